/*
 * test_tmplbuild.c - spec parsing (code_interpreter, warmup, files), input-hash
 * stability and sensitivity, data-dir layout, the current-build lookup and the import
 * of a version published in a shared snapshot dir.
 * No network, no root.
 */
#include <dirent.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "guest/tmplbuild.h"
#include "tests/check.h"

static const char *HASH = "0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef";

static sp_tmplbuild_spec_t *parse(const char *s, sp_err_t *err)
{
    sp_tmplbuild_spec_t *spec = NULL;
    if (sp_tmplbuild_spec_parse(s, strlen(s), &spec, err) < 0)
        return NULL;
    return spec;
}

static void test_tmplbuild_parses_builtin_base(void)
{
    sp_err_t err = {0};
    size_t len = 0;
    char *text = sp_tmplbuild_spec_load(NULL, "base", &len, &err);
    CHECK(text != NULL);
    if (text == NULL)
        return;
    sp_tmplbuild_spec_t *s = NULL;
    CHECK(sp_tmplbuild_spec_parse(text, len, &s, &err) == 0);
    if (s != NULL) {
        CHECK(strcmp(s->name, "base") == 0);
        CHECK(strcmp(s->suite, "bookworm") == 0);
        CHECK(s->cpu_count == 1 && s->memory_mb == 256 && s->disk_mb == 2048);
        CHECK(s->agent == 1);
        int py = 0, sudo = 0;
        for (size_t i = 0; i < s->n_packages; i++) {
            py |= strcmp(s->packages[i], "python3") == 0;
            sudo |= strcmp(s->packages[i], "sudo") == 0;
        }
        CHECK(py && sudo);
        int pipconf = 0; /* E2B's pip_install on base: pip may install system-wide */
        for (size_t i = 0; i < s->n_files; i++)
            pipconf |= strcmp(s->files[i].path, "/etc/pip.conf") == 0 &&
                       strstr(s->files[i].content, "break-system-packages = true") != NULL;
        CHECK(pipconf);
        CHECK(s->n_users == 1);
        if (s->n_users == 1) {
            CHECK(strcmp(s->users[0].name, "user") == 0 && s->users[0].uid == 1000);
            CHECK(strcmp(s->users[0].home, "/home/user") == 0 && s->users[0].sudo == 1);
        }
    }
    sp_tmplbuild_spec_free(s);
    free(text);
    int found = 0;
    for (const char *const *n = sp_tmplbuild_builtin_names(); *n != NULL; n++)
        found |= strcmp(*n, "base") == 0;
    CHECK(found);
    CHECK(sp_tmplbuild_spec_load(NULL, "nope", NULL, &err) == NULL && err.code == SP_ENOTFOUND);
    CHECK(sp_tmplbuild_spec_load(NULL, "../etc", NULL, &err) == NULL && err.code == SP_EINVAL);
}

static void test_tmplbuild_defaults(void)
{
    sp_err_t err = {0};
    sp_tmplbuild_spec_t *s = parse("{\"name\":\"t1\",\"suite\":\"bookworm\","
                                   "\"users\":[{\"name\":\"bob\",\"uid\":1001}]}",
                                   &err);
    CHECK(s != NULL);
    if (s == NULL)
        return;
    CHECK(strcmp(s->variant, "minbase") == 0 && strcmp(s->hostname, "space") == 0);
    CHECK(s->agent == 1 && s->cpu_count == 1 && s->memory_mb == 256 && s->disk_mb == 2048);
    CHECK(s->n_packages == 0);
    CHECK(strcmp(s->users[0].home, "/home/bob") == 0 &&
          strcmp(s->users[0].shell, "/bin/bash") == 0);
    CHECK(s->users[0].sudo == 0);
    sp_tmplbuild_spec_free(s);
    sp_tmplbuild_spec_free(NULL);
}

#define X_FILES(entry) "{\"name\":\"x\",\"suite\":\"bookworm\",\"files\":[" entry "]}"

