/*
 * sysinit.h - guest system duties: PID 1 setup and supervision, finding the
 * channel, and applying IDENTITY after a snapshot restore.
 */
#ifndef SP_AGENT_SYSINIT_H
#define SP_AGENT_SYSINIT_H

#include <stddef.h>
#include <stdint.h>

/* Name of the virtio-serial port the host opens for us. */
#define SP_AGENT_PORT_NAME "space.agent"

/* Mounts /dev/pts, /dev/shm, /run, /tmp when missing; sets a default hostname. */
void sp_sysinit_mounts(void);
/* Finds /dev/<vport> whose /sys/class/virtio-ports/<vport>/name is `name`. 0 or -1. */
int sp_sysinit_find_port(const char *name, char *out, size_t cap);
/* One line on /dev/console (boot debugging). */
void sp_sysinit_console(const char *line);
/*
 * PID 1 loop: forks a worker that runs `worker(arg)` and respawns it if it
 * dies, reaping every orphan meanwhile. Never returns.
 */
void sp_sysinit_supervise(int (*worker)(void *), void *arg);

/* IDENTITY opener. */
void sp_sysinit_on_identity(uint32_t id, const uint8_t *p, uint32_t n);

#endif
