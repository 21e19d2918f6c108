/*
 * route_commands.c - /v1/sandboxes/{id}/commands: run (collected, streamed as NDJSON, or in
 * the background), list, re-attach to output, stdin, signals.
 *
 * Parses and checks the JSON, resolves the sandbox's agent (sp_napi__with_agent), then hands
 * the work to core/channel/exec.h. A streamed command's output flows agent -> NDJSON line ->
 * client, and the agent gets credit back only after h2o took the line (http/stream.c's on_sent), so
 * a client that reads slowly or not at all holds one agent window here, never more. A client that
 * leaves only detaches: the process keeps running and can be re-attached.
 *
 * Command IDs are the guest PIDs in decimal.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/channel/exec.h"
#include "http/json.h"
#include "native-api/napi_int.h"

/* ---- parsing (the body: body.h) ---- */

/* Command ID -> pid: decimal, 1..2^31-1, no sign or leading zeros. 0 when invalid. */
static uint32_t parse_cid(const char *s)
{
    if (s == NULL || s[0] < '1' || s[0] > '9' || strlen(s) > 10)
        return 0;
    unsigned long long v = 0;
    for (const char *p = s; *p; p++) {
        if (*p < '0' || *p > '9')
            return 0;
        v = v * 10 + (unsigned)(*p - '0');
    }
    return v <= 0x7fffffffull ? (uint32_t)v : 0;
}

/* ---- NDJSON streaming: a command's events as lines (ndjson.c) ---- */

typedef struct {
    napi_ctx_t *c; /* until the response starts */
    sp_exec_t *op;
    napi_ndjson_t nd;
} cmdstream_t;

static void cs_free(cmdstream_t *cs)
{
    sp_napi__nd_clear(&cs->nd);
    free(cs);
}

static void cs_sent(void *arg, size_t raw)
{
    cmdstream_t *cs = arg;
    sp_exec_ack(cs->op, raw);
}

static void cs_gone(void *arg)
{
    cmdstream_t *cs = arg;
    cs->nd.st = NULL;
    sp_exec_cancel(cs->op); /* detaches: the process keeps running */
    cs_free(cs);
}

static const sp_stream_cbs_t cs_cbs = {cs_sent, cs_gone};

static void cs_event(void *arg, const sp_exec_ev_t *ev)
{
    cmdstream_t *cs = arg;
    if (cs->nd.st == NULL) {
        /* Not started: the first event decides between a JSON error and the stream. */
        bool failed = ev->type == SP_EXEC_EV_ERROR;
        cs->nd.st = sp_napi__ndjson_begin(cs->c, failed ? ev->err : NULL, &cs_cbs, cs);
        cs->c = NULL;
        if (cs->nd.st == NULL) {
            if (!failed)
                sp_exec_cancel(cs->op);
            cs_free(cs);
            return;
        }
        sp_napi__ndjson_line(cs->nd.st, sp_napi__start_event(ev->pid, NULL), 0);
        if (ev->type == SP_EXEC_EV_START)
            return;
    }
    int rc = sp_napi__nd_event(&cs->nd, ev);
    if (rc < 0)
        sp_exec_cancel(cs->op); /* out of memory: the process keeps running */
    if (rc != 0)
        cs_free(cs);
}

static cmdstream_t *cs_new(napi_ctx_t *c)
{
    cmdstream_t *cs = calloc(1, sizeof(*cs));
    if (cs != NULL)
        cs->c = c;
    return cs;
}

/* ---- POST .../commands ---- */

typedef struct {
    napi_ctx_t *c;
    napi_runspec_t *r;
} runreq_t;

static void on_spawned(void *arg, uint32_t pid, const sp_err_t *err)
{
    napi_ctx_t *c = arg;
    if (err != NULL) {
        sp_napi__fail(c, err);
        return;
    }
    char id[16];
    snprintf(id, sizeof(id), "%u", pid);
    sp_napi__reply(c, 200, json_pack("{s:s,s:i,s:b}", "id", id, "pid", (int)pid, "running", 1));
}

/* ---- a collected command's answer ----
 * {"exit_code":..,"signal":..,"timed_out":..,"id":..,"pid":..,"stdout":..,"stderr":..,
 * "truncated":..} with its Content-Length, rendered piece by piece as the client takes it: the
 * output is what the guest chose (up to SP_EXEC_COLLECT_MAX per stream), and as JSON a NUL byte
 * is six, an invalid one three, so rendering it whole (cleaned copy, jansson string, text,
 * h2o's copy) cost spaced about fifteen times the output: a guest writing NULs made one
 * command's answer 250 MB. Now: the raw bytes once, and a few pieces in flight. */

