/*
 * migdelta.c - drop the guest RAM pages of a migration stream that a base image already has,
 * or (expand) add them back.
 *
 * Owns one call's state (read and write buffers, the read-only map of the base file and the
 * list of its data extents, the RAM block table and a bitmap of kept pages); nothing outlives
 * the call. A page over one of the base's holes is compared with zeroes, not read from the
 * map. Parses only what QEMU 7.2 writes before the device state of a precopy migration:
 *
 *   be32 "QEVM", be32 3
 *   0x07 configuration: be32 len + machine type; then subsections 0x05, u8 len + name,
 *        be32 version, fields (target-page-bits: be32; capabilities: be32 count, each u8 len
 *        + name; uuid: 16 bytes). No terminator: the next byte is a section type.
 *   0x01 START: be32 section id, u8 len + idstr, be32 instance, be32 version, payload
 *   0x02 PART / 0x03 END: be32 section id, payload
 *   0x7e + be32 section id: footer after each section (on for machine types without
 *        compatibility settings, e.g. microvm; read when present, checked against the id)
 *   0x08 command: be16 command, be16 len, data (only OPEN_RETURN_PATH and PING pass)
 *   0x04 FULL (device state) or 0x00 EOF: from here the rest is copied unread.
 *
 * The "ram" payload (version 4) is a list of records, each opened by a be64 word whose low
 * 12 bits are flags and the rest the page offset in its block: MEM_SIZE (total bytes; then
 * per block u8 len + idstr, be64 used length, and a be64 guest address when x-ignore-shared
 * is on), ZERO (+ fill byte), PAGE (+ 4096 bytes), EOS (ends the payload). ZERO and PAGE
 * name their block (u8 len + idstr) unless CONTINUE says "same block as the record before";
 * the loader remembers that block across sections, and so do both ends here.
 *
 * filter_live (a running VM's pre-copy) drops all of the block's records QEMU sends and, at
 * the RAM section's END, writes the block's pages from the process itself: those its pagemap
 * shows copied, read through /proc/<pid>/mem, less those equal to the base.
 *
 * Never trusts a length: every field is read through need(), which fails on a short
 * stream; names are at most 255 bytes, page records fit the read buffer, block lengths and
 * counts are capped. Each loop turn consumes input, so a garbled stream ends in an error.
 */
#include "core/runtime/migdelta.h"

#include <errno.h>
#include <fcntl.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/sysmacros.h>
#include <unistd.h>

#include "core/runtime/procmaps.h"

#define MD_MAGIC   0x5145564dU
#define MD_VERSION 3

#define SEC_EOF     0x00
#define SEC_START   0x01
#define SEC_PART    0x02
#define SEC_END     0x03
#define SEC_FULL    0x04
#define SEC_SUB     0x05
#define SEC_CONFIG  0x07
#define SEC_COMMAND 0x08
#define SEC_FOOTER  0x7e

#define CMD_OPEN_RETURN_PATH 1
#define CMD_PING             2

#define RAM_ZERO     0x02
#define RAM_MEM_SIZE 0x04
#define RAM_PAGE     0x08
#define RAM_EOS      0x10
#define RAM_CONTINUE 0x20
#define RAM_XBZRLE   0x40
#define RAM_HOOK     0x80
#define RAM_COMPRESS 0x100

#define PAGE_SIZE_MD 4096 /* x86 TARGET_PAGE_SIZE; the stream says otherwise only via a */
#define PAGE_BITS_MD 12   /* target-page-bits subsection, which is refused unless 12 */
#define FLAG_MASK    ((uint64_t)PAGE_SIZE_MD - 1)

#define RD_CAP      (1u << 20) /* holds any single record (at most 8 + 1 + 255 + 4096) */
#define WR_CAP      (1u << 20)
#define MAX_BLOCKS  256
#define MAX_BLOCK   ((uint64_t)1 << 40) /* 1 TiB: bounds the kept-page bitmap (32 MiB) */
#define MAX_MACHINE 1024                /* machine type name length */
#define MAX_CAPS    64
#define EXT_MAX     (1u << 16) /* base data extents tracked (a template's RAM has dozens) */
#define RAM_VERSION 4

struct blk {
    uint8_t len;
    char name[256];
    uint64_t used; /* used_length from MEM_SIZE: records must lie below it */
};

struct md {
    int in_fd, out_fd;
    uint8_t *rbuf;
    size_t rpos, rend;
    bool eof, rerr, failed;
    uint8_t *wbuf;
    size_t wlen;

