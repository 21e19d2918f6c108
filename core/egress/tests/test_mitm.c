/*
 * test_mitm.c - credential injection (core/egress/mitm.h) end to end on the host: a sandbox with
 * rules in a real PostgreSQL, its CA created and stored, a "guest" TLS client driven over
 * memory buffers the way the agent stream feeds the proxy, and loopback upstream servers
 * (TLS with a test CA, a rogue certificate, a wrong name, plain HTTP) run on a thread.
 */
#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <openssl/err.h>
#include <openssl/pem.h>
#include <openssl/ssl.h>
#include <openssl/x509v3.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <sodium.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include "core/egress/mitm.h"
#include "core/egress/secrets.h"
#include "core/store/store.h"
#include "core/egress/tests/secrets_fixture.h"

#define SECRET  "s3cr3t-VALUE-9f8e7d6c5b4a"
#define SECRET2 "second-KEY-1234567890"

/* ---- test PKI ---- */

static EVP_PKEY *gen_key(void)
{
    return EVP_EC_gen("P-256");
}

static int ext(X509 *cert, X509 *issuer, int nid, const char *v)
{
    X509V3_CTX ctx;
    X509V3_set_ctx_nodb(&ctx);
    X509V3_set_ctx(&ctx, issuer, cert, NULL, NULL, 0);
    X509_EXTENSION *e = X509V3_EXT_conf_nid(NULL, &ctx, nid, v);
    if (e == NULL)
        return -1;
    X509_add_ext(cert, e, -1);
    X509_EXTENSION_free(e);
    return 0;
}

/* A certificate for cn (SAN san) signed by issuer/ikey, or self-signed when issuer is NULL. */
static X509 *make_cert(const char *cn, const char *san, bool ca, EVP_PKEY *key, X509 *issuer,
                       EVP_PKEY *ikey)
{
    X509 *c = X509_new();
    X509_set_version(c, 2);
    ASN1_INTEGER_set(X509_get_serialNumber(c), (long)randombytes_uniform(1u << 30) + 1);
    X509_NAME_add_entry_by_txt(X509_get_subject_name(c), "CN", MBSTRING_ASC,
                               (const unsigned char *)cn, -1, -1, 0);
    X509_set_issuer_name(c, issuer ? X509_get_subject_name(issuer) : X509_get_subject_name(c));
    X509_gmtime_adj(X509_getm_notBefore(c), -3600);
    X509_gmtime_adj(X509_getm_notAfter(c), 86400);
    X509_set_pubkey(c, key);
    X509 *is = issuer ? issuer : c;
    if (ca) {
        ext(c, is, NID_basic_constraints, "critical,CA:TRUE");
        ext(c, is, NID_key_usage, "critical,keyCertSign");
    } else {
        ext(c, is, NID_subject_alt_name, san);
        ext(c, is, NID_ext_key_usage, "serverAuth");
    }
    X509_sign(c, issuer ? ikey : key, EVP_sha256());
    return c;
}

static SSL_CTX *server_ctx(X509 *cert, EVP_PKEY *key)
{
    SSL_CTX *ctx = SSL_CTX_new(TLS_server_method());
    SSL_CTX_use_certificate(ctx, cert);
    SSL_CTX_use_PrivateKey(ctx, key);
    return ctx;
}

/* ---- upstream servers (a thread, blocking I/O) ---- */

#define MAXREQ 16

struct reqlog {
    char target[256];
    char auth[256];
    int auth_count;
    char xkey[256];
    size_t body_len;
    unsigned long body_sum;
    char body_head[64];
    int conn;
};

struct server {
    int lfd;
    int port;
    SSL_CTX *ctx; /* NULL: plain HTTP */
    pthread_t th;
    volatile int stop;
    pthread_mutex_t mu;
    int conns;
    int handshakes_failed;
    int nreq;
    struct reqlog req[MAXREQ];
};

struct rd {
    SSL *ssl;
    int fd;
    char buf[65536];
    size_t len;
};

static int rd_fill(struct rd *r)
{
    if (r->len == sizeof(r->buf))
        return -1;
    int n = r->ssl ? SSL_read(r->ssl, r->buf + r->len, (int)(sizeof(r->buf) - r->len))
                   : (int)recv(r->fd, r->buf + r->len, sizeof(r->buf) - r->len, 0);
    if (n <= 0)
        return -1;
    r->len += (size_t)n;
    return 0;
}

static void rd_drop(struct rd *r, size_t n)
{
    memmove(r->buf, r->buf + n, r->len - n);
    r->len -= n;
}

/* A line (without CRLF) into out; -1 at EOF. */
static int rd_line(struct rd *r, char *out, size_t cap)
{
    for (;;) {
        char *nl = memchr(r->buf, '\n', r->len);
        if (nl != NULL) {
            size_t l = (size_t)(nl - r->buf);
            size_t tl = l > 0 && r->buf[l - 1] == '\r' ? l - 1 : l;
            snprintf(out, cap, "%.*s", (int)tl, r->buf);
            rd_drop(r, l + 1);
            return 0;
        }
        if (rd_fill(r) < 0)
            return -1;
    }
}

static int rd_body(struct rd *r, size_t n, struct reqlog *q)
{
    while (n > 0) {
        if (r->len == 0 && rd_fill(r) < 0)
            return -1;
        size_t k = r->len < n ? r->len : n;
        for (size_t i = 0; i < k; i++) {
            q->body_sum += (unsigned char)r->buf[i];
            if (q->body_len + i < sizeof(q->body_head) - 1)
                q->body_head[q->body_len + i] = r->buf[i];
        }
        q->body_len += k;
        rd_drop(r, k);
        n -= k;
    }
    return 0;
}

static int wr(struct rd *r, const char *p, size_t n)
{
    return r->ssl ? (SSL_write(r->ssl, p, (int)n) == (int)n ? 0 : -1)
                  : (send(r->fd, p, n, MSG_NOSIGNAL) == (ssize_t)n ? 0 : -1);
}

