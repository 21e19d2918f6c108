/*
 * test_http1.c - HTTP/1.1 request framing (core/egress/http1.h): the
 * request-smuggling table (each input with the verdict, status and framing both
 * the proxy and the credential relay act on), then request forms, authorities
 * and chunked bodies fed in every split.
 */
#include <stdio.h>
#include <string.h>

#include "core/egress/http1.h"
#include "tests/check.h"

#define MAXH 16384

struct hcase {
    const char *name;
    const char *in;
    int rc;     /* 1 complete, 0 needs more, -1 refused */
    int status; /* refused: the status */
    sp_http1_body_t body;
    uint64_t length;
};

static const struct hcase smuggling[] = {
    {"plain GET", "GET http://a.test/ HTTP/1.1\r\nHost: a.test\r\n\r\n", 1, 0, SP_HTTP1_BODY_NONE,
     0},
    {"CL", "POST / HTTP/1.1\r\nContent-Length: 5\r\n\r\nhello", 1, 0, SP_HTTP1_BODY_LENGTH, 5},
    {"CL zero", "POST / HTTP/1.1\r\nContent-Length: 0\r\n\r\n", 1, 0, SP_HTTP1_BODY_NONE, 0},
    {"TE chunked", "POST / HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n", 1, 0,
     SP_HTTP1_BODY_CHUNKED, 0},
    {"TE chunked any case", "POST / HTTP/1.1\r\ntransfer-encoding: ChUnKeD\r\n\r\n", 1, 0,
     SP_HTTP1_BODY_CHUNKED, 0},
    {"CL+TE",
     "POST / HTTP/1.1\r\nContent-Length: 3\r\nTransfer-Encoding: "
     "chunked\r\n\r\n",
     -1, 400, 0, 0},
    {"TE+CL",
     "POST / HTTP/1.1\r\nTransfer-Encoding: chunked\r\nContent-Length: "
     "3\r\n\r\n",
     -1, 400, 0, 0},
    {"TE gzip", "POST / HTTP/1.1\r\nTransfer-Encoding: gzip\r\n\r\n", -1, 501, 0, 0},
    {"TE gzip, chunked", "POST / HTTP/1.1\r\nTransfer-Encoding: gzip, chunked\r\n\r\n", -1, 501, 0,
     0},
    {"TE gzip then chunked fields",
     "POST / HTTP/1.1\r\nTransfer-Encoding: gzip\r\nTransfer-Encoding: "
     "chunked\r\n\r\n",
     -1, 501, 0, 0},
    {"TE chunked, gzip (not last)", "POST / HTTP/1.1\r\nTransfer-Encoding: chunked, gzip\r\n\r\n",
     -1, 400, 0, 0},
    {"TE chunked twice in a list", "POST / HTTP/1.1\r\nTransfer-Encoding: chunked, chunked\r\n\r\n",
     -1, 400, 0, 0},
    {"TE chunked twice in two fields",
     "POST / HTTP/1.1\r\nTransfer-Encoding: chunked\r\nTransfer-Encoding: "
     "chunked\r\n\r\n",
     -1, 400, 0, 0},
    {"TE chunked with a parameter", "POST / HTTP/1.1\r\nTransfer-Encoding: chunked;q=1\r\n\r\n", -1,
     501, 0, 0},
    {"TE empty", "POST / HTTP/1.1\r\nTransfer-Encoding: \r\n\r\n", -1, 400, 0, 0},
    {"TE in HTTP/1.0", "POST / HTTP/1.0\r\nTransfer-Encoding: chunked\r\n\r\n", -1, 400, 0, 0},
    {"TE xchunked", "POST / HTTP/1.1\r\nTransfer-Encoding: xchunked\r\n\r\n", -1, 501, 0, 0},
    {"TE name with space before colon", "POST / HTTP/1.1\r\nTransfer-Encoding : chunked\r\n\r\n",
     -1, 400, 0, 0},
    {"CL duplicate agreeing", "POST / HTTP/1.1\r\nContent-Length: 5\r\nContent-Length: 5\r\n\r\n",
     1, 0, SP_HTTP1_BODY_LENGTH, 5},
    {"CL duplicate, same number",
     "POST / HTTP/1.1\r\nContent-Length: 5\r\nContent-Length: 05\r\n\r\n", 1, 0,
     SP_HTTP1_BODY_LENGTH, 5},
    {"CL conflicting", "POST / HTTP/1.1\r\nContent-Length: 5\r\nContent-Length: 6\r\n\r\n", -1, 400,
     0, 0},
    {"CL list", "POST / HTTP/1.1\r\nContent-Length: 5, 5\r\n\r\n", -1, 400, 0, 0},
    {"CL plus sign", "POST / HTTP/1.1\r\nContent-Length: +5\r\n\r\n", -1, 400, 0, 0},
    {"CL minus sign", "POST / HTTP/1.1\r\nContent-Length: -5\r\n\r\n", -1, 400, 0, 0},
    {"CL inner space", "POST / HTTP/1.1\r\nContent-Length: 1 2\r\n\r\n", -1, 400, 0, 0},
    {"CL surrounding space is OWS", "POST / HTTP/1.1\r\nContent-Length: \t 7 \t\r\n\r\n", 1, 0,
     SP_HTTP1_BODY_LENGTH, 7},
    {"CL hex", "POST / HTTP/1.1\r\nContent-Length: 0x10\r\n\r\n", -1, 400, 0, 0},
    {"CL empty", "POST / HTTP/1.1\r\nContent-Length:\r\n\r\n", -1, 400, 0, 0},
    {"CL 19 digits", "POST / HTTP/1.1\r\nContent-Length: 1000000000000000000\r\n\r\n", -1, 400, 0,
     0},
    {"CL 18 digits", "POST / HTTP/1.1\r\nContent-Length: 999999999999999999\r\n\r\n", 1, 0,
     SP_HTTP1_BODY_LENGTH, 999999999999999999ull},
    {"bare LF line ends", "GET / HTTP/1.1\nHost: a\n\n", -1, 400, 0, 0},
    {"bare LF in one field", "GET / HTTP/1.1\r\nHost: a\nX: b\r\n\r\n", -1, 400, 0, 0},
    {"bare LF as the blank line", "GET / HTTP/1.1\r\nHost: a\r\n\n", -1, 400, 0, 0},
    {"bare LF before the end arrives", "GET / HTTP/1.1\nHost", -1, 400, 0, 0},
    {"bare CR in a value", "GET / HTTP/1.1\r\nX: a\rb\r\n\r\n", -1, 400, 0, 0},
    {"obs-fold", "GET / HTTP/1.1\r\nX: a\r\n folded\r\n\r\n", -1, 400, 0, 0},
    {"obs-fold with tab", "GET / HTTP/1.1\r\nX: a\r\n\tfolded\r\n\r\n", -1, 400, 0, 0},
    {"first field folded", "GET / HTTP/1.1\r\n X: a\r\n\r\n", -1, 400, 0, 0},
    {"NUL in a value", "GET / HTTP/1.1\r\nX: a\0b\r\n\r\n", -1, 400, 0, 0},
    {"control byte in a value",
     "GET / HTTP/1.1\r\nX: a\x01"
     "b\r\n\r\n",
     -1, 400, 0, 0},
    {"DEL in a value", "GET / HTTP/1.1\r\nX: a\x7f\r\n\r\n", -1, 400, 0, 0},
    {"tab and obs-text in a value", "GET / HTTP/1.1\r\nX: a\tb\xc3\xa9\r\n\r\n", 1, 0,
     SP_HTTP1_BODY_NONE, 0},
    {"NUL in a name", "GET / HTTP/1.1\r\nX\0Y: a\r\n\r\n", -1, 400, 0, 0},
    {"no colon", "GET / HTTP/1.1\r\nX a\r\n\r\n", -1, 400, 0, 0},
    {"empty name", "GET / HTTP/1.1\r\n: a\r\n\r\n", -1, 400, 0, 0},
    {"two Host fields", "GET / HTTP/1.1\r\nHost: a\r\nHost: b\r\n\r\n", -1, 400, 0, 0},
    {"two Host fields, same value", "GET / HTTP/1.1\r\nHost: a\r\nhost: a\r\n\r\n", -1, 400, 0, 0},
    {"HTTP/2.0", "GET / HTTP/2.0\r\n\r\n", -1, 505, 0, 0},
    {"HTTP/1.2", "GET / HTTP/1.2\r\n\r\n", -1, 505, 0, 0},
    {"lower-case version", "GET / http/1.1\r\n\r\n", -1, 400, 0, 0},
    {"two spaces", "GET  / HTTP/1.1\r\n\r\n", -1, 400, 0, 0},
    {"space in the target", "GET /a b HTTP/1.1\r\n\r\n", -1, 400, 0, 0},
    {"tab as separator", "GET\t/ HTTP/1.1\r\n\r\n", -1, 400, 0, 0},
    {"control byte in the target", "GET /\x01 HTTP/1.1\r\n\r\n", -1, 400, 0, 0},
    {"TLS bytes", "\x16\x03\x01\x02\x00garbage\r\n\r\n", -1, 400, 0, 0},
    {"leading empty lines skipped", "\r\n\r\nGET / HTTP/1.1\r\n\r\n", 1, 0, SP_HTTP1_BODY_NONE, 0},
    {"not complete", "GET / HTTP/1.1\r\nHost: a\r\n", 0, 0, 0, 0},
    {"not complete, CR last", "GET / HTTP/1.1\r\nHost: a\r\n\r", 0, 0, 0, 0},
    {"empty", "", 0, 0, 0, 0},
    {"CONNECT", "CONNECT a.test:443 HTTP/1.1\r\nHost: a.test:443\r\n\r\n", 1, 0, SP_HTTP1_BODY_NONE,
     0},
    {"CONNECT without port", "CONNECT a.test HTTP/1.1\r\n\r\n", -1, 400, 0, 0},
    {"CONNECT port too big", "CONNECT a.test:99999 HTTP/1.1\r\n\r\n", -1, 400, 0, 0},
    {"CONNECT origin-form", "CONNECT / HTTP/1.1\r\n\r\n", -1, 400, 0, 0},
    {"asterisk for GET", "GET * HTTP/1.1\r\n\r\n", -1, 400, 0, 0},
    {"relative without slash", "GET foo HTTP/1.1\r\n\r\n", -1, 400, 0, 0},
};

