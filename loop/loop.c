/*
 * loop.c - core's event loop (loop/loop.h) on top of h2o's evloop.
 *
 * Owns the h2o_evloop_t, a binary min-heap of timers and the deferred-call
 * queue. fd watches wrap a dup of the caller's fd in an h2o socket flagged
 * DONT_READ, so h2o reports readiness without consuming bytes (libpq and QMP
 * read their own sockets). Timers are kept here rather than in h2o because
 * h2o 2.2's timeouts have one fixed duration per queue.
 *
 * Due timers and deferred calls run inside h2o's pass, from an entry on a zero-length h2o
 * timeout (the turn), not after h2o_evloop_run returns: h2o runs a socket's pending callbacks
 * right after each timeout callback, and expects to, before it polls again. A write that
 * completed at once from outside the pass left its completion pending across the next poll,
 * and h2o's evloop aborted (write_pending: sock->super._cb.write != NULL) when the socket came
 * back writable: an API node forwarding an upload did, twice in four bench runs, when a
 * body's piece was handed out from a deferred call (1c7f8af moved that one caller).
 *
 * The turn keeps the order calls had after the pass: its timeout is the last of h2o's, and a
 * call deferred during a pass (or a timer armed to fire at once) links it, so the call runs
 * at the end of that pass, before the next poll (the body gate relies on that: it puts its
 * read callback back before h2o reads a connection's next request). A call deferred by the
 * turn itself waits for the next pass, as it waited for the next iteration: the entry is
 * linked again only between passes, so h2o never runs it twice in one.
 */
#include "loop/loop.h"

#include "loop/loop_int.h"

#include <h2o.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

struct deferred {
    void (*cb)(void *arg);
    void *arg;
    struct deferred *next;
};

struct sp_loop {
    h2o_evloop_t *ev;
    sp_timer_t **heap; /* 1-based */
    size_t heap_len, heap_cap;
    struct deferred *defer_head, *defer_tail;
    h2o_timeout_t turn;           /* zero-length: runs due timers and deferred calls */
    h2o_timeout_entry_t turn_due; /* linked when there is something to run */
    bool in_turn;
    uint64_t now_ms;
    sp_workpool_t *work; /* work.c, made on first sp_loop_work */
};

sp_workpool_t **sp_loop__work(sp_loop_t *loop)
{
    return &loop->work;
}

struct sp_watch {
    sp_loop_t *loop;
    h2o_socket_t *sock;
    sp_watch_cb cb;
    void *arg;
    int want;
    int write_armed;
    int in_cb;
    int dead;
};

static void on_turn(h2o_timeout_entry_t *entry);

/* The turn runs at the end of this pass (or the next, between passes). */
static void want_turn(sp_loop_t *l)
{
    if (!l->in_turn && !h2o_timeout_is_linked(&l->turn_due))
        h2o_timeout_link(l->ev, &l->turn, &l->turn_due);
}

static uint64_t mono_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000 + (uint64_t)ts.tv_nsec / 1000000;
}

sp_loop_t *sp_loop_create(void)
{
    sp_loop_t *l = calloc(1, sizeof(*l));
    if (l == NULL)
        return NULL;
    l->ev = h2o_evloop_create();
    h2o_timeout_init(l->ev, &l->turn, 0);
    l->turn_due.cb = on_turn;
    l->now_ms = mono_ms();
    return l;
}

void sp_loop_destroy(sp_loop_t *loop)
{
    if (loop == NULL)
        return;
    struct deferred *d = loop->defer_head;
    while (d != NULL) {
        struct deferred *n = d->next;
        free(d);
        d = n;
    }
    sp_loop__work_destroy(loop);
    if (h2o_timeout_is_linked(&loop->turn_due))
        h2o_timeout_unlink(&loop->turn_due);
    h2o_timeout_dispose(loop->ev, &loop->turn);
    free(loop->heap);
    /* Closed sockets are freed by the loop on its next turns. h2o 2.2 has no evloop
     * destructor, so the evloop itself stays (scripts/lsan.supp names it). */
    for (int i = 0; i < 3; i++)
        h2o_evloop_run(loop->ev, 0);
    free(loop);
}

