/*
 * cgroup.c - the guest's workload cgroup (see cgroup.h).
 *
 * The agent and PID 1 stay in the root group. A group of its own for the
 * workload is what keeps them reachable: its memory limit keeps the OOM
 * killer inside the workload (kernel stacks and page tables of a fork bomb
 * are charged there too), its task limit makes fork() fail instead of the
 * guest drowning in processes. The CPU is the agent's at a real-time
 * priority whenever it has work, however many of the workload's tasks are
 * runnable.
 */
#include "agent/cgroup.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <sched.h>
#include <signal.h>
#include <stdio.h>
#include <string.h>
#include <sys/mount.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/vfs.h>
#include <time.h>
#include <unistd.h>

#include "base/log.h"

#ifndef CGROUP2_SUPER_MAGIC
#define CGROUP2_SUPER_MAGIC 0x63677270
#endif

#define MIB (1024ull * 1024ull)

/* Whether sp_cgroup_setup made the group (PID 1 sets it before forking the worker). */
static int work_ready;
/* The limits (0 when unknown), and the number of the last command group made. */
static sp_cgroup_limits_t limits;
static uint32_t last_cmd;
/* Groups of finished commands: empty ones kept for the next commands (making and removing
 * a group costs milliseconds under TCG, more than the rest of starting a command), and
 * those a command's processes outlived, removed once empty (sp_cgroup_sweep). */
#define IDLE_MAX 8
#define LINGER_MAX 256
static uint32_t idle[IDLE_MAX], linger[LINGER_MAX];
static size_t n_idle, n_linger;
static int scanned; /* whether this worker has taken in the groups of the one before */

sp_cgroup_limits_t sp_cgroup_limits(uint64_t mem_total, uint64_t mem_avail)
{
    sp_cgroup_limits_t l;
    /* Per command, not only for the workload as a whole: a command at its limit then reclaims
     * from itself and meets the OOM killer alone, while the others (and a new command's
     * exec) take what is still free, instead of all of them reclaiming from one group.
     * The limit is what was free at boot less a headroom (the agent's buffers, the
     * kernel's unaccounted allocations, the page cache a new exec needs): a limit above
     * what is free is never reached, and the guest-wide OOM killer then comes first,
     * after a reclaim that stalls every process in the guest, the agent included (seen
     * at 2 s per kill under TCG). The headroom also holds what a fork bomb costs the
     * kernel outside any group (its tasks' structures): 16 MiB was not enough. */
    uint64_t headroom = mem_total / 16;
    if (headroom < 32 * MIB)
        headroom = 32 * MIB;
    if (mem_avail > mem_total)
        mem_avail = mem_total;
    l.cmd_memory_max = mem_avail > headroom ? mem_avail - headroom : 0;
    /* A guest that booted nearly full still lets a command have half of it. */
    if (l.cmd_memory_max < mem_total / 2)
        l.cmd_memory_max = mem_total / 2;
    /* All commands together: two commands, each within its limit, may together want more
     * than is free; the workload's own limit, half a headroom above one command's, has them
     * meet the OOM killer inside the workload (which kills the largest of its tasks) rather
     * than the guest-wide one after its reclaim of the whole guest. One command alone still
     * meets its own limit first while the others hold less than half the headroom. */
    l.memory_max = mem_avail > headroom / 2 ? mem_avail - headroom / 2 : 0;
    if (l.memory_max < l.cmd_memory_max)
        l.memory_max = l.cmd_memory_max;
    /* Four tasks per MiB: 2,048 at 512 MiB, about half of what the kernel's own
     * threads-max allows there; at least 1,024 for the smallest guests. One command may
     * take seven eighths of them: the rest stay for the others. */
    l.pids_max = mem_total / MIB * 4;
    if (l.pids_max < 1024)
        l.pids_max = 1024;
    l.cmd_pids_max = l.pids_max - l.pids_max / 8;
    return l;
}