static void serve_conn(struct server *s, struct rd *r, int conn)
{
    char line[8192];
    for (;;) {
        if (rd_line(r, line, sizeof(line)) < 0)
            return;
        if (line[0] == '\0')
            continue;
        struct reqlog q = {0};
        q.conn = conn;
        char *sp1 = strchr(line, ' ');
        char *sp2 = sp1 ? strchr(sp1 + 1, ' ') : NULL;
        if (sp1 && sp2)
            snprintf(q.target, sizeof(q.target), "%.*s", (int)(sp2 - sp1 - 1), sp1 + 1);
        long cl = 0;
        bool chunked = false, close_after = false;
        for (;;) {
            if (rd_line(r, line, sizeof(line)) < 0)
                return;
            if (line[0] == '\0')
                break;
            if (strncasecmp(line, "Authorization:", 14) == 0) {
                q.auth_count++;
                snprintf(q.auth, sizeof(q.auth), "%.255s", line + 15);
            } else if (strncasecmp(line, "X-Api-Key:", 10) == 0) {
                snprintf(q.xkey, sizeof(q.xkey), "%.255s", line + 11);
            } else if (strncasecmp(line, "Content-Length:", 15) == 0) {
                cl = atol(line + 15);
            } else if (strncasecmp(line, "Transfer-Encoding:", 18) == 0) {
                chunked = strstr(line, "chunked") != NULL;
            } else if (strncasecmp(line, "Connection:", 11) == 0) {
                close_after = strstr(line, "close") != NULL;
            }
        }
        if (chunked) {
            for (;;) {
                if (rd_line(r, line, sizeof(line)) < 0)
                    return;
                long n = strtol(line, NULL, 16);
                if (n == 0) {
                    do {
                        if (rd_line(r, line, sizeof(line)) < 0)
                            return;
                    } while (line[0] != '\0');
                    break;
                }
                if (rd_body(r, (size_t)n, &q) < 0 || rd_line(r, line, sizeof(line)) < 0)
                    return;
            }
        } else if (cl > 0 && rd_body(r, (size_t)cl, &q) < 0) {
            return;
        }
        int idx;
        pthread_mutex_lock(&s->mu);
        idx = s->nreq;
        if (s->nreq < MAXREQ)
            s->req[s->nreq++] = q;
        pthread_mutex_unlock(&s->mu);
        /* The answer never quotes the credential. */
        char body[128], resp[256];
        int bl = snprintf(body, sizeof(body), "req=%d len=%zu sum=%lu auth=%d\n", idx, q.body_len,
                          q.body_sum, q.auth_count);
        int rl = snprintf(resp, sizeof(resp),
                          "HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nContent-Length: %d\r\n"
                          "%s\r\n%s",
                          bl, close_after ? "Connection: close\r\n" : "", body);
        if (wr(r, resp, (size_t)rl) < 0 || close_after)
            return;
    }
}

static void *server_main(void *arg)
{
    struct server *s = arg;
    while (!s->stop) {
        struct pollfd pf = {.fd = s->lfd, .events = POLLIN};
        if (poll(&pf, 1, 50) <= 0)
            continue;
        int fd = accept(s->lfd, NULL, NULL);
        if (fd < 0)
            continue;
        struct timeval tv = {.tv_sec = 10};
        setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
        struct rd *r = calloc(1, sizeof(*r));
        r->fd = fd;
        pthread_mutex_lock(&s->mu);
        int conn = s->conns++;
        pthread_mutex_unlock(&s->mu);
        if (s->ctx != NULL) {
            r->ssl = SSL_new(s->ctx);
            SSL_set_fd(r->ssl, fd);
            if (SSL_accept(r->ssl) != 1) {
                pthread_mutex_lock(&s->mu);
                s->handshakes_failed++;
                pthread_mutex_unlock(&s->mu);
                ERR_clear_error();
                SSL_free(r->ssl);
                close(fd);
                free(r);
                continue;
            }
        }
        serve_conn(s, r, conn);
        if (r->ssl != NULL) {
            SSL_shutdown(r->ssl);
            SSL_free(r->ssl);
        }
        ERR_clear_error();
        close(fd);
        free(r);
    }
    return NULL;
}

static void server_start(struct server *s, SSL_CTX *ctx)
{
    memset(s, 0, sizeof(*s));
    s->ctx = ctx;
    pthread_mutex_init(&s->mu, NULL);
    s->lfd = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    socklen_t al = sizeof(a);
    CHECK(bind(s->lfd, (struct sockaddr *)&a, sizeof(a)) == 0 && listen(s->lfd, 16) == 0);
    getsockname(s->lfd, (struct sockaddr *)&a, &al);
    s->port = ntohs(a.sin_port);
    pthread_create(&s->th, NULL, server_main, s);
}

static void server_stop(struct server *s)
{
    s->stop = 1;
    pthread_join(s->th, NULL);
    close(s->lfd);
    pthread_mutex_destroy(&s->mu);
}

static int server_nreq(struct server *s)
{
    pthread_mutex_lock(&s->mu);
    int n = s->nreq;
    pthread_mutex_unlock(&s->mu);
    return n;
}

static int connect_to(int port)
{
    int fd = socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    struct sockaddr_in a = {.sin_family = AF_INET,
                            .sin_port = htons((uint16_t)port),
                            .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    int rc = connect(fd, (struct sockaddr *)&a, sizeof(a));
    CHECK(rc == 0 || errno == EINPROGRESS);
    return fd;
}

static double now_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec * 1000.0 + (double)ts.tv_nsec / 1e6;
}

/* ---- the guest: a TLS (or plain) client over memory, fed like the agent stream ---- */

struct guest {
    sp_mitm_conn_t *c;
    bool tls;
    SSL *ssl;
    BIO *rbio, *wbio;
    char out[1 << 16]; /* plaintext the guest still has to send */
    size_t outlen;
    char *got; /* plaintext received */
    size_t gotlen;
    size_t raw_seen_secret; /* times the secret appeared in bytes handed to the guest */
    size_t sent, consumed;
    bool closed; /* guest said EOF */
    int ended;
    sp_code_t end_code;
    char end_msg[160];
    size_t take_limit; /* to_guest takes at most this per call (0: all) */
};

static bool contains(const void *p, size_t n, const char *needle)
{
    size_t l = strlen(needle);
    for (size_t i = 0; i + l <= n; i++)
        if (memcmp((const char *)p + i, needle, l) == 0)
            return true;
    return false;
}

static void got_append(struct guest *g, const void *p, size_t n)
{
    g->got = realloc(g->got, g->gotlen + n + 1);
    memcpy(g->got + g->gotlen, p, n);
    g->gotlen += n;
    g->got[g->gotlen] = '\0';
}

static size_t g_to_guest(void *arg, const uint8_t *p, size_t n)
{
    struct guest *g = arg;
    if (g->take_limit > 0 && n > g->take_limit)
        n = g->take_limit;
    if (contains(p, n, SECRET) || contains(p, n, SECRET2))
        g->raw_seen_secret++;
    if (g->tls)
        BIO_write(g->rbio, p, (int)n);
    else
        got_append(g, p, n);
    return n;
}

