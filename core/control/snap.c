/*
 * snap.c - sandbox snapshots over the store and the driver's checkpoint (see snap.h).
 *
 * Owns the snapshots being taken by this process (one job each, from the statement that
 * records it to the one that records its outcome) and their waits. Every other call is one
 * statement. An outcome the database did not take is retried until it does, so a snapshot
 * never stays "creating" while this process lives.
 */
#include "core/control/snap.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "base/ids.h"
#include "base/log.h"

#define TS(x) "to_char((" x ") AT TIME ZONE 'UTC', 'YYYY-MM-DD\"T\"HH24:MI:SS.MS\"Z\"')"

#define SNAP_COLS                                                                                  \
    "n.id, n.sandbox_id, n.template, n.cpu_count, n.memory_mb, coalesce(n.name, ''), n.state, "   \
    "coalesce(n.error, ''), " TS("n.created_at") ", coalesce(n.bytes, -1)"
#define SNAP_NCOLS 10

#define RETRY_MS 500 /* an outcome the database did not take */
#define SB_COLS  5   /* the insert's answer: desired, observed, busy, taken, at_max, then ours */


struct job {
    sp_snap_t *s; /* NULL once s is destroyed: the job only frees itself */
    sp_snap_rec_t rec;
    sp_op_rec_t op;
    sp_snap_cb cb; /* NULL once answered */
    void *arg;
    uint32_t wait_ms;
    sp_timer_t wait, retry;
    bool failed;
    char err_code[40];
    char err_msg[160];
    char team_id[64];               /* the taker's */
    char opid[SP_OPID_LEN + 1];     /* the operation's id, chosen up front */
    bool moved;                     /* the name was taken from an older snapshot */
    char bytes[24];                 /* its files' size once written, as a parameter; "": unknown */
    bool shared;                    /* written to the shared snapshot dir too (migration 22) */
    struct job *prev, *next;
};

struct sp_snap {
    sp_loop_t *loop;
    sp_store_t *store;
    sp_driver_t *driver;
    struct job *jobs;
    int team_max; /* SP_SNAP_TEAM_MAX, or $SPACE_SNAP_TEAM_MAX */
    char disk_def[16]; /* the default snapshot-disk quota (MiB) as a parameter; "": none */
    bool *alive; /* the start-up statement's view of s (false once destroyed) */
    char wid[65];       /* this node's worker id; "": none (role api) */
    sp_timer_t release; /* the release sweep (sp_snap_create) */
    bool *sweep_alive;  /* the sweep in flight's view of s */
};

/* ---- rows ---- */

static void parse_snap(const PGresult *r, int row, int col, sp_snap_rec_t *s)
{
    memset(s, 0, sizeof(*s));
    SP_STORE_TEXT(r, row, col + 0, s->id);
    SP_STORE_TEXT(r, row, col + 1, s->sandbox_id);
    SP_STORE_TEXT(r, row, col + 2, s->template_name);
    s->cpu_count = atoi(PQgetvalue(r, row, col + 3));
    s->memory_mb = atoi(PQgetvalue(r, row, col + 4));
    SP_STORE_TEXT(r, row, col + 5, s->name);
    SP_STORE_TEXT(r, row, col + 6, s->state);
    SP_STORE_TEXT(r, row, col + 7, s->error);
    SP_STORE_TEXT(r, row, col + 8, s->created_at);
    s->bytes = atoll(PQgetvalue(r, row, col + 9));
}

/* ---- taking one ---- */

static void job_free(struct job *j)
{
    if (j->s != NULL) {
        if (j->prev)
            j->prev->next = j->next;
        else
            j->s->jobs = j->next;
        if (j->next)
            j->next->prev = j->prev;
    }
    sp_timer_stop(&j->wait);
    sp_timer_stop(&j->retry);
    free(j);
}

