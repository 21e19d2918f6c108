/*
 * exec.c - commands and files over a sandbox's agent channel (core/channel/exec.h).
 *
 * Owns one agent stream per operation and what the operation must keep: stdin bytes still
 * to send, collected output of sp_exec_run (capped), a directory listing (capped). Output
 * is never buffered here: it is handed to the caller straight from the channel's frame
 * buffer, and credit goes back to the agent only through sp_exec_ack, so a slow consumer
 * slows the guest instead of growing our memory.
 *
 * Re-entrancy and credit: chanop_int.h. Every entry from the loop (stream callbacks,
 * timers) is held; a cancel or a terminal callback inside it marks the operation dead (its
 * stream reset at once) and the outermost entry frees it. Knows no HTTP.
 */
#include "core/channel/exec.h"

#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <time.h>

#include "base/buf.h"
#include "base/log.h"
#include "core/channel/chanop_int.h"

typedef enum { K_STREAM, K_RUN, K_SPAWN, K_LIST, K_CTRL, K_FS, K_READ, K_WRITE, K_WATCH } kind_t;

struct sp_exec {
    kind_t kind;
    sp_loop_t *loop;
    sp_agentconn_t *conn;
    sp_chanop_t ch; /* the stream, the lifetime (ch.dead) and credit */
    void *arg;
    sp_timer_t timer; /* timeout_ms, reply deadline or idle limit */
    sp_timer_t grace; /* after a timeout's SIGKILL */

    /* processes */
    sp_exec_event_cb ev_cb;
    uint32_t pid;
    bool started;
    bool timed_out;
    uint8_t *in_buf; /* stdin still to send: in_buf[in_off, in_len) */
    size_t in_len, in_off;
    bool in_eof, in_eof_sent;

    /* sp_exec_run */
    sp_exec_result_cb run_cb;
    size_t cap;
    sp_buf_t out, err;
    bool out_tr, err_tr;

    void (*spawn_cb)(void *arg, uint32_t pid, const sp_err_t *err);

    /* list (K_LIST) and the first phase of K_CTRL */
    sp_exec_list_cb list_cb;
    json_t *items;
    size_t list_bytes; /* the agent's bytes read for the listing (listcap.h) */

    /* K_CTRL: stdin or signal on a running process */
    sp_exec_done_cb done_cb;
    bool is_signal;
    bool is_resize;
    uint32_t rows, cols;
    int sig;
    bool group;
    int phase; /* 0: listing, 1: attached */
    bool found, running;

    /* files */
    void (*fs_cb)(void *arg, json_t *result, const sp_err_t *err);
    sp_exec_fsop_t fsop;
    bool truncated;
    sp_exec_read_cbs_t rcbs;
    uint64_t total;
    sp_exec_write_cbs_t wcbs;
    bool write_failed;
    sp_exec_watch_cbs_t watch_cbs;
};

/* ---- helpers ---- */

size_t sp_exec_utf8_clean(const uint8_t *in, size_t n, char *out, bool final, size_t *consumed)
{
    size_t i = 0, o = 0;
    while (i < n) {
        uint8_t c = in[i];
        if (c < 0x80) {
            out[o++] = (char)c;
            i++;
            continue;
        }
        size_t need = 0;
        uint32_t min = 0, cp = 0;
        if ((c & 0xE0) == 0xC0) {
            need = 1;
            cp = c & 0x1F;
            min = 0x80;
        } else if ((c & 0xF0) == 0xE0) {
            need = 2;
            cp = c & 0x0F;
            min = 0x800;
        } else if ((c & 0xF8) == 0xF0) {
            need = 3;
            cp = c & 0x07;
            min = 0x10000;
        }
        bool ok = need > 0;
        size_t k = 1;
        for (; ok && k <= need && i + k < n; k++) {
            if ((in[i + k] & 0xC0) != 0x80)
                ok = false;
            else
                cp = (cp << 6) | (in[i + k] & 0x3F);
        }
        if (ok && i + need >= n) { /* the sequence runs past the end */
            if (!final)
                break;
            ok = false;
        }
        if (ok && (cp < min || cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF)))
            ok = false;
        if (!ok) {
            out[o++] = (char)0xEF;
            out[o++] = (char)0xBF;
            out[o++] = (char)0xBD;
            i++;
            continue;
        }
        memcpy(out + o, in + i, need + 1);
        o += need + 1;
        i += need + 1;
    }
    if (consumed != NULL)
        *consumed = i;
    return o;
}

json_t *sp_exec_json_bytes(const void *p, size_t n)
{
    char *buf = malloc(3 * n + 1);
    if (buf == NULL)
        return NULL;
    size_t len = sp_exec_utf8_clean(p, n, buf, true, NULL);
    json_t *s = json_stringn_nocheck(buf, len);
    free(buf);
    return s;
}

static json_t *json_sv(sp_ap_str_t s)
{
    return s.p ? sp_exec_json_bytes(s.p, s.n) : json_null();
}

/* json_sv of at most SP_LIST_STR_MAX bytes of s; *cut set when it had more. */
static json_t *json_sv_cap(sp_ap_str_t s, bool *cut)
{
    if (s.p != NULL && s.n > SP_LIST_STR_MAX) {
        s.n = SP_LIST_STR_MAX;
        *cut = true;
    }
    return json_sv(s);
}

/* Counts one list frame of n bytes: false (the list ends here, truncated) when the listing
 * already holds SP_LIST_ENTRIES_MAX entries or the agent's bytes would pass
 * SP_LIST_BYTES_MAX. */
static bool list_room(sp_exec_t *op, size_t n)
{
    op->list_bytes += n;
    return json_array_size(op->items) < SP_LIST_ENTRIES_MAX && op->list_bytes <= SP_LIST_BYTES_MAX;
}

static void iso_time(uint64_t ns, char out[40])
{
    time_t t = (time_t)(ns / 1000000000u);
    struct tm tm;
    gmtime_r(&t, &tm);
    char base[32];
    strftime(base, sizeof(base), "%Y-%m-%dT%H:%M:%S", &tm);
    snprintf(out, 40, "%s.%03uZ", base, (unsigned)((ns / 1000000u) % 1000u));
}

