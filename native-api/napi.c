/*
 * napi.c - routing, authentication, bodies and rendering for /v1.
 *
 * Order of checks: unknown path or method (404/405, no auth needed), then
 * the key (401), then the body (413/400), then the route.
 */
#include "native-api/napi_int.h"

#include <stdlib.h>
#include <string.h>

#include "base/log.h"
#include "http/json.h"

sp_napi_t *sp_napi_create(sp_svc_t *svc)
{
    sp_napi_t *n = calloc(1, sizeof(*n));
    if (n == NULL)
        return NULL;
    n->svc = svc;
    n->sessions = sp_session_tab_create(sp_svc_loop(svc));
    if (n->sessions == NULL) {
        free(n);
        return NULL;
    }
    return n;
}

void sp_napi_set_driver(sp_napi_t *n, sp_driver_t *driver)
{
    n->driver = driver;
}

void sp_napi_set_admin(sp_napi_t *n, sp_admin_t *admin)
{
    n->admin = admin;
}

void sp_napi_set_tmpl(sp_napi_t *n, sp_tmpl_t *tmpl)
{
    n->tmpl = tmpl;
}

void sp_napi_set_snap(sp_napi_t *n, sp_snap_t *snap)
{
    n->snap = snap;
}

void sp_napi_set_fleet(sp_napi_t *n, sp_fleet_t *fleet)
{
    n->fleet = fleet;
}

void sp_napi_destroy(sp_napi_t *n)
{
    if (n == NULL)
        return;
    sp_session_tab_destroy(n->sessions);
    free(n);
}

bool sp_napi_owns(h2o_req_t *req)
{
    size_t len = req->query_at != SIZE_MAX ? req->query_at : req->path.len;
    return (len >= 4 && memcmp(req->path.base, "/v1/", 4) == 0) ||
           (len == 3 && memcmp(req->path.base, "/v1", 3) == 0) ||
           h2o_memis(req->path.base, len, H2O_STRLIT("/healthz"));
}

const char *sp_napi_route_class(h2o_req_t *req)
{
    static const char *const tops[][2] = {{"templates", "templates"},
                                          {"template-files", "templates"},
                                          {"operations", "operations"},
                                          {"snapshots", "snapshots"},
                                          {"secrets", "secrets"},
                                          {"workers", "workers"},
                                          {"attach", "attach"},
                                          {"openapi.json", "openapi"}};
    static const char *const subs[][2] = {
        {"pause", "sandbox_pause"},       {"suspend", "sandbox_suspend"},
        {"wake", "sandbox_wake"},         {"commands", "sandbox_commands"},
        {"files", "sandbox_files"},       {"sessions", "sandbox_sessions"},
        {"contexts", "sandbox_contexts"}, {"execute", "sandbox_execute"},
        {"credentials", "sandbox_credentials"}, {"egress", "sandbox_egress"},
        {"snapshots", "sandbox_snapshots"}};
    const char *segs[NAPI_MAX_SEGS];
    int ns = sp_http_segments(req, segs, NAPI_MAX_SEGS);
    if (ns == 1 && strcmp(segs[0], "healthz") == 0)
        return "health";
    if (ns < 2 || strcmp(segs[0], "v1") != 0)
        return "other";
    for (size_t i = 0; i < sizeof(tops) / sizeof(tops[0]); i++)
        if (strcmp(segs[1], tops[i][0]) == 0)
            return tops[i][1];
    if (strcmp(segs[1], "sandboxes") != 0)
        return "other";
    if (ns == 2)
        return "sandboxes";
    if (ns == 3)
        return "sandbox";
    for (size_t i = 0; i < sizeof(subs) / sizeof(subs[0]); i++)
        if (strcmp(segs[3], subs[i][0]) == 0)
            return subs[i][1];
    return "sandbox_other";
}

