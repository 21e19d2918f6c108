/*
 * route_sessions.c - command sessions: /v1/sandboxes/{id}/sessions (control plane, API key)
 * and /v1/attach/{id}/{session} (data plane, the session's attach token).
 *
 * Creating a session is the only step that asks the database (team scope, sandbox running);
 * attaching resolves the sandbox's agent channel through the runtime driver and never
 * touches PostgreSQL. A session lives in the memory of the worker that owns the sandbox (it
 * holds the process's agent stream), and attach_url names the sandbox, so any node forwards
 * the attach there like any other data-plane path (server/server.c), WebSockets included,
 * and the worker checks the token. Why the path and not a table of sessions in PostgreSQL:
 * the owner is already known from the sandbox (one lookup every data-plane path makes), a
 * table would cost a write per session and rows to expire for a process that dies with its
 * worker anyway. The older /v1/attach/{session} still works on the node that holds the
 * session (everywhere else it is unknown: 404). core/channel/session.h owns the table and
 * the process.
 *
 * Attach without an upgrade streams NDJSON events exactly like POST .../commands?stream=true:
 *   {"type":"start","id","pid","session"}, {"type":"stdout"|"stderr","data"}, then
 *   {"type":"exit","exit_code","signal","timed_out"} (or {"type":"error","error":{..}}).
 *
 * Attach with "Upgrade: websocket" (RFC 6455), the framing:
 *   client -> server  binary frame: raw stdin bytes
 *                     text frame: one JSON control message:
 *                       {"type":"stdin","data":"<utf-8 text>"}
 *                       {"type":"eof"}                         close stdin (after queued stdin)
 *                       {"type":"resize","rows":R,"cols":C}    PTY sessions, 1..1000 each
 *                       {"type":"signal","signal":"SIGINT"|2}  to the process group
 *   server -> client  binary frame: 1 channel byte (1 = stdout, 2 = stderr) + raw output bytes
 *                     text frame: JSON events "start", "exit", "error" as in NDJSON; a bad
 *                       control message gets an "error" event and the session goes on
 *                     after "exit" (or a fatal "error") a close frame (1000).
 * Stdin is a pipe only when the first attach (the one that starts the process) is a
 * WebSocket; over plain HTTP it is /dev/null.
 *
 * Flow control: output credit goes back to the agent only once the bytes were written to the
 * client's socket (NDJSON: http/stream.c's on_sent; WebSocket: when wslay's queue has drained and
 * no socket write is pending). Stdin beyond the agent's credit is kept here up to
 * WS_STDIN_MAX; past that the socket is not read until the process takes stdin again.
 */
#include <signal.h>
#include <sodium.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

#include <h2o/websocket.h>

#include "core/channel/exec.h"
#include "base/log.h"
#include "core/channel/session.h"
#include "native-api/napi_int.h"

#define WS_MAX_MSG     (1024 * 1024)  /* bytes per client message */
#define WS_STDIN_MAX   (1024 * 1024)  /* stdin bytes held before we stop reading the socket */
#define WS_CLOSE_MS 5000u             /* wait this long for the client's close reply */

/* The create body: napi_sessspec_t (body.h). */

/* ---- control plane ---- */

static void create_with_agent(napi_ctx_t *c, sp_agentconn_t *conn)
{
    napi_sessspec_t *sp = c->data;
    sp_session_spec_t ss = {.team_id = c->auth.team_id, .sandbox_id = c->segs[2],
                            .cmd = &sp->spec.cmd, .attach_timeout_s = sp->ttl_s};
    char token[SP_SESSION_TOKEN_LEN + 1];
    sp_err_t e;
    sp_session_t *s = sp_session_create(c->n->sessions, &ss, token, &e);
    if (s == NULL) {
        sp_napi__fail(c, &e);
        return;
    }
    /* The sandbox is in the path so that any node can forward the attach to this worker
     * (server/server.c, as for every data-plane path) without knowing the session. */
    char url[160];
    snprintf(url, sizeof(url), "/v1/attach/%s/%s", sp_session_sandbox(s), sp_session_id(s));
    json_t *o = sp_session_json(s);
    json_object_set_new(o, "attach_url", json_string(url));
    json_object_set_new(o, "attach_token", json_string(token));
    sodium_memzero(token, sizeof(token));
    sp_napi__reply(c, 201, o);
}

