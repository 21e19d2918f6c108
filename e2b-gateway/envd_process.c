/*
 * envd_process.c - process.Process over core/channel/exec.h: Start, Connect, List, SendInput,
 * StreamInput, SendSignal, CloseStdin, Update.
 *
 * A Start/Connect stream passes the process's output agent -> envelope -> client, and the
 * agent gets credit back only once h2o took the envelope (proceed), so a client that does not
 * read (background commands) holds one agent window here, never more. Keepalive events go
 * out after Keepalive-Ping-Interval seconds without another event. A client that leaves only
 * detaches: the process keeps running. connect-timeout-ms on Start is the process's lifetime:
 * while attached exec kills the process group at expiry (the stream then ends with
 * deadline_exceeded); once detached core/channel/proctab.h keeps the deadline.
 *
 * Owns nothing past a call: what Start started a process with (List reports cmd/args/envs/cwd
 * from it; the agent itself keeps only a joined argv) is recorded in core/channel/proctab.h.
 */
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "base/buf.h"
#include "e2b-gateway/envd_int.h"

/* ---- process records (core/channel/proctab.h) ---- */

/* A Start request's process as a record: arrays in a, strings borrowed from the request. NULL
 * when out of memory (the process then goes unrecorded). */
static const sp_proc_spec_t *spec_of(const sp_cp_config_t *cfg, bool pty, sp_carena_t *a)
{
    sp_proc_spec_t *sp = sp_carena_alloc(a, sizeof(*sp));
    sp_proc_env_t *envs = sp_carena_alloc(a, (cfg->n_envs + 1) * sizeof(*envs));
    if (sp == NULL || envs == NULL)
        return NULL;
    for (size_t i = 0; i < cfg->n_envs; i++)
        envs[i] = (sp_proc_env_t){cfg->envs[i].key, cfg->envs[i].value};
    *sp = (sp_proc_spec_t){.cmd = cfg->cmd ? cfg->cmd : "",
                           .args = cfg->args,
                           .nargs = cfg->n_args,
                           .envs = envs,
                           .nenvs = cfg->n_envs,
                           .cwd = cfg->has_cwd ? cfg->cwd : NULL,
                           .pty = pty};
    return sp;
}

/* A record as the wire's ProcessConfig: arrays in a, strings borrowed from the table (the
 * reply is encoded before the table changes). */
static int config_of(const sp_proc_spec_t *sp, sp_cp_config_t *cfg, sp_carena_t *a)
{
    const char **args = sp_carena_alloc(a, (sp->nargs + 1) * sizeof(*args));
    sp_ckv_t *envs = sp_carena_alloc(a, (sp->nenvs + 1) * sizeof(*envs));
    if (args == NULL || envs == NULL)
        return -1;
    for (size_t i = 0; i < sp->nargs; i++)
        args[i] = sp->args[i];
    for (size_t i = 0; i < sp->nenvs; i++)
        envs[i] = (sp_ckv_t){sp->envs[i].key, sp->envs[i].value};
    *cfg = (sp_cp_config_t){.cmd = sp->cmd,
                            .args = args,
                            .n_args = sp->nargs,
                            .envs = envs,
                            .n_envs = sp->nenvs,
                            .cwd = sp->cwd,
                            .has_cwd = sp->cwd != NULL};
    return 0;
}

int sp_e2b__envd_agent(void *gw, const char *sandbox_id, const char *team_id,
                       sp_proctab_agent_cb cb, void *arg)
{
    sp_auth_t auth = {0};
    snprintf(auth.team_id, sizeof(auth.team_id), "%s", team_id);
    sp_err_t e;
    return sp_svc_sandbox_agent(((sp_e2b_t *)gw)->svc, &auth, sandbox_id, cb, arg, &e);
}

/* ---- Start / Connect streams ---- */

typedef struct {
    struct sp_envd *ev;
    envd_call_t *c; /* until the response starts */
    sp_stream_t *st;
    sp_exec_t *op;
    sp_connect_codec_t codec;
    bool is_start, pty, started, gone;
    uint32_t pid;
    sp_timer_t ka; /* keepalive */
    uint32_t ka_ms;
    sp_timer_t deadline;  /* Connect: connect-timeout-ms bounds the stream */
    uint32_t timeout_ms;  /* Start: lifetime */
    uint64_t deadline_at; /* loop ms */
    char sandbox_id[65];
    sp_auth_t auth;
    const sp_proc_spec_t *spec; /* Start: in c's arena, recorded at START (c still lives) */
    int depth;
} pst_t;

