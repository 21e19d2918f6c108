/*
 * tmplbuild.h - builds templates: guest kernel, initramfs and a template's
 * read-only base root filesystem, cached by the hash of their inputs.
 *
 * Folder: guest/ makes what a VM boots: template images, kernel and initramfs, boot arguments.
 * (ARCHITECTURE.md: the layers.)
 *
 * Owns everything below <data-dir>/images and <data-dir>/templates. Does not
 * make per-sandbox overlays, boot VMs or take snapshots (the runtime does);
 * guest/bootargs.h has the kernel command line and QEMU flags to boot what
 * this builds. Blocking: meant for the CLI and start-up, never a request path.
 * The heavy lifting is in shell scripts (guest/scripts/) compiled into the
 * binary and written to a temp dir to run; they need apt-get, dpkg-deb,
 * mmdebstrap, mkfs.ext4, qemu-img, xz, busybox-static, and root.
 *
 * Data-directory layout:
 *
 *   <data-dir>/images/kernel/<kver>/          kver = "<abi>_<debian version>",
 *       vmlinux                                 e.g. 6.1.0-57-amd64_6.1.192-3;
 *       modules/<name>.ko                       ELF with PVH note; uncompressed
 *       modules.load                            modules and their load order;
 *       release                                 uname -r
 *   <data-dir>/images/initramfs-<key>.img      newc cpio; key: first 16 hex of
 *                               SHA-256(kernel version, init, its build
 *                               script, host busybox)
 *   <data-dir>/templates/<name>/
 *       <hash>/rootfs.qcow2     read-only base (mode 0444): ext4 in qcow2,
 *                               sandboxes get a qcow2 overlay over it
 *       <hash>/manifest.json    {"name","hash","kernel_version","kernel",
 *                               "initramfs","rootfs" (paths relative to the
 *                               data dir),"cpu_count","memory_mb","disk_mb",
 *                               "code_interpreter" (bool),"code_sha256" (the
 *                               daemon's, or null),"warmup" (argv array or
 *                               null),"rootfs_bytes","built_at","build_seconds",
 *                               "spec"}
 *       current -> <hash>       swapped atomically (symlink + rename) when a
 *                               build is complete
 *       build.log               output of the last build that ran scripts
 *       .lock                   flock: one build of a template at a time
 *   <data-dir>/images/kernel/.resolved   last "which kernel would apt pick",
 *                               keyed by the mtime of apt's lists dir
 *   <data-dir>/tmp/<name>@XXXXXX/   work dir of a running build; a killed
 *                               build leaves it (removed by the next build of
 *                               <name>) but never a partial <hash> or current.
 *
 * <hash> is the SHA-256 (hex) of: the canonical spec JSON, every builder
 * script, the agent binary's SHA-256, the kernel version and, when the spec
 * asks for code_interpreter, the code daemon (guest/code/space-code, compiled
 * in like the scripts). Old <hash> dirs are kept: running sandboxes' overlays
 * point at them. Template snapshots (core/runtime/qemu.h) live in snapshot-* dirs
 * inside a <hash> dir; the runtime owns and removes those.
 */
#ifndef SP_TMPLBUILD_H
#define SP_TMPLBUILD_H

#include <stdbool.h>
#include <stddef.h>

#include "base/err.h"

#define SP_TMPLBUILD_HASH_LEN    64                          /* hex chars */
#define SP_TMPLBUILD_WARMUP_MAX  32                          /* warmup argv entries */
#define SP_TMPLBUILD_WARMUP_ARG  4096                        /* bytes in one warmup argv entry */
#define SP_TMPLBUILD_CODE_DAEMON "/usr/local/bin/space-code" /* where code_interpreter puts it */
#define SP_TMPLBUILD_FILES_MAX   32                          /* "files" entries */
#define SP_TMPLBUILD_FILE_BYTES  65536                       /* bytes of one file's content */
#define SP_TMPLBUILD_FILE_PATH   1024                        /* bytes of one file's path */

typedef struct {
    char *name;
    unsigned uid;
    char *home;
    char *shell;
    int sudo; /* passwordless sudo */
} sp_tmplbuild_user_t;

/* A file the spec writes into the image after its packages are installed. */
typedef struct {
    char *path; /* absolute, normalized (no '.', '..' or empty components) */
    char *content;
    size_t len;
    unsigned mode; /* 0..07777 */
} sp_tmplbuild_file_t;

/* A parsed template.json (templates/README.md). Owned by the caller. */
typedef struct {
    char *name;
    char *description;
    char *suite;
    char *variant;
    char *hostname;
    char **packages;
    size_t n_packages;
    sp_tmplbuild_user_t *users;
    size_t n_users;
    int agent;            /* install /usr/local/bin/space-agent */
    int code_interpreter; /* install the code daemon as /usr/local/bin/space-code */
    char **warmup;        /* argv the template-snapshot builder runs before the snapshot, */
    size_t n_warmup;      /* or NULL/0; at most SP_TMPLBUILD_WARMUP_MAX entries */
    sp_tmplbuild_file_t *files; /* written into the image as root, in order, after */
    size_t n_files;             /* packages and users; at most SP_TMPLBUILD_FILES_MAX */
    int cpu_count;
    int memory_mb;
    int disk_mb;
    char *canonical; /* the spec as compact JSON with sorted keys: what is hashed */
} sp_tmplbuild_spec_t;

