/*
 * fleet.c - registration, heartbeat, the loss sweep, re-adoption and fencing, drain, and the
 * operator's view of the workers (core/control/fleet.h).
 *
 * Every change is one statement. The heartbeat reads the row's state before it writes: a
 * worker that finds itself lost settles its sandboxes (comeback), one that finds itself
 * draining moves them. The sweep's lease and its work are one statement, so a node that did
 * not renew the lease changes nothing.
 */
#include "core/control/fleet.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "base/log.h"
#include "core/control/recon.h"
#include "core/control/tmpl.h"

#define FLEET_DRAIN_BATCH "8" /* sandboxes moved per heartbeat of a draining worker */

struct sp_fleet {
    sp_loop_t *loop;
    sp_store_t *store;
    sp_driver_t *driver; /* NULL on an API node */
    sp_role_t role;
    char id[65];
    char address[256];
    char vcpus[16], memory_mb[16]; /* "" = no limit (SQL NULL) */
    char *labels;                  /* JSON text */
    char accel_file[4096];
    char version[32];
    char timeout_s[16], grace_s[16];
    char *tmpl_sent; /* the templates text the row holds (NULL: not known to be written) */
    char *tmpl_out;  /* the one the heartbeat in flight writes, or NULL */
    int beat_ms;
    sp_timer_t beat, sweep;
    char gap_s[24], judge_s[24]; /* the sweep's $3 and $4 (sweep_sql) */
    bool registered;
    int inflight; /* statements out; destroy waits for them */
    bool dying;
};

int sp_fleet_role_parse(const char *s, sp_role_t *out)
{
    static const char *const names[] = {"all", "api", "worker"};
    for (int i = 0; s != NULL && i < 3; i++)
        if (strcmp(s, names[i]) == 0) {
            *out = (sp_role_t)i;
            return 0;
        }
    return -1;
}

const char *sp_fleet_role_name(sp_role_t r)
{
    return r == SP_ROLE_API ? "api" : r == SP_ROLE_WORKER ? "worker" : "all";
}

/* ---- labels ---- */

