/*
 * confine.c - what the QEMU driver requires of a VM's confinement and how its QEMU is jailed
 * (core/runtime/jail.h): the uid each VM's QEMU runs as, the view it gets (the QEMU binary
 * and libraries, /dev/null, /dev/zero, /dev/urandom, /dev/kvm only under KVM, the VM's own
 * directory, its kernel, initramfs and disk backing chain read-only, a clone's template RAM as
 * a sealed memfd), and the refusals when seccomp or cgroups are missing.
 *
 * Template RAM: QEMU 7.2 opens a memory-backend-file O_RDWR even for share=off (a private
 * map), so a read-only bind of the template's mem.ram fails and a writable one would let one
 * VM change the pages every other clone maps. Each template snapshot's RAM is copied once per
 * driver into a memfd sealed against writes, growth and shrinking: QEMU opens it read-write
 * (as /proc/self/fd/N: the jail mounts a proc of its own PID namespace, processes only, since
 * a memfd cannot be bind-mounted) and maps it private, and no process can change it. Its
 * holes are filled in the background once a clone uses it (ram_fill_start says why). Kept
 * until the driver goes or the snapshot is collected (the template size's RAM per template
 * size in use; charged to spaced's memory, not the VMs'). Copied off the loop
 * (the loop's SP_WORK_LONG lane: 50-250 ms of reading and writing that would stall every other
 * request) as soon as the snapshot is committed or found current at driver start; a clone whose
 * QEMU is due to start before its copy is done waits for it (sp_qemu__confine_ram_wait).
 *
 * The VM's directory stays spaced's (prepare_vm_dir): QEMU gets its writable files made for
 * it and its QMP and agent sockets as listening fds spaced bound (the command line says fd=
 * instead of path=), so nothing there is QEMU's to replace or link.
 *
 * Does not build QEMU's command line (boot.c) nor decide the cgroup limits (util.c).
 */
#include "core/runtime/qemu/qemu_int.h"

#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "base/log.h"
#include "core/runtime/procmaps.h"

#define RAM_MEMFD_NAME  "space-template-ram"
#define RAM_COPY_CHUNK  (1u << 20)
#define RAM_FILL_WINDOW (8u << 20)
#define CHAIN_MAX 8 /* qcow2 backing files followed; ours are 1 or 2 deep */

/* One template snapshot's RAM as a sealed memfd, in d->ramfds from ram_start until the driver
 * goes, the snapshot is collected, or its RAM file is found replaced (ram_find). While work is
 * set the copy (ram_copy, on the loop's SP_WORK_LONG lane) owns fd, err_no, ms, bytes and the
 * file's identity (dev, ino, mtime); the loop reads them in ram_done. An entry let go mid-copy
 * has d NULL: ram_done then only frees it. */
struct ramfd {
    struct ramfd *next;
    sp_qemu_t *d; /* NULL once let go */
    char dir[PATH_MAX];
    sp_work_t *work; /* the copy in flight */
    bool failed;     /* the copy ended without a memfd: the waiting boots fail, then it goes */
    bool resuming;   /* ram_done is going on with the boots waiting for it: not dropped */
    int fd;          /* the sealed memfd, once made; -1 before */
    bool filled;     /* its holes are being or were filled (ram_fill_start), at its first clone */
    int err_no;      /* why the copy failed */
    uint64_t ms, bytes;
    dev_t dev; /* the mem.ram copied: a snapshot removed and built again at the same dir */
    ino_t ino; /* (its key's) has a new file, which the memfd is not */
    struct timespec mtime;
};

static void ram_drop(struct ramfd *r);

