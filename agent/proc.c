/*
 * proc.c - child processes, their output rings and the streams attached.
 *
 * Output path: child pipe/PTY -> ring (SP_AP_PROC_RING per fd) -> every
 * attached stream, each at its own ring offset and within its own window.
 * Backpressure: while some attached stream lags a full ring behind, the
 * child's fd is not read, so the child blocks instead of the agent or the
 * host buffering without bound. With nobody attached the ring just keeps the
 * latest output.
 *
 * Exit is reported only after the child was reaped and its output fds hit
 * EOF and the stream has sent everything, so PROC_EXIT is always last.
 */
#include "agent/proc.h"

#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <grp.h>
#include <poll.h>
#include <signal.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/signalfd.h>
#include <sys/wait.h>
#include <termios.h>
#include <time.h>
#include <unistd.h>

#include "agent/agent.h"
#include "agent/cgroup.h"
#include "agent/chan.h"
#include "agent/egress.h"
#include "agent/ev.h"
#include "agent/ring.h"
#include "agent/sess.h"
#include "agent/users.h"
#include "base/log.h"

#define PROC_KEEP_FINISHED 32 /* finished processes kept for late attach */
#define PROC_MAX_ATTACH    16 /* streams per process */
#define PROC_READ_CHUNK    65536
#define PROC_EXEC_WAIT_MS 200 /* how long starting a command waits for its exec */

typedef struct proc proc_t;

typedef struct att {
    proc_t *pr;
    sp_stream_t *s;
    uint64_t pos_out, pos_err; /* ring offsets sent so far */
    uint64_t owed;             /* stdin bytes taken from this stream, not yet granted back */
    bool started_sent;
    struct att *next;
} att_t;

struct proc {
    pid_t pid;
    char *tag;
    char *summary; /* argv joined, for PROC_INFO */
    char *cwd;
    char user[64];
    bool pty;
    int in_fd, out_fd, err_fd; /* -1 when closed */
    sp_ev_t *in_ev, *out_ev, *err_ev;
    sp_ring_t out, err;
    uint8_t *inbuf;
    size_t inlen;
    bool in_close_pending;
    bool reaped;
    int status;
    uint64_t started_ns;
    uint64_t seq; /* start order, to evict the oldest finished */
    uint32_t cg;  /* its cgroup (sp_cgroup_cmd_new), 0 for none */
    int exec_fd;  /* its exec's outcome when spawn could not wait for it, else -1 */
    sp_ev_t *exec_ev;
    att_t *atts;
    proc_t *next;
};

static proc_t *procs;
static uint64_t next_seq;
static int sig_fd = -1;

static uint64_t realtime_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

static bool finished(const proc_t *pr)
{
    return pr->reaped && pr->out_fd < 0 && pr->err_fd < 0;
}

static proc_t *find_pid(pid_t pid)
{
    for (proc_t *pr = procs; pr != NULL; pr = pr->next)
        if (pr->pid == pid)
            return pr;
    return NULL;
}

/* ---- output ---- */

/* Bytes we may read into r without overwriting what an attached stream has
 * not sent yet; unbounded (the ring just rolls) when nobody is attached. */
static size_t ring_room(const proc_t *pr, const sp_ring_t *r, bool is_out)
{
    size_t room = PROC_READ_CHUNK;
    for (const att_t *a = pr->atts; a != NULL; a = a->next) {
        uint64_t lag = r->head - (is_out ? a->pos_out : a->pos_err);
        uint64_t left = lag >= r->max ? 0 : r->max - lag;
        if (left < room)
            room = (size_t)left;
    }
    return room;
}

static bool ring_has_room(const proc_t *pr, const sp_ring_t *r, bool is_out)
{
    return ring_room(pr, r, is_out) > 0;
}

static void update_out_interest(proc_t *pr)
{
    if (pr->out_fd >= 0)
        sp_ev_mod(pr->out_ev, ring_has_room(pr, &pr->out, true) ? POLLIN : 0);
    if (pr->err_fd >= 0)
        sp_ev_mod(pr->err_ev, ring_has_room(pr, &pr->err, false) ? POLLIN : 0);
}

static void close_fd(int *fd, sp_ev_t **ev)
{
    sp_ev_del(*ev);
    *ev = NULL;
    if (*fd >= 0)
        close(*fd);
    *fd = -1;
}

static void pump_atts(proc_t *pr)
{
    att_t *next;
    for (att_t *a = pr->atts; a != NULL; a = next) {
        next = a->next; /* a may be freed: its stream can end in pump */
        if (!a->s->closing)
            a->s->ops->pump(a->s);
    }
}

