/*
 * util.c - small helpers every file of the QEMU driver uses: formatting and clocks, paths
 * and small files, the backing file a qcow2 header names, child processes (fork/exec with a
 * cgroup join, watched by pidfd), a VM's cgroups and its console log.
 *
 * Keeps no state of its own; a struct child belongs to whoever started it.
 */
#include "core/runtime/qemu/qemu_int.h"

#include <ctype.h>
#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "base/log.h"
#include "loop/discard.h"

/* ---------- small helpers ---------- */

/* snprintf for paths and small values. Truncation cannot happen for paths: the data
 * directory is limited at creation to leave room below PATH_MAX for every name we add. */
int sp_qemu__sfmt(char *out, size_t n, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    int r = vsnprintf(out, n, fmt, ap);
    va_end(ap);
    return r;
}

uint64_t sp_qemu__mono_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000u + (uint64_t)ts.tv_nsec / 1000000u;
}

uint32_t sp_qemu__env_ms(const char *name, uint32_t dflt)
{
    const char *s = getenv(name);
    if (s == NULL || *s == '\0')
        return dflt;
    char *end;
    unsigned long v = strtoul(s, &end, 10);
    if (*end != '\0' || v == 0 || v > 3600000ul)
        return dflt;
    return (uint32_t)v;
}

/* The executable execvp would run for name, into out[PATH_MAX]. false if none. */
bool sp_qemu__resolve_program(const char *name, char *out)
{
    if (strchr(name, '/') != NULL) {
        sp_qemu__sfmt(out, PATH_MAX, "%s", name);
        return access(name, X_OK) == 0;
    }
    const char *path = getenv("PATH");
    if (path == NULL)
        path = "/usr/local/bin:/usr/bin:/bin";
    while (*path != '\0') {
        size_t l = strcspn(path, ":");
        if (l > 0 && l < PATH_MAX - 1 - strlen(name)) {
            sp_qemu__sfmt(out, PATH_MAX, "%.*s/%s", (int)l, path, name);
            if (access(out, X_OK) == 0)
                return true;
        }
        path += l;
        if (*path == ':')
            path++;
    }
    return false;
}

bool sp_qemu__have_program(const char *name)
{
    char p[PATH_MAX];
    return sp_qemu__resolve_program(name, p);
}

bool sp_qemu__valid_id(const char *id)
{
    size_t n = id != NULL ? strlen(id) : 0;
    if (n == 0 || n > SP_QEMU_ID_MAX || id[0] == '.')
        return false;
    for (size_t i = 0; i < n; i++) {
        unsigned char c = (unsigned char)id[i];
        if (!isalnum(c) && c != '-' && c != '_' && c != '.')
            return false;
    }
    return true;
}

void sp_qemu__vm_path(const struct vm *vm, const char *name, char *out, size_t n)
{
    sp_qemu__sfmt(out, n, "%s/%s", vm->dir, name);
}

bool sp_qemu__file_exists(const char *p)
{
    return access(p, F_OK) == 0;
}

/* Reads at most n-1 bytes of a small file into buf, NUL-terminated. -1 on error. */
ssize_t sp_qemu__read_small(const char *path, char *buf, size_t n)
{
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0)
        return -1;
    ssize_t got = 0;
    while ((size_t)got < n - 1) {
        ssize_t r = read(fd, buf + got, n - 1 - (size_t)got);
        if (r < 0 && errno == EINTR)
            continue;
        if (r <= 0)
            break;
        got += r;
    }
    close(fd);
    buf[got] = '\0';
    return got;
}

