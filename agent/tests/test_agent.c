/*
 * test_agent.c - integration test: a real space-agent on a unix socket.
 *
 * Starts $SP_AGENT_BIN --listen-unix in a temp dir and drives it through the
 * protocol as the host would: processes (pipes, PTY, stdin, signals, users,
 * flow control, re-attach across reconnects), files, watches, TCP, identity
 * and malformed input. Needs root (user switching); skips (77) otherwise.
 */
#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "agent/tests/agenthost.h"
#include "base/agentproto.h"
#include "tests/check.h"

static char tmpdir[64], sock_path[100];

/* ---- agent lifecycle ---- */

static void send_hello(uint64_t session)
{
    sp_ap_hello_t h = {.version = SP_AP_VERSION, .client = {"test", 4}, .session = session};
    sp_ap_writer_init(&ah_w, ah_wbuf, sizeof(ah_wbuf));
    REQUIRE(sp_ap_enc_hello(&ah_w, &h) > 0);
    ah_write_all(ah_wbuf, ah_w.len);
}

/* Waits for the agent's HELLO and checks it answers the one that carried session. */
static void hello_answer(uint64_t session)
{
    frame_t f = ah_wait_on(0, false);
    REQUIRE(f.h.type == SP_AP_T_HELLO);
    sp_ap_hello_t got;
    REQUIRE(sp_ap_dec_hello(f.p, f.h.len, &got, NULL) == 0);
    CHECK(got.version == SP_AP_VERSION);
    CHECK(got.agent_version.n > 0);
    CHECK(got.caps & SP_AP_CAP_PTY);
    CHECK(got.session == session);
}

static uint64_t sessions;

static void hello(void)
{
    uint64_t s = ++sessions * 0x9e3779b97f4a7c15ull;
    send_hello(s);
    hello_answer(s);
}

static void start_agent(void)
{
    char env_file[600];
    snprintf(env_file, sizeof(env_file), "%s/identity.env", tmpdir);
    ah_agent_pid = ah_spawn_agent(sock_path, env_file);
    ah_connect(sock_path);
}

/* ---- processes ---- */

typedef struct {
    char out[65536];
    size_t out_len;
    char err[4096];
    size_t err_len;
    uint64_t total_out;
    int32_t exit_code;
    uint32_t sig;
    uint32_t pid;
    uint32_t error; /* ERROR code instead of an exit */
} result_t;

static uint32_t start_proc(const char *cmd, const char *user, bool pty, const char *tag)
{
    uint32_t id = ah_next_stream++;
    sp_ap_writer_t *w = ah_begin(id, SP_AP_T_PROC_START, 0);
    sp_ap_put_str(w, SP_AP_K_CMD, cmd);
    sp_ap_put_str(w, SP_AP_K_USER, user);
    sp_ap_put_str(w, SP_AP_K_TAG, tag);
    if (pty) {
        sp_ap_put_u32(w, SP_AP_K_PTY, 1);
        sp_ap_put_u32(w, SP_AP_K_ROWS, 30);
        sp_ap_put_u32(w, SP_AP_K_COLS, 100);
    }
    ah_send_frame();
    return id;
}

static void append(char *dst, size_t *len, size_t cap, const uint8_t *p, size_t n)
{
    size_t room = cap - 1 - *len;
    if (n > room)
        n = room;
    memcpy(dst + *len, p, n);
    *len += n;
    dst[*len] = 0;
}

/* Handles one frame of a process stream; returns true at the end of the stream. */
static bool proc_frame(uint32_t id, const frame_t *f, result_t *r, bool auto_grant)
{
    switch (f->h.type) {
    case SP_AP_T_PROC_STARTED:
        r->pid = ah_u32_of(f, SP_AP_K_PID, 0);
        return false;
    case SP_AP_T_PROC_STDOUT:
        append(r->out, &r->out_len, sizeof(r->out), f->p, f->h.len);
        r->total_out += f->h.len;
        if (auto_grant)
            ah_grant(id, f->h.len);
        return false;
    case SP_AP_T_PROC_STDERR:
        append(r->err, &r->err_len, sizeof(r->err), f->p, f->h.len);
        if (auto_grant)
            ah_grant(id, f->h.len);
        return false;
    case SP_AP_T_PROC_EXIT:
        r->exit_code = -1;
        REQUIRE(sp_ap_get_i32(f->p, f->h.len, SP_AP_K_EXIT_CODE, &r->exit_code) == 0);
        r->sig = ah_u32_of(f, SP_AP_K_SIGNAL, 0);
        CHECK(f->h.flags & SP_AP_F_END);
        return true;
    case SP_AP_T_ERROR:
        r->error = ah_err_code(f);
        return true;
    default:
        return false; /* WINDOW for stdin */
    }
}

static void collect(uint32_t id, result_t *r)
{
    frame_t f;
    do
        f = ah_wait_on(id, false);
    while (!proc_frame(id, &f, r, true));
}

