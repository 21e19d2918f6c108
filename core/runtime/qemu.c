/*
 * qemu.c - the QEMU microvm runtime driver (see qemu.h for the on-disk layout).
 *
 * Owns one struct vm per sandbox it runs or has re-adopted: the QEMU process
 * (watched through a pidfd), its QMP client, its agent channel and its
 * cgroup. Never blocks the loop on a VM: qemu-img, QEMU and the probes are
 * fork/exec'd children watched by pidfd; sockets are non-blocking. File
 * system work that is quick (pidfile, vm.json, removing a VM directory) is
 * done inline. Every completion goes through the driver's done-queue, so a
 * callback never runs inside the call that armed it and may call back into
 * the driver.
 *
 * Guest RAM lives in <vm>/mem.ram (memory-backend-file, share=on), so a
 * suspend writes only device state: stop, migrate with x-ignore-shared to a
 * passed fd, fdatasync RAM file + device state + overlay (a `sync -d` child,
 * off the loop) while a thread checksums the three, then commit by an atomic
 * rename of snapshot/manifest.json (sizes and checksums), then quit QEMU.
 * Restore starts QEMU on the same RAM file with -incoming defer, migrate-incoming
 * from a passed fd, cont, and invalidates the snapshot once the vCPUs run (the
 * RAM file and the disk move on from there).
 *
 * Snapshot checksums (sum_files): SHA-256 through OpenSSL, which uses the CPU's
 * SHA extensions here and beats libsodium's BLAKE2b on one core. Only non-zero
 * 4 KiB pages are hashed (holes are skipped with SEEK_DATA, written zeros by a
 * scan), and 1 MiB chunks are spread over one thread per CPU (at most 4), so a
 * RAM file costs what it holds rather than its size. A wake checks sizes and the
 * device state's checksum (60 KB, inline) before it starts anything: a mismatch
 * or an unreadable manifest refuses the wake and the sandbox stays suspended.
 * The RAM file's and the disk's checksums cannot be verified after the wake (the
 * RAM file is mapped shared and the guest writes it, and the disk, as soon as
 * its vCPUs run), and verifying them first would add the whole hash time to
 * every wake. So they are verified off the loop from the moment the wake is
 * asked for, alongside QEMU's start and device state load (time the wake spends
 * anyway), and the vCPUs start only once they match (RS_VERIFY): the wake waits
 * only for what the hash takes beyond that. A mismatch stops QEMU (which has
 * written nothing: the source was stopped, so the guest stays paused), keeps the
 * snapshot and marks it corrupt. The vCPUs seldom wait for the checksums: what
 * they add to a wake is QEMU sharing the CPUs with the hash threads (with one
 * thread fewer the wait grew instead; bench/lifecycle_bench.py prints figures).
 *
 * Template snapshots (qemu.h): a builder VM (a struct vm with tsnap_build set,
 * an id no API call can name, its work dir vms/.tsnap-<key>-<pid>) boots cold,
 * runs the template's warmup (tsnap_warmup, core/channel/exec.h on its agent), settles,
 * and goes through the same suspend steps; suspend_finish then freezes its files
 * and renames the work dir into the template build. A request for a snapshot
 * without a sandbox (sp_qemu_template_snapshot) is a struct vm with tsnap_req set
 * that never starts QEMU: it waits like a boot and is answered and freed in
 * tsnap_req_step. Every transition of a boot waiting for a snapshot goes through
 * on_kick, so no completion frees a VM another loop over the table is holding.
 * tsnap_gc removes snapshots nobody will clone again once no sandbox uses them
 * (tsnap_refs: RAM mappings and overlay backing files, read from every VM dir).
 *
 * Does not know the database or HTTP; does not build images (guest/ does).
 */
#include "core/runtime/qemu.h"

#include <ctype.h>
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <ftw.h>
#include <limits.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <openssl/evp.h>

#include "core/channel/agentconn.h"
#include "core/runtime/cgroup.h"
#include "core/channel/exec.h"
#include "base/log.h"
#include "core/runtime/migdelta.h"
#include "core/runtime/qmp.h"
#include "guest/bootargs.h"
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
#define SP_QEMU_POOL_DEFAULT   2          /* spare clones per template size in use */
#define SP_QEMU_POOL_MAX       16
#define SP_QEMU_POOL_KEYS      4          /* template sizes with spares at once (LRU) */
#define SP_QEMU_POOL_IDLE_MS   1800000u   /* a size nobody created for this long loses them */
#define SP_QEMU_POOL_TICK_MS   100u       /* refill check while boots are in flight */
#define SP_QEMU_POOL_SETTLE_MS 250u /* no refill this soon after a sandbox came up: its first
                                     * commands, not a spare's restore, get the CPUs */
#define SP_QEMU_POOL_RETRY_MS  60000u     /* after a spare failed to come up */
#define SP_QEMU_POOL_WARM_MS   30000u     /* each warm-up command of a spare */

typedef struct sp_qemu sp_qemu_t;

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
static const char *const sum_part[SUM_N] = {"ram", "devstate", "disk"};

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
    char template_name[128];
    int state;
    uint64_t failed_ms; /* mono_ms() of the last failure */
    uint64_t start_ms;
    char why[160]; /* the last failure, client-safe */
};

struct vm {
    sp_qemu_t *d;
    struct vm *next;
    char id[SP_QEMU_ID_MAX + 1];
    char dir[PATH_MAX];
    enum phase ph;
    bool adopted;
    /* boot inputs (NULL once QEMU is started) */
    sp_tmplbuild_paths_t *tp;
    char template_name[128];
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
    sp_timer_t boot_timer;
    uint64_t boot_start_ms;
    sp_timer_t kill_timer;
    bool keep_logs; /* a failed boot keeps console.log and qemu.log */
    bool boot_failed;
    sp_err_t boot_err;
    struct waiter *boot_w, *destroy_w;
    /* suspend / restore */
    bool restoring;
    struct waiter *snap_w;
    int snap_step;
    int snap_fd;
    bool snap_was_paused;
    sp_timer_t snap_timer;
    struct child *sync;
    uint64_t snap_start_ms;
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
    bool cg;                 /* the VM runs in its own cgroup (core/runtime/cgroup.h), with its limits */
    /* template snapshots */
    struct tsnap *tsnap_build; /* this VM is the builder of that snapshot (never a sandbox) */
    struct tsnap *tsnap_wait;  /* this boot clones that snapshot (or waits for it) */
    sp_agentstream_t *settle;  /* builder: `sync` in the guest before the snapshot */
    sp_exec_t *warm;           /* builder: the template's warmup command */
    uint64_t warm_start_ms;
    bool tsnap_req;                 /* no VM: a request for a template snapshot (sp_qemu_template_
                                     * snapshot), answered through boot_w */
    sp_qemu_tsnap_info_t *req_info; /* the request's caller's, filled before its callback */
    char *clone_src;      /* template snapshot dir our RAM is mapped from; NULL: own RAM */
    bool clone_boot;      /* this boot restores clone_src's device state */
    bool cold;            /* this boot must not use a template snapshot */
    bool restore_stream;  /* restoring a snapshot whose stream carries the RAM */
    bool restore_delta;   /* restoring a clone's snapshot: template RAM + the stream's delta */
    bool restore_running; /* the loaded VM came up running (never: sources are stopped) */
    uint64_t cpu_ticks, cpu_ms;
    double cpu_pct;
    /* spare clones (pool_*) */
    bool pooled;        /* a spare: no sandbox yet, invisible to vm_find */
    bool pool_ready;    /* warmed and stopped: pool_take may hand it out */
    bool pool_drop;     /* to be stopped by the pool timer (a safe place to free it) */
    int pool_warm_step; /* the next of pool_warm_cmds to run */
    char pool_key[17];  /* its template snapshot's key */
};

/* A template size recently created from: the pool keeps spare clones of it (pool_fill). */
struct poolwant {
    struct poolwant *next; /* most recently used first */
    char key[17];
    char template_name[128];
    sp_tmplbuild_paths_t tp;
    int cpu_count, memory_mb;
    uint64_t disk_total;
    uint64_t used_ms;  /* mono_ms() of the last create of this size */
    uint64_t retry_ms; /* no new spare before this (one failed) */
};

struct sp_qemu {
    sp_driver_t base;
    char data_dir[PATH_MAX];
    char vms_dir[PATH_MAX];
    char *qemu, *qemu_img;
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
    int pool_size; /* spare clones kept per template size in use; 0: none */
    unsigned pool_seq;
    sp_timer_t pool_timer;
    struct poolwant *wants;
    uint64_t pool_quiet_until; /* mono ms: a sandbox came up (SP_QEMU_POOL_SETTLE_MS) */
};

static void vm_stop(struct vm *vm, bool graceful);
static void vm_finish(struct vm *vm);
static void suspend_finish(struct vm *vm);
static void restore_begin(struct vm *vm);
static void restore_loaded(struct vm *vm);
static void restore_up(struct vm *vm);
static void restore_corrupt(struct vm *vm);
static void restore_verify(struct vm *vm, json_t *man);
static void vm_adopt_connect(struct vm *vm);
static void qmp_try_connect(struct vm *vm);
static void kick(sp_qemu_t *d);
static void tsnap_failed(struct vm *vm, const char *why);
static void tsnap_commit(struct vm *vm);
static void tsnap_settle(struct vm *vm);
static void tsnap_warmup(struct vm *vm);
static bool tsnap_tmp_foreign(const char *name);
static void tsnap_gc(sp_qemu_t *d);
static void pool_warm(struct vm *vm);
static void on_pool_timer(sp_timer_t *t, void *arg);
static int tsnap_key_for(const sp_qemu_t *d, const sp_tmplbuild_paths_t *tp, int cpu_count,
                         int memory_mb, char key[17]);
static void pool_kick(sp_qemu_t *d);
static void pool_failed(sp_qemu_t *d, const char *key);

/* ---------- small helpers ---------- */

/* snprintf for paths and small values. Truncation cannot happen for paths: the data
 * directory is limited at creation to leave room below PATH_MAX for every name we add. */
static int sfmt(char *out, size_t n, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
static int sfmt(char *out, size_t n, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    int r = vsnprintf(out, n, fmt, ap);
    va_end(ap);
    return r;
}

static uint64_t mono_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000u + (uint64_t)ts.tv_nsec / 1000000u;
}

static uint32_t env_ms(const char *name, uint32_t dflt)
{
    const char *s = getenv(name);
    if (s == NULL || *s == '\0')
        return dflt;
    char *end;
    unsigned long v = strtoul(s, &end, 10);
    if (*end != '\0' || v == 0 || v > 3600000ul)
        return dflt;
    return (uint32_t)v;
}

/* The executable execvp would run for name, into out[PATH_MAX]. false if none. */
static bool resolve_program(const char *name, char *out)
{
    if (strchr(name, '/') != NULL) {
        sfmt(out, PATH_MAX, "%s", name);
        return access(name, X_OK) == 0;
    }
    const char *path = getenv("PATH");
    if (path == NULL)
        path = "/usr/local/bin:/usr/bin:/bin";
    while (*path != '\0') {
        size_t l = strcspn(path, ":");
        if (l > 0 && l < PATH_MAX - 1 - strlen(name)) {
            sfmt(out, PATH_MAX, "%.*s/%s", (int)l, path, name);
            if (access(out, X_OK) == 0)
                return true;
        }
        path += l;
        if (*path == ':')
            path++;
    }
    return false;
}

static bool have_program(const char *name)
{
    char p[PATH_MAX];
    return resolve_program(name, p);
}

static bool valid_id(const char *id)
{
    size_t n = id != NULL ? strlen(id) : 0;
    if (n == 0 || n > SP_QEMU_ID_MAX || id[0] == '.')
        return false;
    for (size_t i = 0; i < n; i++) {
        unsigned char c = (unsigned char)id[i];
        if (!isalnum(c) && c != '-' && c != '_' && c != '.')
            return false;
    }
    return true;
}

static void vm_path(const struct vm *vm, const char *name, char *out, size_t n)
{
    sfmt(out, n, "%s/%s", vm->dir, name);
}

static bool file_exists(const char *p)
{
    return access(p, F_OK) == 0;
}

/* Reads at most n-1 bytes of a small file into buf, NUL-terminated. -1 on error. */
static ssize_t read_small(const char *path, char *buf, size_t n)
{
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0)
        return -1;
    ssize_t got = 0;
    while ((size_t)got < n - 1) {
        ssize_t r = read(fd, buf + got, n - 1 - (size_t)got);
        if (r < 0 && errno == EINTR)
            continue;
        if (r <= 0)
            break;
        got += r;
    }
    close(fd);
    buf[got] = '\0';
    return got;
}

/* Writes a file atomically (temp + rename). */
static int write_atomic(const char *path, const char *data, size_t len)
{
    char tmp[PATH_MAX + 8];
    sfmt(tmp, sizeof tmp, "%s.tmp", path);
    int fd = open(tmp, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    if (fd < 0)
        return -1;
    ssize_t w = write(fd, data, len);
    close(fd);
    if (w != (ssize_t)len || rename(tmp, path) < 0) {
        unlink(tmp);
        return -1;
    }
    return 0;
}

static int rm_one(const char *p, const struct stat *st, int flag, struct FTW *f)
{
    if (remove(p) < 0 && errno != ENOENT)
        sp_log(SP_LOG_WARN, "qemu", "cannot remove path=%s err=%s", p, strerror(errno));
    return 0;
}

static void rm_rf(const char *path)
{
    nftw(path, rm_one, 16, FTW_DEPTH | FTW_PHYS | FTW_MOUNT);
}

static int pidfd_open_(pid_t pid)
{
    return (int)syscall(SYS_pidfd_open, pid, 0);
}

/* The last bytes of the console, made printable, for a log line. */
static void console_tail(const struct vm *vm, char *out, size_t n)
{
    char path[PATH_MAX + 16];
    vm_path(vm, "console.log", path, sizeof path);
    out[0] = '\0';
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0)
        return;
    struct stat st;
    size_t want = n - 1;
    off_t off = 0;
    if (fstat(fd, &st) == 0 && (size_t)st.st_size > want)
        off = st.st_size - (off_t)want;
    ssize_t r = pread(fd, out, want, off);
    close(fd);
    if (r < 0)
        r = 0;
    out[r] = '\0';
    for (ssize_t i = 0; i < r; i++) {
        unsigned char c = (unsigned char)out[i];
        if (c == '\n' || c == '\r')
            out[i] = '|';
        else if (c < 0x20 || c > 0x7e)
            out[i] = '.';
    }
}

/* Keeps console.log bounded: QEMU writes it with O_APPEND, so after we cut it to its
 * tail QEMU's next write lands at the new end. A write racing the cut may be lost. */
static void console_trim(const struct vm *vm)
{
    char path[PATH_MAX + 16];
    vm_path(vm, "console.log", path, sizeof path);
    int fd = open(path, O_RDWR | O_CLOEXEC);
    if (fd < 0)
        return;
    struct stat st;
    if (fstat(fd, &st) == 0 && (uint64_t)st.st_size > SP_QEMU_CONSOLE_MAX) {
        char *buf = malloc(SP_QEMU_CONSOLE_KEEP);
        if (buf != NULL) {
            ssize_t r = pread(fd, buf, SP_QEMU_CONSOLE_KEEP, st.st_size - SP_QEMU_CONSOLE_KEEP);
            if (r > 0 && ftruncate(fd, 0) == 0 && pwrite(fd, buf, (size_t)r, 0) != r)
                sp_log(SP_LOG_DEBUG, "qemu", "console trim short write sandbox=%s", vm->id);
            free(buf);
        }
    }
    close(fd);
}

/* ---------- snapshot checksums ---------- */

static void put_le64(uint8_t *p, uint64_t v)
{
    for (int i = 0; i < 8; i++)
        p[i] = (uint8_t)(v >> (8 * i));
}

static bool all_zero(const uint8_t *p, size_t n)
{
    size_t i = 0;
    for (; i + 8 <= n; i += 8) {
        uint64_t w;
        memcpy(&w, p + i, sizeof w);
        if (w != 0)
            return false;
    }
    for (; i < n; i++)
        if (p[i] != 0)
            return false;
    return true;
}

/* One part being checksummed (sum_parts). */
struct sumpart {
    int fd;
    uint64_t size, nchunks, first_stripe; /* its stripes in the shared numbering */
    uint8_t *md;                          /* nchunks * 32: each chunk's SHA-256 */
    uint8_t *has;                         /* nchunks: 1 = the chunk is not all zero */
};

struct sumwork {
    struct sumpart *p;
    int n;
    uint64_t stripes;
    atomic_ulong next;
    atomic_int err; /* the first errno */
    int err_part;   /* and its file (written once, by the thread that set err) */
    const sp_work_t *work; /* NULL, or the job whose cancel ends this early */
};

static void sum_error(struct sumwork *w, int part, int e)
{
    int z = 0;
    if (atomic_compare_exchange_strong(&w->err, &z, e))
        w->err_part = part;
}

#define SUM_STRIPE 8    /* chunks a worker takes at a time */
#define SUM_PAGE   4096 /* zero pages inside a chunk are skipped */

/* Takes stripes until none is left: each chunk is a hole (SEEK_DATA says so), all zero, or
 * hashed. Any number of these run on one sumwork. */
static void *sum_worker(void *arg)
{
    struct sumwork *w = arg;
    uint8_t *buf = malloc(SP_QEMU_SUM_CHUNK);
    EVP_MD_CTX *ctx = EVP_MD_CTX_new();
    if (buf == NULL || ctx == NULL) {
        sum_error(w, -1, ENOMEM);
        free(buf);
        EVP_MD_CTX_free(ctx);
        return NULL;
    }
    for (;;) {
        uint64_t s = atomic_fetch_add(&w->next, 1);
        if (s >= w->stripes || atomic_load(&w->err) != 0)
            break;
        int i = 0;
        while (i + 1 < w->n && w->p[i + 1].first_stripe <= s)
            i++;
        struct sumpart *p = &w->p[i];
        uint64_t c0 = (s - p->first_stripe) * SUM_STRIPE;
        uint64_t c1 = c0 + SUM_STRIPE < p->nchunks ? c0 + SUM_STRIPE : p->nchunks;
        uint64_t data = 0, hole = 0; /* the data extent last found: [data, hole) */
        bool seek = true;            /* SEEK_DATA works on this file system */
        int e = 0;
        for (uint64_t c = c0; c < c1 && e == 0; c++) {
            if (w->work != NULL && sp_work_cancelled(w->work)) {
                e = ECANCELED;
                break;
            }
            uint64_t off = c * SP_QEMU_SUM_CHUNK;
            uint64_t end = p->size - off < SP_QEMU_SUM_CHUNK ? p->size : off + SP_QEMU_SUM_CHUNK;
            uint64_t pos = off; /* pages before pos are done */
            bool any = false;
            if (EVP_DigestInit_ex(ctx, EVP_sha256(), NULL) != 1)
                e = ENOMEM;
            while (pos < end && e == 0) {
                uint64_t rs = pos, re = end; /* the next range that may hold data */
                if (seek && hole <= pos) {
                    off_t d = lseek(p->fd, (off_t)pos, SEEK_DATA);
                    off_t h = d >= 0 ? lseek(p->fd, d, SEEK_HOLE) : -1;
                    if (d < 0 && errno == ENXIO) {
                        data = hole = p->size; /* nothing but holes from pos on */
                    } else if (d < 0 || h < 0) {
                        seek = false;
                    } else {
                        data = (uint64_t)d;
                        hole = (uint64_t)h;
                    }
                }
                if (seek) {
                    if (data >= end)
                        break; /* the rest of the chunk is a hole */
                    rs = data > pos ? data : pos;
                    re = hole < end ? hole : end;
                }
                /* whole pages, counted from the chunk's start */
                rs = off + (rs - off) / SUM_PAGE * SUM_PAGE;
                if (rs < pos)
                    rs = pos;
                re = off + (re - off + SUM_PAGE - 1) / SUM_PAGE * SUM_PAGE;
                if (re > end)
                    re = end;
                size_t got = 0, len = (size_t)(re - rs);
                while (got < len && e == 0) {
                    ssize_t r = pread(p->fd, buf + got, len - got, (off_t)(rs + got));
                    if (r > 0)
                        got += (size_t)r;
                    else if (r < 0 && errno != EINTR)
                        e = errno;
                    else if (r == 0)
                        e = EIO; /* the file shrank under us */
                }
                for (size_t k = 0; e == 0 && k < len; k += SUM_PAGE) {
                    size_t pl = len - k < SUM_PAGE ? len - k : SUM_PAGE;
                    if (all_zero(buf + k, pl))
                        continue;
                    uint8_t idx[4];
                    uint32_t pg = (uint32_t)((rs + k - off) / SUM_PAGE);
                    for (int b = 0; b < 4; b++)
                        idx[b] = (uint8_t)(pg >> (8 * b));
                    if (EVP_DigestUpdate(ctx, idx, sizeof idx) != 1 ||
                        EVP_DigestUpdate(ctx, buf + k, pl) != 1)
                        e = ENOMEM;
                    any = true;
                }
                pos = re;
            }
            unsigned mdlen = 0;
            if (e == 0 && any &&
                (EVP_DigestFinal_ex(ctx, p->md + 32 * c, &mdlen) != 1 || mdlen != 32))
                e = ENOMEM;
            if (e == 0)
                p->has[c] = any;
        }
        if (e != 0) {
            sum_error(w, e == ECANCELED ? -1 : i, e);
            break;
        }
    }
    free(buf);
    EVP_MD_CTX_free(ctx);
    return NULL;
}

/* The checksums (SP_QEMU_SUM_ALGO) of n files into hex[i] (65 bytes each), their sizes into
 * size[i]: per file, SHA-256 over "space-sum-1" and the file size, then, for each 1 MiB chunk
 * holding a byte that is not zero, the chunk's index (u64 LE) and the chunk's digest: SHA-256
 * over each of its 4 KiB pages that is not all zero, as its index in the chunk (u32 LE) and
 * its bytes. Zero pages cost a SEEK_DATA (holes: never read) or a scan (written zeros) instead
 * of a hash, so a sparse RAM file costs what it holds even when the guest scattered it, and
 * the value does not depend on how the file system stores zeros. Chunks are hashed in
 * parallel (up to SP_QEMU_SUM_THREADS threads, one per CPU, this one included).
 * SHA-256 because OpenSSL's uses the CPU's SHA extensions here: faster a core than
 * libsodium's BLAKE2b. pread, not mmap: a file that shrinks under a
 * mapping raises SIGBUS. A cancel of work (not NULL) ends it early (ECANCELED). Thread-safe.
 * 0, or -1 with errno and *bad set to the file that failed (-1 when none did in particular). */
static int sum_files(const char *const *paths, int n, int threads, const sp_work_t *work,
                     uint64_t *size, char (*hex)[65], int *bad)
{
    struct sumpart p[SUM_N];
    struct sumwork w = {.p = p, .n = n, .work = work, .err_part = -1};
    atomic_init(&w.next, 0);
    atomic_init(&w.err, 0);
    *bad = -1;
    if (n < 1 || n > SUM_N) {
        errno = EINVAL;
        return -1;
    }
    int rc = -1, e = 0;
    memset(p, 0, sizeof p);
    for (int i = 0; i < n; i++)
        p[i].fd = -1;
    for (int i = 0; i < n; i++) {
        struct stat st;
        p[i].fd = open(paths[i], O_RDONLY | O_CLOEXEC);
        if (p[i].fd < 0 || fstat(p[i].fd, &st) < 0) {
            e = errno;
            *bad = i;
            goto out;
        }
        p[i].size = (uint64_t)st.st_size;
        p[i].nchunks = (p[i].size + SP_QEMU_SUM_CHUNK - 1) / SP_QEMU_SUM_CHUNK;
        p[i].first_stripe = w.stripes;
        w.stripes += (p[i].nchunks + SUM_STRIPE - 1) / SUM_STRIPE;
        p[i].md = malloc(p[i].nchunks * 32 + 1);
        p[i].has = calloc(p[i].nchunks + 1, 1);
        if (p[i].md == NULL || p[i].has == NULL) {
            e = ENOMEM;
            goto out;
        }
    }
    int nt = threads < 1 ? 1 : threads > SP_QEMU_SUM_THREADS ? SP_QEMU_SUM_THREADS : threads;
    if ((uint64_t)nt > w.stripes)
        nt = w.stripes > 0 ? (int)w.stripes : 1;
    pthread_t th[SP_QEMU_SUM_THREADS];
    int started = 0;
    for (int i = 1; i < nt; i++)
        if (pthread_create(&th[started], NULL, sum_worker, &w) == 0)
            started++; /* fewer helpers only make it slower */
    sum_worker(&w);
    for (int i = 0; i < started; i++)
        pthread_join(th[i], NULL);
    if ((e = atomic_load(&w.err)) != 0) {
        *bad = w.err_part;
        goto out;
    }
    for (int i = 0; i < n; i++) {
        EVP_MD_CTX *c = EVP_MD_CTX_new();
        uint8_t rec[8 + 32], md[EVP_MAX_MD_SIZE];
        unsigned mdlen = 0;
        bool ok = c != NULL && EVP_DigestInit_ex(c, EVP_sha256(), NULL) == 1;
        memcpy(rec, "space-sum-1", 11);
        put_le64(rec + 11, p[i].size);
        ok = ok && EVP_DigestUpdate(c, rec, 19) == 1;
        for (uint64_t k = 0; ok && k < p[i].nchunks; k++) {
            if (!p[i].has[k])
                continue;
            put_le64(rec, k);
            memcpy(rec + 8, p[i].md + 32 * k, 32);
            ok = EVP_DigestUpdate(c, rec, sizeof rec) == 1;
        }
        ok = ok && EVP_DigestFinal_ex(c, md, &mdlen) == 1 && mdlen == 32;
        EVP_MD_CTX_free(c);
        if (!ok) {
            e = ENOMEM;
            goto out;
        }
        for (unsigned k = 0; k < mdlen; k++)
            sfmt(hex[i] + 2 * k, 3, "%02x", md[k]);
        size[i] = p[i].size;
    }
    rc = 0;
out:
    for (int i = 0; i < n; i++) {
        if (p[i].fd >= 0)
            close(p[i].fd);
        free(p[i].md);
        free(p[i].has);
    }
    if (rc < 0)
        errno = e != 0 ? e : EIO;
    return rc;
}

static int sum_file(const char *path, uint64_t *size, char hex[65])
{
    int bad;
    char(*h)[65] = (char(*)[65])hex;
    return sum_files(&path, 1, 1, NULL, size, h, &bad);
}

static void sumjob_free(struct sumjob *j)
{
    if (j->in_fd >= 0)
        close(j->in_fd);
    if (j->out_fd >= 0)
        close(j->out_fd);
    free(j);
}

