/*
 * recon.c - the controller loop: claim, act through the driver, record.
 *
 * A task is one sandbox this worker is acting on; at most one per sandbox.
 * Its steps: [recover a crash leftover] -> begin (record the transitional
 * state) -> driver call -> record the outcome (retried until the database
 * takes it, so an outcome is never lost to an outage) -> release and
 * rescan. Every record statement is guarded by the observed state it
 * expects and by this worker's claim. Operations of kind "snapshot" are
 * core/control/snap.c's: never claimed, finished or superseded here. A record
 * of the VM up (running or paused) also writes its disk size on the row
 * (sandboxes.disk_mb), the figure every node's E2B answers show; at start,
 * the rows from before that column get theirs (fill_disk_sizes).
 */
#include "core/control/recon.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "base/buf.h"
#include "base/ids.h"
#include "base/log.h"
#include "base/metrics.h"
#include "core/control/sandbox.h"

#define RECON_TICK_MS   1000 /* rescan even without NOTIFY */
#define RECON_RETRY_MS  500  /* retry a record the database did not take */
#define RECON_BATCH     "32"
#define RECON_LEASE     "'120 seconds'"

struct task {
    sp_recon_t *r; /* NULL once the controller is gone: the task only frees itself */
    char id[65];
    char template_name[160]; /* "<name>" or "<name>@<version>" (guest/tmplbuild.h) */
    char *env_json;
    char snapshot_id[65]; /* "" unless created from a snapshot (core/control/snap.h) */
    int cpu_count, memory_mb;
    sp_desired_t desired;  /* at claim time */
    sp_observed_t from;    /* observed before the action */
    sp_action_t act;
    sp_observed_t result;  /* to record */
    bool failed;
    char err_code[40];
    char err_msg[160];
    int stage; /* 0 begin, 1 running, 2 recording outcome */
    uint64_t driver_ms; /* when the driver call started (loop ms), for the metrics */
    sp_timer_t retry;
    struct task *prev, *next;
};

struct sp_recon {
    sp_loop_t *loop;
    sp_store_t *store;
    sp_driver_t *driver;
    char worker_id[65];
    bool unplaced; /* also claims rows placed on no worker */
    sp_timer_t tick;
    sp_timer_t sweep; /* deadlines and idle limits */
    bool sweeping;
    bool filling; /* the disk sizes of rows from before (fill_disk_sizes) */
    bool scanning, rescan;
    bool dying; /* destroyed while a scan or sweep was in flight: freed by its callback */
    struct task *tasks;
    int ntasks;
};

static sp_metric_t m_ops = SP_METRIC_COUNTER(
    "space_lifecycle_operations_total",
    "Lifecycle actions the controller ran through the runtime driver, by operation and outcome.",
    "op,outcome");
static sp_metric_t m_scans = SP_METRIC_COUNTER(
    "space_controller_scans_total",
    "Scans of the store for rows this worker's controller has to act on (NOTIFY or timer).", "");
static sp_metric_t m_notices = SP_METRIC_COUNTER(
    "space_controller_notices_total",
    "Changes to sandboxes this worker's controller heard of (NOTIFY space_sandbox), by whom they "
    "concern: this worker (it scans), another (it does not), or any (an unplaced row, or a "
    "writer that did not name the worker: it scans).",
    "worker");
static sp_metric_t m_op_seconds = SP_METRIC_HISTOGRAM(
    "space_lifecycle_operation_duration_seconds",
    "Time the runtime driver took for a lifecycle action, by operation and outcome.",
    "op,outcome", sp_metrics_buckets_ops);

/* The operation an action carries out, as the metrics name it (resume and restore both wake). */
static const char *op_name(sp_action_t a)
{
    switch (a) {
    case SP_ACT_BOOT:
        return "create";
    case SP_ACT_PAUSE:
        return "pause";
    case SP_ACT_SUSPEND:
        return "suspend";
    case SP_ACT_RESUME:
    case SP_ACT_RESTORE:
        return "wake";
    case SP_ACT_DESTROY:
        return "delete";
    default:
        return "other";
    }
}

