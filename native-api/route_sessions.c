/*
 * route_sessions.c - command sessions: /v1/sandboxes/{id}/sessions (control plane, API key)
 * and /v1/attach/{session} (data plane, the session's attach token).
 *
 * Creating a session is the only step that asks the database (team scope, sandbox running);
 * attaching resolves the sandbox's agent channel through the runtime driver and never
 * touches PostgreSQL, so in a multi-host deployment attach_url names the worker that owns
 * the VM (here: this server, as a path). core/channel/session.h owns the table and the process.
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
#define WS_CLOSE_MS    5000u          /* wait this long for the client's close reply */
#define MAX_ATTACH_TTL 3600

/* ---- parsing the create body ---- */

typedef struct {
    sp_exec_cmd_t cmd;
    uint32_t ttl_s;
    char **strs;
    size_t nstrs;
} spec_t;

static void spec_free(spec_t *sp)
{
    if (sp == NULL)
        return;
    for (size_t i = 0; i < sp->nstrs; i++)
        free(sp->strs[i]);
    free(sp->strs);
    free((void *)sp->cmd.argv);
    free((void *)sp->cmd.env);
    free(sp);
}

static void spec_free_v(void *p)
{
    spec_free(p);
}

static const char *keep(spec_t *sp, const char *s, size_t n)
{
    char *d = malloc(n + 1);
    if (d == NULL)
        return NULL;
    memcpy(d, s, n);
    d[n] = '\0';
    sp->strs[sp->nstrs++] = d;
    return d;
}

static int opt_str(json_t *b, const char *key, size_t maxlen, const char **out, sp_err_t *err)
{
    json_t *v = json_object_get(b, key);
    *out = NULL;
    if (v == NULL || json_is_null(v))
        return 0;
    if (!json_is_string(v) || strlen(json_string_value(v)) != json_string_length(v))
        return sp_err_set(err, SP_EINVAL, "%s must be a string without NUL characters", key);
    if (json_string_length(v) > maxlen)
        return sp_err_set(err, SP_EINVAL, "%s is longer than %zu bytes", key, maxlen);
    if (json_string_length(v) == 0)
        return sp_err_set(err, SP_EINVAL, "%s is empty", key);
    *out = json_string_value(v);
    return 0;
}

static int opt_uint(json_t *b, const char *key, long long lo, long long hi, uint32_t *out,
                    sp_err_t *err)
{
    json_t *v = json_object_get(b, key);
    if (v == NULL || json_is_null(v))
        return 0;
    if (!json_is_integer(v) || json_integer_value(v) < lo || json_integer_value(v) > hi)
        return sp_err_set(err, SP_EINVAL, "%s must be an integer from %lld to %lld", key, lo, hi);
    *out = (uint32_t)json_integer_value(v);
    return 0;
}

