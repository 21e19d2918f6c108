/*
 * test_egress.c - integration test of the agent's egress side: a real
 * space-agent on a unix socket, this process playing both the host (frames)
 * and guest programs (TCP/UDP clients on 127.0.0.1).
 *
 * Covers EGRESS_CONFIG validation, the proxy port (open, bytes both ways under
 * windows, 20 MiB each way, half-close, OK/ERROR/RESET endings, guest resets,
 * host disconnect, reconfiguration, 1,000 simultaneous connections, no fd
 * leak), DNS over UDP and TCP (answers, SERVFAIL on ERROR, timeout and no
 * session), resolv.conf/profile files and the env of later PROC_START.
 *
 * The agent runs in host test mode: its resolv.conf, profile file and DNS
 * port are redirected into a temp dir and a free port, so the host's own
 * files and port 53 are never touched. The PROC_START part needs root (it
 * runs as root); the rest runs as any user.
 */
#include <arpa/inet.h>
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "agent/egress.h"
#include "agent/tests/agenthost.h"
#include "base/agentproto.h"
#include "tests/check.h"
#include "tests/ports.h"

static char tmpdir[64], sock_path[100], resolv_path[128], profile_path[160];
static int dns_port;

static uint64_t now_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000 + (uint64_t)ts.tv_nsec / 1000000;
}

/* ---- agent ---- */

static uint32_t hello(void)
{
    sp_ap_hello_t h = {.version = SP_AP_VERSION, .client = {"test", 4}};
    sp_ap_writer_init(&ah_w, ah_wbuf, sizeof(ah_wbuf));
    REQUIRE(sp_ap_enc_hello(&ah_w, &h) > 0);
    ah_write_all(ah_wbuf, ah_w.len);
    frame_t f = ah_wait_on(0, true);
    REQUIRE(f.h.type == SP_AP_T_HELLO);
    sp_ap_hello_t got;
    REQUIRE(sp_ap_dec_hello(f.p, f.h.len, &got, NULL) == 0);
    return got.caps;
}

static int agent_fds(void)
{
    char path[64];
    snprintf(path, sizeof(path), "/proc/%d/fd", (int)ah_agent_pid);
    DIR *d = opendir(path);
    if (d == NULL)
        return -1;
    int n = 0;
    for (struct dirent *e; (e = readdir(d)) != NULL;)
        if (e->d_name[0] != '.')
            n++;
    closedir(d);
    return n;
}

/* Lists the agent's fds on stderr (for a leak report). */
static void dump_agent_fds(void)
{
    char path[64], link[128], target[256];
    snprintf(path, sizeof(path), "/proc/%d/fd", (int)ah_agent_pid);
    DIR *d = opendir(path);
    for (struct dirent *e; d != NULL && (e = readdir(d)) != NULL;) {
        if (e->d_name[0] == '.')
            continue;
        snprintf(link, sizeof(link), "%s/%.32s", path, e->d_name);
        ssize_t n = readlink(link, target, sizeof(target) - 1);
        target[n > 0 ? n : 0] = 0;
        fprintf(stderr, "  agent fd %s -> %s\n", e->d_name, target);
    }
    if (d != NULL)
        closedir(d);
}

/* Waits until the agent holds `want` fds (lingering sockets close on their own). */
static int agent_fds_settle(int want)
{
    int n = -1;
    for (int i = 0; i < 200; i++) {
        n = agent_fds();
        if (n == want)
            return n;
        usleep(25000);
    }
    return n;
}

static void kill_agent(void)
{
    if (ah_agent_pid > 0)
        kill(ah_agent_pid, SIGKILL);
}

/* ---- guest side ---- */

/* Blocking connect to 127.0.0.1:port; -1 with errno if refused. */
static int tcp_connect(int port)
{
    int s = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    struct sockaddr_in sa = {.sin_family = AF_INET, .sin_port = htons((uint16_t)port)};
    sa.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    if (connect(s, (struct sockaddr *)&sa, sizeof(sa)) < 0) {
        int e = errno;
        close(s);
        errno = e;
        return -1;
    }
    return s;
}

/* A nonblocking connect to 127.0.0.1:port, started (it completes in the background). */
static int connect_nb(int port)
{
    int s = socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    REQUIRE(s >= 0);
    struct sockaddr_in sa = {.sin_family = AF_INET, .sin_port = htons((uint16_t)port)};
    sa.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    int rc = connect(s, (struct sockaddr *)&sa, sizeof(sa));
    REQUIRE(rc == 0 || errno == EINPROGRESS);
    return s;
}

static int local_port(int s)
{
    struct sockaddr_in sa;
    socklen_t sl = sizeof(sa);
    REQUIRE(getsockname(s, (struct sockaddr *)&sa, &sl) == 0);
    return ntohs(sa.sin_port);
}

/* Reads exactly n bytes from a guest socket; -1 on EOF, error or timeout. */
static int sock_read(int s, void *p, size_t n, int timeout_ms)
{
    uint8_t *b = p;
    while (n > 0) {
        struct pollfd pf = {.fd = s, .events = POLLIN};
        if (poll(&pf, 1, timeout_ms) <= 0)
            return -1;
        ssize_t r = recv(s, b, n, 0);
        if (r <= 0)
            return -1;
        b += r;
        n -= (size_t)r;
    }
    return 0;
}

/* What a guest socket does next: 0 = EOF, -errno = error, -ETIMEDOUT = nothing. */
static int sock_end(int s, int timeout_ms)
{
    struct pollfd pf = {.fd = s, .events = POLLIN};
    if (poll(&pf, 1, timeout_ms) <= 0)
        return -ETIMEDOUT;
    char c;
    ssize_t r = recv(s, &c, 1, 0);
    return r == 0 ? 0 : r < 0 ? -errno : 1;
}

/* ---- egress helpers ---- */

static frame_t config_raw(const sp_ap_egress_config_t *m)
{
    uint32_t id = ah_next_stream++;
    sp_ap_writer_init(&ah_w, ah_wbuf, sizeof(ah_wbuf));
    REQUIRE(sp_ap_enc_egress_config(&ah_w, id, m) > 0);
    ah_write_all(ah_wbuf, ah_w.len);
    return ah_wait_on(id, true);
}

