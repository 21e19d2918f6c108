/*
 * watch.c - WATCH_START streams: inotify events become WATCH_EVENT frames.
 *
 * Recursive watches add every subdirectory at start and each new one as it
 * appears (a directory created and filled before its watch lands loses those
 * first events; inotify cannot close that gap). Events are dropped, not
 * queued, when the channel is backed up: watchers are best effort.
 */
#include "agent/watch.h"

#include <dirent.h>
#include <errno.h>
#include <limits.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/inotify.h>
#include <sys/stat.h>
#include <unistd.h>

#include "agent/chan.h"
#include "agent/ev.h"
#include "agent/sess.h"
#include "agent/users.h"

#define WATCH_MAX_DIRS 4096
#define WATCH_MASK                                                                                 \
    (IN_CREATE | IN_MODIFY | IN_CLOSE_WRITE | IN_DELETE | IN_MOVED_FROM | IN_MOVED_TO |            \
     IN_ATTRIB | IN_DELETE_SELF | IN_MOVE_SELF)

typedef struct {
    int wd;
    char *path;
} wdir_t;

typedef struct {
    sp_stream_t *s;
    int fd;
    sp_ev_t *ev;
    bool recursive;
    sp_user_t user;
    wdir_t *dirs;
    size_t ndirs;
} watch_t;

static const char *dir_of(watch_t *w, int wd)
{
    for (size_t i = 0; i < w->ndirs; i++)
        if (w->dirs[i].wd == wd)
            return w->dirs[i].path;
    return NULL;
}

/* Adds a watch on path (and, if recursive, its subdirectories). Creds must be the user's. */
static int add_dir(watch_t *w, const char *path, int budget)
{
    if (w->ndirs >= WATCH_MAX_DIRS)
        return 0;
    int wd = inotify_add_watch(w->fd, path, WATCH_MASK | IN_ONLYDIR);
    if (wd < 0)
        return -1;
    if (dir_of(w, wd) == NULL) {
        wdir_t *nd = realloc(w->dirs, (w->ndirs + 1) * sizeof(*nd));
        char *p = strdup(path);
        if (nd == NULL || p == NULL) {
            free(p);
            if (nd != NULL)
                w->dirs = nd;
            return -1;
        }
        w->dirs = nd;
        w->dirs[w->ndirs++] = (wdir_t){wd, p};
    }
    if (!w->recursive || budget <= 0)
        return 0;
    DIR *d = opendir(path);
    if (d == NULL)
        return 0;
    struct dirent *de;
    while ((de = readdir(d)) != NULL) {
        if (de->d_type != DT_DIR || strcmp(de->d_name, ".") == 0 || strcmp(de->d_name, "..") == 0)
            continue;
        char sub[PATH_MAX];
        if (snprintf(sub, sizeof(sub), "%s/%s", path, de->d_name) < (int)sizeof(sub))
            add_dir(w, sub, budget - 1);
    }
    closedir(d);
    return 0;
}

static uint32_t event_bits(uint32_t m)
{
    uint32_t ev = 0;
    if (m & IN_CREATE)
        ev |= SP_AP_EV_CREATE;
    if (m & (IN_MODIFY | IN_CLOSE_WRITE))
        ev |= SP_AP_EV_WRITE;
    if (m & (IN_DELETE | IN_DELETE_SELF))
        ev |= SP_AP_EV_REMOVE;
    if (m & (IN_MOVED_FROM | IN_MOVED_TO | IN_MOVE_SELF))
        ev |= SP_AP_EV_RENAME;
    if (m & IN_ATTRIB)
        ev |= SP_AP_EV_CHMOD;
    return ev;
}

static void emit(watch_t *w, const struct inotify_event *ie)
{
    const char *dir = dir_of(w, ie->wd);
    uint32_t bits = event_bits(ie->mask);
    if (dir == NULL || bits == 0)
        return;
    char path[PATH_MAX];
    const char *name = ie->len ? ie->name : "";
    snprintf(path, sizeof(path), "%s%s%s", dir, *name ? "/" : "", name);
    if (w->recursive && (ie->mask & IN_ISDIR) && (ie->mask & (IN_CREATE | IN_MOVED_TO))) {
        if (sp_users_enter(&w->user) == 0) {
            add_dir(w, path, 32);
            sp_users_leave();
        }
    }
    if (!sp_chan_tx_ok())
        return;
    sp_ap_writer_t *fw = sp_chan_begin(w->s->id, SP_AP_T_WATCH_EVENT, 0, 2 * PATH_MAX + 64);
    if (fw == NULL)
        return;
    sp_ap_put_str(fw, SP_AP_K_PATH, path);
    sp_ap_put_str(fw, SP_AP_K_NAME, name);
    sp_ap_put_u32(fw, SP_AP_K_EVENT, bits);
    sp_ap_put_u32(fw, SP_AP_K_FTYPE, (ie->mask & IN_ISDIR) ? SP_AP_FT_DIR : SP_AP_FT_FILE);
    sp_chan_end(fw);
}

