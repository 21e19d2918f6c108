/*
 * ociimg.c - container images into hidden templates (ociimg.h): the reference,
 * the tools (skopeo, umoci, mkfs.ext4, qemu-img) run as child processes, the
 * unpacked tree made bootable inside its own root.
 */
#include "core/control/ociimg.h"

#include <ctype.h>
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <ftw.h>
#include <limits.h>
#include <linux/openat2.h>
#include <poll.h>
#include <signal.h>
#include <sodium.h>
#include <spawn.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "base/buf.h"
#include "base/rmtree.h"
#include "core/control/tarcheck.h"
#include "guest/tmplbuild.h"

extern char **environ;

#define OUT_MAX (8u << 20)      /* bytes of a tool's output kept (inspect's manifest) */
#define IMPORTER "space-oci-v1" /* bump when the bootable tree changes */
#define USER_NAME "user"

bool sp_ociimg_insecure(const char *registry, const char *insecure)
{
    char host[256];
    snprintf(host, sizeof host, "%s", registry);
    if (host[0] == '[') { /* [::1]:port */
        char *e = strchr(host, ']');
        if (e != NULL)
            *e = '\0';
        if (strcmp(host + 1, "::1") == 0)
            return true;
    } else {
        char *c = strchr(host, ':');
        if (c != NULL)
            *c = '\0';
        if (strcmp(host, "localhost") == 0 || strncmp(host, "127.", 4) == 0)
            return true;
    }
    for (const char *p = insecure; p != NULL && *p;) {
        const char *e = strchr(p, ',');
        size_t n = e ? (size_t)(e - p) : strlen(p);
        while (n > 0 && isspace((unsigned char)*p))
            p++, n--;
        while (n > 0 && isspace((unsigned char)p[n - 1]))
            n--;
        if (n > 0 && (n == strlen(registry) && strncmp(p, registry, n) == 0))
            return true;
        p = e ? e + 1 : p + n;
    }
    return false;
}

/* One word, quoted for /bin/sh when it needs it. */
static void sh_word(sp_buf_t *b, const char *w)
{
    bool plain = w[0] != '\0';
    for (const char *p = w; *p && plain; p++)
        plain = isalnum((unsigned char)*p) || strchr("/._-=:,+@%", *p) != NULL;
    if (plain) {
        sp_buf_str(b, w);
        return;
    }
    sp_buf_str(b, "'");
    for (const char *p = w; *p; p++) {
        if (*p == '\'')
            sp_buf_str(b, "'\\''");
        else
            sp_buf_add(b, p, 1);
    }
    sp_buf_str(b, "'");
}

char *sp_ociimg_start_cmd(const json_t *entrypoint, const json_t *cmd)
{
    sp_buf_t b = SP_BUF_INIT;
    const json_t *parts[2] = {entrypoint, cmd};
    for (int k = 0; k < 2; k++) {
        size_t i;
        json_t *v;
        if (!json_is_array(parts[k]))
            continue;
        json_array_foreach((json_t *)parts[k], i, v)
        {
            if (!json_is_string(v))
                continue;
            if (b.len > 0)
                sp_buf_str(&b, " ");
            sh_word(&b, json_string_value(v));
        }
    }
    char *s = b.len > 0 && !b.oom ? strdup(sp_buf_cstr(&b)) : NULL;
    sp_buf_free(&b);
    return s;
}

/* ---- the import's state ---- */

struct imp {
    const sp_ociimg_opts_t *o;
    const sp_work_t *w;
    sp_ociimg_result_t *out;
    sp_err_t *err;
    char scratch[PATH_MAX]; /* <data-dir>/tmp/oci-XXXXXX: auth file, layout, tree
                             */
    char authfile[PATH_MAX];
    bool insecure;
    sp_ociimg_ref_t ref;
    char src[700]; /* docker://registry/repo:tag or @digest */
};

