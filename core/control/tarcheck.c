/*
 * tarcheck.c - the streaming tar checker (tarcheck.h).
 *
 * Input goes through zlib when it starts with gzip's magic, then into 512-byte blocks: a
 * header, the member's data (skipped, padded to a block), or the payload of a long-name or
 * pax header (kept, at most SP_TAR_MAX_NAME + a pax record's framing), which renames the next
 * member. Symbolic links are judged lexically from the link's directory: the builder VM
 * unpacks the file, so what is checked here is that the build will not fail halfway, not the
 * host's safety.
 */
#include "core/control/tarcheck.h"

#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <zlib.h>

#define BLK       512
#define PAX_MAX   (64u * 1024u) /* a pax extended header's records */
#define HSET_INIT 1024u

enum mode { M_HEADER = 0, M_SKIP, M_PAYLOAD, M_END, M_FAILED };

struct sp_tarcheck {
    uint64_t max_bytes, total;
    int gz; /* -1 unknown yet, 0 plain, 1 gzip */
    bool z_open, z_done;
    z_stream z;
    uint8_t blk[BLK];
    size_t fill;
    enum mode mode;
    uint64_t left;     /* M_SKIP / M_PAYLOAD: bytes still to come, padding included */
    uint64_t want;     /* M_PAYLOAD: bytes of the payload itself */
    char ptype;        /* M_PAYLOAD: 'L', 'K' or 'x' */
    char *payload;     /* M_PAYLOAD */
    size_t plen;
    char *next_name;   /* from L or pax, for the next member */
    char *next_link;   /* from K or pax */
    uint64_t entries;
    bool layer;        /* a container image layer (sp_tarcheck_new_layer) */
    uint64_t pad;      /* M_SKIP of a file's data: the padding at its end */
    int zeros;         /* consecutive zero blocks */
    char why[320];
    /* names of regular files so far (hard-link targets): open addressing */
    char **set;
    size_t set_cap, set_n;
};

static int fail(sp_tarcheck_t *t, const char *fmt, const char *a)
{
    if (t->mode != M_FAILED) {
        snprintf(t->why, sizeof t->why, fmt, a ? a : "");
        t->mode = M_FAILED;
    }
    return -1;
}

static uint64_t hash(const char *s)
{
    uint64_t h = 1469598103934665603ull;
    for (; *s; s++)
        h = (h ^ (uint8_t)*s) * 1099511628211ull;
    return h;
}

static bool set_has(const sp_tarcheck_t *t, const char *s)
{
    if (t->set_cap == 0)
        return false;
    for (size_t i = hash(s) & (t->set_cap - 1);; i = (i + 1) & (t->set_cap - 1)) {
        if (t->set[i] == NULL)
            return false;
        if (strcmp(t->set[i], s) == 0)
            return true;
    }
}

static int set_add(sp_tarcheck_t *t, const char *s)
{
    if (set_has(t, s))
        return 0;
    if ((t->set_n + 1) * 2 > t->set_cap) {
        size_t cap = t->set_cap ? t->set_cap * 2 : HSET_INIT;
        char **n = calloc(cap, sizeof(*n));
        if (n == NULL)
            return -1;
        for (size_t i = 0; i < t->set_cap; i++) {
            if (t->set[i] == NULL)
                continue;
            size_t j = hash(t->set[i]) & (cap - 1);
            while (n[j] != NULL)
                j = (j + 1) & (cap - 1);
            n[j] = t->set[i];
        }
        free(t->set);
        t->set = n;
        t->set_cap = cap;
    }
    char *c = strdup(s);
    if (c == NULL)
        return -1;
    size_t j = hash(c) & (t->set_cap - 1);
    while (t->set[j] != NULL)
        j = (j + 1) & (t->set_cap - 1);
    t->set[j] = c;
    t->set_n++;
    return 0;
}

/* An octal (or base-256) numeric field. -1 when malformed. */
static int64_t num(const uint8_t *f, size_t n)
{
    if (f[0] & 0x80) { /* base-256: GNU's large sizes */
        uint64_t v = f[0] & 0x3f;
        if (f[0] & 0x40)
            return -1; /* negative */
        for (size_t i = 1; i < n; i++) {
            if (v >> 55)
                return -1;
            v = v << 8 | f[i];
        }
        return (int64_t)v;
    }
    uint64_t v = 0;
    size_t i = 0;
    while (i < n && f[i] == ' ')
        i++;
    bool any = false;
    for (; i < n && f[i] >= '0' && f[i] <= '7'; i++) {
        if (v >> 60)
            return -1;
        v = v * 8 + (uint64_t)(f[i] - '0');
        any = true;
    }
    for (; i < n; i++)
        if (f[i] != ' ' && f[i] != '\0')
            return -1;
    return any ? (int64_t)v : 0;
}