int sp_qemu__confine_init(sp_qemu_t *d, const sp_qemu_opts_t *o, sp_err_t *err)
{
    d->allow_no_seccomp = o->insecure_no_seccomp != 0;
    d->allow_no_cgroups = o->insecure_no_cgroups != 0;
    char why[256];
    if (o->no_jail) {
        sp_log(SP_LOG_WARN, "qemu",
               "jailer OFF (--no-jail): every QEMU runs as spaced's user, in its namespaces, "
               "with its file system view; insecure, for comparison only");
        return 0;
    }
    if (!sp_jail_supported(why, sizeof why)) {
        sp_log(SP_LOG_WARN, "qemu",
               "jailer not used: %s; not done: own uid per VM, capability drop, mount/pid/ipc/"
               "uts/net namespaces, pivot_root (still done: no_new_privs via seccomp, fds "
               "closed)",
               why);
        return 0;
    }
    uint32_t start = SP_JAIL_UID_START_DEFAULT, count = SP_JAIL_UID_COUNT_DEFAULT;
    d->jail_userns = sp_jail_userns();
    if (d->jail_userns) {
        if (geteuid() == 0 || getegid() == 0) /* sp_jail_new refuses them */
            return sp_err_set(err, SP_EINVAL, "spaced runs with group 0 but not as root");
    } else {
        if (o->jail_uid_range != NULL && sp_jail_range_parse(o->jail_uid_range, &start, &count) < 0)
            return sp_err_set(err, SP_EINVAL,
                              "--jail-uid-range wants START:COUNT (decimal, not including 0)");
        if (getuid() >= start && getuid() - start < count)
            return sp_err_set(err, SP_EINVAL, "--jail-uid-range must not include spaced's own uid");
        d->jail_ids = sp_jail_ids_create(start, count, getuid());
        if (d->jail_ids == NULL)
            return sp_err_set(err, SP_EINTERNAL, "out of memory");
    }
    char qp[PATH_MAX], real[PATH_MAX];
    if (!sp_qemu__resolve_program(d->qemu, qp) || realpath(qp, real) == NULL)
        return sp_err_set(err, SP_ERUNTIME, "cannot resolve the QEMU binary");
    char *nq = strdup(real);
    if (nq == NULL)
        return sp_err_set(err, SP_EINTERNAL, "out of memory");
    free(d->qemu);
    d->qemu = nq; /* exec'd by path inside the jail: no PATH there */
    sp_qemu__sfmt(d->jail_stage, sizeof d->jail_stage, "%s/jail", d->data_dir);
    if (mkdir(d->jail_stage, 0700) < 0 && errno != EEXIST)
        return sp_err_set(err, SP_ERUNTIME, "cannot create the jail mount point");
    d->jail = true;
    if (d->jail_userns)
        sp_log(SP_LOG_WARN, "qemu",
               "jailer on, in user namespaces (spaced is not root): each QEMU with no "
               "capabilities, no_new_privs, new user/mount/pid/ipc/uts/net namespaces, "
               "pivot_root into its own tmpfs; not done: a uid of its own (every QEMU runs as "
               "spaced's uid %u and keeps its groups)",
               (unsigned)geteuid());
    else
        sp_log(SP_LOG_INFO, "qemu",
               "jailer on: each QEMU as its own uid from %u:%u, no capabilities, no_new_privs, "
               "new mount/pid/ipc/uts/net namespaces, pivot_root into its own tmpfs",
               (unsigned)start, (unsigned)count);
    return 0;
}

void sp_qemu__confine_free(sp_qemu_t *d)
{
    while (d->ramfds != NULL) { /* copies in flight are let go: ram_done frees them */
        struct ramfd *r = d->ramfds;
        d->ramfds = r->next;
        ram_drop(r);
    }
    sp_jail_ids_destroy(d->jail_ids);
    d->jail_ids = NULL;
}

const char *sp_qemu__confine_refusal(const sp_qemu_t *d, bool have_cgroup)
{
    if (d->sandbox != 1 && !d->allow_no_seccomp)
        return "this host's QEMU cannot run with its seccomp sandbox (-sandbox on,...): VMs do "
               "not start unless spaced runs with --insecure-no-seccomp";
    if (!have_cgroup && !d->allow_no_cgroups)
        return "the VM's cgroup (cpu, memory, pids limits) cannot be made: VMs do not start "
               "unless spaced runs with --insecure-no-cgroups";
    return NULL;
}

size_t sp_qemu__confine_insecure(const sp_qemu_t *d, const char **out, size_t n)
{
    size_t k = 0;
    if (!d->jail && k < n)
        out[k++] = "no-jail";
    if (d->jail && d->jail_userns && k < n)
        out[k++] = "jail-one-uid"; /* every QEMU as spaced's own uid (not root) */
    if (d->sandbox == 0 && k < n)
        out[k++] = d->allow_no_seccomp ? "no-seccomp" : "no-seccomp: VMs do not start";
    if (sp_cgroup_kind(d->cg) == SP_CGROUP_NONE && k < n)
        out[k++] = d->allow_no_cgroups ? "no-cgroups" : "no-cgroups: VMs do not start";
    return k;
}

/* ---------- template RAM as sealed memfds ---------- */

/* Copies r->dir/mem.ram into a new sealed memfd: r->fd, or r->err_no. On a worker thread (w
 * set: touches nothing but r's fd, err_no, ms and bytes, stops early once w is cancelled) or,
 * when no job could be queued, on the loop (w NULL). */
