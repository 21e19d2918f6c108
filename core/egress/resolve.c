/*
 * resolve.c - name lookups for the egress proxy and DNS (getaddrinfo, or the
 * test hook) as loop work on the SP_WORK_SHORT lane (loop/loop.h).
 *
 * Owns the jobs: a job waits in its sandbox's queue (sb->rq) until the sandbox
 * has fewer than SP_EGRESS__SB_RESOLVING on the lane and the egress fewer than
 * o.resolver_threads, so a sandbox with slow names holds a few of the lane's
 * threads at most and the lane's queue stays bounded. A job's owner may let go
 * at any time (sp_egress__resolve_cancel); the job itself lives until its work
 * comes back, and keeps its sandbox (sb->resolving) and the egress
 * (eg->nrunning) alive until then. Decides nothing: the owners (proxy.c, dns.c)
 * check the addresses.
 */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "base/log.h"
#include "core/egress/egress_int.h"

/* On a worker thread: touches only j's name, family and results. */
static int resolve_now(const char *name, int family, struct sockaddr_storage *out, int max, int *n)
{
    *n = 0;
    if (sp_egress__hooks.resolve != NULL) {
        struct sockaddr_storage tmp[SP_EGRESS__MAX_ADDRS];
        int k = sp_egress__hooks.resolve(name, tmp, SP_EGRESS__MAX_ADDRS);
        if (k < 0)
            return EAI_NONAME;
        if (k > 0) {
            for (int i = 0; i < k && i < SP_EGRESS__MAX_ADDRS; i++)
                if ((family == AF_UNSPEC || tmp[i].ss_family == family) && *n < max)
                    out[(*n)++] = tmp[i];
            return *n > 0 ? 0 : EAI_NODATA;
        }
    }
    struct addrinfo hints = {.ai_family = family, .ai_socktype = SOCK_STREAM};
    struct addrinfo *res = NULL;
    int rc = getaddrinfo(name, NULL, &hints, &res);
    if (rc != 0)
        return rc;
    for (struct addrinfo *a = res; a != NULL && *n < max; a = a->ai_next) {
        if (a->ai_family != AF_INET && a->ai_family != AF_INET6)
            continue;
        bool dup = false;
        for (int i = 0; i < *n && !dup; i++)
            dup = memcmp(&out[i], a->ai_addr, a->ai_addrlen) == 0;
        if (!dup) {
            memset(&out[*n], 0, sizeof(out[*n]));
            memcpy(&out[*n], a->ai_addr, a->ai_addrlen);
            (*n)++;
        }
    }
    freeaddrinfo(res);
    return *n > 0 ? 0 : EAI_NODATA;
}

static void resolve_work(sp_work_t *w, void *arg)
{
    struct rjob *j = arg;
    j->rc = resolve_now(j->name, j->family, j->addrs, SP_EGRESS__MAX_ADDRS, &j->n);
}

static void run_unlink(sp_egress_t *eg, struct rjob *j)
{
    if (j->run_prev != NULL)
        j->run_prev->run_next = j->run_next;
    else
        eg->running = j->run_next;
    if (j->run_next != NULL)
        j->run_next->run_prev = j->run_prev;
    j->run_prev = j->run_next = NULL;
    eg->nrunning--;
}

/* On the loop: the lookup is back (or was cancelled before it ran). */
static void resolve_done(void *arg, bool cancelled)
{
    struct rjob *j = arg;
    struct sb *sb = j->sb;
    sp_egress_t *eg = sb->eg;
    run_unlink(eg, j);
    eg->st.resolving--;
    if (cancelled && j->owner != NULL) {
        /* Only sp_egress__resolve_stop cancels work, and it runs after every owner
         * is gone. */
        j->rc = EAI_AGAIN;
        j->n = 0;
    }
    /* sb->resolving still counts j here, so done() cannot free sb under us. */
    if (j->owner != NULL)
        j->done(j->owner, j);
    free(j);
    sb->resolving--;
    if (eg->dying) {
        sp_egress__sb_maybe_free(sb);
        sp_egress__maybe_free(eg);
        return;
    }
    /* A place on the lane is free: this sandbox first, then any other that waits.
     */
    sp_egress__resolve_dispatch(sb);
    for (struct sb *x = eg->sbs; x != NULL && eg->nrunning < eg->o.resolver_threads; x = x->next)
        if (x != sb && x->rq != NULL)
            sp_egress__resolve_dispatch(x);
    sp_egress__sb_maybe_free(sb);
}

void sp_egress__resolve_dispatch(struct sb *sb)
{
    sp_egress_t *eg = sb->eg;
    while (sb->rq != NULL) {
        struct rjob *j = sb->rq;
        if (j->owner != NULL && (sb->resolving >= SP_EGRESS__SB_RESOLVING ||
                                 eg->nrunning >= eg->o.resolver_threads || eg->dying))
            break;
        sb->rq = j->next;
        if (sb->rq == NULL)
            sb->rq_tail = NULL;
        j->next = NULL;
        if (j->owner == NULL) {
            eg->st.resolving--;
            free(j);
            continue;
        }
        j->work = sp_loop_work(eg->loop, SP_WORK_SHORT, resolve_work, resolve_done, j);
        if (j->work == NULL) {
            /* No memory or no thread: back to the front; the next completion or
             * lookup tries again, and the owner's own timer ends the wait if none
             * comes. */
            sp_log(SP_LOG_WARN, "egress", "name lookup not queued sandbox=%s", sb->id);
            j->next = sb->rq;
            sb->rq = j;
            if (sb->rq_tail == NULL)
                sb->rq_tail = j;
            break;
        }
        sb->resolving++;
        j->run_next = eg->running;
        if (j->run_next != NULL)
            j->run_next->run_prev = j;
        eg->running = j;
        eg->nrunning++;
    }
}

struct rjob *sp_egress__resolve(struct sb *sb, const char *name, int family,
                                void (*done)(void *, struct rjob *), void *owner)
{
    struct rjob *j = calloc(1, sizeof(*j));
    if (j == NULL)
        return NULL;
    snprintf(j->name, sizeof(j->name), "%s", name);
    j->sb = sb;
    j->family = family;
    j->done = done;
    j->owner = owner;
    sb->eg->st.resolving++;
    if (sb->rq_tail)
        sb->rq_tail->next = j;
    else
        sb->rq = j;
    sb->rq_tail = j;
    sp_egress__resolve_dispatch(sb);
    return j;
}

void sp_egress__resolve_cancel(struct rjob *j)
{
    if (j != NULL)
        j->owner = NULL;
}

const char *sp_egress__resolve_error(int rc)
{
    switch (rc) {
    case EAI_NONAME:
#ifdef EAI_NODATA
    case EAI_NODATA:
#endif
        return "no such host";
    case EAI_AGAIN:
        return "name lookup failed temporarily";
    default:
        return "name lookup failed";
    }
}

void sp_egress__resolve_stop(sp_egress_t *eg)
{
    for (struct rjob *j = eg->running; j != NULL; j = j->run_next)
        sp_work_cancel(j->work);
}
