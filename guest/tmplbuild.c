/*
 * tmplbuild.c - template builds: spec parsing, input hashing, the cache, and
 * running the embedded builder scripts with a progress display.
 *
 * Owns <data-dir>/images and <data-dir>/templates (layout in tmplbuild.h).
 * Everything a build makes is written under <data-dir>/tmp first and renamed
 * into place when complete, so a killed build never leaves a half-built
 * template or a dangling "current". Blocking, single-threaded use.
 */
#include "guest/tmplbuild.h"

#include <ctype.h>
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <poll.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <jansson.h>
#include <openssl/evp.h>

#include "base/log.h"
#include "base/rmtree.h"
#include "base/text.h"
#include "guest/embedded.h"

extern char **environ;

/* The code daemon (guest/code/space-code) as embed.cmake names it. */
#define SP_CODE_EMBED_NAME "code/space-code"

/* ---- spec ---------------------------------------------------------------- */

/* Debian package names: [a-z0-9][a-z0-9+.-]+ (policy 5.6.1). */
static bool valid_package(const char *s)
{
    return sp_tmplbuild__valid_word(s, 2, 100, "+.-");
}

/* Strings that reach the scripts' colon/newline-separated env vars. */
static int valid_field(const char *s, int path)
{
    if (*s == '\0' || strlen(s) > 200 || (path && s[0] != '/'))
        return 0;
    for (const char *p = s; *p; p++)
        if (*p == ':' || *p == '\n' || !isprint((unsigned char)*p) || *p == ' ')
            return 0;
    return 1;
}

static char *dup_or_null(const char *s)
{
    return s != NULL ? strdup(s) : NULL;
}

void sp_tmplbuild_spec_free(sp_tmplbuild_spec_t *s)
{
    if (s == NULL)
        return;
    free(s->name);
    free(s->description);
    free(s->suite);
    free(s->variant);
    free(s->hostname);
    for (size_t i = 0; i < s->n_packages; i++)
        free(s->packages[i]);
    free(s->packages);
    for (size_t i = 0; i < s->n_users; i++) {
        free(s->users[i].name);
        free(s->users[i].home);
        free(s->users[i].shell);
    }
    free(s->users);
    for (size_t i = 0; i < s->n_warmup; i++)
        free(s->warmup[i]);
    free(s->warmup);
    for (size_t i = 0; i < s->n_files; i++) {
        free(s->files[i].path);
        free(s->files[i].content);
    }
    free(s->files);
    free(s->canonical);
    free(s);
}

static int get_int(json_t *root, const char *key, int def, int lo, int hi, int *out, sp_err_t *err)
{
    json_t *v = json_object_get(root, key);
    if (v == NULL) {
        *out = def;
        return 0;
    }
    if (!json_is_integer(v) || json_integer_value(v) < lo || json_integer_value(v) > hi)
        return sp_err_set(err, SP_EINVAL, "spec: %s must be an integer in %d..%d", key, lo, hi);
    *out = (int)json_integer_value(v);
    return 0;
}

static int get_str(json_t *root, const char *key, const char *def, char **out, sp_err_t *err)
{
    json_t *v = json_object_get(root, key);
    if (v == NULL) {
        *out = dup_or_null(def);
        return 0;
    }
    if (!json_is_string(v))
        return sp_err_set(err, SP_EINVAL, "spec: %s must be a string", key);
    *out = strdup(json_string_value(v));
    return *out == NULL ? sp_err_set(err, SP_EINTERNAL, "out of memory") : 0;
}

static int parse_user(json_t *u, sp_tmplbuild_user_t *out, sp_err_t *err)
{
    json_t *name = json_object_get(u, "name"), *uid = json_object_get(u, "uid");
    json_t *home = json_object_get(u, "home"), *shell = json_object_get(u, "shell");
    json_t *sudo = json_object_get(u, "sudo");
    const char *k;
    json_t *v;
    json_object_foreach(u, k, v)
    {
        if (strcmp(k, "name") && strcmp(k, "uid") && strcmp(k, "home") && strcmp(k, "shell") &&
            strcmp(k, "sudo"))
            return sp_err_set(err, SP_EINVAL, "spec: unknown user field '%.40s'", k);
    }
    if (!json_is_string(name) || !sp_tmplbuild_valid_name(json_string_value(name)) ||
        strlen(json_string_value(name)) > 32)
        return sp_err_set(err, SP_EINVAL, "spec: user name must be [a-z0-9._-], at most 32");
    if (!json_is_integer(uid) || json_integer_value(uid) < 1000 || json_integer_value(uid) > 60000)
        return sp_err_set(err, SP_EINVAL, "spec: user uid must be an integer in 1000..60000");
    if ((home != NULL && (!json_is_string(home) || !valid_field(json_string_value(home), 1))) ||
        (shell != NULL && (!json_is_string(shell) || !valid_field(json_string_value(shell), 1))))
        return sp_err_set(err, SP_EINVAL, "spec: user home and shell must be absolute paths");
    if (sudo != NULL && !json_is_boolean(sudo))
        return sp_err_set(err, SP_EINVAL, "spec: user sudo must be a boolean");
    out->name = strdup(json_string_value(name));
    out->uid = (unsigned)json_integer_value(uid);
    if (home != NULL)
        out->home = strdup(json_string_value(home));
    else if (asprintf(&out->home, "/home/%s", json_string_value(name)) < 0)
        out->home = NULL;
    out->shell = strdup(shell != NULL ? json_string_value(shell) : "/bin/bash");
    out->sudo = sudo != NULL && json_is_true(sudo);
    if (out->name == NULL || out->home == NULL || out->shell == NULL)
        return sp_err_set(err, SP_EINTERNAL, "out of memory");
    return 0;
}

static const char *const known_fields[] = {
    "name",   "description", "suite",     "variant",   "packages", "users",
    "agent",  "hostname",    "cpu_count", "memory_mb", "disk_mb",  "code_interpreter",
    "warmup", "files",       NULL,
};

/* An absolute path whose every component is a plain name (no '.', '..', empty or control
 * characters), that is not "/" itself. */
static bool valid_image_path(const char *p)
{
    size_t n = strlen(p);
    if (n < 2 || n > SP_TMPLBUILD_FILE_PATH || p[0] != '/' || p[n - 1] == '/')
        return false;
    for (const char *c = p; *c != '\0'; c++)
        if ((unsigned char)*c < 0x20 || *c == 0x7f)
            return false;
    for (const char *c = p; c != NULL && *c != '\0'; c = strchr(c + 1, '/')) {
        const char *e = strchr(c + 1, '/');
        size_t k = e != NULL ? (size_t)(e - c - 1) : strlen(c + 1);
        if (k == 0 || (k == 1 && c[1] == '.') || (k == 2 && c[1] == '.' && c[2] == '.'))
            return false;
    }
    return true;
}

/* "files": [{"path": "/abs", "content": "text", "mode": 420}] (mode default 0644). */
static int parse_file(json_t *v, size_t i, sp_tmplbuild_file_t *out, sp_err_t *err)
{
    json_t *path = json_object_get(v, "path"), *content = json_object_get(v, "content");
    json_t *mode = json_object_get(v, "mode");
    if (!json_is_object(v) || json_object_size(v) != 2u + (mode != NULL))
        return sp_err_set(err, SP_EINVAL, "spec: files[%zu] must be {path, content, mode?}", i);
    if (!json_is_string(path) || !valid_image_path(json_string_value(path)))
        return sp_err_set(err, SP_EINVAL,
                          "spec: files[%zu].path must be an absolute path of plain names "
                          "(no '.', '..' or '//'), at most %d bytes",
                          i, SP_TMPLBUILD_FILE_PATH);
    if (!json_is_string(content) || json_string_length(content) > SP_TMPLBUILD_FILE_BYTES)
        return sp_err_set(err, SP_EINVAL,
                          "spec: files[%zu].content must be a string of at most "
                          "%d bytes",
                          i, SP_TMPLBUILD_FILE_BYTES);
    if (mode != NULL && (!json_is_integer(mode) || json_integer_value(mode) < 0 ||
                         json_integer_value(mode) > 07777))
        return sp_err_set(err, SP_EINVAL,
                          "spec: files[%zu].mode must be an integer 0..4095 "
                          "(0644 is 420)",
                          i);
    out->mode = mode != NULL ? (unsigned)json_integer_value(mode) : 0644;
    out->len = json_string_length(content);
    out->path = strdup(json_string_value(path));
    out->content = malloc(out->len + 1);
    if (out->path == NULL || out->content == NULL)
        return sp_err_set(err, SP_EINTERNAL, "out of memory");
    memcpy(out->content, json_string_value(content), out->len + 1);
    return 0;
}