/* Sends EGRESS_CONFIG with the usual proxy env for `port`; returns OK(0) or the error code. */
static uint32_t configure(uint32_t port, bool dns)
{
    static char kv[6][96];
    const char *keys[6] = {"HTTP_PROXY",  "HTTPS_PROXY", "http_proxy",
                           "https_proxy", "NO_PROXY",    "no_proxy"};
    sp_ap_egress_config_t m = {.proxy_port = port, .dns = dns};
    for (int i = 0; port != 0 && i < 6; i++) {
        if (i < 4)
            snprintf(kv[i], sizeof(kv[i]), "%s=http://127.0.0.1:%u", keys[i], port);
        else
            snprintf(kv[i], sizeof(kv[i]), "%s=localhost,127.0.0.1,::1", keys[i]);
        m.env[m.envc++] = (sp_ap_str_t){kv[i], (uint32_t)strlen(kv[i])};
    }
    frame_t f = config_raw(&m);
    CHECK(f.h.flags & SP_AP_F_END);
    return f.h.type == SP_AP_T_OK ? 0 : ah_err_code(&f);
}

/* The next frame of type (others passed over, 15 s for each), checked to be on a stream the
 * agent opened; its payload lives until the next frame is read. */
static frame_t wait_agent_frame(uint16_t type)
{
    frame_t f;
    do
        REQUIRE(ah_recv_frame(&f, 15000) == 0);
    while (f.h.type != type);
    CHECK(f.h.stream >= SP_AP_STREAM_AGENT_BASE);
    return f;
}

/* Waits for EGRESS_OPEN on an agent stream; checks KIND and returns the id. */
static uint32_t wait_open(int *peer_port)
{
    frame_t f = wait_agent_frame(SP_AP_T_EGRESS_OPEN);
    CHECK(ah_u32_of(&f, SP_AP_K_KIND, 0) == SP_AP_EGRESS_PROXY);
    *peer_port = (int)ah_u32_of(&f, SP_AP_K_PEER_PORT, 0);
    return f.h.stream;
}

/* A guest program connects to the proxy; returns its socket and the stream. */
static int proxy_client(int port, uint32_t *stream)
{
    int c = tcp_connect(port);
    REQUIRE(c >= 0);
    int peer;
    *stream = wait_open(&peer);
    CHECK(peer == local_port(c));
    return c;
}

/* ---- tests ---- */

static void test_egress_caps_and_bad_config(void)
{
    CHECK(hello() & SP_AP_CAP_EGRESS);
    struct {
        const char *what;
        const void *p;
        size_t n;
    } bad[] = {
        {"truncated tlv", "\x5a\x00\xff\xff\x00\x00\x01", 7},
        {"port is 2 bytes", "\x5a\x00\x02\x00\x00\x00\x50\x00", 8},
        {"port > 65535", "\x5a\x00\x04\x00\x00\x00\x70\x11\x01\x00", 10},
        {"dns = 2", "\x5b\x00\x04\x00\x00\x00\x02\x00\x00\x00", 10},
        {"env without =",
         "\x16\x00\x03\x00\x00\x00"
         "abc",
         9},
        {"env with empty key",
         "\x16\x00\x03\x00\x00\x00"
         "=ab",
         9},
        {"env with NUL",
         "\x16\x00\x03\x00\x00\x00"
         "a=\0",
         9},
    };
    for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
        uint32_t id = ah_next_stream++;
        sp_ap_put_raw(ah_begin(id, SP_AP_T_EGRESS_CONFIG, 0), bad[i].p, bad[i].n);
        ah_send_frame();
        frame_t f = ah_wait_on(id, true);
        if (ah_err_code(&f) != SP_AP_E_INVAL)
            fprintf(stderr, "bad config '%s' not rejected\n", bad[i].what);
        CHECK(ah_err_code(&f) == SP_AP_E_INVAL && (f.h.flags & SP_AP_F_END));
    }
    /* A port someone else holds: ERROR, and the agent carries on. */
    int busy = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    struct sockaddr_in sa = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    socklen_t sl = sizeof(sa);
    REQUIRE(bind(busy, (struct sockaddr *)&sa, sizeof(sa)) == 0 && listen(busy, 1) == 0);
    REQUIRE(getsockname(busy, (struct sockaddr *)&sa, &sl) == 0);
    CHECK(configure(ntohs(sa.sin_port), false) != 0);
    close(busy);
    /* The host may not send agent-only types, nor open on the agent's ids. */
    uint32_t id = ah_next_stream++;
    ah_send_empty(id, SP_AP_T_EGRESS_OPEN, 0);
    frame_t f = ah_wait_on(id, true);
    CHECK(ah_err_code(&f) == SP_AP_E_TYPE);
    id = ah_next_stream++;
    ah_send_empty(id, SP_AP_T_DNS_ANSWER, SP_AP_F_END);
    f = ah_wait_on(id, true);
    CHECK(ah_err_code(&f) == SP_AP_E_TYPE);
    ah_send_empty(SP_AP_STREAM_AGENT_BASE + 7, SP_AP_T_EGRESS_CONFIG, 0);
    f = ah_wait_on(SP_AP_STREAM_AGENT_BASE + 7, true);
    CHECK(ah_err_code(&f) == SP_AP_E_PROTO);
    ah_ping_ok();
}

/* path's text (at most cap - 1 bytes) into buf; "" when it cannot be read. */
static const char *read_text(const char *path, char *buf, size_t cap)
{
    FILE *r = fopen(path, "r");
    size_t n = r ? fread(buf, 1, cap - 1, r) : 0;
    buf[n] = 0;
    if (r)
        fclose(r);
    return buf;
}

