/* server/config: the config file read into options, against a table like spaced's. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "server/config.h"
#include "tests/check.h"

static const struct option opts[] = {{"listen", required_argument, NULL, 'l'},
                                     {"force", no_argument, NULL, 'f'},
                                     {"log-level", required_argument, NULL, 'L'},
                                     {"opt", optional_argument, NULL, 'o'},
                                     {"config", required_argument, NULL, 'c'},
                                     {"help", no_argument, NULL, 'h'},
                                     {NULL, 0, NULL, 0}};

static char path[64];

static int load(const char *text, sp_config_args_t *a, sp_err_t *e)
{
    FILE *f = fopen(path, "w");
    REQUIRE(f != NULL);
    fputs(text, f);
    fclose(f);
    memset(e, 0, sizeof(*e));
    return sp_config_load(path, true, opts, a, e);
}

static void test_settings(void)
{
    sp_config_args_t a;
    sp_err_t e;
    CHECK(load("# comment\n\n   # indented comment\nlisten = 0.0.0.0:3000\n"
               "force = true\nlog-level=debug\r\n  opt =  \"two words # kept\"  \n"
               "listen = 127.0.0.1:9\n",
               &a, &e) == 0);
    REQUIRE(a.argc == 5);
    CHECK(strcmp(a.argv[0], "--listen=0.0.0.0:3000") == 0);
    CHECK(strcmp(a.argv[1], "--force") == 0);
    CHECK(strcmp(a.argv[2], "--log-level=debug") == 0);
    CHECK(strcmp(a.argv[3], "--opt=two words # kept") == 0);
    CHECK(strcmp(a.argv[4], "--listen=127.0.0.1:9") == 0); /* the last one wins in getopt */
    sp_config_args_free(&a);

    /* false leaves a flag out; the boolean spellings. */
    CHECK(load("force = false\nforce = no\nforce = OFF\nforce = 0\n", &a, &e) == 0);
    CHECK(a.argc == 0);
    sp_config_args_free(&a);
    CHECK(load("force = yes\nforce = On\nforce = 1\n", &a, &e) == 0);
    CHECK(a.argc == 3);
    sp_config_args_free(&a);

    /* An empty file, and a quoted empty value for an option that takes one. */
    CHECK(load("", &a, &e) == 0 && a.argc == 0);
    sp_config_args_free(&a);
    CHECK(load("listen = \"\"\n", &a, &e) == 0 && a.argc == 1 &&
          strcmp(a.argv[0], "--listen=") == 0);
    sp_config_args_free(&a);
}

static void test_errors(void)
{
    sp_config_args_t a;
    sp_err_t e;
    CHECK(load("listen = x\n\nlisen = 1\n", &a, &e) < 0);
    CHECK(e.code == SP_EINVAL && strstr(e.msg, "line 3") &&
          strstr(e.msg, "unknown option 'lisen'"));
    CHECK(a.argc == 0 && a.argv == NULL); /* nothing half-read */
    CHECK(load("listen\n", &a, &e) < 0 && strstr(e.msg, "line 1: expected name = value"));
    CHECK(load("force = maybe\n", &a, &e) < 0 && strstr(e.msg, "line 1: force wants true"));
    CHECK(load("listen =\n", &a, &e) < 0 && strstr(e.msg, "line 1: listen needs a value"));
    CHECK(load("listen = \"open\n", &a, &e) < 0 && strstr(e.msg, "unterminated quote"));
    CHECK(load("config = /x\n", &a, &e) < 0 && strstr(e.msg, "unknown option 'config'"));
    CHECK(load("help = true\n", &a, &e) < 0 && strstr(e.msg, "unknown option 'help'"));
    CHECK(load("--listen = x\n", &a, &e) < 0 && strstr(e.msg, "unknown option"));
    char big[6000];
    memset(big, 'a', sizeof(big) - 2);
    big[sizeof(big) - 2] = '\n';
    big[sizeof(big) - 1] = '\0';
    CHECK(load(big, &a, &e) < 0 && strstr(e.msg, "line 1: longer than"));
}

static void test_missing_and_path(void)
{
    sp_config_args_t a;
    sp_err_t e;
    CHECK(sp_config_load("/nonexistent/spaced.conf", false, opts, &a, &e) == 0 && a.argc == 0);
    CHECK(sp_config_load("/nonexistent/spaced.conf", true, opts, &a, &e) < 0);
    CHECK(strstr(e.msg, "cannot read") != NULL);

    bool given;
    char *v1[] = {"spaced", "serve", "--listen", "x", "--config", "/a.conf", NULL};
    CHECK(strcmp(sp_config_path(6, v1, 2, &given), "/a.conf") == 0 && given);
    char *v2[] = {"spaced", "serve", "--config=/b.conf", NULL};
    CHECK(strcmp(sp_config_path(3, v2, 2, &given), "/b.conf") == 0 && given);
    char *v3[] = {"spaced", "serve", "--", "--config=/c.conf", NULL};
    unsetenv("SPACE_CONFIG");
    CHECK(strcmp(sp_config_path(4, v3, 2, &given), SP_CONFIG_DEFAULT_PATH) == 0 && !given);
    setenv("SPACE_CONFIG", "/env.conf", 1);
    CHECK(strcmp(sp_config_path(4, v3, 2, &given), "/env.conf") == 0 && given);
    CHECK(strcmp(sp_config_path(3, v2, 2, &given), "/b.conf") == 0); /* the flag wins */
    setenv("SPACE_CONFIG", "", 1);
    CHECK(strcmp(sp_config_path(2, v3, 2, &given), SP_CONFIG_DEFAULT_PATH) == 0 && !given);
}

int main(void)
{
    snprintf(path, sizeof(path), "/tmp/sp-config-test-%d.conf", (int)getpid());
    test_settings();
    test_errors();
    test_missing_and_path();
    unlink(path);
    return check_report("server.config");
}
