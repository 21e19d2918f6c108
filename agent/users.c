/*
 * users.c - /etc/passwd and /etc/group parsing, fs credential switching.
 *
 * The files are re-read on every lookup: they are small, and a process in
 * the sandbox may add users at any time (useradd) without telling us.
 */
#include "agent/users.h"

#include <errno.h>
#include <grp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/fsuid.h>
#include <unistd.h>

static const char *etc_dir = "/etc";

void sp_users_set_root(const char *dir)
{
    etc_dir = dir != NULL ? dir : "/etc";
}

static FILE *open_etc(const char *name)
{
    char path[512];
    snprintf(path, sizeof(path), "%s/%s", etc_dir, name);
    return fopen(path, "re");
}

/* Splits a colon line into at most max fields in place; returns the count. */
static int split(char *line, char **f, int max)
{
    int n = 0;
    line[strcspn(line, "\n")] = 0;
    f[n++] = line;
    for (char *p = line; *p && n < max; p++) {
        if (*p == ':') {
            *p = 0;
            f[n++] = p + 1;
        }
    }
    return n;
}

static int parse_id(const char *s, unsigned *out)
{
    char *end;
    errno = 0;
    unsigned long v = strtoul(s, &end, 10);
    if (*s == 0 || *end != 0 || errno != 0 || v > 0xfffffffful)
        return -1;
    *out = (unsigned)v;
    return 0;
}

static void copy(char *dst, size_t cap, const char *src)
{
    snprintf(dst, cap, "%s", src);
}

/* Adds the groups that list u->name as a member. */
static void load_groups(sp_user_t *u)
{
    u->groups[0] = u->gid;
    u->ngroups = 1;
    FILE *f = open_etc("group");
    if (f == NULL)
        return;
    char line[4096];
    char *fld[4];
    while (fgets(line, sizeof(line), f) != NULL && u->ngroups < SP_USER_MAX_GROUPS) {
        unsigned gid;
        if (split(line, fld, 4) < 4 || parse_id(fld[2], &gid) < 0 || gid == u->gid)
            continue;
        for (char *m = strtok(fld[3], ","); m != NULL; m = strtok(NULL, ",")) {
            if (strcmp(m, u->name) == 0) {
                u->groups[u->ngroups++] = gid;
                break;
            }
        }
    }
    fclose(f);
}

int sp_users_lookup(const char *name, sp_user_t *u, sp_err_t *err)
{
    if (name == NULL || name[0] == 0)
        name = "root";
    FILE *f = open_etc("passwd");
    if (f == NULL)
        return sp_err_set(err, SP_EUNAVAIL, "cannot read passwd");
    char line[4096];
    char *fld[7];
    int found = 0;
    while (!found && fgets(line, sizeof(line), f) != NULL) {
        unsigned uid, gid;
        if (split(line, fld, 7) < 7 || strcmp(fld[0], name) != 0)
            continue;
        if (parse_id(fld[2], &uid) < 0 || parse_id(fld[3], &gid) < 0)
            continue;
        memset(u, 0, sizeof(*u));
        copy(u->name, sizeof(u->name), fld[0]);
        u->uid = uid;
        u->gid = gid;
        copy(u->home, sizeof(u->home), fld[5][0] ? fld[5] : "/");
        copy(u->shell, sizeof(u->shell), fld[6][0] ? fld[6] : "/bin/sh");
        found = 1;
    }
    fclose(f);
    if (!found)
        return sp_err_set(err, SP_ENOTFOUND, "unknown user");
    load_groups(u);
    return 0;
}

/* Finds field 0 of the line whose field 2 is id. */
static int name_of(const char *file, unsigned id, char *out, size_t cap)
{
    FILE *f = open_etc(file);
    if (f == NULL)
        return -1;
    char line[4096];
    char *fld[4];
    int found = -1;
    while (found < 0 && fgets(line, sizeof(line), f) != NULL) {
        unsigned v;
        if (split(line, fld, 4) >= 3 && parse_id(fld[2], &v) == 0 && v == id) {
            copy(out, cap, fld[0]);
            found = 0;
        }
    }
    fclose(f);
    return found;
}

