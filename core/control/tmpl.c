/*
 * tmpl.c - template builds through the API (tmpl.h): the requests and their validation (a
 * Dockerfile's or an image's request made into steps), the build records and ?wait= waiters,
 * reservations, logs, delete, and at start-up what a previous process left.
 *
 * Not here: a build's course once accepted (tmplrun.c), versions and tags (tmplver.c). What
 * the three share: tmpl_int.h.
 */
#include "core/control/tmpl.h"

#include <ctype.h>
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <signal.h>
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
#include "base/rmtree.h"
#include "core/control/dockerfile.h"
#include "core/control/ociimg.h"
#include "core/control/snap.h"
#include "core/control/tmpl_int.h"
#include "core/control/tmplfiles.h"
#include "core/egress/secrets.h"
#include "guest/tmplbuild.h"
#include "loop/discard.h"

#define BUILD_COLS                                                                                 \
    "b.id, b.template, b.status, coalesce(b.hash, ''), b.cached, coalesce(b.failed_step, 0), "     \
    "coalesce(b.error, ''), " SP_TMPL__TS("b.created_at") ", "                                     \
    "coalesce(" SP_TMPL__TS("b.started_at") ", ''), "                                              \
    "coalesce(" SP_TMPL__TS("b.finished_at") ", ''), "                                             \
    "coalesce((b.request->>'cpu_count')::int, 0), coalesce((b.request->>'memory_mb')::int, 0)"

/* ---- small helpers ---- */

