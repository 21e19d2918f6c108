/*
 * body.c - the E2B gateway's JSON request bodies (e2b-gateway/body.h).
 *
 * A field of the wrong type or out of range is a 400 whose message names it, as E2B's API
 * answers. Pure: no h2o, no server state.
 */
#include "e2b-gateway/body.h"

#include <stdio.h>
#include <string.h>
#include <strings.h>

#include "core/control/tmpl.h"
#include "core/egress/egress_policy.h"

/* ---- the control plane ---- */

int sp_e2b__json_body(const char *p, size_t n, json_t **out, int *status, char why[SP_E2B_WHY_MAX])
{
    *out = NULL;
    *status = 400;
    if (p == NULL || n == 0)
        return 0;
    if (n > CTL_MAX_BODY) {
        *status = 413;
        snprintf(why, SP_E2B_WHY_MAX, "request body is larger than 1 MiB");
        return -1;
    }
    json_error_t je;
    json_t *b = json_loadb(p, n, JSON_REJECT_DUPLICATES, &je);
    if (b == NULL) {
        char msg[160];
        snprintf(msg, sizeof(msg), "malformed JSON: %.100s", je.text);
        snprintf(why, SP_E2B_WHY_MAX, "%s", msg);
        return -1;
    }
    if (!json_is_object(b)) {
        json_decref(b);
        snprintf(why, SP_E2B_WHY_MAX, "request body must be a JSON object");
        return -1;
    }
    *out = b;
    return 0;
}

/* Optional integer field in [lo, hi]; absent or null leaves *out. */
static int body_int(const json_t *b, const char *key, int lo, int hi, int *out, bool *present,
                    char why[SP_E2B_WHY_MAX])
{
    json_t *v = b ? json_object_get(b, key) : NULL;
    if (present)
        *present = false;
    if (v == NULL || json_is_null(v))
        return 0;
    if (!json_is_integer(v) || json_integer_value(v) < lo || json_integer_value(v) > hi) {
        char msg[128];
        snprintf(msg, sizeof(msg), "%s must be an integer from %d to %d", key, lo, hi);
        snprintf(why, SP_E2B_WHY_MAX, "%s", msg);
        return -1;
    }
    *out = (int)json_integer_value(v);
    if (present)
        *present = true;
    return 0;
}

static int body_bool(const json_t *obj, const char *key, bool *out, bool *present,
                     char why[SP_E2B_WHY_MAX])
{
    json_t *v = obj ? json_object_get(obj, key) : NULL;
    if (present)
        *present = false;
    if (v == NULL || json_is_null(v))
        return 0;
    if (!json_is_boolean(v)) {
        char msg[96];
        snprintf(msg, sizeof(msg), "%s must be a boolean", key);
        snprintf(why, SP_E2B_WHY_MAX, "%s", msg);
        return -1;
    }
    *out = json_is_true(v);
    if (present)
        *present = true;
    return 0;
}

static json_t *body_obj(const json_t *b, const char *key, bool *bad, char why[SP_E2B_WHY_MAX])
{
    json_t *v = b ? json_object_get(b, key) : NULL;
    *bad = false;
    if (v == NULL || json_is_null(v))
        return NULL;
    if (!json_is_object(v)) {
        char msg[96];
        snprintf(msg, sizeof(msg), "%s must be an object", key);
        snprintf(why, SP_E2B_WHY_MAX, "%s", msg);
        *bad = true;
        return NULL;
    }
    return v;
}

/*
 * E2B's outbound settings as an egress policy (core/egress/egress_policy.h): allow_internet_access
 * false, or ALL_TRAFFIC ("0.0.0.0/0", "::/0") in network.denyOut, turn the internet off so
 * that only network.allowOut opens destinations; other denyOut entries become deny rules,
 * allowOut entries (domains, "*.domain", IPs, CIDRs) allow rules. One difference: E2B lets an
 * allowOut entry override a wider denyOut range; here deny rules always win. NULL (with *bad
 * false) when nothing beyond the default was asked for; on a bad entry why names it.
 */
