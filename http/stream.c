/*
 * stream.c - streamed response bodies (stream.h).
 *
 * Owns two buffers: the one h2o is writing (fly) and the one writes append to (pend). h2o 2.2
 * wants a buffer kept until its proceed callback, and at most one h2o_send in flight, so pend
 * is swapped in on proceed. The raw count travelling with each buffer goes back through
 * on_sent once h2o calls proceed for it. The last buffer is copied into the request's pool,
 * since this struct is freed at once and h2o may still be writing it.
 */
#include "http/stream.h"

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "base/buf.h"

struct sp_stream {
    h2o_generator_t gen; /* first: h2o hands it back */
    h2o_req_t *req;      /* NULL once the client left or the end was sent */
    sp_stream_cbs_t cbs;
    void *arg;
    sp_buf_t pend, fly;
    size_t pend_raw, fly_raw;
    bool flying; /* an h2o_send waits for proceed */
    bool ending, ok;
    int depth;  /* inside h2o_send or a callback */
    bool freed; /* free once depth is 0 */
};

static void st_free(sp_stream_t *st)
{
    if (st->depth > 0) {
        st->freed = true;
        return;
    }
    sp_buf_free(&st->pend);
    sp_buf_free(&st->fly);
    free(st);
}

static void flush(sp_stream_t *st)
{
    if (st->flying || st->req == NULL || (st->pend.len == 0 && !st->ending))
        return;
    h2o_req_t *req = st->req;
    if (st->ending) {
        h2o_iovec_t buf = {NULL, 0};
        if (st->pend.len > 0) {
            buf.base = h2o_mem_alloc_pool(&req->pool, st->pend.len);
            memcpy(buf.base, st->pend.p, st->pend.len);
            buf.len = st->pend.len;
        }
        st->req = NULL;
        st->depth++;
        h2o_send(req, &buf, buf.len ? 1 : 0, st->ok ? H2O_SEND_STATE_FINAL : H2O_SEND_STATE_ERROR);
        st->depth--;
        st_free(st);
        return;
    }
    sp_buf_t t = st->fly; /* emptied on proceed: its memory is kept for reuse */
    st->fly = st->pend;
    st->fly_raw = st->pend_raw;
    h2o_iovec_t buf = {(char *)st->fly.p, st->fly.len};
    st->pend = t;
    st->pend_raw = 0;
    st->flying = true;
    st->depth++;
    h2o_send(req, &buf, 1, H2O_SEND_STATE_IN_PROGRESS);
    st->depth--;
    if (st->freed)
        st_free(st);
}

static void on_proceed(h2o_generator_t *gen, h2o_req_t *req)
{
    sp_stream_t *st = (sp_stream_t *)gen;
    st->flying = false;
    sp_buf_reset(&st->fly);
    size_t raw = st->fly_raw;
    st->fly_raw = 0;
    if (raw > 0 && !st->ending && st->cbs.on_sent != NULL) {
        st->depth++;
        st->cbs.on_sent(st->arg, raw);
        st->depth--;
        if (st->freed) {
            st_free(st);
            return;
        }
    }
    flush(st);
}

static void on_stop(h2o_generator_t *gen, h2o_req_t *req)
{
    sp_stream_t *st = (sp_stream_t *)gen;
    st->req = NULL;
    if (!st->ending && st->cbs.on_gone != NULL) {
        st->depth++;
        st->cbs.on_gone(st->arg);
        st->depth--;
    }
    st_free(st);
}

sp_stream_t *sp_stream_start(h2o_req_t *req, int status, const char *content_type,
                             long long content_length, const sp_stream_cbs_t *cbs, void *arg)
{
    sp_stream_t *st = calloc(1, sizeof(*st));
    if (st == NULL)
        return NULL;
    st->gen.proceed = on_proceed;
    st->gen.stop = on_stop;
    st->req = req;
    st->cbs = *cbs;
    st->arg = arg;
    req->res.status = status;
    req->res.reason = status < 300 ? "OK" : "Error";
    if (content_length >= 0)
        req->res.content_length = (size_t)content_length;
    h2o_add_header(&req->pool, &req->res.headers, H2O_TOKEN_CONTENT_TYPE, NULL, content_type,
                   strlen(content_type));
    h2o_add_header(&req->pool, &req->res.headers, H2O_TOKEN_CACHE_CONTROL, NULL,
                   H2O_STRLIT("no-store"));
    h2o_start_response(req, &st->gen);
    return st;
}

/* Appends to pend; -1 when memory ran out (pend is then unusable: the stream ends in error). */
static int append(sp_stream_t *st, const void *p, size_t n)
{
    sp_buf_add(&st->pend, p, n);
    return st->pend.oom ? -1 : 0;
}

int sp_stream_write(sp_stream_t *st, const void *p, size_t n, size_t raw)
{
    if (append(st, p, n) < 0)
        return -1;
    st->pend_raw += raw;
    flush(st);
    return 0;
}

size_t sp_stream_pending(const sp_stream_t *st)
{
    return st->pend.len + st->fly.len;
}

void sp_stream_end(sp_stream_t *st, const void *tail, size_t n, bool ok)
{
    st->ending = true;
    st->ok = ok && append(st, tail, n) == 0; /* joins the final h2o_send */
    flush(st);                               /* or on proceed, when a send is in flight */
}

int sp_stream_sink_write(void *st, const uint8_t *p, size_t n)
{
    return sp_stream_write(st, p, n, n);
}

void sp_stream_sink_end(void *st, bool ok)
{
    sp_stream_end(st, NULL, 0, ok);
}