bool sp_napi_data_plane(h2o_req_t *req, char id[65])
{
    /* egress and credentials too: their changes reach the worker's egress proxy through an
     * in-memory hook (sp_svc_set_egress_hook), so they must be made on the sandbox's worker;
     * and snapshots: the worker's runtime takes them, of the VM it runs */
    static const char *const subs[] = {"commands", "files",  "sessions",    "contexts",
                                       "execute",  "egress", "credentials", "snapshots"};
    const char *segs[NAPI_MAX_SEGS];
    int ns = sp_http_segments(req, segs, NAPI_MAX_SEGS);
    if (ns == 4 && strcmp(segs[0], "v1") == 0 && strcmp(segs[1], "attach") == 0 &&
        strlen(segs[2]) < 65) {
        /* The attach path names the sandbox so that any node can route it: the session
         * itself lives only in its worker's memory. */
        snprintf(id, 65, "%s", segs[2]);
        return true;
    }
    if (ns < 4 || strcmp(segs[0], "v1") != 0 || strcmp(segs[1], "sandboxes") != 0 ||
        strlen(segs[2]) >= 65)
        return false;
    for (size_t i = 0; i < sizeof(subs) / sizeof(subs[0]); i++) {
        if (strcmp(segs[3], subs[i]) == 0) {
            snprintf(id, 65, "%s", segs[2]);
            return true;
        }
    }
    return false;
}

bool sp_napi_build_route(h2o_req_t *req, char name[65])
{
    const char *g[NAPI_MAX_SEGS];
    int n = sp_http_segments(req, g, NAPI_MAX_SEGS);
    name[0] = '\0';
    if (n < 2 || strcmp(g[0], "v1") != 0)
        return false;
    if (n == 2 && strcmp(g[1], "templates") == 0 && sp_http_method_is(req, "POST")) {
        /* the body's name, when it has one (the builder answers a bad body) */
        json_t *b = json_loadb(req->entity.base, req->entity.len, 0, NULL);
        const char *v = json_string_value(json_object_get(b, "name"));
        snprintf(name, 65, "%s", v != NULL ? v : "");
        json_decref(b);
        return true;
    }
    if (n == 3)
        return strcmp(g[1], "template-files") == 0;
    if ((n == 5 || (n == 6 && strcmp(g[5], "logs") == 0)) && sp_http_method_is(req, "GET") &&
        strcmp(g[1], "templates") == 0 && strcmp(g[3], "builds") == 0) {
        snprintf(name, 65, "%s", g[2]);
        return true;
    }
    return false;
}

static void ctx_free(napi_ctx_t *c)
{
    json_decref(c->body);
    if (c->data != NULL && c->data_free != NULL)
        c->data_free(c->data);
    c->data = NULL;
}

void sp_napi__reply(napi_ctx_t *c, int status, json_t *obj)
{
    ctx_free(c);
    h2o_req_t *req = sp_http_release(c->hold); /* frees c: it lives in the hold */
    if (req != NULL)
        sp_http_json(req, status, obj);
    else
        json_decref(obj);
}

void sp_napi__reply_text(napi_ctx_t *c, int status, sp_buf_t *body)
{
    ctx_free(c);
    h2o_req_t *req = sp_http_release(c->hold); /* frees c: it lives in the hold */
    if (req != NULL)
        sp_http_json_text(req, status, body);
}

h2o_req_t *sp_napi__take(napi_ctx_t *c)
{
    ctx_free(c);
    return sp_http_release(c->hold); /* frees c */
}

sp_loop_t *sp_napi__loop(napi_ctx_t *c)
{
    return sp_svc_loop(c->n->svc);
}

static void on_agent(void *arg, sp_agentconn_t *conn, const sp_err_t *err)
{
    napi_ctx_t *c = arg;
    if (err != NULL)
        sp_napi__fail(c, err);
    else if (sp_http_hold_req(c->hold) == NULL)
        sp_napi__take(c); /* the client left while we looked: start nothing */
    else
        c->agent_next(c, conn);
}

void sp_napi__with_agent(napi_ctx_t *c, napi_agent_fn next)
{
    sp_err_t e;
    c->agent_next = next;
    if (sp_svc_sandbox_agent(c->n->svc, &c->auth, c->segs[2], on_agent, c, &e) < 0)
        sp_napi__fail(c, &e);
}

