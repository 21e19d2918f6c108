/*
 * migrate.h - the versioned schema, applied at start.
 *
 * Migrations are compiled in (core/store/migrate.c), numbered from 1, each applied
 * in its own transaction together with its row in schema_migrations. A
 * transaction-scoped advisory lock serialises servers that start on one
 * database at once, so none is applied twice. Blocking: for start-up only.
 */
#ifndef SP_MIGRATE_H
#define SP_MIGRATE_H

#include <libpq-fe.h>

#include "base/err.h"

/* Applies what is missing; *applied gets how many were. */
int sp_migrate_apply(PGconn *c, int *applied, sp_err_t *err);

/* Highest version compiled in. */
int sp_migrate_latest(void);

#endif
