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
 * socket's fd while h2o does not read the socket. For HTTP/2 it reads h2o's connection
 * and streams (<h2o/http2_internal.h>: the stream table, a stream's state, decoded head and
 * expected length) and writes frames into the connection's output buffer; a streamed body's
 * DATA is queued here (struct h2s) and handed out from it.
 */
#include "http/bodygate.h"

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
/* HTTP/2's framing (RFC 9113): a frame's head, the client's preface, the types and flags the
 * gate reads or writes. */
#define H2_HEAD        9
#define H2_PREFACE     24
#define H2_DATA        0x0
#define H2_HEADERS     0x1
#define H2_CONT        0x9 /* CONTINUATION */
#define H2_END_STREAM  0x1
#define H2_END_HEADERS 0x4
#define H2_PADDED      0x8
#define H2_DONE_MAX    16 /* answered streams remembered per connection, to drop their late DATA */
#define H2_HEADS_MAX   16 /* heads without their body vetted at the end of one read */
/* A streamed body is read from the socket in pieces of at most this much. */
#define PIECE_MAX ((size_t)512 << 10)
/* What a Content-Length and a Transfer-Encoding field are renamed to (same lengths), so that
 * h2o reads a streamed request's head as one without a body. */
#define GATED_LENGTH SP_BODYGATE_GATED_PREFIX "len"    /* 14: content-length */
#define GATED_CODING SP_BODYGATE_GATED_PREFIX "coding" /* 17: transfer-encoding */

enum gs_state {
    GS_IDLE,   /* the next bytes are a request head */
    GS_BODY,   /* a head was handed on; h2o reads its body through us */
    GS_HANDED, /* the handler has the request; reads resume once h2o is done with it */
};

/* A streamed body being read (sp_bodygate_body_read). */
struct gbody {
    h2o_req_t *req;
    bool chunked, expect; /* expect: 100 Continue not yet sent */
    bool end, failed, collected;
    bool deferred;     /* a pump is deferred (the socket's holds count it) */
    bool tls;          /* read through h2o's socket (which decrypts), not the dup */
    bool reading;      /* tls: h2o's socket is being read for it */
    uint64_t left;     /* Content-Length: body bytes still to come */
    uint64_t got;      /* bytes read of it (chunked: as sent, framing included) */
    uint64_t cap;      /* chunked: the most got may reach */
    sp_chunked_t ck;
    size_t pre;     /* its bytes h2o read already, not handed out yet */
    size_t pre_off; /* those handed out: pre's bytes start at head + pre_off in the input */
    int fd;     /* a dup of the socket's: read directly (plain), drained after (-1: none) */
    sp_watch_t *w;
    char *buf; /* PIECE_MAX: the piece handed out */
    sp_bodygate_body_cb cb;
    void *arg;
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
    bool h2_prior;   /* the input starts with HTTP/2's preface (prior knowledge) */
    bool h2_seen;    /* HTTP/2: h2o has read the connection preface */
    struct h2s *h2s; /* HTTP/2: the streams with a body the gate has vetted */
    bool h2_deferred; /* HTTP/2: a pass handing streamed bodies' pieces out is deferred */
    uint64_t h2_queued;          /* HTTP/2: streamed bodies' bytes queued, all streams (h2_held) */
    h2o_timeout_entry_t h2_tick; /* that pass, on h2o's zero timeout (h2_schedule) */
    h2o_timeout_entry_t b_tick;  /* HTTP/1: a streamed body's deferred read (body_deferred) */
    /* the head just vetted is streamed (its body stays on the socket): its framing */
    bool s_next, s_chunked, s_expect;
    bool vet_read;     /* vet is looking at a head gate_on_read just read (nothing writes) */
    bool tls_continue; /* TLS: its 100 Continue is sent before h2o has the head */
    uint64_t s_length, s_cap;
    struct gbody b; /* the body of the request being handled, when streamed (b.req) */
    h2o_buffer_t *held; /* TLS: the input the streamed request's head is in, kept until the
                         * socket closes (h2o's request points into it; the socket reads into
                         * a new one meanwhile) */
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
static void h2s_free_all(struct gs *st);
static size_t h2_cut(h2o_socket_t *sock);
static void h2_uncut(struct gs *st, size_t total);
static size_t h2_restore(h2o_socket_t *sock, size_t total);

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

static void gs_free_if_done(struct gs *st)
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
    h2s_free_all(st);
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

static void gs_on_close(void *data)
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
    gs_free_if_done(st);
}

/* The policy's verdict on a head, with the server-wide bound on large bodies applied. */
static void ask(sp_bodygate_t *g, const sp_bodygate_head_t *h, sp_bodygate_verdict_t *v)
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
    ask(g, &h, &v);
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
                h2_total = h2_cut(sock);
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
            h2_uncut(st, h2_total); /* h2o took it as HTTP/2: the gate goes before that */
        } else {
            h2_restore(sock, h2_total); /* it did not: the input as it was, less what it read */
        }
    }
out:
    st->in_read = false;
    gs_free_if_done(st);
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
    sock->on_close.cb = gs_on_close;
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