void sp_napi__fail(napi_ctx_t *c, const sp_err_t *err)
{
    ctx_free(c);
    h2o_req_t *req = sp_http_release(c->hold);
    if (req != NULL)
        sp_http_error(req, err);
}

/* ---- rendering ---- */

static json_t *str_or_null(const char *s)
{
    return s[0] ? json_string(s) : json_null();
}

json_t *sp_napi__sandbox_json(const sp_sandbox_rec_t *s)
{
    json_t *o = json_object();
    json_object_set_new(o, "id", json_string(s->id));
    json_object_set_new(o, "template", json_string(s->template_name));
    json_object_set_new(o, "state", json_string(s->observed));
    json_object_set_new(o, "desired_state", json_string(s->desired));
    json_object_set_new(o, "created_at", json_string(s->created_at));
    json_object_set_new(o, "last_activity_at", json_string(s->last_activity_at));
    json_object_set_new(o, "idle_timeout_s", json_integer(s->idle_timeout_s));
    json_object_set_new(o, "deadline_at", str_or_null(s->deadline_at));
    json_object_set_new(o, "deadline_action", json_string(s->deadline_action));
    json_object_set_new(o, "metadata", json_incref(s->metadata));
    json_object_set_new(o, "cpu_count", json_integer(s->cpu_count));
    json_object_set_new(o, "memory_mb", json_integer(s->memory_mb));
    json_object_set_new(o, "snapshot_bytes", json_integer(s->snapshot_bytes));
    json_object_set_new(o, "error", str_or_null(s->error));
    json_object_set_new(o, "access_token", json_string(s->access_token)); /* E2B envd token */
    if (s->lost_at[0]) /* only a sandbox lost with its worker has one (core/control/fleet.h) */
        json_object_set_new(o, "lost_at", json_string(s->lost_at));
    return o;
}

int sp_napi__sandbox_write(sp_buf_t *b, const sp_sandbox_rec_t *s)
{
    /* The order and forms of sp_napi__sandbox_json; a test compares the bytes. */
    if (s->metadata == NULL)
        return -1;
    if (sp_json_put_str(b, "{\"id\":", s->id, false) < 0 ||
        sp_json_put_str(b, ",\"template\":", s->template_name, false) < 0 ||
        sp_json_put_str(b, ",\"state\":", s->observed, false) < 0 ||
        sp_json_put_str(b, ",\"desired_state\":", s->desired, false) < 0 ||
        sp_json_put_str(b, ",\"created_at\":", s->created_at, false) < 0 ||
        sp_json_put_str(b, ",\"last_activity_at\":", s->last_activity_at, false) < 0)
        return -1;
    sp_json_put_int(b, ",\"idle_timeout_s\":", s->idle_timeout_s);
    if (sp_json_put_str(b, ",\"deadline_at\":", s->deadline_at, true) < 0 ||
        sp_json_put_str(b, ",\"deadline_action\":", s->deadline_action, false) < 0)
        return -1;
    sp_buf_str(b, ",\"metadata\":");
    if (sp_json_write(b, s->metadata) < 0)
        return -1;
    sp_json_put_int(b, ",\"cpu_count\":", s->cpu_count);
    sp_json_put_int(b, ",\"memory_mb\":", s->memory_mb);
    sp_json_put_int(b, ",\"snapshot_bytes\":", (long long)s->snapshot_bytes);
    if (sp_json_put_str(b, ",\"error\":", s->error, true) < 0 ||
        sp_json_put_str(b, ",\"access_token\":", s->access_token, false) < 0)
        return -1;
    if (s->lost_at[0] && sp_json_put_str(b, ",\"lost_at\":", s->lost_at, false) < 0)
        return -1;
    sp_buf_add(b, "}", 1);
    return b->oom ? -1 : 0;
}