/* Reads until stdout contains needle. */
static void read_until(uint32_t id, result_t *r, const char *needle)
{
    while (strstr(r->out, needle) == NULL) {
        frame_t f = ah_wait_on(id, false);
        REQUIRE(!proc_frame(id, &f, r, true));
    }
}

static result_t *run(const char *cmd, const char *user)
{
    static result_t r;
    memset(&r, 0, sizeof(r));
    collect(start_proc(cmd, user, false, NULL), &r);
    return &r;
}

static void send_data(uint32_t id, const void *p, size_t n)
{
    sp_ap_put_raw(ah_begin(id, SP_AP_T_DATA, 0), p, n);
    ah_send_frame();
}

static void test_agent_process_basics(void)
{
    result_t *r = run("echo hi", NULL);
    CHECK(r->error == 0 && r->exit_code == 0 && strcmp(r->out, "hi\n") == 0 && r->pid > 0);
    r = run("exit 3", NULL);
    CHECK(r->exit_code == 3);
    r = run("echo oops >&2; exit 1", NULL);
    CHECK(strcmp(r->err, "oops\n") == 0 && r->exit_code == 1);
    r = run("echo $HOME $USER; echo $PATH; pwd", "nobody");
    if (r->error)
        fprintf(stderr, "run as nobody: error %u\n", r->error);
    CHECK(strstr(r->out, "nobody") != NULL);
    CHECK(strstr(r->out, "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin") != NULL);
    r = run("id -u; id -g", "nobody");
    CHECK(strncmp(r->out, "65534\n", 6) == 0);
    r = run("true", "no-such-user-xyz");
    CHECK(r->error == SP_AP_E_NOTFOUND);

    /* argv form, command not found */
    uint32_t id = ah_next_stream++;
    sp_ap_put_str(ah_begin(id, SP_AP_T_PROC_START, 0), SP_AP_K_ARGV,
                  "definitely-not-a-command-xyz");
    ah_send_frame();
    frame_t f = ah_wait_on(id, false);
    CHECK(ah_err_code(&f) == SP_AP_E_NOTFOUND);
}

static void test_agent_stdin_and_signal(void)
{
    result_t r = {0};
    uint32_t id = start_proc("cat", NULL, false, NULL);
    send_data(id, "hello\n", 6);
    read_until(id, &r, "hello\n");
    ah_send_empty(id, SP_AP_T_EOF, 0);
    collect(id, &r);
    CHECK(strcmp(r.out, "hello\n") == 0 && r.exit_code == 0);

    memset(&r, 0, sizeof(r));
    id = start_proc("echo started; exec sleep 30", NULL, false, NULL);
    read_until(id, &r, "started");
    sp_ap_put_u32(ah_begin(id, SP_AP_T_PROC_SIGNAL, 0), SP_AP_K_SIGNAL, SIGTERM);
    ah_send_frame();
    collect(id, &r);
    CHECK(r.sig == SIGTERM);
}

static void resize(uint32_t id, uint32_t rows, uint32_t cols)
{
    sp_ap_writer_t *w = ah_begin(id, SP_AP_T_PROC_RESIZE, 0);
    sp_ap_put_u32(w, SP_AP_K_ROWS, rows);
    sp_ap_put_u32(w, SP_AP_K_COLS, cols);
    ah_send_frame();
}

static void test_agent_pty(void)
{
    result_t r = {0};
    uint32_t id =
        start_proc("stty size; tty >/dev/null && echo isatty; read x; stty size", NULL, true, NULL);
    read_until(id, &r, "isatty");
    CHECK(strstr(r.out, "30 100") != NULL);
    resize(id, 40, 120);
    send_data(id, "go\r", 3);
    collect(id, &r);
    CHECK(strstr(r.out, "40 120") != NULL);
    CHECK(r.exit_code == 0);
}

static void test_agent_flow_control(void)
{
    long rss0 = ah_agent_rss_kb();
    result_t r = {0};
    uint32_t id = start_proc("yes | head -c 50000000", NULL, false, NULL);
    /* Grant nothing: the agent must stop at the initial window. */
    frame_t f;
    struct timespec t0, t1;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    for (;;) {
        clock_gettime(CLOCK_MONOTONIC, &t1);
        if (t1.tv_sec - t0.tv_sec >= 1)
            break;
        if (ah_recv_frame(&f, 200) < 0)
            continue;
        if (f.h.stream == id)
            REQUIRE(!proc_frame(id, &f, &r, false));
    }
    CHECK(r.total_out <= SP_AP_INITIAL_WINDOW);
    long rss1 = ah_agent_rss_kb();
    CHECK(rss1 - rss0 < 16 * 1024); /* ring (1 MiB) + tx queue, not 50 MB */
    ah_grant(id, (uint32_t)r.total_out);
    collect(id, &r);
    CHECK(r.total_out == 50000000);
    if (r.total_out != 50000000)
        fprintf(stderr, "flood: got %llu bytes\n", (unsigned long long)r.total_out);
    CHECK(r.exit_code == 0);
    long rss2 = ah_agent_rss_kb();
    CHECK(rss2 - rss0 < 32 * 1024);
    fprintf(stderr, "flood: rss %ld -> %ld -> %ld kB\n", rss0, rss1, rss2);
}

