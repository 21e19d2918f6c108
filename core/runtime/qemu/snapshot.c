/*
 * snapshot.c - suspend and wake of a sandbox's own snapshot (qemu.h: snapshot/, manifest.json).
 *
 * Guest RAM lives in <vm>/mem.ram (memory-backend-file, share=on), so a
 * suspend writes only device state: stop, migrate with x-ignore-shared to a
 * passed fd, fdatasync RAM file + device state + overlay (a `sync -d` child,
 * off the loop) while a job off the loop checksums the three (sums.c), then
 * commit by an atomic rename of snapshot/manifest.json (sizes and checksums),
 * then quit QEMU. A clone's suspend streams its RAM through the delta filter
 * (sums.c) instead. Restore starts QEMU on the same RAM file with -incoming
 * defer, migrate-incoming from a passed fd, cont, and invalidates the snapshot
 * once the vCPUs run (the RAM file and the disk move on from there).
 *
 * A wake checks sizes and the device state's checksum (60 KB, inline) before it
 * starts anything: a mismatch or an unreadable manifest refuses the wake and the
 * sandbox stays suspended. The RAM file's and the disk's checksums cannot be
 * verified after the wake (the RAM file is mapped shared and the guest writes
 * it, and the disk, as soon as its vCPUs run), and verifying them first would
 * add the whole hash time to every wake. So they are verified off the loop from
 * the moment the wake is asked for, alongside QEMU's start and device state load
 * (time the wake spends anyway), and the vCPUs start only once they match
 * (RS_VERIFY): the wake waits only for what the hash takes beyond that. A
 * mismatch stops QEMU (which has written nothing: the source was stopped, so the
 * guest stays paused), keeps the snapshot and marks it corrupt. The vCPUs seldom
 * wait for the checksums: what they add to a wake is QEMU sharing the CPUs with
 * the hash threads (with one thread fewer the wait grew instead;
 * bench/lifecycle_bench.py prints figures).
 *
 * With a shared snapshot dir a suspend streams the whole RAM into the device state, and
 * the committed snapshot moves there once QEMU quit; a wake of one there copies it back in
 * first (shared.c).
 *
 * Does not compute checksums (sums.c) nor commit template snapshots (tsnap.c, which
 * reuses the suspend steps for its builder).
 */
#include "core/runtime/qemu/qemu_int.h"

#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "base/log.h"

#define DELTA_PIPE_BYTES (1 << 20) /* /proc/sys/fs/pipe-max-size's default; root may exceed it */

static void restore_loaded(struct vm *vm);
static void restore_up(struct vm *vm);
static void restore_corrupt(struct vm *vm);

/* A committed snapshot in the VM dir: snap_commit() renames snapshot/manifest.json into
 * place as its very last step, and boot_done() removes it after a restore. */
bool sp_qemu__snapshot_committed(const char *dir)
{
    char p[PATH_MAX + 32];
    sp_qemu__sfmt(p, sizeof p, "%s/snapshot/manifest.json", dir);
    return sp_qemu__file_exists(p);
}

static const char *const sum_part[SUM_N] = {"ram", "devstate", "disk"};

static const char *const sum_label[SUM_N] = {"RAM", "device state", "disk"};

/* A size the manifest records for a part: -1 when it records none (version 1 has no disk). */
static long long man_size(json_t *man, const char *key)
{
    json_t *v = json_object_get(man, key);
    return json_is_integer(v) && json_integer_value(v) >= 0 ? (long long)json_integer_value(v) : -1;
}

/* What a wake checks before it starts QEMU, all cheap: the corrupt marker, every part's
 * size against the manifest (and the RAM file's against memory_mb: QEMU would silently make
 * a fresh, empty one), and the device state's checksum when it is small (a 60 KB file: well
 * under a millisecond; a clone's first snapshot streams its RAM into it and is verified with
 * the big parts, restore_verify). -1 with a client-safe reason; the snapshot is left as it is. */
static int snap_check(const char *dir, json_t *man, int memory_mb, bool stream, sp_err_t *err)
{
    char p[PATH_MAX + 32], buf[64];
    struct stat st;
    sp_qemu__sfmt(p, sizeof p, "%s/snapshot/corrupt", dir);
    if (sp_qemu__read_small(p, buf, sizeof buf) >= 0) {
        buf[strcspn(buf, "\n")] = '\0';
        return sp_err_set(err, SP_ERUNTIME,
                          "cannot wake: the snapshot failed its checksum check earlier (%s); it "
                          "is kept",
                          buf[0] != '\0' ? buf : "?");
    }
    const char *algo = json_string_value(json_object_get(man, "checksum"));
    if (algo != NULL && strcmp(algo, SP_QEMU_SUM_ALGO) != 0)
        return sp_err_set(err, SP_ERUNTIME, "cannot wake: unknown snapshot checksum %.32s", algo);
    static const char *const files[SUM_N] = {"mem.ram", "snapshot/devstate", "disk.qcow2"};
    static const char *const sizes[SUM_N] = {"ram_bytes", "devstate_bytes", "disk_bytes"};
    for (int i = 0; i < SUM_N; i++) {
        if (i == SUM_RAM && stream)
            continue;
        sp_qemu__sfmt(p, sizeof p, "%s/%s", dir, files[i]);
        if (stat(p, &st) < 0)
            return sp_err_set(err, SP_ERUNTIME, "cannot wake: the snapshot's %s is missing",
                              sum_label[i]);
        long long want = man_size(man, sizes[i]);
        if (i == SUM_RAM && (uint64_t)st.st_size != (uint64_t)memory_mb << 20)
            want = (long long)memory_mb << 20;
        if (want >= 0 && (long long)st.st_size != want)
            return sp_err_set(err, SP_ERUNTIME,
                              "cannot wake: the snapshot's %s has %lld bytes, it should have "
                              "%lld; the snapshot is kept",
                              sum_label[i], (long long)st.st_size, want);
    }
    const char *dsum = json_string_value(json_object_get(man, "devstate_checksum"));
    sp_qemu__sfmt(p, sizeof p, "%s/snapshot/devstate", dir);
    if (dsum != NULL && stat(p, &st) == 0 && (uint64_t)st.st_size <= SP_QEMU_SUM_INLINE_MAX) {
        char got[65];
        uint64_t n;
        if (sp_qemu__sum_file(p, &n, got) < 0)
            return sp_err_set(err, SP_ERUNTIME, "cannot wake: cannot read the snapshot: %s",
                              strerror(errno));
        if (strcmp(got, dsum) != 0)
            return sp_err_set(err, SP_ERUNTIME,
                              "cannot wake: the snapshot's device state does not match its "
                              "checksum; the snapshot is kept");
    }
    return 0;
}

