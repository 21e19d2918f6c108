/*
 * secrets.c - sealed team secrets and per-sandbox credential rules in Postgres.
 *
 * Owns the master key (a copy, zeroed on destroy) and every plaintext it produces until the
 * caller wipes it. Sealing happens on the caller's stack before a statement is queued, so a
 * value never travels to the database in the clear, and the statement parameters that hold
 * the sealed text are copied by the store. Knows no HTTP; core/egress/mitm.h applies the rules.
 */
#include "core/egress/secrets.h"

#include <errno.h>
#include <fcntl.h>
#include <sodium.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/stat.h>
#include <unistd.h>

#include "base/log.h"

#define TS(x) "to_char((" x ") AT TIME ZONE 'UTC', 'YYYY-MM-DD\"T\"HH24:MI:SS.MS\"Z\"')"

#define SEAL_PREFIX "v1:"

struct sp_secrets {
    sp_loop_t *loop;
    sp_store_t *store;
    bool enabled;
    unsigned char key[SP_SECRETS_KEY_LEN];
};

/* ---- the master key ---- */

/* Decodes base64 (standard or URL-safe, padding optional, surrounding space ignored) into
 * exactly SP_SECRETS_KEY_LEN bytes. */
static int decode_key(const char *text, size_t len, unsigned char key[SP_SECRETS_KEY_LEN])
{
    while (len > 0 && (text[len - 1] == '\n' || text[len - 1] == '\r' || text[len - 1] == ' ' ||
                       text[len - 1] == '\t'))
        len--;
    while (len > 0 && (text[0] == ' ' || text[0] == '\t')) {
        text++;
        len--;
    }
    static const int variants[] = {
        sodium_base64_VARIANT_ORIGINAL, sodium_base64_VARIANT_ORIGINAL_NO_PADDING,
        sodium_base64_VARIANT_URLSAFE, sodium_base64_VARIANT_URLSAFE_NO_PADDING};
    for (size_t i = 0; i < sizeof(variants) / sizeof(variants[0]); i++) {
        size_t out = 0;
        const char *end = NULL;
        if (sodium_base642bin(key, SP_SECRETS_KEY_LEN, text, len, NULL, &out, &end, variants[i]) ==
                0 &&
            out == SP_SECRETS_KEY_LEN && end == text + len)
            return 0;
    }
    sodium_memzero(key, SP_SECRETS_KEY_LEN);
    return -1;
}

static int read_key_file(const char *path, unsigned char key[SP_SECRETS_KEY_LEN], sp_err_t *err)
{
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0)
        return sp_err_set(err, SP_EINVAL, "cannot open the master key file: %s", strerror(errno));
    struct stat st;
    if (fstat(fd, &st) == 0 && (st.st_mode & 077) != 0)
        sp_log(SP_LOG_WARN, "secrets", "master key file is readable by others path=%s mode=%o",
               path, (unsigned)(st.st_mode & 0777));
    char buf[256];
    size_t n = 0;
    for (;;) {
        ssize_t r = read(fd, buf + n, sizeof(buf) - n);
        if (r < 0 && errno == EINTR)
            continue;
        if (r <= 0)
            break;
        n += (size_t)r;
        if (n == sizeof(buf))
            break;
    }
    close(fd);
    int rc = -1;
    if (n < sizeof(buf) && decode_key(buf, n, key) == 0)
        rc = 0;
    else if (n == SP_SECRETS_KEY_LEN) { /* 32 raw bytes */
        memcpy(key, buf, SP_SECRETS_KEY_LEN);
        rc = 0;
    }
    sodium_memzero(buf, sizeof(buf));
    if (rc < 0)
        return sp_err_set(err, SP_EINVAL,
                          "the master key file must hold 32 bytes, as base64 or raw");
    return 0;
}

