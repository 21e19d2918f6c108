/*
 * test_connectrpc.c - the Connect pieces without a network: envelopes, both codecs for every
 * message (round trips and known encodings), error codes, header parsing, hostile inputs.
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "e2b-gateway/connectrpc.h"
#include "tests/check.h"

static sp_carena_t A;

/* encode(m) == encode(decode(encode(m))) in codec k; returns the first encoding (malloc'd). */
static sp_buf_t round_trip(sp_connect_codec_t k, const sp_cdesc_t *d, const void *m)
{
    sp_buf_t a = {0}, b = {0};
    CHECK(sp_connect_encode(k, d, m, &a) == 0);
    void *back = calloc(1, d->size);
    sp_err_t err;
    int rc = sp_connect_decode(k, d, a.p, a.len, back, &A, &err);
    if (rc < 0)
        fprintf(stderr, "decode %s: %s\n", d->name, err.msg);
    CHECK(rc == 0);
    CHECK(sp_connect_encode(k, d, back, &b) == 0);
    CHECK(a.len == b.len && (a.len == 0 || memcmp(a.p, b.p, a.len) == 0));
    if (a.len != b.len || (a.len && memcmp(a.p, b.p, a.len) != 0))
        fprintf(stderr, "%s: %.*s != %.*s\n", d->name, (int)a.len, (char *)a.p, (int)b.len,
                (char *)b.p);
    free(back);
    sp_buf_free(&b);
    return a;
}

static void both(const sp_cdesc_t *d, const void *m)
{
    sp_buf_t j = round_trip(SP_CONNECT_JSON, d, m);
    sp_buf_t p = round_trip(SP_CONNECT_PROTO, d, m);
    sp_buf_free(&j);
    sp_buf_free(&p);
}

static bool json_is(const sp_cdesc_t *d, const void *m, const char *want)
{
    sp_buf_t b = {0};
    sp_connect_encode(SP_CONNECT_JSON, d, m, &b);
    bool ok = b.len == strlen(want) && memcmp(b.p, want, b.len) == 0;
    if (!ok)
        fprintf(stderr, "got %.*s want %s\n", (int)b.len, (char *)b.p, want);
    sp_buf_free(&b);
    return ok;
}

static bool proto_is(const sp_cdesc_t *d, const void *m, const uint8_t *want, size_t n)
{
    sp_buf_t b = {0};
    sp_connect_encode(SP_CONNECT_PROTO, d, m, &b);
    bool ok = b.len == n && memcmp(b.p, want, n) == 0;
    sp_buf_free(&b);
    return ok;
}

