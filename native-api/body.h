/*
 * body.h - the native API's request bodies read into what its routes hand to core: the JSON
 * text, the field helpers every route reads with, and one pure function per body (a JSON
 * object -> a struct, or SP_EINVAL naming the field).
 *
 * Knows no h2o and no server state, so the libFuzzer target tests/fuzz_bodies.c
 * drives each parser as the routes do, without a server. The routes (route_*.c) keep what
 * needs the request or the server: authentication, the sandbox lookup, the call into core.
 *
 * Optional fields: absent and JSON null are the same thing and leave the output as it was
 * (strings: NULL). b may be NULL (no body): every field is then absent. Strings are borrowed
 * from b unless a function says it copies.
 */
#ifndef SP_NAPI_BODY_H
#define SP_NAPI_BODY_H

#include <jansson.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "base/err.h"
#include "core/channel/code.h"
#include "core/channel/exec.h"
#include "core/control/admin.h"
#include "core/control/svc.h"

#define NAPI_MAX_BODY (1024 * 1024) /* JSON bodies; larger is 413 */

/* ---- the JSON text and its fields ---- */

/* p[0..n) as JSON (any value; *out NULL when n is 0): 413 past NAPI_MAX_BODY, 400 when
 * malformed. quiet: the parser's message, which quotes the text near the error, is replaced
 * by its line and column (bodies that hold secrets). */
int sp_napi__json_body(const char *p, size_t n, bool quiet, json_t **out, sp_err_t *err);
/* b has only the allowed keys (NULL-terminated list). b NULL: fine unless required ("request
 * body must be a JSON object"). */
int sp_napi__body_keys(const json_t *b, const char *const *allowed, bool required, sp_err_t *err);
/* The field, or NULL when absent or null (borrowed). */
json_t *sp_napi__field(const json_t *b, const char *key);
/* A string without NUL of at most maxlen bytes. */
int sp_napi__opt_str(const json_t *b, const char *key, size_t maxlen, const char **out,
                     sp_err_t *err);
/* A string that must be there (NUL allowed: the caller decides), or NULL with err. */
json_t *sp_napi__req_string(const json_t *b, const char *key, sp_err_t *err);
int sp_napi__opt_bool(const json_t *b, const char *key, bool *out, sp_err_t *err);
int sp_napi__opt_int(const json_t *b, const char *key, int lo, int hi, int *out, sp_err_t *err);
/* A signal given as a number (1..64) or a name ("SIGTERM", "TERM"); -1 for anything else. */
int sp_napi__signal(const json_t *v);

/* ---- command specs (cmdspec.c) ----
 * The process a POST .../commands or .../sessions body describes: cmd or argv, env, cwd,
 * user, pty, rows and cols, as an sp_exec_cmd_t whose strings are copies owned here. The
 * route's parser checks its keys first and reads its own fields (stdin, timeout_s, ...). */
typedef struct {
    sp_exec_cmd_t cmd;
    char **strs; /* what cmd points into */
    size_t nstrs, cap;
} napi_cmdspec_t;

/* Fills *s from b: sp_napi__cmdspec_clear frees it; after -1 it holds nothing. */
int sp_napi__cmdspec_parse(const json_t *b, napi_cmdspec_t *s, sp_err_t *err);
/* A copy of n bytes of p (and a NUL) that lives as long as s; NULL when out of memory. */
const char *sp_napi__cmdspec_keep(napi_cmdspec_t *s, const char *p, size_t n);
void sp_napi__cmdspec_clear(napi_cmdspec_t *s);

/* ---- one parser per body ---- */

/* Any body without fields (lifecycle requests, context restart and interrupt): {} or none. */
int sp_napi__body_none(const json_t *b, sp_err_t *err);

/* POST /v1/sandboxes: *r's json fields (metadata, env, egress, credentials, placement labels)
 * are borrowed from b and checked by core. */
int sp_napi__body_create(const json_t *b, sp_create_req_t *r, sp_err_t *err);

