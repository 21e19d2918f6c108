/*
 * keys.c - administrative key management over a blocking connection.
 */
#include "core/control/keys.h"

#include <sodium.h>
#include <stdbool.h>
#include <stdlib.h>
#include <string.h>

#include "base/log.h"

static PGresult *run(PGconn *c, const char *sql, int n, const char *const *p, sp_err_t *err)
{
    PGresult *r = PQexecParams(c, sql, n, NULL, p, NULL, NULL, 0);
    ExecStatusType st = PQresultStatus(r);
    if (st != PGRES_TUPLES_OK && st != PGRES_COMMAND_OK) {
        sp_log(SP_LOG_ERROR, "keys", "statement failed err=%s", PQresultErrorMessage(r));
        sp_err_set(err, SP_EUNAVAIL, "database error");
        PQclear(r);
        return NULL;
    }
    return r;
}

int sp_keys_hash_key(PGconn *c, unsigned char out[SP_HASHKEY_LEN], sp_err_t *err)
{
    unsigned char fresh[SP_HASHKEY_LEN];
    char hex[SP_HASHKEY_LEN * 2 + 1];
    randombytes_buf(fresh, sizeof(fresh));
    sodium_bin2hex(hex, sizeof(hex), fresh, sizeof(fresh));
    const char *p[] = {hex};
    /* Insert-if-missing then read: two servers starting together agree on one key. */
    PGresult *r = run(c,
                      "WITH ins AS (INSERT INTO settings(name, value) VALUES ('key_hash_key', $1)"
                      " ON CONFLICT (name) DO NOTHING RETURNING value)"
                      " SELECT value FROM ins UNION ALL"
                      " SELECT value FROM settings WHERE name = 'key_hash_key' LIMIT 1",
                      1, p, err);
    if (r == NULL)
        return -1;
    int ok = PQntuples(r) == 1 &&
             sodium_hex2bin(out, SP_HASHKEY_LEN, PQgetvalue(r, 0, 0), strlen(PQgetvalue(r, 0, 0)),
                            NULL, NULL, NULL) == 0;
    PQclear(r);
    sodium_memzero(fresh, sizeof(fresh));
    if (!ok)
        return sp_err_set(err, SP_EINTERNAL, "bad key hash setting");
    return 0;
}

int sp_keys_create(PGconn *c, const char *team, const char *name, char key[SP_KEY_LEN + 1],
                   char key_id[SP_ID_LEN + 1], sp_err_t *err)
{
    unsigned char hk[SP_HASHKEY_LEN];
    if (sp_keys_hash_key(c, hk, err) < 0)
        return -1;
    char team_id[SP_ID_LEN + 1], hash[SP_KEYHASH_HEX + 1], prefix[SP_KEY_PREFIX + 1];
    sp_ids_sandbox(team_id);
    sp_ids_sandbox(key_id);
    sp_ids_api_key(key);
    sp_ids_key_hash(hk, key, hash);
    sodium_memzero(hk, sizeof(hk));
    memcpy(prefix, key, SP_KEY_PREFIX);
    prefix[SP_KEY_PREFIX] = '\0';
    const char *p[] = {team ? team : "default", team_id, key_id, prefix, hash, name ? name : ""};
    PGresult *r = run(c,
                      "WITH t AS (INSERT INTO teams(id, name) VALUES ($2, $1)"
                      " ON CONFLICT (name) DO UPDATE SET name = excluded.name RETURNING id)"
                      " INSERT INTO api_keys(id, team_id, prefix, hash, name)"
                      " SELECT $3, t.id, $4, $5, $6 FROM t",
                      6, p, err);
    if (r == NULL)
        return -1;
    PQclear(r);
    return 0;
}

