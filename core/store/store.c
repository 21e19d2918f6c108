/*
 * store.c - asynchronous libpq pool and listener on the process loop.
 *
 * Owns every PGconn and PGresult. Never blocks the loop: connections are
 * opened with PQconnectStart/PQconnectPoll, statements sent with
 * PQsendQueryParams in non-blocking mode and finished from socket readiness.
 * Each connection prepares a statement the first time it runs its text (its
 * Parse sent just before the first Bind, in the same flight) and runs it prepared
 * from then on: PostgreSQL then parses and plans it once per connection, not once
 * per request. Texts past SP_STORE_PREP_MAX per connection (ad hoc SQL) run
 * unprepared.
 * The pool's connections run in libpq's pipeline mode: a statement goes to an idle
 * connection when there is one, else to the one with the fewest in flight, up to
 * SP_STORE_PIPE_MAX each, each statement followed by its own Sync (its own implicit
 * transaction, as without a pipeline: one failing aborts nothing else). Under load
 * PostgreSQL then reads several statements per wakeup and spaced several answers
 * per read, instead of a round trip of wakeups per statement. A statement queues behind
 * others on a connection only while all of them are plain reads and the oldest was sent
 * less than SP_STORE_PIPE_AGE_MS ago. A statement that may wait on a lock (a write, or a
 * SELECT that locks rows or calls one of our functions) closes its connection's pipeline
 * until it is answered: a workers row held by another transaction must not hold up a
 * health check sent after it. A slow read holds at most the few sent right after it;
 * later ones wait for a free connection as without a pipeline.
 * A broken connection fails its in-flight statements with SP_EUNAVAIL and is
 * reopened with backoff; statements not yet sent wait for a live connection
 * (at most SP_STORE_QUEUE_MS) or fail at once when none is up or coming up.
 */
#include "core/store/store.h"

#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

#include "base/log.h"
#include "base/metrics.h"

#define SP_STORE_QUEUE_MS   5000 /* longest a statement waits for a connection */
#define SP_STORE_QUEUE_MAX  4096 /* statements waiting at once */
#define SP_STORE_BACKOFF_LO 100
#define SP_STORE_PREP_MAX   128 /* prepared statements per connection */
#define SP_STORE_PIPE_MAX   4   /* statements in flight on one connection at most */
#define SP_STORE_PIPE_AGE_MS 10  /* ... and only behind statements sent this recently */

enum conn_state { C_DOWN = 0, C_CONNECTING, C_IDLE, C_BUSY };

static sp_metric_t m_wait = SP_METRIC_HISTOGRAM(
    "space_pg_pool_wait_seconds",
    "Time a statement waited for a free PostgreSQL connection of the pool before it was sent.",
    "", sp_metrics_buckets_wait);
static sp_metric_t m_errors = SP_METRIC_COUNTER(
    "space_pg_errors_total",
    "PostgreSQL failures: statements that failed (statement), statements not run because the "
    "database was unavailable or busy (unavailable), connections lost or not made (connection).",
    "kind");

/* A statement's answers in a pipeline come in stages: its Prepare's (when its text is
 * prepared with it), then its own, each ended by a NULL from PQgetResult, then its Sync's. */
enum { Q_PREP, Q_EXEC, Q_SYNC };

struct query {
    char *sql;
    int nparams;
    char **params;
    sp_store_cb cb;
    void *arg;
    uint64_t queued_ms;
    uint64_t sent_ms;
    struct query *next; /* in the queue, then in its connection's flight */
    int prep;           /* the statement index its text is being prepared as, or -1 */
    int stage;          /* Q_* */
    bool read;          /* a plain read: nothing it does waits on a row or advisory lock */
    PGresult *prep_res; /* its Prepare's answer */
    PGresult *res;      /* its last answer */
};

struct conn {
    sp_store_t *s;
    PGconn *pg;
    sp_watch_t *w;
    int watched_fd;
    enum conn_state st;
    bool listener;
    struct query *fl, *fl_tail; /* in flight, oldest first (pool connections) */
    int nfl;
    int nlock;        /* of them, statements that may wait on a lock (not reads) */
    PGresult *last;   /* last result of the listener's statement */
    sp_timer_t retry; /* reconnect */
    unsigned backoff_ms;
    bool logged_down;
    char *prep[SP_STORE_PREP_MAX]; /* statement "sN" is prep[N]'s text (NULL: its Prepare
                                    * failed); reset on reconnect */
    bool prep_read[SP_STORE_PREP_MAX]; /* and whether it is a plain read (sql_is_read) */
    int nprep;
};

struct sub {
    char *channel;
    sp_store_notify_cb cb;
    void *arg;
};

