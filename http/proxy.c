/*
 * proxy.c - the node-to-node forwarder and the cluster header (proxy.h).
 *
 * Owns one `struct px` per forwarded request: the upstream socket, the request head it
 * wrote, the response framing, the body's two buffers. Body bytes move from the upstream
 * socket into pend (decoded when chunked) and go to the client from fly; the upstream is read
 * while pend holds less than PEND_MAX, and its socket's receive buffer is bounded, so what
 * this node holds per request is about 2 MiB whatever the body's size. Every entry (socket,
 * generator, timeout, pool callbacks) holds `depth`; the struct is freed when it is dead and the
 * outermost entry unwinds. Does not decide what to forward or where: the server's dispatch does
 * (server/server.c), from core's "where is this sandbox".
 */
#include "http/proxy.h"

#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <netdb.h>
#include <openssl/crypto.h>
#include <openssl/evp.h>
#include <openssl/hmac.h>
#include <openssl/rand.h>
#include <openssl/sha.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "base/buf.h"
#include "base/chunked.h"
#include "base/log.h"
#include "base/text.h"
#include "http/bodygate.h"
#include "http/http.h"

#include <h2o/http1.h>  /* h2o_http1_upgrade; needs h2o.h first */
#include <h2o/tunnel.h> /* h2o_tunnel_establish */

/* picohttpparser, which libh2o carries and exports but Debian installs no header for. */
struct phr_header {
    const char *name;
    size_t name_len;
    const char *value;
    size_t value_len;
};
int phr_parse_response(const char *buf, size_t len, int *minor_version, int *status,
                       const char **msg, size_t *msg_len, struct phr_header *headers,
                       size_t *num_headers, size_t last_len);

#define HEAD_MAX (64u * 1024u) /* bytes: the upstream's response head */
#define MAX_FIELDS 128
#define PEND_MAX (1u << 20)    /* bytes read ahead of the client at most (plus one socket read) */
#define UP_RCVBUF (256 * 1024) /* bytes: the upstream socket's receive buffer */
#define NONCE_LEN 16           /* bytes */
#define MAC_LEN 32             /* HMAC-SHA256 */

/* ---- the nonce cache: header nonces seen within the skew window ---- */

struct seen {
    unsigned char nonce[NONCE_LEN];
    time_t until;
    struct seen *next;
};

#define SEEN_BUCKETS 1024

struct sp_proxy {
    sp_loop_t *loop;
    h2o_loop_t *hloop;
    unsigned char key[SP_PROXY_KEY_MAX];
    size_t key_len;
    h2o_timeout_t connect_to, idle_to;
    struct seen *seen[SEEN_BUCKETS];
    size_t seen_count;
    struct sp_proxy_get *gets; /* peer GETs in flight (sp_proxy_get) */
};

static void seen_prune(sp_proxy_t *p, time_t now)
{
    for (size_t b = 0; b < SEEN_BUCKETS; b++) {
        for (struct seen **pp = &p->seen[b]; *pp != NULL;) {
            struct seen *s = *pp;
            if (s->until < now) {
                *pp = s->next;
                free(s);
                p->seen_count--;
            } else {
                pp = &s->next;
            }
        }
    }
}

/* 1 when the nonce was seen already, 0 when it is new (and is now remembered), -1 on OOM. */
static int seen_add(sp_proxy_t *p, const unsigned char nonce[NONCE_LEN], time_t now)
{
    /* Every bucket's chain is pruned as it is walked; a full sweep now and then bounds the
     * rest (entries live 2 * SP_PROXY_SKEW_S). */
    if (p->seen_count > 0 && p->seen_count % 4096 == 0)
        seen_prune(p, now);
    size_t b = ((size_t)nonce[0] | (size_t)nonce[1] << 8) % SEEN_BUCKETS;
    for (struct seen **pp = &p->seen[b]; *pp != NULL;) {
        struct seen *s = *pp;
        if (s->until < now) {
            *pp = s->next;
            free(s);
            p->seen_count--;
            continue;
        }
        if (memcmp(s->nonce, nonce, NONCE_LEN) == 0)
            return 1;
        pp = &s->next;
    }
    struct seen *s = malloc(sizeof(*s));
    if (s == NULL)
        return -1;
    memcpy(s->nonce, nonce, NONCE_LEN);
    s->until = now + 2 * SP_PROXY_SKEW_S;
    s->next = p->seen[b];
    p->seen[b] = s;
    p->seen_count++;
    return 0;
}

/* ---- lifetime of the proxy ---- */

sp_proxy_t *sp_proxy_create(sp_loop_t *loop, const sp_proxy_opts_t *o, sp_err_t *err)
{
    if (o->key != NULL && (o->key_len < SP_PROXY_KEY_MIN || o->key_len > SP_PROXY_KEY_MAX)) {
        sp_err_set(err, SP_EINVAL, "the cluster key must be %d to %d bytes", SP_PROXY_KEY_MIN,
                   SP_PROXY_KEY_MAX);
        return NULL;
    }
    sp_proxy_t *p = calloc(1, sizeof(*p));
    if (p == NULL) {
        sp_err_set(err, SP_EINTERNAL, "out of memory");
        return NULL;
    }
    p->loop = loop;
    p->hloop = sp_loop_native(loop);
    if (o->key != NULL) {
        memcpy(p->key, o->key, o->key_len);
        p->key_len = o->key_len;
    }
    h2o_timeout_init(p->hloop, &p->connect_to,
                     o->connect_timeout_ms ? o->connect_timeout_ms : 5000);
    h2o_timeout_init(p->hloop, &p->idle_to, o->idle_timeout_ms ? o->idle_timeout_ms : 610000);
    return p;
}

void sp_proxy_destroy(sp_proxy_t *p)
{
    if (p == NULL)
        return;
    seen_prune(p, (time_t)INT64_MAX);
    while (p->gets != NULL) /* only at exit: their callers go with the loop */
        sp_proxy_get_cancel(p->gets);
    h2o_timeout_dispose(p->hloop, &p->connect_to);
    h2o_timeout_dispose(p->hloop, &p->idle_to);
    OPENSSL_cleanse(p->key, sizeof(p->key));
    free(p);
}

bool sp_proxy_has_key(const sp_proxy_t *p)
{
    return p != NULL && p->key_len > 0;
}

/* ---- the cluster header ---- */

static int hexdec(const char *s, size_t slen, unsigned char *out, size_t n)
{
    if (slen != 2 * n)
        return -1;
    for (size_t i = 0; i < n; i++) {
        int v = 0;
        for (int k = 0; k < 2; k++) {
            char c = s[2 * i + k];
            int d = c >= '0' && c <= '9' ? c - '0' : c >= 'a' && c <= 'f' ? c - 'a' + 10 : -1;
            if (d < 0)
                return -1;
            v = v * 16 + d;
        }
        out[i] = (unsigned char)v;
    }
    return 0;
}

