/*
 * cmdspec.c - the process a POST .../commands or .../sessions body describes (body.h).
 *
 * One parser for both routes, so a command is the same thing in both: cmd (a shell line)
 * or argv, env, cwd, user, pty and its size. The fields only one route has (stdin,
 * timeout_s, background, stream, tag; attach_timeout_s) and the list of allowed keys stay
 * with the route. The result's strings are copies: the command outlives the request body
 * (it is started after the sandbox lookup, or at the session's first attach).
 */
#include <stdlib.h>
#include <string.h>

#include "native-api/body.h"

#define CMD_MAX  (256 * 1024) /* bytes in a shell line */
#define USER_MAX 63

void sp_napi__cmdspec_clear(napi_cmdspec_t *s)
{
    for (size_t i = 0; i < s->nstrs; i++)
        free(s->strs[i]);
    free(s->strs);
    free((void *)s->cmd.argv);
    free((void *)s->cmd.env);
    memset(s, 0, sizeof(*s));
}

/* Takes str (malloc'd) into s; NULL (and str freed) when out of memory. */
static char *own(napi_cmdspec_t *s, char *str)
{
    if (str != NULL && s->nstrs == s->cap) {
        size_t cap = s->cap ? s->cap * 2 : 8;
        char **n = realloc(s->strs, cap * sizeof(*n));
        if (n == NULL) {
            free(str);
            return NULL;
        }
        s->strs = n;
        s->cap = cap;
    }
    if (str != NULL)
        s->strs[s->nstrs++] = str;
    return str;
}

const char *sp_napi__cmdspec_keep(napi_cmdspec_t *s, const char *p, size_t n)
{
    char *d = malloc(n + 1);
    if (d != NULL) {
        memcpy(d, p, n);
        d[n] = '\0';
    }
    return own(s, d);
}

/* Copies a string that may be NULL; -1 when out of memory. */
static int keep_opt(napi_cmdspec_t *s, const char *p, const char **out, sp_err_t *err)
{
    *out = p != NULL ? sp_napi__cmdspec_keep(s, p, strlen(p)) : NULL;
    return p != NULL && *out == NULL ? sp_err_set(err, SP_EINTERNAL, "out of memory") : 0;
}

/* argv: 1..SP_AP_MAX_ARGV strings without NUL. */
static int parse_argv(napi_cmdspec_t *s, const json_t *argv, sp_err_t *err)
{
    size_t n = json_array_size(argv);
    const char **av = calloc(n, sizeof(*av));
    if (av == NULL)
        return sp_err_set(err, SP_EINTERNAL, "out of memory");
    s->cmd.argv = av;
    for (size_t i = 0; i < n; i++) {
        json_t *a = json_array_get(argv, i);
        if (!json_is_string(a) || strlen(json_string_value(a)) != json_string_length(a))
            return sp_err_set(err, SP_EINVAL, "argv must hold strings without NUL characters");
        if ((av[i] = sp_napi__cmdspec_keep(s, json_string_value(a), json_string_length(a))) == NULL)
            return sp_err_set(err, SP_EINTERNAL, "out of memory");
    }
    s->cmd.argc = n;
    return 0;
}

/* env (checked as a string map): "K=V" strings. */
static int parse_env(napi_cmdspec_t *s, const json_t *env, sp_err_t *err)
{
    const char **ev = calloc(json_object_size(env) + 1, sizeof(*ev));
    if (ev == NULL)
        return sp_err_set(err, SP_EINTERNAL, "out of memory");
    s->cmd.env = ev;
    const char *k;
    json_t *v;
    json_object_foreach((json_t *)env, k, v)
    {
        if (strchr(k, '=') != NULL)
            return sp_err_set(err, SP_EINVAL, "env names may not contain '='");
        size_t kl = strlen(k), vl = json_string_length(v);
        char *kv = own(s, malloc(kl + vl + 2));
        if (kv == NULL)
            return sp_err_set(err, SP_EINTERNAL, "out of memory");
        memcpy(kv, k, kl);
        kv[kl] = '=';
        memcpy(kv + kl + 1, json_string_value(v), vl);
        kv[kl + 1 + vl] = '\0';
        ev[s->cmd.envc++] = kv;
    }
    return 0;
}

int sp_napi__cmdspec_parse(const json_t *b, napi_cmdspec_t *s, sp_err_t *err)
{
    memset(s, 0, sizeof(*s));
    const char *cmd, *cwd, *user;
    int rows = 0, cols = 0;
    bool pty = false;
    json_t *argv = sp_napi__field(b, "argv"), *env = sp_napi__field(b, "env");
    if (sp_napi__opt_str(b, "cmd", CMD_MAX, &cmd, err) < 0 ||
        sp_napi__opt_str(b, "cwd", SP_EXEC_PATH_MAX, &cwd, err) < 0 ||
        sp_napi__opt_str(b, "user", USER_MAX, &user, err) < 0 ||
        sp_napi__opt_int(b, "rows", 1, 1000, &rows, err) < 0 ||
        sp_napi__opt_int(b, "cols", 1, 1000, &cols, err) < 0 ||
        sp_napi__opt_bool(b, "pty", &pty, err) < 0 || sp_svc_check_string_map(env, "env", err) < 0)
        return -1;
    if ((cmd != NULL) == (argv != NULL))
        return sp_err_set(err, SP_EINVAL, "give exactly one of cmd and argv");
    if (cmd != NULL && cmd[0] == '\0')
        return sp_err_set(err, SP_EINVAL, "cmd is empty");
    if (argv != NULL && (!json_is_array(argv) || json_array_size(argv) == 0 ||
                         json_array_size(argv) > SP_AP_MAX_ARGV))
        return sp_err_set(err, SP_EINVAL, "argv must be an array of 1 to %d strings",
                          SP_AP_MAX_ARGV);
    if (user != NULL && user[0] == '\0')
        return sp_err_set(err, SP_EINVAL, "user is empty");
    if ((rows != 0 || cols != 0) && !pty)
        return sp_err_set(err, SP_EINVAL, "rows and cols need pty");
    if ((argv != NULL && parse_argv(s, argv, err) < 0) ||
        (env != NULL && parse_env(s, env, err) < 0) || keep_opt(s, cmd, &s->cmd.cmd, err) < 0 ||
        keep_opt(s, cwd, &s->cmd.cwd, err) < 0 || keep_opt(s, user, &s->cmd.user, err) < 0) {
        sp_napi__cmdspec_clear(s);
        return -1;
    }
    s->cmd.pty = pty;
    s->cmd.rows = (uint32_t)rows;
    s->cmd.cols = (uint32_t)cols;
    return 0;
}
