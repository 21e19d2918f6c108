/*
 * dnsmsg.h - the question of a DNS query a guest sent (DNS_QUERY streams): its header and
 * question kept for the answer, the name as the policy sees it, and the rcode a query that
 * cannot be answered gets.
 *
 * Pure: no I/O, no allocation. Reads one query (header + one question); compression
 * pointers, more than one question and opcodes other than QUERY are refused. Building the
 * answer and deciding the name stay in dns.c.
 */
#ifndef SP_EGRESS_DNSMSG_H
#define SP_EGRESS_DNSMSG_H

#include <stddef.h>
#include <stdint.h>

#include "core/egress/egress_policy.h"

/* rcodes (RFC 1035 4.1.1) */
enum {
    SP_DNSMSG_NOERROR = 0,
    SP_DNSMSG_FORMERR = 1,
    SP_DNSMSG_SERVFAIL = 2,
    SP_DNSMSG_NXDOMAIN = 3,
    SP_DNSMSG_NOTIMP = 4,
    SP_DNSMSG_REFUSED = 5
};

typedef struct {
    uint8_t msg[512 + 16]; /* header + question, ready to be the start of the answer */
    size_t msg_len;
    uint16_t qtype;                 /* 0 until the question is read */
    char name[SP_EGP_NAME_MAX + 1]; /* lowercase, no trailing dot; "?" for a name the policy
                                       cannot read; "" until the question is read */
} sp_dnsmsg_t;

/*
 * Parses the query m[0..n) into *q: SP_DNSMSG_NOERROR when name and qtype are there to be
 * decided, another rcode to answer with at once (q->msg then holds the header, with the
 * question when it was read), or -1 when not even a header is there (no answer possible).
 * q->msg's id and flags are the query's; QDCOUNT is 1 when the question is kept (0 when
 * refused before it), the other counts then 0 (before it, as sent: dns.c writes them anyway).
 */
int sp_dnsmsg_parse(sp_dnsmsg_t *q, const uint8_t *m, size_t n);

#endif
