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

#define MAX_TIMEOUT_S (24 * 3600)

/* ---- parsing ---- */

/* Optional string field: *out borrowed from body (NULL when absent or null). */
static int get_str(json_t *body, const char *key, size_t maxlen, const char **out, sp_err_t *err)
{
    json_t *v = json_object_get(body, key);
    *out = NULL;
    if (v == NULL || json_is_null(v))
        return 0;
    if (!json_is_string(v))
        return sp_err_set(err, SP_EINVAL, "%s must be a string", key);
    if (strlen(json_string_value(v)) != json_string_length(v))
        return sp_err_set(err, SP_EINVAL, "%s may not contain NUL characters", key);
    if (json_string_length(v) > maxlen)
        return sp_err_set(err, SP_EINVAL, "%s is longer than %zu bytes", key, maxlen);
    *out = json_string_value(v);
    return 0;
}

static int get_bool(json_t *body, const char *key, bool *out, sp_err_t *err)
{
    json_t *v = json_object_get(body, key);
    if (v == NULL || json_is_null(v))
        return 0;
    if (!json_is_boolean(v))
        return sp_err_set(err, SP_EINVAL, "%s must be true or false", key);
    *out = json_is_true(v);
    return 0;
}

static int get_uint(json_t *body, const char *key, long long lo, long long hi, uint32_t *out,
                    sp_err_t *err)
{
    json_t *v = json_object_get(body, key);
    if (v == NULL || json_is_null(v))
        return 0;
    if (!json_is_integer(v) || json_integer_value(v) < lo || json_integer_value(v) > hi)
        return sp_err_set(err, SP_EINVAL, "%s must be an integer from %lld to %lld", key, lo, hi);
    *out = (uint32_t)json_integer_value(v);
    return 0;
}

static bool query_true(h2o_req_t *req, const char *name)
{
    const char *v = req ? sp_http_query(req, name) : NULL;
    return v != NULL && (strcmp(v, "true") == 0 || strcmp(v, "1") == 0);
}

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

/* ---- one command request, across its steps ---- */

typedef struct {
    sp_exec_cmd_t cmd;
    bool background, stream;
    /* copies that outlive the JSON body */
    char **strs;
    size_t nstrs;
} runspec_t;

static void runspec_free(runspec_t *r)
{
    for (size_t i = 0; i < r->nstrs; i++)
        free(r->strs[i]);
    free(r->strs);
    free((void *)r->cmd.argv);
    free((void *)r->cmd.env);
    free(r);
}

static void runspec_free_v(void *p)
{
    runspec_free(p);
}

static const char *keep(runspec_t *r, const char *s, size_t n)
{
    char *d = malloc(n + 1);
    if (d == NULL)
        return NULL;
    memcpy(d, s, n);
    d[n] = '\0';
    r->strs[r->nstrs++] = d;
    return d;
}

