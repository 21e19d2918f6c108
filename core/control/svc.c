/*
 * svc.c - core operations over the store.
 *
 * Each call is one statement (data-modifying CTEs keep multi-row changes
 * atomic) whose result is parsed into records here; the HTTP layers render
 * them. Operation waits are woken by NOTIFY space_ops (payload: operation
 * ID) from the controller, re-checked after the listener reconnects, and
 * bounded by their own timers.
 */
#include "core/control/svc.h"

#include <sodium.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/control/fleet.h"
#include "core/control/recon.h"
#include "core/control/snap.h"
#include "core/control/tmpl.h"
#include "core/control/tokens.h"
#include "core/egress/egress_policy.h"
#include "core/egress/secrets.h"
#include "base/buf.h"
#include "base/log.h"

#define TS(x) "to_char((" x ") AT TIME ZONE 'UTC', 'YYYY-MM-DD\"T\"HH24:MI:SS.MS\"Z\"')"

/* Timestamps of the hot reads: selected in UTC as plain text and put in the API's form by
 * sp_store_time (store.h), not by to_char, which cost PostgreSQL more than the row itself. At
 * a zero offset, not at zone 'UTC': the same values, without a zone looked up by name for each
 * (half the cost of the conversion). */
#define UTC(x) "(" x ") AT TIME ZONE INTERVAL '+00:00'"

#define SANDBOX_COLS                                                                               \
    "s.id, s.team_id, s.template, s.desired_state, s.observed_state, " UTC("s.created_at") ", "   \
    UTC("s.last_activity_at") ", " UTC("s.deadline_at") ", s.deadline_action, "                    \
    "s.idle_timeout_s, s.cpu_count, s.memory_mb, s.snapshot_bytes, "                               \
    "coalesce(s.token_salt, ''), "                                                                 \
    "coalesce(s.error, ''), s.metadata::text, s.auto_resume, coalesce(s.deadline_s, 0), "          \
    "coalesce(s.allow_internet_access::int, -1), coalesce(s.network::text, ''), "                 \
    "coalesce(s.envd_version, ''), " UTC("coalesce(s.deadline_at, s.created_at + make_interval("  \
    "secs => coalesce(s.deadline_s, 315360000)))") ", " UTC("s.lost_at") ", "                    \
    "coalesce(s.disk_mb, -1)"
#define SANDBOX_NCOLS 24

struct waiter {
    sp_svc_t *svc;
    char team_id[SP_ID_LEN + 1];
    char op_id[65];
    sp_svc_op_cb cb;
    void *arg;
    sp_timer_t timer;
    bool checking; /* a re-check query is in flight */
    bool recheck;  /* a NOTIFY arrived while it was: its answer may predate the change */
    bool expired;  /* timer fired: answer with whatever the next check finds */
    struct waiter *prev, *next;
};

/* Authenticated keys, so a request costs one query instead of two. Entries live
 * AUTH_TTL_MS; NOTIFY space_keys (sent by revoke) and a listener reconnect clear all, and
 * bump auth_gen: an answer to a lookup sent before the clear (it may have read the key before
 * the revoke committed) is used for its own request but not cached. So a revoked key stops
 * working as soon as the NOTIFY arrives; AUTH_TTL_MS bounds it should one be missed. */
#define AUTH_SLOTS  1024
#define AUTH_TTL_MS 60000

struct auth_entry {
    char hash[SP_KEYHASH_HEX + 1]; /* "" = empty slot */
    sp_auth_t auth;
    uint64_t expires_ms;
};

struct sp_svc {
    sp_loop_t *loop;
    sp_store_t *store;
    unsigned char hashkey[SP_HASHKEY_LEN];
    sp_tokens_t *tokens; /* sandboxes' data-plane tokens (tokens.h) */
    struct waiter *waiters;
    struct auth_entry auth_cache[AUTH_SLOTS];
    int auth_gen; /* bumped by each clear */
    sp_driver_t *driver; /* borrowed; NULL: no data plane */
    sp_sampler_t *sampler; /* with the driver: each sandbox's figures over time */
    struct sp_secrets *secrets; /* borrowed; NULL: no secrets API */
    void (*egress_hook)(void *arg, const char *sandbox_id, const json_t *policy); /* changed */
    void *egress_hook_arg;
    char quota[4][16]; /* the default sandboxes, vcpus, memory_mb, snapshot_mb as parameters;
                        * "": none */
    char place_self[65]; /* this node's worker id; "": an API node (SQL NULL) */
    char place_fresh[16]; /* the heartbeat timeout, seconds */
};

/* Queues sql; done gets an sp_store_req_t, owner svc (flag: the caller's kind or limit). */
static int submit(sp_svc_t *svc, const char *sql, int n, const char *const *p,
                  sp_store_rec_cb done, void *cb, void *arg, int kind, sp_err_t *err)
{
    return sp_store_submit(svc->store, sql, n, p, done, svc, cb, arg, kind, err);
}

/* ---- row parsing ---- */

/* svc: the tokens are derived from the salt read (core/control/tokens.h). */
static void parse_sandbox(const sp_svc_t *svc, PGresult *r, int row, int col,
                          sp_sandbox_rec_t *s)
{
    memset(s, 0, sizeof(*s));
    SP_STORE_TEXT(r, row, col + 0, s->id);
    SP_STORE_TEXT(r, row, col + 1, s->team_id);
    SP_STORE_TEXT(r, row, col + 2, s->template_name);
    SP_STORE_TEXT(r, row, col + 3, s->desired);
    SP_STORE_TEXT(r, row, col + 4, s->observed);
    SP_STORE_TIME(r, row, col + 5, s->created_at);
    SP_STORE_TIME(r, row, col + 6, s->last_activity_at);
    SP_STORE_TIME(r, row, col + 7, s->deadline_at);
    SP_STORE_TEXT(r, row, col + 8, s->deadline_action);
    s->idle_timeout_s = atoi(PQgetvalue(r, row, col + 9));
    s->cpu_count = atoi(PQgetvalue(r, row, col + 10));
    s->memory_mb = atoi(PQgetvalue(r, row, col + 11));
    s->snapshot_bytes = atoll(PQgetvalue(r, row, col + 12));
    const char *salt = PQgetvalue(r, row, col + 13);
    if (salt[0] != '\0' && (sp_tokens_envd(svc->tokens, s->id, salt, s->access_token) < 0 ||
                             sp_tokens_traffic(svc->tokens, s->id, salt, s->traffic_token) < 0))
        sp_log(SP_LOG_WARN, "svc", "sandbox=%s tokens cannot be derived (%s)", s->id,
               salt[0] == 'm' ? "made with a master key this server has not got" : "bad salt");
    SP_STORE_TEXT(r, row, col + 14, s->error);
    /* Most sandboxes have none: "{}" without the parser's setup (per row of every list). */
    const char *md = PQgetvalue(r, row, col + 15);
    s->metadata = strcmp(md, "{}") == 0 ? json_object() : json_loads(md, 0, NULL);
    if (s->metadata == NULL)
        s->metadata = json_object();
    s->auto_resume = PQgetvalue(r, row, col + 16)[0] == 't';
    s->deadline_s = atoi(PQgetvalue(r, row, col + 17));
    s->allow_internet = atoi(PQgetvalue(r, row, col + 18));
    const char *net = PQgetvalue(r, row, col + 19);
    s->network = net[0] ? json_loads(net, 0, NULL) : NULL;
    SP_STORE_TEXT(r, row, col + 20, s->envd_version);
    SP_STORE_TIME(r, row, col + 21, s->end_at);
    SP_STORE_TIME(r, row, col + 22, s->lost_at);
    s->disk_mb = atoll(PQgetvalue(r, row, col + 23));
}

void sp_svc_parse_op(const PGresult *r, int row, int col, sp_op_rec_t *o)
{
    memset(o, 0, sizeof(*o));
    SP_STORE_TEXT(r, row, col + 0, o->id);
    SP_STORE_TEXT(r, row, col + 1, o->sandbox_id);
    SP_STORE_TEXT(r, row, col + 2, o->kind);
    SP_STORE_TEXT(r, row, col + 3, o->status);
    SP_STORE_TEXT(r, row, col + 4, o->error_code);
    SP_STORE_TEXT(r, row, col + 5, o->error_message);
    SP_STORE_TIME(r, row, col + 6, o->created_at);
    SP_STORE_TIME(r, row, col + 7, o->finished_at);
    SP_STORE_TEXT(r, row, col + 8, o->snapshot_id);
    SP_STORE_TEXT(r, row, col + 9, o->progress);
}

static bool op_finished(const sp_op_rec_t *o)
{
    return strcmp(o->status, "succeeded") == 0 || strcmp(o->status, "failed") == 0;
}

/* ---- authentication ---- */

static struct auth_entry *auth_slot(sp_svc_t *svc, const char *hash)
{
    /* The hash is uniformly random hex: its first 3 digits spread keys over the slots. */
    unsigned idx = (unsigned)strtoul((char[4]){hash[0], hash[1], hash[2], 0}, NULL, 16);
    return &svc->auth_cache[idx % AUTH_SLOTS];
}

static void auth_cache_clear(void *arg, const char *channel, const char *payload)
{
    sp_svc_t *svc = arg;
    memset(svc->auth_cache, 0, sizeof(svc->auth_cache));
    svc->auth_gen = (svc->auth_gen + 1) & 0x3fffffff;
}

struct auth_hit {
    sp_svc_auth_cb cb;
    void *arg;
    sp_auth_t auth;
};

static void auth_hit_fire(void *p)
{
    struct auth_hit *h = p;
    h->cb(h->arg, &h->auth, NULL);
    free(h);
}

static void auth_done(void *rec, PGresult *res, const sp_err_t *err)
{
    sp_store_req_t *c = rec;
    sp_svc_auth_cb cb = (sp_svc_auth_cb)c->cb;
    sp_err_t e;
    const sp_err_t *fail = sp_store_one_row(res, err, SP_EAUTH, "invalid or revoked API key", &e);
    if (fail != NULL) {
        cb(c->arg, NULL, fail);
        return;
    }
    sp_auth_t a;
    SP_STORE_TEXT(res, 0, 0, a.team_id);
    SP_STORE_TEXT(res, 0, 1, a.key_id);
    sp_svc_t *svc = c->owner;
    if (c->flag == svc->auth_gen) {
        struct auth_entry *slot = auth_slot(svc, PQgetvalue(res, 0, 2));
        SP_STORE_TEXT(res, 0, 2, slot->hash);
        slot->auth = a;
        slot->expires_ms = sp_loop_now_ms(svc->loop) + AUTH_TTL_MS;
    }
    cb(c->arg, &a, NULL);
}

int sp_svc_authenticate(sp_svc_t *svc, const char *key, sp_svc_auth_cb cb, void *arg,
                        sp_err_t *err)
{
    if (key == NULL || key[0] == '\0')
        return sp_err_set(err, SP_EAUTH, "missing API key");
    if (strlen(key) > 256)
        return sp_err_set(err, SP_EAUTH, "invalid or revoked API key");
    char hash[SP_KEYHASH_HEX + 1];
    sp_ids_key_hash(svc->hashkey, key, hash);
    struct auth_entry *slot = auth_slot(svc, hash);
    if (strcmp(slot->hash, hash) == 0 && slot->expires_ms > sp_loop_now_ms(svc->loop)) {
        struct auth_hit *h = malloc(sizeof(*h));
        if (h != NULL) {
            h->cb = cb;
            h->arg = arg;
            h->auth = slot->auth;
            if (sp_loop_defer(svc->loop, auth_hit_fire, h) == 0)
                return 0;
            free(h);
        }
    }
    const char *p[] = {hash};
    return submit(svc,
                  "SELECT team_id, id, hash FROM api_keys WHERE hash = $1 AND revoked_at IS NULL",
                  1, p, auth_done, (void *)cb, arg, svc->auth_gen, err);
}