/* Bytes a committed snapshot holds on disk (RAM file allocation + device state), or 0. */
uint64_t sp_qemu__snapshot_bytes(const char *dir)
{
    if (!sp_qemu__snapshot_committed(dir))
        return 0;
    char p[PATH_MAX + 32];
    struct stat st;
    uint64_t n = 0;
    sp_qemu__sfmt(p, sizeof p, "%s/mem.ram", dir);
    if (stat(p, &st) == 0)
        n += (uint64_t)st.st_blocks * 512u;
    sp_qemu__sfmt(p, sizeof p, "%s/snapshot/devstate", dir);
    if (stat(p, &st) == 0)
        n += (uint64_t)st.st_size;
    return n;
}

/* ---------- suspend (snapshot) ---------- */

/* A suspend writes into the VM's own snapshot/, a checkpoint (fork.c) into its new
 * snapshot's directory: the same steps otherwise, until the commit. */
static void snap_path(const struct vm *vm, const char *name, char *out, size_t n)
{
    const char *fork = sp_qemu__fork_tmp(vm);
    sp_qemu__sfmt(out, n, "%s/snapshot/%s", fork != NULL ? fork : vm->dir, name);
}

/* The suspend steps are running for this VM: a suspend, or a checkpoint (the VM stays up). */
bool sp_qemu__snapping(const struct vm *vm)
{
    return vm->ph == PH_SUSPENDING || vm->fork != NULL;
}

static void snap_fail(struct vm *vm, const char *what, const char *detail)
{
    bool fork = vm->fork != NULL;
    sp_log(SP_LOG_WARN, "qemu", "%s failed sandbox=%s step=%d what=%s err=%s",
           fork ? "snapshot" : "suspend", vm->id, vm->snap_step, what, detail ? detail : "");
    if (vm->snap_fd >= 0) {
        close(vm->snap_fd);
        vm->snap_fd = -1;
    }
    char p[PATH_MAX + 32];
    snap_path(vm, "devstate.tmp", p, sizeof p);
    unlink(p);
    sp_timer_stop(&vm->snap_timer);
    sp_qemu__sumjob_abandon(vm->sum); /* a running `sync` child is reaped by on_sync_exit */
    vm->sum = NULL;
    sp_qemu__sumjob_abandon(vm->delta); /* its thread ends when QEMU closes the pipe */
    vm->delta = NULL;
    vm->snap_step = SN_NONE;
    sp_err_t e;
    sp_err_set(&e, SP_ERUNTIME, "%s failed: %s", fork ? "snapshot" : "suspend", what);
    sp_qemu__complete_all(vm->d, &vm->snap_w, &e);
    if (fork) {
        /* The VM is intact: give it back as it was (its vCPUs may already run again) and
         * drop the unfinished snapshot. */
        sp_qemu__fork_abort(vm);
        if (!vm->snap_was_paused && vm->qmp != NULL && !sp_qmp_closed(vm->qmp))
            sp_qmp_command(vm->qmp, "cont", NULL, -1, NULL, NULL, &e);
        return;
    }
    if (vm->tsnap_build != NULL) {
        vm->boot_failed = true;
        sp_err_set(&vm->boot_err, SP_ERUNTIME, "template snapshot failed: %s", what);
        vm->ph = PH_UP;
        sp_qemu__vm_stop(vm, false); /* sp_qemu__vm_finish gives up on this snapshot */
        return;
    }
    if (vm->ph == PH_SUSPENDING) {
        vm->ph = PH_UP; /* the VM is intact; give it back as it was */
        if (!vm->snap_was_paused && vm->qmp != NULL && !sp_qmp_closed(vm->qmp))
            sp_qmp_command(vm->qmp, "cont", NULL, -1, NULL, NULL, &e);
    }
}

/* For fork.c: a checkpoint's own steps (the disk copy, the cont) fail the same way. */
void sp_qemu__snap_fail(struct vm *vm, const char *what, const char *detail)
{
    snap_fail(vm, what, detail);
}

/* Device state and RAM are durable: write the manifest and commit it by rename. */
static void snap_commit(struct vm *vm)
{
    char tmp[PATH_MAX + 32], dev[PATH_MAX + 32], man[PATH_MAX + 32], dir[PATH_MAX + 32],
        ram[PATH_MAX + 16];
    snap_path(vm, "devstate.tmp", tmp, sizeof tmp);
    snap_path(vm, "devstate", dev, sizeof dev);
    snap_path(vm, "manifest.json", man, sizeof man);
    snap_path(vm, "", dir, sizeof dir);
    sp_qemu__vm_path(vm, "mem.ram", ram, sizeof ram);
    struct stat sd, sr = {0};
    /* the RAM went into the device state stream (a clone's, every checkpoint's, and every
     * suspend's with a shared snapshot dir) */
    bool stream = vm->clone_src != NULL || vm->fork != NULL || sp_qemu__shared_streams(vm);
    bool delta = stream && vm->delta_ok; /* only its pages that differ from the template's */
    if (rename(tmp, dev) < 0 || stat(dev, &sd) < 0 || (!stream && stat(ram, &sr) < 0)) {
        snap_fail(vm, "cannot commit the snapshot", strerror(errno));
        return;
    }
    /* Sizes and checksums are the ones the sum job saw (the VM was stopped throughout). */
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    json_t *o = json_pack(
        "{s:i, s:i, s:i, s:s, s:s, s:I, s:s, s:I, s:s, s:I, s:I, s:s, s:s, s:s}", "version",
        SP_QEMU_SNAP_VERSION, "cpu_count", vm->cpu_count, "memory_mb", vm->memory_mb, "accel",
        vm->d->accel == 1 ? "kvm" : "tcg", "ram",
        delta    ? "delta"
        : stream ? "stream"
                 : "mem.ram",
        "ram_bytes",
        (json_int_t)(stream ? 0 : vm->sum_sizes[SUM_RAM]), "devstate", "snapshot/devstate",
        "devstate_bytes", (json_int_t)vm->sum_sizes[SUM_DEV], "disk", "disk.qcow2", "disk_bytes",
        (json_int_t)vm->sum_sizes[SUM_DISK], "created_at", (json_int_t)ts.tv_sec, "checksum",
        SP_QEMU_SUM_ALGO, "devstate_checksum", vm->sums[SUM_DEV], "disk_checksum",
        vm->sums[SUM_DISK]);
    if (o != NULL && !stream)
        json_object_set_new(o, "ram_checksum", json_string(vm->sums[SUM_RAM]));
    if (o != NULL && delta)
        json_object_set_new(o, "ram_base", json_string(vm->clone_src));
    if (o != NULL && vm->tsnap_build == NULL && (uint64_t)sd.st_size != vm->sum_sizes[SUM_DEV]) {
        json_decref(o); /* cannot happen: the file was ours alone since QEMU closed it */
        snap_fail(vm, "the device state changed while it was checksummed", NULL);
        return;
    }
    char *js = o != NULL ? json_dumps(o, JSON_COMPACT) : NULL;
    json_decref(o);
    char mtmp[PATH_MAX + 40];
    sp_qemu__sfmt(mtmp, sizeof mtmp, "%s.tmp", man);
    int fd = js != NULL ? open(mtmp, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644) : -1;
    bool ok = fd >= 0 && write(fd, js, strlen(js)) == (ssize_t)strlen(js) && fsync(fd) == 0;
    if (fd >= 0)
        close(fd);
    free(js);
    if (!ok || rename(mtmp, man) < 0) {
        unlink(mtmp);
        snap_fail(vm, "cannot write the snapshot manifest", strerror(errno));
        return;
    }
    sp_qemu__fsync_path(dir, O_RDONLY | O_DIRECTORY); /* the rename itself is durable */
    sp_log(SP_LOG_INFO, "qemu",
           "snapshot committed sandbox=%s%s ram=%s devstate_bytes=%lld ram_bytes=%lld "
           "disk_bytes=%lld checksum_ms=%llu ms=%llu",
           vm->id, vm->fork != NULL ? " (checkpoint)" : "",
           delta    ? "delta"
           : stream ? "stream"
                    : "file",
           (long long)sd.st_size, (long long)sr.st_size, (long long)vm->sum_sizes[SUM_DISK],
           (unsigned long long)vm->sum_ms,
           (unsigned long long)(sp_qemu__mono_ms() - vm->snap_start_ms));
    if (vm->fork != NULL) {
        sp_qemu__fork_committed(vm); /* the VM goes on */
        return;
    }
    vm->snap_step = SN_QUIT;
    sp_qemu__snap_send(vm, "quit", NULL, -1);
    sp_timer_start(&vm->kill_timer, SP_QEMU_QUIT_GRACE_MS);
}

