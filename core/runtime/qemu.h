/*
 * qemu.h - the QEMU microvm runtime driver (core/runtime/driver.h).
 *
 * One QEMU process per sandbox, jailed (qemu/confine.c: its own uid, no capabilities,
 * its own namespaces, a root holding only its files), in its own session and process group (it
 * survives spaced) and its own cgroups (core/runtime/cgroup.h: space.slice/vm-<id> on
 * v2, space/vm-<id> in the cpu, memory and pids hierarchies on v1) limiting it
 * to cpu_count CPUs, memory_mb plus QEMU's overhead (512 MiB under TCG, 128
 * MiB under KVM) and 512 tasks. QEMU joins them before exec; a VM whose group
 * cannot be made, or that cannot join it, fails to boot (unless opts.insecure_no_cgroups:
 * then it boots without limits, logged). The same without QEMU's seccomp sandbox
 * (opts.insecure_no_seccomp). <data-dir>/vms is 0700.
 * Per-VM files live in <data-dir>/vms/<id>/:
 *
 *   disk.qcow2   qcow2 overlay over the template's read-only base
 *   qmp.sock     QMP (core/runtime/qmp.h)
 *   agent.sock   the agent's virtio-serial port (core/channel/agentconn.h)
 *   console.log  serial console, trimmed to its tail when it grows
 *   qemu.log     QEMU's own stdout/stderr
 *   qemu.pid     written once QEMU is started
 *   mem.ram      guest RAM (memory-backend-file, share=on): sparse, grows to memory_mb;
 *                absent for a clone, whose RAM is the template snapshot's (below)
 *   vm.json      cpu_count, memory_mb, disk size, template, accelerator, kernel, initramfs,
 *                ram_src (a clone's template snapshot dir, until its first restore)
 *   paused       present while the vCPUs are stopped by pause()
 *   booting      present from QEMU's start until the agent took IDENTITY (a restore
 *                of the sandbox's own snapshot: until its vCPUs start, when the
 *                snapshot is invalidated); a later driver kills a QEMU it finds with
 *                it: the sandbox is then SUSPENDED (snapshot kept) or ABSENT, to redo
 *   snapshot/    devstate (QEMU device state, ~60 KB) and manifest.json; the
 *                manifest is renamed into place last, so its presence is the
 *                commit: a VM dir without a live QEMU but with it -> SP_VM_SUSPENDED.
 *                manifest.json (version 2): cpu_count, memory_mb, accel, ram ("mem.ram",
 *                "delta" with ram_base, or "stream"), and the size and checksum of every
 *                part: ram_bytes + ram_checksum (only for "mem.ram"), devstate_bytes +
 *                devstate_checksum,
 *                disk_bytes + disk_checksum; "checksum" names the algorithm (qemu/sums.c,
 *                sum_files: SHA-256 of the non-zero 4 KiB pages, per 1 MiB chunk).
 *                corrupt: written when a wake found a part that does not match its
 *                checksum; later wakes are refused at once (the snapshot is kept)
 *
 * Create from a template snapshot: the first boot of a template build (per
 * accelerator, memory size, vCPU count and QEMU binary), or sp_qemu_template_snapshot
 * (`spaced template build`), cold-boots a builder VM, waits for its agent, runs the
 * template's warmup command (manifest "warmup": as root through the agent, exit 0 within
 * 600 s, else the snapshot fails; what it leaves running is in the snapshot), runs `sync`
 * in the guest, stops it, writes its device state and freezes its overlay and RAM file
 * (mode 0444) into
 *
 *   <data-dir>/templates/<name>/<hash>/snapshot-<accel>-<mem>M-<cpus>c-<key>/
 *       disk.qcow2 mem.ram snapshot/devstate template-snapshot.json
 *
 * committed by renaming the finished directory into place (the builder works in
 * <data-dir>/vms/.tsnap-<key>-<pid>/, short enough for its sockets; a driver
 * kills and removes builders it finds there at start). Boots that arrive
 * while it is built wait for it (one build per key). A clone is a qcow2 overlay
 * over that disk.qcow2 (its header written directly, no qemu-img), QEMU mapping
 * the template's mem.ram share=off (private copy-on-write: clones share the
 * pages they have not written), -incoming defer
 * with x-ignore-shared and the template's device state, cont, then IDENTITY
 * (hostname, sandbox id, env, fresh RNG seed, clock). vm.json names the RAM
 * source ("ram_src"). A clone has no RAM file of its own, so its suspend migrates
 * the whole RAM (x-ignore-shared off, no bandwidth limit) into a pipe, and a thread
 * (core/runtime/migdelta.h) writes the device state file from it with only the pages that
 * differ from the template's RAM file (manifest "ram": "delta", "ram_base": the
 * template snapshot dir): a few MB instead of everything the guest ever touched. Its
 * wake maps the template's RAM share=off again and loads the delta over it, so it
 * stays a clone sharing the template's pages. Should the filter refuse the stream,
 * the same suspend migrates again without it ("ram": "stream", logged); that restore
 * loads the stream into a fresh share=on mem.ram, after which the sandbox has its own
 * RAM file and suspends by device state only. When no snapshot can be made or a clone fails to
 * come up, the boot falls back to a cold boot (logged; a cold boot never runs the
 * warmup); a failed snapshot build is retried after 10 minutes.
 *
 * Sandbox snapshots (driver.h: checkpoint; qemu/fork.c): <data-dir>/snapshots/<id>/ holds a
 * copy of a live VM's overlay, its migration stream with the RAM (a clone's: the pages that
 * differ from its template snapshot's), a manifest and vm.json, taken with the suspend steps
 * while the VM is kept (its vCPUs stopped for the migration's last pages, or for all of it
 * where pre-copy cannot be trusted, and the disk copy). A boot with
 * spec->snapshot_id lays the new VM's directory out as a suspended sandbox over it and wakes
 * it. A deleted snapshot's files stay while a VM's or another snapshot's disk backs onto it.
 *
 * Spare clones (the pool): after a create of a template size, the driver keeps clones of that
 * size ready (SP_QEMU_POOL_KEYS sizes, least recently used first to go; a size nobody created
 * for 30 minutes loses them): one after a create, as many as the creates of the last 10 s
 * after a burst (up to pool_size), a quarter fewer (at least one) per 2 idle minutes down to
 * one, all sizes' spares within pool_memory_mb (each counted at its PSS once made;
 * core/runtime/poolpolicy.h decides).
 * A spare is restored in <data-dir>/vms/.pool-<n>-<pid>/ (cgroup "pool:<n>-<pid>"), warmed
 * by a few commands through the agent (TCG's translation cache then holds the exec path),
 * and stopped. A
 * create of its size takes one: cgroup and directory are renamed to the sandbox's
 * (pool.origin records the old directory, which QEMU's command line still names, for
 * re-adoption), the vCPUs start, IDENTITY as above. Spares are made one at a time and
 * only while no other boot is in flight; while a size still has a spare, not in the 250 ms
 * after a sandbox came up either, so its first commands get the CPUs (under TCG a restore
 * beside them made the first command twice as slow). A driver kills the spares it finds at
 * start, and its own at sp_driver_destroy. Spares never keep a template version on disk: the
 * versions' collector (core/control/tmplver.c) tells their directories from a sandbox's by
 * sp_qemu_spare_dir and has a version's spares dropped (driver.h: template_forget) as it
 * removes the version. A create from a sandbox snapshot counts the same way for that
 * snapshot: its spares are restores of it (the same layout and restore as the create's own),
 * taken as a template size's are, and dropped when the snapshot is deleted.
 *
 * Template snapshots ahead (qemu/ahead.c, driver.h: prepare): sizes a caller expects are
 * queued and, one at a time and only while nothing else boots, suspends or warms (the spares'
 * rule), built as sp_qemu_template_snapshot builds them; one that is there already costs a stat.
 * A sandbox boot that has to wait for a build, or boots cold, tells its caller so
 * (sp_vm_spec_t.progress).
 *
 * Clone boots of sandboxes queue when as many sandbox boots as the host has CPUs (at least 2)
 * are under way, and go first come first served as those come up: under load each create
 * then waits for a slot instead of all restoring at once and all answering last. Their boot
 * timeout counts from when they leave the queue (in it they wait 5 boot timeouts at most).
 *
 * Template snapshots nobody will clone again (of a template build that is no longer
 * current, of a key the current build no longer makes, or damaged) are removed at driver
 * start (once the accelerator is known) and after each snapshot commit, but only when no
 * sandbox uses them: a clone maps the snapshot's mem.ram, and its suspended delta
 * refers to it, for as long as vm.json names it ("ram_src"), and keeps its disk.qcow2 as
 * backing file for life. A damaged one in
 * use stays where it is (clones go cold until it is unused, then it is rebuilt).
 *
 * snapshot() = stop, migrate device state only (x-ignore-shared; a clone: with its
 * RAM delta, above) to a passed fd, fdatasync RAM file + device state + overlay while
 * a thread checksums them, commit, quit QEMU.
 * restore() = check sizes and the device state's checksum (refused at once
 * on a mismatch or an unreadable manifest: the sandbox stays SUSPENDED),
 * QEMU on the same files with -incoming defer, migrate-incoming from a
 * passed fd while a thread verifies the RAM file's and disk's checksums,
 * cont once they match (else QEMU goes, the snapshot stays, marked corrupt),
 * IDENTITY (fresh RNG seed, clock); the snapshot is removed once the vCPUs
 * run, because the RAM file and the disk move on from there.
 *
 * The accelerator is decided once per driver: "tcg" and "kvm" are taken as
 * given; "auto" uses KVM only if a guest kernel actually boots under it (a
 * probe VM with a short timeout), because on hosts where /dev/kvm is PVM it
 * opens fine and then hangs guests. The verdict is logged and written to
 * <data-dir>/vms/accel for inspection. Boots wait for the verdict.
 *
 * Live VMs found under <data-dir>/vms at creation are re-adopted (QMP and
 * agent channel reconnected); sp_driver_destroy() on this driver closes
 * connections but leaves every VM running.
 *
 * Environment: SPACE_BOOT_TIMEOUT_MS (default 60000) bounds boot-to-agent;
 * SPACE_POOL_SIZE (default 128, 0 = none) spare clones per size at most and
 * SPACE_POOL_MEMORY_MB (default host RAM / 4) for all, unless opts say, and
 * SPACE_POOL_RESERVE_MB (default host RAM / 16) the host memory they leave alone;
 * SPACE_KVM_PROBE_MS (default 4000) bounds the KVM probe; SPACE_COLD_BOOT=1
 * makes every boot a cold boot (no template snapshots), like opts.cold_boot.
 * With a shared snapshot dir (opts.snapshot_dir, qemu/shared.c) a suspend streams the whole
 * RAM into the device state (no RAM file, no template RAM it depends on), and once QEMU quit
 * moves the snapshot to <snapshot-dir>/sandboxes/<id>/ with its disk's layers (every backing
 * file outside the snapshot dir copied in, named relatively); a wake on any worker copies it
 * back into its VM directory and restores it there, and removes the shared copy once the
 * vCPUs run. Template images (base image, kernel, initramfs) are published once into
 * <snapshot-dir>/templates/ and images/ and VMs are made over the published copies. A
 * sandbox snapshot taken with SP_CKPT_SHARED (driver.h) streams its whole RAM too and is
 * copied to <snapshot-dir>/snapshots/<id>/ before it is ready; a worker booting from one it
 * does not hold copies it into its own data dir first.
 */