    const uint8_t *base;
    size_t base_size;
    /* The base's data extents, [start, end) in order (SEEK_DATA/SEEK_HOLE); what lies
     * between them reads as zeroes. NULL: all of it is taken as data. Comparing against a
     * hole reads nothing of the map: a fault on a hole of a file's map allocates a page of
     * zeroes in its page cache, 100,000s of them for a large guest's untouched RAM. */
    uint64_t (*ext)[2];
    size_t next, ext_cur;
    const char *target;
    size_t target_len;

    struct blk *blocks;
    int nblocks;
    bool have_sizes;
    int filt;       /* index of the filtered block, -1 while unknown or absent */
    uint64_t *kept; /* one bit per page of the filtered block: a record of it was kept */
    int in_cur;     /* block of the previous input ZERO/PAGE record, -1 none */
    int out_cur;    /* block of the previous emitted ZERO/PAGE record, -1 none */
    bool ignore_shared;
    bool expand; /* sp_migdelta_expand: nothing dropped, the base's pages added */
    int exp;     /* expand: index of the target block, -1 while unknown or absent */
    bool ram_started, ram_ended;
    uint32_t ram_id;
    const sp_migdelta_live_t *live; /* filter_live: the block's pages come from there */
    bool live_done;                 /* and were written, at the RAM section's END */

    sp_migdelta_stats_t *st;
    char *why;
    size_t why_len;
};

static const uint8_t zero_page[PAGE_SIZE_MD];

__attribute__((format(printf, 2, 3))) static int fail(struct md *m, const char *fmt, ...)
{
    if (m->failed)
        return -1;
    m->failed = true;
    if (m->why != NULL && m->why_len > 0) {
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(m->why, m->why_len, fmt, ap);
        va_end(ap);
    }
    return -1;
}

static uint16_t be16(const uint8_t *p)
{
    return (uint16_t)((p[0] << 8) | p[1]);
}

static uint32_t be32(const uint8_t *p)
{
    return ((uint32_t)p[0] << 24) | ((uint32_t)p[1] << 16) | ((uint32_t)p[2] << 8) | p[3];
}

static uint64_t be64(const uint8_t *p)
{
    return ((uint64_t)be32(p) << 32) | be32(p + 4);
}

static void put_be64(uint8_t *p, uint64_t v)
{
    for (int i = 7; i >= 0; i--) {
        p[i] = (uint8_t)v;
        v >>= 8;
    }
}

/* Makes n bytes (n <= RD_CAP) available at rbuf + rpos; -1 on a short stream or read error. */
static int need(struct md *m, size_t n)
{
    if (m->rend - m->rpos >= n)
        return 0;
    if (m->rpos > 0) {
        memmove(m->rbuf, m->rbuf + m->rpos, m->rend - m->rpos);
        m->rend -= m->rpos;
        m->rpos = 0;
    }
    while (m->rend < n) {
        if (m->eof)
            return fail(m, "the migration stream ends early");
        ssize_t r = read(m->in_fd, m->rbuf + m->rend, RD_CAP - m->rend);
        if (r < 0 && errno == EINTR)
            continue;
        if (r < 0) {
            m->rerr = true;
            return fail(m, "cannot read the migration stream (errno %d)", errno);
        }
        if (r == 0)
            m->eof = true;
        m->rend += (size_t)r;
        m->st->bytes_in += (uint64_t)r;
    }
    return 0;
}

static int write_all(struct md *m, const uint8_t *p, size_t n)
{
    while (n > 0) {
        ssize_t w = write(m->out_fd, p, n);
        if (w < 0 && errno == EINTR)
            continue;
        if (w <= 0)
            return fail(m, "cannot write the filtered stream (errno %d)", w < 0 ? errno : 0);
        p += w;
        n -= (size_t)w;
        m->st->bytes_out += (uint64_t)w;
    }
    return 0;
}

static int flush(struct md *m)
{
    size_t n = m->wlen;
    m->wlen = 0;
    return write_all(m, m->wbuf, n);
}

static int out(struct md *m, const void *p, size_t n)
{
    if (m->wlen + n > WR_CAP && flush(m) < 0)
        return -1;
    if (n >= WR_CAP)
        return write_all(m, p, n);
    memcpy(m->wbuf + m->wlen, p, n);
    m->wlen += n;
    return 0;
}

/* Copies the next n input bytes to the output; returns them (valid until the next need()). */
static const uint8_t *take(struct md *m, size_t n)
{
    if (need(m, n) < 0)
        return NULL;
    const uint8_t *p = m->rbuf + m->rpos;
    if (out(m, p, n) < 0)
        return NULL;
    m->rpos += n;
    return p;
}

