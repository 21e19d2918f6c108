/*
 * route_templates.c - template builds (core/control/tmpl.h): POST /v1/templates, a build's
 * record and its log, DELETE /v1/templates/{name}, a template with its versions and tags
 * (GET /v1/templates/{name}), and tags:
 *
 *   PUT    /v1/templates/{name}/tags/{tag}  {"version": "<hash or 8+ of its digits>"}
 *                                           or {"from_tag": "<tag>"}: the tag now names that
 *                                           version (made, or moved); 200 {tag, template,
 *                                           version, build_id, created_at}
 *   DELETE /v1/templates/{name}/tags/{tag}  removes it ("default" cannot be: 400)
 *
 * Listing templates is in route_sandboxes.c.
 *
 * The log route answers NDJSON lines from ?offset= (a line number; the answer's last line
 * numbers are offset + count). With ?follow=true it stays open while the build runs, reading
 * the log again every FOLLOW_MS, and ends when the build has ended and every line was sent.
 */
#include <stdlib.h>
#include <string.h>

#include "base/log.h"
#include "native-api/napi_int.h"

#define FOLLOW_MS  300
#define LOG_LINES  10000 /* per read */

static json_t *build_json(const sp_tmpl_build_rec_t *b)
{
    json_t *o = json_pack("{s:s,s:s,s:s,s:b,s:s}", "id", b->id, "template", b->template_name,
                          "status", b->status, "cached", b->cached, "created_at", b->created_at);
    json_object_set_new(o, "version", b->hash[0] ? json_string(b->hash) : json_null());
    json_object_set_new(o, "started_at", b->started_at[0] ? json_string(b->started_at) : json_null());
    json_object_set_new(o, "finished_at",
                        b->finished_at[0] ? json_string(b->finished_at) : json_null());
    json_object_set_new(o, "error", b->error[0] ? json_string(b->error) : json_null());
    json_object_set_new(o, "failed_step",
                        b->failed_step > 0 ? json_integer(b->failed_step) : json_null());
    char logs[256];
    snprintf(logs, sizeof logs, "/v1/templates/%s/builds/%s/logs", b->template_name, b->id);
    json_object_set_new(o, "logs_url", json_string(logs));
    return o;
}

static bool build_finished(const sp_tmpl_build_rec_t *b)
{
    return strcmp(b->status, "succeeded") == 0 || strcmp(b->status, "failed") == 0;
}

static void on_build(void *arg, const sp_tmpl_build_rec_t *b, const sp_err_t *err)
{
    napi_ctx_t *c = arg;
    if (err != NULL) {
        sp_napi__fail(c, err);
        return;
    }
    sp_napi__reply(c, build_finished(b) ? 200 : 202, json_pack("{s:o}", "build", build_json(b)));
}

/* Accepted: answer now, or after waiting for the end with ?wait=. */
static void on_accepted(void *arg, const sp_tmpl_build_rec_t *b, const sp_err_t *err)
{
    napi_ctx_t *c = arg;
    sp_err_t e;
    if (err != NULL || c->wait_ms == 0) {
        on_build(c, b, err);
        return;
    }
    if (sp_tmpl_get_build(c->n->tmpl, &c->auth, b->template_name, b->id, c->wait_ms, on_build, c,
                          &e) < 0)
        sp_napi__fail(c, &e);
}

static bool have_tmpl(napi_ctx_t *c)
{
    if (c->n->tmpl != NULL)
        return true;
    sp_err_t e;
    sp_err_set(&e, SP_EUNAVAIL, "template builds are not available on this server");
    sp_napi__fail(c, &e);
    return false;
}

/* The held request of a route that reads it (its body or query), templates being available:
 * NULL when they are not (answered 503) or the client left (the context dropped). */
static h2o_req_t *tmpl_req(napi_ctx_t *c)
{
    h2o_req_t *req = sp_http_hold_req(c->hold);
    if (!have_tmpl(c))
        return NULL;
    if (req == NULL)
        sp_napi__take(c);
    return req;
}