static void scan(sp_recon_t *r);
static void task_next(struct task *t);

static void task_free(struct task *t)
{
    if (t->r != NULL) {
        if (t->prev)
            t->prev->next = t->next;
        else
            t->r->tasks = t->next;
        if (t->next)
            t->next->prev = t->prev;
        t->r->ntasks--;
    }
    sp_timer_stop(&t->retry);
    free(t->env_json);
    free(t);
}

void sp_recon_set_unplaced(sp_recon_t *r, bool claim)
{
    r->unplaced = claim;
}

int sp_recon_busy(const sp_recon_t *r)
{
    return r->ntasks;
}

/* ---- recording ---- */

static const char *record_sql =
    "WITH u AS (UPDATE sandboxes SET observed_state = $2, action = $10, updated_at = now(),"
    "   error = CASE WHEN $3::text IS NULL THEN error ELSE $4 END,"
    "   desired_state = CASE WHEN $6::text IS NOT NULL AND desired_state = $5 THEN $6"
    "     ELSE desired_state END,"
    "   claim_until = CASE WHEN $8::bool THEN NULL ELSE claim_until END,"
    "   snapshot_bytes = coalesce($12::bigint, snapshot_bytes),"
    "   disk_mb = coalesce($13::bigint, disk_mb)"
    "  WHERE id = $1 AND observed_state = $9 AND worker_id = $7"
    "  RETURNING id, desired_state, observed_state),"
    " f AS (UPDATE operations o SET"
    "   status = CASE WHEN o.target = u.observed_state THEN 'succeeded' ELSE 'failed' END,"
    "   error_code = CASE WHEN o.target = u.observed_state THEN NULL"
    "     WHEN $3::text IS NOT NULL AND (o.target = $5 OR u.observed_state = 'failed') THEN $3"
    "     WHEN u.observed_state = 'failed' THEN 'sandbox_failed' ELSE 'superseded' END,"
    "   error_message = CASE WHEN o.target = u.observed_state THEN NULL"
    "     WHEN $3::text IS NOT NULL AND (o.target = $5 OR u.observed_state = 'failed') THEN $4"
    "     WHEN u.observed_state = 'failed' THEN 'the sandbox failed'"
    "     ELSE 'superseded by a later request' END,"
    "   finished_at = now()"
    "  FROM u WHERE o.sandbox_id = u.id AND o.status IN ('pending', 'running')"
    "   AND o.kind <> 'snapshot'"
    "   AND (o.target = u.observed_state OR u.observed_state = u.desired_state"
    "     OR u.observed_state = 'failed' OR ($3::text IS NOT NULL AND o.target = $5))"
    "  RETURNING o.id),"
    " g AS (UPDATE operations o SET status = 'running' FROM u"
    "  WHERE o.sandbox_id = u.id AND o.status = 'pending' AND o.kind <> 'snapshot'"
    "   AND u.observed_state IN ('starting', 'pausing', 'suspending', 'waking', 'stopping')"
    "  RETURNING o.id),"
    " ev AS (INSERT INTO events (sandbox_id, kind, detail)"
    "  SELECT u.id, $11, coalesce($3, '') FROM u RETURNING 1)"
    " SELECT (SELECT count(*) FROM u), (SELECT count(pg_notify('space_ops', f.id)) FROM f),"
    "  (SELECT count(*) FROM g), (SELECT count(*) FROM ev)";

typedef void (*record_done_fn)(struct task *t, bool applied);

struct record_ctx {
    struct task *t;
    record_done_fn done;
};

static void on_recorded(void *arg, PGresult *res, const sp_err_t *err)
{
    struct record_ctx *rc = arg;
    struct task *t = rc->t;
    record_done_fn done = rc->done;
    free(rc);
    if (t->r == NULL) {
        task_free(t);
        return;
    }
    if (err != NULL) {
        /* Keep the outcome and try again: an outage must not lose it. */
        sp_log(SP_LOG_WARN, "recon", "record failed sandbox=%s err=%s; retrying", t->id, err->msg);
        sp_timer_start(&t->retry, RECON_RETRY_MS);
        return;
    }
    done(t, atoi(PQgetvalue(res, 0, 0)) == 1);
}

