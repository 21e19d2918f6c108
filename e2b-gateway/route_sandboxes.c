/*
 * route_sandboxes.c - the E2B control plane: /sandboxes, /v2/sandboxes and the lifecycle
 * verbs under /sandboxes/{id}, translated to core operations (spec e2b-wire.md section 2).
 *
 * E2B answers synchronously where core is asynchronous: create, kill, pause, connect and
 * resume request their operation and wait for it before answering. States are shown as E2B
 * knows them: "paused" is our suspend (suspending, suspended, or asked to be); every other
 * live state is "running", our memory-resident pause included. Sandboxes that are failed or
 * on their way out are not shown (404, left out of lists). Every error is {"code","message"}
 * with code = the HTTP status. Holds no state between requests.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <time.h>

#include "base/log.h"
#include "e2b-gateway/body.h"
#include "e2b-gateway/gw_int.h"
#include "e2b-gateway/route_int.h"
#include "http/json.h"

#define CTL_V1_PAGES      10 /* GET /sandboxes has no pagination: at most this many core pages */
#define CTL_CLIENT_ID     "space"

/* ---- context, replies, errors ---- */

static void ctl_free(ctl_t *c)
{
    json_decref(c->body);
    json_decref(c->acc);
    json_decref(c->filter);
    json_decref(c->ids);
    c->body = c->acc = c->filter = c->ids = NULL;
    if (c->text != NULL) {
        sp_buf_free(c->text);
        free(c->text);
        c->text = NULL;
    }
}

/* Frees c (its parts, then its hold): the request to answer, with x-next-token set when
 * c->next_token is, or NULL when the client left. */
static h2o_req_t *ctl_finish(ctl_t *c)
{
    ctl_free(c);
    char token[sizeof(c->next_token)];
    snprintf(token, sizeof(token), "%s", c->next_token);
    h2o_req_t *req = sp_http_release(c->hold); /* frees c: it lives in the hold */
    if (req != NULL && token[0] != '\0') {
        size_t n = strlen(token);
        char *v = h2o_mem_alloc_pool(&req->pool, n);
        memcpy(v, token, n);
        h2o_add_header_by_str(&req->pool, &req->res.headers, H2O_STRLIT("x-next-token"), 0, NULL, v,
                              n);
    }
    return req;
}

/* Like sp_e2b__ctl_reply, with the JSON text already written (body stays the caller's). body
 * NULL: a value that cannot be written (see write_listed), answered as sp_http_json answers
 * one, with its 500. */
static void ctl_reply_text(ctl_t *c, int status, sp_buf_t *body)
{
    h2o_req_t *req = ctl_finish(c);
    if (req == NULL)
        return;
    if (body != NULL)
        sp_http_json_text(req, status, body);
    else
        sp_http_json(req, status, NULL);
}

void sp_e2b__ctl_reply(ctl_t *c, int status, json_t *obj)
{
    h2o_req_t *req = ctl_finish(c);
    if (req == NULL) {
        json_decref(obj);
        return;
    }
    if (obj == NULL) { /* 204 */
        req->res.status = status;
        req->res.reason = "No Content";
        h2o_send_inline(req, "", 0);
        return;
    }
    sp_http_json(req, status, obj);
}

void sp_e2b__ctl_fail(ctl_t *c, int status, const char *msg)
{
    ctl_free(c);
    h2o_req_t *req = sp_http_release(c->hold);
    if (req != NULL)
        sp_e2b__error(req, status, msg);
}

void sp_e2b__ctl_fail_err(ctl_t *c, const sp_err_t *err)
{
    sp_e2b__ctl_fail(c, sp_err_http_status(err->code), err->msg);
}

void sp_e2b__ctl_done(void *arg, const sp_err_t *err)
{
    ctl_t *c = arg;
    if (err != NULL)
        sp_e2b__ctl_fail_err(c, err);
    else
        sp_e2b__ctl_reply(c, 204, NULL);
}

/* ---- rendering ---- */

const char *sp_e2b__state(const sp_sandbox_rec_t *sb)
{
    sp_desired_t d;
    sp_observed_t o;
    if (sp_desired_parse(sb->desired, &d) < 0 || sp_observed_parse(sb->observed, &o) < 0)
        return NULL;
    /* lost with its worker (core/control/fleet.h): gone, as E2B clients know a killed one */
    if (d == SP_DESIRED_DELETED || o == SP_OBS_STOPPING || o == SP_OBS_DELETED ||
        o == SP_OBS_FAILED || o == SP_OBS_LOST)
        return NULL;
    if (o == SP_OBS_SUSPENDING || o == SP_OBS_SUSPENDED || d == SP_DESIRED_SUSPENDED)
        return "paused";
    return "running";
}

static const char *envd_version(const sp_sandbox_rec_t *sb)
{
    return sb->envd_version[0] ? sb->envd_version : SP_E2B_ENVD_VERSION;
}

/* The Sandbox model of create and connect. */
static json_t *sandbox_json(sp_e2b_t *gw, const sp_sandbox_rec_t *sb)
{
    json_t *o = json_object();
    json_object_set_new(o, "sandboxID", json_string(sb->id));
    json_object_set_new(o, "templateID", json_string(sb->template_name));
    json_object_set_new(o, "alias", json_string(sb->template_name));
    json_object_set_new(o, "clientID", json_string(CTL_CLIENT_ID));
    json_object_set_new(o, "envdVersion", json_string(envd_version(sb)));
    /* Always a token, even for secure=false: it is how sandbox traffic finds the sandbox.
     * Both are derived again on each read (core/control/tokens.h), so connect gives the ones
     * create gave. The traffic token is what the code interpreter's SDKs send on every call
     * (the JS one on its context calls only that), and what opens a private sandbox's ports. */
    json_object_set_new(o, "envdAccessToken",
                        sb->access_token[0] ? json_string(sb->access_token) : json_null());
    json_object_set_new(o, "trafficAccessToken",
                        sb->traffic_token[0] ? json_string(sb->traffic_token) : json_null());
    json_object_set_new(o, "domain", json_string(gw->domain));
    return o;
}