#ifndef SP_QEMU_H
#define SP_QEMU_H

#include <stdint.h>

#include "core/runtime/driver.h"
#include "base/err.h"
#include "loop/loop.h"

typedef struct {
    const char *data_dir; /* required; absolute recommended (paths go into QEMU's argv) */
    const char *accel;    /* "auto" (NULL), "kvm" or "tcg" */
    const char *qemu;     /* qemu-system-x86_64 binary; NULL: from PATH */
    const char *qemu_img; /* qemu-img binary; NULL: from PATH */
    int cold_boot;        /* 1: never create from a template snapshot */
    int pool_size;        /* spare clones kept ready per template size recently created from,
                           * at most: 0 = $SPACE_POOL_SIZE, else SP_QEMU_POOL_DEFAULT (128);
                           * -1 = none (see below) */
    int pool_memory_mb;   /* memory all spares may use together, MiB: 0 = $SPACE_POOL_MEMORY_MB,
                           * else a quarter of the host's RAM */
    int pool_reserve_mb;  /* host memory spares leave alone (sp_qemu_pool_reserve), MiB: 0 =
                           * $SPACE_POOL_RESERVE_MB, else a sixteenth of the host's RAM; -1 =
                           * none */
    int no_adopt;         /* 1: a tool's driver (spaced template build) on a data dir a
                           * serving spaced may use: adopts no VM, leaves other live processes'
                           * snapshot builders alone, refuses boot and restore; only
                           * sp_qemu_template_snapshot is meant for it */
    /* Confinement (qemu/confine.c, core/runtime/jail.h). By default (zeroes) each QEMU is
     * jailed when spaced is root, and VMs do not start without QEMU's seccomp sandbox or
     * without their cgroup. */
    const char *jail_uid_range; /* "START:COUNT" of the uids VMs run as; NULL: 900000:65536 */
    int no_jail;                /* 1: QEMU runs unjailed (insecure; for comparisons) */
    int insecure_no_seccomp;    /* 1: start VMs even where QEMU has no -sandbox */
    int insecure_no_cgroups;    /* 1: start VMs even without their cgroup */
    /* Storage every worker shares (qemu/shared.c): suspended sandboxes and template images,
     * so that a sandbox suspended by one worker wakes on another. Every worker must see it
     * at the same path. NULL: none, suspended sandboxes stay in their VM directory (one
     * node). */
    const char *snapshot_dir;
    /* Template images a disk chain may stack (export.c): an export whose base already has
     * this many in its chain writes a standalone image instead of one more layer, so a
     * template built on a template built on ... never makes QEMU walk a long chain.
     * 0: SP_QEMU_MAX_LAYERS. */
    int max_layers;
} sp_qemu_opts_t;