static void test_http1_smuggling_table(void)
{
    sp_http1_field_t f[SP_HTTP1_MAX_FIELDS];
    for (size_t i = 0; i < sizeof(smuggling) / sizeof(smuggling[0]); i++) {
        const struct hcase *c = &smuggling[i];
        size_t n = strlen(c->in);
        /* The NUL cases: the literal's length, not strlen. */
        if (strcmp(c->name, "NUL in a value") == 0)
            n = sizeof("GET / HTTP/1.1\r\nX: a\0b\r\n\r\n") - 1;
        if (strcmp(c->name, "NUL in a name") == 0)
            n = sizeof("GET / HTTP/1.1\r\nX\0Y: a\r\n\r\n") - 1;
        if (strcmp(c->name, "TLS bytes") == 0)
            n = sizeof("\x16\x03\x01\x02\x00garbage\r\n\r\n") - 1;
        sp_http1_req_t r;
        int rc = sp_http1_parse_head(c->in, n, MAXH, f, SP_HTTP1_MAX_FIELDS, &r);
        bool ok = rc == c->rc;
        if (ok && rc < 0)
            ok = r.status == c->status && r.why != NULL;
        if (ok && rc == 1)
            ok = r.body == c->body && (c->body != SP_HTTP1_BODY_LENGTH || r.length == c->length);
        if (!ok)
            fprintf(stderr, "case '%s': rc=%d status=%d why=%s body=%d\n", c->name, rc, r.status,
                    r.why ? r.why : "-", (int)r.body);
        CHECK(ok);
    }
}

