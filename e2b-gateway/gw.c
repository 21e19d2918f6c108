/*
 * gw.c - the gateway's dispatcher: classifies each request (requests, not
 * connections: one keep-alive connection mixes the API and many sandboxes),
 * resolves and authenticates the sandbox for sandbox traffic, and hands the
 * request to the part that answers it.
 *
 * Sandbox selection (spec 1.6): Host <port>-<id>.<domain> first; else, for envd
 * paths, the E2b-Sandbox-Id header; else the X-Access-Token alone (an envd path with
 * neither is 401, as envd answers a request without its token). Code-interpreter
 * paths (/execute, /contexts...) on the API address are port 49999 traffic selected the
 * same way (E2B_DEBUG sends them to localhost:49999 with only the token). Who may reach
 * what, and the one answer for an unknown sandbox, another team's and a credential that does
 * not open it: "sandbox traffic" below.
 */
#include "e2b-gateway/gw_int.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "base/log.h"
#include "core/control/tokens.h"
#include "http/bodygate.h"

sp_e2b_t *sp_e2b_create(sp_svc_t *svc, const sp_e2b_opts_t *o)
{
    sp_e2b_t *gw = calloc(1, sizeof(*gw));
    if (gw == NULL)
        return NULL;
    gw->svc = svc;
    snprintf(gw->domain, sizeof(gw->domain), "%s",
             o && o->domain ? o->domain : "space.localhost");
    return gw;
}

void sp_e2b_set_tmpl(sp_e2b_t *gw, sp_tmpl_t *tmpl)
{
    gw->tmpl = tmpl;
}

void sp_e2b_set_snap(sp_e2b_t *gw, sp_snap_t *snap)
{
    gw->snap = snap;
}

void sp_e2b_set_peers(sp_e2b_t *gw, sp_proxy_t *proxy, const char *self_worker_id)
{
    gw->proxy = proxy;
    snprintf(gw->self, sizeof(gw->self), "%s", self_worker_id != NULL ? self_worker_id : "");
}

void sp_e2b_destroy(sp_e2b_t *gw)
{
    if (gw == NULL)
        return;
    sp_e2b__envd_free(gw);
    free(gw);
}

/* ---- errors ---- */

void sp_e2b__error(h2o_req_t *req, int status, const char *msg)
{
    sp_http_json(req, status, json_pack("{s:i,s:s}", "code", status, "message", msg));
}

void sp_e2b__error_from(h2o_req_t *req, const sp_err_t *err)
{
    sp_e2b__error(req, sp_err_http_status(err->code), err->msg);
}

/* ---- classification ---- */

static size_t path_len(h2o_req_t *req)
{
    return req->query_at != SIZE_MAX ? req->query_at : req->path.len;
}

static bool path_is(h2o_req_t *req, const char *p)
{
    return h2o_memis(req->path.base, path_len(req), p, strlen(p));
}

static bool path_starts(h2o_req_t *req, const char *p)
{
    size_t n = strlen(p);
    return path_len(req) >= n && memcmp(req->path.base, p, n) == 0;
}

bool sp_e2b__is_envd_path(h2o_req_t *req)
{
    return path_starts(req, "/process.Process/") || path_starts(req, "/filesystem.Filesystem/") ||
           path_is(req, "/files") || path_is(req, "/health") || path_is(req, "/envs");
}

bool sp_e2b__is_control_path(h2o_req_t *req)
{
    return path_is(req, "/sandboxes") || path_starts(req, "/sandboxes/") ||
           path_starts(req, "/v2/sandboxes") || path_is(req, "/snapshots") ||
           path_starts(req, "/templates") || path_starts(req, "/v2/templates") ||
           path_starts(req, "/v3/templates") || path_starts(req, "/upload/template-files/") ||
           path_is(req, "/volumes") || path_starts(req, "/volumes/") ||
           path_starts(req, "/volumecontent/"); /* 501: route_sandboxes.c */
}

/*
 * Host "<port>-<id>.<domain>[:port]": fills port and id; false when the host is not a sandbox
 * host of our domain. The domain's own ":port" (if any) is compared too.
 */