static void on_inotify(int fd, short rev, void *arg)
{
    watch_t *w = arg;
    /* Aligned as inotify requires. */
    char buf[8192] __attribute__((aligned(__alignof__(struct inotify_event))));
    ssize_t n = read(fd, buf, sizeof(buf));
    if (n <= 0)
        return;
    bool gone = false;
    for (char *p = buf; p < buf + n;) {
        const struct inotify_event *ie = (const struct inotify_event *)p;
        emit(w, ie);
        if ((ie->mask & IN_IGNORED) && w->ndirs > 0 && ie->wd == w->dirs[0].wd)
            gone = true;
        p += sizeof(*ie) + ie->len;
    }
    if (gone)
        sp_sess_error(w->s->id, SP_AP_E_NOTFOUND, ENOENT, "watched directory is gone");
}

static void watch_frame(sp_stream_t *s, const sp_ap_hdr_t *h, const uint8_t *p)
{
    sp_stream_bad_type(s, h->type, "watch");
}

static void watch_close(sp_stream_t *s)
{
    watch_t *w = s->obj;
    sp_ev_del(w->ev);
    close(w->fd);
    for (size_t i = 0; i < w->ndirs; i++)
        free(w->dirs[i].path);
    free(w->dirs);
    free(w);
}

static const sp_stream_ops_t watch_ops = {watch_frame, NULL, watch_close};

static int start(uint32_t id, watch_t *w, const char *path)
{
    if (sp_users_enter(&w->user) < 0) {
        sp_sess_error_errno(id, errno, "switch user");
        return -1;
    }
    int rc = add_dir(w, path, 32);
    int e = errno;
    sp_users_leave();
    if (rc < 0) {
        sp_sess_error_errno(id, e, "watch");
        return -1;
    }
    return 0;
}

void sp_watch_on_start(uint32_t id, const uint8_t *p, uint32_t n)
{
    sp_ap_str_t path, user;
    uint32_t rec = 0;
    char uname[64] = "", full[PATH_MAX];
    sp_err_t err;
    if (sp_ap_get_str(p, n, SP_AP_K_PATH, &path) < 0 || path.p == NULL ||
        sp_ap_get_str(p, n, SP_AP_K_USER, &user) < 0 || user.n >= sizeof(uname) ||
        sp_ap_get_u32(p, n, SP_AP_K_RECURSIVE, &rec) < 0) {
        sp_sess_error(id, SP_AP_E_INVAL, 0, "watch needs a path");
        return;
    }
    if (user.p != NULL)
        memcpy(uname, user.p, user.n);
    watch_t *w = calloc(1, sizeof(*w));
    if (w == NULL)
        return;
    if (sp_users_lookup(uname, &w->user, &err) < 0) {
        free(w);
        sp_sess_error(id, SP_AP_E_NOTFOUND, 0, "%s", err.msg);
        return;
    }
    bool resolved = sp_users_resolve_path(&w->user, path.p, path.n, full, sizeof(full), &err) == 0;
    w->recursive = rec != 0;
    w->fd = inotify_init1(IN_NONBLOCK | IN_CLOEXEC);
    int rc = -1;
    if (!resolved)
        sp_sess_error(id, SP_AP_E_INVAL, 0, "%s", err.msg);
    else if (w->fd < 0)
        sp_sess_error_errno(id, errno, "inotify");
    else
        rc = start(id, w, full); /* replies itself on failure */
    if (rc < 0) {
        if (w->fd >= 0)
            close(w->fd);
        for (size_t i = 0; i < w->ndirs; i++)
            free(w->dirs[i].path);
        free(w->dirs);
        free(w);
        return;
    }
    w->s = sp_sess_open(id, &watch_ops, w);
    w->ev = sp_ev_add(w->fd, POLLIN, on_inotify, w);
    sp_sess_send_empty(id, SP_AP_T_WATCH_STARTED, 0);
}
