/*
 * test_forks.c - sandbox snapshots through the QEMU driver (driver.h: checkpoint): real
 * microVMs on a loop.
 *
 * Needs what test_qemu_driver.c needs (SP_TEST_DATA_DIR with a built `base`); skips (77)
 * without it. A sandbox cloned from the template snapshot runs a shell counting in memory and
 * has a file on its disk. Its snapshot is taken while it runs (it goes on, answering
 * commands), and two sandboxes are booted from the snapshot: each has the file as it was
 * at the snapshot (not as the source changed it after), the counter going on from the
 * snapshot's count in each independently, its own hostname, and different /dev/urandom bytes.
 * A fork suspends and wakes like any sandbox. A snapshot of a fork is taken and booted
 * from (a chain). Deleted snapshots are refused for new boots at once but their files stay
 * while a fork or a snapshot of a fork needs them, and go when the last one does. A paused
 * sandbox stays paused through its snapshot. A cold-booted sandbox (RAM of its own: the whole
 * RAM goes into the snapshot) forks too. Bad ids and missing VMs are refused at once.
 * Prints the vCPU pause window and the times to take a snapshot and to boot from one.
 */
#include <dirent.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include <jansson.h>

#include "core/runtime/driver.h"
#include "core/runtime/qemu.h"
#include "e2e/vmtest.h"
#include "loop/loop.h"
#include "tests/check.h"

/* Boots sandbox id of `base` with memory_mb (from snapshot snap when not NULL): ms to agent
 * ready. */
static double boot_sized(sp_driver_t *d, const char *id, const char *snap, int memory_mb)
{
    sp_vm_spec_t spec = {.sandbox_id = id,
                         .template_name = "base",
                         .cpu_count = 1,
                         .memory_mb = memory_mb,
                         .hostname = id,
                         .env_json = "{\"FORK\":\"1\"}",
                         .snapshot_id = snap};
    return vt_boot(d, &spec, 120000);
}

static double boot_spec(sp_driver_t *d, const char *id, const char *snap)
{
    return boot_sized(d, id, snap, 256);
}

static void destroy(sp_driver_t *d, const char *id)
{
    vt_op(d, d->ops->destroy, id, 20000);
}

static double checkpoint(sp_driver_t *d, const char *id, const char *snap)
{
    vt_res_t r = {0};
    sp_err_t e;
    double t0 = vt_now_ms();
    if (d->ops->checkpoint(d, id, snap, 0, vt_on_res, &r, &e) < 0) {
        fprintf(stderr, "checkpoint %s: %s\n", id, e.msg);
        exit(1);
    }
    REQUIRE(r.done == 0);
    vt_wait_ok(&r, "checkpoint", id, 60000);
    return vt_now_ms() - t0;
}

static void cmd(sp_driver_t *d, const char *id, const char *c, char *out, size_t n)
{
    vt_run_cmd(d, id, c, out, n, 20000);
}

/* The counter's value. The loop's `echo $i > /run/count` truncates before it writes, so a read
 * (or a snapshot) can land in between and see an empty file: read until it holds a number. */
#define READ_COUNT                                                                                 \
    "for k in $(seq 1 100); do v=$(cat /run/count 2>/dev/null); [ -n \"$v\" ] && break; "          \
    "sleep 0.05; done; echo \"$v\""

static long counter(sp_driver_t *d, const char *id)
{
    char out[64];
    cmd(d, id, READ_COUNT, out, sizeof out);
    return atol(out);
}

/* Whether a spare restored from snapshot snap is up (its dir's vm.json names the snapshot
 * and its restore is through: the snapshot/ it was loaded from is gone). */