static bool label_text_ok(const char *s, size_t n, bool key)
{
    if ((key && n == 0) || n > SP_FLEET_MAX_LABEL_LEN)
        return false;
    for (size_t i = 0; i < n; i++) {
        char c = s[i];
        if (!((c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') ||
              c == '.' || c == '_' || c == '-' || c == '/'))
            return false;
    }
    return true;
}

int sp_fleet_check_labels(const json_t *labels, const char *what, sp_err_t *err)
{
    if (!json_is_object(labels))
        return sp_err_set(err, SP_EINVAL, "%s must be an object of strings", what);
    if (json_object_size(labels) > SP_FLEET_MAX_LABELS)
        return sp_err_set(err, SP_EINVAL, "%s: at most %d labels", what, SP_FLEET_MAX_LABELS);
    const char *k;
    json_t *v;
    json_object_foreach((json_t *)labels, k, v)
    {
        if (!json_is_string(v))
            return sp_err_set(err, SP_EINVAL, "%s: values must be strings", what);
        if (!label_text_ok(k, strlen(k), true) ||
            !label_text_ok(json_string_value(v), json_string_length(v), false))
            return sp_err_set(err, SP_EINVAL,
                              "%s: keys of 1 to %d and values of 0 to %d characters "
                              "[A-Za-z0-9._/-]",
                              what, SP_FLEET_MAX_LABEL_LEN, SP_FLEET_MAX_LABEL_LEN);
    }
    return 0;
}

json_t *sp_fleet_parse_labels(const char *text, sp_err_t *err)
{
    json_t *o = json_object();
    if (o == NULL) {
        sp_err_set(err, SP_EINTERNAL, "out of memory");
        return NULL;
    }
    const char *p = text != NULL ? text : "";
    bool more = *p != '\0'; /* an item is due: none after a trailing comma is an error */
    while (more) {
        const char *end = strchr(p, ',');
        size_t n = end ? (size_t)(end - p) : strlen(p);
        const char *eq = memchr(p, '=', n);
        char k[SP_FLEET_MAX_LABEL_LEN + 1], v[SP_FLEET_MAX_LABEL_LEN + 1];
        size_t kn = eq ? (size_t)(eq - p) : 0, vn = eq ? n - kn - 1 : 0;
        if (eq == NULL || !label_text_ok(p, kn, true) || !label_text_ok(eq + 1, vn, false)) {
            json_decref(o);
            sp_err_set(err, SP_EINVAL,
                       "labels: want k=v,k=v (keys of 1 to %d and values of 0 to %d characters "
                       "[A-Za-z0-9._/-])",
                       SP_FLEET_MAX_LABEL_LEN, SP_FLEET_MAX_LABEL_LEN);
            return NULL;
        }
        memcpy(k, p, kn);
        k[kn] = '\0';
        memcpy(v, eq + 1, vn);
        v[vn] = '\0';
        if (json_object_get(o, k) != NULL) {
            json_decref(o);
            sp_err_set(err, SP_EINVAL, "labels: '%s' is given twice", k);
            return NULL;
        }
        json_object_set_new(o, k, json_string(v));
        more = end != NULL;
        p = end ? end + 1 : p + n;
    }
    if (sp_fleet_check_labels(o, "labels", err) < 0) {
        json_decref(o);
        return NULL;
    }
    return o;
}

/* ---- statements ---- */

static void reap(sp_fleet_t *f)
{
    if (f->dying && f->inflight == 0) {
        free(f->labels);
        free(f->tmpl_sent);
        free(f->tmpl_out);
        free(f);
    }
}

/* One statement of the fleet's own; done runs unless the fleet is being destroyed. */
struct fq {
    sp_fleet_t *f;
    void (*done)(sp_fleet_t *f, PGresult *res, const sp_err_t *err, const char *arg);
    char arg[72];
};

static void fq_done(void *rec, PGresult *res, const sp_err_t *err)
{
    struct fq *q = rec;
    sp_fleet_t *f = q->f;
    f->inflight--;
    if (f->dying) {
        reap(f);
        return;
    }
    if (q->done != NULL)
        q->done(f, res, err, q->arg);
}

static int fq_send(sp_fleet_t *f, const char *sql, int n, const char *const *p,
                   void (*done)(sp_fleet_t *, PGresult *, const sp_err_t *, const char *),
                   const char *arg)
{
    sp_err_t e;
    struct fq *q = sp_store_call(f->store, sql, n, p, sizeof(*q), fq_done, &e);
    if (q == NULL)
        return -1;
    q->f = f;
    q->done = done;
    snprintf(q->arg, sizeof(q->arg), "%s", arg ? arg : "");
    f->inflight++;
    return 0;
}

/* ---- registration and heartbeat ---- */

static void accel_now(const sp_fleet_t *f, char *out, size_t cap)
{
    snprintf(out, cap, "%s", f->driver != NULL ? f->driver->ops->name : "");
    FILE *fp = f->accel_file[0] ? fopen(f->accel_file, "r") : NULL;
    if (fp == NULL)
        return;
    char buf[32];
    if (fgets(buf, sizeof(buf), fp) != NULL) {
        buf[strcspn(buf, "\r\n ")] = '\0';
        if (buf[0] != '\0')
            snprintf(out, cap, "%s", buf);
    }
    fclose(fp);
}

static void comeback(sp_fleet_t *f, const char *generation);
static void drain_step(sp_fleet_t *f);

/* A worker's state once it answers again: one declared lost returns to what the operator
 * left it as (draining when drained: migration 14). */
#define BACK_STATE                                                                                 \
    "CASE WHEN w.state <> 'lost' THEN w.state WHEN w.drain THEN 'draining' ELSE 'active' END"

/* Both answer: the state the row had before this statement (read under the row's lock before
 * the write: the source of the INSERT, so a sweep that declared it lost meanwhile is seen),
 * the generation, and its state now. templates: what the driver holds template snapshots of
 * (templates_json); the heartbeat writes it only when it changed ($3 NULL otherwise). */
static const char *register_sql =
    "WITH prev AS (SELECT state FROM workers WHERE id = $1 FOR UPDATE),"
    " v AS (SELECT coalesce((SELECT state FROM prev), 'new') AS was)"
    " INSERT INTO workers AS w (id, address, role, state, vcpus, memory_mb, accelerator, version,"
    "  labels, templates, started_at, heartbeat_at)"
    " SELECT $1, $2, $3, 'active', $4::int, $5::int, $6, $7, $8::jsonb, $9::jsonb, now(), now()"
    " FROM v"
    " ON CONFLICT (id) DO UPDATE SET address = excluded.address, role = excluded.role,"
    "  vcpus = excluded.vcpus, memory_mb = excluded.memory_mb,"
    "  accelerator = excluded.accelerator, version = excluded.version,"
    "  labels = excluded.labels, templates = excluded.templates, started_at = now(),"
    "  heartbeat_at = now(),"
    "  state = " BACK_STATE ", lost_at = NULL"
    " RETURNING (SELECT was FROM v), w.generation, w.state";

static const char *beat_sql =
    "WITH prev AS (SELECT state FROM workers WHERE id = $1 FOR UPDATE)"
    " UPDATE workers w SET heartbeat_at = now(), accelerator = $2,"
    "  templates = coalesce($3::jsonb, w.templates),"
    "  state = " BACK_STATE ", lost_at = NULL"
    " FROM prev WHERE w.id = $1 RETURNING prev.state, w.generation, w.state";

static void beat_done(sp_fleet_t *f, PGresult *res, const sp_err_t *err, const char *arg)
{
    sp_timer_start(&f->beat, (uint64_t)f->beat_ms);
    char *out = f->tmpl_out;
    f->tmpl_out = NULL;
    if (err != NULL) {
        free(out);
        sp_log(SP_LOG_WARN, "fleet", "heartbeat failed err=%s", err->msg);
        return;
    }
    if (out != NULL) {
        free(f->tmpl_sent);
        f->tmpl_sent = out;
    }
    if (PQntuples(res) != 1) { /* the row is gone (removed by an operator): register again */
        f->registered = false;
        sp_timer_start(&f->beat, 0);
        return;
    }
    const char *was = PQgetvalue(res, 0, 0), *gen = PQgetvalue(res, 0, 1),
               *now = PQgetvalue(res, 0, 2);
    bool first = !f->registered;
    if (first)
        sp_log(SP_LOG_INFO, "fleet", "registered worker=%s address=%s role=%s was=%s", f->id,
               f->address, sp_fleet_role_name(f->role), was);
    f->registered = true;
    if (strcmp(was, "lost") == 0)
        sp_log(SP_LOG_WARN, "fleet", "this worker was declared lost; back now generation=%s", gen);
    /* After a start too: a sandbox lost here and deleted or moved since may still have a VM
     * here, whatever the row said (a restart's registration may also race the sweep). */
    if (strcmp(was, "lost") == 0 || first)
        comeback(f, gen);
    if (strcmp(now, "draining") == 0)
        drain_step(f);
}

/* ---- the templates a worker holds snapshots of ---- */

/* One template size into the object templates_json builds: name -> [{cpu_count, memory_mb,
 * spares}], sizes in order, one entry per size. */
static void template_add(const char *name, int cpu_count, int memory_mb, int spares, void *arg)
{
    json_t *o = arg, *a = json_object_get(o, name);
    if (a == NULL &&
        (json_object_set_new(o, name, json_array()) < 0 || (a = json_object_get(o, name)) == NULL))
        return;
    size_t i;
    for (i = 0; i < json_array_size(a); i++) {
        json_t *e = json_array_get(a, i);
        int c = (int)json_integer_value(json_object_get(e, "cpu_count"));
        int m = (int)json_integer_value(json_object_get(e, "memory_mb"));
        if (c == cpu_count && m == memory_mb) { /* two snapshots of one size: one entry */
            json_object_set_new(
                e, "spares",
                json_integer(json_integer_value(json_object_get(e, "spares")) + spares));
            return;
        }
        if (c > cpu_count || (c == cpu_count && m > memory_mb))
            break;
    }
    json_array_insert_new(a, i,
                          json_pack("{s:i, s:i, s:i}", "cpu_count", cpu_count, "memory_mb",
                                    memory_mb, "spares", spares));
}

/* What the row's templates column says (migration 10; space_place prefers a worker whose
 * object has the template's key): the template sizes the driver holds a ready snapshot of, as
 * compact JSON text with sorted keys, so that the same holding gives the same text. NULL when
 * out of memory. */
static char *templates_json(const sp_fleet_t *f)
{
    json_t *o = json_object();
    if (o == NULL)
        return NULL;
    if (f->driver != NULL && f->driver->ops->templates != NULL)
        f->driver->ops->templates(f->driver, template_add, o);
    char *text = json_dumps(o, JSON_COMPACT | JSON_SORT_KEYS);
    json_decref(o);
    return text;
}

static void on_beat(sp_timer_t *t, void *arg)
{
    sp_fleet_t *f = arg;
    char accel[32];
    accel_now(f, accel, sizeof(accel));
    free(f->tmpl_out);
    f->tmpl_out = templates_json(f);
    if (f->registered && f->tmpl_out != NULL && f->tmpl_sent != NULL &&
        strcmp(f->tmpl_out, f->tmpl_sent) == 0) { /* unchanged: not written again */
        free(f->tmpl_out);
        f->tmpl_out = NULL;
    }
    int rc;
    if (!f->registered) {
        const char *p[] = {f->id,
                           f->address,
                           sp_fleet_role_name(f->role),
                           f->vcpus[0] ? f->vcpus : NULL,
                           f->memory_mb[0] ? f->memory_mb : NULL,
                           accel,
                           f->version,
                           f->labels,
                           f->tmpl_out != NULL ? f->tmpl_out : "{}"};
        rc = fq_send(f, register_sql, 9, p, beat_done, NULL);
    } else {
        const char *p[] = {f->id, accel, f->tmpl_out};
        rc = fq_send(f, beat_sql, 3, p, beat_done, NULL);
    }
    if (rc < 0) {
        free(f->tmpl_out);
        f->tmpl_out = NULL;
        sp_timer_start(&f->beat, (uint64_t)f->beat_ms);
    }
}

/* ---- comeback: re-adoption and fencing ---- */

/* What was placed on this worker when it was lost (within a week), and what a wake placed
 * elsewhere since: the rows whose local VM this worker must settle. in_grace: lost no longer
 * than the grace ago and still lost here. */
static const char *comeback_sql =
    "SELECT id, observed_state = 'lost' AND lost_at > now() - make_interval(secs => $2::int)"
    "  AND worker_id = $1 FROM sandboxes"
    " WHERE worker_id = $1 AND lost_at IS NOT NULL AND lost_at > now() - interval '7 days'"
    "  AND observed_state IN ('lost', 'deleted')"
    " UNION ALL SELECT id, false FROM sandboxes"
    " WHERE moved_from = $1 AND worker_id IS DISTINCT FROM $1 AND observed_state <> 'deleted'";

/* Back to what the driver finds, only if still lost here: the row's fence. */
static const char *readopt_sql =
    "WITH u AS (UPDATE sandboxes SET observed_state = $3, lost_at = NULL, error = NULL,"
    "   worker_generation = $4::bigint, updated_at = now()"
    "  WHERE id = $1 AND worker_id = $2 AND observed_state = 'lost' RETURNING id, worker_id),"
    " ev AS (INSERT INTO events (sandbox_id, kind, detail)"
    "  SELECT u.id, 'readopted', 'worker ' || $2 || ' came back' FROM u RETURNING 1)"
    " SELECT count(" SP_RECON_NOTIFY("u") "), (SELECT count(*) FROM ev) FROM u";

static void readopted(sp_fleet_t *f, PGresult *res, const sp_err_t *err, const char *id)
{
    if (err != NULL)
        sp_log(SP_LOG_WARN, "fleet", "re-adoption not recorded sandbox=%s err=%s", id, err->msg);
    else if (atoi(PQgetvalue(res, 0, 0)) == 1)
        sp_log(SP_LOG_INFO, "fleet", "re-adopted sandbox=%s", id);
}

static void fenced(void *arg, const sp_err_t *err)
{
    char *id = arg;
    if (err != NULL)
        sp_log(SP_LOG_ERROR, "fleet", "fencing: stopping sandbox=%s failed err=%s", id, err->msg);
    else
        sp_log(SP_LOG_INFO, "fleet", "fencing: stopped sandbox=%s", id);
    free(id);
}

/* A live VM here of a sandbox this worker must not run: stopped. A suspended one's snapshot is
 * left alone (the worker it woke on may be using it). */
static void fence(sp_fleet_t *f, const char *id)
{
    char *copy = strdup(id);
    sp_err_t e;
    if (copy == NULL || f->driver->ops->destroy(f->driver, id, fenced, copy, &e) < 0) {
        sp_log(SP_LOG_ERROR, "fleet", "fencing: cannot stop sandbox=%s", id);
        free(copy);
    }
}

static void comeback_rows(sp_fleet_t *f, PGresult *res, const sp_err_t *err, const char *gen)
{
    if (err != NULL) {
        /* Settled at the next comeback at the latest; the controller ignores lost rows. */
        sp_log(SP_LOG_ERROR, "fleet", "comeback: reading sandboxes failed err=%s", err->msg);
        return;
    }
    for (int i = 0; i < PQntuples(res); i++) {
        const char *id = PQgetvalue(res, i, 0);
        bool in_grace = PQgetvalue(res, i, 1)[0] == 't';
        sp_vm_state_t vm = f->driver->ops->probe(f->driver, id);
        bool live = vm == SP_VM_RUNNING || vm == SP_VM_PAUSED;
        if (in_grace && live) {
            const char *p[] = {id, f->id, vm == SP_VM_RUNNING ? "running" : "paused", gen};
            if (fq_send(f, readopt_sql, 4, p, readopted, id) < 0)
                sp_log(SP_LOG_WARN, "fleet", "re-adoption not sent sandbox=%s", id);
        } else if (live) {
            fence(f, id);
        }
    }
}

static void comeback(sp_fleet_t *f, const char *generation)
{
    if (f->driver == NULL)
        return;
    const char *p[] = {f->id, f->grace_s};
    if (fq_send(f, comeback_sql, 2, p, comeback_rows, generation) < 0)
        sp_log(SP_LOG_ERROR, "fleet", "comeback: not sent");
}

/* ---- drain ---- */

static const char *drain_suspend_sql =
    "WITH a AS (UPDATE sandboxes SET moving = desired_state, desired_state = 'suspended',"
    "   updated_at = now()"
    "  WHERE worker_id = $1 AND moving IS NULL AND desired_state IN ('running', 'paused')"
    "   AND observed_state IN ('running', 'paused')"
    "   AND EXISTS (SELECT 1 FROM workers WHERE id = $1 AND state = 'draining')"
    "  RETURNING id, team_id, worker_id),"
    " o AS (INSERT INTO operations (id, sandbox_id, team_id, kind, target)"
    "  SELECT 'op' || substr(md5(random()::text || clock_timestamp()::text || a.id), 1, 22),"
    "   a.id, a.team_id, 'drain', 'suspended' FROM a RETURNING 1),"
    " ev AS (INSERT INTO events (sandbox_id, kind, detail)"
    "  SELECT a.id, 'drain', 'suspending to move' FROM a RETURNING 1)"
    " SELECT count(" SP_RECON_NOTIFY("a") "), (SELECT count(*) FROM o),"
    "  (SELECT count(*) FROM ev) FROM a";

static const char *drain_ready_sql =
    "SELECT id FROM sandboxes WHERE worker_id = $1 AND moving IS NOT NULL"
    " AND observed_state = 'suspended' AND desired_state = 'suspended'"
    " ORDER BY updated_at LIMIT " FLEET_DRAIN_BATCH;

/* One sandbox at a time: one that finds no room stays suspended here until the next beat,
 * without holding the others back. The update states again what p read, so that a change
 * committed meanwhile (a delete, a wake placed elsewhere, an undrain) is seen on the row it
 * waited for and wins, rather than being overwritten with the drain's desired state. Both
 * steps act only while the worker is still draining (an undrain committed after the beat read
 * its state stops them); a move also while it is lost: the sweep's (lost_moves_sql). */
static const char *drain_move_sql =
    "WITH p AS (SELECT pl.wid, pl.wgen FROM sandboxes x CROSS JOIN LATERAL space_place("
    "   x.cpu_count, x.memory_mb, x.placement, x.template || coalesce('@' || x.template_version,"
    "   ''), $3::int, NULL, NULL) pl"
    "  WHERE x.id = $1 AND x.worker_id = $2 AND x.moving IS NOT NULL"
    "   AND x.observed_state = 'suspended' AND x.desired_state = 'suspended'"
    "   AND EXISTS (SELECT 1 FROM workers WHERE id = $2 AND state IN ('draining', 'lost'))),"
    " u AS (UPDATE sandboxes s SET worker_id = p.wid, worker_generation = p.wgen,"
    "   moved_from = s.worker_id, desired_state = s.moving, moving = NULL, claim_until = NULL,"
    "   last_activity_at = now(), updated_at = now()"
    "  FROM p WHERE s.id = $1 AND s.worker_id = $2 AND s.moving IS NOT NULL"
    "   AND s.observed_state = 'suspended' AND s.desired_state = 'suspended'"
    "  RETURNING s.id, s.team_id, s.desired_state, s.worker_id),"
    " o AS (INSERT INTO operations (id, sandbox_id, team_id, kind, target)"
    "  SELECT 'op' || substr(md5(random()::text || clock_timestamp()::text || u.id), 1, 22),"
    "   u.id, u.team_id, 'drain', u.desired_state FROM u RETURNING 1),"
    " ev AS (INSERT INTO events (sandbox_id, kind, detail)"
    "  SELECT u.id, 'moved', 'to worker ' || u.worker_id FROM u RETURNING 1)"
    " SELECT count(" SP_RECON_NOTIFY("u") "), (SELECT count(*) FROM o),"
    "  (SELECT count(*) FROM ev) FROM u";

static void drain_moved(sp_fleet_t *f, PGresult *res, const sp_err_t *err, const char *id)
{
    if (err != NULL)
        sp_log(err->code == SP_ECAPACITY ? SP_LOG_INFO : SP_LOG_WARN, "fleet",
               "drain: sandbox=%s not moved yet err=%s", id, err->msg);
    else if (atoi(PQgetvalue(res, 0, 0)) == 1)
        sp_log(SP_LOG_INFO, "fleet", "drain: sandbox=%s placed elsewhere", id);
}

static void drain_ready(sp_fleet_t *f, PGresult *res, const sp_err_t *err, const char *arg)
{
    if (err != NULL)
        return;
    for (int i = 0; i < PQntuples(res); i++) {
        const char *id = PQgetvalue(res, i, 0);
        const char *p[] = {id, f->id, f->timeout_s};
        fq_send(f, drain_move_sql, 3, p, drain_moved, id);
    }
}

static void drain_step(sp_fleet_t *f)
{
    const char *p[] = {f->id};
    fq_send(f, drain_suspend_sql, 1, p, NULL, NULL);
    fq_send(f, drain_ready_sql, 1, p, drain_ready, NULL);
}

/* ---- the loss sweep ---- */

/* The lease first; every change below is conditioned on it, in the same statement. Lost
 * sandboxes of a worker that is still lost and are to be deleted are deleted here: there is
 * no VM left to stop (if the worker comes back, it stops its VM itself: comeback). The
 * template builds a worker declared lost was running fail with it (their builder VMs went
 * with it; a build of the same template is sent to another worker from then on).
 *
 * No worker is declared lost until the database has been reachable for a while, judged by
 * its own clock when the statement runs (a statement sent before an outage may wait in the
 * store's queue and run after it, so nothing decided when it was sent holds): the holder's
 * renewals have had no gap longer than $3 s for $4 s (leases.since, migration 19), and the
 * database itself has been up that long (a restart). $4 is the timeout plus the store's
 * longest reconnect backoff: after an outage every heartbeat is old, and each worker needs
 * up to that long to beat again. */
static const char *sweep_sql =
    "WITH l AS (INSERT INTO leases AS x (name, holder, until, renewed_at, since)"
    "  VALUES ('fleet', $1, now() + make_interval(secs => $2::int * 2), now(), now())"
    "  ON CONFLICT (name) DO UPDATE SET holder = excluded.holder, until = excluded.until,"
    "   renewed_at = now(), since = CASE WHEN x.holder = $1 AND x.since IS NOT NULL"
    "    AND x.renewed_at > now() - make_interval(secs => $3::float8) THEN x.since"
    "    ELSE now() END"
    "  WHERE x.until < now() OR x.holder = $1 RETURNING since),"
    " w AS (UPDATE workers SET state = 'lost', generation = generation + 1, lost_at = now()"
    "  WHERE state <> 'lost' AND heartbeat_at < now() - make_interval(secs => $2::int)"
    "   AND id <> $1 AND EXISTS (SELECT 1 FROM l"
    "    WHERE l.since <= now() - make_interval(secs => $4::float8))"
    "   AND pg_postmaster_start_time() <= now() - make_interval(secs => $4::float8)"
    "  RETURNING id, lost_at,"
    "   to_char(lost_at AT TIME ZONE 'UTC', 'YYYY-MM-DD\"T\"HH24:MI:SS\"Z\"') AS t),"
    " s AS (UPDATE sandboxes x SET observed_state = 'lost', lost_at = w.lost_at,"
    "   error = 'worker ' || w.id || ' lost at ' || w.t, claim_until = NULL, updated_at = now()"
    "  FROM w WHERE x.worker_id = w.id AND x.observed_state IN ('pending', 'starting',"
    "   'running', 'pausing', 'paused', 'waking', 'suspending')"
    "  RETURNING x.id, x.error),"
    /* its template builds: they ran there (migration 21) */
    " b AS (UPDATE template_builds x SET status = 'failed', finished_at = now(),"
    "   error = 'the worker running the build (' || w.id || ') was lost at ' || w.t"
    "  FROM w WHERE x.worker_id = w.id AND x.status IN ('queued', 'building')"
    "  RETURNING x.template, pg_notify('" SP_TMPL_NOTIFY "', x.id)),"
    " bt AS (UPDATE templates m SET status = 'failed' FROM b"
    "  WHERE m.name = b.template AND m.status = 'building' RETURNING 1),"
    " d AS (UPDATE sandboxes x SET observed_state = 'deleted', updated_at = now()"
    "  FROM workers k WHERE k.id = x.worker_id AND k.state = 'lost'"
    "   AND x.observed_state IN ('lost', 'stopping') AND x.desired_state = 'deleted'"
    "   AND EXISTS (SELECT 1 FROM l) RETURNING x.id),"
    " fo AS (UPDATE operations o SET status = CASE WHEN o.sandbox_id IN (SELECT id FROM d)"
    "   THEN 'succeeded' ELSE 'failed' END,"
    "   error_code = CASE WHEN o.sandbox_id IN (SELECT id FROM d) THEN NULL"
    "    ELSE 'worker_lost' END,"
    "   error_message = CASE WHEN o.sandbox_id IN (SELECT id FROM d) THEN NULL"
    "    ELSE (SELECT s.error FROM s WHERE s.id = o.sandbox_id) END,"
    "   finished_at = now()"
    "  WHERE o.status IN ('pending', 'running') AND o.kind <> 'snapshot'"
    "   AND (o.sandbox_id IN (SELECT id FROM s) OR o.sandbox_id IN (SELECT id FROM d))"
    "  RETURNING o.id),"
    " ev AS (INSERT INTO events (sandbox_id, kind, detail)"
    "  SELECT s.id, 'lost', s.error FROM s UNION ALL SELECT d.id, 'deleted', 'worker lost'"
    "  FROM d RETURNING 1)"
    " SELECT (SELECT count(*) FROM l), (SELECT count(*) FROM w), (SELECT count(*) FROM s),"
    "  (SELECT count(*) FROM d), (SELECT count(pg_notify('space_ops', fo.id)) FROM fo),"
    "  (SELECT count(*) FROM ev), (SELECT string_agg(id, ',') FROM w)";

/* Sandboxes a drain suspended to move whose worker was lost before it moved them: suspended,
 * their snapshots are on the shared snapshot directory, so the sweep places them elsewhere in
 * its stead (drain_move_sql, which states the row again), a batch per sweep. */
static const char *lost_moves_sql =
    "SELECT x.id, x.worker_id FROM workers w JOIN sandboxes x ON x.worker_id = w.id"
    " WHERE w.state = 'lost' AND x.moving IS NOT NULL AND x.observed_state = 'suspended'"
    "  AND x.desired_state = 'suspended' ORDER BY x.updated_at LIMIT " FLEET_DRAIN_BATCH;

static void lost_moves(sp_fleet_t *f, PGresult *res, const sp_err_t *err, const char *arg)
{
    if (err != NULL) {
        sp_log(SP_LOG_WARN, "fleet", "sweep: reading moves off lost workers failed err=%s",
               err->msg);
        return;
    }
    for (int i = 0; i < PQntuples(res); i++) {
        const char *id = PQgetvalue(res, i, 0);
        const char *p[] = {id, PQgetvalue(res, i, 1), f->timeout_s};
        fq_send(f, drain_move_sql, 3, p, drain_moved, id);
    }
}

static void swept(sp_fleet_t *f, PGresult *res, const sp_err_t *err, const char *arg)
{
    sp_timer_start(&f->sweep, (uint64_t)f->beat_ms);
    if (err != NULL) {
        sp_log(SP_LOG_WARN, "fleet", "sweep failed err=%s", err->msg);
        return;
    }
    if (atoi(PQgetvalue(res, 0, 1)) > 0 || atoi(PQgetvalue(res, 0, 3)) > 0)
        sp_log(SP_LOG_WARN, "fleet", "workers lost=%s (%s) sandboxes lost=%s deleted=%s",
               PQgetvalue(res, 0, 1), PQgetvalue(res, 0, 6), PQgetvalue(res, 0, 2),
               PQgetvalue(res, 0, 3));
    if (atoi(PQgetvalue(res, 0, 0)) > 0) /* this node holds the lease */
        fq_send(f, lost_moves_sql, 0, NULL, lost_moves, NULL);
}

static void on_sweep(sp_timer_t *t, void *arg)
{
    sp_fleet_t *f = arg;
    /* The sweeping node never declares itself lost: it is plainly alive. */
    const char *p[] = {f->id, f->timeout_s, f->gap_s, f->judge_s};
    if (fq_send(f, sweep_sql, 4, p, swept, NULL) < 0)
        sp_timer_start(&f->sweep, (uint64_t)f->beat_ms);
}

/* ---- lifetime ---- */

sp_fleet_t *sp_fleet_create(sp_loop_t *loop, sp_store_t *store, sp_driver_t *driver,
                            const sp_fleet_opts_t *o, sp_err_t *err)
{
    if (o->heartbeat_timeout_s < 2 || o->lost_grace_s < 0) {
        sp_err_set(err, SP_EINVAL, "the heartbeat timeout must be 2 s or more");
        return NULL;
    }
    sp_fleet_t *f = calloc(1, sizeof(*f));
    if (f == NULL || (f->labels = o->labels != NULL ? json_dumps(o->labels, JSON_COMPACT)
                                                    : strdup("{}")) == NULL) {
        free(f);
        sp_err_set(err, SP_EINTERNAL, "out of memory");
        return NULL;
    }
    f->loop = loop;
    f->store = store;
    f->driver = driver;
    f->role = o->role;
    snprintf(f->id, sizeof(f->id), "%s", o->worker_id);
    snprintf(f->address, sizeof(f->address), "%s", o->address ? o->address : "");
    if (o->vcpus > 0)
        snprintf(f->vcpus, sizeof(f->vcpus), "%d", o->vcpus);
    if (o->memory_mb > 0)
        snprintf(f->memory_mb, sizeof(f->memory_mb), "%d", o->memory_mb);
    snprintf(f->accel_file, sizeof(f->accel_file), "%s", o->accel_file ? o->accel_file : "");
    snprintf(f->version, sizeof(f->version), "%s", o->version ? o->version : "");
    snprintf(f->timeout_s, sizeof(f->timeout_s), "%d", o->heartbeat_timeout_s);
    /* a renewal gap of half the timeout (two sweeps missed) breaks the run */
    snprintf(f->gap_s, sizeof(f->gap_s), "%.3f", o->heartbeat_timeout_s / 2.0);
    snprintf(f->judge_s, sizeof(f->judge_s), "%.3f",
             o->heartbeat_timeout_s + SP_STORE_BACKOFF_MAX_MS / 1000.0);
    snprintf(f->grace_s, sizeof(f->grace_s), "%d", o->lost_grace_s);
    f->beat_ms = o->heartbeat_timeout_s * 1000 / 4;
    sp_timer_init(&f->beat, loop, on_beat, f);
    sp_timer_init(&f->sweep, loop, on_sweep, f);
    if (driver != NULL && o->role != SP_ROLE_API)
        sp_timer_start(&f->beat, 0);
    if (o->role != SP_ROLE_WORKER)
        sp_timer_start(&f->sweep, (uint64_t)f->beat_ms);
    return f;
}

bool sp_fleet_ready(const sp_fleet_t *f)
{
    return f == NULL || f->driver == NULL || f->role == SP_ROLE_API || f->registered;
}

void sp_fleet_destroy(sp_fleet_t *f)
{
    if (f == NULL)
        return;
    sp_timer_stop(&f->beat);
    sp_timer_stop(&f->sweep);
    f->dying = true;
    reap(f);
}

/* ---- the operator's view ---- */

struct wq {
    sp_fleet_t *f;
    sp_fleet_workers_cb cb;
    void *arg;
    bool one;
};

static const char *workers_sql =
    "SELECT json_build_object('id', w.id, 'address', w.address, 'role', w.role,"
    "  'state', w.state, 'drain', w.drain, 'generation', w.generation,"
    "  'accelerator', w.accelerator, 'version', w.version, 'labels', w.labels,"
    "  'templates', w.templates,"
    "  'capacity', json_build_object('vcpus', w.vcpus, 'memory_mb', w.memory_mb),"
    "  'used', json_build_object('vcpus', u.c, 'memory_mb', u.m), 'sandboxes', u.n,"
    "  'heartbeat_age_s', round(extract(epoch FROM now() - w.heartbeat_at)::numeric, 1),"
    "  'started_at', to_char(w.started_at AT TIME ZONE 'UTC', 'YYYY-MM-DD\"T\"HH24:MI:SS\"Z\"'),"
    "  'lost_at', to_char(w.lost_at AT TIME ZONE 'UTC', 'YYYY-MM-DD\"T\"HH24:MI:SS\"Z\"'))::text,"
    " CASE WHEN $1::text IS NULL THEN NULL ELSE json_build_object("
    "  'sandboxes', (SELECT coalesce(json_agg(json_build_object('id', s.id,"
    "    'state', s.observed_state, 'desired_state', s.desired_state,"
    "    'moving', s.moving IS NOT NULL) ORDER BY s.id), '[]') FROM sandboxes s"
    "   WHERE s.worker_id = w.id AND s.observed_state <> 'deleted'),"
    "  'moved', (SELECT coalesce(json_agg(json_build_object('id', s.id, 'worker_id', s.worker_id,"
    "    'state', s.observed_state) ORDER BY s.id), '[]') FROM sandboxes s"
    "   WHERE s.moved_from = w.id AND s.worker_id IS DISTINCT FROM w.id"
    "   AND s.observed_state <> 'deleted'))::text END"
    " FROM workers w CROSS JOIN LATERAL (SELECT"
    "  coalesce(sum(s.cpu_count) FILTER (WHERE s.desired_state IN ('running', 'paused')), 0) c,"
    "  coalesce(sum(s.memory_mb) FILTER (WHERE s.desired_state IN ('running', 'paused')), 0) m,"
    "  count(*) n FROM sandboxes s WHERE s.worker_id = w.id AND s.observed_state <> 'deleted') u"
    " WHERE $1::text IS NULL OR w.id = $1 ORDER BY w.id";

static void workers_done(void *rec, PGresult *res, const sp_err_t *err)
{
    struct wq *q = rec;
    sp_err_t e;
    if (err == NULL && q->one && PQntuples(res) == 0)
        err = (sp_err_set(&e, SP_ENOTFOUND, "worker not found"), &e);
    if (err != NULL) {
        q->cb(q->arg, NULL, err);
        return;
    }
    json_t *a = json_array();
    for (int i = 0; a != NULL && i < PQntuples(res); i++) {
        json_t *w = json_loads(PQgetvalue(res, i, 0), 0, NULL);
        if (w != NULL && !PQgetisnull(res, i, 1)) {
            json_t *more = json_loads(PQgetvalue(res, i, 1), 0, NULL);
            if (more != NULL)
                json_object_update(w, more);
            json_decref(more);
        }
        if (w != NULL)
            json_array_append_new(a, w);
    }
    if (a == NULL) {
        q->cb(q->arg, NULL, (sp_err_set(&e, SP_EINTERNAL, "out of memory"), &e));
        return;
    }
    q->cb(q->arg, a, NULL);
    json_decref(a);
}

static bool valid_worker_id(const char *id)
{
    return id != NULL && label_text_ok(id, strlen(id), true);
}

int sp_fleet_workers(sp_fleet_t *f, const char *id, sp_fleet_workers_cb cb, void *arg,
                     sp_err_t *err)
{
    if (id != NULL && !valid_worker_id(id))
        return sp_err_set(err, SP_ENOTFOUND, "worker not found");
    const char *p[] = {id};
    struct wq *q = sp_store_call(f->store, workers_sql, 1, p, sizeof(*q), workers_done, err);
    if (q == NULL)
        return -1;
    q->f = f;
    q->cb = cb;
    q->arg = arg;
    q->one = id != NULL;
    return 0;
}

struct bq {
    sp_fleet_builder_cb cb;
    void *arg;
};

static void builder_done(void *rec, PGresult *res, const sp_err_t *err)
{
    struct bq *q = rec;
    sp_err_t e;
    if (err == NULL && PQntuples(res) != 1)
        err = (sp_err_set(&e, SP_EUNAVAIL,
                          "no worker can take template builds now: none is active with an "
                          "address and a recent heartbeat"),
               &e);
    if (err != NULL)
        q->cb(q->arg, NULL, NULL, err);
    else
        q->cb(q->arg, PQgetvalue(res, 0, 0), PQgetvalue(res, 0, 1), NULL);
}

int sp_fleet_builder(sp_fleet_t *f, const char *name, sp_fleet_builder_cb cb, void *arg,
                     sp_err_t *err)
{
    char key[65]; /* the name; a tag after ':' is not part of it */
    snprintf(key, sizeof key, "%.*s", (int)strcspn(name, ":"), name);
    const char *p[] = {f->timeout_s, key};
    struct bq *q = sp_store_call(f->store,
                                 "SELECT id, address FROM workers WHERE state = 'active'"
                                 " AND address <> ''"
                                 " AND heartbeat_at > now() - make_interval(secs => $1::int)"
                                 " ORDER BY md5($2 || '/' || id), id LIMIT 1",
                                 2, p, sizeof(*q), builder_done, err);
    if (q == NULL)
        return -1;
    q->cb = cb;
    q->arg = arg;
    return 0;
}

struct dq {
    sp_fleet_t *f;
    sp_fleet_workers_cb cb;
    void *arg;
    char id[65];
};

static void drained(void *rec, PGresult *res, const sp_err_t *err)
{
    struct dq *q = rec;
    sp_err_t e;
    if (err == NULL && PQntuples(res) != 1)
        err = (sp_err_set(&e, SP_ENOTFOUND, "worker not found"), &e);
    if (err != NULL || sp_fleet_workers(q->f, q->id, q->cb, q->arg, &e) < 0)
        q->cb(q->arg, NULL, err != NULL ? err : &e);
}

int sp_fleet_drain(sp_fleet_t *f, const char *id, bool drain, sp_fleet_workers_cb cb, void *arg,
                   sp_err_t *err)
{
    if (!valid_worker_id(id))
        return sp_err_set(err, SP_ENOTFOUND, "worker not found");
    const char *p[] = {id, drain ? "draining" : "active"};
    /* Undrain also wakes here what a drain suspended and did not move yet. A lost worker
     * keeps its state and records the wish (it returns to it: BACK_STATE); what its drain
     * suspended is moved by the sweep meanwhile, undrained or not (its memory is gone). */
    struct dq *q = sp_store_call(
        f->store,
        "WITH prev AS (SELECT state FROM workers WHERE id = $1 FOR UPDATE),"
        " w AS (UPDATE workers w SET drain = $2 = 'draining',"
        "   state = CASE WHEN prev.state = 'lost' THEN 'lost' ELSE $2 END FROM prev"
        "  WHERE w.id = $1 RETURNING w.state),"
        " b AS (UPDATE sandboxes SET desired_state = moving, moving = NULL, updated_at = now()"
        "  WHERE $2 = 'active' AND worker_id = $1 AND moving IS NOT NULL"
        "   AND desired_state = 'suspended' AND EXISTS (SELECT 1 FROM w WHERE w.state = 'active')"
        "  RETURNING id, worker_id)"
        " SELECT prev.state, (SELECT count(" SP_RECON_NOTIFY("b") ") FROM b) FROM prev",
        2, p, sizeof(*q), drained, err);
    if (q == NULL)
        return -1;
    q->f = f;
    q->cb = cb;
    q->arg = arg;
    snprintf(q->id, sizeof(q->id), "%s", id);
    return 0;
}