/* Reads one chunk from fd into ring; closes fd at EOF (EIO on a PTY master is EOF). */
static void drain_fd(proc_t *pr, int *fd, sp_ev_t **ev, sp_ring_t *r)
{
    static uint8_t buf[PROC_READ_CHUNK];
    size_t room = ring_room(pr, r, r == &pr->out);
    if (room == 0)
        return;
    ssize_t n = read(*fd, buf, room);
    if (n > 0) {
        if (sp_ring_write(r, buf, (size_t)n) < 0)
            sp_log(SP_LOG_ERROR, "proc", "ring alloc failed pid=%d", (int)pr->pid);
    } else if (n == 0 || (errno != EAGAIN && errno != EINTR)) {
        close_fd(fd, ev);
    }
}

static void on_out(int fd, short rev, void *arg)
{
    proc_t *pr = arg;
    drain_fd(pr, &pr->out_fd, &pr->out_ev, &pr->out);
    update_out_interest(pr);
    pump_atts(pr);
}

static void on_err(int fd, short rev, void *arg)
{
    proc_t *pr = arg;
    drain_fd(pr, &pr->err_fd, &pr->err_ev, &pr->err);
    update_out_interest(pr);
    pump_atts(pr);
}

/* Sends ring bytes as one frame of type; returns bytes sent. */
static size_t send_ring(att_t *a, uint16_t type, const sp_ring_t *r, uint64_t *pos)
{
    sp_stream_t *s = a->s;
    if (*pos >= r->head || s->send_credit == 0)
        return 0;
    size_t n = SP_AP_MAX_DATA;
    if (n > s->send_credit)
        n = (size_t)s->send_credit;
    sp_ap_writer_t *w = sp_chan_begin(s->id, type, 0, n);
    if (w == NULL)
        return 0;
    size_t got = sp_ring_read(r, pos, w->buf + w->len, n);
    w->len += got;
    sp_chan_end(w);
    s->send_credit -= got;
    return got;
}

static void send_started(att_t *a)
{
    sp_ap_writer_t *w = sp_chan_begin(a->s->id, SP_AP_T_PROC_STARTED, 0, 16);
    if (w != NULL) {
        sp_ap_put_u32(w, SP_AP_K_PID, (uint32_t)a->pr->pid);
        sp_chan_end(w);
    }
    a->started_sent = true;
}

static void put_exit_fields(sp_ap_writer_t *w, int status)
{
    if (WIFSIGNALED(status))
        sp_ap_put_u32(w, SP_AP_K_SIGNAL, (uint32_t)WTERMSIG(status));
    else
        sp_ap_put_i32(w, SP_AP_K_EXIT_CODE, WEXITSTATUS(status));
}

static void att_pump(sp_stream_t *s)
{
    att_t *a = s->obj;
    proc_t *pr = a->pr;
    if (!a->started_sent)
        send_started(a);
    while (sp_chan_tx_ok() && s->send_credit > 0) {
        size_t sent = send_ring(a, SP_AP_T_PROC_STDOUT, &pr->out, &a->pos_out);
        sent += send_ring(a, SP_AP_T_PROC_STDERR, &pr->err, &a->pos_err);
        if (sent == 0)
            break;
    }
    if (finished(pr) && a->pos_out >= pr->out.head && a->pos_err >= pr->err.head) {
        sp_ap_writer_t *w = sp_chan_begin(s->id, SP_AP_T_PROC_EXIT, SP_AP_F_END, 32);
        if (w != NULL) {
            put_exit_fields(w, pr->status);
            sp_chan_end(w);
        }
        sp_stream_close(s);
        return;
    }
    update_out_interest(pr);
}

/* ---- stdin ---- */

/* Gives drained stdin bytes back to the streams they came from, oldest first. */
static void repay(proc_t *pr, size_t k)
{
    for (att_t *a = pr->atts; a != NULL && k > 0; a = a->next) {
        uint64_t pay = a->owed < k ? a->owed : k;
        a->owed -= pay;
        k -= (size_t)pay;
        sp_stream_grant(a->s, (uint32_t)pay);
    }
}

static void close_stdin(proc_t *pr)
{
    pr->in_close_pending = false;
    if (pr->in_fd < 0)
        return;
    if (pr->pty) {
        /* The terminal is the child's stdout too; EOF on a PTY is the EOT character. */
        static const char eot = 4;
        (void)!write(pr->in_fd, &eot, 1);
        return;
    }
    close_fd(&pr->in_fd, &pr->in_ev);
}

/* Writes as much of p as the child takes now; returns bytes written or -1 if stdin is dead. */
static ssize_t write_stdin(proc_t *pr, const uint8_t *p, size_t n)
{
    size_t done = 0;
    while (done < n) {
        ssize_t w = write(pr->in_fd, p + done, n - done);
        if (w < 0) {
            if (errno == EAGAIN || errno == EINTR)
                break;
            return -1;
        }
        done += (size_t)w;
    }
    return (ssize_t)done;
}