static void pst_free(pst_t *s)
{
    sp_timer_stop(&s->ka);
    sp_timer_stop(&s->deadline);
    if (s->c != NULL)
        sp_e2b__envd_call_free(s->c);
    free(s);
}

/* The client left (or never got the stream): detach, leaving the lifetime to a timer. */
static void pst_detach(pst_t *s)
{
    sp_exec_cancel(s->op);
    s->op = NULL;
    if (s->is_start && s->timeout_ms > 0 && s->pid != 0) {
        uint64_t now = sp_loop_now_ms(s->ev->loop);
        uint64_t left = s->deadline_at > now ? s->deadline_at - now : 1;
        sp_proctab_kill_after(s->ev->procs, s->sandbox_id, s->auth.team_id, s->pid, left);
    }
    pst_free(s);
}

static void pst_sent(void *arg, size_t raw)
{
    pst_t *s = arg;
    sp_exec_ack(s->op, raw);
}

static void pst_gone(void *arg)
{
    pst_t *s = arg;
    s->st = NULL; /* freed by connectrpc after this call */
    pst_detach(s);
}

static const sp_stream_cbs_t pst_cbs = {pst_sent, pst_gone};

/* Starts the response; false when the client is gone (s is then freed, op detached). */
static bool pst_begin(pst_t *s)
{
    if (s->st != NULL)
        return true;
    h2o_req_t *req = sp_e2b__envd_take(s->c);
    s->c = NULL;
    if (req != NULL)
        s->st = sp_stream_start(req, 200, sp_connect_stream_ctype(s->codec), -1, &pst_cbs, s);
    if (s->st == NULL) {
        if (req != NULL)
            sp_connect_reply_error(req, SP_CC_INTERNAL, "out of memory");
        pst_detach(s);
        return false;
    }
    return true;
}

static void pst_ka_arm(pst_t *s)
{
    sp_timer_start(&s->ka, s->ka_ms);
}

static int pst_send(pst_t *s, const sp_cp_event_t *ev, size_t raw)
{
    sp_cp_event_resp_t r = {.event = *ev, .has_event = true};
    pst_ka_arm(s);
    return sp_connect_stream_msg(s->st, s->codec, &sp_cd_event_resp, &r, raw);
}

static void pst_ka(sp_timer_t *t, void *arg)
{
    pst_t *s = arg;
    if (s->st == NULL)
        return;
    sp_cp_event_t ev = {.has_keepalive = true};
    if (pst_send(s, &ev, 0) < 0) {
        sp_exec_cancel(s->op);
        s->op = NULL;
        sp_stream_end(s->st, NULL, 0, false);
        s->st = NULL;
        pst_free(s);
    }
}

static void pst_deadline(sp_timer_t *t, void *arg)
{
    pst_t *s = arg;
    if (s->is_start) {
        /* Start: the process's lifetime passed and the agent has not reported it killed yet
         * (a loaded guest's timers run late). End the stream now, as envd's context does, so
         * the client sees deadline_exceeded before its own read timeout; the kill is left to
         * the agent's timer and, detached, the process table's (at once: the time is up). */
        sp_exec_cancel(s->op);
        s->op = NULL;
        if (s->pid != 0)
            sp_proctab_kill_after(s->ev->procs, s->sandbox_id, s->auth.team_id, s->pid, 1);
        if (s->st == NULL && !pst_begin(s))
            return;
        /* The end event envd sends for a process its context killed. */
        sp_cp_event_t ev = {.has_end = true};
        ev.end.exited = false;
        ev.end.exit_code = -1;
        ev.end.status = "signal: killed";
        ev.end.error = "context deadline exceeded";
        ev.end.has_error = true;
        pst_send(s, &ev, 0);
        sp_connect_stream_finish(s->st, SP_CC_DEADLINE_EXCEEDED,
                                 "the command's timeout (connect-timeout-ms) passed");
        s->st = NULL;
        pst_free(s);
        return;
    }
    sp_exec_cancel(s->op); /* Connect: the stream ends, the process goes on */
    s->op = NULL;
    if (s->st == NULL && !pst_begin(s))
        return;
    sp_connect_stream_finish(s->st, SP_CC_DEADLINE_EXCEEDED, "stream deadline exceeded");
    s->st = NULL;
    pst_free(s);
}

