/*
 * envd_fs.c - filesystem.Filesystem over core/channel/exec.h: Stat, MakeDir, Move, ListDir, Remove,
 * WatchDir (stream), and the polling watchers CreateWatcher / GetWatcherEvents /
 * RemoveWatcher.
 *
 * EntryInfo describes a symlink by the entry it finally names (type and permission bits), as
 * envd does, with symlinkTarget the resolved path; the agent reports both with the link.
 *
 * Owns the watcher table: each watcher is an agent WATCH stream whose events are buffered
 * (at most WATCHER_EVENTS_MAX, the oldest dropped) until polled; a watcher nobody polled for
 * WATCHER_IDLE_MS is removed. Knows no process state.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "base/ids.h"
#include "base/log.h"
#include "e2b-gateway/envd_int.h"

#define WATCHER_EVENTS_MAX 10000
#define WATCHER_IDLE_MS    (5u * 60 * 1000)
#define WATCHERS_MAX       1024
#define WATCH_PENDING_MAX  (4u * 1024 * 1024) /* WatchDir bytes queued for a slow client */

/* ---- entries ---- */

static const char *acopy(sp_carena_t *a, const char *s)
{
    if (s == NULL)
        return NULL;
    size_t n = strlen(s);
    char *d = sp_carena_alloc(a, n + 1);
    if (d != NULL)
        memcpy(d, s, n + 1);
    return d;
}

static int parse_mtime(const char *s, sp_ctime_t *t)
{
    int Y, M, D, h, m, sec, ms = 0;
    if (s == NULL || sscanf(s, "%4d-%2d-%2dT%2d:%2d:%2d.%3d", &Y, &M, &D, &h, &m, &sec, &ms) < 6)
        return -1;
    struct tm tm = {.tm_year = Y - 1900,
                    .tm_mon = M - 1,
                    .tm_mday = D,
                    .tm_hour = h,
                    .tm_min = m,
                    .tm_sec = sec};
    t->seconds = (int64_t)timegm(&tm);
    t->nanos = ms * 1000000;
    return 0;
}

/* Go's os.FileMode.String() of an lstat mode, which is envd's `permissions`: one letter per
 * type and special bit in Go's order (d L D p S u g c t), "-" when none, then rwx x3. */
static void go_mode_string(char out[16], const char *type, const char *special, uint32_t mode)
{
    int w = 0;
    bool chr = special && strcmp(special, "char") == 0;
    if (type && strcmp(type, "dir") == 0)
        out[w++] = 'd';
    if (type && strcmp(type, "symlink") == 0)
        out[w++] = 'L';
    if (chr || (special && strcmp(special, "block") == 0))
        out[w++] = 'D';
    if (special && strcmp(special, "fifo") == 0)
        out[w++] = 'p';
    if (special && strcmp(special, "socket") == 0)
        out[w++] = 'S';
    if (mode & 04000)
        out[w++] = 'u';
    if (mode & 02000)
        out[w++] = 'g';
    if (chr)
        out[w++] = 'c';
    if (mode & 01000)
        out[w++] = 't';
    if (w == 0)
        out[w++] = '-';
    static const char rwx[] = "rwxrwxrwx";
    for (int i = 0; i < 9; i++)
        out[w++] = (mode & (0400u >> i)) ? rwx[i] : '-';
    out[w] = '\0';
}

