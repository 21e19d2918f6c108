/*
 * svc.h - the core operations both HTTP surfaces call: authenticate, list
 * templates, create/list/get sandboxes, lifecycle requests, operations.
 *
 * Folder: core/control/ is sandboxes' lifecycle: these operations, states, the controller that
 * reconciles them, API keys. (ARCHITECTURE.md: the layers.)
 *
 * Every call is asynchronous on the loop and scoped by team: another team's
 * sandbox or operation is SP_ENOTFOUND, exactly like a missing one. A
 * lifecycle request writes the desired state, supersedes nothing and
 * records an operation in one statement; the controller (core/control/recon.h) does
 * the work. Records passed to callbacks are borrowed for the callback only.
 * An accepted call (returns 0) calls back exactly once, never before it
 * returns; a refused one (-1) never calls back.
 */
#ifndef SP_SVC_H
#define SP_SVC_H

#include <jansson.h>
#include <stdbool.h>
#include <stdint.h>

#include "core/channel/agentconn.h"
#include "core/runtime/driver.h"
#include "base/err.h"
#include "base/ids.h"
#include "loop/loop.h"
#include "core/control/sampler.h"
#include "core/control/sandbox.h"
#include "core/store/store.h"

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
    bool builtin;        /* everyone's (compiled in); else the caller's team's */
    char version[65];    /* the current version's hash; "" when none */
    char parent[65];     /* "" for a built-in one */
    char last_build_id[37];     /* the team's latest build of it (a UUID); "" when none */
    char last_build_status[16]; /* that build's status; "" when none */
    int disk_mb;                /* the current version's disk capacity; 0 when unknown */
    long long size_bytes;       /* its image's bytes on disk; -1 when unknown */
    /* a team's template's versions, newest first (version, created_at, tags, disk_mb,
     * size_bytes): an array, borrowed for the callback; empty for a built-in one */
    json_t *versions;
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
    /* Derived from the row's salt on each read (core/control/tokens.h), never stored; "" when
     * this server cannot derive them (a master-key salt without the master key). */
    char access_token[SP_TOKEN_LEN + 1];  /* envd's X-Access-Token */
    char traffic_token[SP_TOKEN_LEN + 1]; /* E2B-Traffic-Access-Token: ports, interpreter */
    char error[256];
    json_t *metadata; /* object, owned by the record */
    /* Kept for the E2B surface (migration 2). */
    bool auto_resume;      /* a request for its traffic wakes it from suspend */
    int deadline_s;        /* last timeout length asked for; 0 = none */
    int allow_internet;    /* 1 allowed, 0 denied, -1 not said */
    json_t *network;       /* object or NULL, owned by the record */
    char envd_version[32]; /* "" when not recorded */
    char end_at[32];       /* deadline_at, else created_at + deadline_s (or + 10 years) */
    char lost_at[32];      /* when its worker was declared lost (observed "lost"); else "" */
    /* Its VM's disk size in MiB as its worker recorded it once the VM was up (migration 16:
     * core/control/recon.c), whichever node reads the row; -1 when not recorded (a VM that
     * never came up, a row from before). */
    long long disk_mb;
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
    char snapshot_id[65]; /* kind "snapshot": the snapshot it takes (core/control/snap.h); else "" */
    char progress[200];   /* what it waited for, when that took long (recon.c); "" when never */
} sp_op_rec_t;

/* An operation's columns as sp_svc_parse_op reads them, from operations aliased o: its
 * timestamps selected in UTC as plain text (sp_store_time puts them in the API's form). */
#define SP_SVC_OP_COLS                                                                             \
    "o.id, o.sandbox_id, o.kind, o.status, coalesce(o.error_code, ''), "                           \
    "coalesce(o.error_message, ''), (o.created_at) AT TIME ZONE 'UTC', "                           \
    "(o.finished_at) AT TIME ZONE 'UTC', CASE WHEN o.kind = 'snapshot' THEN o.target ELSE '' END, " \
    "coalesce(o.progress, '')"
#define SP_SVC_OP_NCOLS 10

/* Row row of r, from column col on (SP_SVC_OP_COLS selected there), into *o. */
void sp_svc_parse_op(const PGresult *r, int row, int col, sp_op_rec_t *o);