static void test_tmplbuild_rejects_bad_specs(void)
{
    static const char *bad[] = {
        "not json",
        "[]",
        "{\"suite\":\"bookworm\"}", /* no name */
        "{\"name\":\"x\"}",         /* no suite */
        "{\"name\":\"Bad Name\",\"suite\":\"bookworm\"}",
        "{\"name\":\"x\",\"suite\":\"bookworm\",\"mirror\":\"m\"}", /* unknown field */
        "{\"name\":\"x\",\"suite\":\"bookworm\",\"packages\":[\"ok\",\"rm -rf\"]}",
        "{\"name\":\"x\",\"suite\":\"bookworm\",\"packages\":\"curl\"}",
        "{\"name\":\"x\",\"suite\":\"bookworm\",\"memory_mb\":1}",
        "{\"name\":\"x\",\"suite\":\"bookworm\",\"agent\":\"yes\"}",
        "{\"name\":\"x\",\"suite\":\"bookworm\",\"users\":[{\"name\":\"u\",\"uid\":0}]}",
        "{\"name\":\"x\",\"suite\":\"bookworm\",\"users\":[{\"name\":\"u\",\"uid\":1000,"
        "\"home\":\"/a:b\"}]}",
        "{\"name\":\"x\",\"suite\":\"bookworm\",\"users\":[{\"name\":\"u\",\"uid\":1000},"
        "{\"name\":\"v\",\"uid\":1000}]}",
        "{\"name\":\"x\",\"name\":\"y\",\"suite\":\"bookworm\"}",
        "{\"name\":\"x\",\"suite\":\"bookworm\",\"code_interpreter\":1}",
        "{\"name\":\"x\",\"suite\":\"bookworm\",\"warmup\":\"/bin/true\"}",
        "{\"name\":\"x\",\"suite\":\"bookworm\",\"warmup\":[]}",
        "{\"name\":\"x\",\"suite\":\"bookworm\",\"warmup\":[\"/bin/true\",1]}",
        "{\"name\":\"x\",\"suite\":\"bookworm\",\"warmup\":[\"\"]}",
        "{\"name\":\"x\",\"suite\":\"bookworm\",\"warmup\":[\"a\\u0000b\"]}",
        "{\"name\":\"x\",\"suite\":\"bookworm\",\"agent\":false,\"warmup\":[\"/bin/true\"]}",
        X_FILES("{}"),
        X_FILES("\"/etc/a\""),
        X_FILES("{\"path\":\"etc/a\",\"content\":\"\"}"),
        X_FILES("{\"path\":\"/etc/../../a\",\"content\":\"\"}"),
        X_FILES("{\"path\":\"/etc/./a\",\"content\":\"\"}"),
        X_FILES("{\"path\":\"/etc//a\",\"content\":\"\"}"),
        X_FILES("{\"path\":\"/etc/a/\",\"content\":\"\"}"),
        X_FILES("{\"path\":\"/\",\"content\":\"\"}"),
        X_FILES("{\"path\":\"/..\",\"content\":\"\"}"),
        X_FILES("{\"path\":\"/etc/a\\nb\",\"content\":\"\"}"),
        X_FILES("{\"path\":\"/etc/a\",\"content\":1}"),
        X_FILES("{\"path\":\"/etc/a\",\"content\":\"\",\"mode\":\"0644\"}"),
        X_FILES("{\"path\":\"/etc/a\",\"content\":\"\",\"mode\":4096}"),
        X_FILES("{\"path\":\"/etc/a\",\"content\":\"\",\"owner\":\"root\"}"),
        "{\"name\":\"x\",\"suite\":\"bookworm\",\"files\":{}}",
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        sp_err_t err = {0};
        sp_tmplbuild_spec_t *s = parse(bad[i], &err);
        if (s != NULL)
            fprintf(stderr, "accepted bad spec %zu: %s\n", i, bad[i]);
        CHECK(s == NULL && err.code == SP_EINVAL && err.msg[0] != '\0');
        sp_tmplbuild_spec_free(s);
    }
    /* more than SP_TMPLBUILD_WARMUP_MAX argv entries */
    char big[1024] = "{\"name\":\"x\",\"suite\":\"bookworm\",\"warmup\":[";
    for (int i = 0; i <= SP_TMPLBUILD_WARMUP_MAX; i++)
        strcat(big, i ? ",\"a\"" : "\"a\"");
    strcat(big, "]}");
    sp_err_t err = {0};
    sp_tmplbuild_spec_t *s = parse(big, &err);
    CHECK(s == NULL && err.code == SP_EINVAL && strstr(err.msg, "warmup") != NULL);
    sp_tmplbuild_spec_free(s);
}

/* "files": the builder writes each into the image; what it is given is checked here, and the
 * base template's pip.conf parses. */
