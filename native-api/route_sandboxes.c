/*
 * route_sandboxes.c - /v1/templates, /v1/sandboxes (and a sandbox's lifecycle events) and
 * /v1/operations.
 */
#include <stdlib.h>
#include <string.h>

#include "native-api/napi_int.h"
#include "http/json.h"

/* ---- templates ---- */

static json_t *template_item(const void *rec)
{
    return sp_napi__template_json(rec);
}

static void on_templates(void *arg, const sp_template_rec_t *recs, size_t n, const sp_err_t *err)
{
    napi_ctx_t *c = arg;
    if (err == NULL && c->nsegs == 3)
        sp_napi__reply(c, 200, sp_napi__template_json(&recs[0]));
    else
        sp_napi__reply_list(c, err, "templates", recs, n, sizeof(*recs), template_item);
}

void sp_napi__templates_list(napi_ctx_t *c)
{
    sp_err_t e;
    if (sp_svc_templates(c->n->svc, &c->auth, NULL, on_templates, c, &e) < 0)
        sp_napi__fail(c, &e);
}

void sp_napi__templates_get(napi_ctx_t *c)
{
    sp_err_t e;
    if (strlen(c->segs[2]) > 64)
        sp_napi__fail(c, (sp_err_set(&e, SP_ENOTFOUND, "template not found"), &e));
    else if (sp_svc_templates(c->n->svc, &c->auth, c->segs[2], on_templates, c, &e) < 0)
        sp_napi__fail(c, &e);
}

/* ---- operations (and waiting on them) ---- */

static void on_sandbox_after_wait(void *arg, const sp_sandbox_rec_t *sb, const sp_op_rec_t *op,
                                  const sp_err_t *err)
{
    napi_ctx_t *c = arg;
    json_t *o = json_object();
    /* A sandbox that is gone after a finished delete is reported as null. */
    json_object_set_new(o, "sandbox", sb ? sp_napi__sandbox_json(sb) : json_null());
    json_object_set_new(o, "operation", sp_napi__op_json(&c->op));
    bool done = strcmp(c->op.status, "succeeded") == 0 || strcmp(c->op.status, "failed") == 0;
    sp_napi__reply(c, done ? 200 : 202, o);
}

static void on_op(void *arg, const sp_op_rec_t *op, const sp_err_t *err)
{
    napi_ctx_t *c = arg;
    if (err != NULL) {
        sp_napi__fail(c, err);
        return;
    }
    if (c->sandbox_id[0] == '\0') { /* GET /v1/operations/{id} */
        sp_napi__reply(c, 200, sp_napi__op_json(op));
        return;
    }
    /* A lifecycle call with ?wait=: answer with the operation and the sandbox as it is now. */
    c->op = *op;
    sp_err_t e;
    if (sp_svc_get_sandbox(c->n->svc, &c->auth, c->sandbox_id, on_sandbox_after_wait, c, &e) < 0)
        on_sandbox_after_wait(c, NULL, NULL, &e);
}

void sp_napi__operations_get(napi_ctx_t *c)
{
    sp_err_t e;
    if (sp_svc_get_operation(c->n->svc, &c->auth, c->segs[2], c->wait_ms, on_op, c, &e) < 0)
        sp_napi__fail(c, &e);
}

/* After an accepted lifecycle request: answer at once (202) or wait for the outcome. */
static void accepted(napi_ctx_t *c, const sp_sandbox_rec_t *sb, const sp_op_rec_t *op)
{
    if (c->wait_ms == 0) {
        json_t *o = json_object();
        if (sb != NULL)
            json_object_set_new(o, "sandbox", sp_napi__sandbox_json(sb));
        json_object_set_new(o, "operation", sp_napi__op_json(op));
        sp_napi__reply(c, 202, o);
        return;
    }
    snprintf(c->sandbox_id, sizeof(c->sandbox_id), "%s", op->sandbox_id);
    sp_err_t e;
    if (sp_svc_get_operation(c->n->svc, &c->auth, op->id, c->wait_ms, on_op, c, &e) < 0)
        sp_napi__fail(c, &e);
}