#define ANS_PIECE (64u * 1024u)    /* raw bytes rendered at a time */
#define ANS_PENDING (256u * 1024u) /* rendered bytes queued before waiting for the client */

typedef struct {
    sp_stream_t *st;
    uint8_t *raw; /* stdout then stderr, owned */
    size_t len[2];
    int part;   /* 0 stdout, 1 stderr, 2 done */
    size_t off; /* in the part */
    bool truncated;
    bool pumping; /* in ans_pump */
    bool gone;    /* the client left while pumping: ans_pump frees */
    sp_buf_t piece;
    char *clean; /* 3 * ANS_PIECE: one piece as UTF-8 */
} answer_t;

static const char ans_open[] = ",\"stdout\":\"";
static const char ans_mid[] = "\",\"stderr\":\"";
static const char ans_trunc[] = "\",\"truncated\":";

/* Renders the next piece of the current part into a->piece (appended): mid-part at most
 * ANS_PIECE raw bytes, cleaned as sp_exec_json_bytes does, then escaped; at a part's end its
 * closing text. Advances a->part/off. The raw bytes used (1 for closing text alone); 0 once done,
 * -1 out of memory. */
static long ans_render(answer_t *a)
{
    if (a->part >= 2)
        return 0;
    const uint8_t *p = a->raw + (a->part == 1 ? a->len[0] : 0);
    size_t n = a->len[a->part];
    if (a->off == n) {
        if (a->part == 0) {
            sp_buf_add(&a->piece, ans_mid, sizeof ans_mid - 1);
        } else {
            sp_buf_add(&a->piece, ans_trunc, sizeof ans_trunc - 1);
            const char *t = a->truncated ? "true}\n" : "false}\n";
            sp_buf_add(&a->piece, t, strlen(t));
        }
        a->part++;
        a->off = 0;
        return a->piece.oom ? -1 : 1;
    }
    size_t k = n - a->off < ANS_PIECE ? n - a->off : ANS_PIECE, used = 0;
    size_t m = sp_exec_utf8_clean(p + a->off, k, a->clean, a->off + k == n, &used);
    if (a->off + k == n)
        used = k;
    if (used == 0) /* an incomplete sequence alone cannot fill a piece: never here */
        used = k;
    a->off += used;
    if (sp_json_write_str_part(&a->piece, a->clean, m) < 0 || a->piece.oom)
        return -1;
    return (long)used;
}

static void ans_free(answer_t *a)
{
    sp_buf_free(&a->piece);
    free(a->clean);
    free(a->raw);
    free(a);
}

/* Queues pieces while the client keeps up; ends the stream after the last. */
static void ans_pump(answer_t *a)
{
    if (a->pumping)
        return; /* a write's on_sent inside the loop below: it goes on anyway */
    a->pumping = true;
    while (sp_stream_pending(a->st) < ANS_PENDING) {
        sp_buf_reset(&a->piece);
        long raw = ans_render(a);
        if (raw == 0) {
            a->pumping = false;
            sp_stream_t *st = a->st;
            ans_free(a);
            sp_stream_end(st, NULL, 0, true);
            return;
        }
        int w = raw < 0 ? -1 : sp_stream_write(a->st, a->piece.p, a->piece.len, (size_t)raw);
        if (a->gone) {
            ans_free(a);
            return;
        }
        if (w < 0) {
            a->pumping = false;
            sp_stream_t *st = a->st;
            ans_free(a);
            sp_stream_end(st, NULL, 0, false); /* the client sees a cut body */
            return;
        }
    }
    a->pumping = false;
}

static void ans_sent(void *arg, size_t raw)
{
    (void)raw;
    ans_pump(arg);
}

static void ans_gone(void *arg)
{
    answer_t *a = arg;
    if (a->pumping)
        a->gone = true;
    else
        ans_free(a);
}

static const sp_stream_cbs_t ans_cbs = {ans_sent, ans_gone};