struct sp_store {
    sp_loop_t *loop;
    char *conninfo;
    /* conninfo parsed, with DateStyle ISO added to its options: what PQconnectStartParams
     * takes. NULL-terminated; the strings are PQconninfoParse's (freed with opts). */
    PQconninfoOption *opts;
    const char **keys, **vals;
    char *options; /* the merged "options" value */
    struct conn *conns;
    int nconns; /* pool; the listener is conns[nconns] */
    struct query *head, *tail;
    size_t queued;
    sp_timer_t sweep; /* expires queued statements */
    sp_timer_t kick;  /* zero-delay dispatch after sp_store_query */
    struct sub *subs;
    size_t nsubs;
    bool dying;
};

static void conn_start(struct conn *c);
static void dispatch(sp_store_t *s);
static void on_io(sp_watch_t *w, int events, void *arg);

const char *sp_store_sqlstate(const PGresult *res)
{
    const char *st = res ? PQresultErrorField(res, PG_DIAG_SQLSTATE) : NULL;
    return st ? st : "";
}

static void query_free(struct query *q)
{
    if (q == NULL)
        return;
    if (q->prep_res != NULL)
        PQclear(q->prep_res);
    if (q->res != NULL)
        PQclear(q->res);
    for (int i = 0; i < q->nparams; i++)
        free(q->params[i]);
    free(q->params);
    free(q->sql);
    free(q);
}

static void query_finish(struct query *q, PGresult *res, sp_code_t code, const char *msg)
{
    if (code == SP_OK) {
        q->cb(q->arg, res, NULL);
    } else {
        sp_metrics_add(&m_errors, 1, code == SP_EUNAVAIL ? "unavailable" : "statement");
        sp_err_t e;
        sp_err_set(&e, code, "%s", msg);
        q->cb(q->arg, res, &e);
    }
    query_free(q);
}

static bool any_state(const sp_store_t *s, enum conn_state a, enum conn_state b)
{
    for (int i = 0; i < s->nconns; i++)
        if (s->conns[i].st == a || s->conns[i].st == b)
            return true;
    return false;
}

bool sp_store_up(const sp_store_t *s)
{
    return any_state(s, C_IDLE, C_BUSY);
}

static void fail_queue(sp_store_t *s, const char *msg)
{
    while (s->head != NULL) {
        struct query *q = s->head;
        s->head = q->next;
        if (s->head == NULL)
            s->tail = NULL;
        s->queued--;
        query_finish(q, NULL, SP_EUNAVAIL, msg);
    }
}

/* ---- connection state ---- */

static void set_watch(struct conn *c, int events)
{
    int fd = c->pg ? PQsocket(c->pg) : -1;
    if (fd != c->watched_fd) {
        sp_watch_destroy(c->w);
        c->w = NULL;
        c->watched_fd = -1;
    }
    if (fd < 0)
        return;
    if (c->w == NULL) {
        c->w = sp_watch_create(c->s->loop, fd, on_io, c);
        if (c->w == NULL)
            return;
        c->watched_fd = fd;
    }
    sp_watch_set(c->w, events);
}

static void conn_close(struct conn *c)
{
    for (int i = 0; i < c->nprep; i++)
        free(c->prep[i]);
    c->nprep = 0;
    sp_watch_destroy(c->w);
    c->w = NULL;
    c->watched_fd = -1;
    if (c->last != NULL) {
        PQclear(c->last);
        c->last = NULL;
    }
    if (c->pg != NULL) {
        PQfinish(c->pg);
        c->pg = NULL;
    }
}

static void conn_down(struct conn *c, const char *why)
{
    sp_store_t *s = c->s;
    if (!c->logged_down) {
        sp_log(SP_LOG_WARN, "store", "connection lost listener=%d err=%s", c->listener,
               why ? why : "unknown");
        c->logged_down = true;
    }
    if (!s->dying)
        sp_metrics_add(&m_errors, 1, "connection");
    struct query *q = c->fl;
    c->fl = c->fl_tail = NULL;
    c->nfl = 0;
    c->nlock = 0;
    conn_close(c);
    c->st = C_DOWN;
    while (q != NULL) {
        struct query *next = q->next;
        query_finish(q, NULL, SP_EUNAVAIL, "database unavailable");
        q = next;
    }
    if (s->dying)
        return;
    c->backoff_ms = c->backoff_ms ? c->backoff_ms * 2 : SP_STORE_BACKOFF_LO;
    if (c->backoff_ms > SP_STORE_BACKOFF_MAX_MS)
        c->backoff_ms = SP_STORE_BACKOFF_MAX_MS;
    sp_timer_start(&c->retry, c->backoff_ms);
    if (!c->listener && !any_state(s, C_IDLE, C_BUSY) && !any_state(s, C_CONNECTING, C_CONNECTING))
        fail_queue(s, "database unavailable");
}

static void on_retry(sp_timer_t *t, void *arg)
{
    conn_start(arg);
}

