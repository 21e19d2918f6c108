/*
 * test_store.c - the asynchronous store and migrations against a real PostgreSQL.
 *
 * Uses SP_TEST_PG_DSN when set, else starts a private cluster (core/store/pgcluster)
 * in a temporary directory. Exits 77 when PostgreSQL is not installed.
 */
#include <libpq-fe.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "core/store/migrate.h"
#include "core/store/pgcluster.h"
#include "core/store/store.h"
#include "core/store/tests/pgfixture.h"
#include "loop/loop.h"
#include "tests/check.h"

static sp_loop_t *loop;
static const char *dsn;

struct result {
    int done;
    sp_code_t code;
    char value[128];
    char sqlstate[8];
};

static void on_res(void *arg, PGresult *res, const sp_err_t *err)
{
    struct result *r = arg;
    r->done++;
    r->code = err ? err->code : SP_OK;
    if (res != NULL && PQresultStatus(res) == PGRES_TUPLES_OK && PQntuples(res) > 0)
        snprintf(r->value, sizeof(r->value), "%s", PQgetvalue(res, 0, 0));
    snprintf(r->sqlstate, sizeof(r->sqlstate), "%s", sp_store_sqlstate(res));
}

static void run_until(int *flag, int want, int ms)
{
    for (int i = 0; i < ms / 10 && *flag < want; i++)
        sp_loop_run_once(loop, 10);
}

/* Results built by hand (no server): what sp_store_rows answers, and sp_store_text's cut. */
static void test_store_rows_and_text(void)
{
    PGresult *r = PQmakeEmptyPGresult(NULL, PGRES_TUPLES_OK);
    REQUIRE(r != NULL);
    PGresAttDesc att[2] = {{.name = "a", .typid = 25, .typlen = -1, .atttypmod = -1},
                           {.name = "b", .typid = 25, .typlen = -1, .atttypmod = -1}};
    REQUIRE(PQsetResultAttrs(r, 2, att));
    sp_err_t buf, q;
    const sp_err_t *fail;
    /* No rows: a list of none, or the caller's error when it names one. */
    void *none = sp_store_rows(r, NULL, SP_ENOTFOUND, NULL, 8, &fail, &buf);
    CHECK(none != NULL && fail == NULL);
    free(none);
    CHECK(sp_store_rows(r, NULL, SP_ENOTFOUND, "no such thing", 8, &fail, &buf) == NULL);
    CHECK(fail == &buf && buf.code == SP_ENOTFOUND && strcmp(buf.msg, "no such thing") == 0);
    /* The query's own error comes first, as it is. */
    sp_err_set(&q, SP_EUNAVAIL, "database down");
    CHECK(sp_store_rows(NULL, &q, SP_ENOTFOUND, "no such thing", 8, &fail, &buf) == NULL);
    CHECK(fail == &q);
    /* Two rows: three zeroed records. */
    REQUIRE(PQsetvalue(r, 0, 0, "hello", 5) && PQsetvalue(r, 0, 1, NULL, -1));
    REQUIRE(PQsetvalue(r, 1, 0, "x", 1) && PQsetvalue(r, 1, 1, "y", 1));
    char(*recs)[8] = sp_store_rows(r, NULL, SP_ENOTFOUND, "no such thing", 8, &fail, &buf);
    CHECK(recs != NULL && fail == NULL);
    if (recs != NULL)
        for (int i = 0; i < 3; i++)
            CHECK(memcmp(recs[i], "\0\0\0\0\0\0\0\0", 8) == 0);
    free(recs);
    /* Text: cut to the buffer, SQL NULL as "". */
    char small[4], big[16] = "junk";
    SP_STORE_TEXT(r, 0, 0, small);
    CHECK(strcmp(small, "hel") == 0);
    SP_STORE_TEXT(r, 0, 0, big);
    CHECK(strcmp(big, "hello") == 0);
    SP_STORE_TEXT(r, 0, 1, big);
    CHECK(strcmp(big, "") == 0);
    SP_STORE_TEXT(r, 1, 1, big);
    CHECK(strcmp(big, "y") == 0);
    PQclear(r);
}

