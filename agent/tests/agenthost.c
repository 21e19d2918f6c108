/*
 * agenthost.c - the host end of the agent protocol for the agent's tests (agenthost.h).
 */
#include "agent/tests/agenthost.h"

#include <errno.h>
#include <poll.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include "tests/check.h"

int ah_fd = -1;
uint32_t ah_next_stream = 1;
pid_t ah_agent_pid;
sp_ap_writer_t ah_w;
uint8_t ah_wbuf[SP_AP_MAX_FRAME + 64];

void ah_write_all(const void *p, size_t n)
{
    const uint8_t *b = p;
    while (n > 0) {
        ssize_t w = write(ah_fd, b, n);
        if (w < 0 && errno == EINTR)
            continue;
        REQUIRE(w > 0);
        b += w;
        n -= (size_t)w;
    }
}

int ah_read_full(void *p, size_t n, int timeout_ms)
{
    uint8_t *b = p;
    while (n > 0) {
        struct pollfd pf = {.fd = ah_fd, .events = POLLIN};
        if (poll(&pf, 1, timeout_ms) <= 0)
            return -1;
        ssize_t r = read(ah_fd, b, n);
        if (r <= 0)
            return -1;
        b += r;
        n -= (size_t)r;
    }
    return 0;
}

int ah_recv_frame(frame_t *f, int timeout_ms)
{
    static uint8_t buf[SP_AP_MAX_FRAME];
    uint8_t hdr[SP_AP_HDR_SIZE];
    if (ah_read_full(hdr, sizeof(hdr), timeout_ms) < 0)
        return -1;
    sp_ap_hdr_decode(hdr, &f->h);
    REQUIRE(sp_ap_hdr_check(&f->h, NULL) == 0);
    REQUIRE(ah_read_full(buf, f->h.len, timeout_ms > 10000 ? timeout_ms : 10000) == 0);
    f->p = buf;
    return 0;
}

frame_t ah_wait_on(uint32_t stream, bool skip_window)
{
    frame_t f;
    for (;;) {
        if (ah_recv_frame(&f, 15000) < 0) {
            fprintf(stderr, "timeout or EOF waiting on stream %u\n", stream);
            exit(1);
        }
        if (f.h.stream == stream && !(skip_window && f.h.type == SP_AP_T_WINDOW))
            return f;
    }
}

sp_ap_writer_t *ah_begin(uint32_t stream, uint16_t type, uint16_t flags)
{
    sp_ap_writer_init(&ah_w, ah_wbuf, sizeof(ah_wbuf));
    sp_ap_frame_begin(&ah_w, stream, type, flags);
    return &ah_w;
}

void ah_send_frame(void)
{
    long n = sp_ap_frame_end(&ah_w);
    REQUIRE(n > 0);
    ah_write_all(ah_wbuf, (size_t)n);
}

void ah_send_empty(uint32_t stream, uint16_t type, uint16_t flags)
{
    ah_begin(stream, type, flags);
    ah_send_frame();
}

void ah_send_data(uint32_t stream, const void *p, size_t n)
{
    sp_ap_put_raw(ah_begin(stream, SP_AP_T_DATA, 0), p, n);
    ah_send_frame();
}

void ah_grant(uint32_t stream, uint32_t n)
{
    sp_ap_put_u32(ah_begin(stream, SP_AP_T_WINDOW, 0), SP_AP_K_WINDOW, n);
    ah_send_frame();
}

uint32_t ah_u32_of(const frame_t *f, uint16_t tag, uint32_t dflt)
{
    uint32_t v = dflt;
    REQUIRE(sp_ap_get_u32(f->p, f->h.len, tag, &v) == 0);
    return v;
}

uint32_t ah_err_code(const frame_t *f)
{
    return f->h.type == SP_AP_T_ERROR ? ah_u32_of(f, SP_AP_K_CODE, 0) : 0;
}

void ah_ping_ok(void)
{
    sp_ap_put_raw(ah_begin(0, SP_AP_T_PING, 0), "z", 1);
    ah_send_frame();
    frame_t f = ah_wait_on(0, true);
    CHECK(f.h.type == SP_AP_T_PONG);
}

void ah_prepare(const char *prefix, char *dir, size_t dn, char *sock, size_t sn)
{
    if (getenv("SP_AGENT_BIN") == NULL) {
        fprintf(stderr, "skip: SP_AGENT_BIN not set\n");
        exit(77);
    }
    signal(SIGPIPE, SIG_IGN);
    snprintf(dir, dn, "/tmp/%s-XXXXXX", prefix);
    REQUIRE(mkdtemp(dir) != NULL);
    chmod(dir, 0755);
    snprintf(sock, sn, "%s/agent.sock", dir);
}

pid_t ah_spawn_agent(const char *sock, const char *env_file)
{
    const char *bin = getenv("SP_AGENT_BIN");
    REQUIRE(bin != NULL);
    pid_t pid = fork();
    if (pid == 0) {
        prctl(PR_SET_PDEATHSIG, SIGKILL);
        if (env_file != NULL)
            execl(bin, bin, "--listen-unix", sock, "--log-level", "warn", "--env-file", env_file,
                  (char *)NULL);
        else
            execl(bin, bin, "--listen-unix", sock, "--log-level", "warn", (char *)NULL);
        _exit(127);
    }
    return pid;
}

void ah_connect(const char *sock_path)
{
    if (ah_fd >= 0)
        close(ah_fd);
    struct sockaddr_un sa = {.sun_family = AF_UNIX};
    snprintf(sa.sun_path, sizeof(sa.sun_path), "%s", sock_path);
    for (int i = 0; i < 250; i++) {
        ah_fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
        if (connect(ah_fd, (struct sockaddr *)&sa, sizeof(sa)) == 0)
            return;
        close(ah_fd);
        ah_fd = -1;
        usleep(20000);
    }
    REQUIRE(!"cannot connect to the agent");
}

bool ah_agent_alive(void)
{
    return ah_agent_pid > 0 && waitpid(ah_agent_pid, NULL, WNOHANG) == 0;
}

long ah_agent_rss_kb(void)
{
    char path[64], line[256];
    snprintf(path, sizeof(path), "/proc/%d/status", (int)ah_agent_pid);
    FILE *f = fopen(path, "r");
    long kb = -1;
    while (f != NULL && fgets(line, sizeof(line), f) != NULL)
        if (sscanf(line, "VmRSS: %ld", &kb) == 1)
            break;
    if (f != NULL)
        fclose(f);
    return kb;
}
