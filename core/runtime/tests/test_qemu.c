/*
 * test_qemu.c - the QEMU driver's paths that need no VM: idempotent destroy,
 * probe of leftovers and of a committed snapshot, refusals that fail at once, which
 * images stand alone (with images the real qemu-img makes, when it is installed).
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

#include "core/runtime/qemu.h"
#include "core/runtime/qemu/qemu_int.h" /* the seccomp verdict and the refusal */
#include "loop/loop.h"
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

static bool has_insecure(sp_driver_t *d, const char *what)
{
    const char *ins[8];
    size_t n = sp_driver_insecure(d, ins, 8);
    for (size_t i = 0; i < n; i++)
        if (strcmp(ins[i], what) == 0)
            return true;
    return false;
}

/* A QEMU whose seccomp probe fails (/bin/false stands in: the probe result is faked): VMs are
 * refused, and /healthz's list says so, unless the operator said --insecure-no-seccomp. The
 * same for cgroups. */
static void test_qemu_refuses_without_seccomp(void)
{
    for (int allow = 0; allow < 2; allow++) {
        sp_qemu_opts_t o = {.data_dir = dir,
                            .accel = "tcg",
                            .qemu = "/bin/false",
                            .qemu_img = "/bin/true",
                            .insecure_no_seccomp = allow};
        sp_err_t e;
        sp_driver_t *d = sp_qemu_create(loop, &o, &e);
        REQUIRE(d != NULL);
        sp_qemu_t *q = (sp_qemu_t *)d;
        for (int i = 0; i < 400 && q->sandbox < 0; i++)
            sp_loop_run_once(loop, 10);
        REQUIRE(q->sandbox == 0);
        const char *why = sp_qemu__confine_refusal(q, true);
        if (allow) {
            CHECK(why == NULL);
            CHECK(has_insecure(d, "no-seccomp"));
        } else {
            CHECK(why != NULL && strstr(why, "--insecure-no-seccomp") != NULL);
            CHECK(has_insecure(d, "no-seccomp: VMs do not start"));
        }
        /* a VM without its cgroup: refused unless --insecure-no-cgroups */
        q->sandbox = 1;
        CHECK(sp_qemu__confine_refusal(q, true) == NULL);
        why = sp_qemu__confine_refusal(q, false);
        CHECK(why != NULL && strstr(why, "--insecure-no-cgroups") != NULL);
        q->allow_no_cgroups = true;
        CHECK(sp_qemu__confine_refusal(q, false) == NULL);
        /* root jails unless told not to; vms/ is 0700 either way */
        CHECK(has_insecure(d, "no-jail") == (geteuid() != 0));
        struct stat st;
        char p[512];
        snprintf(p, sizeof p, "%s/vms", dir);
        REQUIRE(stat(p, &st) == 0);
        CHECK((st.st_mode & 0777) == 0700);
        sp_driver_destroy(d);
    }
    sp_qemu_opts_t o = {
        .data_dir = dir, .qemu = "/bin/true", .qemu_img = "/bin/true", .no_jail = 1};
    sp_err_t e;
    sp_driver_t *d = sp_qemu_create(loop, &o, &e);
    REQUIRE(d != NULL);
    CHECK(has_insecure(d, "no-jail"));
    sp_driver_destroy(d);
    if (geteuid() == 0) {
        sp_qemu_opts_t bad = {.data_dir = dir,
                              .qemu = "/bin/true",
                              .qemu_img = "/bin/true",
                              .jail_uid_range = "0:100"};
        CHECK(sp_qemu_create(loop, &bad, &e) == NULL && e.code == SP_EINVAL);
    }
}

