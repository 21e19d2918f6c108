/*
 * egress.h - the host side of sandboxes' outbound traffic: an HTTP proxy and a
 * DNS answerer behind each sandbox's agent channel, with per-sandbox rules
 * (core/egress/egress_policy.h) and an audit log.
 *
 * Folder: core/egress/ is guests' outbound traffic: proxy, DNS, policies, audit, team secrets and
 * credential injection (mitm). (ARCHITECTURE.md: the layers.)
 *
 * Guests have no network device. The agent (agent/egress.c) listens on
 * 127.0.0.1:SP_EGRESS_GUEST_PORT in the guest and on 127.0.0.1:53 for DNS,
 * and turns each connection into an EGRESS_OPEN stream and each query into a
 * DNS_QUERY stream (base/agentproto.h, "Egress"). This module:
 *
 *  - attaches to every sandbox's agent channel as its driver names it
 *    (sp_agentconn_set_sandbox): loads the sandbox's policy and team, sends
 *    EGRESS_CONFIG (proxy port, DNS on, HTTP(S)_PROXY / NO_PROXY for the
 *    guest's processes) after every HELLO, and takes the streams the agent
 *    opens;
 *  - parses the proxy request (core/egress/http1.h, the parser the credential
 *    relay uses too): CONNECT host:port, or a plain-HTTP request in
 *    absolute form (rewritten to origin form with "Connection: close"; one
 *    request per upstream connection; the URI host and the Host header must
 *    agree); anything else gets a 400 (or the status http1.h gives);
 *  - decides: the name first, then every address it resolves to (resolved
 *    once, off the loop thread, as loop work on SP_WORK_SHORT); the connection goes
 *    only to an address that passed, never to a name resolved again; a denial
 *    is an HTTP 403 with a one-line reason;
 *  - for CONNECT, peeks at the TLS ClientHello: a server name (SNI) that is
 *    not the CONNECT host is denied and the connection closed;
 *  - hands connections to destinations with credential rules to core/egress/mitm.h
 *    (when one is set): the CONNECT is answered, the upstream connected, and
 *    both ends given to a sp_mitm_conn_t;
 *  - relays bytes with backpressure both ways: guest bytes are granted back to
 *    the agent only once the upstream socket took them, and the upstream
 *    socket is read only as far as the agent's window allows, so memory per
 *    connection is bounded by one window each way;
 *  - answers DNS A/AAAA queries for allowed names with the resolved addresses
 *    that pass the address rules (NXDOMAIN for denied names; other types get
 *    an empty answer for allowed names);
 *  - writes audit rows (egress_log) in batches, and trims each sandbox's to the
 *    newest SP_EGRESS_LOG_KEEP rows.
 *
 * Limits per sandbox: SP_EGRESS_MAX_CONNS proxy connections and
 * SP_EGRESS_MAX_DNS queries at once (beyond: the guest's connection is reset / SERVFAIL),
 * a memory budget (core/egress/egmem.h) that every byte the guest can make the host hold is
 * charged to before it is granted, initial windows included: SP_EGRESS_MAX_BUFFERED per
 * sandbox, its share of the global memory_limit (limit / sandboxes attached) when that is
 * less, the global limit in all (beyond: a new connection is answered 503, an open one waits
 * for credit until memory comes back), a request head
 * of at most SP_EGRESS_MAX_HEAD bytes within SP_EGRESS_HEAD_TIMEOUT_MS, and
 * a connect timeout. Everything runs on the loop; only getaddrinfo runs on
 * the loop's worker threads (sp_loop_work, lane SP_WORK_SHORT), at most
 * resolver_threads lookups at once and 4 per sandbox.
 *
 * Policy changes (PUT /v1/sandboxes/{id}/egress/policy) apply to new
 * connections and queries: the process that wrote them calls
 * sp_egress_policy_changed; other processes hear NOTIFY space_egress (payload:
 * sandbox ID) and reload.
 */
#ifndef SP_EGRESS_H
#define SP_EGRESS_H

#include <jansson.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <sys/socket.h>

#include "base/err.h"
#include "loop/loop.h"
#include "core/store/store.h"

typedef struct sp_egress sp_egress_t;
struct sp_mitm;

#define SP_EGRESS_GUEST_PORT      3128        /* the proxy port inside every guest */
#define SP_EGRESS_MAX_CONNS       2048        /* proxy connections per sandbox at once */
#define SP_EGRESS_MAX_DNS         128         /* DNS queries per sandbox at once */
#define SP_EGRESS_MAX_HEAD        16384       /* bytes of a proxy request head */
#define SP_EGRESS_MAX_BUFFERED    (64u << 20) /* egress memory per sandbox at most (egmem.h) */
#define SP_EGRESS_HEAD_TIMEOUT_MS 30000
#define SP_EGRESS_LOG_KEEP        10000 /* audit rows kept per sandbox */
#define SP_EGRESS_NOTIFY          "space_egress"

