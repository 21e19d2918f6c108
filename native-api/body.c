/*
 * body.c - the native API's request bodies (native-api/body.h): the JSON text, the field
 * helpers, and one parser per body.
 *
 * Every route reads its body with these, so a value of the wrong type gets the same answer
 * everywhere (400, naming the field). Which keys a body may have, and what they mean, is its
 * parser's; what core checks itself (an egress policy, credential rules, a template's
 * metadata) it is handed as JSON. Pure: no h2o, no server state.
 */
#include "native-api/body.h"

#include <stdlib.h>
#include <string.h>

#include "core/control/admin.h"
#include "core/control/snap.h"
#include "core/egress/secrets.h"

#define MAX_TIMEOUT_S (24 * 3600) /* a command's or an execution's */
#define MAX_ATTACH_TTL 3600       /* a session's attach timeout */
#define CWD_MAX 4096u             /* a code context's working directory */

/* ---- the JSON text and its fields ---- */

int sp_napi__json_body(const char *p, size_t n, bool quiet, json_t **out, sp_err_t *err)
{
    *out = NULL;
    if (n > NAPI_MAX_BODY)
        return sp_err_set(err, SP_ETOOBIG, "request body is larger than 1 MiB");
    if (p == NULL || n == 0)
        return 0;
    json_error_t je;
    *out = json_loadb(p, n, JSON_REJECT_DUPLICATES, &je);
    if (*out != NULL)
        return 0;
    /* The parser's text quotes the body near the error: never for bodies with secrets. */
    if (quiet)
        return sp_err_set(err, SP_EINVAL, "malformed JSON (line %d, column %d)", je.line,
                          je.column);
    return sp_err_set(err, SP_EINVAL, "malformed JSON: %.100s", je.text);
}

int sp_napi__body_keys(const json_t *b, const char *const *allowed, bool required, sp_err_t *err)
{
    if (b == NULL)
        return required ? sp_err_set(err, SP_EINVAL, "request body must be a JSON object") : 0;
    const char *k;
    const json_t *v;
    json_object_foreach((json_t *)b, k, v)
    {
        bool ok = false;
        for (int i = 0; allowed[i] != NULL && !ok; i++)
            ok = strcmp(k, allowed[i]) == 0;
        if (!ok)
            return sp_err_set(err, SP_EINVAL, "unknown field '%.64s'", k);
    }
    return 0;
}

json_t *sp_napi__field(const json_t *b, const char *key)
{
    json_t *v = json_object_get(b, key); /* NULL for a NULL or non-object b */
    return v == NULL || json_is_null(v) ? NULL : v;
}

int sp_napi__opt_str(const json_t *b, const char *key, size_t maxlen, const char **out,
                     sp_err_t *err)
{
    json_t *v = sp_napi__field(b, key);
    *out = NULL;
    if (v == NULL)
        return 0;
    if (!json_is_string(v))
        return sp_err_set(err, SP_EINVAL, "%s must be a string", key);
    if (strlen(json_string_value(v)) != json_string_length(v))
        return sp_err_set(err, SP_EINVAL, "%s may not contain NUL characters", key);
    if (json_string_length(v) > maxlen)
        return sp_err_set(err, SP_EINVAL, "%s is longer than %zu bytes", key, maxlen);
    *out = json_string_value(v);
    return 0;
}

json_t *sp_napi__req_string(const json_t *b, const char *key, sp_err_t *err)
{
    json_t *v = json_object_get(b, key);
    if (v == NULL || !json_is_string(v)) {
        sp_err_set(err, SP_EINVAL, "%s is required and must be a string", key);
        return NULL;
    }
    return v;
}

int sp_napi__opt_bool(const json_t *b, const char *key, bool *out, sp_err_t *err)
{
    json_t *v = sp_napi__field(b, key);
    if (v == NULL)
        return 0;
    if (!json_is_boolean(v))
        return sp_err_set(err, SP_EINVAL, "%s must be true or false", key);
    *out = json_is_true(v);
    return 0;
}

