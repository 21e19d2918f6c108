/*
 * egmem.c - the egress proxy's memory budget (core/egress/egmem.h).
 */
#include "core/egress/egmem.h"

#include <stddef.h>

void sp_egmem_init(sp_egmem_t *m, uint64_t limit, uint64_t sb_limit)
{
    *m = (sp_egmem_t){.limit = limit, .sb_limit = sb_limit};
}

uint64_t sp_egmem_share(const sp_egmem_t *m)
{
    uint64_t fair = m->limit / (m->sandboxes > 0 ? m->sandboxes : 1);
    return fair < m->sb_limit ? fair : m->sb_limit;
}

static sp_egmem_rc_t check(const sp_egmem_t *m, const sp_egmem_sb_t *s, uint64_t n, uint64_t keep)
{
    uint64_t share = sp_egmem_share(m);
    n = n + keep < n ? UINT64_MAX : n + keep;
    if (n > share || s->used > share - n)
        return SP_EGMEM_SHARE; /* first: when both refuse, the sandbox's own limit is why */
    if (n > m->limit || m->used > m->limit - n)
        return SP_EGMEM_GLOBAL;
    return SP_EGMEM_OK;
}

bool sp_egmem_fits(const sp_egmem_t *m, const sp_egmem_sb_t *s, uint64_t n)
{
    return check(m, s, n, 0) == SP_EGMEM_OK;
}

uint64_t sp_egmem_room(const sp_egmem_t *m, const sp_egmem_sb_t *s)
{
    uint64_t g = m->used < m->limit ? m->limit - m->used : 0;
    uint64_t share = sp_egmem_share(m);
    uint64_t l = s->used < share ? share - s->used : 0;
    return g < l ? g : l;
}

sp_egmem_rc_t sp_egmem_charge(sp_egmem_t *m, sp_egmem_sb_t *s, uint64_t n, bool *first)
{
    return sp_egmem_charge_keep(m, s, n, 0, first);
}

sp_egmem_rc_t sp_egmem_charge_keep(sp_egmem_t *m, sp_egmem_sb_t *s, uint64_t n, uint64_t keep,
                                   bool *first)
{
    if (first != NULL)
        *first = false;
    sp_egmem_rc_t rc = check(m, s, n, keep);
    if (rc == SP_EGMEM_OK) {
        s->used += n;
        m->used += n;
        if (m->used > m->peak)
            m->peak = m->used;
        return rc;
    }
    m->refused++;
    bool *flag = rc == SP_EGMEM_GLOBAL ? &m->at_limit : &s->at_share;
    if (!*flag && first != NULL)
        *first = true;
    *flag = true;
    return rc;
}

void sp_egmem_release(sp_egmem_t *m, sp_egmem_sb_t *s, uint64_t n)
{
    if (n > s->used)
        n = s->used;
    s->used -= n;
    m->used -= n < m->used ? n : m->used;
    if (m->at_limit && m->used < m->limit / 2)
        m->at_limit = false;
    if (s->at_share && s->used < sp_egmem_share(m) / 2)
        s->at_share = false;
}

uint64_t sp_egmem_default_limit(uint64_t phys)
{
    uint64_t floor = 256ull << 20;
    uint64_t v = phys / 16;
    if (v < floor)
        v = phys < floor ? phys : floor;
    return v;
}
