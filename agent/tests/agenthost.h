/*
 * agenthost.h - the host end of the agent protocol for the agent's own tests (test_agent.c,
 * test_egress.c): their start (a temporary directory, the agent under test started), one
 * connection to that space-agent, frames read and written synchronously, and a look at the
 * agent process. Test code: REQUIRE stops the program.
 */
#ifndef SP_AGENT_TESTS_AGENTHOST_H
#define SP_AGENT_TESTS_AGENTHOST_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>

#include "base/agentproto.h"

extern int ah_fd;               /* the channel: we are the host; -1 when not connected */
extern uint32_t ah_next_stream; /* the next host-opened stream id */
extern pid_t ah_agent_pid;      /* the agent under test, 0 when none */
extern sp_ap_writer_t ah_w;     /* the frame being built (ah_begin .. ah_send_frame) */
extern uint8_t ah_wbuf[SP_AP_MAX_FRAME + 64];

typedef struct {
    sp_ap_hdr_t h;
    const uint8_t *p;
} frame_t;

void ah_write_all(const void *p, size_t n);
/* Reads exactly n bytes, each poll waiting at most timeout_ms: 0, or -1 on timeout or EOF. */
int ah_read_full(void *p, size_t n, int timeout_ms);
/* Next frame from the agent; the payload lives until the next call. -1 on timeout or EOF. */
int ah_recv_frame(frame_t *f, int timeout_ms);
/* Next frame on stream (WINDOW frames too unless skip_window); others are skipped, as tests
 * run one request at a time. Stops the test after 15 s. */
frame_t ah_wait_on(uint32_t stream, bool skip_window);

sp_ap_writer_t *ah_begin(uint32_t stream, uint16_t type, uint16_t flags);
void ah_send_frame(void);
void ah_send_empty(uint32_t stream, uint16_t type, uint16_t flags);
void ah_send_data(uint32_t stream, const void *p, size_t n);
void ah_grant(uint32_t stream, uint32_t n);

uint32_t ah_u32_of(const frame_t *f, uint16_t tag, uint32_t dflt);
/* An ERROR frame's CODE, 0 for other frames. */
uint32_t ah_err_code(const frame_t *f);

/* A PING answered by a PONG (CHECK). */
void ah_ping_ok(void);

/* The start of a test's main: exits 77 (saying why) without SP_AGENT_BIN, ignores SIGPIPE,
 * makes a temporary directory /tmp/<prefix>-XXXXXX (mode 0755: the agent switches users) into
 * dir and the path of the agent's socket in it into sock. */
void ah_prepare(const char *prefix, char *dir, size_t dn, char *sock, size_t sn);
/* Starts SP_AGENT_BIN listening on the unix socket sock, with --env-file env_file unless
 * NULL: its pid. It dies with the test (a test killed by a timeout takes its agent along). */
pid_t ah_spawn_agent(const char *sock, const char *env_file);
/* Connects ah_fd to the agent's unix socket, waiting up to 5 s for it to listen. */
void ah_connect(const char *sock_path);
bool ah_agent_alive(void);
/* The agent's resident set in KiB, -1 when unknown. */
long ah_agent_rss_kb(void);

#endif