int sp_napi__opt_int(const json_t *b, const char *key, int lo, int hi, int *out, sp_err_t *err)
{
    json_t *v = sp_napi__field(b, key);
    if (v == NULL)
        return 0;
    if (!json_is_integer(v) || json_integer_value(v) < lo || json_integer_value(v) > hi)
        return sp_err_set(err, SP_EINVAL, "%s must be an integer from %d to %d", key, lo, hi);
    *out = (int)json_integer_value(v);
    return 0;
}

int sp_napi__signal(const json_t *v)
{
    if (json_is_integer(v))
        return json_integer_value(v) >= 1 && json_integer_value(v) <= 64
                   ? (int)json_integer_value(v)
                   : -1;
    return json_is_string(v) ? sp_exec_signal_number(json_string_value(v)) : -1;
}

/* ---- one parser per body ---- */

int sp_napi__body_none(const json_t *b, sp_err_t *err)
{
    static const char *const none[] = {NULL};
    return sp_napi__body_keys(b, none, false, err);
}

int sp_napi__body_create(const json_t *b, sp_create_req_t *r, sp_err_t *err)
{
    static const char *const allowed[] = {
        "template",  "metadata",        "env",         "idle_timeout_s", "timeout_s", "cpu_count",
        "memory_mb", "deadline_action", "credentials", "egress",         "snapshot",  "placement",
        NULL};
    json_t *t;
    json_t *da = sp_napi__field(b, "deadline_action");
    json_t *snap = sp_napi__field(b, "snapshot");
    if (sp_napi__body_keys(b, allowed, true, err) < 0 ||
        (snap != NULL && !json_is_string(snap)
             ? sp_err_set(err, SP_EINVAL, "snapshot must be a snapshot id (a string)")
             : 0) < 0 ||
        (snap != NULL && sp_napi__field(b, "template") != NULL
             ? sp_err_set(err, SP_EINVAL, "give either template or snapshot, not both")
             : 0) < 0 ||
        (t = snap != NULL ? snap : sp_napi__req_string(b, "template", err)) == NULL ||
        (da != NULL && !json_is_string(da)
             ? sp_err_set(err, SP_EINVAL, "deadline_action must be a string")
             : 0) < 0 ||
        sp_napi__opt_int(b, "idle_timeout_s", 1, SP_SVC_MAX_TIMEOUT_S, &r->idle_timeout_s, err) <
            0 ||
        sp_napi__opt_int(b, "timeout_s", 1, SP_SVC_MAX_TIMEOUT_S, &r->timeout_s, err) < 0 ||
        sp_napi__opt_int(b, "cpu_count", 1, SP_SVC_MAX_CPUS, &r->cpu_count, err) < 0 ||
        sp_napi__opt_int(b, "memory_mb", SP_SVC_MIN_MEMORY_MB, SP_SVC_MAX_MEMORY_MB, &r->memory_mb,
                         err) < 0)
        return -1;
    if (snap != NULL)
        r->snapshot_id = json_string_value(t);
    else
        r->template_name = json_string_value(t);
    r->metadata = sp_napi__field(b, "metadata");
    r->env = sp_napi__field(b, "env");
    r->deadline_action = json_string_value(da); /* NULL when absent */
    if (strlen(json_string_value(t)) != json_string_length(t))
        return sp_err_set(err, SP_EINVAL, "%s may not contain NUL",
                          snap != NULL ? "snapshot" : "template");
    /* The outbound policy and the credential rules are core's to check (a bad rule is a 400
     * naming it), and the secrets the rules name core's to look up. */
    r->egress = sp_napi__field(b, "egress");
    r->credentials = sp_napi__field(b, "credentials");
    /* {"labels": {...}}: the worker it runs on must have them (core checks the labels) */
    json_t *pl = sp_napi__field(b, "placement");
    if (pl != NULL && !json_is_null(pl)) {
        static const char *const pallowed[] = {"labels", NULL};
        if (!json_is_object(pl))
            return sp_err_set(err, SP_EINVAL, "placement must be an object {\"labels\": {...}}");
        if (sp_napi__body_keys(pl, pallowed, false, err) < 0)
            return -1;
        r->placement_labels = sp_napi__field(pl, "labels");
    }
    return 0;
}

