/*
 * session.c - command sessions (core/channel/session.h).
 *
 * Owns the session table (a list: a few thousand entries at most, scanned linearly), each
 * session's copy of its command, the hash of its token, and one agent stream per attachment.
 * Output is handed on straight from the channel's frame buffer; credit goes back only through
 * sp_session_ack. A sweep timer (once a second while the table is not empty) drops expired
 * sessions. Knows no HTTP and no database.
 *
 * Lifetime: a session is freed by the table, except while an attachment holds it: removal
 * then only unlinks it (lookups fail at once) and the attachment's end frees it.
 * Re-entrancy and credit (chanop_int.h): stream callbacks are held; detach or a terminal event
 * inside them marks the attachment dead and the outermost callback frees it.
 */
#include "core/channel/session.h"

#include <signal.h>
#include <sodium.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "base/log.h"
#include "core/channel/chanop_int.h"

#define HASH_LEN 32
#define SWEEP_MS 1000

struct sp_session_tab {
    sp_loop_t *loop;
    sp_session_t *head;
    size_t n;
    sp_timer_t sweep;
};

struct sp_session {
    sp_session_t *prev, *next;
    sp_session_tab_t *tab;
    sp_loop_t *loop;
    bool removed; /* unlinked; freed when the attachment ends */
    char id[SP_SESSION_ID_LEN + 1];
    char team[SP_ID_LEN + 1];
    char sandbox[65];
    unsigned char token_hash[HASH_LEN];
    char created_at[32], expires_at[32];
    uint64_t deadline_ms; /* CREATED: attach deadline; RUNNING, detached: drop after */
    uint64_t exited_ms;
    sp_session_state_t state;
    uint32_t pid;
    bool exited; /* EXITED: exit_code valid, else signal */
    int exit_code, signal;
    /* the command */
    char *cmd, *cwd, *user;
    char **argv, **env;
    size_t argc, envc;
    bool pty;
    uint32_t rows, cols;
    sp_session_att_t *att;
};

struct sp_session_att {
    sp_session_t *s;
    sp_chanop_t ch; /* the stream, the lifetime (ch.dead) and credit */
    sp_session_att_cbs_t cbs;
    void *arg;
    bool started;
};

/* ---- helpers ---- */

static void iso_now(time_t t, char out[32])
{
    struct tm tm;
    gmtime_r(&t, &tm);
    strftime(out, 32, "%Y-%m-%dT%H:%M:%SZ", &tm);
}

static void token_hash(const char *token, unsigned char out[HASH_LEN])
{
    crypto_generichash(out, HASH_LEN, (const unsigned char *)token, strlen(token), NULL, 0);
}

static char *dup_or_null(const char *s, bool *oom)
{
    if (s == NULL)
        return NULL;
    char *d = strdup(s);
    if (d == NULL)
        *oom = true;
    return d;
}

static char **dup_vec(const char *const *v, size_t n, bool *oom)
{
    if (n == 0)
        return NULL;
    char **d = calloc(n, sizeof(char *));
    if (d == NULL) {
        *oom = true;
        return NULL;
    }
    for (size_t i = 0; i < n; i++)
        d[i] = dup_or_null(v[i], oom);
    return d;
}

static void free_vec(char **v, size_t n)
{
    for (size_t i = 0; v != NULL && i < n; i++)
        free(v[i]);
    free(v);
}

static void sess_free(sp_session_t *s)
{
    free(s->cmd);
    free(s->cwd);
    free(s->user);
    free_vec(s->argv, s->argc);
    free_vec(s->env, s->envc);
    free(s);
}

static void unlink_sess(sp_session_t *s)
{
    sp_session_tab_t *t = s->tab;
    if (t == NULL)
        return;
    if (s->prev != NULL)
        s->prev->next = s->next;
    else
        t->head = s->next;
    if (s->next != NULL)
        s->next->prev = s->prev;
    s->prev = s->next = NULL;
    s->tab = NULL;
    t->n--;
}

/* ---- table ---- */

