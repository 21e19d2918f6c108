/*
 * admin.h - the operator's side of teams and API keys on the event loop: what the
 * /v1/admin routes call.
 *
 * Authenticated by the installation's one admin key (core/control/keys.h makes it; its keyed
 * hash is in settings), never by a team's key, and a team key's hash never matches it: the
 * two credentials open disjoint sets of routes. Teams are named by name or ID. Revoking
 * notifies `space_keys`, so every server forgets cached authentications at once. Calls
 * follow core/control/svc.h's contract: an accepted call (0) calls back exactly once, never
 * before it returns; a refused one (-1) never calls back. Records are borrowed for the
 * callback only. Does not hold HTTP, and does not create the admin key.
 */
#ifndef SP_ADMIN_H
#define SP_ADMIN_H

#include <stddef.h>

#include "base/err.h"
#include "base/ids.h"
#include "core/store/store.h"

typedef struct sp_admin sp_admin_t;

#define SP_ADMIN_NQUOTA 4 /* sandboxes, vcpus, memory_mb, snapshot_mb */

typedef struct {
    char id[SP_ID_LEN + 1];
    char name[65];
    char created_at[32];
    long active_keys; /* keys not revoked */
    /* the team's quotas (core/control/svc.h): sandboxes, vcpus, memory_mb, snapshot_mb; -1:
     * the server's default */
    long quota[SP_ADMIN_NQUOTA];
} sp_admin_team_t;

#define SP_ADMIN_QUOTA_KEEP    (-2L)        /* sp_admin_team_set_quota: leave this one */
#define SP_ADMIN_QUOTA_DEFAULT (-1L)        /* back to the server's default */
#define SP_ADMIN_QUOTA_MAX     1000000000L /* the highest limit a team may be given */

typedef struct {
    char id[SP_ID_LEN + 1];
    char team_id[SP_ID_LEN + 1];
    char team[65];
    char prefix[SP_KEY_PREFIX + 1];
    char name[129];
    char created_at[32];
    char revoked_at[32]; /* "" while active */
} sp_admin_key_t;

#define SP_ADMIN_MAX_KEY_NAME 128 /* bytes */

typedef void (*sp_admin_done_cb)(void *arg, const sp_err_t *err);
typedef void (*sp_admin_teams_cb)(void *arg, const sp_admin_team_t *teams, size_t n,
                                  const sp_err_t *err);
/* secret: the new key's secret (create only, shown once), else NULL. */
typedef void (*sp_admin_keys_cb)(void *arg, const sp_admin_key_t *keys, size_t n,
                                 const char *secret, const sp_err_t *err);

/* store is borrowed; hashkey is the installation's key-hash key (core/control/keys.h). */
sp_admin_t *sp_admin_create(sp_store_t *store, const unsigned char hashkey[SP_HASHKEY_LEN]);
void sp_admin_destroy(sp_admin_t *a);

/* SP_EAUTH when key is missing or is not the admin key (a team's key included). */
int sp_admin_authenticate(sp_admin_t *a, const char *key, sp_admin_done_cb cb, void *arg,
                          sp_err_t *err);

/* Every team, oldest first. */
int sp_admin_teams(sp_admin_t *a, sp_admin_teams_cb cb, void *arg, sp_err_t *err);
/* A new team (name as sp_keys_check_team_name): SP_ECONFLICT when the name is taken. */
int sp_admin_team_create(sp_admin_t *a, const char *name, sp_admin_teams_cb cb, void *arg,
                         sp_err_t *err);

/* Sets the team's quotas (sandboxes, vcpus, memory_mb, snapshot_mb, in that order): each
 * SP_ADMIN_QUOTA_KEEP, SP_ADMIN_QUOTA_DEFAULT or 0 to SP_ADMIN_QUOTA_MAX (0: none may be held;
 * SP_EINVAL otherwise). Calls back with the team as it is then; SP_ENOTFOUND for an unknown
 * team. */
int sp_admin_team_set_quota(sp_admin_t *a, const char *team, const long limits[SP_ADMIN_NQUOTA],
                            sp_admin_teams_cb cb, void *arg, sp_err_t *err);

/* The team's keys, revoked ones included, oldest first; SP_ENOTFOUND for an unknown team. */
int sp_admin_keys(sp_admin_t *a, const char *team, sp_admin_keys_cb cb, void *arg, sp_err_t *err);
/* A new key for an existing team (SP_ENOTFOUND otherwise); name may be NULL. */
int sp_admin_key_create(sp_admin_t *a, const char *team, const char *name, sp_admin_keys_cb cb,
                        void *arg, sp_err_t *err);
/* Revokes the team's active key with this ID or prefix; SP_ENOTFOUND when there is none. */
int sp_admin_key_revoke(sp_admin_t *a, const char *team, const char *key, sp_admin_keys_cb cb,
                        void *arg, sp_err_t *err);

#endif
