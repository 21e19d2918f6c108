/*
 * test_sandbox.c - every allowed and every refused transition of the lifecycle tables.
 */
#include <stdio.h>
#include <string.h>

#include "core/control/sandbox.h"
#include "tests/check.h"

/* Requests: the expected outcome for every (request, desired) with a healthy observed state. */
static void test_sandbox_requests(void)
{
    /* rows: pause, suspend, wake, delete; cols: running, paused, suspended, deleted.
     * value: resulting desired, or -1 conflict, -2 not found */
    static const int want[SP_REQ__COUNT][SP_DESIRED__COUNT] = {
        {SP_DESIRED_PAUSED, -1, -1, -2},
        {SP_DESIRED_SUSPENDED, SP_DESIRED_SUSPENDED, -1, -2},
        {-1, SP_DESIRED_RUNNING, SP_DESIRED_RUNNING, -2},
        {SP_DESIRED_DELETED, SP_DESIRED_DELETED, SP_DESIRED_DELETED, -2},
    };
    for (int r = 0; r < SP_REQ__COUNT; r++)
        for (int d = 0; d < SP_DESIRED__COUNT; d++) {
            sp_desired_t out;
            sp_err_t e = {0};
            int rc = sp_sandbox_request((sp_desired_t)d, SP_OBS_RUNNING, (sp_request_t)r, &out, &e);
            if (want[r][d] >= 0) {
                CHECK(rc == 0);
                CHECK(rc == 0 && (int)out == want[r][d]);
            } else {
                CHECK(rc == -1);
                CHECK(e.code == (want[r][d] == -1 ? SP_ECONFLICT : SP_ENOTFOUND));
            }
        }
}

static void test_sandbox_failed_only_deletes(void)
{
    for (int r = 0; r < SP_REQ__COUNT; r++) {
        sp_desired_t out;
        sp_err_t e = {0};
        int rc = sp_sandbox_request(SP_DESIRED_RUNNING, SP_OBS_FAILED, (sp_request_t)r, &out, &e);
        if (r == SP_REQ_DELETE)
            CHECK(rc == 0 && out == SP_DESIRED_DELETED);
        else
            CHECK(rc == -1 && e.code == SP_ECONFLICT);
    }
    sp_desired_t out;
    CHECK(sp_sandbox_request((sp_desired_t)99, SP_OBS_RUNNING, SP_REQ_PAUSE, &out, NULL) == -1);
    CHECK(sp_sandbox_request(SP_DESIRED_RUNNING, SP_OBS_RUNNING, (sp_request_t)99, &out, NULL) ==
          -1);
}

/* The full observed-transition matrix: exactly these pairs are allowed. */
static void test_sandbox_observed_matrix(void)
{
    static const char *allowed[] = {
        "pending>starting",      "pending>stopping",     "pending>failed",
        "starting>running",      "starting>failed",      "starting>pending",
        "starting>stopping",     "running>pausing",      "running>suspending",
        "running>stopping",      "running>failed",       "pausing>paused",
        "pausing>running",       "pausing>failed",       "paused>waking",
        "paused>suspending",     "paused>stopping",      "paused>failed",
        "suspending>suspended",  "suspending>running",   "suspending>paused",
        "suspending>failed",     "suspended>waking",     "suspended>stopping",
        "waking>running",        "waking>paused",        "waking>suspended",
        "waking>failed",         "stopping>deleted",     "stopping>failed",
        "failed>stopping",       "running>lost",         "paused>lost",
        "lost>stopping",         "lost>running",         "lost>paused",
        "lost>deleted",          NULL};
    int count = 0;
    for (int a = 0; a < SP_OBS__COUNT; a++)
        for (int b = 0; b < SP_OBS__COUNT; b++) {
            char pair[64];
            snprintf(pair, sizeof(pair), "%s>%s", sp_observed_name((sp_observed_t)a),
                     sp_observed_name((sp_observed_t)b));
            bool listed = false;
            for (int i = 0; allowed[i]; i++)
                listed |= strcmp(allowed[i], pair) == 0;
            if (sp_observed_allowed((sp_observed_t)a, (sp_observed_t)b) != listed) {
                fprintf(stderr, "transition %s: table says %d\n", pair, !listed);
                failures++;
            }
            count += listed;
        }
    CHECK(count == 37); /* 31, and the six of "lost" (core/control/fleet.h) */
    CHECK(!sp_observed_allowed((sp_observed_t)-1, SP_OBS_RUNNING));
    CHECK(!sp_observed_allowed(SP_OBS_RUNNING, SP_OBS__COUNT));
}