static void stdin_broken(proc_t *pr)
{
    size_t k = pr->inlen;
    pr->inlen = 0;
    repay(pr, k);
    close_fd(&pr->in_fd, &pr->in_ev);
}

static void on_in(int fd, short rev, void *arg)
{
    proc_t *pr = arg;
    ssize_t w = write_stdin(pr, pr->inbuf, pr->inlen);
    if (w < 0) {
        stdin_broken(pr);
        return;
    }
    memmove(pr->inbuf, pr->inbuf + w, pr->inlen - (size_t)w);
    pr->inlen -= (size_t)w;
    repay(pr, (size_t)w);
    if (pr->inlen == 0) {
        sp_ev_mod(pr->in_ev, 0);
        if (pr->in_close_pending)
            close_stdin(pr);
    }
}

static void stdin_data(att_t *a, const uint8_t *p, size_t n)
{
    proc_t *pr = a->pr;
    if (pr->in_fd < 0 || pr->in_close_pending) {
        sp_stream_grant(a->s, (uint32_t)n); /* stdin is closed: the bytes go nowhere */
        return;
    }
    ssize_t w = pr->inlen == 0 ? write_stdin(pr, p, n) : 0;
    if (w < 0) {
        stdin_broken(pr);
        sp_stream_grant(a->s, (uint32_t)n);
        return;
    }
    size_t rest = n - (size_t)w;
    if (rest > 0) {
        /* Bounded: each stream can only have its window's worth outstanding. */
        uint8_t *nb = realloc(pr->inbuf, pr->inlen + rest);
        if (nb == NULL) {
            sp_stream_grant(a->s, (uint32_t)rest);
            rest = 0;
        } else {
            pr->inbuf = nb;
            memcpy(pr->inbuf + pr->inlen, p + w, rest);
            pr->inlen += rest;
            a->owed += rest;
            sp_ev_mod(pr->in_ev, POLLOUT);
        }
    }
    sp_stream_grant(a->s, (uint32_t)w);
}

/* ---- frames on an attached stream ---- */

static void att_signal(att_t *a, const uint8_t *p, uint32_t n)
{
    uint32_t sig = 0, group = 0;
    if (sp_ap_get_u32(p, n, SP_AP_K_SIGNAL, &sig) < 0 ||
        sp_ap_get_u32(p, n, SP_AP_K_GROUP, &group) < 0 || sig == 0 || sig > 64) {
        sp_sess_error(a->s->id, SP_AP_E_INVAL, 0, "bad signal");
        return;
    }
    /* A group's number is never reused while it exists: it can be killed even after the
     * command's own process is gone, and the processes it left behind go with it. */
    if (group && sig == SIGKILL && a->pr->cg != 0)
        sp_cgroup_kill(a->pr->cg);
    if (a->pr->reaped)
        return; /* the pid may already belong to someone else */
    pid_t target = group ? -a->pr->pid : a->pr->pid;
    if (kill(target, (int)sig) < 0)
        sp_log(SP_LOG_DEBUG, "proc", "kill failed pid=%d errno=%d", (int)a->pr->pid, errno);
}

static void att_resize(att_t *a, const uint8_t *p, uint32_t n)
{
    uint32_t rows = 0, cols = 0;
    if (sp_ap_get_u32(p, n, SP_AP_K_ROWS, &rows) < 0 ||
        sp_ap_get_u32(p, n, SP_AP_K_COLS, &cols) < 0 || rows == 0 || cols == 0 ||
        rows > 0xffff || cols > 0xffff) {
        sp_sess_error(a->s->id, SP_AP_E_INVAL, 0, "bad pty size");
        return;
    }
    if (!a->pr->pty || a->pr->in_fd < 0)
        return;
    struct winsize ws = {.ws_row = (unsigned short)rows, .ws_col = (unsigned short)cols};
    ioctl(a->pr->in_fd, TIOCSWINSZ, &ws);
}

static void att_frame(sp_stream_t *s, const sp_ap_hdr_t *h, const uint8_t *p)
{
    att_t *a = s->obj;
    switch (h->type) {
    case SP_AP_T_DATA:
        stdin_data(a, p, h->len);
        break;
    case SP_AP_T_EOF:
        if (a->pr->inlen > 0)
            a->pr->in_close_pending = true;
        else
            close_stdin(a->pr);
        break;
    case SP_AP_T_PROC_SIGNAL:
        att_signal(a, p, h->len);
        break;
    case SP_AP_T_PROC_RESIZE:
        att_resize(a, p, h->len);
        break;
    default:
        sp_stream_bad_type(s, h->type, "process");
    }
}

