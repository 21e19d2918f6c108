/*
 * egress_int.h - what the files of the egress module (core/egress/egress.h)
 * share:
 *
 *   egress.c   lifetime, attaching to sandboxes' channels, policies, config,
 * notifications proxy.c    proxy connections (EGRESS_OPEN streams): request,
 * decision, relay, mitm dns.c      DNS queries (DNS_QUERY streams) resolve.c
 * name lookups as loop work (SP_WORK_SHORT), bounded per sandbox audit.c audit
 * rows and their batched INSERTs
 *
 * Everything here runs on the loop thread, except sp_egress__hooks.resolve (a
 * worker).
 */
#ifndef SP_EGRESS_INT_H
#define SP_EGRESS_INT_H

#include <netdb.h>
#include <stdbool.h>
#include <stdint.h>
#include <sys/socket.h>

#include "base/ids.h"
#include "core/channel/agentconn.h"
#include "core/egress/egmem.h"
#include "core/egress/egress.h"
#include "core/egress/egress_policy.h"

#define SP_EGRESS__MAX_ADDRS    16
#define SP_EGRESS__SB_RESOLVING 4 /* lookups per sandbox on the work lane at once */

/* The test hooks (sp_egress_set_test_hooks); set before any egress exists. */
extern sp_egress_test_hooks_t sp_egress__hooks;

struct sb;
struct pconn;
struct dnsq;

/* One name to resolve. Fields above `rc` are written on the loop before the job
 * is queued; rc, n and addrs by the worker; owner only on the loop (cancel:
 * owner = NULL). */
struct rjob {
    struct rjob *next;                /* in sb->rq while waiting for a place */
    struct rjob *run_prev, *run_next; /* in eg->running while on the lane */
    struct sb *sb;                    /* whose lookup: counted in sb->resolving while on the lane */
    sp_work_t *work;
    char name[SP_EGP_NAME_MAX + 1];
    int family; /* AF_UNSPEC, AF_INET or AF_INET6 */
    int rc;     /* 0, or an EAI_* code */
    int n;
    struct sockaddr_storage addrs[SP_EGRESS__MAX_ADDRS];
    void (*done)(void *owner, struct rjob *j);
    void *owner;
};

struct logrow;

/* A VM's policy given by its owner, not read from a row (sp_egress_preset). */
struct preset {
    struct preset *next;
    char id[65];
    char team[SP_ID_LEN + 1];
    json_t *policy; /* NULL: the default */
};

struct sp_egress {
    sp_loop_t *loop;
    sp_store_t *store;
    sp_egress_opts_t o;
    struct sp_mitm *mitm;
    struct sb *sbs;
    struct preset *presets;
    sp_egress_stats_t st;

    /* proxy.c: the memory budget (egmem.h); sandboxes with connections waiting for credit
     * that the global limit refused, served in turn as memory comes back */
    sp_egmem_t mem;
    struct sb *gwait, *gwait_tail;

    /* resolve.c: jobs on the work lane (at most o.resolver_threads at once) */
    struct rjob *running;
    int nrunning;

    /* audit.c */
    struct logrow *rows;
    size_t nrows;
    bool flushing;
    sp_timer_t flush;
    uint64_t last_gc_ms;
    unsigned long long dropped;

    sp_timer_t host_addrs; /* egress.c: re-reads the host's addresses (always denied) */

    /* store queries and lookups in flight; after destroy (dying) the last one
     * frees us */
    int inflight;
    bool dying;

    uint8_t rbuf[SP_AP_MAX_DATA]; /* proxy.c: upstream reads, one at a time */
};