static void on_ran(void *arg, const sp_exec_result_t *res, const sp_err_t *err)
{
    napi_ctx_t *c = arg;
    if (err != NULL) {
        sp_napi__fail(c, err);
        return;
    }
    sp_err_t e;
    sp_err_set(&e, SP_EINTERNAL, "out of memory");
    answer_t *a = calloc(1, sizeof(*a));
    sp_buf_t head = SP_BUF_INIT;
    json_t *o = sp_napi__exit_json(res->exited, res->exit_code, res->signal, res->timed_out);
    if (a == NULL || o == NULL) {
        free(a);
        json_decref(o);
        sp_napi__fail(c, &e);
        return;
    }
    char id[16];
    snprintf(id, sizeof(id), "%u", res->pid);
    json_object_set_new(o, "id", json_string(id));
    json_object_set_new(o, "pid", json_integer(res->pid));
    int wrote = sp_json_write(&head, o); /* {...} without the output: its '}' becomes ',' */
    json_decref(o);
    a->len[0] = res->out_len;
    a->len[1] = res->err_len;
    a->truncated = res->out_truncated || res->err_truncated;
    a->raw = malloc(res->out_len + res->err_len + 1);
    a->clean = malloc(3 * ANS_PIECE);
    if (wrote < 0 || head.oom || head.len < 2 || a->raw == NULL || a->clean == NULL) {
        sp_buf_free(&head);
        ans_free(a);
        sp_napi__fail(c, &e);
        return;
    }
    if (res->out_len > 0)
        memcpy(a->raw, res->out, res->out_len);
    if (res->err_len > 0)
        memcpy(a->raw + res->out_len, res->err, res->err_len);
    head.len--;
    sp_buf_add(&head, ans_open, sizeof ans_open - 1);
    /* The length first: the same rendering, counted. */
    long long total = (long long)head.len;
    for (long r; (r = ans_render(a)) != 0; sp_buf_reset(&a->piece)) {
        if (r < 0) {
            sp_buf_free(&head);
            ans_free(a);
            sp_napi__fail(c, &e);
            return;
        }
        total += (long long)a->piece.len;
    }
    a->part = 0;
    a->off = 0;
    sp_buf_reset(&a->piece);
    h2o_req_t *req = sp_napi__take(c);
    if (req == NULL) { /* the client left */
        sp_buf_free(&head);
        ans_free(a);
        return;
    }
    a->st = sp_stream_start(req, 200, "application/json", total, &ans_cbs, a);
    if (a->st == NULL || sp_stream_write(a->st, head.p, head.len, 1) < 0) {
        sp_buf_free(&head);
        if (a->st == NULL) {
            ans_free(a);
            h2o_send_error_500(req, "Internal Server Error", "out of memory", 0);
        } else {
            sp_stream_t *st = a->st;
            ans_free(a);
            sp_stream_end(st, NULL, 0, false);
        }
        return;
    }
    sp_buf_free(&head);
    ans_pump(a);
}

static void run_with_agent(napi_ctx_t *c, sp_agentconn_t *conn)
{
    napi_runspec_t *r = c->data;
    c->data = NULL; /* ours now: freed below, whatever happens to c */
    sp_err_t e;
    sp_loop_t *loop = sp_napi__loop(c);
    if (r->background) {
        if (sp_exec_spawn(loop, conn, &r->spec.cmd, on_spawned, c, &e) == NULL)
            sp_napi__fail(c, &e);
    } else if (r->stream) {
        cmdstream_t *cs = cs_new(c);
        if (cs == NULL)
            sp_napi__fail(c, (sp_err_set(&e, SP_EINTERNAL, "out of memory"), &e));
        else if ((cs->op = sp_exec_stream(loop, conn, &r->spec.cmd, cs_event, cs, &e)) == NULL) {
            cs_free(cs);
            sp_napi__fail(c, &e);
        }
    } else {
        if (sp_exec_run(loop, conn, &r->spec.cmd, 0, on_ran, c, &e) == NULL)
            sp_napi__fail(c, &e);
    }
    sp_napi__runspec_free(r); /* exec copied what it keeps */
}

void sp_napi__commands_run(napi_ctx_t *c)
{
    sp_err_t e;
    h2o_req_t *req = sp_http_hold_req(c->hold);
    bool stream = false;
    sp_err_t ignored; /* ?stream= other than true/1 has always meant false */
    if (req != NULL)
        sp_napi__query_bool(req, "stream", &stream, &ignored);
    napi_runspec_t *r = sp_napi__body_run(c->body, stream, &e);
    if (r == NULL) {
        sp_napi__fail(c, &e);
        return;
    }
    c->data = r; /* kept across the sandbox lookup; freed with c if it fails */
    c->data_free = sp_napi__runspec_free;
    sp_napi__with_agent(c, run_with_agent);
}

/* ---- GET .../commands ---- */

