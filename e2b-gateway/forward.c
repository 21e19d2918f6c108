/*
 * forward.c - sandbox ports other than envd's, forwarded to the guest
 * (sp_e2b__forward in gw_int.h): what the SDK's get_host(port) reaches, e.g.
 * a web server the user runs in the sandbox.
 *
 * One agent TCP_CONNECT stream per request, to 127.0.0.1:<port> in the guest.
 * The request goes out as HTTP/1.1 with `Connection: close` (method, path,
 * headers minus hop-by-hop ones and our access tokens, the buffered body);
 * the guest's response head is parsed here and its body streamed to the
 * client through an h2o generator, de-chunked when the guest chunked it.
 * Flow control: agent credit is granted back only for bytes the client took
 * (generator proceed, or socket write completion), so a slow client slows the
 * guest server and we hold at most one window.
 *
 * An HTTP/1.1 `Upgrade` request (WebSocket) goes out with its Upgrade header;
 * when the guest answers 101 the client connection is taken over from h2o
 * (h2o_http1_upgrade) and becomes a byte pipe to the same agent stream, with
 * the same credit rules one way and read-stop/on_writable the other.
 *
 * Owns one `struct fwd` per request: the agent stream, the request bytes, the
 * response buffers and, once upgraded, the raw client socket. Every entry
 * (agent callbacks, generator callbacks, socket callbacks) holds `depth`; the
 * struct is freed when it is dead and the outermost entry unwinds.
 */
#include <ctype.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

#include "base/buf.h"
#include "base/chunked.h"
#include "base/log.h"
#include "base/text.h"
#include "e2b-gateway/gw_int.h"

#include <h2o/http1.h> /* h2o_http1_upgrade; needs h2o.h first */

#define HEAD_MAX   (64u * 1024u) /* bytes: the guest's response head */
#define MAX_FIELDS 128           /* response header lines */

enum phase {
    P_CONNECT = 0, /* waiting for TCP_CONNECTED */
    P_HEAD,        /* request sent (or sending), response head being read */
    P_BODY,        /* response started, body streaming */
    P_UPGRADING,   /* 101 being written by h2o */
    P_PIPE,        /* raw bytes both ways */
};

enum framing { F_NONE = 0, F_LENGTH, F_CHUNKED, F_EOF };

/* Chunked transfer-coding decoder (in place: output never overtakes input). */

struct fwd {
    h2o_generator_t gen; /* first: h2o hands it back */
    sp_e2b_t *gw;
    h2o_req_t *req;      /* NULL once the client is gone or the response is final */
    struct fwd **hook;   /* slot in req->pool that learns when the pool dies */
    sp_agentstream_t *s; /* NULL once ended or reset */
    enum phase phase;
    int port;
    char sandbox_id[65];
    bool upgrade;        /* the client asked for an HTTP/1.1 upgrade */
    bool no_body;        /* HEAD */

    /* request bytes: head[0..head_len) then the entity; out_off runs over both */
    char *rq;
    size_t rq_len;
    size_t out_off;

    /* the response head as it arrives */
    char *rh;
    size_t rh_len;

    enum framing framing;
    uint64_t remaining; /* F_LENGTH */
    sp_chunked_t ck;
    bool body_done;     /* all body bytes are in pend (or fly) */
    bool ok;            /* the body ended the way its framing said */

    /* toward the client: h2o wants each buffer kept until proceed (or write completion) */
    sp_buf_t pend, fly;
    size_t pend_raw, fly_raw; /* agent bytes each buffer accounts for (credit to grant) */
    bool flying;

    h2o_socket_t *sock;  /* P_PIPE: the client connection */
    bool guest_eof;      /* P_PIPE: the guest closed; close the client once written */

    int depth;
    bool dead;
};

static void f_leave(struct fwd *f);
static void flush_client(struct fwd *f);

/* ---- lifetime ---- */

static void f_enter(struct fwd *f)
{
    f->depth++;
}

/* Stops everything: no more callbacks reach f; it is freed when the outermost entry leaves. */
static void f_kill(struct fwd *f)
{
    if (f->s != NULL) {
        sp_agentstream_reset(f->s);
        f->s = NULL;
    }
    if (f->sock != NULL) {
        f->sock->data = NULL;
        h2o_socket_close(f->sock);
        f->sock = NULL;
    }
    f->dead = true;
}

