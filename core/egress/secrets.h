/*
 * secrets.h - a team's secrets, encrypted at rest, and a sandbox's credential rules.
 *
 * A secret is a named value a team stores once (POST /v1/secrets) and sandboxes use without
 * ever seeing it: a credential rule of the sandbox ("for requests to api.example.com, set
 * header Authorization to 'Bearer {secret}' with secret OPENAI") makes the egress proxy add
 * the header on the host (core/egress/mitm.h).
 *
 * Values are sealed with libsodium's crypto_secretbox (XSalsa20-Poly1305, a random nonce
 * per value) under the installation's master key, which never enters the database: it comes
 * from SPACE_MASTER_KEY (base64 of 32 bytes), from a key file, or, for the embedded default,
 * from <data-dir>/master.key (created 0600 at first start). The sealed text also binds what
 * it belongs to (team and name, or sandbox), so a row copied to another team or sandbox does
 * not open. Plaintext copies are zeroed after use. Values are never logged, returned by the
 * API, or put into an error message; only names and times are.
 *
 * Without a master key (an external database and no key given) the module is disabled: every
 * call answers SP_EUNAVAIL and says how to configure one.
 *
 * Store calls are asynchronous and team-scoped like core/control/svc.h: an accepted call (0) calls
 * back exactly once, never before it returns; a refused one (-1) never. Changes NOTIFY
 * space_credentials (payload: a sandbox ID, or "team:<team_id>" for a secret), which
 * core/egress/mitm.c listens to.
 */
#ifndef SP_SECRETS_H
#define SP_SECRETS_H

#include <jansson.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "base/err.h"
#include "base/ids.h"
#include "loop/loop.h"
#include "core/store/store.h"

typedef struct sp_secrets sp_secrets_t;

#define SP_SECRETS_KEY_LEN    32   /* crypto_secretbox_KEYBYTES */
#define SP_SECRETS_NAME_MAX   64   /* [A-Za-z_][A-Za-z0-9_.-]* */
#define SP_SECRETS_VALUE_MAX  8192 /* bytes; no control characters (it goes into a header) */
#define SP_SECRETS_RULES_MAX  32   /* rules per sandbox */
#define SP_SECRETS_FORMAT_MAX 256  /* rule format, with "{secret}" once */
#define SP_SECRETS_ENV_MAX    128  /* rule env name, [A-Za-z_][A-Za-z0-9_]* */
/* What the guest sees in a rule's env variable: this prefix and the secret's name, never
 * anything derived from the value. */
#define SP_SECRETS_PLACEHOLDER "space-placeholder:"
#define SP_SECRETS_ENV        "SPACE_MASTER_KEY"
#define SP_SECRETS_NOTIFY     "space_credentials"

/* ---- the master key ---- */

typedef enum {
    SP_SECRETS_KEY_NONE = 0, /* no key: secrets disabled */
    SP_SECRETS_KEY_ENV,      /* from SPACE_MASTER_KEY */
    SP_SECRETS_KEY_FILE,     /* from key_file or the data dir's master.key */
    SP_SECRETS_KEY_CREATED,  /* generated into the data dir's master.key now */
} sp_secrets_key_source_t;

/*
 * Finds the master key, blocking (start-up only): SPACE_MASTER_KEY when set, else key_file
 * when given (it must exist), else <gen_dir>/master.key when gen_dir is given (created with
 * mode 0600 and a fresh random key when missing). A key is 32 bytes, written as base64 (a
 * file may also hold the 32 raw bytes). *src says where it came from (NONE: key untouched,
 * nothing configured). -1 with err for a key that is malformed or cannot be read or
 * written: the message names the source, never the key.
 */
int sp_secrets_load_key(const char *key_file, const char *gen_dir,
                        unsigned char key[SP_SECRETS_KEY_LEN], sp_secrets_key_source_t *src,
                        sp_err_t *err);

/* key NULL: disabled. The key is copied (and zeroed on destroy); store is borrowed. */
sp_secrets_t *sp_secrets_create(sp_loop_t *loop, sp_store_t *store,
                                const unsigned char key[SP_SECRETS_KEY_LEN], sp_err_t *err);
void sp_secrets_destroy(sp_secrets_t *s);

bool sp_secrets_enabled(const sp_secrets_t *s);
sp_store_t *sp_secrets_store(const sp_secrets_t *s);
/* SP_EUNAVAIL "secrets need a master key ..." when disabled; 0 otherwise. */
int sp_secrets_check_enabled(const sp_secrets_t *s, sp_err_t *err);

/* ---- sealing (synchronous, no I/O) ---- */

/* Seals len bytes for context (e.g. "secret:<team>:<name>"): a malloc'd NUL-terminated
 * text "v1:<base64 of nonce and box>". NULL with err when disabled or out of memory. */
char *sp_secrets_seal(const sp_secrets_t *s, const char *context, const void *plain, size_t len,
                      sp_err_t *err);