static int write_file(const char *path, const char *val)
{
    int fd = open(path, O_WRONLY | O_CLOEXEC);
    if (fd < 0)
        return -1;
    ssize_t n = write(fd, val, strlen(val));
    int e = errno;
    close(fd);
    errno = e;
    return n == (ssize_t)strlen(val) ? 0 : -1;
}

/* The start of a small kernel file (one read), NUL-terminated in buf; -1 when it cannot be
 * read or is empty. */
static int read_small(const char *path, char *buf, size_t cap)
{
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0)
        return -1;
    ssize_t n = read(fd, buf, cap - 1);
    close(fd);
    if (n <= 0)
        return -1;
    buf[n] = 0;
    return 0;
}

/* A /proc/meminfo field in bytes, 0 when missing. */
static uint64_t meminfo(const char *field)
{
    FILE *f = fopen("/proc/meminfo", "re");
    if (f == NULL)
        return 0;
    char line[128];
    size_t n = strlen(field);
    unsigned long long kb = 0;
    while (fgets(line, sizeof(line), f) != NULL)
        if (strncmp(line, field, n) == 0 && line[n] == ':' &&
            sscanf(line + n + 1, "%llu", &kb) == 1)
            break;
    fclose(f);
    return (uint64_t)kb * 1024;
}

int sp_cgroup_setup(void)
{
    struct statfs fs;
    if (statfs(SP_CGROUP_ROOT, &fs) < 0 || fs.f_type != CGROUP2_SUPER_MAGIC) {
        const unsigned long flags = MS_NOSUID | MS_NODEV | MS_NOEXEC;
        if (mount("cgroup2", SP_CGROUP_ROOT, "cgroup2", flags, NULL) < 0) {
            sp_log(SP_LOG_WARN, "cgroup", "no cgroup2: commands run unconfined errno=%d", errno);
            return -1;
        }
    }
    /* One controller at a time: a kernel without one still gets the others. cpu shares the
     * CPU between commands, each group at the same weight, rather than between processes: a
     * command that forks without end gets one command's share, not nearly all of it. Under
     * TCG a command run during a 10 s fork bomb in another answered in 33-53 ms (median)
     * with it, 438-659 ms without; with no bomb, execs and a Python loop took the same time
     * within the noise (the guest's norandmaps made the exec path cheap; before it, group
     * scheduling measured slower). What it costs on the host's side: one session's A/B pairs
     * had a 256 MiB clone's suspend 10-14% and a running snapshot's pause 4-17% longer; a
     * later session's, against a build that turned cpu on only under load, had the suspend
     * 9-12% shorter with it always on (110/108 against 121/122 ms): noise, either way. The
     * agent stays in the root group, at its real-time priority under load (sp_cgroup_tick). */
    static const char *const ctl[] = {"+memory", "+pids", "+cpu"};
    for (size_t i = 0; i < sizeof(ctl) / sizeof(ctl[0]); i++)
        if (write_file(SP_CGROUP_ROOT "/cgroup.subtree_control", ctl[i]) < 0)
            sp_log(SP_LOG_WARN, "cgroup", "controller %s unavailable errno=%d", ctl[i] + 1, errno);
    if (mkdir(SP_CGROUP_WORK, 0755) < 0 && errno != EEXIST) {
        sp_log(SP_LOG_WARN, "cgroup", "mkdir %s failed errno=%d", SP_CGROUP_WORK, errno);
        return -1;
    }
    uint64_t total = meminfo("MemTotal"), avail = meminfo("MemAvailable");
    if (total == 0 || avail == 0) {
        sp_log(SP_LOG_WARN, "cgroup", "no MemTotal or MemAvailable: commands have no limits");
    } else {
        sp_cgroup_limits_t l = sp_cgroup_limits(total, avail);
        char v[32];
        snprintf(v, sizeof(v), "%llu", (unsigned long long)l.pids_max);
        if (write_file(SP_CGROUP_WORK "/pids.max", v) < 0)
            sp_log(SP_LOG_WARN, "cgroup", "pids.max failed errno=%d", errno);
        snprintf(v, sizeof(v), "%llu", (unsigned long long)l.memory_max);
        if (write_file(SP_CGROUP_WORK "/memory.max", v) < 0)
            sp_log(SP_LOG_WARN, "cgroup", "memory.max failed errno=%d", errno);
        sp_log(SP_LOG_INFO, "cgroup",
               "workload memory_max=%llu pids_max=%llu, per command memory_max=%llu "
               "pids_max=%llu",
               (unsigned long long)l.memory_max, (unsigned long long)l.pids_max,
               (unsigned long long)l.cmd_memory_max, (unsigned long long)l.cmd_pids_max);
        limits = l;
    }
    /* Commands' groups go below: the controllers must reach them too. */
    for (size_t i = 0; i < sizeof(ctl) / sizeof(ctl[0]); i++)
        (void)write_file(SP_CGROUP_WORK "/cgroup.subtree_control", ctl[i]);
    /* PID 1 is never the OOM killer's; the worker it forks, which is the agent, inherits
     * this and must not be either. Commands take the default back (sp_cgroup_fork). */
    if (write_file("/proc/self/oom_score_adj", "-1000") < 0)
        sp_log(SP_LOG_WARN, "cgroup", "oom_score_adj failed errno=%d", errno);
    work_ready = 1;
    return 0;
}