void sp_napi__sessions_create(napi_ctx_t *c)
{
    sp_err_t e;
    napi_sessspec_t *sp = sp_napi__body_session(c->body, &e);
    if (sp == NULL) {
        sp_napi__fail(c, &e);
        return;
    }
    c->data = sp;
    c->data_free = sp_napi__sessspec_free;
    sp_napi__with_agent(c, create_with_agent);
}

static void on_sandbox_for_list(void *arg, const sp_sandbox_rec_t *sb, const sp_op_rec_t *op,
                                const sp_err_t *err)
{
    napi_ctx_t *c = arg;
    if (err != NULL) {
        sp_napi__fail(c, err);
        return;
    }
    json_t *a = sp_session_list_json(c->n->sessions, c->auth.team_id, c->segs[2]);
    sp_napi__reply(c, 200, json_pack("{s:o}", "sessions", a));
}

void sp_napi__sessions_list(napi_ctx_t *c)
{
    sp_err_t e;
    if (sp_svc_get_sandbox(c->n->svc, &c->auth, c->segs[2], on_sandbox_for_list, c, &e) < 0)
        sp_napi__fail(c, &e);
}

void sp_napi__sessions_get(napi_ctx_t *c)
{
    sp_session_t *s = sp_session_get(c->n->sessions, c->auth.team_id, c->segs[2], c->segs[4]);
    sp_err_t e;
    if (s == NULL)
        sp_napi__fail(c, (sp_err_set(&e, SP_ENOTFOUND, "command session not found"), &e));
    else
        sp_napi__reply(c, 200, sp_session_json(s));
}

void sp_napi__sessions_delete(napi_ctx_t *c)
{
    sp_session_t *s = sp_session_get(c->n->sessions, c->auth.team_id, c->segs[2], c->segs[4]);
    sp_err_t e;
    if (s == NULL) {
        sp_napi__fail(c, (sp_err_set(&e, SP_ENOTFOUND, "command session not found"), &e));
        return;
    }
    sp_driver_t *d = c->n->driver;
    sp_agentconn_t *conn = d != NULL ? d->ops->agent(d, sp_session_sandbox(s)) : NULL;
    json_t *o = json_pack("{s:s,s:b}", "id", sp_session_id(s), "deleted", 1);
    sp_session_remove(c->n->sessions, s, conn);
    sp_napi__reply(c, 200, o);
}

/* ---- NDJSON attach (lines: ndjson.c) ---- */

typedef struct {
    sp_http_hold_t *hold; /* until the response starts */
    sp_session_att_t *att;
    char sid[SP_SESSION_ID_LEN + 1];
    napi_ndjson_t nd;
} ndj_t;

static void ndj_free(ndj_t *n)
{
    sp_napi__nd_clear(&n->nd);
    free(n);
}

static void ndj_sent(void *arg, size_t raw)
{
    ndj_t *n = arg;
    sp_session_ack(n->att, raw);
}

static void ndj_gone(void *arg)
{
    ndj_t *n = arg;
    n->nd.st = NULL;
    sp_session_detach(n->att); /* the process keeps running: re-attach replays */
    ndj_free(n);
}

static const sp_stream_cbs_t ndj_cbs = {ndj_sent, ndj_gone};

static void ndj_event(void *arg, const sp_exec_ev_t *ev)
{
    ndj_t *n = arg;
    if (n->nd.st == NULL) {
        h2o_req_t *req = sp_http_release(n->hold);
        n->hold = NULL;
        if (ev->type == SP_EXEC_EV_ERROR) { /* nothing attached: a plain JSON error */
            if (req != NULL)
                sp_http_error(req, ev->err);
            ndj_free(n);
            return;
        }
        if (req == NULL) { /* the client left before the start */
            sp_session_detach(n->att);
            ndj_free(n);
            return;
        }
        n->nd.st = sp_stream_start(req, 200, "application/x-ndjson", -1, &ndj_cbs, n);
        if (n->nd.st == NULL) {
            sp_http_error_code(req, SP_EINTERNAL, "out of memory");
            sp_session_detach(n->att);
            ndj_free(n);
            return;
        }
        sp_napi__ndjson_line(n->nd.st, sp_napi__start_event(ev->pid, n->sid), 0);
        if (ev->type == SP_EXEC_EV_START)
            return;
    }
    int rc = sp_napi__nd_event(&n->nd, ev);
    if (rc < 0)
        sp_session_detach(n->att);
    if (rc != 0)
        ndj_free(n);
}

