/*
 * test_tmplcache.c - the step cache's keys and its trim, over a driver that keeps its snapshots
 * in memory: the trim lists the cache's entries through the driver (checkpoint_list), keeps
 * the newest and deletes the rest, and leaves every other snapshot alone.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <jansson.h>

#include "core/control/tmplcache.h"
#include "tests/check.h"

#define MAXS 64

/* A driver with only the checkpoint calls. */
struct memdrv {
    sp_driver_t base;
    struct {
        char id[80];
        long long t;
        int deleted;
    } s[MAXS];
    int n, deletes;
};

static int m_delete(sp_driver_t *d, const char *id, sp_err_t *err)
{
    (void)err;
    struct memdrv *m = (struct memdrv *)d;
    for (int i = 0; i < m->n; i++)
        if (strcmp(m->s[i].id, id) == 0 && !m->s[i].deleted) {
            m->s[i].deleted = 1;
            m->deletes++;
        }
    return 0;
}

static int m_exists(sp_driver_t *d, const char *id)
{
    struct memdrv *m = (struct memdrv *)d;
    for (int i = 0; i < m->n; i++)
        if (strcmp(m->s[i].id, id) == 0 && !m->s[i].deleted)
            return 1;
    return 0;
}

static int m_list(sp_driver_t *d, const char *prefix,
                  void (*fn)(const char *id, long long committed_s, void *arg), void *arg,
                  sp_err_t *err)
{
    (void)err;
    struct memdrv *m = (struct memdrv *)d;
    for (int i = m->n - 1; i >= 0; i--) /* in no particular order: here, reversed */
        if (!m->s[i].deleted && strncmp(m->s[i].id, prefix, strlen(prefix)) == 0)
            fn(m->s[i].id, m->s[i].t, arg);
    return 0;
}

static const sp_driver_ops_t mops = {
    .checkpoint_delete = m_delete,
    .checkpoint_exists = m_exists,
    .checkpoint_list = m_list,
};

static void add(struct memdrv *m, const char *id, long long t)
{
    snprintf(m->s[m->n].id, sizeof m->s[m->n].id, "%s", id);
    m->s[m->n].t = t;
    m->n++;
}

static void test_keys_and_find(void)
{
    struct memdrv m = {.base.ops = &mops};
    json_t *steps = json_loads("[{\"run\":\"a\"},{\"run\":\"b\"},{\"run\":\"c\"}]", 0, NULL);
    char k1[SP_TMPLCACHE_ID_LEN + 1], k2[SP_TMPLCACHE_ID_LEN + 1], k2o[SP_TMPLCACHE_ID_LEN + 1],
        out[SP_TMPLCACHE_ID_LEN + 1];
    sp_tmplcache_key("team1", "h", 1, 256, 0, steps, 1, k1);
    sp_tmplcache_key("team1", "h", 1, 256, 0, steps, 2, k2);
    sp_tmplcache_key("team2", "h", 1, 256, 0, steps, 2, k2o);
    CHECK(strlen(k1) == SP_TMPLCACHE_ID_LEN && strncmp(k1, "bc-", 3) == 0);
    CHECK(strcmp(k1, k2) != 0 && strcmp(k2, k2o) != 0); /* prefix length and team count */
    CHECK(sp_tmplcache_find(&m.base, "team1", "h", 1, 256, 0, steps, 3, out) == 0);
    add(&m, k1, 100);
    CHECK(sp_tmplcache_find(&m.base, "team1", "h", 1, 256, 0, steps, 3, out) == 1);
    CHECK(strcmp(out, k1) == 0);
    add(&m, k2, 101);
    CHECK(sp_tmplcache_find(&m.base, "team1", "h", 1, 256, 0, steps, 3, out) == 2);
    CHECK(strcmp(out, k2) == 0);
    CHECK(sp_tmplcache_find(&m.base, "team2", "h", 1, 256, 0, steps, 1, out) == 0);
    CHECK(sp_tmplcache_find(&m.base, "team1", "h", 1, 512, 0, steps, 3, out) == 0); /* size */
    /* a builder grown to another disk: its own entries */
    CHECK(sp_tmplcache_find(&m.base, "team1", "h", 1, 256, 4096, steps, 3, out) == 0);
    char kd[SP_TMPLCACHE_ID_LEN + 1];
    sp_tmplcache_key("team1", "h", 1, 256, 4096, steps, 1, kd);
    CHECK(strcmp(kd, k1) != 0);
    json_decref(steps);
}

static void test_trim(void)
{
    struct memdrv m = {.base.ops = &mops};
    json_t *steps = json_loads("[{\"run\":\"x\"}]", 0, NULL);
    char keys[10][SP_TMPLCACHE_ID_LEN + 1];
    for (int i = 0; i < 10; i++) {
        char team[16];
        snprintf(team, sizeof team, "t%d", i);
        sp_tmplcache_key(team, "h", 1, 256, 0, steps, 1, keys[i]);
        add(&m, keys[i], 1000 + (i * 7) % 10); /* ages out of order */
    }
    add(&m, "sandbox-snap", 1);     /* not the cache's */
    add(&m, "bc-short", 2);         /* the prefix but not a key */
    sp_tmplcache_trim(&m.base, 12); /* fewer than keep: nothing */
    CHECK(m.deletes == 0);
    sp_tmplcache_trim(&m.base, 4);
    CHECK(m.deletes == 6);
    for (int i = 0; i < 10; i++) {
        int newest = (i * 7) % 10 >= 6; /* the 4 largest times */
        CHECK(m_exists(&m.base, keys[i]) == newest);
    }
    CHECK(m_exists(&m.base, "sandbox-snap") && m_exists(&m.base, "bc-short"));
    sp_tmplcache_trim(&m.base, 0);
    CHECK(m.deletes == 10);
    CHECK(m_exists(&m.base, "sandbox-snap") && m_exists(&m.base, "bc-short"));
    json_decref(steps);
}

int main(void)
{
    test_keys_and_find();
    test_trim();
    return check_report("core.tmplcache");
}
