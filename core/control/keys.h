/*
 * keys.h - teams and API keys, the administrative side (blocking libpq).
 *
 * Used by `spaced keys ...` and by the embedded default's first start. The
 * request path authenticates through core/control/svc.h instead. A key is shown
 * once, when created; the database keeps its BLAKE2b hash keyed with the
 * installation's hash key (settings row 'key_hash_key'), and its prefix.
 */
#ifndef SP_KEYS_H
#define SP_KEYS_H

#include <libpq-fe.h>
#include <stdio.h>

#include "base/err.h"
#include "base/ids.h"

/* Reads the installation's key-hash key, creating it on first use. */
int sp_keys_hash_key(PGconn *c, unsigned char out[SP_HASHKEY_LEN], sp_err_t *err);

/* Creates a key for team `team` (created when missing; NULL = "default"). key gets the secret. */
int sp_keys_create(PGconn *c, const char *team, const char *name, char key[SP_KEY_LEN + 1],
                   char key_id[SP_ID_LEN + 1], sp_err_t *err);

/* Writes one line per key: id, team, prefix, created, revoked. */
int sp_keys_list(PGconn *c, FILE *out, sp_err_t *err);

/* Revokes by key ID or by prefix; SP_ENOTFOUND when nothing matched. */
int sp_keys_revoke(PGconn *c, const char *id_or_prefix, sp_err_t *err);

/* Number of teams: 0 means a fresh installation. */
int sp_keys_team_count(PGconn *c, long *out, sp_err_t *err);

#endif
