/*
 * admin.c - teams and API keys for the /v1/admin routes, one statement per call.
 */
#include "core/control/admin.h"

#include <sodium.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "base/log.h"
#include "core/control/keys.h"

struct sp_admin {
    sp_store_t *store;
    unsigned char hashkey[SP_HASHKEY_LEN];
};

/* What a call's rows are and what an empty answer means. */
enum kind { K_AUTH, K_TEAMS, K_TEAM_CREATE, K_TEAM_QUOTA, K_KEYS, K_KEY_CREATE, K_KEY_REVOKE };

struct call {
    enum kind kind;
    void *cb;
    void *arg;
    char secret[SP_KEY_LEN + 1]; /* K_KEY_CREATE: the new key, wiped after the callback */
};

#define TS(col) "to_char(" col " AT TIME ZONE 'UTC', 'YYYY-MM-DD\"T\"HH24:MI:SS\"Z\"')"
/* A key row's columns, in parse_key's order, for a key k of team t. */
#define KEY_COLS                                                                                   \
    "k.id, t.id, t.name, k.prefix, k.name, " TS("k.created_at") ", coalesce(" TS(                  \
        "k.revoked_at") ", '')"

static void parse_team(PGresult *r, int i, sp_admin_team_t *t)
{
    SP_STORE_TEXT(r, i, 0, t->id);
    SP_STORE_TEXT(r, i, 1, t->name);
    SP_STORE_TEXT(r, i, 2, t->created_at);
    t->active_keys = atol(PQgetvalue(r, i, 3));
    for (int q = 0; q < SP_ADMIN_NQUOTA; q++)
        t->quota[q] = atol(PQgetvalue(r, i, 4 + q));
}

static void parse_key(PGresult *r, int i, sp_admin_key_t *k)
{
    SP_STORE_TEXT(r, i, 0, k->id);
    SP_STORE_TEXT(r, i, 1, k->team_id);
    SP_STORE_TEXT(r, i, 2, k->team);
    SP_STORE_TEXT(r, i, 3, k->prefix);
    SP_STORE_TEXT(r, i, 4, k->name);
    SP_STORE_TEXT(r, i, 5, k->created_at);
    SP_STORE_TEXT(r, i, 6, k->revoked_at);
}

static void teams_done(struct call *c, PGresult *res)
{
    sp_admin_teams_cb cb = (sp_admin_teams_cb)c->cb;
    sp_err_t e;
    const sp_err_t *fail;
    sp_admin_team_t *t = sp_store_rows(
        res, NULL, SP_ECONFLICT, c->kind == K_TEAM_CREATE ? "a team with this name exists" : NULL,
        sizeof(*t), &fail, &e);
    if (t == NULL) {
        cb(c->arg, NULL, 0, fail);
        return;
    }
    int n = PQntuples(res);
    if (c->kind == K_TEAM_QUOTA && n != 1) {
        free(t);
        cb(c->arg, NULL, 0, (sp_err_set(&e, SP_ENOTFOUND, "team not found"), &e));
        return;
    }
    for (int i = 0; i < n; i++)
        parse_team(res, i, &t[i]);
    cb(c->arg, t, (size_t)n, NULL);
    free(t);
}

static void keys_done(struct call *c, PGresult *res)
{
    sp_admin_keys_cb cb = (sp_admin_keys_cb)c->cb;
    sp_err_t e;
    const sp_err_t *fail;
    /* K_KEYS answers one row per team at least (a LEFT JOIN); none: no such team. */
    sp_admin_key_t *k =
        sp_store_rows(res, NULL, SP_ENOTFOUND,
                      c->kind == K_KEY_REVOKE ? "no active key with this ID or prefix in this team"
                                              : "team not found",
                      sizeof(*k), &fail, &e);
    int n = PQntuples(res);
    if (k == NULL) {
        cb(c->arg, NULL, 0, NULL, fail);
        return;
    }
    size_t m = 0;
    for (int i = 0; i < n; i++)
        if (!PQgetisnull(res, i, 0)) /* a team without keys: its one row has no key */
            parse_key(res, i, &k[m++]);
    cb(c->arg, k, m, c->kind == K_KEY_CREATE ? c->secret : NULL, NULL);
    free(k);
}

static void on_result(void *arg, PGresult *res, const sp_err_t *err)
{
    struct call *c = arg;
    if (c->kind == K_AUTH) {
        sp_admin_done_cb cb = (sp_admin_done_cb)c->cb;
        sp_err_t e;
        if (err == NULL && PQntuples(res) != 1)
            err = (sp_err_set(&e, SP_EAUTH, "invalid admin key"), &e);
        cb(c->arg, err);
    } else if (err != NULL) {
        sp_err_t e = *err;
        /* A statement's SQL error is the server's problem, not the client's input. */
        if (e.code == SP_EINTERNAL)
            sp_err_set(&e, SP_EUNAVAIL, "database error");
        if (c->kind == K_TEAMS || c->kind == K_TEAM_CREATE || c->kind == K_TEAM_QUOTA)
            ((sp_admin_teams_cb)c->cb)(c->arg, NULL, 0, &e);
        else
            ((sp_admin_keys_cb)c->cb)(c->arg, NULL, 0, NULL, &e);
    } else if (c->kind == K_TEAMS || c->kind == K_TEAM_CREATE || c->kind == K_TEAM_QUOTA) {
        teams_done(c, res);
    } else {
        keys_done(c, res);
    }
    sodium_memzero(c->secret, sizeof(c->secret));
    free(c);
}