/* Writes a file atomically (temp + rename). */
int sp_qemu__write_atomic(const char *path, const char *data, size_t len)
{
    char tmp[PATH_MAX + 8];
    sp_qemu__sfmt(tmp, sizeof tmp, "%s.tmp", path);
    int fd = open(tmp, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    if (fd < 0)
        return -1;
    ssize_t w = write(fd, data, len);
    close(fd);
    if (w != (ssize_t)len || rename(tmp, path) < 0) {
        unlink(tmp);
        return -1;
    }
    return 0;
}

bool sp_qemu__path_under(const char *path, const char *dir)
{
    size_t n = strlen(dir);
    return dir[0] != '\0' && strncmp(path, dir, n) == 0 && path[n] == '/';
}

/* Where path goes to be unlinked: <shared>/sandboxes/.trash for what is under the shared
 * snapshot dir (another filesystem, seen by every worker; shared true), else <vms>/.trash.
 * Neither is ever a sandbox id (valid ids do not start with a dot), nor a builder's, spare's,
 * fetch's or publish's temporary name. */
static void trash_dir(const sp_qemu_t *d, bool shared, char *out, size_t n)
{
    if (shared)
        sp_qemu__sfmt(out, n, "%s/sandboxes/.trash", d->shared_dir);
    else
        sp_qemu__sfmt(out, n, "%s/.trash", d->vms_dir);
}

void sp_qemu__discard(const sp_qemu_t *d, const char *path)
{
    char trash[PATH_MAX + 32];
    trash_dir(d, sp_qemu__path_under(path, d->shared_dir), trash, sizeof trash);
    sp_discard(d->base.loop, trash, path);
}

void sp_qemu__discard_leftovers(const sp_qemu_t *d)
{
    char trash[PATH_MAX + 32];
    trash_dir(d, false, trash, sizeof trash);
    sp_discard_leftovers(d->base.loop, trash);
    if (d->shared_dir[0] != '\0') { /* every worker's: removing trash twice is harmless */
        trash_dir(d, true, trash, sizeof trash);
        sp_discard_leftovers(d->base.loop, trash);
    }
}

int sp_qemu__pidfd_open(pid_t pid)
{
    return (int)syscall(SYS_pidfd_open, pid, 0);
}

/* The last bytes of the console, made printable, for a log line. */
void sp_qemu__console_tail(const struct vm *vm, char *out, size_t n)
{
    char path[PATH_MAX + 16];
    sp_qemu__vm_path(vm, "console.log", path, sizeof path);
    out[0] = '\0';
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0)
        return;
    struct stat st;
    size_t want = n - 1;
    off_t off = 0;
    if (fstat(fd, &st) == 0 && (size_t)st.st_size > want)
        off = st.st_size - (off_t)want;
    ssize_t r = pread(fd, out, want, off);
    close(fd);
    if (r < 0)
        r = 0;
    out[r] = '\0';
    for (ssize_t i = 0; i < r; i++) {
        unsigned char c = (unsigned char)out[i];
        if (c == '\n' || c == '\r')
            out[i] = '|';
        else if (c < 0x20 || c > 0x7e)
            out[i] = '.';
    }
}

/* Keeps console.log bounded: QEMU writes it with O_APPEND, so after we cut it to its
 * tail QEMU's next write lands at the new end. A write racing the cut may be lost. */
void sp_qemu__console_trim(const struct vm *vm)
{
    char path[PATH_MAX + 16];
    sp_qemu__vm_path(vm, "console.log", path, sizeof path);
    int fd = open(path, O_RDWR | O_CLOEXEC);
    if (fd < 0)
        return;
    struct stat st;
    if (fstat(fd, &st) == 0 && (uint64_t)st.st_size > SP_QEMU_CONSOLE_MAX) {
        char *buf = malloc(SP_QEMU_CONSOLE_KEEP);
        if (buf != NULL) {
            ssize_t r = pread(fd, buf, SP_QEMU_CONSOLE_KEEP, st.st_size - SP_QEMU_CONSOLE_KEEP);
            if (r > 0 && ftruncate(fd, 0) == 0 && pwrite(fd, buf, (size_t)r, 0) != r)
                sp_log(SP_LOG_DEBUG, "qemu", "console trim short write sandbox=%s", vm->id);
            free(buf);
        }
    }
    close(fd);
}

/* ---------- children ---------- */

/* After fork, waits for the child to join its cgroup: it writes its errno to the status
 * pipe and exits if it cannot; the pipe closes without data once it has joined (close_range
 * before exec). Blocks the loop only for the child's few syscalls. 0 when joined. */
static int await_join(int rd, pid_t pid, int *join_errno)
{
    int e = 0;
    ssize_t r;
    do
        r = read(rd, &e, sizeof e);
    while (r < 0 && errno == EINTR);
    close(rd);
    if (r <= 0)
        return 0;
    *join_errno = r == (ssize_t)sizeof e ? e : EIO;
    waitpid(pid, NULL, 0); /* it exits right after writing */
    return -1;
}

