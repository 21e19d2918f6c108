/*
 * test_code.c - core/channel/code.h against a real space-agent and a stand-in code daemon.
 *
 * Starts $SPACE_AGENT_BIN --listen-unix (the agent runs on this host, so its TCP_CONNECT
 * reaches 127.0.0.1 here) and points the module at a free port (SPACE_CODE_PORT) and at a
 * start script this test writes (SPACE_CODE_DAEMON). A forked child plays the daemon where a
 * case needs one. Covers what the HTTP tests cannot reach: one start for requests that wait
 * together, cancelling a waiter (also from another waiter's callback), a connection destroyed
 * while its start runs, credit granted only as output is acknowledged, and cancel from inside
 * a callback. Skips (77) without the agent binary or root (the agent switches users).
 */
#include <arpa/inet.h>
#include <netinet/in.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "base/log.h"
#include "core/channel/code.h"
#include "core/channel/tests/real_agent.h"
#include "tests/check.h"
#include "tests/ports.h"

static sp_loop_t *loop;
static char dir[] = "/tmp/sp-code-test.XXXXXX";
static char script[256], starts[256];
static int port;
static const char *agent_bin;

/* ---- helpers ---- */

static void run_for(int ms)
{
    uint64_t end = sp_loop_now_ms(loop) + (uint64_t)ms;
    while (sp_loop_now_ms(loop) < end)
        sp_loop_run_once(loop, 10);
}

static bool run_until(const int *flag, int ms)
{
    uint64_t end = sp_loop_now_ms(loop) + (uint64_t)ms;
    while (!*flag && sp_loop_now_ms(loop) < end)
        sp_loop_run_once(loop, 10);
    return *flag;
}

static void write_script(const char *body)
{
    FILE *f = fopen(script, "w");
    if (f == NULL)
        return;
    fprintf(f, "#!/bin/sh\n%s", body);
    fclose(f);
    chmod(script, 0755);
}

static int count_lines(const char *path)
{
    FILE *f = fopen(path, "r");
    if (f == NULL)
        return 0;
    int n = 0, ch;
    while ((ch = fgetc(f)) != EOF)
        n += ch == '\n';
    fclose(f);
    return n;
}

static bool wait_file(const char *path, int ms)
{
    uint64_t end = sp_loop_now_ms(loop) + (uint64_t)ms;
    while (access(path, F_OK) != 0 && sp_loop_now_ms(loop) < end)
        sp_loop_run_once(loop, 10);
    return access(path, F_OK) == 0;
}

/* ---- a stand-in daemon in a child process ---- */

enum { D_LIST = 0, D_FLOOD, D_HOLD };
#define FLOOD_LINES 2000
#define FLOOD_TEXT  1000

struct shared {
    volatile int listening;
    volatile int sent;   /* D_FLOOD: lines written */
    volatile int closed; /* D_HOLD: the client closed its end */
};
static struct shared *sh;

static void put(int fd, const char *s, size_t n)
{
    while (n > 0) {
        ssize_t w = write(fd, s, n);
        if (w <= 0)
            _exit(0);
        s += w;
        n -= (size_t)w;
    }
}

static void daemon_conn(int fd, int mode)
{
    char ch;
    while (read(fd, &ch, 1) == 1 && ch != '\n') /* the request line */
        ;
    static const char ctx[] = "{\"id\":\"c1\",\"language\":\"python\",\"cwd\":\"/\"}";
    char line[FLOOD_TEXT + 128];
    if (mode == D_LIST) {
        snprintf(line, sizeof(line), "{\"ok\":true,\"contexts\":[%s]}\n", ctx);
        put(fd, line, strlen(line));
        return;
    }
    snprintf(line, sizeof(line), "{\"ok\":true,\"context\":%s}\n", ctx);
    put(fd, line, strlen(line));
    if (mode == D_FLOOD) {
        char text[FLOOD_TEXT + 1];
        memset(text, 'z', FLOOD_TEXT);
        text[FLOOD_TEXT] = '\0';
        for (int i = 0; i < FLOOD_LINES; i++) {
            snprintf(line, sizeof(line), "{\"type\":\"stdout\",\"text\":\"%s\"}\n", text);
            put(fd, line, strlen(line));
            sh->sent = i + 1;
        }
        static const char end[] = "{\"type\":\"end\",\"status\":\"ok\",\"execution_count\":1}\n";
        put(fd, end, strlen(end));
        return;
    }
    static const char out[] = "{\"type\":\"stdout\",\"text\":\"x\"}\n";
    put(fd, out, strlen(out));
    while (read(fd, &ch, 1) > 0)
        ;
    sh->closed = 1;
}

