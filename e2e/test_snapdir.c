/*
 * test_snapdir.c - a sandbox suspended on one worker wakes on another, through a shared
 * snapshot dir (core/runtime/qemu.h: opts.snapshot_dir), end to end on real microVMs.
 *
 * Two QEMU drivers in this process stand for two workers: A on the test data dir
 * (SP_TEST_DATA_DIR, a built base template), B on a data dir of its own holding the same
 * template build (its files hard-linked, its directories its own: B builds nothing), one
 * snapshot dir beside them. A clone of base on A gets a file and a background process that
 * counts; it suspends on A (then A's driver goes, as a worker would), and B wakes it: the file
 * is there and the process still counts; nothing of it is left in A's data dir nor in the
 * snapshot dir. Then it suspends on B and wakes on A again (a snapshot whose disk layers came
 * from the snapshot dir goes back there), and a delete removes everything everywhere. While it
 * runs on B, a probe on A (which has nothing of it) leaves B's VM alone.
 * Skips (77) without QEMU or a built base template.
 */
#include <dirent.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "core/runtime/driver.h"
#include "core/runtime/qemu.h"
#include "e2e/vmtest.h"
#include "guest/tmplbuild.h"
#include "loop/loop.h"
#include "tests/check.h"

static char snap_dir[4096], b_dir[4096];

static bool exists(const char *fmt, const char *a, const char *b)
{
    char p[8192];
    snprintf(p, sizeof p, fmt, a, b);
    struct stat st;
    return stat(p, &st) == 0;
}

/* Whether the shared dir's trash (what a worker let go of there: loop/discard.h) is empty
 * within 10 s of the loop running: the space is freed, not only the name. */
static bool shared_trash_drains(void)
{
    char p[8192];
    snprintf(p, sizeof p, "%s/sandboxes/.trash", snap_dir);
    for (int i = 0; i < 200; i++) {
        DIR *d = opendir(p);
        int n = 0;
        struct dirent *de;
        while (d != NULL && (de = readdir(d)) != NULL)
            n += de->d_name[0] != '.';
        if (d != NULL)
            closedir(d);
        if (n == 0)
            return true;
        vt_run_for(50);
    }
    return false;
}

static sp_driver_t *worker(const char *data_dir)
{
    return vt_driver_at(data_dir, snap_dir, 0, -1);
}

static void sh(const char *cmd)
{
    int rc = system(cmd);
    if (rc != 0)
        fprintf(stderr, "command failed (%d): %s\n", rc, cmd);
    REQUIRE(rc == 0);
}

/* B's data dir: the base template's current build, files linked, directories its own. */
static void make_worker_b(void)
{
    char cmd[16384];
    const char *hash = vt_base.hash;
    snprintf(cmd, sizeof cmd,
             "set -e; b='%s'; a='%s'; mkdir -p \"$b/templates/base/%s\" \"$b/images\"; "
             "for f in \"$a/templates/base/%s\"/*; do [ -f \"$f\" ] && ln \"$f\" "
             "\"$b/templates/base/%s/\"; done; ln -s '%s' \"$b/templates/base/current\"; "
             "cp -al \"$a/images/.\" \"$b/images/\"",
             b_dir, vt_data_dir, hash, hash, hash, hash);
    sh(cmd);
}

/* The counter's value, read until the file holds a number: the loop's `echo $i > /tmp/count`
 * truncates before it writes, and a read or a suspend can land in between. */
static long count_of(sp_driver_t *d, const char *id)
{
    char out[64];
    vt_run_cmd(d, id,
               "for k in $(seq 1 100); do v=$(cat /tmp/count 2>/dev/null); [ -n \"$v\" ] && break; "
               "sleep 0.05; done; echo \"$v\"",
               out, sizeof out, 30000);
    return strtol(out, NULL, 10);
}

/* The file is there and the counter counts on. */
static void check_alive(sp_driver_t *d, const char *id, long before)
{
    char out[256];
    vt_run_cmd(d, id, "cat /root/moved.txt", out, sizeof out, 60000);
    CHECK(strcmp(out, "written on A") == 0);
    long c1 = count_of(d, id);
    vt_run_for(1500);
    long c2 = count_of(d, id);
    fprintf(stderr, "counter: %ld before the suspend, %ld then %ld after the wake\n", before, c1,
            c2);
    CHECK(c1 >= before);
    CHECK(c2 > c1);
}

