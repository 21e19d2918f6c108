/*
 * egmem.h - the egress proxy's memory budget (pure: no loop, no I/O), which core/egress/proxy.c
 * charges for every byte a guest can make spaced hold for its outbound connections.
 *
 * What is charged, per connection: a fixed cost for its records (SP_EGMEM_CONN_COST), the
 * credit the agent holds on its stream (the initial window when the stream opens, each grant
 * after) until the bytes it lets the guest send have been taken by the upstream socket, the
 * request heads the proxy keeps, and for a connection handed to the credential relay the
 * relay's buffers and TLS sessions (SP_EGMEM_MITM_COST). Bytes the upstream sends are not:
 * the upstream socket is read only as far as the guest's credit goes.
 *
 * Two limits, both checked by every charge:
 *  - global: the sum over all sandboxes never passes `limit` (--egress-memory-mb);
 *  - per sandbox: its sum never passes its share, min(sb_limit, limit / sandboxes), with
 *    `sandboxes` the number attached now. A sandbox cannot take another's share, so one
 *    flooding never starves the others; a share left unused by an idle sandbox is not lent.
 *    When sandboxes attach, the shares shrink: charges already made stay until released,
 *    so the sum may sit above a new share for a while (never above the global limit).
 * A refused charge changes nothing; the caller makes the connection wait (credit not granted
 * until something is released) or refuses it.
 */
#ifndef SP_EGMEM_H
#define SP_EGMEM_H

#include <stdbool.h>
#include <stdint.h>

#define SP_EGMEM_CONN_COST 4096u /* a connection's records (proxy, stream, lookup) */
/* A credential relay connection's buffers (guest input, upstream output, guest output:
 * core/egress/mitm_conn.c) and its two TLS sessions. */
#define SP_EGMEM_MITM_COST ((128u + 256u + 256u + 128u) * 1024u)

typedef struct {
    uint64_t limit;     /* all sandboxes together, bytes */
    uint64_t sb_limit;  /* one sandbox at most, bytes */
    unsigned sandboxes; /* attached: the global limit is shared among them */
    uint64_t used;      /* charged now */
    uint64_t peak;      /* the most used has been */
    uint64_t refused;   /* charges refused since start */
    bool at_limit;      /* a charge was refused by the global limit and used has not yet fallen
                           below half of it since (for one log line per episode) */
} sp_egmem_t;

typedef struct {
    uint64_t used; /* this sandbox's charges now */
    bool at_share; /* refused by its share, not yet below half of it since */
} sp_egmem_sb_t;

typedef enum {
    SP_EGMEM_OK = 0,
    SP_EGMEM_SHARE,  /* the sandbox's share is used up */
    SP_EGMEM_GLOBAL, /* the global limit is reached */
} sp_egmem_rc_t;

void sp_egmem_init(sp_egmem_t *m, uint64_t limit, uint64_t sb_limit);
/* min(sb_limit, limit / max(sandboxes, 1)) */
uint64_t sp_egmem_share(const sp_egmem_t *m);
/* Charges n to the sandbox and the total, or nothing and says which limit refused it. *first
 * (may be NULL) is set when this refusal starts an episode (the first since usage last fell
 * below half of that limit): the caller logs it once. */
sp_egmem_rc_t sp_egmem_charge(sp_egmem_t *m, sp_egmem_sb_t *s, uint64_t n, bool *first);
/* The same, refused unless keep bytes are left free below both limits after it (credit for
 * connections already open leaves room for new ones' first windows). */
sp_egmem_rc_t sp_egmem_charge_keep(sp_egmem_t *m, sp_egmem_sb_t *s, uint64_t n, uint64_t keep,
                                   bool *first);
/* Gives back n (at most what the sandbox holds). */
void sp_egmem_release(sp_egmem_t *m, sp_egmem_sb_t *s, uint64_t n);
/* Whether a charge of n would pass now (nothing charged). */
bool sp_egmem_fits(const sp_egmem_t *m, const sp_egmem_sb_t *s, uint64_t n);
/* The most a charge to s could be now. */
uint64_t sp_egmem_room(const sp_egmem_t *m, const sp_egmem_sb_t *s);

/* The default global limit for a host with phys bytes of memory: a sixteenth, at least
 * 256 MiB (and phys itself when that is less). */
uint64_t sp_egmem_default_limit(uint64_t phys);

#endif
