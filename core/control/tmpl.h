/*
 * tmpl.h - templates built through the API: a team's own template made from an existing one
 * by running steps in a builder VM, then frozen into a new version of the template.
 *
 * Folder: core/control/ is sandboxes' lifecycle: these operations, states, the controller that
 * reconciles them, API keys. (ARCHITECTURE.md: the layers.)
 *
 * A build (POST /v1/templates) names the template, its parent (`from`: a template the team
 * can use), its steps (run a command, set env, workdir or user for the steps after), an
 * optional start_cmd (left running in the template snapshot, so every sandbox starts with it
 * up) and ready_cmd (polled until it exits 0 before the snapshot is taken), and the default
 * size. It runs as:
 *
 *   boot a builder VM ("bld-<build id>") from the parent, snapshot-fast like any create ->
 *   each step through the agent, its output into the build log -> the template's env written
 *   to /etc/space/template.env in the image -> sync -> pause -> the VM's disk exported as a
 *   qcow2 layer over the parent's image, or a standalone image once the parent's chain is
 *   long (driver.h: export_disk) -> the builder destroyed ->
 *   <data-dir>/templates/<name>/<hash>/{rootfs.qcow2,manifest.json} committed by rename ->
 *   `current` swapped to it -> the template snapshot built (with start_cmd started and
 *   ready_cmd passed: the manifest's warmup) -> the templates row and the build marked done.
 *
 * A failure anywhere (a step exiting non-zero: its number, exit code and the end of its
 * output; the time limit; the snapshot's ready_cmd) fails the build, destroys the builder and
 * leaves the previous version in service (`current` is put back if it was swapped). <hash> is
 * the SHA-256 of the parent's version and the build's inputs: a build whose inputs made a
 * version before finishes at once from it ("cached"), unless it says force. Versions are
 * immutable and never removed here: sandboxes' disks keep them as backing files.
 *
 * Builds beyond SP_TMPL_TEAM_BUILDS running for a team (or SP_TMPL_BUILDS on the server)
 * wait, status "queued". A spaced that stops or dies mid-build fails the build at its next
 * start ("the server restarted during the build") and removes the builder VM and work dir.
 *
 * Names: one namespace on the server; a name belongs to the team that first built it (or to
 * everyone: the built-in ones, which are not built or deleted here). Another team's template
 * is SP_ENOTFOUND, exactly like a missing one; building under a name another team holds is
 * SP_ECONFLICT. Deleting hides the name, drops its tags and stops creates from it; running and
 * suspended sandboxes of it are unaffected.
 *
 * Versions and tags: every successful build is an immutable version (template_versions: its
 * hash, the build that made it, its sandboxes' sizes and env). A tag ([a-z0-9._-], not a
 * UUID) names one version; a build names the tags its version gets ("name:tag" and/or
 * "tags"; none: "default"), and tags move (sp_tmpl_tags_set) to another version. "name" alone
 * means "name:default"; `current` on disk follows the default tag, so the runtime keeps the
 * default's template snapshot as before. A sandbox is created from the version its tag names
 * then (sandboxes.template_version; the driver boots "<name>@<hash>", guest/tmplbuild.h) and
 * keeps it when the tag moves, across suspend and wake. A version is kept on disk while a
 * tag, a sandbox not deleted (or a snapshot of one), another version whose image is a layer
 * over it (not one squashed into a standalone image: driver.h image_standalone), or anything
 * of the runtime's (vms/, snapshots/) but spare clones uses it, the template deleted or not;
 * the others are removed, their spare clones dropped first (driver.h template_forget), when a
 * tag moves, when a build ends, when the template is deleted, at start-up, and every 10
 * minutes (a version whose last sandbox went; sooner with a short image cache time below).
 *
 * Logs: <data-dir>/builds/<id>.ndjson (<snapshot-dir>/builds/ on many workers: below), one
 * JSON object per line {"ts","level","step","stream","line"}, capped at SP_TMPL_LOG_MAX bytes
 * (then one line saying so). Does not know HTTP; the native API renders builds and streams logs.
 */
#ifndef SP_TMPL_H
#define SP_TMPL_H

#include <jansson.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "base/err.h"
#include "core/control/svc.h"
#include "core/control/tmplfiles.h"
#include "core/runtime/driver.h"
#include "core/store/store.h"
#include "loop/loop.h"

