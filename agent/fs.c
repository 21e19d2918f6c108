/*
 * fs.c - file requests, done with the user's filesystem credentials.
 *
 * Pattern: parse PATH/USER, look the user up, sp_users_enter(), do the
 * syscalls, sp_users_leave(), reply. Nothing blocks on anything but local
 * disk. Reads are pumped within the host's window; writes go to a temporary
 * file beside the target that is fsynced and renamed over it on EOF, so
 * readers never see a half-written file.
 */
#include "agent/fs.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "agent/chan.h"
#include "agent/sess.h"
#include "agent/users.h"
#include "base/log.h"

/* A request's common arguments. */
typedef struct {
    uint32_t id;
    const uint8_t *p;
    uint32_t n;
    sp_user_t user;
    char path[PATH_MAX];
} req_t;

/* Resolves a string field to an absolute path for the user (sp_users_resolve_path). */
static int get_path(req_t *r, uint16_t tag, char *out, size_t cap)
{
    sp_ap_str_t s;
    if (sp_ap_get_str(r->p, r->n, tag, &s) < 0 || s.p == NULL || s.n == 0) {
        sp_sess_error(r->id, SP_AP_E_INVAL, 0, "missing or bad path");
        return -1;
    }
    sp_err_t err;
    if (sp_users_resolve_path(&r->user, s.p, s.n, out, cap, &err) < 0) {
        sp_sess_error(r->id, SP_AP_E_INVAL, 0, "%s", err.msg);
        return -1;
    }
    return 0;
}

static int parse_req(req_t *r, uint32_t id, const uint8_t *p, uint32_t n)
{
    r->id = id;
    r->p = p;
    r->n = n;
    sp_ap_str_t u;
    char uname[64] = "";
    sp_err_t err;
    if (sp_ap_fields_check(p, n) < 0 || sp_ap_get_str(p, n, SP_AP_K_USER, &u) < 0 ||
        (u.p != NULL && u.n >= sizeof(uname))) {
        sp_sess_error(id, SP_AP_E_INVAL, 0, "malformed request");
        return -1;
    }
    if (u.p != NULL)
        memcpy(uname, u.p, u.n);
    if (sp_users_lookup(uname, &r->user, &err) < 0) {
        sp_sess_error(id, SP_AP_E_NOTFOUND, 0, "%s", err.msg);
        return -1;
    }
    return get_path(r, SP_AP_K_PATH, r->path, sizeof(r->path));
}

static int enter(req_t *r)
{
    if (sp_users_enter(&r->user) < 0) {
        sp_sess_error_errno(r->id, errno, "switch user");
        return -1;
    }
    return 0;
}

/* ---- entries ---- */

static uint32_t ftype_of(mode_t m)
{
    if (S_ISREG(m))
        return SP_AP_FT_FILE;
    if (S_ISDIR(m))
        return SP_AP_FT_DIR;
    if (S_ISLNK(m))
        return SP_AP_FT_SYMLINK;
    return SP_AP_FT_OTHER;
}

static sp_ap_str_t sv(const char *s)
{
    return (sp_ap_str_t){s, (uint32_t)strlen(s)};
}

static const char *base_name(const char *path)
{
    const char *b = strrchr(path, '/');
    return b != NULL && b[1] ? b + 1 : path;
}

/* uid/gid -> name for one request: a big listing would otherwise re-read
 * /etc/passwd and /etc/group twice per entry. Cleared per request so user
 * changes show up on the next one. */
#define NAME_CACHE 16
static struct {
    unsigned id;
    bool is_group;
    char name[64];
} name_cache[NAME_CACHE];
static int name_cache_len;

static void id_name(unsigned id, bool is_group, char *out, size_t cap)
{
    for (int i = 0; i < name_cache_len; i++) {
        if (name_cache[i].id == id && name_cache[i].is_group == is_group) {
            snprintf(out, cap, "%s", name_cache[i].name);
            return;
        }
    }
    if (is_group)
        sp_users_gid_name(id, out, cap);
    else
        sp_users_uid_name(id, out, cap);
    if (name_cache_len < NAME_CACHE) {
        name_cache[name_cache_len].id = id;
        name_cache[name_cache_len].is_group = is_group;
        snprintf(name_cache[name_cache_len].name, sizeof(name_cache[0].name), "%s", out);
        name_cache_len++;
    }
}

