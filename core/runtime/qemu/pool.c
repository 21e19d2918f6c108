/*
 * pool.c - spare clones (qemu.h): clones of a recently created template size (or restores of a
 * sandbox snapshot recently created from), made ahead of time, warmed and stopped, and handed
 * to a create of that size (or snapshot).
 *
 * Owns the driver's struct poolwant records (the sizes to keep spares of) and makes or drops
 * spares as its policy (core/runtime/poolpolicy.h: how many per size, within the memory
 * budget) says; a spare itself is a struct vm with pooled set, booted by boot.c and stopped by
 * driver.c like any other. Spares are never adopted by a later driver, and never keep their
 * template version: its collector drops them (driver.h: template_forget).
 */
#include "core/runtime/qemu/qemu_int.h"

#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "base/log.h"
#include "base/metrics.h"

/* ---------- spare clones (the pool) ----------
 *
 * Restoring a clone costs a new QEMU process, the device state, the agent's
 * reconnection, and then a first command that runs slowly because TCG translates every
 * guest code path afresh in each process. A spare is a clone made ahead of time for a
 * template size that was recently created from: restored, up, warmed by running a few
 * commands (so its translation cache holds the exec path), then stopped (no CPU). A create
 * of that size takes one: its directory and cgroup are renamed to the sandbox's, the vCPUs
 * start, and IDENTITY gives it the sandbox's hostname, env, RNG seed and clock, exactly as
 * after a restore. How many of a size to keep is the policy's: one after a create, as many
 * as the creates of a recent burst (up to pool_size), a quarter fewer (at least one) per 2 idle
 * minutes, all within the memory budget (each spare counted at its measured PSS, about 40 MB
 * under TCG here).
 * Spares are refilled one at a time and only while no other boot is in flight: the CPU
 * bounds how fast the pool grows, never a create. They are never adopted by a later driver
 * (killed instead) and go with the driver.
 */

/* Warm-up of a spare: the exec path the first commands of a sandbox take. */
static const struct {
    const char *argv[4];
    const char *user;
} pool_warm_cmds[] = {
    {{"true"}, NULL},
    {{"/bin/sh", "-c", "true"}, "user"},
};

/* A taken spare's QEMU is gone: the link its old directory name left (sp_qemu__pool_take) and the
 * record of that name go too. */
void sp_qemu__pool_origin_remove(const struct vm *vm)
{
    char op[PATH_MAX + 16], org[PATH_MAX];
    sp_qemu__vm_path(vm, "pool.origin", op, sizeof op);
    if (sp_qemu__read_small(op, org, sizeof org) <= 0)
        return;
    struct stat st;
    const char *base = strrchr(org, '/');
    if (base != NULL && strncmp(base + 1, ".pool-", 6) == 0 && lstat(org, &st) == 0 &&
        S_ISLNK(st.st_mode))
        unlink(org);
    unlink(op);
}

struct poolwant *sp_qemu__pool_want(sp_qemu_t *d, const char *key)
{
    for (struct poolwant *w = d->wants; w != NULL; w = w->next)
        if (strcmp(w->key, key) == 0)
            return w;
    return NULL;
}

/* Frees w (unlinked by the caller): the policy forgets its size. */
static void want_free(sp_qemu_t *d, struct poolwant *w)
{
    sp_poolpolicy_forget(d->policy, w->key);
    free(w);
}

void sp_qemu__pool_seen(sp_qemu_t *d, struct poolwant *w)
{
    uint64_t now = sp_qemu__mono_ms();
    w->used_ms = now;
    if (sp_poolpolicy_create_seen(d->policy, w->key, now, (uint64_t)w->memory_mb) < 0)
        sp_log(SP_LOG_WARN, "qemu", "spare pool: create not counted (out of memory) key=%s",
               w->key);
}

void sp_qemu__pool_failed(sp_qemu_t *d, const char *key)
{
    struct poolwant *w = sp_qemu__pool_want(d, key);
    if (w != NULL)
        w->retry_ms = sp_qemu__mono_ms() + SP_QEMU_POOL_RETRY_MS;
}

void sp_qemu__pool_kick(sp_qemu_t *d)
{
    if (d->pool_size > 0)
        sp_timer_start(&d->pool_timer, 1);
}

/* Marks the spares of key (NULL: of template tname's builds other than build) to be stopped
 * by the pool timer: callers may be iterating the VM list, and stopping may free a VM. */
