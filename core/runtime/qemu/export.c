/*
 * export.c - a VM's disk for template builds: grown (driver.h: grow_disk), and written out as
 * a template image once the VM is paused (export_disk).
 *
 * Growing resizes the top image of the VM's chain through QEMU (block_resize on its drive),
 * which tells the guest (virtio-blk's configuration change); the lower images keep their
 * size (reads past their end are zeros). A jailed QEMU's file size limit (confine.c: the disk,
 * its RAM and slack) is raised first, so that the disk can fill what it grew by.
 *
 * A template build runs its steps in a builder VM, pauses it (QEMU's stop flushes its block
 * layer, so the overlay file is consistent once the guest ran sync) and asks for its disk.
 * The VM's overlay holds only what the VM wrote; below it are the template snapshot's
 * frozen overlay (for a clone) and the template's image. The export copies the top file
 * (sparse) and rebases the copy onto the template's image with qemu-img in safe mode, which
 * writes into the copy every cluster where the chain between differs from the new backing
 * file: the result is one layer over the template's image with everything the VM changed,
 * not depending on the template snapshot (which is collected on its own schedule). Both run
 * in one child process (/bin/sh), off the loop; the image is written under a temporary name
 * and renamed into place, mode 0444, once complete.
 *
 * Layers stack up when templates are built on templates. Past the driver's max_layers (the
 * template's image and what lies below it already that many files) the export squashes
 * instead: qemu-img convert reads the whole chain through the VM's disk and writes one
 * standalone image, so no sandbox's disk ever walks more than max_layers + 2 files (its
 * overlay and the template snapshot's above the template images). Such an image no longer
 * needs its parent template's image: image_standalone says so from its header, and the
 * template versions' collector (core/control/tmplver.c) goes by that.
 *
 * Does not decide where images live or what they are called (the template builder does).
 */
#include "core/runtime/qemu/qemu_int.h"

#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <sys/resource.h>

#include "base/log.h"

#define EXPORT_TIMEOUT_MS (30u * 60u * 1000u) /* a rebase reads what the template changed */

struct export {
    struct vm *vm;
    struct child *c;
    sp_driver_cb cb;
    void *arg;
    char dest[PATH_MAX];
    char tmp[PATH_MAX + 16];
    uint64_t t0;
};

/* Files in the qcow2 chain that starts at path, path included (a loop ends at 64). */
static int chain_files(const char *path)
{
    char cur[PATH_MAX], next[PATH_MAX];
    int n = 1;
    if (sp_qemu__sfmt(cur, sizeof cur, "%s", path) < 0)
        return n;
    while (n < 64 && sp_qemu__qcow2_backing(cur, next, sizeof next)) {
        memcpy(cur, next, sizeof cur);
        n++;
    }
    return n;
}

static void export_free(struct export *x)
{
    if (x->vm != NULL && x->vm->export == x)
        x->vm->export = NULL;
    sp_qemu__child_free(x->c);
    free(x);
}

static void on_export_exit(struct child *c, int st, bool timed_out, void *arg)
{
    struct export *x = arg;
    (void)c;
    sp_qemu_t *d = x->vm->d;
    sp_err_t e;
    const sp_err_t *err = NULL;
    if (timed_out || st == -1 || !WIFEXITED(st) || WEXITSTATUS(st) != 0) {
        sp_log(SP_LOG_ERROR, "qemu", "disk export failed sandbox=%s status=%d timed_out=%d",
               x->vm->id, st, (int)timed_out);
        sp_err_set(&e, SP_ERUNTIME, "%s",
                   timed_out ? "exporting the disk took too long"
                             : "cannot export the disk (qemu-img failed: see the VM's "
                               "qemu.log)");
        err = &e;
        unlink(x->tmp);
    } else if (chmod(x->tmp, 0444) < 0 || sp_qemu__fsync_path(x->tmp, O_RDONLY) < 0 ||
               rename(x->tmp, x->dest) < 0) {
        sp_err_set(&e, SP_ERUNTIME, "cannot put the exported disk in place: %s", strerror(errno));
        err = &e;
        unlink(x->tmp);
    } else {
        sp_log(SP_LOG_INFO, "qemu", "disk exported sandbox=%s ms=%llu", x->vm->id,
               (unsigned long long)(sp_qemu__mono_ms() - x->t0));
    }
    sp_driver_cb cb = x->cb;
    void *cb_arg = x->arg;
    export_free(x);
    if (sp_qemu__complete(d, cb, cb_arg, err) < 0)
        sp_log(SP_LOG_ERROR, "qemu", "out of memory completing a disk export");
}