static void test_egress_files_and_env(int port)
{
    /* The original resolv.conf is kept once and put back when DNS goes off. */
    FILE *o = fopen(resolv_path, "w");
    REQUIRE(o != NULL);
    fputs("nameserver 192.0.2.1\n", o);
    fclose(o);
    CHECK(configure((uint32_t)port, true) == 0);
    char buf[4096] = "", bk[300];
    read_text(resolv_path, buf, sizeof(buf));
    CHECK(strstr(buf, "\nnameserver 127.0.0.1\n") != NULL);
    CHECK(strstr(buf, "192.0.2.1") == NULL);
    snprintf(bk, sizeof(bk), "%s.space-orig", resolv_path);
    CHECK(strcmp(read_text(bk, buf, sizeof(buf)), "nameserver 192.0.2.1\n") == 0);
    /* The same config again changes nothing; the backup stays the original. */
    CHECK(configure((uint32_t)port, true) == 0);
    CHECK(strcmp(read_text(bk, buf, sizeof(buf)), "nameserver 192.0.2.1\n") == 0);

    /* Login shells: the profile file exports the env and sh can source it. */
    char cmd[512];
    snprintf(cmd, sizeof(cmd),
             ". '%s' && test \"$HTTPS_PROXY\" = http://127.0.0.1:%d && "
             "test \"$no_proxy\" = localhost,127.0.0.1,::1",
             profile_path, port);
    CHECK(system(cmd) == 0);
    struct stat st;
    CHECK(stat(profile_path, &st) == 0 && (st.st_mode & 0777) == 0644);

    /* A value with a quote survives shell quoting. */
    sp_ap_egress_config_t m = {.proxy_port = (uint32_t)port, .dns = true, .envc = 2};
    const char *q = "SPACE_Q=it's a \"test\" $HOME", *odd = "not-a-shell-name=1";
    m.env[0] = (sp_ap_str_t){q, (uint32_t)strlen(q)};
    m.env[1] = (sp_ap_str_t){odd, (uint32_t)strlen(odd)};
    frame_t f = config_raw(&m);
    CHECK(f.h.type == SP_AP_T_OK);
    snprintf(cmd, sizeof(cmd), ". '%s' && test \"$SPACE_Q\" = 'it'\\''s a \"test\" $HOME'",
             profile_path);
    CHECK(system(cmd) == 0);

    /* ENV reaches later PROC_START: over IDENTITY's, under the request's own. */
    if (geteuid() == 0) {
        uint32_t id = ah_next_stream++;
        sp_ap_identity_t idm = {.env = {{"SPACE_Q=from-identity", 21}, {"SPACE_I=ident", 13}},
                                .envc = 2};
        sp_ap_writer_init(&ah_w, ah_wbuf, sizeof(ah_wbuf));
        REQUIRE(sp_ap_enc_identity(&ah_w, id, &idm) > 0);
        ah_write_all(ah_wbuf, ah_w.len);
        f = ah_wait_on(id, true);
        CHECK(f.h.type == SP_AP_T_OK);
        CHECK(configure((uint32_t)port, true) == 0); /* the usual proxy env again */
        id = ah_next_stream++;
        sp_ap_writer_t *w = ah_begin(id, SP_AP_T_PROC_START, 0);
        sp_ap_put_str(w, SP_AP_K_CMD, "echo \"$HTTP_PROXY|$https_proxy|$SPACE_I|$NO_PROXY\"");
        sp_ap_put_str(w, SP_AP_K_ENV, "NO_PROXY=mine");
        sp_ap_put_u32(w, SP_AP_K_STDIN, 0); /* no stdin pipe kept after exit: fd count stays */
        ah_send_frame();
        char out[512] = "";
        size_t ol = 0;
        for (;;) {
            f = ah_wait_on(id, true);
            if (f.h.type == SP_AP_T_PROC_STDOUT && ol + f.h.len < sizeof(out)) {
                memcpy(out + ol, f.p, f.h.len);
                ol += f.h.len;
            }
            if (f.h.flags & SP_AP_F_END)
                break;
        }
        char want[256];
        snprintf(want, sizeof(want), "http://127.0.0.1:%d|http://127.0.0.1:%d|ident|mine\n", port,
                 port);
        if (strcmp(out, want) != 0)
            fprintf(stderr, "proc env: got '%s' want '%s'\n", out, want);
        CHECK(strcmp(out, want) == 0);
    } else {
        fprintf(stderr, "note: PROC_START env check skipped (not root)\n");
    }

    /* DNS off: the original is back, the backup gone. */
    CHECK(configure((uint32_t)port, false) == 0);
    CHECK(strcmp(read_text(resolv_path, buf, sizeof(buf)), "nameserver 192.0.2.1\n") == 0);
    CHECK(access(bk, F_OK) < 0);
}