/* The head ends where it ends: a second request right behind it is not part of
 * it. */
static void test_http1_pipelined_second_request(void)
{
    const char *in = "POST http://a.test/x HTTP/1.1\r\nHost: "
                     "a.test\r\nContent-Length: 3\r\n\r\n"
                     "abcGET http://b.test/ HTTP/1.1\r\nHost: b.test\r\n\r\n";
    sp_http1_field_t f[8];
    sp_http1_req_t r;
    CHECK(sp_http1_parse_head(in, strlen(in), MAXH, f, 8, &r) == 1);
    const char *second = strstr(in, "abcGET") + 3;
    CHECK(r.head_len + r.length == (size_t)(second - in));
    sp_http1_req_t r2;
    CHECK(sp_http1_parse_head(second, strlen(second), MAXH, f, 8, &r2) == 1);
    CHECK(r2.host.n == 6 && memcmp(r2.host.p, "b.test", 6) == 0);
    CHECK(r2.head_len == strlen(second));
}

/* Absolute form with another Host: both are reported, nothing refused. */
static void test_http1_absolute_form_other_host(void)
{
    const char *in = "GET http://a.test:8080/p/q?x=1#frag HTTP/1.1\r\nHost: b.test\r\n\r\n";
    sp_http1_field_t f[8];
    sp_http1_req_t r;
    CHECK(sp_http1_parse_head(in, strlen(in), MAXH, f, 8, &r) == 1);
    CHECK(r.form == SP_HTTP1_ABSOLUTE);
    CHECK(r.scheme.n == 4 && memcmp(r.scheme.p, "http", 4) == 0);
    CHECK(r.authority.n == 11 && memcmp(r.authority.p, "a.test:8080", 11) == 0);
    CHECK(r.path.n == 8 && memcmp(r.path.p, "/p/q?x=1", 8) == 0);
    CHECK(r.host.n == 6 && memcmp(r.host.p, "b.test", 6) == 0);
    CHECK(r.nfields == 1 && sp_http1_field_is(&f[0], "HOST"));
    CHECK(r.minor == 1 && r.method.n == 3);
    /* No path, no Host. */
    const char *in2 = "GET http://a.test HTTP/1.0\r\n\r\n";
    CHECK(sp_http1_parse_head(in2, strlen(in2), MAXH, f, 8, &r) == 1);
    CHECK(r.path.n == 0 && r.host.p == NULL && r.minor == 0);
    CHECK(r.authority.n == 6);
    /* The other forms. */
    const char *in3 = "OPTIONS * HTTP/1.1\r\n\r\n";
    CHECK(sp_http1_parse_head(in3, strlen(in3), MAXH, f, 8, &r) == 1 &&
          r.form == SP_HTTP1_ASTERISK);
    const char *in4 = "CONNECT [::1]:443 HTTP/1.1\r\n\r\n";
    CHECK(sp_http1_parse_head(in4, strlen(in4), MAXH, f, 8, &r) == 1 &&
          r.form == SP_HTTP1_AUTHORITY && r.connect && r.authority.n == 9);
    const char *in5 = "GET /a?b HTTP/1.1\r\nHost: x\r\n\r\n";
    CHECK(sp_http1_parse_head(in5, strlen(in5), MAXH, f, 8, &r) == 1 && r.form == SP_HTTP1_ORIGIN);
}

