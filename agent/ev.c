/*
 * ev.c - poll() over a list of watchers, rebuilt each iteration.
 *
 * The agent watches tens of fds, so an O(n) rebuild per wakeup is cheaper to
 * get right than an incremental structure. Deleted watchers are only marked
 * and reaped between iterations so callbacks can delete freely.
 */
#include "agent/ev.h"

#include <errno.h>
#include <poll.h>
#include <stdbool.h>
#include <stdlib.h>

struct sp_ev {
    int fd;
    short events;
    bool dead;
    sp_ev_cb cb;
    void *arg;
    sp_ev_t *next;
};

static sp_ev_t *watchers;

sp_ev_t *sp_ev_add(int fd, short events, sp_ev_cb cb, void *arg)
{
    sp_ev_t *e = calloc(1, sizeof(*e));
    if (e == NULL)
        return NULL;
    e->fd = fd;
    e->events = events;
    e->cb = cb;
    e->arg = arg;
    e->next = watchers;
    watchers = e;
    return e;
}

void sp_ev_mod(sp_ev_t *e, short events)
{
    if (e != NULL)
        e->events = events;
}

void sp_ev_del(sp_ev_t *e)
{
    if (e != NULL)
        e->dead = true;
}

static void reap_dead(void)
{
    sp_ev_t **pp = &watchers;
    while (*pp != NULL) {
        sp_ev_t *e = *pp;
        if (e->dead) {
            *pp = e->next;
            free(e);
        } else {
            pp = &e->next;
        }
    }
}

int sp_ev_run_once(int timeout_ms)
{
    reap_dead();
    size_t n = 0;
    for (sp_ev_t *e = watchers; e != NULL; e = e->next)
        n++;
    struct pollfd *pfd = calloc(n + 1, sizeof(*pfd));
    sp_ev_t **map = calloc(n + 1, sizeof(*map));
    if (pfd == NULL || map == NULL) {
        free(pfd);
        free(map);
        return -1;
    }
    size_t i = 0;
    for (sp_ev_t *e = watchers; e != NULL; e = e->next, i++) {
        /* A paused watcher still polls as fd -1 so errors on it wait until resumed. */
        pfd[i].fd = e->events ? e->fd : -1;
        pfd[i].events = e->events;
        map[i] = e;
    }
    int rc = poll(pfd, n, timeout_ms);
    if (rc < 0 && errno != EINTR) {
        free(pfd);
        free(map);
        return -1;
    }
    for (i = 0; rc > 0 && i < n; i++) {
        sp_ev_t *e = map[i];
        if (pfd[i].revents != 0 && !e->dead && e->events != 0)
            e->cb(e->fd, pfd[i].revents, e->arg);
    }
    free(pfd);
    free(map);
    return 0;
}
