/*
 * test_agentproto.c - unit tests for the agent protocol codec.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "base/agentproto.h"
#include "tests/check.h"

static uint8_t big[SP_AP_MAX_FRAME + 4096];

static sp_ap_str_t S(const char *s)
{
    return (sp_ap_str_t){s, (uint32_t)strlen(s)};
}

static bool sv_eq(sp_ap_str_t a, const char *b)
{
    return a.p != NULL && a.n == strlen(b) && memcmp(a.p, b, a.n) == 0;
}

static void test_agentproto_header_roundtrip(void)
{
    uint8_t b[SP_AP_HDR_SIZE];
    sp_ap_hdr_t h = {.len = 0x01020304, .stream = 0xa0b0c0d0, .type = 0x0102, .flags = 1}, g;
    sp_ap_hdr_encode(b, &h);
    CHECK(b[0] == 0x04 && b[3] == 0x01 && b[4] == 0xd0 && b[8] == 0x02 && b[10] == 1);
    sp_ap_hdr_decode(b, &g);
    CHECK(g.len == h.len && g.stream == h.stream && g.type == h.type && g.flags == h.flags);
    CHECK(sp_ap_hdr_check(&g, NULL) < 0); /* len too big */
    g.len = SP_AP_MAX_PAYLOAD;
    CHECK(sp_ap_hdr_check(&g, NULL) == 0);
    g.flags = 0x8000;
    sp_err_t err;
    CHECK(sp_ap_hdr_check(&g, &err) < 0 && err.code == SP_EINVAL);
}

static void test_agentproto_proc_start_roundtrip(void)
{
    static sp_ap_proc_start_t m, d;
    memset(&m, 0, sizeof(m));
    m.argv[0] = S("ls");
    m.argv[1] = S("-l");
    m.argv[2] = S("");
    m.argc = 3;
    m.env[0] = S("A=1");
    m.envc = 1;
    m.cwd = S("/tmp");
    m.user = S("user");
    m.tag = S("t1");
    m.pty = true;
    m.rows = 24;
    m.cols = 80;
    m.stdin_pipe = false;
    sp_ap_writer_t w;
    sp_ap_writer_init(&w, big, sizeof(big));
    long n = sp_ap_enc_proc_start(&w, 7, &m);
    CHECK(n > (long)SP_AP_HDR_SIZE);
    sp_ap_hdr_t h;
    sp_ap_hdr_decode(big, &h);
    CHECK(h.type == SP_AP_T_PROC_START && h.stream == 7 && h.len == n - SP_AP_HDR_SIZE);
    sp_err_t err;
    CHECK(sp_ap_dec_proc_start(big + SP_AP_HDR_SIZE, h.len, &d, &err) == 0);
    CHECK(d.argc == 3 && sv_eq(d.argv[0], "ls") && sv_eq(d.argv[1], "-l") && d.argv[2].n == 0);
    CHECK(d.envc == 1 && sv_eq(d.env[0], "A=1") && sv_eq(d.cwd, "/tmp"));
    CHECK(sv_eq(d.user, "user") && sv_eq(d.tag, "t1") && d.pty && d.rows == 24 && d.cols == 80);
    CHECK(!d.stdin_pipe && d.cmd.p == NULL);
}

static void test_agentproto_proc_start_rules(void)
{
    static sp_ap_proc_start_t d;
    uint8_t buf[256];
    sp_ap_writer_t w;
    sp_err_t err;
    /* neither argv nor cmd */
    sp_ap_writer_init(&w, buf, sizeof(buf));
    sp_ap_put_str(&w, SP_AP_K_CWD, "/");
    CHECK(sp_ap_dec_proc_start(buf, w.len, &d, &err) < 0 && err.code == SP_EINVAL);
    /* both */
    sp_ap_writer_init(&w, buf, sizeof(buf));
    sp_ap_put_str(&w, SP_AP_K_CMD, "ls");
    sp_ap_put_str(&w, SP_AP_K_ARGV, "ls");
    CHECK(sp_ap_dec_proc_start(buf, w.len, &d, &err) < 0);
    /* a NUL inside a string */
    sp_ap_writer_init(&w, buf, sizeof(buf));
    sp_ap_put_bytes(&w, SP_AP_K_CMD, "l\0s", 3);
    CHECK(sp_ap_dec_proc_start(buf, w.len, &d, &err) < 0);
    /* wrong integer width */
    sp_ap_writer_init(&w, buf, sizeof(buf));
    sp_ap_put_str(&w, SP_AP_K_CMD, "ls");
    sp_ap_put_u64(&w, SP_AP_K_PTY, 1);
    CHECK(sp_ap_dec_proc_start(buf, w.len, &d, &err) < 0);
    /* unknown tags are skipped; stdin defaults to a pipe */
    sp_ap_writer_init(&w, buf, sizeof(buf));
    sp_ap_put_u32(&w, 999, 5);
    sp_ap_put_str(&w, SP_AP_K_CMD, "ls");
    CHECK(sp_ap_dec_proc_start(buf, w.len, &d, &err) == 0 && sv_eq(d.cmd, "ls") && d.stdin_pipe);
    /* too many argv */
    sp_ap_writer_init(&w, big, sizeof(big));
    for (int i = 0; i <= SP_AP_MAX_ARGV; i++)
        sp_ap_put_str(&w, SP_AP_K_ARGV, "x");
    CHECK(sp_ap_dec_proc_start(big, w.len, &d, &err) < 0);
}

