/*
 * work.c - work off the loop (loop.h, sp_loop_work): two lanes of worker threads with a
 * queue each, and one eventfd through which finished jobs come back to the loop.
 *
 * A job is owned by the queue until a worker takes it, by the worker while fn runs, then by
 * the finished list until the loop calls done and frees it. cancel only sets a flag (and
 * unlinks a job still queued), so the worker never touches a freed job.
 */
#include "loop/loop_int.h"

#include <errno.h>
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include "base/log.h"

struct sp_work {
    sp_work_t *next;
    sp_work_fn fn;
    sp_work_done_cb done;
    void *arg;
    sp_work_lane_t lane;
    atomic_bool cancelled;
    bool queued; /* under mu: still in its lane's queue */
};

struct lane {
    sp_work_t *head, *tail;
    pthread_t *threads;
    int nthreads, max;
    int idle; /* under mu: threads waiting for a job */
};

struct sp_workpool {
    sp_loop_t *loop;
    pthread_mutex_t mu;
    pthread_cond_t cv;
    bool stop;
    struct lane lanes[2];
    sp_work_t *done_head, *done_tail; /* finished, for the loop */
    int efd;
    sp_watch_t *w;
};

static void push(sp_work_t **head, sp_work_t **tail, sp_work_t *j)
{
    j->next = NULL;
    if (*tail != NULL)
        (*tail)->next = j;
    else
        *head = j;
    *tail = j;
}

static void *worker(void *arg)
{
    struct sp_workpool *p = ((void **)arg)[0];
    struct lane *ln = ((void **)arg)[1];
    free(arg);
    pthread_mutex_lock(&p->mu);
    for (;;) {
        while (!p->stop && ln->head == NULL) {
            ln->idle++;
            pthread_cond_wait(&p->cv, &p->mu);
            ln->idle--;
        }
        if (p->stop)
            break;
        sp_work_t *j = ln->head;
        ln->head = j->next;
        if (ln->head == NULL)
            ln->tail = NULL;
        j->queued = false;
        pthread_mutex_unlock(&p->mu);
        if (!atomic_load(&j->cancelled))
            j->fn(j, j->arg);
        pthread_mutex_lock(&p->mu);
        push(&p->done_head, &p->done_tail, j);
        uint64_t one = 1;
        if (write(p->efd, &one, sizeof one) < 0) {
            /* a counter this size cannot overflow; the loop drains the list anyway */
        }
    }
    pthread_mutex_unlock(&p->mu);
    return NULL;
}

static void on_done(sp_watch_t *w, int events, void *arg)
{
    struct sp_workpool *p = arg;
    uint64_t v;
    while (read(p->efd, &v, sizeof v) > 0) {
    }
    pthread_mutex_lock(&p->mu);
    sp_work_t *list = p->done_head;
    p->done_head = p->done_tail = NULL;
    pthread_mutex_unlock(&p->mu);
    while (list != NULL) {
        sp_work_t *j = list;
        list = j->next;
        j->done(j->arg, atomic_load(&j->cancelled));
        free(j);
    }
}

static struct sp_workpool *pool(sp_loop_t *loop)
{
    sp_workpool_t **slot = sp_loop__work(loop);
    if (*slot != NULL)
        return *slot;
    struct sp_workpool *p = calloc(1, sizeof(*p));
    if (p == NULL)
        return NULL;
    p->loop = loop;
    p->lanes[SP_WORK_SHORT].max = SP_LOOP_SHORT_THREADS;
    p->lanes[SP_WORK_LONG].max = SP_LOOP_LONG_THREADS;
    pthread_mutex_init(&p->mu, NULL);
    pthread_cond_init(&p->cv, NULL);
    p->efd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    if (p->efd >= 0)
        p->w = sp_watch_create(loop, p->efd, on_done, p);
    if (p->w == NULL) {
        if (p->efd >= 0)
            close(p->efd);
        pthread_cond_destroy(&p->cv);
        pthread_mutex_destroy(&p->mu);
        free(p);
        return NULL;
    }
    sp_watch_set(p->w, SP_IO_READ);
    *slot = p;
    return p;
}

