/*
 * tmplreq.c - the pure half of template builds (tmpl.h): a build request's fields read and
 * checked (sp_tmpl_parse_build), a Dockerfile's request made into steps
 * (sp_tmpl_expand_dockerfile), names, tags and targets, the key of uploaded files
 * (tmplfiles.h). No database, no builds in flight, no files: tests/fuzz_bodies.c links this
 * file alone (with dockerfile.c and the references' and names' checks) to drive every
 * template-build body of both APIs.
 */
#include "core/control/tmpl.h"

#include <ctype.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/control/dockerfile.h"
#include "core/control/ociimg.h"
#include "core/control/tmpl_int.h"
#include "core/control/tmplfiles.h"
#include "core/egress/egress_policy.h"
#include "core/egress/secrets.h"
#include "guest/tmplbuild.h"

bool sp_tmplfiles_valid_key(const char *key)
{
    if (key == NULL || strlen(key) != 64)
        return false;
    for (const char *p = key; *p; p++)
        if (!isdigit((unsigned char)*p) && !(*p >= 'a' && *p <= 'f'))
            return false;
    return true;
}

static bool valid_env_key(const char *k)
{
    if (k[0] == '\0' || strlen(k) > 256 || isdigit((unsigned char)k[0]))
        return false;
    for (const char *p = k; *p; p++)
        if (!isalnum((unsigned char)*p) && *p != '_')
            return false;
    return true;
}

bool sp_tmpl__valid_user(const char *u)
{
    size_t n = strlen(u);
    if (n == 0 || n > 32 || !(islower((unsigned char)u[0]) || u[0] == '_'))
        return false;
    for (size_t i = 0; i < n; i++) {
        unsigned char c = (unsigned char)u[i];
        if (!(islower(c) || isdigit(c) || c == '_' || c == '-'))
            return false;
    }
    return true;
}

static bool is_uuid(const char *s)
{
    if (strlen(s) != 36)
        return false;
    for (size_t i = 0; i < 36; i++) {
        bool dash = i == 8 || i == 13 || i == 18 || i == 23;
        if (dash ? s[i] != '-' : !isxdigit((unsigned char)s[i]))
            return false;
    }
    return true;
}

bool sp_tmpl_valid_tag(const char *tag)
{
    size_t n = tag != NULL ? strlen(tag) : 0;
    if (n == 0 || n > SP_TMPL_TAG_MAX || is_uuid(tag) || strspn(tag, ".") == n)
        return false;
    return strspn(tag, "abcdefghijklmnopqrstuvwxyz0123456789-_.") == n;
}

int sp_tmpl_parse_target(const char *target, const json_t *tags, char name[64], json_t **out,
                         sp_err_t *err)
{
    *out = NULL;
    const char *colon = target != NULL ? strchr(target, ':') : NULL;
    size_t n = target == NULL ? 0 : colon ? (size_t)(colon - target) : strlen(target);
    if (n == 0 || n > 63)
        return sp_err_set(err, SP_EINVAL,
                          "name is required: [a-z0-9][a-z0-9._-]*, at most 63 characters");
    memcpy(name, target, n);
    name[n] = '\0';
    if (!sp_tmplbuild_valid_name(name))
        return sp_err_set(err, SP_EINVAL,
                          "name is required: [a-z0-9][a-z0-9._-]*, at most 63 characters");
    if (tags != NULL && !json_is_null(tags) &&
        (!json_is_array(tags) || json_array_size(tags) > SP_TMPL_TAGS_MAX))
        return sp_err_set(err, SP_EINVAL, "tags must be an array of at most %d tags",
                          SP_TMPL_TAGS_MAX);
    json_t *all = json_array();
    if (all == NULL)
        return sp_err_set(err, SP_EINTERNAL, "out of memory");
    if (colon != NULL)
        json_array_append_new(all, json_string(colon + 1));
    size_t i;
    json_t *v;
    json_array_foreach(tags, i, v) json_array_append(all, v);
    json_t *uniq = json_array();
    json_array_foreach(all, i, v)
    {
        const char *tg = json_string_value(v);
        if (!json_is_string(v) || strlen(tg) != json_string_length(v) || !sp_tmpl_valid_tag(tg)) {
            sp_err_set(err, SP_EINVAL, "bad tag '%.64s': 1 to %d of [a-z0-9._-], not a UUID",
                       tg != NULL ? tg : "", SP_TMPL_TAG_MAX);
            json_decref(all);
            json_decref(uniq);
            return -1;
        }
        bool dup = false;
        for (size_t j = 0; j < json_array_size(uniq) && !dup; j++)
            dup = strcmp(json_string_value(json_array_get(uniq, j)), tg) == 0;
        if (!dup)
            json_array_append(uniq, v);
    }
    json_decref(all);
    if (json_array_size(uniq) == 0)
        json_array_append_new(uniq, json_string("default"));
    *out = uniq;
    return 0;
}

