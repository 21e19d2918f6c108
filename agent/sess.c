/*
 * sess.c - stream table and routing for one host session.
 *
 * Invariant: a frame reaches a module only after its type was checked for
 * the direction and stream (sp_ap_check_from_host), and DATA only within the
 * window the agent granted. Anything else ends that stream with ERROR.
 * Streams are closed lazily (marked, then unlinked by sweep) so a module can
 * close its stream from inside any callback.
 */
#include "agent/sess.h"

#include <errno.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>

#include "agent/agent.h"
#include "agent/chan.h"
#include "agent/egress.h"
#include "agent/fs.h"
#include "agent/proc.h"
#include "agent/sysinit.h"
#include "agent/tcp.h"
#include "agent/watch.h"
#include "base/log.h"

#define GRANT_MIN (SP_AP_INITIAL_WINDOW / 4) /* bytes of credit given back at once */

static sp_stream_t *streams;
char **sp_sess_default_env;
int sp_sess_default_envc;

static sp_stream_t *find(uint32_t id)
{
    for (sp_stream_t *s = streams; s != NULL; s = s->next)
        if (s->id == id && !s->closing)
            return s;
    return NULL;
}

static void sweep(void)
{
    sp_stream_t **pp = &streams;
    while (*pp != NULL) {
        sp_stream_t *s = *pp;
        if (s->closing) {
            *pp = s->next;
            free(s);
        } else {
            pp = &s->next;
        }
    }
}

sp_stream_t *sp_sess_open(uint32_t id, const sp_stream_ops_t *ops, void *obj)
{
    sp_stream_t *s = calloc(1, sizeof(*s));
    if (s == NULL)
        return NULL;
    s->id = id;
    s->ops = ops;
    s->obj = obj;
    s->send_credit = SP_AP_INITIAL_WINDOW;
    s->recv_credit = SP_AP_INITIAL_WINDOW;
    s->next = streams;
    streams = s;
    return s;
}

void sp_stream_close(sp_stream_t *s)
{
    if (s == NULL || s->closing)
        return;
    s->closing = true;
    if (s->ops->close != NULL)
        s->ops->close(s);
}

void sp_sess_reset(void)
{
    for (sp_stream_t *s = streams; s != NULL; s = s->next)
        sp_stream_close(s);
    sweep();
}

void sp_sess_pump_all(void)
{
    for (sp_stream_t *s = streams; s != NULL; s = s->next)
        if (!s->closing && s->ops->pump != NULL)
            s->ops->pump(s);
    sweep();
}

void sp_sess_send_empty(uint32_t id, uint16_t type, uint16_t flags)
{
    sp_ap_writer_t *w = sp_chan_begin(id, type, flags, 0);
    if (w != NULL)
        sp_chan_end(w);
}

void sp_sess_error(uint32_t id, uint32_t code, int sys_errno, const char *fmt, ...)
{
    char msg[200];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof(msg), fmt, ap);
    va_end(ap);
    sp_log(SP_LOG_DEBUG, "sess", "stream error stream=%u code=%u msg=%s", id, code, msg);
    sp_ap_writer_t *w = sp_chan_begin(id, SP_AP_T_ERROR, SP_AP_F_END, 256);
    if (w != NULL) {
        sp_ap_put_u32(w, SP_AP_K_CODE, code);
        sp_ap_put_u32(w, SP_AP_K_ERRNO, (uint32_t)sys_errno);
        sp_ap_put_str(w, SP_AP_K_MSG, msg);
        sp_chan_end(w);
    }
    if (id != 0)
        sp_stream_close(find(id));
}

uint32_t sp_sess_errcode(int e)
{
    switch (e) {
    case ENOENT:
        return SP_AP_E_NOTFOUND;
    case EACCES:
    case EPERM:
    case EROFS:
        return SP_AP_E_PERM;
    case EEXIST:
    case ENOTEMPTY:
        return SP_AP_E_EXISTS;
    case ENOTDIR:
        return SP_AP_E_NOTDIR;
    case EISDIR:
        return SP_AP_E_ISDIR;
    case EINVAL:
    case ENAMETOOLONG:
    case ELOOP:
        return SP_AP_E_INVAL;
    case EFBIG:
    case ENOSPC:
    case E2BIG:
        return SP_AP_E_TOOBIG;
    case ECONNREFUSED:
    case ETIMEDOUT:
    case EHOSTUNREACH:
        return SP_AP_E_UNAVAIL;
    default:
        return SP_AP_E_IO;
    }
}

