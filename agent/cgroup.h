/*
 * cgroup.h - the guest's workload cgroup: every command the agent starts
 * runs in a cgroup v2 group, one per command inside one for all. The CPU is
 * shared between commands at equal weight, and memory and task limits leave
 * the agent (in the root group, at a real-time priority) room to answer
 * however the workload behaves (a fork bomb, a memory bomb), so the sandbox
 * stays reachable and a kill still gets through: a killed command takes
 * every process it started along.
 */
#ifndef SP_AGENT_CGROUP_H
#define SP_AGENT_CGROUP_H

#include <stdint.h>
#include <sys/types.h>

/* Where the group lives in the guest. */
#define SP_CGROUP_ROOT "/sys/fs/cgroup"
#define SP_CGROUP_WORK SP_CGROUP_ROOT "/sandbox"

/* What sp_cgroup_limits computes for a guest of mem_total bytes. */
typedef struct {
    uint64_t pids_max; /* tasks (processes and threads) the workload may have */
    /* The workload's memory, all commands together: above one command's, below what was
     * available at boot by half the headroom. */
    uint64_t memory_max;
    /* One command's limits: its memory (what was available at boot less a headroom), and
     * its tasks, below the workload's so that the other commands still have room. */
    uint64_t cmd_memory_max, cmd_pids_max;
} sp_cgroup_limits_t;

/* The workload's limits for a guest with mem_total bytes of RAM of which mem_avail
 * were available at boot (/proc/meminfo's MemTotal and MemAvailable). Pure. */
sp_cgroup_limits_t sp_cgroup_limits(uint64_t mem_total, uint64_t mem_avail);

/*
 * PID 1 at boot: mounts cgroup2 at SP_CGROUP_ROOT when missing, enables the
 * memory, pids and cpu controllers for its children and creates
 * SP_CGROUP_WORK with the limits for this guest's RAM. A kernel without
 * cgroup v2 (or a controller) only logs: commands then run unconfined.
 * 0 when the group is ready, -1 otherwise.
 */
int sp_cgroup_setup(void);

/*
 * Parent, before fork: a group of its own for the next command, under
 * SP_CGROUP_WORK (an empty one a finished command left, else a new one), with
 * limits below the workload's so a command that forks without end leaves the
 * others room. Its number (> 0), or 0 when
 * there is no group (the command then runs in the workload group, or
 * unconfined without one).
 */
uint32_t sp_cgroup_cmd_new(void);

/*
 * fork() with the child born in command group cmd: clone3 with
 * CLONE_INTO_CGROUP, so no process is ever moved between groups. Moving one
 * takes the lock every fork and exit takes, and under a fork bomb at its
 * memory limit that stalled the agent for good. A kernel without clone3 gets
 * fork() and a move in the child. With cmd 0 or without the workload group,
 * plain fork() (the child stays in the agent's group). The child is given
 * back to the OOM killer the agent opted out of. Returns what fork() does.
 */
pid_t sp_cgroup_fork(uint32_t cmd);

/*
 * Kills every process in command group cmd at once (cgroup.kill), those
 * that left the command's process group and session included. 0, or -1 when
 * the group is gone or the kernel cannot.
 */
int sp_cgroup_kill(uint32_t cmd);

/*
 * The agent's loop, each turn (it looks at most twice a second): while many
 * more tasks are runnable than there are CPUs (a fork bomb has hundreds),
 * the agent runs SCHED_RR at the lowest real-time priority, so it gets the
 * CPU as soon as it has work; once the crowd is gone it is a normal process
 * again (always at a real-time priority, it made output streaming a third
 * slower under TCG: it took the CPU at every write into a pipe). Its
 * children are always born normal (SCHED_RESET_ON_FORK).
 */
void sp_cgroup_tick(void);

/*
 * A command's own process has ended (reaped): its group, when nothing is left
 * in it, is kept for a later command (sp_cgroup_cmd_new takes it) or removed;
 * when processes outlived the command it stays until they are gone
 * (sp_cgroup_sweep). Returns cmd while the group still holds processes, which
 * sp_cgroup_kill may then reach, else 0: the number may be given to another
 * command and must not be used again.
 */
uint32_t sp_cgroup_cmd_done(uint32_t cmd);

/* Removes the groups that processes outlived their command in, once empty; those still
 * populated stay. Cheap: it looks only at those groups. */
void sp_cgroup_sweep(void);

#endif