static void pool_drop(sp_qemu_t *d, const char *key, const char *tname, const char *build)
{
    for (struct vm *v = d->vms; v != NULL; v = v->next) {
        if (v->pooled &&
            (key != NULL ? strcmp(v->pool_key, key) == 0
                         : !v->pool_fork && v->tp != NULL && strcmp(v->template_name, tname) == 0 &&
                               strcmp(v->tp->hash, build) != 0)) {
            v->pool_drop = true;
            sp_qemu__pool_kick(d);
        }
    }
}

/* Whether template_name ("name" or "name@hash") with build hash is version of template name. */
static bool of_version(const char *template_name, const char *hash, const char *name,
                       const char *version)
{
    size_t n = strlen(name);
    return strncmp(template_name, name, n) == 0 &&
           (template_name[n] == '\0' || template_name[n] == '@') && strcmp(hash, version) == 0;
}

/* driver.h: template_forget. Spares of the version reached by either name ("name", when it was
 * the default build, or "name@hash") are dropped, and so are the sizes wanted of it: the pool
 * timer would otherwise make new spares of files that are about to go. */
int sp_qemu__q_template_forget(sp_driver_t *base, const char *template_name, const char *version)
{
    sp_qemu_t *d = (sp_qemu_t *)base;
    int n = 0;
    for (struct vm *v = d->vms; v != NULL; v = v->next) {
        if (v->pooled && !v->pool_drop && !v->pool_fork && v->tp != NULL &&
            of_version(v->template_name, v->tp->hash, template_name, version)) {
            v->pool_drop = true;
            n += v->ph != PH_STOPPING;
        }
    }
    for (struct poolwant **pp = &d->wants; *pp != NULL;) {
        struct poolwant *w = *pp;
        if (w->sid[0] == '\0' && of_version(w->template_name, w->tp.hash, template_name, version)) {
            *pp = w->next;
            want_free(d, w);
        } else {
            pp = &w->next;
        }
    }
    if (n > 0) {
        sp_log(SP_LOG_INFO, "qemu", "spare clones dropped template=%s version=%.12s spares=%d",
               template_name, version, n);
        sp_qemu__pool_kick(d);
    }
    return n;
}

static void wants_trim(sp_qemu_t *d);

/* The want of key, moved to the front of the list (the most recently used), or a new one
 * there of vm's size (*fresh set). NULL when out of memory. */
static struct poolwant *want_front(sp_qemu_t *d, const char *key, const struct vm *vm, bool *fresh)
{
    struct poolwant **pp = &d->wants, *w = NULL;
    *fresh = false;
    for (; *pp != NULL; pp = &(*pp)->next) {
        if (strcmp((*pp)->key, key) == 0) {
            w = *pp;
            *pp = w->next;
            break;
        }
    }
    if (w == NULL) {
        w = calloc(1, sizeof(*w));
        if (w == NULL)
            return NULL;
        sp_qemu__sfmt(w->key, sizeof w->key, "%s", key);
        w->cpu_count = vm->cpu_count;
        w->memory_mb = vm->memory_mb;
        w->disk_total = vm->disk_total;
        *fresh = true;
    }
    w->next = d->wants;
    d->wants = w;
    return w;
}

/* A create of this size (vm: its boot): remember it (most recent first) and count it unless
 * the create already did (vm->pool_seen), forget the least recently used size beyond
 * SP_QEMU_POOL_KEYS, and drop spares of the template's older builds. */
void sp_qemu__pool_note(sp_qemu_t *d, const char *key, struct vm *vm)
{
    bool fresh;
    struct poolwant *w = want_front(d, key, vm, &fresh);
    if (w == NULL)
        return;
    if (fresh) {
        sp_qemu__sfmt(w->template_name, sizeof w->template_name, "%s", vm->template_name);
        w->tp = *vm->tp;
        /* other builds of this template: no create will match them again */
        pool_drop(d, NULL, vm->template_name, vm->tp->hash);
        for (struct poolwant **q = &d->wants; *q != NULL;) {
            if ((*q)->sid[0] == '\0' && strcmp((*q)->template_name, vm->template_name) == 0 &&
                strcmp((*q)->tp.hash, vm->tp->hash) != 0) {
                struct poolwant *x = *q;
                *q = x->next;
                want_free(d, x);
            } else {
                q = &(*q)->next;
            }
        }
    }
    if (!vm->pool_seen)
        sp_qemu__pool_seen(d, w);
    vm->pool_seen = true; /* a boot that waited for its snapshot comes here again */
    wants_trim(d);
}

/* Forgets the least recently used sizes beyond SP_QEMU_POOL_KEYS (their spares go), and kicks
 * the pool. */
