/*
 * tsnap.c - template snapshots (qemu.h): the snapshot a create of a template size clones,
 * built once per key, and their collection.
 *
 * A builder VM (a struct vm with tsnap_build set, an id no API call can name,
 * tsnap:<key>-<pid>, its work dir vms/.tsnap-<key>-<pid>) boots cold, or, when the request
 * names a seed (sp_qemu_template_snapshot_from: a snapshot of the VM that built the template's
 * image, its whole RAM in the stream), restores that over a new overlay on the image
 * (fork.c: sp_qemu__fork_seed) with RAM of its own; either way it runs the template's
 * warmup (sp_qemu__tsnap_warmup, core/channel/exec.h on its agent), settles, and goes through the
 * same suspend steps (snapshot.c); sp_qemu__suspend_finish then freezes its files and renames the
 * work dir into the template build (sp_qemu__tsnap_commit). A request for a snapshot without a
 * sandbox (sp_qemu_template_snapshot) is a struct vm with tsnap_req set that never starts QEMU: it
 * waits like a boot and is answered and freed in sp_qemu__tsnap_req_step. Every transition of
 * a boot waiting for a snapshot goes through sp_qemu__on_kick, so no completion frees a VM
 * another loop over the table is holding. sp_qemu__tsnap_gc removes snapshots nobody will
 * clone again once no sandbox uses them (tsnap_refs: RAM mappings and overlay backing files,
 * read from every VM dir).
 *
 * Owns the driver's struct tsnap records. Does not clone (boot.c) nor keep spares (pool.c).
 */
#include "core/runtime/qemu/qemu_int.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "base/log.h"
#include "base/metrics.h"
#include "guest/bootargs.h"

/* ---------- template snapshots ---------- */

uint64_t sp_qemu__fnv1a(uint64_t h, const char *s)
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
int sp_qemu__tsnap_key_for(const sp_qemu_t *d, const sp_tmplbuild_paths_t *tp, int cpu_count,
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
    uint64_t h = SP_QEMU_FNV_BASIS;
    h = sp_qemu__fnv1a(h, SP_QEMU_TSNAP_FORMAT);
    h = sp_qemu__fnv1a(h, d->qemu_ident);
    h = sp_qemu__fnv1a(h, tp->hash);
    h = sp_qemu__fnv1a(h, tp->rootfs);
    for (int i = 0; argv[i] != NULL; i++)
        h = sp_qemu__fnv1a(h, argv[i]);
    free(argv);
    sp_qemu__sfmt(key, 17, "%016llx", (unsigned long long)h);
    return 0;
}

static int tsnap_key(const struct vm *vm, char key[17])
{
    return sp_qemu__tsnap_key_for(vm->d, vm->tp, vm->cpu_count, vm->memory_mb, key);
}

/* A committed snapshot dir that matches key and memory size; checks sizes and the device
 * state's checksum (60 KB: cheap, and done once per driver and key). */
static bool tsnap_valid(const char *dir, const char *key, int memory_mb)
{
    char p[PATH_MAX + 48];
    sp_qemu__sfmt(p, sizeof p, "%s/template-snapshot.json", dir);
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
        sp_qemu__sfmt(p, sizeof p, "%s/mem.ram", dir);
        ok = stat(p, &st) == 0 && (uint64_t)st.st_size == (uint64_t)memory_mb << 20;
    }
    if (ok) {
        sp_qemu__sfmt(p, sizeof p, "%s/disk.qcow2", dir);
        ok = stat(p, &st) == 0;
    }
    if (ok) {
        sp_qemu__sfmt(p, sizeof p, "%s/snapshot/devstate", dir);
        char got[SP_TMPLBUILD_HASH_LEN + 1];
        sp_err_t e;
        ok = stat(p, &st) == 0 && st.st_size == (off_t)dev_bytes &&
             sp_tmplbuild_file_sha256(p, got, &e) == 0 && strcmp(got, sum) == 0;
    }
    json_decref(m);
    return ok;
}