static void f_leave(struct fwd *f)
{
    /* While h2o writes the 101, on_upgraded is still to come with f as its argument. */
    if (--f->depth > 0 || !f->dead || f->phase == P_UPGRADING)
        return;
    if (f->hook != NULL)
        *f->hook = NULL;
    free(f->rq);
    free(f->rh);
    sp_buf_free(&f->pend);
    sp_buf_free(&f->fly);
    free(f);
}

static void on_pool_gone(void *p)
{
    struct fwd *f = *(struct fwd **)p;
    if (f == NULL)
        return;
    f->hook = NULL;
    f->req = NULL;
    /* An upgrade disposes the request on purpose: the socket lives on. */
    if (f->phase == P_UPGRADING || f->phase == P_PIPE)
        return;
    f_enter(f);
    f_kill(f);
    f_leave(f);
}

/* Answers with an E2B error if nothing was sent yet, else cuts the response; then ends. */
static void f_fail(struct fwd *f, int status, const char *msg)
{
    h2o_req_t *req = f->req;
    if (req != NULL && f->phase <= P_HEAD) {
        f->req = NULL;
        sp_e2b__error(req, status, msg);
    } else if (req != NULL && f->phase == P_BODY && !f->flying) {
        f->req = NULL;
        h2o_send(req, NULL, 0, H2O_SEND_STATE_ERROR);
    } else if (req != NULL && f->phase == P_BODY) {
        f->ok = false;
        f->body_done = true; /* the error goes out on the next proceed */
        sp_buf_reset(&f->pend);
        if (f->s != NULL) {
            sp_agentstream_reset(f->s);
            f->s = NULL;
        }
        return;
    }
    f_kill(f);
}

/* Nothing listens on the port: E2B's edge answers 502 with the sandbox and the port (JSON, or a
 * page for a browser), which clients tell apart from a sandbox that is gone. */
static void f_port_closed(struct fwd *f)
{
    h2o_req_t *req = f->req;
    if (req == NULL || f->phase > P_HEAD) {
        f_fail(f, 502, "the sandbox's port is not open");
        return;
    }
    f->req = NULL;
    const char *accept = sp_http_header(req, "accept");
    if (accept != NULL && strstr(accept, "text/html") != NULL) {
        char *page = h2o_mem_alloc_pool(&req->pool, 1024);
        int n = snprintf(page, 1024,
                         "<!doctype html><html><head><meta charset=\"utf-8\"><title>Port not "
                         "open</title></head><body><h1>Port %d is not open</h1><p>Sandbox "
                         "<code>%s</code> is running, but nothing in it listens on port %d "
                         "yet.</p></body></html>\n",
                         f->port, f->sandbox_id, f->port);
        req->res.status = 502;
        req->res.reason = "Bad Gateway";
        h2o_add_header(&req->pool, &req->res.headers, H2O_TOKEN_CONTENT_TYPE, NULL,
                       H2O_STRLIT("text/html; charset=utf-8"));
        h2o_send_inline(req, page, (size_t)n);
    } else {
        sp_http_json(req, 502,
                     json_pack("{s:s,s:s,s:i,s:i}", "sandboxId", f->sandbox_id, "message",
                               "The sandbox is running but port is not open", "port", f->port,
                               "code", 502));
    }
    f_kill(f);
}

/* ---- request ---- */

static bool hop_by_hop(const h2o_iovec_t *name)
{
    static const char *const drop[] = {
        "connection", "keep-alive", "proxy-connection", "transfer-encoding", "te", "trailer",
        "upgrade", "host", "content-length", "http2-settings", "expect",
        /* our credentials never reach the guest's app */
        "x-access-token", "e2b-traffic-access-token"};
    for (size_t i = 0; i < sizeof(drop) / sizeof(drop[0]); i++)
        if (h2o_memis(name->base, name->len, drop[i], strlen(drop[i])))
            return true;
    return false;
}

/* Header values from h2o are already free of CR/LF (it parsed them); a value or path with
 * one would split our request, so refuse it anyway. */
static bool has_crlf(const char *p, size_t n)
{
    return memchr(p, '\r', n) != NULL || memchr(p, '\n', n) != NULL;
}