/* Answers the caller once (with the records as they are now, or err). */
static void job_answer(struct job *j, const sp_err_t *err)
{
    sp_snap_cb cb = j->cb;
    j->cb = NULL;
    sp_timer_stop(&j->wait);
    if (cb != NULL)
        cb(j->arg, err ? NULL : &j->rec, err ? NULL : &j->op, err);
}

static void record_outcome(struct job *j);

static void on_outcome(void *arg, PGresult *res, const sp_err_t *err)
{
    struct job *j = arg;
    if (j->s == NULL) {
        job_free(j);
        return;
    }
    if (err != NULL) {
        sp_log(SP_LOG_WARN, "snap", "outcome not recorded snapshot=%s err=%s; retrying",
               j->rec.id, err->msg);
        sp_timer_start(&j->retry, RETRY_MS);
        return;
    }
    if (PQntuples(res) == 1) {
        parse_snap(res, 0, 0, &j->rec);
        sp_svc_parse_op(res, 0, SNAP_NCOLS, &j->op);
    } else { /* failed meanwhile by another process's start-up: say what we know */
        snprintf(j->rec.state, sizeof j->rec.state, "failed");
        snprintf(j->op.status, sizeof j->op.status, "failed");
    }
    sp_log(SP_LOG_INFO, "snap", "snapshot=%s sandbox=%s state=%s%s%s", j->rec.id,
           j->rec.sandbox_id, j->rec.state, j->failed ? " err=" : "", j->failed ? j->err_msg : "");
    job_answer(j, NULL);
    job_free(j);
}

static void record_outcome(struct job *j)
{
    const char *p[] = {j->rec.id,
                       j->failed ? "failed" : "ready",
                       j->failed ? j->err_msg : NULL,
                       j->failed ? j->err_code : NULL,
                       j->op.id,
                       !j->failed && j->bytes[0] ? j->bytes : NULL,
                       j->shared ? "true" : "false"};
    sp_err_t e;
    if (sp_store_query(j->s->store,
                       "WITH n AS (UPDATE snapshots SET state = $2, error = $3,"
                       "  bytes = $6::bigint, shared = $7::bool"
                       "  WHERE id = $1 AND state = 'creating' RETURNING *),"
                       " o AS (UPDATE operations SET finished_at = now(), error_code = $4,"
                       "   error_message = $3,"
                       "   status = CASE WHEN $2 = 'ready' THEN 'succeeded' ELSE 'failed' END"
                       "  WHERE id = $5 AND status IN ('pending', 'running') RETURNING *),"
                       " ev AS (INSERT INTO events (sandbox_id, kind, detail)"
                       "  SELECT n.sandbox_id, CASE WHEN $2 = 'ready' THEN 'snapshot_done'"
                       "   ELSE 'snapshot_failed' END, n.id FROM n RETURNING 1),"
                       " nt AS (SELECT pg_notify('space_ops', o.id) FROM o)"
                       " SELECT " SNAP_COLS ", " SP_SVC_OP_COLS
                       " FROM n, o, nt, (SELECT count(*) FROM ev) x",
                       7, p, on_outcome, j, &e) < 0) {
        sp_log(SP_LOG_WARN, "snap", "outcome not sent snapshot=%s err=%s; retrying", j->rec.id,
               e.msg);
        sp_timer_start(&j->retry, RETRY_MS);
    }
}

static void on_retry(sp_timer_t *t, void *arg)
{
    (void)t;
    record_outcome(arg);
}

static void on_wait(sp_timer_t *t, void *arg)
{
    (void)t;
    job_answer(arg, NULL); /* still being taken: the caller polls the operation */
}

static void job_fail(struct job *j, const sp_err_t *err)
{
    j->failed = true;
    snprintf(j->err_code, sizeof j->err_code, "%s", sp_err_name(err->code));
    snprintf(j->err_msg, sizeof j->err_msg, "%s", err->msg);
}