static bool parse_sandbox_name(sp_e2b_t *gw, const char *h, size_t n, int *port, char id[65])
{
    const char *dot = memchr(h, '.', n);
    if (dot == NULL)
        return false;
    size_t rest = n - (size_t)(dot + 1 - h);
    /* The rest must be our domain, with or without the port the client used. */
    size_t dl = strlen(gw->domain);
    const char *dcolon = strchr(gw->domain, ':');
    size_t dhost = dcolon ? (size_t)(dcolon - gw->domain) : dl;
    const char *r = dot + 1;
    if (!(rest == dl && memcmp(r, gw->domain, dl) == 0) &&
        !(rest >= dhost && memcmp(r, gw->domain, dhost) == 0 &&
          (rest == dhost || r[dhost] == ':')))
        return false;
    const char *dash = memchr(h, '-', (size_t)(dot - h));
    if (dash == NULL || dash == h || dot - dash - 1 <= 0 || dot - dash - 1 > 64)
        return false;
    int p = 0;
    for (const char *c = h; c < dash; c++) {
        if (*c < '0' || *c > '9' || p > 65535)
            return false;
        p = p * 10 + (*c - '0');
    }
    if (p <= 0 || p > 65535)
        return false;
    memcpy(id, dash + 1, (size_t)(dot - dash - 1));
    id[dot - dash - 1] = '\0';
    if (!sp_ids_valid(id))
        return false;
    *port = p;
    return true;
}

static bool parse_sandbox_host(sp_e2b_t *gw, h2o_req_t *req, int *port, char id[65])
{
    return parse_sandbox_name(gw, req->authority.base, req->authority.len, port, id);
}

bool sp_e2b_http1_only(sp_e2b_t *gw, const char *server_name)
{
    int port;
    char id[65];
    return server_name != NULL &&
           parse_sandbox_name(gw, server_name, strlen(server_name), &port, id) &&
           port == SP_E2B_CODE_PORT;
}

bool sp_e2b_owns(sp_e2b_t *gw, h2o_req_t *req)
{
    int port;
    char id[65];
    if (parse_sandbox_host(gw, req, &port, id))
        return true;
    if (sp_e2b__is_control_path(req))
        return true;
    /* envd paths on the API address (E2B_SANDBOX_URL) are always ours (the native API has
     * none of them): without a sandbox selector they answer 401 as envd does for a request
     * without its token, which the SDKs report as an authentication error. */
    return sp_e2b__is_envd_path(req) ||
           (sp_e2b__is_code_path(req) && sp_http_header(req, "x-access-token") != NULL);
}

/* The n-th segment of the path (from 0, after the leading '/'): its start and length. */
static bool path_seg(h2o_req_t *req, int n, const char **seg, size_t *len)
{
    const char *p = req->path.base, *end = p + path_len(req);
    for (int i = 0; p < end; i++) {
        p++; /* the '/' */
        const char *e = memchr(p, '/', (size_t)(end - p));
        if (e == NULL)
            e = end;
        if (i == n) {
            *seg = p;
            *len = (size_t)(e - p);
            return true;
        }
        p = e;
    }
    return false;
}

static bool seg_is(h2o_req_t *req, int n, const char *s)
{
    const char *seg;
    size_t len;
    return path_seg(req, n, &seg, &len) && h2o_memis(seg, len, s, strlen(s));
}

