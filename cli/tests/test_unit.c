/*
 * test_unit.c - spacectl's parts that need no server: options (cli/args.h), where the
 * settings come from (cli/config.h), tables (cli/table.h), URLs and the
 * line splitter (cli/http.h), the commands' helpers, and --help for every command and verb
 * (cli/cmd.h's spc_main, its output captured from stdout).
 */
#include <fcntl.h>
#include <stdarg.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "cli/args.h"
#include "cli/cmd.h"
#include "cli/config.h"
#include "cli/http.h"
#include "cli/table.h"
#include "tests/check.h"

/* ---- args ---- */

static const spc_opt_t t_opts[] = {
    {"json", 0, SPC_FLAG, NULL, "json", 0, 0},
    {"quiet", 'q', SPC_FLAG, NULL, "quiet", 0, 0},
    {"name", 'n', SPC_STR, "N", "a name", 0, 0},
    {"cpu", 0, SPC_INT, "N", "cpus", 1, 8},
    {"env", 'e', SPC_LIST, "K=V", "env", 0, 0},
    {NULL, 0, 0, NULL, NULL, 0, 0},
};
static const spc_cmd_t t_cmd = {"t", "ID", "test", NULL, t_opts, "ID", 1, 1, false};
static const spc_cmd_t t_prog = {"p", "ID -- CMD", "test", NULL, t_opts, "ID", 1, 1, true};
static const spc_cmd_t t_two = {"two", "A B", "test", NULL, t_opts, "A B", 2, 2, false};

/* Parses a NULL-terminated list of words (kept in a static array: the strings stay argv's). */
static int parse(const spc_cmd_t *cmd, spc_args_t *a, sp_err_t *e, ...)
{
    static char *words[32];
    va_list ap;
    va_start(ap, e);
    int n = 0;
    for (char *w; (w = va_arg(ap, char *)) != NULL && n < 31;)
        words[n++] = w;
    va_end(ap);
    words[n] = NULL;
    memset(e, 0, sizeof(*e));
    return spc_args_parse(cmd, n, words, a, e);
}

