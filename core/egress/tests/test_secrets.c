/*
 * test_secrets.c - master key loading, sealing, validation, and the store calls of
 * core/egress/secrets.h against a real PostgreSQL (SP_TEST_PG_DSN or a private cluster).
 */
#include <fcntl.h>
#include <sodium.h>
#include <sys/stat.h>
#include <unistd.h>

#include "core/egress/secrets.h"
#include "core/egress/tests/secrets_fixture.h"
#include "core/store/store.h"

#define VALUE "sk-live-TOPSECRET-0123456789"

static char tmpdir_path[256];

static void write_file(const char *path, const void *p, size_t n)
{
    int fd = open(path, O_WRONLY | O_CREAT | O_TRUNC, 0600);
    CHECK(fd >= 0 && write(fd, p, n) == (ssize_t)n);
    close(fd);
}

static void test_secrets_master_key_sources(void)
{
    unsigned char k1[SP_SECRETS_KEY_LEN], k2[SP_SECRETS_KEY_LEN];
    sp_secrets_key_source_t src;
    sp_err_t e;
    unsetenv(SP_SECRETS_ENV);

    /* Nothing configured and no data dir: no key, no error. */
    CHECK(sp_secrets_load_key(NULL, NULL, k1, &src, &e) == 0 && src == SP_SECRETS_KEY_NONE);

    /* The embedded default: created 0600 on first start, the same key afterwards. */
    CHECK(sp_secrets_load_key(NULL, tmpdir_path, k1, &src, &e) == 0 &&
          src == SP_SECRETS_KEY_CREATED);
    char path[512];
    snprintf(path, sizeof(path), "%s/master.key", tmpdir_path);
    struct stat st;
    CHECK(stat(path, &st) == 0 && (st.st_mode & 0777) == 0600);
    CHECK(sp_secrets_load_key(NULL, tmpdir_path, k2, &src, &e) == 0 && src == SP_SECRETS_KEY_FILE &&
          memcmp(k1, k2, sizeof(k1)) == 0);

    /* The environment wins over everything; base64 of 32 bytes only. */
    unsigned char want[SP_SECRETS_KEY_LEN];
    randombytes_buf(want, sizeof(want));
    char b64[64];
    sodium_bin2base64(b64, sizeof(b64), want, sizeof(want), sodium_base64_VARIANT_ORIGINAL);
    setenv(SP_SECRETS_ENV, b64, 1);
    CHECK(sp_secrets_load_key(path, tmpdir_path, k2, &src, &e) == 0 && src == SP_SECRETS_KEY_ENV &&
          memcmp(k2, want, sizeof(want)) == 0);
    setenv(SP_SECRETS_ENV, "c2hvcnQ=", 1); /* 5 bytes */
    CHECK(sp_secrets_load_key(NULL, NULL, k2, &src, &e) < 0 && e.code == SP_EINVAL);
    CHECK(strstr(e.msg, "c2hvcnQ") == NULL);
    unsetenv(SP_SECRETS_ENV);

    /* A key file: base64 with a newline, or 32 raw bytes; anything else is refused. */
    char kf[512];
    snprintf(kf, sizeof(kf), "%s/other.key", tmpdir_path);
    char line[80];
    snprintf(line, sizeof(line), "%s\n", b64);
    write_file(kf, line, strlen(line));
    CHECK(sp_secrets_load_key(kf, tmpdir_path, k2, &src, &e) == 0 && src == SP_SECRETS_KEY_FILE &&
          memcmp(k2, want, sizeof(want)) == 0);
    write_file(kf, want, sizeof(want));
    CHECK(sp_secrets_load_key(kf, NULL, k2, &src, &e) == 0 && memcmp(k2, want, 32) == 0);
    write_file(kf, "not a key\n", 10);
    CHECK(sp_secrets_load_key(kf, NULL, k2, &src, &e) < 0 && e.code == SP_EINVAL);
    snprintf(kf, sizeof(kf), "%s/missing.key", tmpdir_path);
    CHECK(sp_secrets_load_key(kf, tmpdir_path, k2, &src, &e) < 0); /* named: must exist */
}