static void on_checkpoint(void *arg, const sp_err_t *err)
{
    struct job *j = arg;
    if (j->s == NULL) {
        job_free(j);
        return;
    }
    sp_driver_t *d = j->s->driver;
    if (err != NULL)
        job_fail(j, err);
    else if (d->ops->checkpoint_bytes != NULL) /* what it holds against the team's quota */
        snprintf(j->bytes, sizeof j->bytes, "%llu",
                 (unsigned long long)d->ops->checkpoint_bytes(d, j->rec.id));
    j->shared = err == NULL && d->ops->checkpoint_shared != NULL &&
                d->ops->checkpoint_shared(d, j->rec.id) == 1;
    record_outcome(j);
}

static int insert(struct job *j, sp_err_t *err);

/* The name was moved off the snapshot that had it: record ours. */
static void on_moved(void *arg, PGresult *res, const sp_err_t *err)
{
    struct job *j = arg;
    (void)res;
    if (j->s == NULL) {
        job_free(j);
        return;
    }
    sp_err_t e;
    if (err != NULL || insert(j, &e) < 0) {
        job_answer(j, err != NULL ? err : &e);
        job_free(j);
    }
}

static void on_inserted(void *arg, PGresult *res, const sp_err_t *err)
{
    struct job *j = arg;
    if (j->s == NULL) {
        job_free(j);
        return;
    }
    sp_err_t e;
    /* A name is a pointer (as E2B's snapshot names are): a new snapshot under a name in use
     * takes it, the older one stays reachable by its id. Only once the new one would be
     * taken (the source can be snapshotted), and once (a race loses with 409). */
    bool name_taken = (err != NULL && strcmp(sp_store_sqlstate(res), "23505") == 0) ||
                      (err == NULL && PQntuples(res) == 1 && PQgetisnull(res, 0, SB_COLS) &&
                       PQgetvalue(res, 0, 3)[0] == 't' && PQgetvalue(res, 0, 2)[0] != 't' &&
                       strstr("running paused", PQgetvalue(res, 0, 0)) != NULL &&
                       strstr("running paused", PQgetvalue(res, 0, 1)) != NULL &&
                       PQgetvalue(res, 0, 4)[0] != 't');
    if (name_taken && !j->moved) {
        j->moved = true;
        const char *p[] = {j->team_id, j->rec.name};
        if (sp_store_query(j->s->store,
                           "UPDATE snapshots SET name = NULL"
                           " WHERE team_id = $1 AND name = $2 AND deleted_at IS NULL",
                           2, p, on_moved, j, &e) == 0)
            return;
        err = &e;
    }
    if (err != NULL && strcmp(sp_store_sqlstate(res), "23505") == 0) {
        sp_err_set(&e, SP_ECONFLICT, "snapshot name '%s' is taken in this team", j->rec.name);
        err = &e;
    }
    if (err == NULL && PQntuples(res) != 1)
        err = (sp_err_set(&e, SP_ENOTFOUND, "sandbox not found"), &e);
    if (err == NULL && PQgetisnull(res, 0, SB_COLS)) {
        const char *desired = PQgetvalue(res, 0, 0), *observed = PQgetvalue(res, 0, 1);
        if (PQgetvalue(res, 0, 4)[0] == 't')
            sp_err_set(&e, SP_ECONFLICT,
                       "this team has %d snapshots, the most it may keep: delete some first",
                       j->s->team_max);
        else if (PQgetvalue(res, 0, 2)[0] == 't')
            sp_err_set(&e, SP_ECONFLICT,
                       "a snapshot of sandbox %s is being taken; try again when it is done",
                       j->rec.sandbox_id);
        else if (PQgetvalue(res, 0, 3)[0] == 't')
            sp_err_set(&e, SP_ECONFLICT, "snapshot name '%s' is taken in this team",
                       j->rec.name);
        else
            sp_err_set(&e, SP_ECONFLICT,
                       "sandbox %s is %s%s%s: only a running or paused sandbox can be "
                       "snapshotted",
                       j->rec.sandbox_id, observed, strcmp(desired, observed) ? ", asked to be " : "",
                       strcmp(desired, observed) ? desired : "");
        err = &e;
    }
    if (err != NULL) {
        job_answer(j, err);
        job_free(j);
        return;
    }
    parse_snap(res, 0, SB_COLS, &j->rec);
    sp_svc_parse_op(res, 0, SB_COLS + SNAP_NCOLS, &j->op);
    sp_driver_t *d = j->s->driver;
    int rc =
        d->ops->checkpoint(d, j->rec.sandbox_id, j->rec.id, SP_CKPT_SHARED, on_checkpoint, j, &e);
    if (rc < 0) {
        job_fail(j, &e);
        record_outcome(j); /* answers once recorded */
        return;
    }
    if (j->wait_ms == 0)
        job_answer(j, NULL);
    else
        sp_timer_start(&j->wait, j->wait_ms);
}

