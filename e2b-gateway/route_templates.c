/*
 * route_templates.c - E2B's template build API over core/control/tmpl.h (spec: e2b-templates.md
 * section 2): the SDK's `Template.build` / `build_in_background` / `get_build_status`,
 * `Template.exists`, template delete and list.
 *
 *   POST /v3/templates {name, cpuCount, memoryMB}        -> reserve a build (tmpl: "waiting")
 *   POST /v2/templates/{id}/builds/{build} {steps...}    -> start it (202, {})
 *   GET  /templates/{id}/builds/{build}/status?logsOffset -> status and log entries
 *   GET  /templates/aliases/{name}, DELETE /templates/{id}, GET /templates
 *   POST /templates/tags {target, tags} -> 201 {tags, buildID}; DELETE /templates/tags {name,
 *   tags} -> 204; GET /templates/{id}/tags -> 200 [{tag, buildID, createdAt}]
 *
 * A template's E2B id is its name. The steps are translated to tmpl's: E2B runs them as `user`
 * in /home/user unless told otherwise (its builder adds that user step first), RUN through
 * `bash -l -c`, USER creating the user when missing, a relative WORKDIR joined to the current
 * one; COPY's files come through an upload link (tmplfiles.h: a token in the URL, since JS
 * sends no credentials with it). What tmpl cannot do yet is refused with a 400 that says so,
 * before anything runs: AWS and GCP registries. Names are E2B's "[namespace/]alias[:tag]":
 * the namespace, when given, must be the team's id; the tag is tmpl's (tmpl.h: versions and
 * tags).
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "e2b-gateway/body.h"
#include "e2b-gateway/route_int.h"
#include "http/bodygate.h"

#define LOG_ENTRIES 100 /* per status answer while the build runs (E2B's cap) */

static bool e2b_name(const char *in, char out[65], char *why, size_t cap)
{
    /* the namespace is checked where the team is known (e2b_name_tag) */
    const char *slash = strchr(in, '/');
    char team[65];
    snprintf(team, sizeof team, "%.*s", slash ? (int)(slash - in) : 0, in);
    return sp_e2b__name_tag(team, in, out, NULL, why, cap);
}

/* A build id as a UUID: ours are (older ones, 20 characters, get their letters' bytes). */
static void uuid_of(const char *id, char out[37])
{
    if (strlen(id) == 36) {
        snprintf(out, 37, "%s", id);
        return;
    }
    unsigned char b[16] = {0};
    for (size_t i = 0; i < 16 && id[i]; i++)
        b[i] = (unsigned char)id[i];
    snprintf(out, 37, "%02x%02x%02x%02x-%02x%02x-%02x%02x-%02x%02x-%02x%02x%02x%02x%02x%02x",
             b[0], b[1], b[2], b[3], b[4], b[5], b[6], b[7], b[8], b[9], b[10], b[11], b[12],
             b[13], b[14], b[15]);
}

static sp_tmpl_t *tmpl_of(ctl_t *c)
{
    if (c->gw->tmpl == NULL)
        sp_e2b__ctl_fail(c, 503, "template builds are not available on this server");
    return c->gw->tmpl;
}

/* ---- POST /v3/templates ---- */

static void on_reserved(void *arg, const sp_tmpl_build_rec_t *b, const sp_err_t *err)
{
    ctl_t *c = arg;
    json_t *tags = c->tpl; /* ours until here */
    c->tpl = NULL;
    if (err != NULL) {
        json_decref(tags);
        sp_e2b__ctl_fail_err(c, err);
        return;
    }
    json_t *o = json_pack("{s:s,s:s,s:b,s:[s],s:[s],s:o}", "templateID", b->template_name,
                          "buildID", b->id, "public", 0, "aliases", b->template_name, "names",
                          b->template_name, "tags", tags);
    sp_e2b__ctl_reply(c, 202, o);
}

static void request_build(ctl_t *c)
{
    char alias[65], why[SP_E2B_WHY_MAX];
    json_t *tags;
    int cpu, mem;
    if (sp_e2b__body_template_reserve(c->body, c->auth.team_id, alias, &tags, &cpu, &mem, why) <
        0) {
        sp_e2b__ctl_fail(c, 400, why);
        return;
    }
    sp_err_t e;
    sp_tmpl_t *t = tmpl_of(c);
    if (t == NULL) {
        json_decref(tags);
        return;
    }
    c->tpl = tags; /* freed by on_reserved */
    if (sp_tmpl_reserve(t, &c->auth, alias, tags, cpu, mem, on_reserved, c, &e) < 0) {
        c->tpl = NULL;
        json_decref(tags);
        sp_e2b__ctl_fail_err(c, &e);
    }
}