/* Everything left, unread: device state and the JSON description that follows it. */
static int copy_rest(struct md *m)
{
    if (out(m, m->rbuf + m->rpos, m->rend - m->rpos) < 0 || flush(m) < 0)
        return -1;
    m->rpos = m->rend = 0;
    while (!m->eof) {
        ssize_t r = read(m->in_fd, m->rbuf, RD_CAP);
        if (r < 0 && errno == EINTR)
            continue;
        if (r < 0) {
            m->rerr = true;
            return fail(m, "cannot read the migration stream (errno %d)", errno);
        }
        if (r == 0) {
            m->eof = true;
            break;
        }
        m->st->bytes_in += (uint64_t)r;
        if (write_all(m, m->rbuf, (size_t)r) < 0)
            return -1;
    }
    return 0;
}

/* After a failure: read to EOF so a writer on a pipe finishes (or fails) instead of blocking. */
static void drain(struct md *m)
{
    while (!m->eof && !m->rerr) {
        ssize_t r = read(m->in_fd, m->rbuf, RD_CAP);
        if (r < 0 && errno == EINTR)
            continue;
        if (r < 0)
            m->rerr = true;
        else if (r == 0)
            m->eof = true;
        else
            m->st->bytes_in += (uint64_t)r;
    }
}

static bool name_is(const uint8_t *p, size_t len, const char *s)
{
    return strlen(s) == len && memcmp(p, s, len) == 0;
}

static int parse_config(struct md *m)
{
    const uint8_t *p = take(m, 5); /* type byte + be32 name length */
    if (p == NULL)
        return -1;
    if (p[0] != SEC_CONFIG)
        return fail(m, "the migration stream has no configuration section");
    uint32_t len = be32(p + 1);
    if (len == 0 || len > MAX_MACHINE)
        return fail(m, "bad machine type length in the migration stream");
    if (take(m, len) == NULL)
        return -1;
    for (;;) {
        if (need(m, 1) < 0)
            return -1;
        if (m->rbuf[m->rpos] != SEC_SUB)
            return 0;
        if (need(m, 2) < 0)
            return -1;
        size_t nlen = m->rbuf[m->rpos + 1];
        if ((p = take(m, 2 + nlen + 4)) == NULL)
            return -1;
        const uint8_t *name = p + 2;
        if (be32(p + 2 + nlen) != 1)
            return fail(m, "unknown configuration subsection version");
        if (name_is(name, nlen, "configuration/target-page-bits")) {
            if ((p = take(m, 4)) == NULL)
                return -1;
            if (be32(p) != PAGE_BITS_MD)
                return fail(m, "target page size is not 4 KiB");
        } else if (name_is(name, nlen, "configuration/capabilities")) {
            if ((p = take(m, 4)) == NULL)
                return -1;
            uint32_t n = be32(p);
            if (n > MAX_CAPS)
                return fail(m, "too many capabilities in the migration stream");
            for (uint32_t i = 0; i < n; i++) {
                if (need(m, 1) < 0)
                    return -1;
                size_t clen = m->rbuf[m->rpos];
                if ((p = take(m, 1 + clen)) == NULL)
                    return -1;
                if (name_is(p + 1, clen, "x-ignore-shared"))
                    m->ignore_shared = true;
                else
                    return fail(m, "unsupported migration capability in the stream");
            }
        } else if (name_is(name, nlen, "configuration/uuid")) {
            if (take(m, 16) == NULL)
                return -1;
        } else {
            return fail(m, "unknown configuration subsection in the migration stream");
        }
    }
}

/* MEM_SIZE: the word (already taken) carries the total; entries follow until it is used up. */
static int parse_mem_size(struct md *m, uint64_t total)
{
    if (m->have_sizes)
        return fail(m, "RAM block list sent twice");
    m->have_sizes = true;
    while (total > 0) {
        if (need(m, 1) < 0)
            return -1;
        size_t nlen = m->rbuf[m->rpos];
        size_t extra = m->ignore_shared ? 8 : 0;
        const uint8_t *p = take(m, 1 + nlen + 8 + extra);
        if (p == NULL)
            return -1;
        uint64_t used = be64(p + 1 + nlen);
        if (nlen == 0)
            return fail(m, "RAM block without a name");
        if (used == 0 || used > total || used > MAX_BLOCK)
            return fail(m, "bad RAM block length in the migration stream");
        if (m->nblocks == MAX_BLOCKS)
            return fail(m, "too many RAM blocks in the migration stream");
        for (int i = 0; i < m->nblocks; i++)
            if (m->blocks[i].len == nlen && memcmp(m->blocks[i].name, p + 1, nlen) == 0)
                return fail(m, "RAM block listed twice");
        struct blk *b = &m->blocks[m->nblocks];
        b->len = (uint8_t)nlen;
        memcpy(b->name, p + 1, nlen);
        b->name[nlen] = '\0';
        b->used = used;
        if (nlen == m->target_len && memcmp(b->name, m->target, nlen) == 0 && m->expand) {
            m->exp = m->nblocks;
        } else if (nlen == m->target_len && memcmp(b->name, m->target, nlen) == 0) {
            uint64_t pages = (used + PAGE_SIZE_MD - 1) >> PAGE_BITS_MD;
            m->kept = calloc((size_t)((pages + 63) / 64), sizeof(uint64_t));
            if (m->kept == NULL)
                return fail(m, "out of memory");
            m->filt = m->nblocks;
        }
        m->nblocks++;
        total -= used;
    }
    return 0;
}

