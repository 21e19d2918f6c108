/*
 * test_proctab.c - process records and lifetime kills (core/channel/proctab.h), without an
 * agent: the agent lookup is a stand-in that records what it was asked.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "base/log.h"
#include "core/channel/proctab.h"
#include "tests/check.h"

static sp_loop_t *loop;

static struct {
    int calls;
    int fail; /* answer -1 instead of calling back */
    char sandbox[65], team[64];
} lookup;

static int fake_agent(void *ctx, const char *sandbox_id, const char *team_id,
                      sp_proctab_agent_cb cb, void *arg)
{
    CHECK(ctx == &lookup);
    lookup.calls++;
    snprintf(lookup.sandbox, sizeof(lookup.sandbox), "%s", sandbox_id);
    snprintf(lookup.team, sizeof(lookup.team), "%s", team_id);
    if (lookup.fail)
        return -1;
    sp_err_t e;
    sp_err_set(&e, SP_ECONFLICT, "sandbox is paused");
    cb(arg, NULL, &e);
    return 0;
}

static void run_for(int ms)
{
    uint64_t end = sp_loop_now_ms(loop) + (uint64_t)ms;
    while (sp_loop_now_ms(loop) < end)
        sp_loop_run_once(loop, 5);
}

/* Runs the loop until the lookup has been asked n times, for at most 5 s: on a loaded machine
 * timers are late and starting thousands of them takes long, so a fixed wait is not enough. */
static void run_until_calls(int n)
{
    sp_loop_run_once(loop, 0); /* the loop's clock is now, not when it last ran */
    uint64_t end = sp_loop_now_ms(loop) + 5000;
    while (lookup.calls < n && sp_loop_now_ms(loop) < end)
        sp_loop_run_once(loop, 5);
}

static void test_proctab_records_are_copies(void)
{
    sp_proctab_t *t = sp_proctab_create(loop, fake_agent, &lookup);
    REQUIRE(t != NULL);
    char cmd[] = "python3", a0[] = "-c", a1[] = "print(1)", k[] = "A", v[] = "1", cwd[] = "/tmp";
    const char *args[] = {a0, a1};
    sp_proc_env_t envs[] = {{k, v}};
    sp_proc_spec_t spec = {.cmd = cmd, .args = args, .nargs = 2, .envs = envs, .nenvs = 1,
                           .cwd = cwd, .pty = true};
    CHECK(sp_proctab_put(t, "sb1", 42, &spec) == 0);
    memset(cmd, 'x', strlen(cmd));
    memset(a1, 'x', strlen(a1));
    memset(v, 'x', strlen(v));
    memset(cwd, 'x', strlen(cwd));
    const sp_proc_spec_t *r = sp_proctab_get(t, "sb1", 42);
    REQUIRE(r != NULL);
    CHECK(strcmp(r->cmd, "python3") == 0);
    CHECK(r->nargs == 2 && strcmp(r->args[0], "-c") == 0 && strcmp(r->args[1], "print(1)") == 0);
    CHECK(r->nenvs == 1 && strcmp(r->envs[0].key, "A") == 0 && strcmp(r->envs[0].value, "1") == 0);
    CHECK(r->cwd != NULL && strcmp(r->cwd, "/tmp") == 0);
    CHECK(r->pty);
    CHECK(sp_proctab_get(t, "sb2", 42) == NULL); /* another sandbox's pid 42 */
    CHECK(sp_proctab_get(t, "sb1", 43) == NULL);

    /* cwd: absent stays absent, empty stays empty; no cmd is "" */
    sp_proc_spec_t bare = {.cmd = NULL, .cwd = NULL};
    CHECK(sp_proctab_put(t, "sb1", 7, &bare) == 0);
    r = sp_proctab_get(t, "sb1", 7);
    CHECK(r != NULL && r->cwd == NULL && strcmp(r->cmd, "") == 0 && r->nargs == 0 &&
          r->nenvs == 0 && !r->pty);
    sp_proc_spec_t empty_cwd = {.cmd = "ls", .cwd = ""};
    CHECK(sp_proctab_put(t, "sb1", 8, &empty_cwd) == 0);
    r = sp_proctab_get(t, "sb1", 8);
    CHECK(r != NULL && r->cwd != NULL && r->cwd[0] == '\0');
    sp_proctab_destroy(t);
}

