/*
 * test_migdelta.c - the RAM delta filter on built streams and on real QEMU migrations.
 *
 * Synthetic streams follow the QEMU 7.2 savevm layout (see core/runtime/migdelta.c); the output is
 * decoded here by an independent reader that replays it onto the base image and checks
 * the block of every record. Broken streams (truncated, garbled, huge lengths, unknown
 * sections, XBZRLE ...) must fail cleanly, which the ASan build checks.
 *
 * The round trip runs qemu-system-x86_64 (microvm, TCG, vCPUs never started, no guest
 * kernel): migrate a VM whose RAM file is S, filter against base B, load the result into a
 * VM that maps B share=off, and compare the guest RAM with S; then expand the filtered
 * stream against B and load that into a VM over zeroed RAM, which must see S too; and migrate
 * a VM that loaded the delta through filter_live, which reads its pages from that QEMU's own
 * memory, and load that over B. Exits 77 after
 * the synthetic cases when QEMU is not installed.
 *
 * `test_core_migdelta --bench MIB` instead times the filter on a MIB-sized stream.
 */
#include <errno.h>
#include <fcntl.h>
#include <ftw.h>
#include <jansson.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "core/runtime/migdelta.h"
#include "tests/check.h"

#define PG 4096u

static char dir[] = "/tmp/test_migdelta_XXXXXX";

/* ---- byte buffers ---------------------------------------------------------------------- */

struct buf {
    uint8_t *p;
    size_t len, cap;
};

static void b_put(struct buf *b, const void *p, size_t n)
{
    if (b->len + n > b->cap) {
        size_t cap = b->cap ? b->cap : 4096;
        while (cap < b->len + n)
            cap *= 2;
        b->p = realloc(b->p, cap);
        if (b->p == NULL) {
            fprintf(stderr, "out of memory\n");
            exit(1);
        }
        b->cap = cap;
    }
    memcpy(b->p + b->len, p, n);
    b->len += n;
}

static void b_u8(struct buf *b, unsigned v)
{
    uint8_t c = (uint8_t)v;
    b_put(b, &c, 1);
}

static void b_be16(struct buf *b, unsigned v)
{
    b_u8(b, v >> 8);
    b_u8(b, v);
}

static void b_be32(struct buf *b, uint32_t v)
{
    b_be16(b, v >> 16);
    b_be16(b, v & 0xffff);
}

static void b_be64(struct buf *b, uint64_t v)
{
    b_be32(b, (uint32_t)(v >> 32));
    b_be32(b, (uint32_t)v);
}

static void b_str8(struct buf *b, const char *s)
{
    b_u8(b, (unsigned)strlen(s));
    b_put(b, s, strlen(s));
}

static uint32_t rd32(const uint8_t *p)
{
    return ((uint32_t)p[0] << 24) | ((uint32_t)p[1] << 16) | ((uint32_t)p[2] << 8) | p[3];
}

static uint64_t rd64(const uint8_t *p)
{
    return ((uint64_t)rd32(p) << 32) | rd32(p + 4);
}

static void path_in(char *out, size_t n, const char *name)
{
    snprintf(out, n, "%s/%s", dir, name);
}

static void write_file(const char *name, const void *p, size_t n)
{
    char path[256];
    path_in(path, sizeof path, name);
    int fd = open(path, O_WRONLY | O_CREAT | O_TRUNC, 0600);
    CHECK(fd >= 0);
    const uint8_t *c = p;
    while (n > 0) {
        ssize_t w = write(fd, c, n);
        if (w <= 0) {
            CHECK(!"write failed");
            break;
        }
        c += w;
        n -= (size_t)w;
    }
    close(fd);
}

static uint8_t *read_fd_all(int fd, size_t *n)
{
    struct buf b = {0};
    uint8_t tmp[65536];
    for (;;) {
        ssize_t r = read(fd, tmp, sizeof tmp);
        if (r < 0 && errno == EINTR)
            continue;
        if (r <= 0)
            break;
        b_put(&b, tmp, (size_t)r);
    }
    *n = b.len;
    return b.p;
}

/* ---- stream builder (QEMU 7.2 layout) -------------------------------------------------- */

#define F_ZERO     0x02
#define F_MEM_SIZE 0x04
#define F_PAGE     0x08
#define F_EOS      0x10
#define F_CONT     0x20
#define F_XBZRLE   0x40
#define F_HOOK     0x80
#define F_COMPRESS 0x100

struct gen {
    struct buf b;
    const char *last; /* block of the previous page record, for CONTINUE */
    uint32_t ram_id;
};

static void g_header(struct gen *g, bool subsections, bool ignore_shared)
{
    b_be32(&g->b, 0x5145564d);
    b_be32(&g->b, 3);
    b_u8(&g->b, 0x07);
    b_be32(&g->b, 7);
    b_put(&g->b, "microvm", 7);
    if (subsections) {
        b_u8(&g->b, 0x05);
        b_str8(&g->b, "configuration/target-page-bits");
        b_be32(&g->b, 1);
        b_be32(&g->b, 12);
    }
    if (ignore_shared) {
        b_u8(&g->b, 0x05);
        b_str8(&g->b, "configuration/capabilities");
        b_be32(&g->b, 1);
        b_be32(&g->b, 1);
        b_str8(&g->b, "x-ignore-shared");
    }
    if (subsections) {
        b_u8(&g->b, 0x05);
        b_str8(&g->b, "configuration/uuid");
        b_be32(&g->b, 1);
        for (int i = 0; i < 16; i++)
            b_u8(&g->b, (unsigned)(0xa0 + i));
    }
}

struct gblk {
    const char *name;
    uint64_t used;
};

/* START of the ram section with its block list, closed by EOS and the footer. */
static void g_ram_start(struct gen *g, const struct gblk *blks, int n, bool ignore_shared)
{
    g->ram_id = 2;
    b_u8(&g->b, 0x01);
    b_be32(&g->b, g->ram_id);
    b_str8(&g->b, "ram");
    b_be32(&g->b, 0);
    b_be32(&g->b, 4);
    uint64_t total = 0;
    for (int i = 0; i < n; i++)
        total += blks[i].used;
    b_be64(&g->b, total | F_MEM_SIZE);
    for (int i = 0; i < n; i++) {
        b_str8(&g->b, blks[i].name);
        b_be64(&g->b, blks[i].used);
        if (ignore_shared)
            b_be64(&g->b, 0x100000000ull * (uint64_t)i);
    }
    b_be64(&g->b, F_EOS);
    b_u8(&g->b, 0x7e);
    b_be32(&g->b, g->ram_id);
}

static void g_sec(struct gen *g, int type)
{
    b_u8(&g->b, (unsigned)type);
    b_be32(&g->b, g->ram_id);
}

static void g_sec_close(struct gen *g)
{
    b_be64(&g->b, F_EOS);
    b_u8(&g->b, 0x7e);
    b_be32(&g->b, g->ram_id);
}

/* A page record as QEMU writes it: CONTINUE when the previous record named the same block. */
static void g_rec(struct gen *g, const char *blk, uint64_t off, unsigned type, const uint8_t *page)
{
    bool cont = g->last != NULL && strcmp(g->last, blk) == 0;
    b_be64(&g->b, off | type | (cont ? F_CONT : 0));
    if (!cont)
        b_str8(&g->b, blk);
    if (type == F_PAGE)
        b_put(&g->b, page, PG);
    else
        b_u8(&g->b, page != NULL ? page[0] : 0);
    g->last = blk;
}

/* Device state (opaque bytes, deliberately containing section-like bytes), EOF, vmdesc. */
static void g_tail(struct gen *g)
{
    b_u8(&g->b, 0x04);
    b_be32(&g->b, 3);
    b_str8(&g->b, "timer");
    b_be32(&g->b, 0);
    b_be32(&g->b, 2);
    static const uint8_t dev[] = {0x01, 0x02, 0x7e, 0x00, 0x08, 0x10, 0xff, 0x20};
    b_put(&g->b, dev, sizeof dev);
    b_u8(&g->b, 0x7e);
    b_be32(&g->b, 3);
    b_u8(&g->b, 0x00);
    const char *js = "{\"page_size\":4096,\"devices\":[]}";
    b_u8(&g->b, 0x06);
    b_be32(&g->b, (uint32_t)strlen(js));
    b_put(&g->b, js, strlen(js));
}

/* ---- independent decoder: replays a stream's RAM records onto images ------------------- */

struct img {
    const char *name;
    uint8_t *mem;
    uint64_t size;
    uint64_t pages, zeros; /* records applied */
};

struct dec {
    struct img *imgs;
    int nimg;
    bool strict;     /* CONTINUE must be used exactly when the block repeats */
    size_t tail_off; /* offset of the first FULL/EOF byte */
    char err[160];
};

static int dfail(struct dec *d, const char *what, size_t at)
{
    snprintf(d->err, sizeof d->err, "%s at %zu", what, at);
    return -1;
}

