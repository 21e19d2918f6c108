/*
 * agentconn.c - host end of one VM's agent channel (core/channel/agentconn.h).
 *
 * Owns the unix socket to QEMU's virtio-serial chardev, one frame buffer for
 * reading (SP_AP_MAX_FRAME bytes), the output queue and every open stream.
 * Never blocks the loop: connect, read and write are non-blocking, and what
 * the socket does not take waits in the output queue for writability.
 *
 * Memory a guest can make us hold is bounded: the reader never buffers more
 * than one frame; DATA sends are refused (like an exhausted window) while
 * the output queue is over OUTQ_SOFT, and a queue that reaches OUTQ_MAX
 * (the agent stopped reading while we kept sending control frames) counts as
 * a dead channel: it is closed and reconnected.
 *
 * Re-entrancy: every entry from the loop (watch, timers) holds c->depth.
 * sp_agentconn_destroy inside a callback only marks the connection; the
 * outermost entry finishes the teardown when it unwinds. A stream reset or
 * finished inside its own callback is freed when that callback returns.
 * Callbacks never run inside an API call, except on_error from
 * sp_agentconn_destroy called outside any callback (the header's contract).
 *
 * No liveness PING: a paused VM cannot answer, and this module does not know
 * about pauses, so a probe would tear down the streams of every paused
 * sandbox. EOF, socket errors, garbage and a full output queue are what
 * declare the channel dead.
 */
#include "core/channel/agentconn.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <sodium.h>

#include "base/buf.h"
#include "base/log.h"
#include "base/metrics.h"

#define BACKOFF_LO_MS 100u
#define BACKOFF_HI_MS 2000u
#define HELLO_WAIT_MS     5000u               /* an unanswered HELLO is said again after this */
#define HELLO_WAIT_MAX_MS (10u * 60u * 1000u) /* ... doubling each time, up to this */
#define OUTQ_KEEP     (256u * 1024u)       /* bytes; a larger queue's memory is freed once empty */
#define OUTQ_SOFT     (1024u * 1024u)      /* DATA refused at or above this many queued bytes */
#define OUTQ_LOW      (OUTQ_SOFT / 2)      /* on_writable once below this */
#define OUTQ_MAX      (8u * 1024u * 1024u) /* beyond this the channel is dead */
#define READ_BUDGET   16                   /* reads per readiness callback, for fairness */
#define NBUCKETS      256u                 /* stream table buckets (power of two) */

static sp_metric_t m_connects = SP_METRIC_COUNTER(
    "space_agent_channel_connects_total", "Agent channels that came up for the first time.", "");
static sp_metric_t m_reconnects = SP_METRIC_COUNTER(
    "space_agent_channel_reconnects_total",
    "Agent channels that came up again after they were lost.", "");
static sp_metric_t m_lost =
    SP_METRIC_COUNTER("space_agent_channel_losses_total", "Agent channels lost while up.", "");
#define MAX_STREAMS   65536u               /* open at once per channel */
#define CREDIT_CAP    (1ull << 40)         /* clamp on credit an agent can grant */

struct link {
    struct link *prev, *next;
};

struct sp_agentstream {
    sp_agentconn_t *c;
    uint32_t id;
    sp_agentstream_cbs_t cbs;
    void *arg;
    uint64_t send_credit;        /* DATA bytes the agent accepts */
    uint64_t recv_window;        /* DATA/STDOUT/STDERR bytes the agent may still send us */
    struct sp_agentstream *next; /* bucket chain; only while in the table */
    struct link wantw;           /* in c->wantw while a send was refused */
    bool linked;                 /* in the table */
    bool ended;                  /* END seen or channel lost: send nothing more */
    bool agent_opened;           /* the agent opened it (egress): the host ends it */
    bool dead;                   /* no more callbacks; free when in_cb drops to 0 */
    int in_cb;
};

struct sp_agentconn_listener {
    sp_agentconn_t *c;
    sp_agentconn_listen_cb cb;
    void *arg;
    bool dead; /* removed while the list was being walked: freed when the walk ends */
    struct sp_agentconn_listener *next;
};

/* The process-wide hook for named channels (sp_agentconn_set_hook). Loop thread only. */
static sp_agentconn_hook_cb named_hook;
static void *named_hook_arg;

struct waiter {
    sp_agentconn_t *c;
    sp_timer_t timer;
    void (*cb)(void *arg, const sp_err_t *err);
    void *arg;
    struct link link;
};

struct sp_agentconn {
    sp_loop_t *loop;
    char *path;
    sp_agentconn_state_cb on_state;
    void *arg;

    int fd; /* -1 when closed */
    sp_watch_t *watch;
    int watch_events;
    bool connecting; /* connect() in progress */
    bool up;         /* agent answered HELLO */
    uint64_t session; /* in our HELLO of this connection; the agent echoes it */
    bool failing;    /* output queue overflowed or a send failed: teardown queued */
    bool oq_blocked; /* a stream in wantw waits for the queue to drain below OUTQ_LOW */
    bool destroyed;  /* sp_agentconn_destroy was called */
    int depth;       /* loop entries and callbacks on the stack */
    unsigned backoff_ms;
    bool logged_down; /* connect failures are logged once per outage */
    bool was_ever_up; /* a later HELLO answered is a reconnection (metrics) */

    sp_timer_t retry; /* reconnect */
    sp_timer_t kick;  /* zero-delay: waiters, writable notifications, queued failure */
    sp_timer_t hello; /* our HELLO is unanswered: say it again */
    unsigned hello_first_ms, hello_wait_ms;

    uint8_t *rbuf;
    sp_ap_reader_t rd;

    sp_buf_t oq;    /* queued bytes are oq.p[oq_off, oq.len) */
    size_t oq_off;

    struct sp_agentstream *buckets[NBUCKETS];
    size_t nstreams;
    uint32_t next_id;
    struct link wantw;   /* streams waiting for on_writable */
    struct link waiters; /* sp_agentconn_when_up */

    char agent_version[64];
    uint32_t caps;
    char sandbox[65];