static json_t *e2b_egress(bool internet, const json_t *network, bool *bad, char why[SP_E2B_WHY_MAX])
{
    *bad = false;
    json_t *allow = json_array(), *deny = json_array();
    static const char *const keys[] = {"allowOut", "denyOut"};
    char msg[256] = "";
    for (int k = 0; k < 2 && network != NULL && msg[0] == '\0'; k++) {
        const json_t *arr = json_object_get(network, keys[k]);
        if (arr == NULL || json_is_null(arr))
            continue;
        if (!json_is_array(arr) || json_array_size(arr) > SP_EGP_MAX_RULES) {
            snprintf(msg, sizeof(msg), "network.%s must be an array of at most %d strings", keys[k],
                     SP_EGP_MAX_RULES);
            break;
        }
        for (size_t i = 0; i < json_array_size(arr) && msg[0] == '\0'; i++) {
            const json_t *v = json_array_get(arr, i);
            const char *t = json_string_value(v);
            sp_egp_rule_t rule;
            sp_err_t e;
            if (t == NULL || strlen(t) != json_string_length(v))
                snprintf(msg, sizeof(msg), "network.%s[%zu] must be a string", keys[k], i);
            else if (sp_egp_rule_parse(t, &rule, &e) < 0)
                snprintf(msg, sizeof(msg), "network.%s[%zu] '%.60s': %.120s", keys[k], i, t, e.msg);
            else if (k == 1 && rule.kind == SP_EGP_R_CIDR && rule.prefix == 0 && rule.port == 0)
                internet = false; /* ALL_TRAFFIC: everything but allowOut */
            else
                json_array_append_new(k == 0 ? allow : deny, json_string(t));
        }
    }
    if (msg[0] != '\0') {
        snprintf(why, SP_E2B_WHY_MAX, "%s", msg);
        *bad = true;
    }
    if (*bad || (internet && json_array_size(allow) == 0 && json_array_size(deny) == 0)) {
        json_decref(allow);
        json_decref(deny);
        return NULL;
    }
    return json_pack("{s:b,s:o,s:o}", "internet", internet, "allow", allow, "deny", deny);
}

int sp_e2b__body_template(const json_t *b, char why[SP_E2B_WHY_MAX])
{
    if (b == NULL) {
        snprintf(why, SP_E2B_WHY_MAX, "request body must be a JSON object");
        return -1;
    }
    json_t *t = json_object_get(b, "templateID");
    if (t == NULL || !json_is_string(t) || json_string_length(t) == 0 ||
        strlen(json_string_value(t)) != json_string_length(t)) {
        snprintf(why, SP_E2B_WHY_MAX, "templateID is required and must be a non-empty string");
        return -1;
    }
    return 0;
}

int sp_e2b__body_create(const json_t *b, sp_create_req_t *r, char why[SP_E2B_WHY_MAX])
{
    int timeout = CTL_DEFAULT_TMO_S;
    bool secure = true, internet = true, internet_set = false, auto_pause = false;
    bool auto_resume = false, bad = false;
    if (body_int(b, "timeout", 0, SP_SVC_MAX_TIMEOUT_S, &timeout, NULL, why) < 0 ||
        body_bool(b, "secure", &secure, NULL, why) < 0 ||
        body_bool(b, "allow_internet_access", &internet, &internet_set, why) < 0 ||
        body_bool(b, "autoPause", &auto_pause, NULL, why) < 0)
        return -1;
    json_t *ar = body_obj(b, "autoResume", &bad, why);
    if (bad || body_bool(ar, "enabled", &auto_resume, NULL, why) < 0)
        return -1;
    json_t *network = body_obj(b, "network", &bad, why);
    if (bad)
        return -1;
    (void)body_obj(b, "mcp", &bad, why); /* accepted; the SDK itself starts the MCP gateway */
    if (bad)
        return -1;
    json_t *vm = json_object_get(b, "volumeMounts");
    if (vm != NULL && !json_is_null(vm) && !(json_is_array(vm) && json_array_size(vm) == 0)) {
        snprintf(why, SP_E2B_WHY_MAX, "volume mounts are not supported");
        return -1;
    }
    json_t *md = json_object_get(b, "metadata");
    json_t *env = json_object_get(b, "envVars");
    r->metadata = md && !json_is_null(md) ? md : NULL;
    r->env = env && !json_is_null(env) ? env : NULL;
    r->timeout_s = timeout == 0 ? CTL_ZERO_TMO_S : timeout;
    /* E2B's timeout governs the lifetime; our idle limit must not cut it short. */
    r->idle_timeout_s = SP_SVC_MAX_TIMEOUT_S;
    r->deadline_action = auto_pause ? "suspend" : "delete";
    r->auto_resume = auto_resume;
    r->allow_internet = internet_set ? (internet ? 1 : -1) : 0;
    r->network = network;
    json_t *egress = e2b_egress(internet, network, &bad, why);
    if (bad)
        return -1;
    r->egress = egress;
    return 0;
}