static void test_egress_proxy_roundtrip(int port)
{
    uint32_t s;
    int c = proxy_client(port, &s);
    const char req[] = "CONNECT example.com:443 HTTP/1.1\r\nHost: example.com:443\r\n\r\n";
    CHECK(send(c, req, sizeof(req) - 1, 0) == (ssize_t)sizeof(req) - 1);
    char got[256];
    size_t gl = 0;
    while (gl < sizeof(req) - 1) {
        frame_t f = ah_wait_on(s, true);
        REQUIRE(f.h.type == SP_AP_T_DATA && gl + f.h.len < sizeof(got));
        memcpy(got + gl, f.p, f.h.len);
        gl += f.h.len;
    }
    CHECK(gl == sizeof(req) - 1 && memcmp(got, req, gl) == 0);
    const char resp[] = "HTTP/1.1 200 Connection established\r\n\r\n";
    ah_send_data(s, resp, sizeof(resp) - 1);
    char rb[64];
    CHECK(sock_read(c, rb, sizeof(resp) - 1, 5000) == 0 && memcmp(rb, resp, sizeof(resp) - 1) == 0);
    /* The agent grants back what reached the guest, in steps of a quarter window rather
     * than per write: nothing yet for these few bytes, all of it once a quarter is in. */
    frame_t f;
    uint32_t granted = 0;
    while (ah_recv_frame(&f, 300) == 0)
        if (f.h.stream == s && f.h.type == SP_AP_T_WINDOW)
            granted += ah_u32_of(&f, SP_AP_K_WINDOW, 0);
    CHECK(granted == 0);
    static char chunk[16384];
    memset(chunk, 'x', sizeof(chunk));
    size_t more = SP_AP_INITIAL_WINDOW / 4, total = sizeof(resp) - 1 + more;
    for (size_t sent = 0; sent < more; sent += sizeof(chunk))
        ah_send_data(s, chunk, sizeof(chunk));
    static char sink[SP_AP_INITIAL_WINDOW / 4];
    CHECK(sock_read(c, sink, more, 5000) == 0);
    while (granted < total && ah_recv_frame(&f, 5000) == 0)
        if (f.h.stream == s && f.h.type == SP_AP_T_WINDOW)
            granted += ah_u32_of(&f, SP_AP_K_WINDOW, 0);
    CHECK(granted == total);

    /* Guest half-close: EOF to the host, bytes still flow the other way. */
    shutdown(c, SHUT_WR);
    f = ah_wait_on(s, true);
    CHECK(f.h.type == SP_AP_T_EOF);
    ah_send_data(s, "tail", 4);
    CHECK(sock_read(c, rb, 4, 5000) == 0 && memcmp(rb, "tail", 4) == 0);
    /* Host OK: the guest sees the end. */
    ah_send_empty(s, SP_AP_T_OK, SP_AP_F_END);
    CHECK(sock_end(c, 5000) == 0);
    close(c);

    /* OK right after data the guest has not read yet: the data is flushed first. */
    c = proxy_client(port, &s);
    static uint8_t blob[200000];
    for (size_t i = 0; i < sizeof(blob); i++)
        blob[i] = (uint8_t)(i * 31 + 7);
    for (size_t off = 0; off < sizeof(blob); off += SP_AP_MAX_DATA) {
        size_t k = sizeof(blob) - off < SP_AP_MAX_DATA ? sizeof(blob) - off : SP_AP_MAX_DATA;
        ah_send_data(s, blob + off, k);
    }
    ah_send_empty(s, SP_AP_T_OK, SP_AP_F_END);
    static uint8_t back[sizeof(blob)];
    CHECK(sock_read(c, back, sizeof(back), 5000) == 0 && memcmp(back, blob, sizeof(blob)) == 0);
    CHECK(sock_end(c, 5000) == 0);
    close(c);

    /* Host ERROR: the guest connection is reset. */
    c = proxy_client(port, &s);
    sp_ap_writer_init(&ah_w, ah_wbuf, sizeof(ah_wbuf));
    REQUIRE(sp_ap_enc_error(&ah_w, s, SP_AP_E_PERM, 0, "denied by policy") > 0);
    ah_write_all(ah_wbuf, ah_w.len);
    int e = sock_end(c, 5000);
    CHECK(e == -ECONNRESET || e == 0);
    close(c);

    /* Host RESET: same. */
    c = proxy_client(port, &s);
    ah_send_empty(s, SP_AP_T_RESET, 0);
    e = sock_end(c, 5000);
    CHECK(e == -ECONNRESET || e == 0);
    close(c);

    /* Guest reset (RST): RESET to the host. */
    c = proxy_client(port, &s);
    struct linger lg = {1, 0};
    setsockopt(c, SOL_SOCKET, SO_LINGER, &lg, sizeof(lg));
    close(c);
    f = ah_wait_on(s, true);
    CHECK(f.h.type == SP_AP_T_RESET);

    /* Guest full close while the host still sends: EOF, then RESET when the write fails. */
    c = proxy_client(port, &s);
    close(c);
    f = ah_wait_on(s, true);
    CHECK(f.h.type == SP_AP_T_EOF);
    bool reset = false;
    uint64_t until = now_ms() + 5000;
    while (!reset && now_ms() < until) {
        ah_send_data(s, "more", 4);
        while (!reset && ah_recv_frame(&f, 50) == 0)
            reset = f.h.stream == s && f.h.type == SP_AP_T_RESET;
    }
    CHECK(reset);

    /* A window violation by the host ends the stream; the agent carries on. */
    c = proxy_client(port, &s);
    uint8_t *big = calloc(1, SP_AP_INITIAL_WINDOW + 1);
    ah_send_data(s, big, SP_AP_INITIAL_WINDOW + 1);
    free(big);
    f = ah_wait_on(s, true);
    CHECK(ah_err_code(&f) == SP_AP_E_PROTO);
    e = sock_end(c, 5000);
    CHECK(e == -ECONNRESET || e == 0);
    close(c);
    ah_ping_ok();
}

/* 20 MiB each way at once; the host grants late and in large steps so both windows fill. */
static void test_egress_bulk(int port)
{
    const uint64_t total = 20u << 20;
    long rss0 = ah_agent_rss_kb();
    uint32_t s;
    int c = proxy_client(port, &s);
    fcntl(c, F_SETFL, O_NONBLOCK);
    uint64_t up_sent = 0, up_got = 0, up_granted = 0;                         /* guest -> host */
    uint64_t down_sent = 0, down_got = 0, down_credit = SP_AP_INITIAL_WINDOW; /* host -> guest */
    bool up_eof = false, down_eof_sent = false, window_ok = true, data_ok = true;
    static uint8_t chunk[SP_AP_MAX_DATA], rb[65536];
    uint64_t deadline = now_ms() + 120000;
    while ((!up_eof || down_got < total) && now_ms() < deadline) {
        struct pollfd pf[2] = {{.fd = ah_fd, .events = POLLIN},
                               {.fd = c, .events = POLLIN | (up_sent < total ? POLLOUT : 0)}};
        poll(pf, 2, 1000);
        if (pf[1].revents & POLLOUT) {
            size_t k = 0;
            for (; k < sizeof(chunk) && up_sent + k < total; k++)
                chunk[k] = (uint8_t)((up_sent + k) * 13 + ((up_sent + k) >> 12));
            ssize_t n = send(c, chunk, k, MSG_NOSIGNAL);
            if (n > 0)
                up_sent += (uint64_t)n;
            if (up_sent == total)
                shutdown(c, SHUT_WR);
        }
        if (pf[1].revents & POLLIN) {
            ssize_t n = recv(c, rb, sizeof(rb), 0);
            for (ssize_t i = 0; i < n; i++)
                if (rb[i] != (uint8_t)((down_got + (uint64_t)i) * 7 + 3))
                    data_ok = false;
            if (n > 0)
                down_got += (uint64_t)n;
        }
        if (pf[0].revents & POLLIN) {
            frame_t f;
            REQUIRE(ah_recv_frame(&f, 5000) == 0);
            if (f.h.stream == s && f.h.type == SP_AP_T_DATA) {
                for (uint32_t i = 0; i < f.h.len; i++)
                    if (f.p[i] != (uint8_t)((up_got + i) * 13 + ((up_got + i) >> 12)))
                        data_ok = false;
                up_got += f.h.len;
                if (up_got > up_granted + SP_AP_INITIAL_WINDOW)
                    window_ok = false;
                /* Grant in 192 KiB steps: the agent runs dry before each. */
                if (up_got - up_granted >= 192 * 1024) {
                    ah_grant(s, (uint32_t)(up_got - up_granted));
                    up_granted = up_got;
                }
            } else if (f.h.stream == s && f.h.type == SP_AP_T_WINDOW) {
                down_credit += ah_u32_of(&f, SP_AP_K_WINDOW, 0);
            } else if (f.h.stream == s && f.h.type == SP_AP_T_EOF) {
                up_eof = true;
            } else if (f.h.stream == s) {
                fprintf(stderr, "bulk: unexpected %s\n", sp_ap_type_name(f.h.type));
                data_ok = false;
                break;
            }
        }
        /* Host -> guest within the agent's credit. */
        while (down_sent < total && down_credit > 0) {
            size_t k = SP_AP_MAX_DATA;
            if (k > down_credit)
                k = (size_t)down_credit;
            if (k > total - down_sent)
                k = (size_t)(total - down_sent);
            for (size_t i = 0; i < k; i++)
                chunk[i] = (uint8_t)((down_sent + i) * 7 + 3);
            ah_send_data(s, chunk, k);
            down_sent += k;
            down_credit -= k;
            if (down_sent - down_got > 4 * SP_AP_INITIAL_WINDOW)
                break; /* let the guest side catch up */
        }
        if (down_sent == total && !down_eof_sent) {
            ah_send_empty(s, SP_AP_T_EOF, 0);
            down_eof_sent = true;
        }
    }
    long rss1 = ah_agent_rss_kb();
    fprintf(stderr, "bulk: up %llu/%llu down %llu/%llu, agent rss %ld -> %ld kB\n",
            (unsigned long long)up_got, (unsigned long long)total, (unsigned long long)down_got,
            (unsigned long long)total, rss0, rss1);
    CHECK(up_got == total && up_eof);
    CHECK(down_got == total);
    CHECK(window_ok && data_ok);
    CHECK(rss1 - rss0 < 16 * 1024);
    /* Both directions done: the guest sees EOF; the host ends the stream. */
    fcntl(c, F_SETFL, 0);
    CHECK(sock_end(c, 5000) == 0);
    ah_send_empty(s, SP_AP_T_OK, SP_AP_F_END);
    close(c);
}

