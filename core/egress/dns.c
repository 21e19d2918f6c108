/*
 * dns.c - DNS queries from the guest (DNS_QUERY streams): the name is decided
 * against the sandbox's policy, resolved (resolve.c), and answered with the
 * addresses that pass, or NXDOMAIN for a denied name.
 *
 * Owns one `struct dnsq` per query (its header and question as dnsmsg.c read them, the lookup in
 * flight, a timer that answers SERVFAIL before the agent gives up). Answers
 * only A and AAAA with addresses; other types of an allowed name get an empty
 * answer. Each query is an audit row.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "base/log.h"
#include "core/egress/dnsmsg.h"
#include "core/egress/egress_int.h"

#define DNS_WAIT_MS 4000 /* answer SERVFAIL before the agent's 5 s */
#define DNS_TTL     30   /* seconds, in answers */

struct dnsq {
    struct sb *sb;
    struct dnsq *prev, *next;
    sp_agentstream_t *st;
    sp_dnsmsg_t m; /* header, question and name of the query */
    bool by_name;
    struct rjob *job;
    sp_timer_t timer;
    bool waiting;
};

static void dns_free(struct dnsq *q)
{
    struct sb *sb = q->sb;
    sp_egress__resolve_cancel(q->job);
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
    sp_egress__sb_maybe_free(sb);
}

/* Answers with rcode and the addresses (of the query's type) and frees q. */
static void dns_answer(struct dnsq *q, int rcode, const sp_egp_addr_t *addrs, int n, bool allowed,
                       const char *why)
{
    uint8_t out[sizeof(q->m.msg) + SP_EGRESS__MAX_ADDRS * 28 + 64];
    size_t o = 0;
    memcpy(out, q->m.msg, q->m.msg_len);
    o = q->m.msg_len;
    uint16_t qflags = (uint16_t)(q->m.msg[2] << 8 | q->m.msg[3]);
    uint16_t flags =
        (uint16_t)(0x8000 | (qflags & 0x7800) | (qflags & 0x0100) | 0x0080 | (rcode & 0xf));
    out[2] = (uint8_t)(flags >> 8);
    out[3] = (uint8_t)flags;
    int an = 0;
    char list[72] = "";
    for (int i = 0; i < n; i++) {
        const sp_egp_addr_t *a = &addrs[i];
        size_t alen = a->family == 4 ? 4 : 16;
        if ((q->m.qtype == 1 && a->family != 4) || (q->m.qtype == 28 && a->family != 6))
            continue;
        out[o++] = 0xc0;
        out[o++] = 0x0c; /* the name in the question */
        out[o++] = (uint8_t)(q->m.qtype >> 8);
        out[o++] = (uint8_t)q->m.qtype;
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
    snprintf(host, sizeof(host), "%s", q->m.name[0] ? q->m.name : "?");
    char reason[160];
    snprintf(reason, sizeof(reason), "%s", why ? why : "");
    sp_egress__log(q->sb, "dns", host, 53, list, allowed, reason, 0, 0, 0);
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
                   nx       ? SP_DNSMSG_NXDOMAIN
                   : nodata ? SP_DNSMSG_NOERROR
                            : SP_DNSMSG_SERVFAIL,
                   NULL, 0, true, sp_egress__resolve_error(j->rc));
        return;
    }
    sp_egp_addr_t pass[SP_EGRESS__MAX_ADDRS];
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
    dns_answer(q, SP_DNSMSG_NOERROR, pass, n, n > 0 || removed == 0, removed ? first : NULL);
}

static void dns_decide(struct dnsq *q)
{
    struct sb *sb = q->sb;
    if (!sp_egress__sb_ready(sb)) {
        q->waiting = true;
        return;
    }
    q->waiting = false;
    char why[160];
    if (!sp_egp_check_name(sb->policy, q->m.name, 0, &q->by_name, why, sizeof(why))) {
        dns_answer(q, SP_DNSMSG_NXDOMAIN, NULL, 0, false, why);
        return;
    }
    if (q->m.qtype != 1 && q->m.qtype != 28) {
        /* allowed name, no such records here */
        dns_answer(q, SP_DNSMSG_NOERROR, NULL, 0, true, NULL);
        return;
    }
    q->job =
        sp_egress__resolve(sb, q->m.name, q->m.qtype == 1 ? AF_INET : AF_INET6, dns_on_resolved, q);
    if (q->job == NULL)
        dns_answer(q, SP_DNSMSG_SERVFAIL, NULL, 0, true, "out of memory");
}

static void on_dns_timer(sp_timer_t *t, void *arg)
{
    struct dnsq *q = arg;
    if (q->waiting)
        dns_answer(q, SP_DNSMSG_SERVFAIL, NULL, 0, false, "egress policy is not available");
    else
        dns_answer(q, SP_DNSMSG_SERVFAIL, NULL, 0, true, "name lookup timed out");
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

int sp_egress__dns_accept(struct sb *sb, sp_agentstream_t *s, const uint8_t *payload, size_t len,
                          sp_agentstream_cbs_t *cbs, void **sarg)
{
    sp_egress_t *eg = sb->eg;
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
    int rc = sp_dnsmsg_parse(&q->m, qs.val, qs.len);
    if (rc < 0) {
        q->st = NULL;
        dns_free(q);
        return -1;
    }
    if (rc != SP_DNSMSG_NOERROR) {
        dns_answer(q, rc, NULL, 0, false, "malformed or unsupported query");
        return 0;
    }
    sp_timer_start(&q->timer, DNS_WAIT_MS);
    dns_decide(q);
    return 0;
}

void sp_egress__dns_policy_ready(struct sb *sb)
{
    for (struct dnsq *q = sb->dnsqs, *next; q != NULL; q = next) {
        next = q->next;
        if (q->waiting)
            dns_decide(q);
    }
}

void sp_egress__dns_close_all(struct sb *sb)
{
    while (sb->dnsqs != NULL)
        dns_free(sb->dnsqs);
}