/* "warmup": 1..SP_TMPLBUILD_WARMUP_MAX non-empty strings (an argv, run without a shell). */
static int parse_warmup(json_t *wu, sp_tmplbuild_spec_t *s, sp_err_t *err)
{
    if (!json_is_array(wu) || json_array_size(wu) == 0 ||
        json_array_size(wu) > SP_TMPLBUILD_WARMUP_MAX)
        return sp_err_set(err, SP_EINVAL, "spec: warmup must be an array of 1..%d strings",
                          SP_TMPLBUILD_WARMUP_MAX);
    s->warmup = calloc(json_array_size(wu), sizeof(char *));
    if (s->warmup == NULL)
        return sp_err_set(err, SP_EINTERNAL, "out of memory");
    size_t i;
    json_t *v;
    json_array_foreach(wu, i, v)
    {
        /* jansson rejects NUL inside strings unless asked to allow it: argv stays C strings */
        if (!json_is_string(v) || json_string_length(v) == 0 ||
            json_string_length(v) > SP_TMPLBUILD_WARMUP_ARG)
            return sp_err_set(err, SP_EINVAL, "spec: warmup[%zu] must be a string of 1..%d bytes",
                              i, SP_TMPLBUILD_WARMUP_ARG);
        if ((s->warmup[s->n_warmup++] = strdup(json_string_value(v))) == NULL)
            return sp_err_set(err, SP_EINTERNAL, "out of memory");
    }
    return 0;
}

/* The spec's member key, which must be an array when there ("spec: <key> must be <what>"), in
 * *arr (NULL when absent), and room for its elements (size bytes each, zeroed) in *mem (NULL
 * when it has none) for the caller to free. -1 with err when not an array or out of memory. */
static int spec_array(json_t *root, const char *key, const char *what, size_t size, json_t **arr,
                      void **mem, sp_err_t *err)
{
    *arr = json_object_get(root, key);
    *mem = NULL;
    if (*arr != NULL && !json_is_array(*arr))
        return sp_err_set(err, SP_EINVAL, "spec: %s must be %s", key, what);
    if (*arr != NULL && json_array_size(*arr) > 0) {
        *mem = calloc(json_array_size(*arr), size);
        if (*mem == NULL)
            return sp_err_set(err, SP_EINTERNAL, "out of memory");
    }
    return 0;
}

int sp_tmplbuild_spec_parse(const char *json, size_t len, sp_tmplbuild_spec_t **out, sp_err_t *err)
{
    json_error_t jerr;
    json_t *root = json_loadb(json, len, JSON_REJECT_DUPLICATES, &jerr);
    if (root == NULL)
        return sp_err_set(err, SP_EINVAL, "spec: invalid JSON at line %d: %.80s", jerr.line,
                          jerr.text);
    sp_tmplbuild_spec_t *s = calloc(1, sizeof *s);
    int rc = -1;
    if (s == NULL) {
        sp_err_set(err, SP_EINTERNAL, "out of memory");
        goto out;
    }
    if (!json_is_object(root)) {
        sp_err_set(err, SP_EINVAL, "spec: must be a JSON object");
        goto out;
    }
    const char *k;
    json_t *v;
    json_object_foreach(root, k, v)
    {
        int known = 0;
        for (int i = 0; known_fields[i] != NULL; i++)
            known |= strcmp(k, known_fields[i]) == 0;
        if (!known) {
            sp_err_set(err, SP_EINVAL, "spec: unknown field '%.40s'", k);
            goto out;
        }
    }
    if (get_str(root, "name", NULL, &s->name, err) < 0 ||
        get_str(root, "description", "", &s->description, err) < 0 ||
        get_str(root, "suite", NULL, &s->suite, err) < 0 ||
        get_str(root, "variant", "minbase", &s->variant, err) < 0 ||
        get_str(root, "hostname", "space", &s->hostname, err) < 0 ||
        get_int(root, "cpu_count", 1, 1, 64, &s->cpu_count, err) < 0 ||
        get_int(root, "memory_mb", 256, 64, 65536, &s->memory_mb, err) < 0 ||
        get_int(root, "disk_mb", 2048, 256, 1048576, &s->disk_mb, err) < 0)
        goto out;
    if (s->name == NULL || !sp_tmplbuild_valid_name(s->name)) {
        sp_err_set(err, SP_EINVAL, "spec: name must be [a-z0-9][a-z0-9._-]*, at most 63");
        goto out;
    }
    if (s->suite == NULL || !sp_tmplbuild_valid_name(s->suite)) {
        sp_err_set(err, SP_EINVAL, "spec: suite is required (a Debian suite name)");
        goto out;
    }
    if (!sp_tmplbuild_valid_name(s->variant) || !sp_tmplbuild_valid_name(s->hostname)) {
        sp_err_set(err, SP_EINVAL, "spec: variant and hostname must be [a-z0-9._-]");
        goto out;
    }
    json_t *agent = json_object_get(root, "agent");
    if (agent != NULL && !json_is_boolean(agent)) {
        sp_err_set(err, SP_EINVAL, "spec: agent must be a boolean");
        goto out;
    }
    s->agent = agent == NULL || json_is_true(agent);
    json_t *code = json_object_get(root, "code_interpreter");
    if (code != NULL && !json_is_boolean(code)) {
        sp_err_set(err, SP_EINVAL, "spec: code_interpreter must be a boolean");
        goto out;
    }
    s->code_interpreter = code != NULL && json_is_true(code);
    json_t *wu = json_object_get(root, "warmup");
    if (wu != NULL && parse_warmup(wu, s, err) < 0)
        goto out;
    if (s->warmup != NULL && !s->agent) {
        sp_err_set(err, SP_EINVAL, "spec: warmup needs the agent (it runs through it)");
        goto out;
    }

    json_t *fa, *pk;
    void *mem;
    if (spec_array(root, "files", "an array of objects", sizeof *s->files, &fa, &mem, err) < 0)
        goto out;
    s->files = mem;
    if (json_array_size(fa) > SP_TMPLBUILD_FILES_MAX) {
        sp_err_set(err, SP_EINVAL, "spec: at most %d files", SP_TMPLBUILD_FILES_MAX);
        goto out;
    }
    for (size_t i = 0; s->files != NULL && i < json_array_size(fa); i++)
        if (parse_file(json_array_get(fa, i), i, &s->files[s->n_files++], err) < 0)
            goto out;
    if (spec_array(root, "packages", "an array of strings", sizeof(char *), &pk, &mem, err) < 0)
        goto out;
    s->packages = mem;
    if (s->packages != NULL) {
        size_t i;
        json_array_foreach(pk, i, v)
        {
            if (!json_is_string(v) || !valid_package(json_string_value(v))) {
                sp_err_set(err, SP_EINVAL, "spec: packages[%zu] is not a Debian package name", i);
                goto out;
            }
            if ((s->packages[s->n_packages++] = strdup(json_string_value(v))) == NULL) {
                sp_err_set(err, SP_EINTERNAL, "out of memory");
                goto out;
            }
        }
    }
    json_t *us;
    if (spec_array(root, "users", "an array of objects", sizeof *s->users, &us, &mem, err) < 0)
        goto out;
    s->users = mem;
    if (s->users != NULL) {
        size_t i;
        json_array_foreach(us, i, v)
        {
            if (!json_is_object(v)) {
                sp_err_set(err, SP_EINVAL, "spec: users[%zu] must be an object", i);
                goto out;
            }
            s->n_users++; /* counted first so free() sees partial fields */
            if (parse_user(v, &s->users[i], err) < 0)
                goto out;
            for (size_t j = 0; j < i; j++) {
                if (strcmp(s->users[j].name, s->users[i].name) == 0 ||
                    s->users[j].uid == s->users[i].uid) {
                    sp_err_set(err, SP_EINVAL, "spec: users[%zu] repeats a name or uid", i);
                    goto out;
                }
            }
        }
    }
    s->canonical = json_dumps(root, JSON_COMPACT | JSON_SORT_KEYS);
    if (s->canonical == NULL) {
        sp_err_set(err, SP_EINTERNAL, "out of memory");
        goto out;
    }
    *out = s;
    s = NULL;
    rc = 0;
out:
    sp_tmplbuild_spec_free(s);
    json_decref(root);
    return rc;
}

static const sp_guest_file_t *embedded(const char *name)
{
    for (unsigned i = 0; i < sp_guest_nfiles; i++)
        if (strcmp(sp_guest_files[i].name, name) == 0)
            return &sp_guest_files[i];
    return NULL;
}

static char *read_file(const char *path, size_t max, size_t *len)
{
    FILE *f = fopen(path, "rb");
    if (f == NULL)
        return NULL;
    char *buf = malloc(max + 1);
    size_t n = buf != NULL ? fread(buf, 1, max + 1, f) : 0;
    int bad = buf == NULL || ferror(f) || n > max;
    fclose(f);
    if (bad) {
        free(buf);
        errno = bad && buf != NULL && n > max ? EFBIG : errno;
        return NULL;
    }
    buf[n] = '\0';
    if (len != NULL)
        *len = n;
    return buf;
}

