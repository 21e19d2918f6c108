/*
 * test_cgroup.c - the workload cgroup's limits (agent/cgroup.c) for guests of every size: a
 * command's memory limit stays below what was available at boot by a headroom (32 MiB, or a
 * sixteenth of a large guest) and never under half the guest, all commands together stay
 * below it by half that, the task limit grows with RAM from a floor, and one command leaves
 * the others room. The groups themselves are checked
 * in a real guest by e2e.escape's fork and memory bombs.
 */
#include <stdint.h>

#include "agent/cgroup.h"
#include "tests/check.h"

#define MIB (1024ull * 1024ull)

int main(void)
{
    static const uint64_t sizes_mib[] = {64, 128, 256, 257, 512, 1024, 2048, 8192, 65536};
    uint64_t last_mem = 0, last_pids = 0;
    for (size_t i = 0; i < sizeof(sizes_mib) / sizeof(sizes_mib[0]); i++) {
        uint64_t total = sizes_mib[i] * MIB;
        /* a guest as measured: about a fifth in use at boot (kernel, slab, agent) */
        uint64_t avail = total - total / 5;
        sp_cgroup_limits_t l = sp_cgroup_limits(total, avail);
        uint64_t headroom = total / 16 < 32 * MIB ? 32 * MIB : total / 16;
        CHECK(l.cmd_memory_max < avail);
        uint64_t want = avail - headroom < total / 2 ? total / 2 : avail - headroom;
        CHECK(l.cmd_memory_max == want);
        CHECK(l.cmd_memory_max >= total / 2);
        /* all commands together: under what was available, above one command by half the
         * headroom */
        CHECK(l.memory_max == avail - headroom / 2);
        CHECK(l.memory_max < avail && l.memory_max > l.cmd_memory_max);
        CHECK(l.pids_max >= 1024);
        /* one command leaves the others an eighth of the tasks */
        CHECK(l.cmd_pids_max < l.pids_max && l.pids_max - l.cmd_pids_max >= l.pids_max / 8);
        CHECK(l.cmd_memory_max > last_mem);
        CHECK(l.pids_max >= last_pids);
        last_mem = l.cmd_memory_max;
        last_pids = l.pids_max;
    }
    /* the guest measured under TCG: 206 MiB total, 167 MiB available at boot */
    CHECK(sp_cgroup_limits(210888 * 1024ull, 171200 * 1024ull).cmd_memory_max ==
          171200 * 1024ull - 32 * MIB);
    /* a guest booted nearly full, or reporting more available than it has */
    CHECK(sp_cgroup_limits(256 * MIB, 8 * MIB).cmd_memory_max == 128 * MIB);
    CHECK(sp_cgroup_limits(256 * MIB, 8 * MIB).memory_max == 128 * MIB);
    CHECK(sp_cgroup_limits(256 * MIB, 0).memory_max == 128 * MIB);
    CHECK(sp_cgroup_limits(256 * MIB, 0).cmd_memory_max == 128 * MIB);
    CHECK(sp_cgroup_limits(256 * MIB, 512 * MIB).cmd_memory_max == 224 * MIB);
    CHECK(sp_cgroup_limits(512 * MIB, 400 * MIB).pids_max == 2048);
    CHECK(sp_cgroup_limits(8192 * MIB, 8000 * MIB).pids_max == 32768);
    CHECK(sp_cgroup_limits(128 * MIB, 100 * MIB).pids_max == 1024);
    return check_report("agent.cgroup");
}
