/*
 * dnsmsg.c - a guest's DNS query read into its header, question and name (see dnsmsg.h).
 * Owns nothing; dns.c answers.
 */
#include <stdio.h>
#include <string.h>

#include "core/egress/dnsmsg.h"

int sp_dnsmsg_parse(sp_dnsmsg_t *q, const uint8_t *m, size_t n)
{
    q->msg_len = 0;
    q->qtype = 0;
    q->name[0] = '\0';
    if (n < 12)
        return -1;
    uint16_t flags = (uint16_t)(m[2] << 8 | m[3]);
    uint16_t qd = (uint16_t)(m[4] << 8 | m[5]);
    memcpy(q->msg, m, 12);
    q->msg[4] = 0;
    q->msg[5] = 0; /* a refusal before the question is parsed carries none */
    q->msg_len = 12;
    if (flags & 0x8000)
        return SP_DNSMSG_FORMERR;
    if (((flags >> 11) & 0xf) != 0)
        return SP_DNSMSG_NOTIMP;
    if (qd != 1)
        return SP_DNSMSG_FORMERR;
    size_t off = 12, nl = 0;
    char name[SP_EGP_NAME_MAX + 2];
    for (;;) {
        if (off >= n)
            return SP_DNSMSG_FORMERR;
        unsigned l = m[off++];
        if (l == 0)
            break;
        if (l > 63 || off + l > n || nl + l + 1 > SP_EGP_NAME_MAX + 1)
            return SP_DNSMSG_FORMERR; /* compression pointers have no place in a question */
        if (nl > 0)
            name[nl++] = '.';
        memcpy(name + nl, m + off, l);
        nl += l;
        off += l;
    }
    if (off + 4 > n || off + 4 > sizeof(q->msg))
        return SP_DNSMSG_FORMERR;
    q->qtype = (uint16_t)(m[off] << 8 | m[off + 1]);
    uint16_t qclass = (uint16_t)(m[off + 2] << 8 | m[off + 3]);
    off += 4;
    memcpy(q->msg, m, off);
    q->msg[4] = 0;
    q->msg[5] = 1;
    memset(q->msg + 6, 0, 6);
    q->msg_len = off;
    if (nl == 0)
        return SP_DNSMSG_REFUSED;
    sp_egp_addr_t a;
    if (memchr(name, '\0', nl) != NULL ||
        sp_egp_host_parse(name, nl, q->name, &a) != SP_EGP_HOST_NAME) {
        snprintf(q->name, sizeof(q->name), "?");
        return SP_DNSMSG_NXDOMAIN;
    }
    if (qclass != 1)
        return SP_DNSMSG_REFUSED;
    return SP_DNSMSG_NOERROR;
}