int sp_keys_list(PGconn *c, const char *team, FILE *out, sp_err_t *err)
{
    const char *p[] = {team};
    PGresult *r = run(c,
                      "SELECT k.id, t.name, k.prefix, k.name,"
                      " to_char(k.created_at AT TIME ZONE 'UTC', 'YYYY-MM-DD\"T\"HH24:MI:SS\"Z\"'),"
                      " coalesce(to_char(k.revoked_at AT TIME ZONE 'UTC',"
                      " 'YYYY-MM-DD\"T\"HH24:MI:SS\"Z\"'), '-')"
                      " FROM api_keys k JOIN teams t ON t.id = k.team_id"
                      " WHERE $1::text IS NULL OR t.name = $1 OR t.id = $1"
                      " ORDER BY k.created_at, k.id",
                      1, p, err);
    if (r == NULL)
        return -1;
    fprintf(out, "%-20s  %-16s  %-11s  %-20s  %-20s  %s\n", "ID", "TEAM", "PREFIX", "CREATED",
            "REVOKED", "NAME");
    for (int i = 0; i < PQntuples(r); i++)
        fprintf(out, "%-20s  %-16s  %-11s  %-20s  %-20s  %s\n", PQgetvalue(r, i, 0),
                PQgetvalue(r, i, 1), PQgetvalue(r, i, 2), PQgetvalue(r, i, 4),
                PQgetvalue(r, i, 5), PQgetvalue(r, i, 3));
    PQclear(r);
    return 0;
}

int sp_keys_revoke(PGconn *c, const char *id_or_prefix, sp_err_t *err)
{
    const char *p[] = {id_or_prefix};
    PGresult *r = run(c,
                      "WITH k AS (UPDATE api_keys SET revoked_at = now()"
                      " WHERE (id = $1 OR prefix = $1) AND revoked_at IS NULL RETURNING id)"
                      " SELECT count(*), pg_notify('space_keys', 'revoked') FROM k",
                      1, p, err);
    if (r == NULL)
        return -1;
    long n = atol(PQgetvalue(r, 0, 0));
    PQclear(r);
    if (n == 0)
        return sp_err_set(err, SP_ENOTFOUND, "no active key matches");
    return 0;
}

int sp_keys_check_team_name(const char *name, sp_err_t *err)
{
    size_t n = name != NULL ? strlen(name) : 0;
    bool ok = n >= 1 && n <= 64 && name[0] != '.' && name[0] != '-';
    for (size_t i = 0; ok && i < n; i++)
        ok = (name[i] >= 'a' && name[i] <= 'z') || (name[i] >= 'A' && name[i] <= 'Z') ||
             (name[i] >= '0' && name[i] <= '9') || strchr("._-", name[i]) != NULL;
    if (!ok)
        return sp_err_set(err, SP_EINVAL,
                          "team name must be 1 to 64 of A-Z a-z 0-9 . _ - (not starting with . "
                          "or -)");
    return 0;
}

int sp_keys_team_create(PGconn *c, const char *name, char id[SP_ID_LEN + 1], sp_err_t *err)
{
    if (sp_keys_check_team_name(name, err) < 0)
        return -1;
    sp_ids_sandbox(id);
    const char *p[] = {id, name};
    PGresult *r = run(c,
                      "INSERT INTO teams(id, name) VALUES ($1, $2) ON CONFLICT (name) DO NOTHING"
                      " RETURNING id",
                      2, p, err);
    if (r == NULL)
        return -1;
    int made = PQntuples(r);
    PQclear(r);
    if (made != 1)
        return sp_err_set(err, SP_ECONFLICT, "team %s exists", name);
    return 0;
}

int sp_keys_team_list(PGconn *c, FILE *out, sp_err_t *err)
{
    PGresult *r = run(c,
                      "SELECT t.id, t.name,"
                      " to_char(t.created_at AT TIME ZONE 'UTC', 'YYYY-MM-DD\"T\"HH24:MI:SS\"Z\"'),"
                      " (SELECT count(*) FROM api_keys k"
                      "  WHERE k.team_id = t.id AND k.revoked_at IS NULL),"
                      " coalesce(t.max_sandboxes::text, 'default'),"
                      " coalesce(t.max_vcpus::text, 'default'),"
                      " coalesce(t.max_memory_mb::text, 'default'),"
                      " coalesce(t.max_snapshot_mb::text, 'default')"
                      " FROM teams t ORDER BY t.created_at, t.name",
                      0, NULL, err);
    if (r == NULL)
        return -1;
    fprintf(out, "%-20s  %-24s  %-20s  %-5s  %-9s  %-7s  %-10s  %s\n", "ID", "NAME", "CREATED",
            "KEYS", "SANDBOXES", "VCPUS", "MEMORY_MB", "SNAPSHOT_MB");
    for (int i = 0; i < PQntuples(r); i++)
        fprintf(out, "%-20s  %-24s  %-20s  %-5s  %-9s  %-7s  %-10s  %s\n", PQgetvalue(r, i, 0),
                PQgetvalue(r, i, 1), PQgetvalue(r, i, 2), PQgetvalue(r, i, 3), PQgetvalue(r, i, 4),
                PQgetvalue(r, i, 5), PQgetvalue(r, i, 6), PQgetvalue(r, i, 7));
    PQclear(r);
    return 0;
}