static void free_proc(proc_t *pr)
{
    close_fd(&pr->exec_fd, &pr->exec_ev);
    close_fd(&pr->in_fd, &pr->in_ev);
    close_fd(&pr->out_fd, &pr->out_ev);
    close_fd(&pr->err_fd, &pr->err_ev);
    sp_ring_free(&pr->out);
    sp_ring_free(&pr->err);
    free(pr->inbuf);
    free(pr->tag);
    free(pr->summary);
    free(pr->cwd);
    free(pr);
}

/* Keeps at most PROC_KEEP_FINISHED unattached finished processes. Runs from
 * the loop (sp_proc_tick), never from a callback that may still hold a proc. */
void sp_proc_tick(void)
{
    for (;;) {
        int count = 0;
        proc_t *oldest = NULL;
        for (proc_t *pr = procs; pr != NULL; pr = pr->next) {
            if (finished(pr) && pr->atts == NULL) {
                count++;
                if (oldest == NULL || pr->seq < oldest->seq)
                    oldest = pr;
            }
        }
        if (count <= PROC_KEEP_FINISHED)
            return;
        proc_t **pp = &procs;
        while (*pp != oldest)
            pp = &(*pp)->next;
        *pp = oldest->next;
        free_proc(oldest);
    }
}

static void att_close(sp_stream_t *s)
{
    att_t *a = s->obj;
    proc_t *pr = a->pr;
    att_t **pp = &pr->atts;
    while (*pp != a)
        pp = &(*pp)->next;
    *pp = a->next;
    free(a);
    /* A detached lagging reader no longer holds the pipe back. */
    update_out_interest(pr);
}

static const sp_stream_ops_t att_ops = {att_frame, att_pump, att_close};

static int attach(uint32_t id, proc_t *pr, bool replay)
{
    int count = 0;
    for (att_t *x = pr->atts; x != NULL; x = x->next)
        count++;
    if (count >= PROC_MAX_ATTACH) {
        sp_sess_error(id, SP_AP_E_BUSY, 0, "too many streams on process");
        return -1;
    }
    att_t *a = calloc(1, sizeof(*a));
    if (a == NULL) {
        sp_sess_error(id, SP_AP_E_INTERNAL, ENOMEM, "out of memory");
        return -1;
    }
    a->pr = pr;
    a->pos_out = replay ? sp_ring_tail(&pr->out) : pr->out.head;
    a->pos_err = replay ? sp_ring_tail(&pr->err) : pr->err.head;
    a->s = sp_sess_open(id, &att_ops, a);
    if (a->s == NULL) {
        free(a);
        sp_sess_error(id, SP_AP_E_INTERNAL, ENOMEM, "out of memory");
        return -1;
    }
    a->next = pr->atts;
    pr->atts = a;
    att_pump(a->s);
    return 0;
}

/* ---- reaping ---- */

static void on_reaped(proc_t *pr, int status)
{
    pr->reaped = true;
    pr->status = status;
    pr->cg = sp_cgroup_cmd_done(pr->cg); /* kept only while processes outlive it */
    if (pr->pty && pr->out_fd >= 0) {
        /* A background job may hold the terminal open forever: take what is
         * there now and call it the end, as a terminal emulator would. */
        for (int i = 0; i < 64 && pr->out_fd >= 0; i++) {
            struct pollfd pf = {.fd = pr->out_fd, .events = POLLIN};
            if (poll(&pf, 1, 0) <= 0 || !ring_has_room(pr, &pr->out, true))
                break;
            drain_fd(pr, &pr->out_fd, &pr->out_ev, &pr->out);
        }
        close_fd(&pr->out_fd, &pr->out_ev);
        close_fd(&pr->in_fd, &pr->in_ev);
    }
    pump_atts(pr);
}

static void on_sigchld(int fd, short rev, void *arg)
{
    struct signalfd_siginfo si;
    while (read(sig_fd, &si, sizeof(si)) == (ssize_t)sizeof(si))
        ;
    int status;
    pid_t pid;
    while ((pid = waitpid(-1, &status, WNOHANG)) > 0) {
        proc_t *pr = find_pid(pid);
        if (pr != NULL && !pr->reaped)
            on_reaped(pr, status);
    }
    sp_cgroup_sweep();
}

int sp_proc_init(void)
{
    sigset_t set;
    sigemptyset(&set);
    sigaddset(&set, SIGCHLD);
    if (sigprocmask(SIG_BLOCK, &set, NULL) < 0)
        return -1;
    sig_fd = signalfd(-1, &set, SFD_NONBLOCK | SFD_CLOEXEC);
    if (sig_fd < 0)
        return -1;
    return sp_ev_add(sig_fd, POLLIN, on_sigchld, NULL) ? 0 : -1;
}

/* ---- starting ---- */

