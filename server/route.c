/*
 * route.c - which surface, which node: a request's way from the listener to the native API,
 * the E2B gateway, or another node (route.h).
 */
#include "server/route.h"

#include <string.h>
#include <strings.h>

#include "base/log.h"
#include "core/control/tmplfiles.h"
#include "e2b-gateway/gw.h"
#include "http/http.h"
#include "native-api/napi.h"

/*
 * An upload whose body the gate left on the connection (body_policy: every upload over
 * max_body on HTTP/1) and that is served here: its API key, when the head carries one
 * (native: Authorization: Bearer; E2B: X-API-Key), is checked before a byte of the body is
 * read (a wrong one is refused at once, as a missing one already was by the gate); then the
 * body is read whole, as h2o would have, and the request goes to its surface, which checks the
 * key again with the rest (a second lookup, for large uploads only). A sandbox's traffic
 * (E2B envd /files with a token or a signature, guest ports, which may be public) goes to the
 * E2B surface with its body unread: it authorizes the request, then reads the body
 * (sp_e2b_checks_before_body); so do E2B's template-file upload links (a token in the
 * query). One forwarded to another node never gets here.
 */
struct collecting {
    sp_route_t *s;
    sp_http_hold_t *hold; /* during the key's lookup */
    bool forwarded;
    bool e2b;
};

static void dispatch(sp_route_t *s, h2o_req_t *req, bool forwarded);

/* An error about a request's body, in its surface's shape (E2B: {code, message}). */
static void body_error(h2o_req_t *req, bool e2b, const sp_err_t *err)
{
    if (e2b)
        sp_http_json(req, sp_err_http_status(err->code),
                     json_pack("{s:i,s:s}", "code", sp_err_http_status(err->code), "message",
                               err->msg));
    else
        sp_http_error(req, err);
}

/* arg lives in req's pool: the gate calls back only while req does. */
static void on_collected(void *arg, h2o_req_t *req, const sp_err_t *err)
{
    struct collecting *c = arg;
    if (err != NULL)
        body_error(req, c->e2b, err);
    else
        dispatch(c->s, req, c->forwarded);
}

static void collect(h2o_req_t *req, const struct collecting *how)
{
    struct collecting *c = h2o_mem_alloc_pool(&req->pool, sizeof(*c));
    *c = *how;
    c->hold = NULL;
    sp_bodygate_body_collect(req, on_collected, c);
}

static void on_upload_key(void *arg, const sp_auth_t *auth, const sp_err_t *err)
{
    (void)auth;
    struct collecting c = *(struct collecting *)arg;
    h2o_req_t *req = sp_http_release(c.hold); /* frees arg */
    if (req == NULL) /* the client left during the lookup */
        return;
    if (err != NULL)
        body_error(req, c.e2b, err);
    else
        collect(req, &c);
}

/* forwarded: another node sent req (its cluster header verified). */
static void dispatch(sp_route_t *s, h2o_req_t *req, bool forwarded)
{
    uint64_t len;
    bool chunked;
    if (sp_bodygate_streamed(req, &len, &chunked)) {
        struct collecting how = {s, NULL, forwarded, s->e2b != NULL && sp_e2b_owns(s->e2b, req)};
        if (how.e2b && sp_e2b_checks_before_body(s->e2b, req)) {
            /* a sandbox's traffic, an upload link: their token or signature before the body */
            sp_e2b_handle(s->e2b, req, forwarded);
            return;
        }
        const char *key = NULL, *a = sp_http_header(req, "authorization");
        if (how.e2b)
            key = sp_http_header(req, "x-api-key");
        else if (a != NULL && strncasecmp(a, "Bearer ", 7) == 0)
            key = a + 7;
        if (key == NULL) {
            collect(req, &how);
            return;
        }
        if ((how.hold = sp_http_hold(req, sizeof(struct collecting))) == NULL) {
            sp_http_error_code(req, SP_EINTERNAL, "out of memory");
            return;
        }
        struct collecting *c = sp_http_hold_user(how.hold);
        *c = how;
        sp_err_t e;
        if (sp_svc_authenticate(s->svc, key, on_upload_key, c, &e) < 0)
            on_upload_key(c, NULL, &e);
        return;
    }
    if (s->e2b != NULL && sp_e2b_owns(s->e2b, req)) {
        sp_e2b_handle(s->e2b, req, forwarded);
        return;
    }
    if (sp_napi_owns(req)) {
        sp_napi_handle(s->napi, req);
        return;
    }
    sp_http_error_code(req, SP_ENOTFOUND, "no such path");
}

