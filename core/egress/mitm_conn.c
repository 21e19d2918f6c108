/*
 * mitm_conn.c - the credential relay's connections (core/egress/mitm.h,
 * sp_mitm_conn_*): TLS toward the guest over memory BIOs, TLS (or plain TCP)
 * toward the destination, and in between each request read through
 * core/egress/http1.h (the parser the egress proxy uses too) and its head
 * rewritten with the rule headers.
 *
 * Every conn is driven by one pump that runs from the loop (a zero-delay timer
 * or the upstream socket's watch), never inside a call from the proxy, so the
 * proxy's callbacks never re-enter it. Buffers are bounded: the guest's input
 * is acknowledged (consumed) only while what is waiting stays under
 * GUEST_IN_MAX, upstream output is read only while the guest's side holds less
 * than GUEST_OUT_MAX, and guest requests are parsed only while less than
 * UP_OUT_MAX waits for the upstream socket. Responses are relayed as they come,
 * unparsed. Knows no proxy protocol: core/egress/proxy.c answers CONNECT and
 * connects the upstream socket.
 */
#include <errno.h>
#include <openssl/bio.h>
#include <openssl/err.h>
#include <openssl/x509v3.h>
#include <sodium.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/socket.h>
#include <unistd.h>

#include "base/log.h"
#include "core/egress/mitm_int.h"

#define GUEST_IN_MAX  (128u * 1024) /* guest bytes held before more are acknowledged */
#define GUEST_OUT_MAX (256u * 1024) /* bytes for the guest held before upstream reads stop */
#define UP_OUT_MAX    (256u * 1024) /* request bytes waiting for the upstream socket */
#define HEAD_MAX      (64u * 1024)  /* a request head; longer gets 431 */
#define LINGER_MS     10000         /* after the guest closed: wait this long for upstream */

/* ---- byte buffers (zeroed as they are consumed: request bytes may hold a secret) ---- */

static int buf_put(struct buf *b, const void *d, size_t n)
{
    if (n == 0)
        return 0;
    if (b->off + b->len + n > b->cap) {
        if (b->off > 0) {
            memmove(b->p, b->p + b->off, b->len);
            sodium_memzero(b->p + b->len, b->off);
            b->off = 0;
        }
        if (b->len + n > b->cap) {
            size_t cap = b->cap ? b->cap : 4096;
            while (cap < b->len + n)
                cap *= 2;
            uint8_t *p = malloc(cap);
            if (p == NULL)
                return -1;
            if (b->p != NULL) {
                memcpy(p, b->p, b->len);
                sodium_memzero(b->p, b->cap);
                free(b->p);
            }
            b->p = p;
            b->cap = cap;
        }
    }
    memcpy(b->p + b->off + b->len, d, n);
    b->len += n;
    return 0;
}

static int buf_puts(struct buf *b, const char *s)
{
    return buf_put(b, s, strlen(s));
}

static void buf_drop(struct buf *b, size_t n)
{
    if (n == 0)
        return;
    sodium_memzero(b->p + b->off, n);
    b->off += n;
    b->len -= n;
    if (b->len == 0)
        b->off = 0;
}

static uint8_t *buf_data(const struct buf *b)
{
    return b->p + b->off;
}

static void buf_free(struct buf *b)
{
    if (b->p != NULL) {
        sodium_memzero(b->p, b->cap);
        free(b->p);
    }
    memset(b, 0, sizeof(*b));
}

static void conn_free(sp_mitm_conn_t *c);
static void conn_schedule(sp_mitm_conn_t *c);

/* ---- request heads ---- */

/*
 * Writes the head of request r (read by http1.h) into out: the request line (in
 * origin form when origin: method, path, version), its field lines byte for
 * byte except those the rules set (and, with strip_proxy, the proxy's own),
 * then the rule headers with their secrets and the blank line. -1 with err and
 * *status (502: a rule's secret is missing, 500) and out left as it was.
 */