int sp_e2b__envd_entry(json_t *e, sp_cf_entry_t *out, sp_carena_t *a)
{
    memset(out, 0, sizeof(*out));
    const char *type = json_string_value(json_object_get(e, "type"));
    const char *special = json_string_value(json_object_get(e, "special"));
    uint32_t mode = (uint32_t)json_integer_value(json_object_get(e, "mode"));
    bool link = type && strcmp(type, "symlink") == 0;
    /* envd describes a link by what it finally names: that entry's type (unknown when it does
     * not resolve) and permission bits; symlinkTarget is the resolved path. */
    const char *what = type;
    uint32_t perm = mode & 0777;
    if (link) {
        const char *target = json_string_value(json_object_get(e, "target"));
        what = json_string_value(json_object_get(e, "target_type"));
        perm = (uint32_t)json_integer_value(json_object_get(e, "target_mode")) & 0777;
        out->symlink_target = acopy(a, target ? target : json_string_value(json_object_get(e, "path")));
        out->has_symlink_target = true;
    }
    out->name = acopy(a, json_string_value(json_object_get(e, "name")));
    out->path = acopy(a, json_string_value(json_object_get(e, "path")));
    out->owner = acopy(a, json_string_value(json_object_get(e, "owner")));
    out->group = acopy(a, json_string_value(json_object_get(e, "group")));
    out->type = what && strcmp(what, "dir") == 0    ? SP_CF_TYPE_DIRECTORY
                : what && strcmp(what, "file") == 0 ? SP_CF_TYPE_FILE
                                                    : SP_CF_TYPE_UNSPECIFIED;
    out->size = (int64_t)json_integer_value(json_object_get(e, "size"));
    out->mode = perm; /* Go's FileMode.Perm(): no type or special bits */
    char *p = sp_carena_alloc(a, 16);
    if (p != NULL)
        go_mode_string(p, type, special, mode);
    out->permissions = p;
    if (parse_mtime(json_string_value(json_object_get(e, "mtime")), &out->modified_time) == 0)
        out->has_modified_time = true;
    return out->name && out->path && out->permissions ? 0 : -1;
}

/* ---- Stat / MakeDir / Move ---- */

typedef struct {
    sp_cf_entry_resp_t one;
    sp_cf_listdir_resp_t list;
} fsdata_t;

static fsdata_t *fsdata(envd_call_t *c)
{
    if (c->data == NULL) {
        c->data = calloc(1, sizeof(fsdata_t));
        c->data_free = free;
    }
    return c->data;
}

static void fs_fail(envd_call_t *c, const sp_err_t *err)
{
    sp_e2b__envd_fail_err(c, err);
}

static void on_entry(void *arg, json_t *entry, const sp_err_t *err)
{
    envd_call_t *c = arg;
    if (err != NULL) {
        fs_fail(c, err);
        return;
    }
    fsdata_t *d = c->data;
    if (entry == NULL || sp_e2b__envd_entry(entry, &d->one.entry, &c->arena) < 0) {
        sp_e2b__envd_fail(c, SP_CC_INTERNAL, "malformed entry");
        return;
    }
    d->one.has_entry = true;
    sp_e2b__envd_reply(c, &sp_cd_entry_resp, &d->one);
}

static void fs_op(envd_call_t *c, sp_exec_fsop_t op, const char *path, const char *dest,
                  uint32_t depth, void (*cb)(void *, json_t *, const sp_err_t *))
{
    sp_err_t e;
    fsdata_t *d = fsdata(c);
    if (d == NULL) {
        sp_e2b__envd_fail(c, SP_CC_INTERNAL, "out of memory");
        return;
    }
    sp_exec_fs_req_t fr = {
        .op = op, .path = path, .dest = dest, .user = c->user, .depth = depth, .recursive = true};
    if (sp_exec_fs(c->ev->loop, c->conn, &fr, cb, c, &e) == NULL)
        fs_fail(c, &e);
}

static void rpc_stat(envd_call_t *c)
{
    sp_cf_path_req_t *m = c->msg;
    fs_op(c, SP_EXEC_FS_STAT, m->path, NULL, 0, on_entry);
}