/* Limits: the head size and the field count. */
static void test_http1_huge_headers(void)
{
    static char big[40000];
    int n = snprintf(big, sizeof(big), "GET / HTTP/1.1\r\nX: ");
    memset(big + n, 'a', 20000);
    memcpy(big + n + 20000, "\r\n\r\n", 5);
    sp_http1_field_t f[4];
    sp_http1_req_t r;
    CHECK(sp_http1_parse_head(big, strlen(big), MAXH, f, 4, &r) == -1 && r.status == 431);
    /* Incomplete but already past the limit: refused without waiting. */
    CHECK(sp_http1_parse_head(big, MAXH, MAXH, f, 4, &r) == -1 && r.status == 431);
    CHECK(sp_http1_parse_head(big, MAXH - 1, MAXH, f, 4, &r) == 0);
    /* The same head under a larger limit. */
    CHECK(sp_http1_parse_head(big, strlen(big), 64 * 1024, f, 4, &r) == 1);
    /* Exactly at the limit is fine. */
    const char *in = "GET / HTTP/1.1\r\n\r\n";
    CHECK(sp_http1_parse_head(in, strlen(in), strlen(in), f, 4, &r) == 1);
    CHECK(sp_http1_parse_head(in, strlen(in), strlen(in) - 1, f, 4, &r) == -1 && r.status == 431);
    /* Fields past the caller's room. */
    const char *many = "GET / HTTP/1.1\r\nA: 1\r\nB: 2\r\nC: 3\r\n\r\n";
    CHECK(sp_http1_parse_head(many, strlen(many), MAXH, f, 2, &r) == -1 && r.status == 431);
    CHECK(sp_http1_parse_head(many, strlen(many), MAXH, f, 3, &r) == 1 && r.nfields == 3);
}