static void list_procs(uint32_t want_pid, bool *found, bool *running)
{
    uint32_t id = ah_next_stream++;
    ah_send_empty(id, SP_AP_T_PROC_LIST, 0);
    *found = *running = false;
    for (;;) {
        frame_t f = ah_wait_on(id, false);
        if (f.h.type == SP_AP_T_OK)
            return;
        REQUIRE(f.h.type == SP_AP_T_PROC_INFO);
        if (ah_u32_of(&f, SP_AP_K_PID, 0) == want_pid) {
            *found = true;
            *running = ah_u32_of(&f, SP_AP_K_RUNNING, 0) != 0;
            sp_ap_str_t tag;
            REQUIRE(sp_ap_get_str(f.p, f.h.len, SP_AP_K_TAG, &tag) == 0);
            CHECK(tag.n == 2 && memcmp(tag.p, "bg", 2) == 0);
        }
    }
}

static void test_agent_reattach(void)
{
    result_t r = {0};
    uint32_t id =
        start_proc("for i in $(seq 1 30); do echo line$i; sleep 0.05; done", NULL, false, "bg");
    read_until(id, &r, "line2\n");
    uint32_t pid = r.pid;
    ah_connect(sock_path); /* the old connection is dropped: as after a spaced restart */
    hello();
    bool found, running;
    list_procs(pid, &found, &running);
    CHECK(found && running);
    uint32_t aid = ah_next_stream++;
    sp_ap_writer_t *w = ah_begin(aid, SP_AP_T_PROC_ATTACH, 0);
    sp_ap_put_u32(w, SP_AP_K_PID, pid);
    sp_ap_put_u32(w, SP_AP_K_REPLAY, 1);
    ah_send_frame();
    memset(&r, 0, sizeof(r));
    collect(aid, &r);
    CHECK(r.pid == pid);
    CHECK(strncmp(r.out, "line1\n", 6) == 0); /* replayed from the ring */
    CHECK(strstr(r.out, "line30\n") != NULL);
    CHECK(r.exit_code == 0);
    /* Attaching to an unknown pid fails on that stream only. */
    aid = ah_next_stream++;
    sp_ap_put_u32(ah_begin(aid, SP_AP_T_PROC_ATTACH, 0), SP_AP_K_PID, 0x7ffffff0);
    ah_send_frame();
    frame_t f = ah_wait_on(aid, false);
    CHECK(ah_err_code(&f) == SP_AP_E_NOTFOUND);
}

/* ---- files ---- */

static frame_t fs_req(uint16_t type, const char *path, const char *user)
{
    uint32_t id = ah_next_stream++;
    sp_ap_writer_t *w = ah_begin(id, type, 0);
    sp_ap_put_str(w, SP_AP_K_PATH, path);
    sp_ap_put_str(w, SP_AP_K_USER, user);
    ah_send_frame();
    return ah_wait_on(id, false);
}

static uint32_t write_file(const char *path, const char *user, const uint8_t *data, size_t n)
{
    uint32_t id = ah_next_stream++;
    sp_ap_writer_t *w = ah_begin(id, SP_AP_T_FS_WRITE, 0);
    sp_ap_put_str(w, SP_AP_K_PATH, path);
    sp_ap_put_str(w, SP_AP_K_USER, user);
    sp_ap_put_u32(w, SP_AP_K_MKDIRS, 1);
    ah_send_frame();
    uint64_t credit = SP_AP_INITIAL_WINDOW;
    size_t off = 0;
    while (off < n) {
        if (credit == 0) {
            frame_t f = ah_wait_on(id, false);
            if (f.h.type != SP_AP_T_WINDOW)
                return ah_err_code(&f);
            credit += ah_u32_of(&f, SP_AP_K_WINDOW, 0);
            continue;
        }
        size_t k = n - off < SP_AP_MAX_DATA ? n - off : SP_AP_MAX_DATA;
        if (k > credit)
            k = (size_t)credit;
        send_data(id, data + off, k);
        off += k;
        credit -= k;
    }
    ah_send_empty(id, SP_AP_T_EOF, 0);
    for (;;) {
        frame_t f = ah_wait_on(id, false);
        if (f.h.type == SP_AP_T_OK)
            return 0;
        if (f.h.type == SP_AP_T_ERROR)
            return ah_err_code(&f);
    }
}