/* Opens a sealed text made for context: *plain gets a malloc'd copy (NUL-terminated, not
 * counted in *len) to release with sp_secrets_wipe. SP_EINTERNAL for a text that is
 * malformed, made with another key, or made for another context. */
int sp_secrets_open(const sp_secrets_t *s, const char *context, const char *sealed, uint8_t **plain,
                    size_t *len, sp_err_t *err);
/* Zeroes len bytes of p and frees it. NULL does nothing. */
void sp_secrets_wipe(void *p, size_t len);

/* ---- validation (synchronous) ---- */

int sp_secrets_check_name(const char *name, sp_err_t *err);
/* Value bytes: 1..SP_SECRETS_VALUE_MAX, no NUL or control characters. Never echoes it. */
int sp_secrets_check_value(const char *value, size_t len, sp_err_t *err);

/*
 * Checks a credentials array as the API takes it:
 *   [{"host": "api.example.com" | "*.example.com", "header": "Authorization",
 *     "secret": "NAME", "format": "Bearer {secret}" (optional, default "{secret}"),
 *     "env": "OPENAI_API_KEY" (optional)}]
 * and returns its normalised copy (new reference: hosts lowercased, format filled in, env
 * kept only when given), or NULL with SP_EINVAL. Headers that frame the message (Host,
 * Content-Length, Transfer-Encoding, Connection, ...) are refused.
 *
 * env names a variable every later process in the guest gets, set to the placeholder
 * SP_SECRETS_PLACEHOLDER "<secret>" (core/egress/mitm.h): guest code can use it where it would use
 * the key, and the rule's header is replaced on the way out. A POSIX name of at most
 * SP_SECRETS_ENV_MAX characters; not one the guest's login or the egress proxy sets itself
 * (PATH, HOME, HTTP_PROXY, SSL_CERT_FILE, ...); two rules naming the same env must name the
 * same secret.
 */
json_t *sp_secrets_rules_normalize(const json_t *rules, sp_err_t *err);

/* ---- store calls ---- */

typedef struct {
    char name[SP_SECRETS_NAME_MAX + 1];
    char created_at[32];
    char updated_at[32];
} sp_secret_rec_t;

typedef void (*sp_secrets_rec_cb)(void *arg, const sp_secret_rec_t *rec, const sp_err_t *err);
typedef void (*sp_secrets_list_cb)(void *arg, const sp_secret_rec_t *recs, size_t n,
                                   const sp_err_t *err);
typedef void (*sp_secrets_done_cb)(void *arg, const sp_err_t *err);
typedef void (*sp_secrets_rules_cb)(void *arg, json_t *rules /* borrowed */, const sp_err_t *err);

/* Stores a new secret (replace false: SP_ECONFLICT when the name exists) or replaces an
 * existing one's value (replace true: SP_ENOTFOUND when it does not). value is copied,
 * sealed before this call returns, and the copy zeroed. */
int sp_secrets_put(sp_secrets_t *s, const char *team_id, const char *name, const char *value,
                   size_t len, bool replace, sp_secrets_rec_cb cb, void *arg, sp_err_t *err);
/* Names and times, by name; at most 1000. */
int sp_secrets_list(sp_secrets_t *s, const char *team_id, sp_secrets_list_cb cb, void *arg,
                    sp_err_t *err);
/* SP_ENOTFOUND when missing. Rules naming it stay; their requests get a 502 until it is
 * created again. */
int sp_secrets_delete(sp_secrets_t *s, const char *team_id, const char *name, sp_secrets_done_cb cb,
                      void *arg, sp_err_t *err);

/* SP_EINVAL "secret 'X' does not exist" when a rule (normalised) names a secret the team does
 * not have. For sandbox creation, before the record is written. */
int sp_secrets_check_rule_secrets(sp_secrets_t *s, const char *team_id, const json_t *rules,
                                  sp_secrets_done_cb cb, void *arg, sp_err_t *err);
/* A team's secret opened, for a use on the host that needs the value itself (a template
 * build's registry password, core/control/tmpl.h): never for a guest. cb gets the value
 * (NUL-terminated, len bytes), wiped and freed when cb returns; or SP_ENOTFOUND "secret
 * 'NAME' does not exist". */
typedef void (*sp_secrets_value_cb)(void *arg, const char *value, size_t len, const sp_err_t *err);
int sp_secrets_reveal(sp_secrets_t *s, const char *team_id, const char *name,
                      sp_secrets_value_cb cb, void *arg, sp_err_t *err);
/* A team's sandbox's rules (SP_ENOTFOUND for a missing, deleted or another team's sandbox). */
int sp_secrets_get_rules(sp_secrets_t *s, const char *team_id, const char *sandbox_id,
                         sp_secrets_rules_cb cb, void *arg, sp_err_t *err);
/* Replaces them (rules normalised; the secrets must exist, as above) and NOTIFYs the sandbox
 * so a running VM's proxy uses them from its next request. */
int sp_secrets_set_rules(sp_secrets_t *s, const char *team_id, const char *sandbox_id,
                         const json_t *rules, sp_secrets_rules_cb cb, void *arg, sp_err_t *err);

#endif