static const sp_session_att_cbs_t ndj_att_cbs = {ndj_event, NULL};

static void attach_ndjson(sp_napi_t *api, h2o_req_t *req, sp_session_t *s, sp_agentconn_t *conn)
{
    ndj_t *n = calloc(1, sizeof(*n));
    sp_http_hold_t *h = n != NULL ? sp_http_hold(req, 0) : NULL;
    if (h == NULL) {
        free(n);
        sp_http_error_code(req, SP_EINTERNAL, "out of memory");
        return;
    }
    n->hold = h;
    snprintf(n->sid, sizeof(n->sid), "%s", sp_session_id(s));
    sp_err_t e;
    n->att = sp_session_attach(s, conn, false, &ndj_att_cbs, n, &e);
    if (n->att == NULL) {
        sp_http_release(h);
        ndj_free(n);
        sp_http_error(req, &e);
    }
}

/* ---- WebSocket attach ---- */

typedef struct {
    h2o_websocket_conn_t *ws; /* NULL once closed */
    sp_session_att_t *att;    /* NULL once finished or detached */
    char sid[SP_SESSION_ID_LEN + 1];
    sp_buf_t wbuf;            /* the socket write in flight */
    size_t unacked;           /* output bytes queued to the client, credit not yet given */
    sp_buf_t in;              /* stdin not yet taken by the agent: from in_off on */
    size_t in_off;
    bool eof_pending;
    bool paused;              /* socket reads stopped: too much stdin held */
    bool finished;            /* exit or fatal error queued: close once it was sent */
    bool close_queued;
    int depth;                /* inside h2o_websocket_proceed */
    bool free_pending;
    sp_timer_t pause_timer;   /* stops reads outside h2o's own read path */
    sp_timer_t close_timer;   /* the client does not answer our close */
} wsa_t;

static void wsa_free(wsa_t *w)
{
    sp_timer_stop(&w->pause_timer);
    sp_timer_stop(&w->close_timer);
    sp_buf_free(&w->wbuf);
    sp_buf_free(&w->in);
    free(w);
}

/* Closes the WebSocket and leaves the session (ws_closed's first half). */
static void ws_detach(wsa_t *w)
{
    if (w->ws != NULL) {
        h2o_websocket_close(w->ws);
        w->ws = NULL;
    }
    if (w->att != NULL) {
        sp_session_detach(w->att); /* the process keeps running: re-attach replays */
        w->att = NULL;
    }
}

/* The WebSocket is gone (peer closed, error, or we close): detach and free. */
static void ws_closed(wsa_t *w)
{
    ws_detach(w);
    if (w->depth > 0)
        w->free_pending = true;
    else
        wsa_free(w);
}

static void ws_queue(wsa_t *w, uint8_t opcode, const void *p, size_t n)
{
    if (w->ws == NULL)
        return;
    struct wslay_event_msg m = {.opcode = opcode, .msg = p, .msg_length = n};
    if (wslay_event_queue_msg(w->ws->ws_ctx, &m) != 0)
        sp_log(SP_LOG_INFO, "session", "websocket queue refused session=%s", w->sid);
}

static void ws_queue_json(wsa_t *w, json_t *o)
{
    char *s = o != NULL ? json_dumps(o, JSON_COMPACT) : NULL;
    json_decref(o);
    if (s != NULL)
        ws_queue(w, WSLAY_TEXT_FRAME, s, strlen(s));
    free(s);
}

/* Sends what wslay holds and reads what the client sent (unless paused); grants the agent
 * credit once everything queued was written. Returns false when w was freed. */
