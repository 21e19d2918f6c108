/*
 * code.c - code contexts through the guest's code daemon (core/channel/code.h).
 *
 * Owns, per request, one agent TCP_CONNECT stream to the daemon, the request line still to
 * send, the line being received (at most SP_CODE_LINE_MAX bytes) and, for execute, the
 * output events handed to the caller and not yet acknowledged. Also owns the table of
 * daemon starts in progress: one `space-code start` per agent connection at a time, with
 * the requests that wait for it.
 *
 * Flow control: a complete stdout/stderr line is granted back to the agent only once the
 * caller acknowledged its text (sp_code_ack), every other line once it was handed over. The
 * bytes of a line still incomplete are granted only while the caller holds no output (a line
 * may be longer than the agent's window: it is ours to bound, by the line cap). So what the
 * daemon can make the caller hold is one window plus one line, and a slow client stalls the
 * daemon's output in the guest.
 *
 * The daemon runs in the guest and is not trusted: a line that is too long, not JSON, too
 * complex for its size, or has a field of the wrong type ends the request with an error.
 *
 * Re-entrancy (chanop_int.h): every entry from the loop is held; cancel or a terminal
 * delivery marks the op dead (its stream reset at once) and the outermost entry frees it.
 * Knows no HTTP and no database.
 */
#include "core/channel/code.h"

#include <ctype.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "base/buf.h"
#include "base/log.h"
#include "core/channel/chanop_int.h"
#include "core/channel/codeline.h"
#include "core/channel/exec.h"
#include "core/channel/listcap.h"

#define REPLY_MS        150000u /* answer deadline: above the daemon's 120 s kernel start */
#define START_MS        180000u /* `space-code start` */
#define START_CAP (64u * 1024u)

static const char no_interpreter[] =
    "this sandbox's template has no code interpreter (use a template with code_interpreter, "
    "e.g. code-interpreter-v1)";

typedef enum { K_CREATE = 0, K_LIST, K_DELETE, K_RESTART, K_INTERRUPT, K_EXEC } kind_t;

enum phase {
    P_CONNECT = 0, /* TCP_CONNECT sent */
    P_STARTING,    /* refused: waiting for `space-code start` */
    P_TALK,        /* connected: request going out, status line awaited */
    P_EVENTS,      /* execute accepted: event lines */
};

struct ackent {
    size_t text;   /* text bytes the caller still has to acknowledge */
    uint32_t wire; /* agent bytes to grant when it did */
};

struct starter;

struct sp_code_op {
    kind_t kind;
    sp_loop_t *loop;
    sp_agentconn_t *conn;
    sp_chanop_t ch; /* the stream, the lifetime (ch.dead) and credit */
    void *arg;
    sp_code_ctx_cb ctx_cb;
    sp_code_list_cb list_cb;
    sp_code_done_cb done_cb;
    sp_code_event_cb ev_cb;
    enum phase phase;
    bool tried_start;
    struct starter *starter; /* P_STARTING: the start this op waits for */
    sp_code_op_t *next_wait; /* in starter->waiters */
    char *rq;                /* the request line; freed once sent */
    size_t rq_len, rq_off;
    sp_buf_t line;       /* an incomplete line from the daemon */
    size_t line_owed;    /* bytes of it not granted back yet */
    struct ackent *acks; /* ring: output events not yet acknowledged */
    size_t ack_head, ack_n, ack_cap;
    sp_timer_t timer;
};

/* One `space-code start` in progress for an agent connection. The exec op lives on that
 * connection, so when the connection goes away the start fails (SP_EUNAVAIL) and the entry
 * is dropped before the connection's memory could be reused by another. */
struct starter {
    sp_agentconn_t *conn;
    sp_exec_t *run;
    sp_code_op_t *waiters; /* arrival order */
    struct starter *next;
};

static struct starter *starters; /* one loop thread: no lock */

/* ---- configuration ---- */

static uint32_t code_port(void)
{
    static uint32_t port;
    if (port == 0) {
        port = SP_CODE_GUEST_PORT;
        const char *v = getenv("SPACE_CODE_PORT");
        char *end;
        long p = v != NULL && v[0] != '\0' ? strtol(v, &end, 10) : 0;
        if (v != NULL && v[0] != '\0' && *end == '\0' && p >= 1 && p <= 65535)
            port = (uint32_t)p;
    }
    return port;
}

