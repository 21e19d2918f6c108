/*
 * code.h - code contexts: long-lived interpreters inside a sandbox (Python through an
 * IPython kernel, bash) that keep state between executions.
 *
 * The interpreters are run by the guest's code daemon, /usr/local/bin/space-code
 * (guest/code/space-code, installed by templates with "code": true). It listens on
 * 127.0.0.1:SP_CODE_GUEST_PORT inside the guest; this module reaches it through an agent
 * TCP_CONNECT stream, one connection per request. When nothing listens there it runs
 * `space-code start` as root through the agent (once per sandbox at a time; concurrent
 * requests wait for the same start) and connects again. A template without the daemon
 * answers SP_ECONFLICT "this sandbox's template has no code interpreter (use a template with
 * code_interpreter, e.g. code-interpreter-v1)"; a daemon that does not come up, SP_EUNAVAIL.
 *
 * Daemon protocol (JSON lines, UTF-8, each line at most 16 MiB). The client sends one
 * request line; the daemon answers with one status line, then (execute only) event lines,
 * then closes the connection.
 *
 *   request  {"op": "create"|"list"|"delete"|"restart"|"interrupt"|"execute",
 *             "sandbox_id": str,            every request; when it differs from the last one
 *                                           the daemon saw (a fresh clone of a template
 *                                           snapshot) it reseeds its interpreters' PRNGs
 *             ...op fields below}
 *   status   {"ok": true, ...}  or  {"ok": false, "error": {"code": "invalid"|"not_found"|
 *             "unsupported_language"|"unavailable"|"internal", "message": str}}
 *
 *   create    {"language": str|null (default "python"), "cwd": str|null (default
 *             "/home/user")} -> {"ok":true, "context": CTX}
 *   list      {} -> {"ok":true, "contexts": [CTX...]}  (defaults included, "default": true)
 *   delete    {"context_id": str} -> {"ok":true}
 *   restart   {"context_id": str} -> {"ok":true, "context": CTX}  (state cleared, cwd kept)
 *   interrupt {"context_id": str} -> {"ok":true}
 *   execute   {"context_id": str|null, "language": str|null (both null: python default
 *             context; both set: "invalid"), "code": str, "env": {str: str}|null (this
 *             execution only), "timeout_ms": int (0: none)}
 *             -> {"ok":true, "context": CTX}, then events, the last one "end":
 *     {"type":"stdout"|"stderr", "text": str, "timestamp": str (ISO 8601, UTC)}
 *     {"type":"result", "is_main_result": bool, "data": {MIME type: value}}
 *              (a Jupyter MIME bundle: text/plain, text/html, image/png (base64), ...;
 *              application/json values are JSON, everything else strings)
 *     {"type":"error", "name": str, "value": str, "traceback": [str...]}
 *     {"type":"end", "status": "ok"|"error"|"timeout"|"interrupted"|"crashed",
 *              "execution_count": int|null}
 *   CTX = {"id": str, "language": "python"|"bash", "cwd": str, "default": bool}
 *
 * Executions in one context run one at a time, in arrival order. A timeout interrupts the
 * execution (SIGINT to the kernel) and keeps the context; a client that closes the
 * connection mid-execution interrupts it the same way. A kernel that dies is reported as an
 * error event plus end status "crashed"; restart brings the context back.
 *
 * Daemon details (guest/code/space-code): timeout_ms counts from when the code starts
 * running (not the wait behind other executions or a kernel start). EOF from the client
 * counts as leaving, so a client must not half-close after its request. An execute on a
 * dead context answers ok, then error "KernelDied" and end "crashed"; a default context
 * that cannot start answers "unavailable". Bash: execution_count is null; a non-zero
 * status is error "ExitCode" (value the status, traceback the stderr tail). Local tools
 * only: {"op":"status"} (no sandbox_id, never reseeds) -> contexts with "state".
 *
 * Does not know HTTP or the database: native-api/route_contexts.c and
 * e2b-gateway/envd_code.c render it.
 */
#ifndef SP_CODE_H
#define SP_CODE_H

#include <jansson.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "core/channel/agentconn.h"
#include "base/err.h"
#include "loop/loop.h"

#define SP_CODE_GUEST_PORT 49999
#define SP_CODE_DAEMON "/usr/local/bin/space-code"
#define SP_CODE_LINE_MAX   (16u * 1024 * 1024) /* bytes per protocol line, newline included */
#define SP_CODE_ID_MAX     256u                /* bytes in a context ID */

/* Test-only overrides, read once per process from spaced's environment: SPACE_CODE_PORT (the
 * daemon's port instead of SP_CODE_GUEST_PORT: the test driver's agents run on the host,
 * where 49999 may be taken) and SPACE_CODE_DAEMON (the program run with "start" instead of
 * SP_CODE_DAEMON). */