json_t *sp_napi__op_json(const sp_op_rec_t *op)
{
    json_t *o = json_object();
    json_object_set_new(o, "id", json_string(op->id));
    json_object_set_new(o, "sandbox_id", json_string(op->sandbox_id));
    json_object_set_new(o, "kind", json_string(op->kind));
    json_object_set_new(o, "status", json_string(op->status));
    if (op->error_code[0])
        json_object_set_new(o, "error",
                            json_pack("{s:s,s:s}", "code", op->error_code, "message",
                                      op->error_message));
    else
        json_object_set_new(o, "error", json_null());
    json_object_set_new(o, "created_at", json_string(op->created_at));
    json_object_set_new(o, "finished_at", str_or_null(op->finished_at));
    /* what it waited for when that took long (a template snapshot build, a cold boot) */
    json_object_set_new(o, "progress", op->progress[0] ? json_string(op->progress) : json_null());
    if (op->snapshot_id[0]) /* kind "snapshot": the snapshot it takes */
        json_object_set_new(o, "snapshot_id", json_string(op->snapshot_id));
    return o;
}

void sp_napi__reply_page(napi_ctx_t *c, const char *key, json_t *items, const char *next)
{
    sp_napi__reply(c, 200,
                   json_pack("{s:o,s:o}", key, items, "next_cursor",
                             next ? json_string(next) : json_null()));
}

json_t *sp_napi__items(const void *recs, size_t n, size_t size, napi_item_fn item)
{
    json_t *arr = json_array();
    for (size_t i = 0; arr != NULL && i < n; i++) {
        if (json_array_append_new(arr, item((const char *)recs + i * size)) < 0) {
            json_decref(arr);
            arr = NULL;
        }
    }
    return arr;
}

void sp_napi__on_deleted(void *arg, const sp_err_t *err)
{
    napi_ctx_t *c = arg;
    if (err != NULL)
        sp_napi__fail(c, err);
    else
        sp_napi__reply(c, 200, json_pack("{s:s,s:b}", "name", c->segs[2], "deleted", 1));
}

void sp_napi__reply_list(napi_ctx_t *c, const sp_err_t *err, const char *key, const void *recs,
                         size_t n, size_t size, napi_item_fn item)
{
    if (err != NULL)
        sp_napi__fail(c, err);
    else
        sp_napi__reply(c, 200, json_pack("{s:o}", key, sp_napi__items(recs, n, size, item)));
}

json_t *sp_napi__template_json(const sp_template_rec_t *t)
{
    json_t *o = json_pack("{s:s,s:s,s:i,s:i,s:s,s:s,s:b}", "name", t->name, "description",
                          t->description, "cpu_count", t->cpu_count, "memory_mb", t->memory_mb,
                          "status", t->status, "updated_at", t->updated_at, "builtin",
                          t->builtin);
    json_object_set_new(o, "version", t->version[0] ? json_string(t->version) : json_null());
    json_object_set_new(o, "parent", t->parent[0] ? json_string(t->parent) : json_null());
    json_object_set_new(o, "last_build_id",
                        t->last_build_id[0] ? json_string(t->last_build_id) : json_null());
    json_object_set_new(o, "last_build_status",
                        t->last_build_status[0] ? json_string(t->last_build_status) : json_null());
    json_object_set_new(o, "disk_mb", t->disk_mb > 0 ? json_integer(t->disk_mb) : json_null());
    json_object_set_new(o, "size_bytes",
                        t->size_bytes >= 0 ? json_integer(t->size_bytes) : json_null());
    json_object_set_new(o, "versions", t->versions ? json_deep_copy(t->versions) : json_array());
    return o;
}

/* ---- routing ---- */

enum { M_GET = 1, M_POST = 2, M_DELETE = 4, M_PUT = 8 };

struct route {
    int methods;
    const char *pattern[7]; /* "*" matches one segment */
    napi_route_fn fn[4];    /* by method bit: GET, POST, DELETE, PUT */
    bool body;              /* POST takes a JSON body (PUT bodies are raw, for the route) */
};

