/*
 * procmaps.h - a process's memory maps, as /proc/<pid>/maps lists them.
 *
 * Folder: core/runtime/ is the VMs' runtime: the driver interface and the QEMU driver behind
 * it. (ARCHITECTURE.md: the layers.)
 *
 * The runtime looks at its QEMUs' maps to find their guest RAM: the sealed template RAM a
 * jailed clone maps (qemu/confine.c) and the private map of a clone's RAM file whose written
 * pages an exact snapshot reads (migdelta.h: sp_migdelta_live_open). One reader serves both.
 */
#ifndef SP_RUNTIME_PROCMAPS_H
#define SP_RUNTIME_PROCMAPS_H

#include <stdbool.h>
#include <stdint.h>
#include <sys/types.h>

typedef struct {
    uint64_t lo, hi; /* the map's addresses: [lo, hi) */
    uint64_t off;    /* its offset in the file it maps */
    dev_t dev;       /* the file's device and inode (0 for none) */
    uint64_t ino;
    bool priv;        /* a private (copy-on-write) map, not a shared one */
    const char *path; /* what the kernel names it ("" for none; "/memfd:NAME (deleted)"...) */
} sp_procmap_t;

/* fn for each map of pid, in order of address, until it returns true (then 1 is returned);
 * 0 when it never did; -1 when the maps cannot be read (the process is gone). The map and
 * its path are valid during the call only. */
int sp_procmaps_each(pid_t pid, bool (*fn)(const sp_procmap_t *m, void *arg), void *arg);

#endif