/* ---- HTTP/2 ----
 *
 * h2o decodes the frames and HPACK-coded heads itself and gathers a stream's DATA until its
 * end, so the gate works between its reads: it walks the frames in the input before h2o does,
 * and at the first DATA frame of a stream whose head h2o has not yet read, hands h2o the frames
 * before it (the input cut there, one byte of the next frame left so h2o keeps its buffer)
 * and looks at the stream h2o made: its decoded head asks the same policy an HTTP/1 head
 * does (a head with no DATA after it in the read: once h2o has had the read, h2_vet_heads).
 * Then, frame by frame:
 * - a stream the policy refused, or whose DATA passes its cap (its Content-Length, or the
 *   policy's cap for a body of unknown length), ends there: that DATA frame is rewritten as
 *   an empty HEADERS frame with END_STREAM (trailers, to h2o), so h2o hands the request, with
 *   the little it holds, to the handler, which answers with the refusal (sp_bodygate_request);
 * - the DATA the client still sends on it is dropped before h2o sees it (h2o would reset the
 *   stream before its answer is out); once h2o is done with the stream, the gate sends
 *   RST_STREAM(NO_ERROR) (RFC 9113, 8.1: the answer is complete, stop sending) once;
 * - every byte dropped is given back to the connection's flow-control window (WINDOW_UPDATE
 *   on stream 0), so other streams never stall for it.
 * - the trailers the client still sends on it (a HEADERS frame with END_STREAM) are dropped
 *   too, once h2o has read every frame before them and their block has been decoded into
 *   h2o's HPACK table as h2o would have (h2o would take them as a HEADERS frame on a closed
 *   stream: a connection error). Trailers split into CONTINUATION frames are kept from h2o
 *   until their last frame has come, and dropped whole (h2o reads nothing meanwhile: no other
 *   frame may come between them).
 * The preface is h2o's, read alone first.
 */

enum h2s_state {
    H2S_OPEN,      /* its body comes */
    H2S_STREAMING, /* streamed: ended for h2o at its head, its DATA kept for the handler */
    H2S_ANSWERING, /* refused and ended for h2o; h2o still has it */
    H2S_DONE,      /* refused or streamed, and h2o is done with it */
};

struct h2s {
    struct gs *st;
    struct h2s *next;
    uint32_t id;
    enum h2s_state state;
    bool refuse;   /* ends at its next DATA frame, answered with verdict */
    bool answered; /* the handler took the verdict */
    bool hooked;   /* h2o's stream (its request's pool) is alive */
    bool large;    /* counted in g->large_now */
    bool rst_sent;
    uint64_t got, cap; /* DATA bytes seen; the most it may send */
    sp_bodygate_verdict_t verdict;
    /* a streamed body (the verdict's `stream`): h2o has the request with an empty body, and
     * the handler reads its DATA from here (sp_bodygate_body_read) */
    bool stream;            /* streamed once its state is STREAMING */
    bool chunked;           /* no content-length: got is unbounded but by cap */
    h2o_req_t *req;         /* STREAMING: the stream's request (h2o's, while hooked) */
    h2o_buffer_t *q;        /* STREAMING: payload not handed out yet */
    uint64_t raw, granted;  /* DATA frame bytes (padding too) taken; given back to its window */
    bool q_end;             /* END_STREAM came: q holds the rest */
    bool failed, end_given; /* the reader got an error, or the end */
    bool collected, want;   /* read whole (collect); a read waits for a piece */
    sp_err_t err;           /* failed: why */
    char *buf;              /* PIECE_MAX: the piece handed out */
    sp_bodygate_body_cb cb;
    void *arg;
};

/* HTTP/2 streamed bodies (below, with HTTP/1's) */
static void h2s_drop_body(struct h2s *e);
static void h2s_stream_start(struct h2s *e, h2o_http2_stream_t *s);
static size_t h2s_take(struct h2s *e, const uint8_t *f, size_t len);
static void h2s_ended_by_trailers(struct h2s *e);
static void h2s_count(const struct h2s *e);

static struct h2s *h2s_find(struct gs *st, uint32_t id)
{
    for (struct h2s *e = st->h2s; e != NULL; e = e->next)
        if (e->id == id)
            return e;
    return NULL;
}

static void h2s_free(struct gs *st, struct h2s *e)
{
    for (struct h2s **pp = &st->h2s; *pp != NULL; pp = &(*pp)->next) {
        if (*pp == e) {
            *pp = e->next;
            break;
        }
    }
    h2s_drop_body(e);
    free(e);
}

/* Only entries without a live hook are left when the socket's state goes (holds is 0). */
static void h2s_free_all(struct gs *st)
{
    while (st->h2s != NULL) {
        struct h2s *e = st->h2s;
        st->h2s = e->next;
        h2s_drop_body(e);
        free(e);
    }
}

static void h2s_release_large(struct h2s *e)
{
    if (e->large && e->st->g != NULL) {
        e->st->g->large_now--;
        e->large = false;
    }
}

