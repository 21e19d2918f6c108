/*
 * download.c - a file from a sandbox to a client through a surface's sink (download.h).
 *
 * Owns the download's copies of its request and the exec operation in flight: the stat, then
 * the read. Never buffers file bytes: each DATA frame goes to the sink as it comes, and credit
 * goes back to the agent only through sp_download_sent. Knows no HTTP.
 */
#include "core/channel/download.h"

#include <stdlib.h>
#include <string.h>

#include "core/channel/exec.h"

struct sp_download {
    sp_loop_t *loop;
    sp_agentconn_t *conn; /* borrowed: the read is opened from the stat's callback */
    sp_download_sink_t sink;
    void *arg;
    char *path, *user, *dir_msg;
    bool empty_if_zero;
    sp_exec_t *op;    /* the stat, then the read; NULL after its terminal callback */
    void *out;        /* the sink's output, once begun */
    long long length; /* -1: to the end */
};

static void dl_free(sp_download_t *d)
{
    free(d->path);
    free(d->user);
    free(d->dir_msg);
    free(d);
}

/* Starts the response; false (d freed, the read cancelled) when the sink could not. */
static bool dl_begin(sp_download_t *d)
{
    d->out = d->sink.begin(d->arg, d->length, d);
    if (d->out == NULL) {
        sp_exec_cancel(d->op);
        dl_free(d);
        return false;
    }
    return true;
}

static void on_data(void *arg, const uint8_t *p, size_t n)
{
    sp_download_t *d = arg;
    if (d->out == NULL && !dl_begin(d))
        return;
    if (d->sink.write(d->out, p, n) < 0) {
        sp_exec_cancel(d->op);
        d->sink.end(d->out, false);
        dl_free(d);
    }
}

static void on_done(void *arg, uint64_t total, const sp_err_t *err)
{
    sp_download_t *d = arg;
    d->op = NULL; /* terminal */
    if (d->out == NULL) {
        if (err != NULL) {
            d->sink.fail(d->arg, err);
            dl_free(d);
            return;
        }
        if (!dl_begin(d))
            return;
    }
    /* A file that shrank after the stat cannot fill its length: cut the response. */
    bool ok = err == NULL && (d->length < 0 || (long long)total == d->length);
    d->sink.end(d->out, ok);
    dl_free(d);
}

static const sp_exec_read_cbs_t read_cbs = {on_data, on_done};

/* The stat answered (inside the agent channel's callback, so conn is alive). */
static void on_stat(void *arg, json_t *entry, const sp_err_t *err)
{
    sp_download_t *d = arg;
    d->op = NULL;
    if (err != NULL) {
        d->sink.fail(d->arg, err);
        dl_free(d);
        return;
    }
    const char *type = json_string_value(json_object_get(entry, "type"));
    if (type != NULL && strcmp(type, "dir") == 0) {
        sp_err_t e;
        sp_err_set(&e, SP_EINVAL, "%s", d->dir_msg ? d->dir_msg : "path is a directory");
        d->sink.fail(d->arg, &e);
        dl_free(d);
        return;
    }
    json_int_t size = json_integer_value(json_object_get(entry, "size"));
    bool file = type != NULL && strcmp(type, "file") == 0;
    if (file && size == 0 && d->empty_if_zero) { /* nothing to read: an empty body */
        d->length = 0;
        if (dl_begin(d))
            on_done(d, 0, NULL);
        return;
    }
    /* Regular files with a size: exactly that many bytes with a length. Others (and files
     * that report 0, as in /proc): to the end, chunked. */
    bool sized = file && size > 0;
    d->length = sized ? (long long)size : -1;
    sp_err_t e;
    d->op = sp_exec_read(d->loop, d->conn, d->path, d->user, 0, sized ? (uint64_t)size : 0,
                         &read_cbs, d, &e);
    if (d->op == NULL) {
        d->sink.fail(d->arg, &e);
        dl_free(d);
    }
}

static char *dup_or_null(const char *s, bool *oom)
{
    char *d = s != NULL ? strdup(s) : NULL;
    if (s != NULL && d == NULL)
        *oom = true;
    return d;
}

int sp_download_start(sp_loop_t *loop, sp_agentconn_t *c, const sp_download_req_t *req,
                      const sp_download_sink_t *sink, void *arg, sp_err_t *err)
{
    if (sp_exec_check_path(req->path, err) < 0)
        return -1;
    sp_download_t *d = calloc(1, sizeof(*d));
    bool oom = d == NULL;
    if (d != NULL) {
        d->path = dup_or_null(req->path, &oom);
        d->user = dup_or_null(req->user, &oom);
        d->dir_msg = dup_or_null(req->dir_msg, &oom);
    }
    if (oom) {
        if (d != NULL)
            dl_free(d);
        return sp_err_set(err, SP_EINTERNAL, "out of memory");
    }
    d->loop = loop;
    d->conn = c;
    d->sink = *sink;
    d->arg = arg;
    d->empty_if_zero = req->empty_if_zero;
    sp_exec_fs_req_t fr = {.op = SP_EXEC_FS_STAT, .path = d->path, .user = d->user};
    d->op = sp_exec_fs(loop, c, &fr, on_stat, d, err);
    if (d->op == NULL) {
        dl_free(d);
        return -1;
    }
    return 0;
}

void sp_download_sent(void *dl, size_t n)
{
    sp_download_t *d = dl;
    sp_exec_ack(d->op, n);
}

void sp_download_gone(void *dl)
{
    sp_download_t *d = dl;
    sp_exec_cancel(d->op);
    dl_free(d);
}
