/*
 * cmd_exec.c - spacectl exec and spacectl shell: a command session (POST .../sessions)
 * attached over its WebSocket (GET /v1/attach/{id}/{session}, cli/ws.h), then removed.
 *
 * exec runs argv as given (no shell in between). Its stdout and stderr go to ours as the
 * bytes come (binary-safe: the WebSocket carries raw bytes with a channel byte); our stdin is
 * forwarded when it is not a terminal (a pipe or a file) until its EOF, and the command's
 * stdin is closed at once otherwise. Its exit status becomes ours (128 + n for signal n).
 * SIGINT, SIGTERM and SIGHUP are passed on to the command's process group; a second one stops
 * waiting (removing the session kills the command).
 *
 * shell runs the user's login shell in a PTY. Our terminal goes into raw mode (restored on
 * every way out: the shell's end, errors, SIGTERM, SIGHUP) and every byte typed is forwarded,
 * so Ctrl-C reaches the shell's programs and Ctrl-D ends the shell as it would locally. The
 * window size is sent at the start and on SIGWINCH.
 *
 * If the server answers the attach without upgrading (a proxy that drops Upgrade headers),
 * exec reads the same events as NDJSON instead (the server's fallback): output is then UTF-8
 * text and stdin is not forwarded, which it says on stderr when stdin had something to give.
 * shell needs the WebSocket.
 *
 * Our own failures exit 255, like ssh's, so they stay apart from the command's statuses.
 */
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <termios.h>
#include <unistd.h>

#include "cli/cmd.h"
#include "cli/ws.h"

#define EXIT_OWN       255
#define STDIN_CHUNK    (64 * 1024)
#define STDIN_HIGH     (1024 * 1024) /* queued toward the server before we stop reading stdin */
#define SESSION_TTL_S  60            /* the session is removed if our attach never comes */

static const spc_opt_t exec_opts[] = {
    {"user", 'u', SPC_STR, "U", "run as this guest user (default root)", 0, 0},
    {"cwd", 'w', SPC_STR, "DIR", "working directory (default: the user's home)", 0, 0},
    {"env", 'e', SPC_LIST, "K=V", "an environment variable (repeatable)", 0, 0},
    {NULL, 0, 0, NULL, NULL, 0, 0},
};

static const spc_cmd_t exec_cmd = {
    "exec", "ID [--user U] [--cwd DIR] [--env K=V]... -- CMD [ARGS...]",
    "Run a command in a sandbox.",
    "CMD runs with ARGS as given, without a shell (use -- sh -c '...' for one). Its stdout and\n"
    "stderr arrive on ours as it writes them; our stdin is forwarded when it is a pipe or a\n"
    "file (until its end), and the command's stdin is empty when ours is a terminal. The\n"
    "exit status is the command's own (128 + n when signal n ended it); spacectl's own\n"
    "failures exit 255. Ctrl-C is passed to the command; a second Ctrl-C stops it.",
    exec_opts, "ID", 1, 1, true};

static const spc_opt_t shell_opts[] = {
    {"user", 'u', SPC_STR, "U", "log in as this guest user (default root)", 0, 0},
    {NULL, 0, 0, NULL, NULL, 0, 0},
};

static const spc_cmd_t shell_cmd = {
    "shell", "ID [--user U]", "An interactive shell in a sandbox.",
    "Runs the user's login shell in a pseudo-terminal the size of ours. Everything typed goes\n"
    "to it (Ctrl-C to its programs); Ctrl-D or exit ends it, and its exit status is ours.",
    shell_opts, "ID", 1, 1, false};

/* ---- signals: a self-pipe the loop polls ---- */

static int sig_pipe[2] = {-1, -1};

static void on_signal(int sig)
{
    int saved = errno;
    unsigned char b = (unsigned char)sig;
    if (write(sig_pipe[1], &b, 1) < 0) {
        /* full: the loop has signals enough to read */
    }
    errno = saved;
}