static void test_secrets_seal_open(void)
{
    unsigned char key[SP_SECRETS_KEY_LEN], other[SP_SECRETS_KEY_LEN];
    randombytes_buf(key, sizeof(key));
    randombytes_buf(other, sizeof(other));
    sp_err_t e;
    sp_secrets_t *s = sp_secrets_create(loop, NULL, key, &e);
    sp_secrets_t *s2 = sp_secrets_create(loop, NULL, other, &e);
    sp_secrets_t *off = sp_secrets_create(loop, NULL, NULL, &e);
    CHECK(s && s2 && off && sp_secrets_enabled(s) && !sp_secrets_enabled(off));

    char *a = sp_secrets_seal(s, "secret:t1:A", VALUE, strlen(VALUE), &e);
    char *b = sp_secrets_seal(s, "secret:t1:A", VALUE, strlen(VALUE), &e);
    CHECK(a && b && strncmp(a, "v1:", 3) == 0);
    CHECK(strcmp(a, b) != 0);              /* a fresh nonce each time */
    CHECK(strstr(a, "TOPSECRET") == NULL); /* not in the clear */
    uint8_t *p = NULL;
    size_t n = 0;
    CHECK(sp_secrets_open(s, "secret:t1:A", a, &p, &n, &e) == 0 && n == strlen(VALUE) &&
          memcmp(p, VALUE, n) == 0 && p[n] == '\0');
    sp_secrets_wipe(p, n + 1);
    /* Another context (a row moved to another team or name), key, or a flipped byte. */
    CHECK(sp_secrets_open(s, "secret:t2:A", a, &p, &n, &e) < 0 && p == NULL);
    CHECK(sp_secrets_open(s, "secret:t1:B", a, &p, &n, &e) < 0);
    CHECK(sp_secrets_open(s2, "secret:t1:A", a, &p, &n, &e) < 0);
    CHECK(strstr(e.msg, "TOPSECRET") == NULL);
    a[10] = a[10] == 'A' ? 'B' : 'A';
    CHECK(sp_secrets_open(s, "secret:t1:A", a, &p, &n, &e) < 0);
    CHECK(sp_secrets_open(s, "secret:t1:A", "garbage", &p, &n, &e) < 0);
    CHECK(sp_secrets_open(s, "secret:t1:A", "v1:%%%", &p, &n, &e) < 0);
    CHECK(sp_secrets_open(s, "secret:t1:A", "v1:", &p, &n, &e) < 0);
    /* Disabled: clear errors, no crash. */
    CHECK(sp_secrets_seal(off, "x", "y", 1, &e) == NULL && e.code == SP_EUNAVAIL);
    CHECK(strstr(e.msg, SP_SECRETS_ENV) != NULL);
    free(a);
    free(b);
    sp_secrets_destroy(s);
    sp_secrets_destroy(s2);
    sp_secrets_destroy(off);
    sp_secrets_destroy(NULL);
}