static void on_sweep(sp_timer_t *tm, void *arg)
{
    sp_session_tab_t *t = arg;
    uint64_t now = sp_loop_now_ms(t->loop);
    sp_session_t *next;
    for (sp_session_t *s = t->head; s != NULL; s = next) {
        next = s->next;
        if (s->att != NULL)
            continue;
        bool drop = s->state == SP_SESSION_EXITED ? now >= s->exited_ms + SP_SESSION_KEEP_S * 1000u
                                                  : now >= s->deadline_ms;
        if (drop) {
            sp_log(SP_LOG_INFO, "session", "expired session=%s sandbox=%s state=%d", s->id,
                   s->sandbox, (int)s->state);
            unlink_sess(s);
            sess_free(s);
        }
    }
    if (t->n > 0)
        sp_timer_start(&t->sweep, SWEEP_MS);
}

sp_session_tab_t *sp_session_tab_create(sp_loop_t *loop)
{
    sp_session_tab_t *t = calloc(1, sizeof(*t));
    if (t == NULL)
        return NULL;
    t->loop = loop;
    sp_timer_init(&t->sweep, loop, on_sweep, t);
    return t;
}

void sp_session_tab_destroy(sp_session_tab_t *t)
{
    if (t == NULL)
        return;
    sp_timer_stop(&t->sweep);
    while (t->head != NULL) {
        sp_session_t *s = t->head;
        unlink_sess(s);
        if (s->att != NULL) {
            sp_session_att_t *a = s->att;
            s->att = NULL;
            a->s = NULL; /* its release frees only itself */
            sp_chanop__cancel(&a->ch);
        }
        sess_free(s);
    }
    free(t);
}

sp_session_t *sp_session_create(sp_session_tab_t *t, const sp_session_spec_t *spec,
                                char token_out[SP_SESSION_TOKEN_LEN + 1], sp_err_t *err)
{
    const sp_exec_cmd_t *c = spec->cmd;
    if (c == NULL || (c->cmd == NULL) == (c->argc == 0)) {
        sp_err_set(err, SP_EINVAL, "give exactly one of cmd and argv");
        return NULL;
    }
    if (c->argc > SP_AP_MAX_ARGV || c->envc > SP_AP_MAX_ENV) {
        sp_err_set(err, SP_EINVAL, "at most %d argv entries and %d env entries", SP_AP_MAX_ARGV,
                   SP_AP_MAX_ENV);
        return NULL;
    }
    if (t->n >= SP_SESSION_MAX) {
        sp_err_set(err, SP_ECONFLICT, "too many command sessions on this server");
        return NULL;
    }
    size_t mine = 0;
    for (sp_session_t *s = t->head; s != NULL; s = s->next)
        mine += strcmp(s->team, spec->team_id) == 0;
    if (mine >= SP_SESSION_TEAM_MAX) {
        sp_err_set(err, SP_ECONFLICT, "too many command sessions: at most %d per team",
                   SP_SESSION_TEAM_MAX);
        return NULL;
    }
    sp_session_t *s = calloc(1, sizeof(*s));
    if (s == NULL) {
        sp_err_set(err, SP_EINTERNAL, "out of memory");
        return NULL;
    }
    bool oom = false;
    s->cmd = dup_or_null(c->cmd, &oom);
    s->cwd = dup_or_null(c->cwd, &oom);
    s->user = dup_or_null(c->user, &oom);
    s->argv = dup_vec(c->argv, c->argc, &oom);
    s->argc = s->argv != NULL ? c->argc : 0;
    s->env = dup_vec(c->env, c->envc, &oom);
    s->envc = s->env != NULL ? c->envc : 0;
    if (oom) {
        sess_free(s);
        sp_err_set(err, SP_EINTERNAL, "out of memory");
        return NULL;
    }
    s->pty = c->pty;
    s->rows = c->rows;
    s->cols = c->cols;
    s->loop = t->loop;
    snprintf(s->team, sizeof(s->team), "%s", spec->team_id);
    snprintf(s->sandbox, sizeof(s->sandbox), "%s", spec->sandbox_id);
    memcpy(s->id, "se", 2);
    sp_ids_random(s->id + 2, SP_SESSION_ID_LEN - 2);
    memcpy(token_out, "sat_", 4);
    sp_ids_random62(token_out + 4, SP_SESSION_TOKEN_LEN - 4);
    token_hash(token_out, s->token_hash);
    uint32_t ttl = spec->attach_timeout_s ? spec->attach_timeout_s : SP_SESSION_ATTACH_S;
    time_t now = time(NULL);
    iso_now(now, s->created_at);
    iso_now(now + (time_t)ttl, s->expires_at);
    s->deadline_ms = sp_loop_now_ms(t->loop) + (uint64_t)ttl * 1000u;
    s->state = SP_SESSION_CREATED;
    s->tab = t;
    s->next = t->head;
    if (t->head != NULL)
        t->head->prev = s;
    t->head = s;
    t->n++;
    if (!sp_timer_armed(&t->sweep))
        sp_timer_start(&t->sweep, SWEEP_MS);
    return s;
}

