/*
 * bodygate.c - every request head vetted before h2o reads the body (http/bodygate.h).
 *
 * Owns a small state per gated socket (struct gs, found through the socket's on_close hook)
 * and the count of large bodies in flight. It touches things of h2o's beyond its API: the
 * socket's read callback (`_cb.read`, which it wraps), its input buffer (where a refused
 * HTTP/1 head is replaced, HTTP/2 frames rewritten or dropped, and a read cut short so that
 * h2o reads part of it first), and, to stop a chunked body past its cap, the connection's
 * global max_request_entity_size for the length of one call (h2o compares against it on every
 * read of a chunked body; the loop is single-threaded). For a streamed body it renames the
 * head's framing fields in the input, moves the body bytes h2o read past the head out of it
 * (the head stays where h2o's request points into it), and reads the rest from a dup of the
 * socket's fd while h2o does not read the socket. HTTP/2 is bodygate_h2.c's: it reads h2o's
 * connection and streams (<h2o/http2_internal.h>: the stream table, a stream's state, decoded
 * head and expected length) and writes frames into the connection's output buffer; a streamed
 * body's DATA is queued there (struct h2s) and handed out from it, through the same reads as
 * HTTP/1's (sp_bodygate_body_read). What the two share is in bodygate_int.h.
 */
#include "http/bodygate_int.h"

#include <errno.h>
#include <fcntl.h>
#include <h2o/http1.h>
#include <h2o/http2.h>
#include <h2o/http2_internal.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/socket.h>
#include <unistd.h>

#include "base/chunked.h"
#include "base/log.h"
#include "base/metrics.h"

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
/* What a Content-Length and a Transfer-Encoding field are renamed to (same lengths), so that
 * h2o reads a streamed request's head as one without a body. */
#define GATED_LENGTH SP_BODYGATE_GATED_PREFIX "len"    /* 14: content-length */
#define GATED_CODING SP_BODYGATE_GATED_PREFIX "coding" /* 17: transfer-encoding */

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

static void body_end(struct gs *st);
static void held_free(struct gs *st);