static const char *signame(int sig)
{
    switch (sig) {
    case SIGKILL:
        return "killed";
    case SIGTERM:
        return "terminated";
    case SIGINT:
        return "interrupt";
    case SIGHUP:
        return "hangup";
    case SIGQUIT:
        return "quit";
    case SIGABRT:
        return "aborted";
    case SIGSEGV:
        return "segmentation fault";
    case SIGPIPE:
        return "broken pipe";
    case SIGBUS:
        return "bus error";
    case SIGFPE:
        return "floating point exception";
    case SIGUSR1:
        return "user defined signal 1";
    case SIGUSR2:
        return "user defined signal 2";
    default:
        return NULL;
    }
}

static void pst_event(void *arg, const sp_exec_ev_t *e)
{
    pst_t *s = arg;
    switch (e->type) {
    case SP_EXEC_EV_START: {
        s->pid = e->pid;
        s->started = true;
        if (s->spec != NULL && s->c != NULL)
            sp_proctab_put(s->ev->procs, s->sandbox_id, e->pid, s->spec);
        s->spec = NULL;
        if (!pst_begin(s))
            return;
        sp_cp_event_t ev = {.has_start = true, .start = {.pid = e->pid}};
        if (pst_send(s, &ev, 0) < 0)
            goto broken;
        return;
    }
    case SP_EXEC_EV_STDOUT:
    case SP_EXEC_EV_STDERR: {
        sp_cp_event_t ev = {.has_data = true};
        sp_cbytes_t b = {e->data, e->len};
        if (s->pty)
            ev.data.pty = b, ev.data.has_pty = true;
        else if (e->type == SP_EXEC_EV_STDOUT)
            ev.data.out = b, ev.data.has_out = true;
        else
            ev.data.err = b, ev.data.has_err = true;
        if (s->st == NULL && !pst_begin(s))
            return;
        if (pst_send(s, &ev, e->len) < 0)
            goto broken;
        return;
    }
    case SP_EXEC_EV_EXIT: {
        s->op = NULL; /* terminal */
        sp_proctab_forget(s->ev->procs, s->sandbox_id, s->pid);
        if (s->st == NULL && !pst_begin(s))
            return;
        char status[64];
        const char *sn = signame(e->signal);
        if (e->exited)
            snprintf(status, sizeof(status), "exit status %d", e->exit_code);
        else if (e->signal != 0 && sn != NULL)
            snprintf(status, sizeof(status), "signal: %s", sn);
        else if (e->signal != 0)
            snprintf(status, sizeof(status), "signal: %d", e->signal);
        else
            snprintf(status, sizeof(status), "unknown");
        sp_cp_event_t ev = {.has_end = true};
        ev.end.exited = e->exited;
        ev.end.exit_code = e->exited ? e->exit_code : -1;
        ev.end.status = status;
        if (e->timed_out) {
            ev.end.error = "context deadline exceeded";
            ev.end.has_error = true;
        } else if (!e->exited || e->exit_code != 0) {
            /* envd reports Go's cmd.Wait() error, which reads as the status ("exit status 3",
             * "signal: killed"); the SDKs put it in CommandExitError.error. */
            ev.end.error = status;
            ev.end.has_error = true;
        }
        pst_send(s, &ev, 0);
        if (e->timed_out)
            sp_connect_stream_finish(s->st, SP_CC_DEADLINE_EXCEEDED,
                                     "the command's timeout (connect-timeout-ms) passed");
        else
            sp_connect_stream_finish(s->st, SP_CC_OK, NULL);
        s->st = NULL;
        pst_free(s);
        return;
    }
    case SP_EXEC_EV_ERROR: {
        s->op = NULL;
        if (s->st == NULL) {
            /* Nothing sent yet: a plain Connect error (non-200, spec 3.1). */
            envd_call_t *c = s->c;
            s->c = NULL;
            sp_connect_code_t code = sp_e2b__envd_code(e->err);
            if (code == SP_CC_ALREADY_EXISTS) /* exec: "command has exited" */
                code = SP_CC_NOT_FOUND;
            sp_e2b__envd_fail(c, code, e->err->msg);
        } else {
            sp_connect_stream_finish(s->st, sp_e2b__envd_code(e->err), e->err->msg);
            s->st = NULL;
        }
        pst_free(s);
        return;
    }
    }
    return;
broken:
    sp_exec_cancel(s->op);
    s->op = NULL;
    sp_stream_end(s->st, NULL, 0, false);
    s->st = NULL;
    pst_free(s);
}