/* Reads a whole file; returns bytes read, or -(error code). */
static long read_file(const char *path, const char *user, uint8_t *out, size_t cap)
{
    frame_t f;
    uint32_t id = ah_next_stream++;
    sp_ap_writer_t *w = ah_begin(id, SP_AP_T_FS_READ, 0);
    sp_ap_put_str(w, SP_AP_K_PATH, path);
    sp_ap_put_str(w, SP_AP_K_USER, user);
    ah_send_frame();
    size_t n = 0;
    for (;;) {
        f = ah_wait_on(id, false);
        if (f.h.type != SP_AP_T_DATA)
            break;
        REQUIRE(n + f.h.len <= cap);
        memcpy(out + n, f.p, f.h.len);
        n += f.h.len;
        ah_grant(id, f.h.len);
    }
    if (f.h.type == SP_AP_T_ERROR)
        return -(long)ah_err_code(&f);
    uint64_t size = 0;
    REQUIRE(sp_ap_get_u64(f.p, f.h.len, SP_AP_K_SIZE, &size) == 0);
    CHECK(size == n);
    return (long)n;
}

static uint64_t fnv(const uint8_t *p, size_t n)
{
    uint64_t h = 1469598103934665603ull;
    for (size_t i = 0; i < n; i++)
        h = (h ^ p[i]) * 1099511628211ull;
    return h;
}

static void test_agent_file_roundtrip(void)
{
    size_t n = 3 * 1024 * 1024 + 12345;
    uint8_t *data = malloc(n), *back = malloc(n + 1);
    uint64_t x = 88172645463325252ull;
    for (size_t i = 0; i < n; i++) { /* xorshift: incompressible, reproducible */
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        data[i] = (uint8_t)x;
    }
    char path[512];
    snprintf(path, sizeof(path), "%s/files/deep/big.bin", tmpdir);
    CHECK(write_file(path, NULL, data, n) == 0);
    long got = read_file(path, NULL, back, n + 1);
    CHECK(got == (long)n && fnv(back, n) == fnv(data, n));
    free(data);
    free(back);
}

static uint32_t ftype_of_entry(const frame_t *f)
{
    return ah_u32_of(f, SP_AP_K_FTYPE, 99);
}

static int count_list(const char *path, uint32_t depth, const char *want_name, bool *seen)
{
    uint32_t id = ah_next_stream++;
    sp_ap_writer_t *w = ah_begin(id, SP_AP_T_FS_LIST, 0);
    sp_ap_put_str(w, SP_AP_K_PATH, path);
    sp_ap_put_u32(w, SP_AP_K_DEPTH, depth);
    ah_send_frame();
    int count = 0;
    *seen = false;
    for (;;) {
        frame_t f = ah_wait_on(id, false);
        if (f.h.type != SP_AP_T_FS_ENTRY) {
            CHECK(f.h.type == SP_AP_T_OK);
            return count;
        }
        sp_ap_entry_t e;
        REQUIRE(sp_ap_dec_entry(f.p, f.h.len, &e, NULL) == 0);
        if (e.name.n == strlen(want_name) && memcmp(e.name.p, want_name, e.name.n) == 0)
            *seen = true;
        count++;
    }
}

static void test_agent_file_ops(void)
{
    char a[256], deep[256], file[300], moved[300];
    snprintf(a, sizeof(a), "%s/ops/a", tmpdir);
    snprintf(deep, sizeof(deep), "%s/ops/a/b/c", tmpdir);
    snprintf(file, sizeof(file), "%s/x.txt", deep);
    snprintf(moved, sizeof(moved), "%s/y.txt", a);
    frame_t f = fs_req(SP_AP_T_FS_MKDIR, deep, NULL);
    CHECK(f.h.type == SP_AP_T_OK && ftype_of_entry(&f) == SP_AP_FT_DIR);
    CHECK(write_file(file, NULL, (const uint8_t *)"12345", 5) == 0);
    f = fs_req(SP_AP_T_FS_STAT, file, NULL);
    CHECK(f.h.type == SP_AP_T_OK && ftype_of_entry(&f) == SP_AP_FT_FILE);
    uint64_t size = 0;
    sp_ap_get_u64(f.p, f.h.len, SP_AP_K_SIZE, &size);
    CHECK(size == 5);
    bool seen;
    CHECK(count_list(a, 1, "x.txt", &seen) == 1 && !seen);
    CHECK(count_list(a, 3, "x.txt", &seen) == 3 && seen);

    uint32_t id = ah_next_stream++;
    sp_ap_writer_t *w = ah_begin(id, SP_AP_T_FS_MOVE, 0);
    sp_ap_put_str(w, SP_AP_K_PATH, file);
    sp_ap_put_str(w, SP_AP_K_DEST, moved);
    ah_send_frame();
    f = ah_wait_on(id, false);
    CHECK(f.h.type == SP_AP_T_OK);
    f = fs_req(SP_AP_T_FS_STAT, file, NULL);
    CHECK(ah_err_code(&f) == SP_AP_E_NOTFOUND);

    f = fs_req(SP_AP_T_FS_REMOVE, a, NULL); /* not recursive: not empty */
    CHECK(ah_err_code(&f) == SP_AP_E_EXISTS);
    id = ah_next_stream++;
    w = ah_begin(id, SP_AP_T_FS_REMOVE, 0);
    sp_ap_put_str(w, SP_AP_K_PATH, a);
    sp_ap_put_u32(w, SP_AP_K_RECURSIVE, 1);
    ah_send_frame();
    f = ah_wait_on(id, false);
    CHECK(f.h.type == SP_AP_T_OK);
    f = fs_req(SP_AP_T_FS_STAT, a, NULL);
    CHECK(ah_err_code(&f) == SP_AP_E_NOTFOUND);
}