int sp_snap_take(sp_snap_t *s, const sp_auth_t *a, const char *sandbox_id, const char *name,
                 uint32_t wait_ms, sp_snap_cb cb, void *arg, sp_err_t *err)
{
    if (s->driver == NULL || s->driver->ops->checkpoint == NULL)
        return sp_err_set(err, SP_ENOTSUP, "this server's runtime (%s) cannot take snapshots",
                          s->driver ? s->driver->ops->name : "none");
    if (!sp_ids_valid(sandbox_id))
        return sp_err_set(err, SP_ENOTFOUND, "sandbox not found");
    char norm[SP_SNAP_NAME_MAX + 1] = "";
    if (name != NULL && sp_snap_norm_name(name, norm, sizeof norm, err) < 0)
        return -1;
    struct job *j = calloc(1, sizeof(*j));
    if (j == NULL)
        return sp_err_set(err, SP_EINTERNAL, "out of memory");
    j->s = s;
    j->cb = cb;
    j->arg = arg;
    j->wait_ms = wait_ms > SP_SVC_MAX_WAIT_MS ? SP_SVC_MAX_WAIT_MS : wait_ms;
    sp_timer_init(&j->wait, s->loop, on_wait, j);
    sp_timer_init(&j->retry, s->loop, on_retry, j);
    snprintf(j->rec.sandbox_id, sizeof j->rec.sandbox_id, "%s", sandbox_id);
    snprintf(j->rec.name, sizeof j->rec.name, "%s", norm);
    snprintf(j->team_id, sizeof j->team_id, "%s", a->team_id);
    snprintf(j->rec.id, sizeof j->rec.id, "snap-");
    sp_ids_random(j->rec.id + 5, SP_SNAP_ID_LEN - 5);
    sp_ids_operation(j->opid);
    if (insert(j, err) < 0) {
        free(j);
        return -1;
    }
    j->next = s->jobs;
    if (j->next)
        j->next->prev = j;
    s->jobs = j;
    return 0;
}

