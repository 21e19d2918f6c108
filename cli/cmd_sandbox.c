/*
 * cmd_sandbox.c - spacectl sandbox create | list | get | delete | pause | suspend | wake.
 *
 * Lifecycle calls are asynchronous in the API (202 and an operation): without --wait they
 * print the operation; with it they wait for it (?wait=, then following the operation past
 * the API's 300 s) and print the sandbox as it ended up, failing when the operation failed.
 */
#include <stdlib.h>
#include <string.h>

#include "cli/cmd.h"
#include "cli/table.h"

#define WAIT_PARAM "wait=300"

static const spc_opt_t create_opts[] = {
    {"template", 't', SPC_STR, "T", "template name (default base; see spacectl template list)", 0,
     0},
    {"snapshot", 0, SPC_STR, "ID", "start from this snapshot instead (spacectl snapshot list)", 0,
     0},
    {"cpu", 0, SPC_INT, "N", "vCPUs (1 to 8; default: the template's)", 1, 8},
    {"memory", 0, SPC_INT, "MB", "memory in MiB (128 to 16384; default: the template's)", 128,
     16384},
    {"env", 'e', SPC_LIST, "K=V", "an environment variable for every process (repeatable)", 0, 0},
    {"metadata", 'm', SPC_LIST, "K=V", "a metadata entry (repeatable; list filters on them)", 0, 0},
    {"wait", 'w', SPC_FLAG, NULL, "wait until it runs, then print it", 0, 0},
    {"json", 0, SPC_FLAG, NULL, "print the API's JSON", 0, 0},
    {"quiet", 'q', SPC_FLAG, NULL, "print only the sandbox's ID", 0, 0},
    {NULL, 0, 0, NULL, NULL, 0, 0},
};

static const spc_cmd_t create_cmd = {
    "sandbox create",
    "[--template T | --snapshot ID] [--cpu N] [--memory MB] [--env K=V]... [--metadata K=V]...\n"
    "       [--wait]",
    "Create a sandbox (a microVM) from a template.",
    "Without --wait it prints the create operation and returns at once; the sandbox starts in\n"
    "the background. With --wait it waits until the sandbox runs and prints it; a failed start\n"
    "is reported on stderr with exit status 1. With --snapshot it starts from a snapshot\n"
    "(spacectl snapshot create) with its processes running, and its size.",
    create_opts, NULL, 0, 0, false};

static const spc_opt_t list_opts[] = {
    {"state", 's', SPC_STR, "S", "only these states, comma-separated (running,paused,...)", 0, 0},
    {"metadata", 'm', SPC_LIST, "K=V", "only sandboxes with this metadata (repeatable: all)", 0, 0},
    {"json", 0, SPC_FLAG, NULL, "print the API's JSON", 0, 0},
    {"quiet", 'q', SPC_FLAG, NULL, "print only the IDs", 0, 0},
    {NULL, 0, 0, NULL, NULL, 0, 0},
};

static const spc_cmd_t list_cmd = {
    "sandbox list", "[--state S] [--metadata K=V]...", "List your team's sandboxes.",
    "States: pending, starting, running, pausing, paused, suspending, suspended, waking,\n"
    "stopping, failed (deleted ones only when asked for with --state deleted).",
    list_opts, NULL, 0, 0, false};

static const spc_opt_t get_opts[] = {
    {"json", 0, SPC_FLAG, NULL, "print the API's JSON", 0, 0},
    {NULL, 0, 0, NULL, NULL, 0, 0},
};

static const spc_cmd_t get_cmd = {"sandbox get", "ID", "Show one sandbox.", NULL, get_opts,
                                  "ID", 1, 1, false};

static const spc_opt_t life_opts[] = {
    {"wait", 'w', SPC_FLAG, NULL, "wait for the operation and print the result", 0, 0},
    {"json", 0, SPC_FLAG, NULL, "print the API's JSON", 0, 0},
    {NULL, 0, 0, NULL, NULL, 0, 0},
};

#define LIFE_ABOUT                                                                                 \
    "Without --wait it prints the operation and returns; with --wait it waits for it, prints\n"   \
    "the sandbox as it ended up, and exits 1 when the operation failed."

static const spc_cmd_t delete_cmd = {"sandbox delete", "ID [--wait]",
                                     "Delete a sandbox: its VM stops and its disk is removed.",
                                     LIFE_ABOUT, life_opts, "ID", 1, 1, false};