static int create_key_file(const char *path, unsigned char key[SP_SECRETS_KEY_LEN], sp_err_t *err)
{
    int fd = open(path, O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
    if (fd < 0)
        return sp_err_set(err, SP_EINVAL, "cannot create the master key file: %s", strerror(errno));
    randombytes_buf(key, SP_SECRETS_KEY_LEN);
    char b64[sodium_base64_ENCODED_LEN(SP_SECRETS_KEY_LEN, sodium_base64_VARIANT_ORIGINAL) + 1];
    sodium_bin2base64(b64, sizeof(b64), key, SP_SECRETS_KEY_LEN, sodium_base64_VARIANT_ORIGINAL);
    size_t len = strlen(b64);
    b64[len++] = '\n';
    bool ok = write(fd, b64, len) == (ssize_t)len && fsync(fd) == 0;
    sodium_memzero(b64, sizeof(b64));
    close(fd);
    if (!ok) {
        unlink(path);
        sodium_memzero(key, SP_SECRETS_KEY_LEN);
        return sp_err_set(err, SP_EINVAL, "cannot write the master key file");
    }
    return 0;
}

int sp_secrets_load_key(const char *key_file, const char *gen_dir,
                        unsigned char key[SP_SECRETS_KEY_LEN], sp_secrets_key_source_t *src,
                        sp_err_t *err)
{
    *src = SP_SECRETS_KEY_NONE;
    const char *env = getenv(SP_SECRETS_ENV);
    if (env != NULL && env[0] != '\0') {
        if (decode_key(env, strlen(env), key) < 0)
            return sp_err_set(err, SP_EINVAL, SP_SECRETS_ENV " must be the base64 of 32 bytes");
        *src = SP_SECRETS_KEY_ENV;
        return 0;
    }
    if (key_file != NULL && key_file[0] != '\0') {
        if (read_key_file(key_file, key, err) < 0)
            return -1;
        *src = SP_SECRETS_KEY_FILE;
        return 0;
    }
    if (gen_dir == NULL)
        return 0;
    char path[4096];
    if ((size_t)snprintf(path, sizeof(path), "%s/master.key", gen_dir) >= sizeof(path))
        return sp_err_set(err, SP_EINVAL, "data directory path is too long");
    if (access(path, F_OK) == 0) {
        if (read_key_file(path, key, err) < 0)
            return -1;
        *src = SP_SECRETS_KEY_FILE;
        return 0;
    }
    if (create_key_file(path, key, err) < 0) {
        /* Another process may have created it between the check and the create. */
        if (access(path, F_OK) == 0 && read_key_file(path, key, err) == 0) {
            *src = SP_SECRETS_KEY_FILE;
            return 0;
        }
        return -1;
    }
    *src = SP_SECRETS_KEY_CREATED;
    return 0;
}

sp_secrets_t *sp_secrets_create(sp_loop_t *loop, sp_store_t *store,
                                const unsigned char key[SP_SECRETS_KEY_LEN], sp_err_t *err)
{
    if (sodium_init() < 0) {
        sp_err_set(err, SP_EINTERNAL, "libsodium failed to initialise");
        return NULL;
    }
    sp_secrets_t *s = calloc(1, sizeof(*s));
    if (s == NULL) {
        sp_err_set(err, SP_EINTERNAL, "out of memory");
        return NULL;
    }
    s->loop = loop;
    s->store = store;
    if (key != NULL) {
        memcpy(s->key, key, SP_SECRETS_KEY_LEN);
        s->enabled = true;
    }
    return s;
}

void sp_secrets_destroy(sp_secrets_t *s)
{
    if (s == NULL)
        return;
    sodium_memzero(s->key, sizeof(s->key));
    free(s);
}

bool sp_secrets_enabled(const sp_secrets_t *s)
{
    return s != NULL && s->enabled;
}

sp_store_t *sp_secrets_store(const sp_secrets_t *s)
{
    return s->store;
}

int sp_secrets_check_enabled(const sp_secrets_t *s, sp_err_t *err)
{
    if (sp_secrets_enabled(s))
        return 0;
    return sp_err_set(err, SP_EUNAVAIL,
                      "secrets need a master key: set " SP_SECRETS_ENV
                      " or start spaced with --master-key-file");
}

/* ---- sealing ----
 * The box holds "<context>\n<value>": opening checks the context, so a sealed text moved to
 * another row (another team's secret, another sandbox's CA) does not open there. */

void sp_secrets_wipe(void *p, size_t len)
{
    if (p == NULL)
        return;
    sodium_memzero(p, len);
    free(p);
}

char *sp_secrets_seal(const sp_secrets_t *s, const char *context, const void *plain, size_t len,
                      sp_err_t *err)
{
    if (sp_secrets_check_enabled(s, err) < 0)
        return NULL;
    size_t clen = strlen(context);
    if (len > 1u << 20 || clen > 512) {
        sp_err_set(err, SP_EINTERNAL, "value too large to seal");
        return NULL;
    }
    size_t mlen = clen + 1 + len;
    size_t blen = crypto_secretbox_NONCEBYTES + crypto_secretbox_MACBYTES + mlen;
    size_t b64len = sodium_base64_ENCODED_LEN(blen, sodium_base64_VARIANT_ORIGINAL);
    unsigned char *m = malloc(mlen);
    unsigned char *box = malloc(blen);
    char *out = malloc(strlen(SEAL_PREFIX) + b64len);
    if (m == NULL || box == NULL || out == NULL) {
        free(m);
        free(box);
        free(out);
        sp_err_set(err, SP_EINTERNAL, "out of memory");
        return NULL;
    }
    memcpy(m, context, clen);
    m[clen] = '\n';
    memcpy(m + clen + 1, plain, len);
    randombytes_buf(box, crypto_secretbox_NONCEBYTES);
    crypto_secretbox_easy(box + crypto_secretbox_NONCEBYTES, m, mlen, box, s->key);
    sp_secrets_wipe(m, mlen);
    memcpy(out, SEAL_PREFIX, strlen(SEAL_PREFIX));
    sodium_bin2base64(out + strlen(SEAL_PREFIX), b64len, box, blen, sodium_base64_VARIANT_ORIGINAL);
    free(box);
    return out;
}

int sp_secrets_open(const sp_secrets_t *s, const char *context, const char *sealed, uint8_t **plain,
                    size_t *len, sp_err_t *err)
{
    *plain = NULL;
    *len = 0;
    if (sp_secrets_check_enabled(s, err) < 0)
        return -1;
    size_t plen = strlen(SEAL_PREFIX);
    if (sealed == NULL || strncmp(sealed, SEAL_PREFIX, plen) != 0)
        return sp_err_set(err, SP_EINTERNAL, "stored secret has an unknown format");
    const char *b64 = sealed + plen;
    size_t b64len = strlen(b64);
    size_t cap = b64len / 4 * 3 + 3;
    unsigned char *box = malloc(cap);
    if (box == NULL)
        return sp_err_set(err, SP_EINTERNAL, "out of memory");
    size_t blen = 0;
    if (sodium_base642bin(box, cap, b64, b64len, NULL, &blen, NULL,
                          sodium_base64_VARIANT_ORIGINAL) != 0 ||
        blen < crypto_secretbox_NONCEBYTES + crypto_secretbox_MACBYTES) {
        free(box);
        return sp_err_set(err, SP_EINTERNAL, "stored secret is malformed");
    }
    size_t mlen = blen - crypto_secretbox_NONCEBYTES - crypto_secretbox_MACBYTES;
    unsigned char *m = malloc(mlen + 1);
    if (m == NULL) {
        free(box);
        return sp_err_set(err, SP_EINTERNAL, "out of memory");
    }
    int rc = crypto_secretbox_open_easy(m, box + crypto_secretbox_NONCEBYTES,
                                        blen - crypto_secretbox_NONCEBYTES, box, s->key);
    free(box);
    size_t clen = strlen(context);
    if (rc != 0 || mlen < clen + 1 || memcmp(m, context, clen) != 0 || m[clen] != '\n') {
        sp_secrets_wipe(m, mlen + 1);
        return sp_err_set(err, SP_EINTERNAL, "stored secret does not open with this master key");
    }
    /* Shift the value to the front so the caller frees what it got. */
    size_t vlen = mlen - clen - 1;
    memmove(m, m + clen + 1, vlen);
    sodium_memzero(m + vlen, mlen + 1 - vlen);
    m[vlen] = '\0';
    *plain = m;
    *len = vlen;
    return 0;
}

/* ---- store calls (the checks of what a request gives: secretcheck.c) ---- */

/* Queues sql; done gets an sp_store_req_t (flag: the statement replaces a secret). */
static int submit(sp_secrets_t *s, const char *sql, int n, const char *const *p,
                  sp_store_rec_cb done, void *cb, void *arg, bool replace, sp_err_t *err)
{
    return sp_store_submit(s->store, sql, n, p, done, s, cb, arg, replace, err);
}

static void rec_done(void *rec, PGresult *res, const sp_err_t *err)
{
    sp_store_req_t *c = rec;
    sp_secrets_rec_cb cb = (sp_secrets_rec_cb)c->cb;
    sp_err_t e;
    const sp_err_t *fail =
        c->flag ? sp_store_one_row(res, err, SP_ENOTFOUND, "secret not found", &e)
                   : sp_store_one_row(res, err, SP_ECONFLICT,
                                      "a secret with this name exists (PUT replaces it)", &e);
    if (fail != NULL) {
        cb(c->arg, NULL, fail);
        return;
    }
    sp_secret_rec_t r;
    SP_STORE_TEXT(res, 0, 0, r.name);
    SP_STORE_TEXT(res, 0, 1, r.created_at);
    SP_STORE_TEXT(res, 0, 2, r.updated_at);
    cb(c->arg, &r, NULL);
}

static void secret_context(char *out, size_t cap, const char *team_id, const char *name)
{
    snprintf(out, cap, "secret:%s:%s", team_id, name);
}

int sp_secrets_put(sp_secrets_t *s, const char *team_id, const char *name, const char *value,
                   size_t len, bool replace, sp_secrets_rec_cb cb, void *arg, sp_err_t *err)
{
    if (sp_secrets_check_enabled(s, err) < 0 || sp_secrets_check_name(name, err) < 0 ||
        sp_secrets_check_value(value, len, err) < 0)
        return -1;
    char ctx[128];
    secret_context(ctx, sizeof(ctx), team_id, name);
    char *box = sp_secrets_seal(s, ctx, value, len, err);
    if (box == NULL)
        return -1;
    const char *p[] = {team_id, name, box};
    int rc;
    if (!replace)
        rc = submit(s,
                    "WITH i AS (INSERT INTO secrets (team_id, name, box) VALUES ($1, $2, $3)"
                    "  ON CONFLICT DO NOTHING RETURNING name, created_at, updated_at),"
                    " n AS (SELECT pg_notify('" SP_SECRETS_NOTIFY "', 'team:' || $1) FROM i)"
                    " SELECT i.name, " TS("i.created_at") ", " TS("i.updated_at") " FROM i, n",
                    3, p, rec_done, (void *)cb, arg, false, err);
    else
        rc = submit(s,
                    "WITH u AS (UPDATE secrets SET box = $3, updated_at = now()"
                    "  WHERE team_id = $1 AND name = $2 RETURNING name, created_at, updated_at),"
                    " n AS (SELECT pg_notify('" SP_SECRETS_NOTIFY "', 'team:' || $1) FROM u)"
                    " SELECT u.name, " TS("u.created_at") ", " TS("u.updated_at") " FROM u, n",
                    3, p, rec_done, (void *)cb, arg, true, err);
    free(box); /* sealed: nothing to zero */
    return rc;
}

static void list_done(void *rec, PGresult *res, const sp_err_t *err)
{
    sp_store_req_t *c = rec;
    sp_secrets_list_cb cb = (sp_secrets_list_cb)c->cb;
    sp_err_t e;
    const sp_err_t *fail;
    sp_secret_rec_t *recs = sp_store_rows(res, err, 0, NULL, sizeof(*recs), &fail, &e);
    if (recs == NULL) {
        cb(c->arg, NULL, 0, fail);
        return;
    }
    int n = PQntuples(res);
    for (int i = 0; i < n; i++) {
        SP_STORE_TEXT(res, i, 0, recs[i].name);
        SP_STORE_TEXT(res, i, 1, recs[i].created_at);
        SP_STORE_TEXT(res, i, 2, recs[i].updated_at);
    }
    cb(c->arg, recs, (size_t)n, NULL);
    free(recs);
}

int sp_secrets_list(sp_secrets_t *s, const char *team_id, sp_secrets_list_cb cb, void *arg,
                    sp_err_t *err)
{
    if (sp_secrets_check_enabled(s, err) < 0)
        return -1;
    const char *p[] = {team_id};
    return submit(s,
                  "SELECT name, " TS("created_at") ", " TS(
                      "updated_at") " FROM secrets WHERE team_id = $1 ORDER BY name LIMIT 1000",
                  1, p, list_done, (void *)cb, arg, false, err);
}

static void delete_done(void *rec, PGresult *res, const sp_err_t *err)
{
    sp_store_req_t *c = rec;
    sp_secrets_done_cb cb = (sp_secrets_done_cb)c->cb;
    if (err != NULL) {
        cb(c->arg, err);
        return;
    }
    if (PQntuples(res) != 1 || atoi(PQgetvalue(res, 0, 0)) == 0) {
        sp_err_t e;
        sp_err_set(&e, SP_ENOTFOUND, "secret not found");
        cb(c->arg, &e);
        return;
    }
    cb(c->arg, NULL);
}

int sp_secrets_delete(sp_secrets_t *s, const char *team_id, const char *name, sp_secrets_done_cb cb,
                      void *arg, sp_err_t *err)
{
    if (sp_secrets_check_enabled(s, err) < 0)
        return -1;
    if (sp_secrets_check_name(name, err) < 0)
        return sp_err_set(err, SP_ENOTFOUND, "secret not found");
    const char *p[] = {team_id, name};
    return submit(s,
                  "WITH d AS (DELETE FROM secrets WHERE team_id = $1 AND name = $2 RETURNING 1),"
                  " n AS (SELECT pg_notify('" SP_SECRETS_NOTIFY "', 'team:' || $1) FROM d)"
                  " SELECT count(*) FROM d, n",
                  2, p, delete_done, (void *)cb, arg, false, err);
}

struct reveal {
    sp_secrets_t *s;
    sp_secrets_value_cb cb;
    void *arg;
    char ctx[128];
    char name[SP_SECRETS_NAME_MAX + 1];
};

static void reveal_done(void *rec, PGresult *res, const sp_err_t *err)
{
    struct reveal *r = rec;
    sp_err_t e;
    uint8_t *v = NULL;
    size_t len = 0;
    if (err == NULL && PQntuples(res) != 1)
        err = (sp_err_set(&e, SP_ENOTFOUND, "secret '%s' does not exist", r->name), &e);
    if (err == NULL && sp_secrets_open(r->s, r->ctx, PQgetvalue(res, 0, 0), &v, &len, &e) < 0)
        err = &e;
    r->cb(r->arg, err == NULL ? (const char *)v : NULL, len, err);
    sp_secrets_wipe(v, len);
}

int sp_secrets_reveal(sp_secrets_t *s, const char *team_id, const char *name,
                      sp_secrets_value_cb cb, void *arg, sp_err_t *err)
{
    if (sp_secrets_check_enabled(s, err) < 0)
        return -1;
    if (sp_secrets_check_name(name, err) < 0)
        return sp_err_set(err, SP_ENOTFOUND, "secret '%.64s' does not exist", name);
    const char *p[] = {team_id, name};
    struct reveal *r =
        sp_store_call(s->store, "SELECT box FROM secrets WHERE team_id = $1 AND name = $2", 2, p,
                      sizeof(*r), reveal_done, err);
    if (r == NULL)
        return -1;
    r->s = s;
    r->cb = cb;
    r->arg = arg;
    secret_context(r->ctx, sizeof(r->ctx), team_id, name);
    snprintf(r->name, sizeof(r->name), "%s", name);
    return 0;
}

static void missing_done(void *rec, PGresult *res, const sp_err_t *err)
{
    sp_store_req_t *c = rec;
    sp_secrets_done_cb cb = (sp_secrets_done_cb)c->cb;
    if (err != NULL) {
        cb(c->arg, err);
        return;
    }
    if (PQntuples(res) > 0) {
        sp_err_t e;
        sp_err_set(&e, SP_EINVAL, "credentials name secret '%.64s', which does not exist",
                   PQgetvalue(res, 0, 0));
        cb(c->arg, &e);
        return;
    }
    cb(c->arg, NULL);
}

int sp_secrets_check_rule_secrets(sp_secrets_t *s, const char *team_id, const json_t *rules,
                                  sp_secrets_done_cb cb, void *arg, sp_err_t *err)
{
    if (sp_secrets_check_enabled(s, err) < 0)
        return -1;
    char *js = json_dumps(rules, JSON_COMPACT);
    if (js == NULL)
        return sp_err_set(err, SP_EINTERNAL, "out of memory");
    const char *p[] = {team_id, js};
    int rc = submit(s,
                    "SELECT r->>'secret' FROM jsonb_array_elements($2::jsonb) r"
                    " WHERE NOT EXISTS (SELECT 1 FROM secrets x"
                    "  WHERE x.team_id = $1 AND x.name = r->>'secret') LIMIT 1",
                    2, p, missing_done, (void *)cb, arg, false, err);
    free(js);
    return rc;
}

static void rules_done(void *rec, PGresult *res, const sp_err_t *err)
{
    sp_store_req_t *c = rec;
    sp_secrets_rules_cb cb = (sp_secrets_rules_cb)c->cb;
    sp_err_t e;
    if (err != NULL) {
        cb(c->arg, NULL, err);
        return;
    }
    /* Columns: exists, missing secret (set only), rules text. */
    if (PQntuples(res) != 1 || PQgetvalue(res, 0, 0)[0] != 't') {
        sp_err_set(&e, SP_ENOTFOUND, "sandbox not found");
        cb(c->arg, NULL, &e);
        return;
    }
    if (!PQgetisnull(res, 0, 1)) {
        sp_err_set(&e, SP_EINVAL, "credentials name secret '%.64s', which does not exist",
                   PQgetvalue(res, 0, 1));
        cb(c->arg, NULL, &e);
        return;
    }
    json_t *rules = json_loads(PQgetvalue(res, 0, 2), 0, NULL);
    if (rules == NULL) {
        sp_err_set(&e, SP_EINTERNAL, "stored credentials are malformed");
        cb(c->arg, NULL, &e);
        return;
    }
    cb(c->arg, rules, NULL);
    json_decref(rules);
}

int sp_secrets_get_rules(sp_secrets_t *s, const char *team_id, const char *sandbox_id,
                         sp_secrets_rules_cb cb, void *arg, sp_err_t *err)
{
    if (!sp_ids_valid(sandbox_id))
        return sp_err_set(err, SP_ENOTFOUND, "sandbox not found");
    const char *p[] = {sandbox_id, team_id};
    return submit(s,
                  "SELECT true, NULL::text, credentials::text FROM sandboxes"
                  " WHERE id = $1 AND team_id = $2 AND observed_state <> 'deleted'",
                  2, p, rules_done, (void *)cb, arg, false, err);
}

int sp_secrets_set_rules(sp_secrets_t *s, const char *team_id, const char *sandbox_id,
                         const json_t *rules, sp_secrets_rules_cb cb, void *arg, sp_err_t *err)
{
    if (sp_secrets_check_enabled(s, err) < 0)
        return -1;
    if (!sp_ids_valid(sandbox_id))
        return sp_err_set(err, SP_ENOTFOUND, "sandbox not found");
    json_t *norm = sp_secrets_rules_normalize(rules, err);
    if (norm == NULL)
        return -1;
    char *js = json_dumps(norm, JSON_COMPACT);
    json_decref(norm);
    if (js == NULL)
        return sp_err_set(err, SP_EINTERNAL, "out of memory");
    const char *p[] = {sandbox_id, team_id, js};
    /* One statement: the sandbox must be the team's, every named secret must exist, and the
     * change is announced to the worker running the VM. */
    int rc =
        submit(s,
               "WITH sb AS (SELECT id FROM sandboxes"
               "  WHERE id = $1 AND team_id = $2 AND observed_state <> 'deleted'),"
               " missing AS (SELECT r->>'secret' AS name FROM jsonb_array_elements($3::jsonb) r"
               "  WHERE NOT EXISTS (SELECT 1 FROM secrets x WHERE x.team_id = $2"
               "   AND x.name = r->>'secret') LIMIT 1),"
               " u AS (UPDATE sandboxes SET credentials = $3::jsonb"
               "  WHERE id IN (SELECT id FROM sb) AND NOT EXISTS (SELECT 1 FROM missing)"
               "  RETURNING id, credentials),"
               " n AS (SELECT pg_notify('" SP_SECRETS_NOTIFY "', id) FROM u)"
               " SELECT EXISTS (SELECT 1 FROM sb), (SELECT name FROM missing),"
               "  coalesce((SELECT credentials::text FROM u), '[]'), (SELECT count(*) FROM n)",
               3, p, rules_done, (void *)cb, arg, false, err);
    free(js);
    return rc;
}