static int insert(struct job *j, sp_err_t *err)
{
    char max[16];
    snprintf(max, sizeof max, "%d", j->s->team_max);
    const char *p[] = {j->rec.sandbox_id, j->team_id, j->rec.id, j->opid,
                       j->rec.name[0] ? j->rec.name : NULL, max,
                       j->s->disk_def[0] ? j->s->disk_def : NULL};
    /* One statement: the source's state checked, the row and its operation written; the
     * first four columns say why nothing was written. */
    if (sp_store_query(
            j->s->store,
            "WITH sb AS (SELECT id, team_id, template, cpu_count, memory_mb, env, desired_state,"
            "   observed_state, worker_id,"
            "   EXISTS (SELECT 1 FROM snapshots x WHERE x.sandbox_id = s.id"
            "    AND x.state = 'creating' AND x.deleted_at IS NULL) AS busy,"
            "   ($5::text IS NOT NULL AND EXISTS (SELECT 1 FROM snapshots y"
            "    WHERE y.team_id = $2 AND y.name = $5 AND y.deleted_at IS NULL)) AS taken,"
            "   (SELECT count(*) FROM snapshots z WHERE z.team_id = $2"
            "    AND z.deleted_at IS NULL AND z.state <> 'failed') >= $6::int AS at_max"
            "  FROM sandboxes s WHERE id = $1 AND team_id = $2 AND observed_state <> 'deleted'),"
            " n AS (INSERT INTO snapshots (id, team_id, sandbox_id, template, cpu_count,"
            "   memory_mb, env, name, worker_id)"
            "  SELECT $3, team_id, id, template, cpu_count, memory_mb, env, $5, worker_id"
            "  FROM sb"
            /* the snapshot-disk quota (svc.h) last: SPQTA once the team's snapshots hold
             * it, asked only of a snapshot that would otherwise be taken */
            "  WHERE CASE WHEN observed_state IN ('running', 'paused')"
            "   AND desired_state IN ('running', 'paused') AND NOT busy AND NOT taken"
            "   AND NOT at_max THEN space_team_disk_quota($2, $7::bigint) ELSE false END"
            "  RETURNING *),"
            " o AS (INSERT INTO operations (id, sandbox_id, team_id, kind, target, status)"
            "  SELECT $4, n.sandbox_id, n.team_id, 'snapshot', n.id, 'running' FROM n"
            "  RETURNING *),"
            " ev AS (INSERT INTO events (sandbox_id, kind, detail)"
            "  SELECT n.sandbox_id, 'snapshot', n.id FROM n RETURNING 1)"
            " SELECT sb.desired_state, sb.observed_state, sb.busy, sb.taken, sb.at_max, " SNAP_COLS
            ", " SP_SVC_OP_COLS " FROM sb LEFT JOIN n ON true LEFT JOIN o ON true"
            " LEFT JOIN (SELECT count(*) FROM ev) x ON true",
            7, p, on_inserted, j, err) < 0)
        return -1;
    return 0;
}

/* ---- reading, listing, deleting ---- */

static void get_done(void *rec, PGresult *res, const sp_err_t *err)
{
    sp_store_req_t *c = rec;
    sp_snap_cb cb = (sp_snap_cb)c->cb;
    sp_err_t e;
    const sp_err_t *fail = sp_store_one_row(res, err, SP_ENOTFOUND, "snapshot not found", &e);
    if (fail != NULL) {
        cb(c->arg, NULL, NULL, fail);
        return;
    }
    sp_snap_rec_t r;
    parse_snap(res, 0, 0, &r);
    cb(c->arg, &r, NULL, NULL);
}

int sp_snap_get(sp_snap_t *s, const sp_auth_t *a, const char *id, const char *name,
                sp_snap_cb cb, void *arg, sp_err_t *err)
{
    if (id != NULL ? !sp_snap_valid_id(id) : (name == NULL || strlen(name) > SP_SNAP_NAME_MAX))
        return sp_err_set(err, SP_ENOTFOUND, "snapshot not found");
    const char *p[] = {a->team_id, id, id ? NULL : name};
    return sp_store_submit(s->store,
                           "SELECT " SNAP_COLS " FROM snapshots n WHERE n.team_id = $1"
                           " AND ($2::text IS NULL OR n.id = $2)"
                           " AND ($3::text IS NULL OR n.name = $3) AND n.deleted_at IS NULL",
                           3, p, get_done, s, (void *)cb, arg, 0, err);
}

static void list_done(void *rec, PGresult *res, const sp_err_t *err)
{
    sp_store_req_t *c = rec;
    sp_snap_list_cb cb = (sp_snap_list_cb)c->cb;
    sp_err_t e;
    const sp_err_t *fail;
    sp_snap_rec_t *recs = sp_store_rows(res, err, 0, NULL, sizeof(*recs), &fail, &e);
    if (recs == NULL) {
        cb(c->arg, NULL, 0, NULL, fail);
        return;
    }
    int n = PQntuples(res);
    bool more = n > c->flag;
    if (more)
        n = c->flag;
    for (int i = 0; i < n; i++)
        parse_snap(res, i, 0, &recs[i]);
    char cursor[128] = "";
    if (more && n > 0)
        snprintf(cursor, sizeof cursor, "%s_%s", PQgetvalue(res, n - 1, SNAP_NCOLS),
                 recs[n - 1].id);
    cb(c->arg, recs, (size_t)n, more ? cursor : NULL, NULL);
    free(recs);
}

