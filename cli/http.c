/*
 * http.c - the blocking HTTP/1.1 client (http.h): sockets, TLS, request heads, response heads
 * and bodies.
 *
 * Every request has its own connection ("Connection: close" unless the caller upgrades), so
 * no state outlives a response. SIGPIPE must be ignored by the program: a server that closes
 * early turns a write into an error here, not a signal.
 */
#include "cli/http.h"

#include "base/chunked.h"

#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <openssl/err.h>
#include <openssl/ssl.h>
#include <openssl/x509v3.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/socket.h>
#include <unistd.h>

#include "base/text.h"

#define CONNECT_TIMEOUT_MS 10000
#define MAX_HEAD           (64 * 1024)
#define MAX_HEADERS        64
#define MAX_LINE           (16 * 1024 * 1024)
#define READ_CHUNK         (64 * 1024)

/* ---- URLs ---- */

int spc_url_parse(const char *s, spc_url_t *u, sp_err_t *err)
{
    memset(u, 0, sizeof(*u));
    const char *p;
    if (strncasecmp(s, "http://", 7) == 0) {
        p = s + 7;
    } else if (strncasecmp(s, "https://", 8) == 0) {
        u->tls = true;
        p = s + 8;
    } else {
        return sp_err_set(err, SP_EINVAL, "'%.100s' is not an http:// or https:// URL", s);
    }
    size_t alen = strcspn(p, "/?#");
    if (memchr(p, '@', alen) != NULL)
        return sp_err_set(err, SP_EINVAL, "the URL may not hold a user name (%.100s)", s);
    const char *hend, *port = NULL;
    if (p[0] == '[') {
        hend = memchr(p, ']', alen);
        if (hend == NULL)
            return sp_err_set(err, SP_EINVAL, "unclosed '[' in the URL %.100s", s);
        snprintf(u->host, sizeof(u->host), "%.*s", (int)(hend - p - 1), p + 1);
        if (hend + 1 < p + alen) {
            if (hend[1] != ':')
                return sp_err_set(err, SP_EINVAL, "bad host in the URL %.100s", s);
            port = hend + 2;
        }
    } else {
        hend = memchr(p, ':', alen);
        size_t hlen = hend ? (size_t)(hend - p) : alen;
        if (hlen >= sizeof(u->host))
            return sp_err_set(err, SP_EINVAL, "the host name in the URL is too long");
        snprintf(u->host, sizeof(u->host), "%.*s", (int)hlen, p);
        if (hend != NULL)
            port = hend + 1;
    }
    if (u->host[0] == '\0')
        return sp_err_set(err, SP_EINVAL, "the URL %.100s has no host", s);
    if (port != NULL) {
        size_t plen = (size_t)(p + alen - port);
        char *end;
        long v = strtol(port, &end, 10);
        if (plen == 0 || plen > 5 || end != p + alen || v < 1 || v > 65535)
            return sp_err_set(err, SP_EINVAL, "bad port in the URL %.100s", s);
        snprintf(u->port, sizeof(u->port), "%ld", v);
    } else {
        snprintf(u->port, sizeof(u->port), "%s", u->tls ? "443" : "80");
    }
    const char *path = p + alen;
    if (path[0] == '?' || path[0] == '#')
        return sp_err_set(err, SP_EINVAL, "the URL may not have a query or fragment (%.100s)", s);
    size_t plen = strlen(path);
    while (plen > 0 && path[plen - 1] == '/')
        plen--;
    if (plen >= sizeof(u->prefix) || strpbrk(path, "?# \t\r\n") != NULL)
        return sp_err_set(err, SP_EINVAL, "bad path in the URL %.100s", s);
    snprintf(u->prefix, sizeof(u->prefix), "%.*s", (int)plen, path);
    snprintf(u->text, sizeof(u->text), "%s", s);
    return 0;
}

