/*
 * proxy.c - the egress proxy's connections (EGRESS_OPEN streams): reads the
 * guest's request (CONNECT host:port, or a plain-HTTP request in absolute form)
 * through http1.h, decides on the destination (policy, then every address it
 * resolves to), connects, and relays bytes both ways, or hands the connection
 * to the credential relay (core/egress/mitm.h).
 *
 * Owns one `struct pconn` per proxied connection (guest bytes not yet
 * forwarded, the upstream socket, its lookup and audit fields). Memory per
 * connection is bounded by the windows: guest bytes sit in pc->g until the
 * upstream socket takes them and only then are granted back to the agent (at
 * most one window, SP_AP_INITIAL_WINDOW, is ever outstanding), and the upstream
 * socket is read only as far as the agent's credit goes, into one shared buffer
 * (eg->rbuf), so nothing waits on the host in that direction.
 *
 * Memory across connections: every byte of credit is charged to the budget
 * (core/egress/egmem.h) before the agent gets it, the first window when the
 * stream opens (SP_EGRESS_OPEN_WINDOW when the agent takes it from
 * EGRESS_CONFIG, else SP_AP_INITIAL_WINDOW; a first window that does not fit:
 * 503), the rise to SP_AP_INITIAL_WINDOW once connected, each grant after;
 * bytes the upstream took are released. Credit that does not fit waits in the
 * sandbox's queue (sb->wq, oldest first, partial grants of at least GRANT_MIN)
 * and is granted as memory comes back (mem_kick), the sandbox's own first, then
 * those of sandboxes the global limit held back (eg->gwait).
 *
 * Lifetimes: a pconn is freed by pc_close, which may run inside its stream's
 * callbacks (the stream is ended there; agentconn frees it when the callback
 * returns) or its watch's callback (sp_watch_destroy is safe there); callers
 * return at once after it.
 */
#include <errno.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/socket.h>
#include <unistd.h>

#include "base/buf.h"
#include "base/log.h"
#include "base/metrics.h"
#include "core/egress/egress_int.h"
#include "core/egress/http1.h"
#include "core/egress/mitm.h"
#include "core/egress/sni.h"

static sp_metric_t m_conns = SP_METRIC_COUNTER(
    "space_egress_connections_total", "Proxied connections guests opened (CONNECT or plain HTTP).",
    "");

#define GRANT_BATCH    (64u * 1024u) /* credit given back in steps of this much */
#define GRANT_MIN      4096u         /* less than this is not granted while more is owed */
#define READS_PER_TURN 4             /* upstream reads per readiness callback */

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

struct pconn {
    struct sb *sb;
    struct pconn *prev, *next;
    sp_agentstream_t *st; /* NULL once ended or failed */
    enum phase phase;
    sp_timer_t timer;
    uint64_t t0;

    /* guest bytes received and not yet consumed (= not yet granted back) */
    sp_buf_t g;
    size_t g_off;
    size_t grant_pending; /* credit owed to the agent, not yet charged and granted */
    bool g_eof;

    /* memory (egmem.h) */
    size_t charged;    /* what it holds of the budget: records, credit out, heads, relay */
    bool small_window; /* opened with SP_EGRESS_OPEN_WINDOW */
    bool grown;        /* raised to SP_AP_INITIAL_WINDOW */
    bool refused;      /* no memory for it: answered 503 on the next loop turn */
    bool waiting;      /* in sb->wq, for credit */
    struct pconn *wprev, *wnext;

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
    size_t fwd_ok;         /* bytes at g_off known to belong to the body */
    sp_http1_chunked_t cs; /* BODY_CHUNKED: where the body ends */
    bool cs_done;