void sp_exec_agent_error(const uint8_t *p, size_t n, sp_err_t *out)
{
    sp_ap_error_t e;
    sp_err_t derr;
    if (sp_ap_dec_error(p, n, &e, &derr) < 0) {
        sp_err_set(out, SP_EINTERNAL, "sandbox agent sent a malformed error");
        return;
    }
    char msg[128];
    size_t k = 0;
    for (uint32_t i = 0; e.msg.p != NULL && i < e.msg.n && k < sizeof(msg) - 1; i++) {
        char ch = e.msg.p[i];
        msg[k++] = (ch >= 0x20 && ch < 0x7f) ? ch : '?';
    }
    msg[k] = '\0';
    sp_code_t code;
    switch (e.code) {
    case SP_AP_E_NOTFOUND:
        code = SP_ENOTFOUND;
        break;
    case SP_AP_E_PERM:
        code = SP_EFORBIDDEN;
        break;
    case SP_AP_E_EXISTS:
    case SP_AP_E_BUSY:
        code = SP_ECONFLICT;
        break;
    case SP_AP_E_INVAL:
    case SP_AP_E_NOTDIR:
    case SP_AP_E_ISDIR:
        code = SP_EINVAL;
        break;
    case SP_AP_E_TOOBIG:
        code = SP_ETOOBIG;
        break;
    case SP_AP_E_UNAVAIL:
        code = SP_EUNAVAIL;
        break;
    default:
        code = SP_EINTERNAL;
        break;
    }
    const char *what = e.code == SP_AP_E_NOTFOUND  ? "not found"
                       : e.code == SP_AP_E_PERM    ? "permission denied"
                       : e.code == SP_AP_E_EXISTS  ? "already exists"
                       : e.code == SP_AP_E_NOTDIR  ? "not a directory"
                       : e.code == SP_AP_E_ISDIR   ? "is a directory"
                       : e.code == SP_AP_E_TOOBIG  ? "too large or no space left"
                       : e.code == SP_AP_E_BUSY    ? "busy"
                       : e.code == SP_AP_E_INVAL   ? "invalid argument"
                                                   : "sandbox agent error";
    if (k > 0)
        sp_err_set(out, code, "%s: %s", what, msg);
    else
        sp_err_set(out, code, "%s", what);
}

int sp_exec_proc_exit(const uint8_t *p, size_t n, sp_exec_ev_t *ev)
{
    int32_t code = 0;
    uint32_t sig = 0;
    sp_ap_field_t f;
    bool exited = sp_ap_find(p, n, SP_AP_K_EXIT_CODE, &f) == 1;
    if (sp_ap_get_i32(p, n, SP_AP_K_EXIT_CODE, &code) < 0 ||
        sp_ap_get_u32(p, n, SP_AP_K_SIGNAL, &sig) < 0 || sig > 64)
        return -1;
    *ev = (sp_exec_ev_t){.type = SP_EXEC_EV_EXIT,
                         .exited = exited,
                         .exit_code = exited ? code : 0,
                         .signal = (int)sig};
    return 0;
}

/* ---- lifetime ---- */

static void op_free(void *arg)
{
    sp_exec_t *op = arg;
    sp_timer_stop(&op->timer);
    sp_timer_stop(&op->grace);
    free(op->in_buf);
    sp_buf_free(&op->out);
    sp_buf_free(&op->err);
    json_decref(op->items);
    free(op);
}

/* Marks op dead: resets its stream (no more stream callbacks), stops timers. */
static void op_kill(sp_exec_t *op)
{
    sp_chanop__kill(&op->ch);
    sp_timer_stop(&op->timer);
    sp_timer_stop(&op->grace);
}

void sp_exec_cancel(sp_exec_t *op)
{
    if (op != NULL)
        sp_chanop__cancel(&op->ch); /* op_free stops the timers */
}

/* ---- terminal delivery (always from inside an entry: the entry's leave frees) ---- */

static void deliver_exit(sp_exec_t *op, bool exited, int code, int sig)
{
    sp_exec_ev_t ev = {.type = SP_EXEC_EV_EXIT, .pid = op->pid, .exited = exited,
                       .exit_code = code, .signal = sig, .timed_out = op->timed_out};
    kind_t k = op->kind;
    op_kill(op);
    if (k == K_STREAM) {
        op->ev_cb(op->arg, &ev);
    } else if (k == K_RUN) {
        sp_exec_result_t r = {.pid = op->pid, .exited = exited, .exit_code = code,
                              .signal = sig, .timed_out = op->timed_out,
                              .out = op->out.p, .err = op->err.p,
                              .out_len = op->out.len, .err_len = op->err.len,
                              .out_truncated = op->out_tr, .err_truncated = op->err_tr};
        op->run_cb(op->arg, &r, NULL);
    } else if (k == K_SPAWN) { /* exited before we saw it start: cannot happen (STARTED first) */
        sp_err_t e;
        sp_err_set(&e, SP_EINTERNAL, "command ended before it started");
        op->spawn_cb(op->arg, 0, &e);
    }
}

static void deliver_error(sp_exec_t *op, const sp_err_t *err)
{
    op_kill(op);
    switch (op->kind) {
    case K_STREAM: {
        sp_exec_ev_t ev = {.type = SP_EXEC_EV_ERROR, .pid = op->pid, .err = err};
        op->ev_cb(op->arg, &ev);
        break;
    }
    case K_RUN:
        op->run_cb(op->arg, NULL, err);
        break;
    case K_SPAWN:
        op->spawn_cb(op->arg, 0, err);
        break;
    case K_LIST:
        op->list_cb(op->arg, NULL, false, err);
        break;
    case K_CTRL:
        op->done_cb(op->arg, err);
        break;
    case K_FS:
        op->fs_cb(op->arg, NULL, err);
        break;
    case K_READ:
        op->rcbs.on_done(op->arg, op->total, err);
        break;
    case K_WRITE:
        op->wcbs.on_done(op->arg, NULL, err);
        break;
    case K_WATCH:
        op->watch_cbs.on_done(op->arg, err);
        break;
    }
}

static void fail(sp_exec_t *op, sp_code_t code, const char *msg)
{
    sp_err_t e;
    sp_err_set(&e, code, "%s", msg);
    deliver_error(op, &e);
}

/* ---- stream plumbing (entered and checked alive by chanop.c) ---- */

static void on_frame(void *arg, uint16_t type, uint16_t flags, const uint8_t *p, size_t len);

static void on_lost(void *arg, const sp_err_t *err)
{
    sp_exec_t *op = arg;
    sp_log(SP_LOG_INFO, "exec", "agent stream lost kind=%d pid=%u err=%s", op->kind, op->pid,
           err->msg);
    fail(op, SP_EUNAVAIL, "connection to the sandbox agent was lost");
}

static void feed_stdin(sp_exec_t *op);