static void ram_copy(sp_work_t *w, void *arg)
{
    struct ramfd *r = arg;
    char p[PATH_MAX + 16];
    sp_qemu__sfmt(p, sizeof p, "%s/mem.ram", r->dir);
    uint64_t t0 = sp_qemu__mono_ms();
    int in = open(p, O_RDONLY | O_CLOEXEC);
    struct stat st;
    int mfd = -1;
    char *buf = NULL;
    if (in < 0 || fstat(in, &st) < 0)
        goto fail;
    r->dev = st.st_dev;
    r->ino = st.st_ino;
    r->mtime = st.st_mtim;
    mfd = memfd_create(RAM_MEMFD_NAME, MFD_CLOEXEC | MFD_ALLOW_SEALING);
    buf = malloc(RAM_COPY_CHUNK);
    if (mfd < 0 || buf == NULL || ftruncate(mfd, st.st_size) < 0)
        goto fail;
    /* Only the data extents, and in them only non-zero pages: the memfd keeps the file's
     * holes, so it costs what the template's guest touched. */
    off_t off = 0;
    while (off < st.st_size) {
        off_t data = lseek(in, off, SEEK_DATA);
        if (data < 0) {
            if (errno == ENXIO)
                break;
            goto fail;
        }
        off_t hole = lseek(in, data, SEEK_HOLE);
        if (hole < 0)
            goto fail;
        for (off_t at = data; at < hole;) {
            if (w != NULL && sp_work_cancelled(w)) {
                errno = ECANCELED;
                goto fail;
            }
            size_t want =
                (size_t)(hole - at) < RAM_COPY_CHUNK ? (size_t)(hole - at) : RAM_COPY_CHUNK;
            ssize_t n = pread(in, buf, want, at);
            if (n <= 0) {
                if (n == 0)
                    errno = EIO; /* shorter than fstat said: changed under us */
                goto fail;
            }
            for (ssize_t pg = 0; pg < n; pg += 4096) {
                size_t len = (size_t)(n - pg) < 4096 ? (size_t)(n - pg) : 4096;
                bool zero = true;
                for (size_t i = 0; i < len && zero; i += 8) {
                    uint64_t v = 0;
                    memcpy(&v, buf + pg + i, len - i < 8 ? len - i : 8);
                    zero = v == 0;
                }
                if (!zero && pwrite(mfd, buf + pg, len, at + pg) != (ssize_t)len)
                    goto fail;
                if (!zero)
                    r->bytes += len;
            }
            at += n;
        }
        off = hole;
    }
    if (fcntl(mfd, F_ADD_SEALS, F_SEAL_WRITE | F_SEAL_GROW | F_SEAL_SHRINK | F_SEAL_SEAL) < 0)
        goto fail;
    free(buf);
    close(in);
    r->fd = mfd;
    r->ms = sp_qemu__mono_ms() - t0;
    return;
fail:
    r->err_no = errno != 0 ? errno : EIO;
    free(buf);
    if (in >= 0)
        close(in);
    if (mfd >= 0)
        close(mfd);
}

static void ram_drop(struct ramfd *r)
{
    if (r->work != NULL) {
        r->d = NULL; /* ram_done frees it (and closes a memfd made after all) */
        sp_work_cancel(r->work);
        return;
    }
    if (r->fd >= 0)
        close(r->fd);
    free(r);
}

static void ram_unlink(sp_qemu_t *d, struct ramfd *r)
{
    for (struct ramfd **pp = &d->ramfds; *pp != NULL; pp = &(*pp)->next) {
        if (*pp == r) {
            *pp = r->next;
            return;
        }
    }
}

/* The holes of a sealed memfd, filled off the loop after its clones could start
 * (ram_fill_start). */
struct ramfill {
    int fd; /* a dup of the memfd: it outlives the entry if need be */
    char dir[PATH_MAX];
    int err_no;
    uint64_t ms, bytes;
};

static void ram_fill(sp_work_t *w, void *arg)
{
    struct ramfill *f = arg;
    struct stat st;
    uint64_t t0 = sp_qemu__mono_ms();
    if (fstat(f->fd, &st) < 0) {
        f->err_no = errno;
        return;
    }
    /* A read fault on a hole of a shared map allocates the page and zeroes it (fallocate
     * only allocates: the zeroing waits for the first fault, which is then QEMU's). A window
     * at a time: mapped pages count in spaced's RSS. */
    uint64_t n = (uint64_t)st.st_size;
    for (uint64_t at = 0; at < n && !sp_work_cancelled(w); at += RAM_FILL_WINDOW) {
        size_t len = n - at < RAM_FILL_WINDOW ? (size_t)(n - at) : RAM_FILL_WINDOW;
        const volatile uint8_t *p = mmap(NULL, len, PROT_READ, MAP_SHARED, f->fd, (off_t)at);
        if (p == MAP_FAILED) {
            f->err_no = errno;
            return;
        }
        for (size_t off = 0; off < len; off += 4096)
            (void)p[off];
        munmap((void *)p, len);
        f->bytes = at + len; /* the driver going stops it: what was filled stays filled */
    }
    f->ms = sp_qemu__mono_ms() - t0;
}

static void ram_fill_done(void *arg, bool cancelled)
{
    struct ramfill *f = arg;
    if (!cancelled && f->err_no != 0)
        sp_log(SP_LOG_WARN, "qemu", "template RAM holes not filled dir=%s err=%s", f->dir,
               strerror(f->err_no));
    else if (!cancelled)
        sp_log(SP_LOG_INFO, "qemu", "template RAM holes filled dir=%s ms=%llu bytes=%llu", f->dir,
               (unsigned long long)f->ms, (unsigned long long)f->bytes);
    close(f->fd);
    free(f);
}

