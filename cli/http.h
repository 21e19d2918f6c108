/*
 * http.h - spacectl's HTTP/1.1 client: blocking, one connection per request, plain or TLS.
 *
 * Owns a request's socket, its TLS session (OpenSSL, peer verified against the system's CAs
 * or SPACE_CA_FILE) and the bytes read ahead of the body. Sends a body from memory or
 * streams one from a file descriptor; reads a response body sent with Content-Length,
 * chunked or to the end of the connection, in pieces (a download is never whole in memory)
 * or as NDJSON lines. After a 101 it hands the connection to cli/ws.h. Knows no JSON and no
 * API paths: cli/api.h builds on it.
 *
 * The pure parts (URL parsing, percent-encoding, the chunked decoder, the line splitter) are
 * in this header so the unit test can feed them made-up input.
 */
#ifndef SPC_HTTP_H
#define SPC_HTTP_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "base/buf.h"
#include "base/err.h"

/* ---- URLs ---- */

typedef struct {
    bool tls;          /* https */
    char host[256];    /* an IPv6 address without its brackets */
    char port[8];
    char prefix[512];  /* the URL's path without a trailing '/', prepended to every request */
    char text[600];    /* scheme://host:port as given, for messages */
} spc_url_t;

/* http://host[:port][/prefix] or https://...; -1 with err for anything else. */
int spc_url_parse(const char *s, spc_url_t *out, sp_err_t *err);

/* Appends s percent-encoded for a query value or a path segment (unreserved bytes kept). */
void spc_urlencode(sp_buf_t *b, const char *s);

/* ---- lines (NDJSON) ---- */

typedef struct {
    sp_buf_t buf;
    size_t start; /* the first byte not yet handed out */
    size_t scan;  /* bytes before this hold no newline */
    size_t max;   /* a longer line is an error */
} spc_lines_t;

void spc_lines_init(spc_lines_t *l, size_t max_line);
void spc_lines_free(spc_lines_t *l);
/* Adds input; -1 when out of memory. Invalidates a line handed out before. */
int spc_lines_push(spc_lines_t *l, const void *p, size_t n);
/* The next complete line, without its "\n" (or "\r\n"); empty lines are skipped. 1 with a
 * line (valid until the next push), 0 when none is complete yet, -1 when the pending line is
 * longer than max. With at_end (no more input comes), a last line without newline counts. */
int spc_lines_next(spc_lines_t *l, bool at_end, const char **line, size_t *len);

/* ---- requests ---- */

typedef struct {
    const char *method;
    const char *path;         /* with its query; the URL's prefix goes before it */
    const char *bearer;       /* Authorization: Bearer <bearer>, or NULL */
    const char *content_type; /* with a body */
    const void *body;         /* a body from memory... */
    size_t body_len;
    bool body_from_fd;        /* ...or body_len bytes streamed from body_fd */
    int body_fd;
    /* Told how many body bytes went out so far (a progress bar). */
    void (*progress)(void *arg, uint64_t sent);
    void *progress_arg;
    const char *const *headers; /* more "Name: value" lines, NULL-terminated; or NULL */
    int timeout_ms;             /* per read of the answer; 0: none (a stream, a long wait) */
} spc_req_t;

typedef struct spc_resp spc_resp_t;
typedef struct spc_conn spc_conn_t;

/* Connects, sends the request and reads the response head (skipping 100 Continue). NULL
 * with err: SP_EUNAVAIL when the server cannot be reached or the connection fails, its
 * message naming the URL. The caller frees the response. */
spc_resp_t *spc_http_send(const spc_url_t *u, const spc_req_t *rq, sp_err_t *err);

int spc_resp_status(const spc_resp_t *r);
/* A response header's value (case-insensitive name; the first of several), or NULL. */
const char *spc_resp_header(const spc_resp_t *r, const char *name);
/* The body's length when the server said it (Content-Length), else -1. */
long long spc_resp_length(const spc_resp_t *r);

/* Body bytes into p: > 0, 0 at the body's end, -1 with err (connection lost, bad coding). */
long spc_resp_read(spc_resp_t *r, void *p, size_t n, sp_err_t *err);
/* The whole body into out; -1 past max bytes. */
int spc_resp_read_all(spc_resp_t *r, sp_buf_t *out, size_t max, sp_err_t *err);
/* The next NDJSON line of the body: 1 with a line (valid until the next call), 0 at the
 * body's end, -1 with err (a line over 16 MiB, connection lost). */
int spc_resp_line(spc_resp_t *r, const char **line, size_t *len, sp_err_t *err);

/* After a 101: the connection, and in leftover the bytes read past the head (they are the
 * upgraded protocol's). The response keeps nothing; free it as usual. */
spc_conn_t *spc_resp_take_conn(spc_resp_t *r, sp_buf_t *leftover);
void spc_resp_free(spc_resp_t *r);

/* ---- a connection, for the upgraded protocol (cli/ws.c) ---- */

int spc_conn_fd(const spc_conn_t *c);
/* Bytes the TLS layer holds already: there is something to read without polling. */
bool spc_conn_pending(const spc_conn_t *c);
/* Stops blocking: reads and writes then answer -2 when they would block. */
int spc_conn_set_nonblocking(spc_conn_t *c);
/* Reads: > 0 bytes, 0 at the peer's end, -1 error (err), -2 would block. */
long spc_conn_read(spc_conn_t *c, void *p, size_t n, sp_err_t *err);
/* Writes: > 0 bytes taken, -1 error (err), -2 would block. */
long spc_conn_write(spc_conn_t *c, const void *p, size_t n, sp_err_t *err);
void spc_conn_close(spc_conn_t *c);

#endif