static void test_agentproto_truncated_fields(void)
{
    uint8_t buf[64];
    sp_ap_writer_t w;
    sp_ap_writer_init(&w, buf, sizeof(buf));
    sp_ap_put_str(&w, SP_AP_K_PATH, "/etc/passwd");
    CHECK(sp_ap_fields_check(buf, w.len) == 0);
    for (size_t cut = 1; cut < w.len; cut++)
        CHECK(sp_ap_fields_check(buf, cut) < 0);
    sp_ap_str_t s;
    CHECK(sp_ap_get_str(buf, w.len - 1, SP_AP_K_PATH, &s) < 0);
    /* length field pointing past the end */
    uint8_t bad[] = {40, 0, 0xff, 0xff, 0xff, 0xff, 'a'};
    CHECK(sp_ap_fields_check(bad, sizeof(bad)) < 0);
    sp_ap_field_t f;
    CHECK(sp_ap_find(bad, sizeof(bad), 40, &f) < 0);
    /* empty payload is fine and has no fields */
    CHECK(sp_ap_fields_check(buf, 0) == 0 && sp_ap_find(buf, 0, 40, &f) == 0);
    char out[4];
    sp_ap_field_t longf = {.tag = 1, .len = 4, .val = (const uint8_t *)"abcd"};
    CHECK(sp_ap_field_str(&longf, out, sizeof(out)) < 0); /* no room for the NUL */
}

static void test_agentproto_reader_split_and_oversize(void)
{
    static uint8_t rbuf[SP_AP_MAX_FRAME];
    uint8_t wire[256];
    sp_ap_writer_t w;
    sp_ap_writer_init(&w, wire, sizeof(wire));
    sp_ap_frame_begin(&w, 0, SP_AP_T_PING, 0);
    sp_ap_put_raw(&w, "abc", 3);
    CHECK(sp_ap_frame_end(&w) == SP_AP_HDR_SIZE + 3);
    sp_ap_frame_begin(&w, 5, SP_AP_T_FS_STAT, 0);
    sp_ap_put_str(&w, SP_AP_K_PATH, "/x");
    CHECK(sp_ap_frame_end(&w) > 0);
    size_t total = w.len;

    /* byte-at-a-time delivery yields both frames intact */
    sp_ap_reader_t r;
    sp_ap_reader_init(&r, rbuf, sizeof(rbuf));
    int frames = 0;
    for (size_t i = 0; i < total; i++) {
        size_t avail;
        uint8_t *dst = sp_ap_reader_space(&r, &avail);
        *dst = wire[i];
        sp_ap_reader_commit(&r, 1);
        sp_ap_hdr_t h;
        const uint8_t *p;
        sp_ap_rd_result_t rc;
        while ((rc = sp_ap_reader_next(&r, &h, &p)) != SP_AP_RD_NEED) {
            CHECK(rc == SP_AP_RD_FRAME);
            if (frames == 0)
                CHECK(h.type == SP_AP_T_PING && h.len == 3 && memcmp(p, "abc", 3) == 0);
            else
                CHECK(h.stream == 5 && h.type == SP_AP_T_FS_STAT);
            frames++;
        }
    }
    CHECK(frames == 2);

    /* oversize header: reported, its payload skipped, next frame intact */
    sp_ap_reader_reset(&r);
    sp_ap_hdr_t oh = {.len = SP_AP_MAX_PAYLOAD + 10, .stream = 9, .type = SP_AP_T_DATA};
    size_t avail;
    uint8_t *dst = sp_ap_reader_space(&r, &avail);
    sp_ap_hdr_encode(dst, &oh);
    sp_ap_reader_commit(&r, SP_AP_HDR_SIZE);
    sp_ap_hdr_t h;
    const uint8_t *p;
    CHECK(sp_ap_reader_next(&r, &h, &p) == SP_AP_RD_OVERSIZE && h.stream == 9);
    size_t left = oh.len;
    while (left > 0) {
        dst = sp_ap_reader_space(&r, &avail);
        size_t k = left < avail ? left : avail;
        memset(dst, 0xee, k);
        sp_ap_reader_commit(&r, k);
        left -= k;
        CHECK(sp_ap_reader_next(&r, &h, &p) == SP_AP_RD_NEED);
    }
    dst = sp_ap_reader_space(&r, &avail);
    memcpy(dst, wire, total);
    sp_ap_reader_commit(&r, total);
    CHECK(sp_ap_reader_next(&r, &h, &p) == SP_AP_RD_FRAME && h.type == SP_AP_T_PING);
    CHECK(sp_ap_reader_next(&r, &h, &p) == SP_AP_RD_FRAME && h.stream == 5);
    CHECK(sp_ap_reader_next(&r, &h, &p) == SP_AP_RD_NEED);

    /* a maximal frame fits the buffer exactly */
    sp_ap_reader_reset(&r);
    dst = sp_ap_reader_space(&r, &avail);
    CHECK(avail == SP_AP_MAX_FRAME);
    sp_ap_hdr_t mh = {.len = SP_AP_MAX_PAYLOAD, .stream = 1, .type = SP_AP_T_DATA};
    sp_ap_hdr_encode(dst, &mh);
    sp_ap_reader_commit(&r, SP_AP_MAX_FRAME);
    CHECK(sp_ap_reader_next(&r, &h, &p) == SP_AP_RD_FRAME && h.len == SP_AP_MAX_PAYLOAD);
}