/* ---- POST /v2/templates/{id}/builds/{build} ---- */

static void on_started(void *arg, const sp_tmpl_build_rec_t *b, const sp_err_t *err)
{
    ctl_t *c = arg;
    (void)b;
    if (err != NULL)
        sp_e2b__ctl_fail_err(c, err);
    else /* "{}": the JS client parses a 202's body as JSON unless it says it has none */
        sp_e2b__ctl_reply(c, 202, json_object());
}

static void on_reservation(void *arg, const sp_tmpl_build_rec_t *b, const sp_err_t *err)
{
    ctl_t *c = arg;
    if (err != NULL) {
        sp_e2b__ctl_fail_err(c, err);
        return;
    }
    if (strcmp(b->status, "waiting") != 0) {
        sp_e2b__ctl_fail(c, 409, "this build was started already");
        return;
    }
    char why[SP_E2B_WHY_MAX];
    json_t *req;
    if (sp_e2b__body_template_build(c->body, c->auth.team_id, b->template_name, b->cpu_count,
                                    b->memory_mb, &req, why) < 0) {
        sp_e2b__ctl_fail(c, 400, why);
        return;
    }
    sp_err_t e;
    int rc = sp_tmpl_build_reserved(c->gw->tmpl, &c->auth, req, b->id, on_started, c, &e);
    json_decref(req);
    if (rc < 0)
        sp_e2b__ctl_fail_err(c, &e);
}

static void start_build(ctl_t *c, const char *id, const char *build)
{
    char name[65], why[160];
    sp_err_t e;
    if (c->body == NULL) {
        sp_e2b__ctl_fail(c, 400, "request body must be a JSON object");
    } else if (!e2b_name(id, name, why, sizeof why)) {
        sp_e2b__ctl_fail(c, 404, "template not found");
    } else if (tmpl_of(c) != NULL && sp_tmpl_get_build(c->gw->tmpl, &c->auth, name, build, 0,
                                                       on_reservation, c, &e) < 0) {
        sp_e2b__ctl_fail_err(c, &e);
    }
}

/* ---- GET /templates/{id}/builds/{build}/status ---- */

static const char *e2b_status(const char *ours)
{
    if (strcmp(ours, "succeeded") == 0)
        return "ready";
    if (strcmp(ours, "failed") == 0)
        return "error";
    if (strcmp(ours, "building") == 0)
        return "building";
    return "waiting";
}

struct status {
    sp_tmpl_build_rec_t b;
    int offset, limit;
};

static void on_status_logs(void *arg, const char *nd, size_t len, uint64_t next, bool finished,
                           const sp_err_t *err)
{
    ctl_t *c = arg;
    struct status *s = c->tpl;
    (void)next;
    (void)finished;
    if (err != NULL) {
        free(s);
        c->tpl = NULL;
        sp_e2b__ctl_fail_err(c, err);
        return;
    }
    json_t *entries = json_array();
    for (const char *p = nd, *end = nd + len; p < end;) {
        const char *nl = memchr(p, '\n', (size_t)(end - p));
        size_t n = nl ? (size_t)(nl - p) : (size_t)(end - p);
        json_t *l = json_loadb(p, n, 0, NULL);
        const char *lv = json_string_value(json_object_get(l, "level"));
        json_t *en = json_pack("{s:s,s:s,s:s}", "timestamp",
                               json_string_value(json_object_get(l, "ts")) ?: "", "message",
                               json_string_value(json_object_get(l, "line")) ?: "", "level",
                               lv != NULL && (strcmp(lv, "warn") == 0 || strcmp(lv, "error") == 0)
                                   ? lv
                                   : "info");
        if (en != NULL)
            json_array_append_new(entries, en);
        json_decref(l);
        p += n + 1;
    }
    const char *st = e2b_status(s->b.status);
    json_t *o = json_pack("{s:s,s:s,s:s,s:[],s:o}", "templateID", s->b.template_name, "buildID",
                          s->b.id, "status", st, "logs", "logEntries", entries);
    if (strcmp(st, "error") == 0)
        json_object_set_new(o, "reason",
                            json_pack("{s:s}", "message", s->b.error[0] ? s->b.error : "build failed"));
    free(s);
    c->tpl = NULL;
    sp_e2b__ctl_reply(c, 200, o);
}