static pst_t *pst_new(envd_call_t *c, bool is_start)
{
    pst_t *s = calloc(1, sizeof(*s));
    if (s == NULL)
        return NULL;
    s->ev = c->ev;
    s->c = c;
    s->codec = c->cr.codec;
    s->is_start = is_start;
    s->ka_ms = c->cr.keepalive_s * 1000u;
    snprintf(s->sandbox_id, sizeof(s->sandbox_id), "%s", c->sandbox_id);
    s->auth = c->auth;
    sp_timer_init(&s->ka, c->ev->loop, pst_ka, s);
    sp_timer_init(&s->deadline, c->ev->loop, pst_deadline, s);
    return s;
}

static void rpc_start(envd_call_t *c)
{
    sp_cp_start_req_t *m = c->msg;
    if (!c->cr.streaming) {
        sp_e2b__envd_fail(c, SP_CC_INVALID_ARGUMENT, "Start is a server-streaming RPC");
        return;
    }
    if (!m->has_process || m->process.cmd == NULL || m->process.cmd[0] == '\0') {
        sp_e2b__envd_fail(c, SP_CC_INVALID_ARGUMENT, "process.cmd is required");
        return;
    }
    if (m->process.n_args + 1 > SP_AP_MAX_ARGV || m->process.n_envs > SP_AP_MAX_ENV) {
        sp_e2b__envd_fail(c, SP_CC_INVALID_ARGUMENT, "too many args or envs");
        return;
    }
    const char **argv = sp_carena_alloc(&c->arena, (m->process.n_args + 1) * sizeof(char *));
    const char **env = sp_carena_alloc(&c->arena, (m->process.n_envs + 1) * sizeof(char *));
    if (argv == NULL || env == NULL) {
        sp_e2b__envd_fail(c, SP_CC_RESOURCE_EXHAUSTED, "request too large");
        return;
    }
    argv[0] = m->process.cmd;
    for (size_t i = 0; i < m->process.n_args; i++)
        argv[i + 1] = m->process.args[i];
    for (size_t i = 0; i < m->process.n_envs; i++) {
        const sp_ckv_t *kv = &m->process.envs[i];
        size_t kl = strlen(kv->key), vl = strlen(kv->value);
        if (kl == 0 || strchr(kv->key, '=') != NULL) {
            sp_e2b__envd_fail(c, SP_CC_INVALID_ARGUMENT, "env names must be non-empty, no '='");
            return;
        }
        char *s = sp_carena_alloc(&c->arena, kl + vl + 2);
        if (s == NULL) {
            sp_e2b__envd_fail(c, SP_CC_RESOURCE_EXHAUSTED, "request too large");
            return;
        }
        memcpy(s, kv->key, kl);
        s[kl] = '=';
        memcpy(s + kl + 1, kv->value, vl + 1);
        env[i] = s;
    }
    bool pty = m->has_pty;
    uint32_t rows = 0, cols = 0;
    if (pty && m->pty.has_size) {
        rows = m->pty.size.rows;
        cols = m->pty.size.cols;
        if (rows > 1000 || cols > 1000) {
            sp_e2b__envd_fail(c, SP_CC_INVALID_ARGUMENT, "pty size must be at most 1000");
            return;
        }
    }
    sp_exec_cmd_t cmd = {
        .argv = argv,
        .argc = m->process.n_args + 1,
        .env = env,
        .envc = m->process.n_envs,
        .cwd = m->process.has_cwd && m->process.cwd[0] ? m->process.cwd : NULL,
        .user = c->user,
        .tag = m->has_tag ? m->tag : NULL,
        .pty = pty,
        .rows = rows,
        .cols = cols,
        /* envd: stdin is open unless the client said stdin=false. */
        .stdin_pipe = !m->has_stdin || m->stdin_open || pty,
        .timeout_ms = c->cr.timeout_ms,
    };
    pst_t *s = pst_new(c, true);
    if (s == NULL) {
        sp_e2b__envd_fail(c, SP_CC_INTERNAL, "out of memory");
        return;
    }
    s->pty = pty;
    s->timeout_ms = c->cr.timeout_ms;
    s->deadline_at = sp_loop_now_ms(c->ev->loop) + c->cr.timeout_ms;
    s->spec = spec_of(&m->process, pty, &c->arena);
    sp_err_t e;
    s->op = sp_exec_stream(c->ev->loop, c->conn, &cmd, pst_event, s, &e);
    if (s->op == NULL) {
        s->c = NULL;
        pst_free(s);
        sp_e2b__envd_fail_err(c, &e);
        return;
    }
    if (s->timeout_ms > 0)
        sp_timer_start(&s->deadline, s->timeout_ms); /* from the request's arrival, as envd */
}

