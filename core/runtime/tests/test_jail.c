/*
 * test_jail.c - the jail (core/runtime/jail.h): the uid allocator and its range syntax
 * (pure), and, as root, a jailed `sleep` checked from the host through /proc/<pid>: uid and
 * gid, no capabilities, no_new_privs, its own namespaces, a root that holds only what was
 * bound, only lo, an empty environment, no inherited fds, the rlimits, the cgroup-free
 * path. The QEMU driver's use of it (and its refusal without seccomp) is in test_qemu.c;
 * real VMs in e2e/test_jail.py.
 */
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <grp.h>
#include <limits.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "core/runtime/jail.h"
#include "tests/check.h"

static void test_jail_range_parse(void)
{
    uint32_t s, c;
    CHECK(sp_jail_range_parse("900000:65536", &s, &c) == 0 && s == 900000 && c == 65536);
    CHECK(sp_jail_range_parse("1:1", &s, &c) == 0 && s == 1 && c == 1);
    CHECK(sp_jail_range_parse("0:10", &s, &c) < 0); /* holds root */
    CHECK(sp_jail_range_parse("10:0", &s, &c) < 0);
    CHECK(sp_jail_range_parse("10", &s, &c) < 0);
    CHECK(sp_jail_range_parse("10:", &s, &c) < 0);
    CHECK(sp_jail_range_parse(":10", &s, &c) < 0);
    CHECK(sp_jail_range_parse("-5:10", &s, &c) < 0);
    CHECK(sp_jail_range_parse("10:5x", &s, &c) < 0);
    CHECK(sp_jail_range_parse("4294967290:5", &s, &c) == 0); /* ends at 2^32-2 */
    CHECK(sp_jail_range_parse("4294967290:6", &s, &c) < 0);  /* would hand out (uid_t)-1 */
    CHECK(sp_jail_range_parse("99999999999:1", &s, &c) < 0);
    CHECK(sp_jail_range_parse(NULL, &s, &c) < 0);
}

static void test_jail_ids_allocate(void)
{
    CHECK(sp_jail_ids_create(0, 10, 1000) == NULL && errno == EINVAL);
    /* a range of 4 holding the caller's uid: 3 usable */
    sp_jail_ids_t *ids = sp_jail_ids_create(1000, 4, 1001);
    REQUIRE(ids != NULL);
    uid_t a, b, c, d;
    REQUIRE(sp_jail_ids_take(ids, &a) == 0 && a == 1000);
    REQUIRE(sp_jail_ids_take(ids, &b) == 0 && b == 1002); /* 1001 is the caller's */
    REQUIRE(sp_jail_ids_take(ids, &c) == 0 && c == 1003);
    CHECK(sp_jail_ids_take(ids, &d) < 0 && errno == ENOSPC);
    CHECK(sp_jail_ids_used(ids) == 3);
    /* given back, reused only once the cursor comes round (next-fit) */
    sp_jail_ids_put(ids, b);
    sp_jail_ids_put(ids, b);    /* twice: ignored */
    sp_jail_ids_put(ids, 4242); /* outside: ignored */
    CHECK(sp_jail_ids_used(ids) == 2);
    REQUIRE(sp_jail_ids_take(ids, &d) == 0 && d == 1002);
    sp_jail_ids_put(ids, a);
    sp_jail_ids_put(ids, c);
    /* a restarted driver claims what running VMs hold */
    CHECK(sp_jail_ids_claim(ids, 1003) == 0);
    CHECK(sp_jail_ids_claim(ids, 1003) < 0 && errno == EEXIST);
    CHECK(sp_jail_ids_claim(ids, 1001) < 0 && errno == ERANGE); /* the caller's */
    CHECK(sp_jail_ids_claim(ids, 999) < 0 && errno == ERANGE);
    CHECK(sp_jail_ids_claim(ids, 1004) < 0 && errno == ERANGE);
    REQUIRE(sp_jail_ids_take(ids, &a) == 0 && a == 1000);
    CHECK(sp_jail_ids_take(ids, &b) < 0);
    CHECK(sp_jail_ids_used(ids) == 3);
    sp_jail_ids_destroy(ids);
    sp_jail_ids_destroy(NULL);

    /* the default range: every uid is distinct, none is 0 */
    ids = sp_jail_ids_create(SP_JAIL_UID_START_DEFAULT, 1000, 0);
    REQUIRE(ids != NULL);
    uid_t prev = 0;
    for (int i = 0; i < 1000; i++) {
        uid_t u;
        REQUIRE(sp_jail_ids_take(ids, &u) == 0);
        CHECK(u != 0 && u > prev);
        prev = u;
    }
    sp_jail_ids_destroy(ids);
}

