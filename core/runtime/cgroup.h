/*
 * cgroup.h - per-VM control groups: CPU, memory and pids limits for one
 * process tree, on cgroup v2 or v1 hosts.
 *
 * The host's layout is detected once (sp_cgroup_create) from
 * /proc/self/mountinfo:
 *
 *   v2    a cgroup2 mount whose root offers cpu, memory and pids; they are
 *         enabled in the root's and space.slice's cgroup.subtree_control and
 *         each VM gets <mount>/space.slice/vm-<id> (cpu.max, memory.max,
 *         pids.max).
 *   v1    separate hierarchies carrying cpu, memory and (if present) pids,
 *         wherever they are mounted; each VM gets <mount>/space/vm-<id> in
 *         each (cpu.cfs_period_us + cpu.cfs_quota_us, memory.limit_in_bytes
 *         and memory.memsw.limit_in_bytes where swap accounting exists,
 *         pids.max). Co-mounted controllers share one directory.
 *   none  neither: sp_cgroup_why() says why; VMs run without limits.
 *
 * A VM's process joins its groups itself, between fork and exec, by writing
 * "0" to the fds from sp_cgroup_vm_create (cgroup.procs on v2; on v1 "tasks",
 * which moves its one thread without a host-wide lock; sp_cgroup_join is
 * async-signal-safe), so it never runs outside them. Groups outlive their
 * creator: a restarted driver finds them by name. Owns no process; knows no
 * QEMU.
 */
#ifndef SP_CGROUP_H
#define SP_CGROUP_H

#include <limits.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

typedef enum {
    SP_CGROUP_NONE = 0,
    SP_CGROUP_V1,
    SP_CGROUP_V2,
} sp_cgroup_kind_t;

/* Where the controllers we use are mounted; "" when absent. */
typedef struct {
    char v2[PATH_MAX];     /* a cgroup2 mount (the first, preferring one of the hierarchy root) */
    char cpu[PATH_MAX];    /* v1 hierarchy carrying cpu (often co-mounted with cpuacct) */
    char memory[PATH_MAX]; /* v1 hierarchy carrying memory */
    char pids[PATH_MAX];   /* v1 hierarchy carrying pids */
} sp_cgroup_mounts_t;

/* What one VM may use. */
typedef struct {
    uint64_t mem_bytes;     /* memory.max / memory.limit_in_bytes */
    uint64_t cpu_quota_us;  /* per cpu_period_us */
    uint64_t cpu_period_us; /* 100000 */
    unsigned pids_max;
} sp_cgroup_limits_t;

#define SP_CGROUP_CPU_PERIOD_US 100000u
#define SP_CGROUP_PIDS_MAX      512u
#define SP_CGROUP_JOIN_MAX      3 /* cgroup.procs fds per VM: one per distinct hierarchy */

/* Pure: the cgroup mounts in a /proc/<pid>/mountinfo text (octal escapes in mount points
 * decoded). Lines it does not understand are skipped. Fills *out entirely. */
void sp_cgroup_parse_mountinfo(const char *text, sp_cgroup_mounts_t *out);

/* Pure: the layout to use given the mounts and the text of the cgroup2 mount's
 * cgroup.controllers (NULL or "" when unreadable). v2 needs cpu, memory and pids there;
 * v1 needs cpu and memory hierarchies (pids is used when mounted). */
sp_cgroup_kind_t sp_cgroup_pick(const sp_cgroup_mounts_t *m, const char *v2_controllers);

/* Pure: limits for a VM of cpu_count vCPUs and memory_mb MiB of guest RAM (<= 0: 1 vCPU,
 * 256 MiB) plus QEMU's own overhead_mb. */
void sp_cgroup_limits(int cpu_count, int memory_mb, int overhead_mb, sp_cgroup_limits_t *out);

/* Pure: true when word appears in list as a whole token (separators: space, comma, newline). */
bool sp_cgroup_has_token(const char *list, const char *word);

typedef struct sp_cgroup sp_cgroup_t;

/* Detects the host's layout and prepares the parent groups (mkdir, subtree_control).
 * Never fails for lack of cgroups: the result then has kind NONE and a reason.
 * NULL only when out of memory. */
sp_cgroup_t *sp_cgroup_create(void);
void sp_cgroup_destroy(sp_cgroup_t *cg); /* NULL does nothing; groups stay */

sp_cgroup_kind_t sp_cgroup_kind(const sp_cgroup_t *cg);
/* Why the kind is NONE, or a one-line description of the layout; borrowed. */
const char *sp_cgroup_why(const sp_cgroup_t *cg);

/* cgroup.procs fds a child writes itself into before exec. */
typedef struct {
    int fd[SP_CGROUP_JOIN_MAX];
    int n;
} sp_cgroup_join_t;

/* Creates (or reuses) the groups for VM id, sets *lim, opens their cgroup.procs (v1: tasks) into
 * *join
 * (the caller closes them with sp_cgroup_join_close). -1 with errno set and a reason in why
 * (for a log line) when the layout is NONE or any step fails; nothing is then left behind
 * except groups that already existed. */
int sp_cgroup_vm_create(sp_cgroup_t *cg, const char *id, const sp_cgroup_limits_t *lim,
                        sp_cgroup_join_t *join, char *why, size_t why_n);

/* In a forked child, single-threaded: writes the calling process into every group of *join.
 * Only async-signal-safe calls. -1 with errno on the first failure. */
int sp_cgroup_join(const sp_cgroup_join_t *join);

void sp_cgroup_join_close(sp_cgroup_join_t *join);

/* True when VM id has a group (in the memory hierarchy on v1). */
bool sp_cgroup_vm_exists(const sp_cgroup_t *cg, const char *id);

/* Kills whatever is left in VM id's groups and removes them, retrying briefly (up to about
 * 200 ms, blocking) while the kernel still counts exiting tasks. Absent groups are fine.
 * -1 with errno when a group stays. */
int sp_cgroup_vm_remove(sp_cgroup_t *cg, const char *id);

/* Removes VM id's groups that no process is in, and kills nothing: a group with members is left
 * as it is (0). For the leftovers of a VM known dead, whose group's members, if any, are not
 * its: another spaced's VM of the same id on this host (groups are named by sandbox id alone).
 * -1 with errno when an empty group cannot be removed. */
int sp_cgroup_vm_remove_empty(sp_cgroup_t *cg, const char *id);

/* Renames VM from's groups to VM to's (a spare clone taken by a sandbox,
 * core/runtime/qemu/pool.c); the members stay where they are. 0 when done or when there are no groups; -1 with errno when a
 * rename failed (the ones already done are undone). */
int sp_cgroup_vm_rename(sp_cgroup_t *cg, const char *from, const char *to);

/* Memory charged to VM id's group: memory.current (v2) / memory.usage_in_bytes (v1). */
int sp_cgroup_vm_mem_used(const sp_cgroup_t *cg, const char *id, uint64_t *out);

/* The directory of VM id's group in the hierarchy carrying controller ("cpu", "memory",
 * "pids"); on v2 the same for all. -1 when there is none in this layout. For tests and logs. */
int sp_cgroup_vm_dir(const sp_cgroup_t *cg, const char *controller, const char *id, char *out,
                     size_t n);

#endif
