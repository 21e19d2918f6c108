/*
 * cmd_cp.c - spacectl cp: files and directory trees into and out of a sandbox, through the
 * files API (stat, list, mkdir, PUT and GET of a file's bytes).
 *
 * One side is ID:PATH. A directory is copied recursively; permission bits are kept both ways
 * (local files and directories get exactly the sandbox's bits, umask aside; the sandbox gets
 * ours through the API's mode). Bytes are streamed: an upload is read from the file as it is
 * sent, a download written as it arrives (into a temporary file beside the target, renamed
 * over it when complete), so no file is ever whole in memory. Symbolic links and special
 * files inside a tree are skipped with a warning; given directly, a link is followed.
 *
 * Like cp: a target that is an existing directory (or ends in '/') receives the source under
 * its own name; otherwise the target is the new name. A progress bar goes to stderr when it
 * is a terminal.
 */
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "cli/cmd.h"

static const spc_opt_t cp_opts[] = {
    {"user", 'u', SPC_STR, "U", "the guest user the sandbox side is read or written as "
                                "(default root)", 0, 0},
    {"quiet", 'q', SPC_FLAG, NULL, "no progress bar", 0, 0},
    {NULL, 0, 0, NULL, NULL, 0, 0},
};

static const spc_cmd_t cp_cmd = {
    "cp", "[--user U] SRC DST", "Copy files and directories into or out of a sandbox.",
    "One of SRC and DST is ID:PATH (a sandbox's path: absolute, or relative to the user's\n"
    "home); the other is a local path (write ./a:b for a local name with a colon).\n"
    "Directories are copied recursively, permission bits are kept, symbolic links inside a\n"
    "tree are skipped. A DST that is an existing directory or ends in / receives SRC under its\n"
    "own name.\n\n"
    "  spacectl cp ./data sb123:/home/user/      # -> /home/user/data\n"
    "  spacectl cp sb123:/var/log/app.log .",
    cp_opts, "SRC DST", 2, 2, false};

/* ---- the plan: what to make where, sizes for the progress bar ---- */

typedef struct {
    bool dir;
    char *src, *dst;
    unsigned mode; /* permission bits */
    uint64_t size;
} item_t;

typedef struct {
    item_t *v;
    size_t n, cap;
    uint64_t total;
} plan_t;

static int plan_add(plan_t *p, bool dir, const char *src, const char *dst, unsigned mode,
                    uint64_t size)
{
    if (p->n == p->cap) {
        size_t cap = p->cap ? p->cap * 2 : 16;
        item_t *nv = realloc(p->v, cap * sizeof(*nv));
        if (nv == NULL)
            return -1;
        p->v = nv;
        p->cap = cap;
    }
    item_t *it = &p->v[p->n];
    it->dir = dir;
    it->src = strdup(src);
    it->dst = strdup(dst);
    it->mode = mode & 07777;
    it->size = size;
    if (it->src == NULL || it->dst == NULL) {
        free(it->src);
        free(it->dst);
        return -1;
    }
    p->n++;
    if (!dir)
        p->total += size;
    return 0;
}

static void plan_free(plan_t *p)
{
    for (size_t i = 0; i < p->n; i++) {
        free(p->v[i].src);
        free(p->v[i].dst);
    }
    free(p->v);
}

static char *join(const char *dir, const char *name)
{
    size_t n = strlen(dir);
    while (n > 1 && dir[n - 1] == '/')
        n--;
    char *s = malloc(n + strlen(name) + 2);
    if (s != NULL)
        sprintf(s, "%.*s/%s", (int)n, dir, name);
    return s;
}

/* The last component of a path ("a/b/" -> "b"); "" for "/". */
static const char *base_name(const char *path, char *buf, size_t cap)
{
    size_t n = strlen(path);
    while (n > 0 && path[n - 1] == '/')
        n--;
    size_t s = n;
    while (s > 0 && path[s - 1] != '/')
        s--;
    snprintf(buf, cap, "%.*s", (int)(n - s), path + s);
    return buf;
}