static bool fork_spare_up(const char *snap)
{
    char p[1024];
    snprintf(p, sizeof p, "%s/vms", vt_data_dir);
    DIR *dir = opendir(p);
    struct dirent *de;
    bool up = false;
    while (!up && dir != NULL && (de = readdir(dir)) != NULL) {
        if (strncmp(de->d_name, ".pool-", 6) != 0)
            continue;
        char vj[1400], sd[1400];
        snprintf(vj, sizeof vj, "%s/%s/vm.json", p, de->d_name);
        snprintf(sd, sizeof sd, "%s/%s/snapshot", p, de->d_name);
        json_t *o = json_load_file(vj, 0, NULL);
        const char *s = json_string_value(json_object_get(o, "snapshot"));
        up = s != NULL && strcmp(s, snap) == 0 && access(sd, F_OK) != 0;
        json_decref(o);
    }
    if (dir != NULL)
        closedir(dir);
    return up;
}

static bool snap_dir_exists(const char *snap)
{
    char p[1024];
    snprintf(p, sizeof p, "%s/snapshots/%s", vt_data_dir, snap);
    return access(p, F_OK) == 0;
}

static long pause_ms(const char *snap)
{
    char p[1024];
    snprintf(p, sizeof p, "%s/snapshots/%s/vm.json", vt_data_dir, snap);
    json_t *o = json_load_file(p, 0, NULL);
    REQUIRE(o != NULL);
    long v = (long)json_integer_value(json_object_get(o, "pause_ms"));
    json_decref(o);
    return v;
}

/* What an earlier run that failed half-way left on the shared data dir: its VMs and
 * snapshots (each run names them by its pid). */
static void clean_leftovers(sp_driver_t *d)
{
    const char *kinds[2] = {"vms", "snapshots"};
    for (int k = 0; k < 2; k++) {
        char p[1024];
        snprintf(p, sizeof p, "%s/%s", vt_data_dir, kinds[k]);
        DIR *dir = opendir(p);
        struct dirent *de;
        while (dir != NULL && (de = readdir(dir)) != NULL) {
            sp_err_t e;
            if (k == 0 && strncmp(de->d_name, "fk-", 3) == 0)
                vt_op(d, d->ops->destroy, de->d_name, 20000);
            else if (k == 1 && strncmp(de->d_name, "snap-", 5) == 0)
                d->ops->checkpoint_delete(d, de->d_name, &e);
        }
        if (dir != NULL)
            closedir(dir);
    }
}

/* A counter that lives only in the shell's memory; /run/count (tmpfs) shows it. */
#define COUNTER                                                                                    \
    "nohup sh -c 'echo $$ > /run/count.pid; i=0; while :; do i=$((i+1)); echo $i > /run/count; "   \
    "sleep 0.1; done' "                                                                            \
    ">/dev/null 2>&1 & sleep 0.5; echo started"

struct seen {
    const char *id;
    int n;
    long long t;
};

static void on_listed(const char *id, long long committed_s, void *arg)
{
    struct seen *s = arg;
    if (strcmp(id, s->id) == 0) {
        s->n++;
        s->t = committed_s;
    }
}

/* How many times checkpoint_list with prefix names id (0 or 1), checking its commit time. */
static int listed(sp_driver_t *d, const char *prefix, const char *id)
{
    struct seen s = {.id = id};
    sp_err_t e;
    REQUIRE(d->ops->checkpoint_list(d, prefix, on_listed, &s, &e) == 0);
    long long now = (long long)time(NULL);
    REQUIRE(s.n == 0 || (s.t > now - 3600 && s.t <= now + 1));
    return s.n;
}

