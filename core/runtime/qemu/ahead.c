/*
 * ahead.c - template snapshots made ahead of the creates that will want them (driver.h:
 * prepare): the sizes a caller expects (core/control/sizes.h: those created in the last day,
 * and each template's default) are queued here, and each one whose snapshot is missing is
 * built the way a first create of that size would build it (sp_qemu_template_snapshot: a
 * builder VM, the warmup, the freeze), so that no create waits for it.
 *
 * One at a time, oldest first, and only while the host is not busy (sp_qemu__host_busy: no
 * boot, suspend or spare under way, and not in the settle time after a sandbox came up):
 * a build is a cold boot, seconds of CPU, and must not slow a create down. A sandbox boot
 * that arrives while one is built is not held back by it (the builder is no boot in
 * flight), and one of that very size waits for it like for any build of its key.
 *
 * Owns the driver's struct ahead records. Does not build (tsnap.c) nor keep spares (pool.c).
 */
#include "core/runtime/qemu/qemu_int.h"

#include <stdlib.h>
#include <string.h>

#include "base/log.h"
#include "base/metrics.h"

#define AHEAD_TICK_MS 250u /* looks again this often while the host is busy */

static sp_metric_t m_ahead = SP_METRIC_COUNTER(
    "space_template_snapshots_ahead_total",
    "Template snapshots asked for ahead of creates (expected sizes), by outcome: built, "
    "found (it was there), failed.",
    "outcome");

/* The record of key's snapshot, if this driver has one. */
static const struct tsnap *record(const sp_qemu_t *d, const char *key)
{
    for (const struct tsnap *t = d->tsnaps; t != NULL; t = t->next)
        if (strcmp(t->key, key) == 0)
            return t;
    return NULL;
}

/* Its committed snapshot is there, as this driver knows (a stat). */
static bool ready(const struct tsnap *t)
{
    char p[PATH_MAX + 48];
    sp_qemu__sfmt(p, sizeof p, "%s/template-snapshot.json", t->dir);
    return t->state == TS_READY && sp_qemu__file_exists(p);
}

int sp_qemu__q_prepare(sp_driver_t *base, const char *template_name, int cpu_count, int memory_mb,
                       sp_err_t *err)
{
    sp_qemu_t *d = (sp_qemu_t *)base;
    if (d->cold_only)
        return sp_err_set(err, SP_ECONFLICT, "template snapshots are off (cold boot configured)");
    if (d->no_adopt)
        return sp_err_set(err, SP_ECONFLICT, "this driver only builds template snapshots");
    if (cpu_count < 0 || memory_mb < 0)
        return sp_err_set(err, SP_EINVAL, "bad size");
    const char *tname = template_name != NULL ? template_name : "base";
    if (strlen(tname) >= sizeof(((struct ahead *)0)->template_name))
        return sp_err_set(err, SP_EINVAL, "template name too long");
    sp_tmplbuild_paths_t *tp = sp_qemu__template_for(d, tname, err);
    if (tp == NULL)
        return -1;
    int cpus = sp_qemu__vm_cpus(tp, cpu_count), mem = sp_qemu__vm_memory(tp, memory_mb);
    char key[17];
    int have = -1; /* unknown until the accelerator is (keys depend on it) */
    const struct tsnap *t = NULL;
    if (d->accel >= 0 && sp_qemu__tsnap_key_for(d, tp, cpus, mem, key) == 0) {
        t = record(d, key);
        have = t == NULL ? -1 : ready(t) ? 1 : t->state == TS_BUILDING ? 0 : -1;
    }
    free(tp);
    if (have >= 0)
        return have;
    if (t != NULL && t->state == TS_FAILED && t->failed_ms != 0 &&
        sp_qemu__mono_ms() - t->failed_ms < SP_QEMU_TSNAP_RETRY_MS)
        return sp_err_set(err, SP_ECONFLICT, "its template snapshot failed recently (%s)",
                          t->why[0] != '\0' ? t->why : "see the log");
    for (struct ahead *a = d->aheads; a != NULL; a = a->next)
        if (strcmp(a->template_name, tname) == 0 && a->cpu_count == cpus && a->memory_mb == mem)
            return 0; /* queued already */
    if (d->naheads >= (int)SP_QEMU_AHEAD_MAX)
        return sp_err_set(err, SP_EUNAVAIL, "too many template snapshots queued");
    struct ahead *a = calloc(1, sizeof(*a));
    if (a == NULL)
        return sp_err_set(err, SP_EINTERNAL, "out of memory");
    a->d = d;
    sp_qemu__sfmt(a->template_name, sizeof a->template_name, "%s", tname);
    a->cpu_count = cpus;
    a->memory_mb = mem;
    struct ahead **pp = &d->aheads;
    while (*pp != NULL)
        pp = &(*pp)->next;
    *pp = a;
    d->naheads++;
    sp_log(SP_LOG_DEBUG, "qemu", "template snapshot queued ahead template=%s cpus=%d memory_mb=%d",
           tname, cpus, mem);
    sp_qemu__ahead_kick(d);
    return 0;
}