static spec_t *parse_spec(json_t *b, sp_err_t *err)
{
    static const char *const allowed[] = {"cmd",  "argv", "env",  "cwd",
                                          "user", "pty",  "rows", "cols",
                                          "attach_timeout_s", NULL};
    if (b == NULL) {
        sp_err_set(err, SP_EINVAL, "request body must be a JSON object");
        return NULL;
    }
    const char *cmd, *cwd, *user;
    uint32_t rows = 0, cols = 0, ttl = 0;
    json_t *argv = json_object_get(b, "argv"), *env = json_object_get(b, "env");
    json_t *pty = json_object_get(b, "pty");
    argv = json_is_null(argv) ? NULL : argv;
    env = json_is_null(env) ? NULL : env;
    if (sp_napi__only_keys(b, allowed, err) < 0 || opt_str(b, "cmd", 256 * 1024, &cmd, err) < 0 ||
        opt_str(b, "cwd", SP_EXEC_PATH_MAX, &cwd, err) < 0 ||
        opt_str(b, "user", 63, &user, err) < 0 || opt_uint(b, "rows", 1, 1000, &rows, err) < 0 ||
        opt_uint(b, "cols", 1, 1000, &cols, err) < 0 ||
        opt_uint(b, "attach_timeout_s", 1, MAX_ATTACH_TTL, &ttl, err) < 0 ||
        sp_svc_check_string_map(env, "env", err) < 0)
        return NULL;
    if (pty != NULL && !json_is_null(pty) && !json_is_boolean(pty)) {
        sp_err_set(err, SP_EINVAL, "pty must be true or false");
        return NULL;
    }
    if ((cmd != NULL) == (argv != NULL)) {
        sp_err_set(err, SP_EINVAL, "give exactly one of cmd and argv");
        return NULL;
    }
    if (argv != NULL && (!json_is_array(argv) || json_array_size(argv) == 0 ||
                         json_array_size(argv) > SP_AP_MAX_ARGV)) {
        sp_err_set(err, SP_EINVAL, "argv must be an array of 1 to %d strings", SP_AP_MAX_ARGV);
        return NULL;
    }
    if ((rows || cols) && !json_is_true(pty)) {
        sp_err_set(err, SP_EINVAL, "rows and cols need pty");
        return NULL;
    }
    size_t nargv = argv ? json_array_size(argv) : 0, nenv = env ? json_object_size(env) : 0;
    spec_t *sp = calloc(1, sizeof(*sp));
    if (sp == NULL || (sp->strs = calloc(nargv + nenv + 4, sizeof(char *))) == NULL ||
        (nargv && (sp->cmd.argv = calloc(nargv, sizeof(char *))) == NULL) ||
        (nenv && (sp->cmd.env = calloc(nenv, sizeof(char *))) == NULL)) {
        spec_free(sp);
        sp_err_set(err, SP_EINTERNAL, "out of memory");
        return NULL;
    }
    const char **av = (const char **)sp->cmd.argv, **ev = (const char **)sp->cmd.env;
    for (size_t i = 0; i < nargv; i++) {
        json_t *a = json_array_get(argv, i);
        if (!json_is_string(a) || strlen(json_string_value(a)) != json_string_length(a) ||
            (av[i] = keep(sp, json_string_value(a), json_string_length(a))) == NULL) {
            spec_free(sp);
            sp_err_set(err, SP_EINVAL, "argv must hold strings without NUL characters");
            return NULL;
        }
    }
    sp->cmd.argc = nargv;
    const char *k;
    json_t *v;
    json_object_foreach(env, k, v)
    {
        size_t kl = strlen(k), vl = json_string_length(v);
        char *kv = strchr(k, '=') == NULL ? malloc(kl + vl + 2) : NULL;
        if (kv == NULL) {
            spec_free(sp);
            sp_err_set(err, SP_EINVAL, "env names may not contain '='");
            return NULL;
        }
        memcpy(kv, k, kl);
        kv[kl] = '=';
        memcpy(kv + kl + 1, json_string_value(v), vl);
        kv[kl + 1 + vl] = '\0';
        sp->strs[sp->nstrs++] = kv;
        ev[sp->cmd.envc++] = kv;
    }
    sp->cmd.cmd = cmd ? keep(sp, cmd, strlen(cmd)) : NULL;
    sp->cmd.cwd = cwd ? keep(sp, cwd, strlen(cwd)) : NULL;
    sp->cmd.user = user ? keep(sp, user, strlen(user)) : NULL;
    sp->cmd.pty = json_is_true(pty);
    sp->cmd.rows = rows;
    sp->cmd.cols = cols;
    sp->ttl_s = ttl;
    return sp;
}

/* ---- control plane ---- */

static void create_with_agent(napi_ctx_t *c, sp_agentconn_t *conn)
{
    spec_t *sp = c->data;
    sp_session_spec_t ss = {.team_id = c->auth.team_id, .sandbox_id = c->segs[2],
                            .cmd = &sp->cmd, .attach_timeout_s = sp->ttl_s};
    char token[SP_SESSION_TOKEN_LEN + 1];
    sp_err_t e;
    sp_session_t *s = sp_session_create(c->n->sessions, &ss, token, &e);
    if (s == NULL) {
        sp_napi__fail(c, &e);
        return;
    }
    char url[64];
    snprintf(url, sizeof(url), "/v1/attach/%s", sp_session_id(s));
    json_t *o = sp_session_json(s);
    json_object_set_new(o, "attach_url", json_string(url));
    json_object_set_new(o, "attach_token", json_string(token));
    sodium_memzero(token, sizeof(token));
    sp_napi__reply(c, 201, o);
}