/* Records observed := to (guarded by expect), finishing operations; done runs once it is stored. */
static void record(struct task *t, sp_observed_t expect, sp_observed_t to, bool release,
                   const char *event, record_done_fn done)
{
    sp_recon_t *r = t->r;
    struct record_ctx *rc = malloc(sizeof(*rc));
    if (rc == NULL) {
        sp_timer_start(&t->retry, RECON_RETRY_MS);
        return;
    }
    rc->t = t;
    rc->done = done;
    bool failed = t->failed && t->stage == 2;
    const char *fail_target = failed ? sp_desired_name(t->desired) : NULL;
    /* A failed action rolls the desired state back to where it can rest, unless a later request
     * already changed it. A failed boot rests in failed, so it keeps its desired state. */
    const char *rollback = NULL;
    if (failed && to != SP_OBS_FAILED && to != SP_OBS_DELETED)
        rollback = sp_observed_name(to);
    /* The snapshot's size is what a suspended sandbox costs: kept on the row for the API. */
    char snap[24];
    const char *snap_p = NULL;
    if (to == SP_OBS_SUSPENDED || to == SP_OBS_RUNNING || to == SP_OBS_DELETED) {
        sp_vm_stats_t st;
        sp_err_t se;
        uint64_t bytes = 0;
        if (to == SP_OBS_SUSPENDED && r->driver->ops->stats(r->driver, t->id, &st, &se) == 0)
            bytes = st.snapshot_bytes;
        snprintf(snap, sizeof(snap), "%llu", (unsigned long long)bytes);
        snap_p = snap;
    }
    /* The VM's disk size, once it is up: on the row, every node's lists and details show it
     * (migration 16) without asking this worker. */
    char disk[24];
    const char *disk_p = NULL;
    if (to == SP_OBS_RUNNING || to == SP_OBS_PAUSED) {
        uint64_t mb = sp_driver_disk_bytes(r->driver, t->id) >> 20;
        snprintf(disk, sizeof(disk), "%llu", (unsigned long long)mb);
        disk_p = mb > 0 ? disk : NULL;
    }
    const char *p[] = {t->id,
                       sp_observed_name(to),
                       failed ? t->err_code : NULL,
                       failed ? t->err_msg : NULL,
                       fail_target,
                       rollback,
                       r->worker_id,
                       release ? "true" : "false",
                       sp_observed_name(expect),
                       sp_observed_transitional(to) ? sp_action_name(t->act) : NULL,
                       event,
                       snap_p,
                       disk_p};
    sp_err_t e;
    if (sp_store_query(r->store, record_sql, 13, p, on_recorded, rc, &e) < 0) {
        free(rc);
        sp_timer_start(&t->retry, RECON_RETRY_MS);
    }
}

/* ---- task steps ---- */

static void after_outcome(struct task *t, bool applied)
{
    sp_recon_t *r = t->r;
    if (!applied)
        sp_log(SP_LOG_WARN, "recon", "outcome not applied (claim lost?) sandbox=%s", t->id);
    else
        sp_log(SP_LOG_INFO, "recon", "sandbox=%s action=%s result=%s%s%s", t->id,
               sp_action_name(t->act), sp_observed_name(t->result), t->failed ? " err=" : "",
               t->failed ? t->err_msg : "");
    task_free(t);
    /* The desired state may have moved while we acted. */
    r->rescan = true;
    sp_timer_start(&r->tick, 0);
}

static void record_outcome(struct task *t)
{
    record(t, sp_action_during(t->act), t->result, true, t->failed ? "action_failed" : "action_done",
           after_outcome);
}