static void on_writable(void *arg)
{
    sp_exec_t *op = arg;
    if (op->kind == K_WRITE) {
        sp_timer_start(&op->timer, SP_EXEC_IDLE_MS);
        if (op->wcbs.on_writable != NULL)
            op->wcbs.on_writable(op->arg);
    } else {
        feed_stdin(op);
    }
}

static const sp_chanop_ops_t chan_ops = {on_frame, on_lost, on_writable, op_free};

static void on_timer(sp_timer_t *t, void *arg);
static void on_grace(sp_timer_t *t, void *arg);

static sp_exec_t *op_new(sp_loop_t *loop, sp_agentconn_t *c, kind_t kind, void *arg,
                         sp_err_t *err)
{
    if (loop == NULL || c == NULL) {
        sp_err_set(err, SP_EUNAVAIL, "sandbox VM is not reachable");
        return NULL;
    }
    sp_exec_t *op = calloc(1, sizeof(*op));
    if (op == NULL) {
        sp_err_set(err, SP_EINTERNAL, "out of memory");
        return NULL;
    }
    op->kind = kind;
    op->loop = loop;
    op->conn = c;
    op->arg = arg;
    sp_chanop__init(&op->ch, &chan_ops, op);
    sp_timer_init(&op->timer, loop, on_timer, op);
    sp_timer_init(&op->grace, loop, on_grace, op);
    return op;
}

/* Opens op's stream; -1 with err (op untouched otherwise) when it cannot. */
static int op_open_keep(sp_exec_t *op, uint16_t type, const uint8_t *payload, size_t len,
                        sp_err_t *err)
{
    return sp_chanop__open(&op->ch, op->conn, type, payload, len, err);
}

/* As op_open_keep, for a new op: frees it on failure. */
static int op_open(sp_exec_t *op, uint16_t type, const uint8_t *payload, size_t len,
                   sp_err_t *err)
{
    if (op_open_keep(op, type, payload, len, err) < 0) {
        op_free(op);
        return -1;
    }
    return 0;
}

/* ---- processes ---- */

static void feed_stdin(sp_exec_t *op)
{
    if (op->ch.s == NULL)
        return;
    while (op->in_off < op->in_len) {
        size_t n = op->in_len - op->in_off;
        if (n > SP_AP_MAX_DATA)
            n = SP_AP_MAX_DATA;
        int rc = sp_agentstream_send(op->ch.s, SP_AP_T_DATA, op->in_buf + op->in_off, n);
        if (rc <= 0)
            return; /* 0: on_writable will call again; -1: on_error follows */
        op->in_off += n;
        if (op->kind == K_CTRL)
            sp_timer_start(&op->timer, SP_EXEC_IDLE_MS);
    }
    if (op->in_eof && !op->in_eof_sent) {
        if (sp_agentstream_send(op->ch.s, SP_AP_T_EOF, NULL, 0) < 0)
            return;
        op->in_eof_sent = true;
    }
}

static void ctrl_maybe_done(sp_exec_t *op)
{
    if (op->started && op->in_off >= op->in_len && (!op->in_eof || op->in_eof_sent)) {
        op_kill(op); /* RESET comes after our frames: the agent handles them first */
        op->done_cb(op->arg, NULL);
    }
}

/* Collects up to max bytes in b; what does not fit, or finds no memory, marks it truncated. */
static void append_capped(sp_buf_t *b, bool *tr, size_t max, const uint8_t *p, size_t n)
{
    size_t take = n;
    if (b->len + take > max) {
        take = max - b->len;
        *tr = true;
    }
    if (take == 0)
        return;
    sp_buf_add(b, p, take);
    if (b->oom)
        *tr = true;
}

static void proc_frame(sp_exec_t *op, uint16_t type, const uint8_t *p, size_t len)
{
    switch (type) {
    case SP_AP_T_PROC_STARTED: {
        uint32_t pid = 0;
        if (sp_ap_get_u32(p, len, SP_AP_K_PID, &pid) < 0 || pid == 0) {
            fail(op, SP_EINTERNAL, "sandbox agent sent a malformed start");
            return;
        }
        if (op->started)
            return;
        op->started = true;
        op->pid = pid;
        if (op->kind == K_SPAWN) {
            op_kill(op); /* detach: the process keeps running */
            op->spawn_cb(op->arg, pid, NULL);
        } else if (op->kind == K_STREAM) {
            sp_exec_ev_t ev = {.type = SP_EXEC_EV_START, .pid = pid};
            op->ev_cb(op->arg, &ev);
        } else if (op->kind == K_CTRL) {
            ctrl_maybe_done(op);
        }
        return;
    }
    case SP_AP_T_PROC_STDOUT:
    case SP_AP_T_PROC_STDERR:
        if (op->kind == K_STREAM) {
            sp_exec_ev_t ev = {.type = type == SP_AP_T_PROC_STDOUT ? SP_EXEC_EV_STDOUT
                                                                   : SP_EXEC_EV_STDERR,
                               .pid = op->pid, .data = p, .len = len};
            op->ev_cb(op->arg, &ev);
        } else {
            if (op->kind == K_RUN) {
                if (type == SP_AP_T_PROC_STDOUT)
                    append_capped(&op->out, &op->out_tr, op->cap, p, len);
                else
                    append_capped(&op->err, &op->err_tr, op->cap, p, len);
            }
            /* Collected, dropped (K_CTRL) or beyond the cap: consumed now. */
            sp_chanop__grant(&op->ch, len);
        }
        return;
    case SP_AP_T_PROC_EXIT: {
        sp_exec_ev_t ex;
        if (sp_exec_proc_exit(p, len, &ex) < 0) {
            fail(op, SP_EINTERNAL, "sandbox agent sent a malformed exit");
            return;
        }
        if (op->kind == K_CTRL) {
            sp_err_t e;
            sp_err_set(&e, SP_ECONFLICT, "command %u has exited", op->pid);
            deliver_error(op, &e);
            return;
        }
        deliver_exit(op, ex.exited, ex.exit_code, ex.signal);
        return;
    }
    default:
        return; /* unknown frame types are ignored: the protocol may grow */
    }
}