/* ---------- template snapshot collection ---------- */

void sp_qemu__refs_add(struct refs *r, const char *s)
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
bool sp_qemu__refs_has(const struct refs *r, const char *dir)
{
    size_t l = strlen(dir);
    for (size_t i = 0; i < r->n; i++)
        if (strncmp(r->v[i], dir, l) == 0 && (r->v[i][l] == '\0' || r->v[i][l] == '/'))
            return true;
    return false;
}

/* Every file in the backing chain below the qcow2 image disk (not disk itself), but those
 * under skip (NULL: none): a snapshot's own layers do not hold it. */
void sp_qemu__refs_chain(struct refs *r, const char *disk, const char *skip)
{
    char cur[PATH_MAX], next[PATH_MAX];
    sp_qemu__sfmt(cur, sizeof cur, "%s", disk);
    for (int k = 0; k < 16 && sp_qemu__qcow2_backing(cur, next, sizeof next); k++) {
        if (skip == NULL || !sp_qemu__path_under(next, skip))
            sp_qemu__refs_add(r, next);
        memcpy(cur, next, sizeof cur);
    }
}

void sp_qemu__refs_free(struct refs *r)
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
        char p[PATH_MAX + 80];
        sp_qemu__sfmt(p, sizeof p, "%s/%s/disk.qcow2", d->vms_dir, de->d_name);
        sp_qemu__refs_chain(r, p, NULL); /* a fork's backs onto a sandbox snapshot, then ours */
        sp_qemu__sfmt(p, sizeof p, "%s/%s/vm.json", d->vms_dir, de->d_name);
        json_t *o = json_load_file(p, 0, NULL);
        const char *src = json_string_value(json_object_get(o, "ram_src"));
        if (src != NULL)
            sp_qemu__refs_add(r, src);
        json_decref(o);
    }
    if (dir != NULL)
        closedir(dir);
    for (struct vm *v = d->vms; v != NULL; v = v->next) {
        if (v->clone_src != NULL)
            sp_qemu__refs_add(r, v->clone_src);
        /* a boot waiting for a snapshot being built (or just built: its clone_src is not
         * set yet) holds it too, else a snapshot of a version other than the current one
         * (a tag's) went right after its commit and the boot waited for ever-new builds */
        if (v->tsnap_wait != NULL && v->tsnap_wait->dir[0] != '\0')
            sp_qemu__refs_add(r, v->tsnap_wait->dir);
    }
    sp_qemu__snaps_refs(d, r); /* sandbox snapshots: their RAM base and disk chain */
    sp_qemu__shared_refs(d, r); /* and those being copied in or out, made deltas over one */
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
    if (sp_qemu__tsnap_key_for(d, cur, cpus, mem, want) < 0)
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
 * snapshot: milliseconds. The current ones get their sealed RAM made off the loop for jailed
 * clones (confine.c), the removed ones lose it. */
