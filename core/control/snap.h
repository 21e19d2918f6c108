/*
 * snap.h - sandbox snapshots ("forks"): a team's running or paused sandbox frozen (memory with
 * its processes, device state, disk) through the driver's checkpoint, then any number of new
 * sandboxes created from it (svc.h: sp_create_req_t.snapshot_id), each with its own identity.
 *
 * Folder: core/control/ is sandboxes' lifecycle: these operations, states, the controller that
 * reconciles them, API keys. (ARCHITECTURE.md: the layers.)
 *
 * Taking one writes the snapshot row (state "creating") and an operation of kind "snapshot"
 * (its sandbox_id the source, its snapshot_id the new snapshot; recon.c leaves such
 * operations alone) in one statement, then calls the driver's checkpoint in this process; its
 * outcome marks the row ready or failed (with the driver's message) and finishes the
 * operation with NOTIFY space_ops, so sp_svc_get_operation's waits work on it like on any
 * other. The source goes on as it was (a paused one stays paused).
 *
 * Snapshots are per team: another team's is SP_ENOTFOUND, exactly like a missing one. Ids are
 * "snap-" and 16 characters of [a-z0-9]. A name is an optional alias, `alias[:tag]` in
 * E2B's grammar (lower case; alias [a-z0-9_-], tag [a-z0-9_.-]; tag "default" is the same as
 * none and is dropped), unique in the team among snapshots not deleted.
 *
 * Deleting hides the row (deleted_at) and tells the driver (checkpoint_delete), which keeps
 * the files while sandboxes made from the snapshot use them; one still being taken cannot be
 * deleted (SP_ECONFLICT). At start, rows a stopped process left "creating" are failed ("the
 * server restarted while the snapshot was taken") and their files dropped. Knows no HTTP.
 */
#ifndef SP_SNAP_H
#define SP_SNAP_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "base/err.h"
#include "core/control/svc.h"
#include "core/runtime/driver.h"
#include "core/store/store.h"
#include "loop/loop.h"

#define SP_SNAP_ID_LEN   21 /* "snap-" + 16 */
#define SP_SNAP_TEAM_MAX 200 /* snapshots a team may keep (not deleted, not failed) */
#define SP_SNAP_NAME_MAX 64

typedef struct sp_snap sp_snap_t;

typedef struct {
    char id[SP_SNAP_ID_LEN + 1];
    char sandbox_id[65]; /* the source */
    char template_name[65];
    int cpu_count, memory_mb;
    char name[SP_SNAP_NAME_MAX + 1]; /* normalised alias[:tag], "" when none */
    char state[16];                  /* creating | ready | failed */
    char error[256];                 /* "" unless failed */
    char created_at[32];
    long long bytes; /* its files on disk, measured once ready (svc.h: the quota); -1: unknown */
} sp_snap_rec_t;

/* rec and op borrowed for the callback; op NULL except from sp_snap_take. */
typedef void (*sp_snap_cb)(void *arg, const sp_snap_rec_t *rec, const sp_op_rec_t *op,
                           const sp_err_t *err);
typedef void (*sp_snap_list_cb)(void *arg, const sp_snap_rec_t *recs, size_t n,
                                const char *next_cursor /* NULL at the end */,
                                const sp_err_t *err);

/* worker_id: this node's worker id, or NULL on a node that runs no sandboxes (role api).
 * A snapshot is taken by the worker running its sandbox (an API node forwards the request
 * there) and its row names that worker (worker_id): its files are there. It is taken for
 * every worker (driver.h: SP_CKPT_SHARED); when the driver put it in the shared snapshot dir
 * (checkpoint_shared, so on a worker with --snapshot-dir) its row says shared (migration 22)
 * and a create from it goes to that worker when it has room, else to any other, which
 * copies it in; otherwise a create from it is placed only there (svc.c, migration 20). At
 * start a worker fails the snapshots it left "creating" (its own, and rows naming no worker;
 * asynchronously; logged); and every SP_SNAP_RELEASE_MS it releases (the driver's
 * checkpoint_delete) the files it holds of snapshots deleted meanwhile through another node,
 * which could not: its own, its copies of shared ones, and the shared copies themselves.
 * store and driver are borrowed and outlive s. */
#define SP_SNAP_RELEASE_MS 20000
sp_snap_t *sp_snap_create(sp_loop_t *loop, sp_store_t *store, sp_driver_t *driver,
                          const char *worker_id, sp_err_t *err);
/* Snapshots being taken are abandoned: their rows are failed by the next start. */
void sp_snap_destroy(sp_snap_t *s);
/* The snapshot-disk quota for teams without one of their own (MiB; 0: none; until set,
 * SP_SVC_QUOTA_SNAPSHOT_MB): a take is refused with SP_EQUOTA once the team's snapshots hold
 * that much (svc.h: sp_quota_t). A snapshot's size is measured (the driver's
 * checkpoint_bytes) when it is written and kept on its row. */
void sp_snap_set_quota_default(sp_snap_t *s, int snapshot_mb);

/* Whether id has the shape of a snapshot id (checked before any lookup). */
bool sp_snap_valid_id(const char *id);
/* name normalised into out (cap >= SP_SNAP_NAME_MAX + 1): lower case, ":default" dropped;
 * -1 with SP_EINVAL saying why for a bad one. */
int sp_snap_norm_name(const char *name, char *out, size_t cap, sp_err_t *err);

/*
 * Takes a snapshot of the team's sandbox_id, named name (NULL: none). SP_ENOTSUP at once when
 * the runtime has no checkpoint; through cb: SP_ENOTFOUND for a missing or another team's
 * sandbox, SP_ECONFLICT when it is not running or paused (observed and desired), one of
 * it is being taken already, or the team keeps SP_SNAP_TEAM_MAX snapshots. A name in use
 * moves to the new snapshot once it is recorded (the older one keeps its id). Accepted: cb
 * gets the snapshot and its operation at once (wait_ms 0: state creating, operation running),
 * or when it finished or wait_ms passed, whichever is first; the snapshot goes on being taken
 * either way.
 */
int sp_snap_take(sp_snap_t *s, const sp_auth_t *a, const char *sandbox_id, const char *name,
                 uint32_t wait_ms, sp_snap_cb cb, void *arg, sp_err_t *err);

/* The team's snapshot by id, or by normalised name when id is NULL (deleted ones are not
 * found). */
int sp_snap_get(sp_snap_t *s, const sp_auth_t *a, const char *id, const char *name,
                sp_snap_cb cb, void *arg, sp_err_t *err);

/* The team's snapshots not deleted, newest first, of one source sandbox (NULL: all): limit
 * 1..1000, cursor from a previous page (SP_EINVAL when malformed). */
int sp_snap_list(sp_snap_t *s, const sp_auth_t *a, const char *sandbox_id, int limit,
                 const char *cursor, sp_snap_list_cb cb, void *arg, sp_err_t *err);

/* Deletes the team's snapshot id (see the top): SP_ENOTFOUND (also for one deleted before),
 * SP_ECONFLICT while it is being taken. */
int sp_snap_delete(sp_snap_t *s, const sp_auth_t *a, const char *id, sp_svc_done_cb cb,
                   void *arg, sp_err_t *err);

#endif
