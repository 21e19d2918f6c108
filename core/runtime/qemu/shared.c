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
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include "base/log.h"

#define LAYERS_MAX 8 /* backing files copied into a sandbox's snapshot at most */

/* A wake waiting for its snapshot to be copied in: the spec's strings, owned. */
struct req {
    struct req *next;
    char *id, *template_name, *hostname, *env_json;
    int cpu_count, memory_mb;
    sp_driver_cb cb;
    void *arg;
};

/* A snapshot moved to the shared dir (publish: vm set) or copied from it (fetch: in
 * d->fetches). The job (xfer_run, on a worker thread) touches only its paths and results. */
struct xfer {
    struct xfer *next;
    sp_qemu_t *d;  /* NULL once the driver let go of it */
    struct vm *vm; /* publish: the suspended VM; NULL once abandoned */
    bool fetch;
    bool gone; /* fetch: the sandbox was deleted meanwhile */
    sp_work_t *work;
    char id[SP_QEMU_ID_MAX + 1];
    char shared[PATH_MAX]; /* the shared dir */
    char src[PATH_MAX + 96], tmp[PATH_MAX + 96], dst[PATH_MAX + 96];
    struct req *reqs;
    int rc;
    char why[200];
    uint64_t ms, bytes;
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

static int publish_run(struct xfer *x)
{
    char p[PATH_MAX + 64], q[PATH_MAX + 64];
    sp_rm_rf(x->tmp);
    sp_qemu__sfmt(p, sizeof p, "%s/snapshot", x->tmp);
    if (mkdir(x->tmp, 0700) < 0 || mkdir(p, 0700) < 0)
        return fail(x, "cannot create", p);
    sp_qemu__sfmt(p, sizeof p, "%s/snapshot/manifest.json", x->src);
    json_t *man = json_load_file(p, 0, NULL);
    const char *ram = json_string_value(json_object_get(man, "ram"));
    if (ram == NULL || strcmp(ram, "delta") == 0) {
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
    sp_rm_rf(x->dst); /* an older one is stale: this sandbox ran since */
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
    if (mkdir(to, 0700) < 0)
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
         * replaced by a rename) */
        bool writes = strcmp(de->d_name, "disk.qcow2") == 0 || strcmp(de->d_name, "mem.ram") == 0;
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

static void xfer_run(sp_work_t *w, void *arg)
{
    (void)w;
    struct xfer *x = arg;
    uint64_t t0 = sp_qemu__mono_ms();
    x->rc = x->fetch ? fetch_run(x) : publish_run(x);
    if (x->rc == 0 && !x->fetch)
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
    free(r);
}

static void xfer_free(struct xfer *x)
{
    while (x->reqs != NULL) {
        struct req *n = x->reqs->next;
        req_free(x->reqs);
        x->reqs = n;
    }
    free(x);
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

static void fetch_done(struct xfer *x)
{
    sp_qemu_t *d = x->d;
    if (d == NULL) {
        sp_rm_rf(x->tmp);
        xfer_free(x);
        return;
    }
    for (struct xfer **pp = &d->fetches; *pp != NULL; pp = &(*pp)->next)
        if (*pp == x) {
            *pp = x->next;
            break;
        }
    sp_err_t e;
    if (x->gone) {
        sp_err_set(&e, SP_ERUNTIME, "wake cancelled: the sandbox was deleted");
        x->rc = -1;
    } else if (x->rc < 0) {
        sp_log(SP_LOG_WARN, "qemu", "cannot copy the snapshot in sandbox=%s err=\"%s\"", x->id,
               x->why);
        sp_err_set(&e, SP_ERUNTIME,
                   "cannot wake: the snapshot cannot be read from the snapshot dir");
    } else {
        sp_qemu__discard(d, x->dst); /* an earlier wake's leftovers: the shared copy is newer */
        if (rename(x->tmp, x->dst) < 0) {
            sp_log(SP_LOG_WARN, "qemu", "cannot rename the snapshot in sandbox=%s err=%s", x->id,
                   strerror(errno));
            sp_err_set(&e, SP_ERUNTIME, "cannot wake: the snapshot cannot be copied in");
            x->rc = -1;
        } else {
            sp_log(SP_LOG_INFO, "qemu",
                   "snapshot copied in from the snapshot dir sandbox=%s bytes=%llu ms=%llu", x->id,
                   (unsigned long long)x->bytes, (unsigned long long)x->ms);
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
                             .env_json = r->env_json};
        sp_err_t re;
        if (x->rc < 0)
            re = e;
        if (x->rc < 0 || sp_qemu__restore_local(d, &spec, r->cb, r->arg, &re) < 0) {
            if (sp_qemu__complete(d, r->cb, r->arg, &re) < 0)
                sp_log(SP_LOG_ERROR, "qemu", "wake lost its answer sandbox=%s (no memory)", x->id);
        }
    }
    xfer_free(x);
}

static void xfer_done(void *arg, bool cancelled)
{
    (void)cancelled;
    struct xfer *x = arg;
    x->work = NULL;
    if (x->fetch)
        fetch_done(x);
    else
        publish_done(x);
}

static struct xfer *xfer_new(sp_qemu_t *d, const char *id, bool fetch)
{
    struct xfer *x = calloc(1, sizeof(*x));
    if (x == NULL)
        return NULL;
    x->d = d;
    x->fetch = fetch;
    sp_qemu__sfmt(x->id, sizeof x->id, "%s", id);
    sp_qemu__sfmt(x->shared, sizeof x->shared, "%s", d->shared_dir);
    if (fetch) {
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
    static const char *const subs[] = {"sandboxes", "templates", "images"};
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
    while (d->fetches != NULL) {
        struct xfer *x = d->fetches;
        d->fetches = x->next;
        x->d = NULL; /* its done callback only cleans up */
        sp_work_cancel(x->work);
    }
}

/* A suspend of this VM streams its whole RAM into the device state: with a shared dir, so
 * that the snapshot depends on no RAM file of this worker's. */
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
    struct xfer *x = xfer_new(vm->d, vm->id, false);
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
        if (strcmp(x->id, id) == 0 && !x->gone)
            return x;
    return NULL;
}

bool sp_qemu__shared_fetching(const sp_qemu_t *d, const char *id)
{
    return fetch_find(d, id) != NULL;
}

/* A wake of a sandbox whose snapshot is in the shared dir: copy it in, then restore it. */
int sp_qemu__shared_fetch(sp_qemu_t *d, const sp_vm_spec_t *spec, sp_driver_cb cb, void *arg,
                          sp_err_t *err)
{
    struct req *r = calloc(1, sizeof(*r));
    if (r == NULL)
        return sp_err_set(err, SP_EINTERNAL, "out of memory");
    r->id = strdup(spec->sandbox_id);
    r->template_name = spec->template_name != NULL ? strdup(spec->template_name) : NULL;
    r->hostname = spec->hostname != NULL ? strdup(spec->hostname) : NULL;
    r->env_json = spec->env_json != NULL ? strdup(spec->env_json) : NULL;
    r->cpu_count = spec->cpu_count;
    r->memory_mb = spec->memory_mb;
    r->cb = cb;
    r->arg = arg;
    if (r->id == NULL || (spec->template_name != NULL && r->template_name == NULL) ||
        (spec->hostname != NULL && r->hostname == NULL) ||
        (spec->env_json != NULL && r->env_json == NULL)) {
        req_free(r);
        return sp_err_set(err, SP_EINTERNAL, "out of memory");
    }
    struct xfer *x = fetch_find(d, spec->sandbox_id);
    if (x == NULL) {
        x = xfer_new(d, spec->sandbox_id, true);
        if (x != NULL)
            x->work = sp_loop_work(d->base.loop, SP_WORK_LONG, xfer_run, xfer_done, x);
        if (x == NULL || x->work == NULL) {
            free(x);
            req_free(r);
            return sp_err_set(err, SP_EINTERNAL, "out of memory");
        }
        x->next = d->fetches;
        d->fetches = x;
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
    char p[PATH_MAX + 96];
    sp_qemu__sfmt(p, sizeof p, "%s/sandboxes/%s", d->shared_dir, id);
    sp_qemu__discard(d, p); /* renamed away at once; the removal is made durable below */
    fsync_dir_of(p);
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