static double wake(sp_driver_t *d, const char *id)
{
    sp_vm_spec_t spec = {.sandbox_id = id, .template_name = "base", .hostname = id};
    vt_res_t r = {0};
    sp_err_t e;
    double t0 = vt_now_ms();
    int rc = d->ops->restore(d, &spec, vt_on_res, &r, &e);
    if (rc < 0)
        fprintf(stderr, "restore refused: %s\n", e.msg);
    REQUIRE(rc == 0);
    vt_wait_ok(&r, "wake", id, 240000);
    return vt_now_ms() - t0;
}

int main(void)
{
    vt_init();
    snprintf(snap_dir, sizeof snap_dir, "%s/../snapdir-test-%d", vt_data_dir, (int)getpid());
    snprintf(b_dir, sizeof b_dir, "%s/../snapdir-worker-b-%d", vt_data_dir, (int)getpid());
    make_worker_b();
    const char *id = "snapdir-move-1";

    sp_driver_t *a = worker(vt_data_dir);
    sp_vm_spec_t spec = {.sandbox_id = id,
                         .template_name = "base",
                         .cpu_count = 1,
                         .memory_mb = 256,
                         .hostname = id};
    vt_boot(a, &spec, 300000);
    char out[256];
    vt_run_cmd(a, id,
               "echo 'written on A' > /root/moved.txt; sync; "
               "(i=0; while :; do i=$((i+1)); echo $i > /tmp/count; sleep 0.1; done) "
               ">/dev/null 2>&1 & sleep 0.5; echo started",
               out, sizeof out, 60000);
    CHECK(strcmp(out, "started") == 0);
    long before = count_of(a, id);
    /* the template image went to the snapshot dir, and the VM's disk is made over it */
    CHECK(exists("%s/templates/base/%s/rootfs.qcow2", snap_dir, vt_base.hash));

    double t0 = vt_now_ms();
    vt_op(a, a->ops->snapshot, id, 240000);
    fprintf(stderr, "suspend on A: %.0f ms\n", vt_now_ms() - t0);
    CHECK(exists("%s/sandboxes/%s/snapshot/manifest.json", snap_dir, id));
    CHECK(!exists("%s/vms/%s", vt_data_dir, id));
    sp_driver_destroy(a); /* A is gone as far as this sandbox is concerned */

    sp_driver_t *b = worker(b_dir);
    CHECK(b->ops->probe(b, id) == SP_VM_SUSPENDED);
    fprintf(stderr, "wake on B: %.0f ms\n", wake(b, id));
    check_alive(b, id, before);
    CHECK(!exists("%s/sandboxes/%s", snap_dir, id));
    CHECK(shared_trash_drains());
    CHECK(!exists("%s/vms/%s", vt_data_dir, id));
    CHECK(exists("%s/vms/%s/disk.qcow2", b_dir, id));

    /* A, back (a worker restarted settles the sandboxes that moved away from it: fleet.c's
     * comeback), probes it: nothing of it is A's, and B's VM of it lives on, though it is in
     * a cgroup of the same name on this host */
    a = worker(vt_data_dir);
    CHECK(a->ops->probe(a, id) == SP_VM_ABSENT);
    sp_driver_destroy(a);
    check_alive(b, id, before);

    /* back to A: the snapshot's layers came from the snapshot dir and go back there */
    before = count_of(b, id);
    vt_op(b, b->ops->snapshot, id, 240000);
    CHECK(exists("%s/sandboxes/%s/snapshot/manifest.json", snap_dir, id));
    CHECK(!exists("%s/vms/%s", b_dir, id));
    sp_driver_destroy(b);
    a = worker(vt_data_dir);
    fprintf(stderr, "wake on A: %.0f ms\n", wake(a, id));
    check_alive(a, id, before);

    /* suspended, then deleted by the worker that did not suspend it: gone everywhere */
    vt_op(a, a->ops->snapshot, id, 240000);
    sp_driver_destroy(a);
    b = worker(b_dir);
    vt_op(b, b->ops->destroy, id, 60000);
    CHECK(b->ops->probe(b, id) == SP_VM_ABSENT);
    CHECK(!exists("%s/sandboxes/%s", snap_dir, id));
    CHECK(!exists("%s/vms/%s", vt_data_dir, id));
    CHECK(!exists("%s/vms/%s", b_dir, id));
    CHECK(shared_trash_drains());
    sp_driver_destroy(b);

    char cmd[8400];
    snprintf(cmd, sizeof cmd, "rm -rf '%s' '%s'", snap_dir, b_dir);
    sh(cmd);
    sp_loop_destroy(vt_loop);
    return check_report("snapdir e2e");
}
