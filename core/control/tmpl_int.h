/*
 * tmpl_int.h - what the files of the template module (core/control/tmpl.h) share: a build in
 * memory (struct build) and its waiters, the module's state, and the functions one file calls
 * in another.
 *
 *   tmpl.c     requests and their validation, the build records and ?wait= waiters, reserve,
 *              logs, delete, start-up (what a previous process left), creation and free
 *   tmplrun.c  a build's course: the queue, the builder VM (boot, steps, copy steps, the env
 *              file, pause, export), an image parent's pull, the step cache hook, committing
 *              the new version, its template snapshot, the log and the final record
 *   tmplver.c  versions and tags: which version `current` follows, moving and removing tags,
 *              listing versions, collecting the versions nothing uses
 *
 * A build in memory exists from its accepted request until its record says how it ended; its
 * phase says which one asynchronous call is in flight (at most one), so a failure or the time
 * limit only marks it failed and the in-flight call's callback takes it on to tear-down:
 * destroy the builder if one was booted, then record the failure.
 *
 * Everything runs on the loop thread but an image pull's job (struct impjob, a worker). For
 * core/control/tmpl*.c only.
 */
#ifndef SP_TMPL_INT_H
#define SP_TMPL_INT_H

#include <limits.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "base/buf.h"
#include "base/ids.h"
#include "core/channel/exec.h"
#include "core/control/ociimg.h"
#include "core/control/tmpl.h"
#include "core/control/tmplfiles.h"
#include "core/runtime/qemu.h"
#include "guest/tmplbuild.h"

/* A timestamp column as the API's ISO 8601 text (UTC, milliseconds). */
#define SP_TMPL__TS(x) "to_char((" x ") AT TIME ZONE 'UTC', 'YYYY-MM-DD\"T\"HH24:MI:SS.MS\"Z\"')"
#define SP_TMPL_SEED_PREFIX "bs-" /* the snapshots template snapshots are made from */
#define SP_TMPL__TAIL_MAX 2048 /* bytes of a failed step's output quoted in the error */

enum phase {
    P_ACCEPT = 0, /* the INSERT of its record in flight */
    P_QUEUED,
    P_IMPORT,  /* a container image being pulled on a worker thread (ociimg.h) */
    P_BOOT,    /* driver boot in flight */
    P_EXEC,    /* an exec (step, env file, sync) in flight */
    P_PAUSE,   /* driver pause in flight */
    P_EXPORT,  /* driver export_disk in flight */
    P_SEED,    /* the snapshot of the builder its template snapshot is made from in flight */
    P_DESTROY, /* driver destroy in flight */
    P_TSNAP,   /* template snapshot in flight */
    P_CKPT,    /* a step cache snapshot of the builder in flight */
    P_RECORD,  /* the final UPDATE in flight */
};

struct waiter {
    struct waiter *next;
    struct build *b; /* the build it waits on here (NULL for a remote one) */
    sp_tmpl_t *t;
    sp_auth_t auth;
    char name[65], id[SP_TMPL_ID_MAX + 1];
    sp_tmpl_build_cb cb;
    void *arg;
    sp_timer_t timer;
    sp_timer_t retry; /* a remote waiter's read that failed is tried again */
    bool remote;   /* on a build another node runs: in sp_tmpl.remote (tmpl.c) */
    bool checking; /* a remote waiter's read of the record is in flight */
    bool recheck;  /* a NOTIFY came during it: its answer may predate the change */
    bool expired;  /* its time ran out during it */
};

struct impjob;