void sp_tmpl__copy(char *dst, size_t cap, const char *src)
{
    size_t n = src ? strnlen(src, cap - 1) : 0;
    memcpy(dst, src ? src : "", n);
    dst[n] = '\0';
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

static void vm_id_of(const char *build_id, char out[32])
{
    size_t k = 0;
    k += (size_t)snprintf(out, 32, "bld-");
    for (const char *p = build_id; *p && k < 24; p++)
        if (*p != '-')
            out[k++] = *p;
    out[k] = '\0';
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

/* Answers a build record's read: its one row, else code/none. */
static void answer_build(void *rec, PGresult *res, const sp_err_t *err, sp_code_t code,
                         const char *none)
{
    sp_store_req_t *q = rec;
    sp_tmpl_build_cb cb = (sp_tmpl_build_cb)q->cb;
    sp_err_t e;
    const sp_err_t *why = sp_store_one_row(res, err, code, none, &e);
    if (why != NULL) {
        cb(q->arg, NULL, why);
        return;
    }
    sp_tmpl_build_rec_t b;
    parse_build(res, 0, &b);
    cb(q->arg, &b, NULL);
}

static void build_done_row(void *rec, PGresult *res, const sp_err_t *err)
{
    answer_build(rec, res, err, SP_ENOTFOUND, "build not found");
}

/* A reservation's answer: no row means the name is not the team's to build. */
static void on_reserved(void *rec, PGresult *res, const sp_err_t *err)
{
    answer_build(rec, res, err, SP_ECONFLICT, "the template name is taken");
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

/* A build this node runs answers its waiters when it ends (tmplrun.c). One another node runs
 * (its worker, when the route to builders changed or a client asks a worker directly; an API
 * node runs none) is waited on here by NOTIFY SP_TMPL_NOTIFY, which every statement that ends a
 * build sends with its id: a remote waiter reads the record when it starts, after each such
 * NOTIFY for its build, and after a listener reconnect (one may have been missed), and
 * answers once the record says the build ended or its time ran out. It is linked before its
 * first read, so a NOTIFY racing that read is not missed. A read that cannot be had (the
 * database out of reach) does not end the wait: it is tried again every REMOTE_RETRY_MS,
 * and the answer at the end of the wait is the record as it then reads (or that error). */

#define REMOTE_RETRY_MS 1000

static void waiter_unlink(struct waiter *w)
{
    for (struct waiter **pp = w->remote ? &w->t->remote : &w->b->waiters; *pp != NULL;
         pp = &(*pp)->next)
        if (*pp == w) {
            *pp = w->next;
            break;
        }
}

static void on_waiter_timer(sp_timer_t *tm, void *arg)
{
    (void)tm;
    struct waiter *w = arg;
    if (w->checking) { /* its read answers */
        w->expired = true;
        return;
    }
    waiter_unlink(w);
    sp_tmpl__waiter_answer(w);
}

/* Reads the record and answers; frees w. */
void sp_tmpl__waiter_answer(struct waiter *w)
{
    sp_timer_stop(&w->timer);
    sp_timer_stop(&w->retry);
    sp_err_t e;
    if (read_build(w->t, w->auth.team_id, w->name, w->id, w->cb, w->arg, &e) < 0)
        w->cb(w->arg, NULL, &e);
    free(w);
}

static bool build_ended(const char *status)
{
    return strcmp(status, "succeeded") == 0 || strcmp(status, "failed") == 0;
}

static int remote_check(struct waiter *w, sp_err_t *err);

/* Unlinks remote waiter w and answers it with res's row or why; frees w. */
static void remote_answer(struct waiter *w, PGresult *res, const sp_err_t *why)
{
    waiter_unlink(w);
    sp_timer_stop(&w->timer);
    sp_timer_stop(&w->retry);
    if (why != NULL) {
        w->cb(w->arg, NULL, why);
    } else {
        sp_tmpl_build_rec_t b;
        parse_build(res, 0, &b);
        w->cb(w->arg, &b, NULL);
    }
    free(w);
}

/* A remote waiter's read: answers with the record once the build ended (or there is no such
 * build, or no answer), or its time ran out; else waits on, reading again if a NOTIFY came
 * during the read. */
static void on_remote_check(void *rec, PGresult *res, const sp_err_t *err)
{
    struct waiter *w = *(struct waiter **)rec;
    w->checking = false;
    if (err != NULL && !w->expired) { /* no answer: the wait goes on, the read again later */
        sp_timer_start(&w->retry, REMOTE_RETRY_MS);
        return;
    }
    sp_err_t e;
    const sp_err_t *why = sp_store_one_row(res, err, SP_ENOTFOUND, "build not found", &e);
    bool wait_on = why == NULL && !build_ended(PQgetvalue(res, 0, 2)) && !w->expired;
    if (wait_on && w->recheck && remote_check(w, &e) < 0)
        sp_timer_start(&w->retry, REMOTE_RETRY_MS); /* not sent: later */
    if (wait_on)
        return;
    remote_answer(w, res, why);
}

static void on_remote_retry(sp_timer_t *tm, void *arg)
{
    (void)tm;
    struct waiter *w = arg;
    sp_err_t e;
    if (!w->checking && remote_check(w, &e) < 0)
        sp_timer_start(&w->retry, REMOTE_RETRY_MS);
}

static int remote_check(struct waiter *w, sp_err_t *err)
{
    const char *p[] = {w->id, w->auth.team_id, w->name};
    void *rec = sp_store_call(w->t->store,
                              "SELECT " BUILD_COLS " FROM template_builds b"
                              " WHERE b.id = $1 AND b.team_id = $2 AND b.template = $3",
                              3, p, sizeof(struct waiter *), on_remote_check, err);
    if (rec == NULL)
        return -1;
    *(struct waiter **)rec = w;
    w->checking = true;
    w->recheck = false;
    return 0;
}

/* NOTIFY SP_TMPL_NOTIFY (payload: a build's id; NULL after a listener reconnect: any). */
static void on_builds_notify(void *arg, const char *channel, const char *payload)
{
    (void)channel;
    sp_tmpl_t *t = arg;
    struct waiter *w = t->remote;
    while (w != NULL) {
        struct waiter *next = w->next;
        sp_err_t e;
        if (payload == NULL || strcmp(payload, w->id) == 0) {
            if (w->checking)
                w->recheck = true;
            else if (remote_check(w, &e) < 0)
                sp_timer_start(&w->retry, REMOTE_RETRY_MS); /* not sent: later */
        }
        w = next;
    }
}

/* ---- paths ---- */

int sp_tmpl__pathf(char *out, size_t n, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    int k = vsnprintf(out, n, fmt, ap);
    va_end(ap);
    return k < 0 || (size_t)k >= n ? -1 : 0;
}

/* <data>/templates/.trash, where discarded paths wait for their worker; -1 when too long. */
static int trash_dir(const sp_tmpl_t *t, char *buf, size_t n)
{
    return sp_tmpl__pathf(buf, n, "%s/templates/.trash", t->data_dir);
}

void sp_tmpl__discard(sp_tmpl_t *t, const char *path)
{
    char trash[PATH_MAX];
    if (trash_dir(t, trash, sizeof trash) == 0)
        sp_discard(t->loop, trash, path);
    else
        sp_rm_rf(path);
}

/* Where build id's log is (dir: its directory): the shared snapshot dir's builds/ on many
 * workers (sp_tmpl_set_shared_dir), so that whichever worker answers for builds later still
 * has it; else this data dir's. -1 when it does not fit. */
static int log_path(const sp_tmpl_t *t, const char *id, char *dir, size_t dn, char *out, size_t n)
{
    const char *root = t->shared_dir[0] != '\0' ? t->shared_dir : t->data_dir;
    return sp_tmpl__pathf(dir, dn, "%s/builds", root) < 0 ||
                   sp_tmpl__pathf(out, n, "%s/builds/%s.ndjson", root, id) < 0
               ? -1
               : 0;
}

/* What an earlier run discarded and did not finish removing (it stopped or died meanwhile). */
static void discard_leftovers(sp_tmpl_t *t)
{
    char trash[PATH_MAX];
    if (trash_dir(t, trash, sizeof trash) == 0)
        sp_discard_leftovers(t->loop, trash);
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
    if (why == NULL && PQgetvalue(res, 0, 4)[0] != 't')
        why = (sp_err_set(&e, SP_EINVAL,
                          "from.auth.password_secret: secret '%s' does not exist (spacectl "
                          "secrets set)",
                          b->reg_secret != NULL ? b->reg_secret : ""),
               &e);
    else if (why == NULL && PQgetvalue(res, 0, 0)[0] == '0')
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
            char d[PATH_MAX], p[PATH_MAX];
            if (log_path(b->t, b->id, d, sizeof d, p, sizeof p) == 0)
                unlink(p);
        }
        sp_tmpl__build_free(b);
        a->cb(a->arg, NULL, why);
        return;
    }
    json_t *tags = json_loads(PQgetvalue(res, 0, 3), 0, NULL);
    if (json_is_array(tags) && json_array_size(tags) > 0)
        json_object_set(b->req, "tags", tags);
    json_decref(tags);
    sp_tmpl_build_rec_t r;
    memset(&r, 0, sizeof r);
    sp_tmpl__copy(r.id, sizeof r.id, b->id);
    sp_tmpl__copy(r.template_name, sizeof r.template_name, b->name);
    sp_tmpl__copy(r.status, sizeof r.status, "queued");
    sp_tmpl__copy(r.created_at, sizeof r.created_at, PQgetvalue(res, 0, 2));
    a->cb(a->arg, &r, NULL);
    b->ph = P_QUEUED;
    sp_tmpl__start_queued(b->t);
}

/* SHA-256 of the parent's version and the inputs that shape the image and its snapshot. */
void sp_tmpl__input_hash(struct build *b)
{
    json_t *in = json_pack("{s:s,s:O,s:O,s:O,s:i,s:i,s:i}", "parent_hash", b->pp.hash, "steps",
                           json_object_get(b->req, "steps"), "start_cmd",
                           json_object_get(b->req, "start_cmd") ?: json_null(), "ready_cmd",
                           json_object_get(b->req, "ready_cmd") ?: json_null(), "ready_timeout_s",
                           b->ready_s, "cpu_count", b->cpu_count, "memory_mb", b->memory_mb);
    if (b->force) /* a forced build makes a version of its own */
        json_object_set_new(in, "build", json_string(b->id));
    if (b->disk_mb > 0) /* only when asked: the versions built before keep their hashes */
        json_object_set_new(in, "disk_mb", json_integer(b->disk_mb));
    if (b->snapshot[0] != '\0') /* the builder starts as the snapshot left it */
        json_object_set_new(in, "snapshot", json_string(b->snapshot));
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

/* The parent a build was found to have before build_req: a tag's version (hash), or a
 * sandbox snapshot's template, version and size (snapshot set). */
struct pick {
    const char *name;     /* NULL: the request's */
    const char *hash;     /* NULL: the parent's current version */
    const char *snapshot; /* the builder starts from this sandbox snapshot, or NULL */
    int cpu_count, memory_mb;
};

static int build_req(sp_tmpl_t *t, const sp_auth_t *a, const json_t *req, const char *reserved,
                     const struct pick *pk, sp_tmpl_build_cb cb, void *arg, sp_err_t *err);

/* A parent named with a tag ("web:v2" or {"template": "web:v2"}) other than default: its
 * version is looked up first (the team's own template or a built-in one), then the build goes
 * on from that version. */
struct tagged {
    sp_tmpl_t *t;
    sp_auth_t a;
    json_t *req;
    char reserved[SP_TMPL_ID_MAX + 1];
    bool has_reserved;
    char parent[64 + 1 + SP_TMPL_TAG_MAX];
    sp_tmpl_build_cb cb;
    void *arg;
};

/* The parent's lookup answered: the build goes on from pk, or the caller hears err. */
static void go_on(struct tagged *q, const struct pick *pk, const sp_err_t *err)
{
    sp_err_t e;
    if (err == NULL && build_req(q->t, &q->a, q->req, q->has_reserved ? q->reserved : NULL, pk,
                                 q->cb, q->arg, &e) < 0)
        err = &e;
    if (err != NULL)
        q->cb(q->arg, NULL, err);
    json_decref(q->req);
}

static void on_parent_tag(void *rec, PGresult *res, const sp_err_t *err)
{
    struct tagged *q = rec;
    sp_err_t e;
    /* by name alone on many workers (sp_tmpl_set_shared_dir): a built-in has no tags */
    const char *colon = strchr(q->parent, ':');
    bool name_only = colon != NULL && strcmp(colon + 1, "default") == 0;
    if (err == NULL && PQntuples(res) != 1 && !name_only)
        err = (sp_err_set(&e, SP_ENOTFOUND, "parent template '%s' not found (no such tag)",
                          q->parent),
               &e);
    struct pick pk = {.hash = err == NULL && PQntuples(res) == 1 ? PQgetvalue(res, 0, 0) : NULL};
    go_on(q, &pk, err);
}

/* A parent named by a version's hash ({"template": name, "version": hash or its start}):
 * the one version of the team's template (or a built-in one's) it names. */
static void on_parent_version(void *rec, PGresult *res, const sp_err_t *err)
{
    struct tagged *q = rec;
    sp_err_t e;
    if (err == NULL && PQntuples(res) == 0)
        err =
            (sp_err_set(&e, SP_ENOTFOUND, "parent template version '%s' not found", q->parent), &e);
    else if (err == NULL && PQntuples(res) > 1)
        err = (sp_err_set(&e, SP_EINVAL,
                          "parent template version '%s' is ambiguous: give more of its digits",
                          q->parent),
               &e);
    struct pick pk = {.hash = err == NULL ? PQgetvalue(res, 0, 0) : NULL};
    go_on(q, &pk, err);
}

/* The parent of req when it names a tag other than default: "name:tag" into parent; on many
 * workers (t->shared_dir) also a bare name, as "name:default"; else false (a bare name, an
 * image, a Dockerfile: build_req judges those). */
static bool tagged_parent(const sp_tmpl_t *t, const json_t *req, char *parent, size_t cap)
{
    json_t *from = json_object_get(req, "from");
    if (json_is_object(from) && json_object_size(from) == 1)
        from = json_object_get(from, "template");
    const char *p = json_string_value(from);
    const char *colon = p != NULL ? strchr(p, ':') : NULL;
    if (p != NULL && t->shared_dir[0] != '\0' && strlen(p) + 8 < cap) {
        snprintf(parent, cap, "%.*s", colon != NULL ? (int)(colon - p) : (int)strlen(p), p);
        if (!sp_tmplbuild_valid_name(parent))
            return false; /* build_req says why */
        snprintf(parent + strlen(parent), cap - strlen(parent), ":%s",
                 colon != NULL ? colon + 1 : "default");
        return true;
    }
    if (colon == NULL || strcmp(colon + 1, "default") == 0 || strlen(p) >= cap)
        return false;
    snprintf(parent, cap, "%s", p);
    return true;
}

/* The parent's row read before build_req: sql (n parameters p) answers done with the
 * struct tagged filled in (what: the parent as the request named it, for messages). */
static int lookup_parent(sp_tmpl_t *t, const sp_auth_t *a, const json_t *req,
                         const char *reserved, const char *what, const char *sql, int n,
                         const char *const *p, sp_store_rec_cb done, sp_tmpl_build_cb cb,
                         void *arg, sp_err_t *err)
{
    if (reserved != NULL && !valid_build_id(reserved))
        return sp_err_set(err, SP_ENOTFOUND, "build not found");
    struct tagged *q = sp_store_call(t->store, sql, n, p, sizeof(*q), done, err);
    if (q == NULL)
        return -1;
    q->t = t;
    q->a = *a;
    q->req = json_deep_copy(req);
    q->has_reserved = reserved != NULL;
    sp_tmpl__copy(q->reserved, sizeof q->reserved, reserved);
    sp_tmpl__copy(q->parent, sizeof q->parent, what);
    q->cb = cb;
    q->arg = arg;
    return 0;
}

/* A parent named as a sandbox snapshot ({"snapshot": id}): its row is read first (the
 * team's, ready), then the build goes on from its template's version, at its size, with the
 * builder started from the snapshot (its disk, memory and processes). */
static void on_parent_snapshot(void *rec, PGresult *res, const sp_err_t *err)
{
    struct tagged *q = rec;
    sp_err_t e;
    if (err == NULL && PQntuples(res) != 1)
        err = (sp_err_set(&e, SP_ENOTFOUND, "snapshot %s not found", q->parent), &e);
    else if (err == NULL && strcmp(PQgetvalue(res, 0, 2), "ready") != 0)
        err = (sp_err_set(&e, SP_ECONFLICT, "snapshot %s is %s, not ready", q->parent,
                          PQgetvalue(res, 0, 2)),
               &e);
    struct pick pk = {0};
    if (err == NULL)
        pk = (struct pick){.name = PQgetvalue(res, 0, 0),
                           .hash = PQgetvalue(res, 0, 1)[0] ? PQgetvalue(res, 0, 1) : NULL,
                           .snapshot = q->parent,
                           .cpu_count = atoi(PQgetvalue(res, 0, 3)),
                           .memory_mb = atoi(PQgetvalue(res, 0, 4))};
    go_on(q, &pk, err);
}

static int build_from_snapshot(sp_tmpl_t *t, const sp_auth_t *a, const json_t *req,
                               const char *reserved, const char *sid, sp_tmpl_build_cb cb,
                               void *arg, sp_err_t *err)
{
    sp_tmpl_build_req_t br; /* the rest of the request is judged before the lookup */
    if (sp_tmpl_parse_build(req, &br, err) < 0)
        return -1;
    if (!sp_snap_valid_id(sid))
        return sp_err_set(err, SP_ENOTFOUND, "snapshot %.80s not found", sid);
    const char *p[] = {sid, a->team_id};
    return lookup_parent(t, a, req, reserved, sid,
                         "SELECT s.template, coalesce(sb.template_version, ''), s.state,"
                         " s.cpu_count, s.memory_mb FROM snapshots s"
                         " JOIN sandboxes sb ON sb.id = s.sandbox_id"
                         " WHERE s.id = $1 AND s.team_id = $2 AND s.deleted_at IS NULL",
                         2, p, on_parent_snapshot, cb, arg, err);
}

static int build_tagged(sp_tmpl_t *t, const sp_auth_t *a, const json_t *req,
                        const char *reserved, sp_tmpl_build_cb cb, void *arg, sp_err_t *err)
{
    json_t *from = json_object_get(req, "from");
    const char *sid = json_string_value(json_object_get(from, "snapshot"));
    if (json_is_object(from) && sid != NULL)
        return build_from_snapshot(t, a, req, reserved, sid, cb, arg, err);
    const char *ver = json_string_value(json_object_get(from, "version"));
    if (json_is_object(from) && ver != NULL) {
        sp_tmpl_build_req_t br; /* judged first: the version's form among the rest */
        if (sp_tmpl_parse_build(req, &br, err) < 0)
            return -1;
        char what[64 + 1 + 65];
        snprintf(what, sizeof what, "%s@%s", br.parent, ver);
        const char *p[] = {br.parent, ver, a->team_id};
        return lookup_parent(t, a, req, reserved, what,
                             "SELECT v.hash FROM template_versions v JOIN templates m"
                             " ON m.name = v.template WHERE v.template = $1"
                             " AND v.hash LIKE $2 || '%' AND m.deleted_at IS NULL"
                             " AND (m.team_id IS NULL OR m.team_id = $3) LIMIT 2",
                             3, p, on_parent_version, cb, arg, err);
    }
    char parent[64 + 1 + SP_TMPL_TAG_MAX + 1];
    if (!tagged_parent(t, req, parent, sizeof parent))
        return build_req(t, a, req, reserved, NULL, cb, arg, err);
    char name[sizeof parent];
    memcpy(name, parent, sizeof name);
    char *colon = strchr(name, ':');
    *colon = '\0';
    if (!sp_tmplbuild_valid_name(name) || !sp_tmpl_valid_tag(colon + 1))
        return sp_err_set(err, SP_ENOTFOUND, "parent template '%s:%.64s' not found", name,
                          colon + 1);
    const char *p[] = {name, colon + 1, a->team_id};
    return lookup_parent(t, a, req, reserved, parent,
                         "SELECT g.hash FROM template_tags g JOIN templates m"
                         " ON m.name = g.template WHERE g.template = $1 AND g.tag = $2"
                         " AND m.deleted_at IS NULL AND (m.team_id IS NULL OR m.team_id = $3)",
                         3, p, on_parent_tag, cb, arg, err);
}

int sp_tmpl_build_reserved(sp_tmpl_t *t, const sp_auth_t *a, const json_t *req,
                           const char *reserved, sp_tmpl_build_cb cb, void *arg, sp_err_t *err)
{
    json_t *r;
    if (sp_tmpl_expand_dockerfile(req, &r, err) < 0)
        return -1;
    int rc = build_tagged(t, a, r != NULL ? r : req, reserved, cb, arg, err);
    json_decref(r);
    return rc;
}

/* parent_hash: the parent's version when the request named it by a tag (build_tagged), else
 * NULL: its current one. */
static int build_req(sp_tmpl_t *t, const sp_auth_t *a, const json_t *req, const char *reserved,
                     const struct pick *pk, sp_tmpl_build_cb cb, void *arg, sp_err_t *err)
{
    const char *parent_hash = pk != NULL ? pk->hash : NULL;
    const char *snapshot = pk != NULL ? pk->snapshot : NULL;
    if (reserved != NULL && !valid_build_id(reserved))
        return sp_err_set(err, SP_ENOTFOUND, "build not found");
    sp_tmpl_build_req_t br;
    if (sp_tmpl_parse_build(req, &br, err) < 0)
        return -1;
    const char *name = br.name, *image = br.image;
    const char *parent = pk != NULL && pk->name != NULL ? pk->name : br.parent;
    const char *ruser = br.reg_user, *rpass = br.reg_pass, *rsecret = br.reg_secret;
    const json_t *steps = br.steps;
    int cpus = br.cpu_count, mem = br.memory_mb, timeout = br.timeout_s;
    int ready_s = br.ready_timeout_s;
    bool tags_given = br.tags_given;
    char base_name[64];
    json_t *tags = NULL;
    /* "name:default" is the name; another tag's version was looked up (build_tagged) */
    if (br.parent_tag != NULL && parent_hash == NULL && strcmp(br.parent_tag, "default") != 0)
        return sp_err_set(err, SP_ENOTFOUND, "parent template '%.64s:%.64s' not found", parent,
                          br.parent_tag);
    if (snapshot != NULL) { /* its memory is the snapshot's: so is its size */
        if ((cpus != 0 && cpus != pk->cpu_count) || (mem != 0 && mem != pk->memory_mb))
            return sp_err_set(err, SP_EINVAL,
                              "a build from a snapshot has the snapshot's size (%d vCPU, %d "
                              "MiB): leave cpu_count and memory_mb out",
                              pk->cpu_count, pk->memory_mb);
        cpus = pk->cpu_count;
        mem = pk->memory_mb;
    }
    if (rsecret != NULL && (t->secrets == NULL || sp_secrets_check_enabled(t->secrets, err) < 0))
        return t->secrets == NULL
                   ? sp_err_set(err, SP_EUNAVAIL, "secrets are not available on this server")
                   : -1;
    if (image != NULL && t->agent == NULL)
        return sp_err_set(err, SP_EUNAVAIL,
                          "this server cannot build from images: it knows no guest agent "
                          "binary (spaced --agent, or SPACE_AGENT_BIN)");
    for (struct build *o = t->builds; o != NULL; o = o->next)
        if (strcmp(o->name, name) == 0)
            return sp_err_set(err, SP_ECONFLICT, "template '%s' is being built (build %s)", name,
                              o->id);
    struct build *b = calloc(1, sizeof(*b));
    if (b == NULL)
        return sp_err_set(err, SP_EINTERNAL, "out of memory");
    b->t = t;
    b->log_fd = -1;
    b->size_bytes = -1;
    b->copy_fd = -1;
    sp_timer_init(&b->deadline, t->loop, sp_tmpl__on_deadline, b);
    if (reserved != NULL)
        sp_tmpl__copy(b->id, sizeof b->id, reserved);
    else
        new_uuid(b->id);
    sp_tmpl__copy(b->team, sizeof b->team, a->team_id);
    sp_tmpl__copy(b->name, sizeof b->name, name);
    sp_tmpl__copy(b->parent, sizeof b->parent, image != NULL ? "" : parent);
    sp_tmpl__copy(b->snapshot, sizeof b->snapshot, snapshot);
    vm_id_of(b->id, b->vm_id);
    sp_tmpl__copy(b->user, sizeof b->user, "root");
    b->force = br.force;
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
        b->reg_secret = rsecret ? strdup(rsecret) : NULL;
        json_t *f = json_object_get(b->req, "from");
        json_object_del(f, "auth");
        if (b->image == NULL || (ruser && (!b->reg_user || (!b->reg_pass && !b->reg_secret)))) {
            sp_tmpl__build_free(b);
            return sp_err_set(err, SP_EINTERNAL, "out of memory");
        }
    }
    b->next = t->builds;
    t->builds = b;
    if (b->req == NULL || b->env == NULL) {
        sp_tmpl__build_free(b);
        return sp_err_set(err, SP_EINTERNAL, "out of memory");
    }
    char version[64 + 1 + 65];
    snprintf(version, sizeof version, "%s%s%.64s", parent, parent_hash != NULL ? "@" : "",
             parent_hash != NULL ? parent_hash : "");
    sp_tmpl__copy(b->parent_ref, sizeof b->parent_ref, version);
    if (sp_tmplbuild_find(t->data_dir, t->shared_dir, version, &b->pp, err) < 0) {
        sp_tmpl__build_free(b);
        return sp_err_set(err, SP_ENOTFOUND, "parent template '%s' not found (or not built)",
                          version);
    }
    for (size_t i = 0; i < json_array_size(steps); i++) {
        const char *fk = json_string_value(
            json_object_get(json_object_get(json_array_get(steps, i), "copy"), "files"));
        char path[PATH_MAX];
        if (fk != NULL && sp_tmplfiles_path(t->files, b->team, fk, path, sizeof path, err) < 0) {
            sp_tmpl__build_free(b);
            return sp_err_set(err, SP_EINVAL,
                              "steps[%zu].copy: files %s were never uploaded, or went unused "
                              "so long that they were removed (PUT /v1/template-files/%s)",
                              i, fk, fk);
        }
    }
    if (image == NULL && br.disk_mb > 0 && br.disk_mb < b->pp.disk_mb) {
        int have = b->pp.disk_mb;
        sp_tmpl__build_free(b);
        return sp_err_set(err, SP_EINVAL,
                          "disk_mb %d is below the parent's disk (%d MiB): a template's disk can "
                          "grow, not shrink",
                          br.disk_mb, have);
    }
    b->disk_mb = br.disk_mb > b->pp.disk_mb || image != NULL ? br.disk_mb : 0;
    b->cpu_count = cpus > 0 ? cpus : (b->pp.cpu_count > 0 ? b->pp.cpu_count : 1);
    b->memory_mb = mem > 0 ? mem : (b->pp.memory_mb > 0 ? b->pp.memory_mb : 256);
    if (image == NULL)
        sp_tmpl__input_hash(b); /* an image's: once it is pulled (its digest is part of it) */
    char d[PATH_MAX], p[PATH_MAX];
    if (log_path(t, b->id, d, sizeof d, p, sizeof p) < 0 ||
        (mkdir(d, 0700) < 0 && errno != EEXIST) ||
        (b->log_fd = open(p, O_WRONLY | O_CREAT | O_TRUNC | O_APPEND | O_CLOEXEC, 0600)) < 0) {
        sp_tmpl__build_free(b);
        return sp_err_set(err, SP_EINTERNAL, "cannot open the build log: %s", strerror(errno));
    }
    char tdir[PATH_MAX];
    if (sp_tmpl__pathf(tdir, sizeof tdir, "%s/templates/%s", t->data_dir, name) < 0 ||
        (mkdir(tdir, 0755) < 0 && errno != EEXIST)) {
        sp_tmpl__build_free(b);
        return sp_err_set(err, SP_EINTERNAL, "cannot make the template's directory");
    }
    char cpu_s[16], mem_s[16], *req_s = json_dumps(b->req, JSON_COMPACT);
    snprintf(cpu_s, sizeof cpu_s, "%d", b->cpu_count);
    snprintf(mem_s, sizeof mem_s, "%d", b->memory_mb);
    const char *params[] = {b->id,  b->team, name,  parent, br.description ? br.description : "",
                            cpu_s, mem_s,   req_s, reserved != NULL ? "true" : "false",
                            image != NULL ? "true" : "false", b->tags_given ? "true" : "false",
                            rsecret != NULL ? rsecret : "", t->wid};
    /* The parent must be usable by the team; the name must be free or the team's own (a
     * built-in or another team's is not). The templates row of a new name says "building"
     * until its first build ends; an existing one stays as it is (its version in service). */
    struct accept *acc = sp_store_call(
        t->store,
        /* a registry password from a team secret: the secret must be there */
        "WITH s AS (SELECT $12 = '' OR EXISTS (SELECT 1 FROM secrets WHERE team_id = $2"
        "  AND name = $12) AS ok),"
        " p AS (SELECT 1 FROM templates WHERE name = $4 AND deleted_at IS NULL"
        "  AND status = 'ready' AND (team_id IS NULL OR team_id = $2) AND (SELECT ok FROM s)"
        "  UNION ALL SELECT 1 WHERE $10::bool AND (SELECT ok FROM s)),"
        /* an image: no parent template to check */
        " n AS (INSERT INTO templates (name, description, cpu_count, memory_mb, status, team_id,"
        "  parent) SELECT $3, $5, $6::int, $7::int, 'building', $2,"
        "  CASE WHEN $10::bool THEN NULL ELSE $4 END WHERE EXISTS (SELECT 1"
        "  FROM p) ON CONFLICT (name) DO UPDATE SET updated_at = now()"
        "  WHERE templates.team_id = $2 RETURNING 1),"
        " b AS (INSERT INTO template_builds (id, team_id, template, status, request, worker_id)"
        "  SELECT $1, $2, $3, 'queued', $8::jsonb, nullif($13, '') WHERE EXISTS (SELECT 1"
        "  FROM n) AND $9::bool IS NOT TRUE RETURNING created_at),"
        /* a reserved build (sp_tmpl_reserve) turns from waiting to queued */
        /* ... keeping the tags it was reserved with unless the request names others */
        " r AS (UPDATE template_builds SET status = 'queued', worker_id = nullif($13, ''),"
        "  request = CASE WHEN $11::bool"
        "  OR NOT (template_builds.request ? 'tags') THEN $8::jsonb"
        "  ELSE $8::jsonb || jsonb_build_object('tags', template_builds.request->'tags') END"
        "  WHERE $9::bool AND id = $1 AND team_id = $2 AND template = $3 AND status = 'waiting'"
        "  AND EXISTS (SELECT 1 FROM n) RETURNING created_at, request->'tags' AS tags)"
        " SELECT (SELECT count(*) FROM p), (SELECT count(*) FROM n),"
        "  coalesce((SELECT " SP_TMPL__TS("created_at") " FROM b),"
        "  (SELECT " SP_TMPL__TS("created_at") " FROM r), ''),"
        "  coalesce((SELECT tags FROM r), $8::jsonb->'tags')::text, (SELECT ok FROM s)",
        13, params, sizeof(*acc), on_accepted, err);
    free(req_s);
    if (acc == NULL) {
        sp_tmpl__build_free(b);
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
    if (wait_ms == 0)
        return read_build(t, a->team_id, name, id, cb, arg, err);
    struct waiter *w = calloc(1, sizeof(*w));
    if (w == NULL)
        return sp_err_set(err, SP_EINTERNAL, "out of memory");
    w->t = t;
    w->b = b;
    w->remote = b == NULL;
    w->auth = *a;
    sp_tmpl__copy(w->name, sizeof w->name, name);
    sp_tmpl__copy(w->id, sizeof w->id, id);
    w->cb = cb;
    w->arg = arg;
    sp_timer_init(&w->timer, t->loop, on_waiter_timer, w);
    sp_timer_init(&w->retry, t->loop, on_remote_retry, w);
    struct waiter **head = w->remote ? &t->remote : &b->waiters;
    w->next = *head;
    *head = w;
    if (w->remote && remote_check(w, err) < 0) {
        waiter_unlink(w);
        free(w);
        return -1;
    }
    sp_timer_start(&w->timer, wait_ms);
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
    char d[PATH_MAX], p[PATH_MAX];
    FILE *f = log_path(q->t, q->id, d, sizeof d, p, sizeof p) == 0 ? fopen(p, "re") : NULL;
    if (f == NULL && q->t->shared_dir[0] != '\0' && /* one written before the shared dir */
        sp_tmpl__pathf(p, sizeof p, "%s/builds/%s.ndjson", q->t->data_dir, q->id) == 0)
        f = fopen(p, "re");
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
    sp_tmpl__copy(q->id, sizeof q->id, id);
    q->offset = offset;
    q->max_lines = max_lines > 0 ? max_lines : 10000;
    q->cb = cb;
    q->arg = arg;
    return 0;
}

static void namereq_done(void *rec, PGresult *res, const sp_err_t *err)
{
    struct sp_tmpl__namereq *q = rec;
    sp_err_t e;
    const sp_err_t *why = sp_store_one_row(res, err, SP_EINTERNAL, "no answer", &e);
    if (why == NULL)
        why = q->judge(q, res, &e);
    if (why == NULL)
        sp_tmpl__collect(q->t, q->name);
    q->cb(q->arg, why);
}

int sp_tmpl__namereq_send(sp_tmpl_t *t, const char *sql, int n, const char *const *p,
                          const char *name,
                          const sp_err_t *(*judge)(struct sp_tmpl__namereq *q, const PGresult *res,
                                                   sp_err_t *e),
                          sp_svc_done_cb cb, void *arg, sp_err_t *err)
{
    struct sp_tmpl__namereq *q = sp_store_call(t->store, sql, n, p, sizeof(*q), namereq_done, err);
    if (q == NULL)
        return -1;
    q->t = t;
    sp_tmpl__copy(q->name, sizeof q->name, name);
    q->judge = judge;
    q->cb = cb;
    q->arg = arg;
    return 0;
}

/* Columns: templates deleted (0 or 1), whether the name is a built-in template's. */
static const sp_err_t *judge_deleted(struct sp_tmpl__namereq *q, const PGresult *res, sp_err_t *e)
{
    if (PQgetvalue(res, 0, 0)[0] == '0') {
        if (strcmp(PQgetvalue(res, 0, 1), "t") == 0)
            sp_err_set(e, SP_EFORBIDDEN, "template '%s' is built in: it cannot be deleted",
                       q->name);
        else
            sp_err_set(e, SP_ENOTFOUND, "template not found");
        return e;
    }
    if (sp_tmpl__set_current(q->t, q->name, NULL) < 0)
        sp_log(SP_LOG_WARN, "tmpl", "cannot unlink current of deleted template=%s", q->name);
    sp_log(SP_LOG_INFO, "tmpl", "template deleted template=%s", q->name);
    return NULL;
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
    return sp_tmpl__namereq_send(
        t,
        "WITH d AS (UPDATE templates SET deleted_at = now(), status = 'deleted',"
        "  updated_at = now() WHERE name = $1 AND team_id = $2 AND deleted_at IS NULL"
        "  RETURNING 1),"
        /* its tags go with the name; versions its sandboxes use stay (collect) */
        " g AS (DELETE FROM template_tags WHERE template = $1 AND EXISTS (SELECT 1 FROM d)"
        "  RETURNING 1)"
        " SELECT (SELECT count(*) FROM d) + 0 * (SELECT count(*) FROM g),"
        "  coalesce((SELECT team_id IS NULL FROM templates WHERE name = $1), false)",
        2, p, name, judge_deleted, cb, arg, err);
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
            sp_tmpl__pathf(wdir, sizeof wdir, "%s/templates/%s/.build-%s", t->data_dir, name,
                           id) == 0)
            sp_tmpl__discard(t, wdir);
    }
}