/* The VM's disk size: as its worker recorded it on the row (core/control/recon.c), which is
 * the same from every node; for a row without it (from before the column), this node's driver
 * (0 when the VM is not here). */
static long long disk_mb(sp_e2b_t *gw, const sp_sandbox_rec_t *sb)
{
    if (sb->disk_mb >= 0)
        return sb->disk_mb;
    return (long long)(sp_svc_vm_disk_bytes(gw->svc, sb->id) >> 20);
}

json_t *sp_e2b__listed_json(const char *domain, const sp_sandbox_rec_t *sb, const char *state,
                            long long disk_mb, bool detail)
{
    json_t *o = json_object();
    json_object_set_new(o, "sandboxID", json_string(sb->id));
    json_object_set_new(o, "templateID", json_string(sb->template_name));
    json_object_set_new(o, "alias", json_string(sb->template_name));
    json_object_set_new(o, "clientID", json_string(CTL_CLIENT_ID));
    json_object_set_new(o, "startedAt", json_string(sb->created_at));
    json_object_set_new(o, "endAt", json_string(sb->end_at));
    json_object_set_new(o, "cpuCount", json_integer(sb->cpu_count));
    json_object_set_new(o, "memoryMB", json_integer(sb->memory_mb));
    json_object_set_new(o, "diskSizeMB", json_integer(disk_mb));
    json_object_set_new(o, "envdVersion", json_string(envd_version(sb)));
    json_object_set_new(o, "state", json_string(state));
    json_object_set_new(o, "metadata", json_incref(sb->metadata));
    json_object_set_new(o, "volumeMounts", json_array());
    if (!detail)
        return o;
    json_object_set_new(o, "domain", json_string(domain));
    json_object_set_new(o, "envdAccessToken", json_string(sb->access_token));
    json_object_set_new(o, "allowInternetAccess",
                        sb->allow_internet < 0 ? json_null() : json_boolean(sb->allow_internet));
    if (sb->network != NULL)
        json_object_set_new(o, "network", json_incref(sb->network));
    bool pause = strcmp(sb->deadline_action, "suspend") == 0;
    json_object_set_new(o, "lifecycle",
                        json_pack("{s:b,s:s}", "autoResume", sb->auto_resume, "onTimeout",
                                  pause ? "pause" : "kill"));
    return o;
}

int sp_e2b__listed_write(sp_buf_t *b, const char *domain, const sp_sandbox_rec_t *sb,
                         const char *state, long long disk_mb, bool detail)
{
    /* The order and forms of sp_e2b__listed_json; a test compares the bytes. */
    if (sb->metadata == NULL)
        return -1;
    if (sp_json_put_str(b, "{\"sandboxID\":", sb->id, false) < 0 ||
        sp_json_put_str(b, ",\"templateID\":", sb->template_name, false) < 0 ||
        sp_json_put_str(b, ",\"alias\":", sb->template_name, false) < 0 ||
        sp_json_put_str(b, ",\"clientID\":", CTL_CLIENT_ID, false) < 0 ||
        sp_json_put_str(b, ",\"startedAt\":", sb->created_at, false) < 0 ||
        sp_json_put_str(b, ",\"endAt\":", sb->end_at, false) < 0)
        return -1;
    sp_json_put_int(b, ",\"cpuCount\":", sb->cpu_count);
    sp_json_put_int(b, ",\"memoryMB\":", sb->memory_mb);
    sp_json_put_int(b, ",\"diskSizeMB\":", disk_mb);
    if (sp_json_put_str(b, ",\"envdVersion\":", envd_version(sb), false) < 0 ||
        sp_json_put_str(b, ",\"state\":", state, false) < 0)
        return -1;
    sp_buf_str(b, ",\"metadata\":");
    if (sp_json_write(b, sb->metadata) < 0)
        return -1;
    sp_buf_str(b, ",\"volumeMounts\":[]");
    if (detail) {
        if (sp_json_put_str(b, ",\"domain\":", domain, false) < 0 ||
            sp_json_put_str(b, ",\"envdAccessToken\":", sb->access_token, false) < 0)
            return -1;
        sp_json_put_bool(
            b, ",\"allowInternetAccess\":", sb->allow_internet < 0 ? -1 : sb->allow_internet != 0);
        if (sb->network != NULL) {
            sp_buf_str(b, ",\"network\":");
            if (sp_json_write(b, sb->network) < 0)
                return -1;
        }
        sp_json_put_bool(b, ",\"lifecycle\":{\"autoResume\":", sb->auto_resume);
        sp_buf_str(b, strcmp(sb->deadline_action, "suspend") == 0 ? ",\"onTimeout\":\"pause\"}"
                                                                  : ",\"onTimeout\":\"kill\"}");
    }
    sp_buf_add(b, "}", 1);
    return b->oom ? -1 : 0;
}

/* Appends sb as listed (or in detail) to b (known_disk_mb: its disk size as its worker gave it,
 * for a row without one; -1: disk_mb's): written straight, or, for a record the writer
 * refuses (a field that is not UTF-8, which jansson drops from the object), through its jansson
 * twin, so the bytes are always those of the jansson rendering. -1 only when that fails too. */
static int write_listed(sp_buf_t *b, sp_e2b_t *gw, const sp_sandbox_rec_t *sb, const char *state,
                        bool detail, long long known_disk_mb)
{
    long long disk = sb->disk_mb < 0 && known_disk_mb >= 0 ? known_disk_mb : disk_mb(gw, sb);
    size_t mark = b->len;
    if (sp_e2b__listed_write(b, gw->domain, sb, state, disk, detail) == 0)
        return 0;
    if (b->oom)
        return -1;
    b->len = mark; /* drop the half-written record */
    json_t *o = sp_e2b__listed_json(gw->domain, sb, state, disk, detail);
    int rc = sp_json_write(b, o);
    json_decref(o);
    return rc;
}