static int submit(sp_admin_t *a, enum kind kind, const char *sql, int n, const char *const *p,
                  void *cb, void *arg, const char *secret, sp_err_t *err)
{
    struct call *c = calloc(1, sizeof(*c));
    if (c == NULL)
        return sp_err_set(err, SP_EINTERNAL, "out of memory");
    c->kind = kind;
    c->cb = cb;
    c->arg = arg;
    if (secret != NULL)
        memcpy(c->secret, secret, sizeof(c->secret));
    if (sp_store_query(a->store, sql, n, p, on_result, c, err) < 0) {
        sodium_memzero(c->secret, sizeof(c->secret));
        free(c);
        return -1;
    }
    return 0;
}

sp_admin_t *sp_admin_create(sp_store_t *store, const unsigned char hashkey[SP_HASHKEY_LEN])
{
    sp_admin_t *a = calloc(1, sizeof(*a));
    if (a == NULL)
        return NULL;
    a->store = store;
    memcpy(a->hashkey, hashkey, SP_HASHKEY_LEN);
    return a;
}

void sp_admin_destroy(sp_admin_t *a)
{
    if (a == NULL)
        return;
    sodium_memzero(a->hashkey, sizeof(a->hashkey));
    free(a);
}

int sp_admin_authenticate(sp_admin_t *a, const char *key, sp_admin_done_cb cb, void *arg,
                          sp_err_t *err)
{
    if (key == NULL || key[0] == '\0')
        return sp_err_set(err, SP_EAUTH, "missing admin key");
    if (strlen(key) > 256)
        return sp_err_set(err, SP_EAUTH, "invalid admin key");
    char hash[SP_KEYHASH_HEX + 1];
    sp_ids_key_hash(a->hashkey, key, hash);
    const char *p[] = {hash};
    return submit(a, K_AUTH, "SELECT 1 FROM settings WHERE name = 'admin_key_hash' AND value = $1",
                  1, p, (void *)cb, arg, NULL, err);
}

#define TEAM_COLS                                                                                  \
    "t.id, t.name, " TS("t.created_at") ", (SELECT count(*) FROM api_keys k"                       \
                                        " WHERE k.team_id = t.id AND k.revoked_at IS NULL),"       \
                                        " coalesce(t.max_sandboxes, -1),"                          \
                                        " coalesce(t.max_vcpus, -1),"                              \
                                        " coalesce(t.max_memory_mb, -1),"                          \
                                        " coalesce(t.max_snapshot_mb, -1)"

int sp_admin_teams(sp_admin_t *a, sp_admin_teams_cb cb, void *arg, sp_err_t *err)
{
    return submit(a, K_TEAMS, "SELECT " TEAM_COLS " FROM teams t ORDER BY t.created_at, t.name", 0,
                  NULL, (void *)cb, arg, NULL, err);
}

int sp_admin_team_create(sp_admin_t *a, const char *name, sp_admin_teams_cb cb, void *arg,
                         sp_err_t *err)
{
    if (sp_keys_check_team_name(name, err) < 0)
        return -1;
    char id[SP_ID_LEN + 1];
    sp_ids_sandbox(id);
    const char *p[] = {id, name};
    return submit(a, K_TEAM_CREATE,
                  "WITH t AS (INSERT INTO teams(id, name) VALUES ($1, $2)"
                  " ON CONFLICT (name) DO NOTHING RETURNING id, name, created_at)"
                  " SELECT t.id, t.name, " TS("t.created_at") ", 0, -1, -1, -1, -1 FROM t",
                  2, p, (void *)cb, arg, NULL, err);
}

/* A team argument: bounded, so a path segment of any length costs one bounded parameter. */
static int check_team_ref(const char *team, sp_err_t *err)
{
    if (team == NULL || team[0] == '\0' || strlen(team) > 64)
        return sp_err_set(err, SP_ENOTFOUND, "team not found");
    return 0;
}