/* Appends entry fields for path (already lstat'ed into st) to w. */
static void put_entry(sp_ap_writer_t *w, const char *path, const struct stat *st)
{
    char owner[64], group[64], link[PATH_MAX] = "", target[PATH_MAX] = "";
    struct stat tst;
    id_name(st->st_uid, false, owner, sizeof(owner));
    id_name(st->st_gid, true, group, sizeof(group));
    if (S_ISLNK(st->st_mode)) {
        ssize_t n = readlink(path, link, sizeof(link) - 1);
        link[n > 0 ? n : 0] = 0;
        /* What the link finally names, and what that is (envd reports a link by its target). */
        if (realpath(path, target) == NULL || stat(target, &tst) < 0)
            target[0] = 0;
    }
    uint32_t special = S_ISFIFO(st->st_mode)   ? SP_AP_SPECIAL_FIFO
                       : S_ISSOCK(st->st_mode) ? SP_AP_SPECIAL_SOCKET
                       : S_ISCHR(st->st_mode)  ? SP_AP_SPECIAL_CHAR
                       : S_ISBLK(st->st_mode)  ? SP_AP_SPECIAL_BLOCK
                                               : 0;
    sp_ap_entry_t e = {
        .path = sv(path),
        .name = sv(base_name(path)),
        .ftype = ftype_of(st->st_mode),
        .size = (uint64_t)st->st_size,
        .mode = (uint32_t)(st->st_mode & 07777),
        .uid = st->st_uid,
        .gid = st->st_gid,
        .owner = sv(owner),
        .group = sv(group),
        .mtime_ns = (uint64_t)st->st_mtim.tv_sec * 1000000000u + (uint64_t)st->st_mtim.tv_nsec,
        .link = link[0] ? sv(link) : (sp_ap_str_t){NULL, 0},
        .target = target[0] ? sv(target) : (sp_ap_str_t){NULL, 0},
        .target_ftype = target[0] ? ftype_of(tst.st_mode) : 0,
        .target_mode = target[0] ? (uint32_t)(tst.st_mode & 07777) : 0,
        .special = special,
    };
    sp_ap_put_entry(w, &e);
}

/* Sends OK (END) with the entry of path; creds must still be the user's. */
static void ok_entry(uint32_t id, const char *path)
{
    struct stat st;
    sp_ap_writer_t *w = sp_chan_begin(id, SP_AP_T_OK, SP_AP_F_END, 2 * PATH_MAX + 512);
    if (w == NULL)
        return;
    if (lstat(path, &st) == 0)
        put_entry(w, path, &st);
    sp_chan_end(w);
}

/* ---- stat ---- */

static void do_stat(req_t *r)
{
    struct stat st;
    if (lstat(r->path, &st) < 0) {
        sp_sess_error_errno(r->id, errno, "stat");
        return;
    }
    ok_entry(r->id, r->path);
}

/* ---- read ---- */

typedef struct {
    int fd;
    uint64_t left; /* bytes still to send */
    uint64_t sent;
} rd_t;

static void rd_pump(sp_stream_t *s)
{
    rd_t *rd = s->obj;
    while (sp_chan_tx_ok() && s->send_credit > 0) {
        size_t want = SP_AP_MAX_DATA;
        if (want > s->send_credit)
            want = (size_t)s->send_credit;
        if (want > rd->left)
            want = (size_t)rd->left;
        ssize_t got = 0;
        if (want > 0) {
            sp_ap_writer_t *w = sp_chan_begin(s->id, SP_AP_T_DATA, 0, want);
            if (w == NULL)
                return;
            got = read(rd->fd, w->buf + w->len, want);
            if (got < 0) {
                sp_sess_error_errno(s->id, errno, "read");
                return;
            }
            if (got > 0) {
                w->len += (size_t)got;
                sp_chan_end(w);
            }
        }
        if (got == 0) { /* EOF or LENGTH reached; an unended frame is discarded */
            sp_ap_writer_t *ok = sp_chan_begin(s->id, SP_AP_T_OK, SP_AP_F_END, 16);
            if (ok != NULL) {
                sp_ap_put_u64(ok, SP_AP_K_SIZE, rd->sent);
                sp_chan_end(ok);
            }
            sp_stream_close(s);
            return;
        }
        rd->sent += (uint64_t)got;
        rd->left -= (uint64_t)got;
        s->send_credit -= (uint64_t)got;
    }
}

