/*
 * connectrpc.h - the Connect protocol on h2o: a request's headers and message, unary replies
 * and server streams. The messages, codecs, envelopes and error codes are connect.h's.
 */
#ifndef SP_CONNECTRPC_H
#define SP_CONNECTRPC_H

#include <h2o.h>

#include "e2b-gateway/connect.h"
#include "http/stream.h"

/* Fills cr from req's headers; -1 with a client-safe message in err. */
int sp_connect_request(h2o_req_t *req, sp_connect_req_t *cr, sp_err_t *err);

/* The request message: for unary the whole body, for streaming the single envelope it
 * holds (what follows it is ignored). Decoded with the request's codec into msg. */
int sp_connect_read_msg(h2o_req_t *req, const sp_connect_req_t *cr, const sp_cdesc_t *d, void *msg,
                        sp_carena_t *a, sp_err_t *err);

/* ---- responses ---- */

/* Unary success: 200, the message in the request's codec. */
void sp_connect_reply(h2o_req_t *req, const sp_connect_req_t *cr, const sp_cdesc_t *d,
                      const void *msg);
/* Unary (or not yet started stream) error: status from the code, JSON {code, message}. */
void sp_connect_reply_error(h2o_req_t *req, sp_connect_code_t code, const char *msg);

/* Connect server streams, on http/stream.h (which also carries raw bytes, for /files
 * downloads). Each write is whole envelopes, so an envelope's header and payload always travel
 * in one buffer. */
/* One message as a data envelope. */
int sp_connect_stream_msg(sp_stream_t *st, sp_connect_codec_t codec, const sp_cdesc_t *d,
                          const void *msg, size_t raw);
/* The end-stream envelope ({} or {"error":{code,message}}), then the end of the body. */
void sp_connect_stream_finish(sp_stream_t *st, sp_connect_code_t code, const char *msg);

/* Content type of a Connect stream in this codec. */
const char *sp_connect_stream_ctype(sp_connect_codec_t codec);

#endif