/* The job itself, on a worker thread (sp_loop_work): touches nothing but j. */
static void sum_run(sp_work_t *w, void *arg)
{
    struct sumjob *j = arg;
    uint64_t t0 = mono_ms();
    if (j->delta) {
        j->rc = sp_migdelta_filter(j->in_fd, j->out_fd, j->base, "mem", &j->st, j->why,
                                   sizeof j->why);
        close(j->in_fd); /* a writer still at it gets EPIPE rather than blocking */
        j->in_fd = -1;
        goto done;
    }
    const char *paths[SUM_N];
    int idx[SUM_N], n = 0, bad = -1;
    for (int i = 0; i < SUM_N; i++) {
        if (j->path[i][0] != '\0') {
            paths[n] = j->path[i];
            idx[n++] = i;
        }
    }
    uint64_t size[SUM_N] = {0};
    char hex[SUM_N][65];
    /* One thread per CPU. On a wake QEMU loads the device state meanwhile: leaving it a CPU
     * (one thread fewer) did not help on 2 CPUs: the wait only moved to the checksums. */
    long cpus = sysconf(_SC_NPROCESSORS_ONLN);
    int threads = cpus < 1 ? 1 : (int)(cpus > SP_QEMU_SUM_THREADS ? SP_QEMU_SUM_THREADS : cpus);
    if (n > 0 && sum_files(paths, n, threads, w, size, hex, &bad) < 0) {
        j->bad = bad >= 0 ? idx[bad] : idx[0];
        j->err_no = errno != 0 ? errno : EIO;
    }
    for (int k = 0; k < n && j->bad < 0; k++) {
        memcpy(j->got[idx[k]], hex[k], 65);
        j->size[idx[k]] = size[k];
        if (j->verify && strcmp(hex[k], j->want[idx[k]]) != 0)
            j->bad = idx[k];
    }
done:
    j->ms = mono_ms() - t0;
}

/* A job for vm, not started: fill path[] (and want[] with verify), then sumjob_run. */
static struct sumjob *sumjob_new(struct vm *vm, bool verify)
{
    struct sumjob *j = calloc(1, sizeof(*j));
    if (j == NULL)
        return NULL;
    j->vm = vm;
    j->verify = verify;
    j->bad = -1;
    j->in_fd = -1;
    j->out_fd = -1;
    return j;
}

static void on_sum_done(void *arg, bool cancelled);

/* Queues j on the loop's SP_WORK_LONG lane; on failure frees j. 0 when queued. */
static int sumjob_run(sp_qemu_t *d, struct sumjob *j)
{
    j->work = sp_loop_work(d->base.loop, SP_WORK_LONG, sum_run, on_sum_done, j);
    if (j->work == NULL) {
        sumjob_free(j);
        return -1;
    }
    return 0;
}

/* The VM no longer wants the result: the job stops at its next chunk (a delta filter: once
 * QEMU closes the pipe) and on_sum_done frees it. NULL does nothing. */
static void sumjob_abandon(struct sumjob *j)
{
    if (j == NULL)
        return;
    j->vm = NULL;
    sp_work_cancel(j->work);
}

static void suspend_sums_done(struct vm *vm, struct sumjob *j);
static void restore_sums_done(struct vm *vm, struct sumjob *j);
static void suspend_delta_done(struct vm *vm, struct sumjob *j);

static void on_sum_done(void *arg, bool cancelled)
{
    struct sumjob *j = arg;
    struct vm *vm = j->vm;
    if (cancelled) {
        /* Abandoned (vm NULL), or cancelled by the loop going away first: the VM lets go too. */
        if (vm != NULL && vm->sum == j)
            vm->sum = NULL;
        if (vm != NULL && vm->delta == j)
            vm->delta = NULL;
        sumjob_free(j);
        return;
    }
    if (j->delta) {
        vm->delta = NULL;
        suspend_delta_done(vm, j);
    } else {
        vm->sum = NULL;
        if (j->verify)
            restore_sums_done(vm, j);
        else
            suspend_sums_done(vm, j);
    }
    sumjob_free(j);
}

/* ---------- completions ---------- */

static void on_done_timer(sp_timer_t *t, void *arg)
{
    sp_qemu_t *d = arg;
    struct done *list = d->done_head;
    d->done_head = d->done_tail = NULL;
    while (list != NULL) {
        struct done *x = list;
        list = x->next;
        x->cb(x->arg, x->failed ? &x->err : NULL);
        free(x);
    }
}

/* Queues cb for the next loop turn. Only fails on allocation. */
static int complete(sp_qemu_t *d, sp_driver_cb cb, void *arg, const sp_err_t *err)
{
    struct done *x = calloc(1, sizeof(*x));
    if (x == NULL)
        return -1;
    x->cb = cb;
    x->arg = arg;
    if (err != NULL) {
        x->failed = true;
        x->err = *err;
    }
    if (d->done_tail != NULL)
        d->done_tail->next = x;
    else
        d->done_head = x;
    d->done_tail = x;
    if (!sp_timer_armed(&d->done_timer))
        sp_timer_start(&d->done_timer, 0);
    return 0;
}

static void complete_all(sp_qemu_t *d, struct waiter **list, const sp_err_t *err)
{
    struct waiter *w = *list;
    *list = NULL;
    while (w != NULL) {
        struct waiter *n = w->next;
        if (complete(d, w->cb, w->arg, err) < 0)
            sp_log(SP_LOG_ERROR, "qemu", "out of memory: a driver callback is lost");
        free(w);
        w = n;
    }
}

static int add_waiter(struct waiter **list, sp_driver_cb cb, void *arg, sp_err_t *err)
{
    struct waiter *w = calloc(1, sizeof(*w));
    if (w == NULL)
        return sp_err_set(err, SP_EINTERNAL, "out of memory");
    w->cb = cb;
    w->arg = arg;
    w->next = *list;
    *list = w;
    return 0;
}

/* ---------- children ---------- */

struct spawn_opts {
    const char *out_path;       /* stdout+stderr (appended); NULL: /dev/null */
    int stdin_fd;               /* -1: /dev/null */
    const sp_cgroup_join_t *cg; /* NULL: stay in our cgroup; else join before exec or fail */
    const char *sandbox;        /* for log lines; NULL for helpers */
    bool new_session;
};

/* After fork, waits for the child to join its cgroup: it writes its errno to the status
 * pipe and exits if it cannot; the pipe closes without data once it has joined (close_range
 * before exec). Blocks the loop only for the child's few syscalls. 0 when joined. */
static int await_join(int rd, pid_t pid, int *join_errno)
{
    int e = 0;
    ssize_t r;
    do
        r = read(rd, &e, sizeof e);
    while (r < 0 && errno == EINTR);
    close(rd);
    if (r <= 0)
        return 0;
    *join_errno = r == (ssize_t)sizeof e ? e : EIO;
    waitpid(pid, NULL, 0); /* it exits right after writing */
    return -1;
}

/* fork + exec; the child only makes async-signal-safe calls. Returns the pid and a pidfd.
 * With o->cg, the child joins those cgroups before exec; if it cannot, it never execs and
 * spawn fails (a VM outside its limits is worse than no VM). */
static pid_t spawn(char *const argv[], const struct spawn_opts *o, int *pidfd, sp_err_t *err)
{
    int out = open(o->out_path != NULL ? o->out_path : "/dev/null",
                   O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644);
    int in = o->stdin_fd >= 0 ? o->stdin_fd : open("/dev/null", O_RDONLY | O_CLOEXEC);
    int st[2] = {-1, -1};
    bool join = o->cg != NULL && o->cg->n > 0;
    if (out < 0 || in < 0 || (join && pipe2(st, O_CLOEXEC) < 0)) {
        int e = errno;
        if (out >= 0)
            close(out);
        if (in >= 0 && in != o->stdin_fd)
            close(in);
        sp_err_set(err, SP_ERUNTIME, "cannot open child stdio");
        sp_log(SP_LOG_ERROR, "qemu", "child stdio path=%s err=%s",
               o->out_path ? o->out_path : "/dev/null", strerror(e));
        return -1;
    }
    pid_t pid = fork();
    if (pid == 0) {
        if (o->new_session)
            setsid();
        if (join && sp_cgroup_join(o->cg) < 0) {
            int je = errno;
            if (write(st[1], &je, sizeof je) < 0) {
                /* the parent then sees a VM that exited at once: the boot fails anyway */
            }
            _exit(125);
        }
        struct sigaction sa = {.sa_handler = SIG_DFL};
        sigemptyset(&sa.sa_mask);
        for (int s = 1; s < NSIG; s++)
            sigaction(s, &sa, NULL); /* fails harmlessly for SIGKILL/SIGSTOP/RT gaps */
        sigset_t none;
        sigemptyset(&none);
        sigprocmask(SIG_SETMASK, &none, NULL);
        if (dup2(in, 0) < 0 || dup2(out, 1) < 0 || dup2(out, 2) < 0)
            _exit(126);
        close_range(3, ~0u, 0);
        execvp(argv[0], argv);
        _exit(127);
    }
    int e = errno;
    close(out);
    if (in != o->stdin_fd)
        close(in);
    if (join)
        close(st[1]);
    if (pid < 0) {
        if (join)
            close(st[0]);
        sp_log(SP_LOG_ERROR, "qemu", "fork failed err=%s", strerror(e));
        sp_err_set(err, SP_ERUNTIME, "cannot start process");
        return -1;
    }
    int je = 0;
    if (join && await_join(st[0], pid, &je) < 0) {
        sp_log(SP_LOG_ERROR, "qemu", "vm cannot join its cgroup, not started sandbox=%s err=%s",
               o->sandbox != NULL ? o->sandbox : "-", strerror(je));
        sp_err_set(err, SP_ERUNTIME, "cannot place the VM in its resource-limit cgroup");
        return -1;
    }
    *pidfd = pidfd_open_(pid);
    if (*pidfd < 0) {
        e = errno;
        kill(pid, SIGKILL);
        waitpid(pid, NULL, 0); /* just killed: returns at once */
        sp_log(SP_LOG_ERROR, "qemu", "pidfd_open failed err=%s", strerror(e));
        sp_err_set(err, SP_ERUNTIME, "cannot watch process");
        return -1;
    }
    fcntl(*pidfd, F_SETFD, FD_CLOEXEC);
    return pid;
}

static void child_free(struct child *c)
{
    if (c == NULL)
        return;
    sp_watch_destroy(c->w);
    sp_timer_stop(&c->timer);
    if (c->pidfd >= 0)
        close(c->pidfd);
    free(c);
}

static void on_child_exit(sp_watch_t *w, int events, void *arg)
{
    struct child *c = arg;
    int st = 0;
    pid_t r;
    do
        r = waitpid(c->pid, &st, WNOHANG);
    while (r < 0 && errno == EINTR);
    if (r == 0)
        return; /* spurious */
    if (r < 0)
        st = -1;
    sp_watch_destroy(c->w);
    c->w = NULL;
    sp_timer_stop(&c->timer);
    c->cb(c, st, c->timed_out, c->arg); /* the callback frees c */
}

static void on_child_timeout(sp_timer_t *t, void *arg)
{
    struct child *c = arg;
    c->timed_out = true;
    kill(c->pid, SIGKILL);
}

static struct child *child_start(sp_qemu_t *d, char *const argv[], const struct spawn_opts *o,
                                 uint32_t timeout_ms, child_cb cb, void *arg, sp_err_t *err)
{
    struct child *c = calloc(1, sizeof(*c));
    if (c == NULL) {
        sp_err_set(err, SP_EINTERNAL, "out of memory");
        return NULL;
    }
    c->d = d;
    c->cb = cb;
    c->arg = arg;
    c->pidfd = -1;
    sp_timer_init(&c->timer, d->base.loop, on_child_timeout, c);
    c->pid = spawn(argv, o, &c->pidfd, err);
    if (c->pid < 0) {
        free(c);
        return NULL;
    }
    c->w = sp_watch_create(d->base.loop, c->pidfd, on_child_exit, c);
    if (c->w == NULL) {
        kill(c->pid, SIGKILL);
        waitpid(c->pid, NULL, 0);
        child_free(c);
        sp_err_set(err, SP_EINTERNAL, "cannot watch process");
        return NULL;
    }
    sp_watch_set(c->w, SP_IO_READ);
    if (timeout_ms > 0)
        sp_timer_start(&c->timer, timeout_ms);
    return c;
}

/* ---------- cgroups ---------- */

/* Makes the VM's cgroups (core/runtime/cgroup.h) with limits from its size; fills *join with the
 * cgroup.procs fds its QEMU joins before exec. false (no limits) when the host has no usable
 * layout or this VM's group cannot be made: the VM then boots without limits, logged. */
static bool cg_create(struct vm *vm, sp_cgroup_join_t *join)
{
    sp_qemu_t *d = vm->d;
    vm->cg = false;
    join->n = 0;
    if (sp_cgroup_kind(d->cg) == SP_CGROUP_NONE)
        return false; /* said once, when the driver was created */
    sp_cgroup_limits_t lim;
    sp_cgroup_limits(vm->cpu_count, vm->memory_mb,
                     d->accel == 1 ? SP_QEMU_OVERHEAD_KVM_MB : SP_QEMU_OVERHEAD_TCG_MB, &lim);
    char why[512];
    if (sp_cgroup_vm_create(d->cg, vm->id, &lim, join, why, sizeof why) < 0) {
        sp_log(SP_LOG_WARN, "qemu", "vm runs without cgroup limits sandbox=%s reason=\"%s\"",
               vm->id, why);
        return false;
    }
    sp_log(SP_LOG_DEBUG, "qemu", "vm cgroup sandbox=%s cpu_quota_us=%llu mem_bytes=%llu pids=%u",
           vm->id, (unsigned long long)lim.cpu_quota_us, (unsigned long long)lim.mem_bytes,
           lim.pids_max);
    vm->cg = true;
    return true;
}

/* Kills anything left in the VM's cgroups and removes them. Nothing to do without any. */
static void cg_remove(sp_qemu_t *d, const char *id)
{
    if (sp_cgroup_vm_remove(d->cg, id) < 0)
        sp_log(SP_LOG_WARN, "qemu", "cannot remove cgroup sandbox=%s err=%s", id, strerror(errno));
}

/* ---------- VM table ---------- */

static struct vm *vm_find(sp_qemu_t *d, const char *id)
{
    for (struct vm *v = d->vms; v != NULL; v = v->next)
        if (!v->pooled && strcmp(v->id, id) == 0)
            return v;
    return NULL;
}

static void vm_unlink(struct vm *vm)
{
    struct vm **pp = &vm->d->vms;
    while (*pp != NULL && *pp != vm)
        pp = &(*pp)->next;
    if (*pp == vm)
        *pp = vm->next;
}

static void on_qmp_timer(sp_timer_t *t, void *arg);
static void on_boot_timeout(sp_timer_t *t, void *arg);
static void on_kill_timer(sp_timer_t *t, void *arg);
static void on_snap_timer(sp_timer_t *t, void *arg);

static struct vm *vm_new(sp_qemu_t *d, const char *id)
{
    struct vm *vm = calloc(1, sizeof(*vm));
    if (vm == NULL)
        return NULL;
    vm->d = d;
    sfmt(vm->id, sizeof vm->id, "%s", id);
    sfmt(vm->dir, sizeof vm->dir, "%s/%s", d->vms_dir, id);
    vm->pidfd = -1;
    sp_timer_init(&vm->qmp_timer, d->base.loop, on_qmp_timer, vm);
    sp_timer_init(&vm->boot_timer, d->base.loop, on_boot_timeout, vm);
    sp_timer_init(&vm->kill_timer, d->base.loop, on_kill_timer, vm);
    sp_timer_init(&vm->snap_timer, d->base.loop, on_snap_timer, vm);
    vm->snap_fd = -1;
    vm->next = d->vms;
    d->vms = vm;
    return vm;
}

/* Drops every connection and watcher of the VM (not the process). */
static void vm_disconnect(struct vm *vm)
{
    sp_timer_stop(&vm->qmp_timer);
    sp_timer_stop(&vm->boot_timer);
    sp_timer_stop(&vm->kill_timer);
    sp_timer_stop(&vm->snap_timer);
    if (vm->ident != NULL) {
        sp_agentstream_t *s = vm->ident;
        vm->ident = NULL;
        sp_agentstream_reset(s);
    }
    if (vm->settle != NULL) {
        sp_agentstream_t *s = vm->settle;
        vm->settle = NULL;
        sp_agentstream_reset(s);
    }
    sp_exec_cancel(vm->warm); /* before the agent goes: no callback may reach a freed vm */
    vm->warm = NULL;
    if (vm->agent != NULL) {
        sp_agentconn_t *a = vm->agent;
        vm->agent = NULL; /* on_agent_state ignores calls made while it is destroyed */
        sp_agentconn_destroy(a);
    }
    sp_qmp_destroy(vm->qmp);
    vm->qmp = NULL;
    sp_watch_destroy(vm->pw);
    vm->pw = NULL;
}

static void vm_free(struct vm *vm)
{
    vm_disconnect(vm);
    if (vm->img != NULL) { /* driver going away mid-boot: let qemu-img finish on its own */
        child_free(vm->img);
        vm->img = NULL;
    }
    if (vm->sync != NULL) {
        child_free(vm->sync);
        vm->sync = NULL;
    }
    if (vm->pidfd >= 0)
        close(vm->pidfd);
    if (vm->snap_fd >= 0)
        close(vm->snap_fd);
    sumjob_abandon(vm->sum);
    vm->sum = NULL;
    sumjob_abandon(vm->delta);
    vm->delta = NULL;
    struct waiter *lists[3] = {vm->boot_w, vm->destroy_w, vm->snap_w};
    for (int i = 0; i < 3; i++) {
        while (lists[i] != NULL) {
            struct waiter *n = lists[i]->next;
            free(lists[i]);
            lists[i] = n;
        }
    }
    free(vm->tp);
    free(vm->hostname);
    free(vm->env_json);
    free(vm->clone_src);
    free(vm);
}

/* The pid in the VM dir's qemu.pid if that process is alive and is QEMU running this VM
 * (its command line names the VM directory), else 0. */
static pid_t live_qemu_pid(const char *dir)
{
    char p[PATH_MAX + 16], buf[64];
    sfmt(p, sizeof p, "%s/qemu.pid", dir);
    if (read_small(p, buf, sizeof buf) <= 0)
        return 0;
    long pid = strtol(buf, NULL, 10);
    if (pid <= 1 || pid > INT_MAX)
        return 0;
    sfmt(p, sizeof p, "/proc/%ld/stat", pid);
    char st[512];
    if (read_small(p, st, sizeof st) <= 0)
        return 0;
    char *rp = strrchr(st, ')');
    if (rp == NULL || rp[1] != ' ' || rp[2] == 'Z' || rp[2] == 'X')
        return 0; /* a zombie is dead for our purposes */
    sfmt(p, sizeof p, "/proc/%ld/cmdline", pid);
    int fd = open(p, O_RDONLY | O_CLOEXEC);
    if (fd < 0)
        return 0;
    size_t cap = 64 * 1024;
    char *cmd = malloc(cap + 1);
    ssize_t n = cmd != NULL ? read(fd, cmd, cap) : -1;
    close(fd);
    bool ours = false;
    if (n > 0) {
        for (ssize_t i = 0; i < n; i++)
            if (cmd[i] == '\0')
                cmd[i] = ' ';
        cmd[n] = '\0';
        char needle[PATH_MAX + 8];
        sfmt(needle, sizeof needle, "%s/", dir);
        ours = strstr(cmd, needle) != NULL;
        if (!ours) {
            /* a spare clone taken by this sandbox: its command line names the spare's dir,
             * which pool_take recorded before moving it here */
            char org[PATH_MAX], op[PATH_MAX + 16];
            sfmt(op, sizeof op, "%s/pool.origin", dir);
            ssize_t k = read_small(op, org, sizeof org);
            if (k > 0 && org[0] == '/') {
                sfmt(needle, sizeof needle, "%s/", org);
                ours = strstr(cmd, needle) != NULL;
            }
        }
    }
    free(cmd);
    return ours ? (pid_t)pid : 0;
}

/* live_qemu_pid() for a VM dir, except that a QEMU an earlier driver left before its boot or
 * restore finished (<vm>/booting is written before QEMU starts and removed once the agent has
 * taken IDENTITY) is killed and 0 returned: its state is unknown (maybe still waiting for its
 * device state, maybe paused, surely without its identity). A committed snapshot then makes
 * the sandbox SUSPENDED again, anything else ABSENT: the controller boots or wakes it again.
 * Blocks up to a second for the process to die. */
static pid_t live_vm_pid(sp_qemu_t *d, const char *id, const char *vdir)
{
    pid_t pid = live_qemu_pid(vdir);
    char p[PATH_MAX + 16];
    sfmt(p, sizeof p, "%s/booting", vdir);
    if (pid <= 0 || !file_exists(p) || vm_find(d, id) != NULL)
        return pid;
    sp_log(SP_LOG_WARN, "qemu", "killing a vm left mid-boot by an earlier driver sandbox=%s pid=%d",
           id, (int)pid);
    int pfd = pidfd_open_(pid);
    kill(-pid, SIGKILL);
    kill(pid, SIGKILL);
    if (pfd >= 0) {
        struct pollfd pf = {.fd = pfd, .events = POLLIN};
        poll(&pf, 1, 1000);
        close(pfd);
    }
    cg_remove(d, id);
    static const char *const names[] = {"qmp.sock", "agent.sock", "qemu.pid", "paused", "booting"};
    for (size_t i = 0; i < sizeof names / sizeof names[0]; i++) {
        sfmt(p, sizeof p, "%s/%s", vdir, names[i]);
        unlink(p);
    }
    return 0;
}

/* A committed snapshot in the VM dir: snap_commit() renames snapshot/manifest.json into
 * place as its very last step, and boot_done() removes it after a restore. */
static bool snapshot_committed(const char *dir)
{
    char p[PATH_MAX + 32];
    sfmt(p, sizeof p, "%s/snapshot/manifest.json", dir);
    return file_exists(p);
}

static const char *const sum_label[SUM_N] = {"RAM", "device state", "disk"};

/* A size the manifest records for a part: -1 when it records none (version 1 has no disk). */
static long long man_size(json_t *man, const char *key)
{
    json_t *v = json_object_get(man, key);
    return json_is_integer(v) && json_integer_value(v) >= 0 ? (long long)json_integer_value(v) : -1;
}

/* What a wake checks before it starts QEMU, all cheap: the corrupt marker, every part's
 * size against the manifest (and the RAM file's against memory_mb: QEMU would silently make
 * a fresh, empty one), and the device state's checksum when it is small (a 60 KB file: well
 * under a millisecond; a clone's first snapshot streams its RAM into it and is verified with
 * the big parts, restore_verify). -1 with a client-safe reason; the snapshot is left as it is. */
static int snap_check(const char *dir, json_t *man, int memory_mb, bool stream, sp_err_t *err)
{
    char p[PATH_MAX + 32], buf[64];
    struct stat st;
    sfmt(p, sizeof p, "%s/snapshot/corrupt", dir);
    if (read_small(p, buf, sizeof buf) >= 0) {
        buf[strcspn(buf, "\n")] = '\0';
        return sp_err_set(err, SP_ERUNTIME,
                          "cannot wake: the snapshot failed its checksum check earlier (%s); it "
                          "is kept",
                          buf[0] != '\0' ? buf : "?");
    }
    const char *algo = json_string_value(json_object_get(man, "checksum"));
    if (algo != NULL && strcmp(algo, SP_QEMU_SUM_ALGO) != 0)
        return sp_err_set(err, SP_ERUNTIME, "cannot wake: unknown snapshot checksum %.32s", algo);
    static const char *const files[SUM_N] = {"mem.ram", "snapshot/devstate", "disk.qcow2"};
    static const char *const sizes[SUM_N] = {"ram_bytes", "devstate_bytes", "disk_bytes"};
    for (int i = 0; i < SUM_N; i++) {
        if (i == SUM_RAM && stream)
            continue;
        sfmt(p, sizeof p, "%s/%s", dir, files[i]);
        if (stat(p, &st) < 0)
            return sp_err_set(err, SP_ERUNTIME, "cannot wake: the snapshot's %s is missing",
                              sum_label[i]);
        long long want = man_size(man, sizes[i]);
        if (i == SUM_RAM && (uint64_t)st.st_size != (uint64_t)memory_mb << 20)
            want = (long long)memory_mb << 20;
        if (want >= 0 && (long long)st.st_size != want)
            return sp_err_set(err, SP_ERUNTIME,
                              "cannot wake: the snapshot's %s has %lld bytes, it should have "
                              "%lld; the snapshot is kept",
                              sum_label[i], (long long)st.st_size, want);
    }
    const char *dsum = json_string_value(json_object_get(man, "devstate_checksum"));
    sfmt(p, sizeof p, "%s/snapshot/devstate", dir);
    if (dsum != NULL && stat(p, &st) == 0 && (uint64_t)st.st_size <= SP_QEMU_SUM_INLINE_MAX) {
        char got[65];
        uint64_t n;
        if (sum_file(p, &n, got) < 0)
            return sp_err_set(err, SP_ERUNTIME, "cannot wake: cannot read the snapshot: %s",
                              strerror(errno));
        if (strcmp(got, dsum) != 0)
            return sp_err_set(err, SP_ERUNTIME,
                              "cannot wake: the snapshot's device state does not match its "
                              "checksum; the snapshot is kept");
    }
    return 0;
}

/* Bytes a committed snapshot holds on disk (RAM file allocation + device state), or 0. */
static uint64_t snapshot_bytes(const char *dir)
{
    if (!snapshot_committed(dir))
        return 0;
    char p[PATH_MAX + 32];
    struct stat st;
    uint64_t n = 0;
    sfmt(p, sizeof p, "%s/mem.ram", dir);
    if (stat(p, &st) == 0)
        n += (uint64_t)st.st_blocks * 512u;
    sfmt(p, sizeof p, "%s/snapshot/devstate", dir);
    if (stat(p, &st) == 0)
        n += (uint64_t)st.st_size;
    return n;
}

/* Removes the per-boot files of a VM dir; keeps the logs for debugging. */
/* A taken spare's QEMU is gone: the link its old directory name left (pool_take) and the
 * record of that name go too. */
static void pool_origin_remove(const struct vm *vm)
{
    char op[PATH_MAX + 16], org[PATH_MAX];
    vm_path(vm, "pool.origin", op, sizeof op);
    if (read_small(op, org, sizeof org) <= 0)
        return;
    struct stat st;
    const char *base = strrchr(org, '/');
    if (base != NULL && strncmp(base + 1, ".pool-", 6) == 0 && lstat(org, &st) == 0 &&
        S_ISLNK(st.st_mode))
        unlink(org);
    unlink(op);
}

static void remove_runtime_files(const struct vm *vm)
{
    static const char *const names[] = {"disk.qcow2", "qmp.sock", "agent.sock", "qemu.pid",
                                        "paused",     "vm.json",  "mem.ram",    "booting"};
    char p[PATH_MAX + 16];
    for (size_t i = 0; i < sizeof names / sizeof names[0]; i++) {
        vm_path(vm, names[i], p, sizeof p);
        unlink(p);
    }
}

