/*
 * test_clones.c - create from a template snapshot, end to end on real microVMs.
 *
 * Needs qemu-system-x86_64, qemu-img and a data directory with a built `base`
 * template (SP_TEST_DATA_DIR); skips (77) saying why otherwise. SP_TEST_ACCEL
 * picks auto|kvm|tcg; SP_TEST_TIMEOUT_MULT stretches timeouts.
 *
 * Two concurrent first creates of a size with no snapshot share one snapshot
 * build; a damaged snapshot is kept while a clone uses it (creates cold-boot), removed once
 * unused and rebuilt. Two clones of `base`: both answer, read
 * different bytes from /dev/urandom, have their own hostnames and sandbox IDs, and do not see each
 * other's files. A clone suspends (its RAM goes into the stream) and wakes into a RAM file of its
 * own with its files and a background process; it then suspends and wakes again by device state
 * only. A clone is re-adopted across a driver restart. Destroy leaves no process, directory or
 * cgroup; the template snapshot stays and later creates reuse it (same directory, not rebuilt).
 * Prints clone create-to-agent-ready (median of 5) beside a cold boot with cold_boot set.
 * Template warmup and snapshot collection on hand-made template builds (base's root filesystem
 * linked): see warmup_and_gc. The spare pool: see pool_section and burst_section. A driver
 * destroyed right after it started (while, jailed, it seals
 * template RAM off the loop) leaves nothing for ASan to find.
 */
#include <dirent.h>
#include <errno.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include <jansson.h>

#include "base/log.h"
#include "core/channel/agentconn.h"
#include "core/runtime/cgroup.h"
#include "core/runtime/driver.h"
#include "core/runtime/qemu.h"
#include "e2e/vmtest.h"
#include "guest/tmplbuild.h"
#include "loop/loop.h"
#include "tests/check.h"

static sp_cgroup_t *cgl;

/* The sections below count on exactly the VMs they make: no spares (pool -1) unless they
 * ask for them. */

/* Sandbox id of `base` with mem_mb of RAM and its id as hostname. */
static sp_vm_spec_t sized_spec(const char *id, int mem_mb)
{
    return (sp_vm_spec_t){.sandbox_id = id,
                          .template_name = "base",
                          .cpu_count = 1,
                          .memory_mb = mem_mb,
                          .hostname = id};
}

static void start_boot(sp_driver_t *d, const char *id, int mem_mb, vt_res_t *r)
{
    sp_vm_spec_t spec = sized_spec(id, mem_mb);
    vt_boot_start(d, &spec, r);
}

static void boot_sized(sp_driver_t *d, const char *id, int mem_mb)
{
    sp_vm_spec_t spec = sized_spec(id, mem_mb);
    vt_boot(d, &spec, 180000);
}

/* Boots sandbox id of `base` with its id as hostname; ms to agent ready. */
static double boot(sp_driver_t *d, const char *id)
{
    sp_vm_spec_t spec = {.sandbox_id = id,
                         .template_name = "base",
                         .cpu_count = 1,
                         .memory_mb = 256,
                         .hostname = id,
                         .env_json = "{\"CLONE_TEST\":\"1\"}"};
    return vt_boot(d, &spec, 180000);
}

static void op(sp_driver_t *d,
               int (*fn)(sp_driver_t *, const char *, sp_driver_cb, void *, sp_err_t *),
               const char *id)
{
    vt_op(d, fn, id, 60000);
}

static double restore(sp_driver_t *d, const char *id)
{
    sp_vm_spec_t spec = {.sandbox_id = id, .template_name = "base", .hostname = id};
    vt_res_t r = {0};
    sp_err_t e;
    double t0 = vt_now_ms();
    REQUIRE(d->ops->restore(d, &spec, vt_on_res, &r, &e) == 0);
    vt_wait_ok(&r, "restore", id, 60000);
    return vt_now_ms() - t0;
}

static void run_cmd(sp_driver_t *d, const char *id, const char *cmd, char *out, size_t n)
{
    vt_run_cmd(d, id, cmd, out, n, 30000);
}

/* Contents of a small file of the VM dir ("" when missing). */
static void vm_file(const char *id, const char *name, char *out, size_t n)
{
    char p[4096];
    snprintf(p, sizeof p, "%s/vms/%s/%s", vt_data_dir, id, name);
    vt_read_file(p, out, n);
}

/* The one committed template snapshot dir of the current base build for tag ("-256M-1c-")
 * into out; its inode. With remove, deletes every one for tag instead (0). */
static ino_t tsnap_dir_ex(const sp_tmplbuild_paths_t *tp, const char *tag, char *out, size_t n,
                          int remove)
{
    DIR *dir = opendir(tp->build_dir);
    REQUIRE(dir != NULL);
    struct dirent *de;
    ino_t ino = 0;
    int count = 0;
    while ((de = readdir(dir)) != NULL) {
        if (strncmp(de->d_name, "snapshot-", 9) != 0 || strstr(de->d_name, ".tmp-") != NULL ||
            strstr(de->d_name, ".bad-") != NULL || strstr(de->d_name, tag) == NULL)
            continue;
        if (strlen(tp->build_dir) + strlen(de->d_name) + 2 > n)
            continue;
        memcpy(out, tp->build_dir, strlen(tp->build_dir));
        out[strlen(tp->build_dir)] = '/';
        strcpy(out + strlen(tp->build_dir) + 1, de->d_name);
        char m[4200];
        if (remove) {
            snprintf(m, sizeof m, "rm -rf '%s'", out);
            REQUIRE(system(m) == 0);
            continue;
        }
        snprintf(m, sizeof m, "%s/template-snapshot.json", out);
        struct stat st;
        if (stat(m, &st) == 0) {
            ino = st.st_ino;
            count++;
        }
    }
    closedir(dir);
    REQUIRE(remove || count == 1);
    return ino;
}

static ino_t tsnap_dir(const sp_tmplbuild_paths_t *tp, char *out, size_t n)
{
    return tsnap_dir_ex(tp, "-256M-1c-", out, n, 0);
}

