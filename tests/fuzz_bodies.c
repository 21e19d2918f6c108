/*
 * fuzz_bodies.c - libFuzzer target over every JSON request-body parser of both APIs: the
 * native API's (native-api/body.h) and the E2B gateway's (e2b-gateway/body.h), each driven as
 * its route drives it (the JSON text, the object check of the route or its dispatcher, the
 * parser, and what core checks of the result without state: string maps, egress policies,
 * credential rules).
 *
 * Input: byte 0 picks the parser (P_* below, modulo their count), the rest is the body.
 *
 * Checked: a refusal is 400 (SP_EINVAL; 413 for a body past the cap, 500 only for out of
 * memory) with a message; what a parser accepts is within the bounds the route promises core
 * (ranges, strings NUL-terminated at their JSON length, exactly one of template and snapshot,
 * cmd or argv, ...); a normalised egress policy or set of credential rules reads back as itself.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "core/control/admin.h"
#include "core/control/tmpl.h"
#include "core/egress/egress_policy.h"
#include "core/egress/secrets.h"
#include "e2b-gateway/body.h"
#include "native-api/body.h"
#include "tests/fuzz.h"

enum {
    P_CREATE = 0,
    P_NONE,
    P_SNAPSHOT,
    P_RUN,
    P_STDIN,
    P_SIGNAL,
    P_MKDIR,
    P_MOVE,
    P_SESSION,
    P_CONTEXT,
    P_EXEC,
    P_EXEC_CTX,
    P_SECRET_POST,
    P_SECRET_PUT,
    P_CREDENTIALS,
    P_EGRESS,
    P_TEAM,
    P_QUOTA,
    P_KEY,
    P_TAG,
    P_E2B_CREATE,
    P_E2B_TIMEOUT,
    P_E2B_REFRESH,
    P_E2B_CONNECT,
    P_E2B_RESUME,
    P_E2B_SNAPSHOT,
    P_E2B_CODE_CONTEXT,
    P_E2B_CODE_EXEC,
    P_TMPL_BUILD,      /* native POST /v1/templates: core's own parse (tmpl.h) */
    P_E2B_TPL_RESERVE, /* E2B POST /v3/templates */
    P_E2B_TPL_BUILD,   /* E2B POST /v2/templates/{id}/builds/{build}, then core's parse */
    P_COUNT
};

static void check_err(const sp_err_t *e)
{
    ASSERT(e->code == SP_EINVAL || e->code == SP_ETOOBIG || e->code == SP_EINTERNAL);
    ASSERT(e->msg[0] != '\0' && memchr(e->msg, '\0', sizeof(e->msg)) != NULL);
}

static void check_why(const char *why)
{
    ASSERT(why[0] != '\0' && memchr(why, '\0', SP_E2B_WHY_MAX) != NULL);
}

/* A C string the JSON string v is, whole (no NUL inside). */
static void check_whole(const char *s, const json_t *v)
{
    ASSERT(s != NULL && json_is_string(v) && strlen(s) == json_string_length(v));
}

static void check_str(const char *s, size_t max)
{
    ASSERT(s == NULL || strlen(s) <= max);
}

static void check_cmd(const sp_exec_cmd_t *c)
{
    ASSERT((c->cmd != NULL) != (c->argv != NULL));
    ASSERT(c->cmd == NULL || c->cmd[0] != '\0');
    ASSERT(c->argv == NULL || (c->argc >= 1 && c->argc <= SP_AP_MAX_ARGV));
    for (size_t i = 0; c->argv != NULL && i < c->argc; i++)
        ASSERT(c->argv[i] != NULL);
    for (size_t i = 0; i < c->envc; i++)
        ASSERT(c->env[i] != NULL && strchr(c->env[i], '=') != NULL && c->env[i][0] != '=');
    ASSERT(c->user == NULL || (c->user[0] != '\0' && strlen(c->user) <= 63));
    check_str(c->cwd, SP_EXEC_PATH_MAX);
    ASSERT((c->rows == 0 && c->cols == 0) || c->pty);
    ASSERT(c->rows <= 1000 && c->cols <= 1000);
}

