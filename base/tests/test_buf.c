/*
 * test_buf.c - base/buf.h: growth, strings, printf past the small buffer, consume, oom.
 */
#include <stdint.h>
#include <string.h>

#include "base/buf.h"
#include "tests/check.h"

static void test_buf_grows_and_keeps_bytes(void)
{
    sp_buf_t b = SP_BUF_INIT;
    for (int i = 0; i < 10000; i++) {
        uint8_t c = (uint8_t)i;
        sp_buf_add(&b, &c, 1);
    }
    CHECK(!b.oom && b.len == 10000 && b.cap > b.len);
    int ok = 1;
    for (int i = 0; i < 10000; i++)
        ok &= b.p[i] == (uint8_t)i;
    CHECK(ok);
    sp_buf_free(&b);
    CHECK(b.p == NULL && b.len == 0 && b.cap == 0);
}

static void test_buf_strings_and_printf(void)
{
    sp_buf_t b = SP_BUF_INIT;
    CHECK(strcmp(sp_buf_cstr(&b), "") == 0);
    sp_buf_str(&b, "a=");
    sp_buf_printf(&b, "%d/%s", 42, "x");
    CHECK(strcmp(sp_buf_cstr(&b), "a=42/x") == 0 && b.len == 6);
    char big[1000];
    memset(big, 'z', sizeof(big) - 1);
    big[sizeof(big) - 1] = '\0';
    sp_buf_printf(&b, "[%s]", big); /* past printf's small stack buffer */
    CHECK(b.len == 6 + 1001 && b.p[6] == '[' && b.p[b.len - 1] == ']');
    sp_buf_consume(&b, 6);
    CHECK(b.len == 1001 && b.p[0] == '[');
    sp_buf_consume(&b, 5000);
    CHECK(b.len == 0);
    sp_buf_reset(&b);
    sp_buf_str(&b, "again");
    CHECK(strcmp(sp_buf_cstr(&b), "again") == 0);
    sp_buf_free(&b);
}

static void test_buf_reserve_commit(void)
{
    sp_buf_t b = SP_BUF_INIT;
    char *d = sp_buf_reserve(&b, 3);
    REQUIRE(d != NULL);
    memcpy(d, "xyz", 3);
    sp_buf_commit(&b, 3);
    CHECK(b.len == 3 && memcmp(b.p, "xyz", 3) == 0);
    sp_buf_free(&b);
}

static void test_buf_oom_is_sticky(void)
{
    sp_buf_t b = SP_BUF_INIT;
    sp_buf_str(&b, "kept");
    CHECK(sp_buf_reserve(&b, SIZE_MAX - 2) == NULL && b.oom);
    sp_buf_str(&b, "dropped");
    CHECK(b.len == 4 && memcmp(b.p, "kept", 4) == 0);
    CHECK(strcmp(sp_buf_cstr(&b), "") == 0);
    sp_buf_reset(&b);
    CHECK(!b.oom);
    sp_buf_free(&b);
}

int main(void)
{
    test_buf_grows_and_keeps_bytes();
    test_buf_strings_and_printf();
    test_buf_reserve_commit();
    test_buf_oom_is_sticky();
    return check_report("base.buf");
}