int sp_e2b__body_deadline(const json_t *b, bool refresh, int *secs, char why[SP_E2B_WHY_MAX])
{
    bool present = false;
    if (!refresh) {
        /* TTL becomes now + timeout: it may shorten. */
        if (body_int(b, "timeout", 0, SP_SVC_MAX_TIMEOUT_S, secs, &present, why) < 0)
            return -1;
        if (!present) {
            snprintf(why, SP_E2B_WHY_MAX, "timeout is required");
            return -1;
        }
        return 0;
    }
    /* A refresh only ever extends. */
    *secs = CTL_REFRESH_S;
    return body_int(b, "duration", 0, CTL_REFRESH_MAX_S, secs, NULL, why);
}

int sp_e2b__body_connect(const json_t *b, bool resume, int *timeout_s, char action[16],
                         char why[SP_E2B_WHY_MAX])
{
    bool present = false, auto_pause = false, ap_present = false;
    *timeout_s = CTL_DEFAULT_TMO_S;
    action[0] = '\0';
    if (body_int(b, "timeout", 0, SP_SVC_MAX_TIMEOUT_S, timeout_s, &present, why) < 0)
        return -1;
    if (!resume && !present) {
        snprintf(why, SP_E2B_WHY_MAX, "timeout is required");
        return -1;
    }
    if (*timeout_s == 0)
        *timeout_s = CTL_ZERO_TMO_S;
    if (resume) {
        if (body_bool(b, "autoPause", &auto_pause, &ap_present, why) < 0)
            return -1;
        if (ap_present)
            snprintf(action, 16, "%s", auto_pause ? "suspend" : "delete");
    }
    return 0;
}

int sp_e2b__body_snapshot(const json_t *b, const char *team_id, char name[SP_SNAP_NAME_MAX + 1],
                          char why[SP_E2B_WHY_MAX])
{
    json_t *nv = b ? json_object_get(b, "name") : NULL;
    name[0] = '\0';
    if (nv == NULL || json_is_null(nv))
        return 0;
    const char *s = json_string_value(nv);
    const char *slash = s ? strchr(s, '/') : NULL;
    sp_err_t e;
    if (s == NULL || strlen(s) != json_string_length(nv)) {
        snprintf(why, SP_E2B_WHY_MAX, "name must be a string");
        return -1;
    }
    if (slash != NULL &&
        ((size_t)(slash - s) != strlen(team_id) || strncasecmp(s, team_id, strlen(team_id)) != 0)) {
        char msg[200];
        snprintf(msg, sizeof msg, "namespace '%.*s' is not this team's ('%s')",
                 (int)(slash - s) > 64 ? 64 : (int)(slash - s), s, team_id);
        snprintf(why, SP_E2B_WHY_MAX, "%s", msg);
        return -1;
    }
    if (sp_snap_norm_name(slash ? slash + 1 : s, name, SP_SNAP_NAME_MAX + 1, &e) < 0) {
        snprintf(why, SP_E2B_WHY_MAX, "%s", e.msg);
        return -1;
    }
    return 0;
}

/* ---- the code interpreter ---- */

