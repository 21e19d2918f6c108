/*
 * test_tarcheck.c - the upload checker for template files: tars made here member by member
 * (plain and gzip), the good ones accepted whole and byte by byte, each bad kind refused with
 * its member named.
 */
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <zlib.h>

#include "core/control/tarcheck.h"
#include "tests/check.h"

typedef struct {
    unsigned char *p;
    size_t n, cap;
} tbuf;

static void put(tbuf *b, const void *p, size_t n)
{
    if (b->n + n > b->cap) {
        b->cap = (b->n + n) * 2 + 4096;
        b->p = realloc(b->p, b->cap);
    }
    memcpy(b->p + b->n, p, n);
    b->n += n;
}

/* One member: a ustar header, then size bytes of data padded to 512. */
static void member(tbuf *b, const char *name, char type, const char *link, size_t size)
{
    unsigned char h[512] = {0};
    snprintf((char *)h, 100, "%s", name);
    snprintf((char *)h + 100, 8, "%07o", 0644);
    snprintf((char *)h + 108, 8, "%07o", 0);
    snprintf((char *)h + 116, 8, "%07o", 0);
    snprintf((char *)h + 124, 12, "%011o", (unsigned)(size & 07777777777));
    snprintf((char *)h + 136, 12, "%011o", 0);
    h[156] = (unsigned char)type;
    if (link != NULL)
        snprintf((char *)h + 157, 100, "%s", link);
    memcpy(h + 257, "ustar", 6);
    memcpy(h + 263, "00", 2);
    memset(h + 148, ' ', 8);
    unsigned sum = 0;
    for (int i = 0; i < 512; i++)
        sum += h[i];
    snprintf((char *)h + 148, 8, "%06o", sum);
    put(b, h, 512);
    unsigned char z[512] = {0};
    for (size_t left = size; left > 0;) {
        size_t k = left < 512 ? left : 512;
        memset(z, 'x', k);
        put(b, z, 512);
        left -= k;
    }
}

static void finish(tbuf *b)
{
    unsigned char z[1024] = {0};
    put(b, z, sizeof z);
}

static tbuf gzip(const tbuf *in)
{
    tbuf out = {0};
    z_stream z = {0};
    deflateInit2(&z, 6, Z_DEFLATED, 16 + MAX_WBITS, 8, Z_DEFAULT_STRATEGY);
    out.cap = deflateBound(&z, in->n) + 64;
    out.p = malloc(out.cap);
    z.next_in = in->p;
    z.avail_in = (uInt)in->n;
    z.next_out = out.p;
    z.avail_out = (uInt)out.cap;
    CHECK(deflate(&z, Z_FINISH) == Z_STREAM_END);
    out.n = out.cap - z.avail_out;
    deflateEnd(&z);
    return out;
}

/* 0 and *entries, or -1 with why. bytewise: fed one byte at a time. */
static int check(const tbuf *b, bool bytewise, uint64_t *entries, char *why)
{
    sp_tarcheck_t *t = sp_tarcheck_new(1u << 30);
    int rc = 0;
    if (bytewise) {
        for (size_t i = 0; i < b->n && rc == 0; i++)
            rc = sp_tarcheck_feed(t, b->p + i, 1, why, 256);
    } else {
        rc = sp_tarcheck_feed(t, b->p, b->n, why, 256);
    }
    if (rc == 0)
        rc = sp_tarcheck_end(t, entries, why, 256);
    sp_tarcheck_free(t);
    return rc;
}

static void test_good(void)
{
    tbuf b = {0};
    member(&b, "./", '5', NULL, 0);
    member(&b, "app/", '5', NULL, 0);
    member(&b, "app/main.py", '0', NULL, 700);
    member(&b, "app/link.py", '2', "main.py", 0);
    member(&b, "app/up", '2', "../app/main.py", 0);
    member(&b, "app/hard", '1', "./app/main.py", 0);
    member(&b, "empty", '0', NULL, 0);
    finish(&b);
    char why[256] = "";
    uint64_t n = 0;
    CHECK(check(&b, false, &n, why) == 0 && n == 7);
    CHECK(check(&b, true, &n, why) == 0 && n == 7);
    tbuf g = gzip(&b);
    CHECK(check(&g, false, &n, why) == 0 && n == 7);
    CHECK(check(&g, true, &n, why) == 0 && n == 7);
    /* gzip cut short, and a byte of it changed */
    tbuf cut = {g.p, g.n / 2, g.cap};
    CHECK(check(&cut, false, &n, why) < 0 && strstr(why, "gzip") != NULL);
    g.p[g.n / 2] ^= 0x55;
    CHECK(check(&g, false, &n, why) < 0);
    free(g.p);
    /* the plain tar cut inside a member */
    tbuf cut2 = {b.p, 512 * 4, b.cap};
    CHECK(check(&cut2, false, &n, why) < 0 && strstr(why, "middle") != NULL);
    /* a size limit below the tar */
    sp_tarcheck_t *t = sp_tarcheck_new(2048);
    CHECK(sp_tarcheck_feed(t, b.p, b.n, why, sizeof why) < 0 && strstr(why, "larger") != NULL);
    sp_tarcheck_free(t);
    free(b.p);
}