/* ---- progress ---- */

typedef struct {
    bool on;
    uint64_t total, done, file_done; /* file_done: of the current file, already in done */
    struct timespec t0, last;
    const char *name;
} prog_t;

static double since(const struct timespec *a, const struct timespec *b)
{
    return (double)(b->tv_sec - a->tv_sec) + (double)(b->tv_nsec - a->tv_nsec) / 1e9;
}

static const char *human(double n, char *buf, size_t cap)
{
    static const char *const units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
    int u = 0;
    while (n >= 1024 && u < 4) {
        n /= 1024;
        u++;
    }
    snprintf(buf, cap, u ? "%.1f %s" : "%.0f %s", n, units[u]);
    return buf;
}

static void prog_draw(prog_t *g, bool final)
{
    struct timespec now;
    clock_gettime(CLOCK_MONOTONIC, &now);
    if (!final && since(&g->last, &now) < 0.1)
        return;
    g->last = now;
    double el = since(&g->t0, &now);
    int pct = g->total ? (int)(g->done * 100 / g->total) : 100;
    char a[32], b[32], c[32], bar[21];
    int fill = pct / 5;
    for (int i = 0; i < 20; i++)
        bar[i] = i < fill ? '#' : '.';
    bar[20] = '\0';
    char name[32];
    snprintf(name, sizeof(name), "%.30s", g->name ? g->name : "");
    fprintf(stderr, "\r%-30s [%s] %3d%%  %s / %s  %s/s \033[K", name, bar, pct,
            human((double)g->done, a, sizeof(a)), human((double)g->total, b, sizeof(b)),
            human(el > 0 ? (double)g->done / el : 0, c, sizeof(c)));
    if (final)
        fputc('\n', stderr);
}

static void prog_file(void *arg, uint64_t n)
{
    prog_t *g = arg;
    if (!g->on)
        return;
    g->done += n - g->file_done;
    g->file_done = n;
    prog_draw(g, false);
}

/* ---- the sandbox side ---- */

typedef struct {
    spc_api_t api;
    const char *id;
    const char *user;
} remote_t;

static const char *fs_path(sp_buf_t *q, const remote_t *r, const char *what, const char *path)
{
    sp_buf_reset(q);
    sp_buf_str(q, "/v1/sandboxes/");
    spc_urlencode(q, r->id);
    sp_buf_printf(q, "/files%s?path=", what);
    spc_urlencode(q, path);
    if (r->user != NULL) {
        sp_buf_str(q, "&user=");
        spc_urlencode(q, r->user);
    }
    return sp_buf_cstr(q);
}

/* err's message prefixed with the sandbox path it is about ("ID:PATH: ..."). Always -1. */
static int at(sp_err_t *err, const remote_t *r, const char *path)
{
    sp_err_t e = *err;
    return sp_err_set(err, e.code, "%s:%.100s: %s", r->id, path, e.msg);
}

/* The Entry of path, or NULL: *status 404 when it does not exist (or the sandbox does not). */
static json_t *remote_stat(remote_t *r, const char *path, int *status, sp_err_t *err)
{
    sp_buf_t q = SP_BUF_INIT;
    json_t *ent = NULL;
    spc_api_call(&r->api, "GET", fs_path(&q, r, "/stat", path), NULL, &ent, status, err);
    sp_buf_free(&q);
    return ent;
}

/* What a stat entry is, links resolved: "file", "dir", or something else. */
static const char *kind_of(const json_t *ent)
{
    const char *t = spc_str(ent, "type");
    return strcmp(t, "symlink") == 0 ? spc_str(ent, "target_type") : t;
}

static unsigned mode_of(const json_t *ent)
{
    json_t *m = json_object_get(ent, strcmp(spc_str(ent, "type"), "symlink") == 0 ? "target_mode"
                                                                                   : "mode");
    return (unsigned)json_integer_value(m);
}