/* The builder VM's id: "bld-" and the build id's first 20 letters and digits. */
static int bad(sp_err_t *err, const char *fmt, const char *a)
{
    return sp_err_set(err, SP_EINVAL, fmt, a);
}

/* A string field within limits, or absent (*out NULL). */
static int opt_str(const json_t *o, const char *key, size_t max, const char **out, sp_err_t *err)
{
    json_t *v = json_object_get(o, key);
    *out = NULL;
    if (v == NULL || json_is_null(v))
        return 0;
    if (!json_is_string(v) || json_string_length(v) == 0 || json_string_length(v) > max ||
        strlen(json_string_value(v)) != json_string_length(v))
        return sp_err_set(err, SP_EINVAL, "%s must be a non-empty string of at most %zu bytes", key,
                          max);
    *out = json_string_value(v);
    return 0;
}

static int opt_int(const json_t *o, const char *key, int lo, int hi, int *out, sp_err_t *err)
{
    json_t *v = json_object_get(o, key);
    if (v == NULL || json_is_null(v))
        return 0;
    if (!json_is_integer(v) || json_integer_value(v) < lo || json_integer_value(v) > hi)
        return sp_err_set(err, SP_EINVAL, "%s must be an integer from %d to %d", key, lo, hi);
    *out = (int)json_integer_value(v);
    return 0;
}

static int check_env(const json_t *env, const char *where, sp_err_t *err)
{
    if (!json_is_object(env) || json_object_size(env) > 1000)
        return bad(err, "%s must be an object of at most 1000 strings", where);
    const char *k;
    json_t *v;
    json_object_foreach((json_t *)env, k, v)
    {
        if (!valid_env_key(k))
            return sp_err_set(err, SP_EINVAL, "%s: bad variable name '%.64s'", where, k);
        if (!json_is_string(v) || json_string_length(v) > 65536 ||
            strlen(json_string_value(v)) != json_string_length(v))
            return sp_err_set(err, SP_EINVAL, "%s: %.64s must be a string without NUL", where, k);
    }
    return 0;
}

/* One step: exactly one of run, env, workdir, user (run may carry user, workdir, env,
 * timeout_s). */