static void cmd_path(char *out, size_t cap, uint32_t cmd, const char *file)
{
    if (cmd == 0)
        snprintf(out, cap, SP_CGROUP_WORK "/%s", file);
    else
        snprintf(out, cap, SP_CGROUP_WORK "/c%u%s%s", cmd, *file ? "/" : "", file);
}

/* The per-command memory limit, written when a group is made and again when one is reused
 * (a kill lifts it). Written on every reuse rather than only after a kill: the write took
 * 43-47 us under TCG (Python's loop included), against a command's 10 ms round trip, and
 * there is no state to keep in step with the kills. */
static void set_memory_max(uint32_t cmd)
{
    if (limits.cmd_memory_max == 0)
        return;
    char path[128], v[32];
    snprintf(v, sizeof(v), "%llu", (unsigned long long)limits.cmd_memory_max);
    cmd_path(path, sizeof(path), cmd, "memory.max");
    (void)write_file(path, v);
}

/* 1 when group cmd has no process left, 0 when it has, -1 when it is gone. */
static int cmd_empty(uint32_t cmd)
{
    char path[128], buf[128];
    cmd_path(path, sizeof(path), cmd, "cgroup.events");
    if (read_small(path, buf, sizeof(buf)) < 0)
        return -1;
    return strstr(buf, "populated 0") != NULL;
}

static void add_linger(uint32_t cmd)
{
    if (n_linger < LINGER_MAX)
        linger[n_linger++] = cmd;
    /* else it stays until it is empty and a later worker's first sweep finds it */
}

/* A respawned worker's first sweep: the groups the last one left behind are removed once
 * empty, like any lingering group, and its numbers start after theirs (so that however many
 * are left, the next one is free at the first try in sp_cgroup_cmd_new). */
static void scan_old(void)
{
    scanned = 1;
    DIR *d = opendir(SP_CGROUP_WORK);
    if (d == NULL)
        return;
    struct dirent *de;
    while ((de = readdir(d)) != NULL) {
        unsigned n;
        char end;
        if (sscanf(de->d_name, "c%u%c", &n, &end) == 1 && n != 0) {
            add_linger(n);
            if (n > last_cmd)
                last_cmd = n;
        }
    }
    closedir(d);
}

