/*
 * envd_fs.c - filesystem.Filesystem over core/channel/exec.h: Stat, MakeDir, Move, ListDir, Remove,
 * WatchDir (stream), and the polling watchers CreateWatcher / GetWatcherEvents /
 * RemoveWatcher.
 *
 * EntryInfo describes a symlink by the entry it finally names (type and permission bits), as
 * envd does, with symlinkTarget the resolved path; the agent reports both with the link.
 *
 * Watch events are cooked by core/channel/fswatch.h (names relative to the watched directory,
 * the agent's atomic writes as create + write); the polling watchers live in its table, so
 * this file only translates them. Knows no process state.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "base/log.h"
#include "e2b-gateway/envd_int.h"

#define WATCH_PENDING_MAX (4u * 1024 * 1024) /* WatchDir bytes queued for a slow client */

/* ---- entries ---- */

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
        out->symlink_target =
            sp_e2b__envd_strdup(a, target ? target : json_string_value(json_object_get(e, "path")));
        out->has_symlink_target = true;
    }
    out->name = sp_e2b__envd_strdup(a, json_string_value(json_object_get(e, "name")));
    out->path = sp_e2b__envd_strdup(a, json_string_value(json_object_get(e, "path")));
    out->owner = sp_e2b__envd_strdup(a, json_string_value(json_object_get(e, "owner")));
    out->group = sp_e2b__envd_strdup(a, json_string_value(json_object_get(e, "group")));
    out->type = what && strcmp(what, "dir") == 0    ? SP_CF_TYPE_DIRECTORY
                : what && strcmp(what, "file") == 0 ? SP_CF_TYPE_FILE
                                                    : SP_CF_TYPE_UNSPECIFIED;
    out->size = (int64_t)json_integer_value(json_object_get(e, "size"));
    out->mode = perm; /* Go's FileMode.Perm(): no type or special bits */
    char *p = sp_carena_alloc(a, 16);
    if (p != NULL)
        go_mode_string(p, type, special, mode);
    out->permissions = p;
    const char *mtime = json_string_value(json_object_get(e, "mtime")); /* UTC, to the ms */
    if (mtime != NULL && sp_connect_parse_time(mtime, &out->modified_time) == 0)
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
    if (json_is_true(json_object_get(res, "truncated")))
        sp_e2b__envd_truncated(c);
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

/* An agent event bit (core/channel/fswatch.h cooks one per event kind) as envd's EventType. */
static int32_t ev_type(uint32_t bit)
{
    switch (bit) {
    case SP_AP_EV_CREATE:
        return SP_CF_EV_CREATE;
    case SP_AP_EV_WRITE:
        return SP_CF_EV_WRITE;
    case SP_AP_EV_REMOVE:
        return SP_CF_EV_REMOVE;
    case SP_AP_EV_RENAME:
        return SP_CF_EV_RENAME;
    default:
        return SP_CF_EV_CHMOD;
    }
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
    const char *root = sp_e2b__envd_strdup(&c->arena, path);
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
    sp_fswatch_cook_t cook;
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
    const char *rel;
    uint32_t evs[5];
    int n = sp_fswatch_cook(&w->cook, w->root, path, name, bits, &rel, evs);
    for (int i = 0; i < n; i++) {
        sp_cf_watch_resp_t m = {.has_filesystem = true};
        m.filesystem.name = rel;
        m.filesystem.type = ev_type(evs[i]);
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

/* ---- polling watchers (core/channel/fswatch.h) ---- */

static void created(void *arg, const char *id, const sp_err_t *err)
{
    envd_call_t *c = arg;
    if (err != NULL) {
        sp_e2b__envd_fail_err(c, err);
        return;
    }
    sp_cf_watcher_t r = {.watcher_id = id};
    sp_e2b__envd_reply(c, &sp_cd_watcher, &r);
}

static void create_watcher_start(envd_call_t *c, const char *root)
{
    sp_cf_watch_req_t *m = c->msg;
    sp_err_t e;
    if (sp_fswatch_create(c->ev->watchers, c->conn, c->sandbox_id, root, c->user, m->recursive,
                          created, c, &e) < 0)
        sp_e2b__envd_fail_err(c, &e); /* too many watchers: SP_ETOOBIG, resource_exhausted */
}

static void rpc_create_watcher(envd_call_t *c)
{
    sp_cf_watch_req_t *m = c->msg;
    watch_stat(c, m->path, create_watcher_start);
}

/* A lookup error as envd answers it: not_found, or unavailable with why the watch ended. */
static void watcher_fail(envd_call_t *c, const sp_err_t *e)
{
    sp_e2b__envd_fail(c,
                      e->code == SP_ENOTFOUND  ? SP_CC_NOT_FOUND
                      : e->code == SP_EUNAVAIL ? SP_CC_UNAVAILABLE
                                               : SP_CC_INTERNAL,
                      e->msg);
}

typedef struct {
    envd_call_t *c;
    sp_cf_events_resp_t r;
} poll_t;

static int polled(void *arg, const sp_fswatch_ev_t *evs, size_t n)
{
    poll_t *p = arg;
    sp_carena_t *a = &p->c->arena;
    p->r.events = sp_carena_alloc(a, (n + 1) * sizeof(sp_cf_event_t));
    if (p->r.events == NULL)
        return -1;
    for (size_t i = 0; i < n; i++) {
        sp_cf_event_t *ev = &p->r.events[p->r.n_events];
        ev->name = sp_e2b__envd_strdup(a, evs[i].name);
        ev->type = ev_type(evs[i].ev);
        if (ev->name != NULL)
            p->r.n_events++;
    }
    return 0;
}

static void rpc_get_watcher_events(envd_call_t *c)
{
    sp_cf_watcher_t *m = c->msg;
    poll_t p = {.c = c};
    sp_err_t e;
    if (sp_fswatch_poll(c->ev->watchers, c->sandbox_id, m->watcher_id, polled, &p, &e) < 0)
        watcher_fail(c, &e);
    else
        sp_e2b__envd_reply(c, &sp_cd_events_resp, &p.r);
}

static void rpc_remove_watcher(envd_call_t *c)
{
    sp_cf_watcher_t *m = c->msg;
    sp_err_t e;
    if (sp_fswatch_remove(c->ev->watchers, c->sandbox_id, m->watcher_id, &e) < 0) {
        watcher_fail(c, &e);
        return;
    }
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