static void test_secrets_validation(void)
{
    sp_err_t e;
    CHECK(sp_secrets_check_name("OPENAI_KEY", &e) == 0);
    CHECK(sp_secrets_check_name("a.b-c_1", &e) == 0);
    CHECK(sp_secrets_check_name("", &e) < 0);
    CHECK(sp_secrets_check_name("1abc", &e) < 0);
    CHECK(sp_secrets_check_name("a b", &e) < 0);
    CHECK(sp_secrets_check_name("a/b", &e) < 0);
    char longname[80];
    memset(longname, 'a', sizeof(longname) - 1);
    longname[79] = '\0';
    CHECK(sp_secrets_check_name(longname, &e) < 0);
    CHECK(sp_secrets_check_value(VALUE, strlen(VALUE), &e) == 0);
    CHECK(sp_secrets_check_value("", 0, &e) < 0);
    CHECK(sp_secrets_check_value("abc\r\nX-Evil: 1", 15, &e) < 0);
    CHECK(strstr(e.msg, "Evil") == NULL && strstr(e.msg, "abc") == NULL);
    CHECK(sp_secrets_check_value("a\0b", 3, &e) < 0);

    json_error_t je;
    json_t *in =
        json_loads("[{\"host\":\"API.Example.com\",\"header\":\"Authorization\","
                   "\"secret\":\"K\",\"format\":\"Bearer {secret}\"},"
                   "{\"host\":\"*.example.org\",\"header\":\"X-Api-Key\",\"secret\":\"K\"}]",
                   0, &je);
    json_t *out = sp_secrets_rules_normalize(in, &e);
    CHECK(out != NULL && json_array_size(out) == 2);
    CHECK(strcmp(json_string_value(json_object_get(json_array_get(out, 0), "host")),
                 "api.example.com") == 0);
    CHECK(strcmp(json_string_value(json_object_get(json_array_get(out, 1), "format")),
                 "{secret}") == 0);
    CHECK(json_object_get(json_array_get(out, 0), "env") == NULL); /* only when given */
    json_decref(in);
    json_decref(out);

    /* env: kept as given; the same variable may serve two rules of one secret. */
    in = json_loads("[{\"host\":\"a.com\",\"header\":\"A\",\"secret\":\"K\","
                    "\"env\":\"OPENAI_API_KEY\"},"
                    "{\"host\":\"b.com\",\"header\":\"A\",\"secret\":\"K\","
                    "\"env\":\"OPENAI_API_KEY\"},"
                    "{\"host\":\"c.com\",\"header\":\"A\",\"secret\":\"L\",\"env\":\"_l9\"}]",
                    0, &je);
    out = sp_secrets_rules_normalize(in, &e);
    CHECK(out != NULL && json_array_size(out) == 3);
    CHECK(out != NULL && strcmp(json_string_value(json_object_get(json_array_get(out, 1), "env")),
                                "OPENAI_API_KEY") == 0);
    CHECK(out != NULL &&
          strcmp(json_string_value(json_object_get(json_array_get(out, 2), "env")), "_l9") == 0);
    json_decref(in);
    json_decref(out);
    char envmax[SP_SECRETS_ENV_MAX + 1], rule[400];
    memset(envmax, 'E', SP_SECRETS_ENV_MAX);
    envmax[SP_SECRETS_ENV_MAX] = '\0';
    snprintf(rule, sizeof(rule),
             "[{\"host\":\"a.com\",\"header\":\"A\",\"secret\":\"K\",\"env\":\"%s\"}]", envmax);
    in = json_loads(rule, 0, &je);
    out = sp_secrets_rules_normalize(in, &e);
    CHECK(out != NULL); /* SP_SECRETS_ENV_MAX characters fit */
    json_decref(in);
    json_decref(out);
    snprintf(rule, sizeof(rule),
             "[{\"host\":\"a.com\",\"header\":\"A\",\"secret\":\"K\",\"env\":\"%sE\"}]", envmax);
    in = json_loads(rule, 0, &je);
    out = sp_secrets_rules_normalize(in, &e);
    CHECK(out == NULL && e.code == SP_EINVAL && strstr(e.msg, "env") != NULL);
    json_decref(in);
    static const char *const bad[] = {
        "{}", "[1]", "[{\"host\":\"a.com\",\"header\":\"Authorization\"}]",
        "[{\"host\":\"a.com\",\"header\":\"Host\",\"secret\":\"K\"}]",
        "[{\"host\":\"a.com\",\"header\":\"Content-Length\",\"secret\":\"K\"}]",
        "[{\"host\":\"a.com\",\"header\":\"Proxy-Authorization\",\"secret\":\"K\"}]",
        "[{\"host\":\"a.com\",\"header\":\"Bad Header\",\"secret\":\"K\"}]",
        "[{\"host\":\"https://a.com/x\",\"header\":\"A\",\"secret\":\"K\"}]",
        "[{\"host\":\"a.com:443\",\"header\":\"A\",\"secret\":\"K\"}]",
        "[{\"host\":\"\",\"header\":\"A\",\"secret\":\"K\"}]",
        "[{\"host\":\"a.com\",\"header\":\"A\",\"secret\":\"K\",\"format\":\"no placeholder\"}]",
        "[{\"host\":\"a.com\",\"header\":\"A\",\"secret\":\"K\",\"format\":\"{secret}{secret}\"}]",
        "[{\"host\":\"a.com\",\"header\":\"A\",\"secret\":\"K\",\"format\":\"x\\r\\n{secret}\"}]",
        "[{\"host\":\"a.com\",\"header\":\"A\",\"secret\":\"K\",\"extra\":1}]",
        "[{\"host\":\"a.com\",\"header\":\"A\",\"secret\":\"K\"},"
        " {\"host\":\"A.com\",\"header\":\"a\",\"secret\":\"L\"}]",
        /* env: a POSIX name, not one the sandbox sets, one secret per variable */
        "[{\"host\":\"a.com\",\"header\":\"A\",\"secret\":\"K\",\"env\":\"\"}]",
        "[{\"host\":\"a.com\",\"header\":\"A\",\"secret\":\"K\",\"env\":\"1KEY\"}]",
        "[{\"host\":\"a.com\",\"header\":\"A\",\"secret\":\"K\",\"env\":\"MY-KEY\"}]",
        "[{\"host\":\"a.com\",\"header\":\"A\",\"secret\":\"K\",\"env\":\"K=V\"}]",
        "[{\"host\":\"a.com\",\"header\":\"A\",\"secret\":\"K\",\"env\":\"A B\"}]",
        "[{\"host\":\"a.com\",\"header\":\"A\",\"secret\":\"K\",\"env\":7}]",
        "[{\"host\":\"a.com\",\"header\":\"A\",\"secret\":\"K\",\"env\":null}]",
        "[{\"host\":\"a.com\",\"header\":\"A\",\"secret\":\"K\",\"env\":\"PATH\"}]",
        "[{\"host\":\"a.com\",\"header\":\"A\",\"secret\":\"K\",\"env\":\"HTTPS_PROXY\"}]",
        "[{\"host\":\"a.com\",\"header\":\"A\",\"secret\":\"K\",\"env\":\"SSL_CERT_FILE\"}]",
        "[{\"host\":\"a.com\",\"header\":\"A\",\"secret\":\"K\",\"env\":\"KEY\"},"
        " {\"host\":\"b.com\",\"header\":\"A\",\"secret\":\"L\",\"env\":\"KEY\"}]",
        NULL};
    for (int i = 0; bad[i] != NULL; i++) {
        in = json_loads(bad[i], 0, &je);
        CHECK(in != NULL);
        out = sp_secrets_rules_normalize(in, &e);
        if (out != NULL)
            fprintf(stderr, "accepted: %s\n", bad[i]);
        CHECK(out == NULL && e.code == SP_EINVAL && e.msg[0] != '\0');
        json_decref(out);
        json_decref(in);
    }
}

