/*
 * driver.c - the QEMU microvm runtime driver's ops (core/runtime/driver.h) and the life of a
 * VM around them (see qemu.h for the on-disk layout; qemu_int.h for the other files).
 *
 * Owns one struct vm per sandbox it runs or has re-adopted: the QEMU process
 * (watched through a pidfd), its QMP client, its agent channel and its
 * cgroup. Here: the VM table, stopping a VM and finishing it once its process is
 * gone, re-adoption of the live VMs an earlier driver left, the ops (boot, pause,
 * resume, destroy, probe, agent, stats) and the driver's creation and free. Never
 * blocks the loop on a VM: qemu-img, QEMU and the probes are fork/exec'd children
 * watched by pidfd; sockets are non-blocking. File system work that is quick
 * (pidfile, vm.json, removing a VM directory) is done inline. Every completion goes
 * through the driver's done-queue, so a callback never runs inside the call that
 * armed it and may call back into the driver.
 *
 * Does not boot (boot.c), suspend or wake (snapshot.c), make template snapshots (tsnap.c)
 * or spares (pool.c). Does not know the database or HTTP; does not build images (guest/
 * does).
 */
#include "core/runtime/qemu/qemu_int.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "base/log.h"

static void vm_adopt_connect(struct vm *vm);

/* ---------- completions ---------- */

static void on_done_timer(sp_timer_t *t, void *arg)
{
    sp_qemu_t *d = arg;
    struct done *list = d->done_head;
    d->done_head = d->done_tail = NULL;
    while (list != NULL) {
        struct done *x = list;
        list = x->next;
        x->cb(x->arg, x->failed ? &x->err : NULL);
        free(x);
    }
}

/* Queues cb for the next loop turn. Only fails on allocation. */
int sp_qemu__complete(sp_qemu_t *d, sp_driver_cb cb, void *arg, const sp_err_t *err)
{
    struct done *x = calloc(1, sizeof(*x));
    if (x == NULL)
        return -1;
    x->cb = cb;
    x->arg = arg;
    if (err != NULL) {
        x->failed = true;
        x->err = *err;
    }
    if (d->done_tail != NULL)
        d->done_tail->next = x;
    else
        d->done_head = x;
    d->done_tail = x;
    if (!sp_timer_armed(&d->done_timer))
        sp_timer_start(&d->done_timer, 0);
    return 0;
}

void sp_qemu__complete_all(sp_qemu_t *d, struct waiter **list, const sp_err_t *err)
{
    struct waiter *w = *list;
    *list = NULL;
    while (w != NULL) {
        struct waiter *n = w->next;
        if (sp_qemu__complete(d, w->cb, w->arg, err) < 0)
            sp_log(SP_LOG_ERROR, "qemu", "out of memory: a driver callback is lost");
        free(w);
        w = n;
    }
}

int sp_qemu__add_waiter(struct waiter **list, sp_driver_cb cb, void *arg, sp_err_t *err)
{
    struct waiter *w = calloc(1, sizeof(*w));
    if (w == NULL)
        return sp_err_set(err, SP_EINTERNAL, "out of memory");
    w->cb = cb;
    w->arg = arg;
    w->next = *list;
    *list = w;
    return 0;
}

/* ---------- VM table ---------- */

struct vm *sp_qemu__vm_find(sp_qemu_t *d, const char *id)
{
    for (struct vm *v = d->vms; v != NULL; v = v->next)
        if (!v->pooled && strcmp(v->id, id) == 0)
            return v;
    return NULL;
}

void sp_qemu__vm_unlink(struct vm *vm)
{
    struct vm **pp = &vm->d->vms;
    while (*pp != NULL && *pp != vm)
        pp = &(*pp)->next;
    if (*pp == vm)
        *pp = vm->next;
}

static void on_kill_timer(sp_timer_t *t, void *arg);

struct vm *sp_qemu__vm_new(sp_qemu_t *d, const char *id)
{
    struct vm *vm = calloc(1, sizeof(*vm));
    if (vm == NULL)
        return NULL;
    vm->d = d;
    sp_qemu__sfmt(vm->id, sizeof vm->id, "%s", id);
    sp_qemu__sfmt(vm->dir, sizeof vm->dir, "%s/%s", d->vms_dir, id);
    vm->pidfd = -1;
    sp_timer_init(&vm->qmp_timer, d->base.loop, sp_qemu__on_qmp_timer, vm);
    sp_timer_init(&vm->boot_timer, d->base.loop, sp_qemu__on_boot_timeout, vm);
    sp_timer_init(&vm->kill_timer, d->base.loop, on_kill_timer, vm);
    sp_timer_init(&vm->snap_timer, d->base.loop, sp_qemu__on_snap_timer, vm);
    sp_timer_init(&vm->adopt_timer, d->base.loop, sp_qemu__on_adopt_timer, vm);
    vm->snap_fd = -1;
    vm->next = d->vms;
    d->vms = vm;
    return vm;
}

/* Drops every connection and watcher of the VM (not the process). */
void sp_qemu__vm_disconnect(struct vm *vm)
{
    sp_timer_stop(&vm->qmp_timer);
    sp_timer_stop(&vm->boot_timer);
    sp_timer_stop(&vm->kill_timer);
    sp_timer_stop(&vm->snap_timer);
    sp_timer_stop(&vm->adopt_timer);
    vm->adopt_settling = false;
    /* pause or resume waiting for the settling: they look the VM up again and fail there */
    sp_qemu__complete_all(vm->d, &vm->adopt_w, NULL);
    if (vm->ident != NULL) {
        sp_agentstream_t *s = vm->ident;
        vm->ident = NULL;
        sp_agentstream_reset(s);
    }
    if (vm->settle != NULL) {
        sp_agentstream_t *s = vm->settle;
        vm->settle = NULL;
        sp_agentstream_reset(s);
    }
    sp_exec_cancel(vm->warm); /* before the agent goes: no callback may reach a freed vm */
    vm->warm = NULL;
    if (vm->agent != NULL) {
        sp_agentconn_t *a = vm->agent;
        vm->agent = NULL; /* on_agent_state ignores calls made while it is destroyed */
        sp_agentconn_destroy(a);
    }
    sp_qmp_destroy(vm->qmp);
    vm->qmp = NULL;
    sp_watch_destroy(vm->pw);
    vm->pw = NULL;
}

void sp_qemu__vm_free(struct vm *vm)
{
    sp_qemu__vm_disconnect(vm);
    if (vm->img != NULL) { /* driver going away mid-boot: let qemu-img finish on its own */
        sp_qemu__child_free(vm->img);
        vm->img = NULL;
    }
    if (vm->sync != NULL) {
        sp_qemu__child_free(vm->sync);
        vm->sync = NULL;
    }
    sp_qemu__export_abort(vm);
    sp_qemu__fork_abort(vm);
    if (vm->pidfd >= 0)
        close(vm->pidfd);
    if (vm->snap_fd >= 0)
        close(vm->snap_fd);
    sp_qemu__sumjob_abandon(vm->sum);
    vm->sum = NULL;
    sp_qemu__sumjob_abandon(vm->delta);
    vm->delta = NULL;
    sp_qemu__shared_publish_abandon(vm);
    struct waiter *lists[3] = {vm->boot_w, vm->destroy_w, vm->snap_w};
    for (int i = 0; i < 3; i++) {
        while (lists[i] != NULL) {
            struct waiter *n = lists[i]->next;
            free(lists[i]);
            lists[i] = n;
        }
    }
    free(vm->tp);
    free(vm->hostname);
    free(vm->env_json);
    free(vm->clone_src);
    free(vm->seed);
    sp_qemu__confine_release(vm); /* its QEMU is gone, or the driver is */
    free(vm);
}

/* The pid in the VM dir's qemu.pid if that process is alive and is QEMU running this VM
 * (its command line names the VM directory), else 0. */
