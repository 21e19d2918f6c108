/*
 * discard.h - removing a directory tree without holding up the loop: the tree is renamed into
 * a trash directory at once, so its path is free (and gone for every reader) when the call
 * returns, and it is unlinked on a SP_WORK_LONG worker (base/rmtree.h). Unlinking a GiB of RAM
 * file or disk takes 55-135 ms on ext4 here: a stall for every client when it is done on the
 * loop.
 *
 * trash is a directory on the same filesystem as what is discarded into it (a sibling of the
 * trees, e.g. <data>/vms/.trash), made on first use. What a process stopped or killed before
 * its workers finished stays there: sp_discard_leftovers removes it at the next start. Loop
 * thread only.
 */
#ifndef SP_LOOP_DISCARD_H
#define SP_LOOP_DISCARD_H

#include "loop/loop.h"

/* Removes path (a tree, a file, or nothing) as above. Where it cannot be moved (no trash, a
 * path on another filesystem, no memory or workers to queue it) it is removed here, on the
 * loop, as before. */
void sp_discard(sp_loop_t *loop, const char *trash, const char *path);

/* Queues the removal of everything in trash (what an earlier run left). */
void sp_discard_leftovers(sp_loop_t *loop, const char *trash);

#endif