/* Every action the controller picks is a legal path through the observed table. */
static void test_sandbox_actions_follow_table(void)
{
    for (int o = 0; o < SP_OBS__COUNT; o++)
        for (int d = 0; d < SP_DESIRED__COUNT; d++) {
            sp_action_t a = sp_sandbox_next_action((sp_observed_t)o, (sp_desired_t)d);
            if (a == SP_ACT_NONE)
                continue;
            sp_observed_t during = sp_action_during(a);
            if (!(o == SP_OBS_FAILED && during == SP_OBS_STOPPING) &&
                !sp_observed_allowed((sp_observed_t)o, during)) {
                fprintf(stderr, "%s->%s via %s not allowed\n", sp_observed_name(o),
                        sp_observed_name(during), sp_action_name(a));
                failures++;
            }
            CHECK(sp_observed_allowed(during, sp_action_success(a)));
            sp_observed_t f = sp_action_failure(a, (sp_observed_t)o);
            CHECK(sp_observed_allowed(during, f));
        }
}

/* A sandbox lost with its worker: only a delete, which the controller carries out. */
static void test_sandbox_lost(void)
{
    sp_desired_t out;
    sp_err_t e = {0};
    for (int r = 0; r < SP_REQ__COUNT; r++) {
        int rc = sp_sandbox_request(SP_DESIRED_RUNNING, SP_OBS_LOST, (sp_request_t)r, &out, &e);
        CHECK((rc == 0) == (r == SP_REQ_DELETE));
    }
    CHECK(sp_sandbox_next_action(SP_OBS_LOST, SP_DESIRED_RUNNING) == SP_ACT_NONE);
    CHECK(sp_sandbox_next_action(SP_OBS_LOST, SP_DESIRED_PAUSED) == SP_ACT_NONE);
    CHECK(sp_sandbox_next_action(SP_OBS_LOST, SP_DESIRED_DELETED) == SP_ACT_DESTROY);
    sp_observed_t o;
    CHECK(sp_observed_parse("lost", &o) == 0 && o == SP_OBS_LOST);
    CHECK(!sp_observed_transitional(SP_OBS_LOST));
}

static void test_sandbox_next_action(void)
{
    CHECK(sp_sandbox_next_action(SP_OBS_PENDING, SP_DESIRED_RUNNING) == SP_ACT_BOOT);
    CHECK(sp_sandbox_next_action(SP_OBS_PENDING, SP_DESIRED_PAUSED) == SP_ACT_BOOT);
    CHECK(sp_sandbox_next_action(SP_OBS_RUNNING, SP_DESIRED_RUNNING) == SP_ACT_NONE);
    CHECK(sp_sandbox_next_action(SP_OBS_RUNNING, SP_DESIRED_PAUSED) == SP_ACT_PAUSE);
    CHECK(sp_sandbox_next_action(SP_OBS_RUNNING, SP_DESIRED_SUSPENDED) == SP_ACT_SUSPEND);
    CHECK(sp_sandbox_next_action(SP_OBS_PAUSED, SP_DESIRED_RUNNING) == SP_ACT_RESUME);
    CHECK(sp_sandbox_next_action(SP_OBS_PAUSED, SP_DESIRED_SUSPENDED) == SP_ACT_SUSPEND);
    CHECK(sp_sandbox_next_action(SP_OBS_SUSPENDED, SP_DESIRED_RUNNING) == SP_ACT_RESTORE);
    CHECK(sp_sandbox_next_action(SP_OBS_SUSPENDED, SP_DESIRED_SUSPENDED) == SP_ACT_NONE);
    CHECK(sp_sandbox_next_action(SP_OBS_FAILED, SP_DESIRED_RUNNING) == SP_ACT_NONE);
    CHECK(sp_sandbox_next_action(SP_OBS_FAILED, SP_DESIRED_DELETED) == SP_ACT_DESTROY);
    CHECK(sp_sandbox_next_action(SP_OBS_DELETED, SP_DESIRED_DELETED) == SP_ACT_NONE);
    for (int d = 0; d < SP_DESIRED__COUNT; d++)
        CHECK(sp_sandbox_next_action(SP_OBS_STARTING, (sp_desired_t)d) == SP_ACT_NONE);
    CHECK(sp_sandbox_next_action((sp_observed_t)42, SP_DESIRED_RUNNING) == SP_ACT_NONE);
}