void spc_urlencode(sp_buf_t *b, const char *s)
{
    static const char hex[] = "0123456789ABCDEF";
    for (const unsigned char *p = (const unsigned char *)s; *p; p++) {
        if ((*p >= 'a' && *p <= 'z') || (*p >= 'A' && *p <= 'Z') || (*p >= '0' && *p <= '9') ||
            *p == '-' || *p == '.' || *p == '_' || *p == '~') {
            sp_buf_add(b, p, 1);
        } else {
            char e[3] = {'%', hex[*p >> 4], hex[*p & 15]};
            sp_buf_add(b, e, 3);
        }
    }
}

/* ---- lines ---- */

void spc_lines_init(spc_lines_t *l, size_t max_line)
{
    memset(l, 0, sizeof(*l));
    l->max = max_line;
}

void spc_lines_free(spc_lines_t *l)
{
    sp_buf_free(&l->buf);
    l->start = l->scan = 0;
}

int spc_lines_push(spc_lines_t *l, const void *p, size_t n)
{
    if (l->start > 0) { /* what was handed out is no longer needed */
        sp_buf_consume(&l->buf, l->start);
        l->scan -= l->start;
        l->start = 0;
    }
    sp_buf_add(&l->buf, p, n);
    return l->buf.oom ? -1 : 0;
}

static bool blank(const char *s, size_t n)
{
    for (size_t i = 0; i < n; i++)
        if (s[i] != ' ' && s[i] != '\t' && s[i] != '\r')
            return false;
    return true;
}

int spc_lines_next(spc_lines_t *l, bool at_end, const char **line, size_t *len)
{
    for (;;) {
        size_t from = l->scan > l->start ? l->scan : l->start;
        const uint8_t *nl =
            from < l->buf.len ? memchr(l->buf.p + from, '\n', l->buf.len - from) : NULL;
        const char *s = (const char *)l->buf.p + l->start;
        size_t n;
        if (nl == NULL) {
            l->scan = l->buf.len;
            n = l->buf.len - l->start;
            if (n > l->max)
                return -1;
            if (!at_end || n == 0)
                return 0;
            l->start = l->buf.len; /* the last line, without a newline */
        } else {
            size_t e = (size_t)(nl - l->buf.p);
            n = e - l->start;
            l->start = l->scan = e + 1;
            if (n > l->max)
                return -1;
        }
        if (n > 0 && s[n - 1] == '\r')
            n--;
        if (blank(s, n))
            continue;
        *line = s;
        *len = n;
        return 1;
    }
}

/* ---- connections ---- */

struct spc_conn {
    int fd;
    SSL_CTX *ctx;
    SSL *ssl;
    bool nonblock;
    int timeout_ms; /* blocking reads: give up after this long without a byte (0: never) */
    char url[600];  /* for messages */
};

void spc_conn_close(spc_conn_t *c)
{
    if (c == NULL)
        return;
    if (c->ssl != NULL)
        SSL_free(c->ssl);
    if (c->ctx != NULL)
        SSL_CTX_free(c->ctx);
    if (c->fd >= 0)
        close(c->fd);
    free(c);
}

int spc_conn_fd(const spc_conn_t *c)
{
    return c->fd;
}

bool spc_conn_pending(const spc_conn_t *c)
{
    return c->ssl != NULL && SSL_pending(c->ssl) > 0;
}

int spc_conn_set_nonblocking(spc_conn_t *c)
{
    int fl = fcntl(c->fd, F_GETFL);
    if (fl < 0 || fcntl(c->fd, F_SETFL, fl | O_NONBLOCK) < 0)
        return -1;
    c->nonblock = true;
    return 0;
}

/* The TLS library's last reason, for a message. */
static const char *tls_reason(void)
{
    unsigned long e = ERR_peek_last_error();
    const char *r = e ? ERR_reason_error_string(e) : NULL;
    return r ? r : "the connection failed";
}