void sp_e2b_classify(sp_e2b_t *gw, h2o_req_t *req, const char **surface, const char **route)
{
    int port = 0;
    char id[65];
    bool on_sandbox_host = parse_sandbox_host(gw, req, &port, id);
    if (on_sandbox_host || !sp_e2b__is_control_path(req)) {
        *surface = "envd";
        if (on_sandbox_host && SP_E2B_FORWARDED_PORT(port))
            *route = "guest_port";
        else if (port == SP_E2B_CODE_PORT || sp_e2b__is_code_path(req))
            *route = "code";
        else if (path_starts(req, "/process.Process/"))
            *route = "process";
        else if (path_starts(req, "/filesystem.Filesystem/"))
            *route = "filesystem";
        else if (path_is(req, "/files"))
            *route = "files";
        else if (path_is(req, "/health") || path_is(req, "/envs"))
            *route = "envd_info";
        else
            *route = "other";
        return;
    }
    *surface = "e2b";
    int b = seg_is(req, 0, "v2") ? 1 : 0; /* /v2/sandboxes... as /sandboxes... */
    static const struct {
        const char *seg, *route;
    } subs[] = {{"pause", "sandbox_pause"},       {"resume", "sandbox_resume"},
                {"connect", "sandbox_connect"},   {"timeout", "sandbox_timeout"},
                {"refreshes", "sandbox_refresh"}, {"metrics", "sandbox_metrics"},
                {"logs", "sandbox_logs"},         {"snapshots", "sandbox_snapshots"}};
    const char *seg;
    size_t len;
    if (seg_is(req, b, "snapshots")) {
        *route = "snapshots";
    } else if (seg_is(req, b, "templates")) {
        *route = "templates";
    } else if (!path_seg(req, b + 1, &seg, &len) || len == 0) {
        *route = "sandboxes";
    } else if (h2o_memis(seg, len, H2O_STRLIT("metrics")) && !path_seg(req, b + 2, &seg, &len)) {
        *route = "sandboxes_metrics";
    } else if (!path_seg(req, b + 2, &seg, &len)) {
        *route = "sandbox";
    } else {
        *route = "sandbox_other";
        for (size_t i = 0; i < sizeof(subs) / sizeof(subs[0]); i++)
            if (h2o_memis(seg, len, subs[i].seg, strlen(subs[i].seg)))
                *route = subs[i].route;
    }
}

bool sp_e2b_data_plane(sp_e2b_t *gw, h2o_req_t *req, char id[65])
{
    int port;
    if (parse_sandbox_host(gw, req, &port, id))
        return true;
    if (sp_e2b__is_control_path(req)) {
        /* [/v2]/sandboxes/{id}/metrics and /snapshots (the worker's runtime takes them), and
         * nothing below either */
        const char *seg;
        size_t len;
        int b = seg_is(req, 0, "v2") ? 1 : 0;
        if (!seg_is(req, b, "sandboxes") ||
            !(seg_is(req, b + 2, "metrics") || seg_is(req, b + 2, "snapshots")) ||
            path_seg(req, b + 3, &seg, &len) || !path_seg(req, b + 1, &seg, &len) || len == 0 ||
            len >= 65)
            return false;
        memcpy(id, seg, len);
        id[len] = '\0';
        return true;
    }
    if (sp_e2b__is_envd_path(req) || sp_e2b__is_code_path(req)) {
        const char *hid = sp_http_header(req, "e2b-sandbox-id");
        if (hid == NULL || strlen(hid) >= 65)
            return false;
        snprintf(id, 65, "%s", hid);
        return true;
    }
    return false;
}

static bool eq(const char *const *g, int i, const char *s)
{
    return strcmp(g[i], s) == 0;
}

bool sp_e2b_build_route(h2o_req_t *req, char name[65])
{
    const char *g[8];
    int n = sp_http_segments(req, g, 8);
    bool get = sp_http_method_is(req, "GET"), post = sp_http_method_is(req, "POST");
    name[0] = '\0';
    if ((n == 5 && post && eq(g, 0, "v2") && eq(g, 1, "templates") && eq(g, 3, "builds")) ||
        (n == 5 && get && eq(g, 0, "templates") && eq(g, 2, "builds") && eq(g, 4, "status"))) {
        snprintf(name, 65, "%s", post ? g[2] : g[1]);
        return true;
    }
    return (n == 2 && post && eq(g, 0, "v3") && eq(g, 1, "templates")) ||
           (n == 4 && get && eq(g, 0, "templates") && eq(g, 2, "files")) ||
           (n >= 2 && eq(g, 0, "upload") && eq(g, 1, "template-files"));
}

/* ---- sandbox traffic ---- */

/*
 * Who may reach a sandbox's data plane (README "Data-plane authorization"):
 *   envd (49983)       X-Access-Token; /files also a valid signature (spec 3.7) instead.
 *   interpreter (49999) X-Access-Token or E2B-Traffic-Access-Token, for /execute and the
 *                      context calls alike (the JS SDK sends only the traffic token on those).
 *   other ports        nothing when the sandbox allows public traffic (the default), else
 *                      either token.
 * A credential that does not open the sandbox, a sandbox that does not exist and another
 * team's answer the same status and body (no existence oracle): by what was presented, 401
 * "invalid access token for this sandbox", 401 "invalid signature", or on a port host without
 * any, E2B's 502 "The sandbox was not found". A sandbox is woken (autoResume) only after this.
 */
