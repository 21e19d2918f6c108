/*
 * tmpl.c - template builds through the API (tmpl.h): validation, the build's record, the
 * builder VM's steps, the new version's files, the log.
 *
 * A build in memory (struct build) exists from its accepted request until its record says
 * how it ended; its phase says which one asynchronous call is in flight (at most one), so a
 * failure or the time limit only marks it failed and the in-flight call's callback takes it
 * on to tear-down: destroy the builder if one was booted, then record the failure.
 */
#include "core/control/tmpl.h"

#include <ctype.h>
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <sodium.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "base/buf.h"
#include "base/ids.h"
#include "base/log.h"
#include "core/channel/exec.h"
#include "core/control/dockerfile.h"
#include "core/control/tmplcache.h"
#include "core/control/ociimg.h"
#include "core/control/tmplfiles.h"
#include "core/runtime/qemu.h"
#include "guest/tmplbuild.h"

#define TS(x) "to_char((" x ") AT TIME ZONE 'UTC', 'YYYY-MM-DD\"T\"HH24:MI:SS.MS\"Z\"')"
#define BUILD_COLS                                                                                 \
    "b.id, b.template, b.status, coalesce(b.hash, ''), b.cached, coalesce(b.failed_step, 0), "    \
    "coalesce(b.error, ''), " TS("b.created_at") ", coalesce(" TS("b.started_at") ", ''), "        \
    "coalesce(" TS("b.finished_at") ", ''), coalesce((b.request->>'cpu_count')::int, 0), "       \
    "coalesce((b.request->>'memory_mb')::int, 0)"
#define TAIL_MAX   2048 /* bytes of a failed step's output quoted in the error */
#define LINE_MAX_B 8192 /* a longer output line is split */
#define ENV_FILE   "/etc/space/template.env"
/* Steps that ran this long since the builder came up or its last cache snapshot get one
 * (tmplcache.h): quicker ones cost less to run again than a snapshot (a few hundred ms). */
#define STEP_CACHE_MS 1000u

enum phase {
    P_ACCEPT = 0, /* the INSERT of its record in flight */
    P_QUEUED,
    P_IMPORT,  /* a container image being pulled on a worker thread (ociimg.h) */
    P_BOOT,    /* driver boot in flight */
    P_EXEC,    /* an exec (step, env file, sync) in flight */
    P_PAUSE,   /* driver pause in flight */
    P_EXPORT,  /* driver export_disk in flight */
    P_DESTROY, /* driver destroy in flight */
    P_TSNAP,   /* template snapshot in flight */
    P_CKPT,    /* a step cache snapshot of the builder in flight */
    P_RECORD,  /* the final UPDATE in flight */
};

struct waiter {
    struct waiter *next;
    struct build *b;
    sp_tmpl_t *t;
    sp_auth_t auth;
    char name[65], id[SP_TMPL_ID_MAX + 1];
    sp_tmpl_build_cb cb;
    void *arg;
    sp_timer_t timer;
};

struct impjob;

struct build {
    struct build *next;
    sp_tmpl_t *t;
    char id[SP_TMPL_ID_MAX + 1];
    char team[SP_ID_LEN + 1];
    char name[65];
    char parent[65];
    char vm_id[32];
    char hash[SP_TMPLBUILD_HASH_LEN + 1];
    sp_tmplbuild_paths_t pp; /* the parent's current version */
    json_t *req;             /* the request as validated (owned) */
    json_t *env;             /* env the steps set so far (owned) */
    char user[40];
    char workdir[SP_EXEC_PATH_MAX + 1];
    int cpu_count, memory_mb, timeout_s, ready_s;
    bool force;
    enum phase ph;
    bool vm_up;   /* a builder VM may exist: destroy it at the end */
    bool failed;  /* tear down, then record error */
    bool cached;
    bool swapped; /* current points at the new version */
    bool tags_given; /* the request named tags (a reserved build keeps its reservation's) */
    char prev_current[SP_TMPLBUILD_HASH_LEN + 1]; /* "" when there was none */
    int failed_step;
    char error[1024];
    size_t step; /* index of the step running or next */
    bool finishing; /* the steps are done: the env file and sync are running */
    sp_exec_t *op;
    int copy_fd;      /* a copy step's files being written into the builder, or -1 */
    uint8_t *copy_buf; /* a chunk of them the agent has not taken yet */
    size_t copy_off, copy_len;
    sp_buf_t line[2]; /* a partial output line per stream */
    char tail[TAIL_MAX];
    size_t tail_len;
    int log_fd;
    uint64_t log_bytes;
    bool log_capped;
    sp_timer_t deadline;
    uint64_t t0;
    uint64_t ckpt_ms; /* when the builder came up or last got a step cache snapshot */
    sp_qemu_tsnap_info_t tsnap;
    struct waiter *waiters;
    char *image;          /* from {"image"}: the reference, or NULL (owned) */
    char *reg_user, *reg_pass; /* its registry credentials, until the pull (owned, wiped) */
    struct impjob *imp;   /* the import in flight */
};

/* An import on a worker thread; b is NULL once the build is gone. */
struct impjob {
    struct build *b;
    sp_work_t *work;
    sp_ociimg_opts_t opts;
    char data_dir[PATH_MAX];
    char *ref, *user, *pass;
    int rc;
    sp_err_t err;
    sp_ociimg_result_t res;
};

struct sp_tmpl {
    sp_tmplfiles_t *files;
    sp_loop_t *loop;
    sp_store_t *store;
    sp_driver_t *driver;
    char data_dir[PATH_MAX];
    struct build *builds; /* accepted, not yet recorded as ended; oldest last */
    char *agent, *mirror, *insecure; /* sp_tmpl_set_images (owned) */
    uint64_t image_max;
};

/* ---- small helpers ---- */

static void copy(char *dst, size_t cap, const char *src)
{
    size_t n = src ? strnlen(src, cap - 1) : 0;
    memcpy(dst, src ? src : "", n);
    dst[n] = '\0';
}

static bool valid_env_key(const char *k)
{
    if (k[0] == '\0' || strlen(k) > 256 || isdigit((unsigned char)k[0]))
        return false;
    for (const char *p = k; *p; p++)
        if (!isalnum((unsigned char)*p) && *p != '_')
            return false;
    return true;
}

static bool valid_user(const char *u)
{
    size_t n = strlen(u);
    if (n == 0 || n > 32 || !(islower((unsigned char)u[0]) || u[0] == '_'))
        return false;
    for (size_t i = 0; i < n; i++) {
        unsigned char c = (unsigned char)u[i];
        if (!(islower(c) || isdigit(c) || c == '_' || c == '-'))
            return false;
    }
    return true;
}

/* Our ids, or a UUID (E2B's clients parse build ids as UUIDs). */
static bool valid_build_id(const char *id)
{
    size_t n = strlen(id);
    if (n == SP_ID_LEN)
        return sp_ids_valid(id);
    if (n != 36)
        return false;
    for (size_t i = 0; i < n; i++) {
        bool dash = i == 8 || i == 13 || i == 18 || i == 23;
        if (dash ? id[i] != '-' : !(isdigit((unsigned char)id[i]) || (id[i] >= 'a' && id[i] <= 'f')))
            return false;
    }
    return true;
}

static bool is_uuid(const char *s)
{
    if (strlen(s) != 36)
        return false;
    for (size_t i = 0; i < 36; i++) {
        bool dash = i == 8 || i == 13 || i == 18 || i == 23;
        if (dash ? s[i] != '-' : !isxdigit((unsigned char)s[i]))
            return false;
    }
    return true;
}

bool sp_tmpl_valid_tag(const char *tag)
{
    size_t n = tag != NULL ? strlen(tag) : 0;
    if (n == 0 || n > SP_TMPL_TAG_MAX || is_uuid(tag) || strspn(tag, ".") == n)
        return false;
    return strspn(tag, "abcdefghijklmnopqrstuvwxyz0123456789-_.") == n;
}

/* A fresh version 4 UUID: build ids are UUIDs (E2B's clients parse them as such). */
static void new_uuid(char out[SP_TMPL_ID_MAX + 1])
{
    unsigned char r[16];
    randombytes_buf(r, sizeof r);
    r[6] = (unsigned char)((r[6] & 0x0f) | 0x40); /* version 4 */
    r[8] = (unsigned char)((r[8] & 0x3f) | 0x80); /* RFC 4122 variant */
    snprintf(out, SP_TMPL_ID_MAX + 1,
             "%02x%02x%02x%02x-%02x%02x-%02x%02x-%02x%02x-%02x%02x%02x%02x%02x%02x", r[0], r[1],
             r[2], r[3], r[4], r[5], r[6], r[7], r[8], r[9], r[10], r[11], r[12], r[13], r[14],
             r[15]);
}

int sp_tmpl_parse_target(const char *target, const json_t *tags, char name[64], json_t **out,
                         sp_err_t *err)
{
    *out = NULL;
    const char *colon = target != NULL ? strchr(target, ':') : NULL;
    size_t n = target == NULL ? 0 : colon ? (size_t)(colon - target) : strlen(target);
    if (n == 0 || n > 63)
        return sp_err_set(err, SP_EINVAL,
                          "name is required: [a-z0-9][a-z0-9._-]*, at most 63 characters");
    memcpy(name, target, n);
    name[n] = '\0';
    if (!sp_tmplbuild_valid_name(name))
        return sp_err_set(err, SP_EINVAL,
                          "name is required: [a-z0-9][a-z0-9._-]*, at most 63 characters");
    if (tags != NULL && !json_is_null(tags) &&
        (!json_is_array(tags) || json_array_size(tags) > SP_TMPL_TAGS_MAX))
        return sp_err_set(err, SP_EINVAL, "tags must be an array of at most %d tags",
                          SP_TMPL_TAGS_MAX);
    json_t *all = json_array();
    if (all == NULL)
        return sp_err_set(err, SP_EINTERNAL, "out of memory");
    if (colon != NULL)
        json_array_append_new(all, json_string(colon + 1));
    size_t i;
    json_t *v;
    json_array_foreach(tags, i, v) json_array_append(all, v);
    json_t *uniq = json_array();
    json_array_foreach(all, i, v)
    {
        const char *tg = json_string_value(v);
        if (!json_is_string(v) || strlen(tg) != json_string_length(v) || !sp_tmpl_valid_tag(tg)) {
            sp_err_set(err, SP_EINVAL,
                       "bad tag '%.64s': 1 to %d of [a-z0-9._-], not a UUID",
                       tg != NULL ? tg : "", SP_TMPL_TAG_MAX);
            json_decref(all);
            json_decref(uniq);
            return -1;
        }
        bool dup = false;
        for (size_t j = 0; j < json_array_size(uniq) && !dup; j++)
            dup = strcmp(json_string_value(json_array_get(uniq, j)), tg) == 0;
        if (!dup)
            json_array_append(uniq, v);
    }
    json_decref(all);
    if (json_array_size(uniq) == 0)
        json_array_append_new(uniq, json_string("default"));
    *out = uniq;
    return 0;
}

/* The builder VM's id: "bld-" and the build id's first 20 letters and digits. */
static void vm_id_of(const char *build_id, char out[32])
{
    size_t k = 0;
    k += (size_t)snprintf(out, 32, "bld-");
    for (const char *p = build_id; *p && k < 24; p++)
        if (*p != '-')
            out[k++] = *p;
    out[k] = '\0';
}

static int bad(sp_err_t *err, const char *fmt, const char *a)
{
    return sp_err_set(err, SP_EINVAL, fmt, a);
}

/* A string field within limits, or absent (*out NULL). */
static int opt_str(const json_t *o, const char *key, size_t max, const char **out, sp_err_t *err)
{
    json_t *v = json_object_get(o, key);
    *out = NULL;
    if (v == NULL || json_is_null(v))
        return 0;
    if (!json_is_string(v) || json_string_length(v) == 0 || json_string_length(v) > max ||
        strlen(json_string_value(v)) != json_string_length(v))
        return sp_err_set(err, SP_EINVAL, "%s must be a non-empty string of at most %zu bytes",
                          key, max);
    *out = json_string_value(v);
    return 0;
}

static int opt_int(const json_t *o, const char *key, int lo, int hi, int *out, sp_err_t *err)
{
    json_t *v = json_object_get(o, key);
    if (v == NULL || json_is_null(v))
        return 0;
    if (!json_is_integer(v) || json_integer_value(v) < lo || json_integer_value(v) > hi)
        return sp_err_set(err, SP_EINVAL, "%s must be an integer from %d to %d", key, lo, hi);
    *out = (int)json_integer_value(v);
    return 0;
}

static int check_env(const json_t *env, const char *where, sp_err_t *err)
{
    if (!json_is_object(env) || json_object_size(env) > 1000)
        return bad(err, "%s must be an object of at most 1000 strings", where);
    const char *k;
    json_t *v;
    json_object_foreach((json_t *)env, k, v)
    {
        if (!valid_env_key(k))
            return sp_err_set(err, SP_EINVAL, "%s: bad variable name '%.64s'", where, k);
        if (!json_is_string(v) || json_string_length(v) > 65536 ||
            strlen(json_string_value(v)) != json_string_length(v))
            return sp_err_set(err, SP_EINVAL, "%s: %.64s must be a string without NUL", where, k);
    }
    return 0;
}

/* One step: exactly one of run, env, workdir, user (run may carry user, workdir, env,
 * timeout_s). */
static int check_step(const json_t *s, size_t i, sp_err_t *err)
{
    char where[48];
    snprintf(where, sizeof where, "steps[%zu]", i);
    if (!json_is_object(s))
        return bad(err, "%s must be an object", where);
    static const char *const kinds[] = {"run", "env", "workdir", "user", "copy"};
    int nk = 0, kind = -1;
    for (int k = 0; k < 5; k++)
        if (json_object_get(s, kinds[k]) != NULL) {
            nk++;
            kind = k;
        }
    if (json_object_get(s, "run") != NULL) { /* a run step may set user, workdir, env */
        kind = 0;
        nk = json_object_get(s, "copy") != NULL ? 2 : 1;
    }
    if (nk != 1)
        return bad(err, "%s must have exactly one of run, env, workdir, user, copy", where);
    const char *key;
    json_t *v;
    json_object_foreach((json_t *)s, key, v)
    {
        bool ok = strcmp(key, kinds[kind]) == 0 ||
                  (kind == 0 && (strcmp(key, "user") == 0 || strcmp(key, "workdir") == 0 ||
                                 strcmp(key, "env") == 0 || strcmp(key, "timeout_s") == 0));
        if (!ok)
            return sp_err_set(err, SP_EINVAL, "%s: unknown field '%.64s'", where, key);
    }
    if (kind == 4) {
        json_t *c = json_object_get(s, "copy");
        static const char *const ck[] = {"files", "src", "dest", "user", "mode", NULL};
        if (!json_is_object(c))
            return bad(err, "%s.copy must be an object {files, src, dest, user, mode}", where);
        json_object_foreach(c, key, v)
        {
            bool ok = false;
            for (int j = 0; ck[j] != NULL && !ok; j++)
                ok = strcmp(key, ck[j]) == 0;
            if (!ok)
                return sp_err_set(err, SP_EINVAL, "%s.copy: unknown field '%.64s'", where, key);
        }
        const char *f = json_string_value(json_object_get(c, "files"));
        const char *src = json_string_value(json_object_get(c, "src"));
        const char *dest = json_string_value(json_object_get(c, "dest"));
        const char *cu = json_string_value(json_object_get(c, "user"));
        const char *mode = json_string_value(json_object_get(c, "mode"));
        if (f == NULL || !sp_tmplfiles_valid_key(f))
            return bad(err, "%s.copy.files must be the key of uploaded files (64 hex)", where);
        if (src == NULL || src[0] == '\0' || src[0] == '/' || strlen(src) > 4096 ||
            strstr(src, "..") != NULL)
            return bad(err, "%s.copy.src must be a path inside the uploaded files", where);
        if (dest == NULL || dest[0] == '\0' || strlen(dest) > 4096)
            return bad(err, "%s.copy.dest must be a path", where);
        if (json_object_get(c, "user") != NULL && (cu == NULL || (cu[0] && !valid_user(cu))))
            return bad(err, "%s.copy.user must be a user name", where);
        if (json_object_get(c, "mode") != NULL) {
            bool ok = mode != NULL && (mode[0] == '\0' || (strlen(mode) >= 3 && strlen(mode) <= 4));
            for (const char *m = mode; ok && *m; m++)
                ok = *m >= '0' && *m <= '7';
            if (!ok)
                return bad(err, "%s.copy.mode must be octal digits (\"0755\")", where);
        }
        return 0;
    }
    json_t *run = json_object_get(s, "run");
    if (kind == 0) {
        if (json_is_string(run)) {
            if (json_string_length(run) == 0 || json_string_length(run) > 65536 ||
                strlen(json_string_value(run)) != json_string_length(run))
                return bad(err, "%s.run must be 1..65536 bytes without NUL", where);
        } else if (json_is_array(run) && json_array_size(run) >= 1 &&
                   json_array_size(run) <= 256) {
            size_t j;
            json_t *a;
            json_array_foreach(run, j, a) if (!json_is_string(a) || json_string_length(a) > 65536 ||
                                               strlen(json_string_value(a)) !=
                                                   json_string_length(a)) return
                bad(err, "%s.run: every argument must be a string without NUL", where);
        } else {
            return bad(err, "%s.run must be a shell line or an argv array (1..256 strings)",
                       where);
        }
        int to = 0;
        if (opt_int(s, "timeout_s", 1, SP_TMPL_TIMEOUT_MAX, &to, err) < 0)
            return -1;
    }
    json_t *u = json_object_get(s, "user");
    if (u != NULL && (!json_is_string(u) || !valid_user(json_string_value(u))))
        return bad(err, "%s.user must be a user name ([a-z_][a-z0-9_-]*, at most 32)", where);
    json_t *w = json_object_get(s, "workdir");
    if (w != NULL && (!json_is_string(w) || json_string_value(w)[0] != '/' ||
                      json_string_length(w) > SP_EXEC_PATH_MAX ||
                      strlen(json_string_value(w)) != json_string_length(w)))
        return bad(err, "%s.workdir must be an absolute path", where);
    json_t *e = json_object_get(s, "env");
    if (e != NULL) {
        char w2[64];
        snprintf(w2, sizeof w2, "%s.env", where);
        if (check_env(e, w2, err) < 0)
            return -1;
    }
    return 0;
}

