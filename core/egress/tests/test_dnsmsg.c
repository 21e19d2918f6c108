/*
 * test_dnsmsg.c - a guest's DNS query read (core/egress/dnsmsg.h): the rcode each malformed or
 * unsupported query gets, the name and type of a good one, and the header and question kept
 * for the answer.
 */
#include <stdio.h>
#include <string.h>

#include "core/egress/dnsmsg.h"
#include "tests/check.h"

/* A query: id 0x1234, flags, qdcount, then the encoded name (len-prefixed labels, as given),
 * qtype, qclass; with an answer and additional count to see them zeroed. Returns its length. */
static size_t query(uint8_t *out, uint16_t flags, uint16_t qd, const char *labels, size_t llen,
                    uint16_t qtype, uint16_t qclass)
{
    uint8_t h[12] = {0x12,
                     0x34,
                     (uint8_t)(flags >> 8),
                     (uint8_t)flags,
                     (uint8_t)(qd >> 8),
                     (uint8_t)qd,
                     0,
                     7,
                     0,
                     1,
                     0,
                     1};
    memcpy(out, h, 12);
    memcpy(out + 12, labels, llen);
    size_t o = 12 + llen;
    out[o++] = (uint8_t)(qtype >> 8);
    out[o++] = (uint8_t)qtype;
    out[o++] = (uint8_t)(qclass >> 8);
    out[o++] = (uint8_t)qclass;
    return o;
}

#define EXAMPLE "\7example\3com\0"

static void test_good(void)
{
    uint8_t m[600] = {0};
    sp_dnsmsg_t q;
    size_t n = query(m, 0x0100, 1, EXAMPLE, sizeof(EXAMPLE) - 1, 1, 1);
    CHECK(sp_dnsmsg_parse(&q, m, n) == SP_DNSMSG_NOERROR);
    CHECK(strcmp(q.name, "example.com") == 0);
    CHECK(q.qtype == 1);
    CHECK(q.msg_len == n);
    CHECK(memcmp(q.msg, m, 4) == 0); /* id and flags as sent */
    CHECK(q.msg[4] == 0 && q.msg[5] == 1);
    for (int i = 6; i < 12; i++)
        CHECK(q.msg[i] == 0);
    CHECK(memcmp(q.msg + 12, m + 12, n - 12) == 0);

    /* upper case and a trailing additional record (EDNS): the name is lowercased, the
     * record is not kept */
    n = query(m, 0x0100, 1, "\3WWW\7Example\3COM\0", 17, 28, 1);
    size_t qlen = n;
    memset(m + n, 0xab, 11);
    n += 11;
    CHECK(sp_dnsmsg_parse(&q, m, n) == SP_DNSMSG_NOERROR);
    CHECK(strcmp(q.name, "www.example.com") == 0);
    CHECK(q.qtype == 28);
    CHECK(q.msg_len == qlen);

    /* another type of an allowed name is for dns.c to answer (empty) */
    n = query(m, 0, 1, EXAMPLE, sizeof(EXAMPLE) - 1, 16, 1);
    CHECK(sp_dnsmsg_parse(&q, m, n) == SP_DNSMSG_NOERROR);
    CHECK(q.qtype == 16);
}