void sp_qemu__ahead_kick(sp_qemu_t *d)
{
    if (d->aheads != NULL && !sp_timer_armed(&d->ahead_timer))
        sp_timer_start(&d->ahead_timer, 1);
}

static void ahead_remove(sp_qemu_t *d, struct ahead *a)
{
    for (struct ahead **pp = &d->aheads; *pp != NULL; pp = &(*pp)->next) {
        if (*pp == a) {
            *pp = a->next;
            d->naheads--;
            free(a);
            return;
        }
    }
}

/* The request came back (never after sp_qemu__ahead_free: the driver drops its callbacks). */
static void on_ahead_done(void *arg, const sp_err_t *err)
{
    struct ahead *a = arg;
    sp_qemu_t *d = a->d;
    const char *outcome = err != NULL ? "failed" : a->info.built ? "built" : "found";
    sp_metrics_add(&m_ahead, 1, outcome);
    if (err != NULL)
        sp_log(SP_LOG_WARN, "qemu",
               "template snapshot not made ahead template=%s cpus=%d memory_mb=%d err=\"%s\"",
               a->template_name, a->cpu_count, a->memory_mb, err->msg);
    else
        sp_log(a->info.built ? SP_LOG_INFO : SP_LOG_DEBUG, "qemu",
               "template snapshot %s ahead template=%s cpus=%d memory_mb=%d key=%s",
               a->info.built ? "built" : "found", a->template_name, a->cpu_count, a->memory_mb,
               a->info.key);
    ahead_remove(d, a);
    sp_qemu__ahead_kick(d);
}

/* Asks for the oldest queued size's snapshot once the host is idle; one request at a time. */
void sp_qemu__on_ahead_timer(sp_timer_t *t, void *arg)
{
    sp_qemu_t *d = arg;
    struct ahead *a = d->aheads;
    if (a == NULL || a->asked)
        return; /* its answer kicks again */
    if (sp_qemu__host_busy(d) || sp_qemu__mono_ms() < d->pool_quiet_until) {
        sp_timer_start(&d->ahead_timer, AHEAD_TICK_MS);
        return;
    }
    sp_err_t e;
    if (sp_qemu_template_snapshot(&d->base, a->template_name, a->cpu_count, a->memory_mb, &a->info,
                                  on_ahead_done, a, &e) < 0) {
        sp_metrics_add(&m_ahead, 1, "failed");
        sp_log(SP_LOG_WARN, "qemu",
               "template snapshot not made ahead template=%s cpus=%d memory_mb=%d err=\"%s\"",
               a->template_name, a->cpu_count, a->memory_mb, e.msg);
        ahead_remove(d, a);
        sp_qemu__ahead_kick(d);
        return;
    }
    a->asked = true;
}

void sp_qemu__ahead_free(sp_qemu_t *d)
{
    sp_timer_stop(&d->ahead_timer);
    while (d->aheads != NULL) {
        struct ahead *a = d->aheads;
        d->aheads = a->next;
        free(a);
    }
    d->naheads = 0;
}

void sp_qemu__ahead_metrics_declare(void)
{
    sp_metrics_declare(&m_ahead);
}
