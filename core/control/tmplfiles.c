/*
 * tmplfiles.c - the store of files COPY steps use (tmplfiles.h).
 */
#include "core/control/tmplfiles.h"

#include <ctype.h>
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <sodium.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "base/log.h"
#include "core/control/tarcheck.h"

struct put;

struct sp_tmplfiles {
    sp_loop_t *loop;
    char dir[PATH_MAX]; /* <data-dir>/template-files, or the shared snapshot dir's */
    unsigned char mac_key[crypto_auth_hmacsha256_KEYBYTES];
    struct put *puts; /* in flight */
};

struct put {
    struct put *next;
    sp_tmplfiles_t *f;
    sp_work_t *w;
    char team[SP_ID_LEN + 1];
    char key[65];
    bool verify;
    uint8_t *body;
    size_t n;
    char path[PATH_MAX];
    sp_tmplfiles_put_cb cb;
    void *arg;
    /* results (worker thread) */
    bool existed;
    uint64_t entries;
    sp_code_t code; /* SP_OK: stored */
    char why[256];
};

static bool valid_team(const char *team)
{
    return team != NULL && sp_ids_valid(team);
}

int sp_tmplfiles_set_dir(sp_tmplfiles_t *f, const char *root, sp_err_t *err)
{
    char d[PATH_MAX];
    int k = snprintf(d, sizeof d, "%s/template-files", root);
    if (k < 0 || (size_t)k >= sizeof d || (mkdir(d, 0700) < 0 && errno != EEXIST))
        return sp_err_set(err, SP_EINTERNAL, "cannot make %s/template-files", root);
    memcpy(f->dir, d, (size_t)k + 1);
    return 0;
}

void sp_tmplfiles_fleet_link_key(const unsigned char *secret, size_t n, unsigned char key[32])
{
    static const char label[] = "space template-files upload links";
    crypto_generichash(key, 32, secret, n, (const unsigned char *)label, sizeof label - 1);
}

void sp_tmplfiles_set_link_key(sp_tmplfiles_t *f, const unsigned char key[32])
{
    memcpy(f->mac_key, key, sizeof f->mac_key);
}

sp_tmplfiles_t *sp_tmplfiles_create(sp_loop_t *loop, const char *data_dir, sp_err_t *err)
{
    sp_tmplfiles_t *f = calloc(1, sizeof(*f));
    if (f == NULL) {
        sp_err_set(err, SP_EINTERNAL, "out of memory");
        return NULL;
    }
    f->loop = loop;
    if (sp_tmplfiles_set_dir(f, data_dir, err) < 0) {
        free(f);
        return NULL;
    }
    crypto_auth_hmacsha256_keygen(f->mac_key);
    return f;
}

void sp_tmplfiles_destroy(sp_tmplfiles_t *f)
{
    if (f == NULL)
        return;
    while (f->puts != NULL) { /* the done callbacks see cancelled and free */
        struct put *p = f->puts;
        f->puts = p->next;
        p->f = NULL;
        sp_work_cancel(p->w);
    }
    sodium_memzero(f->mac_key, sizeof f->mac_key);
    free(f);
}

int sp_tmplfiles_path(sp_tmplfiles_t *f, const char *team, const char *key, char *out,
                      size_t cap, sp_err_t *err)
{
    if (!sp_tmplfiles_valid_key(key) || !valid_team(team))
        return sp_err_set(err, SP_EINVAL, "a files key is 64 lowercase hex characters");
    int k = snprintf(out, cap, "%s/%s/%s", f->dir, team, key);
    if (k < 0 || (size_t)k >= cap)
        return sp_err_set(err, SP_EINVAL, "path too long");
    if (access(out, R_OK) < 0)
        return sp_err_set(err, SP_ENOTFOUND,
                          "files %.12s... were never uploaded (or went unused so long that they "
                          "were removed: upload them again)",
                          key);
    (void)utimensat(AT_FDCWD, out, NULL, 0); /* its last use, which the collection reads */
    return 0;
}

/* Whether an upload of the team's key is in flight: it may have found the file there and be
 * about to answer so. */
static bool uploading(const sp_tmplfiles_t *f, const char *team, const char *key)
{
    for (const struct put *p = f->puts; p != NULL; p = p->next)
        if (strcmp(p->team, team) == 0 && strcmp(p->key, key) == 0)
            return true;
    return false;
}