static void on_status_build(void *arg, const sp_tmpl_build_rec_t *b, const sp_err_t *err)
{
    ctl_t *c = arg;
    struct status *s = c->tpl;
    if (err != NULL) {
        free(s);
        c->tpl = NULL;
        sp_e2b__ctl_fail_err(c, err);
        return;
    }
    s->b = *b;
    /* The answer that says ready or error carries every entry left: none is fetched later. */
    bool final = strcmp(b->status, "succeeded") == 0 || strcmp(b->status, "failed") == 0;
    sp_err_t e;
    if (sp_tmpl_logs(c->gw->tmpl, &c->auth, b->template_name, b->id, (uint64_t)s->offset,
                     final ? 0 : (size_t)s->limit, on_status_logs, c, &e) < 0) {
        free(s);
        c->tpl = NULL;
        sp_e2b__ctl_fail_err(c, &e);
    }
}

static void build_status(ctl_t *c, h2o_req_t *req, const char *id, const char *build)
{
    char name[65], why[160];
    int offset = 0, limit = LOG_ENTRIES;
    const char *o = sp_http_query(req, "logsOffset"), *l = sp_http_query(req, "limit");
    if (o != NULL)
        offset = atoi(o);
    if (l != NULL)
        limit = atoi(l);
    if (offset < 0 || limit < 0) {
        sp_e2b__ctl_fail(c, 400, "logsOffset and limit must not be negative");
        return;
    }
    if (limit == 0 || limit > LOG_ENTRIES)
        limit = LOG_ENTRIES;
    if (!e2b_name(id, name, why, sizeof why)) {
        sp_e2b__ctl_fail(c, 404, "template not found");
        return;
    }
    struct status *s = calloc(1, sizeof(*s));
    if (s == NULL || tmpl_of(c) == NULL) {
        free(s);
        if (s == NULL)
            sp_e2b__ctl_fail(c, 500, "out of memory");
        return;
    }
    s->offset = offset;
    s->limit = limit;
    c->tpl = s; /* ours: freed by our callbacks, never by ctl_free */
    sp_err_t e;
    if (sp_tmpl_get_build(c->gw->tmpl, &c->auth, name, build, 0, on_status_build, c, &e) < 0) {
        free(s);
        c->tpl = NULL;
        sp_e2b__ctl_fail_err(c, &e);
    }
}

/* ---- COPY files: the upload link, and the upload ---- */

/* GET /templates/{id}/files/{hash}: 201 {present, url}; the URL carries a token, since JS PUTs
 * to it without credentials. */
static void files_link(ctl_t *c, h2o_req_t *req, const char *hash)
{
    char path[4096], tok[SP_TMPLFILES_TOKEN];
    sp_err_t e;
    if (tmpl_of(c) == NULL)
        return;
    sp_tmplfiles_t *f = sp_tmpl_files(c->gw->tmpl);
    if (!sp_tmplfiles_valid_key(hash)) {
        sp_e2b__ctl_fail(c, 400, "filesHash must be 64 lowercase hex characters");
        return;
    }
    bool present = sp_tmplfiles_path(f, c->auth.team_id, hash, path, sizeof path, &e) == 0;
    sp_tmplfiles_token(f, c->auth.team_id, hash, tok);
    char url[4600];
    snprintf(url, sizeof url, "%s://%.*s/upload/template-files/%s?token=%s",
             req->scheme == &H2O_URL_SCHEME_HTTPS ? "https" : "http", (int)req->authority.len,
             req->authority.base, hash, tok);
    sp_e2b__ctl_reply(c, 201, json_pack("{s:b,s:s}", "present", present, "url", url));
}

struct upload {
    sp_http_hold_t *hold;
};

/* An upload whose token was good, while its body comes (in req's pool). */
struct upload_body {
    sp_e2b_t *gw;
    char team[SP_ID_LEN + 1];
    char hash[65];
};

static void upload_put(sp_e2b_t *gw, h2o_req_t *req, const char *team, const char *hash);
static void on_upload_body(void *arg, h2o_req_t *req, const sp_err_t *err);

