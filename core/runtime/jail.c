/*
 * jail.c - the uid allocator and the jailed spawn (see jail.h).
 *
 * A plan is a list of steps with every string computed in the parent; the child, a clone of a
 * threaded process sharing its memory until it exec's (CLONE_VM | CLONE_VFORK, like
 * posix_spawn), runs them with system calls only (no malloc, no locks, no glibc set*id
 * wrappers, which would signal threads the child does not have), and writes nothing of ours but
 * its report. Owns no process and no file once sp_jail_spawn returned.
 */
#include "core/runtime/jail.h"

#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <pthread.h>
#include <sched.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/mount.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include <linux/capability.h>

#ifndef CLONE_PIDFD
#define CLONE_PIDFD 0x00001000
#endif
#ifndef PR_CAP_AMBIENT
#define PR_CAP_AMBIENT 47
#define PR_CAP_AMBIENT_CLEAR_ALL 4
#endif

/* ---------- the uid allocator ---------- */

struct sp_jail_ids {
    uint32_t start, count;
    uid_t self;
    uint32_t next; /* next-fit cursor, an index */
    unsigned used;
    uint8_t *bits;
};

int sp_jail_range_parse(const char *s, uint32_t *start, uint32_t *count)
{
    if (s == NULL || *s < '0' || *s > '9')
        return -1;
    char *end;
    errno = 0;
    unsigned long long a = strtoull(s, &end, 10);
    if (errno != 0 || *end != ':' || end[1] < '0' || end[1] > '9')
        return -1;
    unsigned long long c = strtoull(end + 1, &end, 10);
    if (errno != 0 || *end != '\0' || c == 0 || a == 0 || a + c - 1 > 0xfffffffeull)
        return -1; /* (uid_t)-1 means "unchanged" to set*id: never hand it out */
    *start = (uint32_t)a;
    *count = (uint32_t)c;
    return 0;
}

sp_jail_ids_t *sp_jail_ids_create(uint32_t start, uint32_t count, uid_t self)
{
    if (start == 0 || count == 0 || (uint64_t)start + count - 1 > 0xfffffffeull) {
        errno = EINVAL;
        return NULL;
    }
    sp_jail_ids_t *ids = calloc(1, sizeof(*ids));
    if (ids == NULL)
        return NULL;
    ids->bits = calloc((count + 7) / 8, 1);
    if (ids->bits == NULL) {
        free(ids);
        return NULL;
    }
    ids->start = start;
    ids->count = count;
    ids->self = self;
    return ids;
}

void sp_jail_ids_destroy(sp_jail_ids_t *ids)
{
    if (ids == NULL)
        return;
    free(ids->bits);
    free(ids);
}

static bool bit_get(const sp_jail_ids_t *ids, uint32_t i)
{
    return ids->bits[i / 8] & (1u << (i % 8));
}

static void bit_set(sp_jail_ids_t *ids, uint32_t i, bool on)
{
    if (on)
        ids->bits[i / 8] |= (uint8_t)(1u << (i % 8));
    else
        ids->bits[i / 8] &= (uint8_t) ~(1u << (i % 8));
}

int sp_jail_ids_take(sp_jail_ids_t *ids, uid_t *out)
{
    for (uint32_t k = 0; k < ids->count; k++) {
        uint32_t i = (ids->next + k) % ids->count;
        uid_t u = (uid_t)(ids->start + i);
        if (bit_get(ids, i) || u == ids->self)
            continue;
        bit_set(ids, i, true);
        ids->used++;
        ids->next = (i + 1) % ids->count;
        *out = u;
        return 0;
    }
    errno = ENOSPC;
    return -1;
}

int sp_jail_ids_claim(sp_jail_ids_t *ids, uid_t uid)
{
    if (uid < ids->start || uid - ids->start >= ids->count || uid == ids->self) {
        errno = ERANGE;
        return -1;
    }
    uint32_t i = uid - ids->start;
    if (bit_get(ids, i)) {
        errno = EEXIST;
        return -1;
    }
    bit_set(ids, i, true);
    ids->used++;
    return 0;
}

