/*
 * test_render.c - sp_napi__sandbox_write gives the bytes sp_json_write gives
 * sp_napi__sandbox_json for the same record: nulls, escapes, non-ASCII, nested metadata,
 * large numbers; and refuses (for the jansson path to answer) what jansson drops.
 */
#include <stdio.h>
#include <string.h>

#include "http/json.h"
#include "native-api/napi_int.h"
#include "tests/check.h"
#include "tests/sandbox_rec.h"

static void same(const sp_sandbox_rec_t *s, const char *what)
{
    sp_buf_t a = SP_BUF_INIT, b = SP_BUF_INIT;
    json_t *o = sp_napi__sandbox_json(s);
    CHECK(sp_json_write(&a, o) == 0);
    json_decref(o);
    CHECK(sp_napi__sandbox_write(&b, s) == 0);
    bool eq = a.len == b.len && memcmp(a.p, b.p, a.len) == 0;
    if (!eq)
        fprintf(stderr, "%s:\n jansson %s\n written %s\n", what, sp_buf_cstr(&a), sp_buf_cstr(&b));
    CHECK(eq);
    sp_buf_free(&a);
    sp_buf_free(&b);
}

int main(void)
{
    sp_sandbox_rec_t s;
    test_sandbox_rec(&s);
    snprintf(s.last_activity_at, sizeof(s.last_activity_at), "2026-12-02T00:25:19.123Z");
    s.idle_timeout_s = 21600;
    same(&s, "plain, nulls");

    snprintf(s.deadline_at, sizeof(s.deadline_at), "2026-12-02T06:25:19.000Z");
    snprintf(s.error, sizeof(s.error), "boot failed: \"quoted\"\\ \n\t\x01 é €");
    snprintf(s.template_name, sizeof(s.template_name), "tmpl/ünï\x7f");
    s.snapshot_bytes = 9007199254740993LL;
    s.idle_timeout_s = -1;
    s.cpu_count = 2147483647;
    json_object_set_new(s.metadata, "k\"ey", json_string("v\\al\n"));
    json_object_set_new(s.metadata, "nested", json_pack("{s:[i,s,b,n]}", "a", 1, "x", 1));
    same(&s, "escapes, deadline, error, metadata");

    /* What jansson cannot hold (not UTF-8) it drops from the object; the writer refuses. */
    snprintf(s.error, sizeof(s.error), "bad \xff byte");
    sp_buf_t b = SP_BUF_INIT;
    CHECK(sp_napi__sandbox_write(&b, &s) < 0);
    sp_buf_free(&b);
    json_decref(s.metadata);
    s.metadata = NULL;
    CHECK(sp_napi__sandbox_write(&b, &s) < 0);
    sp_buf_free(&b);
    return check_report("native-api.render");
}
