/*
 * ring.c - see ring.h. Byte at absolute offset o lives at buf[o % cap].
 */
#include "agent/ring.h"

#include <stdlib.h>
#include <string.h>

void sp_ring_init(sp_ring_t *r, size_t max)
{
    memset(r, 0, sizeof(*r));
    r->max = max;
}

void sp_ring_free(sp_ring_t *r)
{
    free(r->buf);
    r->buf = NULL;
    r->cap = 0;
}

uint64_t sp_ring_tail(const sp_ring_t *r)
{
    return r->head > r->cap ? r->head - r->cap : 0;
}

/* Re-lays the kept bytes into a bigger buffer at their new positions. */
static int grow(sp_ring_t *r, size_t want)
{
    size_t cap = r->cap ? r->cap : 4096;
    while (cap < want && cap < r->max)
        cap *= 2;
    if (cap > r->max)
        cap = r->max;
    if (cap <= r->cap)
        return 0;
    uint8_t *nb = malloc(cap);
    if (nb == NULL)
        return -1;
    for (uint64_t o = sp_ring_tail(r); o < r->head; o++)
        nb[o % cap] = r->buf[o % r->cap];
    free(r->buf);
    r->buf = nb;
    r->cap = cap;
    return 0;
}

int sp_ring_write(sp_ring_t *r, const void *p, size_t n)
{
    const uint8_t *s = p;
    if (n == 0)
        return 0;
    if (r->head + n - sp_ring_tail(r) > r->cap && r->cap < r->max) {
        if (grow(r, (size_t)(r->head - sp_ring_tail(r)) + n) < 0)
            return -1;
    }
    if (n > r->cap) { /* only the last cap bytes can be kept */
        s += n - r->cap;
        r->head += n - r->cap;
        n = r->cap;
    }
    size_t at = (size_t)(r->head % r->cap);
    size_t first = r->cap - at < n ? r->cap - at : n;
    memcpy(r->buf + at, s, first);
    memcpy(r->buf, s + first, n - first);
    r->head += n;
    return 0;
}

size_t sp_ring_read(const sp_ring_t *r, uint64_t *pos, void *out, size_t n)
{
    uint64_t tail = sp_ring_tail(r);
    if (*pos < tail)
        *pos = tail;
    if (*pos >= r->head || r->cap == 0)
        return 0;
    if (n > r->head - *pos)
        n = (size_t)(r->head - *pos);
    size_t at = (size_t)(*pos % r->cap);
    size_t first = r->cap - at < n ? r->cap - at : n;
    memcpy(out, r->buf + at, first);
    memcpy((uint8_t *)out + first, r->buf, n - first);
    *pos += n;
    return n;
}