/* The initial window of a proxy connection's stream when the agent takes it from
 * EGRESS_CONFIG (SP_AP_CAP_EGRESS_WINDOW): room for a request head; the proxy raises it to
 * SP_AP_INITIAL_WINDOW once the connection is allowed and connected, as memory allows. */
#define SP_EGRESS_OPEN_WINDOW SP_EGRESS_MAX_HEAD

typedef struct {
    int resolver_threads;        /* lookups on the work lane at once; 0: 8 (4 per sandbox) */
    uint64_t memory_limit;       /* bytes all sandboxes' egress may hold (core/egress/egmem.h);
                                    0: a sixteenth of the host's memory, at least 256 MiB */
    uint32_t connect_timeout_ms; /* 0: 10000 */
    uint32_t log_flush_ms;       /* 0: 250 (audit batching) */
} sp_egress_opts_t;

/* store is borrowed and outlives eg. Registers the agentconn hook (sp_agentconn_set_hook)
 * and LISTENs on SP_EGRESS_NOTIFY. NULL with err when memory is short or LISTEN fails. */
sp_egress_t *sp_egress_create(sp_loop_t *loop, sp_store_t *store, const sp_egress_opts_t *o,
                              sp_err_t *err);
/* Closes every proxied connection (the guest sees them reset), detaches from every channel,
 * flushes nothing more, cancels its lookups. NULL does nothing. Lookups already running
 * (getaddrinfo cannot be interrupted) and store queries in flight keep the memory until they
 * come back to the loop, or until sp_loop_destroy. */
void sp_egress_destroy(sp_egress_t *eg);

/* Credential injection (core/egress/mitm.h), borrowed; NULL (the default): connections are only
 * ever passed through. Applies to sandboxes attached after the call. */
void sp_egress_set_mitm(sp_egress_t *eg, struct sp_mitm *m);

/* The sandbox's policy changed in the database: reload it if this process serves it (NULL:
 * every sandbox). */
void sp_egress_policy_changed(sp_egress_t *eg, const char *sandbox_id);
/* The same, with the new policy (an object in normal form, as stored): applied at once, so the
 * next connection follows it without a database round trip. */
void sp_egress_policy_set(sp_egress_t *eg, const char *sandbox_id, const json_t *policy);

/* A VM that is not a sandbox (a template build's builder, core/control/tmpl.h) has no row to
 * read its policy from: its owner gives the policy here before the VM starts and clears it
 * when the VM's work is over. policy: an object in a sandbox's egress form
 * (core/egress/egress_policy.h), or NULL for the default (the internet); team: whose VM it is
 * (audit rows). A VM that has neither a row nor a preset reaches nothing, and one whose preset
 * is cleared is denied everything at once. Setting a preset again replaces it. -1 with err
 * (SP_EINVAL) for a policy that does not parse, or out of memory. */
int sp_egress_preset(sp_egress_t *eg, const char *vm_id, const char *team, const json_t *policy,
                     sp_err_t *err);
void sp_egress_preset_clear(sp_egress_t *eg, const char *vm_id);

typedef struct {
    unsigned sandboxes;            /* attached */
    unsigned conns;                /* proxy connections open */
    unsigned dns;                  /* DNS queries in flight */
    unsigned resolving;            /* lookups waiting, queued or running */
    uint64_t bytes_up, bytes_down; /* relayed since start */
    uint64_t allowed, denied;      /* decisions since start (connections and queries) */
    uint64_t mem_used, mem_limit;  /* the memory budget (egmem.h): charged now, the limit */
    uint64_t mem_peak;             /* the most charged at once since start */
    uint64_t mem_refused;          /* charges refused (a connection refused or waiting) */
    unsigned mem_waiting;          /* connections waiting for credit now */
} sp_egress_stats_t;

void sp_egress_stats(const sp_egress_t *eg, sp_egress_stats_t *out);

/* ---- test hooks (spaced-test only; the shipped spaced never sets them) ---- */

/*
 * A resolver consulted before getaddrinfo, on a worker thread (so it must be thread-safe):
 * fills up to max addresses (port 0) for name and returns how many, 0 to fall through to
 * getaddrinfo, or -1 for "no such name".
 */
typedef int (*sp_egress_resolve_fn)(const char *name, struct sockaddr_storage *out, int max);

typedef struct {
    sp_egress_resolve_fn resolve; /* NULL: getaddrinfo only */
    uint16_t guest_port;          /* 0: SP_EGRESS_GUEST_PORT */
    bool no_dns;                  /* do not ask the agent to answer DNS */
} sp_egress_test_hooks_t;

/* Process-wide; set before sp_egress_create. */
void sp_egress_set_test_hooks(const sp_egress_test_hooks_t *h);

#endif
