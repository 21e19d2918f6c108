/*
 * test_fswatch.c - core/channel/fswatch.h: cooking agent events (no agent needed), and the
 * polling watchers against a real space-agent (those cases skip without one): events
 * buffered until polled, scoping by sandbox, a watch that ends, removal, and a table
 * destroyed while a watcher starts.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "base/log.h"
#include "core/channel/fswatch.h"
#include "core/channel/tests/real_agent.h"
#include "tests/check.h"

static sp_loop_t *loop;
static char dir[] = "/tmp/sp-fswatch-test.XXXXXX";

/* ---- cooking ---- */

static int cook(sp_fswatch_cook_t *ck, const char *root, const char *path, uint32_t bits,
                const char **rel, uint32_t out[5])
{
    const char *name = strrchr(path, '/');
    return sp_fswatch_cook(ck, root, path, name ? name + 1 : path, bits, rel, out);
}

static void test_fswatch_cook_names_and_kinds(void)
{
    sp_fswatch_cook_t ck = {0};
    const char *rel;
    uint32_t ev[5];
    int n = cook(&ck, "/home/user", "/home/user/a.txt", SP_AP_EV_WRITE | SP_AP_EV_CREATE, &rel,
                 ev);
    CHECK(n == 2 && ev[0] == SP_AP_EV_CREATE && ev[1] == SP_AP_EV_WRITE);
    CHECK(strcmp(rel, "a.txt") == 0);
    n = cook(&ck, "/home/user/", "/home/user/sub/b", SP_AP_EV_CHMOD | SP_AP_EV_REMOVE, &rel, ev);
    CHECK(n == 2 && ev[0] == SP_AP_EV_REMOVE && ev[1] == SP_AP_EV_CHMOD);
    CHECK(strcmp(rel, "sub/b") == 0); /* relative, subdirectories kept */
    n = cook(&ck, "/home/user", "/elsewhere/c", SP_AP_EV_RENAME, &rel, ev);
    CHECK(n == 1 && ev[0] == SP_AP_EV_RENAME && strcmp(rel, "c") == 0); /* not under root */
}

static void test_fswatch_cook_atomic_writes(void)
{
    sp_fswatch_cook_t ck = {0};
    const char *rel;
    uint32_t ev[5];
    /* The agent's temporary file: its own events are not reported. */
    CHECK(cook(&ck, "/r", "/r/.a.txt.sp-12-3", SP_AP_EV_CREATE, &rel, ev) == 0);
    CHECK(cook(&ck, "/r", "/r/.a.txt.sp-12-3", SP_AP_EV_WRITE, &rel, ev) == 0);
    CHECK(cook(&ck, "/r", "/r/.a.txt.sp-12-3", SP_AP_EV_RENAME, &rel, ev) == 0);
    /* The rename that lands it reads as create + write of the name, once. */
    int n = cook(&ck, "/r", "/r/a.txt", SP_AP_EV_RENAME, &rel, ev);
    CHECK(n == 2 && ev[0] == SP_AP_EV_CREATE && ev[1] == SP_AP_EV_WRITE && !strcmp(rel, "a.txt"));
    n = cook(&ck, "/r", "/r/a.txt", SP_AP_EV_RENAME, &rel, ev);
    CHECK(n == 1 && ev[0] == SP_AP_EV_RENAME);
    /* In a subdirectory, with its directory kept. */
    CHECK(cook(&ck, "/r", "/r/sub/.x.sp-1-2", SP_AP_EV_RENAME, &rel, ev) == 0);
    n = cook(&ck, "/r", "/r/sub/x", SP_AP_EV_RENAME, &rel, ev);
    CHECK(n == 2 && ev[0] == SP_AP_EV_CREATE && strcmp(rel, "sub/x") == 0);
    /* Names that only look alike are reported as they are. */
    CHECK(cook(&ck, "/r", "/r/.hidden", SP_AP_EV_CREATE, &rel, ev) == 1);
    CHECK(cook(&ck, "/r", "/r/.a.sp-x-1", SP_AP_EV_CREATE, &rel, ev) == 1);
    CHECK(cook(&ck, "/r", "/r/.a.sp-12-", SP_AP_EV_CREATE, &rel, ev) == 1);
    CHECK(cook(&ck, "/r", "/r/..sp-1-2", SP_AP_EV_CREATE, &rel, ev) == 1);
}