static void test_http1_upgrade(void)
{
    sp_http1_field_t f[8];
    sp_http1_req_t r;
    const char *u = "GET /ws HTTP/1.1\r\nConnection: keep-alive, "
                    "Upgrade\r\nUpgrade: websocket\r\n\r\n";
    CHECK(sp_http1_parse_head(u, strlen(u), MAXH, f, 8, &r) == 1 && r.upgrade);
    const char *nu = "GET /ws HTTP/1.1\r\nUpgrade: websocket\r\n\r\n";
    CHECK(sp_http1_parse_head(nu, strlen(nu), MAXH, f, 8, &r) == 1 && !r.upgrade);
    CHECK(sp_http1_list_has("a, b ,c", 7, "B", 1) && !sp_http1_list_has("ab", 2, "a", 1));
}

struct acase {
    const char *in;
    int rc;
    const char *host;
    int port; /* -1: none */
};

static void test_http1_authority(void)
{
    static const struct acase cs[] = {
        {"a.test", 0, "a.test", -1},    {"a.test:80", 0, "a.test", 80},
        {"a.test:", 0, "a.test", -1},   {"[::1]:443", 0, "[::1]", 443},
        {"[::1]", 0, "[::1]", -1},      {"1.2.3.4:65535", 0, "1.2.3.4", 65535},
        {"a.test:0", -1, NULL, 0},      {"a.test:65536", -1, NULL, 0},
        {"a.test:123456", -1, NULL, 0}, {"a.test:8a", -1, NULL, 0},
        {"user@a.test", -1, NULL, 0},   {"", -1, NULL, 0},
        {":80", -1, NULL, 0},           {"[::1", -1, NULL, 0},
        {"[::1]x", -1, NULL, 0},        {"[]:80", -1, NULL, 0},
        {"a b", -1, NULL, 0},           {"a/b", -1, NULL, 0},
        {"a.test:80:80", -1, NULL, 0},  {"a\\b", -1, NULL, 0},
        {"[::g]", -1, NULL, 0},         {"a.test:+80", -1, NULL, 0},
    };
    for (size_t i = 0; i < sizeof(cs) / sizeof(cs[0]); i++) {
        sp_http1_authority_t a;
        int rc = sp_http1_authority(cs[i].in, strlen(cs[i].in), &a);
        bool ok = rc == cs[i].rc;
        if (ok && rc == 0)
            ok = a.host.n == strlen(cs[i].host) && memcmp(a.host.p, cs[i].host, a.host.n) == 0 &&
                 (cs[i].port < 0 ? !a.has_port : a.has_port && a.port == cs[i].port);
        if (!ok)
            fprintf(stderr, "authority '%s': rc=%d\n", cs[i].in, rc);
        CHECK(ok);
    }
}

struct ccase {
    const char *name;
    const char *in;
    int rc;      /* over the whole input */
    size_t used; /* rc 1: where the body ends; (size_t)-1: strlen(in) */
};

#define ALL ((size_t)-1)

static const struct ccase chunks[] = {
    {"simple", "5\r\nhello\r\n0\r\n\r\n", 1, ALL},
    {"extensions and trailers", "5;a=b\r\nhello\r\n6 ; ext=\"q\"\r\n world\r\n0\r\nX-T: t\r\n\r\n",
     1, ALL},
    {"upper-case hex", "A\r\n0123456789\r\n0\r\n\r\n", 1, ALL},
    {"leading zeros", "0005\r\nhello\r\n000\r\n\r\n", 1, ALL},
    {"pipelined after the end", "1\r\nx\r\n0\r\n\r\nGET / HTTP/1.1\r\n\r\n", 1, 11},
    {"not done", "5\r\nhel", 0, ALL},
    {"0x prefix", "0x5\r\nhello\r\n0\r\n\r\n", -1, 1},
    {"non-hex", "g\r\n", -1, 0},
    {"empty size", "\r\n", -1, 0},
    {"sign", "+5\r\nhello\r\n", -1, 0},
    {"overflow 17 digits", "00000000000000001\r\n", -1, 16},
    {"huge 2^60", "1000000000000000\r\n", -1, 15},
    {"huge all f", "ffffffffffffffff\r\n", -1, 15},
    {"largest allowed", "fffffffffffffff\r\n", 0, ALL},
    {"space inside the size", "5 5\r\nhello\r\n", -1, 2},
    {"trailing space without extension", "5 \r\nhello\r\n", -1, 2},
    {"bare LF after the size", "5\nhello\r\n0\r\n\r\n", -1, 1},
    {"bare LF after the data", "5\r\nhello\n0\r\n\r\n", -1, 8},
    {"bare LF at the end", "0\r\n\n", -1, 3},
    {"bare CR after the size", "5\rhello", -1, 2},
    {"data longer than its size", "3\r\nhello\r\n", -1, 6},
    {"control byte in an extension", "5;a\x01\r\nhello\r\n", -1, 3},
    {"trailer obs-fold", "0\r\nX: a\r\n b\r\n\r\n", -1, 9},
    {"trailer without colon", "0\r\nX a\r\n\r\n", -1, 4},
    {"trailer NUL", "0\r\nX: a\0\r\n\r\n", -1, 7},
};

