/*
 * opsrv.c - the operator listener: an h2o configuration and context of its own on the
 * process loop, fed by http/sniff.h with no TLS.
 */
#include "server/opsrv.h"

#include <arpa/inet.h>
#include <errno.h>
#include <h2o.h>
#include <netinet/in.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include "base/buf.h"
#include "base/metrics.h"
#include "http/sniff.h"

struct sp_opsrv {
    h2o_globalconf_t config;
    h2o_context_t ctx;
    h2o_accept_ctx_t accept_ctx;
    sp_sniff_t *sniff;
};

static void send_text(h2o_req_t *req, int status, const char *reason, const char *type,
                      const void *body, size_t len)
{
    req->res.status = status;
    req->res.reason = reason;
    h2o_add_header(&req->pool, &req->res.headers, H2O_TOKEN_CONTENT_TYPE, NULL, type, strlen(type));
    h2o_send_inline(req, body, len); /* copies body */
}

static int on_req(h2o_handler_t *self, h2o_req_t *req)
{
    size_t plen = req->query_at != SIZE_MAX ? req->query_at : req->path.len;
    if (!h2o_memis(req->path.base, plen, H2O_STRLIT("/metrics"))) {
        send_text(req, 404, "Not Found", "text/plain; charset=utf-8", H2O_STRLIT("not found\n"));
        return 0;
    }
    if (!h2o_memis(req->method.base, req->method.len, H2O_STRLIT("GET")) &&
        !h2o_memis(req->method.base, req->method.len, H2O_STRLIT("HEAD"))) {
        h2o_add_header(&req->pool, &req->res.headers, H2O_TOKEN_ALLOW, NULL, H2O_STRLIT("GET"));
        send_text(req, 405, "Method Not Allowed", "text/plain; charset=utf-8",
                  H2O_STRLIT("GET only\n"));
        return 0;
    }
    sp_buf_t b = SP_BUF_INIT;
    if (sp_metrics_render(&b) < 0) {
        sp_buf_free(&b);
        send_text(req, 500, "Internal Server Error", "text/plain; charset=utf-8",
                  H2O_STRLIT("out of memory\n"));
        return 0;
    }
    send_text(req, 200, "OK", "text/plain; version=0.0.4; charset=utf-8", b.p, b.len);
    sp_buf_free(&b);
    return 0;
}

/* A bound, listening socket for addr; -1 and err when it cannot be had. */
static int listen_addr(const char *addr, sp_err_t *err)
{
    char host[128];
    const char *colon = strrchr(addr, ':');
    if (colon == NULL || (size_t)(colon - addr) >= sizeof(host))
        return sp_err_set(err, SP_EINVAL, "--metrics-listen wants ADDR:PORT");
    memcpy(host, addr, (size_t)(colon - addr));
    host[colon - addr] = '\0';
    char *end;
    long port = strtol(colon + 1, &end, 10);
    if (colon[1] == '\0' || *end != '\0' || port <= 0 || port > 65535)
        return sp_err_set(err, SP_EINVAL, "bad port in %s", addr);
    struct sockaddr_storage ss;
    memset(&ss, 0, sizeof(ss));
    socklen_t sl;
    size_t hl = strlen(host);
    if (hl >= 2 && host[0] == '[' && host[hl - 1] == ']') {
        struct sockaddr_in6 *s6 = (struct sockaddr_in6 *)&ss;
        host[hl - 1] = '\0';
        s6->sin6_family = AF_INET6;
        s6->sin6_port = htons((uint16_t)port);
        if (inet_pton(AF_INET6, host + 1, &s6->sin6_addr) != 1)
            return sp_err_set(err, SP_EINVAL, "bad address in %s", addr);
        sl = sizeof(*s6);
    } else {
        struct sockaddr_in *s4 = (struct sockaddr_in *)&ss;
        s4->sin_family = AF_INET;
        s4->sin_port = htons((uint16_t)port);
        if (inet_pton(AF_INET, host, &s4->sin_addr) != 1)
            return sp_err_set(err, SP_EINVAL, "bad address in %s", addr);
        sl = sizeof(*s4);
    }
    int fd = socket(ss.ss_family, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0)
        return sp_err_set(err, SP_EINTERNAL, "socket: %s", strerror(errno));
    int one = 1;
    setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
    if (bind(fd, (struct sockaddr *)&ss, sl) < 0 || listen(fd, 64) < 0) {
        sp_err_set(err, SP_EINVAL, "cannot listen on %s: %s", addr, strerror(errno));
        close(fd);
        return -1;
    }
    return fd;
}

sp_opsrv_t *sp_opsrv_create(sp_loop_t *loop, const char *addr, sp_err_t *err)
{
    int fd = listen_addr(addr, err);
    if (fd < 0)
        return NULL;
    sp_opsrv_t *o = calloc(1, sizeof(*o));
    if (o == NULL) {
        close(fd);
        sp_err_set(err, SP_EINTERNAL, "out of memory");
        return NULL;
    }
    h2o_config_init(&o->config);
    h2o_hostconf_t *host =
        h2o_config_register_host(&o->config, h2o_iovec_init(H2O_STRLIT("default")), 65535);
    h2o_pathconf_t *path = h2o_config_register_path(host, "/", 0);
    h2o_handler_t *hd = h2o_create_handler(path, sizeof(*hd));
    hd->on_req = on_req;
    h2o_context_init(&o->ctx, sp_loop_native(loop), &o->config);
    o->accept_ctx.ctx = &o->ctx;
    o->accept_ctx.hosts = o->config.hosts;
    o->sniff = sp_sniff_create(loop, fd, &o->accept_ctx, NULL);
    if (o->sniff == NULL) {
        close(fd);
        sp_opsrv_destroy(o);
        sp_err_set(err, SP_EINTERNAL, "out of memory");
        return NULL;
    }
    return o;
}

void sp_opsrv_destroy(sp_opsrv_t *o)
{
    if (o == NULL)
        return;
    sp_sniff_destroy(o->sniff);
    h2o_context_dispose(&o->ctx);
    h2o_config_dispose(&o->config);
    free(o);
}
