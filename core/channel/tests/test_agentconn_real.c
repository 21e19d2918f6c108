/*
 * test_agentconn_real.c - the host end of the agent channel against a real space-agent.
 *
 * Starts $SPACE_AGENT_BIN (or $SP_AGENT_BIN) --listen-unix in a temp dir and
 * runs commands through sp_agentconn: output, exit codes, stdin. Skips (77)
 * when no binary is given, and when not root (the agent switches users).
 */
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "core/channel/agentconn.h"
#include "base/log.h"
#include "tests/check.h"

static sp_loop_t *loop;

struct proc {
    bool started;
    char out[256];
    size_t outlen;
    bool exited;
    int32_t exit_code;
    int errors;
};

static void on_frame(sp_agentstream_t *s, uint16_t type, uint16_t flags, const uint8_t *p,
                     size_t len, void *arg)
{
    struct proc *pr = arg;
    switch (type) {
    case SP_AP_T_PROC_STARTED:
        pr->started = true;
        break;
    case SP_AP_T_PROC_STDOUT: {
        size_t n = len < sizeof(pr->out) - 1 - pr->outlen ? len : sizeof(pr->out) - 1 - pr->outlen;
        memcpy(pr->out + pr->outlen, p, n);
        pr->outlen += n;
        pr->out[pr->outlen] = 0;
        sp_agentstream_grant(s, (uint32_t)len);
        break;
    }
    case SP_AP_T_PROC_EXIT:
        pr->exited = true;
        pr->exit_code = -1;
        sp_ap_get_i32(p, len, SP_AP_K_EXIT_CODE, &pr->exit_code);
        break;
    case SP_AP_T_ERROR:
        pr->errors++;
        break;
    default:
        break;
    }
    if ((flags & SP_AP_F_END) && type != SP_AP_T_PROC_EXIT && type != SP_AP_T_ERROR)
        pr->errors++;
}

static void on_error(sp_agentstream_t *s, const sp_err_t *err, void *arg)
{
    struct proc *pr = arg;
    pr->errors++;
}

static const sp_agentstream_cbs_t cbs = {on_frame, on_error, NULL};

static void on_state(void *arg, bool up)
{
}

static bool wait_for(bool *flag, int *errs, int timeout_ms)
{
    uint64_t end = sp_loop_now_ms(loop) + (uint64_t)timeout_ms;
    while (!*flag && (errs == NULL || *errs == 0) && sp_loop_now_ms(loop) < end)
        sp_loop_run_once(loop, 20);
    return *flag;
}

static sp_agentstream_t *start(sp_agentconn_t *c, const char *cmd, bool with_stdin, struct proc *pr)
{
    uint8_t buf[256];
    sp_ap_writer_t w;
    sp_ap_writer_init(&w, buf, sizeof(buf));
    sp_ap_put_str(&w, SP_AP_K_CMD, cmd);
    sp_ap_put_u32(&w, SP_AP_K_STDIN, with_stdin ? 1 : 0);
    sp_err_t err;
    sp_agentstream_t *s = sp_agentconn_open(c, SP_AP_T_PROC_START, buf, w.len, &cbs, pr, &err);
    CHECK(s != NULL);
    return s;
}

static void test_agentconn_real_echo(sp_agentconn_t *c)
{
    struct proc pr = {0};
    start(c, "echo hi", false, &pr);
    CHECK(wait_for(&pr.exited, &pr.errors, 5000));
    CHECK(pr.started && pr.errors == 0);
    CHECK(strcmp(pr.out, "hi\n") == 0);
    CHECK(pr.exit_code == 0);
}

static void test_agentconn_real_exit_code(sp_agentconn_t *c)
{
    struct proc pr = {0};
    start(c, "echo out; exit 3", false, &pr);
    CHECK(wait_for(&pr.exited, &pr.errors, 5000));
    CHECK(strcmp(pr.out, "out\n") == 0 && pr.exit_code == 3);
}

static void test_agentconn_real_stdin(sp_agentconn_t *c)
{
    struct proc pr = {0};
    sp_agentstream_t *s = start(c, "cat", true, &pr);
    CHECK(sp_agentstream_send(s, SP_AP_T_DATA, (const uint8_t *)"ping\n", 5) == 1);
    CHECK(sp_agentstream_send(s, SP_AP_T_EOF, NULL, 0) == 1);
    CHECK(wait_for(&pr.exited, &pr.errors, 5000));
    CHECK(strcmp(pr.out, "ping\n") == 0 && pr.exit_code == 0);
}

int main(void)
{
    const char *bin = getenv("SPACE_AGENT_BIN");
    if (bin == NULL || *bin == 0)
        bin = getenv("SP_AGENT_BIN");
    if (bin == NULL || *bin == 0 || access(bin, X_OK) != 0) {
        printf("agentconn_real: skipped (set SPACE_AGENT_BIN to a space-agent binary)\n");
        return 77;
    }
    if (geteuid() != 0) {
        printf("agentconn_real: skipped (space-agent needs root)\n");
        return 77;
    }
    const char *lvl = getenv("SP_TEST_LOG");
    if (lvl == NULL || sp_log_parse_level(lvl, &sp_log_min_level) < 0)
        sp_log_min_level = SP_LOG_WARN;
    char dir[] = "/tmp/sp-agentconn-real.XXXXXX";
    if (mkdtemp(dir) == NULL) {
        perror("mkdtemp");
        return 1;
    }
    char sock[128];
    snprintf(sock, sizeof(sock), "%s/agent.sock", dir);

    loop = sp_loop_create();
    /* Connect first: the client retries until the agent listens. */
    sp_agentconn_t *c = sp_agentconn_create(loop, sock, on_state, NULL);
    CHECK(c != NULL);
    pid_t pid = fork();
    if (pid == 0) {
        execl(bin, bin, "--listen-unix", sock, "--log-level", "warn", (char *)NULL);
        _exit(127);
    }
    CHECK(pid > 0);
    uint64_t end = sp_loop_now_ms(loop) + 10000;
    while (c != NULL && !sp_agentconn_up(c) && sp_loop_now_ms(loop) < end)
        sp_loop_run_once(loop, 20);
    CHECK(c != NULL && sp_agentconn_up(c));
    if (c != NULL && sp_agentconn_up(c)) {
        CHECK(strlen(sp_agentconn_agent_version(c)) > 0);
        test_agentconn_real_echo(c);
        test_agentconn_real_exit_code(c);
        test_agentconn_real_stdin(c);
    }
    sp_agentconn_destroy(c);
    if (pid > 0) {
        kill(pid, SIGTERM);
        waitpid(pid, NULL, 0);
    }
    unlink(sock);
    rmdir(dir);
    return check_report("agentconn_real");
}