static void rd_frame(sp_stream_t *s, const sp_ap_hdr_t *h, const uint8_t *p)
{
    sp_stream_bad_type(s, h->type, "read");
}

static void rd_close(sp_stream_t *s)
{
    rd_t *rd = s->obj;
    close(rd->fd);
    free(rd);
}

static const sp_stream_ops_t rd_ops = {rd_frame, rd_pump, rd_close};

static void do_read(req_t *r)
{
    uint64_t off = 0, len = 0;
    if (sp_ap_get_u64(r->p, r->n, SP_AP_K_OFFSET, &off) < 0 ||
        sp_ap_get_u64(r->p, r->n, SP_AP_K_LENGTH, &len) < 0 || off > (uint64_t)INT64_MAX) {
        sp_sess_error(r->id, SP_AP_E_INVAL, 0, "bad offset or length");
        return;
    }
    int fd = open(r->path, O_RDONLY | O_CLOEXEC | O_NONBLOCK);
    if (fd < 0) {
        sp_sess_error_errno(r->id, errno, "open");
        return;
    }
    struct stat st;
    if (fstat(fd, &st) < 0 || !S_ISREG(st.st_mode)) {
        /* FIFOs and devices could block the loop or never end. */
        close(fd);
        sp_sess_error(r->id, S_ISDIR(st.st_mode) ? SP_AP_E_ISDIR : SP_AP_E_INVAL, 0,
                      "not a regular file");
        return;
    }
    rd_t *rd = calloc(1, sizeof(*rd));
    if (rd == NULL || (off > 0 && lseek(fd, (off_t)off, SEEK_SET) < 0)) {
        free(rd);
        close(fd);
        sp_sess_error(r->id, SP_AP_E_IO, errno, "seek");
        return;
    }
    rd->fd = fd;
    rd->left = len ? len : UINT64_MAX;
    sp_stream_t *s = sp_sess_open(r->id, &rd_ops, rd);
    if (s == NULL) {
        rd_close(&(sp_stream_t){.obj = rd});
        return;
    }
    rd_pump(s);
}

/* ---- mkdir -p ---- */

/* Creates path and its parents; an existing directory is fine. 0 or -1 (errno). */
static int mkdir_p(const char *path, mode_t mode)
{
    char tmp[PATH_MAX];
    snprintf(tmp, sizeof(tmp), "%s", path);
    for (char *p = tmp + 1;; p++) {
        if (*p != '/' && *p != 0)
            continue;
        char c = *p;
        *p = 0;
        if (mkdir(tmp, mode) < 0) {
            struct stat st;
            if (errno != EEXIST || stat(tmp, &st) < 0 || !S_ISDIR(st.st_mode)) {
                if (errno == EEXIST || errno == 0)
                    errno = ENOTDIR;
                return -1;
            }
        }
        *p = c;
        if (c == 0)
            return 0;
    }
}

static void do_mkdir(req_t *r)
{
    uint32_t mode = 0755;
    if (sp_ap_get_u32(r->p, r->n, SP_AP_K_MODE, &mode) < 0) {
        sp_sess_error(r->id, SP_AP_E_INVAL, 0, "bad mode");
        return;
    }
    if (mkdir_p(r->path, mode & 07777) < 0) {
        sp_sess_error_errno(r->id, errno, "mkdir");
        return;
    }
    ok_entry(r->id, r->path);
}

/* ---- write ---- */

typedef struct {
    int fd;
    sp_user_t user;
    char tmp[PATH_MAX];
    char dst[PATH_MAX];
} wr_t;

static void wr_close(sp_stream_t *s)
{
    wr_t *wr = s->obj;
    if (wr->fd >= 0) { /* abandoned before EOF: drop the partial file */
        close(wr->fd);
        unlink(wr->tmp);
    }
    free(wr);
}

