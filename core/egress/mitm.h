/*
 * mitm.h - credential injection for a sandbox's outbound HTTP(S): the part of the egress
 * proxy (core/egress/egress.h) that adds the sandbox's credential headers.
 *
 * A sandbox's credential rules ("for requests to api.example.com, set header Authorization
 * to 'Bearer {secret}' with secret X", core/egress/secrets.h) are applied here, on the host, so
 * the secret never enters the guest: the guest sends its request without the credential
 * (or with any placeholder; the rule's header is replaced, never added twice) and the
 * request that leaves the host carries it. A rule with "env": "NAME" also gives the guest's
 * processes NAME=space-placeholder:<secret name> (sp_mitm_sb_placeholders, sent by the proxy
 * in EGRESS_CONFIG ENV and re-sent when the rules change), so code that wants a key in its
 * environment has one to send; the placeholder is made from the secret's name only, never
 * its value.
 *
 *  - Plain HTTP to a destination with rules (sp_mitm_wants): the proxy hands the connection
 *    to a sp_mitm_conn_t with tls = false, which refuses every request (403): a secret is
 *    never added where it would cross the network in clear.
 *  - HTTPS (CONNECT host:443 to a destination with rules): the proxy answers the CONNECT,
 *    connects the upstream TCP socket and hands both ends to a sp_mitm_conn_t with
 *    tls = true. The conn is the TLS server toward the guest (over memory buffers: the
 *    guest's bytes arrive through agent stream callbacks) with a leaf certificate for the
 *    host minted from the sandbox's own CA, and a TLS client toward the real destination
 *    with full verification (system trust store, SNI, host name check). In between it
 *    parses each HTTP/1.1 request (keep-alive, Content-Length and chunked bodies), sets the
 *    rule headers and forwards; responses are relayed byte for byte. A destination that
 *    fails verification gets the guest a 502 with the reason, never an unverified request.
 *  - HTTPS to destinations without rules never comes here: the proxy passes it through.
 *
 * The sandbox's CA (EC P-256, self-signed, no name constraints: the rules change after the
 * CA exists, and its key never leaves the host) is created the first time the sandbox has a
 * rule, stored in the database with its key sealed by the master key (core/egress/secrets.h) so
 * any worker can use it, and installed into the guest's trust store by sp_mitm_sb_open:
 * /usr/local/share/ca-certificates/space-egress.crt, appended once to
 * /etc/ssl/certs/ca-certificates.crt (created when missing). Programs that keep their own
 * trust store find it through the environment in sp_mitm_guest_env (the proxy sends it in
 * EGRESS_CONFIG).
 *
 * Secret values live in host memory only inside the sandbox handle (zeroed when replaced or
 * freed) and in the buffers that carry a rewritten head (zeroed after use). They are never
 * logged, never sent over the agent channel and never put into an error message. A
 * destination that echoes the credential back in its response hands it to the guest; that
 * cannot be told apart from the response body and is not filtered.
 *
 * Everything runs on the loop and nothing blocks: the upstream socket is non-blocking and
 * watched with loop/loop.h. Rule changes (PUT credentials, a secret created, replaced or
 * deleted) reach open handles through NOTIFY space_credentials, in any process.
 */
#ifndef SP_MITM_H
#define SP_MITM_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "core/channel/agentconn.h"
#include "base/err.h"
#include "loop/loop.h"
#include "core/egress/secrets.h"
#include "core/store/store.h"

typedef struct sp_mitm sp_mitm_t;
typedef struct sp_mitm_sb sp_mitm_sb_t;
typedef struct sp_mitm_conn sp_mitm_conn_t;

/* Where the guest finds the sandbox CA. */
#define SP_MITM_GUEST_CA_PATH     "/usr/local/share/ca-certificates/space-egress.crt"
#define SP_MITM_GUEST_BUNDLE_PATH "/etc/ssl/certs/ca-certificates.crt"

