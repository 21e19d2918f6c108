/*
 * cmd_template.c - spacectl template list | build | delete.
 *
 * build makes a team's own template from another one through the API (POST /v1/templates:
 * steps run in a builder VM) and follows its log live; the built-in templates are still built
 * on the server's host (spaced template build NAME). With --dockerfile, the build's parent and
 * steps are a Dockerfile's; --context DIR is packed with tar (names sorted, owners and times
 * zeroed: the same files give the same key, so an unchanged build comes from the cache) and
 * uploaded as a template file (PUT /v1/template-files/{sha256}) for its COPY and ADD.
 */
#include <errno.h>
#include <fcntl.h>
#include <openssl/evp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "cli/api.h"
#include "cli/cmd.h"
#include "cli/http.h"
#include "cli/table.h"

static const spc_opt_t list_opts[] = {
    {"json", 0, SPC_FLAG, NULL, "print the API's JSON", 0, 0},
    {NULL, 0, 0, NULL, NULL, 0, 0},
};

static const spc_cmd_t list_cmd = {"template list", NULL,
                                   "List the templates sandboxes can be created from.", NULL,
                                   list_opts, NULL, 0, 0, false};

static const spc_opt_t build_opts[] = {
    {"from", 0, SPC_STR, "TEMPLATE", "the template to start from (default: the file's, else base)",
     0, 0},
    {"file", 'f', SPC_STR, "PATH",
     "a build request as JSON (POST /v1/templates); options add to it", 0, 0},
    {"dockerfile", 0, SPC_STR, "PATH", "build from a Dockerfile (its FROM is the parent)", 0, 0},
    {"context", 0, SPC_STR, "DIR", "the Dockerfile's build context (its COPY and ADD sources)", 0,
     0},
    {"env", 'e', SPC_LIST, "K=V", "an env step before the run steps (repeatable)", 0, 0},
    {"workdir", 'w', SPC_STR, "DIR", "a workdir step before the run steps", 0, 0},
    {"user", 'u', SPC_STR, "USER", "a user step before the run steps", 0, 0},
    {"run", 'r', SPC_LIST, "CMD", "a run step: a shell line (repeatable, in order)", 0, 0},
    {"start-cmd", 0, SPC_STR, "CMD", "left running in the template's snapshot", 0, 0},
    {"ready-cmd", 0, SPC_STR, "CMD", "polled until it exits 0 before the snapshot", 0, 0},
    {"cpus", 0, SPC_INT, "N", "default vCPUs of its sandboxes", 1, 64},
    {"memory", 0, SPC_INT, "MB", "default memory of its sandboxes", 128, 65536},
    {"force", 0, SPC_FLAG, NULL, "build even when a version with these inputs exists", 0, 0},
    {"no-follow", 0, SPC_FLAG, NULL, "print the build and return without following its log", 0, 0},
    {"json", 0, SPC_FLAG, NULL, "print the build's JSON at the end (the log goes to stderr)", 0, 0},
    {NULL, 0, 0, NULL, NULL, 0, 0},
};

static const spc_cmd_t build_cmd = {
    "template build",
    "NAME [options]",
    "Build a template from another one, through the API.",
    "Boots a builder from --from, runs the steps (env, workdir and user steps first, then each\n"
    "--run in order), freezes its disk into a new version of NAME and takes its snapshot with\n"
    "--start-cmd running. Follows the build's log; exits 0 when the build succeeded.\n"
    "Example: spacectl template build web --from base --run 'apt-get update && apt-get install\n"
    "-y nginx' --start-cmd 'nginx -g \"daemon off;\"' --ready-cmd 'curl -sf localhost'\n"
    "From a Dockerfile: spacectl template build web --dockerfile Dockerfile --context .",
    build_opts,
    "NAME",
    1,
    1,
    false};

static const spc_opt_t delete_opts[] = {
    {NULL, 0, 0, NULL, NULL, 0, 0},
};

static const spc_cmd_t delete_cmd = {
    "template delete", "NAME", "Delete one of your team's templates.",
    "Its running and suspended sandboxes are not affected; new sandboxes cannot be made from it.",
    delete_opts, "NAME", 1, 1, false};