/* HMAC-SHA256("v1\n" method "\n" authority "\n" path "\n" ts "\n" nonce-hex). */
static int mac_of(const sp_proxy_t *p, h2o_iovec_t method, h2o_iovec_t authority, h2o_iovec_t path,
                  long long ts, const char *nonce_hex, unsigned char out[MAC_LEN])
{
    char tsb[32];
    snprintf(tsb, sizeof(tsb), "%lld", ts);
    const h2o_iovec_t parts[] = {{H2O_STRLIT("v1")}, method,
                                 authority,          path,
                                 {tsb, strlen(tsb)}, {(char *)nonce_hex, strlen(nonce_hex)}};
    sp_buf_t m = SP_BUF_INIT;
    for (size_t i = 0; i < sizeof(parts) / sizeof(parts[0]); i++) {
        sp_buf_add(&m, parts[i].base, parts[i].len);
        sp_buf_str(&m, "\n");
    }
    unsigned int len = 0;
    bool ok = !m.oom && HMAC(EVP_sha256(), p->key, (int)p->key_len, m.p, m.len, out, &len) != NULL;
    sp_buf_free(&m);
    return ok && len == MAC_LEN ? 0 : -1;
}

/* "v1 <ts> <nonce-hex> <mac-hex>" into out (>= 128 bytes), for a request with this method,
 * authority and path (query included). */
static int sign(const sp_proxy_t *p, h2o_iovec_t method, h2o_iovec_t authority, h2o_iovec_t path,
                char *out, size_t cap)
{
    unsigned char nonce[NONCE_LEN], mac[MAC_LEN];
    char nh[2 * NONCE_LEN + 1], mh[2 * MAC_LEN + 1];
    if (RAND_bytes(nonce, sizeof(nonce)) != 1)
        return -1;
    sp_text_hex(nonce, sizeof(nonce), nh);
    long long ts = (long long)time(NULL);
    if (mac_of(p, method, authority, path, ts, nh, mac) < 0)
        return -1;
    sp_text_hex(mac, sizeof(mac), mh);
    int n = snprintf(out, cap, "v1 %lld %s %s", ts, nh, mh);
    return n > 0 && (size_t)n < cap ? 0 : -1;
}

static bool verify(sp_proxy_t *p, h2o_req_t *req, const h2o_iovec_t *v)
{
    if (p == NULL || p->key_len == 0 || v->len > 200)
        return false;
    char buf[201];
    memcpy(buf, v->base, v->len);
    buf[v->len] = '\0';
    char *save = NULL, *ver = strtok_r(buf, " ", &save), *tss = strtok_r(NULL, " ", &save),
         *nh = strtok_r(NULL, " ", &save), *mh = strtok_r(NULL, " ", &save);
    if (ver == NULL || strcmp(ver, "v1") != 0 || tss == NULL || nh == NULL || mh == NULL ||
        strtok_r(NULL, " ", &save) != NULL)
        return false;
    char *e;
    long long ts = strtoll(tss, &e, 10);
    time_t now = time(NULL);
    if (*e != '\0' || ts < (long long)now - SP_PROXY_SKEW_S ||
        ts > (long long)now + SP_PROXY_SKEW_S)
        return false;
    unsigned char nonce[NONCE_LEN], given[MAC_LEN], want[MAC_LEN];
    if (hexdec(nh, strlen(nh), nonce, NONCE_LEN) < 0 ||
        hexdec(mh, strlen(mh), given, MAC_LEN) < 0 ||
        mac_of(p, req->method, req->authority, req->input.path, ts, nh, want) < 0 ||
        CRYPTO_memcmp(given, want, MAC_LEN) != 0)
        return false;
    /* Only a header that verifies may take a place in the cache. */
    return seen_add(p, nonce, now) == 0;
}

sp_proxy_origin_t sp_proxy_check(sp_proxy_t *p, h2o_req_t *req)
{
    sp_proxy_origin_t o = SP_PROXY_DIRECT;
    ssize_t i;
    while ((i = h2o_find_header_by_str(&req->headers, H2O_STRLIT(SP_PROXY_AUTH_HEADER), -1)) !=
           -1) {
        h2o_iovec_t v = req->headers.entries[i].value;
        /* One valid header and nothing else: a second one (valid or not) is forged. */
        if (o == SP_PROXY_DIRECT && verify(p, req, &v))
            o = SP_PROXY_FORWARDED;
        else
            o = SP_PROXY_FORGED;
        h2o_delete_header(&req->headers, i);
    }
    return o;
}

int sp_proxy_read_key(const char *path, unsigned char *out, size_t *len, sp_err_t *err)
{
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0)
        return sp_err_set(err, SP_EINVAL, "cannot open the cluster key file %s: %s", path,
                          strerror(errno));
    struct stat st;
    if (fstat(fd, &st) < 0 || !S_ISREG(st.st_mode)) {
        close(fd);
        return sp_err_set(err, SP_EINVAL, "the cluster key file %s is not a regular file", path);
    }
    if (st.st_mode & (S_IRWXG | S_IRWXO)) {
        close(fd);
        return sp_err_set(err, SP_EINVAL,
                          "the cluster key file %s may be read by others (mode %03o): chmod 600 it",
                          path, (unsigned)(st.st_mode & 0777));
    }
    unsigned char buf[SP_PROXY_KEY_MAX + 2];
    ssize_t n = read(fd, buf, sizeof(buf));
    close(fd);
    if (n < 0)
        return sp_err_set(err, SP_EINVAL, "cannot read the cluster key file %s", path);
    size_t k = (size_t)n;
    if (k > 0 && buf[k - 1] == '\n')
        k--;
    if (k > 0 && buf[k - 1] == '\r')
        k--;
    if (k < SP_PROXY_KEY_MIN || k > SP_PROXY_KEY_MAX) {
        OPENSSL_cleanse(buf, sizeof(buf));
        return sp_err_set(err, SP_EINVAL,
                          "the cluster key in %s must be %d to %d bytes (e.g. `head -c 48 "
                          "/dev/urandom | base64 > FILE`)",
                          path, SP_PROXY_KEY_MIN, SP_PROXY_KEY_MAX);
    }
    memcpy(out, buf, k);
    *len = k;
    OPENSSL_cleanse(buf, sizeof(buf));
    return 0;
}

/* ---- one forwarded request ---- */

enum phase { P_RESOLVE = 0, P_CONNECT, P_HEAD, P_BODY, P_UPGRADING, P_DONE };
enum framing { F_NONE = 0, F_LENGTH, F_CHUNKED, F_EOF };

struct resolve; /* a name being resolved off the loop */

struct px {
    h2o_generator_t gen; /* first: h2o hands it back */
    sp_proxy_t *p;
    h2o_req_t *req;   /* NULL once the client is gone or the response is final */
    struct px **hook; /* slot in req->pool that learns when the pool dies */
    h2o_context_t *ctx;
    h2o_socket_t *up; /* the upstream connection */
    h2o_timeout_entry_t tmo;
    struct resolve *rs;
    enum phase phase;
    char sandbox[65];
    char upstream[256];
    sp_buf_t head; /* the request head, written with the entity after it */
    bool upgrade, no_body;
    /* a request body streamed from the client as it comes (http/bodygate.h) */
    h2o_req_t *sreq; /* its request while the pool lives (x->req goes NULL earlier) */
    bool stream, schunked;
    bool sdone;    /* the whole body is written, or no more of it will be */
    bool swaiting; /* a piece is asked for: the client is what the exchange waits on */
    uint64_t slen; /* its Content-Length */
    char shex[24]; /* a chunk's size line */
    /* response */
    enum framing framing;
    uint64_t remaining; /* F_LENGTH */
    sp_chunked_t ck;
    sp_buf_t pend, fly; /* body bytes read and not yet sent; being sent (h2o keeps it) */
    bool body_done;     /* the whole body is in pend (or fly) */
    bool sending;
    bool up_eof;  /* the upstream ended (EOF or error): what its input holds is all */
    bool failing; /* cut the response once the send in flight is taken */
    int depth;
    bool dead;
};

