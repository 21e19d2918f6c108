/*
 * audit.c - the egress audit log (egress_log): one row per proxy connection and
 * DNS query, kept in memory and written in batched INSERTs that also trim each
 * sandbox's rows.
 *
 * Owns the pending rows (at most LOG_MAX_PENDING: beyond, rows are dropped and
 * counted) and the flush timer. An outage loses rows rather than growing
 * without bound. Knows nothing of how the rows came about (proxy.c, dns.c).
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "base/buf.h"
#include "base/log.h"
#include "core/egress/egress_int.h"

#define LOG_MAX_PENDING 4000                /* audit rows held; beyond: dropped (counted) */
#define LOG_BATCH       500                 /* rows per INSERT */
#define TRIM_EVERY      500                 /* rows per sandbox between trims */
#define GC_EVERY_MS     (10u * 60u * 1000u) /* audit rows of long-deleted sandboxes */

struct logrow {
    char sandbox[65];
    char team[SP_ID_LEN + 1];
    long long at_ms;
    char kind[8];
    char host[SP_EGP_NAME_MAX + 8];
    int port;
    char address[72];
    bool allowed;
    char reason[160];
    unsigned long long up, down;
    int dur_ms;
};

static uint64_t wall_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    return (uint64_t)ts.tv_sec * 1000u + (uint64_t)ts.tv_nsec / 1000000u;
}

void sp_egress__log(struct sb *sb, const char *kind, const char *host, int port,
                    const char *address, bool allowed, const char *reason, uint64_t up,
                    uint64_t down, uint64_t dur_ms)
{
    sp_egress_t *eg = sb->eg;
    if (allowed)
        eg->st.allowed++;
    else
        eg->st.denied++;
    if (eg->rows == NULL || sb->team[0] == '\0')
        return;
    if (eg->nrows >= LOG_MAX_PENDING) {
        if (eg->dropped++ % 1000 == 0)
            sp_log(SP_LOG_WARN, "egress", "audit rows dropped (database slow) total=%llu",
                   eg->dropped);
        return;
    }
    struct logrow *r = &eg->rows[eg->nrows++];
    snprintf(r->sandbox, sizeof(r->sandbox), "%s", sb->id);
    snprintf(r->team, sizeof(r->team), "%s", sb->team);
    r->at_ms = (long long)wall_ms();
    snprintf(r->kind, sizeof(r->kind), "%s", kind);
    snprintf(r->host, sizeof(r->host), "%s", host);
    r->port = port;
    snprintf(r->address, sizeof(r->address), "%s", address ? address : "");
    r->allowed = allowed;
    snprintf(r->reason, sizeof(r->reason), "%s", reason ? reason : "");
    r->up = up;
    r->down = down;
    r->dur_ms = dur_ms > 86400000u ? 86400000 : (int)dur_ms;
    if (++sb->log_since_trim >= TRIM_EVERY) {
        sb->log_since_trim = 0;
        sb->trim = true;
    }
    if (!sp_timer_armed(&eg->flush) && !eg->flushing)
        sp_timer_start(&eg->flush, eg->o.log_flush_ms);
}

/* Appends one element to a PostgreSQL array literal being built ("{" already there). */
static void arr_str(sp_buf_t *b, const char *s)
{
    if (b->len > 1)
        sp_buf_add(b, ",", 1);
    sp_buf_add(b, "\"", 1);
    for (; *s; s++) {
        if (*s == '"' || *s == '\\')
            sp_buf_add(b, "\\", 1);
        sp_buf_add(b, s, 1);
    }
    sp_buf_add(b, "\"", 1);
}

static void arr_num(sp_buf_t *b, long long v)
{
    char t[32];
    int n = snprintf(t, sizeof(t), "%s%lld", b->len > 1 ? "," : "", v);
    sp_buf_add(b, t, (size_t)n);
}

static void on_flushed(void *arg, PGresult *res, const sp_err_t *err)
{
    sp_egress_t *eg = arg;
    eg->inflight--;
    eg->flushing = false;
    if (eg->dying) {
        sp_egress__maybe_free(eg);
        return;
    }
    if (err != NULL)
        sp_log(SP_LOG_WARN, "egress", "audit write failed err=%s", err->msg);
    if (eg->nrows > 0 && !sp_timer_armed(&eg->flush))
        sp_timer_start(&eg->flush, eg->o.log_flush_ms);
}

