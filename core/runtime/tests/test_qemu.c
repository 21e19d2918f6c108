/*
 * test_qemu.c - the QEMU driver's paths that need no VM: idempotent destroy,
 * probe of leftovers and of a committed snapshot, refusals that fail at once.
 *
 * QEMU itself is replaced by /bin/true (it only has to exist); no VM boots,
 * no root, KVM or network is needed. Real VMs: e2e/test_qemu_driver.c.
 */
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "loop/loop.h"
#include "core/runtime/qemu.h"
#include "tests/check.h"

static sp_loop_t *loop;
static char dir[] = "/tmp/test_qemu_XXXXXX";

struct res {
    int done;
    int ok;
};

static void on_res(void *arg, const sp_err_t *err)
{
    struct res *r = arg;
    r->done++;
    r->ok = err == NULL;
}

static void pump(void)
{
    for (int i = 0; i < 5; i++)
        sp_loop_run_once(loop, 5);
}

static void put(const char *rel, const char *text)
{
    char p[512];
    snprintf(p, sizeof p, "%s/%s", dir, rel);
    FILE *f = fopen(p, "w");
    REQUIRE(f != NULL);
    fputs(text, f);
    fclose(f);
}

static bool exists(const char *rel)
{
    char p[512];
    snprintf(p, sizeof p, "%s/%s", dir, rel);
    return access(p, F_OK) == 0;
}

static sp_driver_t *make(void)
{
    sp_qemu_opts_t o = {
        .data_dir = dir, .accel = "tcg", .qemu = "/bin/true", .qemu_img = "/bin/true"};
    sp_err_t e;
    sp_driver_t *d = sp_qemu_create(loop, &o, &e);
    REQUIRE(d != NULL);
    return d;
}

static void test_qemu_bad_options(void)
{
    sp_err_t e;
    sp_qemu_opts_t o = {.data_dir = dir, .accel = "fast"};
    REQUIRE(sp_qemu_create(loop, &o, &e) == NULL && e.code == SP_EINVAL);
    sp_qemu_opts_t o2 = {.data_dir = dir, .qemu = "/nonexistent/qemu"};
    REQUIRE(sp_qemu_create(loop, &o2, &e) == NULL && e.code == SP_ERUNTIME);
}

/* Destroy of a sandbox that has nothing succeeds, on the next loop turn. */
static void test_qemu_destroy_absent_succeeds(void)
{
    sp_driver_t *d = make();
    struct res r = {0};
    sp_err_t e;
    REQUIRE(d->ops->destroy(d, "sb1", on_res, &r, &e) == 0);
    REQUIRE(r.done == 0);
    pump();
    REQUIRE(r.done == 1 && r.ok);
    REQUIRE(d->ops->destroy(d, "../etc", on_res, &r, &e) < 0 && e.code == SP_EINVAL);
    sp_driver_destroy(d);
}

