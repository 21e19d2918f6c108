/*
 * napi_int.h - what the native API's route files share.
 */
#ifndef SP_NAPI_INT_H
#define SP_NAPI_INT_H

#include "core/channel/session.h"
#include "native-api/napi.h"
#include "http/http.h"
#include "http/stream.h"

#define NAPI_MAX_BODY (1024 * 1024) /* JSON bodies; larger is 413 */
#define NAPI_MAX_SEGS 8

struct sp_napi {
    sp_svc_t *svc;
    sp_driver_t *driver;        /* the attach path's way to a VM's agent; may be NULL */
    sp_session_tab_t *sessions; /* command sessions (route_sessions.c) */
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
json_t *sp_napi__op_json(const sp_op_rec_t *o);
json_t *sp_napi__template_json(const sp_template_rec_t *t);

/* Frees the context and hands back the request for a streamed reply (NULL: client gone). */
h2o_req_t *sp_napi__take(napi_ctx_t *c);

/* Resolves segs[2] to a running sandbox's agent channel (404/409/503 answered here), records
 * the activity, then calls next. */
void sp_napi__with_agent(napi_ctx_t *c, napi_agent_fn next);
sp_loop_t *sp_napi__loop(napi_ctx_t *c);

/* The first event of a streamed NDJSON route (http/stream.h): a failure (err != NULL)
 * answers as a JSON error, anything else starts a 200 application/x-ndjson stream. Consumes c
 * either way. NULL when there is no stream (answered with err, the client is gone, or out of
 * memory, answered 500): the caller stops its operation and frees its state. */
sp_stream_t *sp_napi__ndjson_begin(napi_ctx_t *c, const sp_err_t *err, const sp_stream_cbs_t *cbs,
                                   void *arg);

/* Body helpers: check that obj has only the listed keys ("a,b,c"). */
int sp_napi__only_keys(const json_t *obj, const char *const *allowed, sp_err_t *err);

/* Route handlers (the context is authenticated and validated for shape). */
void sp_napi__templates_list(napi_ctx_t *c);
void sp_napi__templates_get(napi_ctx_t *c);
void sp_napi__sandboxes_create(napi_ctx_t *c);
void sp_napi__sandboxes_list(napi_ctx_t *c);
void sp_napi__sandboxes_get(napi_ctx_t *c);
void sp_napi__sandboxes_request(napi_ctx_t *c);
void sp_napi__operations_get(napi_ctx_t *c);
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
void sp_napi__contexts_execute(napi_ctx_t *c);
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
/* GET /v1/attach/{sid}: authenticated by the session's attach token, not an API key. */
void sp_napi__attach(sp_napi_t *n, h2o_req_t *req, const char *sid);

#endif