static void wants_trim(sp_qemu_t *d)
{
    struct poolwant **pp;
    int n = 0;
    for (pp = &d->wants; *pp != NULL;) {
        if (++n > SP_QEMU_POOL_KEYS) {
            struct poolwant *x = *pp;
            *pp = x->next;
            pool_drop(d, x->key, NULL, NULL);
            want_free(d, x);
        } else {
            pp = &(*pp)->next;
        }
    }
    sp_qemu__pool_kick(d);
}

void sp_qemu__pool_note_fork(sp_qemu_t *d, const char *sid, const struct vm *vm)
{
    char key[17];
    sp_qemu__fork_pool_key(sid, key);
    bool fresh;
    struct poolwant *w = want_front(d, key, vm, &fresh);
    if (w == NULL)
        return;
    if (fresh)
        sp_qemu__sfmt(w->sid, sizeof w->sid, "%s", sid);
    sp_qemu__pool_seen(d, w);
    wants_trim(d);
}

void sp_qemu__pool_forget_fork(sp_qemu_t *d, const char *sid)
{
    char key[17];
    sp_qemu__fork_pool_key(sid, key);
    pool_drop(d, key, NULL, NULL);
    for (struct poolwant **pp = &d->wants; *pp != NULL; pp = &(*pp)->next) {
        if (strcmp((*pp)->key, key) == 0) {
            struct poolwant *w = *pp;
            *pp = w->next;
            want_free(d, w);
            break;
        }
    }
}

/* Starts one spare of w's size: a clone of its template snapshot, or a restore of its
 * sandbox snapshot. */
static void pool_start(sp_qemu_t *d, struct poolwant *w)
{
    unsigned seq = ++d->pool_seq;
    char id[SP_QEMU_ID_MAX + 1];
    sp_qemu__sfmt(id, sizeof id, "pool:%u-%d", seq, (int)getpid()); /* ':': no sandbox id, no API */
    sp_tmplbuild_paths_t *tp = w->sid[0] == '\0' ? malloc(sizeof(*tp)) : NULL;
    struct vm *vm = tp != NULL || w->sid[0] != '\0' ? sp_qemu__vm_new(d, id) : NULL;
    if (vm == NULL) {
        free(tp);
        return;
    }
    sp_qemu__sfmt(vm->dir, sizeof vm->dir, "%s/.pool-%u-%d", d->vms_dir, seq, (int)getpid());
    if (w->sid[0] != '\0') {
        vm->pool_fork = true;
        if (sp_qemu__fork_spare_start(vm, w->sid) < 0) {
            w->retry_ms = sp_qemu__mono_ms() + SP_QEMU_POOL_RETRY_MS;
            sp_qemu__vm_unlink(vm);
            sp_qemu__vm_free(vm);
            return;
        }
    } else {
        *tp = w->tp;
        vm->tp = tp;
        sp_qemu__sfmt(vm->template_name, sizeof vm->template_name, "%s", w->template_name);
    }
    sp_qemu__sfmt(vm->pool_key, sizeof vm->pool_key, "%s", w->key);
    vm->pooled = true;
    if (!vm->pool_fork) { /* a restore has them from its snapshot */
        vm->cpu_count = w->cpu_count;
        vm->memory_mb = w->memory_mb;
        vm->disk_total = w->disk_total;
    }
    vm->hostname = strdup("space");
    vm->ph = PH_WAIT_ACCEL;
    vm->boot_start_ms = sp_qemu__mono_ms();
    sp_timer_start(&vm->boot_timer, d->boot_timeout_ms);
    sp_log(SP_LOG_DEBUG, "qemu", "making a spare clone spare=%s template=%s key=%s", id,
           w->template_name, w->key);
    sp_qemu__kick(d);
}

/* The spares of key that count (not dropped, not stopping). */
static int pool_count(const sp_qemu_t *d, const char *key)
{
    int n = 0;
    for (const struct vm *v = d->vms; v != NULL; v = v->next)
        n += v->pooled && !v->pool_drop && v->ph != PH_STOPPING && strcmp(v->pool_key, key) == 0;
    return n;
}

/* What the spares there are count against the memory budget, MiB (a size the policy no
 * longer knows: its guest RAM, until the spare is gone). */
static uint64_t pool_used_mb(const sp_qemu_t *d)
{
    uint64_t mb = 0;
    for (const struct vm *v = d->vms; v != NULL; v = v->next) {
        if (!v->pooled || v->ph == PH_STOPPING)
            continue;
        uint64_t c = sp_poolpolicy_cost(d->policy, v->pool_key);
        mb += c > 0 ? c : (uint64_t)v->memory_mb;
    }
    return mb;
}

