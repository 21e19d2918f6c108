/*
 * egress.c - the host side of guests' outbound traffic (core/egress/egress.h).
 *
 * Owns: one `struct sb` per attached agent channel (policy, team, open proxy
 * connections and DNS queries), one `struct pconn` per proxied connection
 * (guest bytes not yet forwarded, the upstream socket), the resolver threads
 * and their queues, and the audit rows not yet written. Does not own the
 * agent channels (the runtime driver does: we hear SP_AGENTCONN_GONE), the
 * store, or a mitm handle's connections once handed over (core/egress/mitm.h).
 *
 * Memory per connection is bounded by the windows: guest bytes sit in pc->g
 * until the upstream socket takes them and only then are granted back to the
 * agent (at most one window, SP_AP_INITIAL_WINDOW, is ever outstanding), and
 * the upstream socket is read only as far as the agent's credit goes, into
 * one shared buffer, so nothing waits on the host in that direction.
 *
 * Lifetimes: a pconn is freed by pc_close, which may run inside its stream's
 * callbacks (the stream is ended there; agentconn frees it when the callback
 * returns) or its watch's callback (sp_watch_destroy is safe there); callers
 * return at once after it. A sb lives from the agentconn hook to GONE, and
 * after GONE until its store query or mitm open has called back. The egress
 * object outlives sp_egress_destroy while store queries are in flight; their
 * callbacks free it.
 */
#include "core/egress/egress.h"

#include <arpa/inet.h>
#include <ctype.h>
#include <errno.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/eventfd.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include "core/channel/agentconn.h"
#include "core/egress/egress_policy.h"
#include "base/ids.h"
#include "base/log.h"
#include "core/egress/mitm.h"

#define MAX_ADDRS       16
#define G_INIT          4096                /* guest buffer, grows to one window */
#define GRANT_BATCH     (64u * 1024u)       /* credit given back in steps of this much */
#define READS_PER_TURN  4                   /* upstream reads per readiness callback */
#define LOG_MAX_PENDING 4000                /* audit rows held; beyond: dropped (counted) */
#define LOG_BATCH       500                 /* rows per INSERT */
#define TRIM_EVERY      500                 /* rows per sandbox between trims */
#define GC_EVERY_MS     (10u * 60u * 1000u) /* audit rows of long-deleted sandboxes */
#define POLICY_RETRY_MS 1000
#define DNS_WAIT_MS     4000 /* answer SERVFAIL before the agent's 5 s */
#define DNS_TTL         30   /* seconds, in answers */
#define SB_RESOLVING    4    /* lookups per sandbox on the resolver threads at once */

/* ---- test hooks ---- */

static sp_egress_test_hooks_t test_hooks;

void sp_egress_set_test_hooks(const sp_egress_test_hooks_t *h)
{
    if (h != NULL)
        test_hooks = *h;
    else
        memset(&test_hooks, 0, sizeof(test_hooks));
}

/* ---- types ---- */

struct sb;
struct pconn;
struct dnsq;

/* One name to resolve. Fields above `rc` are written on the loop before queueing; rc and
 * addrs by the resolver thread; owner only on the loop (cancel: owner = NULL). */
struct rjob {
    struct rjob *next;
    struct sb *sb; /* whose lookup: counted in sb->resolving while on the threads */
    char name[SP_EGP_NAME_MAX + 1];
    int family; /* AF_UNSPEC, AF_INET or AF_INET6 */
    int rc;     /* 0, or an EAI_* code */
    int n;
    struct sockaddr_storage addrs[MAX_ADDRS];
    void (*done)(void *owner, struct rjob *j);
    void *owner;
};

struct logrow {
    char sandbox[65];
    char team[SP_ID_LEN + 1];
    long long at_ms;
    char kind[8];
    char host[SP_EGP_NAME_MAX + 8];
    int port;
    char address[72];
    bool allowed;
    char reason[160];
    unsigned long long up, down;
    int dur_ms;
};

struct sp_egress {
    sp_loop_t *loop;
    sp_store_t *store;
    sp_egress_opts_t o;
    struct sp_mitm *mitm;
    struct sb *sbs;
    sp_egress_stats_t st;

    /* resolver */
    pthread_t *threads;
    int nthreads;
    pthread_mutex_t mu;
    pthread_cond_t cv;
    struct rjob *q_head, *q_tail;
    struct rjob *d_head, *d_tail;
    bool stop;
    int efd;
    sp_watch_t *ew;

    /* audit */
    struct logrow *rows;
    size_t nrows;
    bool flushing;
    sp_timer_t flush;
    uint64_t last_gc_ms;
    unsigned long long dropped;

    /* store queries in flight; after destroy (dying) the last one frees us */
    int inflight;
    bool dying;

    uint8_t rbuf[SP_AP_MAX_DATA];
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
    size_t buffered; /* guest bytes held in its connections, not yet taken upstream */
    bool held;       /* credit is being held back (buffered reached the limit) */
    struct sp_mitm_sb *mitm;
    bool mitm_opening;
    bool mitm_stale; /* renamed while the handle was being opened: reopen it */
    unsigned resolving;        /* its jobs on the resolver threads */
    struct rjob *rq, *rq_tail; /* its jobs waiting for one of those SB_RESOLVING places */
};

enum phase {
    PH_HEAD = 0, /* reading the request head */
    PH_WAIT,     /* head read; the policy (or credential handle) is still loading */
    PH_RESOLVE,
    PH_CONNECT,
    PH_SNI,   /* CONNECT answered; looking at the first guest bytes */
    PH_RELAY, /* bytes both ways */
    PH_MITM,  /* handed to core/egress/mitm.h */
};

enum body { BODY_NONE = 0, BODY_LENGTH, BODY_CHUNKED, BODY_RAW };

/* Finds where a chunked body ends, byte by byte (the bytes are forwarded unchanged). */
struct chunkscan {
    int state;
    uint64_t size;
    bool done, bad;
};

struct pconn {
    struct sb *sb;
    struct pconn *prev, *next;
    sp_agentstream_t *st; /* NULL once ended or failed */
    enum phase phase;
    sp_timer_t timer;
    uint64_t t0;

    /* guest bytes received and not yet consumed (= not yet granted back) */
    uint8_t *g;
    size_t g_off, g_len, g_cap;
    size_t grant_pending;
    bool g_eof;

    /* the request */
    bool connect, upgrade;
    char host[SP_EGP_NAME_MAX + 8]; /* normal form: name, or address text */
    bool host_is_addr;
    sp_egp_addr_t lit;
    uint16_t port;
    char *head; /* what goes upstream first (plain HTTP: the rewritten head) */
    size_t head_len, head_off;
    char *orig_head; /* the guest's head, for a mitm handover of plain HTTP */
    size_t orig_len;
    enum body body;
    uint64_t body_left;
    size_t fwd_ok; /* bytes at g_off known to belong to the body */
    struct chunkscan cs;

    /* deciding and connecting */
    bool by_name;
    struct rjob *job;
    sp_egp_addr_t addrs[MAX_ADDRS];
    int naddrs, ai;
    int last_errno;

    /* upstream */
    int fd;
    sp_watch_t *w;
    int wev;
    bool up_wr_shut, up_rd_eof;

    struct sp_mitm_conn *mitm;

    /* audit */
    bool log;
    bool allowed;
    const char *kind;
    char addr_text[72];
    char reason[160];
    uint64_t up_bytes, down_bytes;
};

struct dnsq {
    struct sb *sb;
    struct dnsq *prev, *next;
    sp_agentstream_t *st;
    uint8_t msg[512 + 16]; /* header + question of the query */
    size_t msg_len;
    uint16_t qtype;
    char name[SP_EGP_NAME_MAX + 1];
    bool by_name;
    struct rjob *job;
    sp_timer_t timer;
    bool waiting;
};

static void sb_maybe_free(struct sb *sb);
static void sb_dispatch(struct sb *sb);
static void pc_decide(struct pconn *pc);
static void dns_decide(struct dnsq *q);
static void egress_maybe_free(sp_egress_t *eg);

static uint64_t wall_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    return (uint64_t)ts.tv_sec * 1000u + (uint64_t)ts.tv_nsec / 1000000u;
}

/* ---- resolver threads ---- */

static int resolve_now(const char *name, int family, struct sockaddr_storage *out, int max, int *n)
{
    *n = 0;
    if (test_hooks.resolve != NULL) {
        struct sockaddr_storage tmp[MAX_ADDRS];
        int k = test_hooks.resolve(name, tmp, MAX_ADDRS);
        if (k < 0)
            return EAI_NONAME;
        if (k > 0) {
            for (int i = 0; i < k && i < MAX_ADDRS; i++)
                if ((family == AF_UNSPEC || tmp[i].ss_family == family) && *n < max)
                    out[(*n)++] = tmp[i];
            return *n > 0 ? 0 : EAI_NODATA;
        }
    }
    struct addrinfo hints = {.ai_family = family, .ai_socktype = SOCK_STREAM};
    struct addrinfo *res = NULL;
    int rc = getaddrinfo(name, NULL, &hints, &res);
    if (rc != 0)
        return rc;
    for (struct addrinfo *a = res; a != NULL && *n < max; a = a->ai_next) {
        if (a->ai_family != AF_INET && a->ai_family != AF_INET6)
            continue;
        bool dup = false;
        for (int i = 0; i < *n && !dup; i++)
            dup = memcmp(&out[i], a->ai_addr, a->ai_addrlen) == 0;
        if (!dup) {
            memset(&out[*n], 0, sizeof(out[*n]));
            memcpy(&out[*n], a->ai_addr, a->ai_addrlen);
            (*n)++;
        }
    }
    freeaddrinfo(res);
    return *n > 0 ? 0 : EAI_NODATA;
}

static void *resolver_main(void *arg)
{
    sp_egress_t *eg = arg;
    pthread_mutex_lock(&eg->mu);
    for (;;) {
        while (!eg->stop && eg->q_head == NULL)
            pthread_cond_wait(&eg->cv, &eg->mu);
        if (eg->stop)
            break;
        struct rjob *j = eg->q_head;
        eg->q_head = j->next;
        if (eg->q_head == NULL)
            eg->q_tail = NULL;
        pthread_mutex_unlock(&eg->mu);
        j->rc = resolve_now(j->name, j->family, j->addrs, MAX_ADDRS, &j->n);
        pthread_mutex_lock(&eg->mu);
        j->next = NULL;
        if (eg->d_tail)
            eg->d_tail->next = j;
        else
            eg->d_head = j;
        eg->d_tail = j;
        uint64_t one = 1;
        if (write(eg->efd, &one, sizeof(one)) < 0) {
            /* the counter cannot overflow in practice; the loop drains the queue anyway */
        }
    }
    pthread_mutex_unlock(&eg->mu);
    return NULL;
}

static void on_resolved(sp_watch_t *w, int events, void *arg)
{
    sp_egress_t *eg = arg;
    uint64_t v;
    while (read(eg->efd, &v, sizeof(v)) > 0) {
    }
    pthread_mutex_lock(&eg->mu);
    struct rjob *list = eg->d_head;
    eg->d_head = eg->d_tail = NULL;
    pthread_mutex_unlock(&eg->mu);
    while (list != NULL) {
        struct rjob *j = list;
        list = j->next;
        struct sb *sb = j->sb;
        eg->st.resolving--;
        /* sb->resolving still counts j here, so done() cannot free sb under us. */
        if (j->owner != NULL)
            j->done(j->owner, j);
        free(j);
        sb->resolving--;
        sb_dispatch(sb);
        sb_maybe_free(sb);
    }
}

static void rq_submit(sp_egress_t *eg, struct rjob *j)
{
    j->next = NULL;
    pthread_mutex_lock(&eg->mu);
    if (eg->q_tail)
        eg->q_tail->next = j;
    else
        eg->q_head = j;
    eg->q_tail = j;
    pthread_cond_signal(&eg->cv);
    pthread_mutex_unlock(&eg->mu);
}

/* Moves the sandbox's waiting lookups onto the threads while it has places; drops the ones
 * whose owner gave up. A sandbox with slow names thus holds at most SB_RESOLVING threads. */
static void sb_dispatch(struct sb *sb)
{
    while (sb->rq != NULL && sb->resolving < SB_RESOLVING) {
        struct rjob *j = sb->rq;
        sb->rq = j->next;
        if (sb->rq == NULL)
            sb->rq_tail = NULL;
        if (j->owner == NULL) {
            sb->eg->st.resolving--;
            free(j);
            continue;
        }
        sb->resolving++;
        rq_submit(sb->eg, j);
    }
}

/* Queues a lookup; done(owner, job) runs on the loop later (never inside this call). */
static struct rjob *resolve_start(struct sb *sb, const char *name, int family,
                                  void (*done)(void *, struct rjob *), void *owner)
{
    struct rjob *j = calloc(1, sizeof(*j));
    if (j == NULL)
        return NULL;
    snprintf(j->name, sizeof(j->name), "%s", name);
    j->sb = sb;
    j->family = family;
    j->done = done;
    j->owner = owner;
    sb->eg->st.resolving++;
    if (sb->rq_tail)
        sb->rq_tail->next = j;
    else
        sb->rq = j;
    sb->rq_tail = j;
    sb_dispatch(sb);
    return j;
}