static int check_step(const json_t *s, size_t i, sp_err_t *err)
{
    char where[48];
    snprintf(where, sizeof where, "steps[%zu]", i);
    if (!json_is_object(s))
        return bad(err, "%s must be an object", where);
    static const char *const kinds[] = {"run", "env", "workdir", "user", "copy"};
    int nk = 0, kind = -1;
    for (int k = 0; k < 5; k++)
        if (json_object_get(s, kinds[k]) != NULL) {
            nk++;
            kind = k;
        }
    if (json_object_get(s, "run") != NULL) { /* a run step may set user, workdir, env */
        kind = 0;
        nk = json_object_get(s, "copy") != NULL ? 2 : 1;
    }
    if (nk != 1)
        return bad(err, "%s must have exactly one of run, env, workdir, user, copy", where);
    const char *key;
    json_t *v;
    json_object_foreach((json_t *)s, key, v)
    {
        bool ok = strcmp(key, kinds[kind]) == 0 ||
                  (kind == 0 && (strcmp(key, "user") == 0 || strcmp(key, "workdir") == 0 ||
                                 strcmp(key, "env") == 0 || strcmp(key, "timeout_s") == 0));
        if (!ok)
            return sp_err_set(err, SP_EINVAL, "%s: unknown field '%.64s'", where, key);
    }
    if (kind == 4) {
        json_t *c = json_object_get(s, "copy");
        static const char *const ck[] = {"files", "src", "dest", "user", "mode", NULL};
        if (!json_is_object(c))
            return bad(err, "%s.copy must be an object {files, src, dest, user, mode}", where);
        json_object_foreach(c, key, v)
        {
            bool ok = false;
            for (int j = 0; ck[j] != NULL && !ok; j++)
                ok = strcmp(key, ck[j]) == 0;
            if (!ok)
                return sp_err_set(err, SP_EINVAL, "%s.copy: unknown field '%.64s'", where, key);
        }
        const char *f = json_string_value(json_object_get(c, "files"));
        const char *src = json_string_value(json_object_get(c, "src"));
        const char *dest = json_string_value(json_object_get(c, "dest"));
        const char *cu = json_string_value(json_object_get(c, "user"));
        const char *mode = json_string_value(json_object_get(c, "mode"));
        if (f == NULL || !sp_tmplfiles_valid_key(f))
            return bad(err, "%s.copy.files must be the key of uploaded files (64 hex)", where);
        if (src == NULL || src[0] == '\0' || src[0] == '/' || strlen(src) > 4096 ||
            strstr(src, "..") != NULL)
            return bad(err, "%s.copy.src must be a path inside the uploaded files", where);
        if (dest == NULL || dest[0] == '\0' || strlen(dest) > 4096)
            return bad(err, "%s.copy.dest must be a path", where);
        if (json_object_get(c, "user") != NULL &&
            (cu == NULL || (cu[0] && !sp_tmpl__valid_user(cu))))
            return bad(err, "%s.copy.user must be a user name", where);
        if (json_object_get(c, "mode") != NULL) {
            bool ok = mode != NULL && (mode[0] == '\0' || (strlen(mode) >= 3 && strlen(mode) <= 4));
            for (const char *m = mode; ok && *m; m++)
                ok = *m >= '0' && *m <= '7';
            if (!ok)
                return bad(err, "%s.copy.mode must be octal digits (\"0755\")", where);
        }
        return 0;
    }
    json_t *run = json_object_get(s, "run");
    if (kind == 0) {
        if (json_is_string(run)) {
            if (json_string_length(run) == 0 || json_string_length(run) > 65536 ||
                strlen(json_string_value(run)) != json_string_length(run))
                return bad(err, "%s.run must be 1..65536 bytes without NUL", where);
        } else if (json_is_array(run) && json_array_size(run) >= 1 && json_array_size(run) <= 256) {
            size_t j;
            json_t *a;
            json_array_foreach(
                run, j,
                a) if (!json_is_string(a) || json_string_length(a) > 65536 ||
                       strlen(json_string_value(a)) !=
                           json_string_length(
                               a)) return bad(err,
                                              "%s.run: every argument must be a string without NUL",
                                              where);
        } else {
            return bad(err, "%s.run must be a shell line or an argv array (1..256 strings)", where);
        }
        int to = 0;
        if (opt_int(s, "timeout_s", 1, SP_TMPL_TIMEOUT_MAX, &to, err) < 0)
            return -1;
    }
    json_t *u = json_object_get(s, "user");
    if (u != NULL && (!json_is_string(u) || !sp_tmpl__valid_user(json_string_value(u))))
        return bad(err, "%s.user must be a user name ([a-z_][a-z0-9_-]*, at most 32)", where);
    json_t *w = json_object_get(s, "workdir");
    if (w != NULL && (!json_is_string(w) || json_string_value(w)[0] != '/' ||
                      json_string_length(w) > SP_EXEC_PATH_MAX ||
                      strlen(json_string_value(w)) != json_string_length(w)))
        return bad(err, "%s.workdir must be an absolute path", where);
    json_t *e = json_object_get(s, "env");
    if (e != NULL) {
        char w2[64];
        snprintf(w2, sizeof w2, "%s.env", where);
        if (check_env(e, w2, err) < 0)
            return -1;
    }
    return 0;
}