static void test_connectrpc_round_trip_every_message(void)
{
    const char *args[] = {"-l", "-c", "echo hi"};
    sp_ckv_t envs[] = {{"A", "1"}, {"LANG", "C.UTF-8"}};
    sp_cp_config_t cfg = {.cmd = "/bin/bash",
                          .args = args,
                          .n_args = 3,
                          .envs = envs,
                          .n_envs = 2,
                          .cwd = "/tmp",
                          .has_cwd = true};
    sp_cp_start_req_t st = {.process = cfg,
                            .has_process = true,
                            .has_pty = true,
                            .pty = {.has_size = true, .size = {80, 24}},
                            .tag = "t1",
                            .has_tag = true,
                            .stdin_open = false,
                            .has_stdin = true};
    both(&sp_cd_start_req, &st);
    sp_cp_select_req_t sel = {.has_process = true, .process = {.pid = 412, .has_pid = true}};
    both(&sp_cd_select_req, &sel);
    sp_cp_select_req_t selt = {.has_process = true, .process = {.tag = "x", .has_tag = true}};
    both(&sp_cd_select_req, &selt);
    sp_cp_update_req_t up = {.has_process = true,
                             .process = {.pid = 1, .has_pid = true},
                             .has_pty = true,
                             .pty = {.has_size = true, .size = {100, 40}}};
    both(&sp_cd_update_req, &up);
    static const uint8_t bin[] = {0, 1, 2, 0xff, '\r', '\n', '-', '-'};
    sp_cp_send_input_req_t in = {.has_process = true,
                                 .process = {.pid = 7, .has_pid = true},
                                 .has_input = true,
                                 .input = {.stdin_data = {bin, sizeof(bin)}, .has_stdin = true}};
    both(&sp_cd_send_input_req, &in);
    sp_cp_send_signal_req_t sig = {.has_process = true,
                                   .process = {.pid = 7, .has_pid = true},
                                   .signal = SP_CP_SIGNAL_SIGKILL};
    both(&sp_cd_send_signal_req, &sig);
    sp_cp_stream_input_req_t si = {.has_data = true};
    si.data.has_input = true;
    si.data.input.pty = (sp_cbytes_t){bin, 3};
    si.data.input.has_pty = true;
    both(&sp_cd_stream_input_req, &si);
    sp_cp_stream_input_req_t si2 = {.has_start = true, .start = sel, .has_keepalive = false};
    both(&sp_cd_stream_input_req, &si2);
    sp_cp_event_resp_t evs[4] = {
        {.has_event = true}, {.has_event = true}, {.has_event = true}, {.has_event = true}};
    evs[0].event.has_start = true;
    evs[0].event.start.pid = 412;
    evs[1].event.has_data = true;
    evs[1].event.data.out = (sp_cbytes_t){(const uint8_t *)"hi\n", 3};
    evs[1].event.data.has_out = true;
    evs[2].event.has_end = true;
    evs[2].event.end = (sp_cp_end_ev_t){.exit_code = -1,
                                        .exited = false,
                                        .status = "signal: killed",
                                        .error = "e",
                                        .has_error = true};
    evs[3].event.has_keepalive = true;
    for (int i = 0; i < 4; i++)
        both(&sp_cd_event_resp, &evs[i]);
    sp_cp_info_t infos[2] = {
        {.config = cfg, .has_config = true, .pid = 5, .tag = "a", .has_tag = true}, {.pid = 6}};
    sp_cp_list_resp_t lr = {.processes = infos, .n_processes = 2};
    both(&sp_cd_list_resp, &lr);
    sp_cf_entry_t ents[2] = {{.name = "a.txt",
                              .type = SP_CF_TYPE_FILE,
                              .path = "/home/user/a.txt",
                              .size = 5000000000LL,
                              .mode = 0644,
                              .permissions = "-rw-r--r--",
                              .owner = "user",
                              .group = "user",
                              .modified_time = {1700000000, 123000000},
                              .has_modified_time = true},
                             {.name = "l",
                              .type = SP_CF_TYPE_DIRECTORY,
                              .path = "/l",
                              .mode = 0x80000000u | 0755,
                              .permissions = "Lrwxrwxrwx",
                              .owner = "root",
                              .group = "root",
                              .symlink_target = "/tmp",
                              .has_symlink_target = true}};
    sp_cf_entry_resp_t er = {.entry = ents[0], .has_entry = true};
    both(&sp_cd_entry_resp, &er);
    sp_cf_listdir_resp_t ld = {.entries = ents, .n_entries = 2};
    both(&sp_cd_listdir_resp, &ld);
    sp_cf_path_req_t pr = {.path = "/tmp/x y"};
    both(&sp_cd_path_req, &pr);
    sp_cf_move_req_t mv = {.source = "/a", .destination = "/b"};
    both(&sp_cd_move_req, &mv);
    sp_cf_listdir_req_t ldr = {.path = "/", .depth = 3};
    both(&sp_cd_listdir_req, &ldr);
    sp_cf_watch_req_t wr = {.path = "/w", .recursive = true};
    both(&sp_cd_watch_req, &wr);
    sp_cf_watcher_t wid = {.watcher_id = "w123"};
    both(&sp_cd_watcher, &wid);
    sp_cf_event_t fev[2] = {{"a", SP_CF_EV_CREATE}, {"sub/b", SP_CF_EV_CHMOD}};
    sp_cf_events_resp_t evr = {.events = fev, .n_events = 2};
    both(&sp_cd_events_resp, &evr);
    sp_cf_watch_resp_t ws[3] = {{.has_start = true},
                                {.has_filesystem = true, .filesystem = {"x", SP_CF_EV_WRITE}},
                                {.has_keepalive = true}};
    for (int i = 0; i < 3; i++)
        both(&sp_cd_watch_resp, &ws[i]);
    sp_cempty_t e = {0};
    both(&sp_cd_empty, &e);
}

