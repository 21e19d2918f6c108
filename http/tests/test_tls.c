/*
 * test_tls.c - the local CA and wildcard certificate (http/tls.h): what is made, what is
 * kept across starts, what is re-made, and that the SSL_CTX loads it.
 */
#include <arpa/inet.h>
#include <openssl/evp.h>
#include <openssl/pem.h>
#include <openssl/x509.h>
#include <openssl/x509v3.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "http/tls.h"
#include "tests/check.h"

static char g_dir[256];

static X509 *load(const char *path)
{
    FILE *f = fopen(path, "r");
    if (f == NULL)
        return NULL;
    X509 *x = PEM_read_X509(f, NULL, NULL, NULL);
    fclose(f);
    return x;
}

static mode_t mode_of(const char *path)
{
    struct stat st;
    return stat(path, &st) == 0 ? (st.st_mode & 0777) : 0;
}

/* Days from now until t (negative: in the past). */
static int days_until(const ASN1_TIME *t)
{
    int days = 0, secs = 0;
    ASN1_TIME_diff(&days, &secs, NULL, t);
    return days;
}

static bool verifies(X509 *leaf, X509 *ca, const char *host)
{
    X509_STORE *st = X509_STORE_new();
    X509_STORE_add_cert(st, ca);
    X509_STORE_CTX *ctx = X509_STORE_CTX_new();
    X509_STORE_CTX_init(ctx, st, leaf, NULL);
    X509_VERIFY_PARAM *p = X509_STORE_CTX_get0_param(ctx);
    X509_VERIFY_PARAM_set_flags(p, X509_V_FLAG_X509_STRICT);
    X509_VERIFY_PARAM_set_purpose(p, X509_PURPOSE_SSL_SERVER);
    unsigned char ip[16];
    if (inet_pton(AF_INET, host, ip) == 1 || inet_pton(AF_INET6, host, ip) == 1)
        X509_VERIFY_PARAM_set1_ip_asc(p, host);
    else
        X509_VERIFY_PARAM_set1_host(p, host, 0);
    int ok = X509_verify_cert(ctx);
    if (ok != 1)
        fprintf(stderr, "verify %s: %s\n", host,
                X509_verify_cert_error_string(X509_STORE_CTX_get_error(ctx)));
    X509_STORE_CTX_free(ctx);
    X509_STORE_free(st);
    return ok == 1;
}

static void test_tls_creates_ca_and_wildcard(void)
{
    sp_tls_files_t f;
    sp_err_t e;
    CHECK(sp_tls_ensure(g_dir, "space.localhost", &f, &e) == 0);
    CHECK(f.created_ca && f.created_cert);
    CHECK(mode_of(f.ca_key) == 0600);
    CHECK(mode_of(f.key) == 0600);
    CHECK(mode_of(f.ca_cert) == 0644);
    X509 *ca = load(f.ca_cert), *leaf = load(f.cert);
    CHECK(ca != NULL && leaf != NULL);
    if (ca == NULL || leaf == NULL)
        return;
    /* CA: CA:TRUE, keyCertSign, ~10 years */
    CHECK(X509_check_ca(ca) >= 1);
    CHECK((X509_get_key_usage(ca) & KU_KEY_CERT_SIGN) != 0);
    int cad = days_until(X509_get0_notAfter(ca));
    CHECK(cad >= SP_TLS_CA_DAYS - 1 && cad <= SP_TLS_CA_DAYS);
    /* leaf: not a CA, serverAuth, 1-2 years, the SANs */
    CHECK(X509_check_ca(leaf) == 0);
    CHECK((X509_get_extended_key_usage(leaf) & XKU_SSL_SERVER) != 0);
    int ld = days_until(X509_get0_notAfter(leaf));
    CHECK(ld >= 365 && ld <= 2 * 366);
    CHECK(X509_check_host(leaf, "49999-abc.space.localhost", 0, 0, NULL) == 1);
    CHECK(X509_check_host(leaf, "space.localhost", 0, 0, NULL) == 1);
    CHECK(X509_check_host(leaf, "localhost", 0, 0, NULL) == 1);
    CHECK(X509_check_ip_asc(leaf, "127.0.0.1", 0) == 1);
    CHECK(X509_check_host(leaf, "a.b.space.localhost", 0, 0, NULL) != 1); /* one label only */
    CHECK(X509_check_host(leaf, "x.other.localhost", 0, 0, NULL) != 1);
    /* chains to the CA under strict rules (what Python 3.13 applies) */
    CHECK(verifies(leaf, ca, "49983-abc.space.localhost"));
    X509_free(ca);
    X509_free(leaf);
    /* the bundle ends with our CA */
    CHECK(f.bundle[0] != '\0' && access(f.bundle, R_OK) == 0);
}

