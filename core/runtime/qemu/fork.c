/*
 * fork.c - sandbox snapshots (driver.h: checkpoint): a live VM's memory with its processes,
 * device state and disk, written once and booted from any number of times ("forks").
 *
 * Each lives in <data-dir>/snapshots/<snapshot-id>/:
 *
 *   disk.qcow2              a copy of the VM's overlay at the moment of the snapshot (mode
 *                           0444), backing onto what the VM's overlay backed onto: the
 *                           template snapshot's frozen overlay, or another sandbox snapshot's
 *                           disk for a fork of a fork
 *   snapshot/devstate       the migration stream, RAM included: for a clone only the pages
 *                           that differ from its template snapshot's RAM (manifest "ram":
 *                           "delta", "ram_base"), else all of it ("stream")
 *   snapshot/manifest.json  as a suspend writes it (qemu.h), with sizes and checksums
 *   vm.json                 the VM's, naming the template snapshot whose RAM the delta is
 *                           over ("ram_src"), plus "source" (the sandbox) and "snapshot",
 *                           how long the vCPUs stopped ("pause_ms") and how the RAM
 *                           was copied ("ram_copy")
 *   deleted                 present once checkpoint_delete was asked: the directory goes as
 *                           soon as nothing is made from it (snaps_gc)
 *
 * Taking one runs the suspend steps of snapshot.c into <snapshots>/.tmp-<id>-<pid>/ with
 * the VM kept (vm->fork): stop, migrate the whole RAM (through the delta filter for a
 * clone), copy the overlay while the vCPUs are still stopped (its clusters are QEMU's
 * flushed writes), cont, and only then flush and checksum the copy, write the manifest and
 * rename the directory into place. The vCPUs stop for the migration and the copy; what
 * the disk flush and checksums take, the VM runs through. A clone's RAM (and, under KVM,
 * any VM's) is copied while the vCPUs still run (pre-copy), so they stop only for its last
 * pages and the disk copy; for a clone those last pages are every page the kernel copied
 * for its private map of the template's RAM, read from QEMU's memory (q_checkpoint).
 *
 * Booting from one lays out the new VM's directory as a suspended sandbox of its own (vm.json,
 * a fresh overlay over the snapshot's disk, the device state hard-linked, the manifest
 * without the disk's size and checksum: that disk is new) and wakes it through the restore
 * path (snapshot.c): the template's RAM mapped privately with the delta loaded over it, or
 * the stream loaded into RAM of its own, then IDENTITY with the new sandbox's id, hostname,
 * env, RNG seed and clock. The restore removes its hard link once the vCPUs run; the
 * snapshot itself is only read.
 *
 * What a snapshot's files are needed by, and so kept for: every VM whose overlay's backing
 * chain goes through its disk (forks, running or suspended), and every other snapshot whose
 * disk's chain does (a snapshot of a fork). A snapshot's RAM base, the template snapshot,
 * is kept by tsnap.c's collection, which counts snapshots among its users (snaps_refs).
 *
 * A template snapshot builder can also start from one (sp_qemu__fork_seed): the builder VM's
 * snapshot with its whole RAM, over a new overlay on the image exported from that VM's disk.
 *
 * For every worker (driver.h: SP_CKPT_SHARED, with a shared snapshot dir): taken as above,
 * and once the directory is in place shared.c copies it to
 * <snapshot-dir>/snapshots/<snapshot-id>/, its RAM still a delta over the template RAM, which
 * is published beside it once (snapshots/.bases/); the take answers after that. A worker
 * asked to boot from a snapshot it does not have copies it in from there (shared.c, made a
 * delta over a template snapshot of its own; its disk's backing files as layer-<n>.qcow2 in
 * the directory) and from then on treats it like one taken here; checkpoint_delete removes
 * the shared copy at once (no VM uses it) and this one as above.
 *
 * Does not decide ids, owners or names (the control plane does), nor lay out suspends.
 */
#include "core/runtime/qemu/qemu_int.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "base/log.h"

#define FORK_COPY_TIMEOUT_MS 600000u /* the overlay holds what the sandbox wrote: GBs at most */
#define FORK_CHAIN_MAX       8       /* confine.c binds this many backing files into a jail */

struct fork {
    struct vm *vm;
    char sid[SP_QEMU_ID_MAX + 1];
    char tmp[PATH_MAX];
    char dest[PATH_MAX];
    struct child *cp;
    bool live;          /* the VM ran at the start: its RAM is copied while it runs */
    bool exact;         /* live, and its RAM is read from QEMU's own map at the end (src) */
    sp_migdelta_live_t src; /* exact: until the delta filter takes it (fds -1: none) */
    bool share;         /* SP_CKPT_SHARED with a shared dir: copied there too */
    bool forced;        /* live, but it did not converge: stopped by us at stop_ms */
    uint64_t mig_ms;    /* live: when the migration started */
    uint64_t stop_ms;   /* sp_qemu__mono_ms() when the vCPUs were stopped */
    uint64_t window_ms; /* how long they stayed stopped */
    uint64_t ram_ms;    /* of which the RAM and device state took (to the migration's end) */
    uint64_t disk_ms;   /* and the copy of the disk */
};

