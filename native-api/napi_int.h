/*
 * napi_int.h - what the native API's route files share.
 */
#ifndef SP_NAPI_INT_H
#define SP_NAPI_INT_H

#include "native-api/napi.h"
#include "server/http.h"

#define NAPI_MAX_BODY (1024 * 1024) /* JSON bodies; larger is 413 */
#define NAPI_MAX_SEGS 8

struct sp_napi {
    sp_svc_t *svc;
};

/* One request's state across its asynchronous steps, in its hold. */
typedef struct napi_ctx napi_ctx_t;
typedef void (*napi_route_fn)(napi_ctx_t *c);

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
};

/* Finishes a request: replies if the client is still there, frees the context. */
void sp_napi__reply(napi_ctx_t *c, int status, json_t *obj /* stolen */);
void sp_napi__fail(napi_ctx_t *c, const sp_err_t *err);

json_t *sp_napi__sandbox_json(const sp_sandbox_rec_t *s);
json_t *sp_napi__op_json(const sp_op_rec_t *o);
json_t *sp_napi__template_json(const sp_template_rec_t *t);

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

#endif
