/*
 * stream.c - streamed responses for the data-plane routes (napi_int.h).
 *
 * Owns two buffers: the one h2o is writing (fly) and the one callers append to (pend). h2o
 * 2.2 wants each buffer kept until its proceed callback, and at most one h2o_send in flight,
 * so pend is swapped in on proceed. The raw byte count travelling with each buffer goes back
 * to the caller through on_sent once the client took it: that is when upstream credit may
 * be granted, so a slow client bounds what we hold. The final buffer is copied into the
 * request's pool, since this struct is freed at once and h2o may still be writing it.
 */
#include <stdlib.h>
#include <string.h>

#include "native-api/napi_int.h"

struct napi_stream {
    h2o_generator_t gen; /* first: h2o hands it back */
    h2o_req_t *req;
    napi_stream_cbs_t cbs;
    void *arg;
    char *pend, *fly;
    size_t pend_len, pend_cap, fly_cap;
    size_t pend_raw, fly_raw;
    bool flying; /* an h2o_send is waiting for proceed */
    bool ending, ok;
    int depth;   /* inside h2o_send or a callback */
    bool freed;  /* free once depth is 0 */
};

static void st_free(napi_stream_t *st)
{
    if (st->depth > 0) {
        st->freed = true;
        return;
    }
    free(st->pend);
    free(st->fly);
    free(st);
}

static void flush(napi_stream_t *st)
{
    if (st->flying || st->req == NULL || (st->pend_len == 0 && !st->ending))
        return;
    h2o_req_t *req = st->req;
    if (st->ending) {
        h2o_iovec_t buf = {NULL, 0};
        if (st->pend_len > 0) {
            buf.base = h2o_mem_alloc_pool(&req->pool, st->pend_len);
            memcpy(buf.base, st->pend, st->pend_len);
            buf.len = st->pend_len;
        }
        st->req = NULL;
        st->depth++;
        h2o_send(req, &buf, buf.len ? 1 : 0,
                 st->ok ? H2O_SEND_STATE_FINAL : H2O_SEND_STATE_ERROR);
        st->depth--;
        st_free(st);
        return;
    }
    char *t = st->fly;
    size_t tc = st->fly_cap;
    st->fly = st->pend;
    st->fly_cap = st->pend_cap;
    st->fly_raw = st->pend_raw;
    h2o_iovec_t buf = {st->fly, st->pend_len};
    st->pend = t;
    st->pend_cap = tc;
    st->pend_len = 0;
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
    napi_stream_t *st = (napi_stream_t *)gen;
    st->flying = false;
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
    napi_stream_t *st = (napi_stream_t *)gen;
    st->req = NULL;
    if (!st->ending && st->cbs.on_gone != NULL) {
        st->depth++;
        st->cbs.on_gone(st->arg);
        st->depth--;
    }
    st_free(st);
}

napi_stream_t *sp_napi__stream_start(h2o_req_t *req, int status, const char *content_type,
                                     long long content_length, const napi_stream_cbs_t *cbs,
                                     void *arg)
{
    napi_stream_t *st = calloc(1, sizeof(*st));
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

int sp_napi__stream_write(napi_stream_t *st, const void *p, size_t n, size_t raw)
{
    if (st->pend_len + n > st->pend_cap) {
        size_t cap = st->pend_cap ? st->pend_cap : 16384;
        while (cap < st->pend_len + n)
            cap *= 2;
        char *nb = realloc(st->pend, cap);
        if (nb == NULL)
            return -1;
        st->pend = nb;
        st->pend_cap = cap;
    }
    memcpy(st->pend + st->pend_len, p, n);
    st->pend_len += n;
    st->pend_raw += raw;
    flush(st);
    return 0;
}

void sp_napi__stream_end(napi_stream_t *st, bool ok)
{
    st->ending = true;
    st->ok = ok;
    flush(st); /* or on proceed, when a send is in flight */
}

napi_stream_t *sp_napi__ndjson_begin(napi_ctx_t *c, const sp_err_t *err,
                                     const napi_stream_cbs_t *cbs, void *arg)
{
    if (err != NULL) {
        sp_napi__fail(c, err);
        return NULL;
    }
    h2o_req_t *req = sp_napi__take(c);
    if (req == NULL)
        return NULL; /* the client left before the start */
    napi_stream_t *st = sp_napi__stream_start(req, 200, "application/x-ndjson", -1, cbs, arg);
    if (st == NULL)
        sp_http_error_code(req, SP_EINTERNAL, "out of memory");
    return st;
}