/* ---- templates ---- */

static void templates_done(void *rec, PGresult *res, const sp_err_t *err)
{
    sp_store_req_t *c = rec;
    sp_svc_templates_cb cb = (sp_svc_templates_cb)c->cb;
    sp_err_t e;
    const sp_err_t *fail;
    sp_template_rec_t *recs =
        sp_store_rows(res, err, SP_ENOTFOUND, c->flag == 1 ? "template not found" : NULL,
                      sizeof(*recs), &fail, &e);
    if (recs == NULL) {
        cb(c->arg, NULL, 0, fail);
        return;
    }
    int n = PQntuples(res);
    for (int i = 0; i < n; i++) {
        SP_STORE_TEXT(res, i, 0, recs[i].name);
        SP_STORE_TEXT(res, i, 1, recs[i].description);
        recs[i].cpu_count = atoi(PQgetvalue(res, i, 2));
        recs[i].memory_mb = atoi(PQgetvalue(res, i, 3));
        SP_STORE_TEXT(res, i, 4, recs[i].status);
        SP_STORE_TEXT(res, i, 5, recs[i].updated_at);
        recs[i].builtin = PQgetvalue(res, i, 6)[0] == 't';
        SP_STORE_TEXT(res, i, 7, recs[i].version);
        SP_STORE_TEXT(res, i, 8, recs[i].parent);
        SP_STORE_TEXT(res, i, 10, recs[i].last_build_id);
        SP_STORE_TEXT(res, i, 11, recs[i].last_build_status);
        recs[i].versions = json_loads(PQgetvalue(res, i, 12), 0, NULL);
        if (!json_is_array(recs[i].versions)) {
            json_decref(recs[i].versions);
            recs[i].versions = json_array();
        }
        recs[i].disk_mb = PQgetisnull(res, i, 13) ? 0 : atoi(PQgetvalue(res, i, 13));
        recs[i].size_bytes = PQgetisnull(res, i, 14) ? -1 : atoll(PQgetvalue(res, i, 14));
    }
    cb(c->arg, recs, (size_t)n, NULL);
    for (int i = 0; i < n; i++)
        json_decref(recs[i].versions);
    free(recs);
}

int sp_svc_templates(sp_svc_t *svc, const sp_auth_t *a, const char *name,
                     sp_svc_templates_cb cb, void *arg, sp_err_t *err)
{
    const char *p[] = {name, a->team_id};
    /* SQL with TS() between its strings: clang-format would break it apart */
    /* clang-format off */
    return submit(svc,
                  "SELECT name, description, cpu_count, memory_mb, status, " TS("updated_at")
                  ", team_id IS NULL, coalesce(build_id, ''), coalesce(parent, ''),"
                  " (SELECT max(" TS("b.created_at") ") FROM template_builds b"
                  "  WHERE b.template = t.name AND b.team_id = $2),"
                  " (SELECT b.id FROM template_builds b WHERE b.template = t.name"
                  "  AND b.team_id = $2 ORDER BY b.created_at DESC LIMIT 1),"
                  " (SELECT b.status FROM template_builds b WHERE b.template = t.name"
                  "  AND b.team_id = $2 ORDER BY b.created_at DESC LIMIT 1),"
                  " coalesce((SELECT json_agg(json_build_object('version', v.hash,"
                  "  'created_at', " TS("v.created_at") ", 'disk_mb', v.disk_mb,"
                  "  'size_bytes', v.size_bytes, 'tags', coalesce((SELECT json_agg(g.tag"
                  "  ORDER BY g.tag) FROM template_tags g WHERE g.template = v.template"
                  "  AND g.hash = v.hash), '[]'::json)) ORDER BY v.created_at DESC)"
                  "  FROM template_versions v WHERE v.template = t.name"
                  "  AND t.team_id IS NOT NULL), '[]'::json)::text,"
                  " (SELECT v.disk_mb FROM template_versions v WHERE v.template = t.name"
                  "  AND v.hash = t.build_id),"
                  " (SELECT v.size_bytes FROM template_versions v WHERE v.template = t.name"
                  "  AND v.hash = t.build_id)"
                  " FROM templates t WHERE ($1::text IS NULL OR name = $1)"
                  " AND deleted_at IS NULL AND (team_id IS NULL OR team_id = $2) ORDER BY name",
                  2, p, templates_done, (void *)cb, arg, name != NULL, err);
    /* clang-format on */
}

/* ---- sandboxes ---- */

static void sandbox_done(void *rec, PGresult *res, const sp_err_t *err)
{
    sp_store_req_t *c = rec;
    sp_svc_sandbox_cb cb = (sp_svc_sandbox_cb)c->cb;
    sp_err_t e;
    const sp_err_t *fail = sp_store_one_row(res, err, SP_ENOTFOUND,
                                            c->flag == 1   ? "template not found"
                                            : c->flag == 2 ? "snapshot not found"
                                                           : "sandbox not found",
                                            &e);
    if (fail != NULL) {
        cb(c->arg, NULL, NULL, fail);
        return;
    }
    sp_sandbox_rec_t sb;
    sp_op_rec_t op;
    parse_sandbox(c->owner, res, 0, 0, &sb);
    if (PQnfields(res) >= SANDBOX_NCOLS + SP_SVC_OP_NCOLS) {
        sp_svc_parse_op(res, 0, SANDBOX_NCOLS, &op);
        cb(c->arg, &sb, &op, NULL);
    } else {
        cb(c->arg, &sb, NULL, NULL);
    }
    json_decref(sb.metadata);
    json_decref(sb.network);
}

/* A create's statement, its parameters owned: kept while the secrets its credential rules name
 * are looked up, then sent. */
#define CREATE_NPARAMS 27

struct create {
    sp_svc_t *svc;
    sp_svc_sandbox_cb cb;
    void *arg;
    char *p[CREATE_NPARAMS]; /* malloc'd or NULL (SQL NULL) */
    bool oom;
    sp_err_t made_none; /* by snapshot or tag: why the statement made nothing, kept while the
                         * snapshot or tag is read to say more (on_create_checked) */
};

static void create_free(struct create *cr)
{
    for (int i = 0; i < CREATE_NPARAMS; i++)
        free(cr->p[i]);
    free(cr);
}

/* Parameter i: a copy of s (NULL stays NULL). */
static void create_param(struct create *cr, int i, const char *s)
{
    if (s != NULL && (cr->p[i] = strdup(s)) == NULL)
        cr->oom = true;
}

/* Parameter i: an integer, or NULL when it is 0 and zero_is_null. */
static void create_int(struct create *cr, int i, int v, bool zero_is_null)
{
    char t[16];
    snprintf(t, sizeof(t), "%d", v);
    create_param(cr, i, v == 0 && zero_is_null ? NULL : t);
}

/* Parameter i: o as compact JSON text (NULL stays NULL). */
static void create_json(struct create *cr, int i, const json_t *o)
{
    if (o != NULL && (cr->p[i] = json_dumps(o, JSON_COMPACT)) == NULL)
        cr->oom = true;
}

static void on_create_checked(void *rec, PGresult *res, const sp_err_t *err);

/* Sends the statement. A create by template name frees cr either way (the store copies the
 * parameters); one by snapshot or "name:tag" keeps it for on_create_checked (freed here only
 * when nothing was sent). */
static int create_submit(struct create *cr, sp_err_t *err)
{
    bool checked = cr->p[18] != NULL || cr->p[19] != NULL;
    int rc = submit(
        cr->svc,
        /* a team's template: the version its tag ($20, else 'default') names, with that
         * version's sizes and env (tmpl.h); a built-in one: its current build */
        "WITH t AS (SELECT name, coalesce(v.cpu_count, m.cpu_count) AS cpu_count,"
        "  coalesce(v.memory_mb, m.memory_mb) AS memory_mb, coalesce(v.env, m.env) AS env,"
        "  NULL::text AS snap, v.hash AS ver FROM templates m"
        "  LEFT JOIN template_tags g ON g.template = m.name AND g.tag = coalesce($20, 'default')"
        "  LEFT JOIN template_versions v ON v.template = g.template AND v.hash = g.hash"
        "  WHERE $19::text IS NULL AND name = $3 AND deleted_at IS NULL"
        "  AND (m.team_id IS NULL OR (m.team_id = $2 AND status = 'ready' AND v.hash IS NOT NULL))"
        "  AND ($20::text IS NULL OR $20 = 'default' OR m.team_id IS NOT NULL)"
        " UNION ALL SELECT template, cpu_count, memory_mb, env, id,"
        "  (SELECT x.template_version FROM sandboxes x WHERE x.id = snapshots.sandbox_id)"
        "  FROM snapshots"
        "  WHERE id = $19 AND team_id = $2 AND deleted_at IS NULL AND state = 'ready'),"
        " s AS (INSERT INTO sandboxes (id, team_id, template, metadata, env, idle_timeout_s,"
        "  deadline_at, deadline_action, cpu_count, memory_mb, token_salt,"
        "  auto_resume, deadline_s, allow_internet_access, network, envd_version, credentials,"
        "  egress, snapshot_id, template_version, placement, worker_id, worker_generation,"
        "  token_hash)"
        "  SELECT $1, $2, t.name, $4::jsonb, t.env || coalesce($5::jsonb, '{}'), $6::int,"
        "   now() + make_interval(secs => $7::int), $8,"
        "   coalesce($9::int, t.cpu_count), coalesce($10::int, t.memory_mb), $11,"
        "   $13::bool, $7::int, $14::bool, $15::jsonb, $16, coalesce($17::jsonb, '[]'),"
        "   $18::jsonb, t.snap, t.ver, $24::jsonb, p.wid, p.wgen, $27 FROM t"
        /* the worker (core/control/fleet.h): refuses with SPCAP when none has room. The
         * quotas (svc.h: refuses with SPQTA, else true) go first, as an argument: every
         * create takes the team's lock before the workers', never the other way round */
        "  CROSS JOIN LATERAL space_place(CASE WHEN space_team_quota($2,"
        "   coalesce($9::int, t.cpu_count), coalesce($10::int, t.memory_mb), $21::int,"
        "   $22::int, $23::int) THEN coalesce($9::int, t.cpu_count) END,"
        "   coalesce($10::int, t.memory_mb), $24::jsonb, t.name || coalesce('@' || t.ver, ''),"
        /* from a snapshot: only on the worker holding its files (migration 20), unless
         * they are in the shared snapshot dir too (22): then that worker first */
        "   $25::int, $26, (SELECT CASE WHEN z.shared THEN '' ELSE '=' END || z.worker_id"
        "    FROM snapshots z WHERE z.id = t.snap)) p"
        "  RETURNING *),"
        " o AS (INSERT INTO operations (id, sandbox_id, team_id, kind, target)"
        "  SELECT $12, s.id, s.team_id, 'create', 'running' FROM s RETURNING *),"
        " ev AS (INSERT INTO events (sandbox_id, kind) SELECT s.id, 'created' FROM s RETURNING 1),"
        " n AS (SELECT " SP_RECON_NOTIFY("s") " FROM s)"
                                              " SELECT " SANDBOX_COLS ", " SP_SVC_OP_COLS
                                              " FROM s, o, n, ev",
        CREATE_NPARAMS, (const char *const *)cr->p, checked ? on_create_checked : sandbox_done,
        (void *)cr->cb, checked ? (void *)cr : cr->arg, cr->p[18] != NULL ? 2 : 1, err);
    if (!checked || rc < 0)
        create_free(cr);
    return rc;
}