#define SP_TMPL_STEPS_MAX    200
#define SP_TMPL_TEAM_BUILDS  2
#define SP_TMPL_BUILDS       2
#define SP_TMPL_LOG_MAX      (16u << 20)
#define SP_TMPL_TIMEOUT_S    1800 /* default build time limit */
#define SP_TMPL_DISK_MAX_MB  1048576 /* a template's disk, as its specs allow (tmplbuild.h) */
#define SP_TMPL_TIMEOUT_MAX  (24 * 3600)
#define SP_TMPL_READY_S      60 /* default ready_cmd limit; at most SP_TMPL_READY_MAX */
#define SP_TMPL_READY_MAX    590
#define SP_TMPL_ID_MAX       36 /* a build id: a UUID (older builds: SP_ID_LEN) */
#define SP_TMPL_TAG_MAX      64 /* characters in a tag */
#define SP_TMPL_TAGS_MAX     16 /* tags in one request */
#define SP_TMPL_CACHE_TTL_S  86400 /* unused images and uploaded files are kept a day */

typedef struct sp_tmpl sp_tmpl_t;

typedef struct {
    char id[SP_TMPL_ID_MAX + 1];
    char template_name[65];
    char status[16]; /* waiting (reserved) | queued | building | succeeded | failed */
    char hash[65];   /* the version made (or found, cached); "" until then */
    bool cached;
    int failed_step; /* 1-based; 0 when no step failed */
    char error[1024];
    char created_at[32];
    char started_at[32];  /* "" while queued */
    char finished_at[32]; /* "" while unfinished */
    int cpu_count, memory_mb; /* as asked (0: the parent's) */
} sp_tmpl_build_rec_t;

typedef void (*sp_tmpl_build_cb)(void *arg, const sp_tmpl_build_rec_t *b, const sp_err_t *err);

/* worker_id: this node's worker, which records itself on the builds it accepts
 * (template_builds.worker_id, migration 21); NULL on a node that runs no builds (role api).
 * Fails the builds a previous process of this worker left unfinished, never another worker's
 * (those a lost worker leaves are failed by the fleet's sweep, core/control/fleet.c), and
 * removes their builder VMs and work dirs (asynchronous; logged). driver and store are
 * borrowed and outlive t. */
sp_tmpl_t *sp_tmpl_create(sp_loop_t *loop, sp_store_t *store, sp_driver_t *driver,
                          const char *data_dir, const char *worker_id, sp_err_t *err);
/* Builds in flight are abandoned: their builder VMs are destroyed by the next start. */
void sp_tmpl_destroy(sp_tmpl_t *t);

/*
 * Builds from container images (`from: {"image": "registry/repo:tag", "auth": {"username",
 * "password"}}`, core/control/ociimg.h): the guest agent put into them (NULL: such builds are
 * refused), the registry that Docker Hub references go to instead (NULL: Docker Hub), the
 * registries besides loopback ones reached over plain http (comma-separated host[:port], or
 * NULL), the cap on an image's size (0: SP_OCIIMG_MAX_BYTES). The image is pulled at the
 * build's start (step "base" in its log), its config (Env, WorkingDir, User, Entrypoint and
 * Cmd) read as env, workdir and user steps before the build's own and as its start_cmd
 * unless the build has one; the credentials are used for the pull only.
 */
int sp_tmpl_set_images(sp_tmpl_t *t, const char *agent_path, const char *mirror,
                       const char *insecure, uint64_t max_bytes, sp_err_t *err);

/*
 * The build cache: what builds fetched or were given, kept for the next build.
 * - Images (the digest cache, ociimg.h: a hidden template "oci.<digest>"): kept while a
 *   version of any template is layered on one, a build or the runtime uses it, and for ttl_s
 *   (default SP_TMPL_CACHE_TTL_S) after the last build from it; then removed, and a later
 *   build from it pulls it again. Versions made by an older agent or kernel go once unused.
 * - Uploaded files (tmplfiles.h): kept while a build not yet ended copies them, and for ttl_s
 *   after their last upload, lookup or use; then removed, and asked for again.
 * Looked over every ttl_s / 2 (1 s .. 10 min; template versions too, at the same times),
 * images also when a template's versions are removed.
 */
void sp_tmpl_set_build_cache(sp_tmpl_t *t, uint64_t ttl_s);

/* The team secrets (core/egress/secrets.h, borrowed) a build from an image may take its
 * registry password from: from {"image", "auth": {"username", "password_secret": NAME}}. */
struct sp_secrets;
void sp_tmpl_set_secrets(sp_tmpl_t *t, struct sp_secrets *secrets);