/* Whether the base page at off lies wholly in a hole (reads as zeroes). Records come mostly
 * in order of offset: the search goes on from the extent the last one ended at. */
static bool base_hole(struct md *m, uint64_t off)
{
    if (m->ext == NULL)
        return false;
    size_t i = m->ext_cur;
    if (i >= m->next || (i > 0 && off < m->ext[i - 1][1]))
        i = 0; /* behind the cursor: from the start */
    while (i < m->next && m->ext[i][1] <= off)
        i++;
    m->ext_cur = i;
    /* the first extent ending after off: the page is in a hole unless it reaches into it */
    return i == m->next || m->ext[i][0] >= off + PAGE_SIZE_MD;
}

/* Whether the 4 KiB at off of the base (zero past its end) equal page. */
static bool base_equals(struct md *m, uint64_t off, const uint8_t *page)
{
    size_t have = 0;
    if (base_hole(m, off))
        return memcmp(page, zero_page, PAGE_SIZE_MD) == 0;
    if (off < m->base_size) {
        have = m->base_size - off < PAGE_SIZE_MD ? (size_t)(m->base_size - off) : PAGE_SIZE_MD;
        if (memcmp(page, m->base + off, have) != 0)
            return false;
    }
    return memcmp(page + have, zero_page, PAGE_SIZE_MD - have) == 0;
}

/* Whether every byte of the base page at off (zero past its end) is ch. */
static bool base_filled(struct md *m, uint64_t off, uint8_t ch)
{
    size_t have = 0;
    if (base_hole(m, off))
        return ch == 0;
    if (off < m->base_size) {
        have = m->base_size - off < PAGE_SIZE_MD ? (size_t)(m->base_size - off) : PAGE_SIZE_MD;
        const uint8_t *b = m->base + off;
        /* all bytes equal b[0], and b[0] is ch */
        if (b[0] != ch || memcmp(b, b + 1, have - 1) != 0)
            return false;
    }
    return have == PAGE_SIZE_MD || ch == 0;
}

/* Writes a ZERO (data: its fill byte) or PAGE record of block b, naming the block unless
 * the previous record written was of the same block. */
static int put_rec(struct md *m, int b, uint64_t off, unsigned rec, const uint8_t *data)
{
    const struct blk *bk = &m->blocks[b];
    uint8_t hdr[9];
    bool cont = m->out_cur == b;
    put_be64(hdr, off | rec | (cont ? RAM_CONTINUE : 0));
    hdr[8] = bk->len;
    if (out(m, hdr, cont ? 8 : 9) < 0 || (!cont && out(m, bk->name, bk->len) < 0) ||
        out(m, data, rec == RAM_PAGE ? PAGE_SIZE_MD : 1) < 0)
        return -1;
    m->out_cur = b;
    return 0;
}