#define MANY 1000

static void test_egress_many(int port)
{
    usleep(200000); /* earlier connections finish lingering */
    int base_fds = agent_fds();
    static int cl[MANY];
    static uint32_t sid[MANY];
    static int lport[MANY];
    uint64_t t0 = now_ms();
    for (int i = 0; i < MANY; i++)
        cl[i] = connect_nb(port);
    for (int i = 0; i < MANY; i++) {
        struct pollfd pf = {.fd = cl[i], .events = POLLOUT};
        REQUIRE(poll(&pf, 1, 10000) == 1);
        lport[i] = local_port(cl[i]);
        sid[i] = 0;
    }
    int opened = 0;
    frame_t f;
    while (opened < MANY && ah_recv_frame(&f, 15000) == 0) {
        if (f.h.type != SP_AP_T_EGRESS_OPEN)
            continue;
        int peer = (int)ah_u32_of(&f, SP_AP_K_PEER_PORT, 0);
        for (int i = 0; i < MANY; i++) {
            if (lport[i] == peer && sid[i] == 0) {
                sid[i] = f.h.stream;
                opened++;
                break;
            }
        }
    }
    uint64_t t1 = now_ms();
    CHECK(opened == MANY);
    fprintf(stderr, "many: %d connections opened in %llu ms\n", opened,
            (unsigned long long)(t1 - t0));
    for (int i = 0; i < MANY; i++)
        for (int j = i + 1; j < MANY && i < 50; j++)
            CHECK(sid[i] != sid[j]);
    /* Each client says its number; the host answers each on its stream. */
    for (int i = 0; i < MANY; i++) {
        char m[16];
        int n = snprintf(m, sizeof(m), "c%04d", i);
        CHECK(send(cl[i], m, (size_t)n, 0) == n);
        n = snprintf(m, sizeof(m), "h%04d", i);
        if (sid[i] != 0)
            ah_send_data(sid[i], m, (size_t)n);
    }
    int got_up = 0;
    while (got_up < MANY && ah_recv_frame(&f, 15000) == 0) {
        if (f.h.type != SP_AP_T_DATA)
            continue;
        for (int i = 0; i < MANY; i++) {
            if (sid[i] == f.h.stream) {
                char want[16];
                snprintf(want, sizeof(want), "c%04d", i);
                CHECK(f.h.len == 5 && memcmp(f.p, want, 5) == 0);
                got_up++;
                break;
            }
        }
    }
    CHECK(got_up == MANY);
    int got_down = 0;
    for (int i = 0; i < MANY; i++) {
        char m[8], want[8];
        snprintf(want, sizeof(want), "h%04d", i);
        if (sock_read(cl[i], m, 5, 10000) == 0 && memcmp(m, want, 5) == 0)
            got_down++;
    }
    CHECK(got_down == MANY);
    /* The host ends them all; every guest sees EOF; the agent closes every socket. */
    for (int i = 0; i < MANY; i++)
        if (sid[i] != 0)
            ah_send_empty(sid[i], SP_AP_T_OK, SP_AP_F_END);
    int eofs = 0;
    for (int i = 0; i < MANY; i++) {
        if (sock_end(cl[i], 10000) == 0)
            eofs++;
        close(cl[i]);
    }
    CHECK(eofs == MANY);
    int fds = agent_fds_settle(base_fds);
    fprintf(stderr, "many: done in %llu ms, agent fds %d -> %d\n",
            (unsigned long long)(now_ms() - t0), base_fds, fds);
    CHECK(fds == base_fds);
    ah_ping_ok();
}

