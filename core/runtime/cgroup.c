/*
 * cgroup.c - per-VM control groups on cgroup v2 or v1 hosts (see cgroup.h).
 *
 * Owns the layout detected once at creation (which directories are the
 * parents of VM groups, per controller) and nothing else: groups are found
 * by name, so a restarted driver needs no state. All file system work is
 * small and synchronous; only removal may wait (briefly) for exiting tasks.
 * Does not fork or know what runs in a group.
 */
#include "core/runtime/cgroup.h"

#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <time.h>
#include <unistd.h>

#include "base/buf.h"

#define V2_SLICE      "space.slice"
#define V1_PARENT     "space"
#define RM_TRIES      100 /* rmdir attempts while the kernel still counts exiting tasks */
#define RM_SLEEP_NS   2000000L
#define MOUNTINFO_MAX (4u << 20) /* bytes; a host with more mounts than this is not ours */

enum { C_CPU = 0, C_MEM, C_PIDS, C_N };
static const char *const ctl_names[C_N] = {"cpu", "memory", "pids"};

struct sp_cgroup {
    sp_cgroup_kind_t kind;
    char why[512];
    char v2root[PATH_MAX];      /* v2: the mount holding space.slice */
    char parent[C_N][PATH_MAX]; /* parent of VM groups per controller; "" when absent */
};

