/*
 * bodygate.c - every HTTP/1 request head vetted before h2o reads the body (http/bodygate.h).
 *
 * Owns a small state per gated socket (struct gs, found through the socket's on_close hook)
 * and the count of large bodies in flight. It touches three things of h2o's beyond its API,
 * all public fields of h2o 2.2.5's headers: the socket's read callback (`_cb.read`, which it
 * wraps), its input buffer (where a refused head is replaced), and, to stop a chunked body
 * past its cap, the connection's global max_request_entity_size for the length of one call
 * (h2o compares against it on every read of a chunked body; the loop is single-threaded).
 */
#include "http/bodygate.h"

#include <errno.h>
#include <fcntl.h>
#include <h2o/http1.h>
#include <h2o/http2.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/socket.h>
#include <unistd.h>

#include "base/log.h"

/* What h2o parses a refused request as: HTTP/1.0 without keep-alive, so h2o closes the
 * connection after the handler's answer, and no body. */
#define REFUSED_HEAD "GET / HTTP/1.0\r\n\r\n"
#define REFUSED_HEAD_LEN (sizeof(REFUSED_HEAD) - 1)
/* After a refusal, the body the client still sends is read and dropped (up to this much, for
 * this long) so that a client that sends it all before reading gets the answer, not a reset
 * (h2o 2.2.5 closes without draining). */
#define DRAIN_MAX_BYTES ((uint64_t)256 << 20)
#define DRAIN_MAX_MS 10000
/* h2o's own limit on a request head: what it parses of a longer one is its 413. */
#define MAX_HEAD H2O_MAX_REQLEN

enum gs_state {
    GS_IDLE,   /* the next bytes are a request head */
    GS_BODY,   /* a head was handed on; h2o reads its body through us */
    GS_HANDED, /* the handler has the request; reads resume once h2o is done with it */
};

struct gs {
    sp_bodygate_t *g;
    h2o_socket_t *sock; /* NULL once closed */
    h2o_socket_cb orig; /* h2o's read callback */
    enum gs_state state;
    size_t head_len; /* the current request's head, from the start of the input */
    uint64_t length; /* its Content-Length */
    bool chunked;
    uint64_t chunked_cap;
    bool large;   /* counted in g->large_now */
    bool refused; /* the current request is a refusal; verdict is what to send */
    sp_bodygate_verdict_t verdict;
    unsigned holds;      /* live request hooks and deferred rearms: free only at 0 */
    int fd;              /* the socket's fd (h2o's: never closed here) */
    int drain_fd;        /* a refusal: a dup of fd, drained once h2o closes (-1: none) */
    uint64_t drain_left; /* body bytes the refused request still has to send */
    bool in_read;
    bool unreadable; /* the next head is one the gate cannot read: close */
    struct gs *prev, *next;
};

struct sp_bodygate {
    sp_loop_t *loop;
    sp_bodygate_policy_cb policy;
    void *arg;
    unsigned max_large, large_now;
    struct gs *head;
};

static void gs_on_close(void *data);

/* ---- the head parser ---- */

/* picohttpparser, which libh2o carries, exports and parses every HTTP/1 head with, but Debian
 * installs no header for (http/proxy.c declares its response parser the same way). Its
 * struct phr_header is sp_bodygate_field_t. */
int phr_parse_request(const char *buf, size_t len, const char **method, size_t *method_len,
                      const char **path, size_t *path_len, int *minor_version,
                      sp_bodygate_field_t *headers, size_t *num_headers, size_t last_len);

static bool name_is(const char *n, size_t len, const char *want)
{
    return strlen(want) == len && strncasecmp(n, want, len) == 0;
}

/* Content-Length as h2o_strtosize reads it: 1 to 19 digits, nothing else. */
static int content_length(const char *v, size_t n, uint64_t *out)
{
    uint64_t x = 0;
    if (n == 0 || n > 19)
        return -1;
    for (size_t i = 0; i < n; i++) {
        if (v[i] < '0' || v[i] > '9')
            return -1;
        x = x * 10 + (uint64_t)(v[i] - '0');
    }
    if (x >= SIZE_MAX)
        return -1;
    *out = x;
    return 0;
}