/* ---- selectors: pid, or tag through the agent's list ---- */

typedef void (*pid_next_t)(envd_call_t *c, uint32_t pid);

typedef struct {
    envd_call_t *c;
    pid_next_t next;
    const char *tag; /* NULL: by pid */
    uint32_t pid;
} bytag_t;

static void bytag_listed(void *arg, json_t *procs, bool truncated, const sp_err_t *err)
{
    bytag_t *b = arg;
    envd_call_t *c = b->c;
    pid_next_t next = b->next;
    const char *tag = b->tag;
    uint32_t want = b->pid;
    free(b);
    if (err != NULL) {
        sp_e2b__envd_fail_err(c, err);
        return;
    }
    size_t i;
    json_t *p;
    json_array_foreach(procs, i, p)
    {
        const char *t = json_string_value(json_object_get(p, "tag"));
        uint32_t pid = (uint32_t)json_integer_value(json_object_get(p, "pid"));
        bool match = tag != NULL ? t != NULL && strcmp(t, tag) == 0 : pid == want;
        if (match && json_is_true(json_object_get(p, "running"))) {
            next(c, pid);
            return;
        }
    }
    sp_e2b__envd_fail(c, SP_CC_NOT_FOUND, tag ? "no process with this tag" : "process not found");
}

/* live: also look a pid up, so that an exited process is not_found (envd forgets it). */
static void with_pid_ex(envd_call_t *c, bool has, const sp_cp_selector_t *sel, pid_next_t next,
                        bool live)
{
    if (!has || (!sel->has_pid && !sel->has_tag)) {
        sp_e2b__envd_fail(c, SP_CC_INVALID_ARGUMENT, "process selector (pid or tag) is required");
        return;
    }
    if (sel->has_pid && !live) {
        next(c, sel->pid);
        return;
    }
    bytag_t *b = calloc(1, sizeof(*b));
    if (b == NULL) {
        sp_e2b__envd_fail(c, SP_CC_INTERNAL, "out of memory");
        return;
    }
    b->c = c;
    b->next = next;
    b->tag = sel->has_pid ? NULL : sel->tag;
    b->pid = sel->pid;
    sp_err_t e;
    if (sp_exec_list(c->ev->loop, c->conn, bytag_listed, b, &e) == NULL) {
        free(b);
        sp_e2b__envd_fail_err(c, &e);
    }
}

static void with_pid(envd_call_t *c, bool has, const sp_cp_selector_t *sel, pid_next_t next)
{
    with_pid_ex(c, has, sel, next, false);
}

/* ---- Connect ---- */

static void connect_pid(envd_call_t *c, uint32_t pid)
{
    pst_t *s = pst_new(c, false);
    if (s == NULL) {
        sp_e2b__envd_fail(c, SP_CC_INTERNAL, "out of memory");
        return;
    }
    uint32_t to = c->cr.timeout_ms;
    sp_err_t e;
    s->op = sp_exec_attach(c->ev->loop, c->conn, pid, true, pst_event, s, &e);
    if (s->op == NULL) {
        s->c = NULL;
        pst_free(s);
        sp_e2b__envd_fail(c, e.code == SP_ENOTFOUND ? SP_CC_NOT_FOUND : sp_e2b__envd_code(&e),
                          e.msg);
        return;
    }
    /* Output of a PTY process started through Start goes out as pty bytes again. */
    const sp_proc_spec_t *known = sp_proctab_get(c->ev->procs, c->sandbox_id, pid);
    s->pty = known != NULL && known->pty;
    if (to > 0)
        sp_timer_start(&s->deadline, to);
}