static void mkdir_statted(void *arg, json_t *entry, const sp_err_t *err)
{
    envd_call_t *c = arg;
    sp_cf_path_req_t *m = c->msg;
    if (err == NULL) {
        const char *type = json_string_value(json_object_get(entry, "type"));
        if (type != NULL && strcmp(type, "dir") == 0)
            sp_e2b__envd_fail(c, SP_CC_ALREADY_EXISTS, "directory already exists");
        else
            sp_e2b__envd_fail(c, SP_CC_INVALID_ARGUMENT, "path exists and is not a directory");
        return;
    }
    if (err->code != SP_ENOTFOUND || sp_e2b__envd_code(err) == SP_CC_UNAUTHENTICATED) {
        fs_fail(c, err);
        return;
    }
    /* Inside the stat's callback: the channel is alive. */
    fs_op(c, SP_EXEC_FS_MKDIR, m->path, NULL, 0, on_entry);
}

static void rpc_make_dir(envd_call_t *c)
{
    sp_cf_path_req_t *m = c->msg;
    fs_op(c, SP_EXEC_FS_STAT, m->path, NULL, 0, mkdir_statted);
}

static void rpc_move(envd_call_t *c)
{
    sp_cf_move_req_t *m = c->msg;
    if (m->destination == NULL || m->destination[0] == '\0') {
        sp_e2b__envd_fail(c, SP_CC_INVALID_ARGUMENT, "destination is required");
        return;
    }
    fs_op(c, SP_EXEC_FS_MOVE, m->source, m->destination, 0, on_entry);
}

static void on_removed(void *arg, json_t *entry, const sp_err_t *err)
{
    envd_call_t *c = arg;
    if (err != NULL) {
        fs_fail(c, err);
        return;
    }
    sp_cempty_t empty = {0};
    sp_e2b__envd_reply(c, &sp_cd_empty, &empty);
}

static void rpc_remove(envd_call_t *c)
{
    sp_cf_path_req_t *m = c->msg;
    fs_op(c, SP_EXEC_FS_REMOVE, m->path, NULL, 0, on_removed);
}

/* ---- ListDir ---- */

static void on_list(void *arg, json_t *res, const sp_err_t *err)
{
    envd_call_t *c = arg;
    if (err != NULL) {
        fs_fail(c, err);
        return;
    }
    fsdata_t *d = c->data;
    json_t *entries = json_object_get(res, "entries");
    size_t n = json_array_size(entries);
    d->list.entries = sp_carena_alloc(&c->arena, (n + 1) * sizeof(sp_cf_entry_t));
    if (d->list.entries == NULL) {
        sp_e2b__envd_fail(c, SP_CC_RESOURCE_EXHAUSTED, "directory listing too large");
        return;
    }
    size_t i;
    json_t *e;
    json_array_foreach(entries, i, e)
    {
        if (sp_e2b__envd_entry(e, &d->list.entries[d->list.n_entries], &c->arena) == 0)
            d->list.n_entries++;
    }
    sp_e2b__envd_reply(c, &sp_cd_listdir_resp, &d->list);
}

static void rpc_list_dir(envd_call_t *c)
{
    sp_cf_listdir_req_t *m = c->msg;
    uint32_t depth = m->depth == 0 ? 1 : m->depth;
    if (depth > 64)
        depth = 64;
    fs_op(c, SP_EXEC_FS_LIST, m->path, NULL, depth, on_list);
}

/* ---- watches: shared pieces ---- */

static int ev_types(uint32_t bits, int32_t out[5])
{
    int n = 0;
    if (bits & SP_AP_EV_CREATE)
        out[n++] = SP_CF_EV_CREATE;
    if (bits & SP_AP_EV_WRITE)
        out[n++] = SP_CF_EV_WRITE;
    if (bits & SP_AP_EV_REMOVE)
        out[n++] = SP_CF_EV_REMOVE;
    if (bits & SP_AP_EV_RENAME)
        out[n++] = SP_CF_EV_RENAME;
    if (bits & SP_AP_EV_CHMOD)
        out[n++] = SP_CF_EV_CHMOD;
    return n;
}

