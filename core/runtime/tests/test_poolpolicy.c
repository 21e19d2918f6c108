/*
 * test_poolpolicy.c - the spare pool's targets with an injected clock: one create keeps one
 * spare, a burst or a rate asks for more (capped), an idle size shrinks back, the memory budget
 * holds, and a simulated pool driven by the targets never exceeds it nor hands a spare out twice.
 */
#include <stdio.h>
#include <string.h>

#include "core/runtime/poolpolicy.h"
#include "tests/check.h"

static sp_poolpolicy_t *make(int max, uint64_t budget)
{
    sp_poolpolicy_opts_t o = {
        .max_per_size = max, .budget_mb = budget, .window_ms = 10000, .decay_ms = 60000};
    sp_poolpolicy_t *p = sp_poolpolicy_create(&o);
    REQUIRE(p != NULL);
    return p;
}

static void single_and_burst(void)
{
    sp_poolpolicy_t *p = make(16, 100000);
    uint64_t t = 1000000;
    CHECK(sp_poolpolicy_target(p, "a", t) == 0); /* never created from */
    CHECK(sp_poolpolicy_create_seen(p, "a", t, 256) == 0);
    CHECK(sp_poolpolicy_target(p, "a", t) == 1); /* one create: one spare, as before */
    t += 30000;
    CHECK(sp_poolpolicy_create_seen(p, "a", t, 256) == 0);
    CHECK(sp_poolpolicy_target(p, "a", t) == 1); /* creates further apart than the window */
    /* a burst of 8 within a second */
    for (int i = 0; i < 8; i++)
        CHECK(sp_poolpolicy_create_seen(p, "a", t + 20000 + (uint64_t)i * 100, 256) == 0);
    t += 21000;
    CHECK(sp_poolpolicy_target(p, "a", t) == 8);
    /* a steady 1 per 2 s: 5 per window, below the burst's level: it stays */
    t += 15000;
    for (int i = 0; i < 10; i++)
        sp_poolpolicy_create_seen(p, "a", t + (uint64_t)i * 2000, 256);
    t += 18000;
    CHECK(sp_poolpolicy_target(p, "a", t) == 8);
    /* idle: a quarter fewer (at least one) per decay period after the last create, never
     * below one: 8, 6, 5, 4, 3, 2, 1 */
    CHECK(sp_poolpolicy_target(p, "a", t + 59999) == 8);
    CHECK(sp_poolpolicy_target(p, "a", t + 60000) == 6);
    CHECK(sp_poolpolicy_target(p, "a", t + 180000) == 4);
    CHECK(sp_poolpolicy_target(p, "a", t + 359999) == 2);
    CHECK(sp_poolpolicy_target(p, "a", t + 360000) == 1);
    CHECK(sp_poolpolicy_target(p, "a", t + 3600000) == 1);
    /* a create while decayed: back to growing from where it is */
    t += 3600000;
    sp_poolpolicy_create_seen(p, "a", t, 256);
    CHECK(sp_poolpolicy_target(p, "a", t) == 1);
    /* a burst larger than the cap */
    for (int i = 0; i < 40; i++)
        sp_poolpolicy_create_seen(p, "a", t + 1000 + (uint64_t)i * 10, 256);
    CHECK(sp_poolpolicy_target(p, "a", t + 2000) == 16);
    sp_poolpolicy_forget(p, "a");
    CHECK(sp_poolpolicy_target(p, "a", t + 2000) == 0);
    CHECK(!sp_poolpolicy_fits(p, "a", 0));
    sp_poolpolicy_destroy(p);
    sp_poolpolicy_destroy(NULL);
    sp_poolpolicy_opts_t bad = {.max_per_size = 0, .budget_mb = 1};
    CHECK(sp_poolpolicy_create(&bad) == NULL);
    bad.max_per_size = SP_POOLPOLICY_PER_SIZE_MAX + 1;
    CHECK(sp_poolpolicy_create(&bad) == NULL);
}

/* A steady rate over a whole window asks for all of its creates (more than the creates one
 * size's ring could once hold), and a large level goes back by quarters when idle. */