static void check_gone(const char *id, pid_t pid)
{
    vt_run_for(100);
    REQUIRE(pid <= 0 || (kill(pid, 0) < 0 && errno == ESRCH));
    char p[4096];
    struct stat st;
    snprintf(p, sizeof p, "%s/vms/%s", vt_data_dir, id);
    REQUIRE(stat(p, &st) < 0 && errno == ENOENT);
    static const char *const ctl[] = {"cpu", "memory", "pids"};
    for (size_t i = 0; i < 3; i++) {
        char dir[4096];
        if (sp_cgroup_vm_dir(cgl, ctl[i], id, dir, sizeof dir) == 0)
            REQUIRE(stat(dir, &st) < 0 && errno == ENOENT);
    }
}

/* Whether a template snapshot builder of this driver is running in its own cgroup now: its
 * work dir vms/.tsnap-<key>-<pid> is there and so is the group tsnap:<key>-<pid>, named with
 * the pid like the dir, so two spaced on one host building the same snapshot never share one.
 * -1 without cgroups. */
static int builder_group_seen(void)
{
    char p[4096];
    if (sp_cgroup_vm_dir(cgl, "memory", "x", p, sizeof p) < 0)
        return -1;
    snprintf(p, sizeof p, "%s/vms", vt_data_dir);
    DIR *dh = opendir(p);
    REQUIRE(dh != NULL);
    int seen = 0;
    struct dirent *de;
    while ((de = readdir(dh)) != NULL) {
        if (strncmp(de->d_name, ".tsnap-", 7) != 0)
            continue;
        char id[128], dir[4096];
        struct stat st;
        snprintf(id, sizeof id, "tsnap:%s", de->d_name + 7);
        if (sp_cgroup_vm_dir(cgl, "memory", id, dir, sizeof dir) == 0 && stat(dir, &st) == 0)
            seen = 1;
    }
    closedir(dh);
    return seen;
}

/* A template build made by hand from base's (its root filesystem linked, not rebuilt: this
 * test runs no mmdebstrap), with warmup (a JSON array) in its manifest as `spaced template
 * build` writes it, made current. hash: any 64 hex digits. */
static void fake_template(const sp_tmplbuild_paths_t *base, const char *name, const char *hash,
                          const char *warmup)
{
    char dir[4096], p[4400];
    snprintf(dir, sizeof dir, "%s/templates/%s/%s", vt_data_dir, name, hash);
    snprintf(p, sizeof p, "mkdir -p '%s'", dir);
    REQUIRE(system(p) == 0);
    snprintf(p, sizeof p, "%s/rootfs.qcow2", dir);
    unlink(p);
    REQUIRE(symlink(base->rootfs, p) == 0);
    json_t *m = json_load_file(base->manifest, 0, NULL);
    REQUIRE(m != NULL);
    json_object_set_new(m, "name", json_string(name));
    json_object_set_new(m, "hash", json_string(hash));
    json_object_set_new(m, "warmup", json_loads(warmup, 0, NULL));
    snprintf(p, sizeof p, "%s/manifest.json", dir);
    REQUIRE(json_dump_file(m, p, JSON_INDENT(2)) == 0);
    json_decref(m);
    char cur[4400];
    snprintf(p, sizeof p, "%s/templates/%s/current.tmp", vt_data_dir, name);
    snprintf(cur, sizeof cur, "%s/templates/%s/current", vt_data_dir, name);
    unlink(p);
    REQUIRE(symlink(hash, p) == 0 && rename(p, cur) == 0);
}

struct tsres {
    vt_res_t r;
    sp_qemu_tsnap_info_t info;
};

/* sp_qemu_template_snapshot, waited for. */
static void template_snapshot(sp_driver_t *d, const char *name, struct tsres *t)
{
    memset(t, 0, sizeof *t);
    sp_err_t e;
    REQUIRE(sp_qemu_template_snapshot(d, name, 0, 0, &t->info, vt_on_res, &t->r, &e) == 0);
    REQUIRE(vt_wait_for(&t->r.done, 180000) == 0);
}

static void boot_tmpl(sp_driver_t *d, const char *id, const char *tmpl)
{
    sp_vm_spec_t spec = {.sandbox_id = id, .template_name = tmpl, .hostname = id};
    vt_res_t r = {0};
    sp_err_t e;
    REQUIRE(d->ops->boot(d, &spec, vt_on_res, &r, &e) == 0);
    vt_wait_ok(&r, "boot", id, 180000);
}

/* A template's warmup runs in the snapshot builder before the snapshot: its clones have the
 * process it left running and the file it wrote without running anything. A warmup that fails
 * fails the snapshot (with why), and boots cold-boot without the warmup. Template snapshots of
 * a build that is no longer current are removed, but only once no clone uses them. */