static int sfmt(char *out, size_t n, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
static int sfmt(char *out, size_t n, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    int r = vsnprintf(out, n, fmt, ap);
    va_end(ap);
    return r;
}

/* ---------- pure parts ---------- */

bool sp_cgroup_has_token(const char *list, const char *word)
{
    if (list == NULL || word == NULL)
        return false;
    size_t wl = strlen(word);
    const char *p = list;
    while (*p != '\0') {
        p += strspn(p, " ,\n\t");
        size_t l = strcspn(p, " ,\n\t");
        if (l == wl && l > 0 && strncmp(p, word, l) == 0)
            return true;
        p += l;
    }
    return false;
}

/* Copies a mountinfo field of length l into out, decoding \ooo escapes. False if too long. */
static bool unescape(const char *s, size_t l, char *out, size_t n)
{
    size_t o = 0;
    for (size_t i = 0; i < l; i++) {
        char c = s[i];
        if (c == '\\' && i + 3 < l && s[i + 1] >= '0' && s[i + 1] <= '3' && s[i + 2] >= '0' &&
            s[i + 2] <= '7' && s[i + 3] >= '0' && s[i + 3] <= '7') {
            c = (char)(((s[i + 1] - '0') << 6) | ((s[i + 2] - '0') << 3) | (s[i + 3] - '0'));
            i += 3;
        }
        if (o + 1 >= n)
            return false;
        out[o++] = c;
    }
    out[o] = '\0';
    return true;
}

/* Sets slot to mp unless it holds a mount already; a mount of the hierarchy's root ("/")
 * replaces one of a subdirectory (a bind mount seen first). */
static void take(char *slot, bool *slot_root, const char *mp, bool is_root)
{
    if (slot[0] != '\0' && (*slot_root || !is_root))
        return;
    sfmt(slot, PATH_MAX, "%s", mp);
    *slot_root = is_root;
}

void sp_cgroup_parse_mountinfo(const char *text, sp_cgroup_mounts_t *out)
{
    memset(out, 0, sizeof(*out));
    bool root_v2 = false, root_cpu = false, root_mem = false, root_pids = false;
    const char *line = text != NULL ? text : "";
    while (*line != '\0') {
        size_t ll = strcspn(line, "\n");
        /* fields: id parent maj:min root mountpoint opts [optional...] - fstype source superopts */
        const char *f[64];
        size_t fl[64];
        int nf = 0;
        const char *p = line, *end = line + ll;
        while (p < end && nf < 64) {
            while (p < end && *p == ' ')
                p++;
            if (p >= end)
                break;
            const char *q = p;
            while (q < end && *q != ' ')
                q++;
            f[nf] = p;
            fl[nf] = (size_t)(q - p);
            nf++;
            p = q;
        }
        int dash = -1;
        for (int i = 6; i < nf; i++)
            if (fl[i] == 1 && f[i][0] == '-') {
                dash = i;
                break;
            }
        if (dash > 0 && dash + 1 < nf) {
            char fstype[32], mp[PATH_MAX], super[512];
            bool is_root = fl[3] == 1 && f[3][0] == '/';
            bool ok = fl[dash + 1] < sizeof fstype && unescape(f[4], fl[4], mp, sizeof mp);
            if (ok) {
                memcpy(fstype, f[dash + 1], fl[dash + 1]);
                fstype[fl[dash + 1]] = '\0';
                super[0] = '\0';
                if (dash + 3 < nf && fl[dash + 3] < sizeof super) {
                    memcpy(super, f[dash + 3], fl[dash + 3]);
                    super[fl[dash + 3]] = '\0';
                }
                if (strcmp(fstype, "cgroup2") == 0) {
                    take(out->v2, &root_v2, mp, is_root);
                } else if (strcmp(fstype, "cgroup") == 0) {
                    if (sp_cgroup_has_token(super, "cpu"))
                        take(out->cpu, &root_cpu, mp, is_root);
                    if (sp_cgroup_has_token(super, "memory"))
                        take(out->memory, &root_mem, mp, is_root);
                    if (sp_cgroup_has_token(super, "pids"))
                        take(out->pids, &root_pids, mp, is_root);
                }
            }
        }
        line += ll;
        if (*line == '\n')
            line++;
    }
}

sp_cgroup_kind_t sp_cgroup_pick(const sp_cgroup_mounts_t *m, const char *v2_controllers)
{
    if (m->v2[0] != '\0' && sp_cgroup_has_token(v2_controllers, "cpu") &&
        sp_cgroup_has_token(v2_controllers, "memory") &&
        sp_cgroup_has_token(v2_controllers, "pids"))
        return SP_CGROUP_V2;
    if (m->cpu[0] != '\0' && m->memory[0] != '\0')
        return SP_CGROUP_V1;
    return SP_CGROUP_NONE;
}

void sp_cgroup_limits(int cpu_count, int memory_mb, int overhead_mb, sp_cgroup_limits_t *out)
{
    uint64_t cpus = cpu_count > 0 ? (uint64_t)cpu_count : 1u;
    uint64_t mem = memory_mb > 0 ? (uint64_t)memory_mb : 256u;
    uint64_t over = overhead_mb > 0 ? (uint64_t)overhead_mb : 0u;
    out->cpu_period_us = SP_CGROUP_CPU_PERIOD_US;
    out->cpu_quota_us = cpus * SP_CGROUP_CPU_PERIOD_US;
    out->mem_bytes = (mem + over) << 20;
    out->pids_max = SP_CGROUP_PIDS_MAX;
}

/* ---------- file helpers ---------- */

/* The whole file into *out (empty, SP_BUF_INIT): 0, or -1 with errno (EFBIG: max bytes or
 * more) and *out left empty. */
static int read_all(const char *path, size_t max, sp_buf_t *out)
{
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0)
        return -1;
    int e = 0;
    for (;;) {
        if (out->len >= max) {
            e = EFBIG;
            break;
        }
        if (sp_buf_reserve(out, 8192) == NULL) {
            e = ENOMEM;
            break;
        }
        size_t room = out->cap - out->len - 1; /* sp_buf_reserve keeps one for the NUL */
        if (room > max - out->len)
            room = max - out->len;
        ssize_t r = read(fd, out->p + out->len, room);
        if (r < 0 && errno == EINTR)
            continue;
        if (r < 0) {
            e = errno;
            break;
        }
        if (r == 0)
            break;
        sp_buf_commit(out, (size_t)r);
    }
    close(fd);
    if (e != 0) {
        sp_buf_free(out);
        errno = e;
        return -1;
    }
    return 0;
}

static int read_small(const char *path, char *buf, size_t n)
{
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0)
        return -1;
    ssize_t r;
    do
        r = read(fd, buf, n - 1);
    while (r < 0 && errno == EINTR);
    int e = errno;
    close(fd);
    if (r < 0) {
        errno = e;
        return -1;
    }
    buf[r] = '\0';
    return 0;
}

static int write_str(const char *path, const char *s)
{
    int fd = open(path, O_WRONLY | O_CLOEXEC);
    if (fd < 0)
        return -1;
    size_t l = strlen(s);
    ssize_t w;
    do
        w = write(fd, s, l);
    while (w < 0 && errno == EINTR);
    int e = errno;
    close(fd);
    if (w != (ssize_t)l) {
        errno = w < 0 ? e : EIO;
        return -1;
    }
    return 0;
}