static int rewrite_head(sp_mitm_sb_t *sb, const char *host, const sp_http1_req_t *r, bool origin,
                        bool strip_proxy, struct buf *out, int *status, sp_err_t *err)
{
    const struct rule *rs[SP_SECRETS_RULES_MAX];
    size_t nr = sb != NULL ? sp_mitm__rules_for(sb, host, rs, SP_SECRETS_RULES_MAX) : 0;
    for (size_t i = 0; i < nr; i++) {
        if (rs[i]->value == NULL) {
            *status = 502;
            return sp_err_set(err, SP_EUNAVAIL,
                              "the credential rule for %.64s names secret '%s', which does not "
                              "exist or cannot be read",
                              host, rs[i]->secret);
        }
    }
    struct buf o = {0};
    int rc = -1;
    if (origin) {
        char ver[16];
        snprintf(ver, sizeof(ver), " HTTP/1.%d\r\n", r->minor);
        if (buf_put(&o, r->method.p, r->method.n) < 0 || buf_puts(&o, " ") < 0 ||
            ((r->path.n == 0 || r->path.p[0] == '?') && buf_puts(&o, "/") < 0) ||
            buf_put(&o, r->path.p, r->path.n) < 0 || buf_puts(&o, ver) < 0)
            goto oom;
    } else if (buf_put(&o, r->line.p, r->line.n) < 0 || buf_puts(&o, "\r\n") < 0) {
        goto oom;
    }
    for (size_t f = 0; f < r->nfields; f++) {
        const sp_http1_field_t *x = &r->fields[f];
        bool drop = false;
        for (size_t i = 0; i < nr && !drop; i++)
            drop = sp_http1_field_is(x, rs[i]->header);
        if (strip_proxy && (sp_http1_field_is(x, "Proxy-Connection") ||
                            sp_http1_field_is(x, "Proxy-Authorization")))
            drop = true;
        if (!drop && (buf_put(&o, x->line.p, x->line.n) < 0 || buf_puts(&o, "\r\n") < 0))
            goto oom;
    }
    for (size_t i = 0; i < nr; i++) {
        const char *at = strstr(rs[i]->format, "{secret}");
        if (buf_puts(&o, rs[i]->header) < 0 || buf_puts(&o, ": ") < 0 ||
            buf_put(&o, rs[i]->format, (size_t)(at - rs[i]->format)) < 0 ||
            buf_put(&o, rs[i]->value, rs[i]->value_len) < 0 || buf_puts(&o, at + 8) < 0 ||
            buf_puts(&o, "\r\n") < 0)
            goto oom;
    }
    if (buf_puts(&o, "\r\n") < 0 || buf_put(out, buf_data(&o), o.len) < 0)
        goto oom;
    rc = 0;
    goto out;
oom:
    *status = 500;
    sp_err_set(err, SP_EINTERNAL, "out of memory");
out:
    buf_free(&o);
    return rc;
}

int sp_mitm_rewrite_head(sp_mitm_sb_t *sb, const char *host, const char *head, size_t len,
                         char **out, size_t *out_len, sp_err_t *err)
{
    *out = NULL;
    *out_len = 0;
    char h[256];
    if (!sp_mitm__norm_host(host, h, sizeof(h)))
        return sp_err_set(err, SP_EINVAL, "bad destination host");
    if (!sp_mitm_wants(sb, h, 0))
        return 0;
    sp_http1_field_t fields[SP_HTTP1_MAX_FIELDS];
    sp_http1_req_t r;
    int rc = sp_http1_parse_head(head, len, HEAD_MAX, fields, SP_HTTP1_MAX_FIELDS, &r);
    if (rc == 0)
        return sp_err_set(err, SP_EINVAL, "request head is not terminated");
    if (rc < 0)
        return sp_err_set(err, SP_EINVAL, "%s", r.why);
    struct buf o = {0};
    int status;
    if (rewrite_head(sb, h, &r, false, false, &o, &status, err) < 0)
        return -1;
    /* Hand over a NUL-terminated copy of exactly the head. */
    char *s = malloc(o.len + 1);
    if (s == NULL) {
        buf_free(&o);
        return sp_err_set(err, SP_EINTERNAL, "out of memory");
    }
    memcpy(s, buf_data(&o), o.len);
    s[o.len] = '\0';
    *out = s;
    *out_len = o.len;
    buf_free(&o);
    return 0;
}

void sp_mitm_head_free(char *head, size_t len)
{
    sp_secrets_wipe(head, len + (head != NULL ? 1 : 0));
}

/* ---- conns ---- */

static void conn_fail(sp_mitm_conn_t *c, sp_code_t code, const char *msg)
{
    if (c->failed)
        return;
    c->failed = true;
    sp_err_set(&c->err, code, "%s", msg);
}

/* Queues plaintext for the guest (through TLS when the guest speaks it). */
static int guest_write(sp_mitm_conn_t *c, const void *p, size_t n)
{
    if (!c->tls)
        return buf_put(&c->gout, p, n);
    while (n > 0) {
        int w = SSL_write(c->gssl, p, n > INT32_MAX ? INT32_MAX : (int)n);
        if (w <= 0)
            return -1; /* a memory BIO never blocks: the session is broken */
        p = (const uint8_t *)p + w;
        n -= (size_t)w;
    }
    return 0;
}