/* h2o closed the stream (answered, reset, or the connection went). */
static void on_h2s_disposed(void *p)
{
    struct h2s *e = *(struct h2s **)p;
    struct gs *st = e->st;
    e->hooked = false;
    h2s_release_large(e);
    bool streamed = e->state == H2S_STREAMING;
    if (streamed) {
        h2s_count(e);
        h2s_drop_body(e); /* its request goes: what the client still sends is dropped */
    }
    if ((e->state == H2S_ANSWERING || (streamed && !e->q_end)) && st->sock != NULL) {
        e->state = H2S_DONE;
        unsigned n = 0; /* the newest few are kept */
        struct h2s *next;
        for (struct h2s *x = st->h2s; x != NULL; x = next) {
            next = x->next;
            if (x->state == H2S_DONE && ++n > H2_DONE_MAX)
                h2s_free(st, x);
        }
    } else {
        h2s_free(st, e);
    }
    st->holds--;
    gs_free_if_done(st);
}

/* The policy on a stream whose head h2o has read and whose body it is gathering. NULL when
 * out of memory (the stream goes on ungated: h2o's global limit still holds). */
static struct h2s *h2_vet(struct gs *st, h2o_http2_stream_t *s)
{
    sp_bodygate_t *g = st->g;
    h2o_req_t *req = &s->req;
    sp_bodygate_head_t h;
    memset(&h, 0, sizeof(h));
    h.method = req->input.method.base;
    h.method_len = req->input.method.len;
    h.path = req->input.path.base;
    h.path_len = req->input.path.len;
    h.host = req->input.authority.base != NULL ? req->input.authority.base : "";
    h.host_len = req->input.authority.len;
    /* h2o keeps content-length out of the fields (its hpack.c), as the stream's expected
     * length; without one the body's size shows only as it comes, as a chunked one's. */
    h.chunked = s->_expected_content_length == SIZE_MAX;
    h.length = h.chunked ? 0 : (uint64_t)s->_expected_content_length;
    for (size_t i = 0; i < req->headers.size && h.nfields < SP_BODYGATE_MAX_FIELDS; i++) {
        const h2o_header_t *f = &req->headers.entries[i];
        h.fields[h.nfields++] =
            (sp_bodygate_field_t){f->name->base, f->name->len, f->value.base, f->value.len};
    }
    sp_bodygate_verdict_t v;
    ask(g, &h, &v);
    struct h2s *e = calloc(1, sizeof(*e));
    if (e == NULL)
        return NULL;
    struct h2s **hook = h2o_mem_alloc_shared(&req->pool, sizeof(*hook), on_h2s_disposed);
    *hook = e;
    e->st = st;
    e->id = s->stream_id;
    e->hooked = true;
    e->refuse = v.refuse;
    e->verdict = v;
    e->cap = h.chunked ? (v.chunked_cap > 0 ? v.chunked_cap : UINT64_MAX) : h.length;
    e->stream = v.stream && !v.refuse;
    e->chunked = h.chunked;
    if (v.large && !v.refuse) {
        g->large_now++;
        e->large = true;
    }
    e->next = st->h2s;
    st->h2s = e;
    st->holds++;
    return e;
}

/* Hands h2o the first n bytes of the input (whole frames) and keeps the rest for after: 0, or
 * -1 when the socket is gone or h2o took nothing (the rest is then h2o's, ungated). */
static int h2_feed(struct gs *st, size_t n)
{
    h2o_socket_t *sock = st->sock;
    size_t total = sock->input->size;
    sock->input->size = n + 1; /* a frame starts at n: one byte of it, which h2o leaves */
    st->orig(sock, NULL);
    if (st->sock == NULL)
        return -1;
    size_t consumed = n + 1 - sock->input->size;
    sock->input->size = total - consumed;
    if (consumed == 0) {
        st->orig(sock, NULL);
        return -1;
    }
    if (consumed >= H2_PREFACE)
        st->h2_seen = true;
    return 0;
}

/* The trailers at f, a HEADERS frame on a stream the gate ended, with avail bytes of input from
 * there: 1 when their whole block is in (*n: the bytes of its frames, the HEADERS and the
 * CONTINUATION frames after it up to END_HEADERS), 0 when more of it is to come, -1 when they
 * are not trailers the gate drops (h2o's to refuse: no END_STREAM, another frame between, or
 * a block past what h2o takes). */
static int h2_trailers_span(const uint8_t *f, size_t avail, size_t *n)
{
    if (!(f[4] & H2_END_STREAM))
        return -1;
    for (size_t p = 0;;) {
        if (avail - p < H2_HEAD)
            return 0;
        const uint8_t *c = f + p;
        size_t len = (size_t)c[0] << 16 | (size_t)c[1] << 8 | c[2];
        if (p > 0 && (c[3] != H2_CONT || memcmp(c + 5, f + 5, 4) != 0))
            return -1;
        if (p + H2_HEAD + len > H2O_MAX_REQLEN)
            return -1;
        if (avail - p - H2_HEAD < len)
            return 0;
        p += H2_HEAD + len;
        if (c[4] & H2_END_HEADERS) {
            *n = p;
            return 1;
        }
    }
}

/* Decodes the trailers at f (n bytes of frames, as h2_trailers_span found them) on a stream
 * the gate ended into h2o's HPACK table as h2o would, so that they can be dropped: true when
 * done (false: a frame h2o is to refuse, or a block it cannot decode; the connection then ends
 * on h2o's error). */
