/*
 * tls.c - the local CA, the wildcard server certificate and the server
 * SSL_CTX (http/tls.h).
 *
 * Owns the files under <data-dir>/tls. Keys are EC P-256 (small, fast, and
 * accepted by every TLS stack the SDKs use). Certificates carry what strict
 * verifiers (Python 3.13's VERIFY_X509_STRICT) insist on: key identifiers,
 * a critical basicConstraints and keyUsage on the CA, serverAuth on the leaf.
 * The CA is name-constrained to the sandbox domain, localhost and the loopback
 * addresses: trusting it lets it vouch for nothing else (a CA made before, or
 * for another domain, is replaced: ca.pem and bundle.pem keep their paths).
 * Files are written to a temporary name and renamed, keys 0600, so a crash
 * never leaves half a key behind. Start-up only: blocking.
 */
#include "http/tls.h"

#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <h2o.h>
#include <openssl/bn.h>
#include <openssl/err.h>
#include <openssl/evp.h>
#include <openssl/pem.h>
#include <openssl/rand.h>
#include <openssl/x509.h>
#include <openssl/x509v3.h>
#include <stdio.h>
#include <string.h>
#include <strings.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "base/log.h"

/* The last OpenSSL error, for logs (never sent to clients: it may name files). */
static const char *ossl_why(void)
{
    static char buf[256];
    unsigned long e = ERR_get_error();
    if (e == 0)
        return "unknown";
    ERR_error_string_n(e, buf, sizeof(buf));
    ERR_clear_error();
    return buf;
}

static bool host_is_ip(const char *host)
{
    unsigned char b[16];
    return inet_pton(AF_INET, host, b) == 1 || inet_pton(AF_INET6, host, b) == 1;
}

/* A DNS name or an IP: what may go into a SAN without changing its meaning. */
static bool host_ok(const char *host)
{
    size_t n = strlen(host);
    if (n == 0 || n > 200 || host[0] == '.' || host[0] == '-' || host[n - 1] == '.')
        return false;
    if (host_is_ip(host))
        return true;
    for (const char *c = host; *c; c++)
        if (!((*c >= 'a' && *c <= 'z') || (*c >= 'A' && *c <= 'Z') || (*c >= '0' && *c <= '9') ||
              *c == '-' || *c == '.'))
            return false;
    return strstr(host, "..") == NULL;
}

/* ---- files ---- */

static int write_file(const char *path, mode_t mode, int (*fill)(FILE *f, void *arg), void *arg)
{
    char tmp[4300];
    snprintf(tmp, sizeof(tmp), "%s.tmp", path);
    int fd = open(tmp, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, mode);
    if (fd < 0)
        return -1;
    FILE *f = fdopen(fd, "w");
    if (f == NULL) {
        close(fd);
        unlink(tmp);
        return -1;
    }
    bool ok = fill(f, arg) == 0 && fflush(f) == 0 && fsync(fileno(f)) == 0;
    ok = (fclose(f) == 0) && ok;
    if (!ok || chmod(tmp, mode) < 0 || rename(tmp, path) < 0) {
        unlink(tmp);
        return -1;
    }
    return 0;
}

static int fill_key(FILE *f, void *arg)
{
    return PEM_write_PrivateKey(f, arg, NULL, NULL, 0, NULL, NULL) == 1 ? 0 : -1;
}

static int fill_cert(FILE *f, void *arg)
{
    return PEM_write_X509(f, arg) == 1 ? 0 : -1;
}

struct chain {
    X509 *leaf, *ca;
};

static int fill_chain(FILE *f, void *arg)
{
    struct chain *c = arg;
    return PEM_write_X509(f, c->leaf) == 1 && PEM_write_X509(f, c->ca) == 1 ? 0 : -1;
}

struct bundle {
    const char *sys; /* the system bundle, may be missing */
    const char *ca;
};

static int copy_into(FILE *out, const char *path, bool must)
{
    FILE *in = fopen(path, "r");
    if (in == NULL)
        return must ? -1 : 0;
    char buf[16384];
    size_t n;
    int rc = 0;
    while ((n = fread(buf, 1, sizeof(buf), in)) > 0)
        if (fwrite(buf, 1, n, out) != n)
            rc = -1;
    if (ferror(in))
        rc = -1;
    fclose(in);
    fputc('\n', out);
    return rc;
}

