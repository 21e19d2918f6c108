/*
 * envd_code.c - the E2B code interpreter (port 49999, spec e2b-wire.md section 4) over
 * core/channel/code.h: POST /execute streamed as NDJSON, the /contexts CRUD, GET /health.
 *
 * /execute answers with an HTTP error while the daemon has not accepted the execution (bad
 * input 400, unknown context 404, ...), then 200 and one JSON object per line, in the order
 * the daemon's events come: stdout/stderr, result (the Jupyter MIME bundle renamed to E2B's
 * keys), error, and at the end number_of_executions and end_of_execution; the body ends with
 * the execution. {"type":"keepalive"} goes out after KEEPALIVE_MS without another line.
 * Lines are encoded ASCII-only: the Python SDK splits the body with str.splitlines(), which
 * also breaks at U+0085, U+2028 and U+2029, so those must never appear raw.
 *
 * Flow control: stdout/stderr bytes are acknowledged to core only once h2o took the line that
 * carried them, so a client that does not read holds the output in the guest. A client that
 * leaves cancels the execution (the daemon then interrupts it). HTTP/2 tells us at once; over
 * HTTP/1.x h2o does not read the socket while a response streams, so a write would notice
 * only at the second keepalive after the close: the stream polls its socket for the peer's
 * shutdown (POLLRDHUP) every PROBE_MS instead.
 *
 * Owns nothing past a request. Knows nothing of routing or tokens (gw.c checked them).
 */
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "base/log.h"
#include "core/channel/code.h"
#include "core/channel/exec.h"
#include "e2b-gateway/body.h"
#include "e2b-gateway/connectrpc.h"
#include "e2b-gateway/gw_int.h"

#define KEEPALIVE_MS  5000 /* what the real server uses; the SDK's read gap is 300 s */
#define PROBE_MS      1000 /* HTTP/1.x: how often the socket is checked for the client's close */
#define CODE_MAX_SEGS 4

static size_t path_len(h2o_req_t *req)
{
    return req->query_at != SIZE_MAX ? req->query_at : req->path.len;
}

bool sp_e2b__is_code_path(h2o_req_t *req)
{
    size_t n = path_len(req);
    const char *p = req->path.base;
    return h2o_memis(p, n, H2O_STRLIT("/execute")) || h2o_memis(p, n, H2O_STRLIT("/contexts")) ||
           (n > 10 && memcmp(p, "/contexts/", 10) == 0);
}

static void send_status(h2o_req_t *req, int status, const char *reason)
{
    req->res.status = status;
    req->res.reason = reason;
    h2o_send_inline(req, "", 0);
}

/* The body as a JSON object (e2b-gateway/body.h); NULL (400 sent) when it is not one. Empty:
 * {} if empty_ok. */
static json_t *body_object(h2o_req_t *req, bool empty_ok)
{
    char why[SP_E2B_WHY_MAX];
    json_t *o = sp_e2b__code_body(req->entity.base, req->entity.len, empty_ok, why);
    if (o == NULL)
        sp_e2b__error(req, 400, why);
    return o;
}

/* s (NULL stays NULL) copied into req->pool: it outlives the body it came from. */
static const char *pool_str(h2o_req_t *req, const char *s)
{
    if (s == NULL)
        return NULL;
    size_t n = strlen(s);
    char *d = h2o_mem_alloc_pool(&req->pool, n + 1);
    memcpy(d, s, n + 1);
    return d;
}

/* A context as E2B spells it: {"id", "language", "cwd"}; new, or NULL out of memory. */
static json_t *ctx_json(const sp_code_ctx_t *ctx)
{
    return json_pack("{s:s,s:s,s:s}", "id", ctx->id ? ctx->id : "", "language",
                     ctx->language ? ctx->language : "", "cwd", ctx->cwd ? ctx->cwd : "");
}

/* ---- unary context calls ---- */

typedef struct {
    sp_http_hold_t *hold;
} unary_t;

static unary_t *unary_new(h2o_req_t *req)
{
    sp_http_hold_t *h = sp_http_hold(req, sizeof(unary_t));
    if (h == NULL) {
        sp_e2b__error(req, 500, "out of memory");
        return NULL;
    }
    unary_t *u = sp_http_hold_user(h);
    u->hold = h;
    return u;
}

/* Frees u (it lives in the hold) once its call answered: the request to answer with what the
 * call gave, or NULL when the client left or err was the answer (sent here). */