    /* deciding and connecting */
    bool by_name;
    struct rjob *job;
    sp_egp_addr_t addrs[SP_EGRESS__MAX_ADDRS];
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

/* ---- memory (core/egress/egmem.h) ---- */

/* Logs the first refusal of an episode (egmem.h): once per sandbox for its share, once for the
 * host's limit, until usage falls below half again. */
static void mem_refused(struct sb *sb, sp_egmem_rc_t rc, bool first)
{
    sp_egress_t *eg = sb->eg;
    if (!first)
        return;
    if (rc == SP_EGMEM_GLOBAL)
        sp_log(SP_LOG_WARN, "egress",
               "egress memory limit reached limit_mb=%llu used_mb=%llu sandboxes=%u: new "
               "connections get 503 and open ones wait for credit until it drains",
               (unsigned long long)(eg->mem.limit >> 20), (unsigned long long)(eg->mem.used >> 20),
               eg->mem.sandboxes);
    else
        sp_log(SP_LOG_INFO, "egress",
               "egress memory share used sandbox=%s share_kb=%llu used_kb=%llu conns=%u", sb->id,
               (unsigned long long)(sp_egmem_share(&eg->mem) >> 10),
               (unsigned long long)(sb->mem.used >> 10), sb->nconns);
}

/* Charges n to pc's sandbox, leaving keep free; false (nothing charged, *rc why) when it
 * does not fit. */
static bool pc_charge_keep(struct pconn *pc, size_t n, uint64_t keep, sp_egmem_rc_t *rc)
{
    struct sb *sb = pc->sb;
    bool first;
    sp_egmem_rc_t r = sp_egmem_charge_keep(&sb->eg->mem, &sb->mem, n, keep, &first);
    if (rc != NULL)
        *rc = r;
    if (r != SP_EGMEM_OK) {
        mem_refused(sb, r, first);
        return false;
    }
    pc->charged += n;
    return true;
}

static bool pc_charge(struct pconn *pc, size_t n, sp_egmem_rc_t *rc)
{
    return pc_charge_keep(pc, n, 0, rc);
}

static void gwait_add(struct sb *sb)
{
    sp_egress_t *eg = sb->eg;
    if (sb->in_gwait)
        return;
    sb->in_gwait = true;
    sb->gwait_next = NULL;
    if (eg->gwait_tail != NULL)
        eg->gwait_tail->gwait_next = sb;
    else
        eg->gwait = sb;
    eg->gwait_tail = sb;
}

static void gwait_remove(struct sb *sb)
{
    sp_egress_t *eg = sb->eg;
    if (!sb->in_gwait)
        return;
    struct sb *prev = NULL;
    for (struct sb *x = eg->gwait; x != NULL; prev = x, x = x->gwait_next) {
        if (x != sb)
            continue;
        if (prev != NULL)
            prev->gwait_next = x->gwait_next;
        else
            eg->gwait = x->gwait_next;
        if (eg->gwait_tail == x)
            eg->gwait_tail = prev;
        break;
    }
    sb->in_gwait = false;
    sb->gwait_next = NULL;
}

static void wq_remove(struct pconn *pc)
{
    struct sb *sb = pc->sb;
    if (!pc->waiting)
        return;
    if (pc->wprev != NULL)
        pc->wprev->wnext = pc->wnext;
    else
        sb->wq = pc->wnext;
    if (pc->wnext != NULL)
        pc->wnext->wprev = pc->wprev;
    else
        sb->wq_tail = pc->wprev;
    pc->wprev = pc->wnext = NULL;
    pc->waiting = false;
    sb->eg->st.mem_waiting--;
    if (sb->wq == NULL)
        gwait_remove(sb);
}

/* Grants pc as much of its pending credit as the budget takes, short of the quarter of the
 * share kept for first windows (at least GRANT_MIN of it, or all when less is pending); what
 * is left waits in the sandbox's queue, oldest first. True when nothing is left pending. */
static bool pc_try_grant(struct pconn *pc)
{
    struct sb *sb = pc->sb;
    sp_egress_t *eg = sb->eg;
    size_t want = pc->grant_pending;
    /* The last quarter of the share is kept for first windows: connections that are moving
     * bytes never take all of it, so new ones still open. */
    uint64_t room = sp_egmem_room(&eg->mem, &sb->mem), keep = sp_egmem_share(&eg->mem) / 4;
    room = room > keep ? room - keep : 0;
    size_t n = want < room ? want : (size_t)room;
    size_t min = want < GRANT_MIN ? want : GRANT_MIN;
    sp_egmem_rc_t rc = SP_EGMEM_OK;
    if (n < min) {
        /* Refused (room < want): counted, and its episode logged, by the charge's refusal. */
        pc_charge_keep(pc, want, keep, &rc);
        n = 0;
    } else if (!pc_charge_keep(pc, n, keep, &rc)) { /* cannot be: n fits the room */
        n = 0;
    }
    if (n > 0) {
        sp_agentstream_grant(pc->st, (uint32_t)n);
        pc->grant_pending -= n;
    }
    if (pc->grant_pending == 0) {
        wq_remove(pc);
        return true;
    }
    if (!pc->waiting) {
        pc->waiting = true;
        pc->wprev = sb->wq_tail;
        pc->wnext = NULL;
        if (sb->wq_tail != NULL)
            sb->wq_tail->wnext = pc;
        else
            sb->wq = pc;
        sb->wq_tail = pc;
        eg->st.mem_waiting++;
    }
    if (n == 0 && rc == SP_EGMEM_GLOBAL)
        gwait_add(sb);
    return false;
}

/* Serves sb's waiting connections, oldest first, while there is room. False when one still
 * waits. */
static bool sb_serve(struct sb *sb)
{
    while (sb->wq != NULL) {
        struct pconn *pc = sb->wq;
        if (pc->st == NULL) {
            wq_remove(pc); /* closing: nothing to grant */
            continue;
        }
        if (!pc_try_grant(pc))
            return false;
    }
    return true;
}

/* Memory came back to sb: its waiting connections first, then those of sandboxes the global
 * limit held back, in the order they started waiting. */
static void mem_kick(struct sb *sb)
{
    sb_serve(sb);
    sp_egress_t *eg = sb->eg;
    while (eg->gwait != NULL && eg->mem.used < eg->mem.limit) {
        struct sb *x = eg->gwait;
        if (!sb_serve(x))
            break;
        gwait_remove(x);
    }
}

/* Gives back n of pc's charges (at most what it holds). */
static void pc_release(struct pconn *pc, size_t n)
{
    struct sb *sb = pc->sb;
    if (n > pc->charged)
        n = pc->charged;
    if (n == 0)
        return;
    pc->charged -= n;
    sp_egmem_release(&sb->eg->mem, &sb->mem, n);
    mem_kick(sb);
}

/* ---- guest stream helpers ---- */

/* Gives consumed bytes back to the agent as credit, in steps of GRANT_BATCH (a quarter of the
 * first window while the connection has not been raised to SP_AP_INITIAL_WINDOW), each charged
 * to the memory budget first: credit that does not fit waits in the sandbox's queue. */
static void pc_grant(struct pconn *pc, size_t n, bool force)
{
    pc->grant_pending += n;
    if (pc->waiting || pc->st == NULL || pc->grant_pending == 0)
        return;
    size_t batch = pc->small_window && !pc->grown ? SP_EGRESS_OPEN_WINDOW / 4 : GRANT_BATCH;
    if (!force && pc->grant_pending < batch)
        return;
    pc_try_grant(pc);
}

/* The connection is allowed and connected: its window grows to SP_AP_INITIAL_WINDOW (credit
 * charged like any other, so it may wait). */
static void pc_grow(struct pconn *pc)
{
    if (!pc->small_window || pc->grown)
        return;
    pc->grown = true;
    pc_grant(pc, SP_AP_INITIAL_WINDOW - SP_EGRESS_OPEN_WINDOW, true);
}

/* Consumes n guest bytes at g_off: their memory goes back, their credit is granted again. */
static void g_consume(struct pconn *pc, size_t n)
{
    pc->g_off += n;
    if (pc->g_off == pc->g.len) {
        pc->g_off = pc->g.len = 0;
        if (pc->g.cap > GRANT_BATCH)
            sp_buf_free(&pc->g); /* drained: a large buffer goes, the budget counts content */
    }
    pc_release(pc, n);
    pc_grant(pc, n, false);
}

static int g_append(struct pconn *pc, const uint8_t *p, size_t n)
{
    if (pc->g_off > 0 && pc->g.cap - pc->g.len < n + 1) {
        sp_buf_consume(&pc->g, pc->g_off);
        pc->g_off = 0;
    }
    /* The agent cannot send past the window: more than that is a bug, not a load. */
    if (pc->g.len - pc->g_off + n > 2 * SP_AP_INITIAL_WINDOW + SP_AP_MAX_DATA)
        return -1;
    sp_buf_add(&pc->g, p, n);
    if (pc->g.oom)
        return -1;
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
    sp_egress__resolve_cancel(pc->job);
    pc->job = NULL;
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
            snprintf(pc->reason, sizeof(pc->reason), "%.*s", (int)sizeof(pc->reason) - 1, why);
        sp_egress__log(sb, pc->kind ? pc->kind : "http", pc->host, pc->port, pc->addr_text,
                       pc->allowed, pc->reason, pc->up_bytes, pc->down_bytes,
                       sp_loop_now_ms(eg->loop) - pc->t0);
    }
    if (pc->prev)
        pc->prev->next = pc->next;
    else
        sb->conns = pc->next;
    if (pc->next)
        pc->next->prev = pc->prev;
    sb->nconns--;
    eg->st.conns--;
    wq_remove(pc);
    pc_release(pc, pc->charged);
    sp_buf_free(&pc->g);
    free(pc->head);
    if (pc->orig_head != NULL)
        memset(pc->orig_head, 0, pc->orig_len);
    free(pc->orig_head);
    free(pc);
    sp_egress__sb_maybe_free(sb);
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
        snprintf(pc->reason, sizeof(pc->reason), "%.*s", (int)sizeof(pc->reason) - 1, why);
    pc_close(pc, CLOSE_OK, NULL);
}

