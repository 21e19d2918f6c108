/*
 * agent.h - agent-wide constants.
 */
#ifndef SP_AGENT_AGENT_H
#define SP_AGENT_AGENT_H

#define SP_AGENT_VERSION "0.1.0"

/* Login-like PATH every process starts with. */
#define SP_AGENT_PATH "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"

/* Set by --init/--channel: identity may change hostname, clock and RNG. Off in
 * --listen-unix mode, which runs on a developer's or CI host. */
extern int sp_agent_apply_system;

#endif
