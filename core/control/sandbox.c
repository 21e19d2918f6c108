/*
 * sandbox.c - the lifecycle tables. Pure functions over enums; every input
 * is range-checked so a corrupt row cannot index past a table.
 */
#include "core/control/sandbox.h"

#include <string.h>

static const char *desired_names[SP_DESIRED__COUNT] = {"running", "paused", "suspended",
                                                       "deleted"};
static const char *observed_names[SP_OBS__COUNT] = {
    "pending",   "starting", "running",  "pausing", "paused", "suspending",
    "suspended", "waking",   "stopping", "deleted", "failed", "lost"};
static const char *request_names[SP_REQ__COUNT] = {"pause", "suspend", "wake", "delete"};
static const char *action_names[SP_ACT__COUNT] = {"none",    "boot",    "pause",  "resume",
                                                  "suspend", "restore", "destroy"};

const char *sp_desired_name(sp_desired_t d)
{
    return (unsigned)d < SP_DESIRED__COUNT ? desired_names[d] : "unknown";
}

const char *sp_observed_name(sp_observed_t o)
{
    return (unsigned)o < SP_OBS__COUNT ? observed_names[o] : "unknown";
}

const char *sp_request_name(sp_request_t r)
{
    return (unsigned)r < SP_REQ__COUNT ? request_names[r] : "unknown";
}

const char *sp_action_name(sp_action_t a)
{
    return (unsigned)a < SP_ACT__COUNT ? action_names[a] : "unknown";
}

int sp_desired_parse(const char *s, sp_desired_t *out)
{
    for (int i = 0; s != NULL && i < SP_DESIRED__COUNT; i++)
        if (strcmp(s, desired_names[i]) == 0) {
            *out = (sp_desired_t)i;
            return 0;
        }
    return -1;
}

int sp_observed_parse(const char *s, sp_observed_t *out)
{
    for (int i = 0; s != NULL && i < SP_OBS__COUNT; i++)
        if (strcmp(s, observed_names[i]) == 0) {
            *out = (sp_observed_t)i;
            return 0;
        }
    return -1;
}

bool sp_observed_transitional(sp_observed_t o)
{
    return o == SP_OBS_STARTING || o == SP_OBS_PAUSING || o == SP_OBS_SUSPENDING ||
           o == SP_OBS_WAKING || o == SP_OBS_STOPPING;
}

sp_desired_t sp_request_target(sp_request_t req)
{
    switch (req) {
    case SP_REQ_PAUSE:
        return SP_DESIRED_PAUSED;
    case SP_REQ_SUSPEND:
        return SP_DESIRED_SUSPENDED;
    case SP_REQ_DELETE:
        return SP_DESIRED_DELETED;
    default:
        return SP_DESIRED_RUNNING;
    }
}

/* Which desired states each request may start from (bit per sp_desired_t). */
#define D(x) (1u << SP_DESIRED_##x)
static const unsigned request_from[SP_REQ__COUNT] = {
    [SP_REQ_PAUSE] = D(RUNNING),
    [SP_REQ_SUSPEND] = D(RUNNING) | D(PAUSED),
    [SP_REQ_WAKE] = D(PAUSED) | D(SUSPENDED),
    [SP_REQ_DELETE] = D(RUNNING) | D(PAUSED) | D(SUSPENDED),
};
#undef D

int sp_sandbox_request(sp_desired_t desired, sp_observed_t observed, sp_request_t req,
                       sp_desired_t *out, sp_err_t *err)
{
    if ((unsigned)req >= SP_REQ__COUNT || (unsigned)desired >= SP_DESIRED__COUNT ||
        (unsigned)observed >= SP_OBS__COUNT)
        return sp_err_set(err, SP_EINTERNAL, "unknown state");
    if (desired == SP_DESIRED_DELETED || observed == SP_OBS_DELETED)
        return sp_err_set(err, SP_ENOTFOUND, "sandbox is deleted");
    if (observed == SP_OBS_FAILED && req != SP_REQ_DELETE)
        return sp_err_set(err, SP_ECONFLICT, "sandbox has failed; it can only be deleted");
    if (observed == SP_OBS_LOST && req != SP_REQ_DELETE)
        return sp_err_set(err, SP_ECONFLICT,
                          "sandbox was lost with its worker; it can only be deleted");
    if (!(request_from[req] & (1u << desired)))
        return sp_err_set(err, SP_ECONFLICT, "cannot %s a sandbox that is %s",
                          request_names[req], desired_names[desired]);
    *out = sp_request_target(req);
    return 0;
}

/* Allowed observed transitions: bit per destination. */
#define O(x) (1u << SP_OBS_##x)
static const unsigned observed_to[SP_OBS__COUNT] = {
    [SP_OBS_PENDING] = O(STARTING) | O(STOPPING) | O(FAILED),
    [SP_OBS_STARTING] = O(RUNNING) | O(FAILED) | O(PENDING) | O(STOPPING),
    [SP_OBS_RUNNING] = O(PAUSING) | O(SUSPENDING) | O(STOPPING) | O(FAILED) | O(LOST),
    [SP_OBS_PAUSING] = O(PAUSED) | O(RUNNING) | O(FAILED),
    [SP_OBS_PAUSED] = O(WAKING) | O(SUSPENDING) | O(STOPPING) | O(FAILED) | O(LOST),
    [SP_OBS_SUSPENDING] = O(SUSPENDED) | O(RUNNING) | O(PAUSED) | O(FAILED),
    [SP_OBS_SUSPENDED] = O(WAKING) | O(STOPPING),
    [SP_OBS_WAKING] = O(RUNNING) | O(PAUSED) | O(SUSPENDED) | O(FAILED),
    [SP_OBS_STOPPING] = O(DELETED) | O(FAILED),
    [SP_OBS_DELETED] = 0,
    [SP_OBS_FAILED] = O(STOPPING),
    /* deleted: its worker is still lost, so nothing is left to stop (core/control/fleet.c) */
    [SP_OBS_LOST] = O(STOPPING) | O(RUNNING) | O(PAUSED) | O(DELETED),
};
#undef O