static void test_args(void)
{
    spc_args_t a;
    sp_err_t e;
    REQUIRE(parse(&t_cmd, &a, &e, "sb1", "--json", "-q", "--name=x", "--cpu", "4", "-e", "A=1",
                  "--env=B=2", "-n", "y", NULL) == 0);
    CHECK(!a.help);
    CHECK(a.npos == 1 && strcmp(a.pos[0], "sb1") == 0);
    CHECK(spc_args_count(&a, "json") == 1 && spc_args_count(&a, "quiet") == 1);
    CHECK(strcmp(spc_args_str(&a, "name"), "y") == 0); /* the last one wins */
    CHECK(spc_args_count(&a, "name") == 2);
    CHECK(spc_args_int(&a, "cpu", 0) == 4);
    size_t n;
    const char *const *l = spc_args_list(&a, "env", &n);
    CHECK(n == 2 && strcmp(l[0], "A=1") == 0 && strcmp(l[1], "B=2") == 0);
    CHECK(a.rest == NULL && a.nrest == 0);
    spc_args_free(&a);

    /* Defaults when not given. */
    REQUIRE(parse(&t_cmd, &a, &e, "sb1", NULL) == 0);
    CHECK(spc_args_str(&a, "name") == NULL && spc_args_int(&a, "cpu", 7) == 7);
    CHECK(spc_args_count(&a, "json") == 0);
    spc_args_list(&a, "env", &n);
    CHECK(n == 0);
    spc_args_free(&a);

    /* --help anywhere wins over everything else, even what would be an error. */
    REQUIRE(parse(&t_cmd, &a, &e, "--bogus-later?", NULL) < 0);
    REQUIRE(parse(&t_cmd, &a, &e, "-h", "--bogus", NULL) == 0);
    CHECK(a.help);
    spc_args_free(&a);
    REQUIRE(parse(&t_two, &a, &e, "--help", NULL) == 0);
    CHECK(a.help);
    spc_args_free(&a);
    /* ...also after a bad option or value, but not after "--" (the program's own). */
    REQUIRE(parse(&t_cmd, &a, &e, "sb1", "--cpu", "99", "--help", NULL) == 0);
    CHECK(a.help);
    spc_args_free(&a);
    REQUIRE(parse(&t_cmd, &a, &e, "sb1", "--nope", "-h", NULL) == 0);
    CHECK(a.help);
    spc_args_free(&a);
    CHECK(parse(&t_cmd, &a, &e, "sb1", "--nope", "--", "--help", NULL) < 0);
    spc_args_free(&a);

    /* Usage errors, each with a message that names the problem. */
    CHECK(parse(&t_cmd, &a, &e, "sb1", "--nope", NULL) < 0 && strstr(e.msg, "--nope") != NULL);
    CHECK(parse(&t_cmd, &a, &e, "sb1", "-x", NULL) < 0 && strstr(e.msg, "-x") != NULL);
    CHECK(parse(&t_cmd, &a, &e, "sb1", "--cpu", NULL) < 0 && strstr(e.msg, "needs a value"));
    CHECK(parse(&t_cmd, &a, &e, "sb1", "--cpu", "9", NULL) < 0 && strstr(e.msg, "1 to 8"));
    CHECK(parse(&t_cmd, &a, &e, "sb1", "--cpu", "2x", NULL) < 0 && strstr(e.msg, "whole"));
    CHECK(parse(&t_cmd, &a, &e, "sb1", "--json=1", NULL) < 0 && strstr(e.msg, "no value"));
    CHECK(parse(&t_cmd, &a, &e, NULL) < 0 && strstr(e.msg, "missing ID"));
    CHECK(parse(&t_cmd, &a, &e, "a", "b", NULL) < 0 && strstr(e.msg, "'b'"));
    CHECK(parse(&t_two, &a, &e, "a", NULL) < 0 && strstr(e.msg, "missing A B"));

    /* After "--" words are positional even when they look like options; "-" is one. */
    REQUIRE(parse(&t_two, &a, &e, "-", "--", "-x", NULL) == 0);
    CHECK(a.npos == 2 && strcmp(a.pos[0], "-") == 0 && strcmp(a.pos[1], "-x") == 0);
    spc_args_free(&a);

    /* A program: after "--", or from the first word past the positionals, options and all. */
    REQUIRE(parse(&t_prog, &a, &e, "sb1", "-q", "--", "ls", "-l", "--json", NULL) == 0);
    CHECK(a.npos == 1 && spc_args_count(&a, "quiet") == 1 && spc_args_count(&a, "json") == 0);
    CHECK(a.nrest == 3 && strcmp(a.rest[0], "ls") == 0 && strcmp(a.rest[2], "--json") == 0);
    spc_args_free(&a);
    REQUIRE(parse(&t_prog, &a, &e, "sb1", "echo", "-n", "hi", NULL) == 0);
    CHECK(a.nrest == 3 && strcmp(a.rest[0], "echo") == 0 && strcmp(a.rest[1], "-n") == 0);
    CHECK(spc_args_count(&a, "name") == 0); /* -n was the program's */
    spc_args_free(&a);
    CHECK(parse(&t_prog, &a, &e, "sb1", NULL) < 0 && strstr(e.msg, "command to run"));
    CHECK(parse(&t_prog, &a, &e, "sb1", "--", NULL) < 0);

    /* The usage text names every option and its value. */
    char *text = NULL;
    size_t len = 0;
    FILE *f = open_memstream(&text, &len);
    spc_args_usage(&t_cmd, f);
    fclose(f);
    CHECK(strncmp(text, "usage: spacectl t ID\n", 21) == 0);
    CHECK(strstr(text, "-n, --name N") != NULL && strstr(text, "--cpu N") != NULL);
    CHECK(strstr(text, "-h, --help") != NULL);
    free(text);
}

/* ---- config ---- */

static const char *env_tab[16][2];