pid_t sp_qemu__live_qemu_pid(const char *dir)
{
    char p[PATH_MAX + 16], buf[64];
    sp_qemu__sfmt(p, sizeof p, "%s/qemu.pid", dir);
    if (sp_qemu__read_small(p, buf, sizeof buf) <= 0)
        return 0;
    long pid = strtol(buf, NULL, 10);
    if (pid <= 1 || pid > INT_MAX)
        return 0;
    sp_qemu__sfmt(p, sizeof p, "/proc/%ld/stat", pid);
    char st[512];
    if (sp_qemu__read_small(p, st, sizeof st) <= 0)
        return 0;
    char *rp = strrchr(st, ')');
    if (rp == NULL || rp[1] != ' ' || rp[2] == 'Z' || rp[2] == 'X')
        return 0; /* a zombie is dead for our purposes */
    sp_qemu__sfmt(p, sizeof p, "/proc/%ld/cmdline", pid);
    int fd = open(p, O_RDONLY | O_CLOEXEC);
    if (fd < 0)
        return 0;
    size_t cap = 64 * 1024;
    char *cmd = malloc(cap + 1);
    ssize_t n = cmd != NULL ? read(fd, cmd, cap) : -1;
    close(fd);
    bool ours = false;
    if (n > 0) {
        for (ssize_t i = 0; i < n; i++)
            if (cmd[i] == '\0')
                cmd[i] = ' ';
        cmd[n] = '\0';
        char needle[PATH_MAX + 8];
        sp_qemu__sfmt(needle, sizeof needle, "%s/", dir);
        ours = strstr(cmd, needle) != NULL;
        if (!ours) {
            /* a spare clone taken by this sandbox: its command line names the spare's dir,
             * which sp_qemu__pool_take recorded before moving it here */
            char org[PATH_MAX], op[PATH_MAX + 16];
            sp_qemu__sfmt(op, sizeof op, "%s/pool.origin", dir);
            ssize_t k = sp_qemu__read_small(op, org, sizeof org);
            if (k > 0 && org[0] == '/') {
                sp_qemu__sfmt(needle, sizeof needle, "%s/", org);
                ours = strstr(cmd, needle) != NULL;
            }
        }
    }
    free(cmd);
    return ours ? (pid_t)pid : 0;
}

/* sp_qemu__live_qemu_pid() for a VM dir, except that a QEMU an earlier driver left before its boot
 * or restore finished (<vm>/booting is written before QEMU starts and removed once the agent has
 * taken IDENTITY) is killed and 0 returned: its state is unknown (maybe still waiting for its
 * device state, maybe paused, surely without its identity). A committed snapshot then makes
 * the sandbox SUSPENDED again, anything else ABSENT: the controller boots or wakes it again.
 * Blocks up to a second for the process to die. */
pid_t sp_qemu__live_vm_pid(sp_qemu_t *d, const char *id, const char *vdir)
{
    pid_t pid = sp_qemu__live_qemu_pid(vdir);
    char p[PATH_MAX + 16];
    sp_qemu__sfmt(p, sizeof p, "%s/booting", vdir);
    if (pid <= 0 || !sp_qemu__file_exists(p) || sp_qemu__vm_find(d, id) != NULL)
        return pid;
    sp_log(SP_LOG_WARN, "qemu", "killing a vm left mid-boot by an earlier driver sandbox=%s pid=%d",
           id, (int)pid);
    int pfd = sp_qemu__pidfd_open(pid);
    kill(-pid, SIGKILL);
    kill(pid, SIGKILL);
    if (pfd >= 0) {
        struct pollfd pf = {.fd = pfd, .events = POLLIN};
        poll(&pf, 1, 1000);
        close(pfd);
    }
    sp_qemu__cg_remove(d, id);
    static const char *const names[] = {"qmp.sock", "agent.sock", "qemu.pid", "paused", "booting"};
    for (size_t i = 0; i < sizeof names / sizeof names[0]; i++) {
        sp_qemu__sfmt(p, sizeof p, "%s/%s", vdir, names[i]);
        unlink(p);
    }
    return 0;
}

/* Removes the per-boot files of a VM dir; keeps the logs for debugging. */
static void remove_runtime_files(const struct vm *vm)
{
    static const char *const names[] = {"disk.qcow2", "qmp.sock", "agent.sock", "qemu.pid",
                                        "paused",     "vm.json",  "mem.ram",    "booting"};
    char p[PATH_MAX + 16];
    for (size_t i = 0; i < sizeof names / sizeof names[0]; i++) {
        sp_qemu__vm_path(vm, names[i], p, sizeof p);
        unlink(p);
    }
}

/* ---------- process exit, stopping ---------- */

void sp_qemu__on_vm_exit(sp_watch_t *w, int events, void *arg)
{
    struct vm *vm = arg;
    {
        /* Reap it if it is our child (started by this process, maybe by an earlier driver
         * object); for a QEMU inherited from a previous spaced this is ECHILD. */
        int st;
        pid_t r = waitpid(vm->pid, &st, WNOHANG);
        if (r == 0)
            return;
        if (r > 0 && vm->ph != PH_STOPPING)
            sp_log(SP_LOG_INFO, "qemu", "qemu exited sandbox=%s status=%d signal=%d", vm->id,
                   WIFEXITED(st) ? WEXITSTATUS(st) : -1, WIFSIGNALED(st) ? WTERMSIG(st) : 0);
    }
    vm->exited = true;
    sp_watch_destroy(vm->pw);
    vm->pw = NULL;
    if (vm->ph == PH_STOPPING) {
        sp_qemu__vm_finish(vm);
        return;
    }
    if (vm->ph == PH_SUSPENDING && vm->snap_step == SN_QUIT) {
        sp_qemu__suspend_finish(vm);
        return;
    }
    char tail[1024];
    sp_qemu__console_tail(vm, tail, sizeof tail);
    if (vm->ph < PH_UP) {
        sp_log(SP_LOG_WARN, "qemu", "guest did not come up: qemu exited sandbox=%s console=%s",
               vm->id, tail);
        vm->boot_failed = true;
        sp_err_set(&vm->boot_err, SP_ERUNTIME, "guest did not come up: the VM exited during boot");
    } else {
        sp_log(SP_LOG_WARN, "qemu", "vm exited unexpectedly sandbox=%s console=%s", vm->id, tail);
    }
    vm->keep_logs = true;
    vm->ph = PH_STOPPING;
    sp_qemu__vm_finish(vm);
}

static void on_kill_timer(sp_timer_t *t, void *arg)
{
    struct vm *vm = arg;
    if (vm->exited || vm->pid <= 0)
        return;
    sp_log(SP_LOG_INFO, "qemu", "killing qemu sandbox=%s pid=%d", vm->id, (int)vm->pid);
    kill(-vm->pid, SIGKILL);
    kill(vm->pid, SIGKILL);
    sp_timer_start(&vm->kill_timer, SP_QEMU_QUIT_GRACE_MS); /* keep at it until the pidfd fires */
}

static void on_quit_reply(void *arg, json_t *ret, const sp_err_t *err)
{
    /* Nothing: the pidfd tells us when QEMU is gone; the kill timer backs it up. */
}

/* Starts tearing the VM down. graceful: QMP quit first. sp_qemu__vm_finish runs once it is dead. */
void sp_qemu__vm_stop(struct vm *vm, bool graceful)
{
    if (vm->ph == PH_STOPPING)
        return;
    vm->ph = PH_STOPPING;
    sp_timer_stop(&vm->boot_timer);
    sp_timer_stop(&vm->qmp_timer);
    if (vm->ident != NULL) {
        sp_agentstream_t *s = vm->ident;
        vm->ident = NULL;
        sp_agentstream_reset(s);
    }
    sp_exec_cancel(vm->warm);
    vm->warm = NULL;
    if (vm->agent != NULL) {
        sp_agentconn_t *a = vm->agent;
        vm->agent = NULL;
        sp_agentconn_destroy(a);
    }
    if (vm->img != NULL) {
        kill(vm->img->pid, SIGKILL); /* on_img_exit sees PH_STOPPING and finishes */
        return;
    }
    if (vm->pid <= 0 || vm->exited || vm->pw == NULL) {
        sp_qemu__vm_finish(vm);
        return;
    }
    sp_err_t e;
    if (graceful && vm->qmp != NULL && !sp_qmp_closed(vm->qmp) && /* queued if not negotiated */
        sp_qmp_command(vm->qmp, "quit", NULL, -1, on_quit_reply, vm, &e) == 0) {
        sp_timer_start(&vm->kill_timer, SP_QEMU_QUIT_GRACE_MS);
    } else {
        on_kill_timer(&vm->kill_timer, vm);
    }
}