/* Answers the guest's request with an error of our own and stops reading its requests. */
static void answer_error(sp_mitm_conn_t *c, int status, const char *msg)
{
    const char *reason = sp_mitm_http_reason(status);
    char body[300], head[256];
    int bl = snprintf(body, sizeof(body), "space egress: %s\n", msg);
    if (bl < 0 || (size_t)bl >= sizeof(body))
        bl = (int)strlen(body);
    int hl = snprintf(head, sizeof(head),
                      "HTTP/1.1 %d %s\r\nContent-Type: text/plain; charset=utf-8\r\n"
                      "Content-Length: %d\r\nConnection: close\r\n\r\n",
                      status, reason, bl);
    if (guest_write(c, head, (size_t)hl) < 0 || guest_write(c, body, (size_t)bl) < 0)
        conn_fail(c, SP_EINTERNAL, "cannot answer the guest");
    c->rq = RQ_DEAD;
    buf_drop(&c->gin, c->gin.len);
    conn_fail(c, status == 502 ? SP_EUNAVAIL : SP_EINVAL, msg);
}

/* answer_error with a message made by printf (cut to 199 bytes). */
static void answer_errorf(sp_mitm_conn_t *c, int status, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
static void answer_errorf(sp_mitm_conn_t *c, int status, const char *fmt, ...)
{
    char msg[200];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof(msg), fmt, ap);
    va_end(ap);
    answer_error(c, status, msg);
}

const char *sp_mitm_http_reason(int status)
{
    switch (status) {
    case 400:
        return "Bad Request";
    case 403:
        return "Forbidden";
    case 408:
        return "Request Timeout";
    case 421:
        return "Misdirected Request";
    case 431:
        return "Request Header Fields Too Large";
    case 501:
        return "Not Implemented"; /* the HTTP reason phrase: a method the proxy does not serve */
    case 502:
        return "Bad Gateway";
    case 503:
        return "Service Unavailable";
    case 504:
        return "Gateway Timeout";
    case 505:
        return "HTTP Version Not Supported";
    default:
        return "Internal Server Error";
    }
}

/* Whether an authority (host[:port]) names the conn's destination. A target without a port
 * means the scheme's (443 over TLS, else 80); a Host field without one is taken as the
 * connection's own (clients leave it out, and the name is what a server routes by). */
static bool names_us(const sp_mitm_conn_t *c, sp_http1_str_t au, bool host_field)
{
    sp_http1_authority_t a;
    char hp[300], h[256];
    if (sp_http1_authority(au.p, au.n, &a) < 0 || a.host.n >= sizeof(hp))
        return false;
    memcpy(hp, a.host.p, a.host.n);
    hp[a.host.n] = '\0';
    return sp_mitm__norm_host(hp, h, sizeof(h)) && strcmp(h, c->host) == 0 &&
           (a.has_port ? a.port : host_field ? c->port : c->tls ? 443 : 80) == c->port;
}

/* The destination every request on the conn names (its absolute-form or CONNECT target, and
 * its Host) must be the conn's, on every request of a kept-alive connection, in both modes: a
 * server that routes by Host (a CDN, a shared front end) must never get the rule's secret on a
 * request meant for another name. 1: an absolute-form target, to be sent in origin form; 0: keep
 * the request line; -1: another destination. */
static int req_target(const sp_mitm_conn_t *c, const sp_http1_req_t *r)
{
    if (r->host.p != NULL && !names_us(c, r->host, true))
        return -1;
    if (r->form == SP_HTTP1_AUTHORITY)
        return names_us(c, r->authority, false) ? 0 : -1;
    if (r->form != SP_HTTP1_ABSOLUTE)
        return 0;
    const char *scheme = c->tls ? "https" : "http";
    if (r->scheme.n != strlen(scheme) || strncasecmp(r->scheme.p, scheme, r->scheme.n) != 0 ||
        !names_us(c, r->authority, false))
        return -1;
    return 1;
}

static bool method_is(const sp_http1_req_t *r, const char *m)
{
    return r->method.n == strlen(m) && memcmp(r->method.p, m, r->method.n) == 0;
}