static void on_listed(void *arg, json_t *procs, bool truncated, const sp_err_t *err)
{
    napi_ctx_t *c = arg;
    if (err != NULL)
        sp_napi__fail(c, err);
    else
        sp_napi__reply(c, 200, json_pack("{s:O,s:b}", "commands", procs, "truncated", truncated));
}

static void list_with_agent(napi_ctx_t *c, sp_agentconn_t *conn)
{
    sp_err_t e;
    if (sp_exec_list(sp_napi__loop(c), conn, on_listed, c, &e) == NULL)
        sp_napi__fail(c, &e);
}

void sp_napi__commands_list(napi_ctx_t *c)
{
    sp_napi__with_agent(c, list_with_agent);
}

/* ---- GET .../commands/{cid}/output ---- */

static void output_with_agent(napi_ctx_t *c, sp_agentconn_t *conn)
{
    sp_err_t e;
    cmdstream_t *cs = cs_new(c);
    if (cs == NULL) {
        sp_napi__fail(c, (sp_err_set(&e, SP_EINTERNAL, "out of memory"), &e));
        return;
    }
    cs->op = sp_exec_attach(sp_napi__loop(c), conn, parse_cid(c->segs[4]), true, cs_event, cs, &e);
    if (cs->op == NULL) {
        cs_free(cs);
        sp_napi__fail(c, &e);
    }
}

static bool check_cid(napi_ctx_t *c)
{
    if (parse_cid(c->segs[4]) != 0)
        return true;
    sp_err_t e;
    sp_napi__fail(c, (sp_err_set(&e, SP_ENOTFOUND, "command not found"), &e));
    return false;
}

void sp_napi__commands_output(napi_ctx_t *c)
{
    if (check_cid(c))
        sp_napi__with_agent(c, output_with_agent);
}

/* ---- POST .../commands/{cid}/stdin and /signal ---- */

static void on_ctrl(void *arg, const sp_err_t *err)
{
    napi_ctx_t *c = arg;
    if (err != NULL)
        sp_napi__fail(c, err);
    else
        sp_napi__reply(c, 200, json_pack("{s:s}", "id", c->segs[4]));
}

/* A stdin or signal request, checked, kept across the sandbox lookup (c->data). */
typedef struct {
    uint32_t pid;
    const char *data; /* stdin: borrowed from c->body, which lives as long as c */
    size_t len;
    bool eof;
    int sig;
    bool group;
} ctrl_t;

/* Keeps r for the next step; false (answered) when out of memory. */
static bool keep_ctrl(napi_ctx_t *c, const ctrl_t *r)
{
    ctrl_t *k = malloc(sizeof(*k));
    if (k == NULL) {
        sp_err_t e;
        sp_napi__fail(c, (sp_err_set(&e, SP_EINTERNAL, "out of memory"), &e));
        return false;
    }
    *k = *r;
    c->data = k;
    c->data_free = free;
    return true;
}

static void stdin_with_agent(napi_ctx_t *c, sp_agentconn_t *conn)
{
    sp_err_t e;
    const ctrl_t *r = c->data;
    if (sp_exec_stdin(sp_napi__loop(c), conn, r->pid, r->data, r->len, r->eof, on_ctrl, c, &e) ==
        NULL)
        sp_napi__fail(c, &e);
}

void sp_napi__commands_stdin(napi_ctx_t *c)
{
    sp_err_t e;
    ctrl_t r = {.pid = parse_cid(c->segs[4])};
    if (sp_napi__body_stdin(c->body, &r.data, &r.len, &r.eof, &e) < 0) {
        sp_napi__fail(c, &e);
        return;
    }
    if (check_cid(c) && keep_ctrl(c, &r))
        sp_napi__with_agent(c, stdin_with_agent);
}

static void signal_with_agent(napi_ctx_t *c, sp_agentconn_t *conn)
{
    sp_err_t e;
    const ctrl_t *r = c->data;
    if (sp_exec_signal(sp_napi__loop(c), conn, r->pid, r->sig, r->group, on_ctrl, c, &e) == NULL)
        sp_napi__fail(c, &e);
}

void sp_napi__commands_signal(napi_ctx_t *c)
{
    sp_err_t e;
    ctrl_t r = {.pid = parse_cid(c->segs[4])};
    if (sp_napi__body_signal(c->body, &r.sig, &r.group, &e) < 0) {
        sp_napi__fail(c, &e);
        return;
    }
    if (check_cid(c) && keep_ctrl(c, &r))
        sp_napi__with_agent(c, signal_with_agent);
}