/* The egress proxy (core/egress/egress.h, borrowed) of the VMs this server runs: each
 * builder gets its build's policy there (the request's "egress"; none: the internet) while
 * the build runs, and nothing once it has ended. NULL (no proxy): builders reach nothing. */
struct sp_egress;
void sp_tmpl_set_egress(sp_tmpl_t *t, struct sp_egress *egress);

/* Many workers (core/runtime/qemu.h: opts.snapshot_dir, the snapshot dir they share; copied,
 * NULL or "" for none): builds' logs are written to its builds/ (so that the worker answering
 * for builds after another still reads them; one written before is read from the data dir);
 * uploaded files are kept in its template-files/ (tmplfiles.h), so that a build finds them
 * whichever worker they were uploaded through; a build may run on any worker, so the parent a
 * request names by template name alone is the version the database's default tag names (a built-in
 * template, which has no tags: this host's build of it), as for a create, never this host's
 * `current` link, which moves only with builds made here; and a parent version this host lacks is
 * imported from the snapshot dir (guest/tmplbuild.h: sp_tmplbuild_import) where the worker
 * that built it published it. */
void sp_tmpl_set_shared_dir(sp_tmpl_t *t, const char *dir);

/* The files COPY steps use (tmplfiles.h), owned by t. */
sp_tmplfiles_t *sp_tmpl_files(sp_tmpl_t *t);

/* Validates the request (SP_EINVAL naming the field), records the build and queues it; cb
 * with the build record (status queued) or: SP_ENOTFOUND for a parent the team cannot use,
 * SP_ECONFLICT when the name is another team's or a built-in one, or being built already. */
int sp_tmpl_build(sp_tmpl_t *t, const sp_auth_t *a, const json_t *req, sp_tmpl_build_cb cb,
                  void *arg, sp_err_t *err);

/*
 * E2B's two-step build: reserve a build of name (its sizes now, cpu_count and memory_mb 1.. or
 * 0 for the parent's) and the tags its version gets (NULL or []: "default", or those the
 * request names), then start it with sp_tmpl_build_reserved and the rest of the request.
 * The reservation is a build record with status "waiting" and a fresh UUID for an id; the name
 * is claimed for the team as by a build (SP_ECONFLICT when it is not free).
 */
int sp_tmpl_reserve(sp_tmpl_t *t, const sp_auth_t *a, const char *name, const json_t *tags,
                    int cpu_count, int memory_mb, sp_tmpl_build_cb cb, void *arg, sp_err_t *err);
/*
 * A build request's fields as sp_tmpl_build reads them, without state (no database, no
 * builds in flight, no files), so that tests/fuzz_bodies.c drives it: -1 with SP_EINVAL and
 * why (SP_ENOTFOUND for a parent that cannot exist), else *out with strings borrowed from req.
 * A request "from" a Dockerfile is first made into one from its parent
 * (sp_tmpl_expand_dockerfile). What is checked later, with state: the parent's tag (a version
 * looked up), secrets and images being available, a build of the name in flight, the uploaded
 * files the copy steps name.
 */
typedef struct {
    char name[64];                  /* the template's name, its tag cut */
    bool tags_given;                /* "name:tag" or tags named some */
    const char *description, *start_cmd, *ready_cmd; /* NULL when absent */
    char parent[64];                /* the parent template's name ("base" for an image) */
    const char *parent_tag;         /* "name:tag": the tag (in req); else NULL */
    const char *parent_version;     /* {"template", "version"}: the hash or its start; or NULL */
    const char *image;              /* from {"image"}: the reference, else NULL */
    const char *reg_user, *reg_pass, *reg_secret; /* its registry's credentials, or NULL */
    const json_t *steps;            /* checked; NULL when absent */
    int cpu_count, memory_mb;       /* 0: the parent's */
    int disk_mb;                    /* 0: the parent's (a disk grows, never shrinks) */
    int timeout_s, ready_timeout_s; /* defaults when absent */
    bool force;
} sp_tmpl_build_req_t;

int sp_tmpl_parse_build(const json_t *req, sp_tmpl_build_req_t *out, sp_err_t *err);
/* A request from {"dockerfile", "context"?, "auth"?}: *out a new request (the caller's) with
 * the Dockerfile's parent (a template, or an image with auth's credentials), its steps before
 * the request's own, and its start command unless the request has one. *out NULL for any
 * other request (used as it is); -1 with SP_EINVAL and why for a bad Dockerfile. Pure. */
int sp_tmpl_expand_dockerfile(const json_t *req, json_t **out, sp_err_t *err);

/* sp_tmpl_build of a reserved build id (NULL: a new build, as sp_tmpl_build): SP_ENOTFOUND
 * (through cb) when that build is not the team's waiting one of req's name. */
