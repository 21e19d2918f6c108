/*
 * egress.c - proxy port and DNS path relayed over agent-opened streams.
 *
 * Proxy connection life: OPEN (stream up, bytes both ways) -> after the host's
 * OK: LINGER (no stream; flush what the host sent, shut down, read the guest
 * to EOF so close() does not turn into a reset that eats the reply) -> freed.
 * Any error, RESET or lost session frees at once with a reset to the guest.
 * The stream and the connection point at each other; the stream's close op
 * frees the connection unless it was detached first (OK).
 *
 * Host -> guest bytes are written at once; what the socket does not take is
 * buffered, at most the window we granted, and granted back as it drains.
 * Guest -> host bytes are read only while the host's window and the tx queue
 * allow, so a fast guest is held back by its own socket buffers.
 *
 * DNS queries are streams whose close op always answers the querier: with the
 * host's answer if one came, else SERVFAIL. Nothing here blocks: every socket
 * is non-blocking, and the only disk writes are two small files per config.
 */
#include "agent/egress.h"

#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <net/if.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/uio.h>
#include <time.h>
#include <unistd.h>

#include "agent/agent.h"
#include "agent/chan.h"
#include "agent/ev.h"
#include "agent/sess.h"
#include "base/log.h"

#define ACCEPT_BATCH      64    /* accepts per wakeup, so one listener cannot starve the loop */
#define UDP_BATCH         64    /* datagrams per wakeup */
#define DNS_UDP_MAX       4096  /* bytes of a UDP query */
#define DNS_UDP_REPLY_MAX 65507 /* bytes of a UDP reply */
#define DNS_HDR           12    /* bytes */
#define DNS_TIMEOUT_MS    5000
#define DNS_TCP_MAX       64 /* DNS-over-TCP clients */
#define DNS_TCP_INFLIGHT  8  /* queries per TCP client before we stop reading it */
#define DNS_TCP_IDLE_MS   30000
#define LINGER_MS         10000 /* after the host's OK: flush and drain at most this long */
#define FD_LIMIT_WANT     8192  /* RLIMIT_NOFILE the proxy wants (4096 conns + the rest) */
#define DNS_PORT_DEFAULT  53
#define RESOLV_DEFAULT    "/etc/resolv.conf"
#define PROFILE_DEFAULT   "/etc/profile.d/space-egress.sh"
#define RESOLV_CONTENT                                                                             \
    "# Written by space-agent: DNS goes through the sandbox's egress proxy.\n"                     \
    "nameserver 127.0.0.1\n"

/* ---- state ---- */

typedef struct pconn pconn_t;
struct pconn {
    sp_stream_t *s; /* NULL once the host ended the stream (lingering) */
    int fd;
    sp_ev_t *ev;
    uint8_t *buf; /* host bytes the socket has not taken: [off, len) */
    size_t off, len, cap;
    bool rd_eof;           /* guest sent EOF (forwarded) */
    bool wr_eof;           /* host sent EOF */
    bool wr_shut;          /* shutdown(SHUT_WR) done */
    bool hup;              /* POLLHUP seen: polling for errors only would spin */
    uint64_t linger_until; /* ms, lingering only */
    pconn_t *prev, *next;
};

typedef struct dnstcp dnstcp_t;
struct dnstcp {
    int fd;
    sp_ev_t *ev;
    uint8_t *in; /* 2-byte length + message; allocated on first read */
    size_t in_len;
    uint8_t *out;
    size_t out_off, out_len, out_cap;
    int inflight;
    bool rd_eof;
    uint64_t idle_since; /* ms */
    dnstcp_t *prev, *next;
};

typedef struct query query_t;
struct query {
    sp_stream_t *s;
    uint8_t *msg; /* the query as sent */
    size_t len;
    bool tcp;
    struct sockaddr_in from; /* UDP querier */
    dnstcp_t *tc;            /* TCP querier; NULL when it went away */
    const uint8_t *ans;      /* the host's answer, only during close */
    size_t ans_len;
    uint64_t deadline; /* ms */
    query_t *prev, *next;
};

/*
 * The three kinds above live on intrusive doubly linked lists (prev/next, a head and a count
 * in eg): one spelling of putting one at the head and of taking one out, for each kind.
 */
#define LIST_PUSH(head, count, x)                                                                  \
    do {                                                                                           \
        (x)->next = (head);                                                                        \
        if ((head) != NULL)                                                                        \
            (head)->prev = (x);                                                                    \
        (head) = (x);                                                                              \
        (count)++;                                                                                 \
    } while (0)

#define LIST_UNLINK(head, count, x)                                                                \
    do {                                                                                           \
        if ((x)->prev != NULL)                                                                     \
            (x)->prev->next = (x)->next;                                                           \
        else                                                                                       \
            (head) = (x)->next;                                                                    \
        if ((x)->next != NULL)                                                                     \
            (x)->next->prev = (x)->prev;                                                           \
        (count)--;                                                                                 \
    } while (0)

static struct {
    bool init;
    /* overrides, host test mode only */
    int dns_port;
    const char *resolv_path;
    const char *profile_path;

    uint32_t proxy_port;
    uint32_t open_window; /* EGRESS_CONFIG.WINDOW: new connections' send credit; 0: the default */
    int listen_fd;
    sp_ev_t *listen_ev;
    pconn_t *conns;
    int nconns;
    int spare_fd; /* /dev/null, given up to accept-and-close when out of fds */

    bool dns;
    int udp_fd, dtcp_fd;
    sp_ev_t *udp_ev, *dtcp_ev;
    dnstcp_t *dclients;
    int ndclients;
    query_t *queries;
    int nqueries;