typedef struct {
    /* TEST ONLY: a PEM file of extra CAs trusted for upstream destinations, for a loopback
     * test server. The shipped spaced never sets it (spaced-test reads
     * SPACE_TEST_UPSTREAM_CA). NULL: the system trust store alone. */
    const char *test_upstream_ca_file;
} sp_mitm_opts_t;

/*
 * The process-wide part: the upstream TLS context, the sandbox handles and the NOTIFY
 * subscription. store and secrets are borrowed and outlive m. NULL with err when the TLS
 * context cannot be built (or the test CA file cannot be read).
 */
sp_mitm_t *sp_mitm_create(sp_loop_t *loop, sp_store_t *store, sp_secrets_t *secrets,
                          const sp_mitm_opts_t *opts, sp_err_t *err);
/* Every handle must be closed first. NULL does nothing. */
void sp_mitm_destroy(sp_mitm_t *m);

/* "K=V" strings for the guest's environment (EGRESS_CONFIG ENV): SSL_CERT_FILE,
 * REQUESTS_CA_BUNDLE, NODE_EXTRA_CA_CERTS, CURL_CA_BUNDLE. Static storage. */
const char *const *sp_mitm_guest_env(size_t *n);

/* The HTTP/1.1 reason phrase the proxy and the relay answer status with. */
const char *sp_mitm_http_reason(int status);

/* ---- one sandbox ---- */

typedef void (*sp_mitm_sb_cb)(void *arg, sp_mitm_sb_t *sb, const sp_err_t *err);

/*
 * Opens the sandbox's handle for a VM whose agent channel is conn (borrowed; it is used
 * only to install the CA, now or when a rule appears later, so it must stay valid until
 * sp_mitm_sb_close: open one handle per channel session and close it when the channel goes
 * down; NULL: nothing is installed, for tests):
 * loads the rules and the secrets they name, and when there is a rule, the sandbox's CA
 * (created at first use) and installs it into the guest. cb follows exactly once (never
 * inside this call) with the handle, which then answers sp_mitm_wants at once; or with
 * an error (database down: SP_EUNAVAIL) and no handle. A failed installation in the guest
 * is logged and does not fail the open (the guest's HTTPS to rule hosts then fails
 * verification in the guest). The handle is the caller's until sp_mitm_sb_close.
 */
int sp_mitm_sb_open(sp_mitm_t *m, const char *sandbox_id, sp_agentconn_t *conn, sp_mitm_sb_cb cb,
                    void *arg, sp_err_t *err);

/* Closes the handle: open conns are destroyed (no more callbacks), secrets zeroed. Safe
 * while sp_mitm_sb_open's installation is running. NULL does nothing. */
void sp_mitm_sb_close(sp_mitm_sb_t *sb);

/* Whether requests to host (name or IP literal, any case; port not considered) get a
 * credential: a rule names host exactly, or "*.example.com" covers it (any depth). */
bool sp_mitm_wants(const sp_mitm_sb_t *sb, const char *host, uint16_t port);

/* The number of rules loaded (for logs and tests). */
size_t sp_mitm_rule_count(const sp_mitm_sb_t *sb);

/* Calls put (when not NULL) with "NAME=" SP_SECRETS_PLACEHOLDER "<secret>" for each rule that
 * names an env, once per NAME, in rule order; kv is borrowed for the call. Returns how many.
 * Public material only: no value is read. */
size_t sp_mitm_sb_placeholders(const sp_mitm_sb_t *sb, void (*put)(void *arg, const char *kv),
                               void *arg);

/* Called from the loop after a reload (NOTIFY) changed what sp_mitm_sb_placeholders gives,
 * so the caller can re-send the guest's env; not for the first load (the caller asks when
 * the open calls back). It must not close the handle. */
typedef void (*sp_mitm_sb_env_cb)(void *arg, sp_mitm_sb_t *sb);
/* Sets (cb NULL: clears) the handle's env callback. */
void sp_mitm_sb_on_env(sp_mitm_sb_t *sb, sp_mitm_sb_env_cb cb, void *arg);

/* The sandbox CA's certificate (PEM, borrowed until the next reload or close), or NULL while
 * the sandbox has had no rule. Public material: what the guest trusts. */