/* A PROC_START decoded into NUL-terminated, heap-owned strings. */
typedef struct {
    char **argv; /* NULL-terminated */
    char **env;  /* NULL-terminated, final environment */
    char *cwd;
    char *tag;
    bool cwd_defaulted;
    sp_user_t user;
    bool pty, stdin_pipe;
    unsigned rows, cols;
} spec_t;

static char *dup_sv(sp_ap_str_t s)
{
    char *p = malloc((size_t)s.n + 1);
    if (p != NULL) {
        memcpy(p, s.p, s.n);
        p[s.n] = 0;
    }
    return p;
}

static void free_strv(char **v)
{
    for (size_t i = 0; v != NULL && v[i] != NULL; i++)
        free(v[i]);
    free(v);
}

static void free_spec(spec_t *sp)
{
    free_strv(sp->argv);
    free_strv(sp->env);
    free(sp->cwd);
    free(sp->tag);
}

/* Sets "K=V" in env (capacity cap), replacing an existing K. Takes ownership of kv. */
static void env_set(char **env, size_t *n, size_t cap, char *kv)
{
    if (kv == NULL)
        return;
    const char *eq = strchr(kv, '=');
    size_t klen = eq ? (size_t)(eq - kv) : strlen(kv);
    for (size_t i = 0; i < *n; i++) {
        if (strncmp(env[i], kv, klen) == 0 && env[i][klen] == '=') {
            free(env[i]);
            env[i] = kv;
            return;
        }
    }
    if (*n + 1 < cap && eq != NULL && klen > 0)
        env[(*n)++] = kv;
    else
        free(kv);
}

static char *fmt_kv(const char *k, const char *v)
{
    size_t n = strlen(k) + strlen(v) + 2;
    char *p = malloc(n);
    if (p != NULL)
        snprintf(p, n, "%s=%s", k, v);
    return p;
}

static char **build_env(const sp_ap_proc_start_t *m, const sp_user_t *u)
{
    int egc;
    char *const *eg = sp_egress_env(&egc);
    size_t cap = 8 + (size_t)sp_sess_default_envc + (size_t)egc + m->envc + 1, n = 0;
    char **env = calloc(cap, sizeof(*env));
    if (env == NULL)
        return NULL;
    env_set(env, &n, cap, fmt_kv("HOME", u->home));
    env_set(env, &n, cap, fmt_kv("USER", u->name));
    env_set(env, &n, cap, fmt_kv("LOGNAME", u->name));
    env_set(env, &n, cap, fmt_kv("SHELL", u->shell));
    env_set(env, &n, cap, fmt_kv("PATH", SP_AGENT_PATH));
    if (m->pty)
        env_set(env, &n, cap, fmt_kv("TERM", "xterm-256color"));
    for (int i = 0; i < sp_sess_default_envc; i++)
        env_set(env, &n, cap, strdup(sp_sess_default_env[i]));
    for (int i = 0; i < egc; i++) /* proxy settings over IDENTITY's, under the request's */
        env_set(env, &n, cap, strdup(eg[i]));
    for (uint32_t i = 0; i < m->envc; i++)
        env_set(env, &n, cap, dup_sv(m->env[i]));
    return env;
}

static char **build_argv(const sp_ap_proc_start_t *m)
{
    uint32_t argc = m->argc ? m->argc : 3;
    char **argv = calloc((size_t)argc + 1, sizeof(*argv));
    if (argv == NULL)
        return NULL;
    if (m->argc == 0) {
        argv[0] = strdup("/bin/sh");
        argv[1] = strdup("-c");
        argv[2] = dup_sv(m->cmd);
    } else {
        for (uint32_t i = 0; i < argc; i++)
            argv[i] = dup_sv(m->argv[i]);
    }
    for (uint32_t i = 0; i < argc; i++) {
        if (argv[i] == NULL) {
            free_strv(argv);
            return NULL;
        }
    }
    return argv;
}

static char *resolve_cwd(sp_ap_str_t cwd, const sp_user_t *u)
{
    if (cwd.p == NULL || cwd.n == 0)
        return strdup(u->home);
    char buf[PATH_MAX];
    sp_err_t err;
    if (sp_users_resolve_path(u, cwd.p, cwd.n, buf, sizeof(buf), &err) < 0)
        return dup_sv(cwd); /* left as given: the chdir fails and says so */
    return strdup(buf);
}