void sp_qemu__tsnap_gc(sp_qemu_t *d)
{
    if (d->accel < 0)
        return;
    d->gc_done = true;
    struct refs r = {0};
    if (!tsnap_refs(d, &r)) {
        sp_log(SP_LOG_WARN, "qemu", "template snapshots not collected: cannot list the VMs");
        sp_qemu__refs_free(&r);
        return;
    }
    char tdir[PATH_MAX];
    sp_qemu__sfmt(tdir, sizeof tdir, "%s/templates", d->data_dir);
    DIR *td = opendir(tdir);
    int removed = 0, kept = 0;
    struct dirent *te;
    while (td != NULL && (te = readdir(td)) != NULL) {
        if (te->d_name[0] == '.')
            continue;
        sp_tmplbuild_paths_t cur;
        bool have = sp_tmplbuild_current(d->data_dir, te->d_name, &cur, NULL) == 0;
        char tpath[PATH_MAX];
        sp_qemu__sfmt(tpath, sizeof tpath, "%s/%s", tdir, te->d_name);
        DIR *hd = opendir(tpath);
        struct dirent *he;
        while (hd != NULL && (he = readdir(hd)) != NULL) {
            if (strlen(he->d_name) != SP_TMPLBUILD_HASH_LEN)
                continue;
            bool is_cur = have && strcmp(he->d_name, cur.hash) == 0;
            char hpath[PATH_MAX];
            sp_qemu__sfmt(hpath, sizeof hpath, "%s/%s", tpath, he->d_name);
            DIR *sd = opendir(hpath);
            struct dirent *se;
            while (sd != NULL && (se = readdir(sd)) != NULL) {
                if (strncmp(se->d_name, "snapshot-", 9) != 0)
                    continue;
                char spath[PATH_MAX];
                sp_qemu__sfmt(spath, sizeof spath, "%s/%s", hpath, se->d_name);
                const char *why = tsnap_stale(d, is_cur ? &cur : NULL, se->d_name, spath);
                if (why == NULL) {
                    /* current: jailed clones will want its sealed RAM (at driver start,
                     * this is where committed snapshots are found) */
                    sp_qemu__confine_ram_prepare(d, spath);
                    continue;
                }
                if (sp_qemu__refs_has(&r, spath)) {
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
                sp_qemu__confine_ram_forget(d, spath); /* a copy in flight is let go */
                sp_qemu__discard(d, spath);
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
    sp_qemu__refs_free(&r);
    if (removed > 0 || kept > 0)
        sp_log(SP_LOG_INFO, "qemu", "template snapshots collected removed=%d kept_in_use=%d",
               removed, kept);
}

void sp_qemu__tsnap_cid(char *out, size_t n, const char *dir_name)
{
    sp_qemu__sfmt(out, n, "tsnap:%.40s", dir_name + 7); /* after ".tsnap-" */
}

/* A builder work dir .tsnap-<key>-<pid> of a live driver in another process (spaced serve
 * while `spaced template build` runs, say): not ours to kill or remove. */
bool sp_qemu__tsnap_tmp_foreign(const char *name)
{
    const char *dash = strrchr(name, '-');
    long pid = dash != NULL ? strtol(dash + 1, NULL, 10) : 0;
    if (pid <= 1 || pid > INT_MAX || pid == (long)getpid())
        return false;
    return kill((pid_t)pid, 0) == 0 || errno == EPERM;
}

/* Boots waiting for t go back through sp_qemu__on_kick, which sends them on by t's new state. */
static void tsnap_wake(sp_qemu_t *d, struct tsnap *t)
{
    for (struct vm *v = d->vms; v != NULL; v = v->next)
        if (v->ph == PH_WAIT_TSNAP && v->tsnap_wait == t)
            v->ph = PH_WAIT_ACCEL;
    sp_qemu__kick(d);
}

/* Kills a builder QEMU an earlier driver left in a work dir of this snapshot, removes the
 * dirs. Quick: a readdir of the VM directory. */
static void tsnap_clean_tmp(sp_qemu_t *d, const struct tsnap *t)
{
    char base[64];
    const char *parent = d->vms_dir;
    sp_qemu__sfmt(base, sizeof base, ".tsnap-%s-", t->key);
    DIR *dir = opendir(parent);
    if (dir == NULL)
        return;
    struct dirent *de;
    while ((de = readdir(dir)) != NULL) {
        if (strncmp(de->d_name, base, strlen(base)) != 0 || sp_qemu__tsnap_tmp_foreign(de->d_name))
            continue;
        char p[PATH_MAX], cid[SP_QEMU_ID_MAX + 1];
        sp_qemu__sfmt(p, sizeof p, "%s/%s", parent, de->d_name);
        sp_qemu__tsnap_cid(cid, sizeof cid, de->d_name);
        pid_t pid = sp_qemu__leftover_remove(d, p, cid);
        if (pid > 0)
            sp_log(SP_LOG_INFO, "qemu", "killed a stale template snapshot builder pid=%d",
                   (int)pid);
    }
    closedir(dir);
}

/* Starts a builder VM for t from the boot vm's template and size. 0 when started. */
static int tsnap_build_start(sp_qemu_t *d, struct tsnap *t, const struct vm *vm)
{
    tsnap_clean_tmp(d, t);
    char id[SP_QEMU_ID_MAX + 1];
    sp_qemu__tsnap_cid(id, sizeof id, strrchr(t->tmp, '/') + 1);
    sp_tmplbuild_paths_t *tp = malloc(sizeof(*tp));
    struct vm *b = tp != NULL ? sp_qemu__vm_new(d, id) : NULL;
    if (b == NULL) {
        free(tp);
        return -1;
    }
    *tp = *vm->tp;
    b->tp = tp;
    sp_qemu__sfmt(b->dir, sizeof b->dir, "%s", t->tmp);
    sp_qemu__sfmt(b->template_name, sizeof b->template_name, "%s", vm->template_name);
    b->cpu_count = vm->cpu_count;
    b->memory_mb = vm->memory_mb;
    b->disk_total = vm->disk_total;
    b->hostname = strdup("template");
    b->tsnap_build = t;
    b->cold = true;
    /* from a snapshot of the template's own builder: its steps' page cache and all, no boot */
    t->seeded = vm->seed != NULL && !t->seed_failed && sp_qemu__fork_seed(b, vm->seed) == 0;
    if (t->seeded) {
        b->restoring = true;
        b->restore_stream = true;
    }
    b->ph = PH_WAIT_ACCEL;
    b->boot_start_ms = sp_qemu__mono_ms();
    t->start_ms = b->boot_start_ms;
    t->state = TS_BUILDING;
    sp_timer_start(&b->boot_timer, d->boot_timeout_ms);
    sp_log(SP_LOG_INFO, "qemu",
           "building template snapshot template=%s key=%s memory_mb=%d cpus=%d accel=%s from=%s",
           vm->template_name, t->key, vm->memory_mb, vm->cpu_count, d->accel == 1 ? "kvm" : "tcg",
           b->restoring ? vm->seed : "boot");
    sp_qemu__kick(d);
    return 0;
}

/* The snapshot record for a boot, found, adopted from disk, or being built. NULL (logged)
 * when none can be had: the boot goes cold. */
struct tsnap *sp_qemu__tsnap_for(struct vm *vm)
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
        sp_qemu__sfmt(p, sizeof p, "%s/template-snapshot.json", t->dir);
        if (sp_qemu__file_exists(p))
            return t;
        t->state = TS_FAILED; /* removed under us: look again */
        t->failed_ms = 0;
    }
    if (t != NULL &&
        (t->state == TS_BUILDING || (t->state == TS_FAILED && t->failed_ms != 0 &&
                                     sp_qemu__mono_ms() - t->failed_ms < SP_QEMU_TSNAP_RETRY_MS)))
        return t;
    if (t == NULL) {
        t = calloc(1, sizeof(*t));
        if (t == NULL) {
            sp_log(SP_LOG_WARN, "qemu", "cold boot sandbox=%s reason=\"out of memory\"", vm->id);
            return NULL;
        }
        sp_qemu__sfmt(t->key, sizeof t->key, "%s", key);
        sp_qemu__sfmt(t->dir, sizeof t->dir, "%s/snapshot-%s-%dM-%dc-%s", vm->tp->build_dir,
                      d->accel == 1 ? "kvm" : "tcg", vm->memory_mb, vm->cpu_count, key);
        sp_qemu__sfmt(t->tmp, sizeof t->tmp, "%s/.tsnap-%s-%d", d->vms_dir, key, (int)getpid());
        sp_qemu__sfmt(t->template_name, sizeof t->template_name, "%s", vm->template_name);
        t->cpu_count = vm->cpu_count;
        t->memory_mb = vm->memory_mb;
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
        bool used = !tsnap_refs(d, &r) || sp_qemu__refs_has(&r, t->dir);
        sp_qemu__refs_free(&r);
        if (used) {
            sp_log(SP_LOG_WARN, "qemu",
                   "template snapshot is damaged and still used by sandboxes: kept; boots "
                   "cold-boot until it is unused dir=%s",
                   t->dir);
            t->state = TS_FAILED;
            t->failed_ms = sp_qemu__mono_ms();
            sp_qemu__sfmt(t->why, sizeof t->why,
                          "the template snapshot is damaged and still in use");
            return t;
        }
        sp_log(SP_LOG_WARN, "qemu", "template snapshot is damaged: removed, rebuilding dir=%s",
               t->dir);
        sp_qemu__discard(d, t->dir);
    }
    if (tsnap_build_start(d, t, vm) < 0) {
        t->state = TS_FAILED;
        t->failed_ms = sp_qemu__mono_ms();
        sp_qemu__sfmt(t->why, sizeof t->why, "cannot start the template snapshot builder");
    }
    return t;
}

static sp_metric_t m_builds = SP_METRIC_COUNTER(
    "space_template_snapshot_builds_total",
    "Template snapshot builds (boot a builder, warm up, freeze, commit), by outcome.", "outcome");
static sp_metric_t m_build_seconds = SP_METRIC_HISTOGRAM(
    "space_template_snapshot_build_duration_seconds",
    "Time a template snapshot build took, by outcome.", "outcome", sp_metrics_buckets_ops);

void sp_qemu__tsnap_metrics_declare(void)
{
    sp_metrics_declare(&m_builds);
    sp_metrics_declare(&m_build_seconds);
}

static void count_build(const struct tsnap *t, bool ok)
{
    const char *outcome = ok ? "success" : "failure";
    sp_metrics_add(&m_builds, 1, outcome);
    sp_metrics_observe(&m_build_seconds, (double)(sp_qemu__mono_ms() - t->start_ms) / 1000.0,
                       outcome);
}

/* The builder is gone before its snapshot committed: boots waiting for it go cold. */
void sp_qemu__tsnap_failed(struct vm *vm, const char *why)
{
    struct tsnap *t = vm->tsnap_build;
    vm->tsnap_build = NULL;
    if (t->seeded && vm->restoring) { /* boot_done clears it once the seed is up */
        /* The seed did not restore (a failed warmup is the template's own and fails as
         * ever): build it again from a cold boot, for the boots and requests waiting for it,
         * which tsnap_wake sends back to sp_qemu__tsnap_for. */
        t->seed_failed = true;
        t->state = TS_FAILED;
        t->failed_ms = 0; /* not a failure to wait out: look again at once */
        sp_log(SP_LOG_WARN, "qemu",
               "template snapshot seed did not restore template=%s key=%s err=\"%s\": building it "
               "from a cold boot",
               t->template_name, t->key, why);
        tsnap_wake(vm->d, t);
        return;
    }
    count_build(t, false);
    t->state = TS_FAILED;
    t->failed_ms = sp_qemu__mono_ms();
    sp_qemu__sfmt(t->why, sizeof t->why, "%s", why);
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
    vm->snap_start_ms = sp_qemu__mono_ms();
    vm->snap_step = SN_STOP;
    sp_qemu__snap_send(vm, "stop", NULL, -1);
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
 * (sp_qemu__vm_finish -> sp_qemu__tsnap_failed; boots cold-boot, and a cold boot never runs the
 * warmup). */
static void on_warmup_done(void *arg, const sp_exec_result_t *res, const sp_err_t *err)
{
    struct vm *vm = arg;
    vm->warm = NULL;
    if (vm->ph != PH_UP || vm->tsnap_build == NULL)
        return;
    struct tsnap *t = vm->tsnap_build;
    unsigned long long ms = (unsigned long long)(sp_qemu__mono_ms() - vm->warm_start_ms);
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
        sp_qemu__sfmt(why, sizeof why, "the template's warmup failed: %s", err->msg);
    else if (res->timed_out)
        sp_qemu__sfmt(why, sizeof why, "the template's warmup did not finish within %u s",
                      SP_QEMU_WARMUP_MS / 1000u);
    else if (!res->exited)
        sp_qemu__sfmt(why, sizeof why, "the template's warmup was killed by signal %d",
                      res->signal);
    else
        sp_qemu__sfmt(why, sizeof why, "the template's warmup exited with status %d",
                      res->exit_code);
    sp_log(SP_LOG_WARN, "qemu",
           "template warmup failed template=%s key=%s ms=%llu err=\"%s\" output_tail=\"%s\"",
           t->template_name, t->key, ms, why, tail);
    vm->boot_failed = true;
    sp_err_set(&vm->boot_err, SP_ERUNTIME, "%s", why);
    vm->keep_logs = true;
    sp_qemu__vm_stop(vm, false);
}

/* Builder up: run the template's warmup command (as root, through the agent) if it has one,
 * then settle. Whatever it leaves running is in the snapshot. */
void sp_qemu__tsnap_warmup(struct vm *vm)
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
        vm->warm_start_ms = sp_qemu__mono_ms();
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
        sp_qemu__vm_stop(vm, false);
    }
}

/* The builder's files were its jailed QEMU's (confine.c): they become spaced's, and the
 * directory readable by every VM's uid (clones see it through their jail's read-only bind),
 * so that no VM's uid owns what every clone maps. */
static int freeze_owner(const struct vm *vm)
{
    static const char *const names[] = {
        "mem.ram", "disk.qcow2", "snapshot/devstate", "template-snapshot.json", "snapshot", ""};
    char p[PATH_MAX + 48];
    for (size_t i = 0; i < sizeof names / sizeof names[0]; i++) {
        sp_qemu__sfmt(p, sizeof p, "%s%s%s", vm->dir, names[i][0] ? "/" : "", names[i]);
        if (lchown(p, geteuid(), getegid()) < 0 && errno != ENOENT)
            return -1;
    }
    return chmod(vm->dir, 0755);
}

/* The builder's QEMU quit after its device state, RAM file and overlay were made durable
 * (snap_commit): freeze the files and commit the directory by rename. */
void sp_qemu__tsnap_commit(struct vm *vm)
{
    struct tsnap *t = vm->tsnap_build;
    vm->tsnap_build = NULL;
    char p[PATH_MAX + 48], sum[SP_TMPLBUILD_HASH_LEN + 1];
    struct stat sr, sd, sk;
    sp_err_t e;
    const char *why = NULL;
    sp_qemu__vm_path(vm, "snapshot/manifest.json", p, sizeof p);
    unlink(p); /* a per-VM suspend manifest means nothing here */
    sp_qemu__vm_path(vm, "mem.ram", p, sizeof p);
    if (stat(p, &sr) < 0 || chmod(p, 0444) < 0)
        why = "RAM file";
    sp_qemu__vm_path(vm, "disk.qcow2", p, sizeof p);
    if (why == NULL && (stat(p, &sk) < 0 || chmod(p, 0444) < 0))
        why = "overlay";
    sp_qemu__vm_path(vm, "snapshot/devstate", p, sizeof p);
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
                      (json_int_t)ts.tv_sec, "build_ms",
                      (json_int_t)(sp_qemu__mono_ms() - t->start_ms));
        char *js = o != NULL ? json_dumps(o, JSON_COMPACT | JSON_SORT_KEYS) : NULL;
        sp_qemu__vm_path(vm, "template-snapshot.json", p, sizeof p);
        int fd = js != NULL ? open(p, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0444) : -1;
        bool ok = fd >= 0 && write(fd, js, strlen(js)) == (ssize_t)strlen(js) && fsync(fd) == 0;
        if (fd >= 0)
            close(fd);
        free(js);
        if (!ok)
            why = "manifest";
    }
    if (why == NULL && freeze_owner(vm) < 0)
        why = "ownership";
    if (why == NULL) {
        sp_qemu__fsync_path(vm->dir, O_RDONLY | O_DIRECTORY);
        if (rename(vm->dir, t->dir) < 0) {
            /* another spaced on this data dir committed the same key first: use theirs */
            sp_qemu__discard(vm->d, vm->dir);
            if (!tsnap_valid(t->dir, t->key, vm->memory_mb))
                why = "commit";
        } else {
            sp_qemu__sfmt(p, sizeof p, "%s", t->dir);
            char *slash = strrchr(p, '/');
            if (slash != NULL) {
                *slash = '\0';
                sp_qemu__fsync_path(p, O_RDONLY | O_DIRECTORY);
            }
        }
    }
    /* sp_qemu__vm_free must not look at the work dir */
    sp_qemu__sfmt(vm->dir, sizeof vm->dir, "%s", t->dir);
    count_build(t, why == NULL);
    if (why != NULL) {
        t->state = TS_FAILED;
        t->failed_ms = sp_qemu__mono_ms();
        sp_qemu__sfmt(t->why, sizeof t->why, "cannot commit the template snapshot (%s)", why);
        sp_log(SP_LOG_WARN, "qemu", "template snapshot failed template=%s key=%s err=\"%s: %s\"",
               t->template_name, t->key, why, strerror(errno));
    } else {
        t->state = TS_READY;
        sp_log(SP_LOG_INFO, "qemu",
               "template snapshot ready template=%s key=%s ms=%llu ram_alloc_bytes=%lld "
               "devstate_bytes=%lld",
               t->template_name, t->key, (unsigned long long)(sp_qemu__mono_ms() - t->start_ms),
               (long long)sr.st_blocks * 512, (long long)sd.st_size);
    }
    json_decref(o);
    if (why == NULL) {
        sp_qemu__confine_ram_prepare(vm->d, t->dir); /* its clones' sealed RAM, off the loop */
        sp_qemu__tsnap_gc(vm->d);                    /* it may supersede others */
    }
    tsnap_wake(vm->d, t);
}

