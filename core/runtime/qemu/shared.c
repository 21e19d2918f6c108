/*
 * shared.c - the shared snapshot dir (qemu.h: opts.snapshot_dir): storage every worker sees at
 * the same path (NFS, CephFS, or a local dir for one node), so that a sandbox suspended by one
 * worker wakes on another.
 *
 *   <snapshot-dir>/sandboxes/<id>/     a suspended sandbox: vm.json, snapshot/devstate (the
 *       whole RAM streamed in: no RAM file, no template RAM it depends on), snapshot/
 *       manifest.json (the commit, as in a VM dir), disk.qcow2 and layer-<n>.qcow2: its disk
 *       and every backing file that was outside the snapshot dir (a template snapshot's
 *       frozen overlay, a checkpoint's disk), each naming the next relatively; the last names
 *       a published template image by its absolute path in the snapshot dir.
 *   <snapshot-dir>/sandboxes/.tmp-<id>-<pid>/   one being written; renamed to <id> complete
 *   <snapshot-dir>/snapshots/<snapshot-id>/   a sandbox snapshot for every worker (driver.h:
 *       SP_CKPT_SHARED): the taker's <data-dir>/snapshots/<snapshot-id>/ (fork.c) laid out
 *       as a suspended sandbox's above, its device state as taken (a delta over the taker's
 *       template snapshot's RAM, as on one node), its manifest naming that RAM as published
 *       in snapshots/.bases/ (below) instead of by its local path, its disk's backing files
 *       outside the snapshot dir copied in as layer-<n>.qcow2. Written (.tmp-<id>-<pid>,
 *       renamed) before the take answers. A worker asked to boot from one it does not hold
 *       copies it into its own <data-dir>/snapshots/<snapshot-id>/ first (hard links where it
 *       can: nothing writes a snapshot's files), makes its RAM a delta over a template
 *       snapshot of its own, read whole over the published base on the way (localize; whole
 *       when it has none), and from then on uses that copy, kept and collected by fork.c like one
 * taken there; so nothing any VM or snapshot uses is in the shared copy, and checkpoint_delete
 * removes it at once. <snapshot-dir>/snapshots/.bases/<name>/   a template snapshot's RAM (mem.ram,
 * and sha256) some shared sandbox snapshot is a delta over, published by its taker once (a hard
 *       link where it can) and removed once no committed copy names it (bases_sweep). A
 *       worker that checked one against its checksum marks it in its own
 *       <data-dir>/snapshots/.verified/<name> (published_base), gone with the base.
 *   <snapshot-dir>/templates/<name>/<hash>/rootfs.qcow2, <snapshot-dir>/images/...
 *       template images (base image, kernel, initramfs) at the path they have under a data
 *       dir, published once by the first worker to use them (under the flock of
 *       templates/.lock; hard link when on the same file system, else a copy; renamed into
 *       place, never modified) and used by every worker from then on: VMs are made over the
 *       published copies (sp_qemu__shared_template), so a disk's chain means the same bytes
 *       everywhere. A derived template's image names its parent's published copy (export.c
 *       rebases onto it), so it is published as it is; an image whose backing file is not
 *       published stays unpublished and a suspend copies it into the sandbox's layers.
 *       A template's image is published with its manifest.json beside it, so that a worker
 *       asked for a version built elsewhere imports it (sp_tmplbuild_import: links to the
 *       published files) and builds its own template snapshots of it.
 *
 * A suspend commits in the VM dir as on one node, then (QEMU gone) a job off the loop moves
 * the snapshot into the shared dir (sp_qemu__shared_publish) and removes the VM dir; the
 * suspend answers once that is done. Should the move fail, the snapshot stays in the VM dir
 * (this worker can still wake it; logged). A wake of a sandbox whose snapshot is in the shared
 * dir copies it into <data-dir>/vms/.fetch-<id>-<pid>/ (hard links for the files nothing
 * writes, copies of the disk and any RAM file), renames that to the VM dir and restores from
 * there (snapshot.c); the shared copy is removed once the vCPUs run (sp_qemu__shared_forget),
 * or when the sandbox is deleted, by whichever worker does it.
 *
 * Does not decide which worker wakes a sandbox (the controller) nor suspend or restore a VM
 * (snapshot.c).
 */
#include "core/runtime/qemu/qemu_int.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "base/log.h"

#define LAYERS_MAX 8 /* backing files copied into a sandbox's snapshot at most */

/* Published template RAMs (the section of that name, below). */
#define BASES         "snapshots/.bases"
#define BASE_GRACE_S  3600
#define BASES_EVERY_S 300 /* bases are swept at most this often (or half the grace) */

static long long base_grace_s(void)
{
    const char *g = getenv("SPACE_SHARED_BASE_GRACE_S");
    long long v = g != NULL ? atoll(g) : -1;
    return v > 0 ? v : BASE_GRACE_S;
}

/* A wake waiting for its snapshot to be copied in, or a boot for its sandbox snapshot's:
 * the spec's strings, owned. */
struct req {
    struct req *next;
    char *id, *template_name, *hostname, *env_json, *snapshot_id;
    int cpu_count, memory_mb;
    void (*progress)(void *arg, const char *what);
    void *progress_arg;
    bool gone; /* snap fetch: the sandbox was deleted meanwhile */
    sp_driver_cb cb;
    void *arg;
};

/* A snapshot moved to the shared dir (publish: vm set) or copied from it (fetch: in
 * d->fetches); with snap, a sandbox snapshot's copied there (put) or from there (fetch), both
 * in d->fetches. The job (xfer_run, on a worker thread) touches only its paths and results. */
struct xfer {
    struct xfer *next;
    sp_qemu_t *d;  /* NULL once the driver let go of it */
    struct vm *vm; /* publish: the suspended VM; NULL once abandoned */
    bool fetch;
    bool snap;
    bool gone;              /* fetch: the sandbox was deleted meanwhile */
    struct waiter *waiters; /* snap put: the take's callers */
    char base[PATH_MAX];    /* snap: the template snapshot whose RAM this worker's copy's
                             * device state is made a delta over ("": none; localize) */
    char lwhy[160];         /* localize: why it was not, "" when it was or was not tried */
    bool localized;         /* localize: it was */
    sp_migdelta_stats_t lst;
    sp_work_t *work;
    char id[SP_QEMU_ID_MAX + 1];
    char shared[PATH_MAX]; /* the shared dir */
    char src[PATH_MAX + 96], tmp[PATH_MAX + 96], dst[PATH_MAX + 96];
    struct req *reqs;
    int rc;
    char why[200];
    uint64_t ms, bytes;
    uint64_t copy_ms, check_ms; /* snap fetch: the copy's, published_base's parts of ms */
};

static int mkdir_p(const char *path, mode_t mode)
{
    char p[PATH_MAX];
    if (sp_qemu__sfmt(p, sizeof p, "%s", path) < 0)
        return -1;
    for (char *s = p + 1; *s != '\0'; s++) {
        if (*s != '/')
            continue;
        *s = '\0';
        if (mkdir(p, mode) < 0 && errno != EEXIST)
            return -1;
        *s = '/';
    }
    return mkdir(p, mode) < 0 && errno != EEXIST ? -1 : 0;
}

static void fsync_dir_of(const char *path)
{
    char p[PATH_MAX];
    sp_qemu__sfmt(p, sizeof p, "%s", path);
    char *slash = strrchr(p, '/');
    if (slash != NULL && slash != p) {
        *slash = '\0';
        sp_qemu__fsync_path(p, O_RDONLY | O_DIRECTORY);
    }
}

/* Copies src to a new file dst (mode), holes kept as holes, and makes it durable; with
 * may_link a hard link instead where the file system allows (the caller knows nobody writes
 * either name). Bytes copied added to *bytes. 0 or -1 with errno (dst may be left). */
static int copy_file(const char *src, const char *dst, mode_t mode, bool may_link, uint64_t *bytes)
{
    if (may_link && link(src, dst) == 0)
        return 0;
    int in = open(src, O_RDONLY | O_CLOEXEC);
    if (in < 0)
        return -1;
    int out = open(dst, O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, mode);
    if (out < 0) {
        int e = errno;
        close(in);
        errno = e;
        return -1;
    }
    struct stat st;
    int rc = fstat(in, &st);
    off_t end = rc == 0 ? st.st_size : 0, pos = 0;
    char *chunk = NULL;
    while (rc == 0 && pos < end) {
        off_t data = lseek(in, pos, SEEK_DATA);
        if (data < 0) {
            if (errno == ENXIO)
                break;  /* a hole to the end */
            data = pos; /* no SEEK_DATA here: copy everything */
        }
        off_t hole = lseek(in, data, SEEK_HOLE);
        if (hole < 0 || hole > end)
            hole = end;
        while (rc == 0 && data < hole) {
            size_t want = (size_t)(hole - data > (1 << 24) ? (1 << 24) : hole - data);
            loff_t a = data, b = data;
            ssize_t k = copy_file_range(in, &a, out, &b, want, 0);
            if (k < 0 &&
                (errno == EXDEV || errno == ENOSYS || errno == EINVAL || errno == EOPNOTSUPP)) {
                if (chunk == NULL && (chunk = malloc(1 << 20)) == NULL) {
                    rc = -1;
                    break;
                }
                k = pread(in, chunk, want > (1 << 20) ? (1 << 20) : want, data);
                if (k > 0 && pwrite(out, chunk, (size_t)k, data) != k)
                    k = -1;
            }
            if (k <= 0) {
                if (k == 0)
                    errno = EIO; /* the file shrank under us */
                rc = -1;
                break;
            }
            data += k;
            *bytes += (uint64_t)k;
        }
        pos = hole;
    }
    free(chunk);
    if (rc == 0 && (ftruncate(out, end) < 0 || fsync(out) < 0))
        rc = -1;
    int e = errno;
    close(in);
    close(out);
    errno = e;
    return rc;
}

