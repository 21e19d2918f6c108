/*
 * qmp.c - asynchronous QMP client (see qmp.h).
 *
 * Owns the socket, the read buffer and the queue of commands. Every byte is
 * moved from the watch callback, never inside sp_qmp_command, so no callback
 * runs before the call that caused it returns. QEMU writes one JSON object
 * per line ("\r\n"); a line that does not parse, or one longer than
 * SP_QMP_LINE_MAX, closes the connection: nothing QEMU sends can grow memory
 * without bound or reach abort().
 */
#include "core/runtime/qmp.h"

#include <errno.h>
#include <fcntl.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include "base/buf.h"
#include "base/log.h"

#define SP_QMP_LINE_MAX (4u << 20) /* bytes: query-* replies are far smaller */

struct cmd {
    uint64_t id;
    char *buf; /* serialized command + "\n" */
    size_t len, off;
    int fd;        /* to pass with the first byte; -1 none; closed once sent */
    bool internal; /* qmp_capabilities */
    sp_qmp_reply_cb cb;
    void *arg;
    struct cmd *next;
};

struct sp_qmp {
    sp_loop_t *loop;
    int fd;
    sp_watch_t *w;
    sp_qmp_cbs_t cbs;
    void *arg;
    sp_buf_t rb; /* received, not yet parsed into messages; < SP_QMP_LINE_MAX */
    struct cmd *head, *tail; /* in send order; sent ones wait for their reply */
    uint64_t next_id;
    bool greeted, ready, closed, dead;
    int busy; /* depth of callbacks running: free is deferred until 0 */
};

static void cmd_free(struct cmd *c)
{
    if (c->fd >= 0)
        close(c->fd);
    free(c->buf);
    free(c);
}

static void update_interest(sp_qmp_t *q)
{
    if (q->w == NULL)
        return;
    int ev = SP_IO_READ;
    for (struct cmd *c = q->head; c != NULL; c = c->next) {
        if (c->off < c->len && (q->ready || c->internal)) {
            ev |= SP_IO_WRITE;
            break;
        }
    }
    sp_watch_set(q->w, ev);
}

static void really_free(sp_qmp_t *q)
{
    struct cmd *c = q->head;
    while (c != NULL) {
        struct cmd *n = c->next;
        cmd_free(c);
        c = n;
    }
    sp_watch_destroy(q->w);
    if (q->fd >= 0)
        close(q->fd);
    sp_buf_free(&q->rb);
    free(q);
}

void sp_qmp_destroy(sp_qmp_t *q)
{
    if (q == NULL || q->dead)
        return;
    q->dead = true;
    if (q->busy == 0)
        really_free(q);
}

bool sp_qmp_ready(const sp_qmp_t *q)
{
    return q->ready && !q->closed;
}

bool sp_qmp_closed(const sp_qmp_t *q)
{
    return q->closed;
}

/* Fails every command and reports the close; the caller holds q->busy. */
static void close_conn(sp_qmp_t *q, const char *why)
{
    if (q->closed)
        return;
    q->closed = true;
    q->ready = false;
    sp_watch_destroy(q->w);
    q->w = NULL;
    close(q->fd);
    q->fd = -1;
    sp_err_t e;
    sp_err_set(&e, SP_EUNAVAIL, "qmp connection closed: %s", why);
    while (q->head != NULL && !q->dead) {
        struct cmd *c = q->head;
        q->head = c->next;
        if (q->head == NULL)
            q->tail = NULL;
        if (c->cb != NULL)
            c->cb(c->arg, NULL, &e);
        cmd_free(c);
    }
    if (!q->dead && q->cbs.on_closed != NULL)
        q->cbs.on_closed(q, &e, q->arg);
}

static int enqueue(sp_qmp_t *q, const char *cmd, json_t *args, int fd, bool internal,
                   sp_qmp_reply_cb cb, void *arg, sp_err_t *err)
{
    struct cmd *c = calloc(1, sizeof(*c));
    json_t *o = json_object();
    if (c == NULL || o == NULL) {
        free(c);
        json_decref(o);
        json_decref(args);
        return sp_err_set(err, SP_EINTERNAL, "out of memory");
    }
    c->fd = -1;
    c->id = ++q->next_id;
    json_object_set_new(o, "execute", json_string(cmd));
    if (args != NULL)
        json_object_set_new(o, "arguments", args);
    json_object_set_new(o, "id", json_integer((json_int_t)c->id));
    char *s = json_dumps(o, JSON_COMPACT);
    json_decref(o);
    if (s == NULL) {
        free(c);
        return sp_err_set(err, SP_EINTERNAL, "out of memory");
    }
    size_t l = strlen(s);
    c->buf = malloc(l + 2); /* a copy, not realloc: gcc 12 misreads the failure path */
    if (c->buf == NULL) {
        free(s);
        free(c);
        return sp_err_set(err, SP_EINTERNAL, "out of memory");
    }
    memcpy(c->buf, s, l);
    free(s);
    memcpy(c->buf + l, "\n", 2);
    c->len = l + 1;
    if (fd >= 0) {
        c->fd = fcntl(fd, F_DUPFD_CLOEXEC, 0);
        if (c->fd < 0) {
            int e = errno;
            cmd_free(c);
            return sp_err_set(err, SP_EINTERNAL, "dup: %s", strerror(e));
        }
    }
    c->internal = internal;
    c->cb = cb;
    c->arg = arg;
    if (internal) { /* capabilities go before anything the user queued */
        c->next = q->head;
        q->head = c;
        if (q->tail == NULL)
            q->tail = c;
    } else {
        if (q->tail != NULL)
            q->tail->next = c;
        else
            q->head = c;
        q->tail = c;
    }
    update_interest(q);
    return 0;
}

