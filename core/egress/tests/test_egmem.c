/*
 * test_egmem.c - the egress memory budget (core/egress/egmem.h): charges against a sandbox's
 * share and the global limit, refusals that change nothing, shares as sandboxes come and go,
 * one flooding sandbox against a quiet one, the log episodes, and the default limit.
 */
#include <stdio.h>

#include "core/egress/egmem.h"
#include "tests/check.h"

#define MiB (1ull << 20)

static void test_share_and_limit(void)
{
    sp_egmem_t m;
    sp_egmem_init(&m, 100 * MiB, 64 * MiB);
    /* No sandbox counted yet: the whole limit, capped per sandbox. */
    CHECK(sp_egmem_share(&m) == 64 * MiB);
    m.sandboxes = 1;
    CHECK(sp_egmem_share(&m) == 64 * MiB);
    m.sandboxes = 2;
    CHECK(sp_egmem_share(&m) == 50 * MiB);
    m.sandboxes = 4;
    CHECK(sp_egmem_share(&m) == 25 * MiB);

    sp_egmem_sb_t a = {0};
    bool first = true;
    CHECK(sp_egmem_charge(&m, &a, 25 * MiB, &first) == SP_EGMEM_OK);
    CHECK(!first);
    CHECK(a.used == 25 * MiB && m.used == 25 * MiB);
    CHECK(sp_egmem_room(&m, &a) == 0);
    CHECK(!sp_egmem_fits(&m, &a, 1));
    /* Refused: nothing changes, the episode starts once. */
    CHECK(sp_egmem_charge(&m, &a, 1, &first) == SP_EGMEM_SHARE);
    CHECK(first);
    CHECK(a.used == 25 * MiB && m.used == 25 * MiB && m.refused == 1);
    CHECK(sp_egmem_charge(&m, &a, 4096, &first) == SP_EGMEM_SHARE);
    CHECK(!first);
    CHECK(m.refused == 2);
    /* Back under half of the share: the next refusal is a new episode. */
    sp_egmem_release(&m, &a, 10 * MiB);
    CHECK(a.at_share); /* 15 MiB: not under half of 25 yet */
    sp_egmem_release(&m, &a, 3 * MiB);
    CHECK(!a.at_share);
    CHECK(sp_egmem_room(&m, &a) == 13 * MiB);
    CHECK(sp_egmem_charge(&m, &a, 14 * MiB, &first) == SP_EGMEM_SHARE && first);
    /* Releasing more than held gives back what is held, never below zero. */
    sp_egmem_release(&m, &a, 1000 * MiB);
    CHECK(a.used == 0 && m.used == 0);
    CHECK(m.peak == 25 * MiB);
    /* A charge larger than any share or the limit is refused, without overflow. */
    CHECK(sp_egmem_charge(&m, &a, UINT64_MAX, NULL) == SP_EGMEM_SHARE);
    CHECK(sp_egmem_charge(&m, &a, 26 * MiB, NULL) == SP_EGMEM_SHARE);
    CHECK(a.used == 0 && m.used == 0);
}

/* Credit for open connections leaves a quarter of the share free for new ones. */
static void test_keep(void)
{
    sp_egmem_t m;
    sp_egmem_init(&m, 64 * MiB, 64 * MiB);
    m.sandboxes = 1;
    sp_egmem_sb_t a = {0};
    uint64_t keep = sp_egmem_share(&m) / 4;
    bool first = false;
    CHECK(sp_egmem_charge_keep(&m, &a, 48 * MiB, keep, &first) == SP_EGMEM_OK);
    CHECK(sp_egmem_charge_keep(&m, &a, 1, keep, &first) == SP_EGMEM_SHARE && first);
    CHECK(a.used == 48 * MiB);
    /* First windows still fit, up to the whole share. */
    CHECK(sp_egmem_charge(&m, &a, 16 * MiB, NULL) == SP_EGMEM_OK);
    CHECK(sp_egmem_charge(&m, &a, 1, NULL) == SP_EGMEM_SHARE);
    /* No overflow with a huge keep. */
    CHECK(sp_egmem_charge_keep(&m, &a, 1, UINT64_MAX, NULL) == SP_EGMEM_SHARE);
    CHECK(a.used == 64 * MiB && m.used == 64 * MiB);
}