/* The VM's process is gone (or never started): remove what it had and answer waiters.
 * Always runs from a loop callback, never inside a driver call. */
void sp_qemu__vm_finish(struct vm *vm)
{
    sp_qemu_t *d = vm->d;
    sp_qemu__vm_disconnect(vm);
    if (vm->pid > 0 && !vm->exited && kill(vm->pid, 0) == 0) {
        kill(-vm->pid, SIGKILL); /* lost its pidfd watch somehow: make sure */
        kill(vm->pid, SIGKILL);
    }
    sp_qemu__cg_remove(d, vm->id);
    if (!vm->pooled)
        sp_qemu__pool_origin_remove(vm);
    if (vm->tsnap_build != NULL) {
        sp_qemu__tsnap_failed(vm, vm->boot_failed ? vm->boot_err.msg : "the builder VM went away");
    } else if (vm->clone_boot && vm->destroy_w == NULL && vm->boot_w != NULL && vm->tp != NULL) {
        /* A clone that did not come up: cold-boot the same sandbox instead; later boots
         * keep cloning (a snapshot that QEMU refuses fails every clone the same way, and
         * each of them then falls back here). */
        sp_log(SP_LOG_WARN, "qemu",
               "clone did not come up, falling back to a cold boot sandbox=%s err=%s", vm->id,
               vm->boot_failed ? vm->boot_err.msg : "qemu exited");
        if (vm->pidfd >= 0)
            close(vm->pidfd);
        vm->pidfd = -1;
        vm->pid = 0;
        vm->exited = false;
        vm->boot_failed = false;
        vm->keep_logs = false;
        vm->restoring = false;
        vm->clone_boot = false;
        vm->ram_wait = false;
        free(vm->clone_src);
        vm->clone_src = NULL;
        vm->tsnap_wait = NULL;
        vm->cold = true;
        sp_qemu__boot_progress(vm, "booting cold", "the clone of its template snapshot failed");
        vm->snap_step = SN_NONE;
        vm->paused = false;
        vm->ph = PH_WAIT_ACCEL;
        sp_timer_start(&vm->boot_timer, d->boot_timeout_ms);
        sp_qemu__kick(d);
        return;
    }
    if (vm->pooled) {
        if (vm->boot_failed)
            sp_qemu__pool_failed(d, vm->pool_key);
        sp_qemu__discard(vm->d,
                         vm->dir); /* a spare's logs were logged (console tail) when it failed */
    } else if (vm->restoring && vm->destroy_w == NULL) {
        /* a failed restore keeps the snapshot (disk, RAM file, device state) to retry */
        static const char *const names[] = {"qmp.sock", "agent.sock", "qemu.pid", "paused",
                                            "booting"};
        char p[PATH_MAX + 16];
        for (size_t i = 0; i < sizeof names / sizeof names[0]; i++) {
            sp_qemu__vm_path(vm, names[i], p, sizeof p);
            unlink(p);
        }
    } else if (vm->keep_logs && vm->destroy_w == NULL) {
        remove_runtime_files(vm);
    } else {
        sp_qemu__discard(vm->d, vm->dir);
    }
    sp_qemu__vm_unlink(vm);
    sp_err_t cancel;
    sp_err_set(&cancel, SP_ERUNTIME, "boot cancelled: the sandbox was deleted");
    sp_qemu__complete_all(d, &vm->boot_w, vm->boot_failed ? &vm->boot_err : &cancel);
    sp_err_set(&cancel, SP_ERUNTIME, "%s failed: the VM went away",
               vm->fork != NULL ? "snapshot" : "suspend");
    sp_qemu__complete_all(d, &vm->snap_w, &cancel);
    sp_qemu__complete_all(d, &vm->destroy_w, NULL);
    sp_qemu__vm_free(vm);
    if (d->snaps_pending)
        sp_qemu__snaps_gc(d, false); /* it may have been the last made from a deleted one */
}

static void on_console_tick(sp_timer_t *t, void *arg)
{
    sp_qemu_t *d = arg;
    for (struct vm *vm = d->vms; vm != NULL; vm = vm->next)
        if (vm->ph >= PH_START && vm->ph < PH_STOPPING)
            sp_qemu__console_trim(vm);
    sp_timer_start(&d->console_timer, SP_QEMU_CONSOLE_TICK_MS);
}

/* ---------- re-adoption ---------- */

/* Takes over a live QEMU found on disk: watch it, reconnect QMP and the agent channel.
 * NULL when pid is not watchable (gone in between). */
struct vm *sp_qemu__vm_adopt(sp_qemu_t *d, const char *id, pid_t pid)
{
    int pfd = sp_qemu__pidfd_open(pid);
    if (pfd < 0)
        return NULL;
    fcntl(pfd, F_SETFD, FD_CLOEXEC);
    struct vm *vm = sp_qemu__vm_new(d, id);
    if (vm == NULL) {
        close(pfd);
        return NULL;
    }
    vm->pid = pid;
    vm->pidfd = pfd;
    vm->adopted = true;
    vm->ph = PH_UP;
    sp_qemu__read_vm_json(vm);
    char p[PATH_MAX + 16];
    sp_qemu__vm_path(vm, "paused", p, sizeof p);
    vm->paused = sp_qemu__file_exists(p);
    vm->cg = sp_cgroup_vm_exists(d->cg, id); /* groups outlive spaced: nothing to redo */
    sp_qemu__confine_adopted(vm);            /* its uid stays taken */
    vm->pw = sp_watch_create(d->base.loop, vm->pidfd, sp_qemu__on_vm_exit, vm);
    if (vm->pw == NULL) {
        sp_qemu__vm_unlink(vm);
        sp_qemu__vm_free(vm);
        return NULL;
    }
    sp_watch_set(vm->pw, SP_IO_READ);
    vm_adopt_connect(vm);
    return vm;
}

static void vm_adopt_connect(struct vm *vm)
{
    sp_qemu__qmp_try_connect(vm);
    sp_qemu__agent_start(vm);
}

pid_t sp_qemu__leftover_remove(sp_qemu_t *d, const char *dir, const char *cid)
{
    pid_t pid = sp_qemu__live_qemu_pid(dir);
    if (pid > 0) {
        kill(-pid, SIGKILL);
        kill(pid, SIGKILL);
    }
    sp_qemu__discard(d, dir);
    sp_qemu__cg_remove(d, cid);
    return pid;
}