static void test_tmplbuild_files(void)
{
    sp_err_t err = {0};
    sp_tmplbuild_spec_t *s =
        parse("{\"name\":\"t\",\"suite\":\"bookworm\",\"files\":["
              "{\"path\":\"/etc/x.conf\",\"content\":\"a=1\\n\"},"
              "{\"path\":\"/usr/local/bin/run me\",\"content\":\"#!/bin/sh\\n\",\"mode\":493}]}",
              &err);
    CHECK(s != NULL && s->n_files == 2);
    if (s != NULL && s->n_files == 2) {
        CHECK(strcmp(s->files[0].path, "/etc/x.conf") == 0 && s->files[0].mode == 0644 &&
              s->files[0].len == 4 && memcmp(s->files[0].content, "a=1\n", 4) == 0);
        CHECK(strcmp(s->files[1].path, "/usr/local/bin/run me") == 0 && s->files[1].mode == 0755);
        CHECK(strstr(s->canonical, "\"files\":[") != NULL); /* what the hash sees */
    }
    sp_tmplbuild_spec_free(s);
    /* text only: a NUL in the content is refused (the spec is JSON without NULs) */
    s = parse("{\"name\":\"t\",\"suite\":\"bookworm\",\"files\":["
              "{\"path\":\"/a\",\"content\":\"x\\u0000y\"}]}",
              &err);
    CHECK(s == NULL && err.code == SP_EINVAL);
    sp_tmplbuild_spec_free(s);
    /* bounds: SP_TMPLBUILD_FILES_MAX entries, SP_TMPLBUILD_FILE_BYTES of content */
    size_t cap = 64 + (SP_TMPLBUILD_FILES_MAX + 1) * 40 + SP_TMPLBUILD_FILE_BYTES + 64;
    char *big = malloc(cap);
    CHECK(big != NULL);
    if (big == NULL)
        return;
    strcpy(big, "{\"name\":\"t\",\"suite\":\"bookworm\",\"files\":[");
    for (int i = 0; i <= SP_TMPLBUILD_FILES_MAX; i++)
        sprintf(big + strlen(big), "%s{\"path\":\"/f%d\",\"content\":\"\"}", i ? "," : "", i);
    strcat(big, "]}");
    s = parse(big, &err);
    CHECK(s == NULL && err.code == SP_EINVAL && strstr(err.msg, "files") != NULL);
    sp_tmplbuild_spec_free(s);
    strcpy(big,
           "{\"name\":\"t\",\"suite\":\"bookworm\",\"files\":[{\"path\":\"/f\",\"content\":\"");
    size_t at = strlen(big);
    memset(big + at, 'a', SP_TMPLBUILD_FILE_BYTES + 1);
    strcpy(big + at + SP_TMPLBUILD_FILE_BYTES + 1, "\"}]}");
    s = parse(big, &err);
    CHECK(s == NULL && err.code == SP_EINVAL && strstr(err.msg, "content") != NULL);
    sp_tmplbuild_spec_free(s);
    strcpy(big + at + SP_TMPLBUILD_FILE_BYTES, "\"}]}"); /* exactly the limit: accepted */
    s = parse(big, &err);
    CHECK(s != NULL && s->n_files == 1 && s->files[0].len == SP_TMPLBUILD_FILE_BYTES);
    sp_tmplbuild_spec_free(s);
    free(big);
}

static void test_tmplbuild_code_interpreter_and_warmup(void)
{
    sp_err_t err = {0};
    sp_tmplbuild_spec_t *s = parse("{\"name\":\"t\",\"suite\":\"bookworm\"}", &err);
    CHECK(s != NULL && s->code_interpreter == 0 && s->warmup == NULL && s->n_warmup == 0);
    sp_tmplbuild_spec_free(s);
    s = parse("{\"name\":\"t\",\"suite\":\"bookworm\",\"code_interpreter\":true,"
              "\"warmup\":[\"/usr/local/bin/space-code\",\"start\",\"--warm\"]}",
              &err);
    CHECK(s != NULL);
    if (s == NULL)
        return;
    CHECK(s->code_interpreter == 1 && s->n_warmup == 3);
    CHECK(strcmp(s->warmup[0], "/usr/local/bin/space-code") == 0 &&
          strcmp(s->warmup[2], "--warm") == 0);
    CHECK(strstr(s->canonical, "\"warmup\":[") != NULL); /* what the hash sees */
    sp_tmplbuild_spec_free(s);
}