static void g_consumed(void *arg, size_t n)
{
    struct guest *g = arg;
    g->consumed += n;
}

static void g_end(void *arg, const sp_err_t *err)
{
    struct guest *g = arg;
    g->ended++;
    g->end_code = err ? err->code : SP_OK;
    snprintf(g->end_msg, sizeof(g->end_msg), "%s", err ? err->msg : "");
    g->c = NULL; /* freed when this returns */
}

static const sp_mitm_conn_cbs_t gcbs = {g_to_guest, g_consumed, g_end};

static SSL_CTX *guest_ctx(const char *ca_pem)
{
    SSL_CTX *ctx = SSL_CTX_new(TLS_client_method());
    BIO *b = BIO_new_mem_buf(ca_pem, -1);
    X509 *ca = PEM_read_bio_X509(b, NULL, NULL, NULL);
    BIO_free(b);
    X509_STORE_add_cert(SSL_CTX_get_cert_store(ctx), ca);
    X509_free(ca);
    SSL_CTX_set_verify(ctx, SSL_VERIFY_PEER, NULL);
    SSL_CTX_set_alpn_protos(ctx, (const unsigned char *)"\x02h2\x08http/1.1", 12);
    return ctx;
}

static void guest_init(struct guest *g, SSL_CTX *ctx, const char *sni)
{
    memset(g, 0, sizeof(*g));
    g->tls = ctx != NULL;
    if (ctx != NULL) {
        g->ssl = SSL_new(ctx);
        g->rbio = BIO_new(BIO_s_mem());
        g->wbio = BIO_new(BIO_s_mem());
        SSL_set_bio(g->ssl, g->rbio, g->wbio);
        SSL_set_tlsext_host_name(g->ssl, sni);
        SSL_set1_host(g->ssl, sni);
        SSL_set_connect_state(g->ssl);
    }
}

static void guest_send(struct guest *g, const char *s, size_t n)
{
    memcpy(g->out + g->outlen, s, n);
    g->outlen += n;
}

/* One round of the guest's side: TLS work, then its bytes to the conn. */
static void guest_pump(struct guest *g)
{
    if (g->tls) {
        if (!SSL_is_init_finished(g->ssl))
            SSL_do_handshake(g->ssl);
        if (SSL_is_init_finished(g->ssl)) {
            while (g->outlen > 0) {
                int w = SSL_write(g->ssl, g->out, (int)(g->outlen > 16384 ? 16384 : g->outlen));
                if (w <= 0)
                    break;
                memmove(g->out, g->out + w, g->outlen - (size_t)w);
                g->outlen -= (size_t)w;
            }
            char b[16384];
            int r;
            while ((r = SSL_read(g->ssl, b, sizeof(b))) > 0)
                got_append(g, b, (size_t)r);
        }
        ERR_clear_error();
        char b[65536];
        int n;
        while (g->c != NULL && (n = BIO_read(g->wbio, b, sizeof(b))) > 0) {
            sp_mitm_conn_from_guest(g->c, (uint8_t *)b, (size_t)n);
            g->sent += (size_t)n;
        }
    } else if (g->c != NULL && g->outlen > 0) {
        sp_mitm_conn_from_guest(g->c, (uint8_t *)g->out, g->outlen);
        g->sent += g->outlen;
        g->outlen = 0;
    }
}

static void guest_close(struct guest *g)
{
    if (g->tls)
        SSL_shutdown(g->ssl);
    guest_pump(g);
    if (g->c != NULL)
        sp_mitm_conn_guest_eof(g->c);
    g->closed = true;
}

static void guest_free(struct guest *g)
{
    if (g->c != NULL)
        sp_mitm_conn_destroy(g->c);
    SSL_free(g->ssl);
    free(g->got);
}

/* Runs until the guest has received `responses` HTTP status lines, or ended. */
static int count_status(struct guest *g, const char *status)
{
    int n = 0;
    const char *p = g->got;
    while (p != NULL && (p = strstr(p, status)) != NULL) {
        n++;
        p += strlen(status);
    }
    return n;
}

static void drive(struct guest *g, const char *status, int want, int ms)
{
    for (int i = 0; i < ms / 5; i++) {
        guest_pump(g);
        if (count_status(g, status) >= want || g->ended)
            break;
        sp_loop_run_once(loop, 5);
    }
    guest_pump(g);
}

static void drive_end(struct guest *g, int ms)
{
    for (int i = 0; i < ms / 5 && !g->ended; i++) {
        guest_pump(g);
        sp_loop_run_once(loop, 5);
    }
}

/* ---- fixtures ---- */

static sp_store_t *store;
static sp_secrets_t *secrets;
static sp_mitm_t *mitm;

static void on_put(void *arg, const sp_secret_rec_t *rec, const sp_err_t *err)
{
    int *done = arg;
    *done = err ? -1 : 1;
}

static void on_set(void *arg, json_t *rules, const sp_err_t *err)
{
    int *done = arg;
    *done = err ? -1 : 1;
    if (err)
        fprintf(stderr, "set rules: %s\n", err->msg);
}

static void put_secret(const char *team, const char *name, const char *value, bool replace)
{
    int done = 0;
    sp_err_t e;
    CHECK(sp_secrets_put(secrets, team, name, value, strlen(value), replace, on_put, &done, &e) ==
          0);
    run_until(&done, 1, 5000);
    CHECK(done == 1);
}

static void set_rules(const char *team, const char *sb, const char *json)
{
    int done = 0;
    sp_err_t e;
    json_error_t je;
    json_t *r = json_loads(json, 0, &je);
    CHECK(r != NULL);
    CHECK(sp_secrets_set_rules(secrets, team, sb, r, on_set, &done, &e) == 0);
    json_decref(r);
    run_until(&done, 1, 5000);
    CHECK(done == 1);
}

struct opened {
    int done;
    sp_mitm_sb_t *sb;
    sp_code_t code;
};

static void on_open(void *arg, sp_mitm_sb_t *sb, const sp_err_t *err)
{
    struct opened *o = arg;
    o->done++;
    o->sb = sb;
    o->code = err ? err->code : SP_OK;
}

static sp_mitm_sb_t *open_sb(const char *id)
{
    struct opened o = {0};
    sp_err_t e;
    CHECK(sp_mitm_sb_open(mitm, id, NULL, on_open, &o, &e) == 0);
    CHECK(o.done == 0);
    run_until(&o.done, 1, 5000);
    CHECK(o.done == 1 && o.code == SP_OK && o.sb != NULL);
    return o.sb;
}

/* ---- tests ---- */