static void send_listens(struct conn *c)
{
    sp_store_t *s = c->s;
    if (s->nsubs == 0)
        return;
    size_t cap = 16;
    for (size_t i = 0; i < s->nsubs; i++)
        cap += strlen(s->subs[i].channel) * 2 + 16;
    char *sql = malloc(cap);
    if (sql == NULL)
        return;
    size_t off = 0;
    for (size_t i = 0; i < s->nsubs; i++) {
        char *id = PQescapeIdentifier(c->pg, s->subs[i].channel, strlen(s->subs[i].channel));
        if (id == NULL)
            continue;
        off += (size_t)snprintf(sql + off, cap - off, "LISTEN %s;", id);
        PQfreemem(id);
    }
    /* The result of LISTEN is drained by the read path like any other. */
    if (!PQsendQuery(c->pg, sql))
        sp_log(SP_LOG_WARN, "store", "LISTEN failed err=%s", PQerrorMessage(c->pg));
    else
        c->st = C_BUSY;
    free(sql);
}

static void conn_ready(struct conn *c)
{
    sp_store_t *s = c->s;
    PQsetnonblocking(c->pg, 1);
    if (!c->listener && PQenterPipelineMode(c->pg) != 1) {
        conn_down(c, PQerrorMessage(c->pg));
        return;
    }
    c->st = C_IDLE;
    c->backoff_ms = 0;
    if (c->logged_down)
        sp_log(SP_LOG_INFO, "store", "connection restored listener=%d", c->listener);
    c->logged_down = false;
    set_watch(c, SP_IO_READ);
    if (c->listener) {
        send_listens(c);
        for (size_t i = 0; i < s->nsubs; i++)
            s->subs[i].cb(s->subs[i].arg, s->subs[i].channel, NULL);
    } else {
        dispatch(s);
    }
}

static void connect_step(struct conn *c)
{
    switch (PQconnectPoll(c->pg)) {
    case PGRES_POLLING_READING:
        set_watch(c, SP_IO_READ);
        break;
    case PGRES_POLLING_WRITING:
        set_watch(c, SP_IO_WRITE);
        break;
    case PGRES_POLLING_OK:
        conn_ready(c);
        break;
    default:
        conn_down(c, PQerrorMessage(c->pg));
        break;
    }
}

/* Server notices (and the FATAL sent before a shutdown) go to the debug log, not stderr. */
static void on_notice(void *arg, const char *msg)
{
    sp_log(SP_LOG_DEBUG, "store", "server notice: %s", msg);
}

static void conn_start(struct conn *c)
{
    sp_store_t *s = c->s;
    c->pg = s->keys ? PQconnectStartParams(s->keys, s->vals, 0) : PQconnectStart(s->conninfo);
    if (c->pg != NULL)
        PQsetNoticeProcessor(c->pg, on_notice, NULL);
    if (c->pg == NULL || PQstatus(c->pg) == CONNECTION_BAD) {
        conn_down(c, c->pg ? PQerrorMessage(c->pg) : "out of memory");
        return;
    }
    c->st = C_CONNECTING;
    set_watch(c, SP_IO_WRITE);
}

/* ---- statements ---- */

static void flush_out(struct conn *c)
{
    int r = PQflush(c->pg);
    if (r < 0)
        conn_down(c, PQerrorMessage(c->pg));
    else
        set_watch(c, r == 1 ? SP_IO_READ | SP_IO_WRITE : SP_IO_READ);
}

static void prep_name(int i, char out[16])
{
    snprintf(out, 16, "s%d", i);
}

static bool send_prepared(struct conn *c, struct query *q, int i)
{
    char name[16];
    prep_name(i, name);
    return PQsendQueryPrepared(c->pg, name, q->nparams, (const char *const *)q->params, NULL, NULL,
                               0) == 1;
}

/* Whether sql is a plain read, one a pipeline may queue others behind: a SELECT that
 * neither locks rows (FOR UPDATE/SHARE) nor calls what may wait or write (our space_*
 * functions, advisory locks, sequences, notifications). Anything else may wait on a lock
 * held by another transaction. Misjudging a read as a write only costs pipelining. */
static bool sql_is_read(const char *sql)
{
    static const char *const waits[] = {"FOR UPDATE", "FOR NO KEY",  "FOR SHARE", "FOR KEY SHARE",
                                        "space_",     "pg_advisory", "pg_notify", "nextval",
                                        "setval",     "pg_sleep"};
    while (*sql == ' ' || *sql == '\n' || *sql == '\t' || *sql == '(')
        sql++;
    if (strncasecmp(sql, "SELECT", 6) != 0 || (sql[6] != ' ' && sql[6] != '\n' && sql[6] != '\t'))
        return false;
    for (size_t i = 0; i < sizeof(waits) / sizeof(waits[0]); i++)
        if (strcasestr(sql, waits[i]) != NULL)
            return false;
    return true;
}

