/*
 * qmp.h - asynchronous client for the QEMU Machine Protocol on the loop.
 *
 * One sp_qmp_t per QEMU process, over its QMP unix socket (or any connected
 * stream fd, for tests). It reads the greeting, negotiates capabilities and
 * then runs commands: each gets an id, its reply is matched by id and handed
 * to the command's callback. Commands issued before negotiation finishes are
 * queued and sent after it. Asynchronous events (STOP, RESUME, SHUTDOWN, ...)
 * go to the event callback. A command can carry one fd (SCM_RIGHTS), for
 * `getfd` and friends.
 *
 * When the connection drops (QEMU died, garbage on the wire), every pending
 * command's callback gets SP_EUNAVAIL, then on_closed is called once. Knows
 * nothing about VMs or sandboxes.
 */
#ifndef SP_QMP_H
#define SP_QMP_H

#include <jansson.h>
#include <stdbool.h>

#include "base/err.h"
#include "loop/loop.h"

typedef struct sp_qmp sp_qmp_t;

/* A command's outcome: ret is the "return" value (borrowed for the call) or
 * NULL with err set (QMP "error" reply: SP_ERUNTIME with QEMU's desc; lost
 * connection: SP_EUNAVAIL). */
typedef void (*sp_qmp_reply_cb)(void *arg, json_t *ret, const sp_err_t *err);

typedef struct {
    /* Capabilities negotiated: commands now go out. May be NULL. */
    void (*on_ready)(sp_qmp_t *q, void *arg);
    /* An event, e.g. "STOP"; data borrowed for the call (may be NULL). May be NULL. */
    void (*on_event)(sp_qmp_t *q, const char *event, json_t *data, void *arg);
    /* The connection ended (EOF, error, protocol violation); called once, after the
     * pending commands failed. The client is still to be destroyed by the owner. May be NULL. */
    void (*on_closed)(sp_qmp_t *q, const sp_err_t *err, void *arg);
} sp_qmp_cbs_t;

/* Wraps a connected stream fd (the client owns and closes it). cbs is copied.
 * No callback runs inside the call. */
sp_qmp_t *sp_qmp_create(sp_loop_t *loop, int fd, const sp_qmp_cbs_t *cbs, void *arg, sp_err_t *err);

/* Connects to a unix socket path (non-blocking; a unix connect completes or
 * fails at once). NULL with SP_EUNAVAIL when nobody listens there yet. */
sp_qmp_t *sp_qmp_connect(sp_loop_t *loop, const char *path, const sp_qmp_cbs_t *cbs, void *arg,
                         sp_err_t *err);

/* Closes the connection. Pending command callbacks are dropped without being
 * called (the owner is going away). Safe inside any of the client's callbacks.
 * NULL does nothing. */
void sp_qmp_destroy(sp_qmp_t *q);

/*
 * Sends {"execute": cmd, "arguments": args, "id": n}. args (may be NULL) is
 * stolen, even on failure. fd >= 0 travels with the command as SCM_RIGHTS
 * (dup'd at once: the caller keeps its fd). cb (may be NULL) runs exactly once
 * with the reply, never inside this call. -1 with SP_EUNAVAIL when the
 * connection is already closed.
 */
int sp_qmp_command(sp_qmp_t *q, const char *cmd, json_t *args, int fd, sp_qmp_reply_cb cb,
                   void *arg, sp_err_t *err);

/* Negotiated and not closed. */
bool sp_qmp_ready(const sp_qmp_t *q);
bool sp_qmp_closed(const sp_qmp_t *q);

#endif