int sp_bodygate_parse(const char *buf, size_t len, sp_bodygate_head_t *h, size_t *head_len)
{
    memset(h, 0, sizeof(*h));
    h->host = "";
    /* h2o parses at most H2O_MAX_REQLEN bytes of a head (lib/http1.c), with this parser and
     * this many fields. */
    size_t n = len < MAX_HEAD ? len : MAX_HEAD;
    int minor;
    h->nfields = SP_BODYGATE_MAX_FIELDS;
    int r = phr_parse_request(buf, n, &h->method, &h->method_len, &h->path, &h->path_len, &minor,
                              h->fields, &h->nfields, 0);
    if (r == -2)
        return len >= MAX_HEAD ? -1 : 0;
    if (r < 0)
        return -1;
    bool have_len = false;
    for (size_t i = 0; i < h->nfields; i++) {
        const sp_bodygate_field_t *f = &h->fields[i];
        if (f->name == NULL || f->name_len == 0)
            return -1; /* a folded line: h2o 2.2.5 keeps it as a field without a name; the
                        * gate fails closed rather than guess what an upstream makes of it */
        if (name_is(f->name, f->name_len, "transfer-encoding")) {
            h->chunked = true; /* h2o: any Transfer-Encoding wins; not `chunked` is its 400 */
        } else if (name_is(f->name, f->name_len, "content-length") && !have_len) {
            /* h2o reads the first one; one it cannot read is its 400 */
            if (content_length(f->value, f->value_len, &h->length) < 0)
                return -1;
            have_len = true;
        } else if (name_is(f->name, f->name_len, "host")) {
            h->host = f->value; /* h2o keeps the last one as the authority */
            h->host_len = f->value_len;
        }
    }
    if (h->chunked)
        h->length = 0;
    *head_len = (size_t)r;
    return 1;
}

const char *sp_bodygate_header(const sp_bodygate_head_t *h, const char *name, size_t *len)
{
    for (size_t i = 0; i < h->nfields; i++) {
        const sp_bodygate_field_t *f = &h->fields[i];
        if (f->name != NULL && name_is(f->name, f->name_len, name)) {
            *len = f->value_len;
            return f->value;
        }
    }
    return NULL;
}

/* ---- per socket ---- */

static void gs_free_if_done(struct gs *st)
{
    if (st->sock != NULL || st->holds > 0 || st->in_read)
        return;
    if (st->g != NULL) {
        if (st->prev)
            st->prev->next = st->next;
        else
            st->g->head = st->next;
        if (st->next)
            st->next->prev = st->prev;
    }
    free(st);
}

static void release_large(struct gs *st)
{
    if (st->large && st->g != NULL) {
        st->g->large_now--;
        st->large = false;
    }
}

struct drain {
    int fd;
    uint64_t left;
    sp_watch_t *w;
    sp_timer_t timer;
};

static void drain_end(struct drain *d)
{
    sp_watch_destroy(d->w);
    sp_timer_stop(&d->timer);
    close(d->fd);
    free(d);
}

static void on_drain_io(sp_watch_t *w, int events, void *arg)
{
    struct drain *d = arg;
    char buf[16384];
    for (int i = 0; i < 64; i++) {
        ssize_t n = recv(d->fd, buf, sizeof(buf), MSG_DONTWAIT);
        if (n > 0 && (uint64_t)n < d->left) {
            d->left -= (uint64_t)n;
            continue;
        }
        if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR))
            return;
        drain_end(d); /* the end, an error, or all it may send */
        return;
    }
}

static void on_drain_timeout(sp_timer_t *t, void *arg)
{
    drain_end(arg);
}

/* h2o closed the socket after the refusal: the answer is sent; end it with a FIN (the dup
 * keeps the connection open) and drop what the client still sends. */
