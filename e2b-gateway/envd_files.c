/*
 * envd_files.c - envd's entry point (sp_e2b__envd) and its plain-HTTP part: /files
 * download and upload (multipart, octet-stream, gzip), signed file URLs, /health, /envs.
 *
 * Also owns what every envd call shares: the call context (a hold on the request), the
 * effective user (Basic auth, username=, or the default user), the Connect error mapping,
 * and the per-gateway handles on the core tables envd state lives in (made on first use).
 *
 * Streaming both ways without holding a file twice: a download (core/channel/download.h,
 * with this file's sink) passes the agent's DATA to the client and grants the agent credit
 * only once h2o took the bytes (proceed); an upload body is already in h2o's buffer and is
 * sliced into agent DATA frames only as the agent's credit allows (gzip bodies are inflated
 * 64 KiB at a time, on demand). A client that leaves stops the transfer.
 *
 * Paths are guest paths: `../../etc/passwd` resolves inside the guest, as the user, and
 * never touches the host (the agent runs in the VM).
 */
#include <openssl/crypto.h>
#include <openssl/sha.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <time.h>
#include <zlib.h>

#include "base/log.h"
#include "core/channel/download.h"
#include "e2b-gateway/envd_int.h"
#include "e2b-gateway/multipart.h"

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

static const char *default_user(void)
{
    const char *u = getenv("SPACE_E2B_DEFAULT_USER");
    return u != NULL && u[0] != '\0' && strlen(u) < 64 ? u : SP_ENVD_DEFAULT_USER;
}

