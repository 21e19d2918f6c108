/*
 * test_qemu_driver.c - the QEMU driver end to end: real microVMs on a loop.
 *
 * Needs qemu-system-x86_64, qemu-img and a data directory with a built
 * `base` template (guest/tmplbuild.h), named by SP_TEST_DATA_DIR. Skips
 * (77) saying why when any is missing. SP_TEST_ACCEL picks auto|kvm|tcg
 * (default auto); SP_TEST_TIMEOUT_MULT stretches the timeouts.
 *
 * Boots a VM, runs `uname -r` over the agent channel, pauses and resumes,
 * restarts the driver (VM keeps running) and checks it is re-adopted,
 * suspends and restores it across another driver restart (same guest boot
 * id, disk kept), then destroys it and checks no process, overlay or socket
 * is left. Between suspend and restore, damages the snapshot: a manifest that
 * does not parse, a flipped byte of the device state and a truncated RAM file
 * are refused at once with a clear error, a flipped RAM byte is caught by the checksum check before
 * the vCPUs run (the wake fails, the snapshot is kept and marked corrupt, later wakes are refused
 * at once); repaired, the wake succeeds. All boots here are cold boots (opts.cold_boot). Measures
 * cold boot-to-agent-ready over three more boots and prints the median.
 *
 * Where the host has a cgroup layout (core/runtime/cgroup.h), checks after each boot,
 * re-adoption and restore that the QEMU pid is in the VM's cpu and memory
 * (and pids) groups with the limits from its size, and that destroy and a
 * dead QEMU leave no group behind.
 */
#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "core/channel/agentconn.h"
#include "core/runtime/cgroup.h"
#include "core/runtime/driver.h"
#include "e2e/vmtest.h"
#include "guest/tmplbuild.h"
#include "loop/loop.h"
#include "tests/check.h"

/* Cold boots: this test is about them (timeouts, destroy mid-boot); e2e/test_clones.c covers
 * create from a template snapshot. */
static sp_driver_t *make_driver(void)
{
    return vt_driver(1, 0);
}

static double boot_sized(sp_driver_t *d, const char *id, int cpus, int mem_mb)
{
    sp_vm_spec_t spec = {.sandbox_id = id,
                         .template_name = "base",
                         .cpu_count = cpus,
                         .memory_mb = mem_mb,
                         .hostname = "e2e",
                         .env_json = "{\"E2E\":\"1\"}"};
    vt_res_t r = {0};
    double t0 = vt_now_ms();
    vt_boot_start(d, &spec, &r);
    REQUIRE(r.done == 0); /* the outcome comes later, on the loop */
    vt_wait_ok(&r, "boot", id, 120000);
    return vt_now_ms() - t0;
}

static double boot(sp_driver_t *d, const char *id)
{
    return boot_sized(d, id, 1, 256);
}

static void destroy(sp_driver_t *d, const char *id)
{
    vt_res_t r = {0};
    sp_err_t e;
    REQUIRE(d->ops->destroy(d, id, vt_on_res, &r, &e) == 0);
    REQUIRE(r.done == 0);
    vt_wait_ok(&r, "destroy", id, 20000);
}

static void simple(sp_driver_t *d,
                   int (*fn)(sp_driver_t *, const char *, sp_driver_cb, void *, sp_err_t *),
                   const char *id)
{
    vt_op(d, fn, id, 10000);
}

/* ---- commands over the agent ---- */

static void run_cmd(sp_driver_t *d, const char *id, const char *cmd, char *out, size_t n)
{
    vt_run_cmd(d, id, cmd, out, n, 20000);
}

/* ---- cgroups ---- */

static sp_cgroup_t *cgl; /* the host's layout, as the driver sees it */

static int read_text(const char *dir, const char *file, char *out, size_t n)
{
    char p[4200];
    snprintf(p, sizeof p, "%s/%s", dir, file);
    FILE *f = fopen(p, "r");
    if (f == NULL)
        return -1;
    size_t k = fread(out, 1, n - 1, f);
    fclose(f);
    out[k] = '\0';
    return 0;
}

static unsigned long long read_ull(const char *dir, const char *file)
{
    char b[64];
    REQUIRE(read_text(dir, file, b, sizeof b) == 0);
    return strtoull(b, NULL, 10);
}