/* Four processes race to migrate a fresh database: each version is applied once. */
static void test_store_migrations_apply_once(void)
{
    pid_t kids[4];
    for (int i = 0; i < 4; i++) {
        kids[i] = fork();
        if (kids[i] == 0) {
            PGconn *c = PQconnectdb(dsn);
            sp_err_t e;
            int applied = 0;
            int rc = PQstatus(c) == CONNECTION_OK ? sp_migrate_apply(c, &applied, &e) : -1;
            PQfinish(c);
            _exit(rc == 0 ? 0 : 1);
        }
    }
    for (int i = 0; i < 4; i++) {
        int st;
        waitpid(kids[i], &st, 0);
        CHECK(WIFEXITED(st) && WEXITSTATUS(st) == 0);
    }
    PGconn *c = PQconnectdb(dsn);
    PGresult *r = PQexec(c, "SELECT count(*), count(DISTINCT version), max(version)"
                            " FROM schema_migrations");
    CHECK(PQresultStatus(r) == PGRES_TUPLES_OK);
    CHECK(atoi(PQgetvalue(r, 0, 0)) == sp_migrate_latest());
    CHECK(atoi(PQgetvalue(r, 0, 1)) == sp_migrate_latest());
    CHECK(atoi(PQgetvalue(r, 0, 2)) == sp_migrate_latest());
    PQclear(r);
    int applied = -1;
    sp_err_t e;
    CHECK(sp_migrate_apply(c, &applied, &e) == 0 && applied == 0);
    PQfinish(c);
}

static void test_store_queries_and_errors(sp_store_t *s)
{
    struct result a = {0}, b = {0}, c = {0};
    const char *p[] = {"hello", NULL};
    sp_err_t e;
    CHECK(sp_store_query(s, "SELECT $1::text || coalesce($2, '!')", 2, p, on_res, &a, &e) == 0);
    CHECK(a.done == 0); /* never called back inside the call */
    const char *bad[] = {"x"};
    CHECK(sp_store_query(s, "SELECT $1::int", 1, bad, on_res, &b, &e) == 0);
    CHECK(sp_store_query(s, "SELECT pg_sleep(0.05), 7", 0, NULL, on_res, &c, &e) == 0);
    run_until(&c.done, 1, 5000);
    run_until(&a.done, 1, 5000);
    run_until(&b.done, 1, 5000);
    CHECK(a.done == 1 && a.code == SP_OK && strcmp(a.value, "hello!") == 0);
    CHECK(b.done == 1 && b.code == SP_EINTERNAL && strcmp(b.sqlstate, "22P02") == 0);
    CHECK(c.done == 1 && c.code == SP_OK);
    /* Many at once: more than the pool, all answered in order of completion. */
    struct result many[50];
    memset(many, 0, sizeof(many));
    int total = 0;
    for (int i = 0; i < 50; i++) {
        char n[16];
        snprintf(n, sizeof(n), "%d", i);
        const char *pp[] = {n};
        CHECK(sp_store_query(s, "SELECT $1::int * 2", 1, pp, on_res, &many[i], &e) == 0);
    }
    for (int t = 0; t < 500 && total < 50; t++) {
        sp_loop_run_once(loop, 10);
        total = 0;
        for (int i = 0; i < 50; i++)
            total += many[i].done;
    }
    CHECK(total == 50);
    for (int i = 0; i < 50; i++)
        CHECK(atoi(many[i].value) == i * 2);
}

/* Statements run prepared per connection: the same text again and again, a text that does not
 * parse (its error each time: a failed Prepare is not kept), a statement whose prepared form
 * sees a table made after it was first run, and more distinct texts than one connection
 * prepares (the rest run unprepared). */