/* ---------- process exit, stopping ---------- */

static void on_vm_exit(sp_watch_t *w, int events, void *arg)
{
    struct vm *vm = arg;
    {
        /* Reap it if it is our child (started by this process, maybe by an earlier driver
         * object); for a QEMU inherited from a previous spaced this is ECHILD. */
        int st;
        pid_t r = waitpid(vm->pid, &st, WNOHANG);
        if (r == 0)
            return;
        if (r > 0 && vm->ph != PH_STOPPING)
            sp_log(SP_LOG_INFO, "qemu", "qemu exited sandbox=%s status=%d signal=%d", vm->id,
                   WIFEXITED(st) ? WEXITSTATUS(st) : -1, WIFSIGNALED(st) ? WTERMSIG(st) : 0);
    }
    vm->exited = true;
    sp_watch_destroy(vm->pw);
    vm->pw = NULL;
    if (vm->ph == PH_STOPPING) {
        vm_finish(vm);
        return;
    }
    if (vm->ph == PH_SUSPENDING && vm->snap_step == SN_QUIT) {
        suspend_finish(vm);
        return;
    }
    char tail[1024];
    console_tail(vm, tail, sizeof tail);
    if (vm->ph < PH_UP) {
        sp_log(SP_LOG_WARN, "qemu", "guest did not come up: qemu exited sandbox=%s console=%s",
               vm->id, tail);
        vm->boot_failed = true;
        sp_err_set(&vm->boot_err, SP_ERUNTIME, "guest did not come up: the VM exited during boot");
    } else {
        sp_log(SP_LOG_WARN, "qemu", "vm exited unexpectedly sandbox=%s console=%s", vm->id, tail);
    }
    vm->keep_logs = true;
    vm->ph = PH_STOPPING;
    vm_finish(vm);
}

static void on_kill_timer(sp_timer_t *t, void *arg)
{
    struct vm *vm = arg;
    if (vm->exited || vm->pid <= 0)
        return;
    sp_log(SP_LOG_INFO, "qemu", "killing qemu sandbox=%s pid=%d", vm->id, (int)vm->pid);
    kill(-vm->pid, SIGKILL);
    kill(vm->pid, SIGKILL);
    sp_timer_start(&vm->kill_timer, SP_QEMU_QUIT_GRACE_MS); /* keep at it until the pidfd fires */
}

static void on_quit_reply(void *arg, json_t *ret, const sp_err_t *err)
{
    /* Nothing: the pidfd tells us when QEMU is gone; the kill timer backs it up. */
}

/* Starts tearing the VM down. graceful: QMP quit first. vm_finish runs once it is dead. */
static void vm_stop(struct vm *vm, bool graceful)
{
    if (vm->ph == PH_STOPPING)
        return;
    vm->ph = PH_STOPPING;
    sp_timer_stop(&vm->boot_timer);
    sp_timer_stop(&vm->qmp_timer);
    if (vm->ident != NULL) {
        sp_agentstream_t *s = vm->ident;
        vm->ident = NULL;
        sp_agentstream_reset(s);
    }
    sp_exec_cancel(vm->warm);
    vm->warm = NULL;
    if (vm->agent != NULL) {
        sp_agentconn_t *a = vm->agent;
        vm->agent = NULL;
        sp_agentconn_destroy(a);
    }
    if (vm->img != NULL) {
        kill(vm->img->pid, SIGKILL); /* on_img_exit sees PH_STOPPING and finishes */
        return;
    }
    if (vm->pid <= 0 || vm->exited || vm->pw == NULL) {
        vm_finish(vm);
        return;
    }
    sp_err_t e;
    if (graceful && vm->qmp != NULL && !sp_qmp_closed(vm->qmp) && /* queued if not negotiated */
        sp_qmp_command(vm->qmp, "quit", NULL, -1, on_quit_reply, vm, &e) == 0) {
        sp_timer_start(&vm->kill_timer, SP_QEMU_QUIT_GRACE_MS);
    } else {
        on_kill_timer(&vm->kill_timer, vm);
    }
}

/* The VM's process is gone (or never started): remove what it had and answer waiters.
 * Always runs from a loop callback, never inside a driver call. */
static void vm_finish(struct vm *vm)
{
    sp_qemu_t *d = vm->d;
    vm_disconnect(vm);
    if (vm->pid > 0 && !vm->exited && kill(vm->pid, 0) == 0) {
        kill(-vm->pid, SIGKILL); /* lost its pidfd watch somehow: make sure */
        kill(vm->pid, SIGKILL);
    }
    cg_remove(d, vm->id);
    if (!vm->pooled)
        pool_origin_remove(vm);
    if (vm->tsnap_build != NULL) {
        tsnap_failed(vm, vm->boot_failed ? vm->boot_err.msg : "the builder VM went away");
    } else if (vm->clone_boot && vm->destroy_w == NULL && vm->boot_w != NULL && vm->tp != NULL) {
        /* A clone that did not come up: cold-boot the same sandbox instead; later boots
         * keep cloning (a snapshot that QEMU refuses fails every clone the same way, and
         * each of them then falls back here). */
        sp_log(SP_LOG_WARN, "qemu",
               "clone did not come up, falling back to a cold boot sandbox=%s err=%s", vm->id,
               vm->boot_failed ? vm->boot_err.msg : "qemu exited");
        if (vm->pidfd >= 0)
            close(vm->pidfd);
        vm->pidfd = -1;
        vm->pid = 0;
        vm->exited = false;
        vm->boot_failed = false;
        vm->keep_logs = false;
        vm->restoring = false;
        vm->clone_boot = false;
        free(vm->clone_src);
        vm->clone_src = NULL;
        vm->tsnap_wait = NULL;
        vm->cold = true;
        vm->snap_step = SN_NONE;
        vm->paused = false;
        vm->ph = PH_WAIT_ACCEL;
        sp_timer_start(&vm->boot_timer, d->boot_timeout_ms);
        kick(d);
        return;
    }
    if (vm->pooled) {
        if (vm->boot_failed)
            pool_failed(d, vm->pool_key);
        rm_rf(vm->dir); /* a spare's logs were logged (console tail) when it failed */
    } else if (vm->restoring && vm->destroy_w == NULL) {
        /* a failed restore keeps the snapshot (disk, RAM file, device state) to retry */
        static const char *const names[] = {"qmp.sock", "agent.sock", "qemu.pid", "paused",
                                            "booting"};
        char p[PATH_MAX + 16];
        for (size_t i = 0; i < sizeof names / sizeof names[0]; i++) {
            vm_path(vm, names[i], p, sizeof p);
            unlink(p);
        }
    } else if (vm->keep_logs && vm->destroy_w == NULL) {
        remove_runtime_files(vm);
    } else {
        rm_rf(vm->dir);
    }
    vm_unlink(vm);
    sp_err_t cancel;
    sp_err_set(&cancel, SP_ERUNTIME, "boot cancelled: the sandbox was deleted");
    complete_all(d, &vm->boot_w, vm->boot_failed ? &vm->boot_err : &cancel);
    sp_err_set(&cancel, SP_ERUNTIME, "suspend failed: the VM went away");
    complete_all(d, &vm->snap_w, &cancel);
    complete_all(d, &vm->destroy_w, NULL);
    vm_free(vm);
}

/* ---------- QMP ---------- */

static void boot_fail(struct vm *vm, const char *fmt, const char *detail)
{
    vm->boot_failed = true;
    sp_err_set(&vm->boot_err, SP_ERUNTIME, fmt, detail);
    vm->keep_logs = true;
    vm_stop(vm, false);
}

static void agent_start(struct vm *vm);

static void on_status(void *arg, json_t *ret, const sp_err_t *err)
{
    struct vm *vm = arg;
    if (err != NULL) {
        sp_log(SP_LOG_WARN, "qemu", "query-status failed sandbox=%s err=%s", vm->id, err->msg);
        return;
    }
    const char *st = json_string_value(json_object_get(ret, "status"));
    vm->paused = st != NULL && strcmp(st, "running") != 0;
    char p[PATH_MAX + 16];
    vm_path(vm, "paused", p, sizeof p);
    if (vm->adopted && vm->ph == PH_UP && vm->qmp != NULL && st != NULL && !file_exists(p) &&
        (strcmp(st, "postmigrate") == 0 || strcmp(st, "paused") == 0)) {
        /* Stopped, but not by pause() (which leaves the marker): a suspend that an earlier
         * driver never committed. Give it back running, as probe() reported it. */
        sp_err_t e;
        sp_log(SP_LOG_INFO, "qemu",
               "resuming a vm stopped by an unfinished suspend sandbox=%s "
               "status=%s",
               vm->id, st);
        if (sp_qmp_command(vm->qmp, "cont", NULL, -1, NULL, NULL, &e) == 0)
            vm->paused = false;
    }
    if (vm->ph == PH_UP) {
        if (vm->paused)
            write_atomic(p, "", 0);
        else
            unlink(p);
    }
    if (vm->adopted)
        sp_log(SP_LOG_INFO, "qemu", "re-adopted vm sandbox=%s pid=%d status=%s", vm->id,
               (int)vm->pid, st ? st : "?");
}

static void on_qmp_ready(sp_qmp_t *q, void *arg)
{
    struct vm *vm = arg;
    sp_err_t e;
    sp_log(SP_LOG_DEBUG, "qemu", "qmp ready sandbox=%s ms=%llu", vm->id,
           (unsigned long long)(mono_ms() - vm->boot_start_ms));
    if (vm->ph == PH_START && vm->restoring) {
        restore_begin(vm);
        return;
    }
    /* An earlier driver may have died mid-suspend: its migration would stop the VM when it
     * completes and nobody would commit the snapshot. No-op when none is in flight. */
    if (vm->adopted)
        sp_qmp_command(q, "migrate_cancel", NULL, -1, NULL, NULL, &e);
    sp_qmp_command(q, "query-status", NULL, -1, on_status, vm, &e);
    if (vm->ph == PH_START) {
        vm->ph = PH_AGENT;
        agent_start(vm);
    }
}

static void on_qmp_event(sp_qmp_t *q, const char *ev, json_t *data, void *arg)
{
    struct vm *vm = arg;
    if (strcmp(ev, "STOP") == 0)
        vm->paused = true;
    else if (strcmp(ev, "RESUME") == 0)
        vm->paused = false;
    else if (strcmp(ev, "SHUTDOWN") == 0)
        sp_log(SP_LOG_DEBUG, "qemu", "qemu shutting down sandbox=%s", vm->id);
}

static void on_qmp_closed(sp_qmp_t *q, const sp_err_t *err, void *arg)
{
    struct vm *vm = arg;
    sp_qmp_destroy(vm->qmp);
    vm->qmp = NULL;
    if (vm->ph == PH_STOPPING || vm->exited)
        return;
    /* QEMU alive but QMP gone (it allows one client): try again shortly. */
    vm->qmp_tries = 0;
    sp_timer_start(&vm->qmp_timer, 200);
}

static const sp_qmp_cbs_t qmp_cbs = {on_qmp_ready, on_qmp_event, on_qmp_closed};

static void qmp_try_connect(struct vm *vm)
{
    char p[PATH_MAX + 16];
    vm_path(vm, "qmp.sock", p, sizeof p);
    sp_err_t e;
    vm->qmp = sp_qmp_connect(vm->d->base.loop, p, &qmp_cbs, vm, &e);
    if (vm->qmp != NULL)
        return;
    vm->qmp_tries++;
    /* Booting: QEMU creates the socket soon after exec; the boot timer bounds us.
     * Adopted: back off to 1 s and give up after a minute (the VM stays usable via its agent). */
    if (vm->ph == PH_START) {
        sp_timer_start(&vm->qmp_timer, 1); /* QEMU listens shortly after exec; a failed
                                            * connect costs microseconds */
    } else if (vm->qmp_tries < 120) {
        sp_timer_start(&vm->qmp_timer, vm->qmp_tries < 10 ? 100 : 1000);
    } else {
        sp_log(SP_LOG_WARN, "qemu", "qmp unreachable sandbox=%s err=%s", vm->id, e.msg);
    }
}

static void on_qmp_timer(sp_timer_t *t, void *arg)
{
    struct vm *vm = arg;
    if (vm->qmp == NULL && vm->ph != PH_STOPPING && !vm->exited)
        qmp_try_connect(vm);
}

/* ---------- agent, identity ---------- */

/* vm.json without "ram_src": the VM has its own RAM file now. */
static void vm_json_own_ram(struct vm *vm)
{
    char p[PATH_MAX + 16];
    vm_path(vm, "vm.json", p, sizeof p);
    json_t *o = json_load_file(p, 0, NULL);
    if (o == NULL)
        return;
    json_object_del(o, "ram_src");
    char *js = json_dumps(o, JSON_COMPACT);
    json_decref(o);
    if (js == NULL || write_atomic(p, js, strlen(js)) < 0)
        sp_log(SP_LOG_WARN, "qemu", "cannot update vm.json sandbox=%s", vm->id);
    free(js);
}

static void boot_done(struct vm *vm)
{
    vm->ph = PH_UP;
    sp_timer_stop(&vm->boot_timer);
    {
        char p[PATH_MAX + 16];
        vm_path(vm, "booting", p, sizeof p);
        unlink(p); /* a later driver adopts this VM as it is (live_vm_pid) */
    }
    sp_log(SP_LOG_INFO, "qemu", "vm up sandbox=%s pid=%d accel=%s how=%s boot_ms=%llu", vm->id,
           (int)vm->pid, vm->d->accel == 1 ? "kvm" : "tcg",
           vm->clone_boot  ? "clone"
           : vm->restoring ? "restore"
                           : "cold",
           (unsigned long long)(mono_ms() - vm->boot_start_ms));
    if (!vm->pooled && vm->tsnap_build == NULL)
        vm->d->pool_quiet_until = mono_ms() + SP_QEMU_POOL_SETTLE_MS;
    if (vm->tsnap_build != NULL) {
        tsnap_warmup(vm); /* keeps tp: nothing waits on a builder's boot */
        return;
    }
    if (vm->clone_boot) {
        vm->clone_boot = false;
        vm->restoring = false;
        vm->snap_step = SN_NONE;
    }
    if (vm->pooled) {
        pool_warm(vm); /* keeps tp: a sandbox that takes it may still fall back to a boot */
        return;
    }
    free(vm->tp);
    vm->tp = NULL;
    pool_kick(vm->d); /* spares wait for boots in flight: maybe this was the last one */
    if (vm->restore_stream) {
        vm_json_own_ram(vm);
        vm->restore_stream = false;
    }
    vm->restore_delta = false; /* still a clone of the template's RAM: ram_src stays */
    if (vm->restoring) {
        /* From here on the disk moves on: the snapshot must never be restored again. */
        char p[PATH_MAX + 32];
        vm_path(vm, "snapshot/manifest.json", p, sizeof p);
        unlink(p);
        vm_path(vm, "snapshot", p, sizeof p);
        rm_rf(p);
        vm->restoring = false;
        vm->snap_step = SN_NONE;
    }
    complete_all(vm->d, &vm->boot_w, NULL);
}

static void on_ident_frame(sp_agentstream_t *s, uint16_t type, uint16_t flags,
                           const uint8_t *payload, size_t len, void *arg)
{
    struct vm *vm = arg;
    if (!(flags & SP_AP_F_END))
        return;
    vm->ident = NULL; /* freed by agentconn after this returns */
    if (vm->ph != PH_IDENTITY)
        return;
    if (type == SP_AP_T_OK) {
        boot_done(vm);
    } else {
        sp_log(SP_LOG_WARN, "qemu", "guest rejected identity sandbox=%s type=%u", vm->id,
               (unsigned)type);
        boot_fail(vm, "guest did not come up: %s", "the agent rejected its identity");
    }
}

static void on_ident_error(sp_agentstream_t *s, const sp_err_t *err, void *arg)
{
    struct vm *vm = arg;
    vm->ident = NULL;
    if (vm->ph == PH_IDENTITY)
        vm->ph = PH_AGENT; /* the channel dropped: send it again when it is back up */
}

static const sp_agentstream_cbs_t ident_cbs = {on_ident_frame, on_ident_error, NULL};