static int signals_start(const int *sigs, size_t n)
{
    if (pipe2(sig_pipe, O_CLOEXEC | O_NONBLOCK) < 0)
        return -1;
    struct sigaction sa = {0};
    sa.sa_handler = on_signal;
    sa.sa_flags = SA_RESTART;
    sigemptyset(&sa.sa_mask);
    for (size_t i = 0; i < n; i++)
        sigaction(sigs[i], &sa, NULL);
    return 0;
}

/* ---- the terminal (shell) ---- */

static struct termios tty_saved;
static bool tty_raw;

static void tty_restore(void)
{
    if (tty_raw) {
        tcsetattr(STDIN_FILENO, TCSADRAIN, &tty_saved);
        tty_raw = false;
    }
}

static int tty_make_raw(void)
{
    if (tcgetattr(STDIN_FILENO, &tty_saved) < 0)
        return -1;
    struct termios t = tty_saved;
    cfmakeraw(&t); /* the sandbox's PTY does the line discipline and output processing */
    if (tcsetattr(STDIN_FILENO, TCSADRAIN, &t) < 0)
        return -1;
    tty_raw = true;
    atexit(tty_restore);
    return 0;
}

static bool window_size(unsigned *rows, unsigned *cols)
{
    struct winsize ws;
    int fds[] = {STDIN_FILENO, STDOUT_FILENO, STDERR_FILENO};
    for (size_t i = 0; i < 3; i++)
        if (ioctl(fds[i], TIOCGWINSZ, &ws) == 0 && ws.ws_row > 0 && ws.ws_col > 0) {
            /* The API takes 1 to 1000 each. */
            *rows = ws.ws_row > 1000 ? 1000 : ws.ws_row;
            *cols = ws.ws_col > 1000 ? 1000 : ws.ws_col;
            return true;
        }
    return false;
}

/* ---- one attachment ---- */

typedef struct {
    spc_ws_t *ws;
    bool exited;     /* the exit event came */
    int status;      /* the exit status it means */
    bool error;      /* an error event came: err says what */
    sp_err_t err;
    bool out_broken; /* our stdout or stderr is gone */
} att_t;

static int write_all(int fd, const uint8_t *p, size_t n)
{
    while (n > 0) {
        ssize_t k = write(fd, p, n);
        if (k < 0 && errno == EINTR)
            continue;
        if (k < 0 && errno == EAGAIN) { /* a non-blocking terminal: wait for room */
            struct pollfd pf = {.fd = fd, .events = POLLOUT};
            poll(&pf, 1, -1);
            continue;
        }
        if (k <= 0)
            return -1;
        p += k;
        n -= (size_t)k;
    }
    return 0;
}

/* An event of the session ({"type":"start"|"exit"|"error",...}), from either framing. */
static void on_event(att_t *st, const char *text, size_t n)
{
    json_t *o = json_loadb(text, n, 0, NULL);
    const char *type = json_string_value(json_object_get(o, "type"));
    if (type == NULL) {
        /* not an event we know: ignored, like new fields */
    } else if (strcmp(type, "exit") == 0) {
        json_t *code = json_object_get(o, "exit_code"), *sig = json_object_get(o, "signal");
        st->exited = true;
        if (json_is_integer(code))
            st->status = (int)json_integer_value(code) & 0xff;
        else if (json_is_integer(sig))
            st->status = 128 + (int)json_integer_value(sig);
        else
            st->status = EXIT_OWN;
    } else if (strcmp(type, "error") == 0) {
        st->error = true;
        const char *m = spc_str(json_object_get(o, "error"), "message");
        sp_err_set(&st->err, SP_EUNAVAIL, "%s", m[0] ? m : "the session failed");
    } else if ((strcmp(type, "stdout") == 0 || strcmp(type, "stderr") == 0) && !st->out_broken) {
        /* NDJSON framing only: the WebSocket sends output as binary messages. */
        json_t *d = json_object_get(o, "data");
        if (json_is_string(d) &&
            write_all(type[3] == 'o' ? STDOUT_FILENO : STDERR_FILENO,
                      (const uint8_t *)json_string_value(d), json_string_length(d)) < 0)
            st->out_broken = true;
    }
    json_decref(o);
}