static const char *daemon_path(void)
{
    static const char *path;
    if (path == NULL) {
        const char *v = getenv("SPACE_CODE_DAEMON");
        path = v != NULL && v[0] != '\0' ? v : SP_CODE_DAEMON;
    }
    return path;
}

/* ---- lifetime ---- */

static void unwait(sp_code_op_t *op)
{
    struct starter *st = op->starter;
    if (st == NULL)
        return;
    for (sp_code_op_t **pp = &st->waiters; *pp != NULL; pp = &(*pp)->next_wait) {
        if (*pp == op) {
            *pp = op->next_wait;
            break;
        }
    }
    op->next_wait = NULL;
    op->starter = NULL;
}

static void op_free(void *arg)
{
    sp_code_op_t *op = arg;
    sp_timer_stop(&op->timer);
    unwait(op);
    free(op->rq);
    sp_buf_free(&op->line);
    free(op->acks);
    free(op);
}

/* No more callbacks reach op; it is freed when the outermost entry leaves. */
static void op_kill(sp_code_op_t *op)
{
    sp_chanop__kill(&op->ch);
    sp_timer_stop(&op->timer);
    unwait(op);
}

void sp_code_cancel(sp_code_op_t *op)
{
    if (op != NULL)
        sp_chanop__cancel(&op->ch); /* op_free stops the timer and leaves the start's queue */
}

static void grant(sp_code_op_t *op, size_t n)
{
    sp_chanop__grant(&op->ch, n);
}

/* ---- terminal delivery (always from inside an entry) ---- */

static void deliver_fail(sp_code_op_t *op, const sp_err_t *err)
{
    op_kill(op);
    switch (op->kind) {
    case K_CREATE:
    case K_RESTART:
        op->ctx_cb(op->arg, NULL, err);
        break;
    case K_LIST:
        op->list_cb(op->arg, NULL, 0, false, err);
        break;
    case K_DELETE:
    case K_INTERRUPT:
        op->done_cb(op->arg, err);
        break;
    case K_EXEC: {
        sp_code_ev_t ev = {.type = SP_CODE_EV_FAIL, .execution_count = -1, .err = err};
        op->ev_cb(op->arg, &ev);
        break;
    }
    }
}

static void fail(sp_code_op_t *op, sp_code_t code, const char *msg)
{
    sp_err_t e;
    sp_err_set(&e, code, "%s", msg);
    deliver_fail(op, &e);
}

static void malformed(sp_code_op_t *op, const char *why)
{
    sp_log(SP_LOG_WARN, "code", "daemon sent a bad line kind=%d why=%s", op->kind, why);
    fail(op, SP_EUNAVAIL, "the code interpreter sent a malformed answer");
}

/* A context list past SP_LIST_BYTES_MAX (listcap.h): refused before it is parsed. */
static void list_too_long(sp_code_op_t *op)
{
    sp_log(SP_LOG_WARN, "code", "daemon's context list passed %u bytes", SP_LIST_BYTES_MAX);
    fail(op, SP_EUNAVAIL, "the code interpreter's list of contexts is larger than 4 MiB");
}

/* ---- daemon starts ---- */

static void on_stream_frame(void *arg, uint16_t type, uint16_t flags, const uint8_t *p, size_t len);
static void on_stream_lost(void *arg, const sp_err_t *err);
static void on_stream_writable(void *arg);
static const sp_chanop_ops_t chan_ops = {on_stream_frame, on_stream_lost, on_stream_writable,
                                         op_free};

/* Opens the TCP stream to the daemon; -1 with err when the channel is down. */
static int op_connect(sp_code_op_t *op, sp_err_t *err)
{
    uint8_t buf[32];
    sp_ap_writer_t w;
    sp_ap_writer_init(&w, buf, sizeof(buf));
    sp_ap_put_u32(&w, SP_AP_K_PORT, code_port());
    op->phase = P_CONNECT;
    if (sp_chanop__open(&op->ch, op->conn, SP_AP_T_TCP_CONNECT, buf, w.len, err) < 0)
        return -1;
    sp_timer_start(&op->timer, REPLY_MS);
    return 0;
}