struct sb {
    sp_egress_t *eg;
    struct sb *prev, *next;
    char id[65];
    char team[SP_ID_LEN + 1];
    sp_agentconn_t *conn; /* NULL after GONE */
    sp_agentconn_listener_t *lis;
    sp_agentstream_t *cfg; /* EGRESS_CONFIG in flight */
    sp_egp_t *policy;      /* NULL until loaded */
    bool loading, reload, dead;
    sp_timer_t retry;
    struct pconn *conns;
    unsigned nconns;
    struct dnsq *dnsqs;
    unsigned ndns;
    unsigned log_since_trim;
    bool trim;
    sp_egmem_sb_t mem;          /* its charges (proxy.c) */
    struct pconn *wq, *wq_tail; /* its connections waiting for credit, oldest first */
    struct sb *gwait_next;
    bool in_gwait;
    bool small_window; /* its agent applied EGRESS_CONFIG.WINDOW this session (egress.c) */
    struct sp_mitm_sb *mitm;
    bool mitm_opening;
    bool mitm_stale;           /* renamed while the handle was being opened: reopen it */
    unsigned resolving;        /* its jobs on the work lane */
    struct rjob *rq, *rq_tail; /* its jobs waiting for one of those places */
};

/* ---- egress.c ---- */

/* The policy and credential handle are there: connections and queries can be
 * decided. */
bool sp_egress__sb_ready(const struct sb *sb);
/* Frees a dead sandbox once nothing refers to it any more. */
void sp_egress__sb_maybe_free(struct sb *sb);
/* Frees a destroyed egress once nothing is in flight. */
void sp_egress__maybe_free(sp_egress_t *eg);

/* ---- proxy.c ---- */

/* An EGRESS_OPEN stream: takes it (0, *cbs and *sarg set) or refuses it (-1).
 */
int sp_egress__proxy_accept(struct sb *sb, sp_agentstream_t *s, sp_agentstream_cbs_t *cbs,
                            void **sarg);
/* The sandbox is ready: decides the connections that waited for it. */
void sp_egress__proxy_policy_ready(struct sb *sb);
/* Closes every proxy connection of the sandbox (the guest sees them fail). */
void sp_egress__proxy_close_all(struct sb *sb);
/* Grants what its connections wait for, as far as the memory budget now allows. */
void sp_egress__proxy_mem_kick(struct sb *sb);

/* ---- dns.c ---- */

/* A DNS_QUERY stream with its payload: as sp_egress__proxy_accept. */
int sp_egress__dns_accept(struct sb *sb, sp_agentstream_t *s, const uint8_t *payload, size_t len,
                          sp_agentstream_cbs_t *cbs, void **sarg);
void sp_egress__dns_policy_ready(struct sb *sb);
/* Drops every query of the sandbox unanswered (the agent answers SERVFAIL). */
void sp_egress__dns_close_all(struct sb *sb);

/* ---- resolve.c ---- */

/* Queues a lookup; done(owner, job) runs on the loop later (never inside this
 * call), unless sp_egress__resolve_cancel came first. NULL when memory is
 * short. */
struct rjob *sp_egress__resolve(struct sb *sb, const char *name, int family,
                                void (*done)(void *, struct rjob *), void *owner);
/* The owner lets go: done will not be called; the job is freed when it comes
 * back. */
void sp_egress__resolve_cancel(struct rjob *j);
/* Moves waiting lookups onto the lane while there are places; frees cancelled
 * ones. */
void sp_egress__resolve_dispatch(struct sb *sb);
/* A lookup's EAI_* code as text for a guest. */
const char *sp_egress__resolve_error(int rc);
/* sp_egress_destroy: cancels every lookup on the lane (their completions still
 * come, and free them). */
void sp_egress__resolve_stop(sp_egress_t *eg);

/* ---- audit.c ---- */

/* 0, or -1 when memory is short. */
int sp_egress__audit_init(sp_egress_t *eg);
void sp_egress__audit_stop(sp_egress_t *eg);
void sp_egress__audit_free(sp_egress_t *eg);
/* Counts a decision and queues an audit row (address and reason may be NULL).
 */
void sp_egress__log(struct sb *sb, const char *kind, const char *host, int port,
                    const char *address, bool allowed, const char *reason, uint64_t up,
                    uint64_t down, uint64_t dur_ms);

#endif