static void pc_deny(struct pconn *pc, const char *why)
{
    pc->allowed = false;
    snprintf(pc->reason, sizeof(pc->reason), "%.*s", (int)sizeof(pc->reason) - 1, why);
    sp_log(SP_LOG_INFO, "egress", "denied sandbox=%s dest=%s:%u reason=%s", pc->sb->id, pc->host,
           (unsigned)pc->port, why);
    pc_respond(pc, 403, why);
}

/* ---- HTTP request heads ---- */

/* host[:port] or [v6][:port] (split by http1.h): fills the request's host
 * fields. default_port 0 = required. */
static int parse_authority(const char *s, size_t n, uint16_t default_port, char *host,
                           bool *is_addr, sp_egp_addr_t *lit, uint16_t *port)
{
    sp_http1_authority_t a;
    if (sp_http1_authority(s, n, &a) < 0)
        return -1;
    *port = a.has_port ? a.port : default_port;
    if (*port == 0)
        return -1;
    char name[SP_EGP_NAME_MAX + 1];
    sp_egp_host_kind_t k = sp_egp_host_parse(a.host.p, a.host.n, name, lit);
    if (k == SP_EGP_HOST_BAD)
        return -1;
    *is_addr = k == SP_EGP_HOST_ADDR;
    if (*is_addr)
        sp_egp_addr_format(lit, host, SP_EGP_NAME_MAX + 8);
    else
        snprintf(host, SP_EGP_NAME_MAX + 8, "%s", name);
    return 0;
}