/* A live snapshot's RAM is migrated while the vCPUs run (pre-copy: QEMU sends the RAM, then
 * what was written meanwhile, and stops the vCPUs for the last pages once they fit in
 * FORK_DOWNTIME_MS); should that not converge within FORK_LIVE_MAX_MS, the vCPUs are stopped
 * and the migration finishes from the stopped VM. q_checkpoint says when. */
#define FORK_DOWNTIME_MS 30
#define FORK_LIVE_MAX_MS 3000u

bool sp_qemu__fork_valid_sid(const char *sid)
{
    return sp_qemu__valid_id(sid) && strchr(sid, '.') == NULL;
}

const char *sp_qemu__fork_tmp(const struct vm *vm)
{
    return vm->fork != NULL ? vm->fork->tmp : NULL;
}

/* The downtime limit for this VM's migration (ms): a suspend's VM is stopped throughout, so
 * one pass; a live snapshot's stops the vCPUs only for what fits in FORK_DOWNTIME_MS. */
int sp_qemu__fork_downtime(struct vm *vm)
{
    if (vm->fork == NULL || !vm->fork->live)
        return 60000;
    vm->fork->mig_ms = sp_qemu__mono_ms();
    return FORK_DOWNTIME_MS;
}

/* Polling a live snapshot's migration: true once when it ran too long, and the caller stops
 * the vCPUs. */
bool sp_qemu__fork_force_stop(struct vm *vm)
{
    struct fork *f = vm->fork;
    if (f == NULL || !f->live || f->forced || f->mig_ms == 0 ||
        sp_qemu__mono_ms() - f->mig_ms < FORK_LIVE_MAX_MS)
        return false;
    f->forced = true;
    f->stop_ms = sp_qemu__mono_ms();
    sp_log(SP_LOG_INFO, "qemu", "snapshot: RAM copy did not converge, stopping vCPUs sandbox=%s",
           vm->id);
    return true;
}

/* The migration completed; QEMU had the vCPUs stopped for downtime ms at its end. */
void sp_qemu__fork_mig_done(struct vm *vm, long long downtime)
{
    struct fork *f = vm->fork;
    if (f == NULL || !f->live || f->forced)
        return;
    uint64_t now = sp_qemu__mono_ms();
    f->stop_ms = now - (uint64_t)(downtime > 0 && (uint64_t)downtime < now ? downtime : 0);
}

static void fork_free(struct fork *f)
{
    sp_migdelta_live_close(&f->src);
    if (f->cp != NULL) {
        kill(-f->cp->pid, SIGKILL);
        kill(f->cp->pid, SIGKILL);
        waitpid(f->cp->pid, NULL, 0); /* killed: returns at once */
        sp_qemu__child_free(f->cp);
    }
    free(f);
}

/* The VM goes away, or snap_fail gave up: drop the unfinished snapshot (its caller was
 * answered, or is answered by sp_qemu__vm_finish). */
void sp_qemu__fork_abort(struct vm *vm)
{
    struct fork *f = vm->fork;
    if (f == NULL)
        return;
    vm->fork = NULL;
    vm->snap_step = SN_NONE;
    sp_qemu__discard(vm->d, f->tmp);
    sp_log(SP_LOG_INFO, "qemu", "snapshot abandoned sandbox=%s snapshot=%s", vm->id, f->sid);
    fork_free(f);
}

bool sp_qemu__fork_exact(const struct vm *vm)
{
    return vm->fork != NULL && vm->fork->exact;
}

/* The exact snapshot's source, for its delta filter (snapshot.c), which then owns it. */
bool sp_qemu__fork_take_source(struct vm *vm, sp_migdelta_live_t *out)
{
    struct fork *f = vm->fork;
    if (f == NULL || !f->exact || f->src.mem_fd < 0)
        return false;
    *out = f->src;
    f->src.mem_fd = f->src.pagemap_fd = -1;
    return true;
}

/* Whether vm's RAM can be read exactly at the end of a pre-copy (an exact snapshot): a clone
 * whose suspend goes through the delta filter (snapshot.c: suspend_delta_start), whose QEMU
 * maps a copy of its template's RAM that is still the file's (sp_qemu__confine_ram_ident),
 * and whose memory spaced can read. Opens src. */
static bool exact_source(struct vm *vm, sp_migdelta_live_t *src)
{
    uint64_t dev, ino;
    char why[160];
    if (vm->clone_src == NULL || vm->no_delta || vm->tsnap_build != NULL || vm->pid <= 0 ||
        sp_qemu__shared_streams(vm) || sp_qemu__confine_ram_ident(vm, &dev, &ino) < 0)
        return false;
    if (sp_migdelta_live_open((int)vm->pid, dev, ino, (uint64_t)vm->memory_mb << 20, src, why,
                              sizeof why) < 0) {
        sp_log(SP_LOG_INFO, "qemu", "snapshot: RAM not readable from QEMU sandbox=%s why=\"%s\"",
               vm->id, why);
        return false;
    }
    return true;
}

static void fork_fail(struct vm *vm, const char *what, const char *detail)
{
    sp_qemu__snap_fail(vm, what, detail); /* answers the caller, drops the dir, conts */
}

static void on_fork_cont(void *arg, json_t *ret, const sp_err_t *err)
{
    struct vm *vm = arg;
    (void)ret;
    if (vm->fork == NULL)
        return;
    if (err != NULL) {
        fork_fail(vm, "cannot restart the VM's vCPUs", err->msg);
        return;
    }
    vm->fork->window_ms = sp_qemu__mono_ms() - vm->fork->stop_ms;
    sp_qemu__snap_sync(vm); /* flush and checksum while the VM runs */
}