static void test_jail_plan_refuses(void)
{
    CHECK(sp_jail_new("/tmp", 0, 5) == NULL); /* never root */
    CHECK(sp_jail_new("relative", 5, 5) == NULL);
    sp_jail_t *j = sp_jail_new("/tmp", 5, 5);
    REQUIRE(j != NULL);
    CHECK(sp_jail_bind(j, "relative/path", 0) < 0 && errno == EINVAL);
    CHECK(sp_jail_bind(j, "/usr/../etc", 0) < 0 && errno == EINVAL);
    CHECK(sp_jail_bind(j, "/no/such/file", 0) < 0 && errno == ENOENT);
    CHECK(sp_jail_bind(j, "/no/such/file", SP_JAIL_OPT) == 0);
    sp_jail_free(j);
}

static int read_file(const char *path, char *buf, size_t n)
{
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0)
        return -1;
    ssize_t r = read(fd, buf, n - 1);
    close(fd);
    if (r < 0)
        return -1;
    buf[r] = '\0';
    return (int)r;
}

static bool status_has(const char *status, const char *line)
{
    return strstr(status, line) != NULL;
}

static bool same_ns(pid_t pid, const char *ns)
{
    char a[64], b[64], pa[64], pb[64];
    snprintf(pa, sizeof pa, "/proc/self/ns/%s", ns);
    snprintf(pb, sizeof pb, "/proc/%d/ns/%s", (int)pid, ns);
    ssize_t x = readlink(pa, a, sizeof a - 1), y = readlink(pb, b, sizeof b - 1);
    REQUIRE(x > 0 && y > 0);
    a[x] = b[y] = '\0';
    return strcmp(a, b) == 0;
}