int sp_qemu__q_export_disk(sp_driver_t *base, const char *id, const char *backing,
                           const char *dest, sp_driver_cb cb, void *arg, sp_err_t *err)
{
    sp_qemu_t *d = (sp_qemu_t *)base;
    struct vm *vm = sp_qemu__valid_id(id) ? sp_qemu__vm_find(d, id) : NULL;
    if (vm == NULL || vm->exited)
        return sp_err_set(err, SP_ENOTFOUND, "no running VM for sandbox %s", id);
    if (!vm->paused || vm->export != NULL || vm->fork != NULL)
        return sp_err_set(err, SP_ECONFLICT,
                          "the VM must be paused, with no export or snapshot running");
    if (backing == NULL || backing[0] != '/' || dest == NULL || dest[0] != '/')
        return sp_err_set(err, SP_EINVAL, "export paths must be absolute");
    /* With a shared snapshot dir the VM's chain ends in the template image's published copy
     * (shared.c): the export names that one, so that it means the same bytes on every worker
     * and the rebase finds it in the chain (qemu-img then compares only what lies above). */
    char pub[PATH_MAX + 64];
    if (sp_qemu__shared_image(d, backing, pub, sizeof pub))
        backing = pub;
    struct stat st;
    if (stat(backing, &st) < 0 || !S_ISREG(st.st_mode))
        return sp_err_set(err, SP_ENOTFOUND, "no base image %s", backing);
    if (lstat(dest, &st) == 0)
        return sp_err_set(err, SP_ECONFLICT, "%s exists", dest);
    struct export *x = calloc(1, sizeof(*x));
    if (x == NULL)
        return sp_err_set(err, SP_EINTERNAL, "out of memory");
    x->vm = vm;
    x->cb = cb;
    x->arg = arg;
    x->t0 = sp_qemu__mono_ms();
    char disk[PATH_MAX], log[PATH_MAX];
    if (sp_qemu__sfmt(x->dest, sizeof x->dest, "%s", dest) < 0 ||
        sp_qemu__sfmt(x->tmp, sizeof x->tmp, "%s.tmp-%d", dest, (int)getpid()) < 0) {
        free(x);
        return sp_err_set(err, SP_EINVAL, "export path too long");
    }
    sp_qemu__vm_path(vm, "disk.qcow2", disk, sizeof disk);
    sp_qemu__vm_path(vm, "qemu.log", log, sizeof log);
    unlink(x->tmp); /* a leftover of a killed spaced */
    int layers = chain_files(backing);
    bool squash = layers >= d->max_layers;
    /* -U: QEMU holds the images' locks; its vCPUs are stopped and its caches flushed */
    char *argv[] = {"/bin/sh",
                    "-c",
                    squash ? "exec \"$4\" convert -U -q -f qcow2 -O qcow2 \"$1\" \"$2\""
                           : "cp --sparse=always -- \"$1\" \"$2\" && "
                             "exec \"$4\" rebase -U -q -f qcow2 -b \"$3\" -F qcow2 \"$2\"",
                    "space-export",
                    disk,
                    x->tmp,
                    (char *)backing,
                    d->qemu_img,
                    NULL};
    struct spawn_opts so = {.out_path = log,
                            .stdin_fd = -1,
                            .cg = NULL,
                            .sandbox = vm->id,
                            .new_session = true}; /* its cp and qemu-img go with it */
    x->c = sp_qemu__child_start(d, argv, &so, EXPORT_TIMEOUT_MS, on_export_exit, x, err);
    if (x->c == NULL) {
        free(x);
        return -1;
    }
    vm->export = x;
    sp_log(SP_LOG_INFO, "qemu", "exporting disk sandbox=%s base=%s layers=%d%s", vm->id, backing,
           layers, squash ? " squashed: a standalone image" : "");
    return 0;
}

/* driver.h: image_standalone. An image export_disk squashed has no backing file; a layer has
 * one (its template's image). */
int sp_qemu__q_image_standalone(sp_driver_t *base, const char *path)
{
    (void)base;
    return path != NULL && path[0] == '/' ? sp_qemu__qcow2_standalone(path) : -1;
}

/* The VM is going away (destroyed, driver freed) with an export in flight: stop it, and
 * fail the caller (its callback is dropped when the driver itself goes). */