static void test_agent_file_permissions(void)
{
    char secret[512], pub[512], nob[512];
    snprintf(secret, sizeof(secret), "%s/perm/secret", tmpdir);
    snprintf(pub, sizeof(pub), "%s/perm/pub", tmpdir);
    snprintf(nob, sizeof(nob), "%s/perm/nobody-dir", tmpdir);
    CHECK(write_file(secret, NULL, (const uint8_t *)"s", 1) == 0);
    uint32_t id = ah_next_stream++;
    sp_ap_writer_t *w = ah_begin(id, SP_AP_T_FS_CHMOD, 0);
    sp_ap_put_str(w, SP_AP_K_PATH, secret);
    sp_ap_put_u32(w, SP_AP_K_MODE, 0600);
    ah_send_frame();
    frame_t f = ah_wait_on(id, false);
    CHECK(f.h.type == SP_AP_T_OK && ah_u32_of(&f, SP_AP_K_MODE, 0) == 0600);
    uint8_t buf[16];
    CHECK(read_file(secret, "nobody", buf, sizeof(buf)) == -(long)SP_AP_E_PERM);
    CHECK(write_file(pub, "nobody", (const uint8_t *)"x", 1) == SP_AP_E_PERM);
    f = fs_req(SP_AP_T_FS_MKDIR, nob, "nobody");
    CHECK(ah_err_code(&f) == SP_AP_E_PERM);

    /* chown to nobody, then nobody may write inside. */
    f = fs_req(SP_AP_T_FS_MKDIR, nob, NULL);
    CHECK(f.h.type == SP_AP_T_OK);
    id = ah_next_stream++;
    w = ah_begin(id, SP_AP_T_FS_CHOWN, 0);
    sp_ap_put_str(w, SP_AP_K_PATH, nob);
    sp_ap_put_str(w, SP_AP_K_OWNER, "nobody");
    ah_send_frame();
    f = ah_wait_on(id, false);
    CHECK(f.h.type == SP_AP_T_OK && ah_u32_of(&f, SP_AP_K_UID, 0) == 65534);
    char inside[600];
    snprintf(inside, sizeof(inside), "%s/mine", nob);
    CHECK(write_file(inside, "nobody", (const uint8_t *)"m", 1) == 0);
    f = fs_req(SP_AP_T_FS_STAT, inside, "nobody");
    CHECK(f.h.type == SP_AP_T_OK && ah_u32_of(&f, SP_AP_K_UID, 0) == 65534);
    /* nobody cannot give its file away */
    id = ah_next_stream++;
    w = ah_begin(id, SP_AP_T_FS_CHOWN, 0);
    sp_ap_put_str(w, SP_AP_K_PATH, inside);
    sp_ap_put_str(w, SP_AP_K_USER, "nobody");
    sp_ap_put_str(w, SP_AP_K_OWNER, "root");
    ah_send_frame();
    f = ah_wait_on(id, false);
    CHECK(ah_err_code(&f) == SP_AP_E_PERM);
}

static void str_eq(const frame_t *f, uint16_t tag, const char *want)
{
    sp_ap_str_t v = {0};
    CHECK(sp_ap_get_str(f->p, f->h.len, tag, &v) == 0);
    if (want == NULL) {
        CHECK(v.p == NULL);
        return;
    }
    CHECK(v.p != NULL && v.n == strlen(want) && memcmp(v.p, want, v.n) == 0);
    if (v.p == NULL || v.n != strlen(want) || memcmp(v.p, want, v.n) != 0)
        fprintf(stderr, "  got %.*s, want %s\n", (int)v.n, v.p ? v.p : "", want);
}