int sp_keys_team_set_quota(PGconn *c, const char *team, const char *const limits[4], sp_err_t *err)
{
    static const char *const names[4] = {"sandboxes", "vcpus", "memory-mb", "snapshot-mb"};
    /* per quota: whether to set it, then the value (NULL: the server's default) */
    const char *p[9] = {team};
    for (int i = 0; i < 4; i++) {
        const char *v = limits[i];
        p[1 + 2 * i] = v != NULL ? "true" : "false";
        if (v == NULL || strcmp(v, "default") == 0)
            continue;
        size_t n = strspn(v, "0123456789");
        if (n == 0 || n > 10 || v[n] != '\0' || strtoll(v, NULL, 10) > 1000000000)
            return sp_err_set(err, SP_EINVAL, "--%s must be 0 to 1000000000 or default", names[i]);
        p[2 + 2 * i] = v;
    }
    PGresult *r = run(c,
                      "UPDATE teams SET"
                      " max_sandboxes = CASE WHEN $2::bool THEN $3::int ELSE max_sandboxes END,"
                      " max_vcpus = CASE WHEN $4::bool THEN $5::int ELSE max_vcpus END,"
                      " max_memory_mb = CASE WHEN $6::bool THEN $7::int ELSE max_memory_mb END,"
                      " max_snapshot_mb = CASE WHEN $8::bool THEN $9::bigint"
                      "  ELSE max_snapshot_mb END"
                      " WHERE id = (SELECT id FROM teams WHERE name = $1 OR id = $1"
                      "  ORDER BY name = $1 DESC LIMIT 1) RETURNING id",
                      9, p, err);
    if (r == NULL)
        return -1;
    int found = PQntuples(r);
    PQclear(r);
    if (found != 1)
        return sp_err_set(err, SP_ENOTFOUND, "team %s not found", team);
    return 0;
}

int sp_keys_admin_create(PGconn *c, bool replace, char key[SP_KEY_LEN + 1], sp_err_t *err)
{
    unsigned char hk[SP_HASHKEY_LEN];
    if (sp_keys_hash_key(c, hk, err) < 0)
        return -1;
    char fresh[SP_KEY_LEN + 1], hash[SP_KEYHASH_HEX + 1];
    sp_ids_api_key(fresh);
    sp_ids_key_hash(hk, fresh, hash);
    sodium_memzero(hk, sizeof(hk));
    const char *p[] = {hash};
    /* Insert-if-missing: two servers starting together make one key, and only the one that
     * made it learns (and writes out) the secret. */
    PGresult *r = run(c,
                      replace ? "INSERT INTO settings(name, value) VALUES ('admin_key_hash', $1)"
                                " ON CONFLICT (name) DO UPDATE SET value = excluded.value"
                                " RETURNING value"
                              : "INSERT INTO settings(name, value) VALUES ('admin_key_hash', $1)"
                                " ON CONFLICT (name) DO NOTHING RETURNING value",
                      1, p, err);
    if (r == NULL) {
        sodium_memzero(fresh, sizeof(fresh));
        return -1;
    }
    int made = PQntuples(r) == 1;
    PQclear(r);
    if (made)
        memcpy(key, fresh, sizeof(fresh));
    sodium_memzero(fresh, sizeof(fresh));
    return made;
}

int sp_keys_team_count(PGconn *c, long *out, sp_err_t *err)
{
    PGresult *r = run(c, "SELECT count(*) FROM teams", 0, NULL, err);
    if (r == NULL)
        return -1;
    *out = atol(PQgetvalue(r, 0, 0));
    PQclear(r);
    return 0;
}
