/*
 * route_snapshots.c - E2B's snapshots over core/control/snap.h (spec: e2b-templates.md
 * section 4): `sbx.create_snapshot()`, `Sandbox.list_snapshots`, `Sandbox.delete_snapshot`
 * (DELETE /templates/{snapshotID}, routed here from route_templates.c) and creating a sandbox
 * from a snapshot id (`templateID`, resolved here for route_sandboxes.c).
 *
 *   POST /sandboxes/{id}/snapshots {} | {"name": "[ns/]alias[:tag]"}
 *        -> 201 {"snapshotID", "names"} once taken (synchronous; the sandbox keeps running)
 *   GET  /snapshots[?sandboxID=&limit=&nextToken=] -> 200 [SnapshotInfo], x-next-token
 *
 * A snapshot's E2B id: without a name "<snapshot id>:default", names []; with one
 * "<ns>/<alias>:<tag>", names ["<ns>/<alias>"], where <ns> is the team's namespace. This
 * server has no team slugs: a team's namespace is its team id (20 characters of [a-z0-9],
 * stable, and valid in E2B's name grammar). A name in another namespace is refused (400 on
 * create, "not found" on use).
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

#include "e2b-gateway/body.h"
#include "e2b-gateway/route_int.h"

#define SNAP_LIST_MAX 100 /* E2B's default and cap */

static sp_snap_t *snap_of(ctl_t *c)
{
    if (c->gw->snap == NULL)
        sp_e2b__ctl_fail(c, 503, "snapshots are not available on this server");
    return c->gw->snap;
}

/* The E2B SnapshotInfo of a snapshot seen by team. */
static json_t *info_json(const char *team, const sp_snap_rec_t *r)
{
    char id[160];
    if (r->name[0] == '\0') {
        snprintf(id, sizeof id, "%s:default", r->id);
        return json_pack("{s:s,s:[]}", "snapshotID", id, "names");
    }
    const char *colon = strchr(r->name, ':');
    int alen = colon ? (int)(colon - r->name) : (int)strlen(r->name);
    char name[128];
    snprintf(name, sizeof name, "%s/%.*s", team, alen, r->name);
    snprintf(id, sizeof id, "%s:%s", name, colon ? colon + 1 : "default");
    return json_pack("{s:s,s:[s]}", "snapshotID", id, "names", name);
}

int sp_e2b__snapshot_ref(const char *team, const char *ref, char *id, char *name, size_t cap)
{
    id[0] = name[0] = '\0';
    size_t n = strlen(ref);
    /* "<snapshot id>" or "<snapshot id>:default" */
    if (n >= SP_SNAP_ID_LEN && n < cap) {
        char tmp[SP_SNAP_ID_LEN + 1];
        snprintf(tmp, sizeof tmp, "%.*s", SP_SNAP_ID_LEN, ref);
        if (sp_snap_valid_id(tmp) &&
            (ref[SP_SNAP_ID_LEN] == '\0' || strcmp(ref + SP_SNAP_ID_LEN, ":default") == 0)) {
            snprintf(id, cap, "%s", tmp);
            return 1;
        }
    }
    /* "<ns>/<alias>[:tag]" in the team's namespace */
    const char *slash = strchr(ref, '/');
    if (slash == NULL)
        return 0;
    sp_err_t e;
    if ((size_t)(slash - ref) != strlen(team) || strncasecmp(ref, team, strlen(team)) != 0 ||
        sp_snap_norm_name(slash + 1, name, cap, &e) < 0)
        return -1;
    return 1;
}

/* ---- POST /sandboxes/{id}/snapshots ---- */

static void on_taken(void *arg, const sp_snap_rec_t *r, const sp_op_rec_t *op,
                     const sp_err_t *err)
{
    ctl_t *c = arg;
    char msg[320];
    (void)op;
    if (err != NULL && err->code == SP_ENOTFOUND) {
        snprintf(msg, sizeof msg, "Sandbox '%s' not found", c->id);
        sp_e2b__ctl_fail(c, 404, msg);
    } else if (err != NULL) {
        sp_e2b__ctl_fail_err(c, err);
    } else if (strcmp(r->state, "ready") == 0) {
        sp_e2b__ctl_reply(c, 201, info_json(c->auth.team_id, r));
    } else if (strcmp(r->state, "failed") == 0) {
        snprintf(msg, sizeof msg, "taking the snapshot failed: %s", r->error);
        sp_e2b__ctl_fail(c, 500, msg);
    } else {
        snprintf(msg, sizeof msg, "the snapshot %s:default did not finish in time", r->id);
        sp_e2b__ctl_fail(c, 500, msg);
    }
}