/* ---- store calls ---- */

struct res {
    int done;
    sp_code_t code;
    char msg[160];
    sp_secret_rec_t rec;
    size_t n;
    char names[512];
    char rules[1024];
};

static void on_rec(void *arg, const sp_secret_rec_t *rec, const sp_err_t *err)
{
    struct res *r = arg;
    r->done++;
    r->code = err ? err->code : SP_OK;
    snprintf(r->msg, sizeof(r->msg), "%s", err ? err->msg : "");
    if (rec != NULL)
        r->rec = *rec;
}

static void on_list(void *arg, const sp_secret_rec_t *recs, size_t n, const sp_err_t *err)
{
    struct res *r = arg;
    r->done++;
    r->code = err ? err->code : SP_OK;
    r->n = n;
    r->names[0] = '\0';
    for (size_t i = 0; i < n; i++) {
        strncat(r->names, recs[i].name, sizeof(r->names) - strlen(r->names) - 2);
        strcat(r->names, ",");
    }
}

static void on_done(void *arg, const sp_err_t *err)
{
    struct res *r = arg;
    r->done++;
    r->code = err ? err->code : SP_OK;
    snprintf(r->msg, sizeof(r->msg), "%s", err ? err->msg : "");
}

static void on_rules(void *arg, json_t *rules, const sp_err_t *err)
{
    struct res *r = arg;
    r->done++;
    r->code = err ? err->code : SP_OK;
    snprintf(r->msg, sizeof(r->msg), "%s", err ? err->msg : "");
    r->rules[0] = '\0';
    if (rules != NULL) {
        char *s = json_dumps(rules, JSON_COMPACT);
        snprintf(r->rules, sizeof(r->rules), "%s", s);
        free(s);
    }
}

