/*
 * mitm.c - credential injection (core/egress/mitm.h): the process-wide part,
 * sandbox handles (rules with their decrypted secrets, loaded and reloaded from
 * the store), each sandbox's CA (created, sealed, stored and installed in the
 * guest) and its leaf certificates.
 *
 * Owns the sandbox handles and, through them, the conns opened on them (closed
 * with the handle). The relay itself, and the request heads it rewrites, are
 * mitm_conn.c's. Knows no HTTP and no proxy protocol.
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

#include "base/log.h"
#include "core/channel/exec.h"
#include "core/egress/mitm_int.h"

#define LEAF_DAYS  30 /* leaf certificate validity */
#define CA_YEARS   10
#define INSTALL_MS 30000

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

/* ---- hosts and rules ---- */

bool sp_mitm__norm_host(const char *host, char *out, size_t cap)
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
    if (sb == NULL || !sp_mitm__norm_host(host, h, sizeof(h)))
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

size_t sp_mitm__rules_for(const sp_mitm_sb_t *sb, const char *host, const struct rule **out,
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

bool sp_mitm__is_ip_literal(const char *host)
{
    unsigned char b[16];
    return inet_pton(AF_INET, host, b) == 1 || inet_pton(AF_INET6, host, b) == 1;
}

/* A leaf for host signed by the sandbox CA, in a server SSL_CTX of its own. */
static SSL_CTX *make_leaf_ctx(sp_mitm_sb_t *sb, const char *host, time_t *not_after);

SSL_CTX *sp_mitm__leaf_ctx(sp_mitm_sb_t *sb, const char *host)
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
    if (!sp_mitm__norm_host(sni, h, sizeof(h)) || strcmp(h, c->host) != 0) {
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
    snprintf(san, sizeof(san), "%s:%s", sp_mitm__is_ip_literal(host) ? "IP" : "DNS", host);
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
    const sp_err_t *fail = sp_store_one_row(res, err, SP_EINTERNAL, "sandbox CA vanished", &e);
    if (fail != NULL) {
        sb_loaded(sb, fail);
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
    const sp_err_t *fail = sp_store_one_row(res, err, SP_ENOTFOUND, "sandbox not found", &e);
    if (fail != NULL) {
        sb_loaded(sb, fail);
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
    if (sp_store_query(sb->m->store,
                       "SELECT s.credentials::text, s.team_id,"
                       " coalesce((SELECT json_object_agg(x.name, x.box) FROM secrets x"
                       "  WHERE x.team_id = s.team_id AND x.name IN"
                       "   (SELECT r->>'secret' FROM jsonb_array_elements(s.credentials) "
                       "r)), '{}')::text,"
                       " c.cert_pem, c.key_box"
                       " FROM sandboxes s LEFT JOIN sandbox_cas c ON c.sandbox_id = s.id "
                       "WHERE s.id = $1",
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
