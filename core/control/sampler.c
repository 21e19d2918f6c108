/*
 * sampler.c - the rings of samples (a hash of sandbox ids), the periodic tick and the
 * sandboxes-by-state gauge.
 */
#include "core/control/sampler.h"

#include <stdbool.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "base/log.h"
#include "base/metrics.h"
#include "core/control/sandbox.h"

#define NBUCKETS 256u /* power of two */

struct ring {
    char id[65];
    unsigned gen; /* the tick that last saw the sandbox */
    sp_sample_t *v;
    size_t cap, len, head; /* v[(head + i) % cap], i < len, oldest first */
    struct ring *next;
};

struct sp_sampler {
    sp_loop_t *loop;
    sp_store_t *store;
    sp_driver_t *driver;
    sp_timer_t tick;
    bool querying, dying;
    unsigned gen;
    struct ring *buckets[NBUCKETS];
};

static sp_metric_t m_sandboxes = SP_METRIC_GAUGE(
    "space_sandboxes", "Sandboxes that are not deleted, by observed state (all workers).", "state");

static unsigned hash(const char *id)
{
    unsigned h = 2166136261u;
    for (; *id; id++)
        h = (h ^ (unsigned char)*id) * 16777619u;
    return h & (NBUCKETS - 1);
}

static struct ring *ring_find(sp_sampler_t *s, const char *id, bool make)
{
    unsigned b = hash(id);
    for (struct ring *r = s->buckets[b]; r != NULL; r = r->next)
        if (strcmp(r->id, id) == 0)
            return r;
    if (!make || strlen(id) >= sizeof(((struct ring *)0)->id))
        return NULL;
    struct ring *r = calloc(1, sizeof(*r));
    if (r == NULL)
        return NULL;
    strcpy(r->id, id);
    r->gen = s->gen;
    r->next = s->buckets[b];
    s->buckets[b] = r;
    return r;
}

static void ring_free(struct ring *r)
{
    free(r->v);
    free(r);
}

/* Appends one sample; the oldest goes when the ring is full. Grows by doubling up to the
 * ring's size, so a short-lived sandbox costs little. */
static void ring_push(struct ring *r, const sp_sample_t *x)
{
    if (r->len == r->cap && r->cap < SP_SAMPLER_RING) {
        size_t cap = r->cap ? r->cap * 2 : 16;
        if (cap > SP_SAMPLER_RING)
            cap = SP_SAMPLER_RING;
        sp_sample_t *v = malloc(cap * sizeof(*v));
        if (v == NULL)
            return;
        for (size_t i = 0; i < r->len; i++)
            v[i] = r->v[(r->head + i) % r->cap];
        free(r->v);
        r->v = v;
        r->cap = cap;
        r->head = 0;
    }
    if (r->len < r->cap) {
        r->v[(r->head + r->len) % r->cap] = *x;
        r->len++;
    } else {
        r->v[r->head] = *x;
        r->head = (r->head + 1) % r->cap;
    }
}