/* The event's name relative to the watched directory (envd reports it so). */
static const char *rel_name(const char *root, const char *path, const char *name)
{
    size_t rl = strlen(root);
    while (rl > 1 && root[rl - 1] == '/')
        rl--;
    if (strncmp(path, root, rl) == 0 && path[rl] == '/' && path[rl + 1] != '\0')
        return path + rl + 1;
    return name;
}

/*
 * The agent writes files atomically (a temporary ".<name>.sp-<pid>-<n>" beside the file, then
 * rename), where envd writes in place. So a watcher sees the temporary file's events and a
 * rename onto the name; envd clients wait for create/write of the name. Translated here: the
 * temporary file's events are dropped, and the rename that lands it reads as create + write.
 * pending holds the name (relative) whose temporary file was last renamed away.
 */
static bool tmp_of(const char *rel, char *orig, size_t cap)
{
    const char *base = strrchr(rel, '/');
    size_t dl = base ? (size_t)(base - rel) + 1 : 0;
    base = base ? base + 1 : rel;
    if (base[0] != '.')
        return false;
    const char *sp = strstr(base, ".sp-");
    if (sp == NULL || sp == base + 1)
        return false;
    const char *p = sp + 4, *dash = NULL;
    for (; *p; p++) {
        if (*p == '-' && dash == NULL)
            dash = p;
        else if (*p < '0' || *p > '9')
            return false;
    }
    if (dash == NULL || dash == sp + 4 || dash[1] == '\0')
        return false;
    size_t bl = (size_t)(sp - base - 1);
    if (dl + bl + 1 > cap)
        return false;
    memcpy(orig, rel, dl);
    memcpy(orig + dl, base + 1, bl);
    orig[dl + bl] = '\0';
    return true;
}

/* Fills out[] with the envd event types for one agent event on rel; returns the count. */
static int translate(char *pending, size_t cap, const char *rel, uint32_t bits, int32_t out[5])
{
    char orig[SP_EXEC_PATH_MAX + 1];
    if (tmp_of(rel, orig, sizeof(orig))) {
        if (bits & SP_AP_EV_RENAME)
            snprintf(pending, cap, "%s", orig);
        return 0;
    }
    if ((bits & SP_AP_EV_RENAME) && pending[0] != '\0' && strcmp(pending, rel) == 0) {
        pending[0] = '\0';
        out[0] = SP_CF_EV_CREATE;
        out[1] = SP_CF_EV_WRITE;
        return 2;
    }
    return ev_types(bits, out);
}

/* The watch target must be a directory: stat first, then watch its absolute path. */
typedef void (*watch_next_t)(envd_call_t *c, const char *root);

typedef struct {
    watch_next_t next;
    sp_agentconn_t *conn;
} wstat_t;

static void watch_statted(void *arg, json_t *entry, const sp_err_t *err)
{
    envd_call_t *c = arg;
    wstat_t *w = c->data;
    if (err != NULL) {
        fs_fail(c, err);
        return;
    }
    const char *type = json_string_value(json_object_get(entry, "type"));
    const char *path = json_string_value(json_object_get(entry, "path"));
    if (type == NULL || strcmp(type, "dir") != 0 || path == NULL) {
        sp_e2b__envd_fail(c, SP_CC_INVALID_ARGUMENT, "path is not a directory");
        return;
    }
    const char *root = acopy(&c->arena, path);
    watch_next_t next = w->next;
    c->conn = w->conn; /* valid inside this callback */
    free(c->data);
    c->data = NULL;
    c->data_free = NULL;
    if (root == NULL)
        sp_e2b__envd_fail(c, SP_CC_INTERNAL, "out of memory");
    else
        next(c, root);
}

static void watch_stat(envd_call_t *c, const char *path, watch_next_t next)
{
    wstat_t *w = calloc(1, sizeof(*w));
    if (w == NULL) {
        sp_e2b__envd_fail(c, SP_CC_INTERNAL, "out of memory");
        return;
    }
    w->next = next;
    w->conn = c->conn;
    c->data = w;
    c->data_free = free;
    sp_exec_fs_req_t fr = {.op = SP_EXEC_FS_STAT, .path = path, .user = c->user};
    sp_err_t e;
    if (sp_exec_fs(c->ev->loop, c->conn, &fr, watch_statted, c, &e) == NULL)
        fs_fail(c, &e);
}