int sp_snap_list(sp_snap_t *s, const sp_auth_t *a, const char *sandbox_id, int limit,
                 const char *cursor, sp_snap_list_cb cb, void *arg, sp_err_t *err)
{
    if (limit < 1 || limit > 1000)
        return sp_err_set(err, SP_EINVAL, "limit must be 1 to 1000");
    char micros[24] = "", cid[SP_SNAP_ID_LEN + 1] = "";
    if (cursor != NULL && cursor[0] != '\0' &&
        sp_store_cursor_parse(cursor, sp_snap_valid_id, micros, cid, sizeof cid) < 0)
        return sp_err_set(err, SP_EINVAL, "invalid cursor");
    if (sandbox_id != NULL && !sp_ids_valid(sandbox_id))
        sandbox_id = "-"; /* matches nothing: an empty list, as for any unknown sandbox */
    char lim[16];
    snprintf(lim, sizeof lim, "%d", limit + 1);
    const char *p[] = {a->team_id, sandbox_id, micros[0] ? micros : NULL, cid, lim};
    return sp_store_submit(
        s->store,
        "SELECT " SNAP_COLS ", (extract(epoch FROM n.created_at) * 1000000)::bigint"
        " FROM snapshots n WHERE n.team_id = $1 AND n.deleted_at IS NULL"
        " AND ($2::text IS NULL OR n.sandbox_id = $2)"
        " AND ($3::bigint IS NULL OR"
        "  ((extract(epoch FROM n.created_at) * 1000000)::bigint, n.id) < ($3::bigint, $4))"
        " ORDER BY n.created_at DESC, n.id DESC LIMIT $5::int",
        5, p, list_done, s, (void *)cb, arg, limit, err);
}

static void delete_done(void *rec, PGresult *res, const sp_err_t *err)
{
    sp_store_req_t *c = rec;
    sp_snap_t *s = c->owner;
    sp_svc_done_cb cb = (sp_svc_done_cb)c->cb;
    sp_err_t e;
    const sp_err_t *fail = sp_store_one_row(res, err, SP_ENOTFOUND, "snapshot not found", &e);
    if (fail == NULL && strcmp(PQgetvalue(res, 0, 1), "1") != 0)
        fail = (sp_err_set(&e, SP_ECONFLICT,
                           "snapshot %.32s is being taken; delete it when it is done",
                           PQgetvalue(res, 0, 0)),
                &e);
    if (fail != NULL) {
        cb(c->arg, fail);
        return;
    }
    /* The row is gone for the API; the driver drops the files once no VM uses them. A
     * failure here leaves files behind, never a snapshot in service: logged. */
    sp_driver_t *d = s->driver;
    if (d != NULL && d->ops->checkpoint_delete != NULL &&
        d->ops->checkpoint_delete(d, PQgetvalue(res, 0, 0), &e) < 0)
        sp_log(SP_LOG_WARN, "snap", "files of deleted snapshot=%s not released err=%s",
               PQgetvalue(res, 0, 0), e.msg);
    cb(c->arg, NULL);
}

int sp_snap_delete(sp_snap_t *s, const sp_auth_t *a, const char *id, sp_svc_done_cb cb,
                   void *arg, sp_err_t *err)
{
    if (!sp_snap_valid_id(id))
        return sp_err_set(err, SP_ENOTFOUND, "snapshot not found");
    const char *p[] = {id, a->team_id};
    return sp_store_submit(
        s->store,
        "WITH cur AS (SELECT id, state FROM snapshots WHERE id = $1 AND team_id = $2"
        "  AND deleted_at IS NULL FOR UPDATE),"
        " u AS (UPDATE snapshots SET deleted_at = now() FROM cur"
        "  WHERE snapshots.id = cur.id AND cur.state <> 'creating' RETURNING snapshots.id)"
        " SELECT cur.id, (SELECT count(*) FROM u) FROM cur",
        2, p, delete_done, s, (void *)cb, arg, 0, err);
}