static int connect_fd(const spc_url_t *u, sp_err_t *err)
{
    struct addrinfo hints = {.ai_family = AF_UNSPEC, .ai_socktype = SOCK_STREAM}, *res = NULL;
    int rc = getaddrinfo(u->host, u->port, &hints, &res);
    if (rc != 0)
        return sp_err_set(err, SP_EUNAVAIL, "cannot reach the server at %.100s: %s", u->text,
                          gai_strerror(rc));
    int fd = -1, why = ECONNREFUSED;
    for (struct addrinfo *ai = res; ai != NULL && fd < 0; ai = ai->ai_next) {
        fd = socket(ai->ai_family, ai->ai_socktype | SOCK_CLOEXEC | SOCK_NONBLOCK,
                    ai->ai_protocol);
        if (fd < 0) {
            why = errno;
            continue;
        }
        if (connect(fd, ai->ai_addr, ai->ai_addrlen) < 0 && errno != EINPROGRESS) {
            why = errno;
        } else {
            struct pollfd pf = {.fd = fd, .events = POLLOUT};
            int k;
            while ((k = poll(&pf, 1, CONNECT_TIMEOUT_MS)) < 0 && errno == EINTR)
                ;
            socklen_t sl = sizeof(why);
            if (k == 0)
                why = ETIMEDOUT;
            else if (k < 0 || getsockopt(fd, SOL_SOCKET, SO_ERROR, &why, &sl) < 0)
                why = errno;
            if (k > 0 && why == 0)
                break; /* connected */
        }
        close(fd);
        fd = -1;
    }
    freeaddrinfo(res);
    if (fd < 0)
        return sp_err_set(err, SP_EUNAVAIL, "cannot reach the server at %.100s: %s", u->text,
                          strerror(why));
    int fl = fcntl(fd, F_GETFL), one = 1;
    fcntl(fd, F_SETFL, fl & ~O_NONBLOCK);
    /* Keystrokes of an interactive shell go out one by one. */
    setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
    setsockopt(fd, SOL_SOCKET, SO_KEEPALIVE, &one, sizeof(one));
    return fd;
}

static int tls_start(spc_conn_t *c, const spc_url_t *u, sp_err_t *err)
{
    c->ctx = SSL_CTX_new(TLS_client_method());
    if (c->ctx == NULL)
        return sp_err_set(err, SP_EINTERNAL, "TLS: %s", tls_reason());
    SSL_CTX_set_min_proto_version(c->ctx, TLS1_2_VERSION);
    /* A server that closes without close_notify has still ended its (length-framed) answer. */
    SSL_CTX_set_options(c->ctx, SSL_OP_IGNORE_UNEXPECTED_EOF);
    SSL_CTX_set_mode(c->ctx, SSL_MODE_ENABLE_PARTIAL_WRITE | SSL_MODE_ACCEPT_MOVING_WRITE_BUFFER);
    const char *ca = getenv("SPACE_CA_FILE");
    if (ca != NULL && ca[0] != '\0') {
        if (SSL_CTX_load_verify_locations(c->ctx, ca, NULL) != 1)
            return sp_err_set(err, SP_EINVAL, "cannot load the CA certificates in %.100s "
                                              "(SPACE_CA_FILE)", ca);
    } else if (SSL_CTX_set_default_verify_paths(c->ctx) != 1) {
        return sp_err_set(err, SP_EINTERNAL, "TLS: no CA certificates: %s", tls_reason());
    }
    SSL_CTX_set_verify(c->ctx, SSL_VERIFY_PEER, NULL);
    c->ssl = SSL_new(c->ctx);
    if (c->ssl == NULL || SSL_set_fd(c->ssl, c->fd) != 1)
        return sp_err_set(err, SP_EINTERNAL, "TLS: %s", tls_reason());
    unsigned char addr[16];
    bool is_ip = inet_pton(AF_INET, u->host, addr) == 1 || inet_pton(AF_INET6, u->host, addr) == 1;
    if (is_ip) {
        X509_VERIFY_PARAM_set1_ip_asc(SSL_get0_param(c->ssl), u->host);
    } else {
        SSL_set_tlsext_host_name(c->ssl, u->host);
        SSL_set1_host(c->ssl, u->host);
    }
    ERR_clear_error();
    if (SSL_connect(c->ssl) != 1) {
        long v = SSL_get_verify_result(c->ssl);
        return sp_err_set(err, SP_EUNAVAIL, "TLS with %.100s failed: %s", u->text,
                          v != X509_V_OK ? X509_verify_cert_error_string(v) : tls_reason());
    }
    return 0;
}