/* ---- WatchDir (stream) ---- */

typedef struct {
    envd_call_t *c; /* until started */
    sp_stream_t *st;
    sp_exec_t *op;
    sp_connect_codec_t codec;
    char *root;
    sp_timer_t ka, deadline;
    uint32_t ka_ms, timeout_ms;
    char pending[SP_EXEC_PATH_MAX + 1];
} wd_t;

static void wd_free(wd_t *w)
{
    sp_exec_cancel(w->op);
    sp_timer_stop(&w->ka);
    sp_timer_stop(&w->deadline);
    if (w->c != NULL)
        sp_e2b__envd_call_free(w->c);
    free(w->root);
    free(w);
}

static void wd_gone(void *arg)
{
    wd_t *w = arg;
    w->st = NULL;
    wd_free(w);
}

static const sp_stream_cbs_t wd_cbs = {NULL, wd_gone};

static void wd_send(wd_t *w, const sp_cf_watch_resp_t *m)
{
    sp_timer_start(&w->ka, w->ka_ms);
    if (sp_stream_pending(w->st) > WATCH_PENDING_MAX) {
        sp_log(SP_LOG_WARN, "envd", "WatchDir client is not reading: event dropped");
        return;
    }
    sp_connect_stream_msg(w->st, w->codec, &sp_cd_watch_resp, m, 0);
}

static void wd_started(void *arg)
{
    wd_t *w = arg;
    h2o_req_t *req = sp_e2b__envd_take(w->c);
    w->c = NULL;
    if (req != NULL)
        w->st = sp_stream_start(req, 200, sp_connect_stream_ctype(w->codec), -1, &wd_cbs, w);
    if (w->st == NULL) {
        if (req != NULL)
            sp_connect_reply_error(req, SP_CC_INTERNAL, "out of memory");
        wd_free(w);
        return;
    }
    sp_cf_watch_resp_t m = {.has_start = true};
    wd_send(w, &m);
    if (w->timeout_ms > 0)
        sp_timer_start(&w->deadline, w->timeout_ms);
}

static void wd_event(void *arg, const char *path, const char *name, uint32_t bits, uint32_t ftype)
{
    wd_t *w = arg;
    if (w->st == NULL)
        return;
    int32_t types[5];
    const char *rel = rel_name(w->root, path, name);
    int n = translate(w->pending, sizeof(w->pending), rel, bits, types);
    for (int i = 0; i < n; i++) {
        sp_cf_watch_resp_t m = {.has_filesystem = true};
        m.filesystem.name = rel;
        m.filesystem.type = types[i];
        wd_send(w, &m);
    }
}

static void wd_done(void *arg, const sp_err_t *err)
{
    wd_t *w = arg;
    w->op = NULL;
    if (w->st == NULL) {
        envd_call_t *c = w->c;
        w->c = NULL;
        sp_e2b__envd_fail_err(c, err);
    } else {
        sp_connect_stream_finish(w->st, sp_e2b__envd_code(err), err->msg);
        w->st = NULL;
    }
    wd_free(w);
}

static const sp_exec_watch_cbs_t wd_watch_cbs = {wd_started, wd_event, wd_done};

static void wd_ka(sp_timer_t *t, void *arg)
{
    wd_t *w = arg;
    if (w->st == NULL)
        return;
    sp_cf_watch_resp_t m = {.has_keepalive = true};
    wd_send(w, &m);
}

static void wd_deadline(sp_timer_t *t, void *arg)
{
    wd_t *w = arg;
    if (w->st != NULL) {
        sp_connect_stream_finish(w->st, SP_CC_DEADLINE_EXCEEDED, "stream deadline exceeded");
        w->st = NULL;
    }
    wd_free(w);
}