static int build_request(struct fwd *f, h2o_req_t *req)
{
    sp_buf_t b = SP_BUF_INIT;
    h2o_iovec_t path = req->input.path; /* as the client sent it, query included */
    if (has_crlf(req->method.base, req->method.len) || has_crlf(path.base, path.len) ||
        has_crlf(req->authority.base, req->authority.len))
        return -1;
    sp_buf_add(&b, req->method.base, req->method.len);
    sp_buf_str(&b, " ");
    if (path.len == 0 || path.base[0] != '/')
        sp_buf_str(&b, "/");
    sp_buf_add(&b, path.base, path.len);
    sp_buf_str(&b, " HTTP/1.1\r\nHost: ");
    sp_buf_add(&b, req->authority.base, req->authority.len);
    sp_buf_str(&b, "\r\n");
    for (size_t i = 0; i < req->headers.size; i++) {
        const h2o_header_t *h = &req->headers.entries[i];
        if (hop_by_hop(h->name) || has_crlf(h->value.base, h->value.len))
            continue;
        sp_buf_add(&b, h->orig_name ? h->orig_name : h->name->base, h->name->len);
        sp_buf_str(&b, ": ");
        sp_buf_add(&b, h->value.base, h->value.len);
        sp_buf_str(&b, "\r\n");
    }
    if (req->entity.base != NULL) {
        char cl[48];
        snprintf(cl, sizeof(cl), "Content-Length: %zu\r\n", req->entity.len);
        sp_buf_str(&b, cl);
    }
    sp_buf_str(&b, "X-Forwarded-Proto: ");
    sp_buf_str(&b, req->scheme == &H2O_URL_SCHEME_HTTPS ? "https" : "http");
    sp_buf_str(&b, "\r\n");
    if (f->upgrade) {
        sp_buf_str(&b, "Connection: Upgrade\r\nUpgrade: ");
        sp_buf_add(&b, req->upgrade.base, req->upgrade.len);
        sp_buf_str(&b, "\r\n\r\n");
    } else {
        sp_buf_str(&b, "Connection: close\r\n\r\n");
    }
    if (b.oom) {
        sp_buf_free(&b);
        return -1;
    }
    f->rq = (char *)b.p;
    f->rq_len = b.len;
    return 0;
}

/* How much of n to send now: what the credit allows, at most one frame. With no credit at all
 * the send is still tried (and refused): only a refused send brings on_writable. */
static size_t send_size(sp_agentstream_t *s, size_t n)
{
    size_t credit = sp_agentstream_credit(s);
    if (n > credit && credit > 0)
        n = credit;
    return n > SP_AP_MAX_DATA ? SP_AP_MAX_DATA : n;
}

/* Sends request bytes while the agent has credit; the rest waits for on_writable. */
static void pump_request(struct fwd *f)
{
    if (f->s == NULL || f->phase == P_CONNECT || f->req == NULL)
        return;
    size_t ent = f->req->entity.base != NULL ? f->req->entity.len : 0;
    size_t total = f->rq_len + ent;
    while (f->out_off < total) {
        const char *p;
        size_t n;
        if (f->out_off < f->rq_len) {
            p = f->rq + f->out_off;
            n = f->rq_len - f->out_off;
        } else {
            p = f->req->entity.base + (f->out_off - f->rq_len);
            n = total - f->out_off;
        }
        n = send_size(f->s, n);
        int r = sp_agentstream_send(f->s, SP_AP_T_DATA, (const uint8_t *)p, n);
        if (r == 0)
            return;
        if (r < 0) {
            f_fail(f, 502, "the sandbox connection failed");
            return;
        }
        f->out_off += n;
    }
}

/* ---- response head ---- */

static const char *find_head_end(const char *p, size_t n, size_t *head_len)
{
    for (size_t i = 0; i + 1 < n; i++) {
        if (p[i] != '\n')
            continue;
        if (p[i + 1] == '\n') {
            *head_len = i + 2;
            return p;
        }
        if (p[i + 1] == '\r' && i + 2 < n && p[i + 2] == '\n') {
            *head_len = i + 3;
            return p;
        }
    }
    return NULL;
}

struct field {
    const char *name, *value;
    size_t name_len, value_len;
};