static spc_conn_t *conn_open(const spc_url_t *u, sp_err_t *err)
{
    spc_conn_t *c = calloc(1, sizeof(*c));
    if (c == NULL) {
        sp_err_set(err, SP_EINTERNAL, "out of memory");
        return NULL;
    }
    snprintf(c->url, sizeof(c->url), "%s", u->text);
    c->fd = connect_fd(u, err);
    if (c->fd < 0 || (u->tls && tls_start(c, u, err) < 0)) {
        spc_conn_close(c);
        return NULL;
    }
    return c;
}

/* Blocking reads with a timeout: waits for the socket (unless TLS holds bytes already). */
static int wait_readable(spc_conn_t *c, sp_err_t *err)
{
    if (c->nonblock || c->timeout_ms <= 0 || spc_conn_pending(c))
        return 0;
    struct pollfd pf = {.fd = c->fd, .events = POLLIN};
    int k;
    while ((k = poll(&pf, 1, c->timeout_ms)) < 0 && errno == EINTR)
        ;
    if (k == 0)
        return sp_err_set(err, SP_EUNAVAIL, "the server at %.100s did not answer within %d s",
                          c->url, c->timeout_ms / 1000);
    return 0;
}

/*
 * One read or write of up to n bytes, over TLS or the plain socket: the count, 0 when a read
 * meets the end, -2 when a nonblocking connection would block, -1 with err set. Interrupted
 * calls are retried; so are a blocking TLS connection's wants (a renegotiation's round trip).
 */
static long conn_io(spc_conn_t *c, void *p, size_t n, bool sending, sp_err_t *err)
{
    if (n > INT_MAX)
        n = INT_MAX;
    for (;;) {
        if (!sending && wait_readable(c, err) < 0)
            return -1;
        if (c->ssl != NULL) {
            ERR_clear_error();
            int k = sending ? SSL_write(c->ssl, p, (int)n) : SSL_read(c->ssl, p, (int)n);
            if (k > 0)
                return k;
            int e = SSL_get_error(c->ssl, k);
            if (e == SSL_ERROR_ZERO_RETURN && !sending)
                return 0;
            if (e == SSL_ERROR_WANT_READ || e == SSL_ERROR_WANT_WRITE) {
                if (c->nonblock)
                    return -2;
                continue;
            }
            if (e != SSL_ERROR_SYSCALL) {
                sp_err_set(err, SP_EUNAVAIL, "connection to %.100s failed: %s", c->url,
                           tls_reason());
                return -1;
            }
        } else {
            ssize_t k = sending ? send(c->fd, p, n, MSG_NOSIGNAL) : recv(c->fd, p, n, 0);
            if (k >= 0)
                return (long)k;
            if (errno == EAGAIN || errno == EWOULDBLOCK)
                return -2;
        }
        if (errno == EINTR)
            continue;
        sp_err_set(err, SP_EUNAVAIL, "connection to %.100s failed: %s", c->url, strerror(errno));
        return -1;
    }
}

long spc_conn_read(spc_conn_t *c, void *p, size_t n, sp_err_t *err)
{
    return conn_io(c, p, n, false, err);
}

long spc_conn_write(spc_conn_t *c, const void *p, size_t n, sp_err_t *err)
{
    return conn_io(c, (void *)p, n, true, err); /* a write only reads p */
}

static int write_all(spc_conn_t *c, const void *p, size_t n, sp_err_t *err)
{
    const uint8_t *b = p;
    while (n > 0) {
        long k = spc_conn_write(c, b, n, err);
        if (k < 0)
            return -1; /* blocking: -2 cannot happen */
        b += k;
        n -= (size_t)k;
    }
    return 0;
}

/* ---- responses ---- */

enum { B_NONE, B_LENGTH, B_CHUNKED, B_EOF };

struct spc_resp {
    spc_conn_t *conn;
    int status;
    char *head; /* the header block, lines split with NULs */
    const char *hname[MAX_HEADERS], *hval[MAX_HEADERS];
    int nh;
    sp_buf_t in; /* read ahead: in.p[off, in.len) is not consumed yet */
    size_t off;
    int mode;
    long long length;
    uint64_t left;
    sp_chunked_t ck;
    bool done;     /* the body's end was read */
    bool lines_on; /* spc_resp_line in use */
    spc_lines_t lines;
};