static void rate_and_decay(void)
{
    sp_poolpolicy_t *p = make(SP_POOLPOLICY_PER_SIZE_MAX, 100000);
    uint64_t t = 1000;
    for (int i = 0; i < 100; i++) /* 10 per s for 10 s */
        CHECK(sp_poolpolicy_create_seen(p, "a", t + (uint64_t)i * 99, 40) == 0);
    t += 99 * 99;
    CHECK(sp_poolpolicy_target(p, "a", t) == 100);
    CHECK(sp_poolpolicy_target(p, "a", t + 60000) == 75);
    CHECK(sp_poolpolicy_target(p, "a", t + 120000) == 57);
    CHECK(sp_poolpolicy_target(p, "a", t + 20 * 60000) == 1);
    /* the whole ring: 300 creates within a window count as its size, capped by the maximum */
    t += 3600000;
    for (int i = 0; i < 300; i++)
        sp_poolpolicy_create_seen(p, "a", t + (uint64_t)i * 10, 40);
    CHECK(sp_poolpolicy_target(p, "a", t + 3000) == SP_POOLPOLICY_PER_SIZE_MAX);
    sp_poolpolicy_destroy(p);
}

static void budget(void)
{
    sp_poolpolicy_t *p = make(16, 1000);
    uint64_t t = 5000;
    for (int i = 0; i < 10; i++)
        sp_poolpolicy_create_seen(p, "big", t + (uint64_t)i, 300);
    CHECK(sp_poolpolicy_target(p, "big", t + 10) == 3); /* 3 x 300 <= 1000 < 4 x 300 */
    CHECK(sp_poolpolicy_cost(p, "big") == 300);
    CHECK(sp_poolpolicy_fits(p, "big", 700));
    CHECK(!sp_poolpolicy_fits(p, "big", 701));
    CHECK(!sp_poolpolicy_fits(p, "big", 5000)); /* over already (a size's cost went up) */
    /* measured smaller: more fit */
    sp_poolpolicy_measured(p, "big", 34);
    CHECK(sp_poolpolicy_target(p, "big", t + 10) == 10);
    sp_poolpolicy_measured(p, "big", 0); /* ignored */
    CHECK(sp_poolpolicy_cost(p, "big") == 34);
    sp_poolpolicy_measured(p, "big", 300);
    /* a second size, created from more recently, takes the budget first */
    t += 100;
    for (int i = 0; i < 2; i++)
        sp_poolpolicy_create_seen(p, "small", t + (uint64_t)i, 100);
    CHECK(sp_poolpolicy_target(p, "small", t + 10) == 2);
    CHECK(sp_poolpolicy_target(p, "big", t + 10) == 2); /* (1000 - 200) / 300 */
    /* the host can spare less than the budget: the limit is the budget in force, and
     * lifting it gives the budget back */
    sp_poolpolicy_limit(p, 350);
    CHECK(sp_poolpolicy_budget(p) == 350);
    CHECK(sp_poolpolicy_target(p, "small", t + 10) == 2);
    CHECK(sp_poolpolicy_target(p, "big", t + 10) == 0); /* (350 - 200) / 300 */
    CHECK(sp_poolpolicy_fits(p, "small", 200) && !sp_poolpolicy_fits(p, "small", 251));
    sp_poolpolicy_limit(p, 0);
    CHECK(sp_poolpolicy_target(p, "small", t + 10) == 0 && !sp_poolpolicy_fits(p, "small", 0));
    sp_poolpolicy_limit(p, UINT64_MAX);
    CHECK(sp_poolpolicy_budget(p) == 1000 && sp_poolpolicy_target(p, "big", t + 10) == 2);
    /* no budget at all: no spares */
    sp_poolpolicy_t *z = make(4, 0);
    sp_poolpolicy_create_seen(z, "a", 1, 10);
    CHECK(sp_poolpolicy_target(z, "a", 1) == 0 && !sp_poolpolicy_fits(z, "a", 0));
    sp_poolpolicy_destroy(z);
    /* a key too long for the records: refused, not truncated into another size's */
    char longkey[SP_POOLPOLICY_KEY_MAX + 8];
    memset(longkey, 'k', sizeof longkey - 1);
    longkey[sizeof longkey - 1] = '\0';
    CHECK(sp_poolpolicy_create_seen(p, longkey, t, 10) == -1);
    sp_poolpolicy_destroy(p);
}