static h2o_req_t *unary_take(void *arg, const sp_err_t *err)
{
    unary_t *u = arg;
    h2o_req_t *req = sp_http_release(u->hold);
    if (req != NULL && err != NULL) {
        sp_e2b__error_from(req, err);
        return NULL;
    }
    return req;
}

static void on_ctx(void *arg, const sp_code_ctx_t *ctx, const sp_err_t *err)
{
    h2o_req_t *req = unary_take(arg, err);
    if (req != NULL)
        sp_http_json(req, 200, ctx_json(ctx));
}

static void on_done(void *arg, const sp_err_t *err)
{
    h2o_req_t *req = unary_take(arg, err);
    if (req != NULL)
        send_status(req, 204, "No Content");
}

/* restart: any 2xx for the SDK; no body like DELETE. */
static void on_restarted(void *arg, const sp_code_ctx_t *ctx, const sp_err_t *err)
{
    on_done(arg, err);
}

static void on_list(void *arg, const sp_code_ctx_t *ctxs, size_t n, bool truncated,
                    const sp_err_t *err)
{
    h2o_req_t *req = unary_take(arg, err);
    if (req == NULL)
        return;
    json_t *a = json_array();
    for (size_t i = 0; a != NULL && i < n; i++) {
        /* Default contexts too: E2B's server lists every kernel it holds, the default
         * Python one (made at start) and those made on demand for a language. */
        json_array_append_new(a, ctx_json(&ctxs[i]));
    }
    char *s = a ? json_dumps(a, JSON_COMPACT) : NULL;
    json_decref(a);
    if (s == NULL) {
        sp_e2b__error(req, 500, "out of memory");
        return;
    }
    req->res.status = 200;
    req->res.reason = "OK";
    h2o_add_header(&req->pool, &req->res.headers, H2O_TOKEN_CONTENT_TYPE, NULL,
                   H2O_STRLIT("application/json"));
    if (truncated) /* E2B's answer is a bare array: the flag goes in a header */
        h2o_add_header_by_str(&req->pool, &req->res.headers, H2O_STRLIT(SP_LIST_TRUNCATED_HEADER),
                              0, NULL, H2O_STRLIT("true"));
    h2o_send_inline(req, s, strlen(s));
    free(s);
}

/* The call returned NULL: no callback will come; answer here. */
static void unary_started(unary_t *u, sp_code_op_t *op, const sp_err_t *e)
{
    if (op != NULL)
        return;
    unary_take(u, e);
}

static void contexts_create(sp_e2b_t *gw, h2o_req_t *req, const sp_e2b_target_t *t)
{
    json_t *o = body_object(req, true);
    if (o == NULL)
        return;
    const char *language = NULL, *cwd = NULL;
    char why[SP_E2B_WHY_MAX];
    if (sp_e2b__body_code_context(o, &language, &cwd, why) < 0) {
        json_decref(o);
        sp_e2b__error(req, 400, why);
        return;
    }
    language = pool_str(req, language);
    cwd = pool_str(req, cwd);
    json_decref(o);
    unary_t *u = unary_new(req);
    if (u == NULL)
        return;
    sp_err_t e;
    unary_started(
        u,
        sp_code_create(sp_svc_loop(gw->svc), t->conn, t->sandbox_id, language, cwd, on_ctx, u, &e),
        &e);
}

static void contexts_list(sp_e2b_t *gw, h2o_req_t *req, const sp_e2b_target_t *t)
{
    unary_t *u = unary_new(req);
    if (u == NULL)
        return;
    sp_err_t e;
    unary_started(u, sp_code_list(sp_svc_loop(gw->svc), t->conn, t->sandbox_id, on_list, u, &e),
                  &e);
}

/* DELETE /contexts/<id>, or (restart) POST /contexts/<id>/restart. */
static void contexts_end(sp_e2b_t *gw, h2o_req_t *req, const sp_e2b_target_t *t, const char *id,
                         bool restart)
{
    unary_t *u = unary_new(req);
    if (u == NULL)
        return;
    sp_err_t e;
    sp_loop_t *loop = sp_svc_loop(gw->svc);
    unary_started(u,
                  restart ? sp_code_restart(loop, t->conn, t->sandbox_id, id, on_restarted, u, &e)
                          : sp_code_delete(loop, t->conn, t->sandbox_id, id, on_done, u, &e),
                  &e);
}

/* ---- /execute ---- */

