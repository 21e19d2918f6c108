/*
 * chanop_int.h - what every operation on a host-opened agent stream shares (exec.c,
 * session.c, code.c): the stream, the operation's lifetime across re-entrant callbacks, and
 * credit handed back to the agent.
 *
 * Lifetime: an operation may be cancelled, or reach its end, from inside its own callback
 * chain (a stream callback calls the user, who cancels). Every entry from the loop (stream
 * callbacks, which this file dispatches, and the module's timers) holds depth; cancel or a
 * terminal delivery marks the operation dead and resets its stream at once, so no stream
 * callback reaches it afterwards, and the outermost entry releases it when it leaves.
 *
 * Credit: the agent sends no more than the window we granted, so an operation holds at most
 * one window (SP_AP_INITIAL_WINDOW) of output; sp_chanop__grant gives bytes back once its
 * consumer passed them on.
 *
 * Internal to core/channel. Knows no operation kinds: the module keeps its own state in obj.
 */
#ifndef SP_CHANOP_INT_H
#define SP_CHANOP_INT_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "base/err.h"
#include "core/channel/agentconn.h"

typedef struct {
    /* A frame on the stream (payload borrowed). With SP_AP_F_END in flags the stream is over:
     * ch->s is already NULL. Only while the operation is alive. */
    void (*frame)(void *obj, uint16_t type, uint16_t flags, const uint8_t *p, size_t len);
    /* The stream ended without END (channel lost): ch->s is already NULL. Only while alive. */
    void (*lost)(void *obj, const sp_err_t *err);
    /* Send credit came back after a refused send. Only while alive; may be NULL. */
    void (*writable)(void *obj);
    /* Frees obj: called once, when the operation is dead and no entry is open. */
    void (*release)(void *obj);
} sp_chanop_ops_t;

typedef struct {
    sp_agentstream_t *s; /* NULL once the stream ended, was lost or reset */
    const sp_chanop_ops_t *ops;
    void *obj;
    int depth; /* entries from the loop in progress */
    bool dead; /* cancelled or delivered its end: released when depth drops to 0 */
} sp_chanop_t;

void sp_chanop__init(sp_chanop_t *ch, const sp_chanop_ops_t *ops, void *obj);

/* Opens the operation's stream (ch->s must be NULL) with its first frame. -1 with err when it
 * cannot (SP_EUNAVAIL "sandbox agent is not connected" when the channel is down); nothing is
 * released then. Stream callbacks never run inside this call. */
int sp_chanop__open(sp_chanop_t *ch, sp_agentconn_t *c, uint16_t type, const uint8_t *payload,
                    size_t len, sp_err_t *err);

/* An entry from the loop (a timer, say) begins and ends. leave releases the operation when it
 * is dead and this was the outermost entry: the caller must not touch obj after it. */
void sp_chanop__enter(sp_chanop_t *ch);
void sp_chanop__leave(sp_chanop_t *ch);

/* Marks the operation dead and resets its stream: no stream callback reaches it any more.
 * Called before a terminal delivery; the outermost entry releases it. */
void sp_chanop__kill(sp_chanop_t *ch);

/* Stops the operation from outside or inside its callbacks: kill, then release at once when
 * no entry is open. Nothing when it is already dead. */
void sp_chanop__cancel(sp_chanop_t *ch);

/* Gives the agent n more bytes of credit on the stream; nothing once the operation is dead or
 * the stream is over. */
void sp_chanop__grant(sp_chanop_t *ch, size_t n);

#endif
