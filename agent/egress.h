/*
 * egress.h - the guest side of outbound traffic: a local HTTP(S) proxy port and
 * a DNS answer path, both relayed to the host's egress proxy over agent-opened
 * streams. The guest has no network device; this is its only way out.
 *
 * Owns the proxy listener and its connections, the DNS sockets and queries in
 * flight, the environment the host asks for, and two files:
 * /etc/resolv.conf and /etc/profile.d/space-egress.sh. Parses no HTTP and no
 * DNS beyond a message's header and question (the host does both).
 *
 * Guest-side behaviour:
 * - EGRESS_CONFIG (latest wins, re-sent by the host after every HELLO):
 *   PROXY_PORT > 0 listens on 127.0.0.1:<port> (a changed port replaces the
 *   listener; connections already open carry on); 0 closes the listener and
 *   every proxy connection. DNS=1 listens on 127.0.0.1:53 UDP and TCP and
 *   writes /etc/resolv.conf as "nameserver 127.0.0.1" (tmp file + rename; the
 *   original is kept once as /etc/resolv.conf.space-orig and put back when DNS
 *   goes to 0). ENV "K=V" entries override the default env of later
 *   PROC_START (over IDENTITY's, under the request's own ENV) and are written
 *   as `export K='V'` to /etc/profile.d/space-egress.sh for login shells; the
 *   file is removed when PROXY_PORT is 0. Bad fields or sockets that cannot be
 *   bound: ERROR, and nothing changes. A file that cannot be written: ERROR,
 *   with the sockets and env already applied.
 * - Each accepted proxy connection opens a stream (id with
 *   SP_AP_STREAM_AGENT_BASE, counted up, so ids are not reused until 2^31
 *   later) with EGRESS_OPEN {KIND=PROXY, PEER_PORT}; bytes flow as DATA/EOF
 *   under the usual windows both ways (the host's credit is granted back as
 *   bytes reach the guest socket, so each connection buffers at most one
 *   window). Guest EOF -> EOF; guest reset or a failed write -> RESET. Host OK
 *   -> pending bytes are flushed, the socket is shut down and drained for up to
 *   10 s, then closed; host ERROR, RESET or a lost session -> the guest socket
 *   is reset. At most SP_EGRESS_MAX_CONNS connections; beyond that, and while
 *   no host is connected, a new connection is accepted and closed at once.
 * - Each DNS query (UDP datagram <= 4096 bytes, or a length-prefixed TCP
 *   message) opens a DNS_QUERY stream. DNS_ANSWER goes back to the querier
 *   (same address and port; TCP: length-prefixed) with the query's id; ERROR,
 *   RESET, a lost session, no answer within 5 s, no host, or more than
 *   SP_EGRESS_MAX_QUERIES in flight -> SERVFAIL carrying the query's question.
 *
 * In the guest the agent also brings lo up at start: 127.0.0.1 exists only then.
 *
 * Host test mode (--listen-unix, sp_agent_apply_system == 0) never touches the
 * host's files or port 53: the files are written only where
 * SP_AGENT_EGRESS_RESOLV_CONF and SP_AGENT_EGRESS_PROFILE point, and DNS=1
 * needs SP_AGENT_EGRESS_DNS_PORT (else the config is answered with ERROR).
 */
#ifndef SP_AGENT_EGRESS_H
#define SP_AGENT_EGRESS_H

#include <stdint.h>

#define SP_EGRESS_MAX_CONNS   4096 /* proxy connections, lingering ones included */
#define SP_EGRESS_MAX_QUERIES 256  /* DNS queries waiting for the host */

/* Guest: brings lo up. Host test mode: reads the overrides. Both: raises RLIMIT_NOFILE
 * to 8192 (inherited by processes the agent starts). Call once before the loop. */
void sp_egress_init(void);

/* EGRESS_CONFIG opener, called by sess. Answers OK or ERROR. */
void sp_egress_on_config(uint32_t id, const uint8_t *p, uint32_t n);

/* "K=V" strings of the latest config, owned by egress; valid until the next config. */
char *const *sp_egress_env(int *n);

/* ms until the next egress deadline (-1: none). */
int sp_egress_timeout_ms(void);
/* Expires DNS queries, lingering connections and idle DNS clients; call every iteration. */
void sp_egress_tick(void);

#endif