/* Parses what the guest sent into request bytes for the upstream. True on progress. */
static bool step_parse(sp_mitm_conn_t *c)
{
    bool progress = false;
    while (c->gin.len > 0 && c->uout.len < UP_OUT_MAX && !c->failed) {
        uint8_t *p = buf_data(&c->gin);
        size_t n = c->gin.len;
        switch (c->rq) {
        case RQ_HEAD: {
            /* Empty lines before a request are skipped by http1.h (RFC 9112 2.2). */
            sp_http1_field_t fields[SP_HTTP1_MAX_FIELDS];
            sp_http1_req_t r;
            int rc = sp_http1_parse_head(p, n, HEAD_MAX, fields, SP_HTTP1_MAX_FIELDS, &r);
            if (rc == 0)
                return progress;
            c->req_seen = true;
            if (rc < 0) {
                answer_error(c, r.status,
                             r.status == 431 && r.head_len == 0
                                 ? "request head is larger than 64 KiB"
                                 : r.why);
                return true;
            }
            if (c->up_error[0] != '\0') {
                answer_error(c, 502, c->up_error);
                return true;
            }
            if (!c->tls) {
                /* A secret never crosses the network in clear: rules apply over HTTPS only. */
                answer_errorf(c, 403,
                              "credentials for %.64s are added over HTTPS only; plain HTTP to it "
                              "is refused",
                              c->host);
                return true;
            }
            if (method_is(&r, "TRACE") || method_is(&r, "TRACK")) {
                /* They echo the request, injected header included, back to the guest. */
                answer_error(c, 405, "TRACE and TRACK are refused where credentials are added");
                return true;
            }
            int o = req_target(c, &r);
            if (o < 0) {
                answer_errorf(c, 421,
                              "this proxy connection carries credentials for %.64s only; open a "
                              "new one for another destination",
                              c->host);
                return true;
            }
            int status = 400;
            sp_err_t e;
            if (rewrite_head(c->sb, c->host, &r, o == 1, !c->tls, &c->uout, &status, &e) < 0) {
                answer_error(c, status, e.msg);
                return true;
            }
            buf_drop(&c->gin, r.head_len);
            /* CONNECT, or an upgrade without a body: what follows is not HTTP any
             * more. */
            if (r.connect || (r.upgrade && r.body == SP_HTTP1_BODY_NONE)) {
                c->rq = RQ_RAW;
            } else if (r.body == SP_HTTP1_BODY_CHUNKED) {
                c->rq = RQ_CHUNKED;
                sp_http1_chunked_init(&c->cs);
            } else if (r.body == SP_HTTP1_BODY_LENGTH) {
                c->rq = RQ_BODY;
                c->remaining = r.length;
            }
            progress = true;
            continue;
        }
        case RQ_BODY: {
            size_t k = n < c->remaining ? n : (size_t)c->remaining;
            if (buf_put(&c->uout, p, k) < 0) {
                conn_fail(c, SP_EINTERNAL, "out of memory");
                return true;
            }
            buf_drop(&c->gin, k);
            c->remaining -= k;
            if (c->remaining == 0)
                c->rq = RQ_HEAD;
            progress = true;
            continue;
        }
        case RQ_CHUNKED: {
            /* Passed on as it is scanned; bytes after a framing error never are. */
            size_t k = 0;
            const char *why = NULL;
            int rc = sp_http1_chunked_scan(&c->cs, p, n, &k, &why);
            if (buf_put(&c->uout, p, k) < 0) {
                conn_fail(c, SP_EINTERNAL, "out of memory");
                return true;
            }
            buf_drop(&c->gin, k);
            if (rc < 0) {
                answer_error(c, 400, why);
                return true;
            }
            if (rc == 1)
                c->rq = RQ_HEAD;
            progress = true;
            continue;
        }
        case RQ_RAW:
            if (buf_put(&c->uout, p, n) < 0) {
                conn_fail(c, SP_EINTERNAL, "out of memory");
                return true;
            }
            buf_drop(&c->gin, n);
            progress = true;
            continue;
        case RQ_DEAD:
            buf_drop(&c->gin, n);
            progress = true;
            continue;
        }
    }
    return progress;
}

/* Upstream failed: remember why; the guest hears it as a 502 to its next request. */
static void up_failed(sp_mitm_conn_t *c, const char *fmt, const char *detail)
{
    if (c->up_error[0] == '\0') {
        snprintf(c->up_error, sizeof(c->up_error), fmt, c->host, detail);
        sp_log(SP_LOG_INFO, "mitm", "upstream failed host=%s port=%u why=%s", c->host,
               (unsigned)c->port, c->up_error);
    }
    c->up_eof = true;
    if (c->watch != NULL)
        sp_watch_set(c->watch, 0);
    /* A response already reached the guest: the connection just ends. Otherwise the guest
     * gets the reason as a 502 to the request it sent or sends next. */
    if (c->relayed) {
        conn_fail(c, SP_EUNAVAIL, c->up_error);
    } else if (c->req_seen && c->rq != RQ_DEAD) {
        answer_error(c, 502, c->up_error);
    }
}

/* The upstream finished sending: fine after an answer, a failure before one. */
static void up_eof(sp_mitm_conn_t *c)
{
    if (!c->relayed)
        up_failed(c, "%s closed the connection without answering%s", "");
    c->up_eof = true;
}