void sp_napi__sessions_create(napi_ctx_t *c)
{
    sp_err_t e;
    spec_t *sp = parse_spec(c->body, &e);
    if (sp == NULL) {
        sp_napi__fail(c, &e);
        return;
    }
    c->data = sp;
    c->data_free = spec_free_v;
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

/* ---- NDJSON attach ---- */

typedef struct {
    sp_http_hold_t *hold; /* until the response starts */
    sp_stream_t *st;
    sp_session_att_t *att;
    char sid[SP_SESSION_ID_LEN + 1];
    uint8_t carry[2][4];
    size_t ncarry[2];
    char *line;
    size_t line_cap;
} ndj_t;

static void ndj_free(ndj_t *n)
{
    free(n->line);
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
    n->st = NULL;
    sp_session_detach(n->att); /* the process keeps running: re-attach replays */
    ndj_free(n);
}

static const sp_stream_cbs_t ndj_cbs = {ndj_sent, ndj_gone};

static int ndj_emit(ndj_t *n, json_t *o, size_t raw)
{
    char *s = o != NULL ? json_dumps(o, JSON_COMPACT) : NULL;
    json_decref(o);
    if (s == NULL)
        return -1;
    size_t len = strlen(s);
    s[len] = '\n'; /* over the NUL: the string is not used as one again */
    int rc = sp_stream_write(n->st, s, len + 1, raw);
    free(s);
    return rc;
}

static int ndj_output(ndj_t *n, int fd, const uint8_t *p, size_t len, bool final)
{
    size_t total = n->ncarry[fd] + len;
    if (total * 4 + 1 > n->line_cap) {
        char *nb = realloc(n->line, total * 4 + 1);
        if (nb == NULL)
            return -1;
        n->line = nb;
        n->line_cap = total * 4 + 1;
    }
    uint8_t *in = (uint8_t *)n->line + total * 3 + 1; /* input staged after the output area */
    memcpy(in, n->carry[fd], n->ncarry[fd]);
    if (len > 0)
        memcpy(in + n->ncarry[fd], p, len);
    size_t used = 0;
    size_t olen = sp_exec_utf8_clean(in, total, n->line, final, &used);
    n->ncarry[fd] = total - used;
    memcpy(n->carry[fd], in + used, n->ncarry[fd]);
    if (olen == 0)
        return sp_stream_write(n->st, "", 0, len);
    json_t *o = json_object();
    json_object_set_new(o, "type", json_string(fd == 0 ? "stdout" : "stderr"));
    json_object_set_new(o, "data", json_stringn_nocheck(n->line, olen));
    return ndj_emit(n, o, len);
}

static json_t *exit_json(const sp_exec_ev_t *ev)
{
    return json_pack("{s:s,s:o,s:o,s:b}", "type", "exit", "exit_code",
                     ev->exited ? json_integer(ev->exit_code) : json_null(), "signal",
                     ev->signal ? json_integer(ev->signal) : json_null(), "timed_out", 0);
}

static json_t *start_json(const sp_exec_ev_t *ev, const char *sid)
{
    char id[16];
    snprintf(id, sizeof(id), "%u", ev->pid);
    return json_pack("{s:s,s:s,s:i,s:s}", "type", "start", "id", id, "pid", (int)ev->pid,
                     "session", sid);
}

static json_t *error_json(const sp_err_t *err)
{
    return json_pack("{s:s,s:{s:s,s:s}}", "type", "error", "error", "code",
                     sp_err_name(err->code), "message", err->msg);
}

static void ndj_event(void *arg, const sp_exec_ev_t *ev)
{
    ndj_t *n = arg;
    if (n->st == NULL) {
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
        n->st = sp_stream_start(req, 200, "application/x-ndjson", -1, &ndj_cbs, n);
        if (n->st == NULL) {
            sp_http_error_code(req, SP_EINTERNAL, "out of memory");
            sp_session_detach(n->att);
            ndj_free(n);
            return;
        }
        sp_exec_ev_t start = *ev;
        ndj_emit(n, start_json(&start, n->sid), 0);
        if (ev->type == SP_EXEC_EV_START)
            return;
    }
    switch (ev->type) {
    case SP_EXEC_EV_START:
        return;
    case SP_EXEC_EV_STDOUT:
    case SP_EXEC_EV_STDERR:
        if (ndj_output(n, ev->type == SP_EXEC_EV_STDOUT ? 0 : 1, ev->data, ev->len, false) < 0) {
            sp_session_detach(n->att);
            sp_stream_end(n->st, NULL, 0, false);
            ndj_free(n);
        }
        return;
    case SP_EXEC_EV_EXIT:
        for (int fd = 0; fd < 2; fd++)
            if (n->ncarry[fd] > 0)
                ndj_output(n, fd, NULL, 0, true);
        ndj_emit(n, exit_json(ev), 0);
        sp_stream_end(n->st, NULL, 0, true);
        ndj_free(n);
        return;
    case SP_EXEC_EV_ERROR:
        ndj_emit(n, error_json(ev->err), 0);
        sp_stream_end(n->st, NULL, 0, true);
        ndj_free(n);
        return;
    }
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
    uint8_t *wbuf;            /* the socket write in flight */
    size_t wcap;
    size_t unacked;           /* output bytes queued to the client, credit not yet given */
    uint8_t *in;              /* stdin not yet taken by the agent: in[in_off, in_len) */
    size_t in_len, in_off, in_cap;
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
    free(w->wbuf);
    free(w->in);
    free(w);
}

/* The WebSocket is gone (peer closed, error, or we close): detach and free. */
static void ws_closed(wsa_t *w)
{
    if (w->ws != NULL) {
        h2o_websocket_close(w->ws);
        w->ws = NULL;
    }
    if (w->att != NULL) {
        sp_session_detach(w->att); /* the process keeps running: re-attach replays */
        w->att = NULL;
    }
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
            wslay_event_send(w->ws->ws_ctx) != 0)
            ws_closed(w);
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
    if (len > w->wcap) {
        uint8_t *nb = realloc(w->wbuf, len);
        if (nb == NULL) {
            wslay_event_set_error(ctx, WSLAY_ERR_CALLBACK_FAILURE);
            return -1;
        }
        w->wbuf = nb;
        w->wcap = len;
    }
    memcpy(w->wbuf, data, len);
    h2o_iovec_t buf = {(char *)w->wbuf, len};
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
    if (w->in_off < w->in_len) {
        long k = sp_session_write(w->att, w->in + w->in_off, w->in_len - w->in_off);
        if (k > 0)
            w->in_off += (size_t)k;
    }
    if (w->in_off == w->in_len) {
        w->in_off = w->in_len = 0;
        if (w->eof_pending) {
            w->eof_pending = false;
            sp_err_t e;
            if (sp_session_eof(w->att, &e) < 0)
                ws_queue_json(w, error_json(&e));
        }
    }
}