static void test_connectrpc_json_shapes(void)
{
    sp_cp_event_resp_t r = {.has_event = true};
    r.event.has_start = true;
    r.event.start.pid = 412;
    CHECK(json_is(&sp_cd_event_resp, &r, "{\"event\":{\"start\":{\"pid\":412}}}"));
    memset(&r.event, 0, sizeof(r.event));
    r.event.has_data = true;
    r.event.data.has_out = true;
    r.event.data.out = (sp_cbytes_t){(const uint8_t *)"hello\n", 6};
    CHECK(json_is(&sp_cd_event_resp, &r, "{\"event\":{\"data\":{\"stdout\":\"aGVsbG8K\"}}}"));
    memset(&r.event, 0, sizeof(r.event));
    r.event.has_keepalive = true;
    CHECK(json_is(&sp_cd_event_resp, &r, "{\"event\":{\"keepalive\":{}}}"));
    memset(&r.event, 0, sizeof(r.event));
    r.event.has_end = true;
    r.event.end.exited = true;
    r.event.end.status = "exit status 0";
    CHECK(json_is(&sp_cd_event_resp, &r,
                  "{\"event\":{\"end\":{\"exited\":true,\"status\":\"exit status 0\"}}}"));
    sp_cf_entry_t e = {.name = "a",
                       .type = SP_CF_TYPE_DIRECTORY,
                       .path = "/a",
                       .size = 4096,
                       .permissions = "drwxr-xr-x",
                       .modified_time = {0, 0},
                       .has_modified_time = true};
    CHECK(json_is(&sp_cd_entry, &e,
                  "{\"name\":\"a\",\"type\":\"FILE_TYPE_DIRECTORY\",\"path\":\"/a\",\"size\":"
                  "\"4096\",\"permissions\":\"drwxr-xr-x\",\"modifiedTime\":"
                  "\"1970-01-01T00:00:00Z\"}"));
    /* Four-digit years; a time outside Timestamp's range is written as its bound (the text
     * must read back). */
    sp_cf_entry_t t = {.modified_time = {-59011459200, 5}, .has_modified_time = true};
    CHECK(json_is(&sp_cd_entry, &t, "{\"modifiedTime\":\"0100-01-01T00:00:00.000000005Z\"}"));
    t.modified_time = (sp_ctime_t){INT64_MAX, 0};
    CHECK(json_is(&sp_cd_entry, &t, "{\"modifiedTime\":\"9999-12-31T23:59:59Z\"}"));
    t.modified_time = (sp_ctime_t){INT64_MIN, 0};
    CHECK(json_is(&sp_cd_entry, &t, "{\"modifiedTime\":\"0001-01-01T00:00:00Z\"}"));
    sp_cf_watcher_t w = {.watcher_id = "abc"};
    CHECK(json_is(&sp_cd_watcher, &w, "{\"watcherId\":\"abc\"}"));
    sp_cp_start_req_t st = {.has_stdin = true};
    CHECK(json_is(&sp_cd_start_req, &st, "{\"stdin\":false}"));
}

static void test_connectrpc_proto_known_bytes(void)
{
    sp_cp_event_resp_t r = {.has_event = true};
    r.event.has_start = true;
    r.event.start.pid = 412;
    static const uint8_t start[] = {0x0a, 0x05, 0x0a, 0x03, 0x08, 0x9c, 0x03};
    CHECK(proto_is(&sp_cd_event_resp, &r, start, sizeof(start)));
    memset(&r.event, 0, sizeof(r.event));
    r.event.has_end = true;
    r.event.end.exit_code = -1; /* sint32 zigzag: 1 */
    static const uint8_t end[] = {0x0a, 0x04, 0x1a, 0x02, 0x08, 0x01};
    CHECK(proto_is(&sp_cd_event_resp, &r, end, sizeof(end)));
    /* A map entry: envs {"A":"1"} in ProcessConfig field 3. */
    sp_ckv_t kv = {"A", "1"};
    sp_cp_start_req_t st = {.has_process = true, .process = {.cmd = "x", .envs = &kv, .n_envs = 1}};
    static const uint8_t sb[] = {0x0a, 0x0b, 0x0a, 0x01, 'x',  0x1a, 0x06,
                                 0x0a, 0x01, 'A',  0x12, 0x01, '1'};
    CHECK(proto_is(&sp_cd_start_req, &st, sb, sizeof(sb)));
    sp_cp_start_req_t back;
    sp_err_t err;
    CHECK(sp_connect_decode(SP_CONNECT_PROTO, &sp_cd_start_req, sb, sizeof(sb), &back, &A, &err) ==
          0);
    CHECK(back.process.n_envs == 1 && strcmp(back.process.envs[0].value, "1") == 0);
    /* Enum beyond the names, negative: ten-byte varint both ways. */
    sp_cp_send_signal_req_t sg = {.signal = -5};
    sp_buf_t b = {0};
    sp_connect_encode(SP_CONNECT_PROTO, &sp_cd_send_signal_req, &sg, &b);
    CHECK(b.len == 11);
    sp_cp_send_signal_req_t sg2;
    CHECK(sp_connect_decode(SP_CONNECT_PROTO, &sp_cd_send_signal_req, b.p, b.len, &sg2, &A, &err) ==
              0 &&
          sg2.signal == -5);
    sp_buf_free(&b);
}