void sp_jail_ids_put(sp_jail_ids_t *ids, uid_t uid)
{
    if (ids == NULL || uid < ids->start || uid - ids->start >= ids->count)
        return;
    uint32_t i = uid - ids->start;
    if (!bit_get(ids, i))
        return;
    bit_set(ids, i, false);
    ids->used--;
}

unsigned sp_jail_ids_used(const sp_jail_ids_t *ids)
{
    return ids->used;
}

/* ---------- plans ---------- */

enum op_kind {
    OP_MKDIR = 0, /* a directory of the new root (a = path under the stage) */
    OP_MKFILE,    /* an empty file to mount over (a) */
    OP_BIND,      /* mount b on a; then remount with flags */
    OP_SYMLINK,   /* symlink b at a */
    OP_PROC,      /* a proc of the child's PID namespace, pids only, at a */
};

struct op {
    enum op_kind kind;
    unsigned flags;
    unsigned long keep; /* OP_BIND in a user namespace: the source mount's flags to keep */
    char *a, *b;
};

struct sp_jail {
    char stage[PATH_MAX];
    uid_t uid;
    gid_t gid;
    bool userns;                   /* not root: in a user namespace of its own */
    char uid_map[32], gid_map[32]; /* then: uid and gid mapped to themselves */
    int last_cap;
    uint64_t fsize;
    int pass[SP_JAIL_PASS_MAX]; /* fds the child gets as 3, 4, ... */
    int npass;
    struct op *ops;
    size_t n, cap;
    char **bound_dirs; /* paths (inside) bound as directories: nothing is made under them */
    size_t nbd;
};

/* A number from a /proc/sys file, or -1 when it cannot be read. */
static long sysctl_long(const char *path)
{
    FILE *f = fopen(path, "re");
    long v = -1;
    if (f != NULL) {
        if (fscanf(f, "%ld", &v) != 1)
            v = -1;
        fclose(f);
    }
    return v;
}

bool sp_jail_userns(void)
{
    return geteuid() != 0;
}

bool sp_jail_supported(char *why, size_t n)
{
    if (geteuid() == 0)
        return true;
    /* Debian's switch (absent upstream, where they are always allowed), and the count */
    if (sysctl_long("/proc/sys/kernel/unprivileged_userns_clone") == 0 ||
        sysctl_long("/proc/sys/user/max_user_namespaces") == 0) {
        snprintf(why, n,
                 "spaced is not root (euid %u) and this kernel does not let it make a user "
                 "namespace (kernel.unprivileged_userns_clone, user.max_user_namespaces): "
                 "QEMU runs as spaced's own user, in spaced's namespaces, with spaced's file "
                 "system view",
                 (unsigned)geteuid());
        return false;
    }
    return true;
}

/* The highest capability the running kernel knows (it may know more than our headers), read
 * once per process: it does not change while the kernel runs. */
static int last_cap(void)
{
    static atomic_int cached;
    int v = atomic_load(&cached);
    if (v > 0)
        return v;
    v = CAP_LAST_CAP;
    FILE *f = fopen("/proc/sys/kernel/cap_last_cap", "re");
    if (f != NULL) {
        int k;
        if (fscanf(f, "%d", &k) == 1 && k > 0 && k < 64)
            v = k;
        fclose(f);
    }
    atomic_store(&cached, v);
    return v;
}

sp_jail_t *sp_jail_new(const char *stage, uid_t uid, gid_t gid)
{
    if (stage == NULL || stage[0] != '/' || strlen(stage) >= PATH_MAX - 1 || uid == 0 || gid == 0) {
        errno = EINVAL;
        return NULL;
    }
    sp_jail_t *j = calloc(1, sizeof(*j));
    if (j == NULL)
        return NULL;
    snprintf(j->stage, sizeof j->stage, "%s", stage);
    j->uid = uid;
    j->gid = gid;
    j->last_cap = last_cap();
    j->userns = sp_jail_userns();
    if (j->userns) {
        if (uid != geteuid() || gid != getegid()) { /* the only ids its namespace has */
            free(j);
            errno = EINVAL;
            return NULL;
        }
        snprintf(j->uid_map, sizeof j->uid_map, "%u %u 1\n", (unsigned)uid, (unsigned)uid);
        snprintf(j->gid_map, sizeof j->gid_map, "%u %u 1\n", (unsigned)gid, (unsigned)gid);
    }
    return j;
}