static size_t enc_cmd(const sp_exec_cmd_t *cmd, uint8_t **out, sp_err_t *err)
{
    if ((cmd->cmd == NULL) == (cmd->argc == 0)) {
        sp_err_set(err, SP_EINVAL, "give exactly one of cmd and argv");
        return 0;
    }
    if (cmd->argc > SP_AP_MAX_ARGV || cmd->envc > SP_AP_MAX_ENV) {
        sp_err_set(err, SP_EINVAL, "at most %d argv entries and %d env entries", SP_AP_MAX_ARGV,
                   SP_AP_MAX_ENV);
        return 0;
    }
    sp_ap_proc_start_t *m = calloc(1, sizeof(*m));
    if (m == NULL) {
        sp_err_set(err, SP_EINTERNAL, "out of memory");
        return 0;
    }
    size_t total = 256;
#define SV(s) ((sp_ap_str_t){(s), (s) ? (uint32_t)strlen(s) : 0})
    for (size_t i = 0; i < cmd->argc; i++) {
        m->argv[i] = SV(cmd->argv[i]);
        total += m->argv[i].n + 6;
    }
    m->argc = (uint32_t)cmd->argc;
    for (size_t i = 0; i < cmd->envc; i++) {
        m->env[i] = SV(cmd->env[i]);
        total += m->env[i].n + 6;
    }
    m->envc = (uint32_t)cmd->envc;
    m->cmd = SV(cmd->cmd);
    m->cwd = SV(cmd->cwd);
    m->user = SV(cmd->user);
    m->tag = SV(cmd->tag);
#undef SV
    total += m->cmd.n + m->cwd.n + m->user.n + m->tag.n;
    m->pty = cmd->pty;
    m->rows = cmd->rows ? cmd->rows : 24;
    m->cols = cmd->cols ? cmd->cols : 80;
    m->stdin_pipe = cmd->stdin_pipe;
    if (total > SP_AP_MAX_PAYLOAD) {
        free(m);
        sp_err_set(err, SP_ETOOBIG, "command, argv and env are larger than 1 MiB");
        return 0;
    }
    uint8_t *buf = malloc(total + SP_AP_HDR_SIZE);
    sp_ap_writer_t w;
    sp_ap_writer_init(&w, buf, buf ? total + SP_AP_HDR_SIZE : 0);
    long n = buf ? sp_ap_enc_proc_start(&w, 1, m) : -1;
    free(m);
    if (n < (long)SP_AP_HDR_SIZE) {
        free(buf);
        sp_err_set(err, SP_ETOOBIG, "command does not fit one request");
        return 0;
    }
    memmove(buf, buf + SP_AP_HDR_SIZE, (size_t)n - SP_AP_HDR_SIZE);
    *out = buf;
    return (size_t)n - SP_AP_HDR_SIZE;
}

static sp_exec_t *start_proc(sp_loop_t *loop, sp_agentconn_t *c, const sp_exec_cmd_t *cmd,
                             kind_t kind, void *arg, sp_err_t *err)
{
    uint8_t *payload = NULL;
    size_t plen = enc_cmd(cmd, &payload, err);
    if (plen == 0)
        return NULL;
    sp_exec_t *op = op_new(loop, c, kind, arg, err);
    if (op == NULL) {
        free(payload);
        return NULL;
    }
    if (cmd->stdin_pipe && cmd->stdin_len > 0 && kind != K_SPAWN) {
        op->in_buf = malloc(cmd->stdin_len);
        if (op->in_buf == NULL) {
            free(payload);
            op_free(op);
            sp_err_set(err, SP_EINTERNAL, "out of memory");
            return NULL;
        }
        memcpy(op->in_buf, cmd->stdin_data, cmd->stdin_len);
        op->in_len = cmd->stdin_len;
    }
    op->in_eof = cmd->stdin_pipe && cmd->stdin_eof && kind != K_SPAWN;
    int rc = op_open(op, SP_AP_T_PROC_START, payload, plen, err);
    free(payload);
    if (rc < 0)
        return NULL;
    feed_stdin(op); /* frames after PROC_START: the agent has the process by then */
    if (cmd->timeout_ms > 0 && kind != K_SPAWN)
        sp_timer_start(&op->timer, cmd->timeout_ms);
    if (kind == K_SPAWN)
        sp_timer_start(&op->timer, SP_EXEC_REPLY_MS);
    return op;
}

sp_exec_t *sp_exec_stream(sp_loop_t *loop, sp_agentconn_t *c, const sp_exec_cmd_t *cmd,
                          sp_exec_event_cb cb, void *arg, sp_err_t *err)
{
    sp_exec_t *op = start_proc(loop, c, cmd, K_STREAM, arg, err);
    if (op != NULL)
        op->ev_cb = cb;
    return op;
}

sp_exec_t *sp_exec_run(sp_loop_t *loop, sp_agentconn_t *c, const sp_exec_cmd_t *cmd, size_t cap,
                       sp_exec_result_cb cb, void *arg, sp_err_t *err)
{
    sp_exec_t *op = start_proc(loop, c, cmd, K_RUN, arg, err);
    if (op != NULL) {
        op->run_cb = cb;
        op->cap = cap ? cap : SP_EXEC_COLLECT_MAX;
    }
    return op;
}

sp_exec_t *sp_exec_spawn(sp_loop_t *loop, sp_agentconn_t *c, const sp_exec_cmd_t *cmd,
                         void (*cb)(void *arg, uint32_t pid, const sp_err_t *err), void *arg,
                         sp_err_t *err)
{
    sp_exec_t *op = start_proc(loop, c, cmd, K_SPAWN, arg, err);
    if (op != NULL)
        op->spawn_cb = cb;
    return op;
}

static int open_attach(sp_exec_t *op, uint32_t pid, bool replay, bool keep, sp_err_t *err)
{
    uint8_t buf[32];
    sp_ap_writer_t w;
    sp_ap_writer_init(&w, buf, sizeof(buf));
    sp_ap_put_u32(&w, SP_AP_K_PID, pid);
    sp_ap_put_u32(&w, SP_AP_K_REPLAY, replay ? 1 : 0);
    return keep ? op_open_keep(op, SP_AP_T_PROC_ATTACH, buf, w.len, err)
                : op_open(op, SP_AP_T_PROC_ATTACH, buf, w.len, err);
}

sp_exec_t *sp_exec_attach(sp_loop_t *loop, sp_agentconn_t *c, uint32_t pid, bool replay,
                          sp_exec_event_cb cb, void *arg, sp_err_t *err)
{
    if (pid == 0 || pid > 0x7fffffffu) {
        sp_err_set(err, SP_ENOTFOUND, "command not found");
        return NULL;
    }
    sp_exec_t *op = op_new(loop, c, K_STREAM, arg, err);
    if (op == NULL)
        return NULL;
    op->ev_cb = cb;
    op->pid = pid;
    if (open_attach(op, pid, replay, false, err) < 0)
        return NULL;
    return op;
}

void sp_exec_ack(sp_exec_t *op, size_t n)
{
    if (op != NULL)
        sp_chanop__grant(&op->ch, n);
}