static const char *fake_getenv(const char *name)
{
    for (size_t i = 0; i < 16 && env_tab[i][0] != NULL; i++)
        if (strcmp(env_tab[i][0], name) == 0)
            return env_tab[i][1];
    return NULL;
}

static void env_set(const char *name, const char *value)
{
    size_t i = 0;
    while (i < 15 && env_tab[i][0] != NULL && strcmp(env_tab[i][0], name) != 0)
        i++;
    env_tab[i][0] = name;
    env_tab[i][1] = value;
}

static void env_clear(void)
{
    memset(env_tab, 0, sizeof(env_tab));
}

static void write_file(const char *path, const char *text)
{
    FILE *f = fopen(path, "w");
    REQUIRE(f != NULL);
    fputs(text, f);
    fclose(f);
}

static void test_config(void)
{
    char home[] = "/tmp/spc-unit-XXXXXX";
    REQUIRE(mkdtemp(home) != NULL);
    char cfgdir[128], cfg[256], data[128], keyfile[256], out[1024];
    snprintf(cfgdir, sizeof(cfgdir), "%s/.config/space", home);
    snprintf(cfg, sizeof(cfg), "%s/config", cfgdir);
    snprintf(data, sizeof(data), "%s/data", home);
    snprintf(keyfile, sizeof(keyfile), "%s/api-key", data);
    spc_config_t c;
    sp_err_t e;

    /* spaced's data dir rules. */
    env_clear();
    env_set("HOME", home);
    spc_config_data_dir(out, sizeof(out), fake_getenv, 1000);
    CHECK(strncmp(out, home, strlen(home)) == 0 && strstr(out, "/.local/share/space") != NULL);
    spc_config_data_dir(out, sizeof(out), fake_getenv, 0);
    CHECK(strcmp(out, "/var/lib/space") == 0);
    env_set("SPACE_DATA_DIR", data);
    spc_config_data_dir(out, sizeof(out), fake_getenv, 0);
    CHECK(strcmp(out, data) == 0);

    /* The config file's path: an absolute XDG_CONFIG_HOME, else HOME. */
    REQUIRE(spc_config_path(out, sizeof(out), fake_getenv) == 0);
    CHECK(strcmp(out, cfg) == 0);
    env_set("XDG_CONFIG_HOME", "relative/ignored");
    REQUIRE(spc_config_path(out, sizeof(out), fake_getenv) == 0);
    CHECK(strcmp(out, cfg) == 0);
    env_set("XDG_CONFIG_HOME", "/xdg");
    REQUIRE(spc_config_path(out, sizeof(out), fake_getenv) == 0);
    CHECK(strcmp(out, "/xdg/space/config") == 0);
    env_clear();
    CHECK(spc_config_path(out, sizeof(out), fake_getenv) < 0);

    /* Nothing anywhere: the default URL and no key, with where we looked. */
    env_set("HOME", home);
    env_set("SPACE_DATA_DIR", data);
    REQUIRE(spc_config_load(&c, fake_getenv, 1000, &e) == 0);
    CHECK(strcmp(c.url, SPC_DEFAULT_URL) == 0);
    CHECK(c.key[0] == '\0');
    CHECK(strstr(c.looked, "SPACE_API_KEY") && strstr(c.looked, cfg) && strstr(c.looked, keyfile));

    /* The local spaced's key file. */
    REQUIRE(mkdir(data, 0700) == 0);
    write_file(keyfile, "sk_local\n");
    REQUIRE(spc_config_load(&c, fake_getenv, 1000, &e) == 0);
    CHECK(strcmp(c.key, "sk_local") == 0 && strcmp(c.key_from, keyfile) == 0);
    CHECK(strcmp(c.url, SPC_DEFAULT_URL) == 0);

    /* spacectl login's file beats the key file... */
    REQUIRE(spc_config_save(cfg, "https://space.example:8443/api", "sk_file", &e) == 0);
    struct stat st;
    REQUIRE(stat(cfg, &st) == 0);
    CHECK((st.st_mode & 0777) == 0600);
    REQUIRE(stat(cfgdir, &st) == 0);
    CHECK((st.st_mode & 0777) == 0700);
    REQUIRE(spc_config_load(&c, fake_getenv, 1000, &e) == 0);
    CHECK(strcmp(c.key, "sk_file") == 0 && strcmp(c.key_from, cfg) == 0);
    CHECK(strcmp(c.url, "https://space.example:8443/api") == 0 && strcmp(c.url_from, cfg) == 0);

    /* ...and the environment beats both, each setting on its own. */
    env_set("SPACE_API_KEY", "sk_env");
    REQUIRE(spc_config_load(&c, fake_getenv, 1000, &e) == 0);
    CHECK(strcmp(c.key, "sk_env") == 0 && strcmp(c.key_from, "SPACE_API_KEY") == 0);
    CHECK(strcmp(c.url, "https://space.example:8443/api") == 0);
    env_set("SPACE_API_URL", "http://10.0.0.1:3000");
    env_set("SPACE_API_KEY", ""); /* empty counts as unset */
    REQUIRE(spc_config_load(&c, fake_getenv, 1000, &e) == 0);
    CHECK(strcmp(c.url, "http://10.0.0.1:3000") == 0 && strcmp(c.url_from, "SPACE_API_URL") == 0);
    CHECK(strcmp(c.key, "sk_file") == 0);

    /* A file with only a url: the key comes from the key file; comments and blanks pass. */
    write_file(cfg, "# mine\n\n  url = http://h:1  \nother = ignored\n");
    env_set("SPACE_API_URL", "");
    REQUIRE(spc_config_load(&c, fake_getenv, 1000, &e) == 0);
    CHECK(strcmp(c.url, "http://h:1") == 0 && strcmp(c.key, "sk_local") == 0);

    /* A file that cannot be parsed is an error naming its line. */
    write_file(cfg, "url = http://h:1\nnonsense\n");
    CHECK(spc_config_load(&c, fake_getenv, 1000, &e) < 0 && strstr(e.msg, "line 2") != NULL);

    /* Saving again replaces the file and keeps its mode, whatever it was. */
    chmod(cfg, 0644);
    REQUIRE(spc_config_save(cfg, "http://a:2", "sk_new", &e) == 0);
    REQUIRE(stat(cfg, &st) == 0);
    CHECK((st.st_mode & 0777) == 0600);
    REQUIRE(spc_config_load(&c, fake_getenv, 1000, &e) == 0);
    CHECK(strcmp(c.url, "http://a:2") == 0 && strcmp(c.key, "sk_new") == 0);

    unlink(cfg);
    rmdir(cfgdir);
    snprintf(out, sizeof(out), "%s/.config", home);
    rmdir(out);
    unlink(keyfile);
    rmdir(data);
    rmdir(home);
    env_clear();
}

