/*
 * users.h - users and groups from /etc/passwd and /etc/group, read directly.
 *
 * A static binary cannot rely on NSS, so getpwnam() is avoided. Also owns
 * switching the agent's filesystem credentials to a user around file
 * operations (setfsuid/setfsgid/setgroups), which is safe because the agent
 * is single-threaded.
 */
#ifndef SP_AGENT_USERS_H
#define SP_AGENT_USERS_H

#include <stddef.h>
#include <sys/types.h>

#include "base/err.h"

#define SP_USER_MAX_GROUPS 64

typedef struct {
    char name[64];
    uid_t uid;
    gid_t gid;
    char home[256];
    char shell[256];
    gid_t groups[SP_USER_MAX_GROUPS]; /* supplementary, primary included */
    int ngroups;
} sp_user_t;

/* Finds a user by name ("" or NULL: root). -1 with SP_ENOTFOUND if unknown. */
int sp_users_lookup(const char *name, sp_user_t *u, sp_err_t *err);
/* Names for ids; writes the decimal id if unknown. */
void sp_users_uid_name(uid_t uid, char *out, size_t cap);
void sp_users_gid_name(gid_t gid, char *out, size_t cap);
/* Group id by name (or decimal). 0 or -1. */
int sp_users_group_gid(const char *name, gid_t *gid);
/* Overrides the files read (tests); NULL restores /etc. */
void sp_users_set_root(const char *etc_dir);

/* A path as the API gives it, made absolute for u the way E2B's envd does: absolute paths
 * are kept as given; "~" and "~/x" are u's home and below it; other relative paths are under
 * u's home; both of those are cleaned lexically ("..", "." and "//" resolved, no trailing
 * slash). -1 with SP_EINVAL for "~name" forms and paths that do not fit cap. */
int sp_users_resolve_path(const sp_user_t *u, const char *path, size_t n, char *out, size_t cap,
                          sp_err_t *err);

/* Filesystem access as u until sp_users_leave(). 0 or -1 (errno set). */
int sp_users_enter(const sp_user_t *u);
void sp_users_leave(void);

#endif
