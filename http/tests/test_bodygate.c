/*
 * test_bodygate.c - the body gate's head parser (sp_bodygate_parse) reads a head as h2o 2.2.5
 * does: picohttpparser's verdict (whole, more bytes, refused) on the same bytes, the last Host,
 * the first Content-Length read as h2o_strtosize reads it, any Transfer-Encoding as chunked; and
 * it fails closed where h2o would read on (a folded field line).
 */
#include <string.h>

#include "http/bodygate.h"
#include "tests/check.h"

static int parse(const char *s, sp_bodygate_head_t *h)
{
    size_t hl = 0;
    int r = sp_bodygate_parse(s, strlen(s), h, &hl);
    if (r == 1)
        CHECK(hl == strlen(s)); /* every case below is one whole head */
    return r;
}

static int is(const char *p, size_t n, const char *want)
{
    return n == strlen(want) && memcmp(p, want, n) == 0;
}

static void test_bodygate_fields_as_h2o_takes_them(void)
{
    static sp_bodygate_head_t h;
    CHECK(parse("PUT /v1/x?a=1 HTTP/1.1\r\nHost: a.example\r\nhost: b.example\r\n"
                "Content-Length: 12\r\ncontent-length: 99\r\nAuthorization: one\r\n"
                "Authorization: two\r\n\r\n",
                &h) == 1);
    CHECK(is(h.method, h.method_len, "PUT") && is(h.path, h.path_len, "/v1/x?a=1"));
    CHECK(is(h.host, h.host_len, "b.example")); /* h2o's authority: the last Host */
    CHECK(h.length == 12 && !h.chunked);        /* h2o's entity reader: the first */
    size_t n;
    const char *a = sp_bodygate_header(&h, "AUTHORIZATION", &n);
    CHECK(a != NULL && is(a, n, "one")); /* h2o_find_header: the first */
    CHECK(sp_bodygate_header(&h, "x-missing", &n) == NULL);
    /* Transfer-Encoding wins over Content-Length, wherever it is */
    CHECK(parse("POST / HTTP/1.1\r\nContent-Length: 5\r\nTransfer-Encoding: gzip\r\n\r\n", &h) ==
          1);
    CHECK(h.chunked && h.length == 0);
    /* no Host: "" */
    CHECK(parse("GET / HTTP/1.0\r\n\r\n", &h) == 1 && h.host_len == 0 && h.host != NULL);
}

static void test_bodygate_heads_h2o_reads(void)
{
    static sp_bodygate_head_t h;
    /* a minor version h2o reads as HTTP/1.1, one leading empty line, bare LFs */
    CHECK(parse("GET / HTTP/1.5\r\n\r\n", &h) == 1);
    CHECK(parse("\r\nGET / HTTP/1.1\r\n\r\n", &h) == 1);
    CHECK(parse("GET / HTTP/1.1\nHost: x\n\n", &h) == 1 && is(h.host, h.host_len, "x"));
    /* a head past 8 KiB (h2o reads up to H2O_MAX_REQLEN) */
    static char big[64 * 1024];
    strcpy(big, "GET / HTTP/1.1\r\nX-Pad: ");
    size_t o = strlen(big);
    memset(big + o, 'p', 40000);
    strcpy(big + o + 40000, "\r\n\r\n");
    CHECK(parse(big, &h) == 1);
    /* incomplete: more bytes */
    size_t hl;
    CHECK(sp_bodygate_parse("GET / HTTP/1.1\r\nHost: x\r\n", 25, &h, &hl) == 0);
    CHECK(sp_bodygate_parse("GET / HTT", 9, &h, &hl) == 0);
}

static void test_bodygate_refuses_what_h2o_refuses_or_keeps_folded(void)
{
    static sp_bodygate_head_t h;
    CHECK(parse("GET / HTTP/1.1\r\nX-A: b\r\n c\r\n\r\n", &h) == -1); /* folded */
    CHECK(parse("\r\n\r\nGET / HTTP/1.1\r\n\r\n", &h) == -1);         /* two empty lines */
    CHECK(parse("GET / HTTP/2.0\r\n\r\n", &h) == -1);                 /* not HTTP/1 */
    CHECK(parse("GET / HTTP/1.1\r\nBad Name: x\r\n\r\n", &h) == -1);  /* not a token */
    CHECK(parse("GET / HTTP/1.1\r\nX: a\x01"
                "b\r\n\r\n",
                &h) == -1);                                                  /* control byte */
    CHECK(parse("POST / HTTP/1.1\r\nContent-Length: 5 \r\n\r\n", &h) == -1); /* h2o's 400 */
    CHECK(parse("POST / HTTP/1.1\r\nContent-Length: -5\r\n\r\n", &h) == -1);
    CHECK(parse("POST / HTTP/1.1\r\nContent-Length: \r\n\r\n", &h) == -1);
    CHECK(parse("POST / HTTP/1.1\r\nContent-Length: 12345678901234567890\r\n\r\n", &h) == -1);
    CHECK(parse("POST / HTTP/1.1\r\nContent-Length: 1234567890123456789\r\n\r\n", &h) == 1 &&
          h.length == 1234567890123456789ull);
    /* more fields than h2o takes */
    static char many[8192];
    strcpy(many, "GET / HTTP/1.1\r\n");
    for (int i = 0; i <= SP_BODYGATE_MAX_FIELDS; i++)
        strcat(many, "X: y\r\n");
    strcat(many, "\r\n");
    CHECK(parse(many, &h) == -1);
}

int main(void)
{
    test_bodygate_fields_as_h2o_takes_them();
    test_bodygate_heads_h2o_reads();
    test_bodygate_refuses_what_h2o_refuses_or_keeps_folded();
    return check_report("bodygate");
}