/* What the start's outcome means for the waiters: 0 (connect again) or -1 with e. */
static int start_outcome(const sp_exec_result_t *res, const sp_err_t *err, sp_err_t *e)
{
    if (err != NULL) {
        sp_log(SP_LOG_WARN, "code", "daemon start failed err=%s", err->msg);
        if (err->code == SP_ENOTFOUND)
            return sp_err_set(e, SP_ECONFLICT, "%s", no_interpreter);
        return sp_err_set(e, SP_EUNAVAIL, "the code interpreter could not be started: %.100s",
                          err->msg);
    }
    if (res->timed_out)
        return sp_err_set(e, SP_EUNAVAIL, "the code interpreter did not start within %u s",
                          START_MS / 1000);
    if (res->exited && res->exit_code == 0)
        return 0;
    if (res->exited && res->exit_code == 127)
        return sp_err_set(e, SP_ECONFLICT, "%s", no_interpreter);
    /* The last non-blank line of stderr (else stdout) says why. */
    const uint8_t *o = res->err_len > 0 ? res->err : res->out;
    size_t n = res->err_len > 0 ? res->err_len : res->out_len;
    while (n > 0 && isspace(o[n - 1]))
        n--;
    size_t b = n;
    while (b > 0 && o[b - 1] != '\n')
        b--;
    if (n - b > 100)
        b = n - 100;
    char tail[104];
    sp_codeline_clean((const char *)o + b, n - b, tail, sizeof(tail));
    sp_log(SP_LOG_WARN, "code", "daemon start failed exited=%d code=%d signal=%d tail=%s",
           res->exited, res->exit_code, res->signal, tail);
    if (res->exited)
        return sp_err_set(e, SP_EUNAVAIL, "the code interpreter did not start (exit %d%s%s)",
                          res->exit_code, tail[0] ? ": " : "", tail);
    return sp_err_set(e, SP_EUNAVAIL, "the code interpreter did not start (signal %d%s%s)",
                      res->signal, tail[0] ? ": " : "", tail);
}

static void on_started(void *arg, const sp_exec_result_t *res, const sp_err_t *err)
{
    struct starter *st = arg;
    for (struct starter **pp = &starters; *pp != NULL; pp = &(*pp)->next) {
        if (*pp == st) {
            *pp = st->next;
            break;
        }
    }
    sp_err_t e;
    int rc = start_outcome(res, err, &e);
    sp_code_op_t *list = st->waiters;
    free(st);
    /* Hold every waiter first: one's callback may cancel another. */
    for (sp_code_op_t *w = list; w != NULL; w = w->next_wait) {
        w->starter = NULL;
        sp_chanop__enter(&w->ch);
    }
    while (list != NULL) {
        sp_code_op_t *w = list;
        list = w->next_wait;
        w->next_wait = NULL;
        if (!w->ch.dead) {
            sp_err_t ce;
            if (rc < 0)
                deliver_fail(w, &e);
            else if (op_connect(w, &ce) < 0)
                deliver_fail(w, &ce);
        }
        sp_chanop__leave(&w->ch);
    }
}

/* The daemon is not listening: start it (or join the start in progress), then connect. */
static void need_start(sp_code_op_t *op)
{
    struct starter *st = starters;
    while (st != NULL && st->conn != op->conn)
        st = st->next;
    if (st == NULL) {
        st = calloc(1, sizeof(*st));
        if (st == NULL) {
            fail(op, SP_EINTERNAL, "out of memory");
            return;
        }
        const char *argv[] = {daemon_path(), "start"};
        sp_exec_cmd_t cmd = {.argv = argv, .argc = 2, .timeout_ms = START_MS};
        sp_err_t e;
        st->conn = op->conn;
        st->run = sp_exec_run(op->loop, op->conn, &cmd, START_CAP, on_started, st, &e);
        if (st->run == NULL) {
            free(st);
            sp_err_t fe;
            sp_err_set(&fe, SP_EUNAVAIL, "the code interpreter could not be started: %.100s",
                       e.msg);
            deliver_fail(op, &fe);
            return;
        }
        st->next = starters;
        starters = st;
        sp_log(SP_LOG_INFO, "code", "starting the code daemon");
    }
    op->phase = P_STARTING;
    op->starter = st;
    sp_code_op_t **pp = &st->waiters;
    while (*pp != NULL)
        pp = &(*pp)->next_wait;
    *pp = op;
    sp_timer_stop(&op->timer); /* the start has its own deadline */
}