/* Builds the command from the body; NULL with err. */
static runspec_t *parse_run(json_t *b, h2o_req_t *req, sp_err_t *err)
{
    static const char *const allowed[] = {"cmd", "argv",    "env",        "cwd",
                                          "user", "stdin",  "timeout_s",  "background",
                                          "pty",  "stream", "tag",        "rows",
                                          "cols", NULL};
    if (b == NULL) {
        sp_err_set(err, SP_EINVAL, "request body must be a JSON object");
        return NULL;
    }
    if (sp_napi__only_keys(b, allowed, err) < 0)
        return NULL;
    const char *cmd, *cwd, *user, *in, *tag;
    uint32_t timeout_s = 0, rows = 0, cols = 0;
    bool bg = false, pty = false, stream = query_true(req, "stream");
    json_t *argv = json_object_get(b, "argv");
    json_t *env = json_object_get(b, "env");
    if (argv != NULL && json_is_null(argv))
        argv = NULL;
    if (env != NULL && json_is_null(env))
        env = NULL;
    if (get_str(b, "cmd", 256 * 1024, &cmd, err) < 0 || get_str(b, "cwd", SP_EXEC_PATH_MAX, &cwd, err) < 0 ||
        get_str(b, "user", 63, &user, err) < 0 || get_str(b, "stdin", NAPI_MAX_BODY, &in, err) < 0 ||
        get_str(b, "tag", 256, &tag, err) < 0 ||
        get_uint(b, "timeout_s", 1, MAX_TIMEOUT_S, &timeout_s, err) < 0 ||
        get_uint(b, "rows", 1, 1000, &rows, err) < 0 || get_uint(b, "cols", 1, 1000, &cols, err) < 0 ||
        get_bool(b, "background", &bg, err) < 0 || get_bool(b, "pty", &pty, err) < 0 ||
        get_bool(b, "stream", &stream, err) < 0 || sp_svc_check_string_map(env, "env", err) < 0)
        return NULL;
    if ((cmd != NULL) == (argv != NULL)) {
        sp_err_set(err, SP_EINVAL, "give exactly one of cmd and argv");
        return NULL;
    }
    if (cmd != NULL && cmd[0] == '\0') {
        sp_err_set(err, SP_EINVAL, "cmd is empty");
        return NULL;
    }
    if (argv != NULL && (!json_is_array(argv) || json_array_size(argv) == 0 ||
                         json_array_size(argv) > SP_AP_MAX_ARGV)) {
        sp_err_set(err, SP_EINVAL, "argv must be an array of 1 to %d strings", SP_AP_MAX_ARGV);
        return NULL;
    }
    if (user != NULL && user[0] == '\0') {
        sp_err_set(err, SP_EINVAL, "user is empty");
        return NULL;
    }
    if (bg && (in != NULL || timeout_s != 0 || stream)) {
        sp_err_set(err, SP_EINVAL,
                   "background commands take no stdin, timeout_s or stream (use .../stdin)");
        return NULL;
    }
    if ((rows != 0 || cols != 0) && !pty) {
        sp_err_set(err, SP_EINVAL, "rows and cols need pty");
        return NULL;
    }
    size_t nargv = argv ? json_array_size(argv) : 0, nenv = env ? json_object_size(env) : 0;
    runspec_t *r = calloc(1, sizeof(*r));
    if (r == NULL || (r->strs = calloc(nargv + nenv + 8, sizeof(char *))) == NULL ||
        (nargv && (r->cmd.argv = calloc(nargv, sizeof(char *))) == NULL) ||
        (nenv && (r->cmd.env = calloc(nenv, sizeof(char *))) == NULL)) {
        if (r != NULL)
            runspec_free(r);
        sp_err_set(err, SP_EINTERNAL, "out of memory");
        return NULL;
    }
    const char **av = (const char **)r->cmd.argv, **ev = (const char **)r->cmd.env;
    for (size_t i = 0; i < nargv; i++) {
        json_t *a = json_array_get(argv, i);
        if (!json_is_string(a) || strlen(json_string_value(a)) != json_string_length(a)) {
            runspec_free(r);
            sp_err_set(err, SP_EINVAL, "argv must hold strings without NUL characters");
            return NULL;
        }
        av[i] = keep(r, json_string_value(a), json_string_length(a));
    }
    r->cmd.argc = nargv;
    const char *k;
    json_t *v;
    size_t ne = 0;
    json_object_foreach(env, k, v)
    {
        if (strchr(k, '=') != NULL) {
            runspec_free(r);
            sp_err_set(err, SP_EINVAL, "env names may not contain '='");
            return NULL;
        }
        size_t kl = strlen(k), vl = json_string_length(v);
        char *kv = malloc(kl + vl + 2);
        if (kv == NULL)
            break;
        memcpy(kv, k, kl);
        kv[kl] = '=';
        memcpy(kv + kl + 1, json_string_value(v), vl);
        kv[kl + 1 + vl] = '\0';
        r->strs[r->nstrs++] = kv;
        ev[ne++] = kv;
    }
    r->cmd.envc = ne;
    r->cmd.cmd = cmd ? keep(r, cmd, strlen(cmd)) : NULL;
    r->cmd.cwd = cwd ? keep(r, cwd, strlen(cwd)) : NULL;
    r->cmd.user = user ? keep(r, user, strlen(user)) : NULL;
    r->cmd.tag = tag ? keep(r, tag, strlen(tag)) : NULL;
    r->cmd.pty = pty;
    r->cmd.rows = rows;
    r->cmd.cols = cols;
    /* Foreground: stdin is the given text then EOF, else /dev/null (nothing can write to it
     * later). Background: a pipe, written through .../stdin. */
    r->cmd.stdin_pipe = bg || in != NULL;
    if (in != NULL) {
        r->cmd.stdin_data = keep(r, in, strlen(in));
        r->cmd.stdin_len = strlen(in);
        r->cmd.stdin_eof = true;
    }
    r->cmd.timeout_ms = timeout_s * 1000u;
    r->background = bg;
    r->stream = stream;
    return r;
}