static void on_copy_exit(struct child *c, int st, bool timed_out, void *arg)
{
    struct vm *vm = arg;
    struct fork *f = vm->fork;
    sp_qemu__child_free(c);
    if (f == NULL)
        return;
    f->cp = NULL;
    f->disk_ms = sp_qemu__mono_ms() - f->stop_ms - f->ram_ms;
    char disk[PATH_MAX + 16];
    sp_qemu__sfmt(disk, sizeof disk, "%s/disk.qcow2", f->tmp);
    if (timed_out || st == -1 || !WIFEXITED(st) || WEXITSTATUS(st) != 0) {
        fork_fail(vm, "cannot copy the disk", timed_out ? "timed out" : "cp failed");
        return;
    }
    if (chmod(disk, 0444) < 0) {
        fork_fail(vm, "cannot copy the disk", strerror(errno));
        return;
    }
    if (vm->snap_was_paused) {
        /* It stays stopped, as it was (QEMU in postmigrate: resume's cont starts it). */
        f->window_ms = sp_qemu__mono_ms() - f->stop_ms;
        sp_qemu__snap_sync(vm);
        return;
    }
    sp_err_t e;
    if (vm->qmp == NULL ||
        sp_qmp_command(vm->qmp, "cont", NULL, -1, on_fork_cont, vm, &e) < 0)
        fork_fail(vm, "cannot restart the VM's vCPUs", "VM control channel failed");
}

/* The migration is through (snapshot.c): the device state with the RAM is written. The disk
 * is copied now, while the vCPUs are still stopped. */
void sp_qemu__fork_migrated(struct vm *vm)
{
    struct fork *f = vm->fork;
    char disk[PATH_MAX + 16], dest[PATH_MAX + 16], log[PATH_MAX + 16];
    f->ram_ms = sp_qemu__mono_ms() - f->stop_ms;
    sp_qemu__vm_path(vm, "disk.qcow2", disk, sizeof disk);
    sp_qemu__vm_path(vm, "qemu.log", log, sizeof log);
    sp_qemu__sfmt(dest, sizeof dest, "%s/disk.qcow2", f->tmp);
    char *argv[] = {"cp", "--sparse=always", "--", disk, dest, NULL};
    struct spawn_opts so = {.out_path = log, .stdin_fd = -1, .cg = NULL, .sandbox = vm->id};
    sp_err_t e;
    f->cp = sp_qemu__child_start(vm->d, argv, &so, FORK_COPY_TIMEOUT_MS, on_copy_exit, vm, &e);
    if (f->cp == NULL)
        fork_fail(vm, "cannot copy the disk", e.msg);
}

/* snapshot.c committed the manifest in the temporary directory: add vm.json, make it all
 * durable and put the directory in place. */
void sp_qemu__fork_committed(struct vm *vm)
{
    struct fork *f = vm->fork;
    sp_qemu_t *d = vm->d;
    char p[PATH_MAX + 16], man[PATH_MAX + 40];
    sp_qemu__vm_path(vm, "vm.json", p, sizeof p);
    json_t *o = json_load_file(p, 0, NULL);
    sp_qemu__sfmt(man, sizeof man, "%s/snapshot/manifest.json", f->tmp);
    json_t *m = json_load_file(man, 0, NULL);
    char ram[16];
    sp_qemu__sfmt(ram, sizeof ram, "%s", json_string_value(json_object_get(m, "ram")) ?: "?");
    bool delta = strcmp(ram, "delta") == 0;
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    char *js = NULL;
    if (o != NULL) {
        if (delta && vm->clone_src != NULL)
            json_object_set_new(o, "ram_src", json_string(vm->clone_src));
        else
            json_object_del(o, "ram_src");
        json_object_set_new(o, "source", json_string(vm->id));
        json_object_set_new(o, "snapshot", json_string(f->sid));
        json_object_set_new(o, "pause_ms", json_integer((json_int_t)f->window_ms));
        /* how the RAM was copied: "exact" (live, read from QEMU's map at the end), "live"
         * (QEMU's pages, KVM), "stopped" (the vCPUs stopped throughout) */
        json_object_set_new(o, "ram_copy",
                            json_string(f->exact  ? "exact"
                                        : f->live ? "live"
                                                  : "stopped"));
        json_object_set_new(o, "created_at", json_integer((json_int_t)ts.tv_sec));
        js = json_dumps(o, JSON_COMPACT);
    }
    json_decref(o);
    json_decref(m);
    sp_qemu__sfmt(p, sizeof p, "%s/vm.json", f->tmp);
    char sdir[PATH_MAX + 16];
    sp_qemu__sfmt(sdir, sizeof sdir, "%s/snapshot", f->tmp);
    bool ok = js != NULL && sp_qemu__write_atomic(p, js, strlen(js)) == 0 &&
              sp_qemu__fsync_path(sdir, O_RDONLY | O_DIRECTORY) == 0 &&
              sp_qemu__fsync_path(f->tmp, O_RDONLY | O_DIRECTORY) == 0;
    free(js);
    if (!ok || rename(f->tmp, f->dest) < 0) {
        int en = errno;
        fork_fail(vm, "cannot put the snapshot in place", strerror(en));
        return;
    }
    sp_qemu__fsync_path(d->snaps_dir, O_RDONLY | O_DIRECTORY);
    sp_log(SP_LOG_INFO, "qemu",
           "sandbox snapshot taken sandbox=%s snapshot=%s ram=%s pause_ms=%llu (ram_ms=%llu "
           "disk_ms=%llu) ms=%llu",
           vm->id, f->sid, ram, (unsigned long long)f->window_ms, (unsigned long long)f->ram_ms,
           (unsigned long long)f->disk_ms,
           (unsigned long long)(sp_qemu__mono_ms() - vm->snap_start_ms));
    vm->fork = NULL;
    vm->snap_step = SN_NONE;
    bool share = f->share;
    char sid[sizeof f->sid];
    memcpy(sid, f->sid, sizeof sid);
    fork_free(f);
    if (!share) {
        sp_qemu__complete_all(d, &vm->snap_w, NULL);
        return;
    }
    struct waiter *w = vm->snap_w; /* answered once the shared copy is written */
    vm->snap_w = NULL;
    sp_qemu__shared_snap_put(d, sid, vm, w);
}

