/*
 * store.h - PostgreSQL on the event loop: a small pool of asynchronous libpq
 * connections, and one listening connection for LISTEN/NOTIFY.
 *
 * Folder: core/store/ is PostgreSQL for core: this pool, migrations, the embedded cluster.
 * (ARCHITECTURE.md: the layers.)
 *
 * Every statement is one round trip with $n parameters (text format); the
 * core keeps multi-step changes atomic by writing them as one statement with
 * data-modifying CTEs. When the server goes away, calls fail with SP_EUNAVAIL
 * at once (no connection) or when their connection breaks, and the pool
 * reconnects by itself in the background. Every connection runs with DateStyle ISO, so a
 * timestamp selected as `x AT TIME ZONE 'UTC'` arrives as "2026-12-02 00:25:19.123456", which
 * sp_store_time turns into the API's form far cheaper than PostgreSQL's to_char (per row and
 * column, it was most of what a list cost the server). Knows no HTTP and no schema.
 */
#ifndef SP_STORE_H
#define SP_STORE_H

#include <libpq-fe.h>
#include <stdbool.h>

#include "base/err.h"
#include "loop/loop.h"

typedef struct sp_store sp_store_t;

/*
 * Result callback, called exactly once per accepted query, never before
 * sp_store_query returns. On success err is NULL and res is a
 * PGRES_TUPLES_OK/COMMAND_OK result. On failure err is set (SP_EUNAVAIL when
 * the database is unreachable or the query timed out, SP_EINTERNAL for a
 * server-side error) and res is the error result when there is one (for its
 * SQLSTATE) or NULL. res is borrowed: it is cleared after the callback.
 */
typedef void (*sp_store_cb)(void *arg, PGresult *res, const sp_err_t *err);

/* Notification callback: payload is NULL once after each (re)connect of the listener, meaning "re-scan, you may have missed some". */
typedef void (*sp_store_notify_cb)(void *arg, const char *channel, const char *payload);

/* Opens pool_size connections in the background; a server that is down is not an error here. */
sp_store_t *sp_store_create(sp_loop_t *loop, const char *conninfo, int pool_size, sp_err_t *err);
/* Fails every pending query with SP_EUNAVAIL (callbacks run inside this call) and closes. NULL does nothing. */
void sp_store_destroy(sp_store_t *s);

/* Queues one statement. params are copied. -1 with SP_EUNAVAIL when no connection is up. */
int sp_store_query(sp_store_t *s, const char *sql, int nparams, const char *const *params,
                   sp_store_cb cb, void *arg, sp_err_t *err);

/*
 * A statement with a record of the caller's own, the shape of every caller that keeps who asked
 * and what to call back per statement: allocates a zeroed record of size bytes, queues the
 * statement, and once its answer arrived calls done(record, res, err) and frees the record. The
 * answer never comes before this returns, so the caller fills the record afterwards. NULL with
 * err set (and nothing queued, nothing to free) when it cannot be allocated or queued.
 */
typedef void (*sp_store_rec_cb)(void *rec, PGresult *res, const sp_err_t *err);
void *sp_store_call(sp_store_t *s, const char *sql, int nparams, const char *const *params,
                    size_t size, sp_store_rec_cb done, sp_err_t *err);

/* The record most callers keep per statement: who asked, the callback that answers them (cast
 * back by done) and its argument, and one int of the caller's (a kind, a limit). */
typedef struct {
    void *owner;
    void *cb;
    void *arg;
    int flag;
} sp_store_req_t;

/* sp_store_call with an sp_store_req_t filled from the arguments; done gets it as rec. */
int sp_store_submit(sp_store_t *s, const char *sql, int nparams, const char *const *params,
                    sp_store_rec_cb done, void *owner, void *cb, void *arg, int flag,
                    sp_err_t *err);

/* What a read of one row tells its caller: the query's own error, else code/msg (set in *buf)
 * when res does not hold exactly one row, else NULL (the row is there). */
const sp_err_t *sp_store_one_row(const PGresult *res, const sp_err_t *err, sp_code_t code,
                                 const char *msg, sp_err_t *buf);

/* What a read of a list tells its caller: records for its rows, PQntuples(res) + 1 of size bytes
 * each, zeroed (one more than the rows: never an allocation of nothing), for the caller to free;
 * or NULL with *fail set: to the query's own error, else (none not NULL) to code/none in *buf
 * when there are no rows, else to SP_EINTERNAL in *buf (out of memory). */
void *sp_store_rows(const PGresult *res, const sp_err_t *err, sp_code_t code, const char *none,
                    size_t size, const sp_err_t **fail, sp_err_t *buf);

/* The text of column col of row copied into dst (cap bytes), cut to cap - 1 bytes; NULL reads as
 * "". SP_STORE_TEXT fills a char array member: SP_STORE_TEXT(res, i, 0, rec->name). */
void sp_store_text(const PGresult *res, int row, int col, char *dst, size_t cap);
#define SP_STORE_TEXT(res, row, col, field)                                                        \
    sp_store_text((res), (row), (col), (field), sizeof(field))

/* Column col of row, a timestamp selected as `x AT TIME ZONE 'UTC'`, into dst in the API's form
 * "2026-12-02T00:25:19.123Z": milliseconds cut, not rounded (what to_char's MS gives), cut to cap
 * - 1 bytes. "" for NULL and for a value not of that form (infinity). SP_STORE_TIME fills a char
 * array member like SP_STORE_TEXT. */
void sp_store_time(const PGresult *res, int row, int col, char *dst, size_t cap);
#define SP_STORE_TIME(res, row, col, field)                                                        \
    sp_store_time((res), (row), (col), (field), sizeof(field))

/* The same column as microseconds since 1970-01-01 UTC (what extract(epoch) * 1000000 gives);
 * -1 with nothing read for NULL and for a value not of that form. */
int sp_store_time_us(const PGresult *res, int row, int col, long long *us);

/* A list's cursor, "<created_at in epoch microseconds>_<id>" (keyset pagination over
 * (created_at, id); the microseconds as sp_store_time_us reads them): its 1 to 19 digits into
 * micros, its id into id (cap bytes) once valid_id accepts it and it fits. -1 when it is not of
 * that form (micros and id then hold nothing to use). */
int sp_store_cursor_parse(const char *cur, bool (*valid_id)(const char *id), char micros[20],
                          char *id, size_t cap);

/* Subscribes to channel on the listening connection (re-LISTENed after each reconnect). */
int sp_store_listen(sp_store_t *s, const char *channel, sp_store_notify_cb cb, void *arg,
                    sp_err_t *err);

/* The longest a broken connection waits before its next attempt (the backoff doubles from
 * 100 ms up to this): once the database is back, every node's connections are again within
 * this much. */
#define SP_STORE_BACKOFF_MAX_MS 2000

/* True when at least one pool connection is up. */
bool sp_store_up(const sp_store_t *s);

/* SQLSTATE of an error result ("23505"), or "" */
const char *sp_store_sqlstate(const PGresult *res);

/* The SQLSTATE the schema's quota function (space_team_quota, core/store/migrate.c) raises
 * when a team is over a quota. A statement failing with it fails with SP_EQUOTA and the
 * error's primary message, which that function writes for clients (the quota, its limit and
 * the team's use; nothing else). */
#define SP_STORE_QUOTA_STATE "SPQTA"

/* The SQLSTATE the placement function (space_place, core/store/migrate.c) raises when no
 * worker has room: the statement fails with SP_ECAPACITY and the function's message. */
#define SP_STORE_CAPACITY_STATE "SPCAP"

#endif