int sp_napi__body_snapshot(const json_t *b, const char **name, sp_err_t *err)
{
    static const char *const allowed[] = {"name", NULL};
    *name = NULL;
    if (sp_napi__body_keys(b, allowed, false, err) < 0 ||
        sp_napi__opt_str(b, "name", SP_SNAP_NAME_MAX, name, err) < 0)
        return -1;
    return 0;
}

void sp_napi__runspec_free(void *p)
{
    napi_runspec_t *r = p;
    if (r == NULL)
        return;
    sp_napi__cmdspec_clear(&r->spec);
    free(r);
}

napi_runspec_t *sp_napi__body_run(const json_t *b, bool stream, sp_err_t *err)
{
    static const char *const allowed[] = {"cmd",   "argv",      "env",        "cwd", "user",
                                          "stdin", "timeout_s", "background", "pty", "stream",
                                          "tag",   "rows",      "cols",       NULL};
    const char *in, *tag;
    int timeout_s = 0;
    bool bg = false;
    if (sp_napi__body_keys(b, allowed, true, err) < 0 ||
        sp_napi__opt_str(b, "stdin", NAPI_MAX_BODY, &in, err) < 0 ||
        sp_napi__opt_str(b, "tag", 256, &tag, err) < 0 ||
        sp_napi__opt_int(b, "timeout_s", 1, MAX_TIMEOUT_S, &timeout_s, err) < 0 ||
        sp_napi__opt_bool(b, "background", &bg, err) < 0 ||
        sp_napi__opt_bool(b, "stream", &stream, err) < 0)
        return NULL;
    napi_runspec_t *r = calloc(1, sizeof(*r));
    if (r == NULL) {
        sp_err_set(err, SP_EINTERNAL, "out of memory");
        return NULL;
    }
    if (sp_napi__cmdspec_parse(b, &r->spec, err) < 0) {
        free(r);
        return NULL;
    }
    if (bg && (in != NULL || timeout_s != 0 || stream)) {
        sp_napi__runspec_free(r);
        sp_err_set(err, SP_EINVAL,
                   "background commands take no stdin, timeout_s or stream (use .../stdin)");
        return NULL;
    }
    sp_exec_cmd_t *cmd = &r->spec.cmd;
    cmd->tag = tag ? sp_napi__cmdspec_keep(&r->spec, tag, strlen(tag)) : NULL;
    /* Foreground: stdin is the given text then EOF, else /dev/null (nothing can write to it
     * later). Background: a pipe, written through .../stdin. */
    cmd->stdin_pipe = bg || in != NULL;
    if (in != NULL) {
        cmd->stdin_data = sp_napi__cmdspec_keep(&r->spec, in, strlen(in));
        cmd->stdin_len = strlen(in);
        cmd->stdin_eof = true;
    }
    if ((tag != NULL && cmd->tag == NULL) || (in != NULL && cmd->stdin_data == NULL)) {
        sp_napi__runspec_free(r);
        sp_err_set(err, SP_EINTERNAL, "out of memory");
        return NULL;
    }
    cmd->timeout_ms = (uint32_t)timeout_s * 1000u;
    r->background = bg;
    r->stream = stream;
    return r;
}

int sp_napi__body_stdin(const json_t *b, const char **data, size_t *len, bool *eof, sp_err_t *err)
{
    static const char *const allowed[] = {"data", "eof", NULL};
    json_t *d = sp_napi__field(b, "data");
    *data = "";
    *len = 0;
    *eof = false;
    if (sp_napi__body_keys(b, allowed, true, err) < 0 ||
        sp_napi__opt_bool(b, "eof", eof, err) < 0 ||
        (d != NULL && !json_is_string(d) ? sp_err_set(err, SP_EINVAL, "data must be a string")
                                         : 0) < 0 ||
        (d == NULL && !*eof ? sp_err_set(err, SP_EINVAL, "give data, eof or both") : 0) < 0)
        return -1;
    if (d != NULL) {
        *data = json_string_value(d);
        *len = json_string_length(d);
    }
    return 0;
}