static void on_flush(sp_timer_t *t, void *arg)
{
    sp_egress_t *eg = arg;
    if (eg->flushing || eg->nrows == 0)
        return;
    size_t n = eg->nrows < LOG_BATCH ? eg->nrows : LOG_BATCH;
    enum { NCOL = 13 };
    sp_buf_t cols[NCOL];
    memset(cols, 0, sizeof(cols));
    for (int c = 0; c < NCOL; c++)
        sp_buf_add(&cols[c], "{", 1);
    for (size_t i = 0; i < n; i++) {
        const struct logrow *r = &eg->rows[i];
        arr_str(&cols[0], r->sandbox);
        arr_str(&cols[1], r->team);
        arr_num(&cols[2], r->at_ms);
        arr_str(&cols[3], r->kind);
        arr_str(&cols[4], r->host);
        arr_num(&cols[5], r->port);
        arr_str(&cols[6], r->address);
        arr_str(&cols[7], r->allowed ? "t" : "f");
        arr_str(&cols[8], r->reason);
        arr_num(&cols[9], (long long)r->up);
        arr_num(&cols[10], (long long)r->down);
        arr_num(&cols[11], r->dur_ms);
    }
    /* Sandboxes that wrote TRIM_EVERY rows since their last trim. */
    for (struct sb *sb = eg->sbs; sb != NULL; sb = sb->next)
        if (sb->trim) {
            sb->trim = false;
            arr_str(&cols[12], sb->id);
        }
    bool gc = eg->last_gc_ms == 0 || sp_loop_now_ms(eg->loop) - eg->last_gc_ms >= GC_EVERY_MS;
    if (gc)
        eg->last_gc_ms = sp_loop_now_ms(eg->loop);
    bool oom = false;
    for (int c = 0; c < NCOL; c++) {
        sp_buf_add(&cols[c], "}", 1);
        oom = oom || cols[c].oom;
    }
    if (!oom) {
        const char *p[NCOL + 2];
        for (int c = 0; c < NCOL; c++)
            p[c] = sp_buf_cstr(&cols[c]);
        char keep[16];
        snprintf(keep, sizeof(keep), "%d", SP_EGRESS_LOG_KEEP);
        p[NCOL] = gc ? "true" : "false";
        p[NCOL + 1] = keep;
        sp_err_t e;
        /* The trim and the clean-up see the table as it was before this INSERT, so a trimmed
         * sandbox keeps SP_EGRESS_LOG_KEEP older rows plus this batch. */
        int rc =
            sp_store_query(eg->store,
                           "WITH ins AS (INSERT INTO egress_log (sandbox_id, team_id, at, kind, "
                           "host, port,"
                           "   address, allowed, reason, bytes_up, bytes_down, duration_ms)"
                           "  SELECT u.s, u.t, to_timestamp(u.a / 1000.0), u.k, u.h, u.p, u.ad, "
                           "u.al, u.r,"
                           "   u.bu, u.bd, u.d FROM unnest($1::text[], $2::text[], $3::bigint[], "
                           "$4::text[],"
                           "   $5::text[], $6::int[], $7::text[], $8::bool[], $9::text[], "
                           "$10::bigint[],"
                           "   $11::bigint[], $12::int[]) AS u(s, t, a, k, h, p, ad, al, r, bu, "
                           "bd, d)"
                           "  RETURNING 1),"
                           " tr AS (DELETE FROM egress_log e USING (SELECT x.sid, (SELECT l.id "
                           "FROM egress_log l"
                           "   WHERE l.sandbox_id = x.sid ORDER BY l.id DESC OFFSET $15::int "
                           "LIMIT 1) AS cut"
                           "   FROM unnest($13::text[]) AS x(sid)) c"
                           "  WHERE e.sandbox_id = c.sid AND e.id <= c.cut RETURNING 1),"
                           " gc AS (DELETE FROM egress_log e WHERE $14::bool AND e.sandbox_id IN"
                           "  (SELECT s.id FROM sandboxes s WHERE s.observed_state = 'deleted'"
                           "   AND s.updated_at < now() - interval '1 day') RETURNING 1)"
                           " SELECT (SELECT count(*) FROM ins), (SELECT count(*) FROM tr),"
                           "  (SELECT count(*) FROM gc)",
                           NCOL + 2, p, on_flushed, eg, &e);
        if (rc == 0) {
            eg->flushing = true;
            eg->inflight++;
        } else {
            sp_log(SP_LOG_WARN, "egress", "audit write not sent err=%s", e.msg);
        }
    }
    for (int c = 0; c < NCOL; c++)
        sp_buf_free(&cols[c]);
    /* Rows are dropped from memory once handed to the store (or if it refused them): an
     * outage loses audit rows rather than growing without bound. */
    memmove(eg->rows, eg->rows + n, (eg->nrows - n) * sizeof(eg->rows[0]));
    eg->nrows -= n;
    if (!eg->flushing && eg->nrows > 0)
        sp_timer_start(&eg->flush, eg->o.log_flush_ms);
}

int sp_egress__audit_init(sp_egress_t *eg)
{
    if (eg->o.log_flush_ms == 0)
        eg->o.log_flush_ms = 250;
    eg->rows = calloc(LOG_MAX_PENDING, sizeof(eg->rows[0]));
    if (eg->rows == NULL)
        return -1;
    sp_timer_init(&eg->flush, eg->loop, on_flush, eg);
    return 0;
}

void sp_egress__audit_stop(sp_egress_t *eg)
{
    sp_timer_stop(&eg->flush);
}

void sp_egress__audit_free(sp_egress_t *eg)
{
    free(eg->rows);
    eg->rows = NULL;
}