static void test_store_prepared(sp_store_t *s)
{
    sp_err_t e;
    for (int round = 0; round < 3; round++) {
        struct result ok = {0}, bad = {0};
        const char *p[] = {"21"};
        CHECK(sp_store_query(s, "SELECT $1::int * 2", 1, p, on_res, &ok, &e) == 0);
        CHECK(sp_store_query(s, "SELEC 1", 0, NULL, on_res, &bad, &e) == 0);
        run_until(&ok.done, 1, 5000);
        run_until(&bad.done, 1, 5000);
        CHECK(ok.code == SP_OK && strcmp(ok.value, "42") == 0);
        CHECK(bad.code == SP_EINTERNAL && strcmp(bad.sqlstate, "42601") == 0);
    }
    struct result t0 = {0}, mk = {0}, t1 = {0};
    const char *q = "SELECT count(*) FROM pg_class WHERE relname = 'sp_prep_t'";
    CHECK(sp_store_query(s, q, 0, NULL, on_res, &t0, &e) == 0);
    run_until(&t0.done, 1, 5000);
    CHECK(sp_store_query(s, "CREATE TABLE sp_prep_t (x int)", 0, NULL, on_res, &mk, &e) == 0);
    run_until(&mk.done, 1, 5000);
    CHECK(sp_store_query(s, q, 0, NULL, on_res, &t1, &e) == 0);
    run_until(&t1.done, 1, 5000);
    CHECK(strcmp(t0.value, "0") == 0 && mk.code == SP_OK && strcmp(t1.value, "1") == 0);
    /* One at a time, so they all land on the first idle connection: past its 128. */
    for (int i = 0; i < 200; i++) {
        struct result r = {0};
        char sql[64], want[16];
        snprintf(sql, sizeof(sql), "SELECT %d + 0", i);
        snprintf(want, sizeof(want), "%d", i);
        CHECK(sp_store_query(s, sql, 0, NULL, on_res, &r, &e) == 0);
        run_until(&r.done, 1, 5000);
        CHECK(r.code == SP_OK && strcmp(r.value, want) == 0);
    }
}

/* More statements at once than the pool has connections, so that they go several to a
 * connection (its pipeline): each answered with its own result, a failing one (at run time, or
 * a text that does not prepare) failing alone, the others around it untouched; then again. */
static void test_store_pipelined(sp_store_t *s)
{
    sp_err_t e;
    for (int round = 0; round < 2; round++) {
        enum { N = 60 };
        struct result r[N];
        memset(r, 0, sizeof(r));
        char nums[N][16];
        for (int i = 0; i < N; i++) {
            snprintf(nums[i], sizeof(nums[i]), "%d", i);
            const char *p[] = {nums[i]};
            const char *sql = i % 7 == 3    ? "SELECT 100 / ($1::int - $1::int)"
                              : i % 11 == 5 ? "SELEC $1"
                                            : "SELECT $1::int + 1000";
            CHECK(sp_store_query(s, sql, 1, p, on_res, &r[i], &e) == 0);
        }
        for (int i = 0; i < N; i++)
            run_until(&r[i].done, 1, 10000);
        for (int i = 0; i < N; i++) {
            CHECK(r[i].done == 1);
            if (i % 7 == 3) {
                CHECK(r[i].code == SP_EINTERNAL && strcmp(r[i].sqlstate, "22012") == 0);
            } else if (i % 11 == 5) {
                CHECK(r[i].code == SP_EINTERNAL);
            } else {
                CHECK(r[i].code == SP_OK && atoi(r[i].value) == i + 1000);
            }
        }
    }
    /* the text that did not prepare is not kept: alone, its own error again */
    struct result bad = {0};
    const char *p[] = {"1"};
    CHECK(sp_store_query(s, "SELEC $1", 1, p, on_res, &bad, &e) == 0);
    run_until(&bad.done, 1, 5000);
    CHECK(bad.code == SP_EINTERNAL && strcmp(bad.sqlstate, "42601") == 0);
}

/* A write waiting on a lock another transaction holds keeps its connection's pipeline
 * closed: the reads sent in the same turn (more than the pool has connections) all answer
 * while it waits, and it answers once the lock is let go. Before, a read sent right after
 * it could queue behind it on its connection until the lock went (server.outage's health
 * check behind the worker's registration). */
