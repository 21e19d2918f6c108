/*
 * test_svcfilter.c - metadata filters and user string maps.
 */
#include <stdio.h>
#include <string.h>

#include "core/control/svc.h"
#include "tests/check.h"

static void test_svcfilter_metadata_pairs(void)
{
    sp_err_t e;
    json_t *f = sp_svc_metadata_filter("user=alice&env=prod", &e);
    CHECK(f != NULL && json_object_size(f) == 2);
    CHECK(f && strcmp(json_string_value(json_object_get(f, "user")), "alice") == 0);
    CHECK(f && strcmp(json_string_value(json_object_get(f, "env")), "prod") == 0);
    json_decref(f);
    f = sp_svc_metadata_filter("k=", &e);
    CHECK(f && strcmp(json_string_value(json_object_get(f, "k")), "") == 0);
    json_decref(f);
    f = sp_svc_metadata_filter("", &e);
    CHECK(f && json_object_size(f) == 0);
    json_decref(f);
    CHECK(sp_svc_metadata_filter("novalue", &e) == NULL && e.code == SP_EINVAL);
    CHECK(sp_svc_metadata_filter("=v", &e) == NULL && e.code == SP_EINVAL);
}

static void test_svcfilter_string_maps(void)
{
    sp_err_t e;
    json_t *ok = json_pack("{s:s,s:s}", "a", "1", "b", "");
    CHECK(sp_svc_check_string_map(ok, "metadata", &e) == 0);
    json_decref(ok);
    CHECK(sp_svc_check_string_map(NULL, "metadata", &e) == 0);
    json_t *bad = json_pack("{s:i}", "a", 1);
    CHECK(sp_svc_check_string_map(bad, "metadata", &e) == -1 && e.code == SP_EINVAL);
    CHECK(strstr(e.msg, "must be a string") != NULL);
    json_decref(bad);
    json_t *arr = json_array();
    CHECK(sp_svc_check_string_map(arr, "env", &e) == -1);
    json_decref(arr);
    json_t *big = json_object();
    char k[16];
    for (int i = 0; i < 300; i++) {
        snprintf(k, sizeof(k), "k%d", i);
        json_object_set_new(big, k, json_string("v"));
    }
    CHECK(sp_svc_check_string_map(big, "metadata", &e) == -1);
    json_decref(big);
    json_t *nul = json_object();
    json_object_set_new(nul, "k", json_stringn("a\0b", 3));
    CHECK(sp_svc_check_string_map(nul, "env", &e) == -1);
    json_decref(nul);
}

int main(void)
{
    test_svcfilter_metadata_pairs();
    test_svcfilter_string_maps();
    return check_report("svcfilter");
}