/* Sends q on c (in pipeline mode) with its Sync, its text's Prepare first when it has none
 * yet; q joins c's flight. false when libpq refused (the connection is then unusable). */
static bool send_query(struct conn *c, struct query *q)
{
    int i = 0;
    while (i < c->nprep && (c->prep[i] == NULL || strcmp(c->prep[i], q->sql) != 0))
        i++;
    bool ok;
    q->prep = -1;
    q->stage = Q_EXEC;
    if (i < c->nprep) {
        q->read = c->prep_read[i];
        ok = send_prepared(c, q, i);
    } else if (c->nprep < SP_STORE_PREP_MAX && (c->prep[c->nprep] = strdup(q->sql)) != NULL) {
        char name[16];
        i = c->nprep++;
        q->read = c->prep_read[i] = sql_is_read(q->sql);
        prep_name(i, name);
        q->prep = i;
        q->stage = Q_PREP;
        ok = PQsendPrepare(c->pg, name, q->sql, q->nparams, NULL) == 1 && send_prepared(c, q, i);
    } else {
        q->read = sql_is_read(q->sql);
        ok = PQsendQueryParams(c->pg, q->sql, q->nparams, NULL, (const char *const *)q->params,
                               NULL, NULL, 0) == 1;
    }
    if (!ok || PQpipelineSync(c->pg) != 1)
        return false;
    q->next = NULL;
    q->sent_ms = sp_loop_now_ms(c->s->loop);
    if (c->fl_tail != NULL)
        c->fl_tail->next = q;
    else
        c->fl = q;
    c->fl_tail = q;
    c->nfl++;
    c->nlock += !q->read;
    c->st = C_BUSY;
    flush_out(c);
    return true;
}

/* The pool connection a statement goes to: an idle one, else the one with the fewest in
 * flight below SP_STORE_PIPE_MAX, all of them reads, whose oldest was sent within
 * SP_STORE_PIPE_AGE_MS; NULL when there is none (the statement waits in the queue). */
static struct conn *pick(sp_store_t *s)
{
    struct conn *best = NULL;
    uint64_t now = sp_loop_now_ms(s->loop);
    for (int i = 0; i < s->nconns; i++) {
        struct conn *c = &s->conns[i];
        if (c->st == C_IDLE)
            return c;
        if (c->st == C_BUSY && c->nfl < SP_STORE_PIPE_MAX && c->nlock == 0 && c->fl != NULL &&
            now - c->fl->sent_ms <= SP_STORE_PIPE_AGE_MS && (best == NULL || c->nfl < best->nfl))
            best = c;
    }
    return best;
}

static void dispatch(sp_store_t *s)
{
    struct conn *c;
    while (s->head != NULL && (c = pick(s)) != NULL) {
        struct query *q = s->head;
        s->head = q->next;
        if (s->head == NULL)
            s->tail = NULL;
        s->queued--;
        q->next = NULL;
        uint64_t waited = sp_loop_now_ms(s->loop) - q->queued_ms;
        if (!send_query(c, q)) {
            /* Not sent: put it back first in line and take this connection down. */
            q->next = s->head;
            s->head = q;
            if (s->tail == NULL)
                s->tail = q;
            s->queued++;
            conn_down(c, PQerrorMessage(c->pg));
        } else {
            sp_metrics_observe(&m_wait, (double)waited / 1000.0);
        }
    }
}

static void drain_notifies(struct conn *c)
{
    sp_store_t *s = c->s;
    PGnotify *n;
    while (c->pg != NULL && (n = PQnotifies(c->pg)) != NULL) {
        for (size_t i = 0; i < s->nsubs; i++)
            if (strcmp(s->subs[i].channel, n->relname) == 0)
                s->subs[i].cb(s->subs[i].arg, n->relname, n->extra);
        PQfreemem(n);
    }
}

