/*
 * napi.h - the native HTTP API (/v1/..., /healthz).
 *
 * Folder: native-api/ is one of the two HTTP surfaces: it parses, authenticates, calls core and
 * renders; it keeps no state. (ARCHITECTURE.md: the layers.)
 *
 * Parses and authenticates (Authorization: Bearer <key>: a team's API key, or on
 * /v1/admin the installation's admin key), calls one core operation (core/control/svc.h,
 * core/control/admin.h), renders JSON. Its only state is the table of command
 * sessions (core/channel/session.h), which lives in this process's memory.
 */
#ifndef SP_NAPI_H
#define SP_NAPI_H

#include <h2o.h>
#include <stdbool.h>

#include "core/control/admin.h"
#include "core/control/fleet.h"
#include "core/control/snap.h"
#include "core/control/svc.h"
#include "core/control/tmpl.h"

typedef struct sp_napi sp_napi_t;

sp_napi_t *sp_napi_create(sp_svc_t *svc);
void sp_napi_destroy(sp_napi_t *n);

/* The runtime driver (borrowed; outlives n): command sessions attach to a VM's agent channel
 * through it, without the database. Without one, attaching answers 503. */
void sp_napi_set_driver(sp_napi_t *n, sp_driver_t *driver);

/* The admin routes' operations (borrowed; outlives n). Without them, /v1/admin answers 503. */
void sp_napi_set_admin(sp_napi_t *n, sp_admin_t *admin);

/* Template builds (borrowed; outlives n). Without them, building answers 503. */
void sp_napi_set_tmpl(sp_napi_t *n, sp_tmpl_t *tmpl);
/* Sandbox snapshots (borrowed, outlives n); without them /v1/snapshots answers 503. */
void sp_napi_set_snap(sp_napi_t *n, sp_snap_t *snap);

/* The fleet (borrowed, outlives n): /v1/workers, with the admin key; without it they answer 503. */
void sp_napi_set_fleet(sp_napi_t *n, sp_fleet_t *fleet);

/* Whether path belongs to this API (/v1/ and /healthz). */
bool sp_napi_owns(h2o_req_t *req);

/* For the request metrics (http/reqmetrics.h), of a request sp_napi_owns: its route class, a
 * static string from a fixed set ("sandboxes", "sandbox", "sandbox_commands", ...; never an id). */
const char *sp_napi_route_class(h2o_req_t *req);

/* Whether req is data-plane traffic of one sandbox, which the worker owning it must serve
 * (server/server.c forwards it there): /v1/sandboxes/{id}/ commands, files, sessions,
 * contexts, execute, egress and credentials, and all below them, and a session's attach
 * /v1/attach/{id}/{session} (route_sessions.c). The id goes to id. */
bool sp_napi_data_plane(h2o_req_t *req, char id[65]);

/* Whether req needs a worker that builds templates (server/server.c sends it to one from a
 * node that runs no VMs): POST /v1/templates, /v1/template-files/{sha256}, GET /v1/templates/
 * {name}/builds/{id}[/logs]. The template it is about goes to name (the body's "name" for a
 * build; "" for files, which every worker finds in the shared snapshot dir):
 * the fleet sends each name's builds to one worker (core/control/fleet.h). */
bool sp_napi_build_route(h2o_req_t *req, char name[65]);

/* Answers req (now or later). */
void sp_napi_handle(sp_napi_t *n, h2o_req_t *req);

/* The OpenAPI document served at /v1/openapi.json. */
extern const char sp_napi_openapi_json[];

#endif