struct build {
    struct build *next;
    sp_tmpl_t *t;
    char id[SP_TMPL_ID_MAX + 1];
    char team[SP_ID_LEN + 1];
    char name[65];
    char parent[65];
    char parent_ref[64 + 1 + 65]; /* what the builder boots: parent, or parent@version when
                                   * the request named a tag (build_tagged) */
    char vm_id[32];
    char hash[SP_TMPLBUILD_HASH_LEN + 1];
    sp_tmplbuild_paths_t pp; /* the parent's current version */
    json_t *req;             /* the request as validated (owned) */
    json_t *env;             /* env the steps set so far (owned) */
    char user[40];
    char workdir[SP_EXEC_PATH_MAX + 1];
    int cpu_count, memory_mb, timeout_s, ready_s;
    char snapshot[65]; /* from a sandbox snapshot: the builder starts from it; "" if not */
    int disk_mb;  /* asked for: the builder's disk is grown to it first; 0: the parent's */
    bool growing; /* the exec in flight grows the builder's filesystem (grow_disk) */
    bool grown;
    bool force;
    enum phase ph;
    bool vm_up;  /* a builder VM may exist: destroy it at the end */
    bool failed; /* tear down, then record error */
    bool cached;
    bool swapped;    /* current points at the new version */
    bool tags_given; /* the request named tags (a reserved build keeps its reservation's) */
    char prev_current[SP_TMPLBUILD_HASH_LEN + 1]; /* "" when there was none */
    int failed_step;
    char error[1024];
    size_t step;    /* index of the step running or next */
    bool finishing; /* the steps are done: the env file and sync are running */
    sp_exec_t *op;
    int copy_fd;       /* a copy step's files being written into the builder, or -1 */
    uint8_t *copy_buf; /* a chunk of them the agent has not taken yet */
    size_t copy_off, copy_len;
    sp_buf_t line[2]; /* a partial output line per stream */
    char tail[SP_TMPL__TAIL_MAX];
    size_t tail_len;
    int log_fd;
    uint64_t log_bytes;
    bool log_capped;
    long long size_bytes; /* the new version's image on disk, once written; -1 before */
    sp_timer_t deadline;
    uint64_t t0;
    uint64_t ckpt_ms; /* when the builder came up or last got a step cache snapshot */
    uint64_t ckpt_start_ms; /* when the step cache snapshot in flight was asked for */
    sp_qemu_tsnap_info_t tsnap;
    char seed[80]; /* that snapshot ("bs-<pid>-<vm_id>"), "" when none; deleted at the end */
    struct waiter *waiters;
    char *image;               /* from {"image"}: the reference, or NULL (owned) */
    char *reg_user, *reg_pass; /* its registry credentials, until the pull (owned, wiped) */
    char *reg_secret;          /* or the team secret holding the password (owned): opened
                                * just before the pull */
    struct impjob *imp;        /* the import in flight */
};

/* An import on a worker thread; b is NULL once the build is gone. */
struct impjob {
    struct build *b;
    sp_work_t *work;
    sp_ociimg_opts_t opts;
    char data_dir[PATH_MAX];
    char *ref, *user, *pass;
    int rc;
    sp_err_t err;
    sp_ociimg_result_t res;
};

struct sp_tmpl {
    sp_tmplfiles_t *files;
    sp_loop_t *loop;
    sp_store_t *store;
    sp_driver_t *driver;
    char data_dir[PATH_MAX];
    struct build *builds;            /* accepted, not yet recorded as ended; oldest last */
    struct waiter *remote;           /* ?wait= on builds another node runs (tmpl.c) */
    struct sp_tmpl__sweep *sweep;    /* the published versions' listing in flight (tmplver.c) */
    struct judge *judges;            /* versions being judged off the loop (tmplver.c) */
    struct sp_tmpl__imgs *imgs;      /* the images' collection in flight (tmplver.c) */
    char *agent, *mirror, *insecure; /* sp_tmpl_set_images (owned) */
    uint64_t image_max;
    struct sp_secrets *secrets; /* sp_tmpl_set_secrets (borrowed); NULL: none */
    struct sp_egress *egress;   /* sp_tmpl_set_egress (borrowed); NULL: none */
    char shared_dir[PATH_MAX];  /* sp_tmpl_set_shared_dir; "": none (one node) */
    char wid[65];               /* this node's worker (sp_tmpl_create); "": runs no builds */
    uint64_t ckpt_cost_ms;      /* what the last step cache snapshot took (0: none yet) */
    uint64_t cache_ttl_s;       /* sp_tmpl_set_build_cache */
    sp_timer_t collect_timer;   /* collects versions and images now and then (tmpl.h) */
    sp_timer_t images_timer;    /* sp_tmpl__collect_images: the pass asked for */
};

#define SP_TMPL_IMAGES_AFTER_MS 250

/* A request about a template's name answered with done or an error (delete, tags delete). */
struct sp_tmpl__namereq {
    sp_tmpl_t *t;
    char name[65];
    /* The answer's one row read: NULL when it did what was asked (then the template's unused
     * versions are collected), else e filled and returned. */
    const sp_err_t *(*judge)(struct sp_tmpl__namereq *q, const PGresult *res, sp_err_t *e);
    sp_svc_done_cb cb;
    void *arg;
};

/* ---- tmpl.c ---- */