/* ---- the daemon's answers ---- */

static void on_status(sp_code_op_t *op, json_t *j, size_t wire)
{
    sp_err_t e;
    const char *why = NULL;
    int st = sp_codeline_status(j, &e, &why);
    if (st < 0) {
        malformed(op, why);
        return;
    }
    if (st == 0) {
        deliver_fail(op, &e);
        return;
    }
    sp_code_ctx_t ctx;
    switch (op->kind) {
    case K_CREATE:
    case K_RESTART:
        if (sp_codeline_ctx(json_object_get(j, "context"), &ctx) < 0) {
            malformed(op, "bad context");
            return;
        }
        op_kill(op);
        op->ctx_cb(op->arg, &ctx, NULL);
        return;
    case K_LIST: {
        sp_code_ctx_t *v;
        size_t n;
        int rc = sp_codeline_ctx_list(j, &v, &n, &why);
        if (rc == -2) {
            fail(op, SP_EINTERNAL, "out of memory");
            return;
        }
        if (rc < 0) {
            malformed(op, why);
            return;
        }
        bool truncated = n > SP_LIST_CONTEXTS_MAX;
        op_kill(op);
        op->list_cb(op->arg, v, truncated ? SP_LIST_CONTEXTS_MAX : n, truncated, NULL);
        free(v);
        return;
    }
    case K_DELETE:
    case K_INTERRUPT:
        op_kill(op);
        op->done_cb(op->arg, NULL);
        return;
    case K_EXEC: {
        if (sp_codeline_ctx(json_object_get(j, "context"), &ctx) < 0) {
            malformed(op, "bad context");
            return;
        }
        op->phase = P_EVENTS;
        sp_timer_stop(&op->timer); /* the daemon enforces timeout_ms */
        sp_code_ev_t ev = {.type = SP_CODE_EV_START, .ctx = &ctx, .execution_count = -1};
        op->ev_cb(op->arg, &ev);
        grant(op, wire); /* nothing once the caller cancelled */
        return;
    }
    }
}

static bool ack_push(sp_code_op_t *op, size_t text, size_t wire)
{
    if (op->ack_n == op->ack_cap) {
        size_t cap = op->ack_cap ? op->ack_cap * 2 : 64;
        struct ackent *a = malloc(cap * sizeof(*a));
        if (a == NULL)
            return false;
        for (size_t i = 0; i < op->ack_n; i++)
            a[i] = op->acks[(op->ack_head + i) % op->ack_cap];
        free(op->acks);
        op->acks = a;
        op->ack_cap = cap;
        op->ack_head = 0;
    }
    /* A line is at most SP_CODE_LINE_MAX bytes: its wire count fits 32 bits. */
    op->acks[(op->ack_head + op->ack_n) % op->ack_cap] = (struct ackent){text, (uint32_t)wire};
    op->ack_n++;
    return true;
}

void sp_code_ack(sp_code_op_t *op, size_t n)
{
    if (op == NULL || op->ch.dead)
        return;
    while (n > 0 && op->ack_n > 0) {
        struct ackent *a = &op->acks[op->ack_head];
        size_t take = n < a->text ? n : a->text;
        a->text -= take;
        n -= take;
        if (a->text == 0) {
            uint32_t wire = a->wire;
            op->ack_head = (op->ack_head + 1) % op->ack_cap;
            op->ack_n--;
            grant(op, wire);
        }
    }
    if (op->ack_n == 0 && op->line_owed > 0) { /* the line in progress may need the room */
        grant(op, op->line_owed);
        op->line_owed = 0;
    }
}