static bool h2_skip_trailers(h2o_http2_conn_t *conn, const uint8_t *f, size_t n)
{
    h2o_http2_frame_t frame;
    h2o_http2_headers_payload_t payload;
    const char *err = NULL;
    ssize_t first = h2o_http2_decode_frame(&frame, f, n, &H2O_HTTP2_SETTINGS_HOST, &err);
    if (first < 0 || h2o_http2_decode_headers_payload(&payload, &frame, &err) != 0)
        return false;
    const uint8_t *block = payload.headers;
    size_t block_len = payload.headers_len;
    uint8_t *joined = NULL; /* a block split into CONTINUATION frames, joined */
    if ((size_t)first < n) {
        if ((joined = malloc(n)) == NULL)
            return false;
        memcpy(joined, block, block_len);
        for (size_t p = (size_t)first; p < n;) {
            size_t len = (size_t)f[p] << 16 | (size_t)f[p + 1] << 8 | f[p + 2];
            memcpy(joined + block_len, f + p + H2_HEAD, len);
            block_len += len;
            p += H2_HEAD + len;
        }
        block = joined;
    }
    h2o_req_t *scratch = calloc(1, sizeof(*scratch)); /* what the fields decode into */
    if (scratch == NULL) {
        free(joined);
        return false;
    }
    h2o_mem_init_pool(&scratch->pool);
    size_t length;
    int ret = h2o_hpack_parse_headers(scratch, &conn->_input_header_table, block, block_len, NULL,
                                      &length, NULL, &err);
    h2o_mem_clear_pool(&scratch->pool);
    free(scratch);
    free(joined);
    return ret == 0;
}

/* Writes, at f, an empty HEADERS frame with END_STREAM on stream id: the end of its request,
 * for h2o (trailers). */
static void h2_end_frame(uint8_t *f, uint32_t id)
{
    h2o_http2_encode_frame_header(f, 0, H2_HEADERS, H2_END_STREAM | H2_END_HEADERS,
                                  (int32_t)id);
}

/* The stream e (h2o's s) is ended for h2o by the frame h2_end_frame wrote: its request goes to
 * the handler with what h2o holds of its body, to be answered with the refusal. */
static void h2s_ended(struct h2s *e, h2o_http2_stream_t *s)
{
    s->_expected_content_length = SIZE_MAX; /* h2o checks what came against it */
    e->state = H2S_ANSWERING;
    h2s_release_large(e);
}

/* h2_gate's walk of the input: n bytes at *p are kept, moved down to *w when something was
 * cut before them. */
static void keep(h2o_buffer_t *in, size_t *w, size_t *p, size_t n)
{
    if (*w != *p)
        memmove(in->bytes + *w, in->bytes + *p, n);
    *w += n;
    *p += n;
}

/* The end of the walk (or a feed to h2o in its midst): what was cut between w and p goes, the
 * unread rest moving down to w. Returns w, where the rest now starts. */
static size_t compact(h2o_buffer_t *in, size_t w, size_t p)
{
    if (w != p) {
        memmove(in->bytes + w, in->bytes + p, in->size - p);
        in->size -= p - w;
    }
    return w;
}

/* The streams whose heads came in the read h2o has just had (ids), without a DATA frame yet:
 * vetted now, and a refused one ended at once (an end frame put before what is left of the
 * input), so that a refusal is answered on its head, as HTTP/1's is: a client may wait for
 * it before sending its body (Expect: 100-continue), or send it slowly. Not while h2o waits
 * for the rest of a head block (nothing else may come between): those are vetted at their
 * first DATA frame, as any the bound leaves out. */
static void h2_vet_heads(struct gs *st, const uint32_t *ids, unsigned n, bool held)
{
    unsigned ends = 0;
    for (unsigned i = 0; i < n; i++) {
        if (st->sock == NULL || st->g == NULL)
            break;
        h2o_http2_conn_t *conn = st->sock->data;
        if (conn->state >= H2O_HTTP2_CONN_STATE_HALF_CLOSED || conn->_headers_unparsed != NULL)
            break;
        h2o_http2_stream_t *s = h2o_http2_conn_get_stream(conn, ids[i]);
        if (s == NULL || s->state != H2O_HTTP2_STREAM_STATE_RECV_BODY ||
            h2s_find(st, ids[i]) != NULL)
            continue;
        struct h2s *e = h2_vet(st, s);
        if (e == NULL || !(e->refuse || e->stream))
            continue;
        h2o_buffer_t **in = &st->sock->input;
        h2o_buffer_reserve(in, H2_HEAD);
        memmove((*in)->bytes + H2_HEAD, (*in)->bytes, (*in)->size);
        h2_end_frame((uint8_t *)(*in)->bytes, ids[i]);
        (*in)->size += H2_HEAD;
        if (e->refuse)
            h2s_ended(e, s);
        else
            h2s_stream_start(e, s); /* h2o takes it as a request without a body */
        ends++;
    }
    if (ends > 0 && st->sock != NULL) {
        if (held) /* only the end frames: the rest is still kept from h2o */
            h2_feed(st, ends * H2_HEAD);
        else
            st->orig(st->sock, NULL);
    }
}