static void test_sandbox_recover(void)
{
    CHECK(sp_sandbox_recover(SP_OBS_STARTING, SP_VM_ABSENT) == SP_OBS_PENDING);
    CHECK(sp_sandbox_recover(SP_OBS_STARTING, SP_VM_RUNNING) == SP_OBS_RUNNING);
    CHECK(sp_sandbox_recover(SP_OBS_PAUSING, SP_VM_PAUSED) == SP_OBS_PAUSED);
    CHECK(sp_sandbox_recover(SP_OBS_PAUSING, SP_VM_RUNNING) == SP_OBS_RUNNING);
    CHECK(sp_sandbox_recover(SP_OBS_SUSPENDING, SP_VM_SUSPENDED) == SP_OBS_SUSPENDED);
    CHECK(sp_sandbox_recover(SP_OBS_SUSPENDING, SP_VM_RUNNING) == SP_OBS_RUNNING);
    CHECK(sp_sandbox_recover(SP_OBS_WAKING, SP_VM_SUSPENDED) == SP_OBS_SUSPENDED);
    CHECK(sp_sandbox_recover(SP_OBS_WAKING, SP_VM_ABSENT) == SP_OBS_FAILED);
    CHECK(sp_sandbox_recover(SP_OBS_STOPPING, SP_VM_RUNNING) == SP_OBS_STOPPING);
    CHECK(sp_sandbox_recover(SP_OBS_RUNNING, SP_VM_ABSENT) == SP_OBS_RUNNING);
    /* After a crash the VM is the ground truth: what exists is what gets recorded. */
    static const sp_observed_t truth[] = {SP_OBS__COUNT, SP_OBS_RUNNING, SP_OBS_PAUSED,
                                          SP_OBS_SUSPENDED};
    for (int o = 0; o < SP_OBS__COUNT; o++)
        for (int v = SP_VM_RUNNING; v <= SP_VM_SUSPENDED; v++)
            if (sp_observed_transitional((sp_observed_t)o) && o != SP_OBS_STOPPING)
                CHECK(sp_sandbox_recover((sp_observed_t)o, (sp_vm_state_t)v) == truth[v]);
}

static void test_sandbox_names_round_trip(void)
{
    for (int i = 0; i < SP_OBS__COUNT; i++) {
        sp_observed_t o;
        CHECK(sp_observed_parse(sp_observed_name((sp_observed_t)i), &o) == 0 && (int)o == i);
    }
    for (int i = 0; i < SP_DESIRED__COUNT; i++) {
        sp_desired_t d;
        CHECK(sp_desired_parse(sp_desired_name((sp_desired_t)i), &d) == 0 && (int)d == i);
        /* desired names double as the observed name that settles them (SQL relies on it) */
        CHECK(strcmp(sp_desired_name((sp_desired_t)i),
                     sp_observed_name(sp_desired_as_observed((sp_desired_t)i))) == 0);
    }
    sp_observed_t o;
    CHECK(sp_observed_parse("RUNNING", &o) == -1);
    CHECK(sp_observed_parse(NULL, &o) == -1);
    CHECK(strcmp(sp_observed_name((sp_observed_t)77), "unknown") == 0);
}

int main(void)
{
    test_sandbox_requests();
    test_sandbox_failed_only_deletes();
    test_sandbox_observed_matrix();
    test_sandbox_actions_follow_table();
    test_sandbox_next_action();
    test_sandbox_lost();
    test_sandbox_recover();
    test_sandbox_names_round_trip();
    return check_report("sandbox");
}