/* Marks the spares of w's size beyond its target to be dropped: those still being made first
 * (they use the CPU), then the newest. */
static void pool_trim(sp_qemu_t *d, struct poolwant *w, int excess)
{
    for (int pass = 0; pass < 2 && excess > 0; pass++) {
        for (struct vm *v = d->vms; v != NULL && excess > 0; v = v->next) {
            if (v->pooled && !v->pool_drop && v->ph != PH_STOPPING &&
                strcmp(v->pool_key, w->key) == 0 && (pass == 1 || !v->pool_ready)) {
                v->pool_drop = true;
                excess--;
            }
        }
    }
}

bool sp_qemu__host_busy(const sp_qemu_t *d)
{
    for (const struct vm *v = d->vms; v != NULL; v = v->next) {
        if (v->tsnap_req)
            continue; /* no QEMU: its builder, if any, is a VM of its own */
        if (v->ph < PH_UP || v->ph == PH_SUSPENDING || (v->pooled && !v->pool_ready))
            return true;
    }
    return false;
}

/* The host's MemAvailable in MiB; UINT64_MAX when /proc/meminfo cannot be read. */
static uint64_t host_available_mb(void)
{
    FILE *f = fopen("/proc/meminfo", "re");
    if (f == NULL)
        return UINT64_MAX;
    char line[128];
    unsigned long long kb = 0;
    bool found = false;
    while (!found && fgets(line, sizeof line, f) != NULL)
        found = sscanf(line, "MemAvailable: %llu kB", &kb) == 1;
    fclose(f);
    return found ? kb / 1024 : UINT64_MAX;
}

/* Spares give way to sandboxes: they may hold what they hold plus what the host has available
 * beyond its reserve, and when MemAvailable is below the reserve, that much less (the targets
 * shrink and pool_trim drops the difference). One read of /proc/meminfo per pool step. */
static void pool_limit(sp_qemu_t *d)
{
    uint64_t avail = host_available_mb();
    if (avail == UINT64_MAX) {
        sp_poolpolicy_limit(d->policy, UINT64_MAX);
        return;
    }
    uint64_t used = pool_used_mb(d), limit = 0;
    if (used + avail > d->pool_reserve_mb)
        limit = used + avail - d->pool_reserve_mb;
    sp_poolpolicy_limit(d->policy, limit);
    uint64_t budget = sp_poolpolicy_budget(d->policy);
    bool short_now = budget == limit && limit < UINT64_MAX;
    if (short_now != d->pool_short)
        sp_log(short_now ? SP_LOG_WARN : SP_LOG_INFO, "qemu",
               "spare pool %s host memory available_mb=%llu reserve_mb=%llu spares_mb=%llu "
               "budget_mb=%llu",
               short_now ? "limited by" : "no longer limited by", (unsigned long long)avail,
               (unsigned long long)d->pool_reserve_mb, (unsigned long long)used,
               (unsigned long long)budget);
    d->pool_short = short_now;
}

/* Forgets sizes nobody created for SP_QEMU_POOL_IDLE_MS (their spares go) and drops the spares
 * beyond each size's target, then starts the next missing spare of the most recently used
 * size, within the memory budget, one at a time and only when no other boot is in flight: a
 * spare never competes with a sandbox's boot for the CPU. Nor, while a size still has a
 * spare, with the first commands of a sandbox that came up in the last
 * SP_QEMU_POOL_SETTLE_MS; a size with none left is refilled at once. */