static void test_connectrpc_json_lenient_input(void)
{
    sp_err_t err;
    const char *j = "{\n  \"process\": {\"cmd\": \"/bin/bash\", \"args\": [\"-c\", \"x\"],\n"
                    "  \"envs\": {\"K\": \"V\"}, \"cwd\": \"/w\", \"unknown\": [1,{\"a\":2}]},\n"
                    "  \"stdin\": false, \"extra\": null, \"tag\": null}";
    sp_cp_start_req_t st;
    CHECK(sp_connect_decode(SP_CONNECT_JSON, &sp_cd_start_req, (const uint8_t *)j, strlen(j), &st,
                            &A, &err) == 0);
    CHECK(st.has_process && strcmp(st.process.cmd, "/bin/bash") == 0 && st.process.n_args == 2 &&
          st.process.n_envs == 1 && st.process.has_cwd && st.has_stdin && !st.stdin_open &&
          !st.has_tag && !st.has_pty);
    const char *w = "{\"watcher_id\": \"w1\"}";
    sp_cf_watcher_t wt;
    CHECK(sp_connect_decode(SP_CONNECT_JSON, &sp_cd_watcher, (const uint8_t *)w, strlen(w), &wt, &A,
                            &err) == 0 &&
          strcmp(wt.watcher_id, "w1") == 0);
    const char *s1 = "{\"process\":{\"pid\":\"12\"},\"signal\":\"SIGNAL_SIGTERM\"}";
    sp_cp_send_signal_req_t sg;
    CHECK(sp_connect_decode(SP_CONNECT_JSON, &sp_cd_send_signal_req, (const uint8_t *)s1,
                            strlen(s1), &sg, &A, &err) == 0 &&
          sg.process.pid == 12 && sg.signal == 15);
    const char *s2 = "{\"signal\":9}";
    CHECK(sp_connect_decode(SP_CONNECT_JSON, &sp_cd_send_signal_req, (const uint8_t *)s2,
                            strlen(s2), &sg, &A, &err) == 0 &&
          sg.signal == 9);
    const char *e1 = "{\"entry\":{\"size\":12,\"modifiedTime\":\"2024-01-02T03:04:05.5+01:00\"}}";
    sp_cf_entry_resp_t er;
    CHECK(sp_connect_decode(SP_CONNECT_JSON, &sp_cd_entry_resp, (const uint8_t *)e1, strlen(e1),
                            &er, &A, &err) == 0 &&
          er.entry.size == 12 && er.entry.modified_time.seconds == 1704161045 &&
          er.entry.modified_time.nanos == 500000000);
    /* URL-safe base64 without padding. */
    const char *b = "{\"input\":{\"stdin\":\"-_8\"}}";
    sp_cp_send_input_req_t in;
    CHECK(sp_connect_decode(SP_CONNECT_JSON, &sp_cd_send_input_req, (const uint8_t *)b, strlen(b),
                            &in, &A, &err) == 0 &&
          in.input.stdin_data.n == 2 && in.input.stdin_data.p[0] == 0xfb &&
          in.input.stdin_data.p[1] == 0xff);
    /* An empty body is the empty message. */
    CHECK(sp_connect_decode(SP_CONNECT_JSON, &sp_cd_watcher, NULL, 0, &wt, &A, &err) == 0);
}

static int dec_json(const sp_cdesc_t *d, const char *s)
{
    void *m = calloc(1, d->size);
    sp_err_t err;
    int rc = sp_connect_decode(SP_CONNECT_JSON, d, (const uint8_t *)s, strlen(s), m, &A, &err);
    free(m);
    return rc;
}