/* Copies src (NULL: "") into dst, cut to cap - 1 bytes. */
void sp_tmpl__copy(char *dst, size_t cap, const char *src);
/* snprintf into out; -1 when it does not fit. */
int sp_tmpl__pathf(char *out, size_t n, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
/* Removes path and everything under it off the loop (loop/discard.h): path is moved into
 * <data>/templates/.trash at once (gone for every reader when this returns) and unlinked on a
 * worker thread, since a version's files may be gigabytes. What a stop leaves there goes at
 * the next start. Where it cannot be moved, it is removed here (base/rmtree.h). */
void sp_tmpl__discard(sp_tmpl_t *t, const char *path);
/* A Unix user name: [a-z_][a-z0-9_-]*, at most 32. */
bool sp_tmpl__valid_user(const char *u);
/* Sends sql (which answers one row) for a request about name; judge reads the row, then cb gets
 * done or the error. -1 with err when it cannot be sent (cb is never called then). */
int sp_tmpl__namereq_send(sp_tmpl_t *t, const char *sql, int n, const char *const *p,
                          const char *name,
                          const sp_err_t *(*judge)(struct sp_tmpl__namereq *q, const PGresult *res,
                                                   sp_err_t *e),
                          sp_svc_done_cb cb, void *arg, sp_err_t *err);
/* Reads w's build record and answers w's caller; stops w's timer and frees w. */
void sp_tmpl__waiter_answer(struct waiter *w);
/* Sets b->hash: SHA-256 of the parent's version and the inputs that shape the image and its
 * snapshot. */
void sp_tmpl__input_hash(struct build *b);

/* ---- tmplrun.c ---- */

/* Unlinks b from its template's builds and frees it (its waiters are the caller's). */
void sp_tmpl__build_free(struct build *b);
/* Starts queued builds while the limits (SP_TMPL_BUILDS, SP_TMPL_TEAM_BUILDS) allow. */
void sp_tmpl__start_queued(sp_tmpl_t *t);
/* A build's time limit (its deadline timer's callback). */
void sp_tmpl__on_deadline(sp_timer_t *tm, void *arg);

/* ---- tmplver.c ---- */

/* Points <name>/current at hash (symlink then rename: atomic); NULL or "" removes it. */
int sp_tmpl__set_current(const sp_tmpl_t *t, const char *name, const char *hash);
/* Removes name's versions nothing uses (tmpl.h: versions). Asynchronous; logged. */
void sp_tmpl__collect(sp_tmpl_t *t, const char *name);
/* sp_tmpl__collect for every team template; -1 when the query could not be sent. */
int sp_tmpl__collect_all(sp_tmpl_t *t, sp_err_t *err);
/* On a worker with a shared snapshot dir: removes the versions published there (shared.c's
 * templates/<name>/<hash>/) that nothing in the fleet uses, with their rows (tmplver.c says
 * what "uses" is). Asynchronous: the shared dir is listed and its versions removed off the
 * loop, one statement per candidate; logged. */
void sp_tmpl__collect_shared(sp_tmpl_t *t);
/* Lets go of a sweep of the published versions in flight (its job is cancelled). */
void sp_tmpl__sweep_free(sp_tmpl_t *t);
/* Lets go of the judgements of versions in flight (sp_tmpl__collect; their jobs cancelled). */
void sp_tmpl__judges_free(sp_tmpl_t *t);
/* Lets go of the images' collection in flight (its job cancelled, its locks released). */
void sp_tmpl__imgs_free(sp_tmpl_t *t);
/* Where removed published versions go (<snapshot-dir>/templates/.trash) until the worker that
 * moved them has unlinked them; what a worker did not finish, the next to start finishes. */
#define SHARED_TRASH ".trash"
/* How often the versions and the build cache are looked over (tmpl.c's collect timer). */
uint64_t sp_tmpl__collect_period_ms(const sp_tmpl_t *t);
/* Removes the images of the digest cache (ociimg.h) nothing uses and nobody built from for
 * cache_ttl_s (tmpl.h: sp_tmpl_set_build_cache); nothing while an import is in flight. One
 * pass SP_TMPL_IMAGES_AFTER_MS later, for all the calls until then (a collection of every
 * template asks once per template that lost versions). */
void sp_tmpl__collect_images(sp_tmpl_t *t);
/* images_timer's callback: the pass sp_tmpl__collect_images asked for. */
void sp_tmpl__on_images_timer(sp_timer_t *tm, void *arg);

#endif
