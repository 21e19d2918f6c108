/*
 * sandbox.h - sandbox lifecycle states and the rules between them. No I/O.
 *
 * A sandbox has a desired state (what the last accepted request asked for)
 * and an observed state (what the runtime last did). Requests change the
 * desired state (sp_sandbox_request); the controller moves the observed
 * state toward it one action at a time (sp_sandbox_next_action), recording
 * each step before and after it happens (sp_sandbox_action_*), so that a
 * crash between any two steps leaves a row the controller can finish or
 * roll back (sp_sandbox_recover).
 */
#ifndef SP_SANDBOX_H
#define SP_SANDBOX_H

#include <stdbool.h>

#include "core/runtime/driver.h"
#include "base/err.h"

typedef enum {
    SP_DESIRED_RUNNING = 0,
    SP_DESIRED_PAUSED,
    SP_DESIRED_SUSPENDED,
    SP_DESIRED_DELETED,
    SP_DESIRED__COUNT,
} sp_desired_t;

typedef enum {
    SP_OBS_PENDING = 0,
    SP_OBS_STARTING,
    SP_OBS_RUNNING,
    SP_OBS_PAUSING,
    SP_OBS_PAUSED,
    SP_OBS_SUSPENDING,
    SP_OBS_SUSPENDED,
    SP_OBS_WAKING,
    SP_OBS_STOPPING,
    SP_OBS_DELETED,
    SP_OBS_FAILED,
    /* Its worker was declared lost (core/control/fleet.h) while it ran or was paused: its
     * memory is gone unless the worker comes back within the grace and re-adopts it (back to
     * running or paused). Only a delete is accepted; the desired state is kept for that. */
    SP_OBS_LOST,
    SP_OBS__COUNT,
} sp_observed_t;

typedef enum {
    SP_REQ_PAUSE = 0,
    SP_REQ_SUSPEND,
    SP_REQ_WAKE,
    SP_REQ_DELETE,
    SP_REQ__COUNT,
} sp_request_t;

typedef enum {
    SP_ACT_NONE = 0,
    SP_ACT_BOOT,
    SP_ACT_PAUSE,
    SP_ACT_RESUME,
    SP_ACT_SUSPEND,
    SP_ACT_RESTORE,
    SP_ACT_DESTROY,
    SP_ACT__COUNT,
} sp_action_t;

const char *sp_desired_name(sp_desired_t d);
const char *sp_observed_name(sp_observed_t o);
const char *sp_request_name(sp_request_t r);
const char *sp_action_name(sp_action_t a);
/* Parse names; -1 when unknown. */
int sp_desired_parse(const char *s, sp_desired_t *out);
int sp_observed_parse(const char *s, sp_observed_t *out);

/* Transitional states are the "doing" ones: an action is under way. */
bool sp_observed_transitional(sp_observed_t o);

/* The state an accepted request makes desired; -1 with SP_ECONFLICT (and why) when refused. */
int sp_sandbox_request(sp_desired_t desired, sp_observed_t observed, sp_request_t req,
                       sp_desired_t *out, sp_err_t *err);

/* The desired state an operation kind reaches ("create" is running). */
sp_desired_t sp_request_target(sp_request_t req);

/* Whether the observed state may go from a to b (the controller's table). */
bool sp_observed_allowed(sp_observed_t a, sp_observed_t b);

/* What the controller does next from a stable observed state; NONE when at rest or busy. */
sp_action_t sp_sandbox_next_action(sp_observed_t observed, sp_desired_t desired);

/* The observed states an action goes through: during it, after success, after failure. */
sp_observed_t sp_action_during(sp_action_t a);
sp_observed_t sp_action_success(sp_action_t a);
/* Failure state depends on where the action started (suspend from paused rolls back to paused). */
sp_observed_t sp_action_failure(sp_action_t a, sp_observed_t from);

/*
 * After a crash: the observed state to record for a row left in a
 * transitional state, given what the driver finds for it now.
 */
sp_observed_t sp_sandbox_recover(sp_observed_t observed, sp_vm_state_t vm);

/* Whether a user-visible desired state is reached: observed matches desired. */
bool sp_sandbox_settled(sp_observed_t observed, sp_desired_t desired);

/* The observed state that means "desired d is reached". */
sp_observed_t sp_desired_as_observed(sp_desired_t d);

#endif