/* One ZERO or PAGE record; w is its first word, not yet consumed. */
static int ram_record(struct md *m, uint64_t w, unsigned rec)
{
    uint64_t off = w & ~FLAG_MASK;
    size_t hlen = 8;
    int b;
    if (w & RAM_CONTINUE) {
        if (m->in_cur < 0)
            return fail(m, "RAM record continues a block that was never named");
        b = m->in_cur;
    } else {
        if (need(m, 9) < 0)
            return -1;
        size_t nlen = m->rbuf[m->rpos + 8];
        if (need(m, 9 + nlen) < 0)
            return -1;
        const uint8_t *name = m->rbuf + m->rpos + 9;
        for (b = 0; b < m->nblocks; b++)
            if (m->blocks[b].len == nlen && memcmp(m->blocks[b].name, name, nlen) == 0)
                break;
        if (b == m->nblocks)
            return fail(m, "RAM record names a block that was not announced");
        hlen = 9 + nlen;
    }
    const struct blk *bk = &m->blocks[b];
    if (off >= bk->used)
        return fail(m, "RAM record beyond the end of its block");
    size_t plen = rec == RAM_PAGE ? PAGE_SIZE_MD : 1;
    if (need(m, hlen + plen) < 0)
        return -1;
    const uint8_t *data = m->rbuf + m->rpos + hlen;
    m->in_cur = b;

    if (b == m->filt && m->live != NULL) { /* its pages come from the process at the end */
        (rec == RAM_PAGE ? &m->st->pages_in : &m->st->zero_in)[0]++;
        m->rpos += hlen + plen;
        return 0;
    }
    if (b == m->filt) {
        uint64_t idx = off >> PAGE_BITS_MD;
        uint64_t bit = (uint64_t)1 << (idx & 63);
        bool kept_before = (m->kept[idx / 64] & bit) != 0;
        bool same;
        if (rec == RAM_PAGE) {
            m->st->pages_in++;
            same = !kept_before && base_equals(m, off, data);
        } else {
            m->st->zero_in++;
            same = !kept_before && base_filled(m, off, data[0]);
        }
        if (same) {
            m->rpos += hlen + plen;
            return 0;
        }
        m->kept[idx / 64] |= bit;
        if (rec == RAM_PAGE)
            m->st->pages_kept++;
        else
            m->st->zero_kept++;
    }

    if (put_rec(m, b, off, rec, data) < 0)
        return -1;
    m->rpos += hlen + plen;
    return 0;
}

/* expand: a record for every page of the target block, in order of offset, right after the
 * block list (the input's records follow): PAGE with the base's bytes where they are not all
 * zeroes, else ZERO. Every page, as QEMU's own first pass sends them: a page the stream left
 * out would keep whatever RAM it is loaded into held, and a filter against another base
 * (whose page there is not zero) would keep nothing for it either. */
static int emit_base(struct md *m)
{
    if (m->exp < 0)
        return fail(m, "the migration stream has no RAM block %s", m->target);
    if (m->ignore_shared)
        return fail(m, "the migration stream leaves shared RAM out");
    const struct blk *bk = &m->blocks[m->exp];
    uint8_t page[PAGE_SIZE_MD];
    for (uint64_t off = 0; off < bk->used; off += PAGE_SIZE_MD) {
        const uint8_t *p = NULL;
        if (off < m->base_size && !base_hole(m, off)) {
            size_t have =
                m->base_size - off < PAGE_SIZE_MD ? (size_t)(m->base_size - off) : PAGE_SIZE_MD;
            p = m->base + off;
            if (memcmp(p, zero_page, have) == 0) {
                p = NULL;
            } else if (have < PAGE_SIZE_MD) { /* the base's last bytes; zeroes after them */
                memcpy(page, p, have);
                memset(page + have, 0, PAGE_SIZE_MD - have);
                p = page;
            }
        }
        static const uint8_t fill = 0;
        if (put_rec(m, m->exp, off, p != NULL ? RAM_PAGE : RAM_ZERO, p != NULL ? p : &fill) < 0)
            return -1;
        if (p != NULL)
            m->st->base_pages++;
    }
    return 0;
}

/* Reads exactly n bytes at off of fd (a /proc file); false on a short read or an error. */
static bool pread_all(int fd, void *p, size_t n, uint64_t off)
{
    uint8_t *q = p;
    while (n > 0) {
        ssize_t r = pread(fd, q, n, (off_t)off);
        if (r < 0 && errno == EINTR)
            continue;
        if (r <= 0)
            return false;
        q += r;
        n -= (size_t)r;
        off += (uint64_t)r;
    }
    return true;
}

/* A pagemap entry for a page the process holds a copy of its own of: present and not a page
 * of the file, or swapped out (only anonymous pages are). */
static bool pm_copied(uint64_t e)
{
    bool present = (e >> 63) & 1, swapped = (e >> 62) & 1, file = (e >> 61) & 1;
    return (present && !file) || swapped;
}

#define LIVE_PM_BATCH 8192u /* pagemap entries read at a time (64 KiB) */
#define LIVE_RUN      256u  /* pages read from the process at a time (1 MiB) */

/* filter_live, at the RAM section's END (the vCPUs are stopped): a record for every page of
 * the block that the process has copied and that differs from the base. */