/* ---- local -> sandbox ---- */

static int walk_local(plan_t *p, const char *src, const char *dst, sp_err_t *err)
{
    DIR *d = opendir(src);
    if (d == NULL)
        return sp_err_set(err, SP_EINVAL, "%.100s: %s", src, strerror(errno));
    struct dirent *de;
    int rc = 0;
    while (rc == 0 && (errno = 0, de = readdir(d)) != NULL) {
        if (strcmp(de->d_name, ".") == 0 || strcmp(de->d_name, "..") == 0)
            continue;
        char *s = join(src, de->d_name), *t = join(dst, de->d_name);
        struct stat st;
        if (s == NULL || t == NULL)
            rc = sp_err_set(err, SP_EINTERNAL, "out of memory");
        else if (lstat(s, &st) < 0)
            rc = sp_err_set(err, SP_EINVAL, "%.100s: %s", s, strerror(errno));
        else if (S_ISDIR(st.st_mode))
            rc = plan_add(p, true, s, t, st.st_mode, 0) < 0
                     ? sp_err_set(err, SP_EINTERNAL, "out of memory")
                     : walk_local(p, s, t, err);
        else if (S_ISREG(st.st_mode))
            rc = plan_add(p, false, s, t, st.st_mode, (uint64_t)st.st_size) < 0
                     ? sp_err_set(err, SP_EINTERNAL, "out of memory")
                     : 0;
        else
            fprintf(stderr, "spacectl: skipping %s: %s\n", s,
                    S_ISLNK(st.st_mode) ? "a symbolic link" : "not a file or directory");
        free(s);
        free(t);
    }
    if (rc == 0 && errno != 0)
        rc = sp_err_set(err, SP_EINVAL, "%.100s: %s", src, strerror(errno));
    closedir(d);
    return rc;
}

static int put_file(remote_t *r, const item_t *it, prog_t *g, sp_err_t *err)
{
    int fd = open(it->src, O_RDONLY | O_CLOEXEC);
    if (fd < 0)
        return sp_err_set(err, SP_EINVAL, "%.100s: %s", it->src, strerror(errno));
    struct stat st;
    if (fstat(fd, &st) < 0 || !S_ISREG(st.st_mode)) {
        close(fd);
        return sp_err_set(err, SP_EINVAL, "%.100s: not a regular file", it->src);
    }
    sp_buf_t q = SP_BUF_INIT;
    fs_path(&q, r, "", it->dst);
    sp_buf_printf(&q, "&mode=%04o", it->mode);
    g->name = it->dst;
    g->file_done = 0;
    spc_req_t rq = {.method = "PUT", .path = sp_buf_cstr(&q), .bearer = r->api.key,
                    .content_type = "application/octet-stream", .body_from_fd = true,
                    .body_fd = fd, .body_len = (size_t)st.st_size, .progress = prog_file,
                    .progress_arg = g, .timeout_ms = 600 * 1000};
    spc_resp_t *resp = spc_http_send(&r->api.url, &rq, err);
    close(fd);
    sp_buf_free(&q);
    int rc = resp == NULL ? -1 : 0;
    if (resp != NULL && (spc_resp_status(resp) < 200 || spc_resp_status(resp) > 299)) {
        spc_api_error(&r->api, resp, err);
        rc = at(err, r, it->dst);
    }
    spc_resp_free(resp);
    /* The bytes of a file that changed size under us were counted as its stat said. */
    g->done += it->size - g->file_done;
    return rc;
}

static int mkdir_remote(remote_t *r, const item_t *it, sp_err_t *err)
{
    char path[512];
    json_t *body = json_pack("{s:s,s:i}", "path", it->dst, "mode", (int)it->mode);
    if (r->user != NULL)
        json_object_set_new(body, "user", json_string(r->user));
    int rc = spc_api_call(&r->api, "POST",
                          spc_path(path, sizeof(path), "/v1/sandboxes/%s/files/mkdir", r->id),
                          body, NULL, NULL, err);
    json_decref(body);
    return rc < 0 ? at(err, r, it->dst) : 0;
}