void sp_qemu__on_pool_timer(sp_timer_t *t, void *arg)
{
    sp_qemu_t *d = arg;
    uint64_t now = sp_qemu__mono_ms();
    if (d->policy != NULL)
        pool_limit(d);
    for (struct poolwant *w = d->wants; w != NULL; w = w->next) {
        int excess = pool_count(d, w->key) - sp_poolpolicy_target(d->policy, w->key, now);
        if (excess > 0) {
            sp_log(SP_LOG_INFO, "qemu", "spare pool shrinks key=%s by=%d", w->key, excess);
            pool_trim(d, w, excess);
        }
    }
    for (struct vm *v = d->vms; v != NULL;) {
        struct vm *next = v->next; /* sp_qemu__vm_stop may free v */
        if (v->pooled && v->pool_drop && v->ph != PH_STOPPING) {
            sp_log(SP_LOG_INFO, "qemu", "spare clone dropped spare=%s key=%s", v->id, v->pool_key);
            sp_qemu__vm_stop(v, false);
        }
        v = next;
    }
    for (struct poolwant **pp = &d->wants; *pp != NULL;) {
        struct poolwant *w = *pp;
        if (now - w->used_ms > SP_QEMU_POOL_IDLE_MS) {
            *pp = w->next;
            pool_drop(d, w->key, NULL, NULL);
            want_free(d, w);
        } else {
            pp = &w->next;
        }
    }
    if (d->wants == NULL || d->pool_size <= 0 || d->accel < 0)
        return;
    if (sp_qemu__host_busy(d)) {
        sp_timer_start(&d->pool_timer, SP_QEMU_POOL_TICK_MS);
        return;
    }
    uint64_t wait = 60000; /* idle sizes, and targets that decay, are looked at within a minute */
    uint64_t used = pool_used_mb(d);
    for (struct poolwant *w = d->wants; w != NULL; w = w->next) {
        if (now < w->retry_ms) {
            wait = w->retry_ms - now < wait ? w->retry_ms - now : wait;
            continue;
        }
        int n = pool_count(d, w->key), target = sp_poolpolicy_target(d->policy, w->key, now);
        if (n > 0 && n < target && now < d->pool_quiet_until) {
            wait = d->pool_quiet_until - now < wait ? d->pool_quiet_until - now : wait;
            continue; /* a spare is still there for the next create */
        }
        if (n < target && !sp_poolpolicy_fits(d->policy, w->key, used))
            continue; /* spares of other sizes, dropped or stopping, still hold the memory */
        if (n < target) {
            pool_start(d, w);
            wait = SP_QEMU_POOL_TICK_MS;
            break;
        }
    }
    if (used > 0 && wait > SP_QEMU_POOL_MEM_MS)
        wait = SP_QEMU_POOL_MEM_MS; /* spares held: look at the host's memory again soon */
    sp_timer_start(&d->pool_timer, wait);
}

/* The proportional set size of process pid in MiB (rounded up), 0 when unreadable. One read of
 * a small /proc file per spare made: the kernel walks the process's page tables once. */
static uint64_t pss_mb(pid_t pid)
{
    char p[64], line[128];
    snprintf(p, sizeof p, "/proc/%d/smaps_rollup", (int)pid);
    FILE *f = fopen(p, "re");
    if (f == NULL)
        return 0;
    unsigned long long kb = 0;
    while (fgets(line, sizeof line, f) != NULL)
        if (sscanf(line, "Pss: %llu kB", &kb) == 1)
            break;
    fclose(f);
    return (kb + 1023) / 1024;
}

static void on_pool_stopped(void *arg, json_t *ret, const sp_err_t *err)
{
    struct vm *vm = arg;
    if (!vm->pooled || vm->ph != PH_UP)
        return;
    if (err != NULL) {
        sp_log(SP_LOG_WARN, "qemu", "spare clone not stopped spare=%s err=%s", vm->id, err->msg);
        vm->boot_failed = true;
        sp_qemu__vm_stop(vm, false);
        return;
    }
    vm->paused = true;
    vm->pool_ready = true;
    /* stopped: what it holds now is what it costs while it waits */
    uint64_t mb = vm->pid > 0 ? pss_mb(vm->pid) : 0;
    sp_poolpolicy_measured(vm->d->policy, vm->pool_key, mb);
    sp_log(SP_LOG_INFO, "qemu", "spare clone ready spare=%s key=%s ms=%llu pss_mb=%llu", vm->id,
           vm->pool_key, (unsigned long long)(sp_qemu__mono_ms() - vm->boot_start_ms),
           (unsigned long long)mb);
    sp_qemu__pool_kick(vm->d);
}

static void on_pool_warm(void *arg, const sp_exec_result_t *res, const sp_err_t *err)
{
    struct vm *vm = arg;
    vm->warm = NULL;
    if (!vm->pooled || vm->ph != PH_UP)
        return;
    if (err != NULL || !res->exited || res->exit_code != 0)
        sp_log(SP_LOG_DEBUG, "qemu", "spare warm-up command failed spare=%s step=%d err=%s",
               vm->id, vm->pool_warm_step, err != NULL ? err->msg : "exit status");
    vm->pool_warm_step++;
    sp_qemu__pool_warm(vm);
}

