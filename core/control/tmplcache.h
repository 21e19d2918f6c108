/*
 * tmplcache.h - the step cache of template builds: a snapshot of the builder VM (driver.h:
 * checkpoint) after a step, named by everything that led to it, so a later build with the same
 * beginning boots its builder from there and runs only the steps after.
 *
 * Folder: core/control/ reconciles desired and observed state, templates and keys over the
 * store and the runtime driver. (ARCHITECTURE.md: the layers.)
 *
 * An entry's id is "bc-" and 32 hex digits of SHA-256 over the team, the parent version's
 * hash, the builder's size and the steps up to and including that one (a copy step names its
 * files by their SHA-256, so changed files change the key). Entries are the driver's
 * snapshots: their files go when the driver lets them (a newer entry's disk may back onto an
 * older one's). Does not decide when a step is worth a snapshot (tmpl.c does).
 */
#ifndef SP_TMPLCACHE_H
#define SP_TMPLCACHE_H

#include <jansson.h>
#include <stddef.h>

#include "core/runtime/driver.h"

#define SP_TMPLCACHE_ID_LEN 35 /* "bc-" + 32 */
#define SP_TMPLCACHE_KEEP   32 /* entries kept on a data dir; the oldest go first */

/* The entry id after steps[0..n-1] (n >= 1) into out. disk_mb: the disk the builder was
 * grown to before its steps (0: its parent's, as it came). */
void sp_tmplcache_key(const char *team, const char *parent_hash, int cpu_count, int memory_mb,
                      int disk_mb, const json_t *steps, size_t n,
                      char out[SP_TMPLCACHE_ID_LEN + 1]);

/* The largest n <= max_n whose entry the driver has (0: none), its id into out. */
size_t sp_tmplcache_find(sp_driver_t *d, const char *team, const char *parent_hash, int cpu_count,
                         int memory_mb, int disk_mb, const json_t *steps, size_t max_n,
                         char out[SP_TMPLCACHE_ID_LEN + 1]);

/* Deletes the driver's oldest entries beyond keep (by when they were taken). */
void sp_tmplcache_trim(sp_driver_t *d, size_t keep);

#endif