    uint32_t next_id;
    bool wrapped;

    char **env;
    int envc;
} eg = {.listen_fd = -1, .spare_fd = -1, .udp_fd = -1, .dtcp_fd = -1};

static uint64_t now_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000 + (uint64_t)ts.tv_nsec / 1000000;
}

/* Egress needs a socket per proxy client; the kernel's 1024 would cap them early. */
static void raise_fd_limit(void)
{
    struct rlimit r;
    if (getrlimit(RLIMIT_NOFILE, &r) < 0 || r.rlim_cur >= FD_LIMIT_WANT)
        return;
    struct rlimit want = {FD_LIMIT_WANT, r.rlim_max > FD_LIMIT_WANT ? r.rlim_max : FD_LIMIT_WANT};
    if (setrlimit(RLIMIT_NOFILE, &want) == 0)
        return;
    r.rlim_cur = r.rlim_max; /* not allowed to raise the hard limit: take what there is */
    setrlimit(RLIMIT_NOFILE, &r);
}

/* The proxy and DNS listen on 127.0.0.1, which exists only once lo is up; a guest
 * without network setup leaves it down. */
static void loopback_up(void)
{
    int s = socket(AF_INET, SOCK_DGRAM | SOCK_CLOEXEC, 0);
    if (s < 0)
        return;
    struct ifreq ifr;
    memset(&ifr, 0, sizeof(ifr));
    strcpy(ifr.ifr_name, "lo");
    int rc = ioctl(s, SIOCGIFFLAGS, &ifr);
    if (rc == 0 && !(ifr.ifr_flags & IFF_UP)) {
        ifr.ifr_flags |= IFF_UP;
        rc = ioctl(s, SIOCSIFFLAGS, &ifr);
    }
    if (rc < 0)
        sp_log(SP_LOG_WARN, "egress", "bringing up lo failed errno=%d", errno);
    close(s);
}

void sp_egress_init(void)
{
    if (eg.init)
        return;
    eg.init = true;
    eg.dns_port = DNS_PORT_DEFAULT;
    eg.resolv_path = RESOLV_DEFAULT;
    eg.profile_path = PROFILE_DEFAULT;
    eg.next_id = SP_AP_STREAM_AGENT_BASE + 1;
    if (!sp_agent_apply_system) {
        /* On a developer's host: only where the test says, never the real files or port 53. */
        const char *port = getenv("SP_AGENT_EGRESS_DNS_PORT");
        eg.dns_port = port ? atoi(port) : -1;
        eg.resolv_path = getenv("SP_AGENT_EGRESS_RESOLV_CONF");
        eg.profile_path = getenv("SP_AGENT_EGRESS_PROFILE");
    } else {
        loopback_up();
    }
    raise_fd_limit();
    eg.spare_fd = open("/dev/null", O_RDONLY | O_CLOEXEC);
}

/* ---- stream ids ---- */

static bool id_in_use(uint32_t id)
{
    for (pconn_t *c = eg.conns; c != NULL; c = c->next)
        if (c->s != NULL && c->s->id == id)
            return true;
    for (query_t *q = eg.queries; q != NULL; q = q->next)
        if (q->s != NULL && q->s->id == id)
            return true;
    return false;
}

/* Counts up through the agent's id space; only after a wrap (2^31 streams) must it
 * skip ids still open. */
static uint32_t alloc_id(void)
{
    for (;;) {
        uint32_t id = eg.next_id++;
        if (eg.next_id == 0) {
            eg.next_id = SP_AP_STREAM_AGENT_BASE + 1;
            eg.wrapped = true;
        }
        if (!eg.wrapped || !id_in_use(id))
            return id;
    }
}

/* ---- sockets ---- */