static sp_driver_t *warmup_and_gc(sp_driver_t *d, const sp_tmplbuild_paths_t *base)
{
    char w[64], w2[64], c1[64], c2[64], buf[8192], p[4400];
    snprintf(w, sizeof w, "warm%d", (int)getpid());
    snprintf(w2, sizeof w2, "warmfail%d", (int)getpid());
    snprintf(c1, sizeof c1, "clone-%d-w1", (int)getpid());
    snprintf(c2, sizeof c2, "clone-%d-w2", (int)getpid());
    const char *h1 = "1111111111111111111111111111111111111111111111111111111111111111";
    const char *h2 = "2222222222222222222222222222222222222222222222222222222222222222";
    fake_template(base, w, h1,
                  "[\"/bin/sh\", \"-c\", \"echo warm > /root/warm && setsid sh -c 'echo $$ > "
                  "/root/warm.pid; exec sleep 100000' </dev/null >/dev/null 2>&1 & while [ ! -s "
                  "/root/warm.pid ]; do sleep 0.05; done\"]");

    /* built on request (what `spaced template build` does), then found */
    struct tsres t;
    double t0 = vt_now_ms();
    template_snapshot(d, w, &t);
    if (!t.r.ok)
        fprintf(stderr, "template snapshot: %s\n", t.r.err.msg);
    REQUIRE(t.r.ok && t.info.built == 1 && strstr(t.info.dir, h1) != NULL);
    printf("template snapshot with warmup built on request: %.0f ms\n", vt_now_ms() - t0);
    char s1[4096];
    snprintf(s1, sizeof s1, "%s", t.info.dir);
    template_snapshot(d, w, &t);
    REQUIRE(t.r.ok && t.info.built == 0 && strcmp(t.info.dir, s1) == 0);

    boot_tmpl(d, c1, w);
    vm_file(c1, "vm.json", buf, sizeof buf);
    REQUIRE(strstr(buf, s1) != NULL); /* a clone */
    run_cmd(d, c1, "cat /root/warm; p=$(cat /root/warm.pid); kill -0 $p && cat /proc/$p/comm", buf,
            sizeof buf);
    printf("clone of a warmed-up template: %s\n", buf);
    REQUIRE(strcmp(buf, "warm\nsleep") == 0);

    /* the template moves on (a new build is current): the old snapshot stays while c1 uses
     * it, at driver start as after a snapshot commit */
    fake_template(base, w, h2, "[\"/bin/true\"]");
    sp_driver_destroy(d);
    d = vt_driver(0, -1);
    struct stat st;
    REQUIRE(stat(s1, &st) == 0);
    REQUIRE(d->ops->probe(d, c1) == SP_VM_RUNNING);
    pid_t pc = vt_vm_pid(c1);
    op(d, d->ops->destroy, c1);
    check_gone(c1, pc);
    /* unused now: the next commit (the new build's snapshot) collects it */
    template_snapshot(d, w, &t);
    REQUIRE(t.r.ok && t.info.built == 1 && strstr(t.info.dir, h2) != NULL);
    REQUIRE(stat(s1, &st) < 0 && errno == ENOENT);
    printf("old template snapshot: kept while a clone used it, removed after\n");
    /* one of a key the current build no longer makes goes at driver start */
    snprintf(p, sizeof p, "%s/snapshot-tcg-256M-1c-0123456789abcdef", base->build_dir);
    REQUIRE(mkdir(p, 0700) == 0);
    sp_driver_destroy(d);
    d = vt_driver(0, -1);
    REQUIRE(stat(p, &st) < 0 && errno == ENOENT);
    REQUIRE(stat(t.info.dir, &st) == 0); /* the current one stays */

    /* a failing warmup fails the snapshot, saying why; boots cold-boot without it */
    fake_template(base, w2, h1,
                  "[\"/bin/sh\", \"-c\", \"echo x > /root/warm; echo warmup broke >&2; exit 3\"]");
    template_snapshot(d, w2, &t);
    printf("failing warmup: %s\n", t.r.ok ? "(ok?)" : t.r.err.msg);
    REQUIRE(!t.r.ok && strstr(t.r.err.msg, "exited with status 3") != NULL);
    boot_tmpl(d, c2, w2);
    vm_file(c2, "vm.json", buf, sizeof buf);
    REQUIRE(buf[0] != '\0' && strstr(buf, "ram_src") == NULL);
    run_cmd(d, c2, "test -e /root/warm && echo ran || echo not-run", buf, sizeof buf);
    REQUIRE(strcmp(buf, "not-run") == 0);
    pc = vt_vm_pid(c2);
    op(d, d->ops->destroy, c2);
    check_gone(c2, pc);

    snprintf(p, sizeof p, "rm -rf '%s/templates/%s' '%s/templates/%s'", vt_data_dir, w, vt_data_dir,
             w2);
    REQUIRE(system(p) == 0);
    return d;
}

