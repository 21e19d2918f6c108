/*
 * test_chunked.c - the chunked decoder: fed in pieces of every size and handed out in pieces,
 * extensions and trailers skipped, bad framing and oversized chunks refused.
 */
#include <stdio.h>
#include <string.h>

#include "base/buf.h"
#include "base/chunked.h"
#include "tests/check.h"

/* Decodes all of in, fed n bytes at a time and handed out max bytes at a time. */
static int dechunk(const char *in, size_t step, size_t max, sp_buf_t *out)
{
    sp_chunked_t d = SP_CHUNKED_INIT;
    size_t len = strlen(in), off = 0;
    sp_buf_t pend = SP_BUF_INIT; /* fed but not yet consumed */
    int rc = 0;
    while (rc == 0) {
        if (off < len) {
            size_t k = len - off < step ? len - off : step;
            sp_buf_add(&pend, in + off, k);
            off += k;
        }
        for (;;) {
            size_t used, dlen;
            const uint8_t *data;
            rc = sp_chunked_step(&d, pend.p, pend.len, max, &used, &data, &dlen);
            if (dlen > 0)
                sp_buf_add(out, data, dlen);
            sp_buf_consume(&pend, used);
            if (rc != 0 || (used == 0 && dlen == 0))
                break;
        }
        if (rc == 0 && off == len)
            break; /* ran out of input before the end */
    }
    sp_buf_free(&pend);
    return rc;
}

static void test_chunked(void)
{
    const char *in = "5\r\nhello\r\n7;ext=1\r\n, world\r\n0\r\nTrailer: x\r\n\r\n";
    size_t steps[] = {1, 2, 3, 7, 1000}, maxes[] = {1, 4, 1 << 20};
    for (size_t i = 0; i < 5; i++)
        for (size_t j = 0; j < 3; j++) {
            sp_buf_t out = SP_BUF_INIT;
            CHECK(dechunk(in, steps[i], maxes[j], &out) == 1);
            CHECK(strcmp(sp_buf_cstr(&out), "hello, world") == 0);
            sp_buf_free(&out);
        }
    sp_buf_t out = SP_BUF_INIT;
    CHECK(dechunk("A\r\n0123456789\r\n0\r\n\r\n", 1000, 100, &out) == 1);
    CHECK(strcmp(sp_buf_cstr(&out), "0123456789") == 0);
    sp_buf_reset(&out);
    CHECK(dechunk("5\r\nhel", 1000, 100, &out) == 0); /* not the end yet */
    CHECK(strcmp(sp_buf_cstr(&out), "hel") == 0);
    sp_buf_reset(&out);
    CHECK(dechunk("x\r\n", 1000, 100, &out) == -1);
    CHECK(dechunk("5\r\nhelloXX", 1000, 100, &out) == -1);
    CHECK(dechunk("1000000000000000\r\n", 1000, 100, &out) == -1); /* 2^60: too large */
    sp_buf_free(&out);
}

int main(void)
{
    test_chunked();
    return check_report("base.chunked");
}