/* q's answer (its Prepare's error when that failed) to its caller. */
static void complete(struct conn *c, struct query *q)
{
    PGresult *res = q->res;
    q->res = NULL;
    if (q->prep >= 0 && (q->prep_res == NULL || PQresultStatus(q->prep_res) != PGRES_COMMAND_OK)) {
        /* Its text did not prepare: the Prepare's error is the answer, and the text is
         * forgotten, so that a later try prepares it again (under a new name). */
        free(c->prep[q->prep]);
        c->prep[q->prep] = NULL;
        if (res != NULL)
            PQclear(res);
        res = q->prep_res;
        q->prep_res = NULL;
    }
    ExecStatusType st = res ? PQresultStatus(res) : PGRES_FATAL_ERROR;
    if (st == PGRES_TUPLES_OK || st == PGRES_COMMAND_OK) {
        query_finish(q, res, SP_OK, NULL);
    } else {
        const char *state = sp_store_sqlstate(res);
        /* Class 57 (operator intervention) and 08 (connection): the server is going away. */
        bool gone = strncmp(state, "57", 2) == 0 || strncmp(state, "08", 2) == 0;
        const char *primary = res ? PQresultErrorField(res, PG_DIAG_MESSAGE_PRIMARY) : NULL;
        if (strcmp(state, SP_STORE_QUOTA_STATE) == 0 && primary != NULL) {
            /* our own quota function's refusal: its message names the quota, the
             * limit and the use, and holds nothing else (store.h) */
            sp_log(SP_LOG_INFO, "store", "over quota: %s", primary);
            query_finish(q, res, SP_EQUOTA, primary);
        } else if (strcmp(state, SP_STORE_CAPACITY_STATE) == 0 && primary != NULL) {
            /* the placement function's: no worker has room (store.h) */
            sp_log(SP_LOG_INFO, "store", "no capacity: %s", primary);
            query_finish(q, res, SP_ECAPACITY, primary);
        } else {
            if (!gone)
                sp_log(SP_LOG_ERROR, "store", "statement failed sqlstate=%s err=%s", state,
                       res ? PQresultErrorMessage(res) : "no result");
            query_finish(q, res, gone ? SP_EUNAVAIL : SP_EINTERNAL,
                         gone ? "database unavailable" : "internal database error");
        }
    }
    if (res != NULL)
        PQclear(res);
}

/* A pool connection's answers as they arrive, each statement's in its stages (enum above),
 * each statement completed at its Sync. */
static void pipe_results(struct conn *c)
{
    int nulls = 0; /* NULLs in a row with no stage to end: libpq is out of step with us */
    while (c->pg != NULL && c->fl != NULL && !PQisBusy(c->pg)) {
        struct query *q = c->fl;
        PGresult *r = PQgetResult(c->pg);
        if (r == NULL) {
            if (q->stage != Q_SYNC) {
                q->stage++;
            } else if (++nulls > 1) {
                conn_down(c, "the connection's answers are out of step with its statements");
                return;
            }
            continue;
        }
        nulls = 0;
        if (PQresultStatus(r) == PGRES_PIPELINE_SYNC) {
            PQclear(r);
            c->fl = q->next;
            if (c->fl == NULL)
                c->fl_tail = NULL;
            c->nfl--;
            c->nlock -= !q->read;
            complete(c, q);
            continue;
        }
        PGresult **slot = q->stage == Q_PREP ? &q->prep_res : &q->res;
        if (*slot != NULL)
            PQclear(*slot);
        *slot = r;
    }
    if (c->pg == NULL)
        return;
    if (c->fl == NULL)
        c->st = C_IDLE;
    if (PQstatus(c->pg) == CONNECTION_BAD) {
        conn_down(c, "server closed the connection");
        return;
    }
    dispatch(c->s);
}

/* The listener's answers (no pipeline: its LISTENs). */
static void listener_results(struct conn *c)
{
    while (c->pg != NULL && !PQisBusy(c->pg)) {
        PGresult *r = PQgetResult(c->pg);
        if (r != NULL) {
            if (c->last != NULL)
                PQclear(c->last);
            c->last = r;
            continue;
        }
        PGresult *res = c->last;
        c->last = NULL;
        c->st = C_IDLE;
        if (res != NULL && PQresultStatus(res) != PGRES_COMMAND_OK)
            sp_log(SP_LOG_WARN, "store", "listener statement failed err=%s",
                   PQresultErrorMessage(res));
        if (res != NULL)
            PQclear(res);
        if (c->pg != NULL && PQstatus(c->pg) == CONNECTION_BAD)
            conn_down(c, "server closed the connection");
        return;
    }
}

static void on_io(sp_watch_t *w, int events, void *arg)
{
    struct conn *c = arg;
    if (c->st == C_CONNECTING) {
        connect_step(c);
        return;
    }
    if (c->pg == NULL)
        return;
    if (events & SP_IO_WRITE) {
        flush_out(c);
        if (c->pg == NULL)
            return;
    }
    if (events & SP_IO_READ) {
        if (!PQconsumeInput(c->pg)) {
            conn_down(c, PQerrorMessage(c->pg));
            return;
        }
        drain_notifies(c);
        if (c->st == C_BUSY && c->listener)
            listener_results(c);
        else if (c->st == C_BUSY)
            pipe_results(c);
        else if (PQstatus(c->pg) == CONNECTION_BAD)
            conn_down(c, "server closed the connection");
        else {
            /* An idle connection that becomes readable without a statement is the server
             * saying goodbye (or a notice); consume it and check again next time. */
            PGresult *r;
            while (!PQisBusy(c->pg) && (r = PQgetResult(c->pg)) != NULL)
                PQclear(r);
        }
    }
}