/* A template snapshot seed ("bs-<pid>-<vm>") a process that is gone left, or this one's
 * before a restart with the same pid (no build runs yet). */
static void drop_leftover_seed(const char *id, long long committed_s, void *arg)
{
    sp_tmpl_t *t = arg;
    (void)committed_s;
    long pid = strtol(id + strlen(SP_TMPL_SEED_PREFIX), NULL, 10);
    if (pid > 0 && pid != (long)getpid() && (kill((pid_t)pid, 0) == 0 || errno != ESRCH))
        return; /* a live process's, sharing this data dir */
    sp_err_t e;
    sp_log(SP_LOG_INFO, "tmpl", "removing a leftover template snapshot seed %s", id);
    if (t->driver->ops->checkpoint_delete(t->driver, id, &e) < 0)
        sp_log(SP_LOG_WARN, "tmpl", "cannot remove seed %s: %s", id, e.msg);
}

/* Builder VMs left on the data dir by a process that stopped mid-build, whatever database it
 * used (its records may be elsewhere): no build runs yet, so every "bld-*" VM is a leftover. */
static void destroy_leftover_builders(sp_tmpl_t *t)
{
    char dir[PATH_MAX];
    if (t->driver == NULL || sp_tmpl__pathf(dir, sizeof dir, "%s/vms", t->data_dir) < 0)
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
    sp_err_t e;
    if (t->driver->ops->checkpoint_list != NULL && t->driver->ops->checkpoint_delete != NULL &&
        t->driver->ops->checkpoint_list(t->driver, SP_TMPL_SEED_PREFIX, drop_leftover_seed, t, &e) <
            0)
        sp_log(SP_LOG_WARN, "tmpl", "cannot list leftover seeds: %s", e.msg);
}