static void on_driver_done(void *arg, const sp_err_t *err)
{
    struct task *t = arg;
    if (t->r == NULL) {
        task_free(t);
        return;
    }
    t->stage = 2;
    const char *outcome = err != NULL ? "failure" : "success";
    sp_metrics_add(&m_ops, 1, op_name(t->act), outcome);
    sp_metrics_observe(&m_op_seconds,
                       (double)(sp_loop_now_ms(t->r->loop) - t->driver_ms) / 1000.0,
                       op_name(t->act), outcome);
    if (err != NULL) {
        t->failed = true;
        snprintf(t->err_code, sizeof(t->err_code), "%s", sp_err_name(err->code));
        snprintf(t->err_msg, sizeof(t->err_msg), "%s", err->msg);
        t->result = sp_action_failure(t->act, t->from);
    } else {
        t->result = sp_action_success(t->act);
    }
    record_outcome(t);
}

static void on_progress_written(void *arg, PGresult *res, const sp_err_t *err)
{
    if (err != NULL)
        sp_log(SP_LOG_DEBUG, "recon", "progress not recorded err=%s", err->msg);
}

/* The driver says what a boot waits for (driver.h: sp_vm_spec_t.progress): the sandbox's
 * unfinished operations show it (GET /v1/operations/{id}), and keep it once finished, so a
 * client can tell afterwards which way its create went. Only slow paths are told: a create
 * that clones or takes a spare costs no statement here. */
static void on_boot_progress(void *arg, const char *what)
{
    struct task *t = arg;
    if (t->r == NULL)
        return;
    sp_log(SP_LOG_INFO, "recon", "sandbox=%s progress=\"%s\"", t->id, what);
    const char *p[] = {t->id, what};
    sp_err_t e;
    if (sp_store_query(t->r->store,
                       "UPDATE operations SET progress = $2 WHERE sandbox_id = $1"
                       " AND status IN ('pending', 'running') AND kind <> 'snapshot'",
                       2, p, on_progress_written, NULL, &e) < 0)
        sp_log(SP_LOG_DEBUG, "recon", "progress not recorded sandbox=%s err=%s", t->id, e.msg);
}

static void run_driver(struct task *t)
{
    sp_driver_t *d = t->r->driver;
    sp_vm_spec_t spec = {.sandbox_id = t->id,
                         .template_name = t->template_name,
                         .cpu_count = t->cpu_count,
                         .memory_mb = t->memory_mb,
                         .hostname = t->id,
                         .env_json = t->env_json};
    sp_err_t e = {0};
    int rc = -1;
    t->stage = 1;
    t->driver_ms = sp_loop_now_ms(t->r->loop);
    switch (t->act) {
    case SP_ACT_BOOT:
        /* Only a boot starts from the snapshot; a wake restores the sandbox's own state. */
        spec.snapshot_id = t->snapshot_id[0] ? t->snapshot_id : NULL;
        spec.progress = on_boot_progress;
        spec.progress_arg = t;
        rc = d->ops->boot(d, &spec, on_driver_done, t, &e);
        break;
    case SP_ACT_PAUSE:
        rc = d->ops->pause(d, t->id, on_driver_done, t, &e);
        break;
    case SP_ACT_RESUME:
        rc = d->ops->resume(d, t->id, on_driver_done, t, &e);
        break;
    case SP_ACT_SUSPEND:
        rc = d->ops->snapshot(d, t->id, on_driver_done, t, &e);
        break;
    case SP_ACT_RESTORE:
        rc = d->ops->restore(d, &spec, on_driver_done, t, &e);
        break;
    case SP_ACT_DESTROY:
        rc = d->ops->destroy(d, t->id, on_driver_done, t, &e);
        break;
    default:
        sp_err_set(&e, SP_EINTERNAL, "no action");
        break;
    }
    if (rc < 0)
        on_driver_done(t, &e); /* failed at once: same path as a failed callback */
}

static void after_begin(struct task *t, bool applied)
{
    if (!applied) {
        /* Someone else moved the row (another worker, or a crash recovery): let a rescan decide. */
        sp_recon_t *r = t->r;
        task_free(t);
        r->rescan = true;
        sp_timer_start(&r->tick, RECON_RETRY_MS);
        return;
    }
    run_driver(t);
}

static void after_settle(struct task *t, bool applied)
{
    task_free(t);
}