/* ---- shared steps: wait for an operation, then fetch the sandbox ---- */

static void on_op_waited(void *arg, const sp_op_rec_t *op, const sp_err_t *err)
{
    ctl_t *c = arg;
    if (err != NULL) {
        sp_e2b__ctl_fail_err(c, err);
        return;
    }
    c->after_op(c, op);
}

void sp_e2b__ctl_wait(ctl_t *c, const sp_op_rec_t *op, ctl_op_fn next)
{
    sp_err_t e;
    c->after_op = next;
    if (sp_svc_get_operation(c->gw->svc, &c->auth, op->id, SP_SVC_MAX_WAIT_MS, on_op_waited, c,
                             &e) < 0)
        sp_e2b__ctl_fail_err(c, &e);
}

/* An operation that did not succeed, as E2B's 500 (or 409 when a later request won). */
static void op_failed(ctl_t *c, const sp_op_rec_t *op, const char *what)
{
    char msg[320];
    if (strcmp(op->status, "failed") != 0) {
        snprintf(msg, sizeof(msg), "%s did not finish in time; try again", what);
        sp_e2b__ctl_fail(c, 500, msg);
        return;
    }
    snprintf(msg, sizeof(msg), "%s failed: %s", what,
             op->error_message[0] ? op->error_message : op->error_code);
    sp_e2b__ctl_fail(c, strcmp(op->error_code, "superseded") == 0 ? 409 : 500, msg);
}

static void on_fetched(void *arg, const sp_sandbox_rec_t *sb, const sp_op_rec_t *op,
                       const sp_err_t *err)
{
    ctl_t *c = arg;
    if (err != NULL) {
        sp_e2b__ctl_fail_err(c, err);
        return;
    }
    c->after_fetch(c, sb);
}

void sp_e2b__ctl_fetch(ctl_t *c, ctl_sb_fn next)
{
    sp_err_t e;
    c->after_fetch = next;
    if (sp_svc_get_sandbox(c->gw->svc, &c->auth, c->id, on_fetched, c, &e) < 0)
        sp_e2b__ctl_fail_err(c, &e);
}

/* Answers with the Sandbox model (create, connect, resume) and c->status. */
static void reply_sandbox(ctl_t *c, const sp_sandbox_rec_t *sb)
{
    sp_e2b__ctl_reply(c, c->status, sandbox_json(c->gw, sb));
}

/* ---- body fields: e2b-gateway/body.h ---- */

/* ---- POST /sandboxes ---- */

static void on_create_deleted(void *arg, const sp_op_rec_t *op, const sp_err_t *err)
{
    if (err != NULL)
        sp_log(SP_LOG_WARN, "e2b", "cleanup of a failed create not requested err=%s", err->msg);
}

static void create_waited(ctl_t *c, const sp_op_rec_t *op)
{
    if (strcmp(op->status, "succeeded") == 0) {
        c->status = 201;
        sp_e2b__ctl_fetch(c, reply_sandbox);
        return;
    }
    if (strcmp(op->status, "failed") == 0) {
        /* E2B leaves no sandbox behind a failed create: neither do we. */
        sp_err_t e;
        if (sp_svc_request(c->gw->svc, &c->auth, c->id, SP_REQ_DELETE, on_create_deleted, NULL,
                           &e) < 0)
            sp_log(SP_LOG_WARN, "e2b", "cleanup of a failed create not requested err=%s", e.msg);
    }
    op_failed(c, op, "creating the sandbox");
}

static void create_from(ctl_t *c, const char *snapshot_id);

/* A templateID that named no template, looked up as a snapshot's bare alias. */
static void on_snap_alias(void *arg, const sp_snap_rec_t *r, const sp_op_rec_t *op,
                          const sp_err_t *err)
{
    ctl_t *c = arg;
    (void)op;
    if (err == NULL) {
        create_from(c, r->id);
        return;
    }
    sp_err_t e;
    if (err->code == SP_ENOTFOUND)
        err = (sp_err_set(&e, SP_ENOTFOUND, "template not found"), &e);
    sp_e2b__ctl_fail_err(c, err);
}

static void on_created(void *arg, const sp_sandbox_rec_t *sb, const sp_op_rec_t *op,
                       const sp_err_t *err)
{
    ctl_t *c = arg;
    if (err != NULL && err->code == SP_ENOTFOUND && !c->snap_tried && c->gw->snap != NULL &&
        strncmp(err->msg, "tag '", 5) != 0) {
        /* No such template: E2B's team namespace also holds snapshot aliases (a template's
         * missing tag is the template's answer). */
        const char *t = json_string_value(json_object_get(c->body, "templateID"));
        char name[SP_SNAP_NAME_MAX + 1];
        sp_err_t e;
        c->snap_tried = true;
        if (t != NULL && strchr(t, '/') == NULL &&
            sp_snap_norm_name(t, name, sizeof name, &e) == 0 &&
            sp_snap_get(c->gw->snap, &c->auth, NULL, name, on_snap_alias, c, &e) == 0)
            return;
    }
    if (err != NULL) {
        sp_e2b__ctl_fail_err(c, err); /* unknown template: 404, as E2B answers */
        return;
    }
    snprintf(c->id, sizeof(c->id), "%s", sb->id);
    sp_e2b__ctl_wait(c, op, create_waited);
}

/* templateID "<team id>/<alias>[:tag]": the snapshot of that name. */
static void on_snap_named(void *arg, const sp_snap_rec_t *r, const sp_op_rec_t *op,
                          const sp_err_t *err)
{
    ctl_t *c = arg;
    (void)op;
    c->snap_tried = true;
    if (err != NULL) {
        on_snap_alias(c, NULL, NULL, err);
        return;
    }
    create_from(c, r->id);
}