static void test_agentproto_stream_rules(void)
{
    uint32_t code;
    CHECK(sp_ap_check_from_host(SP_AP_T_HELLO, 0, &code) == 0);
    CHECK(sp_ap_check_from_host(SP_AP_T_PING, 0, &code) == 0);
    CHECK(sp_ap_check_from_host(SP_AP_T_HELLO, 3, &code) < 0 && code == SP_AP_E_PROTO);
    CHECK(sp_ap_check_from_host(SP_AP_T_PROC_START, 0, &code) < 0 && code == SP_AP_E_PROTO);
    CHECK(sp_ap_check_from_host(SP_AP_T_PROC_START, 1, &code) == 0);
    CHECK(sp_ap_check_from_host(SP_AP_T_PROC_START, SP_AP_STREAM_AGENT_BASE, &code) < 0);
    CHECK(sp_ap_check_from_host(SP_AP_T_PROC_STDOUT, 1, &code) < 0 && code == SP_AP_E_TYPE);
    CHECK(sp_ap_check_from_host(0x7777, 1, &code) < 0 && code == SP_AP_E_TYPE);
    CHECK(sp_ap_check_from_host(0, 1, &code) < 0 && code == SP_AP_E_TYPE);
    CHECK(sp_ap_type_opens(SP_AP_T_FS_WRITE) && !sp_ap_type_opens(SP_AP_T_DATA));
    CHECK(strcmp(sp_ap_type_name(SP_AP_T_TCP_CONNECT), "tcp_connect") == 0);
    CHECK(strcmp(sp_ap_type_name(0x7777), "unknown") == 0);
}