static const struct route routes[] = {
    {M_GET | M_POST,
     {"v1", "templates", NULL},
     {sp_napi__templates_list, sp_napi__templates_build, NULL},
     true},
    {M_GET | M_DELETE,
     {"v1", "templates", "*", NULL},
     {sp_napi__templates_detail, NULL, sp_napi__templates_delete},
     false},
    {M_PUT | M_DELETE,
     {"v1", "templates", "*", "tags", "*", NULL},
     {NULL, NULL, sp_napi__tags_delete, sp_napi__tags_put},
     false},
    {M_GET, {"v1", "templates", "*", "builds", "*", NULL}, {sp_napi__builds_get, NULL, NULL},
     false},
    {M_GET, {"v1", "templates", "*", "builds", "*", "logs", NULL},
     {sp_napi__builds_logs, NULL, NULL}, false},
    {M_GET | M_PUT,
     {"v1", "template-files", "*", NULL},
     {sp_napi__template_files_get, NULL, NULL, sp_napi__template_files_put},
     false},
    {M_GET | M_POST,
     {"v1", "sandboxes", NULL},
     {sp_napi__sandboxes_list, sp_napi__sandboxes_create, NULL},
     true},
    {M_GET | M_DELETE,
     {"v1", "sandboxes", "*", NULL},
     {sp_napi__sandboxes_get, NULL, sp_napi__sandboxes_request},
     false},
    {M_POST, {"v1", "sandboxes", "*", "pause", NULL}, {NULL, sp_napi__sandboxes_request, NULL}, true},
    {M_POST, {"v1", "sandboxes", "*", "suspend", NULL}, {NULL, sp_napi__sandboxes_request, NULL}, true},
    {M_POST, {"v1", "sandboxes", "*", "wake", NULL}, {NULL, sp_napi__sandboxes_request, NULL}, true},
    {M_GET, {"v1", "sandboxes", "*", "events", NULL}, {sp_napi__sandboxes_events, NULL, NULL},
     false},
    {M_GET, {"v1", "operations", "*", NULL}, {sp_napi__operations_get, NULL, NULL}, false},
    /* Sandbox snapshots (route_snapshots.c). */
    {M_POST, {"v1", "sandboxes", "*", "snapshots", NULL}, {NULL, sp_napi__snapshots_take, NULL},
     true},
    {M_GET, {"v1", "snapshots", NULL}, {sp_napi__snapshots_list, NULL, NULL}, false},
    {M_GET | M_DELETE,
     {"v1", "snapshots", "*", NULL},
     {sp_napi__snapshots_get, NULL, sp_napi__snapshots_delete},
     false},
    {M_GET | M_POST,
     {"v1", "sandboxes", "*", "commands", NULL},
     {sp_napi__commands_list, sp_napi__commands_run, NULL},
     true},
    {M_GET, {"v1", "sandboxes", "*", "commands", "*", "output", NULL},
     {sp_napi__commands_output, NULL, NULL}, false},
    {M_POST, {"v1", "sandboxes", "*", "commands", "*", "stdin", NULL},
     {NULL, sp_napi__commands_stdin, NULL}, true},
    {M_POST, {"v1", "sandboxes", "*", "commands", "*", "signal", NULL},
     {NULL, sp_napi__commands_signal, NULL}, true},
    {M_GET | M_PUT | M_DELETE,
     {"v1", "sandboxes", "*", "files", NULL},
     {sp_napi__files_get, NULL, sp_napi__files_delete, sp_napi__files_put},
     false},
    {M_GET, {"v1", "sandboxes", "*", "files", "stat", NULL}, {sp_napi__files_stat, NULL, NULL},
     false},
    {M_GET, {"v1", "sandboxes", "*", "files", "list", NULL}, {sp_napi__files_list, NULL, NULL},
     false},
    {M_POST, {"v1", "sandboxes", "*", "files", "mkdir", NULL}, {NULL, sp_napi__files_mkdir, NULL},
     true},
    {M_POST, {"v1", "sandboxes", "*", "files", "move", NULL}, {NULL, sp_napi__files_move, NULL},
     true},
    {M_GET | M_POST,
     {"v1", "sandboxes", "*", "sessions", NULL},
     {sp_napi__sessions_list, sp_napi__sessions_create, NULL},
     true},
    {M_GET | M_DELETE,
     {"v1", "sandboxes", "*", "sessions", "*", NULL},
     {sp_napi__sessions_get, NULL, sp_napi__sessions_delete},
     false},
    {M_GET | M_POST,
     {"v1", "sandboxes", "*", "contexts", NULL},
     {sp_napi__contexts_list, sp_napi__contexts_create, NULL},
     true},
    {M_DELETE, {"v1", "sandboxes", "*", "contexts", "*", NULL},
     {NULL, NULL, sp_napi__contexts_delete}, false},
    {M_POST, {"v1", "sandboxes", "*", "contexts", "*", "restart", NULL},
     {NULL, sp_napi__contexts_restart, NULL}, true},
    {M_POST, {"v1", "sandboxes", "*", "contexts", "*", "interrupt", NULL},
     {NULL, sp_napi__contexts_interrupt, NULL}, true},
    {M_POST, {"v1", "sandboxes", "*", "contexts", "*", "execute", NULL},
     {NULL, sp_napi__execute, NULL}, true},
    {M_POST, {"v1", "sandboxes", "*", "execute", NULL}, {NULL, sp_napi__execute, NULL}, true},
    /* Secrets and credential rules (route_secrets.c); PUT bodies are parsed by the route. */
    {M_GET | M_POST, {"v1", "secrets", NULL}, {sp_napi__secrets_list, sp_napi__secrets_create, NULL},
     true},
    {M_PUT | M_DELETE, {"v1", "secrets", "*", NULL},
     {NULL, NULL, sp_napi__secrets_delete, sp_napi__secrets_put}, false},
    {M_GET | M_PUT, {"v1", "sandboxes", "*", "credentials", NULL},
     {sp_napi__credentials_get, NULL, NULL, sp_napi__credentials_put}, false},
    /* Outbound traffic (route_egress.c): audit rows; the policy (PUT body parsed there). */
    {M_GET, {"v1", "sandboxes", "*", "egress", NULL}, {sp_napi__egress_log, NULL, NULL}, false},
    {M_GET | M_PUT, {"v1", "sandboxes", "*", "egress", "policy", NULL},
     {sp_napi__egress_policy_get, NULL, NULL, sp_napi__egress_policy_put}, false},
    /* The operator's teams and keys (route_admin.c): /v1/admin/... takes the admin key. */
    {M_GET | M_POST, {"v1", "admin", "teams", NULL},
     {sp_napi__admin_teams_list, sp_napi__admin_teams_create, NULL}, true},
    {M_POST, {"v1", "admin", "teams", "*", "quota", NULL}, {NULL, sp_napi__admin_team_quota, NULL},
     true},
    {M_GET | M_POST, {"v1", "admin", "teams", "*", "keys", NULL},
     {sp_napi__admin_keys_list, sp_napi__admin_keys_create, NULL}, true},
    {M_DELETE, {"v1", "admin", "teams", "*", "keys", "*", NULL},
     {NULL, NULL, sp_napi__admin_keys_revoke}, false},
    /* The fleet's workers (route_admin.c): the admin key too. */
    {M_GET, {"v1", "workers", NULL}, {sp_napi__workers_list, NULL, NULL}, false},
    {M_GET, {"v1", "workers", "*", NULL}, {sp_napi__workers_get, NULL, NULL}, false},
    {M_POST, {"v1", "workers", "*", "drain", NULL}, {NULL, sp_napi__workers_drain, NULL}, false},
    {M_POST, {"v1", "workers", "*", "undrain", NULL}, {NULL, sp_napi__workers_undrain, NULL},
     false},
};

