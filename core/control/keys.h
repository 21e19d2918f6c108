/*
 * keys.h - teams and API keys, the administrative side (blocking libpq).
 *
 * Used by `spaced keys|teams|admin-key ...` and by the first start. The request
 * path authenticates through core/control/svc.h (team keys) and core/control/admin.h
 * (the admin key) instead. A key is shown
 * once, when created; the database keeps its BLAKE2b hash keyed with the
 * installation's hash key (settings row 'key_hash_key'), and its prefix.
 */
#ifndef SP_KEYS_H
#define SP_KEYS_H

#include <libpq-fe.h>
#include <stdbool.h>
#include <stdio.h>

#include "base/err.h"
#include "base/ids.h"

/* Reads the installation's key-hash key, creating it on first use. */
int sp_keys_hash_key(PGconn *c, unsigned char out[SP_HASHKEY_LEN], sp_err_t *err);

/* Creates a key for team `team` (created when missing; NULL = "default"). key gets the secret. */
int sp_keys_create(PGconn *c, const char *team, const char *name, char key[SP_KEY_LEN + 1],
                   char key_id[SP_ID_LEN + 1], sp_err_t *err);

/* Writes one line per key: id, team, prefix, created, revoked; team: only that team's (by
 * name or ID; NULL = all). */
int sp_keys_list(PGconn *c, const char *team, FILE *out, sp_err_t *err);

/* Revokes by key ID or by prefix; SP_ENOTFOUND when nothing matched. */
int sp_keys_revoke(PGconn *c, const char *id_or_prefix, sp_err_t *err);

/* A team name the admin surfaces accept: 1..64 of [A-Za-z0-9._-], not starting with '.' or
 * '-'. SP_EINVAL otherwise. */
int sp_keys_check_team_name(const char *name, sp_err_t *err);

/* Creates team `name`: SP_ECONFLICT when it exists. id gets its ID. */
int sp_keys_team_create(PGconn *c, const char *name, char id[SP_ID_LEN + 1], sp_err_t *err);

/* Writes one line per team: id, name, created, active keys, then its quotas (sandboxes, vCPUs,
 * memory in MiB, snapshot disk in MiB; "default": the server's, core/control/svc.h). */
int sp_keys_team_list(PGconn *c, FILE *out, sp_err_t *err);

/* Sets team's (name or ID) quotas: each of sandboxes, vcpus, memory_mb, snapshot_mb (in that
 * order) is NULL to leave it, "default" for the server's default, or a limit of 0 to 1000000000
 * (0: the team may hold none). SP_EINVAL on a bad value, SP_ENOTFOUND for an unknown team. */
int sp_keys_team_set_quota(PGconn *c, const char *team, const char *const limits[4], sp_err_t *err);

/* The installation's admin key (the /v1/admin routes' only credential), kept as its keyed
 * hash in settings ('admin_key_hash') like an API key's. Without `replace`, creates one only
 * when there is none: 1 and the secret in key when it did, 0 (key untouched) when one
 * existed. With `replace`, always makes a new one (the old one stops working): 1. */
int sp_keys_admin_create(PGconn *c, bool replace, char key[SP_KEY_LEN + 1], sp_err_t *err);

/* Number of teams: 0 means a fresh installation. */
int sp_keys_team_count(PGconn *c, long *out, sp_err_t *err);

#endif
