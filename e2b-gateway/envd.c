/*
 * envd.c - envd's entry point (sp_e2b__envd: /health, /files, /envs and the Connect RPCs of
 * process and filesystem), and what every envd call shares: the call context (a hold on the
 * request), the effective user (Basic auth, username=, or the default user), the Connect and
 * HTTP error mappings, and the per-gateway handles on the core tables envd state lives in
 * (made on first use). /files is envd_files.c, the RPCs envd_process.c and envd_fs.c.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

#include "e2b-gateway/envd_int.h"

#include "core/channel/listcap.h"

/* ---- state and calls ---- */

struct sp_envd *sp_e2b__envd_state(sp_e2b_t *gw)
{
    if (gw->envd == NULL) {
        struct sp_envd *ev = calloc(1, sizeof(*ev));
        if (ev == NULL)
            return NULL;
        ev->gw = gw;
        ev->loop = sp_svc_loop(gw->svc);
        ev->procs = sp_proctab_create(ev->loop, sp_e2b__envd_agent, gw);
        ev->watchers = sp_fswatch_tab_create(ev->loop);
        if (ev->procs == NULL || ev->watchers == NULL) {
            sp_proctab_destroy(ev->procs);
            sp_fswatch_tab_destroy(ev->watchers);
            free(ev);
            return NULL;
        }
        gw->envd = ev;
    }
    return gw->envd;
}

void sp_e2b__envd_free(sp_e2b_t *gw)
{
    if (gw == NULL || gw->envd == NULL)
        return;
    sp_fswatch_tab_destroy(gw->envd->watchers);
    sp_proctab_destroy(gw->envd->procs);
    free(gw->envd);
    gw->envd = NULL;
}

const char *sp_e2b__envd_strdup(sp_carena_t *a, const char *s)
{
    if (s == NULL)
        return NULL;
    size_t n = strlen(s);
    char *d = sp_carena_alloc(a, n + 1);
    if (d != NULL)
        memcpy(d, s, n + 1);
    return d;
}

sp_loop_t *sp_e2b__envd_loop(envd_call_t *c)
{
    return c->ev->loop;
}

h2o_req_t *sp_e2b__envd_req(envd_call_t *c)
{
    return c->hold ? sp_http_hold_req(c->hold) : NULL;
}

void sp_e2b__envd_call_free(envd_call_t *c)
{
    if (c == NULL)
        return;
    if (c->data_free != NULL)
        c->data_free(c->data);
    sp_carena_free(&c->arena);
    if (c->hold != NULL)
        sp_http_release(c->hold);
    free(c);
}

h2o_req_t *sp_e2b__envd_take(envd_call_t *c)
{
    h2o_req_t *req = c->hold ? sp_http_release(c->hold) : NULL;
    c->hold = NULL;
    sp_e2b__envd_call_free(c);
    return req;
}

void sp_e2b__envd_truncated(envd_call_t *c)
{
    h2o_req_t *req = sp_e2b__envd_req(c);
    if (req != NULL)
        h2o_add_header_by_str(&req->pool, &req->res.headers, H2O_STRLIT(SP_LIST_TRUNCATED_HEADER),
                              0, NULL, H2O_STRLIT("true"));
}

void sp_e2b__envd_reply(envd_call_t *c, const sp_cdesc_t *d, const void *msg)
{
    h2o_req_t *req = sp_e2b__envd_req(c);
    if (req != NULL)
        sp_connect_reply(req, &c->cr, d, msg);
    sp_e2b__envd_call_free(c);
}

void sp_e2b__envd_fail(envd_call_t *c, sp_connect_code_t code, const char *msg)
{
    h2o_req_t *req = sp_e2b__envd_req(c);
    if (req != NULL && c->cr.streaming) {
        /* Streaming clients (connect-web) read only the status of a non-200 answer (404 would
         * be "unimplemented"): a stream error is 200 with the end-stream envelope. */
        static const sp_stream_cbs_t none = {NULL, NULL};
        sp_stream_t *st = sp_stream_start(
            req, 200, sp_connect_stream_ctype(c->cr.codec), -1, &none, NULL);
        if (st != NULL)
            sp_connect_stream_finish(st, code, msg);
        else
            sp_connect_reply_error(req, code, msg);
    } else if (req != NULL) {
        sp_connect_reply_error(req, code, msg);
    }
    sp_e2b__envd_call_free(c);
}