/* ---- table ---- */

static char *render(const spc_table_t *t)
{
    char *text = NULL;
    size_t len = 0;
    FILE *f = open_memstream(&text, &len);
    spc_table_print(t, f);
    fclose(f);
    return text;
}

static void test_table(void)
{
    static const char *const hdr[] = {"ID", "STATE", "NOTE"};
    spc_table_t *t = spc_table_new(3, hdr);
    REQUIRE(t != NULL);
    const char *r1[] = {"abc", "running", "x"};
    const char *r2[] = {"a", "", "long note"};
    const char *r3[] = {"\xc3\xa9t\xc3\xa9", "p\x1b[2Jq", NULL}; /* "été": 3 wide, not 5 */
    REQUIRE(spc_table_add(t, r1) == 0 && spc_table_add(t, r2) == 0 && spc_table_add(t, r3) == 0);
    char *s = render(t);
    const char *want = "ID    STATE     NOTE\n"
                       "abc   running   x\n"
                       "a     -         long note\n"
                       "\xc3\xa9t\xc3\xa9   p?[2Jq    -\n";
    CHECK(strcmp(s, want) == 0);
    if (strcmp(s, want) != 0)
        fprintf(stderr, "got:\n%s", s);
    free(s);
    spc_table_free(t);
    spc_table_free(NULL);

    CHECK(spc_table_width("") == 0 && spc_table_width("abc") == 3);
    CHECK(spc_table_width("\xe2\x82\xac") == 1);
    char *c = spc_table_cell("a\tb\n\x7f");
    CHECK(strcmp(c, "a?b??") == 0);
    free(c);

    char *text = NULL;
    size_t len = 0;
    FILE *f = open_memstream(&text, &len);
    const char *names[] = {"id", "desired state"}, *values[] = {"sb1", ""};
    spc_kv_print(f, 2, names, values);
    fclose(f);
    CHECK(strcmp(text, "id:             sb1\ndesired state:  -\n") == 0);
    free(text);
}

