/*
 * http1.h - HTTP/1.1 request framing (RFC 9112) for the egress proxy and the
 * credential relay: where a request head ends, what it asks for (request line,
 * header fields, Host) and where its body ends.
 *
 * Both core/egress/proxy.c (which decides on the destination a request names)
 * and core/egress/mitm_conn.c (which relays keep-alive requests with credentials)
 * read requests through this module only, so the two can never see different
 * request boundaries or a different Host in the same bytes. It is strict where
 * leniency lets two readers disagree (request smuggling); every refusal carries
 * the HTTP status to answer with.
 *
 * Decisions, all refusals (status 400 unless said):
 *  - lines end in CRLF; a bare LF, or a CR not followed by LF, anywhere in the
 * head or in the chunked framing is refused (RFC 9112 2.2 allows accepting a
 * bare LF; we do not: a peer that treats it differently would split the message
 * elsewhere);
 *  - empty lines (CRLF) before the request line are skipped (RFC 9112 2.2) and
 * counted in the head's length;
 *  - request line: token SP target SP "HTTP/1.0" or "HTTP/1.1", single spaces;
 * another "HTTP/..." version gets 505; the target has no control bytes or
 * spaces;
 *  - field lines: a token name straight before ':' (no whitespace), a value of
 * visible bytes, spaces and tabs (NUL, CR and other control bytes refused);
 * obsolete line folding (a line starting with SP or HTAB) refused; more than
 * the caller's field count gets 431, a head longer than the caller's limit gets
 * 431;
 *  - more than one Host field: 400. A missing Host, or one that names another
 * authority than an absolute-form target, is reported, not refused: the caller
 * decides;
 *  - Transfer-Encoding (all its fields together, RFC 9112 6.1): only "chunked",
 * once: chunked twice or not last is 400, another coding (gzip, chunked) is
 * 501, and any Transfer-Encoding in an HTTP/1.0 request is 400;
 *  - Content-Length: 1 to 18 digits, nothing else (no sign, no inner spaces, no
 * list); repeated fields must carry the same number; Content-Length with
 * Transfer-Encoding is 400 (a proxy must not forward such a request, RFC
 * 9112 6.3);
 *  - chunked bodies: chunk-size is 1 to 16 hex digits with a value below 2^60,
 * then optional extensions (";" after optional whitespace, visible bytes up to
 * the CRLF, the whole line at most SP_HTTP1_CHUNK_LINE_MAX bytes); the data
 * ends in CRLF exactly; trailer fields are checked like header fields (at most
 * SP_HTTP1_TRAILER_MAX bytes).
 *
 * Pure: no I/O, no allocation. Parsed strings point into the caller's bytes,
 * fields into the caller's array.
 */
#ifndef SP_EGRESS_HTTP1_H
#define SP_EGRESS_HTTP1_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#define SP_HTTP1_MAX_FIELDS     128   /* header fields a caller normally makes room for */
#define SP_HTTP1_CHUNK_LINE_MAX 4096  /* bytes of a chunk-size line with its extensions */
#define SP_HTTP1_TRAILER_MAX    16384 /* bytes of a chunked body's trailer section */

/* A piece of the caller's bytes; p NULL (n 0) when absent. */
typedef struct {
    const char *p;
    size_t n;
} sp_http1_str_t;

typedef enum {
    SP_HTTP1_ORIGIN = 0, /* "/path?query" */
    SP_HTTP1_ABSOLUTE,   /* "scheme://authority/path?query" */
    SP_HTTP1_AUTHORITY,  /* "host:port", CONNECT only */
    SP_HTTP1_ASTERISK,   /* "*", OPTIONS only */
} sp_http1_form_t;

typedef enum {
    SP_HTTP1_BODY_NONE = 0,
    SP_HTTP1_BODY_LENGTH,  /* Content-Length bytes */
    SP_HTTP1_BODY_CHUNKED, /* until the last chunk and trailers:
                              sp_http1_chunked_scan */
} sp_http1_body_t;