static void route_create(ctl_t *c)
{
    char why[SP_E2B_WHY_MAX];
    if (sp_e2b__body_template(c->body, why) < 0) {
        sp_e2b__ctl_fail(c, 400, why);
        return;
    }
    json_t *t = json_object_get(c->body, "templateID");
    /* A snapshot's id (route_snapshots.c) instead of a template: by id at once, by name after
     * a lookup. */
    char sid[80], sname[80];
    sp_err_t e;
    int ref = c->gw->snap != NULL
                  ? sp_e2b__snapshot_ref(c->auth.team_id, json_string_value(t), sid, sname,
                                         sizeof sid)
                  : 0;
    const char *slash = strchr(json_string_value(t), '/');
    if (ref < 0) {
        sp_e2b__ctl_fail(c, 404, "template not found");
    } else if (ref > 0 && sid[0] == '\0' && slash != NULL) {
        /* "<team>/<alias>[:tag]": the team's template of that name and tag first (tmpl.h),
         * then its snapshot of that name (on_created) */
        json_object_set_new(c->body, "templateID", json_string(slash + 1));
        create_from(c, NULL);
    } else if (ref > 0 && sid[0] == '\0') {
        if (sp_snap_get(c->gw->snap, &c->auth, NULL, sname, on_snap_named, c, &e) < 0)
            on_snap_named(c, NULL, NULL, &e);
    } else {
        create_from(c, ref > 0 ? sid : NULL);
    }
}

/* The create of body's sandbox, from the snapshot snapshot_id or (NULL) the templateID. */
static void create_from(ctl_t *c, const char *snapshot_id)
{
    json_t *t = json_object_get(c->body, "templateID");
    sp_create_req_t r = {0};
    char why[SP_E2B_WHY_MAX];
    if (sp_e2b__body_create(c->body, &r, why) < 0) {
        sp_e2b__ctl_fail(c, 400, why);
        return;
    }
    if (snapshot_id != NULL) {
        r.snapshot_id = snapshot_id;
        c->snap_tried = true;
    } else {
        r.template_name = json_string_value(t);
    }
    r.envd_version = SP_E2B_ENVD_VERSION;
    sp_err_t e;
    if (sp_svc_create_sandbox(c->gw->svc, &c->auth, &r, on_created, c, &e) < 0)
        sp_e2b__ctl_fail_err(c, &e);
    json_decref(r.egress);
}

/* ---- GET /sandboxes/{id} ---- */

#define DISK_UNASKED -1 /* c->disk_mb: the sandbox's worker not asked */
#define DISK_ASKED -2   /* asked, without an answer: disk_mb's */

static bool ask_worker(ctl_t *c, const sp_sandbox_rec_t *sb);

static void got_detail(ctl_t *c, const sp_sandbox_rec_t *sb)
{
    const char *state = sp_e2b__state(sb);
    if (state == NULL) {
        sp_e2b__ctl_fail(c, 404, "sandbox not found");
        return;
    }
    if (sb->disk_mb < 0 && c->disk_mb == DISK_UNASKED && ask_worker(c, sb))
        return;
    /* One buffer for every answer: the loop is one thread, and the reply copies it. */
    static sp_buf_t out = SP_BUF_INIT;
    sp_buf_reset(&out);
    ctl_reply_text(c, 200,
                   write_listed(&out, c->gw, sb, state, true, c->disk_mb) == 0 ? &out : NULL);
    if (out.cap > (1u << 20))
        sp_buf_free(&out);
}

/*
 * Many hosts: the disk size is on the row, recorded by the worker that runs the VM
 * (core/control/recon.c), so a detail is one read wherever it is asked. A row from before that
 * column whose VM is on another worker is the exception: that worker is asked for its own
 * detail (GET /sandboxes/{id}, the client's key, the cluster header), bounded by
 * SP_E2B_PEER_MS, and the row is read again; without its answer the size shows 0, as for a
 * sandbox without a VM.
 */
static void on_peer_detail(void *arg, int status, const char *body, size_t len, const char *why)
{
    ctl_t *c = arg;
    json_t *o = status == 200 ? json_loadb(body, len, 0, NULL) : NULL;
    json_t *d = json_object_get(o, "diskSizeMB");
    if (json_is_integer(d) && json_integer_value(d) >= 0)
        c->disk_mb = (long long)json_integer_value(d);
    json_decref(o);
    sp_e2b__ctl_fetch(c, got_detail);
}

static void on_detail_where(void *arg, const sp_where_t *w, const sp_err_t *err)
{
    ctl_t *c = arg;
    h2o_req_t *req = sp_http_hold_req(c->hold);
    char path[96];
    snprintf(path, sizeof(path), "/sandboxes/%s", c->id);
    bool elsewhere = err == NULL && req != NULL && w->found && w->worker_id[0] != '\0' &&
                     w->address[0] != '\0' && strcmp(w->worker_id, c->gw->self) != 0 &&
                     strcmp(w->worker_state, "lost") != 0;
    sp_err_t e;
    if (!elsewhere || sp_proxy_get(c->gw->proxy, req, w->address, path, SP_E2B_PEER_MS,
                                   on_peer_detail, c, &e) == NULL)
        sp_e2b__ctl_fetch(c, got_detail);
}

/* Whether sb's worker is being asked for its disk size (then the row is read again). */
static bool ask_worker(ctl_t *c, const sp_sandbox_rec_t *sb)
{
    c->disk_mb = DISK_ASKED;
    sp_err_t e;
    return !c->forwarded && sp_proxy_has_key(c->gw->proxy) &&
           !sp_svc_sandbox_here(c->gw->svc, sb->id) &&
           sp_svc_sandbox_where(c->gw->svc, sb->id, on_detail_where, c, &e) == 0;
}

static void route_detail(ctl_t *c)
{
    c->disk_mb = DISK_UNASKED;
    sp_e2b__ctl_fetch(c, got_detail);
}

/* ---- listing ---- */