static SSL_CTX *gctx;
static sp_mitm_sb_t *main_sb;
static struct server good, rogue, wrongname, plain;

/* Three requests on one guest connection (keep-alive): a GET carrying a placeholder
 * credential, a chunked POST, and a 2 MiB POST whose bytes the guest hands over in pieces
 * while to_guest takes little at a time. The server sees one connection, each request with
 * exactly one injected credential and the exact body; the guest never sees the secret. */
static void test_mitm_tls_injects_keepalive_chunked(sp_mitm_sb_t *sb)
{
    struct guest g;
    guest_init(&g, gctx, "localhost");
    sp_err_t e;
    g.c = sp_mitm_conn_create(sb, "LocalHost.", (uint16_t)good.port, true, connect_to(good.port),
                              &gcbs, &g, &e);
    CHECK(g.c != NULL);
    const char *r1 = "GET /one HTTP/1.1\r\nHost: localhost\r\n"
                     "Authorization: Bearer space-placeholder\r\n\r\n";
    guest_send(&g, r1, strlen(r1));
    double t0 = now_ms();
    drive(&g, "HTTP/1.1 200", 1, 10000);
    double t1 = now_ms();
    CHECK(count_status(&g, "HTTP/1.1 200") == 1);
    CHECK(SSL_is_init_finished(g.ssl));
    const unsigned char *alpn = NULL;
    unsigned alen = 0;
    SSL_get0_alpn_selected(g.ssl, &alpn, &alen);
    CHECK(alen == 8 && memcmp(alpn, "http/1.1", 8) == 0); /* h2 was offered, not taken */

    const char *r2 = "POST /two HTTP/1.1\r\nHost: localhost\r\nTransfer-Encoding: chunked\r\n\r\n"
                     "5\r\nhello\r\n6;ext=1\r\n world\r\n0\r\nX-Trailer: t\r\n\r\n";
    guest_send(&g, r2, strlen(r2));
    drive(&g, "HTTP/1.1 200", 2, 10000);
    CHECK(count_status(&g, "HTTP/1.1 200") == 2);

    size_t big = 2u << 20;
    char head[256];
    int hl = snprintf(head, sizeof(head),
                      "POST /three HTTP/1.1\r\nHost: localhost\r\nContent-Length: %zu\r\n"
                      "X-Api-Key: guest-own\r\n\r\n",
                      big);
    guest_send(&g, head, (size_t)hl);
    double t2 = now_ms();
    unsigned long sum = 0;
    size_t left = big;
    g.take_limit = 700; /* a slow guest side: the conn must hold and resume */
    char chunk[32768];
    for (size_t i = 0; i < sizeof(chunk); i++)
        chunk[i] = (char)('a' + i % 26);
    for (int i = 0; i < 20000 && (left > 0 || g.outlen > 0); i++) {
        while (left > 0 && g.outlen + sizeof(chunk) <= sizeof(g.out)) {
            size_t k = left < sizeof(chunk) ? left : sizeof(chunk);
            for (size_t j = 0; j < k; j++)
                sum += (unsigned char)chunk[j];
            guest_send(&g, chunk, k);
            left -= k;
        }
        guest_pump(&g);
        sp_loop_run_once(loop, 1);
        if (g.c != NULL)
            sp_mitm_conn_guest_writable(g.c);
    }
    drive(&g, "HTTP/1.1 200", 3, 20000);
    CHECK(count_status(&g, "HTTP/1.1 200") == 3);
    fprintf(stderr,
            "figures: first request (guest and upstream TLS handshakes) %.1f ms; 2 MiB POST "
            "through the relay %.1f ms\n",
            t1 - t0, now_ms() - t2);

    CHECK(server_nreq(&good) == 3);
    pthread_mutex_lock(&good.mu);
    for (int i = 0; i < good.nreq && i < 3; i++) {
        struct reqlog *q = &good.req[i];
        CHECK(q->conn == good.req[0].conn); /* one upstream connection */
        CHECK(q->auth_count == 1 && strcmp(q->auth, "Bearer " SECRET) == 0);
        CHECK(strcmp(q->xkey, SECRET2) == 0); /* the rule replaced the guest's own value */
    }
    CHECK(strcmp(good.req[0].target, "/one") == 0);
    CHECK(good.req[1].body_len == 11 && strcmp(good.req[1].body_head, "hello world") == 0);
    CHECK(good.req[2].body_len == big && good.req[2].body_sum == sum);
    pthread_mutex_unlock(&good.mu);

    /* The guest closes; the conn shuts the upstream down and ends cleanly. */
    guest_close(&g);
    drive_end(&g, 15000);
    CHECK(g.ended == 1 && g.end_code == SP_OK);
    CHECK(g.consumed == g.sent); /* every byte given was acknowledged */
    CHECK(g.raw_seen_secret == 0);
    CHECK(!contains(g.got, g.gotlen, SECRET) && !contains(g.got, g.gotlen, SECRET2));
    guest_free(&g);
}

/* An upstream whose certificate does not verify: the guest gets a 502 saying why, the
 * destination never gets a request (so never the secret). */
static void test_mitm_tls_bad_upstream_gets_502(sp_mitm_sb_t *sb, struct server *srv,
                                                const char *why)
{
    struct guest g;
    guest_init(&g, gctx, "localhost");
    sp_err_t e;
    g.c = sp_mitm_conn_create(sb, "localhost", (uint16_t)srv->port, true, connect_to(srv->port),
                              &gcbs, &g, &e);
    CHECK(g.c != NULL);
    const char *r1 = "GET /x HTTP/1.1\r\nHost: localhost\r\n\r\n";
    guest_send(&g, r1, strlen(r1));
    drive(&g, "HTTP/1.1 502", 1, 10000);
    drive_end(&g, 5000);
    CHECK(count_status(&g, "HTTP/1.1 502 Bad Gateway") == 1);
    if (g.got == NULL || strstr(g.got, why) == NULL)
        fprintf(stderr, "guest got: %s\n", g.got ? g.got : "(nothing)");
    CHECK(g.got != NULL && strstr(g.got, "certificate verification failed") != NULL);
    CHECK(g.got != NULL && strstr(g.got, why) != NULL);
    CHECK(g.ended == 1 && g.end_code != SP_OK);
    CHECK(server_nreq(srv) == 0);
    CHECK(!contains(g.got, g.gotlen, SECRET));
    guest_free(&g);
}