static void watchdir_start(envd_call_t *c, const char *root)
{
    sp_cf_watch_req_t *m = c->msg;
    wd_t *w = calloc(1, sizeof(*w));
    if (w == NULL || (w->root = strdup(root)) == NULL) {
        free(w);
        sp_e2b__envd_fail(c, SP_CC_INTERNAL, "out of memory");
        return;
    }
    w->c = c;
    w->codec = c->cr.codec;
    w->ka_ms = c->cr.keepalive_s * 1000u;
    w->timeout_ms = c->cr.timeout_ms;
    sp_timer_init(&w->ka, c->ev->loop, wd_ka, w);
    sp_timer_init(&w->deadline, c->ev->loop, wd_deadline, w);
    sp_err_t e;
    w->op = sp_exec_watch(c->ev->loop, c->conn, root, c->user, m->recursive, &wd_watch_cbs, w, &e);
    if (w->op == NULL) {
        w->c = NULL;
        wd_free(w);
        sp_e2b__envd_fail_err(c, &e);
    }
}

static void rpc_watch_dir(envd_call_t *c)
{
    sp_cf_watch_req_t *m = c->msg;
    if (!c->cr.streaming) {
        sp_e2b__envd_fail(c, SP_CC_INVALID_ARGUMENT, "WatchDir is a server-streaming RPC");
        return;
    }
    watch_stat(c, m->path, watchdir_start);
}

/* ---- polling watchers ---- */

typedef struct {
    char *name;
    int32_t type;
} wev_t;

struct envd_watcher {
    envd_watcher_t *next;
    struct sp_envd *ev;
    envd_call_t *c; /* CreateWatcher, until the watch started */
    char id[48];
    char sandbox_id[65];
    sp_exec_t *op;
    char *root;
    wev_t *events; /* ring of WATCHER_EVENTS_MAX */
    size_t head, count;
    uint64_t polled_ms;
    bool failed;
    char why[160];
    char pending[SP_EXEC_PATH_MAX + 1];
};

static void watcher_clear(envd_watcher_t *w)
{
    for (size_t i = 0; i < w->count; i++)
        free(w->events[(w->head + i) % WATCHER_EVENTS_MAX].name);
    w->head = w->count = 0;
}

static void watcher_free(envd_watcher_t *w)
{
    for (envd_watcher_t **pp = &w->ev->watchers; *pp != NULL; pp = &(*pp)->next)
        if (*pp == w) {
            *pp = w->next;
            w->ev->nwatchers--;
            break;
        }
    sp_exec_cancel(w->op);
    if (w->c != NULL)
        sp_e2b__envd_call_free(w->c);
    if (w->events != NULL)
        watcher_clear(w);
    free(w->events);
    free(w->root);
    free(w);
}

static void sweep(sp_timer_t *t, void *arg)
{
    struct sp_envd *ev = arg;
    uint64_t now = sp_loop_now_ms(ev->loop);
    for (envd_watcher_t *w = ev->watchers, *next; w != NULL; w = next) {
        next = w->next;
        if (w->c == NULL && now - w->polled_ms > WATCHER_IDLE_MS) {
            sp_log(SP_LOG_INFO, "envd", "watcher expired unpolled id=%s sandbox=%s", w->id,
                   w->sandbox_id);
            watcher_free(w);
        }
    }
    if (ev->watchers != NULL)
        sp_timer_start(&ev->sweep, 60000);
}

void sp_e2b__envd_fs_free(struct sp_envd *ev)
{
    while (ev->watchers != NULL)
        watcher_free(ev->watchers);
    if (ev->seq != 0)
        sp_timer_stop(&ev->sweep);
}

static void wt_started(void *arg)
{
    envd_watcher_t *w = arg;
    envd_call_t *c = w->c;
    w->c = NULL;
    w->polled_ms = sp_loop_now_ms(w->ev->loop);
    sp_cf_watcher_t r = {.watcher_id = w->id};
    sp_e2b__envd_reply(c, &sp_cd_watcher, &r);
}

