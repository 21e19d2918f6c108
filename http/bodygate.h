/*
 * bodygate.h - a look at each request's head before h2o reads its body (HTTP/1 and HTTP/2).
 *
 * h2o 2.2.5 calls a handler only once the whole request body is in memory (HTTP/1: the
 * content-length and chunked readers of lib/http1.c; HTTP/2: DATA frames gathered until
 * END_STREAM); it has no hook between the head and the body (streaming request bodies,
 * `write_req`/`proceed_req`, came in 2.3), and its only limit, max_request_entity_size, is one
 * number for every route. The gate fills that gap: for HTTP/1 connections it sits in front of
 * h2o's read callback on each socket it is attached to, parses every request head as it comes
 * (h2o parses the same bytes after it), and asks a policy what the request may send. A request
 * the policy refuses never reaches h2o as sent: its head is replaced by a bodyless
 * `GET / HTTP/1.0` (so h2o closes the connection after answering), the body bytes already read
 * are dropped, and the handler answers with the refusal (sp_bodygate_refusal). A chunked body
 * is counted as it arrives and stopped past the policy's cap (h2o's own 413 then, as the head
 * was already handed over).
 *
 * HTTP/2 connections (prior knowledge, and TLS with ALPN h2) are gated too, between h2o's reads:
 * the gate walks each read's frames before h2o does and vets a stream at its first DATA frame, or
 * at the end of the read its head came in, once h2o has decoded its head (the stream h2o made is
 * read through <h2o/http2_internal.h>, h2o 2.2.5's own layout). A refused stream, or one whose
 * DATA passes its cap, is ended there for h2o (the frame becomes empty trailers) and answered by
 * the handler with the refusal; what its client sends on is dropped (DATA given back to the
 * connection's flow-control window, trailers, in one frame or several, decoded into h2o's HPACK
 * table first). An HTTP/1 `Upgrade: h2c` is not taken (the field is renamed before h2o reads it).
 * TLS connections are attached after the handshake (sp_bodygate_accept does it). HTTP/1 keeps its
 * place across keep-alive requests because h2o re-installs its own read callback after every
 * response: the handler calls sp_bodygate_request for each request, which puts the gate back once
 * h2o is done with it, and vets any pipelined request already read before h2o does.
 *
 * Owns nothing of h2o's: per-socket state lives until the socket closes (its on_close hook,
 * which h2o's HTTP/1 and HTTP/2 servers leave unused). Knows no route: the policy does.
 */
#ifndef SP_BODYGATE_H
#define SP_BODYGATE_H

#include <h2o.h>
#include <stdbool.h>
#include <stdint.h>

#include "base/err.h"
#include "loop/loop.h"

typedef struct sp_bodygate sp_bodygate_t;

/* One header field as picohttpparser gives it (the layout of its struct phr_header). */
typedef struct {
    const char *name;
    size_t name_len;
    const char *value;
    size_t value_len;
} sp_bodygate_field_t;

/* What h2o 2.2.5 takes from a head at most (H2O_MAX_HEADERS): more is its 400. */
#define SP_BODYGATE_MAX_FIELDS 100

/* A request head as the gate read it, which is as h2o reads it: the same parser
 * (picohttpparser's phr_parse_request, which libh2o exports) on the same bytes, and h2o's
 * choices among repeated fields (lib/http1.c's init_headers). Strings are not NUL-terminated
 * and live only during the policy call. */
typedef struct {
    const char *method, *path, *host; /* path with its query; host "" when absent */
    size_t method_len, path_len, host_len; /* host: the last Host field, as h2o takes */
    bool chunked;    /* Transfer-Encoding present (h2o accepts only `chunked`) */
    uint64_t length; /* Content-Length (the first; 0 when absent or chunked) */
    sp_bodygate_field_t fields[SP_BODYGATE_MAX_FIELDS]; /* for sp_bodygate_header */
    size_t nfields;
} sp_bodygate_head_t;

/* What the policy decides. */
typedef struct {
    bool refuse;          /* answer err at once, before the body */
    bool e2b;             /* the refusal in the E2B shape ({code, message}) */
    bool large;           /* counts against the bound on concurrent large bodies */
    uint64_t chunked_cap; /* a chunked body past this many bytes is stopped (0: no cap) */
    bool stream; /* the handler reads the body itself, as it comes (sp_bodygate_streamed) */
    sp_err_t err;
} sp_bodygate_verdict_t;

typedef void (*sp_bodygate_policy_cb)(void *arg, const sp_bodygate_head_t *h,
                                      sp_bodygate_verdict_t *v);

/* max_large: requests counted `large` at once, server-wide; one more is refused with 503
 * (in the shape the policy chose) before its body is read. NULL on allocation failure. */
sp_bodygate_t *sp_bodygate_create(sp_loop_t *loop, sp_bodygate_policy_cb policy, void *arg,
                                  unsigned max_large);
/* Detaches from every socket still open (they go on without a gate). NULL does nothing. */
void sp_bodygate_destroy(sp_bodygate_t *g);

