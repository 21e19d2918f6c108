/*
 * buf.h - one growable byte buffer for everything that builds output a piece at a time
 * (response bodies, SQL array literals, frames, protocol lines).
 *
 * Grows by doubling. A failed allocation sets oom and leaves the contents as they were:
 * later appends do nothing, so a builder appends freely and checks oom once at the end.
 * Not thread-safe; owns p (sp_buf_free).
 */
#ifndef SP_BASE_BUF_H
#define SP_BASE_BUF_H

#include <stdarg.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

typedef struct {
    uint8_t *p;
    size_t len, cap;
    bool oom;
} sp_buf_t;

#define SP_BUF_INIT {NULL, 0, 0, false}

/* Room for n more bytes: a pointer to p + len (the caller writes, then sp_buf_commit), or
 * NULL with oom set. */
void *sp_buf_reserve(sp_buf_t *b, size_t n);
/* Counts n bytes written after sp_buf_reserve. */
void sp_buf_commit(sp_buf_t *b, size_t n);
void sp_buf_add(sp_buf_t *b, const void *p, size_t n);
void sp_buf_str(sp_buf_t *b, const char *s); /* without its NUL */
void sp_buf_printf(sp_buf_t *b, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
/* The contents as a C string: a NUL is kept after them (not counted in len). "" on oom. */
const char *sp_buf_cstr(sp_buf_t *b);
/* Drops the first n bytes (n > len: all). */
void sp_buf_consume(sp_buf_t *b, size_t n);
/* Empty again, memory kept, oom cleared. */
void sp_buf_reset(sp_buf_t *b);
/* Frees the memory; b is empty (and usable) afterwards. */
void sp_buf_free(sp_buf_t *b);

#endif