static void print_templates(const json_t *ans)
{
    static const char *const cols[] = {"NAME", "STATUS", "CPUS", "MEMORY", "UPDATED",
                                       "DESCRIPTION"};
    spc_table_t *t = spc_table_new(6, cols);
    if (t == NULL)
        return;
    size_t i;
    json_t *tp;
    json_array_foreach(json_object_get(ans, "templates"), i, tp)
    {
        char cpu[24], mem[40], num[24], upd[32];
        snprintf(mem, sizeof(mem), "%s MiB", spc_cell(tp, "memory_mb", num, sizeof(num)));
        const char *cells[] = {spc_str(tp, "name"),
                               spc_str(tp, "status"),
                               spc_cell(tp, "cpu_count", cpu, sizeof(cpu)),
                               mem,
                               spc_time(spc_str(tp, "updated_at"), upd, sizeof(upd)),
                               spc_str(tp, "description")};
        spc_table_add(t, cells);
    }
    spc_table_print(t, stdout);
    spc_table_free(t);
}

static int run_list(spc_args_t *a)
{
    return spc_show(a, "/v1/templates", print_templates);
}

/* The file at path, whole (at most max bytes), NUL-terminated; NULL with e. */
static char *read_text(const char *path, size_t max, sp_err_t *e)
{
    FILE *f = fopen(path, "rb");
    if (f == NULL) {
        sp_err_set(e, SP_EINVAL, "%.200s: %s", path, strerror(errno));
        return NULL;
    }
    char *text = malloc(max + 1);
    size_t n = text ? fread(text, 1, max + 1, f) : 0;
    bool bad = text == NULL || ferror(f);
    fclose(f);
    if (bad || n > max) {
        free(text);
        sp_err_set(e, SP_EINVAL, "%.200s: %s", path,
                   bad ? "cannot be read" : "too large (a Dockerfile is at most 1 MiB)");
        return NULL;
    }
    text[n] = '\0';
    return text;
}

/* dir packed into the open file fd by tar, reproducibly (sorted names, no owners, times or
 * gzip name/time). */
static int pack_context(const char *dir, int fd, sp_err_t *e)
{
    struct stat st;
    if (stat(dir, &st) < 0 || !S_ISDIR(st.st_mode))
        return sp_err_set(e, SP_EINVAL, "--context %.200s: not a directory", dir);
    pid_t pid = fork();
    if (pid < 0)
        return sp_err_set(e, SP_EINTERNAL, "fork: %s", strerror(errno));
    if (pid == 0) {
        if (dup2(fd, STDOUT_FILENO) < 0)
            _exit(127);
        execlp("tar", "tar", "--sort=name", "--owner=0", "--group=0", "--numeric-owner",
               "--mtime=@0", "--use-compress-program=gzip -n", "-C", dir, "-cf", "-", ".",
               (char *)NULL);
        _exit(127);
    }
    int status;
    while (waitpid(pid, &status, 0) < 0)
        if (errno != EINTR)
            return sp_err_set(e, SP_EINTERNAL, "waitpid: %s", strerror(errno));
    if (!WIFEXITED(status) || WEXITSTATUS(status) != 0)
        return sp_err_set(e, SP_EINVAL, "--context %.200s: tar failed (status %d)", dir,
                          WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status));
    return 0;
}

/* SHA-256 of the file fd (from its start) as 64 hex digits. */
static int sha256_fd(int fd, char hex[65], sp_err_t *e)
{
    EVP_MD_CTX *md = EVP_MD_CTX_new();
    unsigned char buf[1 << 16], h[32];
    unsigned int hl = 0;
    ssize_t n = 0;
    int ok =
        md != NULL && EVP_DigestInit_ex(md, EVP_sha256(), NULL) == 1 && lseek(fd, 0, SEEK_SET) == 0;
    while (ok && (n = read(fd, buf, sizeof buf)) > 0)
        ok = EVP_DigestUpdate(md, buf, (size_t)n) == 1;
    ok = ok && n == 0 && EVP_DigestFinal_ex(md, h, &hl) == 1 && hl == sizeof h;
    EVP_MD_CTX_free(md);
    if (!ok)
        return sp_err_set(e, SP_EINTERNAL, "cannot hash the build context");
    for (size_t i = 0; i < sizeof h; i++)
        snprintf(hex + 2 * i, 3, "%02x", h[i]);
    return 0;
}

/* --context DIR packed and uploaded as a template file (kept as it is when the server has
 * it already); its key in key. */
