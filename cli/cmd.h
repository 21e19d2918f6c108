/*
 * cmd.h - what spacectl's commands share: their tables (one per command group, in
 * cli/cmd_<group>.c), the dispatch by name that reads them (cli/dispatch.c) and the helpers
 * they print and fail with (cli/cmd.c).
 *
 * Exit statuses: 0 done; 1 the operation failed (the server's message on stderr); 2 a usage
 * error, or something spacectl does not offer; exec and shell pass the command's own status
 * through (128 + n for a signal) and use 255 for their own failures.
 */
#ifndef SPC_CMD_H
#define SPC_CMD_H

#include <jansson.h>
#include <stdbool.h>
#include <stdio.h>

#include "base/err.h"
#include "cli/api.h"
#include "cli/args.h"

#define SPC_EXIT_FAIL  1
#define SPC_EXIT_USAGE 2

typedef struct {
    const char *verb;     /* "create"; NULL for a command that is its own group (exec) */
    const spc_cmd_t *cmd; /* its options */
    int (*run)(spc_args_t *a);
} spc_verb_t;

/* NULL-verb-terminated tables, or one entry for a single command. */
extern const spc_verb_t spc_sandbox_verbs[];
extern const spc_verb_t spc_exec_verbs[];
extern const spc_verb_t spc_shell_verbs[];
extern const spc_verb_t spc_cp_verbs[];
extern const spc_verb_t spc_logs_verbs[];
extern const spc_verb_t spc_template_verbs[];
extern const spc_verb_t spc_snapshot_verbs[];
extern const spc_verb_t spc_secrets_verbs[];
extern const spc_verb_t spc_egress_verbs[];
extern const spc_verb_t spc_login_verbs[];

typedef struct {
    const char *name;    /* "sandbox" */
    const char *summary; /* one line for spacectl --help */
    const spc_verb_t *verbs;
} spc_group_t;

/* Every command group, in the order spacectl --help lists them. */
extern const spc_group_t spc_groups[];
extern const size_t spc_ngroups;

/* Runs spacectl with argv[0..argc) (argv[0] is the program's name) and returns its exit
 * status. Help goes to stdout (exit 0); usage errors to stderr (exit SPC_EXIT_USAGE). The
 * program ignores SIGPIPE before calling it. */
int spc_main(int argc, char **argv);

/* "spacectl: <msg>" on stderr; returns SPC_EXIT_FAIL. */
int spc_fail(const sp_err_t *e);
/* printf-style spc_fail. */
int spc_failf(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
/* The API from the settings, or -1 after printing why (no key, bad URL). */
int spc_api(spc_api_t *a);
/* Pretty JSON and a newline on stdout; returns 0 (1 when it could not be written). */
int spc_print_json(const json_t *j);
/* GETs path and prints the answer: its JSON with --json, else through print (a table, a
 * record). The command's exit status (the server's error on stderr). */
int spc_show(const spc_args_t *a, const char *path, void (*print)(const json_t *ans));
/* DELETEs path and prints "<what> <name> deleted". The command's exit status. */
int spc_delete(const char *path, const char *what, const char *name);
/* "K=V" strings into a JSON object of strings (*out, the caller's). -1 with err naming what
 * (--env, --metadata) when one has no '=' or an empty name. */
int spc_kv_object(const char *const *items, size_t n, const char *what, json_t **out,
                  sp_err_t *err);
/* A string member of o, or "" when absent or not a string (for table cells). */
const char *spc_str(const json_t *o, const char *key);
/* A member of o as text for a cell: strings as they are, numbers and booleans formatted,
 * null as "". buf holds the text when it had to be made. */
const char *spc_cell(const json_t *o, const char *key, char *buf, size_t cap);
/* "2024-05-01T12:00:00.123Z" as "2024-05-01 12:00:00" (UTC) for tables. */
const char *spc_time(const char *iso, char *buf, size_t cap);
/* An API path with one percent-encoded id: fmt has one %s. */
const char *spc_path(char *buf, size_t cap, const char *fmt, const char *id);

#endif