static void test_agent_paths_resolve_like_envd(void)
{
    /* root's home is /root: "~", "~/", "~/x/.." and "x/.." are all it; absolute paths are
     * taken as given. No writes: only stats. */
    const char *home_forms[] = {"~", "~/", "~/.", "~/x/..", "x/..", ".", "x//../."};
    for (size_t i = 0; i < sizeof(home_forms) / sizeof(home_forms[0]); i++) {
        frame_t f = fs_req(SP_AP_T_FS_STAT, home_forms[i], NULL);
        CHECK(f.h.type == SP_AP_T_OK);
        str_eq(&f, SP_AP_K_PATH, "/root");
    }
    frame_t f = fs_req(SP_AP_T_FS_STAT, "~nobody", NULL);
    CHECK(ah_err_code(&f) == SP_AP_E_INVAL);
    f = fs_req(SP_AP_T_FS_STAT, "/", NULL);
    str_eq(&f, SP_AP_K_PATH, "/");
}

static void test_agent_entry_targets_and_specials(void)
{
    char dir[300], link[320], flink[320], dang[320], fifo[320], file[320];
    snprintf(dir, sizeof(dir), "%s/links/d", tmpdir);
    snprintf(file, sizeof(file), "%s/links/f", tmpdir);
    snprintf(link, sizeof(link), "%s/links/to-d", tmpdir);
    snprintf(flink, sizeof(flink), "%s/links/to-to-f", tmpdir);
    snprintf(dang, sizeof(dang), "%s/links/dangling", tmpdir);
    snprintf(fifo, sizeof(fifo), "%s/links/fifo", tmpdir);
    frame_t f = fs_req(SP_AP_T_FS_MKDIR, dir, NULL);
    CHECK(f.h.type == SP_AP_T_OK);
    CHECK(chmod(dir, 0750) == 0);
    CHECK(write_file(file, NULL, (const uint8_t *)"f", 1) == 0);
    CHECK(chmod(file, 0640) == 0);
    char rel[330];
    snprintf(rel, sizeof(rel), "%s/links/to-f", tmpdir);
    CHECK(symlink(dir, link) == 0 && symlink("f", rel) == 0 && symlink("to-f", flink) == 0 &&
          symlink("nowhere", dang) == 0 && mkfifo(fifo, 0644) == 0);
    char real_dir[PATH_MAX], real_file[PATH_MAX];
    REQUIRE(realpath(dir, real_dir) != NULL && realpath(file, real_file) != NULL);

    f = fs_req(SP_AP_T_FS_STAT, link, NULL);
    CHECK(ftype_of_entry(&f) == SP_AP_FT_SYMLINK);
    str_eq(&f, SP_AP_K_TARGET, real_dir);
    CHECK(ah_u32_of(&f, SP_AP_K_TARGET_FTYPE, 99) == SP_AP_FT_DIR);
    CHECK(ah_u32_of(&f, SP_AP_K_TARGET_MODE, 0) == 0750);
    f = fs_req(SP_AP_T_FS_STAT, flink, NULL); /* two links deep */
    str_eq(&f, SP_AP_K_LINK, "to-f");
    str_eq(&f, SP_AP_K_TARGET, real_file);
    CHECK(ah_u32_of(&f, SP_AP_K_TARGET_FTYPE, 99) == SP_AP_FT_FILE);
    CHECK(ah_u32_of(&f, SP_AP_K_TARGET_MODE, 0) == 0640);
    f = fs_req(SP_AP_T_FS_STAT, dang, NULL);
    CHECK(ftype_of_entry(&f) == SP_AP_FT_SYMLINK);
    str_eq(&f, SP_AP_K_TARGET, NULL);
    f = fs_req(SP_AP_T_FS_STAT, fifo, NULL);
    CHECK(ftype_of_entry(&f) == SP_AP_FT_OTHER);
    CHECK(ah_u32_of(&f, SP_AP_K_SPECIAL, 0) == SP_AP_SPECIAL_FIFO);
    f = fs_req(SP_AP_T_FS_STAT, dir, NULL);
    CHECK(ah_u32_of(&f, SP_AP_K_SPECIAL, 99) == 99); /* absent for plain types */
}

static void test_agent_watch(void)
{
    char dir[512], file[600];
    snprintf(dir, sizeof(dir), "%s/watched", tmpdir);
    snprintf(file, sizeof(file), "%s/new.txt", dir);
    frame_t f = fs_req(SP_AP_T_FS_MKDIR, dir, NULL);
    CHECK(f.h.type == SP_AP_T_OK);
    uint32_t wid = ah_next_stream++;
    sp_ap_writer_t *w = ah_begin(wid, SP_AP_T_WATCH_START, 0);
    sp_ap_put_str(w, SP_AP_K_PATH, dir);
    ah_send_frame();
    f = ah_wait_on(wid, false);
    CHECK(f.h.type == SP_AP_T_WATCH_STARTED);
    CHECK(write_file(file, NULL, (const uint8_t *)"hi", 2) == 0);
    bool seen = false;
    for (int i = 0; i < 20 && !seen; i++) {
        f = ah_wait_on(wid, false);
        sp_ap_str_t name;
        REQUIRE(sp_ap_get_str(f.p, f.h.len, SP_AP_K_NAME, &name) == 0);
        seen = f.h.type == SP_AP_T_WATCH_EVENT && name.n == 7 && memcmp(name.p, "new.txt", 7) == 0;
    }
    CHECK(seen);
    ah_send_empty(wid, SP_AP_T_RESET, 0);
}