/* ---- the log ---- */

static void log_raw(struct build *b, const char *level, int step, const char *stream,
                    const char *line, size_t len)
{
    if (b->log_fd < 0 || b->log_capped)
        return;
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    struct tm tm;
    gmtime_r(&ts.tv_sec, &tm);
    char when[64];
    snprintf(when, sizeof when, "%04d-%02d-%02dT%02d:%02d:%02d.%03dZ", tm.tm_year + 1900,
             tm.tm_mon + 1, tm.tm_mday, tm.tm_hour, tm.tm_min, tm.tm_sec,
             (int)(ts.tv_nsec / 1000000) % 1000);
    json_t *o = json_pack("{s:s,s:s,s:i,s:s,s:s%}", "ts", when, "level", level, "step", step,
                          "stream", stream, "line", line, len);
    if (o == NULL) { /* not UTF-8: keep what is printable */
        char *clean = malloc(len + 1);
        if (clean == NULL)
            return;
        for (size_t i = 0; i < len; i++)
            clean[i] = (unsigned char)line[i] < 0x80 ? line[i] : '?';
        clean[len] = '\0';
        o = json_pack("{s:s,s:s,s:i,s:s,s:s}", "ts", when, "level", level, "step", step,
                      "stream", stream, "line", clean);
        free(clean);
        if (o == NULL)
            return;
    }
    char *s = json_dumps(o, JSON_COMPACT);
    json_decref(o);
    if (s == NULL)
        return;
    size_t n = strlen(s);
    s[n] = '\n';
    if (b->log_bytes + n + 1 > SP_TMPL_LOG_MAX) {
        b->log_capped = true;
        static const char cap[] = "{\"level\":\"warn\",\"line\":\"the log reached its size "
                                  "limit: later lines are not kept\"}\n";
        if (write(b->log_fd, cap, sizeof cap - 1) < 0)
            sp_log(SP_LOG_WARN, "tmpl", "build log write failed build=%s", b->id);
    } else if (write(b->log_fd, s, n + 1) == (ssize_t)(n + 1)) {
        b->log_bytes += n + 1;
    }
    free(s);
}