#define BIT(x) (1u << SP_OBS_##x)
#define STATES_RUNNING                                                                             \
    (BIT(PENDING) | BIT(STARTING) | BIT(RUNNING) | BIT(PAUSING) | BIT(PAUSED) | BIT(WAKING))
#define STATES_PAUSED (BIT(SUSPENDING) | BIT(SUSPENDED))

static void list_page(ctl_t *c);

static void on_list(void *arg, const sp_sandbox_rec_t *recs, size_t n, const char *next,
                    const sp_err_t *err)
{
    ctl_t *c = arg;
    if (err != NULL) {
        sp_e2b__ctl_fail_err(c, err);
        return;
    }
    /* The array is written straight (write_listed): into one buffer shared by all answers
     * (the loop is one thread, and the reply copies it), or, for GET /sandboxes when another
     * page is to come, into the request's own (c->text) across the pages. */
    static sp_buf_t page = SP_BUF_INIT;
    sp_buf_t *out = c->text;
    if (out == NULL) {
        sp_buf_reset(&page);
        sp_buf_add(&page, "[", 1);
        out = &page;
    }
    bool ok = true;
    for (size_t i = 0; ok && i < n; i++) {
        const char *state = sp_e2b__state(&recs[i]);
        if (state == NULL)
            continue;
        if (out->len > 1) /* after "[" and an item */
            sp_buf_add(out, ",", 1);
        ok = write_listed(out, c->gw, &recs[i], state, false, -1) == 0;
    }
    snprintf(c->cursor, sizeof(c->cursor), "%s", next ? next : "");
    if (ok && c->route == R_LIST_V1 && next != NULL && ++c->pages < CTL_V1_PAGES) {
        if (c->text == NULL && (c->text = calloc(1, sizeof(*c->text))) != NULL)
            sp_buf_add(c->text, page.p, page.len);
        if (c->text == NULL || c->text->oom) {
            sp_e2b__ctl_fail(c, 500, "out of memory");
            return;
        }
        list_page(c);
        return;
    }
    /* !ok: the answer is the 500 of an array that cannot be written, whatever pages follow. */
    sp_buf_add(out, "]", 1);
    if (c->route == R_LIST_V2)
        snprintf(c->next_token, sizeof(c->next_token), "%s", c->cursor);
    sp_buf_t *own = c->text; /* kept from ctl_free until the reply has copied it */
    c->text = NULL;
    ctl_reply_text(c, 200, ok ? out : NULL);
    if (own != NULL) {
        sp_buf_free(own);
        free(own);
    }
    if (page.cap > (1u << 20))
        sp_buf_free(&page);
}

static void list_page(ctl_t *c)
{
    sp_list_req_t r = {.states = c->states,
                       .metadata = c->filter,
                       .limit = c->limit,
                       .cursor = c->cursor[0] ? c->cursor : NULL};
    sp_err_t e;
    if (sp_svc_list_sandboxes(c->gw->svc, &c->auth, &r, on_list, c, &e) < 0)
        sp_e2b__ctl_fail_err(c, &e);
}

/* metadata=<url-encoded "k=v&k2=v2", each key and value percent-encoded once more> (spec
 * 2.5): the query reader undid the outer layer; undo the form layer and the inner one. */
static json_t *metadata_filter(const char *q, char *why, size_t cap)
{
    json_t *o = json_object();
    size_t len = strlen(q);
    char *tmp = malloc(len + 1), *dec = malloc(len + 1), *key = malloc(len + 1);
    const char *p = q;
    while (o != NULL && tmp && dec && key && *p != '\0') {
        const char *amp = strchr(p, '&');
        size_t pl = amp ? (size_t)(amp - p) : strlen(p);
        const char *eq = memchr(p, '=', pl);
        if (pl == 0) { /* "a=1&&b=2" */
            p += amp ? 1 : 0;
            continue;
        }
        if (eq == NULL || eq == p) {
            snprintf(why, cap, "metadata filter must be key=value pairs");
            json_decref(o);
            o = NULL;
            break;
        }
        /* key: form-decode, then percent-decode */
        if (sp_http_pct_decode(p, (size_t)(eq - p), tmp) < 0 ||
            sp_http_pct_decode(tmp, strlen(tmp), key) < 0 ||
            sp_http_pct_decode(eq + 1, pl - (size_t)(eq + 1 - p), tmp) < 0 ||
            sp_http_pct_decode(tmp, strlen(tmp), dec) < 0 || key[0] == '\0') {
            snprintf(why, cap, "metadata filter has a bad escape");
            json_decref(o);
            o = NULL;
            break;
        }
        json_object_set_new(o, key, json_string(dec));
        p += pl + (amp ? 1 : 0);
    }
    if (o != NULL && (tmp == NULL || dec == NULL || key == NULL)) {
        snprintf(why, cap, "out of memory");
        json_decref(o);
        o = NULL;
    }
    free(tmp);
    free(dec);
    free(key);
    return o;
}