static void adopt_all(sp_qemu_t *d)
{
    DIR *dir = opendir(d->vms_dir);
    if (dir == NULL)
        return;
    struct dirent *de;
    int n = 0;
    while ((de = readdir(dir)) != NULL) {
        if (strncmp(de->d_name, ".tsnap-", 7) == 0) {
            /* a template snapshot builder of an earlier driver: never finished, never adopted
             * (one of a live driver in another process is left to it) */
            if (sp_qemu__tsnap_tmp_foreign(de->d_name))
                continue;
            char tdir[PATH_MAX], cid[SP_QEMU_ID_MAX + 1];
            sp_qemu__sfmt(tdir, sizeof tdir, "%s/%s", d->vms_dir, de->d_name);
            sp_qemu__tsnap_cid(cid, sizeof cid, de->d_name);
            sp_qemu__leftover_remove(d, tdir, cid);
            continue;
        }
        if (strncmp(de->d_name, ".pool-", 6) == 0) {
            char pdir[PATH_MAX];
            sp_qemu__sfmt(pdir, sizeof pdir, "%s/%s", d->vms_dir, de->d_name);
            struct stat lst;
            if (lstat(pdir, &lst) == 0 && S_ISLNK(lst.st_mode)) {
                /* the old name of a taken spare: kept while its QEMU runs */
                char tgt[PATH_MAX];
                ssize_t k = readlink(pdir, tgt, sizeof tgt - 1);
                tgt[k > 0 ? k : 0] = '\0';
                char tdir[PATH_MAX * 2];
                snprintf(tdir, sizeof tdir, "%s/%s", d->vms_dir, tgt);
                if (k <= 0 || strchr(tgt, '/') != NULL || sp_qemu__live_qemu_pid(tdir) <= 0)
                    unlink(pdir);
                continue;
            }
            /* a spare clone of an earlier driver: no sandbox, never adopted */
            if (sp_qemu__tsnap_tmp_foreign(de->d_name))
                continue;
            char cid[SP_QEMU_ID_MAX + 1];
            sp_qemu__sfmt(cid, sizeof cid, "pool:%.40s", de->d_name + 6);
            sp_qemu__leftover_remove(d, pdir, cid);
            continue;
        }
        if (strncmp(de->d_name, ".fetch-", 7) == 0) {
            /* a snapshot an earlier driver was copying in from the shared dir (shared.c) */
            char fdir[PATH_MAX];
            sp_qemu__sfmt(fdir, sizeof fdir, "%s/%s", d->vms_dir, de->d_name);
            if (!d->no_adopt && !sp_qemu__tsnap_tmp_foreign(de->d_name))
                sp_qemu__discard(d, fdir);
            continue;
        }
        if (d->no_adopt || !sp_qemu__valid_id(de->d_name) ||
            sp_qemu__vm_find(d, de->d_name) != NULL)
            continue;
        char vdir[PATH_MAX];
        sp_qemu__sfmt(vdir, sizeof vdir, "%s/%s", d->vms_dir, de->d_name);
        pid_t pid = sp_qemu__live_vm_pid(d, de->d_name, vdir);
        if (pid > 0 && sp_qemu__vm_adopt(d, de->d_name, pid) != NULL)
            n++;
    }
    closedir(dir);
    if (n > 0)
        sp_log(SP_LOG_INFO, "qemu", "re-adopting running vms count=%d", n);
}

/* ---------- driver ops ---------- */

/* Whether creates are served by spares here. */
static bool pool_on(const sp_qemu_t *d)
{
    return d->pool_size > 0 && !d->cold_only && d->accel >= 0 && d->sandbox >= 0;
}

/* Hands spec's create a spare of key if there is one (true: cb is answered by its boot).
 *
 * A spare skips the boot queue (admit_queued), and rightly: the queue keeps restores from all
 * running at once, and a ready spare needs no restore (a rename, `cont` and IDENTITY:
 * milliseconds of CPU). One still restoring was started under the pool's own rule (nothing
 * else booting) and is counted as a boot in flight from here on; one not yet started goes
 * through boot_begin like any clone boot, and so through the queue. Queueing a ready one
 * behind restores would make its create wait seconds for nothing. */
static bool take_spare(sp_qemu_t *d, const char *key, const sp_vm_spec_t *spec, sp_driver_cb cb,
                       void *arg)
{
    struct vm *spare = sp_qemu__pool_pick(d, key);
    bool taken = spare != NULL && sp_qemu__pool_take(spare, spec, cb, arg) == 0;
    sp_qemu__pool_count(taken);
    if (taken)
        sp_qemu__pool_kick(d);
    return taken;
}

/* A create from sandbox snapshot spec->snapshot_id: a spare restored from it when one is
 * there (as a template size's), else a restore of its own; either way the pool is told, so
 * spares of the snapshot are made for the next. */
static int fork_create(sp_qemu_t *d, const sp_vm_spec_t *spec, sp_driver_cb cb, void *arg,
                       sp_err_t *err)
{
    bool pool = pool_on(d);
    if (pool) {
        char key[17];
        sp_qemu__fork_pool_key(spec->snapshot_id, key);
        if (take_spare(d, key, spec, cb, arg)) {
            struct poolwant *pw = sp_qemu__pool_want(d, key);
            if (pw != NULL)
                sp_qemu__pool_seen(d, pw);
            return 0;
        }
    }
    if (sp_qemu__fork_boot(d, spec, cb, arg, err) < 0)
        return -1;
    struct vm *vm = sp_qemu__vm_find(d, spec->sandbox_id);
    if (pool && vm != NULL)
        sp_qemu__pool_note_fork(d, spec->snapshot_id, vm);
    return 0;
}

static int q_boot(sp_driver_t *base, const sp_vm_spec_t *spec, sp_driver_cb cb, void *arg,
                  sp_err_t *err)
{
    sp_qemu_t *d = (sp_qemu_t *)base;
    if (spec == NULL || !sp_qemu__valid_id(spec->sandbox_id))
        return sp_err_set(err, SP_EINVAL, "invalid sandbox id");
    if (d->no_adopt)
        return sp_err_set(err, SP_ECONFLICT, "this driver only builds template snapshots");
    struct vm *vm = sp_qemu__vm_find(d, spec->sandbox_id);
    if (vm == NULL) {
        char vdir[PATH_MAX];
        sp_qemu__sfmt(vdir, sizeof vdir, "%s/%s", d->vms_dir, spec->sandbox_id);
        pid_t pid = sp_qemu__live_vm_pid(d, spec->sandbox_id, vdir);
        if (pid > 0)
            vm = sp_qemu__vm_adopt(d, spec->sandbox_id, pid);
        else if (sp_qemu__snapshot_committed(vdir) && spec->snapshot_id != NULL)
            return sp_qemu__q_restore(base, spec, cb, arg, err); /* made from it, not yet up */
        else if (sp_qemu__snapshot_committed(vdir) ||
                 sp_qemu__shared_committed(d, spec->sandbox_id))
            return sp_err_set(err, SP_ECONFLICT, "sandbox has a snapshot: restore it instead");
    }
    if (vm != NULL) {
        if (vm->ph == PH_STOPPING)
            return sp_err_set(err, SP_ECONFLICT, "sandbox is being deleted");
        if (vm->ph == PH_UP) {
            if (sp_qemu__complete(d, cb, arg, NULL) < 0)
                return sp_err_set(err, SP_EINTERNAL, "out of memory");
            return 0;
        }
        return sp_qemu__add_waiter(&vm->boot_w, cb, arg, err); /* joins the boot in progress */
    }
    if (spec->env_json != NULL) {
        json_t *env = json_loads(spec->env_json, 0, NULL);
        bool ok = json_is_object(env);
        json_decref(env);
        if (!ok)
            return sp_err_set(err, SP_EINVAL, "env is not a JSON object");
    }
    if (spec->snapshot_id != NULL)
        return fork_create(d, spec, cb, arg, err);
    const char *tname = spec->template_name != NULL ? spec->template_name : "base";
    bool oom;
    sp_err_t te;
    sp_tmplbuild_paths_t *tp = sp_qemu__template_current(d, tname, &oom, &te);
    if (tp == NULL && oom)
        return sp_err_set(err, SP_EINTERNAL, "out of memory");
    if (tp == NULL) {
        sp_log(SP_LOG_WARN, "qemu", "template not usable template=%s err=%s", tname, te.msg);
        return sp_err_set(err, SP_ERUNTIME, "template %s is not built on this host", tname);
    }
    bool seen = false; /* the pool's policy counted this create */
    if (pool_on(d)) {
        int cpus = sp_qemu__vm_cpus(tp, spec->cpu_count);
        int mem = sp_qemu__vm_memory(tp, spec->memory_mb);
        char key[17];
        if (sp_qemu__tsnap_key_for(d, tp, cpus, mem, key) == 0) {
            struct poolwant *pw = sp_qemu__pool_want(d, key);
            if (pw != NULL) {
                sp_qemu__pool_seen(d, pw);
                seen = true;
            }
            if (take_spare(d, key, spec, cb, arg)) {
                free(tp);
                return 0;
            }
        }
    }
    vm = sp_qemu__vm_new_boot(d, spec->sandbox_id, tp, tname, spec->cpu_count, spec->memory_mb, cb,
                              arg, err);
    if (vm == NULL)
        return -1;
    vm->pool_seen = seen;
    vm->progress = spec->progress;
    vm->progress_arg = spec->progress_arg;
    vm->hostname = strdup(spec->hostname != NULL && *spec->hostname ? spec->hostname : "space");
    vm->env_json = spec->env_json != NULL ? strdup(spec->env_json) : NULL;
    sp_timer_start(&vm->boot_timer, d->boot_timeout_ms);
    sp_qemu__kick(d);
    return 0;
}