typedef struct xc {
    h2o_req_t *req;   /* until the stream starts; NULL once the client left */
    struct xc **hook; /* in req->pool: tells us the client left before the stream */
    sp_code_op_t *op; /* NULL after the terminal event or a cancel */
    sp_stream_t *st;
    sp_timer_t ka;
    sp_timer_t probe;
    int fd;    /* HTTP/1.x: the connection's socket (valid while st is), else -1 */
    int depth; /* inside one of our callbacks: freeing waits */
    bool dead;
    char sandbox_id[65];
} xc_t;

static void xc_free_now(xc_t *x)
{
    sp_timer_stop(&x->ka);
    sp_timer_stop(&x->probe);
    if (x->hook != NULL)
        *x->hook = NULL;
    free(x);
}

/* Frees x now or when the outermost callback returns. */
static void xc_free(xc_t *x)
{
    if (x->depth > 0) {
        x->dead = true;
        return;
    }
    xc_free_now(x);
}

static void xc_enter(xc_t *x)
{
    x->depth++;
}

/* GCC (-O2) cannot see that xc_free() inside a callback only marks x dead while depth > 0,
 * and reports a use after free on the callers' xc_leave(); the depth count is what makes the
 * free happen only here, last. */
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wpragmas"
#pragma GCC diagnostic ignored "-Wunknown-warning-option" /* clang: it has no such warning */
#pragma GCC diagnostic ignored "-Wuse-after-free"
/* false when x was freed. */
static bool xc_leave(xc_t *x)
{
    if (--x->depth == 0 && x->dead) {
        xc_free_now(x);
        return false;
    }
    return !x->dead;
}
#pragma GCC diagnostic pop

static void xc_cancel(xc_t *x)
{
    if (x->op != NULL) {
        sp_code_op_t *op = x->op;
        x->op = NULL;
        sp_code_cancel(op);
    }
}

/* The client left before the stream started (the request's pool is going away). */
static void on_req_gone(void *p)
{
    xc_t *x = *(xc_t **)p;
    if (x == NULL)
        return;
    x->hook = NULL; /* the slot dies with the pool */
    x->req = NULL;
    xc_cancel(x);
    xc_free(x);
}

static void on_sent(void *arg, size_t raw)
{
    xc_t *x = arg;
    if (x->op == NULL)
        return;
    xc_enter(x);
    sp_code_ack(x->op, raw);
    xc_leave(x);
}

static void on_gone(void *arg)
{
    xc_t *x = arg;
    x->st = NULL; /* freed by connectrpc after this call */
    sp_log(SP_LOG_DEBUG, "e2b", "code client left mid-execution sandbox=%s", x->sandbox_id);
    xc_cancel(x);
    xc_free(x);
}

static const sp_stream_cbs_t xc_cbs = {on_sent, on_gone};

/* Ends the body (after the lines written so far) and frees x. */
static void xc_end(xc_t *x, bool ok)
{
    xc_cancel(x);
    if (x->st != NULL) {
        sp_stream_t *st = x->st;
        x->st = NULL;
        sp_stream_end(st, NULL, 0, ok);
    }
    xc_free(x);
}

/* One NDJSON line (o stolen); raw = the stdout/stderr bytes it carries. -1: the stream broke
 * (x is ended and freed). */
static int xc_line(xc_t *x, json_t *o, size_t raw)
{
    if (x->dead || x->st == NULL) { /* the client left inside this callback */
        json_decref(o);
        return -1;
    }
    /* ASCII only (see the top) and compact: never a raw newline inside a line. */
    char *s = o ? json_dumps(o, JSON_COMPACT | JSON_ENSURE_ASCII) : NULL;
    json_decref(o);
    if (s == NULL) {
        sp_log(SP_LOG_WARN, "e2b", "cannot encode a code output line sandbox=%s", x->sandbox_id);
        xc_end(x, false);
        return -1;
    }
    size_t n = strlen(s);
    s[n] = '\n'; /* replaces the NUL: the length below includes the newline */
    int rc = sp_stream_write(x->st, s, n + 1, raw);
    free(s);
    if (rc < 0) {
        xc_end(x, false);
        return -1;
    }
    if (x->st != NULL)
        sp_timer_start(&x->ka, KEEPALIVE_MS);
    return 0;
}