/* Parses "HTTP/1.x SSS reason" and header lines from p[0..n) (n includes the blank line).
 * -1 on anything malformed. */
static int parse_head(const char *p, size_t n, int *status, struct field *fields, size_t *nf)
{
    const char *end = p + n, *line = p;
    size_t count = 0;
    bool first = true;
    while (line < end) {
        const char *lf = memchr(line, '\n', (size_t)(end - line));
        if (lf == NULL)
            return -1;
        const char *le = lf;
        if (le > line && le[-1] == '\r')
            le--;
        size_t ll = (size_t)(le - line);
        if (first) {
            if (ll < 12 || memcmp(line, "HTTP/1.", 7) != 0 || !isdigit((unsigned char)line[7]) ||
                line[8] != ' ' || !isdigit((unsigned char)line[9]) ||
                !isdigit((unsigned char)line[10]) || !isdigit((unsigned char)line[11]) ||
                (ll > 12 && line[12] != ' '))
                return -1;
            *status = (line[9] - '0') * 100 + (line[10] - '0') * 10 + (line[11] - '0');
            if (*status < 100)
                return -1;
            first = false;
        } else if (ll == 0) {
            break; /* the blank line */
        } else {
            if (line[0] == ' ' || line[0] == '\t' || count == MAX_FIELDS)
                return -1; /* obsolete line folding, or too many fields */
            const char *colon = memchr(line, ':', ll);
            if (colon == NULL || colon == line)
                return -1;
            for (const char *c = line; c < colon; c++)
                if (*c <= ' ' || *c >= 0x7f || strchr("\"(),/;<=>?@[\\]{}", *c) != NULL)
                    return -1;
            const char *v = colon + 1, *ve = le;
            while (v < ve && (*v == ' ' || *v == '\t'))
                v++;
            while (ve > v && (ve[-1] == ' ' || ve[-1] == '\t'))
                ve--;
            /* A bare CR or a NUL would reach the client as is: no response splitting. */
            if (memchr(v, '\r', (size_t)(ve - v)) != NULL || memchr(v, 0, (size_t)(ve - v)))
                return -1;
            fields[count].name = line;
            fields[count].name_len = (size_t)(colon - line);
            fields[count].value = v;
            fields[count].value_len = (size_t)(ve - v);
            count++;
        }
        line = lf + 1;
    }
    *nf = count;
    return first ? -1 : 0;
}

static bool name_is(const struct field *fl, const char *s)
{
    return fl->name_len == strlen(s) && strncasecmp(fl->name, s, fl->name_len) == 0;
}

static bool value_has_token(const struct field *fl, const char *tok)
{
    return h2o_contains_token(fl->value, fl->value_len, tok, strlen(tok), ',');
}

/* Copies the guest's response headers onto req->res, minus hop-by-hop ones and those h2o
 * writes itself. */
static void copy_headers(h2o_req_t *req, const struct field *fields, size_t nf, bool upgrade)
{
    static const char *const skip[] = {"connection", "keep-alive", "proxy-connection",
                                       "transfer-encoding", "te", "trailer", "content-length",
                                       "date", "server"};
    for (size_t i = 0; i < nf; i++) {
        bool drop = false;
        for (size_t k = 0; k < sizeof(skip) / sizeof(skip[0]) && !drop; k++)
            drop = name_is(&fields[i], skip[k]);
        /* h2o writes "connection: upgrade" on a 101 but not the Upgrade header itself. */
        if (name_is(&fields[i], "upgrade"))
            drop = !upgrade;
        if (drop)
            continue;
        h2o_iovec_t name = h2o_strdup(&req->pool, fields[i].name, fields[i].name_len);
        h2o_strtolower(name.base, name.len);
        h2o_iovec_t value = h2o_strdup(&req->pool, fields[i].value, fields[i].value_len);
        h2o_add_header_by_str(&req->pool, &req->res.headers, name.base, name.len, 1, NULL,
                              value.base, value.len);
    }
}

/* ---- chunked decoding ---- */

/* Decodes buf[0..*n) in place; *n becomes the data byte count, *done true once the last chunk
 * and trailers were read (bytes after them are dropped). -1 on a malformed coding. */