/* ---- sandboxes ---- */

static void on_created(void *arg, const sp_sandbox_rec_t *sb, const sp_op_rec_t *op,
                       const sp_err_t *err)
{
    napi_ctx_t *c = arg;
    if (err != NULL) {
        sp_napi__fail(c, err);
        return;
    }
    accepted(c, sb, op);
}

void sp_napi__sandboxes_create(napi_ctx_t *c)
{
    sp_err_t e;
    sp_create_req_t r = {0};
    if (sp_napi__body_create(c->body, &r, &e) < 0 ||
        sp_svc_create_sandbox(c->n->svc, &c->auth, &r, on_created, c, &e) < 0)
        sp_napi__fail(c, &e);
}

static void on_got(void *arg, const sp_sandbox_rec_t *sb, const sp_op_rec_t *op,
                   const sp_err_t *err)
{
    napi_ctx_t *c = arg;
    /* One buffer for every answer: the loop is one thread, and the reply copies it. */
    static sp_buf_t out = SP_BUF_INIT;
    sp_buf_reset(&out);
    if (err != NULL)
        sp_napi__fail(c, err);
    else if (sp_napi__sandbox_write(&out, sb) == 0)
        sp_napi__reply_text(c, 200, &out);
    else
        sp_napi__reply(c, 200, sp_napi__sandbox_json(sb));
    if (out.cap > (1u << 20))
        sp_buf_free(&out);
}

void sp_napi__sandboxes_get(napi_ctx_t *c)
{
    sp_err_t e;
    if (sp_svc_get_sandbox(c->n->svc, &c->auth, c->segs[2], on_got, c, &e) < 0)
        sp_napi__fail(c, &e);
}

static json_t *sandbox_item(const void *rec)
{
    return sp_napi__sandbox_json(rec);
}

static void on_list(void *arg, const sp_sandbox_rec_t *recs, size_t n, const char *next,
                    const sp_err_t *err)
{
    napi_ctx_t *c = arg;
    if (err != NULL) {
        sp_napi__fail(c, err);
        return;
    }
    /* Written straight (sp_napi__sandbox_write), the bytes the jansson page below would give;
     * that page only when a record cannot be. */
    static sp_buf_t out = SP_BUF_INIT;
    sp_buf_reset(&out);
    sp_buf_str(&out, "{\"sandboxes\":[");
    bool ok = true;
    for (size_t i = 0; ok && i < n; i++) {
        if (i > 0)
            sp_buf_add(&out, ",", 1);
        ok = sp_napi__sandbox_write(&out, &recs[i]) == 0;
    }
    sp_buf_str(&out, "],\"next_cursor\":");
    if (ok && next != NULL)
        ok = sp_json_write_str(&out, next) == 0;
    else
        sp_buf_add(&out, "null", 4);
    sp_buf_add(&out, "}", 1);
    if (ok && !out.oom)
        sp_napi__reply_text(c, 200, &out);
    else
        sp_napi__reply_page(c, "sandboxes", sp_napi__items(recs, n, sizeof(*recs), sandbox_item),
                            next);
    if (out.cap > (1u << 20))
        sp_buf_free(&out);
}

void sp_napi__sandboxes_list(napi_ctx_t *c)
{
    h2o_req_t *req = sp_http_hold_req(c->hold);
    sp_err_t e;
    sp_list_req_t r = {.limit = 100};
    const char *state = sp_http_query(req, "state");
    const char *md = sp_http_query(req, "metadata");
    r.cursor = sp_http_query(req, "cursor");
    if (sp_napi__query_int(req, "limit", 1, 1000, &r.limit, &e) < 0) {
        sp_napi__fail(c, &e);
        return;
    }
    if (state != NULL) {
        /* Comma-separated observed states. */
        char buf[256];
        snprintf(buf, sizeof(buf), "%s", state);
        char *save = NULL;
        for (char *s = strtok_r(buf, ",", &save); s; s = strtok_r(NULL, ",", &save)) {
            sp_observed_t o;
            if (sp_observed_parse(s, &o) < 0) {
                sp_napi__fail(c, (sp_err_set(&e, SP_EINVAL, "unknown state '%.32s'", s), &e));
                return;
            }
            r.states |= 1u << o;
        }
        if (r.states == 0) {
            sp_napi__fail(c, (sp_err_set(&e, SP_EINVAL, "state filter is empty"), &e));
            return;
        }
    }
    json_t *filter = NULL;
    if (md != NULL && (filter = sp_svc_metadata_filter(md, &e)) == NULL) {
        sp_napi__fail(c, &e);
        return;
    }
    r.metadata = filter;
    int rc = sp_svc_list_sandboxes(c->n->svc, &c->auth, &r, on_list, c, &e);
    json_decref(filter);
    if (rc < 0)
        sp_napi__fail(c, &e);
}