static void on_event(sp_code_op_t *op, json_t *j, size_t wire)
{
    sp_code_ev_t ev;
    char now[40];
    const char *why = NULL;
    int rc = sp_codeline_event(j, &ev, now, &why);
    if (rc < 0) {
        malformed(op, why);
        return;
    }
    if (rc > 0) {
        grant(op, wire); /* a newer daemon's event: skipped */
        return;
    }
    if (ev.type == SP_CODE_EV_STDOUT || ev.type == SP_CODE_EV_STDERR) {
        if (ev.len == 0) {
            grant(op, wire);
        } else if (!ack_push(op, ev.len, wire)) {
            fail(op, SP_EINTERNAL, "out of memory");
            return;
        }
        op->ev_cb(op->arg, &ev);
        return;
    }
    if (ev.type == SP_CODE_EV_END) {
        op_kill(op);
        op->ev_cb(op->arg, &ev);
        return;
    }
    op->ev_cb(op->arg, &ev);
    grant(op, wire); /* nothing once the caller cancelled */
}

/* One complete line (without its newline); wire = its agent bytes not granted back yet. */
static void on_line(sp_code_op_t *op, const char *line, size_t len, size_t wire)
{
    json_t *j;
    const char *why = NULL;
    if (sp_codeline_json(line, len, &j, &why) < 0) {
        malformed(op, why);
        return;
    }
    if (j == NULL) { /* blank */
        grant(op, wire);
        return;
    }
    if (op->phase == P_TALK)
        on_status(op, j, wire);
    else
        on_event(op, j, wire);
    json_decref(j);
}

static void on_data(sp_code_op_t *op, const uint8_t *p, size_t n)
{
    size_t off = 0;
    while (off < n && !op->ch.dead) {
        const char *line = NULL;
        size_t len = 0, used = 0;
        switch (sp_codeline_cut(&op->line, p + off, n - off, &line, &len, &used)) {
        case SP_CODELINE_TOOLONG:
            malformed(op, "line longer than 16 MiB");
            return;
        case SP_CODELINE_NOMEM:
            fail(op, SP_EINTERNAL, "out of memory");
            return;
        case SP_CODELINE_HELD:
            if (op->kind == K_LIST && op->line.len > SP_LIST_BYTES_MAX) {
                list_too_long(op);
                return;
            }
            /* Held here until its newline comes. With no output held by the caller, nothing
             * else would give the agent room for the rest of it: credit goes back now. */
            if (op->ack_n == 0)
                grant(op, used);
            else
                op->line_owed += used;
            return;
        case SP_CODELINE_LINE:
            if (op->kind == K_LIST && len > SP_LIST_BYTES_MAX) {
                list_too_long(op);
                return;
            }
            break;
        }
        off += used;
        size_t wire = op->line_owed + used;
        op->line_owed = 0;
        on_line(op, line, len, wire);
        if (!op->ch.dead)
            sp_codeline_trim(&op->line);
    }
}

/* ---- stream callbacks ---- */

static void pump(sp_code_op_t *op)
{
    if (op->ch.s == NULL || op->rq == NULL || op->phase < P_TALK)
        return;
    while (op->rq_off < op->rq_len) {
        size_t n = op->rq_len - op->rq_off;
        size_t credit = sp_agentstream_credit(op->ch.s);
        /* With no credit the send is still tried: only a refused send brings on_writable. */
        if (n > credit && credit > 0)
            n = credit;
        if (n > SP_AP_MAX_DATA)
            n = SP_AP_MAX_DATA;
        int r =
            sp_agentstream_send(op->ch.s, SP_AP_T_DATA, (const uint8_t *)op->rq + op->rq_off, n);
        if (r <= 0)
            return; /* 0: on_writable comes; -1: on_error does */
        op->rq_off += n;
    }
    free(op->rq);
    op->rq = NULL;
}

static void gone(sp_code_op_t *op)
{
    if (op->phase == P_EVENTS)
        fail(op, SP_EUNAVAIL, "the code interpreter went away");
    else
        fail(op, SP_EUNAVAIL, "the code interpreter closed the connection without an answer");
}

