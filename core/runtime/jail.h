/*
 * jail.h - starting one untrusted process (a VM's QEMU) jailed: its own uid/gid, no
 * capabilities, no_new_privs, new mount/PID/IPC/UTS/network namespaces, pivot_root into a
 * fresh tmpfs holding only bind mounts of what it needs, an empty environment, no inherited
 * fds but stdio, resource limits, inside its cgroups before exec.
 *
 *   ids     the per-VM uid allocator over the operator's range (--jail-uid-range
 *           START:COUNT); the gid is the same number. Never 0, never the caller's uid.
 *   plan    what one jailed process sees: paths bound at the same absolute path they have
 *           on the host (so every path on QEMU's command line means the same thing on both
 *           sides), read-only unless asked; fds passed in; optionally its own /proc.
 *   spawn   clone into the namespaces sharing the caller's memory until exec (CLONE_VM |
 *           CLONE_VFORK: no copy of a large process's page tables; the pid returned is the
 *           host's view, with a pidfd), the child runs the plan with system calls only (it was
 *           cloned from a threaded process) and leaves the failing step in the caller's
 *           memory; the caller goes on only once the child exec'd or failed.
 *
 * As root it needs CAP_SYS_ADMIN, CAP_SETUID and the like. Not root, the same is done in a
 * user namespace of the child's own (its uid and gid mapped to themselves, the only ids it
 * has; the other namespaces owned by it): the child runs as the caller's uid and gid, with
 * the caller's supplementary groups (an unprivileged map cannot drop them), and the
 * bind mounts keep their sources' locked flags. sp_jail_supported() says whether this
 * process can jail, sp_jail_userns() which way. Knows no QEMU; owns no process once spawned.
 */
#ifndef SP_JAIL_H
#define SP_JAIL_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>

#include "core/runtime/cgroup.h"

#define SP_JAIL_UID_START_DEFAULT 900000u
#define SP_JAIL_UID_COUNT_DEFAULT 65536u
#define SP_JAIL_NOFILE 4096u /* RLIMIT_NOFILE: QEMU's disks, sockets, eventfds */

/* ---------- the uid allocator ---------- */

typedef struct sp_jail_ids sp_jail_ids_t;

/* Parses "START:COUNT" (decimal). -1 when malformed, COUNT is 0, the range wraps past
 * 2^32-2, or it holds uid 0. */
int sp_jail_range_parse(const char *s, uint32_t *start, uint32_t *count);

/* An allocator over [start, start+count), never handing out self (the caller's uid) nor 0.
 * NULL with errno EINVAL for a range sp_jail_range_parse refuses, ENOMEM. */
sp_jail_ids_t *sp_jail_ids_create(uint32_t start, uint32_t count, uid_t self);
void sp_jail_ids_destroy(sp_jail_ids_t *ids);

/* A free uid, preferring ones not handed out recently (next-fit), so a uid freed by one VM
 * is not at once another's. -1 with errno ENOSPC when all are in use. */
int sp_jail_ids_take(sp_jail_ids_t *ids, uid_t *out);
/* Marks uid in use (a running VM found again after a restart). -1 with errno ERANGE when
 * outside the range, EEXIST when already in use. */
int sp_jail_ids_claim(sp_jail_ids_t *ids, uid_t uid);
/* Gives uid back; anything outside the range or not in use is ignored. */
void sp_jail_ids_put(sp_jail_ids_t *ids, uid_t uid);
unsigned sp_jail_ids_used(const sp_jail_ids_t *ids);

/* ---------- a plan and its spawn ---------- */

typedef struct sp_jail sp_jail_t;

enum {
    SP_JAIL_RW = 1 << 0,  /* bind read-write (default read-only) */
    SP_JAIL_DEV = 1 << 1, /* a device node: no nodev on its mount */
    SP_JAIL_OPT = 1 << 2, /* skip silently when the host path does not exist */
};

/* True when this process can jail (effective uid 0, or user namespaces it may make);
 * else why (for a log line). */
bool sp_jail_supported(char *why, size_t n);
/* True when jails are made in a user namespace (this process is not root). */
bool sp_jail_userns(void);

/* A plan for one process running as uid:gid (never 0; in a user namespace, this process's
 * own euid and egid), rooted in a tmpfs mounted (inside the child's own mount namespace) on
 * stage, an existing empty directory the caller owns. NULL when out of memory or an argument
 * is bad. */
sp_jail_t *sp_jail_new(const char *stage, uid_t uid, gid_t gid);
void sp_jail_free(sp_jail_t *j);

/* Binds host_path (absolute; a file or directory, symlinks resolved) at the same path
 * inside. -1 with errno (ENOENT without SP_JAIL_OPT, ENAMETOOLONG, ENOMEM, EINVAL for a
 * relative path); the plan is unchanged then. */
int sp_jail_bind(sp_jail_t *j, const char *host_path, unsigned flags);
/* Mounts a proc file system of the process's own PID namespace at /proc, showing only its
 * processes (subset=pid, hidepid=invisible: no /proc/sys, no kernel tables), so that
 * /proc/self/fd/N reopens an fd passed with sp_jail_pass_fd (a sealed memfd in place of a
 * file that must not be written). */
int sp_jail_mount_proc(sp_jail_t *j);
/* Makes the symlinks the host has at /lib, /lib64, ... (merged /usr) inside as well, for each
 * name in names that is a symlink on the host; a directory there is bound read-only. */
int sp_jail_mirror_root_links(sp_jail_t *j, const char *const *names, size_t n);
/* Passes fd (which must stay open until sp_jail_spawn returns) to the process: it gets it
 * as the returned number (3, 4, ... in the order of the calls), not close-on-exec. -1 with
 * errno E2BIG past SP_JAIL_PASS_MAX. */
#define SP_JAIL_PASS_MAX 4
int sp_jail_pass_fd(sp_jail_t *j, int fd);
/* RLIMIT_FSIZE for the process: the largest file it may write (0: unlimited). */
void sp_jail_set_fsize(sp_jail_t *j, uint64_t bytes);

/* Starts argv[0] (an absolute path inside the jail, bound by the caller) with env (NULL:
 * empty), stdin/stdout/stderr from the given fds, in the cgroups of cg (NULL: none) and a
 * new session; the fds of sp_jail_pass_fd follow stdio, nothing else is open. Blocks until the
 * child exec'd or failed (a few ms). Returns the child's pid as the caller sees it and a pidfd
 * (close-on-exec) in *pidfd; -1 with why filled (the failing step and errno) and errno set. */
pid_t sp_jail_spawn(const sp_jail_t *j, char *const argv[], char *const env[], int in_fd,
                    int out_fd, const sp_cgroup_join_t *cg, int *pidfd, char *why, size_t n);

#endif
