/*
 * recon.h - the controller: moves each sandbox's observed state toward its
 * desired state through the runtime driver, one action at a time.
 *
 * Wakes on NOTIFY space_sandbox (payload "<sandbox id>[ <worker id>]": a notice naming
 * another worker is not its own) and on a timer; claims rows with FOR UPDATE
 * SKIP LOCKED and a lease (worker_id, claim_until), only rows placed on its own
 * worker (sandboxes.worker_id: core/control/fleet.h), and none while its worker
 * is declared lost; rows observed "lost" only to delete them. Each action is recorded before it starts (the
 * transitional observed state) and after it ends; rows found in a
 * transitional state that no live task owns are crash leftovers and are
 * resolved by asking the driver what exists (sp_sandbox_recover). Finishes
 * operations and NOTIFYs space_ops with their IDs.
 */
#ifndef SP_RECON_H
#define SP_RECON_H

#include <stdbool.h>

#include "core/runtime/driver.h"
#include "base/err.h"
#include "loop/loop.h"
#include "core/store/store.h"

/* SQL that wakes the controller of the worker the sandbox row `row` (an alias with id and
 * worker_id) is placed on: NOTIFY space_sandbox with "<id> <worker id>" (other workers leave
 * it to their timer; no worker id wakes them all). */
#define SP_RECON_NOTIFY(row)                                                                       \
    "pg_notify('space_sandbox', " row ".id || ' ' || coalesce(" row ".worker_id, ''))"

typedef struct sp_recon sp_recon_t;

/* worker_id must be stable across restarts of this worker (it reclaims its own rows at once). */
sp_recon_t *sp_recon_create(sp_loop_t *loop, sp_store_t *store, sp_driver_t *driver,
                            const char *worker_id, sp_err_t *err);
/* Whether it also claims rows placed on no worker (made before placement existed, or by an
 * older server): a node of role all does (the default), a worker of a fleet does not. */
void sp_recon_set_unplaced(sp_recon_t *r, bool claim);

/* Stops claiming; actions in flight are abandoned to crash recovery. NULL does nothing. */
void sp_recon_destroy(sp_recon_t *r);

/* Number of actions in flight (for tests and shutdown). */
int sp_recon_busy(const sp_recon_t *r);

#endif