static void on_connect_error(sp_code_op_t *op, const uint8_t *p, size_t len)
{
    sp_ap_error_t ae;
    sp_err_t de;
    bool dec = sp_ap_dec_error(p, len, &ae, &de) == 0;
    bool refused = dec && ae.code == SP_AP_E_UNAVAIL;
    char why[104];
    sp_codeline_clean(dec ? ae.msg.p : NULL, dec ? ae.msg.n : 0, why, sizeof(why));
    if (refused && !op->tried_start) {
        op->tried_start = true;
        need_start(op);
        return;
    }
    sp_log(SP_LOG_INFO, "code", "cannot connect to the code daemon port=%u err=%s", code_port(),
           why);
    if (refused) {
        fail(op, SP_EUNAVAIL, "the code interpreter is not answering after it was started");
        return;
    }
    sp_err_t e;
    sp_err_set(&e, SP_EUNAVAIL, "cannot reach the code interpreter%s%s", why[0] ? ": " : "", why);
    deliver_fail(op, &e);
}

/* Stream callbacks: entered and checked alive by chanop.c. */
static void on_stream_frame(void *arg, uint16_t type, uint16_t flags, const uint8_t *p, size_t len)
{
    sp_code_op_t *op = arg;
    switch (type) {
    case SP_AP_T_TCP_CONNECTED:
        if (op->phase == P_CONNECT) {
            op->phase = P_TALK;
            pump(op);
        }
        break;
    case SP_AP_T_DATA:
        if (op->phase >= P_TALK)
            on_data(op, p, len);
        else
            grant(op, len);
        break;
    case SP_AP_T_ERROR:
        if (op->phase == P_CONNECT) {
            on_connect_error(op, p, len);
        } else {
            sp_err_t e;
            sp_exec_agent_error(p, len, &e);
            sp_log(SP_LOG_INFO, "code", "daemon connection failed err=%s", e.msg);
            gone(op);
        }
        break;
    case SP_AP_T_EOF:
    case SP_AP_T_OK:
        gone(op); /* the daemon closed before its answer was complete */
        break;
    default:
        if (flags & SP_AP_F_END)
            gone(op);
        break;
    }
}

static void on_stream_lost(void *arg, const sp_err_t *err)
{
    sp_code_op_t *op = arg;
    sp_log(SP_LOG_INFO, "code", "agent stream lost kind=%d err=%s", op->kind, err->msg);
    if (op->phase == P_EVENTS)
        fail(op, SP_EUNAVAIL, "the code interpreter went away");
    else
        fail(op, SP_EUNAVAIL, "connection to the sandbox agent was lost");
}

static void on_stream_writable(void *arg)
{
    pump(arg);
}

static void on_timer(sp_timer_t *t, void *arg)
{
    sp_code_op_t *op = arg;
    sp_chanop__enter(&op->ch);
    if (!op->ch.dead) {
        sp_log(SP_LOG_WARN, "code", "daemon did not answer kind=%d phase=%d", op->kind, op->phase);
        fail(op, SP_EUNAVAIL, "the code interpreter did not answer in time");
    }
    sp_chanop__leave(&op->ch);
}

/* ---- requests ---- */

/* Sends rq (stolen) as one line on a new connection to the daemon. */
static sp_code_op_t *op_start(sp_loop_t *loop, sp_agentconn_t *c, kind_t kind,
                              const char *sandbox_id, json_t *rq, void *arg, sp_err_t *err)
{
    if (rq == NULL) {
        sp_err_set(err, SP_EINTERNAL, "out of memory");
        return NULL;
    }
    if (loop == NULL || c == NULL) {
        json_decref(rq);
        sp_err_set(err, SP_EUNAVAIL, "sandbox VM is not reachable");
        return NULL;
    }
    if (json_object_set_new(rq, "sandbox_id", json_string(sandbox_id ? sandbox_id : "")) < 0) {
        json_decref(rq);
        sp_err_set(err, SP_EINVAL, "sandbox ID must be UTF-8");
        return NULL;
    }
    char *line = json_dumps(rq, JSON_COMPACT);
    json_decref(rq);
    if (line == NULL) {
        sp_err_set(err, SP_EINTERNAL, "out of memory");
        return NULL;
    }
    size_t n = strlen(line);
    if (n + 1 > SP_CODE_LINE_MAX) {
        free(line);
        sp_err_set(err, SP_ETOOBIG, "the request is larger than 16 MiB");
        return NULL;
    }
    line[n] = '\n'; /* over the NUL: rq_len says where it ends */
    sp_code_op_t *op = calloc(1, sizeof(*op));
    if (op == NULL) {
        free(line);
        sp_err_set(err, SP_EINTERNAL, "out of memory");
        return NULL;
    }
    op->kind = kind;
    op->loop = loop;
    op->conn = c;
    op->arg = arg;
    op->rq = line;
    op->rq_len = n + 1;
    sp_chanop__init(&op->ch, &chan_ops, op);
    sp_timer_init(&op->timer, loop, on_timer, op);
    if (op_connect(op, err) < 0) {
        op_free(op);
        return NULL;
    }
    return op;
}

