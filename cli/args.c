/*
 * args.c - parsing a command's options and arguments against its table (args.h).
 *
 * Owns the arrays it allocates (positionals, list values); every string stays argv's.
 */
#include "cli/args.h"

#include <assert.h>
#include <errno.h>
#include <stdlib.h>
#include <string.h>

static int nopts(const spc_cmd_t *cmd)
{
    int n = 0;
    while (cmd->opts != NULL && cmd->opts[n].name != NULL)
        n++;
    /* The tables are ours: a command with more options than the arrays hold is our bug. */
    assert(n <= SPC_MAX_OPTS);
    return n;
}

static int find_long(const spc_cmd_t *cmd, const char *name, size_t len)
{
    for (int i = 0; i < nopts(cmd); i++)
        if (strlen(cmd->opts[i].name) == len && memcmp(cmd->opts[i].name, name, len) == 0)
            return i;
    return -1;
}

static int find_letter(const spc_cmd_t *cmd, char c)
{
    for (int i = 0; i < nopts(cmd); i++)
        if (cmd->opts[i].letter != 0 && cmd->opts[i].letter == c)
            return i;
    return -1;
}

static int index_of(const spc_args_t *a, const char *name)
{
    int i = find_long(a->cmd, name, strlen(name));
    /* Commands ask only for options in their own table. */
    assert(i >= 0);
    return i;
}

static int push(char ***arr, int *n, char *s)
{
    char **na = realloc(*arr, sizeof(char *) * (size_t)(*n + 1));
    if (na == NULL)
        return -1;
    na[(*n)++] = s;
    *arr = na;
    return 0;
}

/* Stores one option's value. */
static int take(spc_args_t *a, int i, const char *shown, const char *val, sp_err_t *err)
{
    const spc_opt_t *o = &a->cmd->opts[i];
    a->count[i]++;
    switch (o->kind) {
    case SPC_FLAG:
        return 0;
    case SPC_STR:
        a->str[i] = val;
        return 0;
    case SPC_INT: {
        char *end;
        errno = 0;
        long long v = strtoll(val, &end, 10);
        if (val[0] == '\0' || *end != '\0' || errno != 0)
            return sp_err_set(err, SP_EINVAL, "%s: '%.40s' is not a whole number", shown, val);
        if (v < o->min || v > o->max)
            return sp_err_set(err, SP_EINVAL, "%s must be from %lld to %lld", shown, o->min,
                              o->max);
        a->num[i] = v;
        return 0;
    }
    case SPC_LIST: {
        int n = a->count[i] - 1;
        const char **nl = realloc(a->list[i], sizeof(char *) * (size_t)(n + 1));
        if (nl == NULL)
            return sp_err_set(err, SP_EINTERNAL, "out of memory");
        nl[n] = val;
        a->list[i] = nl;
        return 0;
    }
    }
    return 0;
}