static void after_recover(struct task *t, bool applied)
{
    if (!applied) {
        task_free(t);
        return;
    }
    task_next(t);
}

/* From a stable observed state: act, or settle operations and release. */
static void task_next(struct task *t)
{
    t->act = sp_sandbox_next_action(t->from, t->desired);
    if (t->act == SP_ACT_NONE) {
        t->stage = 0;
        record(t, t->from, t->from, true, "settled", after_settle);
        return;
    }
    t->stage = 0;
    record(t, t->from, sp_action_during(t->act), false, sp_action_name(t->act), after_begin);
}

static void on_task_retry(sp_timer_t *tm, void *arg)
{
    struct task *t = arg;
    if (t->stage == 2)
        record_outcome(t);
    else
        task_next(t);
}

static struct task *task_find(sp_recon_t *r, const char *id)
{
    for (struct task *t = r->tasks; t != NULL; t = t->next)
        if (strcmp(t->id, id) == 0)
            return t;
    return NULL;
}

static void start_task(sp_recon_t *r, PGresult *res, int row)
{
    const char *id = PQgetvalue(res, row, 0);
    if (task_find(r, id) != NULL)
        return;
    sp_desired_t d;
    sp_observed_t o;
    if (sp_desired_parse(PQgetvalue(res, row, 1), &d) < 0 ||
        sp_observed_parse(PQgetvalue(res, row, 2), &o) < 0) {
        sp_log(SP_LOG_ERROR, "recon", "corrupt state sandbox=%s", id);
        return;
    }
    struct task *t = calloc(1, sizeof(*t));
    if (t == NULL)
        return;
    t->r = r;
    snprintf(t->id, sizeof(t->id), "%s", id);
    snprintf(t->template_name, sizeof(t->template_name), "%s", PQgetvalue(res, row, 3));
    t->cpu_count = atoi(PQgetvalue(res, row, 4));
    t->memory_mb = atoi(PQgetvalue(res, row, 5));
    t->env_json = strdup(PQgetvalue(res, row, 6));
    snprintf(t->snapshot_id, sizeof(t->snapshot_id), "%s", PQgetvalue(res, row, 7));
    t->desired = d;
    t->from = o;
    sp_timer_init(&t->retry, r->loop, on_task_retry, t);
    t->next = r->tasks;
    if (t->next)
        t->next->prev = t;
    r->tasks = t;
    r->ntasks++;

    if (sp_observed_transitional(o)) {
        /* No live task owns this row, so the worker that began the action is gone. */
        sp_vm_state_t vm = r->driver->ops->probe(r->driver, id);
        sp_observed_t rec = sp_sandbox_recover(o, vm);
        sp_log(SP_LOG_INFO, "recon", "recovering sandbox=%s observed=%s vm=%d -> %s", id,
               sp_observed_name(o), (int)vm, sp_observed_name(rec));
        if (rec == SP_OBS_STOPPING) {
            t->act = SP_ACT_DESTROY;
            t->from = o;
            run_driver(t);
            return;
        }
        t->from = rec;
        record(t, o, rec, false, "recovered", after_recover);
        return;
    }
    task_next(t);
}

/* ---- deadlines and idle limits ---- */

/*
 * One statement turns due limits into requests, exactly as a client would: the
 * desired state changes and an operation is recorded (kind "deadline" or "idle").
 * A hard deadline deletes or suspends (deadline_action) and is then cleared; an idle
 * limit suspends a running or paused sandbox whose last activity is older than it.
 * SKIP LOCKED lets several workers sweep at once without doing a row twice.
 */