/* A create by snapshot or tag that made nothing is answered: fail, else the statement's own
 * reason; cr is freed. */
static void create_refused(struct create *cr, const sp_err_t *fail)
{
    cr->cb(cr->arg, NULL, NULL, fail != NULL ? fail : &cr->made_none);
    create_free(cr);
}

/* The snapshot a create started from was read, its statement having made nothing: why it
 * cannot be used (404, 409 or 503, told apart here so the client learns which), else the
 * statement's own answer. */
static void on_create_snapshot(void *rec, PGresult *res, const sp_err_t *err)
{
    sp_store_req_t *c = rec;
    struct create *cr = c->arg;
    sp_err_t e;
    const sp_err_t *fail = sp_store_one_row(res, err, SP_ENOTFOUND, "", &e);
    if (fail == &e)
        sp_err_set(&e, SP_ENOTFOUND, "snapshot '%.64s' not found", cr->p[18]);
    else if (fail == NULL && strcmp(PQgetvalue(res, 0, 0), "creating") == 0)
        fail = (sp_err_set(&e, SP_ECONFLICT, "snapshot '%.64s' is still being taken; try again "
                           "when it is ready", cr->p[18]), &e);
    else if (fail == NULL && strcmp(PQgetvalue(res, 0, 0), "ready") != 0)
        fail = (sp_err_set(&e, SP_ECONFLICT, "snapshot '%.64s' failed: %.100s", cr->p[18],
                           PQgetvalue(res, 0, 1)), &e);
    else if (fail == NULL && PQgetvalue(res, 0, 4)[0] != 't' &&
             (strcmp(PQgetvalue(res, 0, 3), "lost") == 0 ||
              strcmp(PQgetvalue(res, 0, 3), "draining") == 0))
        /* its files are on that worker only (migration 20; 22: unless shared) */
        fail = (sp_err_set(&e, SP_EUNAVAIL,
                           "snapshot '%.64s' is held by worker %.64s, which is %s: sandboxes "
                           "are made from it only there",
                           cr->p[18], PQgetvalue(res, 0, 2), PQgetvalue(res, 0, 3)),
                &e);
    create_refused(cr, fail); /* NULL: nothing wrong with it now */
}

/* The template and tag a create by "name:tag" names were read: 404 naming which is missing,
 * else the statement's own answer. */
static void on_create_tag(void *rec, PGresult *res, const sp_err_t *err)
{
    sp_store_req_t *c = rec;
    struct create *cr = c->arg;
    sp_err_t e;
    const sp_err_t *fail = sp_store_one_row(res, err, SP_EINTERNAL, "no answer", &e);
    if (fail == NULL && PQgetvalue(res, 0, 0)[0] != 't')
        fail = (sp_err_set(&e, SP_ENOTFOUND, "template '%.64s' not found", cr->p[2]), &e);
    else if (fail == NULL && PQgetvalue(res, 0, 1)[0] != 't')
        fail = (sp_err_set(&e, SP_ENOTFOUND, "tag '%.64s' does not exist for template '%.64s'",
                           cr->p[19], cr->p[2]),
                &e);
    create_refused(cr, fail);
}

/* Why a create by snapshot or by "name:tag" made nothing: the snapshot or the tag is read
 * (on_create_snapshot, on_create_tag say which of 404, 409 or 503). -1 when it cannot be. */
static int create_why(struct create *cr, sp_err_t *err)
{
    if (cr->p[18] == NULL) {
        const char *p[] = {cr->p[2], cr->p[1], cr->p[19]};
        return submit(
            cr->svc,
            "SELECT EXISTS (SELECT 1 FROM templates WHERE name = $1 AND deleted_at IS NULL"
            "  AND (team_id IS NULL OR (team_id = $2 AND status = 'ready'))),"
            " EXISTS (SELECT 1 FROM templates m WHERE m.name = $1 AND ((m.team_id IS NULL"
            "  AND $3 = 'default') OR EXISTS (SELECT 1 FROM template_tags g"
            "  WHERE g.template = $1 AND g.tag = $3)))",
            3, p, on_create_tag, NULL, cr, 0, err);
    }
    const char *p[] = {cr->p[18], cr->p[1]};
    return submit(cr->svc,
                  "SELECT z.state, coalesce(z.error, ''), coalesce(z.worker_id, ''),"
                  " coalesce(w.state, ''), z.shared"
                  " FROM snapshots z LEFT JOIN workers w ON w.id = z.worker_id"
                  " WHERE z.id = $1 AND z.team_id = $2 AND z.deleted_at IS NULL",
                  2, p, on_create_snapshot, NULL, cr, 0, err);
}

/* A create by snapshot or "name:tag" was answered. Its statement checks the snapshot or tag
 * itself, so the usual create is one round trip; only when it made nothing (or, from a
 * snapshot, no worker could take it: its worker may be lost) are they read, to say why. */
static void on_create_checked(void *rec, PGresult *res, const sp_err_t *err)
{
    sp_store_req_t *c = rec;
    struct create *cr = c->arg;
    bool snap = cr->p[18] != NULL;
    bool none = err == NULL && res != NULL && PQntuples(res) == 0;
    if (!none && !(snap && err != NULL && err->code == SP_ECAPACITY)) {
        sp_store_req_t done = {cr->svc, (void *)cr->cb, cr->arg, c->flag};
        sandbox_done(&done, res, err);
        create_free(cr);
        return;
    }
    if (none)
        sp_err_set(&cr->made_none, SP_ENOTFOUND,
                   snap ? "snapshot not found" : "template not found");
    else
        cr->made_none = *err;
    sp_err_t e;
    if (create_why(cr, &e) < 0)
        create_refused(cr, NULL);
}

/* The rules' secrets were looked up: a missing one fails the create, else it goes on. */
static void on_rule_secrets(void *arg, const sp_err_t *err)
{
    struct create *cr = arg;
    sp_svc_sandbox_cb cb = cr->cb;
    void *cb_arg = cr->arg;
    sp_err_t e;
    if (err != NULL) {
        create_free(cr);
        cb(cb_arg, NULL, NULL, err);
    } else if (create_submit(cr, &e) < 0) {
        cb(cb_arg, NULL, NULL, &e);
    }
}

/* A create's credential rules: *out is their normal form (new reference), or NULL for none
 * (absent, null or []). Rules need the secrets module: SP_EUNAVAIL without it. */
static int create_rules(sp_svc_t *svc, const json_t *given, json_t **out, sp_err_t *err)
{
    *out = NULL;
    if (given == NULL || json_is_null(given))
        return 0;
    json_t *rules = sp_secrets_rules_normalize(given, err);
    if (rules == NULL)
        return -1;
    if (json_array_size(rules) == 0) {
        json_decref(rules);
        return 0;
    }
    if (svc->secrets == NULL || sp_secrets_check_enabled(svc->secrets, err) < 0) {
        json_decref(rules);
        if (svc->secrets == NULL)
            sp_err_set(err, SP_EUNAVAIL, "secrets are not available on this server");
        return -1;
    }
    *out = rules;
    return 0;
}

/* The fields other than the egress policy and the credential rules. */
static int create_check(const sp_create_req_t *req, const char *action, sp_err_t *err)
{
    bool tmpl = req->template_name != NULL && req->template_name[0] != '\0';
    bool snap = req->snapshot_id != NULL && req->snapshot_id[0] != '\0';
    if (tmpl && snap)
        return sp_err_set(err, SP_EINVAL, "give either a template or a snapshot, not both");
    if (snap && (req->cpu_count != 0 || req->memory_mb != 0))
        return sp_err_set(err, SP_EINVAL,
                          "cpu_count and memory_mb come from the snapshot; leave them out");
    if (snap && !sp_snap_valid_id(req->snapshot_id))
        return sp_err_set(err, SP_ENOTFOUND, "snapshot '%.64s' not found", req->snapshot_id);
    const char *colon = tmpl ? strchr(req->template_name, ':') : NULL;
    size_t nlen = tmpl ? (colon ? (size_t)(colon - req->template_name) : strlen(req->template_name))
                       : 0;
    if (!snap && (!tmpl || nlen == 0 || nlen > 64))
        return sp_err_set(err, SP_EINVAL, "template must be a name of 1 to 64 characters");
    if (!snap && colon != NULL && !sp_tmpl_valid_tag(colon + 1))
        return sp_err_set(err, SP_EINVAL,
                          "bad tag '%.64s': [a-z0-9._-], 1 to 64 characters, not a UUID", colon + 1);
    if (sp_svc_check_string_map(req->metadata, "metadata", err) < 0 ||
        sp_svc_check_string_map(req->env, "env", err) < 0)
        return -1;
    if (req->cpu_count < 0 || req->cpu_count > SP_SVC_MAX_CPUS)
        return sp_err_set(err, SP_EINVAL, "cpu_count must be 1 to %d", SP_SVC_MAX_CPUS);
    if (req->memory_mb != 0 &&
        (req->memory_mb < SP_SVC_MIN_MEMORY_MB || req->memory_mb > SP_SVC_MAX_MEMORY_MB))
        return sp_err_set(err, SP_EINVAL, "memory_mb must be %d to %d", SP_SVC_MIN_MEMORY_MB,
                          SP_SVC_MAX_MEMORY_MB);
    if (req->idle_timeout_s < 0 || req->idle_timeout_s > SP_SVC_MAX_TIMEOUT_S)
        return sp_err_set(err, SP_EINVAL, "idle_timeout_s must be 1 to %d",
                          SP_SVC_MAX_TIMEOUT_S);
    if (req->timeout_s < 0 || req->timeout_s > SP_SVC_MAX_TIMEOUT_S)
        return sp_err_set(err, SP_EINVAL, "timeout_s must be 1 to %d", SP_SVC_MAX_TIMEOUT_S);
    if (strcmp(action, "delete") != 0 && strcmp(action, "suspend") != 0)
        return sp_err_set(err, SP_EINVAL, "deadline_action must be delete or suspend");
    if (req->network != NULL && !json_is_object(req->network))
        return sp_err_set(err, SP_EINVAL, "network must be an object");
    if (req->envd_version != NULL && strlen(req->envd_version) > 31)
        return sp_err_set(err, SP_EINVAL, "envd_version is too long");
    if (req->placement_labels != NULL &&
        sp_fleet_check_labels(req->placement_labels, "placement.labels", err) < 0)
        return -1;
    return 0;
}

