/*
 * cmd_template.c - spacectl template list | build.
 *
 * Templates are built on the server's host (spaced template build NAME: a root filesystem
 * from the host's apt sources and a snapshot); the API lists them but cannot build them yet,
 * and build says so instead of pretending.
 */
#include "cli/cmd.h"
#include "cli/table.h"

static const spc_opt_t list_opts[] = {
    {"json", 0, SPC_FLAG, NULL, "print the API's JSON", 0, 0},
    {NULL, 0, 0, NULL, NULL, 0, 0},
};

static const spc_cmd_t list_cmd = {"template list", NULL,
                                   "List the templates sandboxes can be created from.", NULL,
                                   list_opts, NULL, 0, 0, false};

static const spc_opt_t build_opts[] = {
    {NULL, 0, 0, NULL, NULL, 0, 0},
};

static const spc_cmd_t build_cmd = {
    "template build", "NAME", "Build a template (not available through the API yet).",
    "Templates are built on the server's host: spaced template build NAME (specs in\n"
    "templates/NAME/template.json). This command exits with status 2.",
    build_opts, "NAME", 0, 1, false};

static int run_list(spc_args_t *a)
{
    spc_api_t api;
    sp_err_t e;
    json_t *ans;
    if (spc_api(&api) < 0)
        return SPC_EXIT_FAIL;
    if (spc_api_call(&api, "GET", "/v1/templates", NULL, &ans, NULL, &e) < 0)
        return spc_fail(&e);
    if (spc_args_count(a, "json")) {
        int rc = spc_print_json(ans);
        json_decref(ans);
        return rc;
    }
    static const char *const cols[] = {"NAME", "STATUS", "CPUS", "MEMORY", "UPDATED",
                                       "DESCRIPTION"};
    spc_table_t *t = spc_table_new(6, cols);
    size_t i;
    json_t *tp;
    json_array_foreach(json_object_get(ans, "templates"), i, tp)
    {
        char cpu[24], mem[40], num[24], upd[32];
        snprintf(mem, sizeof(mem), "%s MiB", spc_cell(tp, "memory_mb", num, sizeof(num)));
        const char *cells[] = {spc_str(tp, "name"),
                               spc_str(tp, "status"),
                               spc_cell(tp, "cpu_count", cpu, sizeof(cpu)),
                               mem,
                               spc_time(spc_str(tp, "updated_at"), upd, sizeof(upd)),
                               spc_str(tp, "description")};
        if (t != NULL)
            spc_table_add(t, cells);
    }
    if (t != NULL)
        spc_table_print(t, stdout);
    spc_table_free(t);
    json_decref(ans);
    return 0;
}

static int run_build(spc_args_t *a)
{
    fprintf(stderr, "spacectl: building templates through the API is not available yet; build "
                    "%s on the server's host with: spaced template build %s\n",
            a->npos ? a->pos[0] : "a template", a->npos ? a->pos[0] : "NAME");
    return SPC_EXIT_USAGE;
}

const spc_verb_t spc_template_verbs[] = {
    {"list", &list_cmd, run_list},
    {"build", &build_cmd, run_build},
    {NULL, NULL, NULL},
};
