/*
 * config.c - the config file, read into command-line arguments.
 */
#include "server/config.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "base/text.h"

const char *sp_config_path(int argc, char **argv, int first, bool *given)
{
    *given = true;
    for (int i = first; i < argc; i++) {
        if (strcmp(argv[i], "--") == 0)
            break;
        if (strcmp(argv[i], "--config") == 0 && i + 1 < argc)
            return argv[i + 1];
        if (strncmp(argv[i], "--config=", 9) == 0)
            return argv[i] + 9;
    }
    const char *env = getenv("SPACE_CONFIG");
    if (env != NULL && env[0] != '\0')
        return env;
    *given = false;
    return SP_CONFIG_DEFAULT_PATH;
}

void sp_config_args_free(sp_config_args_t *a)
{
    for (int i = 0; i < a->argc; i++)
        free(a->argv[i]);
    free(a->argv);
    a->argv = NULL;
    a->argc = 0;
}

/* 1 true, 0 false, -1 neither. */
static int parse_bool(const char *v)
{
    static const char *const yes[] = {"true", "yes", "on", "1"};
    static const char *const no[] = {"false", "no", "off", "0"};
    for (size_t i = 0; i < 4; i++) {
        if (strcasecmp(v, yes[i]) == 0)
            return 1;
        if (strcasecmp(v, no[i]) == 0)
            return 0;
    }
    return -1;
}

static int push(sp_config_args_t *a, char *arg, sp_err_t *err)
{
    char **v = arg != NULL ? realloc(a->argv, (size_t)(a->argc + 1) * sizeof(*v)) : NULL;
    if (v == NULL) {
        free(arg);
        return sp_err_set(err, SP_EINTERNAL, "out of memory");
    }
    a->argv = v;
    a->argv[a->argc++] = arg;
    return 0;
}

/* One `name = value` line into *out; lineno for errors. */
static int parse_line(char *line, int lineno, const struct option *opts, sp_config_args_t *out,
                      sp_err_t *err)
{
    char *s = sp_text_trim(line);
    if (s[0] == '\0' || s[0] == '#')
        return 0;
    char *eq = strchr(s, '=');
    if (eq == NULL)
        return sp_err_set(err, SP_EINVAL, "line %d: expected name = value", lineno);
    *eq = '\0';
    char *name = sp_text_trim(s), *value = sp_text_trim(eq + 1);
    size_t vn = strlen(value);
    bool quoted = vn >= 2 && value[0] == '"' && value[vn - 1] == '"';
    if (quoted) {
        value[vn - 1] = '\0';
        value++;
    } else if (vn >= 1 && value[0] == '"') {
        return sp_err_set(err, SP_EINVAL, "line %d: unterminated quote in %.40s's value", lineno,
                          name);
    }
    const struct option *o = opts;
    while (o->name != NULL && strcmp(o->name, name) != 0)
        o++;
    if (o->name == NULL || strcmp(name, "config") == 0 || strcmp(name, "help") == 0)
        return sp_err_set(err, SP_EINVAL, "line %d: unknown option '%.64s'", lineno, name);
    char *arg = NULL;
    if (o->has_arg == no_argument) {
        int b = parse_bool(value);
        if (b < 0)
            return sp_err_set(err, SP_EINVAL, "line %d: %.64s wants true or false", lineno, name);
        if (b == 0)
            return 0;
        if (asprintf(&arg, "--%s", name) < 0)
            arg = NULL;
    } else if (value[0] == '\0' && !quoted && o->has_arg == required_argument) {
        return sp_err_set(err, SP_EINVAL, "line %d: %.64s needs a value", lineno, name);
    } else if (asprintf(&arg, "--%s=%s", name, value) < 0) {
        arg = NULL;
    }
    return push(out, arg, err);
}

int sp_config_load(const char *path, bool must_exist, const struct option *opts,
                   sp_config_args_t *out, sp_err_t *err)
{
    out->argv = NULL;
    out->argc = 0;
    FILE *f = fopen(path, "re");
    if (f == NULL) {
        if (errno == ENOENT && !must_exist)
            return 0;
        return sp_err_set(err, SP_EINVAL, "cannot read: %s", strerror(errno));
    }
    char *line = NULL;
    size_t cap = 0;
    int lineno = 0, rc = 0;
    while (rc == 0 && getline(&line, &cap, f) >= 0) {
        lineno++;
        if (strlen(line) > 4096)
            rc = sp_err_set(err, SP_EINVAL, "line %d: longer than 4096 bytes", lineno);
        else
            rc = parse_line(line, lineno, opts, out, err);
    }
    if (rc == 0 && ferror(f))
        rc = sp_err_set(err, SP_EINVAL, "read error");
    free(line);
    fclose(f);
    if (rc < 0)
        sp_config_args_free(out);
    return rc;
}
