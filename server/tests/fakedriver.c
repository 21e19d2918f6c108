/*
 * fakedriver.c - a test-only runtime driver: no VMs, just state files.
 *
 * Lives under tests/ and is linked only into spaced-test, so the shipped
 * binary can never select it. Each sandbox's "VM" is a file
 * <data-dir>/fake/<id> holding running|paused|suspended, so probe() sees
 * the same truth after a restart that a real driver would see from its
 * QMP sockets and snapshot manifests. Actions take SPACE_FAKE_DELAY_MS
 * (default 50) and fail when the sandbox env has SPACE_FAKE_FAIL naming
 * the action (boot, pause, resume, snapshot, restore, destroy).
 */
#include <errno.h>
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "core/driver.h"
#include "core/ids.h"
#include "server/tests/fakedriver.h"

typedef struct {
    sp_driver_t base;
    char dir[4096];
    unsigned delay_ms;
} fake_t;

struct job {
    fake_t *f;
    sp_timer_t timer;
    char id[65];
    char action[16];
    char to[16]; /* state file content after success; "" = remove */
    bool fail;
    sp_driver_cb cb;
    void *arg;
};

static void path_of(fake_t *f, const char *id, char *out, size_t cap)
{
    snprintf(out, cap, "%s/%s", f->dir, id);
}

static const char *read_state(fake_t *f, const char *id, char *buf, size_t cap)
{
    char p[4200];
    path_of(f, id, p, sizeof(p));
    FILE *fp = fopen(p, "r");
    if (fp == NULL)
        return NULL;
    bool ok = fgets(buf, (int)cap, fp) != NULL;
    fclose(fp);
    if (!ok)
        return NULL;
    buf[strcspn(buf, "\n")] = '\0';
    return buf;
}

static void write_state(fake_t *f, const char *id, const char *st)
{
    char p[4200], tmp[4300];
    path_of(f, id, p, sizeof(p));
    if (st[0] == '\0') {
        unlink(p);
        return;
    }
    snprintf(tmp, sizeof(tmp), "%s.tmp", p);
    FILE *fp = fopen(tmp, "w");
    if (fp == NULL)
        return;
    fprintf(fp, "%s\n", st);
    fclose(fp);
    rename(tmp, p);
}

static void on_job(sp_timer_t *t, void *arg)
{
    struct job *j = arg;
    if (j->fail) {
        sp_err_t e;
        sp_err_set(&e, SP_EINTERNAL, "injected %s failure", j->action);
        j->cb(j->arg, &e);
    } else {
        write_state(j->f, j->id, j->to);
        j->cb(j->arg, NULL);
    }
    free(j);
}

static int start(fake_t *f, const char *id, const char *action, const char *to, bool fail,
                 sp_driver_cb cb, void *arg, sp_err_t *err)
{
    if (!sp_ids_valid(id))
        return sp_err_set(err, SP_EINVAL, "bad id");
    struct job *j = calloc(1, sizeof(*j));
    if (j == NULL)
        return sp_err_set(err, SP_EINTERNAL, "out of memory");
    j->f = f;
    snprintf(j->id, sizeof(j->id), "%s", id);
    snprintf(j->action, sizeof(j->action), "%s", action);
    snprintf(j->to, sizeof(j->to), "%s", to);
    j->fail = fail;
    j->cb = cb;
    j->arg = arg;
    sp_timer_init(&j->timer, f->base.loop, on_job, j);
    sp_timer_start(&j->timer, f->delay_ms);
    return 0;
}

/* Whether the sandbox's env asks this action to fail; env is read from a side file
 * written at boot, so later actions see it too. */
static bool wants_fail(fake_t *f, const char *id, const char *action, const char *env_json)
{
    char p[4200], buf[256] = "";
    snprintf(p, sizeof(p), "%s/%s.fail", f->dir, id);
    if (env_json != NULL) {
        json_t *env = json_loads(env_json, 0, NULL);
        const char *v = json_string_value(json_object_get(env, "SPACE_FAKE_FAIL"));
        if (v != NULL) {
            FILE *fp = fopen(p, "w");
            if (fp) {
                fputs(v, fp);
                fclose(fp);
            }
        }
        json_decref(env);
    }
    FILE *fp = fopen(p, "r");
    if (fp == NULL)
        return false;
    bool got = fgets(buf, sizeof(buf), fp) != NULL;
    fclose(fp);
    return got && strstr(buf, action) != NULL;
}

