/*
 * test_work.c - loop/loop.h's work off the loop: results come back on the loop thread once
 * per job, lanes do not wait for each other, a job does not wait for a busy thread while the
 * lane may grow, cancel before and during a job, and a loop destroyed with jobs queued still
 * calls every done.
 */
#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <unistd.h>

#include "loop/loop.h"
#include "tests/check.h"

static pthread_t loop_thread;

struct job {
    int in, out;
    int dones;
    bool cancelled;
    bool on_loop;
    atomic_int started;
    int sleep_ms;
};

static void square(sp_work_t *w, void *arg)
{
    struct job *j = arg;
    atomic_store(&j->started, 1);
    for (int i = 0; i < j->sleep_ms / 10 && !sp_work_cancelled(w); i++)
        usleep(10000);
    j->out = j->in * j->in;
}

static void done(void *arg, bool cancelled)
{
    struct job *j = arg;
    j->dones++;
    j->cancelled = cancelled;
    j->on_loop = pthread_equal(pthread_self(), loop_thread);
}

static void run_until(sp_loop_t *l, struct job *js, int n, int ms)
{
    for (int t = 0; t < ms / 10; t++) {
        int all = 1;
        for (int i = 0; i < n; i++)
            all &= js[i].dones > 0;
        if (all)
            return;
        sp_loop_run_once(l, 10);
    }
}

static void test_work_results_come_back_on_the_loop(void)
{
    sp_loop_t *l = sp_loop_create();
    struct job js[40] = {0};
    for (int i = 0; i < 40; i++) {
        js[i].in = i;
        REQUIRE(sp_loop_work(l, i % 2 ? SP_WORK_LONG : SP_WORK_SHORT, square, done, &js[i]) !=
                NULL);
        CHECK(js[i].dones == 0); /* never before the call returns */
    }
    run_until(l, js, 40, 10000);
    int ok = 1;
    for (int i = 0; i < 40; i++)
        ok &= js[i].dones == 1 && js[i].out == i * i && js[i].on_loop && !js[i].cancelled;
    CHECK(ok);
    sp_loop_destroy(l);
}

static void test_work_short_lane_is_not_held_by_long_jobs(void)
{
    sp_loop_t *l = sp_loop_create();
    struct job longs[SP_LOOP_LONG_THREADS + 2] = {0}, quick = {.in = 3};
    for (int i = 0; i < SP_LOOP_LONG_THREADS + 2; i++) {
        longs[i].sleep_ms = 3000;
        REQUIRE(sp_loop_work(l, SP_WORK_LONG, square, done, &longs[i]) != NULL);
    }
    REQUIRE(sp_loop_work(l, SP_WORK_SHORT, square, done, &quick) != NULL);
    run_until(l, &quick, 1, 2000);
    CHECK(quick.dones == 1 && quick.out == 9);
    for (int i = 0; i < SP_LOOP_LONG_THREADS + 2; i++)
        CHECK(longs[i].dones == 0);
    sp_loop_destroy(l); /* waits for the running ones, cancels the queued ones */
    int ok = 1;
    for (int i = 0; i < SP_LOOP_LONG_THREADS + 2; i++)
        ok &= longs[i].dones == 1;
    CHECK(ok);
}

static void test_work_job_does_not_wait_for_a_busy_thread(void)
{
    sp_loop_t *l = sp_loop_create();
    struct job busy = {.sleep_ms = 3000}, quick = {.in = 4};
    REQUIRE(sp_loop_work(l, SP_WORK_LONG, square, done, &busy) != NULL);
    for (int i = 0; i < 200 && !atomic_load(&busy.started); i++)
        usleep(10000);
    REQUIRE(atomic_load(&busy.started)); /* the lane's only thread is taken */
    REQUIRE(sp_loop_work(l, SP_WORK_LONG, square, done, &quick) != NULL);
    run_until(l, &quick, 1, 2000);
    CHECK(quick.dones == 1 && quick.out == 16);
    CHECK(busy.dones == 0);
    sp_loop_destroy(l);
    CHECK(busy.dones == 1);
}

static void test_work_cancel(void)
{
    sp_loop_t *l = sp_loop_create();
    struct job running = {.sleep_ms = 20000, .in = 2}, waiting[SP_LOOP_LONG_THREADS + 1] = {0};
    sp_work_t *r = sp_loop_work(l, SP_WORK_LONG, square, done, &running);
    REQUIRE(r != NULL);
    for (int i = 0; i < 200 && !atomic_load(&running.started); i++)
        usleep(10000);
    CHECK(atomic_load(&running.started));
    sp_work_t *ws[SP_LOOP_LONG_THREADS + 1];
    for (int i = 0; i < SP_LOOP_LONG_THREADS + 1; i++) {
        waiting[i].sleep_ms = 20000;
        ws[i] = sp_loop_work(l, SP_WORK_LONG, square, done, &waiting[i]);
        REQUIRE(ws[i] != NULL);
    }
    sp_work_cancel(r);
    for (int i = 0; i < SP_LOOP_LONG_THREADS + 1; i++)
        sp_work_cancel(ws[i]);
    run_until(l, &running, 1, 3000);
    CHECK(running.dones == 1 && running.cancelled); /* it polled and stopped early */
    run_until(l, waiting, SP_LOOP_LONG_THREADS + 1, 3000);
    int ok = 1;
    for (int i = 0; i < SP_LOOP_LONG_THREADS + 1; i++)
        ok &= waiting[i].dones == 1 && waiting[i].cancelled;
    CHECK(ok);
    sp_loop_destroy(l);
}

int main(void)
{
    loop_thread = pthread_self();
    test_work_results_come_back_on_the_loop();
    test_work_short_lane_is_not_held_by_long_jobs();
    test_work_job_does_not_wait_for_a_busy_thread();
    test_work_cancel();
    return check_report("loop.work");
}
