/*
 * qemu_int.h - what the files of the QEMU driver (core/runtime/qemu.h) share: the driver's
 * and each VM's state, the records of template snapshots, spares and checksum jobs, and the
 * functions one file calls in another.
 *
 * Folder: core/runtime/qemu/ is the QEMU driver, one file per seam (driver, boot, snapshot, tsnap,
 * pool, sums, util). (ARCHITECTURE.md: the layers.)
 *
 *   driver.c    the ops, the VM table, stopping and finishing a VM, completions,
 *               re-adoption of running VMs, creation and free
 *   boot.c      a boot up to IDENTITY: probes, overlay, QEMU's command line and process,
 *               QMP, the agent channel
 *   snapshot.c  suspend and wake of a sandbox's own snapshot
 *   sums.c      snapshot checksums and the RAM delta filter, off the loop
 *   tsnap.c     template snapshots: keys, builders, warmup, commit, collection
 *   pool.c      spare clones
 *   ahead.c     template snapshots of expected sizes, built ahead while the host is idle
 *   util.c      small helpers: files, child processes, cgroups, console log
 *   confine.c   the jail each QEMU runs in (core/runtime/jail.h), its uid, the refusals
 *               without seccomp or cgroups
 *   fork.c      sandbox snapshots (driver.h: checkpoint): taken from a live VM with the
 *               suspend steps, booted from, collected once nothing is made from them
 *   shared.c    the shared snapshot dir: suspended sandboxes moved there and back, template
 *               images published there
 *
 * Everything runs on the driver's loop but the jobs of sums.c, confine.c's copies of template
 * RAM and shared.c's copies. For core/runtime/qemu/ only.
 */
#ifndef SP_QEMU_INT_H
#define SP_QEMU_INT_H

#include <limits.h>
#include <stdbool.h>
#include <stdint.h>
#include <sys/types.h>

#include "base/rmtree.h"
#include "core/channel/agentconn.h"
#include "core/channel/exec.h"
#include "core/runtime/cgroup.h"
#include "core/runtime/jail.h"
#include "core/runtime/migdelta.h"
#include "core/runtime/poolpolicy.h"
#include "core/runtime/qemu.h"
#include "core/runtime/qmp.h"
#include "guest/tmplbuild.h"

#define SP_QEMU_ID_MAX          64
#define SP_QEMU_BOOT_TIMEOUT_MS 60000u /* TCG boots in seconds; a busy host needs slack */
#define SP_QEMU_KVM_PROBE_MS    4000u  /* real KVM reaches the probe's panic well within it */
#define SP_QEMU_SANDBOX_PROBE   5000u
#define SP_QEMU_QUIT_GRACE_MS   3000u      /* QMP quit, then SIGKILL to the process group */
#define SP_QEMU_CONSOLE_MAX     (2u << 20) /* bytes; trimmed to the tail beyond this */
#define SP_QEMU_CONSOLE_KEEP    (256u << 10)
#define SP_QEMU_CONSOLE_TICK_MS 5000u
#define SP_QEMU_OVERHEAD_TCG_MB 512 /* QEMU beyond guest RAM: TCG's translation cache */
#define SP_QEMU_OVERHEAD_KVM_MB 128
#define SP_QEMU_SANDBOX_ARG                                                                        \
    "on,obsolete=deny,elevateprivileges=deny,spawn=deny,resourcecontrol=deny"
#define SP_QEMU_TSNAP_RETRY_MS 600000u /* a failed template snapshot is retried after this */
#define SP_QEMU_TSNAP_FORMAT   "space-tsnap-1" /* bump when the snapshot layout changes */
#define SP_QEMU_WARMUP_MS      600000u /* a template's warmup command must exit 0 within this */
#define SP_QEMU_SNAP_VERSION   2       /* suspend manifest: 2 added sizes + checksums */
#define SP_QEMU_SUM_ALGO       "sha256-c1m-p4k" /* see sum_files */
#define SP_QEMU_SUM_CHUNK      (1u << 20)
#define SP_QEMU_SUM_INLINE_MAX (4u << 20) /* a device state up to this is verified inline */
#define SP_QEMU_SUM_THREADS    4          /* at most, and no more than CPUs */
#define SP_QEMU_POOL_DEFAULT   128        /* spare clones per template size at most */
#define SP_QEMU_POOL_MAX       SP_POOLPOLICY_PER_SIZE_MAX
#define SP_QEMU_POOL_WINDOW_MS 10000u     /* creates this close together ask for a spare each */
#define SP_QEMU_POOL_DECAY_MS  120000u    /* an idle size keeps a quarter fewer per this */
#define SP_QEMU_POOL_RESERVE   16         /* default reserve: host RAM / this (pool_limit) */
#define SP_QEMU_POOL_MEM_MS    5000u      /* host memory looked at this often with spares */
#define SP_QEMU_POOL_RAM_DIV   4          /* default memory budget: host RAM / this */
#define SP_QEMU_POOL_KEYS      4          /* template sizes with spares at once (LRU) */
#define SP_QEMU_POOL_IDLE_MS   1800000u   /* a size nobody created for this long loses them */
#define SP_QEMU_POOL_TICK_MS   100u       /* refill check while boots are in flight */
#define SP_QEMU_POOL_SETTLE_MS 250u /* no refill this soon after a sandbox came up: its first
                                     * commands, not a spare's restore, get the CPUs */