    sp_agentconn_accept_cb accept;
    void *accept_arg;
    struct sp_agentconn_listener *listeners;
    int listeners_walking; /* > 0 while notify_listeners runs */
};

static void conn_connect(sp_agentconn_t *c);
static void conn_fail(sp_agentconn_t *c, const char *why);
static void conn_finalize(sp_agentconn_t *c);

/* ---- intrusive lists ---- */

static void list_init(struct link *l)
{
    l->prev = l->next = l;
}

static bool list_empty(const struct link *l)
{
    return l->next == l;
}

static void list_push(struct link *head, struct link *n)
{
    n->prev = head->prev;
    n->next = head;
    head->prev->next = n;
    head->prev = n;
}

static void list_remove(struct link *n)
{
    n->prev->next = n->next;
    n->next->prev = n->prev;
    list_init(n);
}

/* Moves every node of from to the front of to. */
static void list_splice_front(struct link *to, struct link *from)
{
    if (list_empty(from))
        return;
    struct link *first = from->next, *last = from->prev;
    last->next = to->next;
    to->next->prev = last;
    to->next = first;
    first->prev = to;
    list_init(from);
}

#define CONTAINER(p, type, member) ((type *)(void *)((char *)(p)-offsetof(type, member)))

/* ---- re-entrancy ---- */

static void conn_enter(sp_agentconn_t *c)
{
    c->depth++;
}

/* Returns true when c was freed: the caller must not touch it again. */
static bool conn_leave(sp_agentconn_t *c)
{
    if (--c->depth == 0 && c->destroyed) {
        conn_finalize(c);
        return true;
    }
    return false;
}

/* ---- stream table ---- */

static struct sp_agentstream **bucket(sp_agentconn_t *c, uint32_t id)
{
    return &c->buckets[id & (NBUCKETS - 1)];
}

static sp_agentstream_t *stream_find(sp_agentconn_t *c, uint32_t id)
{
    for (sp_agentstream_t *s = *bucket(c, id); s != NULL; s = s->next)
        if (s->id == id)
            return s;
    return NULL;
}

static void stream_unlink(sp_agentstream_t *s)
{
    sp_agentconn_t *c = s->c;
    if (s->linked) {
        for (sp_agentstream_t **pp = bucket(c, s->id); *pp != NULL; pp = &(*pp)->next) {
            if (*pp == s) {
                *pp = s->next;
                break;
            }
        }
        s->next = NULL;
        s->linked = false;
        c->nstreams--;
    }
    list_remove(&s->wantw);
}

/* Frees a stream that is unlinked and dead, unless one of its callbacks is on the stack. */
static void stream_release(sp_agentstream_t *s)
{
    if (s->dead && s->in_cb == 0 && !s->linked)
        free(s);
}

/* Next id in [1, SP_AP_STREAM_AGENT_BASE) not in the table. The counter only wraps after
 * 2^31 opens, so an id that was just reset (frames may still be in flight) is not reused. */
static uint32_t stream_alloc_id(sp_agentconn_t *c)
{
    for (;;) {
        uint32_t id = c->next_id++;
        if (c->next_id >= SP_AP_STREAM_AGENT_BASE)
            c->next_id = 1;
        if (stream_find(c, id) == NULL)
            return id; /* terminates: at most MAX_STREAMS ids are taken */
    }
}

/* ---- output queue ---- */

static size_t oq_queued(const sp_agentconn_t *c)
{
    return c->oq.len - c->oq_off;
}

/* Room for n more bytes (sp_buf_commit them), or NULL when that would pass OUTQ_MAX or
 * memory is short (the channel then fails; its next connection starts with an empty queue). */
static uint8_t *oq_reserve(sp_agentconn_t *c, size_t n)
{
    size_t queued = oq_queued(c);
    if (n > OUTQ_MAX || queued > OUTQ_MAX - n)
        return NULL;
    if (c->oq.len + n >= c->oq.cap && c->oq_off > 0) { /* sent bytes make room first */
        sp_buf_consume(&c->oq, c->oq_off);
        c->oq_off = 0;
    }
    return sp_buf_reserve(&c->oq, n);
}

static void set_interest(sp_agentconn_t *c, int events)
{
    if (c->watch != NULL && events != c->watch_events) {
        c->watch_events = events;
        sp_watch_set(c->watch, events);
    }
}

/* Writes what the socket takes. -1 on a socket error (the caller decides when to fail). */
static int oq_flush(sp_agentconn_t *c)
{
    if (c->fd < 0 || c->connecting)
        return 0;
    while (oq_queued(c) > 0) {
        ssize_t n = send(c->fd, c->oq.p + c->oq_off, oq_queued(c), MSG_NOSIGNAL | MSG_DONTWAIT);
        if (n < 0) {
            if (errno == EINTR)
                continue;
            if (errno == EAGAIN || errno == EWOULDBLOCK)
                break;
            return -1;
        }
        c->oq_off += (size_t)n;
    }
    if (oq_queued(c) == 0) {
        c->oq_off = 0;
        sp_buf_reset(&c->oq);
        if (c->oq.cap > OUTQ_KEEP) /* give a burst's memory back */
            sp_buf_free(&c->oq);
    }
    set_interest(c, SP_IO_READ | (oq_queued(c) > 0 ? SP_IO_WRITE : 0));
    if (c->oq_blocked && oq_queued(c) < OUTQ_LOW)
        sp_timer_start(&c->kick, 0); /* on_writable must not run inside an API call */
    return 0;
}

/* Marks the channel dead from inside an API call; the teardown (with its callbacks) runs
 * on the next loop turn. */
static void conn_fail_soon(sp_agentconn_t *c, const char *why)
{
    if (c->failing)
        return;
    sp_log(SP_LOG_WARN, "agentconn", "channel failing path=%s err=%s", c->path, why);
    c->failing = true;
    sp_timer_start(&c->kick, 0);
}

/* Queues one frame and tries to write it. -1 when the channel is closed or failing, or the
 * queue is full (then the channel is failing). Never runs callbacks. */
