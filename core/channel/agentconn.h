/*
 * agentconn.h - the host end of one VM's agent channel (base/agentproto.h).
 *
 * Folder: core/channel/ is the agent channel and what runs on it: exec, files, sessions, code, E2B
 * process records and watchers. (ARCHITECTURE.md: the layers.)
 *
 * One sp_agentconn_t per VM, owned by the runtime driver: it connects to the
 * unix socket QEMU exposes for the virtio-serial port, says HELLO, and
 * multiplexes streams over it on the process loop. If the channel drops
 * (QEMU restarted, snapshot restore, spaced restart) it reconnects with
 * backoff and says HELLO again; open streams end with an error, processes in
 * the guest keep running (re-attach with PROC_ATTACH).
 *
 * Flow control: each stream starts with SP_AP_INITIAL_WINDOW of credit each
 * way. Frames from the agent are handed to the stream's callback as they
 * arrive; the consumer grants credit back (sp_agentstream_grant) only when it
 * has passed the bytes on, so a slow HTTP client slows the guest process
 * instead of growing host memory. Sends beyond the agent's credit are refused
 * (sp_agentstream_send returns 0 and on_writable fires when credit returns).
 *
 * Hostile guests: every frame is bounds-checked by the codec; a frame for an
 * unknown stream is dropped; a channel that sends garbage (bad header,
 * oversized frame, a HELLO that does not parse or has another version, a
 * second HELLO) is closed and reconnected; output beyond the window we
 * granted ends that stream (RESET, on_error). Nothing a guest sends can block
 * the loop or grow memory beyond one frame buffer plus the windows granted.
 * Output to a guest that stops reading is bounded too: DATA is refused (as if
 * out of credit) while 1 MiB is queued, and a queue past 8 MiB (control
 * frames keep coming) means the channel is dead: closed and reconnected.
 *
 * Reconnect backoff: 100 ms doubling to 2 s, reset by each successful HELLO.
 * There is no PING liveness probe: a paused VM cannot answer one. A HELLO
 * without an answer for 5 s is said again on the same connection, with a new
 * session (the wait doubling to 10 minutes): an answer lost in the guest then
 * costs that wait, not the channel, and a paused VM only queues a few HELLOs.
 *
 * Re-entrancy: sp_agentconn_destroy may be called from any callback of the
 * connection or its streams (the teardown finishes when that callback
 * returns); sp_agentstream_reset may be called from the stream's own
 * callbacks. Every other callback runs from the loop, never inside a call,
 * except on_error and SP_AGENTCONN_GONE from sp_agentconn_destroy itself.
 *
 * Streams the agent opens (egress: EGRESS_OPEN, DNS_QUERY; ids with
 * SP_AP_STREAM_AGENT_BASE set) go to the acceptor registered with
 * sp_agentconn_set_acceptor, which hands back the stream's callbacks. On them
 * the host ends the stream (sp_agentstream_end: OK, ERROR or DNS_ANSWER with
 * SP_AP_F_END) and the agent abandons it with RESET (on_error, "closed by the
 * guest"). Without an acceptor such streams are refused with ERROR.
 *
 * Besides the owner's on_state, any number of listeners (sp_agentconn_listen)
 * hear that a session came up (each HELLO), went down, or that the
 * connection is being destroyed; and one process-wide hook hears about every
 * connection its driver names with sp_agentconn_set_sandbox, which is how
 * the egress proxy attaches to each sandbox's channel.
 */
#ifndef SP_AGENTCONN_H
#define SP_AGENTCONN_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "base/agentproto.h"
#include "base/err.h"
#include "loop/loop.h"

typedef struct sp_agentconn sp_agentconn_t;
typedef struct sp_agentstream sp_agentstream_t;

typedef struct {
    /* A frame for this stream (type SP_AP_T_*, payload borrowed for the call). WINDOW is
     * consumed by the connection; other types, unknown ones included, are passed on. After a
     * frame with SP_AP_F_END the stream is finished (send returns -1, grant does nothing): it is
     * freed when the callback returns. */
    void (*on_frame)(sp_agentstream_t *s, uint16_t type, uint16_t flags, const uint8_t *payload,
                     size_t len, void *arg);
    /* The stream ended without END (channel lost, connection closed, reset by us is silent:
     * not called after sp_agentstream_reset). The stream is freed after the call. */
    void (*on_error)(sp_agentstream_t *s, const sp_err_t *err, void *arg);
    /* Send credit came back (or the output queue drained) after a send was refused; a retry
     * larger than the credit now available is refused again. May be NULL. */
    void (*on_writable)(sp_agentstream_t *s, void *arg);
} sp_agentstream_cbs_t;