static void on_ws_message(void *arg, bool text, const uint8_t *p, size_t n)
{
    att_t *st = arg;
    if (text) {
        on_event(st, (const char *)p, n);
        return;
    }
    if (n == 0 || st->out_broken)
        return;
    /* One channel byte: 1 stdout, 2 stderr. */
    int fd = p[0] == 2 ? STDERR_FILENO : STDOUT_FILENO;
    if (write_all(fd, p + 1, n - 1) < 0)
        st->out_broken = true;
}

static int send_json(spc_ws_t *ws, json_t *o)
{
    char *s = json_dumps(o, JSON_COMPACT);
    json_decref(o);
    int rc = s != NULL ? spc_ws_send(ws, true, s, strlen(s), NULL) : -1;
    free(s);
    return rc;
}

static void send_resize(spc_ws_t *ws)
{
    unsigned rows, cols;
    if (window_size(&rows, &cols))
        send_json(ws, json_pack("{s:s,s:i,s:i}", "type", "resize", "rows", (int)rows, "cols",
                                (int)cols));
}

typedef struct {
    bool shell;
    bool fwd_stdin; /* read our stdin and pass it on (else: EOF at once) */
} loop_opts_t;

/* Runs the attachment until the server closes it. 0, or -1 with err (our side failed). */
static int pump(att_t *st, const loop_opts_t *lo, sp_err_t *err)
{
    bool stdin_open = lo->fwd_stdin;
    int forwarded = 0; /* signals passed on (exec) */
    uint8_t *buf = malloc(STDIN_CHUNK);
    if (buf == NULL)
        return sp_err_set(err, SP_EINTERNAL, "out of memory");
    if (!stdin_open)
        send_json(st->ws, json_pack("{s:s}", "type", "eof"));
    if (lo->shell)
        send_resize(st->ws);
    int rc = 0;
    for (;;) {
        struct pollfd pf[3];
        int n = 0, in_at = -1;
        pf[n++] = (struct pollfd){.fd = spc_ws_fd(st->ws), .events = spc_ws_events(st->ws)};
        pf[n++] = (struct pollfd){.fd = sig_pipe[0], .events = POLLIN};
        if (stdin_open && spc_ws_queued(st->ws) < STDIN_HIGH) {
            in_at = n;
            pf[n++] = (struct pollfd){.fd = STDIN_FILENO, .events = POLLIN};
        }
        int k = poll(pf, (nfds_t)n, spc_ws_pending(st->ws) ? 0 : -1);
        if (k < 0 && errno != EINTR) {
            rc = sp_err_set(err, SP_EINTERNAL, "poll: %s", strerror(errno));
            break;
        }
        if (k < 0)
            continue;
        if (pf[1].revents & POLLIN) {
            unsigned char sigs[16];
            ssize_t ns = read(sig_pipe[0], sigs, sizeof(sigs));
            for (ssize_t i = 0; i < ns; i++) {
                if (sigs[i] == SIGWINCH) {
                    if (lo->shell)
                        send_resize(st->ws);
                } else if (lo->shell || ++forwarded > 1) {
                    /* shell: the terminal's keys travel as bytes, so a signal here came from
                     * outside and means leave. exec: the second one means stop waiting. */
                    rc = sp_err_set(err, SP_EUNAVAIL, "stopped by signal %d", sigs[i]);
                    st->status = 128 + sigs[i];
                    goto out;
                } else {
                    send_json(st->ws, json_pack("{s:s,s:i}", "type", "signal", "signal",
                                                (int)sigs[i]));
                }
            }
        }
        if (in_at >= 0 && pf[in_at].revents) {
            ssize_t got = read(STDIN_FILENO, buf, STDIN_CHUNK);
            if (got < 0 && (errno == EINTR || errno == EAGAIN)) {
                /* again later */
            } else if (got > 0) {
                if (spc_ws_send(st->ws, false, buf, (size_t)got, err) < 0)
                    stdin_open = false;
            } else { /* the end (or an error, which ends it just the same) */
                stdin_open = false;
                send_json(st->ws, json_pack("{s:s}", "type", "eof"));
            }
        }
        if (pf[0].revents || spc_ws_pending(st->ws) || spc_ws_events(st->ws) & POLLOUT) {
            int io = spc_ws_io(st->ws, err);
            if (io < 0) {
                rc = -1;
                break;
            }
            if (io == 0)
                break;
        }
        if (st->out_broken)
            break; /* nobody reads what it writes: stop, as a local program would */
    }
out:
    free(buf);
    return rc;
}

