/*
 * test_agentconn.c - the host end of the agent channel against a fake agent.
 *
 * The fake agent lives in this file: a listening unix socket in a temp dir,
 * driven from the same loop as the client, speaking the protocol with the
 * codec (base/agentproto.h). It answers HELLO, records what the host sends
 * and sends whatever a test scripts, including garbage.
 */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include "core/channel/agentconn.h"
#include "base/buf.h"
#include "base/log.h"
#include "base/metrics.h"
#include "tests/check.h"

static sp_loop_t *loop; /* one per process: h2o's evloop has no destructor */
static char tmpdir[64];

/* ---- the fake agent ---- */

#define RX_MAX 512

struct rx {
    uint32_t stream;
    uint16_t type;
    uint16_t flags;
    uint32_t len;
    uint32_t window; /* WINDOW increment */
};

struct fake {
    char path[108];
    int lfd;
    sp_watch_t *lw;
    int fd;
    sp_watch_t *w;
    uint8_t *rbuf;
    sp_ap_reader_t rd;
    bool paused;     /* not reading: the agent is stuck */
    int hello_reply; /* 0: proper HELLO, 1: unparseable, 2: wrong version, 3: proper, after
                        an answer to an earlier host's HELLO and that session's output */
    uint64_t session; /* in the host's last HELLO */
    int lose_answers; /* this many HELLOs get no answer (it was lost in the guest) */
    int accepts;
    int hellos;
    int eofs;
    uint32_t hello_version;
    char hello_client[32];
    struct rx rx[RX_MAX];
    int nrx;
    uint64_t data_bytes;
};

static void fake_client_close(struct fake *f)
{
    sp_watch_destroy(f->w);
    f->w = NULL;
    if (f->fd >= 0)
        close(f->fd);
    f->fd = -1;
    sp_ap_reader_reset(&f->rd);
}

/* Writes everything, letting the loop run (the client reads) while the socket is full. */
static void fake_write(struct fake *f, const void *p, size_t n)
{
    const uint8_t *b = p;
    for (int spins = 0; n > 0 && f->fd >= 0 && spins < 1000;) {
        ssize_t k = send(f->fd, b, n, MSG_NOSIGNAL | MSG_DONTWAIT);
        if (k < 0 && (errno == EAGAIN || errno == EINTR)) {
            sp_loop_run_once(loop, 5);
            spins++;
            continue;
        }
        if (k < 0)
            return; /* client gone: a test checks for that */
        b += k;
        n -= (size_t)k;
    }
}

static void fake_send(struct fake *f, uint32_t stream, uint16_t type, uint16_t flags,
                      const void *payload, size_t len)
{
    uint8_t hdr[SP_AP_HDR_SIZE];
    sp_ap_hdr_t h = {.len = (uint32_t)len, .stream = stream, .type = type, .flags = flags};
    sp_ap_hdr_encode(hdr, &h);
    fake_write(f, hdr, sizeof(hdr));
    if (len > 0)
        fake_write(f, payload, len);
}

static void fake_send_window(struct fake *f, uint32_t stream, uint32_t n)
{
    uint8_t buf[16];
    sp_ap_writer_t w;
    sp_ap_writer_init(&w, buf, sizeof(buf));
    sp_ap_put_u32(&w, SP_AP_K_WINDOW, n);
    fake_send(f, stream, SP_AP_T_WINDOW, 0, buf, w.len);
}

/* Our HELLO, answering the host HELLO that carried session. */
static void fake_send_hello(struct fake *f, uint64_t session)
{
    uint8_t buf[256];
    sp_ap_writer_t w;
    sp_ap_writer_init(&w, buf, sizeof(buf));
    sp_ap_hello_t out = {.version = f->hello_reply == 2 ? SP_AP_VERSION + 1 : SP_AP_VERSION,
                         .agent_version = {"fake-1.0", 8},
                         .caps = SP_AP_CAP_PTY,
                         .boot_ns = 1,
                         .session = session};
    long len = sp_ap_enc_hello(&w, &out);
    fake_write(f, buf, (size_t)len);
}

static void fake_on_hello(struct fake *f, const uint8_t *p, uint32_t n)
{
    sp_ap_hello_t in;
    sp_err_t err;
    f->hellos++;
    if (sp_ap_dec_hello(p, n, &in, &err) < 0)
        return;
    f->hello_version = in.version;
    f->session = in.session;
    snprintf(f->hello_client, sizeof(f->hello_client), "%.*s", (int)in.client.n,
             in.client.p ? in.client.p : "");
    if (f->lose_answers > 0) {
        f->lose_answers--;
        return;
    }
    if (f->hello_reply == 1) {
        fake_send(f, 0, SP_AP_T_HELLO, 0, "\x01\x00", 2);
        return;
    }
    if (f->hello_reply == 3) {
        fake_send_hello(f, in.session ^ 0x5a5a);
        fake_send(f, 1, SP_AP_T_PROC_STDOUT, 0, "old", 3);
    }
    fake_send_hello(f, in.session);
}

static void fake_on_io(sp_watch_t *w, int events, void *arg)
{
    struct fake *f = arg;
    size_t avail;
    uint8_t *p = sp_ap_reader_space(&f->rd, &avail);
    ssize_t n = recv(f->fd, p, avail, MSG_DONTWAIT);
    if (n <= 0) {
        if (n < 0 && (errno == EAGAIN || errno == EINTR))
            return;
        f->eofs++;
        fake_client_close(f);
        return;
    }
    sp_ap_reader_commit(&f->rd, (size_t)n);
    sp_ap_hdr_t h;
    const uint8_t *pl;
    sp_ap_rd_result_t r;
    while ((r = sp_ap_reader_next(&f->rd, &h, &pl)) != SP_AP_RD_NEED) {
        if (r != SP_AP_RD_FRAME) {
            fprintf(stderr, "fake agent: bad frame from host\n");
            failures++;
            continue;
        }
        if (h.stream == 0 && h.type == SP_AP_T_HELLO) {
            fake_on_hello(f, pl, h.len);
            continue;
        }
        if (h.type == SP_AP_T_DATA)
            f->data_bytes += h.len;
        if (f->nrx < RX_MAX) {
            struct rx *x = &f->rx[f->nrx++];
            x->stream = h.stream;
            x->type = h.type;
            x->flags = h.flags;
            x->len = h.len;
            x->window = 0;
            if (h.type == SP_AP_T_WINDOW)
                sp_ap_get_u32(pl, h.len, SP_AP_K_WINDOW, &x->window);
        }
    }
}

