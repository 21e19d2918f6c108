/*
 * route_contexts.c - /v1/sandboxes/{id}/contexts and .../execute: code contexts (core/channel/code.h),
 * long-lived Python and bash interpreters in the sandbox that keep state between executions.
 *
 * Parses and checks the JSON, resolves the sandbox's agent (sp_napi__with_agent), then hands
 * the work to core/channel/code.h. An execution streams as NDJSON: a "start" line once the daemon
 * accepted it, its events, a "keepalive" line after KEEPALIVE_MS without one, and an "end"
 * line. Output flows daemon -> NDJSON line -> client, and the daemon's bytes are acknowledged
 * to core (sp_code_ack) only after h2o took the line (http/stream.c's on_sent), so a slow client
 * holds the interpreter's output in the guest. A client that leaves cancels the execution's
 * connection, which makes the daemon interrupt it. While an execution streams, the
 * sandbox's activity is recorded every ACTIVITY_MS so the idle limit does not suspend it.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/channel/code.h"
#include "base/log.h"
#include "native-api/napi_int.h"

#define KEEPALIVE_MS  5000u
#define ACTIVITY_MS 30000u

static json_t *ctx_json(const void *rec)
{
    const sp_code_ctx_t *x = rec;
    return json_pack("{s:s,s:s,s:s,s:b}", "id", x->id, "language", x->language, "cwd", x->cwd,
                     "default", x->is_default);
}

static void reply_ctx(napi_ctx_t *c, int status, const sp_code_ctx_t *ctx, const sp_err_t *err)
{
    if (err != NULL) {
        sp_napi__fail(c, err);
        return;
    }
    json_t *o = ctx_json(ctx);
    if (o == NULL) {
        sp_err_t e;
        sp_napi__fail(c, (sp_err_set(&e, SP_EINTERNAL, "cannot encode the context"), &e));
        return;
    }
    sp_napi__reply(c, status, o);
}

static void reply_204(napi_ctx_t *c, const sp_err_t *err)
{
    if (err != NULL) {
        sp_napi__fail(c, err);
        return;
    }
    h2o_req_t *req = sp_napi__take(c);
    if (req == NULL)
        return;
    req->res.status = 204;
    req->res.reason = "No Content";
    h2o_send_inline(req, "", 0);
}

/* ---- POST/GET .../contexts ---- */

static void on_created(void *arg, const sp_code_ctx_t *ctx, const sp_err_t *err)
{
    reply_ctx(arg, 201, ctx, err);
}

static void create_with_agent(napi_ctx_t *c, sp_agentconn_t *conn)
{
    sp_err_t e;
    const char *lang = NULL, *cwd = NULL;
    sp_napi__body_context(c->body, &lang, &cwd, &e); /* checked before: cannot fail */
    if (sp_code_create(sp_napi__loop(c), conn, c->segs[2], lang, cwd, on_created, c, &e) == NULL)
        sp_napi__fail(c, &e);
}

void sp_napi__contexts_create(napi_ctx_t *c)
{
    sp_err_t e;
    const char *lang = NULL, *cwd = NULL;
    if (sp_napi__body_context(c->body, &lang, &cwd, &e) < 0) {
        sp_napi__fail(c, &e);
        return;
    }
    sp_napi__with_agent(c, create_with_agent);
}

static void on_listed(void *arg, const sp_code_ctx_t *ctxs, size_t n, bool truncated,
                      const sp_err_t *err)
{
    napi_ctx_t *c = arg;
    if (err != NULL) {
        sp_napi__fail(c, err);
        return;
    }
    json_t *arr = sp_napi__items(ctxs, n, sizeof(*ctxs), ctx_json);
    json_t *o = arr ? json_pack("{s:o,s:b}", "contexts", arr, "truncated", truncated) : NULL;
    if (o == NULL) {
        sp_err_t e;
        sp_napi__fail(c, (sp_err_set(&e, SP_EINTERNAL, "out of memory"), &e));
        return;
    }
    sp_napi__reply(c, 200, o);
}

static void list_with_agent(napi_ctx_t *c, sp_agentconn_t *conn)
{
    sp_err_t e;
    if (sp_code_list(sp_napi__loop(c), conn, c->segs[2], on_listed, c, &e) == NULL)
        sp_napi__fail(c, &e);
}

void sp_napi__contexts_list(napi_ctx_t *c)
{
    sp_napi__with_agent(c, list_with_agent);
}

/* ---- DELETE .../contexts/{ctx}, POST .../restart and .../interrupt ---- */

static void on_done(void *arg, const sp_err_t *err)
{
    reply_204(arg, err);
}

