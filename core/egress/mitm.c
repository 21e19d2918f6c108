/*
 * mitm.c - credential injection: sandbox CAs, leaf certificates, the TLS-terminating
 * HTTP/1.1 relay, and plain request-head rewriting.
 *
 * Owns the sandbox handles (rules with their decrypted secrets, the CA and the leaf cache)
 * and the conns opened on them. Every conn is driven by one pump that runs from the loop
 * (a zero-delay timer or the upstream socket's watch), never inside a call from the proxy,
 * so the proxy's callbacks never re-enter it. Buffers are bounded: the guest's input is
 * acknowledged (consumed) only while what is waiting stays under GUEST_IN_MAX, upstream
 * output is read only while the guest's side holds less than GUEST_OUT_MAX, and guest
 * requests are parsed only while less than UP_OUT_MAX waits for the upstream socket.
 * Responses are relayed as they come, unparsed. Knows no HTTP server and no proxy protocol:
 * core/egress/egress.c answers CONNECT and connects the upstream socket.
 */
#include "core/egress/mitm.h"

#include <arpa/inet.h>
#include <errno.h>
#include <openssl/bio.h>
#include <openssl/err.h>
#include <openssl/evp.h>
#include <openssl/pem.h>
#include <openssl/rand.h>
#include <openssl/ssl.h>
#include <openssl/x509.h>
#include <openssl/x509v3.h>
#include <sodium.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/socket.h>
#include <unistd.h>

#include "core/channel/exec.h"
#include "base/log.h"

#define GUEST_IN_MAX  (128u * 1024) /* guest bytes held before more are acknowledged */
#define GUEST_OUT_MAX (256u * 1024) /* bytes for the guest held before upstream reads stop */
#define UP_OUT_MAX    (256u * 1024) /* request bytes waiting for the upstream socket */
#define HEAD_MAX      (64u * 1024)  /* a request head; longer gets 431 */
#define LEAF_DAYS     30            /* leaf certificate validity */
#define CA_YEARS      10
#define LINGER_MS     10000 /* after the guest closed: wait this long for upstream */
#define INSTALL_MS    30000

static const char *const guest_env[] = {
    "SSL_CERT_FILE=" SP_MITM_GUEST_BUNDLE_PATH,
    "REQUESTS_CA_BUNDLE=" SP_MITM_GUEST_BUNDLE_PATH,
    "CURL_CA_BUNDLE=" SP_MITM_GUEST_BUNDLE_PATH,
    "NODE_EXTRA_CA_CERTS=" SP_MITM_GUEST_BUNDLE_PATH,
};

const char *const *sp_mitm_guest_env(size_t *n)
{
    *n = sizeof(guest_env) / sizeof(guest_env[0]);
    return guest_env;
}

/* ---- byte buffers (zeroed as they are consumed: request bytes may hold a secret) ---- */

struct buf {
    uint8_t *p;
    size_t off, len, cap;
};

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

/* ---- structures ---- */

struct rule {
    char host[256]; /* lowercase; "*.suffix" covers subdomains */
    char header[65];
    char secret[SP_SECRETS_NAME_MAX + 1];
    char *format;
    char env[SP_SECRETS_ENV_MAX + 1]; /* "": no placeholder in the guest */
    uint8_t *value; /* NULL: the secret is missing or does not open */
    size_t value_len;
};

struct leaf {
    char host[256];
    SSL_CTX *ctx;
    time_t not_after;
};

struct sp_mitm {
    sp_loop_t *loop;
    sp_store_t *store;
    sp_secrets_t *secrets;
    SSL_CTX *up_ctx;
    sp_mitm_sb_t *sbs;
};

struct sp_mitm_sb {
    sp_mitm_t *m;
    char id[65];
    char team_id[SP_ID_LEN + 1];
    sp_agentconn_t *conn;
    struct rule *rules;
    size_t nrules;
    EVP_PKEY *ca_key;
    X509 *ca_cert;
    char *ca_pem;
    EVP_PKEY *leaf_key; /* one key for every leaf of this sandbox */
    struct leaf *leaves;
    size_t nleaves;
    bool installed; /* the CA is in this VM's trust store */
    sp_exec_t *install;
    bool install_waiting; /* for the channel to come up */
    sp_mitm_sb_cb open_cb;
    void *open_arg;
    bool opened; /* open_cb has been called */
    bool closed;
    int queries;  /* statements in flight (the handle is freed when they return) */
    bool loading; /* a load (rules, CA) runs */
    bool reload;  /* a change arrived while it did */
    sp_mitm_sb_env_cb env_cb;
    void *env_arg;
    sp_mitm_conn_t *conns;
    sp_mitm_sb_t *prev, *next;
};

enum rq_state {
    RQ_HEAD = 0,
    RQ_BODY,
    RQ_CHUNK_SIZE,
    RQ_CHUNK_DATA,
    RQ_CHUNK_CRLF,
    RQ_TRAILER,
    RQ_RAW,  /* after an Upgrade or CONNECT: bytes pass as they are */
    RQ_DEAD, /* an error answer was sent: the guest's bytes are dropped */
};

struct sp_mitm_conn {
    sp_mitm_sb_t *sb; /* NULL once the handle closed */
    sp_loop_t *loop;
    char host[256];
    uint16_t port;
    bool tls;
    sp_mitm_conn_cbs_t cbs;
    void *arg;
    sp_timer_t timer;
    int busy;  /* pump depth */
    bool dead; /* destroyed: freed when the pump unwinds */

    /* guest side */
    SSL *gssl;
    BIO *grbio, *gwbio;
    struct buf gin;  /* guest plaintext not yet parsed */
    struct buf gout; /* bytes waiting for to_guest */
    size_t owed;     /* guest bytes received, not yet reported consumed */
    bool guest_eof;  /* no more guest bytes */
    bool guest_blocked;
    bool ghs_done;
    bool gshut; /* close_notify queued for the guest */

    /* upstream side */
    int fd;
    sp_watch_t *watch;
    SSL *ussl;
    bool connected, uhs_done;
    bool uwant_write;   /* the last upstream operation needs the socket writable */
    bool up_eof;        /* upstream sent everything */
    bool up_shut;       /* we closed our sending side */
    bool relayed;       /* a response byte reached the guest */
    struct buf uout;    /* request bytes for the upstream */
    char up_error[160]; /* why the upstream failed ("" = it did not) */

    /* request parser */
    enum rq_state rq;
    uint64_t remaining;
    bool req_seen; /* a request head was parsed on this conn */

    /* end */
    bool failed;
    sp_err_t err;
    bool ended;
    sp_timer_t linger;

    sp_mitm_conn_t *prev, *next;
};

static void conn_free(sp_mitm_conn_t *c);
static void conn_schedule(sp_mitm_conn_t *c);

/* ---- hosts and rules ---- */

/* Lowercases host into out, without brackets or a trailing dot. */
static bool norm_host(const char *host, char *out, size_t cap)
{
    size_t n = host ? strlen(host) : 0;
    if (n >= 2 && host[0] == '[' && host[n - 1] == ']') {
        host++;
        n -= 2;
    }
    if (n > 0 && host[n - 1] == '.')
        n--;
    if (n == 0 || n >= cap)
        return false;
    for (size_t i = 0; i < n; i++) {
        char ch = host[i];
        if ((unsigned char)ch <= 0x20 || ch == '/' || ch == '\\' || ch == '@')
            return false;
        out[i] = (ch >= 'A' && ch <= 'Z') ? (char)(ch - 'A' + 'a') : ch;
    }
    out[n] = '\0';
    return true;
}