#define SP_QEMU_POOL_RETRY_MS  60000u     /* after a spare failed to come up */
#define SP_QEMU_POOL_WARM_MS   30000u     /* each warm-up command of a spare */
#define SP_QEMU_AHEAD_MAX      64u        /* sizes waiting to be made ahead, at most */
#define SP_QEMU_QUEUE_POLL_MS  50u        /* queued clone boots look for a free slot this often */
#define SP_QEMU_ADOPT_SETTLE_MS 120000u   /* an adopted VM's leftover migration, waited out */
#define SP_QEMU_QUEUE_TIMEOUT_MULT 5u     /* a queued clone boot gives up after this many boot
                                           * timeouts in the queue */

typedef struct sp_qemu sp_qemu_t;
struct refs;
struct shared_ls;
struct xfer;

/* A caller waiting for a boot, suspend or destroy to finish (sp_qemu__complete_all). */
struct waiter {
    sp_driver_cb cb;
    void *arg;
    struct waiter *next;
};

/* A finished call waiting for the next loop turn. */
struct done {
    sp_driver_cb cb;
    void *arg;
    bool failed;
    sp_err_t err;
    struct done *next;
};

/* A short-lived child (qemu-img, probes) watched through its pidfd. */
struct child;
typedef void (*child_cb)(struct child *c, int wstatus, bool timed_out, void *arg);
struct child {
    sp_qemu_t *d;
    pid_t pid;
    int pidfd;
    sp_watch_t *w;
    sp_timer_t timer;
    bool timed_out;
    child_cb cb;
    void *arg;
};

enum phase {
    PH_WAIT_ACCEL = 0, /* boot waits for the accelerator / sandbox verdicts */
    PH_WAIT_TSNAP,     /* boot waits for its template snapshot to be built */
    PH_DISK,           /* qemu-img is making the overlay */
    PH_START,          /* QEMU started; connecting QMP */
    PH_AGENT,          /* QMP up; waiting for the agent's HELLO */
    PH_IDENTITY,       /* agent up; IDENTITY sent */
    PH_UP,             /* running (or paused) and usable */
    PH_SUSPENDING,     /* snapshot in progress; QEMU quits at the end */
    PH_STOPPING,       /* being killed; finish() removes it */
};

/* Steps of a suspend (vm->snap_step) and of a restore (the same field while restoring). */
enum {
    SN_NONE = 0,
    SN_STOP,
    SN_CANCEL,      /* migrate_cancel: an earlier driver may have died mid-suspend */
    SN_CANCEL_POLL, /* until no migration is in flight */
    SN_STATUS,      /* a migration that completed leaves QEMU in postmigrate: */
    SN_RECONT,      /* cont, */
    SN_RESTOP,      /* stop again (QEMU migrates no VM from postmigrate) */
    SN_CAPS,
    SN_PARAMS, /* no bandwidth limit: the VM is stopped, nothing is gained by pacing */
    SN_GETFD,
    SN_MIGRATE,
    SN_POLL,
    SN_SYNC,
    SN_QUIT,
    RS_CAPS,
    RS_GETFD,
    RS_INCOMING,
    RS_POLL,
    RS_VERIFY, /* loaded and paused; waiting for the snapshot's checksums (sumjob) */
    RS_CONT,
};

/* Parts of a snapshot that carry a checksum (suspend manifest, qemu.h). */
enum { SUM_RAM = 0, SUM_DEV, SUM_DISK, SUM_N };

/* Checksums computed off the loop (sum_files over its parts, on the loop's SP_WORK_LONG lane).
 * Owned by its VM (vm->sum) until the loop hears it finished; a VM that goes away first
 * abandons it (sp_work_cancel: sum_files stops at its next chunk) and the done callback, which
 * always comes, only frees it. The same machinery runs a clone's suspend stream through
 * sp_migdelta_filter (delta: in_fd is the pipe QEMU migrates into, out_fd the device state
 * file; vm->delta). */
struct sumjob {
    sp_work_t *work;
    struct vm *vm; /* NULL once abandoned */
    bool delta;
    int in_fd, out_fd;           /* delta: owned by the job */
    char base[PATH_MAX + 16];    /* delta: the template's RAM file */
    int rc;                      /* delta: sp_migdelta_filter's */
    sp_migdelta_live_t live;     /* delta of a running VM (fork.c): its source (fds -1: none) */
    char why[200];
    sp_migdelta_stats_t st;
    bool verify;                     /* compare with want[] */
    char path[SUM_N][PATH_MAX + 32]; /* "" = not part of this job */
    char want[SUM_N][65];
    char got[SUM_N][65];
    uint64_t size[SUM_N];
    int bad; /* -1, or the part that failed: err_no != 0 read error, else mismatch */
    int err_no;
    uint64_t ms;
};
enum { VERIFY_NONE = 0, VERIFY_RUNNING, VERIFY_OK, VERIFY_FAILED };

/* One template snapshot (qemu.h), keyed by everything its device state depends on. */
enum { TS_BUILDING = 0, TS_READY, TS_FAILED };
struct tsnap {
    struct tsnap *next;
    char key[17];       /* 16 hex digits */
    char dir[PATH_MAX]; /* the committed directory */
    char tmp[PATH_MAX]; /* where the builder works: <vms>/.tsnap-<key>-<pid> (short paths for
                         * its unix sockets; no sandbox id starts with '.') */
    char template_name[160]; /* "name" or "name@hash" (a tagged version) */
    /* the size it is of */
    int cpu_count, memory_mb;
    int state;
    uint64_t failed_ms; /* sp_qemu__mono_ms() of the last failure */
    uint64_t start_ms;
    bool seeded;      /* its last build restored a seed instead of booting */
    bool seed_failed; /* a seed's restore failed: builds of it boot cold from now on */
    char why[160]; /* the last failure, client-safe */
};

