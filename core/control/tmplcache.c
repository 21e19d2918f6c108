/*
 * tmplcache.c - the step cache of template builds (tmplcache.h).
 *
 * Entries are driver snapshots (checkpoint calls) named by their key; the trim lists them by the
 * keys' prefix (checkpoint_list) and deletes all but the newest.
 */
#include "core/control/tmplcache.h"

#include <sodium.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "base/log.h"

void sp_tmplcache_key(const char *team, const char *parent_hash, int cpu_count, int memory_mb,
                      int disk_mb, const json_t *steps, size_t n, char out[SP_TMPLCACHE_ID_LEN + 1])
{
    json_t *prefix = json_array();
    for (size_t i = 0; i < n && i < json_array_size(steps); i++)
        json_array_append(prefix, json_array_get(steps, i));
    json_t *in = json_pack("{s:s,s:s,s:i,s:i,s:o}", "team", team, "parent_hash", parent_hash,
                           "cpu_count", cpu_count, "memory_mb", memory_mb, "steps", prefix);
    if (in != NULL && disk_mb > 0) /* only then: the keys of entries made before stay */
        json_object_set_new(in, "disk_mb", json_integer(disk_mb));
    char *s = in != NULL ? json_dumps(in, JSON_COMPACT | JSON_SORT_KEYS) : NULL;
    json_decref(in);
    unsigned char h[crypto_hash_sha256_BYTES];
    crypto_hash_sha256(h, (const unsigned char *)(s ? s : ""), s ? strlen(s) : 0);
    free(s);
    memcpy(out, "bc-", 3);
    for (size_t i = 0; i < 16; i++)
        snprintf(out + 3 + 2 * i, 3, "%02x", h[i]);
}

size_t sp_tmplcache_find(sp_driver_t *d, const char *team, const char *parent_hash, int cpu_count,
                         int memory_mb, int disk_mb, const json_t *steps, size_t max_n,
                         char out[SP_TMPLCACHE_ID_LEN + 1])
{
    if (d == NULL || d->ops->checkpoint_exists == NULL)
        return 0;
    for (size_t n = max_n; n >= 1; n--) {
        sp_tmplcache_key(team, parent_hash, cpu_count, memory_mb, disk_mb, steps, n, out);
        if (d->ops->checkpoint_exists(d, out) == 1)
            return n;
    }
    out[0] = '\0';
    return 0;
}

struct entry {
    char id[SP_TMPLCACHE_ID_LEN + 1];
    long long t;
};

struct entries {
    struct entry *v;
    size_t n, cap;
    bool oom;
};

static void add_entry(const char *id, long long committed_s, void *arg)
{
    struct entries *es = arg;
    if (strlen(id) != SP_TMPLCACHE_ID_LEN || es->oom)
        return; /* not a key of ours */
    if (es->n == es->cap) {
        size_t nc = es->cap ? 2 * es->cap : 64;
        void *nv = realloc(es->v, nc * sizeof(*es->v));
        if (nv == NULL) {
            es->oom = true;
            return;
        }
        es->v = nv;
        es->cap = nc;
    }
    memcpy(es->v[es->n].id, id, SP_TMPLCACHE_ID_LEN + 1);
    es->v[es->n].t = committed_s;
    es->n++;
}

static int by_age(const void *a, const void *b)
{
    const struct entry *x = a, *y = b;
    return x->t < y->t ? 1 : x->t > y->t ? -1 : strcmp(x->id, y->id); /* newest first */
}

void sp_tmplcache_trim(sp_driver_t *d, size_t keep)
{
    if (d == NULL || d->ops->checkpoint_delete == NULL || d->ops->checkpoint_list == NULL)
        return;
    struct entries es = {0};
    sp_err_t e;
    if (d->ops->checkpoint_list(d, "bc-", add_entry, &es, &e) < 0 || es.oom) {
        sp_log(SP_LOG_WARN, "tmpl", "step cache not trimmed: %s", es.oom ? "out of memory" : e.msg);
        free(es.v);
        return;
    }
    if (es.n > keep) {
        qsort(es.v, es.n, sizeof(*es.v), by_age);
        for (size_t i = keep; i < es.n; i++) {
            if (d->ops->checkpoint_delete(d, es.v[i].id, &e) < 0)
                sp_log(SP_LOG_WARN, "tmpl", "step cache entry not deleted id=%s err=%s", es.v[i].id,
                       e.msg);
        }
    }
    free(es.v);
}