static void px_enter(struct px *x)
{
    x->depth++;
}

static void px_close_up(struct px *x)
{
    if (x->up != NULL) {
        x->up->data = NULL;
        h2o_socket_close(x->up);
        x->up = NULL;
    }
    if (h2o_timeout_is_linked(&x->tmo))
        h2o_timeout_unlink(&x->tmo);
}

static void resolve_abandon(struct resolve *rs);

static void px_kill(struct px *x)
{
    if (x->sreq != NULL)
        sp_bodygate_body_cancel(x->sreq); /* no piece comes to x any more */
    px_close_up(x);
    if (x->rs != NULL) {
        resolve_abandon(x->rs);
        x->rs = NULL;
    }
    x->dead = true;
}

static void px_leave(struct px *x)
{
    if (--x->depth > 0 || !x->dead || x->phase == P_UPGRADING)
        return;
    if (x->hook != NULL)
        *x->hook = NULL;
    sp_buf_free(&x->head);
    sp_buf_free(&x->pend);
    sp_buf_free(&x->fly);
    free(x);
}

static void on_pool_gone(void *arg)
{
    struct px *x = *(struct px **)arg;
    if (x == NULL)
        return;
    x->hook = NULL;
    x->req = NULL;
    x->sreq = NULL;              /* the gate ends the body with the request */
    if (x->phase == P_UPGRADING) /* an upgrade disposes the request on purpose */
        return;
    px_enter(x);
    px_kill(x);
    px_leave(x);
}

void sp_proxy_error(h2o_req_t *req, int status, const char *sandbox, const char *msg)
{
    const char *code = status == 504 ? "timeout" : status == 503 ? "unavailable" : "bad_gateway";
    sp_http_json(req, status,
                 json_pack("{s:{s:s,s:s},s:s,s:s,s:i}", "error", "code", code, "message", msg,
                           "sandboxId", sandbox, "message", msg, "code", status));
}

/* Before the response started: an error answer; after: the client's response is cut. */
static void px_fail(struct px *x, int status, const char *what)
{
    h2o_req_t *req = x->req;
    if (req != NULL && x->phase <= P_HEAD) {
        char msg[512];
        if (x->sandbox[0] != '\0')
            snprintf(msg, sizeof(msg), "sandbox %s: its worker %s %s", x->sandbox, x->upstream,
                     what);
        else /* not a sandbox's (a template build's) */
            snprintf(msg, sizeof(msg), "worker %s %s", x->upstream, what);
        sp_log(SP_LOG_INFO, "proxy", "%s", msg);
        x->req = NULL;
        x->phase = P_DONE;
        sp_proxy_error(req, status, x->sandbox, msg);
    } else if (req != NULL && x->phase == P_BODY) {
        sp_log(SP_LOG_INFO, "proxy", "sandbox %s: worker %s %s mid-response", x->sandbox,
               x->upstream, what);
        if (x->sending) { /* h2o takes one send at a time: the error goes out on proceed */
            x->failing = true;
            px_close_up(x);
            return;
        }
        x->req = NULL;
        x->phase = P_DONE;
        h2o_send(req, NULL, 0, H2O_SEND_STATE_ERROR);
    }
    px_kill(x);
}

static void body_failed(struct px *x, int status, const char *code, const char *msg);

static void on_timeout(h2o_timeout_entry_t *e)
{
    struct px *x = H2O_STRUCT_FROM_MEMBER(struct px, tmo, e);
    px_enter(x);
    if (x->swaiting && x->phase == P_HEAD)
        body_failed(x, 408, "timeout", "no byte of the request body came in time");
    else if (x->phase <= P_CONNECT)
        px_fail(x, 502, "could not be reached in time");
    else
        px_fail(x, 504, "did not answer in time");
    px_leave(x);
}

static void arm(struct px *x, h2o_timeout_t *t)
{
    if (h2o_timeout_is_linked(&x->tmo))
        h2o_timeout_unlink(&x->tmo);
    h2o_timeout_link(x->p->hloop, t, &x->tmo);
}

/* ---- the request head ---- */

static bool named_in_connection(h2o_req_t *req, const h2o_iovec_t *name)
{
    for (ssize_t i = -1; (i = h2o_find_header(&req->headers, H2O_TOKEN_CONNECTION, i)) != -1;)
        if (h2o_contains_token(req->headers.entries[i].value.base,
                               req->headers.entries[i].value.len, name->base, name->len, ','))
            return true;
    return false;
}

static bool hop_by_hop(const h2o_iovec_t *name)
{
    /* RFC 9110 7.6.1, plus what this hop writes itself */
    static const char *const drop[] = {
        "connection",        "keep-alive",        "proxy-connection", "te",
        "trailer",           "transfer-encoding", "upgrade",          "host",
        "content-length",    "http2-settings",    "expect",           "x-forwarded-proto",
        SP_PROXY_AUTH_HEADER};
    for (size_t i = 0; i < sizeof(drop) / sizeof(drop[0]); i++)
        if (h2o_memis(name->base, name->len, drop[i], strlen(drop[i])))
            return true;
    return false;
}

static bool has_crlf(const char *p, size_t n)
{
    return memchr(p, '\r', n) != NULL || memchr(p, '\n', n) != NULL || memchr(p, 0, n) != NULL;
}

/* The head of req as it goes to the next node, into b: with method and path (query included)
 * instead of req's own, the body's framing line when framing (else none), and an Upgrade when
 * upgrade. */
