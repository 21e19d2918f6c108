/*
 * agent.h - agent-wide constants.
 *
 * Folder: agent/ is space-agent, which runs inside every guest; it links base/ only.
 * (ARCHITECTURE.md: the layers.)
 */
#ifndef SP_AGENT_AGENT_H
#define SP_AGENT_AGENT_H

#include "base/agentproto.h"

#define SP_AGENT_VERSION "0.1.0"

/* Login-like PATH every process starts with. */
#define SP_AGENT_PATH "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"

/* Set by --init/--channel: identity may change hostname, clock and RNG. Off in
 * --listen-unix mode, which runs on a developer's or CI host. */
extern int sp_agent_apply_system;

/* Where IDENTITY's env is written for programs started before it (the code daemon reads it
 * so the sandbox's env reaches interpreters that a template snapshot already held): NUL-
 * separated K=V, mode 0600, replaced atomically. NULL: not written. The guest default is
 * SP_AGENT_ENV_FILE; --env-file sets it (host tests). */
#define SP_AGENT_ENV_FILE SP_AP_ENV_FILE
extern const char *sp_agent_env_file;

#endif
