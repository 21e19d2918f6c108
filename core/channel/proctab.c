/*
 * proctab.c - process records and lifetime kills (core/channel/proctab.h).
 *
 * Owns the records (a list, newest first: a few thousand at most, scanned linearly; each one
 * allocation holding its spec's copies) and the pending kills (a list of timers). A kill whose
 * timer fired leaves the list and owns itself until its agent lookup answers, so it may
 * outlive the table. Knows no HTTP and no database.
 */
#include "core/channel/proctab.h"

#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "base/ids.h"
#include "base/log.h"
#include "core/channel/exec.h"

struct rec {
    struct rec *next;
    char sandbox_id[65];
    uint32_t pid;
    sp_proc_spec_t spec; /* pointers into this allocation, after the struct */
};

struct kill {
    struct kill *next;
    sp_proctab_t *tab; /* NULL once it left the list (fired) */
    sp_loop_t *loop;
    sp_timer_t timer;
    char sandbox_id[65];
    char team_id[SP_ID_LEN + 1];
    uint32_t pid;
};

struct sp_proctab {
    sp_loop_t *loop;
    sp_proctab_agent_fn agent;
    void *ctx;
    struct rec *recs;
    size_t nrecs;
    struct kill *kills;
    size_t nkills;
};

sp_proctab_t *sp_proctab_create(sp_loop_t *loop, sp_proctab_agent_fn agent, void *ctx)
{
    sp_proctab_t *t = calloc(1, sizeof(*t));
    if (t == NULL)
        return NULL;
    t->loop = loop;
    t->agent = agent;
    t->ctx = ctx;
    return t;
}

static void kill_unlink(struct kill *k);

void sp_proctab_destroy(sp_proctab_t *t)
{
    if (t == NULL)
        return;
    while (t->kills != NULL) {
        struct kill *k = t->kills;
        kill_unlink(k);
        free(k);
    }
    while (t->recs != NULL) {
        struct rec *r = t->recs;
        t->recs = r->next;
        free(r);
    }
    free(t);
}

/* ---- records ---- */

static char *put_str(char **at, const char *s)
{
    size_t n = strlen(s) + 1;
    char *d = memcpy(*at, s, n);
    *at += n;
    return d;
}

/* One allocation: the struct, the args and envs arrays, then the strings. */
static struct rec *rec_new(const char *sandbox_id, uint32_t pid, const sp_proc_spec_t *sp)
{
    const char *cmd = sp->cmd ? sp->cmd : "";
    size_t size = sizeof(struct rec) + sp->nargs * sizeof(char *) +
                  sp->nenvs * sizeof(sp_proc_env_t) + strlen(cmd) + 1;
    for (size_t i = 0; i < sp->nargs; i++)
        size += strlen(sp->args[i]) + 1;
    for (size_t i = 0; i < sp->nenvs; i++)
        size += strlen(sp->envs[i].key) + strlen(sp->envs[i].value) + 2;
    if (sp->cwd != NULL)
        size += strlen(sp->cwd) + 1;
    struct rec *r = malloc(size);
    if (r == NULL)
        return NULL;
    memset(r, 0, sizeof(*r));
    snprintf(r->sandbox_id, sizeof(r->sandbox_id), "%s", sandbox_id);
    r->pid = pid;
    /* Both arrays hold pointers, so they stay aligned after the struct. */
    const char **args = (const char **)(r + 1);
    sp_proc_env_t *envs = (sp_proc_env_t *)(args + sp->nargs);
    char *at = (char *)(envs + sp->nenvs);
    r->spec.cmd = put_str(&at, cmd);
    for (size_t i = 0; i < sp->nargs; i++)
        args[i] = put_str(&at, sp->args[i]);
    for (size_t i = 0; i < sp->nenvs; i++) {
        envs[i].key = put_str(&at, sp->envs[i].key);
        envs[i].value = put_str(&at, sp->envs[i].value);
    }
    r->spec.args = args;
    r->spec.nargs = sp->nargs;
    r->spec.envs = envs;
    r->spec.nenvs = sp->nenvs;
    r->spec.cwd = sp->cwd != NULL ? put_str(&at, sp->cwd) : NULL;
    r->spec.pty = sp->pty;
    return r;
}

void sp_proctab_forget(sp_proctab_t *t, const char *sandbox_id, uint32_t pid)
{
    for (struct rec **pp = &t->recs; *pp != NULL; pp = &(*pp)->next) {
        struct rec *r = *pp;
        if (r->pid == pid && strcmp(r->sandbox_id, sandbox_id) == 0) {
            *pp = r->next;
            free(r);
            t->nrecs--;
            return;
        }
    }
}