static int write_head(const sp_proxy_t *p, sp_buf_t *b, h2o_req_t *req, h2o_iovec_t method,
                      h2o_iovec_t path, const char *framing, bool upgrade)
{
    if (has_crlf(method.base, method.len) || has_crlf(path.base, path.len) ||
        has_crlf(req->authority.base, req->authority.len))
        return -1;
    sp_buf_add(b, method.base, method.len);
    sp_buf_str(b, " ");
    if (path.len == 0 || path.base[0] != '/')
        sp_buf_str(b, "/");
    sp_buf_add(b, path.base, path.len);
    sp_buf_str(b, " HTTP/1.1\r\nHost: ");
    sp_buf_add(b, req->authority.base, req->authority.len);
    sp_buf_str(b, "\r\n");
    h2o_iovec_t xff = {NULL, 0}, fwd = {NULL, 0};
    for (size_t i = 0; i < req->headers.size; i++) {
        const h2o_header_t *h = &req->headers.entries[i];
        if (hop_by_hop(h->name) || named_in_connection(req, h->name) ||
            has_crlf(h->value.base, h->value.len) ||
            (h->name->len >= sizeof(SP_BODYGATE_GATED_PREFIX) - 1 &&
             strncasecmp(h->name->base, SP_BODYGATE_GATED_PREFIX,
                         sizeof(SP_BODYGATE_GATED_PREFIX) - 1) == 0))
            continue; /* the gate's renamed framing fields: the framing is written below */
        if (h2o_memis(h->name->base, h->name->len, H2O_STRLIT("x-forwarded-for"))) {
            xff = h->value;
            continue;
        }
        if (h2o_memis(h->name->base, h->name->len, H2O_STRLIT("forwarded"))) {
            fwd = h->value;
            continue;
        }
        sp_buf_add(b, h->orig_name ? h->orig_name : h->name->base, h->name->len);
        sp_buf_str(b, ": ");
        sp_buf_add(b, h->value.base, h->value.len);
        sp_buf_str(b, "\r\n");
    }
    /* Where the client came from (RFC 7239 and the common X-Forwarded-* spelling), after what
     * earlier hops said. */
    char host[NI_MAXHOST] = "unknown";
    struct sockaddr_storage ss;
    socklen_t sl = req->conn->callbacks->get_peername != NULL
                       ? req->conn->callbacks->get_peername(req->conn, (struct sockaddr *)&ss)
                       : 0;
    if (sl > 0 && h2o_socket_getnumerichost((struct sockaddr *)&ss, sl, host) == SIZE_MAX)
        snprintf(host, sizeof(host), "unknown");
    bool v6 = strchr(host, ':') != NULL;
    const char *proto = req->scheme == &H2O_URL_SCHEME_HTTPS ? "https" : "http";
    sp_buf_str(b, "X-Forwarded-For: ");
    if (xff.base != NULL) {
        sp_buf_add(b, xff.base, xff.len);
        sp_buf_str(b, ", ");
    }
    sp_buf_printf(b, "%s\r\nForwarded: ", host);
    if (fwd.base != NULL) {
        sp_buf_add(b, fwd.base, fwd.len);
        sp_buf_str(b, ", ");
    }
    sp_buf_printf(b, "for=%s%s%s;proto=%s", v6 ? "\"[" : "", host, v6 ? "]\"" : "", proto);
    if (req->authority.len > 0 && memchr(req->authority.base, '"', req->authority.len) == NULL) {
        sp_buf_str(b, ";host=\"");
        sp_buf_add(b, req->authority.base, req->authority.len);
        sp_buf_str(b, "\"");
    }
    sp_buf_printf(b, "\r\nX-Forwarded-Proto: %s\r\n", proto);
    if (framing != NULL)
        sp_buf_str(b, framing);
    char sig[160];
    if (sign(p, method, req->authority, path, sig, sizeof(sig)) < 0)
        return -1;
    sp_buf_printf(b, "Space-Cluster-Auth: %s\r\n", sig);
    if (upgrade) {
        sp_buf_str(b, "Connection: upgrade\r\nUpgrade: ");
        sp_buf_add(b, req->upgrade.base, req->upgrade.len);
        sp_buf_str(b, "\r\n\r\n");
    } else {
        sp_buf_str(b, "Connection: close\r\n\r\n");
    }
    return b->oom ? -1 : 0;
}

static int build_head(struct px *x, h2o_req_t *req)
{
    /* the path as the client sent it, query included */
    char framing[64];
    if (x->stream && x->schunked)
        snprintf(framing, sizeof(framing), "Transfer-Encoding: chunked\r\n");
    else if (x->stream)
        snprintf(framing, sizeof(framing), "Content-Length: %llu\r\n", (unsigned long long)x->slen);
    else if (req->entity.base != NULL)
        snprintf(framing, sizeof(framing), "Content-Length: %zu\r\n", req->entity.len);
    else
        framing[0] = '\0';
    return write_head(x->p, &x->head, req, req->method, req->input.path,
                      framing[0] != '\0' ? framing : NULL, x->upgrade);
}

/* ---- toward the client ---- */

static void pump_body(struct px *x);

static void on_proceed(h2o_generator_t *gen, h2o_req_t *req)
{
    struct px *x = (struct px *)gen;
    px_enter(x);
    x->sending = false;
    sp_buf_reset(&x->fly);
    if (x->failing) {
        x->req = NULL;
        x->phase = P_DONE;
        px_kill(x);
        h2o_send(req, NULL, 0, H2O_SEND_STATE_ERROR);
    } else {
        arm(x, &x->p->idle_to); /* the client took bytes: the exchange is alive */
        pump_body(x);
    }
    px_leave(x);
}

static void on_stop(h2o_generator_t *gen, h2o_req_t *req)
{
    struct px *x = (struct px *)gen;
    px_enter(x);
    x->req = NULL;
    x->phase = P_DONE;
    px_kill(x);
    px_leave(x);
}

static void on_up_read(h2o_socket_t *sock, const char *err);

/* Moves the body bytes the upstream's input holds into pend (decoded when chunked). */
static int take_input(struct px *x)
{
    h2o_socket_t *up = x->up;
    char *p = up->input->bytes;
    size_t raw = up->input->size, n = raw;
    switch (x->framing) {
    case F_NONE:
        x->body_done = true;
        n = 0;
        break;
    case F_LENGTH:
        if (n >= x->remaining) {
            n = (size_t)x->remaining; /* bytes past Content-Length are dropped */
            x->body_done = true;
        }
        x->remaining -= n;
        break;
    case F_CHUNKED: {
        size_t in = 0, out = 0;
        while (in < raw) {
            size_t used, dlen;
            const uint8_t *data;
            int rc = sp_chunked_step(&x->ck, (const uint8_t *)p + in, raw - in, raw - in, &used,
                                     &data, &dlen);
            if (rc < 0)
                return -1;
            if (dlen > 0)
                memmove(p + out, data, dlen); /* data lies at or after p + out */
            out += dlen;
            in += used;
            if (rc == 1) {
                x->body_done = true;
                break;
            }
            if (used == 0)
                break;
        }
        n = out;
        raw = x->body_done ? raw : in;
        break;
    }
    case F_EOF:
        break;
    }
    if (n > 0)
        sp_buf_add(&x->pend, p, n);
    h2o_buffer_consume(&up->input, raw);
    return x->pend.oom ? -1 : 0;
}

/*
 * The body toward the client: what came from the upstream goes to pend, pend goes out when
 * nothing is in flight (h2o takes one send at a time and keeps the buffer until proceed).
 * The upstream is read while pend holds less than PEND_MAX: a slow client stops it, and
 * reading ahead by that much keeps both sockets busy.
 */
static void pump_body(struct px *x)
{
    if (x->req == NULL)
        return;
    if (x->up != NULL && !x->body_done) {
        if (take_input(x) < 0) {
            px_fail(x, 502, "sent a bad chunked body");
            return;
        }
        if (!x->body_done && x->up_eof) {
            if (x->framing != F_EOF) {
                px_fail(x, 502, "closed the connection");
                return;
            }
            x->body_done = true; /* the end of the connection is the end of the body */
        }
    }
    if (!x->sending && x->body_done) {
        /* x goes away now while h2o may still write: the last bytes live in the pool. */
        h2o_req_t *req = x->req;
        h2o_iovec_t buf = {NULL, 0};
        if (x->pend.len > 0) {
            buf.base = h2o_mem_alloc_pool(&req->pool, x->pend.len);
            memcpy(buf.base, x->pend.p, x->pend.len);
            buf.len = x->pend.len;
        }
        x->req = NULL;
        x->phase = P_DONE;
        px_kill(x);
        h2o_send(req, &buf, buf.len ? 1 : 0, H2O_SEND_STATE_FINAL);
        return;
    }
    if (!x->sending && x->pend.len > 0) {
        sp_buf_t t = x->fly; /* empty: its memory is reused */
        x->fly = x->pend;
        x->pend = t;
        x->sending = true;
        h2o_iovec_t buf = h2o_iovec_init(x->fly.p, x->fly.len);
        h2o_send(x->req, &buf, 1, H2O_SEND_STATE_IN_PROGRESS);
        if (x->dead)
            return;
    }
    if (x->up == NULL)
        return;
    bool want = !x->body_done && !x->up_eof && x->pend.len < PEND_MAX;
    if (want && !h2o_socket_is_reading(x->up))
        h2o_socket_read_start(x->up, on_up_read);
    else if (!want && h2o_socket_is_reading(x->up))
        h2o_socket_read_stop(x->up); /* backpressure: the client has not taken enough */
}