void spc_resp_free(spc_resp_t *r)
{
    if (r == NULL)
        return;
    spc_conn_close(r->conn);
    free(r->head);
    sp_buf_free(&r->in);
    spc_lines_free(&r->lines);
    free(r);
}

int spc_resp_status(const spc_resp_t *r)
{
    return r->status;
}

const char *spc_resp_header(const spc_resp_t *r, const char *name)
{
    for (int i = 0; i < r->nh; i++)
        if (strcasecmp(r->hname[i], name) == 0)
            return r->hval[i];
    return NULL;
}

long long spc_resp_length(const spc_resp_t *r)
{
    return r->mode == B_LENGTH ? r->length : -1;
}

/* Reads more into r->in: bytes read, 0 at the peer's end, -1. */
static long fill(spc_resp_t *r, sp_err_t *err)
{
    if (r->off == r->in.len) {
        r->in.len = 0;
        r->off = 0;
    }
    uint8_t *p = sp_buf_reserve(&r->in, READ_CHUNK);
    if (p == NULL)
        return sp_err_set(err, SP_EINTERNAL, "out of memory");
    long k = spc_conn_read(r->conn, p, READ_CHUNK, err);
    if (k > 0)
        sp_buf_commit(&r->in, (size_t)k);
    return k;
}

/* Parses the head in[off, off + len) (len includes the blank line). */
static int parse_head(spc_resp_t *r, size_t len, sp_err_t *err)
{
    free(r->head);
    r->head = malloc(len + 1);
    if (r->head == NULL)
        return sp_err_set(err, SP_EINTERNAL, "out of memory");
    memcpy(r->head, r->in.p + r->off, len);
    r->head[len] = '\0';
    r->off += len;
    r->nh = 0;
    char *save = NULL, *line = strtok_r(r->head, "\n", &save);
    int major, minor, status;
    if (line == NULL || sscanf(line, "HTTP/%d.%d %d", &major, &minor, &status) != 3 ||
        status < 100 || status > 999)
        return sp_err_set(err, SP_EUNAVAIL, "the server at %.100s does not speak HTTP/1.1",
                          r->conn->url);
    r->status = status;
    while ((line = strtok_r(NULL, "\n", &save)) != NULL) {
        char *colon = strchr(line, ':');
        if (colon == NULL || r->nh == MAX_HEADERS)
            continue;
        *colon = '\0';
        r->hname[r->nh] = sp_text_trim(line);
        r->hval[r->nh] = sp_text_trim(colon + 1);
        r->nh++;
    }
    return 0;
}

static int read_head(spc_resp_t *r, const char *method, sp_err_t *err)
{
    for (;;) {
        const uint8_t *end = NULL;
        for (;;) {
            size_t avail = r->in.len - r->off;
            if (avail >= 4)
                end = memmem(r->in.p + r->off, avail, "\r\n\r\n", 4);
            if (end != NULL)
                break;
            if (avail > MAX_HEAD)
                return sp_err_set(err, SP_EUNAVAIL, "the server's answer head is too large");
            long k = fill(r, err);
            if (k < 0)
                return -1;
            if (k == 0)
                return sp_err_set(err, SP_EUNAVAIL,
                                  "the server at %.100s closed the connection without an answer",
                                  r->conn->url);
        }
        if (parse_head(r, (size_t)(end + 4 - (r->in.p + r->off)), err) < 0)
            return -1;
        if (r->status >= 200 || r->status == 101)
            break;
        /* 100 Continue and other interim answers: the real one follows. */
    }
    const char *te = spc_resp_header(r, "transfer-encoding");
    const char *cl = spc_resp_header(r, "content-length");
    if (r->status == 101 || r->status == 204 || r->status == 304 || strcmp(method, "HEAD") == 0) {
        r->mode = B_NONE;
        r->done = true;
    } else if (te != NULL && strcasestr(te, "chunked") != NULL) {
        r->mode = B_CHUNKED;
    } else if (cl != NULL) {
        char *e;
        long long v = strtoll(cl, &e, 10);
        if (cl[0] == '\0' || *e != '\0' || v < 0)
            return sp_err_set(err, SP_EUNAVAIL, "the server sent a bad Content-Length");
        r->mode = B_LENGTH;
        r->length = v;
        r->left = (uint64_t)v;
        r->done = v == 0;
    } else {
        r->mode = B_EOF;
    }
    return 0;
}