/* As root: `sleep` jailed, looked at from outside. */
static void test_jail_spawn_as_root(void)
{
    char why[256];
    if (!sp_jail_supported(why, sizeof why)) {
        printf("  (skipped: %s)\n", why);
        return;
    }
    char stage[] = "/tmp/test_jail_XXXXXX";
    REQUIRE(mkdtemp(stage) != NULL);
    char data[] = "/tmp/test_jail_data_XXXXXX";
    REQUIRE(mkdtemp(data) != NULL);
    REQUIRE(chown(data, 900123, 900123) == 0);
    char sleep_bin[PATH_MAX];
    REQUIRE(realpath("/bin/sleep", sleep_bin) != NULL);
    sp_jail_t *j = sp_jail_new(stage, 900123, 900123);
    REQUIRE(j != NULL);
    static const char *const links[] = {"/lib", "/lib64"};
    REQUIRE(sp_jail_bind(j, sleep_bin, 0) == 0);
    REQUIRE(sp_jail_bind(j, "/usr/lib", 0) == 0);
    REQUIRE(sp_jail_bind(j, "/usr/lib64", SP_JAIL_OPT) == 0);
    REQUIRE(sp_jail_mirror_root_links(j, links, 2) == 0);
    REQUIRE(sp_jail_bind(j, "/dev/null", SP_JAIL_DEV | SP_JAIL_RW) == 0);
    REQUIRE(sp_jail_bind(j, data, SP_JAIL_RW) == 0);
    sp_jail_set_fsize(j, 1u << 20);
    int given[2];
    REQUIRE(pipe2(given, O_CLOEXEC) == 0);
    CHECK(sp_jail_pass_fd(j, given[0]) == 3); /* handed over, as fd 3 */
    int leak = open("/dev/null", O_RDONLY);   /* not close-on-exec: must not reach the child */
    REQUIRE(leak >= 0);
    setenv("TEST_JAIL_SECRET", "must-not-leak", 1);
    int out = open("/dev/null", O_WRONLY | O_CLOEXEC);
    char *argv[] = {sleep_bin, "30", NULL};
    int pidfd = -1;
    pid_t pid = sp_jail_spawn(j, argv, NULL, out, out, NULL, &pidfd, why, sizeof why);
    if (pid < 0)
        fprintf(stderr, "spawn: %s\n", why);
    REQUIRE(pid > 0 && pidfd >= 0);
    close(out);
    close(leak);
    unsetenv("TEST_JAIL_SECRET");

    char p[128], st[4096];
    snprintf(p, sizeof p, "/proc/%d/status", (int)pid);
    for (int i = 0; i < 200; i++) { /* until exec replaced the clone */
        char exe[PATH_MAX];
        snprintf(p, sizeof p, "/proc/%d/exe", (int)pid);
        ssize_t l = readlink(p, exe, sizeof exe - 1);
        if (l > 0 && (exe[l] = '\0', strcmp(exe, sleep_bin) == 0))
            break;
        usleep(5000);
    }
    snprintf(p, sizeof p, "/proc/%d/status", (int)pid);
    REQUIRE(read_file(p, st, sizeof st) > 0);
    CHECK(status_has(st, "\nUid:\t900123\t900123\t900123\t900123\n"));
    CHECK(status_has(st, "\nGid:\t900123\t900123\t900123\t900123\n"));
    const char *g = strstr(st, "\nGroups:");
    REQUIRE(g != NULL);
    g += 8;
    CHECK(g[strspn(g, " \t")] == '\n'); /* no supplementary groups */
    CHECK(status_has(st, "\nCapInh:\t0000000000000000\n"));
    CHECK(status_has(st, "\nCapPrm:\t0000000000000000\n"));
    CHECK(status_has(st, "\nCapEff:\t0000000000000000\n"));
    CHECK(status_has(st, "\nCapBnd:\t0000000000000000\n"));
    CHECK(status_has(st, "\nCapAmb:\t0000000000000000\n"));
    CHECK(status_has(st, "\nNoNewPrivs:\t1\n"));
    CHECK(status_has(st, "\nNSpid:\t") && strstr(st, "\t1\n") != NULL); /* init of its ns */
    static const char *const nss[] = {"mnt", "pid", "ipc", "uts", "net"};
    for (size_t i = 0; i < sizeof nss / sizeof nss[0]; i++)
        CHECK(!same_ns(pid, nss[i]));
    /* its root holds what was bound and nothing else */
    snprintf(p, sizeof p, "/proc/%d/root", (int)pid);
    DIR *dd = opendir(p);
    REQUIRE(dd != NULL);
    struct dirent *de;
    int n = 0;
    while ((de = readdir(dd)) != NULL) {
        if (strcmp(de->d_name, ".") == 0 || strcmp(de->d_name, "..") == 0)
            continue;
        n++;
        CHECK(strcmp(de->d_name, "usr") == 0 || strcmp(de->d_name, "lib") == 0 ||
              strcmp(de->d_name, "lib64") == 0 || strcmp(de->d_name, "dev") == 0 ||
              strcmp(de->d_name, "tmp") == 0 || strcmp(de->d_name, "bin") == 0);
    }
    closedir(dd);
    CHECK(n >= 3);
    snprintf(p, sizeof p, "/proc/%d/root/etc/passwd", (int)pid);
    CHECK(access(p, F_OK) < 0);
    snprintf(p, sizeof p, "/proc/%d/root/dev/zero", (int)pid);
    CHECK(access(p, F_OK) < 0);
    snprintf(p, sizeof p, "/proc/%d/root%s", (int)pid, data);
    CHECK(access(p, F_OK) == 0);
    /* only lo, and down */
    snprintf(p, sizeof p, "/proc/%d/net/dev", (int)pid);
    REQUIRE(read_file(p, st, sizeof st) > 0);
    int ifs = 0;
    for (char *l = strchr(st, '\n'); l != NULL && (l = strchr(l + 1, '\n')) != NULL;)
        if (l[1] != '\0') {
            ifs++;
            CHECK(strncmp(l + 1 + strspn(l + 1, " "), "lo:", 3) == 0);
        }
    CHECK(ifs == 1);
    /* empty environment, stdio only, limits */
    snprintf(p, sizeof p, "/proc/%d/environ", (int)pid);
    CHECK(read_file(p, st, sizeof st) == 0);
    snprintf(p, sizeof p, "/proc/%d/fd", (int)pid);
    /* The spawn returns once the child is in execve (vfork), which closes the close-on-exec
     * fds a moment later: count again until the exec is through. A leaked fd stays. */
    int fds = 0;
    for (int tries = 0; tries < 100 && fds != 4; tries++) {
        if (tries > 0)
            usleep(10000);
        dd = opendir(p);
        REQUIRE(dd != NULL);
        fds = 0;
        while ((de = readdir(dd)) != NULL)
            fds += de->d_name[0] != '.';
        closedir(dd);
    }
    if (fds != 4) { /* say which, for the log */
        dd = opendir(p);
        while (dd != NULL && (de = readdir(dd)) != NULL) {
            char fp[600], ln[256] = "";
            snprintf(fp, sizeof fp, "%s/%s", p, de->d_name);
            ssize_t k = readlink(fp, ln, sizeof ln - 1);
            if (k > 0)
                fprintf(stderr, "jailed fd %s -> %.*s\n", de->d_name, (int)k, ln);
        }
        if (dd != NULL)
            closedir(dd);
    }
    CHECK(fds == 4); /* stdio and the passed pipe */
    char lnk[64], want[64];
    snprintf(p, sizeof p, "/proc/%d/fd/3", (int)pid);
    ssize_t ll = readlink(p, lnk, sizeof lnk - 1);
    REQUIRE(ll > 0);
    lnk[ll] = '\0';
    snprintf(p, sizeof p, "/proc/self/fd/%d", given[0]);
    ssize_t wl = readlink(p, want, sizeof want - 1);
    REQUIRE(wl > 0);
    want[wl] = '\0';
    CHECK(strcmp(lnk, want) == 0);
    close(given[0]);
    close(given[1]);
    snprintf(p, sizeof p, "/proc/%d/limits", (int)pid);
    REQUIRE(read_file(p, st, sizeof st) > 0);
    CHECK(strstr(st, "Max core file size        0                    0") != NULL);
    CHECK(strstr(st, "Max open files            4096                 4096") != NULL);
    CHECK(strstr(st, "Max file size             1048576              1048576") != NULL);

    kill(pid, SIGKILL);
    int ws;
    REQUIRE(waitpid(pid, &ws, 0) == pid && WIFSIGNALED(ws));
    close(pidfd);

    /* a failing step is reported, and nothing runs */
    REQUIRE(sp_jail_bind(j, "/usr/share", 0) == 0);
    char *bad[] = {"/no/such/exe", NULL};
    out = open("/dev/null", O_WRONLY | O_CLOEXEC);
    pid = sp_jail_spawn(j, bad, NULL, out, out, NULL, &pidfd, why, sizeof why);
    close(out);
    CHECK(pid < 0 && strstr(why, "exec") != NULL);
    sp_jail_free(j);
    rmdir(data);
    rmdir(stage);
}