/* ---- the session ---- */

/* The server did not upgrade: its answer is the NDJSON attach (or an error). 0 when the
 * events were read (st says how it ended), -1 after printing why not. */
static int attach_ndjson(spc_api_t *api, spc_resp_t *r, att_t *st, bool stdin_wanted)
{
    sp_err_t e;
    if (spc_resp_status(r) != 200) {
        spc_api_error(api, r, &e);
        spc_fail(&e);
        return -1;
    }
    if (stdin_wanted)
        fprintf(stderr, "spacectl: the server did not open a WebSocket (a proxy in between?): "
                        "stdin is not forwarded, output is UTF-8 text\n");
    const char *line;
    size_t len;
    int rc;
    while ((rc = spc_resp_line(r, &line, &len, &e)) == 1 && !st->out_broken)
        on_event(st, line, len);
    if (rc < 0) {
        spc_fail(&e);
        return -1;
    }
    return 0;
}

/* The exit status an attachment that ran (or tried to) ends with; says why on stderr when it
 * is not the command's own. */
static int verdict(att_t *st, int rc, const sp_err_t *e)
{
    if (st->exited)
        return st->status; /* error events before the exit were about control messages */
    if (st->out_broken)
        return 128 + SIGPIPE; /* as if we had died of it, like a local program */
    if (rc < 0)
        spc_fail(e);
    else if (st->error)
        spc_fail(&st->err);
    else
        spc_failf("the connection to the session ended before the command did");
    return rc < 0 && st->status != EXIT_OWN ? st->status : EXIT_OWN;
}

/* Creates the session (spec is taken), attaches, removes the session. */
static int run_session(spc_args_t *a, json_t *spec, const loop_opts_t *lo)
{
    spc_api_t api;
    sp_err_t e;
    char path[256];
    json_t *sess;
    if (spc_api(&api) < 0) {
        json_decref(spec);
        return EXIT_OWN;
    }
    const char *id = a->pos[0];
    spc_path(path, sizeof(path), "/v1/sandboxes/%s/sessions", id);
    int rc = spc_api_call(&api, "POST", path, spec, &sess, NULL, &e);
    json_decref(spec);
    if (rc < 0) {
        spc_fail(&e);
        return EXIT_OWN;
    }
    const char *url = spc_str(sess, "attach_url"), *token = spc_str(sess, "attach_token");
    /* attach_url is a path on the server (the URL's prefix applies, as to every API path):
     * any node forwards it to the worker that holds the session. A full URL is followed too. */
    spc_url_t where = api.url;
    const char *apath = url;
    if (strncmp(url, "http://", 7) == 0 || strncmp(url, "https://", 8) == 0) {
        const char *slash = strchr(strstr(url, "//") + 2, '/');
        char base[600];
        snprintf(base, sizeof(base), "%.*s", slash ? (int)(slash - url) : (int)strlen(url), url);
        apath = slash ? slash : "/";
        if (spc_url_parse(base, &where, &e) < 0) {
            json_decref(sess);
            spc_fail(&e);
            return EXIT_OWN;
        }
    }
    static const int sigs[] = {SIGINT, SIGTERM, SIGHUP, SIGWINCH};
    if (signals_start(sigs, sizeof(sigs) / sizeof(sigs[0])) < 0) {
        json_decref(sess);
        spc_failf("cannot set up signal handling: %s", strerror(errno));
        return EXIT_OWN;
    }
    att_t st = {.status = EXIT_OWN};
    spc_resp_t *plain = NULL;
    const spc_ws_cbs_t cbs = {on_ws_message};
    st.ws = spc_ws_connect(&where, apath, token, &cbs, &st, &plain, &e);
    int status = EXIT_OWN;
    if (st.ws != NULL) {
        if (lo->shell && isatty(STDIN_FILENO) && tty_make_raw() < 0)
            fprintf(stderr, "spacectl: cannot put the terminal in raw mode: %s\n",
                    strerror(errno));
        rc = pump(&st, lo, &e);
        tty_restore();
        status = verdict(&st, rc, &e);
        spc_ws_free(st.ws);
    } else if (plain == NULL) {
        spc_fail(&e);
    } else if (lo->shell && spc_resp_status(plain) == 200) {
        spc_failf("the server did not open a WebSocket (a proxy in between?): a shell needs one");
    } else if (attach_ndjson(&api, plain, &st, lo->fwd_stdin) == 0) {
        status = verdict(&st, 0, &e);
    }
    spc_resp_free(plain);
    char sess_path[512];
    snprintf(sess_path, sizeof(sess_path), "%s/%s", path, spc_str(sess, "id"));
    spc_api_call(&api, "DELETE", sess_path, NULL, NULL, NULL, &e); /* best effort: it expires */
    json_decref(sess);
    return status;
}