static void ssl_fail_detail(SSL *ssl, int rc, char *out, size_t cap)
{
    long vr = SSL_get_verify_result(ssl);
    int e = SSL_get_error(ssl, rc);
    unsigned long q = ERR_peek_error();
    if (vr != X509_V_OK) {
        snprintf(out, cap, "certificate verification failed: %s",
                 X509_verify_cert_error_string(vr));
    } else if (e == SSL_ERROR_SYSCALL && q == 0) {
        snprintf(out, cap, "connection closed during the TLS handshake");
    } else {
        char b[200] = "";
        ERR_error_string_n(q, b, sizeof(b));
        const char *r = ERR_reason_error_string(q);
        snprintf(out, cap, "TLS handshake failed: %s", r != NULL ? r : b);
    }
    ERR_clear_error();
}

/* The upstream TLS session failed (rc: what the SSL call returned): why, as up_failed. */
static void up_ssl_failed(sp_mitm_conn_t *c, int rc)
{
    char why[160];
    ssl_fail_detail(c->ussl, rc, why, sizeof(why));
    up_failed(c, "upstream %s: %s", why);
}

/* What a step returns after SSL_read (reading) or SSL_write on the upstream returned rc <= 0:
 * progress so far when it only has to wait (wanting to write marks the connection for it);
 * true after the upstream's orderly close (reading: its EOF) or a failure. */
static bool up_ssl_stalled(sp_mitm_conn_t *c, int rc, bool reading, bool progress)
{
    int e = SSL_get_error(c->ussl, rc);
    if (e == SSL_ERROR_WANT_WRITE)
        c->uwant_write = true;
    if (e == SSL_ERROR_WANT_READ || e == SSL_ERROR_WANT_WRITE)
        return progress;
    if (reading && e == SSL_ERROR_ZERO_RETURN)
        up_eof(c);
    else
        up_ssl_failed(c, rc);
    return true;
}

/* Connect completion and the upstream TLS handshake. */
static bool step_upstream_connect(sp_mitm_conn_t *c)
{
    if (c->up_eof || c->up_error[0] != '\0')
        return false;
    if (!c->connected) {
        int soerr = 0;
        socklen_t sl = sizeof(soerr);
        if (getsockopt(c->fd, SOL_SOCKET, SO_ERROR, &soerr, &sl) < 0)
            soerr = errno;
        if (soerr != 0) {
            up_failed(c, "cannot connect to %s: %s", strerror(soerr));
            return true;
        }
        struct sockaddr_storage ss;
        socklen_t al = sizeof(ss);
        if (getpeername(c->fd, (struct sockaddr *)&ss, &al) < 0) {
            if (errno == ENOTCONN) {
                c->uwant_write = true; /* still connecting */
                return false;
            }
            up_failed(c, "cannot connect to %s: %s", strerror(errno));
            return true;
        }
        c->connected = true;
        c->uwant_write = false;
        if (!c->tls)
            c->uhs_done = true;
        return true;
    }
    if (c->uhs_done)
        return false;
    ERR_clear_error();
    int rc = SSL_connect(c->ussl);
    if (rc == 1) {
        c->uhs_done = true;
        c->uwant_write = false;
        return true;
    }
    int e = SSL_get_error(c->ussl, rc);
    if (e == SSL_ERROR_WANT_READ) {
        c->uwant_write = false;
        return false;
    }
    if (e == SSL_ERROR_WANT_WRITE) {
        c->uwant_write = true;
        return false;
    }
    up_ssl_failed(c, rc);
    return true;
}

static bool step_upstream_write(sp_mitm_conn_t *c)
{
    if (!c->uhs_done || c->up_error[0] != '\0' || c->up_shut)
        return false;
    bool progress = false;
    while (c->uout.len > 0) {
        size_t n = c->uout.len;
        ssize_t w;
        if (c->tls) {
            ERR_clear_error();
            int r = SSL_write(c->ussl, buf_data(&c->uout), n > 65536 ? 65536 : (int)n);
            if (r <= 0)
                return up_ssl_stalled(c, r, false, progress);
            w = r;
        } else {
            w = send(c->fd, buf_data(&c->uout), n, MSG_NOSIGNAL);
            if (w < 0) {
                if (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR) {
                    c->uwant_write = true;
                    return progress;
                }
                up_failed(c, "sending to %s failed: %s", strerror(errno));
                return true;
            }
        }
        buf_drop(&c->uout, (size_t)w);
        c->uwant_write = false;
        progress = true;
    }
    return progress;
}

static size_t guest_pending(const sp_mitm_conn_t *c)
{
    return c->gout.len + (c->gwbio != NULL ? BIO_ctrl_pending(c->gwbio) : 0);
}

