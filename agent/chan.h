/*
 * chan.h - the byte channel to the host: a virtio-serial port or, for tests,
 * a unix socket that accepts one client at a time.
 *
 * Owns the channel fd, the frame reader and the transmit queue. Frames read
 * are handed to sess; frames to send are built in place in the queue. When
 * the host goes away sess is reset and the queue loses a partly written frame
 * (all of it for a unix client); the channel is then re-polled (virtio) or
 * the next client accepted (unix).
 */
#ifndef SP_AGENT_CHAN_H
#define SP_AGENT_CHAN_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>

#include "base/agentproto.h"

/* Opens a virtio-serial port (or any character device / FIFO pair). 0 or -1. */
int sp_chan_open_path(const char *path);
/* Listens on a unix socket path (removed first). 0 or -1. */
int sp_chan_listen_unix(const char *path);

/* Is a host there to send to? Frames built while not connected are dropped. */
bool sp_chan_connected(void);
/* Bytes queued but not yet written. Producers of bulk data stop above SP_CHAN_TX_SOFT. */
size_t sp_chan_tx_queued(void);
#define SP_CHAN_TX_SOFT (1u << 20)
/* True when bulk producers may add a frame. */
bool sp_chan_tx_ok(void);

/*
 * Starts a frame with room for max_payload bytes and returns its writer;
 * finish with sp_chan_end(). Only one frame is open at a time. Returns NULL
 * when out of memory (the caller drops the frame).
 */
sp_ap_writer_t *sp_chan_begin(uint32_t stream, uint16_t type, uint16_t flags, size_t max_payload);
/* Queues the frame begun last; drops it on overflow. 0 or -1. A frame that
 * is begun but never ended is simply discarded by the next sp_chan_begin. */
int sp_chan_end(sp_ap_writer_t *w);

/* The channel's read(2) and write(2), which a test replaces to play a virtio port's host
 * side and its hangups (agent/tests/test_chan.c). NULL restores the real call. */
typedef ssize_t (*sp_chan_read_fn)(int fd, void *buf, size_t n);
typedef ssize_t (*sp_chan_write_fn)(int fd, const void *buf, size_t n);
void sp_chan_set_io(sp_chan_read_fn r, sp_chan_write_fn w);

/* Timeout for the next poll (ms, -1 = none) that chan needs for re-polling. */
int sp_chan_timeout_ms(void);
/* Called every loop iteration: re-arms a channel paused after a hangup. */
void sp_chan_tick(void);

#endif