static int decode(struct dec *d, const uint8_t *s, size_t n)
{
    size_t i = 0;
#define NEED(k)                                                                                    \
    do {                                                                                           \
        if (n - i < (size_t)(k))                                                                   \
            return dfail(d, "short", i);                                                           \
    } while (0)
    NEED(13);
    if (rd32(s) != 0x5145564d || rd32(s + 4) != 3 || s[8] != 0x07)
        return dfail(d, "header", 0);
    i = 13 + rd32(s + 9);
    bool ignore_shared = false;
    for (;;) {
        NEED(1);
        if (s[i] != 0x05)
            break;
        NEED(2);
        size_t nl = s[i + 1];
        NEED(2 + nl + 4);
        const char *nm = (const char *)s + i + 2;
        i += 2 + nl + 4;
        if (nl == 30 && memcmp(nm, "configuration/target-page-bits", nl) == 0) {
            i += 4;
        } else if (nl == 26 && memcmp(nm, "configuration/capabilities", nl) == 0) {
            NEED(4);
            uint32_t c = rd32(s + i);
            i += 4;
            for (uint32_t k = 0; k < c; k++) {
                NEED(1);
                if (s[i] == 15 && memcmp(s + i + 1, "x-ignore-shared", 15) == 0)
                    ignore_shared = true;
                i += 1 + s[i];
            }
        } else if (nl == 18 && memcmp(nm, "configuration/uuid", nl) == 0) {
            i += 16;
        } else {
            return dfail(d, "subsection", i);
        }
    }
    int prev = -2; /* -2: none yet; -1: a block without image */
    char prevname[256] = "";
    for (;;) {
        NEED(1);
        uint8_t t = s[i];
        if (t == 0x04 || t == 0x00) {
            d->tail_off = i;
            return 0;
        }
        if (t == 0x08) {
            NEED(5);
            i += 5 + (((size_t)s[i + 3] << 8) | s[i + 4]);
            continue;
        }
        if (t == 0x01) {
            NEED(6);
            i += 6 + s[i + 5] + 8;
        } else if (t == 0x02 || t == 0x03) {
            i += 5;
        } else {
            return dfail(d, "section type", i);
        }
        for (;;) {
            NEED(8);
            uint64_t w = rd64(s + i);
            unsigned fl = (unsigned)(w & 0xfff);
            uint64_t off = w & ~(uint64_t)0xfff;
            i += 8;
            if ((fl & ~F_CONT) == F_EOS)
                break;
            if ((fl & ~F_CONT) == F_MEM_SIZE) {
                uint64_t tot = off;
                while (tot > 0) {
                    NEED(1);
                    size_t nl = s[i];
                    NEED(1 + nl + 8);
                    uint64_t len = rd64(s + i + 1 + nl);
                    i += 1 + nl + 8 + (ignore_shared ? 8 : 0);
                    if (len > tot)
                        return dfail(d, "mem size", i);
                    tot -= len;
                }
                continue;
            }
            unsigned type = fl & ~F_CONT;
            if (type != F_ZERO && type != F_PAGE)
                return dfail(d, "record type", i);
            char name[256];
            if (fl & F_CONT) {
                if (prev == -2)
                    return dfail(d, "continue without block", i);
                strcpy(name, prevname);
            } else {
                NEED(1);
                size_t nl = s[i];
                NEED(1 + nl);
                memcpy(name, s + i + 1, nl);
                name[nl] = '\0';
                i += 1 + nl;
                if (d->strict && prev != -2 && strcmp(name, prevname) == 0)
                    return dfail(d, "block named again where CONTINUE fits", i);
            }
            int b = -1;
            for (int k = 0; k < d->nimg; k++)
                if (strcmp(d->imgs[k].name, name) == 0)
                    b = k;
            size_t plen = type == F_PAGE ? PG : 1;
            NEED(plen);
            if (b >= 0) {
                struct img *im = &d->imgs[b];
                if (off + PG > im->size)
                    return dfail(d, "offset beyond image", i);
                if (type == F_PAGE) {
                    memcpy(im->mem + off, s + i, PG);
                    im->pages++;
                } else {
                    memset(im->mem + off, s[i], PG);
                    im->zeros++;
                }
            }
            i += plen;
            prev = b;
            strcpy(prevname, name);
        }
        if (n - i >= 5 && s[i] == 0x7e)
            i += 5;
    }
#undef NEED
}

/* ---- running the filter ---------------------------------------------------------------- */

typedef int (*tool_fn)(int, int, const char *, const char *, sp_migdelta_stats_t *, char *, size_t);

static int run_tool(tool_fn fn, const uint8_t *in, size_t n, const char *base, const char *block,
                    struct buf *out, sp_migdelta_stats_t *st, char *why, size_t why_len);

/* Filters in[0..n) (through a file) against the base file `base`; output in *out. */
static int run_filter(const uint8_t *in, size_t n, const char *base, const char *block,
                      struct buf *out, sp_migdelta_stats_t *st, char *why, size_t why_len)
{
    return run_tool(sp_migdelta_filter, in, n, base, block, out, st, why, why_len);
}

/* The same through sp_migdelta_expand. */
static int run_expand(const uint8_t *in, size_t n, const char *base, const char *block,
                      struct buf *out, sp_migdelta_stats_t *st, char *why, size_t why_len)
{
    return run_tool(sp_migdelta_expand, in, n, base, block, out, st, why, why_len);
}

static int run_tool(tool_fn fn, const uint8_t *in, size_t n, const char *base, const char *block,
                    struct buf *out, sp_migdelta_stats_t *st, char *why, size_t why_len)
{
    char ip[256], op[256], bp[256];
    write_file("in.bin", in, n);
    path_in(ip, sizeof ip, "in.bin");
    path_in(op, sizeof op, "out.bin");
    path_in(bp, sizeof bp, base);
    int ifd = open(ip, O_RDONLY);
    int ofd = open(op, O_RDWR | O_CREAT | O_TRUNC, 0600);
    CHECK(ifd >= 0 && ofd >= 0);
    int rc = fn(ifd, ofd, bp, block, st, why, why_len);
    /* whatever happened, the input was read to its end */
    CHECK(lseek(ifd, 0, SEEK_CUR) == (off_t)n);
    CHECK(st->bytes_in == n);
    lseek(ofd, 0, SEEK_SET);
    out->len = 0;
    size_t on;
    uint8_t *o = read_fd_all(ofd, &on);
    if (on > 0)
        b_put(out, o, on);
    free(o);
    CHECK(st->bytes_out == on);
    close(ifd);
    close(ofd);
    return rc;
}

static void fill_page(uint8_t *p, unsigned seed)
{
    uint32_t x = seed * 2654435761u + 12345;
    for (unsigned i = 0; i < PG; i += 4) {
        x = x * 1103515245u + 12345;
        memcpy(p + i, &x, 4);
    }
}

/* ---- synthetic cases --------------------------------------------------------------------- */

#define NMEM 64 /* pages of block "mem" */
#define NROM 4  /* pages of block "rom" */

struct model {
    uint8_t base[NMEM * PG]; /* the base file holds BASE_LEN bytes of it */
    uint8_t src[NMEM * PG];  /* the source VM's "mem" */
    uint8_t rom[NROM * PG];
    uint8_t early5[PG]; /* page 5 as first sent; its later record holds the base's bytes */
};
#define BASE_LEN ((NMEM - 8) * PG + 1000) /* the last pages lie (partly) beyond the base */

static void model_init(struct model *m)
{
    memset(m, 0, sizeof *m);
    for (unsigned i = 0; i < NMEM; i++) {
        if (i % 3 != 0)
            fill_page(m->base + i * PG, i);
    }
    memset(m->base + BASE_LEN, 0, sizeof m->base - BASE_LEN);
    memcpy(m->src, m->base, sizeof m->src);
    fill_page(m->src + 4 * PG, 1004);  /* changed */
    fill_page(m->early5, 1005);        /* changed at first, then back to the base's bytes */
    memset(m->src + 7 * PG, 0, PG);    /* zeroed where the base has data */
    fill_page(m->src + 9 * PG, 1009);  /* set where the base is zero */
    m->src[20 * PG + 17] ^= 1;         /* one bit */
    fill_page(m->src + 60 * PG, 1060); /* beyond the base file */
    /* page 56 straddles the base's end: the file has 1000 bytes of it, zero after */
    for (unsigned i = 0; i < NROM; i++)
        fill_page(m->rom + i * PG, 5000 + i);
    write_file("base.ram", m->base, BASE_LEN);
}

static bool page_zero(const uint8_t *p)
{
    for (unsigned i = 0; i < PG; i++)
        if (p[i])
            return false;
    return true;
}

/* The stream a stopped VM would send: mem pages interleaved with rom pages, over 3 sections. */
static void model_stream(const struct model *m, struct gen *g, bool subs, bool ignore_shared)
{
    memset(g, 0, sizeof *g);
    g_header(g, subs, ignore_shared);
    if (subs) { /* what a source with a return path sends: OPEN_RETURN_PATH, PING 1 */
        b_u8(&g->b, 0x08);
        b_be16(&g->b, 1);
        b_be16(&g->b, 0);
        b_u8(&g->b, 0x08);
        b_be16(&g->b, 2);
        b_be16(&g->b, 4);
        b_be32(&g->b, 1);
    }
    struct gblk blks[] = {{"mem", NMEM * PG}, {"rom", NROM * PG}};
    g_ram_start(g, blks, 2, ignore_shared);
    g_sec(g, 0x02);
    for (unsigned i = 0; i < NMEM; i++) {
        const uint8_t *p = i == 5 ? m->early5 : m->src + i * PG;
        g_rec(g, "mem", (uint64_t)i * PG, page_zero(p) ? F_ZERO : F_PAGE, p);
        if (i == 30) { /* another block between runs of mem */
            g_rec(g, "rom", 0, F_PAGE, m->rom);
            g_rec(g, "rom", PG, F_PAGE, m->rom + PG);
        }
        if (i == 40) { /* close this section, continue in the next: CONTINUE crosses it */
            g_sec_close(g);
            g_sec(g, 0x02);
        }
    }
    g_rec(g, "rom", 2 * PG, F_PAGE, m->rom + 2 * PG);
    g_rec(g, "rom", 3 * PG, F_ZERO, NULL);
    g_sec_close(g);
    g_sec(g, 0x03);
    /* re-sent pages: 4 again (still changed), 2 (equal to the base: dropped), and 5 back at
     * the base's bytes: equal to the base, but its first record was kept, so this one must
     * be kept too or the load would leave the early bytes */
    g_rec(g, "mem", 4 * PG, F_PAGE, m->src + 4 * PG);
    g_rec(g, "mem", 2 * PG, F_PAGE, m->src + 2 * PG);
    g_rec(g, "mem", 5 * PG, F_PAGE, m->src + 5 * PG);
    g_sec_close(g);
    g_tail(g);
}

/* Replays s strictly onto the model's blocks: "mem" starting as init (NMEM pages), "rom" as
 * rom_fill bytes, both described in imgs[2] (their record counts after); *tail (may be NULL)
 * the offset where the device state starts. The decoder's status; its complaint printed. */
static uint8_t r_mem[NMEM * PG], r_rom[NROM * PG];
static int replay(const struct buf *s, const uint8_t *init, uint8_t rom_fill, struct img imgs[2],
                  size_t *tail)
{
    memcpy(r_mem, init, sizeof r_mem);
    memset(r_rom, rom_fill, sizeof r_rom);
    imgs[0] = (struct img){"mem", r_mem, sizeof r_mem, 0, 0};
    imgs[1] = (struct img){"rom", r_rom, sizeof r_rom, 0, 0};
    struct dec d = {.imgs = imgs, .nimg = 2, .strict = true};
    int rc = decode(&d, s->p, s->len);
    if (d.err[0])
        fprintf(stderr, "decode: %s\n", d.err);
    if (tail != NULL)
        *tail = d.tail_off;
    return rc;
}