static int fill_bundle(FILE *f, void *arg)
{
    struct bundle *b = arg;
    if (copy_into(f, b->sys, false) < 0)
        return -1;
    return copy_into(f, b->ca, true);
}

/* The PEM private key (key) or certificate in path; NULL when there is none to read (the caller
 * makes a new one), with OpenSSL's error queue cleared. */
static void *load_pem(const char *path, bool key)
{
    FILE *f = fopen(path, "r");
    if (f == NULL)
        return NULL;
    void *v = key ? (void *)PEM_read_PrivateKey(f, NULL, NULL, NULL)
                  : (void *)PEM_read_X509(f, NULL, NULL, NULL);
    fclose(f);
    ERR_clear_error();
    return v;
}

static X509 *load_cert(const char *path)
{
    return load_pem(path, false);
}

static EVP_PKEY *load_key(const char *path)
{
    return load_pem(path, true);
}

/* ---- certificates ---- */

/* Valid now and for more than SP_TLS_RENEW_DAYS. */
static bool fresh(X509 *x)
{
    time_t now = time(NULL);
    time_t later = now + (time_t)SP_TLS_RENEW_DAYS * 86400;
    return X509_cmp_time(X509_get0_notBefore(x), &now) < 0 &&
           X509_cmp_time(X509_get0_notAfter(x), &later) > 0;
}

static int add_ext(X509 *x, X509V3_CTX *ctx, int nid, const char *value)
{
    X509_EXTENSION *ext = X509V3_EXT_conf_nid(NULL, ctx, nid, value);
    if (ext == NULL)
        return -1;
    int ok = X509_add_ext(x, ext, -1);
    X509_EXTENSION_free(ext);
    return ok == 1 ? 0 : -1;
}

/*
 * One certificate for key, named cn, signed by (issuer, issuer_key); issuer NULL = self-signed.
 * names: the leaf's subjectAltName value, or the CA's nameConstraints value.
 */
static X509 *make_cert(EVP_PKEY *key, const char *cn, X509 *issuer, EVP_PKEY *issuer_key,
                       long days, bool ca, const char *names)
{
    X509 *x = X509_new();
    BIGNUM *bn = BN_new();
    unsigned char rnd[16];
    bool ok = x != NULL && bn != NULL && RAND_bytes(rnd, sizeof(rnd)) == 1;
    if (ok) {
        rnd[0] &= 0x7f; /* positive serial */
        rnd[0] |= 0x01; /* and never a short (leading zero) one */
        ok = BN_bin2bn(rnd, sizeof(rnd), bn) != NULL &&
             BN_to_ASN1_INTEGER(bn, X509_get_serialNumber(x)) != NULL &&
             X509_set_version(x, 2) == 1 &&
             X509_gmtime_adj(X509_getm_notBefore(x), -3600) != NULL &&
             X509_time_adj_ex(X509_getm_notAfter(x), (int)days, 0, NULL) != NULL;
    }
    X509_NAME *name = ok ? X509_get_subject_name(x) : NULL;
    ok = ok &&
         X509_NAME_add_entry_by_txt(name, "O", MBSTRING_ASC, (const unsigned char *)"space", -1,
                                    -1, 0) == 1 &&
         X509_NAME_add_entry_by_txt(name, "CN", MBSTRING_ASC, (const unsigned char *)cn, -1, -1,
                                    0) == 1 &&
         X509_set_issuer_name(x, issuer ? X509_get_subject_name(issuer) : name) == 1 &&
         X509_set_pubkey(x, key) == 1;
    if (ok) {
        X509V3_CTX ctx;
        X509V3_set_ctx_nodb(&ctx);
        X509V3_set_ctx(&ctx, issuer ? issuer : x, x, NULL, NULL, 0);
        if (ca) {
            ok = add_ext(x, &ctx, NID_basic_constraints, "critical,CA:TRUE,pathlen:0") == 0 &&
                 add_ext(x, &ctx, NID_key_usage, "critical,keyCertSign,cRLSign") == 0 &&
                 add_ext(x, &ctx, NID_subject_key_identifier, "hash") == 0 &&
                 add_ext(x, &ctx, NID_authority_key_identifier, "keyid:always") == 0 &&
                 add_ext(x, &ctx, NID_name_constraints, names) == 0;
        } else {
            ok = add_ext(x, &ctx, NID_basic_constraints, "critical,CA:FALSE") == 0 &&
                 add_ext(x, &ctx, NID_key_usage, "critical,digitalSignature") == 0 &&
                 add_ext(x, &ctx, NID_ext_key_usage, "serverAuth") == 0 &&
                 add_ext(x, &ctx, NID_subject_key_identifier, "hash") == 0 &&
                 add_ext(x, &ctx, NID_authority_key_identifier, "keyid:always") == 0 &&
                 add_ext(x, &ctx, NID_subject_alt_name, names) == 0;
        }
    }
    ok = ok && X509_sign(x, issuer_key, EVP_sha256()) > 0;
    BN_free(bn);
    if (!ok) {
        sp_log(SP_LOG_ERROR, "tls", "making a certificate failed cn=%s err=%s", cn, ossl_why());
        X509_free(x);
        return NULL;
    }
    return x;
}

