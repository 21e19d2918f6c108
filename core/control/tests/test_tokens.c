/*
 * test_tokens.c - sandboxes' data-plane tokens (core/control/tokens.h): derived again the same,
 * different per sandbox, per kind and per key, and a master-key salt opens nothing without it.
 */
#include <string.h>

#include "base/ids.h"
#include "core/control/tokens.h"
#include "tests/check.h"

static void fill(unsigned char *k, unsigned char v)
{
    memset(k, v, 32);
}

int main(void)
{
    REQUIRE(sp_ids_init() == 0);
    unsigned char hk[SP_HASHKEY_LEN], mk[32], mk2[32];
    fill(hk, 1);
    fill(mk, 2);
    fill(mk2, 3);
    sp_tokens_t *m = sp_tokens_create(hk, mk), *d = sp_tokens_create(hk, NULL),
                *m2 = sp_tokens_create(hk, mk2);
    REQUIRE(m != NULL && d != NULL && m2 != NULL);
    CHECK(sp_tokens_from_master(m) && !sp_tokens_from_master(d));

    char salt[SP_TOKENS_SALT_MAX], hash[SP_KEYHASH_HEX + 1], tok[SP_TOKEN_LEN + 1],
        again[SP_TOKEN_LEN + 1], traffic[SP_TOKEN_LEN + 1], h2[SP_KEYHASH_HEX + 1];
    sp_tokens_new(m, "sbxone", salt, hash);
    CHECK(strncmp(salt, "m1.", 3) == 0 && strlen(salt) == 3 + 32);
    CHECK(sp_tokens_envd(m, "sbxone", salt, tok) == 0 && strlen(tok) == SP_TOKEN_LEN);
    for (size_t i = 0; i < strlen(tok); i++)
        CHECK((tok[i] >= 'A' && tok[i] <= 'Z') || (tok[i] >= 'a' && tok[i] <= 'z') ||
              (tok[i] >= '0' && tok[i] <= '9'));
    CHECK(sp_tokens_envd(m, "sbxone", salt, again) == 0 && strcmp(tok, again) == 0);
    sp_tokens_hash(m, tok, h2);
    CHECK(strcmp(hash, h2) == 0); /* the lookup finds it by the hash stored at create */
    CHECK(sp_tokens_traffic(m, "sbxone", salt, traffic) == 0 && strcmp(traffic, tok) != 0);
    /* another sandbox with the same salt, another salt, another master key: other tokens */
    CHECK(sp_tokens_envd(m, "sbxtwo", salt, again) == 0 && strcmp(tok, again) != 0);
    char salt2[SP_TOKENS_SALT_MAX];
    sp_tokens_new(m, "sbxone", salt2, h2);
    CHECK(strcmp(salt, salt2) != 0 && strcmp(hash, h2) != 0);
    CHECK(sp_tokens_envd(m2, "sbxone", salt, again) == 0 && strcmp(tok, again) != 0);
    /* without the master key, its salts give nothing (not a token of the database's key) */
    CHECK(sp_tokens_envd(d, "sbxone", salt, again) == -1 && again[0] == '\0');
    CHECK(sp_tokens_traffic(d, "sbxone", salt, again) == -1 && again[0] == '\0');
    /* a database-key salt is derived the same by any server of the installation */
    sp_tokens_new(d, "sbxone", salt2, h2);
    CHECK(strncmp(salt2, "d1.", 3) == 0);
    char a[SP_TOKEN_LEN + 1], b[SP_TOKEN_LEN + 1];
    CHECK(sp_tokens_envd(d, "sbxone", salt2, a) == 0 &&
          sp_tokens_envd(m, "sbxone", salt2, b) == 0 && strcmp(a, b) == 0);
    /* malformed salts */
    const char *bad[] = {"", "m", "m1", "x1.00", "m2.00", "d0.notbase64", "d0."};
    for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++)
        CHECK(sp_tokens_envd(m, "sbxone", bad[i], again) == -1 && again[0] == '\0');
    CHECK(sp_tokens_envd(m, "sbxone", NULL, again) == -1);
    /* comparisons */
    CHECK(sp_tokens_equal(tok, tok));
    CHECK(!sp_tokens_equal(NULL, tok) && !sp_tokens_equal("", "") && !sp_tokens_equal(tok, ""));
    CHECK(!sp_tokens_equal(traffic, tok));
    char near[SP_TOKEN_LEN + 1];
    memcpy(near, tok, sizeof(near));
    near[SP_TOKEN_LEN - 1] ^= 1;
    CHECK(!sp_tokens_equal(near, tok));
    near[SP_TOKEN_LEN - 1] = '\0';
    CHECK(!sp_tokens_equal(near, tok));
    sp_tokens_destroy(m);
    sp_tokens_destroy(d);
    sp_tokens_destroy(m2);
    sp_tokens_destroy(NULL);
    return check_report("core.tokens");
}