/* IDENTITY: hostname, sandbox id, default env, fresh RNG seed, wall clock. */
static void send_identity(struct vm *vm)
{
    size_t cap = 256 * 1024;
    uint8_t *buf = malloc(cap);
    if (buf == NULL) {
        boot_fail(vm, "%s", "out of memory");
        return;
    }
    sp_ap_writer_t w;
    sp_ap_writer_init(&w, buf, cap);
    sp_ap_put_str(&w, SP_AP_K_HOSTNAME, vm->hostname);
    sp_ap_put_str(&w, SP_AP_K_SANDBOX_ID, vm->id);
    if (vm->env_json != NULL) {
        json_t *env = json_loads(vm->env_json, 0, NULL);
        const char *k;
        json_t *v;
        json_object_foreach(env, k, v)
        {
            if (!json_is_string(v))
                continue;
            char *kv = NULL;
            if (asprintf(&kv, "%s=%s", k, json_string_value(v)) >= 0) {
                sp_ap_put_str(&w, SP_AP_K_ENV, kv);
                free(kv);
            }
        }
        json_decref(env);
    }
    uint8_t seed[32];
    if (getrandom(seed, sizeof seed, 0) == (ssize_t)sizeof seed)
        sp_ap_put_bytes(&w, SP_AP_K_SEED, seed, sizeof seed);
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    sp_ap_put_u64(&w, SP_AP_K_TIME_NS, (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec);
    if (w.overflow) {
        free(buf);
        boot_fail(vm, "%s", "sandbox environment is too large");
        return;
    }
    sp_err_t e;
    vm->ph = PH_IDENTITY;
    vm->ident = sp_agentconn_open(vm->agent, SP_AP_T_IDENTITY, buf, w.len, &ident_cbs, vm, &e);
    free(buf);
    if (vm->ident == NULL) {
        vm->ph = PH_AGENT; /* channel went down in between: retried on the next up */
        sp_log(SP_LOG_DEBUG, "qemu", "identity not sent sandbox=%s err=%s", vm->id, e.msg);
    }
}

static void on_agent_state(void *arg, bool up)
{
    struct vm *vm = arg;
    if (vm->agent == NULL)
        return; /* being destroyed */
    sp_log(SP_LOG_DEBUG, "qemu", "agent channel sandbox=%s up=%d ms=%llu", vm->id, (int)up,
           (unsigned long long)(mono_ms() - vm->boot_start_ms));
    if (up && vm->ph == PH_AGENT)
        send_identity(vm);
}

static void agent_start(struct vm *vm)
{
    if (vm->agent != NULL)
        return;
    char p[PATH_MAX + 16];
    vm_path(vm, "agent.sock", p, sizeof p);
    vm->agent = sp_agentconn_create(vm->d->base.loop, p, on_agent_state, vm);
    if (vm->agent == NULL && vm->ph < PH_UP)
        boot_fail(vm, "%s", "cannot create the agent channel");
    else if (vm->agent != NULL && vm->tsnap_build == NULL)
        sp_agentconn_set_sandbox(vm->agent, vm->id); /* the egress proxy attaches here (a
                                                      * spare: renamed by pool_take) */
}

static void on_boot_timeout(sp_timer_t *t, void *arg)
{
    struct vm *vm = arg;
    char tail[1024];
    console_tail(vm, tail, sizeof tail);
    sp_log(SP_LOG_WARN, "qemu",
           "guest did not come up sandbox=%s timeout_ms=%u phase=%d console=%s (console.log "
           "kept in the VM directory)",
           vm->id, vm->d->boot_timeout_ms, (int)vm->ph, tail);
    vm->boot_failed = true;
    sp_err_set(&vm->boot_err, SP_ERUNTIME, "guest did not come up within %u ms",
               vm->d->boot_timeout_ms);
    vm->keep_logs = true;
    vm_stop(vm, false);
}

/* ---------- starting QEMU ---------- */

static int write_vm_json(struct vm *vm)
{
    json_t *o =
        json_pack("{s:s, s:i, s:i, s:I, s:s, s:s, s:s, s:s}", "template", vm->template_name,
                  "cpu_count", vm->cpu_count, "memory_mb", vm->memory_mb, "disk_bytes",
                  (json_int_t)vm->disk_total, "accel", vm->d->accel == 1 ? "kvm" : "tcg", "base",
                  vm->tp->rootfs, "kernel", vm->tp->kernel, "initramfs", vm->tp->initramfs);
    if (o != NULL && vm->clone_src != NULL)
        json_object_set_new(o, "ram_src", json_string(vm->clone_src));
    char *s = o ? json_dumps(o, JSON_COMPACT) : NULL;
    json_decref(o);
    if (s == NULL)
        return -1;
    char p[PATH_MAX + 16];
    vm_path(vm, "vm.json", p, sizeof p);
    int rc = write_atomic(p, s, strlen(s));
    free(s);
    return rc;
}

static void read_vm_json(struct vm *vm)
{
    char p[PATH_MAX + 16];
    vm_path(vm, "vm.json", p, sizeof p);
    json_t *o = json_load_file(p, 0, NULL);
    vm->cpu_count = (int)json_integer_value(json_object_get(o, "cpu_count"));
    vm->memory_mb = (int)json_integer_value(json_object_get(o, "memory_mb"));
    vm->disk_total = (uint64_t)json_integer_value(json_object_get(o, "disk_bytes"));
    const char *src = json_string_value(json_object_get(o, "ram_src"));
    free(vm->clone_src);
    vm->clone_src = src != NULL ? strdup(src) : NULL;
    json_decref(o);
}

static void on_vm_started(struct vm *vm);

static void start_qemu(struct vm *vm)
{
    sp_qemu_t *d = vm->d;
    char disk[PATH_MAX + 16], agent[PATH_MAX + 16], qmp[PATH_MAX + 16], con[PATH_MAX + 16],
        log[PATH_MAX + 16], pidf[PATH_MAX + 16];
    vm_path(vm, "disk.qcow2", disk, sizeof disk);
    vm_path(vm, "agent.sock", agent, sizeof agent);
    vm_path(vm, "qmp.sock", qmp, sizeof qmp);
    vm_path(vm, "console.log", con, sizeof con);
    vm_path(vm, "qemu.log", log, sizeof log);
    vm_path(vm, "qemu.pid", pidf, sizeof pidf);
    unlink(agent);
    unlink(qmp);
    pool_origin_remove(vm); /* this QEMU names this directory */

    sp_bootargs_qemu_t q = {
        .qemu = d->qemu,
        .kernel = vm->tp->kernel,
        .initramfs = vm->tp->initramfs,
        .disk = disk,
        .agent_sock = agent,
        .qmp_sock = qmp,
        .console_log = con,
        .cpu_count = vm->cpu_count,
        .memory_mb = vm->memory_mb,
        .kvm = d->accel == 1,
    };
    char **base = sp_bootargs_qemu_argv(&q);
    if (base == NULL) {
        boot_fail(vm, "%s", "cannot build the QEMU command line");
        return;
    }
    /* Copy, with the serial console moved to an append-mode file chardev (so console.log
     * can be trimmed under QEMU) and the seccomp sandbox added where QEMU has it. */
    char conarg[PATH_MAX + 64];
    sfmt(conarg, sizeof conarg, "file,id=con0,path=%s,append=on", con);
    char *argv[96];
    int n = 0;
    for (int i = 0; base[i] != NULL && n < 88; i++) {
        if (strcmp(base[i], "-serial") == 0 && base[i + 1] != NULL) {
            argv[n++] = "-chardev";
            argv[n++] = conarg;
            argv[n++] = "-serial";
            argv[n++] = "chardev:con0";
            i++;
            continue;
        }
        argv[n++] = base[i];
    }
    if (vm->restore_delta && vm->clone_src == NULL) {
        free(base);
        boot_fail(vm, "restore failed: %s", "out of memory");
        return;
    }
    /* Guest RAM in a shared file: suspend then writes device state only (x-ignore-shared). */
    char memobj[PATH_MAX + 128];
    if (vm->clone_src != NULL) /* private copy-on-write map of the template's RAM */
        sfmt(memobj, sizeof memobj,
             "memory-backend-file,id=mem,size=%dM,mem-path=%s/mem.ram,share=off", vm->memory_mb,
             vm->clone_src);
    else
        sfmt(memobj, sizeof memobj,
             "memory-backend-file,id=mem,size=%dM,mem-path=%s/mem.ram,share=on", vm->memory_mb,
             vm->dir);
    if (vm->restore_stream) { /* the stream fills a fresh RAM file of our own */
        char ram[PATH_MAX + 16];
        vm_path(vm, "mem.ram", ram, sizeof ram);
        unlink(ram);
    }
    argv[n++] = "-object";
    argv[n++] = memobj;
    argv[n++] = "-machine";
    argv[n++] = "memory-backend=mem";
    if (vm->restoring) {
        argv[n++] = "-incoming";
        argv[n++] = "defer";
    }
    if (d->sandbox == 1) {
        argv[n++] = "-sandbox";
        argv[n++] = SP_QEMU_SANDBOX_ARG;
    }
    argv[n] = NULL;

    char cmd[8192];
    size_t off = 0;
    for (int i = 0; i < n && off < sizeof cmd - 1; i++)
        off += (size_t)sfmt(cmd + off, sizeof cmd - off, "%s%s", i ? " " : "", argv[i]);
    sp_log(SP_LOG_DEBUG, "qemu", "starting sandbox=%s argv=%s", vm->id, cmd);

    /* Until the agent has taken IDENTITY, a driver that finds this QEMU must not adopt it. */
    char booting[PATH_MAX + 16];
    vm_path(vm, "booting", booting, sizeof booting);
    if (write_atomic(booting, "", 0) < 0)
        sp_log(SP_LOG_WARN, "qemu", "cannot write the boot marker sandbox=%s err=%s", vm->id,
               strerror(errno));

    sp_cgroup_join_t join;
    bool cg = cg_create(vm, &join);
    struct spawn_opts so = {.out_path = log,
                            .stdin_fd = -1,
                            .cg = cg ? &join : NULL,
                            .sandbox = vm->id,
                            .new_session = true};
    sp_err_t e;
    vm->pid = spawn(argv, &so, &vm->pidfd, &e);
    free(base);
    sp_cgroup_join_close(&join);
    if (vm->pid < 0) {
        vm->pid = 0;
        boot_fail(vm, "%s", e.msg);
        return;
    }
    char pidbuf[32];
    int pl = sfmt(pidbuf, sizeof pidbuf, "%d\n", (int)vm->pid);
    if (write_atomic(pidf, pidbuf, (size_t)pl) < 0)
        sp_log(SP_LOG_WARN, "qemu", "cannot write pidfile sandbox=%s err=%s", vm->id,
               strerror(errno));
    on_vm_started(vm);
}

/* Common to a fresh start and re-adoption: watch the process. */
static void on_vm_started(struct vm *vm)
{
    vm->pw = sp_watch_create(vm->d->base.loop, vm->pidfd, on_vm_exit, vm);
    if (vm->pw == NULL) {
        boot_fail(vm, "%s", "cannot watch the VM process");
        return;
    }
    sp_watch_set(vm->pw, SP_IO_READ);
    if (vm->ph == PH_DISK) {
        vm->ph = PH_START;
        qmp_try_connect(vm);
    }
}

static void on_img_exit(struct child *c, int st, bool timed_out, void *arg)
{
    struct vm *vm = arg;
    child_free(c);
    vm->img = NULL;
    if (vm->ph == PH_STOPPING) {
        vm_finish(vm);
        return;
    }
    if (st == -1 || !WIFEXITED(st) || WEXITSTATUS(st) != 0) {
        sp_log(SP_LOG_ERROR, "qemu", "qemu-img create failed sandbox=%s status=%d (see qemu.log)",
               vm->id, st);
        boot_fail(vm, "%s", "cannot create the sandbox disk");
        return;
    }
    sp_log(SP_LOG_DEBUG, "qemu", "overlay made sandbox=%s ms=%llu", vm->id,
           (unsigned long long)(mono_ms() - vm->boot_start_ms));
    start_qemu(vm);
}

static void put_be32(uint8_t *p, uint32_t v)
{
    for (int i = 0; i < 4; i++)
        p[i] = (uint8_t)(v >> (24 - 8 * i));
}

static void put_be64(uint8_t *p, uint64_t v)
{
    put_be32(p, (uint32_t)(v >> 32));
    put_be32(p + 4, (uint32_t)v);
}

/* Writes an empty qcow2 v3 overlay of `backing` (a qcow2 file; its virtual size is read
 * from its header) the way qemu-img lays one out: header + backing name in cluster 0,
 * refcount table, one refcount block, L1 table; 64 KiB clusters, 16-bit refcounts. Saves
 * a qemu-img process on the clone path. 0 or -1 (errno set; the file may be left). */
static int write_overlay(const char *path, const char *backing)
{
    enum { CL = 65536 };
    int bfd = open(backing, O_RDONLY | O_CLOEXEC);
    if (bfd < 0)
        return -1;
    uint8_t bh[32];
    ssize_t r = pread(bfd, bh, sizeof bh, 0);
    close(bfd);
    if (r != (ssize_t)sizeof bh || memcmp(bh, "QFI\xfb", 4) != 0) {
        errno = EINVAL;
        return -1;
    }
    uint64_t size = 0;
    for (int i = 0; i < 8; i++)
        size = size << 8 | bh[24 + i];
    uint64_t per_l1 = (uint64_t)CL * (CL / 8); /* bytes one L2 table maps */
    uint64_t l1 = (size + per_l1 - 1) / per_l1;
    size_t blen = strlen(backing);
    if (l1 * 8 > CL || blen > 1023) { /* > 4 TiB, or a name past cluster 0's room */
        errno = EINVAL;
        return -1;
    }
    uint8_t h[2048];
    memset(h, 0, sizeof h);
    put_be32(h, 0x514649fbu); /* "QFI\xfb" */
    put_be32(h + 4, 3);
    size_t ext = 104;               /* header_length */
    put_be32(h + ext, 0xe2792acau); /* backing file format name */
    put_be32(h + ext + 4, 5);
    memcpy(h + ext + 8, "qcow2", 5);
    size_t end = ext + 16; /* 8 + 5 padded to 8 */
    size_t name = end + 8; /* end-of-extensions: type 0, length 0 */
    memcpy(h + name, backing, blen);
    put_be64(h + 8, name);
    put_be32(h + 16, (uint32_t)blen);
    put_be32(h + 20, 16); /* cluster_bits */
    put_be64(h + 24, size);
    put_be32(h + 36, (uint32_t)l1);
    put_be64(h + 40, 3 * CL); /* L1 table */
    put_be64(h + 48, 1 * CL); /* refcount table */
    put_be32(h + 56, 1);
    put_be32(h + 96, 4); /* refcount_order: 16-bit */
    put_be32(h + 100, 104);
    uint8_t rt[8], rb[8];
    put_be64(rt, 2 * CL);         /* refcount block in cluster 2 */
    for (int i = 0; i < 4; i++) { /* clusters 0-3 are in use once each */
        rb[2 * i] = 0;
        rb[2 * i + 1] = 1;
    }
    int fd = open(path, O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
    if (fd < 0)
        return -1;
    bool ok = pwrite(fd, h, name + blen, 0) == (ssize_t)(name + blen) &&
              pwrite(fd, rt, sizeof rt, CL) == (ssize_t)sizeof rt &&
              pwrite(fd, rb, sizeof rb, 2 * CL) == (ssize_t)sizeof rb && ftruncate(fd, 4 * CL) == 0;
    int e = errno;
    close(fd);
    errno = e;
    return ok ? 0 : -1;
}

static void start_disk(struct vm *vm)
{
    sp_qemu_t *d = vm->d;
    vm->ph = PH_DISK;
    if (mkdir(d->vms_dir, 0755) < 0 && errno != EEXIST) {
        sp_log(SP_LOG_ERROR, "qemu", "cannot create dir=%s err=%s", d->vms_dir, strerror(errno));
        boot_fail(vm, "%s", "cannot create the VM directory");
        return;
    }
    rm_rf(vm->dir); /* leftovers of a failed boot; boot() checked there is no snapshot */
    if (mkdir(vm->dir, 0700) < 0) {
        sp_log(SP_LOG_ERROR, "qemu", "cannot create dir=%s err=%s", vm->dir, strerror(errno));
        boot_fail(vm, "%s", "cannot create the VM directory");
        return;
    }
    if (write_vm_json(vm) < 0)
        sp_log(SP_LOG_WARN, "qemu", "cannot write vm.json sandbox=%s", vm->id);
    char disk[PATH_MAX + 16], log[PATH_MAX + 16], backing[PATH_MAX + 16];
    vm_path(vm, "disk.qcow2", disk, sizeof disk);
    vm_path(vm, "qemu.log", log, sizeof log);
    /* A clone's chain: template base <- template snapshot's frozen overlay <- ours. */
    if (vm->clone_src != NULL)
        sfmt(backing, sizeof backing, "%s/disk.qcow2", vm->clone_src);
    else
        sfmt(backing, sizeof backing, "%s", vm->tp->rootfs);
    if (vm->clone_src != NULL) {
        if (write_overlay(disk, backing) == 0) {
            start_qemu(vm);
            return;
        }
        sp_log(SP_LOG_WARN, "qemu", "cannot write the overlay, using qemu-img sandbox=%s err=%s",
               vm->id, strerror(errno));
        unlink(disk);
    }
    char *argv[] = {d->qemu_img, "create", "-q",    "-f", "qcow2", "-F",
                    "qcow2",     "-b",     backing, disk, NULL};
    struct spawn_opts so = {.out_path = log, .stdin_fd = -1, .cg = NULL};
    sp_err_t e;
    vm->img = child_start(d, argv, &so, 30000, on_img_exit, vm, &e);
    if (vm->img == NULL)
        boot_fail(vm, "%s", e.msg);
}

/* ---------- accelerator and sandbox probes ---------- */

static void kick(sp_qemu_t *d)
{
    if (!sp_timer_armed(&d->kick_timer))
        sp_timer_start(&d->kick_timer, 0);
}

/* This host boot's id: a probe verdict is reused only within one host boot (KVM modules
 * and hardware settings do not change under a running kernel). "" if unknown. */
static void host_boot_id(char *out, size_t n)
{
    if (read_small("/proc/sys/kernel/random/boot_id", out, n) <= 0)
        out[0] = '\0';
    out[strcspn(out, "\n")] = '\0';
}

/* <vms>/accel is "kvm|tcg\n<reason>\n[probe boot_id=<id>]\n". Returns the accelerator a
 * probe decided earlier in this host boot, or -1. */
static int cached_probe_verdict(sp_qemu_t *d)
{
    char p[PATH_MAX + 16], buf[1024], bid[64], want[128];
    sfmt(p, sizeof p, "%s/accel", d->vms_dir);
    host_boot_id(bid, sizeof bid);
    if (bid[0] == '\0' || read_small(p, buf, sizeof buf) <= 0)
        return -1;
    sfmt(want, sizeof want, "\nprobe boot_id=%s\n", bid);
    if (strstr(buf, want) == NULL)
        return -1;
    if (strncmp(buf, "kvm\n", 4) == 0)
        return 1;
    if (strncmp(buf, "tcg\n", 4) == 0)
        return 0;
    return -1;
}

static void record_accel_ex(sp_qemu_t *d, const char *why, bool probed)
{
    char p[PATH_MAX + 16], buf[768], bid[64] = "";
    sfmt(p, sizeof p, "%s/accel", d->vms_dir);
    if (probed)
        host_boot_id(bid, sizeof bid);
    int n = sfmt(buf, sizeof buf, "%s\n%s\n%s%s%s", d->accel == 1 ? "kvm" : "tcg", why,
                 bid[0] ? "probe boot_id=" : "", bid, bid[0] ? "\n" : "");
    if (mkdir(d->vms_dir, 0755) == 0 || errno == EEXIST)
        write_atomic(p, buf, (size_t)n);
    sp_log(SP_LOG_INFO, "qemu", "accelerator=%s reason=\"%s\"", d->accel == 1 ? "kvm" : "tcg", why);
}

static void record_accel(sp_qemu_t *d, const char *why)
{
    record_accel_ex(d, why, false);
}

static void on_kvm_probe(struct child *c, int st, bool timed_out, void *arg)
{
    sp_qemu_t *d = arg;
    child_free(c);
    d->kvm_probe = NULL;
    char why[256];
    if (!timed_out && st != -1 && WIFEXITED(st) && WEXITSTATUS(st) == 0) {
        d->accel = 1;
        sfmt(why, sizeof why, "a probe guest booted under /dev/kvm");
    } else {
        d->accel = 0;
        if (timed_out)
            sfmt(why, sizeof why,
                 "/dev/kvm opens but a probe guest did not boot within %u ms (software "
                 "KVM such as PVM, or broken); falling back to TCG",
                 d->probe_ms);
        else
            sfmt(why, sizeof why,
                 "a probe guest under /dev/kvm failed (status %d, see vms/kvm-probe.log); "
                 "falling back to TCG",
                 st);
    }
    record_accel_ex(d, why, true);
    if (!d->gc_done)
        tsnap_gc(d); /* keys depend on the accelerator: this is the first chance */
    kick(d);
}

/* Boots the guest kernel under KVM with no init to find: a kernel that works panics at
 * the root mount, and panic=-1 + -no-reboot make QEMU exit 0. A hang means no KVM. */
static void start_kvm_probe(sp_qemu_t *d, const char *kernel)
{
    char log[PATH_MAX + 32], serial[PATH_MAX + 40];
    sfmt(log, sizeof log, "%s/kvm-probe.log", d->vms_dir);
    sfmt(serial, sizeof serial, "file:%s", log);
    unlink(log);
    char *argv[] = {d->qemu,
                    "-M",
                    "microvm,x-option-roms=off,pit=off,pic=off,rtc=off,isa-serial=on",
                    "-enable-kvm",
                    "-cpu",
                    "host,-arch-capabilities",
                    "-m",
                    "128",
                    "-smp",
                    "1",
                    "-kernel",
                    (char *)kernel,
                    "-append",
                    "console=ttyS0 reboot=t panic=-1 rdinit=/space-kvm-probe "
                    "root=/dev/space-kvm-probe",
                    "-nodefaults",
                    "-no-user-config",
                    "-nographic",
                    "-no-reboot",
                    "-serial",
                    serial,
                    NULL};
    struct spawn_opts so = {.out_path = NULL, .stdin_fd = -1, .cg = NULL, .new_session = true};
    sp_err_t e;
    sp_log(SP_LOG_INFO, "qemu", "probing KVM timeout_ms=%u", d->probe_ms);
    d->kvm_probe = child_start(d, argv, &so, d->probe_ms, on_kvm_probe, d, &e);
    if (d->kvm_probe == NULL) {
        d->accel = 0;
        record_accel(d, "cannot start the KVM probe; using TCG");
        kick(d);
    }
}

static void on_sandbox_probe(struct child *c, int st, bool timed_out, void *arg)
{
    sp_qemu_t *d = arg;
    child_free(c);
    d->sandbox_probe = NULL;
    d->sandbox = !timed_out && st != -1 && WIFEXITED(st) && WEXITSTATUS(st) == 0;
    if (d->sandbox)
        sp_log(SP_LOG_INFO, "qemu", "qemu seccomp sandbox available: -sandbox %s",
               SP_QEMU_SANDBOX_ARG);
    else
        sp_log(SP_LOG_WARN, "qemu", "qemu has no usable -sandbox: VMs run without seccomp");
    kick(d);
}

/* Starts QEMU with no machine and the sandbox flags, feeding QMP on stdin a quit. */
static void start_sandbox_probe(sp_qemu_t *d)
{
    int p[2];
    if (pipe2(p, O_CLOEXEC) < 0) {
        d->sandbox = 0;
        return;
    }
    static const char script[] = "{\"execute\":\"qmp_capabilities\"}\n{\"execute\":\"quit\"}\n";
    ssize_t w = write(p[1], script, sizeof script - 1); /* fits the pipe buffer */
    close(p[1]);
    if (w != (ssize_t)sizeof script - 1) {
        close(p[0]);
        d->sandbox = 0;
        return;
    }
    char *argv[] = {d->qemu,
                    "-M",
                    "none",
                    "-display",
                    "none",
                    "-nodefaults",
                    "-no-user-config",
                    "-sandbox",
                    SP_QEMU_SANDBOX_ARG,
                    "-qmp",
                    "stdio",
                    NULL};
    struct spawn_opts so = {.out_path = NULL, .stdin_fd = p[0], .cg = NULL};
    sp_err_t e;
    d->sandbox_probe = child_start(d, argv, &so, SP_QEMU_SANDBOX_PROBE, on_sandbox_probe, d, &e);
    close(p[0]);
    if (d->sandbox_probe == NULL)
        d->sandbox = 0;
}

static void boot_begin(struct vm *vm);

/* Moves boots along once the verdicts are in; starts the KVM probe on the first boot
 * (it needs a guest kernel, which only a boot names). */
static void on_kick(sp_timer_t *t, void *arg)
{
    sp_qemu_t *d = arg;
    for (struct vm *vm = d->vms; vm != NULL;) {
        struct vm *next = vm->next; /* start_disk may fail and free vm */
        if (vm->ph == PH_WAIT_ACCEL) {
            if (d->accel < 0 && d->kvm_probe == NULL)
                start_kvm_probe(d, vm->tp->kernel);
            else if (d->accel >= 0 && d->sandbox >= 0)
                boot_begin(vm);
        }
        vm = next;
    }
}

static void on_console_tick(sp_timer_t *t, void *arg)
{
    sp_qemu_t *d = arg;
    for (struct vm *vm = d->vms; vm != NULL; vm = vm->next)
        if (vm->ph >= PH_START && vm->ph < PH_STOPPING)
            console_trim(vm);
    sp_timer_start(&d->console_timer, SP_QEMU_CONSOLE_TICK_MS);
}

/* ---------- re-adoption ---------- */

/* Takes over a live QEMU found on disk: watch it, reconnect QMP and the agent channel.
 * NULL when pid is not watchable (gone in between). */
static struct vm *vm_adopt(sp_qemu_t *d, const char *id, pid_t pid)
{
    int pfd = pidfd_open_(pid);
    if (pfd < 0)
        return NULL;
    fcntl(pfd, F_SETFD, FD_CLOEXEC);
    struct vm *vm = vm_new(d, id);
    if (vm == NULL) {
        close(pfd);
        return NULL;
    }
    vm->pid = pid;
    vm->pidfd = pfd;
    vm->adopted = true;
    vm->ph = PH_UP;
    read_vm_json(vm);
    char p[PATH_MAX + 16];
    vm_path(vm, "paused", p, sizeof p);
    vm->paused = file_exists(p);
    vm->cg = sp_cgroup_vm_exists(d->cg, id); /* groups outlive spaced: nothing to redo */
    vm->pw = sp_watch_create(d->base.loop, vm->pidfd, on_vm_exit, vm);
    if (vm->pw == NULL) {
        vm_unlink(vm);
        vm_free(vm);
        return NULL;
    }
    sp_watch_set(vm->pw, SP_IO_READ);
    vm_adopt_connect(vm);
    return vm;
}

static void vm_adopt_connect(struct vm *vm)
{
    qmp_try_connect(vm);
    agent_start(vm);
}

/* A builder's or spare's dir an earlier driver left: its QEMU, files and cgroup (cid) go. */
static void remove_leftover(sp_qemu_t *d, const char *dir, const char *cid)
{
    pid_t pid = live_qemu_pid(dir);
    if (pid > 0) {
        kill(-pid, SIGKILL);
        kill(pid, SIGKILL);
    }
    rm_rf(dir);
    cg_remove(d, cid);
}

static void adopt_all(sp_qemu_t *d)
{
    DIR *dir = opendir(d->vms_dir);
    if (dir == NULL)
        return;
    struct dirent *de;
    int n = 0;
    while ((de = readdir(dir)) != NULL) {
        if (strncmp(de->d_name, ".tsnap-", 7) == 0) {
            /* a template snapshot builder of an earlier driver: never finished, never adopted
             * (one of a live driver in another process is left to it) */
            if (tsnap_tmp_foreign(de->d_name))
                continue;
            char tdir[PATH_MAX], cid[SP_QEMU_ID_MAX + 1];
            sfmt(tdir, sizeof tdir, "%s/%s", d->vms_dir, de->d_name);
            sfmt(cid, sizeof cid, "tsnap:%.16s", de->d_name + 7);
            remove_leftover(d, tdir, cid);
            continue;
        }
        if (strncmp(de->d_name, ".pool-", 6) == 0) {
            char pdir[PATH_MAX];
            sfmt(pdir, sizeof pdir, "%s/%s", d->vms_dir, de->d_name);
            struct stat lst;
            if (lstat(pdir, &lst) == 0 && S_ISLNK(lst.st_mode)) {
                /* the old name of a taken spare: kept while its QEMU runs */
                char tgt[PATH_MAX];
                ssize_t k = readlink(pdir, tgt, sizeof tgt - 1);
                tgt[k > 0 ? k : 0] = '\0';
                char tdir[PATH_MAX * 2];
                snprintf(tdir, sizeof tdir, "%s/%s", d->vms_dir, tgt);
                if (k <= 0 || strchr(tgt, '/') != NULL || live_qemu_pid(tdir) <= 0)
                    unlink(pdir);
                continue;
            }
            /* a spare clone of an earlier driver: no sandbox, never adopted */
            if (tsnap_tmp_foreign(de->d_name))
                continue;
            char cid[SP_QEMU_ID_MAX + 1];
            sfmt(cid, sizeof cid, "pool:%.40s", de->d_name + 6);
            remove_leftover(d, pdir, cid);
            continue;
        }
        if (d->no_adopt || !valid_id(de->d_name) || vm_find(d, de->d_name) != NULL)
            continue;
        char vdir[PATH_MAX];
        sfmt(vdir, sizeof vdir, "%s/%s", d->vms_dir, de->d_name);
        pid_t pid = live_vm_pid(d, de->d_name, vdir);
        if (pid > 0 && vm_adopt(d, de->d_name, pid) != NULL)
            n++;
    }
    closedir(dir);
    if (n > 0)
        sp_log(SP_LOG_INFO, "qemu", "re-adopting running vms count=%d", n);
}

/* ---------- spare clones (the pool) ----------
 *
 * Restoring a clone costs a new QEMU process, the device state, the agent's
 * reconnection, and then a first command that runs slowly because TCG translates every
 * guest code path afresh in each process. A spare is a clone made ahead of time for a
 * template size that was recently created from: restored, up, warmed by running a few
 * commands (so its translation cache holds the exec path), then stopped (no CPU). A create
 * of that size takes one: its directory and cgroup are renamed to the sandbox's, the vCPUs
 * start, and IDENTITY gives it the sandbox's hostname, env, RNG seed and clock, exactly as
 * after a restore. Spares are refilled one at a time and only while no other boot is in
 * flight; they are never adopted by a later driver (killed instead) and go with the driver.
 */

/* Warm-up of a spare: the exec path the first commands of a sandbox take. */
static const struct {
    const char *argv[4];
    const char *user;
} pool_warm_cmds[] = {
    {{"true"}, NULL},
    {{"/bin/sh", "-c", "true"}, "user"},
};

static struct poolwant *pool_want(sp_qemu_t *d, const char *key)
{
    for (struct poolwant *w = d->wants; w != NULL; w = w->next)
        if (strcmp(w->key, key) == 0)
            return w;
    return NULL;
}

static void pool_failed(sp_qemu_t *d, const char *key)
{
    struct poolwant *w = pool_want(d, key);
    if (w != NULL)
        w->retry_ms = mono_ms() + SP_QEMU_POOL_RETRY_MS;
}

static void pool_kick(sp_qemu_t *d)
{
    if (d->pool_size > 0)
        sp_timer_start(&d->pool_timer, 1);
}

/* Marks the spares of key (NULL: of template tname's builds other than build) to be stopped
 * by the pool timer: callers may be iterating the VM list, and stopping may free a VM. */
static void pool_drop(sp_qemu_t *d, const char *key, const char *tname, const char *build)
{
    for (struct vm *v = d->vms; v != NULL; v = v->next) {
        if (v->pooled && (key != NULL ? strcmp(v->pool_key, key) == 0
                                      : v->tp != NULL && strcmp(v->template_name, tname) == 0 &&
                                            strcmp(v->tp->hash, build) != 0)) {
            v->pool_drop = true;
            pool_kick(d);
        }
    }
}

/* A create of this size: remember it (most recent first), forget the least recently used size
 * beyond SP_QEMU_POOL_KEYS, and drop spares of the template's older builds. */
static void pool_note(sp_qemu_t *d, const char *key, const struct vm *vm)
{
    struct poolwant **pp = &d->wants, *w = NULL;
    for (; *pp != NULL; pp = &(*pp)->next) {
        if (strcmp((*pp)->key, key) == 0) {
            w = *pp;
            *pp = w->next;
            break;
        }
    }
    if (w == NULL) {
        w = calloc(1, sizeof(*w));
        if (w == NULL)
            return;
        sfmt(w->key, sizeof w->key, "%s", key);
        sfmt(w->template_name, sizeof w->template_name, "%s", vm->template_name);
        w->tp = *vm->tp;
        w->cpu_count = vm->cpu_count;
        w->memory_mb = vm->memory_mb;
        w->disk_total = vm->disk_total;
        /* other builds of this template: no create will match them again */
        pool_drop(d, NULL, vm->template_name, vm->tp->hash);
        for (struct poolwant **q = &d->wants; *q != NULL;) {
            if (strcmp((*q)->template_name, vm->template_name) == 0 &&
                strcmp((*q)->tp.hash, vm->tp->hash) != 0) {
                struct poolwant *x = *q;
                *q = x->next;
                free(x);
            } else {
                q = &(*q)->next;
            }
        }
    }
    w->used_ms = mono_ms();
    w->next = d->wants;
    d->wants = w;
    int n = 0;
    for (pp = &d->wants; *pp != NULL;) {
        if (++n > SP_QEMU_POOL_KEYS) {
            struct poolwant *x = *pp;
            *pp = x->next;
            pool_drop(d, x->key, NULL, NULL);
            free(x);
        } else {
            pp = &(*pp)->next;
        }
    }
    pool_kick(d);
}

/* Starts one spare of w's size. */
static void pool_start(sp_qemu_t *d, struct poolwant *w)
{
    unsigned seq = ++d->pool_seq;
    char id[SP_QEMU_ID_MAX + 1];
    sfmt(id, sizeof id, "pool:%u-%d", seq, (int)getpid()); /* ':': no sandbox id, no API */
    sp_tmplbuild_paths_t *tp = malloc(sizeof(*tp));
    struct vm *vm = tp != NULL ? vm_new(d, id) : NULL;
    if (vm == NULL) {
        free(tp);
        return;
    }
    *tp = w->tp;
    vm->tp = tp;
    sfmt(vm->dir, sizeof vm->dir, "%s/.pool-%u-%d", d->vms_dir, seq, (int)getpid());
    sfmt(vm->template_name, sizeof vm->template_name, "%s", w->template_name);
    sfmt(vm->pool_key, sizeof vm->pool_key, "%s", w->key);
    vm->pooled = true;
    vm->cpu_count = w->cpu_count;
    vm->memory_mb = w->memory_mb;
    vm->disk_total = w->disk_total;
    vm->hostname = strdup("space");
    vm->ph = PH_WAIT_ACCEL;
    vm->boot_start_ms = mono_ms();
    sp_timer_start(&vm->boot_timer, d->boot_timeout_ms);
    sp_log(SP_LOG_DEBUG, "qemu", "making a spare clone spare=%s template=%s key=%s", id,
           w->template_name, w->key);
    kick(d);
}

/* Forgets sizes nobody created for SP_QEMU_POOL_IDLE_MS (their spares go), then starts the
 * next missing spare of the most recently used size, one at a time and only when no other
 * boot is in flight: a spare never competes with a sandbox's boot for the CPU. Nor, while
 * a size still has a spare, with the first commands of a sandbox that came up in the last
 * SP_QEMU_POOL_SETTLE_MS; a size with none left is refilled at once. */
static void on_pool_timer(sp_timer_t *t, void *arg)
{
    sp_qemu_t *d = arg;
    uint64_t now = mono_ms();
    for (struct vm *v = d->vms; v != NULL;) {
        struct vm *next = v->next; /* vm_stop may free v */
        if (v->pooled && v->pool_drop && v->ph != PH_STOPPING) {
            sp_log(SP_LOG_INFO, "qemu", "spare clone dropped spare=%s key=%s", v->id, v->pool_key);
            vm_stop(v, false);
        }
        v = next;
    }
    for (struct poolwant **pp = &d->wants; *pp != NULL;) {
        struct poolwant *w = *pp;
        if (now - w->used_ms > SP_QEMU_POOL_IDLE_MS) {
            *pp = w->next;
            pool_drop(d, w->key, NULL, NULL);
            free(w);
        } else {
            pp = &w->next;
        }
    }
    if (d->wants == NULL || d->pool_size <= 0 || d->accel < 0)
        return;
    for (struct vm *v = d->vms; v != NULL; v = v->next) {
        if (v->tsnap_req)
            continue;
        if (v->ph < PH_UP || v->ph == PH_SUSPENDING || (v->pooled && !v->pool_ready)) {
            sp_timer_start(&d->pool_timer, SP_QEMU_POOL_TICK_MS);
            return;
        }
    }
    uint64_t wait = 60000; /* idle sizes are looked at again within a minute */
    for (struct poolwant *w = d->wants; w != NULL; w = w->next) {
        if (now < w->retry_ms) {
            wait = w->retry_ms - now < wait ? w->retry_ms - now : wait;
            continue;
        }
        int n = 0;
        for (struct vm *v = d->vms; v != NULL; v = v->next)
            n += v->pooled && !v->pool_drop && v->ph != PH_STOPPING &&
                 strcmp(v->pool_key, w->key) == 0;
        if (n > 0 && n < d->pool_size && now < d->pool_quiet_until) {
            wait = d->pool_quiet_until - now < wait ? d->pool_quiet_until - now : wait;
            continue; /* a spare is still there for the next create */
        }
        if (n < d->pool_size) {
            pool_start(d, w);
            wait = SP_QEMU_POOL_TICK_MS;
            break;
        }
    }
    sp_timer_start(&d->pool_timer, wait);
}

static void on_pool_stopped(void *arg, json_t *ret, const sp_err_t *err)
{
    struct vm *vm = arg;
    if (!vm->pooled || vm->ph != PH_UP)
        return;
    if (err != NULL) {
        sp_log(SP_LOG_WARN, "qemu", "spare clone not stopped spare=%s err=%s", vm->id, err->msg);
        vm->boot_failed = true;
        vm_stop(vm, false);
        return;
    }
    vm->paused = true;
    vm->pool_ready = true;
    sp_log(SP_LOG_INFO, "qemu", "spare clone ready spare=%s key=%s ms=%llu", vm->id, vm->pool_key,
           (unsigned long long)(mono_ms() - vm->boot_start_ms));
    pool_kick(vm->d);
}

static void on_pool_warm(void *arg, const sp_exec_result_t *res, const sp_err_t *err)
{
    struct vm *vm = arg;
    vm->warm = NULL;
    if (!vm->pooled || vm->ph != PH_UP)
        return;
    if (err != NULL || !res->exited || res->exit_code != 0)
        sp_log(SP_LOG_DEBUG, "qemu", "spare warm-up command failed spare=%s step=%d err=%s",
               vm->id, vm->pool_warm_step, err != NULL ? err->msg : "exit status");
    vm->pool_warm_step++;
    pool_warm(vm);
}

/* A spare is up: run the warm-up commands one after the other, then stop its vCPUs. */
static void pool_warm(struct vm *vm)
{
    sp_err_t e;
    int n = (int)(sizeof pool_warm_cmds / sizeof pool_warm_cmds[0]);
    while (vm->pool_warm_step < n) {
        const char *const *argv = pool_warm_cmds[vm->pool_warm_step].argv;
        size_t argc = 0;
        while (argc < 4 && argv[argc] != NULL)
            argc++;
        sp_exec_cmd_t cmd = {.argv = argv,
                             .argc = argc,
                             .user = pool_warm_cmds[vm->pool_warm_step].user,
                             .timeout_ms = SP_QEMU_POOL_WARM_MS};
        vm->warm = sp_exec_run(vm->d->base.loop, vm->agent, &cmd, 4096, on_pool_warm, vm, &e);
        if (vm->warm != NULL)
            return;
        vm->pool_warm_step++;
    }
    if (vm->qmp == NULL ||
        sp_qmp_command(vm->qmp, "stop", NULL, -1, on_pool_stopped, vm, &e) < 0) {
        vm->boot_failed = true;
        vm_stop(vm, false);
    }
}

/* A spare of key for a create: a ready one, else the one furthest along: finishing it beats
 * starting another restore beside it. NULL when there is none. */
static struct vm *pool_pick(sp_qemu_t *d, const char *key)
{
    struct vm *best = NULL;
    for (struct vm *v = d->vms; v != NULL; v = v->next) {
        if (!v->pooled || v->pool_drop || v->ph > PH_UP || v->img != NULL ||
            strcmp(v->pool_key, key) != 0)
            continue;
        if (v->ph == PH_UP && (v->qmp == NULL || sp_qmp_closed(v->qmp) || v->agent == NULL))
            continue; /* cannot be started and told who it is */
        if (v->pool_ready)
            return v;
        if (best == NULL || v->ph > best->ph)
            best = v;
    }
    return best;
}

static void on_take_cont(void *arg, json_t *ret, const sp_err_t *err)
{
    struct vm *vm = arg;
    if (err != NULL && vm->ph < PH_UP) {
        sp_log(SP_LOG_WARN, "qemu", "taken spare did not start sandbox=%s err=%s", vm->id,
               err->msg);
        boot_fail(vm, "guest did not come up: %s", "its vCPUs did not start");
    }
}

/* Gives the ready spare vm to sandbox spec->sandbox_id: its directory and cgroup take the
 * sandbox's names, its vCPUs start and IDENTITY follows (boot_done answers cb). -1 when it
 * cannot (nothing changed, or the spare was dropped): the caller boots the ordinary way. */
static int pool_take(struct vm *vm, const sp_vm_spec_t *spec, sp_driver_cb cb, void *arg)
{
    sp_qemu_t *d = vm->d;
    char ndir[PATH_MAX], op[PATH_MAX + 16], old_id[SP_QEMU_ID_MAX + 1];
    sfmt(ndir, sizeof ndir, "%s/%s", d->vms_dir, spec->sandbox_id);
    struct stat st;
    if (lstat(ndir, &st) == 0 || errno != ENOENT)
        return -1; /* files of an earlier boot of this id: the ordinary boot deals with them */
    char *host = strdup(spec->hostname != NULL && *spec->hostname ? spec->hostname : "space");
    char *env = spec->env_json != NULL ? strdup(spec->env_json) : NULL;
    struct waiter *w = calloc(1, sizeof(*w));
    if (host == NULL || w == NULL || (spec->env_json != NULL && env == NULL)) {
        free(host);
        free(env);
        free(w);
        return -1;
    }
    bool started = vm->pid > 0, ok = true, cg_moved = false;
    if (started) {
        /* QEMU's command line keeps naming the spare's directory: live_qemu_pid reads this */
        vm_path(vm, "pool.origin", op, sizeof op);
        ok = write_atomic(op, vm->dir, strlen(vm->dir)) == 0;
    }
    if (ok && vm->cg) {
        ok = sp_cgroup_vm_rename(d->cg, vm->id, spec->sandbox_id) == 0;
        cg_moved = ok;
    }
    if (ok && started) {
        /* QEMU opens files by the names it was given (its sockets while it starts, its disk
         * again when a migration completes): the old name must keep working, at every
         * instant, while this QEMU runs. A link at the new name whose target is the new name
         * is exchanged with the directory: then the directory has the new name and the link
         * the old one, pointing to it. */
        ok = symlink(spec->sandbox_id, ndir) == 0;
        if (ok && renameat2(AT_FDCWD, vm->dir, AT_FDCWD, ndir, RENAME_EXCHANGE) < 0) {
            int e = errno;
            unlink(ndir);
            /* no exchange on this filesystem: move, then link (a window of microseconds) */
            ok = (e == EINVAL || e == ENOSYS) && rename(vm->dir, ndir) == 0;
            if (ok && symlink(spec->sandbox_id, vm->dir) < 0) {
                e = errno;
                rename(ndir, vm->dir);
                ok = false;
            }
            errno = e;
        }
    } else if (ok && rename(vm->dir, ndir) < 0 && errno != ENOENT) {
        ok = false; /* not started: nothing holds its names (no directory yet: fine) */
    }
    if (!ok) {
        sp_log(SP_LOG_WARN, "qemu", "spare clone not taken spare=%s sandbox=%s err=%s", vm->id,
               spec->sandbox_id, strerror(errno));
        if (cg_moved)
            sp_cgroup_vm_rename(d->cg, spec->sandbox_id, vm->id);
        free(host);
        free(env);
        free(w);
        vm->pool_drop = true;
        pool_kick(d);
        return -1;
    }
    sfmt(old_id, sizeof old_id, "%s", vm->id);
    bool was_ready = vm->pool_ready;
    sfmt(vm->id, sizeof vm->id, "%s", spec->sandbox_id);
    sfmt(vm->dir, sizeof vm->dir, "%s", ndir);
    vm->pooled = false;
    vm->pool_ready = false;
    free(vm->hostname);
    vm->hostname = host;
    free(vm->env_json);
    vm->env_json = env;
    w->cb = cb;
    w->arg = arg;
    w->next = vm->boot_w;
    vm->boot_w = w;
    /* Until the agent has taken IDENTITY, a later driver must not adopt it; and a failure
     * before that falls back to a boot of the sandbox (vm_finish), as a failed clone does. */
    char p[PATH_MAX + 16];
    vm_path(vm, "booting", p, sizeof p);
    write_atomic(p, "", 0);
    vm_path(vm, "agent.sock", p, sizeof p);
    if (vm->agent != NULL) { /* else agent_start makes it, by the new path and name */
        sp_agentconn_set_path(vm->agent, p);
        sp_agentconn_set_sandbox(vm->agent, vm->id);
    }
    vm->clone_boot = true;
    vm->boot_start_ms = mono_ms();
    sp_timer_start(&vm->boot_timer, d->boot_timeout_ms);
    const char *how = "ready";
    if (vm->ph < PH_UP) {
        /* still being made: its boot goes on as the sandbox's (the restore, then IDENTITY with
         * the sandbox's names; one already sent with the spare's is sent again) */
        how = vm->ph < PH_START ? "queued" : vm->ph == PH_START ? "restoring" : "connecting";
        if (vm->ph == PH_IDENTITY) {
            sp_agentstream_t *old = vm->ident;
            vm->ident = NULL;
            sp_agentstream_reset(old);
            vm->ph = PH_AGENT;
            if (sp_agentconn_up(vm->agent))
                send_identity(vm);
        }
    } else {
        /* up: stopped, or warming (its warm-up dropped; a `stop` already sent is undone by the
         * `cont` queued behind it) */
        if (!was_ready)
            how = "warming";
        sp_exec_cancel(vm->warm);
        vm->warm = NULL;
        sp_err_t e;
        if (sp_qmp_command(vm->qmp, "cont", NULL, -1, on_take_cont, vm, &e) < 0) {
            boot_fail(vm, "guest did not come up: %s", e.msg);
            return 0; /* answered through vm_finish */
        }
        vm->paused = false;
        vm->ph = PH_AGENT;
        if (sp_agentconn_up(vm->agent))
            send_identity(vm);
    }
    sp_log(SP_LOG_INFO, "qemu", "sandbox from a spare clone sandbox=%s spare=%s key=%s spare_was=%s",
           vm->id, old_id, vm->pool_key, how);
    return 0;
}

/* ---------- driver ops ---------- */

static int q_boot(sp_driver_t *base, const sp_vm_spec_t *spec, sp_driver_cb cb, void *arg,
                  sp_err_t *err)
{
    sp_qemu_t *d = (sp_qemu_t *)base;
    if (spec == NULL || !valid_id(spec->sandbox_id))
        return sp_err_set(err, SP_EINVAL, "invalid sandbox id");
    if (d->no_adopt)
        return sp_err_set(err, SP_ECONFLICT, "this driver only builds template snapshots");
    struct vm *vm = vm_find(d, spec->sandbox_id);
    if (vm == NULL) {
        char vdir[PATH_MAX];
        sfmt(vdir, sizeof vdir, "%s/%s", d->vms_dir, spec->sandbox_id);
        pid_t pid = live_vm_pid(d, spec->sandbox_id, vdir);
        if (pid > 0)
            vm = vm_adopt(d, spec->sandbox_id, pid);
        else if (snapshot_committed(vdir))
            return sp_err_set(err, SP_ECONFLICT, "sandbox has a snapshot: restore it instead");
    }
    if (vm != NULL) {
        if (vm->ph == PH_STOPPING)
            return sp_err_set(err, SP_ECONFLICT, "sandbox is being deleted");
        if (vm->ph == PH_UP) {
            if (complete(d, cb, arg, NULL) < 0)
                return sp_err_set(err, SP_EINTERNAL, "out of memory");
            return 0;
        }
        return add_waiter(&vm->boot_w, cb, arg, err); /* joins the boot in progress */
    }
    if (spec->env_json != NULL) {
        json_t *env = json_loads(spec->env_json, 0, NULL);
        bool ok = json_is_object(env);
        json_decref(env);
        if (!ok)
            return sp_err_set(err, SP_EINVAL, "env is not a JSON object");
    }
    const char *tname = spec->template_name != NULL ? spec->template_name : "base";
    sp_tmplbuild_paths_t *tp = calloc(1, sizeof(*tp));
    if (tp == NULL)
        return sp_err_set(err, SP_EINTERNAL, "out of memory");
    sp_err_t te;
    if (sp_tmplbuild_current(d->data_dir, tname, tp, &te) < 0) {
        free(tp);
        sp_log(SP_LOG_WARN, "qemu", "template not usable template=%s err=%s", tname, te.msg);
        return sp_err_set(err, SP_ERUNTIME, "template %s is not built on this host", tname);
    }
    if (d->pool_size > 0 && !d->cold_only && d->accel >= 0 && d->sandbox >= 0) {
        int cpus = spec->cpu_count > 0 ? spec->cpu_count : (tp->cpu_count > 0 ? tp->cpu_count : 1);
        int mem = spec->memory_mb > 0 ? spec->memory_mb : (tp->memory_mb > 0 ? tp->memory_mb : 256);
        char key[17];
        if (tsnap_key_for(d, tp, cpus, mem, key) == 0) {
            struct poolwant *pw = pool_want(d, key);
            if (pw != NULL)
                pw->used_ms = mono_ms();
            struct vm *spare = pool_pick(d, key);
            if (spare != NULL && pool_take(spare, spec, cb, arg) == 0) {
                free(tp);
                pool_kick(d);
                return 0;
            }
        }
    }
    vm = vm_new(d, spec->sandbox_id);
    if (vm == NULL || add_waiter(&vm->boot_w, cb, arg, err) < 0) {
        free(tp);
        if (vm != NULL) {
            vm_unlink(vm);
            vm_free(vm);
        }
        return sp_err_set(err, SP_EINTERNAL, "out of memory");
    }
    vm->tp = tp;
    sfmt(vm->template_name, sizeof vm->template_name, "%s", tname);
    vm->cpu_count = spec->cpu_count > 0 ? spec->cpu_count : (tp->cpu_count > 0 ? tp->cpu_count : 1);
    vm->memory_mb =
        spec->memory_mb > 0 ? spec->memory_mb : (tp->memory_mb > 0 ? tp->memory_mb : 256);
    vm->disk_total = (uint64_t)(tp->disk_mb > 0 ? tp->disk_mb : 0) << 20;
    vm->hostname = strdup(spec->hostname != NULL && *spec->hostname ? spec->hostname : "space");
    vm->env_json = spec->env_json != NULL ? strdup(spec->env_json) : NULL;
    vm->ph = PH_WAIT_ACCEL;
    vm->boot_start_ms = mono_ms();
    sp_timer_start(&vm->boot_timer, d->boot_timeout_ms);
    kick(d);
    return 0;
}

static struct vm *running_vm(sp_qemu_t *d, const char *id, sp_err_t *err)
{
    struct vm *vm = id != NULL && valid_id(id) ? vm_find(d, id) : NULL;
    if (vm == NULL) {
        sp_err_set(err, SP_ENOTFOUND, "sandbox has no VM");
        return NULL;
    }
    if (vm->ph == PH_STOPPING) {
        sp_err_set(err, SP_ECONFLICT, "sandbox is being deleted");
        return NULL;
    }
    if (vm->ph == PH_SUSPENDING) {
        sp_err_set(err, SP_ECONFLICT, "sandbox is being suspended");
        return NULL;
    }
    if (vm->ph != PH_UP) {
        sp_err_set(err, SP_ECONFLICT, "sandbox is still booting");
        return NULL;
    }
    if (vm->qmp == NULL || sp_qmp_closed(vm->qmp)) {
        sp_err_set(err, SP_EUNAVAIL, "VM control channel is not connected");
        return NULL;
    }
    return vm;
}

struct pr_op {
    struct vm *vm; /* valid while the QMP client lives: it dies with the VM */
    sp_qemu_t *d;
    bool pause;
    sp_driver_cb cb;
    void *arg;
};

static void on_pause_resume(void *arg, json_t *ret, const sp_err_t *err)
{
    struct pr_op *op = arg;
    if (err == NULL) {
        struct vm *vm = op->vm;
        char p[PATH_MAX + 16];
        vm_path(vm, "paused", p, sizeof p);
        vm->paused = op->pause;
        if (op->pause)
            write_atomic(p, "", 0);
        else
            unlink(p);
    } else {
        sp_log(SP_LOG_WARN, "qemu", "%s failed sandbox=%s err=%s", op->pause ? "stop" : "cont",
               op->vm->id, err->msg);
    }
    sp_err_t e;
    if (err != NULL)
        sp_err_set(&e, err->code == SP_EUNAVAIL ? SP_EUNAVAIL : SP_ERUNTIME, "%s failed: %s",
                   op->pause ? "pause" : "resume", err->msg);
    complete(op->d, op->cb, op->arg, err != NULL ? &e : NULL);
    free(op);
}

static int pause_resume(sp_driver_t *base, const char *id, bool pause, sp_driver_cb cb, void *arg,
                        sp_err_t *err)
{
    sp_qemu_t *d = (sp_qemu_t *)base;
    struct vm *vm = running_vm(d, id, err);
    if (vm == NULL)
        return -1;
    struct pr_op *op = calloc(1, sizeof(*op));
    if (op == NULL)
        return sp_err_set(err, SP_EINTERNAL, "out of memory");
    *op = (struct pr_op){vm, d, pause, cb, arg};
    if (sp_qmp_command(vm->qmp, pause ? "stop" : "cont", NULL, -1, on_pause_resume, op, err) < 0) {
        free(op);
        return -1;
    }
    return 0;
}

static int q_pause(sp_driver_t *d, const char *id, sp_driver_cb cb, void *arg, sp_err_t *err)
{
    return pause_resume(d, id, true, cb, arg, err);
}

static int q_resume(sp_driver_t *d, const char *id, sp_driver_cb cb, void *arg, sp_err_t *err)
{
    return pause_resume(d, id, false, cb, arg, err);
}

/* ---------- suspend (snapshot) ---------- */

static void snap_path(const struct vm *vm, const char *name, char *out, size_t n)
{
    sfmt(out, n, "%s/snapshot/%s", vm->dir, name);
}

static void snap_send(struct vm *vm, const char *cmd, json_t *args, int fd);

static void snap_fail(struct vm *vm, const char *what, const char *detail)
{
    sp_log(SP_LOG_WARN, "qemu", "suspend failed sandbox=%s step=%d what=%s err=%s", vm->id,
           vm->snap_step, what, detail ? detail : "");
    if (vm->snap_fd >= 0) {
        close(vm->snap_fd);
        vm->snap_fd = -1;
    }
    char p[PATH_MAX + 32];
    snap_path(vm, "devstate.tmp", p, sizeof p);
    unlink(p);
    sp_timer_stop(&vm->snap_timer);
    sumjob_abandon(vm->sum); /* a running `sync` child is reaped by on_sync_exit */
    vm->sum = NULL;
    sumjob_abandon(vm->delta); /* its thread ends when QEMU closes the pipe */
    vm->delta = NULL;
    vm->snap_step = SN_NONE;
    sp_err_t e;
    sp_err_set(&e, SP_ERUNTIME, "suspend failed: %s", what);
    complete_all(vm->d, &vm->snap_w, &e);
    if (vm->tsnap_build != NULL) {
        vm->boot_failed = true;
        sp_err_set(&vm->boot_err, SP_ERUNTIME, "template snapshot failed: %s", what);
        vm->ph = PH_UP;
        vm_stop(vm, false); /* vm_finish gives up on this snapshot */
        return;
    }
    if (vm->ph == PH_SUSPENDING) {
        vm->ph = PH_UP; /* the VM is intact; give it back as it was */
        if (!vm->snap_was_paused && vm->qmp != NULL && !sp_qmp_closed(vm->qmp))
            sp_qmp_command(vm->qmp, "cont", NULL, -1, NULL, NULL, &e);
    }
}

static int fsync_path(const char *p, int flags)
{
    int fd = open(p, flags | O_CLOEXEC);
    if (fd < 0)
        return -1;
    int rc = fsync(fd);
    close(fd);
    return rc;
}

/* Device state and RAM are durable: write the manifest and commit it by rename. */
static void snap_commit(struct vm *vm)
{
    char tmp[PATH_MAX + 32], dev[PATH_MAX + 32], man[PATH_MAX + 32], dir[PATH_MAX + 32],
        ram[PATH_MAX + 16];
    snap_path(vm, "devstate.tmp", tmp, sizeof tmp);
    snap_path(vm, "devstate", dev, sizeof dev);
    snap_path(vm, "manifest.json", man, sizeof man);
    vm_path(vm, "snapshot", dir, sizeof dir);
    vm_path(vm, "mem.ram", ram, sizeof ram);
    struct stat sd, sr = {0};
    bool stream = vm->clone_src != NULL; /* the RAM went into the device state stream */
    bool delta = stream && vm->delta_ok; /* only its pages that differ from the template's */
    if (rename(tmp, dev) < 0 || stat(dev, &sd) < 0 || (!stream && stat(ram, &sr) < 0)) {
        snap_fail(vm, "cannot commit the snapshot", strerror(errno));
        return;
    }
    /* Sizes and checksums are the ones the sum job saw (the VM was stopped throughout). */
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    json_t *o = json_pack(
        "{s:i, s:i, s:i, s:s, s:s, s:I, s:s, s:I, s:s, s:I, s:I, s:s, s:s, s:s}", "version",
        SP_QEMU_SNAP_VERSION, "cpu_count", vm->cpu_count, "memory_mb", vm->memory_mb, "accel",
        vm->d->accel == 1 ? "kvm" : "tcg", "ram",
        delta    ? "delta"
        : stream ? "stream"
                 : "mem.ram",
        "ram_bytes",
        (json_int_t)(stream ? 0 : vm->sum_sizes[SUM_RAM]), "devstate", "snapshot/devstate",
        "devstate_bytes", (json_int_t)vm->sum_sizes[SUM_DEV], "disk", "disk.qcow2", "disk_bytes",
        (json_int_t)vm->sum_sizes[SUM_DISK], "created_at", (json_int_t)ts.tv_sec, "checksum",
        SP_QEMU_SUM_ALGO, "devstate_checksum", vm->sums[SUM_DEV], "disk_checksum",
        vm->sums[SUM_DISK]);
    if (o != NULL && !stream)
        json_object_set_new(o, "ram_checksum", json_string(vm->sums[SUM_RAM]));
    if (o != NULL && delta)
        json_object_set_new(o, "ram_base", json_string(vm->clone_src));
    if (o != NULL && vm->tsnap_build == NULL && (uint64_t)sd.st_size != vm->sum_sizes[SUM_DEV]) {
        json_decref(o); /* cannot happen: the file was ours alone since QEMU closed it */
        snap_fail(vm, "the device state changed while it was checksummed", NULL);
        return;
    }
    char *js = o != NULL ? json_dumps(o, JSON_COMPACT) : NULL;
    json_decref(o);
    char mtmp[PATH_MAX + 40];
    sfmt(mtmp, sizeof mtmp, "%s.tmp", man);
    int fd = js != NULL ? open(mtmp, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644) : -1;
    bool ok = fd >= 0 && write(fd, js, strlen(js)) == (ssize_t)strlen(js) && fsync(fd) == 0;
    if (fd >= 0)
        close(fd);
    free(js);
    if (!ok || rename(mtmp, man) < 0) {
        unlink(mtmp);
        snap_fail(vm, "cannot write the snapshot manifest", strerror(errno));
        return;
    }
    fsync_path(dir, O_RDONLY | O_DIRECTORY); /* the rename itself is durable */
    sp_log(SP_LOG_INFO, "qemu",
           "snapshot committed sandbox=%s ram=%s devstate_bytes=%lld ram_bytes=%lld "
           "disk_bytes=%lld checksum_ms=%llu ms=%llu",
           vm->id, delta ? "delta" : stream ? "stream" : "file", (long long)sd.st_size,
           (long long)sr.st_size, (long long)vm->sum_sizes[SUM_DISK],
           (unsigned long long)vm->sum_ms, (unsigned long long)(mono_ms() - vm->snap_start_ms));
    vm->snap_step = SN_QUIT;
    snap_send(vm, "quit", NULL, -1);
    sp_timer_start(&vm->kill_timer, SP_QEMU_QUIT_GRACE_MS);
}

static void on_sync_exit(struct child *c, int st, bool timed_out, void *arg)
{
    struct vm *vm = arg;
    child_free(c);
    vm->sync = NULL;
    if (vm->ph != PH_SUSPENDING || vm->snap_step != SN_SYNC)
        return;
    if (timed_out || st == -1 || !WIFEXITED(st) || WEXITSTATUS(st) != 0) {
        snap_fail(vm, "cannot flush the snapshot to disk", "sync failed");
        return;
    }
    vm->sync_done = true;
    if (vm->sum_ok)
        snap_commit(vm);
}

/* The parts' checksums are in (computed while `sync` flushed them): commit once both are. */
static void suspend_sums_done(struct vm *vm, struct sumjob *j)
{
    if (vm->ph != PH_SUSPENDING || vm->snap_step != SN_SYNC)
        return;
    if (j->bad >= 0) {
        snap_fail(vm, "cannot checksum the snapshot", strerror(j->err_no));
        return;
    }
    memcpy(vm->sums, j->got, sizeof vm->sums);
    memcpy(vm->sum_sizes, j->size, sizeof vm->sum_sizes);
    vm->sum_ms = j->ms;
    vm->sum_ok = true;
    if (vm->sync_done)
        snap_commit(vm);
}

/* fdatasync of the RAM file (up to memory_mb of dirty pages), device state and overlay,
 * in a child so the loop does not wait for the disk. */
static void snap_sync(struct vm *vm)
{
    if (vm->snap_fd >= 0) {
        close(vm->snap_fd);
        vm->snap_fd = -1;
    }
    char ram[PATH_MAX + 16], dev[PATH_MAX + 32], disk[PATH_MAX + 16];
    vm_path(vm, "mem.ram", ram, sizeof ram);
    snap_path(vm, "devstate.tmp", dev, sizeof dev);
    vm_path(vm, "disk.qcow2", disk, sizeof disk);
    char *argv[] = {"sync", "--data", dev, disk, vm->clone_src == NULL ? ram : NULL, NULL};
    struct spawn_opts so = {.out_path = NULL, .stdin_fd = -1, .cg = NULL};
    sp_err_t e;
    if (vm->sync != NULL) { /* the flush of a failed suspend is still running */
        snap_fail(vm, "cannot flush the snapshot to disk", "an earlier flush is still running");
        return;
    }
    vm->snap_step = SN_SYNC;
    vm->sync_done = false;
    vm->sum_ok = false;
    memset(vm->sums, 0, sizeof vm->sums);
    memset(vm->sum_sizes, 0, sizeof vm->sum_sizes);
    vm->sum_ms = 0;
    /* Checksums of every part on a thread while `sync` flushes them (a template snapshot
     * builder has its own manifest and skips them). */
    if (vm->tsnap_build == NULL) {
        struct sumjob *j = sumjob_new(vm, false);
        if (j != NULL) {
            sfmt(j->path[SUM_DEV], sizeof j->path[SUM_DEV], "%s", dev);
            sfmt(j->path[SUM_DISK], sizeof j->path[SUM_DISK], "%s", disk);
            if (vm->clone_src == NULL)
                sfmt(j->path[SUM_RAM], sizeof j->path[SUM_RAM], "%s", ram);
        }
        if (j == NULL || sumjob_run(vm->d, j) < 0) {
            snap_fail(vm, "cannot checksum the snapshot", "no thread");
            return;
        }
        vm->sum = j;
    } else {
        vm->sum_ok = true;
    }
    vm->sync = child_start(vm->d, argv, &so, 120000, on_sync_exit, vm, &e);
    if (vm->sync == NULL)
        snap_fail(vm, "cannot flush the snapshot to disk", e.msg);
}

/* A clone's suspend: QEMU migrates into a pipe and a thread writes the device state file
 * from it with only the RAM pages that differ from the template's (core/runtime/migdelta.h). The fd
 * to give QEMU: the pipe's write end, or the device state file itself when there is no
 * delta to make (own RAM file, template builder, or the filter refused this VM before). */
static int suspend_delta_start(struct vm *vm)
{
    vm->mig_done = false;
    vm->delta_ok = false;
    vm->delta_failed = false;
    if (vm->clone_src == NULL || vm->no_delta || vm->tsnap_build != NULL)
        return vm->snap_fd;
    int pfd[2];
    struct sumjob *j = sumjob_new(vm, false);
    if (j == NULL)
        return vm->snap_fd;
    if (pipe2(pfd, O_CLOEXEC) < 0) {
        sumjob_free(j);
        return vm->snap_fd;
    }
    j->delta = true;
    j->in_fd = pfd[0];
    j->out_fd = fcntl(vm->snap_fd, F_DUPFD_CLOEXEC, 0);
    sfmt(j->base, sizeof j->base, "%s/mem.ram", vm->clone_src);
    if (j->out_fd < 0 || sumjob_run(vm->d, j) < 0) { /* sumjob_run frees j when it fails */
        if (j->out_fd < 0)
            sumjob_free(j);
        close(pfd[1]);
        return vm->snap_fd;
    }
    vm->delta = j;
    return pfd[1];
}

/* QEMU's migration completed (and the delta filter, if any, is through). */
static void suspend_migrated(struct vm *vm)
{
    if (vm->delta_failed) {
        /* The VM sits in postmigrate: SN_STATUS runs it through cont/stop again and migrates
         * the whole RAM this time. */
        vm->no_delta = true;
        vm->delta_failed = false;
        vm->snap_step = SN_STATUS;
        snap_send(vm, "query-status", NULL, -1);
        return;
    }
    snap_sync(vm);
}

static void suspend_delta_done(struct vm *vm, struct sumjob *j)
{
    if (vm->ph != PH_SUSPENDING || vm->snap_step < SN_GETFD || vm->snap_step > SN_POLL)
        return;
    if (j->rc < 0) {
        sp_log(SP_LOG_WARN, "qemu",
               "suspend: RAM delta refused sandbox=%s reason=\"%s\" (streaming the whole RAM "
               "instead)",
               vm->id, j->why);
        vm->delta_failed = true;
    } else {
        vm->delta_ok = true;
        sp_log(SP_LOG_DEBUG, "qemu",
               "suspend: RAM delta sandbox=%s pages=%llu/%llu zero=%llu/%llu bytes=%llu->%llu "
               "ms=%llu",
               vm->id, (unsigned long long)j->st.pages_kept, (unsigned long long)j->st.pages_in,
               (unsigned long long)j->st.zero_kept, (unsigned long long)j->st.zero_in,
               (unsigned long long)j->st.bytes_in, (unsigned long long)j->st.bytes_out,
               (unsigned long long)j->ms);
    }
    if (vm->mig_done)
        suspend_migrated(vm);
}

static void on_snap_reply(void *arg, json_t *ret, const sp_err_t *err)
{
    struct vm *vm = arg;
    if (vm->ph != PH_SUSPENDING || vm->snap_step == SN_QUIT)
        return;
    if (err != NULL) {
        snap_fail(vm, "qemu refused a step", err->msg);
        return;
    }
    switch (vm->snap_step) {
    case SN_STOP:
        vm->snap_step = SN_CANCEL;
        snap_send(vm, "migrate_cancel", NULL, -1);
        break;
    case SN_CANCEL:
        vm->snap_step = SN_CANCEL_POLL;
        snap_send(vm, "query-migrate", NULL, -1);
        break;
    case SN_CANCEL_POLL: {
        /* A migration an earlier driver started (and died in) still writes to its fd:
         * capabilities cannot change and a new one cannot start until it is over. */
        const char *st = json_string_value(json_object_get(ret, "status"));
        if (st != NULL && strcmp(st, "completed") != 0 && strcmp(st, "failed") != 0 &&
            strcmp(st, "cancelled") != 0 && strcmp(st, "none") != 0) {
            sp_timer_start(&vm->snap_timer, 5);
            break;
        }
        vm->snap_step = SN_STATUS;
        snap_send(vm, "query-status", NULL, -1);
        break;
    }
    case SN_STATUS:
    case SN_RECONT:
    case SN_RESTOP: {
        const char *st = json_string_value(json_object_get(ret, "status"));
        if (vm->snap_step == SN_STATUS && st != NULL && strcmp(st, "postmigrate") == 0) {
            vm->snap_step = SN_RECONT;
            snap_send(vm, "cont", NULL, -1);
            break;
        }
        if (vm->snap_step == SN_RECONT) {
            vm->snap_step = SN_RESTOP;
            snap_send(vm, "stop", NULL, -1);
            break;
        }
        vm->snap_step = SN_CAPS;
        /* A clone's RAM is a private map of the template's file: stream all of it. */
        json_t *a = json_pack("{s:[{s:s, s:b}]}", "capabilities", "capability", "x-ignore-shared",
                              "state", vm->clone_src == NULL ? 1 : 0);
        snap_send(vm, "migrate-set-capabilities", a, -1);
        break;
    }
    case SN_CAPS:
        /* QEMU paces a migration at 32 MiB/s by default; a clone's streamed RAM would take
         * seconds. Unlimited, and a downtime limit that lets it finish in one pass. */
        vm->snap_step = SN_PARAMS;
        snap_send(vm, "migrate-set-parameters",
                  json_pack("{s:I, s:I}", "max-bandwidth", (json_int_t)1 << 40, "downtime-limit",
                            (json_int_t)60000),
                  -1);
        break;
    case SN_PARAMS: {
        char dir[PATH_MAX + 16], tmp[PATH_MAX + 32];
        vm_path(vm, "snapshot", dir, sizeof dir);
        snap_path(vm, "devstate.tmp", tmp, sizeof tmp);
        if (mkdir(dir, 0700) < 0 && errno != EEXIST) {
            snap_fail(vm, "cannot create the snapshot directory", strerror(errno));
            return;
        }
        if (vm->snap_fd >= 0)
            close(vm->snap_fd); /* a second try (the delta was refused) starts afresh */
        vm->snap_fd = open(tmp, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
        if (vm->snap_fd < 0) {
            snap_fail(vm, "cannot create the device state file", strerror(errno));
            return;
        }
        int qfd = suspend_delta_start(vm);
        vm->snap_step = SN_GETFD;
        snap_send(vm, "getfd", json_pack("{s:s}", "fdname", "spmig"), qfd);
        if (qfd != vm->snap_fd)
            close(qfd); /* the QMP client sends its own dup */
        break;
    }
    case SN_GETFD:
        vm->snap_step = SN_MIGRATE;
        snap_send(vm, "migrate", json_pack("{s:s}", "uri", "fd:spmig"), -1);
        break;
    case SN_MIGRATE:
        vm->snap_step = SN_POLL;
        sp_timer_start(&vm->snap_timer, 1);
        break;
    case SN_POLL: {
        const char *st = json_string_value(json_object_get(ret, "status"));
        if (st != NULL && strcmp(st, "completed") == 0) {
            vm->mig_done = true;
            if (vm->delta == NULL) /* else suspend_delta_done goes on */
                suspend_migrated(vm);
        } else if (st != NULL && (strcmp(st, "failed") == 0 || strcmp(st, "cancelled") == 0)) {
            const char *desc = json_string_value(json_object_get(ret, "error-desc"));
            snap_fail(vm, "migration failed", desc);
        } else { /* device state alone takes a few ms: poll closely at first */
            sp_timer_start(&vm->snap_timer, mono_ms() - vm->snap_start_ms < 200 ? 1 : 5);
        }
        break;
    }
    default:
        break;
    }
}

static void snap_send(struct vm *vm, const char *cmd, json_t *args, int fd)
{
    sp_err_t e;
    if (vm->qmp == NULL) {
        json_decref(args);
        snap_fail(vm, "VM control channel is not connected", NULL);
        return;
    }
    if (sp_qmp_command(vm->qmp, cmd, args, fd, on_snap_reply, vm, &e) < 0 &&
        vm->snap_step != SN_QUIT)
        snap_fail(vm, "VM control channel failed", e.msg);
}

/* ---------- restore ---------- */

static void on_restore_reply(void *arg, json_t *ret, const sp_err_t *err)
{
    struct vm *vm = arg;
    if (vm->ph != PH_START || !vm->restoring)
        return;
    if (err != NULL) {
        sp_log(SP_LOG_WARN, "qemu", "restore step failed sandbox=%s step=%d err=%s", vm->id,
               vm->snap_step, err->msg);
        boot_fail(vm, "restore failed: %s", "qemu refused the snapshot");
        return;
    }
    sp_err_t e;
    switch (vm->snap_step) {
    case RS_CAPS: {
        char dev[PATH_MAX + 32];
        if (vm->clone_boot)
            sfmt(dev, sizeof dev, "%s/snapshot/devstate", vm->clone_src);
        else
            snap_path(vm, "devstate", dev, sizeof dev);
        int fd = open(dev, O_RDONLY | O_CLOEXEC);
        if (fd < 0) {
            boot_fail(vm, "restore failed: %s", "the device state is missing");
            return;
        }
        vm->snap_step = RS_GETFD;
        int rc = sp_qmp_command(vm->qmp, "getfd", json_pack("{s:s}", "fdname", "spin"), fd,
                                on_restore_reply, vm, &e);
        close(fd); /* the client holds its own dup until sent */
        if (rc < 0)
            boot_fail(vm, "restore failed: %s", e.msg);
        return;
    }
    case RS_GETFD:
        vm->snap_step = RS_INCOMING;
        if (sp_qmp_command(vm->qmp, "migrate-incoming", json_pack("{s:s}", "uri", "fd:spin"), -1,
                           on_restore_reply, vm, &e) < 0)
            boot_fail(vm, "restore failed: %s", e.msg);
        return;
    case RS_INCOMING:
        vm->snap_step = RS_POLL;
        sp_timer_start(&vm->snap_timer, 1);
        return;
    case RS_POLL: {
        const char *st = json_string_value(json_object_get(ret, "status"));
        if (st == NULL || strcmp(st, "inmigrate") == 0) { /* a clone loads in a few ms */
            sp_timer_start(&vm->snap_timer, mono_ms() - vm->boot_start_ms < 500 ? 1 : 5);
            return;
        }
        /* Loaded; "paused" (the source was stopped), so nothing has touched RAM or disk yet. */
        vm->restore_running = strcmp(st, "running") == 0;
        if (vm->verify == VERIFY_RUNNING) {
            vm->snap_step = RS_VERIFY; /* restore_sums_done goes on */
            vm->verify_wait_ms = mono_ms();
            return;
        }
        restore_loaded(vm);
        return;
    }
    case RS_CONT:
        restore_up(vm);
        return;
    default:
        return;
    }
}

/* The device state is loaded and the vCPUs are stopped: give up on a snapshot that failed
 * its checksums, else invalidate our own snapshot and start the vCPUs. */
static void restore_loaded(struct vm *vm)
{
    sp_err_t e;
    if (vm->verify == VERIFY_FAILED) {
        restore_corrupt(vm);
        return;
    }
    if (!vm->clone_boot) {
        /* Our own snapshot: once the vCPUs run, its RAM file and disk move on and it can
         * never be restored again. So a later driver must adopt this VM rather than kill
         * it and restore (booting marker first: a crash between the two leaves a stale
         * manifest beside a live VM, which adoption prefers and the next suspend
         * replaces). A clone keeps its marker: its template snapshot never changes, so
         * killing it and starting over stays safe until it has its identity. */
        char p[PATH_MAX + 32];
        vm_path(vm, "booting", p, sizeof p);
        unlink(p);
        snap_path(vm, "manifest.json", p, sizeof p);
        unlink(p);
    }
    if (!vm->restore_running) { /* paused after incoming: start the vCPUs */
        vm->snap_step = RS_CONT;
        if (sp_qmp_command(vm->qmp, "cont", NULL, -1, on_restore_reply, vm, &e) < 0)
            boot_fail(vm, "restore failed: %s", e.msg);
        return;
    }
    restore_up(vm);
}

static void restore_up(struct vm *vm)
{
    sp_log(SP_LOG_INFO, "qemu", "restored vm state sandbox=%s from=%s ms=%llu", vm->id,
           vm->clone_boot ? "template-snapshot" : "own-snapshot",
           (unsigned long long)(mono_ms() - vm->boot_start_ms));
    vm->paused = false;
    vm->ph = PH_AGENT;
    agent_start(vm);
}

/* A part did not match its checksum (or could not be read): QEMU goes, the snapshot stays,
 * marked corrupt so later wakes are refused at once (snap_check) instead of loading it. */
static void restore_corrupt(struct vm *vm)
{
    int part = vm->verify_bad >= 0 && vm->verify_bad < SUM_N ? vm->verify_bad : SUM_DEV;
    char why[120], p[PATH_MAX + 32];
    if (vm->verify_errno != 0) {
        sp_log(SP_LOG_WARN, "qemu",
               "cannot read the snapshot to verify it sandbox=%s part=%s err=%s", vm->id,
               sum_part[part], strerror(vm->verify_errno));
        sfmt(why, sizeof why, "the snapshot's %s cannot be read; it is kept", sum_label[part]);
    } else {
        snap_path(vm, "corrupt", p, sizeof p);
        char line[64];
        int n = sfmt(line, sizeof line, "%s checksum mismatch\n", sum_label[part]);
        if (write_atomic(p, line, (size_t)n) < 0)
            sp_log(SP_LOG_WARN, "qemu", "cannot mark the snapshot corrupt sandbox=%s err=%s",
                   vm->id, strerror(errno));
        sp_log(SP_LOG_ERROR, "qemu",
               "snapshot does not match its checksum sandbox=%s part=%s: not restored, kept and "
               "marked corrupt (snapshot/corrupt)",
               vm->id, sum_part[part]);
        sfmt(why, sizeof why, "the snapshot's %s does not match its checksum; it is kept",
             sum_label[part]);
    }
    boot_fail(vm, "cannot wake: %s", why);
}

/* The big parts' checksums (RAM file, disk, a device state too big for snap_check) are
 * verified on a thread from the moment the wake is asked for, while QEMU starts and loads the
 * device state; the vCPUs start only once they match (RS_VERIFY). They cannot be verified
 * after: the RAM file is mapped shared and the disk is live, so both change as soon as the
 * guest runs. Nothing to do for a version-1 manifest (no checksums). */
static void restore_verify(struct vm *vm, json_t *man)
{
    vm->verify = VERIFY_NONE;
    const char *ram = json_string_value(json_object_get(man, "ram_checksum"));
    const char *dev = json_string_value(json_object_get(man, "devstate_checksum"));
    const char *disk = json_string_value(json_object_get(man, "disk_checksum"));
    long long dev_bytes = man_size(man, "devstate_bytes");
    if (dev_bytes >= 0 && (uint64_t)dev_bytes <= SP_QEMU_SUM_INLINE_MAX)
        dev = NULL; /* snap_check did it */
    if (vm->restore_stream || vm->restore_delta)
        ram = NULL;
    if (ram == NULL && dev == NULL && disk == NULL)
        return;
    struct sumjob *j = sumjob_new(vm, true);
    if (j == NULL) {
        sp_log(SP_LOG_WARN, "qemu", "snapshot checksums not verified sandbox=%s (no memory)",
               vm->id);
        return;
    }
    const char *want[SUM_N] = {ram, dev, disk};
    static const char *const files[SUM_N] = {"mem.ram", "snapshot/devstate", "disk.qcow2"};
    for (int i = 0; i < SUM_N; i++) {
        if (want[i] == NULL)
            continue;
        vm_path(vm, files[i], j->path[i], sizeof j->path[i]);
        sfmt(j->want[i], sizeof j->want[i], "%.64s", want[i]);
    }
    if (sumjob_run(vm->d, j) < 0) {
        sp_log(SP_LOG_WARN, "qemu", "snapshot checksums not verified sandbox=%s (no thread)",
               vm->id);
        return;
    }
    vm->sum = j;
    vm->verify = VERIFY_RUNNING;
}

static void restore_sums_done(struct vm *vm, struct sumjob *j)
{
    vm->verify = j->bad < 0 ? VERIFY_OK : VERIFY_FAILED;
    vm->verify_bad = j->bad;
    vm->verify_errno = j->err_no;
    bool waited = vm->ph == PH_START && vm->restoring && vm->snap_step == RS_VERIFY;
    sp_log(j->bad >= 0 ? SP_LOG_WARN : SP_LOG_INFO, "qemu",
           "snapshot checksums sandbox=%s result=%s ms=%llu wake_waited_ms=%llu ram_bytes=%llu "
           "disk_bytes=%llu",
           vm->id, j->bad < 0 ? "ok" : "failed", (unsigned long long)j->ms,
           (unsigned long long)(waited ? mono_ms() - vm->verify_wait_ms : 0),
           (unsigned long long)j->size[SUM_RAM], (unsigned long long)j->size[SUM_DISK]);
    if (waited)
        restore_loaded(vm);
    else if (j->bad >= 0 && vm->restoring && vm->ph < PH_AGENT)
        restore_corrupt(vm); /* before QEMU loaded anything: no need to wait for it */
}

static void restore_begin(struct vm *vm)
{
    sp_err_t e;
    vm->snap_step = RS_CAPS;
    /* RAM in a file (ours, or the template's for a clone): device state only. */
    json_t *a = json_pack("{s:[{s:s, s:b}]}", "capabilities", "capability", "x-ignore-shared",
                          "state", vm->restore_stream || vm->restore_delta ? 0 : 1);
    if (sp_qmp_command(vm->qmp, "migrate-set-capabilities", a, -1, on_restore_reply, vm, &e) < 0)
        boot_fail(vm, "restore failed: %s", e.msg);
}

static void on_snap_timer(sp_timer_t *t, void *arg)
{
    struct vm *vm = arg;
    sp_err_t e;
    if (vm->qmp == NULL)
        return;
    if (vm->ph == PH_SUSPENDING && (vm->snap_step == SN_POLL || vm->snap_step == SN_CANCEL_POLL))
        sp_qmp_command(vm->qmp, "query-migrate", NULL, -1, on_snap_reply, vm, &e);
    else if (vm->ph == PH_START && vm->snap_step == RS_POLL)
        sp_qmp_command(vm->qmp, "query-status", NULL, -1, on_restore_reply, vm, &e);
}

/* QEMU quit after the commit: the VM is released, its snapshot stays. */
static void suspend_finish(struct vm *vm)
{
    sp_qemu_t *d = vm->d;
    vm_disconnect(vm);
    cg_remove(d, vm->id);
    pool_origin_remove(vm);
    static const char *const names[] = {"qmp.sock", "agent.sock", "qemu.pid", "paused"};
    char p[PATH_MAX + 16];
    for (size_t i = 0; i < sizeof names / sizeof names[0]; i++) {
        vm_path(vm, names[i], p, sizeof p);
        unlink(p);
    }
    if (vm->tsnap_build != NULL) {
        tsnap_commit(vm);
    } else {
        sp_log(SP_LOG_INFO, "qemu", "vm suspended sandbox=%s ms=%llu", vm->id,
               (unsigned long long)(mono_ms() - vm->snap_start_ms));
    }
    vm_unlink(vm);
    complete_all(d, &vm->snap_w, NULL);
    complete_all(d, &vm->boot_w, NULL);
    vm_free(vm);
}

/* ---------- template snapshots ---------- */

static uint64_t fnv1a(uint64_t h, const char *s)
{
    for (; *s != '\0'; s++) {
        h ^= (unsigned char)*s;
        h *= 1099511628211ull;
    }
    h ^= 0xffu; /* separator: ("ab","c") and ("a","bc") differ */
    h *= 1099511628211ull;
    return h;
}

/* The snapshot key of a boot: a hash of everything the template's device state and RAM
 * depend on (format, QEMU binary, template build, base image, and the QEMU command line
 * this driver would run, per-VM paths and the host-measured tsc_early_khz left out: a
 * restored guest keeps the clock setup of the boot that made the snapshot). */
static int tsnap_key_for(const sp_qemu_t *d, const sp_tmplbuild_paths_t *tp, int cpu_count,
                         int memory_mb, char key[17])
{
    sp_bootargs_qemu_t q = {.qemu = d->qemu,
                            .kernel = tp->kernel,
                            .initramfs = tp->initramfs,
                            .disk = "D",
                            .agent_sock = "A",
                            .qmp_sock = "Q",
                            .console_log = "C",
                            .cpu_count = cpu_count,
                            .memory_mb = memory_mb,
                            .kvm = d->accel == 1,
                            .tsc_khz = 1};
    char **argv = sp_bootargs_qemu_argv(&q);
    if (argv == NULL)
        return -1;
    uint64_t h = 14695981039346656037ull;
    h = fnv1a(h, SP_QEMU_TSNAP_FORMAT);
    h = fnv1a(h, d->qemu_ident);
    h = fnv1a(h, tp->hash);
    h = fnv1a(h, tp->rootfs);
    for (int i = 0; argv[i] != NULL; i++)
        h = fnv1a(h, argv[i]);
    free(argv);
    sfmt(key, 17, "%016llx", (unsigned long long)h);
    return 0;
}

static int tsnap_key(const struct vm *vm, char key[17])
{
    return tsnap_key_for(vm->d, vm->tp, vm->cpu_count, vm->memory_mb, key);
}

/* A committed snapshot dir that matches key and memory size; checks sizes and the device
 * state's checksum (60 KB: cheap, and done once per driver and key). */
static bool tsnap_valid(const char *dir, const char *key, int memory_mb)
{
    char p[PATH_MAX + 48];
    sfmt(p, sizeof p, "%s/template-snapshot.json", dir);
    json_t *m = json_load_file(p, 0, NULL);
    if (m == NULL)
        return false;
    const char *fmt = json_string_value(json_object_get(m, "format"));
    const char *k = json_string_value(json_object_get(m, "key"));
    const char *sum = json_string_value(json_object_get(m, "devstate_sha256"));
    json_int_t dev_bytes = json_integer_value(json_object_get(m, "devstate_bytes"));
    bool ok = fmt != NULL && strcmp(fmt, SP_QEMU_TSNAP_FORMAT) == 0 && k != NULL &&
              strcmp(k, key) == 0 && sum != NULL;
    struct stat st;
    if (ok) {
        sfmt(p, sizeof p, "%s/mem.ram", dir);
        ok = stat(p, &st) == 0 && (uint64_t)st.st_size == (uint64_t)memory_mb << 20;
    }
    if (ok) {
        sfmt(p, sizeof p, "%s/disk.qcow2", dir);
        ok = stat(p, &st) == 0;
    }
    if (ok) {
        sfmt(p, sizeof p, "%s/snapshot/devstate", dir);
        char got[SP_TMPLBUILD_HASH_LEN + 1];
        sp_err_t e;
        ok = stat(p, &st) == 0 && st.st_size == (off_t)dev_bytes &&
             sp_tmplbuild_file_sha256(p, got, &e) == 0 && strcmp(got, sum) == 0;
    }
    json_decref(m);
    return ok;
}

/* ---------- template snapshot collection ---------- */

/* The backing file a qcow2 header names, into out[n]. false when none or unreadable. */
static bool qcow2_backing(const char *path, char *out, size_t n)
{
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0)
        return false;
    uint8_t h[20];
    bool ok = pread(fd, h, sizeof h, 0) == (ssize_t)sizeof h && memcmp(h, "QFI\xfb", 4) == 0;
    uint64_t off = 0;
    uint32_t len = 0;
    for (int i = 0; ok && i < 8; i++)
        off = off << 8 | h[8 + i];
    for (int i = 0; ok && i < 4; i++)
        len = len << 8 | h[16 + i];
    ok = ok && off != 0 && len != 0 && len < n && off < (1u << 20);
    ok = ok && pread(fd, out, len, (off_t)off) == (ssize_t)len;
    close(fd);
    if (ok)
        out[len] = '\0';
    return ok;
}

/* Paths sandboxes use, as found on disk and in memory. */
struct refs {
    char **v;
    size_t n, cap;
    bool oom; /* an entry was lost: the picture is incomplete */
};

static void refs_add(struct refs *r, const char *s)
{
    if (r->n == r->cap) {
        size_t cap = r->cap ? 2 * r->cap : 16;
        char **v = realloc(r->v, cap * sizeof(*v));
        if (v == NULL) {
            r->oom = true;
            return;
        }
        r->v = v;
        r->cap = cap;
    }
    if ((r->v[r->n] = strdup(s)) != NULL)
        r->n++;
    else
        r->oom = true;
}

/* dir itself or anything inside it is in use. */
static bool refs_has(const struct refs *r, const char *dir)
{
    size_t l = strlen(dir);
    for (size_t i = 0; i < r->n; i++)
        if (strncmp(r->v[i], dir, l) == 0 && (r->v[i][l] == '\0' || r->v[i][l] == '/'))
            return true;
    return false;
}

static void refs_free(struct refs *r)
{
    for (size_t i = 0; i < r->n; i++)
        free(r->v[i]);
    free(r->v);
    memset(r, 0, sizeof *r);
}

/* What every sandbox on this data dir holds of template snapshots: a clone maps the
 * snapshot's mem.ram until its first restore (vm.json "ram_src") and keeps the snapshot's
 * disk.qcow2 as its overlay's backing file for life (running, suspended or crashed alike).
 * Read from every VM dir on disk (other drivers' VMs included) and from boots in memory that
 * have not written theirs yet. false when the picture may be incomplete (out of memory,
 * unreadable directory): then nothing may be removed. */
static bool tsnap_refs(sp_qemu_t *d, struct refs *r)
{
    bool ok = true;
    DIR *dir = opendir(d->vms_dir);
    if (dir == NULL)
        ok = errno == ENOENT;
    struct dirent *de;
    while (dir != NULL && (de = readdir(dir)) != NULL) {
        if (de->d_name[0] == '.')
            continue; /* ., .., builders (their disk backs onto the template's base) */
        char p[PATH_MAX + 80], b[PATH_MAX];
        sfmt(p, sizeof p, "%s/%s/disk.qcow2", d->vms_dir, de->d_name);
        if (qcow2_backing(p, b, sizeof b))
            refs_add(r, b);
        sfmt(p, sizeof p, "%s/%s/vm.json", d->vms_dir, de->d_name);
        json_t *o = json_load_file(p, 0, NULL);
        const char *src = json_string_value(json_object_get(o, "ram_src"));
        if (src != NULL)
            refs_add(r, src);
        json_decref(o);
    }
    if (dir != NULL)
        closedir(dir);
    for (struct vm *v = d->vms; v != NULL; v = v->next)
        if (v->clone_src != NULL)
            refs_add(r, v->clone_src);
    return ok && !r->oom;
}

/* Why a committed template snapshot dir is of no further use (NULL: it is current). cur is
 * the template's current build, NULL when dir belongs to an older one. */
static const char *tsnap_stale(const sp_qemu_t *d, const sp_tmplbuild_paths_t *cur,
                               const char *name, const char *path)
{
    if (cur == NULL)
        return "the template build is no longer current";
    char accel[4], key[17], want[17];
    int mem = 0, cpus = 0, end = 0;
    if (sscanf(name, "snapshot-%3[a-z]-%dM-%dc-%16[0-9a-f]%n", accel, &mem, &cpus, key, &end) !=
            4 ||
        name[end] != '\0' || mem <= 0 || cpus <= 0)
        return "not a template snapshot name (moved aside or left over)";
    if (strcmp(accel, d->accel == 1 ? "kvm" : "tcg") != 0)
        return "made under another accelerator";
    if (tsnap_key_for(d, cur, cpus, mem, want) < 0)
        return NULL; /* cannot tell: keep it */
    if (strcmp(key, want) != 0)
        return "superseded (QEMU binary or boot arguments changed)";
    if (!tsnap_valid(path, key, mem))
        return "damaged";
    return NULL;
}

/* Removes the template snapshots nobody will clone again (tsnap_stale) that no sandbox
 * uses (tsnap_refs); those in use go on a later pass once their last clone is gone. Runs at
 * driver start (once the accelerator is known: keys depend on it) and after each snapshot
 * commit. Blocks on a readdir of the VM and template dirs and one 60 KB checksum per
 * snapshot: milliseconds. */
static void tsnap_gc(sp_qemu_t *d)
{
    if (d->accel < 0)
        return;
    d->gc_done = true;
    struct refs r = {0};
    if (!tsnap_refs(d, &r)) {
        sp_log(SP_LOG_WARN, "qemu", "template snapshots not collected: cannot list the VMs");
        refs_free(&r);
        return;
    }
    char tdir[PATH_MAX];
    sfmt(tdir, sizeof tdir, "%s/templates", d->data_dir);
    DIR *td = opendir(tdir);
    int removed = 0, kept = 0;
    struct dirent *te;
    while (td != NULL && (te = readdir(td)) != NULL) {
        if (te->d_name[0] == '.')
            continue;
        sp_tmplbuild_paths_t cur;
        bool have = sp_tmplbuild_current(d->data_dir, te->d_name, &cur, NULL) == 0;
        char tpath[PATH_MAX];
        sfmt(tpath, sizeof tpath, "%s/%s", tdir, te->d_name);
        DIR *hd = opendir(tpath);
        struct dirent *he;
        while (hd != NULL && (he = readdir(hd)) != NULL) {
            if (strlen(he->d_name) != SP_TMPLBUILD_HASH_LEN)
                continue;
            bool is_cur = have && strcmp(he->d_name, cur.hash) == 0;
            char hpath[PATH_MAX];
            sfmt(hpath, sizeof hpath, "%s/%s", tpath, he->d_name);
            DIR *sd = opendir(hpath);
            struct dirent *se;
            while (sd != NULL && (se = readdir(sd)) != NULL) {
                if (strncmp(se->d_name, "snapshot-", 9) != 0)
                    continue;
                char spath[PATH_MAX];
                sfmt(spath, sizeof spath, "%s/%s", hpath, se->d_name);
                const char *why = tsnap_stale(d, is_cur ? &cur : NULL, se->d_name, spath);
                if (why == NULL)
                    continue;
                if (refs_has(&r, spath)) {
                    sp_log(SP_LOG_DEBUG, "qemu", "template snapshot kept: in use dir=%s", spath);
                    kept++;
                    continue;
                }
                for (struct tsnap *t = d->tsnaps; t != NULL; t = t->next) {
                    if (strcmp(t->dir, spath) == 0 && t->state == TS_READY) {
                        t->state = TS_FAILED; /* looked at again by the next boot */
                        t->failed_ms = 0;
                    }
                }
                sp_log(SP_LOG_INFO, "qemu", "removing template snapshot dir=%s reason=\"%s\"",
                       spath, why);
                rm_rf(spath);
                removed++;
            }
            if (sd != NULL)
                closedir(sd);
        }
        if (hd != NULL)
            closedir(hd);
    }
    if (td != NULL)
        closedir(td);
    refs_free(&r);
    if (removed > 0 || kept > 0)
        sp_log(SP_LOG_INFO, "qemu", "template snapshots collected removed=%d kept_in_use=%d",
               removed, kept);
}

/* A builder work dir .tsnap-<key>-<pid> of a live driver in another process (spaced serve
 * while `spaced template build` runs, say): not ours to kill or remove. */
static bool tsnap_tmp_foreign(const char *name)
{
    const char *dash = strrchr(name, '-');
    long pid = dash != NULL ? strtol(dash + 1, NULL, 10) : 0;
    if (pid <= 1 || pid > INT_MAX || pid == (long)getpid())
        return false;
    return kill((pid_t)pid, 0) == 0 || errno == EPERM;
}

/* Boots waiting for t go back through on_kick, which sends them on by t's new state. */
static void tsnap_wake(sp_qemu_t *d, struct tsnap *t)
{
    for (struct vm *v = d->vms; v != NULL; v = v->next)
        if (v->ph == PH_WAIT_TSNAP && v->tsnap_wait == t)
            v->ph = PH_WAIT_ACCEL;
    kick(d);
}

/* Kills a builder QEMU an earlier driver left in a work dir of this snapshot, removes the
 * dirs. Quick: a readdir of the VM directory. */
static void tsnap_clean_tmp(sp_qemu_t *d, const struct tsnap *t)
{
    char base[64];
    const char *parent = d->vms_dir;
    sfmt(base, sizeof base, ".tsnap-%s-", t->key);
    DIR *dir = opendir(parent);
    if (dir == NULL)
        return;
    struct dirent *de;
    while ((de = readdir(dir)) != NULL) {
        if (strncmp(de->d_name, base, strlen(base)) != 0 || tsnap_tmp_foreign(de->d_name))
            continue;
        char p[PATH_MAX];
        sfmt(p, sizeof p, "%s/%s", parent, de->d_name);
        pid_t pid = live_qemu_pid(p);
        if (pid > 0) {
            sp_log(SP_LOG_INFO, "qemu", "killing a stale template snapshot builder pid=%d",
                   (int)pid);
            kill(-pid, SIGKILL);
            kill(pid, SIGKILL);
        }
        rm_rf(p);
    }
    closedir(dir);
}

/* Starts a builder VM for t from the boot vm's template and size. 0 when started. */
static int tsnap_build_start(sp_qemu_t *d, struct tsnap *t, const struct vm *vm)
{
    tsnap_clean_tmp(d, t);
    char id[SP_QEMU_ID_MAX + 1];
    sfmt(id, sizeof id, "tsnap:%s", t->key); /* ':' is not a valid sandbox id: no API reaches it */
    sp_tmplbuild_paths_t *tp = malloc(sizeof(*tp));
    struct vm *b = tp != NULL ? vm_new(d, id) : NULL;
    if (b == NULL) {
        free(tp);
        return -1;
    }
    *tp = *vm->tp;
    b->tp = tp;
    sfmt(b->dir, sizeof b->dir, "%s", t->tmp);
    sfmt(b->template_name, sizeof b->template_name, "%s", vm->template_name);
    b->cpu_count = vm->cpu_count;
    b->memory_mb = vm->memory_mb;
    b->disk_total = vm->disk_total;
    b->hostname = strdup("template");
    b->tsnap_build = t;
    b->cold = true;
    b->ph = PH_WAIT_ACCEL;
    b->boot_start_ms = mono_ms();
    t->start_ms = b->boot_start_ms;
    t->state = TS_BUILDING;
    sp_timer_start(&b->boot_timer, d->boot_timeout_ms);
    sp_log(SP_LOG_INFO, "qemu",
           "building template snapshot template=%s key=%s memory_mb=%d cpus=%d accel=%s",
           vm->template_name, t->key, vm->memory_mb, vm->cpu_count, d->accel == 1 ? "kvm" : "tcg");
    kick(d);
    return 0;
}

/* The snapshot record for a boot, found, adopted from disk, or being built. NULL (logged)
 * when none can be had: the boot goes cold. */
static struct tsnap *tsnap_for(struct vm *vm)
{
    sp_qemu_t *d = vm->d;
    char key[17];
    if (tsnap_key(vm, key) < 0) {
        sp_log(SP_LOG_WARN, "qemu", "cold boot sandbox=%s reason=\"no snapshot key (memory)\"",
               vm->id);
        return NULL;
    }
    struct tsnap *t;
    for (t = d->tsnaps; t != NULL; t = t->next)
        if (strcmp(t->key, key) == 0)
            break;
    if (t != NULL && t->state == TS_READY) {
        char p[PATH_MAX + 48];
        sfmt(p, sizeof p, "%s/template-snapshot.json", t->dir);
        if (file_exists(p))
            return t;
        t->state = TS_FAILED; /* removed under us: look again */
        t->failed_ms = 0;
    }
    if (t != NULL &&
        (t->state == TS_BUILDING || (t->state == TS_FAILED && t->failed_ms != 0 &&
                                     mono_ms() - t->failed_ms < SP_QEMU_TSNAP_RETRY_MS)))
        return t;
    if (t == NULL) {
        t = calloc(1, sizeof(*t));
        if (t == NULL) {
            sp_log(SP_LOG_WARN, "qemu", "cold boot sandbox=%s reason=\"out of memory\"", vm->id);
            return NULL;
        }
        sfmt(t->key, sizeof t->key, "%s", key);
        sfmt(t->dir, sizeof t->dir, "%s/snapshot-%s-%dM-%dc-%s", vm->tp->build_dir,
             d->accel == 1 ? "kvm" : "tcg", vm->memory_mb, vm->cpu_count, key);
        sfmt(t->tmp, sizeof t->tmp, "%s/.tsnap-%s-%d", d->vms_dir, key, (int)getpid());
        sfmt(t->template_name, sizeof t->template_name, "%s", vm->template_name);
        t->next = d->tsnaps;
        d->tsnaps = t;
    }
    if (tsnap_valid(t->dir, t->key, vm->memory_mb)) {
        t->state = TS_READY;
        sp_log(SP_LOG_INFO, "qemu", "template snapshot found template=%s key=%s", t->template_name,
               t->key);
        return t;
    }
    struct stat st;
    if (stat(t->dir, &st) == 0) {
        /* Damaged. Clones' overlays may have its disk.qcow2 as their backing file (by this
         * path: moving it aside would put the rebuilt one under them), so it goes only when
         * no sandbox uses it; until then boots cold-boot. */
        struct refs r = {0};
        bool used = !tsnap_refs(d, &r) || refs_has(&r, t->dir);
        refs_free(&r);
        if (used) {
            sp_log(SP_LOG_WARN, "qemu",
                   "template snapshot is damaged and still used by sandboxes: kept; boots "
                   "cold-boot until it is unused dir=%s",
                   t->dir);
            t->state = TS_FAILED;
            t->failed_ms = mono_ms();
            sfmt(t->why, sizeof t->why, "the template snapshot is damaged and still in use");
            return t;
        }
        sp_log(SP_LOG_WARN, "qemu", "template snapshot is damaged: removed, rebuilding dir=%s",
               t->dir);
        rm_rf(t->dir);
    }
    if (tsnap_build_start(d, t, vm) < 0) {
        t->state = TS_FAILED;
        t->failed_ms = mono_ms();
        sfmt(t->why, sizeof t->why, "cannot start the template snapshot builder");
    }
    return t;
}

/* The builder is gone before its snapshot committed: boots waiting for it go cold. */
static void tsnap_failed(struct vm *vm, const char *why)
{
    struct tsnap *t = vm->tsnap_build;
    vm->tsnap_build = NULL;
    t->state = TS_FAILED;
    t->failed_ms = mono_ms();
    sfmt(t->why, sizeof t->why, "%s", why);
    sp_log(SP_LOG_WARN, "qemu",
           "template snapshot failed template=%s key=%s err=\"%s\" (boots cold-boot; retried "
           "after %u s; builder logs in %s)",
           t->template_name, t->key, why, SP_QEMU_TSNAP_RETRY_MS / 1000u, t->tmp);
    tsnap_wake(vm->d, t);
}

static void tsnap_freeze(struct vm *vm)
{
    vm->ph = PH_SUSPENDING;
    vm->snap_was_paused = false;
    vm->snap_start_ms = mono_ms();
    vm->snap_step = SN_STOP;
    snap_send(vm, "stop", NULL, -1);
}

static void on_settle_frame(sp_agentstream_t *s, uint16_t type, uint16_t flags,
                            const uint8_t *payload, size_t len, void *arg)
{
    struct vm *vm = arg;
    if (type == SP_AP_T_PROC_STDOUT || type == SP_AP_T_PROC_STDERR)
        sp_agentstream_grant(s, (uint32_t)len);
    if (!(flags & SP_AP_F_END))
        return;
    vm->settle = NULL; /* freed by agentconn after this returns */
    if (vm->ph == PH_UP)
        tsnap_freeze(vm);
}

static void on_settle_error(sp_agentstream_t *s, const sp_err_t *err, void *arg)
{
    struct vm *vm = arg;
    vm->settle = NULL;
    sp_log(SP_LOG_DEBUG, "qemu", "template settle failed sandbox=%s err=%s", vm->id, err->msg);
    if (vm->ph == PH_UP)
        tsnap_freeze(vm); /* the flush at stop keeps the disk consistent anyway */
}

static const sp_agentstream_cbs_t settle_cbs = {on_settle_frame, on_settle_error, NULL};

/* Builder up: flush the guest's dirty page cache (so clones do not each write it back into
 * their own overlays), then freeze. The boot timer bounds this too. */
static void tsnap_settle(struct vm *vm)
{
    sp_timer_start(&vm->boot_timer, vm->d->boot_timeout_ms);
    uint8_t buf[64];
    sp_ap_writer_t w;
    sp_ap_writer_init(&w, buf, sizeof buf);
    sp_ap_put_str(&w, SP_AP_K_CMD, "sync");
    sp_ap_put_u32(&w, SP_AP_K_STDIN, 0);
    sp_err_t e;
    vm->settle = w.overflow ? NULL
                            : sp_agentconn_open(vm->agent, SP_AP_T_PROC_START, buf, w.len,
                                                &settle_cbs, vm, &e);
    if (vm->settle == NULL)
        tsnap_freeze(vm);
}

/* The builder's warmup ended: settle and freeze on exit 0, else give up on this snapshot
 * (vm_finish -> tsnap_failed; boots cold-boot, and a cold boot never runs the warmup). */
static void on_warmup_done(void *arg, const sp_exec_result_t *res, const sp_err_t *err)
{
    struct vm *vm = arg;
    vm->warm = NULL;
    if (vm->ph != PH_UP || vm->tsnap_build == NULL)
        return;
    struct tsnap *t = vm->tsnap_build;
    unsigned long long ms = (unsigned long long)(mono_ms() - vm->warm_start_ms);
    if (err == NULL && res->exited && res->exit_code == 0) {
        sp_log(SP_LOG_INFO, "qemu", "template warmup done template=%s key=%s ms=%llu",
               t->template_name, t->key, ms);
        tsnap_settle(vm);
        return;
    }
    char why[160], tail[256];
    tail[0] = '\0';
    if (res != NULL) { /* the end of stderr (else stdout), printable, for the log */
        const uint8_t *p = res->err_len > 0 ? res->err : res->out;
        size_t n = res->err_len > 0 ? res->err_len : res->out_len;
        size_t k = n < sizeof tail - 1 ? n : sizeof tail - 1;
        for (size_t i = 0; i < k; i++) {
            uint8_t c = p[n - k + i];
            tail[i] = c == '\n' ? '|' : (c < 0x20 || c > 0x7e) ? '.' : (char)c;
        }
        tail[k] = '\0';
    }
    if (err != NULL)
        sfmt(why, sizeof why, "the template's warmup failed: %s", err->msg);
    else if (res->timed_out)
        sfmt(why, sizeof why, "the template's warmup did not finish within %u s",
             SP_QEMU_WARMUP_MS / 1000u);
    else if (!res->exited)
        sfmt(why, sizeof why, "the template's warmup was killed by signal %d", res->signal);
    else
        sfmt(why, sizeof why, "the template's warmup exited with status %d", res->exit_code);
    sp_log(SP_LOG_WARN, "qemu",
           "template warmup failed template=%s key=%s ms=%llu err=\"%s\" output_tail=\"%s\"",
           t->template_name, t->key, ms, why, tail);
    vm->boot_failed = true;
    sp_err_set(&vm->boot_err, SP_ERUNTIME, "%s", why);
    vm->keep_logs = true;
    vm_stop(vm, false);
}

/* Builder up: run the template's warmup command (as root, through the agent) if it has one,
 * then settle. Whatever it leaves running is in the snapshot. */
static void tsnap_warmup(struct vm *vm)
{
    if (!vm->tp->warmup) {
        tsnap_settle(vm);
        return;
    }
    json_t *m = json_load_file(vm->tp->manifest, 0, NULL);
    json_t *wu = json_object_get(m, "warmup");
    size_t n = json_array_size(wu);
    const char *argv[SP_TMPLBUILD_WARMUP_MAX];
    bool ok = n >= 1 && n <= SP_TMPLBUILD_WARMUP_MAX;
    for (size_t i = 0; ok && i < n; i++)
        ok = (argv[i] = json_string_value(json_array_get(wu, i))) != NULL;
    sp_err_t e;
    if (ok) {
        sp_exec_cmd_t cmd = {.argv = argv, .argc = n, .timeout_ms = SP_QEMU_WARMUP_MS};
        /* the boot timer backs the command's own timeout (and its kill grace) */
        sp_timer_start(&vm->boot_timer, SP_QEMU_WARMUP_MS + SP_EXEC_KILL_GRACE_MS + 30000u);
        vm->warm_start_ms = mono_ms();
        vm->warm =
            sp_exec_run(vm->d->base.loop, vm->agent, &cmd, 64u << 10, on_warmup_done, vm, &e);
        ok = vm->warm != NULL;
        if (ok)
            sp_log(SP_LOG_INFO, "qemu", "template warmup started template=%s key=%s argv0=%s",
                   vm->template_name, vm->tsnap_build->key, argv[0]);
    } else {
        sp_err_set(&e, SP_EINTERNAL, "the template manifest's warmup is unreadable");
    }
    json_decref(m);
    if (!ok) {
        sp_log(SP_LOG_WARN, "qemu", "template warmup not started template=%s err=%s",
               vm->template_name, e.msg);
        vm->boot_failed = true;
        sp_err_set(&vm->boot_err, SP_ERUNTIME, "the template's warmup did not start: %s", e.msg);
        vm->keep_logs = true;
        vm_stop(vm, false);
    }
}

/* The builder's QEMU quit after its device state, RAM file and overlay were made durable
 * (snap_commit): freeze the files and commit the directory by rename. */
static void tsnap_commit(struct vm *vm)
{
    struct tsnap *t = vm->tsnap_build;
    vm->tsnap_build = NULL;
    char p[PATH_MAX + 48], sum[SP_TMPLBUILD_HASH_LEN + 1];
    struct stat sr, sd, sk;
    sp_err_t e;
    const char *why = NULL;
    vm_path(vm, "snapshot/manifest.json", p, sizeof p);
    unlink(p); /* a per-VM suspend manifest means nothing here */
    vm_path(vm, "mem.ram", p, sizeof p);
    if (stat(p, &sr) < 0 || chmod(p, 0444) < 0)
        why = "RAM file";
    vm_path(vm, "disk.qcow2", p, sizeof p);
    if (why == NULL && (stat(p, &sk) < 0 || chmod(p, 0444) < 0))
        why = "overlay";
    vm_path(vm, "snapshot/devstate", p, sizeof p);
    if (why == NULL &&
        (stat(p, &sd) < 0 || chmod(p, 0444) < 0 || sp_tmplbuild_file_sha256(p, sum, &e) < 0))
        why = "device state";
    json_t *o = NULL;
    if (why == NULL) {
        struct timespec ts;
        clock_gettime(CLOCK_REALTIME, &ts);
        o = json_pack("{s:s, s:s, s:s, s:s, s:s, s:i, s:i, s:s, s:I, s:I, s:I, s:I, s:s, s:s, "
                      "s:I, s:I}",
                      "format", SP_QEMU_TSNAP_FORMAT, "key", t->key, "template", t->template_name,
                      "template_hash", vm->tp->hash, "accel", vm->d->accel == 1 ? "kvm" : "tcg",
                      "memory_mb", vm->memory_mb, "cpu_count", vm->cpu_count, "qemu",
                      vm->d->qemu_ident, "ram_bytes", (json_int_t)sr.st_size, "ram_alloc_bytes",
                      (json_int_t)sr.st_blocks * 512, "disk_alloc_bytes",
                      (json_int_t)sk.st_blocks * 512, "devstate_bytes", (json_int_t)sd.st_size,
                      "devstate_sha256", sum, "devstate", "snapshot/devstate", "created_at",
                      (json_int_t)ts.tv_sec, "build_ms", (json_int_t)(mono_ms() - t->start_ms));
        char *js = o != NULL ? json_dumps(o, JSON_COMPACT | JSON_SORT_KEYS) : NULL;
        vm_path(vm, "template-snapshot.json", p, sizeof p);
        int fd = js != NULL ? open(p, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0444) : -1;
        bool ok = fd >= 0 && write(fd, js, strlen(js)) == (ssize_t)strlen(js) && fsync(fd) == 0;
        if (fd >= 0)
            close(fd);
        free(js);
        if (!ok)
            why = "manifest";
    }
    if (why == NULL) {
        fsync_path(vm->dir, O_RDONLY | O_DIRECTORY);
        if (rename(vm->dir, t->dir) < 0) {
            /* another spaced on this data dir committed the same key first: use theirs */
            rm_rf(vm->dir);
            if (!tsnap_valid(t->dir, t->key, vm->memory_mb))
                why = "commit";
        } else {
            sfmt(p, sizeof p, "%s", t->dir);
            char *slash = strrchr(p, '/');
            if (slash != NULL) {
                *slash = '\0';
                fsync_path(p, O_RDONLY | O_DIRECTORY);
            }
        }
    }
    sfmt(vm->dir, sizeof vm->dir, "%s", t->dir); /* vm_free must not look at the work dir */
    if (why != NULL) {
        t->state = TS_FAILED;
        t->failed_ms = mono_ms();
        sfmt(t->why, sizeof t->why, "cannot commit the template snapshot (%s)", why);
        sp_log(SP_LOG_WARN, "qemu", "template snapshot failed template=%s key=%s err=\"%s: %s\"",
               t->template_name, t->key, why, strerror(errno));
    } else {
        t->state = TS_READY;
        sp_log(SP_LOG_INFO, "qemu",
               "template snapshot ready template=%s key=%s ms=%llu ram_alloc_bytes=%lld "
               "devstate_bytes=%lld",
               t->template_name, t->key, (unsigned long long)(mono_ms() - t->start_ms),
               (long long)sr.st_blocks * 512, (long long)sd.st_size);
    }
    json_decref(o);
    if (why == NULL)
        tsnap_gc(vm->d); /* it may supersede others */
    tsnap_wake(vm->d, t);
}

/* A template snapshot request (sp_qemu_template_snapshot) once the accelerator is known: it
 * waits in PH_WAIT_TSNAP while its snapshot is built and is answered (and freed) once the
 * snapshot is ready or failed. */
static void tsnap_req_step(struct vm *vm)
{
    sp_qemu_t *d = vm->d;
    struct tsnap *t = d->cold_only ? NULL : tsnap_for(vm);
    if (t != NULL && t->state == TS_BUILDING) {
        vm->ph = PH_WAIT_TSNAP;
        vm->tsnap_wait = t;
        if (vm->req_info != NULL)
            vm->req_info->built = 1;
        return;
    }
    sp_err_t e;
    bool ok = t != NULL && t->state == TS_READY;
    if (ok && vm->req_info != NULL) {
        sfmt(vm->req_info->dir, sizeof vm->req_info->dir, "%s", t->dir);
        sfmt(vm->req_info->key, sizeof vm->req_info->key, "%s", t->key);
    }
    if (d->cold_only)
        sp_err_set(&e, SP_ECONFLICT, "template snapshots are off (cold boot configured)");
    else if (t == NULL)
        sp_err_set(&e, SP_ERUNTIME, "no template snapshot can be made (see the log)");
    else if (!ok)
        sp_err_set(&e, SP_ERUNTIME, "%s",
                   t->why[0] != '\0' ? t->why : "the template snapshot failed (see the log)");
    complete_all(d, &vm->boot_w, ok ? NULL : &e);
    vm_unlink(vm);
    vm_free(vm);
}

/* Where a boot goes once the accelerator is known: own snapshot, cold, or clone. */
static void boot_begin(struct vm *vm)
{
    sp_qemu_t *d = vm->d;
    if (vm->tsnap_req) {
        tsnap_req_step(vm);
        return;
    }
    if (vm->restoring) {
        vm->ph = PH_DISK; /* the overlay is already there */
        start_qemu(vm);
        return;
    }
    if (vm->cold || d->cold_only) {
        start_disk(vm);
        return;
    }
    struct tsnap *t = tsnap_for(vm);
    if (vm->pooled && (t == NULL || t->state == TS_FAILED)) {
        sp_log(SP_LOG_INFO, "qemu", "spare clone not made key=%s reason=\"no template snapshot\"",
               vm->pool_key);
        vm->boot_failed = true; /* retried later */
        vm_stop(vm, false);
        return;
    }
    if (t == NULL) {
        vm->cold = true;
        start_disk(vm);
        return;
    }
    if (!vm->pooled && d->pool_size > 0)
        pool_note(d, t->key, vm); /* spares of this size from now on */
    switch (t->state) {
    case TS_READY:
        vm->clone_src = strdup(t->dir);
        if (vm->clone_src == NULL) {
            vm->cold = true;
            start_disk(vm);
            return;
        }
        vm->tsnap_wait = t;
        vm->clone_boot = true;
        vm->restoring = true; /* start_qemu: -incoming defer; on_qmp_ready: restore_begin */
        start_disk(vm);
        return;
    case TS_BUILDING:
        vm->ph = PH_WAIT_TSNAP;
        vm->tsnap_wait = t;
        return;
    default:
        sp_log(SP_LOG_INFO, "qemu",
               "cold boot sandbox=%s reason=\"template snapshot %s failed recently\"", vm->id,
               t->key);
        vm->cold = true;
        start_disk(vm);
        return;
    }
}

static int q_snapshot(sp_driver_t *base, const char *id, sp_driver_cb cb, void *arg, sp_err_t *err)
{
    sp_qemu_t *d = (sp_qemu_t *)base;
    struct vm *vm = valid_id(id) ? vm_find(d, id) : NULL;
    if (vm == NULL && valid_id(id)) {
        char vdir[PATH_MAX];
        sfmt(vdir, sizeof vdir, "%s/%s", d->vms_dir, id);
        if (live_vm_pid(d, id, vdir) == 0 && snapshot_committed(vdir)) {
            if (complete(d, cb, arg, NULL) < 0) /* already suspended */
                return sp_err_set(err, SP_EINTERNAL, "out of memory");
            return 0;
        }
    }
    if (vm != NULL && vm->ph == PH_SUSPENDING)
        return add_waiter(&vm->snap_w, cb, arg, err);
    vm = running_vm(d, id, err);
    if (vm == NULL)
        return -1;
    if (add_waiter(&vm->snap_w, cb, arg, err) < 0)
        return -1;
    vm->ph = PH_SUSPENDING;
    vm->snap_was_paused = vm->paused;
    vm->snap_start_ms = mono_ms();
    char man[PATH_MAX + 32];
    snap_path(vm, "manifest.json", man, sizeof man);
    unlink(man); /* an older snapshot is stale once the VM has run */
    vm->snap_step = SN_STOP;
    snap_send(vm, "stop", NULL, -1); /* stop on a paused VM is a no-op */
    return 0;
}

static int q_restore(sp_driver_t *base, const sp_vm_spec_t *spec, sp_driver_cb cb, void *arg,
                     sp_err_t *err)
{
    sp_qemu_t *d = (sp_qemu_t *)base;
    if (spec == NULL || !valid_id(spec->sandbox_id))
        return sp_err_set(err, SP_EINVAL, "invalid sandbox id");
    struct vm *vm = vm_find(d, spec->sandbox_id);
    char vdir[PATH_MAX];
    sfmt(vdir, sizeof vdir, "%s/%s", d->vms_dir, spec->sandbox_id);
    if (vm == NULL) {
        pid_t pid = live_vm_pid(d, spec->sandbox_id, vdir);
        if (pid > 0)
            vm = vm_adopt(d, spec->sandbox_id, pid);
    }
    if (vm != NULL) {
        if (vm->ph == PH_STOPPING)
            return sp_err_set(err, SP_ECONFLICT, "sandbox is being deleted");
        if (vm->ph == PH_SUSPENDING)
            return sp_err_set(err, SP_ECONFLICT, "sandbox is being suspended");
        if (vm->ph == PH_UP) {
            if (complete(d, cb, arg, NULL) < 0)
                return sp_err_set(err, SP_EINTERNAL, "out of memory");
            return 0;
        }
        return add_waiter(&vm->boot_w, cb, arg, err);
    }
    if (!snapshot_committed(vdir))
        return sp_err_set(err, SP_ECONFLICT, "sandbox has no snapshot to restore");
    if (d->no_adopt)
        return sp_err_set(err, SP_ECONFLICT, "this driver only builds template snapshots");
    char p[PATH_MAX + 32];
    sfmt(p, sizeof p, "%s/snapshot/manifest.json", vdir);
    json_t *man = json_load_file(p, 0, NULL);
    sfmt(p, sizeof p, "%s/vm.json", vdir);
    json_t *vj = json_load_file(p, 0, NULL);
    const char *kernel = json_string_value(json_object_get(vj, "kernel"));
    const char *initrd = json_string_value(json_object_get(vj, "initramfs"));
    const char *accel = json_string_value(json_object_get(man, "accel"));
    int mem = (int)json_integer_value(json_object_get(man, "memory_mb"));
    int cpus = (int)json_integer_value(json_object_get(man, "cpu_count"));
    const char *ram = json_string_value(json_object_get(man, "ram"));
    bool stream = ram != NULL && strcmp(ram, "stream") == 0;
    bool delta = ram != NULL && strcmp(ram, "delta") == 0;
    /* a delta is loaded over the template's RAM file, which must still be there as it was */
    const char *base_dir = json_string_value(json_object_get(vj, "ram_src"));
    const char *man_base = json_string_value(json_object_get(man, "ram_base"));
    char base_ram[PATH_MAX + 16];
    struct stat bst;
    bool base_ok = delta && base_dir != NULL && man_base != NULL &&
                   strcmp(base_dir, man_base) == 0 &&
                   sfmt(base_ram, sizeof base_ram, "%s/mem.ram", base_dir) > 0 &&
                   stat(base_ram, &bst) == 0 && (uint64_t)bst.st_size == (uint64_t)mem << 20;
    sp_tmplbuild_paths_t *tp = calloc(1, sizeof(*tp));
    int rc = 0;
    if (tp == NULL) {
        rc = sp_err_set(err, SP_EINTERNAL, "out of memory");
    } else if (delta && !base_ok && json_is_object(man) && mem > 0) {
        sp_log(SP_LOG_WARN, "qemu", "wake refused sandbox=%s reason=\"template RAM %s unusable\"",
               spec->sandbox_id, base_dir != NULL ? base_dir : "(none)");
        rc = sp_err_set(err, SP_ERUNTIME,
                        "cannot wake: the template snapshot this sandbox's memory is based on is "
                        "gone or changed; the snapshot is kept");
    } else if (!json_is_object(man) || mem <= 0 || cpus < 0) {
        sp_log(SP_LOG_WARN, "qemu", "snapshot manifest unreadable sandbox=%s", spec->sandbox_id);
        rc = sp_err_set(err, SP_ERUNTIME,
                        "cannot wake: the snapshot manifest is damaged; the snapshot is kept");
    } else if (vj == NULL || kernel == NULL || initrd == NULL || !file_exists(kernel) ||
               !file_exists(initrd)) {
        sp_log(SP_LOG_WARN, "qemu", "snapshot unusable sandbox=%s (vm.json or images)",
               spec->sandbox_id);
        rc = sp_err_set(err, SP_ERUNTIME, "snapshot is incomplete or its images are gone");
    } else if (snap_check(vdir, man, mem, stream || delta, err) < 0) {
        sp_log(SP_LOG_WARN, "qemu", "wake refused sandbox=%s reason=\"%s\"", spec->sandbox_id,
               err != NULL ? err->msg : "");
        rc = -1;
    } else if (accel != NULL && d->accel >= 0 && strcmp(accel, d->accel == 1 ? "kvm" : "tcg")) {
        rc = sp_err_set(err, SP_ERUNTIME, "snapshot was taken under %s", accel);
    } else {
        sfmt(tp->kernel, sizeof tp->kernel, "%s", kernel);
        sfmt(tp->initramfs, sizeof tp->initramfs, "%s", initrd);
        const char *tn = json_string_value(json_object_get(vj, "template"));
        vm = vm_new(d, spec->sandbox_id);
        if (vm == NULL || add_waiter(&vm->boot_w, cb, arg, err) < 0) {
            if (vm != NULL) {
                vm_unlink(vm);
                vm_free(vm);
            } else {
                free(tp);
            }
            tp = NULL;
            rc = sp_err_set(err, SP_EINTERNAL, "out of memory");
        } else {
            vm->tp = tp;
            tp = NULL;
            sfmt(vm->template_name, sizeof vm->template_name, "%s", tn ? tn : "");
            vm->cpu_count = cpus > 0 ? cpus : 1;
            vm->memory_mb = mem;
            vm->disk_total = (uint64_t)json_integer_value(json_object_get(vj, "disk_bytes"));
            vm->hostname =
                strdup(spec->hostname != NULL && *spec->hostname ? spec->hostname : "space");
            vm->env_json = spec->env_json != NULL ? strdup(spec->env_json) : NULL;
            vm->restoring = true;
            vm->restore_stream = stream;
            vm->restore_delta = delta;
            if (delta)
                vm->clone_src = strdup(base_dir); /* NULL: start_qemu fails the restore */
            vm->ph = PH_WAIT_ACCEL;
            vm->boot_start_ms = mono_ms();
            sp_timer_start(&vm->boot_timer, d->boot_timeout_ms);
            restore_verify(vm, man);
            kick(d);
        }
    }
    free(tp);
    json_decref(man);
    json_decref(vj);
    return rc;
}

static int q_destroy(sp_driver_t *base, const char *id, sp_driver_cb cb, void *arg, sp_err_t *err)
{
    sp_qemu_t *d = (sp_qemu_t *)base;
    if (!valid_id(id))
        return sp_err_set(err, SP_EINVAL, "invalid sandbox id");
    struct vm *vm = vm_find(d, id);
    char vdir[PATH_MAX];
    sfmt(vdir, sizeof vdir, "%s/%s", d->vms_dir, id);
    if (vm == NULL) {
        pid_t pid = live_vm_pid(d, id, vdir);
        if (pid > 0)
            vm = vm_adopt(d, id, pid);
        if (vm == NULL && pid > 0) { /* could not watch it: kill it the blunt way */
            kill(-pid, SIGKILL);
            kill(pid, SIGKILL);
        }
    }
    if (vm == NULL) {
        cg_remove(d, id);
        rm_rf(vdir);
        if (complete(d, cb, arg, NULL) < 0)
            return sp_err_set(err, SP_EINTERNAL, "out of memory");
        return 0;
    }
    if (add_waiter(&vm->destroy_w, cb, arg, err) < 0)
        return -1;
    if (vm->ph != PH_STOPPING) {
        vm->keep_logs = false;
        /* vm_stop may finish at once (nothing running): that only queues completions. */
        vm_stop(vm, vm->ph == PH_UP);
    }
    return 0;
}

static sp_vm_state_t q_probe(sp_driver_t *base, const char *id)
{
    sp_qemu_t *d = (sp_qemu_t *)base;
    if (!valid_id(id))
        return SP_VM_ABSENT;
    struct vm *vm = vm_find(d, id);
    if (vm != NULL) {
        if (vm->ph == PH_STOPPING)
            return SP_VM_ABSENT;
        return vm->paused ? SP_VM_PAUSED : SP_VM_RUNNING;
    }
    char vdir[PATH_MAX];
    sfmt(vdir, sizeof vdir, "%s/%s", d->vms_dir, id);
    pid_t pid = live_vm_pid(d, id, vdir);
    if (pid > 0) {
        vm = vm_adopt(d, id, pid);
        if (vm != NULL)
            return vm->paused ? SP_VM_PAUSED : SP_VM_RUNNING;
    }
    if (snapshot_committed(vdir))
        return SP_VM_SUSPENDED;
    struct stat st;
    if (stat(vdir, &st) == 0) {
        sp_log(SP_LOG_INFO, "qemu", "removing leftovers of a dead vm sandbox=%s", id);
        rm_rf(vdir);
    }
    cg_remove(d, id);
    return SP_VM_ABSENT;
}

static struct sp_agentconn *q_agent(sp_driver_t *base, const char *id)
{
    sp_qemu_t *d = (sp_qemu_t *)base;
    struct vm *vm = valid_id(id) ? vm_find(d, id) : NULL;
    if (vm == NULL || vm->ph == PH_STOPPING)
        return NULL;
    return vm->agent;
}

static int q_stats(sp_driver_t *base, const char *id, sp_vm_stats_t *out, sp_err_t *err)
{
    sp_qemu_t *d = (sp_qemu_t *)base;
    struct vm *vm = valid_id(id) ? vm_find(d, id) : NULL;
    if (vm == NULL || vm->pid <= 0 || vm->ph == PH_STOPPING) {
        /* Suspended: no process, but the snapshot's size is what the sandbox costs. */
        char dir[PATH_MAX + 80];
        uint64_t snap = 0;
        if (valid_id(id)) {
            sfmt(dir, sizeof dir, "%s/%s", d->vms_dir, id);
            snap = snapshot_bytes(dir);
        }
        if (snap == 0)
            return sp_err_set(err, SP_ENOTFOUND, "sandbox has no VM");
        memset(out, 0, sizeof(*out));
        out->snapshot_bytes = snap;
        return 0;
    }
    memset(out, 0, sizeof(*out));
    out->cpu_count = vm->cpu_count;
    out->mem_total_bytes = (uint64_t)vm->memory_mb << 20;
    out->disk_total_bytes = vm->disk_total;

    char p[PATH_MAX + 32], buf[1024];
    sfmt(p, sizeof p, "/proc/%d/stat", (int)vm->pid);
    if (read_small(p, buf, sizeof buf) > 0) {
        char *rp = strrchr(buf, ')');
        unsigned long long ut = 0, stt = 0;
        /* fields after ")": state(3) ... utime(14) stime(15) */
        if (rp != NULL && sscanf(rp + 2, "%*c %*d %*d %*d %*d %*d %*u %*u %*u %*u %*u %llu %llu",
                                 &ut, &stt) == 2) {
            uint64_t ticks = ut + stt, now = mono_ms();
            long hz = sysconf(_SC_CLK_TCK);
            if (vm->cpu_ms != 0 && now > vm->cpu_ms && hz > 0) {
                double used_ms = (double)(ticks - vm->cpu_ticks) * 1000.0 / (double)hz;
                double pct = used_ms * 100.0 / (double)(now - vm->cpu_ms) /
                             (double)(vm->cpu_count > 0 ? vm->cpu_count : 1);
                vm->cpu_pct = pct > 100.0 ? 100.0 : pct;
            }
            if (now - vm->cpu_ms >= 500 || vm->cpu_ms == 0) { /* keep intervals meaningful */
                vm->cpu_ticks = ticks;
                vm->cpu_ms = now;
            }
        }
    }
    out->cpu_used_pct = vm->cpu_pct;

    bool mem = false;
    if (vm->cg && sp_cgroup_vm_mem_used(d->cg, vm->id, &out->mem_used_bytes) == 0)
        mem = out->mem_used_bytes > 0;
    if (!mem) {
        sfmt(p, sizeof p, "/proc/%d/status", (int)vm->pid);
        FILE *f = fopen(p, "re");
        if (f != NULL) {
            while (fgets(buf, sizeof buf, f) != NULL) {
                unsigned long long kb;
                if (sscanf(buf, "VmRSS: %llu kB", &kb) == 1) {
                    out->mem_used_bytes = kb << 10;
                    break;
                }
            }
            fclose(f);
        }
    }
    struct stat st;
    vm_path(vm, "disk.qcow2", p, sizeof p);
    if (stat(p, &st) == 0)
        out->disk_used_bytes = (uint64_t)st.st_blocks * 512u;
    out->snapshot_bytes = snapshot_bytes(vm->dir);
    console_trim(vm);
    return 0;
}

static void q_free(sp_driver_t *base)
{
    sp_qemu_t *d = (sp_qemu_t *)base;
    /* VMs keep running: they are re-adopted by the next driver on this data dir. Template
     * snapshot builders and spare clones are no sandboxes and nobody would adopt them: they
     * go. */
    while (d->vms != NULL) {
        struct vm *vm = d->vms;
        d->vms = vm->next;
        if ((vm->tsnap_build != NULL || vm->pooled) && vm->pid > 0 && !vm->exited) {
            kill(-vm->pid, SIGKILL);
            kill(vm->pid, SIGKILL);
            if (vm->pidfd >= 0) { /* and reap it if it is our child */
                struct pollfd pf = {.fd = vm->pidfd, .events = POLLIN};
                poll(&pf, 1, 1000);
                waitpid(vm->pid, NULL, WNOHANG);
            }
            cg_remove(d, vm->id); /* waits briefly for the group to empty */
            rm_rf(vm->dir);
        }
        vm_free(vm);
    }
    if (d->kvm_probe != NULL) {
        kill(d->kvm_probe->pid, SIGKILL);
        waitpid(d->kvm_probe->pid, NULL, 0); /* killed: returns at once */
        child_free(d->kvm_probe);
    }
    if (d->sandbox_probe != NULL) {
        kill(d->sandbox_probe->pid, SIGKILL);
        waitpid(d->sandbox_probe->pid, NULL, 0);
        child_free(d->sandbox_probe);
    }
    while (d->done_head != NULL) { /* the owner is going away: drop its callbacks */
        struct done *x = d->done_head;
        d->done_head = x->next;
        free(x);
    }
    sp_timer_stop(&d->done_timer);
    sp_timer_stop(&d->kick_timer);
    sp_timer_stop(&d->console_timer);
    sp_timer_stop(&d->pool_timer);
    while (d->wants != NULL) {
        struct poolwant *w = d->wants;
        d->wants = w->next;
        free(w);
    }
    while (d->tsnaps != NULL) {
        struct tsnap *t = d->tsnaps;
        d->tsnaps = t->next;
        free(t);
    }
    sp_cgroup_destroy(d->cg);
    free(d->qemu);
    free(d->qemu_img);
    free(d);
}

static const sp_driver_ops_t qemu_ops = {
    .name = "qemu",
    .boot = q_boot,
    .pause = q_pause,
    .resume = q_resume,
    .snapshot = q_snapshot,
    .restore = q_restore,
    .destroy = q_destroy,
    .probe = q_probe,
    .agent = q_agent,
    .stats = q_stats,
    .free = q_free,
};

sp_driver_t *sp_qemu_create(sp_loop_t *loop, const sp_qemu_opts_t *o, sp_err_t *err)
{
    if (o == NULL || o->data_dir == NULL || *o->data_dir == '\0') {
        sp_err_set(err, SP_EINVAL, "qemu driver needs a data directory");
        return NULL;
    }
    int want = 0;
    if (o->accel == NULL || strcmp(o->accel, "auto") == 0)
        want = 0;
    else if (strcmp(o->accel, "kvm") == 0)
        want = 1;
    else if (strcmp(o->accel, "tcg") == 0)
        want = 2;
    else {
        sp_err_set(err, SP_EINVAL, "accel must be auto, kvm or tcg");
        return NULL;
    }
    sp_qemu_t *d = calloc(1, sizeof(*d));
    if (d == NULL) {
        sp_err_set(err, SP_EINTERNAL, "out of memory");
        return NULL;
    }
    d->base.ops = &qemu_ops;
    d->base.loop = loop;
    d->want = want;
    char abs[PATH_MAX];
    if (strlen(o->data_dir) > PATH_MAX - 256) {
        free(d);
        sp_err_set(err, SP_EINVAL, "data directory path is too long");
        return NULL;
    }
    if (realpath(o->data_dir, abs) == NULL)
        sfmt(abs, sizeof abs, "%s", o->data_dir);
    sfmt(d->data_dir, sizeof d->data_dir, "%s", abs);
    sfmt(d->vms_dir, sizeof d->vms_dir, "%s/vms", abs);
    d->qemu = strdup(o->qemu != NULL ? o->qemu : "qemu-system-x86_64");
    d->qemu_img = strdup(o->qemu_img != NULL ? o->qemu_img : "qemu-img");
    d->boot_timeout_ms = env_ms("SPACE_BOOT_TIMEOUT_MS", SP_QEMU_BOOT_TIMEOUT_MS);
    d->probe_ms = env_ms("SPACE_KVM_PROBE_MS", SP_QEMU_KVM_PROBE_MS);
    const char *cold = getenv("SPACE_COLD_BOOT");
    d->cold_only = o->cold_boot || (cold != NULL && strcmp(cold, "1") == 0);
    d->no_adopt = o->no_adopt != 0;
    sp_timer_init(&d->done_timer, loop, on_done_timer, d);
    sp_timer_init(&d->kick_timer, loop, on_kick, d);
    sp_timer_init(&d->console_timer, loop, on_console_tick, d);
    sp_timer_init(&d->pool_timer, loop, on_pool_timer, d);
    {
        long ps = o->pool_size;
        const char *env = getenv("SPACE_POOL_SIZE");
        if (ps == 0 && env != NULL && *env != '\0') {
            char *end;
            ps = strtol(env, &end, 10);
            if (*end != '\0' || ps < 0)
                ps = SP_QEMU_POOL_DEFAULT;
            else if (ps == 0)
                ps = -1;
        } else if (ps == 0) {
            ps = SP_QEMU_POOL_DEFAULT;
        }
        d->pool_size = ps < 0 || o->no_adopt || o->cold_boot ? 0
                       : ps > SP_QEMU_POOL_MAX               ? SP_QEMU_POOL_MAX
                                                             : (int)ps;
    }
    if (d->qemu == NULL || d->qemu_img == NULL) {
        q_free(&d->base);
        sp_err_set(err, SP_EINTERNAL, "out of memory");
        return NULL;
    }
    if (!have_program(d->qemu) || !have_program(d->qemu_img)) {
        sp_log(SP_LOG_WARN, "qemu", "qemu not found qemu=%s qemu_img=%s", d->qemu, d->qemu_img);
        q_free(&d->base);
        sp_err_set(err, SP_ERUNTIME, "QEMU (qemu-system-x86_64, qemu-img) is not installed");
        return NULL;
    }
    {
        char qp[PATH_MAX];
        struct stat qs;
        if (resolve_program(d->qemu, qp) && stat(qp, &qs) == 0)
            sfmt(d->qemu_ident, sizeof d->qemu_ident, "%s:%lld:%lld", qp, (long long)qs.st_size,
                 (long long)qs.st_mtime);
        else
            sfmt(d->qemu_ident, sizeof d->qemu_ident, "%s", d->qemu);
    }
    if (d->cold_only) {
        sp_log(SP_LOG_INFO, "qemu", "template snapshots off: every boot is a cold boot");
        d->pool_size = 0;
    }
    if (mkdir(d->vms_dir, 0755) < 0 && errno != EEXIST) {
        sp_log(SP_LOG_ERROR, "qemu", "cannot create dir=%s err=%s", d->vms_dir, strerror(errno));
        q_free(&d->base);
        sp_err_set(err, SP_ERUNTIME, "cannot create the VM directory");
        return NULL;
    }

    d->accel = -1;
    if (want == 1) {
        d->accel = 1;
        record_accel(d, "accel=kvm configured");
    } else if (want == 2) {
        d->accel = 0;
        record_accel(d, "accel=tcg configured");
    } else {
        int fd = open("/dev/kvm", O_RDWR | O_CLOEXEC);
        if (fd < 0) {
            char why[160];
            sfmt(why, sizeof why, "/dev/kvm is not usable (%s); using TCG", strerror(errno));
            d->accel = 0;
            record_accel(d, why);
        } else {
            close(fd); /* opening proves little (PVM opens fine): the first boot probes */
            d->accel = cached_probe_verdict(d);
            if (d->accel >= 0)
                sp_log(SP_LOG_INFO, "qemu",
                       "accelerator=%s reason=\"verdict of an earlier probe in this host boot "
                       "(delete vms/accel to probe again)\"",
                       d->accel == 1 ? "kvm" : "tcg");
        }
    }
    d->sandbox = -1;
    start_sandbox_probe(d);
    d->cg = sp_cgroup_create();
    if (sp_cgroup_kind(d->cg) == SP_CGROUP_NONE)
        sp_log(SP_LOG_WARN, "qemu",
               "no per-VM cgroup limits: %s (VMs run without cpu/memory/pids limits)",
               sp_cgroup_why(d->cg));
    else
        sp_log(SP_LOG_INFO, "qemu", "per-VM cgroup limits: %s", sp_cgroup_why(d->cg));
    adopt_all(d);
    tsnap_gc(d); /* a no-op until the accelerator is known (then on_kvm_probe runs it) */
    sp_timer_start(&d->console_timer, SP_QEMU_CONSOLE_TICK_MS);
    return &d->base;
}

int sp_qemu_pool_ready(sp_driver_t *base)
{
    if (base == NULL || base->ops != &qemu_ops)
        return 0;
    int n = 0;
    for (struct vm *v = ((sp_qemu_t *)base)->vms; v != NULL; v = v->next)
        n += v->pooled && v->pool_ready && !v->pool_drop;
    return n;
}

int sp_qemu_template_snapshot(sp_driver_t *base, const char *template_name, int cpu_count,
                              int memory_mb, sp_qemu_tsnap_info_t *info, sp_driver_cb cb, void *arg,
                              sp_err_t *err)
{
    if (base == NULL || base->ops != &qemu_ops)
        return sp_err_set(err, SP_EINVAL, "not a qemu driver");
    sp_qemu_t *d = (sp_qemu_t *)base;
    if (d->cold_only)
        return sp_err_set(err, SP_ECONFLICT, "template snapshots are off (cold boot configured)");
    const char *tname = template_name != NULL ? template_name : "base";
    sp_tmplbuild_paths_t *tp = calloc(1, sizeof(*tp));
    if (tp == NULL)
        return sp_err_set(err, SP_EINTERNAL, "out of memory");
    sp_err_t te;
    if (sp_tmplbuild_current(d->data_dir, tname, tp, &te) < 0) {
        free(tp);
        return sp_err_set(err, te.code == SP_EINVAL ? SP_EINVAL : SP_ENOTFOUND,
                          "template %.64s is not built on this host", tname);
    }
    char id[SP_QEMU_ID_MAX + 1];
    sfmt(id, sizeof id, "tsreq:%u", ++d->req_seq); /* ':' keeps it out of every API's reach */
    struct vm *vm = vm_new(d, id);
    if (vm == NULL || add_waiter(&vm->boot_w, cb, arg, err) < 0) {
        free(tp);
        if (vm != NULL) {
            vm_unlink(vm);
            vm_free(vm);
        }
        return sp_err_set(err, SP_EINTERNAL, "out of memory");
    }
    vm->tp = tp;
    vm->tsnap_req = true;
    vm->req_info = info;
    if (info != NULL)
        memset(info, 0, sizeof *info);
    sfmt(vm->template_name, sizeof vm->template_name, "%s", tname);
    vm->cpu_count = cpu_count > 0 ? cpu_count : (tp->cpu_count > 0 ? tp->cpu_count : 1);
    vm->memory_mb = memory_mb > 0 ? memory_mb : (tp->memory_mb > 0 ? tp->memory_mb : 256);
    vm->disk_total = (uint64_t)(tp->disk_mb > 0 ? tp->disk_mb : 0) << 20;
    vm->ph = PH_WAIT_ACCEL;
    vm->boot_start_ms = mono_ms();
    kick(d);
    return 0;
}
