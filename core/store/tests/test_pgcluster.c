/*
 * test_pgcluster.c - a real embedded cluster in a temp dir: first start,
 * restart with data kept, a stale postmaster.pid naming another process,
 * reuse after the manager was SIGKILLed, recovery after the postmaster was
 * SIGKILLed, the second-manager lock, an unsafe path.
 *
 * Label `pg`. Exits 77 without PostgreSQL server binaries (or, as root,
 * without the `postgres` system user). Takes a few seconds.
 */
#include "core/store/pgcluster.h"
#include "tests/check.h"

#include <errno.h>
#include <ftw.h>
#include <libpq-fe.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

static char dir[64];

static double now_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec * 1000.0 + (double)ts.tv_nsec / 1e6;
}

/* Runs sql; returns the first value of the first row (malloc'd) or NULL. */
static char *query1(const sp_pgcluster_t *c, const char *sql)
{
    PGconn *pg = PQconnectdb(sp_pgcluster_conninfo(c));
    if (PQstatus(pg) != CONNECTION_OK) {
        fprintf(stderr, "connect: %s", PQerrorMessage(pg));
        PQfinish(pg);
        return NULL;
    }
    PGresult *r = PQexec(pg, sql);
    char *v = NULL;
    if (PQresultStatus(r) == PGRES_TUPLES_OK && PQntuples(r) > 0)
        v = strdup(PQgetvalue(r, 0, 0));
    else if (PQresultStatus(r) == PGRES_COMMAND_OK)
        v = strdup("");
    else
        fprintf(stderr, "query %s: %s", sql, PQresultErrorMessage(r));
    PQclear(r);
    PQfinish(pg);
    return v;
}

static int query_is(const sp_pgcluster_t *c, const char *sql, const char *want)
{
    char *v = query1(c, sql);
    int ok = v != NULL && strcmp(v, want) == 0;
    if (v != NULL && !ok)
        fprintf(stderr, "query %s: got '%s' want '%s'\n", sql, v, want);
    free(v);
    return ok;
}

static long postmaster_pid(void)
{
    char p[128];
    snprintf(p, sizeof(p), "%s/pg/data/postmaster.pid", dir);
    FILE *f = fopen(p, "r");
    if (f == NULL)
        return 0;
    long pid = 0;
    if (fscanf(f, "%ld", &pid) != 1)
        pid = 0;
    fclose(f);
    return pid;
}

static sp_pgcluster_t *start_timed(const char *what)
{
    sp_err_t err = {0};
    double t0 = now_ms();
    sp_pgcluster_t *c = sp_pgcluster_start(dir, &err);
    double t1 = now_ms();
    if (c == NULL)
        fprintf(stderr, "start (%s) failed: code=%d msg=%s\n", what, err.code, err.msg);
    else
        printf("TIMING %s: %.0f ms\n", what, t1 - t0);
    return c;
}

static void test_pgcluster_first_start(sp_pgcluster_t **cp)
{
    sp_pgcluster_t *c = *cp = start_timed("first run (initdb + start + createdb)");
    CHECK(c != NULL);
    if (c == NULL)
        return;
    CHECK(strstr(sp_pgcluster_conninfo(c), "dbname=space") != NULL);
    CHECK(strstr(sp_pgcluster_conninfo(c), "/pg/run") != NULL);
    CHECK(sp_pgcluster_running(c) == 1);
    CHECK(query_is(c, "SELECT 1", "1"));
    CHECK(query_is(c, "SHOW listen_addresses", ""));
    CHECK(query_is(c, "SHOW fsync", "on"));
    CHECK(query_is(c, "SHOW max_connections", "50"));
    CHECK(query_is(c, "SELECT current_database()", "space"));
    CHECK(query_is(c, "CREATE TABLE kept (v int)", ""));
    CHECK(query_is(c, "INSERT INTO kept VALUES (42)", ""));

    struct stat st;
    char p[128];
    snprintf(p, sizeof(p), "%s/pg", dir);
    CHECK(stat(p, &st) == 0 && (st.st_mode & 07777) == 0700);
    if (geteuid() == 0) {
        CHECK(st.st_uid != 0); /* handed to the postgres user */
        CHECK(stat(dir, &st) == 0 && (st.st_mode & 0011) == 0011);
    }
}

static void test_pgcluster_second_manager_locked(void)
{
    sp_err_t err = {0};
    sp_pgcluster_t *c2 = sp_pgcluster_start(dir, &err);
    CHECK(c2 == NULL);
    CHECK(err.code == SP_ECONFLICT);
    CHECK(strstr(err.msg, "another spaced") != NULL);
    CHECK(strchr(err.msg, '/') == NULL); /* no paths for clients */
    sp_pgcluster_stop(c2, NULL);
}

static void test_pgcluster_restart_keeps_data(sp_pgcluster_t **cp)
{
    sp_err_t err = {0};
    CHECK(sp_pgcluster_stop(*cp, &err) == 0);
    *cp = NULL;
    CHECK(postmaster_pid() == 0); /* pg_ctl stop -w removed it */
    sp_pgcluster_t *c = *cp = start_timed("warm start (existing cluster, server stopped)");
    CHECK(c != NULL);
    if (c != NULL)
        CHECK(query_is(c, "SELECT v FROM kept", "42"));
}

/* After a reboot the pid in a stale postmaster.pid can be a live process
 * that is not postgres; pg_ctl status would call the server running. */