int sp_napi__body_signal(const json_t *b, int *sig, bool *group, sp_err_t *err)
{
    static const char *const allowed[] = {"signal", "group", NULL};
    *group = true;
    *sig = sp_napi__signal(sp_napi__field(b, "signal"));
    if (sp_napi__body_keys(b, allowed, true, err) < 0 ||
        sp_napi__opt_bool(b, "group", group, err) < 0 ||
        (*sig < 0 ? sp_err_set(err, SP_EINVAL,
                               "signal must be a name like \"SIGTERM\" or a number from 1 to 64")
                  : 0) < 0)
        return -1;
    return 0;
}

int sp_napi__check_user(const char *user, sp_err_t *err)
{
    if (user != NULL && (user[0] == '\0' || strlen(user) > 63))
        return sp_err_set(err, SP_EINVAL, "user must be a name of 1 to 63 characters");
    return 0;
}

int sp_napi__parse_mode(const char *s, uint32_t *out, sp_err_t *err)
{
    if (s == NULL)
        return 0;
    char *end;
    unsigned long v = strtoul(s, &end, 8);
    if (s[0] == '\0' || *end != '\0' || v > 07777)
        return sp_err_set(err, SP_EINVAL, "mode must be octal permission bits like 0644");
    *out = (uint32_t)v;
    return 0;
}

int sp_napi__body_mkdir(const json_t *b, const char **path, const char **user, uint32_t *mode,
                        sp_err_t *err)
{
    static const char *const allowed[] = {"path", "user", "mode", NULL};
    json_t *m = sp_napi__field(b, "mode");
    *mode = 0;
    if (sp_napi__body_keys(b, allowed, true, err) < 0 ||
        sp_napi__opt_str(b, "path", SIZE_MAX, path, err) < 0 ||
        sp_napi__opt_str(b, "user", SIZE_MAX, user, err) < 0 ||
        sp_exec_check_path(*path, err) < 0 || sp_napi__check_user(*user, err) < 0)
        return -1;
    if (m != NULL) {
        if (json_is_integer(m) && json_integer_value(m) >= 0 && json_integer_value(m) <= 07777)
            *mode = (uint32_t)json_integer_value(m);
        else if (!json_is_string(m) || sp_napi__parse_mode(json_string_value(m), mode, err) < 0)
            return sp_err_set(err, SP_EINVAL, "mode must be octal permission bits like \"0755\"");
    }
    return 0;
}

int sp_napi__body_move(const json_t *b, const char **from, const char **to, const char **user,
                       sp_err_t *err)
{
    static const char *const allowed[] = {"from", "to", "user", NULL};
    if (sp_napi__body_keys(b, allowed, true, err) < 0 ||
        sp_napi__opt_str(b, "from", SIZE_MAX, from, err) < 0 ||
        sp_napi__opt_str(b, "to", SIZE_MAX, to, err) < 0 ||
        sp_napi__opt_str(b, "user", SIZE_MAX, user, err) < 0 ||
        (*from == NULL || *to == NULL ? sp_err_set(err, SP_EINVAL, "from and to are required")
                                      : 0) < 0 ||
        sp_exec_check_path(*from, err) < 0 || sp_exec_check_path(*to, err) < 0 ||
        sp_napi__check_user(*user, err) < 0)
        return -1;
    return 0;
}

void sp_napi__sessspec_free(void *p)
{
    napi_sessspec_t *sp = p;
    if (sp == NULL)
        return;
    sp_napi__cmdspec_clear(&sp->spec);
    free(sp);
}