static void h2_gate(struct gs *st)
{
    h2o_socket_t *sock = st->sock;
    h2o_http2_conn_t *conn = sock->data;
    uint64_t win = 0; /* bytes to give back to the connection's window */
    bool wrote = false;
    uint32_t heads[H2_HEADS_MAX];
    unsigned nheads = 0;
    bool held = false; /* the input (all of it) is kept from h2o until more comes */
    if (!st->h2_seen) {
        if (sock->input->size <= H2_PREFACE) {
            st->h2_seen = sock->input->size == H2_PREFACE;
            st->orig(sock, NULL);
            return;
        }
        if (h2_feed(st, H2_PREFACE) < 0)
            return;
    }
    /* The input is walked once: frames at p on are unread; [0, w) is what h2o will read; what
     * lies between w and p was cut. Kept frames move down to w as they are passed, so a read
     * full of cut frames costs its size, not its size for each frame cut (compact). */
    size_t p = 0, w = 0;
    for (;;) {
        h2o_buffer_t *in = sock->input;
        if (in->size - p < H2_HEAD)
            break;
        uint8_t *f = (uint8_t *)in->bytes + p;
        size_t len = (size_t)f[0] << 16 | (size_t)f[1] << 8 | f[2];
        uint32_t id = ((uint32_t)f[5] << 24 | (uint32_t)f[6] << 16 | (uint32_t)f[7] << 8 | f[8]) &
                      0x7fffffffu;
        if (in->size - p - H2_HEAD < len)
            break; /* not whole yet: h2o waits for it too */
        if (f[3] == H2_HEADERS && id != 0) {
            struct h2s *e = h2s_find(st, id);
            if (e == NULL && !(f[4] & H2_END_STREAM) && nheads < H2_HEADS_MAX)
                heads[nheads++] = id; /* a head a body follows (or trailers on one ungated) */
            if (e != NULL && e->state != H2S_OPEN) { /* trailers on a stream it ended */
                if (p > 0) { /* h2o decodes the blocks before them first: HPACK is ordered */
                    p = compact(in, w, p); /* (only cut frames before: at 0 now, no feed) */
                    if (p > 0 && h2_feed(st, p) < 0)
                        return;
                    p = w = 0;
                    continue;
                }
                size_t n;
                int whole = h2_trailers_span(f, in->size, &n);
                if (whole == 0) { /* the rest of their block has yet to come: h2o waits too */
                    held = true;
                    break;
                }
                if (whole > 0 && h2_skip_trailers(conn, f, n)) {
                    p += n; /* cut */
                    if (e->state == H2S_STREAMING)
                        h2s_ended_by_trailers(e);
                    continue;
                }
            }
        }
        if (f[3] != H2_DATA || id == 0) {
            keep(in, &w, &p, H2_HEAD + len);
            continue;
        }
        struct h2s *e = h2s_find(st, id);
        h2o_http2_stream_t *s = h2o_http2_conn_get_stream(conn, id);
        if (e == NULL) {
            if (s != NULL && s->state == H2O_HTTP2_STREAM_STATE_RECV_BODY) {
                e = h2_vet(st, s);
            } else if (w > 0) {
                /* its head may be among the frames kept before it, which h2o has not read */
                p = compact(in, w, p);
                if (h2_feed(st, p) < 0)
                    return;
                p = w = 0;
                continue;
            }
            if (e == NULL) { /* not a stream taking a body: h2o's to answer */
                keep(in, &w, &p, H2_HEAD + len);
                continue;
            }
        }
        if (e->state == H2S_STREAMING) { /* the handler's: h2o sees none of it */
            win += h2s_take(e, f, len);
            p += H2_HEAD + len; /* cut */
            continue;
        }
        if (e->state != H2S_OPEN) { /* answered: h2o sees no more of it */
            p += H2_HEAD + len;     /* cut */
            win += len;
            if (e->state == H2S_DONE && !e->rst_sent &&
                conn->state < H2O_HTTP2_CONN_STATE_IS_CLOSING) {
                h2o_http2__encode_rst_stream_frame(&conn->_write.buf, id, H2O_HTTP2_ERROR_NONE);
                e->rst_sent = wrote = true;
            }
            continue;
        }
        if (s == NULL || s->state != H2O_HTTP2_STREAM_STATE_RECV_BODY) {
            keep(in, &w, &p, H2_HEAD + len); /* DATA after its end: h2o's protocol error */
            continue;
        }
        if (!e->refuse && len > e->cap - e->got) {
            e->refuse = true;
            if (s->_expected_content_length != SIZE_MAX)
                sp_err_set(&e->verdict.err, SP_EINVAL,
                           "request body is longer than its content-length (%llu bytes)",
                           (unsigned long long)e->cap);
            else
                sp_err_set(&e->verdict.err, SP_ETOOBIG, "request body is larger than %llu KiB",
                           (unsigned long long)(e->cap >> 10));
        }
        if (e->refuse || e->stream) { /* empty trailers in this frame's place */
            if (e->stream && !e->refuse)
                h2s_stream_start(e, s);
            size_t back = len;
            if (e->state == H2S_STREAMING)
                back = h2s_take(e, f, len); /* the first of its body, the handler's */
            h2_end_frame(f, id);
            keep(in, &w, &p, H2_HEAD); /* the end frame; its payload cut */
            p += len;
            win += back;
            if (e->state != H2S_STREAMING)
                h2s_ended(e, s);
            continue;
        }
        e->got += len;
        keep(in, &w, &p, H2_HEAD + len);
    }
    compact(sock->input, w, p);
    if (conn->state < H2O_HTTP2_CONN_STATE_IS_CLOSING) {
        for (; win > 0; wrote = true) {
            int32_t n = win > INT32_MAX ? INT32_MAX : (int32_t)win;
            h2o_http2_encode_window_update_frame(&conn->_write.buf, 0, n);
            win -= (uint64_t)n;
        }
        if (wrote)
            h2o_http2_conn_request_write(conn);
    }
    if (!held)
        st->orig(sock, NULL);
    h2_vet_heads(st, heads, nheads, held);
}