static int upload_context(spc_api_t *api, const char *dir, char key[65], sp_err_t *e)
{
    const char *td = getenv("TMPDIR");
    char path[4096];
    snprintf(path, sizeof path, "%.4000s/spacectl-context-XXXXXX", td && *td ? td : "/tmp");
    int fd = mkstemp(path);
    if (fd < 0)
        return sp_err_set(e, SP_EINTERNAL, "%.200s: %s", path, strerror(errno));
    unlink(path); /* gone with the fd */
    struct stat st;
    if (pack_context(dir, fd, e) < 0 || sha256_fd(fd, key, e) < 0) {
        close(fd);
        return -1;
    }
    if (fstat(fd, &st) < 0 || lseek(fd, 0, SEEK_SET) != 0) {
        close(fd);
        return sp_err_set(e, SP_EINTERNAL, "cannot read the packed context");
    }
    char upath[128];
    snprintf(upath, sizeof upath, "/v1/template-files/%s", key);
    spc_req_t rq = {.method = "PUT",
                    .path = upath,
                    .bearer = api->key[0] ? api->key : NULL,
                    .content_type = "application/gzip",
                    .body_from_fd = true,
                    .body_fd = fd,
                    .body_len = (size_t)st.st_size,
                    .timeout_ms = 600 * 1000};
    spc_resp_t *r = spc_http_send(&api->url, &rq, e);
    close(fd);
    int rc = r == NULL ? -1 : 0;
    if (r != NULL && (spc_resp_status(r) < 200 || spc_resp_status(r) > 299))
        rc = spc_api_error(api, r, e);
    spc_resp_free(r);
    return rc;
}

/* The build request: --file's, then the options' steps and fields over it. */
static json_t *build_request(spc_api_t *api, spc_args_t *a, sp_err_t *e)
{
    json_t *req;
    const char *file = spc_args_str(a, "file");
    if (file != NULL) {
        json_error_t je;
        req = json_load_file(file, 0, &je);
        if (!json_is_object(req)) {
            json_decref(req);
            sp_err_set(e, SP_EINVAL, "%s: not a JSON object (%s)", file, je.text);
            return NULL;
        }
    } else {
        req = json_object();
    }
    json_object_set_new(req, "name", json_string(a->pos[0]));
    const char *dockerfile = spc_args_str(a, "dockerfile");
    const char *context = spc_args_str(a, "context");
    if (dockerfile != NULL && spc_args_str(a, "from") != NULL) {
        json_decref(req);
        sp_err_set(e, SP_EINVAL, "--dockerfile and --from: the Dockerfile's FROM is the parent");
        return NULL;
    }
    if (context != NULL && dockerfile == NULL) {
        json_decref(req);
        sp_err_set(e, SP_EINVAL, "--context goes with --dockerfile");
        return NULL;
    }
    if (dockerfile != NULL) {
        char *text = read_text(dockerfile, 1u << 20, e);
        char key[65];
        if (text == NULL || (context != NULL && upload_context(api, context, key, e) < 0)) {
            free(text);
            json_decref(req);
            return NULL;
        }
        json_t *from = json_pack("{s:s}", "dockerfile", text);
        free(text);
        if (from == NULL) {
            json_decref(req);
            sp_err_set(e, SP_EINVAL, "%.200s: not UTF-8 text", dockerfile);
            return NULL;
        }
        if (context != NULL)
            json_object_set_new(from, "context", json_string(key));
        json_object_set_new(req, "from", from);
    } else if (spc_args_str(a, "from") != NULL)
        json_object_set_new(req, "from", json_string(spc_args_str(a, "from")));
    else if (json_object_get(req, "from") == NULL)
        json_object_set_new(req, "from", json_string("base"));
    json_t *steps = json_object_get(req, "steps");
    if (steps == NULL) {
        steps = json_array();
        json_object_set_new(req, "steps", steps);
    }
    size_t n;
    const char *const *env = spc_args_list(a, "env", &n);
    if (n > 0) {
        json_t *o;
        if (spc_kv_object(env, n, "--env", &o, e) < 0) {
            json_decref(req);
            return NULL;
        }
        json_array_append_new(steps, json_pack("{s:o}", "env", o));
    }
    if (spc_args_str(a, "workdir") != NULL)
        json_array_append_new(steps, json_pack("{s:s}", "workdir", spc_args_str(a, "workdir")));
    if (spc_args_str(a, "user") != NULL)
        json_array_append_new(steps, json_pack("{s:s}", "user", spc_args_str(a, "user")));
    const char *const *runs = spc_args_list(a, "run", &n);
    for (size_t i = 0; i < n; i++)
        json_array_append_new(steps, json_pack("{s:s}", "run", runs[i]));
    if (spc_args_str(a, "start-cmd") != NULL)
        json_object_set_new(req, "start_cmd", json_string(spc_args_str(a, "start-cmd")));
    if (spc_args_str(a, "ready-cmd") != NULL)
        json_object_set_new(req, "ready_cmd", json_string(spc_args_str(a, "ready-cmd")));
    if (spc_args_count(a, "cpus"))
        json_object_set_new(req, "cpu_count", json_integer(spc_args_int(a, "cpus", 0)));
    if (spc_args_count(a, "memory"))
        json_object_set_new(req, "memory_mb", json_integer(spc_args_int(a, "memory", 0)));
    if (spc_args_count(a, "force"))
        json_object_set_new(req, "force", json_true());
    return req;
}