static int send_frame(sp_agentconn_t *c, uint32_t stream, uint16_t type, uint16_t flags,
                      const uint8_t *payload, size_t len)
{
    if (c->fd < 0 || c->connecting || c->failing)
        return -1;
    uint8_t *p = oq_reserve(c, SP_AP_HDR_SIZE + len);
    if (p == NULL) {
        conn_fail_soon(c, "output queue full: agent not reading");
        return -1;
    }
    sp_ap_hdr_t h = {.len = (uint32_t)len, .stream = stream, .type = type, .flags = flags};
    sp_ap_hdr_encode(p, &h);
    if (len > 0)
        memcpy(p + SP_AP_HDR_SIZE, payload, len);
    sp_buf_commit(&c->oq, SP_AP_HDR_SIZE + len);
    if (oq_flush(c) < 0) {
        conn_fail_soon(c, strerror(errno));
        return -1;
    }
    return 0;
}

static int send_window(sp_agentconn_t *c, uint32_t stream, uint32_t n)
{
    uint8_t buf[16];
    sp_ap_writer_t w;
    sp_ap_writer_init(&w, buf, sizeof(buf));
    sp_ap_put_u32(&w, SP_AP_K_WINDOW, n);
    return send_frame(c, stream, SP_AP_T_WINDOW, 0, buf, w.len);
}

/* ---- callbacks into users ---- */

/* May free s (reset inside the callback): the caller must not touch s afterwards. */
static void notify_writable(sp_agentstream_t *s)
{
    list_remove(&s->wantw);
    if (s->cbs.on_writable == NULL)
        return;
    s->in_cb++;
    s->cbs.on_writable(s, s->arg);
    s->in_cb--;
    stream_release(s);
}

/* Gives on_writable to waiting streams with credit once the queue drained below OUTQ_LOW
 * (hysteresis: no callback storm around OUTQ_SOFT). Only from loop entries. */
static void drain_wantw(sp_agentconn_t *c)
{
    if (!c->oq_blocked || oq_queued(c) >= OUTQ_LOW)
        return;
    c->oq_blocked = false;
    struct link todo;
    list_init(&todo);
    list_splice_front(&todo, &c->wantw);
    while (!list_empty(&todo)) {
        if (c->destroyed || !c->up || c->failing || oq_queued(c) >= OUTQ_SOFT) {
            c->oq_blocked = true;
            break;
        }
        sp_agentstream_t *s = CONTAINER(todo.next, sp_agentstream_t, wantw);
        list_remove(&s->wantw);
        if (s->send_credit == 0) {
            list_push(&c->wantw, &s->wantw); /* its WINDOW will wake it */
            continue;
        }
        notify_writable(s);
    }
    list_splice_front(&c->wantw, &todo); /* todo lives on this stack: empty it */
}

/* Ends a stream without END: on_error, then free. */
static void stream_fail(sp_agentstream_t *s, sp_code_t code, const char *msg)
{
    stream_unlink(s);
    s->ended = true;
    if (s->dead) {
        stream_release(s);
        return;
    }
    sp_err_t err;
    sp_err_set(&err, code, "%s", msg);
    s->in_cb++;
    s->cbs.on_error(s, &err, s->arg);
    s->in_cb--;
    s->dead = true;
    stream_release(s);
}

static void fail_all_streams(sp_agentconn_t *c, const char *msg)
{
    for (size_t b = 0; b < NBUCKETS; b++)
        while (c->buckets[b] != NULL)
            stream_fail(c->buckets[b], SP_EUNAVAIL, msg);
}

static void run_waiters(sp_agentconn_t *c, const sp_err_t *err)
{
    while (!list_empty(&c->waiters) && (err != NULL || (c->up && !c->destroyed))) {
        struct waiter *w = CONTAINER(c->waiters.next, struct waiter, link);
        list_remove(&w->link);
        sp_timer_stop(&w->timer);
        w->cb(w->arg, err);
        free(w);
    }
}

/* ---- listeners ---- */

static void listeners_purge(sp_agentconn_t *c, bool all)
{
    for (struct sp_agentconn_listener **pp = &c->listeners; *pp != NULL;) {
        struct sp_agentconn_listener *l = *pp;
        if (all || l->dead) {
            *pp = l->next;
            free(l);
        } else {
            pp = &l->next;
        }
    }
}

/* Tells every listener; they may unlisten (themselves or others) or destroy c meanwhile. */
static void notify_listeners(sp_agentconn_t *c, sp_agentconn_event_t ev)
{
    c->listeners_walking++;
    for (struct sp_agentconn_listener *l = c->listeners; l != NULL; l = l->next) {
        if (l->dead)
            continue;
        if (ev != SP_AGENTCONN_GONE && c->destroyed)
            break;
        l->cb(l->arg, c, ev);
    }
    if (--c->listeners_walking == 0)
        listeners_purge(c, false);
}

/* ---- connection ---- */

/* Closes the socket and forgets buffered bytes in both directions. No callbacks. */
static void conn_close(sp_agentconn_t *c)
{
    sp_watch_destroy(c->watch); /* safe inside its own callback */
    c->watch = NULL;
    c->watch_events = 0;
    if (c->fd >= 0)
        close(c->fd);
    c->fd = -1;
    c->connecting = false;
    c->failing = false;
    c->oq_blocked = false;
    c->up = false;
    c->oq_off = 0;
    sp_buf_reset(&c->oq); /* also clears a failed allocation's mark */
    sp_ap_reader_reset(&c->rd);
    sp_timer_stop(&c->hello);
}

static void schedule_retry(sp_agentconn_t *c)
{
    c->backoff_ms = c->backoff_ms ? c->backoff_ms * 2 : BACKOFF_LO_MS;
    if (c->backoff_ms > BACKOFF_HI_MS)
        c->backoff_ms = BACKOFF_HI_MS;
    sp_timer_start(&c->retry, c->backoff_ms);
}

/* The channel is lost: close, fail every stream, tell the owner, reconnect later.
 * Only from loop entries (callbacks run here). */