/* A template snapshot request (sp_qemu_template_snapshot) once the accelerator is known: it
 * waits in PH_WAIT_TSNAP while its snapshot is built and is answered (and freed) once the
 * snapshot is ready or failed. */
void sp_qemu__tsnap_req_step(struct vm *vm)
{
    sp_qemu_t *d = vm->d;
    struct tsnap *t = d->cold_only ? NULL : sp_qemu__tsnap_for(vm);
    if (t != NULL && t->state == TS_BUILDING) {
        vm->ph = PH_WAIT_TSNAP;
        vm->tsnap_wait = t;
        if (vm->req_info != NULL) {
            vm->req_info->built = 1;
            vm->req_info->seeded = t->seeded;
        }
        return;
    }
    sp_err_t e;
    bool ok = t != NULL && t->state == TS_READY;
    if (ok && vm->req_info != NULL) {
        sp_qemu__sfmt(vm->req_info->dir, sizeof vm->req_info->dir, "%s", t->dir);
        sp_qemu__sfmt(vm->req_info->key, sizeof vm->req_info->key, "%s", t->key);
    }
    if (d->cold_only)
        sp_err_set(&e, SP_ECONFLICT, "template snapshots are off (cold boot configured)");
    else if (t == NULL)
        sp_err_set(&e, SP_ERUNTIME, "no template snapshot can be made (see the log)");
    else if (!ok)
        sp_err_set(&e, SP_ERUNTIME, "%s",
                   t->why[0] != '\0' ? t->why : "the template snapshot failed (see the log)");
    sp_qemu__complete_all(d, &vm->boot_w, ok ? NULL : &e);
    sp_qemu__vm_unlink(vm);
    sp_qemu__vm_free(vm);
}