/* A VM of the driver: a sandbox's (booting, up, suspending, stopping), a spare clone (pooled),
 * a template snapshot builder (tsnap_build) or a request for a template snapshot (tsnap_req,
 * never a QEMU). In the driver's list d->vms from sp_qemu__vm_new to sp_qemu__vm_unlink. */
struct vm {
    sp_qemu_t *d;
    struct vm *next;
    char id[SP_QEMU_ID_MAX + 1];
    char dir[PATH_MAX];
    enum phase ph;
    bool adopted;
    /* boot inputs (NULL once QEMU is started) */
    sp_tmplbuild_paths_t *tp;
    char template_name[160]; /* "name" or "name@hash" (a tagged version) */
    char *hostname;
    char *env_json;
    int cpu_count;
    int memory_mb;
    uint64_t disk_total;
    /* process */
    pid_t pid;
    int pidfd;
    sp_watch_t *pw;
    bool exited;
    struct child *img;
    sp_qmp_t *qmp;
    sp_timer_t qmp_timer;
    unsigned qmp_tries;
    sp_agentconn_t *agent;
    sp_agentstream_t *ident;
    bool paused;
    /* adopted: a migration an earlier driver left (its unfinished suspend) is being cancelled
     * and waited out before the run state is read; pause and resume wait in adopt_w until
     * then (boot.c: adopt_settled), as QEMU refuses cont while a migration finishes */
    bool adopt_settling;
    int adopt_step; /* 0: polling query-migrate, 1: polling query-status */
    uint64_t adopt_ms;
    sp_timer_t adopt_timer;
    struct waiter *adopt_w;
    sp_timer_t boot_timer;
    uint64_t boot_start_ms;
    sp_timer_t kill_timer;
    bool keep_logs; /* a failed boot keeps console.log and qemu.log */
    bool boot_failed;
    sp_err_t boot_err;
    struct waiter *boot_w, *destroy_w;
    /* a sandbox's boot: told what it waits for (driver.h: sp_vm_spec_t.progress) while
     * boot_w still holds its caller */
    void (*progress)(void *arg, const char *what);
    void *progress_arg;
    /* suspend / restore */
    bool restoring;
    struct waiter *snap_w;
    int snap_step;
    int snap_fd;
    bool snap_was_paused;
    sp_timer_t snap_timer;
    struct child *sync;
    struct export *export; /* export_disk in flight (export.c) */
    struct fork *fork;     /* checkpoint in flight (fork.c): the suspend steps, into its dir */
    uint64_t snap_start_ms;
    struct xfer *publish;   /* suspend: the snapshot being moved to the shared dir (shared.c) */
    struct sumjob *sum;     /* checksums in flight (suspend: computing; restore: verifying) */
    struct sumjob *delta;   /* suspend of a clone: the stream's RAM delta being filtered */
    bool mig_done;          /* suspend: QEMU finished the migration (the delta may not yet) */
    bool delta_ok;          /* suspend: the device state holds the RAM delta ("ram":"delta") */
    bool delta_failed;      /* suspend: the filter refused the stream: migrate again, whole */
    bool no_delta;          /* this VM's clone suspends stream the whole RAM (filter refused) */
    bool sync_done, sum_ok; /* suspend: both before the commit */
    char sums[SUM_N][65];   /* suspend: the parts' checksums for the manifest */
    uint64_t sum_sizes[SUM_N];
    uint64_t sum_ms;
    int verify;              /* restore: VERIFY_* of the big parts' checksums */
    uint64_t verify_wait_ms; /* restore: when the loaded VM began to wait for them */
    int verify_bad;          /* the part that failed, and the errno of a read error (0: */
    int verify_errno;        /* a mismatch) */
    /* the VM runs in its own cgroup (core/runtime/cgroup.h), with its limits */
    bool cg;
    uid_t jail_uid; /* its QEMU's uid and gid (confine.c); 0: none held */
    bool ram_wait;  /* PH_DISK, QEMU not started: waits for clone_src's sealed RAM (confine.c) */
    /* template snapshots */
    struct tsnap *tsnap_build; /* this VM is the builder of that snapshot (never a sandbox) */
    struct tsnap *tsnap_wait;  /* this boot clones that snapshot (or waits for it) */
    sp_agentstream_t *settle;  /* builder: `sync` in the guest before the snapshot */
    sp_exec_t *warm;           /* builder: the template's warmup command */
    uint64_t warm_start_ms;
    bool tsnap_req;                 /* no VM: a request for a template snapshot (sp_qemu_template_
                                     * snapshot), answered through boot_w */
    sp_qemu_tsnap_info_t *req_info; /* the request's caller's, filled before its callback */
    char *seed; /* request: the sandbox snapshot to make a snapshot it builds from (NULL: boot) */
    char *clone_src;      /* template snapshot dir our RAM is mapped from; NULL: own RAM */
    bool clone_boot;      /* this boot restores clone_src's device state */
    bool cold;            /* this boot must not use a template snapshot */
    bool restore_stream;  /* restoring a snapshot whose stream carries the RAM */
    bool restore_delta;   /* restoring a clone's snapshot: template RAM + the stream's delta */
    bool restore_running; /* the loaded VM came up running (never: sources are stopped) */
    uint64_t cpu_ticks, cpu_ms;
    double cpu_pct;
    /* spare clones (pool_*) */
    bool pooled;        /* a spare: no sandbox yet, invisible to sp_qemu__vm_find */
    bool pool_ready;    /* warmed and stopped: sp_qemu__pool_take may hand it out */
    bool pool_drop;     /* to be stopped by the pool timer (a safe place to free it) */
    bool pool_seen;     /* a sandbox's boot whose create the pool's policy counted already */
    bool pool_fork;     /* a spare restored from a sandbox snapshot (no template boot behind) */
    /* a sandbox's clone boot waits for a boot slot (boot.c: admit_queued), in PH_WAIT_ACCEL */
    bool boot_queued;
    bool boot_admitted; /* it had its slot: boot_begin goes on */
    /* it waited for the driver's own probes (accelerator, seccomp): its boot timeout runs
     * from when they were done, as a queued boot's from its admission (sp_qemu__on_kick) */
    bool probe_wait;
    int pool_warm_step; /* the next of pool_warm_cmds to run */
    char pool_key[17];  /* its template snapshot's key */
};