static void wt_event(void *arg, const char *path, const char *name, uint32_t bits, uint32_t ftype)
{
    envd_watcher_t *w = arg;
    int32_t types[5];
    const char *rel = rel_name(w->root, path, name);
    int n = translate(w->pending, sizeof(w->pending), rel, bits, types);
    for (int i = 0; i < n; i++) {
        if (w->count == WATCHER_EVENTS_MAX) { /* full: the oldest goes */
            free(w->events[w->head].name);
            w->head = (w->head + 1) % WATCHER_EVENTS_MAX;
            w->count--;
        }
        char *nm = strdup(rel);
        if (nm == NULL)
            return;
        wev_t *e = &w->events[(w->head + w->count) % WATCHER_EVENTS_MAX];
        e->name = nm;
        e->type = types[i];
        w->count++;
    }
}

static void wt_done(void *arg, const sp_err_t *err)
{
    envd_watcher_t *w = arg;
    w->op = NULL;
    if (w->c != NULL) { /* did not start */
        envd_call_t *c = w->c;
        w->c = NULL;
        sp_e2b__envd_fail_err(c, err);
        watcher_free(w);
        return;
    }
    w->failed = true;
    snprintf(w->why, sizeof(w->why), "%s", err->msg);
}

static const sp_exec_watch_cbs_t wt_cbs = {wt_started, wt_event, wt_done};

static void create_watcher_start(envd_call_t *c, const char *root)
{
    sp_cf_watch_req_t *m = c->msg;
    struct sp_envd *ev = c->ev;
    if (ev->nwatchers >= WATCHERS_MAX) {
        sp_e2b__envd_fail(c, SP_CC_RESOURCE_EXHAUSTED, "too many watchers");
        return;
    }
    envd_watcher_t *w = calloc(1, sizeof(*w));
    if (w == NULL || (w->root = strdup(root)) == NULL ||
        (w->events = calloc(WATCHER_EVENTS_MAX, sizeof(*w->events))) == NULL) {
        if (w != NULL)
            free(w->root);
        free(w);
        sp_e2b__envd_fail(c, SP_CC_INTERNAL, "out of memory");
        return;
    }
    if (ev->seq == 0)
        sp_timer_init(&ev->sweep, ev->loop, sweep, ev);
    ev->seq++;
    w->ev = ev;
    w->c = c;
    char rnd[SP_ID_LEN + 1];
    sp_ids_random(rnd, SP_ID_LEN);
    rnd[SP_ID_LEN] = '\0';
    snprintf(w->id, sizeof(w->id), "w%s%llu", rnd, (unsigned long long)ev->seq);
    snprintf(w->sandbox_id, sizeof(w->sandbox_id), "%s", c->sandbox_id);
    w->next = ev->watchers;
    ev->watchers = w;
    ev->nwatchers++;
    if (!sp_timer_armed(&ev->sweep))
        sp_timer_start(&ev->sweep, 60000);
    sp_err_t e;
    w->op = sp_exec_watch(ev->loop, c->conn, root, c->user, m->recursive, &wt_cbs, w, &e);
    if (w->op == NULL) {
        w->c = NULL;
        watcher_free(w);
        sp_e2b__envd_fail_err(c, &e);
    }
}

static void rpc_create_watcher(envd_call_t *c)
{
    sp_cf_watch_req_t *m = c->msg;
    watch_stat(c, m->path, create_watcher_start);
}

static envd_watcher_t *watcher_find(envd_call_t *c, const char *id)
{
    for (envd_watcher_t *w = c->ev->watchers; id != NULL && w != NULL; w = w->next)
        if (w->c == NULL && strcmp(w->id, id) == 0 && strcmp(w->sandbox_id, c->sandbox_id) == 0)
            return w;
    return NULL;
}