json_t *sp_e2b__code_body(const char *p, size_t n, bool empty_ok, char why[SP_E2B_WHY_MAX])
{
    if (p == NULL || n == 0) {
        if (empty_ok)
            return json_object();
        snprintf(why, SP_E2B_WHY_MAX, "the request body must be a JSON object");
        return NULL;
    }
    json_error_t je;
    json_t *o = json_loadb(p, n, 0, &je);
    if (o == NULL || !json_is_object(o)) {
        json_decref(o);
        snprintf(why, SP_E2B_WHY_MAX, "the request body must be a JSON object");
        return NULL;
    }
    return o;
}

/* Optional string member: NULL when absent or null (and, as the real server reads "", when
 * empty if empty_is_null); -1 on another type, or on a NUL character unless len is asked for
 * (a cut name could name something else). */
static int opt_string(const json_t *o, const char *key, bool empty_is_null, const char **out,
                      size_t *len, char why[SP_E2B_WHY_MAX])
{
    json_t *v = json_object_get(o, key);
    *out = NULL;
    if (len != NULL)
        *len = 0;
    if (v == NULL || json_is_null(v))
        return 0;
    if (!json_is_string(v)) {
        snprintf(why, SP_E2B_WHY_MAX, "%.64s must be a string or null", key);
        return -1;
    }
    size_t n = json_string_length(v);
    if (n == 0 && empty_is_null)
        return 0;
    if (len == NULL && memchr(json_string_value(v), '\0', n) != NULL) {
        snprintf(why, SP_E2B_WHY_MAX, "%.64s must not contain NUL characters", key);
        return -1;
    }
    *out = json_string_value(v);
    if (len != NULL)
        *len = n;
    return 0;
}

int sp_e2b__body_code_context(const json_t *o, const char **language, const char **cwd,
                              char why[SP_E2B_WHY_MAX])
{
    *cwd = NULL;
    if (opt_string(o, "language", true, language, NULL, why) < 0 ||
        opt_string(o, "cwd", true, cwd, NULL, why) < 0)
        return -1;
    return 0;
}

int sp_e2b__body_code_exec(const json_t *o, sp_code_exec_req_t *r, char why[SP_E2B_WHY_MAX])
{
    memset(r, 0, sizeof(*r));
    json_t *code = json_object_get(o, "code");
    json_t *env = json_object_get(o, "env_vars");
    const char *msg = NULL;
    if (!json_is_string(code))
        msg = "code must be a string";
    else if (env != NULL && !json_is_null(env) && !json_is_object(env))
        msg = "env_vars must be an object of strings or null";
    if (msg == NULL && json_is_object(env)) {
        const char *k;
        json_t *v;
        json_object_foreach(env, k, v)
        {
            if (!json_is_string(v)) {
                msg = "env_vars must be an object of strings or null";
                break;
            }
        }
    }
    if (msg != NULL) {
        snprintf(why, SP_E2B_WHY_MAX, "%s", msg);
        return -1;
    }
    if (opt_string(o, "context_id", true, &r->context_id, NULL, why) < 0 ||
        opt_string(o, "language", true, &r->language, NULL, why) < 0 ||
        opt_string(o, "code", false, &r->code, &r->code_len, why) < 0)
        return -1;
    if (r->context_id != NULL && r->language != NULL) {
        snprintf(why, SP_E2B_WHY_MAX, "Only one of context_id or language can be provided");
        return -1;
    }
    r->env = json_is_object(env) && json_object_size(env) > 0 ? env : NULL;
    r->timeout_ms = 0; /* the SDK applies its own timeout as a read gap, client side */
    return 0;
}

/* ---- template builds (route_templates.c) ---- */

