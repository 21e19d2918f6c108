/*
 * bodygate_int.h - what bodygate.c (the gate, HTTP/1, streamed bodies, TLS) and bodygate_h2.c
 * (HTTP/2's frames and streamed bodies) share: the state per gated socket and per HTTP/2
 * stream, and the calls between the two. Not for any other file.
 */
#ifndef SP_BODYGATE_INT_H
#define SP_BODYGATE_INT_H

#include <h2o.h>
#include <h2o/http2.h>
#include <h2o/http2_internal.h>
#include <stdbool.h>
#include <stdint.h>

#include "base/chunked.h"
#include "http/bodygate.h"

/* A streamed body is read from the socket in pieces of at most this much. */
#define PIECE_MAX ((size_t)512 << 10)

enum gs_state {
    GS_IDLE,   /* the next bytes are a request head */
    GS_BODY,   /* a head was handed on; h2o reads its body through us */
    GS_HANDED, /* the handler has the request; reads resume once h2o is done with it */
};

/* A streamed body being read (sp_bodygate_body_read). */
struct gbody {
    h2o_req_t *req;
    bool chunked, expect; /* expect: 100 Continue not yet sent */
    bool end, failed, collected;
    bool deferred; /* a pump is deferred (the socket's holds count it) */
    bool tls;      /* read through h2o's socket (which decrypts), not the dup */
    bool reading;  /* tls: h2o's socket is being read for it */
    uint64_t left; /* Content-Length: body bytes still to come */
    uint64_t got;  /* bytes read of it (chunked: as sent, framing included) */
    uint64_t cap;  /* chunked: the most got may reach */
    sp_chunked_t ck;
    size_t pre;     /* its bytes h2o read already, not handed out yet */
    size_t pre_off; /* those handed out: pre's bytes start at head + pre_off in the input */
    int fd;         /* a dup of the socket's: read directly (plain), drained after (-1: none) */
    sp_watch_t *w;
    char *buf; /* PIECE_MAX: the piece handed out */
    sp_bodygate_body_cb cb;
    void *arg;
};

struct gs {
    sp_bodygate_t *g;
    h2o_socket_t *sock; /* NULL once closed */
    h2o_socket_cb orig; /* h2o's read callback */
    enum gs_state state;
    size_t head_len; /* the current request's head, from the start of the input */
    uint64_t length; /* its Content-Length */
    bool chunked;
    uint64_t chunked_cap;
    bool large;   /* counted in g->large_now */
    bool refused; /* the current request is a refusal; verdict is what to send */
    sp_bodygate_verdict_t verdict;
    unsigned holds;      /* live request hooks and deferred rearms: free only at 0 */
    int fd;              /* the socket's fd (h2o's: never closed here) */
    int drain_fd;        /* a refusal: a dup of fd, drained once h2o closes (-1: none) */
    uint64_t drain_left; /* body bytes the refused request still has to send */
    bool in_read;
    bool unreadable;    /* the next head is one the gate cannot read: close */
    bool h2_prior;      /* the input starts with HTTP/2's preface (prior knowledge) */
    bool h2_seen;       /* HTTP/2: h2o has read the connection preface */
    struct h2s *h2s;    /* HTTP/2: the streams with a body the gate has vetted */
    bool h2_deferred;   /* HTTP/2: a pass handing streamed bodies' pieces out is deferred */
    uint64_t h2_queued; /* HTTP/2: streamed bodies' bytes queued, all streams (h2_held) */
    h2o_timeout_entry_t h2_tick; /* that pass, on h2o's zero timeout (sp_bodygate__h2_schedule) */
    h2o_timeout_entry_t b_tick;  /* HTTP/1: a streamed body's deferred read (body_deferred) */
    /* the head just vetted is streamed (its body stays on the socket): its framing */
    bool s_next, s_chunked, s_expect;
    bool vet_read;     /* vet is looking at a head gate_on_read just read (nothing writes) */
    bool tls_continue; /* TLS: its 100 Continue is sent before h2o has the head */
    uint64_t s_length, s_cap;
    struct gbody b;     /* the body of the request being handled, when streamed (b.req) */
    h2o_buffer_t *held; /* TLS: the input the streamed request's head is in, kept until the
                         * socket closes (h2o's request points into it; the socket reads into
                         * a new one meanwhile) */
    struct gs *prev, *next;
};