/* The memfd keeps mem.ram's holes (the pages the template's guest never touched) when it is
 * made, so that its clones can start at once. But a clone's QEMU maps it privately, and a
 * fault on a hole of a private map of a memfd allocates the page in the memfd all the same,
 * read or write: the first suspend or snapshot of any clone reads every page (QEMU's
 * migration), and after it the memfd of a 256 MiB template held 256 MiB, not the 71 it
 * had (measured). Those allocations then land in that suspend's time, the 1 GiB size's
 * first suspend took 2.0-2.7 s against 0.3-0.4 s for the next ones, most of it zeroing
 * the pages in QEMU's faults. So the holes are filled here (allocated and zeroed), once per
 * template snapshot and driver, in the background when its first clone takes it (not at
 * driver start: a size nobody creates keeps its holes); its memory is then the template
 * size's RAM, as it was bound to become. Filling took 290 ms for 256 MiB and 1.2-1.4 s for
 * 1 GiB here, on one worker thread. */
static void ram_fill_start(sp_qemu_t *d, const struct ramfd *r)
{
    struct ramfill *f = calloc(1, sizeof *f);
    if (f == NULL)
        return;
    f->fd = fcntl(r->fd, F_DUPFD_CLOEXEC, 0);
    sp_qemu__sfmt(f->dir, sizeof f->dir, "%s", r->dir);
    if (f->fd < 0 || sp_loop_work(d->base.loop, SP_WORK_LONG, ram_fill, ram_fill_done, f) == NULL) {
        if (f->fd >= 0)
            close(f->fd);
        free(f); /* the first suspend fills them as before */
    }
}

/* The copy ended (or was let go): a memfd made is kept for dir's clones; the boots waiting for
 * it go on (sp_qemu__boot_ram_ready), and without one they fail to spawn (plan_vm) as a
 * synchronous copy's failure made them, after which the entry goes so that the next clone
 * tries again. */
static void ram_done(void *arg, bool cancelled)
{
    struct ramfd *r = arg;
    sp_qemu_t *d = r->d;
    r->work = NULL;
    if (cancelled && d != NULL) /* the loop went first: the driver lets go of it too */
        ram_unlink(d, r);
    if (cancelled || d == NULL) {
        sp_log(SP_LOG_DEBUG, "qemu", "template RAM copy let go dir=%s done=%d", r->dir,
               (int)(r->fd >= 0));
        if (r->fd >= 0)
            close(r->fd);
        free(r);
        return;
    }
    if (r->fd >= 0) {
        sp_log(SP_LOG_INFO, "qemu",
               "template RAM sealed for jailed clones dir=%s ms=%llu bytes=%llu (off the loop)",
               r->dir, (unsigned long long)r->ms, (unsigned long long)r->bytes);
    } else {
        r->failed = true;
        sp_log(SP_LOG_ERROR, "qemu", "cannot seal the template RAM dir=%s err=%s", r->dir,
               strerror(r->err_no));
    }
    /* One at a time from the table's head: a boot that goes on may fail and free itself. */
    r->resuming = true;
    for (;;) {
        struct vm *vm = d->vms;
        while (vm != NULL &&
               !(vm->ram_wait && vm->clone_src != NULL && strcmp(vm->clone_src, r->dir) == 0))
            vm = vm->next;
        if (vm == NULL)
            break;
        vm->ram_wait = false;
        sp_qemu__boot_ram_ready(vm);
    }
    r->resuming = false;
    if (r->failed) {
        ram_unlink(d, r);
        free(r);
    }
}

/* Whether r's memfd is still a copy of the mem.ram in its dir (true while there is nothing to
 * compare: the copy in flight, or failed). */
static bool ram_current(const struct ramfd *r)
{
    if (r->work != NULL || r->fd < 0)
        return true;
    char p[PATH_MAX + 16];
    struct stat st;
    sp_qemu__sfmt(p, sizeof p, "%s/mem.ram", r->dir);
    return stat(p, &st) == 0 && st.st_dev == r->dev && st.st_ino == r->ino &&
           st.st_mtim.tv_sec == r->mtime.tv_sec && st.st_mtim.tv_nsec == r->mtime.tv_nsec;
}

/* dir's entry; NULL when there is none, or when its snapshot was removed or built again since
 * the copy (by another process, by hand, or over a damaged one): that entry goes, so that the
 * caller starts a copy of the snapshot there now instead of restoring clones from old RAM. */
static struct ramfd *ram_find(sp_qemu_t *d, const char *dir)
{
    for (struct ramfd **pp = &d->ramfds; *pp != NULL; pp = &(*pp)->next) {
        struct ramfd *r = *pp;
        if (strcmp(r->dir, dir) != 0)
            continue;
        if (r->resuming || ram_current(r))
            return r;
        sp_log(SP_LOG_INFO, "qemu", "template RAM changed since it was sealed: sealed again dir=%s",
               dir);
        *pp = r->next;
        ram_drop(r);
        return NULL;
    }
    return NULL;
}

/* Starts the copy of dir's RAM off the loop (on the loop when no job can be queued). Drops
 * the memfds of snapshots removed meanwhile (by another process's collection; ours calls
 * sp_qemu__confine_ram_forget): their running clones keep their own maps. NULL when out of
 * memory. */