typedef struct {
    const char *template_name; /* NULL (or "") with snapshot_id */
    /* A team's ready snapshot (core/control/snap.h) to start from instead of a template: the
     * sandbox gets its template, cpu_count, memory_mb and env (the request's env merged over
     * it), and cpu_count/memory_mb must be 0. An unknown, deleted or another team's one is
     * SP_ENOTFOUND, one still being taken or failed SP_ECONFLICT, both through the callback. */
    const char *snapshot_id;
    json_t *metadata;   /* object of strings or NULL; borrowed */
    json_t *env;        /* object of strings or NULL; borrowed */
    int idle_timeout_s; /* 0 = default (6 h) */
    int timeout_s;      /* 0 = no hard deadline */
    const char *deadline_action; /* "delete" | "suspend"; NULL = delete */
    int cpu_count;      /* 0 = template default */
    int memory_mb;      /* 0 = template default */
    /* E2B extras; zero values keep the defaults. */
    bool auto_resume;
    int allow_internet;       /* 0 not said, 1 allowed, -1 denied */
    json_t *network;          /* object or NULL; borrowed, stored as given */
    const char *envd_version; /* NULL = none */
    /* Credential rules as the API takes them (an array, core/egress/secrets.h's
     * sp_secrets_rules_normalize), or NULL, null or [] for none; borrowed. Checked, normalised
     * and stored here; the secrets they name must be the team's. */
    json_t *credentials;
    /* Outbound policy {"internet","allow","deny"} (core/egress/egress_policy.h) or NULL (derived
     * from allow_internet: default rules); borrowed, validated again and stored in normal
     * form. */
    json_t *egress;
    /* Labels the worker it is placed on must have (core/control/fleet.h: checked with
     * sp_fleet_check_labels), or NULL; borrowed, kept on the row for later wakes. */
    json_t *placement_labels;
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

/* A team's quotas: what its sandboxes desired running or paused (a paused one keeps its
 * memory) may hold together, and the disk its snapshots hold. A team's own limits are in its
 * row (`spaced teams set-quota`); where it has none, the server's defaults apply. 0: no limit.
 *
 * snapshot_mb counts what the files of the team's snapshots take on disk, as the driver
 * measured them once written (core/store/migrate.c, migration 15): suspended sandboxes'
 * snapshots (memory and device state; the disk overlay is the sandbox's whether or not it
 * is suspended) and sandbox snapshots (snap.h) not deleted. Template versions a team built
 * do not count: they are bounded by their own collection (tmpl.h), and are shared by every
 * sandbox made from them. */
typedef struct {
    int sandboxes;
    int vcpus;
    int memory_mb;
    int snapshot_mb;
} sp_quota_t;

/* The defaults: generous, there to stop a runaway client, not to ration. */
#define SP_SVC_QUOTA_SANDBOXES   100
#define SP_SVC_QUOTA_VCPUS       200
#define SP_SVC_QUOTA_MEMORY_MB   (400 * 1024)
#define SP_SVC_QUOTA_SNAPSHOT_MB (200 * 1024)

/* The server's defaults for teams without limits of their own (SP_SVC_QUOTA_* until set).
 * A create, and a resume of a suspended sandbox, over a quota fail with SP_EQUOTA and a
 * message naming the quota, its limit and the team's use. The check and the write are one
 * statement that locks the team's row: of two creates for the last place, one wins. A
 * client's suspend (and a sandbox snapshot, snap.h) is refused the same way once the team's
 * snapshots hold snapshot_mb or more: a snapshot's size is known only once it is written, so
 * the check is before, the accounting after, and a team ends at most one snapshot past its
 * limit. Suspends the server decides (timeouts, drains) are never refused. */
void sp_svc_set_quota_defaults(sp_svc_t *svc, const sp_quota_t *q);

/* Placement (core/control/fleet.h): creates and wakes from suspend go to a worker that has
 * room (SP_ECAPACITY when none has, at once). A worker counts while its heartbeat is younger
 * than heartbeat_timeout_s; self is this node's worker id when it runs VMs (it counts as alive
 * whatever its heartbeat says), NULL on an API node. Defaults: none, 10 s. */
void sp_svc_set_placement(sp_svc_t *svc, const char *self, int heartbeat_timeout_s);

/* key: the caller's API key. SP_EAUTH when unknown or revoked. */
int sp_svc_authenticate(sp_svc_t *svc, const char *key, sp_svc_auth_cb cb, void *arg,
                        sp_err_t *err);

/* The templates the team can use: the built-in ones and its own (not deleted). */
int sp_svc_templates(sp_svc_t *svc, const sp_auth_t *a, const char *name /* NULL = all */,
                     sp_svc_templates_cb cb, void *arg, sp_err_t *err);

/* Validates req (SP_EINVAL), creates the record and its "create" operation. The egress
 * policy and the credential rules are checked first (SP_EINVAL naming the bad rule; rules
 * without secrets set up are SP_EUNAVAIL), the other fields next; then the secrets the rules
 * name are looked up before the record is written: a missing one is SP_EINVAL "credentials
 * name secret 'X', which does not exist", through the callback. */
int sp_svc_create_sandbox(sp_svc_t *svc, const sp_auth_t *a, const sp_create_req_t *req,
                          sp_svc_sandbox_cb cb, void *arg, sp_err_t *err);

/* New sandboxes' tokens come from the master key (32 bytes, copied) from now on, instead of
 * the database's hash key (core/control/tokens.h); NULL: from the hash key. */
int sp_svc_set_token_master(sp_svc_t *svc, const unsigned char *master, sp_err_t *err);

int sp_svc_get_sandbox(sp_svc_t *svc, const sp_auth_t *a, const char *id, sp_svc_sandbox_cb cb,
                       void *arg, sp_err_t *err);

/*
 * The sandbox an access token opens (data-plane auth: E2B envd, code interpreter, ports).
 * id may be NULL (token only). SP_ENOTFOUND when no sandbox has that token (and id); a deleted
 * sandbox is returned with observed "deleted" (the caller answers "not running"). The token is
 * looked up by its keyed hash, in one statement whether or not the id exists.
 * token NULL with an id looks the sandbox up UNAUTHENTICATED: only for callers that then
 * check another credential against the record's tokens (a traffic token, a signed file URL)
 * or allow none (a public port), and answer a failed check exactly as a missing sandbox.
 */
int sp_svc_sandbox_by_token(sp_svc_t *svc, const char *id, const char *token,
                            sp_svc_sandbox_cb cb, void *arg, sp_err_t *err);

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

/* Team secrets and credential rules (core/egress/secrets.h), borrowed; outlives svc. Without it the
 * secrets API answers SP_EUNAVAIL. */
struct sp_secrets;
void sp_svc_set_secrets(sp_svc_t *svc, struct sp_secrets *secrets);
struct sp_secrets *sp_svc_secrets(sp_svc_t *svc);

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

/* ---- where a sandbox is (many hosts: which worker serves its data plane) ---- */

/* Whether this node's runtime holds a live VM for the sandbox (running or paused, its
 * agent channel up): memory only, no database, so the data plane of a sandbox placed here
 * costs nothing extra. false without a driver. */
bool sp_svc_sandbox_here(sp_svc_t *svc, const char *id);

typedef struct {
    char sandbox_id[65];  /* the sandbox asked about */
    bool found;           /* false: no such sandbox (the caller answers as it would locally) */
    char worker_id[65];   /* "" when not placed on any worker */
    char address[256];    /* the worker's "host:port"; "" when the worker has no row */
    char worker_state[16]; /* active | draining | lost; "" when the worker has no row */
} sp_where_t;

typedef void (*sp_svc_where_cb)(void *arg, const sp_where_t *w, const sp_err_t *err);

/* One statement: the sandbox's owner (sandboxes.worker_id) and that worker's address and
 * state (schema 10's workers). Any team's sandbox: the caller forwards the request to the
 * owner, which authenticates it. */
int sp_svc_sandbox_where(sp_svc_t *svc, const char *id, sp_svc_where_cb cb, void *arg,
                         sp_err_t *err);

typedef void (*sp_svc_where_many_cb)(void *arg, const sp_where_t *w, size_t n, const sp_err_t *err);

/* The same for n sandboxes (valid ids, at most SP_SVC_WHERE_MAX) in one statement, for an
 * answer gathered from their workers: cb gets one record per sandbox that exists, in no
 * particular order (borrowed for the call). */
#define SP_SVC_WHERE_MAX 1000
int sp_svc_sandboxes_where(sp_svc_t *svc, const char *const *ids, size_t n, sp_svc_where_many_cb cb,
                           void *arg, sp_err_t *err);

/* Database round trip, for /healthz. */
int sp_svc_health(sp_svc_t *svc, sp_svc_done_cb cb, void *arg, sp_err_t *err);

/* Builds a containment filter from "k=v&k2=v2" (URL-decoded pairs); NULL + SP_EINVAL when malformed. */
json_t *sp_svc_metadata_filter(const char *query, sp_err_t *err);

/* Checks a user metadata/env object: string values, sane key and size limits. */
int sp_svc_check_string_map(const json_t *obj, const char *what, sp_err_t *err);

/* ---- deadlines, automatic wake, figures and events (the E2B surface uses these) ---- */

typedef enum {
    SP_DEADLINE_KEEP = 0, /* leave deadline_at as it is */
    SP_DEADLINE_CLEAR,    /* no deadline */
    SP_DEADLINE_SET,      /* now + secs (may shorten); also remembered as deadline_s */
    SP_DEADLINE_EXTEND,   /* max(deadline, now + secs); no deadline stays none */
} sp_deadline_mode_t;

typedef struct {
    sp_deadline_mode_t mode;
    int secs;           /* 0..SP_SVC_MAX_TIMEOUT_S */
    const char *action; /* "delete" | "suspend", or NULL to keep */
} sp_deadline_t;

/* sp_svc_request that also changes the deadline in the same statement (dl NULL: keep). */
int sp_svc_request_deadline(sp_svc_t *svc, const sp_auth_t *a, const char *id, sp_request_t req,
                            const sp_deadline_t *dl, sp_svc_op_cb cb, void *arg, sp_err_t *err);

/* Changes the deadline of a sandbox that is (or is becoming) running or natively paused;
 * SP_ENOTFOUND for one that is missing, another team's, suspended or being deleted. The
 * callback gets the updated record (op NULL). */
int sp_svc_set_deadline(sp_svc_t *svc, const sp_auth_t *a, const char *id,
                        const sp_deadline_t *dl, sp_svc_sandbox_cb cb, void *arg, sp_err_t *err);

/*
 * For sandbox traffic to a sandbox that is not running: if it is paused or suspended (or
 * being suspended) and has auto_resume, requests a wake (with a new deadline of its last
 * timeout length) and waits up to wait_ms for it. The callback's err is NULL when the
 * sandbox is (now) running or was not asleep at all; SP_ECONFLICT when it is asleep
 * without auto_resume; the wake's failure otherwise.
 */
int sp_svc_wake_if_autoresume(sp_svc_t *svc, const sp_auth_t *a, const char *id,
                              uint32_t wait_ms, sp_svc_done_cb cb, void *arg, sp_err_t *err);

/* Synchronous: the runtime driver's figures for the sandbox's VM. The caller has checked
 * that the sandbox is the caller's. SP_ENOTFOUND without a VM; SP_EUNAVAIL without a driver. */
int sp_svc_vm_stats(sp_svc_t *svc, const char *id, sp_vm_stats_t *out, sp_err_t *err);
/* The disk size stats would report (0 when there is no VM), without stats' reads: this node's
 * driver only (a sandbox's record has its worker's figure: sp_sandbox_rec_t.disk_mb). */
uint64_t sp_svc_vm_disk_bytes(sp_svc_t *svc, const char *id);

/* The sandbox's figures over time (core/control/sampler.h: sp_sampler_get), oldest first; 0
 * without a driver or any sample. The caller has checked that the sandbox is the caller's. */
size_t sp_svc_vm_samples(sp_svc_t *svc, const char *id, int64_t start_s, int64_t end_s,
                         sp_sample_t *out, size_t cap);

typedef struct {
    long long id;
    char at[32];
    long long at_ms; /* epoch milliseconds */
    char kind[32];
    char detail[256];
} sp_event_rec_t;

typedef void (*sp_svc_events_cb)(void *arg, const sp_event_rec_t *recs, size_t n,
                                 const sp_err_t *err);

/* A team's sandbox's lifecycle events, oldest first, from since_ms (epoch ms; 0 = all), at
 * most limit (1..10000). SP_ENOTFOUND for a missing or another team's sandbox. */
int sp_svc_sandbox_events(sp_svc_t *svc, const sp_auth_t *a, const char *id, long long since_ms,
                          int limit, sp_svc_events_cb cb, void *arg, sp_err_t *err);

/* ---- outbound traffic (core/egress/egress.h) ---- */

/* Told (in this process, before the caller's callback) when a sandbox's egress policy was
 * changed, with the new policy in normal form (borrowed); other processes hear NOTIFY
 * space_egress. */
void sp_svc_set_egress_hook(sp_svc_t *svc,
                            void (*fn)(void *arg, const char *sandbox_id, const json_t *policy),
                            void *arg);

/* policy: the sandbox's policy in normal form (borrowed for the call). */
typedef void (*sp_svc_policy_cb)(void *arg, json_t *policy, const sp_err_t *err);

/* A team's sandbox's egress policy (stored, or derived from allow_internet_access). */
int sp_svc_egress_policy(sp_svc_t *svc, const sp_auth_t *a, const char *id, sp_svc_policy_cb cb,
                         void *arg, sp_err_t *err);
/* Replaces it (SP_EINVAL naming a bad rule, before anything is written); new connections of a
 * running sandbox follow it at once. The callback gets the stored normal form. */
int sp_svc_set_egress_policy(sp_svc_t *svc, const sp_auth_t *a, const char *id,
                             const json_t *policy, sp_svc_policy_cb cb, void *arg, sp_err_t *err);

typedef struct {
    long long id;
    char at[32];
    char kind[8]; /* connect | http | dns */
    char host[264];
    int port;
    char address[72];
    bool allowed;
    char reason[160];
    long long bytes_up, bytes_down;
    int duration_ms;
} sp_egress_rec_t;

typedef void (*sp_svc_egress_log_cb)(void *arg, const sp_egress_rec_t *recs, size_t n,
                                     const char *next_cursor /* NULL at the end */,
                                     const sp_err_t *err);

/* A team's sandbox's audit rows, newest first: limit 1..1000, cursor from a previous page. */
int sp_svc_egress_log(sp_svc_t *svc, const sp_auth_t *a, const char *id, int limit,
                      const char *cursor, sp_svc_egress_log_cb cb, void *arg, sp_err_t *err);

#endif
