/*
 * watch.h - inotify watches on directories, one inotify instance per stream.
 *
 * Owns the inotify fd and the wd -> path table of each watch stream. Watches
 * are added with the user's filesystem credentials, so a user can only watch
 * what they can read.
 */
#ifndef SP_AGENT_WATCH_H
#define SP_AGENT_WATCH_H

#include <stdint.h>

void sp_watch_on_start(uint32_t id, const uint8_t *p, uint32_t n);

#endif