/* Normalises a member name in place: no leading "./", no "." components, no trailing "/".
 * false for an absolute name, a ".." component or an empty component in the middle. */
static bool clean_name(char *s)
{
    if (s[0] == '/')
        return false;
    char *out = s;
    const char *p = s;
    while (*p) {
        const char *e = strchr(p, '/');
        size_t n = e ? (size_t)(e - p) : strlen(p);
        if (n == 2 && p[0] == '.' && p[1] == '.')
            return false;
        if (!(n == 0 || (n == 1 && p[0] == '.'))) {
            if (out != s)
                *out++ = '/';
            memmove(out, p, n);
            out += n;
        }
        p += n + (e ? 1 : 0);
    }
    *out = '\0';
    return true;
}

/* A symbolic link at name (cleaned) pointing at target stays inside the tree, read lexically. */
static bool link_inside(const char *name, const char *target)
{
    if (target[0] == '/' || target[0] == '\0')
        return false;
    long depth = 0;
    for (const char *p = name; *p; p++)
        depth += *p == '/';
    for (const char *p = target; *p;) {
        const char *e = strchr(p, '/');
        size_t n = e ? (size_t)(e - p) : strlen(p);
        if (n == 2 && p[0] == '.' && p[1] == '.') {
            if (--depth < 0)
                return false;
        } else if (!(n == 0 || (n == 1 && p[0] == '.'))) {
            depth++;
        }
        p += n + (e ? 1 : 0);
    }
    return true;
}

static char *dup_field(const uint8_t *f, size_t n)
{
    size_t k = strnlen((const char *)f, n);
    char *s = malloc(k + 1);
    if (s != NULL) {
        memcpy(s, f, k);
        s[k] = '\0';
    }
    return s;
}

/* pax records "LEN KEY=VALUE\n": path and linkpath rename the next member. */
static int pax(sp_tarcheck_t *t, const char *p, size_t n)
{
    size_t i = 0;
    while (i < n) {
        size_t len = 0, j = i;
        while (j < n && p[j] >= '0' && p[j] <= '9' && len < PAX_MAX)
            len = len * 10 + (size_t)(p[j++] - '0');
        if (j >= n || p[j] != ' ' || len == 0 || len > n - i || p[i + len - 1] != '\n')
            return fail(t, "a pax header is malformed%s", NULL);
        const char *kv = p + j + 1, *end = p + i + len - 1;
        const char *eq = memchr(kv, '=', (size_t)(end - kv));
        if (eq == NULL)
            return fail(t, "a pax header is malformed%s", NULL);
        size_t klen = (size_t)(eq - kv), vlen = (size_t)(end - eq - 1);
        char **slot = klen == 4 && memcmp(kv, "path", 4) == 0       ? &t->next_name
                      : klen == 8 && memcmp(kv, "linkpath", 8) == 0 ? &t->next_link
                                                                      : NULL;
        if (slot != NULL) {
            if (vlen > SP_TAR_MAX_NAME || memchr(eq + 1, '\0', vlen) != NULL)
                return fail(t, "a pax name is too long or has a NUL byte%s", NULL);
            free(*slot);
            if ((*slot = malloc(vlen + 1)) == NULL)
                return fail(t, "out of memory%s", NULL);
            memcpy(*slot, eq + 1, vlen);
            (*slot)[vlen] = '\0';
        }
        i += len;
    }
    return 0;
}