static void wr_finish(sp_stream_t *s, wr_t *wr)
{
    int rc = fsync(wr->fd);
    int e = errno;
    if (close(wr->fd) < 0 && rc == 0) {
        rc = -1;
        e = errno;
    }
    wr->fd = -1;
    if (rc == 0 && sp_users_enter(&wr->user) == 0) {
        rc = rename(wr->tmp, wr->dst);
        e = errno;
        if (rc == 0)
            ok_entry(s->id, wr->dst);
        sp_users_leave();
    } else if (rc == 0) {
        rc = -1;
        e = errno;
    }
    if (rc < 0) {
        unlink(wr->tmp);
        sp_sess_error_errno(s->id, e, "write");
        return;
    }
    sp_stream_close(s);
}

static void wr_frame(sp_stream_t *s, const sp_ap_hdr_t *h, const uint8_t *p)
{
    wr_t *wr = s->obj;
    if (h->type == SP_AP_T_EOF) {
        wr_finish(s, wr);
        return;
    }
    if (h->type != SP_AP_T_DATA) {
        sp_stream_bad_type(s, h->type, "write");
        return;
    }
    /* Local disk: a blocking full write is bounded and keeps the code simple. */
    for (size_t done = 0; done < h->len;) {
        ssize_t n = write(wr->fd, p + done, h->len - done);
        if (n < 0 && errno == EINTR)
            continue;
        if (n <= 0) {
            sp_sess_error_errno(s->id, n < 0 ? errno : EIO, "write");
            return;
        }
        done += (size_t)n;
    }
    sp_stream_grant(s, h->len);
}

static const sp_stream_ops_t wr_ops = {wr_frame, NULL, wr_close};

static void do_write(req_t *r)
{
    uint32_t mode = 0, mkdirs = 0;
    bool has_mode = false;
    sp_ap_field_t f;
    if (sp_ap_find(r->p, r->n, SP_AP_K_MODE, &f) == 1) {
        if (sp_ap_field_u32(&f, &mode) < 0) {
            sp_sess_error(r->id, SP_AP_E_INVAL, 0, "bad mode");
            return;
        }
        has_mode = true;
    }
    if (sp_ap_get_u32(r->p, r->n, SP_AP_K_MKDIRS, &mkdirs) < 0) {
        sp_sess_error(r->id, SP_AP_E_INVAL, 0, "bad mkdirs");
        return;
    }
    struct stat st;
    if (!has_mode)
        mode = lstat(r->path, &st) == 0 && S_ISREG(st.st_mode) ? st.st_mode & 07777 : 0644;
    else if (lstat(r->path, &st) == 0 && S_ISDIR(st.st_mode)) {
        sp_sess_error(r->id, SP_AP_E_ISDIR, EISDIR, "is a directory");
        return;
    }
    char dir[PATH_MAX];
    snprintf(dir, sizeof(dir), "%s", r->path);
    char *slash = strrchr(dir, '/');
    if (slash != NULL)
        *(slash == dir ? slash + 1 : slash) = 0;
    if (mkdirs && mkdir_p(dir, 0755) < 0) {
        sp_sess_error_errno(r->id, errno, "mkdir");
        return;
    }
    wr_t *wr = calloc(1, sizeof(*wr));
    if (wr == NULL) {
        sp_sess_error(r->id, SP_AP_E_INTERNAL, ENOMEM, "out of memory");
        return;
    }
    static unsigned counter;
    wr->user = r->user;
    snprintf(wr->dst, sizeof(wr->dst), "%s", r->path);
    int len = snprintf(wr->tmp, sizeof(wr->tmp), "%s/.%s.sp-%d-%u", dir, base_name(r->path),
                       (int)getpid(), counter++);
    wr->fd = len > 0 && (size_t)len < sizeof(wr->tmp)
                 ? open(wr->tmp, O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0600)
                 : (errno = ENAMETOOLONG, -1);
    if (wr->fd < 0 || fchmod(wr->fd, mode & 07777) < 0) {
        int e = errno;
        if (wr->fd >= 0) {
            close(wr->fd);
            unlink(wr->tmp);
        }
        free(wr);
        sp_sess_error_errno(r->id, e, "create");
        return;
    }
    if (sp_sess_open(r->id, &wr_ops, wr) == NULL) {
        close(wr->fd);
        unlink(wr->tmp);
        free(wr);
    }
}