napi_sessspec_t *sp_napi__body_session(const json_t *b, sp_err_t *err)
{
    static const char *const allowed[] = {
        "cmd", "argv", "env", "cwd", "user", "pty", "rows", "cols", "attach_timeout_s", NULL};
    int ttl = 0;
    if (sp_napi__body_keys(b, allowed, true, err) < 0 ||
        sp_napi__opt_int(b, "attach_timeout_s", 1, MAX_ATTACH_TTL, &ttl, err) < 0)
        return NULL;
    napi_sessspec_t *sp = calloc(1, sizeof(*sp));
    if (sp == NULL) {
        sp_err_set(err, SP_EINTERNAL, "out of memory");
        return NULL;
    }
    if (sp_napi__cmdspec_parse(b, &sp->spec, err) < 0) {
        free(sp);
        return NULL;
    }
    /* Sessions refuse an empty cwd (a command takes "" as the user's home). */
    if (sp->spec.cmd.cwd != NULL && sp->spec.cmd.cwd[0] == '\0') {
        sp_napi__sessspec_free(sp);
        sp_err_set(err, SP_EINVAL, "cwd is empty");
        return NULL;
    }
    sp->ttl_s = (uint32_t)ttl;
    return sp;
}

static int check_language(const char *lang, sp_err_t *err)
{
    if (lang != NULL && sp_code_language(lang) == NULL)
        return sp_err_set(err, SP_EINVAL, "unsupported language '%.32s' (supported: %s)", lang,
                          SP_CODE_LANGUAGES);
    return 0;
}

int sp_napi__body_context(const json_t *b, const char **language, const char **cwd, sp_err_t *err)
{
    static const char *const allowed[] = {"language", "cwd", NULL};
    if (sp_napi__body_keys(b, allowed, false, err) < 0 ||
        sp_napi__opt_str(b, "language", 64, language, err) < 0 ||
        sp_napi__opt_str(b, "cwd", CWD_MAX, cwd, err) < 0 || check_language(*language, err) < 0 ||
        (*cwd != NULL && (*cwd)[0] == '\0' ? sp_err_set(err, SP_EINVAL, "cwd is empty") : 0) < 0)
        return -1;
    return 0;
}

int sp_napi__body_exec(const json_t *b, const char *path_ctx, sp_code_exec_req_t *req,
                       sp_err_t *err)
{
    static const char *const ctx_keys[] = {"code", "env", "timeout_s", NULL};
    static const char *const top_keys[] = {"code", "language",  "context_id",
                                           "env",  "timeout_s", NULL};
    json_t *code;
    memset(req, 0, sizeof(*req));
    if (sp_napi__body_keys(b, path_ctx != NULL ? ctx_keys : top_keys, true, err) < 0 ||
        (code = sp_napi__req_string(b, "code", err)) == NULL)
        return -1;
    req->code = json_string_value(code);
    req->code_len = json_string_length(code);
    if (path_ctx != NULL) {
        req->context_id = path_ctx;
    } else if (sp_napi__opt_str(b, "language", 64, &req->language, err) < 0 ||
               sp_napi__opt_str(b, "context_id", 256, &req->context_id, err) < 0 ||
               check_language(req->language, err) < 0) {
        return -1;
    }
    if (req->context_id != NULL && req->language != NULL)
        return sp_err_set(err, SP_EINVAL, "give context_id or language, not both");
    json_t *env = sp_napi__field(b, "env");
    if (sp_svc_check_string_map(env, "env", err) < 0)
        return -1;
    req->env = env;
    json_t *t = sp_napi__field(b, "timeout_s");
    if (t != NULL) {
        double s = json_is_number(t) ? json_number_value(t) : -1;
        if (!(s > 0 && s <= MAX_TIMEOUT_S))
            return sp_err_set(err, SP_EINVAL,
                              "timeout_s must be a number of seconds above 0, "
                              "at most %d",
                              MAX_TIMEOUT_S);
        double ms = s * 1000;
        req->timeout_ms = (uint32_t)ms;
        if ((double)req->timeout_ms < ms)
            req->timeout_ms++; /* rounds up: 0.0001 s is 1 ms, not none */
    }
    return 0;
}