static int dec_proto(const sp_cdesc_t *d, const uint8_t *p, size_t n)
{
    void *m = calloc(1, d->size);
    sp_err_t err;
    int rc = sp_connect_decode(SP_CONNECT_PROTO, d, p, n, m, &A, &err);
    free(m);
    return rc;
}

static void test_connectrpc_hostile_inputs(void)
{
    CHECK(dec_json(&sp_cd_send_input_req, "{\"input\":{\"stdin\":\"@@@\"}}") < 0);
    CHECK(dec_json(&sp_cd_send_input_req, "{\"input\":{\"stdin\":\"a\"}}") < 0);
    CHECK(dec_json(&sp_cd_send_input_req, "{\"input\":{\"stdin\":5}}") < 0);
    CHECK(dec_json(&sp_cd_start_req, "[1,2]") < 0);
    CHECK(dec_json(&sp_cd_start_req, "{\"process\":") < 0);
    CHECK(dec_json(&sp_cd_start_req, "{\"process\":{\"args\":\"x\"}}") < 0);
    CHECK(dec_json(&sp_cd_start_req, "{\"process\":{\"envs\":{\"a\":1}}}") < 0);
    CHECK(dec_json(&sp_cd_start_req, "{\"process\":{\"cmd\":\"a\\u0000b\"}}") < 0);
    CHECK(dec_json(&sp_cd_listdir_req, "{\"depth\":-1}") < 0);
    CHECK(dec_json(&sp_cd_listdir_req, "{\"depth\":4294967296}") < 0);
    CHECK(dec_json(&sp_cd_send_signal_req, "{\"signal\":\"SIGNAL_NOPE\"}") < 0);
    CHECK(dec_json(&sp_cd_entry_resp, "{\"entry\":{\"modifiedTime\":\"yesterday\"}}") < 0);
    /* RFC 3339's digits only: no signs or spaces where sscanf would take them */
    sp_ctime_t tm;
    CHECK(sp_connect_parse_time("0100-01-01T00:00:00Z", &tm) == 0 && tm.seconds == -59011459200);
    CHECK(sp_connect_parse_time("+224-01-02T03:04:05Z", &tm) < 0);
    CHECK(sp_connect_parse_time(" 224-01-02T03:04:05Z", &tm) < 0);
    CHECK(sp_connect_parse_time("2024-01-02T03:04:+5Z", &tm) < 0);
    CHECK(sp_connect_parse_time("2024-01-02T03:04:05+ 1:00", &tm) < 0);
    CHECK(sp_connect_parse_time("2024-01-02T03:04:05+-1:00", &tm) < 0);
    CHECK(sp_connect_parse_time("2024-01-02T03:04", &tm) < 0);
    CHECK(sp_connect_parse_time("2024-01-02T03:04:05-01:30", &tm) == 0 &&
          tm.seconds == 1704164645 + 5400);
    CHECK(dec_json(&sp_cd_path_req, "{\"path\":\"a\",\"path\":\"b\"}") < 0);
    /* Deep nesting: rejected (jansson's depth bound) or ignored, never a crash. */
    size_t depth = 100000;
    char *deep = malloc(2 * depth + 32);
    size_t k = 0;
    k += (size_t)sprintf(deep, "{\"unknown\":");
    for (size_t i = 0; i < depth; i++)
        deep[k++] = '[';
    for (size_t i = 0; i < depth; i++)
        deep[k++] = ']';
    deep[k++] = '}';
    deep[k] = '\0';
    CHECK(dec_json(&sp_cd_path_req, deep) < 0);
    free(deep);

    /* Proto: truncated varint, length past the end, wrong wire type, groups, bad key. */
    static const uint8_t t1[] = {0x0a, 0x05, 'a'};
    CHECK(dec_proto(&sp_cd_path_req, t1, sizeof(t1)) < 0);
    static const uint8_t t2[] = {0x10, 0xff};
    CHECK(dec_proto(&sp_cd_listdir_req, t2, sizeof(t2)) < 0);
    static const uint8_t t3[] = {0x08, 0x01}; /* path as varint */
    CHECK(dec_proto(&sp_cd_path_req, t3, sizeof(t3)) < 0);
    static const uint8_t t4[] = {0x1b, 0x1c}; /* start group / end group */
    CHECK(dec_proto(&sp_cd_path_req, t4, sizeof(t4)) < 0);
    static const uint8_t t5[] = {0x00, 0x01};
    CHECK(dec_proto(&sp_cd_path_req, t5, sizeof(t5)) < 0);
    static const uint8_t t6[] = {0x0a, 0x02, 'a', 0x00}; /* NUL in a string */
    CHECK(dec_proto(&sp_cd_path_req, t6, sizeof(t6)) < 0);
    /* Not UTF-8 (proto3 strings must be; JSON could not carry it): a string, a map key */
    static const uint8_t t6u[] = {0x0a, 0x02, 'a', 0xff};
    CHECK(dec_proto(&sp_cd_path_req, t6u, sizeof(t6u)) < 0);
    static const uint8_t t6k[] = {0x0a, 0x09, 0x0a, 0x01, 'x', 0x1a, 0x04, 0x0a, 0x02, 0xc3, 'A'};
    CHECK(dec_proto(&sp_cd_start_req, t6k, sizeof(t6k)) < 0);
    static const uint8_t t6ok[] = {0x0a, 0x02, 0xc3, 0xa9};
    CHECK(dec_proto(&sp_cd_path_req, t6ok, sizeof(t6ok)) == 0);
    static const uint8_t t7[] = {0x0a, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0x01};
    CHECK(dec_proto(&sp_cd_path_req, t7, sizeof(t7)) < 0);
    static const uint8_t t8[] = {0x0a, 0x80, 0x80, 0x80, 0x80, 0x80,
                                 0x80, 0x80, 0x80, 0x80, 0x80, 0x01}; /* varint of eleven bytes */
    CHECK(dec_proto(&sp_cd_path_req, t8, sizeof(t8)) < 0);
    /* Unknown fields of every wire type are skipped. */
    static const uint8_t ok[] = {0xf8, 0x06, 0x05,                          /* 111 varint */
                                 0x82, 0x07, 0x02, 'x', 'y',                /* 112 len */
                                 0x8d, 0x07, 1,    2,   3,   4,             /* 113 fixed32 */
                                 0x91, 0x07, 1,    2,   3,   4, 5, 6, 7, 8, /* 114 fixed64 */
                                 0x0a, 0x01, '/'};
    sp_cf_path_req_t pr;
    sp_err_t err;
    CHECK(sp_connect_decode(SP_CONNECT_PROTO, &sp_cd_path_req, ok, sizeof(ok), &pr, &A, &err) ==
              0 &&
          strcmp(pr.path, "/") == 0);
    static const uint8_t bad_unknown[] = {0x8d, 0x07, 1, 2};
    CHECK(dec_proto(&sp_cd_path_req, bad_unknown, sizeof(bad_unknown)) < 0);
    /* A huge count of repeated entries stays within the arena bound. */
    size_t n = 200000;
    uint8_t *many = malloc(n * 2);
    for (size_t i = 0; i < n; i++) {
        many[2 * i] = 0x0a; /* ListDirResponse.entries, empty */
        many[2 * i + 1] = 0x00;
    }
    sp_carena_t small = {0};
    sp_cf_listdir_resp_t lr;
    int rc =
        sp_connect_decode(SP_CONNECT_PROTO, &sp_cd_listdir_resp, many, n * 2, &lr, &small, &err);
    CHECK(rc == 0 ? lr.n_entries == n : err.code == SP_ETOOBIG);
    sp_carena_free(&small);
    free(many);
}