/* An egress policy as core reads it: refused, or normalised into what reads back the same. */
static void check_policy(const json_t *p)
{
    sp_err_t e;
    sp_egp_t *pol = sp_egp_from_json(p, "policy", &e);
    if (pol == NULL) {
        check_err(&e);
        return;
    }
    json_t *norm = sp_egp_to_json(pol);
    sp_egp_free(pol);
    ASSERT(norm != NULL);
    sp_egp_t *again = sp_egp_from_json(norm, "policy", &e);
    ASSERT(again != NULL);
    json_t *norm2 = sp_egp_to_json(again);
    sp_egp_free(again);
    ASSERT(json_equal(norm, norm2));
    json_decref(norm);
    json_decref(norm2);
}

/* Credential rules as core reads them: refused, or normalised into what normalises to itself. */
static void check_rules(const json_t *rules)
{
    sp_err_t e;
    json_t *norm = sp_secrets_rules_normalize(rules, &e);
    if (norm == NULL) {
        check_err(&e);
        return;
    }
    json_t *again = sp_secrets_rules_normalize(norm, &e);
    ASSERT(again != NULL && json_equal(norm, again));
    json_decref(norm);
    json_decref(again);
}

/* A template build request as core reads it (sp_tmpl_build, before any state): a Dockerfile
 * made into steps, then the fields. What it accepts is within what a build is given. */
static void check_tmpl_build(const json_t *req)
{
    sp_err_t e;
    json_t *expanded = NULL;
    if (sp_tmpl_expand_dockerfile(req, &expanded, &e) < 0) {
        ASSERT(expanded == NULL);
        check_err(&e);
        return;
    }
    sp_tmpl_build_req_t r;
    if (sp_tmpl_parse_build(expanded != NULL ? expanded : req, &r, &e) < 0) {
        ASSERT(e.code == SP_EINVAL || e.code == SP_ENOTFOUND || e.code == SP_EINTERNAL);
        ASSERT(e.msg[0] != '\0');
    } else {
        ASSERT(r.name[0] != '\0' && strlen(r.name) < sizeof r.name);
        ASSERT(r.parent[0] != '\0' && strcmp(r.parent, r.name) != 0);
        ASSERT(r.steps == NULL || json_array_size(r.steps) <= SP_TMPL_STEPS_MAX);
        ASSERT(r.cpu_count >= 0 && r.cpu_count <= SP_SVC_MAX_CPUS);
        ASSERT(r.memory_mb == 0 ||
               (r.memory_mb >= SP_SVC_MIN_MEMORY_MB && r.memory_mb <= SP_SVC_MAX_MEMORY_MB));
        ASSERT(r.timeout_s >= 1 && r.timeout_s <= SP_TMPL_TIMEOUT_MAX);
        ASSERT(r.ready_timeout_s >= 1 && r.ready_timeout_s <= SP_TMPL_READY_MAX);
        ASSERT((r.image == NULL) || (r.parent_tag == NULL && strcmp(r.parent, "base") == 0));
        ASSERT(r.reg_user == NULL || r.image != NULL);
        check_str(r.start_cmd, 4096);
        check_str(r.ready_cmd, 4096);
    }
    json_decref(expanded);
}