sp_connect_code_t sp_e2b__envd_code(const sp_err_t *err)
{
    if (err->code == SP_ENOTFOUND && strstr(err->msg, "unknown user") != NULL)
        return SP_CC_UNAUTHENTICATED;
    return sp_connect_code_from(err->code);
}

void sp_e2b__envd_fail_err(envd_call_t *c, const sp_err_t *err)
{
    sp_e2b__envd_fail(c, sp_e2b__envd_code(err), err->msg);
}

const char *sp_e2b__envd_default_user(void)
{
    const char *u = getenv("SPACE_E2B_DEFAULT_USER");
    return u != NULL && u[0] != '\0' && strlen(u) < 64 ? u : SP_ENVD_DEFAULT_USER;
}

bool sp_e2b__envd_user_ok(const char *u, size_t n)
{
    if (n == 0 || n > 63)
        return false;
    for (size_t i = 0; i < n; i++) {
        unsigned char ch = (unsigned char)u[i];
        if (ch <= 0x20 || ch == 0x7f || ch == ':' || ch == '/')
            return false;
    }
    return true;
}

/* Authorization: Basic base64("<user>:") -> c->user. -1 when present but unusable. */
int sp_e2b__envd_basic_user(h2o_req_t *req, envd_call_t *c)
{
    const char *a = sp_http_header(req, "authorization");
    if (a == NULL) {
        snprintf(c->user, sizeof(c->user), "%s", sp_e2b__envd_default_user());
        return 0;
    }
    if (strncasecmp(a, "Basic ", 6) != 0)
        return -1;
    const char *b = a + 6;
    while (*b == ' ')
        b++;
    size_t n = strlen(b);
    if (n > 256)
        return -1;
    uint8_t dec[200];
    long k = sp_connect_b64_decode(b, n, dec);
    if (k < 0)
        return -1;
    const uint8_t *colon = memchr(dec, ':', (size_t)k);
    size_t ul = colon ? (size_t)(colon - dec) : (size_t)k;
    if (ul == 0) {
        snprintf(c->user, sizeof(c->user), "%s", sp_e2b__envd_default_user());
        return 0;
    }
    if (!sp_e2b__envd_user_ok((const char *)dec, ul))
        return -1;
    memcpy(c->user, dec, ul);
    c->user[ul] = '\0';
    return 0;
}

/* ---- envd HTTP errors ({"code": status, "message"}, spec 3.6) ---- */

static int http_status(const sp_err_t *e)
{
    if (sp_e2b__envd_code(e) == SP_CC_UNAUTHENTICATED)
        return 401;
    switch (e->code) {
    case SP_EINVAL:
        return 400;
    case SP_ENOTFOUND:
        return 404;
    case SP_ETOOBIG:
        return 507; /* the agent's too-big on writes is ENOSPC/EFBIG */
    case SP_EFORBIDDEN:
        return 403;
    case SP_ECONFLICT:
        return 409;
    case SP_EUNAVAIL:
    case SP_ERUNTIME:
        return 502;
    default:
        return 500;
    }
}

void sp_e2b__envd_http_fail(envd_call_t *c, int status, const char *msg)
{
    h2o_req_t *req = sp_e2b__envd_req(c);
    if (req != NULL)
        sp_e2b__error(req, status, msg);
    sp_e2b__envd_call_free(c);
}

void sp_e2b__envd_http_fail_err(envd_call_t *c, const sp_err_t *e)
{
    sp_e2b__envd_http_fail(c, http_status(e), e->msg);
}

/* ---- /envs ---- */

static void envs_done(void *arg, const sp_exec_result_t *res, const sp_err_t *err)
{
    envd_call_t *c = arg;
    if (err != NULL) {
        sp_e2b__envd_http_fail_err(c, err);
        return;
    }
    json_t *o = json_object();
    if (!res->exited || res->exit_code != 0)
        res = NULL; /* no file: a sandbox that was never given an env (or an older agent) */
    const char *p = res ? (const char *)res->out : "", *end = p + (res ? res->out_len : 0);
    while (p < end) {
        const char *z = memchr(p, '\0', (size_t)(end - p));
        size_t n = z ? (size_t)(z - p) : (size_t)(end - p);
        const char *eq = memchr(p, '=', n);
        if (eq != NULL && eq > p) {
            char *k = strndup(p, (size_t)(eq - p));
            json_t *v = sp_exec_json_bytes(eq + 1, n - (size_t)(eq - p) - 1);
            if (k != NULL && v != NULL)
                json_object_set_new(o, k, v);
            else
                json_decref(v);
            free(k);
        }
        p += n + 1;
    }
    h2o_req_t *req = sp_e2b__envd_req(c);
    if (req != NULL)
        sp_http_json(req, 200, o);
    else
        json_decref(o);
    sp_e2b__envd_call_free(c);
}

