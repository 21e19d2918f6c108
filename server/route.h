/*
 * route.h - a request's way from the public listener to what serves it: the E2B gateway or
 * the native API on this node, or the worker another node names.
 *
 * - sp_route_request: a data-plane request (a sandbox's commands, files, sessions, code, envd,
 *   ports) is served by the worker its sandbox is placed on: at once when its VM runs here,
 *   else where the database says (forwarded through http/proxy.h, never twice). On a node that
 *   runs no VMs (api set) template builds, their logs and files go to the worker
 *   sp_fleet_builder picks. Everything else goes to the surface that owns its path.
 * - sp_route_body_policy: the body gate's policy on a request's head (http/bodygate.h): which
 *   bodies may be large (uploads only, with their credential) and which are refused at once.
 * - sp_route_classify: the request metrics' labels (http/reqmetrics.h).
 *
 * Not here: the listener, TLS and the start-up that fills sp_route_t (server.c); what each
 * surface does with a request (native-api/, e2b-gateway/).
 */
#ifndef SP_ROUTE_H
#define SP_ROUTE_H

#include <h2o.h>
#include <stdbool.h>
#include <stdint.h>

#include "base/ids.h"
#include "core/control/fleet.h"
#include "core/control/svc.h"
#include "e2b-gateway/gw.h"
#include "http/bodygate.h"
#include "http/proxy.h"
#include "native-api/napi.h"

/* Filled by the server before the listener opens; the pointers are borrowed. */
typedef struct sp_route {
    sp_napi_t *napi;
    sp_e2b_t *e2b;       /* NULL: no E2B surface */
    sp_bodygate_t *gate; /* HTTP/1 request heads vetted before their bodies */
    uint64_t max_body;   /* bytes a body but an upload may have */
    sp_svc_t *svc;
    sp_proxy_t *proxy;       /* forwards data-plane requests to the sandbox's worker */
    sp_fleet_t *fleet;       /* NULL: one node */
    char wid[SP_ID_LEN + 1]; /* this node's worker id */
    bool api;                /* --role api: runs no VMs, so template builds go to a worker */
} sp_route_t;

/* Serves or forwards req (an h2o handler's on_req); always 0: req is answered. */
int sp_route_request(sp_route_t *r, h2o_req_t *req);
/* sp_bodygate_policy_cb; arg is the sp_route_t. */
void sp_route_body_policy(void *arg, const sp_bodygate_head_t *h, sp_bodygate_verdict_t *v);
/* sp_reqmetrics_classify_fn; arg is the sp_route_t. */
void sp_route_classify(void *arg, h2o_req_t *req, const char **surface, const char **route);

#endif