static void on_requested(void *arg, const sp_op_rec_t *op, const sp_err_t *err)
{
    napi_ctx_t *c = arg;
    if (err != NULL) {
        sp_napi__fail(c, err);
        return;
    }
    accepted(c, NULL, op);
}

void sp_napi__sandboxes_request(napi_ctx_t *c)
{
    sp_err_t e;
    sp_request_t r = SP_REQ_DELETE;
    if (c->nsegs == 4) {
        const char *verb = c->segs[3];
        r = strcmp(verb, "pause") == 0     ? SP_REQ_PAUSE
            : strcmp(verb, "suspend") == 0 ? SP_REQ_SUSPEND
                                           : SP_REQ_WAKE;
    }
    if (sp_napi__body_none(c->body, &e) < 0) {
        sp_napi__fail(c, &e);
        return;
    }
    if (sp_svc_request(c->n->svc, &c->auth, c->segs[2], r, on_requested, c, &e) < 0)
        sp_napi__fail(c, &e);
}

/* ---- lifecycle events: GET /v1/sandboxes/{id}/events ---- */

#define EVENTS_DEFAULT_LIMIT 1000
#define EVENTS_MAX_LIMIT     10000

static json_t *event_json(const void *rec)
{
    const sp_event_rec_t *r = rec;
    return json_pack("{s:I,s:s,s:I,s:s,s:o}", "id", (json_int_t)r->id, "at", r->at, "at_ms",
                     (json_int_t)r->at_ms, "kind", r->kind, "detail",
                     r->detail[0] ? json_string(r->detail) : json_null());
}

static void on_events(void *arg, const sp_event_rec_t *recs, size_t n, const sp_err_t *err)
{
    sp_napi__reply_list(arg, err, "events", recs, n, sizeof(*recs), event_json);
}

/* A non-negative integer query parameter within [lo, hi]; *out keeps its default when absent. */
static int query_range(h2o_req_t *req, const char *name, long long lo, long long hi,
                       long long *out, sp_err_t *err)
{
    const char *v = sp_http_query(req, name);
    if (v == NULL)
        return 0;
    char *end;
    long long x = strtoll(v, &end, 10);
    if (*v == '\0' || *end != '\0' || x < lo || x > hi)
        return sp_err_set(err, SP_EINVAL, "%s must be an integer from %lld to %lld", name, lo, hi);
    *out = x;
    return 0;
}

/* Oldest first, from ?since (epoch milliseconds, inclusive). A follower asks again with the
 * at_ms of the last event it saw and skips the ids it has: events of one millisecond may
 * arrive in two answers. */
void sp_napi__sandboxes_events(napi_ctx_t *c)
{
    h2o_req_t *req = sp_http_hold_req(c->hold);
    if (req == NULL) { /* the client left while we authenticated */
        sp_napi__take(c);
        return;
    }
    sp_err_t e;
    long long since = 0, limit = EVENTS_DEFAULT_LIMIT;
    if (query_range(req, "since", 0, 1LL << 53, &since, &e) < 0 ||
        query_range(req, "limit", 1, EVENTS_MAX_LIMIT, &limit, &e) < 0 ||
        sp_svc_sandbox_events(c->n->svc, &c->auth, c->segs[2], since, (int)limit, on_events, c,
                              &e) < 0)
        sp_napi__fail(c, &e);
}
