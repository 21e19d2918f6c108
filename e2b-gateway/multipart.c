/*
 * multipart.c - multipart/form-data parsing over a memory buffer (multipart.h).
 *
 * Owns nothing: parts point into the caller's buffer; names are decoded into the parser.
 * Every scan is bounded by the buffer, header blocks by SP_MULTIPART_HEADERS_MAX.
 */
#include "e2b-gateway/multipart.h"

#include <stdio.h>
#include <string.h>
#include <strings.h>

static const char *skip_ws(const char *p)
{
    while (*p == ' ' || *p == '\t')
        p++;
    return p;
}

/*
 * Reads a parameter value at p (token or quoted-string with backslash escapes) into out;
 * returns the position after it, or NULL when it is malformed or too long.
 */
static const char *param_value(const char *p, const char *end, char *out, size_t cap)
{
    size_t o = 0;
    if (p < end && *p == '"') {
        p++;
        while (p < end && *p != '"') {
            if (*p == '\\' && p + 1 < end)
                p++;
            if (o + 1 >= cap)
                return NULL;
            out[o++] = *p++;
        }
        if (p >= end)
            return NULL; /* unterminated quote */
        p++;
    } else {
        while (p < end && *p != ';' && *p != ' ' && *p != '\t') {
            if (o + 1 >= cap)
                return NULL;
            out[o++] = *p++;
        }
    }
    out[o] = '\0';
    return p;
}

/*
 * Finds parameter `name` in the "; k=v; k2=v2" tail [p, end). 1 found (value in out), 0
 * absent, -1 malformed.
 */
static int find_param(const char *p, const char *end, const char *name, char *out, size_t cap)
{
    size_t nl = strlen(name);
    while (p < end) {
        while (p < end && (*p == ';' || *p == ' ' || *p == '\t'))
            p++;
        if (p >= end)
            break;
        const char *k = p;
        while (p < end && *p != '=' && *p != ';')
            p++;
        const char *kend = p;
        while (kend > k && (kend[-1] == ' ' || kend[-1] == '\t'))
            kend--;
        if (p >= end || *p == ';')
            continue; /* a bare token ("form-data") */
        p++;          /* '=' */
        while (p < end && (*p == ' ' || *p == '\t'))
            p++;
        char tmp[SP_MULTIPART_NAME_MAX + 1];
        const char *after = param_value(p, end, tmp, sizeof(tmp));
        if (after == NULL)
            return -1;
        p = after;
        if ((size_t)(kend - k) == nl && strncasecmp(k, name, nl) == 0) {
            if (strlen(tmp) + 1 > cap)
                return -1;
            memcpy(out, tmp, strlen(tmp) + 1);
            return 1;
        }
    }
    return 0;
}

int sp_multipart_boundary(const char *ct, char *out, size_t cap)
{
    if (ct == NULL)
        return -1;
    ct = skip_ws(ct);
    static const char mt[] = "multipart/form-data";
    if (strncasecmp(ct, mt, sizeof(mt) - 1) != 0)
        return -1;
    const char *p = ct + sizeof(mt) - 1;
    p = skip_ws(p);
    if (*p != ';')
        return -1;
    if (find_param(p, p + strlen(p), "boundary", out, cap) != 1)
        return -1;
    size_t n = strlen(out);
    if (n == 0 || n > SP_MULTIPART_BOUNDARY_MAX)
        return -1;
    return 0;
}

int sp_multipart_init(sp_multipart_t *m, const char *content_type, const void *buf, size_t n,
                      sp_err_t *err)
{
    memset(m, 0, sizeof(*m));
    char b[SP_MULTIPART_BOUNDARY_MAX + 1];
    if (sp_multipart_boundary(content_type, b, sizeof(b)) < 0)
        return sp_err_set(err, SP_EINVAL, "multipart/form-data with a boundary is required");
    m->buf = buf;
    m->n = buf ? n : 0;
    m->dlen = (size_t)snprintf(m->delim, sizeof(m->delim), "\r\n--%s", b);
    return 0;
}

static int fail(sp_multipart_t *m, sp_err_t *err, const char *why)
{
    m->state = 3;
    return sp_err_set(err, SP_EINVAL, "malformed multipart body: %s", why);
}