static const spc_cmd_t pause_cmd = {"sandbox pause", "ID [--wait]",
                                    "Pause a sandbox: its vCPUs stop, its memory stays.",
                                    LIFE_ABOUT, life_opts, "ID", 1, 1, false};
static const spc_cmd_t suspend_cmd = {
    "sandbox suspend", "ID [--wait]",
    "Suspend a sandbox: a durable snapshot is written and its VM released.", LIFE_ABOUT,
    life_opts, "ID", 1, 1, false};
static const spc_cmd_t wake_cmd = {"sandbox wake", "ID [--wait]",
                                   "Wake a paused or suspended sandbox.", LIFE_ABOUT, life_opts,
                                   "ID", 1, 1, false};

/* ---- printing ---- */

static const char *const sb_cols[] = {"ID", "TEMPLATE", "STATE", "CPUS", "MEMORY", "CREATED",
                                      "METADATA"};

/* "k=v,k2=v2" from a metadata object. */
static char *metadata_text(const json_t *md)
{
    sp_buf_t b = SP_BUF_INIT;
    const char *k;
    json_t *v;
    json_object_foreach((json_t *)md, k, v)
    {
        sp_buf_printf(&b, "%s%s=%s", b.len ? "," : "", k,
                      json_is_string(v) ? json_string_value(v) : "?");
    }
    char *s = strdup(sp_buf_cstr(&b));
    sp_buf_free(&b);
    return s;
}

static void sb_row(spc_table_t *t, const json_t *sb)
{
    char cpu[24], mem[32], created[32];
    char *md = metadata_text(json_object_get(sb, "metadata"));
    snprintf(mem, sizeof(mem), "%s MiB", spc_cell(sb, "memory_mb", cpu, sizeof(cpu)));
    const char *cells[] = {spc_str(sb, "id"),
                           spc_str(sb, "template"),
                           spc_str(sb, "state"),
                           spc_cell(sb, "cpu_count", cpu, sizeof(cpu)),
                           mem,
                           spc_time(spc_str(sb, "created_at"), created, sizeof(created)),
                           md};
    spc_table_add(t, cells);
    free(md);
}

static void print_sandboxes(const json_t *arr)
{
    spc_table_t *t = spc_table_new(7, sb_cols);
    if (t == NULL)
        return;
    size_t i;
    json_t *sb;
    json_array_foreach(arr, i, sb) sb_row(t, sb);
    spc_table_print(t, stdout);
    spc_table_free(t);
}

static void print_sandbox_long(const json_t *sb)
{
    char b[8][64];
    char *md = metadata_text(json_object_get(sb, "metadata"));
    const char *names[] = {"id",           "template",        "state",          "desired state",
                           "cpus",         "memory (MiB)",    "created",        "last activity",
                           "idle timeout", "deadline",        "deadline action", "snapshot bytes",
                           "metadata",     "error"};
    char idle[48];
    snprintf(idle, sizeof(idle), "%s s", spc_cell(sb, "idle_timeout_s", b[0], sizeof(b[0])));
    const char *values[] = {spc_str(sb, "id"),
                            spc_str(sb, "template"),
                            spc_str(sb, "state"),
                            spc_str(sb, "desired_state"),
                            spc_cell(sb, "cpu_count", b[1], sizeof(b[1])),
                            spc_cell(sb, "memory_mb", b[2], sizeof(b[2])),
                            spc_time(spc_str(sb, "created_at"), b[3], sizeof(b[3])),
                            spc_time(spc_str(sb, "last_activity_at"), b[4], sizeof(b[4])),
                            idle,
                            spc_time(spc_str(sb, "deadline_at"), b[5], sizeof(b[5])),
                            spc_str(sb, "deadline_action"),
                            spc_cell(sb, "snapshot_bytes", b[6], sizeof(b[6])),
                            md,
                            spc_str(sb, "error")};
    spc_kv_print(stdout, sizeof(names) / sizeof(names[0]), names, values);
    free(md);
}

static void print_operation(const json_t *op)
{
    static const char *const cols[] = {"OPERATION", "SANDBOX", "KIND", "STATUS", "ERROR"};
    spc_table_t *t = spc_table_new(5, cols);
    if (t == NULL)
        return;
    json_t *e = json_object_get(op, "error");
    const char *cells[] = {spc_str(op, "id"), spc_str(op, "sandbox_id"), spc_str(op, "kind"),
                           spc_str(op, "status"), spc_str(e, "message")};
    spc_table_add(t, cells);
    spc_table_print(t, stdout);
    spc_table_free(t);
}

