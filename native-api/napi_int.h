/*
 * napi_int.h - what the native API's route files share.
 */
#ifndef SP_NAPI_INT_H
#define SP_NAPI_INT_H

#include "base/buf.h"
#include "core/channel/exec.h"
#include "core/channel/session.h"
#include "core/control/admin.h"
#include "http/http.h"
#include "http/stream.h"
#include "native-api/body.h"
#include "native-api/napi.h"

#define NAPI_MAX_SEGS 8

struct sp_napi {
    sp_svc_t *svc;
    sp_driver_t *driver;        /* the attach path's way to a VM's agent; may be NULL */
    sp_session_tab_t *sessions; /* command sessions (route_sessions.c) */
    sp_admin_t *admin;          /* the /v1/admin routes' operations; NULL: they answer 503 */
    sp_tmpl_t *tmpl;            /* template builds (route_templates.c); NULL: they answer 503 */
    sp_snap_t *snap;            /* sandbox snapshots (route_snapshots.c); NULL: they answer 503 */
    sp_fleet_t *fleet;          /* /v1/workers (route_admin.c); NULL: they answer 503 */
};

/* One request's state across its asynchronous steps, in its hold. */
typedef struct napi_ctx napi_ctx_t;
typedef void (*napi_route_fn)(napi_ctx_t *c);
/* The next step of a data-plane route, with the sandbox's agent channel. */
typedef void (*napi_agent_fn)(napi_ctx_t *c, sp_agentconn_t *conn);

struct napi_ctx {
    sp_napi_t *n;
    sp_http_hold_t *hold;
    sp_auth_t auth;
    const char *segs[NAPI_MAX_SEGS];
    int nsegs;
    json_t *body; /* parsed JSON object or NULL; owned */
    uint32_t wait_ms;
    napi_route_fn route;
    bool keyed; /* a key was given: /v1/workers answers a team's key 403, no key 401 */
    sp_request_t request;
    char op_id[65];
    char sandbox_id[65];
    sp_op_rec_t op; /* kept across a wait */
    bool have_op;
    napi_agent_fn agent_next; /* sp_napi__with_agent */
    void *data;                   /* a route's parsed request, freed with the context */
    void (*data_free)(void *data);
};

/* Finishes a request: replies if the client is still there, frees the context. */
void sp_napi__reply(napi_ctx_t *c, int status, json_t *obj /* stolen */);
void sp_napi__fail(napi_ctx_t *c, const sp_err_t *err);

json_t *sp_napi__sandbox_json(const sp_sandbox_rec_t *s);
/* Appends the bytes sp_json_write gives sp_napi__sandbox_json(s), written straight from the
 * record: building the jansson object, writing it and freeing it was most of what a read of
 * sandboxes cost spaced. -1 when it cannot (a field that is not UTF-8, which jansson drops
 * from the object): the caller renders through sp_napi__sandbox_json then. */
int sp_napi__sandbox_write(sp_buf_t *b, const sp_sandbox_rec_t *s);
/* Finishes a request like sp_napi__reply, with JSON text already written (body stays the
 * caller's). */
void sp_napi__reply_text(napi_ctx_t *c, int status, sp_buf_t *body);
json_t *sp_napi__op_json(const sp_op_rec_t *o);
json_t *sp_napi__template_json(const sp_template_rec_t *t);
/* A page of a list: {key: items (stolen), "next_cursor": next or null}, 200. */
void sp_napi__reply_page(napi_ctx_t *c, const char *key, json_t *items, const char *next);
/* What renders one record of a list: a new object, NULL when out of memory. */
typedef json_t *(*napi_item_fn)(const void *rec);
/* The array of the n records at recs, size bytes apart, each rendered by item: new; NULL when
 * out of memory (then no half list goes out). */
json_t *sp_napi__items(const void *recs, size_t n, size_t size, napi_item_fn item);
/* The answer to a delete of the resource named by segs[2] (a done callback, arg the context):
 * its error, else 200 {"name": segs[2], "deleted": true}. */