static void rpc_connect(envd_call_t *c)
{
    sp_cp_select_req_t *m = c->msg;
    if (!c->cr.streaming) {
        sp_e2b__envd_fail(c, SP_CC_INVALID_ARGUMENT, "Connect is a server-streaming RPC");
        return;
    }
    with_pid_ex(c, m->has_process, &m->process, connect_pid, true);
}

/* ---- List ---- */

static void list_done(void *arg, json_t *procs, bool truncated, const sp_err_t *err)
{
    envd_call_t *c = arg;
    if (err != NULL) {
        sp_e2b__envd_fail_err(c, err);
        return;
    }
    if (truncated)
        sp_e2b__envd_truncated(c);
    sp_cp_list_resp_t r = {0};
    size_t n = json_array_size(procs);
    r.processes = sp_carena_alloc(&c->arena, (n + 1) * sizeof(sp_cp_info_t));
    if (r.processes == NULL) {
        sp_e2b__envd_fail(c, SP_CC_RESOURCE_EXHAUSTED, "too many processes");
        return;
    }
    size_t i;
    json_t *p;
    json_array_foreach(procs, i, p)
    {
        if (!json_is_true(json_object_get(p, "running")))
            continue;
        uint32_t pid = (uint32_t)json_integer_value(json_object_get(p, "pid"));
        sp_cp_info_t *info = &r.processes[r.n_processes++];
        info->pid = pid;
        info->has_config = true;
        const char *tag = json_string_value(json_object_get(p, "tag"));
        if (tag != NULL) {
            info->tag = sp_e2b__envd_strdup(&c->arena, tag);
            info->has_tag = info->tag != NULL;
        }
        const sp_proc_spec_t *known = sp_proctab_get(c->ev->procs, c->sandbox_id, pid);
        if (known != NULL && config_of(known, &info->config, &c->arena) == 0)
            continue;
        /* Not started through Start (or forgotten): the agent's joined argv, split. */
        const char *cmd = json_string_value(json_object_get(p, "cmd"));
        char *line = (char *)sp_e2b__envd_strdup(&c->arena, cmd ? cmd : "");
        if (line == NULL)
            continue;
        size_t cap = 8, na = 0;
        const char **args = sp_carena_alloc(&c->arena, cap * sizeof(char *));
        char *save = NULL;
        char *tok = strtok_r(line, " ", &save);
        info->config.cmd = tok ? tok : "";
        while (args != NULL && (tok = strtok_r(NULL, " ", &save)) != NULL) {
            if (na == cap) {
                const char **nb = sp_carena_alloc(&c->arena, cap * 2 * sizeof(char *));
                if (nb == NULL)
                    break;
                memcpy(nb, args, cap * sizeof(char *));
                args = nb;
                cap *= 2;
            }
            args[na++] = tok;
        }
        info->config.args = args;
        info->config.n_args = args ? na : 0;
        const char *cwd = json_string_value(json_object_get(p, "cwd"));
        if (cwd != NULL) {
            info->config.cwd = sp_e2b__envd_strdup(&c->arena, cwd);
            info->config.has_cwd = info->config.cwd != NULL;
        }
    }
    /* Forget the records of processes that are gone (not after a truncated list: it may leave
     * running ones out). Those r refers to are of running processes, so they stay. */
    uint32_t *running = truncated
                            ? NULL /* processes may be missing from it */
                            : sp_carena_alloc(&c->arena, (r.n_processes + 1) * sizeof(*running));
    if (running != NULL) {
        for (size_t k = 0; k < r.n_processes; k++)
            running[k] = r.processes[k].pid;
        sp_proctab_retain(c->ev->procs, c->sandbox_id, running, r.n_processes);
    }
    sp_e2b__envd_reply(c, &sp_cd_list_resp, &r);
}

static void rpc_list(envd_call_t *c)
{
    sp_err_t e;
    if (sp_exec_list(c->ev->loop, c->conn, list_done, c, &e) == NULL)
        sp_e2b__envd_fail_err(c, &e);
}

/* ---- unary controls ---- */

static void ctrl_done(void *arg, const sp_err_t *err)
{
    envd_call_t *c = arg;
    if (err != NULL) {
        /* envd forgets exited processes: both unknown and exited are not_found. */
        if (err->code == SP_ENOTFOUND || err->code == SP_ECONFLICT)
            sp_e2b__envd_fail(c, SP_CC_NOT_FOUND, err->msg);
        else
            sp_e2b__envd_fail_err(c, err);
        return;
    }
    sp_cempty_t empty = {0};
    sp_e2b__envd_reply(c, &sp_cd_empty, &empty);
}

