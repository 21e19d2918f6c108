/*
 * ws.c - the WebSocket client (ws.h): handshake over cli/http.c, framing by wslay.
 */
#include "cli/ws.h"

#include <openssl/evp.h>
#include <openssl/rand.h>
#include <openssl/sha.h>
#include <poll.h>
#include <stdlib.h>
#include <string.h>
#include <wslay/wslay.h>

#define WS_GUID           "258EAFA5-E914-47DA-95CA-C5AB0DC85B11"
#define WS_MAX_MSG        (64 * 1024 * 1024)
#define HANDSHAKE_TIMEOUT 30000 /* ms */

struct spc_ws {
    spc_conn_t *conn;
    wslay_event_context_ptr ctx;
    sp_buf_t pre; /* bytes read past the 101's head: the first frames */
    size_t pre_off;
    spc_ws_cbs_t cbs;
    void *arg;
    bool eof;    /* the server ended the TCP connection */
    bool failed; /* a read or write failed: ioerr says why */
    sp_err_t ioerr;
};

static ssize_t on_recv(wslay_event_context_ptr ctx, uint8_t *buf, size_t len, int flags,
                       void *user)
{
    spc_ws_t *w = user;
    if (w->pre_off < w->pre.len) {
        size_t n = w->pre.len - w->pre_off < len ? w->pre.len - w->pre_off : len;
        memcpy(buf, w->pre.p + w->pre_off, n);
        w->pre_off += n;
        return (ssize_t)n;
    }
    long k = spc_conn_read(w->conn, buf, len, &w->ioerr);
    if (k > 0)
        return k;
    if (k == -2) {
        wslay_event_set_error(ctx, WSLAY_ERR_WOULDBLOCK);
        return -1;
    }
    if (k == 0)
        w->eof = true;
    else
        w->failed = true;
    wslay_event_set_error(ctx, WSLAY_ERR_CALLBACK_FAILURE);
    return -1;
}

static ssize_t on_send(wslay_event_context_ptr ctx, const uint8_t *data, size_t len, int flags,
                       void *user)
{
    spc_ws_t *w = user;
    long k = spc_conn_write(w->conn, data, len, &w->ioerr);
    if (k > 0)
        return k;
    if (k == -2) {
        wslay_event_set_error(ctx, WSLAY_ERR_WOULDBLOCK);
        return -1;
    }
    w->failed = true;
    wslay_event_set_error(ctx, WSLAY_ERR_CALLBACK_FAILURE);
    return -1;
}

static int on_genmask(wslay_event_context_ptr ctx, uint8_t *buf, size_t len, void *user)
{
    return RAND_bytes(buf, (int)len) == 1 ? 0 : -1;
}

static void on_msg(wslay_event_context_ptr ctx, const struct wslay_event_on_msg_recv_arg *arg,
                   void *user)
{
    spc_ws_t *w = user;
    /* Control frames (ping, pong, close) are wslay's: it answers them itself. */
    if (arg->opcode == WSLAY_TEXT_FRAME || arg->opcode == WSLAY_BINARY_FRAME)
        w->cbs.on_message(w->arg, arg->opcode == WSLAY_TEXT_FRAME, arg->msg, arg->msg_length);
}

void spc_ws_free(spc_ws_t *w)
{
    if (w == NULL)
        return;
    if (w->ctx != NULL)
        wslay_event_context_free(w->ctx);
    spc_conn_close(w->conn);
    sp_buf_free(&w->pre);
    free(w);
}

/* base64(SHA-1(key + GUID)): what the server must answer in Sec-WebSocket-Accept. */
static void expected_accept(const char *key, char out[64])
{
    unsigned char md[SHA_DIGEST_LENGTH];
    char in[128];
    int n = snprintf(in, sizeof(in), "%s%s", key, WS_GUID);
    SHA1((const unsigned char *)in, (size_t)n, md);
    EVP_EncodeBlock((unsigned char *)out, md, SHA_DIGEST_LENGTH);
}