typedef enum {
    CRED_NONE = 0, /* a forwarded port's request without a token: public sandboxes only */
    CRED_ENVD,     /* X-Access-Token: checked by the lookup itself (its keyed hash) */
    CRED_TRAFFIC,  /* E2B-Traffic-Access-Token alone: checked against the record */
    CRED_SIGNED,   /* /files with signature=: checked against the record */
} cred_t;

struct resolve {
    sp_e2b_t *gw;
    sp_http_hold_t *hold;
    sp_e2b_target_t t;
    cred_t cred;
    bool wake;                      /* authorized: it is woken (autoResume) or waited for */
    char traffic[SP_TOKEN_LEN + 1]; /* CRED_TRAFFIC: what was presented */
    char asked[65];                 /* the id asked for, "" when none */
};

static void resolve_fail(struct resolve *rs, int status, const char *msg)
{
    h2o_req_t *req = sp_http_release(rs->hold);
    if (req != NULL)
        sp_e2b__error(req, status, msg);
}

/* The answer for a sandbox that is not there, is another team's, or that the credential
 * presented does not open: one per kind of credential, the same for all three. */
static void resolve_unknown(struct resolve *rs)
{
    if (rs->cred == CRED_NONE) {
        /* E2B's edge: an unknown sandbox behind a port host is 502 "not found". */
        json_t *body = json_pack("{s:s,s:s,s:i}", "sandboxId", rs->asked, "message",
                                 "The sandbox was not found", "code", 502);
        h2o_req_t *req = sp_http_release(rs->hold); /* frees rs */
        if (req != NULL)
            sp_http_json(req, 502, body);
        else
            json_decref(body);
        return;
    }
    resolve_fail(rs, 401,
                 rs->cred == CRED_SIGNED ? "invalid signature"
                                         : "invalid access token for this sandbox");
}

static void on_agent(void *arg, sp_agentconn_t *conn, const sp_err_t *err)
{
    struct resolve *rs = arg;
    if (err != NULL) {
        /* Not running (paused/suspended) reads as "sandbox timeout" to the SDK: 502. */
        int status = err->code == SP_ENOTFOUND ? 404 : 502;
        resolve_fail(rs, status, err->msg);
        return;
    }
    rs->t.conn = conn;
    h2o_req_t *req = sp_http_hold_req(rs->hold);
    if (req == NULL) {
        sp_http_release(rs->hold);
        return;
    }
    sp_e2b_target_t t = rs->t;
    sp_e2b_t *gw = rs->gw;
    sp_http_release(rs->hold); /* rs lived in the hold; the part takes over req from here */
    if (t.port == SP_E2B_ENVD_PORT)
        sp_e2b__envd(gw, req, &t);
    else if (t.port == SP_E2B_CODE_PORT)
        sp_e2b__code(gw, req, &t);
    else
        sp_e2b__forward(gw, req, &t);
}

static void on_woken(void *arg, const sp_err_t *err)
{
    struct resolve *rs = arg;
    sp_err_t e;
    if (err != NULL)
        on_agent(rs, NULL, err); /* same answers as a sandbox that is not running */
    else if (sp_svc_sandbox_agent(rs->gw->svc, &rs->t.auth, rs->t.sandbox_id, on_agent, rs,
                                  &e) < 0)
        on_agent(rs, NULL, &e);
}

/* Whether the record found by id alone is opened by what the request presented. */
static bool authorized(struct resolve *rs, const sp_sandbox_rec_t *sb)
{
    switch (rs->cred) {
    case CRED_ENVD:
        return true; /* the lookup matched the token's hash */
    case CRED_TRAFFIC:
        /* The envd token is the stronger one: it opens ports too (E2B's SDKs put it only in
         * X-Access-Token, but clients of before the traffic token was issued may). */
        return sp_tokens_equal(rs->traffic, sb->traffic_token) ||
               sp_tokens_equal(rs->traffic, sb->access_token);
    case CRED_SIGNED: {
        h2o_req_t *req = sp_http_hold_req(rs->hold);
        sp_err_t e;
        return req != NULL && sp_e2b__files_signed(req, sb->access_token, &e) == 0;
    }
    case CRED_NONE:
        return sp_e2b__public_traffic(sb);
    }
    return false;
}