void sp_e2b__snapshot_create(ctl_t *c)
{
    char name[SP_SNAP_NAME_MAX + 1], why[SP_E2B_WHY_MAX];
    sp_err_t e;
    if (sp_e2b__body_snapshot(c->body, c->auth.team_id, name, why) < 0) {
        sp_e2b__ctl_fail(c, 400, why);
        return;
    }
    sp_snap_t *s = snap_of(c);
    if (s != NULL && sp_snap_take(s, &c->auth, c->id, name[0] ? name : NULL, SP_SVC_MAX_WAIT_MS,
                                  on_taken, c, &e) < 0) {
        if (e.code == SP_ENOTFOUND)
            snprintf(e.msg, sizeof e.msg, "Sandbox '%s' not found", c->id);
        sp_e2b__ctl_fail_err(c, &e);
    }
}

/* ---- GET /snapshots ---- */

static void on_listed(void *arg, const sp_snap_rec_t *recs, size_t n, const char *next,
                      const sp_err_t *err)
{
    ctl_t *c = arg;
    if (err != NULL) {
        sp_e2b__ctl_fail_err(c, err);
        return;
    }
    json_t *arr = json_array();
    for (size_t i = 0; i < n; i++)
        json_array_append_new(arr, info_json(c->auth.team_id, &recs[i]));
    if (next != NULL)
        snprintf(c->next_token, sizeof c->next_token, "%s", next);
    sp_e2b__ctl_reply(c, 200, arr);
}

void sp_e2b__snapshot_list(ctl_t *c, h2o_req_t *req)
{
    const char *limit = sp_http_query(req, "limit");
    int lim = SNAP_LIST_MAX;
    if (limit != NULL) {
        char *end;
        long l = strtol(limit, &end, 10);
        if (*limit == '\0' || *end != '\0' || l < 1) {
            sp_e2b__ctl_fail(c, 400, "limit must be a positive integer");
            return;
        }
        lim = l > SNAP_LIST_MAX ? SNAP_LIST_MAX : (int)l;
    }
    const char *sid = sp_http_query(req, "sandboxID");
    const char *token = sp_http_query(req, "nextToken");
    sp_err_t e;
    sp_snap_t *s = snap_of(c);
    if (s != NULL && sp_snap_list(s, &c->auth, sid && sid[0] ? sid : NULL, lim,
                                  token && token[0] ? token : NULL, on_listed, c, &e) < 0) {
        if (e.code == SP_EINVAL && token != NULL && strstr(e.msg, "cursor") != NULL)
            snprintf(e.msg, sizeof e.msg, "invalid nextToken");
        sp_e2b__ctl_fail_err(c, &e);
    }
}

/* ---- DELETE /templates/{snapshotID} ---- */

static void on_named(void *arg, const sp_snap_rec_t *r, const sp_op_rec_t *op,
                     const sp_err_t *err)
{
    ctl_t *c = arg;
    sp_err_t e;
    (void)op;
    if (err != NULL)
        sp_e2b__ctl_fail_err(c, err);
    else if (sp_snap_delete(c->gw->snap, &c->auth, r->id, sp_e2b__ctl_done, c, &e) < 0)
        sp_e2b__ctl_fail_err(c, &e);
}

void sp_e2b__snapshot_delete(ctl_t *c, const char *id, const char *name)
{
    sp_err_t e;
    sp_snap_t *s = snap_of(c);
    if (s == NULL)
        return;
    if (id[0] != '\0' ? sp_snap_delete(s, &c->auth, id, sp_e2b__ctl_done, c, &e) < 0
                      : sp_snap_get(s, &c->auth, NULL, name, on_named, c, &e) < 0)
        sp_e2b__ctl_fail_err(c, &e);
}