static int emit_live(struct md *m)
{
    const sp_migdelta_live_t *lv = m->live;
    if (m->filt < 0)
        return fail(m, "the migration stream has no RAM block %s", m->target);
    const struct blk *bk = &m->blocks[m->filt];
    if (bk->used > lv->len || (lv->addr & FLAG_MASK) != 0)
        return fail(m, "RAM block %s is longer than the process's map of it", m->target);
    uint64_t pages = bk->used >> PAGE_BITS_MD; /* a block is whole pages (MEM_SIZE) */
    uint64_t *pm = malloc(LIVE_PM_BATCH * sizeof *pm);
    uint8_t *buf = malloc((size_t)LIVE_RUN * PAGE_SIZE_MD);
    int rc = 0;
    if (pm == NULL || buf == NULL)
        rc = fail(m, "out of memory");
    for (uint64_t i = 0; rc == 0 && i < pages; i += LIVE_PM_BATCH) {
        size_t n = pages - i < LIVE_PM_BATCH ? (size_t)(pages - i) : LIVE_PM_BATCH;
        if (!pread_all(lv->pagemap_fd, pm, n * sizeof *pm,
                       ((lv->addr >> PAGE_BITS_MD) + i) * sizeof *pm)) {
            rc = fail(m, "cannot read the VM's page map (errno %d)", errno);
            break;
        }
        for (size_t j = 0; rc == 0 && j < n;) {
            if (!pm_copied(pm[j])) {
                j++;
                continue;
            }
            size_t k = j;
            while (k < n && k - j < LIVE_RUN && pm_copied(pm[k]))
                k++;
            uint64_t off = (i + j) << PAGE_BITS_MD;
            if (!pread_all(lv->mem_fd, buf, (k - j) * PAGE_SIZE_MD, lv->addr + off)) {
                rc = fail(m, "cannot read the VM's memory (errno %d)", errno);
                break;
            }
            for (size_t q = 0; rc == 0 && q < k - j; q++, off += PAGE_SIZE_MD) {
                const uint8_t *page = buf + q * PAGE_SIZE_MD;
                if (base_equals(m, off, page))
                    continue;
                bool zero = memcmp(page, zero_page, PAGE_SIZE_MD) == 0;
                rc = put_rec(m, m->filt, off, zero ? RAM_ZERO : RAM_PAGE, page);
                (zero ? &m->st->zero_kept : &m->st->pages_kept)[0]++;
            }
            j = k;
        }
    }
    free(pm);
    free(buf);
    m->live_done = rc == 0;
    return rc;
}

/* A ram section's payload, up to and including its EOS word. */
static int ram_payload(struct md *m)
{
    for (;;) {
        if (need(m, 8) < 0)
            return -1;
        uint64_t w = be64(m->rbuf + m->rpos);
        unsigned flags = (unsigned)(w & FLAG_MASK);
        unsigned rec = flags & ~(unsigned)RAM_CONTINUE;
        switch (rec) {
        case RAM_EOS:
            return take(m, 8) == NULL ? -1 : 0;
        case RAM_MEM_SIZE:
            if (take(m, 8) == NULL || parse_mem_size(m, w & ~FLAG_MASK) < 0 ||
                (m->expand && emit_base(m) < 0))
                return -1;
            break;
        case RAM_ZERO:
        case RAM_PAGE:
            if (ram_record(m, w, rec) < 0)
                return -1;
            break;
        default:
            if (flags & RAM_XBZRLE)
                return fail(m, "XBZRLE-encoded RAM is not supported");
            if (flags & RAM_COMPRESS)
                return fail(m, "compressed RAM is not supported");
            if (flags & RAM_HOOK)
                return fail(m, "RDMA RAM hooks are not supported");
            return fail(m, "unknown RAM record flags 0x%x", flags);
        }
    }
}

/* Optional footer: 0x7e + the section id. */
static int footer(struct md *m, uint32_t id)
{
    if (need(m, 1) < 0)
        return -1;
    if (m->rbuf[m->rpos] != SEC_FOOTER)
        return 0;
    const uint8_t *p = take(m, 5);
    if (p == NULL)
        return -1;
    if (be32(p + 1) != id)
        return fail(m, "section footer does not match its section");
    return 0;
}