/* The outcome of a lifecycle call: prints it as asked; exit status 1 when its operation
 * failed (waiting first when asked to). */
static int outcome(spc_api_t *api, json_t *ans, spc_args_t *a, bool quiet)
{
    bool json = spc_args_count(a, "json") > 0;
    bool wait = spc_args_count(a, "wait") > 0;
    json_t *res = json_incref(ans);
    const char *st = spc_str(json_object_get(res, "operation"), "status");
    if (wait && strcmp(st, "succeeded") != 0 && strcmp(st, "failed") != 0) {
        sp_err_t e;
        json_decref(res);
        if ((res = spc_api_wait(api, ans, &e)) == NULL)
            return spc_fail(&e);
    }
    json_t *op = json_object_get(res, "operation"), *sb = json_object_get(res, "sandbox");
    bool failed = strcmp(spc_str(op, "status"), "failed") == 0;
    int rc = 0;
    if (json)
        rc = spc_print_json(res);
    else if (quiet)
        printf("%s\n", spc_str(op, "sandbox_id"));
    else if (wait && json_is_object(sb) && !failed) {
        json_t *one = json_pack("[O]", sb);
        print_sandboxes(one);
        json_decref(one);
    } else if (!wait || failed)
        print_operation(op);
    else
        printf("%s %s: %s\n", spc_str(op, "sandbox_id"), spc_str(op, "kind"),
               spc_str(op, "status"));
    if (failed) {
        json_t *e = json_object_get(op, "error");
        rc = spc_failf("%s of %s failed: %s", spc_str(op, "kind"), spc_str(op, "sandbox_id"),
                       json_is_object(e) ? spc_str(e, "message") : "no reason given");
    }
    json_decref(res);
    return rc;
}

/* ---- create ---- */

static int run_create(spc_args_t *a)
{
    sp_err_t e;
    spc_api_t api;
    size_t nenv, nmd;
    const char *const *env = spc_args_list(a, "env", &nenv);
    const char *const *md = spc_args_list(a, "metadata", &nmd);
    json_t *body = json_object(), *o;
    const char *tmpl = spc_args_str(a, "template"), *snap = spc_args_str(a, "snapshot");
    if (tmpl != NULL && snap != NULL) {
        sp_err_set(&e, SP_EINVAL, "give --template or --snapshot, not both");
        goto usage;
    }
    if (snap != NULL)
        json_object_set_new(body, "snapshot", json_string(snap));
    else
        json_object_set_new(body, "template", json_string(tmpl ? tmpl : "base"));
    if (spc_args_count(a, "cpu"))
        json_object_set_new(body, "cpu_count", json_integer(spc_args_int(a, "cpu", 0)));
    if (spc_args_count(a, "memory"))
        json_object_set_new(body, "memory_mb", json_integer(spc_args_int(a, "memory", 0)));
    if (nenv > 0) {
        if (spc_kv_object(env, nenv, "--env", &o, &e) < 0)
            goto usage;
        json_object_set_new(body, "env", o);
    }
    if (nmd > 0) {
        if (spc_kv_object(md, nmd, "--metadata", &o, &e) < 0)
            goto usage;
        json_object_set_new(body, "metadata", o);
    }
    if (spc_api(&api) < 0) {
        json_decref(body);
        return SPC_EXIT_FAIL;
    }
    bool wait = spc_args_count(a, "wait") > 0;
    json_t *ans;
    int rc = spc_api_call(&api, "POST", wait ? "/v1/sandboxes?" WAIT_PARAM : "/v1/sandboxes",
                          body, &ans, NULL, &e);
    json_decref(body);
    if (rc < 0)
        return spc_fail(&e);
    bool quiet = spc_args_count(a, "quiet") > 0;
    rc = outcome(&api, ans, a, quiet);
    json_decref(ans);
    return rc;
usage:
    json_decref(body);
    fprintf(stderr, "spacectl: %s\n", e.msg);
    return SPC_EXIT_USAGE;
}

/* ---- list ---- */