/* At the cap, a new connection is accepted and closed at once; the rest keep working. */
static void test_egress_cap(int port)
{
    const int n = SP_EGRESS_MAX_CONNS;
    struct rlimit rl;
    if (getrlimit(RLIMIT_NOFILE, &rl) < 0 || rl.rlim_cur < (rlim_t)n + 256) {
        fprintf(stderr, "note: cap check skipped (RLIMIT_NOFILE %llu)\n",
                (unsigned long long)rl.rlim_cur);
        return;
    }
    usleep(200000);
    int base_fds = agent_fds();
    int *cl = calloc((size_t)n, sizeof(int));
    REQUIRE(cl != NULL);
    uint64_t t0 = now_ms();
    for (int i = 0; i < n; i++)
        cl[i] = connect_nb(port);
    int opened = 0;
    frame_t f;
    while (opened < n && ah_recv_frame(&f, 15000) == 0)
        opened += f.h.type == SP_AP_T_EGRESS_OPEN;
    CHECK(opened == n);
    fprintf(stderr, "cap: %d connections opened in %llu ms\n", opened,
            (unsigned long long)(now_ms() - t0));
    /* One more: refused (EOF or reset), no stream for it. */
    int extra = tcp_connect(port);
    CHECK(extra >= 0);
    if (extra >= 0) {
        int e = sock_end(extra, 3000);
        CHECK(e == 0 || e == -ECONNRESET);
        close(extra);
    }
    bool opened_more = false;
    while (ah_recv_frame(&f, 300) == 0)
        opened_more |= f.h.type == SP_AP_T_EGRESS_OPEN;
    CHECK(!opened_more);
    /* A new HELLO forgets every stream: all guest connections are reset, every fd freed. */
    CHECK(hello() & SP_AP_CAP_EGRESS);
    int ended = 0;
    for (int i = 0; i < n; i++) {
        struct pollfd pf = {.fd = cl[i], .events = POLLIN};
        if (poll(&pf, 1, 5000) == 1) {
            char c;
            ended += recv(cl[i], &c, 1, 0) <= 0;
        }
        close(cl[i]);
    }
    free(cl);
    CHECK(ended == n);
    int fds = agent_fds_settle(base_fds);
    fprintf(stderr, "cap: done in %llu ms, agent fds %d -> %d\n",
            (unsigned long long)(now_ms() - t0), base_fds, fds);
    CHECK(fds == base_fds);
    CHECK(configure((uint32_t)port, false) == 0);
    ah_ping_ok();
}

/* Guest bytes the agent sends on stream s within ms (other frames passed over). */
static size_t data_within(uint32_t s, int ms)
{
    size_t got = 0;
    frame_t f;
    while (ah_recv_frame(&f, ms) == 0)
        if (f.h.stream == s && f.h.type == SP_AP_T_DATA)
            got += f.h.len;
    return got;
}

/* EGRESS_CONFIG.WINDOW: connections opened after it start with that much credit, and send
 * more only as the host grants it; a config without it brings the default back. */
static void test_egress_open_window(int port)
{
    CHECK(hello() & SP_AP_CAP_EGRESS_WINDOW);
    CHECK(configure((uint32_t)port, false) == 0);
    sp_ap_egress_config_t m = {.proxy_port = (uint32_t)port, .window = 4096};
    frame_t f = config_raw(&m);
    CHECK(f.h.type == SP_AP_T_OK);
    static char blob[10000];
    memset(blob, 'w', sizeof(blob));
    uint32_t s;
    int c = proxy_client(port, &s);
    CHECK(send(c, blob, sizeof(blob), 0) == (ssize_t)sizeof(blob));
    CHECK(data_within(s, 300) == 4096);
    ah_grant(s, 5000);
    CHECK(data_within(s, 300) == 5000);
    ah_grant(s, 5000);
    CHECK(data_within(s, 300) == sizeof(blob) - 4096 - 5000);
    ah_send_empty(s, SP_AP_T_OK, SP_AP_F_END);
    close(c);

    /* Over the default window: refused, nothing changes. */
    m.window = SP_AP_INITIAL_WINDOW + 1;
    f = config_raw(&m);
    CHECK(f.h.type == SP_AP_T_ERROR);
    /* Without WINDOW: the default again. */
    CHECK(configure((uint32_t)port, false) == 0);
    c = proxy_client(port, &s);
    CHECK(send(c, blob, sizeof(blob), 0) == (ssize_t)sizeof(blob));
    CHECK(data_within(s, 300) == sizeof(blob));
    ah_send_empty(s, SP_AP_T_OK, SP_AP_F_END);
    close(c);
    ah_ping_ok();
}

static void test_egress_reconfigure(int port)
{
    uint32_t s_old;
    int c_old = proxy_client(port, &s_old);
    int port2 = test_free_port();
    REQUIRE(port2 > 0);
    CHECK(configure((uint32_t)port2, false) == 0);
    /* Old port closed, new one serving, the open connection carries on. */
    CHECK(tcp_connect(port) < 0 && errno == ECONNREFUSED);
    uint32_t s_new;
    int c_new = proxy_client(port2, &s_new);
    ah_send_data(s_old, "old", 3);
    char b[4];
    CHECK(sock_read(c_old, b, 3, 5000) == 0 && memcmp(b, "old", 3) == 0);
    /* Port 0: no listener, every proxy connection reset, the profile file removed. */
    CHECK(access(profile_path, F_OK) == 0);
    uint32_t id = ah_next_stream++;
    sp_ap_egress_config_t off = {0};
    sp_ap_writer_init(&ah_w, ah_wbuf, sizeof(ah_wbuf));
    REQUIRE(sp_ap_enc_egress_config(&ah_w, id, &off) > 0);
    ah_write_all(ah_wbuf, ah_w.len);
    bool r_old = false, r_new = false, ok = false;
    frame_t f;
    while (!ok && ah_recv_frame(&f, 5000) == 0) {
        r_old |= f.h.stream == s_old && f.h.type == SP_AP_T_RESET;
        r_new |= f.h.stream == s_new && f.h.type == SP_AP_T_RESET;
        ok = f.h.stream == id && f.h.type == SP_AP_T_OK;
    }
    CHECK(ok && r_old && r_new);
    CHECK(tcp_connect(port2) < 0 && errno == ECONNREFUSED);
    int e1 = sock_end(c_old, 5000), e2 = sock_end(c_new, 5000);
    CHECK((e1 == 0 || e1 == -ECONNRESET) && (e2 == 0 || e2 == -ECONNRESET));
    CHECK(access(profile_path, F_OK) < 0);
    close(c_old);
    close(c_new);
    CHECK(configure((uint32_t)port, false) == 0);
}

/* ---- DNS ---- */

