/*
 * poolpolicy.c - the spare pool's targets (poolpolicy.h): per size, the recent creates, the
 * level they asked for and when it decays; the memory budget shared out among sizes.
 *
 * Does not count or touch spares: the caller does, and asks.
 */
#include "core/runtime/poolpolicy.h"

#include <stdlib.h>
#include <string.h>

#define RECENT_MAX                                                                                 \
    SP_POOLPOLICY_PER_SIZE_MAX /* creates remembered per size: a level never                       \
                                * needs more */

struct size {
    struct size *next; /* most recently created first */
    char key[SP_POOLPOLICY_KEY_MAX + 1];
    uint64_t cost_mb;            /* one spare of it */
    uint64_t recent[RECENT_MAX]; /* ring of create times, ms */
    int nrecent, head;           /* head: where the next one goes */
    int level;                   /* spares its creates asked for, >= 1 */
    uint64_t decay_at;           /* the level falls by a quarter at this time (ms) */
};

struct sp_poolpolicy {
    sp_poolpolicy_opts_t o;
    uint64_t limit_mb; /* sp_poolpolicy_limit's */
    struct size *sizes;
};

sp_poolpolicy_t *sp_poolpolicy_create(const sp_poolpolicy_opts_t *o)
{
    if (o->max_per_size < 1 || o->max_per_size > SP_POOLPOLICY_PER_SIZE_MAX)
        return NULL;
    sp_poolpolicy_t *p = calloc(1, sizeof(*p));
    if (p == NULL)
        return NULL;
    p->o = *o;
    p->limit_mb = UINT64_MAX;
    if (p->o.window_ms == 0)
        p->o.window_ms = 10000;
    if (p->o.decay_ms == 0)
        p->o.decay_ms = 60000;
    return p;
}

void sp_poolpolicy_destroy(sp_poolpolicy_t *p)
{
    if (p == NULL)
        return;
    while (p->sizes != NULL) {
        struct size *s = p->sizes;
        p->sizes = s->next;
        free(s);
    }
    free(p);
}

static struct size **find(sp_poolpolicy_t *p, const char *key)
{
    struct size **pp = &p->sizes;
    while (*pp != NULL && strcmp((*pp)->key, key) != 0)
        pp = &(*pp)->next;
    return pp;
}

static const struct size *cfind(const sp_poolpolicy_t *p, const char *key)
{
    const struct size *s = p->sizes;
    while (s != NULL && strcmp(s->key, key) != 0)
        s = s->next;
    return s;
}

int sp_poolpolicy_create_seen(sp_poolpolicy_t *p, const char *key, uint64_t now_ms,
                              uint64_t cost_mb)
{
    sp_poolpolicy_tick(p, now_ms);
    struct size **pp = find(p, key), *s = *pp;
    if (s != NULL) {
        *pp = s->next;
    } else {
        if (strlen(key) > SP_POOLPOLICY_KEY_MAX || (s = calloc(1, sizeof(*s))) == NULL)
            return -1;
        strcpy(s->key, key);
        s->cost_mb = cost_mb > 0 ? cost_mb : 1;
        s->level = 1;
    }
    s->next = p->sizes;
    p->sizes = s;
    s->recent[s->head] = now_ms;
    s->head = (s->head + 1) % RECENT_MAX;
    if (s->nrecent < RECENT_MAX)
        s->nrecent++;
    /* the creates of the last window, this one included: the burst so far */
    int burst = 0;
    for (int i = 0; i < s->nrecent; i++) {
        uint64_t t = s->recent[(s->head - 1 - i + RECENT_MAX) % RECENT_MAX];
        if (now_ms - t >= p->o.window_ms)
            break; /* newest first: the rest are older */
        burst++;
    }
    if (burst > s->level)
        s->level = burst;
    s->decay_at = now_ms + p->o.decay_ms; /* not idle */
    return 0;
}

void sp_poolpolicy_measured(sp_poolpolicy_t *p, const char *key, uint64_t mb)
{
    struct size *s = *find(p, key);
    if (s != NULL && mb > 0)
        s->cost_mb = mb;
}

void sp_poolpolicy_forget(sp_poolpolicy_t *p, const char *key)
{
    struct size **pp = find(p, key), *s = *pp;
    if (s != NULL) {
        *pp = s->next;
        free(s);
    }
}

void sp_poolpolicy_tick(sp_poolpolicy_t *p, uint64_t now_ms)
{
    for (struct size *s = p->sizes; s != NULL; s = s->next) {
        while (s->level > 1 && now_ms >= s->decay_at) {
            int drop = s->level / 4;
            s->level -= drop > 0 ? drop : 1;
            s->decay_at += p->o.decay_ms;
        }
    }
}

int sp_poolpolicy_target(sp_poolpolicy_t *p, const char *key, uint64_t now_ms)
{
    sp_poolpolicy_tick(p, now_ms);
    /* the budget goes to the most recently created sizes first */
    uint64_t left = sp_poolpolicy_budget(p);
    for (const struct size *s = p->sizes; s != NULL; s = s->next) {
        uint64_t n = (uint64_t)(s->level < p->o.max_per_size ? s->level : p->o.max_per_size);
        if (n * s->cost_mb > left)
            n = left / s->cost_mb;
        if (strcmp(s->key, key) == 0)
            return (int)n;
        left -= n * s->cost_mb;
    }
    return 0;
}

uint64_t sp_poolpolicy_cost(const sp_poolpolicy_t *p, const char *key)
{
    const struct size *s = cfind(p, key);
    return s != NULL ? s->cost_mb : 0;
}

bool sp_poolpolicy_fits(const sp_poolpolicy_t *p, const char *key, uint64_t used_mb)
{
    const struct size *s = cfind(p, key);
    uint64_t b = sp_poolpolicy_budget(p);
    return s != NULL && used_mb <= b && s->cost_mb <= b - used_mb;
}

void sp_poolpolicy_limit(sp_poolpolicy_t *p, uint64_t mb)
{
    p->limit_mb = mb;
}

uint64_t sp_poolpolicy_budget(const sp_poolpolicy_t *p)
{
    return p->o.budget_mb < p->limit_mb ? p->o.budget_mb : p->limit_mb;
}
