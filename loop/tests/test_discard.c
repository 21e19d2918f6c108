/*
 * test_discard.c - loop/discard.h: a discarded tree's path is free when the call returns and
 * the tree is unlinked by a worker while the loop runs; the path can be made again at once;
 * nothing there is nothing; an earlier run's leftovers are swept; a trash on another
 * filesystem falls back to removing in place; a loop destroyed with removals queued leaves
 * them for the next sweep.
 */
#include <dirent.h>
#include <fcntl.h>
#include <limits.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "base/rmtree.h"
#include "loop/discard.h"
#include "tests/check.h"

static char root[256], trash[300];

static bool there(const char *p)
{
    struct stat st;
    return lstat(p, &st) == 0;
}

/* Entries in dir (not . and ..), -1 when it cannot be read. */
static int entries(const char *dir)
{
    DIR *d = opendir(dir);
    if (d == NULL)
        return -1;
    int n = 0;
    struct dirent *de;
    while ((de = readdir(d)) != NULL)
        n += strcmp(de->d_name, ".") != 0 && strcmp(de->d_name, "..") != 0;
    closedir(d);
    return n;
}

/* A VM directory's shape: a RAM file of mb MiB written through, a disk, a socket dir. */
static void make_tree(const char *p, int mb)
{
    char f[PATH_MAX + 32];
    REQUIRE(mkdir(p, 0700) == 0);
    snprintf(f, sizeof f, "%s/mem.ram", p);
    int fd = open(f, O_WRONLY | O_CREAT, 0600);
    REQUIRE(fd >= 0);
    static char buf[1 << 20];
    memset(buf, 0x5a, sizeof buf);
    for (int i = 0; i < mb; i++)
        REQUIRE(write(fd, buf, sizeof buf) == (ssize_t)sizeof buf);
    close(fd);
    snprintf(f, sizeof f, "%s/snapshot", p);
    REQUIRE(mkdir(f, 0700) == 0);
    snprintf(f, sizeof f, "%s/snapshot/devstate", p);
    fd = open(f, O_WRONLY | O_CREAT, 0600);
    REQUIRE(fd >= 0);
    close(fd);
}

/* Runs the loop until trash is empty (or gone); false after ms. */
static bool drain(sp_loop_t *l, int ms)
{
    for (int t = 0; t < ms / 10; t++) {
        if (entries(trash) <= 0)
            return true;
        sp_loop_run_once(l, 10);
    }
    return entries(trash) <= 0;
}

static atomic_int hold = 1;

static void held(sp_work_t *w, void *arg)
{
    (void)w;
    (void)arg;
    while (atomic_load(&hold))
        usleep(1000);
}

static void held_done(void *arg, bool cancelled)
{
    (void)cancelled;
    (*(int *)arg)++;
}

static void test_discard_off_the_loop(void)
{
    sp_loop_t *l = sp_loop_create();
    /* every long-lane thread busy: the removal must wait for one, so the test sees it queued */
    int helds = 0;
    for (int i = 0; i < SP_LOOP_LONG_THREADS; i++)
        REQUIRE(sp_loop_work(l, SP_WORK_LONG, held, held_done, &helds) != NULL);
    char p[PATH_MAX + 8];
    snprintf(p, sizeof p, "%s/vm", root);
    make_tree(p, 64);
    sp_discard(l, trash, p);
    CHECK(!there(p));           /* gone for every reader at once */
    CHECK(entries(trash) == 1); /* whole, waiting for a worker: not removed on the loop */
    make_tree(p, 1);            /* the same path is free for a new VM */
    for (int t = 0; t < 20; t++)
        sp_loop_run_once(l, 10);
    CHECK(entries(trash) == 1);
    atomic_store(&hold, 0);
    CHECK(drain(l, 10000));
    for (int t = 0; t < 500 && helds < SP_LOOP_LONG_THREADS; t++)
        sp_loop_run_once(l, 10);
    CHECK(helds == SP_LOOP_LONG_THREADS);
    CHECK(there(p)); /* the new one is not touched */
    sp_discard(l, trash, p);
    CHECK(!there(p));
    CHECK(drain(l, 10000));
    /* nothing there: nothing happens */
    sp_discard(l, trash, p);
    CHECK(entries(trash) == 0);
    /* a file */
    int fd = open(p, O_WRONLY | O_CREAT, 0600);
    REQUIRE(fd >= 0);
    close(fd);
    sp_discard(l, trash, p);
    CHECK(!there(p));
    CHECK(drain(l, 10000));
    sp_loop_destroy(l);
}