/* ---- polling watchers ---- */

struct created {
    int calls;
    char id[SP_FSWATCH_ID_MAX];
    sp_err_t err;
    bool failed;
};

static void on_created(void *arg, const char *id, const sp_err_t *err)
{
    struct created *c = arg;
    c->calls++;
    c->failed = err != NULL;
    if (err != NULL)
        c->err = *err;
    else
        snprintf(c->id, sizeof(c->id), "%s", id);
}

static void run_until(const int *flag, int ms)
{
    uint64_t end = sp_loop_now_ms(loop) + (uint64_t)ms;
    while (!*flag && sp_loop_now_ms(loop) < end)
        sp_loop_run_once(loop, 10);
}

static void run_for(int ms)
{
    uint64_t end = sp_loop_now_ms(loop) + (uint64_t)ms;
    while (sp_loop_now_ms(loop) < end)
        sp_loop_run_once(loop, 10);
}

struct polled {
    int calls;
    size_t n;
    bool created_f1, wrote_f1;
};

static int on_polled(void *arg, const sp_fswatch_ev_t *evs, size_t n)
{
    struct polled *p = arg;
    p->calls++;
    p->n = n;
    for (size_t i = 0; i < n; i++) {
        if (strcmp(evs[i].name, "f1") == 0 && evs[i].ev == SP_AP_EV_CREATE)
            p->created_f1 = true;
        if (strcmp(evs[i].name, "f1") == 0 && evs[i].ev == SP_AP_EV_WRITE)
            p->wrote_f1 = true;
    }
    return 0;
}

static int refuse(void *arg, const sp_fswatch_ev_t *evs, size_t n)
{
    return -1;
}

static void touch(const char *name)
{
    char p[300];
    snprintf(p, sizeof(p), "%s/%s", dir, name);
    FILE *f = fopen(p, "w");
    REQUIRE(f != NULL);
    fputs("x", f);
    fclose(f);
}

static void test_fswatch_poll_scope_remove(sp_agentconn_t *c)
{
    sp_fswatch_tab_t *t = sp_fswatch_tab_create(loop);
    REQUIRE(t != NULL);
    struct created cr = {0};
    sp_err_t e;
    REQUIRE(sp_fswatch_create(t, c, "sb1", dir, NULL, false, on_created, &cr, &e) == 0);
    CHECK(cr.calls == 0); /* never inside the call */
    struct polled p = {0};
    CHECK(sp_fswatch_poll(t, "sb1", cr.id, on_polled, &p, &e) < 0); /* not started yet */
    run_until(&cr.calls, 5000);
    REQUIRE(cr.calls == 1 && !cr.failed && cr.id[0] == 'w');

    CHECK(sp_fswatch_poll(t, "sb1", cr.id, on_polled, &p, &e) == 0 && p.calls == 1 && p.n == 0);
    touch("f1");
    run_for(300);
    CHECK(sp_fswatch_poll(t, "sb1", cr.id, refuse, NULL, &e) < 0 && e.code == SP_EINTERNAL);
    memset(&p, 0, sizeof(p));
    CHECK(sp_fswatch_poll(t, "sb1", cr.id, on_polled, &p, &e) == 0); /* nothing was lost */
    CHECK(p.n > 0 && p.created_f1 && p.wrote_f1);
    memset(&p, 0, sizeof(p));
    CHECK(sp_fswatch_poll(t, "sb1", cr.id, on_polled, &p, &e) == 0 && p.n == 0); /* emptied */

    /* Another sandbox, or an unknown id: not found. */
    CHECK(sp_fswatch_poll(t, "sb2", cr.id, on_polled, &p, &e) < 0 && e.code == SP_ENOTFOUND &&
          strcmp(e.msg, "watcher not found") == 0);
    CHECK(sp_fswatch_remove(t, "sb2", cr.id, &e) < 0 && e.code == SP_ENOTFOUND);
    CHECK(sp_fswatch_poll(t, "sb1", "wnope", on_polled, &p, &e) < 0 && e.code == SP_ENOTFOUND);
    CHECK(sp_fswatch_poll(t, "sb1", NULL, on_polled, &p, &e) < 0 && e.code == SP_ENOTFOUND);

    CHECK(sp_fswatch_remove(t, "sb1", cr.id, &e) == 0);
    CHECK(sp_fswatch_poll(t, "sb1", cr.id, on_polled, &p, &e) < 0 && e.code == SP_ENOTFOUND);

    /* A directory that is not there: the creation fails through its callback. */
    char missing[300];
    snprintf(missing, sizeof(missing), "%s/missing", dir);
    struct created bad = {0};
    REQUIRE(sp_fswatch_create(t, c, "sb1", missing, NULL, false, on_created, &bad, &e) == 0);
    run_until(&bad.calls, 5000);
    CHECK(bad.calls == 1 && bad.failed && bad.err.code == SP_ENOTFOUND);

    /* No channel: refused at once. */
    CHECK(sp_fswatch_create(t, NULL, "sb1", dir, NULL, false, on_created, &bad, &e) < 0 &&
          e.code == SP_EUNAVAIL && bad.calls == 1);
    sp_fswatch_tab_destroy(t);
}

