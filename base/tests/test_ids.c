/*
 * test_ids.c - ID alphabet and length, key format, keyed hashing.
 */
#include <stdio.h>
#include <string.h>

#include "base/ids.h"
#include "tests/check.h"

static void test_ids_sandbox_alphabet(void)
{
    char a[SP_ID_LEN + 1], b[SP_ID_LEN + 1];
    for (int i = 0; i < 1000; i++) {
        sp_ids_sandbox(a);
        CHECK(strlen(a) == SP_ID_LEN);
        CHECK(sp_ids_valid(a));
        CHECK(a[0] >= 'a' && a[0] <= 'z');
        CHECK(strspn(a, "abcdefghijklmnopqrstuvwxyz0123456789") == SP_ID_LEN);
    }
    sp_ids_sandbox(b);
    CHECK(strcmp(a, b) != 0);
    char op[SP_OPID_LEN + 1];
    sp_ids_operation(op);
    CHECK(strncmp(op, "op", 2) == 0 && sp_ids_valid(op) && strlen(op) == SP_OPID_LEN);
}

static void test_ids_valid_rejects(void)
{
    CHECK(!sp_ids_valid(""));
    CHECK(!sp_ids_valid(NULL));
    CHECK(!sp_ids_valid("abc-def"));
    CHECK(!sp_ids_valid("abc.def"));
    CHECK(!sp_ids_valid("ABC"));
    CHECK(!sp_ids_valid("abc/../x"));
    CHECK(!sp_ids_valid("abc'; drop table"));
    char longid[80];
    memset(longid, 'a', 65);
    longid[65] = '\0';
    CHECK(!sp_ids_valid(longid));
    longid[64] = '\0';
    CHECK(sp_ids_valid(longid));
}

static void test_ids_key_and_hash(void)
{
    char k1[SP_KEY_LEN + 1], k2[SP_KEY_LEN + 1];
    sp_ids_api_key(k1);
    sp_ids_api_key(k2);
    CHECK(strncmp(k1, "sk_", 3) == 0 && strlen(k1) == SP_KEY_LEN);
    CHECK(strcmp(k1, k2) != 0);
    unsigned char hk1[SP_HASHKEY_LEN] = {1}, hk2[SP_HASHKEY_LEN] = {2};
    char h1[SP_KEYHASH_HEX + 1], h1b[SP_KEYHASH_HEX + 1], h2[SP_KEYHASH_HEX + 1],
        h3[SP_KEYHASH_HEX + 1];
    sp_ids_key_hash(hk1, k1, h1);
    sp_ids_key_hash(hk1, k1, h1b);
    sp_ids_key_hash(hk2, k1, h2);
    sp_ids_key_hash(hk1, k2, h3);
    CHECK(strcmp(h1, h1b) == 0);      /* deterministic */
    CHECK(strcmp(h1, h2) != 0);       /* keyed */
    CHECK(strcmp(h1, h3) != 0);       /* per key */
    CHECK(strstr(h1, k1 + 3) == NULL); /* not the key */
    CHECK(strlen(h1) == SP_KEYHASH_HEX);
}

int main(void)
{
    if (sp_ids_init() < 0)
        return 1;
    test_ids_sandbox_alphabet();
    test_ids_valid_rejects();
    test_ids_key_and_hash();
    return check_report("ids");
}