static const char *sweep_sql =
    "WITH due AS (SELECT id, (deadline_at IS NOT NULL AND deadline_at <= now()) AS hard"
    "  FROM sandboxes WHERE observed_state NOT IN ('deleted', 'failed')"
    "   AND desired_state <> 'deleted'"
    "   AND ((deadline_at IS NOT NULL AND deadline_at <= now())"
    "     OR (desired_state IN ('running', 'paused')"
    "         AND last_activity_at + make_interval(secs => idle_timeout_s) <= now()))"
    "  ORDER BY id LIMIT 64 FOR UPDATE SKIP LOCKED),"
    " u AS (UPDATE sandboxes s SET"
    "   desired_state = CASE WHEN due.hard AND s.deadline_action = 'delete' THEN 'deleted'"
    "     ELSE 'suspended' END,"
    "   deadline_at = CASE WHEN due.hard THEN NULL ELSE s.deadline_at END,"
    "   updated_at = now()"
    "  FROM due WHERE s.id = due.id"
    "  RETURNING s.id, s.team_id, s.worker_id, s.desired_state, due.hard,"
    "   (SELECT d.desired_state FROM sandboxes d WHERE d.id = s.id) AS was),"
    " o AS (INSERT INTO operations (id, sandbox_id, team_id, kind, target)"
    "  SELECT 'op' || substr(md5(random()::text || clock_timestamp()::text || u.id), 1, 22),"
    "   u.id, u.team_id, CASE WHEN u.hard THEN 'deadline' ELSE 'idle' END, u.desired_state"
    "  FROM u WHERE u.was <> u.desired_state RETURNING sandbox_id),"
    " ev AS (INSERT INTO events (sandbox_id, kind, detail)"
    "  SELECT u.id, CASE WHEN u.hard THEN 'deadline' ELSE 'idle' END, u.desired_state FROM u"
    "  RETURNING 1)"
    " SELECT count(" SP_RECON_NOTIFY("u") "), (SELECT count(*) FROM o),"
    "  (SELECT count(*) FROM ev) FROM u";

/* After sp_recon_destroy: the last in-flight statement's callback frees the controller. */
static bool reap_if_dying(sp_recon_t *r)
{
    if (!r->dying)
        return false;
    if (!r->scanning && !r->sweeping && !r->filling)
        free(r);
    return true;
}

static void on_swept(void *arg, PGresult *res, const sp_err_t *err)
{
    sp_recon_t *r = arg;
    r->sweeping = false;
    if (reap_if_dying(r))
        return;
    if (err == NULL && atoi(PQgetvalue(res, 0, 0)) > 0)
        sp_log(SP_LOG_INFO, "recon", "limits reached sandboxes=%s", PQgetvalue(res, 0, 0));
    sp_timer_start(&r->sweep, RECON_TICK_MS);
}

static void on_sweep(sp_timer_t *tm, void *arg)
{
    sp_recon_t *r = arg;
    sp_err_t e;
    if (sp_store_query(r->store, sweep_sql, 0, NULL, on_swept, r, &e) < 0)
        sp_timer_start(&r->sweep, RECON_TICK_MS);
    else
        r->sweeping = true;
}

/* ---- disk sizes of rows from before migration 16 ---- */

/*
 * Once, at start: this worker's sandboxes whose VM is up but whose row has no disk size (a
 * server from before the column ran them) get it now, so every node's lists show it without
 * waiting for the VM's next recorded change. The driver knows its live VMs from its start (it
 * re-adopts them); one read, then, when any is found, one update.
 */
static void on_disk_filled(void *arg, PGresult *res, const sp_err_t *err)
{
    sp_recon_t *r = arg;
    r->filling = false;
    if (reap_if_dying(r))
        return;
    if (err != NULL)
        sp_log(SP_LOG_WARN, "recon", "disk sizes not recorded err=%s", err->msg);
    else
        sp_log(SP_LOG_INFO, "recon", "disk sizes recorded sandboxes=%s", PQcmdTuples(res));
}