static void test_migdelta_filters_equal_pages(bool subs, bool ignore_shared)
{
    static struct model m;
    model_init(&m);
    struct gen g;
    model_stream(&m, &g, subs, ignore_shared);

    struct buf out = {0};
    sp_migdelta_stats_t st;
    char why[160];
    int rc = run_filter(g.b.p, g.b.len, "base.ram", "mem", &out, &st, why, sizeof why);
    CHECK(rc == 0);
    if (rc != 0)
        fprintf(stderr, "filter: %s\n", why);

    /* expected from the model, not hard-coded */
    uint64_t pages_in = 0, zero_in = 0, pages_kept = 0, zero_kept = 0;
    for (unsigned i = 0; i < NMEM; i++) { /* the first pass */
        const uint8_t *p = i == 5 ? m.early5 : m.src + i * PG;
        bool z = page_zero(p), same = memcmp(p, m.base + i * PG, PG) == 0;
        (z ? &zero_in : &pages_in)[0]++;
        if (!same)
            (z ? &zero_kept : &pages_kept)[0]++;
    }
    pages_in += 3;   /* the re-sent pages 4, 2 and 5 */
    pages_kept += 2; /* 4 and 5 again: their first records were kept */
    CHECK(st.pages_in == pages_in && st.zero_in == zero_in);
    CHECK(st.pages_kept == pages_kept && st.zero_kept == zero_kept);
    CHECK(pages_kept == 7 && zero_kept == 1); /* the model's intent: 4 5 9 20 60, 4 5; 7 */
    CHECK(out.len < g.b.len / 4);
    CHECK(st.bytes_in == g.b.len && st.bytes_out == out.len);

    /* replay the output onto the base: the result is the source's RAM */
    struct img imgs[2];
    size_t tail = 0;
    CHECK(replay(&out, m.base, 0xcc, imgs, &tail) == 0);
    CHECK(memcmp(r_mem, m.src, sizeof r_mem) == 0);
    CHECK(memcmp(r_rom, m.rom, 3 * PG) == 0 && page_zero(r_rom + 3 * PG));
    CHECK(imgs[0].pages == pages_kept && imgs[0].zeros == zero_kept);
    CHECK(imgs[1].pages == 3 && imgs[1].zeros == 1); /* rom untouched by the filter */

    /* the header and configuration, and the device state onward, are copied byte for byte */
    struct img none[] = {{"-", NULL, 0, 0, 0}};
    struct dec din = {.imgs = none, .nimg = 0};
    CHECK(decode(&din, g.b.p, g.b.len) == 0);
    CHECK(g.b.len - din.tail_off == out.len - tail);
    CHECK(memcmp(g.b.p + din.tail_off, out.p + tail, out.len - tail) == 0);
    size_t hdr = 13 + 7;
    CHECK(memcmp(g.b.p, out.p, hdr) == 0);

    /* the unfiltered stream replays to the same RAM (the decoder itself is sound) */
    memcpy(r_mem, m.base, sizeof r_mem);
    struct dec du = {.imgs = imgs, .nimg = 2};
    CHECK(decode(&du, g.b.p, g.b.len) == 0 && memcmp(r_mem, m.src, sizeof r_mem) == 0);
    free(out.p);
    free(g.b.p);
}

/* filter_live through run_tool: the source it reads is tool_live. */
static const sp_migdelta_live_t *tool_live;
static int live_tool(int in, int out, const char *base, const char *block, sp_migdelta_stats_t *st,
                     char *why, size_t why_len)
{
    return sp_migdelta_filter_live(in, out, base, block, tool_live, st, why, why_len);
}

/* filter_live, with this process as the VM: its "mem" is a private map of the base file in
 * which the source's pages were written. The stream's own mem records (stale on purpose:
 * page 5's first bytes, and pages it never re-sends) are all dropped; what replays onto the
 * base is the map's content at the END, whatever the stream said. */
static void test_migdelta_live_reads_the_process(void)
{
    static struct model m;
    model_init(&m);
    write_file("lbase.ram", m.base, sizeof m.base); /* whole: a map past a file's end faults */
    char bp[256];
    path_in(bp, sizeof bp, "lbase.ram");
    int fd = open(bp, O_RDONLY);
    struct stat sb;
    CHECK(fd >= 0 && fstat(fd, &sb) == 0);
    uint8_t *map = mmap(NULL, sizeof m.base, PROT_READ | PROT_WRITE, MAP_PRIVATE, fd, 0);
    close(fd);
    CHECK(map != MAP_FAILED);
    if (map == MAP_FAILED)
        return;
    volatile uint8_t sink = 0;
    for (unsigned i = 0; i < NMEM; i++) /* every page present, as the file's */
        sink ^= map[i * PG];
    (void)sink;
    uint64_t want_pages = 0, want_zero = 0;
    for (unsigned i = 0; i < NMEM; i++) {
        if (memcmp(m.src + i * PG, m.base + i * PG, PG) == 0)
            continue;
        memcpy(map + i * PG, m.src + i * PG, PG);
        (page_zero(m.src + i * PG) ? &want_zero : &want_pages)[0]++;
    }
    memcpy(map + 2 * PG, m.base + 2 * PG, PG); /* copied, but equal to the base: left out */
    CHECK(want_pages == 4 && want_zero == 1);  /* the model's intent: 4 9 20 60; 7 */

    struct gen g;
    model_stream(&m, &g, true, false);
    sp_migdelta_live_t lv;
    char why[160];
    int rc = sp_migdelta_live_open((int)getpid(), sb.st_dev, sb.st_ino, sizeof m.base, &lv, why,
                                   sizeof why);
    CHECK(rc == 0);
    if (rc != 0) {
        fprintf(stderr, "live_open: %s\n", why);
        munmap(map, sizeof m.base);
        free(g.b.p);
        return;
    }
    CHECK(lv.addr == (uint64_t)(uintptr_t)map && lv.len == sizeof m.base);
    tool_live = &lv;
    struct buf out = {0};
    sp_migdelta_stats_t st;
    rc = run_tool(live_tool, g.b.p, g.b.len, "lbase.ram", "mem", &out, &st, why, sizeof why);
    CHECK(rc == 0);
    if (rc != 0)
        fprintf(stderr, "filter_live: %s\n", why);
    CHECK(st.pages_kept == want_pages && st.zero_kept == want_zero);
    CHECK(st.pages_in + st.zero_in == NMEM + 3); /* every mem record read, none kept */
    struct img imgs[2];
    CHECK(replay(&out, m.base, 0xcc, imgs, NULL) == 0);
    CHECK(memcmp(r_mem, m.src, sizeof r_mem) == 0);
    CHECK(imgs[0].pages == want_pages && imgs[0].zeros == want_zero);
    CHECK(memcmp(r_rom, m.rom, 3 * PG) == 0 && imgs[1].pages == 3); /* rom as sent */

    /* a write after the END was read is not in it: what the map held then is */
    map[9 * PG] ^= 0xff;
    CHECK(replay(&out, m.base, 0xcc, imgs, NULL) == 0 && r_mem[9 * PG] == m.src[9 * PG]);

    /* the stream's block is longer than the map: refused */
    sp_migdelta_live_t shortv = lv;
    shortv.len -= PG;
    tool_live = &shortv;
    CHECK(run_tool(live_tool, g.b.p, g.b.len, "lbase.ram", "mem", &out, &st, why, sizeof why) < 0);
    CHECK(strstr(why, "longer than") != NULL);

    /* a stream that never reaches its RAM section's END (the vCPUs were never stopped) */
    struct gen h;
    memset(&h, 0, sizeof h);
    g_header(&h, true, false);
    struct gblk blks[] = {{"mem", NMEM * PG}};
    g_ram_start(&h, blks, 1, false);
    g_sec(&h, 0x02);
    g_rec(&h, "mem", 0, F_PAGE, m.src);
    g_sec_close(&h);
    g_tail(&h);
    tool_live = &lv;
    CHECK(run_tool(live_tool, h.b.p, h.b.len, "lbase.ram", "mem", &out, &st, why, sizeof why) < 0);
    CHECK(strstr(why, "ends before") != NULL);
    tool_live = NULL;
    sp_migdelta_live_close(&lv);
    CHECK(lv.mem_fd == -1 && lv.pagemap_fd == -1);

    /* no private map of that file in the process: nothing opened */
    CHECK(sp_migdelta_live_open((int)getpid(), sb.st_dev, sb.st_ino + 1, PG, &lv, why, sizeof why) <
              0 &&
          lv.mem_fd == -1 && strstr(why, "no private map") != NULL);
    /* a map shorter than asked */
    CHECK(sp_migdelta_live_open((int)getpid(), sb.st_dev, sb.st_ino, sizeof m.base + PG, &lv, why,
                                sizeof why) < 0);
    munmap(map, sizeof m.base);
    free(out.p);
    free(h.b.p);
    free(g.b.p);
}

/* expand(filter(S, B), B) loads into zeroed RAM as S: the base's non-zero pages first, then
 * the delta's records; everything else byte for byte. */
static void test_migdelta_expand_restores_whole(void)
{
    static struct model m;
    model_init(&m);
    struct gen g;
    model_stream(&m, &g, true, false);
    struct buf delta = {0}, full = {0};
    sp_migdelta_stats_t st, xs;
    char why[160];
    CHECK(run_filter(g.b.p, g.b.len, "base.ram", "mem", &delta, &st, why, sizeof why) == 0);
    int rc = run_expand(delta.p, delta.len, "base.ram", "mem", &full, &xs, why, sizeof why);
    CHECK(rc == 0);
    if (rc != 0)
        fprintf(stderr, "expand: %s\n", why);
    uint64_t nonzero = 0; /* the base file's pages with a byte set (the last one partly) */
    for (unsigned i = 0; i < NMEM; i++)
        if ((size_t)i * PG < BASE_LEN && !page_zero(m.base + (size_t)i * PG))
            nonzero++;
    CHECK(nonzero > 0 && xs.base_pages == nonzero);
    CHECK(xs.bytes_in == delta.len && xs.bytes_out == full.len);

    /* complete: it loads the same into RAM holding anything (every page has a record) */
    static uint8_t junk[NMEM * PG], other[NMEM * PG];
    memset(junk, 0xee, sizeof junk);
    struct img imgs[2];
    size_t tail = 0;
    CHECK(replay(&full, junk, 0, imgs, &tail) == 0);
    CHECK(memcmp(r_mem, m.src, sizeof r_mem) == 0);
    CHECK(memcmp(r_rom, m.rom, 3 * PG) == 0 && page_zero(r_rom + 3 * PG));
    CHECK(imgs[0].pages == nonzero + st.pages_kept);
    CHECK(imgs[0].zeros == NMEM - nonzero + st.zero_kept);

    /* filtered again against another base (another worker's template RAM, with data where
     * this one has none): that delta over that base is the source's RAM too */
    for (unsigned i = 0; i < NMEM; i++)
        fill_page(other + (size_t)i * PG, 7000 + i);
    write_file("other.ram", other, sizeof other);
    struct buf again = {0};
    CHECK(run_filter(full.p, full.len, "other.ram", "mem", &again, &xs, why, sizeof why) == 0);
    CHECK(replay(&again, other, 0, imgs, NULL) == 0 && memcmp(r_mem, m.src, sizeof r_mem) == 0);
    free(again.p);

    /* the delta's tail (device state on) is the full stream's, byte for byte */
    struct img none[] = {{"-", NULL, 0, 0, 0}};
    struct dec dd = {.imgs = none, .nimg = 0};
    CHECK(decode(&dd, delta.p, delta.len) == 0);
    CHECK(full.len - tail == delta.len - dd.tail_off);
    CHECK(memcmp(full.p + tail, delta.p + dd.tail_off, full.len - tail) == 0);

    /* refused: a block the stream does not have; a stream that leaves shared RAM out */
    CHECK(run_expand(delta.p, delta.len, "base.ram", "nope", &full, &xs, why, sizeof why) < 0);
    CHECK(strstr(why, "no RAM block nope") != NULL);
    struct gen gs;
    model_stream(&m, &gs, true, true);
    CHECK(run_expand(gs.b.p, gs.b.len, "base.ram", "mem", &full, &xs, why, sizeof why) < 0);
    CHECK(strstr(why, "shared RAM") != NULL);
    free(gs.b.p);
    free(delta.p);
    free(full.p);
    free(g.b.p);
}