/* After a delimiter at m->off: "--" (close) or padding + CRLF (next part). */
static int after_delim(sp_multipart_t *m, sp_err_t *err)
{
    size_t o = m->off;
    if (m->n - o >= 2 && m->buf[o] == '-' && m->buf[o + 1] == '-') {
        m->state = 2;
        m->off = m->n;
        return 0;
    }
    while (o < m->n && (m->buf[o] == ' ' || m->buf[o] == '\t'))
        o++;
    if (m->n - o < 2 || m->buf[o] != '\r' || m->buf[o + 1] != '\n')
        return fail(m, err, "truncated after a boundary");
    m->off = o + 2;
    m->state = 1;
    return 1;
}

/* Parses one header block [h, hend) into m->name and m->filename. */
static int parse_headers(sp_multipart_t *m, const char *h, const char *hend, bool *has_fn)
{
    m->name[0] = '\0';
    m->filename[0] = '\0';
    *has_fn = false;
    while (h < hend) {
        const char *eol = memchr(h, '\r', (size_t)(hend - h));
        const char *lend = eol ? eol : hend;
        static const char cd[] = "content-disposition:";
        if ((size_t)(lend - h) >= sizeof(cd) - 1 && strncasecmp(h, cd, sizeof(cd) - 1) == 0) {
            const char *p = h + sizeof(cd) - 1;
            if (memchr(p, '\0', (size_t)(lend - p)) != NULL)
                return -1;
            if (find_param(p, lend, "name", m->name, sizeof(m->name)) < 0)
                return -1;
            int r = find_param(p, lend, "filename", m->filename, sizeof(m->filename));
            if (r < 0)
                return -1;
            *has_fn = r == 1;
        }
        if (eol == NULL)
            break;
        h = eol + 2 <= hend ? eol + 2 : hend;
    }
    return 0;
}

int sp_multipart_next(sp_multipart_t *m, sp_multipart_part_t *part, sp_err_t *err)
{
    if (m->state == 3)
        return sp_err_set(err, SP_EINVAL, "malformed multipart body");
    if (m->state == 2)
        return 0;
    if (m->state == 0) {
        /* The first delimiter may open the body (no leading CRLF) or follow a preamble. */
        const uint8_t *d = (const uint8_t *)m->delim;
        if (m->n >= m->dlen - 2 && memcmp(m->buf, d + 2, m->dlen - 2) == 0) {
            m->off = m->dlen - 2;
        } else {
            const uint8_t *f = memmem(m->buf, m->n, d, m->dlen);
            if (f == NULL)
                return fail(m, err, "no boundary");
            m->off = (size_t)(f - m->buf) + m->dlen;
        }
        int r = after_delim(m, err);
        if (r <= 0)
            return r;
    }
    /* Headers end at the first empty line. */
    const uint8_t *hs = m->buf + m->off;
    size_t avail = m->n - m->off;
    size_t lim = avail < SP_MULTIPART_HEADERS_MAX ? avail : SP_MULTIPART_HEADERS_MAX;
    const uint8_t *he;
    if (lim >= 2 && hs[0] == '\r' && hs[1] == '\n') {
        he = hs; /* no headers at all */
    } else {
        const uint8_t *f = memmem(hs, lim, "\r\n\r\n", 4);
        if (f == NULL)
            return fail(m, err,
                        avail > SP_MULTIPART_HEADERS_MAX ? "part headers too large"
                                                         : "truncated part headers");
        he = f + 2;
    }
    bool has_fn;
    if (parse_headers(m, (const char *)hs, (const char *)he, &has_fn) < 0)
        return fail(m, err, "bad Content-Disposition");
    size_t body = (size_t)(he + 2 - m->buf);
    const uint8_t *end = memmem(m->buf + body, m->n - body, m->delim, m->dlen);
    if (end == NULL)
        return fail(m, err, "missing closing boundary");
    part->name = m->name;
    part->filename = has_fn ? m->filename : NULL;
    part->data = m->buf + body;
    part->len = (size_t)(end - (m->buf + body));
    m->off = (size_t)(end - m->buf) + m->dlen;
    if (after_delim(m, err) < 0)
        return -1;
    return 1;
}