int main(void)
{
    vt_init();
    sp_err_t e;
    char src[64], f1[64], f2[64], f3[64], snap_a[64], snap_b[64], snap_p[64], out[256], o2[256];
    int pid = (int)getpid();
    snprintf(src, sizeof src, "fk-src-%d", pid);
    snprintf(f1, sizeof f1, "fk-1-%d", pid);
    snprintf(f2, sizeof f2, "fk-2-%d", pid);
    snprintf(f3, sizeof f3, "fk-3-%d", pid);
    snprintf(snap_a, sizeof snap_a, "snap-a-%d", pid);
    snprintf(snap_b, sizeof snap_b, "snap-b-%d", pid);
    snprintf(snap_p, sizeof snap_p, "snap-p-%d", pid);

    sp_driver_t *d = vt_driver(0, -1);
    REQUIRE(d->ops->checkpoint != NULL && d->ops->checkpoint_delete != NULL);
    const char *take = getenv("SP_FORK_TAKE");
    if (take != NULL) { /* SP_FORK_TAKE=<sandbox>: snapshot a running VM as snap_b (debugging) */
        checkpoint(d, take, snap_b);
        printf("took %s of %s\n", snap_b, take);
        sp_driver_destroy(d);
        return 0;
    }
    const char *from = getenv("SP_FORK_FROM");
    if (from != NULL) { /* SP_FORK_FROM=<snapshot>: boot one fork of it (debugging) */
        vt_res_t r = {0};
        sp_vm_spec_t spec = {
            .sandbox_id = f1, .template_name = "base", .hostname = f1, .snapshot_id = from};
        REQUIRE(d->ops->boot(d, &spec, vt_on_res, &r, &e) == 0);
        REQUIRE(vt_wait_for(&r.done, 120000) == 0);
        printf("fork of %s: %s\n", from, r.ok ? "up" : r.err.msg);
        if (r.ok) {
            cmd(d, f1, "cat /run/count", out, sizeof out);
            printf("count %s\n", out);
        }
        destroy(d, f1);
        sp_driver_destroy(d);
        return r.ok ? 0 : 1;
    }
    clean_leftovers(d);
    const char *stress = getenv("SP_FORK_STRESS");
    if (stress != NULL && atoi(stress) > 0) {
        /* SP_FORK_STRESS=N: N snapshots of a sandbox writing memory hard, one fork of each
         * checked alive (for chasing memory consistency; not part of the suite) */
        boot_spec(d, src, NULL);
        cmd(d, src,
            "nohup python3 -c 'b = bytearray(64 << 20)\ni = 0\nwhile True:\n"
            "    b[(i * 4099) % len(b)] = i & 255\n    i += 1' >/dev/null 2>&1 & echo ok",
            out, sizeof out);
        cmd(d, src, COUNTER, out, sizeof out);
        for (int i = 0; i < atoi(stress); i++) {
            checkpoint(d, src, snap_a);
            boot_spec(d, f1, snap_a);
            cmd(d, f1, "cat /run/count; uptime", out, sizeof out);
            printf("round %d: pause %ld ms, fork says %s\n", i, pause_ms(snap_a), out);
            long c1 = counter(d, f1);
            vt_run_for(300);
            REQUIRE(counter(d, f1) > c1);
            destroy(d, f1);
            REQUIRE(d->ops->checkpoint_delete(d, snap_a, &e) == 0);
        }
        destroy(d, src);
        sp_driver_destroy(d);
        return 0;
    }
    /* refused at once: no VM, bad ids, an unknown snapshot */
    REQUIRE(d->ops->checkpoint(d, src, snap_a, 0, vt_on_res, NULL, &e) < 0 &&
            e.code == SP_ENOTFOUND);
    REQUIRE(d->ops->checkpoint(d, src, "../x", 0, vt_on_res, NULL, &e) < 0 && e.code == SP_EINVAL);
    REQUIRE(d->ops->checkpoint(d, src, ".tmp", 0, vt_on_res, NULL, &e) < 0 && e.code == SP_EINVAL);
    REQUIRE(d->ops->checkpoint_exists(d, snap_a) == 0);
    REQUIRE(d->ops->checkpoint_delete(d, snap_a, &e) == 0); /* missing: fine */
    sp_vm_spec_t bad = {.sandbox_id = f1, .template_name = "base", .snapshot_id = snap_a};
    REQUIRE(d->ops->boot(d, &bad, vt_on_res, NULL, &e) < 0 && e.code == SP_ENOTFOUND);

    /* the source: a clone of the template snapshot, a counter in memory, a file on disk */
    boot_spec(d, src, NULL);
    cmd(d, src, COUNTER, out, sizeof out);
    cmd(d, src, "echo before > /root/f", out, sizeof out);
    vt_res_t ra = {0};
    REQUIRE(d->ops->checkpoint(d, src, snap_a, 0, vt_on_res, &ra, &e) == 0);
    /* while it runs, a second one, a pause and a suspend are refused */
    vt_res_t busy = {0};
    REQUIRE(d->ops->checkpoint(d, src, snap_b, 0, vt_on_res, &busy, &e) < 0 &&
            e.code == SP_ECONFLICT);
    REQUIRE(d->ops->pause(d, src, vt_on_res, &busy, &e) < 0 && e.code == SP_ECONFLICT);
    REQUIRE(d->ops->snapshot(d, src, vt_on_res, &busy, &e) < 0 && e.code == SP_ECONFLICT);
    REQUIRE(vt_wait_for(&ra.done, 60000) == 0 && ra.ok && busy.done == 0);
    REQUIRE(d->ops->checkpoint_exists(d, snap_a) == 1);
    REQUIRE(d->ops->checkpoint(d, src, snap_a, 0, vt_on_res, NULL, &e) < 0 &&
            e.code == SP_ECONFLICT); /* exists */
    long at_snap_min = counter(d, src);
    REQUIRE(at_snap_min > 0);
    /* the source goes on and changes its file after the snapshot */
    cmd(d, src, "echo after > /root/f; cat /root/f", out, sizeof out);
    REQUIRE(strcmp(out, "after") == 0);
    REQUIRE(d->ops->probe(d, src) == SP_VM_RUNNING);

    /* a timed snapshot of the running source */
    double take_ms = checkpoint(d, src, snap_p);
    printf("snapshot of a running 256 MiB sandbox: %.0f ms total, vCPUs stopped %ld ms\n", take_ms,
           pause_ms(snap_p));
    REQUIRE(d->ops->checkpoint_delete(d, snap_p, &e) == 0);
    REQUIRE(!snap_dir_exists(snap_p)); /* nothing was made from it */

    /* two forks of snap_a */
    double b1 = boot_spec(d, f1, snap_a);
    double b2 = boot_spec(d, f2, snap_a);
    printf("boot from the snapshot to agent ready: %.0f ms, %.0f ms\n", b1, b2);
    const char *forks[2] = {f1, f2};
    char rnd[2][64];
    for (int i = 0; i < 2; i++) {
        cmd(d, forks[i], "cat /root/f", out, sizeof out);
        REQUIRE(strcmp(out, "before") == 0);
        cmd(d, forks[i], "hostname; echo $FORK", out, sizeof out);
        REQUIRE(strncmp(out, forks[i], strlen(forks[i])) == 0);
        cmd(d, forks[i], "head -c 16 /dev/urandom | od -An -tx1 | tr -d ' \\n'", rnd[i],
            sizeof rnd[i]);
        long c1 = counter(d, forks[i]);
        vt_run_for(600);
        long c2 = counter(d, forks[i]);
        printf("%s: counter %ld then %ld (source had passed %ld before the snapshot)\n", forks[i],
               c1, c2, at_snap_min);
        REQUIRE(c1 >= 1 && c2 > c1); /* the process came with the memory and runs */
    }
    REQUIRE(strcmp(rnd[0], rnd[1]) != 0);
    /* independent: stop the counter in one, the other goes on */
    cmd(d, f1, "kill $(cat /run/count.pid); sleep 0.3; cat /run/count", out, sizeof out);
    long stopped = atol(out);
    vt_run_for(500);
    REQUIRE(counter(d, f1) == stopped);
    long before2 = counter(d, f2);
    vt_run_for(500);
    REQUIRE(counter(d, f2) > before2);

    /* a fork suspends and wakes like any sandbox */
    vt_op(d, d->ops->snapshot, f2, 60000);
    REQUIRE(d->ops->probe(d, f2) == SP_VM_SUSPENDED);
    sp_vm_spec_t w = {.sandbox_id = f2, .template_name = "base", .hostname = f2};
    vt_res_t rw = {0};
    REQUIRE(d->ops->restore(d, &w, vt_on_res, &rw, &e) == 0);
    REQUIRE(vt_wait_for(&rw.done, 120000) == 0 && rw.ok);
    long woke = counter(d, f2);
    vt_run_for(500);
    REQUIRE(counter(d, f2) > woke);
    cmd(d, f2, "cat /root/f", out, sizeof out);
    REQUIRE(strcmp(out, "before") == 0);

    /* a snapshot of a fork, and a fork of that */
    cmd(d, f1, "echo gen2 > /root/g", out, sizeof out);
    checkpoint(d, f1, snap_b);
    boot_spec(d, f3, snap_b);
    cmd(d, f3, "cat /root/f /root/g", out, sizeof out);
    REQUIRE(strcmp(out, "before\ngen2") == 0);
    /* listed by prefix: committed ones only, not another prefix's */
    REQUIRE(listed(d, "snap-", snap_a) == 1 && listed(d, "snap-", snap_b) == 1);
    REQUIRE(listed(d, "snap-b-", snap_a) == 0 && listed(d, "fk-", snap_b) == 0);

    /* deletes: refused for new boots at once, files kept while used */
    REQUIRE(d->ops->checkpoint_delete(d, snap_a, &e) == 0);
    REQUIRE(d->ops->checkpoint_exists(d, snap_a) == 0);
    REQUIRE(listed(d, "snap-", snap_a) == 0 && listed(d, "snap-", snap_b) == 1); /* deleted */
    char lid[64];
    snprintf(lid, sizeof lid, "fk-late-%d", pid);
    sp_vm_spec_t late = {.sandbox_id = lid, .template_name = "base", .snapshot_id = snap_a};
    REQUIRE(d->ops->boot(d, &late, vt_on_res, NULL, &e) < 0 && e.code == SP_ENOTFOUND);
    REQUIRE(snap_dir_exists(snap_a));
    destroy(d, f1);
    destroy(d, f2);
    REQUIRE(snap_dir_exists(snap_a)); /* snap_b's disk and f3 still back onto it */
    REQUIRE(d->ops->checkpoint_delete(d, snap_b, &e) == 0);
    REQUIRE(snap_dir_exists(snap_a) && snap_dir_exists(snap_b)); /* f3 */
    cmd(d, f3, "cat /root/g", out, sizeof out); /* and it still reads through both */
    REQUIRE(strcmp(out, "gen2") == 0);
    destroy(d, f3);
    REQUIRE(!snap_dir_exists(snap_b) && !snap_dir_exists(snap_a));

    /* a paused source stays paused through its snapshot, and resumes */
    vt_op(d, d->ops->pause, src, 10000);
    checkpoint(d, src, snap_p);
    REQUIRE(d->ops->probe(d, src) == SP_VM_PAUSED);
    vt_op(d, d->ops->resume, src, 10000);
    cmd(d, src, "cat /root/f", out, sizeof out);
    REQUIRE(strcmp(out, "after") == 0);
    boot_spec(d, f1, snap_p);
    cmd(d, f1, "cat /root/f", out, sizeof out);
    REQUIRE(strcmp(out, "after") == 0);
    destroy(d, f1);
    REQUIRE(d->ops->checkpoint_delete(d, snap_p, &e) == 0);
    REQUIRE(!snap_dir_exists(snap_p));
    destroy(d, src);

    /* a cold-booted sandbox: RAM of its own, all of it in the snapshot */
    sp_driver_destroy(d);
    d = vt_driver(1, -1);
    boot_spec(d, src, NULL);
    cmd(d, src, COUNTER, out, sizeof out);
    cmd(d, src, "echo cold > /root/f", out, sizeof out);
    checkpoint(d, src, snap_a);
    char m[1024];
    snprintf(m, sizeof m, "%s/snapshots/%s/snapshot/manifest.json", vt_data_dir, snap_a);
    json_t *man = json_load_file(m, 0, NULL);
    REQUIRE(man != NULL);
    printf("cold source: snapshot ram=%s\n", json_string_value(json_object_get(man, "ram")));
    REQUIRE(strcmp(json_string_value(json_object_get(man, "ram")), "stream") == 0);
    json_decref(man);
    boot_spec(d, f1, snap_a);
    cmd(d, f1, "cat /root/f", o2, sizeof o2);
    REQUIRE(strcmp(o2, "cold") == 0);
    long c1 = counter(d, f1);
    vt_run_for(500);
    REQUIRE(counter(d, f1) > c1);
    destroy(d, f1);
    destroy(d, src);
    REQUIRE(d->ops->checkpoint_delete(d, snap_a, &e) == 0);
    REQUIRE(!snap_dir_exists(snap_a));
    sp_driver_destroy(d);

    /* with spares: a create from a snapshot makes the pool keep a spare restored from it, and
     * the next create takes that spare, as creates of a template size do */
    d = vt_driver(0, 1);
    boot_spec(d, src, NULL);
    cmd(d, src, COUNTER, out, sizeof out);
    cmd(d, src, "echo pooled > /root/f", out, sizeof out);
    checkpoint(d, src, snap_a);
    destroy(d, src);
    double r1 = boot_spec(d, f1, snap_a);
    double end = vt_now_ms() + 120000;
    while (!fork_spare_up(snap_a) && vt_now_ms() < end)
        vt_run_for(200);
    REQUIRE(fork_spare_up(snap_a));
    double r2 = boot_spec(d, f2, snap_a);
    printf("boot from the snapshot: restore %.0f ms, from its spare %.0f ms\n", r1, r2);
    char origin[1024];
    snprintf(origin, sizeof origin, "%s/vms/%s/pool.origin", vt_data_dir, f2);
    REQUIRE(access(origin, F_OK) == 0); /* f2's QEMU is the spare's */
    for (int i = 0; i < 2; i++) {
        const char *f = i == 0 ? f1 : f2;
        cmd(d, f, "cat /root/f; hostname; echo $FORK", out, sizeof out);
        char want[256];
        snprintf(want, sizeof want, "pooled\n%s\n1", f);
        REQUIRE(strcmp(out, want) == 0);
        cmd(d, f, "head -c 16 /dev/urandom | od -An -tx1 | tr -d ' \\n'", rnd[i], sizeof rnd[i]);
        long c = counter(d, f);
        vt_run_for(500);
        REQUIRE(c >= 1 && counter(d, f) > c);
    }
    REQUIRE(strcmp(rnd[0], rnd[1]) != 0);
    /* deleted: its spares go with it, and so do its files once the forks are gone */
    REQUIRE(d->ops->checkpoint_delete(d, snap_a, &e) == 0);
    destroy(d, f1);
    destroy(d, f2);
    end = vt_now_ms() + 30000;
    while (snap_dir_exists(snap_a) && vt_now_ms() < end)
        vt_run_for(200);
    REQUIRE(!snap_dir_exists(snap_a));
    sp_driver_destroy(d);

    /* a template snapshot seed (qemu.h: sp_qemu_template_snapshot_from) whose restore fails:
     * the snapshot is built from a cold boot all the same, for a size nothing else uses */
    d = vt_driver(1, -1);
    boot_sized(d, src, NULL, 288);
    checkpoint(d, src, snap_b); /* a cold source: its whole RAM in the stream */
    destroy(d, src);
    sp_driver_destroy(d);
    snprintf(m, sizeof m, "%s/snapshots/%s/snapshot/devstate", vt_data_dir, snap_b);
    REQUIRE(truncate(m, 4096) == 0);
    d = vt_driver(0, -1);
    sp_qemu_tsnap_info_t info;
    vt_res_t tr = {0};
    REQUIRE(sp_qemu_template_snapshot_from(d, "base", 1, 288, snap_b, &info, vt_on_res, &tr, &e) ==
            0);
    vt_wait_ok(&tr, "template snapshot from a broken seed", "base", 240000);
    printf("template snapshot from a seed that does not restore: built=%d seeded=%d\n", info.built,
           info.seeded);
    REQUIRE(info.built == 1 && info.seeded == 0 && info.dir[0] == '/');
    REQUIRE(d->ops->checkpoint_delete(d, snap_b, &e) == 0);
    sp_driver_destroy(d);
    char rm[sizeof info.dir + 16];
    snprintf(rm, sizeof rm, "rm -rf '%s'", info.dir); /* the next run builds it again */
    REQUIRE(system(rm) == 0);
    printf("forks: ok\n");
    return 0;
}