static void test_fswatch_ended_watch_reports_why(const char *bin)
{
    struct agent a = {0};
    REQUIRE(agent_start(loop, bin, dir, &a, "ending"));
    sp_fswatch_tab_t *t = sp_fswatch_tab_create(loop);
    REQUIRE(t != NULL);
    struct created cr = {0};
    sp_err_t e;
    REQUIRE(sp_fswatch_create(t, a.c, "sb1", dir, NULL, false, on_created, &cr, &e) == 0);
    run_until(&cr.calls, 5000);
    REQUIRE(cr.calls == 1 && !cr.failed);
    touch("f1");
    run_for(300);
    agent_stop(&a); /* the channel goes: the watch ends */
    run_for(50);
    struct polled p = {0};
    CHECK(sp_fswatch_poll(t, "sb1", cr.id, on_polled, &p, &e) == 0 && p.wrote_f1);
    CHECK(sp_fswatch_poll(t, "sb1", cr.id, on_polled, &p, &e) < 0 && e.code == SP_EUNAVAIL &&
          e.msg[0] != '\0');
    CHECK(sp_fswatch_remove(t, "sb1", cr.id, &e) == 0);
    sp_fswatch_tab_destroy(t);
}

static void test_fswatch_destroyed_while_starting(sp_agentconn_t *c)
{
    sp_fswatch_tab_t *t = sp_fswatch_tab_create(loop);
    REQUIRE(t != NULL);
    struct created cr = {0};
    sp_err_t e;
    REQUIRE(sp_fswatch_create(t, c, "sb1", dir, NULL, true, on_created, &cr, &e) == 0);
    sp_fswatch_tab_destroy(t);
    CHECK(cr.calls == 1 && cr.failed && cr.err.code == SP_EUNAVAIL);
    run_for(100);
    CHECK(cr.calls == 1);
}

int main(void)
{
    test_fswatch_cook_names_and_kinds();
    test_fswatch_cook_atomic_writes();
    const char *bin = real_agent_bin("fswatch");
    if (bin == NULL)
        return failures ? 1 : 77;
    REQUIRE(real_agent_prepare(dir));
    loop = sp_loop_create();
    struct agent a = {0};
    CHECK(agent_start(loop, bin, dir, &a, "agent"));
    if (a.c != NULL && sp_agentconn_up(a.c)) {
        test_fswatch_poll_scope_remove(a.c);
        test_fswatch_destroyed_while_starting(a.c);
        test_fswatch_ended_watch_reports_why(bin);
    }
    agent_stop(&a);
    run_for(50);
    sp_loop_destroy(loop);
    char p[300];
    snprintf(p, sizeof(p), "%s/f1", dir);
    unlink(p);
    rmdir(dir);
    return check_report("fswatch");
}