static void on_disk_unfilled(void *arg, PGresult *res, const sp_err_t *err)
{
    sp_recon_t *r = arg;
    r->filling = false;
    if (reap_if_dying(r))
        return;
    if (err != NULL) {
        sp_log(SP_LOG_WARN, "recon", "disk sizes not read err=%s", err->msg);
        return;
    }
    /* Two array literals of the same length: validated IDs, and their sizes in MiB. */
    sp_buf_t ids = SP_BUF_INIT, mbs = SP_BUF_INIT;
    int n = 0;
    for (int i = 0; i < PQntuples(res); i++) {
        const char *id = PQgetvalue(res, i, 0);
        uint64_t mb = sp_ids_valid(id) ? sp_driver_disk_bytes(r->driver, id) >> 20 : 0;
        if (mb == 0)
            continue;
        sp_buf_printf(&ids, "%s%s", n > 0 ? "," : "{", id);
        sp_buf_printf(&mbs, "%s%llu", n > 0 ? "," : "{", (unsigned long long)mb);
        n++;
    }
    sp_buf_str(&ids, "}");
    sp_buf_str(&mbs, "}");
    sp_err_t e;
    const char *p[] = {r->worker_id, sp_buf_cstr(&ids), sp_buf_cstr(&mbs)};
    if (n > 0 && !ids.oom && !mbs.oom &&
        sp_store_query(r->store,
                       "UPDATE sandboxes s SET disk_mb = v.mb"
                       " FROM unnest($2::text[], $3::bigint[]) AS v(id, mb)"
                       " WHERE s.id = v.id AND s.worker_id = $1 AND s.disk_mb IS NULL"
                       "  AND s.observed_state IN ('running', 'paused')",
                       3, p, on_disk_filled, r, &e) == 0)
        r->filling = true;
    sp_buf_free(&ids);
    sp_buf_free(&mbs);
}

static void fill_disk_sizes(sp_recon_t *r)
{
    const char *p[] = {r->worker_id};
    sp_err_t e;
    if (sp_store_query(r->store,
                       "SELECT id FROM sandboxes WHERE worker_id = $1 AND disk_mb IS NULL"
                       "  AND observed_state IN ('running', 'paused')",
                       1, p, on_disk_unfilled, r, &e) == 0)
        r->filling = true;
    else
        sp_log(SP_LOG_WARN, "recon", "disk sizes not read err=%s", e.msg);
}

/* ---- scanning ---- */

static void on_claimed(void *arg, PGresult *res, const sp_err_t *err)
{
    sp_recon_t *r = arg;
    r->scanning = false;
    if (reap_if_dying(r))
        return;
    if (err != NULL) {
        sp_timer_start(&r->tick, RECON_TICK_MS);
        return;
    }
    for (int i = 0; i < PQntuples(res); i++)
        start_task(r, res, i);
    if (r->rescan || PQntuples(res) == atoi(RECON_BATCH)) {
        r->rescan = false;
        sp_timer_start(&r->tick, 0);
    } else {
        sp_timer_start(&r->tick, RECON_TICK_MS);
    }
}

static void scan(sp_recon_t *r)
{
    if (r->scanning) {
        r->rescan = true;
        return;
    }
    r->rescan = false;
    sp_metrics_add(&m_scans, 1);
    /* Rows this worker is already acting on, as a text[] literal of validated IDs. */
    size_t cap = 4 + (size_t)r->ntasks * 68;
    char *busy = malloc(cap);
    if (busy == NULL) {
        sp_timer_start(&r->tick, RECON_TICK_MS);
        return;
    }
    size_t off = (size_t)snprintf(busy, cap, "{");
    for (struct task *t = r->tasks; t != NULL; t = t->next)
        off += (size_t)snprintf(busy + off, cap - off, "%s%s", off > 1 ? "," : "", t->id);
    snprintf(busy + off, cap - off, "}");
    const char *p[] = {r->worker_id, busy, r->unplaced ? "true" : "false"};
    sp_err_t e;
    /* Its own rows (placed here), and unplaced ones when it may; none while its worker is
     * lost (core/control/fleet.h: it settles them when its heartbeat resumes). A lost row is
     * only ever deleted. */
    int rc = sp_store_query(
        r->store,
        "UPDATE sandboxes s SET worker_id = $1, claim_until = now() + interval " RECON_LEASE
        " WHERE s.id IN (SELECT c.id FROM sandboxes c"
        "  WHERE c.observed_state <> 'deleted'"
        "   AND (c.worker_id = $1 OR (c.worker_id IS NULL AND $3::bool))"
        "   AND NOT EXISTS (SELECT 1 FROM workers w WHERE w.id = $1 AND w.state = 'lost')"
        "   AND NOT (c.id = ANY($2::text[]))"
        "   AND ((c.desired_state <> c.observed_state"
        "         AND NOT (c.observed_state IN ('failed', 'lost')"
        "                  AND c.desired_state <> 'deleted'))"
        "     OR EXISTS (SELECT 1 FROM operations o WHERE o.sandbox_id = c.id"
        "                AND o.status IN ('pending', 'running') AND o.kind <> 'snapshot'))"
        "  ORDER BY c.updated_at LIMIT " RECON_BATCH " FOR UPDATE SKIP LOCKED)"
        " RETURNING s.id, s.desired_state, s.observed_state,"
        "  s.template || coalesce('@' || s.template_version, ''), s.cpu_count,"
        "  s.memory_mb, s.env::text, coalesce(s.snapshot_id, '')",
        3, p, on_claimed, r, &e);
    free(busy);
    if (rc < 0) {
        sp_timer_start(&r->tick, RECON_TICK_MS);
        return;
    }
    r->scanning = true;
}