static pid_t daemon_start(int mode)
{
    sh->listening = 0;
    sh->sent = 0;
    sh->closed = 0;
    pid_t pid = fork();
    if (pid == 0) {
        prctl(PR_SET_PDEATHSIG, SIGKILL);
        signal(SIGPIPE, SIG_IGN);
        int ls = socket(AF_INET, SOCK_STREAM, 0);
        int one = 1;
        setsockopt(ls, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
        struct sockaddr_in sa = {.sin_family = AF_INET, .sin_port = htons((uint16_t)port)};
        sa.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
        if (bind(ls, (struct sockaddr *)&sa, sizeof(sa)) < 0 || listen(ls, 16) < 0)
            _exit(1);
        sh->listening = 1;
        for (;;) {
            int fd = accept(ls, NULL, NULL);
            if (fd < 0)
                _exit(1);
            daemon_conn(fd, mode);
            close(fd);
        }
    }
    for (int i = 0; i < 500 && !sh->listening; i++)
        usleep(10000);
    CHECK(sh->listening);
    return pid;
}

static void daemon_stop(pid_t pid)
{
    if (pid > 0) {
        kill(pid, SIGKILL);
        waitpid(pid, NULL, 0);
    }
}

/* ---- recorders ---- */

struct rec {
    int calls;
    sp_code_t code;
    char msg[160];
    size_t n;
    sp_code_op_t *cancel_in_cb; /* cancelled from inside this op's callback */
};

static void on_list(void *arg, const sp_code_ctx_t *ctxs, size_t n, bool truncated,
                    const sp_err_t *err)
{
    struct rec *r = arg;
    r->calls++;
    r->code = err ? err->code : SP_OK;
    snprintf(r->msg, sizeof(r->msg), "%s", err ? err->msg : "");
    r->n = n;
    if (r->cancel_in_cb != NULL)
        sp_code_cancel(r->cancel_in_cb);
}

/* ---- cases ---- */

static void test_code_language(void)
{
    CHECK(strcmp(sp_code_language("python"), "python") == 0);
    CHECK(strcmp(sp_code_language(" Python3\n"), "python") == 0);
    CHECK(strcmp(sp_code_language("PY"), "python") == 0);
    CHECK(strcmp(sp_code_language("sh"), "bash") == 0);
    CHECK(strcmp(sp_code_language("Bash"), "bash") == 0);
    CHECK(sp_code_language("r") == NULL);
    CHECK(sp_code_language("") == NULL);
    CHECK(sp_code_language("   ") == NULL);
    CHECK(sp_code_language(NULL) == NULL);
    CHECK(sp_code_language("pythonpythonpythonpython") == NULL);
}

static void test_code_rejects_at_once(sp_agentconn_t *c)
{
    struct rec r = {0};
    sp_err_t e;
    sp_code_exec_req_t both = {
        .context_id = "c1", .language = "python", .code = "1", .code_len = 1};
    CHECK(sp_code_execute(loop, c, "sb", &both, NULL, &r, &e) == NULL && e.code == SP_EINVAL);
    sp_code_exec_req_t lang = {.language = "cobol", .code = "1", .code_len = 1};
    CHECK(sp_code_execute(loop, c, "sb", &lang, NULL, &r, &e) == NULL && e.code == SP_EINVAL);
    CHECK(strstr(e.msg, SP_CODE_LANGUAGES) != NULL);
    sp_code_exec_req_t badutf = {.code = "\xff", .code_len = 1};
    CHECK(sp_code_execute(loop, c, "sb", &badutf, NULL, &r, &e) == NULL && e.code == SP_EINVAL);
    json_t *env = json_pack("{s:i}", "A", 1);
    sp_code_exec_req_t badenv = {.code = "1", .code_len = 1, .env = env};
    CHECK(sp_code_execute(loop, c, "sb", &badenv, NULL, &r, &e) == NULL && e.code == SP_EINVAL);
    json_decref(env);
    CHECK(sp_code_create(loop, c, "sb", "cobol", NULL, NULL, &r, &e) == NULL &&
          e.code == SP_EINVAL);
    CHECK(sp_code_create(loop, c, "sb", NULL, "", NULL, &r, &e) == NULL && e.code == SP_EINVAL);
    CHECK(sp_code_delete(loop, c, "sb", "", NULL, &r, &e) == NULL && e.code == SP_ENOTFOUND);
    CHECK(sp_code_restart(loop, c, "sb", NULL, NULL, &r, &e) == NULL && e.code == SP_ENOTFOUND);
    CHECK(sp_code_interrupt(loop, c, "sb", "a\nb", NULL, &r, &e) == NULL && e.code == SP_ENOTFOUND);
    CHECK(sp_code_list(loop, NULL, "sb", on_list, &r, &e) == NULL && e.code == SP_EUNAVAIL);
    run_for(50);
    CHECK(r.calls == 0);
    /* cancel before anything happened: no callback, nothing leaks */
    sp_code_op_t *op = sp_code_list(loop, c, "sb", on_list, &r, &e);
    CHECK(op != NULL);
    sp_code_cancel(op);
    run_for(100);
    CHECK(r.calls == 0);
}

static void test_code_start_coalesced_and_cancelled(sp_agentconn_t *c)
{
    unlink(starts);
    char body[600];
    /* The start fails: the waiters hear it one after the other, so the first one's callback
     * can cancel another that has not heard yet. */
    snprintf(body, sizeof(body), "echo \"$1\" >> %s\nsleep 1\necho gave up >&2\nexit 1\n", starts);
    write_script(body);
    struct rec a = {0}, b = {0}, d = {0};
    sp_err_t e;
    sp_code_op_t *oa = sp_code_list(loop, c, "sb", on_list, &a, &e);
    sp_code_op_t *ob = sp_code_list(loop, c, "sb", on_list, &b, &e);
    sp_code_op_t *od = sp_code_list(loop, c, "sb", on_list, &d, &e);
    CHECK(oa != NULL && ob != NULL && od != NULL);
    CHECK(wait_file(starts, 10000));
    run_for(100);
    sp_code_cancel(ob); /* a waiter leaves */
    /* and whichever of the other two hears first cancels the last one */
    a.cancel_in_cb = od;
    d.cancel_in_cb = oa;
    uint64_t end = sp_loop_now_ms(loop) + 20000;
    while (a.calls + d.calls == 0 && sp_loop_now_ms(loop) < end)
        sp_loop_run_once(loop, 10);
    run_for(200);
    CHECK(a.calls + d.calls == 1 && b.calls == 0);
    struct rec *first = a.calls ? &a : &d;
    CHECK(first->code == SP_EUNAVAIL && strstr(first->msg, "gave up") != NULL);
    CHECK(count_lines(starts) == 1);
    /* A start that succeeds but leaves nothing listening: each waiter connects once more. */
    unlink(starts);
    snprintf(body, sizeof(body), "echo \"$1\" >> %s\nsleep 1\n", starts);
    write_script(body);
    struct rec x = {0}, y = {0};
    CHECK(sp_code_list(loop, c, "sb", on_list, &x, &e) != NULL);
    CHECK(sp_code_list(loop, c, "sb", on_list, &y, &e) != NULL);
    CHECK(run_until(&x.calls, 20000) && run_until(&y.calls, 5000));
    CHECK(x.code == SP_EUNAVAIL && strstr(x.msg, "not answering") != NULL);
    CHECK(y.code == SP_EUNAVAIL && strstr(y.msg, "not answering") != NULL);
    CHECK(count_lines(starts) == 1);
}

static void test_code_start_missing_or_failing(sp_agentconn_t *c)
{
    unlink(script);
    struct rec a = {0};
    sp_err_t e;
    CHECK(sp_code_list(loop, c, "sb", on_list, &a, &e) != NULL);
    CHECK(run_until(&a.calls, 10000));
    CHECK(a.code == SP_ECONFLICT && strstr(a.msg, "no code interpreter") != NULL);
    write_script("echo 'no kernel for you' >&2\nexit 2\n");
    struct rec b = {0};
    CHECK(sp_code_list(loop, c, "sb", on_list, &b, &e) != NULL);
    CHECK(run_until(&b.calls, 10000));
    CHECK(b.code == SP_EUNAVAIL && strstr(b.msg, "no kernel for you") != NULL);
    CHECK(strstr(b.msg, "exit 2") != NULL);
}

static void test_code_conn_destroyed_while_starting(void)
{
    unlink(starts);
    char body[600];
    snprintf(body, sizeof(body), "echo \"$1\" >> %s\nsleep 3\n", starts);
    write_script(body);
    struct agent two = {0};
    CHECK(agent_start(loop, agent_bin, dir, &two, "two"));
    struct rec a = {0};
    sp_err_t e;
    CHECK(sp_code_list(loop, two.c, "sb", on_list, &a, &e) != NULL);
    CHECK(wait_file(starts, 10000));
    agent_stop(&two); /* the start's stream fails: the waiter hears it, the entry goes */
    run_until(&a.calls, 2000);
    CHECK(a.calls == 1 && a.code == SP_EUNAVAIL);
    /* A new connection, perhaps at the same address, must not join a stale start. */
    snprintf(body, sizeof(body), "echo \"$1\" >> %s\n", starts);
    write_script(body);
    struct agent three = {0};
    CHECK(agent_start(loop, agent_bin, dir, &three, "three"));
    struct rec b = {0};
    CHECK(sp_code_list(loop, three.c, "sb", on_list, &b, &e) != NULL);
    CHECK(run_until(&b.calls, 10000));
    CHECK(b.code == SP_EUNAVAIL && strstr(b.msg, "not answering") != NULL);
    CHECK(count_lines(starts) == 2);
    agent_stop(&three);
}

static void test_code_list_from_daemon(sp_agentconn_t *c)
{
    pid_t d = daemon_start(D_LIST);
    struct rec a = {0};
    sp_err_t e;
    CHECK(sp_code_list(loop, c, "sb", on_list, &a, &e) != NULL);
    CHECK(run_until(&a.calls, 10000));
    CHECK(a.code == SP_OK && a.n == 1);
    daemon_stop(d);
}

struct flood {
    sp_code_op_t *op;
    bool ack;
    int out, starts, ends, fails;
    size_t bytes;
};

static void on_flood(void *arg, const sp_code_ev_t *ev)
{
    struct flood *f = arg;
    switch (ev->type) {
    case SP_CODE_EV_START:
        f->starts++;
        break;
    case SP_CODE_EV_STDOUT:
        f->out++;
        f->bytes += ev->len;
        if (f->ack)
            sp_code_ack(f->op, ev->len);
        break;
    case SP_CODE_EV_END:
        f->ends++;
        break;
    case SP_CODE_EV_FAIL:
        f->fails++;
        break;
    default:
        break;
    }
}

static void test_code_output_waits_for_acks(sp_agentconn_t *c)
{
    pid_t d = daemon_start(D_FLOOD);
    struct flood f = {0};
    sp_err_t e;
    sp_code_exec_req_t rq = {.code = "flood", .code_len = 5};
    f.op = sp_code_execute(loop, c, "sb", &rq, on_flood, &f, &e);
    CHECK(f.op != NULL);
    run_for(1500);
    /* Nothing acknowledged: one agent window of lines, not the whole flood. */
    int held = f.out;
    fprintf(stderr, "code: %d of %d lines delivered unacknowledged\n", held, FLOOD_LINES);
    CHECK(f.starts == 1 && held > 50 && held <= (int)(SP_AP_INITIAL_WINDOW / FLOOD_TEXT) + 1);
    CHECK(f.ends == 0 && f.fails == 0);
    /* Acknowledge what came, then everything as it comes. */
    if (f.ends == 0 && f.fails == 0) /* else f.op is gone */
        sp_code_ack(f.op, f.bytes);
    f.ack = true;
    uint64_t end = sp_loop_now_ms(loop) + 20000;
    while (f.ends == 0 && f.fails == 0 && sp_loop_now_ms(loop) < end)
        sp_loop_run_once(loop, 10);
    CHECK(f.out == FLOOD_LINES && f.ends == 1 && f.fails == 0);
    CHECK(f.bytes == (size_t)FLOOD_LINES * FLOOD_TEXT);
    daemon_stop(d);
}

struct hold {
    sp_code_op_t *op;
    int calls;
};

static void on_hold(void *arg, const sp_code_ev_t *ev)
{
    struct hold *h = arg;
    h->calls++;
    if (ev->type == SP_CODE_EV_START) {
        sp_code_cancel(h->op);
        sp_code_cancel(h->op); /* twice is harmless */
    }
}

static void test_code_cancel_inside_callback(sp_agentconn_t *c)
{
    pid_t d = daemon_start(D_HOLD);
    struct hold h = {0};
    sp_err_t e;
    sp_code_exec_req_t rq = {.code = "x", .code_len = 1};
    h.op = sp_code_execute(loop, c, "sb", &rq, on_hold, &h, &e);
    CHECK(h.op != NULL);
    CHECK(run_until(&h.calls, 10000));
    uint64_t end = sp_loop_now_ms(loop) + 5000;
    while (!sh->closed && sp_loop_now_ms(loop) < end)
        sp_loop_run_once(loop, 10);
    CHECK(h.calls == 1); /* no output, no terminal after the cancel */
    CHECK(sh->closed);   /* the daemon saw the connection close: it interrupts */
    daemon_stop(d);
}

int main(void)
{
    test_code_language();
    agent_bin = real_agent_bin("code");
    if (agent_bin == NULL)
        return failures ? 1 : 77;
    if (!real_agent_prepare(dir))
        return 1;
    snprintf(script, sizeof(script), "%s/space-code", dir);
    snprintf(starts, sizeof(starts), "%s/starts", dir);
    port = test_free_port();
    REQUIRE(port > 0);
    char ps[16];
    snprintf(ps, sizeof(ps), "%d", port);
    setenv("SPACE_CODE_PORT", ps, 1); /* read once, at the first request */
    setenv("SPACE_CODE_DAEMON", script, 1);
    sh = mmap(NULL, sizeof(*sh), PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
    CHECK(sh != MAP_FAILED);

    loop = sp_loop_create();
    struct agent one = {0};
    CHECK(agent_start(loop, agent_bin, dir, &one, "one"));
    if (one.c != NULL && sp_agentconn_up(one.c) && sh != MAP_FAILED) {
        test_code_rejects_at_once(one.c);
        test_code_start_coalesced_and_cancelled(one.c);
        test_code_start_missing_or_failing(one.c);
        test_code_conn_destroyed_while_starting();
        test_code_list_from_daemon(one.c);
        test_code_output_waits_for_acks(one.c);
        test_code_cancel_inside_callback(one.c);
    }
    agent_stop(&one);
    run_for(50);
    sp_loop_destroy(loop);
    unlink(script);
    unlink(starts);
    rmdir(dir);
    return check_report("code");
}