/* ---- list ---- */

typedef struct {
    uint32_t id;
    uint32_t count;
    bool truncated;
} list_t;

static void list_dir(list_t *l, const char *dir, uint32_t depth)
{
    DIR *d = opendir(dir);
    if (d == NULL)
        return;
    struct dirent *de;
    while ((de = readdir(d)) != NULL) {
        if (strcmp(de->d_name, ".") == 0 || strcmp(de->d_name, "..") == 0)
            continue;
        if (l->count >= SP_AP_LIST_MAX) {
            l->truncated = true;
            break;
        }
        char path[PATH_MAX];
        struct stat st;
        int n = snprintf(path, sizeof(path), "%s%s%s", dir,
                         dir[strlen(dir) - 1] == '/' ? "" : "/", de->d_name);
        if (n < 0 || (size_t)n >= sizeof(path) || lstat(path, &st) < 0)
            continue;
        sp_ap_writer_t *w = sp_chan_begin(l->id, SP_AP_T_FS_ENTRY, 0, 2 * PATH_MAX + 512);
        if (w != NULL) {
            put_entry(w, path, &st);
            sp_chan_end(w);
        }
        l->count++;
        if (S_ISDIR(st.st_mode) && depth > 1) /* never follows symlinks: no loops */
            list_dir(l, path, depth - 1);
    }
    closedir(d);
}

static void do_list(req_t *r)
{
    uint32_t depth = 1;
    if (sp_ap_get_u32(r->p, r->n, SP_AP_K_DEPTH, &depth) < 0) {
        sp_sess_error(r->id, SP_AP_E_INVAL, 0, "bad depth");
        return;
    }
    if (depth == 0)
        depth = 1;
    if (depth > 64)
        depth = 64; /* bounds the recursion (stack) */
    struct stat st;
    if (stat(r->path, &st) < 0 || !S_ISDIR(st.st_mode)) {
        sp_sess_error_errno(r->id, errno ? errno : ENOTDIR, "list");
        return;
    }
    DIR *probe = opendir(r->path);
    if (probe == NULL) {
        sp_sess_error_errno(r->id, errno, "list");
        return;
    }
    closedir(probe);
    list_t l = {.id = r->id};
    list_dir(&l, r->path, depth);
    sp_ap_writer_t *w = sp_chan_begin(r->id, SP_AP_T_OK, SP_AP_F_END, 16);
    if (w != NULL) {
        if (l.truncated)
            sp_ap_put_u32(w, SP_AP_K_TRUNCATED, 1);
        sp_chan_end(w);
    }
}

/* ---- move, remove, chmod, chown ---- */

static void do_move(req_t *r)
{
    char dst[PATH_MAX];
    if (get_path(r, SP_AP_K_DEST, dst, sizeof(dst)) < 0)
        return;
    if (rename(r->path, dst) < 0) {
        sp_sess_error_errno(r->id, errno, "move");
        return;
    }
    ok_entry(r->id, dst);
}