/* Template tname's current build (guest/tmplbuild.h), in a new allocation; NULL with *oom when
 * out of memory, else with te saying why it is not usable. A version ("name@hash") this host
 * lacks is imported from the shared snapshot dir first, when another worker published it. */
sp_tmplbuild_paths_t *sp_qemu__template_current(const sp_qemu_t *d, const char *tname, bool *oom,
                                                sp_err_t *te)
{
    sp_tmplbuild_paths_t *tp = calloc(1, sizeof(*tp));
    *oom = tp == NULL;
    if (tp != NULL && sp_tmplbuild_find(d->data_dir, d->shared_dir, tname, tp, te) < 0) {
        free(tp);
        tp = NULL;
    }
    if (tp != NULL)
        sp_qemu__shared_template(d, tname, tp); /* the images every worker has */
    return tp;
}

sp_tmplbuild_paths_t *sp_qemu__template_for(const sp_qemu_t *d, const char *tname, sp_err_t *err)
{
    bool oom;
    sp_err_t te;
    sp_tmplbuild_paths_t *tp = sp_qemu__template_current(d, tname, &oom, &te);
    if (tp == NULL && oom)
        sp_err_set(err, SP_EINTERNAL, "out of memory");
    else if (tp == NULL)
        sp_err_set(err, te.code == SP_EINVAL ? SP_EINVAL : SP_ENOTFOUND,
                   "template %.64s is not built on this host", tname);
    return tp;
}

/* The vCPUs of a VM of template build tp when cpu_count are asked (0: the template's). */
int sp_qemu__vm_cpus(const sp_tmplbuild_paths_t *tp, int cpu_count)
{
    return cpu_count > 0 ? cpu_count : (tp->cpu_count > 0 ? tp->cpu_count : 1);
}

/* Its RAM in MiB when memory_mb are asked (0: the template's). */
int sp_qemu__vm_memory(const sp_tmplbuild_paths_t *tp, int memory_mb)
{
    return memory_mb > 0 ? memory_mb : (tp->memory_mb > 0 ? tp->memory_mb : 256);
}

/* A new VM of template tname (tp: its current build, owned by the VM from here on, freed on
 * failure) for a boot or a template snapshot request, cb waiting for it, sized as asked
 * (sp_qemu__vm_cpus, sp_qemu__vm_memory), in PH_WAIT_ACCEL: the caller adds what is its own
 * and kicks. NULL with err set when out of memory. */
struct vm *sp_qemu__vm_new_boot(sp_qemu_t *d, const char *id, sp_tmplbuild_paths_t *tp,
                                const char *tname, int cpu_count, int memory_mb, sp_driver_cb cb,
                                void *arg, sp_err_t *err)
{
    struct vm *vm = sp_qemu__vm_new(d, id);
    if (vm == NULL || sp_qemu__add_waiter(&vm->boot_w, cb, arg, err) < 0) {
        free(tp);
        if (vm != NULL) {
            sp_qemu__vm_unlink(vm);
            sp_qemu__vm_free(vm);
        }
        sp_err_set(err, SP_EINTERNAL, "out of memory");
        return NULL;
    }
    vm->tp = tp;
    sp_qemu__sfmt(vm->template_name, sizeof vm->template_name, "%s", tname);
    vm->cpu_count = sp_qemu__vm_cpus(tp, cpu_count);
    vm->memory_mb = sp_qemu__vm_memory(tp, memory_mb);
    vm->disk_total = (uint64_t)(tp->disk_mb > 0 ? tp->disk_mb : 0) << 20;
    vm->ph = PH_WAIT_ACCEL;
    vm->boot_start_ms = sp_qemu__mono_ms();
    return vm;
}

struct vm *sp_qemu__running_vm(sp_qemu_t *d, const char *id, sp_err_t *err)
{
    struct vm *vm = id != NULL && sp_qemu__valid_id(id) ? sp_qemu__vm_find(d, id) : NULL;
    if (vm == NULL) {
        sp_err_set(err, SP_ENOTFOUND, "sandbox has no VM");
        return NULL;
    }
    if (vm->ph == PH_STOPPING) {
        sp_err_set(err, SP_ECONFLICT, "sandbox is being deleted");
        return NULL;
    }
    if (vm->ph == PH_SUSPENDING) {
        sp_err_set(err, SP_ECONFLICT, "sandbox is being suspended");
        return NULL;
    }
    if (vm->fork != NULL) {
        sp_err_set(err, SP_ECONFLICT, "a snapshot of the sandbox is being taken; try again");
        return NULL;
    }
    if (vm->ph != PH_UP) {
        sp_err_set(err, SP_ECONFLICT, "sandbox is still booting");
        return NULL;
    }
    if (vm->qmp == NULL || sp_qmp_closed(vm->qmp)) {
        sp_err_set(err, SP_EUNAVAIL, "VM control channel is not connected");
        return NULL;
    }
    return vm;
}

struct pr_op {
    struct vm *vm; /* valid while the QMP client lives: it dies with the VM */
    sp_qemu_t *d;
    bool pause;
    sp_driver_cb cb;
    void *arg;
    char id[SP_QEMU_ID_MAX + 1]; /* looked up again after waiting in vm->adopt_w */
};

static void on_pause_resume(void *arg, json_t *ret, const sp_err_t *err)
{
    struct pr_op *op = arg;
    if (err == NULL) {
        struct vm *vm = op->vm;
        char p[PATH_MAX + 16];
        sp_qemu__vm_path(vm, "paused", p, sizeof p);
        vm->paused = op->pause;
        if (op->pause)
            sp_qemu__write_atomic(p, "", 0);
        else
            unlink(p);
    } else {
        sp_log(SP_LOG_WARN, "qemu", "%s failed sandbox=%s err=%s", op->pause ? "stop" : "cont",
               op->vm->id, err->msg);
    }
    sp_err_t e;
    if (err != NULL)
        sp_err_set(&e, err->code == SP_EUNAVAIL ? SP_EUNAVAIL : SP_ERUNTIME, "%s failed: %s",
                   op->pause ? "pause" : "resume", err->msg);
    sp_qemu__complete(op->d, op->cb, op->arg, err != NULL ? &e : NULL);
    free(op);
}

static void pr_settled(void *arg, const sp_err_t *err);

/* Sends stop or cont, or waits for an adopted VM to settle first (boot.c: adopt_settled). */
static int pr_send(struct pr_op *op, sp_err_t *err)
{
    struct vm *vm = sp_qemu__running_vm(op->d, op->id, err);
    if (vm == NULL)
        return -1;
    op->vm = vm;
    if (vm->adopt_settling)
        return sp_qemu__add_waiter(&vm->adopt_w, pr_settled, op, err);
    return sp_qmp_command(vm->qmp, op->pause ? "stop" : "cont", NULL, -1, on_pause_resume, op, err);
}

/* The adopted VM settled (or went away: pr_send finds out). */
static void pr_settled(void *arg, const sp_err_t *err)
{
    struct pr_op *op = arg;
    sp_err_t e;
    if (pr_send(op, &e) < 0) {
        sp_qemu__complete(op->d, op->cb, op->arg, &e);
        free(op);
    }
}