/* A spare is up: run the warm-up commands one after the other, then stop its vCPUs. */
void sp_qemu__pool_warm(struct vm *vm)
{
    sp_err_t e;
    int n = (int)(sizeof pool_warm_cmds / sizeof pool_warm_cmds[0]);
    while (vm->pool_warm_step < n) {
        const char *const *argv = pool_warm_cmds[vm->pool_warm_step].argv;
        size_t argc = 0;
        while (argc < 4 && argv[argc] != NULL)
            argc++;
        sp_exec_cmd_t cmd = {.argv = argv,
                             .argc = argc,
                             .user = pool_warm_cmds[vm->pool_warm_step].user,
                             .timeout_ms = SP_QEMU_POOL_WARM_MS};
        vm->warm = sp_exec_run(vm->d->base.loop, vm->agent, &cmd, 4096, on_pool_warm, vm, &e);
        if (vm->warm != NULL)
            return;
        vm->pool_warm_step++;
    }
    if (vm->qmp == NULL ||
        sp_qmp_command(vm->qmp, "stop", NULL, -1, on_pool_stopped, vm, &e) < 0) {
        vm->boot_failed = true;
        sp_qemu__vm_stop(vm, false);
    }
}

/* A spare of key for a create: a ready one, else the one furthest along: finishing it beats
 * starting another restore beside it. NULL when there is none. */
struct vm *sp_qemu__pool_pick(sp_qemu_t *d, const char *key)
{
    struct vm *best = NULL;
    for (struct vm *v = d->vms; v != NULL; v = v->next) {
        if (!v->pooled || v->pool_drop || v->ph > PH_UP || v->img != NULL ||
            strcmp(v->pool_key, key) != 0)
            continue;
        if (v->ph == PH_UP && (v->qmp == NULL || sp_qmp_closed(v->qmp) || v->agent == NULL))
            continue; /* cannot be started and told who it is */
        if (v->pool_ready)
            return v;
        if (best == NULL || v->ph > best->ph)
            best = v;
    }
    return best;
}

static void on_take_cont(void *arg, json_t *ret, const sp_err_t *err)
{
    struct vm *vm = arg;
    if (err != NULL && vm->ph < PH_UP) {
        sp_log(SP_LOG_WARN, "qemu", "taken spare did not start sandbox=%s err=%s", vm->id,
               err->msg);
        sp_qemu__boot_fail(vm, "guest did not come up: %s", "its vCPUs did not start");
    }
}

/* Gives the ready spare vm to sandbox spec->sandbox_id: its directory and cgroup take the
 * sandbox's names, its vCPUs start and IDENTITY follows (boot_done answers cb). -1 when it
 * cannot (nothing changed, or the spare was dropped): the caller boots the ordinary way. */