static void drain_start(sp_loop_t *loop, int fd, uint64_t left)
{
    shutdown(fd, SHUT_WR);
    struct drain *d = calloc(1, sizeof(*d));
    if (d == NULL || left == 0) {
        free(d);
        close(fd);
        return;
    }
    d->fd = fd;
    d->left = left < DRAIN_MAX_BYTES ? left : DRAIN_MAX_BYTES;
    d->w = sp_watch_create(loop, fd, on_drain_io, d);
    if (d->w == NULL) {
        free(d);
        close(fd);
        return;
    }
    sp_timer_init(&d->timer, loop, on_drain_timeout, d);
    sp_timer_start(&d->timer, DRAIN_MAX_MS);
    sp_watch_set(d->w, SP_IO_READ);
}

static void gs_on_close(void *data)
{
    struct gs *st = data;
    if (st->drain_fd >= 0) {
        if (st->g != NULL)
            drain_start(st->g->loop, st->drain_fd, st->drain_left);
        else
            close(st->drain_fd);
        st->drain_fd = -1;
    }
    st->sock = NULL;
    release_large(st);
    gs_free_if_done(st);
}

/*
 * Vets the head at input offset off (0 between requests; the end of the current request for
 * one pipelined behind it). Sets the state for it and, when refused, replaces it in the input.
 */
static void vet(struct gs *st, size_t off)
{
    h2o_buffer_t *in = st->sock->input;
    sp_bodygate_head_t h;
    size_t hl;
    int r = sp_bodygate_parse(in->bytes + off, in->size - off, &h, &hl);
    if (r == 0)
        return; /* more bytes: state stays GS_IDLE */
    if (r < 0) {
        /* A head the gate cannot read could still be one h2o reads (folded lines, say):
         * nothing passes unvetted, so the connection ends here. The HTTP/2 preface is h2o's. */
        static const char pri[] = "PRI * HTTP/2";
        if (off == 0 && in->size >= sizeof(pri) - 1 && memcmp(in->bytes, pri, sizeof(pri) - 1) == 0)
            st->state = GS_HANDED; /* h2o takes the socket as HTTP/2 */
        else
            st->unreadable = true;
        return;
    }
    sp_bodygate_t *g = st->g;
    sp_bodygate_verdict_t v = {0};
    g->policy(g->arg, &h, &v);
    if (!v.refuse && v.large && g->large_now >= g->max_large) {
        v.refuse = true;
        sp_err_set(&v.err, SP_EUNAVAIL, "too many large request bodies at once (%u): retry later",
                   g->max_large);
    }
    st->head_len = hl;
    st->length = h.chunked ? 0 : h.length;
    st->chunked = h.chunked;
    st->chunked_cap = v.chunked_cap;
    st->state = h.chunked || h.length > 0 ? GS_BODY : GS_HANDED;
    if (v.refuse && hl >= REFUSED_HEAD_LEN) {
        /* In place: the buffer holds at least the head's bytes. The body bytes already
         * read are dropped with the rest; h2o answers the bodyless request and closes. */
        uint64_t got = in->size - off - hl;
        memcpy(in->bytes + off, REFUSED_HEAD, REFUSED_HEAD_LEN);
        in->size = off + REFUSED_HEAD_LEN;
        if (st->fd >= 0 && st->drain_fd < 0) {
            st->drain_fd = fcntl(st->fd, F_DUPFD_CLOEXEC, 0);
            st->drain_left = h.chunked ? DRAIN_MAX_BYTES : h.length > got ? h.length - got : 0;
        }
        st->refused = true;
        st->verdict = v;
        st->head_len = REFUSED_HEAD_LEN;
        st->length = 0;
        st->chunked = false;
        st->state = GS_HANDED;
        return;
    }
    if (v.large) {
        g->large_now++;
        st->large = true;
    }
}