int sp_qmp_command(sp_qmp_t *q, const char *cmd, json_t *args, int fd, sp_qmp_reply_cb cb,
                   void *arg, sp_err_t *err)
{
    if (q->closed || q->dead) {
        json_decref(args);
        return sp_err_set(err, SP_EUNAVAIL, "qmp connection closed");
    }
    return enqueue(q, cmd, args, fd, false, cb, arg, err);
}

static void on_caps(void *arg, json_t *ret, const sp_err_t *err)
{
    sp_qmp_t *q = arg;
    if (err != NULL) {
        if (err->code != SP_EUNAVAIL) /* a lost connection is reported by on_closed */
            sp_log(SP_LOG_WARN, "qmp", "capabilities failed err=%s", err->msg);
        return; /* close_conn follows if the link died; else QEMU refuses every command */
    }
    q->ready = true;
    update_interest(q);
    if (q->cbs.on_ready != NULL)
        q->cbs.on_ready(q, q->arg);
}

/* Sends what the socket takes. Returns -1 when the connection failed. */
static int flush(sp_qmp_t *q)
{
    while (q->head != NULL) {
        struct cmd *c = NULL;
        for (struct cmd *x = q->head; x != NULL; x = x->next) {
            if (x->off < x->len) {
                c = x;
                break;
            }
        }
        if (c == NULL || !(q->ready || c->internal))
            break;
        struct iovec iov = {.iov_base = c->buf + c->off, .iov_len = c->len - c->off};
        struct msghdr mh = {.msg_iov = &iov, .msg_iovlen = 1};
        char ctl[CMSG_SPACE(sizeof(int))];
        if (c->fd >= 0) {
            memset(ctl, 0, sizeof ctl);
            mh.msg_control = ctl;
            mh.msg_controllen = sizeof ctl;
            struct cmsghdr *cm = CMSG_FIRSTHDR(&mh);
            cm->cmsg_level = SOL_SOCKET;
            cm->cmsg_type = SCM_RIGHTS;
            cm->cmsg_len = CMSG_LEN(sizeof(int));
            memcpy(CMSG_DATA(cm), &c->fd, sizeof(int));
        }
        ssize_t n = sendmsg(q->fd, &mh, MSG_NOSIGNAL | MSG_DONTWAIT);
        if (n < 0) {
            if (errno == EAGAIN || errno == EWOULDBLOCK)
                break;
            if (errno == EINTR)
                continue;
            return -1;
        }
        if (c->fd >= 0) { /* the fd went with the first byte */
            close(c->fd);
            c->fd = -1;
        }
        c->off += (size_t)n;
    }
    update_interest(q);
    return 0;
}

static struct cmd *take_reply(sp_qmp_t *q, json_t *msg)
{
    json_t *id = json_object_get(msg, "id");
    struct cmd *prev = NULL;
    for (struct cmd *c = q->head; c != NULL; prev = c, c = c->next) {
        if (c->off < c->len)
            break; /* not fully sent: cannot be answered yet */
        if (id == NULL || (json_is_integer(id) && (uint64_t)json_integer_value(id) == c->id)) {
            if (prev != NULL)
                prev->next = c->next;
            else
                q->head = c->next;
            if (q->tail == c)
                q->tail = prev;
            return c;
        }
    }
    return NULL;
}

/* Handles one message. -1: protocol violation. */
static int handle(sp_qmp_t *q, json_t *msg)
{
    if (!json_is_object(msg))
        return -1;
    if (json_object_get(msg, "QMP") != NULL) {
        if (q->greeted)
            return -1;
        q->greeted = true;
        sp_err_t e;
        if (enqueue(q, "qmp_capabilities", NULL, -1, true, on_caps, q, &e) < 0)
            return -1;
        return 0;
    }
    json_t *ev = json_object_get(msg, "event");
    if (ev != NULL) {
        if (!json_is_string(ev))
            return -1;
        if (q->cbs.on_event != NULL)
            q->cbs.on_event(q, json_string_value(ev), json_object_get(msg, "data"), q->arg);
        return 0;
    }
    json_t *ret = json_object_get(msg, "return");
    json_t *er = json_object_get(msg, "error");
    if (ret == NULL && er == NULL)
        return 0; /* unknown message kind: ignore, QMP may grow */
    struct cmd *c = take_reply(q, msg);
    if (c == NULL) {
        sp_log(SP_LOG_WARN, "qmp", "reply matches no command");
        return 0;
    }
    if (c->cb != NULL) {
        if (ret != NULL) {
            c->cb(c->arg, ret, NULL);
        } else {
            sp_err_t e;
            const char *desc = json_string_value(json_object_get(er, "desc"));
            sp_err_set(&e, SP_ERUNTIME, "qemu: %s", desc != NULL ? desc : "error");
            c->cb(c->arg, NULL, &e);
        }
    }
    cmd_free(c);
    return 0;
}