static const char *resolve_error(int rc)
{
    switch (rc) {
    case EAI_NONAME:
#ifdef EAI_NODATA
    case EAI_NODATA:
#endif
        return "no such host";
    case EAI_AGAIN:
        return "name lookup failed temporarily";
    default:
        return "name lookup failed";
    }
}

/* ---- audit ---- */

static void log_row(struct sb *sb, const char *kind, const char *host, int port,
                    const char *address, bool allowed, const char *reason, uint64_t up,
                    uint64_t down, uint64_t dur_ms)
{
    sp_egress_t *eg = sb->eg;
    if (allowed)
        eg->st.allowed++;
    else
        eg->st.denied++;
    if (eg->rows == NULL || sb->team[0] == '\0')
        return;
    if (eg->nrows >= LOG_MAX_PENDING) {
        if (eg->dropped++ % 1000 == 0)
            sp_log(SP_LOG_WARN, "egress", "audit rows dropped (database slow) total=%llu",
                   eg->dropped);
        return;
    }
    struct logrow *r = &eg->rows[eg->nrows++];
    snprintf(r->sandbox, sizeof(r->sandbox), "%s", sb->id);
    snprintf(r->team, sizeof(r->team), "%s", sb->team);
    r->at_ms = (long long)wall_ms();
    snprintf(r->kind, sizeof(r->kind), "%s", kind);
    snprintf(r->host, sizeof(r->host), "%s", host);
    r->port = port;
    snprintf(r->address, sizeof(r->address), "%s", address ? address : "");
    r->allowed = allowed;
    snprintf(r->reason, sizeof(r->reason), "%s", reason ? reason : "");
    r->up = up;
    r->down = down;
    r->dur_ms = dur_ms > 86400000u ? 86400000 : (int)dur_ms;
    if (++sb->log_since_trim >= TRIM_EVERY) {
        sb->log_since_trim = 0;
        sb->trim = true;
    }
    if (!sp_timer_armed(&eg->flush) && !eg->flushing)
        sp_timer_start(&eg->flush, eg->o.log_flush_ms);
}

struct sbuf {
    char *p;
    size_t len, cap;
    bool oom;
};

static void sb_put(struct sbuf *b, const char *s, size_t n)
{
    if (b->oom)
        return;
    if (b->len + n + 1 > b->cap) {
        size_t cap = b->cap ? b->cap : 4096;
        while (b->len + n + 1 > cap)
            cap *= 2;
        char *p = realloc(b->p, cap);
        if (p == NULL) {
            b->oom = true;
            return;
        }
        b->p = p;
        b->cap = cap;
    }
    memcpy(b->p + b->len, s, n);
    b->len += n;
    b->p[b->len] = '\0';
}

/* Appends one element to a PostgreSQL array literal being built ("{" already there). */
static void arr_str(struct sbuf *b, const char *s)
{
    if (b->len > 1)
        sb_put(b, ",", 1);
    sb_put(b, "\"", 1);
    for (; *s; s++) {
        if (*s == '"' || *s == '\\')
            sb_put(b, "\\", 1);
        sb_put(b, s, 1);
    }
    sb_put(b, "\"", 1);
}

static void arr_num(struct sbuf *b, long long v)
{
    char t[32];
    int n = snprintf(t, sizeof(t), "%s%lld", b->len > 1 ? "," : "", v);
    sb_put(b, t, (size_t)n);
}

static void on_flushed(void *arg, PGresult *res, const sp_err_t *err)
{
    sp_egress_t *eg = arg;
    eg->inflight--;
    eg->flushing = false;
    if (eg->dying) {
        egress_maybe_free(eg);
        return;
    }
    if (err != NULL)
        sp_log(SP_LOG_WARN, "egress", "audit write failed err=%s", err->msg);
    if (eg->nrows > 0 && !sp_timer_armed(&eg->flush))
        sp_timer_start(&eg->flush, eg->o.log_flush_ms);
}

static void on_flush(sp_timer_t *t, void *arg)
{
    sp_egress_t *eg = arg;
    if (eg->flushing || eg->nrows == 0)
        return;
    size_t n = eg->nrows < LOG_BATCH ? eg->nrows : LOG_BATCH;
    enum { NCOL = 13 };
    struct sbuf cols[NCOL];
    memset(cols, 0, sizeof(cols));
    for (int c = 0; c < NCOL; c++)
        sb_put(&cols[c], "{", 1);
    for (size_t i = 0; i < n; i++) {
        const struct logrow *r = &eg->rows[i];
        arr_str(&cols[0], r->sandbox);
        arr_str(&cols[1], r->team);
        arr_num(&cols[2], r->at_ms);
        arr_str(&cols[3], r->kind);
        arr_str(&cols[4], r->host);
        arr_num(&cols[5], r->port);
        arr_str(&cols[6], r->address);
        arr_str(&cols[7], r->allowed ? "t" : "f");
        arr_str(&cols[8], r->reason);
        arr_num(&cols[9], (long long)r->up);
        arr_num(&cols[10], (long long)r->down);
        arr_num(&cols[11], r->dur_ms);
    }
    /* Sandboxes that wrote TRIM_EVERY rows since their last trim. */
    for (struct sb *sb = eg->sbs; sb != NULL; sb = sb->next)
        if (sb->trim) {
            sb->trim = false;
            arr_str(&cols[12], sb->id);
        }
    bool gc = eg->last_gc_ms == 0 || sp_loop_now_ms(eg->loop) - eg->last_gc_ms >= GC_EVERY_MS;
    if (gc)
        eg->last_gc_ms = sp_loop_now_ms(eg->loop);
    bool oom = false;
    for (int c = 0; c < NCOL; c++) {
        sb_put(&cols[c], "}", 1);
        oom = oom || cols[c].oom;
    }
    if (!oom) {
        const char *p[NCOL + 2];
        for (int c = 0; c < NCOL; c++)
            p[c] = cols[c].p;
        char keep[16];
        snprintf(keep, sizeof(keep), "%d", SP_EGRESS_LOG_KEEP);
        p[NCOL] = gc ? "true" : "false";
        p[NCOL + 1] = keep;
        sp_err_t e;
        /* The trim and the clean-up see the table as it was before this INSERT, so a trimmed
         * sandbox keeps SP_EGRESS_LOG_KEEP older rows plus this batch. */
        int rc = sp_store_query(
            eg->store,
            "WITH ins AS (INSERT INTO egress_log (sandbox_id, team_id, at, kind, host, port,"
            "   address, allowed, reason, bytes_up, bytes_down, duration_ms)"
            "  SELECT u.s, u.t, to_timestamp(u.a / 1000.0), u.k, u.h, u.p, u.ad, u.al, u.r,"
            "   u.bu, u.bd, u.d FROM unnest($1::text[], $2::text[], $3::bigint[], $4::text[],"
            "   $5::text[], $6::int[], $7::text[], $8::bool[], $9::text[], $10::bigint[],"
            "   $11::bigint[], $12::int[]) AS u(s, t, a, k, h, p, ad, al, r, bu, bd, d)"
            "  RETURNING 1),"
            " tr AS (DELETE FROM egress_log e USING (SELECT x.sid, (SELECT l.id FROM egress_log l"
            "   WHERE l.sandbox_id = x.sid ORDER BY l.id DESC OFFSET $15::int LIMIT 1) AS cut"
            "   FROM unnest($13::text[]) AS x(sid)) c"
            "  WHERE e.sandbox_id = c.sid AND e.id <= c.cut RETURNING 1),"
            " gc AS (DELETE FROM egress_log e WHERE $14::bool AND e.sandbox_id IN"
            "  (SELECT s.id FROM sandboxes s WHERE s.observed_state = 'deleted'"
            "   AND s.updated_at < now() - interval '1 day') RETURNING 1)"
            " SELECT (SELECT count(*) FROM ins), (SELECT count(*) FROM tr),"
            "  (SELECT count(*) FROM gc)",
            NCOL + 2, p, on_flushed, eg, &e);
        if (rc == 0) {
            eg->flushing = true;
            eg->inflight++;
        } else {
            sp_log(SP_LOG_WARN, "egress", "audit write not sent err=%s", e.msg);
        }
    }
    for (int c = 0; c < NCOL; c++)
        free(cols[c].p);
    /* Rows are dropped from memory once handed to the store (or if it refused them): an
     * outage loses audit rows rather than growing without bound. */
    memmove(eg->rows, eg->rows + n, (eg->nrows - n) * sizeof(eg->rows[0]));
    eg->nrows -= n;
    if (!eg->flushing && eg->nrows > 0)
        sp_timer_start(&eg->flush, eg->o.log_flush_ms);
}

/* ---- guest stream helpers ---- */

/* Gives consumed bytes back to the agent as credit, in GRANT_BATCH steps. While the sandbox
 * holds SP_EGRESS_MAX_BUFFERED guest bytes that upstreams have not taken, credit is held
 * back (every connection still has what is left of its window). */
static void pc_grant(struct pconn *pc, size_t n, bool force)
{
    struct sb *sb = pc->sb;
    pc->grant_pending += n;
    if (sb->buffered >= SP_EGRESS_MAX_BUFFERED) {
        sb->held = true;
        return;
    }
    if (pc->st != NULL && pc->grant_pending > 0 && (force || pc->grant_pending >= GRANT_BATCH)) {
        sp_agentstream_grant(pc->st, (uint32_t)pc->grant_pending);
        pc->grant_pending = 0;
    }
}

/* The sandbox's buffered guest bytes went down by n: release held credit below half. */
static void sb_unbuffer(struct sb *sb, size_t n)
{
    sb->buffered -= n < sb->buffered ? n : sb->buffered;
    if (!sb->held || sb->buffered >= SP_EGRESS_MAX_BUFFERED / 2)
        return;
    sb->held = false;
    for (struct pconn *pc = sb->conns; pc != NULL; pc = pc->next)
        if (pc->grant_pending > 0)
            pc_grant(pc, 0, true);
}

/* Consumes n guest bytes at g_off. */
static void g_consume(struct pconn *pc, size_t n)
{
    pc->g_off += n;
    if (pc->g_off == pc->g_len)
        pc->g_off = pc->g_len = 0;
    sb_unbuffer(pc->sb, n);
    pc_grant(pc, n, false);
}

static int g_append(struct pconn *pc, const uint8_t *p, size_t n)
{
    if (pc->g_off > 0 && pc->g_cap - pc->g_len < n) {
        memmove(pc->g, pc->g + pc->g_off, pc->g_len - pc->g_off);
        pc->g_len -= pc->g_off;
        pc->g_off = 0;
    }
    if (pc->g_cap - pc->g_len < n) {
        size_t cap = pc->g_cap ? pc->g_cap : G_INIT;
        while (cap - pc->g_len < n)
            cap *= 2;
        /* The agent cannot send past the window: more than that is a bug, not a load. */
        if (cap > 2 * SP_AP_INITIAL_WINDOW + SP_AP_MAX_DATA)
            return -1;
        uint8_t *g = realloc(pc->g, cap);
        if (g == NULL)
            return -1;
        pc->g = g;
        pc->g_cap = cap;
    }
    memcpy(pc->g + pc->g_len, p, n);
    pc->g_len += n;
    pc->sb->buffered += n;
    return 0;
}

/* Sends bytes to the guest within its credit; returns how many went. */
static size_t pc_to_guest(struct pconn *pc, const uint8_t *p, size_t n)
{
    size_t sent = 0;
    while (pc->st != NULL && sent < n) {
        size_t cr = sp_agentstream_credit(pc->st);
        size_t k = n - sent;
        if (k > cr)
            k = cr;
        if (k > SP_AP_MAX_DATA)
            k = SP_AP_MAX_DATA;
        if (k == 0)
            break;
        if (sp_agentstream_send(pc->st, SP_AP_T_DATA, p + sent, k) != 1)
            break;
        sent += k;
    }
    pc->down_bytes += sent;
    pc->sb->eg->st.bytes_down += sent;
    return sent;
}

/* ---- closing ---- */

enum close_mode { CLOSE_OK, CLOSE_ERROR, CLOSE_SILENT };

static void pc_close(struct pconn *pc, enum close_mode mode, const char *why)
{
    struct sb *sb = pc->sb;
    sp_egress_t *eg = sb->eg;
    if (pc->job != NULL) {
        pc->job->owner = NULL;
        pc->job = NULL;
    }
    sp_timer_stop(&pc->timer);
    sp_watch_destroy(pc->w);
    pc->w = NULL;
    if (pc->fd >= 0)
        close(pc->fd);
    pc->fd = -1;
    if (pc->mitm != NULL) {
        struct sp_mitm_conn *m = pc->mitm;
        pc->mitm = NULL;
        sp_mitm_conn_destroy(m);
    }
    if (pc->st != NULL) {
        sp_agentstream_t *st = pc->st;
        pc->st = NULL;
        if (mode == CLOSE_OK) {
            sp_agentstream_end(st, SP_AP_T_OK, NULL, 0);
        } else {
            uint8_t buf[192];
            sp_ap_writer_t w;
            sp_ap_writer_init(&w, buf, sizeof(buf));
            sp_ap_put_u32(&w, SP_AP_K_CODE, SP_AP_E_IO);
            sp_ap_put_str(&w, SP_AP_K_MSG, why ? why : "connection failed");
            sp_agentstream_end(st, SP_AP_T_ERROR, w.overflow ? NULL : buf, w.overflow ? 0 : w.len);
        }
    }
    if (pc->log) {
        if (pc->allowed && why != NULL && pc->reason[0] == '\0' && mode == CLOSE_ERROR)
            snprintf(pc->reason, sizeof(pc->reason), "%s", why);
        log_row(sb, pc->kind ? pc->kind : "http", pc->host, pc->port, pc->addr_text, pc->allowed,
                pc->reason, pc->up_bytes, pc->down_bytes, sp_loop_now_ms(eg->loop) - pc->t0);
    }
    if (pc->prev)
        pc->prev->next = pc->next;
    else
        sb->conns = pc->next;
    if (pc->next)
        pc->next->prev = pc->prev;
    sb->nconns--;
    eg->st.conns--;
    sb_unbuffer(sb, pc->g_len - pc->g_off);
    free(pc->g);
    free(pc->head);
    if (pc->orig_head != NULL)
        memset(pc->orig_head, 0, pc->orig_len);
    free(pc->orig_head);
    free(pc);
    sb_maybe_free(sb);
}