static int upload(remote_t *r, const char *src, const char *dst, prog_t *g, sp_err_t *err)
{
    struct stat st;
    if (stat(src, &st) < 0)
        return sp_err_set(err, SP_EINVAL, "%.100s: %s", src, strerror(errno));
    if (!S_ISDIR(st.st_mode) && !S_ISREG(st.st_mode))
        return sp_err_set(err, SP_EINVAL, "%.100s: not a file or directory", src);
    int status;
    char name[256];
    sp_err_t e2;
    json_t *ent = remote_stat(r, dst, &status, &e2);
    if (ent == NULL && status != 404) {
        *err = e2;
        return at(err, r, dst);
    }
    bool into = (ent != NULL && strcmp(kind_of(ent), "dir") == 0) || dst[strlen(dst) - 1] == '/';
    if (ent != NULL && !into && S_ISDIR(st.st_mode)) {
        json_decref(ent);
        return sp_err_set(err, SP_EINVAL, "%.100s exists in the sandbox and is not a directory",
                          dst);
    }
    json_decref(ent);
    char *target = into ? join(dst, base_name(src, name, sizeof(name))) : strdup(dst);
    plan_t p = {0};
    int rc = target == NULL || plan_add(&p, S_ISDIR(st.st_mode), src, target, st.st_mode,
                                        (uint64_t)st.st_size) < 0
                 ? sp_err_set(err, SP_EINTERNAL, "out of memory")
                 : 0;
    if (rc == 0 && S_ISDIR(st.st_mode))
        rc = walk_local(&p, src, target, err);
    g->total = p.total;
    for (size_t i = 0; rc == 0 && i < p.n; i++)
        rc = p.v[i].dir ? mkdir_remote(r, &p.v[i], err) : put_file(r, &p.v[i], g, err);
    free(target);
    plan_free(&p);
    return rc;
}

/* ---- sandbox -> local ---- */

static int walk_remote(remote_t *r, plan_t *p, const char *src, const char *dst, sp_err_t *err)
{
    sp_buf_t q = SP_BUF_INIT;
    json_t *ans;
    int rc = spc_api_call(&r->api, "GET", fs_path(&q, r, "/list", src), NULL, &ans, NULL, err);
    sp_buf_free(&q);
    if (rc < 0)
        return at(err, r, src);
    if (json_is_true(json_object_get(ans, "truncated"))) {
        json_decref(ans);
        return sp_err_set(err, SP_ETOOBIG, "%.100s holds more entries than one listing gives",
                          src);
    }
    size_t i;
    json_t *ent;
    json_array_foreach(json_object_get(ans, "entries"), i, ent)
    {
        const char *name = spc_str(ent, "name"), *type = spc_str(ent, "type");
        const char *path = spc_str(ent, "path");
        if (name[0] == '\0' || strchr(name, '/') != NULL || strcmp(name, ".") == 0 ||
            strcmp(name, "..") == 0) {
            rc = sp_err_set(err, SP_EUNAVAIL, "the sandbox listed a strange name in %.100s", src);
            break;
        }
        char *t = join(dst, name);
        if (t == NULL) {
            rc = sp_err_set(err, SP_EINTERNAL, "out of memory");
        } else if (strcmp(type, "dir") == 0) {
            rc = plan_add(p, true, path, t, mode_of(ent), 0) < 0
                     ? sp_err_set(err, SP_EINTERNAL, "out of memory")
                     : walk_remote(r, p, path, t, err);
        } else if (strcmp(type, "file") == 0) {
            rc = plan_add(p, false, path, t, mode_of(ent),
                          (uint64_t)json_integer_value(json_object_get(ent, "size"))) < 0
                     ? sp_err_set(err, SP_EINTERNAL, "out of memory")
                     : 0;
        } else {
            fprintf(stderr, "spacectl: skipping %s: %s\n", path,
                    strcmp(type, "symlink") == 0 ? "a symbolic link" : "not a file or directory");
        }
        free(t);
        if (rc < 0)
            break;
    }
    json_decref(ans);
    return rc;
}

