/*
 * migdelta.h - shrink a QEMU migration stream to the guest RAM pages that differ from a base.
 *
 * A clone's guest RAM is a private copy-on-write map of its template's RAM file. When the
 * clone is suspended QEMU streams all of its RAM; this filter drops every page record of one
 * RAM block that would write what the template's file already holds, so the snapshot keeps
 * only the clone's own pages. Loading the filtered stream into a QEMU that maps the same base
 * file (share=off) gives the same guest RAM as loading the whole stream.
 *
 * Understands the savevm stream (version 3) that QEMU 7.2 writes for a plain precopy
 * migration: configuration section, the iterative "ram" section (START/PART/END with
 * MEM_SIZE, ZERO, PAGE and EOS records, 4 KiB target pages), then device state, which is
 * passed through unread. Refuses what it cannot follow exactly (XBZRLE, compression, RDMA
 * hooks, postcopy, multifd, other iterative sections such as block migration) so the caller
 * can fall back to the unfiltered stream. Pure: no globals, no logging, safe on any thread.
 */
#ifndef SP_MIGDELTA_H
#define SP_MIGDELTA_H

#include <stddef.h>
#include <stdint.h>

typedef struct sp_migdelta_stats {
    uint64_t pages_in, pages_kept; /* RAM_SAVE_FLAG_PAGE records of the filtered block */
    uint64_t zero_in, zero_kept;   /* RAM_SAVE_FLAG_ZERO records of the filtered block */
    uint64_t base_pages;           /* expand: the base's pages written out */
    uint64_t bytes_in, bytes_out;
} sp_migdelta_stats_t;

/*
 * Reads a migration stream from in_fd (a pipe or file) to EOF and writes to out_fd the same
 * stream minus every record of RAM block `block` (e.g. "mem") whose page equals the base:
 * a PAGE record whose bytes equal base[offset .. offset+4096), a ZERO record whose fill byte
 * (QEMU writes 0) fills the base page exactly; bytes at or beyond the base file's size count
 * as zero. A record for a page whose earlier record was kept is always kept (a later copy
 * must overwrite the earlier one on load). Other blocks' records and every non-RAM section
 * are copied byte for byte. Block headers are re-encoded (RAM_SAVE_FLAG_CONTINUE set only
 * when the previous KEPT record named the same block; otherwise the idstr is written) so the
 * output loads. base_path is mapped read-only for the call and must not shrink meanwhile
 * (a truncated mapping faults), nor have its holes filled with other than zeroes (a page
 * over a hole, as SEEK_DATA saw it at the start, is taken to be zeroes without a read). in_fd and
 * out_fd stay open; st (may be NULL) is filled even on failure, with what was seen so far.
 *
 * Returns 0; or -1 with a client-safe reason in why (a stream this filter does not
 * understand, a read/write error): the caller then falls back to an unfiltered stream, and
 * out_fd holds a partial stream to discard. On any failure but a read error it still reads
 * in_fd to EOF (so a writer on a pipe never blocks). why (may be NULL) gets a NUL-terminated
 * message of at most why_len - 1 bytes.
 */
int sp_migdelta_filter(int in_fd, int out_fd, const char *base_path, const char *block,
                       sp_migdelta_stats_t *st, char *why, size_t why_len);

/*
 * A live source for sp_migdelta_filter_live: the process whose RAM block is being migrated,
 * read through /proc. Its block is a private (copy-on-write) map of a file holding the
 * base's bytes, so a page the kernel has not copied for it still holds the base's bytes.
 */
typedef struct sp_migdelta_live {
    int mem_fd;     /* /proc/<pid>/mem, open for reading */
    int pagemap_fd; /* /proc/<pid>/pagemap, open for reading */
    uint64_t addr;  /* where the block's byte 0 is mapped in that process (page-aligned) */
    uint64_t len;   /* how many bytes from there are that map (the file from offset 0) */
} sp_migdelta_live_t;

/*
 * Fills *lv for process pid, whose map of the file (dev, ino) from offset 0 must be private
 * and cover len bytes without a gap (one or more adjacent maps of it, as /proc/<pid>/maps
 * shows them). Needs the right to read the process's memory (root, or its owner where
 * ptrace allows). Returns 0, or -1 with why set and nothing left open.
 */
int sp_migdelta_live_open(int pid, uint64_t dev, uint64_t ino, uint64_t len, sp_migdelta_live_t *lv,
                          char *why, size_t why_len);
void sp_migdelta_live_close(sp_migdelta_live_t *lv);

/*
 * sp_migdelta_filter for the migration of a running VM (pre-copy), whose pages QEMU may send
 * before their last write: the stream's own records of `block` are all dropped, however
 * recent, and where the RAM section's END begins (QEMU writes it only once the vCPUs are
 * stopped, and they stay stopped until the caller restarts them after this returns) a
 * record is written for every page of the block that lv's process has copied (its pagemap:
 * present and not a file page, or swapped out) and that differs from the base, read from
 * the process's memory. The result loads over the base as the VM's RAM was when it stopped,
 * whatever QEMU's own dirty tracking missed. A stream without an END for its RAM section
 * fails, as does a block longer than lv->len. lv's descriptors stay open.
 */
int sp_migdelta_filter_live(int in_fd, int out_fd, const char *base_path, const char *block,
                            const sp_migdelta_live_t *lv, sp_migdelta_stats_t *st, char *why,
                            size_t why_len);

/*
 * The inverse: reads a stream sp_migdelta_filter made against base_path (or any stream whose
 * RAM is to be loaded over that base) and writes one that loads into zeroed RAM the same as
 * the input loads over the base: the input byte for byte, except that right after the RAM
 * block list a record is written for every page of block `block` (below its used length): a
 * PAGE record with the base's bytes, or a ZERO record where they are all zeroes (holes and
 * bytes past the base's end are zeroes), so that the result is complete, as QEMU's own
 * streams are (it loads the same into RAM holding anything, and filters against any other
 * base). The input's own records follow and overwrite them on load. Refuses
 * what sp_migdelta_filter refuses, a stream without that block, and one that leaves shared
 * RAM out (x-ignore-shared). Same contract otherwise (st->base_pages counts the PAGE records
 * added).
 */
int sp_migdelta_expand(int in_fd, int out_fd, const char *base_path, const char *block,
                       sp_migdelta_stats_t *st, char *why, size_t why_len);

#endif