static void on_sweep(sp_timer_t *t, void *arg)
{
    sp_store_t *s = arg;
    uint64_t now = sp_loop_now_ms(s->loop);
    while (s->head != NULL && now - s->head->queued_ms > SP_STORE_QUEUE_MS) {
        struct query *q = s->head;
        s->head = q->next;
        if (s->head == NULL)
            s->tail = NULL;
        s->queued--;
        query_finish(q, NULL, SP_EUNAVAIL, "database busy or unavailable");
    }
    sp_timer_start(&s->sweep, 250);
}

static void on_kick(sp_timer_t *t, void *arg)
{
    dispatch(arg);
}

/* ---- public ---- */

/* Every connection runs with DateStyle ISO, the form sp_store_time reads: appended to the
 * options the conninfo gives (a later -c wins in PostgreSQL), so nothing else of the caller's
 * is lost. Unless the conninfo says otherwise, a connection is only made to a server that
 * takes writes (target_session_attrs=read-write): given several hosts (a primary and its
 * standbys), libpq tries each in turn, so after a failover the promoted one is found, and a
 * standby still read-only is never settled for. A conninfo that does not parse is kept as it
 * is (s->keys NULL): its connections fail in the background like any unreachable server's.
 * -1 only when out of memory. */
static int parse_conninfo(sp_store_t *s)
{
    char *msg = NULL;
    s->opts = PQconninfoParse(s->conninfo, &msg);
    PQfreemem(msg);
    if (s->opts == NULL)
        return 0;
    size_t n = 0;
    while (s->opts[n].keyword != NULL)
        n++;
    s->keys = calloc(n + 3, sizeof(*s->keys));
    s->vals = calloc(n + 3, sizeof(*s->vals));
    if (s->keys == NULL || s->vals == NULL)
        return -1;
    const char *given = "";
    size_t k = 0;
    bool attrs = false;
    for (PQconninfoOption *o = s->opts; o->keyword != NULL; o++) {
        if (o->val == NULL)
            continue;
        attrs = attrs || strcmp(o->keyword, "target_session_attrs") == 0;
        if (strcmp(o->keyword, "options") == 0) {
            given = o->val;
            continue;
        }
        s->keys[k] = o->keyword;
        s->vals[k++] = o->val;
    }
    size_t cap = strlen(given) + 32;
    if ((s->options = malloc(cap)) == NULL)
        return -1;
    snprintf(s->options, cap, "%s%s-c DateStyle=ISO", given, given[0] ? " " : "");
    s->keys[k] = "options";
    s->vals[k++] = s->options;
    if (!attrs) {
        s->keys[k] = "target_session_attrs";
        s->vals[k] = "read-write";
    }
    return 0;
}

static void free_conninfo(sp_store_t *s)
{
    PQconninfoFree(s->opts);
    free(s->keys);
    free(s->vals);
    free(s->options);
}

sp_store_t *sp_store_create(sp_loop_t *loop, const char *conninfo, int pool_size, sp_err_t *err)
{
    if (pool_size < 1)
        pool_size = 1;
    sp_store_t *s = calloc(1, sizeof(*s));
    if (s == NULL)
        return NULL;
    s->loop = loop;
    s->conninfo = strdup(conninfo);
    s->nconns = pool_size;
    s->conns = calloc((size_t)pool_size + 1, sizeof(*s->conns));
    if (s->conninfo == NULL || s->conns == NULL) {
        sp_err_set(err, SP_EINTERNAL, "out of memory");
        goto fail;
    }
    if (parse_conninfo(s) < 0) {
        sp_err_set(err, SP_EINTERNAL, "out of memory");
        goto fail;
    }
    for (int i = 0; i <= pool_size; i++) {
        struct conn *c = &s->conns[i];
        c->s = s;
        c->watched_fd = -1;
        c->listener = (i == pool_size);
        sp_timer_init(&c->retry, loop, on_retry, c);
        conn_start(c);
    }
    sp_timer_init(&s->sweep, loop, on_sweep, s);
    sp_timer_init(&s->kick, loop, on_kick, s);
    sp_timer_start(&s->sweep, 250);
    sp_metrics_declare(&m_wait);
    sp_metrics_declare(&m_errors);
    return s;
fail:
    free_conninfo(s);
    free(s->conninfo);
    free(s->conns);
    free(s);
    return NULL;
}

void sp_store_destroy(sp_store_t *s)
{
    if (s == NULL)
        return;
    s->dying = true;
    sp_timer_stop(&s->sweep);
    sp_timer_stop(&s->kick);
    for (int i = 0; i <= s->nconns; i++) {
        sp_timer_stop(&s->conns[i].retry);
        conn_down(&s->conns[i], "shutting down");
    }
    fail_queue(s, "shutting down");
    for (size_t i = 0; i < s->nsubs; i++)
        free(s->subs[i].channel);
    free(s->subs);
    free(s->conns);
    free_conninfo(s);
    free(s->conninfo);
    free(s);
}

