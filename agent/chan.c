/*
 * chan.c - channel I/O: read frames into the reader, write the tx queue.
 *
 * A virtio-serial port stays open for the agent's life: when the host side
 * disconnects, read() returns 0 and poll() keeps reporting POLLHUP, so the
 * port is paused and retried every CHAN_RETRY_MS instead of spinning. A unix
 * socket client that leaves is closed; a new client replaces the old one.
 *
 * A port's hangup is not ordered with its data. The guest learns that the
 * host left or came back from control messages, which its kernel handles
 * after data, so the next host's HELLO can be read before the port reports
 * that the last host left, or while it still reports so. A hangup therefore
 * drops the streams and a partly written frame, but keeps the whole frames
 * queued: the answer to that HELLO is among them, and the host side drops
 * everything before the answer to its own HELLO (answers carry its session,
 * base/agentproto.h). A unix client's queue goes with it.
 */
#include "agent/chan.h"

#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <time.h>
#include <unistd.h>

#include "agent/ev.h"
#include "agent/sess.h"
#include "base/log.h"

#define CHAN_RETRY_MS 100

static struct {
    bool is_port;      /* virtio port: never closed */
    int fd;            /* port or current client; -1 if none */
    int listen_fd;     /* unix mode */
    sp_ev_t *ev;       /* on fd */
    sp_ev_t *listen_ev;
    bool hup;          /* port paused after a hangup */
    uint64_t retry_at; /* ms, CLOCK_MONOTONIC */
    bool connected;
    uint8_t *rbuf;
    sp_ap_reader_t rd;
    uint8_t *tx;
    size_t tx_len, tx_off, tx_cap;
    size_t tx_bound; /* end of the frame tx_off is in (tx_off itself between frames) */
    sp_ap_writer_t w;
    bool w_open;
} ch = {.fd = -1, .listen_fd = -1};

static sp_chan_read_fn io_read = read;
static sp_chan_write_fn io_write = write;

void sp_chan_set_io(sp_chan_read_fn r, sp_chan_write_fn w)
{
    io_read = r != NULL ? r : read;
    io_write = w != NULL ? w : write;
}

static uint64_t now_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000 + (uint64_t)ts.tv_nsec / 1000000;
}

static int init_buffers(void)
{
    if (ch.rbuf != NULL)
        return 0;
    ch.rbuf = malloc(SP_AP_MAX_FRAME);
    if (ch.rbuf == NULL)
        return -1;
    sp_ap_reader_init(&ch.rd, ch.rbuf, SP_AP_MAX_FRAME);
    return 0;
}

static void tx_clear(void)
{
    ch.tx_len = ch.tx_off = ch.tx_bound = 0;
}

/* Moves tx_bound past the frames tx_off has entered. Frames are queued whole, so a header
 * starts at tx_bound while it is below tx_off. */
static void tx_track(void)
{
    while (ch.tx_bound < ch.tx_off) {
        sp_ap_hdr_t h;
        sp_ap_hdr_decode(ch.tx + ch.tx_bound, &h);
        ch.tx_bound += SP_AP_HDR_SIZE + (size_t)h.len;
    }
    if (ch.tx_off == ch.tx_len)
        tx_clear();
}

/* The host is gone: forget its streams and a frame half read or half written. A port keeps
 * its whole queued frames (see the top of this file); a unix client's queue goes with it. */
static void lost_host(void)
{
    ch.connected = false;
    if (ch.is_port) {
        ch.tx_off = ch.tx_bound; /* the rest of a frame the host got the start of */
        tx_track();
    } else {
        tx_clear();
    }
    sp_ap_reader_reset(&ch.rd);
    sp_sess_reset();
}

static void update_interest(void)
{
    short ev = POLLIN;
    if (ch.tx_len > ch.tx_off)
        ev |= POLLOUT;
    sp_ev_mod(ch.ev, ch.hup ? 0 : ev);
}

static void dispatch_frames(void)
{
    sp_ap_hdr_t h;
    const uint8_t *p;
    for (;;) {
        sp_ap_rd_result_t r = sp_ap_reader_next(&ch.rd, &h, &p);
        if (r == SP_AP_RD_NEED)
            return;
        if (r == SP_AP_RD_FRAME)
            sp_sess_on_frame(&h, p);
        else
            sp_sess_on_bad_header(&h, r == SP_AP_RD_OVERSIZE);
    }
}

static void close_client(void)
{
    if (ch.is_port || ch.fd < 0)
        return;
    sp_ev_del(ch.ev);
    ch.ev = NULL;
    close(ch.fd);
    ch.fd = -1;
}

static void on_hangup(void)
{
    if (ch.connected)
        sp_log(SP_LOG_INFO, "chan", "host disconnected");
    lost_host();
    if (ch.is_port) {
        ch.hup = true;
        ch.retry_at = now_ms() + CHAN_RETRY_MS;
        update_interest();
    } else {
        close_client();
    }
}

static void do_read(void)
{
    size_t avail;
    uint8_t *dst = sp_ap_reader_space(&ch.rd, &avail);
    ssize_t n = io_read(ch.fd, dst, avail);
    if (n > 0) {
        if (!ch.connected)
            sp_log(SP_LOG_INFO, "chan", "host connected");
        ch.connected = true;
        sp_ap_reader_commit(&ch.rd, (size_t)n);
        dispatch_frames();
    } else if (n == 0 || (errno != EAGAIN && errno != EINTR)) {
        on_hangup();
    }
}

/* Never resets the session itself: it runs inside stream code (via
 * sp_chan_end), which must not see its stream freed under it. A dead peer
 * is noticed by the read side on the next poll. */