static int chunked_decode(sp_chunked_t *ck, char *buf, size_t *n, bool *done)
{
    size_t in = 0, out = 0;
    while (in < *n) {
        size_t used, dlen;
        const uint8_t *data;
        int rc = sp_chunked_step(ck, (const uint8_t *)buf + in, *n - in, *n - in, &used, &data,
                                 &dlen);
        if (rc < 0)
            return -1;
        if (dlen > 0)
            memmove(buf + out, data, dlen); /* data lies at or after buf + out */
        out += dlen;
        in += used;
        if (rc == 1) {
            *done = true;
            break;
        }
        if (used == 0)
            break;
    }
    *n = out;
    return 0;
}

/* ---- toward the client (generator) ---- */

static void grant(struct fwd *f, size_t n)
{
    while (n > 0 && f->s != NULL) {
        uint32_t g = n > UINT32_MAX ? UINT32_MAX : (uint32_t)n;
        sp_agentstream_grant(f->s, g);
        n -= g;
    }
}

static void on_sock_written(h2o_socket_t *sock, const char *err);

/* Sends pend when nothing is in flight; the final (or error) send once the body is done. */
static void flush_client(struct fwd *f)
{
    if (f->flying || f->dead || f->phase == P_UPGRADING)
        return;
    if (f->phase == P_PIPE) {
        if (f->sock == NULL)
            return;
        if (f->pend.len == 0) {
            if (f->guest_eof)
                f_kill(f); /* everything the guest sent is written */
            return;
        }
    } else if (f->req == NULL || (f->pend.len == 0 && !f->body_done)) {
        return;
    }
    /* swap pend into fly */
    sp_buf_t t = f->fly; /* sent already: its memory is reused */
    f->fly = f->pend;
    f->fly_raw = f->pend_raw;
    size_t len = f->fly.len;
    f->pend = t;
    sp_buf_reset(&f->pend);
    f->pend_raw = 0;
    h2o_iovec_t buf = h2o_iovec_init(f->fly.p, len);
    if (f->phase == P_PIPE) {
        f->flying = true;
        h2o_socket_write(f->sock, &buf, 1, on_sock_written);
        return;
    }
    h2o_req_t *req = f->req;
    if (f->body_done) {
        /* f goes away now while h2o may still write: the last bytes live in the pool. */
        if (len > 0) {
            char *p = h2o_mem_alloc_pool(&req->pool, len);
            memcpy(p, f->fly.p, len);
            buf.base = p;
        }
        f->req = NULL;
        bool ok = f->ok;
        f_kill(f);
        h2o_send(req, &buf, len ? 1 : 0, ok ? H2O_SEND_STATE_FINAL : H2O_SEND_STATE_ERROR);
        return;
    }
    f->flying = true;
    h2o_send(req, &buf, 1, H2O_SEND_STATE_IN_PROGRESS);
}

static void on_proceed(h2o_generator_t *gen, h2o_req_t *req)
{
    struct fwd *f = (struct fwd *)gen;
    f_enter(f);
    f->flying = false;
    size_t raw = f->fly_raw;
    f->fly_raw = 0;
    grant(f, raw); /* the client took these: the guest may send as much again */
    flush_client(f);
    f_leave(f);
}

static void on_stop(h2o_generator_t *gen, h2o_req_t *req)
{
    struct fwd *f = (struct fwd *)gen;
    f_enter(f);
    f->req = NULL;
    f_kill(f);
    f_leave(f);
}

/* Body bytes from the guest (raw = agent bytes they came in, for credit). */
static void body_bytes(struct fwd *f, const uint8_t *p, size_t n)
{
    size_t raw = n;
    if (f->no_body || f->body_done) {
        grant(f, raw);
        return;
    }
    if (f->framing == F_LENGTH && n > f->remaining)
        n = (size_t)f->remaining; /* bytes past Content-Length are dropped */
    char *dst = sp_buf_reserve(&f->pend, n);
    if (dst == NULL) {
        f_fail(f, 502, "out of memory");
        return;
    }
    memcpy(dst, p, n);
    size_t dn = n;
    if (f->framing == F_CHUNKED) {
        bool end = false;
        if (chunked_decode(&f->ck, dst, &dn, &end) < 0) {
            sp_log(SP_LOG_INFO, "e2b", "guest sent a bad chunked body port=%d", f->port);
            f_fail(f, 502, "bad response from the sandbox");
            return;
        }
        if (end) {
            f->body_done = true;
            f->ok = true;
        }
    } else if (f->framing == F_LENGTH) {
        f->remaining -= n;
        if (f->remaining == 0) {
            f->body_done = true;
            f->ok = true;
        }
    }
    sp_buf_commit(&f->pend, dn);
    f->pend_raw += raw;
    flush_client(f);
}

