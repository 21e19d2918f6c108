/*
 * fuzz_http1.c - libFuzzer target over the HTTP/1.1 request framing
 * (core/egress/http1.h).
 *
 * The first byte picks the head limit and a split point. Each input is read as
 * a stream of requests, the way the proxy and the credential relay read a
 * connection: head, then its body (Content-Length or chunked), then the next
 * head. Checked on the way: every piece the parser hands back lies inside the
 * input, a head is never longer than the limit, a head read from a prefix is
 * either incomplete or the same verdict as from the whole, and a chunked body
 * scanned in two pieces ends where it ends when scanned whole.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "core/egress/http1.h"
#include "tests/fuzz.h"

static void inside(const uint8_t *base, size_t n, sp_http1_str_t s)
{
    if (s.p == NULL)
        return;
    ASSERT((const uint8_t *)s.p >= base && (const uint8_t *)s.p + s.n <= base + n);
}

static void check_req(const uint8_t *p, size_t n, size_t max, const sp_http1_req_t *r)
{
    ASSERT(r->head_len >= 4 && r->head_len <= n && r->head_len <= max);
    ASSERT(memcmp(p + r->head_len - 4, "\r\n\r\n", 4) == 0);
    inside(p, n, r->line);
    inside(p, n, r->method);
    inside(p, n, r->target);
    inside(p, n, r->scheme);
    inside(p, n, r->authority);
    inside(p, n, r->path);
    inside(p, n, r->host);
    for (size_t i = 0; i < r->nfields; i++) {
        inside(p, n, r->fields[i].name);
        inside(p, n, r->fields[i].value);
        inside(p, n, r->fields[i].line);
    }
    ASSERT(r->body != SP_HTTP1_BODY_LENGTH || r->length > 0);
    sp_http1_authority_t a;
    if (r->authority.p != NULL && sp_http1_authority(r->authority.p, r->authority.n, &a) == 0)
        inside(p, n, a.host);
    if (r->host.p != NULL && sp_http1_authority(r->host.p, r->host.n, &a) == 0)
        inside(p, n, a.host);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    if (size < 1)
        return 0;
    static const size_t limits[] = {64, 512, 16384, 65536};
    size_t max = limits[data[0] & 3];
    size_t splitter = data[0] >> 2;
    const uint8_t *p = data + 1;
    size_t n = size - 1;
    static sp_http1_field_t f[SP_HTTP1_MAX_FIELDS];
    for (int reqs = 0; reqs < 64 && n > 0; reqs++) {
        sp_http1_req_t r;
        int rc = sp_http1_parse_head(p, n, max, f, SP_HTTP1_MAX_FIELDS, &r);
        ASSERT(rc >= -1 && rc <= 1);
        if (rc < 0)
            ASSERT(r.why != NULL && r.status >= 400 && r.status <= 505);
        /* A prefix says "not yet" or the same as the whole. */
        size_t cut = n * splitter / 64;
        sp_http1_req_t r2;
        int rc2 = sp_http1_parse_head(p, cut, max, f, SP_HTTP1_MAX_FIELDS, &r2);
        ASSERT(rc2 == 0 || rc2 == rc);
        if (rc2 == 1)
            ASSERT(r2.head_len == r.head_len);
        rc = sp_http1_parse_head(p, n, max, f, SP_HTTP1_MAX_FIELDS, &r);
        if (rc != 1)
            return 0;
        check_req(p, n, max, &r);
        p += r.head_len;
        n -= r.head_len;
        if (r.connect || r.upgrade)
            return 0; /* a tunnel: the rest is not HTTP */
        if (r.body == SP_HTTP1_BODY_LENGTH) {
            if (r.length >= n)
                return 0;
            p += r.length;
            n -= (size_t)r.length;
        } else if (r.body == SP_HTTP1_BODY_CHUNKED) {
            sp_http1_chunked_t whole, parts;
            sp_http1_chunked_init(&whole);
            sp_http1_chunked_init(&parts);
            size_t uw = 0, u1 = 0, u2 = 0;
            const char *why = NULL;
            int cw = sp_http1_chunked_scan(&whole, p, n, &uw, &why);
            ASSERT(uw <= n && (cw >= 0 || why != NULL));
            size_t s = n * splitter / 64;
            int cp = sp_http1_chunked_scan(&parts, p, s, &u1, &why);
            if (cp == 0)
                cp = sp_http1_chunked_scan(&parts, p + s, n - s, &u2, &why);
            ASSERT(cp == cw && u1 + u2 == uw);
            if (cw != 1)
                return 0;
            p += uw;
            n -= uw;
        }
    }
    return 0;
}