/* A sample of id's VM now; false when the driver has none here. */
static bool take(sp_sampler_t *s, const char *id, sp_sample_t *x)
{
    sp_vm_stats_t st;
    sp_err_t e;
    memset(&st, 0, sizeof(st));
    if (s->driver == NULL || s->driver->ops->stats == NULL ||
        s->driver->ops->stats(s->driver, id, &st, &e) < 0)
        return false;
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    x->at_ms = (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
    x->cpu_count = st.cpu_count;
    x->cpu_used_pct = st.cpu_used_pct;
    x->mem_used_bytes = st.mem_used_bytes;
    x->mem_total_bytes = st.mem_total_bytes;
    x->disk_used_bytes = st.disk_used_bytes;
    x->disk_total_bytes = st.disk_total_bytes;
    return true;
}

static void on_listed(void *arg, PGresult *res, const sp_err_t *err)
{
    sp_sampler_t *s = arg;
    s->querying = false;
    if (s->dying) {
        sp_sampler_destroy(s);
        return;
    }
    if (err == NULL) {
        s->gen++;
        double counts[SP_OBS__COUNT] = {0};
        for (int i = 0; i < PQntuples(res); i++) {
            const char *id = PQgetvalue(res, i, 0);
            sp_observed_t o;
            if (sp_observed_parse(PQgetvalue(res, i, 1), &o) < 0)
                continue;
            counts[o]++;
            struct ring *r = ring_find(s, id, o == SP_OBS_RUNNING);
            if (r == NULL)
                continue;
            r->gen = s->gen;
            sp_sample_t x;
            if (o == SP_OBS_RUNNING && take(s, id, &x))
                ring_push(r, &x);
        }
        /* Sandboxes the list no longer has are deleted: their rings go. */
        for (unsigned b = 0; b < NBUCKETS; b++) {
            for (struct ring **pp = &s->buckets[b]; *pp != NULL;) {
                struct ring *r = *pp;
                if (r->gen != s->gen) {
                    *pp = r->next;
                    ring_free(r);
                } else {
                    pp = &r->next;
                }
            }
        }
        for (int o = 0; o < SP_OBS__COUNT; o++)
            if (o != SP_OBS_DELETED)
                sp_metrics_set(&m_sandboxes, counts[o], sp_observed_name((sp_observed_t)o));
    }
    sp_timer_start(&s->tick, SP_SAMPLER_INTERVAL_MS);
}

static void on_tick(sp_timer_t *t, void *arg)
{
    sp_sampler_t *s = arg;
    sp_err_t e;
    if (sp_store_query(s->store,
                       "SELECT id, observed_state FROM sandboxes WHERE observed_state <> 'deleted'",
                       0, NULL, on_listed, s, &e) < 0) {
        sp_timer_start(&s->tick, SP_SAMPLER_INTERVAL_MS);
        return;
    }
    s->querying = true;
}

sp_sampler_t *sp_sampler_create(sp_loop_t *loop, sp_store_t *store, sp_driver_t *driver)
{
    sp_sampler_t *s = calloc(1, sizeof(*s));
    if (s == NULL)
        return NULL;
    s->loop = loop;
    s->store = store;
    s->driver = driver;
    sp_metrics_declare(&m_sandboxes);
    sp_timer_init(&s->tick, loop, on_tick, s);
    sp_timer_start(&s->tick, 0);
    return s;
}

void sp_sampler_destroy(sp_sampler_t *s)
{
    if (s == NULL)
        return;
    sp_timer_stop(&s->tick);
    if (s->querying) {
        s->dying = true; /* on_listed frees it */
        return;
    }
    for (unsigned b = 0; b < NBUCKETS; b++) {
        while (s->buckets[b] != NULL) {
            struct ring *r = s->buckets[b];
            s->buckets[b] = r->next;
            ring_free(r);
        }
    }
    free(s);
}

size_t sp_sampler_get(sp_sampler_t *s, const char *id, int64_t start_s, int64_t end_s,
                      sp_sample_t *out, size_t cap)
{
    struct ring *r = ring_find(s, id, false);
    if (r == NULL || r->len == 0) {
        sp_sample_t x;
        if (!take(s, id, &x))
            return 0;
        if ((r = ring_find(s, id, true)) == NULL) {
            if (cap == 0)
                return 0;
            out[0] = x;
            return 1;
        }
        ring_push(r, &x);
    }
    size_t n = 0;
    /* Newest first into out's tail, so that cap keeps the most recent; then moved down. */
    for (size_t i = r->len; i-- > 0 && n < cap;) {
        const sp_sample_t *x = &r->v[(r->head + i) % r->cap];
        int64_t t = x->at_ms / 1000;
        if ((end_s > 0 && t > end_s))
            continue;
        if (start_s > 0 && t < start_s)
            break;
        out[cap - 1 - n] = *x;
        n++;
    }
    if (n < cap)
        memmove(out, out + (cap - n), n * sizeof(*out));
    return n;
}