static void conn_fail(sp_agentconn_t *c, const char *why)
{
    bool was_up = c->up;
    if (was_up)
        sp_metrics_add(&m_lost, 1);
    if (was_up || !c->logged_down)
        sp_log(SP_LOG_WARN, "agentconn", "channel lost path=%s err=%s streams=%zu", c->path, why,
               c->nstreams);
    c->logged_down = true;
    conn_close(c);
    fail_all_streams(c, "agent channel lost");
    if (was_up && !c->destroyed)
        c->on_state(c->arg, false);
    if (was_up && !c->destroyed)
        notify_listeners(c, SP_AGENTCONN_DOWN);
    if (!c->destroyed)
        schedule_retry(c);
}

static void on_io(sp_watch_t *w, int events, void *arg);

/* A nonzero random number (libsodium, as for ids): it must differ from any earlier
 * connection's to this agent, including a previous spaced's. */
static uint64_t new_session(void)
{
    uint64_t v = 0;
    randombytes_buf(&v, sizeof(v));
    return v != 0 ? v : 1;
}

/* Says HELLO with a new session. 0, or -1 after conn_fail. */
static int send_hello(sp_agentconn_t *c)
{
    uint8_t buf[128];
    sp_ap_writer_t w;
    sp_ap_writer_init(&w, buf, sizeof(buf));
    c->session = new_session();
    sp_ap_hello_t hello = {
        .version = SP_AP_VERSION,
        .client = {"spaced", 6},
        .session = c->session,
    };
    long n = sp_ap_enc_hello(&w, &hello);
    /* Our own fixed-size message: assert-worthy, but fail soft. */
    if (n < (long)SP_AP_HDR_SIZE) {
        conn_fail(c, "cannot encode hello");
        return -1;
    }
    sp_ap_hdr_t h;
    sp_ap_hdr_decode(buf, &h);
    if (send_frame(c, 0, SP_AP_T_HELLO, 0, buf + SP_AP_HDR_SIZE, h.len) < 0) {
        conn_fail(c, "cannot send hello");
        return -1;
    }
    sp_timer_start(&c->hello, c->hello_wait_ms);
    return 0;
}

static void conn_connected(sp_agentconn_t *c)
{
    c->connecting = false;
    sp_log(SP_LOG_DEBUG, "agentconn", "connected path=%s", c->path);
    set_interest(c, SP_IO_READ);
    c->hello_wait_ms = c->hello_first_ms;
    send_hello(c);
}

static void conn_connect(sp_agentconn_t *c)
{
    struct sockaddr_un sa = {.sun_family = AF_UNIX};
    memcpy(sa.sun_path, c->path, strlen(c->path) + 1); /* length checked in create */
    int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    if (fd < 0) {
        sp_log(SP_LOG_ERROR, "agentconn", "socket failed err=%s", strerror(errno));
        schedule_retry(c);
        return;
    }
    int rc;
    do
        rc = connect(fd, (struct sockaddr *)&sa, sizeof(sa));
    while (rc < 0 && errno == EINTR);
    if (rc < 0 && errno != EINPROGRESS) {
        /* ENOENT/ECONNREFUSED until QEMU listens; EAGAIN when its backlog is full. */
        if (!c->logged_down)
            sp_log(SP_LOG_INFO, "agentconn", "connect failed path=%s err=%s (retrying)", c->path,
                   strerror(errno));
        c->logged_down = true;
        close(fd);
        schedule_retry(c);
        return;
    }
    c->watch = sp_watch_create(c->loop, fd, on_io, c);
    if (c->watch == NULL) {
        sp_log(SP_LOG_ERROR, "agentconn", "watch failed path=%s", c->path);
        close(fd);
        schedule_retry(c);
        return;
    }
    c->fd = fd;
    if (rc < 0) {
        c->connecting = true;
        set_interest(c, SP_IO_WRITE);
    } else {
        conn_connected(c);
    }
}

static void on_connect_ready(sp_agentconn_t *c)
{
    int soerr = 0;
    socklen_t sl = sizeof(soerr);
    if (getsockopt(c->fd, SOL_SOCKET, SO_ERROR, &soerr, &sl) < 0)
        soerr = errno;
    if (soerr != 0) {
        if (!c->logged_down)
            sp_log(SP_LOG_INFO, "agentconn", "connect failed path=%s err=%s (retrying)", c->path,
                   strerror(soerr));
        c->logged_down = true;
        conn_close(c);
        schedule_retry(c);
        return;
    }
    conn_connected(c);
}

/* ---- incoming frames ---- */

static void on_agent_hello(sp_agentconn_t *c, const uint8_t *p, uint32_t len)
{
    sp_ap_hello_t h;
    sp_err_t err;
    bool ok = sp_ap_dec_hello(p, len, &h, &err) == 0;
    if (ok && h.session != 0 && h.session != c->session) {
        /* The answer to an earlier host's HELLO that the guest read late (see
         * base/agentproto.h): not about this connection. */
        sp_log(SP_LOG_INFO, "agentconn", "ignored the answer to an earlier hello path=%s",
               c->path);
        return;
    }
    if (c->up) {
        /* Only our HELLO starts a session: an unsolicited one means the agent lost track. */
        conn_fail(c, "unexpected hello");
        return;
    }
    if (!ok) {
        conn_fail(c, "malformed hello");
        return;
    }
    if (h.version != SP_AP_VERSION) {
        if (!c->logged_down)
            sp_log(SP_LOG_ERROR, "agentconn", "agent protocol version=%u want=%u path=%s",
                   h.version, SP_AP_VERSION, c->path);
        conn_fail(c, "protocol version mismatch");
        return;
    }
    /* Display string from the guest: bounded and printable. */
    size_t n = 0;
    if (h.agent_version.p != NULL)
        for (; n < h.agent_version.n && n < sizeof(c->agent_version) - 1; n++) {
            char ch = h.agent_version.p[n];
            c->agent_version[n] = (ch >= 0x20 && ch < 0x7f) ? ch : '?';
        }
    c->agent_version[n] = 0;
    c->caps = h.caps;
    c->up = true;
    c->backoff_ms = 0;
    c->logged_down = false;
    sp_metrics_add(c->was_ever_up ? &m_reconnects : &m_connects, 1);
    c->was_ever_up = true;
    sp_timer_stop(&c->hello);
    sp_log(SP_LOG_INFO, "agentconn", "channel up path=%s agent_version=%s caps=0x%x", c->path,
           c->agent_version, h.caps);
    c->on_state(c->arg, true);
    /* After the owner (which sends IDENTITY first), before waiters start requests. */
    if (!c->destroyed && c->up)
        notify_listeners(c, SP_AGENTCONN_UP);
    if (!c->destroyed && c->up)
        run_waiters(c, NULL);
}