void sp_jail_free(sp_jail_t *j)
{
    if (j == NULL)
        return;
    for (size_t i = 0; i < j->n; i++) {
        free(j->ops[i].a);
        free(j->ops[i].b);
    }
    for (size_t i = 0; i < j->nbd; i++)
        free(j->bound_dirs[i]);
    free(j->bound_dirs);
    free(j->ops);
    free(j);
}

int sp_jail_pass_fd(sp_jail_t *j, int fd)
{
    if (j->npass == SP_JAIL_PASS_MAX || fd < 0) {
        errno = fd < 0 ? EINVAL : E2BIG;
        return -1;
    }
    j->pass[j->npass++] = fd;
    return 2 + j->npass;
}

void sp_jail_set_fsize(sp_jail_t *j, uint64_t bytes)
{
    j->fsize = bytes;
}

static int add_op(sp_jail_t *j, enum op_kind k, unsigned flags, const char *inside, const char *b)
{
    if (j->n == j->cap) {
        size_t nc = j->cap ? j->cap * 2 : 32;
        struct op *no = realloc(j->ops, nc * sizeof(*no));
        if (no == NULL)
            return -1;
        j->ops = no;
        j->cap = nc;
    }
    char *a = NULL;
    if (asprintf(&a, "%s%s", j->stage, inside) < 0)
        return -1;
    char *bb = b != NULL ? strdup(b) : NULL;
    if (b != NULL && bb == NULL) {
        free(a);
        return -1;
    }
    j->ops[j->n++] = (struct op){.kind = k, .flags = flags, .a = a, .b = bb};
    return 0;
}

/* True when inside is at or under a directory already bound, or one already made. */
static bool under_bound(const sp_jail_t *j, const char *inside)
{
    for (size_t i = 0; i < j->nbd; i++) {
        size_t l = strlen(j->bound_dirs[i]);
        if (strncmp(inside, j->bound_dirs[i], l) == 0 && (inside[l] == '/' || inside[l] == '\0'))
            return true;
    }
    return false;
}

static bool made(const sp_jail_t *j, const char *inside)
{
    size_t l = strlen(j->stage);
    for (size_t i = 0; i < j->n; i++)
        if ((j->ops[i].kind == OP_MKDIR || j->ops[i].kind == OP_MKFILE ||
             j->ops[i].kind == OP_SYMLINK) &&
            strcmp(j->ops[i].a + l, inside) == 0)
            return true;
    return false;
}

/* mkdir -p of inside's parents in the new root, unless they come from a bind. */
static int make_parents(sp_jail_t *j, const char *inside)
{
    char p[PATH_MAX];
    snprintf(p, sizeof p, "%s", inside);
    for (char *s = p + 1; *s != '\0'; s++) {
        if (*s != '/')
            continue;
        *s = '\0';
        if (!under_bound(j, p) && !made(j, p) && add_op(j, OP_MKDIR, 0, p, NULL) < 0)
            return -1;
        *s = '/';
    }
    return 0;
}

static bool clean_abs(const char *p)
{
    if (p == NULL || p[0] != '/' || strlen(p) >= PATH_MAX - 1 - 64)
        return false;
    for (const char *s = p; *s != '\0'; s++)
        if (s[0] == '/' &&
            (s[1] == '/' || (s[1] == '.' && (s[2] == '/' || s[2] == '\0' ||
                                             (s[2] == '.' && (s[3] == '/' || s[3] == '\0'))))))
            return false;
    return strcmp(p, "/") != 0;
}