char *sp_tmplbuild_spec_load(const char *templates_dir, const char *name, size_t *len,
                             sp_err_t *err)
{
    if (name == NULL || !sp_tmplbuild_valid_name(name)) {
        sp_err_set(err, SP_EINVAL, "bad template name");
        return NULL;
    }
    char path[PATH_MAX];
    if (templates_dir != NULL) {
        if (snprintf(path, sizeof path, "%s/%s/template.json", templates_dir, name) >=
            (int)sizeof path) {
            sp_err_set(err, SP_EINVAL, "templates dir path too long");
            return NULL;
        }
        char *s = read_file(path, 1 << 20, len);
        if (s == NULL)
            sp_err_set(err, errno == ENOENT ? SP_ENOTFOUND : SP_EINVAL,
                       "cannot read template '%s' from the templates dir: %s", name,
                       strerror(errno));
        return s;
    }
    snprintf(path, sizeof path, "templates/%s/template.json", name);
    const sp_guest_file_t *f = embedded(path);
    if (f == NULL) {
        sp_err_set(err, SP_ENOTFOUND, "no built-in template '%s'", name);
        return NULL;
    }
    char *s = malloc(f->size + 1);
    if (s == NULL) {
        sp_err_set(err, SP_EINTERNAL, "out of memory");
        return NULL;
    }
    memcpy(s, f->data, f->size);
    s[f->size] = '\0';
    if (len != NULL)
        *len = f->size;
    return s;
}

const char *const *sp_tmplbuild_builtin_names(void)
{
    static char names[32][64];
    static const char *list[33];
    static int done;
    if (!done) {
        int n = 0;
        for (unsigned i = 0; i < sp_guest_nfiles && n < 32; i++) {
            const char *f = sp_guest_files[i].name;
            const char *end = strstr(f, "/template.json");
            if (strncmp(f, "templates/", 10) != 0 || end == NULL || end - (f + 10) >= 64)
                continue;
            snprintf(names[n], sizeof names[n], "%.*s", (int)(end - (f + 10)), f + 10);
            list[n] = names[n];
            n++;
        }
        list[n] = NULL;
        done = 1;
    }
    return list;
}

/* ---- hashing ------------------------------------------------------------- */

/* Length-prefixed so that no two different field lists hash alike. */
static void put(EVP_MD_CTX *c, const void *p, size_t n)
{
    unsigned char l[8];
    for (int i = 0; i < 8; i++)
        l[i] = (unsigned char)((uint64_t)n >> (8 * i));
    EVP_DigestUpdate(c, l, sizeof l);
    EVP_DigestUpdate(c, p, n);
}

static void put_s(EVP_MD_CTX *c, const char *s)
{
    put(c, s != NULL ? s : "", s != NULL ? strlen(s) : 0);
}

/* A SHA-256 begun, or NULL with out all zeros: EVP_MD_CTX_new fails only without memory, and
 * an all-zero hash never matches a cache entry, so the build just runs. */
static EVP_MD_CTX *hash_begin(char out[SP_TMPLBUILD_HASH_LEN + 1])
{
    EVP_MD_CTX *c = EVP_MD_CTX_new();
    if (c == NULL || EVP_DigestInit_ex(c, EVP_sha256(), NULL) != 1) {
        memset(out, '0', SP_TMPLBUILD_HASH_LEN);
        out[SP_TMPLBUILD_HASH_LEN] = '\0';
        EVP_MD_CTX_free(c);
        return NULL;
    }
    return c;
}

/* Ends hash_begin's c: its hex digest into out, c freed. */
static void hash_end(EVP_MD_CTX *c, char out[SP_TMPLBUILD_HASH_LEN + 1])
{
    unsigned char md[EVP_MAX_MD_SIZE];
    unsigned mdlen = 0;
    EVP_DigestFinal_ex(c, md, &mdlen);
    EVP_MD_CTX_free(c);
    sp_text_hex(md, mdlen, out);
}

/* Hex SHA-256 over the code daemon's files (code/ in the binary: names and contents) into
 * out[65]; all zeros only without memory (then no cache entry matches). */
static void code_sha256(char out[SP_TMPLBUILD_HASH_LEN + 1])
{
    EVP_MD_CTX *c = hash_begin(out);
    if (c == NULL)
        return;
    for (unsigned i = 0; i < sp_guest_nfiles; i++) {
        if (strncmp(sp_guest_files[i].name, "code/", 5) != 0)
            continue;
        put_s(c, sp_guest_files[i].name);
        put(c, sp_guest_files[i].data, sp_guest_files[i].size);
    }
    hash_end(c, out);
}

void sp_tmplbuild_input_hash(const sp_tmplbuild_spec_t *spec, const char *agent_sha256,
                             const char *kernel_version, char out[SP_TMPLBUILD_HASH_LEN + 1])
{
    EVP_MD_CTX *c = hash_begin(out);
    if (c == NULL)
        return;
    put_s(c, "space-template-v1");
    put_s(c, spec->canonical);
    for (unsigned i = 0; i < sp_guest_nfiles; i++) {
        if (strncmp(sp_guest_files[i].name, "scripts/", 8) != 0)
            continue;
        put_s(c, sp_guest_files[i].name);
        put(c, sp_guest_files[i].data, sp_guest_files[i].size);
    }
    put_s(c, agent_sha256);
    put_s(c, kernel_version);
    if (spec->code_interpreter) {
        /* only then: a daemon change must not rebuild templates that do not carry it */
        char sha[SP_TMPLBUILD_HASH_LEN + 1];
        put_s(c, "code");
        if (embedded(SP_CODE_EMBED_NAME) == NULL) {
            put_s(c, "absent"); /* the build then refuses, see sp_tmplbuild_run */
        } else {
            code_sha256(sha);
            put_s(c, sha);
        }
    }
    hash_end(c, out);
}

int sp_tmplbuild_file_sha256(const char *path, char out[SP_TMPLBUILD_HASH_LEN + 1], sp_err_t *err)
{
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0)
        return sp_err_set(err, errno == ENOENT ? SP_ENOTFOUND : SP_EINVAL, "cannot open %s: %s",
                          path, strerror(errno));
    EVP_MD_CTX *c = EVP_MD_CTX_new();
    if (c == NULL || EVP_DigestInit_ex(c, EVP_sha256(), NULL) != 1) {
        EVP_MD_CTX_free(c);
        close(fd);
        return sp_err_set(err, SP_EINTERNAL, "sha256 init failed");
    }
    char buf[1 << 16];
    ssize_t n;
    while ((n = read(fd, buf, sizeof buf)) > 0)
        EVP_DigestUpdate(c, buf, (size_t)n);
    int rerr = n < 0 ? errno : 0;
    close(fd);
    unsigned char md[EVP_MAX_MD_SIZE];
    unsigned mdlen = 0;
    EVP_DigestFinal_ex(c, md, &mdlen);
    EVP_MD_CTX_free(c);
    if (rerr != 0)
        return sp_err_set(err, SP_EINTERNAL, "cannot read %s: %s", path, strerror(rerr));
    sp_text_hex(md, mdlen, out);
    return 0;
}

/* ---- layout -------------------------------------------------------------- */

static int fmt(char *buf, size_t n, sp_err_t *err, const char *f, ...)
    __attribute__((format(printf, 4, 5)));
static int fmt(char *buf, size_t n, sp_err_t *err, const char *f, ...)
{
    va_list ap;
    va_start(ap, f);
    int w = vsnprintf(buf, n, f, ap);
    va_end(ap);
    if (w < 0 || (size_t)w >= n)
        return sp_err_set(err, SP_EINVAL, "data dir path too long");
    return 0;
}

int sp_tmplbuild_paths(const char *data_dir, const char *name, const char *hash,
                       const char *kernel_version, sp_tmplbuild_paths_t *out, sp_err_t *err)
{
    memset(out, 0, sizeof *out);
    if (!sp_tmplbuild_valid_name(name))
        return sp_err_set(err, SP_EINVAL, "bad template name");
    if (strlen(hash) != SP_TMPLBUILD_HASH_LEN ||
        strlen(kernel_version) >= sizeof out->kernel_version ||
        strchr(kernel_version, '/') != NULL || kernel_version[0] == '.' ||
        kernel_version[0] == '\0')
        return sp_err_set(err, SP_EINVAL, "bad hash or kernel version");
    memcpy(out->hash, hash, SP_TMPLBUILD_HASH_LEN + 1);
    strcpy(out->kernel_version, kernel_version);
    if (fmt(out->build_dir, sizeof out->build_dir, err, "%s/templates/%s/%s", data_dir, name,
            hash) < 0 ||
        fmt(out->rootfs, sizeof out->rootfs, err, "%s/rootfs.qcow2", out->build_dir) < 0 ||
        fmt(out->manifest, sizeof out->manifest, err, "%s/manifest.json", out->build_dir) < 0 ||
        fmt(out->kernel, sizeof out->kernel, err, "%s/images/kernel/%s/vmlinux", data_dir,
            kernel_version) < 0)
        return -1;
    return 0;
}