static bool has_header(const char *const *h, const char *name)
{
    size_t n = strlen(name);
    for (; h != NULL && *h != NULL; h++)
        if (strncasecmp(*h, name, n) == 0 && (*h)[n] == ':')
            return true;
    return false;
}

/* Streams the request body from rq->body_fd. */
static int send_fd_body(spc_conn_t *c, const spc_req_t *rq, sp_err_t *err)
{
    enum { CHUNK = 256 * 1024 };
    uint8_t *buf = malloc(CHUNK);
    if (buf == NULL)
        return sp_err_set(err, SP_EINTERNAL, "out of memory");
    uint64_t sent = 0;
    int rc = 0;
    while (rc == 0 && sent < rq->body_len) {
        size_t want = rq->body_len - sent < CHUNK ? (size_t)(rq->body_len - sent) : CHUNK;
        ssize_t k = read(rq->body_fd, buf, want);
        if (k < 0 && errno == EINTR)
            continue;
        if (k < 0)
            rc = sp_err_set(err, SP_EINVAL, "reading the file to send: %s", strerror(errno));
        else if (k == 0)
            rc = sp_err_set(err, SP_EINVAL, "the file got shorter while it was sent");
        else if ((rc = write_all(c, buf, (size_t)k, err)) == 0) {
            sent += (uint64_t)k;
            if (rq->progress != NULL)
                rq->progress(rq->progress_arg, sent);
        }
    }
    free(buf);
    return rc;
}

spc_resp_t *spc_http_send(const spc_url_t *u, const spc_req_t *rq, sp_err_t *err)
{
    spc_resp_t *r = calloc(1, sizeof(*r));
    if (r == NULL) {
        sp_err_set(err, SP_EINTERNAL, "out of memory");
        return NULL;
    }
    r->conn = conn_open(u, err);
    if (r->conn == NULL) {
        spc_resp_free(r);
        return NULL;
    }
    r->conn->timeout_ms = rq->timeout_ms;
    sp_buf_t h = SP_BUF_INIT;
    bool v6 = strchr(u->host, ':') != NULL;
    bool dflt = strcmp(u->port, u->tls ? "443" : "80") == 0;
    sp_buf_printf(&h, "%s %s%s HTTP/1.1\r\nHost: %s%s%s%s%s\r\nUser-Agent: spacectl\r\n",
                  rq->method, u->prefix, rq->path, v6 ? "[" : "", u->host, v6 ? "]" : "",
                  dflt ? "" : ":", dflt ? "" : u->port);
    if (!has_header(rq->headers, "Connection"))
        sp_buf_str(&h, "Connection: close\r\n");
    if (rq->bearer != NULL)
        sp_buf_printf(&h, "Authorization: Bearer %s\r\n", rq->bearer);
    bool body = rq->body != NULL || rq->body_from_fd;
    if (body && rq->content_type != NULL)
        sp_buf_printf(&h, "Content-Type: %s\r\n", rq->content_type);
    if (body || strcmp(rq->method, "POST") == 0 || strcmp(rq->method, "PUT") == 0)
        sp_buf_printf(&h, "Content-Length: %zu\r\n", body ? rq->body_len : 0);
    for (const char *const *x = rq->headers; x != NULL && *x != NULL; x++)
        sp_buf_printf(&h, "%s\r\n", *x);
    sp_buf_str(&h, "\r\n");
    int rc = h.oom ? sp_err_set(err, SP_EINTERNAL, "out of memory")
                   : write_all(r->conn, h.p, h.len, err);
    sp_buf_free(&h);
    if (rc == 0 && rq->body != NULL && rq->body_len > 0)
        rc = write_all(r->conn, rq->body, rq->body_len, err);
    else if (rc == 0 && rq->body_from_fd)
        rc = send_fd_body(r->conn, rq, err);
    if (rc < 0 && err != NULL && err->code == SP_EUNAVAIL) {
        /* The server may have answered (401, 413...) and closed before taking the whole
         * body: its answer says more than our broken pipe. */
        sp_err_t e2;
        if (read_head(r, rq->method, &e2) == 0)
            return r;
    }
    if (rc < 0 || read_head(r, rq->method, err) < 0) {
        spc_resp_free(r);
        return NULL;
    }
    return r;
}

