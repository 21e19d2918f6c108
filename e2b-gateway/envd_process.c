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
 * deadline_exceeded); once detached a lifetime timer here does it.
 *
 * Owns the lifetime timers and a bounded table of the configs of processes started through
 * Start (List reports cmd/args/envs/cwd from it; the agent itself keeps only a joined argv).
 */
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "base/log.h"
#include "e2b-gateway/envd_int.h"

#define PROC_TABLE_MAX 4096
#define LIVES_MAX      10000 /* pending lifetime kills; past it the oldest is dropped (logged) */

/* ---- remembered configs ---- */

struct envd_proc {
    envd_proc_t *next;
    char sandbox_id[65];
    uint32_t pid;
    bool pty;
    sp_carena_t arena;
    sp_cp_config_t cfg;
};

static const char *acopy(sp_carena_t *a, const char *s)
{
    if (s == NULL)
        return NULL;
    size_t n = strlen(s);
    char *d = sp_carena_alloc(a, n + 1);
    if (d != NULL)
        memcpy(d, s, n + 1);
    return d;
}

static envd_proc_t *proc_new(const char *sid, const sp_cp_config_t *cfg)
{
    envd_proc_t *p = calloc(1, sizeof(*p));
    if (p == NULL)
        return NULL;
    snprintf(p->sandbox_id, sizeof(p->sandbox_id), "%s", sid);
    p->cfg.cmd = acopy(&p->arena, cfg->cmd ? cfg->cmd : "");
    p->cfg.args = sp_carena_alloc(&p->arena, (cfg->n_args + 1) * sizeof(char *));
    p->cfg.envs = sp_carena_alloc(&p->arena, (cfg->n_envs + 1) * sizeof(sp_ckv_t));
    if (p->cfg.args == NULL || p->cfg.envs == NULL) {
        sp_carena_free(&p->arena);
        free(p);
        return NULL;
    }
    for (size_t i = 0; i < cfg->n_args; i++)
        p->cfg.args[i] = acopy(&p->arena, cfg->args[i]);
    p->cfg.n_args = cfg->n_args;
    for (size_t i = 0; i < cfg->n_envs; i++) {
        p->cfg.envs[i].key = acopy(&p->arena, cfg->envs[i].key);
        p->cfg.envs[i].value = acopy(&p->arena, cfg->envs[i].value);
    }
    p->cfg.n_envs = cfg->n_envs;
    if (cfg->has_cwd) {
        p->cfg.cwd = acopy(&p->arena, cfg->cwd);
        p->cfg.has_cwd = true;
    }
    return p;
}

static void proc_free(envd_proc_t *p)
{
    sp_carena_free(&p->arena);
    free(p);
}

static void proc_remove(struct sp_envd *ev, const char *sid, uint32_t pid)
{
    for (envd_proc_t **pp = &ev->procs; *pp != NULL; pp = &(*pp)->next) {
        envd_proc_t *p = *pp;
        if (p->pid == pid && strcmp(p->sandbox_id, sid) == 0) {
            *pp = p->next;
            proc_free(p);
            ev->nprocs--;
            return;
        }
    }
}

/* Adds p at the head; the oldest entries go when the table is full. */
static void proc_add(struct sp_envd *ev, envd_proc_t *p)
{
    proc_remove(ev, p->sandbox_id, p->pid);
    p->next = ev->procs;
    ev->procs = p;
    ev->nprocs++;
    if (ev->nprocs > PROC_TABLE_MAX) {
        envd_proc_t **pp = &ev->procs;
        while ((*pp)->next != NULL)
            pp = &(*pp)->next;
        proc_free(*pp);
        *pp = NULL;
        ev->nprocs--;
    }
}

static envd_proc_t *proc_find(struct sp_envd *ev, const char *sid, uint32_t pid)
{
    for (envd_proc_t *p = ev->procs; p != NULL; p = p->next)
        if (p->pid == pid && strcmp(p->sandbox_id, sid) == 0)
            return p;
    return NULL;
}

/* ---- lifetimes of detached processes (connect-timeout-ms on Start) ---- */

struct envd_life {
    envd_life_t *next;
    struct sp_envd *ev;
    sp_loop_t *loop;
    sp_timer_t timer;
    char sandbox_id[65];
    sp_auth_t auth;
    uint32_t pid;
};

/* Takes l off the list (it stays allocated). */
static void life_detach(envd_life_t *l)
{
    for (envd_life_t **pp = &l->ev->lives; *pp != NULL; pp = &(*pp)->next)
        if (*pp == l) {
            *pp = l->next;
            l->ev->nlives--;
            break;
        }
    sp_timer_stop(&l->timer);
}

static void life_unlink(envd_life_t *l)
{
    life_detach(l);
    free(l);
}

static void life_killed(void *arg, const sp_err_t *err)
{
    uint32_t pid = (uint32_t)(uintptr_t)arg;
    if (err != NULL && err->code != SP_ENOTFOUND && err->code != SP_ECONFLICT)
        sp_log(SP_LOG_WARN, "envd", "lifetime kill failed pid=%u err=%s", pid, err->msg);
}