void sp_bodygate__gs_free_if_done(struct gs *st)
{
    if (st->sock != NULL || st->holds > 0 || st->in_read)
        return;
    body_end(st);
    held_free(st);
    if (st->g != NULL) {
        if (st->prev)
            st->prev->next = st->next;
        else
            st->g->head = st->next;
        if (st->next)
            st->next->prev = st->prev;
    }
    sp_bodygate__h2s_free_all(st);
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

static void held_free(struct gs *st)
{
    if (st->held != NULL)
        h2o_buffer_dispose(&st->held);
    st->held = NULL;
}

void sp_bodygate__gs_on_close(void *data)
{
    struct gs *st = data;
    held_free(st); /* h2o is done with the request */
    if (st->drain_fd >= 0) {
        if (st->g != NULL)
            drain_start(st->g->loop, st->drain_fd, st->drain_left);
        else
            close(st->drain_fd);
        st->drain_fd = -1;
    }
    st->sock = NULL;
    release_large(st);
    sp_bodygate__gs_free_if_done(st);
}

/* The policy's verdict on a head, with the server-wide bound on large bodies applied. */
void sp_bodygate__ask(sp_bodygate_t *g, const sp_bodygate_head_t *h, sp_bodygate_verdict_t *v)
{
    memset(v, 0, sizeof(*v));
    g->policy(g->arg, h, v);
    if (!v->refuse && v->large && g->large_now >= g->max_large) {
        v->refuse = true;
        sp_err_set(&v->err, SP_EUNAVAIL, "too many large request bodies at once (%u): retry later",
                   g->max_large);
    }
}

/*
 * A head whose body the handler streams (sp_bodygate_streamed): its framing fields renamed in
 * place, so that h2o reads it as a request without a body and hands it over at once. Within
 * h2o's own limit (past it, h2o's 413 as ever). On a plain socket the body is read from a dup
 * of it, beside h2o; on a TLS one through h2o's socket (which decrypts), into an input buffer
 * of its own (body_begin).
 */
static void stream_head(struct gs *st, sp_bodygate_head_t *h, uint64_t chunked_cap)
{
    _Static_assert(sizeof(GATED_LENGTH) == sizeof("content-length"), "same length");
    _Static_assert(sizeof(GATED_CODING) == sizeof("transfer-encoding"), "same length");
    h2o_globalconf_t *gc = ((h2o_conn_t *)st->sock->data)->ctx->globalconf;
    if (st->fd < 0 || h->length > gc->max_request_entity_size)
        return;
    bool expect = false;
    for (size_t i = 0; i < h->nfields; i++) {
        const sp_bodygate_field_t *f = &h->fields[i];
        if (name_is(f->name, f->name_len, "expect") && f->value_len == 12 &&
            strncasecmp(f->value, "100-continue", 12) == 0)
            expect = true;
    }
    /* TLS: the 100 goes through h2o's socket (which encrypts), and no answer may begin while
     * that write is out (h2o writes one thing at a time). So it is sent before h2o has the
     * head, from the read that brought it, when nothing else writes (gate_on_read): the
     * client then sends its body, which is read as the handler asks for it. A head found
     * another way (pipelined behind a request) is h2o's to read, with its own 100. */
    bool tls = st->sock->ssl != NULL;
    if (expect && tls && !(st->vet_read && st->sock->_cb.write == NULL))
        return;
    for (size_t i = 0; i < h->nfields; i++) {
        sp_bodygate_field_t *f = &h->fields[i];
        if (name_is(f->name, f->name_len, "content-length"))
            memcpy((char *)f->name, GATED_LENGTH, f->name_len);
        else if (name_is(f->name, f->name_len, "transfer-encoding"))
            memcpy((char *)f->name, GATED_CODING, f->name_len);
    }
    st->s_next = true;
    st->s_chunked = h->chunked;
    st->s_length = h->chunked ? 0 : h->length;
    st->s_cap = h->chunked && chunked_cap > 0 ? chunked_cap : gc->max_request_entity_size;
    st->s_expect = expect && !tls;
    st->tls_continue = expect && tls;
    st->state = GS_HANDED; /* h2o reads no body: the handler has the request at once */
    st->length = 0;
    st->chunked = false;
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
        if (off == 0 && in->size >= sizeof(pri) - 1 &&
            memcmp(in->bytes, pri, sizeof(pri) - 1) == 0) {
            st->state = GS_HANDED; /* h2o takes the socket as HTTP/2: gated as such */
            st->h2_prior = true;
        } else
            st->unreadable = true;
        return;
    }
    sp_bodygate_t *g = st->g;
    sp_bodygate_verdict_t v;
    sp_bodygate__ask(g, &h, &v);
    st->s_next = false;
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
    /* No HTTP/1 request becomes HTTP/2 (`Upgrade: h2c`): h2o would take the socket over when
     * its answer is written, past where the gate can take its own place back. The field is
     * renamed in place, so h2o answers over HTTP/1.1, which the upgrade allows; HTTP/2 is
     * had with prior knowledge or over TLS, both gated from their first frame. */
    for (size_t i = 0; i < h.nfields; i++) {
        sp_bodygate_field_t *f = &h.fields[i];
        if (name_is(f->name, f->name_len, "upgrade") && f->value_len >= 3 &&
            strncasecmp(f->value, "h2c", 3) == 0)
            *(char *)f->name = 'X';
    }
    if (v.stream && st->state == GS_BODY)
        stream_head(st, &h, v.chunked_cap);
}

static void gate_on_read(h2o_socket_t *sock, const char *err);

/* TLS: the 100 Continue of the head in the input is out (or failed): h2o reads the head now. */
static void on_continue_sent(h2o_socket_t *sock, const char *err)
{
    h2o_socket_read_start(sock, gate_on_read);
    gate_on_read(sock, err);
}