/* ---- URLs, chunked, lines ---- */

static void test_url(void)
{
    spc_url_t u;
    sp_err_t e;
    REQUIRE(spc_url_parse("http://127.0.0.1:3000", &u, &e) == 0);
    CHECK(!u.tls && strcmp(u.host, "127.0.0.1") == 0 && strcmp(u.port, "3000") == 0);
    CHECK(u.prefix[0] == '\0');
    REQUIRE(spc_url_parse("HTTPS://space.example/api/", &u, &e) == 0);
    CHECK(u.tls && strcmp(u.host, "space.example") == 0 && strcmp(u.port, "443") == 0);
    CHECK(strcmp(u.prefix, "/api") == 0);
    REQUIRE(spc_url_parse("http://[::1]:8080/x", &u, &e) == 0);
    CHECK(strcmp(u.host, "::1") == 0 && strcmp(u.port, "8080") == 0);
    CHECK(strcmp(u.prefix, "/x") == 0);
    REQUIRE(spc_url_parse("http://h", &u, &e) == 0);
    CHECK(strcmp(u.port, "80") == 0);
    static const char *const bad[] = {"ftp://h",        "h:3000",          "http://",
                                      "http://h:0",     "http://h:65536",  "http://h:x",
                                      "http://u@h",     "http://h/?q=1",   "http://[::1",
                                      "http://h:80/a b"};
    for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
        CHECK(spc_url_parse(bad[i], &u, &e) < 0);
        CHECK(e.msg[0] != '\0');
    }

    sp_buf_t b = SP_BUF_INIT;
    spc_urlencode(&b, "a b/c?d=e&f~_.-\xc3\xa9");
    CHECK(strcmp(sp_buf_cstr(&b), "a%20b%2Fc%3Fd%3De%26f~_.-%C3%A9") == 0);
    sp_buf_free(&b);
}


static int push_s(spc_lines_t *l, const char *s)
{
    return spc_lines_push(l, s, strlen(s));
}

static bool is_line(const char *line, size_t len, const char *want)
{
    return len == strlen(want) && memcmp(line, want, len) == 0;
}

static void test_lines(void)
{
    spc_lines_t l;
    const char *line;
    size_t len;
    spc_lines_init(&l, 16);
    REQUIRE(push_s(&l, "{\"a\":1}\r\n\n  \n{\"b\"") == 0);
    CHECK(spc_lines_next(&l, false, &line, &len) == 1 && is_line(line, len, "{\"a\":1}"));
    CHECK(spc_lines_next(&l, false, &line, &len) == 0); /* blanks skipped, the rest incomplete */
    REQUIRE(push_s(&l, ":2}\n{\"c\":3}") == 0);
    CHECK(spc_lines_next(&l, false, &line, &len) == 1 && is_line(line, len, "{\"b\":2}"));
    CHECK(spc_lines_next(&l, false, &line, &len) == 0);
    CHECK(spc_lines_next(&l, true, &line, &len) == 1 && is_line(line, len, "{\"c\":3}"));
    CHECK(spc_lines_next(&l, true, &line, &len) == 0);
    REQUIRE(push_s(&l, "0123456789abcdefXYZ") == 0);
    CHECK(spc_lines_next(&l, false, &line, &len) == -1); /* longer than max, no newline */
    spc_lines_free(&l);
}

