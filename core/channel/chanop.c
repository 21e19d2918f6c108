/*
 * chanop.c - an operation's agent stream, lifetime and credit (chanop_int.h).
 *
 * Owns nothing but the dispatch: the stream callbacks of every operation land here, are held
 * as entries, and reach the module only while the operation is alive.
 */
#include "core/channel/chanop_int.h"

/* One WINDOW frame carries a u32; stay well below it. */
#define GRANT_STEP 0x40000000u

void sp_chanop__init(sp_chanop_t *ch, const sp_chanop_ops_t *ops, void *obj)
{
    ch->s = NULL;
    ch->ops = ops;
    ch->obj = obj;
    ch->depth = 0;
    ch->dead = false;
}

void sp_chanop__enter(sp_chanop_t *ch)
{
    ch->depth++;
}

void sp_chanop__leave(sp_chanop_t *ch)
{
    if (--ch->depth == 0 && ch->dead)
        ch->ops->release(ch->obj);
}

void sp_chanop__kill(sp_chanop_t *ch)
{
    ch->dead = true;
    if (ch->s != NULL) {
        sp_agentstream_reset(ch->s);
        ch->s = NULL;
    }
}

void sp_chanop__cancel(sp_chanop_t *ch)
{
    if (ch->dead)
        return;
    sp_chanop__kill(ch);
    if (ch->depth == 0)
        ch->ops->release(ch->obj);
}

void sp_chanop__grant(sp_chanop_t *ch, size_t n)
{
    while (n > 0 && !ch->dead && ch->s != NULL) {
        uint32_t k = n > GRANT_STEP ? GRANT_STEP : (uint32_t)n;
        sp_agentstream_grant(ch->s, k);
        n -= k;
    }
}

/* ---- stream callbacks ---- */

static void on_frame(sp_agentstream_t *s, uint16_t type, uint16_t flags, const uint8_t *p,
                     size_t len, void *arg)
{
    sp_chanop_t *ch = arg;
    sp_chanop__enter(ch);
    if (flags & SP_AP_F_END)
        ch->s = NULL; /* the connection frees the stream after this call */
    if (!ch->dead)
        ch->ops->frame(ch->obj, type, flags, p, len);
    sp_chanop__leave(ch);
}

static void on_error(sp_agentstream_t *s, const sp_err_t *err, void *arg)
{
    sp_chanop_t *ch = arg;
    sp_chanop__enter(ch);
    ch->s = NULL; /* freed by the connection after this call */
    if (!ch->dead)
        ch->ops->lost(ch->obj, err);
    sp_chanop__leave(ch);
}

static void on_writable(sp_agentstream_t *s, void *arg)
{
    sp_chanop_t *ch = arg;
    sp_chanop__enter(ch);
    if (!ch->dead && ch->ops->writable != NULL)
        ch->ops->writable(ch->obj);
    sp_chanop__leave(ch);
}

static const sp_agentstream_cbs_t stream_cbs = {on_frame, on_error, on_writable};

int sp_chanop__open(sp_chanop_t *ch, sp_agentconn_t *c, uint16_t type, const uint8_t *payload,
                    size_t len, sp_err_t *err)
{
    ch->s = sp_agentconn_open(c, type, payload, len, &stream_cbs, ch, err);
    if (ch->s == NULL) {
        if (err != NULL && err->code == SP_EUNAVAIL)
            sp_err_set(err, SP_EUNAVAIL, "sandbox agent is not connected");
        return -1;
    }
    return 0;
}