/* Answers the guest with an HTTP error (status line, one-line reason) and closes. */
static void pc_respond(struct pconn *pc, int status, const char *why)
{
    const char *text = sp_mitm_http_reason(status);
    char body[256], msg[512];
    int bl = snprintf(body, sizeof(body), "space egress: %s\n", why);
    if (bl < 0 || (size_t)bl >= sizeof(body))
        bl = (int)strlen(body);
    int n = snprintf(msg, sizeof(msg),
                     "HTTP/1.1 %d %s\r\nContent-Type: text/plain; charset=utf-8\r\n"
                     "Content-Length: %d\r\nConnection: close\r\nX-Space-Egress: %s\r\n\r\n%s",
                     status, text, bl, status == 403 ? "denied" : "error", body);
    if (n > 0 && (size_t)n < sizeof(msg))
        pc_to_guest(pc, (const uint8_t *)msg, (size_t)n);
    if (pc->reason[0] == '\0')
        snprintf(pc->reason, sizeof(pc->reason), "%s", why);
    pc_close(pc, CLOSE_OK, NULL);
}

static void pc_deny(struct pconn *pc, const char *why)
{
    pc->allowed = false;
    snprintf(pc->reason, sizeof(pc->reason), "%s", why);
    sp_log(SP_LOG_INFO, "egress", "denied sandbox=%s dest=%s:%u reason=%s", pc->sb->id, pc->host,
           (unsigned)pc->port, why);
    pc_respond(pc, 403, why);
}

/* ---- HTTP request heads ---- */

static bool is_tchar(unsigned char c)
{
    return isalnum(c) || (c != 0 && strchr("!#$%&'*+-.^_`|~", c) != NULL);
}

/* host[:port] or [v6][:port]: fills the request's host fields. default_port 0 = required. */
static int parse_authority(const char *s, size_t n, uint16_t default_port, char *host,
                           bool *is_addr, sp_egp_addr_t *lit, uint16_t *port)
{
    if (n == 0 || memchr(s, '@', n) != NULL)
        return -1;
    size_t hl = n;
    const char *ps = NULL;
    if (s[0] == '[') {
        const char *close = memchr(s, ']', n);
        if (close == NULL)
            return -1;
        hl = (size_t)(close - s) + 1;
        if (hl < n) {
            if (s[hl] != ':')
                return -1;
            ps = s + hl + 1;
        }
    } else {
        const char *c = memchr(s, ':', n);
        if (c != NULL) {
            hl = (size_t)(c - s);
            ps = c + 1;
        }
    }
    *port = default_port;
    if (ps != NULL) {
        size_t pl = n - (size_t)(ps - s);
        unsigned long v = 0;
        if (pl == 0 && default_port != 0) {
            /* "host:" means the default port */
        } else {
            if (pl == 0 || pl > 5)
                return -1;
            for (size_t i = 0; i < pl; i++) {
                if (!isdigit((unsigned char)ps[i]))
                    return -1;
                v = v * 10 + (unsigned long)(ps[i] - '0');
            }
            if (v < 1 || v > 65535)
                return -1;
            *port = (uint16_t)v;
        }
    }
    if (*port == 0)
        return -1;
    char name[SP_EGP_NAME_MAX + 1];
    sp_egp_host_kind_t k = sp_egp_host_parse(s, hl, name, lit);
    if (k == SP_EGP_HOST_BAD)
        return -1;
    *is_addr = k == SP_EGP_HOST_ADDR;
    if (*is_addr)
        sp_egp_addr_format(lit, host, SP_EGP_NAME_MAX + 8);
    else
        snprintf(host, SP_EGP_NAME_MAX + 8, "%s", name);
    return 0;
}

struct hdr {
    const char *name, *value;
    size_t nlen, vlen;
};

#define MAX_HEADERS 128

static bool hname_is(const struct hdr *h, const char *name)
{
    return h->nlen == strlen(name) && strncasecmp(h->name, name, h->nlen) == 0;
}

/* Is header h listed in a Connection header value (hop-by-hop)? */
static bool listed_in(const struct hdr *h, const char *list, size_t n)
{
    size_t i = 0;
    while (i < n) {
        while (i < n && (list[i] == ' ' || list[i] == '\t' || list[i] == ','))
            i++;
        size_t st = i;
        while (i < n && list[i] != ',' && list[i] != ' ' && list[i] != '\t')
            i++;
        if (i > st && i - st == h->nlen && strncasecmp(list + st, h->name, h->nlen) == 0)
            return true;
    }
    return false;
}

static bool token_in(const char *list, size_t n, const char *tok)
{
    size_t tl = strlen(tok), i = 0;
    while (i < n) {
        while (i < n && (list[i] == ' ' || list[i] == '\t' || list[i] == ','))
            i++;
        size_t st = i;
        while (i < n && list[i] != ',' && list[i] != ' ' && list[i] != '\t')
            i++;
        if (i - st == tl && strncasecmp(list + st, tok, tl) == 0)
            return true;
    }
    return false;
}

/*
 * Parses the head (len bytes, the blank line included) into pc. Returns 0, or an HTTP status
 * (400, 501, 505) with *why set.
 */
static int parse_head(struct pconn *pc, const char *h, size_t len, const char **why)
{
    const char *end = h + len;
    const char *eol = memchr(h, '\n', len);
    if (eol == NULL)
        return *why = "malformed request line", 400;
    size_t ll = (size_t)(eol - h);
    if (ll > 0 && h[ll - 1] == '\r')
        ll--;
    const char *sp1 = memchr(h, ' ', ll);
    if (sp1 == NULL || sp1 == h || sp1 - h > 20)
        return *why = "malformed request line", 400;
    for (const char *q = h; q < sp1; q++)
        if (!is_tchar((unsigned char)*q))
            return *why = "malformed request line", 400;
    const char *uri = sp1 + 1;
    const char *sp2 = memchr(uri, ' ', (size_t)(h + ll - uri));
    if (sp2 == NULL || sp2 == uri)
        return *why = "malformed request line", 400;
    size_t ulen = (size_t)(sp2 - uri);
    const char *ver = sp2 + 1;
    size_t vlen = (size_t)(h + ll - ver);
    if (vlen != 8 || (memcmp(ver, "HTTP/1.1", 8) != 0 && memcmp(ver, "HTTP/1.0", 8) != 0))
        return *why = "only HTTP/1.0 and HTTP/1.1 proxy requests are supported", 505;
    for (size_t i = 0; i < ulen; i++)
        if ((unsigned char)uri[i] <= 0x20 || uri[i] == 0x7f)
            return *why = "malformed request line", 400;
    size_t mlen = (size_t)(sp1 - h);
    pc->connect = mlen == 7 && memcmp(h, "CONNECT", 7) == 0;

    /* Headers. */
    struct hdr hs[MAX_HEADERS];
    int nh = 0;
    const char *p = eol + 1;
    for (;;) {
        if (p >= end)
            return *why = "malformed headers", 400;
        const char *le = memchr(p, '\n', (size_t)(end - p));
        if (le == NULL)
            return *why = "malformed headers", 400;
        size_t l = (size_t)(le - p);
        if (l > 0 && p[l - 1] == '\r')
            l--;
        if (l == 0)
            break;
        if (p[0] == ' ' || p[0] == '\t')
            return *why = "folded header lines are not supported", 400;
        const char *colon = memchr(p, ':', l);
        if (colon == NULL || colon == p)
            return *why = "malformed header line", 400;
        for (const char *q = p; q < colon; q++)
            if (!is_tchar((unsigned char)*q))
                return *why = "malformed header name", 400;
        if (nh >= MAX_HEADERS)
            return *why = "too many header lines", 431;
        const char *v = colon + 1, *ve = p + l;
        while (v < ve && (*v == ' ' || *v == '\t'))
            v++;
        while (ve > v && (ve[-1] == ' ' || ve[-1] == '\t'))
            ve--;
        for (const char *q = v; q < ve; q++)
            if (*q == '\0' || *q == '\r')
                return *why = "malformed header value", 400;
        hs[nh++] = (struct hdr){p, v, (size_t)(colon - p), (size_t)(ve - v)};
        p = le + 1;
    }

    if (pc->connect) {
        pc->kind = "connect";
        if (parse_authority(uri, ulen, 0, pc->host, &pc->host_is_addr, &pc->lit, &pc->port) < 0)
            return *why = "CONNECT needs host:port", 400;
        return 0;
    }

    /* Plain HTTP in absolute form. */
    pc->kind = "http";
    if (ulen >= 8 && strncasecmp(uri, "https://", 8) == 0)
        return *why = "https URLs go through CONNECT (set HTTPS_PROXY)", 400;
    if (ulen < 7 || strncasecmp(uri, "http://", 7) != 0)
        return *why = "this is a proxy: send an absolute http:// URI or CONNECT", 400;
    const char *auth = uri + 7;
    size_t alen = 0;
    while (auth + alen < uri + ulen && auth[alen] != '/' && auth[alen] != '?' && auth[alen] != '#')
        alen++;
    if (parse_authority(auth, alen, 80, pc->host, &pc->host_is_addr, &pc->lit, &pc->port) < 0)
        return *why = "bad host in the request URI", 400;
    const char *path = auth + alen;
    size_t plen = (size_t)(uri + ulen - path);
    const char *frag = memchr(path, '#', plen);
    if (frag != NULL)
        plen = (size_t)(frag - path);

    const struct hdr *host_h = NULL, *cl = NULL, *te = NULL, *conn = NULL, *upg = NULL;
    for (int i = 0; i < nh; i++) {
        if (hname_is(&hs[i], "host")) {
            if (host_h != NULL)
                return *why = "more than one Host header", 400;
            host_h = &hs[i];
        } else if (hname_is(&hs[i], "content-length")) {
            if (cl != NULL && (cl->vlen != hs[i].vlen || memcmp(cl->value, hs[i].value, cl->vlen)))
                return *why = "conflicting Content-Length headers", 400;
            cl = &hs[i];
        } else if (hname_is(&hs[i], "transfer-encoding")) {
            if (te != NULL)
                return *why = "more than one Transfer-Encoding header", 400;
            te = &hs[i];
        } else if (hname_is(&hs[i], "connection")) {
            conn = &hs[i];
        } else if (hname_is(&hs[i], "upgrade")) {
            upg = &hs[i];
        }
    }
    if (host_h != NULL) {
        char hh[SP_EGP_NAME_MAX + 8];
        bool ha;
        sp_egp_addr_t hl;
        uint16_t hp;
        if (parse_authority(host_h->value, host_h->vlen, 80, hh, &ha, &hl, &hp) < 0)
            return *why = "bad Host header", 400;
        if (ha != pc->host_is_addr || strcmp(hh, pc->host) != 0 || hp != pc->port)
            return *why = "Host header does not match the request URI", 403;
    }
    if (cl != NULL && te != NULL)
        return *why = "both Content-Length and Transfer-Encoding", 400;
    if (te != NULL) {
        if (te->vlen != 7 || strncasecmp(te->value, "chunked", 7) != 0)
            return *why = "only chunked Transfer-Encoding is supported", 501;
        pc->body = BODY_CHUNKED;
    } else if (cl != NULL) {
        if (cl->vlen == 0 || cl->vlen > 18)
            return *why = "bad Content-Length", 400;
        uint64_t v = 0;
        for (size_t i = 0; i < cl->vlen; i++) {
            if (!isdigit((unsigned char)cl->value[i]))
                return *why = "bad Content-Length", 400;
            v = v * 10 + (uint64_t)(cl->value[i] - '0');
        }
        pc->body = v > 0 ? BODY_LENGTH : BODY_NONE;
        pc->body_left = v;
    } else {
        pc->body = BODY_NONE;
    }
    pc->upgrade = upg != NULL && conn != NULL && token_in(conn->value, conn->vlen, "upgrade");
    if (pc->upgrade && pc->body == BODY_NONE)
        pc->body = BODY_RAW; /* after the head the connection is a tunnel */
    else
        pc->upgrade = false;

    /* The head that goes upstream: origin form, hop-by-hop headers dropped. */
    size_t cap = len + plen + 256;
    char *out = malloc(cap);
    if (out == NULL)
        return *why = "out of memory", 503;
    size_t o = 0;
    memcpy(out + o, h, mlen + 1);
    o += mlen + 1;
    if (plen == 0 || path[0] == '?')
        out[o++] = '/';
    memcpy(out + o, path, plen);
    o += plen;
    out[o++] = ' ';
    memcpy(out + o, ver, 8);
    o += 8;
    memcpy(out + o, "\r\n", 2);
    o += 2;
    if (host_h == NULL) {
        bool v6 = pc->host_is_addr && pc->lit.family == 6;
        o += (size_t)snprintf(out + o, cap - o, "Host: %s%s%s", v6 ? "[" : "", pc->host,
                              v6 ? "]" : "");
        if (pc->port != 80)
            o += (size_t)snprintf(out + o, cap - o, ":%u", (unsigned)pc->port);
        memcpy(out + o, "\r\n", 2);
        o += 2;
    }
    for (int i = 0; i < nh; i++) {
        const struct hdr *x = &hs[i];
        if (hname_is(x, "connection") || hname_is(x, "proxy-connection") ||
            hname_is(x, "keep-alive") || hname_is(x, "proxy-authorization") || hname_is(x, "te") ||
            (conn != NULL && listed_in(x, conn->value, conn->vlen) &&
             !(pc->upgrade && hname_is(x, "upgrade"))))
            continue;
        memcpy(out + o, x->name, x->nlen);
        o += x->nlen;
        memcpy(out + o, ": ", 2);
        o += 2;
        memcpy(out + o, x->value, x->vlen);
        o += x->vlen;
        memcpy(out + o, "\r\n", 2);
        o += 2;
    }
    const char *c = pc->upgrade ? "Connection: Upgrade\r\n\r\n" : "Connection: close\r\n\r\n";
    memcpy(out + o, c, strlen(c));
    o += strlen(c);
    pc->head = out;
    pc->head_len = o;
    return 0;
}