bool sp_observed_allowed(sp_observed_t a, sp_observed_t b)
{
    if ((unsigned)a >= SP_OBS__COUNT || (unsigned)b >= SP_OBS__COUNT)
        return false;
    return (observed_to[a] & (1u << b)) != 0;
}

sp_action_t sp_sandbox_next_action(sp_observed_t o, sp_desired_t d)
{
    if ((unsigned)o >= SP_OBS__COUNT || (unsigned)d >= SP_DESIRED__COUNT)
        return SP_ACT_NONE;
    if (sp_observed_transitional(o) || o == SP_OBS_DELETED)
        return SP_ACT_NONE;
    if (d == SP_DESIRED_DELETED)
        return SP_ACT_DESTROY; /* from pending and failed too: cleanup is idempotent */
    if (o == SP_OBS_FAILED || o == SP_OBS_LOST)
        return SP_ACT_NONE;
    switch (o) {
    case SP_OBS_PENDING:
        return SP_ACT_BOOT;
    case SP_OBS_RUNNING:
        return d == SP_DESIRED_PAUSED      ? SP_ACT_PAUSE
               : d == SP_DESIRED_SUSPENDED ? SP_ACT_SUSPEND
                                           : SP_ACT_NONE;
    case SP_OBS_PAUSED:
        return d == SP_DESIRED_RUNNING     ? SP_ACT_RESUME
               : d == SP_DESIRED_SUSPENDED ? SP_ACT_SUSPEND
                                           : SP_ACT_NONE;
    case SP_OBS_SUSPENDED:
        return d == SP_DESIRED_SUSPENDED ? SP_ACT_NONE : SP_ACT_RESTORE;
    default:
        return SP_ACT_NONE;
    }
}

sp_observed_t sp_action_during(sp_action_t a)
{
    switch (a) {
    case SP_ACT_BOOT:
        return SP_OBS_STARTING;
    case SP_ACT_PAUSE:
        return SP_OBS_PAUSING;
    case SP_ACT_RESUME:
    case SP_ACT_RESTORE:
        return SP_OBS_WAKING;
    case SP_ACT_SUSPEND:
        return SP_OBS_SUSPENDING;
    case SP_ACT_DESTROY:
        return SP_OBS_STOPPING;
    default:
        return SP_OBS_FAILED;
    }
}

sp_observed_t sp_action_success(sp_action_t a)
{
    switch (a) {
    case SP_ACT_BOOT:
    case SP_ACT_RESUME:
    case SP_ACT_RESTORE:
        return SP_OBS_RUNNING;
    case SP_ACT_PAUSE:
        return SP_OBS_PAUSED;
    case SP_ACT_SUSPEND:
        return SP_OBS_SUSPENDED;
    case SP_ACT_DESTROY:
        return SP_OBS_DELETED;
    default:
        return SP_OBS_FAILED;
    }
}

sp_observed_t sp_action_failure(sp_action_t a, sp_observed_t from)
{
    switch (a) {
    case SP_ACT_PAUSE:
        return SP_OBS_RUNNING; /* a failed pause leaves it running */
    case SP_ACT_RESUME:
        return SP_OBS_PAUSED;
    case SP_ACT_SUSPEND:
        return from == SP_OBS_PAUSED ? SP_OBS_PAUSED : SP_OBS_RUNNING;
    case SP_ACT_RESTORE:
        return SP_OBS_SUSPENDED; /* the snapshot is kept; wake can be retried */
    default:
        return SP_OBS_FAILED;
    }
}

sp_observed_t sp_sandbox_recover(sp_observed_t o, sp_vm_state_t vm)
{
    if (!sp_observed_transitional(o))
        return o;
    if (o == SP_OBS_STOPPING)
        return SP_OBS_STOPPING; /* destroy is idempotent: the controller runs it again */
    switch (vm) {
    case SP_VM_RUNNING:
        return SP_OBS_RUNNING;
    case SP_VM_PAUSED:
        return SP_OBS_PAUSED;
    case SP_VM_SUSPENDED:
        return SP_OBS_SUSPENDED;
    case SP_VM_ABSENT:
    default:
        /* Nothing survived: a boot that never finished can start again; anything else lost its VM. */
        return o == SP_OBS_STARTING ? SP_OBS_PENDING : SP_OBS_FAILED;
    }
}

sp_observed_t sp_desired_as_observed(sp_desired_t d)
{
    switch (d) {
    case SP_DESIRED_PAUSED:
        return SP_OBS_PAUSED;
    case SP_DESIRED_SUSPENDED:
        return SP_OBS_SUSPENDED;
    case SP_DESIRED_DELETED:
        return SP_OBS_DELETED;
    default:
        return SP_OBS_RUNNING;
    }
}

bool sp_sandbox_settled(sp_observed_t o, sp_desired_t d)
{
    return o == sp_desired_as_observed(d);
}