/* QEMU with its seccomp sandbox in a jail of uid:gid holding only its binary, the libraries
 * and /dev/null (no machine: the driver's seccomp probe, here jailed), with a sealed memfd
 * as a private RAM backend through the jail's own /proc (how clones map their template's
 * RAM): it answers QMP on stdin and exits 0, and the memfd stays what it was. 0, or the
 * number of the check that failed (its output in stderr). */
static int qemu_in_jail(const char *qemu, uid_t uid, gid_t gid)
{
    char stage[] = "/tmp/test_jail_XXXXXX", why[256];
    if (mkdtemp(stage) == NULL)
        return 1;
    sp_jail_t *j = sp_jail_new(stage, uid, gid);
    static const char *const links[] = {"/lib", "/lib64"};
    if (j == NULL || sp_jail_bind(j, qemu, 0) < 0 || sp_jail_bind(j, "/usr/lib", 0) < 0 ||
        sp_jail_bind(j, "/usr/lib64", SP_JAIL_OPT) < 0 ||
        sp_jail_bind(j, "/usr/share/qemu", SP_JAIL_OPT) < 0 ||
        sp_jail_mirror_root_links(j, links, 2) < 0 ||
        sp_jail_bind(j, "/dev/null", SP_JAIL_DEV | SP_JAIL_RW) < 0 || sp_jail_mount_proc(j) < 0)
        return 2;
    int p[2];
    static const char script[] = "{\"execute\":\"qmp_capabilities\"}\n{\"execute\":\"quit\"}\n";
    if (pipe2(p, O_CLOEXEC) < 0 ||
        write(p[1], script, sizeof script - 1) != (ssize_t)sizeof script - 1)
        return 3;
    close(p[1]);
    char log[] = "/tmp/test_jail_qemu_XXXXXX";
    int out = mkstemp(log);
    int mfd = memfd_create("test-jail-ram", MFD_CLOEXEC | MFD_ALLOW_SEALING);
    if (out < 0 || mfd < 0 || ftruncate(mfd, 1 << 20) < 0 || pwrite(mfd, "x", 1, 4096) != 1 ||
        fcntl(mfd, F_ADD_SEALS, F_SEAL_WRITE | F_SEAL_GROW | F_SEAL_SHRINK | F_SEAL_SEAL) < 0)
        return 4;
    char memobj[128];
    snprintf(memobj, sizeof memobj,
             "memory-backend-file,id=mem,size=1M,mem-path=/proc/self/fd/%d,share=off",
             sp_jail_pass_fd(j, mfd));
    char *argv[] = {(char *)qemu,
                    "-object",
                    memobj,
                    "-M",
                    "none",
                    "-display",
                    "none",
                    "-nodefaults",
                    "-no-user-config",
                    "-sandbox",
                    "on,obsolete=deny,elevateprivileges=deny,spawn=deny,"
                    "resourcecontrol=deny",
                    "-qmp",
                    "stdio",
                    NULL};
    int pidfd = -1, rc = 0;
    pid_t pid = sp_jail_spawn(j, argv, NULL, p[0], out, NULL, &pidfd, why, sizeof why);
    close(p[0]);
    int ws = 0;
    char text[4096] = "", x = 0;
    if (pid < 0) {
        fprintf(stderr, "spawn: %s\n", why);
        rc = 5;
    } else if (waitpid(pid, &ws, 0) != pid) {
        rc = 6;
    } else {
        ssize_t r = pread(out, text, sizeof text - 1, 0);
        text[r > 0 ? r : 0] = '\0';
        if (!WIFEXITED(ws) || WEXITSTATUS(ws) != 0) {
            fprintf(stderr, "qemu: status %d: %s\n", ws, text);
            rc = 7;
        } else if (strstr(text, "\"return\"") == NULL) {
            rc = 8;
        } else if (pread(mfd, &x, 1, 4096) != 1 || x != 'x') { /* it stays what it was */
            rc = 9;
        } else if (pwrite(mfd, "y", 1, 0) >= 0 || errno != EPERM) {
            rc = 10;
        }
    }
    close(mfd);
    close(out);
    if (pidfd >= 0)
        close(pidfd);
    unlink(log);
    sp_jail_free(j);
    rmdir(stage);
    return rc;
}

