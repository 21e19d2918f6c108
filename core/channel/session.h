/*
 * session.h - command sessions: the data-plane side of running a command.
 *
 * A session is created on the control plane (the API checks team scope and that the sandbox
 * runs) and holds one command spec and a session-scoped attach token. A client then attaches
 * with that token: the first attach starts the process, later ones re-attach to it (the
 * agent's buffered output first, then new output). Attaching needs no database: the caller
 * hands in the sandbox's agent channel from the runtime driver, which in a multi-host
 * deployment lives on the worker that owns the VM.
 *
 * Owns an in-memory table of sessions and, per attachment, one agent stream (PROC_START on
 * the first attach, PROC_ATTACH after) on which stdin, EOF, resize and signals travel too.
 * Tokens are kept only as a BLAKE2b hash and compared in constant time. Knows no HTTP.
 *
 * States: CREATED (no process yet) -> RUNNING (first attach started it) -> EXITED (its exit
 * was seen). Lifetimes: a CREATED session is removed when its attach deadline passes
 * (expires_at); a RUNNING one with nobody attached after SP_SESSION_DETACHED_S (the process
 * keeps running and stays reachable through .../commands); an EXITED one after
 * SP_SESSION_KEEP_S. One attachment at a time per session.
 *
 * Flow control: output reaches the caller as it arrives and the agent gets credit back only
 * through sp_session_ack, so a slow client holds one agent window (SP_AP_INITIAL_WINDOW) here.
 * Stdin goes the other way: sp_session_write takes what the agent's credit allows and
 * on_writable says when to offer the rest.
 */
#ifndef SP_SESSION_H
#define SP_SESSION_H

#include <jansson.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "core/channel/agentconn.h"
#include "base/err.h"
#include "core/channel/exec.h"
#include "base/ids.h"
#include "loop/loop.h"

#define SP_SESSION_ID_LEN     24   /* "se" + 22 chars of [a-z0-9] */
#define SP_SESSION_TOKEN_LEN  47   /* "sat_" + 43 chars of base62, ~256 bits */
#define SP_SESSION_ATTACH_S   600  /* default deadline for the first attach */
#define SP_SESSION_DETACHED_S 600  /* a running session nobody attaches to is dropped after */
#define SP_SESSION_KEEP_S     60   /* an exited session is kept this long for re-attach */
#define SP_SESSION_MAX        4096 /* sessions per table */
#define SP_SESSION_TEAM_MAX   256  /* sessions per team */

typedef enum {
    SP_SESSION_CREATED = 0,
    SP_SESSION_RUNNING, /* from CREATED: an attach started the process */
    SP_SESSION_EXITED,  /* from RUNNING: its exit was reported */
} sp_session_state_t;

typedef struct sp_session_tab sp_session_tab_t;
typedef struct sp_session sp_session_t;
typedef struct sp_session_att sp_session_att_t;

typedef struct {
    const char *team_id;
    const char *sandbox_id;
    const sp_exec_cmd_t *cmd; /* cmd/argv, env, cwd, user, pty, rows, cols are used (copied) */
    uint32_t attach_timeout_s; /* 0: SP_SESSION_ATTACH_S */
} sp_session_spec_t;

sp_session_tab_t *sp_session_tab_create(sp_loop_t *loop);
/* Frees every session; open attachments are reset without callbacks. NULL does nothing. */
void sp_session_tab_destroy(sp_session_tab_t *t);

/* A new session; the token is written to token_out (shown once, only its hash is kept). NULL
 * with err: SP_EINVAL for a bad spec, SP_ECONFLICT when the team or the table is full. The
 * session is owned by the table. */
sp_session_t *sp_session_create(sp_session_tab_t *t, const sp_session_spec_t *spec,
                                char token_out[SP_SESSION_TOKEN_LEN + 1], sp_err_t *err);

/* The session id for the attach path, checked against token: unknown or expired ids are
 * SP_ENOTFOUND, a wrong or missing token SP_EAUTH (checked in constant time). */
sp_session_t *sp_session_authorize(sp_session_tab_t *t, const char *id, const char *token,
                                   sp_err_t *err);

/* Team-scoped lookup for the control plane: NULL unless the session is the team's and
 * belongs to sandbox_id. */
sp_session_t *sp_session_get(sp_session_tab_t *t, const char *team_id, const char *sandbox_id,
                             const char *id);

/* {"id","sandbox_id","state","attached","pid","created_at","expires_at","exit_code","signal",
 * "cmd" | "argv", "pty"} (never the token). Caller owns the result. */
json_t *sp_session_json(const sp_session_t *s);
/* Array of the team's sessions of sandbox_id. Caller owns the result. */
json_t *sp_session_list_json(sp_session_tab_t *t, const char *team_id, const char *sandbox_id);

const char *sp_session_id(const sp_session_t *s);
const char *sp_session_sandbox(const sp_session_t *s);
sp_session_state_t sp_session_state(const sp_session_t *s);
uint32_t sp_session_pid(const sp_session_t *s); /* 0 before the start */
/* Deadline for the first attach, "YYYY-MM-DDTHH:MM:SSZ". */
const char *sp_session_expires_at(const sp_session_t *s);

/* Removes the session: an attachment gets SIGKILL sent to the process group and ends when the
 * exit arrives; without one, conn (may be NULL) is used to send it. s is invalid afterwards. */
void sp_session_remove(sp_session_tab_t *t, sp_session_t *s, sp_agentconn_t *conn);

/* ---- attaching ---- */

typedef struct {
    /* START (pid), STDOUT/STDERR (data borrowed; sp_session_ack once passed on), then exactly
     * one terminal EXIT or ERROR (an ERROR before START: nothing was attached; SP_ECONFLICT
     * when the session was removed meanwhile). After a terminal event the attachment is
     * freed when the callback returns. */
    void (*on_event)(void *arg, const sp_exec_ev_t *ev);
    /* Stdin credit came back after sp_session_write took less than offered. May be NULL. */
    void (*on_writable)(void *arg);
} sp_session_att_cbs_t;

/*
 * Attaches to s over conn (the sandbox's agent channel): starts the process if the session
 * is CREATED (stdin is a pipe when interactive, else /dev/null), else re-attaches with
 * replay. NULL with err: SP_ECONFLICT when another attachment is open, SP_EUNAVAIL when the
 * agent cannot be reached. Callbacks never run inside this call.
 */
sp_session_att_t *sp_session_attach(sp_session_t *s, sp_agentconn_t *conn, bool interactive,
                                    const sp_session_att_cbs_t *cbs, void *arg, sp_err_t *err);

/* The caller passed n output bytes on: the agent may send n more. */
void sp_session_ack(sp_session_att_t *a, size_t n);
/* Offers stdin: returns the bytes taken now (0..n; wait for on_writable for the rest), or -1
 * when the attachment is finished or failing. */
long sp_session_write(sp_session_att_t *a, const void *p, size_t n);
/* Closes the process's stdin; resizes its PTY (1..1000 each); sends a signal (1..64) to its
 * process group. 0, or -1 with err (SP_EINVAL for bad values, SP_ECONFLICT when gone). */
int sp_session_eof(sp_session_att_t *a, sp_err_t *err);
int sp_session_resize(sp_session_att_t *a, uint32_t rows, uint32_t cols, sp_err_t *err);
int sp_session_signal(sp_session_att_t *a, int sig, sp_err_t *err);

/* Ends the attachment without callbacks; the process keeps running and can be re-attached.
 * May be called from the attachment's callbacks. NULL does nothing. */
void sp_session_detach(sp_session_att_t *a);

#endif
