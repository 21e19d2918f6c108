/*
 * gw.h - the E2B-compatible surface: a translation layer from what the
 * official E2B SDKs send (../shared/spec/e2b-wire.md) to core operations.
 * Holds no state of its own beyond caches.
 *
 * Folder: e2b-gateway/ is the other HTTP surface: E2B's wire translated to core calls.
 * (ARCHITECTURE.md: the layers.)
 *
 * Three kinds of traffic arrive on the same listener and are told apart per
 * request: the control plane (/sandboxes, /v2/sandboxes, X-API-Key), envd
 * (port 49983: Connect RPC + /files + /health) and other sandbox ports
 * (49999 code interpreter, any port forwarded to the guest).
 */
#ifndef SP_E2B_GW_H
#define SP_E2B_GW_H

#include <h2o.h>
#include <stdbool.h>

#include "core/control/snap.h"
#include "core/control/svc.h"
#include "core/control/tmpl.h"
#include "http/proxy.h"

typedef struct sp_e2b sp_e2b_t;

typedef struct {
    /* Sandbox host suffix returned as `domain` ("space.localhost:3000"): sandbox traffic
     * arrives as Host <port>-<id>.<domain>. */
    const char *domain;
} sp_e2b_opts_t;

sp_e2b_t *sp_e2b_create(sp_svc_t *svc, const sp_e2b_opts_t *o);
void sp_e2b_destroy(sp_e2b_t *gw);

/* Template builds for the E2B template API (borrowed; outlives gw). */
void sp_e2b_set_tmpl(sp_e2b_t *gw, sp_tmpl_t *tmpl);
/* Sandbox snapshots for the E2B snapshot API (borrowed; outlives gw). */
void sp_e2b_set_snap(sp_e2b_t *gw, sp_snap_t *snap);

/* Many hosts: the forwarder to ask other workers with (borrowed; outlives gw; NULL or one
 * without a cluster key: only this node's figures), and this node's worker id ("" when it runs
 * no VMs). The many-sandbox metrics live in the memory of the worker that runs the sandbox: an
 * answer that needs them asks those workers, in parallel, for at most SP_E2B_PEER_MS, and
 * leaves out what did not come. A sandbox's disk size is on its row (its worker records it),
 * read alike by every node; only a detail of a row from before that column asks the worker,
 * the same way, and shows 0 without its answer. */
#define SP_E2B_PEER_MS 3000u
void sp_e2b_set_peers(sp_e2b_t *gw, sp_proxy_t *proxy, const char *self_worker_id);
/* Whether this request is E2B traffic (sandbox host, envd path, or an E2B control path). */
bool sp_e2b_owns(sp_e2b_t *gw, h2o_req_t *req);

/* For the request metrics (http/reqmetrics.h), of a request sp_e2b_owns: the surface, "e2b"
 * (control plane) or "envd" (the data plane: envd, the code interpreter, guest ports), and a
 * route class from a fixed set (static strings; never an id). */
void sp_e2b_classify(sp_e2b_t *gw, h2o_req_t *req, const char **surface, const char **route);

/* Whether a TLS connection for server_name (SNI) should speak HTTP/1.1 only: the code
 * interpreter's host <49999>-<id>.<domain>. The Python SDKs keep HTTP/2 connections and, when
 * a run_code times out on their side, drop the stream without a reset; over HTTP/1.1 they close
 * the connection instead, which is how the server learns to interrupt the abandoned cell. */
bool sp_e2b_http1_only(sp_e2b_t *gw, const char *server_name);

/* Whether req is data-plane traffic of one sandbox, which the worker owning it must serve
 * (server/server.c forwards it there): anything on a sandbox host (envd, the code
 * interpreter, forwarded ports), envd and code paths naming the sandbox in E2B-Sandbox-Id,
 * and GET /sandboxes/{id}/metrics (its figures live in the worker's memory). The id goes to
 * id. An envd path with only an access token and no id is served here. */
bool sp_e2b_data_plane(sp_e2b_t *gw, h2o_req_t *req, char id[65]);

/* Whether req (one of this surface's) needs a worker that builds templates (server/server.c
 * sends it to one from a node that runs no VMs): POST /v3/templates, POST /v2/templates/{id}/
 * builds/{build}, GET /templates/{id}/builds/{build}/status, GET /templates/{id}/files/{hash}
 * and the upload link /upload/template-files/. The template a build and its status are about
 * goes to name, "" for the others (a reservation is a row; files are in the shared snapshot
 * dir): the fleet sends each name's builds to one worker (core/control/fleet.h). */
bool sp_e2b_build_route(h2o_req_t *req, char name[65]);

/* Whether sp_e2b_handle authorizes req itself before it reads a body left on the connection
 * (http/bodygate.h), so that the caller hands it over with its body unread: one sandbox's
 * traffic (envd, the code interpreter, a guest port: its token, its signature, or the
 * sandbox's public traffic), and a template-file upload link (its token). */
bool sp_e2b_checks_before_body(sp_e2b_t *gw, h2o_req_t *req);

/* Answers req (now or later). forwarded: another node sent it (a valid cluster header,
 * http/proxy.h): answered from this node's own memory, never by asking further nodes. */
void sp_e2b_handle(sp_e2b_t *gw, h2o_req_t *req, bool forwarded);

#endif