static int fail(struct xfer *x, const char *what, const char *path)
{
    sp_qemu__sfmt(x->why, sizeof x->why, "%s %s: %s", what, path, strerror(errno));
    return -1;
}

/* ---------- publish: a suspended sandbox's snapshot into the shared dir ---------- */

/* The disk and its backing files outside the shared dir into x->tmp: disk.qcow2, then
 * layer-1.qcow2, ... each naming the next relatively. A file whose name for its backing file
 * changes is copied (its header is rewritten); the VM dir's own are linked where they can
 * be (the VM dir goes once the move is done). Sets *rewrote when disk.qcow2's header changed
 * (its checksum in the manifest must then be the copy's). */
static int publish_disk(struct xfer *x, bool *rewrote)
{
    char cur[PATH_MAX], next[PATH_MAX], raw[PATH_MAX], out[PATH_MAX + 128], want[64];
    sp_qemu__sfmt(cur, sizeof cur, "%s/disk.qcow2", x->src);
    *rewrote = false;
    for (int k = 0;; k++) {
        if (k > LAYERS_MAX) {
            errno = ELOOP;
            return fail(x, "too many backing files under", x->src);
        }
        if (k == 0)
            sp_qemu__sfmt(out, sizeof out, "%s/disk.qcow2", x->tmp);
        else
            sp_qemu__sfmt(out, sizeof out, "%s/layer-%d.qcow2", x->tmp, k);
        bool has = sp_qemu__qcow2_backing(cur, next, sizeof next) &&
                   sp_qemu__qcow2_backing_name(cur, raw, sizeof raw);
        if (has && sp_qemu__path_under(next, x->shared))
            sp_qemu__sfmt(want, sizeof want, "%s", ""); /* keeps its absolute name */
        else if (has)
            sp_qemu__sfmt(want, sizeof want, "layer-%d.qcow2", k + 1);
        bool rename_backing = has && want[0] != '\0' && strcmp(raw, want) != 0;
        if (has && want[0] == '\0' && strcmp(raw, next) != 0)
            rename_backing = true; /* a relative name into the shared dir: made absolute */
        if (copy_file(cur, out, 0644, !rename_backing && sp_qemu__path_under(cur, x->src),
                      &x->bytes) < 0)
            return fail(x, "cannot copy", cur);
        if (rename_backing && sp_qemu__qcow2_set_backing(out, want[0] != '\0' ? want : next) < 0)
            return fail(x, "cannot name the backing file of", out);
        if (k == 0)
            *rewrote = rename_backing;
        if (!has || want[0] == '\0')
            return 0;
        memcpy(cur, next, sizeof cur);
    }
}

/* vm.json without what names this worker's files: the template RAM a clone mapped (its
 * snapshot streamed the whole RAM, so nothing depends on it). */
static int publish_vm_json(struct xfer *x)
{
    char p[PATH_MAX + 32];
    sp_qemu__sfmt(p, sizeof p, "%s/vm.json", x->src);
    json_t *o = json_load_file(p, 0, NULL);
    if (o == NULL) {
        errno = EINVAL;
        return fail(x, "cannot read", p);
    }
    json_object_del(o, "ram_src");
    char *js = json_dumps(o, JSON_COMPACT);
    json_decref(o);
    sp_qemu__sfmt(p, sizeof p, "%s/vm.json", x->tmp);
    int rc = js != NULL ? sp_qemu__write_atomic(p, js, strlen(js)) : -1;
    free(js);
    return rc < 0 ? fail(x, "cannot write", p) : 0;
}

typedef int (*recode_fn)(int, int, const char *, const char *, sp_migdelta_stats_t *, char *,
                         size_t);

/* The first stage of a recode through a pipe: sp_migdelta_expand of in over base into out,
 * which it closes when done (the reader then sees the end). */
struct expander {
    int in, out;
    char base[PATH_MAX + 240];
    sp_migdelta_stats_t st;
    char why[160];
    int rc;
};

static void *expander_run(void *arg)
{
    struct expander *e = arg;
    e->rc = sp_migdelta_expand(e->in, e->out, e->base, "mem", &e->st, e->why, sizeof e->why);
    close(e->out);
    return NULL;
}

/* Writes to the new file out what fn (sp_migdelta_filter or sp_migdelta_expand) makes of the
 * device state in against base_dir's RAM file, durable, and sets man's ram ("delta" over
 * base_dir, else "stream") and the device state's size and checksum to out's. With via (a
 * published base's dir: published_base), in is a delta over via's RAM file, made whole on the way
 * by a thread feeding fn through a pipe (the whole stream is never written). 0, or -1 with why (man
 * untouched). Runs on a worker thread. */
