/*
 * sess.h - the session with the host: stream table, frame routing, windows.
 *
 * Owns every open stream. Routes frames from chan: control on stream 0,
 * openers to the module that serves them, the rest to the stream's ops.
 * Enforces the host's send window and stream-id rules so modules only see
 * well-formed, in-window frames. A session ends on HELLO or hangup; streams
 * are closed, processes are not.
 */
#ifndef SP_AGENT_SESS_H
#define SP_AGENT_SESS_H

#include <stdbool.h>
#include <stdint.h>

#include "base/agentproto.h"

typedef struct sp_stream sp_stream_t;

typedef struct {
    /* A non-opening frame for this stream (DATA, EOF, PROC_SIGNAL, ...). DATA is
     * already charged to the receive window. May close the stream. */
    void (*on_frame)(sp_stream_t *s, const sp_ap_hdr_t *h, const uint8_t *p);
    /* Send what credit and tx room allow. May close the stream. NULL: nothing to pump. */
    void (*pump)(sp_stream_t *s);
    /* The stream is being forgotten: release obj. Must not send frames. */
    void (*close)(sp_stream_t *s);
} sp_stream_ops_t;

struct sp_stream {
    uint32_t id;
    const sp_stream_ops_t *ops;
    void *obj;
    uint64_t send_credit; /* bytes of DATA/STDOUT/STDERR we may still send */
    uint64_t recv_credit; /* bytes of DATA the host may still send */
    uint32_t grant_pending; /* consumed, not yet given back (see sp_stream_grant) */
    bool closing;
    sp_stream_t *next;
};

/* Frame routing, called by chan. */
void sp_sess_on_frame(const sp_ap_hdr_t *h, const uint8_t *p);
void sp_sess_on_bad_header(const sp_ap_hdr_t *h, bool oversize);
/* Closes every stream (host gone or new HELLO). */
void sp_sess_reset(void);
/* Gives every stream a chance to send; called once per loop iteration. */
void sp_sess_pump_all(void);

/* Registers an opened stream with the initial windows. NULL if out of memory. */
sp_stream_t *sp_sess_open(uint32_t id, const sp_stream_ops_t *ops, void *obj);
/* Forgets the stream (ops->close runs). Safe to call from its own callbacks. */
void sp_stream_close(sp_stream_t *s);
/* Sends ERROR (END) on a stream id and forgets the stream if open. */
void sp_sess_error(uint32_t id, uint32_t code, int sys_errno, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));
/* ERROR (SP_AP_E_TYPE): a frame of a type a stream of this kind ("read", "tcp"...) does not
 * take. */
void sp_stream_bad_type(sp_stream_t *s, uint16_t type, const char *kind);
/* ERROR for an errno value, code mapped from it. */
void sp_sess_error_errno(uint32_t id, int sys_errno, const char *what);
/* Maps errno to SP_AP_E_*. */
uint32_t sp_sess_errcode(int sys_errno);
/* Sends a frame with no payload. */
void sp_sess_send_empty(uint32_t id, uint16_t type, uint16_t flags);
/* Gives the host n more bytes of receive window on s (a WINDOW frame). */
void sp_stream_grant(sp_stream_t *s, uint32_t n);
/* Socket -> host: what fd holds (at most what s may send) as one DATA frame, or, at the
 * socket's end, EOF (and *eof set). 0 also when the channel or the socket has nothing now;
 * -1 with errno when recv failed: the caller ends the stream its own way. */
int sp_stream_recv(sp_stream_t *s, int fd, bool *eof);

/* Default environment from the last IDENTITY ("K=V" strings, owned by sess). */
extern char **sp_sess_default_env;
extern int sp_sess_default_envc;

#endif
