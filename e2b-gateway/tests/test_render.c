/*
 * test_render.c - sp_e2b__listed_write gives the bytes sp_json_write gives
 * sp_e2b__listed_json for the same record, listed and in detail: escapes, non-ASCII, nested
 * metadata, network present or not, every allowInternetAccess and lifecycle form, large
 * numbers; and refuses (for the jansson path to answer) what jansson drops.
 */
#include <stdio.h>
#include <string.h>

#include "e2b-gateway/route_int.h"
#include "http/json.h"
#include "tests/check.h"
#include "tests/sandbox_rec.h"

static void same(const sp_sandbox_rec_t *s, const char *domain, long long disk, const char *what)
{
    for (int detail = 0; detail <= 1; detail++) {
        sp_buf_t a = SP_BUF_INIT, b = SP_BUF_INIT;
        json_t *o = sp_e2b__listed_json(domain, s, "running", disk, detail);
        CHECK(sp_json_write(&a, o) == 0);
        json_decref(o);
        CHECK(sp_e2b__listed_write(&b, domain, s, "running", disk, detail) == 0);
        bool eq = a.len == b.len && memcmp(a.p, b.p, a.len) == 0;
        if (!eq)
            fprintf(stderr, "%s (detail %d):\n jansson %s\n written %s\n", what, detail,
                    sp_buf_cstr(&a), sp_buf_cstr(&b));
        CHECK(eq);
        sp_buf_free(&a);
        sp_buf_free(&b);
    }
}

int main(void)
{
    sp_sandbox_rec_t s;
    test_sandbox_rec(&s);
    snprintf(s.end_at, sizeof(s.end_at), "2026-12-02T00:25:34.123Z");
    s.allow_internet = -1;
    same(&s, "e2b.local", 0, "plain: default envd version, no network, allowInternetAccess null");

    snprintf(s.envd_version, sizeof(s.envd_version), "0.2.0");
    snprintf(s.template_name, sizeof(s.template_name), "tmpl/\xc3\xbc\"n\\\x7f\x01");
    snprintf(s.deadline_action, sizeof(s.deadline_action), "suspend");
    s.auto_resume = true;
    s.allow_internet = 1;
    s.cpu_count = 2147483647;
    s.memory_mb = -5;
    json_object_set_new(s.metadata, "k\"ey", json_string("v\\al\n\xe2\x82\xac"));
    json_object_set_new(s.metadata, "nested", json_pack("{s:[i,s,b,n]}", "a", 1, "x", 1));
    s.network = json_pack("{s:[s],s:b}", "allowOut", "1.1.1.1", "allowPublicTraffic", 0);
    same(&s, "d\xc3\xa9v.example", 9007199254740993LL, "escapes, network, pause, true");

    s.allow_internet = 0;
    s.auto_resume = false;
    json_decref(s.network);
    s.network = json_object();
    same(&s, "", -1, "false, empty network");
    json_decref(s.network);
    s.network = NULL;

    /* What jansson cannot hold (not UTF-8) it drops from the object; the writer refuses. */
    sp_buf_t b = SP_BUF_INIT;
    snprintf(s.access_token, sizeof(s.access_token), "bad \xff byte");
    CHECK(sp_e2b__listed_write(&b, "d", &s, "running", 0, true) < 0);
    sp_buf_reset(&b);
    CHECK(sp_e2b__listed_write(&b, "\xc0", &s, "running", 0, true) < 0);
    sp_buf_reset(&b);
    snprintf(s.access_token, sizeof(s.access_token), "tok");
    snprintf(s.end_at, sizeof(s.end_at), "\xe2\x82");
    CHECK(sp_e2b__listed_write(&b, "d", &s, "running", 0, false) < 0);
    sp_buf_reset(&b);
    snprintf(s.end_at, sizeof(s.end_at), "2026-12-02T00:25:34.123Z");
    json_decref(s.metadata);
    s.metadata = NULL;
    CHECK(sp_e2b__listed_write(&b, "d", &s, "running", 0, false) < 0);
    sp_buf_free(&b);
    return check_report("e2b-gateway.render");
}
