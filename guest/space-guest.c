/*
 * space-guest.c - developer front end to the guest pipeline: build a
 * template, show where the current build is, print the QEMU line.
 *
 *   space-guest build <name> --data-dir D [--agent BIN] [--templates-dir D]
 *                            [--kernel-version V] [--force] [--quiet]
 *   space-guest current <name> --data-dir D        paths of the current build
 *   space-guest list                               templates compiled in
 *   space-guest qemu-args --kernel K --initrd I --disk D --agent-sock S
 *                 [--qmp-sock Q] [--console FILE] [--memory-mb N] [--cpus N] [--kvm]
 *                                                  argv, one per line
 *   space-guest tsc-khz
 *   space-guest wait-ready <agent-sock> <timeout-ms>
 *                  connects (retrying until the socket exists), waits for a
 *                  line "ready"; prints the ms waited; exit 1 on timeout/EOF
 *
 * spaced calls sp_tmplbuild_run() itself; this exists for tests and humans.
 */
#include <errno.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <time.h>
#include <unistd.h>

#include "guest/bootargs.h"
#include "guest/tmplbuild.h"

static const char *opt(int argc, char **argv, const char *name)
{
    for (int i = 2; i + 1 < argc; i++)
        if (strcmp(argv[i], name) == 0)
            return argv[i + 1];
    return NULL;
}

static int flag(int argc, char **argv, const char *name)
{
    for (int i = 2; i < argc; i++)
        if (strcmp(argv[i], name) == 0)
            return 1;
    return 0;
}

static double now_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec * 1e3 + (double)ts.tv_nsec / 1e6;
}

/* The boot test's probe: the placeholder agent writes "ready\n" lines to
 * the port; QEMU drops what the guest writes while no client is connected,
 * which is why the placeholder repeats itself. */
static int wait_ready(const char *path, int timeout_ms)
{
    double t0 = now_ms();
    struct sockaddr_un sa = {.sun_family = AF_UNIX};
    if (strlen(path) >= sizeof sa.sun_path) {
        fprintf(stderr, "space-guest: socket path too long\n");
        return 2;
    }
    strcpy(sa.sun_path, path);
    int fd = -1;
    while (now_ms() - t0 < timeout_ms) {
        fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
        if (fd >= 0 && connect(fd, (struct sockaddr *)&sa, sizeof sa) == 0)
            break;
        if (fd >= 0)
            close(fd);
        fd = -1;
        usleep(10000);
    }
    if (fd < 0) {
        fprintf(stderr, "space-guest: cannot connect to %s\n", path);
        return 1;
    }
    char line[256];
    size_t n = 0;
    for (;;) {
        int left = timeout_ms - (int)(now_ms() - t0);
        struct pollfd p = {.fd = fd, .events = POLLIN};
        if (left <= 0 || poll(&p, 1, left) <= 0) {
            fprintf(stderr, "space-guest: no ready line within %d ms\n", timeout_ms);
            break;
        }
        char c;
        ssize_t r = read(fd, &c, 1);
        if (r <= 0) {
            if (r < 0 && errno == EINTR)
                continue;
            fprintf(stderr, "space-guest: agent socket closed\n");
            break;
        }
        if (c == '\n') {
            line[n] = '\0';
            if (strcmp(line, "ready") == 0) {
                printf("%.0f\n", now_ms() - t0);
                close(fd);
                return 0;
            }
            n = 0;
        } else if (n + 1 < sizeof line) {
            line[n++] = c;
        }
    }
    close(fd);
    return 1;
}

static int usage(void)
{
    fprintf(stderr, "usage: space-guest build|current|list|qemu-args|tsc-khz|wait-ready ... "
                    "(see guest/space-guest.c)\n");
    return 2;
}

static void print_paths(const sp_tmplbuild_paths_t *p)
{
    printf("hash=%s\nkernel_version=%s\nkernel=%s\ninitramfs=%s\nrootfs=%s\nmanifest=%s\n"
           "cpu_count=%d\nmemory_mb=%d\ndisk_mb=%d\n",
           p->hash, p->kernel_version, p->kernel, p->initramfs, p->rootfs, p->manifest,
           p->cpu_count, p->memory_mb, p->disk_mb);
}

int main(int argc, char **argv)
{
    if (argc < 2)
        return usage();
    const char *cmd = argv[1];
    sp_err_t err = {0};
    sp_tmplbuild_paths_t p;

    if (strcmp(cmd, "build") == 0 || strcmp(cmd, "current") == 0) {
        if (argc < 3 || argv[2][0] == '-' || opt(argc, argv, "--data-dir") == NULL)
            return usage();
        int rc;
        if (cmd[0] == 'b') {
            const char *agent = opt(argc, argv, "--agent");
#ifdef SP_GUEST_DEFAULT_AGENT
            if (agent == NULL)
                agent = SP_GUEST_DEFAULT_AGENT; /* the tree's own agent build */
#endif
            sp_tmplbuild_opts_t o = {
                .name = argv[2],
                .templates_dir = opt(argc, argv, "--templates-dir"),
                .data_dir = opt(argc, argv, "--data-dir"),
                .agent_path = agent,
                .kernel_version = opt(argc, argv, "--kernel-version"),
                .force = flag(argc, argv, "--force"),
                .progress = !flag(argc, argv, "--quiet"),
            };
            rc = sp_tmplbuild_run(&o, &p, &err);
        } else {
            rc = sp_tmplbuild_current(opt(argc, argv, "--data-dir"), argv[2], &p, &err);
        }
        if (rc < 0) {
            fprintf(stderr, "space-guest: %s\n", err.msg);
            return 1;
        }
        print_paths(&p);
        return 0;
    }
    if (strcmp(cmd, "list") == 0) {
        for (const char *const *n = sp_tmplbuild_builtin_names(); *n != NULL; n++)
            printf("%s\n", *n);
        return 0;
    }
    if (strcmp(cmd, "qemu-args") == 0) {
        const char *mem = opt(argc, argv, "--memory-mb"), *cpus = opt(argc, argv, "--cpus");
        sp_bootargs_qemu_t q = {
            .qemu = opt(argc, argv, "--qemu"),
            .kernel = opt(argc, argv, "--kernel"),
            .initramfs = opt(argc, argv, "--initrd"),
            .disk = opt(argc, argv, "--disk"),
            .agent_sock = opt(argc, argv, "--agent-sock"),
            .qmp_sock = opt(argc, argv, "--qmp-sock"),
            .console_log = opt(argc, argv, "--console"),
            .memory_mb = mem != NULL ? atoi(mem) : 0,
            .cpu_count = cpus != NULL ? atoi(cpus) : 0,
            .kvm = flag(argc, argv, "--kvm"),
            .cmdline_extra = opt(argc, argv, "--append"),
        };
        char **av = sp_bootargs_qemu_argv(&q);
        if (av == NULL) {
            fprintf(stderr, "space-guest: qemu-args needs --kernel --initrd --disk --agent-sock\n");
            return 2;
        }
        for (char **a = av; *a != NULL; a++)
            printf("%s\n", *a);
        free(av);
        return 0;
    }
    if (strcmp(cmd, "wait-ready") == 0 && argc == 4)
        return wait_ready(argv[2], atoi(argv[3]));
    if (strcmp(cmd, "tsc-khz") == 0) {
        printf("%u\n", sp_bootargs_tsc_khz());
        return 0;
    }
    return usage();
}