/* How many backing files the qcow2 image path has below it. */
static int chain_len(const char *path)
{
    char cur[PATH_MAX], next[PATH_MAX];
    sp_qemu__sfmt(cur, sizeof cur, "%s", path);
    int k = 0;
    while (k < 64 && sp_qemu__qcow2_backing(cur, next, sizeof next)) {
        memcpy(cur, next, sizeof cur);
        k++;
    }
    return k;
}

int sp_qemu__q_checkpoint(sp_driver_t *base, const char *id, const char *snapshot_id,
                          unsigned flags, sp_driver_cb cb, void *arg, sp_err_t *err)
{
    sp_qemu_t *d = (sp_qemu_t *)base;
    if (!sp_qemu__fork_valid_sid(snapshot_id))
        return sp_err_set(err, SP_EINVAL, "invalid snapshot id");
    if (d->no_adopt)
        return sp_err_set(err, SP_ECONFLICT, "this driver only builds template snapshots");
    struct vm *vm = sp_qemu__running_vm(d, id, err);
    if (vm == NULL)
        return -1;
    if (vm->export != NULL)
        return sp_err_set(err, SP_ECONFLICT, "the sandbox's disk is being exported");
    if (vm->qmp == NULL || vm->agent == NULL)
        return sp_err_set(err, SP_ECONFLICT, "sandbox is still booting");
    char disk[PATH_MAX + 16];
    sp_qemu__vm_path(vm, "disk.qcow2", disk, sizeof disk);
    int depth = chain_len(disk);
    if (depth + 1 > FORK_CHAIN_MAX)
        return sp_err_set(err, SP_ECONFLICT,
                          "this sandbox descends from %d generations of snapshots and images, "
                          "the most a snapshot can be taken of is %d",
                          depth - 1, FORK_CHAIN_MAX - 2);
    struct fork *f = calloc(1, sizeof(*f));
    if (f == NULL)
        return sp_err_set(err, SP_EINTERNAL, "out of memory");
    f->vm = vm;
    f->src.mem_fd = f->src.pagemap_fd = -1;
    f->share = (flags & SP_CKPT_SHARED) != 0 && d->shared_dir[0] != '\0';
    sp_qemu__sfmt(f->sid, sizeof f->sid, "%s", snapshot_id);
    sp_qemu__sfmt(f->dest, sizeof f->dest, "%s/%s", d->snaps_dir, snapshot_id);
    sp_qemu__sfmt(f->tmp, sizeof f->tmp, "%s/.tmp-%s-%d", d->snaps_dir, snapshot_id,
                  (int)getpid());
    struct stat st;
    char sdir[PATH_MAX + 16];
    sp_qemu__sfmt(sdir, sizeof sdir, "%s/snapshot", f->tmp);
    if (lstat(f->dest, &st) == 0 || sp_qemu__shared_snap_committed(d, snapshot_id, NULL, 0)) {
        free(f);
        return sp_err_set(err, SP_ECONFLICT, "snapshot %s exists", snapshot_id);
    }
    /* 0711 and 0755: a fork's jailed QEMU reads the disk through a bind mount of the file */
    sp_qemu__discard(d, f->tmp);
    if ((mkdir(d->snaps_dir, 0711) < 0 && errno != EEXIST) || mkdir(f->tmp, 0755) < 0 ||
        mkdir(sdir, 0755) < 0) {
        int en = errno;
        sp_qemu__discard(d, f->tmp);
        free(f);
        return sp_err_set(err, SP_ERUNTIME, "cannot create the snapshot directory: %s",
                          strerror(en));
    }
    if (sp_qemu__add_waiter(&vm->snap_w, cb, arg, err) < 0) {
        sp_qemu__discard(d, f->tmp);
        free(f);
        return -1;
    }
    vm->fork = f;
    vm->snap_was_paused = vm->paused;
    vm->snap_start_ms = sp_qemu__mono_ms();
    f->stop_ms = vm->snap_start_ms;
    /* Live (pre-copy) when the RAM the snapshot keeps does not depend on QEMU's dirty
     * tracking, or that tracking is the kernel's:
     * - exact: a clone's RAM is a private map of the template's file, so the pages it wrote
     *   are exactly those the kernel copied for it. Its delta filter drops every page QEMU
     *   sends and, once QEMU has stopped the vCPUs, reads those pages from QEMU's memory
     *   (migdelta.h: sp_migdelta_filter_live). Under TCG too.
     * - under KVM, whose dirty logging the kernel does: QEMU's pages as they come.
     * Under TCG (QEMU 7.2) forks of live snapshots that kept QEMU's pages, taken on a loaded
     * host, came up with corrupted kernel memory (a panic in an interrupt, the same for every
     * fork of that snapshot), while stop-first snapshots of the same VM were sound: a guest
     * write missed by TCG's dirty tracking fits. So elsewhere TCG stops the vCPUs for the
     * whole copy, as a suspend does. SPACE_SNAPSHOT_LIVE=0: never live. */
    const char *lv = getenv("SPACE_SNAPSHOT_LIVE");
    bool run = !vm->paused && !(lv != NULL && strcmp(lv, "0") == 0);
    f->exact = run && exact_source(vm, &f->src);
    f->live = run && (f->exact || d->accel == 1);
    vm->snap_step = SN_STOP;
    sp_log(SP_LOG_INFO, "qemu",
           "taking a snapshot sandbox=%s snapshot=%s live=%d exact=%d shared=%d", vm->id,
           snapshot_id, (int)f->live, (int)f->exact, (int)f->share);
    /* the suspend steps from their first: a live one does not stop the vCPUs there */
    sp_qemu__snap_send(vm, f->live ? "query-status" : "stop", NULL, -1);
    return 0;
}