static sp_session_t *find(sp_session_tab_t *t, const char *id)
{
    if (id == NULL)
        return NULL;
    uint64_t now = sp_loop_now_ms(t->loop);
    for (sp_session_t *s = t->head; s != NULL; s = s->next) {
        if (strcmp(s->id, id) != 0)
            continue;
        /* Past its attach deadline but not swept yet: already gone for clients. */
        if (s->state == SP_SESSION_CREATED && s->att == NULL && now >= s->deadline_ms)
            return NULL;
        return s;
    }
    return NULL;
}

sp_session_t *sp_session_authorize(sp_session_tab_t *t, const char *id, const char *token,
                                   sp_err_t *err)
{
    sp_session_t *s = find(t, id);
    if (s == NULL) {
        sp_err_set(err, SP_ENOTFOUND, "command session not found or expired");
        return NULL;
    }
    unsigned char h[HASH_LEN];
    token_hash(token != NULL ? token : "", h);
    if (token == NULL || sodium_memcmp(h, s->token_hash, HASH_LEN) != 0) {
        sp_err_set(err, SP_EAUTH, "a valid attach token for this session is required");
        return NULL;
    }
    return s;
}

sp_session_t *sp_session_get(sp_session_tab_t *t, const char *team_id, const char *sandbox_id,
                             const char *id)
{
    sp_session_t *s = find(t, id);
    if (s == NULL || strcmp(s->team, team_id) != 0 || strcmp(s->sandbox, sandbox_id) != 0)
        return NULL;
    return s;
}

static const char *state_name(sp_session_state_t st)
{
    return st == SP_SESSION_CREATED ? "created" : st == SP_SESSION_RUNNING ? "running" : "exited";
}

json_t *sp_session_json(const sp_session_t *s)
{
    json_t *o = json_object();
    json_object_set_new(o, "id", json_string(s->id));
    json_object_set_new(o, "sandbox_id", json_string(s->sandbox));
    json_object_set_new(o, "state", json_string(state_name(s->state)));
    json_object_set_new(o, "attached", json_boolean(s->att != NULL));
    json_object_set_new(o, "pid", s->pid ? json_integer(s->pid) : json_null());
    json_object_set_new(o, "created_at", json_string(s->created_at));
    json_object_set_new(o, "expires_at", json_string(s->expires_at));
    bool ex = s->state == SP_SESSION_EXITED;
    json_object_set_new(o, "exit_code", ex && s->exited ? json_integer(s->exit_code) : json_null());
    json_object_set_new(o, "signal", ex && s->signal ? json_integer(s->signal) : json_null());
    if (s->cmd != NULL) {
        json_object_set_new(o, "cmd", sp_exec_json_bytes(s->cmd, strlen(s->cmd)));
    } else {
        json_t *a = json_array();
        for (size_t i = 0; i < s->argc; i++)
            json_array_append_new(a, sp_exec_json_bytes(s->argv[i], strlen(s->argv[i])));
        json_object_set_new(o, "argv", a);
    }
    json_object_set_new(o, "pty", json_boolean(s->pty));
    return o;
}

json_t *sp_session_list_json(sp_session_tab_t *t, const char *team_id, const char *sandbox_id)
{
    json_t *a = json_array();
    for (sp_session_t *s = t->head; s != NULL; s = s->next)
        if (find(t, s->id) == s && strcmp(s->team, team_id) == 0 &&
            strcmp(s->sandbox, sandbox_id) == 0)
            json_array_append_new(a, sp_session_json(s));
    return a;
}

const char *sp_session_id(const sp_session_t *s)
{
    return s->id;
}

const char *sp_session_sandbox(const sp_session_t *s)
{
    return s->sandbox;
}

sp_session_state_t sp_session_state(const sp_session_t *s)
{
    return s->state;
}

uint32_t sp_session_pid(const sp_session_t *s)
{
    return s->pid;
}

const char *sp_session_expires_at(const sp_session_t *s)
{
    return s->expires_at;
}

