/*
 * ev.h - the agent's single-threaded poll() loop: fd watchers, nothing else.
 *
 * Watchers are level-triggered and may be added, changed or deleted from any
 * callback, including their own. Owns no fds.
 */
#ifndef SP_AGENT_EV_H
#define SP_AGENT_EV_H

typedef struct sp_ev sp_ev_t;
/* revents as from poll(2). */
typedef void (*sp_ev_cb)(int fd, short revents, void *arg);

/* Watches fd for events (POLLIN/POLLOUT; 0 = paused). Never NULL unless out of memory. */
sp_ev_t *sp_ev_add(int fd, short events, sp_ev_cb cb, void *arg);
void sp_ev_mod(sp_ev_t *e, short events);
/* Stops watching; the watcher is freed after the current dispatch. NULL is fine. */
void sp_ev_del(sp_ev_t *e);
/* Polls once for at most timeout_ms (-1: forever) and runs ready callbacks. */
int sp_ev_run_once(int timeout_ms);

#endif