/* The committed snapshot's directory, or false with err set (not found, deleted). */
static bool snap_dir(sp_qemu_t *d, const char *sid, char *out, size_t n, sp_err_t *err)
{
    if (!sp_qemu__fork_valid_sid(sid)) {
        sp_err_set(err, SP_EINVAL, "invalid snapshot id");
        return false;
    }
    char p[PATH_MAX + 40];
    sp_qemu__sfmt(out, n, "%s/%s", d->snaps_dir, sid);
    sp_qemu__sfmt(p, sizeof p, "%s/deleted", out);
    bool deleted = sp_qemu__file_exists(p);
    sp_qemu__sfmt(p, sizeof p, "%s/snapshot/manifest.json", out);
    if (deleted || !sp_qemu__file_exists(p)) {
        sp_err_set(err, SP_ENOTFOUND, "snapshot %s does not exist on this host", sid);
        return false;
    }
    return true;
}

int sp_qemu__q_checkpoint_exists(sp_driver_t *base, const char *snapshot_id)
{
    char dir[PATH_MAX];
    sp_err_t e;
    return snap_dir((sp_qemu_t *)base, snapshot_id, dir, sizeof dir, &e) ? 1 : 0;
}

int sp_qemu__q_checkpoint_shared(sp_driver_t *base, const char *snapshot_id)
{
    return sp_qemu__shared_snap_committed((sp_qemu_t *)base, snapshot_id, NULL, 0) ? 1 : 0;
}

int sp_qemu__q_checkpoint_list(sp_driver_t *base, const char *prefix,
                               void (*fn)(const char *snapshot_id, long long committed_s,
                                          void *arg),
                               void *arg, sp_err_t *err)
{
    sp_qemu_t *d = (sp_qemu_t *)base;
    DIR *dir = opendir(d->snaps_dir);
    if (dir == NULL) {
        if (errno != ENOENT)
            return sp_err_set(err, SP_ERUNTIME, "cannot list the snapshots: %s", strerror(errno));
        sp_qemu__shared_snap_list(d, prefix, fn, arg);
        return 0;
    }
    size_t pl = strlen(prefix);
    struct dirent *de;
    while ((de = readdir(dir)) != NULL) {
        char sd[PATH_MAX], p[PATH_MAX + 40];
        sp_err_t e;
        struct stat st;
        if (strncmp(de->d_name, prefix, pl) != 0 || !snap_dir(d, de->d_name, sd, sizeof sd, &e))
            continue; /* not ours, a temporary directory, uncommitted or deleted */
        /* the manifest is written once, last, when the snapshot commits */
        sp_qemu__sfmt(p, sizeof p, "%s/snapshot/manifest.json", sd);
        if (stat(p, &st) == 0)
            fn(de->d_name, (long long)st.st_mtime, arg);
    }
    closedir(dir);
    sp_qemu__shared_snap_list(d, prefix, fn, arg);
    return 0;
}

int sp_qemu__q_checkpoint_delete(sp_driver_t *base, const char *snapshot_id, sp_err_t *err)
{
    sp_qemu_t *d = (sp_qemu_t *)base;
    if (!sp_qemu__fork_valid_sid(snapshot_id))
        return sp_err_set(err, SP_EINVAL, "invalid snapshot id");
    char dir[PATH_MAX], p[PATH_MAX + 16];
    struct stat st;
    sp_qemu__shared_snap_forget(d, snapshot_id); /* nothing uses it: boots use copies */
    sp_qemu__sfmt(dir, sizeof dir, "%s/%s", d->snaps_dir, snapshot_id);
    if (lstat(dir, &st) < 0)
        return 0;
    sp_qemu__sfmt(p, sizeof p, "%s/deleted", dir);
    if (sp_qemu__write_atomic(p, "", 0) < 0)
        return sp_err_set(err, SP_ERUNTIME, "cannot mark the snapshot deleted: %s",
                          strerror(errno));
    d->snaps_pending = true;
    sp_qemu__pool_forget_fork(d, snapshot_id); /* spares hold its disk: they go first */
    sp_qemu__snaps_gc(d, false);
    return 0;
}