bool sp_e2b__name_tag(const char *team, const char *in, char out[65], char tag[65], char *why,
                      size_t cap)
{
    const char *slash = strchr(in, '/');
    if (slash != NULL) {
        if ((size_t)(slash - in) != strlen(team) || strncasecmp(in, team, strlen(team)) != 0) {
            snprintf(why, cap, "namespace of '%.64s' is not this team's", in);
            return false;
        }
        in = slash + 1;
    }
    const char *colon = strchr(in, ':');
    size_t n = colon ? (size_t)(colon - in) : strlen(in);
    if (tag != NULL)
        tag[0] = '\0';
    if (colon != NULL) {
        char lower[SP_TMPL_TAG_MAX + 2];
        size_t k = 0;
        for (const char *p = colon + 1; *p && k < sizeof lower - 1; p++)
            lower[k++] = (char)((*p >= 'A' && *p <= 'Z') ? *p + 32 : *p);
        lower[k] = '\0';
        if (!sp_tmpl_valid_tag(lower) || strlen(colon + 1) > SP_TMPL_TAG_MAX) {
            snprintf(why, cap, "bad tag '%.64s': [a-z0-9._-], at most %d, not a UUID", colon + 1,
                     SP_TMPL_TAG_MAX);
            return false;
        }
        if (tag != NULL)
            snprintf(tag, 65, "%.64s", lower);
    }
    if (n == 0 || n > 63) {
        snprintf(why, cap, "bad template name '%.64s'", in);
        return false;
    }
    for (size_t i = 0; i < n; i++)
        out[i] = (char)((in[i] >= 'A' && in[i] <= 'Z') ? in[i] + 32 : in[i]);
    out[n] = '\0';
    return true;
}

int sp_e2b__body_template_reserve(const json_t *b, const char *team, char alias[65],
                                  json_t **tags, int *cpu_count, int *memory_mb,
                                  char why[SP_E2B_WHY_MAX])
{
    *tags = NULL;
    json_t *name = json_object_get(b, "name");
    if (name == NULL)
        name = json_object_get(b, "alias");
    char tag[65], target[140];
    if (!json_is_string(name)) {
        snprintf(why, SP_E2B_WHY_MAX, "name is required");
        return -1;
    }
    if (!sp_e2b__name_tag(team, json_string_value(name), alias, tag, why, SP_E2B_WHY_MAX))
        return -1;
    /* E2B: the name's tag, then tags; none: "default" */
    json_t *given = json_object_get(b, "tags");
    json_t *lower = json_array();
    size_t i;
    json_t *tg;
    json_array_foreach(given, i, tg)
    {
        char l[80];
        size_t k = 0;
        for (const char *p = json_string_value(tg); p && *p && k < sizeof l - 1; p++)
            l[k++] = (char)((*p >= 'A' && *p <= 'Z') ? *p + 32 : *p);
        l[k] = '\0';
        json_array_append_new(lower, json_is_string(tg) ? json_string(l) : json_null());
    }
    snprintf(target, sizeof target, "%s%s%s", alias, tag[0] ? ":" : "", tag);
    sp_err_t te;
    int prc = sp_tmpl_parse_target(target, given != NULL && !json_is_null(given) ? lower : NULL,
                                   alias, tags, &te);
    json_decref(lower);
    if (prc < 0) {
        snprintf(why, SP_E2B_WHY_MAX, "%s", te.msg);
        return -1;
    }
    json_t *cpu = json_object_get(b, "cpuCount"), *mem = json_object_get(b, "memoryMB");
    if ((cpu != NULL && !json_is_integer(cpu)) || (mem != NULL && !json_is_integer(mem))) {
        json_decref(*tags);
        *tags = NULL;
        snprintf(why, SP_E2B_WHY_MAX, "cpuCount and memoryMB must be integers");
        return -1;
    }
    /* the range is tmpl's to check (sp_tmpl_reserve); one past int's is out of it */
    json_int_t cv = json_integer_value(cpu), mv = json_integer_value(mem);
    *cpu_count = cv < 0 || cv > 1000000 ? -1 : (int)cv;
    *memory_mb = mv < 0 || mv > 100000000 ? -1 : (int)mv;
    return 0;
}