/* Removes what is at fd/name (a directory recursively). 0 or -1 (errno). */
static int remove_at(int dirfd, const char *name, int budget)
{
    if (unlinkat(dirfd, name, 0) == 0)
        return 0;
    if (errno != EISDIR && errno != EPERM)
        return -1;
    if (budget <= 0) {
        errno = ELOOP;
        return -1;
    }
    int fd = openat(dirfd, name, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
    if (fd < 0)
        return -1;
    DIR *d = fdopendir(fd);
    if (d == NULL) {
        close(fd);
        return -1;
    }
    struct dirent *de;
    int rc = 0;
    while (rc == 0 && (de = readdir(d)) != NULL) {
        if (strcmp(de->d_name, ".") != 0 && strcmp(de->d_name, "..") != 0)
            rc = remove_at(fd, de->d_name, budget - 1);
    }
    closedir(d);
    return rc == 0 ? unlinkat(dirfd, name, AT_REMOVEDIR) : -1;
}

static void do_remove(req_t *r)
{
    uint32_t recursive = 0;
    if (sp_ap_get_u32(r->p, r->n, SP_AP_K_RECURSIVE, &recursive) < 0) {
        sp_sess_error(r->id, SP_AP_E_INVAL, 0, "bad recursive");
        return;
    }
    int rc;
    if (recursive) {
        rc = remove_at(AT_FDCWD, r->path, 256);
    } else {
        rc = unlink(r->path);
        if (rc < 0 && (errno == EISDIR || errno == EPERM))
            rc = rmdir(r->path);
    }
    if (rc < 0) {
        sp_sess_error_errno(r->id, errno, "remove");
        return;
    }
    sp_sess_send_empty(r->id, SP_AP_T_OK, SP_AP_F_END);
}

static void do_chmod(req_t *r)
{
    uint32_t mode;
    sp_ap_field_t f;
    if (sp_ap_find(r->p, r->n, SP_AP_K_MODE, &f) != 1 || sp_ap_field_u32(&f, &mode) < 0) {
        sp_sess_error(r->id, SP_AP_E_INVAL, 0, "chmod needs a mode");
        return;
    }
    if (chmod(r->path, mode & 07777) < 0) {
        sp_sess_error_errno(r->id, errno, "chmod");
        return;
    }
    ok_entry(r->id, r->path);
}

static void do_chown(req_t *r)
{
    sp_ap_str_t owner, group;
    uid_t uid = (uid_t)-1;
    gid_t gid = (gid_t)-1;
    char name[64];
    if (sp_ap_get_str(r->p, r->n, SP_AP_K_OWNER, &owner) < 0 ||
        sp_ap_get_str(r->p, r->n, SP_AP_K_GROUP_NAME, &group) < 0 ||
        (owner.p == NULL && group.p == NULL) || owner.n >= sizeof(name) ||
        group.n >= sizeof(name)) {
        sp_sess_error(r->id, SP_AP_E_INVAL, 0, "chown needs owner or group");
        return;
    }
    if (owner.p != NULL) {
        sp_user_t u;
        snprintf(name, sizeof(name), "%.*s", (int)owner.n, owner.p);
        if (sp_users_lookup(name, &u, NULL) < 0) {
            sp_sess_error(r->id, SP_AP_E_NOTFOUND, 0, "unknown owner");
            return;
        }
        uid = u.uid;
    }
    if (group.p != NULL) {
        snprintf(name, sizeof(name), "%.*s", (int)group.n, group.p);
        if (sp_users_group_gid(name, &gid) < 0) {
            sp_sess_error(r->id, SP_AP_E_NOTFOUND, 0, "unknown group");
            return;
        }
    }
    if (lchown(r->path, uid, gid) < 0) {
        sp_sess_error_errno(r->id, errno, "chown");
        return;
    }
    ok_entry(r->id, r->path);
}

void sp_fs_on_request(uint16_t type, uint32_t id, const uint8_t *p, uint32_t n)
{
    static req_t r; /* PATH_MAX buffers: keep them off the stack */
    name_cache_len = 0;
    if (parse_req(&r, id, p, n) < 0 || enter(&r) < 0)
        return;
    switch (type) {
    case SP_AP_T_FS_STAT:
        do_stat(&r);
        break;
    case SP_AP_T_FS_READ:
        do_read(&r);
        break;
    case SP_AP_T_FS_WRITE:
        do_write(&r);
        break;
    case SP_AP_T_FS_LIST:
        do_list(&r);
        break;
    case SP_AP_T_FS_MKDIR:
        do_mkdir(&r);
        break;
    case SP_AP_T_FS_MOVE:
        do_move(&r);
        break;
    case SP_AP_T_FS_REMOVE:
        do_remove(&r);
        break;
    case SP_AP_T_FS_CHMOD:
        do_chmod(&r);
        break;
    case SP_AP_T_FS_CHOWN:
        do_chown(&r);
        break;
    default:
        sp_sess_error(id, SP_AP_E_TYPE, 0, "unknown request");
    }
    sp_users_leave();
}
