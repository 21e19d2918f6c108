/*
 * test_sizes.c - core/control/sizes.h against a real PostgreSQL (SP_TEST_PG_DSN or a private
 * cluster): which sizes of the sandboxes' own rows are handed to the driver's prepare (the
 * last day's, the most created per template within the bound, each template's default at the
 * version a create would get now), and that a new reader (a restart) finds the same.
 */
#include <stdlib.h>
#include <string.h>

#include "core/control/sizes.h"
#include "core/egress/tests/secrets_fixture.h"
#include "core/store/store.h"

/* A driver with prepare only: records what it is asked, answers what the test says. */
#define MAX_CALLS 64
struct rec_driver {
    sp_driver_t base;
    int n;
    char calls[MAX_CALLS][200];
    const char *ready;   /* a call equal to this answers 1 */
    const char *refused; /* and to this -1 */
};

static int rec_prepare(sp_driver_t *d, const char *t, int cpus, int mem, sp_err_t *err)
{
    struct rec_driver *r = (struct rec_driver *)d;
    char c[200];
    snprintf(c, sizeof c, "%s %d %d", t, cpus, mem);
    if (r->n < MAX_CALLS)
        snprintf(r->calls[r->n++], sizeof r->calls[0], "%s", c);
    if (r->ready != NULL && strcmp(c, r->ready) == 0)
        return 1;
    if (r->refused != NULL && strcmp(c, r->refused) == 0)
        return sp_err_set(err, SP_ENOTFOUND, "not here");
    return 0;
}

static void rec_free(sp_driver_t *d)
{
    (void)d;
}

static const sp_driver_ops_t rec_ops = {.name = "rec", .free = rec_free, .prepare = rec_prepare};
static const sp_driver_ops_t noprep_ops = {.name = "noprep", .free = rec_free};

static bool called(const struct rec_driver *r, const char *c)
{
    for (int i = 0; i < r->n; i++)
        if (strcmp(r->calls[i], c) == 0)
            return true;
    return false;
}

/* n sandboxes of team t, template tmpl (version ver or NULL), size cpus x mem, created age_s
 * seconds ago, from snapshot snap (or NULL). */
static void sandboxes(int n, const char *tmpl, const char *ver, int cpus, int mem, int age_s,
                      const char *snap)
{
    static int seq;
    for (int i = 0; i < n; i++) {
        char id[32], c[16], m[16], age[16];
        snprintf(id, sizeof id, "sz%d", ++seq);
        snprintf(c, sizeof c, "%d", cpus);
        snprintf(m, sizeof m, "%d", mem);
        snprintf(age, sizeof age, "%d", age_s);
        const char *p[] = {id, tmpl, ver, c, m, age, snap};
        REQUIRE(fx_sql("INSERT INTO sandboxes (id, team_id, template, template_version,"
                       " cpu_count, memory_mb, access_token, observed_state, desired_state,"
                       " created_at, snapshot_id)"
                       " VALUES ($1, 'tm', $2, $3, $4::int, $5::int, 'tok' || $1, 'deleted',"
                       " 'deleted', now() - make_interval(secs => $6::int), $7)",
                       7, p) != NULL);
    }
}

static void schema_rows(void)
{
    REQUIRE(fx_sql("INSERT INTO teams (id, name) VALUES ('tm', 'tm')", 0, NULL) != NULL);
    REQUIRE(fx_sql("INSERT INTO templates (name, cpu_count, memory_mb) VALUES ('base', 1, 256),"
                   " ('other', 2, 512)",
                   0, NULL) != NULL);
    REQUIRE(fx_sql("INSERT INTO templates (name, cpu_count, memory_mb, deleted_at)"
                   " VALUES ('gone', 1, 256, now())",
                   0, NULL) != NULL);
    /* a team's template: two versions, its default tag on v2 (2 vCPU / 512 MiB) */
    REQUIRE(fx_sql("INSERT INTO templates (name, team_id, status, cpu_count, memory_mb)"
                   " VALUES ('tt', 'tm', 'ready', 1, 128)",
                   0, NULL) != NULL);
    REQUIRE(fx_sql("INSERT INTO template_versions (template, hash, build_id, cpu_count,"
                   " memory_mb) VALUES ('tt', 'v1', 'b1', 1, 256), ('tt', 'v2', 'b2', 2, 512)",
                   0, NULL) != NULL);
    REQUIRE(fx_sql("INSERT INTO template_tags (template, tag, hash) VALUES ('tt', 'default',"
                   " 'v2')",
                   0, NULL) != NULL);
}

static void run_rounds(sp_sizes_t *s, unsigned want)
{
    sp_sizes_stats_t st;
    for (int i = 0; i < 2000; i++) {
        sp_sizes_stats(s, &st);
        if (st.rounds >= want)
            return;
        sp_loop_run_once(loop, 5);
    }
}