/* A template size recently created from: the pool keeps spare clones of it
 * (sp_qemu__on_pool_timer). */
struct poolwant {
    struct poolwant *next; /* most recently used first */
    char key[17];
    char template_name[160]; /* "name" or "name@hash" (a tagged version) */
    sp_tmplbuild_paths_t tp;
    int cpu_count, memory_mb;
    uint64_t disk_total;
    char sid[SP_QEMU_ID_MAX + 1]; /* a sandbox snapshot's spares ("" for a template size) */
    uint64_t used_ms;  /* sp_qemu__mono_ms() of the last create of this size */
    uint64_t retry_ms; /* no new spare before this (one failed) */
};

/* A size whose template snapshot is wanted ahead of its creates (driver.h: prepare), made by
 * ahead.c one at a time while the host is idle. */
struct ahead {
    struct ahead *next; /* oldest first */
    sp_qemu_t *d;
    char template_name[160];
    int cpu_count, memory_mb; /* resolved (never 0) */
    bool asked;               /* its sp_qemu_template_snapshot request is out */
    sp_qemu_tsnap_info_t info;
};

/* The driver (sp_driver_t first: the ops get it as their base). */
struct sp_qemu {
    sp_driver_t base;
    char data_dir[PATH_MAX];
    char vms_dir[PATH_MAX];
    char snaps_dir[PATH_MAX]; /* <data-dir>/snapshots: sandbox snapshots (fork.c) */
    bool snaps_pending;       /* a deleted snapshot may still wait for its last user */
    char *qemu, *qemu_img;
    int max_layers; /* template images a chain may stack before an export squashes */
    int want;    /* 0 auto, 1 kvm, 2 tcg */
    int accel;   /* -1 undecided, 0 TCG, 1 KVM */
    int sandbox; /* -1 unknown, 0 unsupported, 1 supported */
    struct child *kvm_probe, *sandbox_probe;
    sp_cgroup_t *cg; /* the host's cgroup layout, detected once; NULL: out of memory */
    struct vm *vms;
    struct done *done_head, *done_tail;
    sp_timer_t done_timer;
    sp_timer_t kick_timer;
    sp_timer_t console_timer;
    uint32_t boot_timeout_ms;
    uint32_t probe_ms;
    bool cold_only;                 /* opts.cold_boot or SPACE_COLD_BOOT=1 */
    bool no_adopt;                  /* opts.no_adopt: a tool's driver, see qemu.h */
    bool gc_done;                   /* template snapshots were collected since the verdict */
    unsigned req_seq;               /* ids of template snapshot requests */
    char qemu_ident[PATH_MAX + 96]; /* resolved QEMU binary + size + mtime: part of snapshot keys */
    struct tsnap *tsnaps;
    int pool_size;           /* spare clones per template size in use at most; 0: none */
    sp_poolpolicy_t *policy; /* how many to keep of each (NULL when pool_size is 0) */
    unsigned pool_seq;
    sp_timer_t pool_timer;
    struct poolwant *wants;
    uint64_t pool_quiet_until; /* mono ms: a sandbox came up (SP_QEMU_POOL_SETTLE_MS) */
    uint64_t pool_reserve_mb;  /* spares never hold memory the host's MemAvailable needs to
                                * stay above this (pool_limit) */
    bool pool_short;           /* the reserve limits the pool now (logged when it changes) */
    struct ahead *aheads;      /* template snapshots to make ahead (ahead.c) */
    int naheads;
    sp_timer_t ahead_timer;
    int boot_slots; /* sandbox boots in flight at most (the host's CPUs, at least 2); clone
                     * boots beyond it queue, first come first served */
    /* confinement (confine.c) */
    bool jail;                  /* QEMUs are jailed (not --no-jail) */
    bool jail_userns;           /* ... in user namespaces, as spaced's uid (not root) */
    sp_jail_ids_t *jail_ids;    /* their uids */
    char jail_stage[PATH_MAX];  /* <data>/jail: where each jail's tmpfs is mounted, in its
                                 * own mount namespace */
    bool allow_no_seccomp;      /* --insecure-no-seccomp */
    bool allow_no_cgroups;      /* --insecure-no-cgroups */
    struct ramfd *ramfds;       /* template RAM files as sealed memfds, made or being made */
    /* the shared snapshot dir (shared.c) */
    char shared_dir[PATH_MAX]; /* absolute; "" when there is none (opts.snapshot_dir) */
    struct shared_ls *snap_ls; /* its sandbox snapshots as last listed (shared.c) */
    struct xfer *fetches;      /* snapshots being copied in from it (a wake, a boot from a
                                * sandbox snapshot) or out to it (a sandbox snapshot) */
};

