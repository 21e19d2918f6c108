/*
 * test_download.c - core/channel/download.h against a real space-agent (skips without one):
 * the sizes a response is started with, credit that waits for the client, errors before and
 * after the response started, and a client that leaves.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "base/log.h"
#include "core/channel/download.h"
#include "core/channel/tests/real_agent.h"
#include "tests/check.h"

static sp_loop_t *loop;
static char dir[] = "/tmp/sp-download-test.XXXXXX";

/* A surface's sink, recording what it was asked. */
struct sink {
    sp_download_t *dl;
    int begins, ends, fails;
    long long length;
    bool ok;
    sp_err_t err;
    uint8_t *got;
    size_t got_len;
    bool refuse_begin; /* begin answers NULL: the client left before the response */
    bool refuse_write; /* write answers -1 */
    bool ack;          /* give credit back at once, as a client that reads */
};

static void *s_begin(void *arg, long long length, sp_download_t *dl)
{
    struct sink *k = arg;
    k->begins++;
    k->length = length;
    k->dl = dl;
    return k->refuse_begin ? NULL : k; /* the sink's own output: here itself */
}

static int s_write(void *out, const uint8_t *p, size_t n)
{
    struct sink *k = out;
    if (k->refuse_write)
        return -1;
    uint8_t *g = realloc(k->got, k->got_len + n);
    REQUIRE(g != NULL);
    memcpy(g + k->got_len, p, n);
    k->got = g;
    k->got_len += n;
    if (k->ack)
        sp_download_sent(k->dl, n);
    return 0;
}

static void s_end(void *out, bool ok)
{
    struct sink *k = out;
    k->ends++;
    k->ok = ok;
}

static void s_fail(void *arg, const sp_err_t *err)
{
    struct sink *k = arg;
    k->fails++;
    k->err = *err;
}

static const sp_download_sink_t sink_cbs = {s_begin, s_write, s_end, s_fail};

static bool done(const struct sink *k)
{
    return k->ends + k->fails > 0 || (k->refuse_begin && k->begins > 0);
}

static void run_until_done(struct sink *k, int ms)
{
    uint64_t end = sp_loop_now_ms(loop) + (uint64_t)ms;
    while (!done(k) && sp_loop_now_ms(loop) < end)
        sp_loop_run_once(loop, 10);
}

static void run_for(int ms)
{
    uint64_t end = sp_loop_now_ms(loop) + (uint64_t)ms;
    while (sp_loop_now_ms(loop) < end)
        sp_loop_run_once(loop, 10);
}

static char *write_file(const char *name, size_t n)
{
    static char path[256];
    snprintf(path, sizeof(path), "%s/%s", dir, name);
    FILE *f = fopen(path, "w");
    REQUIRE(f != NULL);
    for (size_t i = 0; i < n; i++)
        fputc('a' + (int)(i % 26), f);
    fclose(f);
    return path;
}

static int start(sp_agentconn_t *c, const char *path, bool empty_if_zero, const char *dir_msg,
                 struct sink *k)
{
    sp_download_req_t r = {.path = path, .empty_if_zero = empty_if_zero, .dir_msg = dir_msg};
    sp_err_t e;
    return sp_download_start(loop, c, &r, &sink_cbs, k, &e);
}

static void test_download_sized_file(sp_agentconn_t *c)
{
    struct sink k = {.ack = true};
    const char *path = write_file("small", 1000);
    REQUIRE(start(c, path, false, NULL, &k) == 0);
    CHECK(k.begins == 0); /* never inside the call */
    run_until_done(&k, 5000);
    CHECK(k.begins == 1 && k.length == 1000);
    CHECK(k.ends == 1 && k.ok && k.fails == 0);
    CHECK(k.got_len == 1000 && k.got[0] == 'a' && k.got[999] == 'a' + 999 % 26);
    free(k.got);
}

static void test_download_waits_for_credit(sp_agentconn_t *c)
{
    size_t size = 4 * SP_AP_INITIAL_WINDOW;
    struct sink k = {0};
    const char *path = write_file("big", size);
    REQUIRE(start(c, path, false, NULL, &k) == 0);
    run_for(300);
    /* The client took nothing: the agent stopped at one window. */
    CHECK(k.begins == 1 && k.length == (long long)size);
    CHECK(k.got_len > 0 && k.got_len <= SP_AP_INITIAL_WINDOW);
    CHECK(k.ends == 0);
    sp_download_sent(k.dl, k.got_len);
    k.ack = true;
    run_until_done(&k, 5000);
    CHECK(k.ends == 1 && k.ok && k.got_len == size);
    free(k.got);

    /* The client leaves while the agent waits for credit: no more callbacks. */
    struct sink g = {0};
    REQUIRE(start(c, path, false, NULL, &g) == 0);
    run_for(300);
    CHECK(g.begins == 1 && g.got_len > 0);
    sp_download_gone(g.dl);
    run_for(100);
    CHECK(g.ends == 0 && g.fails == 0);
    free(g.got);
}