/* Channel state changes: up after each successful HELLO exchange, down when lost (after the
 * open streams got on_error). Not called by sp_agentconn_destroy. */
typedef void (*sp_agentconn_state_cb)(void *arg, bool up);

/* Starts connecting to socket_path (retrying with backoff until destroyed). socket_path is
 * copied; NULL when it does not fit a sockaddr_un, on_state is NULL, or memory is short. */
sp_agentconn_t *sp_agentconn_create(sp_loop_t *loop, const char *socket_path,
                                    sp_agentconn_state_cb on_state, void *arg);
/* Closes the channel; every open stream gets on_error (SP_EUNAVAIL), and pending when_up
 * callbacks get SP_EUNAVAIL: inside this call, or when the callback it was called from returns.
 * NULL does nothing. */
void sp_agentconn_destroy(sp_agentconn_t *c);

/* Where later (re)connections go: the socket moved with its directory (a spare clone taken
 * by a sandbox, core/runtime/qemu/pool.c). The live connection is kept. -1 when the path does not
 * fit a sockaddr_un or memory is short (the old path stays). */
int sp_agentconn_set_path(sp_agentconn_t *c, const char *socket_path);

/* How long the first HELLO of a connection waits for its answer before it is said again
 * (tests; 0 restores the default, 5 s). Applies from the next connection. */
void sp_agentconn_set_hello_wait(sp_agentconn_t *c, uint32_t ms);

bool sp_agentconn_up(const sp_agentconn_t *c);
/* The agent's version string from its last HELLO ("" before). */
const char *sp_agentconn_agent_version(const sp_agentconn_t *c);

/*
 * Calls cb once the channel is up (at once on the next loop turn if it is),
 * or with SP_EUNAVAIL after timeout_ms (or when the connection is destroyed). Returns -1 only
 * on allocation failure or while the connection is being destroyed.
 */
int sp_agentconn_when_up(sp_agentconn_t *c, uint32_t timeout_ms,
                         void (*cb)(void *arg, const sp_err_t *err), void *arg);

/*
 * Opens a stream with its first frame (type = an opening type: PROC_START,
 * PROC_ATTACH, PROC_LIST, FS_*, WATCH_START, TCP_CONNECT, IDENTITY; payload
 * = the TLV fields, built with sp_ap_put_*). NULL with SP_EUNAVAIL when the
 * channel is down, SP_ETOOBIG when payload is over SP_AP_MAX_PAYLOAD,
 * SP_EINTERNAL for a type that does not open a stream or cbs without on_frame
 * or on_error. Callbacks never run inside this call. The id is picked in
 * [1, SP_AP_STREAM_AGENT_BASE), never one still open.
 */
sp_agentstream_t *sp_agentconn_open(sp_agentconn_t *c, uint16_t type, const uint8_t *payload,
                                    size_t len, const sp_agentstream_cbs_t *cbs, void *arg,
                                    sp_err_t *err);

/*
 * Sends one frame on the stream (DATA, EOF, PROC_SIGNAL, PROC_RESIZE, ...).
 * DATA counts against the agent's credit: returns 1 when sent (queued), 0 when
 * it would exceed the credit or the channel's output queue is over its soft
 * bound (nothing sent; wait for on_writable), -1 when the stream or channel
 * is gone or failing. len <= SP_AP_MAX_DATA for DATA; other types never wait
 * for credit. Also -1 (a caller bug, logged) for a type the host may not send
 * on a stream: opening types, WINDOW (use grant), RESET (use reset).
 */
int sp_agentstream_send(sp_agentstream_t *s, uint16_t type, const uint8_t *payload, size_t len);

/* Bytes of DATA the agent will accept now (0 while the output queue is over its soft bound). */
size_t sp_agentstream_credit(const sp_agentstream_t *s);

/* Asks for on_writable once sp_agentstream_credit would be above 0 again (after a WINDOW from
 * the agent or the output queue draining), without attempting a send. Never calls back inside
 * the call; a stream with credit now gets it on a later loop turn. */
void sp_agentstream_want_writable(sp_agentstream_t *s);

/* Gives the agent n more bytes of credit for output on this stream (sends WINDOW). */
void sp_agentstream_grant(sp_agentstream_t *s, uint32_t n);

/* Abandons the stream (sends RESET unless it already ended; no more callbacks; s is freed, at
 * once or when its running callback returns). A process keeps running. NULL does nothing. */