static void on_control(sp_agentconn_t *c, const sp_ap_hdr_t *h, const uint8_t *p)
{
    switch (h->type) {
    case SP_AP_T_HELLO:
        on_agent_hello(c, p, h->len);
        break;
    case SP_AP_T_ERROR: {
        sp_ap_error_t e;
        sp_err_t err;
        uint32_t code = 0;
        if (sp_ap_dec_error(p, h->len, &e, &err) == 0)
            code = e.code;
        sp_log(SP_LOG_WARN, "agentconn", "agent control error path=%s code=%u", c->path, code);
        if (!c->up)
            conn_fail(c, "agent refused hello");
        break;
    }
    case SP_AP_T_PONG:
        break; /* we send no PING; a stray PONG is harmless */
    default:
        sp_log(SP_LOG_DEBUG, "agentconn", "dropped control frame type=0x%04x", h->type);
        break;
    }
}

static bool counts_against_window(uint16_t type)
{
    return type == SP_AP_T_DATA || type == SP_AP_T_PROC_STDOUT || type == SP_AP_T_PROC_STDERR;
}

static void send_refusal(sp_agentconn_t *c, uint32_t stream, uint32_t code, const char *msg)
{
    uint8_t buf[160];
    sp_ap_writer_t w;
    sp_ap_writer_init(&w, buf, sizeof(buf));
    sp_ap_put_u32(&w, SP_AP_K_CODE, code);
    sp_ap_put_str(&w, SP_AP_K_MSG, msg);
    if (!w.overflow)
        send_frame(c, stream, SP_AP_T_ERROR, SP_AP_F_END, buf, w.len);
}

/* The agent opens a stream (egress): offer it to the acceptor. */
static void on_agent_open(sp_agentconn_t *c, const sp_ap_hdr_t *h, const uint8_t *p)
{
    if (c->accept == NULL) {
        send_refusal(c, h->stream, SP_AP_E_UNAVAIL, "the host takes no such streams");
        return;
    }
    if (c->nstreams >= MAX_STREAMS) {
        send_refusal(c, h->stream, SP_AP_E_BUSY, "too many open streams");
        return;
    }
    sp_agentstream_t *s = calloc(1, sizeof(*s));
    if (s == NULL) {
        send_refusal(c, h->stream, SP_AP_E_INTERNAL, "out of memory");
        return;
    }
    s->c = c;
    s->id = h->stream;
    s->agent_opened = true;
    s->send_credit = SP_AP_INITIAL_WINDOW;
    s->recv_window = SP_AP_INITIAL_WINDOW;
    list_init(&s->wantw);
    s->linked = true;
    s->next = *bucket(c, s->id);
    *bucket(c, s->id) = s;
    c->nstreams++;
    sp_agentstream_cbs_t cbs = {0};
    void *arg = NULL;
    s->in_cb++;
    int rc = c->accept(c->accept_arg, s, h->type, p, h->len, &cbs, &arg);
    s->in_cb--;
    if (rc == 0 && (cbs.on_frame == NULL || cbs.on_error == NULL)) {
        sp_log(SP_LOG_ERROR, "agentconn", "acceptor gave no callbacks stream=%u", s->id);
        rc = -1;
    }
    if (rc < 0) {
        if (!s->ended)
            send_refusal(c, s->id, SP_AP_E_UNAVAIL, "refused by the host");
        stream_unlink(s);
        s->ended = true;
        s->dead = true;
    } else {
        s->cbs = cbs;
        s->arg = arg;
    }
    stream_release(s);
}

static void on_stream_frame(sp_agentconn_t *c, const sp_ap_hdr_t *h, const uint8_t *p)
{
    sp_agentstream_t *s = c->up ? stream_find(c, h->stream) : NULL;
    if (s == NULL && c->up && h->stream >= SP_AP_STREAM_AGENT_BASE &&
        (h->type == SP_AP_T_EGRESS_OPEN || h->type == SP_AP_T_DNS_QUERY)) {
        on_agent_open(c, h, p);
        return;
    }
    if (s != NULL && s->agent_opened && h->type == SP_AP_T_RESET) {
        stream_fail(s, SP_EUNAVAIL, "closed by the guest");
        return;
    }
    if (s == NULL) {
        /* Unknown, reset (frames cross RESET in flight), or agent-opened: dropped. */
        sp_log(SP_LOG_DEBUG, "agentconn", "dropped frame stream=%u type=0x%04x", h->stream,
               h->type);
        return;
    }
    if (counts_against_window(h->type)) {
        if (h->len > s->recv_window) {
            sp_log(SP_LOG_WARN, "agentconn", "agent exceeded window stream=%u len=%u window=%llu",
                   s->id, h->len, (unsigned long long)s->recv_window);
            send_frame(c, s->id, SP_AP_T_RESET, 0, NULL, 0);
            stream_fail(s, SP_EUNAVAIL, "agent broke flow control");
            return;
        }
        s->recv_window -= h->len;
    }
    bool end = (h->flags & SP_AP_F_END) != 0;
    if (h->type == SP_AP_T_WINDOW) {
        uint32_t inc = 0;
        if (sp_ap_get_u32(p, h->len, SP_AP_K_WINDOW, &inc) < 0)
            sp_log(SP_LOG_WARN, "agentconn", "malformed window stream=%u", s->id);
        s->send_credit += inc;
        if (s->send_credit > CREDIT_CAP)
            s->send_credit = CREDIT_CAP;
        if (end)
            goto deliver; /* odd, but END wins: it is the last frame */
        if (!list_empty(&s->wantw) && s->send_credit > 0 && !c->failing) {
            if (oq_queued(c) < OUTQ_SOFT)
                notify_writable(s);
            else
                c->oq_blocked = true; /* wake it when the queue drains */
        }
        return;
    }
deliver:
    if (end) {
        stream_unlink(s); /* the id is free again; END is the last frame */
        s->ended = true;
    }
    s->in_cb++;
    s->cbs.on_frame(s, h->type, h->flags, p, h->len, s->arg);
    s->in_cb--;
    if (end)
        s->dead = true;
    stream_release(s);
}