static int run_list(spc_args_t *a)
{
    sp_err_t e;
    spc_api_t api;
    size_t nmd;
    const char *const *md = spc_args_list(a, "metadata", &nmd);
    sp_buf_t filter = SP_BUF_INIT, q = SP_BUF_INIT;
    for (size_t i = 0; i < nmd; i++) {
        if (strchr(md[i], '=') == NULL || md[i][0] == '=' || strchr(md[i], '&') != NULL) {
            sp_buf_free(&filter);
            spc_failf("--metadata wants NAME=VALUE without '&', not '%s'", md[i]);
            return SPC_EXIT_USAGE;
        }
        sp_buf_printf(&filter, "%s%s", i ? "&" : "", md[i]);
    }
    if (spc_api(&api) < 0) {
        sp_buf_free(&filter);
        return SPC_EXIT_FAIL;
    }
    const char *state = spc_args_str(a, "state");
    json_t *all = json_array();
    char *cursor = NULL;
    int rc = 0;
    do {
        sp_buf_reset(&q);
        sp_buf_str(&q, "/v1/sandboxes?limit=1000");
        if (state != NULL) {
            sp_buf_str(&q, "&state=");
            spc_urlencode(&q, state);
        }
        if (nmd > 0) {
            sp_buf_str(&q, "&metadata=");
            spc_urlencode(&q, sp_buf_cstr(&filter));
        }
        if (cursor != NULL) {
            sp_buf_str(&q, "&cursor=");
            spc_urlencode(&q, cursor);
        }
        free(cursor);
        cursor = NULL;
        json_t *page;
        if (spc_api_call(&api, "GET", sp_buf_cstr(&q), NULL, &page, NULL, &e) < 0) {
            rc = spc_fail(&e);
            break;
        }
        json_array_extend(all, json_object_get(page, "sandboxes"));
        const char *next = json_string_value(json_object_get(page, "next_cursor"));
        cursor = next ? strdup(next) : NULL;
        json_decref(page);
    } while (cursor != NULL);
    sp_buf_free(&q);
    sp_buf_free(&filter);
    if (rc == 0) {
        if (spc_args_count(a, "json")) {
            json_t *o = json_pack("{s:O,s:n}", "sandboxes", all, "next_cursor");
            rc = spc_print_json(o);
            json_decref(o);
        } else if (spc_args_count(a, "quiet")) {
            size_t i;
            json_t *sb;
            json_array_foreach(all, i, sb) printf("%s\n", spc_str(sb, "id"));
        } else {
            print_sandboxes(all);
        }
    }
    json_decref(all);
    return rc;
}

/* ---- get ---- */

static int run_get(spc_args_t *a)
{
    char path[256];
    return spc_show(a, spc_path(path, sizeof(path), "/v1/sandboxes/%s", a->pos[0]),
                    print_sandbox_long);
}

/* ---- delete, pause, suspend, wake ---- */

static int lifecycle(spc_args_t *a, const char *method, const char *fmt)
{
    sp_err_t e;
    spc_api_t api;
    char path[256], full[300];
    if (spc_api(&api) < 0)
        return SPC_EXIT_FAIL;
    spc_path(path, sizeof(path), fmt, a->pos[0]);
    bool wait = spc_args_count(a, "wait") > 0;
    snprintf(full, sizeof(full), "%s%s", path, wait ? "?" WAIT_PARAM : "");
    json_t *ans;
    if (spc_api_call(&api, method, full, NULL, &ans, NULL, &e) < 0)
        return spc_fail(&e);
    int rc = outcome(&api, ans, a, false);
    json_decref(ans);
    return rc;
}

static int run_delete(spc_args_t *a)
{
    return lifecycle(a, "DELETE", "/v1/sandboxes/%s");
}

static int run_pause(spc_args_t *a)
{
    return lifecycle(a, "POST", "/v1/sandboxes/%s/pause");
}

static int run_suspend(spc_args_t *a)
{
    return lifecycle(a, "POST", "/v1/sandboxes/%s/suspend");
}

static int run_wake(spc_args_t *a)
{
    return lifecycle(a, "POST", "/v1/sandboxes/%s/wake");
}

const spc_verb_t spc_sandbox_verbs[] = {
    {"create", &create_cmd, run_create},   {"list", &list_cmd, run_list},
    {"get", &get_cmd, run_get},            {"delete", &delete_cmd, run_delete},
    {"pause", &pause_cmd, run_pause},      {"suspend", &suspend_cmd, run_suspend},
    {"wake", &wake_cmd, run_wake},         {NULL, NULL, NULL},
};