static void send_signal(sp_agentstream_t *st, int sig)
{
    uint8_t buf[32];
    sp_ap_writer_t w;
    sp_ap_writer_init(&w, buf, sizeof(buf));
    sp_ap_put_u32(&w, SP_AP_K_SIGNAL, (uint32_t)sig);
    sp_ap_put_u32(&w, SP_AP_K_GROUP, 1);
    sp_agentstream_send(st, SP_AP_T_PROC_SIGNAL, buf, w.len);
}

static void on_killed(void *arg, const sp_err_t *err)
{
    if (err != NULL)
        sp_log(SP_LOG_INFO, "session", "kill on removal failed err=%s", err->msg);
}

void sp_session_remove(sp_session_tab_t *t, sp_session_t *s, sp_agentconn_t *conn)
{
    unlink_sess(s);
    if (s->att != NULL) {
        s->removed = true;
        if (s->att->ch.s != NULL)
            send_signal(s->att->ch.s, SIGKILL); /* the exit then ends the attachment */
        return;
    }
    if (s->state == SP_SESSION_RUNNING && s->pid != 0 && conn != NULL) {
        sp_err_t e;
        if (sp_exec_signal(s->loop, conn, s->pid, SIGKILL, true, on_killed, NULL, &e) == NULL)
            sp_log(SP_LOG_INFO, "session", "kill on removal failed session=%s err=%s", s->id,
                   e.msg);
    }
    sess_free(s);
}

/* ---- attachments ---- */

static void att_free(void *arg)
{
    sp_session_att_t *a = arg;
    sp_session_t *s = a->s;
    free(a);
    if (s == NULL)
        return;
    s->att = NULL;
    if (s->removed) {
        sess_free(s);
        return;
    }
    if (s->state == SP_SESSION_RUNNING)
        s->deadline_ms = sp_loop_now_ms(s->loop) + SP_SESSION_DETACHED_S * 1000u;
}

static void deliver(sp_session_att_t *a, const sp_exec_ev_t *ev)
{
    bool terminal = ev->type == SP_EXEC_EV_EXIT || ev->type == SP_EXEC_EV_ERROR;
    if (terminal)
        sp_chanop__kill(&a->ch);
    a->cbs.on_event(a->arg, ev);
}

static void deliver_error(sp_session_att_t *a, sp_code_t code, const char *msg)
{
    sp_err_t e;
    sp_err_set(&e, code, "%s", msg);
    sp_exec_ev_t ev = {.type = SP_EXEC_EV_ERROR, .pid = a->s ? a->s->pid : 0, .err = &e};
    deliver(a, &ev);
}

/* Stream callbacks: entered and checked alive by chanop.c. */
static void att_frame(void *arg, uint16_t type, uint16_t flags, const uint8_t *p, size_t len)
{
    sp_session_att_t *a = arg;
    sp_session_t *s = a->s;
    switch (type) {
    case SP_AP_T_PROC_STARTED: {
        uint32_t pid = 0;
        if (sp_ap_get_u32(p, len, SP_AP_K_PID, &pid) < 0 || pid == 0) {
            deliver_error(a, SP_EINTERNAL, "sandbox agent sent a malformed start");
            break;
        }
        if (a->started)
            break;
        a->started = true;
        if (s->state == SP_SESSION_CREATED) {
            s->state = SP_SESSION_RUNNING;
            s->pid = pid;
        }
        sp_exec_ev_t ev = {.type = SP_EXEC_EV_START, .pid = pid};
        deliver(a, &ev);
        break;
    }
    case SP_AP_T_PROC_STDOUT:
    case SP_AP_T_PROC_STDERR: {
        sp_exec_ev_t ev = {.type = type == SP_AP_T_PROC_STDOUT ? SP_EXEC_EV_STDOUT
                                                               : SP_EXEC_EV_STDERR,
                           .pid = s->pid, .data = p, .len = len};
        deliver(a, &ev);
        break;
    }
    case SP_AP_T_PROC_EXIT: {
        sp_exec_ev_t ev;
        if (sp_exec_proc_exit(p, len, &ev) < 0) {
            deliver_error(a, SP_EINTERNAL, "sandbox agent sent a malformed exit");
            break;
        }
        s->state = SP_SESSION_EXITED;
        s->exited = ev.exited;
        s->exit_code = ev.exit_code;
        s->signal = ev.signal;
        s->exited_ms = sp_loop_now_ms(s->loop);
        ev.pid = s->pid;
        deliver(a, &ev);
        break;
    }
    case SP_AP_T_ERROR: {
        sp_err_t e;
        sp_exec_agent_error(p, len, &e);
        if (e.code == SP_ENOTFOUND && s->state != SP_SESSION_CREATED)
            sp_err_set(&e, SP_ECONFLICT, "the session's process is no longer known to the sandbox");
        sp_exec_ev_t ev = {.type = SP_EXEC_EV_ERROR, .pid = s->pid, .err = &e};
        deliver(a, &ev);
        break;
    }
    default:
        break; /* the protocol may grow */
    }
    if (!a->ch.dead && a->ch.s == NULL) /* ended without EXIT or ERROR */
        deliver_error(a, SP_EINTERNAL, "sandbox agent ended the command stream");
}

