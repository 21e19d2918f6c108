/*
 * sysinit.c - PID 1 duties and IDENTITY.
 *
 * PID 1 must never exit (the kernel panics), so it only mounts, supervises
 * and reaps; the agent proper runs in a forked worker that is respawned if
 * it crashes. Identity changes system state (hostname, clock, RNG) and is
 * applied only when sp_agent_apply_system is set, so host-side tests cannot
 * change the machine they run on.
 */
#include "agent/sysinit.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/mount.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "agent/agent.h"
#include "agent/chan.h"
#include "agent/sess.h"
#include "base/log.h"

/* From linux/random.h, which musl's toolchain does not ship. The ABI is stable. */
#ifndef RNDADDENTROPY
#define RNDADDENTROPY _IOW('R', 0x03, int[2])
#endif
#ifndef RNDRESEEDCRNG
#define RNDRESEEDCRNG _IO('R', 0x07)
#endif

static void mount_if_missing(const char *src, const char *dir, const char *type,
                             unsigned long flags, const char *opts)
{
    mkdir(dir, 0755);
    struct stat a, b;
    char parent[256];
    snprintf(parent, sizeof(parent), "%s/..", dir);
    /* A mount point sits on a different device than its parent. */
    if (stat(dir, &a) == 0 && stat(parent, &b) == 0 && a.st_dev != b.st_dev)
        return;
    if (mount(src, dir, type, flags, opts) < 0)
        sp_log(SP_LOG_WARN, "init", "mount failed dir=%s errno=%d", dir, errno);
}

void sp_sysinit_mounts(void)
{
    mount_if_missing("devpts", "/dev/pts", "devpts", MS_NOSUID | MS_NOEXEC,
                     "gid=5,mode=620,ptmxmode=666");
    mount_if_missing("tmpfs", "/dev/shm", "tmpfs", MS_NOSUID | MS_NODEV, "mode=1777");
    mount_if_missing("tmpfs", "/run", "tmpfs", MS_NOSUID | MS_NODEV, "mode=755");
    mount_if_missing("tmpfs", "/tmp", "tmpfs", MS_NOSUID | MS_NODEV, "mode=1777");
    /* Without a ptmx node in devtmpfs, posix_openpt needs the devpts one. */
    if (access("/dev/ptmx", F_OK) < 0)
        symlink("pts/ptmx", "/dev/ptmx");
    char host[64];
    if (gethostname(host, sizeof(host)) < 0 || host[0] == 0 || strcmp(host, "(none)") == 0)
        sethostname("sandbox", 7);
}

int sp_sysinit_find_port(const char *name, char *out, size_t cap)
{
    DIR *d = opendir("/sys/class/virtio-ports");
    if (d == NULL)
        return -1;
    struct dirent *de;
    int rc = -1;
    while (rc < 0 && (de = readdir(d)) != NULL) {
        if (de->d_name[0] == '.')
            continue;
        char path[512], got[128] = "";
        snprintf(path, sizeof(path), "/sys/class/virtio-ports/%s/name", de->d_name);
        FILE *f = fopen(path, "re");
        if (f == NULL)
            continue;
        if (fgets(got, sizeof(got), f) != NULL) {
            got[strcspn(got, "\n")] = 0;
            if (strcmp(got, name) == 0) {
                snprintf(out, cap, "/dev/%s", de->d_name);
                rc = 0;
            }
        }
        fclose(f);
    }
    closedir(d);
    return rc;
}

void sp_sysinit_console(const char *line)
{
    int fd = open("/dev/console", O_WRONLY | O_NOCTTY | O_CLOEXEC);
    if (fd < 0)
        return;
    (void)!write(fd, line, strlen(line));
    (void)!write(fd, "\n", 1);
    close(fd);
}

void sp_sysinit_supervise(int (*worker)(void *), void *arg)
{
    pid_t child = -1;
    for (;;) {
        if (child < 0) {
            child = fork();
            if (child == 0)
                _exit(worker(arg) == 0 ? 0 : 1);
            if (child < 0) {
                sleep(1);
                continue;
            }
        }
        int status;
        pid_t pid = wait(&status);
        if (pid < 0 && errno == ECHILD) {
            child = -1;
        } else if (pid == child) {
            sp_log(SP_LOG_ERROR, "init", "agent worker died status=%d, respawning", status);
            sp_sysinit_console("space-agent: worker died, respawning");
            child = -1;
            sleep(1); /* a worker that dies at once must not spin the CPU */
        }
        /* Any other pid was an orphan: reaping it was the point. */
    }
}

/* ---- identity ---- */