/* One E2B step appended to steps as tmpl's; *dir is the workdir so far. NULL or why. */
static const char *add_step(json_t *steps, const json_t *st, char *dir, size_t dcap)
{
    const char *type = json_string_value(json_object_get(st, "type"));
    json_t *args = json_object_get(st, "args");
    size_t n = json_array_size(args);
    for (size_t i = 0; i < n; i++)
        if (!json_is_string(json_array_get(args, i)))
            return "step args must be strings";
    const char *a0 = n > 0 ? json_string_value(json_array_get(args, 0)) : NULL;
    const char *a1 = n > 1 ? json_string_value(json_array_get(args, 1)) : NULL;
    if (type == NULL)
        return "every step needs a type";
    if (strcmp(type, "RUN") == 0) {
        if (a0 == NULL)
            return "RUN needs a command";
        json_t *s = json_pack("{s:[s,s,s,s]}", "run", "/bin/bash", "-l", "-c", a0);
        if (a1 != NULL && a1[0] != '\0')
            json_object_set_new(s, "user", json_string(a1));
        json_array_append_new(steps, s);
    } else if (strcmp(type, "ENV") == 0 || strcmp(type, "ARG") == 0) {
        if (n % 2 != 0 && strcmp(type, "ENV") == 0)
            return "ENV needs name and value pairs";
        json_t *env = json_object();
        for (size_t i = 0; i + 1 <= n; i += 2)
            json_object_set_new(env, json_string_value(json_array_get(args, i)),
                                json_string(i + 1 < n ? json_string_value(json_array_get(args, i + 1))
                                                      : ""));
        if (json_object_size(env) > 0)
            json_array_append_new(steps, json_pack("{s:o}", "env", env));
        else
            json_decref(env);
    } else if (strcmp(type, "WORKDIR") == 0) {
        if (a0 == NULL || a0[0] == '\0')
            return "WORKDIR needs a path";
        char p[4200];
        if (a0[0] == '/')
            snprintf(p, sizeof p, "%s", a0);
        else
            snprintf(p, sizeof p, "%s/%s", dir, a0);
        size_t k = strnlen(p, dcap - 1); /* cut to dir's size, as before */
        memcpy(dir, p, k);
        dir[k] = '\0';
        json_array_append_new(steps, json_pack("{s:s}", "workdir", dir));
    } else if (strcmp(type, "USER") == 0) {
        if (a0 == NULL || a0[0] == '\0')
            return "USER needs a name";
        /* E2B makes the user when it is missing */
        json_array_append_new(steps,
                              json_pack("{s:[s,s,s,s,s],s:s}", "run", "/bin/sh", "-c",
                                        "id -u \"$1\" >/dev/null 2>&1 || useradd --create-home "
                                        "--shell /bin/bash \"$1\"",
                                        "space-user", a0, "user", "root"));
        json_array_append_new(steps, json_pack("{s:s}", "user", a0));
    } else if (strcmp(type, "COPY") == 0 || strcmp(type, "ADD") == 0) {
        /* args: src, dest, user, mode; filesHash: the uploaded tar's key */
        const char *files = json_string_value(json_object_get(st, "filesHash"));
        if (a0 == NULL || a1 == NULL || files == NULL)
            return "COPY needs src, dest and filesHash";
        json_t *c = json_pack("{s:s,s:s,s:s}", "files", files, "src", a0, "dest", a1);
        const char *u = n > 2 ? json_string_value(json_array_get(args, 2)) : NULL;
        const char *m = n > 3 ? json_string_value(json_array_get(args, 3)) : NULL;
        if (u != NULL && u[0] != '\0')
            json_object_set_new(c, "user", json_string(u));
        if (m != NULL && m[0] != '\0')
            json_object_set_new(c, "mode", json_string(m));
        json_array_append_new(steps, json_pack("{s:o}", "copy", c));
    } else {
        return "unknown step type";
    }
    return NULL;
}