/* Agent-opened streams: the host ends them (OK, ERROR, DNS_ANSWER), never opens there. */
static void test_agentproto_egress_stream_rules(void)
{
    uint32_t code, a = SP_AP_STREAM_AGENT_BASE + 5;
    CHECK(sp_ap_check_from_host(SP_AP_T_EGRESS_CONFIG, 1, &code) == 0);
    CHECK(sp_ap_check_from_host(SP_AP_T_EGRESS_CONFIG, a, &code) < 0 && code == SP_AP_E_PROTO);
    CHECK(sp_ap_check_from_host(SP_AP_T_EGRESS_CONFIG, 0, &code) < 0 && code == SP_AP_E_PROTO);
    CHECK(sp_ap_check_from_host(SP_AP_T_OK, a, &code) == 0);
    CHECK(sp_ap_check_from_host(SP_AP_T_ERROR, a, &code) == 0);
    CHECK(sp_ap_check_from_host(SP_AP_T_DNS_ANSWER, a, &code) == 0);
    CHECK(sp_ap_check_from_host(SP_AP_T_DATA, a, &code) == 0);
    CHECK(sp_ap_check_from_host(SP_AP_T_EOF, a, &code) == 0);
    CHECK(sp_ap_check_from_host(SP_AP_T_WINDOW, a, &code) == 0);
    CHECK(sp_ap_check_from_host(SP_AP_T_RESET, a, &code) == 0);
    /* ...but not on its own streams, nor control on stream 0 */
    CHECK(sp_ap_check_from_host(SP_AP_T_OK, 1, &code) < 0 && code == SP_AP_E_TYPE);
    CHECK(sp_ap_check_from_host(SP_AP_T_DNS_ANSWER, 1, &code) < 0 && code == SP_AP_E_TYPE);
    CHECK(sp_ap_check_from_host(SP_AP_T_ERROR, 0, &code) < 0);
    CHECK(sp_ap_check_from_host(SP_AP_T_EGRESS_OPEN, 1, &code) < 0 && code == SP_AP_E_TYPE);
    CHECK(sp_ap_check_from_host(SP_AP_T_DNS_QUERY, a, &code) < 0);
    CHECK(sp_ap_type_opens(SP_AP_T_EGRESS_OPEN) && sp_ap_type_opens(SP_AP_T_DNS_QUERY));
    CHECK(!sp_ap_type_opens(SP_AP_T_DNS_ANSWER));
    CHECK(strcmp(sp_ap_type_name(SP_AP_T_DNS_QUERY), "dns_query") == 0);
}

static void test_agentproto_egress_config(void)
{
    static uint8_t buf[8192];
    static sp_ap_egress_config_t m, g;
    sp_ap_writer_t w;
    sp_err_t err;
    m.proxy_port = 3128;
    m.dns = true;
    m.env[0] = S("HTTP_PROXY=http://127.0.0.1:3128");
    m.env[1] = S("NO_PROXY=localhost");
    m.envc = 2;
    sp_ap_writer_init(&w, buf, sizeof(buf));
    CHECK(sp_ap_enc_egress_config(&w, 9, &m) > 0);
    sp_ap_hdr_t h;
    sp_ap_hdr_decode(buf, &h);
    CHECK(h.type == SP_AP_T_EGRESS_CONFIG && h.stream == 9);
    CHECK(sp_ap_dec_egress_config(buf + SP_AP_HDR_SIZE, h.len, &g, &err) == 0);
    CHECK(g.proxy_port == 3128 && g.dns && g.envc == 2);
    CHECK(sv_eq(g.env[0], "HTTP_PROXY=http://127.0.0.1:3128") && sv_eq(g.env[1], "NO_PROXY=localhost"));
    /* empty payload: everything off */
    CHECK(sp_ap_dec_egress_config(buf, 0, &g, &err) == 0 && g.proxy_port == 0 && !g.dns);
    /* rejections */
    const struct {
        const char *p;
        size_t n;
    } bad[] = {
        {"\x5a\x00\x04\x00\x00\x00\x00\x00\x01\x00", 10}, /* port 65536 */
        {"\x5a\x00\x02\x00\x00\x00\x50\x00", 8},             /* port not u32 */
        {"\x5b\x00\x04\x00\x00\x00\x02\x00\x00\x00", 10}, /* dns 2 */
        {"\x16\x00\x01\x00\x00\x00" "A", 7},                   /* env without '=' */
        {"\x16\x00\x02\x00\x00\x00" "=v", 8},                  /* empty key */
        {"\x16\x00\x00\x00\x00\x00", 6},                       /* empty env */
        {"\x16\x00\x05\x00\x00\x00" "A=b", 9},                 /* truncated */
    };
    for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++)
        CHECK(sp_ap_dec_egress_config((const uint8_t *)bad[i].p, bad[i].n, &g, &err) < 0 &&
              err.code == SP_EINVAL);
    /* too many ENV entries */
    sp_ap_writer_init(&w, buf, sizeof(buf));
    sp_ap_frame_begin(&w, 1, SP_AP_T_EGRESS_CONFIG, 0);
    for (int i = 0; i < SP_AP_MAX_ENV + 1; i++)
        sp_ap_put_str(&w, SP_AP_K_ENV, "K=v");
    long n = sp_ap_frame_end(&w);
    CHECK(n > 0 && sp_ap_dec_egress_config(buf + SP_AP_HDR_SIZE, (size_t)n - SP_AP_HDR_SIZE, &g,
                                           &err) < 0);
}

