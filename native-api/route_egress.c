/*
 * route_egress.c - a sandbox's outbound traffic on the native API:
 *
 *   GET /v1/sandboxes/{id}/egress          audit rows, newest first (?limit=1..1000, ?cursor)
 *   GET /v1/sandboxes/{id}/egress/policy   {"internet", "allow", "deny"} in normal form
 *   PUT /v1/sandboxes/{id}/egress/policy   replaces it; new connections follow at once
 *
 * The rules and their meaning are core/egress/egress_policy.h's; the proxy is core/egress/egress.h.
 */
#include <stdlib.h>
#include <string.h>

#include "native-api/napi_int.h"

static json_t *rec_json(const void *rec)
{
    const sp_egress_rec_t *r = rec;
    json_t *o = json_object();
    json_object_set_new(o, "id", json_integer(r->id));
    json_object_set_new(o, "at", json_string(r->at));
    json_object_set_new(o, "kind", json_string(r->kind));
    json_object_set_new(o, "host", json_string(r->host));
    json_object_set_new(o, "port", json_integer(r->port));
    json_object_set_new(o, "address", r->address[0] ? json_string(r->address) : json_null());
    json_object_set_new(o, "allowed", json_boolean(r->allowed));
    json_object_set_new(o, "reason", r->reason[0] ? json_string(r->reason) : json_null());
    json_object_set_new(o, "bytes_up", json_integer(r->bytes_up));
    json_object_set_new(o, "bytes_down", json_integer(r->bytes_down));
    json_object_set_new(o, "duration_ms", json_integer(r->duration_ms));
    return o;
}

static void on_log(void *arg, const sp_egress_rec_t *recs, size_t n, const char *next,
                   const sp_err_t *err)
{
    napi_ctx_t *c = arg;
    if (err != NULL)
        sp_napi__fail(c, err);
    else
        sp_napi__reply_page(c, "entries", sp_napi__items(recs, n, sizeof(*recs), rec_json), next);
}

void sp_napi__egress_log(napi_ctx_t *c)
{
    h2o_req_t *req = sp_http_hold_req(c->hold);
    sp_err_t e;
    int limit = 100;
    if (sp_napi__query_int(req, "limit", 1, 1000, &limit, &e) < 0 ||
        sp_svc_egress_log(c->n->svc, &c->auth, c->segs[2], limit, sp_http_query(req, "cursor"),
                          on_log, c, &e) < 0)
        sp_napi__fail(c, &e);
}

static void on_policy(void *arg, json_t *policy, const sp_err_t *err)
{
    napi_ctx_t *c = arg;
    if (err != NULL)
        sp_napi__fail(c, err);
    else
        sp_napi__reply(c, 200, json_incref(policy));
}

void sp_napi__egress_policy_get(napi_ctx_t *c)
{
    sp_err_t e;
    if (sp_svc_egress_policy(c->n->svc, &c->auth, c->segs[2], on_policy, c, &e) < 0)
        sp_napi__fail(c, &e);
}

void sp_napi__egress_policy_put(napi_ctx_t *c)
{
    sp_err_t e;
    json_t *b;
    if (sp_napi__parse_body(sp_http_hold_req(c->hold), false, &b, &e) < 0 ||
        (b == NULL ? sp_err_set(&e, SP_EINVAL, "request body must be a JSON object") : 0) < 0) {
        sp_napi__fail(c, &e);
        return;
    }
    /* Any JSON value: core says what a policy must be. */
    int rc = sp_svc_set_egress_policy(c->n->svc, &c->auth, c->segs[2], b, on_policy, c, &e);
    json_decref(b);
    if (rc < 0)
        sp_napi__fail(c, &e);
}
