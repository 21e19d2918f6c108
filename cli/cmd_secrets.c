/*
 * cmd_secrets.c - spacectl secrets set | list | delete: the team's secrets, which sandboxes
 * use only through credential rules applied outside the VM (the values never come back).
 *
 * set creates the secret, or replaces its value when one of that name exists. The value comes
 * from --value or from stdin (a terminal is asked without echo; from a pipe or file, all of it
 * with one trailing newline dropped), so it need not appear in the shell's history.
 */
#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include <termios.h>
#include <unistd.h>

#include "cli/cmd.h"
#include "cli/table.h"

#define MAX_VALUE 8192 /* the API's limit */

static const spc_opt_t set_opts[] = {
    {"value", 0, SPC_STR, "V", "the value (default: read from stdin)", 0, 0},
    {"json", 0, SPC_FLAG, NULL, "print the API's JSON", 0, 0},
    {NULL, 0, 0, NULL, NULL, 0, 0},
};

static const spc_cmd_t set_cmd = {
    "secrets set", "NAME [--value V]", "Store a team secret (or replace its value).",
    "Without --value the value is read from stdin: typed at a prompt without echo, or all of a\n"
    "pipe or file with one trailing newline dropped. Names: letters, digits, _ . - (64 at\n"
    "most, not starting with a digit).",
    set_opts, "NAME", 1, 1, false};

static const spc_opt_t list_opts[] = {
    {"json", 0, SPC_FLAG, NULL, "print the API's JSON", 0, 0},
    {NULL, 0, 0, NULL, NULL, 0, 0},
};

static const spc_cmd_t list_cmd = {"secrets list", NULL,
                                   "List the team's secrets (names and times, never values).",
                                   NULL, list_opts, NULL, 0, 0, false};

static const spc_opt_t delete_opts[] = {
    {NULL, 0, 0, NULL, NULL, 0, 0},
};

static const spc_cmd_t delete_cmd = {
    "secrets delete", "NAME", "Delete a team secret.",
    "Credential rules naming it stay; their requests fail until a secret of that name exists.",
    delete_opts, "NAME", 1, 1, false};

/* The value from stdin into buf (NUL-terminated). -1 with err. */
static int read_value(const char *name, char *buf, size_t cap, sp_err_t *err)
{
    size_t n = 0;
    if (isatty(STDIN_FILENO)) {
        struct termios old, t;
        bool quiet = tcgetattr(STDIN_FILENO, &old) == 0;
        fprintf(stderr, "value of %s: ", name);
        if (quiet) {
            t = old;
            t.c_lflag &= ~(tcflag_t)ECHO;
            tcsetattr(STDIN_FILENO, TCSAFLUSH, &t);
        }
        bool ok = fgets(buf, (int)cap, stdin) != NULL;
        if (quiet)
            tcsetattr(STDIN_FILENO, TCSAFLUSH, &old);
        fputc('\n', stderr);
        if (!ok)
            return sp_err_set(err, SP_EINVAL, "no value given");
        n = strlen(buf);
    } else {
        for (;;) {
            ssize_t k = read(STDIN_FILENO, buf + n, cap - 1 - n);
            if (k < 0 && errno == EINTR)
                continue;
            if (k < 0)
                return sp_err_set(err, SP_EINVAL, "reading stdin: %s", strerror(errno));
            if (k == 0)
                break;
            n += (size_t)k;
            if (n == cap - 1)
                return sp_err_set(err, SP_EINVAL, "the value is longer than %d bytes",
                                  MAX_VALUE);
        }
    }
    if (n > 0 && buf[n - 1] == '\n')
        n--;
    if (n > 0 && buf[n - 1] == '\r')
        n--;
    buf[n] = '\0';
    return 0;
}

static int run_set(spc_args_t *a)
{
    spc_api_t api;
    sp_err_t e;
    const char *name = a->pos[0];
    char buf[MAX_VALUE + 2];
    const char *value = spc_args_str(a, "value");
    if (spc_api(&api) < 0)
        return SPC_EXIT_FAIL;
    if (value == NULL) {
        if (read_value(name, buf, sizeof(buf), &e) < 0)
            return spc_fail(&e);
        value = buf;
    }
    json_t *body = json_pack("{s:s,s:s}", "name", name, "value", value), *ans = NULL;
    int status;
    bool replaced = false;
    int rc = spc_api_call(&api, "POST", "/v1/secrets", body, &ans, &status, &e);
    if (rc < 0 && status == 409) { /* it exists: rotate its value */
        char path[256];
        json_object_del(body, "name");
        rc = spc_api_call(&api, "PUT", spc_path(path, sizeof(path), "/v1/secrets/%s", name), body,
                          &ans, NULL, &e);
        replaced = true;
    }
    json_decref(body);
    explicit_bzero(buf, sizeof(buf));
    if (rc < 0)
        return spc_fail(&e);
    if (spc_args_count(a, "json"))
        rc = spc_print_json(ans);
    else
        printf("secret %s %s\n", name, replaced ? "replaced" : "stored");
    json_decref(ans);
    return rc;
}

static void print_secrets(const json_t *ans)
{
    static const char *const cols[] = {"NAME", "CREATED", "UPDATED"};
    spc_table_t *t = spc_table_new(3, cols);
    if (t == NULL)
        return;
    size_t i;
    json_t *s;
    json_array_foreach(json_object_get(ans, "secrets"), i, s)
    {
        char c[32], u[32];
        const char *cells[] = {spc_str(s, "name"), spc_time(spc_str(s, "created_at"), c, sizeof(c)),
                               spc_time(spc_str(s, "updated_at"), u, sizeof(u))};
        spc_table_add(t, cells);
    }
    spc_table_print(t, stdout);
    spc_table_free(t);
}

static int run_list(spc_args_t *a)
{
    return spc_show(a, "/v1/secrets", print_secrets);
}

static int run_delete(spc_args_t *a)
{
    char path[256];
    return spc_delete(spc_path(path, sizeof(path), "/v1/secrets/%s", a->pos[0]), "secret",
                      a->pos[0]);
}

const spc_verb_t spc_secrets_verbs[] = {
    {"set", &set_cmd, run_set},
    {"list", &list_cmd, run_list},
    {"delete", &delete_cmd, run_delete},
    {NULL, NULL, NULL},
};