static int bind_at(sp_jail_t *j, const char *src, const char *inside, bool dir, unsigned flags)
{
    size_t n0 = j->n;
    if (make_parents(j, inside) < 0)
        goto fail;
    if (!under_bound(j, inside) && !made(j, inside) &&
        add_op(j, dir ? OP_MKDIR : OP_MKFILE, 0, inside, NULL) < 0)
        goto fail;
    if (add_op(j, OP_BIND, flags, inside, src) < 0)
        goto fail;
    if (j->userns) {
        /* In a user namespace the source mount's flags are locked: a remount of the bind
         * must keep its read-only, nosuid, nodev, noexec and its atime flags as they are. */
        struct statvfs sv;
        unsigned long keep = 0;
        if (statvfs(src, &sv) == 0) {
            keep |= (sv.f_flag & ST_RDONLY) ? MS_RDONLY : 0;
            keep |= (sv.f_flag & ST_NOSUID) ? MS_NOSUID : 0;
            keep |= (sv.f_flag & ST_NODEV) ? MS_NODEV : 0;
            keep |= (sv.f_flag & ST_NOEXEC) ? MS_NOEXEC : 0;
            keep |= (sv.f_flag & ST_NODIRATIME) ? MS_NODIRATIME : 0;
            if (sv.f_flag & ST_NOATIME)
                keep |= MS_NOATIME;
            else if (!(sv.f_flag & ST_RELATIME))
                keep |= MS_STRICTATIME;
        }
        j->ops[j->n - 1].keep = keep;
    }
    if (dir) {
        char **nb = realloc(j->bound_dirs, (j->nbd + 1) * sizeof(*nb));
        if (nb == NULL)
            goto fail;
        j->bound_dirs = nb;
        if ((nb[j->nbd] = strdup(inside)) == NULL)
            goto fail;
        j->nbd++;
    }
    return 0;
fail:
    while (j->n > n0) {
        j->n--;
        free(j->ops[j->n].a);
        free(j->ops[j->n].b);
    }
    errno = ENOMEM;
    return -1;
}

int sp_jail_bind(sp_jail_t *j, const char *host_path, unsigned flags)
{
    if (!clean_abs(host_path)) {
        errno = host_path != NULL && strlen(host_path) >= PATH_MAX - 65 ? ENAMETOOLONG : EINVAL;
        return -1;
    }
    struct stat st;
    if (stat(host_path, &st) < 0) {
        if (errno == ENOENT && (flags & SP_JAIL_OPT))
            return 0;
        return -1;
    }
    return bind_at(j, host_path, host_path, S_ISDIR(st.st_mode), flags);
}

int sp_jail_mount_proc(sp_jail_t *j)
{
    if (made(j, "/proc"))
        return 0;
    size_t n0 = j->n;
    if (add_op(j, OP_MKDIR, 0, "/proc", NULL) < 0 || add_op(j, OP_PROC, 0, "/proc", NULL) < 0) {
        while (j->n > n0) {
            j->n--;
            free(j->ops[j->n].a);
        }
        errno = ENOMEM;
        return -1;
    }
    return 0;
}

int sp_jail_mirror_root_links(sp_jail_t *j, const char *const *names, size_t n)
{
    for (size_t i = 0; i < n; i++) {
        char tgt[PATH_MAX];
        struct stat st;
        if (lstat(names[i], &st) < 0)
            continue;
        if (S_ISLNK(st.st_mode)) {
            ssize_t l = readlink(names[i], tgt, sizeof tgt - 1);
            if (l <= 0)
                continue;
            tgt[l] = '\0';
            if (made(j, names[i]))
                continue;
            if (make_parents(j, names[i]) < 0 || add_op(j, OP_SYMLINK, 0, names[i], tgt) < 0)
                return -1;
        } else if (S_ISDIR(st.st_mode) && sp_jail_bind(j, names[i], 0) < 0) {
            return -1;
        }
    }
    return 0;
}

/* ---------- the child ---------- */

enum step {
    ST_SESSION = 1,
    ST_CGROUP,
    ST_PRIVATE,
    ST_TMPFS,
    ST_MKDIR,
    ST_MKFILE,
    ST_BIND,
    ST_REMOUNT,
    ST_SYMLINK,
    ST_PROC,
    ST_PIVOT,
    ST_ROOT_RO,
    ST_RLIMIT,
    ST_STDIO,
    ST_CAPBSET,
    ST_AMBIENT,
    ST_SETGROUPS,
    ST_SETGID,
    ST_SETUID,
    ST_CAPSET,
    ST_NNP,
    ST_EXEC,
    ST_USERNS,
};