/* How sp_qemu__spawn starts a child. */
struct spawn_opts {
    const char *out_path;       /* stdout+stderr (appended); NULL: /dev/null */
    int stdin_fd;               /* -1: /dev/null */
    const sp_cgroup_join_t *cg; /* NULL: stay in our cgroup; else join before exec or fail */
    const char *sandbox;        /* for log lines; NULL for helpers */
    bool new_session;
};

/* The functions one file calls in another, by the file that defines them; each is described
 * where it is defined. */

/* ---- driver.c: completions, the VM table, stopping and finishing, re-adoption, ops ---- */

int sp_qemu__complete(sp_qemu_t *d, sp_driver_cb cb, void *arg, const sp_err_t *err);
void sp_qemu__complete_all(sp_qemu_t *d, struct waiter **list, const sp_err_t *err);
int sp_qemu__add_waiter(struct waiter **list, sp_driver_cb cb, void *arg, sp_err_t *err);
struct vm *sp_qemu__vm_find(sp_qemu_t *d, const char *id);
void sp_qemu__vm_unlink(struct vm *vm);
struct vm *sp_qemu__vm_new(sp_qemu_t *d, const char *id);
sp_tmplbuild_paths_t *sp_qemu__template_current(const sp_qemu_t *d, const char *tname, bool *oom,
                                                sp_err_t *te);
/* sp_qemu__template_current for a request naming tname: NULL with err set when it cannot be
 * used (SP_EINTERNAL: out of memory; SP_EINVAL: a bad name; else SP_ENOTFOUND). */
sp_tmplbuild_paths_t *sp_qemu__template_for(const sp_qemu_t *d, const char *tname, sp_err_t *err);
int sp_qemu__vm_cpus(const sp_tmplbuild_paths_t *tp, int cpu_count);
int sp_qemu__vm_memory(const sp_tmplbuild_paths_t *tp, int memory_mb);
struct vm *sp_qemu__vm_new_boot(sp_qemu_t *d, const char *id, sp_tmplbuild_paths_t *tp,
                                const char *tname, int cpu_count, int memory_mb, sp_driver_cb cb,
                                void *arg, sp_err_t *err);
void sp_qemu__vm_disconnect(struct vm *vm);
void sp_qemu__vm_free(struct vm *vm);
pid_t sp_qemu__live_qemu_pid(const char *dir);
pid_t sp_qemu__live_vm_pid(sp_qemu_t *d, const char *id, const char *vdir);
void sp_qemu__on_vm_exit(sp_watch_t *w, int events, void *arg);
void sp_qemu__vm_stop(struct vm *vm, bool graceful);
void sp_qemu__vm_finish(struct vm *vm);
struct vm *sp_qemu__vm_adopt(sp_qemu_t *d, const char *id, pid_t pid);
struct vm *sp_qemu__running_vm(sp_qemu_t *d, const char *id, sp_err_t *err);
extern const sp_driver_ops_t sp_qemu__ops;

/* ---- boot.c: from boot_begin to up; the probes ---- */

void sp_qemu__boot_fail(struct vm *vm, const char *fmt, const char *detail);
/* Tells a sandbox boot's caller what it waits for: "<what> for N vCPU / M MiB[: why]". */
void sp_qemu__boot_progress(struct vm *vm, const char *what, const char *why);
void sp_qemu__qmp_try_connect(struct vm *vm);
void sp_qemu__on_qmp_timer(sp_timer_t *t, void *arg);
void sp_qemu__on_adopt_timer(sp_timer_t *t, void *arg);
void sp_qemu__send_identity(struct vm *vm);
void sp_qemu__agent_start(struct vm *vm);
void sp_qemu__on_boot_timeout(sp_timer_t *t, void *arg);
void sp_qemu__read_vm_json(struct vm *vm);
void sp_qemu__kick(sp_qemu_t *d);
int sp_qemu__cached_probe_verdict(sp_qemu_t *d);
void sp_qemu__record_accel(sp_qemu_t *d, const char *why);
void sp_qemu__start_sandbox_probe(sp_qemu_t *d);
void sp_qemu__on_kick(sp_timer_t *t, void *arg);
void sp_qemu__boot_ram_ready(struct vm *vm);
int sp_qemu__write_overlay(const char *path, const char *backing);

/* ---- export.c: a paused VM's disk written out as an image (template builds) ---- */

int sp_qemu__q_export_disk(sp_driver_t *base, const char *id, const char *backing,
                           const char *dest, sp_driver_cb cb, void *arg, sp_err_t *err);
int sp_qemu__q_image_standalone(sp_driver_t *base, const char *path);
int sp_qemu__q_grow_disk(sp_driver_t *base, const char *id, uint64_t bytes, sp_driver_cb cb,
                         void *arg, sp_err_t *err);
void sp_qemu__export_abort(struct vm *vm);

/* ---- fork.c: sandbox snapshots ---- */

int sp_qemu__q_checkpoint(sp_driver_t *base, const char *id, const char *snapshot_id,
                          unsigned flags, sp_driver_cb cb, void *arg, sp_err_t *err);