/* example.com A, id 0x1234, RD, with an EDNS OPT record. */
static const uint8_t dns_q[] = {0x12, 0x34, 0x01, 0x00, 0x00, 0x01, 0x00, 0x00, 0x00, 0x00,
                                0x00, 0x01, 7,    'e',  'x',  'a',  'm',  'p',  'l',  'e',
                                3,    'c',  'o',  'm',  0,    0x00, 0x01, 0x00, 0x01, 0x00,
                                0x00, 0x29, 0x10, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00};
#define DNS_Q_QEND 29 /* end of the question */

/* An answer as the host would send it, with a different id (the agent restores it). */
static size_t dns_answer(uint8_t *out)
{
    memcpy(out, dns_q, DNS_Q_QEND);
    out[0] = 0xbe;
    out[1] = 0xef;
    out[2] = 0x81;
    out[3] = 0x80;
    out[7] = 1;  /* ANCOUNT */
    out[11] = 0; /* ARCOUNT */
    const uint8_t rr[] = {0xc0, 0x0c, 0, 1, 0, 1, 0, 0, 0, 60, 0, 4, 93, 184, 215, 14};
    memcpy(out + DNS_Q_QEND, rr, sizeof(rr));
    return DNS_Q_QEND + sizeof(rr);
}

static int udp_client(void)
{
    int u = socket(AF_INET, SOCK_DGRAM | SOCK_CLOEXEC, 0);
    struct sockaddr_in sa = {.sin_family = AF_INET, .sin_port = htons((uint16_t)dns_port)};
    sa.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    REQUIRE(connect(u, (struct sockaddr *)&sa, sizeof(sa)) == 0);
    return u;
}

static uint32_t wait_query(void)
{
    frame_t f = wait_agent_frame(SP_AP_T_DNS_QUERY);
    sp_ap_field_t q;
    CHECK(sp_ap_find(f.p, f.h.len, SP_AP_K_QUERY, &q) == 1 && q.len == sizeof(dns_q) &&
          memcmp(q.val, dns_q, sizeof(dns_q)) == 0);
    return f.h.stream;
}

static void answer(uint32_t s)
{
    uint8_t a[128];
    size_t n = dns_answer(a);
    sp_ap_put_bytes(ah_begin(s, SP_AP_T_DNS_ANSWER, SP_AP_F_END), SP_AP_K_QUERY, a, n);
    ah_send_frame();
}

static bool is_answer(const uint8_t *m, ssize_t n)
{
    uint8_t want[128];
    size_t wn = dns_answer(want);
    want[0] = 0x12;
    want[1] = 0x34;
    return n == (ssize_t)wn && memcmp(m, want, wn) == 0;
}

static bool is_servfail(const uint8_t *m, ssize_t n)
{
    return n == DNS_Q_QEND && m[0] == 0x12 && m[1] == 0x34 && (m[2] & 0x80) && (m[3] & 0x0f) == 2 &&
           m[5] == 1 && m[7] == 0 && m[11] == 0 && memcmp(m + 12, dns_q + 12, DNS_Q_QEND - 12) == 0;
}

static ssize_t udp_recv(int u, uint8_t *buf, size_t cap, int timeout_ms)
{
    struct pollfd pf = {.fd = u, .events = POLLIN};
    if (poll(&pf, 1, timeout_ms) <= 0)
        return -1;
    return recv(u, buf, cap, 0);
}

static void test_egress_dns(int port)
{
    uint8_t buf[70000];
    CHECK(configure((uint32_t)port, true) == 0);
    /* UDP round trip. */
    int u = udp_client();
    CHECK(send(u, dns_q, sizeof(dns_q), 0) == (ssize_t)sizeof(dns_q));
    uint32_t s = wait_query();
    answer(s);
    ssize_t n = udp_recv(u, buf, sizeof(buf), 5000);
    CHECK(is_answer(buf, n));

    /* ERROR: SERVFAIL with the question, at once. */
    CHECK(send(u, dns_q, sizeof(dns_q), 0) == (ssize_t)sizeof(dns_q));
    s = wait_query();
    sp_ap_writer_init(&ah_w, ah_wbuf, sizeof(ah_wbuf));
    REQUIRE(sp_ap_enc_error(&ah_w, s, SP_AP_E_PERM, 0, "blocked") > 0);
    ah_write_all(ah_wbuf, ah_w.len);
    n = udp_recv(u, buf, sizeof(buf), 2000);
    CHECK(is_servfail(buf, n));

    /* No answer: SERVFAIL after 5 s, and the agent abandons the stream. */
    uint64_t t0 = now_ms();
    CHECK(send(u, dns_q, sizeof(dns_q), 0) == (ssize_t)sizeof(dns_q));
    s = wait_query();
    n = udp_recv(u, buf, sizeof(buf), 10000);
    uint64_t waited = now_ms() - t0;
    CHECK(is_servfail(buf, n));
    CHECK(waited >= 4900 && waited < 7000);
    fprintf(stderr, "dns: SERVFAIL after %llu ms without an answer\n", (unsigned long long)waited);
    frame_t f = ah_wait_on(s, true);
    CHECK(f.h.type == SP_AP_T_RESET);
    answer(s); /* late: dropped */

    /* Oversized and malformed datagrams: FORMERR or silence, never a crash. */
    memset(buf, 0, 5000);
    memcpy(buf, dns_q, sizeof(dns_q));
    CHECK(send(u, buf, 5000, 0) == 5000);
    n = udp_recv(u, buf, sizeof(buf), 2000);
    CHECK(n >= 12 && buf[0] == 0x12 && (buf[3] & 0x0f) == 1);
    CHECK(send(u, "\x01\x02\x03", 3, 0) == 3);
    ah_ping_ok();

    /* TCP: two pipelined length-prefixed queries, answered in reverse order. */
    int t = tcp_connect(dns_port);
    REQUIRE(t >= 0);
    uint8_t msg[2 + sizeof(dns_q)];
    msg[0] = 0;
    msg[1] = sizeof(dns_q);
    memcpy(msg + 2, dns_q, sizeof(dns_q));
    CHECK(send(t, msg, sizeof(msg), 0) == (ssize_t)sizeof(msg));
    CHECK(send(t, msg, sizeof(msg), 0) == (ssize_t)sizeof(msg));
    uint32_t s1 = wait_query(), s2 = wait_query();
    CHECK(s1 != s2);
    answer(s2);
    sp_ap_writer_init(&ah_w, ah_wbuf, sizeof(ah_wbuf));
    REQUIRE(sp_ap_enc_error(&ah_w, s1, SP_AP_E_UNAVAIL, 0, "upstream down") > 0);
    ah_write_all(ah_wbuf, ah_w.len);
    uint8_t lb[2];
    CHECK(sock_read(t, lb, 2, 5000) == 0);
    size_t l = (size_t)(lb[0] << 8 | lb[1]);
    CHECK(l < sizeof(buf) && sock_read(t, buf, l, 5000) == 0 && is_answer(buf, (ssize_t)l));
    CHECK(sock_read(t, lb, 2, 5000) == 0);
    l = (size_t)(lb[0] << 8 | lb[1]);
    CHECK(l < sizeof(buf) && sock_read(t, buf, l, 5000) == 0 && is_servfail(buf, (ssize_t)l));
    /* Client half-closes: the agent closes once nothing is in flight. */
    shutdown(t, SHUT_WR);
    CHECK(sock_end(t, 5000) == 0);
    close(t);
    close(u);
}

