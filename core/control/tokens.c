/*
 * tokens.c - sandboxes' data-plane tokens, derived from a key and a salt (tokens.h).
 */
#include "core/control/tokens.h"

#include <sodium.h>
#include <stdlib.h>
#include <string.h>

#include "base/log.h"

struct sp_tokens {
    bool has_master;
    unsigned char km[SP_TOKENS_KEY_LEN]; /* from the master key ('m' salts) */
    unsigned char kd[SP_TOKENS_KEY_LEN]; /* from the database's hash key ('d' salts) */
    unsigned char hashkey[SP_HASHKEY_LEN];
};

static const char base62[] = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789";

/* out = keyed BLAKE2b-256(key, label): one key per purpose from one secret. */
static void subkey(unsigned char out[SP_TOKENS_KEY_LEN], const unsigned char key[32],
                   const char *label)
{
    crypto_generichash(out, SP_TOKENS_KEY_LEN, (const unsigned char *)label, strlen(label), key,
                       32);
}

sp_tokens_t *sp_tokens_create(const unsigned char hashkey[SP_HASHKEY_LEN],
                              const unsigned char *master)
{
    sp_tokens_t *t = calloc(1, sizeof(*t));
    if (t == NULL)
        return NULL;
    memcpy(t->hashkey, hashkey, SP_HASHKEY_LEN);
    subkey(t->kd, hashkey, "space sandbox token key v1");
    if (master != NULL) {
        subkey(t->km, master, "space sandbox token key v1");
        t->has_master = true;
    }
    return t;
}

void sp_tokens_destroy(sp_tokens_t *t)
{
    if (t == NULL)
        return;
    sodium_memzero(t, sizeof(*t));
    free(t);
}

bool sp_tokens_from_master(const sp_tokens_t *t)
{
    return t->has_master;
}

/* The key a salt names ("m..." or "d..."); NULL when this server has not got it. */
static const unsigned char *salt_key(const sp_tokens_t *t, const char *salt)
{
    if (salt[0] == 'm')
        return t->has_master ? t->km : NULL;
    if (salt[0] == 'd')
        return t->kd;
    return NULL;
}

static void derive(const unsigned char *key, const char *label, const char *id, const char *salt,
                   char out[SP_TOKEN_LEN + 1])
{
    crypto_generichash_state st;
    unsigned char h[64];
    crypto_generichash_init(&st, key, SP_TOKENS_KEY_LEN, sizeof(h));
    crypto_generichash_update(&st, (const unsigned char *)label, strlen(label) + 1);
    crypto_generichash_update(&st, (const unsigned char *)id, strlen(id) + 1);
    crypto_generichash_update(&st, (const unsigned char *)salt, strlen(salt));
    crypto_generichash_final(&st, h, sizeof(h));
    /* 43 of the 64 bytes, each to one of 62 chars: about 5.9 bits each, 250 in all. */
    for (int i = 0; i < SP_TOKEN_LEN; i++)
        out[i] = base62[h[i] % 62];
    out[SP_TOKEN_LEN] = '\0';
    sodium_memzero(h, sizeof(h));
}

/* The per-sandbox key a converted (sealed) token is sealed under. */
static void seal_key(const unsigned char *key, const char *id, unsigned char out[32])
{
    crypto_generichash_state st;
    crypto_generichash_init(&st, key, SP_TOKENS_KEY_LEN, 32);
    crypto_generichash_update(&st, (const unsigned char *)"space sandbox token seal v1", 28);
    crypto_generichash_update(&st, (const unsigned char *)id, strlen(id));
    crypto_generichash_final(&st, out, 32);
}

#define SEALED_LEN (crypto_secretbox_NONCEBYTES + crypto_secretbox_MACBYTES + SP_TOKEN_LEN)

static int open_sealed(const unsigned char *key, const char *id, const char *b64,
                       char out[SP_TOKEN_LEN + 1])
{
    unsigned char box[SEALED_LEN + 1], k[32];
    size_t n = 0;
    if (sodium_base642bin(box, sizeof(box), b64, strlen(b64), NULL, &n, NULL,
                          sodium_base64_VARIANT_ORIGINAL) != 0 ||
        n != SEALED_LEN)
        return -1;
    seal_key(key, id, k);
    int rc = crypto_secretbox_open_easy((unsigned char *)out, box + crypto_secretbox_NONCEBYTES,
                                        n - crypto_secretbox_NONCEBYTES, box, k);
    sodium_memzero(k, sizeof(k));
    out[SP_TOKEN_LEN] = '\0';
    if (rc != 0 || strlen(out) != SP_TOKEN_LEN)
        return -1;
    return 0;
}

int sp_tokens_envd(const sp_tokens_t *t, const char *id, const char *salt,
                   char out[SP_TOKEN_LEN + 1])
{
    out[0] = '\0';
    const unsigned char *key = salt ? salt_key(t, salt) : NULL;
    if (key == NULL || salt[1] == '\0' || salt[2] != '.')
        return -1;
    if (salt[1] == '1') {
        derive(key, "envd", id, salt, out);
        return 0;
    }
    if (salt[1] == '0' && open_sealed(key, id, salt + 3, out) == 0)
        return 0;
    out[0] = '\0';
    return -1;
}