static bool find_qemu(char *qemu)
{
    return realpath("/usr/bin/qemu-system-x86_64", qemu) != NULL;
}

/* As root, where QEMU is installed. */
static void test_jail_qemu_starts(void)
{
    char why[256], qemu[PATH_MAX];
    if (!sp_jail_supported(why, sizeof why) || geteuid() != 0 || !find_qemu(qemu)) {
        printf("  (skipped: root and /usr/bin/qemu-system-x86_64 needed)\n");
        return;
    }
    CHECK(qemu_in_jail(qemu, 900124, 900124) == 0);
}

/* ---- not root: a jail in a user namespace ---- */

#define NOBODY 65534u

/* Forks a child that gives root up as a non-root spaced runs (nobody's uid and gid, no
 * groups, dumpable: a process that changed its uid is not, and its /proc/self/uid_map would
 * be root's to write) and runs fn in it: its exit status, or -1. fn writes into fd. */
static int as_nobody(int (*fn)(int fd), int fd, pid_t *child)
{
    pid_t c = fork();
    if (c < 0)
        return -1;
    if (c == 0) {
        if (setgroups(0, NULL) < 0 || setresgid(NOBODY, NOBODY, NOBODY) < 0 ||
            setresuid(NOBODY, NOBODY, NOBODY) < 0 || prctl(PR_SET_DUMPABLE, 1) < 0)
            _exit(90);
        _exit(fn(fd));
    }
    *child = c;
    return 0;
}