/* Host gone: open proxy connections are reset, new ones refused at once, DNS fails fast;
 * the listeners stay, and the next host's config brings service back. */
static void test_egress_disconnect(int port)
{
    uint32_t s;
    int c = proxy_client(port, &s);
    int u = udp_client();
    CHECK(send(u, dns_q, sizeof(dns_q), 0) == (ssize_t)sizeof(dns_q));
    wait_query();
    close(ah_fd);
    ah_fd = -1;
    int e = sock_end(c, 5000);
    CHECK(e == 0 || e == -ECONNRESET);
    close(c);
    uint8_t buf[512];
    ssize_t n = udp_recv(u, buf, sizeof(buf), 2000); /* the query in flight */
    CHECK(is_servfail(buf, n));
    usleep(100000);

    uint64_t t0 = now_ms();
    c = tcp_connect(port);
    CHECK(c >= 0);
    if (c >= 0) {
        e = sock_end(c, 2000);
        CHECK(e == 0 || e == -ECONNRESET);
        close(c);
    }
    CHECK(send(u, dns_q, sizeof(dns_q), 0) == (ssize_t)sizeof(dns_q));
    n = udp_recv(u, buf, sizeof(buf), 2000);
    CHECK(is_servfail(buf, n));
    CHECK(now_ms() - t0 < 1500);

    ah_connect(sock_path);
    CHECK(hello() & SP_AP_CAP_EGRESS);
    CHECK(configure((uint32_t)port, true) == 0);
    c = proxy_client(port, &s);
    ah_send_data(s, "back", 4);
    char b[4];
    CHECK(sock_read(c, b, 4, 5000) == 0 && memcmp(b, "back", 4) == 0);
    /* A new HELLO forgets the stream: the guest connection is reset. */
    CHECK(hello() & SP_AP_CAP_EGRESS);
    e = sock_end(c, 5000);
    CHECK(e == 0 || e == -ECONNRESET);
    close(c);
    close(u);
    CHECK(configure((uint32_t)port, true) == 0);
}

/* Without the test override, DNS=1 on a host must not bind port 53. */
static void test_egress_host_mode_dns_refused(void)
{
    char sock2[100];
    snprintf(sock2, sizeof(sock2), "%s/agent2.sock", tmpdir);
    unsetenv("SP_AGENT_EGRESS_DNS_PORT");
    pid_t p2 = ah_spawn_agent(sock2, NULL);
    int keep = ah_fd;
    char keep_path[sizeof(sock_path)];
    memcpy(keep_path, sock_path, sizeof(sock_path));
    snprintf(sock_path, sizeof(sock_path), "%s", sock2);
    ah_fd = -1;
    ah_connect(sock_path);
    hello();
    CHECK(configure(0, true) == SP_AP_E_UNAVAIL);
    close(ah_fd);
    kill(p2, SIGTERM);
    waitpid(p2, NULL, 0);
    ah_fd = keep;
    memcpy(sock_path, keep_path, sizeof(sock_path));
}

int main(void)
{
    ah_prepare("sp-egress-test", tmpdir, sizeof(tmpdir), sock_path, sizeof(sock_path));
    snprintf(resolv_path, sizeof(resolv_path), "%s/resolv.conf", tmpdir);
    snprintf(profile_path, sizeof(profile_path), "%s/profile.d/space-egress.sh", tmpdir);
    dns_port = test_free_port();
    REQUIRE(dns_port > 0);
    char dp[16];
    snprintf(dp, sizeof(dp), "%d", dns_port);
    setenv("SP_AGENT_EGRESS_DNS_PORT", dp, 1);
    setenv("SP_AGENT_EGRESS_RESOLV_CONF", resolv_path, 1);
    setenv("SP_AGENT_EGRESS_PROFILE", profile_path, 1);
    ah_agent_pid = ah_spawn_agent(sock_path, NULL);
    atexit(kill_agent); /* REQUIRE exits early */
    ah_connect(sock_path);

    int port = test_free_port();
    REQUIRE(port > 0);
    test_egress_caps_and_bad_config();
    int fds0 = agent_fds();
    test_egress_files_and_env(port);
    test_egress_proxy_roundtrip(port);
    test_egress_bulk(port);
    test_egress_many(port);
    test_egress_cap(port);
    test_egress_dns(port);
    test_egress_disconnect(port);
    test_egress_reconfigure(port);
    test_egress_open_window(port);
    CHECK(configure(0, false) == 0);
    int fds1 = agent_fds_settle(fds0);
    fprintf(stderr, "agent fds: %d before, %d after\n", fds0, fds1);
    CHECK(fds1 == fds0);
    if (fds1 != fds0)
        dump_agent_fds();
    test_egress_host_mode_dns_refused();
    CHECK(ah_agent_alive());

    kill(ah_agent_pid, SIGTERM);
    waitpid(ah_agent_pid, NULL, 0);
    ah_agent_pid = 0;
    char cmd[200];
    snprintf(cmd, sizeof(cmd), "rm -rf '%s'", tmpdir);
    if (system(cmd) != 0)
        fprintf(stderr, "cleanup failed\n");
    return check_report("egress");
}
