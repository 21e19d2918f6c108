/*
 * ws.h - a WebSocket client (RFC 6455) for spacectl's attach to command sessions.
 *
 * Does the upgrade handshake over cli/http.h (checking Sec-WebSocket-Accept), then frames
 * with wslay: messages out are queued and masked, messages in arrive whole through the
 * callbacks, pings are answered, a close is answered and ends the connection. Non-blocking
 * after the handshake: the caller polls spc_ws_fd for spc_ws_events and calls spc_ws_io.
 * Owns the connection. Knows nothing of sessions' JSON (cli/cmd_exec.c does).
 */
#ifndef SPC_WS_H
#define SPC_WS_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "base/err.h"
#include "cli/http.h"

typedef struct spc_ws spc_ws_t;

typedef struct {
    /* A whole message; p is valid for the call. */
    void (*on_message)(void *arg, bool text, const uint8_t *p, size_t n);
} spc_ws_cbs_t;

/*
 * GETs path on u asking to upgrade, with Authorization: Bearer <bearer>. Returns the
 * WebSocket, or NULL: with *plain set to the server's answer when it did not upgrade (an
 * error, or a proxy that dropped the Upgrade header: the caller reads or frees it), or with
 * err when no answer came.
 */
spc_ws_t *spc_ws_connect(const spc_url_t *u, const char *path, const char *bearer,
                         const spc_ws_cbs_t *cbs, void *arg, spc_resp_t **plain, sp_err_t *err);
void spc_ws_free(spc_ws_t *w);

/* Queues a message (copied). -1 when the connection is closing or out of memory. */
int spc_ws_send(spc_ws_t *w, bool text, const void *p, size_t n, sp_err_t *err);
/* Bytes queued and not yet written: a sender of bulk data waits while this is large. */
size_t spc_ws_queued(spc_ws_t *w);

int spc_ws_fd(spc_ws_t *w);
/* POLLIN and/or POLLOUT as the connection wants them now. */
short spc_ws_events(spc_ws_t *w);
/* TLS holds received bytes: call spc_ws_io without waiting for the socket. */
bool spc_ws_pending(spc_ws_t *w);
/* Reads what there is (calling on_message) and writes what is queued. 1: still open; 0: the
 * server closed (cleanly or not: see spc_ws_clean); -1 with err on a protocol or I/O error. */
int spc_ws_io(spc_ws_t *w, sp_err_t *err);
/* The server sent a close frame (rather than just dropping the connection). */
bool spc_ws_clean(spc_ws_t *w);

#endif