int sp_tmpl_build_reserved(sp_tmpl_t *t, const sp_auth_t *a, const json_t *req,
                           const char *reserved, sp_tmpl_build_cb cb, void *arg, sp_err_t *err);

/* The build id of template name. wait_ms > 0: answers when it finishes or wait_ms passed, on
 * any node (one that does not run the build learns of its end by NOTIFY SP_TMPL_NOTIFY, sent
 * with the build's id by every statement that ends one). */
#define SP_TMPL_NOTIFY "space_builds"
int sp_tmpl_get_build(sp_tmpl_t *t, const sp_auth_t *a, const char *name, const char *id,
                      uint32_t wait_ms, sp_tmpl_build_cb cb, void *arg, sp_err_t *err);

/* Lines [offset, offset + at most max_lines) of the build's log, as NDJSON text (borrowed for
 * the callback), with the offset after them and whether the build had finished when they were
 * read (then no line will follow). */
typedef void (*sp_tmpl_log_cb)(void *arg, const char *ndjson, size_t len, uint64_t next,
                               bool finished, const sp_err_t *err);
int sp_tmpl_logs(sp_tmpl_t *t, const sp_auth_t *a, const char *name, const char *id,
                 uint64_t offset, size_t max_lines, sp_tmpl_log_cb cb, void *arg, sp_err_t *err);

/* Deletes the team's template name (see the top). SP_ENOTFOUND, SP_ECONFLICT while it is
 * being built, SP_EFORBIDDEN for a built-in template. */
int sp_tmpl_delete(sp_tmpl_t *t, const sp_auth_t *a, const char *name, sp_svc_done_cb cb,
                   void *arg, sp_err_t *err);

/* A tag: 1 to SP_TMPL_TAG_MAX of [a-z0-9._-], not a UUID, not only dots. */
bool sp_tmpl_valid_tag(const char *tag);

/* "name[:tag]" and a list of more tags (NULL or an array) -> name, and the tags in *out (a new
 * array, the name's tag first, no duplicates; none: ["default"]). SP_EINVAL naming what is
 * wrong. */
int sp_tmpl_parse_target(const char *target, const json_t *tags, char name[64], json_t **out,
                         sp_err_t *err);

typedef struct {
    char template_name[65];
    char hash[65];          /* the version the tags name now */
    char build_id[SP_TMPL_ID_MAX + 1]; /* the build that made it */
    char created_at[32];    /* when the tags were moved */
} sp_tmpl_tag_rec_t;
typedef void (*sp_tmpl_tag_cb)(void *arg, const sp_tmpl_tag_rec_t *r, const sp_err_t *err);

/* Points tags (a JSON array of tag names) of the team's template name at a version: the one
 * whose hash starts with version (8 to 64 hex digits), or the one tag from_tag names (exactly
 * one of the two). Moving "default" moves `current` and the template's sizes and env. Then the
 * versions no longer used are removed. SP_EINVAL bad tags; SP_ENOTFOUND no such template (or
 * another team's), version or from_tag ("tag 't' does not exist for template 'x'");
 * SP_ECONFLICT an ambiguous version prefix or a build of name running. */
int sp_tmpl_tags_set(sp_tmpl_t *t, const sp_auth_t *a, const char *name, const json_t *tags,
                     const char *version, const char *from_tag, sp_tmpl_tag_cb cb, void *arg,
                     sp_err_t *err);

/* Removes tags from the team's template name, all or none: SP_EINVAL for "default" (it moves,
 * it is not removed) or a bad tag, SP_ENOTFOUND for a tag that does not exist. */
int sp_tmpl_tags_delete(sp_tmpl_t *t, const sp_auth_t *a, const char *name, const json_t *tags,
                        sp_svc_done_cb cb, void *arg, sp_err_t *err);

/* The team's template name's versions and tags as a JSON document (borrowed for the callback):
 * {"name", "tags": [{tag, version, build_id, created_at}], "versions": [{version, build_id,
 * created_at, cpu_count, memory_mb, tags, sandboxes, size_bytes, on_disk}] newest first,
 * "builds": [{id, status, version, tags, created_at, error}] the 20 newest}. */
typedef void (*sp_tmpl_json_cb)(void *arg, const json_t *doc, const sp_err_t *err);
int sp_tmpl_versions(sp_tmpl_t *t, const sp_auth_t *a, const char *name, sp_tmpl_json_cb cb,
                     void *arg, sp_err_t *err);

#endif