static void on_sync_exit(struct child *c, int st, bool timed_out, void *arg)
{
    struct vm *vm = arg;
    sp_qemu__child_free(c);
    vm->sync = NULL;
    if (!sp_qemu__snapping(vm) || vm->snap_step != SN_SYNC)
        return;
    if (timed_out || st == -1 || !WIFEXITED(st) || WEXITSTATUS(st) != 0) {
        snap_fail(vm, "cannot flush the snapshot to disk", "sync failed");
        return;
    }
    vm->sync_done = true;
    if (vm->sum_ok)
        snap_commit(vm);
}

/* The parts' checksums are in (computed while `sync` flushed them): commit once both are. */
void sp_qemu__suspend_sums_done(struct vm *vm, struct sumjob *j)
{
    if (!sp_qemu__snapping(vm) || vm->snap_step != SN_SYNC)
        return;
    if (j->bad >= 0) {
        snap_fail(vm, "cannot checksum the snapshot", strerror(j->err_no));
        return;
    }
    memcpy(vm->sums, j->got, sizeof vm->sums);
    memcpy(vm->sum_sizes, j->size, sizeof vm->sum_sizes);
    vm->sum_ms = j->ms;
    vm->sum_ok = true;
    if (vm->sync_done)
        snap_commit(vm);
}

/* fdatasync of the RAM file (up to memory_mb of dirty pages), device state and overlay,
 * in a child so the loop does not wait for the disk. A checkpoint's: device state and the
 * copy of the overlay in its directory (its RAM is in the stream). */
void sp_qemu__snap_sync(struct vm *vm)
{
    if (vm->snap_fd >= 0) {
        close(vm->snap_fd);
        vm->snap_fd = -1;
    }
    char ram[PATH_MAX + 16], dev[PATH_MAX + 32], disk[PATH_MAX + 16];
    sp_qemu__vm_path(vm, "mem.ram", ram, sizeof ram);
    snap_path(vm, "devstate.tmp", dev, sizeof dev);
    const char *fork = sp_qemu__fork_tmp(vm);
    if (fork != NULL)
        sp_qemu__sfmt(disk, sizeof disk, "%s/disk.qcow2", fork);
    else
        sp_qemu__vm_path(vm, "disk.qcow2", disk, sizeof disk);
    bool own_ram = vm->clone_src == NULL && fork == NULL && !sp_qemu__shared_streams(vm);
    char *argv[] = {"sync", "--data", dev, disk, own_ram ? ram : NULL, NULL};
    struct spawn_opts so = {.out_path = NULL, .stdin_fd = -1, .cg = NULL};
    sp_err_t e;
    if (vm->sync != NULL) { /* the flush of a failed suspend is still running */
        snap_fail(vm, "cannot flush the snapshot to disk", "an earlier flush is still running");
        return;
    }
    vm->snap_step = SN_SYNC;
    vm->sync_done = false;
    vm->sum_ok = false;
    memset(vm->sums, 0, sizeof vm->sums);
    memset(vm->sum_sizes, 0, sizeof vm->sum_sizes);
    vm->sum_ms = 0;
    /* Checksums of every part on a thread while `sync` flushes them (a template snapshot
     * builder has its own manifest and skips them). */
    if (vm->tsnap_build == NULL) {
        struct sumjob *j = sp_qemu__sumjob_new(vm, false);
        if (j != NULL) {
            sp_qemu__sfmt(j->path[SUM_DEV], sizeof j->path[SUM_DEV], "%s", dev);
            sp_qemu__sfmt(j->path[SUM_DISK], sizeof j->path[SUM_DISK], "%s", disk);
            if (own_ram)
                sp_qemu__sfmt(j->path[SUM_RAM], sizeof j->path[SUM_RAM], "%s", ram);
        }
        if (j == NULL || sp_qemu__sumjob_run(vm->d, j) < 0) {
            snap_fail(vm, "cannot checksum the snapshot", "no thread");
            return;
        }
        vm->sum = j;
    } else {
        vm->sum_ok = true;
    }
    vm->sync = sp_qemu__child_start(vm->d, argv, &so, 120000, on_sync_exit, vm, &e);
    if (vm->sync == NULL)
        snap_fail(vm, "cannot flush the snapshot to disk", e.msg);
}

/* A clone's suspend: QEMU migrates into a pipe and a thread writes the device state file
 * from it with only the RAM pages that differ from the template's (core/runtime/migdelta.h). The fd
 * to give QEMU: the pipe's write end, or the device state file itself when there is no
 * delta to make (own RAM file, template builder, or the filter refused this VM before). */
