/*
 * boot.c - a VM's boot, from a driver call to up: the accelerator and seccomp probes, the
 * disk overlay, QEMU's command line and process, QMP, the agent channel and IDENTITY.
 *
 * boot_begin decides where a boot goes once the accelerator is known (its own snapshot,
 * cold, or a clone of a template snapshot); everything after QEMU started is the same for
 * all of them: QMP connects, a restore loads its device state (snapshot.c), the agent says
 * HELLO, IDENTITY goes, boot_done answers the waiters. A failure stops the VM (driver.c
 * finishes it). Does not decide which snapshot a clone uses (tsnap.c) nor take spares
 * (pool.c).
 */
#include "core/runtime/qemu/qemu_int.h"

#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "base/log.h"
#include "guest/bootargs.h"

/* ---------- QMP ---------- */

void sp_qemu__boot_fail(struct vm *vm, const char *fmt, const char *detail)
{
    vm->boot_failed = true;
    sp_err_set(&vm->boot_err, SP_ERUNTIME, fmt, detail);
    vm->keep_logs = true;
    sp_qemu__vm_stop(vm, false);
}

/* ---------- settling an adopted VM ---------- */

/* An earlier driver may have died mid-suspend: its migration would stop the VM when it
 * completes and nobody would commit the snapshot. On adoption it is cancelled (a no-op when
 * none is in flight) and waited out, then the run state is read (on_status). QEMU refuses
 * cont while a migration finishes ("Migration is not finalized yet"), and a stopped VM left
 * in postmigrate must be told from one paused by the user: so pause and resume wait in
 * vm->adopt_w until this is over (driver.c: pause_resume). Bounded by
 * SP_QEMU_ADOPT_SETTLE_MS; the waiters then go on and QEMU answers them as it will. */
static void on_status(void *arg, json_t *ret, const sp_err_t *err);

static void adopt_settled(struct vm *vm)
{
    if (!vm->adopt_settling)
        return;
    vm->adopt_settling = false;
    sp_timer_stop(&vm->adopt_timer);
    sp_qemu__complete_all(vm->d, &vm->adopt_w, NULL);
}

static bool adopt_overdue(const struct vm *vm)
{
    return sp_qemu__mono_ms() - vm->adopt_ms >= SP_QEMU_ADOPT_SETTLE_MS;
}

static void on_adopt_migrate(void *arg, json_t *ret, const sp_err_t *err)
{
    struct vm *vm = arg;
    if (err != NULL) { /* QMP lost (a reconnect settles again) or refused: go on */
        sp_log(SP_LOG_WARN, "qemu", "query-migrate failed sandbox=%s err=%s", vm->id, err->msg);
        adopt_settled(vm);
        return;
    }
    const char *st = json_string_value(json_object_get(ret, "status"));
    if (st != NULL && strcmp(st, "completed") != 0 && strcmp(st, "failed") != 0 &&
        strcmp(st, "cancelled") != 0 && strcmp(st, "none") != 0 && !adopt_overdue(vm)) {
        sp_timer_start(&vm->adopt_timer, 20); /* still writing; cancelling */
        return;
    }
    vm->adopt_step = 1;
    sp_err_t e;
    if (sp_qmp_command(vm->qmp, "query-status", NULL, -1, on_status, vm, &e) < 0)
        adopt_settled(vm);
}

void sp_qemu__on_adopt_timer(sp_timer_t *t, void *arg)
{
    struct vm *vm = arg;
    sp_err_t e;
    if (vm->qmp == NULL ||
        sp_qmp_command(vm->qmp, vm->adopt_step == 0 ? "query-migrate" : "query-status", NULL, -1,
                       vm->adopt_step == 0 ? on_adopt_migrate : on_status, vm, &e) < 0)
        adopt_settled(vm);
}

static void on_status(void *arg, json_t *ret, const sp_err_t *err)
{
    struct vm *vm = arg;
    if (err != NULL) {
        sp_log(SP_LOG_WARN, "qemu", "query-status failed sandbox=%s err=%s", vm->id, err->msg);
        adopt_settled(vm);
        return;
    }
    const char *st = json_string_value(json_object_get(ret, "status"));
    if (vm->adopt_settling && st != NULL && strcmp(st, "finish-migrate") == 0 &&
        !adopt_overdue(vm)) {
        /* the migration is over; QEMU moves the VM on to postmigrate (or back) next */
        sp_timer_start(&vm->adopt_timer, 20);
        return;
    }
    vm->paused = st != NULL && strcmp(st, "running") != 0;
    char p[PATH_MAX + 16];
    sp_qemu__vm_path(vm, "paused", p, sizeof p);
    if (vm->adopted && vm->ph == PH_UP && vm->qmp != NULL && st != NULL &&
        !sp_qemu__file_exists(p) && (strcmp(st, "postmigrate") == 0 || strcmp(st, "paused") == 0)) {
        /* Stopped, but not by pause() (which leaves the marker): a suspend that an earlier
         * driver never committed. Give it back running, as probe() reported it. */
        sp_err_t e;
        sp_log(SP_LOG_INFO, "qemu",
               "resuming a vm stopped by an unfinished suspend sandbox=%s "
               "status=%s",
               vm->id, st);
        if (sp_qmp_command(vm->qmp, "cont", NULL, -1, NULL, NULL, &e) == 0)
            vm->paused = false;
    }
    if (vm->ph == PH_UP) {
        if (vm->paused)
            sp_qemu__write_atomic(p, "", 0);
        else
            unlink(p);
    }
    if (vm->adopted)
        sp_log(SP_LOG_INFO, "qemu", "re-adopted vm sandbox=%s pid=%d status=%s", vm->id,
               (int)vm->pid, st ? st : "?");
    adopt_settled(vm);
}

