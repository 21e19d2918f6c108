/*
 * hostile_agent.c - a hostile guest agent stand-in for the list caps (core/channel/listcap.h):
 * it speaks the agent protocol (base/agentproto.h) like space-agent-host, and answers every
 * list with a flood. The test driver runs it per sandbox (SPACE_FAKE_AGENT, server/tests/
 * fakedriver.c: `--listen-unix SOCK`), so spaced's real routes reach it with no VM.
 *
 *   PROC_LIST    10 tiny entries, then huge ones whose tag, cmd, cwd and user are 255 KiB
 *                each (a frame of about 1 MiB): HOSTILE_HUGE of them (default 256) on the
 *                first list and every other one after, 2 on the others; then HOSTILE_ENTRIES
 *                tiny ones (default 1,000,000), then OK. So the first list passes the cap on
 *                bytes and the second the cap on entries.
 *   FS_LIST      the same with FS_ENTRY: path, name, owner, group, link and target of 170 KiB
 *                each in the huge ones, distinct names in the tiny ones
 *   WATCH_START  WATCH_STARTED, then HOSTILE_EVENTS events (default 30,000) named by 4000
 *                bytes each, never an end
 *   TCP_CONNECT  (the code daemon's port) TCP_CONNECTED, then a context list as the daemon's
 *                status line, sent under the window as DATA: on odd connections 5000 contexts
 *                (under 4 MiB), on even ones contexts up to 15 MiB
 *   FS_STAT      a directory (the routes stat a watched path first); anything else opening a
 *                stream: OK
 * A RESET from the host stops a flood. One connection at a time; a new one after EOF.
 */
#include <errno.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include "base/agentproto.h"

enum { F_PROC = 1, F_FS, F_WATCH, F_CODE };

typedef struct {
    uint32_t stream;
    int kind;
    uint64_t sent;   /* entries or events sent */
    uint64_t huge;   /* F_PROC, F_FS: huge entries in this list (after TINY_FIRST) */
    uint64_t credit; /* F_CODE: DATA bytes the host accepts */
    size_t line_off; /* F_CODE: of line */
    char *line;      /* F_CODE: the status line */
    size_t line_len;
} flood_t;

#define FLOODS_MAX 64

static flood_t floods[FLOODS_MAX];
static int fd = -1;
static unsigned long huge_n = 256, tiny_n = 1000000, events_n = 30000;
static unsigned code_conns, proc_lists, fs_lists;

#define TINY_FIRST 10
static uint8_t *out; /* one frame being built */
static char *big;    /* 1 MiB of 'A' */

static unsigned long env_ul(const char *name, unsigned long dflt)
{
    const char *v = getenv(name);
    return v != NULL && *v ? strtoul(v, NULL, 10) : dflt;
}

static int write_all(const uint8_t *p, size_t n)
{
    while (n > 0) {
        ssize_t k = write(fd, p, n);
        if (k < 0 && errno == EINTR)
            continue;
        if (k <= 0)
            return -1;
        p += k;
        n -= (size_t)k;
    }
    return 0;
}

/* Sends the frame the writer holds. */
static int send_w(sp_ap_writer_t *w)
{
    long n = sp_ap_frame_end(w);
    if (n < 0) {
        fprintf(stderr, "hostile-agent: frame too large\n");
        return -1;
    }
    return write_all(w->buf, (size_t)n);
}

static int send_simple(uint32_t stream, uint16_t type, uint16_t flags)
{
    sp_ap_writer_t w;
    sp_ap_writer_init(&w, out, SP_AP_MAX_FRAME);
    sp_ap_frame_begin(&w, stream, type, flags);
    return send_w(&w);
}

static void put_strn(sp_ap_writer_t *w, uint16_t tag, size_t n)
{
    sp_ap_put_bytes(w, tag, big, n);
}

static flood_t *flood_new(uint32_t stream, int kind)
{
    for (int i = 0; i < FLOODS_MAX; i++)
        if (floods[i].kind == 0) {
            floods[i] = (flood_t){.stream = stream, .kind = kind};
            return &floods[i];
        }
    return NULL;
}

static flood_t *flood_find(uint32_t stream)
{
    for (int i = 0; i < FLOODS_MAX; i++)
        if (floods[i].kind != 0 && floods[i].stream == stream)
            return &floods[i];
    return NULL;
}

