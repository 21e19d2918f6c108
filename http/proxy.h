/*
 * proxy.h - forwards a request to another spaced node (the worker that owns a sandbox) and
 * answers the client with that node's reply, streamed both ways; and the cluster key that
 * proves a forwarded request came from a node of the same installation.
 *
 * Why our own forwarder and not h2o's: h2o 2.2's proxy handler reads the upstream's response
 * as fast as it arrives and spools what the client has not taken into a temporary file, so a
 * 100 MiB download through a slow client costs 100 MiB of disk and page cache here. This one
 * reads the upstream only while the client takes the bytes (at most 1 MiB ahead of it).
 *
 * The request body: an upload the body gate left on the client's connection
 * (sp_bodygate_streamed, http/bodygate.h) goes up as it comes, one piece at a time, the next
 * asked for once the last is written (so the client is read no faster than the upstream
 * takes it), chunked when the client's was; it stops when the upstream's answer begins. Any
 * other body h2o has read whole before on_req; the forwarder writes it from there, without a
 * copy.
 *
 * What the upstream gets: the request line and headers as the client sent them (its
 * Authorization, X-Access-Token and Host pass as they are: the worker authenticates the
 * request itself), minus the hop-by-hop headers (RFC 9110 7.6.1: Connection and the fields
 * it names, Keep-Alive, Proxy-Connection, TE, Trailer, Transfer-Encoding, Upgrade), with
 * Content-Length for the entity, X-Forwarded-For / Forwarded / X-Forwarded-Proto appended,
 * `Connection: close` (one connection per request; an Upgrade keeps its Upgrade), and the
 * cluster header (SP_PROXY_AUTH_HEADER). The reply's hop-by-hop headers are dropped the same
 * way; its body goes out chunked or with its length as h2o frames it for the client, and an
 * upstream that dies mid-body cuts the client's response (no terminating chunk; the
 * connection closed before Content-Length), never a clean end. A 101 to an HTTP/1.1 Upgrade
 * (WebSocket) turns both connections into a byte pipe (h2o's tunnel: each side is read only
 * once the other took the last bytes).
 *
 * The cluster header, `Space-Cluster-Auth: v1 <unix-s> <nonce-hex> <hmac-hex>`, is
 * HMAC-SHA256 with the cluster key over the method, the authority, the path with its query,
 * the time and a random nonce. Chosen over sending the key itself because nodes talk plain
 * HTTP to each other (TLS between them is optional) and the key must never be on the wire; a
 * header copied from one request does not fit another (method, host and path are bound), is
 * refused 30 s after it was made, and is refused when seen again within that window (a
 * nonce cache). The body is not covered (it streams); the header grants nothing a client
 * lacks anyway: the request still carries the client's own credentials, which the worker
 * checks. It only says "a node sent this: do not forward it again".
 */
#ifndef SP_HTTP_PROXY_H
#define SP_HTTP_PROXY_H

#include <h2o.h>
#include <stddef.h>
#include <stdint.h>

#include "base/err.h"
#include "loop/loop.h"

#define SP_PROXY_AUTH_HEADER "space-cluster-auth"
#define SP_PROXY_KEY_MIN 32  /* bytes */
#define SP_PROXY_KEY_MAX 256 /* bytes */
#define SP_PROXY_SKEW_S 30   /* how old (or how far ahead) a cluster header may be */

typedef struct sp_proxy sp_proxy_t;

typedef struct {
    const unsigned char *key; /* the cluster key (copied); NULL: forwarding is refused */
    size_t key_len;
    uint32_t connect_timeout_ms; /* 0: 5 s */
    uint32_t idle_timeout_ms;    /* no byte either way for this long ends it; 0: 610 s */
} sp_proxy_opts_t;

sp_proxy_t *sp_proxy_create(sp_loop_t *loop, const sp_proxy_opts_t *o, sp_err_t *err);
void sp_proxy_destroy(sp_proxy_t *p);

/* Whether a cluster key is set (without one nothing is forwarded nor accepted). */
bool sp_proxy_has_key(const sp_proxy_t *p);

/* Forwards req to upstream ("host:port"; a name is resolved off the loop) and answers req
 * with its reply. sandbox_id names the sandbox in error replies ("" for a request that is
 * not a sandbox's, such as a template build's): 502 with a JSON error when
 * the upstream cannot be reached or sends no valid reply, 504 when it does not answer in
 * time, 503 when no cluster key is set. */
void sp_proxy_forward(sp_proxy_t *p, h2o_req_t *req, const char *upstream, const char *sandbox_id);

/* The forwarder's error answer (before anything was sent), readable by both surfaces' clients:
 * {"error":{"code","message"}} as the native API, top-level message and code as E2B. */
void sp_proxy_error(h2o_req_t *req, int status, const char *sandbox_id, const char *msg);

/*
 * A GET to another node on a client's behalf, its whole answer kept: for an answer a node
 * assembles from several workers' figures (E2B's many-sandbox metrics, the disk size of a
 * sandbox whose row lacks it), where forwarding the client's request whole would not do. The
 * head is req's (its credentials pass as they are: the peer authenticates them, and scopes the
 * answer by them) with GET, path (query included) and the cluster header, as sp_proxy_forward
 * writes it; the peer sees a forwarded request and answers from its own memory without asking
 * further.
 * timeout_ms bounds the whole exchange (name, connect, answer). cb runs exactly once, never
 * inside this call: status and body (borrowed for the call) of any complete answer, or status
 * 0 and why (client-safe, names the worker) when there was none in time, or it was larger than
 * SP_PROXY_GET_MAX. NULL with err, and no callback, when it cannot start (no cluster key: 503;
 * a head that cannot be sent). req is only read during this call.
 */
#define SP_PROXY_GET_MAX (4u << 20) /* bytes of body an answer may have */

typedef struct sp_proxy_get sp_proxy_get_t;
typedef void (*sp_proxy_got_cb)(void *arg, int status, const char *body, size_t len,
                                const char *why);

sp_proxy_get_t *sp_proxy_get(sp_proxy_t *p, h2o_req_t *req, const char *upstream, const char *path,
                             uint32_t timeout_ms, sp_proxy_got_cb cb, void *arg, sp_err_t *err);
/* Abandons g without its callback. NULL does nothing. */
void sp_proxy_get_cancel(sp_proxy_get_t *g);

typedef enum {
    SP_PROXY_DIRECT = 0, /* no cluster header: a client's own request */
    SP_PROXY_FORWARDED,  /* a valid cluster header: a node forwarded it */
    SP_PROXY_FORGED,     /* a cluster header that does not verify (or no key here) */
} sp_proxy_origin_t;

/* Reads and removes the cluster header(s) from req, so nothing after this sees one. */
sp_proxy_origin_t sp_proxy_check(sp_proxy_t *p, h2o_req_t *req);

/* Reads a cluster key file: at least SP_PROXY_KEY_MIN bytes (a trailing newline is not part
 * of the key), refused when the group or others may read it. */
int sp_proxy_read_key(const char *path, unsigned char *out, size_t *len, sp_err_t *err);

#endif
