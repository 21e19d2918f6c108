/*
 * main.c - space-agent entry: argument parsing and the poll loop.
 *
 *   space-agent --init                 PID 1 in the guest: mounts, supervises a worker
 *   space-agent --channel PATH         serve on a virtio-serial port (or any device)
 *   space-agent --listen-unix PATH     serve on a unix socket, one client at a time (tests)
 *   --log-level debug|info|warn|error
 */
#include <errno.h>
#include <inttypes.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "agent/agent.h"
#include "agent/cgroup.h"
#include "agent/chan.h"
#include "agent/egress.h"
#include "agent/ev.h"
#include "agent/growfs.h"
#include "agent/proc.h"
#include "agent/sess.h"
#include "agent/sysinit.h"
#include "base/log.h"

int sp_agent_apply_system;
const char *sp_agent_env_file;

typedef struct {
    const char *channel;
    const char *listen;
} opts_t;

/* The sooner of two poll timeouts (ms, -1 = none). */
static int min_timeout(int a, int b)
{
    if (a < 0)
        return b;
    if (b < 0)
        return a;
    return a < b ? a : b;
}

static int run_loop(void)
{
    for (;;) {
        sp_chan_tick();
        sp_egress_tick();
        sp_sess_pump_all();
        sp_proc_tick();
        sp_cgroup_tick();
        if (sp_ev_run_once(min_timeout(sp_chan_timeout_ms(), sp_egress_timeout_ms())) < 0) {
            sp_log(SP_LOG_ERROR, "agent", "poll failed errno=%d", errno);
            return 1;
        }
    }
}

static int serve(const opts_t *o)
{
    signal(SIGPIPE, SIG_IGN);
    umask(022);
    if (sp_proc_init() < 0) {
        sp_log(SP_LOG_ERROR, "agent", "sigchld setup failed errno=%d", errno);
        return 1;
    }
    sp_egress_init();
    int rc = o->listen ? sp_chan_listen_unix(o->listen) : sp_chan_open_path(o->channel);
    if (rc < 0)
        return 1;
    sp_log(SP_LOG_INFO, "agent", "space-agent %s serving on %s", SP_AGENT_VERSION,
           o->listen ? o->listen : o->channel);
    return run_loop();
}

/* Worker under PID 1: waits for the port to appear, then serves it. */
static int init_worker(void *arg)
{
    static char port[256];
    opts_t o = {.channel = port};
    for (int i = 0; sp_sysinit_find_port(SP_AGENT_PORT_NAME, port, sizeof(port)) < 0; i++) {
        if (i == 50)
            sp_sysinit_console("space-agent: waiting for virtio port " SP_AGENT_PORT_NAME);
        usleep(100000);
    }
    sp_sysinit_console("space-agent " SP_AGENT_VERSION " ready");
    return serve(&o);
}

static int usage(void)
{
    fprintf(stderr, "usage: space-agent --init | --channel PATH | --listen-unix PATH "
                    "[--log-level LEVEL] [--env-file PATH] | --grow-root | --version\n");
    return 2;
}

int main(int argc, char **argv)
{
    opts_t o = {0};
    int init = 0;
    for (int i = 1; i < argc; i++) {
        if (strcmp(argv[i], "--init") == 0) {
            init = 1;
        } else if (strcmp(argv[i], "--channel") == 0 && i + 1 < argc) {
            o.channel = argv[++i];
        } else if (strcmp(argv[i], "--listen-unix") == 0 && i + 1 < argc) {
            o.listen = argv[++i];
        } else if (strcmp(argv[i], "--env-file") == 0 && i + 1 < argc) {
            sp_agent_env_file = argv[++i];
        } else if (strcmp(argv[i], "--log-level") == 0 && i + 1 < argc) {
            if (sp_log_parse_level(argv[++i], &sp_log_min_level) < 0)
                return usage();
        } else if (strcmp(argv[i], "--version") == 0) {
            printf("space-agent %s\n", SP_AGENT_VERSION);
            return 0;
        } else if (strcmp(argv[i], "--grow-root") == 0 && argc == 2) {
            uint64_t from = 0, to = 0;
            sp_err_t e;
            if (sp_agent_grow_fs("/", &from, &to, &e) < 0) {
                fprintf(stderr, "space-agent: %s\n", e.msg);
                return 1;
            }
            printf("root filesystem: %" PRIu64 " -> %" PRIu64 " blocks\n", from, to);
            return 0;
        } else {
            return usage();
        }
    }
    if (init + (o.channel != NULL) + (o.listen != NULL) != 1)
        return usage();
    /* Only in the guest may identity change hostname, clock and the RNG. */
    sp_agent_apply_system = o.listen == NULL;
    if (sp_agent_env_file == NULL && sp_agent_apply_system)
        sp_agent_env_file = SP_AGENT_ENV_FILE;
    if (init) {
        sp_sysinit_mounts();
        sp_cgroup_setup();
        if (getpid() == 1)
            sp_sysinit_supervise(init_worker, NULL);
        return init_worker(NULL); /* --init outside PID 1: debugging */
    }
    return serve(&o);
}