static bool step_upstream_read(sp_mitm_conn_t *c)
{
    if (!c->uhs_done || c->up_eof || c->failed)
        return false;
    bool progress = false;
    uint8_t b[16384];
    while (guest_pending(c) < GUEST_OUT_MAX) {
        ssize_t r;
        if (c->tls) {
            ERR_clear_error();
            int x = SSL_read(c->ussl, b, sizeof(b));
            if (x <= 0)
                return up_ssl_stalled(c, x, true, progress);
            r = x;
        } else {
            r = recv(c->fd, b, sizeof(b), 0);
            if (r < 0) {
                if (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)
                    return progress;
                up_failed(c, "reading from %s failed: %s", strerror(errno));
                return true;
            }
            if (r == 0) {
                up_eof(c);
                return true;
            }
        }
        if (guest_write(c, b, (size_t)r) < 0) {
            conn_fail(c, SP_EINTERNAL, "the guest TLS session failed");
            return true;
        }
        c->relayed = true;
        progress = true;
    }
    return progress;
}

/* The guest's TLS: handshake, then its plaintext into gin. */
static bool step_guest_in(sp_mitm_conn_t *c)
{
    if (!c->tls || c->failed)
        return false;
    bool progress = false;
    if (!c->ghs_done) {
        ERR_clear_error();
        int rc = SSL_do_handshake(c->gssl);
        if (rc == 1) {
            c->ghs_done = true;
            progress = true;
        } else {
            int e = SSL_get_error(c->gssl, rc);
            if (e == SSL_ERROR_WANT_READ) {
                if (c->guest_eof && BIO_ctrl_pending(c->grbio) == 0)
                    conn_fail(c, SP_EINVAL, "the guest closed during the TLS handshake");
                return BIO_ctrl_pending(c->gwbio) > 0;
            }
            if (!c->failed) {
                /* Usually the guest refusing our certificate: it does not trust the
                 * sandbox CA (not installed, or a client with its own trust store). */
                char why[160];
                ssl_fail_detail(c->gssl, rc, why, sizeof(why));
                char msg[256];
                snprintf(msg, sizeof(msg), "guest TLS for %.64s: %s", c->host, why);
                sp_log(SP_LOG_INFO, "mitm", "guest handshake failed host=%s why=%s", c->host, why);
                conn_fail(c, SP_EINVAL, msg);
            }
            return true;
        }
    }
    uint8_t b[16384];
    while (c->gin.len < GUEST_IN_MAX && c->uout.len < UP_OUT_MAX && c->rq != RQ_DEAD) {
        ERR_clear_error();
        int x = SSL_read(c->gssl, b, sizeof(b));
        if (x <= 0) {
            int e = SSL_get_error(c->gssl, x);
            if (e == SSL_ERROR_WANT_READ)
                return progress;
            if (e == SSL_ERROR_ZERO_RETURN) {
                c->guest_eof = true; /* close_notify */
                return true;
            }
            conn_fail(c, SP_EINVAL, "the guest's TLS session failed");
            return true;
        }
        if (buf_put(&c->gin, b, (size_t)x) < 0) {
            sodium_memzero(b, sizeof(b));
            conn_fail(c, SP_EINTERNAL, "out of memory");
            return true;
        }
        progress = true;
    }
    sodium_memzero(b, sizeof(b));
    return progress;
}

/* Everything for the guest out through to_guest. */
static bool step_guest_out(sp_mitm_conn_t *c)
{
    bool progress = false;
    if (c->tls) {
        uint8_t b[16384];
        while (c->gout.len < GUEST_OUT_MAX && BIO_ctrl_pending(c->gwbio) > 0) {
            int n = BIO_read(c->gwbio, b, sizeof(b));
            if (n <= 0)
                break;
            if (buf_put(&c->gout, b, (size_t)n) < 0) {
                conn_fail(c, SP_EINTERNAL, "out of memory");
                return true;
            }
        }
    }
    while (c->gout.len > 0 && !c->guest_blocked && !c->dead) {
        size_t n = c->gout.len;
        size_t t = c->cbs.to_guest(c->arg, buf_data(&c->gout), n);
        if (c->dead)
            return true;
        if (t > n)
            t = n;
        buf_drop(&c->gout, t);
        if (t < n)
            c->guest_blocked = true;
        if (t > 0)
            progress = true;
        else
            break;
    }
    return progress;
}

/* Half-closes: the guest's end toward the upstream once its requests are out. */
static bool step_eofs(sp_mitm_conn_t *c)
{
    bool guest_done =
        c->guest_eof && (c->tls ? BIO_ctrl_pending(c->grbio) == 0 : true) && c->gin.len == 0;
    if (guest_done && !c->up_shut && c->uout.len == 0 && c->uhs_done && c->up_error[0] == '\0') {
        if (c->tls) {
            ERR_clear_error();
            int r = SSL_shutdown(c->ussl);
            if (r < 0) {
                int e = SSL_get_error(c->ussl, r);
                if (e == SSL_ERROR_WANT_WRITE) {
                    c->uwant_write = true;
                    return false;
                }
                ERR_clear_error();
            }
        }
        shutdown(c->fd, SHUT_WR);
        c->up_shut = true;
        sp_timer_start(&c->linger, LINGER_MS);
        return true;
    }
    return false;
}