static void ctrl_started(envd_call_t *c, sp_exec_t *op, const sp_err_t *e)
{
    if (op == NULL)
        ctrl_done(c, e);
}

static void input_pid(envd_call_t *c, uint32_t pid)
{
    sp_cp_send_input_req_t *m = c->msg;
    const sp_cbytes_t *b = m->input.has_pty ? &m->input.pty : &m->input.stdin_data;
    sp_err_t e;
    ctrl_started(c, sp_exec_stdin(c->ev->loop, c->conn, pid, b->p, b->n, false, ctrl_done, c, &e),
                 &e);
}

static void rpc_send_input(envd_call_t *c)
{
    sp_cp_send_input_req_t *m = c->msg;
    if (!m->has_input || (!m->input.has_stdin && !m->input.has_pty)) {
        sp_e2b__envd_fail(c, SP_CC_INVALID_ARGUMENT, "input (stdin or pty) is required");
        return;
    }
    with_pid(c, m->has_process, &m->process, input_pid);
}

static void signal_pid(envd_call_t *c, uint32_t pid)
{
    sp_cp_send_signal_req_t *m = c->msg;
    sp_err_t e;
    ctrl_started(c, sp_exec_signal(c->ev->loop, c->conn, pid, m->signal, true, ctrl_done, c, &e),
                 &e);
}

static void rpc_send_signal(envd_call_t *c)
{
    sp_cp_send_signal_req_t *m = c->msg;
    if (m->signal != SP_CP_SIGNAL_SIGKILL && m->signal != SP_CP_SIGNAL_SIGTERM) {
        sp_e2b__envd_fail(c, SP_CC_INVALID_ARGUMENT, "signal must be SIGNAL_SIGTERM or SIGKILL");
        return;
    }
    with_pid(c, m->has_process, &m->process, signal_pid);
}

static void close_pid(envd_call_t *c, uint32_t pid)
{
    sp_err_t e;
    ctrl_started(c, sp_exec_stdin(c->ev->loop, c->conn, pid, NULL, 0, true, ctrl_done, c, &e), &e);
}

static void rpc_close_stdin(envd_call_t *c)
{
    sp_cp_select_req_t *m = c->msg;
    with_pid(c, m->has_process, &m->process, close_pid);
}

static void update_pid(envd_call_t *c, uint32_t pid)
{
    sp_cp_update_req_t *m = c->msg;
    sp_err_t e;
    ctrl_started(c,
                 sp_exec_resize(c->ev->loop, c->conn, pid, m->pty.size.rows, m->pty.size.cols,
                                ctrl_done, c, &e),
                 &e);
}

static void rpc_update(envd_call_t *c)
{
    sp_cp_update_req_t *m = c->msg;
    if (!m->has_pty || !m->pty.has_size) {
        /* Nothing to change; still check the process exists, as envd does. */
        sp_cempty_t empty = {0};
        if (!m->has_process) {
            sp_e2b__envd_fail(c, SP_CC_INVALID_ARGUMENT, "process selector is required");
            return;
        }
        sp_e2b__envd_reply(c, &sp_cd_empty, &empty);
        return;
    }
    with_pid(c, m->has_process, &m->process, update_pid);
}

/* ---- StreamInput (client streaming: all envelopes are in the body) ---- */

typedef struct {
    sp_buf_t data;
} sinput_t;

static void sinput_free(void *p)
{
    sinput_t *s = p;
    sp_buf_free(&s->data);
    free(s);
}

static void sinput_done(void *arg, const sp_err_t *err)
{
    envd_call_t *c = arg;
    sp_connect_code_t code = SP_CC_OK;
    const char *msg = NULL;
    if (err != NULL) {
        code = err->code == SP_ENOTFOUND || err->code == SP_ECONFLICT ? SP_CC_NOT_FOUND
                                                                      : sp_e2b__envd_code(err);
        msg = err->msg;
    }
    h2o_req_t *req = sp_e2b__envd_req(c);
    if (req != NULL) {
        static const sp_stream_cbs_t none = {NULL, NULL};
        sp_stream_t *st = sp_stream_start(
            req, 200, sp_connect_stream_ctype(c->cr.codec), -1, &none, NULL);
        if (st != NULL) {
            sp_cempty_t empty = {0};
            if (code == SP_CC_OK)
                sp_connect_stream_msg(st, c->cr.codec, &sp_cd_empty, &empty, 0);
            sp_connect_stream_finish(st, code, msg);
        }
    }
    sp_e2b__envd_call_free(c);
}

