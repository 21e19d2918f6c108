/*
 * test_chan.c - unit tests for the agent's channel on a virtio-serial port.
 *
 * The port is played by replacing its read and write (sp_chan_set_io) over
 * /dev/null, which poll() always reports ready. Like the guest kernel's port, the fake
 * returns queued data before it reports a hangup, returns 0 from read while the host is
 * away, and refuses writes (EAGAIN) while it is away. In place of agent/sess.c, a fake
 * session answers every frame with a frame of the same stream, type and payload.
 */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "agent/chan.h"
#include "agent/ev.h"
#include "agent/sess.h"
#include "tests/check.h"

#define T_BIG 0x7777 /* the fake session answers this one with a frame of BIG_LEN bytes */
#define BIG_LEN 40000u

static struct {
    bool up;                /* the host side is connected */
    uint8_t in[4096];       /* host to guest, not yet read */
    size_t in_len, in_off;
    uint8_t out[1u << 18];  /* guest to host, written */
    size_t out_len;
    size_t budget;          /* bytes writes may still take; then EAGAIN */
} port;

static int resets;

/* ---- the fake session (agent/sess.h) ---- */

void sp_sess_on_frame(const sp_ap_hdr_t *h, const uint8_t *p)
{
    size_t n = h->type == T_BIG ? BIG_LEN : h->len;
    sp_ap_writer_t *w = sp_chan_begin(h->stream, h->type, 0, n);
    if (w == NULL)
        return;
    if (h->type == T_BIG) {
        static uint8_t big[BIG_LEN];
        memset(big, 'b', sizeof big);
        sp_ap_put_raw(w, big, sizeof big);
    } else {
        sp_ap_put_raw(w, p, h->len);
    }
    sp_chan_end(w);
}

void sp_sess_on_bad_header(const sp_ap_hdr_t *h, bool oversize)
{
    (void)h;
    (void)oversize;
    failures++;
    fprintf(stderr, "bad header read\n");
}

void sp_sess_reset(void)
{
    resets++;
}

/* ---- the port ---- */

static ssize_t fake_read(int fd, void *buf, size_t n)
{
    (void)fd;
    if (port.in_off < port.in_len) {
        size_t k = port.in_len - port.in_off < n ? port.in_len - port.in_off : n;
        memcpy(buf, port.in + port.in_off, k);
        port.in_off += k;
        return (ssize_t)k;
    }
    if (!port.up)
        return 0;
    errno = EAGAIN;
    return -1;
}

static ssize_t fake_write(int fd, const void *buf, size_t n)
{
    (void)fd;
    if (n > 32 * 1024)
        n = 32 * 1024; /* what the guest kernel takes per write */
    if (n > port.budget)
        n = port.budget;
    if (!port.up || n == 0) {
        errno = EAGAIN;
        return -1;
    }
    CHECK(port.out_len + n <= sizeof port.out);
    if (port.out_len + n > sizeof port.out)
        return -1;
    memcpy(port.out + port.out_len, buf, n);
    port.out_len += n;
    port.budget -= n;
    return (ssize_t)n;
}

static void host_sends(uint16_t type, const char *payload)
{
    sp_ap_hdr_t h = {.len = (uint32_t)strlen(payload), .stream = 0, .type = type, .flags = 0};
    CHECK(port.in_len + SP_AP_HDR_SIZE + h.len <= sizeof port.in);
    sp_ap_hdr_encode(port.in + port.in_len, &h);
    memcpy(port.in + port.in_len + SP_AP_HDR_SIZE, payload, h.len);
    port.in_len += SP_AP_HDR_SIZE + h.len;
}

static uint64_t now_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000 + (uint64_t)ts.tv_nsec / 1000000;
}

/* Runs the agent's loop (as agent/main.c does) for ms milliseconds. */
static void run_for(unsigned ms)
{
    uint64_t end = now_ms() + ms;
    while (now_ms() < end) {
        sp_chan_tick();
        int t = sp_chan_timeout_ms();
        CHECK(sp_ev_run_once(t < 0 || t > 5 ? 5 : t) == 0);
    }
}

