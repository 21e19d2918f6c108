/*
 * agentconn.h - the host end of one VM's agent channel (core/agentproto.h).
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
 * unknown stream is dropped; a channel that sends garbage is closed and
 * reconnected. Nothing a guest sends can block the loop or grow memory
 * beyond one frame buffer plus the windows granted.
 */
#ifndef SP_AGENTCONN_H
#define SP_AGENTCONN_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "core/agentproto.h"
#include "core/err.h"
#include "core/loop.h"

typedef struct sp_agentconn sp_agentconn_t;
typedef struct sp_agentstream sp_agentstream_t;

typedef struct {
    /* A frame for this stream (type SP_AP_T_*, payload borrowed for the call). After a frame
     * with SP_AP_F_END the stream is finished: it is freed when the callback returns. */
    void (*on_frame)(sp_agentstream_t *s, uint16_t type, uint16_t flags, const uint8_t *payload,
                     size_t len, void *arg);
    /* The stream ended without END (channel lost, connection closed, reset by us is silent:
     * not called after sp_agentstream_reset). The stream is freed after the call. */
    void (*on_error)(sp_agentstream_t *s, const sp_err_t *err, void *arg);
    /* Send credit came back after a send was refused. May be NULL. */
    void (*on_writable)(sp_agentstream_t *s, void *arg);
} sp_agentstream_cbs_t;

/* Channel state changes: up after each successful HELLO exchange, down when lost. */
typedef void (*sp_agentconn_state_cb)(void *arg, bool up);

/* Starts connecting to socket_path (retrying with backoff until destroyed). */
sp_agentconn_t *sp_agentconn_create(sp_loop_t *loop, const char *socket_path,
                                    sp_agentconn_state_cb on_state, void *arg);
/* Closes the channel; every open stream gets on_error. NULL does nothing. */
void sp_agentconn_destroy(sp_agentconn_t *c);

bool sp_agentconn_up(const sp_agentconn_t *c);
/* The agent's version string from its last HELLO ("" before). */
const char *sp_agentconn_agent_version(const sp_agentconn_t *c);

/*
 * Calls cb once the channel is up (at once on the next loop turn if it is),
 * or with SP_EUNAVAIL after timeout_ms. Returns -1 only on allocation failure.
 */
int sp_agentconn_when_up(sp_agentconn_t *c, uint32_t timeout_ms,
                         void (*cb)(void *arg, const sp_err_t *err), void *arg);

/*
 * Opens a stream with its first frame (type = an opening type: PROC_START,
 * PROC_ATTACH, PROC_LIST, FS_*, WATCH_START, TCP_CONNECT, IDENTITY; payload
 * = the TLV fields, built with sp_ap_put_*). NULL with SP_EUNAVAIL when the
 * channel is down. Callbacks never run inside this call.
 */
sp_agentstream_t *sp_agentconn_open(sp_agentconn_t *c, uint16_t type, const uint8_t *payload,
                                    size_t len, const sp_agentstream_cbs_t *cbs, void *arg,
                                    sp_err_t *err);

/*
 * Sends one frame on the stream (DATA, EOF, PROC_SIGNAL, PROC_RESIZE, ...).
 * DATA counts against the agent's credit: returns 1 when sent, 0 when it
 * would exceed the credit (nothing sent; wait for on_writable), -1 when the
 * stream or channel is gone. len <= SP_AP_MAX_DATA for DATA.
 */
int sp_agentstream_send(sp_agentstream_t *s, uint16_t type, const uint8_t *payload, size_t len);

/* Bytes of DATA the agent will accept now. */
size_t sp_agentstream_credit(const sp_agentstream_t *s);

/* Gives the agent n more bytes of credit for output on this stream (sends WINDOW). */
void sp_agentstream_grant(sp_agentstream_t *s, uint32_t n);

/* Abandons the stream (sends RESET; no more callbacks). A process keeps running. */
void sp_agentstream_reset(sp_agentstream_t *s);

/* The stream's user argument, and its connection. */
void *sp_agentstream_arg(const sp_agentstream_t *s);
sp_agentconn_t *sp_agentstream_conn(const sp_agentstream_t *s);

#endif
