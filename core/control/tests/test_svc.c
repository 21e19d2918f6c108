/*
 * test_svc.c - what sp_svc_create_sandbox decides before it asks the database: credential
 * rules are checked (first, and only they need the secrets module), the other fields after.
 *
 * The store points at no server: a create that passes every check is refused by the store
 * (SP_EUNAVAIL, no callback), which is how these tests see that it got that far. The path
 * through the database (secrets looked up, then the row written) is native-api.secrets'.
 */
#include <sodium.h>
#include <stdio.h>
#include <string.h>

#include "core/control/svc.h"
#include "core/egress/secrets.h"
#include "tests/check.h"

static sp_loop_t *loop;
static sp_store_t *store;
static int called; /* callbacks: a refused create must make none */

static void on_created(void *arg, const sp_sandbox_rec_t *sb, const sp_op_rec_t *op,
                       const sp_err_t *err)
{
    called++;
}

static const sp_auth_t team = {.team_id = "team1", .key_id = "key1"};

static int create(sp_svc_t *svc, const char *tmpl, json_t *creds, sp_err_t *e)
{
    sp_create_req_t r = {.template_name = tmpl, .credentials = creds};
    memset(e, 0, sizeof(*e));
    return sp_svc_create_sandbox(svc, &team, &r, on_created, NULL, e);
}

static json_t *rule(const char *host, const char *secret)
{
    return json_pack("[{s:s,s:s,s:s}]", "host", host, "header", "Authorization", "secret", secret);
}

static void test_svc_create_checks_credentials_first(void)
{
    unsigned char hashkey[SP_HASHKEY_LEN] = {0};
    sp_err_t e;
    sp_svc_t *svc = sp_svc_create(loop, store, hashkey, &e);
    REQUIRE(svc != NULL);
    json_t *bad = json_pack("{s:s}", "host", "a.com"); /* not an array */
    json_t *framing =
        json_pack("[{s:s,s:s,s:s}]", "host", "a.com", "header", "Host", "secret", "GH");
    json_t *good = rule("API.example.com", "GH");
    json_t *none = json_array();

    /* A bad rule is named first, even beside a bad template; it needs no secrets module. */
    CHECK(create(svc, "", bad, &e) < 0 && e.code == SP_EINVAL && strstr(e.msg, "array"));
    CHECK(create(svc, "base", framing, &e) < 0 && e.code == SP_EINVAL && strstr(e.msg, "Host"));
    /* Good rules without secrets on this server: 503, as before the record is written. */
    CHECK(create(svc, "base", good, &e) < 0 && e.code == SP_EUNAVAIL &&
          strcmp(e.msg, "secrets are not available on this server") == 0);
    /* [] and null are no rules: nothing to look up, the other fields decide. */
    CHECK(create(svc, "", none, &e) < 0 && e.code == SP_EINVAL && strstr(e.msg, "template"));
    CHECK(create(svc, "", json_null(), &e) < 0 && e.code == SP_EINVAL);
    CHECK(create(svc, "base", none, &e) < 0 && e.code == SP_EUNAVAIL); /* the dead store */

    /* A secrets module without a master key says how to configure one. */
    sp_secrets_t *off = sp_secrets_create(loop, store, NULL, &e);
    REQUIRE(off != NULL);
    sp_svc_set_secrets(svc, off);
    CHECK(create(svc, "base", good, &e) < 0 && e.code == SP_EUNAVAIL &&
          strstr(e.msg, SP_SECRETS_ENV) != NULL);

    /* With a key: the rules pass, the other fields are checked next, then the secrets are
     * looked up (here the store refuses: no server). */
    unsigned char key[SP_SECRETS_KEY_LEN];
    randombytes_buf(key, sizeof(key));
    sp_secrets_t *on = sp_secrets_create(loop, store, key, &e);
    REQUIRE(on != NULL);
    sp_svc_set_secrets(svc, on);
    CHECK(create(svc, "", good, &e) < 0 && e.code == SP_EINVAL && strstr(e.msg, "template"));
    CHECK(create(svc, "base", good, &e) < 0 && e.code == SP_EUNAVAIL);
    CHECK(called == 0);

    json_decref(bad);
    json_decref(framing);
    json_decref(good);
    json_decref(none);
    sp_svc_destroy(svc);
    sp_secrets_destroy(off);
    sp_secrets_destroy(on);
}

int main(void)
{
    REQUIRE(sodium_init() >= 0);
    loop = sp_loop_create();
    REQUIRE(loop != NULL);
    sp_err_t e;
    /* No server behind it: connections fail at once and are retried on timers never run. */
    store =
        sp_store_create(loop, "host=/nonexistent/space-test dbname=none connect_timeout=1", 1, &e);
    REQUIRE(store != NULL);
    test_svc_create_checks_credentials_first();
    sp_store_destroy(store);
    sp_loop_destroy(loop);
    return check_report("test_svc");
}