/* How often versions and the build cache (images, uploaded files) are looked over: half the
 * cache's time to live, within 1 s .. 10 min. */
uint64_t sp_tmpl__collect_period_ms(const sp_tmpl_t *t)
{
    uint64_t s = t->cache_ttl_s / 2;
    return (s < 1 ? 1 : s > 600 ? 600 : s) * 1000u;
}

/* Whether a build not yet ended copies the team's files key (sp_tmplfiles_used_cb). */
static bool build_copies(void *arg, const char *team, const char *key)
{
    const sp_tmpl_t *t = arg;
    for (const struct build *b = t->builds; b != NULL; b = b->next) {
        json_t *steps = json_object_get(b->req, "steps");
        for (size_t i = 0; strcmp(b->team, team) == 0 && i < json_array_size(steps); i++) {
            const char *fk = json_string_value(
                json_object_get(json_object_get(json_array_get(steps, i), "copy"), "files"));
            if (fk != NULL && strcmp(fk, key) == 0)
                return true;
        }
    }
    return false;
}

/* What no event collects: a version whose last sandbox or snapshot went (deleting those does
 * not come here), an image or uploaded files whose time in the build cache ran out. */
static void on_collect_timer(sp_timer_t *tm, void *arg)
{
    sp_tmpl_t *t = arg;
    sp_err_t e;
    if (sp_tmpl__collect_all(t, &e) < 0)
        sp_log(SP_LOG_WARN, "tmpl", "template versions not collected err=%s", e.msg);
    sp_tmpl__collect_shared(t);
    sp_tmpl__collect_images(t);
    int n = sp_tmplfiles_collect(t->files, t->cache_ttl_s, build_copies, t);
    if (n > 0)
        sp_log(SP_LOG_INFO, "tmpl", "template files collected removed=%d", n);
    sp_timer_start(tm, sp_tmpl__collect_period_ms(t));
}