/* Reads <build_dir>/manifest.json into out (paths made absolute). */
static int read_manifest(const char *data_dir, const char *name, const char *hash,
                         sp_tmplbuild_paths_t *out, sp_err_t *err)
{
    char path[PATH_MAX];
    if (fmt(path, sizeof path, err, "%s/templates/%s/%s/manifest.json", data_dir, name, hash) < 0)
        return -1;
    json_error_t jerr;
    json_t *m = json_load_file(path, 0, &jerr);
    if (m == NULL)
        return sp_err_set(err, SP_ENOTFOUND, "template '%s' build %.12s has no manifest", name,
                          hash);
    const char *kver = json_string_value(json_object_get(m, "kernel_version"));
    const char *initrd = json_string_value(json_object_get(m, "initramfs"));
    const char *mhash = json_string_value(json_object_get(m, "hash"));
    int rc = -1;
    if (kver == NULL || initrd == NULL || mhash == NULL || strcmp(mhash, hash) != 0) {
        sp_err_set(err, SP_EINTERNAL, "template '%s' manifest is damaged", name);
        goto out;
    }
    if (sp_tmplbuild_paths(data_dir, name, hash, kver, out, err) < 0 ||
        fmt(out->initramfs, sizeof out->initramfs, err, "%s/%s", data_dir, initrd) < 0)
        goto out;
    out->cpu_count = (int)json_integer_value(json_object_get(m, "cpu_count"));
    out->memory_mb = (int)json_integer_value(json_object_get(m, "memory_mb"));
    out->disk_mb = (int)json_integer_value(json_object_get(m, "disk_mb"));
    out->code_interpreter = json_is_true(json_object_get(m, "code_interpreter"));
    out->warmup = json_is_array(json_object_get(m, "warmup"));
    rc = 0;
out:
    json_decref(m);
    return rc;
}

int sp_tmplbuild_current(const char *data_dir, const char *name, sp_tmplbuild_paths_t *out,
                         sp_err_t *err)
{
    char link[PATH_MAX], target[128];
    const char *at = strchr(name, '@');
    if (at != NULL) { /* "<name>@<hash>": that version, current or not */
        char base[64];
        size_t k = (size_t)(at - name);
        if (k == 0 || k >= sizeof base || strlen(at + 1) != SP_TMPLBUILD_HASH_LEN ||
            strspn(at + 1, "0123456789abcdef") != SP_TMPLBUILD_HASH_LEN)
            return sp_err_set(err, SP_EINVAL, "bad template version");
        memcpy(base, name, k);
        base[k] = '\0';
        if (!sp_tmplbuild_valid_name(base))
            return sp_err_set(err, SP_EINVAL, "bad template name");
        return read_manifest(data_dir, base, at + 1, out, err);
    }
    if (!sp_tmplbuild_valid_name(name))
        return sp_err_set(err, SP_EINVAL, "bad template name");
    if (fmt(link, sizeof link, err, "%s/templates/%s/current", data_dir, name) < 0)
        return -1;
    ssize_t n = readlink(link, target, sizeof target - 1);
    if (n < 0)
        return sp_err_set(err, SP_ENOTFOUND, "template '%s' is not built", name);
    target[n] = '\0';
    if ((size_t)n != SP_TMPLBUILD_HASH_LEN)
        return sp_err_set(err, SP_EINTERNAL, "template '%s': bad current link", name);
    return read_manifest(data_dir, name, target, out, err);
}

/* ---- running scripts ----------------------------------------------------- */

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
}

typedef struct {
    const char *name;
    int progress;
    int tty;
    int step, nsteps;
    const char *label;
    double t0;
    int log_fd;
    char log_path[PATH_MAX];
    char **env; /* environ (minus the caller's SP_*) + ours for the scripts */
    size_t n_env, n_inherited, cap_env;
    double times[8];
} build_t;

static void progress_line(build_t *b, const char *state, double secs, int final)
{
    if (!b->progress)
        return;
    if (b->tty)
        fprintf(stderr, "\r\033[K  [%d/%d] %-10s %s %6.1fs%s", b->step, b->nsteps, b->label, state,
                secs, final ? "\n" : "");
    else if (final || secs == 0)
        fprintf(stderr, "template %s: [%d/%d] %s %s%s%.1fs\n", b->name, b->step, b->nsteps,
                b->label, state, final ? " in " : " ", secs);
    fflush(stderr);
}

static void step_begin(build_t *b, const char *label)
{
    b->step++;
    b->label = label;
    b->t0 = now_s();
    if (b->log_fd >= 0)
        dprintf(b->log_fd, "==== [%d/%d] %s\n", b->step, b->nsteps, label);
    if (b->progress && !b->tty)
        fprintf(stderr, "template %s: [%d/%d] %s ...\n", b->name, b->step, b->nsteps, label);
    else
        progress_line(b, "...", 0, 0);
}

static void step_end(build_t *b, const char *state)
{
    double t = now_s() - b->t0;
    if (b->step - 1 < 8)
        b->times[b->step - 1] = t;
    progress_line(b, state, t, 1);
}

/* Prints the last lines of the build log to stderr. */
static void show_log_tail(build_t *b)
{
    if (!b->progress)
        return;
    size_t len;
    char *s = read_file(b->log_path, 64u << 20, &len);
    if (s == NULL)
        return;
    size_t p = len;
    int lines = 0;
    while (p > 0 && lines <= 20)
        if (s[--p] == '\n')
            lines++;
    fprintf(stderr, "---- last lines of %s\n%s----\n", b->log_path, s + p);
    free(s);
}

/* Runs argv (argv[0] found on PATH) with the build env, output appended to
 * the log (or into capture when not NULL), redrawing the elapsed time on a
 * tty. Returns the exit status, or -1 if it could not run. */
/* Closes every fd from lo up (close_range where the kernel has it, else one by one). */
static void closefrom_safe(int lo)
{
#ifdef SYS_close_range
    if (syscall(SYS_close_range, (unsigned)lo, ~0u, 0) == 0)
        return;
#endif
    long max = sysconf(_SC_OPEN_MAX);
    for (int fd = lo; fd < (max > 0 && max < 65536 ? max : 65536); fd++)
        close(fd);
}

static int run(build_t *b, char *const argv[], char *capture, size_t cap)
{
    int pfd[2] = {-1, -1};
    if (capture != NULL && pipe2(pfd, O_CLOEXEC) < 0)
        return -1;
    pid_t pid = fork();
    if (pid < 0) {
        if (pfd[0] >= 0) {
            close(pfd[0]);
            close(pfd[1]);
        }
        return -1;
    }
    if (pid == 0) {
        /* A killed builder takes its script with it (the script's own
         * children, mmdebstrap say, still finish or fail on their own; their
         * output lands in a work dir the next build removes). */
        prctl(PR_SET_PDEATHSIG, SIGTERM);
        int devnull = open("/dev/null", O_RDWR);
        int outfd = capture != NULL ? pfd[1] : (b->log_fd >= 0 ? b->log_fd : devnull);
        int errfd = b->log_fd >= 0 ? b->log_fd : devnull;
        dup2(devnull, 0);
        dup2(outfd, 1);
        dup2(errfd, 2);
        /* Nothing else of ours reaches the scripts: mmdebstrap's shell hooks redirect to fds
         * above 9, which a /bin/sh cannot use once such a number is already taken, and a
         * server's sockets have no business in a build. */
        closefrom_safe(3);
        execvpe(argv[0], argv, b->env);
        _exit(127);
    }
    size_t got = 0;
    if (capture != NULL) {
        close(pfd[1]);
        ssize_t n;
        while (got + 1 < cap && (n = read(pfd[0], capture + got, cap - 1 - got)) > 0)
            got += (size_t)n;
        capture[got] = '\0';
        close(pfd[0]);
    }
    int status;
    for (;;) {
        pid_t r = waitpid(pid, &status, b->progress && b->tty ? WNOHANG : 0);
        if (r == pid)
            break;
        if (r < 0 && errno != EINTR)
            return -1;
        if (r == 0) {
            progress_line(b, "...", now_s() - b->t0, 0);
            poll(NULL, 0, 200);
        }
    }
    return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
}

static int mkdir_p(const char *path, mode_t mode)
{
    char buf[PATH_MAX];
    if (snprintf(buf, sizeof buf, "%s", path) >= (int)sizeof buf)
        return -1;
    for (char *p = buf + 1; *p; p++) {
        if (*p == '/') {
            *p = '\0';
            if (mkdir(buf, mode) < 0 && errno != EEXIST)
                return -1;
            *p = '/';
        }
    }
    return mkdir(buf, mode) < 0 && errno != EEXIST ? -1 : 0;
}