int sp_svc_create_sandbox(sp_svc_t *svc, const sp_auth_t *a, const sp_create_req_t *req,
                          sp_svc_sandbox_cb cb, void *arg, sp_err_t *err)
{
    /* The egress policy, then the credential rules, then the rest: a bad rule is named
     * before the other fields are looked at (the order the native API has always answered
     * in). */
    sp_egp_t *pol = NULL;
    if (req->egress != NULL && !json_is_null(req->egress) &&
        (pol = sp_egp_from_json(req->egress, "egress", err)) == NULL)
        return -1;
    json_t *rules = NULL;
    const char *action = req->deadline_action ? req->deadline_action : "delete";
    if (create_rules(svc, req->credentials, &rules, err) < 0 ||
        create_check(req, action, err) < 0) {
        sp_egp_free(pol);
        json_decref(rules);
        return -1;
    }
    struct create *cr = calloc(1, sizeof(*cr));
    if (cr == NULL) {
        sp_egp_free(pol);
        json_decref(rules);
        return sp_err_set(err, SP_EINTERNAL, "out of memory");
    }
    cr->svc = svc;
    cr->cb = cb;
    cr->arg = arg;
    char id[SP_ID_LEN + 1], opid[SP_OPID_LEN + 1], salt[SP_TOKENS_SALT_MAX],
        hash[SP_KEYHASH_HEX + 1];
    sp_ids_sandbox(id);
    sp_ids_operation(opid);
    sp_tokens_new(svc->tokens, id, salt, hash); /* the tokens are derived, never stored */
    create_param(cr, 0, id);
    create_param(cr, 1, a->team_id);
    bool snap = req->snapshot_id != NULL && req->snapshot_id[0] != '\0';
    if (!snap) { /* "name:tag": the name, and the tag apart (tmpl.h) */
        const char *colon = strchr(req->template_name, ':');
        char name[65];
        snprintf(name, sizeof name, "%.*s",
                 (int)(colon ? (size_t)(colon - req->template_name) : strlen(req->template_name)),
                 req->template_name);
        create_param(cr, 2, name);
        create_param(cr, 19, colon ? colon + 1 : NULL);
    }
    create_param(cr, 18, snap ? req->snapshot_id : NULL);
    create_json(cr, 3, req->metadata);
    create_json(cr, 4, req->env);
    for (int i = 3; i <= 4; i++) /* NULL maps are stored as {} */
        if (cr->p[i] == NULL)
            create_param(cr, i, "{}");
    create_int(cr, 5, req->idle_timeout_s ? req->idle_timeout_s : SP_SVC_DEFAULT_IDLE_S, false);
    create_int(cr, 6, req->timeout_s, true);
    create_param(cr, 7, action);
    create_int(cr, 8, req->cpu_count, true);
    create_int(cr, 9, req->memory_mb, true);
    create_param(cr, 10, salt);
    create_param(cr, 26, hash);
    create_param(cr, 11, opid);
    create_param(cr, 12, req->auto_resume ? "true" : "false");
    create_param(cr, 13, req->allow_internet > 0 ? "true" : req->allow_internet < 0 ? "false" : NULL);
    create_json(cr, 14, req->network);
    create_param(cr, 15, req->envd_version);
    create_json(cr, 16, rules);
    for (int i = 0; i < 3; i++)
        create_param(cr, 20 + i, svc->quota[i][0] ? svc->quota[i] : NULL);
    if (req->placement_labels != NULL && json_object_size(req->placement_labels) > 0)
        create_json(cr, 23, req->placement_labels);
    create_param(cr, 24, svc->place_fresh);
    create_param(cr, 25, svc->place_self[0] ? svc->place_self : NULL);
    if (pol != NULL) { /* the policy in normal form; NULL: derived from allow_internet */
        json_t *norm = sp_egp_to_json(pol);
        sp_egp_free(pol);
        if (norm == NULL)
            cr->oom = true;
        create_json(cr, 17, norm);
        json_decref(norm);
    }
    if (cr->oom) {
        create_free(cr);
        json_decref(rules);
        return sp_err_set(err, SP_EINTERNAL, "out of memory");
    }
    if (rules == NULL)
        return create_submit(cr, err);
    /* The secrets the rules name must exist: looked up first, then the statement is sent. */
    int rc = sp_secrets_check_rule_secrets(svc->secrets, a->team_id, rules, on_rule_secrets, cr,
                                           err);
    json_decref(rules);
    if (rc < 0)
        create_free(cr);
    return rc;
}

int sp_svc_get_sandbox(sp_svc_t *svc, const sp_auth_t *a, const char *id, sp_svc_sandbox_cb cb,
                       void *arg, sp_err_t *err)
{
    if (!sp_ids_valid(id))
        return sp_err_set(err, SP_ENOTFOUND, "sandbox not found");
    const char *p[] = {id, a->team_id};
    return submit(svc,
                  "SELECT " SANDBOX_COLS " FROM sandboxes s"
                  " WHERE s.id = $1 AND s.team_id = $2 AND s.observed_state <> 'deleted'",
                  2, p, sandbox_done, (void *)cb, arg, 0, err);
}

int sp_svc_sandbox_by_token(sp_svc_t *svc, const char *id, const char *token,
                            sp_svc_sandbox_cb cb, void *arg, sp_err_t *err)
{
    if (token == NULL && id == NULL)
        return sp_err_set(err, SP_EAUTH, "missing access token");
    if (token != NULL && (token[0] == '\0' || strlen(token) > 128))
        return sp_err_set(err, SP_EAUTH, "missing or invalid access token");
    if (id != NULL && !sp_ids_valid(id))
        return sp_err_set(err, SP_ENOTFOUND, "sandbox not found");
    /* The token is looked up by its keyed hash (tokens.h): the database never sees it. */
    char hash[SP_KEYHASH_HEX + 1];
    if (token != NULL)
        sp_tokens_hash(svc->tokens, token, hash);
    const char *p[] = {id, token ? hash : NULL};
    /* The token is the credential: the team comes from the row it opens. Deleted rows are
     * returned too (observed "deleted"), so a client can be told "gone" rather than "bad token". */
    return submit(svc,
                  "SELECT " SANDBOX_COLS " FROM sandboxes s"
                  " WHERE ($1::text IS NULL OR s.id = $1)"
                  " AND ($2::text IS NULL OR s.token_hash = $2)",
                  2, p, sandbox_done, (void *)cb, arg, 0, err);
}

static void list_done(void *rec, PGresult *res, const sp_err_t *err)
{
    sp_store_req_t *c = rec;
    sp_svc_list_cb cb = (sp_svc_list_cb)c->cb;
    sp_err_t e;
    const sp_err_t *fail;
    sp_sandbox_rec_t *recs = sp_store_rows(res, err, 0, NULL, sizeof(*recs), &fail, &e);
    if (recs == NULL) {
        cb(c->arg, NULL, 0, NULL, fail);
        return;
    }
    int n = PQntuples(res);
    int limit = c->flag;
    bool more = n > limit;
    if (more)
        n = limit;
    for (int i = 0; i < n; i++)
        parse_sandbox(c->owner, res, i, 0, &recs[i]);
    char cursor[128] = "";
    long long us;
    if (more && n > 0 && sp_store_time_us(res, n - 1, 5, &us) == 0)
        snprintf(cursor, sizeof(cursor), "%lld_%s", us, recs[n - 1].id);
    cb(c->arg, recs, (size_t)n, more ? cursor : NULL, NULL);
    for (int i = 0; i < n; i++) {
        json_decref(recs[i].metadata);
        json_decref(recs[i].network);
    }
    free(recs);
}

int sp_svc_list_sandboxes(sp_svc_t *svc, const sp_auth_t *a, const sp_list_req_t *req,
                          sp_svc_list_cb cb, void *arg, sp_err_t *err)
{
    if (req->limit < 1 || req->limit > 1000)
        return sp_err_set(err, SP_EINVAL, "limit must be 1 to 1000");
    char micros[24] = "", cid[65] = "";
    if (req->cursor != NULL && req->cursor[0] != '\0' &&
        sp_store_cursor_parse(req->cursor, sp_ids_valid, micros, cid, sizeof(cid)) < 0)
        return sp_err_set(err, SP_EINVAL, "invalid cursor");
    /* States as a text[] literal; names come from our own table, never from the client. */
    char states[256] = "{";
    for (int i = 0; i < SP_OBS__COUNT; i++) {
        bool want = req->states ? (req->states & (1u << i)) != 0 : i != SP_OBS_DELETED;
        if (want) {
            strcat(states, sp_observed_name((sp_observed_t)i));
            strcat(states, ",");
        }
    }
    size_t sl = strlen(states);
    if (states[sl - 1] == ',')
        states[sl - 1] = '}';
    else
        strcat(states, "}");
    char *md = req->metadata ? json_dumps(req->metadata, JSON_COMPACT) : NULL;
    char lim[16];
    snprintf(lim, sizeof(lim), "%d", req->limit + 1);
    /* The statement says only what this list asks: a condition "($n IS NULL OR ...)" costs
     * PostgreSQL its setup on every run and a test per row even when the parameter is NULL.
     * At most 8 texts, each prepared once per connection. Without deleted sandboxes (nearly
     * every list) it says so in so many words: the planner takes the partial index of live
     * ones (sandboxes_team_live) only on a condition it can see implies the index's. */
    const char *p[6] = {a->team_id, states};
    int np = 2;
    sp_buf_t sql = SP_BUF_INIT;
    sp_buf_str(&sql, "SELECT " SANDBOX_COLS " FROM sandboxes s WHERE s.team_id = $1");
    if ((req->states & (1u << SP_OBS_DELETED)) == 0)
        sp_buf_str(&sql, " AND s.observed_state <> 'deleted'");
    sp_buf_str(&sql, " AND s.observed_state = ANY($2::text[])");
    if (md != NULL) {
        p[np++] = md;
        sp_buf_printf(&sql, " AND s.metadata @> $%d::jsonb", np);
    }
    if (micros[0] != '\0') {
        p[np++] = micros;
        p[np++] = cid;
        sp_buf_printf(&sql,
                      " AND ((extract(epoch FROM s.created_at) * 1000000)::bigint, s.id)"
                      " < ($%d::bigint, $%d)",
                      np - 1, np);
    }
    p[np++] = lim;
    sp_buf_printf(&sql, " ORDER BY s.created_at DESC, s.id DESC LIMIT $%d::int", np);
    int rc = sql.oom ? sp_err_set(err, SP_EINTERNAL, "out of memory")
                     : submit(svc, sp_buf_cstr(&sql), np, p, list_done, (void *)cb, arg, req->limit,
                              err);
    sp_buf_free(&sql);
    free(md);
    return rc;
}

json_t *sp_svc_metadata_filter(const char *query, sp_err_t *err)
{
    json_t *o = json_object();
    if (query == NULL || query[0] == '\0')
        return o;
    if (strlen(query) > 8192) {
        json_decref(o);
        sp_err_set(err, SP_EINVAL, "metadata filter too long");
        return NULL;
    }
    char *dup = strdup(query);
    char *save = NULL;
    for (char *pair = strtok_r(dup, "&", &save); pair != NULL; pair = strtok_r(NULL, "&", &save)) {
        char *eq = strchr(pair, '=');
        if (eq == NULL || eq == pair) {
            free(dup);
            json_decref(o);
            sp_err_set(err, SP_EINVAL, "metadata filter must be key=value pairs");
            return NULL;
        }
        *eq = '\0';
        json_object_set_new(o, pair, json_string(eq + 1));
    }
    free(dup);
    return o;
}

