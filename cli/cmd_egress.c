/*
 * cmd_egress.c - spacectl egress get | set: a sandbox's outbound traffic policy
 * (GET/PUT /v1/sandboxes/{id}/egress/policy).
 *
 * set replaces the whole policy, as the API does: with --json POLICY as given, or built from
 * --internet, --allow and --deny (what is not said takes the API's default: internet on, no
 * rules). A running sandbox's new connections follow it at once.
 */
#include <string.h>

#include "cli/cmd.h"
#include "cli/table.h"

static const spc_opt_t get_opts[] = {
    {"json", 0, SPC_FLAG, NULL, "print the API's JSON", 0, 0},
    {NULL, 0, 0, NULL, NULL, 0, 0},
};

static const spc_cmd_t get_cmd = {"egress get", "ID", "Show a sandbox's outbound policy.", NULL,
                                  get_opts, "ID", 1, 1, false};

static const spc_opt_t set_opts[] = {
    {"json", 0, SPC_STR, "POLICY", "the whole policy as JSON: {\"internet\",\"allow\",\"deny\"}",
     0, 0},
    {"internet", 0, SPC_STR, "on|off", "public destinations allowed (on, the default) or only "
                                       "what --allow names (off)", 0, 0},
    {"allow", 'a', SPC_LIST, "RULE", "allow a host, *.domain, address or CIDR, optionally "
                                     ":port (repeatable)", 0, 0},
    {"deny", 'd', SPC_LIST, "RULE", "deny one (repeatable; deny wins)", 0, 0},
    {NULL, 0, 0, NULL, NULL, 0, 0},
};

static const spc_cmd_t set_cmd = {
    "egress set", "ID (--json POLICY | [--internet on|off] [--allow RULE]... [--deny RULE]...)",
    "Replace a sandbox's outbound policy.",
    "Rules: example.com, *.example.com (subdomains only), 203.0.113.0/24, 2001:db8::/32, * ;\n"
    "each may end in :port. Private, loopback and metadata addresses stay closed unless an\n"
    "address rule names them. The stored policy is printed.\n\n"
    "  spacectl egress set sb123 --internet off --allow api.example.com --allow '*.example.org'",
    set_opts, "ID", 1, 1, false};

static void print_policy(const json_t *p)
{
    sp_buf_t allow = SP_BUF_INIT, deny = SP_BUF_INIT;
    size_t i;
    json_t *r;
    json_array_foreach(json_object_get(p, "allow"), i, r)
        sp_buf_printf(&allow, "%s%s", i ? ", " : "", json_string_value(r));
    json_array_foreach(json_object_get(p, "deny"), i, r)
        sp_buf_printf(&deny, "%s%s", i ? ", " : "", json_string_value(r));
    json_t *inet = json_object_get(p, "internet");
    const char *names[] = {"internet", "allow", "deny"};
    const char *values[] = {json_is_false(inet) ? "off" : "on", sp_buf_cstr(&allow),
                            sp_buf_cstr(&deny)};
    spc_kv_print(stdout, 3, names, values);
    sp_buf_free(&allow);
    sp_buf_free(&deny);
}

static int run_get(spc_args_t *a)
{
    char path[256];
    return spc_show(a, spc_path(path, sizeof(path), "/v1/sandboxes/%s/egress/policy", a->pos[0]),
                    print_policy);
}

static int usage_error(const char *msg)
{
    fprintf(stderr, "spacectl egress set: %s (spacectl egress set --help)\n", msg);
    return SPC_EXIT_USAGE;
}

static int run_set(spc_args_t *a)
{
    const char *js = spc_args_str(a, "json"), *inet = spc_args_str(a, "internet");
    size_t nallow, ndeny;
    const char *const *allow = spc_args_list(a, "allow", &nallow);
    const char *const *deny = spc_args_list(a, "deny", &ndeny);
    bool parts = inet != NULL || nallow > 0 || ndeny > 0;
    if (js != NULL && parts)
        return usage_error("give --json or --internet/--allow/--deny, not both");
    if (js == NULL && !parts)
        return usage_error("give the policy: --json POLICY, or --internet/--allow/--deny");
    json_t *policy;
    if (js != NULL) {
        json_error_t je;
        policy = json_loads(js, JSON_REJECT_DUPLICATES, &je);
        if (!json_is_object(policy)) {
            json_decref(policy);
            fprintf(stderr, "spacectl: --json is not a JSON object: %s\n",
                    policy ? "another JSON value" : je.text);
            return SPC_EXIT_USAGE;
        }
    } else {
        bool on = true;
        if (inet != NULL) {
            if (strcmp(inet, "on") == 0 || strcmp(inet, "true") == 0)
                on = true;
            else if (strcmp(inet, "off") == 0 || strcmp(inet, "false") == 0)
                on = false;
            else
                return usage_error("--internet is on or off");
        }
        json_t *al = json_array(), *dl = json_array();
        for (size_t i = 0; i < nallow; i++)
            json_array_append_new(al, json_string(allow[i]));
        for (size_t i = 0; i < ndeny; i++)
            json_array_append_new(dl, json_string(deny[i]));
        policy = json_pack("{s:b,s:o,s:o}", "internet", on, "allow", al, "deny", dl);
    }
    spc_api_t api;
    sp_err_t e;
    char path[256];
    json_t *stored;
    if (spc_api(&api) < 0) {
        json_decref(policy);
        return SPC_EXIT_FAIL;
    }
    int rc = spc_api_call(&api, "PUT",
                          spc_path(path, sizeof(path), "/v1/sandboxes/%s/egress/policy",
                                   a->pos[0]),
                          policy, &stored, NULL, &e);
    json_decref(policy);
    if (rc < 0)
        return spc_fail(&e);
    print_policy(stored);
    json_decref(stored);
    return 0;
}

const spc_verb_t spc_egress_verbs[] = {
    {"get", &get_cmd, run_get},
    {"set", &set_cmd, run_set},
    {NULL, NULL, NULL},
};
