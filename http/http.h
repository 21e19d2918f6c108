/*
 * http.h - what both HTTP surfaces share on top of h2o: holding a request
 * across asynchronous work, JSON replies, query parameters, headers.
 *
 * Folder: http/ is the HTTP toolkit on h2o under both surfaces (holds, JSON, streams, TLS, one
 * port for TLS and plain HTTP); it uses base/ and loop/. (ARCHITECTURE.md: the layers.)
 *
 * A hold survives the client: if the connection goes away first, the hold's
 * request becomes NULL and the completion must not reply.
 */
#ifndef SP_HTTP_H
#define SP_HTTP_H

#include <h2o.h>
#include <jansson.h>
#include <stdbool.h>

#include "base/buf.h"
#include "base/err.h"

typedef struct sp_http_hold sp_http_hold_t;

/* Keeps req answerable after the handler returns; user gets user_size zeroed bytes. */
sp_http_hold_t *sp_http_hold(h2o_req_t *req, size_t user_size);
void *sp_http_hold_user(sp_http_hold_t *h);
/* The request, or NULL when the client is gone. */
h2o_req_t *sp_http_hold_req(sp_http_hold_t *h);
/* Frees the hold; returns its request (NULL when the client is gone). */
h2o_req_t *sp_http_release(sp_http_hold_t *h);

/* Sends obj (stolen) as JSON with status. */
void sp_http_json(h2o_req_t *req, int status, json_t *obj);
/* Sends the JSON text in body (written by the caller, e.g. with sp_json_write_str) with status,
 * as sp_http_json sends its own: a newline is appended to body, which stays the caller's. */
void sp_http_json_text(h2o_req_t *req, int status, sp_buf_t *body);
/* Sends {"error":{"code":..,"message":..}} (native shape). */
void sp_http_error(h2o_req_t *req, const sp_err_t *err);
void sp_http_error_code(h2o_req_t *req, sp_code_t code, const char *msg);

/* Query parameter name as a NUL-terminated, percent-decoded copy in req->pool; NULL when absent. */
const char *sp_http_query(h2o_req_t *req, const char *name);
/* Header value as a NUL-terminated copy in req->pool; NULL when absent. */
const char *sp_http_header(h2o_req_t *req, const char *lname);

/* Percent-decodes src[0..len) into dst (cap >= len+1); -1 on a bad escape or NUL byte. */
int sp_http_pct_decode(const char *src, size_t len, char *dst);

/* Splits the path (without query) into at most max segments in req->pool; returns count or -1. */
int sp_http_segments(h2o_req_t *req, const char **segs, int max);

bool sp_http_method_is(h2o_req_t *req, const char *m);

#endif