/* Pops and dispatches every complete frame. -1 when the channel closed or c is dying. */
static int process_frames(sp_agentconn_t *c)
{
    for (;;) {
        sp_ap_hdr_t h;
        const uint8_t *p = NULL;
        sp_err_t err;
        sp_ap_rd_result_t r = sp_ap_reader_next(&c->rd, &h, &p);
        if (r == SP_AP_RD_NEED)
            return 0;
        if (r != SP_AP_RD_FRAME || sp_ap_hdr_check(&h, &err) < 0) {
            sp_log(SP_LOG_WARN, "agentconn",
                   "bad frame header path=%s stream=%u type=0x%04x len=%u flags=0x%x", c->path,
                   h.stream, h.type, h.len, h.flags);
            conn_fail(c, "garbage from agent");
            return -1;
        }
        if (h.stream == 0)
            on_control(c, &h, p);
        else
            on_stream_frame(c, &h, p);
        if (c->fd < 0 || c->destroyed)
            return -1;
        if (c->failing) { /* a callback overflowed the queue */
            conn_fail(c, "output queue full: agent not reading");
            return -1;
        }
    }
}

static void on_readable(sp_agentconn_t *c)
{
    for (int i = 0; i < READ_BUDGET; i++) {
        size_t avail;
        uint8_t *p = sp_ap_reader_space(&c->rd, &avail);
        if (avail == 0) { /* cannot happen: a complete frame is popped before reading on */
            conn_fail(c, "reader full");
            return;
        }
        ssize_t n = recv(c->fd, p, avail, MSG_DONTWAIT);
        if (n == 0) {
            conn_fail(c, "agent closed the channel");
            return;
        }
        if (n < 0) {
            if (errno == EINTR)
                continue;
            if (errno == EAGAIN || errno == EWOULDBLOCK)
                return;
            conn_fail(c, strerror(errno));
            return;
        }
        sp_ap_reader_commit(&c->rd, (size_t)n);
        if (process_frames(c) < 0)
            return;
        if ((size_t)n < avail)
            return; /* drained the socket */
    }
}

static void on_io(sp_watch_t *w, int events, void *arg)
{
    sp_agentconn_t *c = arg;
    if (w != c->watch)
        return; /* cannot happen: a closed watch reports nothing */
    conn_enter(c);
    if (c->connecting) {
        if (events & SP_IO_WRITE)
            on_connect_ready(c);
    } else if (c->failing) {
        conn_fail(c, "output failed");
    } else if (events & SP_IO_WRITE) {
        if (oq_flush(c) < 0)
            conn_fail(c, strerror(errno));
        else
            drain_wantw(c);
    } else if (events & SP_IO_READ) {
        on_readable(c);
    }
    conn_leave(c);
}

static void on_retry(sp_timer_t *t, void *arg)
{
    sp_agentconn_t *c = arg;
    conn_enter(c);
    if (!c->destroyed && c->fd < 0)
        conn_connect(c);
    conn_leave(c);
}

static void on_kick(sp_timer_t *t, void *arg)
{
    sp_agentconn_t *c = arg;
    conn_enter(c);
    if (c->failing)
        conn_fail(c, "output failed");
    if (!c->destroyed && c->up)
        run_waiters(c, NULL);
    if (!c->destroyed && c->up)
        drain_wantw(c);
    conn_leave(c);
}

/* No answer to our HELLO (the timer runs only then: the answer and conn_close stop it). Its
 * answer can be lost in the guest (agent/chan.c), or the agent is slow or stopped (a paused
 * VM). HELLO again on the same connection, with a new session: an answer to the earlier one
 * is then ignored, and reconnecting would send the guest a hangup and a connect for every
 * try, which a stopped guest would have to queue. */
static void on_hello_wait(sp_timer_t *t, void *arg)
{
    sp_agentconn_t *c = arg;
    conn_enter(c);
    if (!c->failing) { /* else the teardown queued on kick closes the connection */
        sp_log(SP_LOG_INFO, "agentconn", "no answer to hello within %u ms: saying it again path=%s",
               c->hello_wait_ms, c->path);
        c->hello_wait_ms = c->hello_wait_ms < HELLO_WAIT_MAX_MS / 2 ? c->hello_wait_ms * 2
                                                                     : HELLO_WAIT_MAX_MS;
        send_hello(c);
    }
    conn_leave(c);
}

static void on_waiter_timeout(sp_timer_t *t, void *arg)
{
    struct waiter *w = arg;
    sp_agentconn_t *c = w->c;
    conn_enter(c);
    list_remove(&w->link);
    sp_err_t err;
    sp_err_set(&err, SP_EUNAVAIL, "sandbox agent is not answering");
    w->cb(w->arg, &err);
    free(w);
    conn_leave(c);
}

/* ---- API ---- */