/* Fills sp from the payload; on failure sends ERROR and returns -1. */
static int parse_spec(uint32_t id, const uint8_t *p, uint32_t n, spec_t *sp)
{
    static sp_ap_proc_start_t m; /* 8 KiB: keep it off the stack */
    sp_err_t err;
    memset(sp, 0, sizeof(*sp));
    if (sp_ap_dec_proc_start(p, n, &m, &err) < 0) {
        sp_sess_error(id, SP_AP_E_INVAL, 0, "%s", err.msg);
        return -1;
    }
    char uname[64] = "";
    if (m.user.p != NULL && (m.user.n >= sizeof(uname) || m.user.n == 0)) {
        sp_sess_error(id, SP_AP_E_INVAL, 0, "bad user name");
        return -1;
    }
    if (m.user.p != NULL)
        memcpy(uname, m.user.p, m.user.n);
    if (sp_users_lookup(uname, &sp->user, &err) < 0) {
        sp_sess_error(id, SP_AP_E_NOTFOUND, 0, "%s", err.msg);
        return -1;
    }
    sp->argv = build_argv(&m);
    sp->env = build_env(&m, &sp->user);
    sp->cwd = resolve_cwd(m.cwd, &sp->user);
    sp->cwd_defaulted = m.cwd.p == NULL || m.cwd.n == 0;
    sp->tag = m.tag.p ? dup_sv(m.tag) : NULL;
    sp->pty = m.pty;
    sp->stdin_pipe = m.stdin_pipe;
    sp->rows = m.rows ? m.rows : 24;
    sp->cols = m.cols ? m.cols : 80;
    if (sp->argv == NULL || sp->env == NULL || sp->cwd == NULL) {
        free_spec(sp);
        sp_sess_error(id, SP_AP_E_INTERNAL, ENOMEM, "out of memory");
        return -1;
    }
    return 0;
}

/* Child side: never returns. Reports a failure's errno on errfd. */
static void exec_child(const spec_t *sp, int in, int out, int err, int errfd)
{
    sigset_t none;
    sigemptyset(&none);
    sigprocmask(SIG_SETMASK, &none, NULL);
    for (int s = 1; s < NSIG; s++)
        signal(s, SIG_DFL);
    setsid();
    if (sp->pty) {
        ioctl(in, TIOCSCTTY, 0);
        struct winsize ws = {.ws_row = (unsigned short)sp->rows, .ws_col = (unsigned short)sp->cols};
        ioctl(in, TIOCSWINSZ, &ws);
    }
    if (dup2(in, 0) < 0 || dup2(out, 1) < 0 || dup2(err, 2) < 0)
        goto fail;
    if (setgroups((size_t)sp->user.ngroups, sp->user.groups) < 0 && sp->user.uid != getuid())
        goto fail;
    if (setgid(sp->user.gid) < 0 || setuid(sp->user.uid) < 0)
        goto fail;
    /* A defaulted cwd is the home, which may not exist (nobody: /nonexistent). */
    if (chdir(sp->cwd) < 0 && (!sp->cwd_defaulted || chdir("/") < 0))
        goto fail;
    const char *file = sp->argv[0];
    if (strchr(file, '/') != NULL) {
        execve(file, sp->argv, sp->env);
        goto fail;
    }
    int best = ENOENT;
    char path[4096];
    for (const char *d = SP_AGENT_PATH; *d;) {
        size_t len = strcspn(d, ":");
        snprintf(path, sizeof(path), "%.*s/%s", (int)len, d, file);
        execve(path, sp->argv, sp->env);
        if (errno == EACCES)
            best = EACCES;
        d += len + (d[len] == ':');
    }
    errno = best;
fail:;
    int e = errno;
    (void)!write(errfd, &e, sizeof(e));
    _exit(127);
}

/* The child's ends and our ends of its stdio. */
typedef struct {
    int child_in, child_out, child_err;
    int in, out, err;
} stdio_t;

static int open_pty(const spec_t *sp, stdio_t *io)
{
    int m = posix_openpt(O_RDWR | O_NOCTTY | O_CLOEXEC);
    if (m < 0 || grantpt(m) < 0 || unlockpt(m) < 0)
        goto fail;
    char *name = ptsname(m);
    int s = name ? open(name, O_RDWR | O_NOCTTY | O_CLOEXEC) : -1;
    if (s < 0)
        goto fail;
    int m2 = fcntl(m, F_DUPFD_CLOEXEC, 0);
    if (m2 < 0) {
        close(s);
        goto fail;
    }
    *io = (stdio_t){s, s, s, m2, m, -1};
    return 0;
fail:
    if (m >= 0)
        close(m);
    return -1;
}

static int open_pipes(const spec_t *sp, stdio_t *io)
{
    int pin[2] = {-1, -1}, pout[2] = {-1, -1}, perr[2] = {-1, -1};
    if (sp->stdin_pipe) {
        if (pipe2(pin, O_CLOEXEC) < 0)
            goto fail;
    } else {
        pin[0] = open("/dev/null", O_RDONLY | O_CLOEXEC);
        if (pin[0] < 0)
            goto fail;
    }
    if (pipe2(pout, O_CLOEXEC) < 0 || pipe2(perr, O_CLOEXEC) < 0)
        goto fail;
    *io = (stdio_t){pin[0], pout[1], perr[1], pin[1], pout[0], perr[0]};
    return 0;
fail:
    for (int i = 0; i < 2; i++) {
        if (pin[i] >= 0)
            close(pin[i]);
        if (pout[i] >= 0)
            close(pout[i]);
        if (perr[i] >= 0)
            close(perr[i]);
    }
    return -1;
}

