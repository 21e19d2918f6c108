/*
 * ids.h - random identifiers and secrets (libsodium's CSPRNG).
 *
 * Sandbox and operation IDs are lowercase letters and digits only, because
 * the E2B host form <port>-<id>.<domain> splits on '-' and '.'. API keys are
 * shown once and stored only as a keyed BLAKE2b hash.
 */
#ifndef SP_IDS_H
#define SP_IDS_H

#include <stdbool.h>
#include <stddef.h>

#define SP_ID_LEN      20 /* sandbox IDs: 20 chars of [a-z0-9], ~103 bits */
#define SP_OPID_LEN    24 /* "op" + 22 chars */
#define SP_KEY_LEN     46 /* "sk_" + 43 chars of base62, ~256 bits */
#define SP_KEY_PREFIX  11 /* "sk_" + 8: shown in listings, identifies without revealing */
#define SP_TOKEN_LEN   43 /* access tokens: 43 chars of base62 */
#define SP_HASHKEY_LEN 32
#define SP_KEYHASH_HEX 64

/* 0 on success; -1 if libsodium cannot initialise. Call once at start. */
int sp_ids_init(void);

/* out gets n chars of [a-z0-9] plus NUL: out must hold n+1. */
void sp_ids_random(char *out, size_t n);
/* Same over [A-Za-z0-9]. */
void sp_ids_random62(char *out, size_t n);

void sp_ids_sandbox(char out[SP_ID_LEN + 1]);
void sp_ids_operation(char out[SP_OPID_LEN + 1]);
void sp_ids_api_key(char out[SP_KEY_LEN + 1]);
void sp_ids_token(char out[SP_TOKEN_LEN + 1]);

/* Whether s looks like a sandbox ID (1..64 chars of [a-z0-9]); rejects before any lookup. */
bool sp_ids_valid(const char *s);

/* Hex of BLAKE2b-256(key) keyed with hashkey. */
void sp_ids_key_hash(const unsigned char hashkey[SP_HASHKEY_LEN], const char *key,
                     char out[SP_KEYHASH_HEX + 1]);

#endif