/* Adds the blocks allocated to the files under dir (and one level of directories below). */
static uint64_t dir_bytes(const char *dir, int depth)
{
    DIR *dh = opendir(dir);
    if (dh == NULL)
        return 0;
    uint64_t n = 0;
    struct dirent *de;
    while ((de = readdir(dh)) != NULL) {
        char p[PATH_MAX];
        struct stat st;
        if (strcmp(de->d_name, ".") == 0 || strcmp(de->d_name, "..") == 0)
            continue;
        sp_qemu__sfmt(p, sizeof p, "%s/%s", dir, de->d_name);
        if (lstat(p, &st) < 0)
            continue;
        if (S_ISDIR(st.st_mode) && depth > 0)
            n += dir_bytes(p, depth - 1);
        else if (S_ISREG(st.st_mode))
            n += (uint64_t)st.st_blocks * 512u;
    }
    closedir(dh);
    return n;
}

uint64_t sp_qemu__q_checkpoint_bytes(sp_driver_t *base, const char *snapshot_id)
{
    char dir[PATH_MAX];
    sp_err_t e;
    if (!snap_dir((sp_qemu_t *)base, snapshot_id, dir, sizeof dir, &e))
        return 0;
    uint64_t n = dir_bytes(dir, 1); /* disk.qcow2, vm.json, snapshot/{devstate,manifest.json} */
    char shared[PATH_MAX + 96];
    if (sp_qemu__shared_snap_committed((sp_qemu_t *)base, snapshot_id, shared, sizeof shared))
        n += dir_bytes(shared, 1); /* and its copy for every worker */
    return n;
}

/* Copies src (a JSON file) to dst without the keys in drop[] (NULL-terminated). */
static int copy_json(const char *src, const char *dst, const char *const drop[])
{
    json_t *o = json_load_file(src, 0, NULL);
    if (!json_is_object(o)) {
        json_decref(o);
        errno = EINVAL;
        return -1;
    }
    for (int i = 0; drop != NULL && drop[i] != NULL; i++)
        json_object_del(o, drop[i]);
    char *js = json_dumps(o, JSON_COMPACT);
    json_decref(o);
    int rc = js != NULL ? sp_qemu__write_atomic(dst, js, strlen(js)) : -1;
    free(js);
    return rc;
}

/* Lays out vdir as a suspended sandbox made from the committed snapshot in sdir: vm.json, a
 * new overlay over its disk, its device state linked, the manifest last (without the disk's
 * size and checksum: that disk is new). 0, or -1 with *step and errno; vdir is then gone. */
static int fork_layout(const sp_qemu_t *d, const char *sdir, const char *vdir, const char **step)
{
    char a[PATH_MAX + 40], b[PATH_MAX + 40];
    sp_qemu__discard(d, vdir); /* leftovers of a failed boot; q_boot checked nothing runs there */
    *step = "cannot create the VM directory";
    bool ok = (mkdir(d->vms_dir, 0700) == 0 || errno == EEXIST) && mkdir(vdir, 0700) == 0;
    if (ok) {
        sp_qemu__sfmt(a, sizeof a, "%s/snapshot", vdir);
        ok = mkdir(a, 0700) == 0;
    }
    if (ok) {
        *step = "cannot write vm.json";
        sp_qemu__sfmt(a, sizeof a, "%s/vm.json", sdir);
        sp_qemu__sfmt(b, sizeof b, "%s/vm.json", vdir);
        static const char *const drop[] = {"source", "pause_ms", "created_at", NULL};
        ok = copy_json(a, b, drop) == 0;
    }
    if (ok) {
        *step = "cannot write the disk overlay";
        sp_qemu__sfmt(a, sizeof a, "%s/disk.qcow2", sdir);
        sp_qemu__sfmt(b, sizeof b, "%s/disk.qcow2", vdir);
        ok = sp_qemu__write_overlay(b, a) == 0;
    }
    if (ok) {
        *step = "cannot link the device state";
        sp_qemu__sfmt(a, sizeof a, "%s/snapshot/devstate", sdir);
        sp_qemu__sfmt(b, sizeof b, "%s/snapshot/devstate", vdir);
        ok = link(a, b) == 0;
    }
    if (ok) {
        /* last: its presence makes the directory a suspended sandbox (a crash from here on
         * is woken like one; before, the boot starts over) */
        *step = "cannot write the snapshot manifest";
        sp_qemu__sfmt(a, sizeof a, "%s/snapshot/manifest.json", sdir);
        sp_qemu__sfmt(b, sizeof b, "%s/snapshot/manifest.json", vdir);
        static const char *const drop[] = {"disk_bytes", "disk_checksum", NULL};
        ok = copy_json(a, b, drop) == 0;
    }
    if (!ok) {
        int en = errno;
        sp_qemu__discard(d, vdir);
        errno = en;
        return -1;
    }
    return 0;
}