static int pause_resume(sp_driver_t *base, const char *id, bool pause, sp_driver_cb cb, void *arg,
                        sp_err_t *err)
{
    sp_qemu_t *d = (sp_qemu_t *)base;
    if (sp_qemu__running_vm(d, id, err) == NULL)
        return -1;
    struct pr_op *op = calloc(1, sizeof(*op));
    if (op == NULL)
        return sp_err_set(err, SP_EINTERNAL, "out of memory");
    *op = (struct pr_op){NULL, d, pause, cb, arg, ""};
    sp_qemu__sfmt(op->id, sizeof op->id, "%s", id);
    if (pr_send(op, err) < 0) {
        free(op);
        return -1;
    }
    return 0;
}

static int q_pause(sp_driver_t *d, const char *id, sp_driver_cb cb, void *arg, sp_err_t *err)
{
    return pause_resume(d, id, true, cb, arg, err);
}

static int q_resume(sp_driver_t *d, const char *id, sp_driver_cb cb, void *arg, sp_err_t *err)
{
    return pause_resume(d, id, false, cb, arg, err);
}

static int q_destroy(sp_driver_t *base, const char *id, sp_driver_cb cb, void *arg, sp_err_t *err)
{
    sp_qemu_t *d = (sp_qemu_t *)base;
    if (!sp_qemu__valid_id(id))
        return sp_err_set(err, SP_EINVAL, "invalid sandbox id");
    struct vm *vm = sp_qemu__vm_find(d, id);
    char vdir[PATH_MAX];
    sp_qemu__sfmt(vdir, sizeof vdir, "%s/%s", d->vms_dir, id);
    if (vm == NULL) {
        pid_t pid = sp_qemu__live_vm_pid(d, id, vdir);
        if (pid > 0)
            vm = sp_qemu__vm_adopt(d, id, pid);
        if (vm == NULL && pid > 0) { /* could not watch it: kill it the blunt way */
            kill(-pid, SIGKILL);
            kill(pid, SIGKILL);
        }
    }
    sp_qemu__shared_forget(d, id); /* whichever worker deletes it */
    if (vm == NULL) {
        sp_qemu__cg_remove(d, id);
        sp_qemu__discard(d, vdir);
        if (d->snaps_pending)
            sp_qemu__snaps_gc(d, false);
        if (sp_qemu__complete(d, cb, arg, NULL) < 0)
            return sp_err_set(err, SP_EINTERNAL, "out of memory");
        return 0;
    }
    if (sp_qemu__add_waiter(&vm->destroy_w, cb, arg, err) < 0)
        return -1;
    if (vm->ph != PH_STOPPING) {
        vm->keep_logs = false;
        /* sp_qemu__vm_stop may finish at once (nothing running): that only queues completions. */
        sp_qemu__vm_stop(vm, vm->ph == PH_UP);
    }
    return 0;
}

static sp_vm_state_t q_probe(sp_driver_t *base, const char *id)
{
    sp_qemu_t *d = (sp_qemu_t *)base;
    if (!sp_qemu__valid_id(id))
        return SP_VM_ABSENT;
    struct vm *vm = sp_qemu__vm_find(d, id);
    if (vm != NULL) {
        if (vm->ph == PH_STOPPING)
            return SP_VM_ABSENT;
        return vm->paused ? SP_VM_PAUSED : SP_VM_RUNNING;
    }
    char vdir[PATH_MAX];
    sp_qemu__sfmt(vdir, sizeof vdir, "%s/%s", d->vms_dir, id);
    pid_t pid = sp_qemu__live_vm_pid(d, id, vdir);
    if (pid > 0) {
        vm = sp_qemu__vm_adopt(d, id, pid);
        if (vm != NULL)
            return vm->paused ? SP_VM_PAUSED : SP_VM_RUNNING;
    }
    if (sp_qemu__snapshot_committed(vdir) || sp_qemu__shared_committed(d, id) ||
        sp_qemu__shared_fetching(d, id))
        return SP_VM_SUSPENDED;
    struct stat st;
    if (stat(vdir, &st) == 0) {
        sp_log(SP_LOG_INFO, "qemu", "removing leftovers of a dead vm sandbox=%s", id);
        sp_qemu__discard(d, vdir);
    }
    /* Its group goes only if empty: no VM of ours is alive, so members would be another's. The
     * fleet probes sandboxes that moved to another worker (core/control/fleet.c: comeback),
     * and that worker's VM of the id may be in a group of the same name on this host. */
    if (sp_cgroup_vm_remove_empty(d->cg, id) < 0)
        sp_log(SP_LOG_WARN, "qemu", "cannot remove cgroup sandbox=%s err=%s", id, strerror(errno));
    return SP_VM_ABSENT;
}

static struct sp_agentconn *q_agent(sp_driver_t *base, const char *id)
{
    sp_qemu_t *d = (sp_qemu_t *)base;
    struct vm *vm = sp_qemu__valid_id(id) ? sp_qemu__vm_find(d, id) : NULL;
    if (vm == NULL || vm->ph == PH_STOPPING)
        return NULL;
    return vm->agent;
}

static uint64_t q_disk_bytes(sp_driver_t *base, const char *id)
{
    sp_qemu_t *d = (sp_qemu_t *)base;
    struct vm *vm = sp_qemu__valid_id(id) ? sp_qemu__vm_find(d, id) : NULL;
    if (vm == NULL || vm->pid <= 0 || vm->ph == PH_STOPPING)
        return 0; /* as q_stats: no VM, or a suspended one */
    return vm->disk_total;
}

static int q_stats(sp_driver_t *base, const char *id, sp_vm_stats_t *out, sp_err_t *err)
{
    sp_qemu_t *d = (sp_qemu_t *)base;
    struct vm *vm = sp_qemu__valid_id(id) ? sp_qemu__vm_find(d, id) : NULL;
    if (vm == NULL || vm->pid <= 0 || vm->ph == PH_STOPPING) {
        /* Suspended: no process, but the snapshot's size is what the sandbox costs. */
        char dir[PATH_MAX + 80];
        uint64_t snap = 0;
        if (sp_qemu__valid_id(id)) {
            sp_qemu__sfmt(dir, sizeof dir, "%s/%s", d->vms_dir, id);
            snap = sp_qemu__snapshot_bytes(dir);
            if (snap == 0)
                snap = sp_qemu__shared_bytes(d, id);
        }
        if (snap == 0)
            return sp_err_set(err, SP_ENOTFOUND, "sandbox has no VM");
        memset(out, 0, sizeof(*out));
        out->snapshot_bytes = snap;
        return 0;
    }
    memset(out, 0, sizeof(*out));
    out->cpu_count = vm->cpu_count;
    out->mem_total_bytes = (uint64_t)vm->memory_mb << 20;
    out->disk_total_bytes = vm->disk_total;

    char p[PATH_MAX + 32], buf[1024];
    sp_qemu__sfmt(p, sizeof p, "/proc/%d/stat", (int)vm->pid);
    if (sp_qemu__read_small(p, buf, sizeof buf) > 0) {
        char *rp = strrchr(buf, ')');
        unsigned long long ut = 0, stt = 0;
        /* fields after ")": state(3) ... utime(14) stime(15) */
        if (rp != NULL && sscanf(rp + 2, "%*c %*d %*d %*d %*d %*d %*u %*u %*u %*u %*u %llu %llu",
                                 &ut, &stt) == 2) {
            uint64_t ticks = ut + stt, now = sp_qemu__mono_ms();
            long hz = sysconf(_SC_CLK_TCK);
            if (vm->cpu_ms != 0 && now > vm->cpu_ms && hz > 0) {
                double used_ms = (double)(ticks - vm->cpu_ticks) * 1000.0 / (double)hz;
                double pct = used_ms * 100.0 / (double)(now - vm->cpu_ms) /
                             (double)(vm->cpu_count > 0 ? vm->cpu_count : 1);
                vm->cpu_pct = pct > 100.0 ? 100.0 : pct;
            }
            if (now - vm->cpu_ms >= 500 || vm->cpu_ms == 0) { /* keep intervals meaningful */
                vm->cpu_ticks = ticks;
                vm->cpu_ms = now;
            }
        }
    }
    out->cpu_used_pct = vm->cpu_pct;

    bool mem = false;
    if (vm->cg && sp_cgroup_vm_mem_used(d->cg, vm->id, &out->mem_used_bytes) == 0)
        mem = out->mem_used_bytes > 0;
    if (!mem) {
        sp_qemu__sfmt(p, sizeof p, "/proc/%d/status", (int)vm->pid);
        FILE *f = fopen(p, "re");
        if (f != NULL) {
            while (fgets(buf, sizeof buf, f) != NULL) {
                unsigned long long kb;
                if (sscanf(buf, "VmRSS: %llu kB", &kb) == 1) {
                    out->mem_used_bytes = kb << 10;
                    break;
                }
            }
            fclose(f);
        }
    }
    struct stat st;
    sp_qemu__vm_path(vm, "disk.qcow2", p, sizeof p);
    if (stat(p, &st) == 0)
        out->disk_used_bytes = (uint64_t)st.st_blocks * 512u;
    out->snapshot_bytes = sp_qemu__snapshot_bytes(vm->dir);
    sp_qemu__console_trim(vm);
    return 0;
}