/* 2 exact match, 1 wildcard match, 0 none. */
static int rule_match(const struct rule *r, const char *host)
{
    if (strcmp(r->host, host) == 0)
        return 2;
    if (strncmp(r->host, "*.", 2) == 0) {
        size_t sl = strlen(r->host) - 1; /* ".suffix" */
        size_t hl = strlen(host);
        if (hl > sl && strcmp(host + hl - sl, r->host + 1) == 0)
            return 1;
    }
    return 0;
}

bool sp_mitm_wants(const sp_mitm_sb_t *sb, const char *host, uint16_t port)
{
    char h[256];
    if (sb == NULL || !norm_host(host, h, sizeof(h)))
        return false;
    for (size_t i = 0; i < sb->nrules; i++)
        if (rule_match(&sb->rules[i], h))
            return true;
    return false;
}

size_t sp_mitm_rule_count(const sp_mitm_sb_t *sb)
{
    return sb ? sb->nrules : 0;
}

/* The first rule from *i on that names an env no earlier rule names, or NULL. */
static const struct rule *next_env(const struct rule *rs, size_t n, size_t *i)
{
    for (; *i < n; (*i)++) {
        const struct rule *r = &rs[*i];
        bool seen = r->env[0] == '\0';
        for (size_t j = 0; j < *i && !seen; j++)
            seen = strcmp(rs[j].env, r->env) == 0;
        if (!seen)
            return &rs[(*i)++];
    }
    return NULL;
}

size_t sp_mitm_sb_placeholders(const sp_mitm_sb_t *sb, void (*put)(void *arg, const char *kv),
                               void *arg)
{
    size_t n = 0, i = 0;
    const struct rule *r;
    while (sb != NULL && (r = next_env(sb->rules, sb->nrules, &i)) != NULL) {
        n++;
        if (put != NULL) {
            char kv[SP_SECRETS_ENV_MAX + sizeof(SP_SECRETS_PLACEHOLDER) + SP_SECRETS_NAME_MAX + 2];
            snprintf(kv, sizeof(kv), "%s=" SP_SECRETS_PLACEHOLDER "%s", r->env, r->secret);
            put(arg, kv);
        }
    }
    return n;
}

void sp_mitm_sb_on_env(sp_mitm_sb_t *sb, sp_mitm_sb_env_cb cb, void *arg)
{
    sb->env_cb = cb;
    sb->env_arg = arg;
}

/* Whether two rule sets give the guest the same placeholders (same names, same secrets). */
static bool env_same(const struct rule *a, size_t na, const struct rule *b, size_t nb)
{
    size_t i = 0, j = 0;
    for (;;) {
        const struct rule *x = next_env(a, na, &i), *y = next_env(b, nb, &j);
        if (x == NULL || y == NULL)
            return x == y;
        if (strcmp(x->env, y->env) != 0 || strcmp(x->secret, y->secret) != 0)
            return false;
    }
}

const char *sp_mitm_sb_ca_pem(const sp_mitm_sb_t *sb)
{
    return sb ? sb->ca_pem : NULL;
}

bool sp_mitm_sb_ca_installed(const sp_mitm_sb_t *sb)
{
    return sb != NULL && sb->installed;
}

static void rules_free(struct rule *rules, size_t n)
{
    for (size_t i = 0; i < n; i++) {
        free(rules[i].format);
        sp_secrets_wipe(rules[i].value, rules[i].value_len);
    }
    free(rules);
}

/* The rules that apply to host, at most one per header: exact ones before wildcards. */
static size_t rules_for(const sp_mitm_sb_t *sb, const char *host, const struct rule **out,
                        size_t cap)
{
    size_t n = 0;
    for (int want = 2; want >= 1; want--) {
        for (size_t i = 0; i < sb->nrules && n < cap; i++) {
            if (rule_match(&sb->rules[i], host) != want)
                continue;
            bool dup = false;
            for (size_t j = 0; j < n && !dup; j++)
                dup = strcasecmp(out[j]->header, sb->rules[i].header) == 0;
            if (!dup)
                out[n++] = &sb->rules[i];
        }
    }
    return n;
}

/* ---- request heads ---- */

struct head_info {
    bool chunked;
    bool has_length;
    uint64_t length;
    bool upgrade; /* Upgrade header or CONNECT: raw bytes after the head */
    int status;   /* when the head is refused: the status for the guest */
};

static bool name_is(const char *p, size_t n, const char *name)
{
    return strlen(name) == n && strncasecmp(p, name, n) == 0;
}

/* Trims optional whitespace around a header value. */
static void trim(const char **p, size_t *n)
{
    while (*n > 0 && (**p == ' ' || **p == '\t')) {
        (*p)++;
        (*n)--;
    }
    while (*n > 0 && ((*p)[*n - 1] == ' ' || (*p)[*n - 1] == '\t'))
        (*n)--;
}

/*
 * Rewrites head[0..len) (ending with its blank line) into out: request line (reqline when
 * not NULL), the headers except those the rules set (and, with strip_proxy, the proxy's
 * own), then the rule headers with their secrets. Fills info with the framing. -1 with err
 * (info->status 400/501/502) and out left as it was on a refusal.
 */
