/*
 * fleet.h - many hosts over one PostgreSQL: a node's part in the fleet of workers.
 *
 * A worker (role all or worker) registers its row in `workers` (core/store/migrate.c, schema
 * 10) as it starts and heartbeats every heartbeat-timeout / 4, keeping the row's templates
 * current (what its driver holds ready template snapshots of, per size: placement prefers it
 * for them, a worker holding the size asked for first). When its heartbeat resumes after
 * it was declared lost, it settles what was placed on it: within the grace it re-adopts each
 * lost sandbox whose VM its driver still has alive; a VM of a sandbox lost past the grace,
 * deleted meanwhile or placed elsewhere since, it stops (fencing: it never runs one twice). A
 * draining worker moves its running and paused sandboxes away: suspend here, then wake placed
 * on another worker. A node serving the API (role all or api) runs the loss sweep under the
 * `leases` row 'fleet' (one node at a time; it acts only in the statement that renewed the
 * lease): a worker whose heartbeat is older than the timeout becomes lost (generation + 1),
 * its running and paused sandboxes observed "lost" (core/control/sandbox.h) with an error and
 * an event; suspended ones are left to wake elsewhere. Placement itself is the database's
 * space_place (migration 11; by size since 17), called by svc's create and wake statements.
 *
 * Also the operator's view (/v1/workers: list, drain, undrain) and the pure parsing of worker
 * labels. Does not claim or act on sandboxes (core/control/recon.h does, for rows placed on its
 * worker), does not forward data-plane traffic, and holds no HTTP.
 */
#ifndef SP_FLEET_H
#define SP_FLEET_H

#include <jansson.h>
#include <stdbool.h>

#include "base/err.h"
#include "core/runtime/driver.h"
#include "core/store/store.h"
#include "loop/loop.h"

typedef struct sp_fleet sp_fleet_t;

typedef enum {
    SP_ROLE_ALL = 0, /* one node: API, controller and VMs (the default) */
    SP_ROLE_API,     /* API only: no driver, no controller */
    SP_ROLE_WORKER,  /* VMs and the controller for its own sandboxes, and the API */
} sp_role_t;

/* "all" | "api" | "worker"; -1 when unknown. */
int sp_fleet_role_parse(const char *s, sp_role_t *out);
const char *sp_fleet_role_name(sp_role_t r);

/* Limits on labels, a worker's (--worker-labels) and a create's placement.labels. */
#define SP_FLEET_MAX_LABELS 16
#define SP_FLEET_MAX_LABEL_LEN 63 /* bytes, key or value */

/* Checks a labels object: at most SP_FLEET_MAX_LABELS string values, keys 1 to
 * SP_FLEET_MAX_LABEL_LEN bytes and values 0 to it, of [A-Za-z0-9._/-]. what names it in the
 * message (SP_EINVAL). */
int sp_fleet_check_labels(const json_t *labels, const char *what, sp_err_t *err);

/* "k=v,k=v" (--worker-labels; "" is none) into a new object, checked as above. NULL with
 * SP_EINVAL when malformed or a key repeats. */
json_t *sp_fleet_parse_labels(const char *text, sp_err_t *err);

typedef struct {
    sp_role_t role;
    const char *worker_id;  /* this node's id (<data-dir>/worker-id) */
    const char *address;    /* host:port other nodes reach this one at */
    int vcpus;              /* offered; 0: no limit */
    int memory_mb;          /* offered; 0: no limit */
    const json_t *labels;   /* object or NULL; borrowed for the call */
    const char *accel_file; /* a file naming the accelerator once known (the QEMU driver's), or
                             * NULL: the driver's name is reported */
    const char *version;
    int heartbeat_timeout_s; /* a worker silent this long is lost (>= 2) */
    int lost_grace_s;        /* a lost worker back within this re-adopts its sandboxes */
} sp_fleet_opts_t;

/* Starts the node's part: registration and heartbeat (role all and worker; driver not NULL),
 * the loss sweep (role all and api). Strings are copied. Registration is sent at once; a
 * database that is down is retried. */
sp_fleet_t *sp_fleet_create(sp_loop_t *loop, sp_store_t *store, sp_driver_t *driver,
                            const sp_fleet_opts_t *o, sp_err_t *err);
void sp_fleet_destroy(sp_fleet_t *f);

/* Whether the node can take sandboxes yet: false on a node that runs them (role all and
 * worker, with a driver) until its first registration is in the database, since placement
 * finds no worker before that; true on every other node. NULL: true. */
bool sp_fleet_ready(const sp_fleet_t *f);

/* The operator's view. workers: an array of objects (id, address, role, state, capacity,
 * used, sandboxes, heartbeat_age_s, labels, ...), borrowed for the callback. id NULL: every
 * worker; else that one (SP_ENOTFOUND when unknown) with its sandboxes and the moves of a
 * drain ("sandboxes", "moved"). */
typedef void (*sp_fleet_workers_cb)(void *arg, json_t *workers, const sp_err_t *err);
int sp_fleet_workers(sp_fleet_t *f, const char *id, sp_fleet_workers_cb cb, void *arg,
                     sp_err_t *err);

/* Drain (no new placements; its running and paused sandboxes move away) or undrain (active
 * again; sandboxes a drain suspended and did not move yet wake here). Either is kept on the
 * row ("drain"): a lost worker stays lost and returns to it when it answers again; while it
 * is lost, the sweep moves what its drain suspended. Calls back with the worker as
 * sp_fleet_workers(id) gives it. SP_ENOTFOUND when unknown. */
int sp_fleet_drain(sp_fleet_t *f, const char *id, bool drain, sp_fleet_workers_cb cb, void *arg,
                   sp_err_t *err);

/* Where a node that runs no VMs (role api) sends the template build requests about template
 * name (a build, its status and log; a tag after ':' ignored; "" for files and reservations):
 * among the active workers
 * with an address and a heartbeat within the timeout, the one whose md5(name/id) sorts first
 * (rendezvous hashing). Builds of different templates spread over the workers; every request
 * about one template goes to the same worker while it lives (its builds queue there, a status
 * request waits on the build itself), and when it is lost or drained only its names move. A
 * build finds its files wherever they were uploaded: workers keep them in the shared snapshot
 * dir (core/control/tmplfiles.h). Calls back with its id and address (borrowed), or SP_EUNAVAIL
 * when there is none. */
typedef void (*sp_fleet_builder_cb)(void *arg, const char *id, const char *address,
                                    const sp_err_t *err);
int sp_fleet_builder(sp_fleet_t *f, const char *name, sp_fleet_builder_cb cb, void *arg,
                     sp_err_t *err);

#endif