static void test_proctab_replace_forget_retain(void)
{
    sp_proctab_t *t = sp_proctab_create(loop, fake_agent, &lookup);
    REQUIRE(t != NULL);
    sp_proc_spec_t one = {.cmd = "one"}, two = {.cmd = "two"};
    CHECK(sp_proctab_put(t, "a", 1, &one) == 0);
    CHECK(sp_proctab_put(t, "a", 1, &two) == 0); /* the same process again: replaced */
    const sp_proc_spec_t *r = sp_proctab_get(t, "a", 1);
    CHECK(r != NULL && strcmp(r->cmd, "two") == 0);
    sp_proctab_forget(t, "a", 1);
    CHECK(sp_proctab_get(t, "a", 1) == NULL);
    sp_proctab_forget(t, "a", 1); /* unknown: nothing */

    for (uint32_t pid = 1; pid <= 3; pid++)
        CHECK(sp_proctab_put(t, "a", pid, &one) == 0);
    CHECK(sp_proctab_put(t, "b", 1, &one) == 0);
    uint32_t running[] = {2, 99};
    sp_proctab_retain(t, "a", running, 2);
    CHECK(sp_proctab_get(t, "a", 1) == NULL);
    CHECK(sp_proctab_get(t, "a", 2) != NULL);
    CHECK(sp_proctab_get(t, "a", 3) == NULL);
    CHECK(sp_proctab_get(t, "b", 1) != NULL); /* other sandboxes are not touched */
    sp_proctab_retain(t, "a", NULL, 0);
    CHECK(sp_proctab_get(t, "a", 2) == NULL);
    sp_proctab_destroy(t);
}

static void test_proctab_bounded_oldest_goes(void)
{
    sp_proctab_t *t = sp_proctab_create(loop, fake_agent, &lookup);
    REQUIRE(t != NULL);
    sp_proc_spec_t s = {.cmd = "sleep"};
    for (uint32_t pid = 1; pid <= SP_PROCTAB_MAX + 1; pid++)
        CHECK(sp_proctab_put(t, "a", pid, &s) == 0);
    CHECK(sp_proctab_get(t, "a", 1) == NULL);
    CHECK(sp_proctab_get(t, "a", 2) != NULL);
    CHECK(sp_proctab_get(t, "a", SP_PROCTAB_MAX + 1) != NULL);
    sp_proctab_destroy(t);
}

static void test_proctab_kill_after(void)
{
    sp_proctab_t *t = sp_proctab_create(loop, fake_agent, &lookup);
    REQUIRE(t != NULL);
    memset(&lookup, 0, sizeof(lookup));
    sp_proctab_kill_after(t, "sb1", "team1", 42, 300);
    run_for(10);
    CHECK(lookup.calls == 0); /* not before its time */
    run_until_calls(1);
    CHECK(lookup.calls == 1);
    CHECK(strcmp(lookup.sandbox, "sb1") == 0 && strcmp(lookup.team, "team1") == 0);

    /* A lookup that fails at once: the kill is dropped (no leak under ASan). */
    lookup.fail = 1;
    sp_proctab_kill_after(t, "sb2", "team1", 43, 1);
    run_until_calls(2);
    CHECK(lookup.calls == 2);

    /* Destroyed first: never asked. */
    lookup.fail = 0;
    sp_proctab_kill_after(t, "sb3", "team1", 44, 20);
    sp_proctab_destroy(t);
    run_for(50);
    CHECK(lookup.calls == 2);
}

static void test_proctab_kills_bounded(void)
{
    sp_proctab_t *t = sp_proctab_create(loop, fake_agent, &lookup);
    REQUIRE(t != NULL);
    memset(&lookup, 0, sizeof(lookup));
    for (uint32_t pid = 1; pid <= SP_PROCTAB_KILLS_MAX + 1; pid++)
        sp_proctab_kill_after(t, "a", "team", pid, 1);
    run_until_calls(SP_PROCTAB_KILLS_MAX);
    run_for(50);
    CHECK(lookup.calls == SP_PROCTAB_KILLS_MAX); /* the oldest was dropped */
    sp_proctab_destroy(t);
}

int main(void)
{
    const char *lvl = getenv("SP_TEST_LOG");
    if (lvl == NULL || sp_log_parse_level(lvl, &sp_log_min_level) < 0)
        sp_log_min_level = SP_LOG_ERROR;
    loop = sp_loop_create();
    test_proctab_records_are_copies();
    test_proctab_replace_forget_retain();
    test_proctab_bounded_oldest_goes();
    test_proctab_kill_after();
    test_proctab_kills_bounded();
    sp_loop_destroy(loop);
    return check_report("proctab");
}