static int suspend_delta_start(struct vm *vm)
{
    vm->mig_done = false;
    vm->delta_ok = false;
    vm->delta_failed = false;
    if (vm->clone_src == NULL || vm->no_delta || vm->tsnap_build != NULL ||
        sp_qemu__shared_streams(vm)) /* a delta is over this worker's template RAM */
        return vm->snap_fd;
    int pfd[2];
    struct sumjob *j = sp_qemu__sumjob_new(vm, false);
    if (j == NULL)
        return vm->snap_fd;
    if (pipe2(pfd, O_CLOEXEC) < 0) {
        sp_qemu__sumjob_free(j);
        return vm->snap_fd;
    }
    /* A pipe holds 64 KiB by default: QEMU's migration thread and the filter then take
     * turns every 16 pages of a stream of 256 MiB and more. */
    (void)fcntl(pfd[1], F_SETPIPE_SZ, DELTA_PIPE_BYTES);
    j->delta = true;
    (void)sp_qemu__fork_take_source(vm, &j->live); /* an exact snapshot's: pages read at the end */
    j->in_fd = pfd[0];
    j->out_fd = fcntl(vm->snap_fd, F_DUPFD_CLOEXEC, 0);
    sp_qemu__sfmt(j->base, sizeof j->base, "%s/mem.ram", vm->clone_src);
    /* sp_qemu__sumjob_run frees j when it fails */
    if (j->out_fd < 0 || sp_qemu__sumjob_run(vm->d, j) < 0) {
        if (j->out_fd < 0)
            sp_qemu__sumjob_free(j);
        close(pfd[1]);
        return vm->snap_fd;
    }
    vm->delta = j;
    return pfd[1];
}

/* QEMU's migration completed (and the delta filter, if any, is through). */
static void suspend_migrated(struct vm *vm)
{
    if (vm->delta_failed) {
        /* The VM sits in postmigrate: SN_STATUS runs it through cont/stop again and migrates
         * the whole RAM this time. */
        vm->no_delta = true;
        vm->delta_failed = false;
        vm->snap_step = SN_STATUS;
        sp_qemu__snap_send(vm, "query-status", NULL, -1);
        return;
    }
    if (vm->fork != NULL)
        sp_qemu__fork_migrated(vm); /* copies the disk, restarts the vCPUs, then syncs */
    else
        sp_qemu__snap_sync(vm);
}

void sp_qemu__suspend_delta_done(struct vm *vm, struct sumjob *j)
{
    if (!sp_qemu__snapping(vm) || vm->snap_step < SN_GETFD || vm->snap_step > SN_POLL)
        return;
    if (j->rc < 0) {
        sp_log(SP_LOG_WARN, "qemu",
               "suspend: RAM delta refused sandbox=%s reason=\"%s\" (streaming the whole RAM "
               "instead)",
               vm->id, j->why);
        vm->delta_failed = true;
    } else {
        vm->delta_ok = true;
        sp_log(SP_LOG_DEBUG, "qemu",
               "suspend: RAM delta sandbox=%s pages=%llu/%llu zero=%llu/%llu bytes=%llu->%llu "
               "ms=%llu",
               vm->id, (unsigned long long)j->st.pages_kept, (unsigned long long)j->st.pages_in,
               (unsigned long long)j->st.zero_kept, (unsigned long long)j->st.zero_in,
               (unsigned long long)j->st.bytes_in, (unsigned long long)j->st.bytes_out,
               (unsigned long long)j->ms);
    }
    if (vm->mig_done)
        suspend_migrated(vm);
}