static const struct route *match(const char **segs, int n)
{
    for (size_t r = 0; r < sizeof(routes) / sizeof(routes[0]); r++) {
        int i = 0;
        for (; routes[r].pattern[i] != NULL && i < n; i++)
            if (strcmp(routes[r].pattern[i], "*") != 0 && strcmp(routes[r].pattern[i], segs[i]) != 0)
                break;
        if (routes[r].pattern[i] == NULL && i == n)
            return &routes[r];
    }
    return NULL;
}

static int method_bit(h2o_req_t *req)
{
    if (sp_http_method_is(req, "GET") || sp_http_method_is(req, "HEAD"))
        return M_GET;
    if (sp_http_method_is(req, "POST"))
        return M_POST;
    if (sp_http_method_is(req, "DELETE"))
        return M_DELETE;
    if (sp_http_method_is(req, "PUT"))
        return M_PUT;
    return 0;
}

/* The hold's user bytes: the driver, asked what isolation it runs without. */
static void on_health(void *arg, const sp_err_t *err)
{
    sp_http_hold_t *h = arg;
    sp_napi_t *n = *(sp_napi_t **)sp_http_hold_user(h);
    h2o_req_t *req = sp_http_release(h);
    if (req == NULL)
        return;
    /* Up once the database answers and, on a node that runs sandboxes, its worker row is in
     * (placement finds no worker before: a create would fail for capacity). */
    bool ready = err == NULL && sp_fleet_ready(n->fleet);
    const char *status = ready ? "ok" : "starting";
    if (err != NULL)
        status = "unavailable";
    json_t *o = json_pack("{s:s,s:s}", "status", status, "database", err != NULL ? "down" : "up");
    const char *ins[8];
    size_t k = sp_driver_insecure(n->driver, ins, sizeof ins / sizeof ins[0]);
    if (o != NULL && k > 0) { /* the operator turned these off, or the host lacks them */
        json_t *a = json_array();
        for (size_t i = 0; i < k; i++)
            json_array_append_new(a, json_string(ins[i]));
        json_object_set_new(o, "insecure", a);
    }
    sp_http_json(req, ready ? 200 : 503, o);
}