static void test_store_write_closes_pipeline(sp_store_t *s)
{
    sp_err_t e;
    PGconn *holder = PQconnectdb(dsn);
    REQUIRE(PQstatus(holder) == CONNECTION_OK);
    const char *hold[] = {"CREATE TABLE IF NOT EXISTS pipe_lock (v int)", "BEGIN",
                          "LOCK TABLE pipe_lock IN SHARE MODE"};
    PGresult *r;
    for (size_t i = 0; i < sizeof(hold) / sizeof(hold[0]); i++) {
        r = PQexec(holder, hold[i]);
        CHECK(PQresultStatus(r) == PGRES_COMMAND_OK);
        PQclear(r);
    }
    struct result w = {0};
    enum { N = 9 }; /* three connections, three pipelined reads each */
    struct result rd[N];
    memset(rd, 0, sizeof(rd));
    char nums[N][16];
    const char *one[] = {"7"};
    CHECK(sp_store_query(s, "INSERT INTO pipe_lock VALUES ($1::int) RETURNING v", 1, one, on_res,
                         &w, &e) == 0);
    for (int i = 0; i < N; i++) {
        snprintf(nums[i], sizeof(nums[i]), "%d", i);
        const char *p[] = {nums[i]};
        CHECK(sp_store_query(s, "SELECT $1::int + 2000", 1, p, on_res, &rd[i], &e) == 0);
    }
    for (int i = 0; i < N; i++) {
        run_until(&rd[i].done, 1, 3000);
        CHECK(rd[i].done == 1 && rd[i].code == SP_OK && atoi(rd[i].value) == i + 2000);
    }
    CHECK(w.done == 0); /* still waiting on the lock */
    r = PQexec(holder, "COMMIT");
    CHECK(PQresultStatus(r) == PGRES_COMMAND_OK);
    PQclear(r);
    run_until(&w.done, 1, 5000);
    CHECK(w.done == 1 && w.code == SP_OK && strcmp(w.value, "7") == 0);
    PQclear(PQexec(holder, "DROP TABLE pipe_lock"));
    PQfinish(holder);
}

/* What a callback keeps of a whole result: the rows of its first columns. */
struct rows {
    int done;
    sp_code_t code;
    int n;
    char v[16][4][48];
    char time[16][48];
    long long us[16];
    int us_rc[16];
};

static void on_rows(void *arg, PGresult *res, const sp_err_t *err)
{
    struct rows *r = arg;
    r->done++;
    r->code = err ? err->code : SP_OK;
    if (err != NULL)
        return;
    r->n = PQntuples(res) < 16 ? PQntuples(res) : 16;
    for (int i = 0; i < r->n; i++) {
        for (int j = 0; j < PQnfields(res) && j < 4; j++)
            SP_STORE_TEXT(res, i, j, r->v[i][j]);
        SP_STORE_TIME(res, i, 0, r->time[i]);
        r->us_rc[i] = sp_store_time_us(res, i, 0, &r->us[i]);
    }
}

/* sp_store_time and sp_store_time_us give what to_char(... 'YYYY-MM-DD"T"HH24:MI:SS.MS"Z"') and
 * extract(epoch) * 1000000 give, on the pool's connections (DateStyle ISO; test_store_conninfo
 * shows it wins over the conninfo's own), for the edges of their forms. */
