/*
 * test_procmaps.c - the maps reader on this process: a private map of a memfd (at an offset,
 * and from 0) and a shared map of a file are found with their addresses, offsets, device,
 * inode, privacy and names; a stopping callback ends the walk; a process that is gone is -1.
 */
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "core/runtime/procmaps.h"
#include "tests/check.h"

struct want {
    uint64_t lo;
    sp_procmap_t got;
    char path[256];
    int seen, calls;
};

static bool at(const sp_procmap_t *m, void *arg)
{
    struct want *w = arg;
    w->calls++;
    if (m->lo != w->lo)
        return false;
    w->got = *m;
    snprintf(w->path, sizeof w->path, "%s", m->path);
    w->seen++;
    return true;
}

static bool count(const sp_procmap_t *m, void *arg)
{
    (void)m;
    ++*(int *)arg;
    return false;
}

int main(void)
{
    long pg = sysconf(_SC_PAGESIZE);
    int fd = memfd_create("sp-procmaps-test", 0);
    REQUIRE(fd >= 0 && ftruncate(fd, 4 * pg) == 0);
    struct stat st;
    REQUIRE(fstat(fd, &st) == 0);
    char *priv = mmap(NULL, 2 * pg, PROT_READ | PROT_WRITE, MAP_PRIVATE, fd, 2 * pg);
    char *shared = mmap(NULL, pg, PROT_READ, MAP_SHARED, fd, 0);
    REQUIRE(priv != MAP_FAILED && shared != MAP_FAILED);

    struct want w = {.lo = (uintptr_t)priv};
    CHECK(sp_procmaps_each(getpid(), at, &w) == 1);
    CHECK(w.seen == 1);
    CHECK(w.got.hi == w.lo + 2 * (uint64_t)pg && w.got.off == 2 * (uint64_t)pg && w.got.priv);
    CHECK(w.got.dev == st.st_dev && w.got.ino == (uint64_t)st.st_ino);
    CHECK(strncmp(w.path, "/memfd:sp-procmaps-test", 23) == 0);

    struct want s = {.lo = (uintptr_t)shared};
    CHECK(sp_procmaps_each(getpid(), at, &s) == 1);
    CHECK(s.seen == 1 && !s.got.priv && s.got.off == 0 && s.got.ino == (uint64_t)st.st_ino);

    /* the walk stops at the first true: fewer calls than the maps there are */
    int all = 0;
    CHECK(sp_procmaps_each(getpid(), count, &all) == 0);
    CHECK(all > 3 && s.calls <= all && w.calls <= all);
    struct want none = {.lo = 1}; /* no map starts there: every map is seen, 0 */
    CHECK(sp_procmaps_each(getpid(), at, &none) == 0 && none.seen == 0 && none.calls >= all - 2);

    /* a process that is gone */
    pid_t child = fork();
    if (child == 0)
        _exit(0);
    REQUIRE(child > 0 && waitpid(child, NULL, 0) == child);
    CHECK(sp_procmaps_each(child, count, &all) == -1);

    munmap(priv, 2 * pg);
    munmap(shared, pg);
    close(fd);
    return check_report("core.procmaps");
}
