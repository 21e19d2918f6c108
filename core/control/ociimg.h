/*
 * ociimg.h - container images as template parents: a registry reference pulled
 * with skopeo, unpacked with umoci, made bootable, and kept as a hidden
 * template per image digest.
 *
 * Folder: core/control/ is sandboxes' lifecycle: these operations, states, the
 * controller that reconciles them, API keys. (ARCHITECTURE.md: the layers.)
 *
 * sp_ociimg_import (blocking: tmpl.c runs it on a worker thread) does:
 *
 *   the reference read Docker's way ("ubuntu:22.04" is
 * docker.io/library/ubuntu:22.04; a Docker Hub one goes to the mirror when one
 * is set) -> `skopeo inspect --raw`: the manifest (a list picks linux/amd64),
 * its digest and layer sizes (over the cap: refused)
 *   -> the hidden template "oci.<first 40 hex of the digest>" has a version for
 * this digest, agent and kernel: done ("cached") -> else `skopeo copy` into an
 * OCI layout, every layer checked (tarcheck.h, layer rules: no absolute or ".."
 * names, the unpacked size capped), `umoci raw unpack` (as root: ownership
 * kept; umoci resolves every path inside the root)
 *   -> the tree made bootable: device nodes, FIFOs and sockets removed,
 * space-agent as /usr/local/bin/space-agent, the mount points, /etc/hostname,
 * /etc/hosts, an empty machine-id, user `user` (uid 1000 or the first free one,
 * home /home/user, passwordless sudo when the image has sudo) unless the image
 * has one -> an ext4 image in qcow2 sized for the tree -> <data-dir>/templates/
 *   oci.<..>/<version>/{rootfs.qcow2,manifest.json}, with the `base` template's
 * kernel and initramfs, committed by rename, `current` pointed at it.
 *
 * Every change to the unpacked tree goes through openat2(RESOLVE_IN_ROOT): the
 * image's symbolic links are read inside its root, never on the host.
 *
 * Registries: https, except loopback ones and those listed as insecure (plain
 * http allowed). Credentials reach skopeo in an auth file (mode 0600) in the
 * import's scratch dir, removed when it ends; they are in no argv, log line,
 * manifest or template. Errors name the registry.
 */
#ifndef SP_OCIIMG_H
#define SP_OCIIMG_H

#include <jansson.h>
#include <stdbool.h>
#include <stdint.h>

#include "base/err.h"
#include "loop/loop.h"

#define SP_OCIIMG_MAX_BYTES (8ull << 30) /* default cap on an image, compressed and unpacked */
#define SP_OCIIMG_PREFIX "oci."          /* hidden templates; not a name users may build */

typedef struct {
    const char *agent_path; /* the guest agent put into images (required) */
    const char *mirror;     /* host[:port] for Docker Hub references, or NULL */
    const char *insecure;   /* comma-separated host[:port] reached over plain http,
                               or NULL */
    uint64_t max_bytes;     /* 0: SP_OCIIMG_MAX_BYTES */
} sp_ociimg_opts_t;

/* A reference read Docker's way. */
typedef struct {
    char registry[256]; /* host[:port]; "docker.io" for Docker Hub (or the mirror)
                         */
    char repo[256];     /* library/ubuntu */
    char tag[129];      /* "" when digest is given */
    char digest[72];    /* sha256:<64 hex>, or "" */
    bool mirrored;      /* a Docker Hub reference sent to the mirror */
} sp_ociimg_ref_t;

/* Reads ref (a leading "docker://" is allowed); mirror as in sp_ociimg_opts_t.
 * SP_EINVAL saying what is wrong. Pure. */
int sp_ociimg_parse_ref(const char *ref, const char *mirror, sp_ociimg_ref_t *out, sp_err_t *err);
/* Whether registry (host[:port]) is reached over plain http: loopback, or in
 * insecure. */
bool sp_ociimg_insecure(const char *registry, const char *insecure);
/* The shell line that runs an image's Entrypoint and Cmd as Docker combines
 * them (arrays of strings, either may be NULL), malloc'd; NULL when both are
 * empty. */
char *sp_ociimg_start_cmd(const json_t *entrypoint, const json_t *cmd);

typedef struct {
    char tmpl[80]; /* the hidden template holding the image: oci.<40 hex> */
    char digest[72];
    char ref[600];  /* what was pulled: registry/repo@digest */
    bool cached;    /* found, not pulled */
    json_t *config; /* {"env": {K: V}, "workdir", "user" (the image's USER as a
                     * name; "": root, as Docker runs it), "start_cmd"} (owned; ""
                     * when unset) */
    json_t *log;    /* lines for the build log (owned array of strings) */
    double seconds; /* pull, unpack and image, or the cache look-up */
} sp_ociimg_result_t;

/* Imports ref (see the top). username/password: registry credentials, or NULL.
 * w: the worker job it runs in (its cancellation stops the tools), or NULL. On
 * failure err names the step and the registry; out->log holds what happened so
 * far either way. Free out with sp_ociimg_result_free. Blocks for as long as
 * the pull and unpack take. */
int sp_ociimg_import(const sp_ociimg_opts_t *o, const char *data_dir, const char *ref,
                     const char *username, const char *password, const sp_work_t *w,
                     sp_ociimg_result_t *out, sp_err_t *err);
void sp_ociimg_result_free(sp_ociimg_result_t *r);

#endif
