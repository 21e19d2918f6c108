/*
 * test_fleet.c - the fleet's pure parts: roles, a worker's --worker-labels and a create's
 * placement.labels.
 */
#include <string.h>

#include "core/control/fleet.h"
#include "tests/check.h"

static void test_fleet_roles(void)
{
    sp_role_t r;
    CHECK(sp_fleet_role_parse("all", &r) == 0 && r == SP_ROLE_ALL);
    CHECK(sp_fleet_role_parse("api", &r) == 0 && r == SP_ROLE_API);
    CHECK(sp_fleet_role_parse("worker", &r) == 0 && r == SP_ROLE_WORKER);
    CHECK(sp_fleet_role_parse("Worker", &r) == -1);
    CHECK(sp_fleet_role_parse(NULL, &r) == -1);
    CHECK(strcmp(sp_fleet_role_name(SP_ROLE_WORKER), "worker") == 0);
}

static void test_fleet_parse_labels(void)
{
    sp_err_t e;
    json_t *o = sp_fleet_parse_labels("zone=a,gpu=,disk=ssd", &e);
    REQUIRE(o != NULL);
    CHECK(json_object_size(o) == 3);
    CHECK(strcmp(json_string_value(json_object_get(o, "zone")), "a") == 0);
    CHECK(strcmp(json_string_value(json_object_get(o, "gpu")), "") == 0);
    json_decref(o);
    o = sp_fleet_parse_labels("", &e);
    CHECK(o != NULL && json_object_size(o) == 0);
    json_decref(o);
    static const char *const bad[] = {"zone",     "=a",    "zone=a,zone=b", "zone=a,",
                                      "zo ne=a",  "k=v=w", "k=\xc3\xa9",    ",",
                                      "a=b,,c=d", NULL};
    for (int i = 0; bad[i] != NULL; i++) {
        e.code = SP_OK;
        json_t *b = sp_fleet_parse_labels(bad[i], &e);
        CHECK(b == NULL && e.code == SP_EINVAL);
        json_decref(b);
    }
    char big[200];
    memset(big, 'k', sizeof big);
    memcpy(big + 64, "=v", 3);
    CHECK(sp_fleet_parse_labels(big, &e) == NULL); /* a key of 64 bytes */
    big[63] = '=';
    big[64] = 'v';
    big[65] = '\0';
    o = sp_fleet_parse_labels(big, &e); /* 63 */
    CHECK(o != NULL);
    json_decref(o);
}

static void test_fleet_check_labels(void)
{
    sp_err_t e;
    json_t *o = json_pack("{s:s,s:s}", "zone", "a", "tier", "gold");
    CHECK(sp_fleet_check_labels(o, "placement.labels", &e) == 0);
    json_object_set_new(o, "n", json_integer(1));
    CHECK(sp_fleet_check_labels(o, "placement.labels", &e) == -1 && e.code == SP_EINVAL &&
          strstr(e.msg, "placement.labels") != NULL);
    json_decref(o);
    json_t *a = json_array();
    CHECK(sp_fleet_check_labels(a, "x", &e) == -1);
    json_decref(a);
    o = json_object();
    for (int i = 0; i <= SP_FLEET_MAX_LABELS; i++) {
        char k[8];
        snprintf(k, sizeof k, "k%d", i);
        json_object_set_new(o, k, json_string("v"));
        CHECK((sp_fleet_check_labels(o, "x", &e) == 0) == (i < SP_FLEET_MAX_LABELS));
    }
    json_decref(o);
    o = json_pack("{s:s}", "", "v");
    CHECK(sp_fleet_check_labels(o, "x", &e) == -1);
    json_decref(o);
}

int main(void)
{
    test_fleet_roles();
    test_fleet_parse_labels();
    test_fleet_check_labels();
    return check_report("fleet");
}
