/*
 * cmd_logs.c - spacectl logs: a sandbox's lifecycle events (GET /v1/sandboxes/{id}/events).
 *
 * --follow asks again every second from the last event's time and prints the ids it has not
 * printed (the API's since is inclusive, in milliseconds), until the sandbox is gone (its
 * events go with it: the API answers 404 for a deleted sandbox) or we are interrupted.
 */
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "cli/cmd.h"
#include "cli/table.h"

#define POLL_MS 1000

static const spc_opt_t logs_opts[] = {
    {"follow", 'f', SPC_FLAG, NULL, "keep printing new events until the sandbox is deleted", 0, 0},
    {"json", 0, SPC_FLAG, NULL, "print the API's JSON (with --follow: one event per line)", 0, 0},
    {NULL, 0, 0, NULL, NULL, 0, 0},
};

static const spc_cmd_t logs_cmd = {
    "logs", "ID [--follow]", "A sandbox's lifecycle events, oldest first.",
    "Events: created, requested (pause, suspend, wake, delete...), the controller's actions\n"
    "(boot, pause, resume, suspend, restore, destroy) and their outcomes (action_done,\n"
    "action_failed with the reason), idle and deadline expiries. Times are UTC.",
    logs_opts, "ID", 1, 1, false};

static void print_event(const json_t *ev)
{
    char t[32];
    char *kind = spc_table_cell(spc_str(ev, "kind"));
    char *detail = spc_table_cell(spc_str(ev, "detail"));
    printf("%-19s  %-14s  %s\n", spc_time(spc_str(ev, "at"), t, sizeof(t)), kind ? kind : "",
           detail ? detail : "");
    free(kind);
    free(detail);
}

static int run_logs(spc_args_t *a)
{
    spc_api_t api;
    sp_err_t e;
    if (spc_api(&api) < 0)
        return SPC_EXIT_FAIL;
    bool follow = spc_args_count(a, "follow") > 0, json = spc_args_count(a, "json") > 0;
    char base[256], path[320];
    spc_path(base, sizeof(base), "/v1/sandboxes/%s/events", a->pos[0]);
    long long last_id = -1, since = 0;
    bool first = true;
    for (;;) {
        snprintf(path, sizeof(path), "%s?limit=10000&since=%lld", base, since);
        json_t *ans;
        int status;
        if (spc_api_call(&api, "GET", path, NULL, &ans, &status, &e) < 0) {
            if (!first && status == 404) {
                fprintf(stderr, "spacectl: sandbox %s is gone\n", a->pos[0]);
                return 0;
            }
            return spc_fail(&e);
        }
        json_t *events = json_object_get(ans, "events");
        if (json && !follow) {
            int rc = spc_print_json(ans);
            json_decref(ans);
            return rc;
        }
        if (first && !json)
            printf("%-19s  %-14s  %s\n", "TIME", "KIND", "DETAIL");
        size_t i;
        json_t *ev;
        json_array_foreach(events, i, ev)
        {
            long long id = json_integer_value(json_object_get(ev, "id"));
            if (id <= last_id)
                continue; /* printed in an earlier answer (the same millisecond) */
            last_id = id;
            since = json_integer_value(json_object_get(ev, "at_ms"));
            if (json) {
                json_dumpf(ev, stdout, JSON_COMPACT | JSON_PRESERVE_ORDER);
                fputc('\n', stdout);
            } else {
                print_event(ev);
            }
        }
        json_decref(ans);
        first = false;
        if (!follow)
            return 0;
        if (fflush(stdout) != 0)
            return SPC_EXIT_FAIL; /* nobody reads us any more */
        struct timespec ts = {POLL_MS / 1000, (POLL_MS % 1000) * 1000000L};
        nanosleep(&ts, NULL);
    }
}

const spc_verb_t spc_logs_verbs[] = {{NULL, &logs_cmd, run_logs}};