static int parse_opts(const spc_cmd_t *cmd, int argc, char **argv, spc_args_t *a, sp_err_t *err)
{
    int k = 0;
    for (; k < argc; k++) {
        char *s = argv[k];
        if (strcmp(s, "-h") == 0 || strcmp(s, "--help") == 0) {
            a->help = true;
            return 0;
        }
        if (strcmp(s, "--") == 0) {
            k++;
            break;
        }
        if (s[0] != '-' || s[1] == '\0') { /* a positional argument ("-" is one too) */
            if (cmd->program && a->npos == cmd->max_pos)
                break; /* the program starts here */
            if (push(&a->pos, &a->npos, s) < 0)
                return sp_err_set(err, SP_EINTERNAL, "out of memory");
            continue;
        }
        int i;
        const char *val = NULL;
        char shown[48];
        if (s[1] == '-') {
            const char *name = s + 2, *eq = strchr(name, '=');
            size_t len = eq ? (size_t)(eq - name) : strlen(name);
            i = find_long(cmd, name, len);
            snprintf(shown, sizeof(shown), "--%.*s", (int)(len > 40 ? 40 : len), name);
            if (i < 0)
                return sp_err_set(err, SP_EINVAL, "unknown option %s", shown);
            if (eq != NULL) {
                if (cmd->opts[i].kind == SPC_FLAG)
                    return sp_err_set(err, SP_EINVAL, "%s takes no value", shown);
                val = eq + 1;
            }
        } else {
            i = s[2] == '\0' ? find_letter(cmd, s[1]) : -1;
            snprintf(shown, sizeof(shown), "%.40s", s);
            if (i < 0)
                return sp_err_set(err, SP_EINVAL, "unknown option %s", shown);
        }
        if (cmd->opts[i].kind != SPC_FLAG && val == NULL) {
            if (k + 1 >= argc)
                return sp_err_set(err, SP_EINVAL, "%s needs a value (%s)", shown,
                                  cmd->opts[i].meta ? cmd->opts[i].meta : "VALUE");
            val = argv[++k];
        }
        if (take(a, i, shown, val, err) < 0)
            return -1;
    }
    if (k < argc) {
        if (cmd->program) {
            a->rest = argv + k;
            a->nrest = argc - k;
        } else {
            for (; k < argc; k++) /* after "--": positional, even when they start with '-' */
                if (push(&a->pos, &a->npos, argv[k]) < 0)
                    return sp_err_set(err, SP_EINTERNAL, "out of memory");
        }
    }
    const char *names = cmd->pos_names ? cmd->pos_names : "arguments";
    if (a->npos < cmd->min_pos)
        return sp_err_set(err, SP_EINVAL, "missing %s", names);
    if (a->npos > cmd->max_pos)
        return sp_err_set(err, SP_EINVAL, "unexpected argument '%.60s'", a->pos[cmd->max_pos]);
    if (cmd->program && a->nrest == 0)
        return sp_err_set(err, SP_EINVAL, "missing the command to run (after --)");
    return 0;
}

/* A usage error does not hide --help: asking for help anywhere before "--" shows it. */
static int parse(const spc_cmd_t *cmd, int argc, char **argv, spc_args_t *a, sp_err_t *err)
{
    if (parse_opts(cmd, argc, argv, a, err) == 0)
        return 0;
    for (int k = 0; k < argc && strcmp(argv[k], "--") != 0; k++) {
        if (strcmp(argv[k], "-h") == 0 || strcmp(argv[k], "--help") == 0) {
            a->help = true;
            return 0;
        }
    }
    return -1;
}

int spc_args_parse(const spc_cmd_t *cmd, int argc, char **argv, spc_args_t *a, sp_err_t *err)
{
    memset(a, 0, sizeof(*a));
    a->cmd = cmd;
    if (parse(cmd, argc, argv, a, err) < 0) {
        spc_args_free(a);
        return -1;
    }
    return 0;
}

void spc_args_free(spc_args_t *a)
{
    for (int i = 0; i < SPC_MAX_OPTS; i++) {
        free(a->list[i]);
        a->list[i] = NULL;
    }
    free(a->pos);
    a->pos = NULL;
    a->npos = 0;
}

int spc_args_count(const spc_args_t *a, const char *name)
{
    return a->count[index_of(a, name)];
}

const char *spc_args_str(const spc_args_t *a, const char *name)
{
    return a->str[index_of(a, name)];
}

long long spc_args_int(const spc_args_t *a, const char *name, long long dflt)
{
    int i = index_of(a, name);
    return a->count[i] ? a->num[i] : dflt;
}

const char *const *spc_args_list(const spc_args_t *a, const char *name, size_t *n)
{
    int i = index_of(a, name);
    *n = (size_t)a->count[i];
    return a->list[i];
}

void spc_args_usage(const spc_cmd_t *cmd, FILE *f)
{
    fprintf(f, "usage: spacectl %s%s%s\n", cmd->name, cmd->synopsis ? " " : "",
            cmd->synopsis ? cmd->synopsis : "");
    if (cmd->summary != NULL)
        fprintf(f, "\n%s\n", cmd->summary);
    if (cmd->about != NULL)
        fprintf(f, "\n%s\n", cmd->about);
    fprintf(f, "\noptions:\n");
    for (int i = 0; i < nopts(cmd); i++) {
        const spc_opt_t *o = &cmd->opts[i];
        char left[64];
        int n = 0;
        if (o->letter)
            n = snprintf(left, sizeof(left), "-%c, ", o->letter);
        snprintf(left + n, sizeof(left) - (size_t)n, "--%s%s%s", o->name, o->meta ? " " : "",
                 o->meta ? o->meta : "");
        fprintf(f, "  %-22s %s\n", left, o->help);
    }
    fprintf(f, "  %-22s %s\n", "-h, --help", "this help");
}