void sp_qemu__export_abort(struct vm *vm)
{
    struct export *x = vm->export;
    if (x == NULL)
        return;
    vm->export = NULL;
    x->vm = NULL;
    kill(-x->c->pid, SIGKILL);
    kill(x->c->pid, SIGKILL);
    waitpid(x->c->pid, NULL, 0); /* killed: returns at once */
    unlink(x->tmp);
    sp_err_t e;
    sp_err_set(&e, SP_ERUNTIME, "the VM went away during the disk export");
    sp_qemu__complete(vm->d, x->cb, x->arg, &e);
    export_free(x);
}

/* ---- grow_disk ---- */

struct grow {
    sp_qemu_t *d;
    char id[SP_QEMU_ID_MAX + 1]; /* looked up again: the VM may go meanwhile */
    uint64_t bytes;
    sp_driver_cb cb;
    void *arg;
};

static void on_grown(void *arg, json_t *ret, const sp_err_t *err)
{
    (void)ret;
    struct grow *g = arg;
    struct vm *vm = sp_qemu__vm_find(g->d, g->id);
    sp_err_t e;
    if (err != NULL) {
        sp_log(SP_LOG_WARN, "qemu", "block_resize failed sandbox=%s err=%s", g->id, err->msg);
        sp_err_set(&e, SP_ERUNTIME, "cannot grow the disk: %s", err->msg);
    } else if (vm != NULL) {
        vm->disk_total = g->bytes;
        /* vm.json says so too (a later driver adopting the VM reads it) */
        char p[PATH_MAX + 16];
        sp_qemu__vm_path(vm, "vm.json", p, sizeof p);
        json_t *o = json_load_file(p, 0, NULL);
        char *text = NULL;
        if (o == NULL ||
            json_object_set_new(o, "disk_bytes", json_integer((json_int_t)g->bytes)) < 0 ||
            (text = json_dumps(o, JSON_COMPACT)) == NULL ||
            sp_qemu__write_atomic(p, text, strlen(text)) < 0)
            sp_log(SP_LOG_WARN, "qemu", "cannot record the grown disk sandbox=%s", vm->id);
        free(text);
        json_decref(o);
        sp_log(SP_LOG_INFO, "qemu", "disk grown sandbox=%s mib=%llu", g->id,
               (unsigned long long)(g->bytes >> 20));
    }
    if (sp_qemu__complete(g->d, g->cb, g->arg, err != NULL ? &e : NULL) < 0)
        sp_log(SP_LOG_ERROR, "qemu", "out of memory completing a disk grow");
    free(g);
}

int sp_qemu__q_grow_disk(sp_driver_t *base, const char *id, uint64_t bytes, sp_driver_cb cb,
                         void *arg, sp_err_t *err)
{
    sp_qemu_t *d = (sp_qemu_t *)base;
    struct vm *vm = sp_qemu__running_vm(d, id, err);
    if (vm == NULL)
        return -1;
    if (bytes < vm->disk_total || bytes % (1u << 20) != 0)
        return sp_err_set(err, SP_EINVAL,
                          "a disk grows to a whole number of MiB, not below its %llu MiB",
                          (unsigned long long)(vm->disk_total >> 20));
    /* the jail's limit on any file QEMU writes (confine.c), as it would be for this disk */
    struct rlimit fs;
    if (vm->pid > 0 && prlimit(vm->pid, RLIMIT_FSIZE, NULL, &fs) == 0 &&
        fs.rlim_max != RLIM_INFINITY) {
        rlim_t want = (rlim_t)(bytes + ((uint64_t)vm->memory_mb << 20) + (1ull << 30));
        struct rlimit nf = {want, want};
        if (want > fs.rlim_max && prlimit(vm->pid, RLIMIT_FSIZE, &nf, NULL) < 0)
            return sp_err_set(err, SP_ERUNTIME, "cannot raise the VM's file size limit: %s",
                              strerror(errno));
    }
    struct grow *g = calloc(1, sizeof(*g));
    json_t *args = json_pack("{s:s,s:I}", "device", "root", "size", (json_int_t)bytes);
    if (g == NULL || args == NULL) {
        free(g);
        json_decref(args);
        return sp_err_set(err, SP_EINTERNAL, "out of memory");
    }
    *g = (struct grow){d, "", bytes, cb, arg};
    sp_qemu__sfmt(g->id, sizeof g->id, "%s", id);
    if (sp_qmp_command(vm->qmp, "block_resize", args, -1, on_grown, g, err) < 0) {
        free(g);
        return -1;
    }
    return 0;
}