static void test_migdelta_other_block_untouched(void)
{
    static struct model m;
    model_init(&m);
    struct gen g;
    model_stream(&m, &g, false, false);
    struct buf out = {0};
    sp_migdelta_stats_t st;
    char why[160];
    /* a block the stream does not have: nothing is dropped, the stream comes out unchanged */
    CHECK(run_filter(g.b.p, g.b.len, "base.ram", "nosuch", &out, &st, why, sizeof why) == 0);
    CHECK(out.len == g.b.len && memcmp(out.p, g.b.p, out.len) == 0);
    CHECK(st.pages_in == 0 && st.pages_kept == 0);
    /* filtering "rom" against a base that differs keeps rom's pages and all of mem */
    CHECK(run_filter(g.b.p, g.b.len, "base.ram", "rom", &out, &st, why, sizeof why) == 0);
    CHECK(st.pages_in == 3 && st.zero_in == 1 && st.pages_kept == 3 && st.zero_kept == 0);
    /* an empty base: every zero page of mem goes, every data page stays */
    write_file("empty.ram", "", 0);
    CHECK(run_filter(g.b.p, g.b.len, "empty.ram", "mem", &out, &st, why, sizeof why) == 0);
    CHECK(st.zero_kept == 0 && st.pages_kept == st.pages_in);
    free(out.p);
    free(g.b.p);
}

/* Expects a clean failure (-1, input read to its end) whose reason contains want. */
static void expect_fail(const uint8_t *s, size_t n, const char *base, const char *want)
{
    struct buf out = {0};
    sp_migdelta_stats_t st;
    char why[160] = "x";
    int rc = run_filter(s, n, base, "mem", &out, &st, why, sizeof why);
    CHECK(rc == -1);
    CHECK(why[0] != '\0');
    if (want != NULL && strstr(why, want) == NULL) {
        fprintf(stderr, "reason \"%s\" lacks \"%s\"\n", why, want);
        failures++;
    }
    free(out.p);
}

/* A stream with the ram section started; the caller adds records and calls finish. */
static void start_min(struct gen *g)
{
    memset(g, 0, sizeof *g);
    g_header(g, false, false);
    struct gblk blks[] = {{"mem", NMEM * PG}};
    g_ram_start(g, blks, 1, false);
    g_sec(g, 0x02);
}

static void finish_min(struct gen *g)
{
    g_sec_close(g);
    g_tail(g);
}

/* Replays the filtered output and the whole stream each onto a copy of base (NMEM pages):
 * true when both decode and give the same RAM. *zeros: the ZERO records the output applied. */
static bool replays_alike(const uint8_t *base, const struct buf *out, const struct gen *g,
                          uint64_t *zeros)
{
    static uint8_t a[NMEM * PG], b[NMEM * PG];
    memcpy(a, base, sizeof a);
    memcpy(b, base, sizeof b);
    struct img ia[] = {{"mem", a, sizeof a, 0, 0}}, ib[] = {{"mem", b, sizeof b, 0, 0}};
    struct dec da = {.imgs = ia, .nimg = 1, .strict = true}, db = {.imgs = ib, .nimg = 1};
    bool ok = decode(&da, out->p, out->len) == 0 && decode(&db, g->b.p, g->b.len) == 0 &&
              memcmp(a, b, sizeof a) == 0;
    *zeros = ia[0].zeros;
    return ok;
}

/* ZERO records carry a fill byte (QEMU writes 0; the loader memsets any value): dropped only
 * where the whole base page holds that byte, counting bytes past the file's end as zero. */
static void test_migdelta_zero_fill_bytes(void)
{
    uint8_t base[2 * PG + PG / 2];
    memset(base, 0xab, PG);              /* page 0: all 0xab */
    memset(base + PG, 0, PG);            /* page 1: zero */
    memset(base + 2 * PG, 0xab, PG / 2); /* page 2: half 0xab, then the file ends */
    write_file("fill.ram", base, sizeof base);
    struct gen g;
    start_min(&g);
    static const struct {
        unsigned page, fill;
        bool kept;
    } recs[] = {{0, 0xab, false}, {1, 0xab, true}, {1, 0, true}, /* kept: page 1 was kept */
                {0, 0, true},     {2, 0xab, true}, {3, 0, false}, {5, 0x11, true}, {6, 0, false}};
    uint64_t want = 0;
    for (size_t i = 0; i < sizeof recs / sizeof recs[0]; i++) {
        uint8_t fill = (uint8_t)recs[i].fill;
        g_rec(&g, "mem", (uint64_t)recs[i].page * PG, F_ZERO, &fill);
        want += recs[i].kept;
    }
    finish_min(&g);
    struct buf out = {0};
    sp_migdelta_stats_t st;
    char why[160];
    CHECK(run_filter(g.b.p, g.b.len, "fill.ram", "mem", &out, &st, why, sizeof why) == 0);
    CHECK(st.zero_in == sizeof recs / sizeof recs[0] && st.zero_kept == want);
    /* replayed onto the base, the output gives what the whole stream gives */
    static uint8_t img[NMEM * PG];
    memcpy(img, base, sizeof base);
    uint64_t zeros;
    CHECK(replays_alike(img, &out, &g, &zeros));
    CHECK(zeros == want);
    free(out.p);
    free(g.b.p);
}

/* A sparse base (a template's RAM file keeps the guest's untouched pages as holes): a record
 * over a hole is compared with zeroes without reading the base's map, so the holes stay holes
 * (a fault on one allocates a page of zeroes in the file's page cache, as many as the guest
 * has untouched pages), and the result is what the whole stream gives all the same. Records
 * go back in offset too (a re-sent page), past the extent the search had reached. */
static void test_migdelta_sparse_base(void)
{
    char path[256];
    path_in(path, sizeof path, "sparse.ram");
    int fd = open(path, O_WRONLY | O_CREAT | O_TRUNC, 0600);
    REQUIRE(fd >= 0);
    REQUIRE(ftruncate(fd, NMEM * PG) == 0);
    static uint8_t data[PG];
    memset(data, 0x5a, PG);
    static const unsigned at[] = {2, 3, 40}; /* data pages; the rest holes */
    for (size_t i = 0; i < sizeof at / sizeof at[0]; i++)
        REQUIRE(pwrite(fd, data, PG, (off_t)at[i] * PG) == (ssize_t)PG);
    REQUIRE(fsync(fd) == 0); /* extents allocated: SEEK_DATA sees them on every file system */
    close(fd);
    static uint8_t zero[PG], other[PG];
    memset(other, 0x77, PG);
    static const struct {
        unsigned page;
        int type; /* F_ZERO (fill) or F_PAGE (content) */
        const uint8_t *content;
        uint8_t fill;
        bool kept;
    } recs[] = {
        {0, F_ZERO, NULL, 0, false},    {1, F_PAGE, zero, 0, false},  /* holes, zero */
        {2, F_PAGE, data, 0, false},    {3, F_ZERO, NULL, 0, true},   /* data pages */
        {10, F_ZERO, NULL, 0x11, true}, {11, F_PAGE, other, 0, true}, /* holes, changed */
        {40, F_PAGE, data, 0, false},   {41, F_ZERO, NULL, 0, false},
        {2, F_PAGE, other, 0, true},    {12, F_ZERO, NULL, 0, false}, /* back, then on */
        {63, F_PAGE, other, 0, true},
    };
    struct gen g;
    start_min(&g);
    uint64_t want = 0;
    for (size_t i = 0; i < sizeof recs / sizeof recs[0]; i++) {
        uint8_t fill = recs[i].fill;
        g_rec(&g, "mem", (uint64_t)recs[i].page * PG, (unsigned)recs[i].type,
              recs[i].type == F_ZERO ? &fill : recs[i].content);
        want += recs[i].kept;
    }
    finish_min(&g);
    struct buf out = {0};
    sp_migdelta_stats_t st;
    char why[160];
    CHECK(run_filter(g.b.p, g.b.len, "sparse.ram", "mem", &out, &st, why, sizeof why) == 0);
    CHECK(st.pages_kept + st.zero_kept == want);
    /* replayed onto the base, the output gives what the whole stream gives */
    static uint8_t img[NMEM * PG];
    static bool is_data[NMEM];
    for (size_t i = 0; i < sizeof at / sizeof at[0]; i++) {
        memcpy(img + at[i] * PG, data, PG);
        is_data[at[i]] = true;
    }
    uint64_t zeros;
    CHECK(replays_alike(img, &out, &g, &zeros));
    /* the holes are holes still: none of their pages is in the file's page cache */
    fd = open(path, O_RDONLY);
    REQUIRE(fd >= 0);
    void *map = mmap(NULL, NMEM * PG, PROT_READ, MAP_SHARED, fd, 0);
    REQUIRE(map != MAP_FAILED);
    static unsigned char res[NMEM];
    REQUIRE(mincore(map, NMEM * PG, res) == 0);
    int cached = 0;
    for (unsigned i = 0; i < NMEM; i++)
        cached += !is_data[i] && (res[i] & 1);
    CHECK(cached == 0);
    if (cached != 0)
        fprintf(stderr, "sparse base: %d hole pages in the page cache\n", cached);
    munmap(map, NMEM * PG);
    close(fd);
    free(out.p);
    free(g.b.p);
}