static void test_connectrpc_envelopes(void)
{
    sp_buf_t b = {0};
    sp_connect_envelope_add(&b, 0, "{}", 2);
    sp_connect_envelope_add(&b, SP_CONNECT_FLAG_END, "{\"x\":1}", 7);
    CHECK(b.len == 5 + 2 + 5 + 7);
    CHECK(b.p[0] == 0 && b.p[4] == 2 && b.p[7] == 2 && b.p[11] == 7);
    size_t off = 0, len;
    uint8_t fl;
    const uint8_t *p;
    sp_err_t err;
    CHECK(sp_connect_envelope_next(b.p, b.len, &off, &fl, &p, &len, &err) == 1 && fl == 0 &&
          len == 2);
    CHECK(sp_connect_envelope_next(b.p, b.len, &off, &fl, &p, &len, &err) == 1 &&
          fl == SP_CONNECT_FLAG_END && len == 7 && memcmp(p, "{\"x\":1}", 7) == 0);
    CHECK(sp_connect_envelope_next(b.p, b.len, &off, &fl, &p, &len, &err) == 0);
    /* Truncated header, length past the body, compressed flag. */
    for (size_t cut = 1; cut < 5; cut++) {
        off = 0;
        CHECK(sp_connect_envelope_next(b.p, cut, &off, &fl, &p, &len, &err) < 0);
    }
    off = 0;
    CHECK(sp_connect_envelope_next(b.p, 6, &off, &fl, &p, &len, &err) < 0);
    static const uint8_t huge[] = {0, 0xff, 0xff, 0xff, 0xff, 'x'};
    off = 0;
    CHECK(sp_connect_envelope_next(huge, sizeof(huge), &off, &fl, &p, &len, &err) < 0);
    static const uint8_t comp[] = {1, 0, 0, 0, 0};
    off = 0;
    CHECK(sp_connect_envelope_next(comp, sizeof(comp), &off, &fl, &p, &len, &err) < 0);
    static const uint8_t empty[] = {0, 0, 0, 0, 0};
    off = 0;
    CHECK(sp_connect_envelope_next(empty, sizeof(empty), &off, &fl, &p, &len, &err) == 1 &&
          len == 0);
    sp_buf_free(&b);
}