int sp_e2b__body_template_build(const json_t *body, const char *team, const char *template_name,
                                int cpu_count, int memory_mb, json_t **out,
                                char why[SP_E2B_WHY_MAX])
{
    *out = NULL;
    char parent[65 + 1 + 65] = ""; /* name[:tag]; stays "" for an image: "from" is replaced */
    json_t *ft = json_object_get(body, "fromTemplate"), *fi = json_object_get(body, "fromImage");
    json_t *from = NULL; /* an image */
    if (json_is_string(ft)) {
        char pname[65], ptag[65];
        if (!sp_e2b__name_tag(team, json_string_value(ft), pname, ptag, why, SP_E2B_WHY_MAX))
            return -1;
        /* a tag: that tag's version (the native build looks it up) */
        snprintf(parent, sizeof parent, "%s%s%s", pname, ptag[0] ? ":" : "", ptag);
    } else if (fi == NULL || json_is_null(fi) ||
               (json_is_string(fi) && strncmp(json_string_value(fi), "e2bdev/base", 11) == 0 &&
                (json_string_value(fi)[11] == '\0' || json_string_value(fi)[11] == ':'))) {
        snprintf(parent, sizeof parent, "base"); /* E2B's base image is our base template */
    } else if (json_is_string(fi)) {
        /* from_image / from_dockerfile: the SDK leaves a Dockerfile's "AS name" on it */
        char ref[512];
        snprintf(ref, sizeof ref, "%.*s", (int)strcspn(json_string_value(fi), " \t"),
                 json_string_value(fi));
        from = json_pack("{s:s}", "image", ref);
        json_t *reg = json_object_get(body, "fromImageRegistry");
        const char *type = json_string_value(json_object_get(reg, "type"));
        if (reg != NULL && !json_is_null(reg)) {
            const char *u = json_string_value(json_object_get(reg, "username"));
            const char *pw = json_string_value(json_object_get(reg, "password"));
            if (type == NULL || strcmp(type, "registry") != 0 || u == NULL || pw == NULL) {
                json_decref(from);
                snprintf(why, SP_E2B_WHY_MAX,
                         "fromImageRegistry: only {\"type\": \"registry\", \"username\", "
                         "\"password\"} is supported on this server (not AWS or GCP registries)");
                return -1;
            }
            json_object_set_new(from, "auth", json_pack("{s:s,s:s}", "username", u, "password", pw));
        }
    } else {
        snprintf(why, SP_E2B_WHY_MAX, "fromImage must be an image reference");
        return -1;
    }
    json_t *req = json_pack("{s:s,s:s,s:i}", "name", template_name, "from", parent,
                            "ready_timeout_s", SP_TMPL_READY_MAX);
    if (from != NULL)
        json_object_set_new(req, "from", from);
    json_t *steps = json_array();
    json_object_set_new(req, "steps", steps);
    if (cpu_count > 0)
        json_object_set_new(req, "cpu_count", json_integer(cpu_count));
    if (memory_mb > 0)
        json_object_set_new(req, "memory_mb", json_integer(memory_mb));
    /* E2B's builder: steps run as user in its home unless they say otherwise */
    char dir[4096] = "/home/user";
    json_array_append_new(steps, json_pack("{s:s}", "user", "user"));
    json_array_append_new(steps, json_pack("{s:s}", "workdir", dir));
    bool force = json_is_true(json_object_get(body, "force"));
    size_t i;
    json_t *st;
    json_array_foreach(json_object_get(body, "steps"), i, st)
    {
        const char *bad = json_is_object(st) ? add_step(steps, st, dir, sizeof dir)
                                             : "every step must be an object";
        if (bad != NULL) {
            snprintf(why, SP_E2B_WHY_MAX, "step %zu: %s", i + 1, bad);
            json_decref(req);
            return -1;
        }
        force = force || json_is_true(json_object_get(st, "force"));
    }
    const char *keys[2][2] = {{"startCmd", "start_cmd"}, {"readyCmd", "ready_cmd"}};
    for (int k = 0; k < 2; k++) {
        json_t *v = json_object_get(body, keys[k][0]);
        if (json_is_string(v) && json_string_length(v) > 0)
            json_object_set_new(req, keys[k][1], json_string(json_string_value(v)));
    }
    if (force)
        json_object_set_new(req, "force", json_true());
    *out = req;
    return 0;
}
