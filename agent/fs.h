/*
 * fs.h - file requests: stat, streamed read, streamed atomic write, list,
 * mkdir -p, move, remove, chmod, chown.
 *
 * Every filesystem call runs with the requesting user's filesystem
 * credentials (users.h), so permission checks are the kernel's. Paths
 * resolve against the user's home. Owns the fds of open read/write streams.
 */
#ifndef SP_AGENT_FS_H
#define SP_AGENT_FS_H

#include <stdint.h>

/* Opener for every FS_* type (not WATCH_START). */
void sp_fs_on_request(uint16_t type, uint32_t id, const uint8_t *p, uint32_t n);

#endif