void sp_napi__templates_build(napi_ctx_t *c)
{
    sp_err_t e;
    if (have_tmpl(c) && sp_tmpl_build(c->n->tmpl, &c->auth, c->body, on_accepted, c, &e) < 0)
        sp_napi__fail(c, &e);
}

void sp_napi__builds_get(napi_ctx_t *c)
{
    sp_err_t e;
    if (have_tmpl(c) && sp_tmpl_get_build(c->n->tmpl, &c->auth, c->segs[2], c->segs[4],
                                          c->wait_ms, on_build, c, &e) < 0)
        sp_napi__fail(c, &e);
}

void sp_napi__templates_delete(napi_ctx_t *c)
{
    sp_err_t e;
    if (have_tmpl(c) &&
        sp_tmpl_delete(c->n->tmpl, &c->auth, c->segs[2], sp_napi__on_deleted, c, &e) < 0)
        sp_napi__fail(c, &e);
}

/* ---- a template with its versions and tags; tags ---- */

static void on_versions(void *arg, const json_t *doc, const sp_err_t *err)
{
    napi_ctx_t *c = arg;
    json_t *o = c->data;
    c->data = NULL;
    if (err != NULL && err->code != SP_ENOTFOUND) {
        json_decref(o);
        sp_napi__fail(c, err);
        return;
    }
    static const char *const keys[] = {"tags", "versions", "builds"};
    for (int i = 0; i < 3; i++) /* none when the template went meanwhile */
        json_object_set_new(o, keys[i],
                            doc != NULL ? json_incref(json_object_get(doc, keys[i])) : json_array());
    sp_napi__reply(c, 200, o);
}

static void on_template(void *arg, const sp_template_rec_t *recs, size_t n, const sp_err_t *err)
{
    napi_ctx_t *c = arg;
    sp_err_t e;
    if (err != NULL || n == 0) {
        sp_napi__fail(c, err ? err : (sp_err_set(&e, SP_ENOTFOUND, "template not found"), &e));
        return;
    }
    json_t *o = sp_napi__template_json(&recs[0]);
    if (recs[0].builtin || c->n->tmpl == NULL) { /* built in: one version, `current` */
        sp_napi__reply(c, 200, o);
        return;
    }
    c->data = o;
    c->data_free = (void (*)(void *))json_decref;
    if (sp_tmpl_versions(c->n->tmpl, &c->auth, recs[0].name, on_versions, c, &e) < 0) {
        sp_napi__fail(c, &e);
    }
}

/* GET /v1/templates/{name}: the template, and for a team's, its tags, versions and builds. */
void sp_napi__templates_detail(napi_ctx_t *c)
{
    sp_err_t e;
    if (strlen(c->segs[2]) > 64)
        sp_napi__fail(c, (sp_err_set(&e, SP_ENOTFOUND, "template not found"), &e));
    else if (sp_svc_templates(c->n->svc, &c->auth, c->segs[2], on_template, c, &e) < 0)
        sp_napi__fail(c, &e);
}

static void on_tag_set(void *arg, const sp_tmpl_tag_rec_t *r, const sp_err_t *err)
{
    napi_ctx_t *c = arg;
    if (err != NULL) {
        sp_napi__fail(c, err);
        return;
    }
    sp_napi__reply(c, 200, json_pack("{s:s,s:s,s:s,s:s,s:s}", "tag", c->segs[4], "template",
                                     r->template_name, "version", r->hash, "build_id",
                                     r->build_id, "created_at", r->created_at));
}