static void hash_of(const char *json, const char *agent, const char *kver, char out[65])
{
    sp_err_t err = {0};
    sp_tmplbuild_spec_t *s = parse(json, &err);
    CHECK(s != NULL);
    if (s == NULL) {
        out[0] = '\0';
        return;
    }
    sp_tmplbuild_input_hash(s, agent, kver, out);
    sp_tmplbuild_spec_free(s);
}

static void test_tmplbuild_hash_stable_and_sensitive(void)
{
    char a[65], b[65], c[65], d[65], e[65], f[65];
    const char *agent = "aa00aa00aa00aa00aa00aa00aa00aa00aa00aa00aa00aa00aa00aa00aa00aa00";
    hash_of("{\"name\":\"t\",\"suite\":\"bookworm\",\"packages\":[\"curl\"]}", agent, "k1", a);
    /* same spec, other whitespace and key order: same hash */
    hash_of("{ \"packages\" : [ \"curl\" ],\n  \"suite\": \"bookworm\", \"name\": \"t\" }", agent,
            "k1", b);
    CHECK(strlen(a) == 64 && strcmp(a, b) == 0);
    hash_of("{\"name\":\"t\",\"suite\":\"bookworm\",\"packages\":[\"curl\",\"git\"]}", agent, "k1",
            c);
    CHECK(strcmp(a, c) != 0); /* a package changes it */
    hash_of("{\"name\":\"t\",\"suite\":\"bookworm\",\"packages\":[\"curl\"]}",
            "bb00aa00aa00aa00aa00aa00aa00aa00aa00aa00aa00aa00aa00aa00aa00aa00", "k1", d);
    CHECK(strcmp(a, d) != 0); /* the agent changes it */
    hash_of("{\"name\":\"t\",\"suite\":\"bookworm\",\"packages\":[\"curl\"]}", agent, "k2", e);
    CHECK(strcmp(a, e) != 0); /* the kernel changes it */
    hash_of("{\"name\":\"t\",\"suite\":\"bookworm\",\"packages\":[\"curl\"],\"disk_mb\":4096}",
            agent, "k1", f);
    CHECK(strcmp(a, f) != 0); /* any spec field changes it */
    hash_of("{\"name\":\"t\",\"suite\":\"bookworm\",\"packages\":[\"curl\"]}", agent, "k1", b);
    CHECK(strcmp(a, b) == 0); /* repeatable */
    hash_of("{\"name\":\"t\",\"suite\":\"bookworm\",\"packages\":[\"curl\"],"
            "\"code_interpreter\":true}",
            agent, "k1", c);
    CHECK(strcmp(a, c) != 0); /* the code daemon changes it */
    hash_of("{\"name\":\"t\",\"suite\":\"bookworm\",\"packages\":[\"curl\"],"
            "\"warmup\":[\"/bin/true\"]}",
            agent, "k1", d);
    hash_of("{\"name\":\"t\",\"suite\":\"bookworm\",\"packages\":[\"curl\"],"
            "\"warmup\":[\"/bin/false\"]}",
            agent, "k1", e);
    CHECK(strcmp(a, d) != 0 && strcmp(d, e) != 0); /* so does the warmup command */
}

static void test_tmplbuild_path_layout(void)
{
    sp_err_t err = {0};
    sp_tmplbuild_paths_t p;
    CHECK(sp_tmplbuild_paths("/var/lib/space", "base", HASH, "6.1.0-57-amd64_6.1.192-3", &p,
                             &err) == 0);
    char want[512];
    snprintf(want, sizeof want, "/var/lib/space/templates/base/%s", HASH);
    CHECK(strcmp(p.build_dir, want) == 0);
    snprintf(want, sizeof want, "/var/lib/space/templates/base/%s/rootfs.qcow2", HASH);
    CHECK(strcmp(p.rootfs, want) == 0);
    snprintf(want, sizeof want, "/var/lib/space/templates/base/%s/manifest.json", HASH);
    CHECK(strcmp(p.manifest, want) == 0);
    CHECK(strcmp(p.kernel, "/var/lib/space/images/kernel/6.1.0-57-amd64_6.1.192-3/vmlinux") == 0);
    CHECK(sp_tmplbuild_paths("/d", "../x", HASH, "k", &p, &err) < 0 && err.code == SP_EINVAL);
    CHECK(sp_tmplbuild_paths("/d", "base", "short", "k", &p, &err) < 0);
    CHECK(sp_tmplbuild_paths("/d", "base", HASH, "../k", &p, &err) < 0);
}

