/*
 * tcp.c - guest TCP connections bridged onto a stream.
 *
 * Host -> socket: DATA is written at once; what the socket does not take is
 * buffered (bounded by the window we granted) and granted back as it drains.
 * Socket -> host: read only while the host's window and the tx queue allow,
 * so a fast guest server is throttled by the kernel's socket buffers.
 * The stream ends with OK once both directions have seen EOF.
 */
#include "agent/tcp.h"

#include <arpa/inet.h>
#include <errno.h>
#include <netinet/in.h>
#include <poll.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include "agent/chan.h"
#include "agent/ev.h"
#include "agent/sess.h"

typedef struct {
    sp_stream_t *s;
    int fd;
    sp_ev_t *ev;
    bool connected;
    bool rd_eof;      /* socket sent EOF (forwarded) */
    bool wr_eof;      /* host sent EOF */
    bool wr_shut;     /* shutdown(SHUT_WR) done */
    uint8_t *buf;     /* host bytes not yet written to the socket */
    size_t len;
} tcp_t;

static void tcp_interest(tcp_t *t)
{
    short ev = 0;
    if (!t->connected || t->len > 0)
        ev |= POLLOUT;
    if (t->connected && !t->rd_eof && t->s->send_credit > 0 && sp_chan_tx_ok())
        ev |= POLLIN;
    sp_ev_mod(t->ev, ev);
}

static void maybe_done(tcp_t *t)
{
    if (t->wr_eof && t->len == 0 && !t->wr_shut) {
        shutdown(t->fd, SHUT_WR);
        t->wr_shut = true;
    }
    if (t->rd_eof && t->wr_shut) {
        sp_sess_send_empty(t->s->id, SP_AP_T_OK, SP_AP_F_END);
        sp_stream_close(t->s);
    }
}

static void flush(tcp_t *t)
{
    size_t done = 0;
    while (done < t->len) {
        ssize_t n = send(t->fd, t->buf + done, t->len - done, MSG_NOSIGNAL);
        if (n < 0) {
            if (errno == EAGAIN || errno == EINTR)
                break;
            sp_sess_error_errno(t->s->id, errno, "send");
            return;
        }
        done += (size_t)n;
    }
    memmove(t->buf, t->buf + done, t->len - done);
    t->len -= done;
    sp_stream_grant(t->s, (uint32_t)done);
}

static void do_recv(tcp_t *t)
{
    if (sp_stream_recv(t->s, t->fd, &t->rd_eof) < 0)
        sp_sess_error_errno(t->s->id, errno, "recv");
}

static void on_sock(int fd, short rev, void *arg)
{
    tcp_t *t = arg;
    sp_stream_t *s = t->s;
    if (!t->connected) {
        int e = 0;
        socklen_t el = sizeof(e);
        getsockopt(fd, SOL_SOCKET, SO_ERROR, &e, &el);
        if (e != 0) {
            sp_sess_error_errno(s->id, e, "connect");
            return;
        }
        t->connected = true;
        sp_sess_send_empty(s->id, SP_AP_T_TCP_CONNECTED, 0);
    }
    if ((rev & POLLOUT) && t->len > 0)
        flush(t);
    if (!s->closing && (rev & (POLLIN | POLLHUP | POLLERR)) && !t->rd_eof)
        do_recv(t);
    if (!s->closing)
        maybe_done(t);
    if (!s->closing)
        tcp_interest(t);
}

static void tcp_frame(sp_stream_t *s, const sp_ap_hdr_t *h, const uint8_t *p)
{
    tcp_t *t = s->obj;
    if (h->type == SP_AP_T_EOF) {
        t->wr_eof = true;
    } else if (h->type == SP_AP_T_DATA && !t->wr_eof) {
        uint8_t *nb = realloc(t->buf, t->len + h->len + 1);
        if (nb == NULL) {
            sp_sess_error(s->id, SP_AP_E_INTERNAL, ENOMEM, "out of memory");
            return;
        }
        t->buf = nb;
        memcpy(t->buf + t->len, p, h->len);
        t->len += h->len;
        if (t->connected)
            flush(t);
    } else {
        sp_stream_bad_type(s, h->type, "tcp");
        return;
    }
    if (!s->closing && t->connected)
        maybe_done(t);
    if (!s->closing)
        tcp_interest(t);
}

/* Window grants and tx room can re-enable reading. */
static void tcp_pump(sp_stream_t *s)
{
    tcp_interest(s->obj);
}

static void tcp_close(sp_stream_t *s)
{
    tcp_t *t = s->obj;
    sp_ev_del(t->ev);
    close(t->fd);
    free(t->buf);
    free(t);
}

static const sp_stream_ops_t tcp_ops = {tcp_frame, tcp_pump, tcp_close};

void sp_tcp_on_connect(uint32_t id, const uint8_t *p, uint32_t n)
{
    uint32_t port = 0, addr = INADDR_LOOPBACK;
    if (sp_ap_get_u32(p, n, SP_AP_K_PORT, &port) < 0 ||
        sp_ap_get_u32(p, n, SP_AP_K_ADDR, &addr) < 0 || port == 0 || port > 65535) {
        sp_sess_error(id, SP_AP_E_INVAL, 0, "tcp_connect needs a port");
        return;
    }
    struct sockaddr_in sa = {.sin_family = AF_INET, .sin_port = htons((uint16_t)port)};
    sa.sin_addr.s_addr = htonl(addr);
    int fd = socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    if (fd < 0) {
        sp_sess_error_errno(id, errno, "socket");
        return;
    }
    if (connect(fd, (struct sockaddr *)&sa, sizeof(sa)) < 0 && errno != EINPROGRESS) {
        int e = errno;
        close(fd);
        sp_sess_error_errno(id, e, "connect");
        return;
    }
    tcp_t *t = calloc(1, sizeof(*t));
    if (t == NULL) {
        close(fd);
        sp_sess_error(id, SP_AP_E_INTERNAL, ENOMEM, "out of memory");
        return;
    }
    t->fd = fd;
    t->s = sp_sess_open(id, &tcp_ops, t);
    if (t->s == NULL) {
        close(fd);
        free(t);
        return;
    }
    t->ev = sp_ev_add(fd, POLLOUT, on_sock, t);
}