static int header(sp_tarcheck_t *t, const uint8_t *h)
{
    bool zero = true;
    for (size_t i = 0; i < BLK && zero; i++)
        zero = h[i] == 0;
    if (zero) {
        if (++t->zeros == 2)
            t->mode = M_END;
        return 0;
    }
    t->zeros = 0;
    t->pad = 0;
    int64_t sum = num(h + 148, 8);
    int64_t mine = 0;
    for (size_t i = 0; i < BLK; i++)
        mine += (i >= 148 && i < 156) ? ' ' : h[i];
    if (sum < 0 || sum != mine)
        return fail(t, "not a tar file (a header's checksum does not match)%s", NULL);
    int64_t size = num(h + 124, 12);
    if (size < 0)
        return fail(t, "a header's size is malformed%s", NULL);
    char type = (char)h[156];
    uint64_t padded = ((uint64_t)size + BLK - 1) / BLK * BLK;
    if (type == 'L' || type == 'K' || type == 'x') {
        if ((uint64_t)size > (type == 'x' ? PAX_MAX : SP_TAR_MAX_NAME + 1))
            return fail(t, "a long-name or pax header is too large%s", NULL);
        free(t->payload);
        if ((t->payload = malloc((size_t)size + 1)) == NULL)
            return fail(t, "out of memory%s", NULL);
        t->plen = 0;
        t->want = (uint64_t)size;
        t->left = padded;
        t->ptype = type;
        t->mode = M_PAYLOAD;
        if (padded == 0) { /* empty payload: applies at once */
            t->mode = M_HEADER;
            return type == 'x' ? 0 : fail(t, "an empty long name%s", NULL);
        }
        return 0;
    }
    if (type == 'g') { /* global pax header: nothing we use */
        t->left = padded;
        t->mode = padded ? M_SKIP : M_HEADER;
        return 0;
    }
    if (++t->entries > SP_TAR_MAX_ENTRIES)
        return fail(t, "more than 200000 members%s", NULL);
    char *name = t->next_name;
    t->next_name = NULL;
    if (name == NULL) {
        /* ustar: prefix (345, 155) "/" name (0, 100) */
        char buf[260];
        size_t pl = strnlen((const char *)h + 345, 155);
        bool ustar = memcmp(h + 257, "ustar", 5) == 0;
        size_t nl = strnlen((const char *)h, 100);
        if (ustar && pl > 0)
            snprintf(buf, sizeof buf, "%.*s/%.*s", (int)pl, h + 345, (int)nl, (const char *)h);
        else
            snprintf(buf, sizeof buf, "%.*s", (int)nl, (const char *)h);
        name = strdup(buf);
    }
    char *link = t->next_link;
    t->next_link = NULL;
    if (link == NULL)
        link = dup_field(h + 157, 100);
    int rc = 0;
    if (t->layer && name != NULL && link != NULL) { /* layers name members from the root */
        while (name[0] == '/')
            memmove(name, name + 1, strlen(name));
        if (type == '1')
            while (link[0] == '/')
                memmove(link, link + 1, strlen(link));
    }
    if (name == NULL || link == NULL) {
        rc = fail(t, "out of memory%s", NULL);
    } else if (strlen(name) > SP_TAR_MAX_NAME) {
        rc = fail(t, "a member name is longer than 4096 bytes%s", NULL);
    } else if (!clean_name(name)) {
        rc = fail(t, "member '%.200s' has an absolute path or a '..' component", name);
    } else if (name[0] == '\0' && type != '5') {
        rc = fail(t, "a member that is not a directory has an empty name%s", NULL);
    } else if (type == '0' || type == '\0' || type == '7') {
        rc = set_add(t, name) < 0 ? fail(t, "out of memory%s", NULL) : 0;
        t->left = padded;
        t->pad = padded - (uint64_t)size;
    } else if (type == '5') {
        t->left = 0;
    } else if (type == '2') {
        if (!t->layer && !link_inside(name, link))
            rc = fail(t, "symbolic link '%.200s' points outside the files", name);
        t->left = 0;
    } else if (type == '1') {
        char *target = strdup(link);
        if (target == NULL || !clean_name(target) || (!t->layer && !set_has(t, target)))
            rc = fail(t, "hard link '%.200s' does not point at a file earlier in the tar", name);
        free(target);
        t->left = 0;
    } else if (t->layer && (type == '3' || type == '4' || type == '6')) {
        t->left = 0; /* the unpacked tree loses them (ociimg.c) */
    } else if (type == '3' || type == '4') {
        rc = fail(t, "member '%.200s' is a device node", name);
    } else if (type == '6') {
        rc = fail(t, "member '%.200s' is a FIFO", name);
    } else {
        rc = fail(t, "member '%.200s' has a type templates cannot hold", name);
    }
    free(name);
    free(link);
    if (rc == 0)
        t->mode = t->left > 0 ? M_SKIP : M_HEADER;
    return rc;
}