static char ns_stage[] = "/tmp/test_jail_ns_XXXXXX", ns_data[] = "/tmp/test_jail_nsd_XXXXXX";
static int ns_go[2];

/* In the child: `sleep` jailed in a user namespace; its pid written to fd, then it waits for
 * the parent's word and kills it. */
static int userns_sleep(int fd)
{
    char why[256], sleep_bin[PATH_MAX];
    pid_t none = -1;
    if (!sp_jail_supported(why, sizeof why) || !sp_jail_userns() ||
        realpath("/bin/sleep", sleep_bin) == NULL) {
        fprintf(stderr, "userns: %s\n", why);
        (void)!write(fd, &none, sizeof none);
        return 91;
    }
    /* only its own ids */
    if (sp_jail_new(ns_stage, NOBODY + 1, NOBODY) != NULL || errno != EINVAL)
        return 92;
    sp_jail_t *j = sp_jail_new(ns_stage, NOBODY, NOBODY);
    static const char *const links[] = {"/lib", "/lib64"};
    if (j == NULL || sp_jail_bind(j, sleep_bin, 0) < 0 || sp_jail_bind(j, "/usr/lib", 0) < 0 ||
        sp_jail_bind(j, "/usr/lib64", SP_JAIL_OPT) < 0 ||
        sp_jail_mirror_root_links(j, links, 2) < 0 ||
        sp_jail_bind(j, "/dev/null", SP_JAIL_DEV | SP_JAIL_RW) < 0 ||
        sp_jail_bind(j, ns_data, SP_JAIL_RW) < 0 || sp_jail_mount_proc(j) < 0)
        return 93;
    int out = open("/dev/null", O_WRONLY | O_CLOEXEC), pidfd = -1;
    char *argv[] = {sleep_bin, "30", NULL};
    pid_t pid = sp_jail_spawn(j, argv, NULL, out, out, NULL, &pidfd, why, sizeof why);
    if (pid < 0)
        fprintf(stderr, "userns spawn: %s\n", why);
    (void)!write(fd, &pid, sizeof pid);
    char x;
    (void)!read(ns_go[0], &x, 1);
    if (pid > 0) {
        kill(pid, SIGKILL);
        waitpid(pid, NULL, 0);
    }
    sp_jail_free(j);
    return pid > 0 ? 0 : 94;
}

/* As root: jailed by a process that is not root, in a user namespace, checked from here:
 * its uid is that process's (mapped to itself, nothing else mapped), no capabilities,
 * no_new_privs, its own user, mount, pid, ipc, uts and net namespaces, a root holding what was
 * bound and nothing else, only lo, an empty environment. */