/* ---- lifecycle requests ---- */

/* The deadline change of an sp_deadline_t, given the parameters holding its mode (M),
 * seconds (S) and action or NULL (A). */
#define DEADLINE_SQL(M, S, A)                                                                      \
    "deadline_at = CASE " M "::int WHEN 1 THEN NULL"                                               \
    "  WHEN 2 THEN now() + make_interval(secs => " S "::int)"                                      \
    "  WHEN 3 THEN CASE WHEN deadline_at IS NULL THEN NULL"                                        \
    "    ELSE greatest(deadline_at, now() + make_interval(secs => " S "::int)) END"                \
    "  ELSE deadline_at END,"                                                                      \
    " deadline_s = CASE " M "::int WHEN 2 THEN " S "::int ELSE deadline_s END,"                    \
    " deadline_action = coalesce(" A "::text, deadline_action)"
#define DEADLINE_SET DEADLINE_SQL("$7", "$8", "$9")

struct req_ctx {
    sp_svc_t *svc;
    sp_auth_t auth;
    char id[65];
    sp_request_t req;
    sp_deadline_t dl; /* KEEP for plain requests */
    char dl_action[16];
    sp_svc_op_cb cb;
    void *arg;
    int tries;
};

static void req_read(struct req_ctx *rc);

static void req_fail(struct req_ctx *rc, const sp_err_t *err)
{
    rc->cb(rc->arg, NULL, err);
    free(rc);
}

static void req_written(void *rec, PGresult *res, const sp_err_t *err)
{
    sp_store_req_t *c = rec;
    struct req_ctx *rc = c->arg;
    if (err != NULL) {
        req_fail(rc, err);
        return;
    }
    if (PQntuples(res) != 1) {
        /* The desired state changed between our read and write: read again. */
        if (++rc->tries < 5) {
            req_read(rc);
            return;
        }
        sp_err_t e;
        sp_err_set(&e, SP_ECONFLICT, "sandbox is changing; try again");
        req_fail(rc, &e);
        return;
    }
    sp_op_rec_t op;
    sp_svc_parse_op(res, 0, 0, &op);
    rc->cb(rc->arg, &op, NULL);
    free(rc);
}

static void req_got_state(void *rec, PGresult *res, const sp_err_t *err)
{
    sp_store_req_t *c = rec;
    struct req_ctx *rc = c->arg;
    sp_err_t e;
    sp_desired_t d, nd;
    sp_observed_t o;
    const sp_err_t *fail = sp_store_one_row(res, err, SP_ENOTFOUND, "sandbox not found", &e);
    if (fail != NULL) {
        req_fail(rc, fail);
        return;
    }
    if (sp_desired_parse(PQgetvalue(res, 0, 0), &d) < 0 ||
        sp_observed_parse(PQgetvalue(res, 0, 1), &o) < 0) {
        sp_log(SP_LOG_ERROR, "svc", "corrupt state sandbox=%s", rc->id);
        sp_err_set(&e, SP_EINTERNAL, "sandbox record is corrupt");
        req_fail(rc, &e);
        return;
    }
    if (sp_sandbox_request(d, o, rc->req, &nd, &e) < 0) {
        req_fail(rc, &e);
        return;
    }
    char opid[SP_OPID_LEN + 1];
    sp_ids_operation(opid);
    char mode[8], secs[16];
    snprintf(mode, sizeof(mode), "%d", (int)rc->dl.mode);
    snprintf(secs, sizeof(secs), "%d", rc->dl.secs);
    const sp_svc_t *svc = rc->svc;
    const char *p[] = {rc->id, rc->auth.team_id, sp_desired_name(nd), sp_desired_name(d), opid,
                       sp_request_name(rc->req), mode, secs,
                       rc->dl_action[0] ? rc->dl_action : NULL,
                       svc->quota[0][0] ? svc->quota[0] : NULL,
                       svc->quota[1][0] ? svc->quota[1] : NULL,
                       svc->quota[2][0] ? svc->quota[2] : NULL,
                       svc->place_fresh,
                       svc->place_self[0] ? svc->place_self : NULL,
                       svc->quota[3][0] ? svc->quota[3] : NULL};
    if (submit(
            rc->svc,
            /* a wake of a suspended sandbox is placed again (core/control/fleet.h), its own
             * worker first: one that is lost or full gives way to another */
            "WITH p AS (SELECT pl.wid, pl.wgen FROM sandboxes x CROSS JOIN LATERAL space_place("
            "   x.cpu_count, x.memory_mb, x.placement, x.template"
            "   || coalesce('@' || x.template_version, ''), $13::int, $14, x.worker_id) pl"
            "  WHERE x.id = $1 AND x.team_id = $2 AND $4 = 'suspended' AND $3 = 'running'"
            "   AND x.desired_state = $4 AND x.observed_state = 'suspended'),"
            " s AS (UPDATE sandboxes SET desired_state = $3, updated_at = now(),"
            "   last_activity_at = CASE WHEN $3 = 'running' THEN now() ELSE last_activity_at END,"
            "   moved_from = CASE WHEN (SELECT wid FROM p) IS DISTINCT FROM worker_id"
            "    AND EXISTS (SELECT 1 FROM p) THEN worker_id ELSE moved_from END,"
            "   worker_id = coalesce((SELECT wid FROM p), worker_id),"
            "   worker_generation = coalesce((SELECT wgen FROM p), worker_generation),"
            "   moving = CASE WHEN EXISTS (SELECT 1 FROM p) THEN NULL ELSE moving END,"
            "   " DEADLINE_SET
            "  WHERE id = $1 AND team_id = $2 AND desired_state = $4"
            /* a suspended sandbox made running again holds its share anew (svc.h) */
            "  AND ($4 <> 'suspended' OR $3 <> 'running' OR space_team_quota($2, cpu_count,"
            "   memory_mb, $10::int, $11::int, $12::int))"
            /* a client's suspend writes a snapshot: refused once the team's hold the limit */
            "  AND ($3 <> 'suspended' OR $4 = 'suspended' OR space_team_disk_quota($2,"
            "   $15::bigint))"
            "  RETURNING id, team_id, worker_id),"
            " o AS (INSERT INTO operations (id, sandbox_id, team_id, kind, target)"
            "  SELECT $5, s.id, s.team_id, $6, $3 FROM s RETURNING *),"
            " ev AS (INSERT INTO events (sandbox_id, kind, detail)"
            "  SELECT s.id, 'requested', $6 FROM s RETURNING 1),"
            " n AS (SELECT " SP_RECON_NOTIFY("s") " FROM s)"
            " SELECT " SP_SVC_OP_COLS " FROM o, n, ev",
            15, p, req_written, NULL, rc, 0, &e) < 0)
        req_fail(rc, &e);
}

static void req_read(struct req_ctx *rc)
{
    sp_err_t e;
    const char *p[] = {rc->id, rc->auth.team_id};
    if (submit(rc->svc,
               "SELECT desired_state, observed_state FROM sandboxes"
               " WHERE id = $1 AND team_id = $2 AND observed_state <> 'deleted'",
               2, p, req_got_state, NULL, rc, 0, &e) < 0)
        req_fail(rc, &e); /* only reached on a retry, from a callback: calling back is allowed */
}

int sp_svc_request(sp_svc_t *svc, const sp_auth_t *a, const char *id, sp_request_t req,
                   sp_svc_op_cb cb, void *arg, sp_err_t *err)
{
    return sp_svc_request_deadline(svc, a, id, req, NULL, cb, arg, err);
}

static int check_deadline(const sp_deadline_t *dl, sp_err_t *err)
{
    if ((unsigned)dl->mode > SP_DEADLINE_EXTEND)
        return sp_err_set(err, SP_EINVAL, "unknown deadline mode");
    if (dl->secs < 0 || dl->secs > SP_SVC_MAX_TIMEOUT_S)
        return sp_err_set(err, SP_EINVAL, "timeout must be 0 to %d seconds", SP_SVC_MAX_TIMEOUT_S);
    if (dl->action != NULL && strcmp(dl->action, "delete") != 0 &&
        strcmp(dl->action, "suspend") != 0)
        return sp_err_set(err, SP_EINVAL, "deadline_action must be delete or suspend");
    return 0;
}

int sp_svc_request_deadline(sp_svc_t *svc, const sp_auth_t *a, const char *id, sp_request_t req,
                            const sp_deadline_t *dl, sp_svc_op_cb cb, void *arg, sp_err_t *err)
{
    if (!sp_ids_valid(id))
        return sp_err_set(err, SP_ENOTFOUND, "sandbox not found");
    if ((unsigned)req >= SP_REQ__COUNT)
        return sp_err_set(err, SP_EINVAL, "unknown request");
    if (dl != NULL && check_deadline(dl, err) < 0)
        return -1;
    struct req_ctx *rc = calloc(1, sizeof(*rc));
    if (rc == NULL)
        return sp_err_set(err, SP_EINTERNAL, "out of memory");
    rc->svc = svc;
    rc->auth = *a;
    snprintf(rc->id, sizeof(rc->id), "%s", id);
    rc->req = req;
    if (dl != NULL) {
        rc->dl = *dl;
        snprintf(rc->dl_action, sizeof(rc->dl_action), "%s", dl->action ? dl->action : "");
        rc->dl.action = NULL; /* the copy in dl_action is what is used */
    }
    rc->cb = cb;
    rc->arg = arg;
    const char *p[] = {rc->id, rc->auth.team_id};
    if (submit(svc,
               "SELECT desired_state, observed_state FROM sandboxes"
               " WHERE id = $1 AND team_id = $2 AND observed_state <> 'deleted'",
               2, p, req_got_state, NULL, rc, 0, err) < 0) {
        free(rc);
        return -1;
    }
    return 0;
}

/* ---- operations and waits ---- */

static void waiter_unlink(struct waiter *w)
{
    if (w->prev)
        w->prev->next = w->next;
    else
        w->svc->waiters = w->next;
    if (w->next)
        w->next->prev = w->prev;
    sp_timer_stop(&w->timer);
}

static void waiter_check(struct waiter *w);

static void waiter_checked(void *rec, PGresult *res, const sp_err_t *err)
{
    sp_store_req_t *c = rec;
    struct waiter *w = c->arg;
    w->checking = false;
    bool again = w->recheck;
    w->recheck = false;
    sp_op_rec_t op;
    bool have = err == NULL && PQntuples(res) == 1;
    if (have)
        sp_svc_parse_op(res, 0, 0, &op);
    if (err != NULL || !have || op_finished(&op) || w->expired) {
        sp_err_t e;
        if (err == NULL && !have)
            sp_err_set(&e, SP_ENOTFOUND, "operation not found");
        waiter_unlink(w);
        w->cb(w->arg, have ? &op : NULL, err ? err : have ? NULL : &e);
        free(w);
        return;
    }
    if (again)
        waiter_check(w); /* the notification may have been for a state this answer missed */
}

/* Reads the waiter's operation once; waiter_checked gets the answer. */
static int waiter_query(struct waiter *w, sp_err_t *err)
{
    const char *p[] = {w->op_id, w->team_id};
    if (submit(w->svc,
               "SELECT " SP_SVC_OP_COLS " FROM operations o WHERE o.id = $1 AND o.team_id = $2", 2,
               p, waiter_checked, NULL, w, 0, err) < 0)
        return -1;
    w->checking = true;
    return 0;
}