static void test_migdelta_rejects_bad_streams(void)
{
    static struct model m;
    model_init(&m);
    struct gen g;
    uint8_t page[PG];
    fill_page(page, 77);

    /* garbage */
    uint8_t junk[20000];
    for (size_t i = 0; i < sizeof junk; i++)
        junk[i] = (uint8_t)(i * 7 + (i >> 5));
    expect_fail(junk, sizeof junk, "base.ram", "not a QEMU migration stream");
    expect_fail(junk, 0, "base.ram", "ends early");

    /* version 2 */
    start_min(&g);
    g.b.p[7] = 2;
    expect_fail(g.b.p, g.b.len, "base.ram", "version");
    free(g.b.p);

    /* huge machine-type length */
    start_min(&g);
    g.b.p[9] = 0xff;
    expect_fail(g.b.p, g.b.len, "base.ram", "machine type");
    free(g.b.p);

    /* XBZRLE, compressed, RDMA hook, flags 0, unknown combination */
    static const unsigned bad_flags[] = {F_XBZRLE, F_COMPRESS, F_HOOK, 0, F_PAGE | F_ZERO, 0x01};
    static const char *bad_why[] = {"XBZRLE", "compressed", "RDMA", "flags", "flags", "flags"};
    for (size_t k = 0; k < sizeof bad_flags / sizeof bad_flags[0]; k++) {
        start_min(&g);
        g_rec(&g, "mem", 0, F_PAGE, page);
        b_be64(&g.b, PG | bad_flags[k] | F_CONT);
        b_put(&g.b, page, PG);
        finish_min(&g);
        expect_fail(g.b.p, g.b.len, "base.ram", bad_why[k]);
        free(g.b.p);
    }

    /* CONTINUE before any block was named */
    start_min(&g);
    b_be64(&g.b, F_PAGE | F_CONT);
    b_put(&g.b, page, PG);
    finish_min(&g);
    expect_fail(g.b.p, g.b.len, "base.ram", "never named");
    free(g.b.p);

    /* a block that MEM_SIZE did not announce; a 255-byte name */
    start_min(&g);
    g_rec(&g, "other", 0, F_PAGE, page);
    finish_min(&g);
    expect_fail(g.b.p, g.b.len, "base.ram", "not announced");
    free(g.b.p);
    start_min(&g);
    b_be64(&g.b, F_PAGE);
    b_u8(&g.b, 255);
    for (int i = 0; i < 255; i++)
        b_u8(&g.b, 'a');
    b_put(&g.b, page, PG);
    finish_min(&g);
    expect_fail(g.b.p, g.b.len, "base.ram", "not announced");
    free(g.b.p);

    /* offsets past the block (and a near-2^64 one) */
    start_min(&g);
    g_rec(&g, "mem", (uint64_t)NMEM * PG, F_PAGE, page);
    finish_min(&g);
    expect_fail(g.b.p, g.b.len, "base.ram", "beyond the end");
    free(g.b.p);
    start_min(&g);
    g_rec(&g, "mem", ~(uint64_t)0xfff, F_ZERO, NULL);
    finish_min(&g);
    expect_fail(g.b.p, g.b.len, "base.ram", "beyond the end");
    free(g.b.p);

    /* MEM_SIZE: a block longer than the total; a 2^50-byte block; a second list */
    {
        struct gen h = {0};
        g_header(&h, false, false);
        b_u8(&h.b, 0x01);
        b_be32(&h.b, 2);
        b_str8(&h.b, "ram");
        b_be32(&h.b, 0);
        b_be32(&h.b, 4);
        b_be64(&h.b, (uint64_t)PG | F_MEM_SIZE);
        b_str8(&h.b, "mem");
        b_be64(&h.b, 2 * PG);
        b_be64(&h.b, F_EOS);
        expect_fail(h.b.p, h.b.len, "base.ram", "block length");
        h.b.len = 13 + 7;
        b_u8(&h.b, 0x01);
        b_be32(&h.b, 2);
        b_str8(&h.b, "ram");
        b_be32(&h.b, 0);
        b_be32(&h.b, 4);
        b_be64(&h.b, ((uint64_t)1 << 50) | F_MEM_SIZE);
        b_str8(&h.b, "mem");
        b_be64(&h.b, (uint64_t)1 << 50);
        b_be64(&h.b, F_EOS);
        expect_fail(h.b.p, h.b.len, "base.ram", "block length");
        free(h.b.p);
    }
    start_min(&g);
    b_be64(&g.b, PG | F_MEM_SIZE);
    b_str8(&g.b, "x");
    b_be64(&g.b, PG);
    finish_min(&g);
    expect_fail(g.b.p, g.b.len, "base.ram", "twice");
    free(g.b.p);

    /* an iterative section other than ram (block migration); a PART of an unknown id */
    {
        struct gen h = {0};
        g_header(&h, false, false);
        b_u8(&h.b, 0x01);
        b_be32(&h.b, 5);
        b_str8(&h.b, "block");
        b_be32(&h.b, 0);
        b_be32(&h.b, 1);
        b_be64(&h.b, 0x02);
        expect_fail(h.b.p, h.b.len, "base.ram", "other than RAM");
        free(h.b.p);
    }
    start_min(&g);
    g_sec_close(&g);
    g.ram_id = 9;
    g_sec(&g, 0x02);
    finish_min(&g);
    expect_fail(g.b.p, g.b.len, "base.ram", "unknown section");
    free(g.b.p);

    /* unknown section type; a footer naming another section; postcopy advise */
    start_min(&g);
    g_sec_close(&g);
    b_u8(&g.b, 0x09);
    expect_fail(g.b.p, g.b.len, "base.ram", "section type 0x09");
    free(g.b.p);
    start_min(&g);
    b_be64(&g.b, F_EOS);
    b_u8(&g.b, 0x7e);
    b_be32(&g.b, 77);
    expect_fail(g.b.p, g.b.len, "base.ram", "footer");
    free(g.b.p);
    {
        struct gen h = {0};
        g_header(&h, false, false);
        b_u8(&h.b, 0x08);
        b_be16(&h.b, 3);
        b_be16(&h.b, 16);
        for (int i = 0; i < 16; i++)
            b_u8(&h.b, 0);
        expect_fail(h.b.p, h.b.len, "base.ram", "command 3");
        free(h.b.p);
    }

    /* unknown configuration subsection and capability; a 64 KiB target page */
    {
        struct gen h = {0};
        g_header(&h, false, false);
        b_u8(&h.b, 0x05);
        b_str8(&h.b, "configuration/new-thing");
        b_be32(&h.b, 1);
        expect_fail(h.b.p, h.b.len, "base.ram", "subsection");
        h.b.len = 13 + 7;
        b_u8(&h.b, 0x05);
        b_str8(&h.b, "configuration/capabilities");
        b_be32(&h.b, 1);
        b_be32(&h.b, 1);
        b_str8(&h.b, "mapped-ram");
        expect_fail(h.b.p, h.b.len, "base.ram", "capability");
        h.b.len = 13 + 7;
        b_u8(&h.b, 0x05);
        b_str8(&h.b, "configuration/capabilities");
        b_be32(&h.b, 1);
        b_be32(&h.b, 0xffffffff);
        expect_fail(h.b.p, h.b.len, "base.ram", "capabilities");
        h.b.len = 13 + 7;
        b_u8(&h.b, 0x05);
        b_str8(&h.b, "configuration/target-page-bits");
        b_be32(&h.b, 1);
        b_be32(&h.b, 16);
        expect_fail(h.b.p, h.b.len, "base.ram", "page size");
        free(h.b.p);
    }

    /* no base file */
    model_stream(&m, &g, false, false);
    expect_fail(g.b.p, g.b.len, "nosuch.ram", "base RAM image");

    /* truncation: anywhere before the device state fails; inside it, the rest is copied */
    struct img none[] = {{"-", NULL, 0, 0, 0}};
    struct dec din = {.imgs = none, .nimg = 0};
    CHECK(decode(&din, g.b.p, g.b.len) == 0);
    int truncs = 0;
    for (size_t len = 0; len < g.b.len; len += len < 400 ? 1 : 173) {
        struct buf out = {0};
        sp_migdelta_stats_t st;
        char why[160];
        int rc = run_filter(g.b.p, len, "base.ram", "mem", &out, &st, why, sizeof why);
        CHECK(rc == (len <= din.tail_off ? -1 : 0));
        if (rc < 0)
            CHECK(strstr(why, "ends early") != NULL);
        truncs++;
        free(out.p);
    }
    CHECK(truncs > 400);

    free(g.b.p);

    /* random corruption of a valid stream dense in structure (ZERO records, sections, two
     * blocks): 0 or -1, never a crash, a hang or an overread (ASan) */
    memset(&g, 0, sizeof g);
    g_header(&g, true, false);
    struct gblk blks[] = {{"mem", NMEM * PG}, {"rom", NROM * PG}};
    g_ram_start(&g, blks, 2, false);
    g_sec(&g, 0x02);
    for (unsigned i = 0; i < 200; i++) {
        if (i % 9 == 4)
            g_rec(&g, "rom", (i % NROM) * PG, F_ZERO, NULL);
        else
            g_rec(&g, "mem", (i % NMEM) * PG, F_ZERO, NULL);
        if (i % 50 == 49) {
            g_sec_close(&g);
            g_sec(&g, 0x02);
        }
    }
    g_rec(&g, "mem", 9 * PG, F_PAGE, page);
    g_sec_close(&g);
    g_tail(&g);
    din.tail_off = 0;
    CHECK(decode(&din, g.b.p, g.b.len) == 0);
    uint32_t x = 12345;
    int fails = 0;
    uint8_t *copy = malloc(g.b.len);
    for (int round = 0; round < 600; round++) {
        memcpy(copy, g.b.p, g.b.len);
        for (int k = 0; k < 1 + round % 4; k++) {
            x = x * 1103515245u + 12345;
            size_t at = (x >> 8) % (din.tail_off + 1);
            x = x * 1103515245u + 12345;
            copy[at] = (uint8_t)(x >> 16);
        }
        struct buf out = {0};
        sp_migdelta_stats_t st;
        char why[160];
        if (run_filter(copy, g.b.len, "base.ram", "mem", &out, &st, why, sizeof why) < 0) {
            CHECK(why[0] != '\0');
            fails++;
        }
        free(out.p);
    }
    CHECK(fails > 100);
    printf("corruption: %d of 600 mutated streams refused\n", fails);
    free(copy);
    free(g.b.p);
}

struct pipe_writer {
    int fd;
    const uint8_t *p;
    size_t n, written;
};

static void *pipe_writer_run(void *arg)
{
    struct pipe_writer *w = arg;
    while (w->written < w->n) {
        ssize_t r = write(w->fd, w->p + w->written, w->n - w->written);
        if (r < 0 && errno == EINTR)
            continue;
        if (r <= 0)
            break;
        w->written += (size_t)r;
    }
    close(w->fd);
    return NULL;
}