/* ---- upgrade (WebSocket) ---- */

static void pump_client_input(struct fwd *f);

static void on_sock_read(h2o_socket_t *sock, const char *err)
{
    struct fwd *f = sock->data;
    if (f == NULL)
        return;
    f_enter(f);
    if (err != NULL)
        f_kill(f); /* the client closed: the guest's side closes with the stream */
    else
        pump_client_input(f);
    f_leave(f);
}

/* Client bytes to the guest while credit lasts; reading pauses when it runs out. */
static void pump_client_input(struct fwd *f)
{
    h2o_socket_t *sock = f->sock;
    if (sock == NULL || f->s == NULL)
        return;
    while (sock->input->size > 0) {
        size_t n = send_size(f->s, sock->input->size);
        int r = sp_agentstream_send(f->s, SP_AP_T_DATA, (const uint8_t *)sock->input->bytes, n);
        if (r < 0) {
            f_kill(f);
            return;
        }
        if (r == 0) {
            if (h2o_socket_is_reading(sock))
                h2o_socket_read_stop(sock); /* on_writable resumes */
            return;
        }
        h2o_buffer_consume(&sock->input, n);
    }
    if (!h2o_socket_is_reading(sock))
        h2o_socket_read_start(sock, on_sock_read);
}

static void on_sock_written(h2o_socket_t *sock, const char *err)
{
    struct fwd *f = sock->data;
    if (f == NULL)
        return;
    f_enter(f);
    f->flying = false;
    if (err != NULL) {
        f_kill(f);
    } else {
        grant(f, f->fly_raw);
        f->fly_raw = 0;
        flush_client(f);
    }
    f_leave(f);
}

static void on_upgraded(void *data, h2o_socket_t *sock, size_t reqsize)
{
    struct fwd *f = data;
    f_enter(f);
    f->flying = false; /* the 101 and the guest's first bytes are written */
    f->phase = P_PIPE;
    if (sock == NULL || f->dead) {
        if (sock != NULL)
            h2o_socket_close(sock);
        f_kill(f);
        f_leave(f);
        return;
    }
    h2o_buffer_consume(&sock->input, reqsize); /* the upgrade request itself */
    f->sock = sock;
    sock->data = f;
    grant(f, f->fly_raw); /* bytes that followed the guest's 101 went out with it */
    f->fly_raw = 0;
    pump_client_input(f);
    flush_client(f);
    f_leave(f);
}

/* ---- from the guest ---- */