void sp_sess_error_errno(uint32_t id, int e, const char *what)
{
    sp_sess_error(id, sp_sess_errcode(e), e, "%s: %s", what, strerror(e));
}

void sp_stream_grant(sp_stream_t *s, uint32_t n)
{
    if (n == 0 || s->closing)
        return;
    /* Credit goes back in steps of GRANT_MIN, not per write: a socket that takes a few
     * hundred bytes at a time would otherwise pull the host into sending frames that
     * small, and the pair stays there (measured: 1 KB frames, 1.8 MB/s instead of
     * 20-30 MB/s). The host still holds window - GRANT_MIN, so it never waits on this. */
    s->grant_pending += n;
    if (s->grant_pending < GRANT_MIN)
        return;
    uint32_t inc = s->grant_pending;
    sp_ap_writer_t *w = sp_chan_begin(s->id, SP_AP_T_WINDOW, 0, 16);
    if (w == NULL)
        return; /* kept pending: the next grant retries */
    sp_ap_put_u32(w, SP_AP_K_WINDOW, inc);
    sp_chan_end(w);
    s->grant_pending = 0;
    s->recv_credit += inc;
}

void sp_stream_bad_type(sp_stream_t *s, uint16_t type, const char *kind)
{
    sp_sess_error(s->id, SP_AP_E_TYPE, 0, "%s not valid on a %s stream", sp_ap_type_name(type),
                  kind);
}

int sp_stream_recv(sp_stream_t *s, int fd, bool *eof)
{
    size_t want = SP_AP_MAX_DATA;
    if (want > s->send_credit)
        want = (size_t)s->send_credit;
    sp_ap_writer_t *w = sp_chan_begin(s->id, SP_AP_T_DATA, 0, want);
    if (w == NULL)
        return 0; /* no room: the next pump retries */
    ssize_t n = recv(fd, w->buf + w->len, want, 0);
    if (n > 0) {
        w->len += (size_t)n;
        sp_chan_end(w);
        s->send_credit -= (uint64_t)n;
    } else if (n == 0) {
        *eof = true;
        sp_sess_send_empty(s->id, SP_AP_T_EOF, 0);
    } else if (errno != EAGAIN && errno != EINTR) {
        return -1;
    }
    return 0;
}