static int write_file(const char *path, const void *data, size_t n, mode_t mode)
{
    int fd = open(path, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, mode);
    if (fd < 0)
        return -1;
    const char *p = data;
    while (n > 0) {
        ssize_t w = write(fd, p, n);
        if (w < 0 && errno == EINTR)
            continue;
        if (w <= 0) {
            close(fd);
            return -1;
        }
        p += w;
        n -= (size_t)w;
    }
    return close(fd);
}

/* ---- versions from a snapshot dir every worker shares ------------------- */

/* A path a manifest names relative to a data dir: no absolute path, no "..". */
static bool plain_rel(const char *p)
{
    return p != NULL && p[0] != '\0' && p[0] != '/' && strstr(p, "..") == NULL;
}

/* dst as src's name on this host: a hard link where the file systems allow, else a symlink to
 * the shared copy (which is never modified: shared.c renames files into place). */
static int link_or_symlink(const char *src, const char *dst)
{
    if (link(src, dst) == 0)
        return 0;
    return symlink(src, dst);
}

int sp_tmplbuild_import(const char *data_dir, const char *shared_dir, const char *name,
                        const char *hash, sp_err_t *err)
{
    char src[PATH_MAX], dst[PATH_MAX], tmp[PATH_MAX], p[PATH_MAX], q[PATH_MAX];
    if (!sp_tmplbuild_valid_name(name) || strlen(hash) != SP_TMPLBUILD_HASH_LEN ||
        strspn(hash, "0123456789abcdef") != SP_TMPLBUILD_HASH_LEN)
        return sp_err_set(err, SP_EINVAL, "bad template version");
    if (fmt(src, sizeof src, err, "%s/templates/%s/%s", shared_dir, name, hash) < 0 ||
        fmt(dst, sizeof dst, err, "%s/templates/%s/%s", data_dir, name, hash) < 0 ||
        fmt(tmp, sizeof tmp, err, "%s/templates/%s/.import-%.12s-%d", data_dir, name, hash,
            (int)getpid()) < 0 ||
        fmt(p, sizeof p, err, "%s/manifest.json", dst) < 0)
        return -1;
    struct stat st;
    if (stat(p, &st) == 0)
        return 0; /* here already */
    if (fmt(p, sizeof p, err, "%s/manifest.json", src) < 0)
        return -1;
    size_t len = 0;
    char *text = read_file(p, 1u << 20, &len); /* a manifest is a few KiB */
    if (text == NULL && errno == ENOENT)
        return sp_err_set(err, SP_ENOTFOUND,
                          "template '%s' version %.12s is not published in the snapshot dir", name,
                          hash);
    if (text == NULL)
        return sp_err_set(err, SP_EINTERNAL,
                          "template '%s' version %.12s: cannot read the published manifest: %s",
                          name, hash, strerror(errno));
    json_t *m = json_loadb(text, len, 0, NULL);
    const char *mhash = json_string_value(json_object_get(m, "hash"));
    const char *kver = json_string_value(json_object_get(m, "kernel_version"));
    const char *initrd = json_string_value(json_object_get(m, "initramfs"));
    char kernel[PATH_MAX];
    int rc = -1;
    if (mhash == NULL || strcmp(mhash, hash) != 0 || kver == NULL || kver[0] == '\0' ||
        kver[0] == '.' || strchr(kver, '/') != NULL || !plain_rel(initrd) ||
        fmt(kernel, sizeof kernel, NULL, "images/kernel/%s/vmlinux", kver) < 0) {
        sp_err_set(err, SP_EINTERNAL,
                   "template '%s' version %.12s: the published manifest is damaged", name, hash);
        goto out;
    }
    /* its kernel and initramfs: where this host has none, the published ones */
    const char *imgs[] = {kernel, initrd};
    for (size_t i = 0; i < 2; i++) {
        if (fmt(p, sizeof p, err, "%s/%s", data_dir, imgs[i]) < 0 ||
            fmt(q, sizeof q, err, "%s/%s", shared_dir, imgs[i]) < 0)
            goto out;
        if (stat(p, &st) == 0)
            continue;
        char dir[PATH_MAX];
        snprintf(dir, sizeof dir, "%s", p);
        *strrchr(dir, '/') = '\0';
        if (stat(q, &st) < 0 || mkdir_p(dir, 0755) < 0 ||
            (link_or_symlink(q, p) < 0 && errno != EEXIST)) {
            sp_err_set(err, SP_ENOTFOUND,
                       "template '%s' version %.12s: %s is neither here nor published", name, hash,
                       imgs[i]);
            goto out;
        }
    }
    if (fmt(p, sizeof p, err, "%s/templates/%s", data_dir, name) < 0)
        goto out;
    sp_rm_rf(tmp);
    char rootfs_src[PATH_MAX], rootfs_dst[PATH_MAX], man[PATH_MAX];
    if (fmt(rootfs_src, sizeof rootfs_src, err, "%s/rootfs.qcow2", src) < 0 ||
        fmt(rootfs_dst, sizeof rootfs_dst, err, "%s/rootfs.qcow2", tmp) < 0 ||
        fmt(man, sizeof man, err, "%s/manifest.json", tmp) < 0)
        goto out;
    if (stat(rootfs_src, &st) < 0) {
        sp_err_set(err, SP_ENOTFOUND,
                   "template '%s' version %.12s: its image is not published in the snapshot dir",
                   name, hash);
        goto out;
    }
    if (mkdir_p(p, 0755) < 0 || mkdir(tmp, 0755) < 0 ||
        link_or_symlink(rootfs_src, rootfs_dst) < 0 || write_file(man, text, len, 0644) < 0) {
        sp_err_set(err, SP_EINTERNAL, "template '%s' version %.12s: cannot import it into %s: %s",
                   name, hash, p, strerror(errno));
        sp_rm_rf(tmp);
        goto out;
    }
    if (rename(tmp, dst) < 0) {
        int e = errno;
        sp_rm_rf(tmp);
        if (fmt(man, sizeof man, err, "%s/manifest.json", dst) < 0)
            goto out;
        if (stat(man, &st) < 0) { /* not another import that won the race */
            sp_err_set(err, SP_EINTERNAL, "template '%s' version %.12s: cannot import it: %s", name,
                       hash, strerror(e));
            goto out;
        }
    }
    int dfd = open(p, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (dfd >= 0) {
        fsync(dfd);
        close(dfd);
    }
    sp_log(SP_LOG_INFO, "tmplbuild",
           "template version imported from the snapshot dir template=%s hash=%.12s", name, hash);
    rc = 0;
out:
    json_decref(m);
    free(text);
    return rc;
}
int sp_tmplbuild_find(const char *data_dir, const char *shared_dir, const char *name,
                      sp_tmplbuild_paths_t *out, sp_err_t *err)
{
    sp_err_t e;
    if (sp_tmplbuild_current(data_dir, name, out, &e) == 0)
        return 0;
    const char *at = strchr(name, '@');
    char base[64];
    if (e.code != SP_ENOTFOUND || shared_dir == NULL || shared_dir[0] == '\0' || at == NULL ||
        (size_t)(at - name) >= sizeof base) {
        if (err != NULL)
            *err = e;
        return -1;
    }
    memcpy(base, name, (size_t)(at - name));
    base[at - name] = '\0';
    if (sp_tmplbuild_import(data_dir, shared_dir, base, at + 1, err) < 0) {
        sp_log(SP_LOG_WARN, "tmplbuild", "template version not imported template=%s err=%s", name,
               err != NULL ? err->msg : "");
        return -1;
    }
    return sp_tmplbuild_current(data_dir, name, out, err);
}

/* Removes work dirs of earlier killed builds of this template (we hold its lock). */
static void remove_stale_work(const char *tmpdir, const char *name)
{
    DIR *d = opendir(tmpdir);
    if (d == NULL)
        return;
    size_t nl = strlen(name);
    struct dirent *e;
    while ((e = readdir(d)) != NULL) {
        if (strncmp(e->d_name, name, nl) == 0 && e->d_name[nl] == '@') {
            char p[PATH_MAX];
            if (snprintf(p, sizeof p, "%s/%s", tmpdir, e->d_name) < (int)sizeof p) {
                sp_log(SP_LOG_INFO, "tmplbuild", "removing stale work dir %s", p);
                sp_rm_rf(p);
            }
        }
    }
    closedir(d);
}

/* Newest kernel already in <data>/images/kernel, for offline builds. */
static int newest_cached_kernel(const char *data_dir, char *out, size_t n)
{
    char p[PATH_MAX];
    if (fmt(p, sizeof p, NULL, "%s/images/kernel", data_dir) < 0)
        return -1;
    DIR *d = opendir(p);
    if (d == NULL)
        return -1;
    struct dirent *e;
    out[0] = '\0';
    while ((e = readdir(d)) != NULL) {
        char v[PATH_MAX];
        struct stat st;
        if (e->d_name[0] == '.' || strlen(e->d_name) >= n)
            continue;
        if (fmt(v, sizeof v, NULL, "%s/%s/vmlinux", p, e->d_name) == 0 && stat(v, &st) == 0 &&
            strverscmp(e->d_name, out) > 0)
            snprintf(out, n, "%s", e->d_name);
    }
    closedir(d);
    return out[0] != '\0' ? 0 : -1;
}

/* "kernel.sh resolve" costs ~0.6 s (apt-cache parses every package list
 * when there is no pkgcache), too slow for a cached build. Its answer only
 * changes when apt's lists do, and apt-get update renames new lists into
 * the directory, which changes its mtime: remember the answer keyed by it. */
#define APT_LISTS_DIR "/var/lib/apt/lists"

static int lists_stamp(char *out, size_t n)
{
    struct stat st;
    if (stat(APT_LISTS_DIR, &st) < 0)
        return -1;
    snprintf(out, n, "%lld.%09ld:%llu", (long long)st.st_mtim.tv_sec, st.st_mtim.tv_nsec,
             (unsigned long long)st.st_ino);
    return 0;
}

static int resolved_cached(const char *data_dir, char *kver, size_t n)
{
    char path[PATH_MAX], stamp[64], want[64];
    if (lists_stamp(want, sizeof want) < 0 ||
        fmt(path, sizeof path, NULL, "%s/images/kernel/.resolved", data_dir) < 0)
        return -1;
    char *s = read_file(path, 512, NULL);
    if (s == NULL)
        return -1;
    char v[128];
    int ok = sscanf(s, "%63s %127s", stamp, v) == 2 && strcmp(stamp, want) == 0 && strlen(v) < n;
    free(s);
    if (!ok)
        return -1;
    snprintf(kver, n, "%s", v);
    return 0;
}

static void resolved_store(const char *data_dir, const char *kver)
{
    char path[PATH_MAX], tmp[PATH_MAX], line[256], stamp[64];
    if (lists_stamp(stamp, sizeof stamp) < 0 ||
        fmt(path, sizeof path, NULL, "%s/images/kernel", data_dir) < 0 || mkdir_p(path, 0755) < 0 ||
        fmt(path, sizeof path, NULL, "%s/images/kernel/.resolved", data_dir) < 0 ||
        fmt(tmp, sizeof tmp, NULL, "%s.tmp", path) < 0)
        return;
    int n = snprintf(line, sizeof line, "%s %s\n", stamp, kver);
    if (n > 0 && (size_t)n < sizeof line && write_file(tmp, line, (size_t)n, 0644) == 0)
        rename(tmp, path);
}

/* The spec's files into <work>/files: one file per entry, named by its index, and "list" with
 * a line "<index> <octal mode> <path>" each (customize.sh writes them into the image). */
static int write_spec_files(const char *work, const sp_tmplbuild_spec_t *spec, char *dir,
                            size_t cap, sp_err_t *err)
{
    char path[PATH_MAX];
    if (fmt(dir, cap, err, "%s/files", work) < 0)
        return -1;
    if (mkdir(dir, 0700) < 0)
        return sp_err_set(err, SP_EINTERNAL, "cannot make %s: %s", dir, strerror(errno));
    char *list = NULL;
    size_t n = 0;
    FILE *f = open_memstream(&list, &n);
    for (size_t i = 0; f != NULL && i < spec->n_files; i++) {
        const sp_tmplbuild_file_t *sf = &spec->files[i];
        int bad = fmt(path, sizeof path, err, "%s/%zu", dir, i) < 0;
        if (!bad && write_file(path, sf->content, sf->len, 0600) < 0)
            bad = sp_err_set(err, SP_EINTERNAL, "cannot write %s: %s", path, strerror(errno));
        if (bad) {
            fclose(f);
            free(list);
            return -1;
        }
        fprintf(f, "%zu %o %s\n", i, sf->mode, sf->path);
    }
    if (f == NULL || fclose(f) != 0) {
        free(list);
        return sp_err_set(err, SP_EINTERNAL, "out of memory");
    }
    int rc = fmt(path, sizeof path, err, "%s/list", dir) < 0 ? -1 : 0;
    if (rc == 0 && write_file(path, list, n, 0600) < 0)
        rc = sp_err_set(err, SP_EINTERNAL, "cannot write %s: %s", path, strerror(errno));
    free(list);
    return rc;
}

static int add_env(build_t *b, const char *k, const char *v)
{
    char *s;
    if (b->n_env + 1 >= b->cap_env || asprintf(&s, "%s=%s", k, v != NULL ? v : "") < 0)
        return -1;
    b->env[b->n_env++] = s;
    b->env[b->n_env] = NULL;
    return 0;
}

static void free_env(build_t *b)
{
    if (b->env == NULL)
        return;
    for (size_t i = b->n_inherited; i < b->n_env; i++)
        free(b->env[i]); /* ours; the ones before belong to environ */
    free(b->env);
}

/* environ without any SP_* the caller had, plus ours (added later). */
static int make_env(build_t *b)
{
    size_t n = 0;
    while (environ[n] != NULL)
        n++;
    b->cap_env = n + 16;
    b->env = calloc(b->cap_env, sizeof(char *));
    if (b->env == NULL)
        return -1;
    for (size_t i = 0; i < n; i++)
        if (strncmp(environ[i], "SP_", 3) != 0)
            b->env[b->n_env++] = environ[i];
    b->n_inherited = b->n_env;
    return 0;
}

static int write_manifest(const char *path, const sp_tmplbuild_spec_t *spec, const char *hash,
                          const char *kver, const char *initrd_rel, const char *agent_sha,
                          const char *code_sha, long long rootfs_bytes, long long rootfs_alloc,
                          const build_t *b, double total)
{
    char kernel_rel[PATH_MAX], rootfs_rel[PATH_MAX], when[64];
    time_t t = time(NULL);
    struct tm tm;
    gmtime_r(&t, &tm);
    strftime(when, sizeof when, "%Y-%m-%dT%H:%M:%SZ", &tm);
    snprintf(kernel_rel, sizeof kernel_rel, "images/kernel/%s/vmlinux", kver);
    snprintf(rootfs_rel, sizeof rootfs_rel, "templates/%s/%s/rootfs.qcow2", spec->name, hash);
    json_t *spec_json = json_loads(spec->canonical, 0, NULL);
    json_t *m = json_pack("{s:s, s:s, s:s, s:s, s:s, s:s, s:o, s:i, s:i, s:i, s:I, s:I, s:s, "
                          "s:f, s:{s:f, s:f, s:f, s:f, s:f}, s:o}",
                          "name", spec->name, "hash", hash, "kernel_version", kver, "kernel",
                          kernel_rel, "initramfs", initrd_rel, "rootfs", rootfs_rel, "agent_sha256",
                          agent_sha != NULL ? json_string(agent_sha) : json_null(), "cpu_count",
                          spec->cpu_count, "memory_mb", spec->memory_mb, "disk_mb", spec->disk_mb,
                          "rootfs_bytes", (json_int_t)rootfs_bytes, "rootfs_allocated_bytes",
                          (json_int_t)rootfs_alloc, "built_at", when, "build_seconds", total,
                          "step_seconds", "kernel", b->times[0], "initramfs", b->times[1], "rootfs",
                          b->times[2], "image", b->times[3], "install", b->times[4], "spec",
                          spec_json != NULL ? spec_json : json_null());
    if (m == NULL)
        return -1;
    json_t *wu = json_null();
    if (spec->warmup != NULL) {
        wu = json_array();
        for (size_t i = 0; wu != NULL && i < spec->n_warmup; i++)
            json_array_append_new(wu, json_string(spec->warmup[i]));
    }
    if (wu == NULL ||
        json_object_set_new(m, "code_interpreter", json_boolean(spec->code_interpreter)) < 0 ||
        json_object_set_new(m, "code_sha256",
                            code_sha != NULL ? json_string(code_sha) : json_null()) < 0 ||
        json_object_set_new(m, "warmup", wu) < 0) {
        json_decref(m);
        return -1;
    }
    int rc = json_dump_file(m, path, JSON_INDENT(2) | JSON_SORT_KEYS);
    json_decref(m);
    return rc;
}

static int step_failed(build_t *b, int status, sp_err_t *err, const char *what)
{
    step_end(b, "FAILED");
    show_log_tail(b);
    sp_log(SP_LOG_ERROR, "tmplbuild", "template=%s step=%s status=%d log=%s", b->name, what, status,
           b->log_path);
    return sp_err_set(err, SP_EUNAVAIL, "template %s: %s failed (see build.log)", b->name, what);
}

/* Points <tdir>/current at hash: a new symlink renamed over it (atomic). */
static int point_current(const char *tdir, const char *hash, sp_err_t *err)
{
    char tmp[PATH_MAX], cur[PATH_MAX];
    fmt(tmp, sizeof tmp, err, "%s/current.tmp", tdir);
    fmt(cur, sizeof cur, err, "%s/current", tdir);
    unlink(tmp);
    if (symlink(hash, tmp) < 0 || rename(tmp, cur) < 0)
        return sp_err_set(err, SP_EINTERNAL, "cannot update current: %s", strerror(errno));
    return 0;
}

int sp_tmplbuild_run(const sp_tmplbuild_opts_t *o, sp_tmplbuild_paths_t *out, sp_err_t *err)
{
    sp_tmplbuild_paths_t paths_local;
    sp_tmplbuild_paths_t *paths = out != NULL ? out : &paths_local;
    if (o == NULL || o->data_dir == NULL || o->name == NULL)
        return sp_err_set(err, SP_EINVAL, "template build needs a name and a data dir");
    double t_start = now_s();
    build_t b = {
        .name = o->name, .progress = o->progress, .tty = isatty(2), .nsteps = 5, .log_fd = -1};
    sp_tmplbuild_spec_t *spec = NULL;
    char *text = NULL;
    char data_dir[PATH_MAX], tdir[PATH_MAX], tmpdir[PATH_MAX], work[PATH_MAX] = "";
    char p1[PATH_MAX], p2[PATH_MAX], p3[PATH_MAX];
    char kver[128], agent_sha[SP_TMPLBUILD_HASH_LEN + 1], hash[SP_TMPLBUILD_HASH_LEN + 1];
    int lock_fd = -1, rc = -1, st;

    if (mkdir_p(o->data_dir, 0755) < 0 || realpath(o->data_dir, data_dir) == NULL)
        return sp_err_set(err, SP_EINVAL, "cannot use data dir: %s", strerror(errno));

    /* Spec. */
    size_t len = 0;
    if (o->spec_json != NULL) {
        text = strdup(o->spec_json);
        len = text != NULL ? strlen(text) : 0;
    } else {
        text = sp_tmplbuild_spec_load(o->templates_dir, o->name, &len, err);
        if (text == NULL)
            return -1;
    }
    if (text == NULL || sp_tmplbuild_spec_parse(text, len, &spec, err) < 0)
        goto out;
    if (strcmp(spec->name, o->name) != 0) {
        sp_err_set(err, SP_EINVAL, "spec name '%s' does not match template '%s'", spec->name,
                   o->name);
        goto out;
    }

    /* Agent. */
    if (spec->agent) {
        if (o->agent_path == NULL) {
            sp_err_set(err, SP_EINVAL, "template %s needs the guest agent binary", o->name);
            goto out;
        }
        if (sp_tmplbuild_file_sha256(o->agent_path, agent_sha, err) < 0)
            goto out;
    }

    /* Code daemon: compiled in (guest/code/space-code), like the scripts. */
    const sp_guest_file_t *code = NULL;
    char code_sha[SP_TMPLBUILD_HASH_LEN + 1];
    if (spec->code_interpreter) {
        code = embedded(SP_CODE_EMBED_NAME);
        if (code == NULL) {
            sp_err_set(err, SP_EUNAVAIL,
                       "template %s wants code_interpreter, but this build carries no code "
                       "daemon (guest/code/space-code)",
                       o->name);
            goto out;
        }
        code_sha256(code_sha); /* every file of the daemon */
    }

    if (make_env(&b) < 0) {
        sp_err_set(err, SP_EINTERNAL, "out of memory");
        goto out;
    }

    /* Lock, then everything under templates/<name> and tmp/ is ours. */
    if (fmt(tdir, sizeof tdir, err, "%s/templates/%s", data_dir, o->name) < 0 ||
        fmt(tmpdir, sizeof tmpdir, err, "%s/tmp", data_dir) < 0 ||
        fmt(p1, sizeof p1, err, "%s/.lock", tdir) < 0)
        goto out;
    if (mkdir_p(tdir, 0755) < 0 || mkdir_p(tmpdir, 0755) < 0 ||
        (lock_fd = open(p1, O_RDWR | O_CREAT | O_CLOEXEC, 0644)) < 0) {
        sp_err_set(err, SP_EINVAL, "cannot write the data dir: %s", strerror(errno));
        goto out;
    }
    if (flock(lock_fd, LOCK_EX | LOCK_NB) < 0) {
        if (o->progress)
            fprintf(stderr, "template %s: waiting for another build to finish\n", o->name);
        if (flock(lock_fd, LOCK_EX) < 0) {
            sp_err_set(err, SP_EINTERNAL, "cannot lock template %s", o->name);
            goto out;
        }
    }
    remove_stale_work(tmpdir, o->name);
    if (fmt(work, sizeof work, err, "%s/%s@XXXXXX", tmpdir, o->name) < 0)
        goto out;
    if (mkdtemp(work) == NULL) {
        sp_err_set(err, SP_EINVAL, "cannot make a work dir: %s", strerror(errno));
        work[0] = '\0';
        goto out;
    }
    chmod(work, 0755); /* apt-get download drops to _apt inside it */

    /* Scripts out of the binary into work/scripts. */
    fmt(p1, sizeof p1, err, "%s/scripts", work);
    if (mkdir(p1, 0755) < 0) {
        sp_err_set(err, SP_EINTERNAL, "cannot write scripts: %s", strerror(errno));
        goto out;
    }
    for (unsigned i = 0; i < sp_guest_nfiles; i++) {
        const sp_guest_file_t *f = &sp_guest_files[i];
        if (strncmp(f->name, "scripts/", 8) != 0)
            continue;
        if (fmt(p1, sizeof p1, err, "%s/%s", work, f->name) < 0 ||
            write_file(p1, f->data, f->size, f->mode) < 0) {
            sp_err_set(err, SP_EINTERNAL, "cannot write scripts: %s", strerror(errno));
            goto out;
        }
    }

    /* Kernel version: pinned, else apt's candidate, else the newest cached. */
    if (o->kernel_version != NULL) {
        snprintf(kver, sizeof kver, "%s", o->kernel_version);
    } else if (resolved_cached(data_dir, kver, sizeof kver) == 0) {
        /* apt's lists have not changed since the last resolve */
    } else {
        char cap[256];
        fmt(p1, sizeof p1, err, "%s/scripts/kernel.sh", work);
        char *argv[] = {"sh", p1, "resolve", NULL};
        st = run(&b, argv, cap, sizeof cap);
        cap[strcspn(cap, "\n")] = '\0';
        size_t capn = strlen(cap);
        if (st == 0 && capn > 0 && capn < sizeof kver) {
            memcpy(kver, cap, capn + 1);
            resolved_store(data_dir, kver);
        } else if (newest_cached_kernel(data_dir, kver, sizeof kver) == 0) {
            sp_log(SP_LOG_WARN, "tmplbuild", "apt cannot resolve the kernel; using cached %s",
                   kver);
        } else {
            sp_err_set(err, SP_EUNAVAIL, "cannot resolve the guest kernel (apt lists missing?)");
            goto out;
        }
    }

    /* Cache check. */
    sp_tmplbuild_input_hash(spec, spec->agent ? agent_sha : NULL, kver, hash);
    if (!o->force && read_manifest(data_dir, o->name, hash, paths, NULL) == 0) {
        struct stat sb;
        if (stat(paths->rootfs, &sb) == 0 && stat(paths->kernel, &sb) == 0 &&
            stat(paths->initramfs, &sb) == 0) {
            if (point_current(tdir, hash, err) < 0)
                goto out;
            if (o->progress)
                fprintf(stderr, "template %s: up to date (%.12s, %.2fs)\n", o->name, hash,
                        now_s() - t_start);
            rc = 0;
            goto out;
        }
    }

    if (geteuid() != 0) {
        sp_err_set(err, SP_EUNAVAIL,
                   "building template %s needs root (mmdebstrap, image "
                   "ownership)",
                   o->name);
        goto out;
    }
    fmt(b.log_path, sizeof b.log_path, err, "%s/build.log", tdir);
    b.log_fd = open(b.log_path, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC | O_APPEND, 0644);
    if (b.log_fd < 0) {
        sp_err_set(err, SP_EINVAL, "cannot write build.log: %s", strerror(errno));
        goto out;
    }
    if (o->progress)
        fprintf(stderr, "template %s: building %.12s (kernel %s)\n", o->name, hash, kver);

    /* 1. Kernel (shared by all templates). */
    step_begin(&b, "kernel");
    char kdir[PATH_MAX];
    if (fmt(kdir, sizeof kdir, err, "%s/images/kernel/%s", data_dir, kver) < 0)
        goto out;
    fmt(p1, sizeof p1, err, "%s/vmlinux", kdir);
    struct stat sb;
    if (stat(p1, &sb) == 0) {
        step_end(&b, "cached");
    } else {
        fmt(p2, sizeof p2, err, "%s/images/kernel", data_dir);
        mkdir_p(p2, 0755);
        fmt(p2, sizeof p2, err, "%s/scripts/kernel.sh", work);
        char *argv[] = {"sh", p2, "fetch", kdir, kver, NULL};
        st = run(&b, argv, NULL, 0);
        if (st != 0 && stat(p1, &sb) != 0) { /* a parallel build may have won */
            step_failed(&b, st, err, st == 3 ? "kernel download" : "kernel");
            goto out;
        }
        step_end(&b, "done");
    }

    /* 2. Initramfs, shared, named by its inputs: the kernel, the scripts
     * that make it and the host busybox (newc stores inode numbers, so the
     * bytes themselves are not reproducible). */
    step_begin(&b, "initramfs");
    char initrd_rel[128];
    {
        char ikey[SP_TMPLBUILD_HASH_LEN + 1], bb[SP_TMPLBUILD_HASH_LEN + 1] = "apt";
        sp_tmplbuild_file_sha256("/bin/busybox", bb, NULL);
        EVP_MD_CTX *c = EVP_MD_CTX_new();
        unsigned char md[EVP_MAX_MD_SIZE];
        unsigned mdlen = 0;
        if (c == NULL || EVP_DigestInit_ex(c, EVP_sha256(), NULL) != 1) {
            EVP_MD_CTX_free(c);
            sp_err_set(err, SP_EINTERNAL, "sha256 init failed");
            goto out;
        }
        put_s(c, "space-initramfs-v1");
        put_s(c, kver);
        put_s(c, bb);
        for (unsigned i = 0; i < sp_guest_nfiles; i++) {
            const sp_guest_file_t *f = &sp_guest_files[i];
            if (strcmp(f->name, "scripts/init") == 0 ||
                strcmp(f->name, "scripts/make-initramfs.sh") == 0)
                put(c, f->data, f->size);
        }
        EVP_DigestFinal_ex(c, md, &mdlen);
        EVP_MD_CTX_free(c);
        sp_text_hex(md, mdlen, ikey);
        snprintf(initrd_rel, sizeof initrd_rel, "images/initramfs-%.16s.img", ikey);
    }
    fmt(p3, sizeof p3, err, "%s/%s", data_dir, initrd_rel);
    if (stat(p3, &sb) == 0) {
        step_end(&b, "cached");
    } else {
        fmt(p1, sizeof p1, err, "%s/scripts/make-initramfs.sh", work);
        fmt(p2, sizeof p2, err, "%s/initramfs.img", work);
        char *argv[] = {"sh", p1, kdir, p2, NULL};
        if ((st = run(&b, argv, NULL, 0)) != 0) {
            step_failed(&b, st, err, "initramfs");
            goto out;
        }
        if (rename(p2, p3) < 0) {
            sp_err_set(err, SP_EINTERNAL, "cannot install the initramfs: %s", strerror(errno));
            goto out;
        }
        step_end(&b, "done");
    }

    /* 3. Root filesystem tree. */
    step_begin(&b, "rootfs");
    {
        char *pk = NULL, *us = NULL;
        size_t pl = 0, ul = 0;
        FILE *f1 = open_memstream(&pk, &pl), *f2 = open_memstream(&us, &ul);
        for (size_t i = 0; f1 != NULL && i < spec->n_packages; i++)
            fprintf(f1, "%s%s", i ? "," : "", spec->packages[i]);
        for (size_t i = 0; f2 != NULL && i < spec->n_users; i++)
            fprintf(f2, "%s:%u:%s:%s:%d\n", spec->users[i].name, spec->users[i].uid,
                    spec->users[i].home, spec->users[i].shell, spec->users[i].sudo);
        if (f1 != NULL)
            fclose(f1);
        if (f2 != NULL)
            fclose(f2);
        int e = pk == NULL || us == NULL || add_env(&b, "SP_SUITE", spec->suite) < 0 ||
                add_env(&b, "SP_VARIANT", spec->variant) < 0 ||
                add_env(&b, "SP_PACKAGES", pk) < 0 || add_env(&b, "SP_USERS", us) < 0 ||
                add_env(&b, "SP_HOSTNAME", spec->hostname) < 0 ||
                add_env(&b, "SP_AGENT", spec->agent ? o->agent_path : "") < 0;
        if (!e && code != NULL) {
            /* The daemon's files into work/code: space-code and the modules beside it. */
            char cdir[PATH_MAX], cpath[PATH_MAX];
            int bad = fmt(cdir, sizeof cdir, err, "%s/code", work) < 0 || mkdir(cdir, 0755) < 0;
            for (unsigned i = 0; !bad && i < sp_guest_nfiles; i++) {
                const sp_guest_file_t *f = &sp_guest_files[i];
                if (strncmp(f->name, "code/", 5) != 0)
                    continue;
                bad = fmt(cpath, sizeof cpath, err, "%s/%s", work, f->name) < 0 ||
                      write_file(cpath, f->data, f->size, f == code ? 0755 : 0644) < 0;
            }
            if (bad) {
                free(pk);
                free(us);
                sp_err_set(err, SP_EINTERNAL, "cannot write the code daemon: %s", strerror(errno));
                goto out;
            }
            e = add_env(&b, "SP_CODE", cdir) < 0;
        }
        if (!e && spec->n_files > 0) {
            char fdir[PATH_MAX];
            if (write_spec_files(work, spec, fdir, sizeof fdir, err) < 0) {
                free(pk);
                free(us);
                goto out;
            }
            e = add_env(&b, "SP_FILES", fdir) < 0;
        }
        const char *src = getenv("SP_APT_SOURCES");
        if (!e && src != NULL)
            e = add_env(&b, "SP_APT_SOURCES", src) < 0;
        free(pk);
        free(us);
        if (e) {
            sp_err_set(err, SP_EINTERNAL, "out of memory");
            goto out;
        }
    }
    fmt(p1, sizeof p1, err, "%s/scripts/make-rootfs.sh", work);
    fmt(p2, sizeof p2, err, "%s/root", work);
    {
        char *argv[] = {"sh", p1, p2, NULL};
        if ((st = run(&b, argv, NULL, 0)) != 0) {
            step_failed(&b, st, err, "rootfs (mmdebstrap)");
            goto out;
        }
    }
    step_end(&b, "done");

    /* 4. ext4 image in qcow2. */
    step_begin(&b, "image");
    char outdir[PATH_MAX], size[32];
    fmt(outdir, sizeof outdir, err, "%s/out", work);
    mkdir(outdir, 0755);
    fmt(p1, sizeof p1, err, "%s/scripts/make-image.sh", work);
    fmt(p3, sizeof p3, err, "%s/rootfs.qcow2", outdir);
    snprintf(size, sizeof size, "%d", spec->disk_mb);
    {
        char *argv[] = {"sh", p1, p2, size, p3, NULL};
        if ((st = run(&b, argv, NULL, 0)) != 0) {
            step_failed(&b, st, err, "image");
            goto out;
        }
    }
    chmod(p3, 0444);
    sp_rm_rf(p2); /* the tree is in the image now; free the space early */
    step_end(&b, "done");

    /* 5. Manifest, move into place, swap current. */
    step_begin(&b, "install");
    if (stat(p3, &sb) < 0) {
        sp_err_set(err, SP_EINTERNAL, "image vanished");
        goto out;
    }
    fmt(p1, sizeof p1, err, "%s/manifest.json", outdir);
    if (write_manifest(p1, spec, hash, kver, initrd_rel, spec->agent ? agent_sha : NULL,
                       code != NULL ? code_sha : NULL, (long long)sb.st_size,
                       (long long)sb.st_blocks * 512, &b, now_s() - t_start) < 0) {
        sp_err_set(err, SP_EINTERNAL, "cannot write the manifest");
        goto out;
    }
    fmt(p1, sizeof p1, err, "%s/%s", tdir, hash);
    if (stat(p1, &sb) == 0) { /* forced rebuild: the old one goes to work/ to be removed */
        fmt(p2, sizeof p2, err, "%s/old", work);
        rename(p1, p2);
    }
    if (rename(outdir, p1) < 0) {
        sp_err_set(err, SP_EINTERNAL, "cannot move the build into place: %s", strerror(errno));
        goto out;
    }
    if (point_current(tdir, hash, err) < 0)
        goto out;
    step_end(&b, "done");
    if (read_manifest(data_dir, o->name, hash, paths, err) < 0)
        goto out;
    if (o->progress)
        fprintf(stderr, "template %s: built %.12s in %.1fs\n", o->name, hash, now_s() - t_start);
    sp_log(SP_LOG_INFO, "tmplbuild", "template=%s hash=%.12s kernel=%s seconds=%.1f", o->name, hash,
           kver, now_s() - t_start);
    rc = 0;
out:
    if (work[0] != '\0')
        sp_rm_rf(work);
    if (b.log_fd >= 0)
        close(b.log_fd);
    if (lock_fd >= 0)
        close(lock_fd); /* releases the flock */
    free_env(&b);
    sp_tmplbuild_spec_free(spec);
    free(text);
    return rc;
}