static void native(int which, const char *p, size_t n)
{
    sp_err_t e = {0};
    json_t *b = NULL;
    bool quiet = which == P_SECRET_POST || which == P_SECRET_PUT || which == P_CREDENTIALS;
    if (sp_napi__json_body(p, n, quiet, &b, &e) < 0) {
        ASSERT(b == NULL);
        check_err(&e);
        return;
    }
    /* The dispatcher refuses a POST body that is not an object; the PUT routes their own way
     * (secrets and credentials: an object; a tag and a policy: checked below). */
    bool put =
        which == P_SECRET_PUT || which == P_CREDENTIALS || which == P_EGRESS || which == P_TAG;
    if ((b != NULL && !json_is_object(b) && !(which == P_EGRESS || which == P_TAG)) ||
        (b == NULL && put && which != P_TAG)) {
        json_decref(b);
        return;
    }
    int rc = 0;
    switch (which) {
    case P_CREATE: {
        sp_create_req_t r = {0};
        rc = sp_napi__body_create(b, &r, &e);
        if (rc == 0) {
            ASSERT((r.template_name != NULL) != (r.snapshot_id != NULL));
            check_whole(r.template_name ? r.template_name : r.snapshot_id,
                        json_object_get(b, r.template_name ? "template" : "snapshot"));
            ASSERT(r.idle_timeout_s >= 0 && r.idle_timeout_s <= SP_SVC_MAX_TIMEOUT_S);
            ASSERT(r.timeout_s >= 0 && r.timeout_s <= SP_SVC_MAX_TIMEOUT_S);
            ASSERT(r.cpu_count >= 0 && r.cpu_count <= SP_SVC_MAX_CPUS);
            ASSERT(r.memory_mb == 0 ||
                   (r.memory_mb >= SP_SVC_MIN_MEMORY_MB && r.memory_mb <= SP_SVC_MAX_MEMORY_MB));
            /* what core checks next, without state */
            if (sp_svc_check_string_map(r.metadata, "metadata", &e) < 0 ||
                sp_svc_check_string_map(r.env, "env", &e) < 0)
                check_err(&e);
            if (r.egress != NULL)
                check_policy(r.egress);
            if (r.credentials != NULL)
                check_rules(r.credentials);
        }
        break;
    }
    case P_NONE:
        rc = sp_napi__body_none(b, &e);
        ASSERT(rc < 0 || b == NULL || json_object_size(b) == 0);
        break;
    case P_SNAPSHOT: {
        const char *name;
        rc = sp_napi__body_snapshot(b, &name, &e);
        if (rc == 0)
            check_str(name, SP_SNAP_NAME_MAX);
        break;
    }
    case P_RUN: {
        napi_runspec_t *r = sp_napi__body_run(b, n % 2 == 0, &e);
        rc = r == NULL ? -1 : 0;
        if (r != NULL) {
            check_cmd(&r->spec.cmd);
            ASSERT(!r->background || (!r->stream && r->spec.cmd.stdin_data == NULL &&
                                      r->spec.cmd.timeout_ms == 0 && r->spec.cmd.stdin_pipe));
            ASSERT(r->spec.cmd.timeout_ms <= 24u * 3600u * 1000u);
            ASSERT(r->spec.cmd.stdin_data == NULL ||
                   strlen(r->spec.cmd.stdin_data) == r->spec.cmd.stdin_len);
            check_str(r->spec.cmd.tag, 256);
            sp_napi__runspec_free(r);
        }
        break;
    }
    case P_STDIN: {
        const char *data;
        size_t len;
        bool eof;
        rc = sp_napi__body_stdin(b, &data, &len, &eof, &e);
        if (rc == 0)
            ASSERT(data != NULL && (len > 0 || eof || json_object_get(b, "data") != NULL));
        break;
    }
    case P_SIGNAL: {
        int sig;
        bool group;
        rc = sp_napi__body_signal(b, &sig, &group, &e);
        if (rc == 0)
            ASSERT(sig >= 1 && sig <= 64);
        break;
    }
    case P_MKDIR: {
        const char *path, *user;
        uint32_t mode;
        rc = sp_napi__body_mkdir(b, &path, &user, &mode, &e);
        if (rc == 0) {
            ASSERT(path != NULL && path[0] != '\0' && strlen(path) <= SP_EXEC_PATH_MAX);
            ASSERT(mode <= 07777);
            ASSERT(user == NULL || (user[0] != '\0' && strlen(user) <= 63));
        }
        break;
    }
    case P_MOVE: {
        const char *from, *to, *user;
        rc = sp_napi__body_move(b, &from, &to, &user, &e);
        if (rc == 0)
            ASSERT(from != NULL && to != NULL && from[0] != '\0' && to[0] != '\0' &&
                   strlen(from) <= SP_EXEC_PATH_MAX && strlen(to) <= SP_EXEC_PATH_MAX);
        break;
    }
    case P_SESSION: {
        napi_sessspec_t *s = sp_napi__body_session(b, &e);
        rc = s == NULL ? -1 : 0;
        if (s != NULL) {
            check_cmd(&s->spec.cmd);
            ASSERT(s->spec.cmd.cwd == NULL || s->spec.cmd.cwd[0] != '\0');
            ASSERT(s->ttl_s <= 3600);
            sp_napi__sessspec_free(s);
        }
        break;
    }
    case P_CONTEXT: {
        const char *lang = NULL, *cwd = NULL;
        rc = sp_napi__body_context(b, &lang, &cwd, &e);
        if (rc == 0) {
            ASSERT(lang == NULL || sp_code_language(lang) != NULL);
            ASSERT(cwd == NULL || cwd[0] != '\0');
        }
        break;
    }
    case P_EXEC:
    case P_EXEC_CTX: {
        sp_code_exec_req_t r;
        rc = sp_napi__body_exec(b, which == P_EXEC_CTX ? "ctx-1" : NULL, &r, &e);
        if (rc == 0) {
            ASSERT(r.code != NULL && r.code[r.code_len] == '\0');
            ASSERT(r.context_id == NULL || r.language == NULL);
            ASSERT(which == P_EXEC || strcmp(r.context_id, "ctx-1") == 0);
            ASSERT(r.language == NULL || sp_code_language(r.language) != NULL);
            ASSERT(r.timeout_ms <= 24u * 3600u * 1000u);
            ASSERT(r.env == NULL || json_is_object(r.env));
        }
        break;
    }
    case P_SECRET_POST:
    case P_SECRET_PUT: {
        const char *name, *value;
        size_t len;
        rc = sp_napi__body_secret(b, which == P_SECRET_POST, &name, &value, &len, &e);
        if (rc == 0) {
            ASSERT((name != NULL) == (which == P_SECRET_POST));
            ASSERT(value != NULL && len >= 1 && len <= SP_SECRETS_VALUE_MAX);
            for (size_t i = 0; i < len; i++)
                ASSERT((unsigned char)value[i] >= 0x20 && value[i] != 0x7f);
        }
        break;
    }
    case P_CREDENTIALS: {
        json_t *rules;
        rc = sp_napi__body_credentials(b, &rules, &e);
        if (rc == 0) {
            ASSERT(rules != NULL);
            check_rules(rules);
        }
        break;
    }
    case P_EGRESS:
        if (b == NULL || !json_is_object(b))
            break; /* core: "the policy must be a JSON object" */
        check_policy(b);
        break;
    case P_TEAM: {
        const char *name;
        rc = sp_napi__body_team(b, &name, &e);
        if (rc == 0)
            check_whole(name, json_object_get(b, "name"));
        break;
    }
    case P_QUOTA: {
        long limits[SP_ADMIN_NQUOTA];
        rc = sp_napi__body_quota(b, limits, &e);
        for (int i = 0; rc == 0 && i < SP_ADMIN_NQUOTA; i++)
            ASSERT(limits[i] == SP_ADMIN_QUOTA_KEEP || limits[i] == SP_ADMIN_QUOTA_DEFAULT ||
                   (limits[i] >= 0 && limits[i] <= SP_ADMIN_QUOTA_MAX));
        break;
    }
    case P_KEY: {
        const char *name;
        rc = sp_napi__body_key(b, &name, &e);
        if (rc == 0)
            check_str(name, SP_ADMIN_MAX_KEY_NAME);
        break;
    }
    case P_TAG: {
        const char *ver = NULL, *from = NULL;
        rc = sp_napi__body_tag(b, &ver, &from, &e);
        break;
    }
    case P_TMPL_BUILD: /* the route hands the object to core as it is */
        check_tmpl_build(b);
        break;
    }
    if (rc < 0)
        check_err(&e);
    json_decref(b);
}

