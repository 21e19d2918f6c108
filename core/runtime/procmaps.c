/*
 * procmaps.c - a process's memory maps (procmaps.h).
 *
 * Each line of /proc/<pid>/maps is "start-end perms offset major:minor inode [path]"; a line
 * longer than the buffer (a long path) is read in pieces, the rest of it skipped.
 */
#include "core/runtime/procmaps.h"

#include <stdio.h>
#include <string.h>
#include <sys/sysmacros.h>

int sp_procmaps_each(pid_t pid, bool (*fn)(const sp_procmap_t *m, void *arg), void *arg)
{
    char p[64], line[512];
    snprintf(p, sizeof p, "/proc/%d/maps", (int)pid);
    FILE *f = fopen(p, "re");
    if (f == NULL)
        return -1;
    int rc = 0;
    bool whole = true; /* the last piece read ended its line */
    while (rc == 0 && fgets(line, sizeof line, f) != NULL) {
        bool start = whole;
        size_t n = strlen(line);
        whole = n > 0 && line[n - 1] == '\n';
        if (!start)
            continue; /* the rest of a long line */
        if (whole)
            line[n - 1] = '\0';
        unsigned long long lo, hi, off, ino;
        unsigned maj, min;
        char perms[8];
        int at = 0;
        if (sscanf(line, "%llx-%llx %7s %llx %x:%x %llu %n", &lo, &hi, perms, &off, &maj, &min,
                   &ino, &at) < 7 ||
            strlen(perms) < 4)
            continue;
        sp_procmap_t m = {.lo = lo,
                          .hi = hi,
                          .off = off,
                          .dev = makedev(maj, min),
                          .ino = ino,
                          .priv = perms[3] == 'p',
                          .path = at > 0 ? line + at : ""};
        if (fn(&m, arg))
            rc = 1;
    }
    fclose(f);
    return rc;
}