static void on_grace(sp_timer_t *t, void *arg)
{
    sp_exec_t *op = arg;
    sp_chanop__enter(&op->ch);
    if (!op->ch.dead) {
        sp_log(SP_LOG_WARN, "exec", "process did not end after SIGKILL pid=%u", op->pid);
        deliver_exit(op, false, 0, 0);
    }
    sp_chanop__leave(&op->ch);
}

static void on_timer(sp_timer_t *t, void *arg)
{
    sp_exec_t *op = arg;
    sp_chanop__enter(&op->ch);
    if (op->ch.dead) {
        sp_chanop__leave(&op->ch);
        return;
    }
    switch (op->kind) {
    case K_STREAM:
    case K_RUN: {
        /* timeout_ms passed: kill the process group, then wait for the exit report. */
        uint8_t buf[32];
        sp_ap_writer_t w;
        sp_ap_writer_init(&w, buf, sizeof(buf));
        sp_ap_put_u32(&w, SP_AP_K_SIGNAL, SIGKILL);
        sp_ap_put_u32(&w, SP_AP_K_GROUP, 1);
        op->timed_out = true;
        if (op->ch.s != NULL)
            sp_agentstream_send(op->ch.s, SP_AP_T_PROC_SIGNAL, buf, w.len);
        sp_timer_start(&op->grace, SP_EXEC_KILL_GRACE_MS);
        break;
    }
    case K_CTRL:
    case K_WRITE:
        fail(op, SP_EUNAVAIL, "the sandbox stopped accepting data");
        break;
    default:
        fail(op, SP_EUNAVAIL, "the sandbox agent did not answer in time");
        break;
    }
    sp_chanop__leave(&op->ch);
}

/* ---- list ---- */

static json_t *proc_info_json(const uint8_t *p, size_t n, bool *cut)
{
    uint32_t pid = 0, pty = 0, running = 0, sig = 0;
    int32_t code = 0;
    uint64_t started = 0;
    sp_ap_str_t tag = {0}, argv = {0}, cwd = {0}, user = {0};
    sp_ap_field_t f;
    if (sp_ap_get_u32(p, n, SP_AP_K_PID, &pid) < 0 || pid == 0 ||
        sp_ap_get_u32(p, n, SP_AP_K_PTY, &pty) < 0 ||
        sp_ap_get_u32(p, n, SP_AP_K_RUNNING, &running) < 0 ||
        sp_ap_get_u32(p, n, SP_AP_K_SIGNAL, &sig) < 0 ||
        sp_ap_get_i32(p, n, SP_AP_K_EXIT_CODE, &code) < 0 ||
        sp_ap_get_u64(p, n, SP_AP_K_STARTED_NS, &started) < 0 ||
        sp_ap_get_str(p, n, SP_AP_K_TAG, &tag) < 0 || sp_ap_get_str(p, n, SP_AP_K_ARGV, &argv) < 0 ||
        sp_ap_get_str(p, n, SP_AP_K_CWD, &cwd) < 0 || sp_ap_get_str(p, n, SP_AP_K_USER, &user) < 0)
        return NULL;
    bool has_code = sp_ap_find(p, n, SP_AP_K_EXIT_CODE, &f) == 1;
    bool has_sig = sp_ap_find(p, n, SP_AP_K_SIGNAL, &f) == 1;
    char id[16], ts[40];
    snprintf(id, sizeof(id), "%u", pid);
    iso_time(started, ts);
    json_t *o = json_object();
    json_object_set_new(o, "id", json_string(id));
    json_object_set_new(o, "pid", json_integer(pid));
    json_object_set_new(o, "tag", json_sv_cap(tag, cut));
    json_object_set_new(o, "cmd", json_sv_cap(argv, cut));
    json_object_set_new(o, "cwd", json_sv_cap(cwd, cut));
    json_object_set_new(o, "user", json_sv_cap(user, cut));
    json_object_set_new(o, "pty", json_boolean(pty));
    json_object_set_new(o, "running", json_boolean(running));
    json_object_set_new(o, "exit_code", !running && has_code ? json_integer(code) : json_null());
    json_object_set_new(o, "signal", !running && has_sig ? json_integer(sig) : json_null());
    json_object_set_new(o, "started_at", json_string(ts));
    return o;
}

static int open_list(sp_exec_t *op, sp_err_t *err)
{
    op->items = json_array();
    if (op->items == NULL) {
        op_free(op);
        sp_err_set(err, SP_EINTERNAL, "out of memory");
        return -1;
    }
    if (op_open(op, SP_AP_T_PROC_LIST, NULL, 0, err) < 0)
        return -1;
    sp_timer_start(&op->timer, SP_EXEC_REPLY_MS);
    return 0;
}

sp_exec_t *sp_exec_list(sp_loop_t *loop, sp_agentconn_t *c, sp_exec_list_cb cb, void *arg,
                        sp_err_t *err)
{
    sp_exec_t *op = op_new(loop, c, K_LIST, arg, err);
    if (op == NULL)
        return NULL;
    op->list_cb = cb;
    return open_list(op, err) < 0 ? NULL : op;
}

/* ---- stdin and signals: find the process, attach, send, detach ---- */

static sp_exec_t *ctrl_new(sp_loop_t *loop, sp_agentconn_t *c, uint32_t pid, sp_exec_done_cb cb,
                           void *arg, sp_err_t *err)
{
    if (pid == 0 || pid > 0x7fffffffu) {
        sp_err_set(err, SP_ENOTFOUND, "command not found");
        return NULL;
    }
    sp_exec_t *op = op_new(loop, c, K_CTRL, arg, err);
    if (op == NULL)
        return NULL;
    op->done_cb = cb;
    op->pid = pid;
    return op;
}

sp_exec_t *sp_exec_stdin(sp_loop_t *loop, sp_agentconn_t *c, uint32_t pid, const void *data,
                         size_t len, bool eof, sp_exec_done_cb cb, void *arg, sp_err_t *err)
{
    sp_exec_t *op = ctrl_new(loop, c, pid, cb, arg, err);
    if (op == NULL)
        return NULL;
    if (len > 0) {
        op->in_buf = malloc(len);
        if (op->in_buf == NULL) {
            op_free(op);
            sp_err_set(err, SP_EINTERNAL, "out of memory");
            return NULL;
        }
        memcpy(op->in_buf, data, len);
        op->in_len = len;
    }
    op->in_eof = eof;
    return open_list(op, err) < 0 ? NULL : op;
}