static void gate_on_read(h2o_socket_t *sock, const char *err)
{
    struct gs *st = sock->on_close.data;
    st->in_read = true;
    size_t h2_total = 0; /* prior knowledge: the input's size before it was cut */
    if (err == NULL && st->g != NULL) {
        if (st->state == GS_IDLE) {
            st->vet_read = true;
            vet(st, 0);
            st->vet_read = false;
            if (st->tls_continue) { /* h2o has the head once the 100 is out (stream_head) */
                static const char cont[] = "HTTP/1.1 100 Continue\r\n\r\n";
                h2o_iovec_t buf = h2o_iovec_init(cont, sizeof(cont) - 1);
                st->tls_continue = false;
                h2o_socket_read_stop(sock);
                h2o_socket_write(sock, &buf, 1, on_continue_sent);
                goto out;
            }
            if (st->unreadable)
                err = "request head the body gate cannot read";
            else if (st->h2_prior)
                h2_total = sp_bodygate__h2_cut(sock);
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
    h2o_socket_cb http1 = st->orig;
    st->orig(sock, err);
    if (h2_total > 0 && st->sock != NULL) {
        if (sock->_cb.read != NULL && sock->_cb.read != http1) {
            sp_bodygate__h2_uncut(st,
                                  h2_total); /* h2o took it as HTTP/2: the gate goes before that */
        } else {
            sp_bodygate__h2_restore(
                sock, h2_total); /* it did not: the input as it was, less what it read */
        }
    }
out:
    st->in_read = false;
    sp_bodygate__gs_free_if_done(st);
}

/* The gate's state on sock, found through its on_close hook; NULL when out of memory or the
 * hook is someone else's. */
static struct gs *gs_new(sp_bodygate_t *g, h2o_socket_t *sock, int fd)
{
    if (sock->on_close.cb != NULL)
        return NULL;
    struct gs *st = calloc(1, sizeof(*st));
    if (st == NULL)
        return NULL;
    st->g = g;
    st->sock = sock;
    st->state = GS_IDLE;
    st->fd = fd;
    st->drain_fd = -1;
    st->next = g->head;
    if (g->head)
        g->head->prev = st;
    g->head = st;
    sock->on_close.cb = sp_bodygate__gs_on_close;
    sock->on_close.data = st;
    return st;
}

void sp_bodygate_attach(sp_bodygate_t *g, h2o_socket_t *sock, int fd)
{
    /* A socket h2o reads as HTTP/2 already, or one someone else watches: not ours. */
    if (sock->_cb.read == NULL)
        return;
    struct gs *st = gs_new(g, sock, fd);
    if (st == NULL)
        return; /* fails open: h2o's global limit still holds */
    st->orig = sock->_cb.read;
    sock->_cb.read = gate_on_read;
}

/* ---- streamed bodies ---- */

static sp_metric_t m_streamed = SP_METRIC_COUNTER(
    "space_http_streamed_bodies_total",
    "Request bodies read as they came rather than whole first (uploads forwarded to another "
    "node), by how they ended: whole, or cut (the client left, bad framing, the answer came "
    "first)",
    "outcome");
static sp_metric_t m_streamed_bytes = SP_METRIC_COUNTER(
    "space_http_streamed_body_bytes_total",
    "Bytes of request bodies read as they came (chunked: as sent, framing included)", "");

void sp_bodygate__count(bool whole, uint64_t bytes)
{
    sp_metrics_add(&m_streamed, 1, whole ? "whole" : "cut");
    sp_metrics_add(&m_streamed_bytes, (double)bytes);
}

static void body_begin(struct gs *st, h2o_req_t *req)
{
    struct gbody *b = &st->b;
    st->s_next = false;
    memset(b, 0, sizeof(*b));
    b->req = req;
    b->chunked = st->s_chunked;
    b->left = st->s_length;
    b->cap = st->s_cap;
    b->ck = (sp_chunked_t)SP_CHUNKED_INIT;
    /* The body is read beside h2o, which takes no request after this one. */
    req->http1_is_persistent = 0;
    h2o_buffer_t *in = st->sock->input;
    b->pre = in->size > st->head_len ? in->size - st->head_len : 0;
    if (!b->chunked && b->pre > b->left)
        b->pre = (size_t)b->left;
    b->expect = st->s_expect && b->pre == 0;
    b->fd = fcntl(st->fd, F_DUPFD_CLOEXEC, 0); /* -1: the first read fails */
    b->tls = st->sock->ssl != NULL;
    if (b->tls) {
        /* h2o's request points into the head in the socket's input, which a read could move
         * (h2o_buffer_reserve): the socket reads into a new buffer, the old one is kept whole
         * until the socket closes (its body bytes past the head are taken from it). */
        held_free(st);
        st->held = in;
        h2o_buffer_init(&st->sock->input, &h2o_socket_buffer_prototype);
    }
}

/* The request is done with its body (answered, or its connection gone): what is left of the
 * body is drained once h2o has closed the connection. */
static void body_end(struct gs *st)
{
    struct gbody *b = &st->b;
    if (b->req == NULL)
        return;
    sp_bodygate__count(b->end, b->got);
    b->req = NULL;
    b->cb = NULL;
    if (b->reading && st->sock != NULL)
        h2o_socket_read_stop(st->sock);
    b->reading = false;
    sp_watch_destroy(b->w);
    b->w = NULL;
    free(b->buf);
    b->buf = NULL;
    if (b->fd >= 0) {
        if (!b->end && !b->failed && st->sock != NULL && st->g != NULL && st->drain_fd < 0) {
            st->drain_fd = b->fd;
            st->drain_left = b->chunked ? DRAIN_MAX_BYTES : b->left - b->pre;
        } else {
            close(b->fd);
        }
        b->fd = -1;
    }
}

static struct gs *gs_of(h2o_req_t *req)
{
    if (req->version >= 0x200 || req->conn->callbacks->get_socket == NULL)
        return NULL;
    h2o_socket_t *sock = req->conn->callbacks->get_socket(req->conn);
    if (sock == NULL || sock->on_close.cb != sp_bodygate__gs_on_close)
        return NULL;
    return sock->on_close.data;
}

/* The body of req when it is streamed and not yet collected, else NULL. */
static struct gbody *body_of(h2o_req_t *req)
{
    struct gs *st = gs_of(req);
    return st != NULL && st->b.req == req && !st->b.collected ? &st->b : NULL;
}

/* The gate's state of req's connection, HTTP/1 or a streamed HTTP/2 body's. */
static struct gs *gate_of(h2o_req_t *req)
{
    struct h2s *e = sp_bodygate__h2s_of(req);
    return e != NULL ? e->st : gs_of(req);
}

bool sp_bodygate_streamed(h2o_req_t *req, uint64_t *length, bool *chunked)
{
    struct h2s *e = sp_bodygate__h2s_of(req);
    if (e != NULL) {
        if (e->collected)
            return false;
        *chunked = e->chunked;
        *length = e->chunked ? 0 : e->cap; /* as it was declared */
        return true;
    }
    struct gbody *b = body_of(req);
    if (b == NULL)
        return false;
    *chunked = b->chunked;
    *length = b->chunked ? 0 : b->left + b->got; /* as it was declared */
    return true;
}

/* Hands the piece in b->buf (n bytes) to the pending read. */
static void body_give(struct gs *st, size_t n, bool end, const sp_err_t *err)
{
    struct gbody *b = &st->b;
    sp_bodygate_body_cb cb = b->cb;
    void *arg = b->arg;
    b->cb = NULL;
    b->end = end;
    b->failed = err != NULL;
    if (b->w != NULL)
        sp_watch_set(b->w, 0);
    st->holds++;
    cb(arg, b->buf, n, end, err);
    st->holds--;
}

static void body_fail(struct gs *st, sp_code_t code, const char *msg)
{
    sp_err_t e;
    sp_err_set(&e, code, "%s", msg);
    body_give(st, 0, false, &e);
}

static void on_body_io(sp_watch_t *w, int events, void *arg);
static void on_body_tls(h2o_socket_t *sock, const char *err);

/* Reads the next piece for the pending read: from what h2o read past the head first, then from
 * the socket; waits for the socket when it has nothing. */
static void body_pump(struct gs *st)
{
    struct gbody *b = &st->b;
    if (b->req == NULL || b->cb == NULL || st->sock == NULL)
        return;
    if (b->buf == NULL && (b->buf = malloc(PIECE_MAX)) == NULL) {
        body_fail(st, SP_EINTERNAL, "out of memory for the request body");
        return;
    }
    for (;;) {
        size_t n;
        if (b->pre > 0) {
            h2o_buffer_t *in = b->tls ? st->held : st->sock->input;
            char *at = in->bytes + st->head_len;
            n = b->pre < PIECE_MAX ? b->pre : PIECE_MAX;
            memcpy(b->buf, at + b->pre_off, n);
            b->pre_off += n;
            b->pre -= n;
            if (b->pre == 0) { /* all handed out: what followed them moves up once */
                memmove(at, at + b->pre_off, in->size - st->head_len - b->pre_off);
                in->size -= b->pre_off;
                b->pre_off = 0;
            }
        } else if (b->tls) {
            h2o_buffer_t *in = st->sock->input;
            if (in->size == 0) {
                b->reading = true;
                h2o_socket_read_start(st->sock, on_body_tls);
                return;
            }
            n = in->size < PIECE_MAX ? in->size : PIECE_MAX;
            if (!b->chunked && b->left < n)
                n = (size_t)b->left; /* what follows is not ours */
            memcpy(b->buf, in->bytes, n);
            h2o_buffer_consume(&st->sock->input, n);
        } else {
            if (b->expect) {
                static const char cont[] = "HTTP/1.1 100 Continue\r\n\r\n";
                b->expect = false;
                if (b->fd < 0 || send(b->fd, cont, sizeof(cont) - 1, MSG_DONTWAIT | MSG_NOSIGNAL) !=
                                     (ssize_t)sizeof(cont) - 1) {
                    body_fail(st, SP_EINVAL, "the client's connection failed");
                    return;
                }
            }
            size_t want = PIECE_MAX;
            if (!b->chunked && b->left < want)
                want = (size_t)b->left; /* never past the body: what follows is not ours */
            ssize_t r = b->fd >= 0 ? recv(b->fd, b->buf, want, MSG_DONTWAIT) : -1;
            if (r < 0 && b->fd >= 0 &&
                (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)) {
                if (b->w == NULL && st->g != NULL)
                    b->w = sp_watch_create(st->g->loop, b->fd, on_body_io, st);
                if (b->w == NULL) {
                    body_fail(st, SP_EINTERNAL, "cannot wait for the request body");
                    return;
                }
                sp_watch_set(b->w, SP_IO_READ);
                return;
            }
            if (r <= 0) {
                body_fail(st, SP_EINVAL,
                          "the client's connection ended before its request body did");
                return;
            }
            n = (size_t)r;
        }
        if (!b->chunked) {
            b->left -= n;
            b->got += n;
            body_give(st, n, b->left == 0, NULL);
            return;
        }
        /* chunked: decoded in place, toward the front of the piece */
        b->got += n; /* the framing counts against the cap too (trailers, say) */
        if (b->got > b->cap) {
            body_fail(st, SP_ETOOBIG, "the chunked request body is larger than the limit");
            return;
        }
        size_t in = 0, out = 0;
        bool end = false;
        while (in < n) {
            size_t used, dlen;
            const uint8_t *data;
            int rc = sp_chunked_step(&b->ck, (const uint8_t *)b->buf + in, n - in, n - in, &used,
                                     &data, &dlen);
            if (rc < 0) {
                body_fail(st, SP_EINVAL, "the request body's chunked coding is malformed");
                return;
            }
            if (dlen > 0)
                memmove(b->buf + out, data, dlen);
            out += dlen;
            in += used;
            if (rc == 1) {
                end = true;
                break;
            }
            if (used == 0)
                break;
        }
        if (out > 0 || end) {
            body_give(st, out, end, NULL);
            return;
        }
        /* framing alone: read on */
    }
}

static void on_body_io(sp_watch_t *w, int events, void *arg)
{
    struct gs *st = arg;
    sp_watch_set(w, 0);
    body_pump(st);
    sp_bodygate__gs_free_if_done(st);
}

/* TLS: h2o read (and decrypted) more of the body into the socket's input, or failed. */
static void on_body_tls(h2o_socket_t *sock, const char *err)
{
    struct gs *st = sock->on_close.data;
    h2o_socket_read_stop(sock);
    st->b.reading = false;
    if (st->b.req == NULL || st->b.cb == NULL)
        return;
    if (err != NULL && sock->input->size == 0)
        body_fail(st, SP_EINVAL, "the client's connection ended before its request body did");
    else
        body_pump(st);
    sp_bodygate__gs_free_if_done(st);
}

static void body_deferred(h2o_timeout_entry_t *entry)
{
    struct gs *st = H2O_STRUCT_FROM_MEMBER(struct gs, b_tick, entry);
    st->b.deferred = false;
    st->holds--;
    body_pump(st);
    sp_bodygate__gs_free_if_done(st);
}

int sp_bodygate_body_read(h2o_req_t *req, sp_bodygate_body_cb cb, void *arg)
{
    struct h2s *e = sp_bodygate__h2s_of(req);
    if (e != NULL) {
        if (e->st->g == NULL || e->st->sock == NULL || e->end_given || e->cb != NULL)
            return -1;
        if (e->buf == NULL && (e->buf = malloc(PIECE_MAX)) == NULL)
            return -1;
        e->cb = cb;
        e->arg = arg;
        e->want = true;
        if (sp_bodygate__h2s_ready(e))
            sp_bodygate__h2_schedule(e->st); /* else when its DATA comes */
        return 0;
    }
    struct gs *st = gs_of(req);
    if (st == NULL || st->b.req != req || st->g == NULL || st->sock == NULL)
        return -1;
    struct gbody *b = &st->b;
    if (b->end || b->failed || b->cb != NULL)
        return -1;
    b->cb = cb;
    b->arg = arg;
    if (b->pre > 0 || b->expect || b->w == NULL || b->tls) {
        /* bytes at hand, a 100 to send first, or no watch yet: on the next turn, inside
         * h2o's loop, on an entry of the connection's own (sp_bodygate__h2_schedule says why) */
        if (!b->deferred) {
            st->b_tick.cb = body_deferred;
            h2o_timeout_link(req->conn->ctx->loop, &req->conn->ctx->zero_timeout, &st->b_tick);
            b->deferred = true;
            st->holds++;
        }
    } else {
        sp_watch_set(b->w, SP_IO_READ);
    }
    return 0;
}

void sp_bodygate_body_cancel(h2o_req_t *req)
{
    struct h2s *e = sp_bodygate__h2s_of(req);
    if (e != NULL) {
        e->cb = NULL;
        e->want = false;
        return;
    }
    struct gs *st = gs_of(req);
    if (st == NULL || st->b.req != req)
        return;
    st->b.cb = NULL;
    if (st->b.w != NULL)
        sp_watch_set(st->b.w, 0);
    if (st->b.reading && st->sock != NULL) {
        h2o_socket_read_stop(st->sock);
        st->b.reading = false;
    }
}

/* Collecting a streamed body into req->entity (sp_bodygate_body_collect); lives in req's pool. */
struct collect {
    h2o_req_t *req;
    sp_bodygate_collected_cb done;
    void *arg;
    h2o_buffer_t *buf;
    sp_timer_t timer;
};

static void collect_dispose(void *p)
{
    struct collect *c = p;
    sp_timer_stop(&c->timer);
    h2o_buffer_dispose(&c->buf);
}

static void collect_end(struct collect *c, const sp_err_t *err)
{
    sp_timer_stop(&c->timer);
    if (err == NULL) {
        struct gbody *b = body_of(c->req);
        struct h2s *e = sp_bodygate__h2s_of(c->req);
        if (b != NULL)
            b->collected = true;
        else if (e != NULL)
            e->collected = true;
        c->req->entity =
            c->buf->size > 0 ? h2o_iovec_init(c->buf->bytes, c->buf->size) : h2o_iovec_init("", 0);
    }
    c->done(c->arg, c->req, err);
}

static void on_collect_piece(void *arg, const char *data, size_t len, bool end, const sp_err_t *err)
{
    struct collect *c = arg;
    if (err != NULL) {
        collect_end(c, err);
        return;
    }
    if (len > 0) {
        h2o_iovec_t room = h2o_buffer_reserve(&c->buf, len);
        if (room.base == NULL) {
            sp_err_t e;
            sp_err_set(&e, SP_EINTERNAL, "out of memory for the request body");
            collect_end(c, &e);
            return;
        }
        memcpy(room.base, data, len);
        c->buf->size += len;
    }
    if (end) {
        collect_end(c, NULL);
        return;
    }
    sp_timer_start(&c->timer, c->req->conn->ctx->globalconf->http1.req_timeout);
    if (sp_bodygate_body_read(c->req, on_collect_piece, c) < 0) {
        sp_err_t e;
        sp_err_set(&e, SP_EINTERNAL, "cannot read the request body");
        collect_end(c, &e);
    }
}

static void on_collect_timeout(sp_timer_t *t, void *arg)
{
    struct collect *c = arg;
    sp_bodygate_body_cancel(c->req);
    sp_err_t e;
    sp_err_set(&e, SP_EINVAL, "the request body did not come in time");
    collect_end(c, &e);
}

void sp_bodygate_body_collect(h2o_req_t *req, sp_bodygate_collected_cb done, void *arg)
{
    struct gs *st = gate_of(req);
    struct collect *c = NULL;
    if (st != NULL && st->g != NULL)
        c = h2o_mem_alloc_shared(&req->pool, sizeof(*c), collect_dispose);
    if (c != NULL) {
        memset(c, 0, sizeof(*c));
        c->req = req;
        c->done = done;
        c->arg = arg;
        h2o_buffer_init(&c->buf, &h2o_socket_buffer_prototype);
        sp_timer_init(&c->timer, st->g->loop, on_collect_timeout, c);
        sp_timer_start(&c->timer, req->conn->ctx->globalconf->http1.req_timeout);
        if (sp_bodygate_body_read(req, on_collect_piece, c) == 0)
            return;
        sp_timer_stop(&c->timer);
    }
    sp_err_t e;
    sp_err_set(&e, SP_EINTERNAL, "cannot read the request body");
    done(arg, req, &e);
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
    sp_bodygate__gs_free_if_done(st);
}

/* Runs when the request's pool goes: h2o is done with it, and (keep-alive) is about to
 * consume its bytes and take the next request, with its own read callback. */
static void on_req_disposed(void *p)
{
    struct gs *st = *(struct gs **)p;
    release_large(st);
    if (st->b.req != NULL) {
        /* Streamed: its connection closes now (not persistent), and what the client still
         * sends of the body is drained after the answer, as after a refusal. */
        body_end(st);
    } else if (st->sock != NULL && st->g != NULL) {
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
    sp_bodygate__gs_free_if_done(st);
}

bool sp_bodygate_request(sp_bodygate_t *g, h2o_req_t *req, sp_bodygate_verdict_t *v)
{
    if (g == NULL || req->conn->callbacks->get_socket == NULL)
        return false;
    h2o_socket_t *sock = req->conn->callbacks->get_socket(req->conn);
    if (sock == NULL || sock->on_close.cb != sp_bodygate__gs_on_close)
        return false;
    struct gs *st = sock->on_close.data;
    if (req->version >= 0x200) { /* HTTP/2: one the gate ended is answered with its verdict */
        uint32_t id = H2O_STRUCT_FROM_MEMBER(h2o_http2_stream_t, req, req)->stream_id;
        struct h2s *e = sp_bodygate__h2s_find(st, id);
        if (e == NULL || e->state == H2S_OPEN || e->state == H2S_STREAMING || e->answered)
            return false;
        e->answered = true;
        *v = e->verdict;
        return true;
    }
    if (st->refused) {
        st->refused = false;
        *v = st->verdict;
        return true;
    }
    st->state = GS_HANDED;
    struct gs **hook = h2o_mem_alloc_shared(&req->pool, sizeof(*hook), on_req_disposed);
    *hook = st;
    st->holds++;
    if (st->s_next)
        body_begin(st, req);
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
            struct gs *st = g != NULL ? gs_new(g, sock, fd) : NULL;
            if (st == NULL) {
                h2o_http2_accept(ctx, sock, at); /* fails open, as sp_bodygate_attach */
                return;
            }
            /* h2o reads what the handshake brought at once: the preface alone, the rest
             * through the gate. */
            st->in_read = true;
            size_t total = sp_bodygate__h2_cut(sock);
            h2o_http2_accept(ctx, sock, at);
            if (st->sock != NULL)
                sp_bodygate__h2_uncut(st, total);
            st->in_read = false;
            sp_bodygate__gs_free_if_done(st);
            return;
        }
    }
    /* h2o_http1_accept parses at once what the handshake's last read brought (a client may send
     * its request in the same flight as its Finished): that input is kept from it until the gate
     * is in place, then read through the gate. */
    h2o_buffer_t *early = sock->input;
    h2o_buffer_init(&sock->input, &h2o_socket_buffer_prototype);
    h2o_http1_accept(ctx, sock, at);
    h2o_buffer_t *none = sock->input;
    sock->input = early;
    h2o_buffer_dispose(&none);
    if (g != NULL)
        sp_bodygate_attach(g, sock, fd);
    if (sock->input->size > 0 && sock->_cb.read != NULL)
        sock->_cb.read(sock, NULL);
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
        body_end(st); /* a streamed body: no more pieces; its reader's next read fails */
        if (st->sock != NULL) {
            if (st->sock->_cb.read == gate_on_read || st->sock->_cb.read == sp_bodygate__h2_on_read)
                st->sock->_cb.read = st->orig;
            st->sock->on_close.cb = NULL;
            st->sock->on_close.data = NULL;
            st->sock = NULL;
        }
        if (st->drain_fd >= 0) {
            close(st->drain_fd);
            st->drain_fd = -1;
        }
        sp_bodygate__gs_free_if_done(st);
    }
    free(g);
}

unsigned sp_bodygate_large_now(const sp_bodygate_t *g)
{
    return g->large_now;
}