/* The spare pool's bounds from options and environment (no spare is made: no create). */
static void test_qemu_pool_options(void)
{
    sp_qemu_pool_stats_t st;
    sp_qemu_opts_t o = {.data_dir = dir,
                        .accel = "tcg",
                        .qemu = "/bin/true",
                        .qemu_img = "/bin/true",
                        .pool_size = 5,
                        .pool_memory_mb = 700,
                        .pool_reserve_mb = 300};
    sp_err_t e;
    setenv("SPACE_POOL_RESERVE_MB", "77", 1); /* the options win */
    sp_driver_t *d = sp_qemu_create(loop, &o, &e);
    REQUIRE(d != NULL);
    CHECK(sp_qemu_pool_stats(d, &st) == 0);
    CHECK(st.budget_mb == 700 && st.target == 0 && st.ready == 0 && st.used_mb == 0);
    CHECK(((sp_qemu_t *)d)->pool_size == 5);
    CHECK(((sp_qemu_t *)d)->pool_reserve_mb == 300);
    CHECK(sp_qemu_pool_reserve(d, 12) == 0 && ((sp_qemu_t *)d)->pool_reserve_mb == 12);
    sp_driver_destroy(d);
    o.pool_reserve_mb = -1; /* none */
    d = sp_qemu_create(loop, &o, &e);
    REQUIRE(d != NULL);
    CHECK(((sp_qemu_t *)d)->pool_reserve_mb == 0);
    sp_driver_destroy(d);
    o.pool_reserve_mb = 0; /* the environment's */
    d = sp_qemu_create(loop, &o, &e);
    REQUIRE(d != NULL);
    CHECK(((sp_qemu_t *)d)->pool_reserve_mb == 77);
    sp_driver_destroy(d);
    unsetenv("SPACE_POOL_RESERVE_MB");
    /* from the environment; a bad value: the default (a share of the host's RAM) */
    o.pool_memory_mb = 0;
    o.pool_size = 0;
    setenv("SPACE_POOL_MEMORY_MB", "123", 1);
    setenv("SPACE_POOL_SIZE", "1000", 1);
    d = sp_qemu_create(loop, &o, &e);
    REQUIRE(d != NULL);
    CHECK(sp_qemu_pool_stats(d, &st) == 0 && st.budget_mb == 123);
    CHECK(((sp_qemu_t *)d)->pool_size == SP_QEMU_POOL_MAX);
    sp_driver_destroy(d);
    setenv("SPACE_POOL_MEMORY_MB", "lots", 1);
    unsetenv("SPACE_POOL_SIZE");
    d = sp_qemu_create(loop, &o, &e);
    REQUIRE(d != NULL);
    long pages = sysconf(_SC_PHYS_PAGES), psz = sysconf(_SC_PAGESIZE);
    CHECK(sp_qemu_pool_stats(d, &st) == 0 &&
          st.budget_mb == (uint64_t)pages * (uint64_t)psz / SP_QEMU_POOL_RAM_DIV / 1048576);
    CHECK(((sp_qemu_t *)d)->pool_size == SP_QEMU_POOL_DEFAULT);
    CHECK(((sp_qemu_t *)d)->pool_reserve_mb ==
          (uint64_t)pages * (uint64_t)psz / 1048576 / SP_QEMU_POOL_RESERVE);
    sp_driver_destroy(d);
    unsetenv("SPACE_POOL_MEMORY_MB");
    /* no pool: no policy, a zero budget */
    o.pool_size = -1;
    d = sp_qemu_create(loop, &o, &e);
    REQUIRE(d != NULL);
    CHECK(sp_qemu_pool_stats(d, &st) == 0 && st.budget_mb == 0 && st.target == 0);
    sp_driver_destroy(d);
    CHECK(sp_qemu_pool_stats(NULL, &st) == -1);
    CHECK(sp_qemu_pool_reserve(NULL, 1) == -1);
}

/* A spare (pooled) or a sandbox's VM of template tname built as hash, without a process. */
static struct vm *fake_vm(sp_driver_t *d, const char *id, bool pooled, const char *tname,
                          const char *hash)
{
    struct vm *vm = sp_qemu__vm_new((sp_qemu_t *)d, id);
    REQUIRE(vm != NULL);
    vm->tp = calloc(1, sizeof(*vm->tp));
    REQUIRE(vm->tp != NULL);
    snprintf(vm->tp->hash, sizeof vm->tp->hash, "%s", hash);
    snprintf(vm->template_name, sizeof vm->template_name, "%s", tname);
    if (pooled) {
        snprintf(vm->dir, sizeof vm->dir, "%s/vms/.%s", dir, id);
        snprintf(vm->pool_key, sizeof vm->pool_key, "k-%s", id);
        vm->pooled = true;
    }
    return vm;
}

static void fake_want(sp_driver_t *d, const char *key, const char *tname, const char *hash)
{
    sp_qemu_t *q = (sp_qemu_t *)d;
    struct poolwant *w = calloc(1, sizeof(*w));
    REQUIRE(w != NULL);
    snprintf(w->key, sizeof w->key, "%s", key);
    snprintf(w->template_name, sizeof w->template_name, "%s", tname);
    snprintf(w->tp.hash, sizeof w->tp.hash, "%s", hash);
    w->next = q->wants;
    q->wants = w;
}

/* template_forget lets go of the spares of one version of one template, reached by its name
 * (it was the default build) or by name@hash, and of the sizes wanted of it; a sandbox's VM of
 * that version, another version and another template that starts with the same letters keep
 * theirs. sp_qemu_spare_dir knows the spares' directories and nothing else. */