/* The guest asks (SNI) for another name than it sent CONNECT for: refused. */
static void test_mitm_sni_mismatch_refused(sp_mitm_sb_t *sb)
{
    struct guest g;
    guest_init(&g, gctx, "other.example");
    sp_err_t e;
    g.c = sp_mitm_conn_create(sb, "localhost", (uint16_t)good.port, true, connect_to(good.port),
                              &gcbs, &g, &e);
    int before = server_nreq(&good);
    drive_end(&g, 5000);
    CHECK(g.ended == 1 && g.end_code == SP_EINVAL && strstr(g.end_msg, "server name") != NULL);
    CHECK(!SSL_is_init_finished(g.ssl));
    CHECK(server_nreq(&good) == before);
    guest_free(&g);
}

/* A destination without rules cannot be intercepted at all. */
static void test_mitm_only_rule_hosts(sp_mitm_sb_t *sb)
{
    CHECK(sp_mitm_wants(sb, "localhost", 443));
    CHECK(sp_mitm_wants(sb, "LOCALHOST.", 443));
    CHECK(sp_mitm_wants(sb, "deep.api.wild.test", 443)); /* "*.wild.test" */
    CHECK(!sp_mitm_wants(sb, "wild.test", 443));
    CHECK(!sp_mitm_wants(sb, "example.com", 443));
    CHECK(!sp_mitm_wants(sb, "localhost.evil.com", 443));
    sp_err_t e;
    struct guest g;
    guest_init(&g, NULL, NULL);
    CHECK(sp_mitm_conn_create(sb, "example.com", 443, true, connect_to(good.port), &gcbs, &g, &e) ==
              NULL &&
          e.code == SP_EINVAL);
}

/* Plain HTTP to a destination with rules: refused (403), so a secret never crosses the network
 * in clear; the destination hears nothing. */
static void test_mitm_plain_http(sp_mitm_sb_t *sb)
{
    int before = server_nreq(&plain);
    struct guest g;
    guest_init(&g, NULL, NULL);
    sp_err_t e;
    g.c = sp_mitm_conn_create(sb, "localhost", (uint16_t)plain.port, false, connect_to(plain.port),
                              &gcbs, &g, &e);
    CHECK(g.c != NULL);
    char r1[256];
    int n = snprintf(r1, sizeof(r1),
                     "GET http://localhost:%d/plain?q=1 HTTP/1.1\r\nHost: localhost:%d\r\n"
                     "Proxy-Connection: keep-alive\r\n\r\n",
                     plain.port, plain.port);
    guest_send(&g, r1, (size_t)n);
    drive(&g, "HTTP/1.1 403", 1, 10000);
    drive_end(&g, 5000);
    CHECK(count_status(&g, "HTTP/1.1 403") == 1);
    CHECK(contains(g.got, g.gotlen, "over HTTPS only"));
    CHECK(g.ended == 1);
    CHECK(server_nreq(&plain) == before);
    CHECK(g.raw_seen_secret == 0 && !contains(g.got, g.gotlen, SECRET));
    guest_free(&g);
}

/* Plain mode reads requests as the proxy does (core/egress/http1.h) and refuses them all: one
 * whose Host names another destination, and a smuggling attempt (Content-Length with
 * Transfer-Encoding, 400 before anything else), never reach the destination. */
static void test_mitm_plain_same_request_rules_as_the_proxy(sp_mitm_sb_t *sb)
{
    struct guest g;
    guest_init(&g, NULL, NULL);
    sp_err_t e;
    int before = server_nreq(&plain);
    g.c = sp_mitm_conn_create(sb, "localhost", (uint16_t)plain.port, false, connect_to(plain.port),
                              &gcbs, &g, &e);
    CHECK(g.c != NULL);
    char r1[256];
    int n =
        snprintf(r1, sizeof(r1),
                 "GET http://localhost:%d/h HTTP/1.1\r\nHost: elsewhere.test\r\n\r\n", plain.port);
    guest_send(&g, r1, (size_t)n);
    drive(&g, "HTTP/1.1 403", 1, 10000);
    drive_end(&g, 5000);
    CHECK(count_status(&g, "HTTP/1.1 403") == 1 && g.ended == 1);
    guest_free(&g);

    guest_init(&g, NULL, NULL);
    g.c = sp_mitm_conn_create(sb, "localhost", (uint16_t)plain.port, false, connect_to(plain.port),
                              &gcbs, &g, &e);
    CHECK(g.c != NULL);
    n = snprintf(r1, sizeof(r1),
                 "POST http://localhost:%d/s HTTP/1.1\r\nHost: localhost:%d\r\n"
                 "Content-Length: 4\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n",
                 plain.port, plain.port);
    guest_send(&g, r1, (size_t)n);
    drive(&g, "HTTP/1.1 400", 1, 10000);
    drive_end(&g, 5000);
    CHECK(count_status(&g, "HTTP/1.1 400") == 1 && g.ended == 1);
    guest_free(&g);
    CHECK(server_nreq(&plain) == before);
}

/* On a new TLS tunnel with the rule, optionally after a good first request (200), req is
 * answered `want` and the connection ends; the destination hears only the good request and
 * the secret goes nowhere. */
static void refused_in_tunnel(sp_mitm_sb_t *sb, bool good_first, const char *req, size_t n,
                              const char *want)
{
    int before = server_nreq(&good);
    struct guest g;
    guest_init(&g, gctx, "localhost");
    sp_err_t e;
    g.c = sp_mitm_conn_create(sb, "localhost", (uint16_t)good.port, true, connect_to(good.port),
                              &gcbs, &g, &e);
    CHECK(g.c != NULL);
    if (good_first) {
        char r1[128];
        int k = snprintf(r1, sizeof(r1), "GET /first HTTP/1.1\r\nHost: localhost:%d\r\n\r\n",
                         good.port);
        guest_send(&g, r1, (size_t)k);
        drive(&g, "HTTP/1.1 200", 1, 10000);
        CHECK(count_status(&g, "HTTP/1.1 200") == 1);
    }
    guest_send(&g, req, n);
    drive(&g, want, 1, 10000);
    drive_end(&g, 5000);
    if (count_status(&g, want) != 1)
        fprintf(stderr, "refused_in_tunnel: wanted %s after %.40s: %.*s\n", want, req,
                (int)(g.gotlen < 200 ? g.gotlen : 200), g.got);
    CHECK(count_status(&g, want) == 1 && g.ended == 1);
    CHECK(server_nreq(&good) == before + (good_first ? 1 : 0));
    CHECK(g.raw_seen_secret == 0 && !contains(g.got, g.gotlen, SECRET));
    guest_free(&g);
}

/* Inside a TLS tunnel every request must name the tunnel's destination: a later request on the
 * kept-alive connection with another Host, or an absolute-form target elsewhere, gets 421 and
 * nothing is sent; TRACE (which would echo the injected header back) gets 405. The destination
 * hears only the first request. */