static void on_admin_auth(void *arg, const sp_err_t *err)
{
    napi_ctx_t *c = arg;
    sp_err_t e;
    if (err != NULL && err->code == SP_EAUTH && strcmp(c->segs[1], "workers") == 0 && c->keyed)
        /* a key that is not the admin key (a team's): the fleet is not the team's to see */
        sp_napi__fail(c, (sp_err_set(&e, SP_EFORBIDDEN, "workers are for the admin key only"),
                          &e));
    else if (err != NULL)
        sp_napi__fail(c, err);
    else
        c->route(c);
}

static void on_auth(void *arg, const sp_auth_t *auth, const sp_err_t *err)
{
    napi_ctx_t *c = arg;
    if (err != NULL) {
        sp_napi__fail(c, err);
        return;
    }
    c->auth = *auth;
    c->route(c);
}

/* Parses ?wait=<seconds> (0..300, fractions allowed). */
static int parse_wait(h2o_req_t *req, uint32_t *out, sp_err_t *err)
{
    const char *w = sp_http_query(req, "wait");
    *out = 0;
    if (w == NULL)
        return 0;
    char *end = NULL;
    double s = strtod(w, &end);
    if (w[0] == '\0' || end == NULL || *end != '\0' || !(s >= 0 && s <= 300))
        return sp_err_set(err, SP_EINVAL, "wait must be a number of seconds from 0 to 300");
    *out = (uint32_t)(s * 1000);
    return 0;
}

