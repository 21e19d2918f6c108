/*
 * tcp.h - TCP_CONNECT streams: a connection to a port inside the guest whose
 * bytes flow both ways as DATA/EOF frames (HTTP forwarding to guest servers).
 *
 * Owns the socket and the bytes the host sent that the socket has not taken.
 */
#ifndef SP_AGENT_TCP_H
#define SP_AGENT_TCP_H

#include <stdint.h>

void sp_tcp_on_connect(uint32_t id, const uint8_t *p, uint32_t n);

#endif