/* Is header h listed in a Connection header value (hop-by-hop)? */
static bool conn_lists(const sp_http1_req_t *r, const sp_http1_field_t *h)
{
    for (size_t i = 0; i < r->nfields; i++)
        if (sp_http1_field_is(&r->fields[i], "connection") &&
            sp_http1_list_has(r->fields[i].value.p, r->fields[i].value.n, h->name.p, h->name.n))
            return true;
    return false;
}

/*
 * Takes the request http1.h read (CONNECT, or plain HTTP in absolute form) into
 * pc: the destination (for plain HTTP the URI's, which a Host header must agree
 * with), the body's framing and the head that goes upstream. Returns 0, or an
 * HTTP status (400, 403, 503) with *why set.
 */
static int parse_head(struct pconn *pc, const sp_http1_req_t *r, const char **why)
{
    pc->connect = r->connect;
    if (pc->connect) {
        pc->kind = "connect";
        if (parse_authority(r->authority.p, r->authority.n, 0, pc->host, &pc->host_is_addr,
                            &pc->lit, &pc->port) < 0)
            return *why = "CONNECT needs host:port", 400;
        return 0;
    }

    /* Plain HTTP in absolute form. */
    pc->kind = "http";
    bool abs = r->form == SP_HTTP1_ABSOLUTE;
    if (abs && r->scheme.n == 5 && strncasecmp(r->scheme.p, "https", 5) == 0)
        return *why = "https URLs go through CONNECT (set HTTPS_PROXY)", 400;
    if (!abs || r->scheme.n != 4 || strncasecmp(r->scheme.p, "http", 4) != 0)
        return *why = "this is a proxy: send an absolute http:// URI or CONNECT", 400;
    if (parse_authority(r->authority.p, r->authority.n, 80, pc->host, &pc->host_is_addr, &pc->lit,
                        &pc->port) < 0)
        return *why = "bad host in the request URI", 400;
    const char *path = r->path.p;
    size_t plen = r->path.n;

    if (r->host.p != NULL) {
        char hh[SP_EGP_NAME_MAX + 8];
        bool ha;
        sp_egp_addr_t hl;
        uint16_t hp;
        if (parse_authority(r->host.p, r->host.n, 80, hh, &ha, &hl, &hp) < 0)
            return *why = "bad Host header", 400;
        if (ha != pc->host_is_addr || strcmp(hh, pc->host) != 0 || hp != pc->port)
            return *why = "Host header does not match the request URI", 403;
    }
    if (r->body == SP_HTTP1_BODY_CHUNKED) {
        pc->body = BODY_CHUNKED;
        sp_http1_chunked_init(&pc->cs);
    } else if (r->body == SP_HTTP1_BODY_LENGTH) {
        pc->body = BODY_LENGTH;
        pc->body_left = r->length;
    } else {
        pc->body = BODY_NONE;
    }
    pc->upgrade = r->upgrade;
    if (pc->upgrade && pc->body == BODY_NONE)
        pc->body = BODY_RAW; /* after the head the connection is a tunnel */
    else
        pc->upgrade = false;

    /* The head that goes upstream: origin form, hop-by-hop headers dropped. */
    size_t cap = r->head_len + plen + 256;
    char *out = malloc(cap);
    if (out == NULL)
        return *why = "out of memory", 503;
    size_t o = 0;
    memcpy(out + o, r->method.p, r->method.n);
    o += r->method.n;
    out[o++] = ' ';
    if (plen == 0 || path[0] == '?')
        out[o++] = '/';
    memcpy(out + o, path, plen);
    o += plen;
    o += (size_t)snprintf(out + o, cap - o, " HTTP/1.%d\r\n", r->minor);
    if (r->host.p == NULL) {
        bool v6 = pc->host_is_addr && pc->lit.family == 6;
        o += (size_t)snprintf(out + o, cap - o, "Host: %s%s%s", v6 ? "[" : "", pc->host,
                              v6 ? "]" : "");
        if (pc->port != 80)
            o += (size_t)snprintf(out + o, cap - o, ":%u", (unsigned)pc->port);
        memcpy(out + o, "\r\n", 2);
        o += 2;
    }
    for (size_t i = 0; i < r->nfields; i++) {
        const sp_http1_field_t *x = &r->fields[i];
        if (sp_http1_field_is(x, "connection") || sp_http1_field_is(x, "proxy-connection") ||
            sp_http1_field_is(x, "keep-alive") || sp_http1_field_is(x, "proxy-authorization") ||
            sp_http1_field_is(x, "te") ||
            (conn_lists(r, x) && !(pc->upgrade && sp_http1_field_is(x, "upgrade"))))
            continue;
        memcpy(out + o, x->name.p, x->name.n);
        o += x->name.n;
        memcpy(out + o, ": ", 2);
        o += 2;
        memcpy(out + o, x->value.p, x->value.n);
        o += x->value.n;
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

/* ---- relaying ---- */

static void pc_set_interest(struct pconn *pc)
{
    if (pc->w == NULL)
        return;
    int ev = 0;
    bool pending_up = pc->head_off < pc->head_len ||
                      (pc->phase == PH_RELAY && pc->fwd_ok > 0 && pc->g.len > pc->g_off);
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
    bool guest_done = pc->g_eof && pc->g.len == pc->g_off && pc->head_off == pc->head_len;
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
        size_t avail = pc->g.len - pc->g_off;
        if (avail == 0)
            break;
        if (pc->fwd_ok == 0) {
            if (pc->body == BODY_RAW) {
                pc->fwd_ok = avail;
            } else if (pc->body == BODY_LENGTH && pc->body_left > 0) {
                pc->fwd_ok = avail < pc->body_left ? avail : (size_t)pc->body_left;
                pc->body_left -= pc->fwd_ok;
            } else if (pc->body == BODY_CHUNKED && !pc->cs_done) {
                int rc =
                    sp_http1_chunked_scan(&pc->cs, pc->g.p + pc->g_off, avail, &pc->fwd_ok, NULL);
                pc->cs_done = rc == 1;
                if (rc < 0) {
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
        ssize_t n = send(pc->fd, pc->g.p + pc->g_off, pc->fwd_ok, MSG_NOSIGNAL | MSG_DONTWAIT);
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
    if (pc->g_eof && pc->g.len == pc->g_off && pc->head_off == pc->head_len && !pc->up_wr_shut) {
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
    pc_release(pc, n); /* in the relay's buffers now, which SP_EGMEM_MITM_COST covers */
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
    if (!pc_charge(pc, SP_EGMEM_MITM_COST, NULL)) {
        if (pc->connect) /* answered already: the guest sees the tunnel close */
            pc_close(pc, CLOSE_ERROR, "egress memory is used up; try again later");
        else
            pc_respond(pc, 503, "egress memory is used up; try again later");
        return;
    }
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
    size_t avail = pc->g.len - pc->g_off;
    if (avail > 0) {
        /* Handed over unconsumed: the mitm's `consumed` releases their charge and grants
         * them. */
        sp_mitm_conn_from_guest(pc->mitm, pc->g.p + pc->g_off, avail);
        pc->g_off = pc->g.len = 0;
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
    size_t avail = pc->g.len - pc->g_off;
    if (avail == 0) {
        if (pc->g_eof)
            pc_relay(pc);
        return;
    }
    const uint8_t *p = pc->g.p + pc->g_off;
    if (mitm_wants(pc)) {
        pc_to_mitm(pc, p[0] == 0x16);
        return;
    }
    if (p[0] != 0x16) {
        pc_relay(pc); /* not TLS: nothing to compare */
        return;
    }
    char sni[SP_EGP_NAME_MAX + 8];
    int r = sp_sni_peek(p, avail, sni, sizeof(sni));
    if (r == SP_SNI_NEED && !pc->g_eof && avail < SP_SNI_MAX_HELLO + 1024)
        return; /* wait for the rest of the ClientHello */
    if (r == SP_SNI_NEED || r == SP_SNI_BAD) {
        pc->allowed = false;
        snprintf(pc->reason, sizeof(pc->reason), "malformed TLS ClientHello");
        pc_close(pc, CLOSE_ERROR, pc->reason);
        return;
    }
    if (r == SP_SNI_FOUND) {
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
    pc_grow(pc);
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
        snprintf(why, sizeof(why), "cannot resolve %.100s: %s", pc->host,
                 sp_egress__resolve_error(j->rc));
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
            if (pc->naddrs < SP_EGRESS__MAX_ADDRS)
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

static void pc_decide(struct pconn *pc)
{
    struct sb *sb = pc->sb;
    pc->log = true;
    if (!sp_egress__sb_ready(sb)) {
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
    pc->job = sp_egress__resolve(sb, pc->host, AF_UNSPEC, pc_on_resolved, pc);
    if (pc->job == NULL)
        pc_respond(pc, 503, "out of memory");
}

/* Reads the head (http1.h) once it is all there; parses and decides. */
static void pc_head(struct pconn *pc)
{
    const uint8_t *p = pc->g.p + pc->g_off;
    size_t n = pc->g.len - pc->g_off;
    sp_http1_field_t fields[SP_HTTP1_MAX_FIELDS];
    sp_http1_req_t req;
    int rc = sp_http1_parse_head(p, n, SP_EGRESS_MAX_HEAD, fields, SP_HTTP1_MAX_FIELDS, &req);
    if (rc == 0) {
        if (pc->g_eof)
            pc_close(pc, CLOSE_OK, NULL); /* the guest left before asking anything */
        return;
    }
    if (rc < 0 && req.head_len == 0 && req.status == 431 && n >= SP_EGRESS_MAX_HEAD) {
        pc->kind = "http";
        snprintf(pc->host, sizeof(pc->host), "?");
        pc_respond(pc, 431, "request head is too large");
        return;
    }
    const char *why = req.why;
    int status = rc < 0 ? req.status : parse_head(pc, &req, &why);
    if (status != 0) {
        if (pc->host[0] == '\0')
            snprintf(pc->host, sizeof(pc->host), "?");
        if (pc->kind == NULL)
            pc->kind = "http";
        pc->log = true;
        pc->allowed = false;
        snprintf(pc->reason, sizeof(pc->reason), "%.*s", (int)sizeof(pc->reason) - 1, why);
        pc_respond(pc, status, why);
        return;
    }
    size_t hl = req.head_len;
    /* The heads kept (the rewritten one, the guest's for a credential handover) are charged;
     * the guest's bytes they came from go back below. */
    bool keep_orig = !pc->connect && pc->sb->eg->mitm != NULL;
    if (!pc_charge(pc, pc->head_len + (keep_orig ? hl : 0), NULL)) {
        pc->log = true;
        pc->allowed = false;
        pc_respond(pc, 503, "egress memory is used up; try again later");
        return;
    }
    if (keep_orig) {
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
    if (pc->refused) {
        pc->kind = "http";
        snprintf(pc->host, sizeof(pc->host), "?");
        pc->log = true;
        pc_respond(pc, 503, "egress memory is used up; try again later");
        return;
    }
    switch (pc->phase) {
    case PH_HEAD:
        if (pc->g.len == pc->g_off) {
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
    if (pc->refused)
        return; /* answered on the next loop turn; nothing is kept */
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

int sp_egress__proxy_accept(struct sb *sb, sp_agentstream_t *s, sp_agentstream_cbs_t *cbs,
                            void **sarg)
{
    sp_egress_t *eg = sb->eg;
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
    /* The agent may send its whole first window at once: charged now, or the connection is
     * refused (a 503 on the next loop turn, every byte that comes before it dropped). */
    pc->small_window = sb->small_window;
    if (pc->small_window)
        sp_agentstream_set_recv_window(s, SP_EGRESS_OPEN_WINDOW);
    size_t first = pc->small_window ? SP_EGRESS_OPEN_WINDOW : SP_AP_INITIAL_WINDOW;
    pc->refused = !pc_charge(pc, SP_EGMEM_CONN_COST + first, NULL);
    sp_timer_start(&pc->timer, pc->refused ? 0 : SP_EGRESS_HEAD_TIMEOUT_MS);
    pc->next = sb->conns;
    if (pc->next)
        pc->next->prev = pc;
    sb->conns = pc;
    sb->nconns++;
    eg->st.conns++;
    sp_metrics_add(&m_conns, 1);
    *cbs = pc_cbs;
    *sarg = pc;
    return 0;
}

/* Whether the sandbox's policy (a new one) still lets pc go where it goes: its name, and the
 * address it resolved to or is connected to. why gets the reason when not. */
static bool pc_still_allowed(struct pconn *pc, char *why, size_t cap)
{
    const sp_egp_t *p = pc->sb->policy;
    bool by_name = false;
    if (!pc->host_is_addr && !sp_egp_check_name(p, pc->host, pc->port, &by_name, why, cap))
        return false;
    if (pc->phase == PH_RESOLVE) {
        pc->by_name = by_name; /* the addresses are checked when they come, by this policy */
        return true;
    }
    const sp_egp_addr_t *a = pc->host_is_addr ? &pc->lit
                             : pc->naddrs > 0 ? &pc->addrs[pc->ai < pc->naddrs ? pc->ai : 0]
                                              : NULL;
    return a == NULL || sp_egp_check_addr(p, a, pc->port, by_name, why, cap);
}

void sp_egress__proxy_policy_ready(struct sb *sb)
{
    for (struct pconn *pc = sb->conns, *next; pc != NULL; pc = next) {
        next = pc->next;
        if (pc->phase == PH_WAIT) {
            pc_decide(pc); /* may close pc, never another */
            continue;
        }
        if (pc->phase == PH_HEAD || pc->st == NULL)
            continue;
        /* A policy change applies to connections already open too: one the new policy would
         * refuse is refused (not yet answered) or closed (relaying), never left running. */
        char why[160];
        if (pc_still_allowed(pc, why, sizeof(why)))
            continue;
        if (pc->phase == PH_RESOLVE || pc->phase == PH_CONNECT) {
            pc_deny(pc, why);
        } else {
            sp_log(SP_LOG_INFO, "egress", "closed by a policy change sandbox=%s dest=%s:%u "
                   "reason=%s", sb->id, pc->host, (unsigned)pc->port, why);
            snprintf(pc->reason, sizeof(pc->reason), "policy changed: %.140s", why);
            pc_close(pc, CLOSE_ERROR, pc->reason);
        }
    }
}

void sp_egress__proxy_mem_kick(struct sb *sb)
{
    mem_kick(sb);
}

void sp_egress__proxy_close_all(struct sb *sb)
{
    while (sb->conns != NULL)
        pc_close(sb->conns, CLOSE_ERROR, "egress proxy stopped");
}
