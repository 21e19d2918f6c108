/*
 * config.h - where spacectl finds the server and its API key.
 *
 * Each of the two settings is taken from the first place that has it:
 *   url: SPACE_API_URL, the config file's "url", else http://127.0.0.1:3000 (spaced's default)
 *   key: SPACE_API_KEY, the config file's "key", else the first line of <data-dir>/api-key,
 *        which spaced writes on its first start (data dir: $SPACE_DATA_DIR, /var/lib/space
 *        as root, else ~/.local/share/space: server/server.c's rules)
 * The config file is $XDG_CONFIG_HOME/space/config (an absolute XDG_CONFIG_HOME only), else
 * ~/.config/space/config: "name = value" lines, # comments; spacectl login writes it, mode 0600.
 *
 * The environment comes through a function (getenv, or a table in the unit test), so the
 * rules can be checked without touching the real one. Knows nothing of HTTP.
 */
#ifndef SPC_CONFIG_H
#define SPC_CONFIG_H

#include <stddef.h>
#include <sys/types.h>

#include "base/err.h"

#define SPC_DEFAULT_URL "http://127.0.0.1:3000"

typedef const char *(*spc_getenv_fn)(const char *name);

typedef struct {
    char url[1024];
    char key[512];         /* "" when none was found */
    char url_from[1100];   /* where url came from, for messages ("SPACE_API_URL", a path) */
    char key_from[1100];   /* where key came from */
    char looked[3200];     /* with no key: every place asked, for the message */
    char config_path[1024]; /* "" when there is no HOME to put it in */
} spc_config_t;

/* Resolves both settings. -1 with err only for a config file that exists but cannot be read
 * or parsed (its line named); a missing key is not an error here (key is "", looked says
 * where we looked). */
int spc_config_load(spc_config_t *c, spc_getenv_fn env, uid_t euid, sp_err_t *err);

/* The config file's path; -1 when neither XDG_CONFIG_HOME nor HOME says where. */
int spc_config_path(char *out, size_t cap, spc_getenv_fn env);

/* spaced's default data directory, by its rules. */
void spc_config_data_dir(char *out, size_t cap, spc_getenv_fn env, uid_t euid);

/* Writes url and key to path (its directory made 0700 when missing), mode 0600, replacing the
 * file atomically. */
int spc_config_save(const char *path, const char *url, const char *key, sp_err_t *err);

#endif