static bool ws_pump(wsa_t *w)
{
    if (w->ws == NULL || w->ws->sock == NULL)
        return true; /* before the upgrade completed: h2o proceeds then */
    w->depth++;
    if (w->paused) {
        if (!h2o_socket_is_writing(w->ws->sock) && wslay_event_want_write(w->ws->ws_ctx) &&
            wslay_event_send(w->ws->ws_ctx) != 0) {
            /* ws_closed with depth > 0, spelled out: gcc cannot see that it does not free. */
            ws_detach(w);
            w->free_pending = true;
        }
    } else {
        h2o_websocket_proceed(w->ws); /* may end in ws_closed */
    }
    w->depth--;
    if (w->free_pending) {
        if (w->depth == 0)
            wsa_free(w);
        return false;
    }
    if (w->ws == NULL || w->ws->sock == NULL || wslay_event_want_write(w->ws->ws_ctx))
        return true;
    /* wslay sends control frames before queued messages and drops what is queued once its
     * close went out: the close is queued only after the last event was handed over. */
    if (w->finished && !w->close_queued) {
        w->close_queued = true;
        wslay_event_queue_close(w->ws->ws_ctx, 1000, NULL, 0);
        sp_timer_start(&w->close_timer, WS_CLOSE_MS);
        return ws_pump(w);
    }
    if (!h2o_socket_is_writing(w->ws->sock) && w->unacked > 0) {
        sp_session_ack(w->att, w->unacked);
        w->unacked = 0;
    }
    return true;
}

static void ws_written(h2o_socket_t *sock, const char *err)
{
    h2o_websocket_conn_t *ws = sock->data;
    wsa_t *w = ws->data;
    if (err != NULL) {
        ws_closed(w);
        return;
    }
    ws_pump(w);
}

/* Replaces h2o's send callback: the same single write in flight, but its completion comes
 * here, which is when output credit may go back to the agent. */
static ssize_t ws_send(wslay_event_context_ptr ctx, const uint8_t *data, size_t len, int flags,
                       void *user)
{
    h2o_websocket_conn_t *ws = user;
    wsa_t *w = ws->data;
    if (ws->sock == NULL || h2o_socket_is_writing(ws->sock)) {
        wslay_event_set_error(ctx, WSLAY_ERR_WOULDBLOCK);
        return -1;
    }
    sp_buf_reset(&w->wbuf); /* the last write completed: h2o is not writing */
    sp_buf_add(&w->wbuf, data, len);
    if (w->wbuf.oom) {
        wslay_event_set_error(ctx, WSLAY_ERR_CALLBACK_FAILURE);
        return -1;
    }
    h2o_iovec_t buf = {(char *)w->wbuf.p, len};
    h2o_socket_write(ws->sock, &buf, 1, ws_written);
    return (ssize_t)len;
}

static void ws_finish(wsa_t *w, json_t *last)
{
    ws_queue_json(w, last);
    w->finished = true; /* ws_pump queues the close after it */
    w->att = NULL;
    sp_timer_start(&w->close_timer, WS_CLOSE_MS);
}

/* Hands held stdin to the agent as its credit allows; EOF after the last byte. */
static void ws_feed(wsa_t *w)
{
    if (w->att == NULL)
        return;
    if (w->in_off < w->in.len) {
        long k = sp_session_write(w->att, w->in.p + w->in_off, w->in.len - w->in_off);
        if (k > 0)
            w->in_off += (size_t)k;
    }
    if (w->in_off == w->in.len) {
        sp_buf_reset(&w->in);
        w->in_off = 0;
        if (w->eof_pending) {
            w->eof_pending = false;
            sp_err_t e;
            if (sp_session_eof(w->att, &e) < 0)
                ws_queue_json(w, sp_napi__error_event(&e));
        }
    }
}

static void ws_stdin(wsa_t *w, const uint8_t *p, size_t n)
{
    if (n == 0)
        return;
    if (w->in_off > 0 && w->in.len + n >= w->in.cap) { /* drop what was taken before growing */
        sp_buf_consume(&w->in, w->in_off);
        w->in_off = 0;
    }
    sp_buf_add(&w->in, p, n);
    if (w->in.oom) {
        /* This message is lost; what is held stays, and later stdin is taken again. */
        w->in.oom = false;
        sp_err_t e;
        sp_err_set(&e, SP_EINTERNAL, "out of memory: stdin dropped");
        ws_queue_json(w, sp_napi__error_event(&e));
        return;
    }
    ws_feed(w);
    if (w->in.len - w->in_off > WS_STDIN_MAX && !w->paused)
        sp_timer_start(&w->pause_timer, 0); /* not from inside h2o's read path */
}

