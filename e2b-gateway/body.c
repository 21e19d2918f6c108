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
