/*
 * poolpolicy.h - how many spare clones to keep of each template size: the decision of the
 * spare pool (qemu/pool.c), apart from QEMU, the loop and the clock.
 *
 * It is told what happens, each event with its time (monotonic ms, given by the caller): a
 * create of a size (its key), the memory a ready spare of a size was measured to use, a size
 * forgotten; and it answers the number of spares to keep of a size (its target) and whether
 * one more fits in the memory budget. The caller counts its spares, starts one while a size
 * has fewer than its target (when its own CPU rule allows) and drops those beyond it.
 *
 * Demand: a size's level is the largest number of its creates seen within one window
 * (opts.window_ms) since the level last fell, so a burst of N creates, or a steady rate of N
 * per window, asks for N spares before the next one comes. A size idle for opts.decay_ms
 * loses a quarter of its level (at least one) per decay_ms, down to 1, so a large burst's
 * spares go back within a few periods and a small one's one by one: a size created from once
 * keeps one spare, as long as the caller keeps the size. Targets are capped by
 * opts.max_per_size and then by the memory budget, shared out most recently created size
 * first, each spare counted as its size's cost (opts' default for the size until a
 * measurement says otherwise). The budget in force is the lower of opts.budget_mb and the
 * limit the caller last set (what the host can spare now: sp_poolpolicy_limit), so spares
 * give way to sandboxes when memory runs short.
 *
 * Owns nothing but its records; not thread-safe (one loop uses it).
 */
#ifndef SP_POOLPOLICY_H
#define SP_POOLPOLICY_H

#include <stdbool.h>
#include <stdint.h>

typedef struct sp_poolpolicy sp_poolpolicy_t;

typedef struct {
    int max_per_size;   /* spares of one size at most; 1..SP_POOLPOLICY_PER_SIZE_MAX */
    uint64_t budget_mb; /* memory of all spares together at most, MiB; 0: none may be made */
    uint32_t window_ms; /* creates within this long count as one burst; 0: 10 s */
    uint32_t decay_ms;  /* a size idle this long keeps one spare fewer; 0: 60 s */
} sp_poolpolicy_opts_t;

#define SP_POOLPOLICY_KEY_MAX      63  /* longest size key */
#define SP_POOLPOLICY_PER_SIZE_MAX 256 /* largest max_per_size (creates remembered per size) */

/* NULL when out of memory or max_per_size is out of its range. */
sp_poolpolicy_t *sp_poolpolicy_create(const sp_poolpolicy_opts_t *o);
void sp_poolpolicy_destroy(sp_poolpolicy_t *p);

/* A create of size key at now_ms; cost_mb: what a spare of it is counted as until measured
 * (e.g. its guest RAM). Starts tracking the size. -1 when out of memory (nothing changed). */
int sp_poolpolicy_create_seen(sp_poolpolicy_t *p, const char *key, uint64_t now_ms,
                              uint64_t cost_mb);

/* A ready spare of key measured at mb MiB (e.g. its PSS): spares of key count as that from now
 * on. Ignored for an unknown size or mb 0. */
void sp_poolpolicy_measured(sp_poolpolicy_t *p, const char *key, uint64_t mb);

/* Stops tracking key (its target becomes 0). */
void sp_poolpolicy_forget(sp_poolpolicy_t *p, const char *key);

/* Time passes: idle sizes decay. Also done by the calls below that take now_ms. */
void sp_poolpolicy_tick(sp_poolpolicy_t *p, uint64_t now_ms);

/* Spares of key to keep at now_ms: 0 for an unknown size. */
int sp_poolpolicy_target(sp_poolpolicy_t *p, const char *key, uint64_t now_ms);

/* What one spare of key counts as, MiB (0: unknown size). */
uint64_t sp_poolpolicy_cost(const sp_poolpolicy_t *p, const char *key);

/* Whether one more spare of key fits when the spares there are count used_mb. */
bool sp_poolpolicy_fits(const sp_poolpolicy_t *p, const char *key, uint64_t used_mb);

/* The memory the spares may hold now, MiB, whatever opts.budget_mb says (e.g. what the host
 * has available beyond a reserve); UINT64_MAX: no limit but the budget (the initial state). */
void sp_poolpolicy_limit(sp_poolpolicy_t *p, uint64_t mb);

/* The budget in force, MiB: the lower of opts.budget_mb and the limit. */
uint64_t sp_poolpolicy_budget(const sp_poolpolicy_t *p);

#endif