static void q_free(sp_driver_t *base)
{
    sp_qemu_t *d = (sp_qemu_t *)base;
    /* VMs keep running: they are re-adopted by the next driver on this data dir. Template
     * snapshot builders and spare clones are no sandboxes and nobody would adopt them: they
     * go. */
    while (d->vms != NULL) {
        struct vm *vm = d->vms;
        d->vms = vm->next;
        if ((vm->tsnap_build != NULL || vm->pooled) && vm->pid > 0 && !vm->exited) {
            kill(-vm->pid, SIGKILL);
            kill(vm->pid, SIGKILL);
            if (vm->pidfd >= 0) { /* and reap it if it is our child */
                struct pollfd pf = {.fd = vm->pidfd, .events = POLLIN};
                poll(&pf, 1, 1000);
                waitpid(vm->pid, NULL, WNOHANG);
            }
            sp_qemu__cg_remove(d, vm->id); /* waits briefly for the group to empty */
            sp_rm_rf(vm->dir);
        }
        sp_qemu__vm_free(vm);
    }
    if (d->kvm_probe != NULL) {
        kill(d->kvm_probe->pid, SIGKILL);
        waitpid(d->kvm_probe->pid, NULL, 0); /* killed: returns at once */
        sp_qemu__child_free(d->kvm_probe);
    }
    if (d->sandbox_probe != NULL) {
        kill(d->sandbox_probe->pid, SIGKILL);
        waitpid(d->sandbox_probe->pid, NULL, 0);
        sp_qemu__child_free(d->sandbox_probe);
    }
    while (d->done_head != NULL) { /* the owner is going away: drop its callbacks */
        struct done *x = d->done_head;
        d->done_head = x->next;
        free(x);
    }
    sp_timer_stop(&d->done_timer);
    sp_timer_stop(&d->kick_timer);
    sp_timer_stop(&d->console_timer);
    sp_timer_stop(&d->pool_timer);
    sp_qemu__ahead_free(d);
    sp_qemu__pool_metrics_stop(d);
    while (d->wants != NULL) {
        struct poolwant *w = d->wants;
        d->wants = w->next;
        free(w);
    }
    sp_poolpolicy_destroy(d->policy);
    while (d->tsnaps != NULL) {
        struct tsnap *t = d->tsnaps;
        d->tsnaps = t->next;
        free(t);
    }
    sp_cgroup_destroy(d->cg);
    sp_qemu__confine_free(d);
    sp_qemu__shared_free(d);
    free(d->qemu);
    free(d->qemu_img);
    free(d);
}

static size_t q_insecure(sp_driver_t *base, const char **out, size_t n)
{
    return sp_qemu__confine_insecure((sp_qemu_t *)base, out, n);
}

const sp_driver_ops_t sp_qemu__ops = {
    .name = "qemu",
    .boot = q_boot,
    .pause = q_pause,
    .resume = q_resume,
    .snapshot = sp_qemu__q_snapshot,
    .restore = sp_qemu__q_restore,
    .destroy = q_destroy,
    .probe = q_probe,
    .agent = q_agent,
    .stats = q_stats,
    .free = q_free,
    .insecure = q_insecure,
    .export_disk = sp_qemu__q_export_disk,
    .image_standalone = sp_qemu__q_image_standalone,
    .grow_disk = sp_qemu__q_grow_disk,
    .checkpoint = sp_qemu__q_checkpoint,
    .checkpoint_delete = sp_qemu__q_checkpoint_delete,
    .checkpoint_exists = sp_qemu__q_checkpoint_exists,
    .checkpoint_shared = sp_qemu__q_checkpoint_shared,
    .checkpoint_bytes = sp_qemu__q_checkpoint_bytes,
    .disk_bytes = q_disk_bytes,
    .checkpoint_list = sp_qemu__q_checkpoint_list,
    .prepare = sp_qemu__q_prepare,
    .templates = sp_qemu__q_templates,
    .template_forget = sp_qemu__q_template_forget,
};

/* The spare pool's policy: pool_size per size at most, within opts' or $SPACE_POOL_MEMORY_MB's
 * budget (else host RAM / SP_QEMU_POOL_RAM_DIV), and the host memory spares leave alone
 * ($SPACE_POOL_RESERVE_MB, else host RAM / SP_QEMU_POOL_RESERVE). -1 when out of memory. */
static int pool_policy_create(sp_qemu_t *d, const sp_qemu_opts_t *o)
{
    long long mb = o->pool_memory_mb;
    const char *env = getenv("SPACE_POOL_MEMORY_MB");
    if (mb <= 0 && env != NULL && *env != '\0') {
        char *end;
        mb = strtoll(env, &end, 10);
        if (*end != '\0' || mb < 0)
            mb = 0;
    }
    long pages = sysconf(_SC_PHYS_PAGES), psz = sysconf(_SC_PAGESIZE);
    long long ram_mb = pages > 0 && psz > 0 ? (long long)pages * psz / 1048576 : 0;
    if (mb <= 0)
        mb = ram_mb > 0 ? ram_mb / SP_QEMU_POOL_RAM_DIV : 1024;
    /* the host's memory spares leave alone: opts', SPACE_POOL_RESERVE_MB, else a share of its
     * RAM */
    long long reserve = o->pool_reserve_mb < 0   ? 0
                        : o->pool_reserve_mb > 0 ? o->pool_reserve_mb
                                                 : ram_mb / SP_QEMU_POOL_RESERVE;
    const char *renv = getenv("SPACE_POOL_RESERVE_MB");
    if (o->pool_reserve_mb == 0 && renv != NULL && *renv != '\0') {
        char *end;
        long long v = strtoll(renv, &end, 10);
        if (*end == '\0' && v >= 0)
            reserve = v;
    }
    d->pool_reserve_mb = (uint64_t)reserve;
    sp_poolpolicy_opts_t po = {.max_per_size = d->pool_size,
                               .budget_mb = (uint64_t)mb,
                               .window_ms = SP_QEMU_POOL_WINDOW_MS,
                               .decay_ms = SP_QEMU_POOL_DECAY_MS};
    d->policy = sp_poolpolicy_create(&po);
    if (d->policy == NULL)
        return -1;
    sp_log(SP_LOG_DEBUG, "qemu", "spare pool per_size_max=%d memory_mb=%lld reserve_mb=%lld",
           d->pool_size, mb, reserve);
    return 0;
}