static void on_qmp_ready(sp_qmp_t *q, void *arg)
{
    struct vm *vm = arg;
    sp_err_t e;
    sp_log(SP_LOG_DEBUG, "qemu", "qmp ready sandbox=%s ms=%llu", vm->id,
           (unsigned long long)(sp_qemu__mono_ms() - vm->boot_start_ms));
    if (vm->ph == PH_START && vm->restoring) {
        sp_qemu__restore_begin(vm);
        return;
    }
    if (vm->adopted) { /* settle it first (adopt_settled) */
        vm->adopt_settling = true;
        vm->adopt_step = 0;
        vm->adopt_ms = sp_qemu__mono_ms();
        sp_qmp_command(q, "migrate_cancel", NULL, -1, NULL, NULL, &e);
        if (sp_qmp_command(q, "query-migrate", NULL, -1, on_adopt_migrate, vm, &e) < 0)
            adopt_settled(vm);
    } else {
        sp_qmp_command(q, "query-status", NULL, -1, on_status, vm, &e);
    }
    if (vm->ph == PH_START) {
        vm->ph = PH_AGENT;
        sp_qemu__agent_start(vm);
    }
}

static void on_qmp_event(sp_qmp_t *q, const char *ev, json_t *data, void *arg)
{
    struct vm *vm = arg;
    if (strcmp(ev, "STOP") == 0)
        vm->paused = true;
    else if (strcmp(ev, "RESUME") == 0)
        vm->paused = false;
    else if (strcmp(ev, "SHUTDOWN") == 0)
        sp_log(SP_LOG_DEBUG, "qemu", "qemu shutting down sandbox=%s", vm->id);
}

static void on_qmp_closed(sp_qmp_t *q, const sp_err_t *err, void *arg)
{
    struct vm *vm = arg;
    sp_qmp_destroy(vm->qmp);
    vm->qmp = NULL;
    if (vm->ph == PH_STOPPING || vm->exited)
        return;
    /* QEMU alive but QMP gone (it allows one client): try again shortly. */
    vm->qmp_tries = 0;
    sp_timer_start(&vm->qmp_timer, 200);
}

static const sp_qmp_cbs_t qmp_cbs = {on_qmp_ready, on_qmp_event, on_qmp_closed};

void sp_qemu__qmp_try_connect(struct vm *vm)
{
    char p[PATH_MAX + 16];
    sp_qemu__vm_path(vm, "qmp.sock", p, sizeof p);
    sp_err_t e;
    vm->qmp = sp_qmp_connect(vm->d->base.loop, p, &qmp_cbs, vm, &e);
    if (vm->qmp != NULL)
        return;
    vm->qmp_tries++;
    /* Booting: QEMU creates the socket soon after exec; the boot timer bounds us.
     * Adopted: back off to 1 s and give up after a minute (the VM stays usable via its agent). */
    if (vm->ph == PH_START) {
        sp_timer_start(&vm->qmp_timer, 1); /* QEMU listens shortly after exec; a failed
                                            * connect costs microseconds */
    } else if (vm->qmp_tries < 120) {
        sp_timer_start(&vm->qmp_timer, vm->qmp_tries < 10 ? 100 : 1000);
    } else {
        sp_log(SP_LOG_WARN, "qemu", "qmp unreachable sandbox=%s err=%s", vm->id, e.msg);
    }
}

void sp_qemu__on_qmp_timer(sp_timer_t *t, void *arg)
{
    struct vm *vm = arg;
    if (vm->qmp == NULL && vm->ph != PH_STOPPING && !vm->exited)
        sp_qemu__qmp_try_connect(vm);
}

/* ---------- agent, identity ---------- */

/* vm.json without "ram_src": the VM has its own RAM file now. */
static void vm_json_own_ram(struct vm *vm)
{
    char p[PATH_MAX + 16];
    sp_qemu__vm_path(vm, "vm.json", p, sizeof p);
    json_t *o = json_load_file(p, 0, NULL);
    if (o == NULL)
        return;
    json_object_del(o, "ram_src");
    char *js = json_dumps(o, JSON_COMPACT);
    json_decref(o);
    if (js == NULL || sp_qemu__write_atomic(p, js, strlen(js)) < 0)
        sp_log(SP_LOG_WARN, "qemu", "cannot update vm.json sandbox=%s", vm->id);
    free(js);
}

/* A restored VM is up: from here on the disk moves on, so its snapshot must never be restored
 * again. */
static void restore_done(struct vm *vm)
{
    if (vm->restore_stream) {
        vm_json_own_ram(vm);
        vm->restore_stream = false;
    }
    vm->restore_delta = false; /* still a clone of the template's RAM: ram_src stays */
    if (vm->restoring) {
        char p[PATH_MAX + 32];
        sp_qemu__vm_path(vm, "snapshot/manifest.json", p, sizeof p);
        unlink(p);
        sp_qemu__vm_path(vm, "snapshot", p, sizeof p);
        sp_qemu__discard(vm->d, p);
        sp_qemu__shared_forget(vm->d, vm->id); /* the copy it was fetched from is spent too */
        vm->restoring = false;
        vm->snap_step = SN_NONE;
    }
}

static void boot_done(struct vm *vm)
{
    vm->ph = PH_UP;
    sp_timer_stop(&vm->boot_timer);
    {
        char p[PATH_MAX + 16];
        sp_qemu__vm_path(vm, "booting", p, sizeof p);
        unlink(p); /* a later driver adopts this VM as it is (sp_qemu__live_vm_pid) */
    }
    sp_log(SP_LOG_INFO, "qemu", "vm up sandbox=%s pid=%d accel=%s how=%s boot_ms=%llu", vm->id,
           (int)vm->pid, vm->d->accel == 1 ? "kvm" : "tcg",
           vm->clone_boot  ? "clone"
           : vm->restoring ? "restore"
                           : "cold",
           (unsigned long long)(sp_qemu__mono_ms() - vm->boot_start_ms));
    if (!vm->pooled && vm->tsnap_build == NULL)
        vm->d->pool_quiet_until = sp_qemu__mono_ms() + SP_QEMU_POOL_SETTLE_MS;
    if (vm->tsnap_build != NULL) {
        /* from a seed: its linked device state must not be written */
        restore_done(vm);
        sp_qemu__tsnap_warmup(vm); /* keeps tp: nothing waits on a builder's boot */
        return;
    }
    if (vm->clone_boot) {
        vm->clone_boot = false;
        vm->restoring = false;
        vm->snap_step = SN_NONE;
    }
    if (vm->pooled) {
        if (vm->pool_fork) { /* restored from a sandbox snapshot: no boot to fall back to */
            restore_done(vm);
            free(vm->tp);
            vm->tp = NULL;
        }
        /* a clone keeps tp: a sandbox that takes it may still fall back to a boot */
        sp_qemu__pool_warm(vm);
        return;
    }
    free(vm->tp);
    vm->tp = NULL;
    sp_qemu__pool_kick(vm->d); /* spares wait for boots in flight: maybe this was the last one */
    sp_timer_start(&vm->d->kick_timer, 0); /* a boot slot is free for a queued clone boot */
    restore_done(vm);
    sp_qemu__complete_all(vm->d, &vm->boot_w, NULL);
}

