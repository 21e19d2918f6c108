/*
 * body.h - the E2B gateway's JSON request bodies read into what its routes hand to core: the
 * control plane's (create, timeout and refreshes, connect and resume, snapshots) and the code
 * interpreter's (contexts, execute). One pure function per body: a JSON object -> a struct,
 * or -1 with why, the message of the 400 the route answers.
 *
 * Knows no h2o and no server state, so the libFuzzer target tests/fuzz_bodies.c
 * drives each parser as the routes do, without a server. What core checks itself (metadata,
 * env, an egress rule's text) it checks there too. Strings are borrowed from the body.
 */
#ifndef SP_E2B_BODY_H
#define SP_E2B_BODY_H

#include <jansson.h>
#include <stdbool.h>
#include <stddef.h>

#include "core/channel/code.h"
#include "core/control/snap.h"
#include "core/control/svc.h"

#define SP_E2B_WHY_MAX 256         /* bytes of a 400's message, its NUL included */
#define CTL_MAX_BODY (1024 * 1024) /* control plane JSON bodies; larger is 413 */
#define CTL_DEFAULT_TMO_S 15       /* NewSandbox.timeout when the body has none (E2B's default) */
#define CTL_ZERO_TMO_S 300 /* what a timeout of 0 means on create/connect (the SDK's default) */
#define CTL_REFRESH_S 15   /* refreshes without a duration */
#define CTL_REFRESH_MAX_S 3600

/* ---- the control plane (route_sandboxes.c, route_snapshots.c) ---- */

/* p[0..n) as a control plane body: *out NULL when n is 0, else a JSON object (the caller's).
 * -1 with *status 413 (larger than CTL_MAX_BODY) or 400 and why. */
int sp_e2b__json_body(const char *p, size_t n, json_t **out, int *status, char why[SP_E2B_WHY_MAX]);

/* POST /sandboxes: the body is there and its templateID a non-empty string. */
int sp_e2b__body_template(const json_t *b, char why[SP_E2B_WHY_MAX]);
/* POST /sandboxes, the rest (read once templateID named a template or a snapshot): *r's
 * timeouts, lifecycle, outbound settings, metadata and env (borrowed from b), but not
 * template_name or snapshot_id. r->egress is new (json_decref it) or NULL. */
int sp_e2b__body_create(const json_t *b, sp_create_req_t *r, char why[SP_E2B_WHY_MAX]);
/* POST /sandboxes/{id}/timeout {"timeout"} (refresh false) or /refreshes {"duration"?}. */
int sp_e2b__body_deadline(const json_t *b, bool refresh, int *secs, char why[SP_E2B_WHY_MAX]);
/* POST /sandboxes/{id}/connect {"timeout"} (resume false) or /resume {"timeout"?,
 * "autoPause"?}: *timeout_s, and *action "suspend" or "delete" when autoPause was given, else
 * "". */
int sp_e2b__body_connect(const json_t *b, bool resume, int *timeout_s, char action[16],
                         char why[SP_E2B_WHY_MAX]);
/* POST /sandboxes/{id}/snapshots {"name"?}: name normalised ("" when none); a
 * "<namespace>/<name>" must name team_id's namespace. */
int sp_e2b__body_snapshot(const json_t *b, const char *team_id, char name[SP_SNAP_NAME_MAX + 1],
                          char why[SP_E2B_WHY_MAX]);

/* ---- template builds (route_templates.c) ---- */

/* "[team/]alias[:tag]" -> alias in out (lower-cased), the tag (or "") in tag when not NULL;
 * false with why (cap bytes) for another namespace, a bad name or a bad tag. */
bool sp_e2b__name_tag(const char *team, const char *in, char out[65], char tag[65], char *why,
                      size_t cap);
/* POST /v3/templates {name | alias, tags?, cpuCount?, memoryMB?} of team: the template's
 * alias, the tags its version gets (*tags new: json_decref it), and the sizes (0: absent; -1:
 * past any range, for core to refuse). */
int sp_e2b__body_template_reserve(const json_t *b, const char *team, char alias[65],
                                  json_t **tags, int *cpu_count, int *memory_mb,
                                  char why[SP_E2B_WHY_MAX]);
/* POST /v2/templates/{id}/builds/{build} {fromTemplate | fromImage (+ fromImageRegistry),
 * steps, startCmd?, readyCmd?, force?}: *out the build request for core (tmpl.h; new,
 * json_decref it) of template_name with the reserved sizes (0: the parent's); E2B's steps
 * made into tmpl's (run as "user" in /home/user unless they say otherwise). */
int sp_e2b__body_template_build(const json_t *body, const char *team, const char *template_name,
                                int cpu_count, int memory_mb, json_t **out,
                                char why[SP_E2B_WHY_MAX]);

/* ---- the code interpreter (envd_code.c) ---- */

/* p[0..n) as a JSON object, new; an empty body is {} when empty_ok. NULL with why. */
json_t *sp_e2b__code_body(const char *p, size_t n, bool empty_ok, char why[SP_E2B_WHY_MAX]);
/* POST /contexts {"language"?, "cwd"?}: "" reads as absent. */
int sp_e2b__body_code_context(const json_t *o, const char **language, const char **cwd,
                              char why[SP_E2B_WHY_MAX]);
/* POST /execute {"code", "context_id"?, "language"?, "env_vars"?}: no timeout (the SDK keeps
 * its own). */
int sp_e2b__body_code_exec(const json_t *o, sp_code_exec_req_t *r, char why[SP_E2B_WHY_MAX]);

#endif
