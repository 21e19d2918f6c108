/*
 * tmplcache.c - the step cache of template builds (tmplcache.h).
 *
 * Reads the driver's snapshot directory (<data-dir>/snapshots/) only to find its own entries'
 * ages for the trim; everything else goes through the driver's checkpoint calls.
 */
#include "core/control/tmplcache.h"

#include <dirent.h>
#include <limits.h>
#include <sodium.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "base/log.h"

void sp_tmplcache_key(const char *team, const char *parent_hash, int cpu_count, int memory_mb,
                      const json_t *steps, size_t n, char out[SP_TMPLCACHE_ID_LEN + 1])
{
    json_t *prefix = json_array();
    for (size_t i = 0; i < n && i < json_array_size(steps); i++)
        json_array_append(prefix, json_array_get(steps, i));
    json_t *in = json_pack("{s:s,s:s,s:i,s:i,s:o}", "team", team, "parent_hash", parent_hash,
                           "cpu_count", cpu_count, "memory_mb", memory_mb, "steps", prefix);
    char *s = in != NULL ? json_dumps(in, JSON_COMPACT | JSON_SORT_KEYS) : NULL;
    json_decref(in);
    unsigned char h[crypto_hash_sha256_BYTES];
    crypto_hash_sha256(h, (const unsigned char *)(s ? s : ""), s ? strlen(s) : 0);
    free(s);
    memcpy(out, "bc-", 3);
    for (size_t i = 0; i < 16; i++)
        snprintf(out + 3 + 2 * i, 3, "%02x", h[i]);
}

size_t sp_tmplcache_find(sp_driver_t *d, const char *team, const char *parent_hash,
                         int cpu_count, int memory_mb, const json_t *steps, size_t max_n,
                         char out[SP_TMPLCACHE_ID_LEN + 1])
{
    if (d == NULL || d->ops->checkpoint_exists == NULL)
        return 0;
    for (size_t n = max_n; n >= 1; n--) {
        sp_tmplcache_key(team, parent_hash, cpu_count, memory_mb, steps, n, out);
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

static int by_age(const void *a, const void *b)
{
    const struct entry *x = a, *y = b;
    return x->t < y->t ? 1 : x->t > y->t ? -1 : strcmp(x->id, y->id); /* newest first */
}

void sp_tmplcache_trim(sp_driver_t *d, const char *data_dir, size_t keep)
{
    if (d == NULL || d->ops->checkpoint_delete == NULL)
        return;
    char dir[PATH_MAX];
    snprintf(dir, sizeof dir, "%s/snapshots", data_dir);
    DIR *dd = opendir(dir);
    if (dd == NULL)
        return;
    struct entry *v = NULL;
    size_t n = 0, cap = 0;
    struct dirent *de;
    while ((de = readdir(dd)) != NULL) {
        if (strncmp(de->d_name, "bc-", 3) != 0 || strlen(de->d_name) != SP_TMPLCACHE_ID_LEN ||
            d->ops->checkpoint_exists(d, de->d_name) != 1)
            continue;
        char p[2 * PATH_MAX + 300];
        struct stat st;
        snprintf(p, sizeof p, "%s/%s/vm.json", dir, de->d_name);
        if (stat(p, &st) < 0)
            continue;
        if (n == cap) {
            size_t nc = cap ? 2 * cap : 64;
            struct entry *nv = realloc(v, nc * sizeof(*nv));
            if (nv == NULL)
                break;
            v = nv;
            cap = nc;
        }
        memcpy(v[n].id, de->d_name, SP_TMPLCACHE_ID_LEN + 1); /* its length was checked */
        v[n].t = (long long)st.st_mtime;
        n++;
    }
    closedir(dd);
    if (n > keep) {
        qsort(v, n, sizeof(*v), by_age);
        for (size_t i = keep; i < n; i++) {
            sp_err_t e;
            if (d->ops->checkpoint_delete(d, v[i].id, &e) < 0)
                sp_log(SP_LOG_WARN, "tmpl", "step cache entry not deleted id=%s err=%s", v[i].id,
                       e.msg);
        }
    }
    free(v);
}