/* A pool driven as qemu/pool.c drives it: each step drops the spares beyond a size's target,
 * then starts one (the CPU rule: one spare in the making at a time) where a size has fewer
 * and it fits; a spare takes MAKE_MS to become ready; creates take a ready spare if there is
 * one. Bursts and idle spells alternate. */
#define NSP 256
#define MAKE_MS 1500
struct spare {
    int key; /* -1: gone */
    uint64_t ready_at;
    int taken; /* creates that took it */
};

static void simulated_pool(void)
{
    const char *keys[2] = {"k0", "k1"};
    const uint64_t cost[2] = {256, 512};
    const uint64_t budget_mb = 3000;
    sp_poolpolicy_t *p = make(8, budget_mb);
    static struct spare sp[NSP];
    int nsp = 0, creates = 0, hits = 0, peak[2] = {0, 0};
    uint64_t used_peak = 0;
    for (uint64_t t = 1000; t < 1000 + 40 * 60000; t += 100) {
        /* load: a burst of 12 creates of k0 at minute 1, of k1 and k0 at minute 10, then
         * 1 per 3 s of k0 for a minute, then idle */
        int want = 0, wkey = 0;
        uint64_t m = (t - 1000) / 100;
        if (m >= 600 && m < 612)
            want = 1;
        if (m >= 6000 && m < 6012)
            want = 1, wkey = (int)(m & 1);
        if (m >= 7200 && m < 7800 && m % 30 == 0)
            want = 1;
        for (int c = 0; c < want; c++) {
            creates++;
            sp_poolpolicy_create_seen(p, keys[wkey], t, cost[wkey]);
            for (int i = 0; i < nsp; i++) {
                if (sp[i].key == wkey && sp[i].ready_at <= t) {
                    sp[i].taken++;
                    sp[i].key = -1; /* it is the sandbox's now */
                    hits++;
                    break;
                }
            }
        }
        /* the pool's step */
        uint64_t used = 0;
        bool making = false;
        int count[2] = {0, 0};
        for (int i = 0; i < nsp; i++) {
            if (sp[i].key < 0)
                continue;
            count[sp[i].key]++;
            used += cost[sp[i].key];
            making |= sp[i].ready_at > t;
        }
        for (int k = 0; k < 2; k++) {
            int tg = sp_poolpolicy_target(p, keys[k], t);
            for (int i = nsp - 1; i >= 0 && count[k] > tg; i--) {
                if (sp[i].key == k) {
                    sp[i].key = -1;
                    count[k]--;
                    used -= cost[k];
                }
            }
            if (count[k] > peak[k])
                peak[k] = count[k];
        }
        for (int k = 0; k < 2 && !making; k++) {
            if (count[k] < sp_poolpolicy_target(p, keys[k], t) &&
                sp_poolpolicy_fits(p, keys[k], used) && nsp < NSP) {
                sp[nsp++] = (struct spare){.key = k, .ready_at = t + MAKE_MS};
                used += cost[k];
                making = true;
            }
        }
        CHECK(used <= budget_mb);
        if (used > used_peak)
            used_peak = used;
    }
    /* after the bursts the pool grew past one spare, then shrank back to one per size */
    CHECK(peak[0] > 1 && peak[0] <= 8);
    CHECK(peak[1] >= 1);
    int left[2] = {0, 0};
    for (int i = 0; i < nsp; i++) {
        CHECK(sp[i].taken <= 1); /* never handed to two creates */
        if (sp[i].key >= 0)
            left[sp[i].key]++;
    }
    CHECK(left[0] == 1 && left[1] == 1);
    CHECK(hits > 1 && hits < creates);
    printf("simulated pool: %d creates, %d from a spare, peak k0 %d k1 %d, peak memory %llu of "
           "%llu MiB\n",
           creates, hits, peak[0], peak[1], (unsigned long long)used_peak,
           (unsigned long long)budget_mb);
    sp_poolpolicy_destroy(p);
}

int main(void)
{
    single_and_burst();
    rate_and_decay();
    budget();
    simulated_pool();
    return check_report("core.poolpolicy");
}
