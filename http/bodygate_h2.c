/*
 * bodygate_h2.c - the body gate on HTTP/2 connections (bodygate_int.h): the walk of each read's
 * frames before h2o reads them, and the DATA of streamed bodies queued and handed out.
 */
#include "http/bodygate_int.h"

#include <stdlib.h>
#include <string.h>

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

/* HTTP/2 streamed bodies (below) */
static void h2s_drop_body(struct h2s *e);
static void h2s_stream_start(struct h2s *e, h2o_http2_stream_t *s);
static size_t h2s_take(struct h2s *e, const uint8_t *f, size_t len);
static void h2s_ended_by_trailers(struct h2s *e);
static void h2s_count(const struct h2s *e);

struct h2s *sp_bodygate__h2s_find(struct gs *st, uint32_t id)
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
void sp_bodygate__h2s_free_all(struct gs *st)
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
    sp_bodygate__gs_free_if_done(st);
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
    sp_bodygate__ask(g, &h, &v);
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
    h2o_http2_encode_frame_header(f, 0, H2_HEADERS, H2_END_STREAM | H2_END_HEADERS, (int32_t)id);
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
            sp_bodygate__h2s_find(st, ids[i]) != NULL)
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
            struct h2s *e = sp_bodygate__h2s_find(st, id);
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
        struct h2s *e = sp_bodygate__h2s_find(st, id);
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

void sp_bodygate__h2_on_read(h2o_socket_t *sock, const char *err)
{
    struct gs *st = sock->on_close.data;
    st->in_read = true;
    if (err == NULL && st->g != NULL)
        h2_gate(st);
    else
        st->orig(sock, err);
    st->in_read = false;
    sp_bodygate__gs_free_if_done(st);
}

/* h2o has just taken sock as HTTP/2 (its read callback is HTTP/2's): the gate goes before it. */
static void h2_take(struct gs *st)
{
    st->orig = st->sock->_cb.read;
    st->sock->_cb.read = sp_bodygate__h2_on_read;
}

/* Before h2o takes a socket as HTTP/2 with input already read: the input is cut after the
 * preface (and one byte), so that h2o reads the preface alone; returns the input's size. */
size_t sp_bodygate__h2_cut(h2o_socket_t *sock)
{
    size_t total = sock->input->size;
    if (total > H2_PREFACE + 1)
        sock->input->size = H2_PREFACE + 1;
    return total;
}

/* After h2o read the cut input: the rest back; returns what h2o consumed. */
size_t sp_bodygate__h2_restore(h2o_socket_t *sock, size_t total)
{
    size_t shown = total > H2_PREFACE + 1 ? H2_PREFACE + 1 : total;
    size_t consumed = shown - sock->input->size;
    sock->input->size = total - consumed;
    return consumed;
}

/* After: the rest back, and the gate on what follows the preface. */
void sp_bodygate__h2_uncut(struct gs *st, size_t total)
{
    h2o_socket_t *sock = st->sock;
    st->h2_seen = sp_bodygate__h2_restore(sock, total) >= H2_PREFACE;
    h2_take(st);
    if (sock->input->size > 0 && st->h2_seen)
        h2_gate(st);
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
    sp_bodygate__count(e->end_given, e->got);
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

/* The end of the body came (END_STREAM on DATA, or trailers). */
static void h2s_body_ended(struct h2s *e)
{
    e->q_end = true;
    if (!e->chunked && e->got != e->cap)
        h2s_fail(e, SP_EINVAL, "request body is shorter than its content-length");
    if (e->want)
        sp_bodygate__h2_schedule(e->st);
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
        sp_bodygate__h2_schedule(e->st);
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

bool sp_bodygate__h2s_ready(const struct h2s *e)
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
        if (sp_bodygate__h2s_ready(e))
            n++;
    /* the callbacks may start or end streams: each one found again from the list's head */
    for (unsigned i = 0; i < n && st->g != NULL; i++) {
        struct h2s *e = st->h2s;
        while (e != NULL && !sp_bodygate__h2s_ready(e))
            e = e->next;
        if (e == NULL)
            break;
        st->holds++;
        h2s_give(e);
        st->holds--;
    }
    sp_bodygate__gs_free_if_done(st);
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
void sp_bodygate__h2_schedule(struct gs *st)
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
struct h2s *sp_bodygate__h2s_of(h2o_req_t *req)
{
    if (req->version < 0x200 || req->conn->callbacks->get_socket == NULL)
        return NULL;
    h2o_socket_t *sock = req->conn->callbacks->get_socket(req->conn);
    if (sock == NULL || sock->on_close.cb != sp_bodygate__gs_on_close)
        return NULL;
    struct gs *st = sock->on_close.data;
    uint32_t id = H2O_STRUCT_FROM_MEMBER(h2o_http2_stream_t, req, req)->stream_id;
    struct h2s *e = sp_bodygate__h2s_find(st, id);
    return e != NULL && e->state == H2S_STREAMING && e->req == req ? e : NULL;
}