void *sp_loop_native(sp_loop_t *loop)
{
    return loop->ev;
}

uint64_t sp_loop_now_ms(sp_loop_t *loop)
{
    return loop->now_ms;
}

/* ---- timers: min-heap on due_ms ---- */

static void heap_swap(sp_loop_t *l, size_t a, size_t b)
{
    sp_timer_t *t = l->heap[a];
    l->heap[a] = l->heap[b];
    l->heap[b] = t;
    l->heap[a]->heap_idx = a;
    l->heap[b]->heap_idx = b;
}

static void heap_up(sp_loop_t *l, size_t i)
{
    while (i > 1 && l->heap[i / 2]->due_ms > l->heap[i]->due_ms) {
        heap_swap(l, i, i / 2);
        i /= 2;
    }
}

static void heap_down(sp_loop_t *l, size_t i)
{
    for (;;) {
        size_t m = i, c = 2 * i;
        if (c <= l->heap_len && l->heap[c]->due_ms < l->heap[m]->due_ms)
            m = c;
        if (c + 1 <= l->heap_len && l->heap[c + 1]->due_ms < l->heap[m]->due_ms)
            m = c + 1;
        if (m == i)
            return;
        heap_swap(l, i, m);
        i = m;
    }
}

void sp_timer_init(sp_timer_t *t, sp_loop_t *loop, sp_timer_cb cb, void *arg)
{
    memset(t, 0, sizeof(*t));
    t->loop = loop;
    t->cb = cb;
    t->arg = arg;
}

bool sp_timer_armed(const sp_timer_t *t)
{
    return t->heap_idx != 0;
}

void sp_timer_stop(sp_timer_t *t)
{
    sp_loop_t *l = t->loop;
    size_t i = t->heap_idx;
    if (i == 0)
        return;
    t->heap_idx = 0;
    if (i != l->heap_len) {
        l->heap[i] = l->heap[l->heap_len];
        l->heap[i]->heap_idx = i;
        l->heap_len--;
        heap_up(l, i);
        heap_down(l, i);
    } else {
        l->heap_len--;
    }
}

void sp_timer_start(sp_timer_t *t, uint64_t delay_ms)
{
    sp_loop_t *l = t->loop;
    sp_timer_stop(t);
    if (l->heap_len + 1 >= l->heap_cap) {
        size_t cap = l->heap_cap ? l->heap_cap * 2 : 64;
        sp_timer_t **h = realloc(l->heap, cap * sizeof(*h));
        if (h == NULL)
            h2o_fatal("out of memory growing the timer heap");
        l->heap = h;
        l->heap_cap = cap;
    }
    t->due_ms = mono_ms() + delay_ms;
    l->heap[++l->heap_len] = t;
    t->heap_idx = l->heap_len;
    heap_up(l, l->heap_len);
    if (delay_ms == 0)
        want_turn(l);
}

static void run_timers(sp_loop_t *l)
{
    uint64_t now = mono_ms();
    l->now_ms = now;
    while (l->heap_len > 0 && l->heap[1]->due_ms <= now) {
        sp_timer_t *t = l->heap[1];
        sp_timer_stop(t);
        t->cb(t, t->arg); /* may re-arm t or free it */
    }
}

/* ---- deferred ---- */

int sp_loop_defer(sp_loop_t *loop, void (*cb)(void *arg), void *arg)
{
    struct deferred *d = malloc(sizeof(*d));
    if (d == NULL)
        return -1;
    d->cb = cb;
    d->arg = arg;
    d->next = NULL;
    if (loop->defer_tail != NULL)
        loop->defer_tail->next = d;
    else
        loop->defer_head = d;
    loop->defer_tail = d;
    want_turn(loop);
    return 0;
}

static void run_deferred(sp_loop_t *l)
{
    /* Only what was queued before this pass runs now; new entries wait a turn. */
    struct deferred *d = l->defer_head;
    l->defer_head = l->defer_tail = NULL;
    while (d != NULL) {
        struct deferred *n = d->next;
        d->cb(d->arg);
        free(d);
        d = n;
    }
}