/* ---- the response head ---- */

static bool field_is(const struct phr_header *h, const char *s)
{
    return h->name_len == strlen(s) && strncasecmp(h->name, s, h->name_len) == 0;
}

static bool resp_hop_by_hop(const struct phr_header *fields, size_t nf, size_t i, bool upgrade)
{
    static const char *const skip[] = {
        "connection",     "keep-alive", "proxy-connection", "transfer-encoding", "te", "trailer",
        "content-length", "date",       "server",           SP_PROXY_AUTH_HEADER};
    for (size_t k = 0; k < sizeof(skip) / sizeof(skip[0]); k++)
        if (field_is(&fields[i], skip[k]))
            return true;
    /* h2o writes "connection: upgrade" on a 101 but not the Upgrade header itself. */
    if (field_is(&fields[i], "upgrade"))
        return !upgrade;
    char lname[128]; /* h2o_contains_token wants the token in lower case */
    if (fields[i].name_len >= sizeof(lname))
        return false;
    for (size_t k = 0; k < fields[i].name_len; k++)
        lname[k] = h2o_tolower(fields[i].name[k]);
    for (size_t k = 0; k < nf; k++)
        if (fields[k].name != NULL && field_is(&fields[k], "connection") &&
            h2o_contains_token(fields[k].value, fields[k].value_len, lname, fields[i].name_len,
                               ','))
            return true;
    return false;
}

static void copy_headers(h2o_req_t *req, const struct phr_header *fields, size_t nf, bool upgrade)
{
    for (size_t i = 0; i < nf; i++) {
        if (fields[i].name == NULL || resp_hop_by_hop(fields, nf, i, upgrade))
            continue; /* (a NULL name is a folded continuation line) */
        h2o_iovec_t name = h2o_strdup(&req->pool, fields[i].name, fields[i].name_len);
        h2o_strtolower(name.base, name.len);
        h2o_iovec_t value = h2o_strdup(&req->pool, fields[i].value, fields[i].value_len);
        h2o_add_header_by_str(&req->pool, &req->res.headers, name.base, name.len, 1, NULL,
                              value.base, value.len);
    }
}

static void on_upgraded(void *data, h2o_socket_t *sock, size_t reqsize)
{
    struct px *x = data;
    px_enter(x);
    x->phase = P_DONE;
    if (sock == NULL || x->dead || x->up == NULL) {
        if (sock != NULL)
            h2o_socket_close(sock);
        px_kill(x);
        px_leave(x);
        return;
    }
    h2o_buffer_consume(&sock->input, reqsize); /* the upgrade request itself */
    if (h2o_timeout_is_linked(&x->tmo))
        h2o_timeout_unlink(&x->tmo);
    h2o_socket_t *up = x->up;
    x->up = NULL;
    up->data = NULL;
    /* Both ways with backpressure from here; the tunnel owns both sockets and closes them
     * when either side ends or nothing moves for the idle timeout. */
    h2o_tunnel_establish(x->ctx, sock, up, &x->p->idle_to);
    px_kill(x);
    px_leave(x);
}

static void body_stop(struct px *x);

/* Parses the response head once it is all in; starts the response. */
static void read_head(struct px *x)
{
    h2o_socket_t *up = x->up;
    for (;;) {
        int minor, status;
        const char *msg;
        size_t msg_len, nf = MAX_FIELDS;
        struct phr_header fields[MAX_FIELDS];
        int hl = phr_parse_response(up->input->bytes, up->input->size, &minor, &status, &msg,
                                    &msg_len, fields, &nf, 0);
        if (hl == -2) {
            if (up->input->size > HEAD_MAX)
                px_fail(x, 502, "sent a response head that is too large");
            return;
        }
        if (hl < 0 || status < 100 || status > 999) {
            px_fail(x, 502, "sent a bad response");
            return;
        }
        h2o_req_t *req = x->req;
        if (status == 101 && x->upgrade) {
            req->res.status = 101;
            req->res.reason = "Switching Protocols";
            copy_headers(req, fields, nf, true);
            h2o_buffer_consume(&up->input, (size_t)hl); /* what follows is the tunnel's */
            h2o_socket_read_stop(up);
            x->phase = P_UPGRADING;
            x->ctx = req->conn->ctx;
            x->req = NULL;
            h2o_http1_upgrade(req, NULL, 0, on_upgraded, x);
            return;
        }
        if (status < 200) { /* 100 Continue, 103 Early Hints...: skip to the real one */
            h2o_buffer_consume(&up->input, (size_t)hl);
            continue;
        }
        body_stop(x);
        req->res.status = status;
        req->res.reason = h2o_strdup(&req->pool, msg, msg_len).base;
        copy_headers(req, fields, nf, false);
        x->framing = F_EOF;
        bool has_length = false;
        for (size_t i = 0; i < nf; i++) {
            if (fields[i].name == NULL)
                continue;
            if (field_is(&fields[i], "transfer-encoding") &&
                h2o_contains_token(fields[i].value, fields[i].value_len, H2O_STRLIT("chunked"),
                                   ','))
                x->framing = F_CHUNKED;
            if (field_is(&fields[i], "content-length")) {
                char num[32];
                size_t vl = fields[i].value_len;
                if (vl == 0 || vl >= sizeof(num)) {
                    px_fail(x, 502, "sent a bad Content-Length");
                    return;
                }
                memcpy(num, fields[i].value, vl);
                num[vl] = '\0';
                char *e;
                unsigned long long v = strtoull(num, &e, 10);
                if (*e != '\0' || num[0] < '0' || num[0] > '9' ||
                    (has_length && v != x->remaining)) {
                    px_fail(x, 502, "sent a bad Content-Length");
                    return;
                }
                x->remaining = v;
                has_length = true;
            }
        }
        if (x->framing != F_CHUNKED && has_length)
            x->framing = F_LENGTH;
        if (x->no_body || status == 204 || status == 304 ||
            (x->framing == F_LENGTH && x->remaining == 0))
            x->framing = F_NONE;
        if (x->framing == F_LENGTH)
            req->res.content_length = (size_t)x->remaining;
        else if (x->framing == F_NONE && x->no_body && has_length)
            req->res.content_length = (size_t)x->remaining; /* HEAD: the length GET would have */
        h2o_buffer_consume(&up->input, (size_t)hl);
        x->phase = P_BODY;
        h2o_start_response(req, &x->gen);
        pump_body(x);
        return;
    }
}

static void on_up_read(h2o_socket_t *sock, const char *err)
{
    struct px *x = sock->data;
    if (x == NULL)
        return;
    px_enter(x);
    arm(x, &x->p->idle_to);
    if (err != NULL) {
        x->up_eof = true;
        h2o_socket_read_stop(sock);
    }
    if (x->phase == P_HEAD && x->req != NULL && sock->input->size > 0)
        read_head(x);
    if (x->phase == P_HEAD && x->up_eof && !x->dead)
        px_fail(x, 502, "closed the connection without a response");
    else if (x->phase == P_BODY && !x->dead)
        pump_body(x);
    px_leave(x);
}