static void test_agent_tcp(void)
{
    int l = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    struct sockaddr_in sa = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    socklen_t sl = sizeof(sa);
    REQUIRE(bind(l, (struct sockaddr *)&sa, sizeof(sa)) == 0 && listen(l, 1) == 0);
    REQUIRE(getsockname(l, (struct sockaddr *)&sa, &sl) == 0);
    uint32_t id = ah_next_stream++;
    sp_ap_put_u32(ah_begin(id, SP_AP_T_TCP_CONNECT, 0), SP_AP_K_PORT, ntohs(sa.sin_port));
    ah_send_frame();
    frame_t f = ah_wait_on(id, false);
    CHECK(f.h.type == SP_AP_T_TCP_CONNECTED);
    int c = accept(l, NULL, NULL);
    REQUIRE(c >= 0);
    send_data(id, "GET /", 5);
    char buf[16] = "";
    CHECK(read(c, buf, 5) == 5 && memcmp(buf, "GET /", 5) == 0);
    CHECK(write(c, "200 OK", 6) == 6);
    do
        f = ah_wait_on(id, false);
    while (f.h.type == SP_AP_T_WINDOW); /* credit back for "GET /" */
    CHECK(f.h.type == SP_AP_T_DATA && f.h.len == 6 && memcmp(f.p, "200 OK", 6) == 0);
    close(c);
    f = ah_wait_on(id, false);
    CHECK(f.h.type == SP_AP_T_EOF);
    ah_send_empty(id, SP_AP_T_EOF, 0);
    f = ah_wait_on(id, false);
    CHECK(f.h.type == SP_AP_T_OK && (f.h.flags & SP_AP_F_END));
    close(l);
    /* Nobody listening: refused, on that stream. */
    id = ah_next_stream++;
    sp_ap_put_u32(ah_begin(id, SP_AP_T_TCP_CONNECT, 0), SP_AP_K_PORT, ntohs(sa.sin_port));
    ah_send_frame();
    f = ah_wait_on(id, false);
    CHECK(ah_err_code(&f) == SP_AP_E_UNAVAIL);
}

static void test_agent_identity_and_ping(void)
{
    uint32_t id = ah_next_stream++;
    sp_ap_identity_t m = {.sandbox_id = {"sbx-1", 5},
                          .env = {{"SPACE_TEST_ENV=from-identity", 28}},
                          .envc = 1,
                          .seed = {"\x01\x02\x00\x03", 4}};
    sp_ap_writer_init(&ah_w, ah_wbuf, sizeof(ah_wbuf));
    REQUIRE(sp_ap_enc_identity(&ah_w, id, &m) > 0);
    ah_write_all(ah_wbuf, ah_w.len);
    frame_t f = ah_wait_on(id, false);
    CHECK(f.h.type == SP_AP_T_OK);
    result_t *r = run("echo $SPACE_TEST_ENV", NULL);
    CHECK(strcmp(r->out, "from-identity\n") == 0);
    /* The env is also in the env file, for programs that started before IDENTITY. */
    char env_file[600], buf[128];
    snprintf(env_file, sizeof(env_file), "%s/identity.env", tmpdir);
    struct stat st;
    CHECK(stat(env_file, &st) == 0 && (st.st_mode & 0777) == 0600);
    FILE *ef = fopen(env_file, "rb");
    size_t en = ef ? fread(buf, 1, sizeof(buf), ef) : 0;
    if (ef)
        fclose(ef);
    CHECK(en == 29 && memcmp(buf, "SPACE_TEST_ENV=from-identity\0", 29) == 0);

    sp_ap_put_raw(ah_begin(0, SP_AP_T_PING, 0), "abc", 3);
    ah_send_frame();
    f = ah_wait_on(0, false);
    CHECK(f.h.type == SP_AP_T_PONG && f.h.len == 3 && memcmp(f.p, "abc", 3) == 0);
}