static void test_agentproto_writer_overflow(void)
{
    uint8_t buf[20];
    sp_ap_writer_t w;
    sp_ap_writer_init(&w, buf, sizeof(buf));
    sp_ap_frame_begin(&w, 1, SP_AP_T_OK, SP_AP_F_END);
    sp_ap_put_str(&w, SP_AP_K_MSG, "this does not fit in twenty bytes");
    CHECK(w.overflow && sp_ap_frame_end(&w) == -1 && w.len == 0);
    /* payloads over the maximum are refused even with room */
    sp_ap_writer_init(&w, big, sizeof(big));
    sp_ap_frame_begin(&w, 1, SP_AP_T_DATA, 0);
    static uint8_t src[SP_AP_MAX_PAYLOAD + 1];
    sp_ap_put_raw(&w, src, sizeof(src));
    CHECK(sp_ap_frame_end(&w) == -1);
}

static void test_agentproto_messages_roundtrip(void)
{
    uint8_t buf[1024];
    sp_ap_writer_t w;
    sp_ap_hdr_t h;
    sp_err_t err;

    sp_ap_writer_init(&w, buf, sizeof(buf));
    CHECK(sp_ap_enc_error(&w, 4, SP_AP_E_PERM, 13, "denied") > 0);
    sp_ap_hdr_decode(buf, &h);
    CHECK(h.type == SP_AP_T_ERROR && (h.flags & SP_AP_F_END));
    sp_ap_error_t e;
    CHECK(sp_ap_dec_error(buf + SP_AP_HDR_SIZE, h.len, &e, &err) == 0);
    CHECK(e.code == SP_AP_E_PERM && e.sys_errno == 13 && sv_eq(e.msg, "denied"));

    sp_ap_writer_init(&w, buf, sizeof(buf));
    sp_ap_hello_t hi = {.version = 1, .agent_version = S("0.1"), .caps = 5, .boot_ns = 42};
    CHECK(sp_ap_enc_hello(&w, &hi) > 0);
    sp_ap_hdr_decode(buf, &h);
    sp_ap_hello_t hd;
    CHECK(h.stream == 0 && sp_ap_dec_hello(buf + SP_AP_HDR_SIZE, h.len, &hd, &err) == 0);
    CHECK(hd.version == 1 && sv_eq(hd.agent_version, "0.1") && hd.caps == 5 && hd.boot_ns == 42);
    CHECK(sp_ap_dec_hello(buf, 0, &hd, &err) < 0); /* version is required */

    static sp_ap_identity_t id, idd;
    memset(&id, 0, sizeof(id));
    id.hostname = S("box");
    id.sandbox_id = S("sb1");
    id.env[0] = S("K=V");
    id.envc = 1;
    id.seed = (sp_ap_str_t){"\0\1\2", 3};
    id.time_ns = 1700000000123456789ull;
    sp_ap_writer_init(&w, buf, sizeof(buf));
    CHECK(sp_ap_enc_identity(&w, 3, &id) > 0);
    sp_ap_hdr_decode(buf, &h);
    CHECK(sp_ap_dec_identity(buf + SP_AP_HDR_SIZE, h.len, &idd, &err) == 0);
    CHECK(sv_eq(idd.hostname, "box") && sv_eq(idd.sandbox_id, "sb1") && idd.envc == 1);
    CHECK(idd.seed.n == 3 && memcmp(idd.seed.p, "\0\1\2", 3) == 0);
    CHECK(idd.time_ns == id.time_ns);

    sp_ap_entry_t en = {.path = S("/a/b"), .name = S("b"), .ftype = SP_AP_FT_FILE, .size = 1ull << 40,
                        .mode = 0644, .uid = 1000, .gid = 100, .owner = S("u"), .group = S("g"),
                        .mtime_ns = 99},
                  ed;
    sp_ap_writer_init(&w, buf, sizeof(buf));
    sp_ap_put_entry(&w, &en);
    CHECK(sp_ap_dec_entry(buf, w.len, &ed, &err) == 0);
    CHECK(sv_eq(ed.path, "/a/b") && ed.size == 1ull << 40 && ed.mode == 0644 && ed.uid == 1000);
    CHECK(ed.link.p == NULL && sv_eq(ed.group, "g") && ed.mtime_ns == 99);
}

int main(void)
{
    test_agentproto_header_roundtrip();
    test_agentproto_proc_start_roundtrip();
    test_agentproto_proc_start_rules();
    test_agentproto_truncated_fields();
    test_agentproto_reader_split_and_oversize();
    test_agentproto_stream_rules();
    test_agentproto_egress_stream_rules();
    test_agentproto_egress_config();
    test_agentproto_writer_overflow();
    test_agentproto_messages_roundtrip();
    return check_report("agentproto");
}