/* An authorized request's sandbox: woken or waited for first when it must be, then its
 * agent. */
static void reach(struct resolve *rs)
{
    sp_err_t e;
    if (rs->wake) {
        if (sp_svc_wake_if_autoresume(rs->gw->svc, &rs->t.auth, rs->t.sandbox_id,
                                      SP_SVC_MAX_WAIT_MS, on_woken, rs, &e) < 0)
            on_woken(rs, &e);
        return;
    }
    if (sp_svc_sandbox_agent(rs->gw->svc, &rs->t.auth, rs->t.sandbox_id, on_agent, rs, &e) < 0)
        on_agent(rs, NULL, &e);
}

/* A resolve for req in a hold of its own (req kept while it waits); NULL, req answered, when
 * memory is short. */
static struct resolve *resolve_new(sp_e2b_t *gw, h2o_req_t *req)
{
    sp_http_hold_t *h = sp_http_hold(req, sizeof(struct resolve));
    if (h == NULL) {
        sp_e2b__error(req, 500, "out of memory");
        return NULL;
    }
    struct resolve *rs = sp_http_hold_user(h);
    rs->gw = gw;
    rs->hold = h;
    return rs;
}

/* arg: the resolve as it was when the body's collection began, in req's pool. */
static void on_traffic_body(void *arg, h2o_req_t *req, const sp_err_t *err)
{
    const struct resolve *saved = arg;
    if (err != NULL) {
        sp_e2b__error(req, sp_err_http_status(err->code), err->msg);
        return;
    }
    struct resolve *rs = resolve_new(saved->gw, req);
    if (rs == NULL)
        return;
    sp_http_hold_t *h = rs->hold;
    *rs = *saved;
    rs->hold = h;
    reach(rs);
}

static void on_sandbox(void *arg, const sp_sandbox_rec_t *sb, const sp_op_rec_t *op,
                       const sp_err_t *err)
{
    struct resolve *rs = arg;
    (void)op;
    if (err != NULL) {
        /* SP_EAUTH: a token that cannot be one (empty, too long), whatever the id. */
        if (err->code == SP_ENOTFOUND || err->code == SP_EAUTH)
            resolve_unknown(rs);
        else
            resolve_fail(rs, sp_err_http_status(err->code), err->msg);
        return;
    }
    bool gone = strcmp(sb->observed, "deleted") == 0 || strcmp(sb->desired, "deleted") == 0;
    /* Checked on every record, also a deleted one: without a credential that opens it, a
     * deleted sandbox is an unknown one too. */
    if (!authorized(rs, sb)) {
        resolve_unknown(rs);
        return;
    }
    /* A sandbox that is gone (killed, expired) is "not running" to the SDK: 502, which makes
     * isRunning() false, rather than 401 for a token that was once valid. */
    if (gone) {
        resolve_fail(rs, 502, "sandbox is not running");
        return;
    }
    snprintf(rs->t.sandbox_id, sizeof(rs->t.sandbox_id), "%s", sb->id);
    snprintf(rs->t.auth.team_id, sizeof(rs->t.auth.team_id), "%s", sb->team_id);
    snprintf(rs->t.access_token, sizeof(rs->t.access_token), "%s", sb->access_token);
    rs->t.signed_url = rs->cred == CRED_SIGNED;
    /* E2B autoResume, only now that the request is authorized: traffic for a sandbox asleep
     * with auto_resume wakes it first; traffic for one that is starting or waking (a connect
     * just answered) waits for it. */
    bool asleep = strcmp(sb->desired, "suspended") == 0 || strcmp(sb->desired, "paused") == 0;
    bool coming = strcmp(sb->desired, "running") == 0 && strcmp(sb->observed, "running") != 0;
    rs->wake = (sb->auto_resume && asleep) || coming;
    uint64_t len;
    bool chunked;
    h2o_req_t *req = sp_http_hold_req(rs->hold);
    if (req != NULL && sp_bodygate_streamed(req, &len, &chunked)) {
        /* Authorized: now the body, left on the connection until here (an upload with a
         * wrong token or signature was answered before a byte of it was read). */
        struct resolve saved = *rs;
        req = sp_http_release(rs->hold); /* frees rs */
        if (req == NULL)
            return;
        struct resolve *c = h2o_mem_alloc_pool(&req->pool, sizeof(*c));
        *c = saved;
        c->hold = NULL;
        sp_bodygate_body_collect(req, on_traffic_body, c);
        return;
    }
    reach(rs);
}