static void close_child_ends(stdio_t *io)
{
    close(io->child_in);
    if (io->child_out != io->child_in)
        close(io->child_out);
    if (io->child_err != io->child_out)
        close(io->child_err);
}

static void close_our_ends(stdio_t *io)
{
    if (io->in >= 0)
        close(io->in);
    if (io->out >= 0)
        close(io->out);
    if (io->err >= 0)
        close(io->err);
}

/*
 * Forks and execs in cgroup cg; returns the pid, or -1 with errno from the child or fork.
 * Waits for the exec (or its failure) PROC_EXEC_WAIT_MS at most: a child that cannot get the
 * memory or CPU to exec (a fork bomb elsewhere in the guest) must not stall the agent, which
 * then goes on with the pid and leaves the outcome on *late_fd (else -1) for later.
 */
static pid_t spawn(const spec_t *sp, uint32_t cg, stdio_t *io, int *late_fd)
{
    *late_fd = -1;
    int ep[2];
    if (pipe2(ep, O_CLOEXEC) < 0)
        return -1;
    pid_t pid = sp_cgroup_fork(cg);
    if (pid == 0) {
        close(ep[0]);
        exec_child(sp, io->child_in, io->child_out, io->child_err, ep[1]);
    }
    int fork_errno = errno;
    close(ep[1]);
    if (pid < 0) {
        close(ep[0]);
        errno = fork_errno;
        return -1;
    }
    struct pollfd pf = {.fd = ep[0], .events = POLLIN};
    int ready;
    do {
        ready = poll(&pf, 1, PROC_EXEC_WAIT_MS);
    } while (ready < 0 && errno == EINTR);
    if (ready == 0) {
        fcntl(ep[0], F_SETFL, fcntl(ep[0], F_GETFL) | O_NONBLOCK);
        *late_fd = ep[0];
        return pid;
    }
    int e = 0;
    ssize_t r;
    do {
        r = read(ep[0], &e, sizeof(e));
    } while (r < 0 && errno == EINTR);
    close(ep[0]);
    if (r == (ssize_t)sizeof(e)) {
        waitpid(pid, NULL, 0);
        errno = e;
        return -1;
    }
    return pid;
}

/* A late exec's outcome: nothing (EOF) when it ran; its errno when it failed, which the
 * command's stderr then says (the child exits 127, reported as any exit is). */
static void on_late_exec(int fd, short rev, void *arg)
{
    proc_t *pr = arg;
    int e = 0;
    ssize_t r = read(pr->exec_fd, &e, sizeof(e));
    if (r < 0 && (errno == EAGAIN || errno == EINTR))
        return;
    if (r == (ssize_t)sizeof(e)) {
        char msg[256];
        int n = snprintf(msg, sizeof(msg), "space-agent: cannot run %.160s: %s\n",
                         pr->summary ? pr->summary : "command", strerror(e));
        if (n > 0 &&
            sp_ring_write(&pr->err, msg, (size_t)n < sizeof(msg) ? (size_t)n : sizeof(msg) - 1) < 0)
            sp_log(SP_LOG_ERROR, "proc", "ring alloc failed pid=%d", (int)pr->pid);
        sp_log(SP_LOG_INFO, "proc", "late exec failed pid=%d errno=%d", (int)pr->pid, e);
        pump_atts(pr);
    }
    close_fd(&pr->exec_fd, &pr->exec_ev);
}

static char *join_argv(char **argv)
{
    size_t n = 1;
    for (size_t i = 0; argv[i]; i++)
        n += strlen(argv[i]) + 1;
    char *s = calloc(1, n);
    for (size_t i = 0; s != NULL && argv[i]; i++) {
        if (i > 0)
            strcat(s, " ");
        strcat(s, argv[i]);
    }
    return s;
}