/* ---- lifetime ---- */

void sp_snap_set_quota_default(sp_snap_t *s, int snapshot_mb)
{
    if (snapshot_mb > 0)
        snprintf(s->disk_def, sizeof s->disk_def, "%d", snapshot_mb);
    else
        s->disk_def[0] = '\0';
}

static void on_leftovers(void *rec, PGresult *res, const sp_err_t *err)
{
    struct {
        sp_snap_t *s;
        bool *alive;
    } *l = rec;
    bool alive = *l->alive;
    free(l->alive);
    if (!alive)
        return;
    l->s->alive = NULL;
    if (err != NULL) {
        sp_log(SP_LOG_WARN, "snap", "cannot fail unfinished snapshots: %s", err->msg);
        return;
    }
    sp_driver_t *d = l->s->driver;
    for (int i = 0; i < PQntuples(res); i++) {
        const char *id = PQgetvalue(res, i, 0);
        sp_err_t e;
        sp_log(SP_LOG_WARN, "snap", "snapshot failed by a restart snapshot=%s", id);
        if (d->ops->checkpoint_delete != NULL && d->ops->checkpoint_delete(d, id, &e) < 0)
            sp_log(SP_LOG_WARN, "snap", "files of failed snapshot=%s not released err=%s", id,
                   e.msg);
    }
}

/* ---- files of snapshots deleted through another node ---- */

struct sweep {
    sp_snap_t *s;
    bool *alive;
};

static void add_id(const char *id, long long committed_s, void *arg)
{
    (void)committed_s;
    json_t *a = arg;
    json_array_append_new(a, json_string(id));
}

static void on_released(void *rec, PGresult *res, const sp_err_t *err)
{
    struct sweep *q = rec;
    bool alive = *q->alive;
    free(q->alive);
    if (!alive)
        return;
    sp_snap_t *s = q->s;
    s->sweep_alive = NULL;
    sp_timer_start(&s->release, SP_SNAP_RELEASE_MS);
    if (err != NULL) {
        sp_log(SP_LOG_WARN, "snap", "deleted snapshots not looked up: %s", err->msg);
        return;
    }
    for (int i = 0; i < PQntuples(res); i++) {
        const char *id = PQgetvalue(res, i, 0);
        sp_err_t e;
        if (s->driver->ops->checkpoint_delete(s->driver, id, &e) < 0)
            sp_log(SP_LOG_WARN, "snap", "files of deleted snapshot=%s not released err=%s", id,
                   e.msg);
        else
            sp_log(SP_LOG_INFO, "snap", "files of snapshot=%s released (deleted elsewhere)", id);
    }
}

/* The snapshots this worker holds files of whose rows say deleted, its own and those it
 * copied in from the shared snapshot dir (and the shared copies, which any worker may
 * remove): their files released. */
static void on_release(sp_timer_t *t, void *arg)
{
    (void)t;
    sp_snap_t *s = arg;
    json_t *ids = json_array();
    sp_err_t e;
    if (ids == NULL || s->driver->ops->checkpoint_list(s->driver, "snap-", add_id, ids, &e) < 0 ||
        json_array_size(ids) == 0) {
        json_decref(ids);
        sp_timer_start(&s->release, SP_SNAP_RELEASE_MS);
        return;
    }
    char *text = json_dumps(ids, JSON_COMPACT);
    json_decref(ids);
    bool *alive = malloc(sizeof(*alive));
    const char *p[] = {text};
    struct sweep *q = text == NULL || alive == NULL
                          ? NULL
                          : sp_store_call(s->store,
                                          "SELECT id FROM snapshots WHERE id IN (SELECT"
                                          " jsonb_array_elements_text($1::jsonb))"
                                          " AND deleted_at IS NOT NULL",
                                          1, p, sizeof(*q), on_released, &e);
    free(text);
    if (q == NULL) {
        free(alive);
        sp_timer_start(&s->release, SP_SNAP_RELEASE_MS);
        return;
    }
    *alive = true;
    q->s = s;
    q->alive = alive;
    s->sweep_alive = alive;
}

