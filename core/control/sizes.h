/*
 * sizes.h - template snapshots for the sizes users ask for, made before anyone waits for
 * them (issue 19, item 4).
 *
 * The sizes are not recorded apart: they are the sandboxes' own rows (deleted ones stay), so
 * a restart, or another worker, sees them as they are. Every interval (and at start) one
 * statement reads, per template (and version), the sizes (vCPUs, memory) of the sandboxes
 * created from it in the last window_s seconds (not those made from a sandbox snapshot): its
 * per_template most created (ties: the most recently), plus its default size. Each is handed
 * to the runtime driver's prepare (core/runtime/driver.h), which builds the template snapshot
 * of a size that lacks one in the background, one at a time, while the host boots nothing.
 * A create of a size never seen before still builds its own (its operation's progress says
 * so); these are the sizes whose snapshot went missing since (a new template version, a new
 * QEMU, a fresh worker of a fleet) or that were created on another worker.
 *
 * Never blocks the loop: the read is asynchronous, prepare is cheap. Knows no HTTP.
 */
#ifndef SP_SIZES_H
#define SP_SIZES_H

#include <stdint.h>

#include "base/err.h"
#include "core/runtime/driver.h"
#include "core/store/store.h"
#include "loop/loop.h"

typedef struct sp_sizes sp_sizes_t;

#define SP_SIZES_PER_TEMPLATE 4    /* sizes per template besides its default */
#define SP_SIZES_INTERVAL_MS 60000 /* how often the sizes are read */
#define SP_SIZES_WINDOW_S 86400    /* how far back creates count */

typedef struct {
    int per_template;     /* >= 1 */
    uint32_t interval_ms; /* 0: SP_SIZES_INTERVAL_MS */
    uint32_t window_s;    /* 0: SP_SIZES_WINDOW_S */
} sp_sizes_opts_t;

/* Starts reading at once, then every interval. driver (borrowed, outlives it) without prepare:
 * nothing is ever asked. NULL with err when per_template < 1 or out of memory. */
sp_sizes_t *sp_sizes_create(sp_loop_t *loop, sp_store_t *store, sp_driver_t *driver,
                            const sp_sizes_opts_t *o, sp_err_t *err);
/* A read in flight is abandoned (its answer only frees it). NULL does nothing. */
void sp_sizes_destroy(sp_sizes_t *s);

/* Reads again now (one read at a time: during one, another follows it). */
void sp_sizes_kick(sp_sizes_t *s);

typedef struct {
    unsigned rounds;  /* reads answered (failed ones included) */
    unsigned failed;  /* reads the database did not answer */
    unsigned asked;   /* prepare calls, over all rounds */
    unsigned ready;   /* of them, answered 1 (there already) */
    unsigned refused; /* of them, answered -1 */
} sp_sizes_stats_t;

void sp_sizes_stats(const sp_sizes_t *s, sp_sizes_stats_t *out);

#endif