int sp_tmplfiles_collect(sp_tmplfiles_t *f, uint64_t keep_s, sp_tmplfiles_used_cb used, void *arg)
{
    DIR *d = opendir(f->dir);
    if (d == NULL)
        return 0;
    time_t now = time(NULL);
    int removed = 0;
    struct dirent *de;
    while ((de = readdir(d)) != NULL) {
        const char *team = de->d_name;
        int tfd;
        DIR *td;
        if (!valid_team(team) ||
            (tfd = openat(dirfd(d), team, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC)) < 0)
            continue;
        if ((td = fdopendir(tfd)) == NULL) {
            close(tfd);
            continue;
        }
        struct dirent *ke;
        while ((ke = readdir(td)) != NULL) {
            struct stat st;
            const char *key = ke->d_name; /* uploads being written are .tmp-<key>-... */
            if (!sp_tmplfiles_valid_key(key) || fstatat(tfd, key, &st, AT_SYMLINK_NOFOLLOW) < 0 ||
                !S_ISREG(st.st_mode) || st.st_mtime + (time_t)keep_s > now ||
                (used != NULL && used(arg, team, key)) || uploading(f, team, key))
                continue;
            if (unlinkat(tfd, key, 0) == 0) {
                removed++;
                sp_log(SP_LOG_INFO, "tmplfiles",
                       "removing unused template files team=%s key=%.12s idle_s=%lld", team, key,
                       (long long)(now - st.st_mtime));
            }
        }
        closedir(td);
        /* an empty team directory goes too, unless an upload (which makes it) is in flight */
        if (f->puts == NULL)
            (void)unlinkat(dirfd(d), team, AT_REMOVEDIR);
    }
    closedir(d);
    return removed;
}

/* ---- uploads ---- */

