/*
 * config.c - reading and writing spacectl's settings (config.h).
 */
#include "cli/config.h"

#include <errno.h>
#include <fcntl.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "base/text.h"

static const char *env_nonempty(spc_getenv_fn env, const char *name)
{
    const char *v = env(name);
    return v != NULL && v[0] != '\0' ? v : NULL;
}

int spc_config_path(char *out, size_t cap, spc_getenv_fn env)
{
    const char *xdg = env_nonempty(env, "XDG_CONFIG_HOME");
    const char *home = env_nonempty(env, "HOME");
    int n;
    if (xdg != NULL && xdg[0] == '/') /* the XDG spec: relative values are to be ignored */
        n = snprintf(out, cap, "%s/space/config", xdg);
    else if (home != NULL)
        n = snprintf(out, cap, "%s/.config/space/config", home);
    else
        return -1;
    return n < 0 || (size_t)n >= cap ? -1 : 0;
}

void spc_config_data_dir(char *out, size_t cap, spc_getenv_fn env, uid_t euid)
{
    const char *d = env_nonempty(env, "SPACE_DATA_DIR");
    if (d != NULL)
        snprintf(out, cap, "%s", d);
    else if (euid == 0)
        snprintf(out, cap, "/var/lib/space");
    else
        snprintf(out, cap, "%s/.local/share/space", env("HOME") ? env("HOME") : ".");
}

/* Reads url and key from the file when it exists (either may stay ""). */
static int read_file(const char *path, char *url, size_t ucap, char *key, size_t kcap,
                     sp_err_t *err)
{
    FILE *f = fopen(path, "r");
    if (f == NULL) {
        if (errno == ENOENT || errno == ENOTDIR)
            return 0;
        return sp_err_set(err, SP_EINVAL, "cannot read %.100s: %s", path, strerror(errno));
    }
    char line[4096];
    int no = 0, rc = 0;
    while (rc == 0 && fgets(line, sizeof(line), f) != NULL) {
        no++;
        char *s = sp_text_trim(line);
        if (s[0] == '\0' || s[0] == '#')
            continue;
        char *eq = strchr(s, '=');
        if (eq == NULL) {
            rc = sp_err_set(err, SP_EINVAL, "%.100s line %d: expected name = value", path, no);
            break;
        }
        *eq = '\0';
        char *name = sp_text_trim(s), *val = sp_text_trim(eq + 1);
        /* Other names are left alone: a newer spacectl may have written them. */
        if (strcmp(name, "url") == 0)
            snprintf(url, ucap, "%s", val);
        else if (strcmp(name, "key") == 0)
            snprintf(key, kcap, "%s", val);
    }
    fclose(f);
    return rc;
}

static bool read_key_file(const char *path, char *key, size_t cap)
{
    FILE *f = fopen(path, "r");
    if (f == NULL)
        return false;
    bool ok = fgets(key, (int)cap, f) != NULL;
    fclose(f);
    if (!ok)
        return false;
    key[strcspn(key, "\r\n")] = '\0';
    return key[0] != '\0';
}

int spc_config_load(spc_config_t *c, spc_getenv_fn env, uid_t euid, sp_err_t *err)
{
    memset(c, 0, sizeof(*c));
    char furl[sizeof(c->url)] = "", fkey[sizeof(c->key)] = "";
    if (spc_config_path(c->config_path, sizeof(c->config_path), env) < 0)
        c->config_path[0] = '\0';
    else if (read_file(c->config_path, furl, sizeof(furl), fkey, sizeof(fkey), err) < 0)
        return -1;

    const char *v = env_nonempty(env, "SPACE_API_URL");
    if (v != NULL) {
        snprintf(c->url, sizeof(c->url), "%s", v);
        snprintf(c->url_from, sizeof(c->url_from), "SPACE_API_URL");
    } else if (furl[0] != '\0') {
        snprintf(c->url, sizeof(c->url), "%s", furl);
        snprintf(c->url_from, sizeof(c->url_from), "%s", c->config_path);
    } else {
        snprintf(c->url, sizeof(c->url), "%s", SPC_DEFAULT_URL);
        snprintf(c->url_from, sizeof(c->url_from), "the default");
    }

    char datadir[1024], keyfile[1100];
    spc_config_data_dir(datadir, sizeof(datadir), env, euid);
    snprintf(keyfile, sizeof(keyfile), "%s/api-key", datadir);
    v = env_nonempty(env, "SPACE_API_KEY");
    if (v != NULL) {
        snprintf(c->key, sizeof(c->key), "%s", v);
        snprintf(c->key_from, sizeof(c->key_from), "SPACE_API_KEY");
    } else if (fkey[0] != '\0') {
        snprintf(c->key, sizeof(c->key), "%s", fkey);
        snprintf(c->key_from, sizeof(c->key_from), "%s", c->config_path);
    } else if (read_key_file(keyfile, c->key, sizeof(c->key))) {
        snprintf(c->key_from, sizeof(c->key_from), "%s", keyfile);
    } else {
        c->key[0] = '\0';
        snprintf(c->looked, sizeof(c->looked),
                 "SPACE_API_KEY is not set, %s%s, and %s is not readable",
                 c->config_path[0] ? "there is no key in " : "there is no config file (HOME "
                                                             "is not set)",
                 c->config_path, keyfile);
    }
    return 0;
}

static int mkdir_parents(const char *path)
{
    char buf[1024];
    snprintf(buf, sizeof(buf), "%s", path);
    char *slash = strrchr(buf, '/');
    if (slash == NULL || slash == buf)
        return 0;
    *slash = '\0';
    for (char *p = buf + 1; *p; p++) {
        if (*p != '/')
            continue;
        *p = '\0';
        if (mkdir(buf, 0755) < 0 && errno != EEXIST)
            return -1;
        *p = '/';
    }
    /* The file's own directory holds a key: only its owner may look in it. */
    if (mkdir(buf, 0700) < 0 && errno != EEXIST)
        return -1;
    return 0;
}

int spc_config_save(const char *path, const char *url, const char *key, sp_err_t *err)
{
    char tmp[1100];
    snprintf(tmp, sizeof(tmp), "%s.tmp", path);
    if (mkdir_parents(path) < 0)
        return sp_err_set(err, SP_EINVAL, "cannot create the directory of %.100s: %s", path,
                          strerror(errno));
    int fd = open(tmp, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC | O_NOFOLLOW, 0600);
    if (fd < 0)
        return sp_err_set(err, SP_EINVAL, "cannot write %.100s: %s", tmp, strerror(errno));
    FILE *f = fdopen(fd, "w");
    if (f == NULL) {
        close(fd);
        unlink(tmp);
        return sp_err_set(err, SP_EINTERNAL, "out of memory");
    }
    /* An existing temporary file keeps its mode through O_TRUNC: set it again. */
    bool ok = fchmod(fd, 0600) == 0;
    ok = ok && fprintf(f, "# spacectl settings (written by spacectl login)\nurl = %s\nkey = %s\n",
                       url, key) > 0;
    ok = fflush(f) == 0 && ok && fsync(fd) == 0;
    if (fclose(f) != 0)
        ok = false;
    if (!ok || rename(tmp, path) < 0) {
        int e = errno;
        unlink(tmp);
        return sp_err_set(err, SP_EINVAL, "cannot write %.100s: %s", path, strerror(e));
    }
    return 0;
}