static void flood_end(flood_t *f)
{
    free(f->line);
    *f = (flood_t){0};
}

/* The daemon's status line for a context list: n contexts with cwds of cwd_len bytes. */
static char *ctx_line(unsigned n, size_t cwd_len, size_t *len)
{
    size_t cap = 64 + (size_t)n * (cwd_len + 96);
    char *s = malloc(cap);
    if (s == NULL)
        return NULL;
    size_t k = (size_t)snprintf(s, cap, "{\"ok\":true,\"contexts\":[");
    for (unsigned i = 0; i < n; i++) {
        k += (size_t)snprintf(s + k, cap - k,
                              "%s{\"id\":\"ctx-%u\",\"language\":\"python\",\"default\":false,"
                              "\"cwd\":\"/",
                              i ? "," : "", i);
        memset(s + k, 'c', cwd_len);
        k += cwd_len;
        k += (size_t)snprintf(s + k, cap - k, "\"}");
    }
    k += (size_t)snprintf(s + k, cap - k, "]}\n");
    *len = k;
    return s;
}

/* One more frame of flood f; 1 when it is over (the stream ended), -1 on a write error. */
static int flood_step(flood_t *f)
{
    sp_ap_writer_t w;
    sp_ap_writer_init(&w, out, SP_AP_MAX_FRAME);
    if (f->kind == F_PROC || f->kind == F_FS) {
        if (f->sent >= TINY_FIRST + f->huge + tiny_n) {
            uint32_t stream = f->stream;
            flood_end(f);
            return send_simple(stream, SP_AP_T_OK, SP_AP_F_END) < 0 ? -1 : 1;
        }
        bool huge = f->sent >= TINY_FIRST && f->sent < TINY_FIRST + f->huge;
        char name[64];
        snprintf(name, sizeof(name), "f%llu", (unsigned long long)f->sent);
        if (f->kind == F_PROC) {
            sp_ap_frame_begin(&w, f->stream, SP_AP_T_PROC_INFO, 0);
            sp_ap_put_u32(&w, SP_AP_K_PID, (uint32_t)(f->sent + 2));
            sp_ap_put_u32(&w, SP_AP_K_RUNNING, 1);
            sp_ap_put_u64(&w, SP_AP_K_STARTED_NS, 1700000000000000000ull);
            if (huge) {
                put_strn(&w, SP_AP_K_TAG, 255 * 1024);
                put_strn(&w, SP_AP_K_ARGV, 255 * 1024);
                put_strn(&w, SP_AP_K_CWD, 255 * 1024);
                put_strn(&w, SP_AP_K_USER, 255 * 1024);
            } else {
                sp_ap_put_str(&w, SP_AP_K_TAG, name);
                sp_ap_put_str(&w, SP_AP_K_ARGV, "sleep 1000");
                sp_ap_put_str(&w, SP_AP_K_CWD, "/");
                sp_ap_put_str(&w, SP_AP_K_USER, "root");
            }
        } else {
            sp_ap_entry_t e = {.ftype = huge ? SP_AP_FT_SYMLINK : SP_AP_FT_FILE,
                               .size = 1,
                               .mode = 0644,
                               .mtime_ns = 1700000000000000000ull};
            size_t n = 170 * 1024;
            if (huge) {
                e.path = e.name = e.owner = e.group = e.link = e.target = (sp_ap_str_t){big, n};
                e.target_ftype = SP_AP_FT_FILE;
            } else {
                e.name = (sp_ap_str_t){name, (uint32_t)strlen(name)};
                e.path = e.name;
                e.owner = e.group = (sp_ap_str_t){"root", 4};
            }
            sp_ap_frame_begin(&w, f->stream, SP_AP_T_FS_ENTRY, 0);
            sp_ap_put_entry(&w, &e);
        }
        f->sent++;
        return send_w(&w) < 0 ? -1 : 0;
    }
    if (f->kind == F_WATCH) {
        if (f->sent >= events_n)
            return 1; /* quiet from here on; never an end */
        char name[4001];
        int k = snprintf(name, sizeof(name), "e%llu-", (unsigned long long)f->sent);
        memset(name + k, 'w', sizeof(name) - 1 - (size_t)k);
        name[sizeof(name) - 1] = '\0';
        char path[4100];
        snprintf(path, sizeof(path), "/tmp/%s", name);
        sp_ap_frame_begin(&w, f->stream, SP_AP_T_WATCH_EVENT, 0);
        sp_ap_put_str(&w, SP_AP_K_PATH, path);
        sp_ap_put_str(&w, SP_AP_K_NAME, name);
        sp_ap_put_u32(&w, SP_AP_K_EVENT, SP_AP_EV_CREATE);
        sp_ap_put_u32(&w, SP_AP_K_FTYPE, SP_AP_FT_FILE);
        f->sent++;
        return send_w(&w) < 0 ? -1 : 0;
    }
    /* F_CODE: the line as DATA under the host's window, then EOF and OK. */
    if (f->line_off < f->line_len) {
        size_t n = f->line_len - f->line_off;
        if (n > SP_AP_MAX_DATA)
            n = SP_AP_MAX_DATA;
        if (n > f->credit)
            n = (size_t)f->credit;
        if (n == 0)
            return 1; /* wait for WINDOW */
        sp_ap_frame_begin(&w, f->stream, SP_AP_T_DATA, 0);
        sp_ap_put_raw(&w, f->line + f->line_off, n);
        f->line_off += n;
        f->credit -= n;
        return send_w(&w) < 0 ? -1 : 0;
    }
    return 1; /* the host closes the connection once it read the line */
}