static void conn_end(sp_mitm_conn_t *c, const sp_err_t *err)
{
    c->ended = true;
    sp_mitm_conn_cbs_t cbs = c->cbs;
    void *arg = c->arg;
    c->busy++;
    cbs.on_end(arg, err);
    c->busy--;
    c->dead = true; /* terminal: the conn is freed when the pump unwinds */
}

static void update_watch(sp_mitm_conn_t *c)
{
    if (c->watch == NULL)
        return;
    int ev = 0;
    if (!c->up_eof && c->up_error[0] == '\0' && !c->failed) {
        if (!c->connected || c->uwant_write || (c->uhs_done && c->uout.len > 0 && !c->up_shut))
            ev |= SP_IO_WRITE;
        if (c->connected && (!c->uhs_done || guest_pending(c) < GUEST_OUT_MAX))
            ev |= SP_IO_READ;
    }
    sp_watch_set(c->watch, ev);
}

static void pump(sp_mitm_conn_t *c)
{
    if (c->dead || c->ended)
        return;
    c->busy++;
    for (int i = 0; i < 256 && !c->dead; i++) {
        bool p = false;
        p |= step_upstream_connect(c);
        p |= step_guest_in(c);
        p |= step_parse(c);
        p |= step_upstream_write(c);
        p |= step_upstream_read(c);
        if (c->up_eof && c->up_error[0] == '\0' && c->tls && c->ghs_done && !c->gshut &&
            !c->failed && guest_pending(c) == 0) {
            SSL_shutdown(c->gssl); /* close_notify toward the guest */
            c->gshut = true;
            p = true;
        }
        if (c->dead)
            break;
        p |= step_guest_out(c);
        if (c->dead)
            break;
        p |= step_eofs(c);
        if (!p)
            break;
    }
    if (!c->dead && c->owed > 0) {
        size_t held = c->gin.len + (c->tls ? BIO_ctrl_pending(c->grbio) : 0);
        if (held < GUEST_IN_MAX || c->rq == RQ_DEAD) {
            size_t n = c->owed;
            c->owed = 0;
            c->cbs.consumed(c->arg, n);
        }
    }
    if (!c->dead) {
        bool drained = c->gout.len == 0 && (!c->tls || BIO_ctrl_pending(c->gwbio) == 0);
        bool guest_done =
            c->guest_eof && c->gin.len == 0 && (!c->tls || BIO_ctrl_pending(c->grbio) == 0);
        if (drained && c->failed) {
            conn_end(c, &c->err);
        } else if (drained && c->up_error[0] != '\0') {
            /* The guest gets the reason with its next request; without one, it left. */
            if (guest_done) {
                sp_err_t e;
                sp_err_set(&e, SP_EUNAVAIL, "%s", c->up_error);
                conn_end(c, &e);
            }
        } else if (drained && c->up_eof && (!c->tls || c->gshut)) {
            conn_end(c, NULL);
        }
    }
    if (!c->dead)
        update_watch(c);
    c->busy--;
    if (c->dead && c->busy == 0)
        conn_free(c);
}

static void on_timer(sp_timer_t *t, void *arg)
{
    pump(arg);
}

static void on_linger(sp_timer_t *t, void *arg)
{
    sp_mitm_conn_t *c = arg;
    /* The guest is gone and the upstream never finished: stop waiting. */
    c->up_eof = true;
    pump(c);
}

static void on_watch(sp_watch_t *w, int events, void *arg)
{
    pump(arg);
}

static void conn_schedule(sp_mitm_conn_t *c)
{
    if (!c->dead && !c->ended && !sp_timer_armed(&c->timer))
        sp_timer_start(&c->timer, 0);
}