/* Prints the log from its start while the build runs (one streamed request with follow). */
static void follow_log(spc_api_t *api, const char *logs_url, FILE *out)
{
    char path[512];
    if (snprintf(path, sizeof(path), "%s?follow=true", logs_url) >= (int)sizeof(path)) {
        fprintf(stderr, "spacectl: cannot follow the build's log: its URL is too long\n");
        return;
    }
    spc_req_t rq = {.method = "GET", .path = path, .bearer = api->key[0] ? api->key : NULL,
                    .timeout_ms = 0};
    sp_err_t e;
    spc_resp_t *r = spc_http_send(&api->url, &rq, &e);
    if (r == NULL || spc_resp_status(r) != 200) {
        if (r != NULL)
            spc_api_error(api, r, &e);
        fprintf(stderr, "spacectl: cannot follow the build's log: %s\n", e.msg);
        spc_resp_free(r);
        return;
    }
    const char *line;
    size_t len;
    while (spc_resp_line(r, &line, &len, &e) == 1) {
        json_t *o = json_loadb(line, len, 0, NULL);
        const char *text = json_string_value(json_object_get(o, "line"));
        const char *stream = json_string_value(json_object_get(o, "stream"));
        long long step = json_integer_value(json_object_get(o, "step"));
        if (text != NULL && stream != NULL && strcmp(stream, "build") != 0)
            fprintf(out, "  [%lld] %s\n", step, text);
        else if (text != NULL)
            fprintf(out, "%s\n", text);
        json_decref(o);
        fflush(out);
    }
    spc_resp_free(r);
}

static int run_build(spc_args_t *a)
{
    spc_api_t api;
    sp_err_t e;
    if (spc_api(&api) < 0)
        return SPC_EXIT_FAIL;
    json_t *req = build_request(&api, a, &e);
    if (req == NULL)
        return spc_fail(&e);
    json_t *ans;
    int rc = spc_api_call(&api, "POST", "/v1/templates", req, &ans, NULL, &e);
    json_decref(req);
    if (rc < 0)
        return spc_fail(&e);
    json_t *b = json_object_get(ans, "build");
    bool json = spc_args_count(a, "json") > 0;
    if (spc_args_count(a, "no-follow")) {
        if (json)
            rc = spc_print_json(ans);
        else
            printf("build %s of %s: %s\n", spc_str(b, "id"), spc_str(b, "template"),
                   spc_str(b, "status"));
        json_decref(ans);
        return rc;
    }
    FILE *out = json ? stderr : stdout;
    fprintf(out, "build %s of %s\n", spc_str(b, "id"), spc_str(b, "template"));
    fflush(out);
    char logs[512], path[600];
    snprintf(logs, sizeof(logs), "%s", spc_str(b, "logs_url"));
    follow_log(&api, logs, out);
    /* the log ended: the build has ended too (or the connection went: ask until it has) */
    char base[400];
    snprintf(base, sizeof(base), "%.*s", (int)(strlen(logs) - 5), logs); /* without "/logs" */
    json_decref(ans);
    for (;;) {
        snprintf(path, sizeof(path), "%s?wait=300", base);
        if (spc_api_call(&api, "GET", path, NULL, &ans, NULL, &e) < 0)
            return spc_fail(&e);
        b = json_object_get(ans, "build");
        const char *st = spc_str(b, "status");
        if (strcmp(st, "succeeded") == 0 || strcmp(st, "failed") == 0)
            break;
        json_decref(ans);
    }
    bool ok = strcmp(spc_str(b, "status"), "succeeded") == 0;
    if (json)
        spc_print_json(ans);
    else if (ok)
        printf("template %s: version %.12s ready%s\n", spc_str(b, "template"),
               spc_str(b, "version"), json_is_true(json_object_get(b, "cached")) ? " (cached)" : "");
    if (!ok)
        fprintf(stderr, "spacectl: build failed: %s\n", spc_str(b, "error"));
    json_decref(ans);
    return ok ? 0 : SPC_EXIT_FAIL;
}

static int run_delete(spc_args_t *a)
{
    char path[256];
    return spc_delete(spc_path(path, sizeof(path), "/v1/templates/%s", a->pos[0]), "template",
                      a->pos[0]);
}

const spc_verb_t spc_template_verbs[] = {
    {"list", &list_cmd, run_list},
    {"build", &build_cmd, run_build},
    {"delete", &delete_cmd, run_delete},
    {NULL, NULL, NULL},
};
