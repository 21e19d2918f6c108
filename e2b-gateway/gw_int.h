/*
 * gw_int.h - what the gateway's parts share. The dispatcher (gw.c) classifies a
 * request and resolves the sandbox for sandbox traffic; the parts answer:
 *   route_sandboxes.c  control plane (sp_e2b__control)
 *   envd_*.c           envd on port 49983 (sp_e2b__envd)
 *   envd_code.c        the code interpreter on port 49999 (sp_e2b__code)
 *   forward.c          other guest ports (sp_e2b__forward)
 */
#ifndef SP_E2B_GW_INT_H
#define SP_E2B_GW_INT_H

#include "core/channel/agentconn.h"
#include "e2b-gateway/gw.h"
#include "http/http.h"

#define SP_E2B_ENVD_PORT 49983
#define SP_E2B_CODE_PORT 49999
/* The envd version we report and whose behaviour we implement (spec section 5). */
#define SP_E2B_ENVD_VERSION "0.5.7"

struct sp_e2b {
    sp_svc_t *svc;
    char domain[256];
    struct sp_envd *envd; /* handles on the core tables envd uses (proctab, fswatch); lazily made */
    sp_tmpl_t *tmpl;      /* template builds (route_templates.c); NULL: they answer 503 */
    sp_snap_t *snap;      /* sandbox snapshots (route_snapshots.c); NULL: they answer 503 */
    sp_proxy_t *proxy;    /* asks other workers (sp_e2b_set_peers); NULL: this node only */
    char self[65];        /* this node's worker id; "" when it runs no VMs */
};

/* A resolved, authenticated sandbox for one sandbox-traffic request. Borrowed for the call. */
typedef struct {
    char sandbox_id[65];
    sp_auth_t auth;             /* the sandbox's team */
    char access_token[SP_TOKEN_LEN + 1];
    sp_agentconn_t *conn;       /* the running VM's agent channel */
    int port;                   /* 49983 for envd */
    bool signed_url; /* /files authorized by its signature: its user and path are fixed */
} sp_e2b_target_t;

/* E2B control-plane error body {"code": <status>, "message": ...} (spec 2.1). */
void sp_e2b__error(h2o_req_t *req, int status, const char *msg);
void sp_e2b__error_from(h2o_req_t *req, const sp_err_t *err);

/* Control plane: /sandboxes..., /v2/sandboxes (X-API-Key). */
void sp_e2b__control(sp_e2b_t *gw, h2o_req_t *req, bool forwarded);
/* Whether path (without query) is a control-plane path. */
bool sp_e2b__is_control_path(h2o_req_t *req);

/* envd (port 49983): /process.Process/<M>, /filesystem.Filesystem/<M>, /files, /health, /envs. */
void sp_e2b__envd(sp_e2b_t *gw, h2o_req_t *req, const sp_e2b_target_t *t);
/* Frees gw->envd (watchers, lifetime timers). */
void sp_e2b__envd_free(sp_e2b_t *gw);
/* Whether path is an envd path. */
bool sp_e2b__is_envd_path(h2o_req_t *req);

/* Signed file URLs (spec 3.7, envd_files.c): 0 when req's signature= is the one token gives
 * its path, operation (GET read, POST write), username and expiry, and it has not expired;
 * -1 with SP_EAUTH otherwise. */
int sp_e2b__files_signed(h2o_req_t *req, const char *token, sp_err_t *err);
/* Whether req's signature_expiration is malformed or past (err says which): refused before
 * the sandbox is looked up. */
bool sp_e2b__files_sig_expired(h2o_req_t *req, sp_err_t *err);

/* The code interpreter (port 49999, spec 4) over core/channel/code.h: POST /execute (NDJSON stream),
 * POST/GET /contexts, DELETE /contexts/{id}, POST /contexts/{id}/restart, GET /health. */
void sp_e2b__code(sp_e2b_t *gw, h2o_req_t *req, const sp_e2b_target_t *t);
/* Whether path is a code-interpreter path (/execute, /contexts...): on the API address these
 * are routed by X-Access-Token (E2B_DEBUG mode or a gateway serving localhost:49999). */
bool sp_e2b__is_code_path(h2o_req_t *req);

/* Other guest ports (not envd, not the code interpreter): forwarded to 127.0.0.1:<port> in
 * the guest as HTTP/1.1, WebSocket upgrades included (forward.c). */
#define SP_E2B_FORWARDED_PORT(p) ((p) != SP_E2B_ENVD_PORT && (p) != SP_E2B_CODE_PORT)
void sp_e2b__forward(sp_e2b_t *gw, h2o_req_t *req, const sp_e2b_target_t *t);
/* Whether the sandbox's forwarded ports take traffic without a token (network.allowPublicTraffic,
 * default true). */
bool sp_e2b__public_traffic(const sp_sandbox_rec_t *sb);

#endif