void sp_qemu__fork_pool_key(const char *sid, char key[17])
{
    uint64_t h = sp_qemu__fnv1a(sp_qemu__fnv1a(SP_QEMU_FNV_BASIS, "fork"), sid);
    sp_qemu__sfmt(key, 17, "%016llx", (unsigned long long)h);
}

int sp_qemu__fork_spare_start(struct vm *vm, const char *sid)
{
    sp_err_t e;
    char sdir[PATH_MAX];
    const char *step = NULL;
    if (!snap_dir(vm->d, sid, sdir, sizeof sdir, &e)) {
        step = e.msg;
    } else if (fork_layout(vm->d, sdir, vm->dir, &step) < 0) {
        sp_err_set(&e, SP_ERUNTIME, "%s: %s", step, strerror(errno));
        step = e.msg;
    } else if (sp_qemu__restore_fill(vm, &e) < 0) {
        step = e.msg;
    } else {
        return 0;
    }
    sp_log(SP_LOG_INFO, "qemu", "spare fork not made spare=%s snapshot=%s reason=\"%s\"", vm->id,
           sid, step);
    sp_qemu__discard(vm->d, vm->dir);
    return -1;
}

int sp_qemu__fork_boot(sp_qemu_t *d, const sp_vm_spec_t *spec, sp_driver_cb cb, void *arg,
                       sp_err_t *err)
{
    char sdir[PATH_MAX];
    struct stat st;
    if (!snap_dir(d, spec->snapshot_id, sdir, sizeof sdir, err)) {
        /* not here at all (not even deleted): in the shared dir, it is copied in first */
        if (err->code == SP_ENOTFOUND && lstat(sdir, &st) < 0 && errno == ENOENT &&
            (sp_qemu__shared_snap_fetching(d, spec->snapshot_id) ||
             sp_qemu__shared_snap_committed(d, spec->snapshot_id, NULL, 0)))
            return sp_qemu__shared_snap_fetch(d, spec, cb, arg, err);
        return -1;
    }
    char vdir[PATH_MAX];
    sp_qemu__sfmt(vdir, sizeof vdir, "%s/%s", d->vms_dir, spec->sandbox_id);
    const char *step;
    if (fork_layout(d, sdir, vdir, &step) < 0) {
        int en = errno;
        sp_log(SP_LOG_WARN, "qemu", "boot from snapshot failed sandbox=%s snapshot=%s %s: %s",
               spec->sandbox_id, spec->snapshot_id, step, strerror(en));
        return sp_err_set(err, SP_ERUNTIME, "%s for the sandbox", step);
    }
    sp_log(SP_LOG_INFO, "qemu", "booting from a snapshot sandbox=%s snapshot=%s",
           spec->sandbox_id, spec->snapshot_id);
    if (sp_qemu__q_restore(&d->base, spec, cb, arg, err) < 0) {
        sp_qemu__discard(d, vdir);
        return -1;
    }
    return 0;
}

int sp_qemu__fork_seed(struct vm *b, const char *sid)
{
    sp_qemu_t *d = b->d;
    sp_err_t e;
    char sdir[PATH_MAX], a[PATH_MAX + 40], c[PATH_MAX + 40];
    const char *step = NULL;
    int en = 0; /* errno of a failed call */
    if (!snap_dir(d, sid, sdir, sizeof sdir, &e))
        step = e.msg;
    json_t *man = NULL;
    if (step == NULL) {
        sp_qemu__sfmt(a, sizeof a, "%s/snapshot/manifest.json", sdir);
        man = json_load_file(a, 0, NULL);
        const char *ram = json_string_value(json_object_get(man, "ram"));
        const char *accel = json_string_value(json_object_get(man, "accel"));
        if (ram == NULL || strcmp(ram, "stream") != 0)
            step = "its RAM is not all in its device state";
        else if (json_integer_value(json_object_get(man, "memory_mb")) != b->memory_mb ||
                 json_integer_value(json_object_get(man, "cpu_count")) != b->cpu_count)
            step = "it is of another size";
        else if (accel == NULL || strcmp(accel, d->accel == 1 ? "kvm" : "tcg") != 0)
            step = "it was taken under another accelerator";
    }
    json_decref(man);
    sp_qemu__discard(d, b->dir); /* a failed build's leftovers (tsnap_clean_tmp killed its QEMU) */
    if (step == NULL && (mkdir(b->dir, 0700) < 0 ||
                         (sp_qemu__sfmt(a, sizeof a, "%s/snapshot", b->dir), mkdir(a, 0700)) < 0))
        step = "cannot create the directory", en = errno;
    if (step == NULL && sp_qemu__write_vm_json(b) < 0)
        step = "cannot write vm.json", en = errno;
    if (step == NULL) { /* the seed's disk is the image's: the image is what was exported */
        sp_qemu__vm_path(b, "disk.qcow2", a, sizeof a);
        if (sp_qemu__write_overlay(a, b->tp->rootfs) < 0)
            step = "cannot write the overlay", en = errno;
    }
    if (step == NULL) {
        sp_qemu__sfmt(a, sizeof a, "%s/snapshot/devstate", sdir);
        sp_qemu__vm_path(b, "snapshot/devstate", c, sizeof c);
        if (link(a, c) < 0)
            step = "cannot link the device state", en = errno;
    }
    if (step != NULL) {
        sp_log(SP_LOG_WARN, "qemu",
               "template snapshot boots cold: snapshot %s cannot seed it template=%s (%s%s%s)", sid,
               b->template_name, step, en ? ": " : "", en ? strerror(en) : "");
        sp_qemu__discard(d, b->dir);
        return -1;
    }
    return 0;
}