sp_exec_t *sp_exec_signal(sp_loop_t *loop, sp_agentconn_t *c, uint32_t pid, int sig, bool group,
                          sp_exec_done_cb cb, void *arg, sp_err_t *err)
{
    if (sig < 1 || sig > 64) {
        sp_err_set(err, SP_EINVAL, "signal must be 1 to 64");
        return NULL;
    }
    sp_exec_t *op = ctrl_new(loop, c, pid, cb, arg, err);
    if (op == NULL)
        return NULL;
    op->is_signal = true;
    op->sig = sig;
    op->group = group;
    return open_list(op, err) < 0 ? NULL : op;
}

sp_exec_t *sp_exec_resize(sp_loop_t *loop, sp_agentconn_t *c, uint32_t pid, uint32_t rows,
                          uint32_t cols, sp_exec_done_cb cb, void *arg, sp_err_t *err)
{
    if (rows < 1 || rows > 1000 || cols < 1 || cols > 1000) {
        sp_err_set(err, SP_EINVAL, "rows and cols must be 1 to 1000");
        return NULL;
    }
    sp_exec_t *op = ctrl_new(loop, c, pid, cb, arg, err);
    if (op == NULL)
        return NULL;
    op->is_resize = true;
    op->rows = rows;
    op->cols = cols;
    return open_list(op, err) < 0 ? NULL : op;
}

/* The listing for a K_CTRL op ended: attach to the process if it runs. */
static void ctrl_listed(sp_exec_t *op)
{
    op->ch.s = NULL; /* the list stream ended */
    sp_timer_stop(&op->timer);
    if (!op->found) {
        fail(op, SP_ENOTFOUND, "command not found");
        return;
    }
    if (!op->running) {
        sp_err_t e;
        sp_err_set(&e, SP_ECONFLICT, "command %u has exited", op->pid);
        deliver_error(op, &e);
        return;
    }
    op->phase = 1;
    sp_err_t e;
    if (open_attach(op, op->pid, false, true, &e) < 0) {
        deliver_error(op, &e);
        return;
    }
    if (op->is_resize) {
        uint8_t buf[32];
        sp_ap_writer_t w;
        sp_ap_writer_init(&w, buf, sizeof(buf));
        sp_ap_put_u32(&w, SP_AP_K_ROWS, op->rows);
        sp_ap_put_u32(&w, SP_AP_K_COLS, op->cols);
        sp_agentstream_send(op->ch.s, SP_AP_T_PROC_RESIZE, buf, w.len);
    } else if (op->is_signal) {
        uint8_t buf[32];
        sp_ap_writer_t w;
        sp_ap_writer_init(&w, buf, sizeof(buf));
        sp_ap_put_u32(&w, SP_AP_K_SIGNAL, (uint32_t)op->sig);
        sp_ap_put_u32(&w, SP_AP_K_GROUP, op->group ? 1 : 0);
        sp_agentstream_send(op->ch.s, SP_AP_T_PROC_SIGNAL, buf, w.len);
    } else {
        feed_stdin(op);
    }
    sp_timer_start(&op->timer,
                   op->is_signal || op->is_resize ? SP_EXEC_REPLY_MS : SP_EXEC_IDLE_MS);
}

/* ---- files ---- */

static const char *ftype_name(uint32_t t)
{
    switch (t) {
    case SP_AP_FT_FILE:
        return "file";
    case SP_AP_FT_DIR:
        return "dir";
    case SP_AP_FT_SYMLINK:
        return "symlink";
    default:
        return "other";
    }
}

static json_t *entry_json(const uint8_t *p, size_t n)
{
    sp_ap_entry_t e;
    sp_err_t err;
    if (sp_ap_dec_entry(p, n, &e, &err) < 0)
        return NULL;
    char ts[40];
    iso_time(e.mtime_ns, ts);
    json_t *o = json_object();
    json_object_set_new(o, "path", json_sv(e.path));
    json_object_set_new(o, "name", json_sv(e.name));
    json_object_set_new(o, "type", json_string(ftype_name(e.ftype)));
    json_object_set_new(o, "size", json_integer((json_int_t)e.size));
    json_object_set_new(o, "mode", json_integer(e.mode));
    json_object_set_new(o, "uid", json_integer(e.uid));
    json_object_set_new(o, "gid", json_integer(e.gid));
    json_object_set_new(o, "owner", json_sv(e.owner));
    json_object_set_new(o, "group", json_sv(e.group));
    json_object_set_new(o, "mtime", json_string(ts));
    if (e.link.p != NULL)
        json_object_set_new(o, "link", json_sv(e.link));
    if (e.target.p != NULL) {
        json_object_set_new(o, "target", json_sv(e.target));
        json_object_set_new(o, "target_type", json_string(ftype_name(e.target_ftype)));
        json_object_set_new(o, "target_mode", json_integer(e.target_mode));
    }
    static const char *const special[] = {NULL, "fifo", "socket", "char", "block"};
    if (e.ftype == SP_AP_FT_OTHER && e.special > 0 && e.special < 5)
        json_object_set_new(o, "special", json_string(special[e.special]));
    return o;
}

static const uint16_t fs_types[] = {SP_AP_T_FS_STAT, SP_AP_T_FS_LIST, SP_AP_T_FS_MKDIR,
                                    SP_AP_T_FS_MOVE, SP_AP_T_FS_REMOVE};

sp_exec_t *sp_exec_fs(sp_loop_t *loop, sp_agentconn_t *c, const sp_exec_fs_req_t *req,
                      void (*cb)(void *arg, json_t *result, const sp_err_t *err), void *arg,
                      sp_err_t *err)
{
    if ((unsigned)req->op > SP_EXEC_FS_REMOVE) {
        sp_err_set(err, SP_EINTERNAL, "unknown file operation");
        return NULL;
    }
    if (sp_exec_check_path(req->path, err) < 0 ||
        (req->op == SP_EXEC_FS_MOVE && sp_exec_check_path(req->dest, err) < 0))
        return NULL;
    sp_exec_t *op = op_new(loop, c, K_FS, arg, err);
    if (op == NULL)
        return NULL;
    op->fs_cb = cb;
    op->fsop = req->op;
    if (req->op == SP_EXEC_FS_LIST) {
        op->items = json_array();
        if (op->items == NULL) {
            op_free(op);
            sp_err_set(err, SP_EINTERNAL, "out of memory");
            return NULL;
        }
    }
    uint8_t buf[2 * SP_EXEC_PATH_MAX + 256];
    sp_ap_writer_t w;
    sp_ap_writer_init(&w, buf, sizeof(buf));
    sp_ap_put_str(&w, SP_AP_K_PATH, req->path);
    sp_ap_put_str(&w, SP_AP_K_USER, req->user);
    if (req->op == SP_EXEC_FS_MOVE)
        sp_ap_put_str(&w, SP_AP_K_DEST, req->dest);
    if (req->op == SP_EXEC_FS_LIST)
        sp_ap_put_u32(&w, SP_AP_K_DEPTH, req->depth ? req->depth : 1);
    if (req->op == SP_EXEC_FS_REMOVE)
        sp_ap_put_u32(&w, SP_AP_K_RECURSIVE, req->recursive ? 1 : 0);
    if (req->op == SP_EXEC_FS_MKDIR && req->mode != 0)
        sp_ap_put_u32(&w, SP_AP_K_MODE, req->mode);
    if (w.overflow) { /* cannot happen: paths are checked against the buffer's bound */
        op_free(op);
        sp_err_set(err, SP_EINVAL, "request too large");
        return NULL;
    }
    if (op_open(op, fs_types[req->op], buf, w.len, err) < 0)
        return NULL;
    sp_timer_start(&op->timer, SP_EXEC_REPLY_MS);
    return op;
}