sp_snap_t *sp_snap_create(sp_loop_t *loop, sp_store_t *store, sp_driver_t *driver,
                          const char *worker_id, sp_err_t *err)
{
    sp_snap_t *s = calloc(1, sizeof(*s));
    bool *alive = malloc(sizeof(*alive));
    if (s == NULL || alive == NULL) {
        free(s);
        free(alive);
        sp_err_set(err, SP_EINTERNAL, "out of memory");
        return NULL;
    }
    s->loop = loop;
    s->store = store;
    s->driver = driver;
    snprintf(s->wid, sizeof s->wid, "%s", worker_id != NULL ? worker_id : "");
    sp_timer_init(&s->release, loop, on_release, s);
    if (s->wid[0] != '\0' && driver->ops->checkpoint_list != NULL &&
        driver->ops->checkpoint_delete != NULL)
        sp_timer_start(&s->release, SP_SNAP_RELEASE_MS);
    const char *tm = getenv("SPACE_SNAP_TEAM_MAX"); /* for tests: a limit reached quickly */
    s->team_max = tm != NULL && atoi(tm) > 0 ? atoi(tm) : SP_SNAP_TEAM_MAX;
    sp_snap_set_quota_default(s, SP_SVC_QUOTA_SNAPSHOT_MB);
    if (s->wid[0] == '\0') { /* an API node: what a worker left is that worker's to settle */
        free(alive);
        return s;
    }
    const char *lp[] = {s->wid};
    struct leftovers {
        sp_snap_t *s;
        bool *alive;
    } *l = sp_store_call(
        store,
        "WITH f AS (UPDATE snapshots SET state = 'failed',"
        "  error = 'the server restarted while the snapshot was taken'"
        "  WHERE state = 'creating' AND (worker_id = $1 OR worker_id IS NULL) RETURNING id),"
        " o AS (UPDATE operations SET status = 'failed', error_code = 'unavailable',"
        "  error_message = 'the server restarted while the snapshot was taken',"
        "  finished_at = now()"
        "  WHERE kind = 'snapshot' AND status IN ('pending', 'running')"
        "  AND target IN (SELECT id FROM f) RETURNING id),"
        " nt AS (SELECT count(pg_notify('space_ops', o.id)) AS k FROM o)"
        " SELECT f.id FROM f, nt",
        1, lp, sizeof(struct leftovers), on_leftovers, err);
    if (l == NULL) {
        free(s);
        free(alive);
        return NULL;
    }
    *alive = true;
    l->s = s;
    l->alive = alive;
    s->alive = alive;
    return s;
}

void sp_snap_destroy(sp_snap_t *s)
{
    if (s == NULL)
        return;
    if (s->alive != NULL)
        *s->alive = false; /* the start-up statement's answer finds s gone */
    if (s->sweep_alive != NULL)
        *s->sweep_alive = false; /* and the release sweep's */
    sp_timer_stop(&s->release);
    for (struct job *j = s->jobs, *n; j != NULL; j = n) {
        n = j->next;
        /* No answers: the owner is going away. A job waiting to retry its outcome waits
         * on nothing else: freed here. Otherwise the store or the driver calls back later
         * and the job frees itself then. */
        bool idle = sp_timer_armed(&j->retry);
        sp_timer_stop(&j->wait);
        sp_timer_stop(&j->retry);
        if (idle) {
            free(j);
            continue;
        }
        j->cb = NULL;
        j->s = NULL;
        j->prev = j->next = NULL;
    }
    free(s);
}
