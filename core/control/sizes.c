/*
 * sizes.c - the sizes of the last day's creates handed to the driver's prepare (sizes.h).
 *
 * One statement per round, one round at a time; a round's answer is handed out at once
 * (prepare is synchronous and cheap). Owns its timer and, while a read is out, itself: a
 * destroy during one leaves the freeing to its answer.
 */
#include "core/control/sizes.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "base/log.h"

#define SIZES_RETRY_MS 2000 /* until a first read answered: the pool connects as we start */

struct sp_sizes {
    sp_loop_t *loop;
    sp_store_t *store;
    sp_driver_t *driver;
    sp_sizes_opts_t o;
    sp_timer_t timer;
    bool reading, again, dying;
    bool read_once; /* a read was answered */
    sp_sizes_stats_t st;
};

/* Per template: the version a create of its bare name gets now (as svc.c's create reads it: a
 * team's template at its default tag, a built-in one at its current build), with its default
 * size; the sizes created from it (any version) in the window, most created first, at most
 * $2; and its default. The ones created most come first: the driver builds in that order. */
static const char *const sizes_sql =
    "WITH c AS (SELECT s.template AS name, s.cpu_count AS cpus, s.memory_mb AS mem,"
    "  count(*) AS n, max(s.created_at) AS last FROM sandboxes s"
    "  WHERE s.created_at > now() - make_interval(secs => $1::int) AND s.snapshot_id IS NULL"
    "  GROUP BY 1, 2, 3),"
    " r AS (SELECT c.*, row_number() OVER (PARTITION BY c.name ORDER BY c.n DESC, c.last DESC)"
    "  AS k FROM c),"
    " t AS (SELECT m.name, coalesce(v.cpu_count, m.cpu_count) AS cpus,"
    "  coalesce(v.memory_mb, m.memory_mb) AS mem, m.name || coalesce('@' || v.hash, '') AS tkey"
    "  FROM templates m"
    "  LEFT JOIN template_tags g ON g.template = m.name AND g.tag = 'default'"
    "  LEFT JOIN template_versions v ON v.template = g.template AND v.hash = g.hash"
    "  WHERE m.deleted_at IS NULL AND m.name IN (SELECT name FROM c)"
    "  AND (m.team_id IS NULL OR (m.status = 'ready' AND v.hash IS NOT NULL)))"
    " SELECT t.tkey, r.cpus, r.mem, r.n FROM r JOIN t ON t.name = r.name WHERE r.k <= $2::int"
    " UNION ALL SELECT t.tkey, t.cpus, t.mem, 0 FROM t"
    " ORDER BY 4 DESC, 1 LIMIT 1024";

static void schedule(sp_sizes_t *s, uint32_t ms)
{
    sp_timer_start(&s->timer, ms);
}

static void on_read(void *arg, PGresult *res, const sp_err_t *err)
{
    sp_sizes_t *s = arg;
    s->reading = false;
    if (s->dying) {
        free(s);
        return;
    }
    s->st.rounds++;
    if (err != NULL) {
        s->st.failed++;
        sp_log(s->read_once ? SP_LOG_WARN : SP_LOG_DEBUG, "sizes", "sizes not read err=%s",
               err->msg);
        schedule(s, s->again ? 0 : s->read_once ? s->o.interval_ms : SIZES_RETRY_MS);
        s->again = false;
        return;
    }
    s->read_once = true;
    int n = PQntuples(res), queued = 0;
    for (int i = 0; i < n; i++) {
        const char *tname = PQgetvalue(res, i, 0);
        int cpus = atoi(PQgetvalue(res, i, 1)), mem = atoi(PQgetvalue(res, i, 2));
        sp_err_t e;
        s->st.asked++;
        int rc = s->driver->ops->prepare(s->driver, tname, cpus, mem, &e);
        if (rc < 0) {
            s->st.refused++;
            /* a template not on this worker, cold boots configured: nothing to do, said once
             * per round at most per size */
            sp_log(e.code == SP_ENOTFOUND || e.code == SP_ECONFLICT ? SP_LOG_DEBUG : SP_LOG_WARN,
                   "sizes",
                   "template snapshot not asked ahead template=%s cpus=%d memory_mb=%d "
                   "err=\"%s\"",
                   tname, cpus, mem, e.msg);
        } else if (rc == 1) {
            s->st.ready++;
        } else {
            queued++;
        }
    }
    if (queued > 0)
        sp_log(SP_LOG_INFO, "sizes", "template snapshots to make ahead sizes=%d queued=%d", n,
               queued);
    schedule(s, s->again ? 0 : s->o.interval_ms);
    s->again = false;
}

static void on_timer(sp_timer_t *t, void *arg)
{
    sp_sizes_t *s = arg;
    if (s->driver->ops->prepare == NULL)
        return;
    char win[16], per[16];
    snprintf(win, sizeof win, "%u", (unsigned)s->o.window_s);
    snprintf(per, sizeof per, "%d", s->o.per_template);
    const char *p[] = {win, per};
    sp_err_t e;
    if (sp_store_query(s->store, sizes_sql, 2, p, on_read, s, &e) < 0) {
        s->st.rounds++;
        s->st.failed++;
        /* the database is down, or not yet connected at start: next round */
        schedule(s, s->read_once ? s->o.interval_ms : SIZES_RETRY_MS);
        return;
    }
    s->reading = true;
}

sp_sizes_t *sp_sizes_create(sp_loop_t *loop, sp_store_t *store, sp_driver_t *driver,
                            const sp_sizes_opts_t *o, sp_err_t *err)
{
    if (o->per_template < 1) {
        sp_err_set(err, SP_EINVAL, "sizes per template must be at least 1");
        return NULL;
    }
    sp_sizes_t *s = calloc(1, sizeof(*s));
    if (s == NULL) {
        sp_err_set(err, SP_EINTERNAL, "out of memory");
        return NULL;
    }
    s->loop = loop;
    s->store = store;
    s->driver = driver;
    s->o = *o;
    if (s->o.interval_ms == 0)
        s->o.interval_ms = SP_SIZES_INTERVAL_MS;
    if (s->o.window_s == 0)
        s->o.window_s = SP_SIZES_WINDOW_S;
    sp_timer_init(&s->timer, loop, on_timer, s);
    schedule(s, 0);
    return s;
}

void sp_sizes_kick(sp_sizes_t *s)
{
    if (s->reading)
        s->again = true;
    else
        schedule(s, 0);
}

void sp_sizes_stats(const sp_sizes_t *s, sp_sizes_stats_t *out)
{
    *out = s->st;
}

void sp_sizes_destroy(sp_sizes_t *s)
{
    if (s == NULL)
        return;
    sp_timer_stop(&s->timer);
    if (s->reading)
        s->dying = true; /* freed by on_read (the store calls back even as it goes) */
    else
        free(s);
}