static int procs_has(const char *dir, pid_t pid)
{
    static char b[1 << 16];
    if (read_text(dir, "cgroup.procs", b, sizeof b) < 0)
        return 0;
    for (char *s = b; *s != '\0';) {
        char *end;
        long v = strtol(s, &end, 10);
        if (end == s)
            break;
        if (v == (long)pid)
            return 1;
        s = end;
    }
    return 0;
}

/* TCG or KVM, as the driver decided: the memory limit's overhead depends on it. */
static int accel_is_kvm(void)
{
    char p[4096], b[16] = "";
    snprintf(p, sizeof p, "%s/vms", vt_data_dir);
    REQUIRE(read_text(p, "accel", b, sizeof b) == 0);
    return strncmp(b, "kvm", 3) == 0;
}

/* QEMU pid of VM id runs in the VM's groups, limited to cpus vCPUs and mem_mb + overhead. */
static void check_cgroup(const char *id, pid_t pid, int cpus, int mem_mb)
{
    if (sp_cgroup_kind(cgl) == SP_CGROUP_NONE)
        return;
    unsigned long long want_mem = ((unsigned long long)mem_mb + (accel_is_kvm() ? 128 : 512)) << 20;
    char mem[4096], cpu[4096], pids[4096];
    REQUIRE(sp_cgroup_vm_dir(cgl, "memory", id, mem, sizeof mem) == 0);
    REQUIRE(sp_cgroup_vm_dir(cgl, "cpu", id, cpu, sizeof cpu) == 0);
    REQUIRE(procs_has(mem, pid));
    REQUIRE(procs_has(cpu, pid));
    if (sp_cgroup_kind(cgl) == SP_CGROUP_V1) {
        unsigned long long lim = read_ull(mem, "memory.limit_in_bytes");
        unsigned long long period = read_ull(cpu, "cpu.cfs_period_us");
        unsigned long long quota = read_ull(cpu, "cpu.cfs_quota_us");
        printf("cgroup v1 %s: pid %d in memory+cpu groups, memory.limit_in_bytes=%llu "
               "cpu.cfs_quota_us=%llu cpu.cfs_period_us=%llu\n",
               id, (int)pid, lim, quota, period);
        REQUIRE(lim == want_mem);
        REQUIRE(period == 100000ull && quota == 100000ull * (unsigned long long)cpus);
        char sw[4200];
        snprintf(sw, sizeof sw, "%s/memory.memsw.limit_in_bytes", mem);
        if (access(sw, F_OK) == 0)
            REQUIRE(read_ull(mem, "memory.memsw.limit_in_bytes") == want_mem);
    } else {
        char cm[64];
        REQUIRE(read_text(cpu, "cpu.max", cm, sizeof cm) == 0);
        unsigned long long lim = read_ull(mem, "memory.max");
        printf("cgroup v2 %s: pid %d in its group, memory.max=%llu cpu.max=%s", id, (int)pid, lim,
               cm);
        REQUIRE(lim == want_mem);
        char want_cpu[64];
        snprintf(want_cpu, sizeof want_cpu, "%llu 100000\n", 100000ull * (unsigned long long)cpus);
        REQUIRE(strcmp(cm, want_cpu) == 0);
    }
    if (sp_cgroup_vm_dir(cgl, "pids", id, pids, sizeof pids) == 0) {
        REQUIRE(procs_has(pids, pid));
        REQUIRE(read_ull(pids, "pids.max") == 512ull);
    }
}

/* No group of VM id is left in any hierarchy. */
static void check_no_cgroup(const char *id)
{
    static const char *const ctl[] = {"cpu", "memory", "pids"};
    struct stat sb;
    for (size_t i = 0; i < sizeof ctl / sizeof ctl[0]; i++) {
        char dir[4096];
        if (sp_cgroup_vm_dir(cgl, ctl[i], id, dir, sizeof dir) == 0)
            REQUIRE(stat(dir, &sb) < 0 && errno == ENOENT);
    }
}

static void flip_byte(const char *path, off_t off)
{
    int fd = open(path, O_RDWR);
    REQUIRE(fd >= 0);
    unsigned char c;
    REQUIRE(pread(fd, &c, 1, off) == 1);
    c ^= 0xff;
    REQUIRE(pwrite(fd, &c, 1, off) == 1);
    close(fd);
}

