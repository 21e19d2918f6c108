/*
 * real_agent.h - a real space-agent on this host, for core/channel's tests that need one:
 * started with --listen-unix in the test's directory and reached with sp_agentconn. Included
 * once per test program.
 *
 * The agent runs on the host, as root (it switches users), so files and ports it touches are
 * this host's: tests use their own temporary directory.
 */
#ifndef SP_TEST_REAL_AGENT_H
#define SP_TEST_REAL_AGENT_H

#include <signal.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "base/log.h"
#include "core/channel/agentconn.h"

struct agent {
    pid_t pid;
    char sock[300];
    sp_agentconn_t *c;
};

/* $SPACE_AGENT_BIN when this host can run it (as root); else NULL after saying why. */
static inline const char *real_agent_bin(const char *test)
{
    const char *bin = getenv("SPACE_AGENT_BIN");
    if (bin == NULL || *bin == 0 || access(bin, X_OK) != 0) {
        printf("%s: skipped the agent cases (set SPACE_AGENT_BIN to a space-agent binary)\n",
               test);
        return NULL;
    }
    if (geteuid() != 0) {
        printf("%s: skipped the agent cases (space-agent needs root)\n", test);
        return NULL;
    }
    return bin;
}

/* What an agent test does before its cases: the log level from SP_TEST_LOG (default error),
 * SIGPIPE ignored, and dir (a mkdtemp template) made, readable by the users the agent switches
 * to. false when dir could not be made. */
static inline bool real_agent_prepare(char *dir)
{
    const char *lvl = getenv("SP_TEST_LOG");
    if (lvl == NULL || sp_log_parse_level(lvl, &sp_log_min_level) < 0)
        sp_log_min_level = SP_LOG_ERROR;
    signal(SIGPIPE, SIG_IGN);
    if (mkdtemp(dir) == NULL) {
        perror("mkdtemp");
        return false;
    }
    chmod(dir, 0755);
    return true;
}

static void real_agent_state(void *arg, bool up)
{
}

/* Starts bin listening on dir/<name>.sock and connects; true once the channel is up (10 s). */
static inline bool agent_start(sp_loop_t *loop, const char *bin, const char *dir, struct agent *a,
                               const char *name)
{
    snprintf(a->sock, sizeof(a->sock), "%s/%s.sock", dir, name);
    a->c = sp_agentconn_create(loop, a->sock, real_agent_state, NULL);
    a->pid = fork();
    if (a->pid == 0) {
        prctl(PR_SET_PDEATHSIG, SIGKILL); /* never outlives a test that crashed */
        execl(bin, bin, "--listen-unix", a->sock, "--log-level", "error", (char *)NULL);
        _exit(127);
    }
    uint64_t end = sp_loop_now_ms(loop) + 10000;
    while (a->c != NULL && !sp_agentconn_up(a->c) && sp_loop_now_ms(loop) < end)
        sp_loop_run_once(loop, 10);
    return a->c != NULL && sp_agentconn_up(a->c);
}

static inline void agent_stop(struct agent *a)
{
    sp_agentconn_destroy(a->c);
    a->c = NULL;
    if (a->pid > 0) {
        kill(a->pid, SIGKILL);
        waitpid(a->pid, NULL, 0);
    }
    unlink(a->sock);
}

#endif
