/*
 * tls.h - the server's TLS material: a local CA and a wildcard certificate
 * for the sandbox domain, kept in <data-dir>/tls, and the OpenSSL context the
 * listener hands to h2o.
 *
 * Why: the E2B code interpreter (and get_host() traffic) always uses
 * https://<port>-<id>.<domain>, so the server must terminate TLS with a
 * certificate valid for *.<domain> that the client trusts (spec 1.6). With no
 * operator-supplied certificate, a CA is made once (ca.key 0600, ca.pem) and a
 * server certificate for *.<host>, <host>, localhost and 127.0.0.1 is signed
 * by it; the server certificate is re-made when the domain changes, the CA
 * changes, or it is within 30 days of expiry. Users trust ca.pem (or
 * bundle.pem: the system CAs plus ours, for SSL_CERT_FILE, which replaces the
 * system bundle for Python).
 *
 * Blocking file I/O and key generation: start-up only, never on the loop.
 */
#ifndef SP_TLS_H
#define SP_TLS_H

#include <openssl/ssl.h>
#include <stdbool.h>

#include "base/err.h"

#define SP_TLS_CA_DAYS     3650 /* local CA validity */
#define SP_TLS_SERVER_DAYS 397  /* server certificate validity (the browser maximum) */
#define SP_TLS_RENEW_DAYS  30   /* re-make a certificate this close to expiry */

typedef struct {
    char dir[4096];         /* <data-dir>/tls */
    char ca_cert[4200];     /* ca.pem */
    char ca_key[4200];      /* ca.key */
    char cert[4200];        /* server.pem: leaf then CA */
    char key[4200];         /* server.key */
    char bundle[4200];      /* bundle.pem: system CAs + ca.pem ("" when not written) */
    bool created_ca;        /* this call made a new CA (clients must trust it anew) */
    bool created_cert;      /* this call made a new server certificate */
} sp_tls_files_t;

/*
 * Makes sure <data_dir>/tls holds a CA and a server certificate valid for
 * host (the domain without ":port"; "space.localhost"), creating or renewing
 * what is missing, expiring or for another host, and writes bundle.pem.
 * Fills *out. 0, or -1 with err.
 */
int sp_tls_ensure(const char *data_dir, const char *host, sp_tls_files_t *out, sp_err_t *err);

/*
 * A server SSL_CTX (TLS 1.2+) with the certificate chain and key from PEM
 * files, ALPN h2 and http/1.1 registered for h2o. The caller owns the result
 * (SSL_CTX_free). NULL with err when the files do not load or do not match.
 */
SSL_CTX *sp_tls_server_ctx(const char *cert_file, const char *key_file, sp_err_t *err);

/*
 * Replaces ctx's ALPN choice: h2 then http/1.1 as before, except for connections whose SNI
 * name fn(arg, name) accepts (name may be NULL), which get http/1.1 only. One such
 * selector per process (it is kept in a static); fn runs during handshakes, on the loop.
 */
typedef bool (*sp_tls_http1_only_fn)(void *arg, const char *server_name);
int sp_tls_set_http1_only(SSL_CTX *ctx, sp_tls_http1_only_fn fn, void *arg);

#endif