/* Tar bytes (uncompressed). */
static int tar_bytes(sp_tarcheck_t *t, const uint8_t *p, size_t n)
{
    t->total += n;
    if (t->total > t->max_bytes)
        return fail(t, "the tar is larger than this server takes%s", NULL);
    while (n > 0 && t->mode != M_FAILED) {
        if (t->mode == M_END)
            return 0; /* what follows the end marker is not read */
        if (t->mode == M_SKIP) {
            size_t k = n < t->left ? n : (size_t)t->left;
            t->left -= k;
            p += k;
            n -= k;
            if (t->left == 0)
                t->mode = M_HEADER;
            continue;
        }
        if (t->mode == M_PAYLOAD) {
            size_t k = n < t->left ? n : (size_t)t->left;
            uint64_t room = t->want - t->plen;
            size_t keep = k < room ? k : (size_t)room;
            memcpy(t->payload + t->plen, p, keep);
            t->plen += keep;
            t->left -= k;
            p += k;
            n -= k;
            if (t->left == 0) {
                t->payload[t->plen] = '\0';
                t->mode = M_HEADER;
                if (t->ptype == 'x') {
                    if (pax(t, t->payload, t->plen) < 0)
                        return -1;
                } else {
                    char **slot = t->ptype == 'L' ? &t->next_name : &t->next_link;
                    free(*slot);
                    *slot = strndup(t->payload, t->plen);
                }
            }
            continue;
        }
        size_t k = BLK - t->fill < n ? BLK - t->fill : n;
        memcpy(t->blk + t->fill, p, k);
        t->fill += k;
        p += k;
        n -= k;
        if (t->fill == BLK) {
            t->fill = 0;
            if (header(t, t->blk) < 0)
                return -1;
        }
    }
    return t->mode == M_FAILED ? -1 : 0;
}

sp_tarcheck_t *sp_tarcheck_new(uint64_t max_bytes)
{
    sp_tarcheck_t *t = calloc(1, sizeof(*t));
    if (t != NULL) {
        t->max_bytes = max_bytes;
        t->gz = -1;
    }
    return t;
}

sp_tarcheck_t *sp_tarcheck_new_layer(uint64_t max_bytes)
{
    sp_tarcheck_t *t = sp_tarcheck_new(max_bytes);
    if (t != NULL)
        t->layer = true;
    return t;
}

int sp_tarcheck_feed(sp_tarcheck_t *t, const void *p, size_t n, char *why, size_t cap)
{
    const uint8_t *b = p;
    if (t->mode == M_FAILED)
        goto out;
    if (t->gz < 0 && n > 0) {
        t->gz = n >= 2 ? (b[0] == 0x1f && b[1] == 0x8b) : (b[0] == 0x1f);
        if (t->gz) {
            if (inflateInit2(&t->z, 16 + MAX_WBITS) != Z_OK) {
                fail(t, "out of memory%s", NULL);
                goto out;
            }
            t->z_open = true;
        }
    }
    if (!t->gz) {
        tar_bytes(t, b, n);
        goto out;
    }
    t->z.next_in = (Bytef *)(uintptr_t)b;
    t->z.avail_in = (uInt)n;
    while (t->z.avail_in > 0 && t->mode != M_FAILED && !t->z_done) {
        uint8_t out[16384];
        t->z.next_out = out;
        t->z.avail_out = sizeof out;
        int zr = inflate(&t->z, Z_NO_FLUSH);
        if (zr != Z_OK && zr != Z_STREAM_END && !(zr == Z_BUF_ERROR && t->z.avail_out == 0)) {
            fail(t, "the gzip stream is corrupt%s", NULL);
            break;
        }
        if (tar_bytes(t, out, sizeof out - t->z.avail_out) < 0)
            break;
        if (zr == Z_STREAM_END)
            t->z_done = true;
    }
out:
    if (t->mode == M_FAILED) {
        snprintf(why, cap, "%s", t->why);
        return -1;
    }
    return 0;
}

int sp_tarcheck_end(sp_tarcheck_t *t, uint64_t *entries, char *why, size_t cap)
{
    if (t->mode != M_FAILED) {
        if (t->gz == 1 && !t->z_done)
            fail(t, "the gzip stream ends early%s", NULL);
        else if (t->gz < 0)
            fail(t, "the file is empty%s", NULL);
        else if (t->layer && t->mode == M_SKIP && t->left <= t->pad)
            ; /* some image tools end a layer after its last file's data: Go's reader takes it */
        else if (t->mode == M_SKIP || t->mode == M_PAYLOAD || t->fill != 0)
            fail(t, "the tar ends in the middle of a member%s", NULL);
        else if (t->entries == 0)
            fail(t, "the tar has no members%s", NULL);
    }
    if (t->mode == M_FAILED) {
        snprintf(why, cap, "%s", t->why);
        return -1;
    }
    if (entries != NULL)
        *entries = t->entries;
    return 0;
}

void sp_tarcheck_free(sp_tarcheck_t *t)
{
    if (t == NULL)
        return;
    if (t->z_open)
        inflateEnd(&t->z);
    for (size_t i = 0; i < t->set_cap; i++)
        free(t->set[i]);
    free(t->set);
    free(t->payload);
    free(t->next_name);
    free(t->next_link);
    free(t);
}