/* Is the host's output exactly one frame of this type and payload? */
static bool got_only(uint16_t type, const char *payload)
{
    if (port.out_len < SP_AP_HDR_SIZE)
        return false;
    sp_ap_hdr_t h;
    sp_ap_hdr_decode(port.out, &h);
    return h.type == type && h.stream == 0 && h.len == strlen(payload) &&
           port.out_len == SP_AP_HDR_SIZE + h.len &&
           memcmp(port.out + SP_AP_HDR_SIZE, payload, h.len) == 0;
}

static void host_reads_all(void)
{
    port.out_len = 0;
}

/* A fresh port with a host that has had its HELLO answered. */
static void first_session(void)
{
    memset(&port, 0, sizeof port);
    port.up = true;
    port.budget = (size_t)-1;
    host_sends(SP_AP_T_HELLO, "session-1");
    run_for(30);
    CHECK(got_only(SP_AP_T_HELLO, "session-1"));
    host_reads_all();
}

/* The host leaves (the port reports it), and the next one connects and sends its HELLO. */
static void next_host(void)
{
    port.up = false;
    run_for(30);
    port.budget = (size_t)-1;
    port.up = true;
    host_sends(SP_AP_T_HELLO, "session-2");
    run_for(250);
}

/* The guest kernel hands the agent a new host's HELLO before it reports that this host
 * connected (control messages are handled after data): the answer cannot be written then,
 * and the hangup the port still reports must not lose it. */
static void test_chan_answer_read_before_the_port_reports_the_host_is_kept(void)
{
    first_session();

    port.up = false; /* the host left */
    int before = resets;
    run_for(30);
    CHECK(resets > before);
    CHECK(port.out_len == 0);

    host_sends(SP_AP_T_HELLO, "session-2"); /* the next host, still reported away */
    run_for(250);                           /* past the hangup's retry, twice */
    CHECK(port.out_len == 0);

    port.up = true; /* the connect message is handled at last */
    run_for(250);
    CHECK(got_only(SP_AP_T_HELLO, "session-2"));
}

/* A frame the old host got the start of must not be finished to the next host: it would
 * read the rest as a frame header. */
static void test_chan_hangup_cuts_a_half_written_frame(void)
{
    first_session();

    port.budget = 1000;
    host_sends(T_BIG, "x");
    run_for(30);
    CHECK(port.out_len == 1000); /* the big answer is half written */
    host_reads_all();

    next_host();
    CHECK(got_only(SP_AP_T_HELLO, "session-2"));
}

/* Whole frames queued when the host leaves are written to the next one, whose side drops
 * them (they come before the answer to its HELLO); a frame that never began is whole. */
static void test_chan_hangup_keeps_whole_frames(void)
{
    first_session();

    port.budget = 0; /* the host stopped reading */
    host_sends(T_BIG, "x");
    run_for(30);
    CHECK(port.out_len == 0);
    next_host();
    sp_ap_hdr_t h;
    CHECK(port.out_len == 2 * SP_AP_HDR_SIZE + BIG_LEN + strlen("session-2"));
    sp_ap_hdr_decode(port.out, &h);
    CHECK(h.type == T_BIG && h.len == BIG_LEN);
    sp_ap_hdr_decode(port.out + SP_AP_HDR_SIZE + BIG_LEN, &h);
    CHECK(h.type == SP_AP_T_HELLO && h.len == strlen("session-2"));
}

int main(void)
{
    sp_chan_set_io(fake_read, fake_write);
    if (sp_chan_open_path("/dev/null") < 0) {
        fprintf(stderr, "cannot open /dev/null\n");
        return 1;
    }
    test_chan_answer_read_before_the_port_reports_the_host_is_kept();
    test_chan_hangup_cuts_a_half_written_frame();
    test_chan_hangup_keeps_whole_frames();
    return check_report("chan");
}