static void route_list(ctl_t *c, h2o_req_t *req)
{
    const char *state = sp_http_query(req, "state");
    const char *md = sp_http_query(req, "metadata");
    const char *limit = sp_http_query(req, "limit");
    const char *token = sp_http_query(req, "nextToken");
    c->limit = c->route == R_LIST_V1 ? 1000 : 100;
    c->states = c->route == R_LIST_V1 ? STATES_RUNNING : STATES_RUNNING | STATES_PAUSED;
    if (c->route == R_LIST_V2 && state != NULL) {
        c->states = 0;
        char buf[128];
        snprintf(buf, sizeof(buf), "%s", state);
        char *save = NULL;
        for (char *s = strtok_r(buf, ",", &save); s; s = strtok_r(NULL, ",", &save)) {
            if (strcmp(s, "running") == 0)
                c->states |= STATES_RUNNING;
            else if (strcmp(s, "paused") == 0)
                c->states |= STATES_PAUSED;
            else {
                sp_e2b__ctl_fail(c, 400, "state must be running and/or paused");
                return;
            }
        }
        if (c->states == 0) {
            sp_e2b__ctl_fail(c, 400, "state filter is empty");
            return;
        }
    }
    if (c->route == R_LIST_V2 && limit != NULL) {
        char *end;
        long l = strtol(limit, &end, 10);
        if (*limit == '\0' || *end != '\0' || l < 1 || l > 100) {
            sp_e2b__ctl_fail(c, 400, "limit must be 1 to 100");
            return;
        }
        c->limit = (int)l;
    }
    if (c->route == R_LIST_V2 && token != NULL) {
        if (strlen(token) >= sizeof(c->cursor)) {
            sp_e2b__ctl_fail(c, 400, "invalid nextToken");
            return;
        }
        snprintf(c->cursor, sizeof(c->cursor), "%s", token);
    }
    if (md != NULL) {
        char why[96];
        if (strlen(md) > 8192) {
            sp_e2b__ctl_fail(c, 400, "metadata filter too long");
            return;
        }
        c->filter = metadata_filter(md, why, sizeof(why));
        if (c->filter == NULL) {
            sp_e2b__ctl_fail(c, 400, why);
            return;
        }
    }
    list_page(c);
}

/* ---- DELETE /sandboxes/{id} ---- */

static void kill_waited(ctl_t *c, const sp_op_rec_t *op)
{
    if (strcmp(op->status, "succeeded") == 0)
        sp_e2b__ctl_reply(c, 204, NULL);
    else
        op_failed(c, op, "killing the sandbox");
}

static void on_requested(void *arg, const sp_op_rec_t *op, const sp_err_t *err)
{
    ctl_t *c = arg;
    if (err != NULL) {
        sp_e2b__ctl_fail_err(c, err);
        return;
    }
    sp_e2b__ctl_wait(c, op, c->after_request);
}

static void request(ctl_t *c, sp_request_t r, const sp_deadline_t *dl, ctl_op_fn next)
{
    sp_err_t e;
    c->after_request = next;
    if (sp_svc_request_deadline(c->gw->svc, &c->auth, c->id, r, dl, on_requested, c, &e) < 0)
        sp_e2b__ctl_fail_err(c, &e);
}

static void route_kill(ctl_t *c)
{
    request(c, SP_REQ_DELETE, NULL, kill_waited);
}

/* ---- POST /sandboxes/{id}/timeout and /refreshes ---- */

static void deadline_set(void *arg, const sp_sandbox_rec_t *sb, const sp_op_rec_t *op,
                         const sp_err_t *err)
{
    ctl_t *c = arg;
    if (err != NULL)
        sp_e2b__ctl_fail_err(c, err);
    else
        sp_e2b__ctl_reply(c, 204, NULL);
}

static void route_deadline(ctl_t *c)
{
    sp_deadline_t dl = {0};
    char why[SP_E2B_WHY_MAX];
    /* timeout: TTL becomes now + timeout (it may shorten); a refresh only ever extends */
    dl.mode = c->route == R_TIMEOUT ? SP_DEADLINE_SET : SP_DEADLINE_EXTEND;
    if (sp_e2b__body_deadline(c->body, c->route != R_TIMEOUT, &dl.secs, why) < 0) {
        sp_e2b__ctl_fail(c, 400, why);
        return;
    }
    sp_err_t e;
    if (sp_svc_set_deadline(c->gw->svc, &c->auth, c->id, &dl, deadline_set, c, &e) < 0)
        sp_e2b__ctl_fail_err(c, &e);
}

/* ---- POST /sandboxes/{id}/pause (= our suspend) ---- */

static void deadline_restored(void *arg, const sp_sandbox_rec_t *sb, const sp_op_rec_t *op,
                              const sp_err_t *err)
{
    if (err != NULL && err->code != SP_ENOTFOUND)
        sp_log(SP_LOG_WARN, "e2b", "deadline not restored after a failed pause err=%s", err->msg);
}

/* The pause failed and the sandbox runs on: give it back a deadline (a full timeout). */
static void pause_undo(ctl_t *c, const sp_sandbox_rec_t *sb)
{
    sp_deadline_t dl = {.mode = SP_DEADLINE_SET, .secs = sb->deadline_s};
    sp_err_t e;
    if (sb->deadline_s > 0 &&
        sp_svc_set_deadline(c->gw->svc, &c->auth, c->id, &dl, deadline_restored, NULL, &e) < 0)
        sp_log(SP_LOG_WARN, "e2b", "deadline not restored after a failed pause err=%s", e.msg);
    op_failed(c, &c->op, "pausing the sandbox");
}

static void pause_waited(ctl_t *c, const sp_op_rec_t *op)
{
    if (strcmp(op->status, "succeeded") == 0) {
        sp_e2b__ctl_reply(c, 204, NULL);
        return;
    }
    c->op = *op;
    sp_e2b__ctl_fetch(c, pause_undo);
}

static void pause_refused(void *arg, const sp_op_rec_t *op, const sp_err_t *err)
{
    ctl_t *c = arg;
    if (err == NULL) {
        sp_e2b__ctl_wait(c, op, pause_waited);
        return;
    }
    if (err->code == SP_ECONFLICT) {
        char msg[160];
        snprintf(msg, sizeof(msg), "sandbox %s is already paused", c->id);
        sp_e2b__ctl_fail(c, 409, msg);
        return;
    }
    sp_e2b__ctl_fail_err(c, err);
}

static void route_pause(ctl_t *c)
{
    /* A paused sandbox keeps no deadline: E2B never kills a paused sandbox on timeout. */
    sp_deadline_t dl = {.mode = SP_DEADLINE_CLEAR};
    sp_err_t e;
    if (sp_svc_request_deadline(c->gw->svc, &c->auth, c->id, SP_REQ_SUSPEND, &dl, pause_refused, c,
                                &e) < 0)
        sp_e2b__ctl_fail_err(c, &e);
}

