/*
 * tokens.h - a sandbox's data-plane tokens (E2B's envdAccessToken and trafficAccessToken),
 * never stored in a form that works.
 *
 * A token is derived, not stored: keyed BLAKE2b under the token key over a label, the
 * sandbox's ID and its salt (sandboxes.token_salt, random per sandbox), mapped to 43 chars of
 * [A-Za-z0-9]. So it can be given again where the E2B wire gives it again (connect, detail)
 * and checked (signed file URLs recompute it) without being kept. The row also keeps the
 * envd token's keyed hash (token_hash, with the API keys' hash key, keys.h) for the one
 * lookup by token alone (spec 1.6 2b: a request carrying only X-Access-Token).
 *
 * The token key comes from the master key when spaced has one (core/egress/secrets.h; it is
 * never in the database): then the database alone cannot make a working token. Without one it
 * comes from the database's hash key, and the database alone can (the README says so). The
 * salt says which key made it: "m1.<hex>" (master) or "d1.<hex>" (database), so adding a
 * master key later leaves the tokens of existing sandboxes as they were.
 *
 * Rows written before schema 12 held the token in clear (access_token). sp_tokens_convert
 * (start-up) seals each under the token key into the salt ("m0.<base64>" or "d0.<base64>":
 * the token must be given again, unchanged, by connect) and clears access_token.
 */
#ifndef SP_TOKENS_H
#define SP_TOKENS_H

#include <libpq-fe.h>
#include <stdbool.h>

#include "base/err.h"
#include "base/ids.h"

typedef struct sp_tokens sp_tokens_t;

#define SP_TOKENS_KEY_LEN 32
#define SP_TOKENS_SALT_MAX 160 /* the longest salt ("x0." and a sealed token) and its NUL */

/* hashkey: the database's (keys.h); master: the master key, or NULL. Both copied. */
sp_tokens_t *sp_tokens_create(const unsigned char hashkey[SP_HASHKEY_LEN],
                              const unsigned char *master);
/* Zeroes the keys. NULL does nothing. */
void sp_tokens_destroy(sp_tokens_t *t);

/* Whether new tokens come from the master key. */
bool sp_tokens_from_master(const sp_tokens_t *t);

/* A new sandbox's salt, and the keyed hash of the envd token it gives. */
void sp_tokens_new(const sp_tokens_t *t, const char *id, char salt[SP_TOKENS_SALT_MAX],
                   char hash[SP_KEYHASH_HEX + 1]);

/* The envd access token of sandbox id with that salt; -1 (out "") when the salt is malformed
 * or needs a key this server does not have (a master-key salt without a master key). */
int sp_tokens_envd(const sp_tokens_t *t, const char *id, const char *salt,
                   char out[SP_TOKEN_LEN + 1]);
/* The traffic access token (E2B-Traffic-Access-Token): a forwarded port's and the code
 * interpreter's credential, not envd's. Same failures. */
int sp_tokens_traffic(const sp_tokens_t *t, const char *id, const char *salt,
                      char out[SP_TOKEN_LEN + 1]);

/* The keyed hash a presented envd token is looked up by. */
void sp_tokens_hash(const sp_tokens_t *t, const char *token, char out[SP_KEYHASH_HEX + 1]);

/* Whether a presented credential equals a token, in time that does not depend on where they
 * differ. An empty token matches nothing. */
bool sp_tokens_equal(const char *given, const char *token);

/* Blocking (start-up, after the migrations): the rows that still hold a token in clear get
 * its hash and its sealed salt, and lose the clear one. *n: rows converted. */
int sp_tokens_convert(PGconn *c, const sp_tokens_t *t, int *n, sp_err_t *err);

#endif
