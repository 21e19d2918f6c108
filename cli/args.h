/*
 * args.h - spacectl's command-line options: one table per command, parsed into values.
 *
 * Accepts --name VALUE, --name=VALUE, -x for one-letter flags, -h/--help everywhere, and
 * "--" to end the options. A command that runs a program (exec) takes everything from "--",
 * or from the first word after its positional arguments, as the program's argv. Knows
 * nothing of HTTP or the API: the commands (cli/cmd.h) read the values.
 */
#ifndef SPC_ARGS_H
#define SPC_ARGS_H

#include <stdbool.h>
#include <stddef.h>
#include <stdio.h>

#include "base/err.h"

#define SPC_MAX_OPTS 16 /* options per command */

typedef enum {
    SPC_FLAG = 0, /* present or not */
    SPC_STR,      /* one value (the last one given wins) */
    SPC_INT,      /* one integer within [min, max] */
    SPC_LIST,     /* repeatable: every value in order */
} spc_optkind_t;

typedef struct {
    const char *name; /* long name without the dashes; NULL ends a table */
    char letter;      /* one-letter form (-q), or 0 */
    spc_optkind_t kind;
    const char *meta; /* the value's name in the help ("MB") */
    const char *help;
    long long min, max; /* SPC_INT */
} spc_opt_t;

typedef struct {
    const char *name;     /* "sandbox create" */
    const char *synopsis; /* what follows the name in the usage line */
    const char *summary;  /* one line: what it does */
    const char *about;    /* more for --help, or NULL */
    const spc_opt_t *opts;
    const char *pos_names; /* positional arguments for messages ("ID", "SRC DST"), or NULL */
    int min_pos, max_pos;  /* positional argument counts */
    bool program;          /* the rest (after "--" or after max_pos positionals) is a program */
} spc_cmd_t;

typedef struct {
    const spc_cmd_t *cmd;
    bool help; /* -h or --help: the caller prints the usage and exits 0 */
    int count[SPC_MAX_OPTS];
    const char *str[SPC_MAX_OPTS];
    long long num[SPC_MAX_OPTS];
    const char **list[SPC_MAX_OPTS]; /* SPC_LIST values (the array is owned, strings borrowed) */
    char **pos;                      /* positional arguments (array owned, strings borrowed) */
    int npos;
    char **rest; /* the program's argv (points into argv), or NULL */
    int nrest;
} spc_args_t;

/* Parses argv[0..argc) (the words after the command's name) into *a; strings stay argv's.
 * -1 with err (a usage error: an unknown option, a missing or malformed value, a wrong number
 * of arguments); *a is then freed. With --help, returns 0 with a->help set and checks nothing
 * else. */
int spc_args_parse(const spc_cmd_t *cmd, int argc, char **argv, spc_args_t *a, sp_err_t *err);
void spc_args_free(spc_args_t *a);

/* How many times the option was given (0: not at all). name must be in the command's table. */
int spc_args_count(const spc_args_t *a, const char *name);
/* The value of an SPC_STR option, or NULL when not given. */
const char *spc_args_str(const spc_args_t *a, const char *name);
/* The value of an SPC_INT option, or dflt when not given. */
long long spc_args_int(const spc_args_t *a, const char *name, long long dflt);
/* The values of an SPC_LIST option, in order; *n gets their count (NULL when none). */
const char *const *spc_args_list(const spc_args_t *a, const char *name, size_t *n);

/* "usage: spacectl <name> <synopsis>", the summary, the about text and the options, to f. */
void spc_args_usage(const spc_cmd_t *cmd, FILE *f);

#endif