void sp_napi__on_deleted(void *arg, const sp_err_t *err);
/* A list call's answer: its error, else 200 {key: sp_napi__items(recs, n, size, item)}. */
void sp_napi__reply_list(napi_ctx_t *c, const sp_err_t *err, const char *key, const void *recs,
                         size_t n, size_t size, napi_item_fn item);

/* Frees the context and hands back the request for a streamed reply (NULL: client gone). */
h2o_req_t *sp_napi__take(napi_ctx_t *c);

/* Resolves segs[2] to a running sandbox's agent channel (404/409/503 answered here), records
 * the activity, then calls next. */
void sp_napi__with_agent(napi_ctx_t *c, napi_agent_fn next);
sp_loop_t *sp_napi__loop(napi_ctx_t *c);

/* ---- streamed NDJSON (ndjson.c) ---- */

/* The first event of a streamed NDJSON route (http/stream.h): a failure (err != NULL)
 * answers as a JSON error, anything else starts a 200 application/x-ndjson stream. Consumes c
 * either way. NULL when there is no stream (answered with err, the client is gone, or out of
 * memory, answered 500): the caller stops its operation and frees its state. */
sp_stream_t *sp_napi__ndjson_begin(napi_ctx_t *c, const sp_err_t *err, const sp_stream_cbs_t *cbs,
                                   void *arg);

/* Writes o (stolen; NULL: out of memory) as one line standing for raw agent bytes; -1 when
 * out of memory. */
int sp_napi__ndjson_line(sp_stream_t *st, json_t *o, size_t raw);

/* A process's events as lines on st: {"type":"start","id","pid"[,"session"]},
 * {"type":"stdout"|"stderr","data"}, {"exit_code","signal","timed_out","type":"exit"} or
 * {"type":"error","error":{"code","message"}}. Zero it, set st once the stream started. */
typedef struct {
    sp_stream_t *st;
    uint8_t carry[2][4]; /* an incomplete UTF-8 sequence at the end of a chunk, per fd */
    size_t ncarry[2];
    sp_buf_t line;       /* scratch for one output line */
} napi_ndjson_t;

/* An event after the start line, as its line: 1 when it was the last (EXIT, after what the
 * carries still held, or ERROR: the stream is ended), -1 when out of memory (the stream is
 * cut; the caller stops or detaches the process), 0 otherwise. */
int sp_napi__nd_event(napi_ndjson_t *nd, const sp_exec_ev_t *ev);
void sp_napi__nd_clear(napi_ndjson_t *nd);
/* {"exit_code","signal","timed_out"}: a collected command's result and the exit line. */
json_t *sp_napi__exit_json(bool exited, int code, int sig, bool timed_out);
/* The lines of an EXIT event (the exit_json fields and "type") and of an error. */
json_t *sp_napi__exit_event(const sp_exec_ev_t *ev);
json_t *sp_napi__error_event(const sp_err_t *err);
/* session: NULL, or the session the process runs in. */
json_t *sp_napi__start_event(uint32_t pid, const char *session);

/* ---- request input (input.c; the body's fields: body.h) ---- */

/* req's body as JSON: sp_napi__json_body on its bytes. */
int sp_napi__parse_body(h2o_req_t *req, bool quiet, json_t **out, sp_err_t *err);
/* Query parameters: absent leaves *out as it was. */
int sp_napi__query_int(h2o_req_t *req, const char *name, int lo, int hi, int *out, sp_err_t *err);
/* true/1 or false/0. */
int sp_napi__query_bool(h2o_req_t *req, const char *name, bool *out, sp_err_t *err);