void sp_users_uid_name(uid_t uid, char *out, size_t cap)
{
    if (name_of("passwd", uid, out, cap) < 0)
        snprintf(out, cap, "%u", (unsigned)uid);
}

void sp_users_gid_name(gid_t gid, char *out, size_t cap)
{
    if (name_of("group", gid, out, cap) < 0)
        snprintf(out, cap, "%u", (unsigned)gid);
}

int sp_users_group_gid(const char *name, gid_t *gid)
{
    unsigned v;
    if (parse_id(name, &v) == 0) {
        *gid = v;
        return 0;
    }
    FILE *f = open_etc("group");
    if (f == NULL)
        return -1;
    char line[4096];
    char *fld[4];
    int rc = -1;
    while (rc < 0 && fgets(line, sizeof(line), f) != NULL) {
        if (split(line, fld, 4) >= 3 && strcmp(fld[0], name) == 0 && parse_id(fld[2], &v) == 0) {
            *gid = v;
            rc = 0;
        }
    }
    fclose(f);
    return rc;
}

int sp_users_enter(const sp_user_t *u)
{
    if (u->uid == 0)
        return 0;
    /* Order matters: groups and fsgid while still privileged, fsuid last. A
     * non-zero fsuid also drops CAP_DAC_OVERRIDE/CAP_CHOWN/CAP_FOWNER for fs checks. */
    if (setgroups((size_t)u->ngroups, u->groups) < 0)
        return -1;
    setfsgid(u->gid);
    setfsuid(u->uid);
    if ((uid_t)setfsuid((uid_t)-1) != u->uid) {
        sp_users_leave();
        errno = EPERM;
        return -1;
    }
    return 0;
}

void sp_users_leave(void)
{
    setfsuid(0);
    setfsgid(0);
    setgroups(0, NULL);
}

/* Lexical clean of an absolute path in place, as Go's filepath.Clean: "//" and "/./" drop,
 * "/x/.." goes back a level (never above "/"), no trailing slash except "/" itself. */
static void clean_abs(char *p)
{
    char *w = p; /* p[0] == '/' */
    const char *r = p;
    *w++ = '/';
    while (*r != '\0') {
        while (*r == '/')
            r++;
        const char *s = r;
        while (*r != '\0' && *r != '/')
            r++;
        size_t n = (size_t)(r - s);
        if (n == 0 || (n == 1 && s[0] == '.'))
            continue;
        if (n == 2 && s[0] == '.' && s[1] == '.') {
            if (w > p + 1) {
                w--; /* the slash after the last element */
                while (w > p + 1 && w[-1] != '/')
                    w--;
            }
            continue;
        }
        memmove(w, s, n);
        w += n;
        *w++ = '/';
    }
    if (w > p + 1)
        w--;
    *w = '\0';
}

int sp_users_resolve_path(const sp_user_t *u, const char *path, size_t n, char *out, size_t cap,
                          sp_err_t *err)
{
    int len;
    if (n > 0 && path[0] == '/') {
        len = snprintf(out, cap, "%.*s", (int)n, path); /* absolute: as given, as envd does */
    } else if (n > 0 && path[0] == '~') {
        if (n > 1 && path[1] != '/')
            return sp_err_set(err, SP_EINVAL, "cannot expand another user's home directory");
        len = snprintf(out, cap, "%s/%.*s", u->home, (int)(n - 1), path + 1);
    } else {
        len = snprintf(out, cap, "%s/%.*s", u->home, (int)n, path);
    }
    if (len < 0 || (size_t)len >= cap)
        return sp_err_set(err, SP_EINVAL, "path too long");
    if (path[0] != '/' && out[0] == '/')
        clean_abs(out);
    return 0;
}