static void on_uploaded(void *arg, bool existed, uint64_t entries, const sp_err_t *err)
{
    struct upload *u = arg;
    (void)existed;
    (void)entries;
    h2o_req_t *req = sp_http_release(u->hold); /* frees u */
    if (req == NULL)
        return;
    if (err != NULL)
        sp_e2b__error_from(req, err);
    else
        sp_http_json(req, 200, json_pack("{s:b}", "stored", 1));
}

void sp_e2b__template_upload(sp_e2b_t *gw, h2o_req_t *req, const char *hash)
{
    char team[SP_ID_LEN + 1], tok[SP_TMPLFILES_TOKEN] = "";
    sp_err_t e;
    if (!sp_http_method_is(req, "PUT")) {
        sp_e2b__error(req, 405, "upload with PUT");
        return;
    }
    if (gw->tmpl == NULL) {
        sp_e2b__error(req, 503, "template builds are not available on this server");
        return;
    }
    const char *t = sp_http_query(req, "token");
    if (t != NULL)
        snprintf(tok, sizeof tok, "%s", t);
    sp_tmplfiles_t *f = sp_tmpl_files(gw->tmpl);
    if (sp_tmplfiles_token_check(f, tok, hash, team, &e) < 0) {
        sp_e2b__error(req, 403, e.msg); /* a large body not read yet: refused on its head */
        return;
    }
    uint64_t len;
    bool chunked;
    if (sp_bodygate_streamed(req, &len, &chunked)) { /* the token is good: now the body */
        struct upload_body *ub = h2o_mem_alloc_pool(&req->pool, sizeof(*ub));
        ub->gw = gw;
        snprintf(ub->team, sizeof ub->team, "%s", team);
        snprintf(ub->hash, sizeof ub->hash, "%s", hash);
        sp_bodygate_body_collect(req, on_upload_body, ub);
        return;
    }
    upload_put(gw, req, team, hash);
}

static void on_upload_body(void *arg, h2o_req_t *req, const sp_err_t *err)
{
    const struct upload_body *ub = arg;
    if (err != NULL)
        sp_e2b__error_from(req, err);
    else
        upload_put(ub->gw, req, ub->team, ub->hash);
}

static void upload_put(sp_e2b_t *gw, h2o_req_t *req, const char *team, const char *hash)
{
    sp_err_t e;
    sp_tmplfiles_t *f = sp_tmpl_files(gw->tmpl);
    sp_http_hold_t *h = sp_http_hold(req, sizeof(struct upload));
    if (h == NULL) {
        sp_e2b__error(req, 500, "out of memory");
        return;
    }
    struct upload *u = sp_http_hold_user(h);
    u->hold = h;
    if (sp_tmplfiles_put(f, team, hash, false, req->entity.base, req->entity.len, on_uploaded, u,
                         &e) < 0) {
        req = sp_http_release(h);
        if (req != NULL)
            sp_e2b__error_from(req, &e);
    }
}

/* ---- aliases, tags, delete, list ---- */

struct alias {
    char tag[65];
    bool builtin;
};

static void on_alias_tags(void *arg, const json_t *doc, const sp_err_t *err)
{
    ctl_t *c = arg;
    struct alias *al = c->tpl;
    c->tpl = NULL;
    bool found = false;
    size_t i;
    json_t *v;
    json_array_foreach(json_object_get(doc, "tags"), i, v) found =
        found || strcmp(json_string_value(json_object_get(v, "tag")), al->tag) == 0;
    char msg[200];
    if (err != NULL && err->code != SP_ENOTFOUND) {
        sp_e2b__ctl_fail_err(c, err);
    } else if (err != NULL || !found) {
        snprintf(msg, sizeof msg, "tag '%s' does not exist for template '%s'", al->tag,
                 json_string_value(json_object_get(doc, "name")) ?: "");
        sp_e2b__ctl_fail(c, 404, msg);
    } else {
        sp_e2b__ctl_reply(c, 200, json_pack("{s:s,s:b}", "templateID",
                                            json_string_value(json_object_get(doc, "name")),
                                            "public", 0));
    }
    free(al);
}

