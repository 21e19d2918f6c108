/*
 * http.c - shared HTTP helpers on h2o 2.2.
 */
#include "http/http.h"
#include "http/json.h"

#include <stdlib.h>
#include <string.h>

#include "base/text.h"

struct sp_http_hold {
    h2o_req_t *req;
    struct sp_http_hold **slot; /* in req->pool; cleared when we release first */
    char user[];
};

static void on_pool_dispose(void *p)
{
    struct sp_http_hold **slot = p;
    if (*slot != NULL)
        (*slot)->req = NULL; /* the client left: the completion must not reply */
}

sp_http_hold_t *sp_http_hold(h2o_req_t *req, size_t user_size)
{
    sp_http_hold_t *h = calloc(1, sizeof(*h) + user_size);
    if (h == NULL)
        return NULL;
    h->req = req;
    h->slot = h2o_mem_alloc_shared(&req->pool, sizeof(*h->slot), on_pool_dispose);
    *h->slot = h;
    return h;
}

void *sp_http_hold_user(sp_http_hold_t *h)
{
    return h->user;
}

h2o_req_t *sp_http_hold_req(sp_http_hold_t *h)
{
    return h->req;
}

h2o_req_t *sp_http_release(sp_http_hold_t *h)
{
    h2o_req_t *req = h->req;
    if (req != NULL)
        *h->slot = NULL;
    free(h);
    return req;
}

void sp_http_json(h2o_req_t *req, int status, json_t *obj)
{
    /* One buffer for every response (the loop is one thread), freed when a big one grew it. */
    static sp_buf_t out = SP_BUF_INIT;
    sp_buf_reset(&out);
    bool ok = sp_json_write(&out, obj) == 0;
    json_decref(obj);
    req->res.status = status;
    req->res.reason = status < 300 ? "OK" : "Error";
    h2o_add_header(&req->pool, &req->res.headers, H2O_TOKEN_CONTENT_TYPE, NULL,
                   H2O_STRLIT("application/json"));
    sp_buf_add(&out, "\n", 1);
    if (!ok || out.oom) {
        req->res.status = 500;
        static const char fallback[] =
            "{\"error\":{\"code\":\"internal\",\"message\":\"cannot encode response\"}}";
        h2o_send_inline(req, fallback, sizeof(fallback) - 1);
    } else {
        h2o_send_inline(req, (const char *)out.p, out.len); /* copied into the request's pool */
    }
    if (out.cap > (1u << 20))
        sp_buf_free(&out);
}

void sp_http_json_text(h2o_req_t *req, int status, sp_buf_t *body)
{
    req->res.status = status;
    req->res.reason = status < 300 ? "OK" : "Error";
    h2o_add_header(&req->pool, &req->res.headers, H2O_TOKEN_CONTENT_TYPE, NULL,
                   H2O_STRLIT("application/json"));
    sp_buf_add(body, "\n", 1);
    if (body->oom) {
        req->res.status = 500;
        static const char fallback[] =
            "{\"error\":{\"code\":\"internal\",\"message\":\"cannot encode response\"}}";
        h2o_send_inline(req, fallback, sizeof(fallback) - 1);
    } else {
        h2o_send_inline(req, (const char *)body->p, body->len); /* copied into the request's pool */
    }
}

void sp_http_error(h2o_req_t *req, const sp_err_t *err)
{
    json_t *o = json_pack("{s:{s:s,s:s}}", "error", "code", sp_err_name(err->code), "message",
                          err->msg);
    sp_http_json(req, sp_err_http_status(err->code), o);
}

void sp_http_error_code(h2o_req_t *req, sp_code_t code, const char *msg)
{
    sp_err_t e;
    sp_err_set(&e, code, "%s", msg);
    sp_http_error(req, &e);
}

int sp_http_pct_decode(const char *src, size_t len, char *dst)
{
    size_t o = 0;
    for (size_t i = 0; i < len; i++) {
        char c = src[i];
        if (c == '%') {
            if (i + 2 >= len)
                return -1;
            int hi = sp_text_hexval(src[i + 1]), lo = sp_text_hexval(src[i + 2]);
            if (hi < 0 || lo < 0)
                return -1;
            c = (char)(hi * 16 + lo);
            i += 2;
        } else if (c == '+') {
            c = ' ';
        }
        if (c == '\0')
            return -1;
        dst[o++] = c;
    }
    dst[o] = '\0';
    return 0;
}

const char *sp_http_query(h2o_req_t *req, const char *name)
{
    if (req->query_at == SIZE_MAX)
        return NULL;
    const char *q = req->path.base + req->query_at + 1;
    const char *end = req->path.base + req->path.len;
    size_t nl = strlen(name);
    while (q < end) {
        const char *amp = memchr(q, '&', (size_t)(end - q));
        const char *pe = amp ? amp : end;
        const char *eq = memchr(q, '=', (size_t)(pe - q));
        const char *ke = eq ? eq : pe;
        if ((size_t)(ke - q) == nl && memcmp(q, name, nl) == 0) {
            const char *v = eq ? eq + 1 : pe;
            size_t vl = (size_t)(pe - v);
            char *out = h2o_mem_alloc_pool(&req->pool, vl + 1);
            if (sp_http_pct_decode(v, vl, out) < 0)
                return NULL;
            return out;
        }
        q = pe + 1;
    }
    return NULL;
}

const char *sp_http_header(h2o_req_t *req, const char *lname)
{
    size_t nl = strlen(lname);
    for (size_t i = 0; i < req->headers.size; i++) {
        h2o_header_t *h = &req->headers.entries[i];
        if (h->name->len == nl && h2o_lcstris(h->name->base, h->name->len, lname, nl)) {
            char *out = h2o_mem_alloc_pool(&req->pool, h->value.len + 1);
            memcpy(out, h->value.base, h->value.len);
            out[h->value.len] = '\0';
            return out;
        }
    }
    return NULL;
}

int sp_http_segments(h2o_req_t *req, const char **segs, int max)
{
    size_t len = req->query_at != SIZE_MAX ? req->query_at : req->path.len;
    const char *p = req->path.base, *end = p + len;
    int n = 0;
    while (p < end) {
        while (p < end && *p == '/')
            p++;
        if (p >= end)
            break;
        const char *s = p;
        while (p < end && *p != '/')
            p++;
        if (n == max)
            return -1;
        char *seg = h2o_mem_alloc_pool(&req->pool, (size_t)(p - s) + 1);
        if (sp_http_pct_decode(s, (size_t)(p - s), seg) < 0)
            return -1;
        segs[n++] = seg;
    }
    return n;
}

bool sp_http_method_is(h2o_req_t *req, const char *m)
{
    return h2o_memis(req->method.base, req->method.len, m, strlen(m));
}