static void logf_(struct build *b, const char *level, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
static void logf_(struct build *b, const char *level, const char *fmt, ...)
{
    char line[2048];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(line, sizeof line, fmt, ap);
    va_end(ap);
    log_raw(b, level, (int)b->step + (b->ph == P_EXEC ? 1 : 0), "build", line, strlen(line));
}

static void tail_add(struct build *b, const uint8_t *p, size_t n)
{
    if (n >= TAIL_MAX) {
        p += n - (TAIL_MAX - 1);
        n = TAIL_MAX - 1;
    }
    if (b->tail_len + n >= TAIL_MAX) {
        size_t drop = b->tail_len + n - (TAIL_MAX - 1);
        memmove(b->tail, b->tail + drop, b->tail_len - drop);
        b->tail_len -= drop;
    }
    memcpy(b->tail + b->tail_len, p, n);
    b->tail_len += n;
    b->tail[b->tail_len] = '\0';
}

/* Output of the running step: whole lines into the log, the rest kept for the next chunk. */
static void step_output(struct build *b, int fd, const uint8_t *p, size_t n, bool final)
{
    static const char *const names[2] = {"stdout", "stderr"};
    sp_buf_t *lb = &b->line[fd];
    if (n > 0)
        tail_add(b, p, n);
    for (size_t i = 0; i < n; i++) {
        if (p[i] == '\n' || lb->len >= LINE_MAX_B) {
            log_raw(b, "info", (int)b->step + 1, names[fd], (const char *)lb->p, lb->len);
            sp_buf_reset(lb);
            if (p[i] == '\n')
                continue;
        }
        sp_buf_add(lb, p + i, 1);
    }
    if (final && lb->len > 0) {
        log_raw(b, "info", (int)b->step + 1, names[fd], (const char *)lb->p, lb->len);
        sp_buf_reset(lb);
    }
}

/* ---- records ---- */

static void parse_build(PGresult *r, int row, sp_tmpl_build_rec_t *o)
{
    memset(o, 0, sizeof(*o));
    SP_STORE_TEXT(r, row, 0, o->id);
    SP_STORE_TEXT(r, row, 1, o->template_name);
    SP_STORE_TEXT(r, row, 2, o->status);
    SP_STORE_TEXT(r, row, 3, o->hash);
    o->cached = PQgetvalue(r, row, 4)[0] == 't';
    o->failed_step = atoi(PQgetvalue(r, row, 5));
    SP_STORE_TEXT(r, row, 6, o->error);
    SP_STORE_TEXT(r, row, 7, o->created_at);
    SP_STORE_TEXT(r, row, 8, o->started_at);
    SP_STORE_TEXT(r, row, 9, o->finished_at);
    o->cpu_count = atoi(PQgetvalue(r, row, 10));
    o->memory_mb = atoi(PQgetvalue(r, row, 11));
}

static void build_done_row(void *rec, PGresult *res, const sp_err_t *err)
{
    sp_store_req_t *q = rec;
    sp_tmpl_build_cb cb = (sp_tmpl_build_cb)q->cb;
    sp_err_t e;
    const sp_err_t *why = sp_store_one_row(res, err, SP_ENOTFOUND, "build not found", &e);
    if (why != NULL) {
        cb(q->arg, NULL, why);
        return;
    }
    sp_tmpl_build_rec_t b;
    parse_build(res, 0, &b);
    cb(q->arg, &b, NULL);
}

/* A reservation's answer: no row means the name is not the team's to build. */
static void on_reserved(void *rec, PGresult *res, const sp_err_t *err)
{
    sp_store_req_t *q = rec;
    sp_tmpl_build_cb cb = (sp_tmpl_build_cb)q->cb;
    sp_err_t e;
    const sp_err_t *why =
        sp_store_one_row(res, err, SP_ECONFLICT, "the template name is taken", &e);
    if (why != NULL) {
        cb(q->arg, NULL, why);
        return;
    }
    sp_tmpl_build_rec_t b;
    parse_build(res, 0, &b);
    cb(q->arg, &b, NULL);
}

static int read_build(sp_tmpl_t *t, const char *team, const char *name, const char *id,
                      sp_tmpl_build_cb cb, void *arg, sp_err_t *err)
{
    const char *p[] = {id, team, name};
    return sp_store_submit(t->store,
                           "SELECT " BUILD_COLS " FROM template_builds b"
                           " WHERE b.id = $1 AND b.team_id = $2 AND b.template = $3",
                           3, p, build_done_row, t, (void *)cb, arg, 0, err);
}

/* ---- waiters (?wait=) ---- */

static void waiter_answer(struct waiter *w);

static void waiter_unlink(struct waiter *w)
{
    for (struct waiter **pp = &w->b->waiters; *pp != NULL; pp = &(*pp)->next)
        if (*pp == w) {
            *pp = w->next;
            break;
        }
}

static void on_waiter_timer(sp_timer_t *tm, void *arg)
{
    (void)tm;
    struct waiter *w = arg;
    waiter_unlink(w);
    waiter_answer(w);
}

/* Reads the record and answers; frees w. */
static void waiter_answer(struct waiter *w)
{
    sp_timer_stop(&w->timer);
    sp_err_t e;
    if (read_build(w->t, w->auth.team_id, w->name, w->id, w->cb, w->arg, &e) < 0)
        w->cb(w->arg, NULL, &e);
    free(w);
}

/* ---- the build's course ---- */

static void advance(struct build *b);
static void start_queued(sp_tmpl_t *t);
static void collect(sp_tmpl_t *t, const char *name);
static bool has_default(const struct build *b);

static void wipe_free(char *s)
{
    if (s != NULL) {
        sodium_memzero(s, strlen(s));
        free(s);
    }
}

static void build_free(struct build *b)
{
    sp_tmpl_t *t = b->t;
    for (struct build **pp = &t->builds; *pp != NULL; pp = &(*pp)->next)
        if (*pp == b) {
            *pp = b->next;
            break;
        }
    sp_timer_stop(&b->deadline);
    if (b->op != NULL)
        sp_exec_cancel(b->op);
    if (b->log_fd >= 0)
        close(b->log_fd);
    if (b->copy_fd >= 0)
        close(b->copy_fd);
    free(b->copy_buf);
    sp_buf_free(&b->line[0]);
    sp_buf_free(&b->line[1]);
    json_decref(b->req);
    json_decref(b->env);
    free(b->image);
    wipe_free(b->reg_user);
    wipe_free(b->reg_pass);
    if (b->imp != NULL) { /* the job frees itself when it reports */
        b->imp->b = NULL;
        sp_work_cancel(b->imp->work);
    }
    free(b);
}

static void fail(struct build *b, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void fail(struct build *b, const char *fmt, ...)
{
    if (b->failed)
        return;
    b->failed = true;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(b->error, sizeof b->error, fmt, ap);
    va_end(ap);
    logf_(b, "error", "build failed: %s", b->error);
    sp_log(SP_LOG_WARN, "tmpl", "template build failed build=%s template=%s err=\"%s\"", b->id,
           b->name, b->error);
}

static void on_deadline(sp_timer_t *tm, void *arg)
{
    (void)tm;
    struct build *b = arg;
    fail(b, "the build did not finish within its time limit of %d s", b->timeout_s);
    if (b->imp != NULL) /* the pull's tools are stopped; its report tears down */
        sp_work_cancel(b->imp->work);
    if (b->op != NULL) { /* a step: stop waiting for it; the VM goes with the tear-down */
        sp_exec_cancel(b->op);
        b->op = NULL;
        advance(b);
    }
}

static void on_recorded(void *rec, PGresult *res, const sp_err_t *err)
{
    (void)res;
    struct build *b = *(struct build **)rec;
    if (err != NULL)
        sp_log(SP_LOG_ERROR, "tmpl", "cannot record the end of build=%s err=%s", b->id, err->msg);
    sp_log(SP_LOG_INFO, "tmpl", "template build ended build=%s template=%s ok=%d cached=%d s=%.1f",
           b->id, b->name, !b->failed, (int)b->cached,
           (double)(sp_loop_now_ms(b->t->loop) - b->t0) / 1000.0);
    sp_tmpl_t *t = b->t;
    struct waiter *ws = b->waiters;
    char name[65];
    bool moved = !b->failed && err == NULL; /* tags moved: their old versions may be unused */
    copy(name, sizeof name, b->name);
    b->waiters = NULL;
    build_free(b);
    if (moved)
        collect(t, name);
    while (ws != NULL) {
        struct waiter *n = ws->next;
        ws->b = NULL;
        waiter_answer(ws);
        ws = n;
    }
    start_queued(t);
}

static void record_end(struct build *b)
{
    b->ph = P_RECORD;
    sp_timer_stop(&b->deadline);
    char step[16], *env = NULL;
    snprintf(step, sizeof step, "%d", b->failed_step);
    sp_err_t e;
    void *rec = NULL;
    if (b->failed) {
        const char *p[] = {b->id, b->error, b->failed_step > 0 ? step : NULL, b->name};
        rec = sp_store_call(
            b->t->store,
            "WITH b AS (UPDATE template_builds SET status = 'failed', error = $2,"
            "  failed_step = $3::int, finished_at = now(), started_at = coalesce(started_at, now())"
            "  WHERE id = $1 RETURNING 1)"
            " UPDATE templates SET status = 'failed', updated_at = now()"
            " WHERE name = $4 AND status = 'building' AND (SELECT count(*) FROM b) >= 0",
            4, p, sizeof(struct build *), on_recorded, &e);
    } else {
        const json_t *desc = json_object_get(b->req, "description");
        char cpus[16], mem[16];
        snprintf(cpus, sizeof cpus, "%d", b->cpu_count);
        snprintf(mem, sizeof mem, "%d", b->memory_mb);
        env = json_dumps(b->env, JSON_COMPACT);
        char *tags = json_dumps(json_object_get(b->req, "tags"), JSON_COMPACT);
        const char *p[] = {b->id,   b->hash, b->cached ? "true" : "false",
                           b->name, desc != NULL ? json_string_value(desc) : NULL,
                           cpus,    mem,     env,
                           b->parent, tags ? tags : "[\"default\"]",
                           has_default(b) ? "true" : "false"};
        /* the version (its first build's id kept), its tags moved to it; the templates row
         * describes the default tag's version */
        rec = sp_store_call(
            b->t->store,
            "WITH b AS (UPDATE template_builds SET status = 'succeeded', hash = $2,"
            "  cached = $3::bool, finished_at = now(), started_at = coalesce(started_at, now())"
            "  WHERE id = $1 RETURNING 1),"
            " v AS (INSERT INTO template_versions (template, hash, build_id, cpu_count, memory_mb,"
            "  env) VALUES ($4, $2, $1, $6::int, $7::int, $8::jsonb)"
            "  ON CONFLICT (template, hash) DO NOTHING RETURNING 1),"
            " g AS (INSERT INTO template_tags (template, tag, hash)"
            "  SELECT $4, x, $2 FROM jsonb_array_elements_text($10::jsonb) x"
            "  ON CONFLICT (template, tag) DO UPDATE SET hash = EXCLUDED.hash, created_at = now()"
            "  RETURNING 1)"
            " UPDATE templates SET status = 'ready',"
            "  build_id = CASE WHEN $11::bool THEN $2 ELSE build_id END,"
            "  description = coalesce($5, description),"
            "  cpu_count = CASE WHEN $11::bool THEN $6::int ELSE cpu_count END,"
            "  memory_mb = CASE WHEN $11::bool THEN $7::int ELSE memory_mb END,"
            "  env = CASE WHEN $11::bool THEN $8::jsonb ELSE env END,"
            "  parent = $9, deleted_at = NULL, updated_at = now()"
            " WHERE name = $4 AND (SELECT count(*) FROM b) + (SELECT count(*) FROM v)"
            "  + (SELECT count(*) FROM g) >= 0",
            11, p, sizeof(struct build *), on_recorded, &e);
        free(tags);
    }
    free(env);
    if (rec == NULL) {
        sp_log(SP_LOG_ERROR, "tmpl", "cannot record the end of build=%s err=%s", b->id, e.msg);
        struct build **slot = &b; /* answer waiters and move on all the same */
        on_recorded(slot, NULL, &e);
        return;
    }
    *(struct build **)rec = b;
}

/* ---- files of the new version ---- */

static int pathf(char *out, size_t n, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
static int pathf(char *out, size_t n, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    int k = vsnprintf(out, n, fmt, ap);
    va_end(ap);
    return k < 0 || (size_t)k >= n ? -1 : 0;
}

static void rm_rf(const char *path)
{
    DIR *d = opendir(path);
    if (d != NULL) {
        struct dirent *de;
        while ((de = readdir(d)) != NULL) {
            if (strcmp(de->d_name, ".") == 0 || strcmp(de->d_name, "..") == 0)
                continue;
            char p[PATH_MAX];
            if (pathf(p, sizeof p, "%s/%s", path, de->d_name) == 0) {
                struct stat st;
                if (lstat(p, &st) == 0 && S_ISDIR(st.st_mode))
                    rm_rf(p);
                else
                    unlink(p);
            }
        }
        closedir(d);
    }
    rmdir(path);
}

static int fsync_dir(const char *p)
{
    int fd = open(p, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (fd < 0)
        return -1;
    int rc = fsync(fd);
    close(fd);
    return rc;
}

/* Points <name>/current at hash (symlink then rename: atomic). */
static int set_current(const sp_tmpl_t *t, const char *name, const char *hash)
{
    char cur[PATH_MAX], tmp[PATH_MAX], dir[PATH_MAX];
    if (pathf(dir, sizeof dir, "%s/templates/%s", t->data_dir, name) < 0 ||
        pathf(cur, sizeof cur, "%s/current", dir) < 0 ||
        pathf(tmp, sizeof tmp, "%s/.current-%d", dir, (int)getpid()) < 0)
        return -1;
    if (hash == NULL || hash[0] == '\0')
        return unlink(cur) < 0 && errno != ENOENT ? -1 : fsync_dir(dir);
    unlink(tmp);
    if (symlink(hash, tmp) < 0 || rename(tmp, cur) < 0) {
        unlink(tmp);
        return -1;
    }
    return fsync_dir(dir);
}

static void work_dir(const struct build *b, char *out, size_t n)
{
    if (pathf(out, n, "%s/templates/%s/.build-%s", b->t->data_dir, b->name, b->id) < 0)
        out[0] = '\0';
}

/* The warmup the template snapshot builder runs (as root): the template's env, start_cmd in
 * the background as the template's user in its workdir, then ready_cmd until it passes. */
static json_t *warmup_argv(const struct build *b)
{
    const char *start = json_string_value(json_object_get(b->req, "start_cmd"));
    const char *ready = json_string_value(json_object_get(b->req, "ready_cmd"));
    if (start == NULL && ready == NULL)
        return json_null();
    static const char script[] =
        "set -a; [ -r " ENV_FILE " ] && . " ENV_FILE "; set +a\n"
        "user=$1 dir=$2 start=$3 ready=$4 limit=$5\n"
        "as() { if [ \"$user\" = root ]; then /bin/sh -c \"$1\"; "
        "elif command -v runuser >/dev/null 2>&1; then runuser -u \"$user\" -- /bin/sh -c \"$1\"; "
        /* images without util-linux (busybox ones) */
        "else su -s /bin/sh \"$user\" -c \"$1\"; fi; }\n"
        "if [ -n \"$dir\" ]; then cd \"$dir\" || exit 1; fi\n"
        "if [ -n \"$start\" ]; then\n"
        "  ( as \"$start\" ) </dev/null >/var/log/space-start.log 2>&1 &\n"
        "fi\n"
        "[ -n \"$ready\" ] || exit 0\n"
        "end=$(( $(date +%s) + limit ))\n"
        "until as \"$ready\" </dev/null >/dev/null 2>&1; do\n"
        "  if [ \"$(date +%s)\" -ge \"$end\" ]; then\n"
        "    echo \"ready_cmd did not pass within $limit s; start_cmd's output:\"\n"
        "    tail -c 2000 /var/log/space-start.log; exit 1\n"
        "  fi\n"
        "  sleep 0.2\n"
        "done\n";
    char limit[16];
    snprintf(limit, sizeof limit, "%d", b->ready_s);
    return json_pack("[s,s,s,s,s,s,s,s,s]", "/bin/sh", "-c", script, "space-start", b->user,
                     b->workdir, start ? start : "", ready ? ready : "", limit);
}

/* manifest.json of the new version: the parent's, with this build's name, hash, image,
 * sizes and warmup. */
static int write_manifest(struct build *b, const char *wdir)
{
    json_t *m = json_load_file(b->pp.manifest, 0, NULL);
    if (m == NULL)
        return -1;
    char rootfs[PATH_MAX];
    if (pathf(rootfs, sizeof rootfs, "templates/%s/%s/rootfs.qcow2", b->name, b->hash) < 0) {
        json_decref(m);
        return -1;
    }
    struct stat st;
    char img[PATH_MAX], path[PATH_MAX], tmp[PATH_MAX];
    if (pathf(img, sizeof img, "%s/rootfs.qcow2", wdir) < 0 || stat(img, &st) < 0 ||
        pathf(path, sizeof path, "%s/manifest.json", wdir) < 0 ||
        pathf(tmp, sizeof tmp, "%s/manifest.json.tmp", wdir) < 0) {
        json_decref(m);
        return -1;
    }
    json_t *spec = json_deep_copy(b->req);
    json_object_set_new(spec, "parent_hash", json_string(b->pp.hash));
    int rc = json_object_set_new(m, "name", json_string(b->name)) |
             json_object_set_new(m, "hash", json_string(b->hash)) |
             json_object_set_new(m, "rootfs", json_string(rootfs)) |
             json_object_set_new(m, "parent", json_string(b->parent)) |
             json_object_set_new(m, "cpu_count", json_integer(b->cpu_count)) |
             json_object_set_new(m, "memory_mb", json_integer(b->memory_mb)) |
             json_object_set_new(m, "warmup", warmup_argv(b)) |
             json_object_set_new(m, "env", json_deep_copy(b->env)) |
             json_object_set_new(m, "rootfs_bytes", json_integer((json_int_t)st.st_blocks * 512)) |
             json_object_set_new(m, "built_at", json_integer((json_int_t)time(NULL))) |
             json_object_set_new(
                 m, "build_seconds",
                 json_real((double)(sp_loop_now_ms(b->t->loop) - b->t0) / 1000.0)) |
             json_object_set_new(m, "spec", spec);
    if (rc == 0)
        rc = json_dump_file(m, tmp, JSON_INDENT(2) | JSON_SORT_KEYS);
    json_decref(m);
    int fd = rc == 0 ? open(tmp, O_RDONLY | O_CLOEXEC) : -1;
    if (fd < 0 || fsync(fd) < 0 || rename(tmp, path) < 0) {
        if (fd >= 0)
            close(fd);
        return -1;
    }
    close(fd);
    return 0;
}

/* The build's version gets the default tag: `current` follows it (what the bare name boots,
 * and what the runtime keeps the template snapshot of). */
static bool has_default(const struct build *b)
{
    size_t i;
    json_t *v;
    json_array_foreach(json_object_get(b->req, "tags"), i, v) if (
        strcmp(json_string_value(v), "default") == 0) return true;
    return false;
}

/* The exported image is in the work dir: commit the version and point current at it when it
 * gets the default tag. */
static void install(struct build *b)
{
    char wdir[PATH_MAX], final[PATH_MAX], cur[PATH_MAX], target[128];
    work_dir(b, wdir, sizeof wdir);
    if (pathf(final, sizeof final, "%s/templates/%s/%s", b->t->data_dir, b->name, b->hash) < 0 ||
        write_manifest(b, wdir) < 0 || rename(wdir, final) < 0) {
        fail(b, "cannot commit the template's files: %s", strerror(errno));
        return;
    }
    if (!has_default(b)) {
        logf_(b, "info", "version %.12s committed", b->hash);
        return;
    }
    if (pathf(cur, sizeof cur, "%s/templates/%s/current", b->t->data_dir, b->name) == 0) {
        ssize_t n = readlink(cur, target, sizeof target - 1);
        copy(b->prev_current, sizeof b->prev_current, n > 0 ? (target[n] = '\0', target) : "");
    }
    if (set_current(b->t, b->name, b->hash) < 0) {
        fail(b, "cannot make the new version current: %s", strerror(errno));
        return;
    }
    b->swapped = true;
    logf_(b, "info", "version %.12s committed", b->hash);
}

/* ---- driver callbacks ---- */

static void on_tsnap(void *arg, const sp_err_t *err)
{
    struct build *b = arg;
    if (err != NULL)
        fail(b, "the template snapshot failed (start_cmd/ready_cmd): %s", err->msg);
    else
        logf_(b, "info", "template snapshot ready (%s)", b->tsnap.built ? "built" : "found");
    if (b->failed && b->swapped) { /* the previous version stays in service */
        if (set_current(b->t, b->name, b->prev_current) < 0)
            sp_log(SP_LOG_ERROR, "tmpl", "cannot put back current template=%s", b->name);
        b->swapped = false;
    }
    record_end(b);
}

static void take_snapshot(struct build *b)
{
    sp_err_t e;
    b->ph = P_TSNAP;
    if (b->t->driver == NULL || strcmp(b->t->driver->ops->name, "qemu") != 0) {
        on_tsnap(b, NULL);
        return;
    }
    logf_(b, "info", "taking the template snapshot%s",
          json_object_get(b->req, "start_cmd") || json_object_get(b->req, "ready_cmd")
              ? " after start_cmd and ready_cmd"
              : "");
    char ver[160]; /* this version, whichever tag `current` follows */
    snprintf(ver, sizeof ver, "%s@%s", b->name, b->hash);
    if (sp_qemu_template_snapshot(b->t->driver, ver, b->cpu_count, b->memory_mb, &b->tsnap,
                                  on_tsnap, b, &e) < 0) {
        sp_err_t e2 = e;
        on_tsnap(b, &e2);
    }
}

static void on_destroyed(void *arg, const sp_err_t *err)
{
    struct build *b = arg;
    b->vm_up = false;
    if (err != NULL)
        sp_log(SP_LOG_WARN, "tmpl", "builder VM not destroyed build=%s err=%s", b->id, err->msg);
    if (!b->failed) {
        install(b);
        if (!b->failed) {
            take_snapshot(b);
            return;
        }
    }
    char wdir[PATH_MAX];
    work_dir(b, wdir, sizeof wdir);
    rm_rf(wdir);
    record_end(b);
}

static void destroy_vm(struct build *b)
{
    sp_err_t e;
    b->ph = P_DESTROY;
    if (!b->vm_up || b->t->driver->ops->destroy(b->t->driver, b->vm_id, on_destroyed, b, &e) < 0)
        on_destroyed(b, b->vm_up ? &e : NULL);
}

static void on_exported(void *arg, const sp_err_t *err)
{
    struct build *b = arg;
    if (err != NULL)
        fail(b, "cannot freeze the builder's disk: %s", err->msg);
    else
        logf_(b, "info", "disk frozen");
    destroy_vm(b);
}

static void on_paused(void *arg, const sp_err_t *err)
{
    struct build *b = arg;
    sp_err_t e;
    if (err != NULL)
        fail(b, "cannot stop the builder: %s", err->msg);
    if (b->failed) {
        destroy_vm(b);
        return;
    }
    char wdir[PATH_MAX], dest[PATH_MAX];
    work_dir(b, wdir, sizeof wdir);
    b->ph = P_EXPORT;
    if (pathf(dest, sizeof dest, "%s/rootfs.qcow2", wdir) < 0 ||
        b->t->driver->ops->export_disk == NULL ||
        b->t->driver->ops->export_disk(b->t->driver, b->vm_id, b->pp.rootfs, dest, on_exported, b,
                                       &e) < 0) {
        if (b->t->driver->ops->export_disk == NULL)
            sp_err_set(&e, SP_ERUNTIME, "this runtime cannot export disks");
        on_exported(b, &e);
    }
}

static void pause_vm(struct build *b)
{
    sp_err_t e;
    b->ph = P_PAUSE;
    if (b->t->driver->ops->pause(b->t->driver, b->vm_id, on_paused, b, &e) < 0)
        on_paused(b, &e);
}

/* ---- steps ---- */

static const char *step_kind(const json_t *s)
{
    static const char *const kinds[] = {"run", "env", "workdir", "user", "copy"};
    for (int k = 0; k < 5; k++)
        if (json_object_get(s, kinds[k]) != NULL)
            return kinds[k];
    return "?";
}

/* "K=V" strings of env then extra (extra wins), into a NULL-terminated array (free the array
 * only: the strings live in *store). */
static const char **env_strings(const json_t *env, const json_t *extra, sp_buf_t *store,
                                size_t *n)
{
    size_t cap = json_object_size(env) + (extra ? json_object_size(extra) : 0) + 1;
    const char **v = calloc(cap, sizeof(*v));
    size_t *offs = calloc(cap, sizeof(*offs));
    if (v == NULL || offs == NULL) {
        free(v);
        free(offs);
        return NULL;
    }
    json_t *all = json_deep_copy(env);
    if (extra != NULL)
        json_object_update(all, (json_t *)extra);
    const char *k;
    json_t *val;
    size_t i = 0;
    json_object_foreach(all, k, val)
    {
        offs[i++] = store->len;
        sp_buf_add(store, k, strlen(k));
        sp_buf_add(store, "=", 1);
        sp_buf_add(store, json_string_value(val), json_string_length(val));
        sp_buf_add(store, "", 1);
    }
    json_decref(all);
    for (size_t j = 0; j < i; j++)
        v[j] = (const char *)store->p + offs[j];
    free(offs);
    *n = i;
    if (store->oom) {
        free(v);
        return NULL;
    }
    return v;
}

static void on_cached(void *arg, const sp_err_t *err)
{
    struct build *b = arg;
    b->ckpt_ms = sp_loop_now_ms(b->t->loop);
    if (err != NULL)
        logf_(b, "warn", "steps 1-%zu: not cached (%s)", b->step, err->msg);
    else
        logf_(b, "info", "steps 1-%zu: cached for later builds", b->step);
    sp_tmplcache_trim(b->t->driver, b->t->data_dir, SP_TMPLCACHE_KEEP);
    advance(b);
}

/* A step succeeded: the builder as it is now becomes a step cache entry when the steps since
 * the last one took long enough, then the next step. */
static void step_done(struct build *b)
{
    sp_driver_t *d = b->t->driver;
    uint64_t now = sp_loop_now_ms(b->t->loop);
    if (b->failed || d == NULL || d->ops->checkpoint == NULL || now - b->ckpt_ms < STEP_CACHE_MS) {
        advance(b);
        return;
    }
    char id[SP_TMPLCACHE_ID_LEN + 1];
    sp_tmplcache_key(b->team, b->pp.hash, b->cpu_count, b->memory_mb,
                     json_object_get(b->req, "steps"), b->step, id);
    sp_err_t e;
    b->ph = P_CKPT;
    if (d->ops->checkpoint_exists(d, id) == 1) {
        b->ckpt_ms = now;
        advance(b);
    } else if (d->ops->checkpoint(d, b->vm_id, id, on_cached, b, &e) < 0) {
        on_cached(b, &e);
    }
}

static void on_step_event(void *arg, const sp_exec_ev_t *ev)
{
    struct build *b = arg;
    switch (ev->type) {
    case SP_EXEC_EV_START:
        return;
    case SP_EXEC_EV_STDOUT:
    case SP_EXEC_EV_STDERR:
        step_output(b, ev->type == SP_EXEC_EV_STDERR, ev->data, ev->len, false);
        sp_exec_ack(b->op, ev->len);
        return;
    case SP_EXEC_EV_EXIT:
    case SP_EXEC_EV_ERROR:
        break;
    }
    b->op = NULL;
    step_output(b, 0, NULL, 0, true);
    step_output(b, 1, NULL, 0, true);
    json_t *s = json_array_get(json_object_get(b->req, "steps"), b->step);
    const json_t *run = json_object_get(s, "run");
    char what[96];
    if (json_is_string(run))
        snprintf(what, sizeof what, "%.80s", json_string_value(run));
    else
        snprintf(what, sizeof what, "%.80s", json_string_value(json_array_get(run, 0)));
    if (b->finishing) {
        if (ev->type == SP_EXEC_EV_ERROR || !ev->exited || ev->exit_code != 0)
            fail(b, "writing the template's env file and syncing the disk failed: %s",
                 ev->type == SP_EXEC_EV_ERROR ? ev->err->msg : b->tail);
    } else if (ev->type == SP_EXEC_EV_ERROR) {
        b->failed_step = (int)b->step + 1;
        fail(b, "step %zu (run: %s) could not run: %s", b->step + 1, what, ev->err->msg);
    } else if (ev->timed_out) {
        b->failed_step = (int)b->step + 1;
        fail(b, "step %zu (run: %s) did not finish within its timeout_s; last output: %s",
             b->step + 1, what, b->tail);
    } else if (!ev->exited || ev->exit_code != 0) {
        b->failed_step = (int)b->step + 1;
        if (ev->exited)
            fail(b, "step %zu (run: %s) exited with code %d; last output: %s", b->step + 1, what,
                 ev->exit_code, b->tail);
        else
            fail(b, "step %zu (run: %s) was killed by signal %d; last output: %s", b->step + 1,
                 what, ev->signal, b->tail);
    } else {
        logf_(b, "info", "step %zu done", b->step + 1);
        b->step++;
        step_done(b);
        return;
    }
    advance(b);
}

static void run_cmd(struct build *b, const json_t *run, const json_t *extra_env, const char *user,
                    const char *cwd, uint32_t timeout_ms, const void *stdin_data,
                    size_t stdin_len)
{
    sp_buf_t store = {0};
    size_t envc = 0;
    const char **env = env_strings(b->env, extra_env, &store, &envc);
    const char *argv[257];
    size_t argc = 0;
    if (json_is_array(run)) {
        size_t i;
        json_t *a;
        json_array_foreach(run, i, a) argv[argc++] = json_string_value(a);
    }
    sp_exec_cmd_t cmd = {
        .cmd = json_is_string(run) ? json_string_value(run) : NULL,
        .argv = argc > 0 ? argv : NULL,
        .argc = argc,
        .env = env,
        .envc = envc,
        .cwd = cwd,
        .user = user,
        .stdin_pipe = stdin_data != NULL,
        .stdin_data = stdin_data,
        .stdin_len = stdin_len,
        .stdin_eof = true,
        .timeout_ms = timeout_ms,
    };
    sp_err_t e;
    sp_agentconn_t *conn = b->t->driver->ops->agent(b->t->driver, b->vm_id);
    b->tail_len = 0;
    b->tail[0] = '\0';
    b->op = env == NULL || conn == NULL
                ? NULL
                : sp_exec_stream(b->t->loop, conn, &cmd, on_step_event, b, &e);
    free(env);
    sp_buf_free(&store);
    if (b->op == NULL) {
        b->failed_step = b->finishing ? 0 : (int)b->step + 1;
        fail(b, "step %zu could not start: %s", b->step + 1,
             conn == NULL ? "the builder VM has no agent channel"
                          : (env == NULL ? "out of memory" : e.msg));
        advance(b);
    }
}

/* ---- copy steps: the files into the builder, then unpacked there ---- */

#define COPY_CHUNK (256u * 1024u)
#define COPY_DIR   "/tmp/.space-copy"

/* Run as root in the builder: $1 the uploaded tar, $2 src, $3 dest, $4 owner, $5 mode, $6
 * the workdir. E2B's COPY: the source is src cut before its first glob segment; a directory's
 * contents are merged into dest, a file goes to dest (into it when dest ends with '/'); each
 * thing copied gets owner:owner and mode (recursively), and so does dest when the copy made it
 * (as Docker's COPY --chown). */
static const char copy_script[] =
    "set -e\n"
    "f=$1 src=$2 dest=$3 owner=$4 mode=$5 wd=$6\n"
    "stage=$(mktemp -d " COPY_DIR "/stage.XXXXXX)\n"
    "trap 'rm -rf \"$stage\" \"$f\"' EXIT\n"
    "tar -x --no-same-owner -f \"$f\" -C \"$stage\"\n"
    "base=$src\n"
    "case $base in *'*'*|*'?'*|*'['*) base=${base%%[*?[]*}; case $base in */*) "
    "base=${base%/*};; *) base=.;; esac;; esac\n"
    "base=${base#./}; base=${base%/}; [ -n \"$base\" ] || base=.\n"
    "case $dest in /*) ;; *) dest=\"${wd:-/root}/$dest\";; esac\n"
    "s=\"$stage/$base\"\n"
    "if [ ! -e \"$s\" ] && [ ! -L \"$s\" ]; then echo \"COPY: '$src' is not in the uploaded "
    "files\" >&2; exit 1; fi\n"
    "apply() { if [ -n \"$owner\" ]; then chown -hR \"$owner:$owner\" \"$1\" 2>/dev/null || "
    "chown -hR \"$owner\" \"$1\"; fi; if [ -n \"$mode\" ] && [ ! -L \"$1\" ]; then chmod -R "
    "\"$mode\" \"$1\"; fi; }\n"
    "if [ -d \"$s\" ] && [ ! -L \"$s\" ]; then\n"
    "  if [ ! -d \"$dest\" ]; then mkdir -p \"$dest\"; [ -z \"$owner\" ] || chown "
    "\"$owner:$owner\" \"$dest\" 2>/dev/null || chown \"$owner\" \"$dest\"; fi\n"
    "  for e in \"$s\"/* \"$s\"/.[!.]* \"$s\"/..?*; do\n"
    "    [ -e \"$e\" ] || [ -L \"$e\" ] || continue\n"
    "    n=$(basename \"$e\"); cp -a \"$e\" \"$dest/\" && apply \"$dest/$n\"\n"
    "  done\n"
    "else\n"
    "  case $dest in */) mkdir -p \"$dest\"; dest=\"$dest$(basename \"$s\")\";; "
    "*) mkdir -p \"$(dirname \"$dest\")\";; esac\n"
    "  cp -a \"$s\" \"$dest\" && apply \"$dest\"\n"
    "fi\n";

static void copy_pump(struct build *b);

static void on_copy_writable(void *arg)
{
    copy_pump(arg);
}

static void on_copy_written(void *arg, json_t *entry, const sp_err_t *err)
{
    struct build *b = arg;
    (void)entry;
    b->op = NULL;
    if (b->copy_fd >= 0)
        close(b->copy_fd);
    b->copy_fd = -1;
    free(b->copy_buf);
    b->copy_buf = NULL;
    if (err != NULL) {
        b->failed_step = (int)b->step + 1;
        fail(b, "step %zu (copy): cannot put the files into the builder: %s", b->step + 1,
             err->msg);
        advance(b);
        return;
    }
    json_t *c = json_object_get(json_array_get(json_object_get(b->req, "steps"), b->step), "copy");
    const char *owner = json_string_value(json_object_get(c, "user"));
    const char *mode = json_string_value(json_object_get(c, "mode"));
    char path[128];
    snprintf(path, sizeof path, COPY_DIR "/%s", json_string_value(json_object_get(c, "files")));
    json_t *argv = json_pack("[s,s,s,s,s,s,s,s,s,s]", "/bin/sh", "-c", copy_script, "space-copy",
                             path, json_string_value(json_object_get(c, "src")),
                             json_string_value(json_object_get(c, "dest")),
                             owner && owner[0] ? owner : b->user, mode ? mode : "", b->workdir);
    run_cmd(b, argv, NULL, "root", "/", 0, NULL, 0);
    json_decref(argv);
}

static const sp_exec_write_cbs_t copy_cbs = {on_copy_writable, on_copy_written};

/* Offers the file's bytes while the agent takes them; ends the write at its end. */
static void copy_pump(struct build *b)
{
    while (b->op != NULL && b->copy_fd >= 0) {
        if (b->copy_off == b->copy_len) {
            ssize_t k = read(b->copy_fd, b->copy_buf, COPY_CHUNK);
            if (k < 0) {
                sp_exec_cancel(b->op);
                b->op = NULL;
                b->failed_step = (int)b->step + 1;
                fail(b, "step %zu (copy): cannot read the uploaded files: %s", b->step + 1,
                     strerror(errno));
                advance(b);
                return;
            }
            if (k == 0) {
                close(b->copy_fd);
                b->copy_fd = -1;
                sp_exec_write_end(b->op);
                return;
            }
            b->copy_off = 0;
            b->copy_len = (size_t)k;
        }
        long took = sp_exec_write_data(b->op, b->copy_buf + b->copy_off,
                                       b->copy_len - b->copy_off);
        if (took <= 0)
            return; /* on_writable, or on_done with the failure, follows */
        b->copy_off += (size_t)took;
    }
}

static void start_copy(struct build *b, const json_t *c)
{
    const char *key = json_string_value(json_object_get(c, "files"));
    char path[PATH_MAX], dest[128];
    sp_err_t e;
    logf_(b, "info", "COPY %s -> %s (files %.12s)", json_string_value(json_object_get(c, "src")),
          json_string_value(json_object_get(c, "dest")), key);
    sp_agentconn_t *conn = b->t->driver->ops->agent(b->t->driver, b->vm_id);
    snprintf(dest, sizeof dest, COPY_DIR "/%s", key);
    if (sp_tmplfiles_path(b->t->files, b->team, key, path, sizeof path, &e) < 0 ||
        (b->copy_fd = open(path, O_RDONLY | O_CLOEXEC)) < 0 ||
        (b->copy_buf = malloc(COPY_CHUNK)) == NULL || conn == NULL ||
        (b->op = sp_exec_write(b->t->loop, conn, dest, "root", 0600, true, &copy_cbs, b, &e)) ==
            NULL) {
        if (b->copy_fd < 0 && e.code == SP_OK)
            sp_err_set(&e, SP_EINTERNAL, "%s", strerror(errno));
        b->failed_step = (int)b->step + 1;
        fail(b, "step %zu (copy) could not start: %s", b->step + 1,
             conn == NULL ? "the builder VM has no agent channel" : e.msg);
        advance(b);
        return;
    }
    b->copy_off = b->copy_len = 0;
    copy_pump(b);
}

/* Runs the steps from b->step on, then writes the env file, syncs, and pauses. */
static void advance(struct build *b)
{
    if (b->failed) {
        destroy_vm(b);
        return;
    }
    b->ph = P_EXEC;
    json_t *steps = json_object_get(b->req, "steps");
    while (b->step < json_array_size(steps)) {
        json_t *s = json_array_get(steps, b->step);
        const char *kind = step_kind(s);
        logf_(b, "info", "step %zu/%zu: %s", b->step + 1, json_array_size(steps), kind);
        if (strcmp(kind, "env") == 0) {
            json_object_update(b->env, json_object_get(s, "env"));
        } else if (strcmp(kind, "user") == 0) {
            copy(b->user, sizeof b->user, json_string_value(json_object_get(s, "user")));
        } else if (strcmp(kind, "workdir") == 0) {
            copy(b->workdir, sizeof b->workdir,
                 json_string_value(json_object_get(s, "workdir")));
            /* as Dockerfile's WORKDIR: made if missing (by root, then given to the user) */
            json_t *mk = json_pack("[s,s,s,s,s,s]", "/bin/sh", "-c",
                                   "[ -d \"$1\" ] || { mkdir -p \"$1\" && chown \"$2\" \"$1\"; }",
                                   "space-workdir", b->workdir, b->user);
            run_cmd(b, mk, NULL, "root", "/", 60000, NULL, 0);
            json_decref(mk);
            return;
        } else if (strcmp(kind, "copy") == 0) {
            start_copy(b, json_object_get(s, "copy"));
            return;
        } else {
            const char *u = json_string_value(json_object_get(s, "user"));
            const char *w = json_string_value(json_object_get(s, "workdir"));
            int to = (int)json_integer_value(json_object_get(s, "timeout_s"));
            logf_(b, "info", "$ %s",
                  json_is_string(json_object_get(s, "run"))
                      ? json_string_value(json_object_get(s, "run"))
                      : "(argv)");
            run_cmd(b, json_object_get(s, "run"), json_object_get(s, "env"),
                    u ? u : b->user, w ? w : (b->workdir[0] ? b->workdir : NULL),
                    to > 0 ? (uint32_t)to * 1000u : 0, NULL, 0);
            return;
        }
        b->step++;
    }
    if (!b->finishing) {
        /* the template's env for start_cmd; sandboxes get it from the templates row */
        sp_buf_t f = {0};
        const char *k;
        json_t *v;
        json_object_foreach(b->env, k, v)
        {
            char head[300];
            snprintf(head, sizeof head, "%s='", k);
            sp_buf_add(&f, head, strlen(head));
            for (const char *p = json_string_value(v); *p; p++) {
                if (*p == '\'')
                    sp_buf_add(&f, "'\\''", 4);
                else
                    sp_buf_add(&f, p, 1);
            }
            sp_buf_add(&f, "'\n", 2);
        }
        b->finishing = true; /* the next exit is the env file's */
        json_t *w = json_pack("[s,s,s]", "/bin/sh", "-c",
                              "mkdir -p /etc/space && cat > " ENV_FILE " && sync");
        logf_(b, "info", "writing %s and syncing the disk", ENV_FILE);
        run_cmd(b, w, NULL, "root", "/", 120000, f.len > 0 ? (const void *)f.p : "", f.len);
        json_decref(w);
        sp_buf_free(&f);
        return;
    }
    pause_vm(b);
}

static void on_booted(void *arg, const sp_err_t *err)
{
    struct build *b = arg;
    b->ckpt_ms = sp_loop_now_ms(b->t->loop);
    if (err != NULL) {
        fail(b, "the builder VM did not start: %s", err->msg);
    } else {
        logf_(b, "info", "builder VM up in %.1f s",
              (double)(sp_loop_now_ms(b->t->loop) - b->t0) / 1000.0);
    }
    advance(b);
}

static void on_started(void *rec, PGresult *res, const sp_err_t *err)
{
    (void)res;
    struct build *b = *(struct build **)rec;
    if (err != NULL)
        sp_log(SP_LOG_WARN, "tmpl", "cannot mark build=%s started: %s", b->id, err->msg);
}

/* A version with these inputs exists: use it. */
static bool try_cached(struct build *b)
{
    char man[PATH_MAX];
    if (b->force ||
        pathf(man, sizeof man, "%s/templates/%s/%s/manifest.json", b->t->data_dir, b->name,
              b->hash) < 0 ||
        access(man, R_OK) < 0)
        return false;
    b->cached = true;
    logf_(b, "info", "version %.12s was built before with the same inputs: using it", b->hash);
    if (!has_default(b))
        return true;
    char cur[PATH_MAX], target[128];
    if (pathf(cur, sizeof cur, "%s/templates/%s/current", b->t->data_dir, b->name) == 0) {
        ssize_t n = readlink(cur, target, sizeof target - 1);
        copy(b->prev_current, sizeof b->prev_current, n > 0 ? (target[n] = '\0', target) : "");
    }
    if (set_current(b->t, b->name, b->hash) < 0)
        fail(b, "cannot make the version current: %s", strerror(errno));
    else
        b->swapped = true;
    return true;
}

static void start_vm(struct build *b);
static void input_hash(struct build *b);

/* ---- a parent from a container image (ociimg.h), pulled on a worker thread ---- */

static void import_run(sp_work_t *w, void *arg)
{
    struct impjob *j = arg;
    j->rc = sp_ociimg_import(&j->opts, j->data_dir, j->ref, j->user, j->pass, w, &j->res,
                             &j->err);
}

static void impjob_free(struct impjob *j)
{
    free(j->ref);
    wipe_free(j->user);
    wipe_free(j->pass);
    sp_ociimg_result_free(&j->res);
    free(j);
}

/* The image's config as steps before the build's own (as a Dockerfile's would be): its env,
 * its user, its workdir; its command as start_cmd unless the build has one. */
static void image_steps(struct build *b, const json_t *cfg)
{
    json_t *steps = json_object_get(b->req, "steps");
    json_t *pre = json_array();
    json_t *env = json_object_get(cfg, "env");
    const char *user = json_string_value(json_object_get(cfg, "user"));
    const char *wd = json_string_value(json_object_get(cfg, "workdir"));
    const char *start = json_string_value(json_object_get(cfg, "start_cmd"));
    if (json_is_object(env) && json_object_size(env) > 0)
        json_array_append_new(pre, json_pack("{s:O}", "env", env));
    if (user != NULL && valid_user(user))
        json_array_append_new(pre, json_pack("{s:s}", "user", user));
    if (wd != NULL && wd[0] == '/' && strlen(wd) <= SP_EXEC_PATH_MAX)
        json_array_append_new(pre, json_pack("{s:s}", "workdir", wd));
    json_array_extend(pre, steps);
    json_object_set_new(b->req, "steps", pre);
    if (start != NULL && start[0] != '\0' && json_object_get(b->req, "start_cmd") == NULL)
        json_object_set_new(b->req, "start_cmd", json_string(start));
}

static void on_imported(void *arg, bool cancelled)
{
    struct impjob *j = arg;
    struct build *b = j->b;
    if (b == NULL) { /* the build is gone */
        impjob_free(j);
        return;
    }
    b->imp = NULL;
    size_t i;
    json_t *l;
    json_array_foreach(j->res.log, i, l) logf_(b, "info", "%s", json_string_value(l));
    sp_err_t e;
    if (cancelled || b->failed) {
        fail(b, "the image pull was stopped");
    } else if (j->rc < 0) {
        fail(b, "image %s: %s", b->image, j->err.msg);
    } else if (sp_tmplbuild_current(b->t->data_dir, j->res.tmpl, &b->pp, &e) < 0) {
        fail(b, "image %s: its template is not usable: %s", b->image, e.msg);
    } else {
        copy(b->parent, sizeof b->parent, j->res.tmpl);
        logf_(b, "info", "image %s %s in %.1f s (template %s)", j->res.ref,
              j->res.cached ? "found in the digest cache" : "imported", j->res.seconds,
              j->res.tmpl);
        image_steps(b, j->res.config);
        json_t *f = json_object_get(b->req, "from");
        if (json_is_object(f))
            json_object_set_new(f, "digest", json_string(j->res.digest));
        input_hash(b);
    }
    impjob_free(j);
    if (b->failed) {
        record_end(b);
        return;
    }
    logf_(b, "info", "building %s from %s (version %.12s)", b->name, b->parent, b->pp.hash);
    start_vm(b);
}

static void start_import(struct build *b)
{
    sp_tmpl_t *t = b->t;
    b->ph = P_IMPORT;
    struct impjob *j = calloc(1, sizeof(*j));
    if (j != NULL) {
        j->b = b;
        j->opts = (sp_ociimg_opts_t){.agent_path = t->agent,
                                     .mirror = t->mirror,
                                     .insecure = t->insecure,
                                     .max_bytes = t->image_max};
        copy(j->data_dir, sizeof j->data_dir, t->data_dir);
        j->ref = strdup(b->image);
        j->user = b->reg_user; /* handed over: the build keeps no credentials */
        j->pass = b->reg_pass;
        b->reg_user = b->reg_pass = NULL;
    }
    logf_(b, "info", "pulling the image %s", b->image);
    if (j == NULL || j->ref == NULL ||
        (j->work = sp_loop_work(t->loop, SP_WORK_LONG, import_run, on_imported, j)) == NULL) {
        if (j != NULL)
            impjob_free(j);
        fail(b, "cannot start the image pull: out of memory");
        record_end(b);
        return;
    }
    b->imp = j;
}

static void start_build(struct build *b)
{
    sp_tmpl_t *t = b->t;
    b->ph = P_BOOT;
    b->t0 = sp_loop_now_ms(t->loop);
    sp_timer_start(&b->deadline, (uint64_t)b->timeout_s * 1000u);
    const char *p[] = {b->id};
    sp_err_t e;
    void *rec = sp_store_call(t->store,
                              /* only from queued: the statement that records the end may
                               * run first on another connection (a cached build ends at once) */
                              "UPDATE template_builds SET status = 'building', started_at = now()"
                              " WHERE id = $1 AND status = 'queued'",
                              1, p, sizeof(struct build *), on_started, &e);
    if (rec != NULL)
        *(struct build **)rec = b;
    if (b->image != NULL) {
        start_import(b);
        return;
    }
    logf_(b, "info", "building %s from %s (version %.12s)", b->name, b->parent, b->pp.hash);
    start_vm(b);
}

/* The parent is known (b->pp) and the input hash made: a cached version, or the builder. */
static void start_vm(struct build *b)
{
    sp_tmpl_t *t = b->t;
    sp_err_t e;
    if (try_cached(b)) {
        if (b->failed)
            record_end(b);
        else
            take_snapshot(b);
        return;
    }
    char wdir[PATH_MAX];
    work_dir(b, wdir, sizeof wdir);
    rm_rf(wdir);
    if (wdir[0] == '\0' || mkdir(wdir, 0755) < 0) {
        fail(b, "cannot make the build's work dir: %s", strerror(errno));
        record_end(b);
        return;
    }
    sp_vm_spec_t spec = {.sandbox_id = b->vm_id,
                         .template_name = b->parent,
                         .cpu_count = b->cpu_count,
                         .memory_mb = b->memory_mb,
                         .hostname = "build",
                         .env_json = NULL};
    /* the step cache: the builder of an earlier build with the same first steps, as it was
     * after them; only the rest run */
    char cid[SP_TMPLCACHE_ID_LEN + 1];
    json_t *steps = json_object_get(b->req, "steps");
    size_t n = b->force ? 0
                        : sp_tmplcache_find(t->driver, b->team, b->pp.hash, b->cpu_count,
                                            b->memory_mb, steps, json_array_size(steps), cid);
    if (n > 0) {
        spec.snapshot_id = cid;
        for (size_t i = 0; i < n; i++) { /* what the skipped steps set, without running them */
            json_t *st = json_array_get(steps, i);
            const char *kind = step_kind(st);
            if (strcmp(kind, "env") == 0)
                json_object_update(b->env, json_object_get(st, "env"));
            else if (strcmp(kind, "user") == 0)
                copy(b->user, sizeof b->user, json_string_value(json_object_get(st, "user")));
            else if (strcmp(kind, "workdir") == 0)
                copy(b->workdir, sizeof b->workdir,
                     json_string_value(json_object_get(st, "workdir")));
            logf_(b, "info", "step %zu/%zu: %s: cached", i + 1, json_array_size(steps), kind);
        }
        b->step = n;
        logf_(b, "info", "steps 1-%zu: cached: the builder starts as an earlier build left it "
                         "after them",
              n);
    }
    b->vm_up = true;
    if (t->driver == NULL) {
        sp_err_set(&e, SP_ERUNTIME, "no microVM runtime");
        b->vm_up = false;
        on_booted(b, &e);
    } else if (t->driver->ops->boot(t->driver, &spec, on_booted, b, &e) < 0) {
        b->vm_up = false;
        on_booted(b, &e);
    }
}

static void start_queued(sp_tmpl_t *t)
{
    int running = 0;
    for (struct build *b = t->builds; b != NULL; b = b->next)
        running += b->ph > P_QUEUED;
    /* oldest first: the list has the newest at its head */
    while (running < SP_TMPL_BUILDS) {
        struct build *pick = NULL;
        for (struct build *b = t->builds; b != NULL; b = b->next) {
            if (b->ph != P_QUEUED)
                continue;
            int team = 0;
            for (struct build *o = t->builds; o != NULL; o = o->next)
                team += o->ph > P_QUEUED && strcmp(o->team, b->team) == 0;
            if (team < SP_TMPL_TEAM_BUILDS)
                pick = b;
        }
        if (pick == NULL)
            return;
        running++;
        start_build(pick);
    }
}

/* ---- versions: which are in use, the others removed ---- */

/* Whether the file at path mentions needle (vm.json files are a few hundred bytes). */
static bool file_mentions(const char *path, const char *needle)
{
    FILE *f = fopen(path, "re");
    if (f == NULL)
        return false;
    char buf[16384];
    size_t n = fread(buf, 1, sizeof buf - 1, f);
    fclose(f);
    buf[n] = '\0';
    return strstr(buf, needle) != NULL;
}

/* What the runtime holds of the version dir vdir ("<data>/templates/<name>/<hash>"): a VM
 * (running, suspended, a spare or a builder) or a sandbox snapshot whose vm.json names a file
 * in it. Step cache entries (tmplcache.h) naming it are deleted instead: no build will start
 * from a version that is gone, and the same inputs made again later make new files. */
static bool runtime_uses(sp_tmpl_t *t, const char *vdir)
{
    char needle[PATH_MAX];
    if (pathf(needle, sizeof needle, "%s/", vdir) < 0)
        return true;
    static const char *const dirs[] = {"vms", "snapshots"};
    bool used = false;
    for (int k = 0; k < 2 && !used; k++) {
        char dir[PATH_MAX];
        if (pathf(dir, sizeof dir, "%s/%s", t->data_dir, dirs[k]) < 0)
            return true;
        DIR *d = opendir(dir);
        if (d == NULL) {
            if (errno != ENOENT)
                return true;
            continue;
        }
        struct dirent *de;
        while (!used && (de = readdir(d)) != NULL) {
            char p[PATH_MAX];
            if (strcmp(de->d_name, ".") == 0 || strcmp(de->d_name, "..") == 0 ||
                pathf(p, sizeof p, "%s/%s/vm.json", dir, de->d_name) < 0 ||
                !file_mentions(p, needle))
                continue;
            sp_err_t e;
            if (k == 1 && strncmp(de->d_name, "bc-", 3) == 0 && t->driver != NULL &&
                t->driver->ops->checkpoint_delete != NULL &&
                t->driver->ops->checkpoint_delete(t->driver, de->d_name, &e) == 0)
                continue;
            used = true;
        }
        closedir(d);
    }
    return used;
}

/* Whether a version of any template on disk was built on name's version hash (its rootfs is
 * a layer over the parent's). */
static bool is_parent(sp_tmpl_t *t, const char *name, const char *hash)
{
    char tdir[PATH_MAX];
    if (pathf(tdir, sizeof tdir, "%s/templates", t->data_dir) < 0)
        return true;
    DIR *d = opendir(tdir);
    if (d == NULL)
        return true;
    bool used = false;
    struct dirent *de;
    while (!used && (de = readdir(d)) != NULL) {
        char p[PATH_MAX];
        if (de->d_name[0] == '.' || pathf(p, sizeof p, "%s/%s", tdir, de->d_name) < 0)
            continue;
        DIR *vd = opendir(p);
        struct dirent *ve;
        while (!used && vd != NULL && (ve = readdir(vd)) != NULL) {
            char m[PATH_MAX];
            if (strlen(ve->d_name) != SP_TMPLBUILD_HASH_LEN ||
                pathf(m, sizeof m, "%s/%s/manifest.json", p, ve->d_name) < 0)
                continue;
            json_t *man = json_load_file(m, 0, NULL);
            const char *pn = json_string_value(json_object_get(man, "parent"));
            const char *ph =
                json_string_value(json_object_get(json_object_get(man, "spec"), "parent_hash"));
            used = pn != NULL && ph != NULL && strcmp(pn, name) == 0 && strcmp(ph, hash) == 0;
            json_decref(man);
        }
        if (vd != NULL)
            closedir(vd);
    }
    closedir(d);
    return used;
}

struct collect {
    sp_tmpl_t *t;
    char name[65];
};

static void on_version_row_deleted(void *rec, PGresult *res, const sp_err_t *err)
{
    (void)rec;
    (void)res;
    if (err != NULL)
        sp_log(SP_LOG_WARN, "tmpl", "version row not deleted err=%s", err->msg);
}

/* The versions of q->name in use were read (column 0: a version needed by every version, when
 * sandboxes older than versions use the template; 1: the hashes in use): every other version
 * on disk that nothing else holds is removed, with its row. */
static void on_in_use(void *rec, PGresult *res, const sp_err_t *err)
{
    struct collect *q = rec;
    sp_tmpl_t *t = q->t;
    if (err != NULL || PQntuples(res) != 1) {
        sp_log(SP_LOG_WARN, "tmpl", "template versions not collected template=%s err=%s",
               q->name, err != NULL ? err->msg : "no answer");
        return;
    }
    if (PQgetvalue(res, 0, 0)[0] == 't')
        return; /* sandboxes of unknown versions: keep them all */
    for (struct build *b = t->builds; b != NULL; b = b->next)
        if (strcmp(b->name, q->name) == 0)
            return; /* its version is not recorded yet: the next collection */
    const char *in_use = PQgetvalue(res, 0, 1); /* "{h1,h2}" */
    char tdir[PATH_MAX], cur[PATH_MAX], target[128] = "";
    if (pathf(tdir, sizeof tdir, "%s/templates/%s", t->data_dir, q->name) < 0 ||
        pathf(cur, sizeof cur, "%s/current", tdir) < 0)
        return;
    ssize_t n = readlink(cur, target, sizeof target - 1);
    target[n > 0 ? n : 0] = '\0';
    DIR *d = opendir(tdir);
    struct dirent *de;
    int removed = 0;
    while (d != NULL && (de = readdir(d)) != NULL) {
        const char *h = de->d_name;
        char vdir[PATH_MAX];
        if (strlen(h) != SP_TMPLBUILD_HASH_LEN || strspn(h, "0123456789abcdef") != strlen(h) ||
            strstr(in_use, h) != NULL || strcmp(h, target) == 0 ||
            pathf(vdir, sizeof vdir, "%s/%s", tdir, h) < 0)
            continue;
        bool building = false; /* a build of another template on it */
        for (struct build *b = t->builds; b != NULL; b = b->next)
            building = building || (strcmp(b->parent, q->name) == 0 && strcmp(b->pp.hash, h) == 0);
        if (building || is_parent(t, q->name, h) || runtime_uses(t, vdir))
            continue;
        sp_log(SP_LOG_INFO, "tmpl", "removing unused template version template=%s version=%.12s",
               q->name, h);
        rm_rf(vdir);
        removed++;
        const char *p[] = {q->name, h};
        sp_err_t e;
        if (sp_store_call(t->store,
                          "DELETE FROM template_versions v WHERE template = $1 AND hash = $2"
                          " AND NOT EXISTS (SELECT 1 FROM template_tags g"
                          "  WHERE g.template = $1 AND g.hash = $2)",
                          2, p, 1, on_version_row_deleted, &e) == NULL)
            sp_log(SP_LOG_WARN, "tmpl", "version row not deleted template=%s err=%s", q->name,
                   e.msg);
    }
    if (d != NULL)
        closedir(d);
    if (removed > 0)
        sp_log(SP_LOG_INFO, "tmpl", "template versions collected template=%s removed=%d", q->name,
               removed);
}

/* Removes name's versions nothing uses (tmpl.h: versions). Asynchronous; logged. */
static void collect(sp_tmpl_t *t, const char *name)
{
    const char *p[] = {name};
    sp_err_t e;
    struct collect *q = sp_store_call(
        t->store,
        "SELECT EXISTS (SELECT 1 FROM sandboxes s WHERE s.template = $1"
        "  AND s.observed_state <> 'deleted' AND s.template_version IS NULL"
        "  AND s.snapshot_id IS NULL),"
        " coalesce(array_agg(DISTINCT h), '{}')::text FROM ("
        "  SELECT hash AS h FROM template_tags WHERE template = $1"
        "  UNION ALL SELECT template_version FROM sandboxes WHERE template = $1"
        "   AND observed_state <> 'deleted' AND template_version IS NOT NULL"
        "  UNION ALL SELECT x.template_version FROM snapshots n JOIN sandboxes x"
        "   ON x.id = n.sandbox_id WHERE n.template = $1 AND n.deleted_at IS NULL"
        "   AND x.template_version IS NOT NULL) u"
        " WHERE EXISTS (SELECT 1 FROM templates WHERE name = $1 AND team_id IS NOT NULL)",
        1, p, sizeof(*q), on_in_use, &e);
    if (q == NULL) {
        sp_log(SP_LOG_WARN, "tmpl", "template versions not collected template=%s err=%s", name,
               e.msg);
        return;
    }
    q->t = t;
    copy(q->name, sizeof q->name, name);
}

static void on_team_templates(void *rec, PGresult *res, const sp_err_t *err)
{
    sp_tmpl_t *t = *(sp_tmpl_t **)rec;
    if (err != NULL)
        return;
    for (int i = 0; i < PQntuples(res); i++)
        collect(t, PQgetvalue(res, i, 0));
}

/* ---- tags ---- */

/* A tag's answer: the tag's row, or why not (columns: error code, message). */
struct tagreq {
    sp_tmpl_t *t;
    char name[65];
    bool is_default; /* `current` follows the default tag */
    sp_tmpl_tag_cb cb;
    void *arg;
};

static void on_tag_set(void *rec, PGresult *res, const sp_err_t *err)
{
    struct tagreq *q = rec;
    sp_err_t e;
    const sp_err_t *why = sp_store_one_row(res, err, SP_EINTERNAL, "no answer", &e);
    if (why == NULL && PQgetvalue(res, 0, 0)[0] != '\0') {
        const char *code = PQgetvalue(res, 0, 0);
        sp_err_set(&e, strcmp(code, "conflict") == 0 ? SP_ECONFLICT : SP_ENOTFOUND, "%s",
                   PQgetvalue(res, 0, 1));
        why = &e;
    }
    if (why != NULL) {
        q->cb(q->arg, NULL, why);
        return;
    }
    sp_tmpl_tag_rec_t r;
    memset(&r, 0, sizeof r);
    copy(r.template_name, sizeof r.template_name, q->name);
    SP_STORE_TEXT(res, 0, 2, r.hash);
    SP_STORE_TEXT(res, 0, 3, r.build_id);
    SP_STORE_TEXT(res, 0, 4, r.created_at);
    if (q->is_default && set_current(q->t, q->name, r.hash) < 0)
        sp_log(SP_LOG_ERROR, "tmpl", "cannot point current at the default tag template=%s",
               q->name);
    collect(q->t, q->name);
    q->cb(q->arg, &r, NULL);
}

int sp_tmpl_tags_set(sp_tmpl_t *t, const sp_auth_t *a, const char *name, const json_t *tags,
                     const char *version, const char *from_tag, sp_tmpl_tag_cb cb, void *arg,
                     sp_err_t *err)
{
    if (!sp_tmplbuild_valid_name(name))
        return sp_err_set(err, SP_ENOTFOUND, "template '%.64s' not found", name);
    if (!json_is_array(tags) || json_array_size(tags) == 0 ||
        json_array_size(tags) > SP_TMPL_TAGS_MAX)
        return sp_err_set(err, SP_EINVAL, "tags must be 1 to %d tags", SP_TMPL_TAGS_MAX);
    bool is_default = false;
    size_t i;
    json_t *v;
    json_array_foreach(tags, i, v)
    {
        if (!json_is_string(v) || !sp_tmpl_valid_tag(json_string_value(v)))
            return sp_err_set(err, SP_EINVAL, "bad tag '%.64s': 1 to %d of [a-z0-9._-], not a UUID",
                              json_is_string(v) ? json_string_value(v) : "", SP_TMPL_TAG_MAX);
        is_default = is_default || strcmp(json_string_value(v), "default") == 0;
    }
    if ((version == NULL) == (from_tag == NULL))
        return sp_err_set(err, SP_EINVAL, "give either version or from_tag");
    if (version != NULL && (strlen(version) < 8 || strlen(version) > SP_TMPLBUILD_HASH_LEN ||
                            strspn(version, "0123456789abcdef") != strlen(version)))
        return sp_err_set(err, SP_EINVAL, "version must be a version's hash (at least 8 of its "
                                          "hex digits)");
    if (from_tag != NULL && !sp_tmpl_valid_tag(from_tag))
        return sp_err_set(err, SP_EINVAL, "bad tag '%.64s'", from_tag);
    for (struct build *o = t->builds; o != NULL; o = o->next)
        if (strcmp(o->name, name) == 0 && strcmp(o->team, a->team_id) == 0)
            return sp_err_set(err, SP_ECONFLICT, "template '%s' is being built (build %s)", name,
                              o->id);
    char *tj = json_dumps(tags, JSON_COMPACT);
    if (tj == NULL)
        return sp_err_set(err, SP_EINTERNAL, "out of memory");
    const char *p[] = {name, a->team_id, version, from_tag, tj, is_default ? "true" : "false"};
    /* The version: by hash (a unique prefix) or the one from_tag names; then every tag moved to
     * it, and the templates row follows when the default tag moves. */
    struct tagreq *q = sp_store_call(
        t->store,
        "WITH m AS (SELECT name FROM templates WHERE name = $1 AND team_id = $2"
        "  AND deleted_at IS NULL),"
        " c AS (SELECT v.* FROM template_versions v, m WHERE v.template = m.name"
        "  AND (($3::text IS NOT NULL AND v.hash LIKE $3 || '%') OR ($4::text IS NOT NULL"
        "  AND v.hash = (SELECT hash FROM template_tags WHERE template = $1 AND tag = $4)))),"
        " ok AS (SELECT * FROM c WHERE (SELECT count(*) FROM c) = 1),"
        " g AS (INSERT INTO template_tags (template, tag, hash)"
        "  SELECT ok.template, x, ok.hash FROM ok, jsonb_array_elements_text($5::jsonb) x"
        "  ON CONFLICT (template, tag) DO UPDATE SET hash = EXCLUDED.hash, created_at = now()"
        "  RETURNING created_at),"
        " u AS (UPDATE templates SET build_id = ok.hash, cpu_count = ok.cpu_count,"
        "  memory_mb = ok.memory_mb, env = ok.env, updated_at = now() FROM ok"
        "  WHERE $6::bool AND templates.name = ok.template RETURNING 1)"
        " SELECT CASE WHEN NOT EXISTS (SELECT 1 FROM m) THEN 'notfound'"
        "  WHEN (SELECT count(*) FROM c) > 1 THEN 'conflict'"
        "  WHEN NOT EXISTS (SELECT 1 FROM c) THEN 'notfound' ELSE '' END,"
        "  CASE WHEN NOT EXISTS (SELECT 1 FROM m) THEN format('template ''%s'' not found', $1)"
        "  WHEN (SELECT count(*) FROM c) > 1 THEN format('version ''%s'' is ambiguous: give more"
        "  of its digits', $3)"
        "  WHEN $4::text IS NOT NULL THEN format('tag ''%s'' does not exist for template ''%s''',"
        "  $4, $1) ELSE format('version ''%s'' of template ''%s'' not found', $3, $1) END,"
        "  coalesce((SELECT hash FROM ok), ''), coalesce((SELECT build_id FROM ok), ''),"
        "  coalesce((SELECT " TS("max(created_at)") " FROM g), ''),"
        "  (SELECT count(*) FROM u)",
        6, p, sizeof(*q), on_tag_set, err);
    free(tj);
    if (q == NULL)
        return -1;
    q->t = t;
    copy(q->name, sizeof q->name, name);
    q->is_default = is_default;
    q->cb = cb;
    q->arg = arg;
    return 0;
}

struct untagreq {
    sp_tmpl_t *t;
    char name[65];
    sp_svc_done_cb cb;
    void *arg;
};

static void on_untagged(void *rec, PGresult *res, const sp_err_t *err)
{
    struct untagreq *q = rec;
    sp_err_t e;
    const sp_err_t *why = sp_store_one_row(res, err, SP_EINTERNAL, "no answer", &e);
    if (why == NULL && PQgetvalue(res, 0, 0)[0] != 't')
        why = (sp_err_set(&e, SP_ENOTFOUND, "template '%s' not found", q->name), &e);
    else if (why == NULL && PQgetvalue(res, 0, 1)[0] != '\0')
        why = (sp_err_set(&e, SP_ENOTFOUND, "tag '%s' does not exist for template '%s'",
                          PQgetvalue(res, 0, 1), q->name),
               &e);
    if (why == NULL)
        collect(q->t, q->name);
    q->cb(q->arg, why);
}

int sp_tmpl_tags_delete(sp_tmpl_t *t, const sp_auth_t *a, const char *name, const json_t *tags,
                        sp_svc_done_cb cb, void *arg, sp_err_t *err)
{
    if (!sp_tmplbuild_valid_name(name))
        return sp_err_set(err, SP_ENOTFOUND, "template '%.64s' not found", name);
    if (!json_is_array(tags) || json_array_size(tags) == 0 ||
        json_array_size(tags) > SP_TMPL_TAGS_MAX)
        return sp_err_set(err, SP_EINVAL, "tags must be 1 to %d tags", SP_TMPL_TAGS_MAX);
    size_t i;
    json_t *v;
    json_array_foreach(tags, i, v)
    {
        if (!json_is_string(v) || !sp_tmpl_valid_tag(json_string_value(v)))
            return sp_err_set(err, SP_EINVAL, "bad tag '%.64s'",
                              json_is_string(v) ? json_string_value(v) : "");
        if (strcmp(json_string_value(v), "default") == 0)
            return sp_err_set(err, SP_EINVAL,
                              "the default tag cannot be removed (move it, or delete the "
                              "template)");
    }
    char *tj = json_dumps(tags, JSON_COMPACT);
    if (tj == NULL)
        return sp_err_set(err, SP_EINTERNAL, "out of memory");
    const char *p[] = {name, a->team_id, tj};
    /* all or nothing: a tag that does not exist deletes none */
    struct untagreq *q = sp_store_call(
        t->store,
        "WITH m AS (SELECT name FROM templates WHERE name = $1 AND team_id = $2"
        "  AND deleted_at IS NULL),"
        " w AS (SELECT x AS tag FROM jsonb_array_elements_text($3::jsonb) x),"
        " miss AS (SELECT min(tag) AS tag FROM w WHERE NOT EXISTS (SELECT 1 FROM template_tags g"
        "  WHERE g.template = $1 AND g.tag = w.tag)),"
        " d AS (DELETE FROM template_tags g USING m WHERE g.template = m.name"
        "  AND g.tag IN (SELECT tag FROM w) AND (SELECT tag FROM miss) IS NULL RETURNING 1)"
        " SELECT EXISTS (SELECT 1 FROM m), coalesce((SELECT tag FROM miss), ''),"
        "  (SELECT count(*) FROM d)",
        3, p, sizeof(*q), on_untagged, err);
    free(tj);
    if (q == NULL)
        return -1;
    q->t = t;
    copy(q->name, sizeof q->name, name);
    q->cb = cb;
    q->arg = arg;
    return 0;
}

static void on_versions(void *rec, PGresult *res, const sp_err_t *err)
{
    sp_store_req_t *q = rec;
    sp_tmpl_t *t = q->owner;
    sp_tmpl_json_cb cb = (sp_tmpl_json_cb)q->cb;
    sp_err_t e;
    const sp_err_t *why = sp_store_one_row(res, err, SP_ENOTFOUND, "template not found", &e);
    json_t *doc = why == NULL ? json_loads(PQgetvalue(res, 0, 0), 0, NULL) : NULL;
    if (why == NULL && doc == NULL)
        why = (sp_err_set(&e, SP_EINTERNAL, "bad versions document"), &e);
    if (why != NULL) {
        cb(q->arg, NULL, why);
        return;
    }
    /* sizes from disk: the version's own layer (its rootfs.qcow2) */
    const char *name = json_string_value(json_object_get(doc, "name"));
    size_t i;
    json_t *v;
    json_array_foreach(json_object_get(doc, "versions"), i, v)
    {
        const char *h = json_string_value(json_object_get(v, "version"));
        char p[PATH_MAX];
        struct stat st;
        bool on_disk = name != NULL && h != NULL &&
                       pathf(p, sizeof p, "%s/templates/%s/%s/rootfs.qcow2", t->data_dir, name,
                             h) == 0 &&
                       stat(p, &st) == 0;
        json_object_set_new(v, "size_bytes",
                            on_disk ? json_integer((json_int_t)st.st_blocks * 512) : json_null());
        json_object_set_new(v, "on_disk", json_boolean(on_disk));
    }
    cb(q->arg, doc, NULL);
    json_decref(doc);
}

int sp_tmpl_versions(sp_tmpl_t *t, const sp_auth_t *a, const char *name, sp_tmpl_json_cb cb,
                     void *arg, sp_err_t *err)
{
    if (!sp_tmplbuild_valid_name(name))
        return sp_err_set(err, SP_ENOTFOUND, "template not found");
    const char *p[] = {name, a->team_id};
    return sp_store_submit(
        t->store,
        "SELECT json_build_object('name', m.name,"
        " 'tags', coalesce((SELECT json_agg(json_build_object('tag', g.tag, 'version', g.hash,"
        "  'build_id', v.build_id, 'created_at', " TS("g.created_at") ") ORDER BY g.tag)"
        "  FROM template_tags g JOIN template_versions v ON v.template = g.template"
        "  AND v.hash = g.hash WHERE g.template = m.name), '[]'::json),"
        " 'versions', coalesce((SELECT json_agg(json_build_object('version', v.hash,"
        "  'build_id', v.build_id, 'created_at', " TS("v.created_at") ","
        "  'cpu_count', v.cpu_count, 'memory_mb', v.memory_mb,"
        "  'tags', coalesce((SELECT json_agg(g.tag ORDER BY g.tag) FROM template_tags g"
        "   WHERE g.template = v.template AND g.hash = v.hash), '[]'::json),"
        "  'sandboxes', (SELECT count(*) FROM sandboxes s WHERE s.template = v.template"
        "   AND s.template_version = v.hash AND s.observed_state <> 'deleted'))"
        "  ORDER BY v.created_at DESC) FROM template_versions v WHERE v.template = m.name),"
        "  '[]'::json),"
        " 'builds', coalesce((SELECT json_agg(json_build_object('id', b.id, 'status', b.status,"
        "  'version', b.hash, 'tags', b.request->'tags', 'created_at', " TS("b.created_at") ","
        "  'error', b.error) ORDER BY b.created_at DESC) FROM (SELECT * FROM template_builds b"
        "  WHERE b.template = m.name AND b.team_id = $2 ORDER BY b.created_at DESC LIMIT 20) b),"
        "  '[]'::json))::text"
        " FROM templates m WHERE m.name = $1 AND m.team_id = $2 AND m.deleted_at IS NULL",
        2, p, on_versions, t, (void *)cb, arg, 0, err);
}

/* ---- the API ---- */

struct accept {
    struct build *b;
    sp_tmpl_build_cb cb;
    void *arg;
};

static void on_accepted(void *rec, PGresult *res, const sp_err_t *err)
{
    struct accept *a = rec;
    struct build *b = a->b;
    sp_err_t e;
    const sp_err_t *why = sp_store_one_row(res, err, SP_EINTERNAL, "no answer", &e);
    if (why == NULL && PQgetvalue(res, 0, 0)[0] == '0')
        why = (sp_err_set(&e, SP_ENOTFOUND, "parent template '%s' not found (or not built)",
                          b->parent),
               &e);
    else if (why == NULL && PQgetvalue(res, 0, 1)[0] == '0')
        why = (sp_err_set(&e, SP_ECONFLICT, "template name '%s' is taken", b->name), &e);
    else if (why == NULL && PQgetvalue(res, 0, 2)[0] == '\0')
        why = (sp_err_set(&e, SP_ENOTFOUND, "build %s of '%s' not found (or already started)",
                          b->id, b->name),
               &e);
    if (why != NULL) {
        if (b->log_fd >= 0) {
            char p[PATH_MAX];
            if (pathf(p, sizeof p, "%s/builds/%s.ndjson", b->t->data_dir, b->id) == 0)
                unlink(p);
        }
        build_free(b);
        a->cb(a->arg, NULL, why);
        return;
    }
    json_t *tags = json_loads(PQgetvalue(res, 0, 3), 0, NULL);
    if (json_is_array(tags) && json_array_size(tags) > 0)
        json_object_set(b->req, "tags", tags);
    json_decref(tags);
    sp_tmpl_build_rec_t r;
    memset(&r, 0, sizeof r);
    copy(r.id, sizeof r.id, b->id);
    copy(r.template_name, sizeof r.template_name, b->name);
    copy(r.status, sizeof r.status, "queued");
    copy(r.created_at, sizeof r.created_at, PQgetvalue(res, 0, 2));
    a->cb(a->arg, &r, NULL);
    b->ph = P_QUEUED;
    start_queued(b->t);
}

/* SHA-256 of the parent's version and the inputs that shape the image and its snapshot. */
static void input_hash(struct build *b)
{
    json_t *in = json_pack("{s:s,s:O,s:O,s:O,s:i,s:i,s:i}", "parent_hash", b->pp.hash, "steps",
                           json_object_get(b->req, "steps"), "start_cmd",
                           json_object_get(b->req, "start_cmd") ?: json_null(), "ready_cmd",
                           json_object_get(b->req, "ready_cmd") ?: json_null(), "ready_timeout_s",
                           b->ready_s, "cpu_count", b->cpu_count, "memory_mb", b->memory_mb);
    if (b->force) /* a forced build makes a version of its own */
        json_object_set_new(in, "build", json_string(b->id));
    char *s = json_dumps(in, JSON_COMPACT | JSON_SORT_KEYS);
    json_decref(in);
    unsigned char h[crypto_hash_sha256_BYTES];
    crypto_hash_sha256(h, (const unsigned char *)(s ? s : ""), s ? strlen(s) : 0);
    free(s);
    for (size_t i = 0; i < sizeof h; i++)
        snprintf(b->hash + 2 * i, 3, "%02x", h[i]);
}

int sp_tmpl_build(sp_tmpl_t *t, const sp_auth_t *a, const json_t *req, sp_tmpl_build_cb cb,
                  void *arg, sp_err_t *err)
{
    return sp_tmpl_build_reserved(t, a, req, NULL, cb, arg, err);
}

static int build_req(sp_tmpl_t *t, const sp_auth_t *a, const json_t *req, const char *reserved,
                     sp_tmpl_build_cb cb, void *arg, sp_err_t *err);

/* from {"dockerfile", "context"?, "auth"?}: the request with the Dockerfile's parent (a template,
 * or an image with auth's credentials), its steps before
 * the request's own, and its start command unless the request has one. */
int sp_tmpl_build_reserved(sp_tmpl_t *t, const sp_auth_t *a, const json_t *req,
                           const char *reserved, sp_tmpl_build_cb cb, void *arg, sp_err_t *err)
{
    json_t *from = json_object_get(req, "from");
    json_t *df = json_object_get(from, "dockerfile");
    if (!json_is_object(from) || df == NULL)
        return build_req(t, a, req, reserved, cb, arg, err);
    json_t *ctx = json_object_get(from, "context");
    const char *key;
    json_t *v;
    json_object_foreach(from, key, v) if (strcmp(key, "dockerfile") != 0 &&
                                          strcmp(key, "context") != 0 &&
                                          strcmp(key, "auth") != 0) return
        sp_err_set(err, SP_EINVAL, "from: unknown field '%.64s' beside dockerfile", key);
    if (!json_is_string(df))
        return sp_err_set(err, SP_EINVAL, "from.dockerfile must be the Dockerfile's text");
    if (ctx != NULL && (!json_is_string(ctx) || !sp_tmplfiles_valid_key(json_string_value(ctx))))
        return sp_err_set(err, SP_EINVAL,
                          "from.context must be the key of uploaded files (64 hex characters)");
    json_t *steps = json_object_get(req, "steps");
    if (steps != NULL && !json_is_array(steps))
        return sp_err_set(err, SP_EINVAL, "steps must be an array");
    sp_dockerfile_t d;
    if (sp_dockerfile_parse(json_string_value(df), json_string_length(df),
                            ctx ? json_string_value(ctx) : NULL, &d, err) < 0)
        return -1;
    json_t *r = json_deep_copy(req);
    if (steps != NULL)
        json_array_extend(d.steps, steps);
    if (d.image[0] != '\0') { /* FROM an image: its registry's credentials come along */
        json_t *f = json_pack("{s:s}", "image", d.image);
        if (json_object_get(from, "auth") != NULL)
            json_object_set(f, "auth", json_object_get(from, "auth"));
        json_object_set_new(r, "from", f);
    } else if (json_object_get(from, "auth") != NULL) {
        sp_dockerfile_free(&d);
        json_decref(r);
        return sp_err_set(err, SP_EINVAL, "from.auth is for a Dockerfile FROM an image");
    } else {
        json_object_set_new(r, "from", json_string(d.parent));
    }
    json_object_set(r, "steps", d.steps);
    if (d.start_cmd != NULL && json_object_get(r, "start_cmd") == NULL)
        json_object_set_new(r, "start_cmd", json_string(d.start_cmd));
    sp_dockerfile_free(&d);
    int rc = build_req(t, a, r, reserved, cb, arg, err);
    json_decref(r);
    return rc;
}

/* from {"image": ref, "auth": {"username", "password"}}: the reference and credentials. */
static int image_from(const json_t *from, const char **image, const char **user,
                      const char **pass, sp_err_t *err)
{
    const char *key;
    json_t *v;
    json_object_foreach((json_t *)from, key, v) if (strcmp(key, "image") != 0 &&
                                                    strcmp(key, "auth") != 0) return
        sp_err_set(err, SP_EINVAL, "from: unknown field '%.64s' beside image", key);
    json_t *img = json_object_get(from, "image");
    if (!json_is_string(img) || json_string_length(img) == 0 || json_string_length(img) > 500)
        return sp_err_set(err, SP_EINVAL, "from.image must be an image reference "
                                          "(registry/repository:tag)");
    sp_ociimg_ref_t r;
    if (sp_ociimg_parse_ref(json_string_value(img), NULL, &r, err) < 0)
        return -1;
    *image = json_string_value(img);
    json_t *auth = json_object_get(from, "auth");
    if (auth != NULL && !json_is_null(auth)) {
        const char *u = json_string_value(json_object_get(auth, "username"));
        const char *p = json_string_value(json_object_get(auth, "password"));
        if (!json_is_object(auth) || json_object_size(auth) != 2 || u == NULL || p == NULL ||
            u[0] == '\0' || strlen(u) > 1024 || strlen(p) > 8192 || strchr(u, ':') != NULL)
            return sp_err_set(err, SP_EINVAL,
                              "from.auth must be {\"username\", \"password\"} (strings; no ':' "
                              "in the username)");
        *user = u;
        *pass = p;
    }
    return 0;
}

static int build_req(sp_tmpl_t *t, const sp_auth_t *a, const json_t *req, const char *reserved,
                     sp_tmpl_build_cb cb, void *arg, sp_err_t *err)
{
    if (reserved != NULL && !valid_build_id(reserved))
        return sp_err_set(err, SP_ENOTFOUND, "build not found");
    static const char *const allowed[] = {"name",      "description",     "from",
                                          "steps",     "start_cmd",       "ready_cmd",
                                          "cpu_count", "memory_mb",       "timeout_s",
                                          "force",     "ready_timeout_s", "tags",
                                          NULL};
    if (!json_is_object(req))
        return sp_err_set(err, SP_EINVAL, "the body must be a JSON object");
    const char *key;
    json_t *v;
    json_object_foreach((json_t *)req, key, v)
    {
        bool ok = false;
        for (int i = 0; allowed[i] != NULL && !ok; i++)
            ok = strcmp(key, allowed[i]) == 0;
        if (!ok)
            return sp_err_set(err, SP_EINVAL, "unknown field '%.64s'", key);
    }
    const char *name = NULL, *desc = NULL, *start = NULL, *ready = NULL, *parent = NULL;
    if (opt_str(req, "name", 63 + 1 + SP_TMPL_TAG_MAX, &name, err) < 0 ||
        opt_str(req, "description", 255, &desc, err) < 0 ||
        opt_str(req, "start_cmd", 4096, &start, err) < 0 ||
        opt_str(req, "ready_cmd", 4096, &ready, err) < 0)
        return -1;
    /* "name:tag" and tags: the tags the new version gets (none named: "default") */
    char base_name[64];
    json_t *tags = NULL;
    bool tags_given = (name != NULL && strchr(name, ':') != NULL) ||
                      json_array_size(json_object_get(req, "tags")) > 0;
    if (sp_tmpl_parse_target(name, json_object_get(req, "tags"), base_name, &tags, err) < 0)
        return -1;
    json_decref(tags); /* parsed again into the build below */
    name = base_name;
    if (strncmp(name, SP_OCIIMG_PREFIX, strlen(SP_OCIIMG_PREFIX)) == 0)
        return sp_err_set(err, SP_EINVAL,
                          "name: '" SP_OCIIMG_PREFIX "' names are this server's own (images)");
    json_t *from = json_object_get(req, "from");
    const char *image = NULL, *ruser = NULL, *rpass = NULL;
    if (json_is_string(from)) {
        parent = json_string_value(from);
    } else if (json_is_object(from) && json_object_get(from, "image") != NULL) {
        if (image_from(from, &image, &ruser, &rpass, err) < 0)
            return -1;
        parent = "base"; /* sizes until the image's own template is known */
    } else if (json_is_object(from) && json_object_size(from) == 1) {
        if (json_is_string(json_object_get(from, "template")))
            parent = json_string_value(json_object_get(from, "template"));
        else if (json_object_get(from, "snapshot"))
            return sp_err_set(err, SP_EINVAL,
                              "from: templates, images and Dockerfiles can be built from on this "
                              "server (not snapshots yet)");
    }
    if (parent == NULL)
        return sp_err_set(err, SP_EINVAL,
                          "from is required: a template name, {\"template\": name} or "
                          "{\"image\": reference}");
    if (!sp_tmplbuild_valid_name(parent) ||
        (image == NULL && strncmp(parent, SP_OCIIMG_PREFIX, strlen(SP_OCIIMG_PREFIX)) == 0))
        return sp_err_set(err, SP_ENOTFOUND, "parent template '%.64s' not found", parent);
    if (strcmp(parent, name) == 0)
        return sp_err_set(err, SP_EINVAL, "a template cannot be built from itself");
    if (image != NULL && t->agent == NULL)
        return sp_err_set(err, SP_EUNAVAIL,
                          "this server cannot build from images: it knows no guest agent "
                          "binary (spaced --agent, or SPACE_AGENT_BIN)");
    json_t *steps = json_object_get(req, "steps");
    if (steps != NULL && (!json_is_array(steps) || json_array_size(steps) > SP_TMPL_STEPS_MAX))
        return sp_err_set(err, SP_EINVAL, "steps must be an array of at most %d steps",
                          SP_TMPL_STEPS_MAX);
    for (size_t i = 0; i < json_array_size(steps); i++)
        if (check_step(json_array_get(steps, i), i, err) < 0)
            return -1;
    int cpus = 0, mem = 0, timeout = SP_TMPL_TIMEOUT_S, ready_s = SP_TMPL_READY_S;
    if (opt_int(req, "cpu_count", 1, SP_SVC_MAX_CPUS, &cpus, err) < 0 ||
        opt_int(req, "memory_mb", SP_SVC_MIN_MEMORY_MB, SP_SVC_MAX_MEMORY_MB, &mem, err) < 0 ||
        opt_int(req, "timeout_s", 1, SP_TMPL_TIMEOUT_MAX, &timeout, err) < 0 ||
        opt_int(req, "ready_timeout_s", 1, SP_TMPL_READY_MAX, &ready_s, err) < 0)
        return -1;
    json_t *force = json_object_get(req, "force");
    if (force != NULL && !json_is_boolean(force))
        return sp_err_set(err, SP_EINVAL, "force must be a boolean");
    for (struct build *o = t->builds; o != NULL; o = o->next)
        if (strcmp(o->name, name) == 0)
            return sp_err_set(err, SP_ECONFLICT, "template '%s' is being built (build %s)", name,
                              o->id);
    struct build *b = calloc(1, sizeof(*b));
    if (b == NULL)
        return sp_err_set(err, SP_EINTERNAL, "out of memory");
    b->t = t;
    b->log_fd = -1;
    b->copy_fd = -1;
    sp_timer_init(&b->deadline, t->loop, on_deadline, b);
    if (reserved != NULL)
        copy(b->id, sizeof b->id, reserved);
    else
        new_uuid(b->id);
    copy(b->team, sizeof b->team, a->team_id);
    copy(b->name, sizeof b->name, name);
    copy(b->parent, sizeof b->parent, image != NULL ? "" : parent);
    vm_id_of(b->id, b->vm_id);
    copy(b->user, sizeof b->user, "root");
    b->force = json_is_true(force);
    b->timeout_s = timeout;
    b->ready_s = ready_s;
    b->req = json_deep_copy(req);
    b->env = json_object();
    if (b->req != NULL &&
        sp_tmpl_parse_target(json_string_value(json_object_get(req, "name")),
                             json_object_get(req, "tags"), base_name, &tags, err) == 0) {
        json_object_set_new(b->req, "name", json_string(base_name));
        json_object_set_new(b->req, "tags", tags);
    }
    b->tags_given = tags_given;
    if (steps == NULL)
        json_object_set_new(b->req, "steps", json_array());
    if (image != NULL) { /* the credentials stay in memory: never in the record or manifest */
        b->image = strdup(image);
        b->reg_user = ruser ? strdup(ruser) : NULL;
        b->reg_pass = rpass ? strdup(rpass) : NULL;
        json_t *f = json_object_get(b->req, "from");
        json_object_del(f, "auth");
        if (b->image == NULL || (ruser && (!b->reg_user || !b->reg_pass))) {
            build_free(b);
            return sp_err_set(err, SP_EINTERNAL, "out of memory");
        }
    }
    b->next = t->builds;
    t->builds = b;
    if (b->req == NULL || b->env == NULL) {
        build_free(b);
        return sp_err_set(err, SP_EINTERNAL, "out of memory");
    }
    if (sp_tmplbuild_current(t->data_dir, parent, &b->pp, err) < 0) {
        build_free(b);
        return sp_err_set(err, SP_ENOTFOUND, "parent template '%s' not found (or not built)",
                          parent);
    }
    for (size_t i = 0; i < json_array_size(steps); i++) {
        const char *fk = json_string_value(
            json_object_get(json_object_get(json_array_get(steps, i), "copy"), "files"));
        char path[PATH_MAX];
        if (fk != NULL && sp_tmplfiles_path(t->files, b->team, fk, path, sizeof path, err) < 0) {
            build_free(b);
            return sp_err_set(err, SP_EINVAL,
                              "steps[%zu].copy: files %s were never uploaded (PUT "
                              "/v1/template-files/%s)",
                              i, fk, fk);
        }
    }
    b->cpu_count = cpus > 0 ? cpus : (b->pp.cpu_count > 0 ? b->pp.cpu_count : 1);
    b->memory_mb = mem > 0 ? mem : (b->pp.memory_mb > 0 ? b->pp.memory_mb : 256);
    if (image == NULL)
        input_hash(b); /* an image's: once it is pulled (its digest is part of it) */
    char p[PATH_MAX];
    if (pathf(p, sizeof p, "%s/builds", t->data_dir) < 0 || (mkdir(p, 0700) < 0 && errno != EEXIST) ||
        pathf(p, sizeof p, "%s/builds/%s.ndjson", t->data_dir, b->id) < 0 ||
        (b->log_fd = open(p, O_WRONLY | O_CREAT | O_TRUNC | O_APPEND | O_CLOEXEC, 0600)) < 0) {
        build_free(b);
        return sp_err_set(err, SP_EINTERNAL, "cannot open the build log: %s", strerror(errno));
    }
    char tdir[PATH_MAX];
    if (pathf(tdir, sizeof tdir, "%s/templates/%s", t->data_dir, name) < 0 ||
        (mkdir(tdir, 0755) < 0 && errno != EEXIST)) {
        build_free(b);
        return sp_err_set(err, SP_EINTERNAL, "cannot make the template's directory");
    }
    char cpu_s[16], mem_s[16], *req_s = json_dumps(b->req, JSON_COMPACT);
    snprintf(cpu_s, sizeof cpu_s, "%d", b->cpu_count);
    snprintf(mem_s, sizeof mem_s, "%d", b->memory_mb);
    const char *params[] = {b->id,  b->team, name,  parent, desc ? desc : "",
                            cpu_s, mem_s,   req_s, reserved != NULL ? "true" : "false",
                            image != NULL ? "true" : "false", b->tags_given ? "true" : "false"};
    /* The parent must be usable by the team; the name must be free or the team's own (a
     * built-in or another team's is not). The templates row of a new name says "building"
     * until its first build ends; an existing one stays as it is (its version in service). */
    struct accept *acc = sp_store_call(
        t->store,
        "WITH p AS (SELECT 1 FROM templates WHERE name = $4 AND deleted_at IS NULL"
        "  AND status = 'ready' AND (team_id IS NULL OR team_id = $2)"
        "  UNION ALL SELECT 1 WHERE $10::bool)," /* an image: no parent template to check */
        " n AS (INSERT INTO templates (name, description, cpu_count, memory_mb, status, team_id,"
        "  parent) SELECT $3, $5, $6::int, $7::int, 'building', $2,"
        "  CASE WHEN $10::bool THEN NULL ELSE $4 END WHERE EXISTS (SELECT 1"
        "  FROM p) ON CONFLICT (name) DO UPDATE SET updated_at = now()"
        "  WHERE templates.team_id = $2 RETURNING 1),"
        " b AS (INSERT INTO template_builds (id, team_id, template, status, request)"
        "  SELECT $1, $2, $3, 'queued', $8::jsonb WHERE EXISTS (SELECT 1 FROM n)"
        "  AND $9::bool IS NOT TRUE RETURNING created_at),"
        /* a reserved build (sp_tmpl_reserve) turns from waiting to queued */
        /* ... keeping the tags it was reserved with unless the request names others */
        " r AS (UPDATE template_builds SET status = 'queued', request = CASE WHEN $11::bool"
        "  OR NOT (template_builds.request ? 'tags') THEN $8::jsonb"
        "  ELSE $8::jsonb || jsonb_build_object('tags', template_builds.request->'tags') END"
        "  WHERE $9::bool AND id = $1 AND team_id = $2 AND template = $3 AND status = 'waiting'"
        "  AND EXISTS (SELECT 1 FROM n) RETURNING created_at, request->'tags' AS tags)"
        " SELECT (SELECT count(*) FROM p), (SELECT count(*) FROM n),"
        "  coalesce((SELECT " TS("created_at") " FROM b), (SELECT " TS("created_at") " FROM r),"
        "  ''), coalesce((SELECT tags FROM r), $8::jsonb->'tags')::text",
        11, params, sizeof(*acc), on_accepted, err);
    free(req_s);
    if (acc == NULL) {
        build_free(b);
        return -1;
    }
    acc->b = b;
    acc->cb = cb;
    acc->arg = arg;
    return 0;
}

int sp_tmpl_reserve(sp_tmpl_t *t, const sp_auth_t *a, const char *name, const json_t *tags,
                    int cpu_count, int memory_mb, sp_tmpl_build_cb cb, void *arg, sp_err_t *err)
{
    if (name == NULL || !sp_tmplbuild_valid_name(name))
        return sp_err_set(err, SP_EINVAL,
                          "bad template name: [a-z0-9][a-z0-9._-]*, at most 63 characters");
    if (strncmp(name, SP_OCIIMG_PREFIX, strlen(SP_OCIIMG_PREFIX)) == 0)
        return sp_err_set(err, SP_EINVAL,
                          "bad template name: '" SP_OCIIMG_PREFIX "' names are this server's own");
    if ((cpu_count != 0 && (cpu_count < 1 || cpu_count > SP_SVC_MAX_CPUS)) ||
        (memory_mb != 0 && (memory_mb < SP_SVC_MIN_MEMORY_MB || memory_mb > SP_SVC_MAX_MEMORY_MB)))
        return sp_err_set(err, SP_EINVAL, "cpu_count must be 1..%d and memory_mb %d..%d",
                          SP_SVC_MAX_CPUS, SP_SVC_MIN_MEMORY_MB, SP_SVC_MAX_MEMORY_MB);
    size_t i;
    json_t *v;
    json_array_foreach(tags, i, v) if (!json_is_string(v) ||
                                       !sp_tmpl_valid_tag(json_string_value(v))) return
        sp_err_set(err, SP_EINVAL, "bad tag '%.64s'", json_is_string(v) ? json_string_value(v) : "");
    if (tags != NULL && json_array_size(tags) > SP_TMPL_TAGS_MAX)
        return sp_err_set(err, SP_EINVAL, "at most %d tags", SP_TMPL_TAGS_MAX);
    char id[SP_TMPL_ID_MAX + 1];
    new_uuid(id);
    json_t *o = json_object();
    if (cpu_count > 0)
        json_object_set_new(o, "cpu_count", json_integer(cpu_count));
    if (memory_mb > 0)
        json_object_set_new(o, "memory_mb", json_integer(memory_mb));
    if (json_array_size(tags) > 0)
        json_object_set(o, "tags", (json_t *)tags);
    char *req = json_dumps(o, JSON_COMPACT);
    json_decref(o);
    if (req == NULL)
        return sp_err_set(err, SP_EINTERNAL, "out of memory");
    const char *p[] = {id, a->team_id, name, req};
    int rc = sp_store_submit(
        t->store,
        "WITH n AS (INSERT INTO templates (name, status, team_id) VALUES ($3, 'building', $2)"
        "  ON CONFLICT (name) DO UPDATE SET updated_at = now() WHERE templates.team_id = $2"
        "  RETURNING 1),"
        " b AS (INSERT INTO template_builds (id, team_id, template, status, request)"
        "  SELECT $1, $2, $3, 'waiting', $4::jsonb WHERE EXISTS (SELECT 1 FROM n)"
        "  RETURNING *)"
        " SELECT " BUILD_COLS " FROM b",
        4, p, on_reserved, t, (void *)cb, arg, 0, err);
    free(req);
    return rc;
}

int sp_tmpl_get_build(sp_tmpl_t *t, const sp_auth_t *a, const char *name, const char *id,
                      uint32_t wait_ms, sp_tmpl_build_cb cb, void *arg, sp_err_t *err)
{
    if (!valid_build_id(id) || !sp_tmplbuild_valid_name(name))
        return sp_err_set(err, SP_ENOTFOUND, "build not found");
    struct build *b = NULL;
    for (struct build *o = t->builds; o != NULL; o = o->next)
        if (strcmp(o->id, id) == 0 && strcmp(o->team, a->team_id) == 0 &&
            strcmp(o->name, name) == 0)
            b = o;
    if (wait_ms == 0 || b == NULL)
        return read_build(t, a->team_id, name, id, cb, arg, err);
    struct waiter *w = calloc(1, sizeof(*w));
    if (w == NULL)
        return sp_err_set(err, SP_EINTERNAL, "out of memory");
    w->t = t;
    w->b = b;
    w->auth = *a;
    copy(w->name, sizeof w->name, name);
    copy(w->id, sizeof w->id, id);
    w->cb = cb;
    w->arg = arg;
    sp_timer_init(&w->timer, t->loop, on_waiter_timer, w);
    sp_timer_start(&w->timer, wait_ms);
    w->next = b->waiters;
    b->waiters = w;
    return 0;
}

struct logreq {
    sp_tmpl_t *t;
    char id[SP_TMPL_ID_MAX + 1];
    uint64_t offset;
    size_t max_lines;
    sp_tmpl_log_cb cb;
    void *arg;
};

static void on_log_build(void *rec, PGresult *res, const sp_err_t *err)
{
    struct logreq *q = rec;
    sp_err_t e;
    const sp_err_t *why = sp_store_one_row(res, err, SP_ENOTFOUND, "build not found", &e);
    if (why != NULL) {
        q->cb(q->arg, NULL, 0, q->offset, true, why);
        return;
    }
    const char *st = PQgetvalue(res, 0, 0);
    bool finished = strcmp(st, "succeeded") == 0 || strcmp(st, "failed") == 0;
    char p[PATH_MAX];
    FILE *f = pathf(p, sizeof p, "%s/builds/%s.ndjson", q->t->data_dir, q->id) == 0
                  ? fopen(p, "re")
                  : NULL;
    sp_buf_t out = {0};
    uint64_t line = 0, next = q->offset;
    if (f != NULL) {
        char *l = NULL;
        size_t cap = 0;
        ssize_t n;
        while ((n = getline(&l, &cap, f)) > 0) {
            if (l[n - 1] != '\n') /* being written: not a line yet */
                break;
            if (line++ < q->offset)
                continue;
            if (next - q->offset >= q->max_lines || out.len > (4u << 20)) {
                finished = false; /* more to read */
                break;
            }
            sp_buf_add(&out, l, (size_t)n);
            next++;
        }
        free(l);
        fclose(f);
    }
    if (out.oom) {
        sp_err_set(&e, SP_EINTERNAL, "out of memory");
        q->cb(q->arg, NULL, 0, q->offset, true, &e);
    } else {
        q->cb(q->arg, out.len ? (const char *)out.p : "", out.len, next, finished, NULL);
    }
    sp_buf_free(&out);
}

int sp_tmpl_logs(sp_tmpl_t *t, const sp_auth_t *a, const char *name, const char *id,
                 uint64_t offset, size_t max_lines, sp_tmpl_log_cb cb, void *arg, sp_err_t *err)
{
    if (!valid_build_id(id) || !sp_tmplbuild_valid_name(name))
        return sp_err_set(err, SP_ENOTFOUND, "build not found");
    const char *p[] = {id, a->team_id, name};
    struct logreq *q = sp_store_call(t->store,
                                     "SELECT status FROM template_builds"
                                     " WHERE id = $1 AND team_id = $2 AND template = $3",
                                     3, p, sizeof(*q), on_log_build, err);
    if (q == NULL)
        return -1;
    q->t = t;
    copy(q->id, sizeof q->id, id);
    q->offset = offset;
    q->max_lines = max_lines > 0 ? max_lines : 10000;
    q->cb = cb;
    q->arg = arg;
    return 0;
}

struct delreq {
    sp_tmpl_t *t;
    char name[65];
    sp_svc_done_cb cb;
    void *arg;
};

static void on_deleted(void *rec, PGresult *res, const sp_err_t *err)
{
    struct delreq *q = rec;
    sp_err_t e;
    const sp_err_t *why = sp_store_one_row(res, err, SP_EINTERNAL, "no answer", &e);
    if (why == NULL && PQgetvalue(res, 0, 0)[0] == '0') {
        if (strcmp(PQgetvalue(res, 0, 1), "t") == 0)
            sp_err_set(&e, SP_EFORBIDDEN, "template '%s' is built in: it cannot be deleted",
                       q->name);
        else
            sp_err_set(&e, SP_ENOTFOUND, "template not found");
        why = &e;
    }
    if (why == NULL && set_current(q->t, q->name, NULL) < 0)
        sp_log(SP_LOG_WARN, "tmpl", "cannot unlink current of deleted template=%s", q->name);
    if (why == NULL) {
        sp_log(SP_LOG_INFO, "tmpl", "template deleted template=%s", q->name);
        collect(q->t, q->name);
    }
    q->cb(q->arg, why);
}

int sp_tmpl_delete(sp_tmpl_t *t, const sp_auth_t *a, const char *name, sp_svc_done_cb cb,
                   void *arg, sp_err_t *err)
{
    if (!sp_tmplbuild_valid_name(name))
        return sp_err_set(err, SP_ENOTFOUND, "template not found");
    for (struct build *o = t->builds; o != NULL; o = o->next)
        if (strcmp(o->name, name) == 0 && strcmp(o->team, a->team_id) == 0)
            return sp_err_set(err, SP_ECONFLICT, "template '%s' is being built (build %s)", name,
                              o->id);
    const char *p[] = {name, a->team_id};
    struct delreq *q = sp_store_call(
        t->store,
        "WITH d AS (UPDATE templates SET deleted_at = now(), status = 'deleted',"
        "  updated_at = now() WHERE name = $1 AND team_id = $2 AND deleted_at IS NULL"
        "  RETURNING 1),"
        /* its tags go with the name; versions its sandboxes use stay (collect) */
        " g AS (DELETE FROM template_tags WHERE template = $1 AND EXISTS (SELECT 1 FROM d)"
        "  RETURNING 1)"
        " SELECT (SELECT count(*) FROM d) + 0 * (SELECT count(*) FROM g),"
        "  coalesce((SELECT team_id IS NULL FROM templates WHERE name = $1), false)",
        2, p, sizeof(*q), on_deleted, err);
    if (q == NULL)
        return -1;
    q->t = t;
    copy(q->name, sizeof q->name, name);
    q->cb = cb;
    q->arg = arg;
    return 0;
}

/* ---- start-up: what a previous process left ---- */

static void on_leftover_destroyed(void *arg, const sp_err_t *err)
{
    char *id = arg;
    if (err != NULL)
        sp_log(SP_LOG_WARN, "tmpl", "leftover builder VM not destroyed vm=%s err=%s", id,
               err->msg);
    free(id);
}

static void on_leftovers(void *rec, PGresult *res, const sp_err_t *err)
{
    sp_tmpl_t *t = *(sp_tmpl_t **)rec;
    if (err != NULL) {
        sp_log(SP_LOG_WARN, "tmpl", "cannot fail unfinished builds: %s", err->msg);
        return;
    }
    for (int i = 0; i < PQntuples(res); i++) {
        const char *id = PQgetvalue(res, i, 0), *name = PQgetvalue(res, i, 1);
        sp_log(SP_LOG_WARN, "tmpl", "build failed by a restart build=%s template=%s", id, name);
        char wdir[PATH_MAX];
        if (sp_tmplbuild_valid_name(name) &&
            pathf(wdir, sizeof wdir, "%s/templates/%s/.build-%s", t->data_dir, name, id) == 0)
            rm_rf(wdir);
    }
}

/* Builder VMs left on the data dir by a process that stopped mid-build, whatever database it
 * used (its records may be elsewhere): no build runs yet, so every "bld-*" VM is a leftover. */
static void destroy_leftover_builders(sp_tmpl_t *t)
{
    char dir[PATH_MAX];
    if (t->driver == NULL || pathf(dir, sizeof dir, "%s/vms", t->data_dir) < 0)
        return;
    DIR *d = opendir(dir);
    struct dirent *de;
    while (d != NULL && (de = readdir(d)) != NULL) {
        if (strncmp(de->d_name, "bld-", 4) != 0 || strlen(de->d_name) >= 32)
            continue;
        char *vm = strdup(de->d_name);
        sp_err_t e;
        sp_log(SP_LOG_WARN, "tmpl", "removing a leftover builder VM vm=%s", de->d_name);
        if (vm != NULL &&
            t->driver->ops->destroy(t->driver, vm, on_leftover_destroyed, vm, &e) < 0)
            free(vm);
    }
    if (d != NULL)
        closedir(d);
}

sp_tmpl_t *sp_tmpl_create(sp_loop_t *loop, sp_store_t *store, sp_driver_t *driver,
                          const char *data_dir, sp_err_t *err)
{
    sp_tmpl_t *t = calloc(1, sizeof(*t));
    if (t == NULL) {
        sp_err_set(err, SP_EINTERNAL, "out of memory");
        return NULL;
    }
    t->loop = loop;
    t->store = store;
    t->driver = driver;
    copy(t->data_dir, sizeof t->data_dir, data_dir);
    if ((t->files = sp_tmplfiles_create(loop, data_dir, err)) == NULL) {
        free(t);
        return NULL;
    }
    void *rec = sp_store_call(
        store,
        "WITH f AS (UPDATE template_builds SET status = 'failed', finished_at = now(),"
        "  error = 'the server restarted during the build'"
        "  WHERE status IN ('queued', 'building') RETURNING id, template),"
        " u AS (UPDATE templates SET status = 'failed' WHERE status = 'building'"
        "  AND name IN (SELECT template FROM f))"
        " SELECT id, template FROM f",
        0, NULL, sizeof(sp_tmpl_t *), on_leftovers, err);
    if (rec == NULL) {
        sp_tmplfiles_destroy(t->files);
        free(t);
        return NULL;
    }
    *(sp_tmpl_t **)rec = t;
    destroy_leftover_builders(t);
    /* versions nothing uses any more (their sandboxes went while we were down) */
    void *r2 = sp_store_call(store, "SELECT name FROM templates WHERE team_id IS NOT NULL", 0,
                             NULL, sizeof(sp_tmpl_t *), on_team_templates, err);
    if (r2 != NULL)
        *(sp_tmpl_t **)r2 = t;
    return t;
}

void sp_tmpl_destroy(sp_tmpl_t *t)
{
    if (t == NULL)
        return;
    while (t->builds != NULL) {
        struct build *b = t->builds;
        while (b->waiters != NULL) { /* the owner is going away: no answers */
            struct waiter *w = b->waiters;
            b->waiters = w->next;
            sp_timer_stop(&w->timer);
            free(w);
        }
        build_free(b);
    }
    sp_tmplfiles_destroy(t->files);
    free(t->agent);
    free(t->mirror);
    free(t->insecure);
    free(t);
}

int sp_tmpl_set_images(sp_tmpl_t *t, const char *agent_path, const char *mirror,
                       const char *insecure, uint64_t max_bytes, sp_err_t *err)
{
    char *a = agent_path ? strdup(agent_path) : NULL, *m = mirror ? strdup(mirror) : NULL;
    char *i = insecure ? strdup(insecure) : NULL;
    if ((agent_path && !a) || (mirror && !m) || (insecure && !i)) {
        free(a);
        free(m);
        free(i);
        return sp_err_set(err, SP_EINTERNAL, "out of memory");
    }
    free(t->agent);
    free(t->mirror);
    free(t->insecure);
    t->agent = a;
    t->mirror = m;
    t->insecure = i;
    t->image_max = max_bytes;
    return 0;
}

sp_tmplfiles_t *sp_tmpl_files(sp_tmpl_t *t)
{
    return t->files;
}
