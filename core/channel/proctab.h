/*
 * proctab.h - what the host remembers about processes started in sandboxes through an API,
 * beyond what the agent keeps: the command each was started with, and the lifetime of those
 * nobody is attached to any more.
 *
 * Records: the agent knows a process by pid with a joined argv, its tag and cwd; a surface
 * that reports processes as they were started (E2B's process.List: cmd, args, envs, cwd)
 * records the spec when the process started and looks it up by (sandbox, pid). At most
 * SP_PROCTAB_MAX records: a new one pushes out the oldest. A record goes when the process's
 * exit is seen, or when a listing shows the process gone (sp_proctab_retain).
 *
 * Lifetimes: a process started with a timeout is killed by exec while a stream is attached
 * (sp_exec_cmd_t.timeout_ms); once the stream is left, sp_proctab_kill_after keeps the
 * deadline: when it passes, the table asks its owner for the sandbox's agent channel (the
 * channel may have been replaced meanwhile) and sends SIGKILL to the process group. At most
 * SP_PROCTAB_KILLS_MAX are pending: past it the oldest is dropped, with a warning.
 *
 * One table serves every sandbox of a server, on the loop thread. Knows no HTTP and no
 * database: the owner resolves sandboxes (the agent callback).
 */
#ifndef SP_PROCTAB_H
#define SP_PROCTAB_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "base/err.h"
#include "core/channel/agentconn.h"
#include "loop/loop.h"

#define SP_PROCTAB_MAX       4096  /* records, all sandboxes */
#define SP_PROCTAB_KILLS_MAX 10000 /* pending lifetime kills */

typedef struct sp_proctab sp_proctab_t;

typedef struct {
    const char *key, *value;
} sp_proc_env_t;

/* What a process was started with, as the client gave it. */
typedef struct {
    const char *cmd;         /* the program */
    const char *const *args; /* its arguments after cmd */
    size_t nargs;
    const sp_proc_env_t *envs;
    size_t nenvs;
    const char *cwd; /* NULL: none given ("" is kept as given) */
    bool pty;
} sp_proc_spec_t;

/* The answer to the agent callback: conn is valid for the call only (NULL with err). */
typedef void (*sp_proctab_agent_cb)(void *arg, sp_agentconn_t *conn, const sp_err_t *err);
/* Finds the agent channel of team_id's sandbox_id for a lifetime kill: 0 and cb exactly once
 * (possibly later), or -1 and never cb. */
typedef int (*sp_proctab_agent_fn)(void *ctx, const char *sandbox_id, const char *team_id,
                                   sp_proctab_agent_cb cb, void *arg);

/* NULL when out of memory. agent and ctx are kept for lifetime kills. */
sp_proctab_t *sp_proctab_create(sp_loop_t *loop, sp_proctab_agent_fn agent, void *ctx);
/* Frees the records; pending lifetime kills are dropped (a resolution already under way
 * still sends its kill). NULL does nothing. */
void sp_proctab_destroy(sp_proctab_t *t);

/* Records spec (copied) for pid in sandbox_id, replacing a record of the same process.
 * -1 when out of memory (nothing recorded). */
int sp_proctab_put(sp_proctab_t *t, const char *sandbox_id, uint32_t pid,
                   const sp_proc_spec_t *spec);
/* pid's record, borrowed until the table is next changed; NULL when there is none. */
const sp_proc_spec_t *sp_proctab_get(sp_proctab_t *t, const char *sandbox_id, uint32_t pid);
/* Forgets pid's record (its exit was seen). */
void sp_proctab_forget(sp_proctab_t *t, const char *sandbox_id, uint32_t pid);
/* Forgets the records of sandbox_id whose pid is not in running[0..n) (a listing of the
 * processes that still run). Records of the pids listed are left as they are. */
void sp_proctab_retain(sp_proctab_t *t, const char *sandbox_id, const uint32_t *running, size_t n);

/* Kills pid's process group in sandbox_id (team_id's) after ms, unless the table is
 * destroyed first. Out of memory: nothing is scheduled (logged). */
void sp_proctab_kill_after(sp_proctab_t *t, const char *sandbox_id, const char *team_id,
                           uint32_t pid, uint64_t ms);

#endif