int sp_qemu__q_checkpoint_shared(sp_driver_t *base, const char *snapshot_id);
/* A sandbox snapshot id: what a sandbox id may be, without dots (they name temporary dirs). */
bool sp_qemu__fork_valid_sid(const char *sid);
int sp_qemu__q_checkpoint_delete(sp_driver_t *base, const char *snapshot_id, sp_err_t *err);
int sp_qemu__q_checkpoint_exists(sp_driver_t *base, const char *snapshot_id);
uint64_t sp_qemu__q_checkpoint_bytes(sp_driver_t *base, const char *snapshot_id);
int sp_qemu__q_checkpoint_list(sp_driver_t *base, const char *prefix,
                               void (*fn)(const char *snapshot_id, long long committed_s,
                                          void *arg),
                               void *arg, sp_err_t *err);
/* Lays out template snapshot builder b's dir from sandbox snapshot sid (taken with its whole
 * RAM, of b's size): vm.json, a new overlay over b's template image, the device state linked;
 * b then restores it instead of booting cold. 0, or -1 (logged) and b's dir gone. */
int sp_qemu__fork_seed(struct vm *b, const char *sid);
int sp_qemu__write_vm_json(struct vm *vm);
/* The spare pool's key of sandbox snapshot sid (16 hex digits, as a template size's). */
void sp_qemu__fork_pool_key(const char *sid, char key[17]);
/* Lays out spare vm's dir (its id and dir set) from snapshot sid and fills it for a restore
 * (sp_qemu__restore_fill). 0, or -1 (logged) with the dir gone. */
int sp_qemu__fork_spare_start(struct vm *vm, const char *sid);
int sp_qemu__fork_boot(sp_qemu_t *d, const sp_vm_spec_t *spec, sp_driver_cb cb, void *arg,
                       sp_err_t *err);
const char *sp_qemu__fork_tmp(const struct vm *vm);
int sp_qemu__fork_downtime(struct vm *vm);
bool sp_qemu__fork_force_stop(struct vm *vm);
void sp_qemu__fork_mig_done(struct vm *vm, long long downtime);
void sp_qemu__fork_migrated(struct vm *vm);
void sp_qemu__fork_committed(struct vm *vm);
void sp_qemu__fork_abort(struct vm *vm);
bool sp_qemu__fork_exact(const struct vm *vm);
bool sp_qemu__fork_take_source(struct vm *vm, sp_migdelta_live_t *out);
void sp_qemu__snaps_refs(sp_qemu_t *d, struct refs *r);
void sp_qemu__snaps_gc(sp_qemu_t *d, bool at_start);

/* ---- snapshot.c: suspend and wake ---- */

void sp_qemu__snap_sync(struct vm *vm);
void sp_qemu__snap_fail(struct vm *vm, const char *what, const char *detail);
bool sp_qemu__snapping(const struct vm *vm);

bool sp_qemu__snapshot_committed(const char *dir);
uint64_t sp_qemu__snapshot_bytes(const char *dir);
void sp_qemu__suspend_sums_done(struct vm *vm, struct sumjob *j);
void sp_qemu__suspend_delta_done(struct vm *vm, struct sumjob *j);
void sp_qemu__snap_send(struct vm *vm, const char *cmd, json_t *args, int fd);
void sp_qemu__restore_sums_done(struct vm *vm, struct sumjob *j);
void sp_qemu__restore_begin(struct vm *vm);
void sp_qemu__on_snap_timer(sp_timer_t *t, void *arg);
void sp_qemu__suspend_finish(struct vm *vm);
int sp_qemu__q_snapshot(sp_driver_t *base, const char *id, sp_driver_cb cb, void *arg,
                        sp_err_t *err);
int sp_qemu__q_restore(sp_driver_t *base, const sp_vm_spec_t *spec, sp_driver_cb cb, void *arg,
                       sp_err_t *err);
void sp_qemu__suspend_release(struct vm *vm);
/* Fills new VM vm (not started, its dir laid out as a suspended sandbox's) from its dir's
 * snapshot manifest and vm.json: images, size, how its RAM comes back, checksums to verify.
 * 0, or -1 with err (logged); vm is then the caller's to free. */
int sp_qemu__restore_fill(struct vm *vm, sp_err_t *err);
int sp_qemu__restore_local(sp_qemu_t *d, const sp_vm_spec_t *spec, sp_driver_cb cb, void *arg,
                           sp_err_t *err);

/* ---- shared.c: the shared snapshot dir ---- */

int sp_qemu__shared_init(sp_qemu_t *d, const char *dir, sp_err_t *err);
void sp_qemu__shared_free(sp_qemu_t *d);
bool sp_qemu__shared_streams(const struct vm *vm);
void sp_qemu__shared_template(const sp_qemu_t *d, const char *tname, sp_tmplbuild_paths_t *tp);
bool sp_qemu__shared_image(const sp_qemu_t *d, const char *local, char *out, size_t n);
bool sp_qemu__shared_publishes(const struct vm *vm);
void sp_qemu__shared_publish(struct vm *vm);
void sp_qemu__shared_publish_abandon(struct vm *vm);
bool sp_qemu__shared_committed(const sp_qemu_t *d, const char *id);
int sp_qemu__shared_fetch(sp_qemu_t *d, const sp_vm_spec_t *spec, sp_driver_cb cb, void *arg,
                          sp_err_t *err);
bool sp_qemu__shared_fetching(const sp_qemu_t *d, const char *id);
void sp_qemu__shared_forget(sp_qemu_t *d, const char *id);
uint64_t sp_qemu__shared_bytes(const sp_qemu_t *d, const char *id);
/* Sandbox snapshots for every worker (driver.h: SP_CKPT_SHARED), in <shared>/snapshots/:
 * whether sid's copy there is committed, its directory into out[n] (out may be NULL). */