/* An entry with a string past SP_LIST_STR_MAX (listcap.h). */
static bool entry_too_long(const sp_ap_entry_t *e)
{
    return e->path.n > SP_LIST_STR_MAX || e->name.n > SP_LIST_STR_MAX ||
           e->owner.n > SP_LIST_STR_MAX || e->group.n > SP_LIST_STR_MAX ||
           e->link.n > SP_LIST_STR_MAX || e->target.n > SP_LIST_STR_MAX;
}

static void fs_frame(sp_exec_t *op, uint16_t type, uint16_t flags, const uint8_t *p, size_t len)
{
    bool cap_hit = false;
    if (type == SP_AP_T_FS_ENTRY && op->fsop == SP_EXEC_FS_LIST && !(flags & SP_AP_F_END)) {
        if (!list_room(op, len)) { /* a cap: answer what we have, stop the agent */
            op->truncated = true;
            cap_hit = true;
        } else {
            sp_ap_entry_t de;
            sp_err_t de_err;
            if (sp_ap_dec_entry(p, len, &de, &de_err) == 0 && entry_too_long(&de)) {
                op->truncated = true; /* left out: a cut path would name another file */
                return;
            }
            json_t *e = entry_json(p, len);
            if (e == NULL) {
                fail(op, SP_EINTERNAL, "sandbox agent sent a malformed entry");
                return;
            }
            json_array_append_new(op->items, e);
            return;
        }
    }
    if (type != SP_AP_T_OK && !cap_hit)
        return;
    json_t *res = NULL;
    if (op->fsop == SP_EXEC_FS_LIST) {
        uint32_t tr = 0;
        if (!cap_hit)
            sp_ap_get_u32(p, len, SP_AP_K_TRUNCATED, &tr);
        res = json_pack("{s:O,s:b}", "entries", op->items, "truncated", op->truncated || tr);
    } else if (op->fsop != SP_EXEC_FS_REMOVE) {
        res = entry_json(p, len);
        if (res == NULL) {
            fail(op, SP_EINTERNAL, "sandbox agent sent a malformed entry");
            return;
        }
    }
    op_kill(op);
    op->fs_cb(op->arg, res, NULL);
    json_decref(res);
}

sp_exec_t *sp_exec_read(sp_loop_t *loop, sp_agentconn_t *c, const char *path, const char *user,
                        uint64_t offset, uint64_t length, const sp_exec_read_cbs_t *cbs,
                        void *arg, sp_err_t *err)
{
    if (sp_exec_check_path(path, err) < 0)
        return NULL;
    sp_exec_t *op = op_new(loop, c, K_READ, arg, err);
    if (op == NULL)
        return NULL;
    op->rcbs = *cbs;
    uint8_t buf[SP_EXEC_PATH_MAX + 256];
    sp_ap_writer_t w;
    sp_ap_writer_init(&w, buf, sizeof(buf));
    sp_ap_put_str(&w, SP_AP_K_PATH, path);
    sp_ap_put_str(&w, SP_AP_K_USER, user);
    sp_ap_put_u64(&w, SP_AP_K_OFFSET, offset);
    sp_ap_put_u64(&w, SP_AP_K_LENGTH, length);
    if (op_open(op, SP_AP_T_FS_READ, buf, w.len, err) < 0)
        return NULL;
    return op;
}

static void read_frame(sp_exec_t *op, uint16_t type, const uint8_t *p, size_t len)
{
    if (type == SP_AP_T_DATA) {
        op->total += len;
        op->rcbs.on_data(op->arg, p, len);
        return;
    }
    if (type == SP_AP_T_OK) {
        op_kill(op);
        op->rcbs.on_done(op->arg, op->total, NULL);
    }
}

sp_exec_t *sp_exec_write(sp_loop_t *loop, sp_agentconn_t *c, const char *path, const char *user,
                         uint32_t mode, bool mkdirs, const sp_exec_write_cbs_t *cbs, void *arg,
                         sp_err_t *err)
{
    if (sp_exec_check_path(path, err) < 0)
        return NULL;
    sp_exec_t *op = op_new(loop, c, K_WRITE, arg, err);
    if (op == NULL)
        return NULL;
    op->wcbs = *cbs;
    uint8_t buf[SP_EXEC_PATH_MAX + 256];
    sp_ap_writer_t w;
    sp_ap_writer_init(&w, buf, sizeof(buf));
    sp_ap_put_str(&w, SP_AP_K_PATH, path);
    sp_ap_put_str(&w, SP_AP_K_USER, user);
    if (mode != 0)
        sp_ap_put_u32(&w, SP_AP_K_MODE, mode);
    sp_ap_put_u32(&w, SP_AP_K_MKDIRS, mkdirs ? 1 : 0);
    if (op_open(op, SP_AP_T_FS_WRITE, buf, w.len, err) < 0)
        return NULL;
    sp_timer_start(&op->timer, SP_EXEC_IDLE_MS);
    return op;
}

long sp_exec_write_data(sp_exec_t *op, const void *p, size_t n)
{
    if (op == NULL || op->ch.dead || op->ch.s == NULL || op->write_failed)
        return -1;
    size_t took = 0;
    while (took < n) {
        size_t k = n - took;
        if (k > SP_AP_MAX_DATA)
            k = SP_AP_MAX_DATA;
        int rc = sp_agentstream_send(op->ch.s, SP_AP_T_DATA, (const uint8_t *)p + took, k);
        if (rc == 0)
            break;
        if (rc < 0) {
            op->write_failed = true; /* on_error (or the agent's ERROR) reports it */
            return took > 0 ? (long)took : -1;
        }
        took += k;
    }
    if (took > 0)
        sp_timer_start(&op->timer, SP_EXEC_IDLE_MS);
    return (long)took;
}