static void on_keepalive(sp_timer_t *t, void *arg)
{
    xc_t *x = arg;
    if (x->st == NULL)
        return;
    xc_enter(x);
    xc_line(x, json_pack("{s:s}", "type", "keepalive"), 0);
    xc_leave(x);
}

/* HTTP/1.x: has the client closed its end? POLLRDHUP sees the FIN even behind bytes nobody
 * read yet (a TLS close_notify). The fd stays valid while x->st is: h2o stops the stream
 * (on_gone) before it closes the connection. */
static void on_probe(sp_timer_t *t, void *arg)
{
    xc_t *x = arg;
    if (x->st == NULL || x->fd < 0)
        return;
    struct pollfd pfd = {.fd = x->fd, .events = POLLRDHUP};
    if (poll(&pfd, 1, 0) > 0 && (pfd.revents & (POLLRDHUP | POLLHUP | POLLERR | POLLNVAL))) {
        sp_log(SP_LOG_DEBUG, "e2b", "code client closed its connection sandbox=%s", x->sandbox_id);
        xc_enter(x);
        xc_end(x, false);
        xc_leave(x);
        return;
    }
    sp_timer_start(&x->probe, PROBE_MS);
}

/* Text as a JSON string; bytes that are not UTF-8 become U+FFFD (the daemon sends UTF-8, but a
 * line must never be lost to one bad byte). Valid text is taken as it is, without a copy. */
static json_t *text_json(const char *p, size_t n)
{
    if (p == NULL)
        return json_string("");
    json_t *s = json_stringn(p, n);
    return s != NULL ? s : sp_exec_json_bytes(p, n);
}

/* text/plain loses one pair of surrounding quotes, as the real server does (a lone quote
 * character becomes ""). */
static json_t *plain_text(json_t *v)
{
    if (!json_is_string(v))
        return json_incref(v);
    const char *s = json_string_value(v);
    size_t n = json_string_length(v);
    if (n >= 1 && (s[0] == '\'' || s[0] == '"') && s[n - 1] == s[0])
        return json_stringn(n >= 2 ? s + 1 : "", n >= 2 ? n - 2 : 0);
    return json_incref(v);
}

/* Jupyter MIME type -> E2B result key (spec 4). */
static const struct {
    const char *mime, *key;
} mime_keys[] = {
    {"text/plain", "text"},        {"text/html", "html"},
    {"text/markdown", "markdown"}, {"image/svg+xml", "svg"},
    {"image/png", "png"},          {"image/jpeg", "jpeg"},
    {"application/pdf", "pdf"},    {"text/latex", "latex"},
    {"application/json", "json"},  {"application/javascript", "javascript"},
    {"e2b/data", "data"},          {"e2b/chart", "chart"},
};

static json_t *result_line(const sp_code_ev_t *ev)
{
    json_t *o = json_pack("{s:s}", "type", "result");
    json_t *extra = json_object();
    if (o == NULL || extra == NULL) {
        json_decref(o);
        json_decref(extra);
        return NULL;
    }
    const char *mime;
    json_t *v;
    json_object_foreach(ev->data, mime, v)
    {
        if (json_is_null(v)) /* the real server drops null fields */
            continue;
        const char *key = NULL;
        for (size_t i = 0; i < sizeof(mime_keys) / sizeof(mime_keys[0]); i++)
            if (strcmp(mime, mime_keys[i].mime) == 0)
                key = mime_keys[i].key;
        if (key == NULL)
            json_object_set(extra, mime, v);
        else if (strcmp(key, "text") == 0)
            json_object_set_new(o, key, plain_text(v));
        else
            json_object_set(o, key, v);
    }
    if (json_object_size(extra) > 0)
        json_object_set_new(o, "extra", extra);
    else
        json_decref(extra);
    json_object_set_new(o, "is_main_result", json_boolean(ev->is_main_result));
    return o;
}

/* The traceback frames as one string, a newline between frames. */
static json_t *traceback_json(json_t *tb)
{
    if (json_is_string(tb))
        return json_incref(tb);
    size_t total = 0, i;
    json_t *f;
    json_array_foreach(tb, i, f) total += json_string_length(f) + 1;
    char *b = malloc(total + 1);
    if (b == NULL)
        return NULL;
    size_t o = 0;
    json_array_foreach(tb, i, f)
    {
        if (!json_is_string(f))
            continue;
        if (o > 0)
            b[o++] = '\n';
        memcpy(b + o, json_string_value(f), json_string_length(f));
        o += json_string_length(f);
    }
    json_t *s = json_stringn(b, o);
    free(b);
    return s;
}