/* fork + exec; the child only makes async-signal-safe calls. Returns the pid and a pidfd.
 * With o->cg, the child joins those cgroups before exec; if it cannot, it never execs and
 * sp_qemu__spawn fails (a VM outside its limits is worse than no VM). */
pid_t sp_qemu__spawn(char *const argv[], const struct spawn_opts *o, int *pidfd, sp_err_t *err)
{
    int out = open(o->out_path != NULL ? o->out_path : "/dev/null",
                   O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644);
    int in = o->stdin_fd >= 0 ? o->stdin_fd : open("/dev/null", O_RDONLY | O_CLOEXEC);
    int st[2] = {-1, -1};
    bool join = o->cg != NULL && o->cg->n > 0;
    if (out < 0 || in < 0 || (join && pipe2(st, O_CLOEXEC) < 0)) {
        int e = errno;
        if (out >= 0)
            close(out);
        if (in >= 0 && in != o->stdin_fd)
            close(in);
        sp_err_set(err, SP_ERUNTIME, "cannot open child stdio");
        sp_log(SP_LOG_ERROR, "qemu", "child stdio path=%s err=%s",
               o->out_path ? o->out_path : "/dev/null", strerror(e));
        return -1;
    }
    pid_t pid = fork();
    if (pid == 0) {
        if (o->new_session)
            setsid();
        if (join && sp_cgroup_join(o->cg) < 0) {
            int je = errno;
            if (write(st[1], &je, sizeof je) < 0) {
                /* the parent then sees a VM that exited at once: the boot fails anyway */
            }
            _exit(125);
        }
        struct sigaction sa = {.sa_handler = SIG_DFL};
        sigemptyset(&sa.sa_mask);
        for (int s = 1; s < NSIG; s++)
            sigaction(s, &sa, NULL); /* fails harmlessly for SIGKILL/SIGSTOP/RT gaps */
        sigset_t none;
        sigemptyset(&none);
        sigprocmask(SIG_SETMASK, &none, NULL);
        if (dup2(in, 0) < 0 || dup2(out, 1) < 0 || dup2(out, 2) < 0)
            _exit(126);
        close_range(3, ~0u, 0);
        execvp(argv[0], argv);
        _exit(127);
    }
    int e = errno;
    close(out);
    if (in != o->stdin_fd)
        close(in);
    if (join)
        close(st[1]);
    if (pid < 0) {
        if (join)
            close(st[0]);
        sp_log(SP_LOG_ERROR, "qemu", "fork failed err=%s", strerror(e));
        sp_err_set(err, SP_ERUNTIME, "cannot start process");
        return -1;
    }
    int je = 0;
    if (join && await_join(st[0], pid, &je) < 0) {
        sp_log(SP_LOG_ERROR, "qemu", "vm cannot join its cgroup, not started sandbox=%s err=%s",
               o->sandbox != NULL ? o->sandbox : "-", strerror(je));
        sp_err_set(err, SP_ERUNTIME, "cannot place the VM in its resource-limit cgroup");
        return -1;
    }
    *pidfd = sp_qemu__pidfd_open(pid);
    if (*pidfd < 0) {
        e = errno;
        kill(pid, SIGKILL);
        waitpid(pid, NULL, 0); /* just killed: returns at once */
        sp_log(SP_LOG_ERROR, "qemu", "pidfd_open failed err=%s", strerror(e));
        sp_err_set(err, SP_ERUNTIME, "cannot watch process");
        return -1;
    }
    fcntl(*pidfd, F_SETFD, FD_CLOEXEC);
    return pid;
}

void sp_qemu__child_free(struct child *c)
{
    if (c == NULL)
        return;
    sp_watch_destroy(c->w);
    sp_timer_stop(&c->timer);
    if (c->pidfd >= 0)
        close(c->pidfd);
    free(c);
}

static void on_child_exit(sp_watch_t *w, int events, void *arg)
{
    struct child *c = arg;
    int st = 0;
    pid_t r;
    do
        r = waitpid(c->pid, &st, WNOHANG);
    while (r < 0 && errno == EINTR);
    if (r == 0)
        return; /* spurious */
    if (r < 0)
        st = -1;
    sp_watch_destroy(c->w);
    c->w = NULL;
    sp_timer_stop(&c->timer);
    c->cb(c, st, c->timed_out, c->arg); /* the callback frees c */
}