static void set_default_env(const sp_ap_identity_t *m)
{
    for (int i = 0; i < sp_sess_default_envc; i++)
        free(sp_sess_default_env[i]);
    free(sp_sess_default_env);
    sp_sess_default_env = NULL;
    sp_sess_default_envc = 0;
    if (m->envc == 0)
        return;
    sp_sess_default_env = calloc(m->envc, sizeof(char *));
    for (uint32_t i = 0; sp_sess_default_env != NULL && i < m->envc; i++) {
        char *s = malloc((size_t)m->env[i].n + 1);
        if (s == NULL)
            break;
        memcpy(s, m->env[i].p, m->env[i].n);
        s[m->env[i].n] = 0;
        sp_sess_default_env[sp_sess_default_envc++] = s;
    }
}

/* Writes the default env to sp_agent_env_file (see agent.h). Best effort: a failure is
 * logged, and processes started later still get the env from the agent. */
static void write_env_file(void)
{
    const char *path = sp_agent_env_file;
    if (path == NULL)
        return;
    char dir[256], tmp[300];
    snprintf(dir, sizeof(dir), "%s", path);
    char *slash = strrchr(dir, '/');
    if (slash != NULL && slash != dir) {
        *slash = '\0';
        mkdir(dir, 0755);
    }
    snprintf(tmp, sizeof(tmp), "%s.new", path);
    int fd = open(tmp, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC | O_NOFOLLOW, 0600);
    bool ok = fd >= 0;
    for (int i = 0; ok && i < sp_sess_default_envc; i++) {
        const char *kv = sp_sess_default_env[i];
        size_t n = strlen(kv) + 1; /* with its NUL, the separator */
        ok = write(fd, kv, n) == (ssize_t)n;
    }
    if (fd >= 0 && close(fd) < 0)
        ok = false;
    if (!ok || rename(tmp, path) < 0) {
        sp_log(SP_LOG_WARN, "init", "writing the env file failed path=%s errno=%d", path, errno);
        unlink(tmp);
    }
}

/* Credits the seed to the kernel pool and forces a CRNG reseed; clones of one
 * snapshot otherwise share their RNG state. Returns 0 or an errno. */
static int mix_seed(const sp_ap_str_t *seed)
{
    int fd = open("/dev/urandom", O_WRONLY | O_CLOEXEC);
    if (fd < 0)
        return errno;
    int e = 0;
    struct {
        int entropy_count; /* bits credited */
        int buf_size;      /* bytes */
        uint8_t buf[512];
    } req;
    size_t n = seed->n < sizeof(req.buf) ? seed->n : sizeof(req.buf);
    req.entropy_count = (int)(n * 8);
    req.buf_size = (int)n;
    memcpy(req.buf, seed->p, n);
    if (!sp_agent_apply_system || ioctl(fd, RNDADDENTROPY, &req) < 0) {
        /* Not root or no ioctl: mixing without credit is still worth it. */
        if (write(fd, seed->p, n) < 0)
            e = errno;
    }
#ifdef RNDRESEEDCRNG
    if (sp_agent_apply_system)
        ioctl(fd, RNDRESEEDCRNG);
#endif
    close(fd);
    return e;
}

static int apply_system(const sp_ap_identity_t *m)
{
    if (m->hostname.p != NULL && m->hostname.n > 0 && sethostname(m->hostname.p, m->hostname.n) < 0)
        return errno;
    if (m->time_ns != 0) {
        struct timespec ts = {.tv_sec = (time_t)(m->time_ns / 1000000000u),
                              .tv_nsec = (long)(m->time_ns % 1000000000u)};
        if (clock_settime(CLOCK_REALTIME, &ts) < 0)
            return errno;
    }
    return 0;
}

void sp_sysinit_on_identity(uint32_t id, const uint8_t *p, uint32_t n)
{
    static sp_ap_identity_t m; /* 4 KiB: keep it off the stack */
    sp_err_t err;
    if (sp_ap_dec_identity(p, n, &m, &err) < 0) {
        sp_sess_error(id, SP_AP_E_INVAL, 0, "%s", err.msg);
        return;
    }
    if (m.hostname.n > 64) {
        sp_sess_error(id, SP_AP_E_INVAL, 0, "hostname too long");
        return;
    }
    set_default_env(&m);
    write_env_file();
    int e = 0;
    if (m.seed.p != NULL && m.seed.n > 0)
        e = mix_seed(&m.seed);
    if (e == 0 && sp_agent_apply_system)
        e = apply_system(&m);
    if (e != 0) {
        sp_sess_error_errno(id, e, "identity");
        return;
    }
    sp_log(SP_LOG_INFO, "init", "identity applied sandbox=%.*s system=%d", (int)m.sandbox_id.n,
           m.sandbox_id.p ? m.sandbox_id.p : "", sp_agent_apply_system);
    sp_sess_send_empty(id, SP_AP_T_OK, SP_AP_F_END);
}