static int parse(struct md *m)
{
    const uint8_t *p = take(m, 8);
    if (p == NULL)
        return -1;
    if (be32(p) != MD_MAGIC)
        return fail(m, "not a QEMU migration stream");
    if (be32(p + 4) != MD_VERSION)
        return fail(m, "unsupported migration stream version");
    if (parse_config(m) < 0)
        return -1;
    for (;;) {
        if (need(m, 1) < 0)
            return -1;
        uint8_t type = m->rbuf[m->rpos];
        switch (type) {
        case SEC_START: {
            if (need(m, 6) < 0)
                return -1;
            size_t ilen = m->rbuf[m->rpos + 5];
            if ((p = take(m, 6 + ilen + 8)) == NULL)
                return -1;
            if (!name_is(p + 6, ilen, "ram") || m->ram_started)
                return fail(m, "the migration stream has an iterative section other than RAM");
            if (be32(p + 6 + ilen + 4) != RAM_VERSION)
                return fail(m, "unsupported RAM section version");
            m->ram_started = true;
            m->ram_id = be32(p + 1);
            if (ram_payload(m) < 0 || footer(m, m->ram_id) < 0)
                return -1;
            break;
        }
        case SEC_PART:
        case SEC_END:
            if ((p = take(m, 5)) == NULL)
                return -1;
            if (!m->ram_started || m->ram_ended || be32(p + 1) != m->ram_id)
                return fail(m, "the migration stream continues an unknown section");
            if (type == SEC_END && m->live != NULL && emit_live(m) < 0)
                return -1;
            if (ram_payload(m) < 0 || footer(m, m->ram_id) < 0)
                return -1;
            m->ram_ended = type == SEC_END;
            break;
        case SEC_COMMAND: {
            if (need(m, 5) < 0)
                return -1;
            uint16_t cmd = be16(m->rbuf + m->rpos + 1);
            uint16_t len = be16(m->rbuf + m->rpos + 3);
            if (!(cmd == CMD_OPEN_RETURN_PATH && len == 0) && !(cmd == CMD_PING && len == 4))
                return fail(m, "unsupported migration command %u", cmd);
            if (take(m, 5 + (size_t)len) == NULL)
                return -1;
            break;
        }
        case SEC_FULL:
        case SEC_EOF:
            return copy_rest(m);
        default:
            return fail(m, "unknown section type 0x%02x in the migration stream", type);
        }
    }
}

/* m->ext from fd's data extents; left NULL (all data) when the file system cannot say or the
 * file has more than EXT_MAX of them. */
static void map_extents(struct md *m, int fd, uint64_t size)
{
    size_t cap = 64;
    m->ext = malloc(cap * sizeof *m->ext);
    off_t off = 0;
    while (m->ext != NULL && (uint64_t)off < size) {
        off_t data = lseek(fd, off, SEEK_DATA);
        if (data < 0 && errno == ENXIO)
            break; /* a hole to the end */
        off_t hole = data < 0 ? -1 : lseek(fd, data, SEEK_HOLE);
        if (hole <= data || m->next == EXT_MAX) {
            free(m->ext); /* cannot tell: compare against the map everywhere */
            m->ext = NULL;
            break;
        }
        if (m->next == cap) {
            void *v = realloc(m->ext, 2 * cap * sizeof *m->ext);
            if (v == NULL) {
                free(m->ext);
                m->ext = NULL;
                break;
            }
            m->ext = v;
            cap *= 2;
        }
        m->ext[m->next][0] = (uint64_t)data;
        m->ext[m->next][1] = (uint64_t)hole;
        m->next++;
        off = hole;
    }
}

static int map_base(struct md *m, const char *path)
{
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0)
        return fail(m, "cannot open the base RAM image");
    struct stat sb;
    if (fstat(fd, &sb) < 0 || !S_ISREG(sb.st_mode)) {
        close(fd);
        return fail(m, "the base RAM image is not a regular file");
    }
    if (sb.st_size > 0) {
        void *p = mmap(NULL, (size_t)sb.st_size, PROT_READ, MAP_SHARED, fd, 0);
        if (p == MAP_FAILED) {
            close(fd);
            return fail(m, "cannot map the base RAM image");
        }
        madvise(p, (size_t)sb.st_size, MADV_SEQUENTIAL); /* a hint; failure is harmless */
        m->base = p;
        m->base_size = (size_t)sb.st_size;
        map_extents(m, fd, (uint64_t)sb.st_size);
    }
    close(fd);
    return 0;
}