/* ---- POST /sandboxes/{id}/connect and /resume (= wake from suspend) ---- */

static void woke(ctl_t *c, const sp_op_rec_t *op)
{
    if (strcmp(op->status, "succeeded") == 0)
        sp_e2b__ctl_fetch(c, reply_sandbox);
    else
        op_failed(c, op, "resuming the sandbox");
}

static void on_running(void *arg, const sp_err_t *err)
{
    ctl_t *c = arg;
    if (err != NULL)
        sp_e2b__ctl_fail_err(c, err);
    else
        sp_e2b__ctl_fetch(c, reply_sandbox);
}

/* connect on a running sandbox: its deadline was extended; answer once it really runs. */
static void extended(void *arg, const sp_sandbox_rec_t *sb, const sp_op_rec_t *op,
                     const sp_err_t *err)
{
    ctl_t *c = arg;
    if (err != NULL) {
        sp_e2b__ctl_fail_err(c, err);
        return;
    }
    if (strcmp(sb->observed, "running") == 0) {
        reply_sandbox(c, sb);
        return;
    }
    /* Still starting or waking (someone else's request): wait for it. */
    sp_err_t e;
    if (sp_svc_wake_if_autoresume(c->gw->svc, &c->auth, c->id, SP_SVC_MAX_WAIT_MS, on_running, c,
                                  &e) < 0)
        sp_e2b__ctl_fail_err(c, &e);
}

static void connect_got(ctl_t *c, const sp_sandbox_rec_t *sb)
{
    const char *state = sp_e2b__state(sb);
    if (state == NULL) {
        sp_e2b__ctl_fail(c, 404, "sandbox not found");
        return;
    }
    bool paused = strcmp(state, "paused") == 0;
    sp_err_t e;
    if (c->route == R_RESUME && !paused) {
        char msg[160];
        snprintf(msg, sizeof(msg), "sandbox %s is already running", c->id);
        sp_e2b__ctl_fail(c, 409, msg);
        return;
    }
    sp_deadline_t dl = {.secs = c->timeout_s, .action = c->action[0] ? c->action : NULL};
    if (paused) {
        /* Resumed: a fresh deadline, counted from now. */
        c->status = 201;
        dl.mode = SP_DEADLINE_SET;
        request(c, SP_REQ_WAKE, &dl, woke);
        return;
    }
    /* Running for E2B: connect only ever extends its deadline. */
    c->status = 200;
    dl.mode = SP_DEADLINE_EXTEND;
    if (strcmp(sb->desired, "paused") == 0) {
        /* Our memory-resident pause, which E2B shows as running: resume it. */
        request(c, SP_REQ_WAKE, &dl, woke);
        return;
    }
    if (sp_svc_set_deadline(c->gw->svc, &c->auth, c->id, &dl, extended, c, &e) < 0)
        sp_e2b__ctl_fail_err(c, &e);
}

static void route_connect(ctl_t *c)
{
    char why[SP_E2B_WHY_MAX];
    if (sp_e2b__body_connect(c->body, c->route == R_RESUME, &c->timeout_s, c->action, why) < 0) {
        sp_e2b__ctl_fail(c, 400, why);
        return;
    }
    sp_e2b__ctl_fetch(c, connect_got);
}

/* ---- routing ---- */

static int method_bit(h2o_req_t *req)
{
    if (sp_http_method_is(req, "GET"))
        return CTL_GET;
    if (sp_http_method_is(req, "POST"))
        return CTL_POST;
    if (sp_http_method_is(req, "DELETE"))
        return CTL_DELETE;
    return 0;
}

struct ctl_route {
    int route;
    int method;
    const char *pattern[5]; /* "*" = the sandbox ID */
    bool body;              /* POST with a JSON body (may be empty) */
};

static const struct ctl_route ctl_routes[] = {
    {R_CREATE, CTL_POST, {"sandboxes", NULL}, true},
    {R_LIST_V1, CTL_GET, {"sandboxes", NULL}, false},
    {R_LIST_V2, CTL_GET, {"v2", "sandboxes", NULL}, false},
    {R_METRICS_MANY, CTL_GET, {"sandboxes", "metrics", NULL}, false},
    {R_GET, CTL_GET, {"sandboxes", "*", NULL}, false},
    {R_KILL, CTL_DELETE, {"sandboxes", "*", NULL}, false},
    {R_TIMEOUT, CTL_POST, {"sandboxes", "*", "timeout", NULL}, true},
    {R_REFRESH, CTL_POST, {"sandboxes", "*", "refreshes", NULL}, true},
    {R_PAUSE, CTL_POST, {"sandboxes", "*", "pause", NULL}, false},
    {R_CONNECT, CTL_POST, {"sandboxes", "*", "connect", NULL}, true},
    {R_RESUME, CTL_POST, {"sandboxes", "*", "resume", NULL}, true},
    {R_METRICS, CTL_GET, {"sandboxes", "*", "metrics", NULL}, false},
    {R_LOGS, CTL_GET, {"sandboxes", "*", "logs", NULL}, false},
    {R_LOGS_V2, CTL_GET, {"v2", "sandboxes", "*", "logs", NULL}, false},
    {R_SNAPSHOT, CTL_POST, {"sandboxes", "*", "snapshots", NULL}, true},
    {R_SNAPSHOTS, CTL_GET, {"snapshots", NULL}, false},
};

/* The route for segs and method; *path_known tells 405 from 404 when none matches. */
static const struct ctl_route *ctl_match(const char **segs, int n, int method, bool *path_known,
                                         const char **id)
{
    *path_known = false;
    for (size_t r = 0; r < sizeof(ctl_routes) / sizeof(ctl_routes[0]); r++) {
        const struct ctl_route *cr = &ctl_routes[r];
        const char *sid = NULL;
        int i = 0;
        for (; cr->pattern[i] != NULL && i < n; i++) {
            if (strcmp(cr->pattern[i], "*") == 0)
                sid = segs[i];
            else if (strcmp(cr->pattern[i], segs[i]) != 0)
                break;
        }
        if (cr->pattern[i] != NULL || i != n)
            continue;
        /* /sandboxes/metrics is the many-sandbox route, never a sandbox called "metrics". */
        if (sid != NULL && n == 2 && strcmp(sid, "metrics") == 0)
            continue;
        *path_known = true;
        if (cr->method == method) {
            *id = sid;
            return cr;
        }
    }
    return NULL;
}

