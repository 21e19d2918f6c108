/*
 * test_cgroup.c - cgroup layout detection from mountinfo text and limit arithmetic.
 * Pure: touches no cgroup file system.
 */
#include <errno.h>
#include <stdio.h>
#include <string.h>

#include "core/runtime/cgroup.h"
#include "tests/check.h"

/* A systemd "hybrid" host: v1 controllers, each alone, plus an empty unified v2 mount. */
static const char hybrid[] =
    "23 1 0:21 / / rw,relatime - overlay overlay rw\n"
    "31 23 0:28 / /sys/fs/cgroup rw,relatime - tmpfs tmpfs rw,mode=755\n"
    "32 31 0:29 / /sys/fs/cgroup/cpu rw,relatime - cgroup cgroup rw,cpu\n"
    "33 31 0:30 / /sys/fs/cgroup/cpuacct rw,relatime - cgroup cgroup rw,cpuacct\n"
    "34 31 0:31 / /sys/fs/cgroup/cpuset rw,relatime - cgroup cgroup rw,cpuset\n"
    "35 31 0:32 / /sys/fs/cgroup/memory rw,relatime - cgroup cgroup rw,memory\n"
    "36 31 0:33 / /sys/fs/cgroup/devices rw,relatime - cgroup cgroup rw,devices\n"
    "39 31 0:36 / /sys/fs/cgroup/pids rw,relatime - cgroup cgroup rw,pids\n"
    "40 31 0:37 / /sys/fs/cgroup/systemd rw,relatime - cgroup cgroup rw,name=systemd\n"
    "41 31 0:38 / /sys/fs/cgroup/unified rw,relatime - cgroup2 cgroup2 rw\n";

static void test_cgroup_hybrid_is_v1(void)
{
    sp_cgroup_mounts_t m;
    sp_cgroup_parse_mountinfo(hybrid, &m);
    CHECK(strcmp(m.v2, "/sys/fs/cgroup/unified") == 0);
    CHECK(strcmp(m.cpu, "/sys/fs/cgroup/cpu") == 0); /* not cpuacct, not cpuset */
    CHECK(strcmp(m.memory, "/sys/fs/cgroup/memory") == 0);
    CHECK(strcmp(m.pids, "/sys/fs/cgroup/pids") == 0);
    CHECK(sp_cgroup_pick(&m, "hugetlb\n") == SP_CGROUP_V1);
    CHECK(sp_cgroup_pick(&m, "") == SP_CGROUP_V1);
    CHECK(sp_cgroup_pick(&m, NULL) == SP_CGROUP_V1);
    /* had the unified mount all three, it would win */
    CHECK(sp_cgroup_pick(&m, "cpu memory pids\n") == SP_CGROUP_V2);
}

/* Older Debian/RHEL: cpu and cpuacct co-mounted, an escaped space in a mount point,
 * optional fields before the separator, no pids hierarchy. */
static void test_cgroup_comounted_and_escaped(void)
{
    static const char text[] =
        "30 25 0:26 / /sys/fs/cgroup/cpu,cpuacct rw,nosuid shared:12 - cgroup cgroup "
        "rw,cpu,cpuacct\n"
        "31 25 0:27 / /srv/my\\040cgroups/memory rw shared:13 master:2 - cgroup cgroup "
        "rw,memory\n"
        "this line is garbage\n"
        "\n"
        "32 25 0:28 / /x rw - cgroup\n";
    sp_cgroup_mounts_t m;
    sp_cgroup_parse_mountinfo(text, &m);
    CHECK(strcmp(m.cpu, "/sys/fs/cgroup/cpu,cpuacct") == 0);
    CHECK(strcmp(m.memory, "/srv/my cgroups/memory") == 0);
    CHECK(m.pids[0] == '\0' && m.v2[0] == '\0');
    CHECK(sp_cgroup_pick(&m, NULL) == SP_CGROUP_V1); /* pids is optional on v1 */
}

static void test_cgroup_pure_v2(void)
{
    static const char text[] =
        "29 23 0:26 / /sys/fs/cgroup rw,nosuid,nodev,noexec,relatime shared:4 - cgroup2 cgroup2 "
        "rw,nsdelegate,memory_recursiveprot\n";
    sp_cgroup_mounts_t m;
    sp_cgroup_parse_mountinfo(text, &m);
    CHECK(strcmp(m.v2, "/sys/fs/cgroup") == 0);
    CHECK(m.cpu[0] == '\0' && m.memory[0] == '\0');
    CHECK(sp_cgroup_pick(&m, "cpuset cpu io memory hugetlb pids rdma misc\n") == SP_CGROUP_V2);
    /* "cpuset" is not "cpu": without cpu delegated there is nothing to use */
    CHECK(sp_cgroup_pick(&m, "cpuset io memory pids\n") == SP_CGROUP_NONE);
    CHECK(sp_cgroup_pick(&m, "") == SP_CGROUP_NONE);
}