/* A writer on a pipe is never left blocked: the filter reads to EOF even after it gave up. */
static void test_migdelta_drains_pipe_on_failure(void)
{
    size_t n = 8u << 20;
    uint8_t *s = calloc(1, n);
    memcpy(s, "QEVM\0\0\0\3\7\0\0\0\7microvm\1\0\0\0\2\5block", 32);
    int p[2];
    CHECK(pipe(p) == 0);
    struct pipe_writer w = {.fd = p[1], .p = s, .n = n};
    pthread_t t;
    CHECK(pthread_create(&t, NULL, pipe_writer_run, &w) == 0);
    char bp[256], op[256], why[160];
    path_in(bp, sizeof bp, "base.ram");
    path_in(op, sizeof op, "out.bin");
    int ofd = open(op, O_WRONLY | O_CREAT | O_TRUNC, 0600);
    sp_migdelta_stats_t st;
    CHECK(sp_migdelta_filter(p[0], ofd, bp, "mem", &st, why, sizeof why) == -1);
    pthread_join(t, NULL);
    CHECK(w.written == n && st.bytes_in == n);
    close(p[0]);
    close(ofd);
    free(s);
}

struct par {
    int in, out;
    const char *base;
    int rc;
    sp_migdelta_stats_t st;
};

static void *par_run(void *arg)
{
    struct par *p = arg;
    char why[160];
    p->rc = sp_migdelta_filter(p->in, p->out, p->base, "mem", &p->st, why, sizeof why);
    return NULL;
}

/* Calls on several threads at once share nothing: each output equals a lone call's. */
static void test_migdelta_concurrent_calls(void)
{
    static struct model m;
    model_init(&m);
    struct gen g;
    model_stream(&m, &g, true, false);
    struct buf alone = {0};
    sp_migdelta_stats_t st;
    char why[160], bp[256];
    CHECK(run_filter(g.b.p, g.b.len, "base.ram", "mem", &alone, &st, why, sizeof why) == 0);
    path_in(bp, sizeof bp, "base.ram");
    enum { N = 4 };
    struct par ps[N];
    struct pipe_writer ws[N];
    pthread_t wt[N], ft[N];
    for (int i = 0; i < N; i++) {
        int p[2];
        CHECK(pipe(p) == 0);
        ws[i] = (struct pipe_writer){.fd = p[1], .p = g.b.p, .n = g.b.len};
        char op[64], path[256];
        snprintf(op, sizeof op, "par%d.bin", i);
        path_in(path, sizeof path, op);
        ps[i] = (struct par){
            .in = p[0], .out = open(path, O_RDWR | O_CREAT | O_TRUNC, 0600), .base = bp};
        CHECK(pthread_create(&wt[i], NULL, pipe_writer_run, &ws[i]) == 0);
        CHECK(pthread_create(&ft[i], NULL, par_run, &ps[i]) == 0);
    }
    for (int i = 0; i < N; i++) {
        pthread_join(wt[i], NULL);
        pthread_join(ft[i], NULL);
        CHECK(ps[i].rc == 0 && ps[i].st.pages_kept == st.pages_kept);
        lseek(ps[i].out, 0, SEEK_SET);
        size_t n;
        uint8_t *o = read_fd_all(ps[i].out, &n);
        CHECK(n == alone.len && memcmp(o, alone.p, n) == 0);
        free(o);
        close(ps[i].in);
        close(ps[i].out);
    }
    free(alone.p);
    free(g.b.p);
}

/* ---- real QEMU -------------------------------------------------------------------------- */

#define QEMU_BIN "qemu-system-x86_64"
#define MEM_MB   64
#define NPAGES   ((MEM_MB << 20) / PG)

static bool have_qemu(void)
{
    const char *path = getenv("PATH");
    if (path == NULL)
        return false;
    char *copy = strdup(path), *save = NULL;
    bool found = false;
    for (char *d = strtok_r(copy, ":", &save); d != NULL && !found;
         d = strtok_r(NULL, ":", &save)) {
        char p[512];
        snprintf(p, sizeof p, "%s/%s", d, QEMU_BIN);
        found = access(p, X_OK) == 0;
    }
    free(copy);
    return found;
}

struct vm {
    pid_t pid;
    int qmp;
    char rbuf[1 << 16];
    size_t rlen;
};

static pid_t spawn_qemu(const char *name, const char *mem_path, bool share, bool incoming)
{
    char sock[256], log[256], memobj[512];
    snprintf(sock, sizeof sock, "unix:%s/%s.sock,server=on,wait=off", dir, name);
    snprintf(log, sizeof log, "%s/%s.log", dir, name);
    snprintf(memobj, sizeof memobj, "memory-backend-file,id=mem,size=%dM,mem-path=%s,share=%s",
             MEM_MB, mem_path, share ? "on" : "off");
    char mb[16];
    snprintf(mb, sizeof mb, "%d", MEM_MB);
    const char *argv[] = {QEMU_BIN,
                          "-M",
                          "microvm,x-option-roms=off",
                          "-accel",
                          "tcg",
                          "-S",
                          "-nodefaults",
                          "-no-user-config",
                          "-nographic",
                          "-m",
                          mb,
                          "-object",
                          memobj,
                          "-machine",
                          "memory-backend=mem",
                          "-qmp",
                          sock,
                          incoming ? "-incoming" : NULL,
                          "defer",
                          NULL};
    pid_t pid = fork();
    if (pid == 0) {
        int fd = open(log, O_WRONLY | O_CREAT | O_TRUNC, 0600);
        if (fd >= 0) {
            dup2(fd, 1);
            dup2(fd, 2);
        }
        int nul = open("/dev/null", O_RDONLY);
        if (nul >= 0)
            dup2(nul, 0);
        execvp(QEMU_BIN, (char *const *)argv);
        _exit(127);
    }
    return pid;
}

/* One JSON line from QMP within timeout_ms; NULL on timeout/EOF. */
static json_t *qmp_line(struct vm *v, int timeout_ms)
{
    for (;;) {
        char *nl = memchr(v->rbuf, '\n', v->rlen);
        if (nl != NULL) {
            size_t len = (size_t)(nl - v->rbuf) + 1;
            json_t *j = json_loadb(v->rbuf, len, 0, NULL);
            memmove(v->rbuf, v->rbuf + len, v->rlen - len);
            v->rlen -= len;
            if (j != NULL)
                return j;
            continue;
        }
        struct pollfd pfd = {.fd = v->qmp, .events = POLLIN};
        if (v->rlen == sizeof v->rbuf || poll(&pfd, 1, timeout_ms) <= 0)
            return NULL;
        ssize_t r = read(v->qmp, v->rbuf + v->rlen, sizeof v->rbuf - v->rlen);
        if (r <= 0)
            return NULL;
        v->rlen += (size_t)r;
    }
}

/* Runs a command (args stolen), fd passed along when >= 0; the reply's "return" or NULL. */
static json_t *qmp(struct vm *v, const char *cmd, json_t *args, int fd)
{
    json_t *o = json_pack("{s:s}", "execute", cmd);
    if (args != NULL)
        json_object_set_new(o, "arguments", args);
    char *s = json_dumps(o, JSON_COMPACT);
    json_decref(o);
    size_t n = strlen(s);
    s = realloc(s, n + 2);
    s[n++] = '\n';
    struct iovec iov = {.iov_base = s, .iov_len = n};
    union {
        char buf[CMSG_SPACE(sizeof(int))];
        struct cmsghdr align;
    } u;
    struct msghdr mh = {.msg_iov = &iov, .msg_iovlen = 1};
    if (fd >= 0) {
        mh.msg_control = u.buf;
        mh.msg_controllen = sizeof u.buf;
        struct cmsghdr *c = CMSG_FIRSTHDR(&mh);
        c->cmsg_level = SOL_SOCKET;
        c->cmsg_type = SCM_RIGHTS;
        c->cmsg_len = CMSG_LEN(sizeof(int));
        memcpy(CMSG_DATA(c), &fd, sizeof fd);
    }
    ssize_t w = sendmsg(v->qmp, &mh, MSG_NOSIGNAL);
    free(s);
    if (w != (ssize_t)n)
        return NULL;
    for (;;) {
        json_t *j = qmp_line(v, 20000);
        if (j == NULL) {
            fprintf(stderr, "qmp %s: no reply\n", cmd);
            return NULL;
        }
        if (json_object_get(j, "event") != NULL) {
            json_decref(j);
            continue;
        }
        json_t *ret = json_incref(json_object_get(j, "return"));
        if (ret == NULL) {
            char *e = json_dumps(j, JSON_COMPACT);
            fprintf(stderr, "qmp %s: %s\n", cmd, e);
            free(e);
        }
        json_decref(j);
        return ret;
    }
}

static int vm_start(struct vm *v, const char *name, const char *mem_path, bool share, bool incoming)
{
    memset(v, 0, sizeof *v);
    v->qmp = -1;
    v->pid = spawn_qemu(name, mem_path, share, incoming);
    if (v->pid < 0)
        return -1;
    struct sockaddr_un sa = {.sun_family = AF_UNIX};
    snprintf(sa.sun_path, sizeof sa.sun_path, "%s/%s.sock", dir, name);
    for (int i = 0; i < 400; i++) { /* up to 20 s for QEMU to listen */
        int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
        if (connect(fd, (struct sockaddr *)&sa, sizeof sa) == 0) {
            v->qmp = fd;
            break;
        }
        close(fd);
        if (waitpid(v->pid, NULL, WNOHANG) == v->pid) {
            v->pid = -1;
            fprintf(stderr, "qemu %s exited at start (see its log)\n", name);
            return -1;
        }
        usleep(50000);
    }
    json_t *greet = v->qmp >= 0 ? qmp_line(v, 20000) : NULL;
    if (greet == NULL)
        return -1;
    json_decref(greet);
    json_t *r = qmp(v, "qmp_capabilities", NULL, -1);
    if (r == NULL)
        return -1;
    json_decref(r);
    return 0;
}

static void vm_stop(struct vm *v)
{
    if (v->qmp >= 0) {
        json_decref(qmp(v, "quit", NULL, -1));
        close(v->qmp);
        v->qmp = -1;
    }
    if (v->pid > 0) {
        for (int i = 0; i < 100 && waitpid(v->pid, NULL, WNOHANG) == 0; i++)
            usleep(20000);
        if (kill(v->pid, 0) == 0) {
            kill(v->pid, SIGKILL);
            waitpid(v->pid, NULL, 0);
        }
        v->pid = -1;
    }
}

