/*
 * route_admin.c - /v1/admin: teams and their API keys, for the operator's scripts.
 *
 * The routes authenticate with the admin key (core/control/admin.h; napi.c picks it by the
 * route's flag), never a team's key, and the team routes never take the admin key. A new
 * key's secret is in the create response only; listings show prefixes. A team's quotas
 * (core/control/svc.h) are set with POST /v1/admin/teams/{team}/quota. The fleet's workers
 * (/v1/workers: list, one with its sandboxes, drain, undrain) take the admin key too; a team's
 * key gets 403 there.
 */
#include <string.h>

#include "core/control/admin.h"
#include "native-api/napi_int.h"

/* A team's quota: its limit, or null for the server's default. */
static json_t *quota_json(long v)
{
    return v < 0 ? json_null() : json_integer(v);
}

static json_t *team_json(const void *rec)
{
    const sp_admin_team_t *t = rec;
    return json_pack("{s:s,s:s,s:s,s:I,s:{s:o,s:o,s:o,s:o}}", "id", t->id, "name", t->name,
                     "created_at", t->created_at, "active_keys", (json_int_t)t->active_keys,
                     "quota", "sandboxes", quota_json(t->quota[0]), "vcpus",
                     quota_json(t->quota[1]), "memory_mb", quota_json(t->quota[2]), "snapshot_mb",
                     quota_json(t->quota[3]));
}

static json_t *key_json(const void *rec)
{
    const sp_admin_key_t *k = rec;
    return json_pack("{s:s,s:s,s:s,s:s,s:s,s:s,s:o}", "id", k->id, "team_id", k->team_id, "team",
                     k->team, "prefix", k->prefix, "name", k->name, "created_at", k->created_at,
                     "revoked_at", k->revoked_at[0] ? json_string(k->revoked_at) : json_null());
}

static void on_teams(void *arg, const sp_admin_team_t *t, size_t n, const sp_err_t *err)
{
    sp_napi__reply_list(arg, err, "teams", t, n, sizeof(*t), team_json);
}

static void on_team_created(void *arg, const sp_admin_team_t *t, size_t n, const sp_err_t *err)
{
    napi_ctx_t *c = arg;
    if (err != NULL)
        sp_napi__fail(c, err);
    else
        sp_napi__reply(c, 201, team_json(&t[0]));
}

static void on_keys(void *arg, const sp_admin_key_t *k, size_t n, const char *secret,
                    const sp_err_t *err)
{
    sp_napi__reply_list(arg, err, "keys", k, n, sizeof(*k), key_json);
}

static void on_key_created(void *arg, const sp_admin_key_t *k, size_t n, const char *secret,
                           const sp_err_t *err)
{
    napi_ctx_t *c = arg;
    if (err != NULL) {
        sp_napi__fail(c, err);
        return;
    }
    json_t *o = key_json(&k[0]);
    json_object_set_new(o, "key", json_string(secret)); /* shown this once */
    sp_napi__reply(c, 201, o);
}

static void on_key_revoked(void *arg, const sp_admin_key_t *k, size_t n, const char *secret,
                           const sp_err_t *err)
{
    napi_ctx_t *c = arg;
    if (err != NULL)
        sp_napi__fail(c, err);
    else
        sp_napi__reply(c, 200, key_json(&k[0]));
}

void sp_napi__admin_teams_list(napi_ctx_t *c)
{
    sp_err_t e;
    if (sp_admin_teams(c->n->admin, on_teams, c, &e) < 0)
        sp_napi__fail(c, &e);
}

void sp_napi__admin_teams_create(napi_ctx_t *c)
{
    sp_err_t e;
    const char *name;
    if (sp_napi__body_team(c->body, &name, &e) < 0 ||
        sp_admin_team_create(c->n->admin, name, on_team_created, c, &e) < 0)
        sp_napi__fail(c, &e);
}

static void on_team_quota(void *arg, const sp_admin_team_t *t, size_t n, const sp_err_t *err)
{
    napi_ctx_t *c = arg;
    if (err != NULL)
        sp_napi__fail(c, err);
    else
        sp_napi__reply(c, 200, team_json(&t[0]));
}

void sp_napi__admin_team_quota(napi_ctx_t *c)
{
    sp_err_t e;
    long limits[SP_ADMIN_NQUOTA];
    if (sp_napi__body_quota(c->body, limits, &e) < 0) {
        sp_napi__fail(c, &e);
        return;
    }
    if (sp_admin_team_set_quota(c->n->admin, c->segs[3], limits, on_team_quota, c, &e) < 0)
        sp_napi__fail(c, &e);
}

void sp_napi__admin_keys_list(napi_ctx_t *c)
{
    sp_err_t e;
    if (sp_admin_keys(c->n->admin, c->segs[3], on_keys, c, &e) < 0)
        sp_napi__fail(c, &e);
}

void sp_napi__admin_keys_create(napi_ctx_t *c)
{
    sp_err_t e;
    const char *name = NULL;
    if (sp_napi__body_key(c->body, &name, &e) < 0 ||
        sp_admin_key_create(c->n->admin, c->segs[3], name, on_key_created, c, &e) < 0)
        sp_napi__fail(c, &e);
}

void sp_napi__admin_keys_revoke(napi_ctx_t *c)
{
    sp_err_t e;
    if (sp_admin_key_revoke(c->n->admin, c->segs[3], c->segs[5], on_key_revoked, c, &e) < 0)
        sp_napi__fail(c, &e);
}

/* ---- the fleet's workers (core/control/fleet.h) ---- */

static void on_workers(void *arg, json_t *workers, const sp_err_t *err)
{
    napi_ctx_t *c = arg;
    if (err != NULL)
        sp_napi__fail(c, err);
    else if (json_array_size(workers) == 1 && c->nsegs >= 3)
        sp_napi__reply(c, 200, json_incref(json_array_get(workers, 0)));
    else
        sp_napi__reply(c, 200, json_pack("{s:O}", "workers", workers));
}

static bool have_fleet(napi_ctx_t *c)
{
    sp_err_t e;
    if (c->n->fleet != NULL)
        return true;
    sp_napi__fail(c, (sp_err_set(&e, SP_EUNAVAIL, "the fleet is not available"), &e));
    return false;
}

void sp_napi__workers_list(napi_ctx_t *c)
{
    sp_err_t e;
    if (have_fleet(c) && sp_fleet_workers(c->n->fleet, NULL, on_workers, c, &e) < 0)
        sp_napi__fail(c, &e);
}

void sp_napi__workers_get(napi_ctx_t *c)
{
    sp_err_t e;
    if (have_fleet(c) && sp_fleet_workers(c->n->fleet, c->segs[2], on_workers, c, &e) < 0)
        sp_napi__fail(c, &e);
}

static void drain(napi_ctx_t *c, bool on)
{
    sp_err_t e;
    if (have_fleet(c) && sp_fleet_drain(c->n->fleet, c->segs[2], on, on_workers, c, &e) < 0)
        sp_napi__fail(c, &e);
}

void sp_napi__workers_drain(napi_ctx_t *c)
{
    drain(c, true);
}

void sp_napi__workers_undrain(napi_ctx_t *c)
{
    drain(c, false);
}