/* ---- the commands' helpers ---- */

static void test_helpers(void)
{
    char buf[64];
    CHECK(strcmp(spc_time("2024-05-01T12:00:00.123Z", buf, sizeof(buf)), "2024-05-01 12:00:00") ==
          0);
    CHECK(strcmp(spc_time("soon", buf, sizeof(buf)), "soon") == 0);
    CHECK(strcmp(spc_path(buf, sizeof(buf), "/v1/sandboxes/%s/events", "a/b c"),
                 "/v1/sandboxes/a%2Fb%20c/events") == 0);

    json_t *o = json_pack("{s:s,s:i,s:b,s:n,s:f}", "s", "x", "i", 42, "b", 1, "n", "r", 1.5);
    CHECK(strcmp(spc_str(o, "s"), "x") == 0 && strcmp(spc_str(o, "i"), "") == 0);
    CHECK(strcmp(spc_cell(o, "i", buf, sizeof(buf)), "42") == 0);
    CHECK(strcmp(spc_cell(o, "b", buf, sizeof(buf)), "true") == 0);
    CHECK(strcmp(spc_cell(o, "n", buf, sizeof(buf)), "") == 0);
    CHECK(strcmp(spc_cell(o, "r", buf, sizeof(buf)), "1.5") == 0);
    CHECK(strcmp(spc_cell(o, "missing", buf, sizeof(buf)), "") == 0);
    json_decref(o);

    const char *kv[] = {"A=1", "B==2", "C="};
    sp_err_t e;
    REQUIRE(spc_kv_object(kv, 3, "--env", &o, &e) == 0);
    CHECK(strcmp(spc_str(o, "A"), "1") == 0 && strcmp(spc_str(o, "B"), "=2") == 0);
    CHECK(json_is_string(json_object_get(o, "C")) && strcmp(spc_str(o, "C"), "") == 0);
    json_decref(o);
    const char *bad1[] = {"A"}, *bad2[] = {"=v"};
    CHECK(spc_kv_object(bad1, 1, "--env", &o, &e) < 0 && strstr(e.msg, "--env") != NULL);
    CHECK(spc_kv_object(bad2, 1, "--metadata", &o, &e) < 0 && strstr(e.msg, "--metadata"));
}

/* ---- help for every command ---- */

/* Runs spc_main on the words with stdout and stderr captured; returns its exit status. */
static int run_main(char **out, char **errout, int argc, char **argv)
{
    char opath[] = "/tmp/spc-unit-out-XXXXXX", epath[] = "/tmp/spc-unit-err-XXXXXX";
    int ofd = mkstemp(opath), efd = mkstemp(epath);
    REQUIRE(ofd >= 0 && efd >= 0);
    fflush(stdout);
    fflush(stderr);
    int so = dup(STDOUT_FILENO), se = dup(STDERR_FILENO);
    dup2(ofd, STDOUT_FILENO);
    dup2(efd, STDERR_FILENO);
    int rc = spc_main(argc, argv);
    fflush(stdout);
    fflush(stderr);
    dup2(so, STDOUT_FILENO);
    dup2(se, STDERR_FILENO);
    close(so);
    close(se);
    char *bufs[2] = {NULL, NULL};
    int fds[2] = {ofd, efd};
    for (int i = 0; i < 2; i++) {
        off_t n = lseek(fds[i], 0, SEEK_END);
        bufs[i] = calloc(1, (size_t)n + 1);
        REQUIRE(bufs[i] != NULL && pread(fds[i], bufs[i], (size_t)n, 0) == n);
        close(fds[i]);
    }
    unlink(opath);
    unlink(epath);
    *out = bufs[0];
    *errout = bufs[1];
    return rc;
}