/* The server certificate's names for host (an OpenSSL subjectAltName value). */
static void leaf_names(const char *host, char *out, size_t cap)
{
    if (host_is_ip(host))
        snprintf(out, cap, "IP:%s,DNS:localhost,IP:127.0.0.1,IP:::1", host);
    else
        snprintf(out, cap, "DNS:*.%s,DNS:%s,DNS:localhost,IP:127.0.0.1,IP:::1", host, host);
}

/* The CA's name constraints for host: it, its subdomains, localhost, loopback. */
static void ca_constraints(const char *host, char *out, size_t cap)
{
    static const char v6all[] = "ffff:ffff:ffff:ffff:ffff:ffff:ffff:ffff";
    static const char rest[] = "permitted;DNS:localhost,permitted;IP:127.0.0.0/255.0.0.0,"
                               "permitted;IP:::1/ffff:ffff:ffff:ffff:ffff:ffff:ffff:ffff";
    if (!host_is_ip(host))
        snprintf(out, cap, "critical,permitted;DNS:%s,%s", host, rest);
    else if (strchr(host, ':') != NULL)
        snprintf(out, cap, "critical,permitted;IP:%s/%s,%s", host, v6all, rest);
    else
        snprintf(out, cap, "critical,permitted;IP:%s/255.255.255.255,%s", host, rest);
}

/* Whether name lies in the DNS subtree base (the name itself or one below it). */
static bool dns_under(const char *name, const ASN1_IA5STRING *base)
{
    size_t n = strlen(name), b = (size_t)base->length;
    const char *bp = (const char *)base->data;
    if (b == 0)
        return true;
    if (n == b)
        return strncasecmp(name, bp, b) == 0;
    return n > b && name[n - b - 1] == '.' && strncasecmp(name + n - b, bp, b) == 0;
}

/* Whether the address text host lies in the IP subtree base (address then mask bytes). */
static bool ip_under(const char *host, const ASN1_OCTET_STRING *base)
{
    unsigned char a[16];
    int len = inet_pton(AF_INET, host, a) == 1 ? 4 : inet_pton(AF_INET6, host, a) == 1 ? 16 : 0;
    if (len == 0 || base->length != 2 * len)
        return false;
    for (int i = 0; i < len; i++)
        if ((a[i] & base->data[len + i]) != (base->data[i] & base->data[len + i]))
            return false;
    return true;
}

/* The CA is name-constrained, and its permitted subtrees hold host (the server certificate's
 * other names, localhost and loopback, are in every CA this file makes). */
static bool ca_covers(X509 *ca, const char *host)
{
    NAME_CONSTRAINTS *nc = X509_get_ext_d2i(ca, NID_name_constraints, NULL, NULL);
    bool ok = false;
    bool ip = host_is_ip(host);
    for (int i = 0; nc != NULL && !ok && i < sk_GENERAL_SUBTREE_num(nc->permittedSubtrees); i++) {
        const GENERAL_NAME *g = sk_GENERAL_SUBTREE_value(nc->permittedSubtrees, i)->base;
        if (!ip && g->type == GEN_DNS)
            ok = dns_under(host, g->d.dNSName);
        else if (ip && g->type == GEN_IPADD)
            ok = ip_under(host, g->d.iPAddress);
    }
    NAME_CONSTRAINTS_free(nc);
    ERR_clear_error();
    return ok;
}

static EVP_PKEY *make_key(void)
{
    EVP_PKEY *k = EVP_PKEY_Q_keygen(NULL, NULL, "EC", "P-256");
    if (k == NULL)
        sp_log(SP_LOG_ERROR, "tls", "key generation failed err=%s", ossl_why());
    return k;
}