static void att_lost(void *arg, const sp_err_t *err)
{
    sp_session_att_t *a = arg;
    sp_log(SP_LOG_INFO, "session", "agent stream lost session=%s err=%s", a->s ? a->s->id : "-",
           err->msg);
    deliver_error(a, SP_EUNAVAIL, "connection to the sandbox agent was lost");
}

static void att_writable(void *arg)
{
    sp_session_att_t *a = arg;
    if (a->cbs.on_writable != NULL)
        a->cbs.on_writable(a->arg);
}

static const sp_chanop_ops_t att_ops = {att_frame, att_lost, att_writable, att_free};

/* PROC_START fields for the session's command; malloc'd, *len set. NULL with err. */
static uint8_t *enc_start(const sp_session_t *s, bool interactive, size_t *len, sp_err_t *err)
{
    size_t total = 256;
    total += s->cmd ? strlen(s->cmd) : 0;
    total += s->cwd ? strlen(s->cwd) : 0;
    total += s->user ? strlen(s->user) : 0;
    for (size_t i = 0; i < s->argc; i++)
        total += strlen(s->argv[i]) + 8;
    for (size_t i = 0; i < s->envc; i++)
        total += strlen(s->env[i]) + 8;
    if (total > SP_AP_MAX_PAYLOAD) {
        sp_err_set(err, SP_ETOOBIG, "command, argv and env are larger than 1 MiB");
        return NULL;
    }
    uint8_t *buf = malloc(total);
    if (buf == NULL) {
        sp_err_set(err, SP_EINTERNAL, "out of memory");
        return NULL;
    }
    sp_ap_writer_t w;
    sp_ap_writer_init(&w, buf, total);
    for (size_t i = 0; i < s->argc; i++)
        sp_ap_put_str(&w, SP_AP_K_ARGV, s->argv[i]);
    sp_ap_put_str(&w, SP_AP_K_CMD, s->cmd);
    for (size_t i = 0; i < s->envc; i++)
        sp_ap_put_str(&w, SP_AP_K_ENV, s->env[i]);
    sp_ap_put_str(&w, SP_AP_K_CWD, s->cwd);
    sp_ap_put_str(&w, SP_AP_K_USER, s->user);
    sp_ap_put_str(&w, SP_AP_K_TAG, s->id);
    sp_ap_put_u32(&w, SP_AP_K_PTY, s->pty ? 1 : 0);
    sp_ap_put_u32(&w, SP_AP_K_ROWS, s->rows ? s->rows : 24);
    sp_ap_put_u32(&w, SP_AP_K_COLS, s->cols ? s->cols : 80);
    sp_ap_put_u32(&w, SP_AP_K_STDIN, interactive ? 1 : 0);
    if (w.overflow) {
        free(buf);
        sp_err_set(err, SP_ETOOBIG, "command does not fit one request");
        return NULL;
    }
    *len = w.len;
    return buf;
}