static void test_tls_keeps_what_fits(void)
{
    sp_tls_files_t f;
    sp_err_t e;
    X509 *before = NULL;
    char path[512];
    snprintf(path, sizeof(path), "%s/tls/server.pem", g_dir);
    before = load(path);
    CHECK(sp_tls_ensure(g_dir, "space.localhost", &f, &e) == 0);
    CHECK(!f.created_ca && !f.created_cert);
    X509 *after = load(path);
    CHECK(before != NULL && after != NULL && X509_cmp(before, after) == 0);
    X509_free(before);
    X509_free(after);
}

static void test_tls_remakes_for_new_domain(void)
{
    sp_tls_files_t f;
    sp_err_t e;
    char path[512];
    snprintf(path, sizeof(path), "%s/tls/ca.pem", g_dir);
    X509 *old_ca = load(path);
    CHECK(sp_tls_ensure(g_dir, "sbx.example.test", &f, &e) == 0);
    /* A CA limited to the old domain cannot vouch for the new one: a new CA, same files. */
    CHECK(f.created_ca && f.created_cert);
    X509 *leaf = load(f.cert), *ca = load(f.ca_cert);
    CHECK(old_ca != NULL && leaf != NULL && !verifies(leaf, old_ca, "8080-abc.sbx.example.test"));
    X509_free(old_ca);
    CHECK(leaf != NULL && X509_check_host(leaf, "8080-abc.sbx.example.test", 0, 0, NULL) == 1);
    CHECK(leaf != NULL && X509_check_host(leaf, "x.space.localhost", 0, 0, NULL) != 1);
    CHECK(leaf != NULL && ca != NULL && verifies(leaf, ca, "8080-abc.sbx.example.test"));
    X509_free(leaf);
    X509_free(ca);
}

static void test_tls_remakes_after_ca_loss(void)
{
    sp_tls_files_t f;
    sp_err_t e;
    char path[512];
    snprintf(path, sizeof(path), "%s/tls/ca.key", g_dir);
    unlink(path);
    CHECK(sp_tls_ensure(g_dir, "sbx.example.test", &f, &e) == 0);
    CHECK(f.created_ca && f.created_cert); /* a leaf from the lost CA would not verify */
    X509 *leaf = load(f.cert), *ca = load(f.ca_cert);
    CHECK(leaf != NULL && ca != NULL && verifies(leaf, ca, "1-abc.sbx.example.test"));
    X509_free(leaf);
    X509_free(ca);
}

static void test_tls_rejects_bad_host(void)
{
    sp_tls_files_t f;
    sp_err_t e;
    CHECK(sp_tls_ensure(g_dir, "", &f, &e) < 0);
    CHECK(sp_tls_ensure(g_dir, "a,DNS:evil.com", &f, &e) < 0 && e.code == SP_EINVAL);
    CHECK(sp_tls_ensure(g_dir, "bad..name", &f, &e) < 0);
}

static void test_tls_ctx_loads(void)
{
    sp_tls_files_t f;
    sp_err_t e;
    CHECK(sp_tls_ensure(g_dir, "space.localhost", &f, &e) == 0);
    SSL_CTX *ctx = sp_tls_server_ctx(f.cert, f.key, &e);
    CHECK(ctx != NULL);
    if (ctx != NULL) {
        CHECK(SSL_CTX_get_min_proto_version(ctx) == TLS1_2_VERSION);
        SSL_CTX_free(ctx);
    }
    /* a key that does not match the certificate */
    CHECK(sp_tls_server_ctx(f.cert, f.ca_key, &e) == NULL);
    CHECK(sp_tls_server_ctx("/nonexistent/cert.pem", f.key, &e) == NULL);
}

/* The CA vouches only for the sandbox domain, localhost and loopback: a certificate it signed
 * for any other name fails verification, whatever its key says. */
