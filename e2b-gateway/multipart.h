/*
 * multipart.h - multipart/form-data (RFC 7578) over a body held in memory.
 *
 * Parts are returned one at a time as views into the caller's buffer (no copy), so a
 * 100 MiB upload is never duplicated: the caller feeds each part's bytes onward as it likes.
 * Robust to hostile bodies: bounded header sizes, truncation and a missing final boundary
 * are errors, and a boundary-like sequence inside content (CRLF--x) is only a delimiter when
 * the whole boundary follows.
 */
#ifndef SP_MULTIPART_H
#define SP_MULTIPART_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "base/err.h"

#define SP_MULTIPART_BOUNDARY_MAX 200   /* bytes of boundary (RFC 2046 says 70) */
#define SP_MULTIPART_HEADERS_MAX  16384 /* bytes of one part's header block */
#define SP_MULTIPART_NAME_MAX     4096  /* bytes of a decoded name or filename */

typedef struct {
    const char *name;     /* form field name ("" when absent); valid until the next call */
    const char *filename; /* NULL when the part has no filename parameter */
    const uint8_t *data;  /* the part's content, inside the caller's buffer */
    size_t len;
} sp_multipart_part_t;

typedef struct {
    const uint8_t *buf;
    size_t n, off;
    char delim[SP_MULTIPART_BOUNDARY_MAX + 5]; /* "\r\n--" boundary */
    size_t dlen;
    int state; /* 0: before the first boundary, 1: at a part, 2: finished */
    char name[SP_MULTIPART_NAME_MAX + 1];
    char filename[SP_MULTIPART_NAME_MAX + 1];
} sp_multipart_t;

/* The boundary parameter of a multipart/form-data content type into out[cap]. -1 when the
 * type is not multipart/form-data or has no usable boundary. */
int sp_multipart_boundary(const char *content_type, char *out, size_t cap);

/* Starts parsing buf[0..n) (borrowed until the parser is dropped). -1 with err on a bad
 * content type. */
int sp_multipart_init(sp_multipart_t *m, const char *content_type, const void *buf, size_t n,
                      sp_err_t *err);

/* 1: *part filled; 0: the closing boundary was reached; -1 with err (SP_EINVAL) when the body
 * is malformed or truncated (and on every later call). */
int sp_multipart_next(sp_multipart_t *m, sp_multipart_part_t *part, sp_err_t *err);

#endif