static void test_discard_leftovers(void)
{
    /* what a killed run left: two trees, and a dot entry nobody made (never swept) */
    char p[PATH_MAX + 32];
    snprintf(p, sizeof p, "%s/AbCdEf", trash);
    REQUIRE(mkdir(p, 0700) == 0);
    snprintf(p, sizeof p, "%s/AbCdEf/d", trash);
    make_tree(p, 2);
    snprintf(p, sizeof p, "%s/XyZ123", trash);
    make_tree(p, 1);
    snprintf(p, sizeof p, "%s/.keep", trash);
    REQUIRE(mkdir(p, 0700) == 0);
    sp_loop_t *l = sp_loop_create();
    sp_discard_leftovers(l, trash);
    for (int t = 0; t < 1000 && entries(trash) > 1; t++)
        sp_loop_run_once(l, 10);
    CHECK(entries(trash) == 1 && there(p));
    sp_loop_destroy(l);
    rmdir(p);
    /* no trash at all: nothing to do */
    char none[PATH_MAX + 16];
    snprintf(none, sizeof none, "%s/none", root);
    l = sp_loop_create();
    sp_discard_leftovers(l, none);
    CHECK(!there(none));
    sp_loop_destroy(l);
}

/* The loop goes while removals wait: each job's done still comes (no leak under ASan), and
 * what was not removed is the next sweep's. */
static void test_discard_loop_destroyed(void)
{
    sp_loop_t *l = sp_loop_create();
    char p[PATH_MAX + 16];
    for (int i = 0; i < 8; i++) {
        snprintf(p, sizeof p, "%s/v%d", root, i);
        make_tree(p, 4);
        sp_discard(l, trash, p);
        CHECK(!there(p));
    }
    sp_loop_destroy(l);
    l = sp_loop_create();
    sp_discard_leftovers(l, trash);
    CHECK(drain(l, 10000));
    sp_loop_destroy(l);
}

/* A trash on another filesystem: the tree cannot be renamed there and goes in place. */
static void test_discard_other_filesystem(void)
{
    char other[PATH_MAX] = "/dev/shm/sp-discard-XXXXXX";
    struct stat a, b;
    if (mkdtemp(other) == NULL || stat(other, &a) < 0 || stat(root, &b) < 0 ||
        a.st_dev == b.st_dev) {
        printf("discard: no second filesystem at /dev/shm: fallback case skipped\n");
        if (other[0] != '\0')
            rmdir(other);
        return;
    }
    char p[PATH_MAX + 8], t[PATH_MAX + 8];
    snprintf(p, sizeof p, "%s/vm", root);
    snprintf(t, sizeof t, "%s/trash", other);
    make_tree(p, 1);
    sp_loop_t *l = sp_loop_create();
    sp_discard(l, t, p);
    CHECK(!there(p));
    CHECK(entries(t) == 0); /* the temporary entry made for the move is gone too */
    sp_loop_destroy(l);
    sp_rm_rf(other);
}

int main(void)
{
    snprintf(root, sizeof root, "%s/sp-discard-XXXXXX",
             getenv("TMPDIR") ? getenv("TMPDIR") : "/tmp");
    REQUIRE(mkdtemp(root) != NULL);
    snprintf(trash, sizeof trash, "%s/.trash", root);
    test_discard_off_the_loop();
    test_discard_leftovers();
    test_discard_loop_destroyed();
    test_discard_other_filesystem();
    CHECK(sp_rm_rf(root) == 0);
    return check_report("loop.discard");
}