static void test_mitm_tls_same_destination_every_request(sp_mitm_sb_t *sb)
{
    const char *second[] = {
        "GET /two HTTP/1.1\r\nHost: elsewhere.test\r\n\r\n",
        "GET https://elsewhere.test/two HTTP/1.1\r\nHost: elsewhere.test\r\n\r\n",
        "TRACE /two HTTP/1.1\r\nHost: localhost\r\n\r\n",
    };
    const char *want[] = {"HTTP/1.1 421", "HTTP/1.1 421", "HTTP/1.1 405"};
    for (size_t i = 0; i < sizeof(second) / sizeof(second[0]); i++)
        refused_in_tunnel(sb, true, second[i], strlen(second[i]), want[i]);
}

/* A request whose head carries control bytes (NUL, a bare CR, DEL, another C0 byte in a
 * header value, a request line with one) or an obsolete line folding, first on its tunnel or
 * after a good one: 400, the connection ends, the destination hears nothing of it and the
 * secret goes nowhere. */
static void test_mitm_tls_control_bytes_refused(sp_mitm_sb_t *sb)
{
    static const char *const bad[] = {
        "GET /c HTTP/1.1\r\nHost: localhost\r\nX-A: a\001b\r\n\r\n",
        "GET /c HTTP/1.1\r\nHost: localhost\r\nX-A: a\rb\r\n\r\n",
        "GET /c HTTP/1.1\r\nHost: localhost\r\nX-A: a\177b\r\n\r\n",
        "GET /c\001 HTTP/1.1\r\nHost: localhost\r\n\r\n",
        "GET /c HTTP/1.1\r\nHost: localhost\r\nX-A: a\r\n b\r\n\r\n",
    };
    const size_t nbad = sizeof(bad) / sizeof(bad[0]);
    const size_t nul_at = (size_t)(strchr(bad[0], '\001') - bad[0]); /* made a NUL below */
    for (int after_good = 0; after_good < 2; after_good++) {
        for (size_t i = 0; i <= nbad; i++) {
            char req[256];
            size_t n = strlen(bad[i < nbad ? i : 0]);
            memcpy(req, bad[i < nbad ? i : 0], n);
            if (i == nbad) /* the first again, its \001 a NUL */
                req[nul_at] = '\0';
            refused_in_tunnel(sb, after_good, req, n, "HTTP/1.1 400");
        }
    }
}

/* The head rewrite the proxy calls for plain requests it forwards itself. */
static void test_mitm_rewrite_head(sp_mitm_sb_t *sb)
{
    sp_err_t e;
    char *out = NULL;
    size_t len = 0;
    const char *h =
        "GET /x HTTP/1.1\r\nHost: localhost\r\nauthorization: old\r\nAccept: */*\r\n\r\n";
    CHECK(sp_mitm_rewrite_head(sb, "localhost", h, strlen(h), &out, &len, &e) == 0);
    CHECK(out != NULL && len == strlen(out));
    CHECK(out != NULL && strstr(out, "Authorization: Bearer " SECRET "\r\n") != NULL);
    CHECK(out != NULL && strstr(out, "old") == NULL && strstr(out, "Accept: */*\r\n") != NULL);
    CHECK(out != NULL && strncmp(out, "GET /x HTTP/1.1\r\n", 17) == 0);
    CHECK(out != NULL && len >= 4 && memcmp(out + len - 4, "\r\n\r\n", 4) == 0);
    sp_mitm_head_free(out, len);
    CHECK(sp_mitm_rewrite_head(sb, "example.com", h, strlen(h), &out, &len, &e) == 0 &&
          out == NULL);
    const char *bad = "GET /x HTTP/1.1\r\n folded: x\r\n\r\n";
    CHECK(sp_mitm_rewrite_head(sb, "localhost", bad, strlen(bad), &out, &len, &e) < 0 &&
          e.code == SP_EINVAL && out == NULL);
    const char *smuggle =
        "POST / HTTP/1.1\r\nContent-Length: 3\r\nTransfer-Encoding: chunked\r\n\r\n";
    CHECK(sp_mitm_rewrite_head(sb, "localhost", smuggle, strlen(smuggle), &out, &len, &e) < 0);
    const char *nohttp = "GARBAGE\r\n\r\n";
    CHECK(sp_mitm_rewrite_head(sb, "localhost", nohttp, strlen(nohttp), &out, &len, &e) < 0);
}

/* A rule whose secret is gone: the guest hears which secret is missing, never a value; the
 * destination gets nothing. A secret (re)created later works without reopening. */
static void test_mitm_missing_secret_then_created(void)
{
    set_rules("team1", "sbmiss1",
              "[{\"host\":\"localhost\",\"header\":\"Authorization\",\"secret\":\"LATER\"}]");
    const char *p[] = {"team1"};
    fx_sql("DELETE FROM secrets WHERE team_id = $1 AND name = 'LATER'", 1, p);
    sp_mitm_sb_t *sb = open_sb("sbmiss1");
    CHECK(sp_mitm_rule_count(sb) == 1);
    int before = server_nreq(&good);
    sp_err_t e;
    struct guest g;
    /* Each sandbox has its own CA: a guest trusting another sandbox's refuses this one. */
    CHECK(strcmp(sp_mitm_sb_ca_pem(sb), sp_mitm_sb_ca_pem(main_sb)) != 0);
    guest_init(&g, gctx, "localhost");
    g.c = sp_mitm_conn_create(sb, "localhost", (uint16_t)good.port, true, connect_to(good.port),
                              &gcbs, &g, &e);
    drive_end(&g, 5000);
    CHECK(g.ended == 1 && strstr(g.end_msg, "unknown ca") != NULL);
    guest_free(&g);

    SSL_CTX *own = guest_ctx(sp_mitm_sb_ca_pem(sb));
    guest_init(&g, own, "localhost");
    g.c = sp_mitm_conn_create(sb, "localhost", (uint16_t)good.port, true, connect_to(good.port),
                              &gcbs, &g, &e);
    const char *r1 = "GET /m HTTP/1.1\r\nHost: localhost\r\n\r\n";
    guest_send(&g, r1, strlen(r1));
    drive(&g, "HTTP/1.1 502", 1, 10000);
    drive_end(&g, 5000);
    CHECK(count_status(&g, "HTTP/1.1 502") == 1);
    CHECK(g.got != NULL && strstr(g.got, "'LATER'") != NULL);
    if (g.got == NULL || strstr(g.got, "'LATER'") == NULL)
        fprintf(stderr, "guest got: %s ended=%d msg=%s\n", g.got ? g.got : "(nothing)", g.ended,
                g.end_msg);
    CHECK(server_nreq(&good) == before);
    guest_free(&g);
    SSL_CTX_free(own);

    /* Created now: the NOTIFY reloads the handle. */
    put_secret("team1", "LATER", "later-value-abc", false);
    char *out = NULL;
    size_t len = 0;
    const char *h = "GET / HTTP/1.1\r\nHost: localhost\r\n\r\n";
    int rc = -1;
    for (int i = 0; i < 400 && rc < 0; i++) {
        run_for(10);
        rc = sp_mitm_rewrite_head(sb, "localhost", h, strlen(h), &out, &len, &e);
    }
    CHECK(rc == 0 && out != NULL && strstr(out, "Authorization: later-value-abc\r\n") != NULL);
    sp_mitm_head_free(out, len);
    sp_mitm_sb_close(sb);
}

