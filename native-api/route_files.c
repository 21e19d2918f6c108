/*
 * route_files.c - /v1/sandboxes/{id}/files: download, upload, remove, stat, list, mkdir,
 * move.
 *
 * Downloads stream (core/channel/download.h; this file is its sink): the agent's DATA goes to
 * the client as it comes and the agent gets credit back only after h2o took it, so a 1 GiB
 * file passes through one agent window of memory.
 * Uploads: h2o hands us the whole body (large ones live in its temp-file-backed buffer, not
 * the heap); we slice it into DATA frames only as the agent's credit allows. Either way a
 * client that leaves stops the transfer (an upload is abandoned and the agent drops its
 * temporary file).
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/channel/download.h"
#include "core/channel/exec.h"
#include "native-api/napi_int.h"

typedef struct {
    char *path;
    char *dest;
    char *user;
    uint32_t mode;
    uint32_t depth;
    bool flag;         /* recursive (DELETE) or mkdirs (PUT) */
    sp_exec_fsop_t op; /* what fs_next asks the agent (request/answer operations) */
} fsreq_t;

static void fsreq_free(void *p)
{
    fsreq_t *f = p;
    free(f->path);
    free(f->dest);
    free(f->user);
    free(f);
}

static fsreq_t *fsreq_new(napi_ctx_t *c, sp_err_t *err)
{
    fsreq_t *f = calloc(1, sizeof(*f));
    if (f == NULL) {
        sp_err_set(err, SP_EINTERNAL, "out of memory");
        return NULL;
    }
    c->data = f;
    c->data_free = fsreq_free;
    return f;
}

static int set_str(char **dst, const char *src, sp_err_t *err)
{
    *dst = src ? strdup(src) : NULL;
    if (src != NULL && *dst == NULL)
        return sp_err_set(err, SP_EINTERNAL, "out of memory");
    return 0;
}

/* path and user from the query string. */
static fsreq_t *from_query(napi_ctx_t *c, sp_err_t *err)
{
    h2o_req_t *req = sp_http_hold_req(c->hold);
    if (req == NULL) {
        sp_err_set(err, SP_EUNAVAIL, "client gone");
        return NULL;
    }
    const char *path = sp_http_query(req, "path");
    const char *user = sp_http_query(req, "user");
    if (path == NULL) {
        sp_err_set(err, SP_EINVAL,
                   "path query parameter is required (percent-encoded, without NUL)");
        return NULL;
    }
    if (sp_exec_check_path(path, err) < 0 || sp_napi__check_user(user, err) < 0)
        return NULL;
    fsreq_t *f = fsreq_new(c, err);
    if (f == NULL || set_str(&f->path, path, err) < 0 || set_str(&f->user, user, err) < 0)
        return NULL;
    return f;
}

/* ---- request/answer operations: stat, list, mkdir, move, remove ---- */

static void on_fs(void *arg, json_t *result, const sp_err_t *err)
{
    napi_ctx_t *c = arg;
    if (err != NULL) {
        sp_napi__fail(c, err);
        return;
    }
    fsreq_t *f = c->data;
    if (result == NULL)
        result = json_pack("{s:s,s:b}", "path", f->path, "removed", 1);
    else
        json_incref(result);
    sp_napi__reply(c, 200, result);
}

static void fs_next(napi_ctx_t *c, sp_agentconn_t *conn)
{
    fsreq_t *f = c->data;
    sp_exec_fs_req_t r = {.op = f->op,
                          .path = f->path,
                          .dest = f->dest,
                          .user = f->user,
                          .depth = f->depth,
                          .recursive = f->flag,
                          .mode = f->mode};
    sp_err_t e;
    if (sp_exec_fs(sp_napi__loop(c), conn, &r, on_fs, c, &e) == NULL)
        sp_napi__fail(c, &e);
}

/* Runs operation op of request f (c->data) once the sandbox's agent is reached. */
static void fs_start(napi_ctx_t *c, fsreq_t *f, sp_exec_fsop_t op)
{
    f->op = op;
    sp_napi__with_agent(c, fs_next);
}

void sp_napi__files_stat(napi_ctx_t *c)
{
    sp_err_t e;
    fsreq_t *f = from_query(c, &e);
    if (f == NULL)
        sp_napi__fail(c, &e);
    else
        fs_start(c, f, SP_EXEC_FS_STAT);
}

void sp_napi__files_list(napi_ctx_t *c)
{
    sp_err_t e;
    fsreq_t *f = from_query(c, &e);
    if (f == NULL) {
        sp_napi__fail(c, &e);
        return;
    }
    int depth = 1;
    if (sp_napi__query_int(sp_http_hold_req(c->hold), "depth", 1, 32, &depth, &e) < 0) {
        sp_napi__fail(c, &e);
        return;
    }
    f->depth = (uint32_t)depth;
    fs_start(c, f, SP_EXEC_FS_LIST);
}

void sp_napi__files_delete(napi_ctx_t *c)
{
    sp_err_t e;
    fsreq_t *f = from_query(c, &e);
    if (f == NULL || sp_napi__query_bool(sp_http_hold_req(c->hold), "recursive", &f->flag, &e) < 0) {
        sp_napi__fail(c, &e);
        return;
    }
    fs_start(c, f, SP_EXEC_FS_REMOVE);
}