long spc_resp_read(spc_resp_t *r, void *p, size_t n, sp_err_t *err)
{
    if (n == 0)
        return 0;
    for (;;) {
        if (r->done)
            return 0;
        size_t avail = r->in.len - r->off;
        if (avail > 0) {
            const uint8_t *src = r->in.p + r->off;
            if (r->mode == B_CHUNKED) {
                size_t used, dlen;
                const uint8_t *d;
                int rc = sp_chunked_step(&r->ck, src, avail, n, &used, &d, &dlen);
                if (rc < 0) {
                    sp_err_set(err, SP_EUNAVAIL, "the server sent a bad chunked body");
                    return -1;
                }
                if (dlen > 0)
                    memmove(p, d, dlen);
                r->off += used;
                r->done = rc == 1;
                if (dlen > 0)
                    return (long)dlen;
                continue;
            }
            size_t take = avail < n ? avail : n;
            if (r->mode == B_LENGTH && take > r->left)
                take = (size_t)r->left;
            memcpy(p, src, take);
            r->off += take;
            if (r->mode == B_LENGTH) {
                r->left -= take;
                r->done = r->left == 0;
            }
            return (long)take;
        }
        long k = fill(r, err);
        if (k < 0)
            return -1;
        if (k == 0) {
            if (r->mode == B_EOF) {
                r->done = true;
                return 0;
            }
            sp_err_set(err, SP_EUNAVAIL, "the server at %.100s closed the connection before "
                                         "the end of its answer",
                       r->conn->url);
            return -1;
        }
    }
}

int spc_resp_read_all(spc_resp_t *r, sp_buf_t *out, size_t max, sp_err_t *err)
{
    for (;;) {
        uint8_t *p = sp_buf_reserve(out, READ_CHUNK);
        if (p == NULL)
            return sp_err_set(err, SP_EINTERNAL, "out of memory");
        long k = spc_resp_read(r, p, READ_CHUNK, err);
        if (k < 0)
            return -1;
        if (k == 0)
            return 0;
        sp_buf_commit(out, (size_t)k);
        if (out->len > max)
            return sp_err_set(err, SP_ETOOBIG, "the server's answer is larger than %zu bytes",
                              max);
    }
}

int spc_resp_line(spc_resp_t *r, const char **line, size_t *len, sp_err_t *err)
{
    if (!r->lines_on) {
        spc_lines_init(&r->lines, MAX_LINE);
        r->lines_on = true;
    }
    for (;;) {
        int rc = spc_lines_next(&r->lines, r->done, line, len);
        if (rc != 0)
            return rc > 0 ? 1
                          : sp_err_set(err, SP_ETOOBIG, "a line of the server's answer is "
                                                        "longer than 16 MiB");
        if (r->done)
            return 0;
        char buf[READ_CHUNK];
        long k = spc_resp_read(r, buf, sizeof(buf), err);
        if (k < 0)
            return -1;
        if (k > 0 && spc_lines_push(&r->lines, buf, (size_t)k) < 0)
            return sp_err_set(err, SP_EINTERNAL, "out of memory");
    }
}

spc_conn_t *spc_resp_take_conn(spc_resp_t *r, sp_buf_t *leftover)
{
    if (r->in.len > r->off)
        sp_buf_add(leftover, r->in.p + r->off, r->in.len - r->off);
    r->off = r->in.len;
    spc_conn_t *c = r->conn;
    r->conn = NULL;
    c->timeout_ms = 0;
    return c;
}