/* A template name: [a-z0-9][a-z0-9._-]*, at most 63 characters (it names a directory). */
bool sp_tmplbuild_valid_name(const char *s);
/* min to max bytes of [a-z0-9] and the characters in more, the first of [a-z0-9] (names,
 * Debian packages; guest/tmplname.c). */
bool sp_tmplbuild__valid_word(const char *s, size_t min, size_t max, const char *more);

/* Parses and validates a spec; *out is freed with sp_tmplbuild_spec_free(). */
int sp_tmplbuild_spec_parse(const char *json, size_t len, sp_tmplbuild_spec_t **out, sp_err_t *err);
void sp_tmplbuild_spec_free(sp_tmplbuild_spec_t *s);

/* The text of template <name>: <templates_dir>/<name>/template.json if
 * templates_dir is not NULL, else the copy compiled into the binary.
 * Returns a malloc'd NUL-terminated string (length in *len) or NULL. */
char *sp_tmplbuild_spec_load(const char *templates_dir, const char *name, size_t *len,
                             sp_err_t *err);

/* Names of the templates compiled in, NULL-terminated, static. */
const char *const *sp_tmplbuild_builtin_names(void);

/* The build cache key (see top of file) into out[65]. agent_sha256 is the hex
 * SHA-256 of the agent binary, or NULL when the spec installs none. */
void sp_tmplbuild_input_hash(const sp_tmplbuild_spec_t *spec, const char *agent_sha256,
                             const char *kernel_version, char out[SP_TMPLBUILD_HASH_LEN + 1]);

/* Hex SHA-256 of a file into out[65]. */
int sp_tmplbuild_file_sha256(const char *path, char out[SP_TMPLBUILD_HASH_LEN + 1], sp_err_t *err);

/* Where the files of one build are (absolute when data_dir is). */
typedef struct {
    char hash[SP_TMPLBUILD_HASH_LEN + 1];
    char kernel_version[128];
    char build_dir[4096]; /* <data-dir>/templates/<name>/<hash> */
    char rootfs[4096];    /* read-only base: qcow2 */
    char manifest[4096];
    char kernel[4096]; /* vmlinux */
    char initramfs[4096];
    int cpu_count;
    int memory_mb;
    int disk_mb;
    int code_interpreter; /* the image has the code daemon (SP_TMPLBUILD_CODE_DAEMON) */
    int warmup;           /* the manifest has a warmup command (read it from "warmup") */
} sp_tmplbuild_paths_t;

/* Pure layout: fills build_dir, rootfs, manifest and kernel for the given
 * hash and kernel version (initramfs is named by content: known only from a
 * manifest). -1 with SP_EINVAL when a path would not fit. */
int sp_tmplbuild_paths(const char *data_dir, const char *name, const char *hash,
                       const char *kernel_version, sp_tmplbuild_paths_t *out, sp_err_t *err);

/* The current build of template <name>, read from its manifest: what the
 * runtime boots. -1 with SP_ENOTFOUND when the template was never built.
 * <name>@<hash> names one version of it instead, current or not (a sandbox
 * created from a tag other than the one `current` follows, core/control/tmpl.h):
 * SP_ENOTFOUND when that version is not on disk. */
int sp_tmplbuild_current(const char *data_dir, const char *name, sp_tmplbuild_paths_t *out,
                         sp_err_t *err);

/* Version <name>@<hash> of a template built on another worker, made usable in data_dir from
 * shared_dir, the snapshot dir every worker shares (core/runtime/qemu.h: opts.snapshot_dir),
 * where the worker that built it published it (<shared>/templates/<name>/<hash>/: its
 * manifest.json beside rootfs.qcow2). Its manifest is copied; its image, and the kernel and
 * initramfs it names when this data dir has none, are hard links to the published files (a
 * symlink where the file systems differ): never copies. The version appears whole or not at
 * all (a directory renamed into place); 0 at once when it is here already. SP_ENOTFOUND
 * when it is not published. Blocking, small: a file read and a few links. */
int sp_tmplbuild_import(const char *data_dir, const char *shared_dir, const char *name,
                        const char *hash, sp_err_t *err);

/* sp_tmplbuild_current, but a version ("name@hash") this data dir lacks is imported from
 * shared_dir first (sp_tmplbuild_import; NULL or "": none, as sp_tmplbuild_current). */
int sp_tmplbuild_find(const char *data_dir, const char *shared_dir, const char *name,
                      sp_tmplbuild_paths_t *out, sp_err_t *err);

typedef struct {
    const char *name;          /* template name */
    const char *templates_dir; /* spec dir override; NULL: compiled-in specs */
    const char *spec_json;     /* spec text to use instead of either; NULL: load by name */
    const char *data_dir;
    const char *agent_path;     /* guest agent binary; required when the spec says agent */
    const char *kernel_version; /* NULL: what apt would install now (offline: the newest cached) */
    int force;                  /* rebuild even when the cache is valid */
    int progress;               /* 1: progress on stderr (redrawn on a tty, lines otherwise) */
} sp_tmplbuild_opts_t;

/* Builds (or finds cached) template o->name and makes it current. Fills *out
 * (may be NULL) with the current build's paths. Blocks for the duration:
 * seconds cached, about a minute cold. A failure leaves the previous
 * current untouched and the scripts' output in templates/<name>/build.log. */
int sp_tmplbuild_run(const sp_tmplbuild_opts_t *o, sp_tmplbuild_paths_t *out, sp_err_t *err);

#endif