static void on_hello(const uint8_t *p, uint32_t n)
{
    sp_ap_hello_t in;
    sp_err_t err;
    if (sp_ap_dec_hello(p, n, &in, &err) < 0)
        return;
    sp_ap_writer_t w;
    sp_ap_writer_init(&w, out, SP_AP_MAX_FRAME);
    sp_ap_hello_t m = {.version = SP_AP_VERSION,
                       .agent_version = {"hostile-1", 9},
                       .caps = SP_AP_CAP_PTY | SP_AP_CAP_WATCH | SP_AP_CAP_TCP | SP_AP_CAP_IDENTITY,
                       .boot_ns = 1,
                       .session = in.session};
    long len = sp_ap_enc_hello(&w, &m);
    if (len > 0)
        write_all(out, (size_t)len);
}

static int on_frame(const sp_ap_hdr_t *h, const uint8_t *p)
{
    if (h->stream == 0) {
        if (h->type == SP_AP_T_HELLO)
            on_hello(p, h->len);
        return 0;
    }
    flood_t *f = flood_find(h->stream);
    if (h->type == SP_AP_T_RESET) {
        if (f != NULL)
            flood_end(f);
        return 0;
    }
    if (h->type == SP_AP_T_WINDOW) {
        uint32_t inc = 0;
        sp_ap_get_u32(p, h->len, SP_AP_K_WINDOW, &inc);
        if (f != NULL)
            f->credit += inc;
        return 0;
    }
    if (h->type == SP_AP_T_EOF && f != NULL && f->kind == F_CODE) {
        /* The host closed its side: both closed once we are done. */
        return 0;
    }
    if (!sp_ap_type_opens(h->type))
        return 0;
    sp_ap_writer_t w;
    switch (h->type) {
    case SP_AP_T_PROC_LIST:
    case SP_AP_T_FS_LIST: {
        bool proc = h->type == SP_AP_T_PROC_LIST;
        flood_t *l = flood_new(h->stream, proc ? F_PROC : F_FS);
        if (l == NULL)
            return send_simple(h->stream, SP_AP_T_OK, SP_AP_F_END);
        unsigned *n = proc ? &proc_lists : &fs_lists;
        l->huge = ++*n % 2 == 1 ? huge_n : 2; /* odd lists: past the byte cap */
        return 0;
    }
    case SP_AP_T_WATCH_START:
        if (send_simple(h->stream, SP_AP_T_WATCH_STARTED, 0) < 0)
            return -1;
        flood_new(h->stream, F_WATCH);
        return 0;
    case SP_AP_T_TCP_CONNECT: {
        if (send_simple(h->stream, SP_AP_T_TCP_CONNECTED, 0) < 0)
            return -1;
        flood_t *c = flood_new(h->stream, F_CODE);
        if (c == NULL)
            return 0;
        c->credit = SP_AP_INITIAL_WINDOW;
        bool big_one = (++code_conns % 2) == 0;
        c->line = big_one ? ctx_line(3600, 4000, &c->line_len) : ctx_line(5000, 16, &c->line_len);
        return 0;
    }
    case SP_AP_T_FS_STAT: {
        sp_ap_entry_t e = {.ftype = SP_AP_FT_DIR, .mode = 0755, .mtime_ns = 1};
        sp_ap_str_t path = {0};
        sp_ap_get_str(p, h->len, SP_AP_K_PATH, &path);
        e.path = path.p ? path : (sp_ap_str_t){"/", 1};
        e.name = e.path;
        e.owner = e.group = (sp_ap_str_t){"root", 4};
        sp_ap_writer_init(&w, out, SP_AP_MAX_FRAME);
        sp_ap_frame_begin(&w, h->stream, SP_AP_T_OK, SP_AP_F_END);
        sp_ap_put_entry(&w, &e);
        return send_w(&w);
    }
    default:
        return send_simple(h->stream, SP_AP_T_OK, SP_AP_F_END);
    }
}

