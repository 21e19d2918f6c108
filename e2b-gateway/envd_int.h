/*
 * envd_int.h - what the envd parts share (envd.c dispatches; envd_files.c answers /files;
 * envd_process.c and envd_fs.c the Connect services): one call's context, the per-gateway
 * handles on core state, user selection and error mapping.
 */
#ifndef SP_E2B_ENVD_INT_H
#define SP_E2B_ENVD_INT_H

#include "core/channel/exec.h"
#include "core/channel/fswatch.h"
#include "core/channel/proctab.h"
#include "e2b-gateway/connectrpc.h"
#include "e2b-gateway/gw_int.h"

/* The template's default user (spec 5: with envd >= 0.4.0 no Authorization means this user).
 * SPACE_E2B_DEFAULT_USER overrides it (hosts without a `user` account, tests). */
#define SP_ENVD_DEFAULT_USER "user"

/* Per gateway, made on first use, freed by sp_e2b__envd_free. The state itself lives in core
 * (core/channel/proctab.h, core/channel/fswatch.h): the gateway only translates. */
struct sp_envd {
    sp_e2b_t *gw;
    sp_loop_t *loop;
    sp_proctab_t *procs;        /* what Start started processes with, and their lifetimes */
    sp_fswatch_tab_t *watchers; /* CreateWatcher's polling watchers, all sandboxes */
};

/* One RPC or HTTP call: malloc'd, holds the request until answered. */
typedef struct {
    sp_e2b_t *gw;
    struct sp_envd *ev;
    sp_http_hold_t *hold;
    sp_connect_req_t cr;
    sp_carena_t arena;
    char sandbox_id[65];
    sp_auth_t auth;
    char access_token[SP_TOKEN_LEN + 1];
    sp_agentconn_t *conn; /* valid during the dispatching call only */
    bool signed_url;      /* /files by its signature (gw.c): user and path as signed */
    char user[64];        /* effective user (Basic auth or the default) */
    void *msg;            /* decoded request message (in arena) */
    void *data;           /* the handler's own state */
    void (*data_free)(void *data);
} envd_call_t;

struct sp_envd *sp_e2b__envd_state(sp_e2b_t *gw);
/* A copy of s in a (NULL for NULL, or when out of memory). */
const char *sp_e2b__envd_strdup(sp_carena_t *a, const char *s);
sp_loop_t *sp_e2b__envd_loop(envd_call_t *c);

/* The request, or NULL when the client left. */
h2o_req_t *sp_e2b__envd_req(envd_call_t *c);
/* Unary success / error (frees the call; nothing is sent when the client left). */
void sp_e2b__envd_reply(envd_call_t *c, const sp_cdesc_t *d, const void *msg);
/* Before a reply: marks the answer as a list cut at a cap (core/channel/listcap.h) with the
 * header SP_LIST_TRUNCATED_HEADER, as envd's messages have no field for it. */
void sp_e2b__envd_truncated(envd_call_t *c);
void sp_e2b__envd_fail(envd_call_t *c, sp_connect_code_t code, const char *msg);
void sp_e2b__envd_fail_err(envd_call_t *c, const sp_err_t *err);
/* Frees the call and returns its request (NULL when the client left). */
h2o_req_t *sp_e2b__envd_take(envd_call_t *c);
void sp_e2b__envd_call_free(envd_call_t *c);

/* Our error as a Connect code: "unknown user" from the agent is unauthenticated (spec 3.5). */
sp_connect_code_t sp_e2b__envd_code(const sp_err_t *err);

/* envd's plain-HTTP errors ({"code": status, "message"}, spec 3.6; free the call). */
void sp_e2b__envd_http_fail(envd_call_t *c, int status, const char *msg);
void sp_e2b__envd_http_fail_err(envd_call_t *c, const sp_err_t *e);

/* The user a call runs as when it names none (SPACE_E2B_DEFAULT_USER, else envd's). */
const char *sp_e2b__envd_default_user(void);
/* Whether u[0..n) can be a user name (1-63 bytes, no controls, ':' or '/'). */
bool sp_e2b__envd_user_ok(const char *u, size_t n);
/* Authorization: Basic base64("<user>:") -> c->user (the default user when absent or empty).
 * -1 when present but unusable. */
int sp_e2b__envd_basic_user(h2o_req_t *req, envd_call_t *c);

/* /files (envd_files.c): GET downloads, POST uploads. */
void sp_e2b__envd_files(envd_call_t *c, h2o_req_t *req);

/* Services; method is the last path segment. */
void sp_e2b__envd_process(envd_call_t *c, const char *method);
void sp_e2b__envd_fs(envd_call_t *c, const char *method);

/* Fills a wire EntryInfo from an exec entry object (strings copied into arena). */
int sp_e2b__envd_entry(json_t *e, sp_cf_entry_t *out, sp_carena_t *a);

/* The agent channel of team_id's sandbox_id for a lifetime kill (sp_proctab_agent_fn). */
int sp_e2b__envd_agent(void *gw, const char *sandbox_id, const char *team_id,
                       sp_proctab_agent_cb cb, void *arg);

#endif