static void e2b(int which, const char *p, size_t n)
{
    char why[SP_E2B_WHY_MAX] = "";
    int rc = 0;
    if (which == P_E2B_CODE_CONTEXT || which == P_E2B_CODE_EXEC) {
        json_t *o = sp_e2b__code_body(p, n, which == P_E2B_CODE_CONTEXT, why);
        if (o == NULL) {
            check_why(why);
            return;
        }
        ASSERT(json_is_object(o));
        if (which == P_E2B_CODE_CONTEXT) {
            const char *lang = NULL, *cwd = NULL;
            rc = sp_e2b__body_code_context(o, &lang, &cwd, why);
            if (rc == 0)
                ASSERT((lang == NULL || lang[0] != '\0') && (cwd == NULL || cwd[0] != '\0'));
        } else {
            sp_code_exec_req_t r;
            rc = sp_e2b__body_code_exec(o, &r, why);
            if (rc == 0) {
                ASSERT(r.code != NULL && r.code[r.code_len] == '\0');
                ASSERT(r.context_id == NULL || r.language == NULL);
                ASSERT(r.env == NULL || json_object_size(r.env) > 0);
            }
        }
        if (rc < 0)
            check_why(why);
        json_decref(o);
        return;
    }
    json_t *b = NULL;
    int status = 0;
    if (sp_e2b__json_body(p, n, &b, &status, why) < 0) {
        ASSERT(b == NULL && (status == 400 || status == 413));
        check_why(why);
        return;
    }
    ASSERT(b == NULL || json_is_object(b));
    switch (which) {
    case P_E2B_CREATE: {
        sp_create_req_t r = {0};
        rc = sp_e2b__body_template(b, why);
        if (rc == 0) {
            ASSERT(json_string_length(json_object_get(b, "templateID")) > 0);
            rc = sp_e2b__body_create(b, &r, why);
        }
        if (rc == 0) {
            ASSERT(r.timeout_s >= 1 && r.timeout_s <= SP_SVC_MAX_TIMEOUT_S);
            ASSERT(r.allow_internet >= -1 && r.allow_internet <= 1);
            ASSERT(r.network == NULL || json_is_object(r.network));
            sp_err_t e;
            if (sp_svc_check_string_map(r.metadata, "metadata", &e) < 0 ||
                sp_svc_check_string_map(r.env, "env", &e) < 0)
                check_err(&e);
            if (r.egress != NULL)
                check_policy(r.egress);
            json_decref(r.egress);
        }
        break;
    }
    case P_E2B_TIMEOUT:
    case P_E2B_REFRESH: {
        int secs = -1;
        rc = sp_e2b__body_deadline(b, which == P_E2B_REFRESH, &secs, why);
        if (rc == 0)
            ASSERT(secs >= 0 && secs <= SP_SVC_MAX_TIMEOUT_S);
        break;
    }
    case P_E2B_CONNECT:
    case P_E2B_RESUME: {
        int secs;
        char action[16];
        rc = sp_e2b__body_connect(b, which == P_E2B_RESUME, &secs, action, why);
        if (rc == 0)
            ASSERT(secs >= 1 && secs <= SP_SVC_MAX_TIMEOUT_S &&
                   (action[0] == '\0' || strcmp(action, "suspend") == 0 ||
                    strcmp(action, "delete") == 0));
        break;
    }
    case P_E2B_TPL_RESERVE: {
        char alias[65];
        json_t *tags = NULL;
        int cpu = 0, mem = 0;
        rc = sp_e2b__body_template_reserve(b, "team-1", alias, &tags, &cpu, &mem, why);
        if (rc == 0) {
            ASSERT(alias[0] != '\0' && strlen(alias) <= 63);
            for (const char *q = alias; *q; q++)
                ASSERT(!(*q >= 'A' && *q <= 'Z'));
            ASSERT(json_is_array(tags) && json_array_size(tags) >= 1);
            ASSERT(cpu >= -1 && mem >= -1);
        } else {
            ASSERT(tags == NULL);
        }
        json_decref(tags);
        break;
    }
    case P_E2B_TPL_BUILD: {
        json_t *req = NULL;
        rc = sp_e2b__body_template_build(b, "team-1", "my-tpl", 2, 512, &req, why);
        if (rc == 0) {
            ASSERT(json_is_object(req));
            check_tmpl_build(req); /* what the route hands core next */
        } else {
            ASSERT(req == NULL);
        }
        json_decref(req);
        break;
    }
    case P_E2B_SNAPSHOT: {
        char name[SP_SNAP_NAME_MAX + 1];
        rc = sp_e2b__body_snapshot(b, "team-1", name, why);
        if (rc == 0) {
            ASSERT(strlen(name) <= SP_SNAP_NAME_MAX);
            for (const char *q = name; *q; q++)
                ASSERT(!(*q >= 'A' && *q <= 'Z'));
        }
        break;
    }
    }
    if (rc < 0)
        check_why(why);
    json_decref(b);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    if (size < 1)
        return 0;
    int which = data[0] % P_COUNT;
    const char *p = (const char *)data + 1;
    size_t n = size - 1;
    if (which == P_TMPL_BUILD)
        native(which, p, n);
    else if (which >= P_E2B_CREATE)
        e2b(which, p, n);
    else
        native(which, p, n);
    return 0;
}