static int rewrite_head(sp_mitm_sb_t *sb, const char *host, const char *head, size_t len,
                        const char *reqline, bool strip_proxy, struct buf *out,
                        struct head_info *info, sp_err_t *err)
{
    memset(info, 0, sizeof(*info));
    info->status = 400;
    const struct rule *rs[SP_SECRETS_RULES_MAX];
    size_t nr = sb != NULL ? rules_for(sb, host, rs, SP_SECRETS_RULES_MAX) : 0;
    for (size_t i = 0; i < nr; i++) {
        if (rs[i]->value == NULL) {
            info->status = 502;
            return sp_err_set(err, SP_EUNAVAIL,
                              "the credential rule for %.64s names secret '%s', which does not "
                              "exist or cannot be read",
                              host, rs[i]->secret);
        }
    }
    struct buf o = {0};
    const char *p = head, *end = head + len;
    bool first = true, te = false;
    int rc = -1;
    while (p < end) {
        const char *nl = memchr(p, '\n', (size_t)(end - p));
        if (nl == NULL) {
            sp_err_set(err, SP_EINVAL, "request head is not terminated");
            goto out;
        }
        size_t ll = (size_t)(nl - p);
        if (ll > 0 && p[ll - 1] == '\r')
            ll--;
        const char *line = p;
        p = nl + 1;
        if (first) {
            first = false;
            const char *sp1 = memchr(line, ' ', ll);
            const char *v = ll >= 8 ? line + ll - 8 : NULL;
            if (sp1 == NULL || v == NULL ||
                (memcmp(v, "HTTP/1.1", 8) != 0 && memcmp(v, "HTTP/1.0", 8) != 0)) {
                info->status = ll >= 8 && v != NULL && memcmp(v, "HTTP/", 5) == 0 ? 505 : 400;
                sp_err_set(err, SP_EINVAL, "request line is not HTTP/1.x");
                goto out;
            }
            if (name_is(line, (size_t)(sp1 - line), "CONNECT"))
                info->upgrade = true;
            if ((reqline ? buf_puts(&o, reqline) : buf_put(&o, line, ll)) < 0 ||
                buf_puts(&o, "\r\n") < 0)
                goto oom;
            continue;
        }
        if (ll == 0)
            break; /* the blank line */
        if (line[0] == ' ' || line[0] == '\t') {
            sp_err_set(err, SP_EINVAL, "folded header lines are not accepted");
            goto out;
        }
        const char *colon = memchr(line, ':', ll);
        if (colon == NULL || colon == line) {
            sp_err_set(err, SP_EINVAL, "malformed header line");
            goto out;
        }
        size_t nl2 = (size_t)(colon - line);
        for (size_t i = 0; i < nl2; i++) {
            char ch = line[i];
            if (ch == ' ' || ch == '\t' || (unsigned char)ch < 0x21 || ch == 0x7f) {
                sp_err_set(err, SP_EINVAL, "malformed header name");
                goto out;
            }
        }
        const char *val = colon + 1;
        size_t vl = ll - nl2 - 1;
        trim(&val, &vl);
        if (name_is(line, nl2, "Content-Length")) {
            uint64_t v = 0;
            if (vl == 0 || vl > 15) {
                sp_err_set(err, SP_EINVAL, "bad Content-Length");
                goto out;
            }
            for (size_t i = 0; i < vl; i++) {
                if (val[i] < '0' || val[i] > '9') {
                    sp_err_set(err, SP_EINVAL, "bad Content-Length");
                    goto out;
                }
                v = v * 10 + (uint64_t)(val[i] - '0');
            }
            if (info->has_length && info->length != v) {
                sp_err_set(err, SP_EINVAL, "conflicting Content-Length headers");
                goto out;
            }
            info->has_length = true;
            info->length = v;
        } else if (name_is(line, nl2, "Transfer-Encoding")) {
            /* Only "chunked" (last) is understood; anything else cannot be framed. */
            te = true;
            info->chunked = vl >= 7 && strncasecmp(val + vl - 7, "chunked", 7) == 0 &&
                            (vl == 7 || val[vl - 8] == ' ' || val[vl - 8] == ',');
            if (!info->chunked || vl != 7) {
                info->status = 501;
                sp_err_set(err, SP_EINVAL, "only Transfer-Encoding: chunked is supported");
                goto out;
            }
        } else if (name_is(line, nl2, "Upgrade")) {
            info->upgrade = true;
        }
        bool drop = false;
        for (size_t i = 0; i < nr && !drop; i++)
            drop = name_is(line, nl2, rs[i]->header);
        if (strip_proxy &&
            (name_is(line, nl2, "Proxy-Connection") || name_is(line, nl2, "Proxy-Authorization")))
            drop = true;
        if (!drop && (buf_put(&o, line, ll) < 0 || buf_puts(&o, "\r\n") < 0))
            goto oom;
    }
    if (first) {
        sp_err_set(err, SP_EINVAL, "empty request head");
        goto out;
    }
    if (te && info->has_length) {
        sp_err_set(err, SP_EINVAL, "both Content-Length and Transfer-Encoding");
        goto out;
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
    info->status = 500;
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
    if (!norm_host(host, h, sizeof(h)))
        return sp_err_set(err, SP_EINVAL, "bad destination host");
    if (!sp_mitm_wants(sb, h, 0))
        return 0;
    struct buf o = {0};
    struct head_info info;
    if (rewrite_head(sb, h, head, len, NULL, false, &o, &info, err) < 0)
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

/* ---- certificates ---- */

static void log_ssl(const char *what)
{
    unsigned long e = ERR_get_error();
    char buf[256] = "";
    if (e != 0)
        ERR_error_string_n(e, buf, sizeof(buf));
    ERR_clear_error();
    sp_log(SP_LOG_WARN, "mitm", "%s err=%s", what, buf);
}

static int add_ext(X509 *cert, X509 *issuer, int nid, const char *value)
{
    X509V3_CTX ctx;
    X509V3_set_ctx_nodb(&ctx);
    X509V3_set_ctx(&ctx, issuer, cert, NULL, NULL, 0);
    X509_EXTENSION *ext = X509V3_EXT_conf_nid(NULL, &ctx, nid, value);
    if (ext == NULL)
        return -1;
    int ok = X509_add_ext(cert, ext, -1);
    X509_EXTENSION_free(ext);
    return ok ? 0 : -1;
}

static int random_serial(X509 *cert)
{
    unsigned char b[16];
    randombytes_buf(b, sizeof(b));
    b[0] &= 0x7f; /* positive */
    b[0] |= 0x01; /* and never zero-led to a shorter length */
    BIGNUM *bn = BN_bin2bn(b, sizeof(b), NULL);
    int ok = bn != NULL && BN_to_ASN1_INTEGER(bn, X509_get_serialNumber(cert)) != NULL;
    BN_free(bn);
    return ok ? 0 : -1;
}

static EVP_PKEY *ec_key(void)
{
    return EVP_EC_gen("P-256");
}

/* A self-signed CA for sandbox id. */
static int make_ca(const char *id, EVP_PKEY **key_out, X509 **cert_out)
{
    EVP_PKEY *key = ec_key();
    X509 *cert = X509_new();
    char cn[128];
    snprintf(cn, sizeof(cn), "space egress CA %s", id);
    X509_NAME *name = cert ? X509_get_subject_name(cert) : NULL;
    if (key == NULL || cert == NULL || X509_set_version(cert, 2) != 1 || random_serial(cert) < 0 ||
        X509_NAME_add_entry_by_txt(name, "O", MBSTRING_ASC, (const unsigned char *)"space", -1, -1,
                                   0) != 1 ||
        X509_NAME_add_entry_by_txt(name, "CN", MBSTRING_ASC, (const unsigned char *)cn, -1, -1,
                                   0) != 1 ||
        X509_set_issuer_name(cert, name) != 1 ||
        X509_gmtime_adj(X509_getm_notBefore(cert), -3600) == NULL ||
        X509_gmtime_adj(X509_getm_notAfter(cert), (long)CA_YEARS * 365 * 86400) == NULL ||
        X509_set_pubkey(cert, key) != 1 ||
        add_ext(cert, cert, NID_basic_constraints, "critical,CA:TRUE,pathlen:0") < 0 ||
        add_ext(cert, cert, NID_key_usage, "critical,keyCertSign,cRLSign") < 0 ||
        add_ext(cert, cert, NID_subject_key_identifier, "hash") < 0 ||
        X509_sign(cert, key, EVP_sha256()) == 0) {
        log_ssl("creating a sandbox CA failed");
        EVP_PKEY_free(key);
        X509_free(cert);
        return -1;
    }
    *key_out = key;
    *cert_out = cert;
    return 0;
}

static bool is_ip_literal(const char *host)
{
    unsigned char b[16];
    return inet_pton(AF_INET, host, b) == 1 || inet_pton(AF_INET6, host, b) == 1;
}

/* A leaf for host signed by the sandbox CA, in a server SSL_CTX of its own. */
static SSL_CTX *make_leaf_ctx(sp_mitm_sb_t *sb, const char *host, time_t *not_after);

static SSL_CTX *leaf_ctx(sp_mitm_sb_t *sb, const char *host)
{
    time_t now = time(NULL);
    for (size_t i = 0; i < sb->nleaves; i++) {
        if (strcmp(sb->leaves[i].host, host) != 0)
            continue;
        if (sb->leaves[i].not_after - now > 86400)
            return sb->leaves[i].ctx;
        SSL_CTX_free(sb->leaves[i].ctx); /* about to expire: mint again */
        sb->leaves[i] = sb->leaves[--sb->nleaves];
        break;
    }
    if (sb->leaf_key == NULL && (sb->leaf_key = ec_key()) == NULL) {
        log_ssl("creating a leaf key failed");
        return NULL;
    }
    time_t na = 0;
    SSL_CTX *ctx = make_leaf_ctx(sb, host, &na);
    if (ctx == NULL)
        return NULL;
    struct leaf *l = realloc(sb->leaves, (sb->nleaves + 1) * sizeof(*l));
    if (l == NULL) {
        SSL_CTX_free(ctx);
        return NULL;
    }
    sb->leaves = l;
    snprintf(l[sb->nleaves].host, sizeof(l[sb->nleaves].host), "%s", host);
    l[sb->nleaves].ctx = ctx;
    l[sb->nleaves].not_after = na;
    sb->nleaves++;
    return ctx;
}

static int alpn_select(SSL *ssl, const unsigned char **out, unsigned char *outlen,
                       const unsigned char *in, unsigned int inlen, void *arg)
{
    /* HTTP/1.1 only: the relay parses HTTP/1.x requests. */
    for (unsigned int i = 0; i < inlen;) {
        unsigned int l = in[i];
        if (i + 1 + l > inlen)
            break;
        if (l == 8 && memcmp(in + i + 1, "http/1.1", 8) == 0) {
            *out = in + i + 1;
            *outlen = 8;
            return SSL_TLSEXT_ERR_OK;
        }
        i += 1 + l;
    }
    return SSL_TLSEXT_ERR_NOACK;
}

static int servername_cb(SSL *ssl, int *alert, void *arg)
{
    /* The guest must ask for the host it sent CONNECT for: the leaf is minted for that one
     * and the credential belongs to it. */
    sp_mitm_conn_t *c = SSL_get_app_data(ssl);
    const char *sni = SSL_get_servername(ssl, TLSEXT_NAMETYPE_host_name);
    if (c == NULL || sni == NULL)
        return SSL_TLSEXT_ERR_OK;
    char h[256];
    if (!norm_host(sni, h, sizeof(h)) || strcmp(h, c->host) != 0) {
        sp_err_set(&c->err, SP_EINVAL, "TLS server name does not match the CONNECT host %.64s",
                   c->host);
        c->failed = true;
        *alert = SSL_AD_UNRECOGNIZED_NAME;
        return SSL_TLSEXT_ERR_ALERT_FATAL;
    }
    return SSL_TLSEXT_ERR_OK;
}

static SSL_CTX *make_leaf_ctx(sp_mitm_sb_t *sb, const char *host, time_t *not_after)
{
    X509 *cert = X509_new();
    SSL_CTX *ctx = NULL;
    char san[300];
    snprintf(san, sizeof(san), "%s:%s", is_ip_literal(host) ? "IP" : "DNS", host);
    X509_NAME *name = cert ? X509_get_subject_name(cert) : NULL;
    /* The CN is informational (clients check the SAN) and limited to 64 bytes. */
    char cn[65];
    snprintf(cn, sizeof(cn), "%s", host);
    if (cert == NULL || X509_set_version(cert, 2) != 1 || random_serial(cert) < 0 ||
        X509_NAME_add_entry_by_txt(name, "CN", MBSTRING_ASC, (const unsigned char *)cn, -1, -1,
                                   0) != 1 ||
        X509_set_issuer_name(cert, X509_get_subject_name(sb->ca_cert)) != 1 ||
        X509_gmtime_adj(X509_getm_notBefore(cert), -3600) == NULL ||
        X509_gmtime_adj(X509_getm_notAfter(cert), (long)LEAF_DAYS * 86400) == NULL ||
        X509_set_pubkey(cert, sb->leaf_key) != 1 ||
        add_ext(cert, sb->ca_cert, NID_basic_constraints, "critical,CA:FALSE") < 0 ||
        add_ext(cert, sb->ca_cert, NID_key_usage, "critical,digitalSignature") < 0 ||
        add_ext(cert, sb->ca_cert, NID_ext_key_usage, "serverAuth") < 0 ||
        add_ext(cert, sb->ca_cert, NID_subject_alt_name, san) < 0 ||
        add_ext(cert, sb->ca_cert, NID_authority_key_identifier, "keyid:always") < 0 ||
        X509_sign(cert, sb->ca_key, EVP_sha256()) == 0) {
        log_ssl("minting a leaf certificate failed");
        X509_free(cert);
        return NULL;
    }
    *not_after = time(NULL) + (time_t)LEAF_DAYS * 86400;
    ctx = SSL_CTX_new(TLS_server_method());
    if (ctx == NULL || SSL_CTX_set_min_proto_version(ctx, TLS1_2_VERSION) != 1 ||
        SSL_CTX_use_certificate(ctx, cert) != 1 || SSL_CTX_use_PrivateKey(ctx, sb->leaf_key) != 1) {
        log_ssl("leaf TLS context failed");
        SSL_CTX_free(ctx);
        X509_free(cert);
        return NULL;
    }
    X509_free(cert);
    SSL_CTX_set_mode(ctx, SSL_MODE_ENABLE_PARTIAL_WRITE | SSL_MODE_ACCEPT_MOVING_WRITE_BUFFER);
    SSL_CTX_set_options(ctx, SSL_OP_IGNORE_UNEXPECTED_EOF | SSL_OP_NO_RENEGOTIATION);
    SSL_CTX_set_alpn_select_cb(ctx, alpn_select, NULL);
    SSL_CTX_set_tlsext_servername_callback(ctx, servername_cb);
    SSL_CTX_set_session_cache_mode(ctx, SSL_SESS_CACHE_OFF);
    SSL_CTX_set_num_tickets(ctx, 0);
    return ctx;
}

static char *pem_of_cert(X509 *cert)
{
    BIO *b = BIO_new(BIO_s_mem());
    char *out = NULL;
    if (b != NULL && PEM_write_bio_X509(b, cert) == 1) {
        char *p;
        long n = BIO_get_mem_data(b, &p);
        out = malloc((size_t)n + 1);
        if (out != NULL) {
            memcpy(out, p, (size_t)n);
            out[n] = '\0';
        }
    }
    BIO_free(b);
    return out;
}

/* The PEM of key, sealed for sandbox id. */
static char *seal_key(sp_mitm_sb_t *sb, EVP_PKEY *key, sp_err_t *err)
{
    BIO *b = BIO_new(BIO_s_mem());
    char *out = NULL;
    if (b == NULL || PEM_write_bio_PrivateKey(b, key, NULL, NULL, 0, NULL, NULL) != 1) {
        sp_err_set(err, SP_EINTERNAL, "cannot encode the CA key");
    } else {
        char *p;
        long n = BIO_get_mem_data(b, &p);
        char ctx[96];
        snprintf(ctx, sizeof(ctx), "ca:%s", sb->id);
        out = sp_secrets_seal(sb->m->secrets, ctx, p, (size_t)n, err);
        sodium_memzero(p, (size_t)n);
    }
    BIO_free(b);
    return out;
}

/* Loads the CA from its stored form. */
static int load_ca(sp_mitm_sb_t *sb, const char *cert_pem, const char *key_box, sp_err_t *err)
{
    char ctx[96];
    snprintf(ctx, sizeof(ctx), "ca:%s", sb->id);
    uint8_t *kp = NULL;
    size_t kl = 0;
    if (sp_secrets_open(sb->m->secrets, ctx, key_box, &kp, &kl, err) < 0)
        return -1;
    BIO *kb = BIO_new_mem_buf(kp, (int)kl);
    EVP_PKEY *key = kb ? PEM_read_bio_PrivateKey(kb, NULL, NULL, NULL) : NULL;
    BIO_free(kb);
    sp_secrets_wipe(kp, kl);
    BIO *cb = BIO_new_mem_buf(cert_pem, -1);
    X509 *cert = cb ? PEM_read_bio_X509(cb, NULL, NULL, NULL) : NULL;
    BIO_free(cb);
    if (key == NULL || cert == NULL || X509_check_private_key(cert, key) != 1) {
        log_ssl("stored sandbox CA does not load");
        EVP_PKEY_free(key);
        X509_free(cert);
        return sp_err_set(err, SP_EINTERNAL, "stored sandbox CA is unusable");
    }
    char *pem = pem_of_cert(cert);
    if (pem == NULL) {
        EVP_PKEY_free(key);
        X509_free(cert);
        return sp_err_set(err, SP_EINTERNAL, "out of memory");
    }
    EVP_PKEY_free(sb->ca_key);
    X509_free(sb->ca_cert);
    free(sb->ca_pem);
    sb->ca_key = key;
    sb->ca_cert = cert;
    sb->ca_pem = pem;
    return 0;
}

/* ---- the process-wide part ---- */

static void on_notify(void *arg, const char *channel, const char *payload);

sp_mitm_t *sp_mitm_create(sp_loop_t *loop, sp_store_t *store, sp_secrets_t *secrets,
                          const sp_mitm_opts_t *opts, sp_err_t *err)
{
    sp_mitm_t *m = calloc(1, sizeof(*m));
    if (m == NULL) {
        sp_err_set(err, SP_EINTERNAL, "out of memory");
        return NULL;
    }
    m->loop = loop;
    m->store = store;
    m->secrets = secrets;
    m->up_ctx = SSL_CTX_new(TLS_client_method());
    if (m->up_ctx == NULL || SSL_CTX_set_min_proto_version(m->up_ctx, TLS1_2_VERSION) != 1 ||
        SSL_CTX_set_default_verify_paths(m->up_ctx) != 1) {
        log_ssl("upstream TLS context failed");
        sp_err_set(err, SP_EINTERNAL, "cannot set up the upstream TLS context");
        goto fail;
    }
    if (opts != NULL && opts->test_upstream_ca_file != NULL &&
        SSL_CTX_load_verify_locations(m->up_ctx, opts->test_upstream_ca_file, NULL) != 1) {
        log_ssl("test upstream CA file does not load");
        sp_err_set(err, SP_EINVAL, "the test upstream CA file does not load");
        goto fail;
    }
    SSL_CTX_set_verify(m->up_ctx, SSL_VERIFY_PEER, NULL);
    SSL_CTX_set_mode(m->up_ctx,
                     SSL_MODE_ENABLE_PARTIAL_WRITE | SSL_MODE_ACCEPT_MOVING_WRITE_BUFFER);
    SSL_CTX_set_options(m->up_ctx, SSL_OP_IGNORE_UNEXPECTED_EOF);
    SSL_CTX_set_alpn_protos(m->up_ctx, (const unsigned char *)"\x08http/1.1", 9);
    if (store != NULL && sp_store_listen(store, SP_SECRETS_NOTIFY, on_notify, m, err) < 0)
        goto fail;
    if (opts != NULL && opts->test_upstream_ca_file != NULL)
        sp_log(SP_LOG_WARN, "mitm", "TEST ONLY: extra upstream CA trusted file=%s",
               opts->test_upstream_ca_file);
    return m;
fail:
    SSL_CTX_free(m->up_ctx);
    free(m);
    return NULL;
}

void sp_mitm_destroy(sp_mitm_t *m)
{
    if (m == NULL)
        return;
    /* Handles still open are a caller bug; close them so nothing dangles. */
    while (m->sbs != NULL)
        sp_mitm_sb_close(m->sbs);
    SSL_CTX_free(m->up_ctx);
    free(m);
}

/* ---- sandbox handles ---- */

static void sb_load(sp_mitm_sb_t *sb);

static void sb_free(sp_mitm_sb_t *sb)
{
    rules_free(sb->rules, sb->nrules);
    for (size_t i = 0; i < sb->nleaves; i++)
        SSL_CTX_free(sb->leaves[i].ctx);
    free(sb->leaves);
    EVP_PKEY_free(sb->leaf_key);
    EVP_PKEY_free(sb->ca_key);
    X509_free(sb->ca_cert);
    free(sb->ca_pem);
    free(sb);
}

/* A statement of this handle finished: false when the handle was closed meanwhile (then it
 * is freed here and the caller must not touch it). */
static bool sb_query_back(sp_mitm_sb_t *sb)
{
    sb->queries--;
    if (!sb->closed)
        return true;
    if (sb->queries == 0)
        sb_free(sb);
    return false;
}

static void sb_loaded(sp_mitm_sb_t *sb, const sp_err_t *err)
{
    sb->loading = false;
    if (!sb->opened) {
        sb->opened = true;
        if (err != NULL) {
            /* The handle never reached the caller: it ends here. */
            sp_mitm_sb_cb cb = sb->open_cb;
            void *arg = sb->open_arg;
            sp_mitm_sb_close(sb);
            cb(arg, NULL, err);
            return;
        }
        sb->open_cb(sb->open_arg, sb, NULL);
        return;
    }
    if (err != NULL)
        sp_log(SP_LOG_WARN, "mitm", "reloading credentials failed sandbox=%s err=%s", sb->id,
               err->msg);
    if (sb->reload && !sb->closed) {
        sb->reload = false;
        sb_load(sb);
    }
}

static void on_installed(void *arg, const sp_exec_result_t *res, const sp_err_t *err)
{
    sp_mitm_sb_t *sb = arg;
    sb->install = NULL;
    if (err != NULL)
        sp_log(SP_LOG_WARN, "mitm",
               "installing the egress CA in the guest failed sandbox=%s "
               "err=%s",
               sb->id, err->msg);
    else if (!res->exited || res->exit_code != 0)
        sp_log(SP_LOG_WARN, "mitm",
               "installing the egress CA in the guest failed sandbox=%s "
               "exit=%d stderr=%.200s",
               sb->id, res->exit_code, res->err ? (const char *)res->err : "");
    else {
        sb->installed = true;
        sp_log(SP_LOG_INFO, "mitm", "egress CA installed sandbox=%s", sb->id);
    }
    sb_loaded(sb, NULL);
}

/* Writes the CA into the guest's trust store: its own file, and the bundle once. */
static const char install_script[] =
    "set -e; ca=" SP_MITM_GUEST_CA_PATH "; bundle=" SP_MITM_GUEST_BUNDLE_PATH ";"
    " mkdir -p \"$(dirname \"$ca\")\" \"$(dirname \"$bundle\")\";"
    " cat > \"$ca.tmp\"; chmod 644 \"$ca.tmp\"; mv \"$ca.tmp\" \"$ca\";"
    " line=$(sed -n 2p \"$ca\");"
    " if ! grep -qF -- \"$line\" \"$bundle\" 2>/dev/null; then"
    "   { echo; cat \"$ca\"; } >> \"$bundle\"; chmod 644 \"$bundle\"; fi";

static void sb_install_now(sp_mitm_sb_t *sb)
{
    sp_exec_cmd_t cmd = {.cmd = install_script,
                         .stdin_pipe = true,
                         .stdin_data = sb->ca_pem,
                         .stdin_len = strlen(sb->ca_pem),
                         .stdin_eof = true,
                         .timeout_ms = INSTALL_MS};
    sp_err_t e;
    sb->install = sp_exec_run(sb->m->loop, sb->conn, &cmd, 4096, on_installed, sb, &e);
    if (sb->install == NULL) {
        sp_log(SP_LOG_WARN, "mitm",
               "installing the egress CA in the guest failed sandbox=%s "
               "err=%s",
               sb->id, e.msg);
        sb_loaded(sb, NULL);
    }
}

static void on_channel_up(void *arg, const sp_err_t *err)
{
    sp_mitm_sb_t *sb = arg;
    if (!sb_query_back(sb))
        return;
    sb->install_waiting = false;
    if (err != NULL) {
        sp_log(SP_LOG_WARN, "mitm",
               "installing the egress CA in the guest failed sandbox=%s "
               "err=%s",
               sb->id, err->msg);
        sb_loaded(sb, NULL);
        return;
    }
    sb_install_now(sb);
}

/* Waits for the channel (the handle may be opened before the agent's HELLO), then
 * installs. The wait counts like a statement: the handle outlives it. */
static void sb_install(sp_mitm_sb_t *sb)
{
    sb->install_waiting = true;
    if (sp_agentconn_when_up(sb->conn, INSTALL_MS, on_channel_up, sb) < 0) {
        sb->install_waiting = false;
        sp_log(SP_LOG_WARN, "mitm",
               "installing the egress CA in the guest failed sandbox=%s "
               "err=channel unavailable",
               sb->id);
        sb_loaded(sb, NULL);
        return;
    }
    sb->queries++;
}

/* The CA is there: install it when this VM does not have it yet. */
static void sb_have_ca(sp_mitm_sb_t *sb)
{
    if (!sb->installed && sb->conn != NULL && sb->install == NULL && !sb->install_waiting)
        sb_install(sb);
    else
        sb_loaded(sb, NULL);
}

static void on_ca_stored(void *arg, PGresult *res, const sp_err_t *err);

static void on_ca_read(void *arg, PGresult *res, const sp_err_t *err)
{
    sp_mitm_sb_t *sb = arg;
    if (!sb_query_back(sb))
        return;
    sp_err_t e;
    if (err != NULL) {
        sb_loaded(sb, err);
        return;
    }
    if (PQntuples(res) != 1) {
        sb_loaded(sb, (sp_err_set(&e, SP_EINTERNAL, "sandbox CA vanished"), &e));
        return;
    }
    if (load_ca(sb, PQgetvalue(res, 0, 0), PQgetvalue(res, 0, 1), &e) < 0) {
        sb_loaded(sb, &e);
        return;
    }
    sb_have_ca(sb);
}

static void on_ca_stored(void *arg, PGresult *res, const sp_err_t *err)
{
    sp_mitm_sb_t *sb = arg;
    if (!sb_query_back(sb))
        return;
    if (err != NULL) {
        sb_loaded(sb, err);
        return;
    }
    /* Read back whichever CA won (another worker may have stored one at the same time). */
    const char *p[] = {sb->id};
    sp_err_t e;
    if (sp_store_query(sb->m->store,
                       "SELECT cert_pem, key_box FROM sandbox_cas WHERE sandbox_id = $1", 1, p,
                       on_ca_read, sb, &e) < 0) {
        sb_loaded(sb, &e);
        return;
    }
    sb->queries++;
}

/* Creates the CA and stores it (first use of a sandbox with a rule). */
static void sb_create_ca(sp_mitm_sb_t *sb)
{
    sp_err_t e;
    EVP_PKEY *key = NULL;
    X509 *cert = NULL;
    if (make_ca(sb->id, &key, &cert) < 0) {
        sb_loaded(sb, (sp_err_set(&e, SP_EINTERNAL, "cannot create the sandbox CA"), &e));
        return;
    }
    char *pem = pem_of_cert(cert);
    char *box = pem ? seal_key(sb, key, &e) : NULL;
    EVP_PKEY_free(key);
    X509_free(cert);
    if (box == NULL) {
        free(pem);
        if (pem == NULL)
            sp_err_set(&e, SP_EINTERNAL, "out of memory");
        sb_loaded(sb, &e);
        return;
    }
    const char *p[] = {sb->id, pem, box};
    int rc = sp_store_query(sb->m->store,
                            "INSERT INTO sandbox_cas (sandbox_id, cert_pem, key_box)"
                            " VALUES ($1, $2, $3) ON CONFLICT (sandbox_id) DO NOTHING",
                            3, p, on_ca_stored, sb, &e);
    free(pem);
    free(box);
    if (rc < 0) {
        sb_loaded(sb, &e);
        return;
    }
    sb->queries++;
}

/* Columns: credentials, team_id, {name: box} of the named secrets, CA cert, CA key box. */
static void on_rules(void *arg, PGresult *res, const sp_err_t *err)
{
    sp_mitm_sb_t *sb = arg;
    if (!sb_query_back(sb))
        return;
    sp_err_t e;
    if (err != NULL) {
        sb_loaded(sb, err);
        return;
    }
    if (PQntuples(res) != 1) {
        sb_loaded(sb, (sp_err_set(&e, SP_ENOTFOUND, "sandbox not found"), &e));
        return;
    }
    snprintf(sb->team_id, sizeof(sb->team_id), "%s", PQgetvalue(res, 0, 1));
    json_t *rules = json_loads(PQgetvalue(res, 0, 0), 0, NULL);
    json_t *boxes = json_loads(PQgetvalue(res, 0, 2), 0, NULL);
    size_t n = json_is_array(rules) ? json_array_size(rules) : 0;
    struct rule *rs = calloc(n + 1, sizeof(*rs));
    if (rs == NULL || !json_is_array(rules) || !json_is_object(boxes)) {
        json_decref(rules);
        json_decref(boxes);
        free(rs);
        sb_loaded(sb, (sp_err_set(&e, SP_EINTERNAL, "stored credentials are malformed"), &e));
        return;
    }
    size_t k = 0;
    for (size_t i = 0; i < n && k < SP_SECRETS_RULES_MAX; i++) {
        json_t *r = json_array_get(rules, i);
        const char *host = json_string_value(json_object_get(r, "host"));
        const char *header = json_string_value(json_object_get(r, "header"));
        const char *secret = json_string_value(json_object_get(r, "secret"));
        const char *format = json_string_value(json_object_get(r, "format"));
        const char *env = json_string_value(json_object_get(r, "env"));
        if (host == NULL || header == NULL || secret == NULL || format == NULL ||
            strstr(format, "{secret}") == NULL)
            continue; /* written through sp_secrets_rules_normalize: cannot happen */
        struct rule *x = &rs[k];
        if (env != NULL && strlen(env) <= SP_SECRETS_ENV_MAX)
            snprintf(x->env, sizeof(x->env), "%s", env);
        snprintf(x->host, sizeof(x->host), "%s", host);
        snprintf(x->header, sizeof(x->header), "%s", header);
        snprintf(x->secret, sizeof(x->secret), "%s", secret);
        x->format = strdup(format);
        if (x->format == NULL)
            continue;
        const char *box = json_string_value(json_object_get(boxes, secret));
        if (box != NULL) {
            char ctx[128];
            snprintf(ctx, sizeof(ctx), "secret:%s:%s", sb->team_id, secret);
            if (sp_secrets_open(sb->m->secrets, ctx, box, &x->value, &x->value_len, &e) < 0)
                sp_log(SP_LOG_WARN, "mitm", "secret does not open sandbox=%s secret=%s err=%s",
                       sb->id, secret, e.msg);
            else if (sp_secrets_check_value((const char *)x->value, x->value_len, &e) < 0) {
                sp_secrets_wipe(x->value, x->value_len);
                x->value = NULL;
                x->value_len = 0;
            }
        }
        k++;
    }
    json_decref(rules);
    json_decref(boxes);
    bool env_changed = !env_same(sb->rules, sb->nrules, rs, k);
    rules_free(sb->rules, sb->nrules);
    sb->rules = rs;
    sb->nrules = k;
    sp_log(SP_LOG_DEBUG, "mitm", "credentials loaded sandbox=%s rules=%zu", sb->id, k);
    if (env_changed && sb->opened && sb->env_cb != NULL)
        sb->env_cb(sb->env_arg, sb);
    if (k == 0) {
        sb_loaded(sb, NULL); /* no rule, no CA needed (yet) */
        return;
    }
    if (sb->ca_cert != NULL) {
        sb_have_ca(sb);
        return;
    }
    if (!PQgetisnull(res, 0, 3)) {
        if (load_ca(sb, PQgetvalue(res, 0, 3), PQgetvalue(res, 0, 4), &e) < 0) {
            sb_loaded(sb, &e);
            return;
        }
        sb_have_ca(sb);
        return;
    }
    sb_create_ca(sb);
}

static void sb_load(sp_mitm_sb_t *sb)
{
    if (sb->loading) {
        sb->reload = true;
        return;
    }
    sb->loading = true;
    const char *p[] = {sb->id};
    sp_err_t e;
    if (sp_store_query(
            sb->m->store,
            "SELECT s.credentials::text, s.team_id,"
            " coalesce((SELECT json_object_agg(x.name, x.box) FROM secrets x"
            "  WHERE x.team_id = s.team_id AND x.name IN"
            "   (SELECT r->>'secret' FROM jsonb_array_elements(s.credentials) r)), '{}')::text,"
            " c.cert_pem, c.key_box"
            " FROM sandboxes s LEFT JOIN sandbox_cas c ON c.sandbox_id = s.id WHERE s.id = $1",
            1, p, on_rules, sb, &e) < 0) {
        sb->loading = false;
        if (sb->opened)
            sp_log(SP_LOG_WARN, "mitm", "reloading credentials failed sandbox=%s err=%s", sb->id,
                   e.msg);
        return;
    }
    sb->queries++;
}

static void open_fire(void *arg)
{
    sp_mitm_sb_t *sb = arg;
    sb->queries--;
    if (sb->closed) {
        if (sb->queries == 0)
            sb_free(sb);
        return;
    }
    sb_load(sb);
    if (!sb->loading) {
        sp_err_t e;
        sp_err_set(&e, SP_EUNAVAIL, "database unavailable");
        sb_loaded(sb, &e);
    }
}

int sp_mitm_sb_open(sp_mitm_t *m, const char *sandbox_id, sp_agentconn_t *conn, sp_mitm_sb_cb cb,
                    void *arg, sp_err_t *err)
{
    if (!sp_ids_valid(sandbox_id))
        return sp_err_set(err, SP_ENOTFOUND, "sandbox not found");
    if (sp_secrets_check_enabled(m->secrets, err) < 0)
        return -1;
    sp_mitm_sb_t *sb = calloc(1, sizeof(*sb));
    if (sb == NULL)
        return sp_err_set(err, SP_EINTERNAL, "out of memory");
    sb->m = m;
    snprintf(sb->id, sizeof(sb->id), "%s", sandbox_id);
    sb->conn = conn;
    sb->open_cb = cb;
    sb->open_arg = arg;
    /* Deferred so the callback never runs inside this call, even when the query is refused. */
    if (sp_loop_defer(m->loop, open_fire, sb) < 0) {
        free(sb);
        return sp_err_set(err, SP_EINTERNAL, "out of memory");
    }
    sb->queries++;
    sb->next = m->sbs;
    if (m->sbs != NULL)
        m->sbs->prev = sb;
    m->sbs = sb;
    return 0;
}

void sp_mitm_sb_close(sp_mitm_sb_t *sb)
{
    if (sb == NULL || sb->closed)
        return;
    sb->closed = true;
    if (sb->prev != NULL)
        sb->prev->next = sb->next;
    else
        sb->m->sbs = sb->next;
    if (sb->next != NULL)
        sb->next->prev = sb->prev;
    sb->prev = sb->next = NULL;
    while (sb->conns != NULL) {
        sp_mitm_conn_t *c = sb->conns;
        sb->conns = c->next;
        c->sb = NULL; /* unlinked: it never looks at the handle again */
        c->prev = c->next = NULL;
        sp_mitm_conn_destroy(c);
    }
    if (sb->install != NULL) {
        sp_exec_cancel(sb->install);
        sb->install = NULL;
    }
    /* Secrets go now even if a statement still holds the handle. */
    rules_free(sb->rules, sb->nrules);
    sb->rules = NULL;
    sb->nrules = 0;
    if (sb->queries == 0)
        sb_free(sb);
}

static void on_notify(void *arg, const char *channel, const char *payload)
{
    sp_mitm_t *m = arg;
    for (sp_mitm_sb_t *sb = m->sbs; sb != NULL; sb = sb->next) {
        if (sb->closed)
            continue;
        bool hit = payload == NULL || strcmp(payload, sb->id) == 0 ||
                   (strncmp(payload, "team:", 5) == 0 && strcmp(payload + 5, sb->team_id) == 0);
        if (hit)
            sb_load(sb);
    }
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

/* Plain mode: an absolute-form target for our host becomes origin form. 0 keep, 1 rewrote
 * into reqline, -1 another destination. */
static int origin_form(sp_mitm_conn_t *c, const char *line, size_t ll, char *reqline, size_t cap)
{
    const char *sp1 = memchr(line, ' ', ll);
    if (sp1 == NULL)
        return 0;
    const char *t = sp1 + 1;
    const char *sp2 = memchr(t, ' ', (size_t)(line + ll - t));
    if (sp2 == NULL || (size_t)(sp2 - t) < 7 || strncasecmp(t, "http://", 7) != 0)
        return 0;
    const char *auth = t + 7;
    const char *pe = auth;
    while (pe < sp2 && *pe != '/' && *pe != '?')
        pe++;
    char hp[300];
    size_t al = (size_t)(pe - auth);
    if (al == 0 || al >= sizeof(hp))
        return -1;
    memcpy(hp, auth, al);
    hp[al] = '\0';
    if (strchr(hp, '@') != NULL)
        return -1;
    unsigned port = 80;
    char *colon = strrchr(hp, ':');
    if (colon != NULL && strchr(colon, ']') == NULL) {
        *colon = '\0';
        port = (unsigned)atoi(colon + 1);
    }
    char h[256];
    if (!norm_host(hp, h, sizeof(h)) || strcmp(h, c->host) != 0 || port != c->port)
        return -1;
    int n = snprintf(reqline, cap, "%.*s %s%.*s", (int)(sp1 - line), line,
                     pe < sp2 && *pe == '/' ? "" : "/", (int)(line + ll - pe), pe);
    return n > 0 && (size_t)n < cap ? 1 : -1;
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
            /* Blank lines between requests are ignored (RFC 9112 2.2). */
            if (p[0] == '\r' || p[0] == '\n') {
                size_t k = p[0] == '\r' ? (n >= 2 && p[1] == '\n' ? 2 : (n >= 2 ? 1 : 0)) : 1;
                if (k == 0)
                    return progress;
                buf_drop(&c->gin, k);
                progress = true;
                continue;
            }
            size_t hl = 0;
            for (size_t i = 0; i + 1 < n && hl == 0; i++) {
                if (p[i] == '\n' && p[i + 1] == '\n')
                    hl = i + 2;
                else if (p[i] == '\n' && p[i + 1] == '\r' && i + 2 < n && p[i + 2] == '\n')
                    hl = i + 3;
            }
            if (hl == 0) {
                if (n > HEAD_MAX)
                    answer_error(c, 431, "request head is larger than 64 KiB");
                return progress;
            }
            if (hl > HEAD_MAX) {
                answer_error(c, 431, "request head is larger than 64 KiB");
                return true;
            }
            c->req_seen = true;
            if (c->up_error[0] != '\0') {
                answer_error(c, 502, c->up_error);
                return true;
            }
            char reqline[8192];
            const char *rl = NULL;
            if (!c->tls) {
                const uint8_t *le = memchr(p, '\n', hl);
                size_t ll = (size_t)(le - p);
                if (ll > 0 && p[ll - 1] == '\r')
                    ll--;
                int o = origin_form(c, (const char *)p, ll, reqline, sizeof(reqline));
                if (o < 0) {
                    char msg[200];
                    snprintf(msg, sizeof(msg),
                             "this proxy connection carries credentials for %.64s only; "
                             "open a new one for another destination",
                             c->host);
                    answer_error(c, 421, msg);
                    return true;
                }
                if (o == 1)
                    rl = reqline;
            }
            struct head_info info;
            sp_err_t e;
            if (rewrite_head(c->sb, c->host, (const char *)p, hl, rl, !c->tls, &c->uout, &info,
                             &e) < 0) {
                answer_error(c, info.status, e.msg);
                return true;
            }
            buf_drop(&c->gin, hl);
            if (info.upgrade)
                c->rq = RQ_RAW;
            else if (info.chunked)
                c->rq = RQ_CHUNK_SIZE;
            else if (info.has_length && info.length > 0) {
                c->rq = RQ_BODY;
                c->remaining = info.length;
            }
            progress = true;
            continue;
        }
        case RQ_BODY:
        case RQ_CHUNK_DATA: {
            size_t k = n < c->remaining ? n : (size_t)c->remaining;
            if (buf_put(&c->uout, p, k) < 0) {
                conn_fail(c, SP_EINTERNAL, "out of memory");
                return true;
            }
            buf_drop(&c->gin, k);
            c->remaining -= k;
            if (c->remaining == 0)
                c->rq = c->rq == RQ_BODY ? RQ_HEAD : RQ_CHUNK_CRLF;
            progress = true;
            continue;
        }
        case RQ_CHUNK_SIZE:
        case RQ_CHUNK_CRLF:
        case RQ_TRAILER: {
            uint8_t *nl = memchr(p, '\n', n < 4096 ? n : 4096);
            if (nl == NULL) {
                if (n >= 4096)
                    answer_error(c, 400, "chunked body line is too long");
                return progress;
            }
            size_t ll = (size_t)(nl - p) + 1;
            size_t tl = ll - 1 - (ll >= 2 && p[ll - 2] == '\r' ? 1 : 0); /* text length */
            if (c->rq == RQ_CHUNK_CRLF) {
                if (tl != 0) {
                    answer_error(c, 400, "chunk data is longer than its size");
                    return true;
                }
                c->rq = RQ_CHUNK_SIZE;
            } else if (c->rq == RQ_CHUNK_SIZE) {
                uint64_t size = 0;
                size_t digits = 0;
                for (size_t i = 0; i < tl && p[i] != ';' && p[i] != ' ' && p[i] != '\t'; i++) {
                    int d = (p[i] >= '0' && p[i] <= '9')   ? p[i] - '0'
                            : (p[i] >= 'a' && p[i] <= 'f') ? p[i] - 'a' + 10
                            : (p[i] >= 'A' && p[i] <= 'F') ? p[i] - 'A' + 10
                                                           : -1;
                    if (d < 0 || digits >= 15) {
                        answer_error(c, 400, "bad chunk size");
                        return true;
                    }
                    size = size * 16 + (uint64_t)d;
                    digits++;
                }
                if (digits == 0) {
                    answer_error(c, 400, "bad chunk size");
                    return true;
                }
                c->remaining = size;
                c->rq = size == 0 ? RQ_TRAILER : RQ_CHUNK_DATA;
            } else if (tl == 0) {
                c->rq = RQ_HEAD; /* the blank line after the trailers */
            }
            if (buf_put(&c->uout, p, ll) < 0) {
                conn_fail(c, SP_EINTERNAL, "out of memory");
                return true;
            }
            buf_drop(&c->gin, ll);
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
    char why[160];
    ssl_fail_detail(c->ussl, rc, why, sizeof(why));
    up_failed(c, "upstream %s: %s", why);
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
            if (r <= 0) {
                int e = SSL_get_error(c->ussl, r);
                if (e == SSL_ERROR_WANT_WRITE) {
                    c->uwant_write = true;
                    return progress;
                }
                if (e == SSL_ERROR_WANT_READ)
                    return progress;
                char why[160];
                ssl_fail_detail(c->ussl, r, why, sizeof(why));
                up_failed(c, "upstream %s: %s", why);
                return true;
            }
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
            if (x <= 0) {
                int e = SSL_get_error(c->ussl, x);
                if (e == SSL_ERROR_WANT_READ)
                    return progress;
                if (e == SSL_ERROR_WANT_WRITE) {
                    c->uwant_write = true;
                    return progress;
                }
                if (e == SSL_ERROR_ZERO_RETURN) {
                    up_eof(c);
                    return true;
                }
                char why[160];
                ssl_fail_detail(c->ussl, x, why, sizeof(why));
                up_failed(c, "upstream %s: %s", why);
                return true;
            }
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
    if (!norm_host(host, c->host, sizeof(c->host)) || !sp_mitm_wants(sb, c->host, port)) {
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
        SSL_CTX *lctx = sb->ca_cert != NULL ? leaf_ctx(sb, c->host) : NULL;
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
        bool ip = is_ip_literal(c->host);
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