#define SP_QEMU_MAX_LAYERS 4

/* Creates the driver; strings are copied. Never blocks on a VM: probes and
 * re-adoption run on the loop. NULL with SP_EINVAL on bad options, or
 * SP_ERUNTIME when the data directory cannot be used. */
sp_driver_t *sp_qemu_create(sp_loop_t *loop, const sp_qemu_opts_t *o, sp_err_t *err);

typedef struct {
    char dir[4096]; /* the committed template snapshot directory */
    char key[17];
    int built;  /* 1: this request waited for a build; 0: it was there */
    int seeded; /* 1: that build restored the request's seed (sp_qemu_template_snapshot_from) */
} sp_qemu_tsnap_info_t;

/* Makes sure the template snapshot that creates of template_name (NULL: "base") with
 * cpu_count and memory_mb (0: the template's defaults) would clone exists, building it the
 * way the first such create would (builder VM, warmup, snapshot; one build per key, shared
 * with boots waiting for it). cb once it is ready (err NULL, *info filled if info is not NULL;
 * info must stay valid until then) or failed (why in err: the build's own error, e.g. a
 * failed warmup). For `spaced template build`; d must be a qemu driver. Fails at once with
 * SP_ENOTFOUND when the template is not built, SP_ECONFLICT with cold_boot. */