int sp_napi__body_secret(const json_t *b, bool named, const char **name, const char **value,
                         size_t *len, sp_err_t *err)
{
    static const char *const with_name[] = {"name", "value", NULL};
    static const char *const value_only[] = {"value", NULL};
    json_t *n = NULL, *v;
    *name = NULL;
    *value = NULL;
    *len = 0;
    if (sp_napi__body_keys(b, named ? with_name : value_only, true, err) < 0 ||
        (named && ((n = sp_napi__req_string(b, "name", err)) == NULL ||
                   sp_secrets_check_name(json_string_value(n), err) < 0)) ||
        (v = sp_napi__req_string(b, "value", err)) == NULL)
        return -1;
    *name = n != NULL ? json_string_value(n) : NULL;
    *value = json_string_value(v);
    *len = json_string_length(v);
    return sp_secrets_check_value(*value, *len, err);
}

int sp_napi__body_credentials(const json_t *b, json_t **rules, sp_err_t *err)
{
    static const char *const allowed[] = {"credentials", NULL};
    *rules = b ? json_object_get(b, "credentials") : NULL;
    if (sp_napi__body_keys(b, allowed, true, err) < 0)
        return -1;
    if (*rules == NULL)
        return sp_err_set(err, SP_EINVAL, "credentials is required (an array, [] for none)");
    return 0;
}

int sp_napi__body_team(const json_t *b, const char **name, sp_err_t *err)
{
    static const char *const allowed[] = {"name", NULL};
    json_t *n;
    if (sp_napi__body_keys(b, allowed, true, err) < 0 ||
        (n = sp_napi__req_string(b, "name", err)) == NULL)
        return -1;
    /* The name check reads a C string: one with a NUL inside would pass as its first part. */
    if (strlen(json_string_value(n)) != json_string_length(n))
        return sp_err_set(err, SP_EINVAL, "name may not contain NUL characters");
    *name = json_string_value(n);
    return 0;
}

int sp_napi__body_quota(const json_t *b, long limits[SP_ADMIN_NQUOTA], sp_err_t *err)
{
    static const char *const allowed[] = {"sandboxes", "vcpus", "memory_mb", "snapshot_mb", NULL};
    if (sp_napi__body_keys(b, allowed, true, err) < 0)
        return -1;
    /* absent: left as it is; null: the server's default; else the limit */
    for (int i = 0; allowed[i] != NULL; i++) {
        json_t *v = json_object_get(b, allowed[i]);
        int l = 0;
        if (v == NULL)
            limits[i] = SP_ADMIN_QUOTA_KEEP;
        else if (json_is_null(v))
            limits[i] = SP_ADMIN_QUOTA_DEFAULT;
        else if (sp_napi__opt_int(b, allowed[i], 0, (int)SP_ADMIN_QUOTA_MAX, &l, err) < 0)
            return -1;
        else
            limits[i] = l;
    }
    return 0;
}

int sp_napi__body_key(const json_t *b, const char **name, sp_err_t *err)
{
    static const char *const allowed[] = {"name", NULL};
    *name = NULL;
    if (sp_napi__body_keys(b, allowed, false, err) < 0 ||
        sp_napi__opt_str(b, "name", SP_ADMIN_MAX_KEY_NAME, name, err) < 0)
        return -1;
    return 0;
}

int sp_napi__body_tag(const json_t *b, const char **version, const char **from_tag, sp_err_t *err)
{
    static const char *const allowed[] = {"version", "from_tag", NULL};
    if (sp_napi__body_keys(b, allowed, true, err) < 0)
        return -1;
    json_t *ver = json_object_get(b, "version"), *from = json_object_get(b, "from_tag");
    if ((ver != NULL && !json_is_string(ver)) || (from != NULL && !json_is_string(from)))
        return sp_err_set(err, SP_EINVAL, "version and from_tag must be strings");
    *version = json_string_value(ver);
    *from_tag = json_string_value(from);
    return 0;
}