static const char *step_name(int s)
{
    static const char *const names[] = {"?",
                                        "setsid",
                                        "cgroup join",
                                        "private mounts",
                                        "root tmpfs",
                                        "mkdir",
                                        "mount point",
                                        "bind mount",
                                        "read-only remount",
                                        "symlink",
                                        "proc",
                                        "pivot_root",
                                        "root read-only",
                                        "rlimit",
                                        "stdio",
                                        "capability bounding set",
                                        "ambient capabilities",
                                        "setgroups",
                                        "setresgid",
                                        "setresuid",
                                        "capset",
                                        "no_new_privs",
                                        "exec",
                                        "user namespace ids"};
    return s > 0 && s < (int)(sizeof names / sizeof names[0]) ? names[s] : "?";
}

/* What the child leaves for the parent, in the parent's memory (the child shares it until it
 * exec's): the failing step and its errno; step 0 when it reached exec. */
struct report {
    volatile int step;
    volatile int err;
};

/* The child's code is not instrumented: a sanitizer's stack bookkeeping would write to our
 * memory (the shadow of a stack that is unmapped once the child is gone). */
#define CHILD_CODE __attribute__((no_sanitize("address", "undefined")))

static CHILD_CODE __attribute__((noreturn)) void child_fail(struct report *rep, int step)
{
    rep->err = errno;
    rep->step = step;
    _exit(125);
}

/* The kernel's struct sigaction (rt_sigaction), for SIG_DFL only. */
struct ksigaction {
    void *handler;
    unsigned long flags;
    void *restorer;
    unsigned long mask;
};

/* The child, on its own stack in the parent's memory (the parent is stopped until it exec's or
 * exits): system calls and what they leave in errno only; nothing written but rep. */