int sp_tokens_traffic(const sp_tokens_t *t, const char *id, const char *salt,
                      char out[SP_TOKEN_LEN + 1])
{
    out[0] = '\0';
    const unsigned char *key = salt ? salt_key(t, salt) : NULL;
    if (key == NULL || (salt[1] != '0' && salt[1] != '1') || salt[2] != '.')
        return -1;
    derive(key, "traffic", id, salt, out);
    return 0;
}

void sp_tokens_new(const sp_tokens_t *t, const char *id, char salt[SP_TOKENS_SALT_MAX],
                   char hash[SP_KEYHASH_HEX + 1])
{
    unsigned char r[16];
    randombytes_buf(r, sizeof(r));
    salt[0] = t->has_master ? 'm' : 'd';
    salt[1] = '1';
    salt[2] = '.';
    sodium_bin2hex(salt + 3, SP_TOKENS_SALT_MAX - 3, r, sizeof(r));
    char tok[SP_TOKEN_LEN + 1];
    sp_tokens_envd(t, id, salt, tok); /* cannot fail: the salt names a key we have */
    sp_tokens_hash(t, tok, hash);
    sodium_memzero(tok, sizeof(tok));
}

void sp_tokens_hash(const sp_tokens_t *t, const char *token, char out[SP_KEYHASH_HEX + 1])
{
    sp_ids_key_hash(t->hashkey, token, out);
}

bool sp_tokens_equal(const char *given, const char *token)
{
    size_t n = strlen(token);
    if (given == NULL || n == 0 || strlen(given) != n)
        return false;
    return sodium_memcmp(given, token, n) == 0;
}

/* The sealed salt for a token kept in clear before schema 12. */
static int seal(const sp_tokens_t *t, const char *id, const char *token,
                char salt[SP_TOKENS_SALT_MAX])
{
    if (strlen(token) != SP_TOKEN_LEN)
        return -1;
    unsigned char box[SEALED_LEN], k[32];
    randombytes_buf(box, crypto_secretbox_NONCEBYTES);
    seal_key(t->has_master ? t->km : t->kd, id, k);
    crypto_secretbox_easy(box + crypto_secretbox_NONCEBYTES, (const unsigned char *)token,
                          SP_TOKEN_LEN, box, k);
    sodium_memzero(k, sizeof(k));
    salt[0] = t->has_master ? 'm' : 'd';
    salt[1] = '0';
    salt[2] = '.';
    sodium_bin2base64(salt + 3, SP_TOKENS_SALT_MAX - 3, box, sizeof(box),
                      sodium_base64_VARIANT_ORIGINAL);
    return 0;
}

int sp_tokens_convert(PGconn *c, const sp_tokens_t *t, int *n, sp_err_t *err)
{
    *n = 0;
    PGresult *r =
        PQexec(c, "SELECT id, access_token FROM sandboxes WHERE access_token IS NOT NULL");
    if (PQresultStatus(r) != PGRES_TUPLES_OK) {
        sp_log(SP_LOG_ERROR, "tokens", "reading tokens failed err=%s", PQresultErrorMessage(r));
        PQclear(r);
        return sp_err_set(err, SP_EUNAVAIL, "database error");
    }
    int rc = 0;
    for (int i = 0; i < PQntuples(r) && rc == 0; i++) {
        const char *id = PQgetvalue(r, i, 0), *tok = PQgetvalue(r, i, 1);
        char salt[SP_TOKENS_SALT_MAX], hash[SP_KEYHASH_HEX + 1];
        if (seal(t, id, tok, salt) < 0) {
            /* Not one we made (hand-written rows): it cannot be given again; it stops working. */
            sp_log(SP_LOG_WARN, "tokens", "sandbox=%s token of unexpected form: replaced", id);
            sp_tokens_new(t, id, salt, hash);
        } else {
            sp_tokens_hash(t, tok, hash);
        }
        /* Only while it still holds that token: a second server converting at once wins or
         * loses as a whole, and both write a working pair. */
        const char *p[] = {id, tok, salt, hash};
        PGresult *u = PQexecParams(c,
                                   "UPDATE sandboxes SET token_salt = $3, token_hash = $4,"
                                   " access_token = NULL WHERE id = $1 AND access_token = $2",
                                   4, NULL, p, NULL, NULL, 0);
        if (PQresultStatus(u) != PGRES_COMMAND_OK) {
            sp_log(SP_LOG_ERROR, "tokens", "sandbox=%s converting token failed err=%s", id,
                   PQresultErrorMessage(u));
            rc = sp_err_set(err, SP_EUNAVAIL, "database error");
        } else {
            *n += atoi(PQcmdTuples(u));
        }
        PQclear(u);
        sodium_memzero(salt, sizeof(salt));
    }
    PQclear(r);
    return rc;
}