sp_tmpl_t *sp_tmpl_create(sp_loop_t *loop, sp_store_t *store, sp_driver_t *driver,
                          const char *data_dir, const char *worker_id, sp_err_t *err)
{
    sp_tmpl_t *t = calloc(1, sizeof(*t));
    if (t == NULL) {
        sp_err_set(err, SP_EINTERNAL, "out of memory");
        return NULL;
    }
    t->loop = loop;
    t->store = store;
    t->driver = driver;
    sp_tmpl__copy(t->data_dir, sizeof t->data_dir, data_dir);
    if ((t->files = sp_tmplfiles_create(loop, data_dir, err)) == NULL) {
        free(t);
        return NULL;
    }
    sp_tmpl__copy(t->wid, sizeof t->wid, worker_id != NULL ? worker_id : "");
    if (sp_store_listen(store, SP_TMPL_NOTIFY, on_builds_notify, t, err) < 0) {
        sp_tmplfiles_destroy(t->files);
        free(t);
        return NULL;
    }
    /* this worker's unfinished builds (and those of rows from before builds named theirs);
     * a node that runs none has none */
    const char *p[] = {t->wid};
    void *rec = sp_store_call(
        store,
        "WITH f AS (UPDATE template_builds SET status = 'failed', finished_at = now(),"
        "  error = 'the server restarted during the build'"
        "  WHERE status IN ('queued', 'building') AND $1 <> ''"
        "  AND (worker_id = $1 OR worker_id IS NULL)"
        "  RETURNING id, template, pg_notify('" SP_TMPL_NOTIFY "', id)),"
        " u AS (UPDATE templates SET status = 'failed' WHERE status = 'building'"
        "  AND name IN (SELECT template FROM f))"
        " SELECT id, template FROM f",
        1, p, sizeof(sp_tmpl_t *), on_leftovers, err);
    if (rec == NULL) {
        sp_tmplfiles_destroy(t->files);
        free(t);
        return NULL;
    }
    *(sp_tmpl_t **)rec = t;
    destroy_leftover_builders(t);
    discard_leftovers(t);
    /* versions nothing uses any more (their sandboxes went while we were down) */
    (void)sp_tmpl__collect_all(t, err); /* not fatal: each name is collected again later */
    t->cache_ttl_s = SP_TMPL_CACHE_TTL_S;
    sp_timer_init(&t->collect_timer, loop, on_collect_timer, t);
    sp_timer_init(&t->images_timer, loop, sp_tmpl__on_images_timer, t);
    sp_timer_start(&t->collect_timer, sp_tmpl__collect_period_ms(t));
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
        sp_tmpl__build_free(b);
    }
    while (t->remote != NULL) { /* the store went first: none is reading */
        struct waiter *w = t->remote;
        t->remote = w->next;
        sp_timer_stop(&w->timer);
        sp_timer_stop(&w->retry);
        free(w);
    }
    sp_tmpl__sweep_free(t);
    sp_tmpl__judges_free(t);
    sp_tmpl__imgs_free(t);
    sp_timer_stop(&t->collect_timer);
    sp_timer_stop(&t->images_timer);
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