/* One more thread for ln while it has fewer than max and work waits; 0 or -1. Under mu. */
static int grow(struct sp_workpool *p, struct lane *ln)
{
    if (ln->nthreads >= ln->max)
        return 0;
    if (ln->threads == NULL && (ln->threads = calloc((size_t)ln->max, sizeof(pthread_t))) == NULL)
        return ln->nthreads > 0 ? 0 : -1;
    void **a = malloc(2 * sizeof(void *));
    if (a == NULL)
        return ln->nthreads > 0 ? 0 : -1;
    a[0] = p;
    a[1] = ln;
    sigset_t all, old;
    sigfillset(&all);
    pthread_sigmask(SIG_SETMASK, &all, &old);
    int rc = pthread_create(&ln->threads[ln->nthreads], NULL, worker, a);
    pthread_sigmask(SIG_SETMASK, &old, NULL);
    if (rc != 0) {
        free(a);
        sp_log(SP_LOG_WARN, "loop", "cannot start a worker thread err=%s", strerror(rc));
        return ln->nthreads > 0 ? 0 : -1;
    }
    ln->nthreads++;
    return 0;
}

sp_work_t *sp_loop_work(sp_loop_t *loop, sp_work_lane_t lane, sp_work_fn fn,
                        sp_work_done_cb done, void *arg)
{
    struct sp_workpool *p = pool(loop);
    if (p == NULL || (lane != SP_WORK_SHORT && lane != SP_WORK_LONG))
        return NULL;
    sp_work_t *j = calloc(1, sizeof(*j));
    if (j == NULL)
        return NULL;
    j->fn = fn;
    j->done = done;
    j->arg = arg;
    j->lane = lane;
    atomic_init(&j->cancelled, false);
    struct lane *ln = &p->lanes[lane];
    pthread_mutex_lock(&p->mu);
    /* A new thread when every one of the lane's is busy (or there are none yet): unless an idle
     * thread is left over once each job already waiting has taken one. */
    int waiting = 0;
    for (sp_work_t *q = ln->head; q != NULL; q = q->next)
        waiting++;
    if (ln->idle <= waiting && grow(p, ln) < 0) {
        pthread_mutex_unlock(&p->mu);
        free(j);
        return NULL;
    }
    j->queued = true;
    push(&ln->head, &ln->tail, j);
    pthread_cond_broadcast(&p->cv);
    pthread_mutex_unlock(&p->mu);
    return j;
}

void sp_work_cancel(sp_work_t *j)
{
    if (j == NULL)
        return;
    atomic_store(&j->cancelled, true);
}

bool sp_work_cancelled(const sp_work_t *j)
{
    return atomic_load(&((sp_work_t *)j)->cancelled);
}

void sp_loop__work_destroy(sp_loop_t *loop)
{
    sp_workpool_t **slot = sp_loop__work(loop);
    struct sp_workpool *p = *slot;
    if (p == NULL)
        return;
    pthread_mutex_lock(&p->mu);
    p->stop = true;
    /* Jobs never started count as cancelled; they go to the finished list unrun. */
    for (int l = 0; l < 2; l++) {
        struct lane *ln = &p->lanes[l];
        while (ln->head != NULL) {
            sp_work_t *j = ln->head;
            ln->head = j->next;
            atomic_store(&j->cancelled, true);
            push(&p->done_head, &p->done_tail, j);
        }
        ln->tail = NULL;
    }
    pthread_cond_broadcast(&p->cv);
    pthread_mutex_unlock(&p->mu);
    for (int l = 0; l < 2; l++) {
        for (int i = 0; i < p->lanes[l].nthreads; i++)
            pthread_join(p->lanes[l].threads[i], NULL);
        free(p->lanes[l].threads);
    }
    on_done(p->w, SP_IO_READ, p); /* every done callback, on this (the loop's) thread */
    sp_watch_destroy(p->w);
    close(p->efd);
    pthread_cond_destroy(&p->cv);
    pthread_mutex_destroy(&p->mu);
    free(p);
    *slot = NULL;
}