static void note(struct imp *m, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void note(struct imp *m, const char *fmt, ...)
{
    char line[1024];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(line, sizeof line, fmt, ap);
    va_end(ap);
    json_array_append_new(m->out->log, json_string(line));
}

static int pathf(char *out, size_t n, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
static int pathf(char *out, size_t n, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    int k = vsnprintf(out, n, fmt, ap);
    va_end(ap);
    return k < 0 || (size_t)k >= n ? -1 : 0;
}

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
}

/* Runs argv (stdin /dev/null), its stdout and stderr into *outb (at most
 * OUT_MAX bytes; may be NULL). Killed when the job is cancelled. Returns its
 * exit status (128+signal when killed), -1 when it could not start. */
static int run(struct imp *m, char *const argv[], sp_buf_t *outb)
{
    int pfd[2];
    if (pipe2(pfd, O_CLOEXEC) < 0)
        return -1;
    posix_spawn_file_actions_t fa;
    posix_spawnattr_t at;
    posix_spawn_file_actions_init(&fa);
    posix_spawnattr_init(&at);
    posix_spawn_file_actions_addopen(&fa, 0, "/dev/null", O_RDONLY, 0);
    posix_spawn_file_actions_adddup2(&fa, pfd[1], 1);
    posix_spawn_file_actions_adddup2(&fa, pfd[1], 2);
    sigset_t none, all;
    sigemptyset(&none);
    sigfillset(&all);
    sigdelset(&all, SIGKILL);
    sigdelset(&all, SIGSTOP);
    posix_spawnattr_setsigmask(&at, &none); /* workers block every signal */
    posix_spawnattr_setsigdefault(&at, &all);
    posix_spawnattr_setflags(&at, POSIX_SPAWN_SETSIGMASK | POSIX_SPAWN_SETSIGDEF);
    pid_t pid;
    int rc = posix_spawnp(&pid, argv[0], &fa, &at, argv, environ);
    posix_spawn_file_actions_destroy(&fa);
    posix_spawnattr_destroy(&at);
    close(pfd[1]);
    if (rc != 0) {
        close(pfd[0]);
        errno = rc;
        return -1;
    }
    bool killed = false;
    for (;;) {
        if (!killed && m->w != NULL && sp_work_cancelled(m->w)) {
            kill(pid, SIGKILL);
            killed = true;
        }
        struct pollfd p = {.fd = pfd[0], .events = POLLIN};
        int k = poll(&p, 1, 200);
        if (k < 0 && errno != EINTR)
            break;
        if (k <= 0)
            continue;
        char buf[16384];
        ssize_t r = read(pfd[0], buf, sizeof buf);
        if (r <= 0)
            break;
        if (outb != NULL && outb->len + (size_t)r <= OUT_MAX)
            sp_buf_add(outb, buf, (size_t)r);
    }
    close(pfd[0]);
    int st = 0;
    while (waitpid(pid, &st, 0) < 0 && errno == EINTR)
        ;
    return WIFEXITED(st) ? WEXITSTATUS(st) : 128 + (WIFSIGNALED(st) ? WTERMSIG(st) : 0);
}

/* The end of a tool's output, one line, for an error message. */
static const char *tail_of(sp_buf_t *b, char *out, size_t n)
{
    const char *s = b->len > 0 ? sp_buf_cstr(b) : "";
    size_t len = strlen(s);
    while (len > 0 && isspace((unsigned char)s[len - 1]))
        len--;
    size_t from = len > n - 1 ? len - (n - 1) : 0;
    const char *nl = NULL;
    for (size_t i = len; i > from; i--)
        if (s[i - 1] == '\n') {
            nl = s + i;
            break;
        }
    if (nl != NULL)
        from = (size_t)(nl - s);
    snprintf(out, n, "%.*s", (int)(len - from), s + from);
    for (char *p = out; *p; p++)
        if (*p == '\n' || *p == '\r')
            *p = ' ';
    return out;
}

static bool has(const char *hay, const char *needle)
{
    return strstr(hay, needle) != NULL;
}

/* skopeo failed talking to the registry: why, in words naming it. */
static int registry_error(struct imp *m, const char *what, sp_buf_t *outb)
{
    char t[600];
    tail_of(outb, t, sizeof t);
    const char *reg = m->ref.registry;
    if (m->w != NULL && sp_work_cancelled(m->w))
        return sp_err_set(m->err, SP_EUNAVAIL, "%s from %s stopped (the build ended)", what, reg);
    if (has(t, "connection refused") || has(t, "no such host") || has(t, "i/o timeout") ||
        has(t, "network is unreachable") || has(t, "no route to host") ||
        has(t, "server misbehaving") || has(t, "dial tcp"))
        return sp_err_set(m->err, SP_EUNAVAIL,
                          "cannot reach the image registry %s (%s): is it up, and reachable "
                          "from this server?",
                          reg, t);
    if (has(t, "unauthorized") || has(t, "authentication required") ||
        has(t, "requested access to the resource is denied") || has(t, " 401"))
        return sp_err_set(m->err, SP_EFORBIDDEN,
                          "the image registry %s refused the credentials (or wants some): %s", reg,
                          t);
    if (has(t, "manifest unknown") || has(t, "name unknown") || has(t, "not found"))
        return sp_err_set(m->err, SP_ENOTFOUND, "image %s/%s not found on the registry %s", reg,
                          m->ref.repo, reg);
    if (has(t, "http: server gave HTTP response to HTTPS client"))
        return sp_err_set(m->err, SP_EUNAVAIL,
                          "the image registry %s speaks plain http: list it with "
                          "--insecure-registry to allow that",
                          reg);
    return sp_err_set(m->err, SP_EUNAVAIL, "%s from the image registry %s failed: %s", what, reg,
                      t);
}

/* The auth file skopeo reads (containers-auth.json), mode 0600 in the scratch
 * dir. */
static int write_authfile(struct imp *m, const char *user, const char *pass)
{
    size_t ul = strlen(user), pl = strlen(pass);
    char *plain = malloc(ul + pl + 2);
    size_t b64n = sodium_base64_ENCODED_LEN(ul + pl + 1, sodium_base64_VARIANT_ORIGINAL);
    char *b64 = malloc(b64n);
    int rc = -1;
    if (plain != NULL && b64 != NULL) {
        memcpy(plain, user, ul);
        plain[ul] = ':';
        memcpy(plain + ul + 1, pass, pl);
        sodium_bin2base64(b64, b64n, (const unsigned char *)plain, ul + pl + 1,
                          sodium_base64_VARIANT_ORIGINAL);
        json_t *j = json_pack("{s:{s:{s:s}}}", "auths", m->ref.registry, "auth", b64);
        char *text = j ? json_dumps(j, JSON_COMPACT) : NULL;
        json_decref(j);
        int fd = text && pathf(m->authfile, sizeof m->authfile, "%s/auth.json", m->scratch) == 0
                     ? open(m->authfile, O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0600)
                     : -1;
        if (fd >= 0) {
            size_t len = strlen(text);
            rc = write(fd, text, len) == (ssize_t)len ? 0 : -1;
            close(fd);
        }
        if (text != NULL) {
            sodium_memzero(text, strlen(text));
            free(text);
        }
        sodium_memzero(plain, ul + pl + 1);
        sodium_memzero(b64, b64n);
    }
    free(plain);
    free(b64);
    if (rc < 0)
        m->authfile[0] = '\0';
    return rc;
}

/* skopeo's arguments common to its reads from the registry, into argv from *k.
 */
static void src_opts(struct imp *m, char **argv, int *k, bool copy)
{
    static char tls_false[] = "--tls-verify=false", src_tls_false[] = "--src-tls-verify=false";
    static char authf[] = "--authfile", src_authf[] = "--src-authfile";
    if (m->insecure)
        argv[(*k)++] = copy ? src_tls_false : tls_false;
    if (m->authfile[0] != '\0') {
        argv[(*k)++] = copy ? src_authf : authf;
        argv[(*k)++] = m->authfile;
    }
}

static void digest_of(const char *p, size_t n, char out[72])
{
    unsigned char h[crypto_hash_sha256_BYTES];
    crypto_hash_sha256(h, (const unsigned char *)p, n);
    int k = snprintf(out, 72, "sha256:");
    for (size_t i = 0; i < sizeof h; i++)
        k += snprintf(out + k, (size_t)(72 - k), "%02x", h[i]);
}

/* `skopeo inspect --raw` of src: the image's manifest (a list's linux/amd64
 * one), its digest into m->ref.digest, the sum of its layers' sizes into
 * *bytes. */
static int inspect(struct imp *m, uint64_t *bytes)
{
    for (int round = 0; round < 2; round++) {
        sp_buf_t o = SP_BUF_INIT;
        char *argv[12];
        int k = 0;
        argv[k++] = "skopeo";
        argv[k++] = "inspect";
        argv[k++] = "--raw";
        src_opts(m, argv, &k, false);
        argv[k++] = m->src;
        argv[k] = NULL;
        int st = run(m, argv, &o);
        if (st != 0) {
            if (st < 0)
                sp_buf_printf(&o, "cannot run skopeo: %s", strerror(errno));
            int rc = registry_error(m, "reading the image's manifest", &o);
            sp_buf_free(&o);
            return rc;
        }
        json_t *man = json_loadb((const char *)o.p, o.len, 0, NULL);
        char dg[72];
        digest_of((const char *)o.p, o.len, dg);
        sp_buf_free(&o);
        if (!json_is_object(man)) {
            json_decref(man);
            return sp_err_set(m->err, SP_EUNAVAIL,
                              "the registry %s sent a manifest that is not "
                              "JSON",
                              m->ref.registry);
        }
        json_t *list = json_object_get(man, "manifests");
        if (json_is_array(list)) { /* an index: the linux/amd64 image */
            const char *pick = NULL;
            size_t i;
            json_t *e;
            json_array_foreach(list, i, e)
            {
                json_t *pl = json_object_get(e, "platform");
                const char *os = json_string_value(json_object_get(pl, "os"));
                const char *arch = json_string_value(json_object_get(pl, "architecture"));
                if (os && arch && strcmp(os, "linux") == 0 && strcmp(arch, "amd64") == 0) {
                    pick = json_string_value(json_object_get(e, "digest"));
                    break;
                }
            }
            sp_ociimg_ref_t r = m->ref;
            if (round > 0 || pick == NULL || strlen(pick) != 71 ||
                strncmp(pick, "sha256:", 7) != 0) {
                json_decref(man);
                return sp_err_set(m->err, SP_EINVAL, "image %s/%s has no linux/amd64 variant",
                                  r.registry, r.repo);
            }
            snprintf(m->ref.digest, sizeof m->ref.digest, "%s", pick);
            json_decref(man);
            snprintf(m->src, sizeof m->src, "docker://%s/%s@%s", m->ref.registry, m->ref.repo,
                     m->ref.digest);
            continue;
        }
        if (m->ref.digest[0] != '\0' && strcmp(m->ref.digest, dg) != 0) {
            json_decref(man);
            return sp_err_set(m->err, SP_EUNAVAIL,
                              "the registry %s sent a manifest whose digest is not %s",
                              m->ref.registry, m->ref.digest);
        }
        snprintf(m->ref.digest, sizeof m->ref.digest, "%s", dg);
        uint64_t sum = 0;
        size_t i;
        json_t *l;
        json_array_foreach(json_object_get(man, "layers"), i, l) sum +=
            (uint64_t)json_integer_value(json_object_get(l, "size"));
        json_decref(man);
        *bytes = sum;
        snprintf(m->src, sizeof m->src, "docker://%s/%s@%s", m->ref.registry, m->ref.repo,
                 m->ref.digest);
        return 0;
    }
    return sp_err_set(m->err, SP_EINTERNAL, "unreachable");
}

/* ---- the OCI layout skopeo wrote ---- */

static json_t *load_blob(const char *layout, const char *digest)
{
    char p[PATH_MAX];
    if (digest == NULL || strncmp(digest, "sha256:", 7) != 0 || strlen(digest) != 71 ||
        strchr(digest + 7, '/') != NULL ||
        pathf(p, sizeof p, "%s/blobs/sha256/%s", layout, digest + 7) < 0)
        return NULL;
    return json_load_file(p, 0, NULL);
}

/* The image's manifest and config from the layout (one image in it). */
static int layout_image(struct imp *m, const char *layout, json_t **manifest, json_t **config)
{
    char p[PATH_MAX];
    *manifest = *config = NULL;
    json_t *index =
        pathf(p, sizeof p, "%s/index.json", layout) == 0 ? json_load_file(p, 0, NULL) : NULL;
    const char *md = json_string_value(
        json_object_get(json_array_get(json_object_get(index, "manifests"), 0), "digest"));
    *manifest = load_blob(layout, md);
    json_decref(index);
    *config = load_blob(
        layout, json_string_value(json_object_get(json_object_get(*manifest, "config"), "digest")));
    if (*manifest == NULL || *config == NULL) {
        json_decref(*manifest);
        json_decref(*config);
        *manifest = *config = NULL;
        return sp_err_set(m->err, SP_EUNAVAIL, "the pulled image's layout is incomplete");
    }
    return 0;
}

/* Every layer through the layer rules, within the cap all together (unpacked).
 */
static int check_layers(struct imp *m, const char *layout, const json_t *manifest, uint64_t cap)
{
    uint64_t left = cap;
    size_t i;
    json_t *l;
    json_array_foreach(json_object_get(manifest, "layers"), i, l)
    {
        const char *d = json_string_value(json_object_get(l, "digest"));
        const char *mt = json_string_value(json_object_get(l, "mediaType"));
        char p[PATH_MAX], why[400] = "";
        if (mt != NULL && strstr(mt, "zstd") != NULL)
            return sp_err_set(m->err, SP_EINVAL,
                              "layer %zu of the image is zstd-compressed: not supported (gzip "
                              "or plain layers only)",
                              i + 1);
        if (d == NULL || strlen(d) != 71 || strchr(d + 7, '/') != NULL ||
            pathf(p, sizeof p, "%s/blobs/sha256/%s", layout, d + 7) < 0)
            return sp_err_set(m->err, SP_EINVAL, "layer %zu has a bad digest", i + 1);
        int fd = open(p, O_RDONLY | O_CLOEXEC);
        sp_tarcheck_t *tc = sp_tarcheck_new_layer(left);
        if (fd < 0 || tc == NULL) {
            if (fd >= 0)
                close(fd);
            sp_tarcheck_free(tc);
            return sp_err_set(m->err, SP_EINTERNAL, "cannot read layer %zu", i + 1);
        }
        char buf[65536];
        ssize_t r;
        int rc = 0;
        while (rc == 0 && (r = read(fd, buf, sizeof buf)) > 0)
            rc = sp_tarcheck_feed(tc, buf, (size_t)r, why, sizeof why);
        uint64_t entries = 0;
        if (rc == 0)
            rc = sp_tarcheck_end(tc, &entries, why, sizeof why);
        close(fd);
        uint64_t used = 0;
        if (rc == 0) { /* what the layer unpacks to, roughly: its file size bound */
            struct stat st;
            used = stat(p, &st) == 0 ? (uint64_t)st.st_size : 0;
        }
        sp_tarcheck_free(tc);
        if (rc < 0) {
            if (strstr(why, "larger than") != NULL)
                return sp_err_set(m->err, SP_EINVAL,
                                  "the image is larger than this server takes (%llu MiB "
                                  "unpacked)",
                                  (unsigned long long)(cap >> 20));
            return sp_err_set(m->err, SP_EINVAL, "layer %zu of the image is refused: %s", i + 1,
                              why);
        }
        left = left > used ? left - used : 0;
    }
    return 0;
}

/* ---- the tree, inside its own root ---- */

static int in_root(int root, const char *path, int flags, mode_t mode)
{
    struct open_how how = {.flags = (uint64_t)(flags | O_CLOEXEC),
                           .mode = (flags & O_CREAT) ? mode : 0,
                           .resolve = RESOLVE_IN_ROOT | RESOLVE_NO_MAGICLINKS};
    return (int)syscall(SYS_openat2, root, path, &how, sizeof how);
}

/* mkdir -p path (relative to the root), each component resolved inside it. */
static int mkdirs(int root, const char *path, mode_t mode)
{
    char p[PATH_MAX];
    snprintf(p, sizeof p, "%s", path);
    for (char *s = p;; s++) {
        bool end = *s == '\0';
        if (*s == '/' || end) {
            char c = *s;
            *s = '\0';
            if (p[0] != '\0') {
                char *slash = strrchr(p, '/');
                int dfd =
                    slash ? (*slash = '\0', in_root(root, p, O_PATH | O_DIRECTORY, 0)) : dup(root);
                if (slash)
                    *slash = '/';
                if (dfd < 0)
                    return -1;
                int rc = mkdirat(dfd, slash ? slash + 1 : p, mode);
                close(dfd);
                if (rc < 0 && errno != EEXIST)
                    return -1;
            }
            *s = c;
        }
        if (end)
            break;
    }
    int fd = in_root(root, path, O_PATH | O_DIRECTORY, 0);
    if (fd < 0)
        return -1;
    close(fd);
    return 0;
}

/* Writes data as path (replacing a regular file; a symbolic link is followed
 * inside the root), mode. */
static int put_file(int root, const char *path, const void *data, size_t n, mode_t mode,
                    bool append)
{
    int fd = in_root(root, path, O_WRONLY | O_CREAT | (append ? O_APPEND : O_TRUNC), mode);
    if (fd < 0)
        return -1;
    struct stat st;
    int rc =
        fstat(fd, &st) == 0 && S_ISREG(st.st_mode) && write(fd, data, n) == (ssize_t)n ? 0 : -1;
    if (rc == 0 && !append)
        rc = fchmod(fd, mode);
    close(fd);
    return rc;
}

/* A file of the image (at most 1 MiB), NUL-terminated, or NULL. */
static char *get_file(int root, const char *path)
{
    int fd = in_root(root, path, O_RDONLY, 0);
    if (fd < 0)
        return NULL;
    struct stat st;
    char *s = NULL;
    if (fstat(fd, &st) == 0 && S_ISREG(st.st_mode) && st.st_size < (1 << 20) &&
        (s = malloc((size_t)st.st_size + 1)) != NULL) {
        ssize_t r = read(fd, s, (size_t)st.st_size);
        s[r > 0 ? r : 0] = '\0';
    }
    close(fd);
    return s;
}

/* The line of name (or of uid, when name is NULL) in a passwd-style text: its
 * fields. */
static bool find_entry(const char *text, const char *name, long uid, char *uname, size_t un,
                       long *uid_out, long *gid_out)
{
    for (const char *l = text; l != NULL && *l; l = strchr(l, '\n') ? strchr(l, '\n') + 1 : NULL) {
        char line[1024];
        size_t n = strcspn(l, "\n");
        snprintf(line, sizeof line, "%.*s", (int)(n < sizeof line ? n : sizeof line - 1), l);
        char *f[4] = {0};
        char *t = line;
        int k = 0;
        for (char *p = line; k < 4; p++) {
            if (*p == ':' || *p == '\0') {
                bool last = *p == '\0';
                *p = '\0';
                f[k++] = t;
                t = p + 1;
                if (last)
                    break;
            }
        }
        if (k < 3)
            continue;
        long id = strtol(f[2], NULL, 10);
        if ((name != NULL && strcmp(f[0], name) == 0) || (name == NULL && id == uid)) {
            if (uname != NULL)
                snprintf(uname, un, "%s", f[0]);
            if (uid_out != NULL)
                *uid_out = id;
            if (gid_out != NULL)
                *gid_out = k >= 4 ? strtol(f[3], NULL, 10) : id;
            return true;
        }
    }
    return false;
}

static bool id_taken(const char *text, long id)
{
    return find_entry(text, NULL, id, NULL, 0, NULL, NULL);
}

/* Device nodes, FIFOs and sockets out; the tree's size counted (per worker
 * thread: nftw takes no argument for its callback). */
static __thread uint64_t t_walk_bytes;
static __thread unsigned t_walk_dropped;

static int clean_entry(const char *p, const struct stat *st, int flag, struct FTW *f)
{
    (void)f;
    if (flag == FTW_F && (S_ISCHR(st->st_mode) || S_ISBLK(st->st_mode) || S_ISFIFO(st->st_mode) ||
                          S_ISSOCK(st->st_mode))) {
        unlink(p);
        t_walk_dropped++;
        return 0;
    }
    t_walk_bytes += (uint64_t)st->st_blocks * 512;
    return 0;
}

/* The template user and the fix-ups that let our init boot the tree. */
static int make_bootable(struct imp *m, const char *tree, json_t *cfg, char *user, size_t un)
{
    int root = open(tree, O_PATH | O_DIRECTORY | O_CLOEXEC);
    if (root < 0)
        return sp_err_set(m->err, SP_EINTERNAL, "cannot open the unpacked image");
    int rc = -1;
    char *passwd = NULL, *group = NULL, *agent = NULL;
    size_t agent_len = 0;
    /* the agent */
    FILE *af = fopen(m->o->agent_path, "re");
    if (af != NULL) {
        struct stat st;
        if (fstat(fileno(af), &st) == 0 && st.st_size > 0 && st.st_size < (64 << 20) &&
            (agent = malloc((size_t)st.st_size)) != NULL)
            agent_len = fread(agent, 1, (size_t)st.st_size, af);
        fclose(af);
    }
    if (agent_len == 0) {
        sp_err_set(m->err, SP_EUNAVAIL, "cannot read the guest agent %s", m->o->agent_path);
        goto out;
    }
    static const char *const dirs[] = {"usr/local/bin", "dev",  "proc", "sys",       "run",
                                       "etc",           "root", "home", "etc/space", "var/log"};
    for (size_t i = 0; i < sizeof dirs / sizeof dirs[0]; i++)
        if (mkdirs(root, dirs[i], 0755) < 0) {
            sp_err_set(m->err, SP_EINVAL, "the image's /%s cannot be made a directory: %s", dirs[i],
                       strerror(errno));
            goto out;
        }
    if (mkdirs(root, "tmp", 01777) < 0) {
        sp_err_set(m->err, SP_EINVAL, "the image's /tmp cannot be made a directory");
        goto out;
    }
    int tfd = in_root(root, "tmp", O_RDONLY | O_DIRECTORY, 0);
    if (tfd >= 0) {
        fchmod(tfd, 01777);
        close(tfd);
    }
    static const char hosts[] = "127.0.0.1\tlocalhost\n127.0.1.1\tspace\n"
                                "::1\t\tlocalhost ip6-localhost ip6-loopback\n";
    if (put_file(root, "usr/local/bin/space-agent", agent, agent_len, 0755, false) < 0 ||
        put_file(root, "etc/hostname", "space\n", 6, 0644, false) < 0 ||
        put_file(root, "etc/hosts", hosts, sizeof hosts - 1, 0644, false) < 0 ||
        put_file(root, "etc/machine-id", "", 0, 0444, false) < 0) {
        sp_err_set(m->err, SP_EINVAL, "cannot put the agent and /etc files into the image: %s",
                   strerror(errno));
        goto out;
    }
    /* users: root always; `user` made when missing; the image's USER is the
     * template's */
    passwd = get_file(root, "etc/passwd");
    group = get_file(root, "etc/group");
    if (passwd == NULL || !find_entry(passwd, "root", 0, NULL, 0, NULL, NULL)) {
        static const char r[] = "root:x:0:0:root:/root:/bin/sh\n";
        if (put_file(root, "etc/passwd", r, sizeof r - 1, 0644, passwd != NULL) < 0)
            goto users_bad;
    }
    if (group == NULL || !find_entry(group, "root", 0, NULL, 0, NULL, NULL)) {
        static const char r[] = "root:x:0:\n";
        if (put_file(root, "etc/group", r, sizeof r - 1, 0644, group != NULL) < 0)
            goto users_bad;
    }
    free(passwd);
    free(group);
    passwd = get_file(root, "etc/passwd");
    group = get_file(root, "etc/group");
    if (passwd == NULL || group == NULL)
        goto users_bad;
    if (!find_entry(passwd, USER_NAME, 0, NULL, 0, NULL, NULL)) {
        long id = 1000;
        while (id_taken(passwd, id) || id_taken(group, id))
            id++;
        char shell[32] = "/bin/sh";
        int sh = in_root(root, "bin/bash", O_PATH, 0);
        if (sh >= 0) {
            snprintf(shell, sizeof shell, "/bin/bash");
            close(sh);
        }
        char pl[256], gl[64];
        snprintf(pl, sizeof pl, USER_NAME ":x:%ld:%ld::/home/" USER_NAME ":%s\n", id, id, shell);
        snprintf(gl, sizeof gl, USER_NAME ":x:%ld:\n", id);
        char *shadow = get_file(root, "etc/shadow");
        if (put_file(root, "etc/passwd", pl, strlen(pl), 0644, true) < 0 ||
            (!find_entry(group, USER_NAME, 0, NULL, 0, NULL, NULL) &&
             put_file(root, "etc/group", gl, strlen(gl), 0644, true) < 0) ||
            (shadow != NULL &&
             put_file(root, "etc/shadow", USER_NAME "::19000:0:99999:7:::\n",
                      strlen(USER_NAME "::19000:0:99999:7:::\n"), 0640, true) < 0)) {
            free(shadow);
            goto users_bad;
        }
        free(shadow);
        if (mkdirs(root, "home/" USER_NAME, 0755) < 0)
            goto users_bad;
        int h = in_root(root, "home/" USER_NAME, O_RDONLY | O_DIRECTORY | O_NOFOLLOW, 0);
        if (h >= 0) {
            if (fchown(h, (uid_t)id, (gid_t)id) < 0)
                note(m, "cannot give /home/" USER_NAME " to its user: %s", strerror(errno));
            close(h);
        }
        int sd = in_root(root, "etc/sudoers.d", O_PATH | O_DIRECTORY, 0);
        if (sd >= 0) {
            close(sd);
            static const char su[] = USER_NAME " ALL=(ALL:ALL) NOPASSWD:ALL\n";
            put_file(root, "etc/sudoers.d/90-space-" USER_NAME, su, sizeof su - 1, 0440, false);
        }
        note(m, "user '" USER_NAME "' (uid %ld) added to the image", id);
        free(passwd);
        passwd = get_file(root, "etc/passwd");
    }
    const char *iu = json_string_value(json_object_get(cfg, "user"));
    if (iu == NULL || iu[0] == '\0') {
        user[0] = '\0'; /* root, as Docker runs it */
    } else {
        char name[64];
        snprintf(name, sizeof name, "%.*s", (int)strcspn(iu, ":"), iu);
        char *end;
        long uid = strtol(name, &end, 10);
        bool numeric = name[0] != '\0' && *end == '\0';
        if (!find_entry(passwd, numeric ? NULL : name, uid, user, un, NULL, NULL)) {
            sp_err_set(m->err, SP_EINVAL, "the image's USER %.64s is not in its /etc/passwd", iu);
            goto out;
        }
    }
    rc = 0;
    goto out;
users_bad:
    sp_err_set(m->err, SP_EINVAL, "cannot add the users to the image's /etc/passwd: %s",
               strerror(errno));
out:
    free(passwd);
    free(group);
    free(agent);
    close(root);
    return rc;
}

/* ---- the whole import ---- */

static json_t *config_of(const json_t *image_config)
{
    const json_t *c = json_object_get(image_config, "config");
    json_t *env = json_object();
    size_t i;
    json_t *v;
    json_array_foreach(json_object_get(c, "Env"), i, v)
    {
        const char *s = json_string_value(v);
        const char *eq = s ? strchr(s, '=') : NULL;
        if (eq == NULL || eq == s || eq - s > 256)
            continue;
        char k[260];
        snprintf(k, sizeof k, "%.*s", (int)(eq - s), s);
        json_object_set_new(env, k, json_string(eq + 1));
    }
    char *start = sp_ociimg_start_cmd(json_object_get(c, "Entrypoint"), json_object_get(c, "Cmd"));
    const char *wd = json_string_value(json_object_get(c, "WorkingDir"));
    const char *u = json_string_value(json_object_get(c, "User"));
    json_t *o = json_pack("{s:o,s:s,s:s,s:s}", "env", env, "workdir", wd ? wd : "", "user",
                          u ? u : "", "start_cmd", start ? start : "");
    free(start);
    return o;
}

static int image_version(struct imp *m, const sp_tmplbuild_paths_t *base, char out[65])
{
    char agent_sha[65];
    if (sp_tmplbuild_file_sha256(m->o->agent_path, agent_sha, m->err) < 0)
        return -1;
    unsigned char h[crypto_hash_sha256_BYTES];
    crypto_hash_sha256_state st;
    crypto_hash_sha256_init(&st);
    const char *parts[] = {IMPORTER, m->ref.digest, agent_sha, base->kernel, base->initramfs};
    for (size_t i = 0; i < sizeof parts / sizeof parts[0]; i++)
        crypto_hash_sha256_update(&st, (const unsigned char *)parts[i], strlen(parts[i]) + 1);
    crypto_hash_sha256_final(&st, h);
    for (size_t i = 0; i < sizeof h; i++)
        snprintf(out + 2 * i, 3, "%02x", h[i]);
    return 0;
}

static int write_manifest(struct imp *m, const sp_tmplbuild_paths_t *base, const char *name,
                          const char *version, const char *dir, json_t *cfg, int disk_mb,
                          double secs)
{
    json_t *man = json_load_file(base->manifest, 0, NULL);
    char rootfs[PATH_MAX], p[PATH_MAX], img[PATH_MAX], agent_sha[65];
    struct stat st;
    if (man == NULL ||
        pathf(rootfs, sizeof rootfs, "templates/%s/%s/rootfs.qcow2", name, version) < 0 ||
        pathf(img, sizeof img, "%s/rootfs.qcow2", dir) < 0 || stat(img, &st) < 0 ||
        pathf(p, sizeof p, "%s/manifest.json", dir) < 0 ||
        sp_tmplbuild_file_sha256(m->o->agent_path, agent_sha, NULL) < 0) {
        json_decref(man);
        return sp_err_set(m->err, SP_EINTERNAL, "cannot read the base template's manifest");
    }
    int rc = json_object_set_new(man, "name", json_string(name)) |
             json_object_set_new(man, "hash", json_string(version)) |
             json_object_set_new(man, "rootfs", json_string(rootfs)) |
             json_object_set_new(man, "disk_mb", json_integer(disk_mb)) |
             json_object_set_new(man, "agent_sha256", json_string(agent_sha)) |
             json_object_set_new(man, "code_interpreter", json_false()) |
             json_object_set_new(man, "code_sha256", json_null()) |
             json_object_set_new(man, "warmup", json_null()) |
             json_object_set_new(man, "rootfs_bytes", json_integer((json_int_t)st.st_size)) |
             json_object_set_new(man, "rootfs_allocated_bytes",
                                 json_integer((json_int_t)st.st_blocks * 512)) |
             json_object_set_new(man, "built_at", json_integer((json_int_t)time(NULL))) |
             json_object_set_new(man, "build_seconds", json_real(secs)) |
             json_object_del(man, "step_seconds") * 0 |
             json_object_set_new(man, "image_config", json_deep_copy(cfg)) |
             json_object_set_new(man, "spec",
                                 json_pack("{s:s,s:s,s:s}", "image", m->out->ref, "digest",
                                           m->ref.digest, "importer", IMPORTER));
    if (rc == 0)
        rc = json_dump_file(man, p, JSON_INDENT(2) | JSON_SORT_KEYS);
    json_decref(man);
    if (rc != 0)
        return sp_err_set(m->err, SP_EINTERNAL, "cannot write the image's manifest");
    return 0;
}

static int set_current(const char *tdir, const char *version)
{
    char cur[PATH_MAX], tmp[PATH_MAX];
    if (pathf(cur, sizeof cur, "%s/current", tdir) < 0 ||
        pathf(tmp, sizeof tmp, "%s/.current-%ld", tdir, (long)syscall(SYS_gettid)) < 0)
        return -1;
    unlink(tmp);
    if (symlink(version, tmp) < 0 || rename(tmp, cur) < 0) {
        unlink(tmp);
        return -1;
    }
    return 0;
}

/* Pull, check, unpack, make bootable, image: into dir (the version's files). */
static int build_version(struct imp *m, const sp_tmplbuild_paths_t *base, const char *name,
                         const char *version, const char *dir, uint64_t cap)
{
    char layout[PATH_MAX], dst[PATH_MAX + 16], tree[PATH_MAX], raw[PATH_MAX], img[PATH_MAX];
    if (pathf(layout, sizeof layout, "%s/layout", m->scratch) < 0 ||
        pathf(dst, sizeof dst, "oci:%s:img", layout) < 0 ||
        pathf(tree, sizeof tree, "%s/rootfs", m->scratch) < 0 ||
        pathf(raw, sizeof raw, "%s/rootfs.raw", m->scratch) < 0 ||
        pathf(img, sizeof img, "%s/rootfs.qcow2", dir) < 0)
        return sp_err_set(m->err, SP_EINVAL, "the data dir's path is too long");
    double t0 = now_s();
    sp_buf_t o = SP_BUF_INIT;
    char *argv[16];
    int k = 0;
    argv[k++] = "skopeo";
    argv[k++] = "copy";
    argv[k++] = "--quiet";
    src_opts(m, argv, &k, true);
    argv[k++] = m->src;
    argv[k++] = dst;
    argv[k] = NULL;
    int st = run(m, argv, &o);
    if (st != 0) {
        if (st < 0)
            sp_buf_printf(&o, "cannot run skopeo: %s", strerror(errno));
        int rc = registry_error(m, "pulling the image", &o);
        sp_buf_free(&o);
        return rc;
    }
    sp_buf_free(&o);
    note(m, "pulled %s in %.1f s", m->out->ref, now_s() - t0);
    json_t *manifest = NULL, *config = NULL;
    if (layout_image(m, layout, &manifest, &config) < 0)
        return -1;
    int rc = check_layers(m, layout, manifest, cap);
    json_t *cfg = rc == 0 ? config_of(config) : NULL;
    json_decref(manifest);
    json_decref(config);
    if (rc < 0)
        return -1;
    double t1 = now_s();
    char *un[] = {"umoci", "raw", "unpack", "--image", dst + 4, tree, NULL};
    st = run(m, un, &o);
    if (st != 0) {
        char t[400];
        sp_err_set(m->err, SP_EINVAL, "unpacking the image failed: %s",
                   st < 0 ? strerror(errno) : tail_of(&o, t, sizeof t));
        sp_buf_free(&o);
        json_decref(cfg);
        return -1;
    }
    sp_buf_free(&o);
    sp_rm_rf(layout); /* the blobs are in the tree now */
    t_walk_bytes = 0;
    t_walk_dropped = 0;
    nftw(tree, clean_entry, 32, FTW_PHYS | FTW_MOUNT);
    uint64_t used = t_walk_bytes;
    note(m, "unpacked in %.1f s: %llu MiB%s", now_s() - t1, (unsigned long long)(used >> 20),
         t_walk_dropped ? " (device nodes, FIFOs and sockets dropped)" : "");
    if (used > cap) {
        json_decref(cfg);
        return sp_err_set(m->err, SP_EINVAL,
                          "the image is larger than this server takes (%llu MiB unpacked, "
                          "limit %llu MiB)",
                          (unsigned long long)(used >> 20), (unsigned long long)(cap >> 20));
    }
    char user[64];
    if (make_bootable(m, tree, cfg, user, sizeof user) < 0) {
        json_decref(cfg);
        return -1;
    }
    json_object_set_new(cfg, "user", json_string(user));
    /* room for what the steps and sandboxes add: half again, and 512 MiB, at
     * least base's */
    int disk_mb = (int)((used + used / 2) >> 20) + 512;
    if (disk_mb < base->disk_mb)
        disk_mb = base->disk_mb;
    double t2 = now_s();
    char size[32];
    snprintf(size, sizeof size, "%dM", disk_mb);
    char *tr[] = {"truncate", "-s", size, raw, NULL};
    char *mk[] = {"mkfs.ext4", "-q",     "-F",
                  "-L",        "rootfs", "-m",
                  "0",         "-E",     "lazy_itable_init=0,lazy_journal_init=0",
                  "-d",        tree,     raw,
                  NULL};
    char *cv[] = {"qemu-img", "convert", "-q", "-f", "raw", "-O", "qcow2", raw, img, NULL};
    char *const *steps[] = {tr, mk, cv};
    for (int i = 0; i < 3; i++) {
        if ((st = run(m, steps[i], &o)) != 0) {
            char t[400];
            sp_err_set(m->err, SP_EINTERNAL, "making the image's disk failed (%s): %s", steps[i][0],
                       st < 0 ? strerror(errno) : tail_of(&o, t, sizeof t));
            sp_buf_free(&o);
            json_decref(cfg);
            return -1;
        }
        sp_buf_reset(&o);
    }
    sp_buf_free(&o);
    unlink(raw);
    chmod(img, 0444);
    note(m, "disk image made in %.1f s (%d MiB)", now_s() - t2, disk_mb);
    rc = write_manifest(m, base, name, version, dir, cfg, disk_mb, now_s() - t0);
    if (rc == 0) {
        json_decref(m->out->config);
        m->out->config = cfg;
    } else {
        json_decref(cfg);
    }
    return rc;
}

int sp_ociimg_import(const sp_ociimg_opts_t *o, const char *data_dir, const char *ref,
                     const char *username, const char *password, const sp_work_t *w,
                     sp_ociimg_result_t *out, sp_err_t *err)
{
    memset(out, 0, sizeof(*out));
    out->log = json_array();
    struct imp m = {.o = o, .w = w, .out = out, .err = err};
    double t0 = now_s();
    if (o == NULL || o->agent_path == NULL)
        return sp_err_set(err, SP_EUNAVAIL,
                          "this server cannot build from images: it knows no guest agent binary");
    if (sp_ociimg_parse_ref(ref, o->mirror, &m.ref, err) < 0)
        return -1;
    m.insecure = sp_ociimg_insecure(m.ref.registry, o->insecure);
    if (m.ref.digest[0] != '\0')
        snprintf(m.src, sizeof m.src, "docker://%s/%s@%s", m.ref.registry, m.ref.repo,
                 m.ref.digest);
    else
        snprintf(m.src, sizeof m.src, "docker://%s/%s:%s", m.ref.registry, m.ref.repo, m.ref.tag);
    if (m.ref.mirrored)
        note(&m, "a Docker Hub image: asking the mirror %s", m.ref.registry);
    sp_tmplbuild_paths_t base;
    if (sp_tmplbuild_current(data_dir, "base", &base, err) < 0)
        return sp_err_set(err, SP_EUNAVAIL,
                          "images boot with the base template's kernel, and base is not built");
    uint64_t cap = o->max_bytes > 0 ? o->max_bytes : SP_OCIIMG_MAX_BYTES;
    char tmp[PATH_MAX];
    if (pathf(tmp, sizeof tmp, "%s/tmp", data_dir) < 0 ||
        (mkdir(tmp, 0755) < 0 && errno != EEXIST) ||
        pathf(m.scratch, sizeof m.scratch, "%s/tmp/oci-XXXXXX", data_dir) < 0 ||
        mkdtemp(m.scratch) == NULL)
        return sp_err_set(err, SP_EINTERNAL, "cannot make the import's scratch dir: %s",
                          strerror(errno));
    int rc = -1, lock = -1;
    if (username != NULL && password != NULL && write_authfile(&m, username, password) < 0) {
        sp_err_set(err, SP_EINTERNAL, "cannot write the registry credentials for skopeo");
        goto out;
    }
    uint64_t bytes = 0;
    note(&m, "resolving %s/%s:%s on %s%s", m.ref.registry, m.ref.repo,
         m.ref.tag[0] ? m.ref.tag : m.ref.digest, m.ref.registry,
         m.insecure ? " (plain http allowed)" : "");
    if (inspect(&m, &bytes) < 0)
        goto out;
    snprintf(out->digest, sizeof out->digest, "%s", m.ref.digest);
    snprintf(out->ref, sizeof out->ref, "%s/%s@%s", m.ref.registry, m.ref.repo, m.ref.digest);
    snprintf(out->tmpl, sizeof out->tmpl, SP_OCIIMG_PREFIX "%.40s", m.ref.digest + 7);
    note(&m, "image %s: %llu MiB of layers", m.ref.digest, (unsigned long long)(bytes >> 20));
    if (bytes > cap) {
        sp_err_set(err, SP_EINVAL,
                   "the image is larger than this server takes (%llu MiB of "
                   "layers, limit %llu "
                   "MiB)",
                   (unsigned long long)(bytes >> 20), (unsigned long long)(cap >> 20));
        goto out;
    }
    char version[65], tdir[PATH_MAX], vdir[PATH_MAX], man[PATH_MAX], lk[PATH_MAX];
    if (image_version(&m, &base, version) < 0 ||
        pathf(tdir, sizeof tdir, "%s/templates/%s", data_dir, out->tmpl) < 0 ||
        pathf(vdir, sizeof vdir, "%s/%s", tdir, version) < 0 ||
        pathf(man, sizeof man, "%s/manifest.json", vdir) < 0 ||
        pathf(lk, sizeof lk, "%s/.lock", tdir) < 0)
        goto out;
    /* The digest cache's collection (tmpl.h: sp_tmpl_set_build_cache) removes an unused
     * image's directory, lock file included, while holding its lock: a lock taken on a file
     * no longer linked is let go and taken again on the new one. */
    for (int tries = 0;; tries++) {
        struct stat ls;
        if ((mkdir(tdir, 0755) < 0 && errno != EEXIST) ||
            (lock = open(lk, O_RDWR | O_CREAT | O_CLOEXEC, 0600)) < 0 || flock(lock, LOCK_EX) < 0 ||
            fstat(lock, &ls) < 0) {
            sp_err_set(err, SP_EINTERNAL, "cannot lock the image's directory: %s", strerror(errno));
            goto out;
        }
        if (ls.st_nlink > 0)
            break;
        close(lock);
        lock = -1;
        if (tries == 8) {
            sp_err_set(err, SP_EINTERNAL, "cannot lock the image's directory: it keeps going");
            goto out;
        }
    }
    json_t *cached = json_load_file(man, 0, NULL);
    if (cached != NULL) {
        out->cached = true;
        out->config = json_deep_copy(json_object_get(cached, "image_config"));
        json_decref(cached);
        note(&m, "image %s was imported before: not pulled again (digest cache)", m.ref.digest);
    } else {
        char work[PATH_MAX];
        if (pathf(work, sizeof work, "%s/.work-%.16s", tdir, m.scratch + strlen(m.scratch) - 6) <
                0 ||
            mkdir(work, 0755) < 0) {
            sp_err_set(err, SP_EINTERNAL, "cannot make the image's work dir: %s", strerror(errno));
            goto out;
        }
        if (build_version(&m, &base, out->tmpl, version, work, cap) < 0) {
            sp_rm_rf(work);
            goto out;
        }
        if (rename(work, vdir) < 0) {
            sp_err_set(err, SP_EINTERNAL, "cannot commit the image: %s", strerror(errno));
            sp_rm_rf(work);
            goto out;
        }
    }
    if (set_current(tdir, version) < 0) {
        sp_err_set(err, SP_EINTERNAL, "cannot make the image's version current: %s",
                   strerror(errno));
        goto out;
    }
    /* its last use, which the digest cache's collection reads (not fatal: it may go early) */
    if (utimensat(AT_FDCWD, vdir, NULL, 0) < 0)
        note(&m, "cannot mark the image's last use: %s", strerror(errno));
    if (out->config == NULL)
        out->config =
            json_pack("{s:{},s:s,s:s,s:s}", "env", "workdir", "", "user", "", "start_cmd", "");
    rc = 0;
out:
    if (lock >= 0)
        close(lock);
    if (m.authfile[0] != '\0')
        unlink(m.authfile);
    sp_rm_rf(m.scratch);
    out->seconds = now_s() - t0;
    return rc;
}

void sp_ociimg_result_free(sp_ociimg_result_t *r)
{
    if (r == NULL)
        return;
    json_decref(r->config);
    json_decref(r->log);
    r->config = r->log = NULL;
}
