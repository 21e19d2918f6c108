/*
 * execcheck.c - what exec.h checks of a request before anything runs: a signal's name or
 * number, a guest path's bounds (declared in core/channel/exec.h).
 *
 * Pure: no agent, no loop, so the request-body parsers (and their fuzz target) use them
 * without the channel.
 */
#include <signal.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

#include "core/channel/exec.h"

static const struct {
    const char *name;
    int num;
} signames[] = {
    {"HUP", SIGHUP},       {"INT", SIGINT},   {"QUIT", SIGQUIT},   {"ILL", SIGILL},
    {"TRAP", SIGTRAP},     {"ABRT", SIGABRT}, {"BUS", SIGBUS},     {"FPE", SIGFPE},
    {"KILL", SIGKILL},     {"USR1", SIGUSR1}, {"SEGV", SIGSEGV},   {"USR2", SIGUSR2},
    {"PIPE", SIGPIPE},     {"ALRM", SIGALRM}, {"TERM", SIGTERM},   {"CHLD", SIGCHLD},
    {"CONT", SIGCONT},     {"STOP", SIGSTOP}, {"TSTP", SIGTSTP},   {"TTIN", SIGTTIN},
    {"TTOU", SIGTTOU},     {"URG", SIGURG},   {"XCPU", SIGXCPU},   {"XFSZ", SIGXFSZ},
    {"VTALRM", SIGVTALRM}, {"PROF", SIGPROF}, {"WINCH", SIGWINCH}, {"SYS", SIGSYS},
};

int sp_exec_signal_number(const char *name)
{
    if (name == NULL || name[0] == '\0')
        return -1;
    if (name[0] >= '0' && name[0] <= '9') {
        char *end;
        long v = strtol(name, &end, 10);
        return (*end == '\0' && v >= 1 && v <= 64) ? (int)v : -1;
    }
    if (strncasecmp(name, "SIG", 3) == 0)
        name += 3;
    for (size_t i = 0; i < sizeof(signames) / sizeof(signames[0]); i++)
        if (strcasecmp(name, signames[i].name) == 0)
            return signames[i].num;
    return -1;
}

int sp_exec_check_path(const char *path, sp_err_t *err)
{
    if (path == NULL || path[0] == '\0')
        return sp_err_set(err, SP_EINVAL, "path is required");
    if (strlen(path) > SP_EXEC_PATH_MAX)
        return sp_err_set(err, SP_EINVAL, "path is longer than %u bytes", SP_EXEC_PATH_MAX);
    return 0;
}