static void h2_on_read(h2o_socket_t *sock, const char *err)
{
    struct gs *st = sock->on_close.data;
    st->in_read = true;
    if (err == NULL && st->g != NULL)
        h2_gate(st);
    else
        st->orig(sock, err);
    st->in_read = false;
    gs_free_if_done(st);
}

/* h2o has just taken sock as HTTP/2 (its read callback is HTTP/2's): the gate goes before it. */
static void h2_take(struct gs *st)
{
    st->orig = st->sock->_cb.read;
    st->sock->_cb.read = h2_on_read;
}

/* Before h2o takes a socket as HTTP/2 with input already read: the input is cut after the
 * preface (and one byte), so that h2o reads the preface alone; returns the input's size. */
static size_t h2_cut(h2o_socket_t *sock)
{
    size_t total = sock->input->size;
    if (total > H2_PREFACE + 1)
        sock->input->size = H2_PREFACE + 1;
    return total;
}

/* After h2o read the cut input: the rest back; returns what h2o consumed. */
static size_t h2_restore(h2o_socket_t *sock, size_t total)
{
    size_t shown = total > H2_PREFACE + 1 ? H2_PREFACE + 1 : total;
    size_t consumed = shown - sock->input->size;
    sock->input->size = total - consumed;
    return consumed;
}