/* Scans n body bytes of a chunked body; returns how many belong to it (all, unless it ends
 * inside). cs->bad on a framing error. */
enum {
    CS_SIZE = 0,
    CS_SIZE_LF,
    CS_EXT,
    CS_DATA,
    CS_DATA_CR,
    CS_DATA_LF,
    CS_TR_START,
    CS_TR_LINE,
    CS_TR_END_LF
};

static size_t chunk_scan(struct chunkscan *cs, const uint8_t *p, size_t n, uint64_t *data_left)
{
    size_t i = 0;
    while (i < n && !cs->done && !cs->bad) {
        uint8_t c = p[i];
        switch (cs->state) {
        case CS_SIZE:
            if (isxdigit(c)) {
                if (cs->size >> 56)
                    cs->bad = true;
                cs->size =
                    cs->size * 16 + (uint64_t)(isdigit(c) ? c - '0' : (tolower(c) - 'a' + 10));
            } else if (c == ';' || c == ' ' || c == '\t') {
                cs->state = CS_EXT;
            } else if (c == '\r') {
                cs->state = CS_SIZE_LF;
            } else if (c == '\n') {
                cs->state = cs->size ? CS_DATA : CS_TR_START;
                *data_left = cs->size;
            } else {
                cs->bad = true;
            }
            i++;
            break;
        case CS_EXT:
            if (c == '\n') {
                cs->state = cs->size ? CS_DATA : CS_TR_START;
                *data_left = cs->size;
            }
            i++;
            break;
        case CS_SIZE_LF:
            if (c != '\n')
                cs->bad = true;
            cs->state = cs->size ? CS_DATA : CS_TR_START;
            *data_left = cs->size;
            i++;
            break;
        case CS_DATA: {
            size_t k = n - i;
            if (k > *data_left)
                k = (size_t)*data_left;
            i += k;
            *data_left -= k;
            if (*data_left == 0)
                cs->state = CS_DATA_CR;
            break;
        }
        case CS_DATA_CR:
            if (c == '\r')
                cs->state = CS_DATA_LF;
            else if (c == '\n')
                cs->state = CS_SIZE, cs->size = 0;
            else
                cs->bad = true;
            i++;
            break;
        case CS_DATA_LF:
            if (c != '\n')
                cs->bad = true;
            cs->state = CS_SIZE;
            cs->size = 0;
            i++;
            break;
        case CS_TR_START:
            if (c == '\r')
                cs->state = CS_TR_END_LF;
            else if (c == '\n')
                cs->done = true;
            else
                cs->state = CS_TR_LINE;
            i++;
            break;
        case CS_TR_LINE:
            if (c == '\n')
                cs->state = CS_TR_START;
            i++;
            break;
        case CS_TR_END_LF:
            if (c != '\n')
                cs->bad = true;
            cs->done = true;
            i++;
            break;
        }
    }
    return i;
}

/* ---- TLS ClientHello ---- */

enum { SNI_NEED = 0, SNI_NONE, SNI_FOUND, SNI_BAD };

static int sni_peek(const uint8_t *p, size_t n, char *name, size_t cap)
{
    uint8_t hs[SP_EGRESS_MAX_HEAD + 8];
    size_t hl = 0, off = 0;
    while (off + 5 <= n) {
        if (p[off] != 0x16)
            return SNI_BAD;
        size_t rl = (size_t)p[off + 3] << 8 | p[off + 4];
        if (rl == 0 || rl > 16384 + 256)
            return SNI_BAD;
        if (off + 5 + rl > n)
            break;
        size_t k = rl;
        if (hl + k > sizeof(hs))
            return SNI_BAD; /* a ClientHello larger than we look at */
        memcpy(hs + hl, p + off + 5, k);
        hl += k;
        off += 5 + rl;
        if (hl >= 4) {
            if (hs[0] != 1)
                return SNI_BAD;
            size_t ml = (size_t)hs[1] << 16 | (size_t)hs[2] << 8 | hs[3];
            if (ml > sizeof(hs) - 4)
                return SNI_BAD;
            if (hl >= 4 + ml) {
                const uint8_t *b = hs + 4, *e = hs + 4 + ml;
                if (e - b < 34)
                    return SNI_BAD;
                b += 34; /* version, random */
                if (b + 1 > e || b + 1 + b[0] > e)
                    return SNI_BAD;
                b += 1 + b[0]; /* session id */
                if (b + 2 > e)
                    return SNI_BAD;
                size_t cl = (size_t)b[0] << 8 | b[1];
                if (b + 2 + cl > e)
                    return SNI_BAD;
                b += 2 + cl; /* cipher suites */
                if (b + 1 > e || b + 1 + b[0] > e)
                    return SNI_BAD;
                b += 1 + b[0]; /* compression */
                if (b == e)
                    return SNI_NONE;
                if (b + 2 > e)
                    return SNI_BAD;
                size_t el = (size_t)b[0] << 8 | b[1];
                b += 2;
                if (b + el > e)
                    return SNI_BAD;
                const uint8_t *xe = b + el;
                while (b + 4 <= xe) {
                    unsigned type = (unsigned)b[0] << 8 | b[1];
                    size_t xl = (size_t)b[2] << 8 | b[3];
                    b += 4;
                    if (b + xl > xe)
                        return SNI_BAD;
                    if (type == 0) {
                        const uint8_t *s = b, *se = b + xl;
                        if (s + 2 > se)
                            return SNI_BAD;
                        s += 2;
                        while (s + 3 <= se) {
                            unsigned nt = s[0];
                            size_t nl = (size_t)s[1] << 8 | s[2];
                            s += 3;
                            if (s + nl > se)
                                return SNI_BAD;
                            if (nt == 0) {
                                if (nl == 0 || nl >= cap)
                                    return SNI_BAD;
                                memcpy(name, s, nl);
                                name[nl] = '\0';
                                return memchr(name, '\0', nl) ? SNI_BAD : SNI_FOUND;
                            }
                            s += nl;
                        }
                        return SNI_NONE;
                    }
                    b += xl;
                }
                return SNI_NONE;
            }
        }
    }
    return SNI_NEED;
}

/* ---- relaying ---- */

static void pc_set_interest(struct pconn *pc)
{
    if (pc->w == NULL)
        return;
    int ev = 0;
    bool pending_up = pc->head_off < pc->head_len ||
                      (pc->phase == PH_RELAY && pc->fwd_ok > 0 && pc->g_len > pc->g_off);
    if (pc->phase == PH_CONNECT || pending_up)
        ev |= SP_IO_WRITE;
    if (pc->phase == PH_RELAY && !pc->up_rd_eof && pc->st != NULL) {
        if (sp_agentstream_credit(pc->st) > 0)
            ev |= SP_IO_READ;
        else
            sp_agentstream_want_writable(pc->st); /* on_writable resumes reading */
    }
    if (ev != pc->wev) {
        pc->wev = ev;
        sp_watch_set(pc->w, ev);
    }
}

/* Closes pc when both directions are done; true when it did (pc is gone). */
static bool pc_check_done(struct pconn *pc)
{
    /* Upstream said all it will say. Plain HTTP is one request per connection: done. A
     * tunnel waits for the guest to finish too (half-close both ways). */
    if (!pc->up_rd_eof)
        return false;
    bool guest_done = pc->g_eof && pc->g_len == pc->g_off && pc->head_off == pc->head_len;
    if ((pc->body == BODY_RAW || pc->connect) && !guest_done && !pc->up_wr_shut)
        return false;
    pc_close(pc, CLOSE_OK, NULL);
    return true;
}

/* Writes what can go upstream now. -1 when pc was closed. */
static int pump_up(struct pconn *pc)
{
    sp_egress_t *eg = pc->sb->eg;
    while (pc->head_off < pc->head_len) {
        ssize_t n = send(pc->fd, pc->head + pc->head_off, pc->head_len - pc->head_off,
                         MSG_NOSIGNAL | MSG_DONTWAIT);
        if (n < 0) {
            if (errno == EINTR)
                continue;
            if (errno == EAGAIN || errno == EWOULDBLOCK)
                return 0;
            pc_close(pc, CLOSE_ERROR, "upstream closed the connection");
            return -1;
        }
        pc->head_off += (size_t)n;
    }
    for (;;) {
        size_t avail = pc->g_len - pc->g_off;
        if (avail == 0)
            break;
        if (pc->fwd_ok == 0) {
            if (pc->body == BODY_RAW) {
                pc->fwd_ok = avail;
            } else if (pc->body == BODY_LENGTH && pc->body_left > 0) {
                pc->fwd_ok = avail < pc->body_left ? avail : (size_t)pc->body_left;
                pc->body_left -= pc->fwd_ok;
            } else if (pc->body == BODY_CHUNKED && !pc->cs.done) {
                pc->fwd_ok = chunk_scan(&pc->cs, pc->g + pc->g_off, avail, &pc->body_left);
                if (pc->cs.bad) {
                    pc_close(pc, CLOSE_ERROR, "malformed chunked request body");
                    return -1;
                }
            } else {
                /* The request is complete: what follows (a pipelined request) is dropped;
                 * the guest sees the connection close after this response. */
                g_consume(pc, avail);
                break;
            }
        }
        ssize_t n = send(pc->fd, pc->g + pc->g_off, pc->fwd_ok, MSG_NOSIGNAL | MSG_DONTWAIT);
        if (n < 0) {
            if (errno == EINTR)
                continue;
            if (errno == EAGAIN || errno == EWOULDBLOCK)
                break;
            pc_close(pc, CLOSE_ERROR, "upstream closed the connection");
            return -1;
        }
        pc->fwd_ok -= (size_t)n;
        pc->up_bytes += (size_t)n;
        eg->st.bytes_up += (size_t)n;
        g_consume(pc, (size_t)n);
    }
    if (pc->g_eof && pc->g_len == pc->g_off && pc->head_off == pc->head_len && !pc->up_wr_shut) {
        shutdown(pc->fd, SHUT_WR);
        pc->up_wr_shut = true;
        if (pc_check_done(pc))
            return -1;
    }
    return 0;
}

/* Reads what the guest can take now. -1 when pc was closed. */
static int pump_down(struct pconn *pc)
{
    sp_egress_t *eg = pc->sb->eg;
    for (int i = 0; i < READS_PER_TURN && !pc->up_rd_eof && pc->st != NULL; i++) {
        size_t cr = sp_agentstream_credit(pc->st);
        if (cr == 0) {
            sp_agentstream_want_writable(pc->st);
            break;
        }
        if (cr > SP_AP_MAX_DATA)
            cr = SP_AP_MAX_DATA;
        ssize_t n = recv(pc->fd, eg->rbuf, cr, MSG_DONTWAIT);
        if (n < 0) {
            if (errno == EINTR)
                continue;
            if (errno == EAGAIN || errno == EWOULDBLOCK)
                break;
            pc_close(pc, CLOSE_ERROR, "upstream connection reset");
            return -1;
        }
        if (n == 0) {
            pc->up_rd_eof = true;
            sp_agentstream_send(pc->st, SP_AP_T_EOF, NULL, 0);
            return pc_check_done(pc) ? -1 : 0;
        }
        pc_to_guest(pc, eg->rbuf, (size_t)n);
        if ((size_t)n < cr)
            break;
    }
    return 0;
}

static void on_up_io(sp_watch_t *w, int events, void *arg);