/*
 * Many hosts: a data-plane request (a sandbox's commands, files, sessions, code, envd, ports)
 * is served by the worker the sandbox is placed on. A sandbox whose VM runs here is served at
 * once, from memory (no database round trip: the one-node case); otherwise the database says
 * where it is (sp_svc_sandbox_where) and the request is forwarded there (http/proxy.h), or
 * served here when it is placed here or nowhere (the surface then answers as it always did:
 * not found, not running, waking). A request a node forwarded is never forwarded again.
 */
struct where_wait {
    sp_route_t *s;
    sp_http_hold_t *hold;
    bool forwarded;
    char id[65];
};

static void on_where(void *arg, const sp_where_t *w, const sp_err_t *err)
{
    struct where_wait ww = *(struct where_wait *)arg;
    h2o_req_t *req = sp_http_release(ww.hold); /* frees arg */
    if (req == NULL)
        return;
    sp_route_t *s = ww.s;
    char msg[512];
    if (err != NULL || !w->found || w->worker_id[0] == '\0' || strcmp(w->worker_id, s->wid) == 0) {
        dispatch(s, req, ww.forwarded);
    } else if (ww.forwarded) {
        snprintf(msg, sizeof(msg),
                 "sandbox %s is not on this worker (it is placed on worker %s): a forwarded "
                 "request is not forwarded again",
                 ww.id, w->worker_id);
        sp_proxy_error(req, 409, ww.id, msg);
    } else if (w->address[0] == '\0') {
        snprintf(msg, sizeof(msg), "sandbox %s is placed on worker %s, which has no address",
                 ww.id, w->worker_id);
        sp_proxy_error(req, 503, ww.id, msg);
    } else if (strcmp(w->worker_state, "lost") == 0) {
        snprintf(msg, sizeof(msg), "sandbox %s is placed on worker %s, which is lost", ww.id,
                 w->worker_id);
        sp_proxy_error(req, 503, ww.id, msg);
    } else {
        sp_proxy_forward(s->proxy, req, w->address, ww.id);
    }
}

/*
 * Template builds on a node that runs no VMs (--role api): a build, its status and log, the
 * files uploaded for it and an E2B reservation go to a worker, forwarded like the data plane:
 * each template's to the one sp_fleet_builder picks for its name (core/control/fleet.h), files
 * and reservations to any (they are in the shared snapshot dir and the database). Each surface
 * says which of its routes those are and what template they name (sp_napi_build_route,
 * sp_e2b_build_route). Reads of templates, tags and deletes are the database's: served here.
 */
struct builder_wait {
    sp_route_t *s;
    sp_http_hold_t *hold;
};

static void on_builder(void *arg, const char *id, const char *address, const sp_err_t *err)
{
    struct builder_wait bw = *(struct builder_wait *)arg;
    h2o_req_t *req = sp_http_release(bw.hold); /* frees arg */
    if (req == NULL)
        return;
    if (err != NULL) {
        sp_proxy_error(req, sp_err_http_status(err->code), "", err->msg);
        return;
    }
    sp_log(SP_LOG_DEBUG, "server", "template build request to worker=%s", id);
    sp_proxy_forward(bw.s->proxy, req, address, "");
}