static void on_restarted(void *arg, const sp_code_ctx_t *ctx, const sp_err_t *err)
{
    reply_ctx(arg, 200, ctx, err);
}

static void delete_with_agent(napi_ctx_t *c, sp_agentconn_t *conn)
{
    sp_err_t e;
    if (sp_code_delete(sp_napi__loop(c), conn, c->segs[2], c->segs[4], on_done, c, &e) == NULL)
        sp_napi__fail(c, &e);
}

static void restart_with_agent(napi_ctx_t *c, sp_agentconn_t *conn)
{
    sp_err_t e;
    if (sp_code_restart(sp_napi__loop(c), conn, c->segs[2], c->segs[4], on_restarted, c, &e) ==
        NULL)
        sp_napi__fail(c, &e);
}

static void interrupt_with_agent(napi_ctx_t *c, sp_agentconn_t *conn)
{
    sp_err_t e;
    if (sp_code_interrupt(sp_napi__loop(c), conn, c->segs[2], c->segs[4], on_done, c, &e) == NULL)
        sp_napi__fail(c, &e);
}

void sp_napi__contexts_delete(napi_ctx_t *c)
{
    sp_napi__with_agent(c, delete_with_agent);
}

static void ctx_action(napi_ctx_t *c, napi_agent_fn next)
{
    sp_err_t e;
    if (sp_napi__body_none(c->body, &e) < 0) {
        sp_napi__fail(c, &e);
        return;
    }
    sp_napi__with_agent(c, next);
}

void sp_napi__contexts_restart(napi_ctx_t *c)
{
    ctx_action(c, restart_with_agent);
}

void sp_napi__contexts_interrupt(napi_ctx_t *c)
{
    ctx_action(c, interrupt_with_agent);
}

/* ---- execute ---- */

/* Fills req from the body (strings borrowed from it); context_id from the path when the
 * route has one (.../contexts/{ctx}/execute rather than .../execute). */
static int parse_exec(napi_ctx_t *c, sp_code_exec_req_t *req, sp_err_t *err)
{
    bool in_context = strcmp(c->segs[3], "contexts") == 0;
    return sp_napi__body_exec(c->body, in_context ? c->segs[4] : NULL, req, err);
}

typedef struct {
    napi_ctx_t *c; /* until the response starts */
    sp_stream_t *st;
    sp_code_op_t *op;
    sp_loop_t *loop;
    sp_timer_t keepalive;
    sp_svc_t *svc; /* activity while streaming */
    sp_auth_t auth;
    char sandbox_id[65];
    uint64_t touched_ms;
} xs_t;

static void xs_free(xs_t *xs)
{
    sp_timer_stop(&xs->keepalive);
    free(xs);
}

static void xs_sent(void *arg, size_t raw)
{
    xs_t *xs = arg;
    sp_code_ack(xs->op, raw);
}

static void xs_gone(void *arg)
{
    xs_t *xs = arg;
    xs->st = NULL;
    sp_code_cancel(xs->op); /* the daemon sees the connection close and interrupts */
    xs_free(xs);
}

static const sp_stream_cbs_t xs_cbs = {xs_sent, xs_gone};

static void touched(void *arg, sp_agentconn_t *conn, const sp_err_t *err)
{
    /* Only the activity mattered; an error here is the next request's business. */
}

/* Records the sandbox's activity at most every ACTIVITY_MS while output streams. */
static void xs_touch(xs_t *xs)
{
    uint64_t now = sp_loop_now_ms(xs->loop);
    if (now - xs->touched_ms < ACTIVITY_MS)
        return;
    xs->touched_ms = now;
    sp_err_t e;
    if (sp_svc_sandbox_agent(xs->svc, &xs->auth, xs->sandbox_id, touched, NULL, &e) < 0)
        sp_log(SP_LOG_INFO, "napi", "activity not recorded sandbox=%s err=%s", xs->sandbox_id,
               e.msg);
}

/* Writes o (stolen) as one line standing for raw daemon bytes; -1 when out of memory. */
static int xs_emit(xs_t *xs, json_t *o, size_t raw)
{
    if (o == NULL)
        return -1;
    int rc = sp_napi__ndjson_line(xs->st, o, raw);
    sp_timer_start(&xs->keepalive, KEEPALIVE_MS);
    xs_touch(xs);
    return rc;
}

/* Cuts the response (the client sees a broken body) and stops the execution. */
static void xs_abort(xs_t *xs)
{
    sp_code_cancel(xs->op);
    sp_stream_end(xs->st, NULL, 0, false);
    xs_free(xs);
}

static void on_keepalive(sp_timer_t *t, void *arg)
{
    xs_t *xs = arg;
    if (xs_emit(xs, json_pack("{s:s}", "type", "keepalive"), 0) < 0)
        xs_abort(xs);
}