static void on_alias(void *arg, const sp_template_rec_t *recs, size_t n, const sp_err_t *err)
{
    ctl_t *c = arg;
    struct alias *al = c->tpl;
    if (err != NULL || n == 0) {
        free(al);
        c->tpl = NULL;
        if (err != NULL && err->code != SP_ENOTFOUND)
            sp_e2b__ctl_fail_err(c, err);
        else
            sp_e2b__ctl_fail(c, 404, "template not found");
        return;
    }
    /* "name:tag" exists when the tag does (a built-in template has "default" only) */
    if (al != NULL && al->tag[0] != '\0' && !(recs[0].builtin && strcmp(al->tag, "default") == 0)) {
        sp_err_t e;
        if (recs[0].builtin) {
            c->tpl = NULL;
            char msg[200];
            snprintf(msg, sizeof msg, "tag '%s' does not exist for template '%s'", al->tag,
                     recs[0].name);
            free(al);
            sp_e2b__ctl_fail(c, 404, msg);
        } else if (tmpl_of(c) == NULL) {
            c->tpl = NULL;
            free(al);
        } else if (sp_tmpl_versions(c->gw->tmpl, &c->auth, recs[0].name, on_alias_tags, c, &e) <
                   0) {
            c->tpl = NULL;
            free(al);
            sp_e2b__ctl_fail_err(c, &e);
        }
        return;
    }
    free(al);
    c->tpl = NULL;
    sp_e2b__ctl_reply(c, 200, json_pack("{s:s,s:b}", "templateID", recs[0].name, "public",
                                        recs[0].builtin));
}

/* GET /templates/aliases/{name}: name is "[ns/]alias[:tag]", raw (two segments) or encoded. */
static void alias_exists(ctl_t *c, const char *name)
{
    char alias[65], why[160];
    struct alias *al = calloc(1, sizeof(*al));
    sp_err_t e;
    if (al == NULL) {
        sp_e2b__ctl_fail(c, 500, "out of memory");
    } else if (!sp_e2b__name_tag(c->auth.team_id, name, alias, al->tag, why, sizeof why)) {
        free(al);
        sp_e2b__ctl_fail(c, 404, "template not found");
    } else {
        c->tpl = al; /* freed by on_alias or on_alias_tags */
        if (sp_svc_templates(c->gw->svc, &c->auth, alias, on_alias, c, &e) < 0) {
            c->tpl = NULL;
            free(al);
            sp_e2b__ctl_fail_err(c, &e);
        }
    }
}

/* POST /templates/tags {"target": "name[:tag]", "tags": [...]}: the tags moved to the version
 * target's tag (default "default") names. */
static void on_assigned(void *arg, const sp_tmpl_tag_rec_t *r, const sp_err_t *err)
{
    ctl_t *c = arg;
    json_t *tags = c->tpl;
    c->tpl = NULL;
    if (err != NULL) {
        json_decref(tags);
        sp_e2b__ctl_fail_err(c, err);
        return;
    }
    char uuid[37];
    uuid_of(r->build_id, uuid);
    sp_e2b__ctl_reply(c, 201, json_pack("{s:o,s:s}", "tags", tags, "buildID", uuid));
}

static void assign_tags(ctl_t *c)
{
    const char *target = json_string_value(json_object_get(c->body, "target"));
    json_t *given = json_object_get(c->body, "tags");
    char alias[65], tag[65], why[160];
    if (c->body == NULL || target == NULL || !json_is_array(given) ||
        json_array_size(given) == 0) {
        sp_e2b__ctl_fail(c, 400, "give target (\"name:tag\") and tags (a non-empty array)");
        return;
    }
    if (!sp_e2b__name_tag(c->auth.team_id, target, alias, tag, why, sizeof why)) {
        sp_e2b__ctl_fail(c, 400, why);
        return;
    }
    json_t *tags = json_array();
    size_t i;
    json_t *v;
    json_array_foreach(given, i, v)
    {
        char l[80];
        size_t k = 0;
        for (const char *p = json_string_value(v); p && *p && k < sizeof l - 1; p++)
            l[k++] = (char)((*p >= 'A' && *p <= 'Z') ? *p + 32 : *p);
        l[k] = '\0';
        json_array_append_new(tags, json_is_string(v) ? json_string(l) : json_null());
    }
    sp_err_t e;
    if (tmpl_of(c) == NULL) {
        json_decref(tags);
        return;
    }
    c->tpl = tags;
    if (sp_tmpl_tags_set(c->gw->tmpl, &c->auth, alias, tags, NULL, tag[0] ? tag : "default",
                         on_assigned, c, &e) < 0) {
        c->tpl = NULL;
        json_decref(tags);
        sp_e2b__ctl_fail_err(c, &e);
    }
}