static void ws_control(wsa_t *w, const uint8_t *p, size_t n)
{
    sp_err_t e;
    json_error_t je;
    json_t *o = json_loadb((const char *)p, n, 0, &je);
    const char *type = json_string_value(json_object_get(o, "type"));
    int rc = 0;
    if (type == NULL) {
        rc = sp_err_set(&e, SP_EINVAL, "text messages are JSON objects with a \"type\"");
    } else if (w->att == NULL) {
        rc = sp_err_set(&e, SP_ECONFLICT, "the command is no longer attached");
    } else if (strcmp(type, "stdin") == 0) {
        json_t *d = json_object_get(o, "data");
        if (!json_is_string(d))
            rc = sp_err_set(&e, SP_EINVAL, "stdin wants a string \"data\"");
        else
            ws_stdin(w, (const uint8_t *)json_string_value(d), json_string_length(d));
    } else if (strcmp(type, "eof") == 0) {
        w->eof_pending = true;
        ws_feed(w);
    } else if (strcmp(type, "resize") == 0) {
        json_t *r = json_object_get(o, "rows"), *c = json_object_get(o, "cols");
        if (!json_is_integer(r) || !json_is_integer(c) || json_integer_value(r) < 1 ||
            json_integer_value(r) > 1000 || json_integer_value(c) < 1 ||
            json_integer_value(c) > 1000)
            rc = sp_err_set(&e, SP_EINVAL, "resize wants integer rows and cols from 1 to 1000");
        else
            rc = sp_session_resize(w->att, (uint32_t)json_integer_value(r),
                                   (uint32_t)json_integer_value(c), &e);
    } else if (strcmp(type, "signal") == 0) {
        int sig = sp_napi__signal(json_object_get(o, "signal"));
        if (sig < 0)
            rc = sp_err_set(&e, SP_EINVAL, "signal must be a name like \"SIGINT\" or 1 to 64");
        else
            rc = sp_session_signal(w->att, sig, &e);
    } else {
        rc = sp_err_set(&e, SP_EINVAL, "unknown message type (stdin, eof, resize, signal)");
    }
    json_decref(o);
    if (rc < 0)
        ws_queue_json(w, sp_napi__error_event(&e));
}

/* From wslay, inside h2o_websocket_proceed: never close or proceed from here. */
static void ws_msg(h2o_websocket_conn_t *ws, const struct wslay_event_on_msg_recv_arg *arg)
{
    wsa_t *w = ws->data;
    if (arg == NULL) {
        ws_closed(w);
        return;
    }
    if (arg->opcode == WSLAY_BINARY_FRAME) {
        if (w->att != NULL)
            ws_stdin(w, arg->msg, arg->msg_length);
    } else if (arg->opcode == WSLAY_TEXT_FRAME) {
        ws_control(w, arg->msg, arg->msg_length);
    }
}

static void ws_pause(sp_timer_t *t, void *arg)
{
    wsa_t *w = arg;
    if (w->ws != NULL && w->ws->sock != NULL && w->in.len - w->in_off > WS_STDIN_MAX) {
        w->paused = true;
        h2o_socket_read_stop(w->ws->sock);
    }
}

static void ws_close_timeout(sp_timer_t *t, void *arg)
{
    ws_closed(arg); /* from the loop: no h2o frame of this connection is running */
}

static void ws_writable(void *arg)
{
    wsa_t *w = arg;
    ws_feed(w);
    if (w->paused && w->in.len - w->in_off <= WS_STDIN_MAX / 2) {
        w->paused = false;
        ws_pump(w);
    }
}

