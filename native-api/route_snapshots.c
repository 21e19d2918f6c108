/*
 * route_snapshots.c - sandbox snapshots (core/control/snap.h):
 *
 *   POST   /v1/sandboxes/{id}/snapshots {"name"?}  -> 202 {"snapshot","operation"} while it is
 *          being taken; with ?wait= 201 once ready, 200 once failed (the operation says why)
 *   GET    /v1/snapshots[?sandbox_id=&limit=&cursor=] -> {"snapshots": [...], "next_cursor"}
 *   GET    /v1/snapshots/{id}                     -> the snapshot
 *   DELETE /v1/snapshots/{id}                     -> {"id", "deleted": true}
 *
 * Creating sandboxes from one is POST /v1/sandboxes {"snapshot": id} (route_sandboxes.c).
 */
#include <stdlib.h>
#include <string.h>

#include "native-api/napi_int.h"

static json_t *snap_json(const sp_snap_rec_t *r)
{
    json_t *o = json_pack("{s:s,s:s,s:s,s:i,s:i,s:s,s:s}", "id", r->id, "sandbox_id",
                          r->sandbox_id, "template", r->template_name, "cpu_count", r->cpu_count,
                          "memory_mb", r->memory_mb, "state", r->state, "created_at",
                          r->created_at);
    json_object_set_new(o, "name", r->name[0] ? json_string(r->name) : json_null());
    json_object_set_new(o, "error", r->error[0] ? json_string(r->error) : json_null());
    json_object_set_new(o, "bytes", r->bytes >= 0 ? json_integer(r->bytes) : json_null());
    return o;
}

static json_t *snap_item(const void *rec)
{
    return snap_json(rec);
}

static bool have_snap(napi_ctx_t *c)
{
    if (c->n->snap != NULL)
        return true;
    sp_err_t e;
    sp_err_set(&e, SP_EUNAVAIL, "snapshots are not available on this server");
    sp_napi__fail(c, &e);
    return false;
}

static void on_taken(void *arg, const sp_snap_rec_t *r, const sp_op_rec_t *op,
                     const sp_err_t *err)
{
    napi_ctx_t *c = arg;
    if (err != NULL) {
        sp_napi__fail(c, err);
        return;
    }
    int status = strcmp(r->state, "ready") == 0    ? 201
                 : strcmp(r->state, "failed") == 0 ? 200
                                                   : 202;
    sp_napi__reply(c, status,
                   json_pack("{s:o,s:o}", "snapshot", snap_json(r), "operation",
                             sp_napi__op_json(op)));
}

void sp_napi__snapshots_take(napi_ctx_t *c)
{
    sp_err_t e;
    const char *name = NULL;
    if (!have_snap(c))
        return;
    if (sp_napi__body_snapshot(c->body, &name, &e) < 0 ||
        sp_snap_take(c->n->snap, &c->auth, c->segs[2], name, c->wait_ms, on_taken, c, &e) < 0)
        sp_napi__fail(c, &e);
}

static void on_list(void *arg, const sp_snap_rec_t *recs, size_t n, const char *next,
                    const sp_err_t *err)
{
    napi_ctx_t *c = arg;
    if (err != NULL)
        sp_napi__fail(c, err);
    else
        sp_napi__reply_page(c, "snapshots", sp_napi__items(recs, n, sizeof(*recs), snap_item),
                            next);
}

void sp_napi__snapshots_list(napi_ctx_t *c)
{
    h2o_req_t *req = sp_http_hold_req(c->hold);
    sp_err_t e;
    int limit = 100;
    if (!have_snap(c))
        return;
    if (req == NULL) {
        sp_napi__take(c);
        return;
    }
    if (sp_napi__query_int(req, "limit", 1, 1000, &limit, &e) < 0 ||
        sp_snap_list(c->n->snap, &c->auth, sp_http_query(req, "sandbox_id"), limit,
                     sp_http_query(req, "cursor"), on_list, c, &e) < 0)
        sp_napi__fail(c, &e);
}

static void on_got(void *arg, const sp_snap_rec_t *r, const sp_op_rec_t *op, const sp_err_t *err)
{
    napi_ctx_t *c = arg;
    (void)op;
    if (err != NULL)
        sp_napi__fail(c, err);
    else
        sp_napi__reply(c, 200, snap_json(r));
}

void sp_napi__snapshots_get(napi_ctx_t *c)
{
    sp_err_t e;
    if (have_snap(c) && sp_snap_get(c->n->snap, &c->auth, c->segs[2], NULL, on_got, c, &e) < 0)
        sp_napi__fail(c, &e);
}

static void on_deleted(void *arg, const sp_err_t *err)
{
    napi_ctx_t *c = arg;
    if (err != NULL)
        sp_napi__fail(c, err);
    else
        sp_napi__reply(c, 200, json_pack("{s:s,s:b}", "id", c->segs[2], "deleted", 1));
}

void sp_napi__snapshots_delete(napi_ctx_t *c)
{
    sp_err_t e;
    if (have_snap(c) && sp_snap_delete(c->n->snap, &c->auth, c->segs[2], on_deleted, c, &e) < 0)
        sp_napi__fail(c, &e);
}