bool sp_qemu__shared_snap_committed(const sp_qemu_t *d, const char *sid, char *out, size_t n);
/* A boot from sandbox snapshot spec->snapshot_id, not held here: copied in, then booted
 * (the driver's boot again); cb answered either way. */
int sp_qemu__shared_snap_fetch(sp_qemu_t *d, const sp_vm_spec_t *spec, sp_driver_cb cb, void *arg,
                               sp_err_t *err);
bool sp_qemu__shared_snap_fetching(const sp_qemu_t *d, const char *sid);
/* The snapshot committed in <snaps>/<sid> (taken of vm) is copied to the shared dir with its
 * whole RAM, then w's callers are answered (w taken); should that fail, the snapshot is
 * discarded here too. A copy here that holds the whole RAM is made a delta (shared.c). */
void sp_qemu__shared_snap_put(sp_qemu_t *d, const char *sid, const struct vm *vm, struct waiter *w);
/* The template snapshots the sandbox snapshots being copied use (tsnap.c's collection). */
void sp_qemu__shared_refs(const sp_qemu_t *d, struct refs *r);
/* The shared copy of sid goes (off the loop). */
void sp_qemu__shared_snap_forget(sp_qemu_t *d, const char *sid);
/* fn for each committed shared copy whose id starts with prefix, as the last listing of the
 * shared dir saw them (made off the loop; each call starts the next): one call old. */
void sp_qemu__shared_snap_list(sp_qemu_t *d, const char *prefix,
                               void (*fn)(const char *sid, long long committed_s, void *arg),
                               void *arg);

/* ---- sums.c: checksum and delta jobs ---- */

int sp_qemu__sum_file(const char *path, uint64_t *size, char hex[65]);
void sp_qemu__sumjob_free(struct sumjob *j);
struct sumjob *sp_qemu__sumjob_new(struct vm *vm, bool verify);
int sp_qemu__sumjob_run(sp_qemu_t *d, struct sumjob *j);
void sp_qemu__sumjob_abandon(struct sumjob *j);

/* ---- tsnap.c: template snapshots ---- */

/* Paths sandboxes use, as found on disk and in memory (tsnap.c and fork.c collect by them). */
struct refs {
    char **v;
    size_t n, cap;
    bool oom; /* an entry was lost: the picture is incomplete */
};
void sp_qemu__refs_add(struct refs *r, const char *s);
bool sp_qemu__refs_has(const struct refs *r, const char *dir);
void sp_qemu__refs_free(struct refs *r);
void sp_qemu__refs_chain(struct refs *r, const char *disk, const char *skip);

/* FNV-1a of s into h, then a separator (("ab","c") and ("a","bc") differ); start from
 * SP_QEMU_FNV_BASIS. For keys that only name things in this process or its data dir. */
#define SP_QEMU_FNV_BASIS 14695981039346656037ull
uint64_t sp_qemu__fnv1a(uint64_t h, const char *s);
int sp_qemu__tsnap_key_for(const sp_qemu_t *d, const sp_tmplbuild_paths_t *tp, int cpu_count,
                           int memory_mb, char key[17]);
void sp_qemu__tsnap_gc(sp_qemu_t *d);
bool sp_qemu__tsnap_tmp_foreign(const char *name);
/* The id (and so the cgroup) of the builder whose work dir is named dir_name
 * (".tsnap-<key>-<pid>"): "tsnap:<key>-<pid>". ':' is not a valid sandbox id, so no API call
 * reaches it; the pid keeps two spaced on one host (workers in network namespaces) building the
 * same snapshot out of each other's cgroup, whose limits and removal are one builder's. */
void sp_qemu__tsnap_cid(char *out, size_t n, const char *dir_name);
struct tsnap *sp_qemu__tsnap_for(struct vm *vm);
void sp_qemu__tsnap_failed(struct vm *vm, const char *why);
void sp_qemu__tsnap_warmup(struct vm *vm);
void sp_qemu__tsnap_commit(struct vm *vm);
/* driver.h ops->templates: the ready template snapshots, with their ready spares. */
void sp_qemu__q_templates(sp_driver_t *base,
                          void (*fn)(const char *template_name, int cpu_count, int memory_mb,
                                     int spares, void *arg),
                          void *arg);
void sp_qemu__tsnap_req_step(struct vm *vm);

/* ---- pool.c: spare clones ---- */

void sp_qemu__pool_origin_remove(const struct vm *vm);
struct poolwant *sp_qemu__pool_want(sp_qemu_t *d, const char *key);
void sp_qemu__pool_failed(sp_qemu_t *d, const char *key);
void sp_qemu__pool_kick(sp_qemu_t *d);
/* A create from sandbox snapshot sid (vm: its restore): as sp_qemu__pool_note, its spares
 * being restores of that snapshot. */
