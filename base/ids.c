/*
 * ids.c - IDs, keys and key hashes from libsodium.
 */
#include "base/ids.h"

#include <sodium.h>
#include <string.h>

static const char lower36[] = "abcdefghijklmnopqrstuvwxyz0123456789";
static const char base62[] = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789";

int sp_ids_init(void)
{
    return sodium_init() < 0 ? -1 : 0;
}

static void random_over(char *out, size_t n, const char *alphabet, uint32_t len)
{
    /* randombytes_uniform has no modulo bias. */
    for (size_t i = 0; i < n; i++)
        out[i] = alphabet[randombytes_uniform(len)];
    out[n] = '\0';
}

void sp_ids_random(char *out, size_t n)
{
    random_over(out, n, lower36, 36);
}

void sp_ids_random62(char *out, size_t n)
{
    random_over(out, n, base62, 62);
}

void sp_ids_sandbox(char out[SP_ID_LEN + 1])
{
    /* First char a letter, so an ID never reads as a number or port. */
    out[0] = lower36[randombytes_uniform(26)];
    sp_ids_random(out + 1, SP_ID_LEN - 1);
}

void sp_ids_operation(char out[SP_OPID_LEN + 1])
{
    out[0] = 'o';
    out[1] = 'p';
    sp_ids_random(out + 2, SP_OPID_LEN - 2);
}

void sp_ids_api_key(char out[SP_KEY_LEN + 1])
{
    memcpy(out, "sk_", 3);
    sp_ids_random62(out + 3, SP_KEY_LEN - 3);
}

void sp_ids_token(char out[SP_TOKEN_LEN + 1])
{
    sp_ids_random62(out, SP_TOKEN_LEN);
}

bool sp_ids_valid(const char *s)
{
    size_t n = s ? strlen(s) : 0;
    if (n == 0 || n > 64)
        return false;
    for (size_t i = 0; i < n; i++)
        if (!((s[i] >= 'a' && s[i] <= 'z') || (s[i] >= '0' && s[i] <= '9')))
            return false;
    return true;
}

void sp_ids_key_hash(const unsigned char hashkey[SP_HASHKEY_LEN], const char *key,
                     char out[SP_KEYHASH_HEX + 1])
{
    unsigned char h[32];
    crypto_generichash(h, sizeof(h), (const unsigned char *)key, strlen(key), hashkey,
                       SP_HASHKEY_LEN);
    sodium_bin2hex(out, SP_KEYHASH_HEX + 1, h, sizeof(h));
}
