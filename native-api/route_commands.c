/*
 * route_commands.c - /v1/sandboxes/{id}/commands: run (collected, streamed as NDJSON, or in
 * the background), list, re-attach to output, stdin, signals.
 *
 * Parses and checks the JSON, resolves the sandbox's agent (sp_napi__with_agent), then hands
 * the work to core/channel/exec.h. A streamed command's output flows agent -> NDJSON line -> client,
 * and the agent gets credit back only after h2o took the line (http/stream.c's on_sent), so a
 * client that reads slowly or not at all holds one agent window here, never more. A client
 * that leaves only detaches: the process keeps running and can be re-attached.
 *
 * Command IDs are the guest PIDs in decimal.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/channel/exec.h"
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

static void on_ran(void *arg, const sp_exec_result_t *res, const sp_err_t *err)
{
    napi_ctx_t *c = arg;
    if (err != NULL) {
        sp_napi__fail(c, err);
        return;
    }
    json_t *o = sp_napi__exit_json(res->exited, res->exit_code, res->signal, res->timed_out);
    char id[16];
    snprintf(id, sizeof(id), "%u", res->pid);
    json_t *out = sp_exec_json_bytes(res->out, res->out_len);
    json_t *errs = sp_exec_json_bytes(res->err, res->err_len);
    if (out == NULL || errs == NULL) {
        json_decref(out);
        json_decref(errs);
        json_decref(o);
        sp_err_t e;
        sp_err_set(&e, SP_EINTERNAL, "out of memory");
        sp_napi__fail(c, &e);
        return;
    }
    json_object_set_new(o, "id", json_string(id));
    json_object_set_new(o, "pid", json_integer(res->pid));
    json_object_set_new(o, "stdout", out);
    json_object_set_new(o, "stderr", errs);
    json_object_set_new(o, "truncated", json_boolean(res->out_truncated || res->err_truncated));
    sp_napi__reply(c, 200, o);
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