static void rpc_get_watcher_events(envd_call_t *c)
{
    sp_cf_watcher_t *m = c->msg;
    envd_watcher_t *w = watcher_find(c, m->watcher_id);
    if (w == NULL) {
        sp_e2b__envd_fail(c, SP_CC_NOT_FOUND, "watcher not found");
        return;
    }
    w->polled_ms = sp_loop_now_ms(c->ev->loop);
    if (w->count == 0 && w->failed) {
        sp_e2b__envd_fail(c, SP_CC_UNAVAILABLE, w->why);
        return;
    }
    sp_cf_events_resp_t r = {0};
    r.events = sp_carena_alloc(&c->arena, (w->count + 1) * sizeof(sp_cf_event_t));
    if (r.events == NULL) {
        sp_e2b__envd_fail(c, SP_CC_INTERNAL, "out of memory");
        return;
    }
    for (size_t i = 0; i < w->count; i++) {
        wev_t *e = &w->events[(w->head + i) % WATCHER_EVENTS_MAX];
        r.events[r.n_events].name = acopy(&c->arena, e->name);
        r.events[r.n_events].type = e->type;
        if (r.events[r.n_events].name != NULL)
            r.n_events++;
    }
    watcher_clear(w);
    sp_e2b__envd_reply(c, &sp_cd_events_resp, &r);
}

static void rpc_remove_watcher(envd_call_t *c)
{
    sp_cf_watcher_t *m = c->msg;
    envd_watcher_t *w = watcher_find(c, m->watcher_id);
    if (w == NULL) {
        sp_e2b__envd_fail(c, SP_CC_NOT_FOUND, "watcher not found");
        return;
    }
    watcher_free(w);
    sp_cempty_t empty = {0};
    sp_e2b__envd_reply(c, &sp_cd_empty, &empty);
}

/* ---- dispatch ---- */

static const struct {
    const char *name;
    const sp_cdesc_t *req;
    void (*fn)(envd_call_t *c);
    bool needs_path;
} methods[] = {
    {"Stat", &sp_cd_path_req, rpc_stat, true},
    {"MakeDir", &sp_cd_path_req, rpc_make_dir, true},
    {"Move", &sp_cd_move_req, rpc_move, true},
    {"ListDir", &sp_cd_listdir_req, rpc_list_dir, true},
    {"Remove", &sp_cd_path_req, rpc_remove, true},
    {"WatchDir", &sp_cd_watch_req, rpc_watch_dir, true},
    {"CreateWatcher", &sp_cd_watch_req, rpc_create_watcher, true},
    {"GetWatcherEvents", &sp_cd_watcher, rpc_get_watcher_events, false},
    {"RemoveWatcher", &sp_cd_watcher, rpc_remove_watcher, false},
};

void sp_e2b__envd_fs(envd_call_t *c, const char *method)
{
    for (size_t i = 0; i < sizeof(methods) / sizeof(methods[0]); i++) {
        if (strcmp(methods[i].name, method) != 0)
            continue;
        h2o_req_t *req = sp_e2b__envd_req(c);
        sp_err_t e;
        c->msg = sp_carena_alloc(&c->arena, methods[i].req->size);
        if (req == NULL || c->msg == NULL ||
            sp_connect_read_msg(req, &c->cr, methods[i].req, c->msg, &c->arena, &e) < 0) {
            sp_e2b__envd_fail(c, SP_CC_INVALID_ARGUMENT, req && c->msg ? e.msg : "out of memory");
            return;
        }
        if (methods[i].needs_path) {
            /* Every request with a path has it as its first string field. */
            const char *p = *(const char **)c->msg;
            if (sp_exec_check_path(p, &e) < 0) {
                sp_e2b__envd_fail(c, SP_CC_INVALID_ARGUMENT, e.msg);
                return;
            }
        }
        methods[i].fn(c);
        return;
    }
    sp_e2b__envd_fail(c, SP_CC_UNIMPLEMENTED, "no such method in filesystem.Filesystem");
}