static void test_connectrpc_codes_and_headers(void)
{
    CHECK(strcmp(sp_connect_code_name(SP_CC_DEADLINE_EXCEEDED), "deadline_exceeded") == 0);
    CHECK(strcmp(sp_connect_code_name(SP_CC_UNAUTHENTICATED), "unauthenticated") == 0);
    CHECK(sp_connect_code_http(SP_CC_NOT_FOUND) == 404);
    CHECK(sp_connect_code_http(SP_CC_UNAUTHENTICATED) == 401);
    CHECK(sp_connect_code_http(SP_CC_ALREADY_EXISTS) == 409);
    CHECK(sp_connect_code_from(SP_ENOTFOUND) == SP_CC_NOT_FOUND);
    CHECK(sp_connect_code_from(SP_EFORBIDDEN) == SP_CC_PERMISSION_DENIED);
    CHECK(sp_connect_code_from(SP_EINVAL) == SP_CC_INVALID_ARGUMENT);
    sp_connect_req_t cr;
    CHECK(sp_connect_content_type("application/connect+json", &cr) == 0 && cr.streaming &&
          cr.codec == SP_CONNECT_JSON);
    CHECK(sp_connect_content_type("application/proto", &cr) == 0 && !cr.streaming &&
          cr.codec == SP_CONNECT_PROTO);
    CHECK(sp_connect_content_type("application/json; charset=utf-8", &cr) == 0);
    CHECK(sp_connect_content_type("application/jsonx", &cr) < 0);
    CHECK(sp_connect_content_type("text/plain", &cr) < 0);
    uint32_t v;
    CHECK(sp_connect_parse_timeout("60000", &v) == 0 && v == 60000);
    CHECK(sp_connect_parse_timeout("12345678901", &v) < 0);
    CHECK(sp_connect_parse_timeout("-1", &v) < 0);
    CHECK(sp_connect_parse_timeout("", &v) < 0);
    CHECK(sp_connect_parse_keepalive("50", &v) == 0 && v == 50);
    CHECK(sp_connect_parse_keepalive("0", &v) < 0);
    CHECK(sp_connect_parse_keepalive("5s", &v) < 0);
    char out[16];
    CHECK(sp_connect_b64_encode((const uint8_t *)"hi\n", 3, out) == 4 && strcmp(out, "aGkK") == 0);
    uint8_t d[8];
    CHECK(sp_connect_b64_decode("aGkK", 4, d) == 3 && memcmp(d, "hi\n", 3) == 0);
    CHECK(sp_connect_b64_decode("aGk=", 4, d) == 2);
    CHECK(sp_connect_b64_decode("a", 1, d) < 0);
    CHECK(sp_connect_b64_decode("a b=", 4, d) < 0);
}

int main(void)
{
    test_connectrpc_round_trip_every_message();
    test_connectrpc_json_shapes();
    test_connectrpc_proto_known_bytes();
    test_connectrpc_json_lenient_input();
    test_connectrpc_hostile_inputs();
    test_connectrpc_envelopes();
    test_connectrpc_codes_and_headers();
    sp_carena_free(&A);
    return check_report("connectrpc");
}