/* ---- a request body streamed toward the upstream ----
 *
 * One piece at a time (http/bodygate.h): the next is asked for once the last is written, so a
 * slow upstream holds the client back, and what is in flight here is one piece. Each goes as
 * it came, or as one chunk when the client's body was chunked. The body stops when the answer
 * begins (a worker answers before the whole body only to refuse it); the client's connection
 * then closes after the answer, its remaining bytes drained by the gate.
 */

static void on_written(h2o_socket_t *sock, const char *err);

/* The client's body could not be had: before the answer, an error answer; after, nothing more
 * goes up. */
static void body_failed(struct px *x, int status, const char *code, const char *msg)
{
    h2o_req_t *req = x->req;
    x->sdone = true;
    x->swaiting = false;
    sp_log(SP_LOG_INFO, "proxy", "sandbox %s: request body to worker %s: %s", x->sandbox,
           x->upstream, msg);
    if (req != NULL && x->phase <= P_HEAD) {
        x->req = NULL;
        x->phase = P_DONE;
        sp_http_json(req, status,
                     json_pack("{s:{s:s,s:s},s:s,s:s,s:i}", "error", "code", code, "message", msg,
                               "sandboxId", x->sandbox, "message", msg, "code", status));
        px_kill(x);
    }
}

static void on_body_piece(void *arg, const char *data, size_t len, bool end, const sp_err_t *err)
{
    struct px *x = arg;
    px_enter(x);
    x->swaiting = false;
    if (err != NULL) {
        body_failed(x, sp_err_http_status(err->code), sp_err_name(err->code), err->msg);
    } else if (x->up != NULL && !x->sdone) {
        h2o_iovec_t bufs[4];
        size_t k = 0;
        if (len > 0 && x->schunked) {
            int hn = snprintf(x->shex, sizeof(x->shex), "%zx\r\n", len);
            bufs[k++] = h2o_iovec_init(x->shex, (size_t)hn);
        }
        if (len > 0)
            bufs[k++] = h2o_iovec_init(data, len);
        if (len > 0 && x->schunked)
            bufs[k++] = h2o_iovec_init(H2O_STRLIT("\r\n"));
        if (end && x->schunked)
            bufs[k++] = h2o_iovec_init(H2O_STRLIT("0\r\n\r\n"));
        x->sdone = end;
        arm(x, &x->p->idle_to); /* the client sent bytes: the exchange is alive */
        if (k > 0)
            h2o_socket_write(x->up, bufs, k, on_written);
    }
    px_leave(x);
}

/* Asks for the next piece of the body, while it goes on. */
static void body_next(struct px *x)
{
    if (!x->stream || x->sdone || x->sreq == NULL || x->up == NULL || x->phase != P_HEAD)
        return;
    if (sp_bodygate_body_read(x->sreq, on_body_piece, x) < 0)
        body_failed(x, 500, sp_err_name(SP_EINTERNAL), "the request body cannot be read");
    else
        x->swaiting = true;
}

/* The answer began: no more of the body goes up. */
static void body_stop(struct px *x)
{
    if (x->stream && !x->sdone) {
        x->sdone = true;
        x->swaiting = false;
        if (x->sreq != NULL)
            sp_bodygate_body_cancel(x->sreq);
    }
}

static void on_written(h2o_socket_t *sock, const char *err)
{
    struct px *x = sock->data;
    if (x == NULL)
        return;
    px_enter(x);
    if (err != NULL && x->stream && x->phase == P_HEAD) {
        /* The worker may have answered and closed before taking the whole body: its answer
         * (or its end without one) is read next. */
        body_stop(x);
        if (x->up_eof)
            px_fail(x, 502, "closed the connection without a response");
    } else if (err != NULL && x->phase <= P_HEAD) {
        px_fail(x, 502, "closed the connection before taking the request");
    } else if (err == NULL) {
        body_next(x);
    }
    px_leave(x);
}

static void on_connect(h2o_socket_t *sock, const char *err)
{
    struct px *x = sock->data;
    if (x == NULL)
        return;
    px_enter(x);
    if (err != NULL) {
        char what[160];
        snprintf(what, sizeof(what), "is unreachable (%s)", err);
        px_fail(x, 502, what);
        px_leave(x);
        return;
    }
    x->phase = P_HEAD;
    arm(x, &x->p->idle_to);
    h2o_req_t *req = x->req;
    h2o_iovec_t bufs[2] = {h2o_iovec_init(x->head.p, x->head.len),
                           h2o_iovec_init(req->entity.base, req->entity.len)};
    h2o_socket_write(sock, bufs, req->entity.base != NULL && req->entity.len > 0 ? 2 : 1,
                     on_written);
    h2o_socket_read_start(sock, on_up_read);
    px_leave(x);
}

static void start_connect(struct px *x, struct sockaddr *sa, socklen_t len)
{
    x->phase = P_CONNECT;
    x->up = h2o_socket_connect(x->p->hloop, sa, len, on_connect);
    if (x->up == NULL) {
        px_fail(x, 502, "is unreachable (connect failed)");
        return;
    }
    x->up->data = x;
    /* One socket read drains what the kernel holds: a bounded receive buffer bounds it (and
     * with it pend), where loopback's autotuning would let it grow to megabytes. */
    int rcvbuf = UP_RCVBUF;
    setsockopt(h2o_socket_get_fd(x->up), SOL_SOCKET, SO_RCVBUF, &rcvbuf, sizeof(rcvbuf));
    arm(x, &x->p->connect_to);
}

/* ---- names resolved off the loop ---- */

/* Who waits for a name: a forwarded request or a peer GET. */
typedef void (*resolved_fn)(void *owner, int rc, const char *host, struct sockaddr *sa,
                            socklen_t len);

struct resolve {
    resolved_fn done;
    void *owner; /* NULL once abandoned */
    char host[256], port[8];
    struct sockaddr_storage addr;
    socklen_t addrlen;
    int rc;
};

static void resolve_run(sp_work_t *w, void *arg)
{
    struct resolve *rs = arg;
    struct addrinfo hints = {.ai_socktype = SOCK_STREAM}, *ai = NULL;
    rs->rc = getaddrinfo(rs->host, rs->port, &hints, &ai);
    if (rs->rc == 0 && ai != NULL && ai->ai_addrlen <= sizeof(rs->addr)) {
        memcpy(&rs->addr, ai->ai_addr, ai->ai_addrlen);
        rs->addrlen = ai->ai_addrlen;
    } else if (rs->rc == 0) {
        rs->rc = EAI_FAIL;
    }
    if (ai != NULL)
        freeaddrinfo(ai);
}

static void resolve_done(void *arg, bool cancelled)
{
    struct resolve *rs = arg;
    if (!cancelled && rs->owner != NULL)
        rs->done(rs->owner, rs->rc, rs->host, (struct sockaddr *)&rs->addr, rs->addrlen);
    free(rs);
}

static void resolve_abandon(struct resolve *rs)
{
    rs->owner = NULL; /* done frees it */
}

/* Splits "host:port" / "[v6]:port": 1 with a literal address in *sa, 0 with a name to resolve
 * in host and port, -1 when upstream is malformed. */