int sp_admin_team_set_quota(sp_admin_t *a, const char *team, const long limits[SP_ADMIN_NQUOTA],
                            sp_admin_teams_cb cb, void *arg, sp_err_t *err)
{
    if (check_team_ref(team, err) < 0)
        return -1;
    /* per quota: whether to set it, then the value (NULL: the server's default) */
    char v[SP_ADMIN_NQUOTA][24];
    const char *p[1 + 2 * SP_ADMIN_NQUOTA] = {team};
    for (int i = 0; i < SP_ADMIN_NQUOTA; i++) {
        long l = limits[i];
        if (l != SP_ADMIN_QUOTA_KEEP && l != SP_ADMIN_QUOTA_DEFAULT &&
            (l < 0 || l > SP_ADMIN_QUOTA_MAX))
            return sp_err_set(err, SP_EINVAL, "a quota is 0 to %ld, or null for the default",
                              SP_ADMIN_QUOTA_MAX);
        p[1 + 2 * i] = l == SP_ADMIN_QUOTA_KEEP ? "false" : "true";
        snprintf(v[i], sizeof(v[i]), "%ld", l);
        p[2 + 2 * i] = l >= 0 ? v[i] : NULL;
    }
    return submit(a, K_TEAM_QUOTA,
                  "UPDATE teams t SET"
                  " max_sandboxes = CASE WHEN $2::bool THEN $3::int ELSE max_sandboxes END,"
                  " max_vcpus = CASE WHEN $4::bool THEN $5::int ELSE max_vcpus END,"
                  " max_memory_mb = CASE WHEN $6::bool THEN $7::int ELSE max_memory_mb END,"
                  " max_snapshot_mb = CASE WHEN $8::bool THEN $9::bigint ELSE max_snapshot_mb END"
                  " WHERE t.id = (SELECT id FROM teams WHERE name = $1 OR id = $1"
                  "  ORDER BY name = $1 DESC LIMIT 1) RETURNING " TEAM_COLS,
                  9, p, (void *)cb, arg, NULL, err);
}

int sp_admin_keys(sp_admin_t *a, const char *team, sp_admin_keys_cb cb, void *arg, sp_err_t *err)
{
    if (check_team_ref(team, err) < 0)
        return -1;
    const char *p[] = {team};
    return submit(a, K_KEYS,
                  "SELECT " KEY_COLS " FROM teams t LEFT JOIN api_keys k ON k.team_id = t.id"
                  " WHERE t.id = (SELECT id FROM teams WHERE name = $1 OR id = $1"
                  "  ORDER BY name = $1 DESC LIMIT 1)"
                  " ORDER BY k.created_at, k.id",
                  1, p, (void *)cb, arg, NULL, err);
}

int sp_admin_key_create(sp_admin_t *a, const char *team, const char *name, sp_admin_keys_cb cb,
                        void *arg, sp_err_t *err)
{
    if (check_team_ref(team, err) < 0)
        return -1;
    if (name != NULL && strlen(name) > SP_ADMIN_MAX_KEY_NAME)
        return sp_err_set(err, SP_EINVAL, "name is longer than %d bytes", SP_ADMIN_MAX_KEY_NAME);
    char key[SP_KEY_LEN + 1], id[SP_ID_LEN + 1], hash[SP_KEYHASH_HEX + 1];
    char prefix[SP_KEY_PREFIX + 1];
    sp_ids_sandbox(id);
    sp_ids_api_key(key);
    sp_ids_key_hash(a->hashkey, key, hash);
    memcpy(prefix, key, SP_KEY_PREFIX);
    prefix[SP_KEY_PREFIX] = '\0';
    const char *p[] = {team, id, prefix, hash, name ? name : ""};
    int rc = submit(a, K_KEY_CREATE,
                    "WITH t AS (SELECT id, name FROM teams WHERE name = $1 OR id = $1"
                    "  ORDER BY name = $1 DESC LIMIT 1),"
                    " k AS (INSERT INTO api_keys(id, team_id, prefix, hash, name)"
                    "  SELECT $2, t.id, $3, $4, $5 FROM t RETURNING *)"
                    " SELECT " KEY_COLS " FROM k JOIN t ON t.id = k.team_id",
                    5, p, (void *)cb, arg, key, err);
    sodium_memzero(key, sizeof(key));
    return rc;
}

int sp_admin_key_revoke(sp_admin_t *a, const char *team, const char *key, sp_admin_keys_cb cb,
                        void *arg, sp_err_t *err)
{
    if (check_team_ref(team, err) < 0)
        return -1;
    if (key == NULL || key[0] == '\0' || strlen(key) > 64)
        return sp_err_set(err, SP_ENOTFOUND, "no active key with this ID or prefix in this team");
    const char *p[] = {team, key};
    /* pg_notify: every server's authentication cache forgets the key now (svc.c). */
    return submit(a, K_KEY_REVOKE,
                  "WITH t AS (SELECT id, name FROM teams WHERE name = $1 OR id = $1"
                  "  ORDER BY name = $1 DESC LIMIT 1),"
                  " k AS (UPDATE api_keys SET revoked_at = now() FROM t"
                  "  WHERE api_keys.team_id = t.id AND (api_keys.id = $2 OR api_keys.prefix = $2)"
                  "  AND api_keys.revoked_at IS NULL RETURNING api_keys.*)"
                  " SELECT " KEY_COLS ", pg_notify('space_keys', 'revoked')"
                  " FROM k JOIN t ON t.id = k.team_id",
                  2, p, (void *)cb, arg, NULL, err);
}