static int cmp_d(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

/* The spare dirs (.pool-*) under vms/; the pid of the last one's QEMU into *pid. links:
 * count the links a taken spare leaves under its old name instead. */
static int spare_entries(pid_t *pid, int links)
{
    char p[4096];
    snprintf(p, sizeof p, "%s/vms", vt_data_dir);
    DIR *dir = opendir(p);
    REQUIRE(dir != NULL);
    int n = 0;
    struct dirent *de;
    while ((de = readdir(dir)) != NULL) {
        char own[32]; /* this process's driver's: others may be left by a crashed run */
        snprintf(own, sizeof own, "-%d", (int)getpid());
        size_t nl = strlen(de->d_name), ol = strlen(own);
        if (strncmp(de->d_name, ".pool-", 6) != 0 || nl < ol ||
            strcmp(de->d_name + nl - ol, own) != 0)
            continue;
        char full[4400];
        struct stat st;
        snprintf(full, sizeof full, "%s/%s", p, de->d_name);
        if (lstat(full, &st) < 0 || (links ? !S_ISLNK(st.st_mode) : !S_ISDIR(st.st_mode)))
            continue;
        n++;
        char id[300];
        snprintf(id, sizeof id, "%s", de->d_name);
        if (pid != NULL)
            *pid = vt_vm_pid(id);
    }
    closedir(dir);
    return n;
}

static int spare_dirs(pid_t *pid)
{
    return spare_entries(pid, 0);
}

static int wait_spares(sp_driver_t *d, int want, double timeout_ms)
{
    double end = vt_now_ms() + timeout_ms * vt_mult;
    while (sp_qemu_pool_ready(d) < want && vt_now_ms() < end)
        sp_loop_run_once(vt_loop, 20);
    return sp_qemu_pool_ready(d) >= want ? 0 : -1;
}

/* The QEMU pids of this driver's spares, at most max, into pids; how many. */
static int spare_pids(pid_t *pids, int max)
{
    char p[4096];
    snprintf(p, sizeof p, "%s/vms", vt_data_dir);
    DIR *dir = opendir(p);
    REQUIRE(dir != NULL);
    char own[32];
    snprintf(own, sizeof own, "-%d", (int)getpid());
    int n = 0;
    struct dirent *de;
    while ((de = readdir(dir)) != NULL && n < max) {
        size_t nl = strlen(de->d_name), ol = strlen(own);
        char full[4400];
        struct stat st;
        snprintf(full, sizeof full, "%s/%s", p, de->d_name);
        if (strncmp(de->d_name, ".pool-", 6) != 0 || nl < ol ||
            strcmp(de->d_name + nl - ol, own) != 0 || lstat(full, &st) < 0 || !S_ISDIR(st.st_mode))
            continue;
        pid_t x = vt_vm_pid(de->d_name);
        if (x > 0)
            pids[n++] = x;
    }
    closedir(dir);
    return n;
}

/* The adaptive pool: a burst of creates of a size makes it keep more than one spare of it (up
 * to pool_size), within its memory budget; two concurrent creates then each take a spare of
 * their own (distinct QEMUs, hostnames, ids), never the same one. */
static void burst_section(void)
{
    enum { BURST = 4, MAXP = 3 };
    sp_driver_t *d = vt_driver(0, MAXP);
    char ids[BURST + 2][64], buf[256];
    vt_res_t r[BURST + 2];
    memset(r, 0, sizeof r);
    for (int i = 0; i < BURST + 2; i++)
        snprintf(ids[i], sizeof ids[i], "clone-%d-b%d", (int)getpid(), i);
    sp_qemu_pool_stats_t st;
    REQUIRE(sp_qemu_pool_stats(d, &st) == 0 && st.ready == 0 && st.target == 0);
    /* BURST creates at once: one spare is wanted per create of the burst, up to MAXP */
    for (int i = 0; i < BURST; i++)
        start_boot(d, ids[i], 256, &r[i]);
    for (int i = 0; i < BURST; i++) {
        REQUIRE(vt_wait_for(&r[i].done, 240000) == 0);
        REQUIRE(r[i].ok);
    }
    REQUIRE(sp_qemu_pool_stats(d, &st) == 0);
    printf("after a burst of %d: spare target %d (pool_size %d)\n", BURST, st.target, MAXP);
    REQUIRE(st.target == MAXP);
    /* more than one spare of the size, then the pool done: as many ready as its target
     * (which decays, one per idle period: on a slow machine it may stop short of MAXP) */
    REQUIRE(wait_spares(d, 2, 300000) == 0);
    double until = vt_now_ms() + 120000 * vt_mult;
    while (sp_qemu_pool_stats(d, &st) == 0 && (st.warming > 0 || st.ready < st.target) &&
           vt_now_ms() < until)
        sp_loop_run_once(vt_loop, 20);
    vt_run_for(1000); /* no more come */
    REQUIRE(sp_qemu_pool_stats(d, &st) == 0);
    printf("spares after the burst: ready %d warming %d, %llu of %llu MiB\n", st.ready, st.warming,
           (unsigned long long)st.used_mb, (unsigned long long)st.budget_mb);
    REQUIRE(st.ready >= 2 && st.ready <= MAXP && st.warming == 0);
    REQUIRE(spare_dirs(NULL) == st.ready); /* never more than the target */
    REQUIRE(st.used_mb > 0 && st.used_mb <= st.budget_mb);

    /* the host short of memory (a reserve above what it has available): every spare goes,
     * none is made; the reserve lifted, the pool is made again */
    REQUIRE(sp_qemu_pool_reserve(d, 1ull << 40) == 0);
    until = vt_now_ms() + 30000 * vt_mult;
    while (sp_qemu_pool_stats(d, &st) == 0 && (st.ready + st.warming > 0 || spare_dirs(NULL) > 0) &&
           vt_now_ms() < until)
        sp_loop_run_once(vt_loop, 20);
    REQUIRE(sp_qemu_pool_stats(d, &st) == 0);
    printf("host memory short: spares ready %d warming %d, budget %llu MiB, target %d\n", st.ready,
           st.warming, (unsigned long long)st.budget_mb, st.target);
    REQUIRE(st.ready == 0 && st.warming == 0 && st.budget_mb == 0 && st.target == 0);
    REQUIRE(spare_dirs(NULL) == 0);
    vt_run_for(1500); /* none comes back while it is short */
    REQUIRE(sp_qemu_pool_stats(d, &st) == 0 && st.ready + st.warming == 0);
    REQUIRE(sp_qemu_pool_reserve(d, 0) == 0);
    REQUIRE(wait_spares(d, 2, 300000) == 0);
    until = vt_now_ms() + 120000 * vt_mult;
    while (sp_qemu_pool_stats(d, &st) == 0 && (st.warming > 0 || st.ready < st.target) &&
           vt_now_ms() < until)
        sp_loop_run_once(vt_loop, 20);
    REQUIRE(sp_qemu_pool_stats(d, &st) == 0 && st.ready >= 2 && st.warming == 0);
    printf("host memory back: %d spares again\n", st.ready);
    pid_t sp[8];
    int nsp = spare_pids(sp, 8);
    REQUIRE(nsp == st.ready);

    /* two concurrent creates: two different spares */
    int a = BURST, b = BURST + 1;
    start_boot(d, ids[a], 256, &r[a]);
    start_boot(d, ids[b], 256, &r[b]);
    REQUIRE(vt_wait_for(&r[a].done, 120000) == 0 && vt_wait_for(&r[b].done, 120000) == 0);
    REQUIRE(r[a].ok && r[b].ok);
    pid_t pa = vt_vm_pid(ids[a]), pb = vt_vm_pid(ids[b]);
    int from_spare = 0;
    for (int i = 0; i < nsp; i++)
        from_spare += (sp[i] == pa) + (sp[i] == pb);
    REQUIRE(pa > 0 && pb > 0 && pa != pb && from_spare == 2);
    run_cmd(d, ids[a], "hostname", buf, sizeof buf);
    REQUIRE(strcmp(buf, ids[a]) == 0);
    run_cmd(d, ids[b], "hostname", buf, sizeof buf);
    REQUIRE(strcmp(buf, ids[b]) == 0);
    printf("two concurrent creates took two spares: pids %d %d\n", (int)pa, (int)pb);

    for (int i = 0; i < BURST + 2; i++) {
        pid_t pi = vt_vm_pid(ids[i]);
        op(d, d->ops->destroy, ids[i]);
        check_gone(ids[i], pi);
    }
    sp_driver_destroy(d);
    vt_run_for(200);
    REQUIRE(spare_dirs(NULL) == 0);
    printf("adaptive pool: grew on a burst, within its budget, one spare per create\n");
}

/* Spare clones: a create after one is ready takes it (same QEMU process, renamed dir and
 * cgroup) with its own identity; it suspends, wakes, is re-adopted by a new driver, and
 * goes; spares never outlive their driver. */
static void pool_section(void)
{
    sp_driver_t *d = vt_driver(0, 1);
    char p1[64], p2[64], p3[64], buf[8192], r1[128], r2[128];
    snprintf(p1, sizeof p1, "clone-%d-p1", (int)getpid());
    snprintf(p2, sizeof p2, "clone-%d-p2", (int)getpid());
    snprintf(p3, sizeof p3, "clone-%d-p3", (int)getpid());
    REQUIRE(sp_qemu_pool_ready(d) == 0 && spare_dirs(NULL) == 0);
    boot(d, p1); /* the first create of the size: ordinary clone; spares from now on */
    REQUIRE(wait_spares(d, 1, 120000) == 0);
    pid_t spare = 0;
    REQUIRE(spare_dirs(&spare) == 1 && spare > 0);
    vt_run_for(300);
    REQUIRE(sp_qemu_pool_ready(d) == 1 && spare_dirs(NULL) == 1); /* pool_size 1: no more */

    double tb = boot(d, p2);
    REQUIRE(vt_vm_pid(p2) == spare);      /* the spare's QEMU, now under the sandbox's name */
    REQUIRE(spare_entries(NULL, 1) == 1); /* its old name, for QEMU's reopen of the disk */
    REQUIRE(d->ops->probe(d, p2) == SP_VM_RUNNING);
    static const char *const ctl[] = {"cpu", "memory", "pids"};
    for (size_t i = 0; i < 3; i++) {
        char dir[4096], procs[4200];
        if (sp_cgroup_vm_dir(cgl, ctl[i], p2, dir, sizeof dir) < 0)
            continue;
        snprintf(procs, sizeof procs, "%s/cgroup.procs", dir);
        FILE *f = fopen(procs, "r");
        REQUIRE(f != NULL);
        int found = 0, x;
        while (fscanf(f, "%d", &x) == 1)
            found |= x == (int)spare;
        fclose(f);
        REQUIRE(found);
    }
    const char *rnd = "head -c 32 /dev/urandom | od -An -tx1 | tr -d ' \\n'";
    run_cmd(d, p1, rnd, r1, sizeof r1);
    run_cmd(d, p2, rnd, r2, sizeof r2);
    REQUIRE(strlen(r1) == 64 && strlen(r2) == 64 && strcmp(r1, r2) != 0);
    run_cmd(d, p2, "hostname; echo $CLONE_TEST; date +%Y", buf, sizeof buf);
    char want[256];
    time_t now = time(NULL);
    struct tm tmv;
    gmtime_r(&now, &tmv);
    snprintf(want, sizeof want, "%s\n1\n%d", p2, tmv.tm_year + 1900);
    printf("taken spare: create to agent ready %.0f ms; hostname/env/year: %s\n", tb, buf);
    REQUIRE(strcmp(buf, want) == 0);
    vm_file(p2, "vm.json", buf, sizeof buf);
    REQUIRE(strstr(buf, "\"ram_src\"") != NULL); /* a clone like any other */
    REQUIRE(wait_spares(d, 1, 120000) == 0);     /* refilled */

    /* suspend and wake keep its files and processes */
    char bgpid[32], cmd[160];
    run_cmd(d, p2,
            "echo in-p2 > /root/p2; setsid sleep 100000 </dev/null >/dev/null 2>&1 & echo $!",
            bgpid, sizeof bgpid);
    REQUIRE(atoi(bgpid) > 0);
    op(d, d->ops->snapshot, p2);
    REQUIRE(d->ops->probe(d, p2) == SP_VM_SUSPENDED);
    REQUIRE(spare_entries(NULL, 1) == 0); /* that QEMU is gone: so is the link */
    restore(d, p2);
    snprintf(cmd, sizeof cmd, "cat /root/p2; kill -0 %s && echo alive; hostname", bgpid);
    run_cmd(d, p2, cmd, buf, sizeof buf);
    snprintf(want, sizeof want, "in-p2\nalive\n%s", p2);
    REQUIRE(strcmp(buf, want) == 0);

    /* a create while the next spare is still being made takes that one: take the ready
     * spare (p4), wait for the next one's QEMU to be up, create p3 */
    char p4[64];
    snprintf(p4, sizeof p4, "clone-%d-p4", (int)getpid());
    REQUIRE(wait_spares(d, 1, 120000) == 0);
    boot(d, p4);
    pid_t pid4 = vt_vm_pid(p4);
    pid_t next = 0;
    double until = vt_now_ms() + 30000 * vt_mult;
    while (vt_now_ms() < until) {
        next = 0;
        if (spare_dirs(&next) == 1 && next > 0 && next != pid4)
            break;
        sp_loop_run_once(vt_loop, 1);
    }
    REQUIRE(next > 0 && next != pid4);
    vt_run_for(30); /* QMP connects within a few ms of QEMU's start */
    int was_ready = sp_qemu_pool_ready(d);
    boot(d, p3);
    pid_t pid3 = vt_vm_pid(p3);
    printf("create while a spare was being made (ready=%d): took it: %s\n", was_ready,
           pid3 == next ? "yes" : "no");
    REQUIRE(pid3 == next);
    run_cmd(d, p3, "hostname; echo $CLONE_TEST", buf, sizeof buf);
    snprintf(want, sizeof want, "%s\n1", p3);
    REQUIRE(strcmp(buf, want) == 0);

    /* a new driver kills the old one's spares but re-adopts taken ones (their QEMU still
     * names the spare's directory) */
    REQUIRE(wait_spares(d, 1, 120000) == 0);
    pid_t left = 0;
    REQUIRE(spare_dirs(&left) == 1 && left > 0);
    sp_driver_destroy(d); /* its spares go with it */
    vt_run_for(200);
    REQUIRE(spare_dirs(NULL) == 0 && kill(left, 0) < 0);
    REQUIRE(kill(pid3, 0) == 0);
    d = vt_driver(0, 1);
    REQUIRE(d->ops->probe(d, p3) == SP_VM_RUNNING);
    run_cmd(d, p3, "hostname", buf, sizeof buf);
    REQUIRE(strcmp(buf, p3) == 0);
    REQUIRE(d->ops->probe(d, p4) == SP_VM_RUNNING);
    pid_t pid1 = vt_vm_pid(p1), pid2 = vt_vm_pid(p2);
    op(d, d->ops->destroy, p1);
    op(d, d->ops->destroy, p2);
    op(d, d->ops->destroy, p3);
    op(d, d->ops->destroy, p4);
    check_gone(p1, pid1);
    check_gone(p2, pid2);
    check_gone(p3, pid3);
    check_gone(p4, pid4);
    sp_driver_destroy(d);
    REQUIRE(spare_dirs(NULL) == 0 && spare_entries(NULL, 1) == 0);
    printf("spare clones: taken, identity, suspend/wake, re-adopted, none left\n");
}

int main(void)
{
    vt_init();
    sp_log_level_t lv;
    if (getenv("SP_TEST_LOG") != NULL && sp_log_parse_level(getenv("SP_TEST_LOG"), &lv) == 0)
        sp_log_min_level = lv;
    if (getenv("SPACE_COLD_BOOT") != NULL)
        unsetenv("SPACE_COLD_BOOT");
    cgl = sp_cgroup_create();
    REQUIRE(cgl != NULL);
    char a[64], b[64], c[64];
    snprintf(a, sizeof a, "clone-%d-a", (int)getpid());
    snprintf(b, sizeof b, "clone-%d-b", (int)getpid());
    sp_driver_t *d = vt_driver(0, -1);
    char sdir[4096], buf[8192];

    /* Concurrent first creates of a size with no snapshot yet (320 MiB: only this test uses
     * it, so removing its snapshot cannot break another sandbox) share one snapshot build. */
    {
        char x[64], y[64], sx[8192], sy[8192];
        tsnap_dir_ex(&vt_base, "-320M-1c-", sdir, sizeof sdir, 1);
        snprintf(x, sizeof x, "clone-%d-x", (int)getpid());
        snprintf(y, sizeof y, "clone-%d-y", (int)getpid());
        vt_res_t rx = {0}, ry = {0};
        double t0 = vt_now_ms();
        start_boot(d, x, 320, &rx);
        start_boot(d, y, 320, &ry);
        int builder_seen = builder_group_seen(); /* the build is under way while they wait */
        while ((!rx.done || !ry.done) && vt_now_ms() - t0 < 180000) {
            vt_run_for(50);
            if (builder_seen == 0)
                builder_seen = builder_group_seen();
        }
        REQUIRE(rx.done && ry.done);
        REQUIRE(builder_seen != 0); /* -1: no cgroups here, nothing to see */
        REQUIRE(rx.ok && ry.ok);
        printf("two concurrent first creates (one snapshot build): %.0f ms\n", vt_now_ms() - t0);
        tsnap_dir_ex(&vt_base, "-320M-1c-", sdir, sizeof sdir, 0); /* exactly one */
        vm_file(x, "vm.json", sx, sizeof sx);
        vm_file(y, "vm.json", sy, sizeof sy);
        REQUIRE(strstr(sx, sdir) != NULL && strstr(sy, sdir) != NULL); /* both are clones */
        run_cmd(d, x, "awk '/MemTotal/{print ($2 > 200000)}' /proc/meminfo", buf, sizeof buf);
        REQUIRE(strcmp(buf, "1") == 0);
        pid_t px = vt_vm_pid(x), py = vt_vm_pid(y);
        op(d, d->ops->destroy, y);
        check_gone(y, py);

        /* a damaged snapshot (device state changed) that clone x still uses is kept (x's
         * overlay has its disk as backing file): the next create cold-boots */
        char cmd[8400];
        snprintf(cmd, sizeof cmd,
                 "chmod u+w '%s/snapshot/devstate' && echo x >> "
                 "'%s/snapshot/devstate'",
                 sdir, sdir);
        REQUIRE(system(cmd) == 0);
        sp_driver_destroy(d);
        d = vt_driver(0, -1);
        boot_sized(d, y, 320);
        vm_file(y, "vm.json", sy, sizeof sy);
        REQUIRE(sy[0] != '\0' && strstr(sy, "ram_src") == NULL); /* cold */
        struct stat st;
        snprintf(cmd, sizeof cmd, "%s/snapshot/devstate", sdir);
        REQUIRE(stat(cmd, &st) == 0);
        run_cmd(d, x, "echo x-still-works", buf, sizeof buf);
        REQUIRE(strcmp(buf, "x-still-works") == 0);
        printf("damaged template snapshot in use: kept, next create cold-booted\n");
        py = vt_vm_pid(y);
        op(d, d->ops->destroy, x);
        op(d, d->ops->destroy, y);
        check_gone(x, px);
        check_gone(y, py);

        /* unused now: the next driver removes it at start, the next create rebuilds it */
        sp_driver_destroy(d);
        d = vt_driver(0, -1);
        REQUIRE(stat(sdir, &st) < 0 && errno == ENOENT);
        boot_sized(d, x, 320);
        char sdir2[4096];
        tsnap_dir_ex(&vt_base, "-320M-1c-", sdir2, sizeof sdir2, 0);
        vm_file(x, "vm.json", sx, sizeof sx);
        REQUIRE(strstr(sx, sdir2) != NULL);
        printf("damaged template snapshot unused: removed and rebuilt\n");
        px = vt_vm_pid(x);
        op(d, d->ops->destroy, x);
        check_gone(x, px);
        tsnap_dir_ex(&vt_base, "-320M-1c-", sdir, sizeof sdir, 1);

        /* removed behind the driver's back (as another process's collection would) and built
         * again at the same dir: its clones restore the new RAM, not the sealed copy of the old
         * (which made the guest crash, and the create fall back to a cold boot) */
        boot_sized(d, x, 320);
        tsnap_dir_ex(&vt_base, "-320M-1c-", sdir2, sizeof sdir2, 0);
        vm_file(x, "vm.json", sx, sizeof sx);
        REQUIRE(strstr(sx, sdir2) != NULL && strstr(sx, "ram_src") != NULL);
        run_cmd(d, x, "echo rebuilt-ram", buf, sizeof buf);
        REQUIRE(strcmp(buf, "rebuilt-ram") == 0);
        printf("template snapshot built again at the same dir: cloned from its new RAM\n");
        px = vt_vm_pid(x);
        op(d, d->ops->destroy, x);
        check_gone(x, px);
        tsnap_dir_ex(&vt_base, "-320M-1c-", sdir, sizeof sdir, 1);
    }

    double ta = boot(d, a);
    printf("first clone (builds the template snapshot unless there is one): %.0f ms\n", ta);
    ino_t ino = tsnap_dir(&vt_base, sdir, sizeof sdir);
    printf("template snapshot: %s\n", sdir);
    double tb = boot(d, b);
    printf("second clone: %.0f ms\n", tb);
    REQUIRE(tsnap_dir(&vt_base, sdir, sizeof sdir) == ino); /* reused, not rebuilt */
    vm_file(a, "vm.json", buf, sizeof buf);
    REQUIRE(strstr(buf, "\"ram_src\"") != NULL && strstr(buf, sdir) != NULL);
    vm_file(b, "vm.json", buf, sizeof buf);
    REQUIRE(strstr(buf, "\"ram_src\"") != NULL);

    /* identity: own hostname, own random numbers, same template boot */
    char ha[128], hb[128], ra[128], rb[128], ba[128], bb[128], ea[64];
    const char *rnd = "head -c 32 /dev/urandom | od -An -tx1 | tr -d ' \\n'";
    run_cmd(d, a, rnd, ra, sizeof ra);
    run_cmd(d, b, rnd, rb, sizeof rb);
    run_cmd(d, a, "hostname", ha, sizeof ha);
    run_cmd(d, b, "hostname", hb, sizeof hb);
    run_cmd(d, a, "cat /proc/sys/kernel/random/boot_id", ba, sizeof ba);
    run_cmd(d, b, "cat /proc/sys/kernel/random/boot_id", bb, sizeof bb);
    run_cmd(d, a, "echo $CLONE_TEST", ea, sizeof ea);
    printf("urandom a=%s\nurandom b=%s\nhostnames %s / %s, boot_id %s / %s, env=%s\n", ra, rb, ha,
           hb, ba, bb, ea);
    REQUIRE(strlen(ra) == 64 && strlen(rb) == 64 && strcmp(ra, rb) != 0);
    REQUIRE(strcmp(ha, a) == 0 && strcmp(hb, b) == 0);
    REQUIRE(strcmp(ea, "1") == 0);

    /* disks are private */
    run_cmd(d, a, "echo only-a > /root/only-a; sync; cat /root/only-a", buf, sizeof buf);
    REQUIRE(strcmp(buf, "only-a") == 0);
    run_cmd(d, b, "test -e /root/only-a && echo yes || echo no", buf, sizeof buf);
    REQUIRE(strcmp(buf, "no") == 0);

    /* suspend a clone: its RAM pages that differ from the template's go into the device
     * state; the wake maps the template's RAM again and loads them over it */
    char bgpid[32];
    run_cmd(d, a, "setsid sleep 100000 </dev/null >/dev/null 2>&1 & echo $!", bgpid, sizeof bgpid);
    REQUIRE(atoi(bgpid) > 0);
    /* 8 MB of fresh pages (and the guest's page cache dropped: pages the template holds
     * become free and are reused) must come back exactly */
    run_cmd(d, a,
            "head -c 8000000 /dev/urandom > /root/big; md5sum < /root/big | cut -c1-32; "
            "echo 3 > /proc/sys/vm/drop_caches",
            buf, sizeof buf);
    char big_md5[64];
    snprintf(big_md5, sizeof big_md5, "%.32s", buf);
    REQUIRE(strlen(big_md5) == 32);
    double t0 = vt_now_ms();
    op(d, d->ops->snapshot, a);
    double susp1 = vt_now_ms() - t0;
    REQUIRE(d->ops->probe(d, a) == SP_VM_SUSPENDED);
    vm_file(a, "snapshot/manifest.json", buf, sizeof buf);
    REQUIRE(strstr(buf, "\"ram\":\"delta\"") != NULL && strstr(buf, sdir) != NULL);
    struct stat dst;
    char dpath[4200];
    snprintf(dpath, sizeof dpath, "%s/vms/%s/snapshot/devstate", vt_data_dir, a);
    REQUIRE(stat(dpath, &dst) == 0);
    long long dev1 = (long long)dst.st_size;
    double wake1 = restore(d, a);
    vm_file(a, "vm.json", buf, sizeof buf);
    REQUIRE(strstr(buf, "ram_src") != NULL); /* still a clone of the template's RAM */
    char cmd[160];
    snprintf(cmd, sizeof cmd, "cat /root/only-a; kill -0 %s && echo alive; md5sum < /root/big",
             bgpid);
    char want[256];
    snprintf(want, sizeof want, "only-a\nalive\n%s  -", big_md5);
    run_cmd(d, a, cmd, buf, sizeof buf);
    REQUIRE(strcmp(buf, want) == 0);
    /* and again: each suspend writes the delta */
    t0 = vt_now_ms();
    op(d, d->ops->snapshot, a);
    double susp2 = vt_now_ms() - t0;
    vm_file(a, "snapshot/manifest.json", buf, sizeof buf);
    REQUIRE(strstr(buf, "\"ram\":\"delta\"") != NULL);
    double wake2 = restore(d, a);
    run_cmd(d, a, cmd, buf, sizeof buf);
    REQUIRE(strcmp(buf, want) == 0);
    printf("clone suspend (RAM delta, device state %lld bytes) %.0f ms, wake %.0f ms; then "
           "suspend %.0f ms, wake %.0f ms\n",
           dev1, susp1, wake1, susp2, wake2);
    /* the whole RAM would be more than the 8 MB written plus what the guest had: the delta
     * holds what changed, not the template's pages */
    run_cmd(d, a,
            "awk '/^(MemTotal|MemFree):/{v[$1]=$2} END{print "
            "(v[\"MemTotal:\"]-v[\"MemFree:\"])*1024}' /proc/meminfo",
            buf, sizeof buf);
    printf("guest memory in use %s bytes, delta %lld bytes\n", buf, dev1);
    REQUIRE(dev1 < atoll(buf));

    /* the filter cannot read the template's RAM: the suspend migrates the whole RAM instead
     * ("stream"), the wake loads it into the sandbox's own RAM file, later suspends write
     * device state only */
    char tram[4200], tram2[4300];
    snprintf(tram, sizeof tram, "%s/mem.ram", sdir);
    snprintf(tram2, sizeof tram2, "%s/mem.ram.away", sdir);
    REQUIRE(rename(tram, tram2) == 0);
    op(d, d->ops->snapshot, a);
    REQUIRE(rename(tram2, tram) == 0);
    vm_file(a, "snapshot/manifest.json", buf, sizeof buf);
    REQUIRE(strstr(buf, "\"ram\":\"stream\"") != NULL);
    restore(d, a);
    vm_file(a, "vm.json", buf, sizeof buf);
    REQUIRE(strstr(buf, "ram_src") == NULL);
    run_cmd(d, a, cmd, buf, sizeof buf);
    REQUIRE(strcmp(buf, want) == 0);
    op(d, d->ops->snapshot, a);
    vm_file(a, "snapshot/manifest.json", buf, sizeof buf);
    REQUIRE(strstr(buf, "\"ram\":\"mem.ram\"") != NULL);
    restore(d, a);
    run_cmd(d, a, cmd, buf, sizeof buf);
    REQUIRE(strcmp(buf, want) == 0);
    printf("delta refused: whole RAM streamed, then the sandbox's own RAM file\n");

    /* a driver restart re-adopts a running clone */
    pid_t pb = vt_vm_pid(b);
    sp_driver_destroy(d);
    vt_run_for(100);
    REQUIRE(kill(pb, 0) == 0);
    d = vt_driver(0, -1);
    REQUIRE(d->ops->probe(d, b) == SP_VM_RUNNING);
    run_cmd(d, b, "hostname", buf, sizeof buf);
    REQUIRE(strcmp(buf, b) == 0);
    /* and it still suspends the clone way after re-adoption */
    op(d, d->ops->snapshot, b);
    vm_file(b, "snapshot/manifest.json", buf, sizeof buf);
    REQUIRE(strstr(buf, "\"ram\":\"delta\"") != NULL);
    restore(d, b);
    run_cmd(d, b, "test -e /root/only-a && echo yes || echo no", buf, sizeof buf);
    REQUIRE(strcmp(buf, "no") == 0);

    pid_t pa = vt_vm_pid(a);
    pb = vt_vm_pid(b);
    op(d, d->ops->destroy, a);
    op(d, d->ops->destroy, b);
    check_gone(a, pa);
    check_gone(b, pb);
    REQUIRE(tsnap_dir(&vt_base, sdir, sizeof sdir) == ino); /* the template snapshot stays */

    /* later creates reuse it: create-to-agent-ready, median of 5 */
    double t[5];
    for (int i = 0; i < 5; i++) {
        snprintf(c, sizeof c, "clone-%d-c%d", (int)getpid(), i);
        t[i] = boot(d, c);
        run_cmd(d, c, "echo hi", buf, sizeof buf);
        REQUIRE(strcmp(buf, "hi") == 0);
        pid_t pc = vt_vm_pid(c);
        op(d, d->ops->destroy, c);
        check_gone(c, pc);
    }
    REQUIRE(tsnap_dir(&vt_base, sdir, sizeof sdir) == ino);
    qsort(t, 5, sizeof t[0], cmp_d);
    printf("clone create to agent ready: median %.0f ms (%.0f-%.0f)\n", t[2], t[0], t[4]);
    d = warmup_and_gc(d, &vt_base);
    REQUIRE(tsnap_dir(&vt_base, sdir, sizeof sdir) == ino); /* base's snapshot was never touched */
    sp_driver_destroy(d);

    /* A driver that goes at once after it started (jailed, it then seals every current
     * snapshot's RAM off the loop): a copy in flight is let go, and its done callback, which
     * comes after the driver is gone, only frees it (ASan: no use after free, no leak). */
    sp_driver_destroy(vt_driver(0, -1));
    vt_run_for(1000);
    printf("driver destroyed while sealing template RAM: ok\n");

    pool_section();
    burst_section();

    /* cold_boot: no snapshot, no ram_src */
    d = vt_driver(1, -1);
    snprintf(c, sizeof c, "clone-%d-cold", (int)getpid());
    double tc = boot(d, c);
    vm_file(c, "vm.json", buf, sizeof buf);
    REQUIRE(buf[0] != '\0' && strstr(buf, "ram_src") == NULL);
    printf("cold boot to agent ready (cold_boot=1): %.0f ms\n", tc);
    pid_t pc = vt_vm_pid(c);
    op(d, d->ops->destroy, c);
    check_gone(c, pc);
    sp_driver_destroy(d);

    sp_loop_destroy(vt_loop);
    sp_cgroup_destroy(cgl);
    printf("clones e2e: ok\n");
    return 0;
}