sp_mitm_conn_t *sp_mitm_conn_create(sp_mitm_sb_t *sb, const char *host, uint16_t port, bool tls,
                                    int upstream_fd, const sp_mitm_conn_cbs_t *cbs, void *arg,
                                    sp_err_t *err)
{
    sp_mitm_conn_t *c = calloc(1, sizeof(*c));
    if (c == NULL) {
        close(upstream_fd);
        sp_err_set(err, SP_EINTERNAL, "out of memory");
        return NULL;
    }
    c->fd = upstream_fd;
    if (!sp_mitm__norm_host(host, c->host, sizeof(c->host)) || !sp_mitm_wants(sb, c->host, port)) {
        sp_err_set(err, SP_EINVAL, "no credential rule for this destination");
        goto fail;
    }
    c->sb = sb;
    c->loop = sb->m->loop;
    c->port = port;
    c->tls = tls;
    c->cbs = *cbs;
    c->arg = arg;
    if (tls) {
        SSL_CTX *lctx = sb->ca_cert != NULL ? sp_mitm__leaf_ctx(sb, c->host) : NULL;
        if (lctx == NULL) {
            sp_err_set(err, SP_EUNAVAIL,
                       "no certificate for this destination (sandbox CA "
                       "unavailable)");
            goto fail;
        }
        c->gssl = SSL_new(lctx);
        c->grbio = BIO_new(BIO_s_mem());
        c->gwbio = BIO_new(BIO_s_mem());
        c->ussl = SSL_new(sb->m->up_ctx);
        if (c->gssl == NULL || c->grbio == NULL || c->gwbio == NULL || c->ussl == NULL) {
            BIO_free(c->grbio);
            BIO_free(c->gwbio);
            c->grbio = c->gwbio = NULL;
            sp_err_set(err, SP_EINTERNAL, "out of memory");
            goto fail;
        }
        SSL_set_bio(c->gssl, c->grbio, c->gwbio); /* the SSL owns them now */
        SSL_set_accept_state(c->gssl);
        SSL_set_app_data(c->gssl, c);
        /* Full verification: chain to the trust store, and the name we connect for. */
        bool ip = sp_mitm__is_ip_literal(c->host);
        if ((!ip && SSL_set_tlsext_host_name(c->ussl, c->host) != 1) ||
            (!ip && SSL_set1_host(c->ussl, c->host) != 1) ||
            (ip && X509_VERIFY_PARAM_set1_ip_asc(SSL_get0_param(c->ussl), c->host) != 1) ||
            SSL_set_fd(c->ussl, c->fd) != 1) {
            sp_err_set(err, SP_EINTERNAL, "cannot set up the upstream TLS session");
            goto fail;
        }
        SSL_set_connect_state(c->ussl);
    }
    c->watch = sp_watch_create(c->loop, c->fd, on_watch, c);
    if (c->watch == NULL) {
        sp_err_set(err, SP_EINTERNAL, "cannot watch the upstream socket");
        goto fail;
    }
    sp_timer_init(&c->timer, c->loop, on_timer, c);
    sp_timer_init(&c->linger, c->loop, on_linger, c);
    c->next = sb->conns;
    if (sb->conns != NULL)
        sb->conns->prev = c;
    sb->conns = c;
    sp_watch_set(c->watch, SP_IO_WRITE);
    conn_schedule(c);
    return c;
fail:
    ERR_clear_error();
    SSL_free(c->gssl);
    SSL_free(c->ussl);
    close(c->fd);
    free(c);
    return NULL;
}

void sp_mitm_conn_from_guest(sp_mitm_conn_t *c, const uint8_t *p, size_t n)
{
    if (c == NULL || c->dead || c->ended || n == 0)
        return;
    c->owed += n;
    if (c->rq == RQ_DEAD) {
        conn_schedule(c); /* dropped after an error answer; acknowledged by the pump */
        return;
    }
    int rc = c->tls ? (BIO_write(c->grbio, p, (int)n) == (int)n ? 0 : -1) : buf_put(&c->gin, p, n);
    if (rc < 0)
        conn_fail(c, SP_EINTERNAL, "out of memory");
    conn_schedule(c);
}

void sp_mitm_conn_guest_eof(sp_mitm_conn_t *c)
{
    if (c == NULL || c->dead || c->ended)
        return;
    c->guest_eof = true;
    conn_schedule(c);
}

void sp_mitm_conn_guest_writable(sp_mitm_conn_t *c)
{
    if (c == NULL || c->dead || c->ended)
        return;
    c->guest_blocked = false;
    conn_schedule(c);
}

static void conn_free(sp_mitm_conn_t *c)
{
    if (c->sb != NULL) {
        if (c->prev != NULL)
            c->prev->next = c->next;
        else
            c->sb->conns = c->next;
        if (c->next != NULL)
            c->next->prev = c->prev;
    }
    sp_timer_stop(&c->timer);
    sp_timer_stop(&c->linger);
    sp_watch_destroy(c->watch);
    SSL_free(c->gssl);
    SSL_free(c->ussl);
    ERR_clear_error();
    close(c->fd);
    buf_free(&c->gin);
    buf_free(&c->gout);
    buf_free(&c->uout);
    free(c);
}

void sp_mitm_conn_destroy(sp_mitm_conn_t *c)
{
    if (c == NULL)
        return;
    if (c->dead) {
        return; /* already ending: freed when its pump unwinds */
    }
    c->dead = true;
    if (c->busy == 0)
        conn_free(c);
}
