/*
 * tarcheck.h - decides whether an uploaded tar (plain or gzip) is one a template build may
 * unpack: a streaming reader of its headers that refuses what could reach outside the
 * directory it is unpacked in or make devices.
 *
 * Folder: core/control/ is sandboxes' lifecycle: these operations, states, the controller that
 * reconciles them, API keys. (ARCHITECTURE.md: the layers.)
 *
 * The host never unpacks these files (the builder VM does, as root in the guest); the check
 * exists so that a bad file is refused with its reason at upload, not half-applied in a build.
 * Accepted: regular files, directories, symbolic links whose target, read from the link's own
 * directory, stays inside the tree, hard links to an earlier member, and the POSIX (pax) and
 * GNU long-name headers that rename the next member. Refused, naming the member: absolute
 * names, ".." components, device nodes, FIFOs and other types, links that escape, bad header
 * checksums, truncated data, more than SP_TAR_MAX_ENTRIES members or names over
 * SP_TAR_MAX_NAME bytes, a gzip stream that is corrupt or inflates past max_bytes.
 * Pure: no I/O; memory is one header's worth plus the hard-link name set.
 */
#ifndef SP_TARCHECK_H
#define SP_TARCHECK_H

#include <stddef.h>
#include <stdint.h>

#define SP_TAR_MAX_ENTRIES 200000
#define SP_TAR_MAX_NAME    4096

typedef struct sp_tarcheck sp_tarcheck_t;

/* max_bytes bounds the tar's uncompressed size. NULL when out of memory. */
sp_tarcheck_t *sp_tarcheck_new(uint64_t max_bytes);
/* A layer of a container image (core/control/ociimg.h), unpacked by umoci into a root of its
 * own: names are held to the same rules, but a symbolic link may point anywhere (it is read
 * inside the image's root, where absolute targets are the norm), names may start with '/' (read
 * from the image's root, as Docker does), a hard link may name a file
 * of a lower layer, and device nodes and FIFOs pass (the unpacked tree is cleared of them). */
sp_tarcheck_t *sp_tarcheck_new_layer(uint64_t max_bytes);
/* Feeds the next n bytes of the upload (compressed or not: told by its first bytes). -1 with
 * the reason in why (what and which member) at the first problem; then it stays failed. */
int sp_tarcheck_feed(sp_tarcheck_t *t, const void *p, size_t n, char *why, size_t cap);
/* The upload ended: 0 when the tar is complete and acceptable, with its member count in
 * *entries (may be NULL); else -1 and why. */
int sp_tarcheck_end(sp_tarcheck_t *t, uint64_t *entries, char *why, size_t cap);
void sp_tarcheck_free(sp_tarcheck_t *t);

#endif
