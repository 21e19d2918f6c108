/*
 * buf.c - the growable byte buffer (buf.h).
 */
#include "base/buf.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

void *sp_buf_reserve(sp_buf_t *b, size_t n)
{
    if (b->oom)
        return NULL;
    if (n > SIZE_MAX - b->len - 1) {
        b->oom = true;
        return NULL;
    }
    size_t need = b->len + n + 1; /* + room for sp_buf_cstr's NUL */
    if (need > b->cap) {
        size_t cap = b->cap ? b->cap : 64;
        while (cap < need)
            cap = cap > SIZE_MAX / 2 ? need : cap * 2;
        uint8_t *p = realloc(b->p, cap);
        if (p == NULL) {
            b->oom = true;
            return NULL;
        }
        b->p = p;
        b->cap = cap;
    }
    return b->p + b->len;
}

void sp_buf_commit(sp_buf_t *b, size_t n)
{
    if (!b->oom && b->len + n < b->cap)
        b->len += n;
}

void sp_buf_add(sp_buf_t *b, const void *p, size_t n)
{
    if (n == 0)
        return;
    void *d = sp_buf_reserve(b, n);
    if (d != NULL) {
        memcpy(d, p, n);
        b->len += n;
    }
}

void sp_buf_str(sp_buf_t *b, const char *s)
{
    sp_buf_add(b, s, strlen(s));
}

void sp_buf_printf(sp_buf_t *b, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    char small[256];
    int n = vsnprintf(small, sizeof(small), fmt, ap);
    va_end(ap);
    if (n < 0)
        return;
    if ((size_t)n < sizeof(small)) {
        sp_buf_add(b, small, (size_t)n);
        return;
    }
    char *d = sp_buf_reserve(b, (size_t)n);
    if (d == NULL)
        return;
    va_start(ap, fmt);
    vsnprintf(d, (size_t)n + 1, fmt, ap);
    va_end(ap);
    b->len += (size_t)n;
}

const char *sp_buf_cstr(sp_buf_t *b)
{
    if (b->oom || sp_buf_reserve(b, 0) == NULL)
        return "";
    b->p[b->len] = '\0';
    return (const char *)b->p;
}

void sp_buf_consume(sp_buf_t *b, size_t n)
{
    if (n >= b->len) {
        b->len = 0;
        return;
    }
    memmove(b->p, b->p + n, b->len - n);
    b->len -= n;
}

void sp_buf_reset(sp_buf_t *b)
{
    b->len = 0;
    b->oom = false;
}

void sp_buf_free(sp_buf_t *b)
{
    free(b->p);
    memset(b, 0, sizeof(*b));
}