static int parse_upstream(const char *upstream, char host[256], long *port,
                          struct sockaddr_storage *sa, socklen_t *len)
{
    const char *colon = strrchr(upstream, ':');
    const char *hs = upstream, *he = colon;
    if (upstream[0] == '[') {
        const char *rb = strchr(upstream, ']');
        if (rb == NULL || rb + 1 != colon)
            return -1;
        hs = upstream + 1;
        he = rb;
    }
    char *e = NULL;
    *port = colon != NULL ? strtol(colon + 1, &e, 10) : 0;
    if (colon == NULL || he <= hs || (size_t)(he - hs) >= 256 || *e != '\0' || *port <= 0 ||
        *port > 65535)
        return -1;
    memcpy(host, hs, (size_t)(he - hs));
    host[he - hs] = '\0';
    struct sockaddr_in a4 = {.sin_family = AF_INET, .sin_port = htons((uint16_t)*port)};
    struct sockaddr_in6 a6 = {.sin6_family = AF_INET6, .sin6_port = htons((uint16_t)*port)};
    memset(sa, 0, sizeof(*sa));
    if (inet_pton(AF_INET, host, &a4.sin_addr) == 1) {
        memcpy(sa, &a4, sizeof(a4));
        *len = sizeof(a4);
        return 1;
    }
    if (inet_pton(AF_INET6, host, &a6.sin6_addr) == 1) {
        memcpy(sa, &a6, sizeof(a6));
        *len = sizeof(a6);
        return 1;
    }
    return 0;
}

/* Starts resolving host:port off the loop; NULL when it cannot (no memory, no thread). */
static struct resolve *resolve_start(sp_proxy_t *p, const char *host, long port, resolved_fn done,
                                     void *owner)
{
    struct resolve *rs = calloc(1, sizeof(*rs));
    if (rs == NULL)
        return NULL;
    rs->done = done;
    rs->owner = owner;
    snprintf(rs->host, sizeof(rs->host), "%s", host);
    snprintf(rs->port, sizeof(rs->port), "%ld", port);
    if (sp_loop_work(p->loop, SP_WORK_SHORT, resolve_run, resolve_done, rs) == NULL) {
        free(rs);
        return NULL;
    }
    return rs;
}

static void px_resolved(void *owner, int rc, const char *host, struct sockaddr *sa, socklen_t len)
{
    struct px *x = owner;
    x->rs = NULL;
    px_enter(x);
    if (rc != 0) {
        char what[400];
        snprintf(what, sizeof(what), "is unreachable (cannot resolve %s: %s)", host,
                 gai_strerror(rc));
        px_fail(x, 502, what);
    } else {
        start_connect(x, sa, len);
    }
    px_leave(x);
}

/* Connects at once to a literal address, else resolves the name first. */
static void locate(struct px *x, const char *upstream)
{
    char host[256];
    long port;
    struct sockaddr_storage sa;
    socklen_t len = 0;
    int k = parse_upstream(upstream, host, &port, &sa, &len);
    if (k < 0) {
        px_fail(x, 502, "has a bad address");
        return;
    }
    if (k == 1) {
        start_connect(x, (struct sockaddr *)&sa, len);
        return;
    }
    arm(x, &x->p->connect_to); /* the name's resolution counts toward connecting */
    x->rs = resolve_start(x->p, host, port, px_resolved, x);
    if (x->rs == NULL)
        px_fail(x, 502, "cannot be resolved (out of memory or no worker thread)");
}

void sp_proxy_forward(sp_proxy_t *p, h2o_req_t *req, const char *upstream, const char *sandbox_id)
{
    if (!sp_proxy_has_key(p)) {
        char msg[256];
        snprintf(msg, sizeof(msg),
                 "sandbox %s runs on another worker and this node has no cluster key "
                 "(--cluster-key-file) to forward the request with",
                 sandbox_id);
        sp_proxy_error(req, 503, sandbox_id, msg);
        return;
    }
    struct px *x = calloc(1, sizeof(*x));
    if (x == NULL) {
        sp_proxy_error(req, 503, sandbox_id, "out of memory");
        return;
    }
    x->gen.proceed = on_proceed;
    x->gen.stop = on_stop;
    x->p = p;
    x->req = req;
    x->tmo.cb = on_timeout;
    x->ck = (sp_chunked_t)SP_CHUNKED_INIT;
    snprintf(x->sandbox, sizeof(x->sandbox), "%s", sandbox_id);
    snprintf(x->upstream, sizeof(x->upstream), "%s", upstream);
    x->no_body = sp_http_method_is(req, "HEAD");
    if (sp_bodygate_streamed(req, &x->slen, &x->schunked)) {
        x->stream = true;
        x->sreq = req;
    }
    /* Upgrades exist only in HTTP/1.1 (HTTP/2 has none; h2c is h2o's own business). */
    x->upgrade = req->version < 0x200 && req->upgrade.base != NULL &&
                 !h2o_lcstris(req->upgrade.base, req->upgrade.len, H2O_STRLIT("h2c"));
    if (build_head(x, req) < 0) {
        sp_buf_free(&x->head);
        free(x);
        sp_proxy_error(req, 400, sandbox_id, "this request cannot be forwarded");
        return;
    }
    x->hook = h2o_mem_alloc_shared(&req->pool, sizeof(*x->hook), on_pool_gone);
    *x->hook = x;
    px_enter(x);
    locate(x, upstream);
    px_leave(x);
}

/* ---- a GET to another node, its whole answer kept (sp_proxy_get) ---- */

struct sp_proxy_get {
    sp_proxy_t *p;
    struct sp_proxy_get *prev, *next; /* p's list of GETs in flight */
    sp_proxy_got_cb cb;
    void *arg;
    h2o_socket_t *up;
    struct resolve *rs;
    sp_timer_t timer; /* the deadline; also runs a failure outside sp_proxy_get */
    char why[200];    /* set: fail with it when the timer fires */
    char upstream[256];
    sp_buf_t head, in; /* the request head; the whole response as read */
};

static void pg_close(sp_proxy_get_t *g)
{
    if (g->up != NULL) {
        g->up->data = NULL;
        h2o_socket_close(g->up);
        g->up = NULL;
    }
    if (g->rs != NULL) {
        resolve_abandon(g->rs);
        g->rs = NULL;
    }
    sp_timer_stop(&g->timer);
    if (g->prev != NULL)
        g->prev->next = g->next;
    else
        g->p->gets = g->next;
    if (g->next != NULL)
        g->next->prev = g->prev;
    sp_buf_free(&g->head);
    sp_buf_free(&g->in);
}

/* Ends g: cb once, with the answer (status > 0) or why it could not be had. */
static void pg_end(sp_proxy_get_t *g, int status, const char *body, size_t len, const char *why)
{
    sp_proxy_got_cb cb = g->cb;
    void *arg = g->arg;
    char upstream[256], msg[512];
    snprintf(upstream, sizeof(upstream), "%s", g->upstream);
    if (status == 0) {
        snprintf(msg, sizeof(msg), "worker %s %s", upstream, why);
        sp_log(SP_LOG_INFO, "proxy", "peer get failed: %s", msg);
    }
    /* The body lives in g->in until cb returns. */
    sp_buf_t in = g->in;
    g->in = (sp_buf_t)SP_BUF_INIT;
    pg_close(g);
    free(g);
    cb(arg, status, body, len, status == 0 ? msg : NULL);
    sp_buf_free(&in);
}

/* Defers a failure to the loop: the callback never runs inside sp_proxy_get. */
static void pg_fail_later(sp_proxy_get_t *g, const char *why)
{
    if (g->up != NULL) {
        g->up->data = NULL;
        h2o_socket_close(g->up);
        g->up = NULL;
    }
    snprintf(g->why, sizeof(g->why), "%s", why);
    sp_timer_start(&g->timer, 0);
}