static void test_download_empty_and_unsized(sp_agentconn_t *c)
{
    const char *path = write_file("empty", 0);
    struct sink k = {.ack = true};
    REQUIRE(start(c, path, true, NULL, &k) == 0); /* envd: empty body, no read */
    run_until_done(&k, 5000);
    CHECK(k.begins == 1 && k.length == 0 && k.ends == 1 && k.ok && k.got_len == 0);

    struct sink u = {.ack = true};
    REQUIRE(start(c, path, false, NULL, &u) == 0); /* read to the end, chunked */
    run_until_done(&u, 5000);
    CHECK(u.begins == 1 && u.length == -1 && u.ends == 1 && u.ok && u.got_len == 0);

    /* A /proc file reports size 0 but has bytes: read to its end unless told otherwise. */
    struct sink p = {.ack = true};
    REQUIRE(start(c, "/proc/self/status", false, NULL, &p) == 0);
    run_until_done(&p, 5000);
    CHECK(p.begins == 1 && p.length == -1 && p.ends == 1 && p.ok && p.got_len > 0);
    free(p.got);
    struct sink q = {.ack = true};
    REQUIRE(start(c, "/proc/self/status", true, NULL, &q) == 0);
    run_until_done(&q, 5000);
    CHECK(q.begins == 1 && q.length == 0 && q.ends == 1 && q.ok && q.got_len == 0);
}

static void test_download_errors(sp_agentconn_t *c)
{
    struct sink d = {0};
    REQUIRE(start(c, dir, false, NULL, &d) == 0);
    run_until_done(&d, 5000);
    CHECK(d.fails == 1 && d.begins == 0 && d.err.code == SP_EINVAL &&
          strcmp(d.err.msg, "path is a directory") == 0);

    struct sink h = {0};
    REQUIRE(start(c, dir, false, "path is a directory (use files/list)", &h) == 0);
    run_until_done(&h, 5000);
    CHECK(h.fails == 1 && strcmp(h.err.msg, "path is a directory (use files/list)") == 0);

    char missing[300];
    snprintf(missing, sizeof(missing), "%s/missing", dir);
    struct sink m = {0};
    REQUIRE(start(c, missing, false, NULL, &m) == 0);
    run_until_done(&m, 5000);
    CHECK(m.fails == 1 && m.begins == 0 && m.err.code == SP_ENOTFOUND);

    struct sink b = {.refuse_begin = true};
    REQUIRE(start(c, write_file("refused", 10), false, NULL, &b) == 0);
    run_until_done(&b, 5000);
    run_for(50);
    CHECK(b.begins == 1 && b.ends == 0 && b.fails == 0);

    struct sink w = {.refuse_write = true};
    REQUIRE(start(c, write_file("cut", 10), false, NULL, &w) == 0);
    run_until_done(&w, 5000);
    CHECK(w.begins == 1 && w.ends == 1 && !w.ok && w.fails == 0);

    sp_err_t e;
    sp_download_req_t bad = {.path = ""};
    CHECK(sp_download_start(loop, c, &bad, &sink_cbs, NULL, &e) < 0 && e.code == SP_EINVAL);
    sp_download_req_t nochan = {.path = "/etc/hostname"};
    CHECK(sp_download_start(loop, NULL, &nochan, &sink_cbs, NULL, &e) < 0 &&
          e.code == SP_EUNAVAIL);
}

int main(void)
{
    const char *bin = real_agent_bin("download");
    if (bin == NULL)
        return 77;
    REQUIRE(real_agent_prepare(dir));
    loop = sp_loop_create();
    struct agent a = {0};
    CHECK(agent_start(loop, bin, dir, &a, "agent"));
    if (a.c != NULL && sp_agentconn_up(a.c)) {
        test_download_sized_file(a.c);
        test_download_waits_for_credit(a.c);
        test_download_empty_and_unsized(a.c);
        test_download_errors(a.c);
    }
    agent_stop(&a);
    run_for(50);
    sp_loop_destroy(loop);
    const char *names[] = {"small", "big", "empty", "refused", "cut"};
    for (size_t i = 0; i < sizeof(names) / sizeof(names[0]); i++) {
        char p[300];
        snprintf(p, sizeof(p), "%s/%s", dir, names[i]);
        unlink(p);
    }
    rmdir(dir);
    return check_report("download");
}