static void refused(const char *name, char type, const char *link, const char *want)
{
    tbuf b = {0};
    member(&b, "ok", '0', NULL, 3);
    member(&b, name, type, link, 0);
    finish(&b);
    char why[256] = "";
    uint64_t n;
    int rc = check(&b, false, &n, why);
    if (rc == 0 || strstr(why, want) == NULL)
        fprintf(stderr, "member %s type %c: rc %d why '%s' (want '%s')\n", name, type, rc, why,
                want);
    CHECK(rc < 0 && strstr(why, want) != NULL);
    free(b.p);
}

static void test_refused(void)
{
    refused("/etc/passwd", '0', NULL, "absolute path");
    refused("a/../../etc", '0', NULL, "'..'");
    refused("..", '5', NULL, "'..'");
    refused("dev", '3', NULL, "device node");
    refused("blk", '4', NULL, "device node");
    refused("fifo", '6', NULL, "FIFO");
    refused("odd", 'V', NULL, "type");
    refused("esc", '2', "../x", "outside");
    refused("a/b/esc", '2', "../../../x", "outside");
    refused("abs", '2', "/etc/shadow", "outside");
    refused("hl", '1', "/etc/shadow", "hard link");
    refused("hl2", '1', "nosuch", "hard link");
    refused("hl3", '1', "../ok", "hard link");
    char why[256];
    uint64_t n;
    /* a bad checksum: not a tar */
    tbuf b = {0};
    member(&b, "f", '0', NULL, 1);
    finish(&b);
    b.p[0] = 'g';
    CHECK(check(&b, false, &n, why) < 0 && strstr(why, "checksum") != NULL);
    free(b.p);
    /* empty, and no members */
    tbuf e = {0};
    CHECK(check(&e, false, &n, why) < 0 && strstr(why, "empty") != NULL);
    finish(&e);
    CHECK(check(&e, false, &n, why) < 0 && strstr(why, "no members") != NULL);
    free(e.p);
}

/* GNU long names and pax paths rename the next member, and are judged like any name. */
static void test_long_names(void)
{
    char longname[300];
    memset(longname, 'a', 250);
    strcpy(longname + 250, "/file");
    for (int bad = 0; bad < 2; bad++) {
        tbuf b = {0};
        const char *nm = bad ? "../escape" : longname;
        member(&b, "././@LongLink", 'L', NULL, strlen(nm) + 1);
        /* member() wrote x's as data: rewrite the payload with the name */
        memcpy(b.p + b.n - 512, nm, strlen(nm) + 1);
        member(&b, "short", '0', NULL, 10);
        finish(&b);
        char why[256] = "";
        uint64_t n = 0;
        int rc = check(&b, true, &n, why);
        CHECK(bad ? (rc < 0 && strstr(why, "escape") != NULL) : (rc == 0 && n == 1));
        free(b.p);
    }
    for (int bad = 0; bad < 2; bad++) {
        tbuf b = {0};
        char rec[128];
        const char *path = bad ? "/abs/path" : "dir/from-pax";
        int len = (int)strlen(path) + 7; /* "NN path=" + value + "\n" */
        len += len >= 10 ? 2 : 1;
        snprintf(rec, sizeof rec, "%d path=%s\n", len, path);
        member(&b, "PaxHeader", 'x', NULL, strlen(rec));
        memcpy(b.p + b.n - 512, rec, strlen(rec));
        member(&b, "plain", '0', NULL, 1);
        finish(&b);
        char why[256] = "";
        uint64_t n = 0;
        int rc = check(&b, false, &n, why);
        CHECK(bad ? (rc < 0 && strstr(why, "/abs/path") != NULL) : (rc == 0 && n == 1));
        free(b.p);
    }
}

/* Tars made by GNU tar (plain, gzip, pax: the fuzz seeds) are accepted. */
static void test_real_tars(void)
{
    static const char *const names[] = {"plain.tar", "gzip.tgz", "pax.tar"};
    char dir[4096];
    snprintf(dir, sizeof dir, "%s", __FILE__);
    char *slash = strrchr(dir, '/');
    if (slash != NULL)
        *slash = '\0';
    for (int i = 0; i < 3; i++) {
        char p[4200];
        snprintf(p, sizeof p, "%s/corpus_tarcheck/%s", dir, names[i]);
        FILE *f = fopen(p, "rb");
        CHECK(f != NULL);
        if (f == NULL)
            continue;
        tbuf b = {0};
        unsigned char chunk[4096];
        size_t k;
        while ((k = fread(chunk, 1, sizeof chunk, f)) > 0)
            put(&b, chunk, k);
        fclose(f);
        char why[256] = "";
        uint64_t n = 0;
        int rc = check(&b, false, &n, why);
        if (rc != 0)
            fprintf(stderr, "%s: %s\n", names[i], why);
        CHECK(rc == 0 && n == 5); /* app/ app/a.txt app/l app/sub/ app/sub/b */
        free(b.p);
    }
}

int main(void)
{
    test_real_tars();
    test_good();
    test_refused();
    test_long_names();
    return check_report("core.tarcheck");
}