static void on_snap_reply(void *arg, json_t *ret, const sp_err_t *err)
{
    struct vm *vm = arg;
    if (!sp_qemu__snapping(vm) || vm->snap_step == SN_QUIT)
        return;
    if (err != NULL) {
        snap_fail(vm, "qemu refused a step", err->msg);
        return;
    }
    switch (vm->snap_step) {
    case SN_STOP:
        vm->snap_step = SN_CANCEL;
        sp_qemu__snap_send(vm, "migrate_cancel", NULL, -1);
        break;
    case SN_CANCEL:
        vm->snap_step = SN_CANCEL_POLL;
        sp_qemu__snap_send(vm, "query-migrate", NULL, -1);
        break;
    case SN_CANCEL_POLL: {
        /* A migration an earlier driver started (and died in) still writes to its fd:
         * capabilities cannot change and a new one cannot start until it is over. */
        const char *st = json_string_value(json_object_get(ret, "status"));
        if (st != NULL && strcmp(st, "completed") != 0 && strcmp(st, "failed") != 0 &&
            strcmp(st, "cancelled") != 0 && strcmp(st, "none") != 0) {
            sp_timer_start(&vm->snap_timer, 5);
            break;
        }
        vm->snap_step = SN_STATUS;
        sp_qemu__snap_send(vm, "query-status", NULL, -1);
        break;
    }
    case SN_STATUS:
    case SN_RECONT:
    case SN_RESTOP: {
        const char *st = json_string_value(json_object_get(ret, "status"));
        if (vm->snap_step == SN_STATUS && st != NULL && strcmp(st, "finish-migrate") == 0) {
            sp_timer_start(&vm->snap_timer, 5); /* the cancelled one's end: postmigrate next */
            break;
        }
        if (vm->snap_step == SN_STATUS && st != NULL && strcmp(st, "postmigrate") == 0) {
            vm->snap_step = SN_RECONT;
            sp_qemu__snap_send(vm, "cont", NULL, -1);
            break;
        }
        if (vm->snap_step == SN_RECONT) {
            vm->snap_step = SN_RESTOP;
            sp_qemu__snap_send(vm, "stop", NULL, -1);
            break;
        }
        vm->snap_step = SN_CAPS;
        /* A clone's RAM is a private map of the template's file: stream all of it. So does
         * a checkpoint: its RAM file, if it has one, moves on when the vCPUs run again. And a
         * suspend into a shared snapshot dir: the snapshot must not need a RAM file here. */
        json_t *a = json_pack("{s:[{s:s, s:b}]}", "capabilities", "capability", "x-ignore-shared",
                              "state",
                              vm->clone_src == NULL && vm->fork == NULL &&
                                      !sp_qemu__shared_streams(vm)
                                  ? 1
                                  : 0);
        sp_qemu__snap_send(vm, "migrate-set-capabilities", a, -1);
        break;
    }
    case SN_CAPS:
        /* QEMU paces a migration at 32 MiB/s by default; a clone's streamed RAM would take
         * seconds. Unlimited, and a downtime limit that lets it finish in one pass. */
        vm->snap_step = SN_PARAMS;
        sp_qemu__snap_send(vm, "migrate-set-parameters",
                           json_pack("{s:I, s:I}", "max-bandwidth", (json_int_t)1 << 40,
                                     "downtime-limit", (json_int_t)sp_qemu__fork_downtime(vm)),
                           -1);
        break;
    case SN_PARAMS: {
        char dir[PATH_MAX + 16], tmp[PATH_MAX + 32];
        snap_path(vm, "", dir, sizeof dir);
        snap_path(vm, "devstate.tmp", tmp, sizeof tmp);
        if (mkdir(dir, 0700) < 0 && errno != EEXIST) {
            snap_fail(vm, "cannot create the snapshot directory", strerror(errno));
            return;
        }
        if (vm->snap_fd >= 0)
            close(vm->snap_fd); /* a second try (the delta was refused) starts afresh */
        vm->snap_fd = open(tmp, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
        if (vm->snap_fd < 0) {
            snap_fail(vm, "cannot create the device state file", strerror(errno));
            return;
        }
        int qfd = suspend_delta_start(vm);
        if (qfd == vm->snap_fd && sp_qemu__fork_exact(vm) && !vm->no_delta) {
            /* the vCPUs run: a stream kept as QEMU sends it could miss their last writes */
            snap_fail(vm, "cannot take the snapshot", "its RAM filter did not start");
            return;
        }
        vm->snap_step = SN_GETFD;
        sp_qemu__snap_send(vm, "getfd", json_pack("{s:s}", "fdname", "spmig"), qfd);
        if (qfd != vm->snap_fd)
            close(qfd); /* the QMP client sends its own dup */
        break;
    }
    case SN_GETFD:
        vm->snap_step = SN_MIGRATE;
        sp_qemu__snap_send(vm, "migrate", json_pack("{s:s}", "uri", "fd:spmig"), -1);
        break;
    case SN_MIGRATE:
        vm->snap_step = SN_POLL;
        sp_timer_start(&vm->snap_timer, 1);
        break;
    case SN_POLL: {
        const char *st = json_string_value(json_object_get(ret, "status"));
        if (st != NULL && strcmp(st, "completed") == 0) {
            sp_qemu__fork_mig_done(vm, json_integer_value(json_object_get(ret, "downtime")));
            vm->mig_done = true;
            if (vm->delta == NULL) /* else sp_qemu__suspend_delta_done goes on */
                suspend_migrated(vm);
        } else if (st != NULL && (strcmp(st, "failed") == 0 || strcmp(st, "cancelled") == 0)) {
            const char *desc = json_string_value(json_object_get(ret, "error-desc"));
            snap_fail(vm, "migration failed", desc);
        } else { /* device state alone takes a few ms: poll closely at first */
            sp_timer_start(&vm->snap_timer, sp_qemu__mono_ms() - vm->snap_start_ms < 200 ? 1 : 5);
        }
        break;
    }
    default:
        break;
    }
}

void sp_qemu__snap_send(struct vm *vm, const char *cmd, json_t *args, int fd)
{
    sp_err_t e;
    if (vm->qmp == NULL) {
        json_decref(args);
        snap_fail(vm, "VM control channel is not connected", NULL);
        return;
    }
    if (sp_qmp_command(vm->qmp, cmd, args, fd, on_snap_reply, vm, &e) < 0 &&
        vm->snap_step != SN_QUIT)
        snap_fail(vm, "VM control channel failed", e.msg);
}

/* ---------- restore ---------- */

static void on_restore_reply(void *arg, json_t *ret, const sp_err_t *err)
{
    struct vm *vm = arg;
    if (vm->ph != PH_START || !vm->restoring)
        return;
    if (err != NULL) {
        sp_log(SP_LOG_WARN, "qemu", "restore step failed sandbox=%s step=%d err=%s", vm->id,
               vm->snap_step, err->msg);
        sp_qemu__boot_fail(vm, "restore failed: %s", "qemu refused the snapshot");
        return;
    }
    sp_err_t e;
    switch (vm->snap_step) {
    case RS_CAPS: {
        char dev[PATH_MAX + 32];
        if (vm->clone_boot)
            sp_qemu__sfmt(dev, sizeof dev, "%s/snapshot/devstate", vm->clone_src);
        else
            snap_path(vm, "devstate", dev, sizeof dev);
        int fd = open(dev, O_RDONLY | O_CLOEXEC);
        if (fd < 0) {
            sp_qemu__boot_fail(vm, "restore failed: %s", "the device state is missing");
            return;
        }
        vm->snap_step = RS_GETFD;
        int rc = sp_qmp_command(vm->qmp, "getfd", json_pack("{s:s}", "fdname", "spin"), fd,
                                on_restore_reply, vm, &e);
        close(fd); /* the client holds its own dup until sent */
        if (rc < 0)
            sp_qemu__boot_fail(vm, "restore failed: %s", e.msg);
        return;
    }
    case RS_GETFD:
        vm->snap_step = RS_INCOMING;
        if (sp_qmp_command(vm->qmp, "migrate-incoming", json_pack("{s:s}", "uri", "fd:spin"), -1,
                           on_restore_reply, vm, &e) < 0)
            sp_qemu__boot_fail(vm, "restore failed: %s", e.msg);
        return;
    case RS_INCOMING:
        vm->snap_step = RS_POLL;
        sp_timer_start(&vm->snap_timer, 1);
        return;
    case RS_POLL: {
        const char *st = json_string_value(json_object_get(ret, "status"));
        if (st == NULL || strcmp(st, "inmigrate") == 0) { /* a clone loads in a few ms */
            sp_timer_start(&vm->snap_timer, sp_qemu__mono_ms() - vm->boot_start_ms < 500 ? 1 : 5);
            return;
        }
        /* Loaded; "paused" (the source was stopped), so nothing has touched RAM or disk yet. */
        vm->restore_running = strcmp(st, "running") == 0;
        if (vm->verify == VERIFY_RUNNING) {
            vm->snap_step = RS_VERIFY; /* sp_qemu__restore_sums_done goes on */
            vm->verify_wait_ms = sp_qemu__mono_ms();
            return;
        }
        restore_loaded(vm);
        return;
    }
    case RS_CONT:
        restore_up(vm);
        return;
    default:
        return;
    }
}

/* The device state is loaded and the vCPUs are stopped: give up on a snapshot that failed
 * its checksums, else invalidate our own snapshot and start the vCPUs. */
static void restore_loaded(struct vm *vm)
{
    sp_err_t e;
    if (vm->verify == VERIFY_FAILED) {
        restore_corrupt(vm);
        return;
    }
    if (!vm->clone_boot) {
        /* Our own snapshot: once the vCPUs run, its RAM file and disk move on and it can
         * never be restored again. So a later driver must adopt this VM rather than kill
         * it and restore (booting marker first: a crash between the two leaves a stale
         * manifest beside a live VM, which adoption prefers and the next suspend
         * replaces). A clone keeps its marker: its template snapshot never changes, so
         * killing it and starting over stays safe until it has its identity. */
        char p[PATH_MAX + 32];
        sp_qemu__vm_path(vm, "booting", p, sizeof p);
        unlink(p);
        snap_path(vm, "manifest.json", p, sizeof p);
        unlink(p);
    }
    if (!vm->restore_running) { /* paused after incoming: start the vCPUs */
        vm->snap_step = RS_CONT;
        if (sp_qmp_command(vm->qmp, "cont", NULL, -1, on_restore_reply, vm, &e) < 0)
            sp_qemu__boot_fail(vm, "restore failed: %s", e.msg);
        return;
    }
    restore_up(vm);
}

static void restore_up(struct vm *vm)
{
    sp_log(SP_LOG_INFO, "qemu", "restored vm state sandbox=%s from=%s ms=%llu", vm->id,
           vm->clone_boot ? "template-snapshot" : "own-snapshot",
           (unsigned long long)(sp_qemu__mono_ms() - vm->boot_start_ms));
    vm->paused = false;
    vm->ph = PH_AGENT;
    sp_qemu__agent_start(vm);
}

/* A part did not match its checksum (or could not be read): QEMU goes, the snapshot stays,
 * marked corrupt so later wakes are refused at once (snap_check) instead of loading it. */
static void restore_corrupt(struct vm *vm)
{
    int part = vm->verify_bad >= 0 && vm->verify_bad < SUM_N ? vm->verify_bad : SUM_DEV;
    char why[120], p[PATH_MAX + 32];
    if (vm->verify_errno != 0) {
        sp_log(SP_LOG_WARN, "qemu",
               "cannot read the snapshot to verify it sandbox=%s part=%s err=%s", vm->id,
               sum_part[part], strerror(vm->verify_errno));
        sp_qemu__sfmt(why, sizeof why, "the snapshot's %s cannot be read; it is kept",
                      sum_label[part]);
    } else {
        snap_path(vm, "corrupt", p, sizeof p);
        char line[64];
        int n = sp_qemu__sfmt(line, sizeof line, "%s checksum mismatch\n", sum_label[part]);
        if (sp_qemu__write_atomic(p, line, (size_t)n) < 0)
            sp_log(SP_LOG_WARN, "qemu", "cannot mark the snapshot corrupt sandbox=%s err=%s",
                   vm->id, strerror(errno));
        sp_log(SP_LOG_ERROR, "qemu",
               "snapshot does not match its checksum sandbox=%s part=%s: not restored, kept and "
               "marked corrupt (snapshot/corrupt)",
               vm->id, sum_part[part]);
        sp_qemu__sfmt(why, sizeof why, "the snapshot's %s does not match its checksum; it is kept",
                      sum_label[part]);
    }
    sp_qemu__boot_fail(vm, "cannot wake: %s", why);
}

/* The big parts' checksums (RAM file, disk, a device state too big for snap_check) are
 * verified on a thread from the moment the wake is asked for, while QEMU starts and loads the
 * device state; the vCPUs start only once they match (RS_VERIFY). They cannot be verified
 * after: the RAM file is mapped shared and the disk is live, so both change as soon as the
 * guest runs. Nothing to do for a version-1 manifest (no checksums). */
static void restore_verify(struct vm *vm, json_t *man)
{
    vm->verify = VERIFY_NONE;
    const char *ram = json_string_value(json_object_get(man, "ram_checksum"));
    const char *dev = json_string_value(json_object_get(man, "devstate_checksum"));
    const char *disk = json_string_value(json_object_get(man, "disk_checksum"));
    long long dev_bytes = man_size(man, "devstate_bytes");
    if (dev_bytes >= 0 && (uint64_t)dev_bytes <= SP_QEMU_SUM_INLINE_MAX)
        dev = NULL; /* snap_check did it */
    if (vm->restore_stream || vm->restore_delta)
        ram = NULL;
    if (ram == NULL && dev == NULL && disk == NULL)
        return;
    struct sumjob *j = sp_qemu__sumjob_new(vm, true);
    if (j == NULL) {
        sp_log(SP_LOG_WARN, "qemu", "snapshot checksums not verified sandbox=%s (no memory)",
               vm->id);
        return;
    }
    const char *want[SUM_N] = {ram, dev, disk};
    static const char *const files[SUM_N] = {"mem.ram", "snapshot/devstate", "disk.qcow2"};
    for (int i = 0; i < SUM_N; i++) {
        if (want[i] == NULL)
            continue;
        sp_qemu__vm_path(vm, files[i], j->path[i], sizeof j->path[i]);
        sp_qemu__sfmt(j->want[i], sizeof j->want[i], "%.64s", want[i]);
    }
    if (sp_qemu__sumjob_run(vm->d, j) < 0) {
        sp_log(SP_LOG_WARN, "qemu", "snapshot checksums not verified sandbox=%s (no thread)",
               vm->id);
        return;
    }
    vm->sum = j;
    vm->verify = VERIFY_RUNNING;
}

void sp_qemu__restore_sums_done(struct vm *vm, struct sumjob *j)
{
    vm->verify = j->bad < 0 ? VERIFY_OK : VERIFY_FAILED;
    vm->verify_bad = j->bad;
    vm->verify_errno = j->err_no;
    bool waited = vm->ph == PH_START && vm->restoring && vm->snap_step == RS_VERIFY;
    sp_log(j->bad >= 0 ? SP_LOG_WARN : SP_LOG_INFO, "qemu",
           "snapshot checksums sandbox=%s result=%s ms=%llu wake_waited_ms=%llu ram_bytes=%llu "
           "disk_bytes=%llu",
           vm->id, j->bad < 0 ? "ok" : "failed", (unsigned long long)j->ms,
           (unsigned long long)(waited ? sp_qemu__mono_ms() - vm->verify_wait_ms : 0),
           (unsigned long long)j->size[SUM_RAM], (unsigned long long)j->size[SUM_DISK]);
    if (waited)
        restore_loaded(vm);
    else if (j->bad >= 0 && vm->restoring && vm->ph < PH_AGENT)
        restore_corrupt(vm); /* before QEMU loaded anything: no need to wait for it */
}

void sp_qemu__restore_begin(struct vm *vm)
{
    sp_err_t e;
    vm->snap_step = RS_CAPS;
    /* RAM in a file (ours, or the template's for a clone): device state only. */
    json_t *a = json_pack("{s:[{s:s, s:b}]}", "capabilities", "capability", "x-ignore-shared",
                          "state", vm->restore_stream || vm->restore_delta ? 0 : 1);
    if (sp_qmp_command(vm->qmp, "migrate-set-capabilities", a, -1, on_restore_reply, vm, &e) < 0)
        sp_qemu__boot_fail(vm, "restore failed: %s", e.msg);
}

void sp_qemu__on_snap_timer(sp_timer_t *t, void *arg)
{
    struct vm *vm = arg;
    sp_err_t e;
    if (vm->qmp == NULL)
        return;
    if (vm->snap_step == SN_POLL && sp_qemu__fork_force_stop(vm))
        sp_qmp_command(vm->qmp, "stop", NULL, -1, NULL, NULL, &e); /* then it completes */
    if (sp_qemu__snapping(vm) && (vm->snap_step == SN_POLL || vm->snap_step == SN_CANCEL_POLL))
        sp_qmp_command(vm->qmp, "query-migrate", NULL, -1, on_snap_reply, vm, &e);
    else if (sp_qemu__snapping(vm) && vm->snap_step == SN_STATUS)
        sp_qmp_command(vm->qmp, "query-status", NULL, -1, on_snap_reply, vm, &e);
    else if (vm->ph == PH_START && vm->snap_step == RS_POLL)
        sp_qmp_command(vm->qmp, "query-status", NULL, -1, on_restore_reply, vm, &e);
}

/* QEMU quit after the commit: the VM is released, its snapshot stays. */
void sp_qemu__suspend_finish(struct vm *vm)
{
    sp_qemu_t *d = vm->d;
    sp_qemu__vm_disconnect(vm);
    sp_qemu__cg_remove(d, vm->id);
    sp_qemu__pool_origin_remove(vm);
    static const char *const names[] = {"qmp.sock", "agent.sock", "qemu.pid", "paused"};
    char p[PATH_MAX + 16];
    for (size_t i = 0; i < sizeof names / sizeof names[0]; i++) {
        sp_qemu__vm_path(vm, names[i], p, sizeof p);
        unlink(p);
    }
    bool publish = sp_qemu__shared_publishes(vm); /* before tsnap_commit lets go of the build */
    if (vm->tsnap_build != NULL) {
        sp_qemu__tsnap_commit(vm);
    } else {
        sp_log(SP_LOG_INFO, "qemu", "vm suspended sandbox=%s ms=%llu", vm->id,
               (unsigned long long)(sp_qemu__mono_ms() - vm->snap_start_ms));
    }
    if (publish) {
        sp_qemu__shared_publish(vm); /* then sp_qemu__suspend_release */
        return;
    }
    sp_qemu__suspend_release(vm);
}

/* The suspend is over (its snapshot committed, and moved to the shared dir if there is one):
 * the VM goes from the table and its waiters are answered. */
void sp_qemu__suspend_release(struct vm *vm)
{
    sp_qemu_t *d = vm->d;
    sp_qemu__vm_unlink(vm);
    sp_qemu__complete_all(d, &vm->snap_w, NULL);
    sp_qemu__complete_all(d, &vm->boot_w, NULL);
    sp_qemu__vm_free(vm);
}

int sp_qemu__q_snapshot(sp_driver_t *base, const char *id, sp_driver_cb cb, void *arg,
                        sp_err_t *err)
{
    sp_qemu_t *d = (sp_qemu_t *)base;
    struct vm *vm = sp_qemu__valid_id(id) ? sp_qemu__vm_find(d, id) : NULL;
    if (vm == NULL && sp_qemu__valid_id(id)) {
        char vdir[PATH_MAX];
        sp_qemu__sfmt(vdir, sizeof vdir, "%s/%s", d->vms_dir, id);
        if (sp_qemu__live_vm_pid(d, id, vdir) == 0 && sp_qemu__snapshot_committed(vdir)) {
            if (sp_qemu__complete(d, cb, arg, NULL) < 0) /* already suspended */
                return sp_err_set(err, SP_EINTERNAL, "out of memory");
            return 0;
        }
    }
    if (vm != NULL && vm->ph == PH_SUSPENDING)
        return sp_qemu__add_waiter(&vm->snap_w, cb, arg, err);
    vm = sp_qemu__running_vm(d, id, err);
    if (vm == NULL)
        return -1;
    if (sp_qemu__add_waiter(&vm->snap_w, cb, arg, err) < 0)
        return -1;
    vm->ph = PH_SUSPENDING;
    vm->snap_was_paused = vm->paused;
    vm->snap_start_ms = sp_qemu__mono_ms();
    char man[PATH_MAX + 32];
    snap_path(vm, "manifest.json", man, sizeof man);
    unlink(man); /* an older snapshot is stale once the VM has run */
    vm->snap_step = SN_STOP;
    sp_qemu__snap_send(vm, "stop", NULL, -1); /* stop on a paused VM is a no-op */
    return 0;
}

/* A wake: of a snapshot in the shared dir (copied in first, shared.c), else of the one in the
 * VM dir. */
int sp_qemu__q_restore(sp_driver_t *base, const sp_vm_spec_t *spec, sp_driver_cb cb, void *arg,
                       sp_err_t *err)
{
    sp_qemu_t *d = (sp_qemu_t *)base;
    if (spec == NULL || !sp_qemu__valid_id(spec->sandbox_id))
        return sp_err_set(err, SP_EINVAL, "invalid sandbox id");
    const char *id = spec->sandbox_id;
    if (d->shared_dir[0] != '\0' && spec->snapshot_id == NULL && !d->no_adopt &&
        sp_qemu__vm_find(d, id) == NULL) {
        char vdir[PATH_MAX];
        sp_qemu__sfmt(vdir, sizeof vdir, "%s/%s", d->vms_dir, id);
        if (sp_qemu__shared_fetching(d, id) ||
            (sp_qemu__live_vm_pid(d, id, vdir) == 0 && sp_qemu__shared_committed(d, id)))
            return sp_qemu__shared_fetch(d, spec, cb, arg, err);
    }
    return sp_qemu__restore_local(d, spec, cb, arg, err);
}

int sp_qemu__restore_local(sp_qemu_t *d, const sp_vm_spec_t *spec, sp_driver_cb cb, void *arg,
                           sp_err_t *err)
{
    if (spec == NULL || !sp_qemu__valid_id(spec->sandbox_id))
        return sp_err_set(err, SP_EINVAL, "invalid sandbox id");
    struct vm *vm = sp_qemu__vm_find(d, spec->sandbox_id);
    char vdir[PATH_MAX];
    sp_qemu__sfmt(vdir, sizeof vdir, "%s/%s", d->vms_dir, spec->sandbox_id);
    if (vm == NULL) {
        pid_t pid = sp_qemu__live_vm_pid(d, spec->sandbox_id, vdir);
        if (pid > 0)
            vm = sp_qemu__vm_adopt(d, spec->sandbox_id, pid);
    }
    if (vm != NULL) {
        if (vm->ph == PH_STOPPING)
            return sp_err_set(err, SP_ECONFLICT, "sandbox is being deleted");
        if (vm->ph == PH_SUSPENDING)
            return sp_err_set(err, SP_ECONFLICT, "sandbox is being suspended");
        if (vm->ph == PH_UP) {
            if (sp_qemu__complete(d, cb, arg, NULL) < 0)
                return sp_err_set(err, SP_EINTERNAL, "out of memory");
            return 0;
        }
        return sp_qemu__add_waiter(&vm->boot_w, cb, arg, err);
    }
    if (!sp_qemu__snapshot_committed(vdir))
        return sp_err_set(err, SP_ECONFLICT, "sandbox has no snapshot to restore");
    if (d->no_adopt)
        return sp_err_set(err, SP_ECONFLICT, "this driver only builds template snapshots");
    vm = sp_qemu__vm_new(d, spec->sandbox_id);
    if (vm == NULL)
        return sp_err_set(err, SP_EINTERNAL, "out of memory");
    if (sp_qemu__add_waiter(&vm->boot_w, cb, arg, err) < 0 || sp_qemu__restore_fill(vm, err) < 0) {
        sp_qemu__vm_unlink(vm);
        sp_qemu__vm_free(vm);
        return -1;
    }
    vm->hostname = strdup(spec->hostname != NULL && *spec->hostname ? spec->hostname : "space");
    vm->env_json = spec->env_json != NULL ? strdup(spec->env_json) : NULL;
    vm->ph = PH_WAIT_ACCEL;
    vm->boot_start_ms = sp_qemu__mono_ms();
    sp_timer_start(&vm->boot_timer, d->boot_timeout_ms);
    sp_qemu__kick(d);
    return 0;
}

int sp_qemu__restore_fill(struct vm *vm, sp_err_t *err)
{
    sp_qemu_t *d = vm->d;
    const char *vdir = vm->dir;
    char p[PATH_MAX + 32];
    sp_qemu__sfmt(p, sizeof p, "%s/snapshot/manifest.json", vdir);
    json_t *man = json_load_file(p, 0, NULL);
    sp_qemu__sfmt(p, sizeof p, "%s/vm.json", vdir);
    json_t *vj = json_load_file(p, 0, NULL);
    const char *kernel = json_string_value(json_object_get(vj, "kernel"));
    const char *initrd = json_string_value(json_object_get(vj, "initramfs"));
    const char *accel = json_string_value(json_object_get(man, "accel"));
    int mem = (int)json_integer_value(json_object_get(man, "memory_mb"));
    int cpus = (int)json_integer_value(json_object_get(man, "cpu_count"));
    const char *ram = json_string_value(json_object_get(man, "ram"));
    bool stream = ram != NULL && strcmp(ram, "stream") == 0;
    bool delta = ram != NULL && strcmp(ram, "delta") == 0;
    /* a delta is loaded over the template's RAM file, which must still be there as it was */
    const char *base_dir = json_string_value(json_object_get(vj, "ram_src"));
    const char *man_base = json_string_value(json_object_get(man, "ram_base"));
    char base_ram[PATH_MAX + 16];
    struct stat bst;
    bool base_ok = delta && base_dir != NULL && man_base != NULL &&
                   strcmp(base_dir, man_base) == 0 &&
                   sp_qemu__sfmt(base_ram, sizeof base_ram, "%s/mem.ram", base_dir) > 0 &&
                   stat(base_ram, &bst) == 0 && (uint64_t)bst.st_size == (uint64_t)mem << 20;
    sp_tmplbuild_paths_t *tp = calloc(1, sizeof(*tp));
    int rc = 0;
    if (tp == NULL) {
        rc = sp_err_set(err, SP_EINTERNAL, "out of memory");
    } else if (delta && !base_ok && json_is_object(man) && mem > 0) {
        sp_log(SP_LOG_WARN, "qemu", "wake refused sandbox=%s reason=\"template RAM %s unusable\"",
               vm->id, base_dir != NULL ? base_dir : "(none)");
        rc = sp_err_set(err, SP_ERUNTIME,
                        "cannot wake: the template snapshot this sandbox's memory is based on is "
                        "gone or changed; the snapshot is kept");
    } else if (!json_is_object(man) || mem <= 0 || cpus < 0) {
        sp_log(SP_LOG_WARN, "qemu", "snapshot manifest unreadable sandbox=%s", vm->id);
        rc = sp_err_set(err, SP_ERUNTIME,
                        "cannot wake: the snapshot manifest is damaged; the snapshot is kept");
    } else if (vj == NULL || kernel == NULL || initrd == NULL || !sp_qemu__file_exists(kernel) ||
               !sp_qemu__file_exists(initrd)) {
        sp_log(SP_LOG_WARN, "qemu", "snapshot unusable sandbox=%s (vm.json or images)", vm->id);
        rc = sp_err_set(err, SP_ERUNTIME, "snapshot is incomplete or its images are gone");
    } else if (snap_check(vdir, man, mem, stream || delta, err) < 0) {
        sp_log(SP_LOG_WARN, "qemu", "wake refused sandbox=%s reason=\"%s\"", vm->id,
               err != NULL ? err->msg : "");
        rc = -1;
    } else if (accel != NULL && d->accel >= 0 && strcmp(accel, d->accel == 1 ? "kvm" : "tcg")) {
        rc = sp_err_set(err, SP_ERUNTIME, "snapshot was taken under %s", accel);
    } else if (delta && (vm->clone_src = strdup(base_dir)) == NULL) {
        rc = sp_err_set(err, SP_EINTERNAL, "out of memory");
    } else {
        sp_qemu__sfmt(tp->kernel, sizeof tp->kernel, "%s", kernel);
        sp_qemu__sfmt(tp->initramfs, sizeof tp->initramfs, "%s", initrd);
        const char *tn = json_string_value(json_object_get(vj, "template"));
        vm->tp = tp;
        tp = NULL;
        sp_qemu__sfmt(vm->template_name, sizeof vm->template_name, "%s", tn ? tn : "");
        vm->cpu_count = cpus > 0 ? cpus : 1;
        vm->memory_mb = mem;
        vm->disk_total = (uint64_t)json_integer_value(json_object_get(vj, "disk_bytes"));
        vm->restoring = true;
        vm->restore_stream = stream;
        vm->restore_delta = delta;
        restore_verify(vm, man);
    }
    free(tp);
    json_decref(man);
    json_decref(vj);
    return rc;
}
