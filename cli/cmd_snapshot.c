/*
 * cmd_snapshot.c - spacectl snapshot create | list | delete: sandbox snapshots ("forks").
 *
 * create takes a snapshot of a running or paused sandbox (POST /v1/sandboxes/{id}/snapshots)
 * and waits until it is ready (?wait=, then following its operation), printing its id;
 * `spacectl sandbox create --snapshot ID` makes sandboxes from it.
 */
#include <stdio.h>
#include <string.h>

#include "cli/api.h"
#include "cli/cmd.h"
#include "cli/table.h"

static const spc_opt_t create_opts[] = {
    {"name", 'n', SPC_STR, "NAME", "an alias for it, unique in your team (alias[:tag])", 0, 0},
    {"no-wait", 0, SPC_FLAG, NULL, "print the operation and return while it is being taken", 0,
     0},
    {"json", 0, SPC_FLAG, NULL, "print the API's JSON", 0, 0},
    {NULL, 0, 0, NULL, NULL, 0, 0},
};

static const spc_cmd_t create_cmd = {
    "snapshot create", "SANDBOX [--name NAME] [--no-wait] [--json]",
    "Snapshot a running or paused sandbox (memory, processes and disk).",
    "The sandbox goes on as it was. Prints the snapshot's id once it is ready; create\n"
    "sandboxes from it with: spacectl sandbox create --snapshot ID",
    create_opts, "SANDBOX", 1, 1, false};

static const spc_opt_t list_opts[] = {
    {"sandbox", 's', SPC_STR, "ID", "only the snapshots of this sandbox", 0, 0},
    {"json", 0, SPC_FLAG, NULL, "print the API's JSON", 0, 0},
    {NULL, 0, 0, NULL, NULL, 0, 0},
};

static const spc_cmd_t list_cmd = {"snapshot list", "[--sandbox ID] [--json]",
                                   "List your team's snapshots, newest first.", NULL, list_opts,
                                   NULL, 0, 0, false};

static const spc_opt_t delete_opts[] = {
    {NULL, 0, 0, NULL, NULL, 0, 0},
};

static const spc_cmd_t delete_cmd = {
    "snapshot delete", "ID", "Delete a snapshot.",
    "Sandboxes already created from it keep running; new ones cannot be made from it.",
    delete_opts, "ID", 1, 1, false};

static int run_create(spc_args_t *a)
{
    spc_api_t api;
    sp_err_t e;
    char path[256], full[300];
    if (spc_api(&api) < 0)
        return SPC_EXIT_FAIL;
    bool wait = spc_args_count(a, "no-wait") == 0;
    spc_path(path, sizeof(path), "/v1/sandboxes/%s/snapshots", a->pos[0]);
    snprintf(full, sizeof(full), "%s%s", path, wait ? "?wait=300" : "");
    json_t *body = json_object(), *ans;
    if (spc_args_str(a, "name") != NULL)
        json_object_set_new(body, "name", json_string(spc_args_str(a, "name")));
    int rc = spc_api_call(&api, "POST", full, body, &ans, NULL, &e);
    json_decref(body);
    if (rc < 0)
        return spc_fail(&e);
    char id[64];
    snprintf(id, sizeof(id), "%s", spc_str(json_object_get(ans, "snapshot"), "id"));
    const char *st = spc_str(json_object_get(ans, "snapshot"), "state");
    if (wait && strcmp(st, "creating") == 0) {
        json_t *res = spc_api_wait(&api, ans, &e);
        json_decref(ans);
        if (res == NULL)
            return spc_fail(&e);
        json_decref(res);
        spc_path(path, sizeof(path), "/v1/snapshots/%s", id);
        json_t *snap;
        if (spc_api_call(&api, "GET", path, NULL, &snap, NULL, &e) < 0)
            return spc_fail(&e);
        ans = json_pack("{s:o}", "snapshot", snap);
    }
    json_t *snap = json_object_get(ans, "snapshot");
    st = spc_str(snap, "state");
    if (spc_args_count(a, "json"))
        rc = spc_print_json(ans);
    else if (strcmp(st, "ready") == 0 || !wait)
        printf("%s%s%s\n", id, wait ? "" : " ", wait ? "" : st);
    if (strcmp(st, "failed") == 0)
        rc = spc_failf("snapshot %s of %s failed: %s", id, a->pos[0], spc_str(snap, "error"));
    json_decref(ans);
    return rc;
}

static void print_snapshots(const json_t *ans)
{
    static const char *const cols[] = {"ID", "NAME", "SANDBOX", "TEMPLATE", "STATE", "CREATED"};
    spc_table_t *t = spc_table_new(6, cols);
    if (t == NULL)
        return;
    size_t i;
    json_t *sn;
    json_array_foreach(json_object_get(ans, "snapshots"), i, sn)
    {
        char created[32];
        const char *cells[] = {spc_str(sn, "id"),       spc_str(sn, "name"),
                               spc_str(sn, "sandbox_id"), spc_str(sn, "template"),
                               spc_str(sn, "state"),
                               spc_time(spc_str(sn, "created_at"), created, sizeof(created))};
        spc_table_add(t, cells);
    }
    spc_table_print(t, stdout);
    spc_table_free(t);
}

static int run_list(spc_args_t *a)
{
    char path[256] = "/v1/snapshots?limit=1000";
    if (spc_args_str(a, "sandbox") != NULL)
        spc_path(path, sizeof(path), "/v1/snapshots?limit=1000&sandbox_id=%s",
                 spc_args_str(a, "sandbox"));
    return spc_show(a, path, print_snapshots);
}

static int run_delete(spc_args_t *a)
{
    char path[256];
    return spc_delete(spc_path(path, sizeof(path), "/v1/snapshots/%s", a->pos[0]), "snapshot",
                      a->pos[0]);
}

const spc_verb_t spc_snapshot_verbs[] = {
    {"create", &create_cmd, run_create},
    {"list", &list_cmd, run_list},
    {"delete", &delete_cmd, run_delete},
    {NULL, NULL, NULL},
};
