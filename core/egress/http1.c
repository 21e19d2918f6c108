/*
 * http1.c - HTTP/1.1 request framing (http1.h).
 *
 * Owns nothing: reads the caller's bytes and fills the caller's structures. The
 * head is read in two passes: the first finds where it ends (refusing bare LF
 * and CR on the way, so a head with one is refused before it is complete), the
 * second reads its lines, which by then all end in CRLF.
 */
#include "core/egress/http1.h"

#include <string.h>
#include <strings.h>

#include "base/text.h"

static bool is_tchar(unsigned char c)
{
    if ((c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9'))
        return true;
    return c != 0 && strchr("!#$%&'*+-.^_`|~", c) != NULL;
}

/* A byte a field value (or chunk extension) may hold: visible, obs-text, space,
 * tab. */
static bool is_vbyte(unsigned char c)
{
    return c == '\t' || (c >= 0x20 && c != 0x7f);
}

static bool is_ows(char c)
{
    return c == ' ' || c == '\t';
}

static int refuse(sp_http1_req_t *req, int status, const char *why)
{
    req->status = status;
    req->why = why;
    return -1;
}

static bool str_is(const char *p, size_t n, const char *s)
{
    return strlen(s) == n && strncasecmp(p, s, n) == 0;
}

bool sp_http1_field_is(const sp_http1_field_t *f, const char *name)
{
    return str_is(f->name.p, f->name.n, name);
}

/* Calls each element of a comma-separated list (whitespace around it trimmed,
 * empty ones skipped) until fn returns false. */
static void list_each(const char *s, size_t n, bool (*fn)(void *arg, const char *e, size_t el),
                      void *arg)
{
    size_t i = 0;
    while (i < n) {
        size_t st = i;
        while (i < n && s[i] != ',')
            i++;
        size_t en = i;
        while (st < en && is_ows(s[st]))
            st++;
        while (en > st && is_ows(s[en - 1]))
            en--;
        if (en > st && !fn(arg, s + st, en - st))
            return;
        i++; /* the comma */
    }
}

struct find {
    const char *tok;
    size_t len;
    bool found;
};

static bool find_one(void *arg, const char *e, size_t el)
{
    struct find *f = arg;
    f->found = el == f->len && strncasecmp(e, f->tok, el) == 0;
    return !f->found;
}

bool sp_http1_list_has(const char *s, size_t n, const char *tok, size_t tok_len)
{
    struct find f = {tok, tok_len, false};
    list_each(s, n, find_one, &f);
    return f.found;
}

/* Transfer codings seen so far, in order, across every Transfer-Encoding field.
 */
struct te {
    unsigned chunked, other, elems;
    bool chunked_last;
};

static bool te_one(void *arg, const char *e, size_t el)
{
    struct te *t = arg;
    t->elems++;
    /* "chunked" takes no parameters: "chunked;x=1" is another coding to us. */
    if (str_is(e, el, "chunked")) {
        t->chunked++;
        t->chunked_last = true;
    } else {
        t->other++;
        t->chunked_last = false;
    }
    return true;
}

/* Reg-name, IPv4 and percent-encoded bytes (RFC 3986 3.2.2), without the port.
 */
static bool is_hostchar(unsigned char c)
{
    if ((c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9'))
        return true;
    return c != 0 && strchr("-._~%!$&'()*+,;=", c) != NULL;
}

int sp_http1_authority(const char *s, size_t n, sp_http1_authority_t *a)
{
    memset(a, 0, sizeof(*a));
    if (n == 0 || memchr(s, '@', n) != NULL)
        return -1;
    size_t hl;
    if (s[0] == '[') {
        const char *close = memchr(s, ']', n);
        if (close == NULL || close == s + 1)
            return -1;
        hl = (size_t)(close - s) + 1;
        for (size_t i = 1; i + 1 < hl; i++)
            if (sp_text_hexval((unsigned char)s[i]) < 0 && s[i] != ':' && s[i] != '.')
                return -1;
    } else {
        hl = 0;
        while (hl < n && s[hl] != ':') {
            if (!is_hostchar((unsigned char)s[hl]))
                return -1;
            hl++;
        }
        if (hl == 0)
            return -1;
    }
    a->host.p = s;
    a->host.n = hl;
    if (hl == n)
        return 0;
    if (s[hl] != ':')
        return -1;
    const char *ps = s + hl + 1;
    size_t pl = n - hl - 1;
    if (pl == 0)
        return 0; /* "host:" is the scheme's default port (RFC 3986 3.2.3) */
    if (pl > 5)
        return -1;
    unsigned long v = 0;
    for (size_t i = 0; i < pl; i++) {
        if (ps[i] < '0' || ps[i] > '9')
            return -1;
        v = v * 10 + (unsigned long)(ps[i] - '0');
    }
    if (v < 1 || v > 65535)
        return -1;
    a->has_port = true;
    a->port = (uint16_t)v;
    return 0;
}

/* Finds the end of the head: its length, 0 when not there yet, -1 refused. */
static long head_end(const char *p, size_t n, size_t max_head, size_t *first_line,
                     sp_http1_req_t *req)
{
    size_t i = 0;
    /* Empty lines before the request line (RFC 9112 2.2). */
    while (i < n && (p[i] == '\r' || p[i] == '\n')) {
        if (p[i] == '\n')
            return refuse(req, 400, "bare LF in the request head");
        if (i + 1 == n)
            break;
        if (p[i + 1] != '\n')
            return refuse(req, 400, "bare CR in the request head");
        i += 2;
    }
    *first_line = i;
    size_t line_start = i;
    size_t lim = n < max_head ? n : max_head;
    for (; i < lim; i++) {
        if (p[i] == '\r') {
            if (i + 1 < n && p[i + 1] != '\n')
                return refuse(req, 400, "bare CR in the request head");
            continue;
        }
        if (p[i] != '\n')
            continue;
        if (i == 0 || p[i - 1] != '\r')
            return refuse(req, 400, "bare LF in the request head");
        if (i - 1 == line_start && line_start > *first_line)
            return (long)(i + 1); /* the blank line */
        line_start = i + 1;
    }
    if (n >= max_head)
        return refuse(req, 431, "request head is too large");
    return 0;
}

static int request_line(const char *l, size_t ll, sp_http1_req_t *req)
{
    req->line.p = l;
    req->line.n = ll;
    size_t i = 0;
    while (i < ll && is_tchar((unsigned char)l[i]))
        i++;
    if (i == 0 || i == ll || l[i] != ' ')
        return refuse(req, 400, "malformed request line");
    req->method.p = l;
    req->method.n = i;
    const char *t = l + i + 1;
    const char *sp2 = memchr(t, ' ', (size_t)(l + ll - t));
    if (sp2 == NULL || sp2 == t)
        return refuse(req, 400, "malformed request line");
    req->target.p = t;
    req->target.n = (size_t)(sp2 - t);
    const char *v = sp2 + 1;
    size_t vl = (size_t)(l + ll - v);
    if (memchr(v, ' ', vl) != NULL)
        return refuse(req, 400, "malformed request line");
    if (vl == 8 && memcmp(v, "HTTP/1.", 7) == 0 && (v[7] == '0' || v[7] == '1'))
        req->minor = v[7] - '0';
    else if (vl >= 5 && memcmp(v, "HTTP/", 5) == 0)
        return refuse(req, 505, "only HTTP/1.0 and HTTP/1.1 requests are supported");
    else
        return refuse(req, 400, "malformed request line");
    for (size_t k = 0; k < req->target.n; k++)
        if ((unsigned char)t[k] <= 0x20 || t[k] == 0x7f)
            return refuse(req, 400, "malformed request line");

    req->connect = req->method.n == 7 && memcmp(l, "CONNECT", 7) == 0;
    const char *tp = req->target.p;
    size_t tn = req->target.n;
    if (req->connect) {
        sp_http1_authority_t a;
        if (sp_http1_authority(tp, tn, &a) < 0 || !a.has_port)
            return refuse(req, 400, "CONNECT needs host:port");
        req->form = SP_HTTP1_AUTHORITY;
        req->authority = req->target;
        return 0;
    }
    if (tn == 1 && tp[0] == '*') {
        if (!(req->method.n == 7 && memcmp(l, "OPTIONS", 7) == 0))
            return refuse(req, 400, "'*' is a target for OPTIONS only");
        req->form = SP_HTTP1_ASTERISK;
        return 0;
    }
    if (tp[0] == '/') {
        req->form = SP_HTTP1_ORIGIN;
        return 0;
    }
    /* absolute-form: scheme "://" authority path-abempty [ "?" query ] */
    size_t k = 0;
    while (k < tn && ((tp[k] >= 'a' && tp[k] <= 'z') || (tp[k] >= 'A' && tp[k] <= 'Z') ||
                      (k > 0 && ((tp[k] >= '0' && tp[k] <= '9') || strchr("+-.", tp[k]) != NULL))))
        k++;
    if (k == 0 || tn - k < 3 || memcmp(tp + k, "://", 3) != 0)
        return refuse(req, 400, "malformed request target");
    req->form = SP_HTTP1_ABSOLUTE;
    req->scheme.p = tp;
    req->scheme.n = k;
    const char *au = tp + k + 3, *end = tp + tn;
    const char *ae = au;
    while (ae < end && *ae != '/' && *ae != '?' && *ae != '#')
        ae++;
    req->authority.p = au;
    req->authority.n = (size_t)(ae - au);
    const char *frag = memchr(ae, '#', (size_t)(end - ae));
    req->path.p = ae;
    req->path.n = (size_t)((frag != NULL ? frag : end) - ae);
    return 0;
}

/* Content-Length: digits only, at most 18 of them (fits in 64 bits). */
static int parse_length(const char *v, size_t n, uint64_t *out)
{
    if (n == 0 || n > 18)
        return -1;
    uint64_t x = 0;
    for (size_t i = 0; i < n; i++) {
        if (v[i] < '0' || v[i] > '9')
            return -1;
        x = x * 10 + (uint64_t)(v[i] - '0');
    }
    *out = x;
    return 0;
}

int sp_http1_parse_head(const void *vp, size_t n, size_t max_head, sp_http1_field_t *fields,
                        size_t max_fields, sp_http1_req_t *req)
{
    const char *p = vp;
    memset(req, 0, sizeof(*req));
    req->fields = fields;
    size_t first = 0;
    long hl = head_end(p, n, max_head, &first, req);
    if (hl <= 0)
        return (int)hl;
    req->head_len = (size_t)hl;
    const char *end = p + hl;

    const char *l = p + first;
    const char *le = memchr(l, '\n', (size_t)(end - l)); /* ends in CRLF: head_end checked */
    if (request_line(l, (size_t)(le - l) - 1, req) < 0)
        return -1;

    bool has_cl = false, has_te = false, conn_upgrade = false, upgrade_field = false;
    struct te te = {0};
    for (l = le + 1; l < end; l = le + 1) {
        le = memchr(l, '\n', (size_t)(end - l));
        size_t ll = (size_t)(le - l) - 1;
        if (ll == 0)
            break; /* the blank line */
        if (is_ows(l[0]))
            return refuse(req, 400, "folded header lines are not accepted");
        size_t nl = 0;
        while (nl < ll && is_tchar((unsigned char)l[nl]))
            nl++;
        if (nl == 0 || nl == ll || l[nl] != ':')
            return refuse(req, 400, "malformed header line");
        const char *v = l + nl + 1, *ve = l + ll;
        while (v < ve && is_ows(*v))
            v++;
        while (ve > v && is_ows(ve[-1]))
            ve--;
        for (const char *q = v; q < ve; q++)
            if (!is_vbyte((unsigned char)*q))
                return refuse(req, 400, "control byte in a header value");
        if (req->nfields >= max_fields)
            return refuse(req, 431, "too many header lines");
        sp_http1_field_t *f = &fields[req->nfields++];
        *f = (sp_http1_field_t){{l, nl}, {v, (size_t)(ve - v)}, {l, ll}};
        if (sp_http1_field_is(f, "host")) {
            if (req->host.p != NULL)
                return refuse(req, 400, "more than one Host header");
            req->host = f->value;
        } else if (sp_http1_field_is(f, "content-length")) {
            uint64_t x;
            if (parse_length(f->value.p, f->value.n, &x) < 0)
                return refuse(req, 400, "bad Content-Length");
            if (has_cl && x != req->length)
                return refuse(req, 400, "conflicting Content-Length headers");
            has_cl = true;
            req->length = x;
        } else if (sp_http1_field_is(f, "transfer-encoding")) {
            has_te = true;
            list_each(f->value.p, f->value.n, te_one, &te);
        } else if (sp_http1_field_is(f, "connection")) {
            conn_upgrade = conn_upgrade || sp_http1_list_has(f->value.p, f->value.n, "upgrade", 7);
        } else if (sp_http1_field_is(f, "upgrade")) {
            upgrade_field = true;
        }
    }
    req->upgrade = upgrade_field && conn_upgrade;
    if (has_te) {
        if (has_cl)
            return refuse(req, 400, "both Content-Length and Transfer-Encoding");
        if (req->minor == 0)
            return refuse(req, 400, "Transfer-Encoding in an HTTP/1.0 request");
        if (te.elems == 0)
            return refuse(req, 400, "empty Transfer-Encoding");
        if (te.chunked > 1)
            return refuse(req, 400, "chunked more than once in Transfer-Encoding");
        if (te.chunked == 1 && !te.chunked_last)
            return refuse(req, 400, "chunked is not the last transfer coding");
        if (te.other > 0)
            return refuse(req, 501, "only chunked Transfer-Encoding is supported");
        req->body = SP_HTTP1_BODY_CHUNKED;
        req->length = 0;
    } else if (has_cl && req->length > 0) {
        req->body = SP_HTTP1_BODY_LENGTH;
    }
    return 1;
}

/* ---- chunked bodies ---- */

enum {
    CH_SIZE = 0, /* the first hex digit of a chunk size */
    CH_SIZE_MORE,
    CH_BWS, /* whitespace after the size: only ';' may follow */
    CH_EXT,
    CH_SIZE_LF,
    CH_DATA,
    CH_DATA_CR,
    CH_DATA_LF,
    CH_TR_START, /* a trailer line or the final CRLF */
    CH_TR_NAME,
    CH_TR_VALUE,
    CH_TR_LF,
    CH_END_LF,
    CH_DONE,
};

void sp_http1_chunked_init(sp_http1_chunked_t *c)
{
    memset(c, 0, sizeof(*c));
}

int sp_http1_chunked_scan(sp_http1_chunked_t *c, const void *vp, size_t n, size_t *used,
                          const char **why)
{
    const unsigned char *p = vp;
    size_t i = 0;
    const char *bad = NULL;
    while (i < n && c->state != CH_DONE && bad == NULL) {
        unsigned char ch = p[i];
        if (c->state <= CH_SIZE_LF && ++c->line > SP_HTTP1_CHUNK_LINE_MAX) {
            bad = "chunk size line is too long";
            break;
        }
        if (c->state >= CH_TR_START && ++c->trailers > SP_HTTP1_TRAILER_MAX) {
            bad = "chunked trailers are too large";
            break;
        }
        switch (c->state) {
        case CH_SIZE:
        case CH_SIZE_MORE: {
            int d = sp_text_hexval(ch);
            if (d >= 0) {
                if (c->digits == 16) {
                    bad = "chunk size is too long";
                    break;
                }
                c->digits++;
                c->size = c->size * 16 + (uint64_t)d;
                if (c->size >> 60) {
                    bad = "chunk size is too large";
                    break;
                }
                c->state = CH_SIZE_MORE;
            } else if (c->state == CH_SIZE) {
                bad = "bad chunk size";
                break;
            } else if (ch == ';') {
                c->state = CH_EXT;
            } else if (ch == ' ' || ch == '\t') {
                c->state = CH_BWS;
            } else if (ch == '\r') {
                c->state = CH_SIZE_LF;
            } else {
                bad = ch == '\n' ? "bare LF in chunked framing" : "bad chunk size";
                break;
            }
            i++;
            break;
        }
        case CH_BWS:
            if (ch == ';')
                c->state = CH_EXT;
            else if (ch != ' ' && ch != '\t') {
                bad = "bad chunk size";
                break;
            }
            i++;
            break;
        case CH_EXT:
            if (ch == '\r')
                c->state = CH_SIZE_LF;
            else if (!is_vbyte(ch)) {
                bad =
                    ch == '\n' ? "bare LF in chunked framing" : "control byte in a chunk extension";
                break;
            }
            i++;
            break;
        case CH_SIZE_LF:
            if (ch != '\n') {
                bad = "bare CR in chunked framing";
                break;
            }
            c->left = c->size;
            c->state = c->size > 0 ? CH_DATA : CH_TR_START;
            i++;
            break;
        case CH_DATA: {
            size_t k = n - i;
            if (k > c->left)
                k = (size_t)c->left;
            i += k;
            c->left -= k;
            if (c->left == 0)
                c->state = CH_DATA_CR;
            break;
        }
        case CH_DATA_CR:
            if (ch != '\r') {
                bad = "chunk data is longer than its size";
                break;
            }
            c->state = CH_DATA_LF;
            i++;
            break;
        case CH_DATA_LF:
            if (ch != '\n') {
                bad = "bare CR in chunked framing";
                break;
            }
            c->state = CH_SIZE;
            c->size = 0;
            c->digits = 0;
            c->line = 0;
            i++;
            break;
        case CH_TR_START:
            if (ch == '\r')
                c->state = CH_END_LF;
            else if (ch == ' ' || ch == '\t') {
                bad = "folded trailer lines are not accepted";
                break;
            } else if (is_tchar(ch))
                c->state = CH_TR_NAME;
            else {
                bad = ch == '\n' ? "bare LF in chunked framing" : "malformed trailer line";
                break;
            }
            i++;
            break;
        case CH_TR_NAME:
            if (ch == ':')
                c->state = CH_TR_VALUE;
            else if (!is_tchar(ch)) {
                bad = "malformed trailer line";
                break;
            }
            i++;
            break;
        case CH_TR_VALUE:
            if (ch == '\r')
                c->state = CH_TR_LF;
            else if (!is_vbyte(ch)) {
                bad = ch == '\n' ? "bare LF in chunked framing" : "control byte in a trailer value";
                break;
            }
            i++;
            break;
        case CH_TR_LF:
        case CH_END_LF:
            if (ch != '\n') {
                bad = "bare CR in chunked framing";
                break;
            }
            c->state = c->state == CH_TR_LF ? CH_TR_START : CH_DONE;
            i++;
            break;
        }
    }
    *used = i;
    if (bad != NULL) {
        if (why != NULL)
            *why = bad;
        return -1;
    }
    return c->state == CH_DONE ? 1 : 0;
}
