/*
 * svc.h - the core operations both HTTP surfaces call: authenticate, list
 * templates, create/list/get sandboxes, lifecycle requests, operations.
 *
 * Every call is asynchronous on the loop and scoped by team: another team's
 * sandbox or operation is SP_ENOTFOUND, exactly like a missing one. A
 * lifecycle request writes the desired state, supersedes nothing and
 * records an operation in one statement; the controller (core/recon.h) does
 * the work. Records passed to callbacks are borrowed for the callback only.
 * An accepted call (returns 0) calls back exactly once, never before it
 * returns; a refused one (-1) never calls back.
 */
#ifndef SP_SVC_H
#define SP_SVC_H

#include <jansson.h>
#include <stdbool.h>
#include <stdint.h>

#include "core/agentconn.h"
#include "core/driver.h"
#include "core/err.h"
#include "core/ids.h"
#include "core/loop.h"
#include "core/sandbox.h"
#include "core/store.h"

typedef struct sp_svc sp_svc_t;

typedef struct {
    char team_id[SP_ID_LEN + 1];
    char key_id[SP_ID_LEN + 1];
} sp_auth_t;

typedef struct {
    char name[65];
    char description[256];
    int cpu_count;
    int memory_mb;
    char status[16]; /* unbuilt | building | ready | failed */
    char updated_at[32];
} sp_template_rec_t;

typedef struct {
    char id[65];
    char team_id[SP_ID_LEN + 1];
    char template_name[65];
    char desired[16];
    char observed[16];
    char created_at[32];
    char last_activity_at[32];
    char deadline_at[32]; /* "" when none */
    char deadline_action[16];
    int idle_timeout_s;
    int cpu_count;
    int memory_mb;
    long long snapshot_bytes;
    char access_token[SP_TOKEN_LEN + 1];
    char error[256];
    json_t *metadata; /* object, owned by the record */
} sp_sandbox_rec_t;

typedef struct {
    char id[65];
    char sandbox_id[65];
    char kind[16];
    char status[16]; /* pending | running | succeeded | failed */
    char error_code[40];
    char error_message[256];
    char created_at[32];
    char finished_at[32]; /* "" while unfinished */
} sp_op_rec_t;

typedef struct {
    const char *template_name;
    json_t *metadata;   /* object of strings or NULL; borrowed */
    json_t *env;        /* object of strings or NULL; borrowed */
    int idle_timeout_s; /* 0 = default (6 h) */
    int timeout_s;      /* 0 = no hard deadline */
    const char *deadline_action; /* "delete" | "suspend"; NULL = delete */
    int cpu_count;      /* 0 = template default */
    int memory_mb;      /* 0 = template default */
} sp_create_req_t;

typedef struct {
    unsigned states;     /* bit per sp_observed_t; 0 = every state but deleted */
    json_t *metadata;    /* containment filter object or NULL; borrowed */
    int limit;           /* 1..1000 */
    const char *cursor;  /* from a previous page or NULL */
} sp_list_req_t;

/* Limits the API surfaces validate against. */
#define SP_SVC_MAX_CPUS       8
#define SP_SVC_MAX_MEMORY_MB  16384
#define SP_SVC_MIN_MEMORY_MB  128
#define SP_SVC_MAX_TIMEOUT_S  (30 * 24 * 3600)
#define SP_SVC_DEFAULT_IDLE_S (6 * 3600)
#define SP_SVC_MAX_WAIT_MS    (300 * 1000)

typedef void (*sp_svc_auth_cb)(void *arg, const sp_auth_t *auth, const sp_err_t *err);
typedef void (*sp_svc_templates_cb)(void *arg, const sp_template_rec_t *recs, size_t n,
                                    const sp_err_t *err);
typedef void (*sp_svc_sandbox_cb)(void *arg, const sp_sandbox_rec_t *sb, const sp_op_rec_t *op,
                                  const sp_err_t *err);