static void start_response(struct fwd *f, const char *p, size_t n)
{
    size_t head_len = 0;
    /* The head may span frames: keep what came so far. */
    if (f->rh_len + n > HEAD_MAX + SP_AP_MAX_DATA) {
        f_fail(f, 502, "the sandbox's response head is too large");
        return;
    }
    char *rh = realloc(f->rh, f->rh_len + n + 1);
    if (rh == NULL) {
        f_fail(f, 502, "out of memory");
        return;
    }
    f->rh = rh;
    memcpy(f->rh + f->rh_len, p, n);
    f->rh_len += n;
    size_t raw = n;
    for (;;) {
        if (find_head_end(f->rh, f->rh_len, &head_len) == NULL) {
            if (f->rh_len > HEAD_MAX)
                f_fail(f, 502, "the sandbox's response head is too large");
            else
                grant(f, raw); /* buffered here, not by the client */
            return;
        }
        int status = 0;
        struct field fields[MAX_FIELDS];
        size_t nf = 0;
        if (parse_head(f->rh, head_len, &status, fields, &nf) < 0) {
            sp_log(SP_LOG_INFO, "e2b", "guest sent a bad response head port=%d", f->port);
            f_fail(f, 502, "bad response from the sandbox");
            return;
        }
        h2o_req_t *req = f->req;
        size_t rest = f->rh_len - head_len;
        if (status == 101 && f->upgrade) {
            req->res.status = 101;
            req->res.reason = "Switching Protocols";
            copy_headers(req, fields, nf, true);
            /* Bytes after the 101 go out right behind it, from the pool (h2o writes later). */
            h2o_iovec_t extra = h2o_strdup(&req->pool, f->rh + head_len, rest);
            f->fly_raw = raw;
            f->flying = true;
            f->phase = P_UPGRADING;
            h2o_http1_upgrade(req, &extra, rest ? 1 : 0, on_upgraded, f);
            return;
        }
        if (status < 200) { /* 100 Continue, 103 Early Hints...: skip to the real one */
            memmove(f->rh, f->rh + head_len, rest);
            f->rh_len = rest;
            continue;
        }
        req->res.status = status;
        req->res.reason = status < 400 ? "OK" : "Error";
        copy_headers(req, fields, nf, false);
        f->framing = F_EOF;
        bool has_length = false;
        for (size_t i = 0; i < nf; i++) {
            if (name_is(&fields[i], "transfer-encoding") && value_has_token(&fields[i], "chunked"))
                f->framing = F_CHUNKED;
            if (name_is(&fields[i], "content-length") && !has_length) {
                char num[32];
                size_t vl = fields[i].value_len;
                if (vl == 0 || vl >= sizeof(num)) {
                    f_fail(f, 502, "bad response from the sandbox");
                    return;
                }
                memcpy(num, fields[i].value, vl);
                num[vl] = '\0';
                char *e;
                unsigned long long v = strtoull(num, &e, 10);
                if (*e != '\0' || !isdigit((unsigned char)num[0])) {
                    f_fail(f, 502, "bad response from the sandbox");
                    return;
                }
                f->remaining = v;
                has_length = true;
            }
        }
        if (f->framing != F_CHUNKED && has_length)
            f->framing = F_LENGTH;
        if (f->no_body || status == 204 || status == 304 ||
            (f->framing == F_LENGTH && f->remaining == 0)) {
            f->framing = F_NONE;
            f->body_done = true;
            f->ok = true;
        }
        if (f->framing == F_LENGTH && !f->no_body)
            req->res.content_length = (size_t)f->remaining;
        f->phase = P_BODY;
        h2o_start_response(req, &f->gen);
        /* The head's bytes are ours to credit now; the rest is body. */
        size_t body_raw = rest;
        grant(f, raw > body_raw ? raw - body_raw : 0);
        char *body = f->rh + head_len;
        if (rest > 0) {
            body_bytes(f, (const uint8_t *)body, rest);
        } else {
            flush_client(f); /* an empty body ends here */
        }
        free(f->rh);
        f->rh = NULL;
        f->rh_len = 0;
        return;
    }
}

static void on_guest_eof(struct fwd *f)
{
    switch (f->phase) {
    case P_CONNECT:
    case P_HEAD:
        f_fail(f, 502, "the sandbox closed the connection without a response");
        break;
    case P_BODY:
        if (!f->body_done) {
            f->body_done = true;
            f->ok = f->framing == F_EOF;
        }
        if (f->s != NULL) { /* both directions are done: the agent closes the socket */
            sp_agentstream_reset(f->s);
            f->s = NULL;
        }
        flush_client(f);
        break;
    case P_UPGRADING:
    case P_PIPE:
        f->guest_eof = true;
        flush_client(f);
        break;
    }
}