static struct ramfd *ram_start(sp_qemu_t *d, const char *dir)
{
    for (struct ramfd **pp = &d->ramfds; *pp != NULL;) {
        struct ramfd *r = *pp;
        if (r->work == NULL && !r->failed && !r->resuming && access(r->dir, F_OK) < 0 &&
            errno == ENOENT) {
            *pp = r->next;
            ram_drop(r);
            continue;
        }
        pp = &r->next;
    }
    struct ramfd *r = calloc(1, sizeof(*r));
    if (r == NULL) {
        sp_log(SP_LOG_ERROR, "qemu", "cannot seal the template RAM dir=%s err=%s", dir,
               strerror(ENOMEM));
        return NULL;
    }
    r->d = d;
    r->fd = -1;
    sp_qemu__sfmt(r->dir, sizeof r->dir, "%s", dir);
    r->next = d->ramfds;
    d->ramfds = r;
    r->work = sp_loop_work(d->base.loop, SP_WORK_LONG, ram_copy, ram_done, r);
    if (r->work == NULL) {
        sp_log(SP_LOG_WARN, "qemu", "no worker thread: sealing the template RAM on the loop dir=%s",
               dir);
        ram_copy(NULL, r);
        ram_done(r, false); /* nobody waits yet: a failed entry just goes */
        return ram_find(d, dir);
    }
    sp_log(SP_LOG_DEBUG, "qemu", "sealing the template RAM off the loop dir=%s", dir);
    return r;
}

/* A template snapshot is committed or found current (tsnap.c): its RAM is copied now, so that
 * its first jailed clone need not wait for it. Not in a tool's driver (no_adopt: spaced
 * template build), which never clones. */
void sp_qemu__confine_ram_prepare(sp_qemu_t *d, const char *dir)
{
    if (d->jail && !d->no_adopt && ram_find(d, dir) == NULL)
        ram_start(d, dir);
}

/* The snapshot at dir is being removed (collection, tsnap.c; no VM uses it): its memfd goes,
 * and a copy still running is let go (ram_done frees it). */
void sp_qemu__confine_ram_forget(sp_qemu_t *d, const char *dir)
{
    for (struct ramfd **pp = &d->ramfds; *pp != NULL; pp = &(*pp)->next) {
        struct ramfd *r = *pp;
        if (strcmp(r->dir, dir) == 0 && !r->resuming) {
            *pp = r->next;
            ram_drop(r);
            return;
        }
    }
}

/* Called as a jailed clone's QEMU is about to start: true when its template RAM is still being
 * copied (started now if it was not), and the boot waits (vm->ram_wait) until ram_done goes
 * on with it. false: go on; plan_vm then finds the memfd, or fails the spawn. */
bool sp_qemu__confine_ram_wait(struct vm *vm)
{
    sp_qemu_t *d = vm->d;
    vm->ram_wait = false;
    if (!d->jail || vm->clone_src == NULL)
        return false;
    struct ramfd *r = ram_find(d, vm->clone_src);
    if (r == NULL)
        r = ram_start(d, vm->clone_src);
    if (r == NULL || r->work == NULL)
        return false;
    vm->ram_wait = true;
    sp_log(SP_LOG_DEBUG, "qemu", "boot waits for its sealed template RAM sandbox=%s dir=%s", vm->id,
           vm->clone_src);
    return true;
}

/* The sealed memfd of dir's RAM, made. -1 with errno when there is none (its copy failed,
 * logged by ram_done, or never ran). */
static int ram_fd(sp_qemu_t *d, const char *dir)
{
    struct ramfd *r = ram_find(d, dir);
    if (r != NULL && r->fd >= 0 && r->work == NULL) {
        if (!r->filled) { /* a clone uses it: its size is in use */
            r->filled = true;
            ram_fill_start(d, r);
        }
        return r->fd;
    }
    errno = r != NULL && r->err_no != 0 ? r->err_no : ENOENT;
    return -1;
}

/* The template RAM memfd a QEMU maps (a private map, from offset 0, of a memfd named as
 * ram_copy names them), opened through /proc/<pid>/map_files; -1 when it maps none. */
struct ram_map {
    pid_t pid;
    int fd;
};

static bool is_ram_map(const sp_procmap_t *m, void *arg)
{
    struct ram_map *r = arg;
    static const char name[] = "/memfd:" RAM_MEMFD_NAME;
    if (!m->priv || m->off != 0 || strncmp(m->path, name, sizeof name - 1) != 0 ||
        (m->path[sizeof name - 1] != ' ' && m->path[sizeof name - 1] != '\0'))
        return false;
    char p[96];
    snprintf(p, sizeof p, "/proc/%d/map_files/%llx-%llx", (int)r->pid, (unsigned long long)m->lo,
             (unsigned long long)m->hi);
    r->fd = open(p, O_RDONLY | O_CLOEXEC);
    return r->fd >= 0;
}

static int mapped_ram_fd(pid_t pid)
{
    struct ram_map r = {pid, -1};
    sp_procmaps_each(pid, is_ram_map, &r);
    return r.fd;
}

static bool ts_before(struct timespec a, struct timespec b)
{
    return a.tv_sec < b.tv_sec || (a.tv_sec == b.tv_sec && a.tv_nsec < b.tv_nsec);
}