static int get_file(remote_t *r, const item_t *it, prog_t *g, sp_err_t *err)
{
    sp_buf_t q = SP_BUF_INIT;
    fs_path(&q, r, "", it->src);
    spc_req_t rq = {.method = "GET", .path = sp_buf_cstr(&q), .bearer = r->api.key,
                    .timeout_ms = 600 * 1000};
    spc_resp_t *resp = spc_http_send(&r->api.url, &rq, err);
    sp_buf_free(&q);
    if (resp == NULL)
        return -1;
    if (spc_resp_status(resp) != 200) {
        spc_api_error(&r->api, resp, err);
        spc_resp_free(resp);
        return at(err, r, it->src);
    }
    char *tmp = malloc(strlen(it->dst) + 32);
    if (tmp == NULL) {
        spc_resp_free(resp);
        return sp_err_set(err, SP_EINTERNAL, "out of memory");
    }
    sprintf(tmp, "%s.spacectl-%d", it->dst, (int)getpid());
    int fd = open(tmp, O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
    int rc = fd < 0 ? sp_err_set(err, SP_EINVAL, "%.100s: %s", tmp, strerror(errno)) : 0;
    g->name = it->dst;
    g->file_done = 0;
    uint64_t got = 0;
    uint8_t *buf = rc == 0 ? malloc(256 * 1024) : NULL;
    if (rc == 0 && buf == NULL)
        rc = sp_err_set(err, SP_EINTERNAL, "out of memory");
    while (rc == 0) {
        long k = spc_resp_read(resp, buf, 256 * 1024, err);
        if (k <= 0) {
            rc = k < 0 ? -1 : 0;
            break;
        }
        for (long off = 0; off < k && rc == 0;) {
            ssize_t w = write(fd, buf + off, (size_t)(k - off));
            if (w < 0 && errno == EINTR)
                continue;
            if (w < 0)
                rc = sp_err_set(err, SP_EINVAL, "%.100s: %s", it->dst, strerror(errno));
            else
                off += w;
        }
        got += (uint64_t)k;
        prog_file(g, got);
    }
    free(buf);
    spc_resp_free(resp);
    /* Exactly the sandbox's bits, whatever our umask says (like cp -p). */
    if (rc == 0 && (fchmod(fd, it->mode) < 0 || fsync(fd) < 0))
        rc = sp_err_set(err, SP_EINVAL, "%.100s: %s", it->dst, strerror(errno));
    if (fd >= 0 && close(fd) < 0 && rc == 0)
        rc = sp_err_set(err, SP_EINVAL, "%.100s: %s", it->dst, strerror(errno));
    if (rc == 0 && rename(tmp, it->dst) < 0)
        rc = sp_err_set(err, SP_EINVAL, "%.100s: %s", it->dst, strerror(errno));
    if (rc < 0 && fd >= 0)
        unlink(tmp);
    free(tmp);
    g->done += it->size > got ? it->size - got : 0; /* a file that shrank since the listing */
    return rc;
}

static int download(remote_t *r, const char *src, const char *dst, prog_t *g, sp_err_t *err)
{
    int status;
    json_t *ent = remote_stat(r, src, &status, err);
    if (ent == NULL)
        return at(err, r, src);
    const char *kind = kind_of(ent);
    bool dir = strcmp(kind, "dir") == 0;
    if (!dir && strcmp(kind, "file") != 0) {
        json_decref(ent);
        return sp_err_set(err, SP_EINVAL, "%.100s in the sandbox is not a file or directory",
                          src);
    }
    unsigned mode = mode_of(ent);
    uint64_t size = (uint64_t)json_integer_value(json_object_get(ent, "size"));
    json_decref(ent);
    struct stat st;
    char name[256];
    bool exists = stat(dst, &st) == 0;
    bool into = (exists && S_ISDIR(st.st_mode)) || dst[strlen(dst) - 1] == '/';
    if (exists && !into && dir)
        return sp_err_set(err, SP_EINVAL, "%.100s exists and is not a directory", dst);
    char *target = into ? join(dst, base_name(src, name, sizeof(name))) : strdup(dst);
    plan_t p = {0};
    int rc = target == NULL || plan_add(&p, dir, src, target, mode, dir ? 0 : size) < 0
                 ? sp_err_set(err, SP_EINTERNAL, "out of memory")
                 : 0;
    if (rc == 0 && dir)
        rc = walk_remote(r, &p, src, target, err);
    g->total = p.total;
    /* Directories are made writable for us first and get their own bits once full. */
    for (size_t i = 0; rc == 0 && i < p.n; i++) {
        if (!p.v[i].dir)
            rc = get_file(r, &p.v[i], g, err);
        else if (mkdir(p.v[i].dst, 0700) < 0 && errno != EEXIST)
            rc = sp_err_set(err, SP_EINVAL, "%.100s: %s", p.v[i].dst, strerror(errno));
    }
    for (size_t i = p.n; rc == 0 && i-- > 0;)
        if (p.v[i].dir && chmod(p.v[i].dst, p.v[i].mode) < 0)
            rc = sp_err_set(err, SP_EINVAL, "%.100s: %s", p.v[i].dst, strerror(errno));
    free(target);
    plan_free(&p);
    return rc;
}

/* ---- the command ---- */

/* "ID:PATH" -> id and path (pointing into s); false for a local path. */
static bool remote_arg(const char *s, char *id, size_t cap, const char **path)
{
    const char *colon = strchr(s, ':');
    if (colon == NULL || colon == s || (size_t)(colon - s) >= cap || (size_t)(colon - s) > 64)
        return false;
    for (const char *p = s; p < colon; p++)
        if (!((*p >= 'a' && *p <= 'z') || (*p >= '0' && *p <= '9')))
            return false;
    snprintf(id, cap, "%.*s", (int)(colon - s), s);
    *path = colon + 1;
    return true;
}

static int run_cp(spc_args_t *a)
{
    char sid[72], did[72];
    const char *spath, *dpath;
    bool sr = remote_arg(a->pos[0], sid, sizeof(sid), &spath);
    bool dr = remote_arg(a->pos[1], did, sizeof(did), &dpath);
    if (sr == dr) {
        fprintf(stderr, "spacectl: %s\n", sr ? "copying from one sandbox to another is not "
                                               "offered: copy through a local directory"
                                             : "one of SRC and DST must be ID:PATH (a sandbox's "
                                               "path)");
        return SPC_EXIT_USAGE;
    }
    const char *rpath = sr ? spath : dpath, *lpath = sr ? a->pos[1] : a->pos[0];
    if (rpath[0] == '\0' || lpath[0] == '\0') {
        fprintf(stderr, "spacectl: empty path in %s\n", sr ? a->pos[0] : a->pos[1]);
        return SPC_EXIT_USAGE;
    }
    remote_t r = {.id = sr ? sid : did, .user = spc_args_str(a, "user")};
    if (spc_api(&r.api) < 0)
        return SPC_EXIT_FAIL;
    prog_t g = {.on = isatty(STDERR_FILENO) && !spc_args_count(a, "quiet")};
    clock_gettime(CLOCK_MONOTONIC, &g.t0);
    sp_err_t e;
    int rc = sr ? download(&r, rpath, lpath, &g, &e) : upload(&r, lpath, rpath, &g, &e);
    if (g.on && g.name != NULL) {
        g.name = rc == 0 ? "done" : "failed";
        prog_draw(&g, true);
    }
    return rc < 0 ? spc_fail(&e) : 0;
}

const spc_verb_t spc_cp_verbs[] = {{NULL, &cp_cmd, run_cp}};