uint32_t sp_cgroup_cmd_new(void)
{
    if (!work_ready)
        return 0;
    if (!scanned)
        scan_old();
    while (n_idle > 0) {
        uint32_t cmd = idle[--n_idle];
        int e = cmd_empty(cmd);
        if (e == 1) {
            set_memory_max(cmd);
            return cmd;
        }
        if (e == 0) /* something was started in it after all: remove it once empty */
            add_linger(cmd);
    }
    /* Never share a group that exists (a wrapped number, or one scan_old could not see):
     * take the next free. */
    for (int tries = 0; tries < 64; tries++) {
        uint32_t cmd = ++last_cmd;
        if (cmd == 0)
            cmd = last_cmd = 1;
        char path[128];
        cmd_path(path, sizeof(path), cmd, "");
        if (mkdir(path, 0755) < 0) {
            if (errno == EEXIST)
                continue;
            sp_log(SP_LOG_WARN, "cgroup", "mkdir %s failed errno=%d", path, errno);
            return 0;
        }
        set_memory_max(cmd);
        char v[32];
        if (limits.cmd_pids_max > 0) {
            snprintf(v, sizeof(v), "%llu", (unsigned long long)limits.cmd_pids_max);
            cmd_path(path, sizeof(path), cmd, "pids.max");
            (void)write_file(path, v);
        }
        return cmd;
    }
    return 0;
}

/* clone3's arguments up to the cgroup (linux/sched.h, which musl's toolchain does not ship;
 * the ABI is stable). */
struct clone_args_v2 {
    uint64_t flags, pidfd, child_tid, parent_tid, exit_signal, stack, stack_size, tls;
    uint64_t set_tid, set_tid_size, cgroup;
};
#ifndef SYS_clone3
#define SYS_clone3 435
#endif
#define SP_CLONE_INTO_CGROUP 0x200000000ULL

/* Only a forked child calls this: async-signal-safe (open, write, close). */
static void enter(uint32_t cmd)
{
    char path[128];
    cmd_path(path, sizeof(path), cmd, "cgroup.procs");
    int fd = open(path, O_WRONLY | O_CLOEXEC);
    if (fd < 0)
        return;
    (void)!write(fd, "0", 1);
    close(fd);
}

/* Only a forked child calls this: the OOM killer's default, which the agent opted out of. */
static void default_oom(void)
{
    int fd = open("/proc/self/oom_score_adj", O_WRONLY | O_CLOEXEC);
    if (fd < 0)
        return;
    (void)!write(fd, "0", 1);
    close(fd);
}