static void check_verb_help(const spc_group_t *g, const spc_verb_t *v, const char *flag)
{
    char *argv[4] = {"spacectl", (char *)g->name, (char *)v->verb, (char *)flag};
    int argc = 4;
    if (v->verb == NULL) { /* a single command: spacectl exec --help */
        argv[2] = (char *)flag;
        argc = 3;
    }
    char *out, *err;
    int rc = run_main(&out, &err, argc, argv);
    char want[128];
    snprintf(want, sizeof(want), "usage: spacectl %s ", v->cmd->name);
    CHECK(rc == 0);
    CHECK(strncmp(out, want, strlen(v->cmd->synopsis ? want : "usage: spacectl")) == 0);
    CHECK(strstr(out, v->cmd->summary) != NULL);
    CHECK(strstr(out, "options:\n") != NULL && strstr(out, "-h, --help") != NULL);
    for (const spc_opt_t *o = v->cmd->opts; o != NULL && o->name != NULL; o++) {
        char name[64];
        snprintf(name, sizeof(name), "--%s", o->name);
        CHECK(strstr(out, name) != NULL);
        CHECK(o->help != NULL && o->help[0] != '\0');
    }
    CHECK(err[0] == '\0');
    if (rc != 0 || strstr(out, "options:\n") == NULL)
        fprintf(stderr, "spacectl %s %s %s: rc %d\n%s%s", g->name, v->verb ? v->verb : "", flag,
                rc, out, err);
    free(out);
    free(err);
}

static void test_help(void)
{
    char *out, *err;
    char *top[] = {"spacectl", "--help"};
    CHECK(run_main(&out, &err, 2, top) == 0);
    for (size_t i = 0; i < spc_ngroups; i++) {
        char line[64];
        snprintf(line, sizeof(line), "\n  %-10s ", spc_groups[i].name);
        CHECK(strstr(out, line) != NULL);
    }
    CHECK(strstr(out, "SPACE_API_URL") != NULL && strstr(out, "SPACE_API_KEY") != NULL);
    free(out);
    free(err);

    /* No command: the usage on stderr, status 2. An unknown command or verb: 2 too. */
    char *none[] = {"spacectl"};
    CHECK(run_main(&out, &err, 1, none) == SPC_EXIT_USAGE && out[0] == '\0');
    CHECK(strstr(err, "usage: spacectl") != NULL);
    free(out);
    free(err);
    char *unk[] = {"spacectl", "sandboxes"};
    CHECK(run_main(&out, &err, 2, unk) == SPC_EXIT_USAGE && strstr(err, "'sandboxes'"));
    free(out);
    free(err);
    char *unkv[] = {"spacectl", "sandbox", "destroy"};
    CHECK(run_main(&out, &err, 3, unkv) == SPC_EXIT_USAGE && strstr(err, "sandbox destroy"));
    free(out);
    free(err);
    char *bad[] = {"spacectl", "sandbox", "get"};
    CHECK(run_main(&out, &err, 3, bad) == SPC_EXIT_USAGE && strstr(err, "missing ID"));
    free(out);
    free(err);

    size_t nverbs = 0;
    for (size_t i = 0; i < spc_ngroups; i++) {
        const spc_group_t *g = &spc_groups[i];
        if (g->verbs[0].verb != NULL) {
            /* The group's own help lists its verbs. */
            char *gh[] = {"spacectl", (char *)g->name, "--help"};
            CHECK(run_main(&out, &err, 3, gh) == 0);
            for (const spc_verb_t *v = g->verbs; v->verb != NULL; v++) {
                char line[64];
                snprintf(line, sizeof(line), "\n  %-8s ", v->verb);
                CHECK(strstr(out, line) != NULL);
            }
            free(out);
            free(err);
        }
        for (const spc_verb_t *v = g->verbs; v->cmd != NULL; v++) {
            check_verb_help(g, v, "--help");
            check_verb_help(g, v, "-h");
            nverbs++;
            if (v->verb == NULL)
                break;
        }
    }
    /* sandbox (7), exec, shell, cp, logs, template (3), snapshot (3), secrets (3), egress (2),
     * login. */
    CHECK(nverbs == 23);
}

int main(void)
{
    test_args();
    test_config();
    test_table();
    test_url();
    test_lines();
    test_helpers();
    test_help();
    return check_report("cli.unit");
}
