/*
 * route_int.h - what the control plane's route files share (route_sandboxes.c,
 * route_metrics.c): one request's context, kept in its hold across asynchronous steps.
 */
#ifndef SP_E2B_ROUTE_INT_H
#define SP_E2B_ROUTE_INT_H

#include "e2b-gateway/gw_int.h"

enum {
    R_CREATE = 1,
    R_LIST_V1,
    R_LIST_V2,
    R_METRICS_MANY,
    R_GET,
    R_KILL,
    R_TIMEOUT,
    R_REFRESH,
    R_PAUSE,
    R_CONNECT,
    R_RESUME,
    R_METRICS,
    R_LOGS,
    R_LOGS_V2,
    R_TEMPLATES, /* every /templates path: route_templates.c routes them itself */
    R_SNAPSHOT,  /* POST /sandboxes/{id}/snapshots (route_snapshots.c) */
    R_SNAPSHOTS, /* GET /snapshots (route_snapshots.c) */
};

enum { CTL_GET = 1, CTL_POST = 2, CTL_DELETE = 4 };

typedef struct ctl ctl_t;
typedef void (*ctl_op_fn)(ctl_t *c, const sp_op_rec_t *op);
typedef void (*ctl_sb_fn)(ctl_t *c, const sp_sandbox_rec_t *sb);

struct ctl {
    sp_e2b_t *gw;
    sp_http_hold_t *hold;
    sp_auth_t auth;
    int route;
    bool wants_body;
    bool forwarded;     /* a node sent it: this node's figures only (sp_e2b_handle) */
    int pending;        /* answers from other workers still awaited */
    long long disk_mb;  /* GET /sandboxes/{id} of a row without its disk size: what its
                         * worker gave; -1 not asked, -2 no answer (route_sandboxes.c) */
    char id[65];        /* the sandbox of /sandboxes/{id}/... */
    json_t *body;       /* parsed JSON object or NULL; owned */
    int status;         /* success status to answer with (200/201) */
    int timeout_s;      /* connect/resume */
    char action[16];    /* resume's autoPause as a deadline action, "" = keep */
    sp_op_rec_t op;     /* a finished operation kept across a further step */
    ctl_op_fn after_op; /* sp_e2b__ctl_wait */
    ctl_op_fn after_request;
    ctl_sb_fn after_fetch; /* sp_e2b__ctl_fetch */
    /* listing and metrics */
    unsigned states;
    int limit, pages;
    char cursor[128];
    char next_token[128]; /* sent as x-next-token when set */
    json_t *filter;       /* metadata containment filter; owned */
    json_t *acc;          /* what is being collected for the answer; owned */
    json_t *ids;          /* metrics: the sandbox IDs asked for (array) or NULL; owned */
    long long start_s, end_s; /* metrics: the series's bounds (unix s), 0: open */
    void *tpl;                /* route_templates.c's state across a step; its own to free */
    bool snap_tried;          /* create: templateID was looked up as a snapshot name too */
    /* GET /sandboxes: the array written so far, across pages (route_sandboxes.c); owned */
    sp_buf_t *text;
};

/* Finish the request (answer if the client is still there) and free the context.
 * obj NULL: no body (204). */
void sp_e2b__ctl_reply(ctl_t *c, int status, json_t *obj /* stolen */);
void sp_e2b__ctl_fail(ctl_t *c, int status, const char *msg);
void sp_e2b__ctl_fail_err(ctl_t *c, const sp_err_t *err);
/* An sp_svc_done_cb with arg a ctl_t: 204 on success, else the error. */
void sp_e2b__ctl_done(void *arg, const sp_err_t *err);

/* Waits for op to finish (or the longest wait), then next(c, op); errors answered here. */
void sp_e2b__ctl_wait(ctl_t *c, const sp_op_rec_t *op, ctl_op_fn next);
/* Reads c->id (team-scoped), then next(c, sb); errors answered here. */
void sp_e2b__ctl_fetch(ctl_t *c, ctl_sb_fn next);

/* "running" | "paused" as E2B shows the sandbox; NULL when E2B should not see it. */
const char *sp_e2b__state(const sp_sandbox_rec_t *sb);

/* ListedSandbox (detail false) or SandboxDetail (all ten required keys in both), state as
 * sp_e2b__state gives it, disk_mb the VM's disk size, domain the gateway's. */
json_t *sp_e2b__listed_json(const char *domain, const sp_sandbox_rec_t *sb, const char *state,
                            long long disk_mb, bool detail);
/* The same text sp_json_write gives sp_e2b__listed_json's object, written straight from the
 * record (building and freeing the jansson object was most of what a list cost). -1 when it
 * cannot (a field that is not UTF-8, which jansson drops from the object; no metadata): what
 * was appended is then garbage, and the caller renders the jansson object instead. */
int sp_e2b__listed_write(sp_buf_t *b, const char *domain, const sp_sandbox_rec_t *sb,
                         const char *state, long long disk_mb, bool detail);

/* route_metrics.c: GET /sandboxes/{id}/metrics, /sandboxes/metrics, /sandboxes/{id}/logs,
 * /v2/sandboxes/{id}/logs. */
void sp_e2b__route_metrics(ctl_t *c, h2o_req_t *req);
void sp_e2b__route_logs(ctl_t *c, h2o_req_t *req);

/* route_templates.c: /templates..., /v2/templates..., /v3/templates (after authentication). */
void sp_e2b__route_templates(ctl_t *c, h2o_req_t *req);
/* route_snapshots.c: POST /sandboxes/{id}/snapshots, GET /snapshots, and DELETE
 * /templates/{snapshotID} of a snapshot (by id, or by normalised name when id is ""). */
void sp_e2b__snapshot_create(ctl_t *c);
void sp_e2b__snapshot_list(ctl_t *c, h2o_req_t *req);
void sp_e2b__snapshot_delete(ctl_t *c, const char *id, const char *name);
/* Whether ref (a templateID, URL-decoded) names a snapshot of team: 1 with its id in id (a
 * "<snapshot id>[:default]") or its normalised name in name (a "<team id>/<alias>[:tag]"),
 * the other ""; 0 when it has neither form (a template name, or a bare alias); -1 for a name
 * in another namespace or a malformed one. id and name hold cap bytes (>= 65). */
int sp_e2b__snapshot_ref(const char *team, const char *ref, char *id, char *name, size_t cap);

/* PUT /upload/template-files/{hash}?token=: a COPY step's files, authorised by the token. */
void sp_e2b__template_upload(sp_e2b_t *gw, h2o_req_t *req, const char *hash);

#endif