int sp_qemu__pool_take(struct vm *vm, const sp_vm_spec_t *spec, sp_driver_cb cb, void *arg)
{
    sp_qemu_t *d = vm->d;
    char ndir[PATH_MAX], op[PATH_MAX + 16], old_id[SP_QEMU_ID_MAX + 1];
    sp_qemu__sfmt(ndir, sizeof ndir, "%s/%s", d->vms_dir, spec->sandbox_id);
    struct stat st;
    if (lstat(ndir, &st) == 0 || errno != ENOENT)
        return -1; /* files of an earlier boot of this id: the ordinary boot deals with them */
    char *host = strdup(spec->hostname != NULL && *spec->hostname ? spec->hostname : "space");
    char *env = spec->env_json != NULL ? strdup(spec->env_json) : NULL;
    struct waiter *w = calloc(1, sizeof(*w));
    if (host == NULL || w == NULL || (spec->env_json != NULL && env == NULL)) {
        free(host);
        free(env);
        free(w);
        return -1;
    }
    bool started = vm->pid > 0, ok = true, cg_moved = false;
    if (started) {
        /* QEMU's command line keeps naming the spare's directory: sp_qemu__live_qemu_pid reads this
         */
        sp_qemu__vm_path(vm, "pool.origin", op, sizeof op);
        ok = sp_qemu__write_atomic(op, vm->dir, strlen(vm->dir)) == 0;
    }
    if (ok && vm->cg) {
        ok = sp_cgroup_vm_rename(d->cg, vm->id, spec->sandbox_id) == 0;
        cg_moved = ok;
    }
    if (ok && started) {
        /* QEMU opens files by the names it was given (its sockets while it starts, its disk
         * again when a migration completes): the old name must keep working, at every
         * instant, while this QEMU runs. A link at the new name whose target is the new name
         * is exchanged with the directory: then the directory has the new name and the link
         * the old one, pointing to it. */
        ok = symlink(spec->sandbox_id, ndir) == 0;
        if (ok && renameat2(AT_FDCWD, vm->dir, AT_FDCWD, ndir, RENAME_EXCHANGE) < 0) {
            int e = errno;
            unlink(ndir);
            /* no exchange on this filesystem: move, then link (a window of microseconds) */
            ok = (e == EINVAL || e == ENOSYS) && rename(vm->dir, ndir) == 0;
            if (ok && symlink(spec->sandbox_id, vm->dir) < 0) {
                e = errno;
                rename(ndir, vm->dir);
                ok = false;
            }
            errno = e;
        }
    } else if (ok && rename(vm->dir, ndir) < 0 && errno != ENOENT) {
        ok = false; /* not started: nothing holds its names (no directory yet: fine) */
    }
    if (!ok) {
        sp_log(SP_LOG_WARN, "qemu", "spare clone not taken spare=%s sandbox=%s err=%s", vm->id,
               spec->sandbox_id, strerror(errno));
        if (cg_moved)
            sp_cgroup_vm_rename(d->cg, spec->sandbox_id, vm->id);
        free(host);
        free(env);
        free(w);
        vm->pool_drop = true;
        sp_qemu__pool_kick(d);
        return -1;
    }
    sp_qemu__sfmt(old_id, sizeof old_id, "%s", vm->id);
    bool was_ready = vm->pool_ready;
    sp_qemu__sfmt(vm->id, sizeof vm->id, "%s", spec->sandbox_id);
    sp_qemu__sfmt(vm->dir, sizeof vm->dir, "%s", ndir);
    vm->pooled = false;
    vm->pool_ready = false;
    vm->pool_seen = true; /* q_boot counted its create; boot_begin must not count it again */
    free(vm->hostname);
    vm->hostname = host;
    free(vm->env_json);
    vm->env_json = env;
    w->cb = cb;
    w->arg = arg;
    w->next = vm->boot_w;
    vm->boot_w = w;
    /* Until the agent has taken IDENTITY, a later driver must not adopt it; and a failure
     * before that falls back to a boot of the sandbox (sp_qemu__vm_finish), as a failed clone does.
     */
    char p[PATH_MAX + 16];
    sp_qemu__vm_path(vm, "booting", p, sizeof p);
    sp_qemu__write_atomic(p, "", 0);
    sp_qemu__vm_path(vm, "agent.sock", p, sizeof p);
    if (vm->agent != NULL) { /* else sp_qemu__agent_start makes it, by the new path and name */
        sp_agentconn_set_path(vm->agent, p);
        sp_agentconn_set_sandbox(vm->agent, vm->id);
    }
    /* a clone's restore, with its fall-back to a cold boot; a fork's restore goes on as one
     * of its own snapshot (its device state, its manifest gone once loaded) */
    vm->clone_boot = !vm->pool_fork;
    vm->pool_fork = false;
    vm->boot_start_ms = sp_qemu__mono_ms();
    sp_timer_start(&vm->boot_timer, d->boot_timeout_ms);
    const char *how = "ready";
    if (vm->ph < PH_UP) {
        /* still being made: its boot goes on as the sandbox's (the restore, then IDENTITY with
         * the sandbox's names; one already sent with the spare's is sent again) */
        how = vm->ph < PH_START ? "queued" : vm->ph == PH_START ? "restoring" : "connecting";
        if (vm->ph == PH_IDENTITY) {
            sp_agentstream_t *old = vm->ident;
            vm->ident = NULL;
            sp_agentstream_reset(old);
            vm->ph = PH_AGENT;
            if (sp_agentconn_up(vm->agent))
                sp_qemu__send_identity(vm);
        }
    } else {
        /* up: stopped, or warming (its warm-up dropped; a `stop` already sent is undone by the
         * `cont` queued behind it) */
        if (!was_ready)
            how = "warming";
        sp_exec_cancel(vm->warm);
        vm->warm = NULL;
        sp_err_t e;
        if (sp_qmp_command(vm->qmp, "cont", NULL, -1, on_take_cont, vm, &e) < 0) {
            sp_qemu__boot_fail(vm, "guest did not come up: %s", e.msg);
            return 0; /* answered through sp_qemu__vm_finish */
        }
        vm->paused = false;
        vm->ph = PH_AGENT;
        if (sp_agentconn_up(vm->agent))
            sp_qemu__send_identity(vm);
    }
    sp_log(SP_LOG_INFO, "qemu", "sandbox from a spare clone sandbox=%s spare=%s key=%s spare_was=%s",
           vm->id, old_id, vm->pool_key, how);
    return 0;
}

static sp_metric_t m_takes = SP_METRIC_COUNTER(
    "space_spare_pool_requests_total",
    "Creates of a template size the spare pool serves, by whether a spare clone was there.",
    "result");