static void gate_on_read(h2o_socket_t *sock, const char *err)
{
    struct gs *st = sock->on_close.data;
    st->in_read = true;
    if (err == NULL && st->g != NULL) {
        if (st->state == GS_IDLE) {
            vet(st, 0);
            if (st->unreadable)
                err = "request head the body gate cannot read";
        } else if (st->state == GS_BODY && st->chunked && st->chunked_cap > 0 &&
                   sock->input->size - st->head_len > st->chunked_cap) {
            /* h2o stops the body itself (413, connection closed) when it sees its limit
             * passed; the limit is made 0 for this one call. */
            h2o_globalconf_t *gc = ((h2o_conn_t *)sock->data)->ctx->globalconf;
            size_t keep = gc->max_request_entity_size;
            gc->max_request_entity_size = 0;
            st->orig(sock, NULL);
            gc->max_request_entity_size = keep;
            goto out;
        }
    }
    st->orig(sock, err);
out:
    st->in_read = false;
    gs_free_if_done(st);
}

void sp_bodygate_attach(sp_bodygate_t *g, h2o_socket_t *sock, int fd)
{
    /* HTTP/2 (prior knowledge) or a socket someone else watches: not ours. */
    if (sock->_cb.read == NULL || sock->on_close.cb != NULL)
        return;
    struct gs *st = calloc(1, sizeof(*st));
    if (st == NULL)
        return; /* fails open: h2o's global limit still holds */
    st->g = g;
    st->sock = sock;
    st->orig = sock->_cb.read;
    st->state = GS_IDLE;
    st->fd = fd;
    st->drain_fd = -1;
    st->next = g->head;
    if (g->head)
        g->head->prev = st;
    g->head = st;
    sock->on_close.cb = gs_on_close;
    sock->on_close.data = st;
    sock->_cb.read = gate_on_read;
}

/* ---- after each request ---- */

static void rearm(void *arg)
{
    struct gs *st = arg;
    st->holds--;
    /* h2o reads the next request with its own callback again: put the gate before it. NULL:
     * h2o is busy with a pipelined request, whose end rearms again. */
    if (st->sock != NULL && st->g != NULL && st->sock->_cb.read == st->orig)
        st->sock->_cb.read = gate_on_read;
    gs_free_if_done(st);
}

/* Runs when the request's pool goes: h2o is done with it, and (keep-alive) is about to
 * consume its bytes and take the next request, with its own read callback. */
static void on_req_disposed(void *p)
{
    struct gs *st = *(struct gs **)p;
    release_large(st);
    if (st->sock != NULL && st->g != NULL) {
        /* A request already read behind this one is parsed by h2o before the gate is back:
         * vet it now, where it starts (a chunked request closes its connection instead). */
        size_t end = st->head_len + st->length;
        st->state = GS_IDLE;
        if (st->sock->input->size > end)
            vet(st, end);
        if (st->unreadable) /* h2o would read it before the gate is back */
            st->sock->input->size = end;
        if (sp_loop_defer(st->g->loop, rearm, st) == 0) {
            st->holds++;
        } else {
            sp_log(SP_LOG_WARN, "http", "body gate: no memory to rearm; connection closes");
            h2o_socket_read_stop(st->sock);
        }
    }
    st->holds--;
    gs_free_if_done(st);
}

bool sp_bodygate_request(sp_bodygate_t *g, h2o_req_t *req, sp_bodygate_verdict_t *v)
{
    if (g == NULL || req->version >= 0x200 || req->conn->callbacks->get_socket == NULL)
        return false;
    h2o_socket_t *sock = req->conn->callbacks->get_socket(req->conn);
    if (sock == NULL || sock->on_close.cb != gs_on_close)
        return false;
    struct gs *st = sock->on_close.data;
    if (st->refused) {
        st->refused = false;
        *v = st->verdict;
        return true;
    }
    st->state = GS_HANDED;
    struct gs **hook = h2o_mem_alloc_shared(&req->pool, sizeof(*hook), on_req_disposed);
    *hook = st;
    st->holds++;
    /* Where a chunked body ends in h2o's buffer (decoded in place) is h2o's to know: no
     * request may follow one on the same connection, so none can pass the gate unseen. */
    if (st->chunked)
        req->http1_is_persistent = 0;
    return false;
}

