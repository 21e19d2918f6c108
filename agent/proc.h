/*
 * proc.h - processes started for the host: fork/exec as a user, pipes or a
 * PTY, bounded output rings, attach/re-attach, exit reporting.
 *
 * Owns every child the agent starts, their fds and rings. Processes outlive
 * the streams (and sessions) that watch them; finished ones are kept for a
 * while so a late re-attach still sees their output and exit status.
 */
#ifndef SP_AGENT_PROC_H
#define SP_AGENT_PROC_H

#include <stdint.h>

/* Sets up SIGCHLD delivery (signalfd). Call once before the loop. 0 or -1. */
int sp_proc_init(void);

/* Housekeeping between loop iterations: drops old finished processes. */
void sp_proc_tick(void);

/* Stream openers, called by sess with the opening frame's payload. */
void sp_proc_on_start(uint32_t id, const uint8_t *p, uint32_t n);
void sp_proc_on_attach(uint32_t id, const uint8_t *p, uint32_t n);
void sp_proc_on_list(uint32_t id, const uint8_t *p, uint32_t n);

#endif