static json_t *error_line(const char *name, const char *value, json_t *traceback)
{
    json_t *o = json_pack("{s:s}", "type", "error");
    if (o == NULL) {
        json_decref(traceback);
        return NULL;
    }
    json_object_set_new(o, "name", text_json(name ? name : "", name ? strlen(name) : 0));
    json_object_set_new(o, "value", text_json(value ? value : "", value ? strlen(value) : 0));
    json_object_set_new(o, "traceback", traceback ? traceback : json_string(""));
    return o;
}

/* Starts the 200 NDJSON response; false when the client is gone (x freed, op cancelled). */
static bool xc_begin(xc_t *x)
{
    if (x->st != NULL)
        return true;
    h2o_req_t *req = x->req;
    x->req = NULL;
    if (x->hook != NULL) {
        *x->hook = NULL; /* the stream reports the client leaving from now on */
        x->hook = NULL;
    }
    if (req != NULL && req->version < 0x200 && req->conn->callbacks->get_socket != NULL) {
        h2o_socket_t *sock = req->conn->callbacks->get_socket(req->conn);
        x->fd = sock != NULL ? h2o_socket_get_fd(sock) : -1;
    }
    if (req != NULL)
        x->st = sp_stream_start(req, 200, "application/x-ndjson", -1, &xc_cbs, x);
    if (x->st == NULL) {
        if (req != NULL)
            sp_e2b__error(req, 500, "out of memory");
        xc_cancel(x);
        xc_free(x);
        return false;
    }
    sp_timer_start(&x->ka, KEEPALIVE_MS);
    if (x->fd >= 0)
        sp_timer_start(&x->probe, PROBE_MS);
    return true;
}

static void xc_event_in(xc_t *x, const sp_code_ev_t *ev)
{
    switch (ev->type) {
    case SP_CODE_EV_START:
        /* A first line now, so the headers go out now: the SDKs start their execution
         * timeout when the response starts, and quiet code would otherwise delay it to the
         * first keepalive. The SDKs ignore keepalive lines. */
        if (xc_begin(x))
            xc_line(x, json_pack("{s:s}", "type", "keepalive"), 0);
        return;
    case SP_CODE_EV_STDOUT:
    case SP_CODE_EV_STDERR: {
        if (!xc_begin(x))
            return;
        json_t *o = json_pack("{s:s}", "type", ev->type == SP_CODE_EV_STDOUT ? "stdout" : "stderr");
        if (o != NULL) {
            json_object_set_new(o, "text", text_json(ev->text, ev->len));
            if (ev->timestamp != NULL)
                json_object_set_new(o, "timestamp", json_string(ev->timestamp));
        }
        xc_line(x, o, ev->len);
        return;
    }
    case SP_CODE_EV_RESULT:
        if (xc_begin(x))
            xc_line(x, result_line(ev), 0);
        return;
    case SP_CODE_EV_ERROR:
        if (xc_begin(x))
            xc_line(x, error_line(ev->name, ev->value, traceback_json(ev->traceback)), 0);
        return;
    case SP_CODE_EV_END:
        x->op = NULL; /* terminal: the op is gone */
        if (!xc_begin(x))
            return;
        if (ev->execution_count >= 0 &&
            xc_line(x,
                    json_pack("{s:s,s:i}", "type", "number_of_executions", "execution_count",
                              ev->execution_count),
                    0) < 0)
            return;
        if (xc_line(x, json_pack("{s:s}", "type", "end_of_execution"), 0) < 0)
            return;
        xc_end(x, true);
        return;
    case SP_CODE_EV_FAIL:
        x->op = NULL;
        if (x->st == NULL) {
            /* Rejected before it ran: a plain HTTP error (404 unknown context, 400, ...). */
            h2o_req_t *req = x->req;
            x->req = NULL;
            if (x->hook != NULL) {
                *x->hook = NULL; /* answered: nothing to cancel when the pool goes */
                x->hook = NULL;
            }
            if (req != NULL)
                sp_e2b__error_from(req, ev->err);
            xc_free(x);
            return;
        }
        /* The daemon went away mid-execution: what the real server says when its kernel
         * connection drops, then the normal end. */
        sp_log(SP_LOG_INFO, "e2b", "code execution ended unexpectedly sandbox=%s err=%s",
               x->sandbox_id, ev->err ? ev->err->msg : "");
        if (xc_line(x,
                    error_line("UnexpectedEndOfExecution",
                               ev->err && ev->err->msg[0]
                                   ? ev->err->msg
                                   : "Connection to the execution was closed before the "
                                     "execution was finished",
                               json_string("")),
                    0) < 0)
            return;
        if (xc_line(x, json_pack("{s:s}", "type", "end_of_execution"), 0) < 0)
            return;
        xc_end(x, true);
        return;
    }
}