/* Which file a clone's QEMU maps its RAM from (fork.c reads the VM's pages through that map,
 * and takes every page it has not written to be mem.ram's): clone_src's mem.ram, or when
 * jailed the sealed memfd it was given. That memfd is the driver's own copy, or an older one:
 * an adopted VM's (made by the driver before), or one whose template RAM was sealed again
 * since. An older one is taken only when it is sealed against writes, as long as mem.ram,
 * and mem.ram has not changed since its last write (its copy). -1 when there is none. */
int sp_qemu__confine_ram_ident(const struct vm *vm, uint64_t *dev, uint64_t *ino)
{
    struct stat st;
    char p[PATH_MAX + 16];
    if (vm->clone_src == NULL)
        return -1;
    sp_qemu__sfmt(p, sizeof p, "%s/mem.ram", vm->clone_src);
    if (vm->d->jail) {
        int fd = vm->pid > 0 ? mapped_ram_fd(vm->pid) : -1;
        if (fd < 0 || fstat(fd, &st) < 0) {
            if (fd >= 0)
                close(fd);
            return -1;
        }
        struct ramfd *r = ram_find(vm->d, vm->clone_src);
        struct stat own, file;
        bool ok = r != NULL && r->fd >= 0 && r->work == NULL && fstat(r->fd, &own) == 0 &&
                  own.st_dev == st.st_dev && own.st_ino == st.st_ino;
        if (!ok) {
            int seals = fcntl(fd, F_GET_SEALS);
            ok = seals >= 0 && (seals & F_SEAL_WRITE) && stat(p, &file) == 0 &&
                 file.st_size == st.st_size && ts_before(file.st_mtim, st.st_mtim) &&
                 ts_before(file.st_ctim, st.st_mtim);
        }
        close(fd);
        if (!ok)
            return -1;
    } else if (stat(p, &st) < 0) {
        return -1;
    }
    *dev = st.st_dev;
    *ino = st.st_ino;
    return 0;
}

static int plan_vm(struct vm *vm, sp_jail_t *j, int *memfd)
{
    sp_qemu_t *d = vm->d;
    static const char *const links[] = {"/lib", "/lib64", "/lib32", "/libx32"};
    char chain[PATH_MAX], next[PATH_MAX];
    if (sp_jail_bind(j, d->qemu, 0) < 0 || sp_jail_bind(j, "/usr/lib", 0) < 0 ||
        sp_jail_bind(j, "/usr/lib64", SP_JAIL_OPT) < 0 ||
        sp_jail_bind(j, "/usr/share/qemu", SP_JAIL_OPT) < 0 ||
        sp_jail_bind(j, "/usr/share/seabios", SP_JAIL_OPT) < 0 ||
        sp_jail_bind(j, "/etc/ld.so.cache", SP_JAIL_OPT) < 0 ||
        sp_jail_mirror_root_links(j, links, sizeof links / sizeof links[0]) < 0 ||
        sp_jail_bind(j, "/dev/null", SP_JAIL_DEV | SP_JAIL_RW) < 0 ||
        sp_jail_bind(j, "/dev/zero", SP_JAIL_DEV | SP_JAIL_RW) < 0 ||
        sp_jail_bind(j, "/dev/urandom", SP_JAIL_DEV) < 0 ||
        (d->accel == 1 && sp_jail_bind(j, "/dev/kvm", SP_JAIL_DEV | SP_JAIL_RW) < 0) ||
        sp_jail_bind(j, vm->dir, SP_JAIL_RW) < 0 || sp_jail_bind(j, vm->tp->kernel, 0) < 0 ||
        (vm->tp->initramfs[0] != '\0' && sp_jail_bind(j, vm->tp->initramfs, 0) < 0))
        return -1;
    if (vm->clone_src != NULL) {
        /* the template's RAM as a sealed memfd, reopened through the jail's own /proc (a
         * memfd cannot be bind-mounted); its disk comes with the backing chain below */
        *memfd = ram_fd(d, vm->clone_src);
        if (*memfd < 0 || sp_jail_mount_proc(j) < 0)
            return -1;
    }
    sp_qemu__vm_path(vm, "disk.qcow2", chain, sizeof chain);
    for (int k = 0;
         k < CHAIN_MAX && sp_qemu__qcow2_backing(chain, next, sizeof next) && next[0] == '/'; k++) {
        if (sp_jail_bind(j, next, 0) < 0)
            return -1;
        memcpy(chain, next, sizeof chain);
    }
    return 0;
}

/* The VM directory stays spaced's (0711: QEMU may only walk it), so that QEMU can neither
 * replace what spaced reads or writes there (vm.json, qemu.pid, snapshot/, the sockets it
 * connects to) nor plant links for spaced to follow. The files QEMU opens read-write are
 * made beforehand and become its uid's: the disk overlay, the console log and, for a VM with
 * RAM of its own, an empty mem.ram (QEMU sizes an empty file). 0 or -1 with errno. */