/* PUT /v1/templates/{name}/tags/{tag} {"version"} or {"from_tag"} */
void sp_napi__tags_put(napi_ctx_t *c)
{
    sp_err_t e;
    json_t *b = NULL;
    const char *ver = NULL, *from = NULL;
    if (!have_tmpl(c))
        return;
    if (sp_napi__parse_body(sp_http_hold_req(c->hold), false, &b, &e) < 0 ||
        sp_napi__body_tag(b, &ver, &from, &e) < 0) {
        json_decref(b);
        sp_napi__fail(c, &e);
        return;
    }
    json_t *tags = json_pack("[s]", c->segs[4]);
    if (tags == NULL) {
        sp_err_set(&e, SP_EINTERNAL, "out of memory");
    } else if (sp_tmpl_tags_set(c->n->tmpl, &c->auth, c->segs[2], tags, ver, from, on_tag_set, c,
                                &e) == 0) {
        json_decref(tags);
        json_decref(b);
        return;
    }
    json_decref(tags);
    json_decref(b);
    sp_napi__fail(c, &e);
}

static void on_tag_deleted(void *arg, const sp_err_t *err)
{
    napi_ctx_t *c = arg;
    if (err != NULL)
        sp_napi__fail(c, err);
    else
        sp_napi__reply(c, 200, json_pack("{s:s,s:s,s:b}", "template", c->segs[2], "tag",
                                         c->segs[4], "deleted", 1));
}

/* DELETE /v1/templates/{name}/tags/{tag} */
void sp_napi__tags_delete(napi_ctx_t *c)
{
    sp_err_t e;
    json_t *tags = json_pack("[s]", c->segs[4]);
    if (have_tmpl(c) && tags != NULL &&
        sp_tmpl_tags_delete(c->n->tmpl, &c->auth, c->segs[2], tags, on_tag_deleted, c, &e) < 0)
        sp_napi__fail(c, &e);
    json_decref(tags);
}

/* ---- template files (COPY steps' uploads) ---- */

static void on_file_put(void *arg, bool existed, uint64_t entries, const sp_err_t *err)
{
    napi_ctx_t *c = arg;
    if (err != NULL) {
        sp_napi__fail(c, err);
        return;
    }
    json_t *o = json_pack("{s:s,s:b}", "key", c->segs[2], "existed", existed);
    if (!existed)
        json_object_set_new(o, "entries", json_integer((json_int_t)entries));
    sp_napi__reply(c, existed ? 200 : 201, o);
}

/* PUT /v1/template-files/{sha256}: the body is a tar (or tar.gz) whose SHA-256 is the key. */
void sp_napi__template_files_put(napi_ctx_t *c)
{
    sp_err_t e;
    h2o_req_t *req = tmpl_req(c);
    if (req == NULL)
        return;
    if (sp_tmplfiles_put(sp_tmpl_files(c->n->tmpl), c->auth.team_id, c->segs[2], true,
                         req->entity.base, req->entity.len, on_file_put, c, &e) < 0)
        sp_napi__fail(c, &e);
}

/* GET /v1/template-files/{sha256}: whether the team uploaded it. */
void sp_napi__template_files_get(napi_ctx_t *c)
{
    sp_err_t e;
    char path[4096];
    if (!have_tmpl(c))
        return;
    if (sp_tmplfiles_path(sp_tmpl_files(c->n->tmpl), c->auth.team_id, c->segs[2], path,
                          sizeof path, &e) < 0) {
        if (e.code == SP_EINVAL)
            sp_err_set(&e, SP_ENOTFOUND, "files not found");
        sp_napi__fail(c, &e);
        return;
    }
    sp_napi__reply(c, 200, json_pack("{s:s,s:b}", "key", c->segs[2], "present", 1));
}

/* ---- the log ---- */

struct follow {
    sp_tmpl_t *tmpl;
    sp_auth_t auth;
    char name[65], id[SP_TMPL_ID_MAX + 1];
    uint64_t offset;
    bool follow;
    sp_stream_t *st;
    sp_timer_t timer;
    bool reading; /* an sp_tmpl_logs in flight */
    bool gone;    /* the client left: free once nothing is in flight */
};

static void follow_free(struct follow *f)
{
    sp_timer_stop(&f->timer);
    free(f);
}