/* Writes "<dir>/<file>" = value; on failure says which in why. */
static int set_file(const char *dir, const char *file, const char *value, char *why, size_t n)
{
    char p[PATH_MAX + 64];
    sfmt(p, sizeof p, "%s/%s", dir, file);
    if (write_str(p, value) == 0)
        return 0;
    int e = errno;
    sfmt(why, n, "cannot set %s=%s: %s", p, value, strerror(e));
    errno = e;
    return -1;
}

static bool exists_in(const char *dir, const char *file)
{
    char p[PATH_MAX + 64];
    sfmt(p, sizeof p, "%s/%s", dir, file);
    return access(p, F_OK) == 0;
}

/* ---------- detection ---------- */

static void set_none(sp_cgroup_t *cg, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void set_none(sp_cgroup_t *cg, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(cg->why, sizeof cg->why, fmt, ap);
    va_end(ap);
    cg->kind = SP_CGROUP_NONE;
    for (int i = 0; i < C_N; i++)
        cg->parent[i][0] = '\0';
}

static void init_v2(sp_cgroup_t *cg, const char *mount)
{
    char buf[512], p[PATH_MAX + 64];
    sfmt(cg->v2root, sizeof cg->v2root, "%s", mount);
    sfmt(p, sizeof p, "%s/cgroup.subtree_control", mount);
    if (read_small(p, buf, sizeof buf) < 0 || !sp_cgroup_has_token(buf, "cpu") ||
        !sp_cgroup_has_token(buf, "memory") || !sp_cgroup_has_token(buf, "pids")) {
        if (write_str(p, "+cpu +memory +pids") < 0) {
            set_none(cg, "cgroup v2: cannot enable cpu, memory, pids in %s: %s", p,
                     strerror(errno));
            return;
        }
    }
    char slice[PATH_MAX];
    sfmt(slice, sizeof slice, "%s/" V2_SLICE, mount);
    if (mkdir(slice, 0755) < 0 && errno != EEXIST) {
        set_none(cg, "cgroup v2: cannot create %s: %s", slice, strerror(errno));
        return;
    }
    char why[256];
    if (set_file(slice, "cgroup.subtree_control", "+cpu +memory +pids", why, sizeof why) < 0) {
        set_none(cg, "cgroup v2: %s", why);
        return;
    }
    for (int i = 0; i < C_N; i++)
        sfmt(cg->parent[i], PATH_MAX, "%s", slice);
    cg->kind = SP_CGROUP_V2;
    sfmt(cg->why, sizeof cg->why, "cgroup v2 at %s", slice);
}

static void init_v1(sp_cgroup_t *cg, const sp_cgroup_mounts_t *m)
{
    const char *mounts[C_N] = {m->cpu, m->memory, m->pids};
    for (int i = 0; i < C_N; i++) {
        if (mounts[i][0] == '\0')
            continue;
        char dir[PATH_MAX];
        sfmt(dir, sizeof dir, "%s/" V1_PARENT, mounts[i]);
        if (mkdir(dir, 0755) < 0 && errno != EEXIST) {
            set_none(cg, "cgroup v1: cannot create %s: %s", dir, strerror(errno));
            return;
        }
        sfmt(cg->parent[i], PATH_MAX, "%s", dir);
    }
    cg->kind = SP_CGROUP_V1;
    sfmt(cg->why, sizeof cg->why, "cgroup v1 cpu=%s memory=%s pids=%s", cg->parent[C_CPU],
         cg->parent[C_MEM], cg->parent[C_PIDS][0] ? cg->parent[C_PIDS] : "(not mounted)");
}

sp_cgroup_t *sp_cgroup_create(void)
{
    sp_cgroup_t *cg = calloc(1, sizeof(*cg));
    if (cg == NULL)
        return NULL;
    sp_cgroup_mounts_t *m = malloc(sizeof(*m));
    if (m == NULL) {
        free(cg);
        return NULL;
    }
    sp_buf_t text = SP_BUF_INIT;
    if (read_all("/proc/self/mountinfo", MOUNTINFO_MAX, &text) < 0) {
        set_none(cg, "cannot read /proc/self/mountinfo: %s", strerror(errno));
        free(m);
        return cg;
    }
    sp_cgroup_parse_mountinfo(sp_buf_cstr(&text), m);
    sp_buf_free(&text);
    char ctl[512] = "";
    if (m->v2[0] != '\0') {
        char p[PATH_MAX + 32];
        sfmt(p, sizeof p, "%s/cgroup.controllers", m->v2);
        if (read_small(p, ctl, sizeof ctl) < 0)
            ctl[0] = '\0';
    }
    switch (sp_cgroup_pick(m, ctl)) {
    case SP_CGROUP_V2:
        init_v2(cg, m->v2);
        break;
    case SP_CGROUP_V1:
        init_v1(cg, m);
        break;
    default:
        set_none(cg,
                 "no cgroup v2 mount offering cpu, memory and pids%s%s, and no cgroup v1 "
                 "cpu and memory hierarchies",
                 m->v2[0] ? " at " : "", m->v2);
        break;
    }
    free(m);
    return cg;
}

void sp_cgroup_destroy(sp_cgroup_t *cg)
{
    free(cg);
}

sp_cgroup_kind_t sp_cgroup_kind(const sp_cgroup_t *cg)
{
    return cg != NULL ? cg->kind : SP_CGROUP_NONE;
}

const char *sp_cgroup_why(const sp_cgroup_t *cg)
{
    return cg != NULL ? cg->why : "no cgroup layout";
}

/* ---------- per VM ---------- */

static bool valid_name(const char *id)
{
    return id != NULL && id[0] != '\0' && id[0] != '.' && strchr(id, '/') == NULL &&
           strlen(id) < 128;
}

int sp_cgroup_vm_dir(const sp_cgroup_t *cg, const char *controller, const char *id, char *out,
                     size_t n)
{
    if (cg == NULL || cg->kind == SP_CGROUP_NONE || !valid_name(id))
        return -1;
    for (int i = 0; i < C_N; i++) {
        if (strcmp(controller, ctl_names[i]) != 0)
            continue;
        if (cg->parent[i][0] == '\0')
            return -1;
        sfmt(out, n, "%s/vm-%s", cg->parent[i], id);
        return 0;
    }
    return -1;
}

/* The VM's distinct group directories (co-mounted v1 controllers, or v2, share one). */
static int vm_dirs(const sp_cgroup_t *cg, const char *id, char dirs[C_N][PATH_MAX])
{
    int n = 0;
    for (int i = 0; i < C_N; i++) {
        if (cg->parent[i][0] == '\0')
            continue;
        char d[PATH_MAX];
        sfmt(d, sizeof d, "%s/vm-%s", cg->parent[i], id);
        bool dup = false;
        for (int j = 0; j < n; j++)
            dup = dup || strcmp(dirs[j], d) == 0;
        if (dup)
            continue;
        memcpy(dirs[n], d, sizeof d);
        n++;
    }
    return n;
}

static int set_limits_v2(const char *dir, const sp_cgroup_limits_t *lim, char *why, size_t n)
{
    char v[64];
    sfmt(v, sizeof v, "%llu %llu", (unsigned long long)lim->cpu_quota_us,
         (unsigned long long)lim->cpu_period_us);
    if (set_file(dir, "cpu.max", v, why, n) < 0)
        return -1;
    sfmt(v, sizeof v, "%llu", (unsigned long long)lim->mem_bytes);
    if (set_file(dir, "memory.max", v, why, n) < 0)
        return -1;
    /* like memsw on v1: the limit is on RAM + swap, so no swapping past it */
    if (exists_in(dir, "memory.swap.max") && set_file(dir, "memory.swap.max", "0", why, n) < 0)
        return -1;
    sfmt(v, sizeof v, "%u", lim->pids_max);
    return set_file(dir, "pids.max", v, why, n);
}

/* Sets the v1 limits of the controllers mounted at dir (several when co-mounted). */
static int set_limits_v1(const sp_cgroup_t *cg, const char *dir, const char *id,
                         const sp_cgroup_limits_t *lim, char *why, size_t n)
{
    char v[64], d[PATH_MAX];
    if (sp_cgroup_vm_dir(cg, "cpu", id, d, sizeof d) == 0 && strcmp(d, dir) == 0) {
        /* period first: the quota is checked against it */
        sfmt(v, sizeof v, "%llu", (unsigned long long)lim->cpu_period_us);
        if (set_file(dir, "cpu.cfs_period_us", v, why, n) < 0)
            return -1;
        sfmt(v, sizeof v, "%llu", (unsigned long long)lim->cpu_quota_us);
        if (set_file(dir, "cpu.cfs_quota_us", v, why, n) < 0)
            return -1;
    }
    if (sp_cgroup_vm_dir(cg, "memory", id, d, sizeof d) == 0 && strcmp(d, dir) == 0) {
        sfmt(v, sizeof v, "%llu", (unsigned long long)lim->mem_bytes);
        /* memsw >= limit always: raise memsw first (fails harmlessly when lowering a reused
         * group), then the limit, then memsw for real. */
        bool memsw = exists_in(dir, "memory.memsw.limit_in_bytes");
        if (memsw) {
            char p[PATH_MAX + 64];
            sfmt(p, sizeof p, "%s/memory.memsw.limit_in_bytes", dir);
            (void)write_str(p, v);
        }
        if (set_file(dir, "memory.limit_in_bytes", v, why, n) < 0)
            return -1;
        if (memsw && set_file(dir, "memory.memsw.limit_in_bytes", v, why, n) < 0)
            return -1;
    }
    if (sp_cgroup_vm_dir(cg, "pids", id, d, sizeof d) == 0 && strcmp(d, dir) == 0) {
        sfmt(v, sizeof v, "%u", lim->pids_max);
        if (set_file(dir, "pids.max", v, why, n) < 0)
            return -1;
    }
    return 0;
}

int sp_cgroup_vm_create(sp_cgroup_t *cg, const char *id, const sp_cgroup_limits_t *lim,
                        sp_cgroup_join_t *join, char *why, size_t why_n)
{
    join->n = 0;
    if (cg == NULL || cg->kind == SP_CGROUP_NONE) {
        sfmt(why, why_n, "%s", sp_cgroup_why(cg));
        errno = ENOTSUP;
        return -1;
    }
    if (!valid_name(id)) {
        sfmt(why, why_n, "invalid group name");
        errno = EINVAL;
        return -1;
    }
    char dirs[C_N][PATH_MAX];
    bool made[C_N] = {false};
    int nd = vm_dirs(cg, id, dirs);
    int e = 0;
    for (int i = 0; i < nd && e == 0; i++) {
        if (mkdir(dirs[i], 0755) == 0)
            made[i] = true;
        else if (errno != EEXIST) {
            e = errno;
            sfmt(why, why_n, "cannot create %s: %s", dirs[i], strerror(e));
        }
    }
    for (int i = 0; i < nd && e == 0; i++) {
        int r = cg->kind == SP_CGROUP_V2 ? set_limits_v2(dirs[i], lim, why, why_n)
                                         : set_limits_v1(cg, dirs[i], id, lim, why, why_n);
        if (r < 0)
            e = errno;
    }
    for (int i = 0; i < nd && e == 0; i++) {
        char p[PATH_MAX + 32];
        /* v1: the child's only thread through "tasks" moves the process as "cgroup.procs"
         * would, without the write lock on every thread group of the host that a write to
         * cgroup.procs takes (an RCU grace period: milliseconds per hierarchy, on the path of
         * every VM start); QEMU's threads, made after exec, follow it. */
        if (cg->kind == SP_CGROUP_V2)
            sfmt(p, sizeof p, "%s/cgroup.procs", dirs[i]);
        else
            sfmt(p, sizeof p, "%s/tasks", dirs[i]);
        int fd = open(p, O_WRONLY | O_CLOEXEC);
        if (fd < 0) {
            e = errno;
            sfmt(why, why_n, "cannot open %s: %s", p, strerror(e));
            break;
        }
        join->fd[join->n++] = fd;
    }
    if (e == 0)
        return 0;
    sp_cgroup_join_close(join);
    for (int i = 0; i < nd; i++)
        if (made[i])
            rmdir(dirs[i]);
    errno = e;
    return -1;
}

int sp_cgroup_join(const sp_cgroup_join_t *join)
{
    for (int i = 0; i < join->n; i++) {
        ssize_t w;
        do
            w = write(join->fd[i], "0", 1);
        while (w < 0 && errno == EINTR);
        if (w != 1) {
            if (w >= 0)
                errno = EIO;
            return -1;
        }
    }
    return 0;
}

void sp_cgroup_join_close(sp_cgroup_join_t *join)
{
    for (int i = 0; i < join->n; i++)
        if (join->fd[i] >= 0)
            close(join->fd[i]);
    join->n = 0;
}

bool sp_cgroup_vm_exists(const sp_cgroup_t *cg, const char *id)
{
    char d[PATH_MAX];
    if (sp_cgroup_vm_dir(cg, "memory", id, d, sizeof d) < 0)
        return false;
    return access(d, F_OK) == 0;
}

/* SIGKILLs every process listed in dir/cgroup.procs. */
static void kill_members(const char *dir)
{
    char p[PATH_MAX + 32];
    sfmt(p, sizeof p, "%s/cgroup.procs", dir);
    sp_buf_t b = SP_BUF_INIT;
    if (read_all(p, 1u << 20, &b) < 0)
        return;
    const char *list = sp_buf_cstr(&b);
    for (const char *s = list; *s != '\0';) {
        char *end;
        long pid = strtol(s, &end, 10);
        if (end == s)
            break;
        if (pid > 1)
            kill((pid_t)pid, SIGKILL);
        s = end;
        while (*s == '\n')
            s++;
    }
    sp_buf_free(&b);
}

int sp_cgroup_vm_remove(sp_cgroup_t *cg, const char *id)
{
    if (cg == NULL || cg->kind == SP_CGROUP_NONE || !valid_name(id))
        return 0;
    char dirs[C_N][PATH_MAX];
    int nd = vm_dirs(cg, id, dirs);
    int e = 0;
    for (int i = 0; i < nd; i++) {
        if (access(dirs[i], F_OK) < 0)
            continue;
        if (cg->kind == SP_CGROUP_V2 && exists_in(dirs[i], "cgroup.kill")) {
            char p[PATH_MAX + 32];
            sfmt(p, sizeof p, "%s/cgroup.kill", dirs[i]);
            (void)write_str(p, "1");
        } else {
            kill_members(dirs[i]);
        }
        int tries = 0;
        while (rmdir(dirs[i]) < 0 && errno != ENOENT) {
            if (errno != EBUSY || ++tries >= RM_TRIES) {
                e = errno;
                break;
            }
            /* tasks just killed still count until they finish exiting */
            kill_members(dirs[i]);
            struct timespec ts = {0, RM_SLEEP_NS};
            nanosleep(&ts, NULL);
        }
    }
    if (e == 0)
        return 0;
    errno = e;
    return -1;
}

int sp_cgroup_vm_remove_empty(sp_cgroup_t *cg, const char *id)
{
    if (cg == NULL || cg->kind == SP_CGROUP_NONE || !valid_name(id))
        return 0;
    char dirs[C_N][PATH_MAX];
    int nd = vm_dirs(cg, id, dirs);
    int e = 0;
    for (int i = 0; i < nd; i++)
        if (rmdir(dirs[i]) < 0 && errno != ENOENT && errno != EBUSY && e == 0)
            e = errno; /* EBUSY: it has members */
    if (e == 0)
        return 0;
    errno = e;
    return -1;
}

int sp_cgroup_vm_rename(sp_cgroup_t *cg, const char *from, const char *to)
{
    if (cg == NULL || cg->kind == SP_CGROUP_NONE)
        return 0;
    if (!valid_name(from) || !valid_name(to)) {
        errno = EINVAL;
        return -1;
    }
    char a[C_N][PATH_MAX], b[C_N][PATH_MAX];
    int na = vm_dirs(cg, from, a);
    int nb = vm_dirs(cg, to, b);
    if (na != nb) {
        errno = EINVAL;
        return -1;
    }
    for (int i = 0; i < na; i++) {
        if (access(a[i], F_OK) < 0 && errno == ENOENT)
            continue;
        if (rename(a[i], b[i]) < 0) {
            int e = errno;
            for (int j = i - 1; j >= 0; j--)
                (void)rename(b[j], a[j]);
            errno = e;
            return -1;
        }
    }
    return 0;
}

int sp_cgroup_vm_mem_used(const sp_cgroup_t *cg, const char *id, uint64_t *out)
{
    char d[PATH_MAX], p[PATH_MAX + 32], buf[64];
    if (sp_cgroup_vm_dir(cg, "memory", id, d, sizeof d) < 0)
        return -1;
    sfmt(p, sizeof p, "%s/%s", d,
         cg->kind == SP_CGROUP_V2 ? "memory.current" : "memory.usage_in_bytes");
    if (read_small(p, buf, sizeof buf) < 0)
        return -1;
    char *end;
    errno = 0;
    unsigned long long v = strtoull(buf, &end, 10);
    if (end == buf || errno != 0)
        return -1;
    *out = v;
    return 0;
}