/* A VM dir whose QEMU is gone is cleaned up by probe; a committed snapshot is SUSPENDED. */
static void test_qemu_probe_leftovers_and_snapshot(void)
{
    sp_driver_t *d = make();
    REQUIRE(mkdir(strcat(strcpy((char[512]){0}, dir), "/vms/dead"), 0700) == 0);
    put("vms/dead/qemu.pid", "999999999\n"); /* no such process */
    put("vms/dead/disk.qcow2", "x");
    REQUIRE(d->ops->probe(d, "dead") == SP_VM_ABSENT);
    REQUIRE(!exists("vms/dead"));

    /* a live process that is not our QEMU (its cmdline does not name the dir) */
    REQUIRE(mkdir(strcat(strcpy((char[512]){0}, dir), "/vms/other"), 0700) == 0);
    char pid[32];
    snprintf(pid, sizeof pid, "%d\n", (int)getpid());
    put("vms/other/qemu.pid", pid);
    REQUIRE(d->ops->probe(d, "other") == SP_VM_ABSENT);
    REQUIRE(!exists("vms/other"));

    REQUIRE(mkdir(strcat(strcpy((char[512]){0}, dir), "/vms/susp"), 0700) == 0);
    REQUIRE(mkdir(strcat(strcpy((char[512]){0}, dir), "/vms/susp/snapshot"), 0700) == 0);
    put("vms/susp/snapshot/manifest.json", "{}");
    REQUIRE(d->ops->probe(d, "susp") == SP_VM_SUSPENDED);
    REQUIRE(d->ops->agent(d, "susp") == NULL);
    sp_vm_stats_t st;
    sp_err_t e;
    REQUIRE(d->ops->stats(d, "susp", &st, &e) < 0 && e.code == SP_ENOTFOUND);
    /* suspending what is suspended succeeds; booting over a snapshot is refused */
    struct res r = {0};
    REQUIRE(d->ops->snapshot(d, "susp", on_res, &r, &e) == 0);
    pump();
    REQUIRE(r.done == 1 && r.ok);
    sp_vm_spec_t spec = {.sandbox_id = "susp", .template_name = "base"};
    REQUIRE(d->ops->boot(d, &spec, on_res, &r, &e) < 0 && e.code == SP_ECONFLICT);
    /* the snapshot lacks its files: restore refuses at once, keeps it */
    REQUIRE(d->ops->restore(d, &spec, on_res, &r, &e) < 0 && e.code == SP_ERUNTIME);
    REQUIRE(exists("vms/susp/snapshot/manifest.json"));
    /* destroy removes it all */
    struct res rd = {0};
    REQUIRE(d->ops->destroy(d, "susp", on_res, &rd, &e) == 0);
    pump();
    REQUIRE(rd.done == 1 && rd.ok && !exists("vms/susp"));
    REQUIRE(d->ops->probe(d, "susp") == SP_VM_ABSENT);
    sp_driver_destroy(d);
}

static void test_qemu_refusals(void)
{
    sp_driver_t *d = make();
    sp_err_t e;
    struct res r = {0};
    sp_vm_spec_t spec = {.sandbox_id = "sb2", .template_name = "nosuch"};
    REQUIRE(d->ops->boot(d, &spec, on_res, &r, &e) < 0 && e.code == SP_ERUNTIME);
    sp_vm_spec_t bad = {.sandbox_id = "a/b", .template_name = "base"};
    REQUIRE(d->ops->boot(d, &bad, on_res, &r, &e) < 0 && e.code == SP_EINVAL);
    sp_vm_spec_t env = {.sandbox_id = "sb2", .template_name = "base", .env_json = "[1]"};
    REQUIRE(d->ops->boot(d, &env, on_res, &r, &e) < 0 && e.code == SP_EINVAL);
    REQUIRE(d->ops->pause(d, "sb2", on_res, &r, &e) < 0 && e.code == SP_ENOTFOUND);
    REQUIRE(d->ops->resume(d, "sb2", on_res, &r, &e) < 0 && e.code == SP_ENOTFOUND);
    REQUIRE(d->ops->snapshot(d, "sb2", on_res, &r, &e) < 0 && e.code == SP_ENOTFOUND);
    REQUIRE(d->ops->restore(d, &spec, on_res, &r, &e) < 0 && e.code == SP_ECONFLICT);
    pump();
    REQUIRE(r.done == 0);
    sp_driver_destroy(d);
}

int main(void)
{
    REQUIRE(mkdtemp(dir) != NULL);
    loop = sp_loop_create();
    REQUIRE(loop != NULL);
    test_qemu_bad_options();
    test_qemu_destroy_absent_succeeds();
    test_qemu_probe_leftovers_and_snapshot();
    test_qemu_refusals();
    pump();
    sp_loop_destroy(loop);
    char cmd[600];
    snprintf(cmd, sizeof cmd, "rm -rf %s", dir);
    REQUIRE(system(cmd) == 0);
    printf("qemu driver unit: all tests passed\n");
    return 0;
}
