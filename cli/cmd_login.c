/*
 * cmd_login.c - spacectl login: checks a server URL and API key against the server and saves
 * them in spacectl's config file (cli/config.h: mode 0600, XDG_CONFIG_HOME respected).
 *
 * The environment (SPACE_API_URL, SPACE_API_KEY) still wins over the file afterwards.
 */
#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include <termios.h>
#include <unistd.h>

#include "cli/cmd.h"

static const spc_opt_t login_opts[] = {
    {"url", 0, SPC_STR, "URL", "the server (default: the one spacectl uses now)", 0, 0},
    {"key", 0, SPC_STR, "KEY", "the API key (default: read from stdin, without echo)", 0, 0},
    {NULL, 0, 0, NULL, NULL, 0, 0},
};

static const spc_cmd_t login_cmd = {
    "login", "[--url URL] [--key KEY]", "Save the server's URL and an API key for spacectl.",
    "The key is checked against the server first; nothing is saved when the server refuses it\n"
    "or cannot be reached. The file is $XDG_CONFIG_HOME/space/config, else\n"
    "~/.config/space/config (mode 0600). API keys come from spaced keys create on the server's\n"
    "host (a local spaced also writes one to <data-dir>/api-key).",
    login_opts, NULL, 0, 0, false};

static const char *real_getenv(const char *name)
{
    return getenv(name);
}

static int read_key(char *buf, size_t cap, sp_err_t *err)
{
    struct termios old, t;
    bool tty = isatty(STDIN_FILENO) && tcgetattr(STDIN_FILENO, &old) == 0;
    if (tty) {
        fprintf(stderr, "API key: ");
        t = old;
        t.c_lflag &= ~(tcflag_t)ECHO;
        tcsetattr(STDIN_FILENO, TCSAFLUSH, &t);
    }
    bool ok = fgets(buf, (int)cap, stdin) != NULL;
    if (tty) {
        tcsetattr(STDIN_FILENO, TCSAFLUSH, &old);
        fputc('\n', stderr);
    }
    buf[ok ? strcspn(buf, "\r\n") : 0] = '\0';
    if (buf[0] == '\0')
        return sp_err_set(err, SP_EINVAL, "no API key given");
    return 0;
}

static int run_login(spc_args_t *a)
{
    sp_err_t e;
    spc_config_t c;
    if (spc_config_load(&c, real_getenv, geteuid(), &e) < 0)
        return spc_fail(&e);
    if (c.config_path[0] == '\0')
        return spc_failf("nowhere to save the settings: neither XDG_CONFIG_HOME nor HOME is set");
    const char *url = spc_args_str(a, "url") ? spc_args_str(a, "url") : c.url;
    char key[512];
    if (spc_args_str(a, "key") != NULL)
        snprintf(key, sizeof(key), "%s", spc_args_str(a, "key"));
    else if (read_key(key, sizeof(key), &e) < 0)
        return spc_fail(&e);
    if (strpbrk(key, " \t\r\n") != NULL || strpbrk(url, " \t\r\n") != NULL)
        return spc_failf("the URL and the key may not hold spaces or line breaks");
    spc_api_t api;
    if (spc_api_init_url(&api, url, &e) < 0)
        return spc_fail(&e);
    snprintf(api.key, sizeof(api.key), "%s", key);
    snprintf(api.key_from, sizeof(api.key_from), "%s", spc_args_str(a, "key") ? "--key" : "stdin");
    if (spc_api_call(&api, "GET", "/v1/sandboxes?limit=1", NULL, NULL, NULL, &e) < 0) {
        spc_failf("%s; nothing saved", e.msg);
        return SPC_EXIT_FAIL;
    }
    if (spc_config_save(c.config_path, url, key, &e) < 0)
        return spc_fail(&e);
    explicit_bzero(key, sizeof(key));
    printf("saved the server %s and its key in %s\n", url, c.config_path);
    if (getenv("SPACE_API_URL") || getenv("SPACE_API_KEY"))
        fprintf(stderr, "spacectl: note: SPACE_API_URL or SPACE_API_KEY is set and wins over "
                        "the file\n");
    return 0;
}

const spc_verb_t spc_login_verbs[] = {{NULL, &login_cmd, run_login}};