static void on_tick(sp_timer_t *tm, void *arg)
{
    scan(arg);
}

/* A NOTIFY space_sandbox's payload: "<sandbox id>" or "<sandbox id> <worker id>", the worker
 * the row is placed on once changed (none: unplaced, or a writer that does not say). Only that
 * worker has anything to do for a row placed on one, so the others do not scan for it: with N
 * workers a create would otherwise cost N scans. The timer's scan covers anything missed. */
static bool notify_for_us(const sp_recon_t *r, const char *payload)
{
    const char *sp = payload != NULL ? strchr(payload, ' ') : NULL;
    const char *whom = sp == NULL || sp[1] == '\0'               ? "any"
                       : strcmp(sp + 1, r->worker_id) == 0 ? "this"
                                                           : "other";
    sp_metrics_add(&m_notices, 1, whom);
    return whom[0] != 'o';
}

static void on_notify(void *arg, const char *channel, const char *payload)
{
    sp_recon_t *r = arg;
    if (!notify_for_us(r, payload))
        return;
    if (!sp_timer_armed(&r->tick) || r->scanning) {
        r->rescan = true;
        return;
    }
    sp_timer_start(&r->tick, 0);
}

sp_recon_t *sp_recon_create(sp_loop_t *loop, sp_store_t *store, sp_driver_t *driver,
                            const char *worker_id, sp_err_t *err)
{
    sp_recon_t *r = calloc(1, sizeof(*r));
    if (r == NULL) {
        sp_err_set(err, SP_EINTERNAL, "out of memory");
        return NULL;
    }
    r->loop = loop;
    r->store = store;
    r->driver = driver;
    snprintf(r->worker_id, sizeof(r->worker_id), "%s", worker_id);
    r->unplaced = true;
    sp_timer_init(&r->tick, loop, on_tick, r);
    sp_timer_init(&r->sweep, loop, on_sweep, r);
    sp_metrics_declare(&m_ops);
    sp_metrics_declare(&m_scans);
    sp_metrics_declare(&m_notices);
    sp_metrics_declare(&m_op_seconds);
    if (sp_store_listen(store, "space_sandbox", on_notify, r, err) < 0) {
        free(r);
        return NULL;
    }
    sp_timer_start(&r->tick, 0);
    sp_timer_start(&r->sweep, RECON_TICK_MS);
    fill_disk_sizes(r);
    return r;
}

void sp_recon_destroy(sp_recon_t *r)
{
    if (r == NULL)
        return;
    sp_timer_stop(&r->tick);
    sp_timer_stop(&r->sweep);
    /* Tasks waiting on the driver or the store free themselves when called back. */
    for (struct task *t = r->tasks, *n; t != NULL; t = n) {
        n = t->next;
        sp_timer_stop(&t->retry);
        t->r = NULL;
        if (t->stage == 0 && !sp_timer_armed(&t->retry)) {
            /* waiting on the store: its shutdown calls back */
        }
    }
    r->tasks = NULL;
    r->dying = true;
    reap_if_dying(r);
}