/* After: the rest back, and the gate on what follows the preface. */
static void h2_uncut(struct gs *st, size_t total)
{
    h2o_socket_t *sock = st->sock;
    st->h2_seen = h2_restore(sock, total) >= H2_PREFACE;
    h2_take(st);
    if (sock->input->size > 0 && st->h2_seen)
        h2_gate(st);
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
    sp_metrics_add(&m_streamed, 1, b->end ? "whole" : "cut");
    sp_metrics_add(&m_streamed_bytes, (double)b->got);
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

/* ---- HTTP/2 streamed bodies ----
 *
 * A stream whose verdict is `stream` is ended for h2o at its head (an empty HEADERS frame with
 * END_STREAM where its first DATA frame was, or before what follows its head), so h2o hands
 * its request to the handler at once, with no body. Its DATA frames are cut from the input
 * before h2o reads it, their payload queued here, the connection's flow-control window given
 * back at once while the connection's streamed bodies have at most H2_CONN_QUEUED queued
 * (past it, as the bytes leave the queues: h2_held), and the stream's only as the handler
 * takes the bytes: a client sends at most the stream's window (h2o's initial 16 MiB) ahead of
 * the handler, all its streams together at most H2_CONN_QUEUED and the connection's window,
 * and one that sends more on a stream than its window fails that body (h2s_take). Pieces are
 * handed out in one deferred pass per connection (h2_deliver). */

/* Streamed bodies' bytes a connection may have queued before their share of the connection's
 * flow-control window is held back: one stream's window, so that one stalled stream leaves
 * the others the whole connection window. */
#define H2_CONN_QUEUED (16u << 20)

/* The connection window held back: what is queued past H2_CONN_QUEUED. */
static uint64_t h2_held(const struct gs *st)
{
    return st->h2_queued > H2_CONN_QUEUED ? st->h2_queued - H2_CONN_QUEUED : 0;
}

/* n bytes left the queues (handed out, or dropped): the connection window held back for them
 * goes back to the client. */
static void h2_unqueued(struct gs *st, size_t n)
{
    uint64_t held = h2_held(st);
    st->h2_queued -= n;
    uint64_t give = held - h2_held(st);
    if (give == 0 || st->sock == NULL)
        return;
    h2o_http2_conn_t *conn = st->sock->data;
    if (conn->state >= H2O_HTTP2_CONN_STATE_IS_CLOSING)
        return;
    h2o_http2_encode_window_update_frame(&conn->_write.buf, 0, (int32_t)give);
    h2o_http2_conn_request_write(conn);
}

static void h2s_count(const struct h2s *e)
{
    sp_metrics_add(&m_streamed, 1, e->end_given ? "whole" : "cut");
    sp_metrics_add(&m_streamed_bytes, (double)e->got);
}

static void h2s_drop_body(struct h2s *e)
{
    if (e->q != NULL) {
        h2_unqueued(e->st, e->q->size);
        h2o_buffer_dispose(&e->q);
    }
    free(e->buf);
    e->buf = NULL;
    e->req = NULL;
    e->cb = NULL;
    e->want = false;
}

static void h2s_stream_start(struct h2s *e, h2o_http2_stream_t *s)
{
    s->_expected_content_length = SIZE_MAX; /* h2o checks what came against it */
    e->state = H2S_STREAMING;
    e->req = &s->req;
    h2o_buffer_init(&e->q, &h2o_socket_buffer_prototype);
}

static void h2s_fail(struct h2s *e, sp_code_t code, const char *msg)
{
    if (e->failed || e->end_given)
        return;
    e->failed = true;
    sp_err_set(&e->err, code, "%s", msg);
}

static void h2_schedule(struct gs *st);

/* The end of the body came (END_STREAM on DATA, or trailers). */
static void h2s_body_ended(struct h2s *e)
{
    e->q_end = true;
    if (!e->chunked && e->got != e->cap)
        h2s_fail(e, SP_EINVAL, "request body is shorter than its content-length");
    if (e->want)
        h2_schedule(e->st);
}

static void h2s_ended_by_trailers(struct h2s *e)
{
    if (!e->q_end)
        h2s_body_ended(e);
}

/* A DATA frame of a streamed stream (f, payload len), cut from the input by the caller: its
 * data queued for the handler (unless the body failed, or ended before it). Returns how much
 * of the connection's window to give back for it now (all but what h2_held keeps). */
static size_t h2s_take(struct h2s *e, const uint8_t *f, size_t len)
{
    const uint8_t *d = f + H2_HEAD;
    size_t n = len;
    e->raw += len;
    /* h2o never sees these frames, so its flow control does not hold the client to the
     * stream's window: held here. A client that sends past it (what was given back plus
     * h2o's initial window) fails the body, and what is queued goes: a node holds at most the
     * window of each streamed body (at most --max-large-bodies of them), whatever a client
     * sends. */
    if (!e->failed && e->raw - e->granted > H2O_HTTP2_SETTINGS_HOST.initial_window_size) {
        h2s_fail(e, SP_EINVAL,
                 "the client sent more of the request body than HTTP/2 flow control allows");
        if (e->q != NULL) { /* its memory too (consuming keeps the buffer) */
            h2_unqueued(e->st, e->q->size);
            h2o_buffer_dispose(&e->q);
            h2o_buffer_init(&e->q, &h2o_socket_buffer_prototype);
        }
    }
    uint64_t held = h2_held(e->st);
    if (f[4] & H2_PADDED) {
        if (n < 1 || (size_t)d[0] >= n) { /* h2o would end the connection: the body fails */
            h2s_fail(e, SP_EINVAL, "a DATA frame's padding is longer than the frame");
            n = 0;
        } else {
            n -= 1 + (size_t)d[0];
            d++;
        }
    }
    if (!e->failed && !e->q_end && n > 0) {
        if (n > e->cap - e->got) {
            if (e->chunked)
                h2s_fail(e, SP_ETOOBIG, "request body is larger than the limit");
            else
                h2s_fail(e, SP_EINVAL, "request body is longer than its content-length");
        } else {
            h2o_iovec_t room = h2o_buffer_reserve(&e->q, n);
            if (room.base == NULL) {
                h2s_fail(e, SP_EINTERNAL, "out of memory for the request body");
            } else {
                memcpy(room.base, d, n);
                e->q->size += n;
                e->got += n;
                e->st->h2_queued += n;
            }
        }
    }
    if ((f[4] & H2_END_STREAM) && !e->q_end)
        h2s_body_ended(e);
    else if (e->want)
        h2_schedule(e->st);
    return len - (size_t)(h2_held(e->st) - held);
}

/* Gives the stream's window back for what is no longer queued (taken by the handler, or
 * dropped), while h2o still has the stream. */
static void h2s_grant(struct h2s *e)
{
    struct gs *st = e->st;
    uint64_t queued = e->q != NULL ? e->q->size : 0;
    uint64_t give = e->raw - e->granted - queued;
    if (give == 0 || e->q_end || e->failed || st->sock == NULL)
        return; /* after the end or an error: the client is to send no more on it */
    h2o_http2_conn_t *conn = st->sock->data;
    if (conn->state >= H2O_HTTP2_CONN_STATE_IS_CLOSING)
        return;
    e->granted += give;
    while (give > 0) {
        int32_t n = give > INT32_MAX ? INT32_MAX : (int32_t)give;
        h2o_http2_encode_window_update_frame(&conn->_write.buf, e->id, n);
        give -= (uint64_t)n;
    }
    h2o_http2_conn_request_write(conn);
}

static bool h2s_ready(const struct h2s *e)
{
    return e->want && e->cb != NULL && (e->failed || e->q_end || e->q->size > 0);
}

/* Hands e's next piece (or its end, or its error) to its pending read. */
static void h2s_give(struct h2s *e)
{
    sp_bodygate_body_cb cb = e->cb;
    void *arg = e->arg;
    e->cb = NULL;
    e->want = false;
    if (e->failed) {
        e->end_given = true; /* no read after an error */
        sp_err_t err = e->err;
        cb(arg, NULL, 0, false, &err);
        return;
    }
    size_t n = e->q->size < PIECE_MAX ? e->q->size : PIECE_MAX;
    if (n > 0) {
        memcpy(e->buf, e->q->bytes, n);
        h2o_buffer_consume(&e->q, n);
        h2_unqueued(e->st, n);
    }
    bool end = e->q_end && e->q->size == 0;
    e->end_given = end;
    h2s_grant(e);
    cb(arg, e->buf, n, end, NULL);
}

/* The deferred pass: every stream of the connection whose read can be answered is, one piece
 * each; a reader that asks again meanwhile is answered in the next pass. */
static void h2_deliver(void *arg)
{
    struct gs *st = arg;
    st->h2_deferred = false;
    st->holds--;
    unsigned n = 0;
    for (struct h2s *e = st->h2s; e != NULL; e = e->next)
        if (h2s_ready(e))
            n++;
    /* the callbacks may start or end streams: each one found again from the list's head */
    for (unsigned i = 0; i < n && st->g != NULL; i++) {
        struct h2s *e = st->h2s;
        while (e != NULL && !h2s_ready(e))
            e = e->next;
        if (e == NULL)
            break;
        st->holds++;
        h2s_give(e);
        st->holds--;
    }
    gs_free_if_done(st);
}

static void h2_on_tick(h2o_timeout_entry_t *entry)
{
    h2_deliver(H2O_STRUCT_FROM_MEMBER(struct gs, h2_tick, entry));
}

/* The pass runs on h2o's zero timeout, inside h2o's loop: a reader writes to an h2o socket
 * there (http/proxy.c), and h2o's evloop expects a write that completes at once to be
 * reported within its own pass, else a socket still polled for writing fires with no write
 * callback (h2o asserts). The loop's deferred calls run in that pass too (loop/loop.c), but
 * each costs a malloc and can fail; the entry here is the connection's own, so a pass, which
 * comes as often as DATA frames do, allocates nothing and cannot fail. */
static void h2_schedule(struct gs *st)
{
    if (st->h2_deferred || st->g == NULL || st->sock == NULL)
        return;
    h2o_http2_conn_t *conn = st->sock->data;
    st->h2_tick.cb = h2_on_tick;
    h2o_timeout_link(conn->super.ctx->loop, &conn->super.ctx->zero_timeout, &st->h2_tick);
    st->h2_deferred = true;
    st->holds++;
}

/* req's streamed HTTP/2 body, when it is one (NULL: not HTTP/2, not streamed, or gone). */
static struct h2s *h2s_of(h2o_req_t *req)
{
    if (req->version < 0x200 || req->conn->callbacks->get_socket == NULL)
        return NULL;
    h2o_socket_t *sock = req->conn->callbacks->get_socket(req->conn);
    if (sock == NULL || sock->on_close.cb != gs_on_close)
        return NULL;
    struct gs *st = sock->on_close.data;
    uint32_t id = H2O_STRUCT_FROM_MEMBER(h2o_http2_stream_t, req, req)->stream_id;
    struct h2s *e = h2s_find(st, id);
    return e != NULL && e->state == H2S_STREAMING && e->req == req ? e : NULL;
}

static struct gs *gs_of(h2o_req_t *req)
{
    if (req->version >= 0x200 || req->conn->callbacks->get_socket == NULL)
        return NULL;
    h2o_socket_t *sock = req->conn->callbacks->get_socket(req->conn);
    if (sock == NULL || sock->on_close.cb != gs_on_close)
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
    struct h2s *e = h2s_of(req);
    return e != NULL ? e->st : gs_of(req);
}

bool sp_bodygate_streamed(h2o_req_t *req, uint64_t *length, bool *chunked)
{
    struct h2s *e = h2s_of(req);
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
    gs_free_if_done(st);
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
    gs_free_if_done(st);
}

static void body_deferred(h2o_timeout_entry_t *entry)
{
    struct gs *st = H2O_STRUCT_FROM_MEMBER(struct gs, b_tick, entry);
    st->b.deferred = false;
    st->holds--;
    body_pump(st);
    gs_free_if_done(st);
}

int sp_bodygate_body_read(h2o_req_t *req, sp_bodygate_body_cb cb, void *arg)
{
    struct h2s *e = h2s_of(req);
    if (e != NULL) {
        if (e->st->g == NULL || e->st->sock == NULL || e->end_given || e->cb != NULL)
            return -1;
        if (e->buf == NULL && (e->buf = malloc(PIECE_MAX)) == NULL)
            return -1;
        e->cb = cb;
        e->arg = arg;
        e->want = true;
        if (h2s_ready(e))
            h2_schedule(e->st); /* else when its DATA comes */
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
         * h2o's loop, on an entry of the connection's own (h2_schedule says why) */
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
    struct h2s *e = h2s_of(req);
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
        struct h2s *e = h2s_of(c->req);
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
    gs_free_if_done(st);
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
    gs_free_if_done(st);
}

bool sp_bodygate_request(sp_bodygate_t *g, h2o_req_t *req, sp_bodygate_verdict_t *v)
{
    if (g == NULL || req->conn->callbacks->get_socket == NULL)
        return false;
    h2o_socket_t *sock = req->conn->callbacks->get_socket(req->conn);
    if (sock == NULL || sock->on_close.cb != gs_on_close)
        return false;
    struct gs *st = sock->on_close.data;
    if (req->version >= 0x200) { /* HTTP/2: one the gate ended is answered with its verdict */
        uint32_t id = H2O_STRUCT_FROM_MEMBER(h2o_http2_stream_t, req, req)->stream_id;
        struct h2s *e = h2s_find(st, id);
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
            size_t total = h2_cut(sock);
            h2o_http2_accept(ctx, sock, at);
            if (st->sock != NULL)
                h2_uncut(st, total);
            st->in_read = false;
            gs_free_if_done(st);
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
            if (st->sock->_cb.read == gate_on_read || st->sock->_cb.read == h2_on_read)
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