sp_session_att_t *sp_session_attach(sp_session_t *s, sp_agentconn_t *conn, bool interactive,
                                    const sp_session_att_cbs_t *cbs, void *arg, sp_err_t *err)
{
    if (s->att != NULL) {
        sp_err_set(err, SP_ECONFLICT, "the session is attached elsewhere");
        return NULL;
    }
    if (s->removed) {
        sp_err_set(err, SP_ENOTFOUND, "command session not found or expired");
        return NULL;
    }
    if (conn == NULL) {
        sp_err_set(err, SP_EUNAVAIL, "sandbox VM is not reachable");
        return NULL;
    }
    sp_session_att_t *a = calloc(1, sizeof(*a));
    if (a == NULL) {
        sp_err_set(err, SP_EINTERNAL, "out of memory");
        return NULL;
    }
    a->s = s;
    a->cbs = *cbs;
    a->arg = arg;
    sp_chanop__init(&a->ch, &att_ops, a);
    int rc;
    if (s->state == SP_SESSION_CREATED) {
        size_t len = 0;
        uint8_t *p = enc_start(s, interactive, &len, err);
        if (p == NULL) {
            free(a);
            return NULL;
        }
        rc = sp_chanop__open(&a->ch, conn, SP_AP_T_PROC_START, p, len, err);
        free(p);
    } else {
        uint8_t buf[32];
        sp_ap_writer_t w;
        sp_ap_writer_init(&w, buf, sizeof(buf));
        sp_ap_put_u32(&w, SP_AP_K_PID, s->pid);
        sp_ap_put_u32(&w, SP_AP_K_REPLAY, 1);
        rc = sp_chanop__open(&a->ch, conn, SP_AP_T_PROC_ATTACH, buf, w.len, err);
    }
    if (rc < 0) {
        free(a);
        return NULL;
    }
    s->att = a;
    return a;
}

void sp_session_ack(sp_session_att_t *a, size_t n)
{
    if (a != NULL)
        sp_chanop__grant(&a->ch, n);
}

long sp_session_write(sp_session_att_t *a, const void *p, size_t n)
{
    if (a == NULL || a->ch.dead || a->ch.s == NULL)
        return -1;
    size_t done = 0;
    while (done < n) {
        size_t k = n - done;
        size_t credit = sp_agentstream_credit(a->ch.s);
        if (k > SP_AP_MAX_DATA)
            k = SP_AP_MAX_DATA;
        if (k > credit)
            k = credit;
        if (k == 0) {
            /* Out of credit (or the channel's queue is full): on_writable says when to go on.
             * Without it, stdin that all arrived before the agent's WINDOW would wait for a
             * next message from the client that may never come. */
            sp_agentstream_want_writable(a->ch.s);
            break;
        }
        int rc = sp_agentstream_send(a->ch.s, SP_AP_T_DATA, (const uint8_t *)p + done, k);
        if (rc < 0)
            return -1;
        if (rc == 0)
            break;
        done += k;
    }
    return (long)done;
}

static int ctrl_check(sp_session_att_t *a, sp_err_t *err)
{
    if (a == NULL || a->ch.dead || a->ch.s == NULL)
        return sp_err_set(err, SP_ECONFLICT, "the command is no longer attached");
    return 0;
}

int sp_session_eof(sp_session_att_t *a, sp_err_t *err)
{
    if (ctrl_check(a, err) < 0)
        return -1;
    if (sp_agentstream_send(a->ch.s, SP_AP_T_EOF, NULL, 0) < 0)
        return sp_err_set(err, SP_EUNAVAIL, "connection to the sandbox agent was lost");
    return 0;
}

int sp_session_resize(sp_session_att_t *a, uint32_t rows, uint32_t cols, sp_err_t *err)
{
    if (rows < 1 || rows > 1000 || cols < 1 || cols > 1000)
        return sp_err_set(err, SP_EINVAL, "rows and cols must be from 1 to 1000");
    if (ctrl_check(a, err) < 0)
        return -1;
    if (!a->s->pty)
        return sp_err_set(err, SP_EINVAL, "resize needs a session with pty");
    uint8_t buf[32];
    sp_ap_writer_t w;
    sp_ap_writer_init(&w, buf, sizeof(buf));
    sp_ap_put_u32(&w, SP_AP_K_ROWS, rows);
    sp_ap_put_u32(&w, SP_AP_K_COLS, cols);
    if (sp_agentstream_send(a->ch.s, SP_AP_T_PROC_RESIZE, buf, w.len) < 0)
        return sp_err_set(err, SP_EUNAVAIL, "connection to the sandbox agent was lost");
    return 0;
}

int sp_session_signal(sp_session_att_t *a, int sig, sp_err_t *err)
{
    if (sig < 1 || sig > 64)
        return sp_err_set(err, SP_EINVAL, "signal must be 1 to 64");
    if (ctrl_check(a, err) < 0)
        return -1;
    send_signal(a->ch.s, sig);
    return 0;
}

void sp_session_detach(sp_session_att_t *a)
{
    if (a != NULL)
        sp_chanop__cancel(&a->ch);
}