int sp_tmpl_expand_dockerfile(const json_t *req, json_t **out, sp_err_t *err)
{
    *out = NULL;
    json_t *from = json_object_get(req, "from");
    json_t *df = json_object_get(from, "dockerfile");
    if (!json_is_object(from) || df == NULL)
        return 0;
    json_t *ctx = json_object_get(from, "context");
    const char *key;
    json_t *v;
    json_object_foreach(
        from, key, v) if (strcmp(key, "dockerfile") != 0 && strcmp(key, "context") != 0 &&
                          strcmp(key, "auth") !=
                              0) return sp_err_set(err, SP_EINVAL,
                                                   "from: unknown field '%.64s' beside dockerfile",
                                                   key);
    if (!json_is_string(df))
        return sp_err_set(err, SP_EINVAL, "from.dockerfile must be the Dockerfile's text");
    if (ctx != NULL && (!json_is_string(ctx) || !sp_tmplfiles_valid_key(json_string_value(ctx))))
        return sp_err_set(err, SP_EINVAL,
                          "from.context must be the key of uploaded files (64 hex characters)");
    json_t *steps = json_object_get(req, "steps");
    if (steps != NULL && !json_is_array(steps))
        return sp_err_set(err, SP_EINVAL, "steps must be an array");
    sp_dockerfile_t d;
    if (sp_dockerfile_parse(json_string_value(df), json_string_length(df),
                            ctx ? json_string_value(ctx) : NULL, &d, err) < 0)
        return -1;
    json_t *r = json_deep_copy(req);
    if (r == NULL) {
        sp_dockerfile_free(&d);
        return sp_err_set(err, SP_EINTERNAL, "out of memory");
    }
    if (steps != NULL)
        json_array_extend(d.steps, steps);
    if (d.image[0] != '\0') { /* FROM an image: its registry's credentials come along */
        json_t *f = json_pack("{s:s}", "image", d.image);
        if (json_object_get(from, "auth") != NULL)
            json_object_set(f, "auth", json_object_get(from, "auth"));
        json_object_set_new(r, "from", f);
    } else if (json_object_get(from, "auth") != NULL) {
        sp_dockerfile_free(&d);
        json_decref(r);
        return sp_err_set(err, SP_EINVAL, "from.auth is for a Dockerfile FROM an image");
    } else {
        json_object_set_new(r, "from", json_string(d.parent));
    }
    json_object_set(r, "steps", d.steps);
    if (d.start_cmd != NULL && json_object_get(r, "start_cmd") == NULL)
        json_object_set_new(r, "start_cmd", json_string(d.start_cmd));
    sp_dockerfile_free(&d);
    *out = r;
    return 0;
}

/* from {"image": ref, "auth": {"username", "password" | "password_secret"}}: the reference
 * and credentials (the password itself, or the name of the team secret that holds it). */
static int image_from(const json_t *from, const char **image, const char **user, const char **pass,
                      const char **pass_secret, sp_err_t *err)
{
    const char *key;
    json_t *v;
    json_object_foreach((json_t *)from, key,
                        v) if (strcmp(key, "image") != 0 &&
                               strcmp(key, "auth") !=
                                   0) return sp_err_set(err, SP_EINVAL,
                                                        "from: unknown field '%.64s' beside image",
                                                        key);
    json_t *img = json_object_get(from, "image");
    if (!json_is_string(img) || json_string_length(img) == 0 || json_string_length(img) > 500)
        return sp_err_set(err, SP_EINVAL,
                          "from.image must be an image reference "
                          "(registry/repository:tag)");
    sp_ociimg_ref_t r;
    if (sp_ociimg_parse_ref(json_string_value(img), NULL, &r, err) < 0)
        return -1;
    *image = json_string_value(img);
    json_t *auth = json_object_get(from, "auth");
    if (auth != NULL && !json_is_null(auth)) {
        const char *u = json_string_value(json_object_get(auth, "username"));
        const char *p = json_string_value(json_object_get(auth, "password"));
        const char *ps = json_string_value(json_object_get(auth, "password_secret"));
        if (!json_is_object(auth) || json_object_size(auth) != 2 || u == NULL ||
            (p == NULL) == (ps == NULL) || u[0] == '\0' || strlen(u) > 1024 ||
            (p != NULL && strlen(p) > 8192) || strchr(u, ':') != NULL)
            return sp_err_set(err, SP_EINVAL,
                              "from.auth must be {\"username\", \"password\"} or {\"username\", "
                              "\"password_secret\": the name of a team secret} (strings; no ':' "
                              "in the username)");
        if (ps != NULL && sp_secrets_check_name(ps, err) < 0)
            return -1;
        *user = u;
        *pass = p;
        *pass_secret = ps;
    }
    return 0;
}

