/*
 * khash.h - what h2o 2.2.5's <h2o/http2_internal.h> needs of klib's khash, which libh2o is
 * built with but Debian does not install: the layout of its hash tables (an integer-keyed
 * open-addressing table: bucket count, sizes, two flag bits per bucket, keys, values) and a
 * lookup. The lookup walks every bucket, so it depends on the layout and the flag bits (bit 1
 * empty, bit 0 deleted) and not on the hash function; http/bodygate.c, its one user, looks up
 * the streams of one HTTP/2 connection (a few hundred buckets at most). Nothing here inserts.
 */
#ifndef SP_COMPAT_KHASH_H
#define SP_COMPAT_KHASH_H

#include <stdint.h>

typedef uint32_t khint32_t;
typedef uint64_t khint64_t;
typedef khint32_t khint_t;
typedef khint_t khiter_t;

#define khash_t(name) kh_##name##_t

#define KHASH_MAP_INIT_INT64(name, khval_t)                                                        \
    typedef struct kh_##name##_s {                                                                 \
        khint_t n_buckets, size, n_occupied, upper_bound;                                          \
        khint32_t *flags;                                                                          \
        khint64_t *keys;                                                                           \
        khval_t *vals;                                                                             \
    } kh_##name##_t;                                                                               \
    static inline khint_t kh_get_##name(const kh_##name##_t *h, khint64_t key)                     \
    {                                                                                              \
        for (khint_t i = 0; i < h->n_buckets; i++)                                                 \
            if (((h->flags[i >> 4] >> ((i & 0xfu) << 1)) & 3u) == 0 && h->keys[i] == key)          \
                return i;                                                                          \
        return h->n_buckets;                                                                       \
    }

#define kh_get(name, h, k) kh_get_##name(h, k)
#define kh_end(h)          ((h)->n_buckets)
#define kh_val(h, x)       ((h)->vals[x])

#endif
