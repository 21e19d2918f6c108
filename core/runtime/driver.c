/*
 * driver.c - the "no runtime" driver and the generic destructor.
 *
 * Shipped when no microVM runtime can be used on a host: creating or waking
 * a sandbox fails with runtime_unavailable and a reason; stopping, pausing
 * and deleting what does not exist succeed, so records can still be cleaned
 * up. Callbacks run on the next loop turn, never inside the call.
 */
#include "core/runtime/driver.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef struct {
    sp_driver_t base;
    char why[128];
} unavail_t;

struct pending {
    sp_driver_cb cb;
    void *arg;
    sp_err_t err;
    bool failed;
};

static void fire(void *p)
{
    struct pending *pd = p;
    pd->cb(pd->arg, pd->failed ? &pd->err : NULL);
    free(pd);
}

static int later(sp_driver_t *d, sp_driver_cb cb, void *arg, const char *fail, sp_err_t *err)
{
    struct pending *pd = calloc(1, sizeof(*pd));
    if (pd == NULL)
        return sp_err_set(err, SP_EINTERNAL, "out of memory");
    pd->cb = cb;
    pd->arg = arg;
    if (fail != NULL) {
        pd->failed = true;
        sp_err_set(&pd->err, SP_ERUNTIME, "%s", fail);
    }
    if (sp_loop_defer(d->loop, fire, pd) < 0) {
        free(pd);
        return sp_err_set(err, SP_EINTERNAL, "out of memory");
    }
    return 0;
}

static int u_boot(sp_driver_t *d, const sp_vm_spec_t *s, sp_driver_cb cb, void *arg, sp_err_t *e)
{
    return later(d, cb, arg, ((unavail_t *)d)->why, e);
}

static int u_pause(sp_driver_t *d, const char *id, sp_driver_cb cb, void *arg, sp_err_t *e)
{
    return later(d, cb, arg, ((unavail_t *)d)->why, e);
}

static int u_destroy(sp_driver_t *d, const char *id, sp_driver_cb cb, void *arg, sp_err_t *e)
{
    return later(d, cb, arg, NULL, e);
}

static sp_vm_state_t u_probe(sp_driver_t *d, const char *id)
{
    return SP_VM_ABSENT;
}

static int u_stats(sp_driver_t *d, const char *id, sp_vm_stats_t *out, sp_err_t *err)
{
    return sp_err_set(err, SP_ENOTFOUND, "sandbox has no VM");
}

static struct sp_agentconn *u_agent(sp_driver_t *d, const char *id)
{
    return NULL;
}

static void u_free(sp_driver_t *d)
{
    free(d);
}

static const sp_driver_ops_t unavail_ops = {
    .name = "unavailable",
    .boot = u_boot,
    .pause = u_pause,
    .resume = u_pause,
    .snapshot = u_pause,
    .restore = u_boot,
    .destroy = u_destroy,
    .probe = u_probe,
    .agent = u_agent,
    .stats = u_stats,
    .free = u_free,
};

sp_driver_t *sp_driver_unavailable_create(sp_loop_t *loop, const char *why)
{
    unavail_t *u = calloc(1, sizeof(*u));
    if (u == NULL)
        return NULL;
    u->base.ops = &unavail_ops;
    u->base.loop = loop;
    snprintf(u->why, sizeof(u->why), "%s", why ? why : "no microVM runtime on this host");
    return &u->base;
}

size_t sp_driver_insecure(sp_driver_t *d, const char **out, size_t n)
{
    return d != NULL && d->ops->insecure != NULL ? d->ops->insecure(d, out, n) : 0;
}

uint64_t sp_driver_disk_bytes(sp_driver_t *d, const char *id)
{
    if (d == NULL)
        return 0;
    if (d->ops->disk_bytes != NULL)
        return d->ops->disk_bytes(d, id);
    sp_vm_stats_t st;
    sp_err_t e;
    memset(&st, 0, sizeof(st));
    return d->ops->stats != NULL && d->ops->stats(d, id, &st, &e) == 0 ? st.disk_total_bytes : 0;
}

void sp_driver_destroy(sp_driver_t *d)
{
    if (d != NULL)
        d->ops->free(d);
}