/* Context IDs as clients give them: 1..SP_CODE_ID_MAX bytes without control characters. */
static bool id_ok(const char *id)
{
    if (id == NULL || id[0] == '\0' || strlen(id) > SP_CODE_ID_MAX)
        return false;
    for (const char *p = id; *p; p++)
        if ((unsigned char)*p < 0x20 || *p == 0x7f)
            return false;
    return true;
}

/* A JSON string of s, or NULL (s NULL: JSON null) with err when it is not UTF-8. */
static json_t *str_or_null(const char *s, const char *what, sp_err_t *err)
{
    if (s == NULL)
        return json_null();
    json_t *v = json_string(s);
    if (v == NULL)
        sp_err_set(err, SP_EINVAL, "%s must be valid UTF-8", what);
    return v;
}

static json_t *ctx_request(const char *opname, const char *context_id, sp_err_t *err)
{
    if (!id_ok(context_id)) {
        sp_err_set(err, SP_ENOTFOUND, "no such context");
        return NULL;
    }
    json_t *id = str_or_null(context_id, "context ID", err);
    if (id == NULL)
        return NULL;
    json_t *rq = json_pack("{s:s,s:o}", "op", opname, "context_id", id);
    if (rq == NULL)
        sp_err_set(err, SP_EINTERNAL, "out of memory");
    return rq;
}

sp_code_op_t *sp_code_create(sp_loop_t *loop, sp_agentconn_t *c, const char *sandbox_id,
                             const char *language, const char *cwd, sp_code_ctx_cb cb, void *arg,
                             sp_err_t *err)
{
    const char *lang = NULL;
    if (language != NULL && (lang = sp_code_language(language)) == NULL) {
        sp_err_set(err, SP_EINVAL, "unsupported language (supported: %s)", SP_CODE_LANGUAGES);
        return NULL;
    }
    if (cwd != NULL && (cwd[0] == '\0' || strlen(cwd) > SP_EXEC_PATH_MAX)) {
        sp_err_set(err, SP_EINVAL, "cwd must be a path of 1 to %u bytes", SP_EXEC_PATH_MAX);
        return NULL;
    }
    json_t *jcwd = str_or_null(cwd, "cwd", err);
    if (jcwd == NULL)
        return NULL;
    json_t *rq = json_pack("{s:s,s:o,s:o}", "op", "create", "language",
                           lang ? json_string(lang) : json_null(), "cwd", jcwd);
    sp_code_op_t *op = op_start(loop, c, K_CREATE, sandbox_id, rq, arg, err);
    if (op != NULL)
        op->ctx_cb = cb;
    return op;
}

sp_code_op_t *sp_code_list(sp_loop_t *loop, sp_agentconn_t *c, const char *sandbox_id,
                           sp_code_list_cb cb, void *arg, sp_err_t *err)
{
    sp_code_op_t *op =
        op_start(loop, c, K_LIST, sandbox_id, json_pack("{s:s}", "op", "list"), arg, err);
    if (op != NULL)
        op->list_cb = cb;
    return op;
}