static uint64_t boot_ns(void)
{
    static uint64_t t;
    if (t == 0) {
        struct timespec ts;
        clock_gettime(CLOCK_BOOTTIME, &ts);
        t = (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
    }
    return t;
}

static void on_hello(const sp_ap_hdr_t *h, const uint8_t *p)
{
    sp_ap_hello_t in;
    sp_err_t err;
    if (sp_ap_dec_hello(p, h->len, &in, &err) < 0) {
        sp_sess_error(0, SP_AP_E_PROTO, 0, "%s", err.msg);
        return;
    }
    /* HELLO starts a new session: streams of a previous host are stale. */
    sp_sess_reset();
    sp_ap_hello_t out = {
        .version = SP_AP_VERSION,
        .agent_version = {SP_AGENT_VERSION, (uint32_t)strlen(SP_AGENT_VERSION)},
        .caps = SP_AP_CAP_PTY | SP_AP_CAP_WATCH | SP_AP_CAP_TCP | SP_AP_CAP_IDENTITY |
                SP_AP_CAP_EGRESS | SP_AP_CAP_EGRESS_WINDOW,
        .boot_ns = boot_ns(),
        .session = in.session, /* which HELLO this answers (see base/agentproto.h) */
    };
    sp_ap_writer_t *w = sp_chan_begin(0, SP_AP_T_HELLO, 0, 256);
    if (w == NULL)
        return;
    w->len = 0; /* sp_ap_enc_hello begins and ends the frame itself; ending twice is harmless */
    sp_ap_enc_hello(w, &out);
    sp_chan_end(w);
}

static void on_control(const sp_ap_hdr_t *h, const uint8_t *p)
{
    if (h->type == SP_AP_T_HELLO) {
        on_hello(h, p);
    } else if (h->type == SP_AP_T_PING) {
        if (h->len > SP_AP_PING_MAX) {
            sp_sess_error(0, SP_AP_E_PROTO, 0, "ping payload %u > %u", h->len, SP_AP_PING_MAX);
            return;
        }
        sp_ap_writer_t *w = sp_chan_begin(0, SP_AP_T_PONG, 0, h->len);
        if (w != NULL) {
            sp_ap_put_raw(w, p, h->len);
            sp_chan_end(w);
        }
    }
}

typedef void (*opener_fn)(uint32_t id, const uint8_t *p, uint32_t n);

static opener_fn opener_for(uint16_t type)
{
    switch (type) {
    case SP_AP_T_IDENTITY:
        return sp_sysinit_on_identity;
    case SP_AP_T_PROC_START:
        return sp_proc_on_start;
    case SP_AP_T_PROC_ATTACH:
        return sp_proc_on_attach;
    case SP_AP_T_PROC_LIST:
        return sp_proc_on_list;
    case SP_AP_T_WATCH_START:
        return sp_watch_on_start;
    case SP_AP_T_TCP_CONNECT:
        return sp_tcp_on_connect;
    case SP_AP_T_EGRESS_CONFIG:
        return sp_egress_on_config;
    default:
        return NULL; /* FS_* requests: sp_fs_on_request also needs the type */
    }
}

static void on_stream_frame(sp_stream_t *s, const sp_ap_hdr_t *h, const uint8_t *p)
{
    if (h->type == SP_AP_T_RESET) {
        sp_stream_close(s);
        return;
    }
    if (h->type == SP_AP_T_WINDOW) {
        uint32_t inc = 0;
        if (sp_ap_get_u32(p, h->len, SP_AP_K_WINDOW, &inc) < 0) {
            sp_sess_error(s->id, SP_AP_E_PROTO, 0, "malformed window");
            return;
        }
        s->send_credit += inc;
        if (s->ops->pump != NULL)
            s->ops->pump(s);
        return;
    }
    if (h->type == SP_AP_T_DATA) {
        if (h->len > s->recv_credit) {
            sp_sess_error(s->id, SP_AP_E_PROTO, 0, "data beyond window (%u > %llu)", h->len,
                          (unsigned long long)s->recv_credit);
            return;
        }
        s->recv_credit -= h->len;
    }
    s->ops->on_frame(s, h, p);
}

void sp_sess_on_frame(const sp_ap_hdr_t *h, const uint8_t *p)
{
    uint32_t code;
    if (sp_ap_check_from_host(h->type, h->stream, &code) < 0) {
        sp_sess_error(h->stream, code, 0, "%s type 0x%04x on stream %u",
                      sp_ap_type_known(h->type) ? "unexpected" : "unknown", h->type, h->stream);
        return;
    }
    if (h->stream == 0) {
        on_control(h, p);
        return;
    }
    sp_stream_t *s = find(h->stream);
    if (sp_ap_type_opens(h->type)) {
        if (s != NULL) {
            sp_sess_error(h->stream, SP_AP_E_BUSY, 0, "stream %u already open", h->stream);
            return;
        }
        opener_fn fn = opener_for(h->type);
        if (fn != NULL)
            fn(h->stream, p, h->len);
        else
            sp_fs_on_request(h->type, h->stream, p, h->len);
        return;
    }
    if (s == NULL)
        return; /* may have crossed a RESET or our END in flight */
    on_stream_frame(s, h, p);
}

void sp_sess_on_bad_header(const sp_ap_hdr_t *h, bool oversize)
{
    sp_log(SP_LOG_WARN, "sess", "bad frame header stream=%u type=0x%04x len=%u flags=0x%x",
           h->stream, h->type, h->len, h->flags);
    if (oversize)
        sp_sess_error(h->stream, SP_AP_E_TOOBIG, 0, "frame payload %u exceeds %u", h->len,
                      SP_AP_MAX_PAYLOAD);
    else
        sp_sess_error(h->stream, SP_AP_E_PROTO, 0, "reserved flags 0x%x", h->flags);
}