static proc_t *new_proc(const spec_t *sp, pid_t pid, uint32_t cg, int late_fd, stdio_t *io)
{
    proc_t *pr = calloc(1, sizeof(*pr));
    if (pr == NULL)
        return NULL;
    pr->pid = pid;
    pr->cg = cg;
    pr->exec_fd = late_fd;
    if (late_fd >= 0)
        pr->exec_ev = sp_ev_add(late_fd, POLLIN, on_late_exec, pr);
    pr->pty = sp->pty;
    pr->tag = sp->tag ? strdup(sp->tag) : NULL;
    pr->summary = join_argv(sp->argv);
    pr->cwd = strdup(sp->cwd);
    snprintf(pr->user, sizeof(pr->user), "%s", sp->user.name);
    pr->started_ns = realtime_ns();
    pr->seq = next_seq++;
    sp_ring_init(&pr->out, SP_AP_PROC_RING);
    sp_ring_init(&pr->err, SP_AP_PROC_RING);
    pr->in_fd = io->in;
    pr->out_fd = io->out;
    pr->err_fd = io->err;
    for (int *fd = &pr->in_fd; fd <= &pr->err_fd; fd++)
        if (*fd >= 0)
            fcntl(*fd, F_SETFL, fcntl(*fd, F_GETFL) | O_NONBLOCK);
    if (pr->in_fd >= 0)
        pr->in_ev = sp_ev_add(pr->in_fd, 0, on_in, pr);
    pr->out_ev = sp_ev_add(pr->out_fd, POLLIN, on_out, pr);
    if (pr->err_fd >= 0)
        pr->err_ev = sp_ev_add(pr->err_fd, POLLIN, on_err, pr);
    pr->next = procs;
    procs = pr;
    return pr;
}

void sp_proc_on_start(uint32_t id, const uint8_t *p, uint32_t n)
{
    spec_t sp;
    if (parse_spec(id, p, n, &sp) < 0)
        return;
    stdio_t io;
    if ((sp.pty ? open_pty(&sp, &io) : open_pipes(&sp, &io)) < 0) {
        sp_sess_error_errno(id, errno, "stdio setup");
        free_spec(&sp);
        return;
    }
    uint32_t cg = sp_cgroup_cmd_new();
    int late_fd;
    pid_t pid = spawn(&sp, cg, &io, &late_fd);
    int e = errno;
    close_child_ends(&io);
    if (pid < 0) {
        sp_cgroup_cmd_done(cg);
        close_our_ends(&io);
        sp_sess_error_errno(id, e, "exec");
        free_spec(&sp);
        return;
    }
    proc_t *pr = new_proc(&sp, pid, cg, late_fd, &io);
    free_spec(&sp);
    if (pr == NULL) {
        if (late_fd >= 0)
            close(late_fd);
        close_our_ends(&io);
        kill(pid, SIGKILL);
        sp_sess_error(id, SP_AP_E_INTERNAL, ENOMEM, "out of memory");
        return;
    }
    sp_log(SP_LOG_DEBUG, "proc", "started pid=%d stream=%u", (int)pid, id);
    attach(id, pr, false);
}

void sp_proc_on_attach(uint32_t id, const uint8_t *p, uint32_t n)
{
    uint32_t pid = 0, replay = 0;
    if (sp_ap_get_u32(p, n, SP_AP_K_PID, &pid) < 0 ||
        sp_ap_get_u32(p, n, SP_AP_K_REPLAY, &replay) < 0 || pid == 0) {
        sp_sess_error(id, SP_AP_E_INVAL, 0, "proc_attach needs a pid");
        return;
    }
    proc_t *pr = find_pid((pid_t)pid);
    if (pr == NULL) {
        sp_sess_error(id, SP_AP_E_NOTFOUND, 0, "no process %u", pid);
        return;
    }
    attach(id, pr, replay != 0);
}

static void send_info(uint32_t id, const proc_t *pr)
{
    sp_ap_writer_t *w = sp_chan_begin(id, SP_AP_T_PROC_INFO, 0, 8192);
    if (w == NULL)
        return;
    sp_ap_put_u32(w, SP_AP_K_PID, (uint32_t)pr->pid);
    sp_ap_put_str(w, SP_AP_K_TAG, pr->tag);
    if (pr->summary != NULL) /* long command lines are cut to fit the frame */
        sp_ap_put_bytes(w, SP_AP_K_ARGV, pr->summary, strnlen(pr->summary, 4096));
    sp_ap_put_str(w, SP_AP_K_CWD, pr->cwd);
    sp_ap_put_str(w, SP_AP_K_USER, pr->user);
    sp_ap_put_u32(w, SP_AP_K_PTY, pr->pty);
    sp_ap_put_u32(w, SP_AP_K_RUNNING, !pr->reaped);
    if (pr->reaped)
        put_exit_fields(w, pr->status);
    sp_ap_put_u64(w, SP_AP_K_STARTED_NS, pr->started_ns);
    sp_chan_end(w);
}

void sp_proc_on_list(uint32_t id, const uint8_t *p, uint32_t n)
{
    for (const proc_t *pr = procs; pr != NULL; pr = pr->next)
        send_info(id, pr);
    sp_sess_send_empty(id, SP_AP_T_OK, SP_AP_F_END);
}