struct envs {
    int changes;
    char kv[512];
};

static void env_put(void *arg, const char *kv)
{
    struct envs *v = arg;
    size_t n = strlen(v->kv);
    snprintf(v->kv + n, sizeof(v->kv) - n, "%s;", kv);
}

static void env_changed(void *arg, sp_mitm_sb_t *sb)
{
    ((struct envs *)arg)->changes++;
}

/* Rules with env give the guest placeholders made of the secret's name (one per variable),
 * never the value; a reload that changes them calls back, one that keeps them does not. */
static void test_mitm_placeholders(void)
{
    set_rules("team1", "sbenv1",
              "[{\"host\":\"localhost\",\"header\":\"Authorization\",\"secret\":\"TOKEN\","
              "\"format\":\"Bearer {secret}\",\"env\":\"MY_KEY\"},"
              "{\"host\":\"*.wild.test\",\"header\":\"Authorization\",\"secret\":\"TOKEN\","
              "\"env\":\"MY_KEY\"},"
              "{\"host\":\"localhost\",\"header\":\"X-Api-Key\",\"secret\":\"TOKEN2\"}]");
    sp_mitm_sb_t *sb = open_sb("sbenv1");
    CHECK(sb != NULL);
    if (sb == NULL)
        return;
    struct envs v = {0};
    sp_mitm_sb_on_env(sb, env_changed, &v);
    CHECK(sp_mitm_sb_placeholders(sb, env_put, &v) == 1);
    CHECK(strcmp(v.kv, "MY_KEY=" SP_SECRETS_PLACEHOLDER "TOKEN;") == 0);
    CHECK(strstr(v.kv, SECRET) == NULL);

    /* Same placeholders, another header: no call back. Then a second variable: one. */
    set_rules("team1", "sbenv1",
              "[{\"host\":\"localhost\",\"header\":\"Authorization\",\"secret\":\"TOKEN\","
              "\"env\":\"MY_KEY\"}]");
    for (int i = 0; i < 400 && sp_mitm_rule_count(sb) != 1; i++)
        run_for(10);
    CHECK(sp_mitm_rule_count(sb) == 1 && v.changes == 0);
    if (sp_mitm_rule_count(sb) != 1 || v.changes != 0)
        fprintf(stderr, "rules=%zu changes=%d\n", sp_mitm_rule_count(sb), v.changes);
    set_rules("team1", "sbenv1",
              "[{\"host\":\"localhost\",\"header\":\"Authorization\",\"secret\":\"TOKEN\","
              "\"env\":\"MY_KEY\"},"
              "{\"host\":\"localhost\",\"header\":\"X-Api-Key\",\"secret\":\"TOKEN2\","
              "\"env\":\"OTHER\"}]");
    for (int i = 0; i < 400 && v.changes == 0; i++)
        run_for(10);
    CHECK(v.changes == 1);
    v.kv[0] = '\0';
    CHECK(sp_mitm_sb_placeholders(sb, env_put, &v) == 2);
    CHECK(strcmp(v.kv, "MY_KEY=" SP_SECRETS_PLACEHOLDER "TOKEN;OTHER=" SP_SECRETS_PLACEHOLDER
                       "TOKEN2;") == 0);
    /* Removed: none left, and the handle says so. */
    set_rules("team1", "sbenv1", "[]");
    for (int i = 0; i < 400 && v.changes == 1; i++)
        run_for(10);
    CHECK(v.changes == 2 && sp_mitm_sb_placeholders(sb, NULL, NULL) == 0);
    sp_mitm_sb_close(sb);
}

/* Rules changed while open reach the handle (NOTIFY), and the CA stays the same one. */
static void test_mitm_rules_reload(sp_mitm_sb_t *sb)
{
    char *ca_before = strdup(sp_mitm_sb_ca_pem(sb));
    CHECK(!sp_mitm_wants(sb, "new.example", 443));
    set_rules("team1", "sbmitm1",
              "[{\"host\":\"localhost\",\"header\":\"Authorization\",\"secret\":\"TOKEN\","
              "\"format\":\"Bearer {secret}\"},"
              "{\"host\":\"localhost\",\"header\":\"X-Api-Key\",\"secret\":\"TOKEN2\"},"
              "{\"host\":\"*.wild.test\",\"header\":\"X-Api-Key\",\"secret\":\"TOKEN2\"},"
              "{\"host\":\"new.example\",\"header\":\"X-Api-Key\",\"secret\":\"TOKEN2\"}]");
    for (int i = 0; i < 400 && !sp_mitm_wants(sb, "new.example", 443); i++)
        run_for(10);
    CHECK(sp_mitm_wants(sb, "new.example", 443) && sp_mitm_rule_count(sb) == 4);
    CHECK(sp_mitm_sb_ca_pem(sb) != NULL && strcmp(ca_before, sp_mitm_sb_ca_pem(sb)) == 0);
    free(ca_before);
}