int sp_store_query(sp_store_t *s, const char *sql, int nparams, const char *const *params,
                   sp_store_cb cb, void *arg, sp_err_t *err)
{
    if (!any_state(s, C_IDLE, C_BUSY) && !any_state(s, C_CONNECTING, C_CONNECTING))
        return sp_err_set(err, SP_EUNAVAIL, "database unavailable");
    if (s->queued >= SP_STORE_QUEUE_MAX)
        return sp_err_set(err, SP_EUNAVAIL, "database busy");
    struct query *q = calloc(1, sizeof(*q));
    if (q == NULL)
        return sp_err_set(err, SP_EINTERNAL, "out of memory");
    q->sql = strdup(sql);
    q->nparams = nparams;
    q->params = calloc((size_t)(nparams > 0 ? nparams : 1), sizeof(char *));
    bool ok = q->sql != NULL && q->params != NULL;
    for (int i = 0; ok && i < nparams; i++) {
        if (params[i] != NULL) {
            q->params[i] = strdup(params[i]);
            ok = q->params[i] != NULL;
        }
    }
    if (!ok) {
        query_free(q);
        return sp_err_set(err, SP_EINTERNAL, "out of memory");
    }
    q->cb = cb;
    q->arg = arg;
    q->queued_ms = sp_loop_now_ms(s->loop);
    if (s->tail != NULL)
        s->tail->next = q;
    else
        s->head = q;
    s->tail = q;
    s->queued++;
    /* Dispatch on the next turn so the callback can never run inside this call. */
    if (!sp_timer_armed(&s->kick))
        sp_timer_start(&s->kick, 0);
    return 0;
}

const sp_err_t *sp_store_one_row(const PGresult *res, const sp_err_t *err, sp_code_t code,
                                 const char *msg, sp_err_t *buf)
{
    if (err != NULL)
        return err;
    if (PQntuples(res) != 1) {
        sp_err_set(buf, code, "%s", msg);
        return buf;
    }
    return NULL;
}

void *sp_store_rows(const PGresult *res, const sp_err_t *err, sp_code_t code, const char *none,
                    size_t size, const sp_err_t **fail, sp_err_t *buf)
{
    *fail = err;
    if (err != NULL)
        return NULL;
    if (none != NULL && PQntuples(res) == 0) {
        sp_err_set(buf, code, "%s", none);
        *fail = buf;
        return NULL;
    }
    void *recs = calloc((size_t)PQntuples(res) + 1, size);
    if (recs == NULL) {
        sp_err_set(buf, SP_EINTERNAL, "out of memory");
        *fail = buf;
    }
    return recs;
}

void sp_store_text(const PGresult *res, int row, int col, char *dst, size_t cap)
{
    const char *src = PQgetvalue(res, row, col); /* "" for NULL, NULL off the table's end */
    size_t n = src ? strnlen(src, cap - 1) : 0;
    memcpy(dst, src ? src : "", n);
    dst[n] = '\0';
}

/* Reads ISO "Y-MM-DD HH:MM:SS[.f]" (Y four digits or more, f one to six): the offsets of its
 * parts, or false when v is not of that form. */
struct iso_time {
    size_t ylen;      /* digits of the year */
    const char *time; /* "HH:MM:SS" */
    const char *frac; /* the digits after '.', or "" */
    size_t flen;
};

static bool digits(const char *p, size_t n)
{
    for (size_t i = 0; i < n; i++)
        if (p[i] < '0' || p[i] > '9')
            return false;
    return true;
}

static bool iso_parse(const char *v, struct iso_time *t)
{
    size_t y = 0;
    while (v[y] >= '0' && v[y] <= '9')
        y++;
    const char *d = v + y; /* "-MM-DD HH:MM:SS" */
    if (y < 4 || y > 9 || strnlen(d, 15) < 15 || d[0] != '-' || !digits(d + 1, 2) ||
        d[3] != '-' || !digits(d + 4, 2) || d[6] != ' ' || !digits(d + 7, 2) || d[9] != ':' ||
        !digits(d + 10, 2) || d[12] != ':' || !digits(d + 13, 2))
        return false;
    const char *f = d + 15;
    size_t fl = 0;
    if (*f == '.') {
        f++;
        while (f[fl] >= '0' && f[fl] <= '9')
            fl++;
        if (fl < 1 || fl > 6)
            return false;
    }
    if (f[fl] != '\0')
        return false;
    *t = (struct iso_time){(size_t)y, d + 7, f, fl};
    return true;
}