static bool any_flood_ready(void)
{
    for (int i = 0; i < FLOODS_MAX; i++) {
        flood_t *f = &floods[i];
        if (f->kind == F_PROC || f->kind == F_FS)
            return true;
        if (f->kind == F_WATCH && f->sent < events_n)
            return true;
        if (f->kind == F_CODE && f->line_off < f->line_len && f->credit > 0)
            return true;
    }
    return false;
}

static void serve(void)
{
    static uint8_t rbuf[SP_AP_MAX_FRAME + 65536];
    sp_ap_reader_t r;
    sp_ap_reader_init(&r, rbuf, sizeof(rbuf));
    for (;;) {
        struct pollfd pfd = {.fd = fd, .events = POLLIN};
        int pr = poll(&pfd, 1, any_flood_ready() ? 0 : 1000);
        if (pr < 0 && errno != EINTR)
            return;
        if (pr > 0) {
            size_t avail;
            uint8_t *sp = sp_ap_reader_space(&r, &avail);
            ssize_t k = read(fd, sp, avail);
            if (k <= 0)
                return;
            sp_ap_reader_commit(&r, (size_t)k);
            sp_ap_hdr_t h;
            const uint8_t *p;
            sp_ap_rd_result_t rr;
            while ((rr = sp_ap_reader_next(&r, &h, &p)) != SP_AP_RD_NEED)
                if (rr == SP_AP_RD_FRAME && on_frame(&h, p) < 0)
                    return;
        }
        /* A batch of each flood, then look at what the host said. */
        for (int i = 0; i < FLOODS_MAX; i++)
            for (int b = 0; b < 32 && floods[i].kind != 0; b++) {
                int rc = flood_step(&floods[i]);
                if (rc < 0)
                    return;
                if (rc > 0)
                    break;
            }
    }
}

int main(int argc, char **argv)
{
    const char *path = NULL;
    for (int i = 1; i + 1 < argc; i++)
        if (strcmp(argv[i], "--listen-unix") == 0)
            path = argv[i + 1];
    if (path == NULL) {
        fprintf(stderr, "usage: hostile-agent --listen-unix SOCK\n");
        return 2;
    }
    huge_n = env_ul("HOSTILE_HUGE", huge_n);
    tiny_n = env_ul("HOSTILE_ENTRIES", tiny_n);
    events_n = env_ul("HOSTILE_EVENTS", events_n);
    out = malloc(SP_AP_MAX_FRAME);
    big = malloc(1u << 20);
    if (out == NULL || big == NULL)
        return 1;
    memset(big, 'A', 1u << 20);
    int ls = socket(AF_UNIX, SOCK_STREAM, 0);
    struct sockaddr_un sa = {.sun_family = AF_UNIX};
    if (ls < 0 || strlen(path) >= sizeof(sa.sun_path))
        return 1;
    strcpy(sa.sun_path, path);
    unlink(path);
    if (bind(ls, (struct sockaddr *)&sa, sizeof(sa)) < 0 || listen(ls, 4) < 0) {
        perror("hostile-agent: listen");
        return 1;
    }
    for (;;) {
        fd = accept(ls, NULL, NULL);
        if (fd < 0) {
            if (errno == EINTR)
                continue;
            return 1;
        }
        serve();
        close(fd);
        fd = -1;
        for (int i = 0; i < FLOODS_MAX; i++)
            if (floods[i].kind != 0)
                flood_end(&floods[i]);
    }
}
