/*
 * secrets_fixture.h - what test_secrets.c and test_mitm.c share: a PostgreSQL to run
 * against (core/store/tests/pgfixture.h) with the schema applied, the loop, and a few rows
 * (teams, a template, sandboxes) written with blocking libpq.
 */
#ifndef SP_SECRETS_FIXTURE_H
#define SP_SECRETS_FIXTURE_H

#include <libpq-fe.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/store/migrate.h"
#include "core/store/tests/pgfixture.h"
#include "loop/loop.h"
#include "tests/check.h"

static sp_loop_t *loop;
static const char *dsn;
static pgfx_t fx_pg;

/* Runs the loop until *flag reaches want or ms pass. */
static inline void run_until(int *flag, int want, int ms)
{
    for (int i = 0; i < ms / 5 && *flag < want; i++)
        sp_loop_run_once(loop, 5);
}

static inline void run_for(int ms)
{
    for (int i = 0; i < ms / 5; i++)
        sp_loop_run_once(loop, 5);
}

/* 0 ok, 77 skip, 1 failure. */
static inline int fx_start(const char *name)
{
    sp_err_t e;
    int rc = pgfx_start(&fx_pg, name);
    if (rc != 0)
        return rc;
    dsn = fx_pg.dsn;
    PGconn *c = PQconnectdb(dsn);
    int applied = 0;
    rc = PQstatus(c) == CONNECTION_OK ? sp_migrate_apply(c, &applied, &e) : -1;
    PQfinish(c);
    if (rc < 0) {
        fprintf(stderr, "migrate failed\n");
        return 1;
    }
    loop = sp_loop_create();
    return 0;
}

static inline void fx_stop(void)
{
    sp_loop_destroy(loop);
    pgfx_stop(&fx_pg);
}

/* Runs one statement with parameters; returns the first value (static buffer) or NULL. */
static inline const char *fx_sql(const char *sql, int n, const char *const *p)
{
    static char out[8192];
    PGconn *c = PQconnectdb(dsn);
    PGresult *r = PQexecParams(c, sql, n, NULL, p, NULL, NULL, 0);
    ExecStatusType st = PQresultStatus(r);
    const char *ret = NULL;
    if (st == PGRES_TUPLES_OK && PQntuples(r) > 0) {
        snprintf(out, sizeof(out), "%s", PQgetvalue(r, 0, 0));
        ret = out;
    } else if (st == PGRES_COMMAND_OK || st == PGRES_TUPLES_OK) {
        out[0] = '\0';
        ret = out;
    } else {
        fprintf(stderr, "sql failed: %s\n", PQresultErrorMessage(r));
    }
    PQclear(r);
    PQfinish(c);
    return ret;
}

/* A team, the template and a running sandbox of that team (ids are test-chosen). */
static inline void fx_sandbox(const char *team, const char *sandbox)
{
    const char *t[] = {team};
    fx_sql("INSERT INTO teams (id, name) VALUES ($1, $1) ON CONFLICT DO NOTHING", 1, t);
    fx_sql("INSERT INTO templates (name) VALUES ('base') ON CONFLICT DO NOTHING", 0, NULL);
    const char *s[] = {sandbox, team};
    fx_sql("INSERT INTO sandboxes (id, team_id, template, cpu_count, memory_mb, access_token,"
           " observed_state) VALUES ($1, $2, 'base', 1, 256, 'tok' || $1, 'running')",
           2, s);
}

#endif