/* Polls query-migrate until completed (0) or failed/time out (-1). */
static int wait_migration(struct vm *v)
{
    for (int i = 0; i < 600; i++) {
        json_t *r = qmp(v, "query-migrate", NULL, -1);
        const char *st = r != NULL ? json_string_value(json_object_get(r, "status")) : NULL;
        bool ok = st != NULL && strcmp(st, "completed") == 0;
        bool bad = st == NULL || strcmp(st, "failed") == 0 || strcmp(st, "cancelled") == 0;
        json_decref(r);
        if (ok || bad)
            return ok ? 0 : -1;
        usleep(20000);
    }
    return -1;
}

static int set_params(struct vm *v)
{
    json_t *r = qmp(v, "migrate-set-parameters",
                    json_pack("{s:I}", "max-bandwidth", (json_int_t)1 << 40), -1);
    json_decref(r);
    return r != NULL ? 0 : -1;
}

/* Starts an outgoing migration of v into a new pipe; returns its read end, or -1. */
static int migrate_to_pipe(struct vm *v)
{
    int p[2];
    if (pipe2(p, O_CLOEXEC) < 0 || set_params(v) < 0)
        return -1;
    json_t *r = qmp(v, "getfd", json_pack("{s:s}", "fdname", "mig"), p[1]);
    close(p[1]); /* QEMU holds its own copy and closes it when the migration ends */
    if (r == NULL) {
        close(p[0]);
        return -1;
    }
    json_decref(r);
    r = qmp(v, "migrate", json_pack("{s:s}", "uri", "fd:mig"), -1);
    if (r == NULL) {
        close(p[0]);
        return -1;
    }
    json_decref(r);
    return p[0];
}

/* Loads the stream file `stream` into a new VM on `base` (share=off); returns the VM. */
static int load_into(struct vm *v, const char *name, const char *base, const char *stream)
{
    if (vm_start(v, name, base, false, true) < 0)
        return -1;
    char sp[256];
    path_in(sp, sizeof sp, stream);
    int fd = open(sp, O_RDONLY | O_CLOEXEC);
    json_t *r = fd >= 0 ? qmp(v, "getfd", json_pack("{s:s}", "fdname", "in"), fd) : NULL;
    if (fd >= 0)
        close(fd);
    if (r == NULL)
        return -1;
    json_decref(r);
    r = qmp(v, "migrate-incoming", json_pack("{s:s}", "uri", "fd:in"), -1);
    if (r == NULL)
        return -1;
    json_decref(r);
    return wait_migration(v);
}

static uint8_t *load_file(const char *name, size_t *n)
{
    char p[256];
    path_in(p, sizeof p, name);
    int fd = open(p, O_RDONLY);
    if (fd < 0) {
        *n = 0;
        return NULL;
    }
    uint8_t *b = read_fd_all(fd, n);
    close(fd);
    return b;
}

static int pmemsave(struct vm *v, const char *name)
{
    char p[256];
    path_in(p, sizeof p, name);
    json_t *r =
        qmp(v, "pmemsave",
            json_pack("{s:i, s:I, s:s}", "val", 0, "size", (json_int_t)MEM_MB << 20, "filename", p),
            -1);
    json_decref(r);
    return r != NULL ? 0 : -1;
}

/* The whole "mem" block of v, read back through another (unfiltered) migration. */
static uint8_t *ram_by_migration(struct vm *v)
{
    int rfd = migrate_to_pipe(v);
    if (rfd < 0)
        return NULL;
    size_t n;
    uint8_t *s = read_fd_all(rfd, &n);
    close(rfd);
    if (wait_migration(v) < 0) {
        free(s);
        return NULL;
    }
    uint8_t *mem = calloc(1, (size_t)MEM_MB << 20);
    struct img imgs[] = {{"mem", mem, (uint64_t)MEM_MB << 20, 0, 0}};
    struct dec d = {.imgs = imgs, .nimg = 1};
    int rc = decode(&d, s, n);
    if (rc < 0)
        fprintf(stderr, "decode: %s\n", d.err);
    free(s);
    /* every page of the block comes in the first pass */
    if (rc < 0 || imgs[0].pages + imgs[0].zeros < NPAGES) {
        free(mem);
        return NULL;
    }
    return mem;
}

struct tee {
    int in, file, pipe;
    size_t n;
};

/* QEMU's stream goes both to a file (the unfiltered copy) and into the filter's pipe. */
static void *tee_run(void *arg)
{
    struct tee *t = arg;
    static uint8_t buf[1 << 16];
    for (;;) {
        ssize_t r = read(t->in, buf, sizeof buf);
        if (r < 0 && errno == EINTR)
            continue;
        if (r <= 0)
            break;
        t->n += (size_t)r;
        for (ssize_t o = 0, w; o < r; o += w)
            if ((w = write(t->file, buf + o, (size_t)(r - o))) <= 0)
                return NULL;
        for (ssize_t o = 0, w; o < r; o += w)
            if ((w = write(t->pipe, buf + o, (size_t)(r - o))) <= 0)
                return NULL;
    }
    close(t->pipe);
    return NULL;
}

/* Bytes where guest-physical memory shows the BIOS instead of RAM: microvm maps the last
 * 128 KiB (at most) of its firmware image, the "isa-bios" alias, just below 1 MiB and above
 * RAM; Debian's 64 KiB bios-microvm.bin covers 0xf0000-0xfffff. pmemsave reads that view. */
#define BIOS_LO 0xe0000u
#define BIOS_HI 0x100000u