/* ---- NDJSON streaming: a command's events as lines ---- */

typedef struct {
    napi_ctx_t *c; /* until the response starts */
    sp_stream_t *st;
    sp_exec_t *op;
    uint8_t carry[2][4]; /* an incomplete UTF-8 sequence at the end of a chunk, per fd */
    size_t ncarry[2];
    char *line;          /* scratch for one event line */
    size_t line_cap;
} cmdstream_t;

static void cs_free(cmdstream_t *cs)
{
    free(cs->line);
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
    cs->st = NULL;
    sp_exec_cancel(cs->op); /* detaches: the process keeps running */
    cs_free(cs);
}

static const sp_stream_cbs_t cs_cbs = {cs_sent, cs_gone};

static int cs_emit(cmdstream_t *cs, json_t *o, size_t raw)
{
    char *s = json_dumps(o, JSON_COMPACT);
    json_decref(o);
    if (s == NULL)
        return -1;
    size_t n = strlen(s);
    s[n] = '\n';
    int rc = sp_stream_write(cs->st, s, n + 1, raw);
    free(s);
    return rc;
}

/* Output bytes as a line; the UTF-8 carry keeps characters split across chunks whole. */
static int cs_output(cmdstream_t *cs, int fd, const uint8_t *p, size_t n, bool final)
{
    size_t total = cs->ncarry[fd] + n;
    size_t need = total * 3 + 1 + total; /* the output area, then the staged input */
    if (need > cs->line_cap) {
        char *nb = realloc(cs->line, need);
        if (nb == NULL)
            return -1;
        cs->line = nb;
        cs->line_cap = need;
    }
    /* Input staged after the output area: [0, 3*total] output, then the input bytes. */
    uint8_t *in = (uint8_t *)cs->line + total * 3 + 1;
    memcpy(in, cs->carry[fd], cs->ncarry[fd]);
    memcpy(in + cs->ncarry[fd], p, n);
    size_t used = 0;
    size_t len = sp_exec_utf8_clean(in, total, cs->line, final, &used);
    cs->ncarry[fd] = total - used; /* at most 3: an incomplete sequence */
    memcpy(cs->carry[fd], in + used, cs->ncarry[fd]);
    if (len == 0)
        return sp_stream_write(cs->st, "", 0, n); /* nothing to show yet: credit back */
    json_t *o = json_object();
    json_object_set_new(o, "type", json_string(fd == 0 ? "stdout" : "stderr"));
    json_object_set_new(o, "data", json_stringn_nocheck(cs->line, len));
    return cs_emit(cs, o, n);
}

static json_t *exit_json(bool exited, int code, int sig, bool timed_out)
{
    json_t *o = json_object();
    json_object_set_new(o, "exit_code", exited ? json_integer(code) : json_null());
    json_object_set_new(o, "signal", sig ? json_integer(sig) : json_null());
    json_object_set_new(o, "timed_out", json_boolean(timed_out));
    return o;
}

