/*
 * driver.h - the runtime driver interface: what the controller asks of a
 * microVM implementation (QEMU microvm here; Firecracker could sit behind it).
 *
 * Folder: core/runtime/ runs VMs: this interface, the QEMU driver (core/runtime/qemu/), QMP,
 * cgroups, RAM deltas. (ARCHITECTURE.md: the layers.)
 *
 * Every lifecycle call is asynchronous on the process loop. A call that fails
 * at once returns -1, fills err and never calls cb; one that returns 0 calls
 * cb exactly once, never before returning. Calls are keyed by sandbox ID and
 * are idempotent where the controller may repeat them after a crash:
 * destroy of a missing VM succeeds; boot of a VM that already runs succeeds.
 * A driver owns its VMs' files under its data directory; the controller owns
 * the database.
 */
#ifndef SP_DRIVER_H
#define SP_DRIVER_H

#include <stddef.h>
#include <stdint.h>

#include "base/err.h"
#include "loop/loop.h"

typedef struct sp_driver sp_driver_t;

/* What a VM is made from; strings are borrowed for the duration of the call. */
typedef struct {
    const char *sandbox_id;
    const char *template_name;
    int cpu_count;
    int memory_mb;
    const char *hostname;
    const char *env_json; /* JSON object of env vars for processes in the guest, or NULL */
    /* boot only: start from this sandbox snapshot (ops->checkpoint) instead of the template:
     * its memory, processes and disk, with this spec's identity (id, hostname, env, a fresh
     * RNG seed and clock). cpu_count and memory_mb are the snapshot's, whatever the spec says.
     * NULL: from the template. */
    const char *snapshot_id;
    /* boot only; NULL: not told. What the boot waits for when that takes long (a template
     * snapshot being built for its size, a cold boot), as a short client-safe line such as
     * "building template snapshot for 2 vCPU / 1024 MiB": called on the loop, zero or more
     * times, never after the boot's cb. */
    void (*progress)(void *arg, const char *what);
    void *progress_arg;
} sp_vm_spec_t;

/* What a driver finds for a sandbox when asked (after a restart, say). */
typedef enum {
    SP_VM_ABSENT = 0,  /* no VM and no snapshot */
    SP_VM_RUNNING,     /* VM process alive, vCPUs running */
    SP_VM_PAUSED,      /* VM process alive, vCPUs stopped */
    SP_VM_SUSPENDED,   /* no VM process; a committed snapshot exists */
} sp_vm_state_t;

typedef struct {
    double cpu_used_pct; /* of the VM's allotment, over the last sample interval */
    int cpu_count;
    uint64_t mem_used_bytes;
    uint64_t mem_total_bytes;
    uint64_t disk_used_bytes;
    uint64_t disk_total_bytes;
    uint64_t snapshot_bytes; /* size of the committed snapshot, 0 if none */
} sp_vm_stats_t;

typedef void (*sp_driver_cb)(void *arg, const sp_err_t *err /* NULL on success */);

/* checkpoint's flags. SP_CKPT_SHARED: a snapshot for every worker. On a driver with a shared
 * snapshot dir it depends on nothing of this host's (its RAM all in its device state, no
 * delta over a template snapshot here) and is copied there before cb; a worker asked to boot
 * from it copies it in first. Elsewhere it is an ordinary one. */
#define SP_CKPT_SHARED 1u

