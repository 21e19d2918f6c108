/*
 * loop.h - the event loop core runs on: fd readiness, timers, deferred calls.
 *
 * Folder: loop/ is the event loop (fds, timers, work run off the loop); it uses base/ only.
 * (ARCHITECTURE.md: the layers.)
 *
 * One loop per process, one thread. The implementation (loop/loop.c) sits
 * on h2o's evloop so HTTP and core share the thread; core sees only this
 * header. Nothing here blocks: blocking work goes to worker threads through
 * sp_loop_work. Callbacks never run before the call that arms them returns.
 */
#ifndef SP_LOOP_H
#define SP_LOOP_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

typedef struct sp_loop sp_loop_t;

/* Creates a loop with its own h2o evloop. */
sp_loop_t *sp_loop_create(void);
void sp_loop_destroy(sp_loop_t *loop);

/* The h2o_evloop_t * behind the loop, for the HTTP layer (void * keeps h2o out of core). */
void *sp_loop_native(sp_loop_t *loop);

/* Runs one iteration: waits at most max_wait_ms (less when a timer is due), runs what is ready. */
int sp_loop_run_once(sp_loop_t *loop, int32_t max_wait_ms);

/* Monotonic milliseconds, sampled once per iteration. */
uint64_t sp_loop_now_ms(sp_loop_t *loop);

/* ---- fd readiness ---- */

enum { SP_IO_READ = 1, SP_IO_WRITE = 2 };

typedef struct sp_watch sp_watch_t;
typedef void (*sp_watch_cb)(sp_watch_t *w, int events, void *arg);

/* Watches fd (not owned: the loop works on its own dup). Starts with no interest. */
sp_watch_t *sp_watch_create(sp_loop_t *loop, int fd, sp_watch_cb cb, void *arg);
/* Sets the interest: a mask of SP_IO_READ | SP_IO_WRITE. Level-triggered. */
void sp_watch_set(sp_watch_t *w, int events);
/* Stops watching; safe inside the watch's own callback. NULL does nothing. */
void sp_watch_destroy(sp_watch_t *w);

/* ---- timers ---- */

typedef struct sp_timer sp_timer_t;
typedef void (*sp_timer_cb)(sp_timer_t *t, void *arg);

struct sp_timer {
    /* private */
    sp_loop_t *loop;
    uint64_t due_ms;
    sp_timer_cb cb;
    void *arg;
    size_t heap_idx; /* 0 = not armed */
};

void sp_timer_init(sp_timer_t *t, sp_loop_t *loop, sp_timer_cb cb, void *arg);
/* (Re)arms t to fire once after delay_ms. */
void sp_timer_start(sp_timer_t *t, uint64_t delay_ms);
void sp_timer_stop(sp_timer_t *t);
bool sp_timer_armed(const sp_timer_t *t);

/* ---- deferred calls ---- */

/* Runs cb(arg) on the next iteration: for "never call back before returning". 0 or -1 (ENOMEM). */
int sp_loop_defer(sp_loop_t *loop, void (*cb)(void *arg), void *arg);

/* ---- work off the loop ----
 *
 * Blocking work (name resolution, checksums over gigabytes, stream filters) runs on worker
 * threads and reports back on the loop. Two lanes, each with its own threads so that long
 * jobs never hold up short ones: SP_WORK_SHORT (latency-bound: DNS; SP_LOOP_SHORT_THREADS) and
 * SP_WORK_LONG (CPU or disk-bound, seconds: checksums; SP_LOOP_LONG_THREADS). Threads start
 * on first use with every signal blocked (the program takes its signals on the loop). */

#define SP_LOOP_SHORT_THREADS 8
#define SP_LOOP_LONG_THREADS  4

typedef enum { SP_WORK_SHORT = 0, SP_WORK_LONG = 1 } sp_work_lane_t;
typedef struct sp_work sp_work_t;

/* Runs on a worker thread: must not touch the loop or anything the loop owns. */
typedef void (*sp_work_fn)(sp_work_t *w, void *arg);
/* Runs on the loop once fn has returned (or without fn, when cancelled before it started).
 * Called exactly once per accepted job, never before sp_loop_work returns. After a cancel,
 * cancelled is true: the owner has let go and done only frees what arg holds. */
typedef void (*sp_work_done_cb)(void *arg, bool cancelled);

/* Queues fn(arg) on lane; done(arg, cancelled) follows on the loop. NULL (nothing queued,
 * done never called) when memory or threads are short. */
sp_work_t *sp_loop_work(sp_loop_t *loop, sp_work_lane_t lane, sp_work_fn fn,
                        sp_work_done_cb done, void *arg);
/* The owner no longer wants the result: a job not yet started never runs, a running one sees
 * sp_work_cancelled() turn true (it should poll it and return early); done still comes, with
 * cancelled set. Loop thread only. NULL does nothing. */
void sp_work_cancel(sp_work_t *w);
/* For fn: whether the job was cancelled (safe from the worker thread). */
bool sp_work_cancelled(const sp_work_t *w);

#endif