/* Every case whole, and again split at every byte: the verdict and the end do
 * not move. */
static void test_http1_chunked_table(void)
{
    for (size_t i = 0; i < sizeof(chunks) / sizeof(chunks[0]); i++) {
        const struct ccase *c = &chunks[i];
        size_t n = strlen(c->in);
        if (strcmp(c->name, "trailer NUL") == 0)
            n = 12;
        size_t want = c->used == ALL ? n : c->used;
        for (size_t split = 0; split <= n; split++) {
            sp_http1_chunked_t cs;
            sp_http1_chunked_init(&cs);
            size_t u1 = 0, u2 = 0;
            const char *why = NULL;
            int rc = sp_http1_chunked_scan(&cs, c->in, split, &u1, &why);
            if (rc == 0)
                rc = sp_http1_chunked_scan(&cs, c->in + split, n - split, &u2, &why);
            bool ok = rc == c->rc && u1 + u2 == want && (rc >= 0 || why != NULL);
            if (!ok) {
                fprintf(stderr, "chunked '%s' split %zu: rc=%d used=%zu why=%s\n", c->name, split,
                        rc, u1 + u2, why ? why : "-");
                CHECK(ok);
                break;
            }
        }
    }
}

/* A long extension line and a large trailer section are refused at their
 * limits. */
static void test_http1_chunked_limits(void)
{
    static char line[SP_HTTP1_CHUNK_LINE_MAX + 64];
    memset(line, 'a', sizeof(line));
    memcpy(line, "1;", 2);
    sp_http1_chunked_t cs;
    sp_http1_chunked_init(&cs);
    size_t used;
    const char *why = NULL;
    CHECK(sp_http1_chunked_scan(&cs, line, sizeof(line), &used, &why) == -1 &&
          used == SP_HTTP1_CHUNK_LINE_MAX);
    static char tr[SP_HTTP1_TRAILER_MAX + 64];
    memset(tr, 'a', sizeof(tr));
    memcpy(tr, "0\r\nX:", 5);
    sp_http1_chunked_init(&cs);
    CHECK(sp_http1_chunked_scan(&cs, tr, sizeof(tr), &used, &why) == -1 &&
          used == 3 + SP_HTTP1_TRAILER_MAX);
    /* A large chunk streams through in pieces. */
    sp_http1_chunked_init(&cs);
    CHECK(sp_http1_chunked_scan(&cs, "100000\r\n", 8, &used, &why) == 0 && used == 8);
    static char data[4096];
    memset(data, 'x', sizeof(data));
    for (int i = 0; i < 256; i++)
        CHECK(sp_http1_chunked_scan(&cs, data, sizeof(data), &used, &why) == 0 &&
              used == sizeof(data));
    CHECK(sp_http1_chunked_scan(&cs, "\r\n0\r\n\r\n", 7, &used, &why) == 1 && used == 7);
}

int main(void)
{
    test_http1_smuggling_table();
    test_http1_pipelined_second_request();
    test_http1_absolute_form_other_host();
    test_http1_huge_headers();
    test_http1_upgrade();
    test_http1_authority();
    test_http1_chunked_table();
    test_http1_chunked_limits();
    return check_report("test_http1");
}