static int listen_on(int type, int port)
{
    int fd = socket(AF_INET, type | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    if (fd < 0)
        return -1;
    int one = 1;
    setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
    struct sockaddr_in sa = {.sin_family = AF_INET, .sin_port = htons((uint16_t)port)};
    sa.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    if (bind(fd, (struct sockaddr *)&sa, sizeof(sa)) < 0 ||
        (type == SOCK_STREAM && listen(fd, 4096) < 0)) {
        int e = errno;
        close(fd);
        errno = e;
        return -1;
    }
    return fd;
}

/* Out of fds with clients waiting: a level-triggered listener would spin, so give up
 * the spare fd to accept one client and close it. */
static void shed_one(int lfd)
{
    if (eg.spare_fd < 0)
        return;
    close(eg.spare_fd);
    int c = accept4(lfd, NULL, NULL, SOCK_CLOEXEC);
    if (c >= 0)
        close(c);
    eg.spare_fd = open("/dev/null", O_RDONLY | O_CLOEXEC);
}

/* One accept of a listener's batch (peer: where to put the client's address, or NULL): the
 * client's fd; -1 when the next may follow (interrupted, aborted; out of fds, one waiting
 * client shed); -2 when the batch ends (nothing waits, or a failure the next wakeup retries). */
static int accept_next(int lfd, struct sockaddr_in *peer)
{
    socklen_t pl = sizeof(*peer);
    int fd = accept4(lfd, (struct sockaddr *)peer, peer ? &pl : NULL, SOCK_NONBLOCK | SOCK_CLOEXEC);
    if (fd >= 0)
        return fd;
    if (errno == EMFILE || errno == ENFILE)
        shed_one(lfd);
    return errno == EINTR || errno == ECONNABORTED ? -1 : -2;
}

static void reset_close(int fd)
{
    struct linger lg = {.l_onoff = 1, .l_linger = 0};
    setsockopt(fd, SOL_SOCKET, SO_LINGER, &lg, sizeof(lg));
    close(fd);
}

/* ---- proxy connections ---- */

static void pc_free(pconn_t *c, bool reset)
{
    LIST_UNLINK(eg.conns, eg.nconns, c);
    sp_ev_del(c->ev);
    if (reset)
        reset_close(c->fd);
    else
        close(c->fd);
    free(c->buf);
    free(c);
}

/* Abandons the stream (RESET) and the guest connection (reset). */
static void pc_abort(pconn_t *c)
{
    if (c->s != NULL) {
        sp_sess_send_empty(c->s->id, SP_AP_T_RESET, 0);
        sp_stream_close(c->s); /* close op frees c */
    } else {
        pc_free(c, true);
    }
}

static void pc_interest(pconn_t *c)
{
    short ev = 0;
    if (c->len > c->off)
        ev |= POLLOUT;
    if (c->s != NULL) {
        if (!c->rd_eof && c->s->send_credit > 0 && sp_chan_tx_ok())
            ev |= POLLIN;
    } else if (c->wr_shut) {
        ev |= POLLIN; /* lingering: read the guest to its EOF */
    }
    /* Otherwise still poll (for nothing) to hear a reset; a socket already hung up has
     * nothing left to report but the EOF we read once the host gives credit. */
    if (ev == 0 && !c->hup && !(c->rd_eof && c->wr_shut))
        ev = POLLPRI;
    sp_ev_mod(c->ev, ev);
}

/* Writes buffered host bytes; grants what went out. -1 with errno on a dead socket. */
static int pc_flush(pconn_t *c)
{
    size_t done = 0;
    int rc = 0;
    while (c->off < c->len) {
        ssize_t n = send(c->fd, c->buf + c->off, c->len - c->off, MSG_NOSIGNAL);
        if (n < 0) {
            if (errno != EAGAIN && errno != EINTR)
                rc = -1;
            break;
        }
        c->off += (size_t)n;
        done += (size_t)n;
    }
    if (c->off == c->len) { /* idle connections keep no buffer */
        free(c->buf);
        c->buf = NULL;
        c->off = c->len = c->cap = 0;
    }
    if (done > 0 && c->s != NULL)
        sp_stream_grant(c->s, (uint32_t)done);
    return rc;
}

static void pc_maybe_shut(pconn_t *c)
{
    if (c->wr_eof && c->len == c->off && !c->wr_shut) {
        shutdown(c->fd, SHUT_WR);
        c->wr_shut = true;
    }
}

/* Lingering: flush, shut down, read to EOF; then free. Returns true if c was freed. */
static bool pc_linger_step(pconn_t *c, short rev)
{
    if (c->len > c->off && pc_flush(c) < 0) {
        pc_free(c, true);
        return true;
    }
    c->wr_eof = true;
    pc_maybe_shut(c);
    if (c->wr_shut && !c->rd_eof && (rev & (POLLIN | POLLHUP | POLLERR))) {
        uint8_t junk[4096];
        ssize_t n;
        while ((n = recv(c->fd, junk, sizeof(junk), 0)) > 0)
            ;
        if (n == 0)
            c->rd_eof = true;
        else if (errno != EAGAIN && errno != EINTR) {
            pc_free(c, true);
            return true;
        }
    }
    if (c->wr_shut && c->rd_eof) {
        pc_free(c, false);
        return true;
    }
    return false;
}

/* Guest -> host: one DATA frame, or EOF. -1 if c was freed. */
static int pc_recv(pconn_t *c)
{
    if (sp_stream_recv(c->s, c->fd, &c->rd_eof) == 0)
        return 0;
    sp_log(SP_LOG_DEBUG, "egress", "proxy client reset stream=%u errno=%d", c->s->id, errno);
    pc_abort(c);
    return -1;
}

static void pc_on_sock(int fd, short rev, void *arg)
{
    pconn_t *c = arg;
    if (c->s == NULL) {
        if (!pc_linger_step(c, rev))
            pc_interest(c);
        return;
    }
    if ((rev & POLLOUT) && c->len > c->off && pc_flush(c) < 0) {
        sp_log(SP_LOG_DEBUG, "egress", "proxy client write failed stream=%u errno=%d", c->s->id,
               errno);
        pc_abort(c);
        return;
    }
    bool can_read = !c->rd_eof && c->s->send_credit > 0 && sp_chan_tx_ok();
    if ((rev & (POLLIN | POLLHUP | POLLERR)) && can_read) {
        if (pc_recv(c) < 0)
            return;
    } else if (rev & (POLLERR | POLLHUP)) {
        int e = 0;
        socklen_t el = sizeof(e);
        getsockopt(fd, SOL_SOCKET, SO_ERROR, &e, &el);
        if (e != 0) {
            pc_abort(c);
            return;
        }
        if (rev & POLLHUP)
            c->hup = true;
    }
    pc_maybe_shut(c);
    pc_interest(c);
}

static void pc_frame(sp_stream_t *s, const sp_ap_hdr_t *h, const uint8_t *p)
{
    pconn_t *c = s->obj;
    switch (h->type) {
    case SP_AP_T_DATA: {
        if (c->wr_eof) {
            pc_abort(c);
            return;
        }
        size_t sent = 0;
        if (c->len == c->off) { /* nothing queued: straight to the socket */
            while (sent < h->len) {
                ssize_t n = send(c->fd, p + sent, h->len - sent, MSG_NOSIGNAL);
                if (n < 0) {
                    if (errno != EAGAIN && errno != EINTR) {
                        pc_abort(c);
                        return;
                    }
                    break;
                }
                sent += (size_t)n;
            }
            sp_stream_grant(s, (uint32_t)sent);
        }
        size_t rest = h->len - sent;
        if (rest > 0) {
            /* The window bounds what is queued here (sess checked it). */
            if (c->off > 0 && c->off == c->len)
                c->off = c->len = 0;
            if (c->cap - c->len < rest) {
                if (c->off > 0) {
                    memmove(c->buf, c->buf + c->off, c->len - c->off);
                    c->len -= c->off;
                    c->off = 0;
                }
                if (c->cap - c->len < rest) {
                    uint8_t *nb = realloc(c->buf, c->len + rest);
                    if (nb == NULL) {
                        pc_abort(c);
                        return;
                    }
                    c->buf = nb;
                    c->cap = c->len + rest;
                }
            }
            memcpy(c->buf + c->len, p + sent, rest);
            c->len += rest;
        }
        break;
    }
    case SP_AP_T_EOF:
        c->wr_eof = true;
        break;
    case SP_AP_T_OK:
        /* Done: detach from the stream and let the guest have what is left. */
        s->obj = NULL;
        c->s = NULL;
        sp_stream_close(s);
        c->linger_until = now_ms() + LINGER_MS;
        if (!pc_linger_step(c, 0))
            pc_interest(c);
        return;
    case SP_AP_T_ERROR:
        sp_stream_close(s); /* close op resets the guest connection */
        return;
    default:
        sp_log(SP_LOG_DEBUG, "egress", "unexpected %s on proxy stream=%u", sp_ap_type_name(h->type),
               s->id);
        pc_abort(c);
        return;
    }
    pc_maybe_shut(c);
    pc_interest(c);
}

static void pc_pump(sp_stream_t *s)
{
    pc_interest(s->obj);
}

static void pc_stream_gone(sp_stream_t *s)
{
    pconn_t *c = s->obj;
    if (c == NULL)
        return; /* detached: lingering on its own */
    c->s = NULL;
    pc_free(c, true);
}

static const sp_stream_ops_t pc_ops = {pc_frame, pc_pump, pc_stream_gone};

static void pc_open(int fd, uint16_t peer_port)
{
    pconn_t *c = calloc(1, sizeof(*c));
    if (c == NULL) {
        close(fd);
        return;
    }
    c->fd = fd;
    c->ev = sp_ev_add(fd, 0, pc_on_sock, c);
    uint32_t id = alloc_id();
    c->s = c->ev ? sp_sess_open(id, &pc_ops, c) : NULL;
    if (c->s == NULL) {
        sp_ev_del(c->ev);
        close(fd);
        free(c);
        return;
    }
    if (eg.open_window != 0)
        c->s->send_credit = eg.open_window; /* the host grants the rest as its memory allows */
    LIST_PUSH(eg.conns, eg.nconns, c);
    int one = 1;
    setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
    sp_ap_writer_t *w = sp_chan_begin(id, SP_AP_T_EGRESS_OPEN, 0, 32);
    if (w == NULL) {
        sp_stream_close(c->s); /* the host never heard of it */
        return;
    }
    sp_ap_put_u32(w, SP_AP_K_KIND, SP_AP_EGRESS_PROXY);
    sp_ap_put_u32(w, SP_AP_K_PEER_PORT, peer_port);
    sp_chan_end(w);
    pc_interest(c);
}

static void on_proxy_accept(int lfd, short rev, void *arg)
{
    for (int i = 0; i < ACCEPT_BATCH; i++) {
        struct sockaddr_in peer;
        int fd = accept_next(lfd, &peer);
        if (fd == -1)
            continue;
        if (fd < 0)
            return;
        /* No host (its streams would go nowhere) or at the cap: refuse quickly. */
        if (!sp_chan_connected() || eg.nconns >= SP_EGRESS_MAX_CONNS) {
            close(fd);
            continue;
        }
        pc_open(fd, ntohs(peer.sin_port));
    }
}

/* Closes every proxy connection (PROXY_PORT 0). */
static void pc_close_all(void)
{
    while (eg.conns != NULL)
        pc_abort(eg.conns);
}

/* ---- DNS messages ---- */

static uint16_t be16(const uint8_t *p)
{
    return (uint16_t)(p[0] << 8 | p[1]);
}

/* End of the question section, or DNS_HDR with *qd = 0 when it does not parse. */
static size_t question_end(const uint8_t *m, size_t n, uint16_t *qd)
{
    size_t off = DNS_HDR;
    uint16_t want = be16(m + 4);
    for (uint16_t i = 0; i < want; i++) {
        for (;;) {
            if (off >= n)
                goto bad;
            uint8_t l = m[off];
            if (l == 0) {
                off += 1;
                break;
            }
            if ((l & 0xC0) == 0xC0) {
                off += 2;
                break;
            }
            if (l & 0xC0)
                goto bad;
            off += 1u + l;
        }
        off += 4; /* type, class */
        if (off > n)
            goto bad;
    }
    *qd = want;
    return off;
bad:
    *qd = 0;
    return DNS_HDR;
}

/* Builds an error reply (rcode) to the query m[n] in out (>= n bytes). Returns its size. */
static size_t dns_error_reply(const uint8_t *m, size_t n, uint8_t rcode, uint8_t *out)
{
    uint16_t qd;
    size_t len = question_end(m, n, &qd);
    memcpy(out, m, len);
    out[2] = (uint8_t)(0x80 | (m[2] & 0x79));  /* QR, keep opcode and RD */
    out[3] = (uint8_t)(0x80 | (rcode & 0x0F)); /* RA */
    out[4] = (uint8_t)(qd >> 8);
    out[5] = (uint8_t)qd;
    memset(out + 6, 0, 6); /* no answer, authority or additional records */
    return len;
}

/* ---- DNS over TCP clients ---- */

/* May more queries be taken from t? Bounds what an unread client costs. */
static bool dtc_room(const dnstcp_t *t)
{
    return t->inflight < DNS_TCP_INFLIGHT && t->out_len - t->out_off < 65536;
}

static void dtc_interest(dnstcp_t *t)
{
    short ev = 0;
    if (t->out_len > t->out_off)
        ev |= POLLOUT;
    if (!t->rd_eof && dtc_room(t))
        ev |= POLLIN;
    sp_ev_mod(t->ev, ev ? ev : POLLPRI);
}

static void dtc_free(dnstcp_t *t)
{
    for (query_t *q = eg.queries; q != NULL; q = q->next)
        if (q->tc == t)
            q->tc = NULL; /* its answer has nowhere to go */
    LIST_UNLINK(eg.dclients, eg.ndclients, t);
    sp_ev_del(t->ev);
    close(t->fd);
    free(t->in);
    free(t->out);
    free(t);
}

/* Queues one length-prefixed message; the id is forced to the query's. */
static void dtc_send(dnstcp_t *t, const uint8_t id[2], const uint8_t *m, size_t n)
{
    if (t->out_off > 0 && t->out_off == t->out_len)
        t->out_off = t->out_len = 0;
    if (t->out_cap - t->out_len < n + 2) {
        if (t->out_off > 0) {
            memmove(t->out, t->out + t->out_off, t->out_len - t->out_off);
            t->out_len -= t->out_off;
            t->out_off = 0;
        }
        size_t cap = t->out_len + n + 2;
        uint8_t *nb = cap > t->out_cap ? realloc(t->out, cap) : t->out;
        if (nb == NULL)
            return; /* the client times out */
        t->out = nb;
        if (cap > t->out_cap)
            t->out_cap = cap;
    }
    uint8_t *o = t->out + t->out_len;
    o[0] = (uint8_t)(n >> 8);
    o[1] = (uint8_t)n;
    memcpy(o + 2, m, n);
    o[2] = id[0];
    o[3] = id[1];
    t->out_len += n + 2;
    t->idle_since = now_ms();
    dtc_interest(t);
}

/* ---- DNS queries ---- */

static void q_answer(query_t *q, const uint8_t *m, size_t n)
{
    if (q->tcp) {
        if (q->tc != NULL)
            dtc_send(q->tc, q->msg, m, n);
        return;
    }
    if (eg.udp_fd < 0)
        return;
    struct iovec iov[2] = {{q->msg, 2}, {(void *)(m + 2), n - 2}}; /* the query's id */
    struct msghdr mh = {
        .msg_name = &q->from, .msg_namelen = sizeof(q->from), .msg_iov = iov, .msg_iovlen = 2};
    if (sendmsg(eg.udp_fd, &mh, MSG_DONTWAIT | MSG_NOSIGNAL) < 0)
        sp_log(SP_LOG_DEBUG, "egress", "dns reply send failed errno=%d", errno);
}

static void q_servfail(query_t *q)
{
    uint8_t *out = malloc(q->len);
    if (out == NULL)
        return;
    size_t n = dns_error_reply(q->msg, q->len, 2, out);
    q_answer(q, out, n);
    free(out);
}

/* Close op: answers the querier (the host's answer or SERVFAIL) and frees q. */
static void q_stream_gone(sp_stream_t *s)
{
    query_t *q = s->obj;
    size_t max = q->tcp ? 65535 : DNS_UDP_REPLY_MAX;
    if (q->ans != NULL && q->ans_len >= DNS_HDR && q->ans_len <= max)
        q_answer(q, q->ans, q->ans_len);
    else
        q_servfail(q);
    if (q->tc != NULL)
        q->tc->inflight--;
    LIST_UNLINK(eg.queries, eg.nqueries, q);
    free(q->msg);
    free(q);
}

static void q_frame(sp_stream_t *s, const sp_ap_hdr_t *h, const uint8_t *p)
{
    query_t *q = s->obj;
    if (h->type == SP_AP_T_DNS_ANSWER) {
        sp_ap_field_t f;
        if (sp_ap_find(p, h->len, SP_AP_K_QUERY, &f) == 1) {
            q->ans = f.val;
            q->ans_len = f.len;
        }
    } else if (h->type != SP_AP_T_OK && h->type != SP_AP_T_ERROR) {
        sp_sess_send_empty(s->id, SP_AP_T_RESET, 0); /* DATA, EOF...: not on a query */
    }
    sp_stream_close(s); /* answers (p is still valid here) */
}

static const sp_stream_ops_t q_ops = {q_frame, NULL, q_stream_gone};

/* One query from the guest. tc: the TCP client, NULL for UDP. */
static void dns_submit(const uint8_t *m, size_t n, const struct sockaddr_in *from, dnstcp_t *tc)
{
    if (n < DNS_HDR || (m[2] & 0x80))
        return; /* not a query: nothing to answer to */
    query_t *q = calloc(1, sizeof(*q));
    uint8_t *copy = malloc(n);
    if (q == NULL || copy == NULL) {
        free(q);
        free(copy);
        return;
    }
    memcpy(copy, m, n);
    q->msg = copy;
    q->len = n;
    q->tcp = tc != NULL;
    q->tc = tc;
    if (from != NULL)
        q->from = *from;
    q->deadline = now_ms() + DNS_TIMEOUT_MS;
    LIST_PUSH(eg.queries, eg.nqueries, q);
    if (tc != NULL)
        tc->inflight++;
    size_t max = tc ? 65535 : DNS_UDP_MAX;
    uint32_t id = alloc_id();
    sp_stream_t *s = NULL;
    if (n <= max && sp_chan_connected() && eg.nqueries <= SP_EGRESS_MAX_QUERIES)
        s = sp_sess_open(id, &q_ops, q);
    if (s == NULL) {
        /* Too big, no host, too many in flight or no memory: SERVFAIL now. */
        sp_stream_t tmp = {.id = id, .obj = q};
        q_stream_gone(&tmp);
        return;
    }
    q->s = s;
    sp_ap_writer_t *w = sp_chan_begin(id, SP_AP_T_DNS_QUERY, 0, n + 16);
    if (w == NULL) {
        sp_stream_close(s);
        return;
    }
    sp_ap_put_bytes(w, SP_AP_K_QUERY, m, n);
    sp_chan_end(w);
}

static void on_dns_udp(int fd, short rev, void *arg)
{
    static uint8_t buf[65536];
    for (int i = 0; i < UDP_BATCH; i++) {
        struct sockaddr_in from;
        socklen_t fl = sizeof(from);
        ssize_t n = recvfrom(fd, buf, sizeof(buf), MSG_DONTWAIT, (struct sockaddr *)&from, &fl);
        if (n < 0)
            return;
        if (n > DNS_UDP_MAX && n >= DNS_HDR && !(buf[2] & 0x80)) {
            /* FORMERR rather than silence: the client stops waiting. */
            static uint8_t out[65536];
            size_t len = dns_error_reply(buf, (size_t)n, 1, out);
            sendto(fd, out, len, MSG_DONTWAIT, (struct sockaddr *)&from, fl);
            continue;
        }
        dns_submit(buf, (size_t)n, &from, NULL);
    }
}

/* Splits complete length-prefixed messages off t->in while under the in-flight cap.
 * Returns -1 when the client broke framing (a zero length). */
static int dtc_parse(dnstcp_t *t)
{
    while (dtc_room(t) && t->in_len >= 2) {
        size_t l = be16(t->in);
        if (l == 0)
            return -1;
        if (t->in_len < 2 + l)
            break;
        dns_submit(t->in + 2, l, NULL, t);
        memmove(t->in, t->in + 2 + l, t->in_len - 2 - l);
        t->in_len -= 2 + l;
    }
    return 0;
}

static bool dtc_done(const dnstcp_t *t)
{
    return t->rd_eof && t->inflight == 0 && t->out_off == t->out_len;
}

static void on_dtc(int fd, short rev, void *arg)
{
    dnstcp_t *t = arg;
    if ((rev & POLLOUT) && t->out_len > t->out_off) {
        ssize_t n = send(fd, t->out + t->out_off, t->out_len - t->out_off, MSG_NOSIGNAL);
        if (n < 0 && errno != EAGAIN && errno != EINTR) {
            dtc_free(t);
            return;
        }
        if (n > 0)
            t->out_off += (size_t)n;
    }
    if ((rev & (POLLIN | POLLHUP | POLLERR)) && !t->rd_eof && dtc_room(t)) {
        if (t->in == NULL && (t->in = malloc(2 + 65535)) == NULL) {
            dtc_free(t);
            return;
        }
        ssize_t n = recv(fd, t->in + t->in_len, 2 + 65535 - t->in_len, 0);
        if (n > 0) {
            t->in_len += (size_t)n;
            t->idle_since = now_ms();
        } else if (n == 0) {
            t->rd_eof = true;
        } else if (errno != EAGAIN && errno != EINTR) {
            dtc_free(t);
            return;
        }
    } else if ((rev & POLLERR) && !(rev & POLLOUT)) {
        dtc_free(t);
        return;
    }
    if (dtc_parse(t) < 0 || dtc_done(t)) {
        dtc_free(t);
        return;
    }
    dtc_interest(t);
}

static void on_dtc_accept(int lfd, short rev, void *arg)
{
    for (int i = 0; i < ACCEPT_BATCH; i++) {
        int fd = accept_next(lfd, NULL);
        if (fd == -1)
            continue;
        if (fd < 0)
            return;
        dnstcp_t *t = eg.ndclients < DNS_TCP_MAX ? calloc(1, sizeof(*t)) : NULL;
        if (t == NULL) {
            close(fd);
            continue;
        }
        t->fd = fd;
        t->idle_since = now_ms();
        t->ev = sp_ev_add(fd, POLLIN, on_dtc, t);
        if (t->ev == NULL) {
            close(fd);
            free(t);
            continue;
        }
        LIST_PUSH(eg.dclients, eg.ndclients, t);
    }
}

static void dns_stop(void)
{
    while (eg.dclients != NULL)
        dtc_free(eg.dclients);
    sp_ev_del(eg.udp_ev);
    sp_ev_del(eg.dtcp_ev);
    eg.udp_ev = eg.dtcp_ev = NULL;
    if (eg.udp_fd >= 0)
        close(eg.udp_fd);
    if (eg.dtcp_fd >= 0)
        close(eg.dtcp_fd);
    eg.udp_fd = eg.dtcp_fd = -1;
    eg.dns = false; /* queries in flight still end; their UDP replies are dropped */
}

/* ---- files ---- */

/* path holds exactly want (the first len bytes of it). */
static bool file_is_n(const char *path, const char *want, size_t len)
{
    int fd = open(path, O_RDONLY | O_CLOEXEC | O_NOFOLLOW);
    if (fd < 0)
        return false;
    char buf[4096];
    size_t off = 0;
    bool same = true;
    for (;;) {
        ssize_t n = read(fd, buf, sizeof(buf));
        if (n < 0 && errno == EINTR)
            continue;
        if (n < 0 || (n > 0 && ((size_t)n > len - off || memcmp(buf, want + off, (size_t)n)))) {
            same = false;
            break;
        }
        if (n == 0) {
            same = off == len;
            break;
        }
        off += (size_t)n;
    }
    close(fd);
    return same;
}

static bool file_is(const char *path, const char *want)
{
    return file_is_n(path, want, strlen(want));
}

/* Writes path via a temporary file beside it and rename(). 0 or -1 with errno. */
static int write_atomic(const char *path, const char *data, size_t n)
{
    char tmp[4096];
    if (snprintf(tmp, sizeof(tmp), "%s.space-tmp", path) >= (int)sizeof(tmp)) {
        errno = ENAMETOOLONG;
        return -1;
    }
    int fd = open(tmp, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC | O_NOFOLLOW, 0644);
    if (fd < 0)
        return -1;
    size_t off = 0;
    while (off < n) {
        ssize_t w = write(fd, data + off, n - off);
        if (w < 0 && errno == EINTR)
            continue;
        if (w < 0) {
            int e = errno;
            close(fd);
            unlink(tmp);
            errno = e;
            return -1;
        }
        off += (size_t)w;
    }
    fchmod(fd, 0644); /* whatever the umask */
    /* No fsync: every EGRESS_CONFIG writes these again, and a snapshot holds the guest's page
     * cache with its disk; an fsync costs tens of ms under TCG on each create and wake. */
    if (close(fd) < 0 || rename(tmp, path) < 0) {
        int e = errno;
        unlink(tmp);
        errno = e;
        return -1;
    }
    return 0;
}

/* DNS on: our resolv.conf, the original kept once beside it. Off: the original back
 * (only if the file is still ours). 0 or -1 with errno. */
static int resolv_apply(bool on)
{
    const char *path = eg.resolv_path;
    if (path == NULL)
        return 0;
    char backup[4096];
    if (snprintf(backup, sizeof(backup), "%s.space-orig", path) >= (int)sizeof(backup)) {
        errno = ENAMETOOLONG;
        return -1;
    }
    struct stat st;
    if (on) {
        if (file_is(path, RESOLV_CONTENT))
            return 0;
        /* A hard link keeps the original (file or symlink) through the rename below. */
        if (lstat(backup, &st) < 0 && lstat(path, &st) == 0 && link(path, backup) < 0)
            return -1;
        return write_atomic(path, RESOLV_CONTENT, strlen(RESOLV_CONTENT));
    }
    if (!file_is(path, RESOLV_CONTENT))
        return 0;
    if (lstat(backup, &st) == 0)
        return rename(backup, path);
    return unlink(path);
}

static bool shell_name(const char *k, size_t n)
{
    if (n == 0 || (k[0] >= '0' && k[0] <= '9'))
        return false;
    for (size_t i = 0; i < n; i++) {
        char ch = k[i];
        if (!(ch == '_' || (ch >= 'a' && ch <= 'z') || (ch >= 'A' && ch <= 'Z') ||
              (ch >= '0' && ch <= '9')))
            return false;
    }
    return true;
}

/* Login shells: `export K='V'` for each env entry. Removed when off or empty. */
static int profile_apply(bool on)
{
    const char *path = eg.profile_path;
    if (path == NULL)
        return 0;
    if (!on || eg.envc == 0) {
        if (unlink(path) < 0 && errno != ENOENT)
            return -1;
        return 0;
    }
    size_t cap = 256;
    for (int i = 0; i < eg.envc; i++)
        cap += 16 + 4 * strlen(eg.env[i]);
    char *out = malloc(cap);
    if (out == NULL)
        return -1;
    size_t n = (size_t)snprintf(out, cap,
                                "# Written by space-agent from the sandbox's egress "
                                "settings; removed when egress is off.\n");
    for (int i = 0; i < eg.envc; i++) {
        const char *kv = eg.env[i], *eq = strchr(kv, '=');
        if (!shell_name(kv, (size_t)(eq - kv)))
            continue; /* not a shell variable name: PROC_START still gets it */
        n += (size_t)snprintf(out + n, cap - n, "export %.*s='", (int)(eq - kv), kv);
        for (const char *v = eq + 1; *v; v++) {
            if (*v == '\'') {
                memcpy(out + n, "'\\''", 4);
                n += 4;
            } else {
                out[n++] = *v;
            }
        }
        out[n++] = '\'';
        out[n++] = '\n';
    }
    char dir[4096];
    snprintf(dir, sizeof(dir), "%s", path);
    char *slash = strrchr(dir, '/');
    if (slash != NULL && slash != dir) {
        *slash = 0;
        mkdir(dir, 0755); /* /etc/profile.d may not exist in a minimal image */
    }
    /* Unchanged (a wake, or a spare clone taken by a sandbox: core/runtime/qemu/pool.c): nothing
     * to do. */
    int rc = file_is_n(path, out, n) ? 0 : write_atomic(path, out, n);
    free(out);
    return rc;
}

/* ---- config ---- */

static int set_env(const sp_ap_egress_config_t *m)
{
    char **env = calloc((size_t)m->envc + 1, sizeof(*env));
    if (env == NULL)
        return -1;
    for (uint32_t i = 0; i < m->envc; i++) {
        env[i] = malloc((size_t)m->env[i].n + 1);
        if (env[i] == NULL) {
            for (uint32_t j = 0; j < i; j++)
                free(env[j]);
            free(env);
            return -1;
        }
        memcpy(env[i], m->env[i].p, m->env[i].n);
        env[i][m->env[i].n] = 0;
    }
    for (int i = 0; i < eg.envc; i++)
        free(eg.env[i]);
    free(eg.env);
    eg.env = env;
    eg.envc = (int)m->envc;
    return 0;
}

char *const *sp_egress_env(int *n)
{
    *n = eg.envc;
    return eg.env;
}

void sp_egress_on_config(uint32_t id, const uint8_t *p, uint32_t n)
{
    static sp_ap_egress_config_t m; /* 4 KiB: keep it off the stack */
    sp_err_t err;
    sp_egress_init();
    if (sp_ap_dec_egress_config(p, n, &m, &err) < 0) {
        sp_sess_error(id, SP_AP_E_INVAL, 0, "%s", err.msg);
        return;
    }
    if (m.dns && eg.dns_port <= 0) {
        sp_sess_error(id, SP_AP_E_UNAVAIL, 0,
                      "dns needs SP_AGENT_EGRESS_DNS_PORT when the agent runs on a host");
        return;
    }

    /* New sockets first: if one cannot be had, nothing changes. */
    int lfd = -1, ufd = -1, tfd = -1;
    bool new_proxy = m.proxy_port != 0 && m.proxy_port != eg.proxy_port;
    bool new_dns = m.dns && !eg.dns;
    if (new_proxy && (lfd = listen_on(SOCK_STREAM, (int)m.proxy_port)) < 0) {
        sp_sess_error_errno(id, errno, "proxy port");
        return;
    }
    if (new_dns && ((ufd = listen_on(SOCK_DGRAM, eg.dns_port)) < 0 ||
                    (tfd = listen_on(SOCK_STREAM, eg.dns_port)) < 0)) {
        int e = errno;
        if (lfd >= 0)
            close(lfd);
        if (ufd >= 0)
            close(ufd);
        sp_sess_error_errno(id, e, "dns port");
        return;
    }
    if (set_env(&m) < 0) {
        if (lfd >= 0)
            close(lfd);
        if (ufd >= 0)
            close(ufd);
        if (tfd >= 0)
            close(tfd);
        sp_sess_error(id, SP_AP_E_INTERNAL, ENOMEM, "out of memory");
        return;
    }

    eg.open_window = m.window;
    if (m.proxy_port != eg.proxy_port) {
        sp_ev_del(eg.listen_ev);
        eg.listen_ev = NULL;
        if (eg.listen_fd >= 0)
            close(eg.listen_fd);
        eg.listen_fd = lfd;
        eg.proxy_port = m.proxy_port;
        if (lfd >= 0)
            eg.listen_ev = sp_ev_add(lfd, POLLIN, on_proxy_accept, NULL);
        else
            pc_close_all();
    }
    if (new_dns) {
        eg.udp_fd = ufd;
        eg.dtcp_fd = tfd;
        eg.udp_ev = sp_ev_add(ufd, POLLIN, on_dns_udp, NULL);
        eg.dtcp_ev = sp_ev_add(tfd, POLLIN, on_dtc_accept, NULL);
        eg.dns = true;
    } else if (!m.dns && eg.dns) {
        dns_stop();
    }
    sp_log(SP_LOG_INFO, "egress", "config proxy_port=%u dns=%d env=%u", m.proxy_port, m.dns,
           m.envc);

    if (resolv_apply(m.dns) < 0) {
        sp_sess_error_errno(id, errno, "resolv.conf");
        return;
    }
    if (profile_apply(m.proxy_port != 0) < 0) {
        sp_sess_error_errno(id, errno, "profile");
        return;
    }
    sp_sess_send_empty(id, SP_AP_T_OK, SP_AP_F_END);
}

/* ---- time ---- */

int sp_egress_timeout_ms(void)
{
    uint64_t next = UINT64_MAX;
    for (query_t *q = eg.queries; q != NULL; q = q->next)
        if (q->deadline < next)
            next = q->deadline;
    for (pconn_t *c = eg.conns; c != NULL; c = c->next)
        if (c->s == NULL && c->linger_until < next)
            next = c->linger_until;
    for (dnstcp_t *t = eg.dclients; t != NULL; t = t->next)
        if (t->inflight == 0 && t->idle_since + DNS_TCP_IDLE_MS < next)
            next = t->idle_since + DNS_TCP_IDLE_MS;
    if (next == UINT64_MAX)
        return -1;
    uint64_t now = now_ms();
    return next > now ? (int)(next - now) : 0;
}

void sp_egress_tick(void)
{
    if (eg.queries == NULL && eg.conns == NULL && eg.dclients == NULL)
        return;
    uint64_t now = now_ms();
    for (query_t *q = eg.queries, *nq; q != NULL; q = nq) {
        nq = q->next;
        if (q->deadline <= now) {
            sp_log(SP_LOG_DEBUG, "egress", "dns query timed out stream=%u", q->s->id);
            sp_sess_send_empty(q->s->id, SP_AP_T_RESET, 0);
            sp_stream_close(q->s); /* SERVFAIL, frees q */
        }
    }
    for (pconn_t *c = eg.conns, *nc; c != NULL; c = nc) {
        nc = c->next;
        if (c->s == NULL && c->linger_until <= now)
            pc_free(c, true);
    }
    for (dnstcp_t *t = eg.dclients, *nt; t != NULL; t = nt) {
        nt = t->next;
        if (t->inflight == 0 && t->idle_since + DNS_TCP_IDLE_MS <= now)
            dtc_free(t);
    }
}