sp_agentconn_t *sp_agentconn_create(sp_loop_t *loop, const char *socket_path,
                                    sp_agentconn_state_cb on_state, void *arg)
{
    struct sockaddr_un sa;
    if (loop == NULL || socket_path == NULL || on_state == NULL ||
        strlen(socket_path) >= sizeof(sa.sun_path)) {
        sp_log(SP_LOG_ERROR, "agentconn", "bad socket path or arguments");
        return NULL;
    }
    sp_agentconn_t *c = calloc(1, sizeof(*c));
    if (c == NULL)
        return NULL;
    c->path = strdup(socket_path);
    c->rbuf = malloc(SP_AP_MAX_FRAME);
    if (c->path == NULL || c->rbuf == NULL) {
        free(c->path);
        free(c->rbuf);
        free(c);
        return NULL;
    }
    c->loop = loop;
    c->on_state = on_state;
    c->arg = arg;
    c->fd = -1;
    c->next_id = 1;
    sp_metrics_declare(&m_reconnects); /* listed at 0 from the first channel on */
    sp_metrics_declare(&m_lost);
    sp_ap_reader_init(&c->rd, c->rbuf, SP_AP_MAX_FRAME);
    list_init(&c->wantw);
    list_init(&c->waiters);
    sp_timer_init(&c->retry, loop, on_retry, c);
    sp_timer_init(&c->kick, loop, on_kick, c);
    sp_timer_init(&c->hello, loop, on_hello_wait, c);
    c->hello_first_ms = HELLO_WAIT_MS;
    sp_timer_start(&c->retry, 0); /* first attempt on the next turn */
    return c;
}

static void conn_finalize(sp_agentconn_t *c)
{
    c->depth++; /* callbacks below must not finalize again */
    conn_close(c);
    fail_all_streams(c, "agent connection closed");
    sp_err_t err;
    sp_err_set(&err, SP_EUNAVAIL, "agent connection closed");
    run_waiters(c, &err);
    notify_listeners(c, SP_AGENTCONN_GONE);
    listeners_purge(c, true);
    sp_timer_stop(&c->retry);
    sp_timer_stop(&c->kick);
    sp_timer_stop(&c->hello);
    sp_buf_free(&c->oq);
    free(c->rbuf);
    free(c->path);
    free(c);
}

void sp_agentconn_destroy(sp_agentconn_t *c)
{
    if (c == NULL || c->destroyed)
        return;
    c->destroyed = true;
    sp_log(SP_LOG_DEBUG, "agentconn", "destroy path=%s streams=%zu", c->path, c->nstreams);
    if (c->depth == 0)
        conn_finalize(c);
}

void sp_agentconn_set_hello_wait(sp_agentconn_t *c, uint32_t ms)
{
    c->hello_first_ms = ms > 0 ? ms : HELLO_WAIT_MS;
}

bool sp_agentconn_up(const sp_agentconn_t *c)
{
    return c != NULL && c->up && !c->failing && !c->destroyed;
}

const char *sp_agentconn_agent_version(const sp_agentconn_t *c)
{
    return c->agent_version;
}

int sp_agentconn_when_up(sp_agentconn_t *c, uint32_t timeout_ms,
                         void (*cb)(void *arg, const sp_err_t *err), void *arg)
{
    if (c->destroyed)
        return -1;
    struct waiter *w = calloc(1, sizeof(*w));
    if (w == NULL)
        return -1;
    w->c = c;
    w->cb = cb;
    w->arg = arg;
    list_push(&c->waiters, &w->link);
    sp_timer_init(&w->timer, c->loop, on_waiter_timeout, w);
    sp_timer_start(&w->timer, timeout_ms);
    if (sp_agentconn_up(c))
        sp_timer_start(&c->kick, 0);
    return 0;
}

static sp_agentstream_t *open_fail(sp_err_t *err, sp_code_t code, const char *msg)
{
    sp_err_set(err, code, "%s", msg);
    return NULL;
}

sp_agentstream_t *sp_agentconn_open(sp_agentconn_t *c, uint16_t type, const uint8_t *payload,
                                    size_t len, const sp_agentstream_cbs_t *cbs, void *arg,
                                    sp_err_t *err)
{
    bool opens = sp_ap_type_opens(type) && type != SP_AP_T_EGRESS_OPEN &&
                 type != SP_AP_T_DNS_QUERY; /* those two are the agent's to open */
    if (!opens || cbs == NULL || cbs->on_frame == NULL || cbs->on_error == NULL)
        return open_fail(err, SP_EINTERNAL, "bad agent stream request");
    if (len > SP_AP_MAX_PAYLOAD)
        return open_fail(err, SP_ETOOBIG, "request too large");
    if (!sp_agentconn_up(c))
        return open_fail(err, SP_EUNAVAIL, "sandbox agent is not connected");
    if (c->nstreams >= MAX_STREAMS)
        return open_fail(err, SP_EUNAVAIL, "too many open agent streams");
    sp_agentstream_t *s = calloc(1, sizeof(*s));
    if (s == NULL)
        return open_fail(err, SP_EINTERNAL, "out of memory");
    s->c = c;
    s->id = stream_alloc_id(c);
    s->cbs = *cbs;
    s->arg = arg;
    s->send_credit = SP_AP_INITIAL_WINDOW;
    s->recv_window = SP_AP_INITIAL_WINDOW;
    list_init(&s->wantw);
    if (send_frame(c, s->id, type, 0, payload, len) < 0) {
        free(s);
        return open_fail(err, SP_EUNAVAIL, "sandbox agent channel failed");
    }
    s->linked = true;
    s->next = *bucket(c, s->id);
    *bucket(c, s->id) = s;
    c->nstreams++;
    sp_log(SP_LOG_DEBUG, "agentconn", "open stream=%u type=%s", s->id, sp_ap_type_name(type));
    return s;
}