/* What sandbox snapshots on this data dir use: their disk's backing chain and the template
 * snapshot their RAM is a delta over (for tsnap.c's collection). */
void sp_qemu__snaps_refs(sp_qemu_t *d, struct refs *r)
{
    DIR *dir = opendir(d->snaps_dir);
    if (dir == NULL) {
        if (errno != ENOENT)
            r->oom = true; /* cannot tell: nothing may go */
        return;
    }
    struct dirent *de;
    while ((de = readdir(dir)) != NULL) {
        if (strcmp(de->d_name, ".") == 0 || strcmp(de->d_name, "..") == 0)
            continue;
        char p[PATH_MAX + 80];
        sp_qemu__sfmt(p, sizeof p, "%s/%s/disk.qcow2", d->snaps_dir, de->d_name);
        sp_qemu__refs_chain(r, p, NULL);
        sp_qemu__sfmt(p, sizeof p, "%s/%s/vm.json", d->snaps_dir, de->d_name);
        json_t *o = json_load_file(p, 0, NULL);
        const char *src = json_string_value(json_object_get(o, "ram_src"));
        if (src != NULL)
            sp_qemu__refs_add(r, src);
        json_decref(o);
    }
    closedir(dir);
}

/* The disk chains of every VM dir (spares and builders too) and every snapshot. */
static bool users(sp_qemu_t *d, struct refs *r)
{
    const char *dirs[2] = {d->vms_dir, d->snaps_dir};
    bool ok = true;
    for (int i = 0; i < 2; i++) {
        DIR *dir = opendir(dirs[i]);
        if (dir == NULL) {
            ok = ok && errno == ENOENT;
            continue;
        }
        struct dirent *de;
        while ((de = readdir(dir)) != NULL) {
            if (strcmp(de->d_name, ".") == 0 || strcmp(de->d_name, "..") == 0)
                continue;
            char p[PATH_MAX + 80], own[PATH_MAX + 40];
            sp_qemu__sfmt(p, sizeof p, "%s/%s/disk.qcow2", dirs[i], de->d_name);
            sp_qemu__sfmt(own, sizeof own, "%s/%s", dirs[i], de->d_name);
            /* a snapshot copied in from the shared dir backs onto layers of its own: those
             * do not keep it */
            sp_qemu__refs_chain(r, p, i == 1 ? own : NULL);
        }
        closedir(dir);
    }
    return ok && !r->oom;
}

/* Removes the deleted snapshots nothing is made from any more, until none can go (one going
 * may free the snapshot its disk backed onto); at start also the temporary directories of
 * snapshots a dead spaced was taking. A directory listing and a header read per VM and
 * snapshot: milliseconds. */
void sp_qemu__snaps_gc(sp_qemu_t *d, bool at_start)
{
    bool pending = false;
    for (int round = 0; round < 64; round++) {
        struct refs r = {0};
        if (!users(d, &r)) {
            sp_qemu__refs_free(&r);
            sp_log(SP_LOG_WARN, "qemu", "sandbox snapshots not collected: cannot list users");
            d->snaps_pending = true;
            return;
        }
        DIR *dir = opendir(d->snaps_dir);
        if (dir == NULL) {
            sp_qemu__refs_free(&r);
            d->snaps_pending = false;
            return;
        }
        bool removed = false;
        pending = false;
        struct dirent *de;
        while ((de = readdir(dir)) != NULL) {
            if (strcmp(de->d_name, ".") == 0 || strcmp(de->d_name, "..") == 0)
                continue;
            char p[PATH_MAX + 80], sd[PATH_MAX + 40];
            sp_qemu__sfmt(sd, sizeof sd, "%s/%s", d->snaps_dir, de->d_name);
            if (de->d_name[0] == '.') {
                int pid = 0, end = 0;
                const char *dash = strrchr(de->d_name, '-');
                bool ours = dash != NULL && sscanf(dash + 1, "%d%n", &pid, &end) == 1 &&
                            dash[1 + end] == '\0';
                char proc[32];
                snprintf(proc, sizeof proc, "/proc/%d", pid);
                if (at_start && ours && pid != (int)getpid() && !sp_qemu__file_exists(proc)) {
                    sp_log(SP_LOG_INFO, "qemu", "removing an unfinished snapshot dir=%s",
                           de->d_name);
                    sp_qemu__discard(d, sd);
                }
                continue;
            }
            sp_qemu__sfmt(p, sizeof p, "%s/deleted", sd);
            if (!sp_qemu__file_exists(p))
                continue;
            if (sp_qemu__refs_has(&r, sd)) {
                pending = true;
                continue;
            }
            sp_log(SP_LOG_INFO, "qemu", "removing a deleted sandbox snapshot snapshot=%s",
                   de->d_name);
            sp_qemu__discard(d, sd);
            removed = true;
        }
        closedir(dir);
        sp_qemu__refs_free(&r);
        if (!removed)
            break;
        at_start = false;
    }
    d->snaps_pending = pending;
    if (!pending)
        sp_qemu__tsnap_gc(d); /* a template snapshot may have lost its last user */
}