static int run(int in_fd, int out_fd, const char *base_path, const char *block,
               sp_migdelta_stats_t *st, char *why, size_t why_len, bool expand,
               const sp_migdelta_live_t *live)
{
    sp_migdelta_stats_t local;
    struct md m = {.in_fd = in_fd,
                   .out_fd = out_fd,
                   .expand = expand,
                   .exp = -1,
                   .filt = -1,
                   .in_cur = -1,
                   .out_cur = -1,
                   .live = live,
                   .st = st != NULL ? st : &local,
                   .why = why,
                   .why_len = why_len};
    memset(m.st, 0, sizeof *m.st);
    if (why != NULL && why_len > 0)
        why[0] = '\0';
    m.rbuf = malloc(RD_CAP);
    m.wbuf = malloc(WR_CAP);
    m.blocks = calloc(MAX_BLOCKS, sizeof *m.blocks);
    int rc;
    if (m.rbuf == NULL || m.wbuf == NULL || m.blocks == NULL) {
        rc = fail(&m, "out of memory");
    } else if (block == NULL || block[0] == '\0' || strlen(block) > 255 || base_path == NULL) {
        rc = fail(&m, "bad RAM block name or base image");
    } else {
        m.target = block;
        m.target_len = strlen(block);
        rc = map_base(&m, base_path);
        if (rc == 0)
            rc = parse(&m);
        if (rc == 0 && expand && !m.have_sizes)
            rc = fail(&m, "the migration stream has no RAM block list");
        if (rc == 0 && live != NULL && !m.live_done)
            rc = fail(&m, "the migration stream ends before its RAM section does");
        if (rc == 0)
            rc = flush(&m);
    }
    if (rc < 0 && m.rbuf != NULL)
        drain(&m);
    else if (rc < 0) /* no buffer for draining: a small one on the stack will do */
        for (char tmp[4096];;) {
            ssize_t r = read(in_fd, tmp, sizeof tmp);
            if (r == 0 || (r < 0 && errno != EINTR))
                break;
        }
    if (m.base != NULL)
        munmap((void *)m.base, m.base_size);
    free(m.ext);
    free(m.kept);
    free(m.blocks);
    free(m.wbuf);
    free(m.rbuf);
    return rc;
}

int sp_migdelta_filter(int in_fd, int out_fd, const char *base_path, const char *block,
                       sp_migdelta_stats_t *st, char *why, size_t why_len)
{
    return run(in_fd, out_fd, base_path, block, st, why, why_len, false, NULL);
}

int sp_migdelta_filter_live(int in_fd, int out_fd, const char *base_path, const char *block,
                            const sp_migdelta_live_t *lv, sp_migdelta_stats_t *st, char *why,
                            size_t why_len)
{
    return run(in_fd, out_fd, base_path, block, st, why, why_len, false, lv);
}

int sp_migdelta_expand(int in_fd, int out_fd, const char *base_path, const char *block,
                       sp_migdelta_stats_t *st, char *why, size_t why_len)
{
    return run(in_fd, out_fd, base_path, block, st, why, why_len, true, NULL);
}

void sp_migdelta_live_close(sp_migdelta_live_t *lv)
{
    if (lv->mem_fd >= 0)
        close(lv->mem_fd);
    if (lv->pagemap_fd >= 0)
        close(lv->pagemap_fd);
    lv->mem_fd = lv->pagemap_fd = -1;
}

static int live_why(char *why, size_t why_len, const char *msg)
{
    if (why != NULL && why_len > 0)
        snprintf(why, why_len, "%s", msg);
    return -1;
}

/* The private map of the RAM file (dev, ino) from its offset 0, followed while the maps
 * after it go on with the file where it left off (one map, or several the kernel split). */
struct ram_span {
    uint64_t dev, ino, len;
    uint64_t addr, covered;
    bool found;
};

static bool ram_span_at(const sp_procmap_t *m, void *arg)
{
    struct ram_span *r = arg;
    bool ours = m->ino == r->ino && (uint64_t)m->dev == r->dev && m->priv;
    if (!r->found && ours && m->off == 0) {
        r->found = true;
        r->addr = m->lo;
    } else if (r->found && !(ours && m->lo == r->addr + r->covered && m->off == r->covered)) {
        return true; /* a gap, or another map, before len bytes were seen */
    }
    if (r->found)
        r->covered = m->hi - r->addr;
    return r->found && r->covered >= r->len;
}

int sp_migdelta_live_open(int pid, uint64_t dev, uint64_t ino, uint64_t len, sp_migdelta_live_t *lv,
                          char *why, size_t why_len)
{
    *lv = (sp_migdelta_live_t){.mem_fd = -1, .pagemap_fd = -1};
    struct ram_span r = {.dev = dev, .ino = ino, .len = len};
    if (sp_procmaps_each(pid, ram_span_at, &r) < 0)
        return live_why(why, why_len, "cannot read the process's maps");
    if (!r.found || r.covered < len)
        return live_why(why, why_len, "the process has no private map of the RAM file");
    uint64_t addr = r.addr;
    char p[64];
    snprintf(p, sizeof p, "/proc/%d/mem", pid);
    lv->mem_fd = open(p, O_RDONLY | O_CLOEXEC);
    snprintf(p, sizeof p, "/proc/%d/pagemap", pid);
    lv->pagemap_fd = open(p, O_RDONLY | O_CLOEXEC);
    if (lv->mem_fd < 0 || lv->pagemap_fd < 0) {
        sp_migdelta_live_close(lv);
        return live_why(why, why_len, "cannot open the process's memory");
    }
    lv->addr = addr;
    lv->len = len;
    return 0;
}