const char *sp_mitm_sb_ca_pem(const sp_mitm_sb_t *sb);

/* Whether the CA was installed in the guest over the handle's channel. */
bool sp_mitm_sb_ca_installed(const sp_mitm_sb_t *sb);

/* ---- plain HTTP ---- */

/*
 * Rewrites one plain-HTTP request head (request line and header lines up to and including
 * the blank line; CRLF or LF line ends) for a request to host: every rule header for host is
 * set to its formatted secret, replacing any value the guest sent; the rest is kept byte for
 * byte. *out gets a malloc'd head (free it with sp_mitm_head_free: it holds a secret) and
 * *out_len its length; when no rule applies, *out is NULL and the caller forwards head as
 * it is. Errors, with nothing allocated: SP_EINVAL for a malformed head; SP_EUNAVAIL when a
 * rule's secret does not exist (any more) or cannot be decrypted; the proxy answers the
 * guest 502 with err->msg (which never holds a value).
 */
int sp_mitm_rewrite_head(sp_mitm_sb_t *sb, const char *host, const char *head, size_t len,
                         char **out, size_t *out_len, sp_err_t *err);
/* Zeroes and frees a head from sp_mitm_rewrite_head. NULL does nothing. */
void sp_mitm_head_free(char *head, size_t len);

/* ---- a proxied connection ---- */

typedef struct {
    /* Bytes for the guest (TLS records, or HTTP responses when tls is false), borrowed for
     * the call. Returns how many were taken (0..n); with fewer than n the conn keeps the
     * rest and waits for sp_mitm_conn_guest_writable. */
    size_t (*to_guest)(void *arg, const uint8_t *p, size_t n);
    /* n bytes given to sp_mitm_conn_from_guest were processed: grant the agent that much
     * credit. What the conn holds unprocessed stays bounded because of this. */
    void (*consumed)(void *arg, size_t n);
    /* Terminal: every byte for the guest was taken; close the guest's connection: cleanly
     * (err NULL: EOF) or as failed (err says why; the guest already got a 502 when it had
     * sent a request). Never called inside a call into the conn: always from the loop.
     * The conn is freed when this returns (sp_mitm_conn_destroy inside it does nothing). */
    void (*on_end)(void *arg, const sp_err_t *err);
} sp_mitm_conn_cbs_t;

/*
 * Takes over a guest connection to host:port whose first byte (after the proxy's CONNECT
 * answer, if any) is the next thing sp_mitm_conn_from_guest gives. upstream_fd is a TCP
 * socket to the destination, connected or with a non-blocking connect in progress; the
 * conn owns it from here (also on failure: it is closed). tls: the guest speaks TLS (HTTPS
 * via CONNECT) and so does the upstream. Plain (tls false) requests may use absolute form
 * for host (rewritten to origin form); one that names another destination (in its target
 * or its Host header) gets a 421 and ends the conn. Requests are read with
 * core/egress/http1.h, as the proxy reads them.
 * NULL with err (and fd closed) on allocation failure or a bad host.
 */
sp_mitm_conn_t *sp_mitm_conn_create(sp_mitm_sb_t *sb, const char *host, uint16_t port, bool tls,
                                    int upstream_fd, const sp_mitm_conn_cbs_t *cbs, void *arg,
                                    sp_err_t *err);
/* Bytes from the guest (copied). Never calls back inside the call. */
void sp_mitm_conn_from_guest(sp_mitm_conn_t *c, const uint8_t *p, size_t n);
/* The guest closed its sending side. */
void sp_mitm_conn_guest_eof(sp_mitm_conn_t *c);
/* The guest side takes bytes again (after to_guest took fewer than offered). */
void sp_mitm_conn_guest_writable(sp_mitm_conn_t *c);
/* Abandons the conn: no more callbacks, upstream closed. Safe inside its callbacks. NULL
 * does nothing. */
void sp_mitm_conn_destroy(sp_mitm_conn_t *c);

#endif
