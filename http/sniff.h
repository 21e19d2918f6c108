/*
 * sniff.h - one listening socket for both HTTPS and plain HTTP.
 *
 * The E2B SDKs reach the API over http:// and sandbox hosts over https:// and
 * the server answers both on one address (spec 1.6): each accepted connection
 * waits until its first byte is readable, which is peeked (not consumed);
 * 0x16 (a TLS handshake record) hands it to the TLS accept context, anything
 * else to the plain one. A connection that sends nothing within the timeout
 * is closed, and at most SP_SNIFF_MAX_PENDING wait at once (beyond that the
 * listener pauses and the kernel backlog holds the rest).
 */
#ifndef SP_SNIFF_H
#define SP_SNIFF_H

#include <h2o.h>

#include "http/bodygate.h"
#include "loop/loop.h"

#define SP_SNIFF_TIMEOUT_MS  10000
#define SP_SNIFF_MAX_PENDING 256 /* each holds two fds while it waits */

typedef struct sp_sniff sp_sniff_t;

/*
 * Starts accepting on listen_fd (a listening socket; owned from here: closed by
 * destroy). plain and tls are borrowed and must outlive the sniffer; tls NULL
 * sends every connection to plain. NULL on allocation failure (fd still the caller's).
 */
sp_sniff_t *sp_sniff_create(sp_loop_t *loop, int listen_fd, h2o_accept_ctx_t *plain,
                            h2o_accept_ctx_t *tls);
/* HTTP/1 connections from here on get the body gate (NULL: none); borrowed. */
void sp_sniff_set_gate(sp_sniff_t *s, sp_bodygate_t *g);
/* Stops listening, closes connections still being sniffed. NULL does nothing. */
void sp_sniff_destroy(sp_sniff_t *s);

#endif