typedef struct {
    const char *name;
    /* Starts a VM for spec->sandbox_id (cold boot or template-snapshot restore) until its agent answers. */
    int (*boot)(sp_driver_t *d, const sp_vm_spec_t *spec, sp_driver_cb cb, void *arg, sp_err_t *err);
    /* Stops / restarts the vCPUs; memory stays resident. */
    int (*pause)(sp_driver_t *d, const char *id, sp_driver_cb cb, void *arg, sp_err_t *err);
    int (*resume)(sp_driver_t *d, const char *id, sp_driver_cb cb, void *arg, sp_err_t *err);
    /* Writes a durable snapshot (memory, devices, disk), commits it, then releases the VM. */
    int (*snapshot)(sp_driver_t *d, const char *id, sp_driver_cb cb, void *arg, sp_err_t *err);
    /* Starts a VM from the sandbox's committed snapshot, until its agent answers. */
    int (*restore)(sp_driver_t *d, const sp_vm_spec_t *spec, sp_driver_cb cb, void *arg,
                   sp_err_t *err);
    /* Kills the VM and removes everything the sandbox had: overlay, snapshot, sockets. */
    int (*destroy)(sp_driver_t *d, const char *id, sp_driver_cb cb, void *arg, sp_err_t *err);
    /* Synchronous, cheap: what exists for the sandbox now. Re-adopts a live VM it finds. */
    sp_vm_state_t (*probe)(sp_driver_t *d, const char *id);
    /* The VM's agent channel (core/channel/agentconn.h), owned by the driver; NULL when there is no
     * running VM. Valid until the VM is paused-then-suspended, destroyed, or the driver freed. */
    struct sp_agentconn *(*agent)(sp_driver_t *d, const char *id);
    /* Synchronous, cheap: resource figures. -1 with SP_ENOTFOUND when there is no VM. */
    int (*stats)(sp_driver_t *d, const char *id, sp_vm_stats_t *out, sp_err_t *err);
    /* Optional, synchronous, no I/O: the disk_total_bytes stats would give (0 when there is no
     * running VM), for listings that want only that. NULL: callers use stats. */
    uint64_t (*disk_bytes)(sp_driver_t *d, const char *id);
    void (*free)(sp_driver_t *d);
    /* Optional: the isolation this driver runs without, by the operator's choice or the
     * host's lack ("no-jail", "no-seccomp", "no-cgroups", or "...: VMs do not start"), for
     * /healthz: at most n static strings into out, the count returned. */
    size_t (*insecure)(sp_driver_t *d, const char **out, size_t n);
    /* Optional (template builds): writes the paused VM's disk as it is now into dest, a new
     * qcow2 image (mode 0444) whose backing file is base, holding what differs from base
     * (base must be in the disk's backing chain: the template image the VM was made from);
     * or, when base already stacks on too many images, a standalone image holding all of it
     * (image_standalone tells which was written). SP_ECONFLICT when the VM is not paused;
     * dest must not exist. NULL: not supported. */
    int (*export_disk)(sp_driver_t *d, const char *id, const char *base, const char *dest,
                       sp_driver_cb cb, void *arg, sp_err_t *err);
    /* Optional (template builds): grows the running VM's disk to bytes (a whole number of
     * MiB, not below its size now). The guest sees the new size at once, as a disk that grew
     * under it; its filesystem is the guest's to grow. SP_ENOTFOUND: no running VM;
     * SP_EINVAL: smaller than the disk is. NULL: not supported. */
    int (*grow_disk)(sp_driver_t *d, const char *id, uint64_t bytes, sp_driver_cb cb, void *arg,
                     sp_err_t *err);
    /* Optional, synchronous, cheap (reads a header), callable from any thread (the published
     * versions' sweep calls it from a job): 1 when the disk image at path (absolute)
     * reads nothing from any other file, so the images it was made over may go; 0 when it
     * needs another file; -1 when it cannot be read or is not an image of this driver's.
     * NULL: not supported (callers take every image as needing its base). */
    int (*image_standalone)(sp_driver_t *d, const char *path);
    /* Optional (sandbox snapshots, "forks"): writes a snapshot named snapshot_id of the running
     * or paused VM id (memory with its processes, device state, disk), stopping its vCPUs only
     * while memory and disk are captured; the VM then goes on as it was (a paused one stays
     * paused). cb once the snapshot is durable; boots with spec->snapshot_id then start from it,
     * any number of times. SP_ENOTFOUND: no VM; SP_ECONFLICT: the VM is booting, suspending,
     * being deleted or already being snapshotted, or snapshot_id exists; SP_EINVAL: a bad
     * snapshot_id (letters, digits, '-', '_', at most 64). NULL: not supported.
     * flags: SP_CKPT_SHARED, or 0 for a snapshot only this host boots from. */
    int (*checkpoint)(sp_driver_t *d, const char *id, const char *snapshot_id, unsigned flags,
                      sp_driver_cb cb, void *arg, sp_err_t *err);
    /* Optional, synchronous: snapshot_id is no longer wanted. Its files go as soon as no VM and
     * no other snapshot is made from them (at once, or when the last such goes); its shared
     * copy (SP_CKPT_SHARED) at once (workers that booted from it hold copies of their own,
     * which their own checkpoint_delete releases). A missing one succeeds. NULL: not
     * supported. */
    int (*checkpoint_delete)(sp_driver_t *d, const char *snapshot_id, sp_err_t *err);
    /* Optional, synchronous, cheap: 1 when snapshot_id is committed and not deleted, else 0. */
    int (*checkpoint_exists)(sp_driver_t *d, const char *snapshot_id);
    /* Optional, synchronous, cheap: 1 when the committed snapshot_id is also in storage every
     * worker reads (SP_CKPT_SHARED on a driver with a shared snapshot dir), so that a boot
     * from it works on any of them; else 0. NULL: never. */
    int (*checkpoint_shared)(sp_driver_t *d, const char *snapshot_id);
    /* Optional, synchronous (a few stats): the bytes the committed snapshot_id's files take
     * on disk (allocated blocks), 0 when it does not exist. For the snapshot-disk quota. */
    uint64_t (*checkpoint_bytes)(sp_driver_t *d, const char *snapshot_id);
    /* Optional, synchronous: fn once for each committed, not deleted snapshot whose id starts
     * with prefix, with the Unix time (seconds) it was committed, in no particular order; a
     * shared one (SP_CKPT_SHARED) also when only its shared copy is there (an id may come
     * twice). fn must not call the driver. 0, or -1 with err when the snapshots cannot be listed.
     * NULL: not supported. */
    int (*checkpoint_list)(sp_driver_t *d, const char *prefix,
                           void (*fn)(const char *snapshot_id, long long committed_s, void *arg),
                           void *arg, sp_err_t *err);
    /* Optional: boots of template_name (NULL: "base") sized cpu_count vCPUs and memory_mb MiB
     * (0: the template's default) are expected: make what such a boot starts from ahead of
     * time (the QEMU driver: the template snapshot of that size) in the background, only while
     * the host is not booting anything, so that no boot waits for it. Synchronous and cheap (a
     * few small file reads): 1 when it is ready now, 0 when it is queued or being made, -1
     * with err when it cannot be (SP_ENOTFOUND: the template is not built here; SP_ECONFLICT:
     * this driver makes none, e.g. cold boots configured; SP_EUNAVAIL: too many queued).
     * NULL: not supported. */
    int (*prepare)(sp_driver_t *d, const char *template_name, int cpu_count, int memory_mb,
                   sp_err_t *err);
    /* Optional, synchronous, no I/O: fn once for each template size this driver holds a ready
     * template snapshot of (a create of that template and size clones it rather than booting
     * cold): the template as sp_vm_spec_t.template_name names it ("name" or "name@version"),
     * the size, and how many spare clones of it are ready. fn must not call the driver. NULL:
     * the driver keeps none. */
    void (*templates)(sp_driver_t *d,
                      void (*fn)(const char *template_name, int cpu_count, int memory_mb,
                                 int spares, void *arg),
                      void *arg);
    /* Optional, synchronous, no I/O: version (a build's hash, all its digits) of the template
     * template_name (a name without "@version") is no longer wanted, and its files are about to
     * be removed. What the driver made of it only to serve creates sooner (the QEMU driver: its
     * spare clones, and the sizes it keeps spares of) is let go at once: no create is given
     * one of them from now on and none is made again; their processes end soon after, on the
     * loop. Nothing of a sandbox (its VM, its snapshots) is touched. Returns how many spare
     * clones were let go. NULL: the driver keeps nothing of the kind. */
    int (*template_forget)(sp_driver_t *d, const char *template_name, const char *version);
} sp_driver_ops_t;

/* Implementations embed this first. */
struct sp_driver {
    const sp_driver_ops_t *ops;
    sp_loop_t *loop;
};

/*
 * The driver a build ships when no microVM runtime can be used: every boot
 * and restore fails with "runtime_unavailable: <why>", every other call
 * succeeds on the absent VM. why is copied.
 */
sp_driver_t *sp_driver_unavailable_create(sp_loop_t *loop, const char *why);

/* d->ops->insecure, or 0 when the driver has none (or d is NULL). */
size_t sp_driver_insecure(sp_driver_t *d, const char **out, size_t n);

/* The disk size of the sandbox's running VM in bytes (d->ops->disk_bytes, else what stats
 * gives), 0 when there is none (no VM, a suspended one) or d is NULL. */
uint64_t sp_driver_disk_bytes(sp_driver_t *d, const char *id);

/* d->ops->free(d); NULL does nothing. */
void sp_driver_destroy(sp_driver_t *d);

#endif