static void on_child_timeout(sp_timer_t *t, void *arg)
{
    struct child *c = arg;
    c->timed_out = true;
    kill(c->pid, SIGKILL);
}

struct child *sp_qemu__child_start(sp_qemu_t *d, char *const argv[], const struct spawn_opts *o,
                                   uint32_t timeout_ms, child_cb cb, void *arg, sp_err_t *err)
{
    struct child *c = calloc(1, sizeof(*c));
    if (c == NULL) {
        sp_err_set(err, SP_EINTERNAL, "out of memory");
        return NULL;
    }
    c->d = d;
    c->cb = cb;
    c->arg = arg;
    c->pidfd = -1;
    sp_timer_init(&c->timer, d->base.loop, on_child_timeout, c);
    c->pid = sp_qemu__spawn(argv, o, &c->pidfd, err);
    if (c->pid < 0) {
        free(c);
        return NULL;
    }
    c->w = sp_watch_create(d->base.loop, c->pidfd, on_child_exit, c);
    if (c->w == NULL) {
        kill(c->pid, SIGKILL);
        waitpid(c->pid, NULL, 0);
        sp_qemu__child_free(c);
        sp_err_set(err, SP_EINTERNAL, "cannot watch process");
        return NULL;
    }
    sp_watch_set(c->w, SP_IO_READ);
    if (timeout_ms > 0)
        sp_timer_start(&c->timer, timeout_ms);
    return c;
}

/* ---------- cgroups ---------- */

/* Makes the VM's cgroups (core/runtime/cgroup.h) with limits from its size; fills *join with the
 * cgroup.procs fds its QEMU joins before exec. false (no limits) when the host has no usable
 * layout or this VM's group cannot be made: the VM then boots without limits, logged. */
bool sp_qemu__cg_create(struct vm *vm, sp_cgroup_join_t *join)
{
    sp_qemu_t *d = vm->d;
    vm->cg = false;
    join->n = 0;
    if (sp_cgroup_kind(d->cg) == SP_CGROUP_NONE)
        return false; /* said once, when the driver was created */
    sp_cgroup_limits_t lim;
    sp_cgroup_limits(vm->cpu_count, vm->memory_mb,
                     d->accel == 1 ? SP_QEMU_OVERHEAD_KVM_MB : SP_QEMU_OVERHEAD_TCG_MB, &lim);
    char why[512];
    if (sp_cgroup_vm_create(d->cg, vm->id, &lim, join, why, sizeof why) < 0) {
        sp_log(SP_LOG_WARN, "qemu", "vm runs without cgroup limits sandbox=%s reason=\"%s\"",
               vm->id, why);
        return false;
    }
    sp_log(SP_LOG_DEBUG, "qemu", "vm cgroup sandbox=%s cpu_quota_us=%llu mem_bytes=%llu pids=%u",
           vm->id, (unsigned long long)lim.cpu_quota_us, (unsigned long long)lim.mem_bytes,
           lim.pids_max);
    vm->cg = true;
    return true;
}

/* Kills anything left in the VM's cgroups and removes them. Nothing to do without any. */
void sp_qemu__cg_remove(sp_qemu_t *d, const char *id)
{
    if (sp_cgroup_vm_remove(d->cg, id) < 0)
        sp_log(SP_LOG_WARN, "qemu", "cannot remove cgroup sandbox=%s err=%s", id, strerror(errno));
}

int sp_qemu__fsync_path(const char *p, int flags)
{
    int fd = open(p, flags | O_CLOEXEC);
    if (fd < 0)
        return -1;
    int rc = fsync(fd);
    close(fd);
    return rc;
}

/* The backing file name a qcow2 header holds, as written there, into out[n]. false when
 * none or unreadable. */