static void test_sizes_last_day_bounded_with_default(void)
{
    sandboxes(5, "base", NULL, 1, 512, 60, NULL);
    sandboxes(3, "base", NULL, 2, 1024, 3600, NULL);
    sandboxes(2, "base", NULL, 1, 256, 120, NULL);        /* its default, also created */
    sandboxes(1, "base", NULL, 2, 2048, 600, NULL);       /* a tie for the 4th place: the older */
    sandboxes(1, "base", NULL, 1, 768, 60, NULL);         /* the newer of the tie: kept */
    sandboxes(6, "base", NULL, 4, 4096, 2 * 86400, NULL); /* two days ago */
    sandboxes(2, "tt", "v1", 1, 1024, 60, NULL);          /* of an older version */
    sandboxes(4, "gone", NULL, 1, 512, 60, NULL);         /* a deleted template */
    /* a sandbox snapshot and 3 sandboxes made from it: they start from it, not the template */
    REQUIRE(fx_sql("INSERT INTO snapshots (id, team_id, sandbox_id, template, cpu_count,"
                   " memory_mb) VALUES ('snap1', 'tm', 'sz1', 'base', 8, 8192)",
                   0, NULL) != NULL);
    sandboxes(3, "base", NULL, 8, 8192, 60, "snap1");

    struct rec_driver d = {.base = {.ops = &rec_ops}};
    d.base.loop = loop;
    sp_err_t e;
    sp_store_t *store = sp_store_create(loop, dsn, 2, &e);
    REQUIRE(store != NULL);
    sp_sizes_opts_t o = {.per_template = 4, .interval_ms = 3600000};
    sp_sizes_t *s = sp_sizes_create(loop, store, &d.base, &o, &e);
    REQUIRE(s != NULL);
    run_rounds(s, 1);
    sp_sizes_stats_t st;
    sp_sizes_stats(s, &st);
    CHECK(st.rounds == 1 && st.failed == 0);
    /* base: its 4 most created of the day, then its default; tt: at its default tag's
     * version, the size created from an older one and its default */
    static const char *const want[] = {"base 1 512", "base 2 1024",  "base 1 256",
                                       "base 1 768", "tt@v2 1 1024", "tt@v2 2 512"};
    for (size_t i = 0; i < sizeof want / sizeof want[0]; i++) {
        if (!called(&d, want[i]))
            fprintf(stderr, "not asked: %s\n", want[i]);
        CHECK(called(&d, want[i]));
    }
    /* base 1 256 twice (a size and the default): the driver dedupes, asking twice is fine */
    CHECK(d.n == 7);
    CHECK(strcmp(d.calls[0], "base 1 512") == 0); /* the most created first */
    CHECK(!called(&d, "base 2 2048") && !called(&d, "base 4 4096") && !called(&d, "base 8 8192"));
    for (int i = 0; i < d.n; i++)
        CHECK(strncmp(d.calls[i], "gone", 4) != 0 && strncmp(d.calls[i], "other", 5) != 0);
    CHECK(st.asked == 7 && st.ready == 0 && st.refused == 0);

    /* A restart: a new reader finds the same sizes in the rows; the driver's answers count. */
    sp_sizes_destroy(s);
    d.n = 0;
    d.ready = "base 1 512";
    d.refused = "tt@v2 2 512";
    s = sp_sizes_create(loop, store, &d.base, &o, &e);
    REQUIRE(s != NULL);
    run_rounds(s, 1);
    sp_sizes_stats(s, &st);
    CHECK(d.n == 7 && st.asked == 7 && st.ready == 1 && st.refused == 1);
    for (size_t i = 0; i < sizeof want / sizeof want[0]; i++)
        CHECK(called(&d, want[i]));

    /* A new size created since shows at the next round (kicked here instead of the hour). */
    sandboxes(9, "other", NULL, 4, 1024, 1, NULL);
    d.n = 0;
    sp_sizes_kick(s);
    run_rounds(s, 2);
    CHECK(called(&d, "other 4 1024") && called(&d, "other 2 512"));
    CHECK(strcmp(d.calls[0], "other 4 1024") == 0); /* 9 creates: the most */

    /* A bound of 1: only the most created size of each template, and the defaults. */
    sp_sizes_destroy(s);
    d.n = 0;
    o.per_template = 1;
    s = sp_sizes_create(loop, store, &d.base, &o, &e);
    run_rounds(s, 1);
    CHECK(d.n == 6 && called(&d, "base 1 512") && !called(&d, "base 2 1024") &&
          called(&d, "base 1 256") && called(&d, "tt@v2 1 1024") && called(&d, "other 4 1024"));
    sp_sizes_destroy(s);

    /* A driver without prepare is never asked, and nothing breaks. */
    struct rec_driver nd = {.base = {.ops = &noprep_ops}};
    s = sp_sizes_create(loop, store, &nd.base, &o, &e);
    REQUIRE(s != NULL);
    run_for(100);
    sp_sizes_stats(s, &st);
    CHECK(st.rounds == 0 && nd.n == 0);
    sp_sizes_destroy(s);

    /* Bad options are refused; a read in flight outlives a destroy (its answer frees it). */
    o.per_template = 0;
    CHECK(sp_sizes_create(loop, store, &d.base, &o, &e) == NULL && e.code == SP_EINVAL);
    o.per_template = 2;
    s = sp_sizes_create(loop, store, &d.base, &o, &e);
    sp_loop_run_once(loop, 0); /* the first read is sent */
    sp_sizes_destroy(s);
    run_for(200);
    sp_store_destroy(store);
}

int main(void)
{
    int rc = fx_start("sizes");
    if (rc != 0)
        return rc;
    schema_rows();
    test_sizes_last_day_bounded_with_default();
    fx_stop();
    return check_report("sizes");
}
