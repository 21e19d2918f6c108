/*
 * ring.h - bounded byte ring addressed by absolute stream offsets.
 *
 * Keeps the last `max` bytes written. Readers hold their own absolute
 * offset, so several attached streams can read at different speeds; an
 * offset older than the oldest kept byte is moved forward (those bytes are
 * lost). Grows on demand up to max, so idle processes cost little.
 */
#ifndef SP_AGENT_RING_H
#define SP_AGENT_RING_H

#include <stddef.h>
#include <stdint.h>

typedef struct {
    uint8_t *buf;
    size_t cap; /* current allocation, a power of two <= max */
    size_t max;
    uint64_t head; /* total bytes ever written */
} sp_ring_t;

void sp_ring_init(sp_ring_t *r, size_t max);
void sp_ring_free(sp_ring_t *r);
/* Offset of the oldest byte still kept. */
uint64_t sp_ring_tail(const sp_ring_t *r);
/* Appends n bytes, overwriting the oldest beyond max. -1 if out of memory. */
int sp_ring_write(sp_ring_t *r, const void *p, size_t n);
/* Copies up to n bytes from *pos (advanced past lost bytes first); returns bytes copied. */
size_t sp_ring_read(const sp_ring_t *r, uint64_t *pos, void *out, size_t n);

#endif