/* Offset of the first non-zero byte of a file (the guest's RAM has data early). */
static off_t first_data(const char *path)
{
    int fd = open(path, O_RDONLY);
    REQUIRE(fd >= 0);
    static unsigned char buf[1 << 20];
    off_t off = 0;
    for (;;) {
        ssize_t r = pread(fd, buf, sizeof buf, off);
        REQUIRE(r > 0);
        for (ssize_t i = 0; i < r; i++) {
            if (buf[i] != 0) {
                close(fd);
                return off + i;
            }
        }
        off += r;
    }
}

static int try_restore(sp_driver_t *d, const char *id, sp_err_t *e)
{
    sp_vm_spec_t spec = {.sandbox_id = id, .template_name = "base", .hostname = "e2e"};
    vt_res_t r = {0};
    return d->ops->restore(d, &spec, vt_on_res, &r, e);
}

/* A suspended sandbox's snapshot, damaged three ways: each wake is refused (or fails) with a
 * clear error, the snapshot stays; then repaired. */
static void damaged_snapshot(sp_driver_t *d, const char *id)
{
    char vd[4096], p[4200], man[4096];
    snprintf(vd, sizeof vd, "%s/vms/%s", vt_data_dir, id);
    snprintf(p, sizeof p, "%s/snapshot/manifest.json", vd);
    vt_read_file(p, man, sizeof man);
    printf("suspend manifest: %s\n", man);
    REQUIRE(strstr(man, "\"ram_checksum\":\"") != NULL &&
            strstr(man, "\"devstate_checksum\":\"") != NULL &&
            strstr(man, "\"disk_checksum\":\"") != NULL && strstr(man, "\"disk_bytes\":") != NULL);
    sp_err_t e;

    /* a manifest that does not parse: refused at once, still SUSPENDED */
    snprintf(p, sizeof p, "%s/snapshot/manifest.json", vd);
    FILE *f = fopen(p, "w");
    REQUIRE(f != NULL && fputs("{\"version\":2,\"memory_", f) >= 0 && fclose(f) == 0);
    REQUIRE(try_restore(d, id, &e) < 0 && e.code == SP_ERUNTIME &&
            strstr(e.msg, "manifest is damaged") != NULL);
    printf("damaged manifest -> %s\n", e.msg);
    REQUIRE(d->ops->probe(d, id) == SP_VM_SUSPENDED);
    f = fopen(p, "w");
    REQUIRE(f != NULL && fputs(man, f) >= 0 && fclose(f) == 0);

    /* a flipped byte of the device state: refused at once */
    snprintf(p, sizeof p, "%s/snapshot/devstate", vd);
    flip_byte(p, 1000);
    REQUIRE(try_restore(d, id, &e) < 0 && e.code == SP_ERUNTIME &&
            strstr(e.msg, "device state does not match its checksum") != NULL);
    printf("corrupt device state -> %s\n", e.msg);
    REQUIRE(d->ops->probe(d, id) == SP_VM_SUSPENDED);
    flip_byte(p, 1000);

    /* a truncated RAM file: refused at once */
    snprintf(p, sizeof p, "%s/mem.ram", vd);
    struct stat st;
    REQUIRE(stat(p, &st) == 0 && st.st_size == 256 << 20);
    static unsigned char tail[4096];
    int fd = open(p, O_RDWR);
    REQUIRE(fd >= 0 && pread(fd, tail, sizeof tail, st.st_size - 4096) == 4096);
    REQUIRE(ftruncate(fd, st.st_size - 4096) == 0);
    REQUIRE(try_restore(d, id, &e) < 0 && e.code == SP_ERUNTIME &&
            strstr(e.msg, "RAM has") != NULL);
    printf("truncated RAM file -> %s\n", e.msg);
    REQUIRE(d->ops->probe(d, id) == SP_VM_SUSPENDED);
    REQUIRE(ftruncate(fd, st.st_size) == 0 && pwrite(fd, tail, 4096, st.st_size - 4096) == 4096);
    close(fd);

    /* a flipped RAM byte: the wake starts, the checksum check stops it before the vCPUs run */
    off_t off = first_data(p);
    flip_byte(p, off);
    sp_vm_spec_t spec = {.sandbox_id = id, .template_name = "base", .hostname = "e2e"};
    vt_res_t r = {0};
    REQUIRE(d->ops->restore(d, &spec, vt_on_res, &r, &e) == 0);
    REQUIRE(vt_wait_for(&r.done, 60000) == 0);
    REQUIRE(!r.ok && strstr(r.err.msg, "RAM does not match its checksum") != NULL);
    printf("corrupt RAM (byte %lld) -> %s\n", (long long)off, r.err.msg);
    vt_run_for(100);
    REQUIRE(d->ops->probe(d, id) == SP_VM_SUSPENDED);
    REQUIRE(try_restore(d, id, &e) < 0 && strstr(e.msg, "failed its checksum check") != NULL);
    printf("and again -> %s\n", e.msg);
    flip_byte(p, off);
    snprintf(p, sizeof p, "%s/snapshot/corrupt", vd);
    REQUIRE(unlink(p) == 0);
}