static void on_frame(sp_agentstream_t *s, uint16_t type, uint16_t flags, const uint8_t *payload,
                     size_t len, void *arg)
{
    struct fwd *f = arg;
    f_enter(f);
    if (flags & SP_AP_F_END)
        f->s = NULL; /* the stream is freed when this callback returns */
    switch (type) {
    case SP_AP_T_TCP_CONNECTED:
        if (f->phase == P_CONNECT) {
            f->phase = P_HEAD;
            pump_request(f);
        }
        break;
    case SP_AP_T_DATA:
        if (f->phase == P_HEAD && f->req != NULL)
            start_response(f, (const char *)payload, len);
        else if (f->phase == P_BODY)
            body_bytes(f, payload, len);
        else if (f->phase == P_UPGRADING || f->phase == P_PIPE) {
            sp_buf_add(&f->pend, payload, len);
            if (f->pend.oom) {
                f_kill(f);
                break;
            }
            f->pend_raw += len;
            if (f->phase == P_PIPE)
                flush_client(f);
        } else if (f->s != NULL) {
            grant(f, len);
        }
        break;
    case SP_AP_T_EOF:
        on_guest_eof(f);
        break;
    case SP_AP_T_ERROR: {
        sp_ap_error_t e;
        sp_err_t err;
        char msg[104];
        if (sp_ap_dec_error(payload, len, &e, &err) == 0 && e.msg.p != NULL)
            snprintf(msg, sizeof(msg), "%.*s", (int)(e.msg.n > 100 ? 100 : e.msg.n), e.msg.p);
        else
            snprintf(msg, sizeof(msg), "error");
        if (f->phase == P_CONNECT) {
            sp_log(SP_LOG_DEBUG, "e2b", "guest port closed sandbox=%s port=%d err=%s",
                   f->sandbox_id, f->port, msg);
            f_port_closed(f);
        } else {
            sp_log(SP_LOG_INFO, "e2b", "guest connection failed port=%d err=%s", f->port, msg);
            if (f->phase >= P_UPGRADING && f->phase <= P_PIPE) {
                f->guest_eof = true;
                flush_client(f);
            } else {
                f_fail(f, 502, "the sandbox connection failed");
            }
        }
        break;
    }
    case SP_AP_T_OK:
        on_guest_eof(f); /* both directions closed */
        break;
    default:
        break;
    }
    f_leave(f);
}

static void on_stream_error(sp_agentstream_t *s, const sp_err_t *err, void *arg)
{
    struct fwd *f = arg;
    f_enter(f);
    f->s = NULL;
    if (f->phase == P_PIPE || f->phase == P_UPGRADING) {
        f->guest_eof = true;
        flush_client(f);
    } else {
        f_fail(f, 502, "the sandbox connection was lost");
    }
    f_leave(f);
}

static void on_stream_writable(sp_agentstream_t *s, void *arg)
{
    struct fwd *f = arg;
    f_enter(f);
    if (f->phase == P_PIPE)
        pump_client_input(f);
    else
        pump_request(f);
    f_leave(f);
}

void sp_e2b__forward(sp_e2b_t *gw, h2o_req_t *req, const sp_e2b_target_t *t)
{
    struct fwd *f = calloc(1, sizeof(*f));
    if (f == NULL) {
        sp_e2b__error(req, 500, "out of memory");
        return;
    }
    f->gen.proceed = on_proceed;
    f->gen.stop = on_stop;
    f->gw = gw;
    f->req = req;
    f->port = t->port;
    snprintf(f->sandbox_id, sizeof(f->sandbox_id), "%s", t->sandbox_id);
    f->no_body = sp_http_method_is(req, "HEAD");
    /* Upgrades exist only in HTTP/1.1 (HTTP/2 has none; h2c is h2o's own business). */
    f->upgrade = req->version < 0x200 && req->upgrade.base != NULL &&
                 !h2o_lcstris(req->upgrade.base, req->upgrade.len, H2O_STRLIT("h2c"));
    if (build_request(f, req) < 0) {
        free(f);
        sp_e2b__error(req, 400, "request cannot be forwarded");
        return;
    }
    f->hook = h2o_mem_alloc_shared(&req->pool, sizeof(*f->hook), on_pool_gone);
    *f->hook = f;
    uint8_t buf[32];
    sp_ap_writer_t w;
    sp_ap_writer_init(&w, buf, sizeof(buf));
    sp_ap_put_u32(&w, SP_AP_K_PORT, (uint32_t)t->port);
    static const sp_agentstream_cbs_t cbs = {on_frame, on_stream_error, on_stream_writable};
    sp_err_t e;
    f->s = sp_agentconn_open(t->conn, SP_AP_T_TCP_CONNECT, buf, w.len, &cbs, f, &e);
    if (f->s == NULL) {
        f_enter(f);
        f_fail(f, 502, e.msg);
        f_leave(f);
    }
}

bool sp_e2b__public_traffic(const sp_sandbox_rec_t *sb)
{
    json_t *v = sb->network ? json_object_get(sb->network, "allowPublicTraffic") : NULL;
    return !json_is_false(v);
}