sp_code_op_t *sp_code_delete(sp_loop_t *loop, sp_agentconn_t *c, const char *sandbox_id,
                             const char *context_id, sp_code_done_cb cb, void *arg, sp_err_t *err)
{
    json_t *rq = ctx_request("delete", context_id, err);
    if (rq == NULL)
        return NULL;
    sp_code_op_t *op = op_start(loop, c, K_DELETE, sandbox_id, rq, arg, err);
    if (op != NULL)
        op->done_cb = cb;
    return op;
}

sp_code_op_t *sp_code_restart(sp_loop_t *loop, sp_agentconn_t *c, const char *sandbox_id,
                              const char *context_id, sp_code_ctx_cb cb, void *arg, sp_err_t *err)
{
    json_t *rq = ctx_request("restart", context_id, err);
    if (rq == NULL)
        return NULL;
    sp_code_op_t *op = op_start(loop, c, K_RESTART, sandbox_id, rq, arg, err);
    if (op != NULL)
        op->ctx_cb = cb;
    return op;
}

sp_code_op_t *sp_code_interrupt(sp_loop_t *loop, sp_agentconn_t *c, const char *sandbox_id,
                                const char *context_id, sp_code_done_cb cb, void *arg,
                                sp_err_t *err)
{
    json_t *rq = ctx_request("interrupt", context_id, err);
    if (rq == NULL)
        return NULL;
    sp_code_op_t *op = op_start(loop, c, K_INTERRUPT, sandbox_id, rq, arg, err);
    if (op != NULL)
        op->done_cb = cb;
    return op;
}

sp_code_op_t *sp_code_execute(sp_loop_t *loop, sp_agentconn_t *c, const char *sandbox_id,
                              const sp_code_exec_req_t *req, sp_code_event_cb cb, void *arg,
                              sp_err_t *err)
{
    if (req->context_id != NULL && req->language != NULL) {
        sp_err_set(err, SP_EINVAL, "give a context ID or a language, not both");
        return NULL;
    }
    if (req->context_id != NULL && !id_ok(req->context_id)) {
        sp_err_set(err, SP_ENOTFOUND, "no such context");
        return NULL;
    }
    const char *lang = NULL;
    if (req->language != NULL && (lang = sp_code_language(req->language)) == NULL) {
        sp_err_set(err, SP_EINVAL, "unsupported language (supported: %s)", SP_CODE_LANGUAGES);
        return NULL;
    }
    if (req->code == NULL && req->code_len > 0) {
        sp_err_set(err, SP_EINVAL, "code is required");
        return NULL;
    }
    if (req->code_len >= SP_CODE_LINE_MAX) {
        sp_err_set(err, SP_ETOOBIG, "code is larger than 16 MiB");
        return NULL;
    }
    json_t *env = json_null();
    if (req->env != NULL && !json_is_null(req->env)) {
        if (!json_is_object(req->env)) {
            sp_err_set(err, SP_EINVAL, "env must be an object of strings");
            return NULL;
        }
        const char *k;
        json_t *v;
        json_object_foreach(req->env, k, v)
        {
            if (!json_is_string(v) || k[0] == '\0' || strchr(k, '=') != NULL) {
                sp_err_set(err, SP_EINVAL, "env must map non-empty names without '=' to strings");
                return NULL;
            }
        }
        env = json_deep_copy(req->env);
    }
    json_t *code = json_stringn(req->code ? req->code : "", req->code_len);
    if (code == NULL) {
        json_decref(env);
        sp_err_set(err, SP_EINVAL, "code must be valid UTF-8");
        return NULL;
    }
    json_t *id = str_or_null(req->context_id, "context ID", err);
    if (id == NULL || env == NULL) {
        json_decref(id);
        json_decref(env);
        json_decref(code);
        if (id != NULL)
            sp_err_set(err, SP_EINTERNAL, "out of memory");
        return NULL;
    }
    json_t *rq = json_pack("{s:s,s:o,s:o,s:o,s:o,s:I}", "op", "execute", "context_id", id,
                           "language", lang ? json_string(lang) : json_null(), "code", code, "env",
                           env, "timeout_ms", (json_int_t)req->timeout_ms);
    sp_code_op_t *op = op_start(loop, c, K_EXEC, sandbox_id, rq, arg, err);
    if (op != NULL)
        op->ev_cb = cb;
    return op;
}
