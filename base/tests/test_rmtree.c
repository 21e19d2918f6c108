/*
 * test_rmtree.c - base/rmtree.h: a tree goes whole, deeper than the walk's descriptors;
 * symbolic links go, never what they point at; a file, a link and a missing path; a mount
 * point below is never crossed (checked when the test may mount).
 */
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mount.h>
#include <sys/stat.h>
#include <unistd.h>

#include "base/rmtree.h"
#include "tests/check.h"

static char root[256];

static void put(const char *rel, const char *data)
{
    char p[PATH_MAX];
    snprintf(p, sizeof p, "%s/%s", root, rel);
    int fd = open(p, O_WRONLY | O_CREAT | O_TRUNC, 0600);
    REQUIRE(fd >= 0);
    REQUIRE(write(fd, data, strlen(data)) == (ssize_t)strlen(data));
    close(fd);
}

static void dir(const char *rel)
{
    char p[PATH_MAX];
    snprintf(p, sizeof p, "%s/%s", root, rel);
    REQUIRE(mkdir(p, 0700) == 0);
}

static bool there(const char *rel)
{
    char p[PATH_MAX];
    struct stat st;
    snprintf(p, sizeof p, "%s/%s", root, rel);
    return lstat(p, &st) == 0;
}

static int rm(const char *rel)
{
    char p[PATH_MAX];
    snprintf(p, sizeof p, "%s/%s", root, rel);
    return sp_rm_rf(p);
}

static void test_rmtree_tree_and_links(void)
{
    dir("outside");
    put("outside/keep", "keep");
    dir("t");
    dir("t/a");
    dir("t/a/b");
    put("t/a/b/f", "x");
    put("t/a/g", "y");
    dir("t/ro");
    put("t/ro/f", "z");
    char p[PATH_MAX], q[PATH_MAX];
    snprintf(p, sizeof p, "%s/t/ro", root);
    chmod(p, 0500);
    snprintf(p, sizeof p, "%s/outside", root);
    snprintf(q, sizeof q, "%s/t/dirlink", root);
    REQUIRE(symlink(p, q) == 0);
    snprintf(p, sizeof p, "%s/outside/keep", root);
    snprintf(q, sizeof q, "%s/t/a/filelink", root);
    REQUIRE(symlink(p, q) == 0);
    snprintf(q, sizeof q, "%s/t/dangling", root);
    REQUIRE(symlink("/nonexistent/x", q) == 0);
    CHECK(rm("t") == 0);
    CHECK(!there("t"));
    CHECK(there("outside/keep")); /* links went, not what they point at */

    /* deeper than the walk's 16 descriptors */
    char rel[PATH_MAX] = "deep";
    dir(rel);
    for (int i = 0; i < 40; i++) {
        strcat(rel, "/d");
        dir(rel);
    }
    strcat(rel, "/f");
    put(rel, "deep");
    CHECK(rm("deep") == 0);
    CHECK(!there("deep"));

    /* a file, a link to a directory (the link goes, the directory stays), nothing */
    put("file", "f");
    CHECK(rm("file") == 0 && !there("file"));
    snprintf(p, sizeof p, "%s/outside", root);
    snprintf(q, sizeof q, "%s/link", root);
    REQUIRE(symlink(p, q) == 0);
    CHECK(rm("link") == 0 && !there("link") && there("outside/keep"));
    CHECK(rm("missing") == 0);
    CHECK(rm("outside") == 0 && !there("outside"));
}

/* A filesystem mounted below the tree is not crossed: what is in it stays. Root only (the
 * tests run as root in CI); skipped, and said so, otherwise. */
static void test_rmtree_stays_on_its_filesystem(void)
{
    dir("m");
    dir("m/mnt");
    char p[PATH_MAX];
    snprintf(p, sizeof p, "%s/m/mnt", root);
    if (mount("rmtree-test", p, "tmpfs", 0, "size=1m") < 0) {
        printf("rmtree: cannot mount a tmpfs (%s): mount point case skipped\n", strerror(errno));
        rm("m");
        return;
    }
    put("m/mnt/inside", "i");
    put("m/f", "f");
    CHECK(rm("m") < 0); /* m/mnt could not go: it is a mount point */
    CHECK(!there("m/f"));
    CHECK(there("m/mnt/inside"));
    REQUIRE(umount(p) == 0);
    CHECK(rm("m") == 0 && !there("m"));
}

int main(void)
{
    snprintf(root, sizeof root, "%s/sp-rmtree-XXXXXX",
             getenv("TMPDIR") ? getenv("TMPDIR") : "/tmp");
    REQUIRE(mkdtemp(root) != NULL);
    test_rmtree_tree_and_links();
    test_rmtree_stays_on_its_filesystem();
    CHECK(sp_rm_rf(root) == 0);
    return check_report("base.rmtree");
}