static int recode_devstate(recode_fn fn, const char *in, const char *via, const char *out,
                           const char *base_dir, json_t *man, sp_migdelta_stats_t *st, char *why,
                           size_t why_len)
{
    char ram[PATH_MAX + 16], hex[65];
    sp_qemu__sfmt(ram, sizeof ram, "%s/mem.ram", base_dir);
    int dfd = open(in, O_RDONLY | O_CLOEXEC);
    int ofd = open(out, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
    int ifd = dfd; /* what fn reads */
    uint64_t size = 0;
    struct expander ex;
    pthread_t th;
    bool piped = false;
    int rc = 0;
    if (dfd < 0 || ofd < 0) {
        sp_qemu__sfmt(why, why_len, "cannot open %s: %s", dfd < 0 ? in : out, strerror(errno));
        rc = -1;
    } else if (via != NULL) {
        int pfd[2];
        if (pipe2(pfd, O_CLOEXEC) < 0) {
            sp_qemu__sfmt(why, why_len, "cannot make a pipe: %s", strerror(errno));
            rc = -1;
        } else {
            (void)fcntl(pfd[1], F_SETPIPE_SZ, 1 << 20);
            memset(&ex, 0, sizeof ex);
            ex.in = dfd;
            ex.out = pfd[1];
            sp_qemu__sfmt(ex.base, sizeof ex.base, "%s/mem.ram", via);
            piped = pthread_create(&th, NULL, expander_run, &ex) == 0;
            if (piped) {
                ifd = pfd[0];
            } else {
                close(pfd[0]);
                close(pfd[1]);
                sp_qemu__sfmt(why, why_len, "cannot start a thread");
                rc = -1;
            }
        }
    }
    if (rc == 0)
        rc = fn(ifd, ofd, ram, "mem", st, why, why_len);
    if (piped) {
        close(ifd); /* a writer still going gets EPIPE */
        pthread_join(th, NULL);
        if (ex.rc < 0 && rc == 0) {
            sp_qemu__sfmt(why, why_len, "%s", ex.why);
            rc = -1;
        }
    }
    if (rc == 0 && (fsync(ofd) < 0 || sp_qemu__sum_file(out, &size, hex) < 0)) {
        sp_qemu__sfmt(why, why_len, "cannot write %s: %s", out, strerror(errno));
        rc = -1;
    }
    if (dfd >= 0)
        close(dfd);
    if (ofd >= 0)
        close(ofd);
    if (rc < 0)
        return -1;
    bool delta = fn == sp_migdelta_filter;
    json_object_set_new(man, "ram", json_string(delta ? "delta" : "stream"));
    if (delta)
        json_object_set_new(man, "ram_base", json_string(base_dir));
    else
        json_object_del(man, "ram_base");
    json_object_del(man, "ram_base_shared");
    json_object_del(man, "ram_base_checksum");
    json_object_set_new(man, "devstate_bytes", json_integer((json_int_t)size));
    json_object_set_new(man, "devstate_checksum", json_string(hex));
    return 0;
}

static int publish_base(struct xfer *x, json_t *man);
static int published_base(struct xfer *x, const char *dir, char *via, size_t n);

static int publish_run(struct xfer *x)
{
    char p[PATH_MAX + 64], q[PATH_MAX + 64];
    sp_rm_rf(x->tmp);
    sp_qemu__sfmt(p, sizeof p, "%s/snapshot", x->tmp);
    mode_t dm = x->snap ? 0755 : 0700; /* a sandbox snapshot's: as fork.c makes them */
    if (mkdir(x->tmp, dm) < 0 || mkdir(p, dm) < 0)
        return fail(x, "cannot create", p);
    sp_qemu__sfmt(p, sizeof p, "%s/snapshot/manifest.json", x->src);
    json_t *man = json_load_file(p, 0, NULL);
    char ram[16];
    sp_qemu__sfmt(ram, sizeof ram, "%s", json_string_value(json_object_get(man, "ram")) ?: "");
    bool delta = strcmp(ram, "delta") == 0;
    if (ram[0] == '\0' || (delta && !x->snap)) {
        json_decref(man);
        errno = EINVAL;
        return fail(x, "a snapshot that depends on this worker's template RAM:", p);
    }
    bool rewrote;
    int rc = publish_vm_json(x);
    if (rc == 0)
        rc = publish_disk(x, &rewrote);
    static const char *const own[] = {"snapshot/devstate", "mem.ram"};
    for (size_t i = 0; rc == 0 && i < sizeof own / sizeof own[0]; i++) {
        if (i == 1 && strcmp(ram, "mem.ram") != 0)
            break;
        if (i == 0 && delta && (rc = publish_base(x, man)) < 0)
            break;
        sp_qemu__sfmt(p, sizeof p, "%s/%s", x->src, own[i]);
        sp_qemu__sfmt(q, sizeof q, "%s/%s", x->tmp, own[i]);
        if (copy_file(p, q, 0600, true, &x->bytes) < 0)
            rc = fail(x, "cannot copy", p);
    }
    if (rc == 0 && rewrote) { /* its header changed: the manifest has the copy's checksum */
        char hex[65];
        uint64_t size;
        sp_qemu__sfmt(p, sizeof p, "%s/disk.qcow2", x->tmp);
        if (sp_qemu__sum_file(p, &size, hex) < 0) {
            rc = fail(x, "cannot checksum", p);
        } else {
            json_object_set_new(man, "disk_checksum", json_string(hex));
            json_object_set_new(man, "disk_bytes", json_integer((json_int_t)size));
        }
    }
    char *js = rc == 0 ? json_dumps(man, JSON_COMPACT) : NULL;
    json_decref(man);
    sp_qemu__sfmt(p, sizeof p, "%s/snapshot/manifest.json", x->tmp);
    if (rc == 0 && (js == NULL || sp_qemu__write_atomic(p, js, strlen(js)) < 0))
        rc = fail(x, "cannot write", p);
    free(js);
    if (rc < 0)
        return -1;
    sp_qemu__sfmt(p, sizeof p, "%s/snapshot", x->tmp);
    sp_qemu__fsync_path(p, O_RDONLY | O_DIRECTORY);
    sp_qemu__fsync_path(x->tmp, O_RDONLY | O_DIRECTORY);
    sp_rm_rf(x->dst); /* an older one is stale: this sandbox ran since (a snapshot: none) */
    if (rename(x->tmp, x->dst) < 0)
        return fail(x, "cannot rename into place", x->dst);
    fsync_dir_of(x->dst);
    return 0;
}

/* ---------- fetch: a snapshot from the shared dir into a VM dir ---------- */

static int fetch_copy_dir(struct xfer *x, const char *sub)
{
    char from[PATH_MAX + 64], to[PATH_MAX + 64], p[PATH_MAX * 2], q[PATH_MAX * 2];
    sp_qemu__sfmt(from, sizeof from, "%s%s", x->src, sub);
    sp_qemu__sfmt(to, sizeof to, "%s%s", x->tmp, sub);
    if (mkdir(to, x->snap ? 0755 : 0700) < 0)
        return fail(x, "cannot create", to);
    DIR *dir = opendir(from);
    if (dir == NULL)
        return fail(x, "cannot read", from);
    struct dirent *de;
    int rc = 0;
    while (rc == 0 && (de = readdir(dir)) != NULL) {
        if (de->d_name[0] == '.' || strcmp(de->d_name, "snapshot") == 0)
            continue;
        snprintf(p, sizeof p, "%s/%s", from, de->d_name);
        snprintf(q, sizeof q, "%s/%s", to, de->d_name);
        /* QEMU writes the disk and a RAM file: those are copies; the rest is only read (or
         * replaced by a rename). Nothing writes a sandbox snapshot's. */
        bool writes = !x->snap &&
                      (strcmp(de->d_name, "disk.qcow2") == 0 || strcmp(de->d_name, "mem.ram") == 0);
        if (copy_file(p, q, writes ? 0600 : 0644, !writes, &x->bytes) < 0)
            rc = fail(x, "cannot copy", p);
    }
    closedir(dir);
    if (rc == 0)
        sp_qemu__fsync_path(to, O_RDONLY | O_DIRECTORY);
    return rc;
}

static int fetch_run(struct xfer *x)
{
    sp_rm_rf(x->tmp);
    if (fetch_copy_dir(x, "") < 0 || fetch_copy_dir(x, "/snapshot") < 0)
        return -1;
    return 0;
}

/* ---------- a sandbox snapshot's RAM as a delta on this worker ---------- */

/* Rewrites the device state of the snapshot in dir with fn over base_dir's RAM file (made
 * whole over via's first, when via is a published base: recode_devstate), its manifest to
 * match and, for a delta, vm.json's ram_src; device state and manifest are renamed over, so
 * the shared copy's (a hard link) stays as it is. 0, or -1 with why. Runs on a worker thread. */
static int rewrite(const char *dir, recode_fn fn, const char *via, const char *base_dir,
                   sp_migdelta_stats_t *st, char *why, size_t why_len)
{
    char dev[PATH_MAX + 64], tmp[PATH_MAX + 64], man[PATH_MAX + 64], mtmp[PATH_MAX + 64],
        vmj[PATH_MAX + 64];
    sp_qemu__sfmt(dev, sizeof dev, "%s/snapshot/devstate", dir);
    sp_qemu__sfmt(tmp, sizeof tmp, "%s/snapshot/devstate.new", dir);
    sp_qemu__sfmt(man, sizeof man, "%s/snapshot/manifest.json", dir);
    sp_qemu__sfmt(mtmp, sizeof mtmp, "%s/snapshot/manifest.json.new", dir);
    sp_qemu__sfmt(vmj, sizeof vmj, "%s/vm.json", dir);
    json_t *m = json_load_file(man, 0, NULL), *v = json_load_file(vmj, 0, NULL);
    int rc = -1;
    if (m == NULL || v == NULL) {
        sp_qemu__sfmt(why, why_len, "cannot read its manifest or vm.json");
    } else if (recode_devstate(fn, dev, via, tmp, base_dir, m, st, why, why_len) == 0) {
        if (fn == sp_migdelta_filter)
            json_object_set_new(v, "ram_src", json_string(base_dir));
        char *mj = json_dumps(m, JSON_COMPACT), *vj = json_dumps(v, JSON_COMPACT);
        /* vm.json first (ram_src means nothing to a whole-RAM snapshot); a crash between the
         * two renames leaves a device state its manifest's checksum refuses, never a wrong
         * one */
        bool ok = mj != NULL && vj != NULL && sp_qemu__write_atomic(mtmp, mj, strlen(mj)) == 0 &&
                  sp_qemu__write_atomic(vmj, vj, strlen(vj)) == 0 && rename(tmp, dev) == 0 &&
                  rename(mtmp, man) == 0;
        free(mj);
        free(vj);
        if (ok) {
            char sd[PATH_MAX + 16];
            sp_qemu__sfmt(sd, sizeof sd, "%s/snapshot", dir);
            sp_qemu__fsync_path(sd, O_RDONLY | O_DIRECTORY);
            rc = 0;
        } else {
            sp_qemu__sfmt(why, why_len, "cannot rewrite: %s", strerror(errno));
        }
    }
    unlink(tmp);
    unlink(mtmp);
    json_decref(m);
    json_decref(v);
    return rc;
}

/* Makes the device state of the snapshot in dir (this worker's copy: one copied in, or the
 * taker's when it was not taken as a delta, as a VM with RAM of its own is not) a delta over
 * x->base's RAM file, as a clone's suspend writes it (sp_migdelta_filter: only the pages that
 * differ; the result loads over any RAM file of that size the same as the whole stream), so
 * that its forks here map that template RAM privately and load only their own pages, as
 * clones of the template do: a boot of 0.3 s instead of 1.5-2.5 s for 256 MiB under TCG, and
 * RAM shared with the template's clones. Any template snapshot RAM of the snapshot's size
 * serves; one of its own template shares the most. The device state is whole, or (via: a
 * shared copy's, published_base) a delta over a published base, made whole on the way. On
 * any failure the copy stays as it was; x->lwhy says why. A delta over a template snapshot
 * here already is left alone. Runs on a worker thread. */
static void localize(struct xfer *x, const char *dir, const char *via)
{
    char man[PATH_MAX + 64], ram[PATH_MAX + 16];
    sp_qemu__sfmt(man, sizeof man, "%s/snapshot/manifest.json", dir);
    sp_qemu__sfmt(ram, sizeof ram, "%s/mem.ram", x->base);
    json_t *m = json_load_file(man, 0, NULL);
    const char *kind = json_string_value(json_object_get(m, "ram"));
    long long mem = (long long)json_integer_value(json_object_get(m, "memory_mb"));
    struct stat st;
    if (via[0] == '\0' && kind != NULL && strcmp(kind, "delta") == 0) {
        /* one already (the taker's, as taken) */
    } else if (kind == NULL || strcmp(kind, via[0] != '\0' ? "delta" : "stream") != 0) {
        sp_qemu__sfmt(x->lwhy, sizeof x->lwhy, "not a whole-RAM snapshot");
    } else if (stat(ram, &st) < 0 || (long long)st.st_size != mem << 20) {
        sp_qemu__sfmt(x->lwhy, sizeof x->lwhy, "the template RAM is not of its size");
    } else {
        x->localized = rewrite(dir, sp_migdelta_filter, via[0] != '\0' ? via : NULL, x->base,
                               &x->lst, x->lwhy, sizeof x->lwhy) == 0;
    }
    json_decref(m);
}

static void xfer_run(sp_work_t *w, void *arg)
{
    (void)w;
    struct xfer *x = arg;
    uint64_t t0 = sp_qemu__mono_ms();
    char via[PATH_MAX + 200] = "";
    x->rc = x->fetch ? fetch_run(x) : publish_run(x);
    x->copy_ms = sp_qemu__mono_ms() - t0;
    if (x->rc == 0 && x->snap && x->fetch)
        x->rc = published_base(x, x->tmp, via, sizeof via);
    x->check_ms = sp_qemu__mono_ms() - t0 - x->copy_ms;
    if (x->rc == 0 && x->snap && x->base[0] != '\0')
        localize(x, x->fetch ? x->tmp : x->src, via);
    if (x->rc == 0 && via[0] != '\0' && !x->localized) { /* no delta here: made whole */
        char why[160];
        sp_migdelta_stats_t st;
        if (rewrite(x->tmp, sp_migdelta_expand, NULL, via, &st, why, sizeof why) < 0) {
            sp_qemu__sfmt(x->why, sizeof x->why, "cannot make its whole RAM: %s", why);
            x->rc = -1;
        }
    }
    if (x->rc == 0 && !x->fetch && !x->snap)
        sp_rm_rf(x->src); /* nothing of it stays on this worker */
    if (x->rc < 0)
        sp_rm_rf(x->tmp);
    x->ms = sp_qemu__mono_ms() - t0;
}

static void req_free(struct req *r)
{
    free(r->id);
    free(r->template_name);
    free(r->hostname);
    free(r->env_json);
    free(r->snapshot_id);
    free(r);
}

static void xfer_free(struct xfer *x)
{
    while (x->reqs != NULL) {
        struct req *n = x->reqs->next;
        req_free(x->reqs);
        x->reqs = n;
    }
    while (x->waiters != NULL) { /* answered already, or the driver is gone */
        struct waiter *n = x->waiters->next;
        free(x->waiters);
        x->waiters = n;
    }
    free(x);
}

static void log_localized(const struct xfer *x)
{
    if (x->base[0] == '\0' || (!x->localized && x->lwhy[0] == '\0'))
        return;
    if (x->lwhy[0] != '\0')
        sp_log(SP_LOG_WARN, "qemu",
               "sandbox snapshot kept whole here snapshot=%s base=%s reason=\"%s\" (its forks "
               "here load the whole RAM)",
               x->id, x->base, x->lwhy);
    else
        sp_log(SP_LOG_INFO, "qemu",
               "sandbox snapshot here as a RAM delta snapshot=%s base=%s pages=%llu/%llu "
               "bytes=%llu->%llu",
               x->id, x->base, (unsigned long long)x->lst.pages_kept,
               (unsigned long long)x->lst.pages_in, (unsigned long long)x->lst.bytes_in,
               (unsigned long long)x->lst.bytes_out);
}

static void unlist(struct xfer *x)
{
    for (struct xfer **pp = &x->d->fetches; *pp != NULL; pp = &(*pp)->next)
        if (*pp == x) {
            *pp = x->next;
            break;
        }
}

/* A sandbox snapshot's copy into the shared dir is done: the take answers. Should it have
 * failed, the snapshot is not kept here either (ready means every worker can boot from it). */
static void snap_put_done(struct xfer *x)
{
    sp_qemu_t *d = x->d;
    if (d == NULL) { /* the driver is gone: the next start fails the take and drops both */
        xfer_free(x);
        return;
    }
    unlist(x);
    sp_err_t e;
    if (x->rc < 0) {
        sp_log(SP_LOG_ERROR, "qemu",
               "sandbox snapshot not copied to the snapshot dir snapshot=%s "
               "err=\"%s\"",
               x->id, x->why);
        sp_err_set(&e, SP_ERUNTIME, "cannot copy the snapshot to the shared snapshot dir");
        sp_qemu__discard(d, x->src);
        sp_qemu__fsync_path(d->snaps_dir, O_RDONLY | O_DIRECTORY);
    } else {
        sp_log(SP_LOG_INFO, "qemu",
               "sandbox snapshot copied to the snapshot dir snapshot=%s bytes=%llu ms=%llu", x->id,
               (unsigned long long)x->bytes, (unsigned long long)x->ms);
        log_localized(x);
    }
    sp_qemu__complete_all(d, &x->waiters, x->rc < 0 ? &e : NULL);
    xfer_free(x);
}

static void publish_done(struct xfer *x)
{
    struct vm *vm = x->vm;
    if (vm == NULL) { /* deleted meanwhile: what the job may have put in place goes too */
        if (x->rc == 0 && x->d != NULL)
            sp_qemu__discard(x->d, x->dst);
        else if (x->rc == 0)
            sp_rm_rf(x->dst);
        xfer_free(x);
        return;
    }
    vm->publish = NULL;
    if (x->rc < 0)
        sp_log(SP_LOG_ERROR, "qemu",
               "suspended sandbox not moved to the snapshot dir sandbox=%s err=\"%s\": its "
               "snapshot stays on this worker, which alone can wake it",
               x->id, x->why);
    else
        sp_log(SP_LOG_INFO, "qemu",
               "snapshot moved to the snapshot dir sandbox=%s bytes=%llu ms=%llu", x->id,
               (unsigned long long)x->bytes, (unsigned long long)x->ms);
    xfer_free(x);
    sp_qemu__suspend_release(vm);
}

/* A snapshot was copied in from the shared dir (or not): a suspended sandbox's into its VM
 * dir, each wake waiting for it restoring it from there; a sandbox snapshot's into this
 * worker's snapshots, each boot waiting for it starting over (driver.c: q_boot, which now
 * finds it here). Or they fail. */
static void fetch_done(struct xfer *x)
{
    sp_qemu_t *d = x->d;
    if (d == NULL) {
        sp_rm_rf(x->tmp);
        xfer_free(x);
        return;
    }
    unlist(x);
    const char *what = x->snap ? "sandbox snapshot" : "snapshot";
    sp_err_t e;
    struct stat st;
    if (x->gone) {
        sp_err_set(&e, SP_ERUNTIME, "wake cancelled: the sandbox was deleted");
        x->rc = -1;
    } else if (x->rc < 0) {
        sp_log(SP_LOG_WARN, "qemu", "cannot copy in %s=%s err=\"%s\"",
               x->snap ? "sandbox snapshot" : "the snapshot of sandbox", x->id, x->why);
        sp_err_set(&e, SP_ERUNTIME, "cannot %s: the snapshot cannot be read from the snapshot dir",
                   x->snap ? "boot" : "wake");
    } else if (x->snap && lstat(x->dst, &st) == 0) {
        sp_qemu__discard(d, x->tmp); /* it is here already */
    } else {
        if (!x->snap)
            sp_qemu__discard(d, x->dst); /* an earlier wake's leftovers: the shared copy is newer */
        if (rename(x->tmp, x->dst) < 0) {
            sp_log(SP_LOG_WARN, "qemu", "cannot rename the %s in id=%s err=%s", what, x->id,
                   strerror(errno));
            sp_err_set(&e, SP_ERUNTIME, "cannot %s: the snapshot cannot be copied in",
                       x->snap ? "boot" : "wake");
            x->rc = -1;
        } else {
            char parts[96] = "";
            if (x->snap)
                snprintf(parts, sizeof parts, " (copy %llu, base checked %llu, RAM %llu)",
                         (unsigned long long)x->copy_ms, (unsigned long long)x->check_ms,
                         (unsigned long long)(x->ms - x->copy_ms - x->check_ms));
            sp_log(SP_LOG_INFO, "qemu",
                   "%s copied in from the snapshot dir id=%s bytes=%llu ms=%llu%s", what, x->id,
                   (unsigned long long)x->bytes, (unsigned long long)x->ms, parts);
            log_localized(x);
        }
    }
    if (x->rc < 0)
        sp_qemu__discard(d, x->tmp);
    for (struct req *r = x->reqs; r != NULL; r = r->next) {
        sp_vm_spec_t spec = {.sandbox_id = r->id,
                             .template_name = r->template_name,
                             .cpu_count = r->cpu_count,
                             .memory_mb = r->memory_mb,
                             .hostname = r->hostname,
                             .env_json = r->env_json,
                             .snapshot_id = r->snapshot_id,
                             .progress = r->progress,
                             .progress_arg = r->progress_arg};
        sp_err_t re = e;
        if (r->gone)
            sp_err_set(&re, SP_ERUNTIME, "boot cancelled: the sandbox was deleted");
        bool ok = !r->gone && x->rc == 0 &&
                  (x->snap ? d->base.ops->boot(&d->base, &spec, r->cb, r->arg, &re)
                           : sp_qemu__restore_local(d, &spec, r->cb, r->arg, &re)) == 0;
        if (!ok && sp_qemu__complete(d, r->cb, r->arg, &re) < 0)
            sp_log(SP_LOG_ERROR, "qemu", "%s lost its answer sandbox=%s (no memory)",
                   x->snap ? "boot" : "wake", r->id);
    }
    xfer_free(x);
}

static void xfer_done(void *arg, bool cancelled)
{
    (void)cancelled;
    struct xfer *x = arg;
    x->work = NULL;
    if (x->snap && !x->fetch)
        snap_put_done(x);
    else if (x->fetch)
        fetch_done(x);
    else
        publish_done(x);
}

static struct xfer *xfer_new(sp_qemu_t *d, const char *id, bool fetch, bool snap)
{
    struct xfer *x = calloc(1, sizeof(*x));
    if (x == NULL)
        return NULL;
    x->d = d;
    x->fetch = fetch;
    x->snap = snap;
    sp_qemu__sfmt(x->id, sizeof x->id, "%s", id);
    sp_qemu__sfmt(x->shared, sizeof x->shared, "%s", d->shared_dir);
    if (snap && fetch) {
        sp_qemu__sfmt(x->src, sizeof x->src, "%s/snapshots/%s", d->shared_dir, id);
        sp_qemu__sfmt(x->tmp, sizeof x->tmp, "%s/.fetch-%s-%d", d->snaps_dir, id, (int)getpid());
        sp_qemu__sfmt(x->dst, sizeof x->dst, "%s/%s", d->snaps_dir, id);
    } else if (snap) {
        sp_qemu__sfmt(x->src, sizeof x->src, "%s/%s", d->snaps_dir, id);
        sp_qemu__sfmt(x->tmp, sizeof x->tmp, "%s/snapshots/.tmp-%s-%d", d->shared_dir, id,
                      (int)getpid());
        sp_qemu__sfmt(x->dst, sizeof x->dst, "%s/snapshots/%s", d->shared_dir, id);
    } else if (fetch) {
        sp_qemu__sfmt(x->src, sizeof x->src, "%s/sandboxes/%s", d->shared_dir, id);
        sp_qemu__sfmt(x->tmp, sizeof x->tmp, "%s/.fetch-%s-%d", d->vms_dir, id, (int)getpid());
        sp_qemu__sfmt(x->dst, sizeof x->dst, "%s/%s", d->vms_dir, id);
    } else {
        sp_qemu__sfmt(x->src, sizeof x->src, "%s/%s", d->vms_dir, id);
        sp_qemu__sfmt(x->tmp, sizeof x->tmp, "%s/sandboxes/.tmp-%s-%d", d->shared_dir, id,
                      (int)getpid());
        sp_qemu__sfmt(x->dst, sizeof x->dst, "%s/sandboxes/%s", d->shared_dir, id);
    }
    return x;
}

/* A copy the driver owns (a wake's, or a sandbox snapshot's either way; base: see localize,
 * NULL for a wake) started and put in d->fetches; NULL when out of memory. */
static struct xfer *xfer_start(sp_qemu_t *d, const char *id, bool fetch, bool snap,
                               const char *base)
{
    struct xfer *x = xfer_new(d, id, fetch, snap);
    if (x != NULL)
        sp_qemu__sfmt(x->base, sizeof x->base, "%s", base != NULL ? base : "");
    if (x != NULL)
        x->work = sp_loop_work(d->base.loop, SP_WORK_LONG, xfer_run, xfer_done, x);
    if (x == NULL || x->work == NULL) {
        free(x);
        return NULL;
    }
    x->next = d->fetches;
    d->fetches = x;
    return x;
}

/* ---------- listing the shared sandbox snapshots ---------- */

/* The shared dir's snapshots/ as a job last listed it: names (committed copies, and the
 * .tmp-* ones being written or left by a dead worker) with their manifests' mtimes. A listing
 * reads the shared file system (NFS, say), so it runs off the loop; the loop uses the last
 * one and starts the next (at most one in flight), so what it sees is one sweep old. */
struct lsent {
    char name[SP_QEMU_ID_MAX + 32];
    long long mtime; /* the manifest's; -1: not committed */
};
struct shared_ls {
    sp_qemu_t *d; /* NULL once the driver let go: the job's done frees it */
    sp_work_t *work;
    char dir[PATH_MAX + 32];
    char marks[PATH_MAX + 32]; /* this worker's .verified (published_base) */
    time_t bases_at;           /* the last bases_sweep (the job's alone) */
    struct lsent *cur, *next; /* the last listing (loop's), the one being made (job's) */
    size_t ncur, nnext;
    bool next_ok;
};

static void bases_sweep(const char *sdir, const char *marks, const struct lsent *v, size_t n,
                        time_t since);

static void ls_run(sp_work_t *w, void *arg)
{
    (void)w;
    struct shared_ls *l = arg;
    l->next = NULL;
    l->nnext = 0;
    l->next_ok = false;
    time_t since = time(NULL);
    DIR *dh = opendir(l->dir);
    if (dh == NULL) {
        l->next_ok = errno == ENOENT;
        return;
    }
    size_t cap = 0;
    struct dirent *de;
    l->next_ok = true;
    while ((de = readdir(dh)) != NULL) {
        if (strcmp(de->d_name, ".") == 0 || strcmp(de->d_name, "..") == 0 ||
            strlen(de->d_name) >= sizeof l->next[0].name)
            continue;
        if (l->nnext == cap) {
            size_t nc = cap ? 2 * cap : 32;
            struct lsent *v = realloc(l->next, nc * sizeof *v);
            if (v == NULL) {
                l->next_ok = false;
                break;
            }
            l->next = v;
            cap = nc;
        }
        struct lsent *e = &l->next[l->nnext++];
        sp_qemu__sfmt(e->name, sizeof e->name, "%s", de->d_name);
        char p[PATH_MAX + 400];
        struct stat st;
        sp_qemu__sfmt(p, sizeof p, "%s/%s/snapshot/manifest.json", l->dir, de->d_name);
        e->mtime = de->d_name[0] != '.' && stat(p, &st) == 0 ? (long long)st.st_mtime : -1;
    }
    closedir(dh);
    /* every committed copy's manifest is read: not at every listing */
    long long every = base_grace_s() / 2 < BASES_EVERY_S ? base_grace_s() / 2 : BASES_EVERY_S;
    if (l->next_ok && since - l->bases_at >= every) {
        bases_sweep(l->dir, l->marks, l->next, l->nnext, since);
        l->bases_at = since;
    }
}

static void ls_done(void *arg, bool cancelled)
{
    (void)cancelled;
    struct shared_ls *l = arg;
    l->work = NULL;
    if (l->d == NULL || !l->next_ok) {
        free(l->next);
        l->next = NULL;
        if (l->d == NULL) {
            free(l->cur);
            free(l);
        }
        return;
    }
    free(l->cur);
    l->cur = l->next;
    l->ncur = l->nnext;
    l->next = NULL;
}

/* The last listing (NULL: none yet), and the next one started. */
static const struct shared_ls *ls_get(sp_qemu_t *d)
{
    if (d->shared_dir[0] == '\0')
        return NULL;
    if (d->snap_ls == NULL) {
        if ((d->snap_ls = calloc(1, sizeof *d->snap_ls)) == NULL)
            return NULL;
        d->snap_ls->d = d;
        sp_qemu__sfmt(d->snap_ls->dir, sizeof d->snap_ls->dir, "%s/snapshots", d->shared_dir);
        sp_qemu__sfmt(d->snap_ls->marks, sizeof d->snap_ls->marks, "%s/.verified", d->snaps_dir);
    }
    struct shared_ls *l = d->snap_ls;
    if (l->work == NULL)
        l->work = sp_loop_work(d->base.loop, SP_WORK_LONG, ls_run, ls_done, l);
    return l;
}

static void ls_free(sp_qemu_t *d)
{
    struct shared_ls *l = d->snap_ls;
    d->snap_ls = NULL;
    if (l == NULL)
        return;
    if (l->work != NULL) {
        l->d = NULL; /* ls_done frees it */
        sp_work_cancel(l->work);
        return;
    }
    free(l->cur);
    free(l);
}

/* ---------- the template RAM a shared sandbox snapshot is a delta over ---------- */

/* <snapshot-dir>/snapshots/.bases/<name>/: mem.ram (a template snapshot's RAM, published by
 * the worker that took a sandbox snapshot over it) and sha256 (its checksum, written last:
 * the commit). The directory's mtime is touched, under .bases/.lock, each time a snapshot
 * copy is about to name it; the listing job removes one that no committed copy names and
 * that was not touched for BASE_GRACE_S (SPACE_SHARED_BASE_GRACE_S) before that listing
 * began, re-checked under the lock: a copy being written names a base touched less than the
 * grace ago, and once committed its manifest holds it. The sweep runs with a listing at
 * most every BASES_EVERY_S (or half the grace): it reads every committed copy's manifest. */

/* The name a template snapshot's RAM is published under: its version's hash (12 hex digits)
 * and its own directory's name (size and key); false when dir is not of that form. */
static bool base_name(const char *dir, char *out, size_t n)
{
    const char *leaf = strrchr(dir, '/');
    if (leaf == NULL || leaf == dir)
        return false;
    const char *ver = leaf - 1;
    while (ver > dir && *ver != '/')
        ver--;
    int vl = (int)(leaf - ver - 1);
    if (*ver != '/' || vl < 12 || strchr(leaf + 1, '.') != NULL || leaf[1] == '\0')
        return false;
    int k = sp_qemu__sfmt(out, n, "%.12s-%s", ver + 1, leaf + 1);
    return k > 0 && (size_t)k < n;
}

/* Opens and locks <shared>/snapshots/.bases/.lock (made with the dir); -1 with x->why. */
static int bases_lock(struct xfer *x, char *bases, size_t n)
{
    char lock[PATH_MAX + 64];
    sp_qemu__sfmt(bases, n, "%s/" BASES, x->shared);
    sp_qemu__sfmt(lock, sizeof lock, "%s/.lock", bases);
    int fd = mkdir_p(bases, 0755) < 0 ? -1 : open(lock, O_RDWR | O_CREAT | O_CLOEXEC, 0600);
    if (fd < 0 || flock(fd, LOCK_EX) < 0) {
        if (fd >= 0)
            close(fd);
        fail(x, "cannot lock", lock);
        return -1;
    }
    return fd;
}

/* A snapshot taken as a delta over this worker's template snapshot RAM (as on one node: its
 * vCPUs stop only while its own pages are written) keeps that form in the shared copy: that
 * RAM is published once as a base (above; a hard link where the file system allows, else a
 * copy, with its checksum), and man names it (ram_base_shared, ram_base_checksum) instead of
 * the local path. So a copy costs its own pages, not the whole RAM, written, checksummed and
 * synced before the take answers. Runs on a worker thread. */
static int publish_base(struct xfer *x, json_t *man)
{
    const char *local = json_string_value(json_object_get(man, "ram_base"));
    char name[128], bases[PATH_MAX + 64], bdir[PATH_MAX + 200], tmp[PATH_MAX + 220],
        p[PATH_MAX + 240], q[PATH_MAX + 240], hex[65] = "";
    if (local == NULL || !base_name(local, name, sizeof name)) {
        errno = EINVAL;
        return fail(x, "no template RAM named rightly in the manifest of", x->src);
    }
    int lk = bases_lock(x, bases, sizeof bases);
    if (lk < 0)
        return -1;
    sp_qemu__sfmt(bdir, sizeof bdir, "%s/%s", bases, name);
    sp_qemu__sfmt(p, sizeof p, "%s/sha256", bdir);
    int rc = 0;
    FILE *f = fopen(p, "re");
    if (f == NULL || fscanf(f, "%64[0-9a-f]", hex) != 1 || strlen(hex) != 64) {
        uint64_t size;
        sp_qemu__sfmt(tmp, sizeof tmp, "%s/.tmp-%s-%d", bases, name, (int)getpid());
        sp_rm_rf(tmp);
        sp_qemu__sfmt(p, sizeof p, "%s/mem.ram", local);
        sp_qemu__sfmt(q, sizeof q, "%s/mem.ram", tmp);
        if (mkdir(tmp, 0755) < 0)
            rc = fail(x, "cannot create", tmp);
        else if (copy_file(p, q, 0444, true, &x->bytes) < 0)
            rc = fail(x, "cannot copy", p);
        else if (sp_qemu__sum_file(q, &size, hex) < 0)
            rc = fail(x, "cannot checksum", q);
        sp_qemu__sfmt(q, sizeof q, "%s/sha256", tmp);
        if (rc == 0 && sp_qemu__write_atomic(q, hex, 64) < 0)
            rc = fail(x, "cannot write", q);
        if (rc == 0) {
            sp_qemu__fsync_path(tmp, O_RDONLY | O_DIRECTORY);
            sp_rm_rf(bdir); /* a partial one: no checksum */
            if (rename(tmp, bdir) < 0)
                rc = fail(x, "cannot rename into place", bdir);
            else
                sp_qemu__fsync_path(bases, O_RDONLY | O_DIRECTORY);
        }
        if (rc < 0)
            sp_rm_rf(tmp);
    }
    if (f != NULL)
        fclose(f);
    if (rc == 0 && utimensat(AT_FDCWD, bdir, NULL, 0) < 0) /* the sweep's guard */
        rc = fail(x, "cannot touch", bdir);
    close(lk);
    if (rc < 0)
        return -1;
    json_object_del(man, "ram_base");
    json_object_set_new(man, "ram_base_shared", json_string(name));
    json_object_set_new(man, "ram_base_checksum", json_string(hex));
    return 0;
}

/* A base's checksum is verified once per worker: the worker then records what the file was
 * (device, inode, size, mtime, ctime: a write changes them) beside its snapshots, in
 * .verified/<name>, and takes a file that still matches as verified. mark: that path. */
static int base_id(const struct stat *st, const char *sum, char *out, size_t n)
{
    return snprintf(out, n, "%llu %llu %lld %lld.%09ld %lld.%09ld %s",
                    (unsigned long long)st->st_dev, (unsigned long long)st->st_ino,
                    (long long)st->st_size, (long long)st->st_mtim.tv_sec, st->st_mtim.tv_nsec,
                    (long long)st->st_ctim.tv_sec, st->st_ctim.tv_nsec, sum);
}

static bool base_known(const char *mark, const struct stat *st, const char *sum)
{
    char want[256], got[256];
    base_id(st, sum, want, sizeof want);
    FILE *f = fopen(mark, "re");
    if (f == NULL)
        return false;
    size_t n = fread(got, 1, sizeof got - 1, f);
    fclose(f);
    got[n] = '\0';
    return strcmp(got, want) == 0;
}

static void base_mark(const char *mark, const struct stat *st, const char *sum)
{
    char line[256], dir[PATH_MAX];
    int n = base_id(st, sum, line, sizeof line);
    sp_qemu__sfmt(dir, sizeof dir, "%s", mark);
    char *slash = strrchr(dir, '/');
    if (slash != NULL)
        *slash = '\0';
    (void)mkdir(dir, 0700);
    (void)sp_qemu__write_atomic(mark, line, (size_t)n); /* else verified again next time */
}

/* A copy in this worker's snapshots (fetched from the shared dir into dir) whose RAM is a
 * delta over a published base: via gets that base's directory, once its RAM file is of the
 * snapshot's size and matches its checksum (verified once per worker: base_known); localize
 * and the whole-RAM rewrite read it. A copy without a base (whole already) leaves via "".
 * -1 with x->why: the copy cannot be used. Runs on a worker thread. */
static int published_base(struct xfer *x, const char *dir, char *via, size_t n)
{
    char man[PATH_MAX + 64], bdir[PATH_MAX + 200], ram[PATH_MAX + 220], mark[PATH_MAX + 200],
        hex[65];
    sp_qemu__sfmt(man, sizeof man, "%s/snapshot/manifest.json", dir);
    json_t *m = json_load_file(man, 0, NULL);
    const char *name = json_string_value(json_object_get(m, "ram_base_shared"));
    const char *sum = json_string_value(json_object_get(m, "ram_base_checksum"));
    via[0] = '\0';
    if (m != NULL && name == NULL) {
        json_decref(m);
        return 0;
    }
    int rc = 0;
    uint64_t size;
    struct stat st;
    if (m == NULL || sum == NULL || name[0] == '.' || strchr(name, '/') != NULL) {
        errno = EINVAL;
        rc = fail(x, "a manifest that names no base rightly:", man);
    } else {
        sp_qemu__sfmt(bdir, sizeof bdir, "%s/" BASES "/%s", x->shared, name);
        sp_qemu__sfmt(ram, sizeof ram, "%s/mem.ram", bdir);
        const char *slash = strrchr(dir, '/'); /* dir is in this worker's snapshots */
        sp_qemu__sfmt(mark, sizeof mark, "%.*s/.verified/%s",
                      slash != NULL ? (int)(slash - dir) : 0, dir, name);
        long long want = (long long)json_integer_value(json_object_get(m, "memory_mb")) << 20;
        if (stat(ram, &st) < 0) {
            rc = fail(x, "cannot read the template RAM", ram);
        } else if ((long long)st.st_size != want) {
            errno = EIO;
            rc = fail(x, "the template RAM is not of the snapshot's size:", ram);
        } else if (!base_known(mark, &st, sum)) { /* not verified here, or changed since */
            if (sp_qemu__sum_file(ram, &size, hex) < 0) {
                rc = fail(x, "cannot read the template RAM", ram);
            } else if (strcmp(hex, sum) != 0) {
                errno = EIO;
                rc = fail(x, "the template RAM does not match its checksum:", ram);
            } else {
                base_mark(mark, &st, sum);
            }
        }
    }
    if (rc == 0)
        sp_qemu__sfmt(via, n, "%s", bdir);
    json_decref(m);
    return rc;
}

/* This worker's marks (base_known) of bases that are gone. */
static void marks_sweep(const char *bases, const char *marks)
{
    DIR *dh = opendir(marks);
    struct dirent *de;
    while (dh != NULL && (de = readdir(dh)) != NULL) {
        char p[PATH_MAX + 400];
        struct stat st;
        sp_qemu__sfmt(p, sizeof p, "%s/%s", bases, de->d_name);
        if (de->d_name[0] == '.' || lstat(p, &st) == 0 || errno != ENOENT)
            continue;
        sp_qemu__sfmt(p, sizeof p, "%s/%s", marks, de->d_name);
        unlink(p);
    }
    if (dh != NULL)
        closedir(dh);
}

/* The listing job's collection of bases (ls_run): v[0..n) is the listing of snapshots/ made
 * after since; a base no committed copy there names, untouched since before since less the
 * grace, goes (renamed under the lock, then removed); then this worker's marks of bases that
 * are gone. */
static void bases_sweep(const char *sdir, const char *marks, const struct lsent *v, size_t n,
                        time_t since)
{
    char bases[PATH_MAX + 64], lock[PATH_MAX + 64];
    sp_qemu__sfmt(bases, sizeof bases, "%s/.bases", sdir);
    DIR *dh = opendir(bases);
    if (dh == NULL) {
        if (errno == ENOENT)
            marks_sweep(bases, marks);
        return;
    }
    json_t *refs = json_object();
    bool known = refs != NULL;
    for (size_t i = 0; known && i < n; i++) {
        char p[PATH_MAX + 400];
        if (v[i].mtime < 0)
            continue;
        sp_qemu__sfmt(p, sizeof p, "%s/%s/snapshot/manifest.json", sdir, v[i].name);
        struct stat st;
        json_t *m = json_load_file(p, 0, NULL);
        const char *b = json_string_value(json_object_get(m, "ram_base_shared"));
        if (m == NULL && (stat(p, &st) == 0 || errno != ENOENT))
            known = false; /* unreadable, not gone: it may name any */
        else if (b != NULL)
            json_object_set_new(refs, b, json_true());
        json_decref(m);
    }
    time_t before = since - (time_t)base_grace_s();
    struct dirent *de;
    while (known && (de = readdir(dh)) != NULL) {
        char p[PATH_MAX + 400], gone[PATH_MAX + 400];
        struct stat st;
        const char *nm = de->d_name;
        bool tmp = strncmp(nm, ".tmp-", 5) == 0, left = strncmp(nm, ".gone-", 6) == 0;
        if ((nm[0] == '.' && !tmp && !left) || json_object_get(refs, nm) != NULL)
            continue;
        sp_qemu__sfmt(p, sizeof p, "%s/%s", bases, nm);
        if (lstat(p, &st) < 0 || st.st_mtime >= before)
            continue;
        if (left) { /* a sweep that stopped midway */
            sp_rm_rf(p);
            continue;
        }
        sp_qemu__sfmt(lock, sizeof lock, "%s/.lock", bases);
        int fd = open(lock, O_RDWR | O_CLOEXEC);
        if (fd < 0 || flock(fd, LOCK_EX) < 0) {
            if (fd >= 0)
                close(fd);
            continue;
        }
        sp_qemu__sfmt(gone, sizeof gone, "%s/.gone-%s-%d", bases, tmp ? nm + 5 : nm, (int)getpid());
        bool moved = lstat(p, &st) == 0 && st.st_mtime < before && rename(p, gone) == 0;
        close(fd);
        if (moved) {
            sp_rm_rf(gone);
            sp_log(SP_LOG_INFO, "qemu", "template RAM no shared snapshot names removed base=%s",
                   nm);
        }
    }
    closedir(dh);
    json_decref(refs);
    if (known)
        marks_sweep(bases, marks);
}

/* ---------- the calls ---------- */

int sp_qemu__shared_init(sp_qemu_t *d, const char *dir, sp_err_t *err)
{
    if (dir == NULL || dir[0] == '\0')
        return 0;
    char abs[PATH_MAX], p[PATH_MAX + 32];
    if (strlen(dir) > PATH_MAX - 256)
        return sp_err_set(err, SP_EINVAL, "snapshot directory path is too long");
    if (mkdir_p(dir, 0711) < 0 || realpath(dir, abs) == NULL)
        return sp_err_set(err, SP_ERUNTIME, "cannot use the snapshot directory %s: %s", dir,
                          strerror(errno));
    static const char *const subs[] = {"sandboxes", "templates", "images", "snapshots"};
    for (size_t i = 0; i < sizeof subs / sizeof subs[0]; i++) {
        sp_qemu__sfmt(p, sizeof p, "%s/%s", abs, subs[i]);
        if (mkdir(p, 0711) < 0 && errno != EEXIST)
            return sp_err_set(err, SP_ERUNTIME, "cannot create %s: %s", p, strerror(errno));
    }
    sp_qemu__sfmt(d->shared_dir, sizeof d->shared_dir, "%s", abs);
    sp_log(SP_LOG_INFO, "qemu", "shared snapshot dir=%s", abs);
    return 0;
}

void sp_qemu__shared_free(sp_qemu_t *d)
{
    ls_free(d);
    while (d->fetches != NULL) {
        struct xfer *x = d->fetches;
        d->fetches = x->next;
        x->d = NULL; /* its done callback only cleans up */
        sp_work_cancel(x->work);
    }
}

/* A suspend of this VM streams its whole RAM into the device state: with a shared dir, so
 * that the snapshot depends on no RAM file of this worker's. (A sandbox snapshot for every
 * worker does not: its shared copy is a delta over a template RAM published beside it.) */
bool sp_qemu__shared_streams(const struct vm *vm)
{
    return sp_qemu__shared_publishes(vm);
}

bool sp_qemu__shared_publishes(const struct vm *vm)
{
    return vm->d->shared_dir[0] != '\0' && vm->tsnap_build == NULL && vm->fork == NULL &&
           !vm->pooled;
}

/* QEMU quit after the commit: the move into the shared dir starts; sp_qemu__suspend_release
 * follows when it is done (failed or not). */
void sp_qemu__shared_publish(struct vm *vm)
{
    struct xfer *x = xfer_new(vm->d, vm->id, false, false);
    if (x != NULL) {
        x->vm = vm;
        x->work = sp_loop_work(vm->d->base.loop, SP_WORK_LONG, xfer_run, xfer_done, x);
    }
    if (x == NULL || x->work == NULL) {
        free(x);
        sp_log(SP_LOG_ERROR, "qemu",
               "suspended sandbox not moved to the snapshot dir sandbox=%s (no memory or "
               "thread): its snapshot stays on this worker",
               vm->id);
        sp_qemu__suspend_release(vm);
        return;
    }
    vm->publish = x;
}

/* The VM goes before its move is done (deleted, or the driver freed): the job goes on, and
 * its result is removed. */
void sp_qemu__shared_publish_abandon(struct vm *vm)
{
    if (vm->publish == NULL)
        return;
    vm->publish->vm = NULL;
    sp_work_cancel(vm->publish->work);
    vm->publish = NULL;
}

bool sp_qemu__shared_committed(const sp_qemu_t *d, const char *id)
{
    if (d->shared_dir[0] == '\0' || !sp_qemu__valid_id(id))
        return false;
    char p[PATH_MAX + 96];
    sp_qemu__sfmt(p, sizeof p, "%s/sandboxes/%s", d->shared_dir, id);
    return sp_qemu__snapshot_committed(p);
}

uint64_t sp_qemu__shared_bytes(const sp_qemu_t *d, const char *id)
{
    if (d->shared_dir[0] == '\0' || !sp_qemu__valid_id(id))
        return 0;
    char p[PATH_MAX + 96];
    sp_qemu__sfmt(p, sizeof p, "%s/sandboxes/%s", d->shared_dir, id);
    return sp_qemu__snapshot_bytes(p);
}

static struct xfer *fetch_find(const sp_qemu_t *d, const char *id)
{
    for (struct xfer *x = d->fetches; x != NULL; x = x->next)
        if (x->fetch && !x->snap && strcmp(x->id, id) == 0 && !x->gone)
            return x;
    return NULL;
}

bool sp_qemu__shared_fetching(const sp_qemu_t *d, const char *id)
{
    return fetch_find(d, id) != NULL;
}

static char *dup_or_null(const char *s, bool *oom)
{
    char *c = s != NULL ? strdup(s) : NULL;
    if (s != NULL && c == NULL)
        *oom = true;
    return c;
}

/* spec and its answer kept for after a copy; NULL when out of memory. */
static struct req *req_new(const sp_vm_spec_t *spec, sp_driver_cb cb, void *arg)
{
    struct req *r = calloc(1, sizeof(*r));
    if (r == NULL)
        return NULL;
    bool oom = false;
    r->id = dup_or_null(spec->sandbox_id, &oom);
    r->template_name = dup_or_null(spec->template_name, &oom);
    r->hostname = dup_or_null(spec->hostname, &oom);
    r->env_json = dup_or_null(spec->env_json, &oom);
    r->snapshot_id = dup_or_null(spec->snapshot_id, &oom);
    r->cpu_count = spec->cpu_count;
    r->memory_mb = spec->memory_mb;
    r->progress = spec->progress;
    r->progress_arg = spec->progress_arg;
    r->cb = cb;
    r->arg = arg;
    if (oom || r->id == NULL) {
        req_free(r);
        return NULL;
    }
    return r;
}

/* A wake of a sandbox whose snapshot is in the shared dir: copy it in, then restore it. */
int sp_qemu__shared_fetch(sp_qemu_t *d, const sp_vm_spec_t *spec, sp_driver_cb cb, void *arg,
                          sp_err_t *err)
{
    struct req *r = req_new(spec, cb, arg);
    if (r == NULL)
        return sp_err_set(err, SP_EINTERNAL, "out of memory");
    struct xfer *x = fetch_find(d, spec->sandbox_id);
    if (x == NULL && (x = xfer_start(d, spec->sandbox_id, true, false, NULL)) == NULL) {
        req_free(r);
        return sp_err_set(err, SP_EINTERNAL, "out of memory");
    }
    r->next = x->reqs;
    x->reqs = r;
    return 0;
}

/* The sandbox woke (its snapshot is spent) or is deleted: its shared copy goes. A copy in
 * flight for a wake is cancelled and its waiters fail. */
void sp_qemu__shared_forget(sp_qemu_t *d, const char *id)
{
    if (d->shared_dir[0] == '\0' || !sp_qemu__valid_id(id))
        return;
    struct xfer *x = fetch_find(d, id);
    if (x != NULL) {
        x->gone = true;
        sp_work_cancel(x->work);
    }
    for (x = d->fetches; x != NULL; x = x->next) /* a boot from a snapshot being copied in */
        for (struct req *r = x->snap && x->fetch ? x->reqs : NULL; r != NULL; r = r->next)
            if (strcmp(r->id, id) == 0)
                r->gone = true;
    char p[PATH_MAX + 96];
    sp_qemu__sfmt(p, sizeof p, "%s/sandboxes/%s", d->shared_dir, id);
    sp_qemu__discard(d, p); /* renamed away at once; the removal is made durable below */
    fsync_dir_of(p);
}

/* ---------- sandbox snapshots for every worker ---------- */

static bool snap_path(const sp_qemu_t *d, const char *sid, char *out, size_t n)
{
    return d->shared_dir[0] != '\0' && sp_qemu__fork_valid_sid(sid) &&
           sp_qemu__sfmt(out, n, "%s/snapshots/%s", d->shared_dir, sid) > 0;
}

bool sp_qemu__shared_snap_committed(const sp_qemu_t *d, const char *sid, char *out, size_t n)
{
    char p[PATH_MAX + 96];
    if (!snap_path(d, sid, p, sizeof p) || !sp_qemu__snapshot_committed(p))
        return false;
    if (out != NULL)
        sp_qemu__sfmt(out, n, "%s", p);
    return true;
}

static struct xfer *snap_find(const sp_qemu_t *d, const char *sid, bool fetch)
{
    for (struct xfer *x = d->fetches; x != NULL; x = x->next)
        if (x->snap && x->fetch == fetch && strcmp(x->id, sid) == 0)
            return x;
    return NULL;
}

/* The template snapshot whose RAM this worker's copy of a snapshot of template tmpl (a name,
 * or "name@hash") and memory_mb is made a delta over (localize): prefer when it is one, else
 * a ready one of that template and size (that version first), else any of that size; "" when
 * there is none (the copy stays whole). */
static void pick_base(const sp_qemu_t *d, const char *prefer, const char *tmpl, int memory_mb,
                      char *out, size_t n)
{
    out[0] = '\0';
    if (prefer != NULL && prefer[0] != '\0') {
        sp_qemu__sfmt(out, n, "%s", prefer);
        return;
    }
    size_t nl = tmpl != NULL ? strcspn(tmpl, "@") : 0;
    int best = 0;
    for (const struct tsnap *t = d->tsnaps; t != NULL; t = t->next) {
        if (t->state != TS_READY || t->memory_mb != memory_mb)
            continue;
        int score = 1;
        if (tmpl != NULL && strcmp(t->template_name, tmpl) == 0)
            score = 3;
        else if (tmpl != NULL && strncmp(t->template_name, tmpl, nl) == 0 &&
                 (t->template_name[nl] == '\0' || t->template_name[nl] == '@'))
            score = 2;
        if (score > best) {
            best = score;
            sp_qemu__sfmt(out, n, "%s", t->dir);
        }
    }
}

int sp_qemu__shared_snap_fetch(sp_qemu_t *d, const sp_vm_spec_t *spec, sp_driver_cb cb, void *arg,
                               sp_err_t *err)
{
    if (mkdir(d->snaps_dir, 0711) < 0 && errno != EEXIST)
        return sp_err_set(err, SP_ERUNTIME, "cannot create %s: %s", d->snaps_dir, strerror(errno));
    struct req *r = req_new(spec, cb, arg);
    if (r == NULL)
        return sp_err_set(err, SP_EINTERNAL, "out of memory");
    struct xfer *x = snap_find(d, spec->snapshot_id, true);
    char base[PATH_MAX];
    if (x == NULL)
        pick_base(d, NULL, spec->template_name, spec->memory_mb, base, sizeof base);
    if (x == NULL && (x = xfer_start(d, spec->snapshot_id, true, true, base)) == NULL) {
        req_free(r);
        return sp_err_set(err, SP_EINTERNAL, "out of memory");
    }
    if (spec->progress != NULL)
        spec->progress(spec->progress_arg, "copying the snapshot in from the snapshot dir");
    r->next = x->reqs;
    x->reqs = r;
    return 0;
}

void sp_qemu__shared_refs(const sp_qemu_t *d, struct refs *r)
{
    for (const struct xfer *x = d->fetches; x != NULL; x = x->next)
        if (x->snap && x->base[0] != '\0')
            sp_qemu__refs_add(r, x->base);
}

bool sp_qemu__shared_snap_fetching(const sp_qemu_t *d, const char *sid)
{
    return snap_find(d, sid, true) != NULL;
}

void sp_qemu__shared_snap_put(sp_qemu_t *d, const char *sid, const struct vm *vm, struct waiter *w)
{
    char base[PATH_MAX];
    pick_base(d, vm->clone_src, vm->template_name, vm->memory_mb, base, sizeof base);
    struct xfer *x = xfer_start(d, sid, false, true, base);
    if (x == NULL) {
        sp_err_t e;
        sp_err_set(&e, SP_EINTERNAL, "out of memory");
        char p[PATH_MAX + 96];
        sp_qemu__sfmt(p, sizeof p, "%s/%s", d->snaps_dir, sid);
        sp_qemu__discard(d, p);
        sp_qemu__complete_all(d, &w, &e);
        return;
    }
    x->waiters = w;
}

void sp_qemu__shared_snap_forget(sp_qemu_t *d, const char *sid)
{
    char p[PATH_MAX + 96], tmp[SP_QEMU_ID_MAX + 16];
    struct stat st;
    if (!snap_path(d, sid, p, sizeof p))
        return;
    /* a copy a dead worker was writing (the take failed at its next start, or is deleted),
     * as the last listing saw them */
    sp_qemu__sfmt(tmp, sizeof tmp, ".tmp-%s-", sid);
    const struct shared_ls *l = snap_find(d, sid, false) == NULL ? ls_get(d) : NULL;
    for (size_t i = 0; l != NULL && i < l->ncur; i++) {
        char q[PATH_MAX + 400];
        if (strncmp(l->cur[i].name, tmp, strlen(tmp)) != 0)
            continue;
        sp_qemu__sfmt(q, sizeof q, "%s/snapshots/%s", d->shared_dir, l->cur[i].name);
        sp_qemu__discard(d, q);
    }
    if (lstat(p, &st) < 0)
        return;
    sp_log(SP_LOG_INFO, "qemu",
           "removing a deleted sandbox snapshot from the snapshot dir "
           "snapshot=%s",
           sid);
    sp_qemu__discard(d, p);
    fsync_dir_of(p);
}

void sp_qemu__shared_snap_list(sp_qemu_t *d, const char *prefix,
                               void (*fn)(const char *sid, long long committed_s, void *arg),
                               void *arg)
{
    const struct shared_ls *l = ls_get(d);
    size_t pl = strlen(prefix);
    for (size_t i = 0; l != NULL && i < l->ncur; i++)
        if (l->cur[i].mtime >= 0 && strncmp(l->cur[i].name, prefix, pl) == 0)
            fn(l->cur[i].name, l->cur[i].mtime, arg);
}

/* ---------- template images ---------- */

/* The published counterpart of a template image under our data dir (templates/... or
 * images/...), into out[n]; false when local is not one. */
static bool shared_name(const sp_qemu_t *d, const char *local, char *out, size_t n)
{
    if (!sp_qemu__path_under(local, d->data_dir))
        return false;
    const char *rel = local + strlen(d->data_dir) + 1;
    if (strncmp(rel, "templates/", 10) != 0 && strncmp(rel, "images/", 7) != 0)
        return false;
    return sp_qemu__sfmt(out, n, "%s/%s", d->shared_dir, rel) > 0 && strlen(out) < n - 1;
}

/* Publishes local as out (its shared_name) unless there: under the shared dir's lock, a hard
 * link or a copy renamed into place. An image whose backing file is not in the shared dir is
 * not published (its bytes mean something only over this worker's file). Blocking: a copy
 * when the shared dir is another file system (once per image and fleet). */
static bool publish_image(const sp_qemu_t *d, const char *local, const char *out)
{
    struct stat st;
    if (stat(out, &st) == 0)
        return true;
    char back[PATH_MAX], lock[PATH_MAX + 32], tmp[PATH_MAX + 32];
    if (sp_qemu__qcow2_backing(local, back, sizeof back) &&
        !sp_qemu__path_under(back, d->shared_dir))
        return false;
    sp_qemu__sfmt(lock, sizeof lock, "%s/templates/.lock", d->shared_dir);
    int lfd = open(lock, O_RDWR | O_CREAT | O_CLOEXEC, 0600);
    if (lfd < 0 || flock(lfd, LOCK_EX) < 0) {
        sp_log(SP_LOG_WARN, "qemu", "cannot lock %s err=%s", lock, strerror(errno));
        if (lfd >= 0)
            close(lfd);
        return false;
    }
    bool ok = stat(out, &st) == 0; /* another worker published it while we waited */
    uint64_t t0 = sp_qemu__mono_ms(), bytes = 0;
    if (!ok) {
        sp_qemu__sfmt(tmp, sizeof tmp, "%s.tmp-%d", out, (int)getpid());
        char dir[PATH_MAX];
        sp_qemu__sfmt(dir, sizeof dir, "%s", out);
        *strrchr(dir, '/') = '\0';
        unlink(tmp);
        ok = mkdir_p(dir, 0711) == 0 && copy_file(local, tmp, 0444, true, &bytes) == 0 &&
             rename(tmp, out) == 0;
        if (ok) {
            fsync_dir_of(out);
            sp_log(SP_LOG_INFO, "qemu",
                   "template image published image=%s how=%s bytes=%llu ms=%llu", out,
                   bytes > 0 ? "copy" : "link", (unsigned long long)bytes,
                   (unsigned long long)(sp_qemu__mono_ms() - t0));
        } else {
            sp_log(SP_LOG_WARN, "qemu", "cannot publish template image=%s err=%s", out,
                   strerror(errno));
            unlink(tmp);
        }
    }
    close(lfd); /* the lock goes with it */
    return ok;
}

bool sp_qemu__shared_image(const sp_qemu_t *d, const char *local, char *out, size_t n)
{
    return d->shared_dir[0] != '\0' && shared_name(d, local, out, n) &&
           publish_image(d, local, out);
}

/* A published image's manifest beside it (rootfs: the image's published path), so that
 * other workers can import the version (guest/tmplbuild.h: sp_tmplbuild_import): copied to a
 * temporary name and renamed into place, once. Failure is logged: other workers then cannot
 * create from this version, this one still can. */
static void publish_manifest(const char *manifest, const char *rootfs)
{
    char dst[PATH_MAX + 64], tmp[PATH_MAX + 96];
    struct stat st;
    sp_qemu__sfmt(dst, sizeof dst, "%s", rootfs);
    char *slash = strrchr(dst, '/');
    if (manifest[0] == '\0' || slash == NULL ||
        sp_qemu__sfmt(slash + 1, sizeof dst - (size_t)(slash + 1 - dst), "manifest.json") <= 0 ||
        stat(dst, &st) == 0)
        return;
    sp_qemu__sfmt(tmp, sizeof tmp, "%s.tmp-%d", dst, (int)getpid());
    unlink(tmp);
    uint64_t bytes = 0;
    if (copy_file(manifest, tmp, 0444, false, &bytes) < 0 || rename(tmp, dst) < 0) {
        sp_log(SP_LOG_WARN, "qemu", "cannot publish template manifest=%s err=%s", dst,
               strerror(errno));
        unlink(tmp);
        return;
    }
    fsync_dir_of(dst);
}

/* A template build's images as every worker has them: the published copies (publishing
 * them first if need be), where they can be. */
void sp_qemu__shared_template(const sp_qemu_t *d, const char *tname, sp_tmplbuild_paths_t *tp)
{
    if (d->shared_dir[0] == '\0')
        return;
    char *paths[] = {tp->rootfs, tp->kernel, tp->initramfs};
    size_t sizes[] = {sizeof tp->rootfs, sizeof tp->kernel, sizeof tp->initramfs};
    char out[PATH_MAX + 64];
    for (size_t i = 0; i < sizeof paths / sizeof paths[0]; i++) {
        if (paths[i][0] == '\0')
            continue;
        if (sp_qemu__shared_image(d, paths[i], out, sizeof out) && strlen(out) < sizes[i]) {
            if (i == 0)
                publish_manifest(tp->manifest, out);
            memcpy(paths[i], out, strlen(out) + 1);
        } else if (i == 0)
            sp_log(SP_LOG_WARN, "qemu",
                   "template image not in the snapshot dir template=%s image=%s: its sandboxes' "
                   "snapshots carry a copy",
                   tname, paths[i]);
    }
}
