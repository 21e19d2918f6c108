/*
 * stream.h - streamed response bodies for both HTTP surfaces: command output, code
 * execution events, file downloads, Connect server streams.
 *
 * Bytes written go out as the client takes them. Each write carries a raw count (the upstream
 * bytes it stands for, e.g. agent bytes before encoding); on_sent reports the raw count of what
 * the client took, which is when the caller may grant that much credit upstream. So a
 * slow client holds the sender back, and memory here is what was written and not yet taken:
 * bounded by the caller's upstream window. on_gone says the client left: the stream is freed
 * after it returns and no other call may follow. After sp_stream_end the stream is gone too,
 * and no callback comes.
 */
#ifndef SP_STREAM_H
#define SP_STREAM_H

#include <h2o.h>
#include <stdbool.h>
#include <stdint.h>
#include <stddef.h>

typedef struct sp_stream sp_stream_t;
typedef struct {
    void (*on_sent)(void *arg, size_t raw); /* may be NULL */
    void (*on_gone)(void *arg);             /* may be NULL */
} sp_stream_cbs_t;

/* Sends status and headers (content type, Cache-Control: no-store); content_length < 0:
 * chunked. NULL when out of memory (then nothing was sent). */
sp_stream_t *sp_stream_start(h2o_req_t *req, int status, const char *content_type,
                             long long content_length, const sp_stream_cbs_t *cbs, void *arg);
/* Queues n bytes (copied; n may be 0 to hand back raw credit alone). Whatever one write
 * queued travels in one buffer. -1 when out of memory. */
int sp_stream_write(sp_stream_t *st, const void *p, size_t n, size_t raw);
/* Bytes written and not yet taken by the client. */
size_t sp_stream_pending(const sp_stream_t *st);
/* Ends the body after what was queued, with tail (n bytes, may be 0) last. ok false, or no
 * memory for the tail, aborts the response: the client sees a cut body. */
void sp_stream_end(sp_stream_t *st, const void *tail, size_t n, bool ok);

/* The stream as a plain byte sink, for producers in core that take write/end callbacks with
 * an opaque output (core/channel/download.h): every byte counts as raw, no tail. */
int sp_stream_sink_write(void *st, const uint8_t *p, size_t n);
void sp_stream_sink_end(void *st, bool ok);

#endif
