/*
 * pgfixture.h - what the C suites that run against a real PostgreSQL share (test_store.c,
 * and core/egress/tests/secrets_fixture.h for test_secrets.c and test_mitm.c): the server
 * (SP_TEST_PG_DSN when set, else a private cluster, core/store/pgcluster, in a temporary
 * directory, removed at the end unless SP_TEST_KEEP is set), and a recorder of LISTEN
 * notifications. It applies no schema: each suite does (or tests) that.
 */
#ifndef SP_PGFIXTURE_H
#define SP_PGFIXTURE_H

#include <stdio.h>
#include <stdlib.h>

#include "core/store/pgcluster.h"

typedef struct {
    const char *dsn;         /* the server's conninfo */
    sp_pgcluster_t *cluster; /* the private cluster; NULL with SP_TEST_PG_DSN */
    char tmp[256];           /* its directory */
} pgfx_t;

/* Finds or starts the server; name goes into the directory's name. 0 ok, 77 skip (no
 * PostgreSQL installed, said on stdout), 1 failure. */
static inline int pgfx_start(pgfx_t *f, const char *name)
{
    sp_err_t e;
    f->cluster = NULL;
    f->dsn = getenv("SP_TEST_PG_DSN");
    if (f->dsn != NULL && f->dsn[0] != '\0')
        return 0;
    if (!sp_pgcluster_available()) {
        printf("skip: PostgreSQL is not installed\n");
        return 77;
    }
    snprintf(f->tmp, sizeof(f->tmp), "/tmp/sp-%s-XXXXXX", name);
    if (mkdtemp(f->tmp) == NULL)
        return 1;
    f->cluster = sp_pgcluster_start(f->tmp, &e);
    if (f->cluster == NULL) {
        fprintf(stderr, "cluster: %s\n", e.msg);
        return 1;
    }
    f->dsn = sp_pgcluster_conninfo(f->cluster);
    return 0;
}

/* Stops a private cluster and removes its directory (kept with SP_TEST_KEEP). */
static inline void pgfx_stop(pgfx_t *f)
{
    sp_err_t e;
    if (f->cluster == NULL)
        return;
    sp_pgcluster_stop(f->cluster, &e);
    f->cluster = NULL;
    char cmd[512];
    snprintf(cmd, sizeof(cmd), "rm -rf %s", f->tmp);
    if (getenv("SP_TEST_KEEP") == NULL && system(cmd) != 0)
        fprintf(stderr, "cleanup failed\n");
}

/* What an sp_store_listen callback (pgfx_on_note) saw: notifications, and reconnects (the
 * NULL payload the store sends when its listener came back). */
typedef struct {
    int got, reconnects;
    char payload[128]; /* the last notification's */
} pgfx_note_t;

static inline void pgfx_on_note(void *arg, const char *ch, const char *payload)
{
    pgfx_note_t *n = arg;
    (void)ch;
    if (payload == NULL) {
        n->reconnects++;
        return;
    }
    n->got++;
    snprintf(n->payload, sizeof(n->payload), "%s", payload);
}

#endif