int sp_qemu_template_snapshot(sp_driver_t *base, const char *template_name, int cpu_count,
                              int memory_mb, sp_qemu_tsnap_info_t *info, sp_driver_cb cb, void *arg,
                              sp_err_t *err)
{
    return sp_qemu_template_snapshot_from(base, template_name, cpu_count, memory_mb, NULL, info, cb,
                                          arg, err);
}

int sp_qemu_template_seed(sp_driver_t *base, const char *id, const char *snapshot_id,
                          sp_driver_cb cb, void *arg, sp_err_t *err)
{
    if (base == NULL || base->ops != &sp_qemu__ops)
        return sp_err_set(err, SP_EINVAL, "not a qemu driver");
    struct vm *vm = sp_qemu__running_vm((sp_qemu_t *)base, id, err);
    if (vm == NULL)
        return -1;
    bool no_delta = vm->no_delta;
    vm->no_delta = true; /* the seeded builder's RAM is a file of its own, not a clone's */
    if (sp_qemu__q_checkpoint(base, id, snapshot_id, 0, cb, arg, err) < 0) {
        vm->no_delta = no_delta;
        return -1;
    }
    return 0;
}

int sp_qemu_template_snapshot_from(sp_driver_t *base, const char *template_name, int cpu_count,
                                   int memory_mb, const char *seed, sp_qemu_tsnap_info_t *info,
                                   sp_driver_cb cb, void *arg, sp_err_t *err)
{
    if (base == NULL || base->ops != &sp_qemu__ops)
        return sp_err_set(err, SP_EINVAL, "not a qemu driver");
    sp_qemu_t *d = (sp_qemu_t *)base;
    if (d->cold_only)
        return sp_err_set(err, SP_ECONFLICT, "template snapshots are off (cold boot configured)");
    const char *tname = template_name != NULL ? template_name : "base";
    sp_tmplbuild_paths_t *tp = sp_qemu__template_for(d, tname, err);
    if (tp == NULL)
        return -1;
    char id[SP_QEMU_ID_MAX + 1];
    /* ':' keeps it out of every API's reach */
    sp_qemu__sfmt(id, sizeof id, "tsreq:%u", ++d->req_seq);
    struct vm *vm = sp_qemu__vm_new_boot(d, id, tp, tname, cpu_count, memory_mb, cb, arg, err);
    if (vm == NULL)
        return -1;
    vm->tsnap_req = true;
    vm->req_info = info;
    if (seed != NULL && (vm->seed = strdup(seed)) == NULL)
        sp_log(SP_LOG_WARN, "qemu", "template snapshot boots cold template=%s (out of memory)",
               tname);
    if (info != NULL)
        memset(info, 0, sizeof *info);
    sp_qemu__kick(d);
    return 0;
}

/* What the fleet tells placement (core/control/fleet.h): each ready template snapshot and
 * its warmed spares. A record is made by the first boot of its size since the driver started
 * (then found on disk, or built), so one committed before a restart shows once used again. */
void sp_qemu__q_templates(sp_driver_t *base,
                          void (*fn)(const char *template_name, int cpu_count, int memory_mb,
                                     int spares, void *arg),
                          void *arg)
{
    sp_qemu_t *d = (sp_qemu_t *)base;
    if (d->cold_only)
        return;
    for (const struct tsnap *t = d->tsnaps; t != NULL; t = t->next) {
        if (t->state != TS_READY)
            continue;
        int spares = 0;
        for (const struct vm *v = d->vms; v != NULL; v = v->next)
            spares += v->pooled && v->pool_ready && !v->pool_drop && v->ph != PH_STOPPING &&
                      strcmp(v->pool_key, t->key) == 0;
        fn(t->template_name, t->cpu_count, t->memory_mb, spares, arg);
    }
}
