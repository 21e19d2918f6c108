/*
 * sniff.c - accept, peek one byte, hand to h2o as TLS or plain HTTP (http/sniff.h).
 *
 * Owns the listening fd and every accepted fd until it is handed to h2o. Waits
 * through sp_watch (which watches a dup, so peeking never disturbs the fd h2o
 * gets); the peek uses MSG_PEEK, so h2o reads the byte again, TLS or not.
 */
#include "http/sniff.h"

#include <errno.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include "base/log.h"

#define ACCEPT_BUDGET 64  /* accepts per readiness callback */
#define EMFILE_PAUSE_MS 100

struct pend {
    sp_sniff_t *s;
    int fd;
    sp_watch_t *w;
    sp_timer_t timer;
    struct pend *prev, *next;
};

struct sp_sniff {
    sp_loop_t *loop;
    int fd;
    sp_watch_t *lw;
    bool listening; /* lw has read interest */
    sp_timer_t resume; /* after EMFILE */
    h2o_accept_ctx_t *plain, *tls;
    sp_bodygate_t *gate;
    struct pend *head;
    size_t npend;
};

static void set_listening(sp_sniff_t *s, bool on)
{
    if (s->listening != on) {
        s->listening = on;
        sp_watch_set(s->lw, on ? SP_IO_READ : 0);
    }
}

static void pend_free(struct pend *p, bool close_fd)
{
    sp_sniff_t *s = p->s;
    sp_watch_destroy(p->w);
    sp_timer_stop(&p->timer);
    if (close_fd)
        close(p->fd);
    if (p->prev)
        p->prev->next = p->next;
    else
        s->head = p->next;
    if (p->next)
        p->next->prev = p->prev;
    free(p);
    s->npend--;
    if (s->npend < SP_SNIFF_MAX_PENDING && !sp_timer_armed(&s->resume))
        set_listening(s, true);
}

static void hand_off(struct pend *p, bool is_tls)
{
    sp_sniff_t *s = p->s;
    int fd = p->fd;
    pend_free(p, false);
    int one = 1;
    setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
    h2o_socket_t *sock = h2o_evloop_socket_create(sp_loop_native(s->loop), fd, 0);
    if (s->gate == NULL) {
        h2o_accept(is_tls && s->tls != NULL ? s->tls : s->plain, sock);
    } else if (is_tls && s->tls != NULL) {
        sp_bodygate_accept(s->gate, s->tls, sock, fd);
    } else {
        h2o_accept(s->plain, sock); /* plain: h2o takes it as HTTP/1 at once */
        sp_bodygate_attach(s->gate, sock, fd);
    }
}

void sp_sniff_set_gate(sp_sniff_t *s, sp_bodygate_t *g)
{
    s->gate = g;
}

static void on_pend_io(sp_watch_t *w, int events, void *arg)
{
    struct pend *p = arg;
    unsigned char b;
    ssize_t n = recv(p->fd, &b, 1, MSG_PEEK | MSG_DONTWAIT);
    if (n == 1) {
        hand_off(p, b == 0x16); /* TLS record type 22: handshake */
        return;
    }
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR))
        return;
    pend_free(p, true); /* closed before a byte, or an error */
}

static void on_pend_timeout(sp_timer_t *t, void *arg)
{
    pend_free(arg, true);
}

static void on_resume(sp_timer_t *t, void *arg)
{
    sp_sniff_t *s = arg;
    set_listening(s, s->npend < SP_SNIFF_MAX_PENDING);
}

static void on_listen(sp_watch_t *w, int events, void *arg)
{
    sp_sniff_t *s = arg;
    for (int i = 0; i < ACCEPT_BUDGET && s->npend < SP_SNIFF_MAX_PENDING; i++) {
        int fd = accept4(s->fd, NULL, NULL, SOCK_NONBLOCK | SOCK_CLOEXEC);
        if (fd < 0) {
            if (errno == EMFILE || errno == ENFILE || errno == ENOBUFS || errno == ENOMEM) {
                /* Level-triggered: the pending connection would wake us at once again. */
                sp_log(SP_LOG_WARN, "server", "accept failed err=%s (pausing)", strerror(errno));
                set_listening(s, false);
                sp_timer_start(&s->resume, EMFILE_PAUSE_MS);
            }
            return; /* EAGAIN, ECONNABORTED, EINTR: next readiness */
        }
        struct pend *p = calloc(1, sizeof(*p));
        if (p == NULL) {
            close(fd);
            return;
        }
        p->s = s;
        p->fd = fd;
        p->w = sp_watch_create(s->loop, fd, on_pend_io, p);
        if (p->w == NULL) {
            close(fd);
            free(p);
            return;
        }
        sp_timer_init(&p->timer, s->loop, on_pend_timeout, p);
        sp_timer_start(&p->timer, SP_SNIFF_TIMEOUT_MS);
        p->next = s->head;
        if (s->head)
            s->head->prev = p;
        s->head = p;
        s->npend++;
        sp_watch_set(p->w, SP_IO_READ);
    }
    if (s->npend >= SP_SNIFF_MAX_PENDING)
        set_listening(s, false);
}

sp_sniff_t *sp_sniff_create(sp_loop_t *loop, int listen_fd, h2o_accept_ctx_t *plain,
                            h2o_accept_ctx_t *tls)
{
    sp_sniff_t *s = calloc(1, sizeof(*s));
    if (s == NULL)
        return NULL;
    s->loop = loop;
    s->plain = plain;
    s->tls = tls;
    s->lw = sp_watch_create(loop, listen_fd, on_listen, s);
    if (s->lw == NULL) {
        free(s);
        return NULL;
    }
    s->fd = listen_fd;
    sp_timer_init(&s->resume, loop, on_resume, s);
    set_listening(s, true);
    return s;
}

void sp_sniff_destroy(sp_sniff_t *s)
{
    if (s == NULL)
        return;
    while (s->head != NULL) {
        sp_timer_stop(&s->resume); /* keep pend_free from re-arming the listener */
        pend_free(s->head, true);
    }
    sp_timer_stop(&s->resume);
    sp_watch_destroy(s->lw);
    close(s->fd);
    free(s);
}