int sp_qemu_template_snapshot(sp_driver_t *d, const char *template_name, int cpu_count,
                              int memory_mb, sp_qemu_tsnap_info_t *info, sp_driver_cb cb, void *arg,
                              sp_err_t *err);

/* The same, where the snapshot is to be built from seed, a snapshot (driver.h: checkpoint) of
 * the VM that built template_name's image, taken by sp_qemu_template_seed while its disk was
 * exported: the builder restores it instead of booting cold, and runs the warmup in a guest
 * whose page cache already holds what the steps read. seed NULL, or one that cannot be used
 * (another size, a delta, gone; logged): a cold boot, as sp_qemu_template_snapshot. The seed
 * is only read; its caller deletes it once cb has run. */
int sp_qemu_template_snapshot_from(sp_driver_t *d, const char *template_name, int cpu_count,
                                   int memory_mb, const char *seed, sp_qemu_tsnap_info_t *info,
                                   sp_driver_cb cb, void *arg, sp_err_t *err);

/* A snapshot (driver.h: checkpoint) of running or paused VM id to seed a template snapshot:
 * its whole RAM in the device state, not a delta over its template's. A paused VM stays
 * paused. As ops->checkpoint otherwise. */
int sp_qemu_template_seed(sp_driver_t *d, const char *id, const char *snapshot_id, sp_driver_cb cb,
                          void *arg, sp_err_t *err);

/* Spare clones ready to be taken (for tests and logs). 0 for another driver. */
int sp_qemu_pool_ready(sp_driver_t *d);

typedef struct {
    int ready, warming;          /* spares that can be taken; being made */
    int target;                  /* spares the pool aims for, all sizes together */
    uint64_t used_mb, budget_mb; /* their memory as the pool counts it; its limit */
} sp_qemu_pool_stats_t;

/* The spare pool now (for tests and benches). -1 (st zeroed) for another driver. */
int sp_qemu_pool_stats(sp_driver_t *d, sp_qemu_pool_stats_t *st);

/* The host memory spares leave alone, MiB (default $SPACE_POOL_RESERVE_MB, else a sixteenth
 * of the host's RAM): spares are made only while the host's MemAvailable stays above it, and
 * dropped (newest first) while it is below, looked at every few seconds while spares exist and
 * at once after this call. -1 for another driver. */
int sp_qemu_pool_reserve(sp_driver_t *d, uint64_t mb);

/* Whether name, an entry of <data-dir>/vms, is the directory of one of d's spare clones (not
 * a sandbox's, nor a builder's, nor the link a taken spare's old name leaves, nor a spare of
 * another process's driver). Spares are no use of their template version: a collector of
 * versions lets them go (driver.h: template_forget) instead of keeping the version for them.
 * false for another driver. */
bool sp_qemu_spare_dir(sp_driver_t *d, const char *name);

#endif