void sp_napi__files_mkdir(napi_ctx_t *c)
{
    sp_err_t e;
    const char *path, *user;
    uint32_t mode = 0;
    if (sp_napi__body_mkdir(c->body, &path, &user, &mode, &e) < 0) {
        sp_napi__fail(c, &e);
        return;
    }
    fsreq_t *f = fsreq_new(c, &e);
    if (f == NULL || set_str(&f->path, path, &e) < 0 || set_str(&f->user, user, &e) < 0) {
        sp_napi__fail(c, &e);
        return;
    }
    f->mode = mode;
    fs_start(c, f, SP_EXEC_FS_MKDIR);
}

void sp_napi__files_move(napi_ctx_t *c)
{
    sp_err_t e;
    const char *from, *to, *user;
    if (sp_napi__body_move(c->body, &from, &to, &user, &e) < 0) {
        sp_napi__fail(c, &e);
        return;
    }
    fsreq_t *f = fsreq_new(c, &e);
    if (f == NULL || set_str(&f->path, from, &e) < 0 || set_str(&f->dest, to, &e) < 0 ||
        set_str(&f->user, user, &e) < 0) {
        sp_napi__fail(c, &e);
        return;
    }
    fs_start(c, f, SP_EXEC_FS_MOVE);
}

/* ---- download: the sink of core/channel/download.h ---- */

static const sp_stream_cbs_t dl_stream_cbs = {sp_download_sent, sp_download_gone};

static void *dl_begin(void *arg, long long length, sp_download_t *dl)
{
    h2o_req_t *req = sp_napi__take(arg);
    sp_stream_t *st = NULL;
    if (req != NULL)
        st = sp_stream_start(req, 200, "application/octet-stream", length, &dl_stream_cbs, dl);
    if (st == NULL && req != NULL)
        sp_http_error_code(req, SP_EINTERNAL, "out of memory");
    return st;
}

static void dl_fail(void *arg, const sp_err_t *err)
{
    sp_napi__fail(arg, err);
}

static const sp_download_sink_t dl_sink = {dl_begin, sp_stream_sink_write, sp_stream_sink_end,
                                           dl_fail};

static void get_next(napi_ctx_t *c, sp_agentconn_t *conn)
{
    fsreq_t *f = c->data;
    sp_download_req_t r = {.path = f->path,
                           .user = f->user,
                           .dir_msg = "path is a directory (use files/list)"};
    sp_err_t e;
    if (sp_download_start(sp_napi__loop(c), conn, &r, &dl_sink, c, &e) < 0)
        sp_napi__fail(c, &e);
}

void sp_napi__files_get(napi_ctx_t *c)
{
    sp_err_t e;
    if (from_query(c, &e) == NULL)
        sp_napi__fail(c, &e);
    else
        sp_napi__with_agent(c, get_next);
}

/* ---- upload ---- */

typedef struct {
    napi_ctx_t *c;
    sp_exec_t *op;
    size_t off;
    bool ended;
} up_t;

static void up_feed(up_t *u)
{
    h2o_req_t *req = sp_http_hold_req(u->c->hold);
    if (req == NULL) { /* the client left: its body is gone with it */
        sp_exec_cancel(u->op);
        sp_napi__take(u->c);
        free(u);
        return;
    }
    while (u->off < req->entity.len) {
        long k = sp_exec_write_data(u->op, req->entity.base + u->off, req->entity.len - u->off);
        if (k <= 0)
            return; /* 0: on_writable comes; -1: on_done comes */
        u->off += (size_t)k;
    }
    if (!u->ended) {
        u->ended = true;
        sp_exec_write_end(u->op);
    }
}

static void up_writable(void *arg)
{
    up_feed(arg);
}

static void up_done(void *arg, json_t *entry, const sp_err_t *err)
{
    up_t *u = arg;
    napi_ctx_t *c = u->c;
    free(u);
    if (err != NULL)
        sp_napi__fail(c, err);
    else
        sp_napi__reply(c, 200, entry ? json_incref(entry) : json_object());
}

static const sp_exec_write_cbs_t up_cbs = {up_writable, up_done};

static void put_next(napi_ctx_t *c, sp_agentconn_t *conn)
{
    fsreq_t *f = c->data;
    sp_err_t e;
    up_t *u = calloc(1, sizeof(*u));
    if (u == NULL) {
        sp_napi__fail(c, (sp_err_set(&e, SP_EINTERNAL, "out of memory"), &e));
        return;
    }
    u->c = c;
    u->op = sp_exec_write(sp_napi__loop(c), conn, f->path, f->user, f->mode, f->flag, &up_cbs, u,
                          &e);
    if (u->op == NULL) {
        free(u);
        sp_napi__fail(c, &e);
        return;
    }
    up_feed(u);
}

void sp_napi__files_put(napi_ctx_t *c)
{
    sp_err_t e;
    fsreq_t *f = from_query(c, &e);
    h2o_req_t *req = sp_http_hold_req(c->hold);
    if (f != NULL) {
        f->flag = true; /* mkdirs by default */
        if (req == NULL || sp_napi__query_bool(req, "mkdirs", &f->flag, &e) < 0 ||
            sp_napi__parse_mode(sp_http_query(req, "mode"), &f->mode, &e) < 0)
            f = NULL;
    }
    if (f == NULL) {
        sp_napi__fail(c, &e);
        return;
    }
    sp_napi__with_agent(c, put_next);
}