static void to_builder(sp_route_t *s, h2o_req_t *req, const char *name)
{
    if (!sp_proxy_has_key(s->proxy)) {
        sp_proxy_error(req, 503, "",
                       "template builds run on workers, and this node has no cluster key "
                       "(--cluster-key-file) to forward them with");
        return;
    }
    sp_http_hold_t *h = sp_http_hold(req, sizeof(struct builder_wait));
    if (h == NULL) {
        sp_http_error_code(req, SP_EINTERNAL, "out of memory");
        return;
    }
    struct builder_wait *bw = sp_http_hold_user(h);
    bw->s = s;
    bw->hold = h;
    sp_err_t e;
    if (sp_fleet_builder(s->fleet, name, on_builder, bw, &e) < 0)
        on_builder(bw, NULL, NULL, &e);
}

int sp_route_request(sp_route_t *s, h2o_req_t *req)
{
    sp_bodygate_verdict_t v;
    if (sp_bodygate_request(s->gate, req, &v)) { /* refused on its head: the body never came */
        body_error(req, v.e2b, &v.err);
        return 0;
    }
    /* Only a node may say a request was forwarded: the header is checked and removed here,
     * before any surface sees the request. */
    sp_proxy_origin_t origin = sp_proxy_check(s->proxy, req);
    if (origin == SP_PROXY_FORGED) {
        sp_http_json(req, 401,
                     json_pack("{s:{s:s,s:s},s:s,s:i}", "error", "code", "unauthenticated",
                               "message", "the cluster header does not verify", "message",
                               "the cluster header does not verify", "code", 401));
        return 0;
    }
    char id[65];
    bool e2b = s->e2b != NULL && sp_e2b_owns(s->e2b, req);
    char tname[65];
    if (s->api && origin != SP_PROXY_FORWARDED && s->fleet != NULL &&
        (e2b ? sp_e2b_build_route(req, tname)
             : sp_napi_owns(req) && sp_napi_build_route(req, tname))) {
        to_builder(s, req, tname);
        return 0;
    }
    bool data_plane = e2b ? sp_e2b_data_plane(s->e2b, req, id)
                          : sp_napi_owns(req) && sp_napi_data_plane(req, id);
    if (!data_plane || sp_svc_sandbox_here(s->svc, id)) {
        dispatch(s, req, origin == SP_PROXY_FORWARDED);
        return 0;
    }
    sp_http_hold_t *h = sp_http_hold(req, sizeof(struct where_wait));
    if (h == NULL) {
        sp_http_error_code(req, SP_EINTERNAL, "out of memory");
        return 0;
    }
    struct where_wait *ww = sp_http_hold_user(h);
    ww->s = s;
    ww->hold = h;
    ww->forwarded = origin == SP_PROXY_FORWARDED;
    snprintf(ww->id, sizeof(ww->id), "%s", id);
    sp_err_t e;
    if (sp_svc_sandbox_where(s->svc, id, on_where, ww, &e) < 0)
        on_where(ww, NULL, &e);
    return 0;
}

/* The path of p[0, n) up to its query. */
static size_t path_part(const char *p, size_t n)
{
    const char *q = memchr(p, '?', n);
    return q != NULL ? (size_t)(q - p) : n;
}

static bool has_prefix(const char *p, size_t n, const char *pre)
{
    size_t k = strlen(pre);
    return n >= k && memcmp(p, pre, k) == 0;
}

/* /v1/sandboxes/{id}/files exactly: the native upload. */
static bool is_native_files(const char *p, size_t n)
{
    if (!has_prefix(p, n, "/v1/sandboxes/"))
        return false;
    const char *id = p + 14, *end = p + n;
    const char *sl = memchr(id, '/', (size_t)(end - id));
    return sl != NULL && sl > id && h2o_memis(sl, (size_t)(end - sl), H2O_STRLIT("/files"));
}