static void do_write(void)
{
    while (ch.tx_off < ch.tx_len) {
        ssize_t n = io_write(ch.fd, ch.tx + ch.tx_off, ch.tx_len - ch.tx_off);
        if (n < 0) {
            if (errno != EAGAIN && errno != EINTR)
                ch.tx_off = ch.tx_len; /* peer gone: what is queued is lost anyway */
            break;
        }
        ch.tx_off += (size_t)n;
    }
    tx_track();
}

static void on_fd(int fd, short rev, void *arg)
{
    int my_fd = ch.fd;
    if (rev & POLLOUT)
        do_write();
    if (ch.fd != my_fd || ch.hup)
        return;
    if (rev & (POLLIN | POLLHUP | POLLERR))
        do_read();
    if (ch.fd == my_fd && !ch.hup)
        update_interest();
}

int sp_chan_open_path(const char *path)
{
    if (init_buffers() < 0)
        return -1;
    int fd = open(path, O_RDWR | O_NONBLOCK | O_CLOEXEC | O_NOCTTY);
    if (fd < 0) {
        sp_log(SP_LOG_ERROR, "chan", "open channel failed path=%s errno=%d", path, errno);
        return -1;
    }
    ch.is_port = true;
    ch.fd = fd;
    ch.ev = sp_ev_add(fd, POLLIN, on_fd, NULL);
    /* A port gives no connect event; treat it as connected until a hangup. */
    ch.connected = true;
    return ch.ev ? 0 : -1;
}

static void on_accept(int fd, short rev, void *arg)
{
    int c = accept4(fd, NULL, NULL, SOCK_NONBLOCK | SOCK_CLOEXEC);
    if (c < 0)
        return;
    if (ch.fd >= 0) {
        sp_log(SP_LOG_INFO, "chan", "new client replaces the old one");
        close_client();
        lost_host();
    }
    ch.fd = c;
    ch.connected = true;
    ch.ev = sp_ev_add(c, POLLIN, on_fd, NULL);
}

int sp_chan_listen_unix(const char *path)
{
    if (init_buffers() < 0)
        return -1;
    struct sockaddr_un sa = {.sun_family = AF_UNIX};
    if (strlen(path) >= sizeof(sa.sun_path))
        return -1;
    strcpy(sa.sun_path, path);
    int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    if (fd < 0)
        return -1;
    unlink(path);
    if (bind(fd, (struct sockaddr *)&sa, sizeof(sa)) < 0 || listen(fd, 4) < 0) {
        sp_log(SP_LOG_ERROR, "chan", "listen failed errno=%d", errno);
        close(fd);
        return -1;
    }
    ch.listen_fd = fd;
    ch.listen_ev = sp_ev_add(fd, POLLIN, on_accept, NULL);
    return 0;
}

bool sp_chan_connected(void)
{
    return ch.connected && ch.fd >= 0;
}

size_t sp_chan_tx_queued(void)
{
    return ch.tx_len - ch.tx_off;
}

bool sp_chan_tx_ok(void)
{
    return sp_chan_connected() && sp_chan_tx_queued() < SP_CHAN_TX_SOFT;
}

static int tx_reserve(size_t need)
{
    if (ch.tx_off > 0 && ch.tx_off == ch.tx_len)
        tx_clear();
    if (ch.tx_cap - ch.tx_len >= need)
        return 0;
    if (ch.tx_off > 0) { /* reclaim the written prefix before growing */
        memmove(ch.tx, ch.tx + ch.tx_off, ch.tx_len - ch.tx_off);
        ch.tx_len -= ch.tx_off;
        ch.tx_bound -= ch.tx_off;
        ch.tx_off = 0;
        if (ch.tx_cap - ch.tx_len >= need)
            return 0;
    }
    size_t cap = ch.tx_cap ? ch.tx_cap : 65536;
    while (cap - ch.tx_len < need)
        cap *= 2;
    uint8_t *p = realloc(ch.tx, cap);
    if (p == NULL)
        return -1;
    ch.tx = p;
    ch.tx_cap = cap;
    return 0;
}

sp_ap_writer_t *sp_chan_begin(uint32_t stream, uint16_t type, uint16_t flags, size_t max_payload)
{
    if (max_payload > SP_AP_MAX_PAYLOAD)
        max_payload = SP_AP_MAX_PAYLOAD;
    if (tx_reserve(SP_AP_HDR_SIZE + max_payload) < 0)
        return NULL;
    /* The writer covers only the free tail, so a frame can never spill over queued bytes. */
    sp_ap_writer_init(&ch.w, ch.tx + ch.tx_len, SP_AP_HDR_SIZE + max_payload);
    sp_ap_frame_begin(&ch.w, stream, type, flags);
    ch.w_open = true;
    return &ch.w;
}

int sp_chan_end(sp_ap_writer_t *w)
{
    ch.w_open = false;
    long n = sp_ap_frame_end(w);
    if (n < 0) {
        sp_log(SP_LOG_ERROR, "chan", "frame overflow dropped");
        return -1;
    }
    if (!sp_chan_connected())
        return 0;
    ch.tx_len += (size_t)n;
    do_write();
    if (ch.fd >= 0 && !ch.hup)
        update_interest();
    return 0;
}

int sp_chan_timeout_ms(void)
{
    if (!ch.hup)
        return -1;
    uint64_t now = now_ms();
    return ch.retry_at > now ? (int)(ch.retry_at - now) : 0;
}

void sp_chan_tick(void)
{
    if (ch.hup && now_ms() >= ch.retry_at) {
        /* Reading again tells us whether the host is back (data) or not (0 again). */
        ch.hup = false;
        update_interest();
    }
}