static void test_tls_ca_is_name_constrained(void)
{
    sp_tls_files_t f;
    sp_err_t e;
    CHECK(sp_tls_ensure(g_dir, "space.localhost", &f, &e) == 0);
    X509 *ca = load(f.ca_cert);
    FILE *kf = fopen(f.ca_key, "r");
    EVP_PKEY *ca_key = kf ? PEM_read_PrivateKey(kf, NULL, NULL, NULL) : NULL;
    if (kf != NULL)
        fclose(kf);
    REQUIRE(ca != NULL && ca_key != NULL);
    int crit = -1;
    NAME_CONSTRAINTS *nc = X509_get_ext_d2i(ca, NID_name_constraints, &crit, NULL);
    CHECK(nc != NULL && crit == 1);
    NAME_CONSTRAINTS_free(nc);
    const char *names[] = {"DNS:www.example.com", "DNS:1-abc.space.localhost", "DNS:localhost",
                           "IP:127.0.0.1", "IP:10.0.0.1", "DNS:space.localhost.evil.com"};
    const char *hosts[] = {"www.example.com", "1-abc.space.localhost", "localhost", "127.0.0.1",
                           "10.0.0.1", "space.localhost.evil.com"};
    const bool want[] = {false, true, true, true, false, false};
    for (size_t i = 0; i < sizeof(names) / sizeof(names[0]); i++) {
        EVP_PKEY *k = EVP_PKEY_Q_keygen(NULL, NULL, "EC", "P-256");
        X509 *x = X509_new();
        REQUIRE(k != NULL && x != NULL);
        X509V3_CTX ctx;
        X509V3_set_ctx_nodb(&ctx);
        X509V3_set_ctx(&ctx, ca, x, NULL, NULL, 0);
        X509_EXTENSION *bc =
            X509V3_EXT_conf_nid(NULL, &ctx, NID_basic_constraints, "critical,CA:FALSE");
        X509_EXTENSION *san = X509V3_EXT_conf_nid(NULL, &ctx, NID_subject_alt_name, names[i]);
        X509_EXTENSION *eku = X509V3_EXT_conf_nid(NULL, &ctx, NID_ext_key_usage, "serverAuth");
        X509_EXTENSION *ski = X509V3_EXT_conf_nid(NULL, &ctx, NID_subject_key_identifier, "hash");
        X509_EXTENSION *aki =
            X509V3_EXT_conf_nid(NULL, &ctx, NID_authority_key_identifier, "keyid:always");
        ASN1_INTEGER_set(X509_get_serialNumber(x), (long)i + 100);
        X509_set_version(x, 2);
        X509_gmtime_adj(X509_getm_notBefore(x), -60);
        X509_gmtime_adj(X509_getm_notAfter(x), 3600);
        X509_NAME_add_entry_by_txt(X509_get_subject_name(x), "O", MBSTRING_ASC,
                                   (const unsigned char *)"test", -1, -1, 0);
        X509_set_issuer_name(x, X509_get_subject_name(ca));
        X509_set_pubkey(x, k);
        X509_add_ext(x, bc, -1);
        X509_add_ext(x, san, -1);
        X509_add_ext(x, eku, -1);
        X509_add_ext(x, ski, -1);
        X509_add_ext(x, aki, -1);
        REQUIRE(X509_sign(x, ca_key, EVP_sha256()) > 0);
        bool ok = verifies(x, ca, hosts[i]);
        if (ok != want[i])
            fprintf(stderr, "%s: verified=%d, want %d\n", names[i], ok, want[i]);
        CHECK(ok == want[i]);
        X509_EXTENSION_free(bc);
        X509_EXTENSION_free(san);
        X509_EXTENSION_free(eku);
        X509_EXTENSION_free(ski);
        X509_EXTENSION_free(aki);
        X509_free(x);
        EVP_PKEY_free(k);
    }
    X509_free(ca);
    EVP_PKEY_free(ca_key);
}

int main(void)
{
    const char *tmp = getenv("TMPDIR");
    snprintf(g_dir, sizeof(g_dir), "%s/sp-test-tls-XXXXXX", tmp && tmp[0] ? tmp : "/tmp");
    if (mkdtemp(g_dir) == NULL) {
        perror("mkdtemp");
        return 1;
    }
    test_tls_creates_ca_and_wildcard();
    test_tls_keeps_what_fits();
    test_tls_remakes_for_new_domain();
    test_tls_remakes_after_ca_loss();
    test_tls_rejects_bad_host();
    test_tls_ca_is_name_constrained();
    test_tls_ctx_loads();
    char cmd[600];
    snprintf(cmd, sizeof(cmd), "rm -rf '%s'", g_dir);
    if (system(cmd) != 0)
        fprintf(stderr, "cleanup failed\n");
    return check_report("tls");
}