/* envd's /envs answers the sandbox's own variables (those given at create), not a process's
 * whole environment: the file the agent writes at IDENTITY. */
static void envs_get(envd_call_t *c)
{
    static const char *const argv[] = {"/bin/cat", SP_AP_ENV_FILE};
    sp_exec_cmd_t cmd = {.argv = argv, .argc = 2, .user = NULL, .timeout_ms = 10000};
    sp_err_t e;
    if (sp_exec_run(sp_e2b__envd_loop(c), c->conn, &cmd, 1 << 20, envs_done, c, &e) == NULL)
        sp_e2b__envd_http_fail_err(c, &e);
}

/* ---- dispatch ---- */

static size_t path_len(h2o_req_t *req)
{
    return req->query_at != SIZE_MAX ? req->query_at : req->path.len;
}

static bool path_is(h2o_req_t *req, const char *p)
{
    return h2o_memis(req->path.base, path_len(req), p, strlen(p));
}

static const char *path_after(h2o_req_t *req, const char *prefix)
{
    size_t n = strlen(prefix), l = path_len(req);
    if (l <= n || memcmp(req->path.base, prefix, n) != 0)
        return NULL;
    char *m = h2o_mem_alloc_pool(&req->pool, l - n + 1);
    memcpy(m, req->path.base + n, l - n);
    m[l - n] = '\0';
    return m;
}

void sp_e2b__envd(sp_e2b_t *gw, h2o_req_t *req, const sp_e2b_target_t *t)
{
    struct sp_envd *ev = sp_e2b__envd_state(gw);
    envd_call_t *c = ev ? calloc(1, sizeof(*c)) : NULL;
    if (c == NULL || (c->hold = sp_http_hold(req, 0)) == NULL) {
        free(c);
        sp_e2b__error(req, 500, "out of memory");
        return;
    }
    c->gw = gw;
    c->ev = ev;
    snprintf(c->sandbox_id, sizeof(c->sandbox_id), "%s", t->sandbox_id);
    c->auth = t->auth;
    snprintf(c->access_token, sizeof(c->access_token), "%s", t->access_token);
    c->conn = t->conn;
    c->signed_url = t->signed_url;

    if (path_is(req, "/health")) {
        h2o_req_t *r = sp_e2b__envd_take(c);
        if (!sp_agentconn_up(t->conn)) {
            sp_e2b__error(r, 502, "sandbox is not answering");
            return;
        }
        r->res.status = 204;
        r->res.reason = "No Content";
        h2o_send_inline(r, "", 0);
        return;
    }
    if (path_is(req, "/files")) {
        sp_e2b__envd_files(c, req);
        return;
    }
    if (path_is(req, "/envs")) {
        if (!sp_http_method_is(req, "GET")) {
            sp_e2b__envd_http_fail(c, 405, "GET");
            return;
        }
        snprintf(c->user, sizeof(c->user), "%s", sp_e2b__envd_default_user());
        envs_get(c);
        return;
    }
    const char *pm = path_after(req, "/process.Process/");
    const char *fm = pm ? NULL : path_after(req, "/filesystem.Filesystem/");
    if (pm == NULL && fm == NULL) {
        sp_e2b__envd_http_fail(c, 404, "no such path");
        return;
    }
    if (!sp_http_method_is(req, "POST")) {
        sp_e2b__envd_fail(c, SP_CC_UNIMPLEMENTED, "Connect RPCs are POST");
        return;
    }
    sp_err_t e;
    if (sp_connect_request(req, &c->cr, &e) < 0) {
        sp_e2b__envd_fail(c, SP_CC_INVALID_ARGUMENT, e.msg);
        return;
    }
    if (sp_e2b__envd_basic_user(req, c) < 0) {
        sp_e2b__envd_fail(c, SP_CC_UNAUTHENTICATED, "invalid Authorization header");
        return;
    }
    if (pm != NULL)
        sp_e2b__envd_process(c, pm);
    else
        sp_e2b__envd_fs(c, fm);
}