typedef struct sp_code_op sp_code_op_t; /* one request in flight */

typedef struct {
    const char *id;
    const char *language;
    const char *cwd;
    bool is_default;
} sp_code_ctx_t;

/* All pointers borrowed for the callback. */
typedef void (*sp_code_ctx_cb)(void *arg, const sp_code_ctx_t *ctx, const sp_err_t *err);
/* A list: at most SP_LIST_CONTEXTS_MAX contexts (truncated when the daemon listed more); a
 * list answer longer than SP_LIST_BYTES_MAX fails (core/channel/listcap.h). */
typedef void (*sp_code_list_cb)(void *arg, const sp_code_ctx_t *ctxs, size_t n, bool truncated,
                                const sp_err_t *err);
typedef void (*sp_code_done_cb)(void *arg, const sp_err_t *err);

/* err codes: SP_EINVAL (bad language/cwd), SP_ENOTFOUND (no such context), SP_ECONFLICT (no
 * daemon in this template), SP_EUNAVAIL (it could not start or went away), SP_EINTERNAL. */
sp_code_op_t *sp_code_create(sp_loop_t *loop, sp_agentconn_t *c, const char *sandbox_id,
                          const char *language, const char *cwd, sp_code_ctx_cb cb, void *arg,
                          sp_err_t *err);
sp_code_op_t *sp_code_list(sp_loop_t *loop, sp_agentconn_t *c, const char *sandbox_id,
                        sp_code_list_cb cb, void *arg, sp_err_t *err);
sp_code_op_t *sp_code_delete(sp_loop_t *loop, sp_agentconn_t *c, const char *sandbox_id,
                          const char *context_id, sp_code_done_cb cb, void *arg, sp_err_t *err);
sp_code_op_t *sp_code_restart(sp_loop_t *loop, sp_agentconn_t *c, const char *sandbox_id,
                           const char *context_id, sp_code_ctx_cb cb, void *arg, sp_err_t *err);
sp_code_op_t *sp_code_interrupt(sp_loop_t *loop, sp_agentconn_t *c, const char *sandbox_id,
                             const char *context_id, sp_code_done_cb cb, void *arg,
                             sp_err_t *err);

typedef struct {
    const char *context_id; /* NULL: the default context of language */
    const char *language;   /* NULL: python */
    const char *code;
    size_t code_len;
    json_t *env;            /* object of strings or NULL; borrowed for the call */
    uint32_t timeout_ms;    /* 0: none */
} sp_code_exec_req_t;

typedef enum {
    SP_CODE_EV_START = 0, /* ctx: the context it runs in (accepted by the daemon) */
    SP_CODE_EV_STDOUT,    /* text, len, timestamp */
    SP_CODE_EV_STDERR,
    SP_CODE_EV_RESULT,    /* is_main_result, data (MIME bundle object) */
    SP_CODE_EV_ERROR,     /* name, value, traceback (array of strings): the code raised */
    SP_CODE_EV_END,       /* terminal: status, execution_count (-1: none) */
    SP_CODE_EV_FAIL,      /* terminal: err (rejected before START, or the connection to the
                           * daemon broke: SP_EUNAVAIL "the code interpreter went away") */
} sp_code_evtype_t;

typedef struct {
    sp_code_evtype_t type;
    const sp_code_ctx_t *ctx;
    const char *text;
    size_t len;
    const char *timestamp;
    bool is_main_result;
    json_t *data;
    const char *name, *value;
    json_t *traceback;
    const char *status;
    int execution_count;
    const sp_err_t *err;
} sp_code_ev_t; /* everything borrowed for the callback */

typedef void (*sp_code_event_cb)(void *arg, const sp_code_ev_t *ev);

/* Runs code; events arrive in order, exactly one terminal (END or FAIL) last. Flow control:
 * the daemon's bytes are granted back to the agent only as the caller acknowledges what it
 * passed on (sp_code_ack with the event's len for STDOUT/STDERR, 0 otherwise is fine): a
 * slow client holds the interpreter's output in the guest, never in spaced's memory. */
sp_code_op_t *sp_code_execute(sp_loop_t *loop, sp_agentconn_t *c, const char *sandbox_id,
                           const sp_code_exec_req_t *req, sp_code_event_cb cb, void *arg,
                           sp_err_t *err);
void sp_code_ack(sp_code_op_t *op, size_t n);

/* Stops a request: no callback after this returns. For execute, closing the connection makes
 * the daemon interrupt the running execution. */
void sp_code_cancel(sp_code_op_t *op);

/* Normalises a language name as the daemon does (trimmed, lower case; "py"/"python3" ->
 * "python", "sh" -> "bash"); NULL when it is not one of SP_CODE_LANGUAGES. */
const char *sp_code_language(const char *name);
#define SP_CODE_LANGUAGES "python, bash"

#endif