int sp_tmpl_parse_build(const json_t *req, sp_tmpl_build_req_t *out, sp_err_t *err)
{
    memset(out, 0, sizeof(*out));
    static const char *const allowed[] = {
        "name",      "description", "from",      "steps", "start_cmd",       "ready_cmd",
        "cpu_count", "memory_mb",   "timeout_s", "force", "ready_timeout_s", "tags",
        "egress",    "disk_mb",     NULL};
    if (!json_is_object(req))
        return sp_err_set(err, SP_EINVAL, "the body must be a JSON object");
    const char *key;
    json_t *v;
    json_object_foreach((json_t *)req, key, v)
    {
        bool ok = false;
        for (int i = 0; allowed[i] != NULL && !ok; i++)
            ok = strcmp(key, allowed[i]) == 0;
        if (!ok)
            return sp_err_set(err, SP_EINVAL, "unknown field '%.64s'", key);
    }
    const char *name = NULL, *parent = NULL;
    if (opt_str(req, "name", 63 + 1 + SP_TMPL_TAG_MAX, &name, err) < 0 ||
        opt_str(req, "description", 255, &out->description, err) < 0 ||
        opt_str(req, "start_cmd", 4096, &out->start_cmd, err) < 0 ||
        opt_str(req, "ready_cmd", 4096, &out->ready_cmd, err) < 0)
        return -1;
    /* "name:tag" and tags: the tags the new version gets (none named: "default") */
    json_t *tags = NULL;
    out->tags_given = (name != NULL && strchr(name, ':') != NULL) ||
                      json_array_size(json_object_get(req, "tags")) > 0;
    if (sp_tmpl_parse_target(name, json_object_get(req, "tags"), out->name, &tags, err) < 0)
        return -1;
    json_decref(tags); /* parsed again into the build */
    if (strncmp(out->name, SP_OCIIMG_PREFIX, strlen(SP_OCIIMG_PREFIX)) == 0)
        return sp_err_set(err, SP_EINVAL,
                          "name: '" SP_OCIIMG_PREFIX "' names are this server's own (images)");
    json_t *from = json_object_get(req, "from");
    if (json_is_string(from)) {
        parent = json_string_value(from);
    } else if (json_is_object(from) && json_object_get(from, "image") != NULL) {
        if (image_from(from, &out->image, &out->reg_user, &out->reg_pass, &out->reg_secret, err) <
            0)
            return -1;
        parent = "base"; /* sizes until the image's own template is known */
    } else if (json_is_object(from) && json_object_size(from) == 1) {
        if (json_is_string(json_object_get(from, "template")))
            parent = json_string_value(json_object_get(from, "template"));
        else if (json_is_string(json_object_get(from, "snapshot")))
            parent = "base"; /* its template is the caller's to find (tmpl.c) */
    } else if (json_is_object(from) && json_object_size(from) == 2 &&
               json_is_string(json_object_get(from, "template")) &&
               json_object_get(from, "version") != NULL) {
        /* one version of a template, by its hash (the caller finds it: tmpl.c) */
        const char *vs = json_string_value(json_object_get(from, "version"));
        parent = json_string_value(json_object_get(from, "template"));
        if (vs == NULL || strlen(vs) < 8 || strlen(vs) > 64 ||
            strspn(vs, "0123456789abcdef") != strlen(vs))
            return sp_err_set(err, SP_EINVAL,
                              "from.version must be a version's hash (at least 8 of its hex "
                              "digits)");
        if (strchr(parent, ':') != NULL)
            return sp_err_set(err, SP_EINVAL, "from: a tag or a version, not both");
        out->parent_version = vs;
    }
    if (parent == NULL)
        return sp_err_set(err, SP_EINVAL,
                          "from is required: a template name, {\"template\": name}, "
                          "{\"snapshot\": id} or {\"image\": reference}");
    /* "name:tag": the tag is the caller's to resolve (a version looked up by build_tagged) */
    const char *colon = out->image == NULL ? strchr(parent, ':') : NULL;
    if (colon != NULL) {
        if ((size_t)(colon - parent) >= sizeof out->parent)
            return sp_err_set(err, SP_ENOTFOUND, "parent template '%.64s' not found", parent);
        out->parent_tag = colon + 1;
    }
    size_t pn = colon != NULL ? (size_t)(colon - parent) : strlen(parent);
    if (pn >= sizeof out->parent)
        return sp_err_set(err, SP_ENOTFOUND, "parent template '%.64s' not found", parent);
    memcpy(out->parent, parent, pn);
    out->parent[pn] = '\0';
    if (!sp_tmplbuild_valid_name(out->parent) ||
        (out->image == NULL &&
         strncmp(out->parent, SP_OCIIMG_PREFIX, strlen(SP_OCIIMG_PREFIX)) == 0))
        return sp_err_set(err, SP_ENOTFOUND, "parent template '%.64s' not found", parent);
    if (strcmp(out->parent, out->name) == 0)
        return sp_err_set(err, SP_EINVAL, "a template cannot be built from itself");
    json_t *steps = json_object_get(req, "steps");
    if (steps != NULL && (!json_is_array(steps) || json_array_size(steps) > SP_TMPL_STEPS_MAX))
        return sp_err_set(err, SP_EINVAL, "steps must be an array of at most %d steps",
                          SP_TMPL_STEPS_MAX);
    for (size_t i = 0; i < json_array_size(steps); i++)
        if (check_step(json_array_get(steps, i), i, err) < 0)
            return -1;
    out->steps = steps;
    out->timeout_s = SP_TMPL_TIMEOUT_S;
    out->ready_timeout_s = SP_TMPL_READY_S;
    if (opt_int(req, "cpu_count", 1, SP_SVC_MAX_CPUS, &out->cpu_count, err) < 0 ||
        opt_int(req, "memory_mb", SP_SVC_MIN_MEMORY_MB, SP_SVC_MAX_MEMORY_MB, &out->memory_mb,
                err) < 0 ||
        opt_int(req, "disk_mb", 256, SP_TMPL_DISK_MAX_MB, &out->disk_mb, err) < 0 ||
        opt_int(req, "timeout_s", 1, SP_TMPL_TIMEOUT_MAX, &out->timeout_s, err) < 0 ||
        opt_int(req, "ready_timeout_s", 1, SP_TMPL_READY_MAX, &out->ready_timeout_s, err) < 0)
        return -1;
    json_t *force = json_object_get(req, "force");
    if (force != NULL && !json_is_boolean(force))
        return sp_err_set(err, SP_EINVAL, "force must be a boolean");
    out->force = json_is_true(force);
    /* the builder's outbound traffic, as a sandbox's (core/egress/egress_policy.h); none
     * given: the internet, as sandboxes get it (package steps need it). Given to the egress
     * proxy when the builder starts (sp_tmpl_set_egress). */
    json_t *egress = json_object_get(req, "egress");
    if (egress != NULL && !json_is_null(egress)) {
        sp_egp_t *pol = sp_egp_from_json(egress, "egress", err);
        if (pol == NULL)
            return -1;
        sp_egp_free(pol);
    }
    return 0;
}