static sp_metric_t m_size = SP_METRIC_GAUGE(
    "space_spare_pool_size", "Spare clones by state (warming: being made; ready: can be taken).",
    "state");
static sp_metric_t m_target = SP_METRIC_GAUGE(
    "space_spare_pool_target",
    "Spare clones the pool aims to keep, all template sizes together (demand, within the budget).",
    "");
static sp_metric_t m_mem = SP_METRIC_GAUGE(
    "space_spare_pool_memory_bytes",
    "Memory of the spare clones (used: as the pool counts them; budget: its limit).", "kind");

void sp_qemu__pool_count(bool hit)
{
    sp_metrics_add(&m_takes, 1, hit ? "hit" : "miss");
}

/* Runs in sp_metrics_render, on the loop (base/metrics.h): the VM list is ours to read. */
static void pool_collect(void *arg)
{
    sp_qemu_t *d = arg;
    int ready = 0, warming = 0;
    for (struct vm *v = d->vms; v != NULL; v = v->next) {
        if (!v->pooled || v->pool_drop)
            continue;
        ready += v->pool_ready;
        warming += !v->pool_ready;
    }
    sp_metrics_set(&m_size, ready, "ready");
    sp_metrics_set(&m_size, warming, "warming");
    if (d->policy == NULL)
        return;
    int target = 0;
    uint64_t now = sp_qemu__mono_ms();
    for (struct poolwant *w = d->wants; w != NULL; w = w->next)
        target += sp_poolpolicy_target(d->policy, w->key, now);
    sp_metrics_set(&m_target, target);
    sp_metrics_set(&m_mem, (double)pool_used_mb(d) * 1048576.0, "used");
    sp_metrics_set(&m_mem, (double)sp_poolpolicy_budget(d->policy) * 1048576.0, "budget");
}

void sp_qemu__pool_metrics_start(sp_qemu_t *d)
{
    sp_metrics_declare(&m_takes);
    sp_metrics_declare(&m_target);
    sp_metrics_declare(&m_mem);
    sp_qemu__tsnap_metrics_declare();
    sp_qemu__ahead_metrics_declare();
    if (sp_metrics_collector_add(pool_collect, d) < 0)
        sp_log(SP_LOG_WARN, "qemu", "spare pool metrics off: out of memory");
}

void sp_qemu__pool_metrics_stop(sp_qemu_t *d)
{
    sp_metrics_collector_remove(pool_collect, d);
}

int sp_qemu_pool_ready(sp_driver_t *base)
{
    if (base == NULL || base->ops != &sp_qemu__ops)
        return 0;
    int n = 0;
    for (struct vm *v = ((sp_qemu_t *)base)->vms; v != NULL; v = v->next)
        n += v->pooled && v->pool_ready && !v->pool_drop;
    return n;
}

int sp_qemu_pool_stats(sp_driver_t *base, sp_qemu_pool_stats_t *st)
{
    memset(st, 0, sizeof(*st));
    if (base == NULL || base->ops != &sp_qemu__ops)
        return -1;
    sp_qemu_t *d = (sp_qemu_t *)base;
    for (struct vm *v = d->vms; v != NULL; v = v->next) {
        if (!v->pooled || v->pool_drop || v->ph == PH_STOPPING)
            continue;
        st->ready += v->pool_ready;
        st->warming += !v->pool_ready;
    }
    if (d->policy != NULL) {
        uint64_t now = sp_qemu__mono_ms();
        for (struct poolwant *w = d->wants; w != NULL; w = w->next)
            st->target += sp_poolpolicy_target(d->policy, w->key, now);
        st->used_mb = pool_used_mb(d);
        st->budget_mb = sp_poolpolicy_budget(d->policy);
    }
    return 0;
}

int sp_qemu_pool_reserve(sp_driver_t *base, uint64_t mb)
{
    if (base == NULL || base->ops != &sp_qemu__ops)
        return -1;
    sp_qemu_t *d = (sp_qemu_t *)base;
    d->pool_reserve_mb = mb;
    sp_qemu__pool_kick(d);
    return 0;
}

bool sp_qemu_spare_dir(sp_driver_t *base, const char *name)
{
    if (base == NULL || base->ops != &sp_qemu__ops)
        return false;
    for (const struct vm *v = ((sp_qemu_t *)base)->vms; v != NULL; v = v->next) {
        const char *b = strrchr(v->dir, '/');
        if (v->pooled && b != NULL && strcmp(b + 1, name) == 0)
            return true;
    }
    return false;
}