/* ---- TLS ---- */

struct tls_accept {
    sp_bodygate_t *g;
    int fd;
    h2o_accept_ctx_t *ctx;
    h2o_socket_t *sock;
    struct timeval connected_at;
    sp_timer_t timer;
};

static void on_tls_timeout(sp_timer_t *t, void *arg)
{
    struct tls_accept *a = arg;
    h2o_socket_t *sock = a->sock;
    free(a);
    h2o_socket_close(sock);
}

static void on_tls_handshake(h2o_socket_t *sock, const char *err)
{
    struct tls_accept *a = sock->data;
    sock->data = NULL;
    sp_timer_stop(&a->timer);
    sp_bodygate_t *g = a->g;
    int fd = a->fd;
    h2o_accept_ctx_t *ctx = a->ctx;
    struct timeval at = a->connected_at;
    free(a);
    if (err != NULL) {
        h2o_socket_close(sock);
        return;
    }
    /* As h2o_accept: HTTP/2 when ALPN chose it, else HTTP/1.1 (gated). */
    h2o_iovec_t proto = h2o_socket_ssl_get_selected_protocol(sock);
    for (const h2o_iovec_t *id = h2o_http2_alpn_protocols; id->len != 0; ++id) {
        if (proto.len == id->len && memcmp(proto.base, id->base, proto.len) == 0) {
            h2o_http2_accept(ctx, sock, at);
            return;
        }
    }
    h2o_http1_accept(ctx, sock, at);
    if (g != NULL)
        sp_bodygate_attach(g, sock, fd);
}

void sp_bodygate_accept(sp_bodygate_t *g, h2o_accept_ctx_t *ctx, h2o_socket_t *sock, int fd)
{
    struct tls_accept *a = calloc(1, sizeof(*a));
    if (a == NULL || ctx->ssl_ctx == NULL || ctx->expect_proxy_line) {
        free(a);
        h2o_accept(ctx, sock); /* as ever, ungated */
        return;
    }
    a->g = g;
    a->fd = fd;
    a->ctx = ctx;
    a->sock = sock;
    a->connected_at = *h2o_get_timestamp(ctx->ctx, NULL, NULL);
    sp_timer_init(&a->timer, g->loop, on_tls_timeout, a);
    sp_timer_start(&a->timer, ctx->ctx->globalconf->handshake_timeout);
    sock->data = a;
    h2o_socket_ssl_handshake(sock, ctx->ssl_ctx, NULL, on_tls_handshake);
}

/* ---- the gate ---- */

sp_bodygate_t *sp_bodygate_create(sp_loop_t *loop, sp_bodygate_policy_cb policy, void *arg,
                                  unsigned max_large)
{
    sp_bodygate_t *g = calloc(1, sizeof(*g));
    if (g == NULL)
        return NULL;
    g->loop = loop;
    g->policy = policy;
    g->arg = arg;
    g->max_large = max_large;
    return g;
}

void sp_bodygate_destroy(sp_bodygate_t *g)
{
    if (g == NULL)
        return;
    /* Sockets still open keep reading through their state, which now passes everything on. */
    struct gs *next;
    for (struct gs *st = g->head; st != NULL; st = next) {
        next = st->next;
        st->g = NULL;
        st->large = false;
        if (st->sock != NULL) {
            if (st->sock->_cb.read == gate_on_read)
                st->sock->_cb.read = st->orig;
            st->sock->on_close.cb = NULL;
            st->sock->on_close.data = NULL;
            st->sock = NULL;
        }
        if (st->drain_fd >= 0) {
            close(st->drain_fd);
            st->drain_fd = -1;
        }
        gs_free_if_done(st);
    }
    free(g);
}

unsigned sp_bodygate_large_now(const sp_bodygate_t *g)
{
    return g->large_now;
}