static void sandbox_traffic(sp_e2b_t *gw, h2o_req_t *req, const char *id, int port)
{
    const char *token = sp_http_header(req, "x-access-token");
    const char *traffic = sp_http_header(req, "e2b-traffic-access-token");
    bool fwd = id != NULL && SP_E2B_FORWARDED_PORT(port);
    cred_t cred = CRED_ENVD;
    if (token == NULL) {
        if (port == SP_E2B_ENVD_PORT && path_is(req, "/files") &&
            sp_http_query(req, "signature") != NULL && id != NULL) {
            /* A signed URL's expiry is checked before any lookup: it says nothing of the
             * sandbox. */
            sp_err_t e;
            if (sp_e2b__files_sig_expired(req, &e)) {
                sp_e2b__error(req, 401, e.msg);
                return;
            }
            cred = CRED_SIGNED;
        } else if (port != SP_E2B_ENVD_PORT && traffic != NULL && id != NULL) {
            cred = CRED_TRAFFIC;
        } else if (fwd && traffic == NULL) {
            cred = CRED_NONE;
        } else {
            sp_e2b__error(req, 401,
                          port == SP_E2B_ENVD_PORT
                              ? "missing X-Access-Token"
                              : "missing X-Access-Token or E2B-Traffic-Access-Token");
            return;
        }
    }
    struct resolve *rs = resolve_new(gw, req);
    if (rs == NULL)
        return;
    rs->t.port = port;
    rs->cred = cred;
    snprintf(rs->asked, sizeof(rs->asked), "%s", id ? id : "");
    if (cred == CRED_TRAFFIC && strlen(traffic) == SP_TOKEN_LEN)
        snprintf(rs->traffic, sizeof(rs->traffic), "%s", traffic); /* else "": opens nothing */
    sp_err_t e;
    /* One statement in every case: by the token's hash (and the id when given), else by the
     * id alone and the credential checked on the record. */
    if (sp_svc_sandbox_by_token(gw->svc, id, cred == CRED_ENVD ? token : NULL, on_sandbox, rs,
                                &e) < 0)
        on_sandbox(rs, NULL, NULL, &e);
}

bool sp_e2b_checks_before_body(sp_e2b_t *gw, h2o_req_t *req)
{
    int port;
    char id[65];
    const char *segs[4];
    if (parse_sandbox_host(gw, req, &port, id))
        return true;
    if (sp_http_segments(req, segs, 4) == 3 && strcmp(segs[0], "upload") == 0 &&
        strcmp(segs[1], "template-files") == 0)
        return sp_http_query(req, "token") != NULL &&
               sp_http_header(req, "x-api-key") == NULL; /* sp_e2b__template_upload */
    return !sp_e2b__is_control_path(req) &&
           (sp_e2b__is_envd_path(req) || sp_e2b__is_code_path(req));
}

void sp_e2b_handle(sp_e2b_t *gw, h2o_req_t *req, bool forwarded)
{
    int port;
    char id[65];
    if (parse_sandbox_host(gw, req, &port, id)) {
        sandbox_traffic(gw, req, id, port);
        return;
    }
    if (sp_e2b__is_control_path(req)) {
        sp_e2b__control(gw, req, forwarded);
        return;
    }
    /* E2b-Sandbox-Id as given: one that cannot be an id is answered as an unknown one. */
    if (sp_e2b__is_envd_path(req)) {
        sandbox_traffic(gw, req, sp_http_header(req, "e2b-sandbox-id"), SP_E2B_ENVD_PORT);
        return;
    }
    if (sp_e2b__is_code_path(req)) {
        sandbox_traffic(gw, req, sp_http_header(req, "e2b-sandbox-id"), SP_E2B_CODE_PORT);
        return;
    }
    sp_e2b__error(req, 404, "no such path");
}