/* Parses the complete lines in rb. -1: protocol violation. */
static int parse_lines(sp_qmp_t *q)
{
    const char *rbuf = (const char *)q->rb.p;
    size_t start = 0;
    for (;;) {
        const char *nl = memchr(rbuf + start, '\n', q->rb.len - start);
        if (nl == NULL)
            break;
        size_t end = (size_t)(nl - rbuf);
        size_t l = end - start;
        while (l > 0 && (rbuf[start + l - 1] == '\r' || rbuf[start + l - 1] == ' '))
            l--;
        if (l > 0) {
            json_error_t je;
            json_t *msg = json_loadb(rbuf + start, l, 0, &je);
            if (msg == NULL) {
                sp_log(SP_LOG_WARN, "qmp", "unparsable message err=%s", je.text);
                return -1;
            }
            int rc = handle(q, msg);
            json_decref(msg);
            if (rc < 0)
                return -1;
            if (q->dead || q->closed)
                return 0;
        }
        start = end + 1;
    }
    sp_buf_consume(&q->rb, start);
    return 0;
}

static void on_io(sp_watch_t *w, int events, void *arg)
{
    sp_qmp_t *q = arg;
    if (q->dead || q->closed)
        return;
    q->busy++;
    if (events & SP_IO_WRITE) {
        if (flush(q) < 0) {
            close_conn(q, strerror(errno));
            goto out;
        }
    }
    if (events & SP_IO_READ) {
        for (int round = 0; round < 16 && !q->dead && !q->closed; round++) {
            /* room for 4 KiB more, the buffer staying within SP_QMP_LINE_MAX (it doubles) */
            if (q->rb.len + 4096 >= SP_QMP_LINE_MAX) {
                close_conn(q, "message too long");
                goto out;
            }
            if (sp_buf_reserve(&q->rb, 4096) == NULL) {
                close_conn(q, "out of memory");
                goto out;
            }
            /* all the room there is, but the byte sp_buf_reserve keeps for a NUL */
            ssize_t n = recv(q->fd, q->rb.p + q->rb.len, q->rb.cap - q->rb.len - 1, MSG_DONTWAIT);
            if (n == 0) {
                close_conn(q, "eof");
                goto out;
            }
            if (n < 0) {
                if (errno == EINTR)
                    continue;
                if (errno != EAGAIN && errno != EWOULDBLOCK)
                    close_conn(q, strerror(errno));
                break;
            }
            sp_buf_commit(&q->rb, (size_t)n);
            if (parse_lines(q) < 0) {
                close_conn(q, "protocol error");
                goto out;
            }
        }
    }
    if (!q->dead && !q->closed && flush(q) < 0)
        close_conn(q, strerror(errno));
out:
    q->busy--;
    if (q->dead && q->busy == 0)
        really_free(q);
}

sp_qmp_t *sp_qmp_create(sp_loop_t *loop, int fd, const sp_qmp_cbs_t *cbs, void *arg, sp_err_t *err)
{
    sp_qmp_t *q = calloc(1, sizeof(*q));
    if (q == NULL) {
        close(fd);
        sp_err_set(err, SP_EINTERNAL, "out of memory");
        return NULL;
    }
    q->loop = loop;
    q->fd = fd;
    if (cbs != NULL)
        q->cbs = *cbs;
    q->arg = arg;
    int fl = fcntl(fd, F_GETFL);
    if (fl >= 0)
        fcntl(fd, F_SETFL, fl | O_NONBLOCK);
    q->w = sp_watch_create(loop, fd, on_io, q);
    if (q->w == NULL) {
        really_free(q);
        sp_err_set(err, SP_EINTERNAL, "cannot watch qmp socket");
        return NULL;
    }
    sp_watch_set(q->w, SP_IO_READ);
    return q;
}

sp_qmp_t *sp_qmp_connect(sp_loop_t *loop, const char *path, const sp_qmp_cbs_t *cbs, void *arg,
                         sp_err_t *err)
{
    struct sockaddr_un sa = {.sun_family = AF_UNIX};
    if (strlen(path) >= sizeof sa.sun_path) {
        sp_err_set(err, SP_EINTERNAL, "qmp socket path too long");
        return NULL;
    }
    strcpy(sa.sun_path, path);
    int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    if (fd < 0) {
        sp_err_set(err, SP_EINTERNAL, "socket: %s", strerror(errno));
        return NULL;
    }
    if (connect(fd, (struct sockaddr *)&sa, sizeof sa) < 0) {
        int e = errno;
        close(fd);
        sp_err_set(err, SP_EUNAVAIL, "qmp connect: %s", strerror(e));
        return NULL;
    }
    return sp_qmp_create(loop, fd, cbs, arg, err);
}
