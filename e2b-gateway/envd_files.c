/*
 * envd_files.c - envd's /files: download and upload (multipart, octet-stream, gzip) and
 * signed file URLs.
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
#include "core/control/tokens.h"

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

bool sp_e2b__files_sig_expired(h2o_req_t *req, sp_err_t *err)
{
    const char *exp = sp_http_query(req, "signature_expiration");
    if (exp == NULL)
        return false;
    char *end;
    long long e = strtoll(exp, &end, 10);
    if (exp[0] == '\0' || *end != '\0') {
        sp_err_set(err, SP_EAUTH, "invalid signature expiration");
        return true;
    }
    if (e < (long long)time(NULL)) {
        sp_err_set(err, SP_EAUTH, "signature expired");
        return true;
    }
    return false;
}

int sp_e2b__files_signed(h2o_req_t *req, const char *token, sp_err_t *err)
{
    const char *sig = sp_http_query(req, "signature");
    if (sig == NULL)
        return sp_err_set(err, SP_EAUTH, "missing X-Access-Token or signature");
    if (sp_e2b__files_sig_expired(req, err))
        return -1;
    const char *path = sp_http_query(req, "path");
    const char *user = sp_http_query(req, "username");
    char want[64];
    signature_of(path ? path : "", sp_http_method_is(req, "POST") ? "write" : "read",
                 user ? user : "", token, sp_http_query(req, "signature_expiration"), want);
    /* An empty token (one this server cannot derive) opens nothing. */
    if (token[0] == '\0' || !sp_tokens_equal(sig, want))
        return sp_err_set(err, SP_EAUTH, "invalid signature");
    return 0;
}

/* 0 when the request may touch files: a matching token, or a valid unexpired signature. */
static int files_auth(h2o_req_t *req, envd_call_t *c, sp_err_t *err)
{
    const char *tok = sp_http_header(req, "x-access-token");
    if (tok != NULL && !c->signed_url) {
        if (!sp_tokens_equal(tok, c->access_token))
            return sp_err_set(err, SP_EAUTH, "invalid access token");
        return 0;
    }
    return sp_e2b__files_signed(req, c->access_token, err);
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
    sp_e2b__envd_http_fail_err(arg, err);
}

static const sp_download_sink_t dl_sink = {dl_begin, sp_stream_sink_write, sp_stream_sink_end,
                                           dl_fail};

static void files_get(envd_call_t *c, const char *path)
{
    /* envd answers an empty regular file with an empty body, without reading it. */
    sp_download_req_t r = {.path = path, .user = c->user, .empty_if_zero = true};
    sp_err_t e;
    if (sp_download_start(sp_e2b__envd_loop(c), c->conn, &r, &dl_sink, c, &e) < 0)
        sp_e2b__envd_http_fail_err(c, &e);
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
    sp_e2b__envd_http_fail(u->c, status, msg); /* frees u through data_free */
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
        sp_e2b__envd_http_fail_err(u->c, err);
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
        sp_e2b__envd_http_fail_err(u->c, &e);
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
        sp_e2b__envd_http_fail(c, 500, "out of memory");
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
            sp_e2b__envd_http_fail(c, 500, "out of memory");
            return;
        }
        sp_multipart_part_t part;
        int rc;
        size_t nparts = 0;
        if (sp_multipart_init(mp, ct, body, blen, &e) < 0) {
            free(mp);
            sp_e2b__envd_http_fail_err(c, &e);
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
            sp_e2b__envd_http_fail_err(c, &e);
            return;
        }
        sp_multipart_init(mp, ct, body, blen, &e);
        while ((rc = sp_multipart_next(mp, &part, &e)) == 1) {
            if (strcmp(part.name, "file") != 0)
                continue;
            const char *dest = nparts == 1 && qpath != NULL ? qpath : part.filename;
            if (u->c->signed_url && nparts != 1) { /* the signed path, and only it */
                sp_err_set(&e, SP_EAUTH, "a signed upload URL writes one file, at its path");
                rc = -1;
                break;
            }
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
            sp_e2b__envd_http_fail_err(c, &e);
            return;
        }
    } else if (ct == NULL || strncasecmp(ct, "application/octet-stream", 24) == 0) {
        if (qpath == NULL) {
            sp_e2b__envd_http_fail(c, 400, "path query parameter is required");
            return;
        }
        const char *ce = sp_http_header(req, "content-encoding");
        if (ce != NULL && strcasecmp(ce, "gzip") == 0) {
            u->gz = true;
            if ((u->zout = malloc(65536)) == NULL) {
                sp_e2b__envd_http_fail(c, 500, "out of memory");
                return;
            }
        } else if (ce != NULL && strcasecmp(ce, "identity") != 0) {
            sp_e2b__envd_http_fail(c, 400, "unsupported Content-Encoding (gzip or identity)");
            return;
        }
        if (up_add(u, qpath, 0, blen, &e) < 0) {
            sp_e2b__envd_http_fail_err(c, &e);
            return;
        }
    } else {
        sp_e2b__envd_http_fail(c, 400, "Content-Type must be multipart/form-data or application/octet-stream");
        return;
    }
    up_next(u);
}

/* /files: GET downloads, POST uploads; signed URLs or the access token, the user from
 * username= or Basic auth. */
void sp_e2b__envd_files(envd_call_t *c, h2o_req_t *req)
{
    const char *path = sp_http_query(req, "path");
    const char *uname = sp_http_query(req, "username");
    bool write = sp_http_method_is(req, "POST");
    sp_err_t e;
    if (!write && !sp_http_method_is(req, "GET")) {
        sp_e2b__envd_http_fail(c, 405, "GET or POST");
        return;
    }
    if (files_auth(req, c, &e) < 0) {
        sp_e2b__envd_http_fail(c, 401, e.msg);
        return;
    }
    if (uname != NULL && uname[0] != '\0') {
        if (!sp_e2b__envd_user_ok(uname, strlen(uname))) {
            sp_e2b__envd_http_fail(c, 401, "invalid user name");
            return;
        }
        snprintf(c->user, sizeof(c->user), "%s", uname);
    } else if (c->signed_url) {
        /* The signature covers username= (empty when absent, spec 3.7): a signed URL is for
         * the user it names or the default one, never one a Basic header picks. */
        snprintf(c->user, sizeof(c->user), "%s", sp_e2b__envd_default_user());
    } else if (sp_e2b__envd_basic_user(req, c) < 0) {
        sp_e2b__envd_http_fail(c, 401, "invalid Authorization header");
        return;
    }
    /* A signed upload URL writes the one path it was signed for. */
    if (write && c->signed_url && (path == NULL || path[0] == '\0')) {
        sp_e2b__envd_http_fail(c, 401, "a signed upload URL must name its path");
        return;
    }
    if (write) {
        files_post(c, req, path);
    } else if (path == NULL || sp_exec_check_path(path, &e) < 0) {
        sp_e2b__envd_http_fail(c, 400, "path query parameter is required");
    } else {
        files_get(c, path);
    }
}