void sp_exec_write_end(sp_exec_t *op)
{
    if (op == NULL || op->ch.dead || op->ch.s == NULL)
        return;
    if (sp_agentstream_send(op->ch.s, SP_AP_T_EOF, NULL, 0) < 0)
        op->write_failed = true;
    sp_timer_start(&op->timer, SP_EXEC_IDLE_MS);
}

static void write_frame(sp_exec_t *op, uint16_t type, const uint8_t *p, size_t len)
{
    if (type != SP_AP_T_OK)
        return;
    json_t *e = entry_json(p, len);
    op_kill(op);
    op->wcbs.on_done(op->arg, e, NULL);
    json_decref(e);
}

sp_exec_t *sp_exec_watch(sp_loop_t *loop, sp_agentconn_t *c, const char *path, const char *user,
                         bool recursive, const sp_exec_watch_cbs_t *cbs, void *arg,
                         sp_err_t *err)
{
    if (sp_exec_check_path(path, err) < 0)
        return NULL;
    sp_exec_t *op = op_new(loop, c, K_WATCH, arg, err);
    if (op == NULL)
        return NULL;
    op->watch_cbs = *cbs;
    uint8_t buf[SP_EXEC_PATH_MAX + 256];
    sp_ap_writer_t w;
    sp_ap_writer_init(&w, buf, sizeof(buf));
    sp_ap_put_str(&w, SP_AP_K_PATH, path);
    sp_ap_put_str(&w, SP_AP_K_USER, user);
    sp_ap_put_u32(&w, SP_AP_K_RECURSIVE, recursive ? 1 : 0);
    if (op_open(op, SP_AP_T_WATCH_START, buf, w.len, err) < 0)
        return NULL;
    sp_timer_start(&op->timer, SP_EXEC_REPLY_MS); /* until WATCH_STARTED */
    return op;
}

static void watch_frame(sp_exec_t *op, uint16_t type, const uint8_t *p, size_t len)
{
    if (type == SP_AP_T_WATCH_STARTED) {
        if (op->started)
            return;
        op->started = true;
        sp_timer_stop(&op->timer);
        op->watch_cbs.on_started(op->arg);
        return;
    }
    if (type != SP_AP_T_WATCH_EVENT || !op->started)
        return;
    sp_ap_str_t path = {0}, name = {0};
    uint32_t ev = 0, ft = 0;
    if (sp_ap_get_str(p, len, SP_AP_K_PATH, &path) < 0 || path.p == NULL ||
        sp_ap_get_str(p, len, SP_AP_K_NAME, &name) < 0 ||
        sp_ap_get_u32(p, len, SP_AP_K_EVENT, &ev) < 0 ||
        sp_ap_get_u32(p, len, SP_AP_K_FTYPE, &ft) < 0 || path.n > SP_EXEC_PATH_MAX ||
        name.n > SP_EXEC_PATH_MAX)
        return; /* a malformed event is dropped, the watch goes on */
    char *ps = malloc(path.n + 1), *ns = malloc(name.n + 1);
    if (ps != NULL && ns != NULL) {
        memcpy(ps, path.p, path.n);
        ps[path.n] = '\0';
        if (name.n)
            memcpy(ns, name.p, name.n);
        ns[name.n] = '\0';
        op->watch_cbs.on_event(op->arg, ps, ns, ev, ft);
    }
    free(ps);
    free(ns);
}

/* ---- dispatch ---- */

/* The process listing is over (OK, or a cap hit): the terminal callback. */
static void list_done(sp_exec_t *op)
{
    json_t *items = json_incref(op->items);
    op_kill(op);
    op->list_cb(op->arg, items, op->truncated, NULL);
    json_decref(items);
}

static void on_frame(void *arg, uint16_t type, uint16_t flags, const uint8_t *p, size_t len)
{
    sp_exec_t *op = arg;
    bool end = (flags & SP_AP_F_END) != 0;
    if (type == SP_AP_T_ERROR) {
        sp_err_t e;
        sp_exec_agent_error(p, len, &e);
        if (op->kind == K_CTRL && op->phase == 1 && e.code == SP_ENOTFOUND)
            sp_err_set(&e, SP_ECONFLICT, "command %u has exited", op->pid);
        else if (op->kind == K_STREAM && !op->started && e.code == SP_ENOTFOUND &&
                 op->pid != 0)
            sp_err_set(&e, SP_ENOTFOUND, "command not found");
        deliver_error(op, &e);
        return;
    }
    switch (op->kind) {
    case K_STREAM:
    case K_RUN:
    case K_SPAWN:
        proc_frame(op, type, p, len);
        break;
    case K_LIST:
        if (type == SP_AP_T_PROC_INFO && !end) {
            if (!list_room(op, len)) { /* a cap: answer what we have, stop the agent */
                op->truncated = true;
                list_done(op);
                return;
            }
            json_t *o = proc_info_json(p, len, &op->truncated);
            if (o != NULL)
                json_array_append_new(op->items, o);
        } else if (type == SP_AP_T_OK) {
            list_done(op);
        }
        break;
    case K_CTRL:
        if (op->phase == 0) {
            if (type == SP_AP_T_PROC_INFO) {
                uint32_t pid = 0, running = 0;
                if (sp_ap_get_u32(p, len, SP_AP_K_PID, &pid) == 0 && pid == op->pid &&
                    sp_ap_get_u32(p, len, SP_AP_K_RUNNING, &running) == 0) {
                    op->found = true;
                    op->running = running != 0;
                }
            } else if (type == SP_AP_T_OK) {
                ctrl_listed(op);
            }
        } else {
            proc_frame(op, type, p, len);
        }
        break;
    case K_FS:
        fs_frame(op, type, flags, p, len);
        break;
    case K_READ:
        read_frame(op, type, p, len);
        break;
    case K_WRITE:
        write_frame(op, type, p, len);
        break;
    case K_WATCH:
        watch_frame(op, type, p, len);
        break;
    }
    /* An END we did not expect (OK on a process stream, say). */
    if (end && !op->ch.dead && op->ch.s == NULL)
        fail(op, SP_EINTERNAL, "sandbox agent ended the request unexpectedly");
}