/* POST /v1/sandboxes/{id}/snapshots {"name"?}. */
int sp_napi__body_snapshot(const json_t *b, const char **name, sp_err_t *err);

/* POST .../commands: the command (copies) and how to answer. stream: ?stream= (the body's
 * "stream" overrides it). */
typedef struct {
    napi_cmdspec_t spec; /* the process, and stdin, tag and timeout added here */
    bool background, stream;
} napi_runspec_t;
/* NULL with err; else the caller's, freed with sp_napi__runspec_free. */
napi_runspec_t *sp_napi__body_run(const json_t *b, bool stream, sp_err_t *err);
void sp_napi__runspec_free(void *r);

/* POST .../commands/{id}/stdin {"data"?, "eof"?}: *data is "" and *len 0 without data. */
int sp_napi__body_stdin(const json_t *b, const char **data, size_t *len, bool *eof, sp_err_t *err);
/* POST .../commands/{id}/signal {"signal", "group"?}: *group is true unless given. */
int sp_napi__body_signal(const json_t *b, int *sig, bool *group, sp_err_t *err);

/* POST .../files/mkdir {"path", "user"?, "mode"?}: *mode 0 when absent. */
int sp_napi__body_mkdir(const json_t *b, const char **path, const char **user, uint32_t *mode,
                        sp_err_t *err);
/* POST .../files/move {"from", "to", "user"?}. */
int sp_napi__body_move(const json_t *b, const char **from, const char **to, const char **user,
                       sp_err_t *err);
/* A user name (files routes): NULL, or 1 to 63 characters. */
int sp_napi__check_user(const char *user, sp_err_t *err);
/* Octal permission bits from "644"/"0755"; s NULL leaves *out. */
int sp_napi__parse_mode(const char *s, uint32_t *out, sp_err_t *err);

/* POST .../sessions: the command (copies) and its attach timeout. */
typedef struct {
    napi_cmdspec_t spec;
    uint32_t ttl_s;
} napi_sessspec_t;
/* NULL with err; else the caller's, freed with sp_napi__sessspec_free. */
napi_sessspec_t *sp_napi__body_session(const json_t *b, sp_err_t *err);
void sp_napi__sessspec_free(void *s);

/* POST .../contexts {"language"?, "cwd"?}. */
int sp_napi__body_context(const json_t *b, const char **language, const char **cwd, sp_err_t *err);
/* POST .../execute and .../contexts/{ctx}/execute: path_ctx is the context the path names
 * (NULL for .../execute), which then is req->context_id. */
int sp_napi__body_exec(const json_t *b, const char *path_ctx, sp_code_exec_req_t *req,
                       sp_err_t *err);

/* POST /v1/secrets {"name", "value"} (named) and PUT /v1/secrets/{name} {"value"}: *name NULL
 * when not named. The value is never quoted in an error. */
int sp_napi__body_secret(const json_t *b, bool named, const char **name, const char **value,
                         size_t *len, sp_err_t *err);
/* PUT .../credentials {"credentials": [...]}: the rules, checked by core. */
int sp_napi__body_credentials(const json_t *b, json_t **rules, sp_err_t *err);

/* POST /v1/admin/teams {"name"}. */
int sp_napi__body_team(const json_t *b, const char **name, sp_err_t *err);
/* POST /v1/admin/teams/{id}/quota: limits[0..4) for sandboxes, vcpus, memory_mb, snapshot_mb,
 * each SP_ADMIN_QUOTA_KEEP (absent), SP_ADMIN_QUOTA_DEFAULT (null) or 0 to SP_ADMIN_QUOTA_MAX. */
int sp_napi__body_quota(const json_t *b, long limits[SP_ADMIN_NQUOTA], sp_err_t *err);
/* POST /v1/admin/teams/{id}/keys {"name"?}. */
int sp_napi__body_key(const json_t *b, const char **name, sp_err_t *err);

/* PUT /v1/templates/{name}/tags/{tag} {"version"} or {"from_tag"}. */
int sp_napi__body_tag(const json_t *b, const char **version, const char **from_tag, sp_err_t *err);

#endif
