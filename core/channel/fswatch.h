/*
 * fswatch.h - directory watches as clients see them: the agent's events made into the names
 * and kinds a client expects, and a table of polling watchers that buffer them until asked.
 *
 * Cooking: the agent writes files atomically (a temporary ".<name>.sp-<pid>-<n>" beside the
 * file, then a rename onto the name), where a client expects a file written in place. So the
 * temporary file's events are dropped and the rename that lands it reads as create + write of
 * the name; names are made relative to the watched directory.
 *
 * Polling watchers: each is an agent WATCH stream (sp_exec_watch) whose cooked events are
 * buffered until polled: at most SP_FSWATCH_EVENTS_MAX events and SP_WATCH_BYTES_MAX of names
 * per watcher (the oldest dropped), and SP_WATCH_ALL_BYTES_MAX for all of a table's watchers
 * (past it a new event is dropped), so a guest's endless events cost a bounded buffer
 * (core/channel/listcap.h). A watcher nobody polled for SP_FSWATCH_IDLE_MS is removed
 * (checked once a minute); at most SP_FSWATCH_MAX watchers per table. A watch that ends
 * (directory gone, channel lost) keeps its buffered events; the poll after them reports why it
 * ended.
 *
 * One table serves every sandbox of a server, on the loop thread; watchers are found by
 * (sandbox, id). Knows no HTTP.
 */
#ifndef SP_FSWATCH_H
#define SP_FSWATCH_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "base/err.h"
#include "core/channel/agentconn.h"
#include "core/channel/exec.h"
#include "core/channel/listcap.h"
#include "loop/loop.h"

#define SP_FSWATCH_EVENTS_MAX SP_WATCH_EVENTS_MAX /* buffered per watcher */
#define SP_FSWATCH_IDLE_MS    (5u * 60 * 1000) /* unpolled watchers are removed after */
#define SP_FSWATCH_MAX        1024             /* watchers per table */
#define SP_FSWATCH_ID_MAX     48               /* bytes in an id, NUL included */

/* ---- cooking ---- */

/* Per watch: the name whose temporary file was last renamed away. Zero it to start. */
typedef struct {
    char pending[SP_EXEC_PATH_MAX + 1];
} sp_fswatch_cook_t;

/*
 * One agent event (path and name as sp_exec_watch gives them, SP_AP_EV_* bits) on the watch of
 * directory root: *rel is set to the name relative to root (borrowed from path or name), and
 * out[] to single SP_AP_EV_* bits, in the order create, write, remove, rename, chmod. Returns
 * how many (0: nothing to report).
 */
int sp_fswatch_cook(sp_fswatch_cook_t *ck, const char *root, const char *path, const char *name,
                    uint32_t bits, const char **rel, uint32_t out[5]);

/* ---- polling watchers ---- */

typedef struct sp_fswatch_tab sp_fswatch_tab_t;

typedef struct {
    const char *name; /* relative to the watched directory */
    uint32_t ev;      /* one SP_AP_EV_* bit */
} sp_fswatch_ev_t;

sp_fswatch_tab_t *sp_fswatch_tab_create(sp_loop_t *loop);
/* Removes every watcher; a creation still waiting for its watch gets its callback with
 * SP_EUNAVAIL inside this call. NULL does nothing. */
void sp_fswatch_tab_destroy(sp_fswatch_tab_t *t);

/* The watch is in place (id borrowed for the call: the watcher's name for poll and remove),
 * or it could not start (err, id NULL). */
typedef void (*sp_fswatch_created_cb)(void *arg, const char *id, const sp_err_t *err);

/* Starts a watcher of directory root (absolute; the caller checked it is a directory) in
 * sandbox_id, as user, over c. 0: cb follows exactly once, never inside this call. -1 with err
 * and no callback: SP_ETOOBIG when the table is full, or what sp_exec_watch refused. */
int sp_fswatch_create(sp_fswatch_tab_t *t, sp_agentconn_t *c, const char *sandbox_id,
                      const char *root, const char *user, bool recursive, sp_fswatch_created_cb cb,
                      void *arg, sp_err_t *err);

/* Hands sandbox_id's watcher id's buffered events to cb (oldest first, borrowed for the call;
 * inside this call); the buffer is emptied unless cb returns -1. Counts as a poll. -1 with
 * err: SP_ENOTFOUND for an unknown id (or one still starting), SP_EUNAVAIL (why the watch
 * ended) when it ended and nothing is buffered, SP_EINTERNAL when out of memory here or in cb
 * (nothing lost). */
int sp_fswatch_poll(sp_fswatch_tab_t *t, const char *sandbox_id, const char *id,
                    int (*cb)(void *arg, const sp_fswatch_ev_t *evs, size_t n), void *arg,
                    sp_err_t *err);

/* Removes the watcher; -1 with SP_ENOTFOUND as sp_fswatch_poll. */
int sp_fswatch_remove(sp_fswatch_tab_t *t, const char *sandbox_id, const char *id, sp_err_t *err);

#endif