static void pc_relay(struct pconn *pc)
{
    pc->phase = PH_RELAY;
    sp_timer_stop(&pc->timer);
    if (pump_up(pc) < 0)
        return;
    pc_set_interest(pc);
}

/* ---- the mitm handover ---- */

static size_t mitm_to_guest(void *arg, const uint8_t *p, size_t n)
{
    struct pconn *pc = arg;
    size_t k = pc_to_guest(pc, p, n);
    if (k < n && pc->st != NULL)
        sp_agentstream_want_writable(pc->st);
    return k;
}

static void mitm_consumed(void *arg, size_t n)
{
    struct pconn *pc = arg;
    pc->up_bytes += n;
    pc->sb->eg->st.bytes_up += n;
    pc_grant(pc, n, false);
}

static void mitm_end(void *arg, const sp_err_t *err)
{
    struct pconn *pc = arg;
    struct sp_mitm_conn *m = pc->mitm;
    pc->mitm = NULL; /* ending: it must not be destroyed from inside its own callback twice */
    if (err != NULL && pc->reason[0] == '\0')
        snprintf(pc->reason, sizeof(pc->reason), "%s", err->msg);
    pc_close(pc, err ? CLOSE_ERROR : CLOSE_OK, err ? err->msg : NULL);
    sp_mitm_conn_destroy(m);
}

static const sp_mitm_conn_cbs_t mitm_cbs = {mitm_to_guest, mitm_consumed, mitm_end};

static void pc_to_mitm(struct pconn *pc, bool tls)
{
    sp_err_t e;
    sp_watch_destroy(pc->w);
    pc->w = NULL;
    int fd = pc->fd;
    pc->fd = -1; /* the mitm conn owns it now, also on failure */
    pc->phase = PH_MITM;
    sp_timer_stop(&pc->timer);
    pc->mitm = sp_mitm_conn_create(pc->sb->mitm, pc->host, pc->port, tls, fd, &mitm_cbs, pc, &e);
    if (pc->mitm == NULL) {
        pc_close(pc, CLOSE_ERROR, e.msg);
        return;
    }
    sp_log(SP_LOG_DEBUG, "egress", "credentials sandbox=%s dest=%s:%u tls=%d", pc->sb->id, pc->host,
           (unsigned)pc->port, (int)tls);
    if (!pc->connect && pc->orig_head != NULL) {
        sp_mitm_conn_from_guest(pc->mitm, (const uint8_t *)pc->orig_head, pc->orig_len);
        memset(pc->orig_head, 0, pc->orig_len);
        free(pc->orig_head);
        pc->orig_head = NULL;
    }
    size_t avail = pc->g_len - pc->g_off;
    if (avail > 0) {
        /* Handed over unconsumed: the mitm's `consumed` grants them. */
        sp_mitm_conn_from_guest(pc->mitm, pc->g + pc->g_off, avail);
        pc->g_off = pc->g_len = 0;
        sb_unbuffer(pc->sb, avail);
    }
    if (pc->g_eof)
        sp_mitm_conn_guest_eof(pc->mitm);
}

static bool mitm_wants(struct pconn *pc)
{
    return pc->sb->mitm != NULL && sp_mitm_wants(pc->sb->mitm, pc->host, pc->port);
}

/* ---- CONNECT: the first guest bytes ---- */

static void pc_sni(struct pconn *pc)
{
    size_t avail = pc->g_len - pc->g_off;
    if (avail == 0) {
        if (pc->g_eof)
            pc_relay(pc);
        return;
    }
    const uint8_t *p = pc->g + pc->g_off;
    if (mitm_wants(pc)) {
        pc_to_mitm(pc, p[0] == 0x16);
        return;
    }
    if (p[0] != 0x16) {
        pc_relay(pc); /* not TLS: nothing to compare */
        return;
    }
    char sni[SP_EGP_NAME_MAX + 8];
    int r = sni_peek(p, avail, sni, sizeof(sni));
    if (r == SNI_NEED && !pc->g_eof && avail < SP_EGRESS_MAX_HEAD + 1024)
        return; /* wait for the rest of the ClientHello */
    if (r == SNI_NEED || r == SNI_BAD) {
        pc->allowed = false;
        snprintf(pc->reason, sizeof(pc->reason), "malformed TLS ClientHello");
        pc_close(pc, CLOSE_ERROR, pc->reason);
        return;
    }
    if (r == SNI_FOUND) {
        char name[SP_EGP_NAME_MAX + 1];
        sp_egp_addr_t a;
        sp_egp_host_kind_t k = sp_egp_host_parse(sni, strlen(sni), name, &a);
        bool same = false;
        if (k == SP_EGP_HOST_NAME && !pc->host_is_addr)
            same = strcmp(name, pc->host) == 0;
        else if (k == SP_EGP_HOST_ADDR && pc->host_is_addr)
            same = a.family == pc->lit.family && memcmp(a.b, pc->lit.b, 16) == 0;
        if (!same) {
            pc->allowed = false;
            snprintf(pc->reason, sizeof(pc->reason),
                     "TLS server name '%.100s' does not match the CONNECT host",
                     k == SP_EGP_HOST_BAD ? "(invalid)" : sni);
            sp_log(SP_LOG_INFO, "egress", "denied sandbox=%s dest=%s:%u reason=sni mismatch",
                   pc->sb->id, pc->host, (unsigned)pc->port);
            pc_close(pc, CLOSE_ERROR, pc->reason);
            return;
        }
    }
    pc_relay(pc);
}

/* ---- connecting ---- */