static CHILD_CODE __attribute__((noreturn)) void child_run(const sp_jail_t *j, char *const argv[],
                                                           char *const env[], int in_fd, int out_fd,
                                                           const sp_cgroup_join_t *cg,
                                                           struct report *rep)
{
    if (setsid() < 0)
        child_fail(rep, ST_SESSION);
    if (j->userns) {
        /* its own ids mapped to themselves, before anything it makes needs an owner; the
         * supplementary groups stay as they are (setgroups denied, as unprivileged maps need) */
        static const char deny[] = "deny";
        const char *files[] = {"/proc/self/setgroups", "/proc/self/uid_map", "/proc/self/gid_map"};
        const char *data[] = {deny, j->uid_map, j->gid_map};
        for (int i = 0; i < 3; i++) {
            int fd = open(files[i], O_WRONLY | O_CLOEXEC);
            size_t len = 0;
            while (data[i][len] != '\0')
                len++;
            if (fd < 0 || write(fd, data[i], len) != (ssize_t)len)
                child_fail(rep, ST_USERNS);
            close(fd);
        }
    }
    if (cg != NULL && cg->n > 0 && sp_cgroup_join(cg) < 0)
        child_fail(rep, ST_CGROUP);
    if (mount(NULL, "/", NULL, MS_REC | MS_PRIVATE, NULL) < 0)
        child_fail(rep, ST_PRIVATE);
    if (mount("space-jail", j->stage, "tmpfs", MS_NOSUID | MS_NODEV | MS_NOEXEC,
              "size=1m,nr_inodes=4096,mode=0755") < 0)
        child_fail(rep, ST_TMPFS);
    for (size_t i = 0; i < j->n; i++) {
        const struct op *o = &j->ops[i];
        switch (o->kind) {
        case OP_MKDIR:
            if (mkdir(o->a, 0755) < 0 && errno != EEXIST)
                child_fail(rep, ST_MKDIR);
            break;
        case OP_MKFILE: {
            int fd = open(o->a, O_WRONLY | O_CREAT | O_CLOEXEC, 0600);
            if (fd < 0)
                child_fail(rep, ST_MKFILE);
            close(fd);
            break;
        }
        case OP_SYMLINK:
            if (symlink(o->b, o->a) < 0)
                child_fail(rep, ST_SYMLINK);
            break;
        case OP_PROC:
            if (mount("proc", o->a, "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC,
                      "subset=pid,hidepid=invisible") < 0)
                child_fail(rep, ST_PROC);
            break;
        case OP_BIND: {
            if (mount(o->b, o->a, NULL, MS_BIND, NULL) < 0)
                child_fail(rep, ST_BIND);
            unsigned long fl = MS_REMOUNT | MS_BIND | MS_NOSUID | o->keep;
            if (!(o->flags & SP_JAIL_RW))
                fl |= MS_RDONLY;
            else
                fl |= MS_NOEXEC; /* writable: never executable */
            if (!(o->flags & SP_JAIL_DEV))
                fl |= MS_NODEV;
            if (mount(NULL, o->a, NULL, fl, NULL) < 0)
                child_fail(rep, ST_REMOUNT);
            break;
        }
        }
    }
    char old[PATH_MAX + 8];
    size_t sl = strlen(j->stage);
    memcpy(old, j->stage, sl);
    memcpy(old + sl, "/.old", 6);
    if (mkdir(old, 0700) < 0 || syscall(SYS_pivot_root, j->stage, old) < 0 || chdir("/") < 0 ||
        umount2("/.old", MNT_DETACH) < 0 || rmdir("/.old") < 0)
        child_fail(rep, ST_PIVOT);
    if (mount(NULL, "/", NULL, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV | MS_NOEXEC,
              NULL) < 0)
        child_fail(rep, ST_ROOT_RO);
    struct rlimit nof = {SP_JAIL_NOFILE, SP_JAIL_NOFILE}, core = {0, 0};
    if (setrlimit(RLIMIT_NOFILE, &nof) < 0 || setrlimit(RLIMIT_CORE, &core) < 0)
        child_fail(rep, ST_RLIMIT);
    if (j->fsize > 0) {
        struct rlimit fs = {j->fsize, j->fsize};
        if (setrlimit(RLIMIT_FSIZE, &fs) < 0)
            child_fail(rep, ST_RLIMIT);
    }
    struct ksigaction dfl = {.handler = SIG_DFL};
    for (int s = 1; s < 65; s++)
        syscall(SYS_rt_sigaction, s, &dfl, NULL, 8); /* fails harmlessly for KILL/STOP */
    unsigned long none = 0;
    syscall(SYS_rt_sigprocmask, SIG_SETMASK, &none, NULL, 8);
    /* stdio, then the passed fds as 3, 4, ..., nothing else. Everything first moves above where
     * it goes, so no dup2 clobbers a source. */
    int hi = 3 + SP_JAIL_PASS_MAX + 8;
    int tmp[SP_JAIL_PASS_MAX + 2];
    int src[SP_JAIL_PASS_MAX + 2];
    int ns = 0;
    src[ns++] = in_fd;
    src[ns++] = out_fd;
    for (int i = 0; i < j->npass; i++)
        src[ns++] = j->pass[i];
    for (int i = 0; i < ns; i++) {
        tmp[i] = fcntl(src[i], F_DUPFD_CLOEXEC, hi);
        if (tmp[i] < 0)
            child_fail(rep, ST_STDIO);
    }
    if (dup2(tmp[0], 0) < 0 || dup2(tmp[1], 1) < 0 || dup2(tmp[1], 2) < 0)
        child_fail(rep, ST_STDIO);
    for (int i = 0; i < j->npass; i++)
        if (dup2(tmp[2 + i], 3 + i) < 0)
            child_fail(rep, ST_STDIO);
    close_range((unsigned)(3 + j->npass), ~0u, 0);
    for (int c = 0; c <= j->last_cap; c++)
        if (prctl(PR_CAPBSET_DROP, c, 0, 0, 0) < 0 && errno != EINVAL)
            child_fail(rep, ST_CAPBSET);
    if (prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0) < 0 && errno != EINVAL)
        child_fail(rep, ST_AMBIENT);
    if (!j->userns && syscall(SYS_setgroups, 0, NULL) < 0)
        child_fail(rep, ST_SETGROUPS);
    if (syscall(SYS_setresgid, j->gid, j->gid, j->gid) < 0)
        child_fail(rep, ST_SETGID);
    if (syscall(SYS_setresuid, j->uid, j->uid, j->uid) < 0)
        child_fail(rep, ST_SETUID);
    /* setresuid cleared the permitted and effective sets; the inheritable one stays */
    struct __user_cap_header_struct hdr = {_LINUX_CAPABILITY_VERSION_3, 0};
    struct __user_cap_data_struct data[2];
    memset(data, 0, sizeof data);
    if (syscall(SYS_capset, &hdr, data) < 0)
        child_fail(rep, ST_CAPSET);
    if (prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) < 0)
        child_fail(rep, ST_NNP);
    static char *const empty[] = {NULL};
    execve(argv[0], argv, env != NULL ? env : empty);
    child_fail(rep, ST_EXEC);
}