static json_t *event_json(const sp_code_ev_t *ev)
{
    switch (ev->type) {
    case SP_CODE_EV_STDOUT:
    case SP_CODE_EV_STDERR:
        return json_pack("{s:s,s:s%,s:s}", "type",
                         ev->type == SP_CODE_EV_STDOUT ? "stdout" : "stderr", "text", ev->text,
                         ev->len, "timestamp", ev->timestamp ? ev->timestamp : "");
    case SP_CODE_EV_RESULT:
        return json_pack("{s:s,s:b,s:O}", "type", "result", "is_main_result", ev->is_main_result,
                         "data", ev->data);
    case SP_CODE_EV_ERROR:
        return json_pack("{s:s,s:s,s:s,s:O}", "type", "error", "name", ev->name, "value", ev->value,
                         "traceback", ev->traceback);
    case SP_CODE_EV_END: {
        json_t *o = json_pack("{s:s,s:s}", "type", "end", "status", ev->status);
        if (o != NULL)
            json_object_set_new(o, "execution_count",
                                ev->execution_count >= 0 ? json_integer(ev->execution_count)
                                                         : json_null());
        return o;
    }
    case SP_CODE_EV_FAIL:
        return json_pack("{s:s,s:s,s:{s:s,s:s}}", "type", "end", "status", "failed", "error",
                         "code", sp_err_name(ev->err->code), "message", ev->err->msg);
    case SP_CODE_EV_START:
        break;
    }
    return NULL;
}

static void xs_event(void *arg, const sp_code_ev_t *ev)
{
    xs_t *xs = arg;
    if (xs->st == NULL) {
        /* Not started: the first event decides between a JSON error and the stream. */
        bool failed = ev->type == SP_CODE_EV_FAIL;
        xs->st = sp_napi__ndjson_begin(xs->c, failed ? ev->err : NULL, &xs_cbs, xs);
        xs->c = NULL;
        if (xs->st == NULL) {
            if (!failed)
                sp_code_cancel(xs->op);
            xs_free(xs);
            return;
        }
        json_t *o = json_pack("{s:s,s:o}", "type", "start", "context",
                              ev->ctx ? ctx_json(ev->ctx) : json_null());
        if (xs_emit(xs, o, 0) < 0) {
            xs_abort(xs);
            return;
        }
        if (ev->type == SP_CODE_EV_START)
            return;
    }
    if (ev->type == SP_CODE_EV_START)
        return;
    bool terminal = ev->type == SP_CODE_EV_END || ev->type == SP_CODE_EV_FAIL;
    size_t raw = ev->type == SP_CODE_EV_STDOUT || ev->type == SP_CODE_EV_STDERR ? ev->len : 0;
    if (xs_emit(xs, event_json(ev), raw) < 0) {
        if (terminal) { /* the op is finished: only the response is left to cut */
            sp_stream_end(xs->st, NULL, 0, false);
            xs_free(xs);
        } else {
            xs_abort(xs);
        }
        return;
    }
    if (terminal) {
        sp_stream_end(xs->st, NULL, 0, true);
        xs_free(xs);
    }
}

static void exec_with_agent(napi_ctx_t *c, sp_agentconn_t *conn)
{
    sp_err_t e;
    sp_code_exec_req_t req;
    if (parse_exec(c, &req, &e) < 0) { /* checked before: cannot fail */
        sp_napi__fail(c, &e);
        return;
    }
    xs_t *xs = calloc(1, sizeof(*xs));
    if (xs == NULL) {
        sp_napi__fail(c, (sp_err_set(&e, SP_EINTERNAL, "out of memory"), &e));
        return;
    }
    xs->c = c;
    xs->loop = sp_napi__loop(c);
    xs->svc = c->n->svc;
    xs->auth = c->auth;
    snprintf(xs->sandbox_id, sizeof(xs->sandbox_id), "%s", c->segs[2]);
    xs->touched_ms = sp_loop_now_ms(xs->loop); /* with_agent just recorded it */
    sp_timer_init(&xs->keepalive, xs->loop, on_keepalive, xs);
    xs->op = sp_code_execute(xs->loop, conn, c->segs[2], &req, xs_event, xs, &e);
    if (xs->op == NULL) {
        xs_free(xs);
        sp_napi__fail(c, &e);
    }
}

/* POST .../execute and .../contexts/{ctx}/execute. */
void sp_napi__execute(napi_ctx_t *c)
{
    sp_err_t e;
    sp_code_exec_req_t req;
    if (parse_exec(c, &req, &e) < 0) {
        sp_napi__fail(c, &e);
        return;
    }
    sp_napi__with_agent(c, exec_with_agent);
}