static void on_event(void *arg, const sp_code_ev_t *ev)
{
    xc_t *x = arg;
    if (x->dead)
        return;
    xc_enter(x);
    xc_event_in(x, ev);
    xc_leave(x);
}

static void execute(sp_e2b_t *gw, h2o_req_t *req, const sp_e2b_target_t *t)
{
    json_t *o = body_object(req, false);
    if (o == NULL)
        return;
    sp_code_exec_req_t r;
    char why[SP_E2B_WHY_MAX];
    if (sp_e2b__body_code_exec(o, &r, why) < 0) {
        json_decref(o);
        sp_e2b__error(req, 400, why);
        return;
    }
    /* r's strings and env are borrowed from o, which lives until the call copied them */

    xc_t *x = calloc(1, sizeof(*x));
    if (x == NULL) {
        json_decref(o);
        sp_e2b__error(req, 500, "out of memory");
        return;
    }
    x->req = req;
    snprintf(x->sandbox_id, sizeof(x->sandbox_id), "%s", t->sandbox_id);
    x->fd = -1;
    sp_timer_init(&x->ka, sp_svc_loop(gw->svc), on_keepalive, x);
    sp_timer_init(&x->probe, sp_svc_loop(gw->svc), on_probe, x);
    sp_err_t e;
    x->op = sp_code_execute(sp_svc_loop(gw->svc), t->conn, t->sandbox_id, &r, on_event, x, &e);
    json_decref(o); /* env was borrowed for the call only */
    if (x->op == NULL) {
        free(x);
        sp_e2b__error_from(req, &e);
        return;
    }
    x->hook = h2o_mem_alloc_shared(&req->pool, sizeof(*x->hook), on_req_gone);
    *x->hook = x;
}

/* ---- dispatch ---- */

void sp_e2b__code(sp_e2b_t *gw, h2o_req_t *req, const sp_e2b_target_t *t)
{
    const char *segs[CODE_MAX_SEGS];
    int n = sp_http_segments(req, segs, CODE_MAX_SEGS);
    const char *allowed = NULL;
    if (n == 1 && strcmp(segs[0], "health") == 0) {
        if (sp_http_method_is(req, "GET") || sp_http_method_is(req, "HEAD")) {
            req->res.status = 200;
            req->res.reason = "OK";
            h2o_add_header(&req->pool, &req->res.headers, H2O_TOKEN_CONTENT_TYPE, NULL,
                           H2O_STRLIT("application/json"));
            h2o_send_inline(req, H2O_STRLIT("\"OK\""));
            return;
        }
        allowed = "GET";
    } else if (n == 1 && strcmp(segs[0], "execute") == 0) {
        if (sp_http_method_is(req, "POST")) {
            execute(gw, req, t);
            return;
        }
        allowed = "POST";
    } else if (n == 1 && strcmp(segs[0], "contexts") == 0) {
        if (sp_http_method_is(req, "POST")) {
            contexts_create(gw, req, t);
            return;
        }
        if (sp_http_method_is(req, "GET")) {
            contexts_list(gw, req, t);
            return;
        }
        allowed = "GET, POST";
    } else if (n == 2 && strcmp(segs[0], "contexts") == 0) {
        if (sp_http_method_is(req, "DELETE")) {
            contexts_end(gw, req, t, segs[1], false);
            return;
        }
        allowed = "DELETE";
    } else if (n == 3 && strcmp(segs[0], "contexts") == 0 && strcmp(segs[2], "restart") == 0) {
        if (sp_http_method_is(req, "POST")) {
            contexts_end(gw, req, t, segs[1], true);
            return;
        }
        allowed = "POST";
    }
    if (allowed != NULL) {
        h2o_add_header(&req->pool, &req->res.headers, H2O_TOKEN_ALLOW, NULL, allowed,
                       strlen(allowed));
        sp_e2b__error(req, 405, "method not allowed on this path");
        return;
    }
    sp_e2b__error(req, 404, "no such path on the code interpreter");
}