static void waiter_check(struct waiter *w)
{
    if (w->checking) {
        w->recheck = true;
        return;
    }
    sp_err_t e;
    if (waiter_query(w, &e) < 0) {
        waiter_unlink(w);
        w->cb(w->arg, NULL, &e);
        free(w);
    }
}

static void on_waiter_timer(sp_timer_t *t, void *arg)
{
    struct waiter *w = arg;
    w->expired = true;
    waiter_check(w);
}

static void on_ops_notify(void *arg, const char *channel, const char *payload)
{
    sp_svc_t *svc = arg;
    struct waiter *w = svc->waiters, *next;
    for (; w != NULL; w = next) {
        next = w->next; /* waiter_check can finish and free w only from a later callback */
        if (payload == NULL || strcmp(payload, w->op_id) == 0)
            waiter_check(w);
    }
}

int sp_svc_get_operation(sp_svc_t *svc, const sp_auth_t *a, const char *op_id, uint32_t wait_ms,
                         sp_svc_op_cb cb, void *arg, sp_err_t *err)
{
    if (!sp_ids_valid(op_id))
        return sp_err_set(err, SP_ENOTFOUND, "operation not found");
    if (wait_ms > SP_SVC_MAX_WAIT_MS)
        wait_ms = SP_SVC_MAX_WAIT_MS;
    struct waiter *w = calloc(1, sizeof(*w));
    if (w == NULL)
        return sp_err_set(err, SP_EINTERNAL, "out of memory");
    w->svc = svc;
    snprintf(w->team_id, sizeof(w->team_id), "%s", a->team_id);
    snprintf(w->op_id, sizeof(w->op_id), "%s", op_id);
    w->cb = cb;
    w->arg = arg;
    w->expired = wait_ms == 0;
    sp_timer_init(&w->timer, svc->loop, on_waiter_timer, w);
    /* Link first so a NOTIFY racing the first check is not missed. */
    w->next = svc->waiters;
    if (w->next)
        w->next->prev = w;
    svc->waiters = w;
    if (wait_ms > 0)
        sp_timer_start(&w->timer, wait_ms);
    if (waiter_query(w, err) < 0) {
        waiter_unlink(w);
        free(w);
        return -1;
    }
    return 0;
}

/* ---- the data plane ---- */

void sp_svc_set_driver(sp_svc_t *svc, sp_driver_t *driver)
{
    svc->driver = driver;
    sp_sampler_destroy(svc->sampler);
    svc->sampler = driver != NULL ? sp_sampler_create(svc->loop, svc->store, driver) : NULL;
}

sp_loop_t *sp_svc_loop(sp_svc_t *svc)
{
    return svc->loop;
}

void sp_svc_set_secrets(sp_svc_t *svc, struct sp_secrets *secrets)
{
    svc->secrets = secrets;
}

struct sp_secrets *sp_svc_secrets(sp_svc_t *svc)
{
    return svc->secrets;
}

static void touched(void *rec, PGresult *res, const sp_err_t *err)
{
    (void)rec;
    if (err != NULL) /* activity is best effort: the idle timer may fire a little early */
        sp_log(SP_LOG_WARN, "svc", "last_activity_at update failed err=%s", err->msg);
}

/* A running sandbox whose channel is not up yet (spaced just restarted and is re-adopting the
 * VM, or the agent is reconnecting) is waited for, up to AGENT_WAIT_MS, instead of failing. */
#define AGENT_WAIT_MS 15000

struct agent_wait {
    sp_svc_agent_cb cb;
    void *arg;
    sp_agentconn_t *conn;
};

static void agent_up(void *p, const sp_err_t *err)
{
    struct agent_wait *w = p;
    if (err != NULL) {
        sp_err_t e;
        sp_err_set(&e, SP_EUNAVAIL, "sandbox agent did not answer");
        w->cb(w->arg, NULL, &e);
    } else {
        w->cb(w->arg, w->conn, NULL);
    }
    free(w);
}

static void agent_done(void *rec, PGresult *res, const sp_err_t *err)
{
    sp_store_req_t *c = rec;
    sp_svc_agent_cb cb = (sp_svc_agent_cb)c->cb;
    sp_err_t e;
    const sp_err_t *fail = sp_store_one_row(res, err, SP_ENOTFOUND, "sandbox not found", &e);
    if (fail != NULL) {
        cb(c->arg, NULL, fail);
        return;
    }
    const char *id = PQgetvalue(res, 0, 0);
    const char *obs = PQgetvalue(res, 0, 1);
    if (strcmp(obs, "running") != 0) {
        if (strcmp(obs, "paused") == 0 || strcmp(obs, "suspended") == 0)
            sp_err_set(&e, SP_ECONFLICT, "sandbox is %s; wake it first", obs);
        else
            sp_err_set(&e, SP_ECONFLICT, "sandbox is %s, not running", obs);
        cb(c->arg, NULL, &e);
        return;
    }
    sp_agentconn_t *conn = NULL;
    sp_svc_t *svc = c->owner;
    if (svc->driver == NULL) { /* an API node (core/control/fleet.h): the VM is a worker's */
        sp_err_set(&e, SP_EUNAVAIL, "sandbox runs on worker %.64s; this node does not forward "
                   "yet", PQgetvalue(res, 0, 2));
        cb(c->arg, NULL, &e);
        return;
    }
    if (svc->driver->ops->agent != NULL)
        conn = svc->driver->ops->agent(svc->driver, id);
    if (conn == NULL) {
        sp_err_set(&e, SP_EUNAVAIL, "sandbox VM is not reachable");
        cb(c->arg, NULL, &e);
        return;
    }
    /* Fire and forget: the reply does not wait for this write. At most one per second per
     * sandbox actually changes the row. */
    const char *p[] = {id};
    if (submit(c->owner,
               "UPDATE sandboxes SET last_activity_at = now() WHERE id = $1"
               " AND last_activity_at < now() - interval '1 second'",
               1, p, touched, NULL, NULL, 0, &e) < 0)
        sp_log(SP_LOG_WARN, "svc", "last_activity_at update not sent err=%s", e.msg);
    if (!sp_agentconn_up(conn)) {
        struct agent_wait *w = malloc(sizeof(*w));
        if (w != NULL) {
            w->cb = cb;
            w->arg = c->arg;
            w->conn = conn;
            if (sp_agentconn_when_up(conn, AGENT_WAIT_MS, agent_up, w) == 0)
                return;
            free(w);
        }
    }
    cb(c->arg, conn, NULL);
}

int sp_svc_sandbox_agent(sp_svc_t *svc, const sp_auth_t *a, const char *id, sp_svc_agent_cb cb,
                         void *arg, sp_err_t *err)
{
    if (!sp_ids_valid(id))
        return sp_err_set(err, SP_ENOTFOUND, "sandbox not found");
    const char *p[] = {id, a->team_id};
    return submit(svc,
                  "SELECT s.id, s.observed_state, coalesce(s.worker_id, '') FROM sandboxes s"
                  " WHERE s.id = $1 AND s.team_id = $2 AND s.observed_state <> 'deleted'",
                  2, p, agent_done, (void *)cb, arg, 0, err);
}

/* ---- where a sandbox is ---- */

bool sp_svc_sandbox_here(sp_svc_t *svc, const char *id)
{
    return sp_ids_valid(id) && svc->driver != NULL && svc->driver->ops->agent != NULL &&
           svc->driver->ops->agent(svc->driver, id) != NULL;
}

#define WHERE_SQL                                                                                  \
    "SELECT coalesce(s.worker_id, ''), coalesce(w.address, ''), coalesce(w.state, ''), s.id"       \
    " FROM sandboxes s LEFT JOIN workers w ON w.id = s.worker_id"

static void where_row(const PGresult *res, int row, sp_where_t *w)
{
    memset(w, 0, sizeof(*w));
    w->found = true;
    snprintf(w->worker_id, sizeof(w->worker_id), "%s", PQgetvalue(res, row, 0));
    snprintf(w->address, sizeof(w->address), "%s", PQgetvalue(res, row, 1));
    snprintf(w->worker_state, sizeof(w->worker_state), "%s", PQgetvalue(res, row, 2));
    snprintf(w->sandbox_id, sizeof(w->sandbox_id), "%s", PQgetvalue(res, row, 3));
}

static void where_done(void *rec, PGresult *res, const sp_err_t *err)
{
    sp_store_req_t *c = rec;
    sp_svc_where_cb cb = (sp_svc_where_cb)c->cb;
    sp_where_t w;
    memset(&w, 0, sizeof(w));
    if (err != NULL) {
        cb(c->arg, NULL, err);
        return;
    }
    if (PQntuples(res) == 1)
        where_row(res, 0, &w);
    cb(c->arg, &w, NULL);
}

int sp_svc_sandbox_where(sp_svc_t *svc, const char *id, sp_svc_where_cb cb, void *arg,
                         sp_err_t *err)
{
    if (!sp_ids_valid(id))
        return sp_err_set(err, SP_ENOTFOUND, "sandbox not found");
    const char *p[] = {id};
    return submit(svc, WHERE_SQL " WHERE s.id = $1", 1, p, where_done, (void *)cb, arg, 0, err);
}

static void where_many_done(void *rec, PGresult *res, const sp_err_t *err)
{
    sp_store_req_t *c = rec;
    sp_svc_where_many_cb cb = (sp_svc_where_many_cb)c->cb;
    if (err != NULL) {
        cb(c->arg, NULL, 0, err);
        return;
    }
    int rows = PQntuples(res);
    sp_where_t *w = rows > 0 ? calloc((size_t)rows, sizeof(*w)) : NULL;
    if (rows > 0 && w == NULL) {
        sp_err_t e;
        sp_err_set(&e, SP_EINTERNAL, "out of memory");
        cb(c->arg, NULL, 0, &e);
        return;
    }
    for (int i = 0; i < rows; i++)
        where_row(res, i, &w[i]);
    cb(c->arg, w, (size_t)rows, NULL);
    free(w);
}

int sp_svc_sandboxes_where(sp_svc_t *svc, const char *const *ids, size_t n, sp_svc_where_many_cb cb,
                           void *arg, sp_err_t *err)
{
    if (n > SP_SVC_WHERE_MAX)
        return sp_err_set(err, SP_EINVAL, "at most %d sandboxes at once", SP_SVC_WHERE_MAX);
    /* One text[] parameter: "{id,id}" (valid ids are [a-z0-9], nothing to quote). */
    sp_buf_t arr = SP_BUF_INIT;
    sp_buf_str(&arr, "{");
    for (size_t i = 0; i < n; i++) {
        if (!sp_ids_valid(ids[i]))
            continue;
        if (arr.len > 1)
            sp_buf_str(&arr, ",");
        sp_buf_str(&arr, ids[i]);
    }
    sp_buf_str(&arr, "}");
    sp_buf_add(&arr, "", 1);
    if (arr.oom) {
        sp_buf_free(&arr);
        return sp_err_set(err, SP_EINTERNAL, "out of memory");
    }
    const char *p[] = {(const char *)arr.p};
    int rc = submit(svc, WHERE_SQL " WHERE s.id = ANY($1::text[])", 1, p, where_many_done,
                    (void *)cb, arg, 0, err);
    sp_buf_free(&arr);
    return rc;
}