/* DELETE /templates/tags {"name", "tags"}: a name with a tag, or "default", is a 400. */
static void remove_tags(ctl_t *c)
{
    const char *name = json_string_value(json_object_get(c->body, "name"));
    json_t *given = json_object_get(c->body, "tags");
    char alias[65], tag[65], why[160];
    if (c->body == NULL || name == NULL || !json_is_array(given) ||
        json_array_size(given) == 0) {
        sp_e2b__ctl_fail(c, 400, "give name and tags (a non-empty array)");
        return;
    }
    if (!sp_e2b__name_tag(c->auth.team_id, name, alias, tag, why, sizeof why) || tag[0] != '\0') {
        sp_e2b__ctl_fail(c, 400, tag[0] != '\0' ? "name must not carry a tag" : why);
        return;
    }
    sp_err_t e;
    if (tmpl_of(c) != NULL &&
        sp_tmpl_tags_delete(c->gw->tmpl, &c->auth, alias, given, sp_e2b__ctl_done, c, &e) < 0)
        sp_e2b__ctl_fail_err(c, &e);
}

/* GET /templates/{id}/tags: [{tag, buildID, createdAt}] */
static void on_tags(void *arg, const json_t *doc, const sp_err_t *err)
{
    ctl_t *c = arg;
    if (err != NULL) {
        sp_e2b__ctl_fail_err(c, err);
        return;
    }
    json_t *arr = json_array();
    size_t i;
    json_t *v;
    json_array_foreach(json_object_get(doc, "tags"), i, v)
    {
        char uuid[37];
        uuid_of(json_string_value(json_object_get(v, "build_id")) ?: "", uuid);
        json_array_append_new(
            arr, json_pack("{s:O,s:s,s:O}", "tag", json_object_get(v, "tag"), "buildID", uuid,
                           "createdAt", json_object_get(v, "created_at")));
    }
    sp_e2b__ctl_reply(c, 200, arr);
}

static void get_tags(ctl_t *c, const char *id)
{
    char alias[65], why[160];
    sp_err_t e;
    if (!sp_e2b__name_tag(c->auth.team_id, id, alias, NULL, why, sizeof why))
        sp_e2b__ctl_fail(c, 404, "template not found");
    else if (tmpl_of(c) != NULL &&
             sp_tmpl_versions(c->gw->tmpl, &c->auth, alias, on_tags, c, &e) < 0)
        sp_e2b__ctl_fail_err(c, &e);
}

static void on_list(void *arg, const sp_template_rec_t *recs, size_t n, const sp_err_t *err)
{
    ctl_t *c = arg;
    if (err != NULL) {
        sp_e2b__ctl_fail_err(c, err);
        return;
    }
    json_t *arr = json_array();
    for (size_t i = 0; i < n; i++) {
        const sp_template_rec_t *t = &recs[i];
        const char *st = strcmp(t->status, "ready") == 0      ? "ready"
                         : strcmp(t->status, "building") == 0 ? "building"
                         : strcmp(t->status, "failed") == 0   ? "error"
                                                              : "waiting";
        json_array_append_new(
            arr,
            json_pack("{s:s,s:s,s:i,s:i,s:i,s:b,s:[s],s:[s],s:s,s:s,s:n,s:n,s:i,s:i,s:s,s:s}",
                      "templateID", t->name, "buildID",
                      t->last_build_id[0] ? t->last_build_id : t->version, "cpuCount", t->cpu_count,
                      "memoryMB", t->memory_mb, "diskSizeMB", t->disk_mb > 0 ? t->disk_mb : 2048,
                      "public", t->builtin, "aliases", t->name, "names", t->name, "createdAt",
                      t->updated_at, "updatedAt", t->updated_at, "createdBy", "lastSpawnedAt",
                      "spawnCount", 0, "buildCount", (int)json_array_size(t->versions),
                      "envdVersion", "0.2.0", "buildStatus", st));
    }
    sp_e2b__ctl_reply(c, 200, arr);
}

/* Whether DELETE /templates/... names a snapshot (route_snapshots.c): one: the whole id (one
 * segment), else ns and rest (two segments). Non-zero when it does (sid or sname set; both ""
 * for a name in another namespace: not found). */