int sp_proctab_put(sp_proctab_t *t, const char *sandbox_id, uint32_t pid,
                   const sp_proc_spec_t *spec)
{
    struct rec *r = rec_new(sandbox_id, pid, spec);
    if (r == NULL)
        return -1;
    sp_proctab_forget(t, sandbox_id, pid);
    r->next = t->recs;
    t->recs = r;
    t->nrecs++;
    if (t->nrecs > SP_PROCTAB_MAX) { /* full: the oldest (last) goes */
        struct rec **pp = &t->recs;
        while ((*pp)->next != NULL)
            pp = &(*pp)->next;
        free(*pp);
        *pp = NULL;
        t->nrecs--;
    }
    return 0;
}

const sp_proc_spec_t *sp_proctab_get(sp_proctab_t *t, const char *sandbox_id, uint32_t pid)
{
    for (struct rec *r = t->recs; r != NULL; r = r->next)
        if (r->pid == pid && strcmp(r->sandbox_id, sandbox_id) == 0)
            return &r->spec;
    return NULL;
}

void sp_proctab_retain(sp_proctab_t *t, const char *sandbox_id, const uint32_t *running, size_t n)
{
    for (struct rec **pp = &t->recs; *pp != NULL;) {
        struct rec *r = *pp;
        bool keep = strcmp(r->sandbox_id, sandbox_id) != 0;
        for (size_t i = 0; !keep && i < n; i++)
            keep = running[i] == r->pid;
        if (keep) {
            pp = &r->next;
            continue;
        }
        *pp = r->next;
        free(r);
        t->nrecs--;
    }
}

/* ---- lifetime kills ---- */

/* Takes k off its table's list (it stays allocated) and stops its timer. */
static void kill_unlink(struct kill *k)
{
    sp_proctab_t *t = k->tab;
    sp_timer_stop(&k->timer);
    if (t == NULL)
        return;
    for (struct kill **pp = &t->kills; *pp != NULL; pp = &(*pp)->next)
        if (*pp == k) {
            *pp = k->next;
            t->nkills--;
            break;
        }
    k->tab = NULL;
}

static void on_killed(void *arg, const sp_err_t *err)
{
    uint32_t pid = (uint32_t)(uintptr_t)arg;
    if (err != NULL && err->code != SP_ENOTFOUND && err->code != SP_ECONFLICT)
        sp_log(SP_LOG_WARN, "proctab", "lifetime kill failed pid=%u err=%s", pid, err->msg);
}

/* Runs after k left the list (the table may be gone): uses only k's own fields. */
static void on_agent(void *arg, sp_agentconn_t *conn, const sp_err_t *err)
{
    struct kill *k = arg;
    if (err == NULL) {
        sp_err_t e;
        if (sp_exec_signal(k->loop, conn, k->pid, SIGKILL, true, on_killed,
                           (void *)(uintptr_t)k->pid, &e) == NULL)
            on_killed((void *)(uintptr_t)k->pid, &e);
        else
            sp_log(SP_LOG_INFO, "proctab", "lifetime expired sandbox=%s pid=%u", k->sandbox_id,
                   k->pid);
    }
    free(k);
}

static void on_fire(sp_timer_t *tm, void *arg)
{
    struct kill *k = arg;
    sp_proctab_t *t = k->tab;
    kill_unlink(k);
    if (t->agent(t->ctx, k->sandbox_id, k->team_id, on_agent, k) < 0)
        free(k);
}

void sp_proctab_kill_after(sp_proctab_t *t, const char *sandbox_id, const char *team_id,
                           uint32_t pid, uint64_t ms)
{
    struct kill *k = calloc(1, sizeof(*k));
    if (k == NULL) {
        sp_log(SP_LOG_WARN, "proctab", "out of memory: no lifetime for sandbox=%s pid=%u",
               sandbox_id, pid);
        return;
    }
    k->tab = t;
    k->loop = t->loop;
    snprintf(k->sandbox_id, sizeof(k->sandbox_id), "%s", sandbox_id);
    snprintf(k->team_id, sizeof(k->team_id), "%s", team_id);
    k->pid = pid;
    sp_timer_init(&k->timer, t->loop, on_fire, k);
    sp_timer_start(&k->timer, ms);
    k->next = t->kills;
    t->kills = k;
    t->nkills++;
    if (t->nkills > SP_PROCTAB_KILLS_MAX) {
        struct kill *old = t->kills;
        while (old->next != NULL)
            old = old->next;
        sp_log(SP_LOG_WARN, "proctab",
               "too many detached timed processes: dropping the limit sandbox=%s pid=%u",
               old->sandbox_id, old->pid);
        kill_unlink(old);
        free(old);
    }
}