bool sp_qemu__qcow2_backing_name(const char *path, char *out, size_t n)
{
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0)
        return false;
    uint8_t h[20];
    bool ok = pread(fd, h, sizeof h, 0) == (ssize_t)sizeof h && memcmp(h, "QFI\xfb", 4) == 0;
    uint64_t off = 0;
    uint32_t len = 0;
    for (int i = 0; ok && i < 8; i++)
        off = off << 8 | h[8 + i];
    for (int i = 0; ok && i < 4; i++)
        len = len << 8 | h[16 + i];
    ok = ok && off != 0 && len != 0 && len < n && off < (1u << 20);
    ok = ok && pread(fd, out, len, (off_t)off) == (ssize_t)len;
    close(fd);
    if (ok)
        out[len] = '\0';
    return ok;
}

/* Whether the qcow2 image at path reads nothing from another file: no backing file, and (a
 * version 3 header) no external data file, the one other file a qcow2 image can name. 1 when
 * it stands alone, 0 when it names another file, -1 when it cannot be read or is not a
 * version 2 or 3 qcow2 image (so a caller that must be sure takes it as layered). */
int sp_qemu__qcow2_standalone(const char *path)
{
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0)
        return -1;
    uint8_t h[80];
    ssize_t got = pread(fd, h, sizeof h, 0);
    close(fd);
    if (got < 72 || memcmp(h, "QFI\xfb", 4) != 0)
        return -1;
    uint32_t version = 0;
    uint64_t off = 0, incompat = 0;
    for (int i = 0; i < 4; i++)
        version = version << 8 | h[4 + i];
    for (int i = 0; i < 8; i++)
        off = off << 8 | h[8 + i];
    if (version == 3) {
        if (got < 80)
            return -1;
        for (int i = 0; i < 8; i++)
            incompat = incompat << 8 | h[72 + i];
    } else if (version != 2) {
        return -1;
    }
    /* QEMU reads a backing file name only when its offset is not 0; incompatible feature
     * bit 2 is the external data file. */
    return off == 0 && (incompat & (1u << 2)) == 0 ? 1 : 0;
}

/* The backing file of the qcow2 image at path, into out[n]: the name its header holds when
 * absolute (ours are, but for the layers of a sandbox's snapshot from the shared snapshot
 * dir, shared.c), else resolved against path's directory as QEMU resolves it. false when
 * none or unreadable. */
bool sp_qemu__qcow2_backing(const char *path, char *out, size_t n)
{
    if (!sp_qemu__qcow2_backing_name(path, out, n))
        return false;
    const char *slash = strrchr(path, '/');
    if (out[0] == '/' || slash == NULL)
        return true;
    size_t dlen = (size_t)(slash - path) + 1, len = strlen(out);
    if (dlen + len >= n)
        return false;
    memmove(out + dlen, out, len + 1);
    memcpy(out, path, dlen);
    return true;
}

/* Names `name` as the backing file of the qcow2 image at path (not in use by any QEMU), in
 * place: the name sits in cluster 0 after the header and its extensions, where qemu-img put
 * it, and the new one must fit there too. What qemu-img rebase -u does, without a process.
 * 0 or -1 (errno set; EINVAL: the image has no backing file or the name does not fit). */
int sp_qemu__qcow2_set_backing(const char *path, const char *name)
{
    int fd = open(path, O_RDWR | O_CLOEXEC);
    if (fd < 0)
        return -1;
    uint8_t h[24];
    bool ok = pread(fd, h, sizeof h, 0) == (ssize_t)sizeof h && memcmp(h, "QFI\xfb", 4) == 0;
    uint64_t off = 0;
    uint32_t bits = 0;
    for (int i = 0; ok && i < 8; i++)
        off = off << 8 | h[8 + i];
    for (int i = 0; ok && i < 4; i++)
        bits = bits << 8 | h[20 + i];
    size_t len = strlen(name);
    if (!ok || off == 0 || bits < 9 || bits > 21 || len == 0 || len > 1023 ||
        off + len > (1ull << bits)) {
        close(fd);
        errno = EINVAL;
        return -1;
    }
    uint8_t be[4] = {(uint8_t)(len >> 24), (uint8_t)(len >> 16), (uint8_t)(len >> 8), (uint8_t)len};
    ok = pwrite(fd, name, len, (off_t)off) == (ssize_t)len &&
         pwrite(fd, be, sizeof be, 16) == (ssize_t)sizeof be && fsync(fd) == 0;
    int e = errno;
    close(fd);
    errno = e;
    return ok ? 0 : -1;
}