void sp_store_time(const PGresult *res, int row, int col, char *dst, size_t cap)
{
    const char *v = PQgetvalue(res, row, col);
    struct iso_time t;
    char out[40];
    if (v == NULL || !iso_parse(v, &t)) {
        dst[0] = '\0';
        return;
    }
    size_t n = t.ylen + 6;
    memcpy(out, v, n); /* Y-MM-DD */
    out[n++] = 'T';
    memcpy(out + n, t.time, 8);
    n += 8;
    out[n++] = '.';
    for (size_t i = 0; i < 3; i++)
        out[n++] = i < t.flen ? t.frac[i] : '0';
    out[n++] = 'Z';
    out[n] = '\0';
    n = n < cap - 1 ? n : cap - 1;
    memcpy(dst, out, n);
    dst[n] = '\0';
}

static long long num(const char *p, size_t n)
{
    long long v = 0;
    for (size_t i = 0; i < n; i++)
        v = v * 10 + (p[i] - '0');
    return v;
}

int sp_store_time_us(const PGresult *res, int row, int col, long long *us)
{
    const char *v = PQgetvalue(res, row, col);
    struct iso_time t;
    if (v == NULL || PQgetisnull(res, row, col) || !iso_parse(v, &t))
        return -1;
    long long y = num(v, t.ylen), m = num(v + t.ylen + 1, 2), d = num(v + t.ylen + 4, 2);
    /* Days from 1970-01-01 of a proleptic Gregorian date (H. Hinnant's days_from_civil). */
    y -= m <= 2;
    long long era = (y >= 0 ? y : y - 399) / 400;
    long long yoe = y - era * 400;
    long long doy = (153 * (m + (m > 2 ? -3 : 9)) + 2) / 5 + d - 1;
    long long doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    long long days = era * 146097 + doe - 719468;
    long long secs = days * 86400 + num(t.time, 2) * 3600 + num(t.time + 3, 2) * 60 +
                     num(t.time + 6, 2);
    long long frac = num(t.frac, t.flen);
    for (size_t i = t.flen; i < 6; i++)
        frac *= 10;
    *us = secs * 1000000 + frac;
    return 0;
}

int sp_store_cursor_parse(const char *cur, bool (*valid_id)(const char *id), char micros[20],
                          char *id, size_t cap)
{
    const char *us = strchr(cur, '_');
    if (us == NULL || us == cur || us - cur > 19)
        return -1;
    for (const char *q = cur; q < us; q++)
        if (*q < '0' || *q > '9')
            return -1;
    if (!valid_id(us + 1) || strlen(us + 1) >= cap)
        return -1;
    memcpy(micros, cur, (size_t)(us - cur));
    micros[us - cur] = '\0';
    memcpy(id, us + 1, strlen(us + 1) + 1);
    return 0;
}

/* sp_store_call's record: the callback, then the caller's bytes (aligned as malloc aligns). */
struct rec {
    sp_store_rec_cb done;
    max_align_t data[];
};

static void on_rec(void *arg, PGresult *res, const sp_err_t *err)
{
    struct rec *r = arg;
    r->done(r->data, res, err);
    free(r);
}

void *sp_store_call(sp_store_t *s, const char *sql, int nparams, const char *const *params,
                    size_t size, sp_store_rec_cb done, sp_err_t *err)
{
    struct rec *r = calloc(1, sizeof(*r) + size);
    if (r == NULL) {
        sp_err_set(err, SP_EINTERNAL, "out of memory");
        return NULL;
    }
    r->done = done;
    if (sp_store_query(s, sql, nparams, params, on_rec, r, err) < 0) {
        free(r);
        return NULL;
    }
    return r->data;
}

int sp_store_listen(sp_store_t *s, const char *channel, sp_store_notify_cb cb, void *arg,
                    sp_err_t *err)
{
    struct sub *n = realloc(s->subs, (s->nsubs + 1) * sizeof(*n));
    if (n == NULL)
        return sp_err_set(err, SP_EINTERNAL, "out of memory");
    s->subs = n;
    s->subs[s->nsubs].channel = strdup(channel);
    s->subs[s->nsubs].cb = cb;
    s->subs[s->nsubs].arg = arg;
    if (s->subs[s->nsubs].channel == NULL)
        return sp_err_set(err, SP_EINTERNAL, "out of memory");
    s->nsubs++;
    struct conn *l = &s->conns[s->nconns];
    if (l->st == C_IDLE)
        send_listens(l); /* re-LISTENs all; harmless */
    return 0;
}

int sp_store_submit(sp_store_t *s, const char *sql, int nparams, const char *const *params,
                    sp_store_rec_cb done, void *owner, void *cb, void *arg, int flag,
                    sp_err_t *err)
{
    sp_store_req_t *r = sp_store_call(s, sql, nparams, params, sizeof(*r), done, err);
    if (r == NULL)
        return -1;
    *r = (sp_store_req_t){owner, cb, arg, flag};
    return 0;
}