sp_driver_t *sp_qemu_create(sp_loop_t *loop, const sp_qemu_opts_t *o, sp_err_t *err)
{
    if (o == NULL || o->data_dir == NULL || *o->data_dir == '\0') {
        sp_err_set(err, SP_EINVAL, "qemu driver needs a data directory");
        return NULL;
    }
    int want = 0;
    if (o->accel == NULL || strcmp(o->accel, "auto") == 0)
        want = 0;
    else if (strcmp(o->accel, "kvm") == 0)
        want = 1;
    else if (strcmp(o->accel, "tcg") == 0)
        want = 2;
    else {
        sp_err_set(err, SP_EINVAL, "accel must be auto, kvm or tcg");
        return NULL;
    }
    sp_qemu_t *d = calloc(1, sizeof(*d));
    if (d == NULL) {
        sp_err_set(err, SP_EINTERNAL, "out of memory");
        return NULL;
    }
    d->base.ops = &sp_qemu__ops;
    d->base.loop = loop;
    d->want = want;
    char abs[PATH_MAX];
    if (strlen(o->data_dir) > PATH_MAX - 256) {
        free(d);
        sp_err_set(err, SP_EINVAL, "data directory path is too long");
        return NULL;
    }
    if (realpath(o->data_dir, abs) == NULL)
        sp_qemu__sfmt(abs, sizeof abs, "%s", o->data_dir);
    sp_qemu__sfmt(d->data_dir, sizeof d->data_dir, "%s", abs);
    sp_qemu__sfmt(d->vms_dir, sizeof d->vms_dir, "%s/vms", abs);
    sp_qemu__sfmt(d->snaps_dir, sizeof d->snaps_dir, "%s/snapshots", abs);
    d->qemu = strdup(o->qemu != NULL ? o->qemu : "qemu-system-x86_64");
    d->qemu_img = strdup(o->qemu_img != NULL ? o->qemu_img : "qemu-img");
    d->max_layers = o->max_layers > 0 ? o->max_layers : SP_QEMU_MAX_LAYERS;
    d->boot_timeout_ms = sp_qemu__env_ms("SPACE_BOOT_TIMEOUT_MS", SP_QEMU_BOOT_TIMEOUT_MS);
    d->probe_ms = sp_qemu__env_ms("SPACE_KVM_PROBE_MS", SP_QEMU_KVM_PROBE_MS);
    const char *cold = getenv("SPACE_COLD_BOOT");
    d->cold_only = o->cold_boot || (cold != NULL && strcmp(cold, "1") == 0);
    d->no_adopt = o->no_adopt != 0;
    sp_timer_init(&d->done_timer, loop, on_done_timer, d);
    sp_timer_init(&d->kick_timer, loop, sp_qemu__on_kick, d);
    sp_timer_init(&d->console_timer, loop, on_console_tick, d);
    sp_timer_init(&d->pool_timer, loop, sp_qemu__on_pool_timer, d);
    sp_timer_init(&d->ahead_timer, loop, sp_qemu__on_ahead_timer, d);
    {
        long ps = o->pool_size;
        const char *env = getenv("SPACE_POOL_SIZE");
        if (ps == 0 && env != NULL && *env != '\0') {
            char *end;
            ps = strtol(env, &end, 10);
            if (*end != '\0' || ps < 0)
                ps = SP_QEMU_POOL_DEFAULT;
            else if (ps == 0)
                ps = -1;
        } else if (ps == 0) {
            ps = SP_QEMU_POOL_DEFAULT;
        }
        d->pool_size = ps < 0 || o->no_adopt || o->cold_boot ? 0
                       : ps > SP_QEMU_POOL_MAX               ? SP_QEMU_POOL_MAX
                                                             : (int)ps;
    }
    if (d->qemu == NULL || d->qemu_img == NULL) {
        q_free(&d->base);
        sp_err_set(err, SP_EINTERNAL, "out of memory");
        return NULL;
    }
    if (!sp_qemu__have_program(d->qemu) || !sp_qemu__have_program(d->qemu_img)) {
        sp_log(SP_LOG_WARN, "qemu", "qemu not found qemu=%s qemu_img=%s", d->qemu, d->qemu_img);
        q_free(&d->base);
        sp_err_set(err, SP_ERUNTIME, "QEMU (qemu-system-x86_64, qemu-img) is not installed");
        return NULL;
    }
    {
        char qp[PATH_MAX];
        struct stat qs;
        if (sp_qemu__resolve_program(d->qemu, qp) && stat(qp, &qs) == 0)
            sp_qemu__sfmt(d->qemu_ident, sizeof d->qemu_ident, "%s:%lld:%lld", qp,
                          (long long)qs.st_size, (long long)qs.st_mtime);
        else
            sp_qemu__sfmt(d->qemu_ident, sizeof d->qemu_ident, "%s", d->qemu);
    }
    if (d->cold_only) {
        sp_log(SP_LOG_INFO, "qemu", "template snapshots off: every boot is a cold boot");
        d->pool_size = 0;
    }
    {
        long cpus = sysconf(_SC_NPROCESSORS_ONLN);
        d->boot_slots = cpus > 2 ? (int)cpus : 2;
    }
    if (d->pool_size > 0 && pool_policy_create(d, o) < 0) {
        q_free(&d->base);
        sp_err_set(err, SP_EINTERNAL, "out of memory");
        return NULL;
    }
    /* 0700: each QEMU reaches its own directory through its jail's bind mount, never
     * through vms/ */
    if ((mkdir(d->vms_dir, 0700) < 0 && errno != EEXIST) || chmod(d->vms_dir, 0700) < 0) {
        sp_log(SP_LOG_ERROR, "qemu", "cannot create dir=%s err=%s", d->vms_dir, strerror(errno));
        q_free(&d->base);
        sp_err_set(err, SP_ERUNTIME, "cannot create the VM directory");
        return NULL;
    }
    if (sp_qemu__confine_init(d, o, err) < 0 || sp_qemu__shared_init(d, o->snapshot_dir, err) < 0) {
        q_free(&d->base);
        return NULL;
    }

    d->accel = -1;
    if (want == 1) {
        d->accel = 1;
        sp_qemu__record_accel(d, "accel=kvm configured");
    } else if (want == 2) {
        d->accel = 0;
        sp_qemu__record_accel(d, "accel=tcg configured");
    } else {
        int fd = open("/dev/kvm", O_RDWR | O_CLOEXEC);
        if (fd < 0) {
            char why[160];
            sp_qemu__sfmt(why, sizeof why, "/dev/kvm is not usable (%s); using TCG",
                          strerror(errno));
            d->accel = 0;
            sp_qemu__record_accel(d, why);
        } else {
            close(fd); /* opening proves little (PVM opens fine): the first boot probes */
            d->accel = sp_qemu__cached_probe_verdict(d);
            if (d->accel >= 0)
                sp_log(SP_LOG_INFO, "qemu",
                       "accelerator=%s reason=\"verdict of an earlier probe in this host boot "
                       "(delete vms/accel to probe again)\"",
                       d->accel == 1 ? "kvm" : "tcg");
        }
    }
    d->sandbox = -1;
    sp_qemu__start_sandbox_probe(d);
    d->cg = sp_cgroup_create();
    if (sp_cgroup_kind(d->cg) == SP_CGROUP_NONE)
        sp_log(SP_LOG_WARN, "qemu", "no per-VM cgroup limits: %s (%s)", sp_cgroup_why(d->cg),
               d->allow_no_cgroups ? "--insecure-no-cgroups: VMs run without cpu/memory/pids "
                                     "limits"
                                   : "VMs do not start unless spaced runs with "
                                     "--insecure-no-cgroups");
    else
        sp_log(SP_LOG_INFO, "qemu", "per-VM cgroup limits: %s", sp_cgroup_why(d->cg));
    if (!d->no_adopt)
        sp_qemu__discard_leftovers(d);
    adopt_all(d);
    sp_qemu__snaps_gc(d, true);
    sp_qemu__pool_metrics_start(d);
    sp_qemu__tsnap_gc(d); /* a no-op until the accelerator is known (then on_kvm_probe runs it) */
    sp_timer_start(&d->console_timer, SP_QEMU_CONSOLE_TICK_MS);
    return &d->base;
}