static void pg_on_timer(sp_timer_t *t, void *arg)
{
    sp_proxy_get_t *g = arg;
    pg_end(g, 0, NULL, 0, g->why[0] ? g->why : "did not answer in time");
}

/* The whole response is in g->in (the upstream closed, or its Content-Length arrived):
 * answers cb. */
static void pg_parse(sp_proxy_get_t *g, bool eof)
{
    int minor, status;
    const char *msg;
    size_t msg_len, nf = MAX_FIELDS;
    struct phr_header fields[MAX_FIELDS];
    char *buf = (char *)g->in.p;
    int hl = phr_parse_response(buf, g->in.len, &minor, &status, &msg, &msg_len, fields, &nf, 0);
    if (hl == -2 && !eof)
        return; /* the head is not all in yet */
    if (hl < 0 || status < 200 || status > 999) {
        pg_end(g, 0, NULL, 0,
               hl == -2 ? "closed the connection without a response" : "sent a bad response");
        return;
    }
    bool chunked = false, has_length = false;
    unsigned long long length = 0;
    for (size_t i = 0; i < nf; i++) {
        if (fields[i].name == NULL)
            continue;
        if (field_is(&fields[i], "transfer-encoding") &&
            h2o_contains_token(fields[i].value, fields[i].value_len, H2O_STRLIT("chunked"), ','))
            chunked = true;
        if (field_is(&fields[i], "content-length") && fields[i].value_len > 0 &&
            fields[i].value_len < 20) {
            char num[24];
            memcpy(num, fields[i].value, fields[i].value_len);
            num[fields[i].value_len] = '\0';
            char *e;
            length = strtoull(num, &e, 10);
            has_length = *e == '\0' && num[0] >= '0' && num[0] <= '9';
        }
    }
    char *body = buf + hl;
    size_t n = g->in.len - (size_t)hl;
    if (chunked) {
        if (!eof)
            return; /* decoded once the connection ended */
        sp_chunked_t ck = SP_CHUNKED_INIT;
        size_t in = 0, out = 0;
        int rc = 0;
        while (in < n && rc == 0) {
            size_t used, dlen;
            const uint8_t *data;
            rc = sp_chunked_step(&ck, (const uint8_t *)body + in, n - in, n - in, &used, &data,
                                 &dlen);
            if (rc < 0)
                break;
            if (dlen > 0)
                memmove(body + out, data, dlen); /* data lies at or after body + out */
            out += dlen;
            in += used;
            if (used == 0 && rc == 0)
                break;
        }
        if (rc != 1) {
            pg_end(g, 0, NULL, 0, "sent a bad or cut chunked body");
            return;
        }
        n = out;
    } else if (has_length) {
        if (n < length) {
            if (eof)
                pg_end(g, 0, NULL, 0, "closed the connection mid-body");
            return;
        }
        n = (size_t)length;
    } else if (!eof) {
        return; /* the end of the connection is the end of the body */
    }
    pg_end(g, status, body, n, NULL);
}

static void pg_on_read(h2o_socket_t *sock, const char *err)
{
    sp_proxy_get_t *g = sock->data;
    if (g == NULL)
        return;
    sp_buf_add(&g->in, sock->input->bytes, sock->input->size);
    h2o_buffer_consume(&sock->input, sock->input->size);
    if (g->in.oom) {
        pg_end(g, 0, NULL, 0, "sent more than this node could hold");
        return;
    }
    if (g->in.len > SP_PROXY_GET_MAX + HEAD_MAX) {
        pg_end(g, 0, NULL, 0, "sent an answer that is too large");
        return;
    }
    pg_parse(g, err != NULL);
}

static void pg_on_written(h2o_socket_t *sock, const char *err)
{
    sp_proxy_get_t *g = sock->data;
    if (g != NULL && err != NULL)
        pg_fail_later(g, "closed the connection before taking the request");
}

static void pg_on_connect(h2o_socket_t *sock, const char *err)
{
    sp_proxy_get_t *g = sock->data;
    if (g == NULL)
        return;
    if (err != NULL) {
        char why[160];
        snprintf(why, sizeof(why), "is unreachable (%s)", err);
        pg_fail_later(g, why);
        return;
    }
    h2o_iovec_t buf = h2o_iovec_init(g->head.p, g->head.len);
    h2o_socket_write(sock, &buf, 1, pg_on_written);
    h2o_socket_read_start(sock, pg_on_read);
}

static void pg_connect(sp_proxy_get_t *g, struct sockaddr *sa, socklen_t len)
{
    g->up = h2o_socket_connect(g->p->hloop, sa, len, pg_on_connect);
    if (g->up == NULL) {
        pg_fail_later(g, "is unreachable (connect failed)");
        return;
    }
    g->up->data = g;
}

static void pg_resolved(void *owner, int rc, const char *host, struct sockaddr *sa, socklen_t len)
{
    sp_proxy_get_t *g = owner;
    g->rs = NULL;
    if (rc != 0) {
        char why[sizeof(g->why)];
        snprintf(why, sizeof(why), "is unreachable (cannot resolve %s: %s)", host,
                 gai_strerror(rc));
        pg_fail_later(g, why);
        return;
    }
    pg_connect(g, sa, len);
}

sp_proxy_get_t *sp_proxy_get(sp_proxy_t *p, h2o_req_t *req, const char *upstream, const char *path,
                             uint32_t timeout_ms, sp_proxy_got_cb cb, void *arg, sp_err_t *err)
{
    if (!sp_proxy_has_key(p)) {
        sp_err_set(err, SP_EUNAVAIL, "this node has no cluster key (--cluster-key-file)");
        return NULL;
    }
    sp_proxy_get_t *g = calloc(1, sizeof(*g));
    if (g == NULL) {
        sp_err_set(err, SP_EINTERNAL, "out of memory");
        return NULL;
    }
    g->p = p;
    g->cb = cb;
    g->arg = arg;
    snprintf(g->upstream, sizeof(g->upstream), "%s", upstream);
    sp_timer_init(&g->timer, p->loop, pg_on_timer, g);
    if (write_head(p, &g->head, req, h2o_iovec_init(H2O_STRLIT("GET")),
                   h2o_iovec_init(path, strlen(path)), NULL, false) < 0) {
        sp_buf_free(&g->head);
        free(g);
        sp_err_set(err, SP_EINVAL, "this request cannot be sent to another node");
        return NULL;
    }
    g->next = p->gets;
    if (p->gets != NULL)
        p->gets->prev = g;
    p->gets = g;
    sp_timer_start(&g->timer, timeout_ms); /* the whole exchange, name and connect included */
    char host[256];
    long port;
    struct sockaddr_storage sa;
    socklen_t len = 0;
    int k = parse_upstream(upstream, host, &port, &sa, &len);
    if (k < 0) {
        pg_fail_later(g, "has a bad address");
    } else if (k == 1) {
        pg_connect(g, (struct sockaddr *)&sa, len);
    } else {
        g->rs = resolve_start(p, host, port, pg_resolved, g);
        if (g->rs == NULL)
            pg_fail_later(g, "cannot be resolved (out of memory or no worker thread)");
    }
    return g;
}

void sp_proxy_get_cancel(sp_proxy_get_t *g)
{
    if (g == NULL)
        return;
    pg_close(g);
    free(g);
}