typedef struct {
    sp_http1_str_t name;  /* as sent (compare without case) */
    sp_http1_str_t value; /* without the whitespace around it */
    sp_http1_str_t line;  /* the whole field line, without its CRLF */
} sp_http1_field_t;

typedef struct {
    size_t head_len;     /* bytes up to and including the blank line */
    sp_http1_str_t line; /* the request line, without its CRLF */
    sp_http1_str_t method, target;
    int minor; /* HTTP/1.<minor>: 0 or 1 */
    sp_http1_form_t form;
    bool connect; /* the method is CONNECT (the form is then AUTHORITY) */
    /* ABSOLUTE: the scheme as sent; the authority (also AUTHORITY: the whole
     * target); the path and query without any fragment (may be empty). */
    sp_http1_str_t scheme, authority, path;
    sp_http1_str_t host;      /* the Host field's value; p NULL when there is none */
    sp_http1_field_t *fields; /* the caller's array */
    size_t nfields;
    sp_http1_body_t body;
    uint64_t length; /* BODY_LENGTH: its bytes (0 is BODY_NONE) */
    bool upgrade;    /* an Upgrade field, and "upgrade" in Connection */
    int status;      /* refused: the status to answer with (400, 431, 501, 505) */
    const char *why; /* refused: a one-line reason (static text) */
} sp_http1_req_t;

/*
 * Reads the request head at the start of p[0..n). max_head bounds the head
 * (leading empty lines included); fields has room for max_fields. Returns 1
 * with req filled (the head is req->head_len bytes; what follows is the body,
 * then the next request), 0 when the head is not complete yet and nothing seen
 * so far is wrong (call again with more bytes), -1 refused (req->status,
 * req->why). Needs no state between calls: it reads from the start.
 */
int sp_http1_parse_head(const void *p, size_t n, size_t max_head, sp_http1_field_t *fields,
                        size_t max_fields, sp_http1_req_t *req);

/* Whether field f is named name (ASCII case-insensitive). */
bool sp_http1_field_is(const sp_http1_field_t *f, const char *name);
/* Whether the comma-separated list s[0..n) holds token tok (case-insensitive).
 */
bool sp_http1_list_has(const char *s, size_t n, const char *tok, size_t tok_len);

/* An authority (host[:port], [v6][:port]) split up. */
typedef struct {
    sp_http1_str_t host; /* brackets kept around an IPv6 literal */
    bool has_port;       /* false also for "host:" (empty port) */
    uint16_t port;       /* has_port: 1..65535 */
} sp_http1_authority_t;

/* Splits s[0..n): 0, or -1 when empty, with userinfo ('@'), a bad port
 * (not 1..65535, more than 5 digits), characters no host may hold, or an
 * unclosed '['. The host is not checked further (a name or address parser
 * decides what it is). */
int sp_http1_authority(const char *s, size_t n, sp_http1_authority_t *a);

/* A chunked body being scanned: sp_http1_chunked_init, then
 * sp_http1_chunked_scan on each piece of the bytes after the head, in order. */
typedef struct {
    int state;
    unsigned digits;
    uint64_t size;   /* the chunk being read */
    uint64_t left;   /* its data bytes still to come */
    size_t line;     /* bytes of the current size line or trailer line */
    size_t trailers; /* bytes of the trailer section */
} sp_http1_chunked_t;

void sp_http1_chunked_init(sp_http1_chunked_t *c);
/*
 * Scans p[0..n): *used gets how many of these bytes belong to the body. Returns
 * 1 when the body ended within them (what follows *used is the next request), 0
 * when all n belong to it and more is to come, -1 on a framing error (why;
 * *used bytes before it were fine). The bytes are not changed: a proxy forwards
 * them as they are.
 */
int sp_http1_chunked_scan(sp_http1_chunked_t *c, const void *p, size_t n, size_t *used,
                          const char **why);

#endif