/* Runs after l left the list (it may outlive the envd state): uses only its own fields. */
static void life_agent(void *arg, sp_agentconn_t *conn, const sp_err_t *err)
{
    envd_life_t *l = arg;
    if (err == NULL) {
        sp_err_t e;
        if (sp_exec_signal(l->loop, conn, l->pid, SIGKILL, true, life_killed,
                           (void *)(uintptr_t)l->pid, &e) == NULL)
            life_killed((void *)(uintptr_t)l->pid, &e);
        else
            sp_log(SP_LOG_INFO, "envd", "connect-timeout expired sandbox=%s pid=%u", l->sandbox_id,
                   l->pid);
    }
    free(l);
}

static void life_fire(sp_timer_t *t, void *arg)
{
    envd_life_t *l = arg;
    sp_err_t e;
    sp_svc_t *svc = l->ev->gw->svc;
    life_detach(l);
    if (sp_svc_sandbox_agent(svc, &l->auth, l->sandbox_id, life_agent, l, &e) < 0)
        free(l);
}

static void life_add(struct sp_envd *ev, const char *sid, const sp_auth_t *auth, uint32_t pid,
                     uint64_t ms)
{
    envd_life_t *l = calloc(1, sizeof(*l));
    if (l == NULL)
        return;
    l->ev = ev;
    l->loop = ev->loop;
    snprintf(l->sandbox_id, sizeof(l->sandbox_id), "%s", sid);
    l->auth = *auth;
    l->pid = pid;
    sp_timer_init(&l->timer, ev->loop, life_fire, l);
    sp_timer_start(&l->timer, ms);
    l->next = ev->lives;
    ev->lives = l;
    ev->nlives++;
    if (ev->nlives > LIVES_MAX) {
        envd_life_t *old = ev->lives;
        while (old->next != NULL)
            old = old->next;
        sp_log(SP_LOG_WARN, "envd",
               "too many detached timed processes: dropping the limit "
               "sandbox=%s pid=%u",
               old->sandbox_id, old->pid);
        life_unlink(old);
    }
}

void sp_e2b__envd_process_free(struct sp_envd *ev)
{
    while (ev->lives != NULL)
        life_unlink(ev->lives);
    while (ev->procs != NULL) {
        envd_proc_t *p = ev->procs;
        ev->procs = p->next;
        proc_free(p);
    }
    ev->nprocs = 0;
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
    envd_proc_t *cfg; /* Start: registered at START */
    int depth;
} pst_t;

static void pst_free(pst_t *s)
{
    sp_timer_stop(&s->ka);
    sp_timer_stop(&s->deadline);
    if (s->cfg != NULL)
        proc_free(s->cfg);
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
        life_add(s->ev, s->sandbox_id, &s->auth, s->pid, left);
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
        if (s->cfg != NULL) {
            s->cfg->pid = e->pid;
            proc_add(s->ev, s->cfg);
            s->cfg = NULL;
        }
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
        proc_remove(s->ev, s->sandbox_id, s->pid);
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
    s->cfg = proc_new(c->sandbox_id, &m->process);
    if (s->cfg != NULL)
        s->cfg->pty = pty;
    sp_err_t e;
    s->op = sp_exec_stream(c->ev->loop, c->conn, &cmd, pst_event, s, &e);
    if (s->op == NULL) {
        s->c = NULL;
        pst_free(s);
        sp_e2b__envd_fail_err(c, &e);
    }
}

/* ---- selectors: pid, or tag through the agent's list ---- */

typedef void (*pid_next_t)(envd_call_t *c, uint32_t pid);

typedef struct {
    envd_call_t *c;
    pid_next_t next;
    const char *tag; /* NULL: by pid */
    uint32_t pid;
} bytag_t;

static void bytag_listed(void *arg, json_t *procs, const sp_err_t *err)
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
    envd_proc_t *known = proc_find(c->ev, c->sandbox_id, pid);
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

static void list_done(void *arg, json_t *procs, const sp_err_t *err)
{
    envd_call_t *c = arg;
    if (err != NULL) {
        sp_e2b__envd_fail_err(c, err);
        return;
    }
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
            info->tag = acopy(&c->arena, tag);
            info->has_tag = info->tag != NULL;
        }
        envd_proc_t *known = proc_find(c->ev, c->sandbox_id, pid);
        if (known != NULL) {
            info->config = known->cfg;
            continue;
        }
        /* Not started through Start (or forgotten): the agent's joined argv, split. */
        const char *cmd = json_string_value(json_object_get(p, "cmd"));
        char *line = (char *)acopy(&c->arena, cmd ? cmd : "");
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
            info->config.cwd = acopy(&c->arena, cwd);
            info->config.has_cwd = info->config.cwd != NULL;
        }
    }
    /* Forget configs of processes that are gone. */
    for (envd_proc_t **pp = &c->ev->procs; *pp != NULL;) {
        envd_proc_t *q = *pp;
        bool alive = strcmp(q->sandbox_id, c->sandbox_id) != 0;
        for (size_t k = 0; !alive && k < r.n_processes; k++)
            alive = r.processes[k].pid == q->pid;
        if (alive) {
            pp = &q->next;
            continue;
        }
        /* Entries still referenced by r are alive by construction: safe to free. */
        *pp = q->next;
        proc_free(q);
        c->ev->nprocs--;
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
    sp_cbuf_t data;
} sinput_t;

static void sinput_free(void *p)
{
    sinput_t *s = p;
    sp_cbuf_free(&s->data);
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
            sp_cbuf_add(&s->data, b->p, b->n);
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