/* ---- health ---- */

static void health_done(void *rec, PGresult *res, const sp_err_t *err)
{
    sp_store_req_t *c = rec;
    ((sp_svc_done_cb)c->cb)(c->arg, err);
}

int sp_svc_health(sp_svc_t *svc, sp_svc_done_cb cb, void *arg, sp_err_t *err)
{
    return submit(svc, "SELECT 1", 0, NULL, health_done, (void *)cb, arg, 0, err);
}

/* ---- lifetime ---- */

sp_svc_t *sp_svc_create(sp_loop_t *loop, sp_store_t *store,
                        const unsigned char hashkey[SP_HASHKEY_LEN], sp_err_t *err)
{
    sp_svc_t *svc = calloc(1, sizeof(*svc));
    if (svc == NULL) {
        sp_err_set(err, SP_EINTERNAL, "out of memory");
        return NULL;
    }
    svc->loop = loop;
    svc->store = store;
    memcpy(svc->hashkey, hashkey, SP_HASHKEY_LEN);
    svc->tokens = sp_tokens_create(hashkey, NULL);
    if (svc->tokens == NULL) {
        free(svc);
        sp_err_set(err, SP_EINTERNAL, "out of memory");
        return NULL;
    }
    sp_quota_t q = {SP_SVC_QUOTA_SANDBOXES, SP_SVC_QUOTA_VCPUS, SP_SVC_QUOTA_MEMORY_MB,
                    SP_SVC_QUOTA_SNAPSHOT_MB};
    sp_svc_set_quota_defaults(svc, &q);
    sp_svc_set_placement(svc, NULL, 10);
    if (sp_store_listen(store, "space_ops", on_ops_notify, svc, err) < 0 ||
        sp_store_listen(store, "space_keys", auth_cache_clear, svc, err) < 0) {
        sp_tokens_destroy(svc->tokens);
        free(svc);
        return NULL;
    }
    return svc;
}

int sp_svc_set_token_master(sp_svc_t *svc, const unsigned char *master, sp_err_t *err)
{
    sp_tokens_t *t = sp_tokens_create(svc->hashkey, master);
    if (t == NULL)
        return sp_err_set(err, SP_EINTERNAL, "out of memory");
    sp_tokens_destroy(svc->tokens);
    svc->tokens = t;
    return 0;
}

void sp_svc_set_placement(sp_svc_t *svc, const char *self, int heartbeat_timeout_s)
{
    snprintf(svc->place_self, sizeof(svc->place_self), "%s", self ? self : "");
    snprintf(svc->place_fresh, sizeof(svc->place_fresh), "%d", heartbeat_timeout_s);
}

void sp_svc_set_quota_defaults(sp_svc_t *svc, const sp_quota_t *q)
{
    int v[4] = {q->sandboxes, q->vcpus, q->memory_mb, q->snapshot_mb};
    for (int i = 0; i < 4; i++) {
        if (v[i] > 0)
            snprintf(svc->quota[i], sizeof(svc->quota[i]), "%d", v[i]);
        else
            svc->quota[i][0] = '\0';
    }
}

void sp_svc_destroy(sp_svc_t *svc)
{
    if (svc == NULL)
        return;
    while (svc->waiters != NULL) {
        struct waiter *w = svc->waiters;
        waiter_unlink(w);
        sp_err_t e;
        sp_err_set(&e, SP_EUNAVAIL, "shutting down");
        if (!w->checking) {
            w->cb(w->arg, NULL, &e);
            free(w);
        }
        /* A waiter with a check in flight is answered and freed by the store's shutdown. */
    }
    sp_sampler_destroy(svc->sampler);
    sp_tokens_destroy(svc->tokens);
    sodium_memzero(svc->hashkey, sizeof(svc->hashkey));
    free(svc);
}

/* ---- deadlines ---- */

int sp_svc_set_deadline(sp_svc_t *svc, const sp_auth_t *a, const char *id,
                        const sp_deadline_t *dl, sp_svc_sandbox_cb cb, void *arg, sp_err_t *err)
{
    if (!sp_ids_valid(id))
        return sp_err_set(err, SP_ENOTFOUND, "sandbox not found");
    if (check_deadline(dl, err) < 0)
        return -1;
    char mode[8], secs[16];
    snprintf(mode, sizeof(mode), "%d", (int)dl->mode);
    snprintf(secs, sizeof(secs), "%d", dl->secs);
    const char *p[] = {id, a->team_id, mode, secs, dl->action};
    /* Asleep (suspended, or on its way there) has no running deadline to change. */
    return submit(svc,
                  "WITH s AS (UPDATE sandboxes SET " DEADLINE_SQL("$3", "$4", "$5") ","
                  "   updated_at = now()"
                  "  WHERE id = $1 AND team_id = $2 AND desired_state IN ('running', 'paused')"
                  "   AND observed_state NOT IN ('deleted', 'failed', 'stopping', 'suspending',"
                  "    'suspended')"
                  "  RETURNING *)"
                  " SELECT " SANDBOX_COLS " FROM s",
                  5, p, sandbox_done, (void *)cb, arg, 0, err);
}

/* ---- automatic wake (E2B autoResume) ---- */

#define WAKE_POLL_MS 100

struct wake_ctx {
    sp_svc_t *svc;
    sp_auth_t auth;
    char id[65];
    uint64_t until_ms; /* give up waiting at this loop time */
    sp_svc_done_cb cb;
    void *arg;
    sp_timer_t poll;
};

static void wake_finish(struct wake_ctx *w, const sp_err_t *err)
{
    sp_timer_stop(&w->poll);
    w->cb(w->arg, err);
    free(w);
}

static void wake_got(void *arg, const sp_sandbox_rec_t *sb, const sp_op_rec_t *op,
                     const sp_err_t *err);

static void on_wake_poll(sp_timer_t *t, void *arg)
{
    struct wake_ctx *w = arg;
    sp_err_t e;
    if (sp_svc_get_sandbox(w->svc, &w->auth, w->id, wake_got, w, &e) < 0)
        wake_finish(w, &e);
}

/* Someone else's start or wake is under way: look again shortly, until the time is up. */
static void wake_poll_later(struct wake_ctx *w)
{
    if (sp_loop_now_ms(w->svc->loop) >= w->until_ms) {
        sp_err_t e;
        sp_err_set(&e, SP_EUNAVAIL, "sandbox is still waking; try again");
        wake_finish(w, &e);
        return;
    }
    sp_timer_start(&w->poll, WAKE_POLL_MS);
}

static void wake_op_done(void *arg, const sp_op_rec_t *op, const sp_err_t *err)
{
    struct wake_ctx *w = arg;
    sp_err_t e;
    if (err != NULL) {
        wake_finish(w, err);
    } else if (strcmp(op->status, "succeeded") == 0) {
        wake_finish(w, NULL);
    } else if (strcmp(op->status, "failed") == 0) {
        sp_err_set(&e, SP_EUNAVAIL, "waking the sandbox failed: %.100s", op->error_message);
        wake_finish(w, &e);
    } else {
        sp_err_set(&e, SP_EUNAVAIL, "sandbox is still waking; try again");
        wake_finish(w, &e);
    }
}

static void wake_requested(void *arg, const sp_op_rec_t *op, const sp_err_t *err)
{
    struct wake_ctx *w = arg;
    if (err != NULL) {
        if (err->code == SP_ECONFLICT) /* a concurrent request changed it: look again */
            wake_poll_later(w);
        else
            wake_finish(w, err);
        return;
    }
    uint64_t now = sp_loop_now_ms(w->svc->loop);
    uint32_t left = w->until_ms > now ? (uint32_t)(w->until_ms - now) : 1;
    sp_err_t e;
    if (sp_svc_get_operation(w->svc, &w->auth, op->id, left, wake_op_done, w, &e) < 0)
        wake_finish(w, &e);
}

static void wake_got(void *arg, const sp_sandbox_rec_t *sb, const sp_op_rec_t *op,
                     const sp_err_t *err)
{
    struct wake_ctx *w = arg;
    sp_err_t e;
    if (err != NULL) {
        wake_finish(w, err);
        return;
    }
    sp_desired_t d;
    sp_observed_t o;
    if (sp_desired_parse(sb->desired, &d) < 0 || sp_observed_parse(sb->observed, &o) < 0) {
        wake_finish(w, (sp_err_set(&e, SP_EINTERNAL, "sandbox record is corrupt"), &e));
        return;
    }
    if (d == SP_DESIRED_DELETED || o == SP_OBS_STOPPING) {
        wake_finish(w, (sp_err_set(&e, SP_ENOTFOUND, "sandbox not found"), &e));
        return;
    }
    if (o == SP_OBS_FAILED) {
        wake_finish(w, (sp_err_set(&e, SP_ECONFLICT, "sandbox has failed"), &e));
        return;
    }
    if (d == SP_DESIRED_RUNNING) {
        if (o == SP_OBS_RUNNING)
            wake_finish(w, NULL);
        else
            wake_poll_later(w);
        return;
    }
    if (!sb->auto_resume) {
        wake_finish(w, (sp_err_set(&e, SP_ECONFLICT, "sandbox is paused"), &e));
        return;
    }
    sp_deadline_t dl = {.mode = sb->deadline_s > 0 ? SP_DEADLINE_SET : SP_DEADLINE_KEEP,
                        .secs = sb->deadline_s > 0 ? sb->deadline_s : 0};
    sp_log(SP_LOG_INFO, "svc", "auto-resume sandbox=%s", sb->id);
    if (sp_svc_request_deadline(w->svc, &w->auth, w->id, SP_REQ_WAKE, &dl, wake_requested, w,
                                &e) < 0)
        wake_finish(w, &e);
}

int sp_svc_wake_if_autoresume(sp_svc_t *svc, const sp_auth_t *a, const char *id,
                              uint32_t wait_ms, sp_svc_done_cb cb, void *arg, sp_err_t *err)
{
    if (!sp_ids_valid(id))
        return sp_err_set(err, SP_ENOTFOUND, "sandbox not found");
    if (wait_ms > SP_SVC_MAX_WAIT_MS)
        wait_ms = SP_SVC_MAX_WAIT_MS;
    struct wake_ctx *w = calloc(1, sizeof(*w));
    if (w == NULL)
        return sp_err_set(err, SP_EINTERNAL, "out of memory");
    w->svc = svc;
    w->auth = *a;
    snprintf(w->id, sizeof(w->id), "%s", id);
    w->until_ms = sp_loop_now_ms(svc->loop) + wait_ms;
    w->cb = cb;
    w->arg = arg;
    sp_timer_init(&w->poll, svc->loop, on_wake_poll, w);
    if (sp_svc_get_sandbox(svc, a, id, wake_got, w, err) < 0) {
        free(w);
        return -1;
    }
    return 0;
}

/* ---- figures and events ---- */

int sp_svc_vm_stats(sp_svc_t *svc, const char *id, sp_vm_stats_t *out, sp_err_t *err)
{
    if (!sp_ids_valid(id))
        return sp_err_set(err, SP_ENOTFOUND, "sandbox not found");
    if (svc->driver == NULL || svc->driver->ops->stats == NULL)
        return sp_err_set(err, SP_EUNAVAIL, "no runtime on this server");
    memset(out, 0, sizeof(*out));
    return svc->driver->ops->stats(svc->driver, id, out, err);
}

