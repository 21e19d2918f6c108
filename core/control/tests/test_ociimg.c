/*
 * test_ociimg.c - container image references read Docker's way, the mirror,
 * which registries get plain http, and the start command an image's Entrypoint
 * and Cmd make.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/control/ociimg.h"
#include "tests/check.h"

#define D64 "0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef"

static void ref_is(const char *in, const char *mirror, const char *reg, const char *repo,
                   const char *tag, const char *digest, bool mirrored)
{
    sp_ociimg_ref_t r;
    sp_err_t e = {0};
    int rc = sp_ociimg_parse_ref(in, mirror, &r, &e);
    bool ok = rc == 0 && strcmp(r.registry, reg) == 0 && strcmp(r.repo, repo) == 0 &&
              strcmp(r.tag, tag) == 0 && strcmp(r.digest, digest) == 0 && r.mirrored == mirrored;
    if (!ok)
        fprintf(stderr, "%s -> rc %d %s | %s | %s | %s (%s)\n", in, rc, r.registry, r.repo, r.tag,
                r.digest, e.msg);
    CHECK(ok);
}

static void ref_bad(const char *in, const char *want)
{
    sp_ociimg_ref_t r;
    sp_err_t e = {0};
    int rc = sp_ociimg_parse_ref(in, NULL, &r, &e);
    if (rc == 0 || strstr(e.msg, want) == NULL)
        fprintf(stderr, "%s -> rc %d '%s' (want '%s')\n", in, rc, e.msg, want);
    CHECK(rc < 0 && e.code == SP_EINVAL && strstr(e.msg, want) != NULL);
}

static void test_refs(void)
{
    ref_is("ubuntu", NULL, "docker.io", "library/ubuntu", "latest", "", false);
    ref_is("ubuntu:22.04", NULL, "docker.io", "library/ubuntu", "22.04", "", false);
    ref_is("docker.io/library/debian:12", NULL, "docker.io", "library/debian", "12", "", false);
    ref_is("index.docker.io/org/app", NULL, "docker.io", "org/app", "latest", "", false);
    ref_is("org/app:v1", "mirror.local:5000", "mirror.local:5000", "org/app", "v1", "", true);
    ref_is("ubuntu:22.04", "m:1", "m:1", "library/ubuntu", "22.04", "", true);
    ref_is("127.0.0.1:5000/img", "m:1", "127.0.0.1:5000", "img", "latest", "", false);
    ref_is("docker://localhost/a/b:c", NULL, "localhost", "a/b", "c", "", false);
    ref_is("ghcr.io/o/a@sha256:" D64, NULL, "ghcr.io", "o/a", "", "sha256:" D64, false);
    ref_is("ghcr.io/o/a:t@sha256:" D64, NULL, "ghcr.io", "o/a", "", "sha256:" D64, false);
    ref_bad("", "not an image reference");
    ref_bad("-oops", "not an image reference");
    ref_bad("Ubuntu", "lowercase");
    ref_bad("a/../b", "bad repository");
    ref_bad("a:b c", "bad tag");
    ref_bad("a@sha256:12", "digest");
    ref_bad("reg:5000/a$b", "bad repository");
}

static void test_insecure(void)
{
    CHECK(sp_ociimg_insecure("127.0.0.1:5000", NULL));
    CHECK(sp_ociimg_insecure("localhost:5000", NULL));
    CHECK(sp_ociimg_insecure("[::1]:5000", NULL));
    CHECK(!sp_ociimg_insecure("docker.io", NULL));
    CHECK(!sp_ociimg_insecure("reg.lan:5000", "reg.lan"));
    CHECK(sp_ociimg_insecure("reg.lan:5000", "other:1, reg.lan:5000"));
}

static void test_start_cmd(void)
{
    json_t *ep = json_pack("[s,s]", "/bin/sh", "-c");
    json_t *cmd = json_pack("[s]", "echo 'hi' && sleep 1");
    char *s = sp_ociimg_start_cmd(ep, cmd);
    CHECK(s != NULL && strcmp(s, "/bin/sh -c 'echo '\\''hi'\\'' && sleep 1'") == 0);
    free(s);
    s = sp_ociimg_start_cmd(NULL, cmd);
    CHECK(s != NULL && strcmp(s, "'echo '\\''hi'\\'' && sleep 1'") == 0);
    free(s);
    CHECK(sp_ociimg_start_cmd(NULL, NULL) == NULL);
    json_decref(ep);
    json_decref(cmd);
}

int main(void)
{
    test_refs();
    test_insecure();
    test_start_cmd();
    return check_report("core.ociimg");
}