static void pc_connected(struct pconn *pc)
{
    int one = 1;
    setsockopt(pc->fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
    sp_egp_addr_format(&pc->addrs[pc->ai], pc->addr_text, sizeof(pc->addr_text));
    pc->allowed = true;
    sp_log(SP_LOG_DEBUG, "egress", "connected sandbox=%s dest=%s:%u addr=%s", pc->sb->id, pc->host,
           (unsigned)pc->port, pc->addr_text);
    if (pc->connect) {
        static const char ok[] = "HTTP/1.1 200 Connection established\r\n\r\n";
        if (pc_to_guest(pc, (const uint8_t *)ok, sizeof(ok) - 1) != sizeof(ok) - 1) {
            pc_close(pc, CLOSE_ERROR, "guest stream closed");
            return;
        }
        pc->down_bytes -= sizeof(ok) - 1; /* the audit counts the tunnel's bytes */
        pc->body = BODY_RAW;
        pc->phase = PH_SNI;
        pc_set_interest(pc); /* nothing to write or read until the guest speaks */
        sp_timer_start(&pc->timer, SP_EGRESS_HEAD_TIMEOUT_MS);
        pc_sni(pc);
        return;
    }
    if (mitm_wants(pc)) {
        pc_to_mitm(pc, false);
        return;
    }
    pc_relay(pc);
}

static void pc_connect_next(struct pconn *pc)
{
    sp_watch_destroy(pc->w);
    pc->w = NULL;
    pc->wev = 0;
    if (pc->fd >= 0)
        close(pc->fd);
    pc->fd = -1;
    for (; pc->ai < pc->naddrs; pc->ai++) {
        const sp_egp_addr_t *a = &pc->addrs[pc->ai];
        struct sockaddr_storage ss;
        socklen_t sl;
        memset(&ss, 0, sizeof(ss));
        if (a->family == 4) {
            struct sockaddr_in *s4 = (struct sockaddr_in *)&ss;
            s4->sin_family = AF_INET;
            s4->sin_port = htons(pc->port);
            memcpy(&s4->sin_addr, a->b, 4);
            sl = sizeof(*s4);
        } else {
            struct sockaddr_in6 *s6 = (struct sockaddr_in6 *)&ss;
            s6->sin6_family = AF_INET6;
            s6->sin6_port = htons(pc->port);
            memcpy(&s6->sin6_addr, a->b, 16);
            sl = sizeof(*s6);
        }
        int fd = socket(ss.ss_family, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
        if (fd < 0) {
            pc->last_errno = errno;
            continue;
        }
        int rc;
        do
            rc = connect(fd, (struct sockaddr *)&ss, sl);
        while (rc < 0 && errno == EINTR);
        if (rc < 0 && errno != EINPROGRESS) {
            pc->last_errno = errno;
            close(fd);
            continue;
        }
        pc->w = sp_watch_create(pc->sb->eg->loop, fd, on_up_io, pc);
        if (pc->w == NULL) {
            pc->last_errno = errno ? errno : ENOMEM;
            close(fd);
            continue;
        }
        pc->fd = fd;
        pc->phase = PH_CONNECT;
        if (rc == 0) {
            pc_connected(pc);
            return;
        }
        pc->wev = SP_IO_WRITE;
        sp_watch_set(pc->w, SP_IO_WRITE);
        return;
    }
    char why[160];
    char a[72];
    if (pc->naddrs > 0)
        sp_egp_addr_format(&pc->addrs[pc->naddrs - 1], a, sizeof(a));
    else
        snprintf(a, sizeof(a), "?");
    snprintf(pc->addr_text, sizeof(pc->addr_text), "%s", a);
    snprintf(why, sizeof(why), "cannot connect to %.80s port %u: %s", pc->host, (unsigned)pc->port,
             strerror(pc->last_errno ? pc->last_errno : ECONNREFUSED));
    pc->allowed = true;
    pc_respond(pc, 502, why);
}

static void on_up_io(sp_watch_t *w, int events, void *arg)
{
    struct pconn *pc = arg;
    if (pc->phase == PH_CONNECT) {
        int soerr = 0;
        socklen_t sl = sizeof(soerr);
        if (getsockopt(pc->fd, SOL_SOCKET, SO_ERROR, &soerr, &sl) < 0)
            soerr = errno;
        if (soerr != 0) {
            pc->last_errno = soerr;
            pc->ai++;
            pc_connect_next(pc);
            return;
        }
        pc_connected(pc);
        return;
    }
    if (pc->phase != PH_RELAY)
        return;
    if ((events & SP_IO_WRITE) && pump_up(pc) < 0)
        return;
    if ((events & SP_IO_READ) && pump_down(pc) < 0)
        return;
    pc_set_interest(pc);
}

/* ---- deciding ---- */

static void pc_on_resolved(void *owner, struct rjob *j)
{
    struct pconn *pc = owner;
    pc->job = NULL;
    const sp_egp_t *pol = pc->sb->policy;
    if (j->rc != 0) {
        char why[160];
        snprintf(why, sizeof(why), "cannot resolve %.100s: %s", pc->host, resolve_error(j->rc));
        pc->allowed = true;
        pc_respond(pc, 502, why);
        return;
    }
    char first_why[128] = "";
    char first_addr[72] = "";
    pc->naddrs = 0;
    for (int i = 0; i < j->n; i++) {
        sp_egp_addr_t a;
        if (sp_egp_addr_from_sockaddr((struct sockaddr *)&j->addrs[i], &a) < 0)
            continue;
        char why[128];
        if (sp_egp_check_addr(pol, &a, pc->port, pc->by_name, why, sizeof(why))) {
            if (pc->naddrs < MAX_ADDRS)
                pc->addrs[pc->naddrs++] = a;
        } else if (first_why[0] == '\0') {
            snprintf(first_why, sizeof(first_why), "%s", why);
            sp_egp_addr_format(&a, first_addr, sizeof(first_addr));
        }
    }
    if (pc->naddrs == 0) {
        char why[200];
        snprintf(why, sizeof(why), "%.80s resolves only to denied addresses (%.80s)", pc->host,
                 first_why[0] ? first_why : "none usable");
        snprintf(pc->addr_text, sizeof(pc->addr_text), "%s", first_addr);
        pc_deny(pc, why);
        return;
    }
    pc->ai = 0;
    pc_connect_next(pc);
}

static bool sb_ready(const struct sb *sb)
{
    return sb->policy != NULL && !sb->mitm_opening;
}

static void pc_decide(struct pconn *pc)
{
    struct sb *sb = pc->sb;
    pc->log = true;
    if (!sb_ready(sb)) {
        pc->phase = PH_WAIT;
        return;
    }
    char why[160];
    sp_timer_start(&pc->timer, sb->eg->o.connect_timeout_ms); /* resolving and connecting */
    if (pc->host_is_addr) {
        if (!sp_egp_check_addr(sb->policy, &pc->lit, pc->port, false, why, sizeof(why))) {
            snprintf(pc->addr_text, sizeof(pc->addr_text), "%.64s", pc->host);
            pc_deny(pc, why);
            return;
        }
        pc->addrs[0] = pc->lit;
        pc->naddrs = 1;
        pc->ai = 0;
        pc_connect_next(pc);
        return;
    }
    if (!sp_egp_check_name(sb->policy, pc->host, pc->port, &pc->by_name, why, sizeof(why))) {
        pc_deny(pc, why);
        return;
    }
    pc->phase = PH_RESOLVE;
    pc->job = resolve_start(sb, pc->host, AF_UNSPEC, pc_on_resolved, pc);
    if (pc->job == NULL)
        pc_respond(pc, 503, "out of memory");
}

/* Looks for the end of the head; parses and decides once it is there. */
static void pc_head(struct pconn *pc)
{
    const uint8_t *p = pc->g + pc->g_off;
    size_t n = pc->g_len - pc->g_off;
    size_t hl = 0;
    for (size_t i = 0; i + 1 < n && i < SP_EGRESS_MAX_HEAD; i++) {
        if (p[i] == '\n' && p[i + 1] == '\n') {
            hl = i + 2;
            break;
        }
        if (p[i] == '\n' && i + 2 < n && p[i + 1] == '\r' && p[i + 2] == '\n') {
            hl = i + 3;
            break;
        }
    }
    if (hl == 0) {
        if (n >= SP_EGRESS_MAX_HEAD) {
            pc->kind = "http";
            snprintf(pc->host, sizeof(pc->host), "?");
            pc_respond(pc, 431, "request head is too large");
        } else if (pc->g_eof) {
            pc_close(pc, CLOSE_OK, NULL); /* the guest left before asking anything */
        }
        return;
    }
    const char *why = NULL;
    int status = parse_head(pc, (const char *)p, hl, &why);
    if (status != 0) {
        if (pc->host[0] == '\0')
            snprintf(pc->host, sizeof(pc->host), "?");
        if (pc->kind == NULL)
            pc->kind = "http";
        pc->log = true;
        pc->allowed = false;
        snprintf(pc->reason, sizeof(pc->reason), "%s", why);
        pc_respond(pc, status, why);
        return;
    }
    if (!pc->connect && pc->sb->eg->mitm != NULL) {
        pc->orig_head = malloc(hl);
        if (pc->orig_head != NULL) {
            memcpy(pc->orig_head, p, hl);
            pc->orig_len = hl;
        }
    }
    g_consume(pc, hl);
    pc_decide(pc);
}

static void on_pc_timer(sp_timer_t *t, void *arg)
{
    struct pconn *pc = arg;
    switch (pc->phase) {
    case PH_HEAD:
        if (pc->g_len == pc->g_off) {
            pc_close(pc, CLOSE_OK, NULL); /* an idle connection that never asked */
            return;
        }
        pc->kind = "http";
        snprintf(pc->host, sizeof(pc->host), "?");
        pc->log = true;
        pc_respond(pc, 408, "request head not received in time");
        return;
    case PH_WAIT:
        pc->allowed = false;
        pc_respond(pc, 503, "egress policy is not available; try again");
        return;
    case PH_RESOLVE:
    case PH_CONNECT:
        pc->allowed = true;
        pc_respond(pc, 504, "connecting took too long");
        return;
    case PH_SNI:
        pc->allowed = false;
        snprintf(pc->reason, sizeof(pc->reason), "no TLS ClientHello in time");
        pc_close(pc, CLOSE_ERROR, pc->reason);
        return;
    default:
        return;
    }
}

/* ---- the guest side of a proxy connection ---- */

static void pc_frame(sp_agentstream_t *s, uint16_t type, uint16_t flags, const uint8_t *p,
                     size_t len, void *arg)
{
    struct pconn *pc = arg;
    if (flags & SP_AP_F_END) { /* the agent does not end these; treat it as gone */
        pc->st = NULL;
        pc_close(pc, CLOSE_SILENT, "guest ended the stream");
        return;
    }
    if (type == SP_AP_T_DATA) {
        if (pc->phase == PH_MITM) {
            if (pc->mitm != NULL)
                sp_mitm_conn_from_guest(pc->mitm, p, len);
            return;
        }
        if (g_append(pc, p, len) < 0) {
            pc_close(pc, CLOSE_ERROR, "guest sent more than its window");
            return;
        }
        if (pc->phase == PH_RESOLVE || pc->phase == PH_WAIT || pc->phase == PH_CONNECT)
            return; /* held until the upstream is there (bounded by the window) */
    } else if (type == SP_AP_T_EOF) {
        pc->g_eof = true;
        if (pc->phase == PH_MITM) {
            if (pc->mitm != NULL)
                sp_mitm_conn_guest_eof(pc->mitm);
            return;
        }
    } else {
        return;
    }
    switch (pc->phase) {
    case PH_HEAD:
        pc_head(pc);
        break;
    case PH_SNI:
        pc_sni(pc);
        break;
    case PH_RELAY:
        if (pump_up(pc) < 0 || pc_check_done(pc))
            return;
        pc_set_interest(pc);
        break;
    default:
        break;
    }
}

static void pc_error(sp_agentstream_t *s, const sp_err_t *err, void *arg)
{
    struct pconn *pc = arg;
    pc->st = NULL;
    if (pc->allowed && pc->reason[0] == '\0' && pc->phase != PH_RELAY && pc->phase != PH_MITM)
        snprintf(pc->reason, sizeof(pc->reason), "guest closed the connection");
    pc_close(pc, CLOSE_SILENT, NULL);
}

static void pc_writable(sp_agentstream_t *s, void *arg)
{
    struct pconn *pc = arg;
    if (pc->phase == PH_MITM) {
        if (pc->mitm != NULL)
            sp_mitm_conn_guest_writable(pc->mitm);
        return;
    }
    if (pc->phase == PH_RELAY) {
        if (pump_down(pc) < 0)
            return;
        pc_set_interest(pc);
    }
}

static const sp_agentstream_cbs_t pc_cbs = {pc_frame, pc_error, pc_writable};

/* ---- DNS ---- */

enum {
    RC_NOERROR = 0,
    RC_FORMERR = 1,
    RC_SERVFAIL = 2,
    RC_NXDOMAIN = 3,
    RC_NOTIMP = 4,
    RC_REFUSED = 5
};

static void dns_free(struct dnsq *q)
{
    struct sb *sb = q->sb;
    if (q->job != NULL)
        q->job->owner = NULL;
    sp_timer_stop(&q->timer);
    if (q->st != NULL) {
        sp_agentstream_t *st = q->st;
        q->st = NULL;
        sp_agentstream_reset(st);
    }
    if (q->prev)
        q->prev->next = q->next;
    else
        sb->dnsqs = q->next;
    if (q->next)
        q->next->prev = q->prev;
    sb->ndns--;
    sb->eg->st.dns--;
    free(q);
    sb_maybe_free(sb);
}

/* Answers with rcode and the addresses (of the query's type) and frees q. */
static void dns_answer(struct dnsq *q, int rcode, const sp_egp_addr_t *addrs, int n, bool allowed,
                       const char *why)
{
    uint8_t out[sizeof(q->msg) + MAX_ADDRS * 28 + 64];
    size_t o = 0;
    memcpy(out, q->msg, q->msg_len);
    o = q->msg_len;
    uint16_t qflags = (uint16_t)(q->msg[2] << 8 | q->msg[3]);
    uint16_t flags =
        (uint16_t)(0x8000 | (qflags & 0x7800) | (qflags & 0x0100) | 0x0080 | (rcode & 0xf));
    out[2] = (uint8_t)(flags >> 8);
    out[3] = (uint8_t)flags;
    int an = 0;
    char list[72] = "";
    for (int i = 0; i < n; i++) {
        const sp_egp_addr_t *a = &addrs[i];
        size_t alen = a->family == 4 ? 4 : 16;
        if ((q->qtype == 1 && a->family != 4) || (q->qtype == 28 && a->family != 6))
            continue;
        out[o++] = 0xc0;
        out[o++] = 0x0c; /* the name in the question */
        out[o++] = (uint8_t)(q->qtype >> 8);
        out[o++] = (uint8_t)q->qtype;
        out[o++] = 0;
        out[o++] = 1; /* IN */
        out[o++] = 0;
        out[o++] = 0;
        out[o++] = 0;
        out[o++] = DNS_TTL;
        out[o++] = 0;
        out[o++] = (uint8_t)alen;
        memcpy(out + o, a->b, alen);
        o += alen;
        an++;
        if (strlen(list) < 40) {
            char t[64];
            sp_egp_addr_format(a, t, sizeof(t));
            snprintf(list + strlen(list), sizeof(list) - strlen(list), "%s%s", list[0] ? "," : "",
                     t);
        }
    }
    out[6] = (uint8_t)(an >> 8);
    out[7] = (uint8_t)an;
    memset(out + 8, 0, 4); /* no authority or additional records (EDNS dropped) */
    uint8_t buf[sizeof(out) + 16];
    sp_ap_writer_t w;
    sp_ap_writer_init(&w, buf, sizeof(buf));
    sp_ap_put_bytes(&w, SP_AP_K_QUERY, out, o);
    if (q->st != NULL && !w.overflow) {
        sp_agentstream_t *st = q->st;
        q->st = NULL;
        sp_agentstream_end(st, SP_AP_T_DNS_ANSWER, buf, w.len);
    }
    char host[SP_EGP_NAME_MAX + 8];
    snprintf(host, sizeof(host), "%s", q->name[0] ? q->name : "?");
    char reason[160];
    snprintf(reason, sizeof(reason), "%s", why ? why : "");
    log_row(q->sb, "dns", host, 53, list, allowed, reason, 0, 0, 0);
    dns_free(q);
}

static void dns_on_resolved(void *owner, struct rjob *j)
{
    struct dnsq *q = owner;
    q->job = NULL;
    if (j->rc != 0) {
        bool nx = j->rc == EAI_NONAME;
#ifdef EAI_NODATA
        bool nodata = j->rc == EAI_NODATA;
#else
        bool nodata = false;
#endif
        dns_answer(q,
                   nx       ? RC_NXDOMAIN
                   : nodata ? RC_NOERROR
                            : RC_SERVFAIL,
                   NULL, 0, true, resolve_error(j->rc));
        return;
    }
    sp_egp_addr_t pass[MAX_ADDRS];
    int n = 0, removed = 0;
    char first[128] = "";
    for (int i = 0; i < j->n; i++) {
        sp_egp_addr_t a;
        char why[128];
        if (sp_egp_addr_from_sockaddr((struct sockaddr *)&j->addrs[i], &a) < 0)
            continue;
        if (sp_egp_check_addr(q->sb->policy, &a, 0, q->by_name, why, sizeof(why)))
            pass[n++] = a;
        else if (removed++ == 0)
            snprintf(first, sizeof(first), "addresses removed: %.100s", why);
    }
    dns_answer(q, RC_NOERROR, pass, n, n > 0 || removed == 0, removed ? first : NULL);
}

static void dns_decide(struct dnsq *q)
{
    struct sb *sb = q->sb;
    if (!sb_ready(sb)) {
        q->waiting = true;
        return;
    }
    q->waiting = false;
    char why[160];
    if (!sp_egp_check_name(sb->policy, q->name, 0, &q->by_name, why, sizeof(why))) {
        dns_answer(q, RC_NXDOMAIN, NULL, 0, false, why);
        return;
    }
    if (q->qtype != 1 && q->qtype != 28) {
        dns_answer(q, RC_NOERROR, NULL, 0, true, NULL); /* allowed name, no such records here */
        return;
    }
    q->job = resolve_start(sb, q->name, q->qtype == 1 ? AF_INET : AF_INET6, dns_on_resolved, q);
    if (q->job == NULL)
        dns_answer(q, RC_SERVFAIL, NULL, 0, true, "out of memory");
}

static void on_dns_timer(sp_timer_t *t, void *arg)
{
    struct dnsq *q = arg;
    if (q->waiting)
        dns_answer(q, RC_SERVFAIL, NULL, 0, false, "egress policy is not available");
    else
        dns_answer(q, RC_SERVFAIL, NULL, 0, true, "name lookup timed out");
}

static void dns_frame(sp_agentstream_t *s, uint16_t type, uint16_t flags, const uint8_t *p,
                      size_t len, void *arg)
{
    struct dnsq *q = arg;
    if (flags & SP_AP_F_END) {
        q->st = NULL;
        dns_free(q);
    }
}

static void dns_error(sp_agentstream_t *s, const sp_err_t *err, void *arg)
{
    struct dnsq *q = arg;
    q->st = NULL;
    dns_free(q);
}

static const sp_agentstream_cbs_t dns_cbs = {dns_frame, dns_error, NULL};

/* Parses a query's header and question into q; the rcode to answer with on failure, or -1
 * when not even a header is there. */
static int dns_parse(struct dnsq *q, const uint8_t *m, size_t n)
{
    if (n < 12)
        return -1;
    uint16_t flags = (uint16_t)(m[2] << 8 | m[3]);
    uint16_t qd = (uint16_t)(m[4] << 8 | m[5]);
    memcpy(q->msg, m, 12);
    q->msg[4] = 0;
    q->msg[5] = 0; /* a refusal before the question is parsed carries none */
    q->msg_len = 12;
    if (flags & 0x8000)
        return RC_FORMERR;
    if (((flags >> 11) & 0xf) != 0)
        return RC_NOTIMP;
    if (qd != 1)
        return RC_FORMERR;
    size_t off = 12, nl = 0;
    char name[SP_EGP_NAME_MAX + 2];
    for (;;) {
        if (off >= n)
            return RC_FORMERR;
        unsigned l = m[off++];
        if (l == 0)
            break;
        if (l > 63 || off + l > n || nl + l + 1 > SP_EGP_NAME_MAX + 1)
            return RC_FORMERR; /* compression pointers have no place in a question */
        if (nl > 0)
            name[nl++] = '.';
        memcpy(name + nl, m + off, l);
        nl += l;
        off += l;
    }
    if (off + 4 > n || off + 4 > sizeof(q->msg))
        return RC_FORMERR;
    q->qtype = (uint16_t)(m[off] << 8 | m[off + 1]);
    uint16_t qclass = (uint16_t)(m[off + 2] << 8 | m[off + 3]);
    off += 4;
    memcpy(q->msg, m, off);
    q->msg[4] = 0;
    q->msg[5] = 1;
    memset(q->msg + 6, 0, 6);
    q->msg_len = off;
    if (nl == 0)
        return RC_REFUSED;
    sp_egp_addr_t a;
    if (memchr(name, '\0', nl) != NULL ||
        sp_egp_host_parse(name, nl, q->name, &a) != SP_EGP_HOST_NAME) {
        snprintf(q->name, sizeof(q->name), "?");
        return RC_NXDOMAIN;
    }
    if (qclass != 1)
        return RC_REFUSED;
    return RC_NOERROR;
}

/* ---- attaching to a sandbox's channel ---- */

static int on_accept(void *arg, sp_agentstream_t *s, uint16_t type, const uint8_t *payload,
                     size_t len, sp_agentstream_cbs_t *cbs, void **sarg)
{
    struct sb *sb = arg;
    sp_egress_t *eg = sb->eg;
    if (sb->dead)
        return -1;
    if (type == SP_AP_T_DNS_QUERY) {
        if (sb->ndns >= SP_EGRESS_MAX_DNS)
            return -1;    /* the agent answers SERVFAIL */
        sp_ap_field_t qs; /* raw bytes: NULs are fine */
        if (sp_ap_find(payload, len, SP_AP_K_QUERY, &qs) != 1)
            return -1;
        struct dnsq *q = calloc(1, sizeof(*q));
        if (q == NULL)
            return -1;
        q->sb = sb;
        q->st = s;
        sp_timer_init(&q->timer, eg->loop, on_dns_timer, q);
        q->next = sb->dnsqs;
        if (q->next)
            q->next->prev = q;
        sb->dnsqs = q;
        sb->ndns++;
        eg->st.dns++;
        *cbs = dns_cbs;
        *sarg = q;
        int rc = dns_parse(q, qs.val, qs.len);
        if (rc < 0) {
            q->st = NULL;
            dns_free(q);
            return -1;
        }
        if (rc != RC_NOERROR) {
            dns_answer(q, rc, NULL, 0, false, "malformed or unsupported query");
            return 0;
        }
        sp_timer_start(&q->timer, DNS_WAIT_MS);
        dns_decide(q);
        return 0;
    }
    if (type != SP_AP_T_EGRESS_OPEN)
        return -1;
    uint32_t kind = 0;
    if (sp_ap_get_u32(payload, len, SP_AP_K_KIND, &kind) < 0 || kind != SP_AP_EGRESS_PROXY)
        return -1;
    if (sb->nconns >= SP_EGRESS_MAX_CONNS) {
        sp_log(SP_LOG_WARN, "egress", "connection limit sandbox=%s limit=%u", sb->id,
               SP_EGRESS_MAX_CONNS);
        return -1;
    }
    struct pconn *pc = calloc(1, sizeof(*pc));
    if (pc == NULL)
        return -1;
    pc->sb = sb;
    pc->st = s;
    pc->fd = -1;
    pc->t0 = sp_loop_now_ms(eg->loop);
    sp_timer_init(&pc->timer, eg->loop, on_pc_timer, pc);
    sp_timer_start(&pc->timer, SP_EGRESS_HEAD_TIMEOUT_MS);
    pc->next = sb->conns;
    if (pc->next)
        pc->next->prev = pc;
    sb->conns = pc;
    sb->nconns++;
    eg->st.conns++;
    *cbs = pc_cbs;
    *sarg = pc;
    return 0;
}

static void cfg_frame(sp_agentstream_t *s, uint16_t type, uint16_t flags, const uint8_t *p,
                      size_t len, void *arg)
{
    struct sb *sb = arg;
    if (!(flags & SP_AP_F_END))
        return;
    sb->cfg = NULL;
    if (type == SP_AP_T_OK) {
        sp_log(SP_LOG_DEBUG, "egress", "guest proxy configured sandbox=%s", sb->id);
        return;
    }
    sp_ap_error_t e;
    sp_err_t err;
    char msg[128] = "";
    if (type == SP_AP_T_ERROR && sp_ap_dec_error(p, len, &e, &err) == 0 && e.msg.p != NULL)
        snprintf(msg, sizeof(msg), "%.*s", (int)(e.msg.n > 100 ? 100 : e.msg.n), e.msg.p);
    sp_log(SP_LOG_WARN, "egress", "guest refused the egress config sandbox=%s err=%s", sb->id, msg);
}

static void cfg_error(sp_agentstream_t *s, const sp_err_t *err, void *arg)
{
    struct sb *sb = arg;
    sb->cfg = NULL;
}

static const sp_agentstream_cbs_t cfg_cbs = {cfg_frame, cfg_error, NULL};

static void put_env(void *arg, const char *kv)
{
    sp_ap_put_str(arg, SP_AP_K_ENV, kv);
}

static void sb_send_config(struct sb *sb)
{
    if (sb->conn == NULL || !sp_agentconn_up(sb->conn))
        return;
    if (!(sp_agentconn_caps(sb->conn) & SP_AP_CAP_EGRESS)) {
        sp_log(SP_LOG_INFO, "egress",
               "agent has no egress support sandbox=%s (rebuild the "
               "template); the guest has no way out",
               sb->id);
        return;
    }
    if (sb->cfg != NULL) {
        sp_agentstream_t *old = sb->cfg;
        sb->cfg = NULL;
        sp_agentstream_reset(old);
    }
    uint16_t port = test_hooks.guest_port ? test_hooks.guest_port : SP_EGRESS_GUEST_PORT;
    char proxy[64];
    snprintf(proxy, sizeof(proxy), "http://127.0.0.1:%u", (unsigned)port);
    uint8_t buf[16384]; /* room for the placeholders of SP_SECRETS_RULES_MAX rules */
    sp_ap_writer_t w;
    sp_ap_writer_init(&w, buf, sizeof(buf));
    sp_ap_put_u32(&w, SP_AP_K_PROXY_PORT, port);
    sp_ap_put_u32(&w, SP_AP_K_DNS, test_hooks.no_dns ? 0 : 1);
    static const char *const names[] = {"HTTP_PROXY", "HTTPS_PROXY", "http_proxy", "https_proxy"};
    char kv[160];
    for (size_t i = 0; i < 4; i++) {
        snprintf(kv, sizeof(kv), "%s=%s", names[i], proxy);
        sp_ap_put_str(&w, SP_AP_K_ENV, kv);
    }
    sp_ap_put_str(&w, SP_AP_K_ENV, "NO_PROXY=localhost,127.0.0.1,::1");
    sp_ap_put_str(&w, SP_AP_K_ENV, "no_proxy=localhost,127.0.0.1,::1");
    if (sb->eg->mitm != NULL) {
        size_t n = 0;
        const char *const *env = sp_mitm_guest_env(&n);
        for (size_t i = 0; i < n; i++)
            sp_ap_put_str(&w, SP_AP_K_ENV, env[i]);
    }
    /* Credential placeholders (core/egress/mitm.h): names of secrets, never their values. */
    if (sb->mitm != NULL)
        sp_mitm_sb_placeholders(sb->mitm, put_env, &w);
    sp_err_t e;
    if (w.overflow) {
        sp_log(SP_LOG_ERROR, "egress", "egress config too large sandbox=%s", sb->id);
        return;
    }
    sb->cfg = sp_agentconn_open(sb->conn, SP_AP_T_EGRESS_CONFIG, buf, w.len, &cfg_cbs, sb, &e);
    if (sb->cfg == NULL)
        sp_log(SP_LOG_WARN, "egress", "egress config not sent sandbox=%s err=%s", sb->id, e.msg);
}

static void sb_close_all(struct sb *sb)
{
    while (sb->conns != NULL)
        pc_close(sb->conns, CLOSE_ERROR, "egress proxy stopped");
    while (sb->dnsqs != NULL)
        dns_free(sb->dnsqs);
}

static void sb_unlink(struct sb *sb)
{
    sp_egress_t *eg = sb->eg;
    if (sb->prev)
        sb->prev->next = sb->next;
    else if (eg->sbs == sb)
        eg->sbs = sb->next;
    if (sb->next)
        sb->next->prev = sb->prev;
    sb->prev = sb->next = NULL;
}

/* Frees a dead sandbox once nothing refers to it any more. */
static void sb_maybe_free(struct sb *sb)
{
    if (!sb->dead || sb->loading || sb->mitm_opening || sb->conns != NULL || sb->dnsqs != NULL ||
        sb->resolving > 0)
        return;
    sb_dispatch(sb); /* only cancelled jobs are left waiting: this frees them */
    sp_timer_stop(&sb->retry);
    sp_egp_free(sb->policy);
    free(sb);
}

static void sb_policy_ready(struct sb *sb)
{
    if (!sb_ready(sb))
        return;
    for (struct pconn *pc = sb->conns, *next; pc != NULL; pc = next) {
        next = pc->next;
        if (pc->phase == PH_WAIT)
            pc_decide(pc); /* may close pc, never another */
    }
    for (struct dnsq *q = sb->dnsqs, *next; q != NULL; q = next) {
        next = q->next;
        if (q->waiting)
            dns_decide(q);
    }
}

static void sb_load(struct sb *sb);

static void on_policy(void *arg, PGresult *res, const sp_err_t *err)
{
    struct sb *sb = arg;
    sp_egress_t *eg = sb->eg;
    sb->loading = false;
    eg->inflight--;
    if (eg->dying) {
        sb->dead = true;
        sb_maybe_free(sb);
        egress_maybe_free(eg);
        return;
    }
    if (sb->dead) {
        sb_maybe_free(sb);
        return;
    }
    if (err != NULL) {
        sp_log(SP_LOG_WARN, "egress", "policy load failed sandbox=%s err=%s (retrying)", sb->id,
               err->msg);
        sp_timer_start(&sb->retry, POLICY_RETRY_MS);
        return;
    }
    if (sb->reload) { /* changed while this was in flight: the answer may be the old one */
        sb->reload = false;
        if (PQntuples(res) == 1)
            snprintf(sb->team, sizeof(sb->team), "%s", PQgetvalue(res, 0, 0));
        sb_load(sb);
        return;
    }
    sp_egp_t *p = NULL;
    if (PQntuples(res) != 1) {
        sp_log(SP_LOG_WARN, "egress", "no sandbox row sandbox=%s: everything denied", sb->id);
        p = sp_egp_default();
        if (p != NULL)
            p->internet = false;
    } else {
        snprintf(sb->team, sizeof(sb->team), "%s", PQgetvalue(res, 0, 0));
        const char *js = PQgetvalue(res, 0, 1);
        int aia = atoi(PQgetvalue(res, 0, 2));
        if (js[0] != '\0') {
            json_t *o = json_loads(js, 0, NULL);
            sp_err_t e;
            p = o ? sp_egp_from_json(o, "egress", &e) : NULL;
            json_decref(o);
            if (p == NULL) {
                sp_log(SP_LOG_ERROR, "egress",
                       "stored policy unreadable sandbox=%s: everything "
                       "denied",
                       sb->id);
                p = sp_egp_default();
                if (p != NULL)
                    p->internet = false;
            }
        } else {
            p = sp_egp_default();
            if (p != NULL)
                p->internet = aia != 0; /* E2B allow_internet_access=false */
        }
    }
    if (p == NULL) {
        sp_timer_start(&sb->retry, POLICY_RETRY_MS);
        return;
    }
    sp_egp_free(sb->policy);
    sb->policy = p;
    sp_log(SP_LOG_DEBUG, "egress", "policy loaded sandbox=%s internet=%d allow=%zu deny=%zu",
           sb->id, (int)p->internet, p->nallow, p->ndeny);
    sb_policy_ready(sb);
}

static void sb_load(struct sb *sb)
{
    sp_egress_t *eg = sb->eg;
    if (sb->loading) {
        sb->reload = true;
        return;
    }
    if (strchr(sb->id, ':') != NULL) {
        /* not a sandbox (a spare clone, core/runtime/qemu/pool.c, until a sandbox takes it): no
         * row to read, nothing goes out */
        sp_egp_t *p = sp_egp_default();
        if (p == NULL) {
            sp_timer_start(&sb->retry, POLICY_RETRY_MS);
            return;
        }
        p->internet = false;
        sp_egp_free(sb->policy);
        sb->policy = p;
        sb_policy_ready(sb);
        return;
    }
    const char *p[] = {sb->id};
    sp_err_t e;
    if (sp_store_query(eg->store,
                       "SELECT team_id, coalesce(egress::text, ''),"
                       " coalesce(allow_internet_access::int, -1) FROM sandboxes WHERE id = $1",
                       1, p, on_policy, sb, &e) < 0) {
        sp_timer_start(&sb->retry, POLICY_RETRY_MS);
        return;
    }
    sb->loading = true;
    eg->inflight++;
}

static void on_sb_retry(sp_timer_t *t, void *arg)
{
    struct sb *sb = arg;
    if (!sb->dead)
        sb_load(sb);
}

/* The sandbox's rule placeholders changed: later processes get the new set. */
static void on_mitm_env(void *arg, struct sp_mitm_sb *h)
{
    struct sb *sb = arg;
    if (!sb->dead && sb->mitm == h)
        sb_send_config(sb);
}

static void sb_open_mitm(struct sb *sb);

static void on_mitm_open(void *arg, struct sp_mitm_sb *h, const sp_err_t *err)
{
    struct sb *sb = arg;
    sp_egress_t *eg = sb->eg;
    sb->mitm_opening = false;
    eg->inflight--;
    if (sb->dead || eg->dying) {
        if (h != NULL)
            sp_mitm_sb_close(h);
        sb->dead = true;
        sb_maybe_free(sb);
        if (eg->dying)
            egress_maybe_free(eg);
        return;
    }
    if (sb->mitm_stale) { /* opened for the old name */
        sb->mitm_stale = false;
        if (h != NULL)
            sp_mitm_sb_close(h);
        sb_open_mitm(sb);
        return;
    }
    if (err != NULL)
        sp_log(SP_LOG_WARN, "egress",
               "credentials unavailable sandbox=%s err=%s (passing "
               "through)",
               sb->id, err->msg);
    sb->mitm = h;
    if (h != NULL) {
        sp_mitm_sb_on_env(h, on_mitm_env, sb);
        /* The config may have gone out before the rules were loaded. */
        if (sp_mitm_sb_placeholders(h, NULL, NULL) > 0)
            sb_send_config(sb);
    }
    sb_policy_ready(sb);
}

/* Opens the sandbox's credential handle (core/egress/mitm.h) when credential injection is on. */
static void sb_open_mitm(struct sb *sb)
{
    sp_egress_t *eg = sb->eg;
    if (eg->mitm == NULL || sb->mitm != NULL || sb->mitm_opening || sb->conn == NULL ||
        strchr(sb->id, ':') != NULL) /* no sandbox (sb_load), no credentials */
        return;
    sp_err_t e;
    sb->mitm_opening = true;
    eg->inflight++;
    if (sp_mitm_sb_open(eg->mitm, sb->id, sb->conn, on_mitm_open, sb, &e) < 0) {
        sb->mitm_opening = false;
        eg->inflight--;
        sp_log(SP_LOG_WARN, "egress", "credentials unavailable sandbox=%s err=%s", sb->id, e.msg);
    }
}

static void on_conn_event(void *arg, sp_agentconn_t *c, sp_agentconn_event_t ev)
{
    struct sb *sb = arg;
    if (ev == SP_AGENTCONN_UP) {
        sb_send_config(sb);
        return;
    }
    if (ev == SP_AGENTCONN_DOWN) {
        sb->cfg = NULL; /* failed with the channel */
        return;
    }
    /* GONE: the channel is being freed; every stream on it has already failed. */
    sb->conn = NULL;
    sb->lis = NULL;
    sb->cfg = NULL;
    sb_close_all(sb);
    if (sb->mitm != NULL) {
        sp_mitm_sb_close(sb->mitm);
        sb->mitm = NULL;
    }
    sb_unlink(sb);
    sb->eg->st.sandboxes--;
    sb->dead = true;
    sb_maybe_free(sb);
}

/* The channel's VM now belongs to sandbox id (a spare clone taken by a sandbox,
 * core/runtime/qemu/pool.c): what was decided under the old name goes, the new one's policy and
 * credentials load, and the config goes out again (the agent leaves files that did not change
 * alone). */
static void sb_rename(struct sb *sb, const char *id)
{
    if (strcmp(sb->id, id) == 0)
        return;
    sp_log(SP_LOG_DEBUG, "egress", "channel renamed sandbox=%s was=%s", id, sb->id);
    snprintf(sb->id, sizeof(sb->id), "%s", id);
    sb->team[0] = '\0';
    sb_close_all(sb);
    sp_egp_free(sb->policy);
    sb->policy = NULL; /* connections wait for the new one */
    if (sb->mitm != NULL) {
        sp_mitm_sb_close(sb->mitm);
        sb->mitm = NULL;
    }
    if (sb->mitm_opening)
        sb->mitm_stale = true;
    sb_load(sb);
    sb_open_mitm(sb);
    if (sp_agentconn_up(sb->conn))
        sb_send_config(sb);
}

static void on_named(void *arg, sp_agentconn_t *c, const char *sandbox_id)
{
    sp_egress_t *eg = arg;
    for (struct sb *x = eg->sbs; x != NULL; x = x->next) {
        if (x->conn == c && !x->dead) {
            sb_rename(x, sandbox_id);
            return;
        }
    }
    struct sb *sb = calloc(1, sizeof(*sb));
    if (sb == NULL) {
        sp_log(SP_LOG_ERROR, "egress", "out of memory attaching sandbox=%s", sandbox_id);
        return;
    }
    sb->eg = eg;
    sb->conn = c;
    snprintf(sb->id, sizeof(sb->id), "%s", sandbox_id);
    sp_timer_init(&sb->retry, eg->loop, on_sb_retry, sb);
    sb->lis = sp_agentconn_listen(c, on_conn_event, sb);
    if (sb->lis == NULL) {
        free(sb);
        sp_log(SP_LOG_ERROR, "egress", "cannot listen on the channel sandbox=%s", sandbox_id);
        return;
    }
    sp_agentconn_set_acceptor(c, on_accept, sb);
    sb->next = eg->sbs;
    if (sb->next)
        sb->next->prev = sb;
    eg->sbs = sb;
    eg->st.sandboxes++;
    sb_load(sb);
    sb_open_mitm(sb);
    if (sp_agentconn_up(c))
        sb_send_config(sb);
}

/* ---- notifications ---- */

void sp_egress_policy_changed(sp_egress_t *eg, const char *sandbox_id)
{
    if (eg == NULL || eg->dying)
        return;
    for (struct sb *sb = eg->sbs; sb != NULL; sb = sb->next)
        if (sandbox_id == NULL || strcmp(sb->id, sandbox_id) == 0)
            sb_load(sb);
}

void sp_egress_policy_set(sp_egress_t *eg, const char *sandbox_id, const json_t *policy)
{
    if (eg == NULL || eg->dying || sandbox_id == NULL)
        return;
    for (struct sb *sb = eg->sbs; sb != NULL; sb = sb->next) {
        if (strcmp(sb->id, sandbox_id) != 0)
            continue;
        sp_err_t e;
        sp_egp_t *p = sp_egp_from_json(policy, "egress", &e);
        if (p == NULL) { /* cannot happen for a stored policy; reload it instead */
            sb_load(sb);
            continue;
        }
        sp_egp_free(sb->policy);
        sb->policy = p;
        if (sb->loading)
            sb->reload = true; /* a load in flight may hold the old one */
        sb_policy_ready(sb);
    }
}

static void on_notify(void *arg, const char *channel, const char *payload)
{
    sp_egress_policy_changed(arg, payload); /* NULL (listener reconnected): reload all */
}

/* ---- lifetime ---- */

static void raise_nofile(void)
{
    /* Every proxied connection holds a socket (and the loop a dup of it): lift the soft limit
     * to the hard one, up to 65536. */
    struct rlimit rl;
    if (getrlimit(RLIMIT_NOFILE, &rl) == 0 && rl.rlim_cur < rl.rlim_max && rl.rlim_cur < 65536) {
        rlim_t want = rl.rlim_max < 65536 ? rl.rlim_max : 65536;
        rl.rlim_cur = want;
        if (setrlimit(RLIMIT_NOFILE, &rl) < 0)
            sp_log(SP_LOG_WARN, "egress", "cannot raise the open files limit err=%s",
                   strerror(errno));
    }
}

sp_egress_t *sp_egress_create(sp_loop_t *loop, sp_store_t *store, const sp_egress_opts_t *o,
                              sp_err_t *err)
{
    sp_egress_t *eg = calloc(1, sizeof(*eg));
    if (eg == NULL) {
        sp_err_set(err, SP_EINTERNAL, "out of memory");
        return NULL;
    }
    eg->loop = loop;
    eg->store = store;
    if (o != NULL)
        eg->o = *o;
    if (eg->o.resolver_threads <= 0)
        eg->o.resolver_threads = 8;
    if (eg->o.connect_timeout_ms == 0)
        eg->o.connect_timeout_ms = 10000;
    if (eg->o.log_flush_ms == 0)
        eg->o.log_flush_ms = 250;
    eg->efd = -1;
    eg->rows = calloc(LOG_MAX_PENDING, sizeof(eg->rows[0]));
    eg->threads = calloc((size_t)eg->o.resolver_threads, sizeof(pthread_t));
    if (eg->rows == NULL || eg->threads == NULL) {
        free(eg->rows);
        free(eg->threads);
        free(eg);
        sp_err_set(err, SP_EINTERNAL, "out of memory");
        return NULL;
    }
    pthread_mutex_init(&eg->mu, NULL);
    pthread_cond_init(&eg->cv, NULL);
    sp_timer_init(&eg->flush, loop, on_flush, eg);
    eg->efd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    if (eg->efd >= 0)
        eg->ew = sp_watch_create(loop, eg->efd, on_resolved, eg);
    if (eg->ew == NULL) {
        sp_err_set(err, SP_EINTERNAL, "cannot set up the resolver queue");
        goto fail;
    }
    sp_watch_set(eg->ew, SP_IO_READ);
    /* The threads start with every signal blocked: the server takes SIGTERM through a
     * signalfd on the loop thread, and a thread that could receive it would die of it. */
    sigset_t all, old;
    sigfillset(&all);
    pthread_sigmask(SIG_SETMASK, &all, &old);
    for (int i = 0; i < eg->o.resolver_threads; i++) {
        if (pthread_create(&eg->threads[i], NULL, resolver_main, eg) != 0)
            break;
        eg->nthreads++;
    }
    pthread_sigmask(SIG_SETMASK, &old, NULL);
    if (eg->nthreads < eg->o.resolver_threads) {
        sp_err_set(err, SP_EINTERNAL, "cannot start resolver threads");
        goto fail;
    }
    if (store != NULL && sp_store_listen(store, SP_EGRESS_NOTIFY, on_notify, eg, err) < 0)
        goto fail;
    raise_nofile();
    sp_agentconn_set_hook(on_named, eg);
    return eg;
fail:
    pthread_mutex_lock(&eg->mu);
    eg->stop = true;
    pthread_cond_broadcast(&eg->cv);
    pthread_mutex_unlock(&eg->mu);
    for (int i = 0; i < eg->nthreads; i++)
        pthread_join(eg->threads[i], NULL);
    sp_watch_destroy(eg->ew);
    if (eg->efd >= 0)
        close(eg->efd);
    free(eg->rows);
    free(eg->threads);
    free(eg);
    return NULL;
}

void sp_egress_set_mitm(sp_egress_t *eg, struct sp_mitm *m)
{
    eg->mitm = m;
    /* Channels attached before (VMs re-adopted at start): their handles, and the guest env
     * that points programs at the sandbox CA. */
    for (struct sb *sb = eg->sbs; sb != NULL && m != NULL; sb = sb->next) {
        sb_open_mitm(sb);
        if (sb->conn != NULL && sp_agentconn_up(sb->conn))
            sb_send_config(sb);
    }
}

void sp_egress_stats(const sp_egress_t *eg, sp_egress_stats_t *out)
{
    *out = eg->st;
}

static void egress_maybe_free(sp_egress_t *eg)
{
    if (eg->inflight > 0)
        return;
    free(eg->rows);
    free(eg);
}

void sp_egress_destroy(sp_egress_t *eg)
{
    if (eg == NULL)
        return;
    sp_agentconn_set_hook(NULL, NULL);
    eg->dying = true;
    sp_timer_stop(&eg->flush);
    while (eg->sbs != NULL) {
        struct sb *sb = eg->sbs;
        sb_unlink(sb);
        sb_close_all(sb);
        if (sb->conn != NULL) {
            sp_agentconn_set_acceptor(sb->conn, NULL, NULL);
            sp_agentconn_unlisten(sb->lis);
            if (sb->cfg != NULL)
                sp_agentstream_reset(sb->cfg);
        }
        sb->cfg = NULL;
        sb->conn = NULL;
        if (sb->mitm != NULL)
            sp_mitm_sb_close(sb->mitm);
        sb->mitm = NULL;
        sb->dead = true;
        sb_maybe_free(sb);
    }
    pthread_mutex_lock(&eg->mu);
    eg->stop = true;
    pthread_cond_broadcast(&eg->cv);
    pthread_mutex_unlock(&eg->mu);
    for (int i = 0; i < eg->nthreads; i++)
        pthread_join(eg->threads[i], NULL);
    /* Lookups that will never be delivered now: their sandboxes (dead) can go. */
    struct rjob *lists[2] = {eg->q_head, eg->d_head};
    eg->q_head = eg->d_head = NULL;
    for (int l = 0; l < 2; l++)
        for (struct rjob *j = lists[l], *n; j != NULL; j = n) {
            n = j->next;
            struct sb *sb = j->sb;
            free(j);
            sb->resolving--;
            sb_maybe_free(sb);
        }
    sp_watch_destroy(eg->ew);
    close(eg->efd);
    pthread_mutex_destroy(&eg->mu);
    pthread_cond_destroy(&eg->cv);
    free(eg->threads);
    eg->threads = NULL;
    egress_maybe_free(eg);
}