static void ws_stdin(wsa_t *w, const uint8_t *p, size_t n)
{
    if (n == 0)
        return;
    if (w->in_off > 0 && w->in_off == w->in_len)
        w->in_off = w->in_len = 0;
    if (w->in_len + n > w->in_cap) {
        if (w->in_off > 0) { /* compact first */
            memmove(w->in, w->in + w->in_off, w->in_len - w->in_off);
            w->in_len -= w->in_off;
            w->in_off = 0;
        }
        size_t cap = w->in_cap ? w->in_cap : 4096;
        while (cap < w->in_len + n)
            cap *= 2;
        uint8_t *nb = cap > w->in_cap ? realloc(w->in, cap) : w->in;
        if (nb == NULL) {
            sp_err_t e;
            sp_err_set(&e, SP_EINTERNAL, "out of memory: stdin dropped");
            ws_queue_json(w, error_json(&e));
            return;
        }
        w->in = nb;
        w->in_cap = cap;
    }
    memcpy(w->in + w->in_len, p, n);
    w->in_len += n;
    ws_feed(w);
    if (w->in_len - w->in_off > WS_STDIN_MAX && !w->paused)
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
        json_t *sv = json_object_get(o, "signal");
        int sig = json_is_integer(sv) && json_integer_value(sv) >= 1 && json_integer_value(sv) <= 64
                      ? (int)json_integer_value(sv)
                      : sp_exec_signal_number(json_string_value(sv));
        if (sig < 0)
            rc = sp_err_set(&e, SP_EINVAL, "signal must be a name like \"SIGINT\" or 1 to 64");
        else
            rc = sp_session_signal(w->att, sig, &e);
    } else {
        rc = sp_err_set(&e, SP_EINVAL, "unknown message type (stdin, eof, resize, signal)");
    }
    json_decref(o);
    if (rc < 0)
        ws_queue_json(w, error_json(&e));
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
    if (w->ws != NULL && w->ws->sock != NULL && w->in_len - w->in_off > WS_STDIN_MAX) {
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
    if (w->paused && w->in_len - w->in_off <= WS_STDIN_MAX / 2) {
        w->paused = false;
        ws_pump(w);
    }
}

static void ws_event(void *arg, const sp_exec_ev_t *ev)
{
    wsa_t *w = arg;
    switch (ev->type) {
    case SP_EXEC_EV_START:
        ws_queue_json(w, start_json(ev, w->sid));
        ws_feed(w); /* stdin that arrived before the start */
        break;
    case SP_EXEC_EV_STDOUT:
    case SP_EXEC_EV_STDERR: {
        uint8_t *m = malloc(ev->len + 1);
        if (m == NULL) {
            sp_err_t e;
            sp_err_set(&e, SP_EINTERNAL, "out of memory");
            sp_session_detach(w->att);
            ws_finish(w, error_json(&e));
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
        ws_finish(w, exit_json(ev));
        break;
    case SP_EXEC_EV_ERROR:
        ws_finish(w, error_json(ev->err));
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

/* ---- GET /v1/attach/{session} ---- */

void sp_napi__attach(sp_napi_t *api, h2o_req_t *req, const char *sid)
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