static int snapshot_ref(ctl_t *c, const char *one, const char *ns, const char *rest, char *sid,
                        char *sname)
{
    char ref[200];
    if (c->gw->snap == NULL)
        return 0;
    if (one != NULL)
        snprintf(ref, sizeof ref, "%s", one);
    else
        snprintf(ref, sizeof ref, "%s/%s", ns, rest);
    int r = sp_e2b__snapshot_ref(c->auth.team_id, ref, sid, sname, 80);
    if (r < 0)
        sid[0] = sname[0] = '\0';
    return r;
}

void sp_e2b__route_templates(ctl_t *c, h2o_req_t *req)
{
    const char *segs[8];
    int n = sp_http_segments(req, segs, 8);
    int b = n > 0 && (strcmp(segs[0], "v2") == 0 || strcmp(segs[0], "v3") == 0) ? 1 : 0;
    const char **s = segs + b;
    int k = n - b;
    bool get = sp_http_method_is(req, "GET"), post = sp_http_method_is(req, "POST"),
         del = sp_http_method_is(req, "DELETE");
    char name[65], why[160], sid[80] = "", sname[80] = "";
    sp_err_t e;
    if (n < 1 || k < 1 || strcmp(s[0], "templates") != 0) {
        sp_e2b__ctl_fail(c, 404, "no such path");
    } else if (k == 1 && post && b == 1 && strcmp(segs[0], "v3") == 0) {
        request_build(c);
    } else if (k == 4 && post && b == 1 && strcmp(s[2], "builds") == 0) {
        start_build(c, s[1], s[3]);
    } else if (k == 5 && get && b == 0 && strcmp(s[2], "builds") == 0 &&
               strcmp(s[4], "status") == 0) {
        build_status(c, req, s[1], s[3]);
    } else if (k == 4 && get && b == 0 && strcmp(s[2], "files") == 0) {
        files_link(c, req, s[3]);
    } else if (k >= 3 && get && b == 0 && strcmp(s[1], "aliases") == 0) {
        char full[200];
        snprintf(full, sizeof full, "%s%s%s", s[2], k == 4 ? "/" : "", k == 4 ? s[3] : "");
        if (k > 4)
            sp_e2b__ctl_fail(c, 404, "template not found");
        else
            alias_exists(c, full);
    } else if (k == 2 && post && b == 0 && strcmp(s[1], "tags") == 0) {
        assign_tags(c);
    } else if (k == 2 && del && b == 0 && strcmp(s[1], "tags") == 0) {
        remove_tags(c);
    } else if ((k == 3 || k == 4) && get && b == 0 && strcmp(s[k - 1], "tags") == 0) {
        char full[200];
        snprintf(full, sizeof full, "%s%s%s", s[1], k == 4 ? "/" : "", k == 4 ? s[2] : "");
        get_tags(c, full);
    } else if (k == 1 && get && b == 0) {
        if (sp_svc_templates(c->gw->svc, &c->auth, NULL, on_list, c, &e) < 0)
            sp_e2b__ctl_fail_err(c, &e);
    } else if ((k == 2 || k == 3) && del && b == 0 && strcmp(s[1], "tags") != 0 &&
               snapshot_ref(c, k == 2 ? s[1] : NULL, s[1], s[2], sid, sname) != 0) {
        /* A snapshot's id (Sandbox.delete_snapshot): "<id>:default" or "<ns>/<alias>:<tag>",
         * raw from Python (two segments) or percent-encoded from JS (one). */
        if (sid[0] == '\0' && sname[0] == '\0')
            sp_e2b__ctl_fail(c, 404, "snapshot not found");
        else
            sp_e2b__snapshot_delete(c, sid, sname);
    } else if (k == 2 && del && b == 0 && strcmp(s[1], "tags") != 0) {
        if (!e2b_name(s[1], name, why, sizeof why))
            sp_e2b__ctl_fail(c, 404, "template not found");
        else if (tmpl_of(c) != NULL &&
                 sp_tmpl_delete(c->gw->tmpl, &c->auth, name, sp_e2b__ctl_done, c, &e) < 0)
            sp_e2b__ctl_fail_err(c, &e);
    } else {
        sp_e2b__ctl_fail(c, 501,
                         "this template call (tags, publishing, snapshots) is not supported by "
                         "this server");
    }
}