uint64_t sp_svc_vm_disk_bytes(sp_svc_t *svc, const char *id)
{
    return sp_ids_valid(id) ? sp_driver_disk_bytes(svc->driver, id) : 0;
}

size_t sp_svc_vm_samples(sp_svc_t *svc, const char *id, int64_t start_s, int64_t end_s,
                         sp_sample_t *out, size_t cap)
{
    if (!sp_ids_valid(id) || svc->sampler == NULL)
        return 0;
    return sp_sampler_get(svc->sampler, id, start_s, end_s, out, cap);
}

static void events_done(void *rec, PGresult *res, const sp_err_t *err)
{
    sp_store_req_t *c = rec;
    sp_svc_events_cb cb = (sp_svc_events_cb)c->cb;
    sp_err_t e;
    const sp_err_t *fail;
    /* One row at least (a LEFT JOIN): none, no such sandbox. */
    sp_event_rec_t *recs =
        sp_store_rows(res, err, SP_ENOTFOUND, "sandbox not found", sizeof(*recs), &fail, &e);
    if (recs == NULL) {
        cb(c->arg, NULL, 0, fail);
        return;
    }
    int rows = PQntuples(res);
    size_t n = 0;
    for (int i = 0; i < rows; i++) {
        if (PQgetisnull(res, i, 0)) /* the sandbox exists but has no (matching) events */
            continue;
        recs[n].id = atoll(PQgetvalue(res, i, 0));
        SP_STORE_TEXT(res, i, 1, recs[n].at);
        recs[n].at_ms = atoll(PQgetvalue(res, i, 2));
        SP_STORE_TEXT(res, i, 3, recs[n].kind);
        SP_STORE_TEXT(res, i, 4, recs[n].detail);
        n++;
    }
    cb(c->arg, recs, n, NULL);
    free(recs);
}

int sp_svc_sandbox_events(sp_svc_t *svc, const sp_auth_t *a, const char *id, long long since_ms,
                          int limit, sp_svc_events_cb cb, void *arg, sp_err_t *err)
{
    if (!sp_ids_valid(id))
        return sp_err_set(err, SP_ENOTFOUND, "sandbox not found");
    if (limit < 1 || limit > 10000)
        return sp_err_set(err, SP_EINVAL, "limit must be 1 to 10000");
    if (since_ms < 0)
        return sp_err_set(err, SP_EINVAL, "start must not be negative");
    char since[24], lim[16];
    snprintf(since, sizeof(since), "%lld", since_ms);
    snprintf(lim, sizeof(lim), "%d", limit);
    const char *p[] = {id, a->team_id, since, lim};
    return submit(svc,
                  "SELECT e.id, " TS("e.at") ", floor(extract(epoch FROM e.at) * 1000)::bigint,"
                  " e.kind, e.detail FROM sandboxes s LEFT JOIN LATERAL"
                  " (SELECT * FROM events ev WHERE ev.sandbox_id = s.id"
                  "   AND ev.at >= to_timestamp($3::bigint / 1000.0) ORDER BY ev.id LIMIT $4::int)"
                  " e ON true"
                  " WHERE s.id = $1 AND s.team_id = $2 AND s.observed_state <> 'deleted'"
                  " ORDER BY e.id",
                  4, p, events_done, (void *)cb, arg, 0, err);
}

/* ---- outbound traffic ---- */

void sp_svc_set_egress_hook(sp_svc_t *svc,
                            void (*fn)(void *arg, const char *sandbox_id, const json_t *policy),
                            void *arg)
{
    svc->egress_hook = fn;
    svc->egress_hook_arg = arg;
}

/* The policy a row stands for: its egress column, else allow_internet_access alone. */
static json_t *policy_of_row(PGresult *res, int row, int col)
{
    const char *js = PQgetvalue(res, row, col);
    int aia = atoi(PQgetvalue(res, row, col + 1));
    sp_egp_t *p = NULL;
    if (js[0] != '\0') {
        json_t *o = json_loads(js, 0, NULL);
        p = o ? sp_egp_from_json(o, "egress", NULL) : NULL;
        json_decref(o);
    } else {
        p = sp_egp_default();
        if (p != NULL)
            p->internet = aia != 0;
    }
    json_t *j = p ? sp_egp_to_json(p) : NULL;
    sp_egp_free(p);
    return j;
}

static void policy_done(void *rec, PGresult *res, const sp_err_t *err)
{
    sp_store_req_t *c = rec;
    sp_svc_policy_cb cb = (sp_svc_policy_cb)c->cb;
    sp_err_t e;
    const sp_err_t *fail = sp_store_one_row(res, err, SP_ENOTFOUND, "sandbox not found", &e);
    if (fail != NULL) {
        cb(c->arg, NULL, fail);
        return;
    }
    json_t *j = policy_of_row(res, 0, 1);
    if (j == NULL) {
        sp_log(SP_LOG_ERROR, "svc", "stored egress policy unreadable sandbox=%s",
               PQgetvalue(res, 0, 0));
        sp_err_set(&e, SP_EINTERNAL, "stored egress policy is unreadable");
        cb(c->arg, NULL, &e);
        return;
    }
    sp_svc_t *svc = c->owner;
    if (c->flag == 1 && svc->egress_hook != NULL)
        svc->egress_hook(svc->egress_hook_arg, PQgetvalue(res, 0, 0), j);
    cb(c->arg, j, NULL);
    json_decref(j);
}

int sp_svc_egress_policy(sp_svc_t *svc, const sp_auth_t *a, const char *id, sp_svc_policy_cb cb,
                         void *arg, sp_err_t *err)
{
    if (!sp_ids_valid(id))
        return sp_err_set(err, SP_ENOTFOUND, "sandbox not found");
    const char *p[] = {id, a->team_id};
    return submit(svc,
                  "SELECT s.id, coalesce(s.egress::text, ''),"
                  " coalesce(s.allow_internet_access::int, -1) FROM sandboxes s"
                  " WHERE s.id = $1 AND s.team_id = $2 AND s.observed_state <> 'deleted'",
                  2, p, policy_done, (void *)cb, arg, 0, err);
}

int sp_svc_set_egress_policy(sp_svc_t *svc, const sp_auth_t *a, const char *id,
                             const json_t *policy, sp_svc_policy_cb cb, void *arg, sp_err_t *err)
{
    if (!sp_ids_valid(id))
        return sp_err_set(err, SP_ENOTFOUND, "sandbox not found");
    if (policy == NULL || !json_is_object(policy))
        return sp_err_set(err, SP_EINVAL, "the policy must be a JSON object");
    sp_egp_t *pol = sp_egp_from_json(policy, "policy", err);
    if (pol == NULL)
        return -1;
    json_t *norm = sp_egp_to_json(pol);
    sp_egp_free(pol);
    char *js = norm ? json_dumps(norm, JSON_COMPACT) : NULL;
    json_decref(norm);
    if (js == NULL)
        return sp_err_set(err, SP_EINTERNAL, "out of memory");
    const char *p[] = {id, a->team_id, js};
    int rc = submit(svc,
                    "WITH u AS (UPDATE sandboxes SET egress = $3::jsonb, updated_at = now()"
                    "  WHERE id = $1 AND team_id = $2 AND observed_state <> 'deleted'"
                    "  RETURNING id, egress, allow_internet_access),"
                    " n AS (SELECT pg_notify('space_egress', u.id) FROM u)"
                    " SELECT u.id, u.egress::text, coalesce(u.allow_internet_access::int, -1)"
                    " FROM u, n",
                    3, p, policy_done, (void *)cb, arg, 1, err);
    free(js);
    return rc;
}

static void egress_log_done(void *rec, PGresult *res, const sp_err_t *err)
{
    sp_store_req_t *c = rec;
    sp_svc_egress_log_cb cb = (sp_svc_egress_log_cb)c->cb;
    sp_err_t e;
    const sp_err_t *fail;
    /* One row at least (a LEFT JOIN): none, no such sandbox. */
    sp_egress_rec_t *recs =
        sp_store_rows(res, err, SP_ENOTFOUND, "sandbox not found", sizeof(*recs), &fail, &e);
    if (recs == NULL) {
        cb(c->arg, NULL, 0, NULL, fail);
        return;
    }
    int rows = PQntuples(res);
    size_t n = 0;
    int limit = c->flag;
    bool more = false;
    for (int i = 0; i < rows; i++) {
        if (PQgetisnull(res, i, 0)) /* the sandbox exists but has no (more) rows */
            continue;
        if ((int)n == limit) {
            more = true;
            break;
        }
        sp_egress_rec_t *r = &recs[n++];
        r->id = atoll(PQgetvalue(res, i, 0));
        SP_STORE_TEXT(res, i, 1, r->at);
        SP_STORE_TEXT(res, i, 2, r->kind);
        SP_STORE_TEXT(res, i, 3, r->host);
        r->port = atoi(PQgetvalue(res, i, 4));
        SP_STORE_TEXT(res, i, 5, r->address);
        r->allowed = PQgetvalue(res, i, 6)[0] == 't';
        SP_STORE_TEXT(res, i, 7, r->reason);
        r->bytes_up = atoll(PQgetvalue(res, i, 8));
        r->bytes_down = atoll(PQgetvalue(res, i, 9));
        r->duration_ms = atoi(PQgetvalue(res, i, 10));
    }
    char cursor[32] = "";
    if (more && n > 0)
        snprintf(cursor, sizeof(cursor), "%lld", recs[n - 1].id);
    cb(c->arg, recs, n, more ? cursor : NULL, NULL);
    free(recs);
}

int sp_svc_egress_log(sp_svc_t *svc, const sp_auth_t *a, const char *id, int limit,
                      const char *cursor, sp_svc_egress_log_cb cb, void *arg, sp_err_t *err)
{
    if (!sp_ids_valid(id))
        return sp_err_set(err, SP_ENOTFOUND, "sandbox not found");
    if (limit < 1 || limit > 1000)
        return sp_err_set(err, SP_EINVAL, "limit must be 1 to 1000");
    char before[24] = "";
    if (cursor != NULL && cursor[0] != '\0') {
        size_t cl = strlen(cursor);
        if (cl > 19 || strspn(cursor, "0123456789") != cl)
            return sp_err_set(err, SP_EINVAL, "invalid cursor");
        memcpy(before, cursor, cl + 1); /* cl <= 19 digits */
    }
    char lim[16];
    snprintf(lim, sizeof(lim), "%d", limit + 1);
    const char *p[] = {id, a->team_id, before[0] ? before : NULL, lim};
    return submit(svc,
                  "SELECT l.id, " TS("l.at") ", l.kind, l.host, l.port, l.address, l.allowed,"
                  " l.reason, l.bytes_up, l.bytes_down, l.duration_ms"
                  " FROM sandboxes s LEFT JOIN LATERAL"
                  " (SELECT * FROM egress_log e WHERE e.sandbox_id = s.id"
                  "   AND ($3::bigint IS NULL OR e.id < $3::bigint)"
                  "   ORDER BY e.id DESC LIMIT $4::int) l ON true"
                  " WHERE s.id = $1 AND s.team_id = $2 AND s.observed_state <> 'deleted'"
                  " ORDER BY l.id DESC",
                  4, p, egress_log_done, (void *)cb, arg, limit, err);
}