static void test_agent_malformed(void)
{
    /* Unknown type on a stream. */
    uint32_t id = ah_next_stream++;
    ah_begin(id, 0x7777, 0);
    ah_send_frame();
    frame_t f = ah_wait_on(id, false);
    CHECK(ah_err_code(&f) == SP_AP_E_TYPE && (f.h.flags & SP_AP_F_END));

    /* A request type on stream 0. */
    ah_send_empty(0, SP_AP_T_PROC_LIST, 0);
    f = ah_wait_on(0, false);
    CHECK(ah_err_code(&f) == SP_AP_E_PROTO);

    /* Truncated TLV in PROC_START. */
    id = ah_next_stream++;
    sp_ap_put_raw(ah_begin(id, SP_AP_T_PROC_START, 0), "\x15\x00\xff\xff\x00\x00ls", 8);
    ah_send_frame();
    f = ah_wait_on(id, false);
    CHECK(ah_err_code(&f) == SP_AP_E_INVAL);

    /* Oversized frame: rejected on its stream, skipped, channel stays in sync. */
    id = ah_next_stream++;
    size_t big = SP_AP_MAX_PAYLOAD + 4096;
    uint8_t *junk = calloc(1, SP_AP_HDR_SIZE + big);
    sp_ap_hdr_t h = {.len = (uint32_t)big, .stream = id, .type = SP_AP_T_FS_STAT};
    sp_ap_hdr_encode(junk, &h);
    ah_write_all(junk, SP_AP_HDR_SIZE + big);
    free(junk);
    f = ah_wait_on(id, false);
    CHECK(ah_err_code(&f) == SP_AP_E_TOOBIG);
    ah_ping_ok();

    /* Reserved flags. */
    id = ah_next_stream++;
    ah_begin(id, SP_AP_T_FS_STAT, 0);
    ah_w.buf[10] = 0x00;
    ah_w.buf[11] = 0x80;
    ah_send_frame();
    f = ah_wait_on(id, false);
    CHECK(ah_err_code(&f) == SP_AP_E_PROTO);

    /* Opening on the agent's id space; reusing an open stream id. */
    ah_send_empty(SP_AP_STREAM_AGENT_BASE + 1, SP_AP_T_PROC_LIST, 0);
    f = ah_wait_on(SP_AP_STREAM_AGENT_BASE + 1, false);
    CHECK(ah_err_code(&f) == SP_AP_E_PROTO);
    id = start_proc("sleep 5", NULL, false, NULL);
    f = ah_wait_on(id, false);
    CHECK(f.h.type == SP_AP_T_PROC_STARTED);
    ah_send_empty(id, SP_AP_T_PROC_LIST, 0);
    f = ah_wait_on(id, false);
    CHECK(ah_err_code(&f) == SP_AP_E_BUSY);

    /* DATA beyond the window. */
    id = start_proc("sleep 5", NULL, false, NULL);
    f = ah_wait_on(id, false);
    uint8_t *blob = calloc(1, SP_AP_INITIAL_WINDOW + 1);
    send_data(id, blob, SP_AP_INITIAL_WINDOW + 1);
    free(blob);
    do
        f = ah_wait_on(id, false);
    while (f.h.type == SP_AP_T_WINDOW);
    CHECK(ah_err_code(&f) == SP_AP_E_PROTO);
    ah_ping_ok();

    /* Garbage: the host reconnects, the agent lives on. */
    uint8_t g[4096];
    for (size_t i = 0; i < sizeof(g); i++)
        g[i] = (uint8_t)(i * 131 + 7);
    ah_write_all(g, sizeof(g));
    usleep(100000);
    CHECK(ah_agent_alive());
    ah_connect(sock_path);
    hello();
    ah_ping_ok();
    CHECK(ah_agent_alive());
}

/* Two HELLOs read together (an earlier host's, unanswered, and the next one's, as a guest
 * finds them on resume): one answer each, in order, each naming its HELLO's session. */
static void test_agent_hello_answers_name_the_session(void)
{
    send_hello(0x1111);
    send_hello(0x2222);
    hello_answer(0x1111);
    hello_answer(0x2222);
    send_hello(0); /* a host that sends none gets none */
    hello_answer(0);
    ah_ping_ok();
}

int main(void)
{
    if (geteuid() != 0) {
        fprintf(stderr, "skip: needs root for user switching\n");
        return 77;
    }
    ah_prepare("sp-agent-test", tmpdir, sizeof(tmpdir), sock_path, sizeof(sock_path));
    start_agent();
    hello();
    test_agent_process_basics();
    test_agent_stdin_and_signal();
    test_agent_pty();
    test_agent_identity_and_ping();
    test_agent_file_roundtrip();
    test_agent_file_ops();
    test_agent_file_permissions();
    test_agent_paths_resolve_like_envd();
    test_agent_entry_targets_and_specials();
    test_agent_watch();
    test_agent_tcp();
    test_agent_flow_control();
    test_agent_reattach();
    test_agent_hello_answers_name_the_session();
    test_agent_malformed();
    CHECK(ah_agent_alive());
    kill(ah_agent_pid, SIGTERM);
    waitpid(ah_agent_pid, NULL, 0);
    char cmd[400];
    snprintf(cmd, sizeof(cmd), "rm -rf '%s'", tmpdir);
    if (system(cmd) != 0)
        fprintf(stderr, "cleanup failed\n");
    return check_report("agent");
}