struct sp_bodygate {
    sp_loop_t *loop;
    sp_bodygate_policy_cb policy;
    void *arg;
    unsigned max_large, large_now;
    struct gs *head;
};

enum h2s_state {
    H2S_OPEN,      /* its body comes */
    H2S_STREAMING, /* streamed: ended for h2o at its head, its DATA kept for the handler */
    H2S_ANSWERING, /* refused and ended for h2o; h2o still has it */
    H2S_DONE,      /* refused or streamed, and h2o is done with it */
};

struct h2s {
    struct gs *st;
    struct h2s *next;
    uint32_t id;
    enum h2s_state state;
    bool refuse;   /* ends at its next DATA frame, answered with verdict */
    bool answered; /* the handler took the verdict */
    bool hooked;   /* h2o's stream (its request's pool) is alive */
    bool large;    /* counted in g->large_now */
    bool rst_sent;
    uint64_t got, cap; /* DATA bytes seen; the most it may send */
    sp_bodygate_verdict_t verdict;
    /* a streamed body (the verdict's `stream`): h2o has the request with an empty body, and
     * the handler reads its DATA from here (sp_bodygate_body_read) */
    bool stream;            /* streamed once its state is STREAMING */
    bool chunked;           /* no content-length: got is unbounded but by cap */
    h2o_req_t *req;         /* STREAMING: the stream's request (h2o's, while hooked) */
    h2o_buffer_t *q;        /* STREAMING: payload not handed out yet */
    uint64_t raw, granted;  /* DATA frame bytes (padding too) taken; given back to its window */
    bool q_end;             /* END_STREAM came: q holds the rest */
    bool failed, end_given; /* the reader got an error, or the end */
    bool collected, want;   /* read whole (collect); a read waits for a piece */
    sp_err_t err;           /* failed: why */
    char *buf;              /* PIECE_MAX: the piece handed out */
    sp_bodygate_body_cb cb;
    void *arg;
};

/* ---- bodygate.c ---- */

/* Frees st once its socket is gone and nothing holds it. */
void sp_bodygate__gs_free_if_done(struct gs *st);
/* The socket's on_close hook: what finds st (sock->on_close.data) and tells a gated socket. */
void sp_bodygate__gs_on_close(void *data);
/* The policy's verdict on head h. */
void sp_bodygate__ask(sp_bodygate_t *g, const sp_bodygate_head_t *h, sp_bodygate_verdict_t *v);
/* A streamed body ended, whole or cut, after bytes: the metrics. */
void sp_bodygate__count(bool whole, uint64_t bytes);

/* ---- bodygate_h2.c ---- */

/* The gate's read callback on an HTTP/2 connection (in place of h2o's). */
void sp_bodygate__h2_on_read(h2o_socket_t *sock, const char *err);
/* Before h2o takes sock as HTTP/2 with input already read: the input cut after the preface
 * (and one byte), so that h2o reads the preface alone; returns the input's size. */
size_t sp_bodygate__h2_cut(h2o_socket_t *sock);
/* After h2o read the cut input: the rest back and the gate on what follows the preface. */
void sp_bodygate__h2_uncut(struct gs *st, size_t total);
/* After it, when h2o did not take the socket as HTTP/2: the rest back; what h2o consumed. */
size_t sp_bodygate__h2_restore(h2o_socket_t *sock, size_t total);
struct h2s *sp_bodygate__h2s_find(struct gs *st, uint32_t id);
void sp_bodygate__h2s_free_all(struct gs *st);
/* req's streamed HTTP/2 body, when it is one (NULL: not HTTP/2, not streamed, or gone). */
struct h2s *sp_bodygate__h2s_of(h2o_req_t *req);
/* Whether e's pending read can be answered now. */
bool sp_bodygate__h2s_ready(const struct h2s *e);
/* The pass handing streamed bodies' pieces out, on h2o's zero timeout. */
void sp_bodygate__h2_schedule(struct gs *st);

#endif