static void cs_event(void *arg, const sp_exec_ev_t *ev)
{
    cmdstream_t *cs = arg;
    if (cs->st == NULL) {
        /* Not started: the first event decides between a JSON error and the stream. */
        bool failed = ev->type == SP_EXEC_EV_ERROR;
        cs->st = sp_napi__ndjson_begin(cs->c, failed ? ev->err : NULL, &cs_cbs, cs);
        cs->c = NULL;
        if (cs->st == NULL) {
            if (!failed)
                sp_exec_cancel(cs->op);
            cs_free(cs);
            return;
        }
        char id[16];
        snprintf(id, sizeof(id), "%u", ev->pid);
        cs_emit(cs, json_pack("{s:s,s:s,s:i}", "type", "start", "id", id, "pid", (int)ev->pid), 0);
        if (ev->type == SP_EXEC_EV_START)
            return;
    }
    switch (ev->type) {
    case SP_EXEC_EV_START:
        return;
    case SP_EXEC_EV_STDOUT:
    case SP_EXEC_EV_STDERR:
        if (cs_output(cs, ev->type == SP_EXEC_EV_STDOUT ? 0 : 1, ev->data, ev->len, false) < 0) {
            /* Out of memory: cut the response; the process keeps running. */
            sp_exec_cancel(cs->op);
            sp_stream_end(cs->st, NULL, 0, false);
            cs_free(cs);
        }
        return;
    case SP_EXEC_EV_EXIT: {
        for (int fd = 0; fd < 2; fd++)
            if (cs->ncarry[fd] > 0)
                cs_output(cs, fd, NULL, 0, true);
        json_t *o = exit_json(ev->exited, ev->exit_code, ev->signal, ev->timed_out);
        json_object_set_new(o, "type", json_string("exit"));
        cs_emit(cs, o, 0);
        sp_stream_end(cs->st, NULL, 0, true);
        cs_free(cs);
        return;
    }
    case SP_EXEC_EV_ERROR:
        cs_emit(cs,
                json_pack("{s:s,s:{s:s,s:s}}", "type", "error", "error", "code",
                          sp_err_name(ev->err->code), "message", ev->err->msg),
                0);
        sp_stream_end(cs->st, NULL, 0, true);
        cs_free(cs);
        return;
    }
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
    runspec_t *r;
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
    json_t *o = exit_json(res->exited, res->exit_code, res->signal, res->timed_out);
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
    runspec_t *r = c->data;
    c->data = NULL; /* ours now: freed below, whatever happens to c */
    sp_err_t e;
    sp_loop_t *loop = sp_napi__loop(c);
    if (r->background) {
        if (sp_exec_spawn(loop, conn, &r->cmd, on_spawned, c, &e) == NULL)
            sp_napi__fail(c, &e);
    } else if (r->stream) {
        cmdstream_t *cs = cs_new(c);
        if (cs == NULL)
            sp_napi__fail(c, (sp_err_set(&e, SP_EINTERNAL, "out of memory"), &e));
        else if ((cs->op = sp_exec_stream(loop, conn, &r->cmd, cs_event, cs, &e)) == NULL) {
            cs_free(cs);
            sp_napi__fail(c, &e);
        }
    } else {
        if (sp_exec_run(loop, conn, &r->cmd, 0, on_ran, c, &e) == NULL)
            sp_napi__fail(c, &e);
    }
    runspec_free(r); /* exec copied what it keeps */
}

void sp_napi__commands_run(napi_ctx_t *c)
{
    sp_err_t e;
    runspec_t *r = parse_run(c->body, sp_http_hold_req(c->hold), &e);
    if (r == NULL) {
        sp_napi__fail(c, &e);
        return;
    }
    c->data = r; /* kept across the sandbox lookup; freed with c if it fails */
    c->data_free = runspec_free_v;
    sp_napi__with_agent(c, run_with_agent);
}