void sp_agentstream_reset(sp_agentstream_t *s);

/*
 * Ends a stream the agent opened with its last frame: type OK, ERROR or DNS_ANSWER, sent with
 * SP_AP_F_END (payload: TLV fields, <= SP_AP_MAX_PAYLOAD). No callbacks after it; s is freed
 * at once or when its running callback returns. Returns 0 when the frame was queued, -1 when
 * it could not be (channel gone or failing; the stream is released all the same) or for a
 * caller bug (a host-opened stream, another type: logged, nothing done).
 */
int sp_agentstream_end(sp_agentstream_t *s, uint16_t type, const uint8_t *payload, size_t len);

/* For the acceptor of a stream the agent opened, inside the accept call: the agent was told
 * (EGRESS_CONFIG.WINDOW) that this stream starts with n bytes of credit instead of
 * SP_AP_INITIAL_WINDOW, so DATA past n before a grant ends it like any window violation. Only
 * lowers the window; nothing for other streams or once DATA has come. */
void sp_agentstream_set_recv_window(sp_agentstream_t *s, uint32_t n);

/* True for a stream the agent opened. */
bool sp_agentstream_agent_opened(const sp_agentstream_t *s);

/* The stream's user argument, and its connection. */
void *sp_agentstream_arg(const sp_agentstream_t *s);
sp_agentconn_t *sp_agentstream_conn(const sp_agentstream_t *s);

/* ---- streams the agent opens ---- */

/*
 * Offered each stream the agent opens (type EGRESS_OPEN or DNS_QUERY; payload borrowed for
 * the call). To take it, fill *cbs (on_frame and on_error required) and *stream_arg and
 * return 0: the opening frame itself is not passed to on_frame, and the handler may already
 * send on s or end it. Return -1 to refuse: the connection ends it with ERROR
 * (SP_AP_E_UNAVAIL). Runs from the loop.
 */
typedef int (*sp_agentconn_accept_cb)(void *arg, sp_agentstream_t *s, uint16_t type,
                                      const uint8_t *payload, size_t len,
                                      sp_agentstream_cbs_t *cbs, void **stream_arg);
/* Sets (or with cb NULL clears) the connection's acceptor; one per connection. */
void sp_agentconn_set_acceptor(sp_agentconn_t *c, sp_agentconn_accept_cb cb, void *arg);

/* ---- listeners ---- */

typedef enum {
    SP_AGENTCONN_UP = 1, /* a session started (HELLO answered); after the owner's on_state */
    SP_AGENTCONN_DOWN,   /* the session was lost (streams already failed); after on_state */
    SP_AGENTCONN_GONE,   /* the connection is being destroyed: forget it; the listener is
                            freed after the call */
} sp_agentconn_event_t;

typedef void (*sp_agentconn_listen_cb)(void *arg, sp_agentconn_t *c, sp_agentconn_event_t ev);
typedef struct sp_agentconn_listener sp_agentconn_listener_t;

/* Adds a listener (in order of adding). NULL when memory is short or c is being destroyed.
 * It is not told about a session that is already up: check sp_agentconn_up. */
sp_agentconn_listener_t *sp_agentconn_listen(sp_agentconn_t *c, sp_agentconn_listen_cb cb,
                                             void *arg);
/* Removes a listener; safe inside any callback, its own included. NULL does nothing. */
void sp_agentconn_unlisten(sp_agentconn_listener_t *l);

/* Capabilities (SP_AP_CAP_*) from the agent's last HELLO (0 before). */
uint32_t sp_agentconn_caps(const sp_agentconn_t *c);

/* ---- which sandbox ---- */

/* Names the sandbox this channel belongs to (its driver calls it right after create; id is
 * copied, at most 64 characters) and tells the process-wide hook, inside this call. Called
 * again with another name (a spare clone taken by a sandbox), the hook hears the new name for
 * the same channel. */
void sp_agentconn_set_sandbox(sp_agentconn_t *c, const char *sandbox_id);
/* The name given to set_sandbox, "" before. */
const char *sp_agentconn_sandbox(const sp_agentconn_t *c);

/* The process-wide hook told about every named channel (one per process: the egress proxy;
 * NULL clears). It typically adds a listener and an acceptor. Loop thread only. */
typedef void (*sp_agentconn_hook_cb)(void *arg, sp_agentconn_t *c, const char *sandbox_id);
void sp_agentconn_set_hook(sp_agentconn_hook_cb cb, void *arg);

#endif
