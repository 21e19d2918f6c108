/*
 * download.h - a file from a sandbox to an HTTP client, for every surface: stat, then the
 * bytes, with the agent's credit handed back only as the client takes them.
 *
 * The file is stat'ed first (a directory is SP_EINVAL; a regular file's size becomes the
 * response's length), then read with sp_exec_read on the same agent channel. The surface
 * supplies a sink: how to start its response, write to it, end it, or answer an error while
 * nothing was sent yet. The response starts with the first bytes (or at the end of an empty
 * read), so a read that fails at once still gets a proper error answer.
 *
 * Flow control: the sink's writes carry the file bytes; the surface forwards its stream's
 * "the client took n bytes" to sp_download_sent and "the client left" to sp_download_gone.
 * Both have the shape of a byte sink's callbacks (void *arg first) so a surface can hand them
 * to its stream unchanged, with the download as the argument. So a download holds one agent
 * window of memory however large the file and however slow the client.
 *
 * Knows no HTTP: the sink does.
 */
#ifndef SP_DOWNLOAD_H
#define SP_DOWNLOAD_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "base/err.h"
#include "core/channel/agentconn.h"
#include "loop/loop.h"

typedef struct sp_download sp_download_t;

typedef struct {
    /* The bytes come: start the response with length bytes (-1: not known, to the end).
     * Returns the sink's output (opaque here, passed to write and end), or NULL when the
     * client is gone or the response could not start (the surface answered what it could);
     * the download then stops without another callback. dl is the argument for
     * sp_download_sent and sp_download_gone from now on. */
    void *(*begin)(void *arg, long long length, sp_download_t *dl);
    /* File bytes, borrowed for the call. 0, or -1 when they could not be queued: the download
     * then ends the response cut (end with ok false) and stops. */
    int (*write)(void *out, const uint8_t *p, size_t n);
    /* Terminal after begin: ends the response; ok false cuts it (the read failed midway, or
     * the file shrank under its length). */
    void (*end)(void *out, bool ok);
    /* Terminal before begin: the stat or the read failed (err), or the path is a directory
     * (SP_EINVAL, dir_msg). */
    void (*fail)(void *arg, const sp_err_t *err);
} sp_download_sink_t;

typedef struct {
    const char *path; /* checked as sp_exec_check_path */
    const char *user; /* NULL: root */
    /* A regular file whose size is 0 is sent as an empty body without reading it (envd);
     * false: it is read to its end, chunked, as files in /proc report 0. */
    bool empty_if_zero;
    const char *dir_msg; /* the error for a directory; NULL: "path is a directory" */
} sp_download_req_t;

/* Starts the download (strings copied). 0: exactly one of fail, end, or a begin that returns
 * NULL follows (never inside this call), unless the client leaves (sp_download_gone) first.
 * -1 with err: nothing was started and no callback comes. */
int sp_download_start(sp_loop_t *loop, sp_agentconn_t *c, const sp_download_req_t *req,
                      const sp_download_sink_t *sink, void *arg, sp_err_t *err);

/* The client took n bytes: the agent may send n more. dl is the sp_download_t from begin. */
void sp_download_sent(void *dl, size_t n);
/* The client left: the read stops, no more callbacks (the output is the caller's to drop). */
void sp_download_gone(void *dl);

#endif
