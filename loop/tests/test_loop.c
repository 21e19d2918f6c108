/*
 * test_loop.c - loop/loop.h's deferred calls and timers: they run inside h2o's pass (a write
 * to an h2o socket that completes at once is reported before the pass ends), a call deferred
 * during a pass runs before the next poll, one deferred by a deferred call waits a turn (no
 * spinning), and a timer fires on time without busy polling.
 */
#include <h2o.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include "loop/loop.h"
#include "tests/check.h"

static uint64_t mono_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000 + (uint64_t)ts.tv_nsec / 1000000;
}

/* ---- a write from a deferred call or a timer is reported within the same pass ---- */

struct writer {
    h2o_socket_t *sock;
    int written;
    const char *err;
};

static void on_written(h2o_socket_t *sock, const char *err)
{
    struct writer *w = sock->data;
    w->written++;
    w->err = err;
}

static void write_one(void *arg)
{
    struct writer *w = arg;
    h2o_iovec_t buf = h2o_iovec_init("x", 1);
    h2o_socket_write(w->sock, &buf, 1, on_written);
}

static void write_one_timer(sp_timer_t *t, void *arg)
{
    (void)t;
    write_one(arg);
}

static void test_loop_write_from_deferred_call_completes_in_its_pass(void)
{
    sp_loop_t *l = sp_loop_create();
    int sv[2];
    CHECK(socketpair(AF_UNIX, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0, sv) == 0);
    struct writer w = {0};
    w.sock = h2o_evloop_socket_create(sp_loop_native(l), sv[0], 0);
    w.sock->data = &w;
    CHECK(sp_loop_defer(l, write_one, &w) == 0);
    sp_loop_run_once(l, 0);
    /* After the pass, h2o had run the write's completion: the deferred call ran inside it.
     * (When deferred calls ran after the pass, the completion waited across the next poll.) */
    CHECK(w.written == 1 && w.err == NULL);

    sp_timer_t t;
    sp_timer_init(&t, l, write_one_timer, &w);
    sp_timer_start(&t, 0);
    sp_loop_run_once(l, 0);
    CHECK(w.written == 2 && w.err == NULL);
    char got[4];
    CHECK(read(sv[1], got, sizeof(got)) == 2);

    h2o_socket_close(w.sock);
    close(sv[1]);
    sp_loop_destroy(l);
}

/* ---- order: during a pass, by a deferred call, again and again ---- */

struct order {
    sp_loop_t *l;
    int fd;
    sp_watch_t *w;
    int from_watch, nested, nested_again, forever;
};

static void count_from_watch(void *arg)
{
    ((struct order *)arg)->from_watch++;
}

static void on_readable(sp_watch_t *w, int events, void *arg)
{
    (void)w;
    (void)events;
    struct order *o = arg;
    char c;
    if (read(o->fd, &c, 1) == 1)
        CHECK(sp_loop_defer(o->l, count_from_watch, o) == 0);
}

static void nested_inner(void *arg)
{
    ((struct order *)arg)->nested_again++;
}

static void nested_outer(void *arg)
{
    struct order *o = arg;
    o->nested++;
    CHECK(sp_loop_defer(o->l, nested_inner, o) == 0);
}

static void forever(void *arg)
{
    struct order *o = arg;
    if (++o->forever < 1000)
        CHECK(sp_loop_defer(o->l, forever, o) == 0);
}

static void test_loop_deferred_call_order(void)
{
    struct order o = {0};
    o.l = sp_loop_create();
    int p[2];
    CHECK(pipe(p) == 0);
    o.fd = p[0];
    o.w = sp_watch_create(o.l, p[0], on_readable, &o);
    sp_watch_set(o.w, SP_IO_READ);
    CHECK(write(p[1], "a", 1) == 1);
    /* Deferred from the watch's callback, during the pass: run before the pass ends, so
     * before the next poll (the body gate puts its read callback back that way). */
    for (int i = 0; i < 50 && o.from_watch == 0; i++)
        sp_loop_run_once(o.l, 100);
    CHECK(o.from_watch == 1);

    /* Deferred by a deferred call: waits for the next turn. */
    CHECK(sp_loop_defer(o.l, nested_outer, &o) == 0);
    sp_loop_run_once(o.l, 0);
    CHECK(o.nested == 1 && o.nested_again == 0);
    sp_loop_run_once(o.l, 0);
    CHECK(o.nested_again == 1);

    /* A call that defers itself runs once per turn: the loop never spins inside one. */
    CHECK(sp_loop_defer(o.l, forever, &o) == 0);
    for (int i = 0; i < 10; i++)
        sp_loop_run_once(o.l, 0);
    CHECK(o.forever == 10);
    while (o.forever < 1000)
        sp_loop_run_once(o.l, 0);

    sp_watch_destroy(o.w);
    close(p[0]);
    close(p[1]);
    sp_loop_destroy(o.l);
}

/* ---- a timer fires on time, waited for rather than polled ---- */

static void count_timer(sp_timer_t *t, void *arg)
{
    (void)t;
    (*(int *)arg)++;
}

static void test_loop_timer_fires_on_time(void)
{
    sp_loop_t *l = sp_loop_create();
    int fired = 0, turns = 0;
    sp_timer_t t;
    sp_timer_init(&t, l, count_timer, &fired);
    uint64_t t0 = mono_ms();
    sp_timer_start(&t, 60);
    while (fired == 0 && turns < 100) {
        sp_loop_run_once(l, 1000);
        turns++;
    }
    uint64_t took = mono_ms() - t0;
    CHECK(fired == 1);
    CHECK(took >= 60 && took < 900);
    CHECK(turns <= 4); /* the wait, then the turn that runs it (an early wakeup at most) */
    sp_loop_destroy(l);
}

int main(void)
{
    test_loop_write_from_deferred_call_completes_in_its_pass();
    test_loop_deferred_call_order();
    test_loop_timer_fires_on_time();
    return check_report("loop.loop");
}
