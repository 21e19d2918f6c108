/*
 * pgcluster.h - the private PostgreSQL cluster `spaced serve` runs when no
 * --database-url is given.
 *
 * Layout, all under <data-dir>/pg (mode 0700, owned by the cluster user):
 *   data/          PGDATA (initdb on first run; config rewritten every start)
 *   run/           unix socket directory; the only way in (no TCP)
 *   log/           postgres.log (pg_ctl) and postgres-<Day>.log (collector)
 *   .spaced.lock   flock held by the managing spaced process
 *
 * As root the cluster runs as Debian's `postgres` system user (PostgreSQL
 * refuses root); otherwise as the current user. Clients authenticate by peer
 * credentials (kernel-checked uid on the socket) mapped to the database
 * superuser `postgres`; no password exists anywhere.
 *
 * Every call blocks (fork/exec of initdb and pg_ctl): start-up and shut-down
 * code only, never the request path. The caller must not reap children with
 * waitpid(-1) or set SIGCHLD to SIG_IGN while a call runs.
 */
#ifndef SP_PGCLUSTER_H
#define SP_PGCLUSTER_H

#include <stddef.h>

#include "base/err.h"

typedef struct sp_pgcluster sp_pgcluster_t;

/* 1 if PostgreSQL server binaries were found (and, when running as root, the
 * `postgres` system user exists); 0 otherwise. Logs nothing. */
int sp_pgcluster_available(void);

/* Makes sure the cluster in <data_dir>/pg exists and runs, and that database
 * `space` exists. data_dir is created (one level) if missing; when root it is
 * made traversable by others (0711-style) so the cluster user can reach its
 * folder. First run: initdb, then pg_ctl start -w. A postmaster left running
 * by an earlier spaced (killed without stopping it) is reused as is.
 * Fails with SP_ECONFLICT while another process manages the same data_dir,
 * SP_EUNAVAIL when PostgreSQL is missing or does not start, SP_EINVAL for an
 * unusable data_dir. The returned handle is the caller's; free it with
 * sp_pgcluster_stop(). */
sp_pgcluster_t *sp_pgcluster_start(const char *data_dir, sp_err_t *err);

/* Management commands beside a running `spaced serve`: 1 when another process manages the
 * cluster of data_dir (holds its lock), with that cluster's conninfo (as
 * sp_pgcluster_conninfo) in out; 0 when nobody does (start it with sp_pgcluster_start);
 * -1 when the lock cannot be read (e.g. another user's data directory). Starts and locks
 * nothing, so a serve starting meanwhile still can. */
int sp_pgcluster_attach(const char *data_dir, char *out, size_t cap, sp_err_t *err);

/* libpq conninfo for database `space`, e.g.
 * "host='/var/lib/space/pg/run' port=5432 dbname=space user=postgres".
 * Borrowed: valid until sp_pgcluster_stop(c). */
const char *sp_pgcluster_conninfo(const sp_pgcluster_t *c);

/* 1 if the postmaster is alive (pg_ctl status), 0 if not. */
int sp_pgcluster_running(const sp_pgcluster_t *c);

/* Starts the postmaster again if it died (0 if it runs on return). */
int sp_pgcluster_ensure_running(sp_pgcluster_t *c, sp_err_t *err);

/* pg_ctl stop -m fast -w, then frees c (also on failure) and releases the
 * lock. c == NULL does nothing and returns 0. */
int sp_pgcluster_stop(sp_pgcluster_t *c, sp_err_t *err);

#endif