static void test_tmplbuild_current_reads_manifest(void)
{
    char dir[] = "/tmp/test_tmplbuild.XXXXXX";
    CHECK(mkdtemp(dir) != NULL);
    sp_err_t err = {0};
    sp_tmplbuild_paths_t p;
    CHECK(sp_tmplbuild_current(dir, "base", &p, &err) < 0 && err.code == SP_ENOTFOUND);

    char path[512];
    snprintf(path, sizeof path, "%s/templates", dir);
    mkdir(path, 0755);
    snprintf(path, sizeof path, "%s/templates/base", dir);
    mkdir(path, 0755);
    snprintf(path, sizeof path, "%s/templates/base/%s", dir, HASH);
    mkdir(path, 0755);
    snprintf(path, sizeof path, "%s/templates/base/%s/manifest.json", dir, HASH);
    FILE *f = fopen(path, "w");
    CHECK(f != NULL);
    if (f != NULL) {
        fprintf(f,
                "{\"name\":\"base\",\"hash\":\"%s\",\"kernel_version\":\"kv\","
                "\"initramfs\":\"images/initramfs-00.img\",\"cpu_count\":1,"
                "\"memory_mb\":256,\"disk_mb\":2048,\"code_interpreter\":true,"
                "\"warmup\":[\"/bin/true\"]}",
                HASH);
        fclose(f);
    }
    snprintf(path, sizeof path, "%s/templates/base/current", dir);
    CHECK(symlink(HASH, path) == 0);
    CHECK(sp_tmplbuild_current(dir, "base", &p, &err) == 0);
    char want[512];
    snprintf(want, sizeof want, "%s/images/initramfs-00.img", dir);
    CHECK(strcmp(p.initramfs, want) == 0);
    snprintf(want, sizeof want, "%s/images/kernel/kv/vmlinux", dir);
    CHECK(strcmp(p.kernel, want) == 0);
    CHECK(strcmp(p.hash, HASH) == 0 && p.memory_mb == 256 && p.disk_mb == 2048);
    CHECK(p.code_interpreter == 1 && p.warmup == 1);

    /* a templates dir overrides the built-in specs */
    snprintf(path, sizeof path, "%s/specs", dir);
    mkdir(path, 0755);
    snprintf(path, sizeof path, "%s/specs/mine", dir);
    mkdir(path, 0755);
    snprintf(path, sizeof path, "%s/specs/mine/template.json", dir);
    f = fopen(path, "w");
    if (f != NULL) {
        fputs("{\"name\":\"mine\",\"suite\":\"bookworm\"}", f);
        fclose(f);
    }
    snprintf(path, sizeof path, "%s/specs", dir);
    char *text = sp_tmplbuild_spec_load(path, "mine", NULL, &err);
    CHECK(text != NULL && strstr(text, "\"mine\"") != NULL);
    free(text);

    /* sha256("abc") */
    snprintf(path, sizeof path, "%s/abc", dir);
    f = fopen(path, "w");
    if (f != NULL) {
        fputs("abc", f);
        fclose(f);
    }
    char h[65];
    CHECK(sp_tmplbuild_file_sha256(path, h, &err) == 0 &&
          strcmp(h, "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad") == 0);

    char cmd[600];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", dir);
    CHECK(system(cmd) == 0);
}

static void put(const char *path, const char *text)
{
    FILE *f = fopen(path, "w");
    CHECK(f != NULL);
    if (f != NULL) {
        fputs(text, f);
        fclose(f);
    }
}

static void mkdirs(const char *root, const char *rel)
{
    char p[512];
    snprintf(p, sizeof p, "%s/%s", root, rel);
    for (char *s = p + strlen(root) + 1; *s; s++)
        if (*s == '/') {
            *s = '\0';
            mkdir(p, 0755);
            *s = '/';
        }
    mkdir(p, 0755);
}

