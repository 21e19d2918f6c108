/*
 * chunked.h - the chunked transfer coding (RFC 9112 7.1), decoded incrementally: for any
 * reader of an HTTP/1.1 response body (spacectl's client, the gateway's port forwarder).
 *
 * Strict on the framing (sizes, CRLFs); chunk extensions and trailers are read and dropped.
 * No allocation: the caller keeps the input and copies out what is handed out.
 */
#ifndef SP_BASE_CHUNKED_H
#define SP_BASE_CHUNKED_H

#include <stddef.h>
#include <stdint.h>

typedef struct {
    int state;
    uint64_t left; /* bytes of the current chunk not yet handed out */
    int digits;
} sp_chunked_t;

#define SP_CHUNKED_INIT                                                                            \
    {                                                                                              \
        0, 0, 0                                                                                    \
    }

/* Consumes bytes of in[0, n) (*used of them) until it has body bytes to hand out (*data,
 * pointing into in, *dlen of them, at most max), needs more input, or reached the end.
 * Returns 1 at the end (the last chunk and any trailers were read), 0 otherwise, -1 when the
 * input is not chunked coding. Extensions and trailers are skipped. */
int sp_chunked_step(sp_chunked_t *d, const uint8_t *in, size_t n, size_t max, size_t *used,
                    const uint8_t **data, size_t *dlen);

#endif
