/*
 * tmplfiles.h - the files template builds copy in (COPY steps): a team's uploads, each a tar
 * (plain or gzip) kept under a key, checked at upload (core/control/tarcheck.h) and never
 * unpacked on the host.
 *
 * Folder: core/control/ is sandboxes' lifecycle: these operations, states, the controller that
 * reconciles them, API keys. (ARCHITECTURE.md: the layers.)
 *
 * Layout: <data-dir>/template-files/<team id>/<key>, key = 64 lowercase hex characters; on a
 * worker with a shared snapshot dir, <snapshot-dir>/template-files/ instead
 * (sp_tmplfiles_set_dir), so that a build on any worker finds what was uploaded through
 * another (core/control/fleet.h spreads builds over workers by template). The
 * native API's key is the SHA-256 of the bytes uploaded (checked: verify); E2B's is the SDK's
 * own hash of the files (filesHash, opaque: not checked). An upload of a key that is there
 * already is answered at once ("existed") and its bytes are ignored: content is immutable per
 * key. Uploads are hashed, checked and written on a worker thread (SP_WORK_LONG), renamed
 * into place whole. Every lookup and upload of a key marks its last use (the file's mtime);
 * files unused for the build cache's time (tmpl.h: sp_tmpl_set_build_cache) are removed by
 * sp_tmplfiles_collect, and a later build asks for them again (E2B's SDK uploads what the
 * server says it lacks).
 *
 * Upload links (E2B's PUT to a URL the server gave, which JS sends without credentials): a
 * token binding team, key and an expiry (SP_TMPLFILES_LINK_S), authenticated with a key made
 * at start (links die with the process), or on many nodes one derived from the cluster key
 * (sp_tmplfiles_set_link_key), so that the link works through whichever worker answers it.
 */
#ifndef SP_TMPLFILES_H
#define SP_TMPLFILES_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "base/err.h"
#include "base/ids.h"
#include "loop/loop.h"

#define SP_TMPLFILES_MAX    (256u << 20)  /* bytes of one upload, as sent */
#define SP_TMPLFILES_TAR    (4ull << 30)  /* bytes of its tar, unpacked */
#define SP_TMPLFILES_LINK_S (30 * 60)     /* an upload link's life */
#define SP_TMPLFILES_TOKEN  128           /* room for a token */

typedef struct sp_tmplfiles sp_tmplfiles_t;

sp_tmplfiles_t *sp_tmplfiles_create(sp_loop_t *loop, const char *data_dir, sp_err_t *err);
/* Uploads in flight are abandoned (their temporary files removed by the next start). */
void sp_tmplfiles_destroy(sp_tmplfiles_t *f);
/* Keeps files in root/template-files instead (made when missing); -1 when it cannot be. */
int sp_tmplfiles_set_dir(sp_tmplfiles_t *f, const char *root, sp_err_t *err);
/* The upload-link key of a fleet whose nodes share secret (its cluster key), into key. */
void sp_tmplfiles_fleet_link_key(const unsigned char *secret, size_t n, unsigned char key[32]);
/* Authenticates upload links with key (sp_tmplfiles_fleet_link_key) instead of this
 * process's own. */
void sp_tmplfiles_set_link_key(sp_tmplfiles_t *f, const unsigned char key[32]);

bool sp_tmplfiles_valid_key(const char *key);

/* The path of the team's file key into out; -1 with SP_ENOTFOUND when it was never uploaded
 * (SP_EINVAL for a bad key). */
int sp_tmplfiles_path(sp_tmplfiles_t *f, const char *team, const char *key, char *out,
                      size_t cap, sp_err_t *err);

/* Removes the files whose last use is keep_s or more ago, except those used says a build
 * still needs (used may be NULL), and team directories left empty; returns how many went.
 * On the loop's thread. */
typedef bool (*sp_tmplfiles_used_cb)(void *arg, const char *team, const char *key);
int sp_tmplfiles_collect(sp_tmplfiles_t *f, uint64_t keep_s, sp_tmplfiles_used_cb used, void *arg);

/* Stores body[0..n) (copied) as the team's key. cb: existed (nothing written), or the member
 * count; or SP_EINVAL naming what is wrong with the tar, or that it does not hash to key
 * (verify), SP_ETOOBIG past SP_TMPLFILES_MAX. */
typedef void (*sp_tmplfiles_put_cb)(void *arg, bool existed, uint64_t entries,
                                    const sp_err_t *err);
int sp_tmplfiles_put(sp_tmplfiles_t *f, const char *team, const char *key, bool verify,
                     const void *body, size_t n, sp_tmplfiles_put_cb cb, void *arg,
                     sp_err_t *err);

/* An upload link's token for team and key, valid for SP_TMPLFILES_LINK_S. */
void sp_tmplfiles_token(sp_tmplfiles_t *f, const char *team, const char *key,
                        char out[SP_TMPLFILES_TOKEN]);
/* The team a token was made for, when it is genuine, unexpired and for key; else -1
 * (SP_EAUTH). */
int sp_tmplfiles_token_check(sp_tmplfiles_t *f, const char *token, const char *key,
                             char team[SP_ID_LEN + 1], sp_err_t *err);

#endif
