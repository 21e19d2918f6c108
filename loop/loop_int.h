/*
 * loop_int.h - what loop.c and work.c share: the work pool's slot in the loop.
 */
#ifndef SP_LOOP_INT_H
#define SP_LOOP_INT_H

#include "loop/loop.h"

typedef struct sp_workpool sp_workpool_t;

/* The loop's work pool slot (NULL until the first sp_loop_work). */
sp_workpool_t **sp_loop__work(sp_loop_t *loop);
/* Stops the workers (after their current job) and frees the pool; jobs still queued or done
 * get their done callback with cancelled = true first. Called by sp_loop_destroy. */
void sp_loop__work_destroy(sp_loop_t *loop);

#endif
