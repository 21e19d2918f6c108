/*
 * fuzz_dnsmsg.c - libFuzzer target over a guest's DNS query read (core/egress/dnsmsg.h).
 *
 * Checked: the verdict is -1 or an rcode the reader gives; the kept header and question are
 * the query's bytes (id, flags, question) with the counts the answer needs, and never more than
 * the buffer dns.c builds the answer in; the name is NUL-terminated, and for a query to decide,
 * a lowercase host name of at most SP_EGP_NAME_MAX characters that, encoded again into a
 * query, reads back as itself.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "core/egress/dnsmsg.h"
#include "tests/fuzz.h"

/* The name as question labels after a 12-byte header; 0 when it has an empty label. */
static size_t encode(const char *name, uint8_t *out, size_t cap)
{
    size_t o = 12;
    const char *p = name;
    for (;;) {
        const char *dot = strchr(p, '.');
        size_t l = dot ? (size_t)(dot - p) : strlen(p);
        if (l == 0 || l > 63 || o + 1 + l + 5 > cap)
            return 0;
        out[o++] = (uint8_t)l;
        memcpy(out + o, p, l);
        o += l;
        if (dot == NULL)
            break;
        p = dot + 1;
    }
    out[o++] = 0;
    return o;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    sp_dnsmsg_t q;
    int rc = sp_dnsmsg_parse(&q, data, size);
    ASSERT(rc == -1 ||
           (rc >= SP_DNSMSG_NOERROR && rc <= SP_DNSMSG_REFUSED && rc != SP_DNSMSG_SERVFAIL));
    ASSERT(memchr(q.name, '\0', sizeof(q.name)) != NULL);
    if (rc < 0) {
        ASSERT(size < 12);
        return 0;
    }
    ASSERT(q.msg_len >= 12 && q.msg_len <= size && q.msg_len <= sizeof(q.msg));
    ASSERT(memcmp(q.msg, data, 4) == 0);
    ASSERT(q.msg[4] == 0 && q.msg[5] == (q.msg_len > 12 ? 1 : 0));
    for (int i = 6; i < 12; i++) /* dns.c writes these counts in every answer */
        ASSERT(q.msg[i] == (q.msg_len > 12 ? 0 : data[i]));
    ASSERT(memcmp(q.msg + 12, data + 12, q.msg_len - 12) == 0);
    if (rc != SP_DNSMSG_NOERROR)
        return 0;

    size_t nl = strlen(q.name);
    ASSERT(nl > 0 && nl <= SP_EGP_NAME_MAX && q.msg_len > 12);
    for (size_t i = 0; i < nl; i++)
        ASSERT(q.name[i] != '?' && !(q.name[i] >= 'A' && q.name[i] <= 'Z'));
    uint8_t again[600];
    memcpy(again, data, 12);
    size_t o = encode(q.name, again, sizeof(again));
    ASSERT(o > 12);
    memcpy(again + o, data + q.msg_len - 4, 4); /* type and class */
    sp_dnsmsg_t q2;
    ASSERT(sp_dnsmsg_parse(&q2, again, o + 4) == SP_DNSMSG_NOERROR);
    ASSERT(strcmp(q2.name, q.name) == 0 && q2.qtype == q.qtype);
    return 0;
}
