/*
 * config.h - spaced's config file: the command line's long options as `name = value` lines.
 *
 * Generic over the getopt table: every long option is a setting under its own name, so an
 * option added to the table is settable here without a change. The file's settings become
 * "--name=value" arguments placed before the command line's, which therefore wins (getopt
 * keeps the last value). Owns reading and checking the file; does not know what any option
 * means (server.c does).
 *
 * Syntax: one `name = value` per line; blank lines and lines whose first non-blank character
 * is '#' are ignored; spaces around name and value are dropped; a value in double quotes is
 * taken as is, without them (spaces, '#'). Options without an argument take true/false
 * (also yes/no, on/off, 1/0): true passes the flag, false leaves it out. `config` and `help`
 * are not settings.
 */
#ifndef SP_CONFIG_H
#define SP_CONFIG_H

#include <getopt.h>
#include <stdbool.h>

#include "base/err.h"

/* Where spaced looks when neither --config nor $SPACE_CONFIG names a file (a missing file
 * there is fine). Set at build time (SPACE_CONFIG_FILE). */
#ifndef SP_CONFIG_DEFAULT_PATH
#define SP_CONFIG_DEFAULT_PATH "/etc/space/spaced.conf"
#endif

typedef struct {
    char **argv; /* "--name=value" or "--name", in the file's order; owned */
    int argc;
} sp_config_args_t;

/* The file to read: --config FILE (or --config=FILE) in argv[first..], else $SPACE_CONFIG
 * when set and not empty, else SP_CONFIG_DEFAULT_PATH. *given: the caller named it (then it
 * must exist). */
const char *sp_config_path(int argc, char **argv, int first, bool *given);

/* Reads path into *out, checking every name against opts (getopt_long's table, ending in a
 * zero entry). A missing file is an empty one unless must_exist. Errors (SP_EINVAL) say
 * "line N: ..." for a bad line or an unknown name; *out is then empty. */
int sp_config_load(const char *path, bool must_exist, const struct option *opts,
                   sp_config_args_t *out, sp_err_t *err);

void sp_config_args_free(sp_config_args_t *a);

#endif