spc_ws_t *spc_ws_connect(const spc_url_t *u, const char *path, const char *bearer,
                         const spc_ws_cbs_t *cbs, void *arg, spc_resp_t **plain, sp_err_t *err)
{
    *plain = NULL;
    unsigned char rnd[16];
    char key[32], keyline[64], want[64];
    if (RAND_bytes(rnd, sizeof(rnd)) != 1) {
        sp_err_set(err, SP_EINTERNAL, "no random bytes for the WebSocket key");
        return NULL;
    }
    EVP_EncodeBlock((unsigned char *)key, rnd, sizeof(rnd));
    snprintf(keyline, sizeof(keyline), "Sec-WebSocket-Key: %s", key);
    const char *hdrs[] = {"Connection: Upgrade", "Upgrade: websocket",
                          "Sec-WebSocket-Version: 13", keyline, NULL};
    spc_req_t rq = {.method = "GET", .path = path, .bearer = bearer, .headers = hdrs,
                    .timeout_ms = HANDSHAKE_TIMEOUT};
    spc_resp_t *r = spc_http_send(u, &rq, err);
    if (r == NULL)
        return NULL;
    if (spc_resp_status(r) != 101) {
        *plain = r;
        return NULL;
    }
    expected_accept(key, want);
    const char *got = spc_resp_header(r, "sec-websocket-accept");
    if (got == NULL || strcmp(got, want) != 0) {
        spc_resp_free(r);
        sp_err_set(err, SP_EUNAVAIL, "the server's WebSocket handshake is wrong "
                                     "(Sec-WebSocket-Accept)");
        return NULL;
    }
    spc_ws_t *w = calloc(1, sizeof(*w));
    if (w == NULL) {
        spc_resp_free(r);
        sp_err_set(err, SP_EINTERNAL, "out of memory");
        return NULL;
    }
    w->cbs = *cbs;
    w->arg = arg;
    w->conn = spc_resp_take_conn(r, &w->pre);
    spc_resp_free(r);
    struct wslay_event_callbacks wcb = {.recv_callback = on_recv, .send_callback = on_send,
                                        .genmask_callback = on_genmask,
                                        .on_msg_recv_callback = on_msg};
    if (w->pre.oom || spc_conn_set_nonblocking(w->conn) < 0 ||
        wslay_event_context_client_init(&w->ctx, &wcb, w) != 0) {
        spc_ws_free(w);
        sp_err_set(err, SP_EINTERNAL, "out of memory");
        return NULL;
    }
    wslay_event_config_set_max_recv_msg_length(w->ctx, WS_MAX_MSG);
    return w;
}

int spc_ws_send(spc_ws_t *w, bool text, const void *p, size_t n, sp_err_t *err)
{
    struct wslay_event_msg m = {.opcode = text ? WSLAY_TEXT_FRAME : WSLAY_BINARY_FRAME,
                                .msg = p, .msg_length = n};
    if (wslay_event_queue_msg(w->ctx, &m) != 0)
        return sp_err_set(err, SP_EUNAVAIL, "the session's connection is closing");
    return 0;
}

size_t spc_ws_queued(spc_ws_t *w)
{
    return wslay_event_get_queued_msg_length(w->ctx);
}

int spc_ws_fd(spc_ws_t *w)
{
    return spc_conn_fd(w->conn);
}

short spc_ws_events(spc_ws_t *w)
{
    short ev = 0;
    if (wslay_event_want_read(w->ctx))
        ev |= POLLIN;
    if (wslay_event_want_write(w->ctx))
        ev |= POLLOUT;
    return ev;
}

bool spc_ws_pending(spc_ws_t *w)
{
    return w->pre_off < w->pre.len || spc_conn_pending(w->conn);
}

bool spc_ws_clean(spc_ws_t *w)
{
    return wslay_event_get_close_received(w->ctx) != 0;
}

int spc_ws_io(spc_ws_t *w, sp_err_t *err)
{
    if (wslay_event_want_read(w->ctx) && wslay_event_recv(w->ctx) != 0) {
        if (w->failed) {
            if (err != NULL)
                *err = w->ioerr;
            return -1;
        }
        if (w->eof)
            return 0;
        return sp_err_set(err, SP_EINTERNAL, "out of memory");
    }
    if (w->eof)
        return 0;
    if (wslay_event_want_write(w->ctx) && wslay_event_send(w->ctx) != 0) {
        if (w->failed) {
            if (err != NULL)
                *err = w->ioerr;
            return -1;
        }
        return sp_err_set(err, SP_EINTERNAL, "out of memory");
    }
    return wslay_event_want_read(w->ctx) || wslay_event_want_write(w->ctx) ? 1 : 0;
}
