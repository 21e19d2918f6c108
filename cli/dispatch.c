/*
 * dispatch.c - spacectl's commands by name (cmd.h): finds the command group and verb, parses
 * its options (cli/args.h), prints the help asked for, and runs it (cli/cmd_<group>.c).
 */
#include <stdio.h>
#include <string.h>

#include "cli/cmd.h"

const spc_group_t spc_groups[] = {
    {"sandbox", "create, list, show, pause, suspend, wake and delete sandboxes",
     spc_sandbox_verbs},
    {"exec", "run a command in a sandbox (its output, stdin and exit status pass through)",
     spc_exec_verbs},
    {"shell", "an interactive shell in a sandbox", spc_shell_verbs},
    {"cp", "copy files and directories into and out of a sandbox", spc_cp_verbs},
    {"logs", "a sandbox's lifecycle events", spc_logs_verbs},
    {"template", "the templates sandboxes are made from", spc_template_verbs},
    {"snapshot", "snapshots of running sandboxes, to create more from (forks)",
     spc_snapshot_verbs},
    {"secrets", "team secrets for credential injection", spc_secrets_verbs},
    {"egress", "a sandbox's outbound traffic policy", spc_egress_verbs},
    {"login", "save the server's URL and an API key", spc_login_verbs},
};

const size_t spc_ngroups = sizeof(spc_groups) / sizeof(spc_groups[0]);

static void usage(FILE *f)
{
    fprintf(f, "usage: spacectl COMMAND [ARGS...]\n\n"
               "The command-line client of space's native API.\n\ncommands:\n");
    for (size_t i = 0; i < spc_ngroups; i++)
        fprintf(f, "  %-10s %s\n", spc_groups[i].name, spc_groups[i].summary);
    fprintf(f, "\n"
               "'spacectl COMMAND --help' shows a command's options.\n\n"
               "The server and key: SPACE_API_URL and SPACE_API_KEY, else the config file\n"
               "($XDG_CONFIG_HOME/space/config or ~/.config/space/config, written by spacectl\n"
               "login), else a local spaced: http://127.0.0.1:3000 with the key in\n"
               "<data-dir>/api-key ($SPACE_DATA_DIR, /var/lib/space as root, else\n"
               "~/.local/share/space). SPACE_CA_FILE names CA certificates for https.\n");
}

static bool single(const spc_group_t *g)
{
    return g->verbs[0].verb == NULL;
}

static void group_usage(const spc_group_t *g, FILE *f)
{
    fprintf(f, "usage: spacectl %s VERB [ARGS...]\n\n%s.\n\nverbs:\n", g->name, g->summary);
    for (const spc_verb_t *v = g->verbs; v->verb != NULL; v++)
        fprintf(f, "  %-8s %s\n", v->verb, v->cmd->summary);
    fprintf(f, "\n'spacectl %s VERB --help' shows a verb's options.\n", g->name);
}

static bool is_help(const char *s)
{
    return strcmp(s, "-h") == 0 || strcmp(s, "--help") == 0 || strcmp(s, "help") == 0;
}

int spc_main(int argc, char **argv)
{
    if (argc < 2) {
        usage(stderr);
        return SPC_EXIT_USAGE;
    }
    if (is_help(argv[1])) {
        usage(stdout);
        return 0;
    }
    const spc_group_t *g = NULL;
    for (size_t i = 0; i < spc_ngroups && g == NULL; i++)
        if (strcmp(argv[1], spc_groups[i].name) == 0)
            g = &spc_groups[i];
    if (g == NULL) {
        fprintf(stderr, "spacectl: unknown command '%s' (spacectl --help lists them)\n", argv[1]);
        return SPC_EXIT_USAGE;
    }
    const spc_verb_t *v = NULL;
    int first = 2;
    if (single(g)) {
        v = &g->verbs[0];
    } else {
        if (argc < 3 || is_help(argv[2])) {
            group_usage(g, argc < 3 ? stderr : stdout);
            return argc < 3 ? SPC_EXIT_USAGE : 0;
        }
        for (const spc_verb_t *x = g->verbs; x->verb != NULL && v == NULL; x++)
            if (strcmp(argv[2], x->verb) == 0)
                v = x;
        if (v == NULL) {
            fprintf(stderr, "spacectl: unknown verb '%s %s' (spacectl %s --help lists them)\n",
                    g->name, argv[2], g->name);
            return SPC_EXIT_USAGE;
        }
        first = 3;
    }
    spc_args_t a;
    sp_err_t e;
    if (spc_args_parse(v->cmd, argc - first, argv + first, &a, &e) < 0) {
        fprintf(stderr, "spacectl %s: %s (spacectl %s --help)\n", v->cmd->name, e.msg,
                v->cmd->name);
        return SPC_EXIT_USAGE;
    }
    int rc;
    if (a.help) {
        spc_args_usage(v->cmd, stdout);
        rc = 0;
    } else {
        rc = v->run(&a);
    }
    spc_args_free(&a);
    if (fflush(stdout) != 0 && rc == 0)
        rc = SPC_EXIT_FAIL; /* the output did not get where it was going */
    return rc;
}