#define WAIT(r) run_until(&(r).done, 1, 5000)

/* sp_secrets_reveal's answer: the value copied into r->rules (it is wiped after the call). */
static void on_value(void *arg, const char *value, size_t len, const sp_err_t *err)
{
    struct res *r = arg;
    r->done++;
    r->code = err ? err->code : SP_OK;
    snprintf(r->msg, sizeof(r->msg), "%s", err ? err->msg : "");
    r->n = len;
    snprintf(r->rules, sizeof(r->rules), "%s", value != NULL ? value : "(null)");
}

static void test_secrets_store_and_tenancy(sp_store_t *st)
{
    unsigned char key[SP_SECRETS_KEY_LEN];
    randombytes_buf(key, sizeof(key));
    sp_err_t e;
    sp_secrets_t *s = sp_secrets_create(loop, st, key, &e);
    pgfx_note_t note = {0};
    CHECK(sp_store_listen(st, SP_SECRETS_NOTIFY, pgfx_on_note, &note, &e) == 0);
    run_until(&note.reconnects, 1, 5000);
    run_for(100);
    fx_sandbox("teama", "sbaaa1");
    fx_sandbox("teamb", "sbbbb1");

    /* Create: 201-style record, the value only sealed in the table. */
    struct res r = {0};
    CHECK(sp_secrets_put(s, "teama", "OPENAI", VALUE, strlen(VALUE), false, on_rec, &r, &e) == 0);
    CHECK(r.done == 0);
    WAIT(r);
    CHECK(r.code == SP_OK && strcmp(r.rec.name, "OPENAI") == 0 && r.rec.created_at[0] != '\0');
    const char *p[] = {"teama"};
    const char *box = fx_sql("SELECT box FROM secrets WHERE team_id = $1", 1, p);
    CHECK(box != NULL && strncmp(box, "v1:", 3) == 0 && strstr(box, "TOPSECRET") == NULL);
    const char *dump = fx_sql("SELECT string_agg(t::text, '|') FROM secrets t", 0, NULL);
    CHECK(dump != NULL && strstr(dump, "TOPSECRET") == NULL);
    run_until(&note.got, 1, 3000);
    CHECK(note.got >= 1 && strcmp(note.payload, "team:teama") == 0);

    /* The same name again conflicts; PUT-style replace works; unknown replace is 404. */
    memset(&r, 0, sizeof(r));
    CHECK(sp_secrets_put(s, "teama", "OPENAI", "x", 1, false, on_rec, &r, &e) == 0);
    WAIT(r);
    CHECK(r.code == SP_ECONFLICT);
    memset(&r, 0, sizeof(r));
    CHECK(sp_secrets_put(s, "teama", "OPENAI", VALUE "2", strlen(VALUE) + 1, true, on_rec, &r,
                         &e) == 0);
    WAIT(r);
    CHECK(r.code == SP_OK);
    memset(&r, 0, sizeof(r));
    CHECK(sp_secrets_put(s, "teama", "NOPE", "x", 1, true, on_rec, &r, &e) == 0);
    WAIT(r);
    CHECK(r.code == SP_ENOTFOUND);
    /* Bad input is refused at once, without echoing the value. */
    CHECK(sp_secrets_put(s, "teama", "bad name", "x", 1, false, on_rec, &r, &e) < 0 &&
          e.code == SP_EINVAL);
    CHECK(sp_secrets_put(s, "teama", "OK", "line1\nTOPSECRET", 16, false, on_rec, &r, &e) < 0 &&
          e.code == SP_EINVAL && strstr(e.msg, "TOPSECRET") == NULL);

    /* Team B sees nothing of team A's, and can use the same name for its own. */
    memset(&r, 0, sizeof(r));
    CHECK(sp_secrets_list(s, "teamb", on_list, &r, &e) == 0);
    WAIT(r);
    CHECK(r.code == SP_OK && r.n == 0);
    memset(&r, 0, sizeof(r));
    CHECK(sp_secrets_delete(s, "teamb", "OPENAI", on_done, &r, &e) == 0);
    WAIT(r);
    CHECK(r.code == SP_ENOTFOUND);
    memset(&r, 0, sizeof(r));
    CHECK(sp_secrets_put(s, "teamb", "OPENAI", "b-value", 7, false, on_rec, &r, &e) == 0);
    WAIT(r);
    CHECK(r.code == SP_OK);
    memset(&r, 0, sizeof(r));
    CHECK(sp_secrets_put(s, "teama", "OTHER", "v", 1, false, on_rec, &r, &e) == 0);
    WAIT(r);
    memset(&r, 0, sizeof(r));
    CHECK(sp_secrets_list(s, "teama", on_list, &r, &e) == 0);
    WAIT(r);
    CHECK(r.code == SP_OK && r.n == 2 && strcmp(r.names, "OPENAI,OTHER,") == 0);

    /* Revealed for a host-side use: each team its own value, nothing of another team's. */
    memset(&r, 0, sizeof(r));
    CHECK(sp_secrets_reveal(s, "teama", "OTHER", on_value, &r, &e) == 0);
    WAIT(r);
    CHECK(r.code == SP_OK && r.n == 1 && strcmp(r.rules, "v") == 0);
    memset(&r, 0, sizeof(r));
    CHECK(sp_secrets_reveal(s, "teamb", "OPENAI", on_value, &r, &e) == 0);
    WAIT(r);
    CHECK(r.code == SP_OK && r.n == 7 && strcmp(r.rules, "b-value") == 0);
    memset(&r, 0, sizeof(r));
    CHECK(sp_secrets_reveal(s, "teamb", "OTHER", on_value, &r, &e) == 0);
    WAIT(r);
    CHECK(r.code == SP_ENOTFOUND && strstr(r.msg, "'OTHER' does not exist") != NULL &&
          strcmp(r.rules, "(null)") == 0);
    CHECK(sp_secrets_reveal(s, "teama", "bad name", on_value, &r, &e) < 0 &&
          e.code == SP_ENOTFOUND);

    /* Rules: only the team's own sandbox, only existing secrets; a change NOTIFYs it. */
    json_error_t je;
    json_t *rules = json_loads("[{\"host\":\"api.example.com\",\"header\":\"Authorization\","
                               "\"secret\":\"OPENAI\",\"format\":\"Bearer {secret}\"}]",
                               0, &je);
    json_t *missing = json_loads("[{\"host\":\"api.example.com\",\"header\":\"X\","
                                 "\"secret\":\"GHOST\"}]",
                                 0, &je);
    memset(&r, 0, sizeof(r));
    CHECK(sp_secrets_set_rules(s, "teamb", "sbaaa1", rules, on_rules, &r, &e) == 0);
    WAIT(r);
    CHECK(r.code == SP_ENOTFOUND);
    memset(&r, 0, sizeof(r));
    CHECK(sp_secrets_set_rules(s, "teama", "sbaaa1", missing, on_rules, &r, &e) == 0);
    WAIT(r);
    CHECK(r.code == SP_EINVAL && strstr(r.msg, "GHOST") != NULL);
    memset(&r, 0, sizeof(r));
    CHECK(sp_secrets_check_rule_secrets(s, "teama", missing, on_done, &r, &e) == 0);
    WAIT(r);
    CHECK(r.code == SP_EINVAL);
    memset(&r, 0, sizeof(r));
    CHECK(sp_secrets_check_rule_secrets(s, "teama", rules, on_done, &r, &e) == 0);
    WAIT(r);
    CHECK(r.code == SP_OK);
    int before = note.got;
    memset(&r, 0, sizeof(r));
    CHECK(sp_secrets_set_rules(s, "teama", "sbaaa1", rules, on_rules, &r, &e) == 0);
    WAIT(r);
    CHECK(r.code == SP_OK && strstr(r.rules, "Bearer {secret}") != NULL);
    CHECK(strstr(r.rules, "TOPSECRET") == NULL);
    run_until(&note.got, before + 1, 3000);
    CHECK(note.got > before && strcmp(note.payload, "sbaaa1") == 0);
    memset(&r, 0, sizeof(r));
    CHECK(sp_secrets_get_rules(s, "teama", "sbaaa1", on_rules, &r, &e) == 0);
    WAIT(r);
    CHECK(r.code == SP_OK && strstr(r.rules, "api.example.com") != NULL);
    memset(&r, 0, sizeof(r));
    CHECK(sp_secrets_get_rules(s, "teamb", "sbaaa1", on_rules, &r, &e) == 0);
    WAIT(r);
    CHECK(r.code == SP_ENOTFOUND);
    CHECK(sp_secrets_get_rules(s, "teama", "../x", on_rules, &r, &e) < 0 && e.code == SP_ENOTFOUND);

    /* Delete; the rule naming it stays (its requests fail until the secret is back). */
    memset(&r, 0, sizeof(r));
    CHECK(sp_secrets_delete(s, "teama", "OPENAI", on_done, &r, &e) == 0);
    WAIT(r);
    CHECK(r.code == SP_OK);
    memset(&r, 0, sizeof(r));
    CHECK(sp_secrets_delete(s, "teama", "OPENAI", on_done, &r, &e) == 0);
    WAIT(r);
    CHECK(r.code == SP_ENOTFOUND);
    memset(&r, 0, sizeof(r));
    CHECK(sp_secrets_list(s, "teamb", on_list, &r, &e) == 0);
    WAIT(r);
    CHECK(r.n == 1); /* team B's own OPENAI is untouched */

    /* Disabled: every call says how to configure a key. */
    sp_secrets_t *off = sp_secrets_create(loop, st, NULL, &e);
    CHECK(sp_secrets_list(off, "teama", on_list, &r, &e) < 0 && e.code == SP_EUNAVAIL);
    CHECK(sp_secrets_put(off, "teama", "A", "v", 1, false, on_rec, &r, &e) < 0 &&
          e.code == SP_EUNAVAIL);
    sp_secrets_destroy(off);
    json_decref(rules);
    json_decref(missing);
    sp_secrets_destroy(s);
}

int main(void)
{
    if (sodium_init() < 0)
        return 1;
    snprintf(tmpdir_path, sizeof(tmpdir_path), "/tmp/sp-secrets-key-XXXXXX");
    if (mkdtemp(tmpdir_path) == NULL)
        return 1;
    int rc = fx_start("secrets");
    if (rc != 0)
        return rc;
    test_secrets_master_key_sources();
    test_secrets_seal_open();
    test_secrets_validation();
    sp_err_t e;
    sp_store_t *st = sp_store_create(loop, dsn, 2, &e);
    CHECK(st != NULL);
    if (st != NULL)
        test_secrets_store_and_tenancy(st);
    sp_store_destroy(st);
    fx_stop();
    char cmd[512];
    snprintf(cmd, sizeof(cmd), "rm -rf %s", tmpdir_path);
    if (system(cmd) != 0)
        fprintf(stderr, "cleanup failed\n");
    return check_report("secrets");
}