static void dispatch(ctl_t *c, h2o_req_t *req)
{
    switch (c->route) {
    case R_CREATE:
        route_create(c);
        break;
    case R_LIST_V1:
    case R_LIST_V2:
        route_list(c, req);
        break;
    case R_GET:
        route_detail(c);
        break;
    case R_KILL:
        route_kill(c);
        break;
    case R_TIMEOUT:
    case R_REFRESH:
        route_deadline(c);
        break;
    case R_PAUSE:
        route_pause(c);
        break;
    case R_CONNECT:
    case R_RESUME:
        route_connect(c);
        break;
    case R_METRICS:
    case R_METRICS_MANY:
        sp_e2b__route_metrics(c, req);
        break;
    case R_LOGS:
    case R_LOGS_V2:
        sp_e2b__route_logs(c, req);
        break;
    case R_TEMPLATES:
        sp_e2b__route_templates(c, req);
        break;
    case R_SNAPSHOT:
        sp_e2b__snapshot_create(c);
        break;
    case R_SNAPSHOTS:
        sp_e2b__snapshot_list(c, req);
        break;
    default:
        sp_e2b__ctl_fail(c, 404, "no such path");
        break;
    }
}

static void on_auth(void *arg, const sp_auth_t *auth, const sp_err_t *err)
{
    ctl_t *c = arg;
    if (err != NULL) {
        sp_e2b__ctl_fail_err(c, err); /* 401, or 503 when the database is down */
        return;
    }
    c->auth = *auth;
    h2o_req_t *req = sp_http_hold_req(c->hold);
    if (req == NULL) { /* the client left while we looked the key up */
        sp_http_release(c->hold);
        return;
    }
    if (c->wants_body) {
        char why[SP_E2B_WHY_MAX];
        int status;
        if (sp_e2b__json_body(req->entity.base, req->entity.len, &c->body, &status, why) < 0) {
            sp_e2b__ctl_fail(c, status, why);
            return;
        }
    }
    dispatch(c, req);
}

void sp_e2b__control(sp_e2b_t *gw, h2o_req_t *req, bool forwarded)
{
    const char *segs[8];
    int n = sp_http_segments(req, segs, 8);
    int method = method_bit(req);
    bool known = false;
    const char *id = NULL;
    const struct ctl_route *r = n > 0 ? ctl_match(segs, n, method, &known, &id) : NULL;
    if (n == 3 && strcmp(segs[0], "upload") == 0 && strcmp(segs[1], "template-files") == 0) {
        sp_e2b__template_upload(gw, req, segs[2]); /* its token is the credential */
        return;
    }
    /* /templates, /v2/templates/..., /v3/templates: names in the path; routed after the key */
    static const struct ctl_route tpl_get = {R_TEMPLATES, CTL_GET, {NULL}, false},
                                  tpl_body = {R_TEMPLATES, CTL_POST, {NULL}, true};
    if (n >= 1 && (strcmp(segs[0], "templates") == 0 ||
                   (n >= 2 && (strcmp(segs[0], "v2") == 0 || strcmp(segs[0], "v3") == 0) &&
                    strcmp(segs[1], "templates") == 0)))
        r = method == CTL_POST || (method == CTL_DELETE && n == 2 && strcmp(segs[1], "tags") == 0)
                ? &tpl_body /* DELETE /templates/tags: {"name", "tags"} */
                : &tpl_get;
    if (r == NULL && n >= 1 &&
        (strcmp(segs[0], "volumes") == 0 || strcmp(segs[0], "volumecontent") == 0)) {
        /* E2B's Volume API (control and content): not on this server yet, said plainly */
        sp_e2b__error(req, 501, "volumes are not supported by this server");
        return;
    }
    if (r == NULL) {
        if (known)
            sp_e2b__error(req, 405, "method not allowed on this path");
        else
            sp_e2b__error(req, 404, "no such path");
        return;
    }
    if (id != NULL && (strlen(id) > 64 || !sp_ids_valid(id))) {
        sp_e2b__error(req, 404, "sandbox not found");
        return;
    }
    const char *key = sp_http_header(req, "x-api-key");
    if ((key == NULL || key[0] == '\0') && r->route == R_TEMPLATES) {
        /* E2B's template routes also take an access token, which is all the CLI sends for
         * `template list`/`delete` with no API key set; here a team's API key is its access
         * token. Sandbox routes keep to X-API-Key, as E2B's do. */
        const char *a = sp_http_header(req, "authorization");
        if (a != NULL && strncasecmp(a, "Bearer ", 7) == 0)
            key = a + 7;
    }
    if (key == NULL || key[0] == '\0') {
        sp_e2b__error(req, 401,
                      r->route == R_TEMPLATES ? "missing X-API-Key or Authorization: Bearer"
                                              : "missing X-API-Key");
        return;
    }
    sp_http_hold_t *h = sp_http_hold(req, sizeof(ctl_t));
    if (h == NULL) {
        sp_e2b__error(req, 500, "out of memory");
        return;
    }
    ctl_t *c = sp_http_hold_user(h);
    c->gw = gw;
    c->hold = h;
    c->route = r->route;
    c->wants_body = r->body;
    c->forwarded = forwarded;
    if (id != NULL)
        snprintf(c->id, sizeof(c->id), "%s", id);
    sp_err_t e;
    if (sp_svc_authenticate(gw->svc, key, on_auth, c, &e) < 0)
        sp_e2b__ctl_fail_err(c, &e);
}