/* Attaches to a socket h2o has just accepted as HTTP/1 (plain: right after h2o_accept); fd is
 * the socket's (still h2o's), dup'ed after a refusal to drain the rest of the body once h2o
 * has answered and closed (a client that sends the whole body first then reads the answer
 * rather than a reset). One that starts with HTTP/2's preface is followed into HTTP/2. */
void sp_bodygate_attach(sp_bodygate_t *g, h2o_socket_t *sock, int fd);
/* h2o_accept for a TLS connection (fd as above), with the gate attached once ALPN chose
 * HTTP/1.1 or HTTP/2. */
void sp_bodygate_accept(sp_bodygate_t *g, h2o_accept_ctx_t *ctx, h2o_socket_t *sock, int fd);

/* For every request the handler gets, first: true when the gate refused it (*v is the
 * refusal to send, as is); else notes the request so the gate takes its place again after
 * it (HTTP/1). Requests on sockets without a gate are false. */
bool sp_bodygate_request(sp_bodygate_t *g, h2o_req_t *req, sp_bodygate_verdict_t *v);

/*
 * Streamed bodies. A request the policy marks `stream`, on an HTTP/1 connection (plain, or TLS
 * without `Expect: 100-continue`), reaches its handler with its head alone: its Content-Length
 * and Transfer-Encoding fields are renamed in place before h2o reads the head (to
 * SP_BODYGATE_GATED_PREFIX..., which a forwarder drops), so h2o reads no body and calls the
 * handler at once; the body stays on the connection for the handler to read, piece by piece, as
 * the client sends it and no faster than the handler takes it (sp_bodygate_body_read). Such a
 * connection serves no further request (`Connection: close` on its answer), and what the client
 * still sends after the answer is read and dropped (as after a refusal). On HTTP/2 the stream
 * is ended for h2o at its head (h2o sees a request without a body) and its DATA kept by the
 * gate for the handler, the stream's flow-control window given back only as the handler takes
 * the bytes (so at most that window, h2o's 16 MiB, is held per stream); the connection goes on
 * serving other streams, and DATA sent after the answer is dropped. A `stream` verdict on TLS
 * with `Expect: 100-continue`, or on a body past h2o's own limit, is read whole by h2o as any
 * other.
 */
#define SP_BODYGATE_GATED_PREFIX "x-sp-gated-"

/* True when req's body was left on its connection (framing in *length, *chunked: a chunked
 * body's size is unknown, *length 0). False for every other request, and once collected. */
bool sp_bodygate_streamed(h2o_req_t *req, uint64_t *length, bool *chunked);

/* One piece of a streamed body: data[0, len) (decoded when chunked; valid until the next read
 * or the end of the request), end when it is the last (len may then be 0); or err when the body
 * cannot be had (the client closed early, bad chunked coding, past the chunked cap): no read
 * follows either. */
typedef void (*sp_bodygate_body_cb)(void *arg, const char *data, size_t len, bool end,
                                    const sp_err_t *err);
/* Asks for the next piece: cb runs once, later (never inside this call). A client that sent
 * `Expect: 100-continue` is told to go on at the first read. -1 (nothing called) when req is not
 * streamed, its body ended, or a read is pending. */
int sp_bodygate_body_read(h2o_req_t *req, sp_bodygate_body_cb cb, void *arg);
/* Drops a pending read (the reader is going): its cb never runs. Nothing when none. */
void sp_bodygate_body_cancel(h2o_req_t *req);
/* Reads the rest of a streamed body into req->entity, as h2o would have (in a buffer that
 * spills to a mapped temporary file past 32 MiB, h2o's), then calls done: req is an ordinary
 * request from then on (err NULL), or its body could not be had (err, to answer with; also on
 * a client silent for h2o's request timeout). done is not called when req goes first. */
typedef void (*sp_bodygate_collected_cb)(void *arg, h2o_req_t *req, const sp_err_t *err);
void sp_bodygate_body_collect(h2o_req_t *req, sp_bodygate_collected_cb done, void *arg);

/* The first header of that name in h (case-insensitive), as h2o_find_header finds it: its
 * value, or NULL; *len its length. */
const char *sp_bodygate_header(const sp_bodygate_head_t *h, const char *name, size_t *len);
/* Requests counted large right now (for tests and metrics). */
unsigned sp_bodygate_large_now(const sp_bodygate_t *g);

/* The head parser alone, for tests: 1 with *h filled when buf holds a whole head (*head_len
 * its bytes), 0 when more bytes are needed, -1 when it is not a head the gate understands
 * (nothing h2o would read differently: h2o refuses it, or, for a folded field line, which h2o
 * 2.2.5 keeps as a field without a name, the gate fails closed). Reads at most
 * H2O_MAX_REQLEN bytes, as h2o does: a head that is not whole within them is -1. */
int sp_bodygate_parse(const char *buf, size_t len, sp_bodygate_head_t *h, size_t *head_len);

#endif