struct child_args {
    const sp_jail_t *j;
    char *const *argv;
    char *const *env;
    int in_fd, out_fd;
    const sp_cgroup_join_t *cg;
    struct report *rep;
};

static CHILD_CODE int child_entry(void *arg)
{
    const struct child_args *a = arg;
    child_run(a->j, a->argv, a->env, a->in_fd, a->out_fd, a->cg, a->rep);
}

/* The child's stack: it runs in our memory (CLONE_VM) until it exec's, so it needs its own. */
#define CHILD_STACK (256u << 10)

pid_t sp_jail_spawn(const sp_jail_t *j, char *const argv[], char *const env[], int in_fd,
                    int out_fd, const sp_cgroup_join_t *cg, int *pidfd, char *why, size_t n)
{
    /* CLONE_VM | CLONE_VFORK, as posix_spawn does: a fork would copy the page tables of all of
     * spaced (milliseconds per hundred MB, on the loop, and copy-on-write faults after it),
     * for a child that only makes system calls and exec's. We stay stopped until then. */
    char *stack = mmap(NULL, CHILD_STACK, PROT_READ | PROT_WRITE,
                       MAP_PRIVATE | MAP_ANONYMOUS | MAP_STACK, -1, 0);
    if (stack == MAP_FAILED) {
        snprintf(why, n, "child stack: %s", strerror(errno));
        return -1;
    }
    struct report rep = {0, 0};
    struct child_args a = {j, argv, env, in_fd, out_fd, cg, &rep};
    int pfd = -1;
    /* Every signal blocked until the child has reset its handlers to the default: a handler of
     * ours must never run in it, on our memory. */
    sigset_t all, old;
    sigfillset(&all);
    pthread_sigmask(SIG_SETMASK, &all, &old);
    pid_t pid =
        clone(child_entry, stack + CHILD_STACK,
              CLONE_VM | CLONE_VFORK | CLONE_NEWNS | CLONE_NEWPID | CLONE_NEWIPC | CLONE_NEWUTS |
                  CLONE_NEWNET | CLONE_PIDFD | SIGCHLD | (j->userns ? CLONE_NEWUSER : 0),
              &a, &pfd);
    int e = errno;
    pthread_sigmask(SIG_SETMASK, &old, NULL);
    munmap(stack, CHILD_STACK);
    if (pid < 0) {
        snprintf(why, n, "clone into new namespaces: %s", strerror(e));
        errno = e;
        return -1;
    }
    /* The child has exec'd, or exited (after a report, or killed before exec, which the
     * caller then sees as a process that exits at once). */
    if (rep.step == 0) {
        fcntl(pfd, F_SETFD, FD_CLOEXEC);
        *pidfd = pfd;
        return pid;
    }
    waitpid(pid, NULL, 0); /* it exited after reporting */
    if (pfd >= 0)
        close(pfd);
    snprintf(why, n, "%s: %s", step_name(rep.step), strerror(rep.err));
    errno = rep.err != 0 ? rep.err : EIO;
    return -1;
}