/* One sandbox opening connection after connection (each: its records and first window) until
 * refused never takes what another's share holds: the quiet one still gets all of its own. */
static void test_flood_leaves_the_others_their_share(void)
{
    const uint64_t conn = 4096 + 16384;
    sp_egmem_t m;
    sp_egmem_init(&m, 64 * MiB, 64 * MiB);
    m.sandboxes = 2;
    sp_egmem_sb_t flood = {0}, quiet = {0};
    unsigned n = 0;
    while (sp_egmem_charge(&m, &flood, conn, NULL) == SP_EGMEM_OK)
        n++;
    CHECK(n == (32 * MiB) / conn);
    CHECK(flood.used <= 32 * MiB);
    /* Its connections then ask for credit: refused too, by its share. */
    CHECK(sp_egmem_charge(&m, &flood, 64 * 1024, NULL) == SP_EGMEM_SHARE);
    unsigned q = 0;
    while (sp_egmem_charge(&m, &quiet, conn, NULL) == SP_EGMEM_OK)
        q++;
    CHECK(q == n);
    CHECK(m.used <= m.limit);

    /* A third sandbox attaches: the shares shrink to a third; the first two keep what they
     * hold (the total stays under the limit), and the newcomer gets what is left. */
    m.sandboxes = 3;
    sp_egmem_sb_t third = {0};
    bool first = false;
    sp_egmem_rc_t rc = sp_egmem_charge(&m, &third, conn, &first);
    CHECK(rc == SP_EGMEM_OK || rc == SP_EGMEM_GLOBAL);
    uint64_t before = m.used;
    while (sp_egmem_charge(&m, &third, conn, &first) == SP_EGMEM_OK)
        ;
    CHECK(m.used <= m.limit);
    CHECK(m.used >= before);
    CHECK(m.at_limit); /* the global limit refused it */
    CHECK(first || m.refused > 0);
    /* The flood lets go: the newcomer now gets up to its share, not beyond. */
    sp_egmem_release(&m, &flood, flood.used);
    CHECK(!m.at_limit || m.used >= m.limit / 2);
    while (sp_egmem_charge(&m, &third, conn, NULL) == SP_EGMEM_OK)
        ;
    CHECK(third.used <= sp_egmem_share(&m));
    CHECK(third.used + conn > sp_egmem_share(&m));
    /* The flooder, over its new share no more, gets a third too, never the quiet one's. */
    while (sp_egmem_charge(&m, &flood, conn, NULL) == SP_EGMEM_OK)
        ;
    CHECK(m.used <= m.limit);
    CHECK(quiet.used == q * conn);
}

/* The sum of every sandbox's charges is the total, through any order of charges and
 * releases. */
static void test_books_balance(void)
{
    sp_egmem_t m;
    sp_egmem_init(&m, 8 * MiB, 4 * MiB);
    m.sandboxes = 3;
    sp_egmem_sb_t s[3] = {{0}};
    unsigned x = 12345;
    for (int i = 0; i < 100000; i++) {
        x = x * 1103515245u + 12345u;
        sp_egmem_sb_t *t = &s[(x >> 16) % 3];
        uint64_t n = (x >> 8) % (300 * 1024);
        if (x & 1)
            sp_egmem_charge(&m, t, n, NULL);
        else
            sp_egmem_release(&m, t, n);
        if (m.used != s[0].used + s[1].used + s[2].used || m.used > m.limit ||
            t->used > sp_egmem_share(&m)) {
            CHECK(!"books out of balance");
            return;
        }
    }
}

static void test_default_limit(void)
{
    CHECK(sp_egmem_default_limit(16ull << 30) == 1ull << 30);
    CHECK(sp_egmem_default_limit(24ull << 30) == 1536 * MiB);
    CHECK(sp_egmem_default_limit(2ull << 30) == 256 * MiB);
    CHECK(sp_egmem_default_limit(128 * MiB) == 128 * MiB);
}

int main(void)
{
    test_share_and_limit();
    test_keep();
    test_flood_leaves_the_others_their_share();
    test_books_balance();
    test_default_limit();
    return check_report("egmem");
}