static void test_qemu_template_forget(void)
{
    static const char h1[] = "1111111111111111111111111111111111111111111111111111111111111111";
    static const char h2[] = "2222222222222222222222222222222222222222222222222222222222222222";
    /* h2 as a tag reaches it */
    static const char app2[] =
        "app@2222222222222222222222222222222222222222222222222222222222222222";
    sp_qemu_opts_t o = {.data_dir = dir,
                        .accel = "tcg",
                        .qemu = "/bin/true",
                        .qemu_img = "/bin/true",
                        .pool_size = 5};
    sp_err_t e;
    sp_driver_t *d = sp_qemu_create(loop, &o, &e);
    REQUIRE(d != NULL && d->ops->template_forget != NULL);
    struct vm *a = fake_vm(d, "pool-1-1", true, "app", h1);
    struct vm *b = fake_vm(d, "pool-2-1", true, app2, h2);
    struct vm *c = fake_vm(d, "pool-3-1", true, "app", h2);
    struct vm *other = fake_vm(d, "pool-4-1", true, "apple", h1);
    struct vm *sb = fake_vm(d, "sandbox1", false, "app", h1);
    fake_want(d, "w-app-1", "app", h1);
    fake_want(d, "w-app-2", app2, h2);
    fake_want(d, "w-apple-1", "apple", h1);
    sp_qemu_t *q = (sp_qemu_t *)d;

    CHECK(sp_qemu_spare_dir(d, ".pool-1-1") && sp_qemu_spare_dir(d, ".pool-4-1"));
    CHECK(!sp_qemu_spare_dir(d, "sandbox1") && !sp_qemu_spare_dir(d, ".pool-9-1"));
    CHECK(!sp_qemu_spare_dir(NULL, ".pool-1-1"));

    CHECK(d->ops->template_forget(d, "app", h1) == 1);
    CHECK(a->pool_drop && !b->pool_drop && !c->pool_drop && !other->pool_drop && !sb->pool_drop);
    CHECK(sp_qemu__pool_want(q, "w-app-1") == NULL && sp_qemu__pool_want(q, "w-app-2") != NULL &&
          sp_qemu__pool_want(q, "w-apple-1") != NULL);
    CHECK(d->ops->template_forget(d, "app", h1) == 0); /* already let go */
    CHECK(d->ops->template_forget(d, "app", h2) == 2);
    CHECK(b->pool_drop && c->pool_drop && !other->pool_drop);
    CHECK(sp_qemu__pool_want(q, "w-app-2") == NULL && sp_qemu__pool_want(q, "w-apple-1") != NULL);
    CHECK(d->ops->template_forget(d, "ap", h1) == 0 && !other->pool_drop);
    /* still a spare until it is stopped: the collector may let it go with its version */
    CHECK(sp_qemu_spare_dir(d, ".pool-1-1"));
    sp_driver_destroy(d); /* no process: the spares are only freed */
}

/* image_standalone on images qemu-img makes: a standalone one (as made, and as a squashing
 * export's convert writes it, also as a version 2 image) is 1; a layer, and an image with an
 * external data file, are 0; anything else -1. Skipped without qemu-img. */
static void test_qemu_image_standalone(void)
{
    if (system("command -v qemu-img >/dev/null 2>&1") != 0) {
        printf("test_qemu_image_standalone: skipped, no qemu-img\n");
        return;
    }
    char cmd[2048];
    snprintf(cmd, sizeof cmd,
             "cd %s && qemu-img create -q -f qcow2 base.qcow2 16M && "
             "qemu-img create -q -f qcow2 -b base.qcow2 -F qcow2 layer.qcow2 && "
             "qemu-img convert -q -f qcow2 -O qcow2 layer.qcow2 flat.qcow2 && "
             "qemu-img create -q -f qcow2 -o compat=0.10 v2.qcow2 16M && "
             "qemu-img create -q -f qcow2 -o compat=0.10 -b base.qcow2 -F qcow2 v2layer.qcow2 && "
             "qemu-img create -q -f qcow2 -o data_file=data.raw ext.qcow2 16M",
             dir);
    REQUIRE(system(cmd) == 0);
    put("text.qcow2", "not an image at all, but longer than a qcow2 header is: 0123456789abcdef");
    sp_driver_t *d = make();
    REQUIRE(d->ops->image_standalone != NULL);
    static const struct {
        const char *file;
        int want;
    } cases[] = {{"base.qcow2", 1},  {"flat.qcow2", 1},    {"v2.qcow2", 1},
                 {"layer.qcow2", 0}, {"v2layer.qcow2", 0}, {"ext.qcow2", 0},
                 {"text.qcow2", -1}, {"missing.qcow2", -1}};
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        char p[512];
        snprintf(p, sizeof p, "%s/%s", dir, cases[i].file);
        int got = d->ops->image_standalone(d, p);
        if (got != cases[i].want)
            fprintf(stderr, "image_standalone(%s) = %d, want %d\n", cases[i].file, got,
                    cases[i].want);
        CHECK(got == cases[i].want);
    }
    CHECK(d->ops->image_standalone(d, "base.qcow2") == -1); /* relative: refused */
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
    test_qemu_refuses_without_seccomp();
    test_qemu_pool_options();
    test_qemu_template_forget();
    test_qemu_image_standalone();
    pump();
    sp_loop_destroy(loop);
    char cmd[600];
    snprintf(cmd, sizeof cmd, "rm -rf %s", dir);
    REQUIRE(system(cmd) == 0);
    return check_report("qemu driver unit");
}