/*
 * The body gate's policy (http/bodygate.h), on a request's head: bodies up to max_body go on;
 * larger ones only to the upload routes (native files and template files, E2B's /files and
 * template files, and forwarded guest ports, whose apps take what they take), which count
 * as large (a bound on how many at once) and must carry their credential: a native key, or
 * E2B's API key or upload token (h2o's read path cannot wait for the lookup that says whether
 * it is right); envd's /files and guest ports may be public, so only the count holds them.
 * Every such upload streams (http/bodygate.h; HTTP/1 and HTTP/2): one on its way to another
 * node goes up as it comes (http/proxy.h), one served here has its key's value checked before
 * its body is read (dispatch).
 */
void sp_route_body_policy(void *arg, const sp_bodygate_head_t *h, sp_bodygate_verdict_t *v)
{
    sp_route_t *s = arg;
    size_t pn = path_part(h->path, h->path_len);
    /* Which surface would own it: for the shape of a refusal, and E2B's routes. */
    h2o_req_t fake;
    memset(&fake, 0, sizeof(fake));
    fake.authority = h2o_iovec_init(h->host, h->host_len);
    fake.path = h2o_iovec_init(h->path, h->path_len);
    fake.query_at = pn < h->path_len ? pn : SIZE_MAX;
    bool e2b = s->e2b != NULL && sp_e2b_owns(s->e2b, &fake);
    v->e2b = e2b;
    if (!h->chunked && h->length <= s->max_body)
        return;
    bool upload = false, needs_key = false, tfile = false;
    size_t n;
    const char *surface = NULL, *route = NULL;
    if (e2b) {
        sp_e2b_classify(s->e2b, &fake, &surface, &route);
        if (route != NULL && (strcmp(route, "files") == 0 || strcmp(route, "guest_port") == 0)) {
            upload = true;
        } else if (has_prefix(h->path, pn, "/upload/template-files/")) {
            upload = tfile = true;
            needs_key = sp_bodygate_header(h, "x-api-key", &n) == NULL &&
                        memmem(h->path + pn, h->path_len - pn, "token=", 6) == NULL;
        }
    } else if (h2o_memis(h->method, h->method_len, H2O_STRLIT("PUT")) &&
               (has_prefix(h->path, pn, "/v1/template-files/") || is_native_files(h->path, pn))) {
        upload = true;
        tfile = has_prefix(h->path, pn, "/v1/template-files/");
        const char *a = sp_bodygate_header(h, "authorization", &n);
        needs_key = a == NULL || n <= 7 || strncasecmp(a, "Bearer ", 7) != 0;
    }
    if (!upload) {
        if (h->chunked) { /* its size shows as it comes: stopped past the cap */
            v->chunked_cap = s->max_body;
            return;
        }
        v->refuse = true;
        sp_err_set(&v->err, SP_ETOOBIG, "request body is larger than %llu KiB",
                   (unsigned long long)(s->max_body >> 10));
        return;
    }
    if (needs_key) {
        v->refuse = true;
        sp_err_set(&v->err, SP_EAUTH, e2b ? "missing API key or upload token: a large body "
                                            "is read only with one"
                                          : "missing API key (Authorization: Bearer <key>): "
                                            "a large body is read only with one");
        return;
    }
    if (tfile && !h->chunked && h->length > SP_TMPLFILES_MAX) { /* said on its head: at once */
        v->refuse = true;
        sp_err_set(&v->err, SP_ETOOBIG, "a template file is at most %u MiB",
                   SP_TMPLFILES_MAX >> 20);
        return;
    }
    v->large = true;
    v->stream = true;
}

void sp_route_classify(void *arg, h2o_req_t *req, const char **surface, const char **route)
{
    sp_route_t *s = arg;
    if (s->e2b != NULL && sp_e2b_owns(s->e2b, req)) {
        sp_e2b_classify(s->e2b, req, surface, route);
    } else if (sp_napi_owns(req)) {
        *surface = "native";
        *route = sp_napi_route_class(req);
    }
}