/* A version published in a shared dir, imported into a data dir that has none of it. */
static void test_tmplbuild_import_from_shared_dir(void)
{
    char root[] = "/tmp/test_tmplbuild_imp.XXXXXX";
    CHECK(mkdtemp(root) != NULL);
    char shared[200], data[200], p[1024], m[1024];
    snprintf(shared, sizeof shared, "%s/shared", root);
    snprintf(data, sizeof data, "%s/data", root);
    mkdir(shared, 0755);
    mkdir(data, 0755);
    sp_err_t err = {0};
    sp_tmplbuild_paths_t tp;
    /* nothing published */
    CHECK(sp_tmplbuild_import(data, shared, "web", HASH, &err) < 0 && err.code == SP_ENOTFOUND);
    CHECK(sp_tmplbuild_import(data, shared, "../x", HASH, &err) < 0 && err.code == SP_EINVAL);
    CHECK(sp_tmplbuild_import(data, shared, "web", "abc", &err) < 0 && err.code == SP_EINVAL);

    char vdir[100];
    snprintf(vdir, sizeof vdir, "templates/web/%s", HASH);
    mkdirs(shared, vdir);
    mkdirs(shared, "images/kernel/kv");
    snprintf(p, sizeof p, "%s/images/kernel/kv/vmlinux", shared);
    put(p, "kernel");
    snprintf(p, sizeof p, "%s/images/initramfs-00.img", shared);
    put(p, "initramfs");
    snprintf(p, sizeof p, "%s/%s/rootfs.qcow2", shared, vdir);
    put(p, "rootfs");
    /* a manifest naming another version, then one naming a path out of the data dir */
    snprintf(p, sizeof p, "%s/%s/manifest.json", shared, vdir);
    snprintf(m, sizeof m,
             "{\"name\":\"web\",\"hash\":\"%.63s0\",\"kernel_version\":\"kv\","
             "\"initramfs\":\"images/initramfs-00.img\"}",
             HASH);
    put(p, m);
    CHECK(sp_tmplbuild_import(data, shared, "web", HASH, &err) < 0 && err.code == SP_EINTERNAL);
    snprintf(m, sizeof m,
             "{\"name\":\"web\",\"hash\":\"%s\",\"kernel_version\":\"kv\","
             "\"initramfs\":\"../../etc/x\"}",
             HASH);
    put(p, m);
    CHECK(sp_tmplbuild_import(data, shared, "web", HASH, &err) < 0 && err.code == SP_EINTERNAL);
    snprintf(p, sizeof p, "%s/templates/web/%s", data, HASH);
    struct stat st;
    CHECK(stat(p, &st) < 0); /* nothing half made */

    snprintf(p, sizeof p, "%s/%s/manifest.json", shared, vdir);
    snprintf(m, sizeof m,
             "{\"name\":\"web\",\"hash\":\"%s\",\"kernel_version\":\"kv\","
             "\"initramfs\":\"images/initramfs-00.img\",\"memory_mb\":512}",
             HASH);
    put(p, m);
    char ver[100];
    snprintf(ver, sizeof ver, "web@%s", HASH);
    CHECK(sp_tmplbuild_current(data, ver, &tp, &err) < 0 && err.code == SP_ENOTFOUND);
    CHECK(sp_tmplbuild_import(data, shared, "web", HASH, &err) == 0);
    CHECK(sp_tmplbuild_current(data, ver, &tp, &err) == 0 && tp.memory_mb == 512);
    /* its image and the kernel and initramfs this data dir lacked are the published files */
    struct stat a, b;
    snprintf(p, sizeof p, "%s/%s/rootfs.qcow2", shared, vdir);
    CHECK(stat(tp.rootfs, &a) == 0 && stat(p, &b) == 0 && a.st_ino == b.st_ino);
    snprintf(p, sizeof p, "%s/images/kernel/kv/vmlinux", shared);
    CHECK(stat(tp.kernel, &a) == 0 && stat(p, &b) == 0 && a.st_ino == b.st_ino);
    CHECK(stat(tp.initramfs, &a) == 0);
    /* again: here already; no leftover temporary directory */
    CHECK(sp_tmplbuild_import(data, shared, "web", HASH, &err) == 0);
    snprintf(p, sizeof p, "%s/templates/web", data);
    int entries = 0;
    DIR *d = opendir(p);
    for (struct dirent *e; d != NULL && (e = readdir(d)) != NULL;)
        entries += e->d_name[0] != '.';
    if (d != NULL)
        closedir(d);
    CHECK(entries == 1);
    char cmd[700];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", root);
    CHECK(system(cmd) == 0);
}

int main(void)
{
    test_tmplbuild_parses_builtin_base();
    test_tmplbuild_defaults();
    test_tmplbuild_rejects_bad_specs();
    test_tmplbuild_files();
    test_tmplbuild_code_interpreter_and_warmup();
    test_tmplbuild_hash_stable_and_sensitive();
    test_tmplbuild_path_layout();
    test_tmplbuild_current_reads_manifest();
    test_tmplbuild_import_from_shared_dir();
    return check_report("tmplbuild");
}