static int f_boot(sp_driver_t *d, const sp_vm_spec_t *s, sp_driver_cb cb, void *arg, sp_err_t *e)
{
    fake_t *f = (fake_t *)d;
    return start(f, s->sandbox_id, "boot", "running", wants_fail(f, s->sandbox_id, "boot", s->env_json),
                 cb, arg, e);
}

static int simple(sp_driver_t *d, const char *id, const char *act, const char *need,
                  const char *to, sp_driver_cb cb, void *arg, sp_err_t *e)
{
    fake_t *f = (fake_t *)d;
    char buf[32];
    const char *st = read_state(f, id, buf, sizeof(buf));
    bool fail = wants_fail(f, id, act, NULL);
    if (need != NULL && (st == NULL || strstr(need, st) == NULL)) {
        fail = true;
    }
    return start(f, id, act, to, fail, cb, arg, e);
}

static int f_pause(sp_driver_t *d, const char *id, sp_driver_cb cb, void *arg, sp_err_t *e)
{
    return simple(d, id, "pause", "running", "paused", cb, arg, e);
}

static int f_resume(sp_driver_t *d, const char *id, sp_driver_cb cb, void *arg, sp_err_t *e)
{
    return simple(d, id, "resume", "paused", "running", cb, arg, e);
}

static int f_snapshot(sp_driver_t *d, const char *id, sp_driver_cb cb, void *arg, sp_err_t *e)
{
    return simple(d, id, "snapshot", "running,paused", "suspended", cb, arg, e);
}

static int f_restore(sp_driver_t *d, const sp_vm_spec_t *s, sp_driver_cb cb, void *arg,
                     sp_err_t *e)
{
    return simple(d, s->sandbox_id, "restore", "suspended", "running", cb, arg, e);
}

static int f_destroy(sp_driver_t *d, const char *id, sp_driver_cb cb, void *arg, sp_err_t *e)
{
    fake_t *f = (fake_t *)d;
    char p[4200];
    snprintf(p, sizeof(p), "%s/%s.fail", f->dir, id);
    bool fail = wants_fail(f, id, "destroy", NULL);
    if (!fail)
        unlink(p);
    return start(f, id, "destroy", "", fail, cb, arg, e);
}

static sp_vm_state_t f_probe(sp_driver_t *d, const char *id)
{
    char buf[32];
    const char *st = read_state((fake_t *)d, id, buf, sizeof(buf));
    if (st == NULL)
        return SP_VM_ABSENT;
    if (strcmp(st, "running") == 0)
        return SP_VM_RUNNING;
    if (strcmp(st, "paused") == 0)
        return SP_VM_PAUSED;
    return SP_VM_SUSPENDED;
}

static int f_stats(sp_driver_t *d, const char *id, sp_vm_stats_t *out, sp_err_t *err)
{
    if (f_probe(d, id) == SP_VM_ABSENT)
        return sp_err_set(err, SP_ENOTFOUND, "no VM");
    memset(out, 0, sizeof(*out));
    out->cpu_count = 1;
    out->mem_total_bytes = 256u << 20;
    return 0;
}

static struct sp_agentconn *f_agent(sp_driver_t *d, const char *id)
{
    return NULL; /* no guest: commands and files need the real runtime */
}

static void f_free(sp_driver_t *d)
{
    free(d);
}

static const sp_driver_ops_t fake_ops = {
    .name = "test",
    .boot = f_boot,
    .pause = f_pause,
    .resume = f_resume,
    .snapshot = f_snapshot,
    .restore = f_restore,
    .destroy = f_destroy,
    .probe = f_probe,
    .agent = f_agent,
    .stats = f_stats,
    .free = f_free,
};

sp_driver_t *sp_test_fakedriver_create(sp_loop_t *loop, const char *data_dir)
{
    fake_t *f = calloc(1, sizeof(*f));
    if (f == NULL)
        return NULL;
    f->base.ops = &fake_ops;
    f->base.loop = loop;
    snprintf(f->dir, sizeof(f->dir), "%s/fake", data_dir);
    if (mkdir(f->dir, 0700) < 0 && errno != EEXIST) {
        free(f);
        return NULL;
    }
    const char *d = getenv("SPACE_FAKE_DELAY_MS");
    f->delay_ms = d ? (unsigned)atoi(d) : 50;
    return &f->base;
}