/* The server certificate fits: for host, from this CA, with this key, not expiring. */
static bool leaf_ok(X509 *leaf, EVP_PKEY *key, X509 *ca, const char *host)
{
    if (leaf == NULL || key == NULL || !fresh(leaf) || X509_check_private_key(leaf, key) != 1 ||
        X509_verify(leaf, X509_get0_pubkey(ca)) != 1) {
        ERR_clear_error();
        return false;
    }
    if (host_is_ip(host))
        return X509_check_ip_asc(leaf, host, 0) == 1;
    char sub[256];
    snprintf(sub, sizeof(sub), "x.%s", host);
    return X509_check_host(leaf, host, 0, 0, NULL) == 1 &&
           X509_check_host(leaf, sub, 0, 0, NULL) == 1;
}

int sp_tls_ensure(const char *data_dir, const char *host, sp_tls_files_t *out, sp_err_t *err)
{
    memset(out, 0, sizeof(*out));
    if (!host_ok(host))
        return sp_err_set(err, SP_EINVAL, "domain host %.100s is not a DNS name or address", host);
    snprintf(out->dir, sizeof(out->dir), "%s/tls", data_dir);
    snprintf(out->ca_cert, sizeof(out->ca_cert), "%s/ca.pem", out->dir);
    snprintf(out->ca_key, sizeof(out->ca_key), "%s/ca.key", out->dir);
    snprintf(out->cert, sizeof(out->cert), "%s/server.pem", out->dir);
    snprintf(out->key, sizeof(out->key), "%s/server.key", out->dir);
    /* 0755: ca.pem must be readable by the users who trust it; keys are 0600 inside. */
    if (mkdir(out->dir, 0755) < 0 && errno != EEXIST) {
        sp_log(SP_LOG_ERROR, "tls", "mkdir failed dir=%s err=%s", out->dir, strerror(errno));
        return sp_err_set(err, SP_EINTERNAL, "cannot create the TLS directory");
    }
    int rc = -1;
    X509 *ca = load_cert(out->ca_cert), *leaf = NULL;
    EVP_PKEY *ca_key = load_key(out->ca_key), *key = NULL;
    if (ca == NULL || ca_key == NULL || !fresh(ca) || X509_check_private_key(ca, ca_key) != 1 ||
        !ca_covers(ca, host)) {
        if (ca != NULL && ca_key != NULL)
            sp_log(SP_LOG_WARN, "tls", "the local CA is not limited to host=%s: making a new one "
                   "(clients trust it again through the same files)", host);
        ERR_clear_error();
        X509_free(ca);
        EVP_PKEY_free(ca_key);
        char nc[1024];
        ca_constraints(host, nc, sizeof(nc));
        ca_key = make_key();
        ca = ca_key ? make_cert(ca_key, "space local CA", NULL, ca_key, SP_TLS_CA_DAYS, true, nc)
                    : NULL;
        if (ca == NULL || write_file(out->ca_key, 0600, fill_key, ca_key) < 0 ||
            write_file(out->ca_cert, 0644, fill_cert, ca) < 0) {
            sp_log(SP_LOG_ERROR, "tls", "writing the CA failed dir=%s err=%s", out->dir,
                   strerror(errno));
            sp_err_set(err, SP_EINTERNAL, "cannot create the local CA");
            goto out;
        }
        out->created_ca = true;
        sp_log(SP_LOG_INFO, "tls", "created local CA path=%s", out->ca_cert);
    }
    leaf = load_cert(out->cert);
    key = load_key(out->key);
    if (out->created_ca || !leaf_ok(leaf, key, ca, host)) {
        X509_free(leaf);
        EVP_PKEY_free(key);
        char sans[1024], cn[256];
        leaf_names(host, sans, sizeof(sans));
        snprintf(cn, sizeof(cn), "%s", host);
        key = make_key();
        leaf = key ? make_cert(key, cn, ca, ca_key, SP_TLS_SERVER_DAYS, false, sans) : NULL;
        struct chain ch = {leaf, ca};
        if (leaf == NULL || write_file(out->key, 0600, fill_key, key) < 0 ||
            write_file(out->cert, 0644, fill_chain, &ch) < 0) {
            sp_log(SP_LOG_ERROR, "tls", "writing the server certificate failed dir=%s err=%s",
                   out->dir, strerror(errno));
            sp_err_set(err, SP_EINTERNAL, "cannot create the server certificate");
            goto out;
        }
        out->created_cert = true;
        sp_log(SP_LOG_INFO, "tls", "created server certificate host=%s", host);
    }
    /* bundle.pem: what SSL_CERT_FILE should name (it replaces the system bundle in Python). */
    snprintf(out->bundle, sizeof(out->bundle), "%s/bundle.pem", out->dir);
    struct bundle b = {X509_get_default_cert_file(), out->ca_cert};
    if (write_file(out->bundle, 0644, fill_bundle, &b) < 0) {
        sp_log(SP_LOG_WARN, "tls", "writing bundle.pem failed err=%s", strerror(errno));
        out->bundle[0] = '\0';
    }
    rc = 0;
out:
    X509_free(ca);
    X509_free(leaf);
    EVP_PKEY_free(ca_key);
    EVP_PKEY_free(key);
    return rc;
}