static void sinput_pid(envd_call_t *c, uint32_t pid)
{
    sinput_t *s = c->data;
    sp_err_t e;
    if (sp_exec_stdin(c->ev->loop, c->conn, pid, s->data.p, s->data.len, false, sinput_done, c,
                      &e) == NULL)
        sinput_done(c, &e);
}

static void rpc_stream_input(envd_call_t *c)
{
    h2o_req_t *req = sp_e2b__envd_req(c);
    sp_err_t e;
    if (!c->cr.streaming || req == NULL) {
        sp_e2b__envd_fail(c, SP_CC_INVALID_ARGUMENT, "StreamInput is a client-streaming RPC");
        return;
    }
    sinput_t *s = calloc(1, sizeof(*s));
    if (s == NULL) {
        sp_e2b__envd_fail(c, SP_CC_INTERNAL, "out of memory");
        return;
    }
    c->data = s;
    c->data_free = sinput_free;
    const uint8_t *body = (const uint8_t *)req->entity.base;
    size_t n = body ? req->entity.len : 0, off = 0;
    uint8_t flags;
    const uint8_t *p;
    size_t len;
    int rc;
    sp_cp_selector_t sel = {0};
    bool have = false;
    while ((rc = sp_connect_envelope_next(body, n, &off, &flags, &p, &len, &e)) == 1) {
        if (flags & SP_CONNECT_FLAG_END)
            break;
        sp_cp_stream_input_req_t m;
        if (sp_connect_decode(c->cr.codec, &sp_cd_stream_input_req, p, len, &m, &c->arena, &e) <
            0) {
            rc = -1;
            break;
        }
        if (m.has_start && m.start.has_process) {
            sel = m.start.process;
            have = true;
        }
        if (m.has_data && m.data.has_input) {
            const sp_cbytes_t *b =
                m.data.input.has_pty ? &m.data.input.pty : &m.data.input.stdin_data;
            sp_buf_add(&s->data, b->p, b->n);
        }
    }
    if (rc < 0) {
        sp_e2b__envd_fail(c, SP_CC_INVALID_ARGUMENT, e.msg);
        return;
    }
    if (s->data.oom) {
        sp_e2b__envd_fail(c, SP_CC_RESOURCE_EXHAUSTED, "input too large");
        return;
    }
    with_pid(c, have, &sel, sinput_pid);
}

/* ---- dispatch ---- */

static const struct {
    const char *name;
    const sp_cdesc_t *req;
    void (*fn)(envd_call_t *c);
} methods[] = {
    {"Start", &sp_cd_start_req, rpc_start},
    {"Connect", &sp_cd_select_req, rpc_connect},
    {"List", &sp_cd_empty, rpc_list},
    {"SendInput", &sp_cd_send_input_req, rpc_send_input},
    {"SendSignal", &sp_cd_send_signal_req, rpc_send_signal},
    {"CloseStdin", &sp_cd_select_req, rpc_close_stdin},
    {"Update", &sp_cd_update_req, rpc_update},
    {"StreamInput", NULL, rpc_stream_input},
};

void sp_e2b__envd_process(envd_call_t *c, const char *method)
{
    for (size_t i = 0; i < sizeof(methods) / sizeof(methods[0]); i++) {
        if (strcmp(methods[i].name, method) != 0)
            continue;
        if (methods[i].req != NULL) {
            h2o_req_t *req = sp_e2b__envd_req(c);
            sp_err_t e;
            c->msg = sp_carena_alloc(&c->arena, methods[i].req->size);
            if (req == NULL || c->msg == NULL ||
                sp_connect_read_msg(req, &c->cr, methods[i].req, c->msg, &c->arena, &e) < 0) {
                sp_e2b__envd_fail(c, SP_CC_INVALID_ARGUMENT,
                                  req && c->msg ? e.msg : "out of memory");
                return;
            }
        }
        methods[i].fn(c);
        return;
    }
    sp_e2b__envd_fail(c, SP_CC_UNIMPLEMENTED, "no such method in process.Process");
}