static void on_ident_frame(sp_agentstream_t *s, uint16_t type, uint16_t flags,
                           const uint8_t *payload, size_t len, void *arg)
{
    struct vm *vm = arg;
    if (!(flags & SP_AP_F_END))
        return;
    vm->ident = NULL; /* freed by agentconn after this returns */
    if (vm->ph != PH_IDENTITY)
        return;
    if (type == SP_AP_T_OK) {
        boot_done(vm);
    } else {
        sp_log(SP_LOG_WARN, "qemu", "guest rejected identity sandbox=%s type=%u", vm->id,
               (unsigned)type);
        sp_qemu__boot_fail(vm, "guest did not come up: %s", "the agent rejected its identity");
    }
}

static void on_ident_error(sp_agentstream_t *s, const sp_err_t *err, void *arg)
{
    struct vm *vm = arg;
    vm->ident = NULL;
    if (vm->ph == PH_IDENTITY)
        vm->ph = PH_AGENT; /* the channel dropped: send it again when it is back up */
}

static const sp_agentstream_cbs_t ident_cbs = {on_ident_frame, on_ident_error, NULL};

/* IDENTITY: hostname, sandbox id, default env, fresh RNG seed, wall clock. */
void sp_qemu__send_identity(struct vm *vm)
{
    size_t cap = 256 * 1024;
    uint8_t *buf = malloc(cap);
    if (buf == NULL) {
        sp_qemu__boot_fail(vm, "%s", "out of memory");
        return;
    }
    sp_ap_writer_t w;
    sp_ap_writer_init(&w, buf, cap);
    sp_ap_put_str(&w, SP_AP_K_HOSTNAME, vm->hostname);
    sp_ap_put_str(&w, SP_AP_K_SANDBOX_ID, vm->id);
    if (vm->env_json != NULL) {
        json_t *env = json_loads(vm->env_json, 0, NULL);
        const char *k;
        json_t *v;
        json_object_foreach(env, k, v)
        {
            if (!json_is_string(v))
                continue;
            char *kv = NULL;
            if (asprintf(&kv, "%s=%s", k, json_string_value(v)) >= 0) {
                sp_ap_put_str(&w, SP_AP_K_ENV, kv);
                free(kv);
            }
        }
        json_decref(env);
    }
    uint8_t seed[32];
    if (getrandom(seed, sizeof seed, 0) == (ssize_t)sizeof seed)
        sp_ap_put_bytes(&w, SP_AP_K_SEED, seed, sizeof seed);
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    sp_ap_put_u64(&w, SP_AP_K_TIME_NS, (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec);
    if (w.overflow) {
        free(buf);
        sp_qemu__boot_fail(vm, "%s", "sandbox environment is too large");
        return;
    }
    sp_err_t e;
    vm->ph = PH_IDENTITY;
    vm->ident = sp_agentconn_open(vm->agent, SP_AP_T_IDENTITY, buf, w.len, &ident_cbs, vm, &e);
    free(buf);
    if (vm->ident == NULL) {
        vm->ph = PH_AGENT; /* channel went down in between: retried on the next up */
        sp_log(SP_LOG_DEBUG, "qemu", "identity not sent sandbox=%s err=%s", vm->id, e.msg);
    }
}

static void on_agent_state(void *arg, bool up)
{
    struct vm *vm = arg;
    if (vm->agent == NULL)
        return; /* being destroyed */
    sp_log(SP_LOG_DEBUG, "qemu", "agent channel sandbox=%s up=%d ms=%llu", vm->id, (int)up,
           (unsigned long long)(sp_qemu__mono_ms() - vm->boot_start_ms));
    if (up && vm->ph == PH_AGENT)
        sp_qemu__send_identity(vm);
}

void sp_qemu__agent_start(struct vm *vm)
{
    if (vm->agent != NULL)
        return;
    char p[PATH_MAX + 16];
    sp_qemu__vm_path(vm, "agent.sock", p, sizeof p);
    vm->agent = sp_agentconn_create(vm->d->base.loop, p, on_agent_state, vm);
    if (vm->agent == NULL && vm->ph < PH_UP)
        sp_qemu__boot_fail(vm, "%s", "cannot create the agent channel");
    else if (vm->agent != NULL && vm->tsnap_build == NULL)
        sp_agentconn_set_sandbox(vm->agent, vm->id); /* the egress proxy attaches here (a
                                                      * spare: renamed by sp_qemu__pool_take) */
}

void sp_qemu__on_boot_timeout(sp_timer_t *t, void *arg)
{
    struct vm *vm = arg;
    char tail[1024];
    sp_qemu__console_tail(vm, tail, sizeof tail);
    sp_log(SP_LOG_WARN, "qemu",
           "guest did not come up sandbox=%s timeout_ms=%u phase=%d console=%s (console.log "
           "kept in the VM directory)",
           vm->id, vm->d->boot_timeout_ms, (int)vm->ph, tail);
    vm->boot_failed = true;
    sp_err_set(&vm->boot_err, SP_ERUNTIME, "guest did not come up within %u ms",
               vm->d->boot_timeout_ms);
    vm->keep_logs = true;
    sp_qemu__vm_stop(vm, false);
}

/* ---------- starting QEMU ---------- */

int sp_qemu__write_vm_json(struct vm *vm)
{
    json_t *o =
        json_pack("{s:s, s:i, s:i, s:I, s:s, s:s, s:s, s:s}", "template", vm->template_name,
                  "cpu_count", vm->cpu_count, "memory_mb", vm->memory_mb, "disk_bytes",
                  (json_int_t)vm->disk_total, "accel", vm->d->accel == 1 ? "kvm" : "tcg", "base",
                  vm->tp->rootfs, "kernel", vm->tp->kernel, "initramfs", vm->tp->initramfs);
    if (o != NULL && vm->clone_src != NULL)
        json_object_set_new(o, "ram_src", json_string(vm->clone_src));
    char *s = o ? json_dumps(o, JSON_COMPACT) : NULL;
    json_decref(o);
    if (s == NULL)
        return -1;
    char p[PATH_MAX + 16];
    sp_qemu__vm_path(vm, "vm.json", p, sizeof p);
    int rc = sp_qemu__write_atomic(p, s, strlen(s));
    free(s);
    return rc;
}

void sp_qemu__read_vm_json(struct vm *vm)
{
    char p[PATH_MAX + 16];
    sp_qemu__vm_path(vm, "vm.json", p, sizeof p);
    json_t *o = json_load_file(p, 0, NULL);
    vm->cpu_count = (int)json_integer_value(json_object_get(o, "cpu_count"));
    vm->memory_mb = (int)json_integer_value(json_object_get(o, "memory_mb"));
    vm->disk_total = (uint64_t)json_integer_value(json_object_get(o, "disk_bytes"));
    const char *src = json_string_value(json_object_get(o, "ram_src"));
    free(vm->clone_src);
    vm->clone_src = src != NULL ? strdup(src) : NULL;
    json_decref(o);
}

static void on_vm_started(struct vm *vm);

static void start_qemu(struct vm *vm)
{
    sp_qemu_t *d = vm->d;
    if (sp_qemu__confine_ram_wait(vm))
        return; /* a jailed clone's sealed template RAM is still being made */
    char disk[PATH_MAX + 16], agent[PATH_MAX + 16], qmp[PATH_MAX + 16], con[PATH_MAX + 16],
        log[PATH_MAX + 16], pidf[PATH_MAX + 16];
    sp_qemu__vm_path(vm, "disk.qcow2", disk, sizeof disk);
    sp_qemu__vm_path(vm, "agent.sock", agent, sizeof agent);
    sp_qemu__vm_path(vm, "qmp.sock", qmp, sizeof qmp);
    sp_qemu__vm_path(vm, "console.log", con, sizeof con);
    sp_qemu__vm_path(vm, "qemu.log", log, sizeof log);
    sp_qemu__vm_path(vm, "qemu.pid", pidf, sizeof pidf);
    unlink(agent);
    unlink(qmp);
    sp_qemu__pool_origin_remove(vm); /* this QEMU names this directory */

    sp_bootargs_qemu_t q = {
        .qemu = d->qemu,
        .kernel = vm->tp->kernel,
        .initramfs = vm->tp->initramfs,
        .disk = disk,
        .agent_sock = agent,
        .qmp_sock = qmp,
        .console_log = con,
        .cpu_count = vm->cpu_count,
        .memory_mb = vm->memory_mb,
        .kvm = d->accel == 1,
    };
    char **base = sp_bootargs_qemu_argv(&q);
    if (base == NULL) {
        sp_qemu__boot_fail(vm, "%s", "cannot build the QEMU command line");
        return;
    }
    /* Copy, with the serial console moved to an append-mode file chardev (so console.log
     * can be trimmed under QEMU) and the seccomp sandbox added where QEMU has it. */
    char conarg[PATH_MAX + 64];
    sp_qemu__sfmt(conarg, sizeof conarg, "file,id=con0,path=%s,append=on", con);
    char *argv[96];
    int n = 0;
    for (int i = 0; base[i] != NULL && n < 88; i++) {
        if (strcmp(base[i], "-serial") == 0 && base[i + 1] != NULL) {
            argv[n++] = "-chardev";
            argv[n++] = conarg;
            argv[n++] = "-serial";
            argv[n++] = "chardev:con0";
            i++;
            continue;
        }
        argv[n++] = base[i];
    }
    if (vm->restore_delta && vm->clone_src == NULL) {
        free(base);
        sp_qemu__boot_fail(vm, "restore failed: %s", "out of memory");
        return;
    }
    /* Guest RAM in a shared file: suspend then writes device state only (x-ignore-shared). */
    char memobj[PATH_MAX + 128];
    if (vm->clone_src != NULL) /* private copy-on-write map of the template's RAM */
        sp_qemu__sfmt(memobj, sizeof memobj,
                      "memory-backend-file,id=mem,size=%dM,mem-path=%s/mem.ram,share=off",
                      vm->memory_mb, vm->clone_src);
    else
        sp_qemu__sfmt(memobj, sizeof memobj,
                      "memory-backend-file,id=mem,size=%dM,mem-path=%s/mem.ram,share=on",
                      vm->memory_mb, vm->dir);
    if (vm->restore_stream) { /* the stream fills a fresh RAM file of our own */
        char ram[PATH_MAX + 16];
        sp_qemu__vm_path(vm, "mem.ram", ram, sizeof ram);
        unlink(ram);
    }
    argv[n++] = "-object";
    argv[n++] = memobj;
    argv[n++] = "-machine";
    argv[n++] = "memory-backend=mem";
    if (vm->restoring) {
        argv[n++] = "-incoming";
        argv[n++] = "defer";
    }
    if (d->sandbox == 1) {
        argv[n++] = "-sandbox";
        argv[n++] = SP_QEMU_SANDBOX_ARG;
    }
    argv[n] = NULL;

    char cmd[8192];
    size_t off = 0;
    for (int i = 0; i < n && off < sizeof cmd - 1; i++)
        off += (size_t)sp_qemu__sfmt(cmd + off, sizeof cmd - off, "%s%s", i ? " " : "", argv[i]);
    sp_log(SP_LOG_DEBUG, "qemu", "starting sandbox=%s argv=%s", vm->id, cmd);

    /* Until the agent has taken IDENTITY, a driver that finds this QEMU must not adopt it. */
    char booting[PATH_MAX + 16];
    sp_qemu__vm_path(vm, "booting", booting, sizeof booting);
    if (sp_qemu__write_atomic(booting, "", 0) < 0)
        sp_log(SP_LOG_WARN, "qemu", "cannot write the boot marker sandbox=%s err=%s", vm->id,
               strerror(errno));

    sp_cgroup_join_t join;
    bool cg = sp_qemu__cg_create(vm, &join);
    const char *refuse = sp_qemu__confine_refusal(d, cg);
    if (refuse != NULL) {
        sp_log(SP_LOG_ERROR, "qemu", "vm not started sandbox=%s reason=\"%s\"", vm->id, refuse);
        free(base);
        sp_cgroup_join_close(&join);
        sp_qemu__boot_fail(vm, "%s", refuse);
        return;
    }
    sp_err_t e;
    vm->pid = sp_qemu__confine_spawn(vm, argv, log, cg ? &join : NULL, &vm->pidfd, &e);
    free(base);
    sp_cgroup_join_close(&join);
    if (vm->pid < 0) {
        vm->pid = 0;
        sp_qemu__boot_fail(vm, "%s", e.msg);
        return;
    }
    char pidbuf[32];
    int pl = sp_qemu__sfmt(pidbuf, sizeof pidbuf, "%d\n", (int)vm->pid);
    if (sp_qemu__write_atomic(pidf, pidbuf, (size_t)pl) < 0)
        sp_log(SP_LOG_WARN, "qemu", "cannot write pidfile sandbox=%s err=%s", vm->id,
               strerror(errno));
    on_vm_started(vm);
}

/* The sealed template RAM a jailed clone waited for is made, or cannot be (confine.c): its
 * QEMU starts now, or fails to. */
void sp_qemu__boot_ram_ready(struct vm *vm)
{
    if (vm->ph == PH_DISK && vm->pid <= 0 && vm->img == NULL)
        start_qemu(vm);
}

/* Common to a fresh start and re-adoption: watch the process. */
static void on_vm_started(struct vm *vm)
{
    vm->pw = sp_watch_create(vm->d->base.loop, vm->pidfd, sp_qemu__on_vm_exit, vm);
    if (vm->pw == NULL) {
        sp_qemu__boot_fail(vm, "%s", "cannot watch the VM process");
        return;
    }
    sp_watch_set(vm->pw, SP_IO_READ);
    if (vm->ph == PH_DISK) {
        vm->ph = PH_START;
        sp_qemu__qmp_try_connect(vm);
    }
}

static void on_img_exit(struct child *c, int st, bool timed_out, void *arg)
{
    struct vm *vm = arg;
    sp_qemu__child_free(c);
    vm->img = NULL;
    if (vm->ph == PH_STOPPING) {
        sp_qemu__vm_finish(vm);
        return;
    }
    if (st == -1 || !WIFEXITED(st) || WEXITSTATUS(st) != 0) {
        sp_log(SP_LOG_ERROR, "qemu", "qemu-img create failed sandbox=%s status=%d (see qemu.log)",
               vm->id, st);
        sp_qemu__boot_fail(vm, "%s", "cannot create the sandbox disk");
        return;
    }
    sp_log(SP_LOG_DEBUG, "qemu", "overlay made sandbox=%s ms=%llu", vm->id,
           (unsigned long long)(sp_qemu__mono_ms() - vm->boot_start_ms));
    start_qemu(vm);
}

static void put_be32(uint8_t *p, uint32_t v)
{
    for (int i = 0; i < 4; i++)
        p[i] = (uint8_t)(v >> (24 - 8 * i));
}

static void put_be64(uint8_t *p, uint64_t v)
{
    put_be32(p, (uint32_t)(v >> 32));
    put_be32(p + 4, (uint32_t)v);
}

/* Writes an empty qcow2 v3 overlay of `backing` (a qcow2 file; its virtual size is read
 * from its header) the way qemu-img lays one out: header + backing name in cluster 0,
 * refcount table, one refcount block, L1 table; 64 KiB clusters, 16-bit refcounts. Saves
 * a qemu-img process on the clone path. 0 or -1 (errno set; the file may be left). */
int sp_qemu__write_overlay(const char *path, const char *backing)
{
    enum { CL = 65536 };
    int bfd = open(backing, O_RDONLY | O_CLOEXEC);
    if (bfd < 0)
        return -1;
    uint8_t bh[32];
    ssize_t r = pread(bfd, bh, sizeof bh, 0);
    close(bfd);
    if (r != (ssize_t)sizeof bh || memcmp(bh, "QFI\xfb", 4) != 0) {
        errno = EINVAL;
        return -1;
    }
    uint64_t size = 0;
    for (int i = 0; i < 8; i++)
        size = size << 8 | bh[24 + i];
    uint64_t per_l1 = (uint64_t)CL * (CL / 8); /* bytes one L2 table maps */
    uint64_t l1 = (size + per_l1 - 1) / per_l1;
    size_t blen = strlen(backing);
    if (l1 * 8 > CL || blen > 1023) { /* > 4 TiB, or a name past cluster 0's room */
        errno = EINVAL;
        return -1;
    }
    uint8_t h[2048];
    memset(h, 0, sizeof h);
    put_be32(h, 0x514649fbu); /* "QFI\xfb" */
    put_be32(h + 4, 3);
    size_t ext = 104;               /* header_length */
    put_be32(h + ext, 0xe2792acau); /* backing file format name */
    put_be32(h + ext + 4, 5);
    memcpy(h + ext + 8, "qcow2", 5);
    size_t end = ext + 16; /* 8 + 5 padded to 8 */
    size_t name = end + 8; /* end-of-extensions: type 0, length 0 */
    memcpy(h + name, backing, blen);
    put_be64(h + 8, name);
    put_be32(h + 16, (uint32_t)blen);
    put_be32(h + 20, 16); /* cluster_bits */
    put_be64(h + 24, size);
    put_be32(h + 36, (uint32_t)l1);
    put_be64(h + 40, 3 * CL); /* L1 table */
    put_be64(h + 48, 1 * CL); /* refcount table */
    put_be32(h + 56, 1);
    put_be32(h + 96, 4); /* refcount_order: 16-bit */
    put_be32(h + 100, 104);
    uint8_t rt[8], rb[8];
    put_be64(rt, 2 * CL);         /* refcount block in cluster 2 */
    for (int i = 0; i < 4; i++) { /* clusters 0-3 are in use once each */
        rb[2 * i] = 0;
        rb[2 * i + 1] = 1;
    }
    int fd = open(path, O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
    if (fd < 0)
        return -1;
    bool ok = pwrite(fd, h, name + blen, 0) == (ssize_t)(name + blen) &&
              pwrite(fd, rt, sizeof rt, CL) == (ssize_t)sizeof rt &&
              pwrite(fd, rb, sizeof rb, 2 * CL) == (ssize_t)sizeof rb && ftruncate(fd, 4 * CL) == 0;
    int e = errno;
    close(fd);
    errno = e;
    return ok ? 0 : -1;
}

static void start_disk(struct vm *vm)
{
    sp_qemu_t *d = vm->d;
    vm->ph = PH_DISK;
    if (mkdir(d->vms_dir, 0700) < 0 && errno != EEXIST) {
        sp_log(SP_LOG_ERROR, "qemu", "cannot create dir=%s err=%s", d->vms_dir, strerror(errno));
        sp_qemu__boot_fail(vm, "%s", "cannot create the VM directory");
        return;
    }
    sp_qemu__discard(d,
                     vm->dir); /* leftovers of a failed boot; boot() checked there is no snapshot */
    if (mkdir(vm->dir, 0700) < 0) {
        sp_log(SP_LOG_ERROR, "qemu", "cannot create dir=%s err=%s", vm->dir, strerror(errno));
        sp_qemu__boot_fail(vm, "%s", "cannot create the VM directory");
        return;
    }
    if (sp_qemu__write_vm_json(vm) < 0)
        sp_log(SP_LOG_WARN, "qemu", "cannot write vm.json sandbox=%s", vm->id);
    char disk[PATH_MAX + 16], log[PATH_MAX + 16], backing[PATH_MAX + 16];
    /* There from the start, so that a boot that fails before QEMU opened it still leaves the
     * console log its error points at (empty: the guest never wrote to it). */
    sp_qemu__vm_path(vm, "console.log", log, sizeof log);
    int cfd = open(log, O_WRONLY | O_CREAT | O_APPEND | O_NOFOLLOW | O_CLOEXEC, 0600);
    if (cfd >= 0)
        close(cfd);
    sp_qemu__vm_path(vm, "disk.qcow2", disk, sizeof disk);
    sp_qemu__vm_path(vm, "qemu.log", log, sizeof log);
    /* A clone's chain: template base <- template snapshot's frozen overlay <- ours. */
    if (vm->clone_src != NULL)
        sp_qemu__sfmt(backing, sizeof backing, "%s/disk.qcow2", vm->clone_src);
    else
        sp_qemu__sfmt(backing, sizeof backing, "%s", vm->tp->rootfs);
    if (vm->clone_src != NULL) {
        if (sp_qemu__write_overlay(disk, backing) == 0) {
            start_qemu(vm);
            return;
        }
        sp_log(SP_LOG_WARN, "qemu", "cannot write the overlay, using qemu-img sandbox=%s err=%s",
               vm->id, strerror(errno));
        unlink(disk);
    }
    char *argv[] = {d->qemu_img, "create", "-q",    "-f", "qcow2", "-F",
                    "qcow2",     "-b",     backing, disk, NULL};
    struct spawn_opts so = {.out_path = log, .stdin_fd = -1, .cg = NULL};
    sp_err_t e;
    vm->img = sp_qemu__child_start(d, argv, &so, 30000, on_img_exit, vm, &e);
    if (vm->img == NULL)
        sp_qemu__boot_fail(vm, "%s", e.msg);
}

/* ---------- accelerator and sandbox probes ---------- */

void sp_qemu__kick(sp_qemu_t *d)
{
    if (!sp_timer_armed(&d->kick_timer))
        sp_timer_start(&d->kick_timer, 0);
}

/* This host boot's id: a probe verdict is reused only within one host boot (KVM modules
 * and hardware settings do not change under a running kernel). "" if unknown. */
static void host_boot_id(char *out, size_t n)
{
    if (sp_qemu__read_small("/proc/sys/kernel/random/boot_id", out, n) <= 0)
        out[0] = '\0';
    out[strcspn(out, "\n")] = '\0';
}

/* <vms>/accel is "kvm|tcg\n<reason>\n[probe boot_id=<id>]\n". Returns the accelerator a
 * probe decided earlier in this host boot, or -1. */
int sp_qemu__cached_probe_verdict(sp_qemu_t *d)
{
    char p[PATH_MAX + 16], buf[1024], bid[64], want[128];
    sp_qemu__sfmt(p, sizeof p, "%s/accel", d->vms_dir);
    host_boot_id(bid, sizeof bid);
    if (bid[0] == '\0' || sp_qemu__read_small(p, buf, sizeof buf) <= 0)
        return -1;
    sp_qemu__sfmt(want, sizeof want, "\nprobe boot_id=%s\n", bid);
    if (strstr(buf, want) == NULL)
        return -1;
    if (strncmp(buf, "kvm\n", 4) == 0)
        return 1;
    if (strncmp(buf, "tcg\n", 4) == 0)
        return 0;
    return -1;
}

static void record_accel_ex(sp_qemu_t *d, const char *why, bool probed)
{
    char p[PATH_MAX + 16], buf[768], bid[64] = "";
    sp_qemu__sfmt(p, sizeof p, "%s/accel", d->vms_dir);
    if (probed)
        host_boot_id(bid, sizeof bid);
    int n = sp_qemu__sfmt(buf, sizeof buf, "%s\n%s\n%s%s%s", d->accel == 1 ? "kvm" : "tcg", why,
                          bid[0] ? "probe boot_id=" : "", bid, bid[0] ? "\n" : "");
    if (mkdir(d->vms_dir, 0700) == 0 || errno == EEXIST)
        sp_qemu__write_atomic(p, buf, (size_t)n);
    sp_log(SP_LOG_INFO, "qemu", "accelerator=%s reason=\"%s\"", d->accel == 1 ? "kvm" : "tcg", why);
}

void sp_qemu__record_accel(sp_qemu_t *d, const char *why)
{
    record_accel_ex(d, why, false);
}

static void on_kvm_probe(struct child *c, int st, bool timed_out, void *arg)
{
    sp_qemu_t *d = arg;
    sp_qemu__child_free(c);
    d->kvm_probe = NULL;
    char why[256];
    if (!timed_out && st != -1 && WIFEXITED(st) && WEXITSTATUS(st) == 0) {
        d->accel = 1;
        sp_qemu__sfmt(why, sizeof why, "a probe guest booted under /dev/kvm");
    } else {
        d->accel = 0;
        if (timed_out)
            sp_qemu__sfmt(why, sizeof why,
                          "/dev/kvm opens but a probe guest did not boot within %u ms (software "
                          "KVM such as PVM, or broken); falling back to TCG",
                          d->probe_ms);
        else
            sp_qemu__sfmt(why, sizeof why,
                          "a probe guest under /dev/kvm failed (status %d, see vms/kvm-probe.log); "
                          "falling back to TCG",
                          st);
    }
    record_accel_ex(d, why, true);
    if (!d->gc_done)
        sp_qemu__tsnap_gc(d); /* keys depend on the accelerator: this is the first chance */
    sp_qemu__kick(d);
}

/* Boots the guest kernel under KVM with no init to find: a kernel that works panics at
 * the root mount, and panic=-1 + -no-reboot make QEMU exit 0. A hang means no KVM. */
static void start_kvm_probe(sp_qemu_t *d, const char *kernel)
{
    char log[PATH_MAX + 32], serial[PATH_MAX + 40];
    sp_qemu__sfmt(log, sizeof log, "%s/kvm-probe.log", d->vms_dir);
    sp_qemu__sfmt(serial, sizeof serial, "file:%s", log);
    unlink(log);
    char *argv[] = {d->qemu,
                    "-M",
                    "microvm,x-option-roms=off,pit=off,pic=off,rtc=off,isa-serial=on",
                    "-enable-kvm",
                    "-cpu",
                    "host,-arch-capabilities",
                    "-m",
                    "128",
                    "-smp",
                    "1",
                    "-kernel",
                    (char *)kernel,
                    "-append",
                    "console=ttyS0 reboot=t panic=-1 rdinit=/space-kvm-probe "
                    "root=/dev/space-kvm-probe",
                    "-nodefaults",
                    "-no-user-config",
                    "-nographic",
                    "-no-reboot",
                    "-serial",
                    serial,
                    NULL};
    struct spawn_opts so = {.out_path = NULL, .stdin_fd = -1, .cg = NULL, .new_session = true};
    sp_err_t e;
    sp_log(SP_LOG_INFO, "qemu", "probing KVM timeout_ms=%u", d->probe_ms);
    d->kvm_probe = sp_qemu__child_start(d, argv, &so, d->probe_ms, on_kvm_probe, d, &e);
    if (d->kvm_probe == NULL) {
        d->accel = 0;
        sp_qemu__record_accel(d, "cannot start the KVM probe; using TCG");
        sp_qemu__kick(d);
    }
}

static void on_sandbox_probe(struct child *c, int st, bool timed_out, void *arg)
{
    sp_qemu_t *d = arg;
    sp_qemu__child_free(c);
    d->sandbox_probe = NULL;
    d->sandbox = !timed_out && st != -1 && WIFEXITED(st) && WEXITSTATUS(st) == 0;
    if (d->sandbox)
        sp_log(SP_LOG_INFO, "qemu", "qemu seccomp sandbox available: -sandbox %s",
               SP_QEMU_SANDBOX_ARG);
    else if (d->allow_no_seccomp)
        sp_log(SP_LOG_WARN, "qemu",
               "qemu has no usable -sandbox: VMs run without seccomp (--insecure-no-seccomp)");
    else
        sp_log(SP_LOG_ERROR, "qemu",
               "qemu has no usable -sandbox: VMs do not start unless spaced runs with "
               "--insecure-no-seccomp");
    sp_qemu__kick(d);
}

/* Starts QEMU with no machine and the sandbox flags, feeding QMP on stdin a quit. */
void sp_qemu__start_sandbox_probe(sp_qemu_t *d)
{
    int p[2];
    if (pipe2(p, O_CLOEXEC) < 0) {
        d->sandbox = 0;
        return;
    }
    static const char script[] = "{\"execute\":\"qmp_capabilities\"}\n{\"execute\":\"quit\"}\n";
    ssize_t w = write(p[1], script, sizeof script - 1); /* fits the pipe buffer */
    close(p[1]);
    if (w != (ssize_t)sizeof script - 1) {
        close(p[0]);
        d->sandbox = 0;
        return;
    }
    char *argv[] = {d->qemu,
                    "-M",
                    "none",
                    "-display",
                    "none",
                    "-nodefaults",
                    "-no-user-config",
                    "-sandbox",
                    SP_QEMU_SANDBOX_ARG,
                    "-qmp",
                    "stdio",
                    NULL};
    struct spawn_opts so = {.out_path = NULL, .stdin_fd = p[0], .cg = NULL};
    sp_err_t e;
    d->sandbox_probe =
        sp_qemu__child_start(d, argv, &so, SP_QEMU_SANDBOX_PROBE, on_sandbox_probe, d, &e);
    close(p[0]);
    if (d->sandbox_probe == NULL)
        d->sandbox = 0;
}

static void boot_begin(struct vm *vm);

/* Sandbox boots under way: from the overlay to the agent's IDENTITY, each a QEMU starting or
 * restoring, the heaviest CPU work here (spares and snapshot builders not counted: they
 * already wait for the rest). */
static int boots_in_flight(const sp_qemu_t *d)
{
    int n = 0;
    for (const struct vm *v = d->vms; v != NULL; v = v->next)
        n += !v->pooled && v->tsnap_build == NULL && !v->tsnap_req && v->ph >= PH_DISK &&
             v->ph < PH_UP;
    return n;
}

/* Lets queued clone boots go, the earliest create first, while fewer than d->boot_slots
 * sandbox boots are under way; looks again every SP_QEMU_QUEUE_POLL_MS while any wait. When
 * CPU-bound, creates then come up one slot after the other instead of all restoring at once
 * and all finishing last. */
static void admit_queued(sp_qemu_t *d)
{
    for (;;) {
        struct vm *first = NULL;
        for (struct vm *v = d->vms; v != NULL; v = v->next)
            if (v->boot_queued && v->ph == PH_WAIT_ACCEL &&
                (first == NULL || v->boot_start_ms < first->boot_start_ms))
                first = v;
        if (first == NULL)
            return;
        if (boots_in_flight(d) >= d->boot_slots) {
            sp_timer_start(&d->kick_timer, SP_QEMU_QUEUE_POLL_MS);
            return;
        }
        first->boot_queued = false;
        first->boot_admitted = true;
        sp_log(SP_LOG_DEBUG, "qemu", "clone boot admitted sandbox=%s queued_ms=%llu", first->id,
               (unsigned long long)(sp_qemu__mono_ms() - first->boot_start_ms));
        sp_timer_start(&first->boot_timer, d->boot_timeout_ms); /* from its start, not its queue */
        boot_begin(first); /* may free it; the list is walked again */
    }
}

/* Moves boots along once the verdicts are in; starts the KVM probe on the first boot
 * (it needs a guest kernel, which only a boot names). */
void sp_qemu__on_kick(sp_timer_t *t, void *arg)
{
    sp_qemu_t *d = arg;
    for (struct vm *vm = d->vms; vm != NULL;) {
        struct vm *next = vm->next; /* start_disk may fail and free vm */
        /* a dropped spare is not begun: the pool timer stops it, and its template version's
         * files may be gone already (driver.h: template_forget) */
        if (vm->ph == PH_WAIT_ACCEL && !vm->boot_queued && !(vm->pooled && vm->pool_drop)) {
            bool probed = d->accel >= 0 && d->sandbox >= 0;
            /* the probes' time is not the guest's; a template snapshot request has no timer
             * of its own (its builder's bounds it) and gets none here */
            if (!probed && !vm->probe_wait && sp_timer_armed(&vm->boot_timer)) {
                vm->probe_wait = true;
                sp_timer_start(&vm->boot_timer, d->boot_timeout_ms * SP_QEMU_QUEUE_TIMEOUT_MULT);
            } else if (probed && vm->probe_wait) {
                vm->probe_wait = false;
                sp_timer_start(&vm->boot_timer, d->boot_timeout_ms);
            }
            if (d->accel < 0 && d->kvm_probe == NULL)
                start_kvm_probe(d, vm->tp->kernel);
            else if (probed)
                boot_begin(vm);
        }
        vm = next;
    }
    admit_queued(d); /* after the walk: an admitted boot may free a VM */
}

void sp_qemu__boot_progress(struct vm *vm, const char *what, const char *why)
{
    if (vm->progress == NULL || vm->boot_w == NULL || vm->pooled)
        return; /* nobody to tell, or its caller was answered already */
    char line[200];
    sp_qemu__sfmt(line, sizeof line, "%s for %d vCPU / %d MiB%s%s", what, vm->cpu_count,
                  vm->memory_mb, why != NULL ? ": " : "", why != NULL ? why : "");
    vm->progress(vm->progress_arg, line);
}

/* Where a boot goes once the accelerator is known: own snapshot, cold, or clone. */
static void boot_begin(struct vm *vm)
{
    sp_qemu_t *d = vm->d;
    if (vm->tsnap_req) {
        sp_qemu__tsnap_req_step(vm);
        return;
    }
    if (vm->restoring) {
        vm->ph = PH_DISK; /* the overlay is already there */
        start_qemu(vm);
        return;
    }
    if (vm->cold || d->cold_only) {
        start_disk(vm);
        return;
    }
    struct tsnap *t = sp_qemu__tsnap_for(vm);
    if (vm->pooled && (t == NULL || t->state == TS_FAILED)) {
        sp_log(SP_LOG_INFO, "qemu", "spare clone not made key=%s reason=\"no template snapshot\"",
               vm->pool_key);
        vm->boot_failed = true; /* retried later */
        sp_qemu__vm_stop(vm, false);
        return;
    }
    if (t == NULL) {
        sp_qemu__boot_progress(vm, "booting cold", "no template snapshot can be made");
        vm->cold = true;
        start_disk(vm);
        return;
    }
    if (!vm->pooled && d->pool_size > 0)
        sp_qemu__pool_note(d, t->key, vm); /* spares of this size from now on */
    switch (t->state) {
    case TS_READY:
        if (!vm->pooled && !vm->boot_admitted) {
            vm->boot_queued = true; /* sp_qemu__on_kick admits it (admit_queued) */
            vm->tsnap_wait = t;     /* its snapshot is kept meanwhile (sp_qemu__tsnap_gc) */
            /* the boot timeout starts once it is admitted; the queue has its own, longer */
            sp_timer_start(&vm->boot_timer, d->boot_timeout_ms * SP_QEMU_QUEUE_TIMEOUT_MULT);
            return;
        }
        vm->clone_src = strdup(t->dir);
        if (vm->clone_src == NULL) {
            vm->cold = true;
            start_disk(vm);
            return;
        }
        vm->tsnap_wait = t;
        vm->clone_boot = true;
        /* start_qemu: -incoming defer; on_qmp_ready: sp_qemu__restore_begin */
        vm->restoring = true;
        start_disk(vm);
        return;
    case TS_BUILDING:
        sp_qemu__boot_progress(vm, "building template snapshot", NULL);
        vm->ph = PH_WAIT_TSNAP;
        vm->tsnap_wait = t;
        return;
    default:
        sp_log(SP_LOG_INFO, "qemu",
               "cold boot sandbox=%s reason=\"template snapshot %s failed recently\"", vm->id,
               t->key);
        sp_qemu__boot_progress(vm, "booting cold", "its template snapshot failed recently");
        vm->cold = true;
        start_disk(vm);
        return;
    }
}