static bool user_ok(const char *u, size_t n)
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
static int basic_user(h2o_req_t *req, envd_call_t *c)
{
    const char *a = sp_http_header(req, "authorization");
    if (a == NULL) {
        snprintf(c->user, sizeof(c->user), "%s", default_user());
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
        snprintf(c->user, sizeof(c->user), "%s", default_user());
        return 0;
    }
    if (!user_ok((const char *)dec, ul))
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

static void files_fail(envd_call_t *c, int status, const char *msg)
{
    h2o_req_t *req = sp_e2b__envd_req(c);
    if (req != NULL)
        sp_e2b__error(req, status, msg);
    sp_e2b__envd_call_free(c);
}

static void files_fail_err(envd_call_t *c, const sp_err_t *e)
{
    files_fail(c, http_status(e), e->msg);
}

/* ---- signed URLs (spec 3.7) ---- */

static void signature_of(const char *path, const char *op, const char *user, const char *token,
                         const char *exp, char out[64])
{
    size_t n = strlen(path) + strlen(op) + strlen(user) + strlen(token) + (exp ? strlen(exp) : 0);
    char *raw = malloc(n + 8);
    unsigned char md[SHA256_DIGEST_LENGTH];
    if (raw == NULL) {
        snprintf(out, 64, "-"); /* matches no signature */
        return;
    }
    int k = sprintf(raw, "%s:%s:%s:%s", path, op, user, token);
    if (exp != NULL)
        k += sprintf(raw + k, ":%s", exp);
    SHA256((const unsigned char *)raw, (size_t)k, md);
    free(raw);
    memcpy(out, "v1_", 3);
    size_t b = sp_connect_b64_encode(md, sizeof(md), out + 3);
    while (b > 0 && out[3 + b - 1] == '=')
        b--;
    out[3 + b] = '\0';
}

/* 0 when the request may touch files: a matching token, or a valid unexpired signature. */
static int files_auth(h2o_req_t *req, envd_call_t *c, bool write, const char *path, sp_err_t *err)
{
    const char *tok = sp_http_header(req, "x-access-token");
    if (tok != NULL) {
        size_t n = strlen(tok);
        if (n != strlen(c->access_token) || CRYPTO_memcmp(tok, c->access_token, n) != 0)
            return sp_err_set(err, SP_EAUTH, "invalid access token");
        return 0;
    }
    const char *sig = sp_http_query(req, "signature");
    if (sig == NULL)
        return sp_err_set(err, SP_EAUTH, "missing X-Access-Token or signature");
    const char *exp = sp_http_query(req, "signature_expiration");
    const char *user = sp_http_query(req, "username");
    char want[64];
    signature_of(path ? path : "", write ? "write" : "read", user ? user : "", c->access_token, exp,
                 want);
    size_t n = strlen(sig);
    if (n != strlen(want) || CRYPTO_memcmp(sig, want, n) != 0)
        return sp_err_set(err, SP_EAUTH, "invalid signature");
    if (exp != NULL) {
        char *end;
        long long e = strtoll(exp, &end, 10);
        if (exp[0] == '\0' || *end != '\0')
            return sp_err_set(err, SP_EAUTH, "invalid signature expiration");
        if (e < (long long)time(NULL))
            return sp_err_set(err, SP_EAUTH, "signature expired");
    }
    return 0;
}

/* ---- GET /files: the sink of core/channel/download.h ---- */

static const sp_stream_cbs_t dl_stream_cbs = {sp_download_sent, sp_download_gone};

static void *dl_begin(void *arg, long long length, sp_download_t *dl)
{
    h2o_req_t *req = sp_e2b__envd_take(arg);
    sp_stream_t *st = NULL;
    if (req != NULL)
        st = sp_stream_start(req, 200, "application/octet-stream", length, &dl_stream_cbs, dl);
    if (st == NULL && req != NULL)
        sp_e2b__error(req, 500, "out of memory");
    return st;
}

static void dl_fail(void *arg, const sp_err_t *err)
{
    files_fail_err(arg, err);
}

static const sp_download_sink_t dl_sink = {dl_begin, sp_stream_sink_write, sp_stream_sink_end,
                                           dl_fail};

static void files_get(envd_call_t *c, const char *path)
{
    /* envd answers an empty regular file with an empty body, without reading it. */
    sp_download_req_t r = {.path = path, .user = c->user, .empty_if_zero = true};
    sp_err_t e;
    if (sp_download_start(sp_e2b__envd_loop(c), c->conn, &r, &dl_sink, c, &e) < 0)
        files_fail_err(c, &e);
}

/* ---- POST /files ---- */

typedef struct {
    char *path;
    size_t off, len; /* the part's bytes in req->entity */
} upfile_t;

typedef struct {
    envd_call_t *c;
    sp_agentconn_t *conn; /* borrowed: each write opens from the previous one's callback */
    upfile_t *files;
    size_t nfiles, cur;
    sp_exec_t *op;
    size_t off; /* bytes of the current file fed (raw or compressed) */
    bool ended;
    bool gz;
    z_stream z;
    bool z_init, z_end;
    uint8_t *zout;
    size_t zlen, zoff;
    json_t *result;
} up_t;

static void up_free(void *p)
{
    up_t *u = p;
    if (u == NULL)
        return;
    sp_exec_cancel(u->op);
    for (size_t i = 0; i < u->nfiles; i++)
        free(u->files[i].path);
    free(u->files);
    if (u->z_init)
        inflateEnd(&u->z);
    free(u->zout);
    json_decref(u->result);
    free(u);
}

static void up_next(up_t *u);

static void up_abort(up_t *u, int status, const char *msg)
{
    sp_exec_cancel(u->op);
    u->op = NULL;
    files_fail(u->c, status, msg); /* frees u through data_free */
}

static void up_feed(up_t *u)
{
    h2o_req_t *req = sp_e2b__envd_req(u->c);
    if (req == NULL) { /* the client left: its body went with it */
        sp_e2b__envd_call_free(u->c);
        return;
    }
    upfile_t *f = &u->files[u->cur];
    const uint8_t *base = (const uint8_t *)req->entity.base + f->off;
    for (;;) {
        if (!u->gz) {
            if (u->off >= f->len)
                break;
            long k = sp_exec_write_data(u->op, base + u->off, f->len - u->off);
            if (k <= 0)
                return; /* 0: on_writable comes; -1: on_done comes */
            u->off += (size_t)k;
            continue;
        }
        if (u->zoff < u->zlen) {
            long k = sp_exec_write_data(u->op, u->zout + u->zoff, u->zlen - u->zoff);
            if (k <= 0)
                return;
            u->zoff += (size_t)k;
            continue;
        }
        if (u->z_end)
            break;
        if (!u->z_init) {
            memset(&u->z, 0, sizeof(u->z));
            if (inflateInit2(&u->z, 16 + MAX_WBITS) != Z_OK) {
                up_abort(u, 500, "cannot start gzip decoding");
                return;
            }
            u->z_init = true;
            u->z.next_in = (Bytef *)base;
            u->z.avail_in = (uInt)(f->len > 0x7fffffffu ? 0x7fffffffu : f->len);
            u->off = u->z.avail_in;
        }
        if (u->z.avail_in == 0 && u->off < f->len) { /* bodies past 2 GiB: refill */
            size_t left = f->len - u->off;
            u->z.next_in = (Bytef *)base + u->off;
            u->z.avail_in = (uInt)(left > 0x7fffffffu ? 0x7fffffffu : left);
            u->off += u->z.avail_in;
        }
        u->z.next_out = u->zout;
        u->z.avail_out = 65536;
        int rc = inflate(&u->z, Z_NO_FLUSH);
        u->zlen = 65536 - u->z.avail_out;
        u->zoff = 0;
        if (rc == Z_STREAM_END) {
            u->z_end = true;
        } else if (rc == Z_BUF_ERROR && u->zlen == 0 && u->z.avail_in == 0) {
            up_abort(u, 400, "truncated gzip body");
            return;
        } else if (rc != Z_OK && rc != Z_BUF_ERROR) {
            up_abort(u, 400, "invalid gzip body");
            return;
        }
    }
    if (!u->ended) {
        u->ended = true;
        sp_exec_write_end(u->op);
    }
}

static void up_writable(void *arg)
{
    up_feed(arg);
}

static const char *base_name(const char *p)
{
    const char *s = strrchr(p, '/');
    return s ? s + 1 : p;
}

static void up_done(void *arg, json_t *entry, const sp_err_t *err)
{
    up_t *u = arg;
    u->op = NULL;
    if (err != NULL) {
        files_fail_err(u->c, err);
        return;
    }
    const char *path = json_string_value(json_object_get(entry, "path"));
    if (path == NULL)
        path = u->files[u->cur].path;
    json_array_append_new(u->result, json_pack("{s:s,s:s,s:s}", "name", base_name(path), "type",
                                               "file", "path", path));
    u->cur++;
    up_next(u);
}

static const sp_exec_write_cbs_t up_cbs = {up_writable, up_done};

static void up_next(up_t *u)
{
    if (u->cur >= u->nfiles) {
        h2o_req_t *req = sp_e2b__envd_req(u->c);
        if (req != NULL)
            sp_http_json(req, 200, json_incref(u->result));
        sp_e2b__envd_call_free(u->c);
        return;
    }
    u->off = 0;
    u->ended = false;
    sp_err_t e;
    u->op = sp_exec_write(sp_e2b__envd_loop(u->c), u->conn, u->files[u->cur].path, u->c->user, 0,
                          true, &up_cbs, u, &e);
    if (u->op == NULL) {
        files_fail_err(u->c, &e);
        return;
    }
    up_feed(u);
}

static int up_add(up_t *u, const char *path, size_t off, size_t len, sp_err_t *err)
{
    if (sp_exec_check_path(path, err) < 0)
        return -1;
    for (size_t i = 0; i < u->nfiles; i++)
        if (strcmp(u->files[i].path, path) == 0)
            return sp_err_set(err, SP_EINVAL, "the same path is written twice in one request");
    upfile_t *nf = realloc(u->files, (u->nfiles + 1) * sizeof(*nf));
    if (nf == NULL)
        return sp_err_set(err, SP_EINTERNAL, "out of memory");
    u->files = nf;
    if ((nf[u->nfiles].path = strdup(path)) == NULL)
        return sp_err_set(err, SP_EINTERNAL, "out of memory");
    nf[u->nfiles].off = off;
    nf[u->nfiles].len = len;
    u->nfiles++;
    return 0;
}

#define MAX_UPLOAD_FILES 10000

static void files_post(envd_call_t *c, h2o_req_t *req, const char *qpath)
{
    sp_err_t e;
    up_t *u = calloc(1, sizeof(*u));
    if (u == NULL || (u->result = json_array()) == NULL) {
        free(u);
        files_fail(c, 500, "out of memory");
        return;
    }
    u->c = c;
    u->conn = c->conn;
    c->data = u;
    c->data_free = up_free;
    const char *ct = sp_http_header(req, "content-type");
    const uint8_t *body = (const uint8_t *)req->entity.base;
    size_t blen = req->entity.base ? req->entity.len : 0;
    if (ct != NULL && strncasecmp(ct, "multipart/form-data", 19) == 0) {
        sp_multipart_t *mp = malloc(sizeof(*mp));
        if (mp == NULL) {
            files_fail(c, 500, "out of memory");
            return;
        }
        sp_multipart_part_t part;
        int rc;
        size_t nparts = 0;
        if (sp_multipart_init(mp, ct, body, blen, &e) < 0) {
            free(mp);
            files_fail_err(c, &e);
            return;
        }
        /* First pass: count file parts (the ?path= rule needs exactly one). */
        while ((rc = sp_multipart_next(mp, &part, &e)) == 1)
            if (strcmp(part.name, "file") == 0)
                nparts++;
        if (rc < 0 || nparts == 0 || nparts > MAX_UPLOAD_FILES) {
            free(mp);
            if (rc >= 0)
                sp_err_set(&e, SP_EINVAL,
                           nparts ? "too many files in one request" : "no file part");
            files_fail_err(c, &e);
            return;
        }
        sp_multipart_init(mp, ct, body, blen, &e);
        while ((rc = sp_multipart_next(mp, &part, &e)) == 1) {
            if (strcmp(part.name, "file") != 0)
                continue;
            const char *dest = nparts == 1 && qpath != NULL ? qpath : part.filename;
            if (dest == NULL || dest[0] == '\0') {
                sp_err_set(&e, SP_EINVAL, "a file part needs a filename or ?path=");
                rc = -1;
                break;
            }
            if (up_add(u, dest, (size_t)(part.data - body), part.len, &e) < 0) {
                rc = -1;
                break;
            }
        }
        free(mp);
        if (rc < 0) {
            files_fail_err(c, &e);
            return;
        }
    } else if (ct == NULL || strncasecmp(ct, "application/octet-stream", 24) == 0) {
        if (qpath == NULL) {
            files_fail(c, 400, "path query parameter is required");
            return;
        }
        const char *ce = sp_http_header(req, "content-encoding");
        if (ce != NULL && strcasecmp(ce, "gzip") == 0) {
            u->gz = true;
            if ((u->zout = malloc(65536)) == NULL) {
                files_fail(c, 500, "out of memory");
                return;
            }
        } else if (ce != NULL && strcasecmp(ce, "identity") != 0) {
            files_fail(c, 400, "unsupported Content-Encoding (gzip or identity)");
            return;
        }
        if (up_add(u, qpath, 0, blen, &e) < 0) {
            files_fail_err(c, &e);
            return;
        }
    } else {
        files_fail(c, 400, "Content-Type must be multipart/form-data or application/octet-stream");
        return;
    }
    up_next(u);
}

/* ---- /envs ---- */

static void envs_done(void *arg, const sp_exec_result_t *res, const sp_err_t *err)
{
    envd_call_t *c = arg;
    if (err != NULL) {
        files_fail_err(c, err);
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
        files_fail_err(c, &e);
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
        const char *path = sp_http_query(req, "path");
        const char *uname = sp_http_query(req, "username");
        bool write = sp_http_method_is(req, "POST");
        sp_err_t e;
        if (!write && !sp_http_method_is(req, "GET")) {
            files_fail(c, 405, "GET or POST");
            return;
        }
        if (files_auth(req, c, write, path, &e) < 0) {
            files_fail(c, 401, e.msg);
            return;
        }
        if (uname != NULL && uname[0] != '\0') {
            if (!user_ok(uname, strlen(uname))) {
                files_fail(c, 401, "invalid user name");
                return;
            }
            snprintf(c->user, sizeof(c->user), "%s", uname);
        } else if (basic_user(req, c) < 0) {
            files_fail(c, 401, "invalid Authorization header");
            return;
        }
        if (write) {
            files_post(c, req, path);
        } else if (path == NULL || sp_exec_check_path(path, &e) < 0) {
            files_fail(c, 400, "path query parameter is required");
        } else {
            files_get(c, path);
        }
        return;
    }
    if (path_is(req, "/envs")) {
        if (!sp_http_method_is(req, "GET")) {
            files_fail(c, 405, "GET");
            return;
        }
        snprintf(c->user, sizeof(c->user), "%s", default_user());
        envs_get(c);
        return;
    }
    const char *pm = path_after(req, "/process.Process/");
    const char *fm = pm ? NULL : path_after(req, "/filesystem.Filesystem/");
    if (pm == NULL && fm == NULL) {
        files_fail(c, 404, "no such path");
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
    if (basic_user(req, c) < 0) {
        sp_e2b__envd_fail(c, SP_CC_UNAUTHENTICATED, "invalid Authorization header");
        return;
    }
    if (pm != NULL)
        sp_e2b__envd_process(c, pm);
    else
        sp_e2b__envd_fs(c, fm);
}