static void ws_event(void *arg, const sp_exec_ev_t *ev)
{
    wsa_t *w = arg;
    switch (ev->type) {
    case SP_EXEC_EV_START:
        ws_queue_json(w, sp_napi__start_event(ev->pid, w->sid));
        ws_feed(w); /* stdin that arrived before the start */
        break;
    case SP_EXEC_EV_STDOUT:
    case SP_EXEC_EV_STDERR: {
        uint8_t *m = malloc(ev->len + 1);
        if (m == NULL) {
            sp_err_t e;
            sp_err_set(&e, SP_EINTERNAL, "out of memory");
            sp_session_detach(w->att);
            ws_finish(w, sp_napi__error_event(&e));
            break;
        }
        m[0] = ev->type == SP_EXEC_EV_STDOUT ? 1 : 2;
        memcpy(m + 1, ev->data, ev->len);
        ws_queue(w, WSLAY_BINARY_FRAME, m, ev->len + 1);
        free(m);
        w->unacked += ev->len;
        break;
    }
    case SP_EXEC_EV_EXIT:
        ws_finish(w, sp_napi__exit_event(ev));
        break;
    case SP_EXEC_EV_ERROR:
        ws_finish(w, sp_napi__error_event(ev->err));
        break;
    }
    ws_pump(w);
}

static const sp_session_att_cbs_t ws_att_cbs = {ws_event, ws_writable};

static void attach_ws(sp_napi_t *api, h2o_req_t *req, const char *client_key, sp_session_t *s,
                      sp_agentconn_t *conn)
{
    wsa_t *w = calloc(1, sizeof(*w));
    if (w == NULL) {
        sp_http_error_code(req, SP_EINTERNAL, "out of memory");
        return;
    }
    snprintf(w->sid, sizeof(w->sid), "%s", sp_session_id(s));
    sp_loop_t *loop = sp_svc_loop(api->svc);
    sp_timer_init(&w->pause_timer, loop, ws_pause, w);
    sp_timer_init(&w->close_timer, loop, ws_close_timeout, w);
    sp_err_t e;
    w->att = sp_session_attach(s, conn, true, &ws_att_cbs, w, &e);
    if (w->att == NULL) {
        wsa_free(w);
        sp_http_error(req, &e);
        return;
    }
    /* The attachment's callbacks come from the loop, after this handler returned: by then
     * w->ws is set (events before the upgrade completed wait in wslay's queue). */
    w->ws = h2o_upgrade_to_websocket(req, client_key, w, ws_msg);
    struct wslay_event_callbacks cbs = w->ws->ws_callbacks;
    cbs.send_callback = ws_send;
    wslay_event_config_set_callbacks(w->ws->ws_ctx, &cbs);
    wslay_event_config_set_max_recv_msg_length(w->ws->ws_ctx, WS_MAX_MSG);
}

/* ---- GET /v1/attach/{id}/{session}, GET /v1/attach/{session} ---- */

void sp_napi__attach(sp_napi_t *api, h2o_req_t *req, const char *sandbox, const char *sid)
{
    const char *authz = sp_http_header(req, "authorization");
    const char *token = NULL;
    if (authz != NULL && strncasecmp(authz, "Bearer ", 7) == 0)
        token = authz + 7;
    if (token == NULL)
        token = sp_http_query(req, "token");
    if (token == NULL || token[0] == '\0') {
        sp_http_error_code(req, SP_EAUTH, "the session's attach token is required");
        return;
    }
    sp_err_t e;
    sp_session_t *s = sp_session_authorize(api->sessions, sid, token, &e);
    if (s != NULL && sandbox != NULL && strcmp(sp_session_sandbox(s), sandbox) != 0) {
        s = NULL; /* another sandbox's session: as unknown as any (the path routed it here) */
        sp_err_set(&e, SP_ENOTFOUND, "command session not found or expired");
    }
    if (s == NULL) {
        sp_http_error(req, &e);
        return;
    }
    sp_driver_t *d = api->driver;
    sp_agentconn_t *conn = d != NULL ? d->ops->agent(d, sp_session_sandbox(s)) : NULL;
    if (conn == NULL) {
        sp_http_error_code(req, SP_EUNAVAIL, "sandbox VM is not reachable (paused or stopped?)");
        return;
    }
    const char *client_key = NULL;
    if (req->version < 0x200 && h2o_is_websocket_handshake(req, &client_key) == 0 &&
        client_key != NULL)
        attach_ws(api, req, client_key, s, conn);
    else
        attach_ndjson(api, req, s, conn);
}