static int prepare_vm_dir(const struct vm *vm, uid_t u, gid_t g)
{
    if (chown(vm->dir, geteuid(), getegid()) < 0 || chmod(vm->dir, 0711) < 0)
        return -1;
    static const char *const names[] = {"disk.qcow2", "console.log", "mem.ram"};
    char p[PATH_MAX + 16];
    for (size_t i = 0; i < sizeof names / sizeof names[0]; i++) {
        bool create = i == 1 || (i == 2 && vm->clone_src == NULL);
        sp_qemu__vm_path(vm, names[i], p, sizeof p);
        int fd = open(p, O_RDONLY | O_NOFOLLOW | O_CLOEXEC | (create ? O_CREAT : 0), 0600);
        if (fd < 0 && errno == ENOENT && !create)
            continue;
        if (fd < 0 || fchown(fd, u, g) < 0 || fchmod(fd, 0600) < 0) {
            int e = errno;
            if (fd >= 0)
                close(fd);
            errno = e;
            return -1;
        }
        close(fd);
    }
    return 0;
}

/* A listening unix socket at the VM's path for name, made by spaced and handed to QEMU
 * (chardev fd=): the socket file is spaced's, in spaced's directory. -1 with errno. */
static int listen_at(const struct vm *vm, const char *name)
{
    struct sockaddr_un sa = {.sun_family = AF_UNIX};
    char p[PATH_MAX + 16];
    sp_qemu__vm_path(vm, name, p, sizeof p);
    if (strlen(p) >= sizeof sa.sun_path) {
        errno = ENAMETOOLONG;
        return -1;
    }
    memcpy(sa.sun_path, p, strlen(p) + 1);
    unlink(p);
    int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0)
        return -1;
    if (bind(fd, (struct sockaddr *)&sa, sizeof sa) < 0 || chmod(p, 0600) < 0 ||
        listen(fd, 8) < 0) {
        int e = errno;
        close(fd);
        errno = e;
        return -1;
    }
    return fd;
}

static pid_t jail_spawn(struct vm *vm, char *const argv[], const char *log_path,
                        const sp_cgroup_join_t *cg, int *pidfd, sp_err_t *err);

pid_t sp_qemu__confine_spawn(struct vm *vm, char *const argv[], const char *log_path,
                             const sp_cgroup_join_t *cg, int *pidfd, sp_err_t *err)
{
    sp_qemu_t *d = vm->d;
    struct timespec t0, t1;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    pid_t pid;
    if (d->jail) {
        pid = jail_spawn(vm, argv, log_path, cg, pidfd, err);
    } else {
        struct spawn_opts so = {
            .out_path = log_path, .stdin_fd = -1, .cg = cg, .sandbox = vm->id, .new_session = true};
        pid = sp_qemu__spawn(argv, &so, pidfd, err);
    }
    clock_gettime(CLOCK_MONOTONIC, &t1);
    /* spawn_us: jailed, plan + clone + namespaces + mounts + pivot + drop, up to exec;
     * unjailed, fork (bench/jail_bench.py compares them) */
    if (pid > 0)
        sp_log(SP_LOG_DEBUG, "qemu", "qemu spawned sandbox=%s pid=%d jail=%d uid=%u spawn_us=%lld",
               vm->id, (int)pid, (int)d->jail, (unsigned)vm->jail_uid,
               (long long)(t1.tv_sec - t0.tv_sec) * 1000000 + (t1.tv_nsec - t0.tv_nsec) / 1000);
    return pid;
}