void sp_tmpl_set_build_cache(sp_tmpl_t *t, uint64_t ttl_s)
{
    t->cache_ttl_s = ttl_s;
    sp_timer_start(&t->collect_timer, sp_tmpl__collect_period_ms(t));
}

void sp_tmpl_set_secrets(sp_tmpl_t *t, struct sp_secrets *secrets)
{
    t->secrets = secrets;
}

void sp_tmpl_set_egress(sp_tmpl_t *t, struct sp_egress *egress)
{
    t->egress = egress;
}

void sp_tmpl_set_shared_dir(sp_tmpl_t *t, const char *dir)
{
    sp_tmpl__copy(t->shared_dir, sizeof t->shared_dir, dir);
    char trash[PATH_MAX];
    if (sp_tmpl__pathf(trash, sizeof trash, "%s/templates/" SHARED_TRASH, dir) == 0)
        sp_discard_leftovers(t->loop, trash); /* published versions removed midway */
    sp_err_t e;
    if (sp_tmplfiles_set_dir(t->files, dir, &e) < 0) /* then each worker keeps its own */
        sp_log(SP_LOG_WARN, "tmpl", "template files stay in the data dir: %s", e.msg);
}

sp_tmplfiles_t *sp_tmpl_files(sp_tmpl_t *t)
{
    return t->files;
}