static void test_jail_spawn_in_userns(void)
{
    if (geteuid() != 0) {
        printf("  (skipped: root needed, to become nobody)\n");
        return;
    }
    int rep[2];
    REQUIRE(pipe2(rep, O_CLOEXEC) == 0 && pipe2(ns_go, O_CLOEXEC) == 0);
    /* made here, the child's own (the child's memory is a copy: the names are set here) */
    REQUIRE(mkdtemp(ns_stage) != NULL && mkdtemp(ns_data) != NULL);
    REQUIRE(chown(ns_stage, NOBODY, NOBODY) == 0 && chown(ns_data, NOBODY, NOBODY) == 0);
    pid_t c = -1;
    REQUIRE(as_nobody(userns_sleep, rep[1], &c) == 0);
    close(rep[1]);
    pid_t pid = -1;
    REQUIRE(read(rep[0], &pid, sizeof pid) == (ssize_t)sizeof pid);
    close(rep[0]);
    CHECK(pid > 0);
    if (pid > 0) {
        char p[160], st[4096];
        snprintf(p, sizeof p, "/proc/%d/status", (int)pid);
        REQUIRE(read_file(p, st, sizeof st) > 0);
        CHECK(status_has(st, "\nUid:\t65534\t65534\t65534\t65534\n"));
        CHECK(status_has(st, "\nGid:\t65534\t65534\t65534\t65534\n"));
        CHECK(status_has(st, "\nCapEff:\t0000000000000000\n"));
        CHECK(status_has(st, "\nCapPrm:\t0000000000000000\n"));
        CHECK(status_has(st, "\nCapBnd:\t0000000000000000\n"));
        CHECK(status_has(st, "\nNoNewPrivs:\t1\n"));
        static const char *const nss[] = {"user", "mnt", "pid", "ipc", "uts", "net"};
        for (size_t i = 0; i < sizeof nss / sizeof nss[0]; i++)
            CHECK(!same_ns(pid, nss[i]));
        snprintf(p, sizeof p, "/proc/%d/uid_map", (int)pid);
        REQUIRE(read_file(p, st, sizeof st) > 0);
        unsigned a = 0, b = 0, n = 0;
        CHECK(sscanf(st, "%u %u %u", &a, &b, &n) == 3 && a == NOBODY && b == NOBODY && n == 1);
        CHECK(strchr(st, '\n') == st + strlen(st) - 1); /* one line */
        snprintf(p, sizeof p, "/proc/%d/root", (int)pid);
        DIR *dd = opendir(p);
        REQUIRE(dd != NULL);
        struct dirent *de;
        while ((de = readdir(dd)) != NULL)
            if (strcmp(de->d_name, ".") != 0 && strcmp(de->d_name, "..") != 0)
                CHECK(strcmp(de->d_name, "usr") == 0 || strcmp(de->d_name, "lib") == 0 ||
                      strcmp(de->d_name, "lib64") == 0 || strcmp(de->d_name, "dev") == 0 ||
                      strcmp(de->d_name, "tmp") == 0 || strcmp(de->d_name, "bin") == 0 ||
                      strcmp(de->d_name, "proc") == 0);
        closedir(dd);
        snprintf(p, sizeof p, "/proc/%d/root/etc/passwd", (int)pid);
        CHECK(access(p, F_OK) < 0);
        snprintf(p, sizeof p, "/proc/%d/root%s", (int)pid, ns_data);
        CHECK(access(p, F_OK) == 0);
        snprintf(p, sizeof p, "/proc/%d/environ", (int)pid);
        CHECK(read_file(p, st, sizeof st) == 0);
        snprintf(p, sizeof p, "/proc/%d/net/dev", (int)pid);
        REQUIRE(read_file(p, st, sizeof st) > 0);
        CHECK(strstr(st, "lo:") != NULL && strstr(st, "eth") == NULL);
    }
    (void)!write(ns_go[1], "x", 1);
    int ws = 0;
    REQUIRE(waitpid(c, &ws, 0) == c);
    CHECK(WIFEXITED(ws) && WEXITSTATUS(ws) == 0);
    close(ns_go[0]);
    close(ns_go[1]);
    rmdir(ns_data);
    rmdir(ns_stage);
}

/* In the child: QEMU jailed in a user namespace, as it is for a spaced that is not root. */
static int userns_qemu(int fd)
{
    (void)fd;
    char qemu[PATH_MAX];
    if (!find_qemu(qemu))
        return 95;
    return qemu_in_jail(qemu, NOBODY, NOBODY);
}

/* As root (to become nobody), where QEMU is installed: QEMU with its seccomp sandbox and a
 * sealed memfd RAM backend starts and answers in a user namespace's jail. */
static void test_jail_qemu_in_userns(void)
{
    char qemu[PATH_MAX];
    if (geteuid() != 0 || !find_qemu(qemu)) {
        printf("  (skipped: root and /usr/bin/qemu-system-x86_64 needed)\n");
        return;
    }
    pid_t c = -1;
    REQUIRE(as_nobody(userns_qemu, -1, &c) == 0);
    int ws = 0;
    REQUIRE(waitpid(c, &ws, 0) == c);
    if (!WIFEXITED(ws) || WEXITSTATUS(ws) != 0)
        fprintf(stderr, "qemu in a user namespace: status %d\n", ws);
    CHECK(WIFEXITED(ws) && WEXITSTATUS(ws) == 0);
}

int main(void)
{
    test_jail_range_parse();
    test_jail_ids_allocate();
    test_jail_plan_refuses();
    test_jail_spawn_as_root();
    test_jail_qemu_starts();
    test_jail_spawn_in_userns();
    test_jail_qemu_in_userns();
    return check_report("jail");
}
