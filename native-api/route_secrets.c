/*
 * route_secrets.c - /v1/secrets and /v1/sandboxes/{id}/credentials.
 *
 * A secret's value goes one way: in with POST or PUT, sealed at once (core/egress/secrets.h), and
 * never out again: responses carry names and times, and no error message quotes a body
 * (the JSON parser's own messages are replaced for these routes). Credential rules name
 * secrets; they are not secret themselves and are shown as stored.
 */
#include <stdlib.h>
#include <string.h>

#include <sodium.h>

#include "core/egress/secrets.h"
#include "native-api/napi_int.h"

static sp_secrets_t *secrets_of(napi_ctx_t *c, sp_err_t *err)
{
    sp_secrets_t *s = sp_svc_secrets(c->n->svc);
    if (s == NULL) {
        sp_err_set(err, SP_EUNAVAIL, "secrets are not available on this server");
        return NULL;
    }
    return sp_secrets_check_enabled(s, err) < 0 ? NULL : s;
}

static json_t *secret_json(const void *rec)
{
    const sp_secret_rec_t *r = rec;
    return json_pack("{s:s,s:s,s:s}", "name", r->name, "created_at", r->created_at, "updated_at",
                     r->updated_at);
}

/* A PUT body (raw for PUT routes): a JSON object, or NULL with err. The parser's message
 * is not used: it quotes the text near the error, which may be a secret. */
static json_t *put_body(napi_ctx_t *c, sp_err_t *err)
{
    h2o_req_t *req = sp_http_hold_req(c->hold);
    json_t *b = NULL;
    if (req == NULL) {
        sp_err_set(err, SP_EINTERNAL, "client gone");
        return NULL;
    }
    if (sp_napi__parse_body(req, true, &b, err) < 0)
        return NULL;
    if (b == NULL || !json_is_object(b)) {
        json_decref(b);
        sp_err_set(err, SP_EINVAL, "request body must be a JSON object");
        return NULL;
    }
    return b;
}

/* Removes the value from a parsed body before it is freed. jansson keeps its own copy of
 * the text; overwriting it in place is the only way to zero that copy. */
static void wipe_value(json_t *b)
{
    json_t *j = b ? json_object_get(b, "value") : NULL;
    if (j != NULL && json_is_string(j))
        sodium_memzero((char *)json_string_value(j), json_string_length(j));
}

/* Zeroes the request body (it held a value) and the parsed copy of the value. */
static void wipe_request(napi_ctx_t *c, json_t *b)
{
    wipe_value(b);
    h2o_req_t *req = sp_http_hold_req(c->hold);
    if (req != NULL && req->entity.base != NULL && req->entity.len > 0)
        sodium_memzero((void *)req->entity.base, req->entity.len);
}

static void on_created(void *arg, const sp_secret_rec_t *rec, const sp_err_t *err)
{
    napi_ctx_t *c = arg;
    if (err != NULL)
        sp_napi__fail(c, err);
    else
        sp_napi__reply(c, 201, secret_json(rec));
}

static void on_replaced(void *arg, const sp_secret_rec_t *rec, const sp_err_t *err)
{
    napi_ctx_t *c = arg;
    if (err != NULL)
        sp_napi__fail(c, err);
    else
        sp_napi__reply(c, 200, secret_json(rec));
}

void sp_napi__secrets_create(napi_ctx_t *c)
{
    sp_err_t e;
    sp_secrets_t *s = secrets_of(c, &e);
    json_t *b = c->body;
    const char *name, *value;
    size_t len;
    if (s == NULL) {
        wipe_request(c, b);
        sp_napi__fail(c, &e);
        return;
    }
    if (sp_napi__body_secret(b, true, &name, &value, &len, &e) < 0) {
        wipe_request(c, b);
        sp_napi__fail(c, &e);
        return;
    }
    int rc = sp_secrets_put(s, c->auth.team_id, name, value, len, false, on_created, c, &e);
    wipe_request(c, b); /* sealed (or refused) inside the call */
    if (rc < 0)
        sp_napi__fail(c, &e);
}

void sp_napi__secrets_put(napi_ctx_t *c)
{
    sp_err_t e;
    sp_secrets_t *s = secrets_of(c, &e);
    json_t *b = s ? put_body(c, &e) : NULL;
    const char *unnamed, *value = NULL;
    size_t len = 0;
    if (b == NULL || sp_napi__body_secret(b, false, &unnamed, &value, &len, &e) < 0) {
        wipe_request(c, b);
        json_decref(b);
        sp_napi__fail(c, &e);
        return;
    }
    const char *name = c->segs[2];
    int rc = sp_secrets_check_name(name, &e) < 0
                 ? sp_err_set(&e, SP_ENOTFOUND, "secret not found")
                 : sp_secrets_put(s, c->auth.team_id, name, value, len, true, on_replaced, c, &e);
    wipe_request(c, b);
    json_decref(b);
    if (rc < 0)
        sp_napi__fail(c, &e);
}

static void on_list(void *arg, const sp_secret_rec_t *recs, size_t n, const sp_err_t *err)
{
    sp_napi__reply_list(arg, err, "secrets", recs, n, sizeof(*recs), secret_json);
}

void sp_napi__secrets_list(napi_ctx_t *c)
{
    sp_err_t e;
    sp_secrets_t *s = secrets_of(c, &e);
    if (s == NULL || sp_secrets_list(s, c->auth.team_id, on_list, c, &e) < 0)
        sp_napi__fail(c, &e);
}

void sp_napi__secrets_delete(napi_ctx_t *c)
{
    sp_err_t e;
    sp_secrets_t *s = secrets_of(c, &e);
    if (s == NULL ||
        sp_secrets_delete(s, c->auth.team_id, c->segs[2], sp_napi__on_deleted, c, &e) < 0)
        sp_napi__fail(c, &e);
}

/* ---- credential rules ---- */

static void on_rules(void *arg, json_t *rules, const sp_err_t *err)
{
    napi_ctx_t *c = arg;
    if (err != NULL)
        sp_napi__fail(c, err);
    else
        sp_napi__reply(c, 200, json_pack("{s:O}", "credentials", rules));
}

void sp_napi__credentials_get(napi_ctx_t *c)
{
    sp_err_t e;
    sp_secrets_t *s = sp_svc_secrets(c->n->svc);
    if (s == NULL) {
        sp_napi__fail(c, (sp_err_set(&e, SP_EUNAVAIL, "secrets are not available"), &e));
        return;
    }
    /* Reading rules needs no master key: they hold names, not values. */
    if (sp_secrets_get_rules(s, c->auth.team_id, c->segs[2], on_rules, c, &e) < 0)
        sp_napi__fail(c, &e);
}

void sp_napi__credentials_put(napi_ctx_t *c)
{
    sp_err_t e;
    sp_secrets_t *s = secrets_of(c, &e);
    json_t *b = s ? put_body(c, &e) : NULL;
    json_t *v = NULL;
    if (b == NULL || sp_napi__body_credentials(b, &v, &e) < 0 ||
        sp_secrets_set_rules(s, c->auth.team_id, c->segs[2], v, on_rules, c, &e) < 0) {
        json_decref(b);
        sp_napi__fail(c, &e);
        return;
    }
    json_decref(b);
}