static void put_work(sp_work_t *w, void *arg)
{
    struct put *p = arg;
    (void)w;
    p->code = SP_OK;
    if (access(p->path, F_OK) == 0) {
        p->existed = true;
        (void)utimensat(AT_FDCWD, p->path, NULL, 0); /* its last use */
        return;
    }
    if (p->verify) {
        unsigned char h[crypto_hash_sha256_BYTES];
        crypto_hash_sha256(h, p->body, p->n);
        char hex[65];
        sodium_bin2hex(hex, sizeof hex, h, sizeof h);
        if (strcmp(hex, p->key) != 0) {
            p->code = SP_EINVAL;
            snprintf(p->why, sizeof p->why, "the upload's SHA-256 is %s, not its key", hex);
            return;
        }
    }
    sp_tarcheck_t *tc = sp_tarcheck_new(SP_TMPLFILES_TAR);
    if (tc == NULL) {
        p->code = SP_EINTERNAL;
        snprintf(p->why, sizeof p->why, "out of memory");
        return;
    }
    char why[256];
    int rc = sp_tarcheck_feed(tc, p->body, p->n, why, sizeof why);
    if (rc == 0)
        rc = sp_tarcheck_end(tc, &p->entries, why, sizeof why);
    sp_tarcheck_free(tc);
    if (rc < 0) {
        p->code = SP_EINVAL;
        snprintf(p->why, sizeof p->why, "the files cannot be used: %.200s", why);
        return;
    }
    char dir[PATH_MAX], tmp[PATH_MAX + 128];
    snprintf(dir, sizeof dir, "%s", p->path);
    char *slash = strrchr(dir, '/');
    if (slash != NULL)
        *slash = '\0';
    /* unique across the workers sharing the dir, whose pids may be the same */
    snprintf(tmp, sizeof tmp, "%s/.tmp-%s-%d-%08x", dir, p->key, (int)getpid(),
             (unsigned)randombytes_random());
    int fd = -1;
    for (int i = 0; i < 2 && fd < 0; i++) {
        /* the team's directory, which another worker's collection may remove when empty */
        if (mkdir(dir, 0700) < 0 && errno != EEXIST) {
            p->code = SP_EINTERNAL;
            snprintf(p->why, sizeof p->why, "cannot store the files: %s", strerror(errno));
            return;
        }
        fd = open(tmp, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
        if (fd < 0 && errno != ENOENT)
            break;
    }
    size_t off = 0;
    while (fd >= 0 && off < p->n) {
        ssize_t k = write(fd, p->body + off, p->n - off);
        if (k <= 0)
            break;
        off += (size_t)k;
    }
    if (fd < 0 || off != p->n || fsync(fd) < 0 || close(fd) < 0 || rename(tmp, p->path) < 0) {
        int e = errno;
        if (fd >= 0 && off != p->n)
            close(fd);
        unlink(tmp);
        p->code = SP_EINTERNAL;
        snprintf(p->why, sizeof p->why, "cannot store the files: %s", strerror(e));
    }
}

static void put_done(void *arg, bool cancelled)
{
    struct put *p = arg;
    if (!cancelled && p->f != NULL) {
        for (struct put **pp = &p->f->puts; *pp != NULL; pp = &(*pp)->next)
            if (*pp == p) {
                *pp = p->next;
                break;
            }
        sp_err_t e;
        if (p->code != SP_OK)
            sp_err_set(&e, p->code, "%s", p->why);
        else
            sp_log(SP_LOG_INFO, "tmplfiles", "template files %s team=%s key=%.12s entries=%llu",
                   p->existed ? "were there" : "stored", p->team, p->key,
                   (unsigned long long)p->entries);
        p->cb(p->arg, p->existed, p->entries, p->code != SP_OK ? &e : NULL);
    }
    free(p->body);
    free(p);
}

int sp_tmplfiles_put(sp_tmplfiles_t *f, const char *team, const char *key, bool verify,
                     const void *body, size_t n, sp_tmplfiles_put_cb cb, void *arg, sp_err_t *err)
{
    if (!sp_tmplfiles_valid_key(key) || !valid_team(team))
        return sp_err_set(err, SP_EINVAL, "a files key is 64 lowercase hex characters");
    if (n > SP_TMPLFILES_MAX)
        return sp_err_set(err, SP_ETOOBIG, "template files are limited to %u MiB per upload",
                          SP_TMPLFILES_MAX >> 20);
    struct put *p = calloc(1, sizeof(*p));
    if (p == NULL || (n > 0 && (p->body = malloc(n)) == NULL)) {
        free(p);
        return sp_err_set(err, SP_EINTERNAL, "out of memory");
    }
    if (n > 0)
        memcpy(p->body, body, n);
    p->n = n;
    p->f = f;
    p->verify = verify;
    p->cb = cb;
    p->arg = arg;
    snprintf(p->team, sizeof p->team, "%s", team);
    snprintf(p->key, sizeof p->key, "%s", key);
    if (snprintf(p->path, sizeof p->path, "%.3900s/%.20s/%.64s", f->dir, team, key) < 0)
        p->path[0] = '\0';
    p->w = sp_loop_work(f->loop, SP_WORK_LONG, put_work, put_done, p);
    if (p->w == NULL) {
        free(p->body);
        free(p);
        return sp_err_set(err, SP_EINTERNAL, "out of memory");
    }
    p->next = f->puts;
    f->puts = p;
    return 0;
}

/* ---- upload links ---- */

/* token = <team>.<expiry>.<hex HMAC-SHA-256 of "team.expiry.key"> */
static void mac(sp_tmplfiles_t *f, const char *team, long long exp, const char *key,
                char hex[65])
{
    char msg[256];
    int k = snprintf(msg, sizeof msg, "%s.%lld.%s", team, exp, key);
    unsigned char m[crypto_auth_hmacsha256_BYTES];
    crypto_auth_hmacsha256(m, (const unsigned char *)msg, (size_t)k, f->mac_key);
    sodium_bin2hex(hex, 65, m, sizeof m);
}

void sp_tmplfiles_token(sp_tmplfiles_t *f, const char *team, const char *key,
                        char out[SP_TMPLFILES_TOKEN])
{
    long long exp = (long long)time(NULL) + SP_TMPLFILES_LINK_S;
    char hex[65];
    mac(f, team, exp, key, hex);
    snprintf(out, SP_TMPLFILES_TOKEN, "%s.%lld.%s", team, exp, hex);
}

int sp_tmplfiles_token_check(sp_tmplfiles_t *f, const char *token, const char *key,
                             char team[SP_ID_LEN + 1], sp_err_t *err)
{
    char copy[SP_TMPLFILES_TOKEN];
    if (token == NULL || strlen(token) >= sizeof copy || !sp_tmplfiles_valid_key(key))
        return sp_err_set(err, SP_EAUTH, "bad upload link");
    snprintf(copy, sizeof copy, "%s", token);
    char *d1 = strchr(copy, '.'), *d2 = d1 ? strchr(d1 + 1, '.') : NULL;
    if (d1 == NULL || d2 == NULL)
        return sp_err_set(err, SP_EAUTH, "bad upload link");
    *d1 = *d2 = '\0';
    char *end = NULL;
    long long exp = strtoll(d1 + 1, &end, 10);
    if (!valid_team(copy) || end == NULL || *end != '\0' || strlen(d2 + 1) != 64)
        return sp_err_set(err, SP_EAUTH, "bad upload link");
    char want[65];
    mac(f, copy, exp, key, want);
    if (sodium_memcmp(want, d2 + 1, 64) != 0)
        return sp_err_set(err, SP_EAUTH, "bad upload link");
    if (exp < (long long)time(NULL))
        return sp_err_set(err, SP_EAUTH, "the upload link has expired");
    memcpy(team, copy, SP_ID_LEN);
    team[SP_ID_LEN] = '\0';
    return 0;
}