static void test_store_time(sp_store_t *s)
{
    struct rows r = {0};
    sp_err_t e;
    const char *sql =
        "SELECT t AT TIME ZONE 'UTC',"
        " to_char(t AT TIME ZONE 'UTC', 'YYYY-MM-DD\"T\"HH24:MI:SS.MS\"Z\"'),"
        " CASE WHEN isfinite(t) THEN (extract(epoch FROM t) * 1000000)::bigint::text END,"
        " current_setting('DateStyle')"
        " FROM unnest(ARRAY['2026-12-02 00:25:19.123456+00', '2026-12-02 00:25:19+00',"
        " '2026-12-02 00:25:19.1+00', '2026-12-02 00:25:19.999999+00',"
        " '2024-02-29 23:59:59.000999+00', '1969-12-31 23:59:59.999999+00',"
        " '1970-01-01 00:00:00+00', '0999-03-01 12:00:00.5+00', '12345-06-07 08:09:10.011+00',"
        " '2026-12-02 05:25:19.5+05:00', 'infinity', NULL]::timestamptz[]) t";
    CHECK(sp_store_query(s, sql, 0, NULL, on_rows, &r, &e) == 0);
    run_until(&r.done, 1, 5000);
    REQUIRE(r.code == SP_OK && r.n == 12);
    CHECK(strncmp(r.v[0][3], "ISO", 3) == 0);
    for (int i = 0; i < r.n; i++) {
        if (strcmp(r.time[i], r.v[i][1]) != 0)
            fprintf(stderr, "time %s: %s, to_char %s\n", r.v[i][0], r.time[i], r.v[i][1]);
        CHECK(strcmp(r.time[i], r.v[i][1]) == 0);
        if (r.v[i][2][0] == '\0' || strcmp(r.v[i][0], "infinity") == 0) {
            CHECK(r.us_rc[i] == -1); /* NULL, infinity */
            continue;
        }
        CHECK(r.us_rc[i] == 0 && r.us[i] == atoll(r.v[i][2]));
    }
    CHECK(strcmp(r.time[0], "2026-12-02T00:25:19.123Z") == 0);
    CHECK(strcmp(r.time[11], "") == 0);
    struct rows one = {0};
    CHECK(sp_store_query(s, "SELECT '2026-12-02 00:25:19'::timestamp", 0, NULL, on_rows, &one,
                         &e) == 0);
    run_until(&one.done, 1, 5000);
    CHECK(one.code == SP_OK && strcmp(one.time[0], "2026-12-02T00:25:19.000Z") == 0);
}

/* The conninfo's own options are kept beside the DateStyle the store adds; a conninfo that does
 * not parse makes a store whose statements fail as unavailable, as before it was parsed. */
static void test_store_conninfo(void)
{
    sp_err_t e;
    char ci[1024];
    snprintf(ci, sizeof(ci), "%s options='-c application_name=sp_opt_test -c DateStyle=SQL'", dsn);
    sp_store_t *s = sp_store_create(loop, ci, 1, &e);
    REQUIRE(s != NULL);
    struct rows r = {0};
    CHECK(sp_store_query(s,
                         "SELECT current_setting('application_name'),"
                         " current_setting('DateStyle')",
                         0, NULL, on_rows, &r, &e) == 0);
    run_until(&r.done, 1, 5000);
    CHECK(r.code == SP_OK && strcmp(r.v[0][0], "sp_opt_test") == 0 &&
          strncmp(r.v[0][1], "ISO", 3) == 0);
    sp_store_destroy(s);
    sp_store_t *bad = sp_store_create(loop, "host='unterminated", 1, &e);
    REQUIRE(bad != NULL);
    for (int i = 0; i < 20; i++)
        sp_loop_run_once(loop, 10);
    struct result q = {0};
    if (sp_store_query(bad, "SELECT 1", 0, NULL, on_res, &q, &e) == 0) {
        run_until(&q.done, 1, 10000);
        CHECK(q.code == SP_EUNAVAIL);
    } else {
        CHECK(e.code == SP_EUNAVAIL);
    }
    sp_store_destroy(bad);
}

static void test_store_notify(sp_store_t *s, pgfx_note_t *n)
{
    run_until(&n->reconnects, 1, 5000);
    CHECK(n->reconnects >= 1);
    struct result r = {0};
    sp_err_t e;
    /* the listener may still be sending LISTEN; give it a turn */
    for (int i = 0; i < 20; i++)
        sp_loop_run_once(loop, 10);
    CHECK(sp_store_query(s, "SELECT pg_notify('sp_test', 'ping')", 0, NULL, on_res, &r, &e) == 0);
    run_until(&n->got, 1, 5000);
    CHECK(n->got == 1 && strcmp(n->payload, "ping") == 0);
}

static pgfx_t g_pg;
static int stop_cluster(void);