int sp_agentstream_send(sp_agentstream_t *s, uint16_t type, const uint8_t *payload, size_t len)
{
    sp_agentconn_t *c = s->c;
    uint32_t code;
    if (s->dead || s->ended || !sp_agentconn_up(c))
        return -1;
    if (sp_ap_check_from_host(type, s->id, &code) < 0 || sp_ap_type_opens(type) ||
        type == SP_AP_T_WINDOW || type == SP_AP_T_RESET) {
        sp_log(SP_LOG_ERROR, "agentconn", "bad send type=0x%04x stream=%u", type, s->id);
        return -1;
    }
    if (type == SP_AP_T_DATA) {
        if (len > SP_AP_MAX_DATA) {
            sp_log(SP_LOG_ERROR, "agentconn", "data frame too long len=%zu", len);
            return -1;
        }
        if (len > s->send_credit || oq_queued(c) >= OUTQ_SOFT) {
            if (list_empty(&s->wantw))
                list_push(&c->wantw, &s->wantw);
            if (oq_queued(c) >= OUTQ_SOFT)
                c->oq_blocked = true;
            return 0;
        }
    } else if (len > SP_AP_MAX_PAYLOAD) {
        sp_log(SP_LOG_ERROR, "agentconn", "frame too long len=%zu", len);
        return -1;
    }
    if (send_frame(c, s->id, type, 0, payload, len) < 0)
        return -1;
    if (type == SP_AP_T_DATA)
        s->send_credit -= len;
    return 1;
}

size_t sp_agentstream_credit(const sp_agentstream_t *s)
{
    if (s->dead || s->ended || !sp_agentconn_up(s->c) || oq_queued(s->c) >= OUTQ_SOFT)
        return 0;
    return s->send_credit > SIZE_MAX ? SIZE_MAX : (size_t)s->send_credit;
}

void sp_agentstream_want_writable(sp_agentstream_t *s)
{
    sp_agentconn_t *c = s->c;
    if (s->dead || s->ended || !sp_agentconn_up(c))
        return;
    if (list_empty(&s->wantw))
        list_push(&c->wantw, &s->wantw);
    /* Out of credit: its WINDOW wakes it. Queue over the bound (or credit already there):
     * the drain check does, from a loop turn. */
    if (oq_queued(c) >= OUTQ_SOFT || s->send_credit > 0) {
        c->oq_blocked = true;
        if (oq_queued(c) < OUTQ_LOW)
            sp_timer_start(&c->kick, 0);
    }
}

void sp_agentstream_grant(sp_agentstream_t *s, uint32_t n)
{
    if (n == 0 || s->dead || s->ended || !sp_agentconn_up(s->c))
        return;
    if (send_window(s->c, s->id, n) == 0)
        s->recv_window += n;
}

void sp_agentstream_set_recv_window(sp_agentstream_t *s, uint32_t n)
{
    if (s->agent_opened && s->in_cb > 0 && s->recv_window == SP_AP_INITIAL_WINDOW &&
        n < s->recv_window)
        s->recv_window = n;
}

void sp_agentstream_reset(sp_agentstream_t *s)
{
    if (s == NULL || s->dead)
        return;
    sp_agentconn_t *c = s->c;
    if (!s->ended && sp_agentconn_up(c))
        send_frame(c, s->id, SP_AP_T_RESET, 0, NULL, 0);
    stream_unlink(s);
    s->ended = true;
    s->dead = true;
    stream_release(s);
}

void *sp_agentstream_arg(const sp_agentstream_t *s)
{
    return s->arg;
}

sp_agentconn_t *sp_agentstream_conn(const sp_agentstream_t *s)
{
    return s->c;
}

int sp_agentstream_end(sp_agentstream_t *s, uint16_t type, const uint8_t *payload, size_t len)
{
    if (s == NULL || s->dead)
        return -1;
    if (!s->agent_opened ||
        (type != SP_AP_T_OK && type != SP_AP_T_ERROR && type != SP_AP_T_DNS_ANSWER) ||
        len > SP_AP_MAX_PAYLOAD) {
        sp_log(SP_LOG_ERROR, "agentconn", "bad end type=0x%04x stream=%u", type, s->id);
        return -1;
    }
    sp_agentconn_t *c = s->c;
    int rc = -1;
    if (!s->ended && sp_agentconn_up(c))
        rc = send_frame(c, s->id, type, SP_AP_F_END, payload, len);
    stream_unlink(s);
    s->ended = true;
    s->dead = true;
    stream_release(s);
    return rc;
}

bool sp_agentstream_agent_opened(const sp_agentstream_t *s)
{
    return s->agent_opened;
}

void sp_agentconn_set_acceptor(sp_agentconn_t *c, sp_agentconn_accept_cb cb, void *arg)
{
    c->accept = cb;
    c->accept_arg = arg;
}

sp_agentconn_listener_t *sp_agentconn_listen(sp_agentconn_t *c, sp_agentconn_listen_cb cb,
                                             void *arg)
{
    if (c == NULL || c->destroyed || cb == NULL)
        return NULL;
    struct sp_agentconn_listener *l = calloc(1, sizeof(*l));
    if (l == NULL)
        return NULL;
    l->c = c;
    l->cb = cb;
    l->arg = arg;
    struct sp_agentconn_listener **pp = &c->listeners;
    while (*pp != NULL)
        pp = &(*pp)->next;
    *pp = l;
    return l;
}

void sp_agentconn_unlisten(sp_agentconn_listener_t *l)
{
    if (l == NULL || l->dead)
        return;
    l->dead = true;
    if (l->c->listeners_walking == 0)
        listeners_purge(l->c, false);
}

uint32_t sp_agentconn_caps(const sp_agentconn_t *c)
{
    return c->caps;
}

int sp_agentconn_set_path(sp_agentconn_t *c, const char *socket_path)
{
    struct sockaddr_un sa;
    if (c == NULL || socket_path == NULL || strlen(socket_path) >= sizeof(sa.sun_path))
        return -1;
    char *p = strdup(socket_path);
    if (p == NULL)
        return -1;
    free(c->path);
    c->path = p;
    return 0;
}

void sp_agentconn_set_sandbox(sp_agentconn_t *c, const char *sandbox_id)
{
    if (c == NULL || sandbox_id == NULL)
        return;
    snprintf(c->sandbox, sizeof(c->sandbox), "%s", sandbox_id);
    if (named_hook != NULL)
        named_hook(named_hook_arg, c, c->sandbox);
}

const char *sp_agentconn_sandbox(const sp_agentconn_t *c)
{
    return c->sandbox;
}

void sp_agentconn_set_hook(sp_agentconn_hook_cb cb, void *arg)
{
    named_hook = cb;
    named_hook_arg = arg;
}
