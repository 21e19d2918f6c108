/*
 * mitm_int.h - what the two files of the credential relay (core/egress/mitm.h)
 * share:
 *
 *   mitm.c       the process-wide part, sandbox handles (rules, CA, leaf
 * certificates) mitm_conn.c  the relay: one conn per handed-over connection,
 * its request framing (core/egress/http1.h) and head rewriting
 *
 * Everything runs on the loop thread.
 */
#ifndef SP_MITM_INT_H
#define SP_MITM_INT_H

#include <openssl/ssl.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <time.h>

#include "core/channel/exec.h"
#include "core/egress/http1.h"
#include "core/egress/mitm.h"

/* Bytes zeroed as they are consumed (request bytes may hold a secret). */
struct buf {
    uint8_t *p;
    size_t off, len, cap;
};

struct rule {
    char host[256]; /* lowercase; "*.suffix" covers subdomains */
    char header[65];
    char secret[SP_SECRETS_NAME_MAX + 1];
    char *format;
    char env[SP_SECRETS_ENV_MAX + 1]; /* "": no placeholder in the guest */
    uint8_t *value;                   /* NULL: the secret is missing or does not open */
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
    RQ_BODY,    /* Content-Length */
    RQ_CHUNKED, /* a chunked body, scanned as it passes */
    RQ_RAW,     /* after an Upgrade or CONNECT: bytes pass as they are */
    RQ_DEAD,    /* an error answer was sent: the guest's bytes are dropped */
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

    /* request framing (core/egress/http1.h) */
    enum rq_state rq;
    uint64_t remaining;    /* RQ_BODY: bytes of the body still to come */
    sp_http1_chunked_t cs; /* RQ_CHUNKED: where the body ends */
    bool req_seen;         /* a request head was parsed on this conn */

    /* end */
    bool failed;
    sp_err_t err;
    bool ended;
    sp_timer_t linger;

    sp_mitm_conn_t *prev, *next;
};

/* ---- mitm.c ---- */

/* Lowercases host into out, without brackets or a trailing dot; false when it
 * is no host. */
bool sp_mitm__norm_host(const char *host, char *out, size_t cap);
/* The rules that apply to host (normal form), at most one per header: exact
 * ones before wildcards. */
size_t sp_mitm__rules_for(const sp_mitm_sb_t *sb, const char *host, const struct rule **out,
                          size_t cap);
bool sp_mitm__is_ip_literal(const char *host);
/* The TLS server context with the leaf certificate for host (cached per
 * handle), or NULL. */
SSL_CTX *sp_mitm__leaf_ctx(sp_mitm_sb_t *sb, const char *host);

#endif