pid_t sp_cgroup_fork(uint32_t cmd)
{
    if (!work_ready)
        return fork();
    if (cmd == 0) {
        /* No group of its own: the workload group, with its controllers on, may hold
         * none, so the child stays in the agent's (the root). */
        pid_t pid = fork();
        if (pid == 0)
            default_oom();
        return pid;
    }
    char path[128];
    cmd_path(path, sizeof(path), cmd, "");
    int dfd = open(path, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (dfd >= 0) {
        struct clone_args_v2 ca = {
            .flags = SP_CLONE_INTO_CGROUP, .exit_signal = SIGCHLD, .cgroup = (uint64_t)dfd};
        long pid = syscall(SYS_clone3, &ca, sizeof(ca));
        int e = errno;
        close(dfd);
        if (pid == 0)
            default_oom();
        if (pid >= 0 || (e != ENOSYS && e != EINVAL && e != E2BIG)) {
            errno = e;
            return (pid_t)pid;
        }
    }
    pid_t pid = fork();
    if (pid == 0) {
        enter(cmd);
        default_oom();
    }
    return pid;
}

#ifndef SCHED_RESET_ON_FORK
#define SCHED_RESET_ON_FORK 0x40000000
#endif

/* The agent's scheduling: SCHED_RR (rt) or SCHED_OTHER, both reset to normal in children. */
static void set_rt(int rt)
{
    /* The system call itself: musl's sched_setscheduler() always fails (ENOSYS), by design. */
    struct sched_param sp = {.sched_priority = rt ? 1 : 0};
    int policy = (rt ? SCHED_RR : SCHED_OTHER) | SCHED_RESET_ON_FORK;
    if (syscall(SYS_sched_setscheduler, 0, policy, &sp) < 0)
        sp_log(SP_LOG_WARN, "cgroup", "scheduling policy %d refused errno=%d", policy, errno);
    else if (rt)
        sp_log(SP_LOG_INFO, "cgroup", "the workload crowds the CPU: the agent goes first");
}

/* Tasks runnable now, the agent included (/proc/loadavg's fourth field), or -1. */
static long runnable(void)
{
    char buf[128];
    if (read_small("/proc/loadavg", buf, sizeof(buf)) < 0)
        return -1;
    long r;
    return sscanf(buf, "%*s %*s %*s %ld/", &r) == 1 ? r : -1;
}

void sp_cgroup_tick(void)
{
    static int rt, ncpu;
    static struct timespec last;
    if (!work_ready)
        return; /* not the guest's agent (a test's, on the host): its host's business */
    struct timespec now;
    clock_gettime(CLOCK_MONOTONIC, &now);
    if (last.tv_sec != 0 &&
        (now.tv_sec - last.tv_sec) * 1000 + (now.tv_nsec - last.tv_nsec) / 1000000 < 500)
        return;
    last = now;
    if (ncpu == 0) {
        long c = sysconf(_SC_NPROCESSORS_ONLN);
        ncpu = c > 0 ? (int)c : 1;
        set_rt(0); /* children must never inherit a priority */
    }
    long r = runnable();
    if (r < 0)
        return;
    if (!rt && r > 4L * ncpu + 4)
        set_rt(rt = 1);
    else if (rt && r <= 2L * ncpu + 2)
        set_rt(rt = 0);
}

int sp_cgroup_kill(uint32_t cmd)
{
    if (!work_ready || cmd == 0)
        return -1;
    char path[128];
    cmd_path(path, sizeof(path), cmd, "cgroup.kill");
    if (write_file(path, "1") < 0)
        return -1;
    /* Every process in the group now has SIGKILL pending (and any it was forking gets it
     * too), but one stuck charging a page at the group's limit sees it only once its
     * reclaim gives up, and in a group at its limit with no swap, reclaim keeps finding
     * file pages to evict, so it rarely does: under TCG, the processes of a fork bomb at
     * its limit took up to 36 s to die (stack: try_charge_memcg, try_to_free_mem_cgroup_pages,
     * reclaim_throttle). With the limit lifted their charges succeed at once, they exit and
     * free what they held. The agent starts nothing in the group until it is empty, and
     * sets the limit again when it reuses it (root in the guest could raise it anyway). */
    cmd_path(path, sizeof(path), cmd, "memory.max");
    (void)write_file(path, "max");
    return 0;
}

uint32_t sp_cgroup_cmd_done(uint32_t cmd)
{
    if (!work_ready || cmd == 0)
        return 0;
    int e = cmd_empty(cmd);
    if (e == 1 && n_idle < IDLE_MAX) {
        idle[n_idle++] = cmd;
        return 0;
    }
    if (e == 1) {
        char path[128];
        cmd_path(path, sizeof(path), cmd, "");
        (void)rmdir(path);
        return 0;
    }
    if (e == 0) {
        add_linger(cmd);
        return cmd;
    }
    return 0;
}

void sp_cgroup_sweep(void)
{
    if (!work_ready)
        return;
    if (!scanned)
        scan_old();
    for (size_t i = 0; i < n_linger;) {
        char path[128];
        cmd_path(path, sizeof(path), linger[i], "");
        if (rmdir(path) == 0 || errno == ENOENT)
            linger[i] = linger[--n_linger];
        else
            i++; /* EBUSY while anything is left in it */
    }
}
