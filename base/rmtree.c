/*
 * rmtree.c - removing a directory tree (rmtree.h): nftw, depth first, physical, one
 * filesystem.
 */
#include "base/rmtree.h"

#include <errno.h>
#include <ftw.h>
#include <stdio.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "base/log.h"

static int rm_entry(const char *p, const struct stat *st, int flag, struct FTW *f)
{
    (void)st;
    (void)f;
    int rc = flag == FTW_DP ? rmdir(p) : unlink(p);
    if (rc < 0 && errno != ENOENT)
        sp_log(SP_LOG_WARN, "fs", "cannot remove path=%s err=%s", p, strerror(errno));
    return 0;
}

int sp_rm_rf(const char *path)
{
    /* nftw reports a file or a link itself (FTW_F, FTW_SL) and nothing for a missing path.
     * 16 descriptors at most: deeper trees are walked by reopening, not refused. */
    nftw(path, rm_entry, 16, FTW_DEPTH | FTW_PHYS | FTW_MOUNT);
    struct stat st;
    return lstat(path, &st) < 0 && errno == ENOENT ? 0 : -1;
}