void sp_napi_handle(sp_napi_t *n, h2o_req_t *req)
{
    const char *segs[NAPI_MAX_SEGS];
    int ns = sp_http_segments(req, segs, NAPI_MAX_SEGS);
    int mb = method_bit(req);

    if (ns == 1 && strcmp(segs[0], "healthz") == 0) {
        sp_http_hold_t *h = sp_http_hold(req, sizeof(sp_napi_t *));
        if (h != NULL)
            *(sp_napi_t **)sp_http_hold_user(h) = n;
        sp_err_t e;
        if (h == NULL || sp_svc_health(n->svc, on_health, h, &e) < 0) {
            if (h != NULL)
                sp_http_release(h);
            sp_http_json(req, 503, json_pack("{s:s,s:s}", "status", "unavailable", "database",
                                             "down"));
        }
        return;
    }
    if (ns == 2 && strcmp(segs[0], "v1") == 0 && strcmp(segs[1], "openapi.json") == 0 &&
        mb == M_GET) {
        req->res.status = 200;
        req->res.reason = "OK";
        h2o_add_header(&req->pool, &req->res.headers, H2O_TOKEN_CONTENT_TYPE, NULL,
                       H2O_STRLIT("application/json"));
        h2o_send_inline(req, sp_napi_openapi_json, strlen(sp_napi_openapi_json));
        return;
    }
    if ((ns == 3 || ns == 4) && strcmp(segs[0], "v1") == 0 && strcmp(segs[1], "attach") == 0) {
        /* The data plane: the session's token, not an API key, and no database.
         * /v1/attach/{sandbox}/{session} is what sessions hand out; /v1/attach/{session}, the
         * older form, is served only by the node that holds the session. */
        if (mb != M_GET)
            sp_http_json(req, 405,
                         json_pack("{s:{s:s,s:s}}", "error", "code", "method_not_allowed",
                                   "message", "method not allowed on this path"));
        else
            sp_napi__attach(n, req, ns == 4 ? segs[2] : NULL, segs[ns - 1]);
        return;
    }
    const struct route *r = ns < 0 ? NULL : match(segs, ns);
    if (r == NULL) {
        sp_http_error_code(req, SP_ENOTFOUND, "no such path");
        return;
    }
    if (!(r->methods & mb)) {
        sp_http_json(req, 405,
                     json_pack("{s:{s:s,s:s}}", "error", "code", "method_not_allowed", "message",
                               "method not allowed on this path"));
        return;
    }
    sp_err_t e;
    uint32_t wait_ms;
    if (parse_wait(req, &wait_ms, &e) < 0) {
        sp_http_error(req, &e);
        return;
    }
    const char *authz = sp_http_header(req, "authorization");
    const char *key = NULL;
    if (authz != NULL && strncasecmp(authz, "Bearer ", 7) == 0)
        key = authz + 7;
    json_t *body = NULL;
    if (mb == M_POST && r->body) {
        /* Quiet for secrets: the parser's message would quote the value. */
        if (sp_napi__parse_body(req, strcmp(segs[1], "secrets") == 0, &body, &e) < 0) {
            sp_http_error(req, &e);
            return;
        }
        if (body != NULL && !json_is_object(body)) {
            json_decref(body);
            sp_http_error_code(req, SP_EINVAL, "request body must be a JSON object");
            return;
        }
    }
    sp_http_hold_t *h = sp_http_hold(req, sizeof(napi_ctx_t));
    if (h == NULL) {
        json_decref(body);
        sp_http_error_code(req, SP_EINTERNAL, "out of memory");
        return;
    }
    napi_ctx_t *c = sp_http_hold_user(h);
    c->n = n;
    c->hold = h;
    c->nsegs = ns;
    memcpy(c->segs, segs, sizeof(segs[0]) * (size_t)ns);
    c->body = body;
    c->wait_ms = wait_ms;
    c->route = r->fn[mb == M_GET ? 0 : mb == M_POST ? 1 : mb == M_DELETE ? 2 : 3];
    if (strcmp(r->pattern[1], "admin") == 0 || strcmp(r->pattern[1], "workers") == 0) {
        if (n->admin == NULL)
            sp_napi__fail(c, (sp_err_set(&e, SP_EUNAVAIL, "the admin API is off"), &e));
        else if ((c->keyed = key != NULL && key[0] != '\0'),
                 sp_admin_authenticate(n->admin, key, on_admin_auth, c, &e) < 0)
            sp_napi__fail(c, &e);
        return;
    }
    if (sp_svc_authenticate(n->svc, key, on_auth, c, &e) < 0)
        sp_napi__fail(c, &e);
}