/* Route handlers (the context is authenticated and validated for shape). */
void sp_napi__templates_list(napi_ctx_t *c);
void sp_napi__templates_get(napi_ctx_t *c);
void sp_napi__templates_build(napi_ctx_t *c);
void sp_napi__templates_delete(napi_ctx_t *c);
void sp_napi__templates_detail(napi_ctx_t *c);
void sp_napi__tags_put(napi_ctx_t *c);
void sp_napi__tags_delete(napi_ctx_t *c);
void sp_napi__builds_get(napi_ctx_t *c);
void sp_napi__builds_logs(napi_ctx_t *c);
void sp_napi__template_files_put(napi_ctx_t *c);
void sp_napi__template_files_get(napi_ctx_t *c);
void sp_napi__sandboxes_create(napi_ctx_t *c);
void sp_napi__sandboxes_list(napi_ctx_t *c);
void sp_napi__sandboxes_get(napi_ctx_t *c);
void sp_napi__sandboxes_request(napi_ctx_t *c);
void sp_napi__sandboxes_events(napi_ctx_t *c);
void sp_napi__operations_get(napi_ctx_t *c);
/* Sandbox snapshots (route_snapshots.c). */
void sp_napi__snapshots_take(napi_ctx_t *c);
void sp_napi__snapshots_list(napi_ctx_t *c);
void sp_napi__snapshots_get(napi_ctx_t *c);
void sp_napi__snapshots_delete(napi_ctx_t *c);
void sp_napi__commands_run(napi_ctx_t *c);
void sp_napi__commands_list(napi_ctx_t *c);
void sp_napi__commands_output(napi_ctx_t *c);
void sp_napi__commands_stdin(napi_ctx_t *c);
void sp_napi__commands_signal(napi_ctx_t *c);
void sp_napi__files_get(napi_ctx_t *c);
void sp_napi__files_put(napi_ctx_t *c);
void sp_napi__files_delete(napi_ctx_t *c);
void sp_napi__files_stat(napi_ctx_t *c);
void sp_napi__files_list(napi_ctx_t *c);
void sp_napi__files_mkdir(napi_ctx_t *c);
void sp_napi__files_move(napi_ctx_t *c);
void sp_napi__sessions_create(napi_ctx_t *c);
void sp_napi__sessions_list(napi_ctx_t *c);
void sp_napi__sessions_get(napi_ctx_t *c);
void sp_napi__sessions_delete(napi_ctx_t *c);
void sp_napi__contexts_create(napi_ctx_t *c);
void sp_napi__contexts_list(napi_ctx_t *c);
void sp_napi__contexts_delete(napi_ctx_t *c);
void sp_napi__contexts_restart(napi_ctx_t *c);
void sp_napi__contexts_interrupt(napi_ctx_t *c);
/* Both execute routes: in a context when the path names one. */
void sp_napi__execute(napi_ctx_t *c);
void sp_napi__secrets_create(napi_ctx_t *c);
void sp_napi__secrets_list(napi_ctx_t *c);
void sp_napi__secrets_put(napi_ctx_t *c);
void sp_napi__secrets_delete(napi_ctx_t *c);
void sp_napi__credentials_get(napi_ctx_t *c);
void sp_napi__credentials_put(napi_ctx_t *c);
/* Outbound traffic (route_egress.c): audit rows, and the policy (PUT body parsed there). */
void sp_napi__egress_log(napi_ctx_t *c);
void sp_napi__egress_policy_get(napi_ctx_t *c);
void sp_napi__egress_policy_put(napi_ctx_t *c);
/* Teams and keys (route_admin.c): authenticated with the admin key, not a team's. */
void sp_napi__admin_teams_list(napi_ctx_t *c);
void sp_napi__admin_teams_create(napi_ctx_t *c);
void sp_napi__admin_team_quota(napi_ctx_t *c);
void sp_napi__admin_keys_list(napi_ctx_t *c);
void sp_napi__admin_keys_create(napi_ctx_t *c);
void sp_napi__admin_keys_revoke(napi_ctx_t *c);
void sp_napi__workers_list(napi_ctx_t *c);
void sp_napi__workers_get(napi_ctx_t *c);
void sp_napi__workers_drain(napi_ctx_t *c);
void sp_napi__workers_undrain(napi_ctx_t *c);
/* GET /v1/attach/{sandbox}/{sid} and /v1/attach/{sid}: authenticated by the session's
 * attach token, not an API key. */
/* sandbox: the sandbox the path names (the session must be its), or NULL for the older
 * /v1/attach/{session}. */
void sp_napi__attach(sp_napi_t *n, h2o_req_t *req, const char *sandbox, const char *sid);

#endif
