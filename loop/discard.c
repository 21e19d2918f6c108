/*
 * discard.c - removal off the loop (discard.h): rename into trash/XXXXXX/d, then sp_rm_rf of
 * trash/XXXXXX on a worker.
 */
#include "loop/discard.h"

#include <dirent.h>
#include <errno.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/stat.h>
#include <unistd.h>

#include "base/rmtree.h"

struct discard {
    char dir[PATH_MAX]; /* trash/XXXXXX, holding what was discarded */
};

static void discard_work(sp_work_t *w, void *arg)
{
    (void)w;
    sp_rm_rf(((struct discard *)arg)->dir);
}

static void discard_done(void *arg, bool cancelled)
{
    (void)cancelled; /* the loop is going: what is left is the next start's leftovers */
    free(arg);
}

static int pathf(char *out, size_t n, const char *a, const char *b)
{
    int k = snprintf(out, n, "%s/%s", a, b);
    return k < 0 || (size_t)k >= n ? -1 : 0;
}

/* Queues the removal of dir on a worker, or removes it here when it cannot be queued. */
static void queue(sp_loop_t *loop, const char *dir)
{
    struct discard *x = malloc(sizeof *x);
    if (x != NULL && snprintf(x->dir, sizeof x->dir, "%s", dir) < (int)sizeof x->dir &&
        sp_loop_work(loop, SP_WORK_LONG, discard_work, discard_done, x) != NULL)
        return;
    free(x);
    sp_rm_rf(dir);
}

void sp_discard(sp_loop_t *loop, const char *trash, const char *path)
{
    char dir[PATH_MAX], dst[PATH_MAX];
    struct stat st;
    if (lstat(path, &st) < 0)
        return; /* nothing there */
    if ((mkdir(trash, 0700) == 0 || errno == EEXIST) &&
        pathf(dir, sizeof dir, trash, "XXXXXX") == 0 && mkdtemp(dir) != NULL) {
        if (pathf(dst, sizeof dst, dir, "d") == 0 && rename(path, dst) == 0) {
            queue(loop, dir);
            return;
        }
        rmdir(dir);
    }
    sp_rm_rf(path); /* not movable (another filesystem?): here, as it was */
}

void sp_discard_leftovers(sp_loop_t *loop, const char *trash)
{
    char dir[PATH_MAX];
    DIR *d = opendir(trash);
    if (d == NULL)
        return;
    struct dirent *de;
    while ((de = readdir(d)) != NULL)
        if (de->d_name[0] != '.' && pathf(dir, sizeof dir, trash, de->d_name) == 0)
            queue(loop, dir);
    closedir(d);
}