static void fake_on_accept(sp_watch_t *w, int events, void *arg)
{
    struct fake *f = arg;
    int fd = accept4(f->lfd, NULL, NULL, SOCK_NONBLOCK | SOCK_CLOEXEC);
    if (fd < 0)
        return;
    fake_client_close(f); /* one client at a time, like space-agent */
    f->fd = fd;
    f->accepts++;
    f->w = sp_watch_create(loop, fd, fake_on_io, f);
    sp_watch_set(f->w, f->paused ? 0 : SP_IO_READ);
}

static void fake_init(struct fake *f, const char *name)
{
    memset(f, 0, sizeof(*f));
    snprintf(f->path, sizeof(f->path), "%s/%s", tmpdir, name);
    unlink(f->path);
    f->lfd = -1;
    f->fd = -1;
    f->rbuf = malloc(SP_AP_MAX_FRAME);
    sp_ap_reader_init(&f->rd, f->rbuf, SP_AP_MAX_FRAME);
}

static void fake_listen(struct fake *f)
{
    struct sockaddr_un sa = {.sun_family = AF_UNIX};
    snprintf(sa.sun_path, sizeof(sa.sun_path), "%s", f->path);
    f->lfd = socket(AF_UNIX, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    CHECK(f->lfd >= 0);
    CHECK(bind(f->lfd, (struct sockaddr *)&sa, sizeof(sa)) == 0);
    CHECK(listen(f->lfd, 8) == 0);
    f->lw = sp_watch_create(loop, f->lfd, fake_on_accept, f);
    sp_watch_set(f->lw, SP_IO_READ);
}

static void fake_pause(struct fake *f, bool paused)
{
    f->paused = paused;
    if (f->w != NULL)
        sp_watch_set(f->w, paused ? 0 : SP_IO_READ);
}

static void fake_free(struct fake *f)
{
    fake_client_close(f);
    sp_watch_destroy(f->lw);
    if (f->lfd >= 0)
        close(f->lfd);
    unlink(f->path);
    free(f->rbuf);
}

/* The last frame of `type` the host sent, or NULL. */
static const struct rx *fake_last(const struct fake *f, uint16_t type)
{
    for (int i = f->nrx - 1; i >= 0; i--)
        if (f->rx[i].type == type)
            return &f->rx[i];
    return NULL;
}

/* ---- the client side ---- */

struct state {
    int ups, downs;
    sp_agentconn_t *destroy_on_down; /* destroys inside on_state(false) */
};

static void on_state(void *arg, bool up)
{
    struct state *st = arg;
    if (up) {
        st->ups++;
    } else {
        st->downs++;
        if (st->destroy_on_down != NULL)
            sp_agentconn_destroy(st->destroy_on_down);
    }
}

struct sink {
    int frames;
    uint16_t types[32];
    char data[4096];
    size_t dlen;
    int ended;
    int errors;
    sp_code_t err_code;
    int writable;
    bool auto_grant;
    bool reset_in_frame;
    sp_agentconn_t *destroy_in_frame;
};

static void sink_frame(sp_agentstream_t *s, uint16_t type, uint16_t flags, const uint8_t *p,
                       size_t len, void *arg)
{
    struct sink *k = arg;
    if (k->frames < 32)
        k->types[k->frames] = type;
    k->frames++;
    if (type == SP_AP_T_PROC_STDOUT) {
        size_t n = len < sizeof(k->data) - k->dlen ? len : sizeof(k->data) - k->dlen;
        memcpy(k->data + k->dlen, p, n);
        k->dlen += n;
        if (k->auto_grant)
            sp_agentstream_grant(s, (uint32_t)len);
    }
    if (flags & SP_AP_F_END) {
        k->ended++;
        CHECK(sp_agentstream_send(s, SP_AP_T_EOF, NULL, 0) == -1); /* finished */
    }
    if (k->reset_in_frame)
        sp_agentstream_reset(s);
    if (k->destroy_in_frame != NULL)
        sp_agentconn_destroy(k->destroy_in_frame);
}

static void sink_error(sp_agentstream_t *s, const sp_err_t *err, void *arg)
{
    struct sink *k = arg;
    k->errors++;
    k->err_code = err->code;
    CHECK(sp_agentstream_send(s, SP_AP_T_EOF, NULL, 0) == -1);
    sp_agentstream_reset(s); /* harmless here */
}

static void sink_writable(sp_agentstream_t *s, void *arg)
{
    struct sink *k = arg;
    k->writable++;
}

static const sp_agentstream_cbs_t sink_cbs = {sink_frame, sink_error, sink_writable};

typedef bool (*pred_fn)(void *arg);

static bool run_until(pred_fn pred, void *arg, int timeout_ms)
{
    uint64_t end = sp_loop_now_ms(loop) + (uint64_t)timeout_ms;
    while (!pred(arg)) {
        if (sp_loop_now_ms(loop) >= end)
            return false;
        sp_loop_run_once(loop, 10);
    }
    return true;
}

static void run_for(int ms)
{
    uint64_t end = sp_loop_now_ms(loop) + (uint64_t)ms;
    while (sp_loop_now_ms(loop) < end)
        sp_loop_run_once(loop, 10);
}

static bool conn_is_up(void *arg)
{
    return sp_agentconn_up(arg);
}

static bool sink_done(void *arg)
{
    struct sink *k = arg;
    return k->ended > 0 || k->errors > 0;
}

static bool sink_writable_once(void *arg)
{
    return ((struct sink *)arg)->writable > 0;
}

struct waited {
    int calls;
    sp_code_t code;
};

static void on_waited(void *arg, const sp_err_t *err)
{
    struct waited *w = arg;
    w->calls++;
    w->code = err ? err->code : SP_OK;
}

static bool waited_called(void *arg)
{
    return ((struct waited *)arg)->calls > 0;
}

/* A PROC_START payload: CMD "echo hi". */
static size_t proc_start_payload(uint8_t *buf, size_t cap)
{
    sp_ap_writer_t w;
    sp_ap_writer_init(&w, buf, cap);
    sp_ap_put_str(&w, SP_AP_K_CMD, "echo hi");
    return w.len;
}

/* Connects a client to a listening fake and waits for the HELLO exchange. */
static sp_agentconn_t *connect_up(struct fake *f, struct state *st)
{
    sp_agentconn_t *c = sp_agentconn_create(loop, f->path, on_state, st);
    CHECK(c != NULL);
    CHECK(run_until(conn_is_up, c, 2000));
    return c;
}

/* Opens a PROC_START stream and returns it; *id gets the stream id the fake saw. */
static sp_agentstream_t *open_proc(sp_agentconn_t *c, struct fake *f, struct sink *k, uint32_t *id)
{
    uint8_t buf[64];
    size_t n = proc_start_payload(buf, sizeof(buf));
    sp_err_t err;
    int before = f->nrx;
    sp_agentstream_t *s = sp_agentconn_open(c, SP_AP_T_PROC_START, buf, n, &sink_cbs, k, &err);
    CHECK(s != NULL);
    for (int i = 0; i < 200 && f->nrx == before; i++)
        sp_loop_run_once(loop, 10);
    CHECK(f->nrx > before && f->rx[f->nrx - 1].type == SP_AP_T_PROC_START);
    *id = f->nrx > before ? f->rx[f->nrx - 1].stream : 0;
    return s;
}

/* ---- cases ---- */

static void test_agentconn_backoff_then_up(void)
{
    struct fake f;
    struct state st = {0};
    fake_init(&f, "backoff.sock");
    sp_agentconn_t *c = sp_agentconn_create(loop, f.path, on_state, &st);
    CHECK(c != NULL);
    CHECK(!sp_agentconn_up(c));
    CHECK(strcmp(sp_agentconn_agent_version(c), "") == 0);
    struct waited quick = {0}, slow = {0};
    CHECK(sp_agentconn_when_up(c, 100, on_waited, &quick) == 0);
    CHECK(sp_agentconn_when_up(c, 3000, on_waited, &slow) == 0);
    CHECK(quick.calls == 0); /* never inside the call */

    sp_err_t err;
    uint8_t buf[64];
    size_t n = proc_start_payload(buf, sizeof(buf));
    CHECK(sp_agentconn_open(c, SP_AP_T_PROC_START, buf, n, &sink_cbs, NULL, &err) == NULL);
    CHECK(err.code == SP_EUNAVAIL);

    run_for(300); /* attempts at ~0, 100 and 300 ms fail: nothing listens */
    CHECK(quick.calls == 1 && quick.code == SP_EUNAVAIL);
    CHECK(slow.calls == 0);
    CHECK(st.ups == 0 && !sp_agentconn_up(c));

    fake_listen(&f);
    uint64_t t0 = sp_loop_now_ms(loop);
    CHECK(run_until(conn_is_up, c, 2500));
    CHECK(sp_loop_now_ms(loop) - t0 < 2100); /* backoff is capped at 2 s */
    CHECK(st.ups == 1 && st.downs == 0);
    CHECK(f.hellos == 1 && f.hello_version == SP_AP_VERSION);
    CHECK(strcmp(f.hello_client, "spaced") == 0);
    CHECK(strcmp(sp_agentconn_agent_version(c), "fake-1.0") == 0);
    CHECK(run_until(waited_called, &slow, 500));
    CHECK(slow.calls == 1 && slow.code == SP_OK);

    /* When already up: called on a later turn, not inside. */
    struct waited again = {0};
    CHECK(sp_agentconn_when_up(c, 1000, on_waited, &again) == 0);
    CHECK(again.calls == 0);
    CHECK(run_until(waited_called, &again, 500) && again.code == SP_OK);

    sp_agentconn_destroy(c);
    sp_agentconn_destroy(NULL);
    fake_free(&f);
}

static void test_agentconn_stream_frames_then_end(void)
{
    struct fake f;
    struct state st = {0};
    fake_init(&f, "frames.sock");
    fake_listen(&f);
    sp_agentconn_t *c = connect_up(&f, &st);
    struct sink k = {.auto_grant = true};
    uint32_t id;
    sp_agentstream_t *s = open_proc(c, &f, &k, &id);
    CHECK(id >= 1 && id < SP_AP_STREAM_AGENT_BASE);
    CHECK(sp_agentstream_arg(s) == &k && sp_agentstream_conn(s) == c);
    CHECK(sp_agentstream_credit(s) == SP_AP_INITIAL_WINDOW);

    /* Several frames in one write (the client reads them in one go), plus noise it must drop:
     * a frame for an unknown stream and a non-control frame on stream 0. */
    uint8_t batch[512];
    sp_ap_writer_t w;
    sp_ap_writer_init(&w, batch, sizeof(batch));
    sp_ap_frame_begin(&w, id, SP_AP_T_PROC_STARTED, 0);
    sp_ap_put_u32(&w, SP_AP_K_PID, 42);
    sp_ap_frame_end(&w);
    sp_ap_frame_begin(&w, id, SP_AP_T_PROC_STDOUT, 0);
    sp_ap_put_raw(&w, "hello ", 6);
    sp_ap_frame_end(&w);
    sp_ap_frame_begin(&w, 999, SP_AP_T_PROC_STDOUT, 0);
    sp_ap_put_raw(&w, "stray", 5);
    sp_ap_frame_end(&w);
    sp_ap_frame_begin(&w, 0, SP_AP_T_PROC_STDOUT, 0);
    sp_ap_put_raw(&w, "ctl", 3);
    sp_ap_frame_end(&w);
    sp_ap_frame_begin(&w, id, SP_AP_T_PROC_STDOUT, 0);
    sp_ap_put_raw(&w, "world", 5);
    sp_ap_frame_end(&w);
    fake_write(&f, batch, w.len);

    /* The final frame arrives a few bytes at a time. */
    uint8_t fin[64];
    sp_ap_writer_init(&w, fin, sizeof(fin));
    sp_ap_frame_begin(&w, id, SP_AP_T_PROC_EXIT, SP_AP_F_END);
    sp_ap_put_i32(&w, SP_AP_K_EXIT_CODE, 0);
    long fl = sp_ap_frame_end(&w);
    CHECK(fl > 0);
    for (long off = 0; off < fl; off += 5) {
        fake_write(&f, fin + off, (size_t)(fl - off < 5 ? fl - off : 5));
        for (int i = 0; i < 3; i++)
            sp_loop_run_once(loop, 5);
        if (off + 5 < fl)
            CHECK(k.ended == 0);
    }
    CHECK(run_until(sink_done, &k, 1000));
    CHECK(k.frames == 4 && k.ended == 1 && k.errors == 0);
    CHECK(k.types[0] == SP_AP_T_PROC_STARTED && k.types[1] == SP_AP_T_PROC_STDOUT &&
          k.types[2] == SP_AP_T_PROC_STDOUT && k.types[3] == SP_AP_T_PROC_EXIT);
    CHECK(k.dlen == 11 && memcmp(k.data, "hello world", 11) == 0);
    /* s is freed now. The grants went out as WINDOW frames on the stream. */
    run_for(30);
    uint32_t granted = 0;
    for (int i = 0; i < f.nrx; i++)
        if (f.rx[i].type == SP_AP_T_WINDOW && f.rx[i].stream == id)
            granted += f.rx[i].window;
    CHECK(granted == 11);
    CHECK(sp_agentconn_up(c) && st.downs == 0); /* noise did not break the channel */

    sp_agentconn_destroy(c);
    fake_free(&f);
}

static void test_agentconn_multiplex_two_streams(void)
{
    struct fake f;
    struct state st = {0};
    fake_init(&f, "mux.sock");
    fake_listen(&f);
    sp_agentconn_t *c = connect_up(&f, &st);
    struct sink a = {0}, b = {0};
    uint32_t ida, idb;
    open_proc(c, &f, &a, &ida);
    open_proc(c, &f, &b, &idb);
    CHECK(ida != idb && ida != 0 && idb != 0);

    fake_send(&f, ida, SP_AP_T_PROC_STDOUT, 0, "a1", 2);
    fake_send(&f, idb, SP_AP_T_PROC_STDOUT, 0, "b1", 2);
    fake_send(&f, ida, SP_AP_T_PROC_STDOUT, 0, "a2", 2);
    fake_send(&f, idb, SP_AP_T_PROC_STDOUT, 0, "b2", 2);
    fake_send(&f, idb, SP_AP_T_OK, SP_AP_F_END, NULL, 0);
    fake_send(&f, ida, SP_AP_T_OK, SP_AP_F_END, NULL, 0);
    CHECK(run_until(sink_done, &a, 1000));
    CHECK(run_until(sink_done, &b, 1000));
    CHECK(a.dlen == 4 && memcmp(a.data, "a1a2", 4) == 0 && a.ended == 1);
    CHECK(b.dlen == 4 && memcmp(b.data, "b1b2", 4) == 0 && b.ended == 1);
    CHECK(a.errors == 0 && b.errors == 0);

    sp_agentconn_destroy(c);
    fake_free(&f);
}

static void test_agentconn_credit(void)
{
    struct fake f;
    struct state st = {0};
    fake_init(&f, "credit.sock");
    fake_listen(&f);
    sp_agentconn_t *c = connect_up(&f, &st);
    struct sink k = {0};
    uint32_t id;
    sp_agentstream_t *s = open_proc(c, &f, &k, &id);

    static uint8_t chunk[SP_AP_MAX_DATA + 1];
    memset(chunk, 'x', sizeof(chunk));
    CHECK(sp_agentstream_send(s, SP_AP_T_DATA, chunk, SP_AP_MAX_DATA + 1) == -1);
    CHECK(sp_agentstream_send(s, SP_AP_T_WINDOW, chunk, 4) == -1);     /* grant() does that */
    CHECK(sp_agentstream_send(s, SP_AP_T_PROC_START, chunk, 4) == -1); /* opens a stream */
    int sent = 0;
    while (sent < 10 && sp_agentstream_send(s, SP_AP_T_DATA, chunk, SP_AP_MAX_DATA) == 1)
        sent++;
    CHECK(sent == (int)(SP_AP_INITIAL_WINDOW / SP_AP_MAX_DATA));
    CHECK(sp_agentstream_credit(s) == 0);
    CHECK(sp_agentstream_send(s, SP_AP_T_DATA, chunk, 1) == 0);
    CHECK(sp_agentstream_send(s, SP_AP_T_PROC_SIGNAL, chunk, 0) == 1); /* not DATA: no credit */
    run_for(50);
    CHECK(f.data_bytes == SP_AP_INITIAL_WINDOW);
    CHECK(k.writable == 0);

    fake_send_window(&f, id, SP_AP_MAX_DATA);
    CHECK(run_until(sink_writable_once, &k, 1000));
    CHECK(k.writable == 1);
    CHECK(sp_agentstream_credit(s) == SP_AP_MAX_DATA);
    CHECK(sp_agentstream_send(s, SP_AP_T_DATA, chunk, SP_AP_MAX_DATA) == 1);
    CHECK(sp_agentstream_send(s, SP_AP_T_DATA, chunk, 1) == 0);
    run_for(50);
    CHECK(f.data_bytes == SP_AP_INITIAL_WINDOW + SP_AP_MAX_DATA);

    /* The other direction: output beyond the window we granted ends the stream. */
    static uint8_t out[SP_AP_MAX_DATA];
    memset(out, 'y', sizeof(out));
    for (uint32_t i = 0; i < SP_AP_INITIAL_WINDOW / SP_AP_MAX_DATA; i++)
        fake_send(&f, id, SP_AP_T_PROC_STDOUT, 0, out, sizeof(out));
    run_for(30);
    CHECK(k.errors == 0);
    fake_send(&f, id, SP_AP_T_PROC_STDOUT, 0, out, 1);
    CHECK(run_until(sink_done, &k, 1000));
    CHECK(k.errors == 1 && k.err_code == SP_EUNAVAIL);
    run_for(30);
    const struct rx *r = fake_last(&f, SP_AP_T_RESET);
    CHECK(r != NULL && r->stream == id);
    CHECK(sp_agentconn_up(c)); /* only the stream ended */

    sp_agentconn_destroy(c);
    fake_free(&f);
}

static void test_agentconn_output_bounded(void)
{
    struct fake f;
    struct state st = {0};
    fake_init(&f, "bound.sock");
    fake_listen(&f);
    sp_agentconn_t *c = connect_up(&f, &st);
    struct sink k = {0};
    uint32_t id;
    sp_agentstream_t *s = open_proc(c, &f, &k, &id);
    fake_send_window(&f, id, 64u << 20);
    run_for(30);
    CHECK(sp_agentstream_credit(s) > (32u << 20));

    /* The agent stops reading: DATA is refused once the queue is over its soft limit. */
    fake_pause(&f, true);
    static uint8_t chunk[SP_AP_MAX_DATA];
    int sent = 0, rc = 1;
    while (sent < 1000 && (rc = sp_agentstream_send(s, SP_AP_T_DATA, chunk, sizeof(chunk))) == 1)
        sent++;
    CHECK(rc == 0);
    CHECK(sent > 4 && sent < 100); /* ~1 MiB queued plus what the socket holds */
    CHECK(sp_agentstream_credit(s) == 0);
    run_for(30);
    CHECK(k.writable == 0 && sp_agentconn_up(c));

    /* It reads again: the queue drains and the stream hears about it. */
    fake_pause(&f, false);
    CHECK(run_until(sink_writable_once, &k, 2000));
    CHECK(sp_agentstream_credit(s) > 0);

    /* Stuck for good while we keep sending non-DATA frames: past the hard bound the channel
     * is declared dead and reconnected. */
    fake_pause(&f, true);
    static uint8_t big[SP_AP_MAX_PAYLOAD];
    int n = 0;
    rc = 1;
    while (n < 40 && (rc = sp_agentstream_send(s, SP_AP_T_PROC_SIGNAL, big, sizeof(big))) == 1)
        n++;
    CHECK(rc == -1 && n >= 7);
    CHECK(!sp_agentconn_up(c));
    CHECK(k.errors == 0); /* not inside the call */
    CHECK(run_until(sink_done, &k, 1000));
    CHECK(k.errors == 1 && k.err_code == SP_EUNAVAIL);
    CHECK(st.downs == 1);
    fake_pause(&f, false);
    CHECK(run_until(conn_is_up, c, 2000));
    CHECK(st.ups == 2 && f.hellos == 2);

    sp_agentconn_destroy(c);
    fake_free(&f);
}

/* One unlabelled series from the rendered /metrics text (what a scraper sees); -1 if absent. */
static double metric(const char *name)
{
    sp_buf_t b = {0};
    CHECK(sp_metrics_render(&b) == 0);
    double v = -1;
    size_t n = strlen(name);
    for (const char *p = (const char *)b.p, *end = p + b.len; p != NULL && p < end;) {
        if (strncmp(p, name, n) == 0 && p[n] == ' ')
            v = strtod(p + n + 1, NULL);
        const char *nl = memchr(p, '\n', (size_t)(end - p));
        p = nl != NULL ? nl + 1 : NULL;
    }
    sp_buf_free(&b);
    return v;
}

static void test_agentconn_server_close_reconnects(void)
{
    struct fake f;
    struct state st = {0};
    fake_init(&f, "close.sock");
    fake_listen(&f);
    double connects0 = metric("space_agent_channel_connects_total");
    double reconnects0 = metric("space_agent_channel_reconnects_total");
    double losses0 = metric("space_agent_channel_losses_total");
    sp_agentconn_t *c = connect_up(&f, &st);
    CHECK(metric("space_agent_channel_connects_total") == connects0 + 1);
    CHECK(metric("space_agent_channel_reconnects_total") == reconnects0);
    struct sink k = {0};
    uint32_t id;
    open_proc(c, &f, &k, &id);
    fake_send(&f, id, SP_AP_T_PROC_STARTED, 0, NULL, 0);
    run_for(20);
    CHECK(k.frames == 1);

    fake_client_close(&f);
    CHECK(run_until(sink_done, &k, 1000));
    CHECK(k.errors == 1 && k.err_code == SP_EUNAVAIL && k.ended == 0);
    CHECK(st.downs == 1);
    CHECK(run_until(conn_is_up, c, 2000));
    CHECK(st.ups == 2 && f.hellos == 2 && f.accepts == 2);
    /* The second HELLO answered on the same channel is a reconnection, not a first connect. */
    CHECK(metric("space_agent_channel_reconnects_total") == reconnects0 + 1);
    CHECK(metric("space_agent_channel_connects_total") == connects0 + 1);
    CHECK(metric("space_agent_channel_losses_total") == losses0 + 1);

    /* The new session works. */
    struct sink k2 = {0};
    uint32_t id2;
    open_proc(c, &f, &k2, &id2);
    fake_send(&f, id2, SP_AP_T_OK, SP_AP_F_END, NULL, 0);
    CHECK(run_until(sink_done, &k2, 1000) && k2.ended == 1);

    sp_agentconn_destroy(c);
    fake_free(&f);
}

static void test_agentconn_garbage_reconnects(void)
{
    struct fake f;
    struct state st = {0};
    fake_init(&f, "garbage.sock");
    fake_listen(&f);
    sp_agentconn_t *c = connect_up(&f, &st);

    /* Reserved flags. */
    struct sink k = {0};
    uint32_t id;
    open_proc(c, &f, &k, &id);
    uint8_t junk[SP_AP_HDR_SIZE];
    memset(junk, 0xff, sizeof(junk));
    junk[0] = 4, junk[1] = junk[2] = junk[3] = 0; /* len 4: only the flags are wrong */
    fake_write(&f, junk, sizeof(junk));
    CHECK(run_until(sink_done, &k, 1000));
    CHECK(k.errors == 1 && k.err_code == SP_EUNAVAIL);
    CHECK(run_until(conn_is_up, c, 2000));
    CHECK(st.downs == 1 && st.ups == 2 && f.hellos == 2);

    /* An oversized frame. */
    struct sink k2 = {0};
    open_proc(c, &f, &k2, &id);
    sp_ap_hdr_t h = {.len = SP_AP_MAX_PAYLOAD + 1, .stream = id, .type = SP_AP_T_PROC_STDOUT};
    sp_ap_hdr_encode(junk, &h);
    fake_write(&f, junk, sizeof(junk));
    CHECK(run_until(sink_done, &k2, 1000));
    CHECK(k2.errors == 1);
    CHECK(run_until(conn_is_up, c, 2000));
    CHECK(st.downs == 2 && st.ups == 3 && f.hellos == 3);

    /* A second HELLO while up: the agent lost track of the session. */
    fake_send(&f, 0, SP_AP_T_HELLO, 0, "\x01\x00", 2);
    run_for(50);
    CHECK(st.downs == 3);
    CHECK(run_until(conn_is_up, c, 2000));
    CHECK(f.session != 0);
    fake_send_hello(&f, f.session);
    run_for(50);
    CHECK(st.downs == 4);
    CHECK(run_until(conn_is_up, c, 2000));
    /* A HELLO answering another session's (read late by the guest) changes nothing. */
    uint64_t first = f.session;
    fake_send_hello(&f, f.session + 1);
    run_for(50);
    CHECK(st.downs == 4 && sp_agentconn_up(c));
    sp_agentconn_destroy(c);

    /* The guest answers an earlier host's HELLO, and sends that session's output, before
     * ours: both are ignored, and the channel comes up once, on our answer. */
    struct state st3 = {0};
    f.hello_reply = 3;
    c = connect_up(&f, &st3);
    run_for(50);
    CHECK(st3.ups == 1 && st3.downs == 0 && sp_agentconn_up(c));
    CHECK(f.session != 0 && f.session != first); /* a new session per connection */
    struct sink k3 = {0};
    open_proc(c, &f, &k3, &id); /* the channel works */
    fake_send(&f, id, SP_AP_T_PROC_STDOUT, 0, "new", 3);
    fake_send(&f, id, SP_AP_T_PROC_EXIT, SP_AP_F_END, NULL, 0);
    CHECK(run_until(sink_done, &k3, 1000));
    CHECK(k3.errors == 0 && k3.dlen == 3 && memcmp(k3.data, "new", 3) == 0);
    f.hello_reply = 0;
    sp_agentconn_destroy(c);

    /* Answers to our HELLO that do not parse, or speak another version: never up, retried. */
    for (int mode = 1; mode <= 2; mode++) {
        struct state st2 = {0};
        f.hello_reply = mode;
        int hellos = f.hellos;
        c = sp_agentconn_create(loop, f.path, on_state, &st2);
        run_for(250);
        CHECK(f.hellos >= hellos + 2 && st2.ups == 0 && !sp_agentconn_up(c));
        f.hello_reply = 0;
        CHECK(run_until(conn_is_up, c, 2000));
        CHECK(st2.ups == 1 && st2.downs == 0);
        sp_agentconn_destroy(c);
    }
    fake_free(&f);
}

/* An answer lost in the guest costs a wait, not the channel: the HELLO is said again on the
 * same connection, waiting twice as long each time; one read late (the agent was stopped)
 * answers an earlier session and is ignored. */
static void test_agentconn_unanswered_hello_is_said_again(void)
{
    struct fake f;
    struct state st = {0};
    fake_init(&f, "hello-again.sock");
    fake_listen(&f);
    f.lose_answers = 2;
    sp_agentconn_t *c = sp_agentconn_create(loop, f.path, on_state, &st);
    sp_agentconn_set_hello_wait(c, 100);
    uint64_t t0 = sp_loop_now_ms(loop);
    CHECK(run_until(conn_is_up, c, 3000));
    uint64_t took = sp_loop_now_ms(loop) - t0;
    CHECK(took >= 280 && took < 2000); /* 100 ms, then 200 ms */
    CHECK(f.accepts == 1 && f.hellos == 3 && st.ups == 1 && st.downs == 0);
    run_for(500);
    CHECK(f.hellos == 3 && sp_agentconn_up(c)); /* nothing more once answered */

    sp_agentconn_destroy(c);
    fake_free(&f);

    /* The agent reads nothing (a paused VM) across two waits, then answers all three HELLOs
     * in order: only the last one's answer counts, and none is taken as unexpected. */
    struct state st2 = {0};
    fake_init(&f, "hello-late.sock");
    fake_pause(&f, true);
    fake_listen(&f);
    c = sp_agentconn_create(loop, f.path, on_state, &st2);
    sp_agentconn_set_hello_wait(c, 100);
    run_for(400); /* HELLOs at about 0, 100 and 300 ms */
    CHECK(f.accepts == 1 && f.hellos == 0 && !sp_agentconn_up(c));
    fake_pause(&f, false);
    CHECK(run_until(conn_is_up, c, 1000));
    CHECK(f.hellos == 3);
    run_for(300);
    CHECK(sp_agentconn_up(c) && st2.ups == 1 && st2.downs == 0 && f.accepts == 1);
    sp_agentconn_destroy(c);
    fake_free(&f);
}

static bool fake_saw_eof(void *arg)
{
    return ((struct fake *)arg)->eofs > 0;
}

static void test_agentconn_destroy_with_open_streams(void)
{
    struct fake f;
    struct state st = {0};
    fake_init(&f, "destroy.sock");
    fake_listen(&f);

    /* Plain destroy: every open stream hears, at once. */
    sp_agentconn_t *c = connect_up(&f, &st);
    struct sink a = {0}, b = {0};
    uint32_t ida, idb;
    open_proc(c, &f, &a, &ida);
    open_proc(c, &f, &b, &idb);
    sp_agentconn_destroy(c);
    CHECK(a.errors == 1 && b.errors == 1 && a.err_code == SP_EUNAVAIL);
    CHECK(st.downs == 0); /* the owner destroyed it: no state callback */
    CHECK(run_until(fake_saw_eof, &f, 1000));

    /* Destroy from inside a stream's on_frame. */
    c = connect_up(&f, &st);
    struct sink x = {0}, y = {0};
    uint32_t idx, idy;
    open_proc(c, &f, &x, &idx);
    open_proc(c, &f, &y, &idy);
    x.destroy_in_frame = c;
    fake_send(&f, idx, SP_AP_T_PROC_STDOUT, 0, "z", 1);
    fake_send(&f, idy, SP_AP_T_PROC_STDOUT, 0, "never", 5);
    CHECK(run_until(sink_done, &y, 1000));
    CHECK(x.frames == 1 && x.errors == 1 && y.errors == 1 && y.frames == 0);

    /* Destroy from inside on_state(false), while streams fail. */
    st.ups = 0;
    c = connect_up(&f, &st);
    st.destroy_on_down = c;
    struct sink d = {0};
    uint32_t idd;
    open_proc(c, &f, &d, &idd);
    int hellos = f.hellos;
    fake_client_close(&f);
    CHECK(run_until(sink_done, &d, 1000));
    CHECK(d.errors == 1);
    run_for(300);
    CHECK(f.hellos == hellos); /* no reconnect after destroy */
    st.destroy_on_down = NULL;

    fake_free(&f);
}

static void test_agentconn_reset_in_callback(void)
{
    struct fake f;
    struct state st = {0};
    fake_init(&f, "reset.sock");
    fake_listen(&f);
    sp_agentconn_t *c = connect_up(&f, &st);
    struct sink k = {.reset_in_frame = true};
    uint32_t id;
    open_proc(c, &f, &k, &id);
    fake_send(&f, id, SP_AP_T_PROC_STDOUT, 0, "one", 3);
    fake_send(&f, id, SP_AP_T_PROC_STDOUT, 0, "two", 3); /* crosses the RESET: dropped */
    run_for(50);
    CHECK(k.frames == 1 && k.errors == 0);
    const struct rx *r = fake_last(&f, SP_AP_T_RESET);
    CHECK(r != NULL && r->stream == id);

    /* Reset on an END frame sends nothing: the agent already forgot the stream. */
    struct sink e = {.reset_in_frame = true};
    uint32_t ide;
    open_proc(c, &f, &e, &ide);
    fake_send(&f, ide, SP_AP_T_OK, SP_AP_F_END, NULL, 0);
    CHECK(run_until(sink_done, &e, 1000));
    run_for(30);
    r = fake_last(&f, SP_AP_T_RESET);
    CHECK(r != NULL && r->stream == id);

    /* Reset outside callbacks: no on_error when the channel closes later. */
    struct sink g = {0};
    uint32_t idg;
    sp_agentstream_t *s = open_proc(c, &f, &g, &idg);
    sp_agentstream_reset(s);
    sp_agentconn_destroy(c);
    CHECK(g.errors == 0 && g.frames == 0);
    fake_free(&f);
}

/* ---- streams the agent opens (egress) ---- */

struct lis {
    int up, down, gone;
    int hooked;
    char hooked_id[65];
    sp_agentconn_listener_t *self;
    bool unlisten_on_up;
};

static void lis_cb(void *arg, sp_agentconn_t *c, sp_agentconn_event_t ev)
{
    struct lis *l = arg;
    if (ev == SP_AGENTCONN_UP)
        l->up++;
    else if (ev == SP_AGENTCONN_DOWN)
        l->down++;
    else
        l->gone++;
    if (ev == SP_AGENTCONN_UP && l->unlisten_on_up)
        sp_agentconn_unlisten(l->self);
}

static void lis_hook(void *arg, sp_agentconn_t *c, const char *id)
{
    struct lis *l = arg;
    l->hooked++;
    snprintf(l->hooked_id, sizeof(l->hooked_id), "%s", id);
}

struct acc {
    int offered;
    uint16_t type;
    bool refuse;
    struct sink sink;
    sp_agentstream_t *s;
};

static int acc_cb(void *arg, sp_agentstream_t *s, uint16_t type, const uint8_t *p, size_t len,
                  sp_agentstream_cbs_t *cbs, void **sarg)
{
    struct acc *a = arg;
    a->offered++;
    a->type = type;
    if (a->refuse)
        return -1;
    CHECK(sp_agentstream_agent_opened(s));
    a->s = s;
    *cbs = sink_cbs;
    *sarg = &a->sink;
    return 0;
}

static bool acc_offered(void *arg)
{
    return ((struct acc *)arg)->offered > 0;
}

/* The last frame the host sent on stream id, or NULL. */
static const struct rx *fake_last_on(const struct fake *f, uint32_t id)
{
    for (int i = f->nrx - 1; i >= 0; i--)
        if (f->rx[i].stream == id)
            return &f->rx[i];
    return NULL;
}

static void test_agentconn_agent_opened_streams(void)
{
    struct fake f;
    struct state st = {0};
    struct lis l = {0}, l2 = {.unlisten_on_up = true};
    fake_init(&f, "egress.sock");
    fake_listen(&f);
    sp_agentconn_set_hook(lis_hook, &l);
    sp_agentconn_t *c = sp_agentconn_create(loop, f.path, on_state, &st);
    CHECK(strcmp(sp_agentconn_sandbox(c), "") == 0);
    sp_agentconn_set_sandbox(c, "sbx1");
    CHECK(l.hooked == 1 && strcmp(l.hooked_id, "sbx1") == 0);
    CHECK(strcmp(sp_agentconn_sandbox(c), "sbx1") == 0);
    sp_agentconn_set_hook(NULL, NULL);
    CHECK(sp_agentconn_listen(c, lis_cb, &l) != NULL);
    l2.self = sp_agentconn_listen(c, lis_cb, &l2);
    CHECK(run_until(conn_is_up, c, 2000));
    CHECK(l.up == 1 && l2.up == 1 && st.ups == 1);
    CHECK(sp_agentconn_caps(c) == SP_AP_CAP_PTY);

    /* No acceptor yet: refused with ERROR + END. */
    const uint32_t a1 = SP_AP_STREAM_AGENT_BASE | 1;
    fake_send(&f, a1, SP_AP_T_EGRESS_OPEN, 0, NULL, 0);
    run_for(50);
    const struct rx *r = fake_last_on(&f, a1);
    CHECK(r != NULL && r->type == SP_AP_T_ERROR && (r->flags & SP_AP_F_END));

    /* Accepted: DATA both ways, then the host ends it with OK + END. */
    struct acc a = {0};
    sp_agentconn_set_acceptor(c, acc_cb, &a);
    const uint32_t a2 = SP_AP_STREAM_AGENT_BASE | 2;
    fake_send(&f, a2, SP_AP_T_EGRESS_OPEN, 0, NULL, 0);
    fake_send(&f, a2, SP_AP_T_DATA, 0, "GET", 3);
    CHECK(run_until(acc_offered, &a, 1000));
    run_for(30);
    CHECK(a.type == SP_AP_T_EGRESS_OPEN && a.s != NULL);
    CHECK(a.sink.frames == 1 && a.sink.types[0] == SP_AP_T_DATA);
    CHECK(a.s != NULL && sp_agentstream_send(a.s, SP_AP_T_DATA, (const uint8_t *)"HTTP", 4) == 1);
    run_for(30);
    r = fake_last_on(&f, a2);
    CHECK(r != NULL && r->type == SP_AP_T_DATA && r->len == 4);
    /* Only OK, ERROR and DNS_ANSWER end it. */
    CHECK(a.s != NULL && sp_agentstream_end(a.s, SP_AP_T_DATA, NULL, 0) == -1);
    CHECK(a.s != NULL && sp_agentstream_end(a.s, SP_AP_T_OK, NULL, 0) == 0);
    run_for(30);
    r = fake_last_on(&f, a2);
    CHECK(r != NULL && r->type == SP_AP_T_OK && (r->flags & SP_AP_F_END));
    CHECK(a.sink.errors == 0);
    fake_send(&f, a2, SP_AP_T_DATA, 0, "late", 4); /* crossed the END: dropped */
    run_for(30);
    CHECK(a.sink.frames == 1);

    /* The guest abandons one with RESET: on_error. */
    struct acc b = {0};
    sp_agentconn_set_acceptor(c, acc_cb, &b);
    const uint32_t a3 = SP_AP_STREAM_AGENT_BASE | 3;
    fake_send(&f, a3, SP_AP_T_DNS_QUERY, 0, NULL, 0);
    CHECK(run_until(acc_offered, &b, 1000));
    CHECK(b.type == SP_AP_T_DNS_QUERY);
    fake_send(&f, a3, SP_AP_T_RESET, 0, NULL, 0);
    CHECK(run_until(sink_done, &b.sink, 1000));
    CHECK(b.sink.errors == 1 && b.sink.err_code == SP_EUNAVAIL);

    /* A refusing acceptor: ERROR + END. A host stream cannot be ended this way. */
    struct acc d = {.refuse = true};
    sp_agentconn_set_acceptor(c, acc_cb, &d);
    const uint32_t a4 = SP_AP_STREAM_AGENT_BASE | 4;
    fake_send(&f, a4, SP_AP_T_EGRESS_OPEN, 0, NULL, 0);
    CHECK(run_until(acc_offered, &d, 1000));
    run_for(30);
    r = fake_last_on(&f, a4);
    CHECK(r != NULL && r->type == SP_AP_T_ERROR && (r->flags & SP_AP_F_END));
    struct sink k = {0};
    uint32_t id;
    sp_agentstream_t *hs = open_proc(c, &f, &k, &id);
    CHECK(sp_agentstream_end(hs, SP_AP_T_OK, NULL, 0) == -1);
    /* The host may not open the agent's stream types. */
    sp_err_t err;
    CHECK(sp_agentconn_open(c, SP_AP_T_EGRESS_OPEN, NULL, 0, &sink_cbs, &k, &err) == NULL);

    /* Channel loss: DOWN for the listener still there, then UP again; destroy: GONE. */
    sp_agentconn_set_acceptor(c, acc_cb, &b);
    fake_client_close(&f);
    CHECK(run_until(sink_done, &k, 1000));
    CHECK(run_until(conn_is_up, c, 3000));
    run_for(20);
    CHECK(l.down == 1 && l.up == 2);
    CHECK(l2.up == 1 && l2.down == 0); /* it left inside its first UP */
    sp_agentconn_destroy(c);
    CHECK(l.gone == 1 && l2.gone == 0);
    fake_free(&f);
}

int main(void)
{
    const char *lvl = getenv("SP_TEST_LOG");
    if (lvl == NULL || sp_log_parse_level(lvl, &sp_log_min_level) < 0)
        sp_log_min_level = (sp_log_level_t)(SP_LOG_ERROR + 1); /* expected misuse is logged */
    snprintf(tmpdir, sizeof(tmpdir), "/tmp/sp-agentconn.XXXXXX");
    if (mkdtemp(tmpdir) == NULL) {
        perror("mkdtemp");
        return 1;
    }
    loop = sp_loop_create();
    test_agentconn_backoff_then_up();
    test_agentconn_stream_frames_then_end();
    test_agentconn_multiplex_two_streams();
    test_agentconn_credit();
    test_agentconn_output_bounded();
    test_agentconn_server_close_reconnects();
    test_agentconn_garbage_reconnects();
    test_agentconn_unanswered_hello_is_said_again();
    test_agentconn_destroy_with_open_streams();
    test_agentconn_reset_in_callback();
    test_agentconn_agent_opened_streams();
    for (int i = 0; i < 5; i++)
        sp_loop_run_once(loop, 1);
    rmdir(tmpdir);
    return check_report("agentconn");
}
