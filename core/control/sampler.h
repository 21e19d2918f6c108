/*
 * sampler.h - each sandbox's resource figures over time (what E2B's per-sandbox metrics
 * return), and the number of sandboxes by state (base/metrics.h: space_sandboxes).
 *
 * Every SP_SAMPLER_INTERVAL_MS one statement lists the sandboxes that are not deleted; each
 * running one that has a VM here (the runtime driver's stats) gets a sample in its ring,
 * which keeps the last SP_SAMPLER_RING samples for as long as the sandbox exists (a paused
 * or suspended sandbox keeps its ring without new samples; a deleted one's ring goes at the
 * next tick). Everything runs on the loop; nothing here blocks.
 *
 * Not here: who may read whose figures (svc.h checks), their E2B shape (e2b-gateway/).
 */
#ifndef SP_SAMPLER_H
#define SP_SAMPLER_H

#include <stddef.h>
#include <stdint.h>

#include "core/runtime/driver.h"
#include "core/store/store.h"
#include "loop/loop.h"

#define SP_SAMPLER_INTERVAL_MS 5000
#define SP_SAMPLER_RING        720 /* an hour at 5 s */

typedef struct {
    int64_t at_ms; /* wall clock, ms since the epoch */
    int cpu_count;
    double cpu_used_pct;
    uint64_t mem_used_bytes, mem_total_bytes;
    uint64_t disk_used_bytes, disk_total_bytes;
} sp_sample_t;

typedef struct sp_sampler sp_sampler_t;

/* Starts sampling (first tick at once). store and driver are borrowed and must outlive it. */
sp_sampler_t *sp_sampler_create(sp_loop_t *loop, sp_store_t *store, sp_driver_t *driver);
/* Stops; a statement in flight frees it when it returns. NULL does nothing. */
void sp_sampler_destroy(sp_sampler_t *s);

/*
 * Copies the samples of sandbox id taken between start_s and end_s (unix seconds, inclusive;
 * 0: unbounded) into out, oldest first, at most cap (the most recent ones); returns how many.
 * A sandbox without any sample yet whose VM runs here gets its first one now, so a sandbox
 * asked about right after it started has a figure.
 */
size_t sp_sampler_get(sp_sampler_t *s, const char *id, int64_t start_s, int64_t end_s,
                      sp_sample_t *out, size_t cap);

#endif