static int cmp_d(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

int main(void)
{
    vt_init();
    sp_err_t e;
    char id[64];
    snprintf(id, sizeof id, "e2e-%d", (int)getpid());

    sp_driver_t *d = make_driver();
    cgl = sp_cgroup_create();
    REQUIRE(cgl != NULL);
    printf("cgroup layout: %s\n", sp_cgroup_why(cgl));
    /* cleanup of nothing succeeds; there is nothing to suspend */
    destroy(d, id);
    REQUIRE(d->ops->probe(d, id) == SP_VM_ABSENT);
    REQUIRE(d->ops->snapshot(d, id, vt_on_res, NULL, &e) < 0 && e.code == SP_ENOTFOUND);
    sp_vm_stats_t st;
    REQUIRE(d->ops->stats(d, id, &st, &e) < 0 && e.code == SP_ENOTFOUND);

    double first = boot(d, id);
    printf("first boot (includes the accelerator probe): %.0f ms\n", first);
    REQUIRE(d->ops->probe(d, id) == SP_VM_RUNNING);
    char rel[256];
    run_cmd(d, id, "uname -r", rel, sizeof rel);
    printf("uname -r in the guest: %s\n", rel);
    REQUIRE(rel[0] != '\0');
    REQUIRE(strstr(vt_base.kernel_version, rel) ==
            vt_base.kernel_version); /* "<abi>_<debian version>" */
    check_cgroup(id, vt_vm_pid(id), 1, 256);

    /* boot again is idempotent */
    boot(d, id);

    REQUIRE(d->ops->stats(d, id, &st, &e) == 0);
    vt_run_for(600);
    REQUIRE(d->ops->stats(d, id, &st, &e) == 0);
    printf("stats: cpu=%.1f%% mem=%llu/%llu disk=%llu/%llu\n", st.cpu_used_pct,
           (unsigned long long)st.mem_used_bytes, (unsigned long long)st.mem_total_bytes,
           (unsigned long long)st.disk_used_bytes, (unsigned long long)st.disk_total_bytes);
    REQUIRE(st.mem_used_bytes > 0 && st.disk_used_bytes > 0 && st.mem_total_bytes == 256u << 20);

    double t0 = vt_now_ms();
    simple(d, d->ops->pause, id);
    double tp_ms = vt_now_ms() - t0;
    REQUIRE(d->ops->probe(d, id) == SP_VM_PAUSED);
    t0 = vt_now_ms();
    simple(d, d->ops->resume, id);
    printf("pause %.2f ms, resume %.2f ms (including a vt_loop turn)\n", tp_ms, vt_now_ms() - t0);
    REQUIRE(d->ops->probe(d, id) == SP_VM_RUNNING);

    /* pause, then restart the driver: the new one must see PAUSED from disk */
    simple(d, d->ops->pause, id);
    pid_t pid = vt_vm_pid(id);
    REQUIRE(pid > 0);
    sp_driver_destroy(d);
    vt_run_for(200);
    REQUIRE(kill(pid, 0) == 0); /* the VM survived its driver */
    d = make_driver();
    REQUIRE(d->ops->probe(d, id) == SP_VM_PAUSED);
    vt_run_for(300);
    simple(d, d->ops->resume, id);
    REQUIRE(d->ops->probe(d, id) == SP_VM_RUNNING);
    run_cmd(d, id, "uname -r", rel, sizeof rel);
    printf("after driver restart: re-adopted, uname -r: %s\n", rel);
    check_cgroup(id, pid, 1, 256); /* the groups outlived the driver */

    /* a second driver restart, then probe (not just create) re-adopts */
    sp_driver_destroy(d);
    d = make_driver();
    REQUIRE(d->ops->probe(d, id) == SP_VM_RUNNING);

    /* suspend and restore: same guest boot (memory came back), disk kept */
    char bid1[128], bid2[128], mark[64];
    run_cmd(d, id, "echo kept > /root/marker; sync; cat /proc/sys/kernel/random/boot_id", bid1,
            sizeof bid1);
    t0 = vt_now_ms();
    simple(d, d->ops->snapshot, id);
    printf("suspend: %.0f ms\n", vt_now_ms() - t0);
    REQUIRE(d->ops->probe(d, id) == SP_VM_SUSPENDED);
    REQUIRE(d->ops->agent(d, id) == NULL);
    vt_run_for(100);
    REQUIRE(kill(pid, 0) < 0);
    sp_driver_destroy(d); /* a restart in between: the snapshot is on disk */
    d = make_driver();
    REQUIRE(d->ops->probe(d, id) == SP_VM_SUSPENDED);
    damaged_snapshot(d, id);
    {
        sp_vm_spec_t spec = {.sandbox_id = id, .template_name = "base", .hostname = "e2e"};
        vt_res_t r = {0};
        t0 = vt_now_ms();
        REQUIRE(d->ops->restore(d, &spec, vt_on_res, &r, &e) == 0);
        vt_wait_ok(&r, "restore", id, 60000);
        printf("restore to agent ready: %.0f ms\n", vt_now_ms() - t0);
    }
    REQUIRE(d->ops->probe(d, id) == SP_VM_RUNNING);
    run_cmd(d, id, "cat /proc/sys/kernel/random/boot_id", bid2, sizeof bid2);
    run_cmd(d, id, "cat /root/marker", mark, sizeof mark);
    printf("guest boot_id before/after suspend: %s / %s, marker=%s\n", bid1, bid2, mark);
    REQUIRE(strcmp(bid1, bid2) == 0 && strcmp(mark, "kept") == 0);
    pid = vt_vm_pid(id);
    REQUIRE(pid > 0);
    check_cgroup(id, pid, 1, 256); /* the restored QEMU is a new process: limited too */

    destroy(d, id);
    vt_run_for(100);
    REQUIRE(kill(pid, 0) < 0 && errno == ESRCH);
    char p[4096];
    snprintf(p, sizeof p, "%s/vms/%s", vt_data_dir, id);
    struct stat sb;
    REQUIRE(stat(p, &sb) < 0 && errno == ENOENT); /* no overlay, socket or pidfile */
    REQUIRE(d->ops->probe(d, id) == SP_VM_ABSENT);
    REQUIRE(d->ops->agent(d, id) == NULL);
    check_no_cgroup(id);

    /* spaced killed outright (SIGKILL, no cleanup): its VM keeps running and is re-adopted */
    {
        char kid[80];
        snprintf(kid, sizeof kid, "%s-k", id);
        fflush(NULL);
        pid_t child = fork();
        REQUIRE(child >= 0);
        if (child == 0) {
            vt_loop = sp_loop_create();
            sp_driver_t *cd = make_driver();
            boot(cd, kid);
            raise(SIGKILL);
        }
        int cst;
        REQUIRE(waitpid(child, &cst, 0) == child && WIFSIGNALED(cst));
        pid_t kp = vt_vm_pid(kid);
        REQUIRE(kp > 0 && kill(kp, 0) == 0);
        REQUIRE(d->ops->probe(d, kid) == SP_VM_RUNNING);
        run_cmd(d, kid, "echo alive", rel, sizeof rel);
        REQUIRE(strcmp(rel, "alive") == 0);
        /* the exact QEMU command line, for the record */
        char cl[4096];
        snprintf(p, sizeof p, "/proc/%d/cmdline", (int)kp);
        FILE *f = fopen(p, "r");
        REQUIRE(f != NULL);
        size_t cn = fread(cl, 1, sizeof cl - 1, f);
        fclose(f);
        for (size_t i = 0; i < cn; i++)
            if (cl[i] == '\0')
                cl[i] = ' ';
        cl[cn] = '\0';
        printf("qemu argv: %s\n", cl);

        /* a guest printing forever cannot fill the disk: console.log is cut to its tail */
        snprintf(p, sizeof p, "%s/vms/%s/console.log", vt_data_dir, kid);
        f = fopen(p, "a");
        REQUIRE(f != NULL);
        static char junk[1 << 20];
        memset(junk, 'x', sizeof junk);
        for (int i = 0; i < 3; i++)
            REQUIRE(fwrite(junk, 1, sizeof junk, f) == sizeof junk);
        fclose(f);
        REQUIRE(d->ops->stats(d, kid, &st, &e) == 0);
        REQUIRE(stat(p, &sb) == 0 && sb.st_size <= (2 << 20));

        /* QEMU dies under us: the driver notices, probe says ABSENT and cleans up */
        kill(kp, SIGKILL);
        vt_run_for(300);
        REQUIRE(d->ops->agent(d, kid) == NULL);
        REQUIRE(d->ops->probe(d, kid) == SP_VM_ABSENT);
        snprintf(p, sizeof p, "%s/vms/%s", vt_data_dir, kid);
        REQUIRE(stat(p, &sb) < 0 && errno == ENOENT);
        check_no_cgroup(kid);
        destroy(d, kid);
    }

    /* limits follow the sandbox's size */
    {
        char sid[80];
        snprintf(sid, sizeof sid, "%s-s", id);
        boot_sized(d, sid, 2, 384);
        check_cgroup(sid, vt_vm_pid(sid), 2, 384);
        destroy(d, sid);
        check_no_cgroup(sid);
    }

    /* cold boot-to-agent-ready, median of 3 */
    double t[3];
    for (int i = 0; i < 3; i++) {
        char bid[80];
        snprintf(bid, sizeof bid, "%s-b%d", id, i);
        t[i] = boot(d, bid);
        destroy(d, bid);
        check_no_cgroup(bid);
    }
    qsort(t, 3, sizeof t[0], cmp_d);
    printf("cold boot to agent ready: median %.0f ms (%.0f-%.0f)\n", t[1], t[0], t[2]);

    /* destroy while booting: the boot fails, nothing remains */
    {
        char bid[80];
        snprintf(bid, sizeof bid, "%s-x", id);
        sp_vm_spec_t spec = {.sandbox_id = bid, .template_name = "base"};
        vt_res_t rb = {0}, rd = {0};
        REQUIRE(d->ops->boot(d, &spec, vt_on_res, &rb, &e) == 0);
        vt_run_for(700);
        REQUIRE(d->ops->destroy(d, bid, vt_on_res, &rd, &e) == 0);
        REQUIRE(vt_wait_for(&rd.done, 20000) == 0 && rd.ok);
        REQUIRE(rb.done == 1 && !rb.ok);
        snprintf(p, sizeof p, "%s/vms/%s", vt_data_dir, bid);
        REQUIRE(stat(p, &sb) < 0);
    }

    /* boot timeout: the VM is killed, console.log is kept, the error says why */
    sp_driver_destroy(d);
    setenv("SPACE_BOOT_TIMEOUT_MS", "800", 1);
    d = make_driver();
    unsetenv("SPACE_BOOT_TIMEOUT_MS");
    {
        char bid[80];
        snprintf(bid, sizeof bid, "%s-t", id);
        sp_vm_spec_t spec = {.sandbox_id = bid, .template_name = "base"};
        vt_res_t rb = {0};
        REQUIRE(d->ops->boot(d, &spec, vt_on_res, &rb, &e) == 0);
        REQUIRE(vt_wait_for(&rb.done, 20000) == 0);
        REQUIRE(!rb.ok && strstr(rb.err.msg, "guest did not come up") != NULL);
        printf("boot timeout: %s\n", rb.err.msg);
        vt_run_for(100);
        snprintf(p, sizeof p, "%s/vms/%s/console.log", vt_data_dir, bid);
        REQUIRE(stat(p, &sb) == 0);
        snprintf(p, sizeof p, "%s/vms/%s/disk.qcow2", vt_data_dir, bid);
        REQUIRE(stat(p, &sb) < 0);
        REQUIRE(d->ops->probe(d, bid) == SP_VM_ABSENT); /* and the leftovers go */
        snprintf(p, sizeof p, "%s/vms/%s", vt_data_dir, bid);
        REQUIRE(stat(p, &sb) < 0);
    }

    sp_driver_destroy(d);
    sp_loop_destroy(vt_loop);
    sp_cgroup_destroy(cgl);
    printf("qemu driver e2e: ok\n");
    return 0;
}