static void test_migdelta_qemu_round_trip(void)
{
    size_t ram = (size_t)MEM_MB << 20;
    uint8_t *B = calloc(1, ram), *S;
    for (unsigned i = 0; i < NPAGES; i++)
        if (i % 7 == 0)
            fill_page(B + (size_t)i * PG, i);
    S = malloc(ram);
    memcpy(S, B, ram);
    for (unsigned i = 0; i < NPAGES; i++) {
        uint8_t *p = S + (size_t)i * PG;
        if (i % 7 == 0 && i % 211 == 0)
            memset(p, 0, PG); /* zeroed */
        else if (i % 7 == 0 && i % 97 == 3)
            p[i % PG] ^= 0x5a; /* one byte changed */
        else if (i % 7 != 0 && i % 173 == 5)
            fill_page(p, 100000 + i); /* set where B is zero */
    }
    fill_page(S + 0xe8000, 424242); /* a change under the BIOS window too */
    uint64_t want_pages = 0, want_zero = 0, want_pages_in = 0, want_zero_in = 0;
    for (unsigned i = 0; i < NPAGES; i++) {
        const uint8_t *s = S + (size_t)i * PG;
        bool z = page_zero(s);
        (z ? &want_zero_in : &want_pages_in)[0]++;
        if (memcmp(s, B + (size_t)i * PG, PG) != 0)
            (z ? &want_zero : &want_pages)[0]++;
    }
    write_file("B.ram", B, ram);
    write_file("S.ram", S, ram);
    char bpath[256], spath[256];
    path_in(bpath, sizeof bpath, "B.ram");
    path_in(spath, sizeof spath, "S.ram");

    struct vm src = {.pid = -1, .qmp = -1}, dst = {.pid = -1, .qmp = -1},
              raw = {.pid = -1, .qmp = -1};
    uint8_t *pm_src = NULL, *pm_dst = NULL, *pm_raw = NULL, *back = NULL;
    size_t n_src = 0, n_dst = 0, n_raw = 0;
    CHECK(vm_start(&src, "src", spath, true, false) == 0);
    CHECK(pmemsave(&src, "pm_src.bin") == 0);
    pm_src = load_file("pm_src.bin", &n_src);

    /* suspend: QEMU -> pipe -> tee (unfiltered copy) -> pipe -> filter -> filtered file */
    int rfd = migrate_to_pipe(&src);
    CHECK(rfd >= 0);
    char up[256], fp[256];
    path_in(up, sizeof up, "unfiltered.bin");
    path_in(fp, sizeof fp, "filtered.bin");
    int p[2] = {-1, -1};
    CHECK(pipe2(p, O_CLOEXEC) == 0);
    struct tee t = {.in = rfd, .file = open(up, O_WRONLY | O_CREAT | O_TRUNC, 0600), .pipe = p[1]};
    pthread_t th;
    CHECK(pthread_create(&th, NULL, tee_run, &t) == 0);
    int ffd = open(fp, O_WRONLY | O_CREAT | O_TRUNC, 0600);
    sp_migdelta_stats_t st;
    char why[160];
    int rc = sp_migdelta_filter(p[0], ffd, bpath, "mem", &st, why, sizeof why);
    pthread_join(th, NULL);
    close(p[0]);
    close(ffd);
    close(t.file);
    close(rfd);
    CHECK(rc == 0);
    if (rc != 0)
        fprintf(stderr, "filter: %s\n", why);
    CHECK(wait_migration(&src) == 0);
    vm_stop(&src);

    printf("qemu: unfiltered %zu bytes, filtered %llu bytes; pages in %llu kept %llu (want %llu), "
           "zero in %llu kept %llu (want %llu)\n",
           t.n, (unsigned long long)st.bytes_out, (unsigned long long)st.pages_in,
           (unsigned long long)st.pages_kept, (unsigned long long)want_pages,
           (unsigned long long)st.zero_in, (unsigned long long)st.zero_kept,
           (unsigned long long)want_zero);
    CHECK(st.bytes_in == t.n);
    CHECK(st.pages_kept == want_pages && st.zero_kept == want_zero);
    CHECK(st.pages_in == want_pages_in && st.zero_in == want_zero_in);
    CHECK(st.bytes_out * 8 < st.bytes_in);

    /* wake: a VM on B (share=off) loads the filtered stream */
    CHECK(load_into(&dst, "dst", bpath, "filtered.bin") == 0);
    CHECK(pmemsave(&dst, "pm_dst.bin") == 0);
    pm_dst = load_file("pm_dst.bin", &n_dst);
    CHECK(n_src == ram && n_dst == ram);
    if (n_src == ram && n_dst == ram) {
        CHECK(memcmp(pm_dst, pm_src, ram) == 0); /* the guest sees exactly what it saw before */
        CHECK(memcmp(pm_dst, S, BIOS_LO) == 0);
        CHECK(memcmp(pm_dst + BIOS_HI, S + BIOS_HI, ram - BIOS_HI) == 0);
    }
    /* the whole block, BIOS window included, read back by migrating the woken VM out */
    back = ram_by_migration(&dst);
    CHECK(back != NULL && memcmp(back, S, ram) == 0);
    vm_stop(&dst);
    free(back);

    /* live: a VM on B (share=off) that loaded the delta has copied exactly the pages the
     * loader wrote; filter_live drops every page QEMU sends and reads those from the QEMU
     * process at the END; the result loads over B as S */
    struct vm lsrc = {.pid = -1, .qmp = -1}, ldst = {.pid = -1, .qmp = -1};
    CHECK(load_into(&lsrc, "lsrc", bpath, "filtered.bin") == 0);
    struct stat bst;
    sp_migdelta_live_t lv;
    CHECK(stat(bpath, &bst) == 0);
    rc = sp_migdelta_live_open((int)lsrc.pid, bst.st_dev, bst.st_ino, ram, &lv, why, sizeof why);
    CHECK(rc == 0);
    if (rc != 0)
        fprintf(stderr, "live_open: %s\n", why);
    int lfd = rc == 0 ? migrate_to_pipe(&lsrc) : -1;
    char lp[256];
    path_in(lp, sizeof lp, "live.bin");
    int lout = open(lp, O_WRONLY | O_CREAT | O_TRUNC, 0600);
    sp_migdelta_stats_t ls;
    rc =
        lfd >= 0 ? sp_migdelta_filter_live(lfd, lout, bpath, "mem", &lv, &ls, why, sizeof why) : -1;
    if (lfd >= 0)
        close(lfd);
    close(lout);
    sp_migdelta_live_close(&lv);
    CHECK(rc == 0);
    if (rc != 0)
        fprintf(stderr, "filter_live: %s\n", why);
    CHECK(wait_migration(&lsrc) == 0);
    vm_stop(&lsrc);
    CHECK(ls.pages_kept == want_pages && ls.zero_kept == want_zero);
    CHECK(ls.pages_in + ls.zero_in >= NPAGES);
    CHECK(load_into(&ldst, "ldst", bpath, "live.bin") == 0);
    back = ram_by_migration(&ldst);
    CHECK(back != NULL && memcmp(back, S, ram) == 0);
    vm_stop(&ldst);
    free(back);

    /* sanity: the unfiltered stream loads the same way */
    CHECK(load_into(&raw, "raw", bpath, "unfiltered.bin") == 0);
    CHECK(pmemsave(&raw, "pm_raw.bin") == 0);
    pm_raw = load_file("pm_raw.bin", &n_raw);
    CHECK(n_raw == ram && pm_src != NULL && memcmp(pm_raw, pm_src, ram) == 0);
    back = ram_by_migration(&raw);
    CHECK(back != NULL && memcmp(back, S, ram) == 0);
    vm_stop(&raw);
    free(back);

    /* a whole stream again: the filtered one expanded against B loads into zeroed RAM (a
     * fresh file, as a worker without B restores a snapshot copied from the snapshot dir) */
    char ep[256], zp[256];
    path_in(ep, sizeof ep, "expanded.bin");
    path_in(zp, sizeof zp, "Z.ram");
    uint8_t *Z = calloc(1, ram);
    write_file("Z.ram", Z, ram);
    free(Z);
    int efd = open(fp, O_RDONLY), xfd = open(ep, O_WRONLY | O_CREAT | O_TRUNC, 0600);
    sp_migdelta_stats_t xs;
    rc = sp_migdelta_expand(efd, xfd, bpath, "mem", &xs, why, sizeof why);
    close(efd);
    close(xfd);
    CHECK(rc == 0);
    if (rc != 0)
        fprintf(stderr, "expand: %s\n", why);
    uint64_t want_base = 0;
    for (unsigned i = 0; i < NPAGES; i++)
        if (!page_zero(B + (size_t)i * PG))
            want_base++;
    CHECK(xs.base_pages == want_base);
    struct vm whole = {.pid = -1, .qmp = -1};
    uint8_t *pm_whole = NULL;
    size_t n_whole = 0;
    CHECK(load_into(&whole, "whole", zp, "expanded.bin") == 0);
    CHECK(pmemsave(&whole, "pm_whole.bin") == 0);
    pm_whole = load_file("pm_whole.bin", &n_whole);
    CHECK(n_whole == ram && pm_src != NULL && memcmp(pm_whole, pm_src, ram) == 0);
    back = ram_by_migration(&whole);
    CHECK(back != NULL && memcmp(back, S, ram) == 0);
    vm_stop(&whole);
    free(back);
    free(pm_whole);

    /* and that whole stream filtered against another base B2 (another worker's template RAM)
     * loads over B2 as S */
    uint8_t *B2 = calloc(1, ram);
    for (unsigned i = 0; i < NPAGES; i++)
        if (i % 5 == 1)
            fill_page(B2 + (size_t)i * PG, 900000 + i);
    write_file("B2.ram", B2, ram);
    free(B2);
    char b2path[256], dp2[256];
    path_in(b2path, sizeof b2path, "B2.ram");
    path_in(dp2, sizeof dp2, "other-delta.bin");
    efd = open(ep, O_RDONLY);
    xfd = open(dp2, O_WRONLY | O_CREAT | O_TRUNC, 0600);
    rc = sp_migdelta_filter(efd, xfd, b2path, "mem", &xs, why, sizeof why);
    close(efd);
    close(xfd);
    CHECK(rc == 0);
    struct vm other = {.pid = -1, .qmp = -1};
    CHECK(load_into(&other, "other", b2path, "other-delta.bin") == 0);
    back = ram_by_migration(&other);
    CHECK(back != NULL && memcmp(back, S, ram) == 0);
    vm_stop(&other);
    free(back);

    /* B was mapped share=off: untouched */
    size_t nb;
    uint8_t *b2 = load_file("B.ram", &nb);
    CHECK(nb == ram && memcmp(b2, B, ram) == 0);
    free(b2);
    free(pm_src);
    free(pm_dst);
    free(pm_raw);
    free(B);
    free(S);
}

/* ---- benchmark ------------------------------------------------------------------------- */

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
}

/* A MIB-sized "mem" block sent as PAGE records (the worst case: no ZERO records), 1 page in
 * 16 different from the base; timed from a pipe fed by a thread into a file. */
static int bench(unsigned mib)
{
    size_t ram = (size_t)mib << 20, npages = ram / PG;
    uint8_t *base = calloc(1, ram);
    if (mib == 0 || base == NULL)
        return 1;
    for (size_t i = 0; i < npages; i++)
        fill_page(base + i * PG, (unsigned)i);
    write_file("bench_base.ram", base, ram);
    struct gen g;
    memset(&g, 0, sizeof g);
    g_header(&g, false, false);
    struct gblk blks[] = {{"mem", ram}};
    g_ram_start(&g, blks, 1, false);
    g_sec(&g, 0x03);
    uint8_t page[PG];
    for (size_t i = 0; i < npages; i++) {
        const uint8_t *p = base + i * PG;
        if (i % 16 == 5) {
            memcpy(page, p, PG);
            page[100] ^= 1;
            p = page;
        }
        g_rec(&g, "mem", (uint64_t)i * PG, F_PAGE, p);
    }
    g_sec_close(&g);
    g_tail(&g);
    free(base);

    char bp[256], op[256], why[160];
    path_in(bp, sizeof bp, "bench_base.ram");
    path_in(op, sizeof op, "bench_out.bin");
    double best = 1e9;
    for (int round = 0; round < 4; round++) {
        bool cold = round == 3; /* last: the base file dropped from the page cache first */
        if (cold) {
            int bfd = open(bp, O_RDONLY);
            if (bfd < 0 || fdatasync(bfd) < 0 || posix_fadvise(bfd, 0, 0, POSIX_FADV_DONTNEED) != 0)
                fprintf(stderr, "bench: cannot drop the base from the page cache\n");
            if (bfd >= 0)
                close(bfd);
        }
        int p[2];
        if (pipe(p) < 0)
            return 1;
        struct pipe_writer w = {.fd = p[1], .p = g.b.p, .n = g.b.len};
        int ofd = open(op, O_WRONLY | O_CREAT | O_TRUNC, 0600);
        sp_migdelta_stats_t st;
        double t0 = now_s();
        pthread_t t;
        pthread_create(&t, NULL, pipe_writer_run, &w);
        int rc = sp_migdelta_filter(p[0], ofd, bp, "mem", &st, why, sizeof why);
        pthread_join(t, NULL);
        double dt = now_s() - t0;
        close(p[0]);
        close(ofd);
        if (rc != 0) {
            fprintf(stderr, "bench: %s\n", why);
            return 1;
        }
        if (dt < best && !cold)
            best = dt;
        printf("bench %u MiB%s: stream %zu bytes -> %llu bytes (%llu of %llu pages kept) in "
               "%.3f s = %.0f MB/s\n",
               mib, cold ? " (base not cached)" : "", g.b.len, (unsigned long long)st.bytes_out,
               (unsigned long long)st.pages_kept, (unsigned long long)st.pages_in, dt,
               (double)g.b.len / dt / 1e6);
    }
    printf("bench %u MiB best with the base cached: %.0f MB/s\n", mib,
           (double)g.b.len / best / 1e6);
    free(g.b.p);
    return 0;
}

static int rm_one(const char *path, const struct stat *sb, int flag, struct FTW *ftw)
{
    return remove(path);
}

static void rm_dir(void)
{
    if (getenv("SP_TEST_KEEP") != NULL) {
        fprintf(stderr, "kept %s\n", dir);
        return;
    }
    if (nftw(dir, rm_one, 16, FTW_DEPTH | FTW_PHYS) != 0)
        fprintf(stderr, "could not remove %s\n", dir);
}

int main(int argc, char **argv)
{
    signal(SIGPIPE, SIG_IGN);
    if (mkdtemp(dir) == NULL) {
        perror("mkdtemp");
        return 1;
    }
    if (argc == 3 && strcmp(argv[1], "--bench") == 0) {
        int rc = bench((unsigned)atoi(argv[2]));
        rm_dir();
        return rc;
    }
    test_migdelta_filters_equal_pages(false, false);
    test_migdelta_filters_equal_pages(true, true);
    test_migdelta_other_block_untouched();
    test_migdelta_expand_restores_whole();
    test_migdelta_zero_fill_bytes();
    test_migdelta_sparse_base();
    test_migdelta_rejects_bad_streams();
    test_migdelta_drains_pipe_on_failure();
    test_migdelta_concurrent_calls();
    test_migdelta_live_reads_the_process();
    if (failures) {
        rm_dir();
        fprintf(stderr, "%d check(s) failed\n", failures);
        return 1;
    }
    if (!have_qemu()) {
        rm_dir();
        printf("migdelta: synthetic ok; %s not found, round trip skipped\n", QEMU_BIN);
        return 77;
    }
    test_migdelta_qemu_round_trip();
    rm_dir();
    return check_report("migdelta");
}