/* ---- GET .../commands ---- */

static void on_listed(void *arg, json_t *procs, const sp_err_t *err)
{
    napi_ctx_t *c = arg;
    if (err != NULL)
        sp_napi__fail(c, err);
    else
        sp_napi__reply(c, 200, json_pack("{s:O}", "commands", procs));
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

static void stdin_with_agent(napi_ctx_t *c, sp_agentconn_t *conn)
{
    sp_err_t e;
    json_t *d = json_object_get(c->body, "data");
    bool eof = json_is_true(json_object_get(c->body, "eof"));
    const char *s = d && json_is_string(d) ? json_string_value(d) : "";
    size_t n = d && json_is_string(d) ? json_string_length(d) : 0;
    if (sp_exec_stdin(sp_napi__loop(c), conn, parse_cid(c->segs[4]), s, n, eof, on_ctrl, c, &e) ==
        NULL)
        sp_napi__fail(c, &e);
}

void sp_napi__commands_stdin(napi_ctx_t *c)
{
    static const char *const allowed[] = {"data", "eof", NULL};
    sp_err_t e;
    json_t *b = c->body;
    bool eof = false;
    json_t *d = b ? json_object_get(b, "data") : NULL;
    if (b == NULL)
        sp_err_set(&e, SP_EINVAL, "request body must be a JSON object");
    if (b == NULL || sp_napi__only_keys(b, allowed, &e) < 0 ||
        get_bool(b, "eof", &eof, &e) < 0 ||
        (d != NULL && !json_is_string(d) && !json_is_null(d)
             ? sp_err_set(&e, SP_EINVAL, "data must be a string")
             : 0) < 0 ||
        ((d == NULL || json_is_null(d)) && !eof
             ? sp_err_set(&e, SP_EINVAL, "give data, eof or both")
             : 0) < 0) {
        sp_napi__fail(c, &e);
        return;
    }
    if (check_cid(c))
        sp_napi__with_agent(c, stdin_with_agent);
}

static void signal_with_agent(napi_ctx_t *c, sp_agentconn_t *conn)
{
    sp_err_t e;
    json_t *sv = json_object_get(c->body, "signal");
    int sig = json_is_integer(sv) ? (int)json_integer_value(sv)
                                  : sp_exec_signal_number(json_string_value(sv));
    json_t *g = json_object_get(c->body, "group");
    bool group = g == NULL || json_is_null(g) || json_is_true(g);
    if (sp_exec_signal(sp_napi__loop(c), conn, parse_cid(c->segs[4]), sig, group, on_ctrl, c,
                       &e) == NULL)
        sp_napi__fail(c, &e);
}

void sp_napi__commands_signal(napi_ctx_t *c)
{
    static const char *const allowed[] = {"signal", "group", NULL};
    sp_err_t e;
    json_t *b = c->body;
    bool group = true;
    json_t *sv = b ? json_object_get(b, "signal") : NULL;
    int sig = -1;
    if (sv != NULL && json_is_integer(sv) && json_integer_value(sv) >= 1 &&
        json_integer_value(sv) <= 64)
        sig = (int)json_integer_value(sv);
    else if (sv != NULL && json_is_string(sv))
        sig = sp_exec_signal_number(json_string_value(sv));
    if (b == NULL)
        sp_err_set(&e, SP_EINVAL, "request body must be a JSON object");
    if (b == NULL || sp_napi__only_keys(b, allowed, &e) < 0 || get_bool(b, "group", &group, &e) < 0 ||
        (sig < 0 ? sp_err_set(&e, SP_EINVAL,
                              "signal must be a name like \"SIGTERM\" or a number from 1 to 64")
                 : 0) < 0) {
        sp_napi__fail(c, &e);
        return;
    }
    if (check_cid(c))
        sp_napi__with_agent(c, signal_with_agent);
}
