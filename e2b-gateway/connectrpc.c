/*
 * connectrpc.c - the Connect protocol on h2o 2.2 (connectrpc.h): request headers and message,
 * unary replies, and streamed responses (on http/stream.h). The bytes are connect.c's.
 *
 * Owns nothing beyond a call except the stream objects (freed on end or when the client
 * leaves).
 */
#include "e2b-gateway/connectrpc.h"

#include <jansson.h>
#include <stdlib.h>
#include <string.h>

static const char *hdr(h2o_req_t *req, const char *name)
{
    ssize_t i = h2o_find_header_by_str(&req->headers, name, strlen(name), -1);
    if (i < 0)
        return NULL;
    h2o_iovec_t v = req->headers.entries[i].value;
    char *s = h2o_mem_alloc_pool(&req->pool, v.len + 1);
    memcpy(s, v.base, v.len);
    s[v.len] = '\0';
    return s;
}

int sp_connect_request(h2o_req_t *req, sp_connect_req_t *cr, sp_err_t *err)
{
    memset(cr, 0, sizeof(*cr));
    cr->keepalive_s = SP_CONNECT_KEEPALIVE_DEFAULT_S;
    if (sp_connect_content_type(hdr(req, "content-type"), cr) < 0)
        return sp_err_set(err, SP_EINVAL,
                          "content type must be application/json, application/proto, "
                          "application/connect+json or application/connect+proto");
    const char *enc = hdr(req, cr->streaming ? "connect-content-encoding" : "content-encoding");
    if (enc != NULL && strcasecmp(enc, "identity") != 0)
        return sp_err_set(err, SP_EINVAL, "compressed requests are not supported");
    const char *t = hdr(req, "connect-timeout-ms");
    if (t != NULL && sp_connect_parse_timeout(t, &cr->timeout_ms) < 0)
        return sp_err_set(err, SP_EINVAL, "connect-timeout-ms must be 1 to 10 digits");
    const char *k = hdr(req, "keepalive-ping-interval");
    if (k != NULL && sp_connect_parse_keepalive(k, &cr->keepalive_s) < 0)
        return sp_err_set(err, SP_EINVAL, "Keepalive-Ping-Interval must be whole seconds");
    return 0;
}

int sp_connect_read_msg(h2o_req_t *req, const sp_connect_req_t *cr, const sp_cdesc_t *d, void *msg,
                        sp_carena_t *a, sp_err_t *err)
{
    const uint8_t *body = (const uint8_t *)req->entity.base;
    size_t n = req->entity.base ? req->entity.len : 0;
    return sp_connect_decode_body(cr, d, body, n, msg, a, err);
}

/* ---- responses ---- */

static void send_body(h2o_req_t *req, int status, const char *ctype, const void *p, size_t n)
{
    req->res.status = status;
    req->res.reason = status == 200 ? "OK" : "Error";
    req->res.content_length = n;
    h2o_add_header(&req->pool, &req->res.headers, H2O_TOKEN_CONTENT_TYPE, NULL, ctype,
                   strlen(ctype));
    h2o_send_inline(req, p, n); /* copies */
}

void sp_connect_reply(h2o_req_t *req, const sp_connect_req_t *cr, const sp_cdesc_t *d,
                      const void *msg)
{
    sp_buf_t b = {0};
    if (sp_connect_encode(cr->codec, d, msg, &b) < 0) {
        sp_buf_free(&b);
        sp_connect_reply_error(req, SP_CC_INTERNAL, "out of memory");
        return;
    }
    /* An empty proto message is a valid empty body; JSON is at least {}. */
    send_body(req, 200, cr->codec == SP_CONNECT_PROTO ? "application/proto" : "application/json",
              b.p ? (const char *)b.p : "", b.len);
    sp_buf_free(&b);
}

void sp_connect_reply_error(h2o_req_t *req, sp_connect_code_t code, const char *msg)
{
    json_t *o =
        json_pack("{s:s,s:s}", "code", sp_connect_code_name(code), "message", msg ? msg : "");
    char *s = o ? json_dumps(o, JSON_COMPACT) : NULL;
    json_decref(o);
    const char *body = s ? s : "{\"code\":\"internal\",\"message\":\"out of memory\"}";
    send_body(req, sp_connect_code_http(code), "application/json", body, strlen(body));
    free(s);
}

const char *sp_connect_stream_ctype(sp_connect_codec_t codec)
{
    return codec == SP_CONNECT_PROTO ? "application/connect+proto" : "application/connect+json";
}

/* ---- streams ---- */

int sp_connect_stream_msg(sp_stream_t *st, sp_connect_codec_t codec, const sp_cdesc_t *d,
                          const void *msg, size_t raw)
{
    sp_buf_t pl = {0}, env = {0};
    int rc = sp_connect_encode(codec, d, msg, &pl);
    if (rc == 0) {
        sp_connect_envelope_add(&env, 0, pl.p, pl.len);
        rc = env.oom ? -1 : sp_stream_write(st, env.p, env.len, raw);
    }
    sp_buf_free(&pl);
    sp_buf_free(&env);
    return rc;
}

void sp_connect_stream_finish(sp_stream_t *st, sp_connect_code_t code, const char *msg)
{
    char *s = NULL;
    if (code != SP_CC_OK) {
        json_t *o = json_pack("{s:{s:s,s:s}}", "error", "code", sp_connect_code_name(code),
                              "message", msg ? msg : "");
        s = o ? json_dumps(o, JSON_COMPACT) : NULL;
        json_decref(o);
    }
    const char *body = code == SP_CC_OK ? "{}"
                       : s              ? s
                                        : "{\"error\":{\"code\":\"internal\",\"message\":\"\"}}";
    sp_buf_t env = {0};
    sp_connect_envelope_add(&env, SP_CONNECT_FLAG_END, body, strlen(body));
    free(s);
    sp_stream_end(st, env.p, env.len, !env.oom);
    sp_buf_free(&env);
}