static void test_pgcluster_ignores_stale_pidfile(sp_pgcluster_t **cp)
{
    CHECK(sp_pgcluster_stop(*cp, NULL) == 0);
    *cp = NULL;
    fflush(NULL);
    pid_t other = fork();
    if (other == 0) {
        pause();
        _exit(0);
    }
    char p[128];
    snprintf(p, sizeof(p), "%s/pg/data/postmaster.pid", dir);
    FILE *f = fopen(p, "w");
    CHECK(f != NULL);
    if (f != NULL) {
        fprintf(f, "%ld\n%s/pg/data\n", (long)other, dir);
        fclose(f);
    }
    sp_pgcluster_t *c = *cp = start_timed("start over a stale postmaster.pid");
    CHECK(c != NULL);
    CHECK(postmaster_pid() != (long)other);
    if (c != NULL)
        CHECK(query_is(c, "SELECT v FROM kept", "42"));
    kill(other, SIGKILL);
    waitpid(other, NULL, 0);
}

/* The manager is SIGKILLed: nobody stops the postmaster. The next start
 * must take the lock (postmaster must not have inherited it) and reuse. */
static void test_pgcluster_reuses_orphaned_server(sp_pgcluster_t **cp)
{
    CHECK(sp_pgcluster_stop(*cp, NULL) == 0);
    *cp = NULL;
    fflush(NULL);
    pid_t pid = fork();
    if (pid == 0) {
        sp_pgcluster_t *c = sp_pgcluster_start(dir, NULL);
        if (c == NULL)
            _exit(1);
        raise(SIGKILL);
        _exit(2);
    }
    int st = 0;
    CHECK(pid > 0 && waitpid(pid, &st, 0) == pid);
    CHECK(WIFSIGNALED(st) && WTERMSIG(st) == SIGKILL);
    long before = postmaster_pid();
    CHECK(before > 0 && kill((pid_t)before, 0) == 0);

    sp_pgcluster_t *c = *cp = start_timed("reuse of orphaned running server");
    CHECK(c != NULL);
    if (c == NULL)
        return;
    CHECK(postmaster_pid() == before); /* same postmaster, not restarted */
    CHECK(query_is(c, "SELECT v FROM kept", "42"));
}

static void test_pgcluster_restarts_killed_postmaster(sp_pgcluster_t *c)
{
    if (c == NULL)
        return;
    long pid = postmaster_pid();
    CHECK(pid > 0 && kill((pid_t)pid, SIGKILL) == 0);
    int down = 0;
    for (int i = 0; i < 200 && !down; i++) {
        down = !sp_pgcluster_running(c);
        if (!down)
            usleep(50 * 1000);
    }
    CHECK(down);
    sp_err_t err = {0};
    double t0 = now_ms();
    int rc = sp_pgcluster_ensure_running(c, &err);
    printf("TIMING restart after postmaster SIGKILL (crash recovery): %.0f ms\n", now_ms() - t0);
    if (rc != 0)
        fprintf(stderr, "ensure_running: %s\n", err.msg);
    CHECK(rc == 0);
    CHECK(sp_pgcluster_running(c) == 1);
    CHECK(postmaster_pid() != pid);
    CHECK(query_is(c, "SELECT v FROM kept", "42"));
    CHECK(sp_pgcluster_ensure_running(c, &err) == 0); /* running: no-op */
}

static void test_pgcluster_rejects_unsafe_path(void)
{
    char bad[128];
    snprintf(bad, sizeof(bad), "%s/has space", dir);
    sp_err_t err = {0};
    sp_pgcluster_t *c = sp_pgcluster_start(bad, &err);
    CHECK(c == NULL);
    CHECK(err.code == SP_EINVAL);
    sp_pgcluster_stop(c, NULL);
}

static int rm_one(const char *p, const struct stat *sb, int type, struct FTW *ftw)
{
    (void)sb;
    (void)type;
    (void)ftw;
    return remove(p) != 0 && errno != ENOENT ? -1 : 0;
}

int main(void)
{
    if (!sp_pgcluster_available()) {
        printf("SKIP: PostgreSQL server binaries (or the postgres user) not found\n");
        return 77;
    }
    snprintf(dir, sizeof(dir), "/tmp/sp_pgcluster.XXXXXX");
    if (mkdtemp(dir) == NULL) {
        perror("mkdtemp");
        return 1;
    }
    sp_pgcluster_t *c = NULL;
    test_pgcluster_first_start(&c);
    if (c != NULL) {
        test_pgcluster_second_manager_locked();
        test_pgcluster_restart_keeps_data(&c);
        test_pgcluster_ignores_stale_pidfile(&c);
        test_pgcluster_reuses_orphaned_server(&c);
        test_pgcluster_restarts_killed_postmaster(c);
    }
    test_pgcluster_rejects_unsafe_path();
    if (c != NULL) {
        sp_err_t err = {0};
        CHECK(sp_pgcluster_stop(c, &err) == 0);
    } else {
        /* Leave nothing running behind a failed case. */
        long pid = postmaster_pid();
        if (pid > 0)
            kill((pid_t)pid, SIGTERM), sleep(1);
    }
    if (getenv("SP_TEST_KEEP") == NULL)
        nftw(dir, rm_one, 16, FTW_DEPTH | FTW_PHYS);
    else
        printf("kept %s\n", dir);
    printf("%s (%d failures)\n", failures ? "FAIL" : "PASS", failures);
    return failures ? 1 : 0;
}