void sp_qemu__pool_note_fork(sp_qemu_t *d, const char *sid, const struct vm *vm);
/* Snapshot sid is deleted: its spares go, and no more are made. */
void sp_qemu__pool_forget_fork(sp_qemu_t *d, const char *sid);
void sp_qemu__pool_note(sp_qemu_t *d, const char *key, struct vm *vm);
/* A create of w's size (served by a spare or not): the policy counts it. */
void sp_qemu__pool_seen(sp_qemu_t *d, struct poolwant *w);
void sp_qemu__on_pool_timer(sp_timer_t *t, void *arg);
void sp_qemu__pool_warm(struct vm *vm);
struct vm *sp_qemu__pool_pick(sp_qemu_t *d, const char *key);
int sp_qemu__pool_take(struct vm *vm, const sp_vm_spec_t *spec, sp_driver_cb cb, void *arg);
/* driver.h ops->template_forget: drops a version's spares and the sizes wanted of it. */
int sp_qemu__q_template_forget(sp_driver_t *base, const char *template_name, const char *version);
/* tsnap.c: the template snapshot build metrics listed before the first build. */
void sp_qemu__tsnap_metrics_declare(void);
/* A create of a size the pool serves: counts whether a spare was there (base/metrics.h). */
void sp_qemu__pool_count(bool hit);
/* The pool's size as a gauge, read at each scrape while the driver lives. */
void sp_qemu__pool_metrics_start(sp_qemu_t *d);
void sp_qemu__pool_metrics_stop(sp_qemu_t *d);

/* Whether the host is busy with CPU-heavy VM work: a boot (sandbox's, spare's or template
 * snapshot builder's) or a suspend under way, or a spare being warmed. Spares and snapshots
 * made ahead wait for it to end. */
bool sp_qemu__host_busy(const sp_qemu_t *d);

/* ---- ahead.c: template snapshots made ahead ---- */

int sp_qemu__q_prepare(sp_driver_t *base, const char *template_name, int cpu_count, int memory_mb,
                       sp_err_t *err);
void sp_qemu__ahead_kick(sp_qemu_t *d);
void sp_qemu__on_ahead_timer(sp_timer_t *t, void *arg);
void sp_qemu__ahead_free(sp_qemu_t *d);
void sp_qemu__ahead_metrics_declare(void);

/* ---- confine.c: the jail ---- */

int sp_qemu__confine_init(sp_qemu_t *d, const sp_qemu_opts_t *o, sp_err_t *err);
void sp_qemu__confine_free(sp_qemu_t *d);
const char *sp_qemu__confine_refusal(const sp_qemu_t *d, bool have_cgroup);
size_t sp_qemu__confine_insecure(const sp_qemu_t *d, const char **out, size_t n);
pid_t sp_qemu__confine_spawn(struct vm *vm, char *const argv[], const char *log_path,
                             const sp_cgroup_join_t *cg, int *pidfd, sp_err_t *err);
void sp_qemu__confine_adopted(struct vm *vm);
void sp_qemu__confine_release(struct vm *vm);
void sp_qemu__confine_ram_prepare(sp_qemu_t *d, const char *dir);
void sp_qemu__confine_ram_forget(sp_qemu_t *d, const char *dir);
int sp_qemu__confine_ram_ident(const struct vm *vm, uint64_t *dev, uint64_t *ino);
bool sp_qemu__confine_ram_wait(struct vm *vm);

/* ---- util.c: helpers ---- */

int sp_qemu__sfmt(char *out, size_t n, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
uint64_t sp_qemu__mono_ms(void);
uint32_t sp_qemu__env_ms(const char *name, uint32_t dflt);
bool sp_qemu__resolve_program(const char *name, char *out);
bool sp_qemu__have_program(const char *name);
bool sp_qemu__valid_id(const char *id);
void sp_qemu__vm_path(const struct vm *vm, const char *name, char *out, size_t n);
bool sp_qemu__file_exists(const char *p);
/* path lies inside dir (a prefix followed by a slash); never inside an empty dir. */
bool sp_qemu__path_under(const char *path, const char *dir);
ssize_t sp_qemu__read_small(const char *path, char *buf, size_t n);
int sp_qemu__write_atomic(const char *path, const char *data, size_t len);
/* Removes path (a VM or snapshot directory) off the loop (loop/discard.h): renamed into
 * <vms>/.trash (<shared>/sandboxes/.trash for a path in the shared snapshot dir) at once,
 * unlinked on a worker; a RAM file of a GiB takes 55-135 ms to unlink. Loop thread only;
 * workers call sp_rm_rf (base/rmtree.h). */
void sp_qemu__discard(const sp_qemu_t *d, const char *path);
/* At start: what an earlier run (or, in the shared dir, any worker) discarded and had not
 * finished removing. */
void sp_qemu__discard_leftovers(const sp_qemu_t *d);
int sp_qemu__pidfd_open(pid_t pid);
void sp_qemu__console_tail(const struct vm *vm, char *out, size_t n);
void sp_qemu__console_trim(const struct vm *vm);
pid_t sp_qemu__spawn(char *const argv[], const struct spawn_opts *o, int *pidfd, sp_err_t *err);
void sp_qemu__child_free(struct child *c);
struct child *sp_qemu__child_start(sp_qemu_t *d, char *const argv[], const struct spawn_opts *o,
                                   uint32_t timeout_ms, child_cb cb, void *arg, sp_err_t *err);
bool sp_qemu__cg_create(struct vm *vm, sp_cgroup_join_t *join);
void sp_qemu__cg_remove(sp_qemu_t *d, const char *id);
/* driver.c: a builder's or spare's dir an earlier driver left: its QEMU (killed, with its
 * process group), its files and its cgroup (cid) go. The QEMU pid killed, 0 when none ran. */
pid_t sp_qemu__leftover_remove(sp_qemu_t *d, const char *dir, const char *cid);
int sp_qemu__fsync_path(const char *p, int flags);
bool sp_qemu__qcow2_backing_name(const char *path, char *out, size_t n);
bool sp_qemu__qcow2_backing(const char *path, char *out, size_t n);
int sp_qemu__qcow2_standalone(const char *path);
int sp_qemu__qcow2_set_backing(const char *path, const char *name);

#endif