SSL_CTX *sp_tls_server_ctx(const char *cert_file, const char *key_file, sp_err_t *err)
{
    SSL_CTX *ctx = SSL_CTX_new(TLS_server_method());
    if (ctx == NULL) {
        sp_log(SP_LOG_ERROR, "tls", "SSL_CTX_new failed err=%s", ossl_why());
        sp_err_set(err, SP_EINTERNAL, "cannot create a TLS context");
        return NULL;
    }
    SSL_CTX_set_min_proto_version(ctx, TLS1_2_VERSION);
    SSL_CTX_set_options(ctx, SSL_OP_NO_COMPRESSION | SSL_OP_CIPHER_SERVER_PREFERENCE |
                                 SSL_OP_NO_RENEGOTIATION);
    if (SSL_CTX_use_certificate_chain_file(ctx, cert_file) != 1) {
        sp_log(SP_LOG_ERROR, "tls", "loading certificate failed path=%s err=%s", cert_file,
               ossl_why());
        sp_err_set(err, SP_EINVAL, "cannot load the TLS certificate");
        SSL_CTX_free(ctx);
        return NULL;
    }
    if (SSL_CTX_use_PrivateKey_file(ctx, key_file, SSL_FILETYPE_PEM) != 1 ||
        SSL_CTX_check_private_key(ctx) != 1) {
        sp_log(SP_LOG_ERROR, "tls", "loading key failed path=%s err=%s", key_file, ossl_why());
        sp_err_set(err, SP_EINVAL, "cannot load the TLS key, or it does not match the certificate");
        SSL_CTX_free(ctx);
        return NULL;
    }
    /* h2o_alpn_protocols = h2 (and its drafts) then http/1.1: HTTP/2 when offered. */
    h2o_ssl_register_alpn_protocols(ctx, h2o_alpn_protocols);
    return ctx;
}

struct alpn {
    sp_tls_http1_only_fn fn;
    void *arg;
};

static int alpn_select(SSL *ssl, const unsigned char **out, unsigned char *outlen,
                       const unsigned char *in, unsigned int inlen, void *arg)
{
    static const unsigned char both[] = "\x02h2\x08http/1.1", h1[] = "\x08http/1.1";
    struct alpn *a = arg;
    const char *sni = SSL_get_servername(ssl, TLSEXT_NAMETYPE_host_name);
    bool only1 = a->fn(a->arg, sni);
    const unsigned char *ours = only1 ? h1 : both;
    unsigned int ours_len = only1 ? sizeof(h1) - 1 : sizeof(both) - 1;
    /* Server preference: the first of ours the client offered. */
    if (SSL_select_next_proto((unsigned char **)out, outlen, ours, ours_len, in, inlen) !=
        OPENSSL_NPN_NEGOTIATED)
        return SSL_TLSEXT_ERR_NOACK; /* no common protocol: HTTP/1.1 without ALPN */
    return SSL_TLSEXT_ERR_OK;
}

int sp_tls_set_http1_only(SSL_CTX *ctx, sp_tls_http1_only_fn fn, void *arg)
{
    /* Lives as long as the context: freed with it through ex_data would need an index for
     * one pointer; the server makes one context per process. */
    static struct alpn a;
    a.fn = fn;
    a.arg = arg;
    SSL_CTX_set_alpn_select_cb(ctx, alpn_select, &a);
    return 0;
}