static void test_store_outage_and_recovery(sp_store_t *s, sp_pgcluster_t *cl, pgfx_note_t *n)
{
    if (cl == NULL)
        return; /* an external server is not ours to stop */
    sp_err_t e;
    int before = n->reconnects;
    /* Stop the server under the pool (fast shutdown terminates every session). */
    struct result r = {0};
    CHECK(stop_cluster() == 0);
    for (int i = 0; i < 50; i++)
        sp_loop_run_once(loop, 10);
    int rc = sp_store_query(s, "SELECT 1", 0, NULL, on_res, &r, &e);
    if (rc == 0) {
        run_until(&r.done, 1, 10000);
        CHECK(r.code == SP_EUNAVAIL);
    } else {
        CHECK(e.code == SP_EUNAVAIL);
    }
    CHECK(!sp_store_up(s) || r.code == SP_EUNAVAIL);
    CHECK(sp_pgcluster_ensure_running(cl, &e) == 0);
    /* Recovers by itself: a query succeeds within a few seconds. */
    struct result ok = {.code = SP_EUNAVAIL};
    for (int t = 0; t < 100 && ok.code != SP_OK; t++) {
        memset(&ok, 0, sizeof(ok));
        ok.code = SP_EUNAVAIL;
        if (sp_store_query(s, "SELECT 42", 0, NULL, on_res, &ok, &e) == 0)
            run_until(&ok.done, 1, 2000);
        else
            for (int i = 0; i < 10; i++)
                sp_loop_run_once(loop, 10);
    }
    if (ok.code != SP_OK)
        fprintf(stderr, "recovery: code=%d value=%s state=%s\n", ok.code, ok.value, ok.sqlstate);
    CHECK(ok.code == SP_OK && strcmp(ok.value, "42") == 0);
    /* Statements prepared before the restart (test_store_prepared) are prepared again on the new
     * connections: several at once, so every connection of the pool runs one. */
    struct result again[8];
    memset(again, 0, sizeof(again));
    const char *p21[] = {"21"};
    for (int i = 0; i < 8; i++)
        CHECK(sp_store_query(s, "SELECT $1::int * 2", 1, p21, on_res, &again[i], &e) == 0);
    for (int i = 0; i < 8; i++) {
        run_until(&again[i].done, 1, 5000);
        CHECK(again[i].code == SP_OK && strcmp(again[i].value, "42") == 0);
    }
    run_until(&n->reconnects, before + 1, 5000);
    CHECK(n->reconnects > before); /* the listener came back and said so */
}

static int stop_cluster(void)
{
    char cmd[1024];
    const char *as = geteuid() == 0 ? "runuser -u postgres -- " : "";
    snprintf(
        cmd, sizeof(cmd),
        "%s$(ls -d /usr/lib/postgresql/*/bin | sort -V | tail -1)/pg_ctl -D %s/pg/data -m fast "
        "-w stop >/dev/null 2>&1",
        as, g_pg.tmp);
    return system(cmd) == 0 ? 0 : -1;
}

int main(void)
{
    sp_err_t e;
    test_store_rows_and_text(); /* needs no server */
    int rc = pgfx_start(&g_pg, "store");
    if (rc != 0)
        return rc;
    dsn = g_pg.dsn;
    loop = sp_loop_create();
    test_store_migrations_apply_once();
    sp_store_t *s = sp_store_create(loop, dsn, 3, &e);
    CHECK(s != NULL);
    pgfx_note_t n = {0};
    CHECK(sp_store_listen(s, "sp_test", pgfx_on_note, &n, &e) == 0);
    test_store_queries_and_errors(s);
    test_store_prepared(s);
    test_store_pipelined(s);
    test_store_write_closes_pipeline(s);
    test_store_time(s);
    test_store_conninfo();
    test_store_notify(s, &n);
    test_store_outage_and_recovery(s, g_pg.cluster, &n);
    sp_store_destroy(s);
    sp_loop_destroy(loop);
    pgfx_stop(&g_pg);
    return check_report("store");
}