typedef void (*sp_svc_list_cb)(void *arg, const sp_sandbox_rec_t *recs, size_t n,
                               const char *next_cursor /* NULL at the end */, const sp_err_t *err);
typedef void (*sp_svc_op_cb)(void *arg, const sp_op_rec_t *op, const sp_err_t *err);
typedef void (*sp_svc_done_cb)(void *arg, const sp_err_t *err);

sp_svc_t *sp_svc_create(sp_loop_t *loop, sp_store_t *store,
                        const unsigned char hashkey[SP_HASHKEY_LEN], sp_err_t *err);
void sp_svc_destroy(sp_svc_t *svc);

/* key: the caller's API key. SP_EAUTH when unknown or revoked. */
int sp_svc_authenticate(sp_svc_t *svc, const char *key, sp_svc_auth_cb cb, void *arg,
                        sp_err_t *err);

int sp_svc_templates(sp_svc_t *svc, const char *name /* NULL = all */, sp_svc_templates_cb cb,
                     void *arg, sp_err_t *err);

/* Validates req (SP_EINVAL), creates the record and its "create" operation. */
int sp_svc_create_sandbox(sp_svc_t *svc, const sp_auth_t *a, const sp_create_req_t *req,
                          sp_svc_sandbox_cb cb, void *arg, sp_err_t *err);

int sp_svc_get_sandbox(sp_svc_t *svc, const sp_auth_t *a, const char *id, sp_svc_sandbox_cb cb,
                       void *arg, sp_err_t *err);

int sp_svc_list_sandboxes(sp_svc_t *svc, const sp_auth_t *a, const sp_list_req_t *req,
                          sp_svc_list_cb cb, void *arg, sp_err_t *err);

/* pause | suspend | wake | delete: SP_ECONFLICT when the transition is not allowed. */
int sp_svc_request(sp_svc_t *svc, const sp_auth_t *a, const char *id, sp_request_t req,
                   sp_svc_op_cb cb, void *arg, sp_err_t *err);

/* wait_ms > 0: answers when the operation finishes or when wait_ms has passed. */
int sp_svc_get_operation(sp_svc_t *svc, const sp_auth_t *a, const char *op_id, uint32_t wait_ms,
                         sp_svc_op_cb cb, void *arg, sp_err_t *err);

/* ---- the data plane: a running sandbox's agent channel ---- */

/* The runtime driver the data-plane calls use (borrowed; outlives svc). Without one,
 * sp_svc_sandbox_agent answers SP_EUNAVAIL. */
void sp_svc_set_driver(sp_svc_t *svc, sp_driver_t *driver);
sp_loop_t *sp_svc_loop(sp_svc_t *svc);

/* conn is the driver's, valid for the callback and, per driver.h, until the VM is
 * suspended or destroyed: callers open their streams on it at once. */
typedef void (*sp_svc_agent_cb)(void *arg, sp_agentconn_t *conn, const sp_err_t *err);

/*
 * Resolves a team's sandbox to its VM's agent channel for a command or file operation:
 * another team's or a missing sandbox is SP_ENOTFOUND; a sandbox that is not running is
 * SP_ECONFLICT (with what to do); a running one whose VM has no channel is SP_EUNAVAIL
 * ("sandbox VM is not reachable"). On success it also records the activity
 * (last_activity_at) with a separate statement the callback does not wait for.
 */
int sp_svc_sandbox_agent(sp_svc_t *svc, const sp_auth_t *a, const char *id, sp_svc_agent_cb cb,
                         void *arg, sp_err_t *err);

/* Database round trip, for /healthz. */
int sp_svc_health(sp_svc_t *svc, sp_svc_done_cb cb, void *arg, sp_err_t *err);

/* Builds a containment filter from "k=v&k2=v2" (URL-decoded pairs); NULL + SP_EINVAL when malformed. */
json_t *sp_svc_metadata_filter(const char *query, sp_err_t *err);

/* Checks a user metadata/env object: string values, sane key and size limits. */
int sp_svc_check_string_map(const json_t *obj, const char *what, sp_err_t *err);

#endif