/* The turn's entry fired, inside h2o's pass: h2o runs what it left pending right after. */
static void on_turn(h2o_timeout_entry_t *entry)
{
    sp_loop_t *l = H2O_STRUCT_FROM_MEMBER(sp_loop_t, turn_due, entry);
    l->in_turn = true;
    run_timers(l);
    run_deferred(l);
    l->in_turn = false;
}

int sp_loop_run_once(sp_loop_t *loop, int32_t max_wait_ms)
{
    /* The turn's timeout goes last among h2o's (its contexts made theirs after the loop). */
    h2o_linklist_unlink(&loop->turn._link);
    h2o_linklist_insert(&loop->ev->_timeouts, &loop->turn._link);
    /* Something to run now (deferred by the last turn, or a timer due): h2o polls without
     * waiting and runs the turn after what the poll found. */
    int32_t wait = max_wait_ms;
    uint64_t now = mono_ms();
    if (loop->defer_head != NULL || (loop->heap_len > 0 && loop->heap[1]->due_ms <= now)) {
        want_turn(loop);
    } else if (loop->heap_len > 0) {
        uint64_t d = loop->heap[1]->due_ms - now;
        if (d < (uint64_t)wait)
            wait = (int32_t)d;
    }
    int r = h2o_evloop_run(loop->ev, wait);
    loop->now_ms = mono_ms();
    return r;
}

/* ---- fd watches ---- */

static void watch_free_if_dead(sp_watch_t *w)
{
    if (w->dead && !w->in_cb) {
        h2o_socket_close(w->sock);
        free(w);
    }
}

static void on_write_ready(h2o_socket_t *sock, const char *err);

static void arm_write(sp_watch_t *w)
{
    if (!w->write_armed && (w->want & SP_IO_WRITE)) {
        w->write_armed = 1;
        h2o_socket_notify_write(w->sock, on_write_ready);
    }
}

static void on_read_ready(h2o_socket_t *sock, const char *err)
{
    sp_watch_t *w = sock->data;
    if (!(w->want & SP_IO_READ))
        return;
    w->in_cb = 1;
    w->cb(w, SP_IO_READ, w->arg);
    w->in_cb = 0;
    watch_free_if_dead(w);
}

static void on_write_ready(h2o_socket_t *sock, const char *err)
{
    sp_watch_t *w = sock->data;
    w->write_armed = 0;
    if (!(w->want & SP_IO_WRITE))
        return;
    w->in_cb = 1;
    w->cb(w, SP_IO_WRITE, w->arg);
    w->in_cb = 0;
    if (w->dead) {
        watch_free_if_dead(w);
        return;
    }
    /* Level-triggered: still interested means tell us again when writable. */
    arm_write(w);
}

sp_watch_t *sp_watch_create(sp_loop_t *loop, int fd, sp_watch_cb cb, void *arg)
{
    int dfd = dup(fd);
    if (dfd < 0)
        return NULL;
    sp_watch_t *w = calloc(1, sizeof(*w));
    if (w == NULL) {
        close(dfd);
        return NULL;
    }
    w->loop = loop;
    w->cb = cb;
    w->arg = arg;
    w->sock = h2o_evloop_socket_create(loop->ev, dfd, H2O_SOCKET_FLAG_DONT_READ);
    w->sock->data = w;
    return w;
}

void sp_watch_set(sp_watch_t *w, int events)
{
    if (w == NULL || w->dead)
        return;
    int had_read = w->want & SP_IO_READ;
    w->want = events;
    if ((events & SP_IO_READ) && !had_read)
        h2o_socket_read_start(w->sock, on_read_ready);
    else if (!(events & SP_IO_READ) && had_read)
        h2o_socket_read_stop(w->sock);
    arm_write(w);
}

void sp_watch_destroy(sp_watch_t *w)
{
    if (w == NULL || w->dead)
        return;
    w->dead = 1;
    w->want = 0;
    /* Closing disposes the socket: h2o drops its pending notifications with it. */
    watch_free_if_dead(w);
}
