/*
 * test_json.c - sp_json_write gives json_dumps(v, JSON_COMPACT)'s bytes: on hand-picked values
 * (escapes, UTF-8 edges, reals, empty containers) and on random trees, and refuses what jansson
 * refuses (strings that are not UTF-8); so do the field pieces (sp_json_put_*).
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "http/json.h"
#include "tests/check.h"

static unsigned long long rng = 88172645463325252ull;

static unsigned next(void)
{
    rng ^= rng << 13;
    rng ^= rng >> 7;
    rng ^= rng << 17;
    return (unsigned)rng;
}

/* Same text as jansson, or both refuse. */
static int same(json_t *v)
{
    sp_buf_t b = SP_BUF_INIT;
    int rc = sp_json_write(&b, v);
    char *want = json_dumps(v, JSON_COMPACT | JSON_ENCODE_ANY);
    int ok = (rc < 0 && want == NULL) ||
             (rc == 0 && want != NULL && strlen(want) == b.len && memcmp(want, b.p, b.len) == 0);
    if (!ok)
        fprintf(stderr, "differ: rc=%d ours=%.*s jansson=%s\n", rc, (int)b.len, (const char *)b.p,
                want ? want : "(refused)");
    free(want);
    sp_buf_free(&b);
    return ok;
}

static json_t *rand_string(void)
{
    static const char *const pieces[] = {"a", "Z", " ", "\"", "\\", "/", "\n", "\r", "\t", "\b",
                                         "\f", "\x01", "\x1f", "\x7f", "\xc3\xa9", "\xe2\x82\xac",
                                         "\xf0\x9f\x98\x80", "\xe2\x80\xa8", "sandbox", "{}", ":,"};
    char s[256];
    size_t n = 0, k = next() % 12;
    for (size_t i = 0; i < k; i++) {
        const char *p = pieces[next() % (sizeof(pieces) / sizeof(pieces[0]))];
        size_t l = strlen(p);
        memcpy(s + n, p, l);
        n += l;
    }
    if (next() % 8 == 0) /* an embedded NUL, as json_stringn allows */
        s[n++] = '\0';
    return json_stringn(s, n);
}

static json_t *rand_value(int depth)
{
    switch (next() % (depth > 4 ? 6 : 8)) {
    case 0:
        return json_integer((json_int_t)(int)next() * (next() % 2 ? 1 : 100000));
    case 1:
        return json_real((double)(int)next() / ((next() % 1000) + 1));
    case 2:
        return json_true();
    case 3:
        return json_false();
    case 4:
        return json_null();
    case 5:
        return rand_string();
    case 6: {
        json_t *a = json_array();
        for (unsigned i = 0, n = next() % 5; i < n; i++)
            json_array_append_new(a, rand_value(depth + 1));
        return a;
    }
    default: {
        json_t *o = json_object();
        for (unsigned i = 0, n = next() % 5; i < n; i++) {
            json_t *k = rand_string();
            json_object_set_new(o, json_string_value(k), rand_value(depth + 1));
            json_decref(k);
        }
        return o;
    }
    }
}

int main(void)
{
    const char *fixed[] = {"{}", "[]", "{\"a\":[1,2.5,true,false,null,\"x\"]}",
                           "[1e300, -0.0, 0.1]",
                           "{\"k\":\"\\u0000\\u001f\\u007f\\u00e9\\ud83d\\ude00\"}",
                           "[[[[[[]]]]],{\"\":{}}]", "-9223372036854775808", "\"\\/\""};
    for (size_t i = 0; i < sizeof(fixed) / sizeof(fixed[0]); i++) {
        json_error_t je;
        json_t *v = json_loads(fixed[i], JSON_DECODE_ANY | JSON_ALLOW_NUL, &je);
        REQUIRE(v != NULL);
        CHECK(same(v));
        json_decref(v);
    }
    /* Not UTF-8 (made unchecked, as a careless caller could): both refuse. */
    const char *bad[] = {"\xc0\x80", "\xed\xa0\x80", "\xf4\x90\x80\x80", "\xe2\x82", "\xff"};
    for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
        json_t *v = json_pack("{s:o}", "k", json_string_nocheck(bad[i]));
        sp_buf_t b = SP_BUF_INIT;
        CHECK(sp_json_write(&b, v) < 0);
        CHECK(same(v));
        CHECK(!sp_json_utf8_valid(bad[i], strlen(bad[i])));
        CHECK(json_stringn(bad[i], strlen(bad[i])) == NULL);
        sp_buf_free(&b);
        json_decref(v);
    }
    CHECK(sp_json_utf8_valid("", 0) &&
          sp_json_utf8_valid("a\xc3\xa9\xe2\x82\xac\xf0\x9f\x98\x80", 10));
    CHECK(sp_json_utf8_valid("\xf4\x8f\xbf\xbf", 4) && !sp_json_utf8_valid("\xc3\xa9", 1));
    CHECK(sp_json_write(&(sp_buf_t)SP_BUF_INIT, NULL) < 0);
    /* Long strings: multi-byte characters across the writer's 4 KiB blocks, at every offset. */
    for (int shift = 0; shift < 4; shift++) {
        static char big[40000];
        size_t n = 0;
        memset(big, 'x', (size_t)shift);
        n = (size_t)shift;
        while (n + 16 < sizeof(big)) {
            memcpy(big + n, "\xc3\xa9\xe2\x82\xac\xf0\x9f\x98\x80\n\"\x01", 12);
            n += 12;
        }
        json_t *v = json_stringn(big, n);
        REQUIRE(v != NULL);
        CHECK(same(v));
        json_decref(v);
    }
    int differ = 0;
    for (int i = 0; i < 20000; i++) {
        json_t *v = rand_value(0);
        differ += !same(v);
        json_decref(v);
    }
    CHECK(differ == 0);
    /* The field pieces: the text jansson gives the same value after the same key. */
    const long long ints[] = {0,
                              1,
                              -1,
                              9,
                              10,
                              -10,
                              2147483647,
                              -2147483648LL,
                              9007199254740993LL,
                              9223372036854775807LL,
                              -9223372036854775807LL - 1};
    for (size_t i = 0; i < sizeof(ints) / sizeof(ints[0]); i++) {
        sp_buf_t b = SP_BUF_INIT;
        sp_json_put_int(&b, "{\"n\":", ints[i]);
        sp_buf_add(&b, "}", 1);
        json_t *v = json_pack("{s:I}", "n", (json_int_t)ints[i]);
        char *want = json_dumps(v, JSON_COMPACT);
        CHECK(strcmp(sp_buf_cstr(&b), want) == 0);
        free(want);
        json_decref(v);
        sp_buf_free(&b);
    }
    sp_buf_t b = SP_BUF_INIT;
    sp_json_put_bool(&b, "[", 1);
    sp_json_put_bool(&b, ",", 0);
    sp_json_put_bool(&b, ",", -1);
    CHECK(sp_json_put_str(&b, ",", "", true) == 0);
    CHECK(sp_json_put_str(&b, ",", "", false) == 0);
    CHECK(sp_json_put_str(&b, ",", "a\"\xc3\xa9", true) == 0);
    sp_buf_add(&b, "]", 1);
    CHECK(strcmp(sp_buf_cstr(&b), "[true,false,null,null,\"\",\"a\\\"\xc3\xa9\"]") == 0);
    CHECK(sp_json_put_str(&b, ",", "\xff", false) < 0);
    sp_buf_free(&b);
    return check_report("json");
}