static pid_t jail_spawn(struct vm *vm, char *const argv[], const char *log_path,
                        const sp_cgroup_join_t *cg, int *pidfd, sp_err_t *err)
{
    sp_qemu_t *d = vm->d;
    if (!d->jail_userns && vm->jail_uid == 0 && sp_jail_ids_take(d->jail_ids, &vm->jail_uid) < 0) {
        vm->jail_uid = 0;
        sp_log(SP_LOG_ERROR, "qemu", "no free uid in the jail range sandbox=%s in_use=%u", vm->id,
               sp_jail_ids_used(d->jail_ids));
        sp_err_set(err, SP_ERUNTIME, "no free uid for the VM (--jail-uid-range is exhausted)");
        return -1;
    }
    /* where a jailed spawn's time goes (debug log below): t[0] start, t[1] VM dir prepared,
     * t[2] planned, t[3] sockets bound, t[4] the child exec'd */
    struct timespec t[5];
    clock_gettime(CLOCK_MONOTONIC, &t[0]);
    /* not root: spaced's own ids, the only ones its user namespaces have (none held) */
    uid_t uid = d->jail_userns ? geteuid() : vm->jail_uid;
    gid_t gid = d->jail_userns ? getegid() : vm->jail_uid;
    sp_jail_t *j = sp_jail_new(d->jail_stage, uid, gid);
    int memfd = -1, qmp_fd = -1, agent_fd = -1;
    size_t argc = 0;
    while (argv[argc] != NULL)
        argc++;
    char **av = calloc(argc + 3, sizeof(*av));
    char qmpdev[64], agentdev[64];
    bool ok = j != NULL && av != NULL && prepare_vm_dir(vm, uid, gid) == 0;
    clock_gettime(CLOCK_MONOTONIC, &t[1]);
    ok = ok && plan_vm(vm, j, &memfd) == 0;
    clock_gettime(CLOCK_MONOTONIC, &t[2]);
    if (!ok || (qmp_fd = listen_at(vm, "qmp.sock")) < 0 ||
        (agent_fd = listen_at(vm, "agent.sock")) < 0) {
        sp_log(SP_LOG_ERROR, "qemu", "cannot prepare the jail sandbox=%s err=%s", vm->id,
               strerror(errno));
        sp_jail_free(j);
        free(av);
        if (qmp_fd >= 0)
            close(qmp_fd);
        sp_err_set(err, SP_ERUNTIME, "cannot prepare the VM's jail");
        return -1;
    }
    /* QMP and the agent's chardev listen on the sockets spaced made (see listen_at) */
    sp_qemu__sfmt(qmpdev, sizeof qmpdev, "socket,id=qmp0,fd=%d,server=on,wait=off",
                  sp_jail_pass_fd(j, qmp_fd));
    sp_qemu__sfmt(agentdev, sizeof agentdev, "socket,id=agent,fd=%d,server=on,wait=off",
                  sp_jail_pass_fd(j, agent_fd));
    char memobj[128] = "";
    if (memfd >= 0) /* the same backend, private, on the sealed copy */
        sp_qemu__sfmt(memobj, sizeof memobj,
                      "memory-backend-file,id=mem,size=%dM,mem-path=/proc/self/fd/%d,share=off",
                      vm->memory_mb, sp_jail_pass_fd(j, memfd));
    size_t k = 0;
    for (size_t i = 0; i < argc; i++) {
        if (strcmp(argv[i], "-qmp") == 0 && i + 1 < argc) {
            av[k++] = "-chardev";
            av[k++] = qmpdev;
            av[k++] = "-mon";
            av[k++] = "chardev=qmp0,mode=control";
            i++;
        } else if (strncmp(argv[i], "socket,id=agent,", 16) == 0) {
            av[k++] = agentdev;
        } else if (memobj[0] != '\0' && strncmp(argv[i], "memory-backend-file,", 20) == 0) {
            av[k++] = memobj;
        } else {
            av[k++] = argv[i];
        }
    }
    av[k] = NULL;
    if (vm->disk_total > 0) /* no file of a VM grows past its disk, its RAM, and slack */
        sp_jail_set_fsize(j, vm->disk_total + ((uint64_t)vm->memory_mb << 20) + (1ull << 30));
    int out = open(log_path, O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644);
    int in = open("/dev/null", O_RDONLY | O_CLOEXEC);
    char why[256] = "";
    pid_t pid = -1;
    clock_gettime(CLOCK_MONOTONIC, &t[3]);
    if (out >= 0 && in >= 0)
        pid = sp_jail_spawn(j, av, NULL, in, out, cg, pidfd, why, sizeof why);
    else
        sp_qemu__sfmt(why, sizeof why, "stdio: %s", strerror(errno));
    clock_gettime(CLOCK_MONOTONIC, &t[4]);
    long long us[4];
    for (int i = 0; i < 4; i++)
        us[i] = (long long)(t[i + 1].tv_sec - t[i].tv_sec) * 1000000 +
                (t[i + 1].tv_nsec - t[i].tv_nsec) / 1000;
    sp_log(SP_LOG_DEBUG, "qemu",
           "jail steps sandbox=%s prepare_us=%lld plan_us=%lld sockets_us=%lld spawn_us=%lld",
           vm->id, us[0], us[1], us[2], us[3]);
    if (out >= 0)
        close(out);
    if (in >= 0)
        close(in);
    close(qmp_fd); /* QEMU holds them now; once it is gone, connecting is refused */
    close(agent_fd);
    free(av);
    sp_jail_free(j);
    if (pid < 0) {
        sp_log(SP_LOG_ERROR, "qemu", "jailed qemu not started sandbox=%s uid=%u step=\"%s\"",
               vm->id, (unsigned)uid, why);
        sp_err_set(err, SP_ERUNTIME, "cannot start the VM in its jail");
        return -1;
    }
    return pid;
}

void sp_qemu__confine_adopted(struct vm *vm)
{
    sp_qemu_t *d = vm->d;
    if (!d->jail || d->jail_userns) /* not root: no uid of its own to claim */
        return;
    char p[64], buf[2048];
    sp_qemu__sfmt(p, sizeof p, "/proc/%d/status", (int)vm->pid);
    if (sp_qemu__read_small(p, buf, sizeof buf) <= 0)
        return;
    const char *u = strstr(buf, "\nUid:");
    unsigned long uid = u != NULL ? strtoul(u + 5, NULL, 10) : 0;
    if (uid != 0 && sp_jail_ids_claim(d->jail_ids, (uid_t)uid) == 0)
        vm->jail_uid = (uid_t)uid;
    else if (uid == 0)
        sp_log(SP_LOG_WARN, "qemu", "re-adopted vm runs unjailed (started so) sandbox=%s", vm->id);
}

void sp_qemu__confine_release(struct vm *vm)
{
    if (vm->jail_uid != 0)
        sp_jail_ids_put(vm->d->jail_ids, vm->jail_uid);
    vm->jail_uid = 0;
}