static int run_exec(spc_args_t *a)
{
    sp_err_t e;
    size_t nenv;
    const char *const *env = spc_args_list(a, "env", &nenv);
    json_t *spec = json_object(), *argv = json_array(), *o;
    for (int i = 0; i < a->nrest; i++)
        json_array_append_new(argv, json_string(a->rest[i]));
    json_object_set_new(spec, "argv", argv);
    json_object_set_new(spec, "attach_timeout_s", json_integer(SESSION_TTL_S));
    if (spc_args_str(a, "user"))
        json_object_set_new(spec, "user", json_string(spc_args_str(a, "user")));
    if (spc_args_str(a, "cwd"))
        json_object_set_new(spec, "cwd", json_string(spc_args_str(a, "cwd")));
    if (nenv > 0) {
        if (spc_kv_object(env, nenv, "--env", &o, &e) < 0) {
            json_decref(spec);
            fprintf(stderr, "spacectl: %s\n", e.msg);
            return SPC_EXIT_USAGE;
        }
        json_object_set_new(spec, "env", o);
    }
    loop_opts_t lo = {.shell = false, .fwd_stdin = !isatty(STDIN_FILENO)};
    return run_session(a, spec, &lo);
}

static int run_shell(spc_args_t *a)
{
    unsigned rows = 24, cols = 80;
    window_size(&rows, &cols);
    /* The login shell the guest's passwd gives the user (the agent sets SHELL from it). */
    json_t *spec = json_pack("{s:[s,s,s],s:b,s:i,s:i,s:i}", "argv", "/bin/sh", "-c",
                             "exec \"${SHELL:-/bin/sh}\" -l", "pty", 1, "rows", (int)rows,
                             "cols", (int)cols, "attach_timeout_s", SESSION_TTL_S);
    const char *term = getenv("TERM");
    if (term != NULL && term[0] != '\0')
        json_object_set_new(spec, "env", json_pack("{s:s}", "TERM", term));
    if (spc_args_str(a, "user"))
        json_object_set_new(spec, "user", json_string(spc_args_str(a, "user")));
    loop_opts_t lo = {.shell = true, .fwd_stdin = true};
    return run_session(a, spec, &lo);
}

const spc_verb_t spc_exec_verbs[] = {{NULL, &exec_cmd, run_exec}};
const spc_verb_t spc_shell_verbs[] = {{NULL, &shell_cmd, run_shell}};