static void test_refused(void)
{
    uint8_t m[600] = {0};
    sp_dnsmsg_t q;
    size_t n;

    CHECK(sp_dnsmsg_parse(&q, m, 0) == -1);
    memset(m, 0, 11);
    CHECK(sp_dnsmsg_parse(&q, m, 11) == -1);
    CHECK(q.msg_len == 0 && q.name[0] == '\0');

    /* a response: FORMERR with the header only, QDCOUNT 0 */
    n = query(m, 0x8100, 1, EXAMPLE, sizeof(EXAMPLE) - 1, 1, 1);
    CHECK(sp_dnsmsg_parse(&q, m, n) == SP_DNSMSG_FORMERR);
    CHECK(q.msg_len == 12 && q.msg[4] == 0 && q.msg[5] == 0);
    CHECK(q.msg[0] == 0x12 && q.msg[1] == 0x34 && q.msg[2] == 0x81);
    CHECK(q.name[0] == '\0');

    /* opcode STATUS (2) */
    n = query(m, 2 << 11, 1, EXAMPLE, sizeof(EXAMPLE) - 1, 1, 1);
    CHECK(sp_dnsmsg_parse(&q, m, n) == SP_DNSMSG_NOTIMP);
    CHECK(q.msg_len == 12);

    /* no question, two questions */
    n = query(m, 0, 0, EXAMPLE, sizeof(EXAMPLE) - 1, 1, 1);
    CHECK(sp_dnsmsg_parse(&q, m, n) == SP_DNSMSG_FORMERR);
    n = query(m, 0, 2, EXAMPLE, sizeof(EXAMPLE) - 1, 1, 1);
    CHECK(sp_dnsmsg_parse(&q, m, n) == SP_DNSMSG_FORMERR);

    /* a compression pointer in the question */
    n = query(m, 0, 1, "\7example\xc0\x0c", 10, 1, 1);
    CHECK(sp_dnsmsg_parse(&q, m, n) == SP_DNSMSG_FORMERR);
    CHECK(q.msg_len == 12);

    /* a label running past the end; a name without its terminator; no room for type and
     * class */
    n = query(m, 0, 1, EXAMPLE, sizeof(EXAMPLE) - 1, 1, 1);
    CHECK(sp_dnsmsg_parse(&q, m, 16) == SP_DNSMSG_FORMERR);
    CHECK(sp_dnsmsg_parse(&q, m, 12 + 12) == SP_DNSMSG_FORMERR);
    CHECK(sp_dnsmsg_parse(&q, m, n - 1) == SP_DNSMSG_FORMERR);

    /* a name longer than SP_EGP_NAME_MAX: 5 labels of 63 */
    char lab[5 * 64 + 1];
    for (int i = 0; i < 5; i++) {
        lab[i * 64] = 63;
        memset(lab + i * 64 + 1, 'a', 63);
    }
    lab[5 * 64] = 0;
    n = query(m, 0, 1, lab, sizeof(lab), 1, 1);
    CHECK(sp_dnsmsg_parse(&q, m, n) == SP_DNSMSG_FORMERR);
    /* 4 labels of 63 (255 with dots... 4*63+3 = 255 > 253): refused as a name */
    lab[4 * 64] = 0;
    n = query(m, 0, 1, lab, 4 * 64 + 1, 1, 1);
    CHECK(sp_dnsmsg_parse(&q, m, n) == SP_DNSMSG_FORMERR);
    /* 3 labels of 63 and one of 61: 253 characters, the longest name */
    lab[3 * 64] = 61;
    lab[3 * 64 + 62] = 0;
    n = query(m, 0, 1, lab, 3 * 64 + 63, 1, 1);
    CHECK(sp_dnsmsg_parse(&q, m, n) == SP_DNSMSG_NOERROR);
    CHECK(strlen(q.name) == 253);

    /* the root: REFUSED with the question kept */
    n = query(m, 0, 1, "\0", 1, 1, 1);
    CHECK(sp_dnsmsg_parse(&q, m, n) == SP_DNSMSG_REFUSED);
    CHECK(q.msg_len == n && q.msg[5] == 1);
    CHECK(q.name[0] == '\0');

    /* names the policy cannot read: NXDOMAIN, name "?" */
    n = query(m, 0, 1, "\3a\0b\3com\0", 9, 1, 1);
    CHECK(sp_dnsmsg_parse(&q, m, n) == SP_DNSMSG_NXDOMAIN);
    CHECK(strcmp(q.name, "?") == 0);
    CHECK(q.msg_len == n);
    n = query(m, 0, 1, "\3a b\3com\0", 9, 1, 1);
    CHECK(sp_dnsmsg_parse(&q, m, n) == SP_DNSMSG_NXDOMAIN);
    n = query(m, 0, 1, "\0031\0010\0010\0011\0", 9, 1, 1); /* 1.0.0.1 is an address */
    CHECK(sp_dnsmsg_parse(&q, m, n) == SP_DNSMSG_NXDOMAIN);
    CHECK(strcmp(q.name, "?") == 0);

    /* class CH: REFUSED, the name read */
    n = query(m, 0, 1, EXAMPLE, sizeof(EXAMPLE) - 1, 16, 3);
    CHECK(sp_dnsmsg_parse(&q, m, n) == SP_DNSMSG_REFUSED);
    CHECK(strcmp(q.name, "example.com") == 0);
}

int main(void)
{
    test_good();
    test_refused();
    return check_report("dnsmsg");
}