static void on_more(void *arg, const char *nd, size_t len, uint64_t next, bool finished,
                    const sp_err_t *err);

static void read_more(struct follow *f)
{
    sp_err_t e;
    f->reading = true;
    if (sp_tmpl_logs(f->tmpl, &f->auth, f->name, f->id, f->offset, LOG_LINES, on_more, f, &e) <
        0) {
        f->reading = false;
        sp_stream_end(f->st, NULL, 0, false);
        follow_free(f);
    }
}

static void on_follow_timer(sp_timer_t *t, void *arg)
{
    (void)t;
    read_more(arg);
}

static void on_more(void *arg, const char *nd, size_t len, uint64_t next, bool finished,
                    const sp_err_t *err)
{
    struct follow *f = arg;
    f->reading = false;
    if (f->gone) {
        follow_free(f);
        return;
    }
    if (err != NULL) {
        sp_stream_end(f->st, NULL, 0, false);
        follow_free(f);
        return;
    }
    if (len > 0 && sp_stream_write(f->st, nd, len, 0) < 0) {
        sp_stream_end(f->st, NULL, 0, false);
        follow_free(f);
        return;
    }
    bool more = next - f->offset >= LOG_LINES;
    f->offset = next;
    if (more) {
        read_more(f);
    } else if (finished || !f->follow) {
        sp_stream_end(f->st, NULL, 0, true);
        follow_free(f);
    } else {
        sp_timer_start(&f->timer, FOLLOW_MS);
    }
}

static void on_gone(void *arg)
{
    struct follow *f = arg;
    f->gone = true;
    if (!f->reading)
        follow_free(f);
}

static const sp_stream_cbs_t follow_cbs = {.on_sent = NULL, .on_gone = on_gone};

/* The first read: errors as a status; else the stream starts with its lines. */
struct first {
    napi_ctx_t *c;
    struct follow *f;
};

static void on_first_read(void *arg, const char *nd, size_t len, uint64_t next, bool finished,
                          const sp_err_t *err)
{
    struct first *fr = arg;
    napi_ctx_t *c = fr->c;
    struct follow *f = fr->f;
    free(fr);
    if (err != NULL) {
        free(f);
        sp_napi__fail(c, err);
        return;
    }
    f->st = sp_napi__ndjson_begin(c, NULL, &follow_cbs, f);
    if (f->st == NULL) {
        free(f);
        return;
    }
    f->reading = true;
    on_more(f, nd, len, next, finished, NULL);
}

void sp_napi__builds_logs(napi_ctx_t *c)
{
    sp_err_t e;
    int offset = 0;
    bool follow = false;
    h2o_req_t *req = tmpl_req(c);
    if (req == NULL)
        return;
    if (sp_napi__query_int(req, "offset", 0, 1 << 30, &offset, &e) < 0 ||
        sp_napi__query_bool(req, "follow", &follow, &e) < 0) {
        sp_napi__fail(c, &e);
        return;
    }
    struct follow *f = calloc(1, sizeof(*f));
    struct first *fr = calloc(1, sizeof(*fr));
    if (f == NULL || fr == NULL) {
        free(f);
        free(fr);
        sp_napi__fail(c, (sp_err_set(&e, SP_EINTERNAL, "out of memory"), &e));
        return;
    }
    f->tmpl = c->n->tmpl;
    f->auth = c->auth;
    snprintf(f->name, sizeof f->name, "%.64s", c->segs[2]);
    snprintf(f->id, sizeof f->id, "%.36s", c->segs[4]);
    f->offset = (uint64_t)offset;
    f->follow = follow;
    sp_timer_init(&f->timer, sp_napi__loop(c), on_follow_timer, f);
    fr->c = c;
    fr->f = f;
    if (sp_tmpl_logs(f->tmpl, &f->auth, f->name, f->id, f->offset, LOG_LINES, on_first_read, fr,
                     &e) < 0) {
        free(f);
        free(fr);
        sp_napi__fail(c, &e);
    }
}