/* The CA is stored for other workers with its key sealed; a second handle loads the same. */
static void test_mitm_ca_stored_sealed(sp_mitm_sb_t *sb)
{
    const char *p[] = {"sbmitm1"};
    const char *box = fx_sql("SELECT key_box FROM sandbox_cas WHERE sandbox_id = $1", 1, p);
    CHECK(box != NULL && strncmp(box, "v1:", 3) == 0 && strstr(box, "PRIVATE") == NULL);
    const char *cert = fx_sql("SELECT cert_pem FROM sandbox_cas WHERE sandbox_id = $1", 1, p);
    CHECK(cert != NULL && strcmp(cert, sp_mitm_sb_ca_pem(sb)) == 0);
    sp_mitm_sb_t *again = open_sb("sbmitm1");
    CHECK(again != NULL && strcmp(sp_mitm_sb_ca_pem(again), sp_mitm_sb_ca_pem(sb)) == 0);
    sp_mitm_sb_close(again);
    /* No rule, no CA. */
    sp_mitm_sb_t *none = open_sb("sbnone1");
    CHECK(none != NULL && sp_mitm_rule_count(none) == 0 && sp_mitm_sb_ca_pem(none) == NULL);
    CHECK(!sp_mitm_wants(none, "localhost", 443));
    sp_mitm_sb_close(none);
    /* Unknown sandbox. */
    struct opened o = {0};
    sp_err_t e;
    CHECK(sp_mitm_sb_open(mitm, "nosuchsandbox", NULL, on_open, &o, &e) == 0);
    run_until(&o.done, 1, 5000);
    CHECK(o.done == 1 && o.code == SP_ENOTFOUND && o.sb == NULL);
}

/* Closing the handle with a conn open: the conn goes without calling back. */
static void test_mitm_close_with_open_conn(void)
{
    sp_mitm_sb_t *sb = open_sb("sbmitm1");
    struct guest g;
    guest_init(&g, gctx, "localhost");
    sp_err_t e;
    g.c = sp_mitm_conn_create(sb, "localhost", (uint16_t)good.port, true, connect_to(good.port),
                              &gcbs, &g, &e);
    guest_pump(&g);
    run_for(50);
    sp_mitm_sb_close(sb);
    g.c = NULL;
    run_for(50);
    CHECK(g.ended == 0);
    guest_free(&g);
}

int main(void)
{
    if (sodium_init() < 0)
        return 1;
    int rc = fx_start("mitm");
    if (rc != 0)
        return rc;
    signal(SIGPIPE, SIG_IGN);

    /* PKI: the test CA (trusted for upstreams), a good leaf, a wrong-name leaf, a rogue. */
    EVP_PKEY *cak = gen_key(), *k1 = gen_key(), *k2 = gen_key(), *k3 = gen_key();
    X509 *ca = make_cert("test upstream CA", NULL, true, cak, NULL, NULL);
    X509 *c1 = make_cert("localhost", "DNS:localhost", false, k1, ca, cak);
    X509 *c2 = make_cert("wrong.example", "DNS:wrong.example", false, k2, ca, cak);
    X509 *c3 = make_cert("localhost", "DNS:localhost", false, k3, NULL, NULL);
    char cafile[] = "/tmp/sp-mitm-ca-XXXXXX";
    int cfd = mkstemp(cafile);
    FILE *f = fdopen(cfd, "w");
    PEM_write_X509(f, ca);
    fclose(f);
    SSL_CTX *s1 = server_ctx(c1, k1), *s2 = server_ctx(c2, k2), *s3 = server_ctx(c3, k3);
    server_start(&good, s1);
    server_start(&wrongname, s2);
    server_start(&rogue, s3);
    server_start(&plain, NULL);

    sp_err_t e;
    store = sp_store_create(loop, dsn, 2, &e);
    unsigned char key[SP_SECRETS_KEY_LEN];
    randombytes_buf(key, sizeof(key));
    secrets = sp_secrets_create(loop, store, key, &e);
    sp_mitm_opts_t mo = {.test_upstream_ca_file = cafile};
    mitm = sp_mitm_create(loop, store, secrets, &mo, &e);
    CHECK(store && secrets && mitm);
    sp_mitm_opts_t badopts = {.test_upstream_ca_file = "/nonexistent/ca.pem"};
    CHECK(sp_mitm_create(loop, store, secrets, &badopts, &e) == NULL && e.code == SP_EINVAL);
    run_for(200); /* the listener is up */

    fx_sandbox("team1", "sbmitm1");
    fx_sandbox("team1", "sbmiss1");
    fx_sandbox("team1", "sbenv1");
    fx_sandbox("team1", "sbnone1");
    put_secret("team1", "TOKEN", SECRET, false);
    put_secret("team1", "TOKEN2", SECRET2, false);
    put_secret("team1", "LATER", "x", false);
    set_rules("team1", "sbmitm1",
              "[{\"host\":\"localhost\",\"header\":\"Authorization\",\"secret\":\"TOKEN\","
              "\"format\":\"Bearer {secret}\"},"
              "{\"host\":\"localhost\",\"header\":\"X-Api-Key\",\"secret\":\"TOKEN2\"},"
              "{\"host\":\"*.wild.test\",\"header\":\"X-Api-Key\",\"secret\":\"TOKEN2\"}]");
    sp_mitm_sb_t *sb = open_sb("sbmitm1");
    CHECK(sb != NULL && sp_mitm_rule_count(sb) == 3 && sp_mitm_sb_ca_pem(sb) != NULL);
    if (sb == NULL || sp_mitm_sb_ca_pem(sb) == NULL)
        return 1;
    gctx = guest_ctx(sp_mitm_sb_ca_pem(sb));
    main_sb = sb;

    test_mitm_only_rule_hosts(sb);
    test_mitm_rewrite_head(sb);
    test_mitm_tls_injects_keepalive_chunked(sb);
    test_mitm_tls_bad_upstream_gets_502(sb, &rogue, "self-signed certificate");
    test_mitm_tls_bad_upstream_gets_502(sb, &wrongname, "hostname mismatch");
    test_mitm_sni_mismatch_refused(sb);
    test_mitm_plain_http(sb);
    test_mitm_plain_same_request_rules_as_the_proxy(sb);
    test_mitm_tls_same_destination_every_request(sb);
    test_mitm_tls_control_bytes_refused(sb);
    test_mitm_ca_stored_sealed(sb);
    test_mitm_rules_reload(sb);
    test_mitm_missing_secret_then_created();
    test_mitm_placeholders();
    test_mitm_close_with_open_conn();

    sp_mitm_sb_close(sb);
    run_for(50);
    sp_mitm_destroy(mitm);
    sp_store_destroy(store);
    sp_secrets_destroy(secrets);
    server_stop(&good);
    server_stop(&wrongname);
    server_stop(&rogue);
    server_stop(&plain);
    SSL_CTX_free(s1);
    SSL_CTX_free(s2);
    SSL_CTX_free(s3);
    SSL_CTX_free(gctx);
    X509_free(ca);
    X509_free(c1);
    X509_free(c2);
    X509_free(c3);
    EVP_PKEY_free(cak);
    EVP_PKEY_free(k1);
    EVP_PKEY_free(k2);
    EVP_PKEY_free(k3);
    unlink(cafile);
    fx_stop();
    return check_report("mitm");
}