static void test_cgroup_none_and_bind_mounts(void)
{
    sp_cgroup_mounts_t m;
    sp_cgroup_parse_mountinfo("", &m);
    CHECK(sp_cgroup_pick(&m, NULL) == SP_CGROUP_NONE);
    sp_cgroup_parse_mountinfo(NULL, &m);
    CHECK(sp_cgroup_pick(&m, NULL) == SP_CGROUP_NONE);
    /* memory alone is not enough for v1 */
    sp_cgroup_parse_mountinfo("35 31 0:32 / /cg/memory rw - cgroup cgroup rw,memory\n", &m);
    CHECK(sp_cgroup_pick(&m, NULL) == SP_CGROUP_NONE);
    /* a bind mount of a subgroup listed first gives way to the hierarchy's root */
    static const char text[] =
        "50 31 0:32 /docker/abc /mnt/sub rw - cgroup cgroup rw,memory\n"
        "51 31 0:32 / /sys/fs/cgroup/memory rw - cgroup cgroup rw,memory\n"
        "52 31 0:32 /other /mnt/other rw - cgroup cgroup rw,memory\n"
        "53 31 0:29 /docker/abc /sys/fs/cgroup/cpu rw - cgroup cgroup rw,cpu\n";
    sp_cgroup_parse_mountinfo(text, &m);
    CHECK(strcmp(m.memory, "/sys/fs/cgroup/memory") == 0);
    CHECK(strcmp(m.cpu, "/sys/fs/cgroup/cpu") == 0); /* a container's view is still used */
}

static void test_cgroup_tokens(void)
{
    CHECK(sp_cgroup_has_token("rw,cpu,cpuacct", "cpu"));
    CHECK(sp_cgroup_has_token("rw,cpu,cpuacct", "cpuacct"));
    CHECK(!sp_cgroup_has_token("rw,cpuacct", "cpu"));
    CHECK(!sp_cgroup_has_token("cpuset io", "cpu"));
    CHECK(sp_cgroup_has_token("cpuset io memory\n", "memory"));
    CHECK(!sp_cgroup_has_token("", "cpu"));
    CHECK(!sp_cgroup_has_token(NULL, "cpu"));
}

static void test_cgroup_limits_from_size(void)
{
    sp_cgroup_limits_t l;
    sp_cgroup_limits(0, 0, 512, &l); /* defaults: 1 vCPU, 256 MiB; TCG overhead */
    CHECK(l.cpu_period_us == 100000u && l.cpu_quota_us == 100000u);
    CHECK(l.mem_bytes == (uint64_t)(256 + 512) << 20);
    CHECK(l.pids_max == 512u);
    sp_cgroup_limits(2, 1024, 128, &l); /* KVM overhead */
    CHECK(l.cpu_quota_us == 200000u);
    CHECK(l.mem_bytes == 1152ull << 20);
    sp_cgroup_limits(8, 16384, 512, &l); /* no 32-bit overflow */
    CHECK(l.cpu_quota_us == 800000u);
    CHECK(l.mem_bytes == 16896ull << 20);
    sp_cgroup_limits(-3, -1, -5, &l);
    CHECK(l.cpu_quota_us == 100000u && l.mem_bytes == 256ull << 20);
}

static void test_cgroup_no_layout(void)
{
    /* without a detected layout nothing is created, and saying so is not an error elsewhere */
    sp_cgroup_limits_t l;
    sp_cgroup_limits(1, 256, 512, &l);
    sp_cgroup_join_t j;
    char why[128];
    errno = 0;
    CHECK(sp_cgroup_vm_create(NULL, "x", &l, &j, why, sizeof why) < 0 && errno == ENOTSUP);
    CHECK(j.n == 0);
    CHECK(sp_cgroup_join(&j) == 0);
    CHECK(!sp_cgroup_vm_exists(NULL, "x"));
    CHECK(sp_cgroup_vm_remove(NULL, "x") == 0);
    char d[64];
    CHECK(sp_cgroup_vm_dir(NULL, "memory", "x", d, sizeof d) < 0);
    uint64_t u;
    CHECK(sp_cgroup_vm_mem_used(NULL, "x", &u) < 0);
    CHECK(sp_cgroup_kind(NULL) == SP_CGROUP_NONE);
    sp_cgroup_destroy(NULL);
}

int main(void)
{
    test_cgroup_hybrid_is_v1();
    test_cgroup_comounted_and_escaped();
    test_cgroup_pure_v2();
    test_cgroup_none_and_bind_mounts();
    test_cgroup_tokens();
    test_cgroup_limits_from_size();
    test_cgroup_no_layout();
    return check_report("cgroup");
}
