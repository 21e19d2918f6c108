/*
 * tmplver.c - a template's versions and tags (tmpl.h): the `current` link that follows the
 * default tag, moving and removing tags, listing versions, and collecting the versions nothing
 * uses (no tag, no sandbox, no snapshot, no child template's image layered on it, nothing in
 * the runtime but spare clones, which go with it) from disk and their rows.
 *
 * Not here: building versions (tmplrun.c), the requests and records of builds (tmpl.c).
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
#include <sys/file.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "base/log.h"
#include "base/rmtree.h"
#include "core/control/ociimg.h"
#include "core/control/tmpl_int.h"
#include "core/runtime/qemu.h"
#include "guest/tmplbuild.h"

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
int sp_tmpl__set_current(const sp_tmpl_t *t, const char *name, const char *hash)
{
    char cur[PATH_MAX], tmp[PATH_MAX], dir[PATH_MAX];
    if (sp_tmpl__pathf(dir, sizeof dir, "%s/templates/%s", t->data_dir, name) < 0 ||
        sp_tmpl__pathf(cur, sizeof cur, "%s/current", dir) < 0 ||
        sp_tmpl__pathf(tmp, sizeof tmp, "%s/.current-%d", dir, (int)getpid()) < 0)
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

/* ---- versions: which are in use, the others removed ---- */

/* p (an array of n of size bytes, *cap of room) with room for one more: p itself, a larger
 * copy (*cap updated), or NULL (p untouched). */
static void *grow(void *p, size_t n, size_t *cap, size_t size)
{
    if (n < *cap)
        return p;
    size_t nc = *cap ? 2 * *cap : 8;
    void *q = realloc(p, nc * size);
    if (q != NULL)
        *cap = nc;
    return q;
}

/* A version dir and what the data dir says of it: the VM and sandbox snapshot dirs whose
 * vm.json names a file in it (cand_scan, a walk that may run off the loop), and whether a
 * version of any template on disk is layered on it (judge_run). */
struct cand {
    char vdir[PATH_MAX]; /* "<data>/templates/<name>/<hash>" */
    const char *hash;    /* its last component */
    bool parent;
    json_t *vms, *snaps; /* ["<dir name>", ...] */
    size_t owner;        /* the image it is of (image collection) */
    long long idle_s;    /* the image collection's: since its last use */
};

static bool cand_init(struct cand *c, const char *vdir)
{
    memset(c, 0, sizeof *c);
    if (sp_tmpl__pathf(c->vdir, sizeof c->vdir, "%s", vdir) < 0)
        return false;
    c->hash = strrchr(c->vdir, '/') + 1;
    c->vms = json_array();
    c->snaps = json_array();
    return c->vms != NULL && c->snaps != NULL;
}

static void cand_fini(struct cand *c)
{
    json_decref(c->vms);
    json_decref(c->snaps);
}

/* Adds to each of v[0..n) the dirs under <data_dir>/vms and /snapshots whose vm.json (a few
 * hundred bytes) names a file in its version dir; false when a list cannot be read. Touches
 * files only: safe off the loop. */
static bool cand_scan(const char *data_dir, struct cand *v, size_t n)
{
    static const char *const subs[] = {"vms", "snapshots"};
    for (int k = 0; k < 2; k++) {
        char dir[PATH_MAX];
        if (sp_tmpl__pathf(dir, sizeof dir, "%s/%s", data_dir, subs[k]) < 0)
            return false;
        DIR *d = opendir(dir);
        if (d == NULL) {
            if (errno != ENOENT)
                return false;
            continue;
        }
        struct dirent *de;
        while ((de = readdir(d)) != NULL) {
            char p[PATH_MAX], buf[16384];
            if (strcmp(de->d_name, ".") == 0 || strcmp(de->d_name, "..") == 0 ||
                sp_tmpl__pathf(p, sizeof p, "%s/%s/vm.json", dir, de->d_name) < 0)
                continue;
            FILE *f = fopen(p, "re");
            if (f == NULL)
                continue;
            size_t got = fread(buf, 1, sizeof buf - 1, f);
            fclose(f);
            buf[got] = '\0';
            for (size_t i = 0; i < n; i++) {
                char needle[PATH_MAX];
                if (sp_tmpl__pathf(needle, sizeof needle, "%s/", v[i].vdir) == 0 &&
                    strstr(buf, needle) != NULL)
                    json_array_append_new(k == 0 ? v[i].vms : v[i].snaps, json_string(de->d_name));
            }
        }
        closedir(d);
    }
    return true;
}

static json_t *parents_in(sp_driver_t *driver, const char *root, const char *prefix);

/* Marks which of v[0..n) a version on disk (of a template whose name starts with prefix) is
 * layered on, the template's name read from each one's vdir, and who names each (cand_scan);
 * false when that cannot be told. Touches files only: safe off the loop. */
static bool cands_read(sp_driver_t *driver, const char *data_dir, const char *prefix,
                       struct cand *v, size_t n)
{
    json_t *parents = parents_in(driver, data_dir, prefix);
    for (size_t i = 0; parents != NULL && i < n; i++) {
        const char *name = v[i].hash - 1; /* the '/' before the hash */
        while (name > v[i].vdir && name[-1] != '/')
            name--;
        char nh[600];
        snprintf(nh, sizeof nh, "%.*s@%s", (int)(v[i].hash - 1 - name), name, v[i].hash);
        v[i].parent = json_object_get(parents, nh) != NULL;
    }
    bool ok = parents != NULL && cand_scan(data_dir, v, n);
    json_decref(parents);
    return ok;
}

/* What the runtime holds of c (cand_scan found who names it): a VM (running, suspended or a
 * builder) or a sandbox snapshot. Step cache entries (tmplcache.h) naming it are deleted
 * instead: no build will start from a version that is gone, and the same inputs made again
 * later make new files. Spare clones (qemu.h: sp_qemu_spare_dir) are no use either: they only
 * serve creates of a version a tag names, so *spares tells whether there are any, for the
 * caller to let go with the version (driver.h: template_forget). Loop thread. */
static bool runtime_holds(sp_tmpl_t *t, const struct cand *c, bool *spares)
{
    size_t i;
    json_t *e;
    json_array_foreach(c->vms, i, e)
    {
        if (!sp_qemu_spare_dir(t->driver, json_string_value(e)))
            return true;
        *spares = true;
    }
    json_array_foreach(c->snaps, i, e)
    {
        const char *id = json_string_value(e);
        sp_err_t err;
        if (strncmp(id, "bc-", 3) != 0 || t->driver == NULL ||
            t->driver->ops->checkpoint_delete == NULL ||
            t->driver->ops->checkpoint_delete(t->driver, id, &err) < 0)
            return true;
    }
    return false;
}

/* Whether the child version dir vdir's image needs nothing of its parent's: the build
 * squashed it into a standalone image (driver.h: export_disk). Read from the image itself,
 * not from a record of the build, so that it holds for versions built before anything was
 * recorded, and across restarts; anything the driver cannot vouch for (no such op, an
 * unreadable or missing image) counts as a layer, keeping its parent as before. */
static bool image_standalone(sp_driver_t *drv, const char *vdir)
{
    char img[PATH_MAX];
    return drv != NULL && drv->ops->image_standalone != NULL &&
           sp_tmpl__pathf(img, sizeof img, "%s/rootfs.qcow2", vdir) == 0 &&
           drv->ops->image_standalone(drv, img) == 1;
}

/* Calls fn with every version of any template under root (the data dir, or the shared
 * snapshot dir's published ones) that names a parent version (its manifest's "parent" and
 * spec.parent_hash) and its directory, until fn returns false; -1 when the templates cannot
 * be listed. */
typedef bool (*child_fn)(void *arg, const char *parent, const char *hash, const char *cdir);
static int each_child_in(const char *root, child_fn fn, void *arg)
{
    char tdir[PATH_MAX];
    if (sp_tmpl__pathf(tdir, sizeof tdir, "%s/templates", root) < 0)
        return -1;
    DIR *d = opendir(tdir);
    if (d == NULL)
        return -1;
    bool more = true;
    struct dirent *de;
    while (more && (de = readdir(d)) != NULL) {
        char p[PATH_MAX];
        if (de->d_name[0] == '.' || sp_tmpl__pathf(p, sizeof p, "%s/%s", tdir, de->d_name) < 0)
            continue;
        DIR *vd = opendir(p);
        struct dirent *ve;
        while (more && vd != NULL && (ve = readdir(vd)) != NULL) {
            char m[PATH_MAX], cdir[PATH_MAX];
            if (strlen(ve->d_name) != SP_TMPLBUILD_HASH_LEN ||
                sp_tmpl__pathf(cdir, sizeof cdir, "%s/%s", p, ve->d_name) < 0 ||
                sp_tmpl__pathf(m, sizeof m, "%s/manifest.json", cdir) < 0)
                continue;
            json_t *man = json_load_file(m, 0, NULL);
            const char *pn = json_string_value(json_object_get(man, "parent"));
            const char *ph =
                json_string_value(json_object_get(json_object_get(man, "spec"), "parent_hash"));
            if (pn != NULL && ph != NULL)
                more = fn(arg, pn, ph, cdir);
            json_decref(man);
        }
        if (vd != NULL)
            closedir(vd);
    }
    closedir(d);
    return 0;
}

/* Before a version's files go, the driver lets go of what it made of it (its spares, the sizes
 * it keeps them of); false when the version must stay: a driver that cannot forget leaves its
 * spares keeping it. */
static bool let_go(sp_tmpl_t *t, const char *name, const char *hash, bool spares)
{
    const sp_driver_ops_t *ops = t->driver != NULL ? t->driver->ops : NULL;
    if (ops != NULL && ops->template_forget != NULL) {
        ops->template_forget(t->driver, name, hash);
        return true;
    }
    return !spares;
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

/* A template's versions that the database says nothing holds, judged: a job (SP_WORK_LONG)
 * lists them and reads what the data dir says of them (every template's manifests, every VM
 * and sandbox snapshot's vm.json), the loop then decides with what only it knows (builds,
 * spares, step cache entries) and removes. */
struct judge {
    struct judge *next; /* in t->judges */
    sp_tmpl_t *t;       /* NULL once the module let go: judge_done frees */
    sp_work_t *work;
    sp_driver_t *driver;
    char name[65];
    char data_dir[PATH_MAX];
    char *in_use; /* "{h1,h2}" (owned) */
    char target[128];
    bool deleted;
    struct cand *v;
    size_t n;
    bool unknown; /* what holds them could not be told: nothing goes */
};

static void judge_run(sp_work_t *w, void *arg)
{
    (void)w;
    struct judge *j = arg;
    char tdir[PATH_MAX];
    if (sp_tmpl__pathf(tdir, sizeof tdir, "%s/templates/%s", j->data_dir, j->name) < 0)
        return;
    DIR *d = opendir(tdir);
    struct dirent *de;
    size_t cap = 0;
    while (d != NULL && !j->unknown && (de = readdir(d)) != NULL) {
        const char *h = de->d_name;
        char vdir[PATH_MAX];
        if (strlen(h) != SP_TMPLBUILD_HASH_LEN || strspn(h, "0123456789abcdef") != strlen(h) ||
            strstr(j->in_use, h) != NULL || strcmp(h, j->target) == 0 ||
            sp_tmpl__pathf(vdir, sizeof vdir, "%s/%s", tdir, h) < 0)
            continue;
        struct cand *v = grow(j->v, j->n, &cap, sizeof *v);
        if (v == NULL) {
            j->unknown = true;
            break;
        }
        j->v = v;
        j->unknown = !cand_init(&v[j->n++], vdir);
    }
    if (d != NULL)
        closedir(d);
    if (j->n == 0 || j->unknown)
        return;
    j->unknown = !cands_read(j->driver, j->data_dir, "", j->v, j->n);
}

static void judge_free(struct judge *j)
{
    for (size_t i = 0; i < j->n; i++)
        cand_fini(&j->v[i]);
    free(j->v);
    free(j->in_use);
    free(j);
}

static void judge_done(void *arg, bool cancelled)
{
    struct judge *j = arg;
    sp_tmpl_t *t = j->t;
    char tdir[PATH_MAX];
    for (struct judge **pp = t != NULL ? &t->judges : NULL; pp != NULL && *pp != NULL;
         pp = &(*pp)->next)
        if (*pp == j) {
            *pp = j->next;
            break;
        }
    if (t == NULL || cancelled || j->unknown ||
        sp_tmpl__pathf(tdir, sizeof tdir, "%s/templates/%s", t->data_dir, j->name) < 0) {
        judge_free(j);
        return;
    }
    int removed = 0;
    for (size_t i = 0; i < j->n; i++) {
        const struct cand *c = &j->v[i];
        struct stat st;
        bool building = false; /* a build of another template on it */
        for (struct build *b = t->builds; b != NULL; b = b->next)
            building =
                building || (strcmp(b->parent, j->name) == 0 && strcmp(b->pp.hash, c->hash) == 0);
        bool spares = false;
        if (building || c->parent || lstat(c->vdir, &st) < 0 /* another judgement removed it */ ||
            runtime_holds(t, c, &spares) || !let_go(t, j->name, c->hash, spares))
            continue;
        sp_log(SP_LOG_INFO, "tmpl", "removing unused template version template=%s version=%.12s",
               j->name, c->hash);
        sp_tmpl__discard(t, c->vdir);
        removed++;
        const char *p[] = {j->name, c->hash};
        sp_err_t e;
        if (sp_store_call(t->store,
                          "DELETE FROM template_versions v WHERE template = $1 AND hash = $2"
                          " AND NOT EXISTS (SELECT 1 FROM template_tags g"
                          "  WHERE g.template = $1 AND g.hash = $2)",
                          2, p, 1, on_version_row_deleted, &e) == NULL)
            sp_log(SP_LOG_WARN, "tmpl", "version row not deleted template=%s err=%s", j->name,
                   e.msg);
    }
    /* A deleted template's directory goes with its last version (a new build of the name
     * would be in t->builds, and its files would keep the directory) */
    if (j->deleted && rmdir(tdir) == 0)
        sp_log(SP_LOG_INFO, "tmpl", "deleted template's directory removed template=%s", j->name);
    if (removed > 0) {
        sp_log(SP_LOG_INFO, "tmpl", "template versions collected template=%s removed=%d", j->name,
               removed);
        sp_tmpl__collect_images(t); /* what they were layered on may be unused now */
    }
    judge_free(j);
}

void sp_tmpl__judges_free(sp_tmpl_t *t)
{
    while (t->judges != NULL) {
        struct judge *j = t->judges;
        t->judges = j->next;
        j->t = NULL; /* judge_done frees it */
        sp_work_cancel(j->work);
    }
}

/* The versions of q->name in use were read (column 0: a version needed by every version, when
 * sandboxes older than versions use the template; 1: the hashes in use; 2: the template is
 * deleted): every other version on disk that nothing else holds is removed, with its row
 * (judge_run, judge_done). */
static void on_in_use(void *rec, PGresult *res, const sp_err_t *err)
{
    struct collect *q = rec;
    sp_tmpl_t *t = q->t;
    if (err != NULL || PQntuples(res) != 1) {
        sp_log(SP_LOG_WARN, "tmpl", "template versions not collected template=%s err=%s", q->name,
               err != NULL ? err->msg : "no answer");
        return;
    }
    if (PQgetvalue(res, 0, 0)[0] == 't')
        return; /* sandboxes of unknown versions: keep them all */
    for (struct build *b = t->builds; b != NULL; b = b->next)
        if (strcmp(b->name, q->name) == 0)
            return; /* its version is not recorded yet: the next collection */
    char tdir[PATH_MAX], cur[PATH_MAX], target[128] = "";
    if (sp_tmpl__pathf(tdir, sizeof tdir, "%s/templates/%s", t->data_dir, q->name) < 0 ||
        sp_tmpl__pathf(cur, sizeof cur, "%s/current", tdir) < 0)
        return;
    ssize_t n = readlink(cur, target, sizeof target - 1);
    target[n > 0 ? n : 0] = '\0';
    bool deleted = PQgetvalue(res, 0, 2)[0] == 't';
    if (deleted && target[0] != '\0') {
        /* deleted through another node (an API node, on many workers): `current` went there,
         * not here, and holds nothing any more */
        if (sp_tmpl__set_current(t, q->name, NULL) == 0)
            target[0] = '\0';
    }
    struct judge *j = calloc(1, sizeof *j);
    if (j == NULL || (j->in_use = strdup(PQgetvalue(res, 0, 1))) == NULL) {
        free(j);
        sp_log(SP_LOG_WARN, "tmpl", "template versions not collected template=%s err=no memory",
               q->name);
        return;
    }
    j->t = t;
    j->driver = t->driver;
    j->deleted = deleted;
    sp_tmpl__copy(j->name, sizeof j->name, q->name);
    sp_tmpl__copy(j->data_dir, sizeof j->data_dir, t->data_dir);
    sp_tmpl__copy(j->target, sizeof j->target, target);
    if ((j->work = sp_loop_work(t->loop, SP_WORK_LONG, judge_run, judge_done, j)) == NULL) {
        judge_free(j);
        sp_log(SP_LOG_WARN, "tmpl", "template versions not collected template=%s err=no worker",
               q->name);
        return;
    }
    j->next = t->judges;
    t->judges = j;
}

/* What holds versions of the template named by the SQL expression T, the one rule both judges
 * read (a worker's own copies, sp_tmpl__collect; the published ones, SHARED_HELD_SQL): a
 * sandbox of it (of any state but deleted) of no recorded version, made before versions were
 * recorded, holds every version (a boolean); else the versions a tag names, a sandbox is of,
 * or a snapshot's sandbox was of are held (a one-column query of hashes, h). */
#define UNKNOWN_VERSION_SQL(T)                                                                     \
    "EXISTS (SELECT 1 FROM sandboxes s WHERE s.template = " T                                      \
    "  AND s.observed_state <> 'deleted' AND s.template_version IS NULL"                           \
    "  AND s.snapshot_id IS NULL)"
#define VERSIONS_USED_SQL(T)                                                                       \
    "SELECT hash AS h FROM template_tags WHERE template = " T                                      \
    " UNION ALL SELECT template_version FROM sandboxes WHERE template = " T                        \
    "  AND observed_state <> 'deleted' AND template_version IS NOT NULL"                           \
    " UNION ALL SELECT x.template_version FROM snapshots n JOIN sandboxes x"                       \
    "  ON x.id = n.sandbox_id WHERE n.template = " T " AND n.deleted_at IS NULL"                   \
    "  AND x.template_version IS NOT NULL"

/* Removes name's versions nothing uses (tmpl.h: versions). Asynchronous; logged. */
void sp_tmpl__collect(sp_tmpl_t *t, const char *name)
{
    const char *p[] = {name};
    sp_err_t e;
    struct collect *q = sp_store_call(
        t->store,
        "SELECT " UNKNOWN_VERSION_SQL("$1") ", coalesce(array_agg(DISTINCT h), '{}')::text,"
        " NOT EXISTS (SELECT 1 FROM templates WHERE name = $1 AND deleted_at IS NULL)"
        " FROM (" VERSIONS_USED_SQL("$1") ") u"
        " WHERE EXISTS (SELECT 1 FROM templates WHERE name = $1 AND team_id IS NOT NULL)",
        1, p, sizeof(*q), on_in_use, &e);
    if (q == NULL) {
        sp_log(SP_LOG_WARN, "tmpl", "template versions not collected template=%s err=%s", name,
               e.msg);
        return;
    }
    q->t = t;
    sp_tmpl__copy(q->name, sizeof q->name, name);
}

static void on_team_templates(void *rec, PGresult *res, const sp_err_t *err)
{
    sp_tmpl_t *t = *(sp_tmpl_t **)rec;
    if (err != NULL)
        return;
    for (int i = 0; i < PQntuples(res); i++) {
        char dir[PATH_MAX];
        struct stat st;
        /* a name with no directory here (deleted and collected, or built elsewhere) has
         * nothing to collect */
        if (sp_tmpl__pathf(dir, sizeof dir, "%s/templates/%s", t->data_dir,
                           PQgetvalue(res, i, 0)) == 0 &&
            stat(dir, &st) == 0)
            sp_tmpl__collect(t, PQgetvalue(res, i, 0));
    }
}

int sp_tmpl__collect_all(sp_tmpl_t *t, sp_err_t *err)
{
    void *rec = sp_store_call(t->store, "SELECT name FROM templates WHERE team_id IS NOT NULL", 0,
                              NULL, sizeof(sp_tmpl_t *), on_team_templates, err);
    if (rec == NULL)
        return -1;
    *(sp_tmpl_t **)rec = t;
    return 0;
}

/* ---- the shared snapshot dir's published versions ---- */

/* A published version is removed once nothing in the fleet uses it: no tag names it, no
 * sandbox (of any state but deleted) or snapshot is of it, no sandbox of the template is of
 * an unknown version, no published version of any template is layered on it, no build here
 * starts from it, no build of the template is unfinished anywhere (a build publishes its
 * version for its template snapshot before it records it: a snapshot may take longer than the
 * grace), and it was published more than two collection periods ago. Each worker
 * collects its own copies (on_in_use) from what its disk shows; a version's published copy
 * is what every worker's copies (hard links, or symlinks across file systems) and template
 * snapshots are made over, so it is judged from the database, for the whole fleet, by
 * whichever worker looks first, and its row goes in the same statement: a tag can no longer
 * be moved onto it, and a build of the same inputs makes and publishes it again. The grace
 * covers a version published by a build elsewhere that has not recorded it yet; built-in
 * templates are never judged here. The digest cache's images (oci.*) have no rows: one goes
 * when no published version is layered on it, no build in the fleet is unfinished (it may be
 * making one), none here is importing, and it was published longer ago than the grace and the
 * cache's time to live. */
#define SHARED_HELD_SQL                                                                            \
    "WITH h AS (SELECT NOT EXISTS (SELECT 1 FROM templates WHERE name = $1"                        \
    "  AND team_id IS NOT NULL) OR " UNKNOWN_VERSION_SQL("$1")                                     \
    " OR $2 IN (" VERSIONS_USED_SQL("$1") ")"                                                      \
    " OR EXISTS (SELECT 1 FROM template_builds b WHERE b.template = $1"                            \
    "  AND b.status IN ('queued', 'building')) AS held),"                                          \
    " d AS (DELETE FROM template_versions v USING h WHERE NOT h.held AND v.template = $1"          \
    "  AND v.hash = $2 RETURNING 1)"                                                               \
    " SELECT h.held, (SELECT count(*) FROM d) FROM h"

struct shared_q {
    sp_tmpl_t *t;
    char name[65];
    char hash[SP_TMPLBUILD_HASH_LEN + 1];
};

struct parents_q {
    sp_driver_t *driver;
    const char *prefix; /* parents whose name starts with it only */
    json_t *out;
};

static bool add_parent(void *arg, const char *parent, const char *hash, const char *cdir)
{
    struct parents_q *q = arg;
    char nh[600];
    if (strncmp(parent, q->prefix, strlen(q->prefix)) == 0 &&
        snprintf(nh, sizeof nh, "%s@%s", parent, hash) < (int)sizeof nh &&
        !image_standalone(q->driver, cdir))
        json_object_set_new(q->out, nh, json_true());
    return true;
}

/* The versions whose name starts with prefix that a version under root (the data dir, or the
 * shared snapshot dir's published ones) is layered on (a layer: not image_standalone):
 * {"name@hash": true, ...}; NULL when that cannot be told (nothing goes). */
static json_t *parents_in(sp_driver_t *driver, const char *root, const char *prefix)
{
    struct parents_q q = {driver, prefix, json_object()};
    if (q.out != NULL && each_child_in(root, add_parent, &q) < 0) {
        json_decref(q.out);
        return NULL;
    }
    return q.out;
}

/* ---- the sweep, off the loop ---- */

/* The published versions are on the shared file system (NFS, say), where a listing, a manifest
 * read or a lock may block for long: a job (SP_WORK_LONG) lists the versions old enough to be
 * judged and reads what the published ones are layered on, another removes a version, and the
 * loop only judges (builds here, the database). At most one listing is in flight. */
struct swept {
    char name[65];
    char hash[SP_TMPLBUILD_HASH_LEN + 1];
    bool image;
};

struct sp_tmpl__sweep {
    sp_tmpl_t *t; /* NULL once the module let go: sweep_done frees it */
    sp_driver_t *driver;
    char root[PATH_MAX]; /* the shared dir */
    time_t grace, image_grace;
    bool images;     /* the digest cache's images may be judged */
    struct swept *v; /* the versions nothing published is layered on, old enough */
    size_t n;
    sp_work_t *work;
};

static void sweep_run(sp_work_t *w, void *arg)
{
    struct sp_tmpl__sweep *sw = arg;
    char tdir[PATH_MAX];
    if (sp_tmpl__pathf(tdir, sizeof tdir, "%s/templates", sw->root) < 0)
        return;
    DIR *d = opendir(tdir);
    if (d == NULL)
        return;
    time_t now = time(NULL);
    json_t *parents = NULL; /* read once, when a version is old enough to be judged */
    bool unknown = false;   /* the published versions could not be listed: nothing goes */
    size_t cap = 0;
    struct dirent *de;
    while (!unknown && !sp_work_cancelled(w) && (de = readdir(d)) != NULL) {
        const char *name = de->d_name;
        char ndir[PATH_MAX];
        bool image = strncmp(name, SP_OCIIMG_PREFIX, strlen(SP_OCIIMG_PREFIX)) == 0;
        if (name[0] == '.' || strlen(name) > 64 || (image && !sw->images) ||
            sp_tmpl__pathf(ndir, sizeof ndir, "%s/%s", tdir, name) < 0)
            continue;
        DIR *vd = opendir(ndir);
        struct dirent *ve;
        while (!unknown && vd != NULL && (ve = readdir(vd)) != NULL) {
            const char *h = ve->d_name;
            char vdir[PATH_MAX], nh[600];
            struct stat st;
            if (strlen(h) != SP_TMPLBUILD_HASH_LEN || strspn(h, "0123456789abcdef") != strlen(h) ||
                sp_tmpl__pathf(vdir, sizeof vdir, "%s/%s", ndir, h) < 0 || lstat(vdir, &st) < 0 ||
                !S_ISDIR(st.st_mode) || st.st_mtime + (image ? sw->image_grace : sw->grace) > now)
                continue;
            if (parents == NULL && (parents = parents_in(sw->driver, sw->root, "")) == NULL) {
                unknown = true;
                break;
            }
            snprintf(nh, sizeof nh, "%s@%s", name, h);
            if (json_object_get(parents, nh) != NULL)
                continue;
            struct swept *v = grow(sw->v, sw->n, &cap, sizeof *v);
            if (v == NULL) {
                unknown = true;
                break;
            }
            sw->v = v;
            struct swept *e = &v[sw->n++];
            sp_tmpl__copy(e->name, sizeof e->name, name);
            sp_tmpl__copy(e->hash, sizeof e->hash, h);
            e->image = image;
        }
        if (vd != NULL)
            closedir(vd);
    }
    closedir(d);
    json_decref(parents);
    if (unknown)
        sw->n = 0;
}

/* A published version's removal (remove_published): moved into templates/.trash under the
 * lock publishing takes (shared.c), its template's directory with it when it was its last,
 * then unlinked, all in the job; done only logs. */
struct unpublish {
    char root[PATH_MAX];
    char name[65];
    char hash[SP_TMPLBUILD_HASH_LEN + 1];
    char why[32];
    int err;    /* errno of a lock that failed */
    bool there; /* it was there (else another worker removed it first) */
};

static void unpublish_run(sp_work_t *w, void *arg)
{
    (void)w;
    struct unpublish *u = arg;
    char tdir[PATH_MAX], lock[PATH_MAX], ndir[PATH_MAX], vdir[PATH_MAX], trash[PATH_MAX],
        to[PATH_MAX];
    static unsigned seq; /* a name per removal (jobs run on several threads) */
    if (sp_tmpl__pathf(tdir, sizeof tdir, "%s/templates", u->root) < 0 ||
        sp_tmpl__pathf(lock, sizeof lock, "%s/.lock", tdir) < 0 ||
        sp_tmpl__pathf(trash, sizeof trash, "%s/" SHARED_TRASH, tdir) < 0 ||
        sp_tmpl__pathf(ndir, sizeof ndir, "%s/%s", tdir, u->name) < 0 ||
        sp_tmpl__pathf(vdir, sizeof vdir, "%s/%s", ndir, u->hash) < 0 ||
        sp_tmpl__pathf(to, sizeof to, "%s/%s@%.12s.%d.%u", trash, u->name, u->hash, (int)getpid(),
                       __atomic_add_fetch(&seq, 1, __ATOMIC_RELAXED)) < 0) {
        u->err = ENAMETOOLONG;
        return;
    }
    int fd = open(lock, O_RDWR | O_CREAT | O_CLOEXEC, 0600);
    if (fd < 0 || flock(fd, LOCK_EX) < 0) {
        u->err = errno;
        if (fd >= 0)
            close(fd);
        return;
    }
    struct stat st;
    u->there = lstat(vdir, &st) == 0;
    bool moved = false;
    if (u->there) {
        (void)mkdir(trash, 0700);
        moved = rename(vdir, to) == 0;
        if (!moved) /* no trash to move it into: removed where it is, under the lock */
            sp_rm_rf(vdir);
    }
    bool last = u->there && rmdir(ndir) == 0; /* no publish is making a version in it: locked */
    close(fd);
    if (!u->there)
        return;
    fsync_dir(last ? tdir : ndir);
    if (moved)
        sp_rm_rf(to);
}

static void unpublish_done(void *arg, bool cancelled)
{
    struct unpublish *u = arg;
    if (u->err != 0)
        sp_log(SP_LOG_WARN, "tmpl", "published version not collected template=%s err=%s", u->name,
               strerror(u->err));
    else if (u->there && !cancelled)
        sp_log(SP_LOG_INFO, "tmpl",
               "removed a published template version nothing uses template=%s version=%.12s %s",
               u->name, u->hash, u->why);
    free(u);
}

/* name@hash's published directory goes (unpublish). why: for the log. */
static void remove_published(sp_tmpl_t *t, const char *name, const char *hash, const char *why)
{
    struct unpublish *u = calloc(1, sizeof *u);
    if (u == NULL)
        return; /* the next sweep */
    sp_tmpl__copy(u->root, sizeof u->root, t->shared_dir);
    sp_tmpl__copy(u->name, sizeof u->name, name);
    sp_tmpl__copy(u->hash, sizeof u->hash, hash);
    sp_tmpl__copy(u->why, sizeof u->why, why);
    if (sp_loop_work(t->loop, SP_WORK_LONG, unpublish_run, unpublish_done, u) == NULL)
        free(u);
}

/* The database's judgement of q's version: when nothing holds it, its row is gone and so go
 * its files. */
static void on_shared_held(void *rec, PGresult *res, const sp_err_t *err)
{
    struct shared_q *q = rec;
    if (err != NULL || PQntuples(res) != 1) {
        sp_log(SP_LOG_WARN, "tmpl", "published version not collected template=%s err=%s", q->name,
               err != NULL ? err->msg : "no answer");
        return;
    }
    char why[32];
    snprintf(why, sizeof why, "row_deleted=%s", PQgetvalue(res, 0, 1));
    if (PQgetvalue(res, 0, 0)[0] != 't')
        remove_published(q->t, q->name, q->hash, why);
}

static bool importing(const sp_tmpl_t *t);

/* The listing is back: each version no build here starts from is judged, an image by its
 * files alone (when still none is importing here), a team template's by the database. */
static void sweep_done(void *arg, bool cancelled)
{
    struct sp_tmpl__sweep *sw = arg;
    sp_tmpl_t *t = sw->t;
    if (t != NULL)
        t->sweep = NULL;
    for (size_t i = 0; t != NULL && !cancelled && i < sw->n; i++) {
        const struct swept *e = &sw->v[i];
        bool building = false; /* a build here on it, or making it (published for its
                                  * template snapshot before its row is written) */
        for (struct build *b = t->builds; b != NULL; b = b->next)
            building = building ||
                       (strcmp(b->parent, e->name) == 0 && strcmp(b->pp.hash, e->hash) == 0) ||
                       (strcmp(b->name, e->name) == 0 && strcmp(b->hash, e->hash) == 0);
        if (building || (e->image && importing(t)))
            continue;
        if (e->image) {
            remove_published(t, e->name, e->hash, "image=1");
            continue;
        }
        const char *p[] = {e->name, e->hash};
        sp_err_t err;
        struct shared_q *q =
            sp_store_call(t->store, SHARED_HELD_SQL, 2, p, sizeof(*q), on_shared_held, &err);
        if (q == NULL) {
            sp_log(SP_LOG_WARN, "tmpl", "published version not collected template=%s err=%s",
                   e->name, err.msg);
            continue;
        }
        q->t = t;
        sp_tmpl__copy(q->name, sizeof q->name, e->name);
        sp_tmpl__copy(q->hash, sizeof q->hash, e->hash);
    }
    free(sw->v);
    free(sw);
}

/* The sweep itself (sp_tmpl__collect_shared), once the database said whether any build in
 * the fleet is unfinished (builds_idle: none is). */
static void collect_shared(sp_tmpl_t *t, bool builds_idle)
{
    if (t->sweep != NULL)
        return; /* the last one is still listing */
    struct sp_tmpl__sweep *sw = calloc(1, sizeof *sw);
    if (sw == NULL)
        return;
    sw->t = t;
    sw->driver = t->driver;
    sp_tmpl__copy(sw->root, sizeof sw->root, t->shared_dir);
    sw->grace = (time_t)(2 * sp_tmpl__collect_period_ms(t) / 1000);
    /* an image (the digest cache's) is judged by its files alone: no build anywhere may be
     * making a version over it, and it stays the cache's time to live after it was published */
    sw->image_grace = sw->grace > (time_t)t->cache_ttl_s ? sw->grace : (time_t)t->cache_ttl_s;
    sw->images = builds_idle && !importing(t);
    if ((sw->work = sp_loop_work(t->loop, SP_WORK_LONG, sweep_run, sweep_done, sw)) == NULL) {
        free(sw);
        return;
    }
    t->sweep = sw;
}

void sp_tmpl__sweep_free(sp_tmpl_t *t)
{
    if (t->sweep == NULL)
        return;
    t->sweep->t = NULL; /* sweep_done frees it */
    sp_work_cancel(t->sweep->work);
    t->sweep = NULL;
}

static void on_builds_unfinished(void *rec, PGresult *res, const sp_err_t *err)
{
    sp_tmpl_t *t = *(sp_tmpl_t **)rec;
    /* not known: the team templates' versions are judged all the same, images not */
    collect_shared(t, err == NULL && PQntuples(res) == 1 && PQgetvalue(res, 0, 0)[0] == 'f');
}

void sp_tmpl__collect_shared(sp_tmpl_t *t)
{
    sp_err_t e;
    if (t->shared_dir[0] == '\0')
        return;
    void *rec = sp_store_call(t->store,
                              "SELECT EXISTS (SELECT 1 FROM template_builds"
                              " WHERE status IN ('queued', 'building'))",
                              0, NULL, sizeof(sp_tmpl_t *), on_builds_unfinished, &e);
    if (rec == NULL)
        collect_shared(t, false);
    else
        *(sp_tmpl_t **)rec = t;
}

/* ---- images: the digest cache's hidden templates (ociimg.h) ---- */

/* Whether an import is in flight here: it may be filling, or about to build on, any image's
 * directory (its result reaches the build on this loop later). */
static bool importing(const sp_tmpl_t *t)
{
    for (const struct build *b = t->builds; b != NULL; b = b->next)
        if (b->imp != NULL)
            return true;
    return false;
}

/* The digest cache's images, collected off the loop: a job (SP_WORK_LONG) takes each
 * image's lock (held until the loop has judged it; another process sharing the data dir
 * importing it holds it: next time), lists its versions, and reads what holds them (the
 * versions layered on them, the VMs and snapshots naming them: cand_scan); the loop judges.
 * A version goes when nothing holds it (no build on it, no version of any template layered
 * on it, nothing in the runtime) and, for the current one, when it was last used (its
 * directory's mtime: the import touches it on every hit) at least cache_ttl_s ago. The others
 * can never be hit again: the agent or kernel they were made with is not this server's. The
 * image's directory goes with its last version. */
struct img {
    char name[128];
    char dir[PATH_MAX];
    char target[128]; /* `current` */
    int lock;         /* its lock's fd, held; -1: none */
    int kept, removed;
};

struct sp_tmpl__imgs {
    sp_tmpl_t *t; /* NULL once the module let go: imgs_done frees */
    sp_driver_t *driver;
    sp_work_t *work;
    char data_dir[PATH_MAX];
    uint64_t ttl_s;
    struct img *im;
    size_t nim;
    struct cand *v; /* their versions to judge (owner: the index in im) */
    size_t n;
    bool unknown;
};

static void imgs_list(struct sp_tmpl__imgs *g, size_t k, time_t now, size_t *cap)
{
    struct img *im = &g->im[k];
    char cur[PATH_MAX];
    if (sp_tmpl__pathf(cur, sizeof cur, "%s/current", im->dir) < 0)
        return;
    ssize_t n = readlink(cur, im->target, sizeof im->target - 1);
    im->target[n > 0 ? n : 0] = '\0';
    DIR *d = opendir(im->dir);
    struct dirent *de;
    while (d != NULL && !g->unknown && (de = readdir(d)) != NULL) {
        const char *h = de->d_name;
        char vdir[PATH_MAX];
        struct stat st;
        if (h[0] == '.' || strcmp(h, "current") == 0)
            continue;
        if (strlen(h) != SP_TMPLBUILD_HASH_LEN || strspn(h, "0123456789abcdef") != strlen(h) ||
            sp_tmpl__pathf(vdir, sizeof vdir, "%s/%s", im->dir, h) < 0 || stat(vdir, &st) < 0 ||
            (strcmp(h, im->target) == 0 && st.st_mtime + (time_t)g->ttl_s > now)) {
            im->kept++; /* not ours to judge, or the current one, used lately */
            continue;
        }
        struct cand *v = grow(g->v, g->n, cap, sizeof *v);
        if (v == NULL) {
            g->unknown = true;
            break;
        }
        g->v = v;
        g->unknown = !cand_init(&v[g->n], vdir);
        v[g->n].owner = k;
        v[g->n++].idle_s = (long long)(now - st.st_mtime);
    }
    if (d != NULL)
        closedir(d);
}

static void imgs_run(sp_work_t *w, void *arg)
{
    (void)w;
    struct sp_tmpl__imgs *g = arg;
    char tdir[PATH_MAX];
    if (sp_tmpl__pathf(tdir, sizeof tdir, "%s/templates", g->data_dir) < 0)
        return;
    DIR *d = opendir(tdir);
    if (d == NULL)
        return;
    time_t now = time(NULL);
    size_t icap = 0, vcap = 0;
    struct dirent *de;
    while (!g->unknown && (de = readdir(d)) != NULL) {
        char idir[PATH_MAX], lk[PATH_MAX];
        if (strncmp(de->d_name, SP_OCIIMG_PREFIX, strlen(SP_OCIIMG_PREFIX)) != 0 ||
            strlen(de->d_name) >= sizeof g->im[0].name ||
            sp_tmpl__pathf(idir, sizeof idir, "%s/%s", tdir, de->d_name) < 0 ||
            sp_tmpl__pathf(lk, sizeof lk, "%s/.lock", idir) < 0)
            continue;
        int fd = open(lk, O_RDWR | O_CREAT | O_CLOEXEC, 0600);
        if (fd >= 0 && flock(fd, LOCK_EX | LOCK_NB) < 0) {
            close(fd);
            fd = -1;
        }
        struct img *im = fd >= 0 ? grow(g->im, g->nim, &icap, sizeof *im) : NULL;
        if (im == NULL) {
            if (fd >= 0)
                close(fd);
            continue;
        }
        g->im = im;
        im = &g->im[g->nim++];
        memset(im, 0, sizeof *im);
        im->lock = fd;
        sp_tmpl__copy(im->name, sizeof im->name, de->d_name);
        sp_tmpl__copy(im->dir, sizeof im->dir, idir);
        imgs_list(g, g->nim - 1, now, &vcap);
    }
    closedir(d);
    if (g->n == 0 || g->unknown)
        return;
    g->unknown = !cands_read(g->driver, g->data_dir, SP_OCIIMG_PREFIX, g->v, g->n);
}

static void imgs_free(struct sp_tmpl__imgs *g)
{
    for (size_t i = 0; i < g->nim; i++)
        if (g->im[i].lock >= 0)
            close(g->im[i].lock);
    for (size_t i = 0; i < g->n; i++)
        cand_fini(&g->v[i]);
    free(g->im);
    free(g->v);
    free(g);
}

static void imgs_done(void *arg, bool cancelled)
{
    struct sp_tmpl__imgs *g = arg;
    sp_tmpl_t *t = g->t;
    if (t != NULL)
        t->imgs = NULL;
    if (t == NULL || cancelled || g->unknown || importing(t)) {
        imgs_free(g);
        return;
    }
    int removed = 0;
    for (size_t i = 0; i < g->n; i++) {
        const struct cand *c = &g->v[i];
        struct img *im = &g->im[c->owner];
        bool building = false, spares = false;
        for (struct build *b = t->builds; b != NULL; b = b->next)
            building =
                building || (strcmp(b->parent, im->name) == 0 && strcmp(b->pp.hash, c->hash) == 0);
        if (building || c->parent || runtime_holds(t, c, &spares) ||
            !let_go(t, im->name, c->hash, spares)) {
            im->kept++;
            continue;
        }
        sp_log(SP_LOG_INFO, "tmpl",
               "removing an unused image template=%s version=%.12s idle_s=%lld", im->name, c->hash,
               c->idle_s);
        char cur[PATH_MAX];
        if (strcmp(c->hash, im->target) == 0 &&
            sp_tmpl__pathf(cur, sizeof cur, "%s/current", im->dir) == 0)
            unlink(cur);
        sp_tmpl__discard(t, c->vdir);
        im->removed++;
        removed++;
    }
    /* an image's directory goes with its last version, its lock file too (ociimg.c opens it
     * again) */
    for (size_t k = 0; k < g->nim; k++)
        if (g->im[k].kept == 0 && g->im[k].removed > 0)
            sp_tmpl__discard(t, g->im[k].dir);
    if (removed > 0)
        sp_log(SP_LOG_INFO, "tmpl", "images collected removed=%d", removed);
    imgs_free(g);
}

void sp_tmpl__collect_images(sp_tmpl_t *t)
{
    if (!sp_timer_armed(&t->images_timer))
        sp_timer_start(&t->images_timer, SP_TMPL_IMAGES_AFTER_MS);
}

void sp_tmpl__on_images_timer(sp_timer_t *tm, void *arg)
{
    (void)tm;
    sp_tmpl_t *t = arg;
    if (importing(t) || t->imgs != NULL)
        return; /* one in flight: the caller's pass is the next timer's */
    struct sp_tmpl__imgs *g = calloc(1, sizeof *g);
    if (g == NULL)
        return;
    g->t = t;
    g->driver = t->driver;
    g->ttl_s = t->cache_ttl_s;
    sp_tmpl__copy(g->data_dir, sizeof g->data_dir, t->data_dir);
    if ((g->work = sp_loop_work(t->loop, SP_WORK_LONG, imgs_run, imgs_done, g)) == NULL) {
        free(g);
        return;
    }
    t->imgs = g;
}

void sp_tmpl__imgs_free(sp_tmpl_t *t)
{
    if (t->imgs == NULL)
        return;
    t->imgs->t = NULL; /* imgs_done frees it */
    sp_work_cancel(t->imgs->work);
    t->imgs = NULL;
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
    sp_tmpl__copy(r.template_name, sizeof r.template_name, q->name);
    SP_STORE_TEXT(res, 0, 2, r.hash);
    SP_STORE_TEXT(res, 0, 3, r.build_id);
    SP_STORE_TEXT(res, 0, 4, r.created_at);
    if (q->is_default && sp_tmpl__set_current(q->t, q->name, r.hash) < 0)
        sp_log(SP_LOG_ERROR, "tmpl", "cannot point current at the default tag template=%s",
               q->name);
    sp_tmpl__collect(q->t, q->name);
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
        return sp_err_set(err, SP_EINVAL,
                          "version must be a version's hash (at least 8 of its "
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
    /* SQL with SP_TMPL__TS between its strings: clang-format would break it apart */
    /* clang-format off */
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
        "  coalesce((SELECT " SP_TMPL__TS("max(created_at)") " FROM g), ''),"
        "  (SELECT count(*) FROM u)",
        6, p, sizeof(*q), on_tag_set, err);
    /* clang-format on */
    free(tj);
    if (q == NULL)
        return -1;
    q->t = t;
    sp_tmpl__copy(q->name, sizeof q->name, name);
    q->is_default = is_default;
    q->cb = cb;
    q->arg = arg;
    return 0;
}

/* Columns: whether the template is the team's, the first tag asked for that it lacks ("" when
 * none). */
static const sp_err_t *judge_untagged(struct sp_tmpl__namereq *q, const PGresult *res, sp_err_t *e)
{
    if (PQgetvalue(res, 0, 0)[0] != 't') {
        sp_err_set(e, SP_ENOTFOUND, "template '%s' not found", q->name);
        return e;
    }
    if (PQgetvalue(res, 0, 1)[0] != '\0') {
        sp_err_set(e, SP_ENOTFOUND, "tag '%s' does not exist for template '%s'",
                   PQgetvalue(res, 0, 1), q->name);
        return e;
    }
    return NULL;
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
    int rc = sp_tmpl__namereq_send(
        t,
        "WITH m AS (SELECT name FROM templates WHERE name = $1 AND team_id = $2"
        "  AND deleted_at IS NULL),"
        " w AS (SELECT x AS tag FROM jsonb_array_elements_text($3::jsonb) x),"
        " miss AS (SELECT min(tag) AS tag FROM w WHERE NOT EXISTS (SELECT 1 FROM template_tags g"
        "  WHERE g.template = $1 AND g.tag = w.tag)),"
        " d AS (DELETE FROM template_tags g USING m WHERE g.template = m.name"
        "  AND g.tag IN (SELECT tag FROM w) AND (SELECT tag FROM miss) IS NULL RETURNING 1)"
        " SELECT EXISTS (SELECT 1 FROM m), coalesce((SELECT tag FROM miss), ''),"
        "  (SELECT count(*) FROM d)",
        3, p, name, judge_untagged, cb, arg, err);
    free(tj);
    return rc;
}

/* The document as the database made it: sizes are the versions' records (the image's size
 * when it was built), the same on every node, and nothing here touches the disk. */
static void on_versions(void *rec, PGresult *res, const sp_err_t *err)
{
    sp_store_req_t *q = rec;
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
    cb(q->arg, doc, NULL);
    json_decref(doc);
}

int sp_tmpl_versions(sp_tmpl_t *t, const sp_auth_t *a, const char *name, sp_tmpl_json_cb cb,
                     void *arg, sp_err_t *err)
{
    if (!sp_tmplbuild_valid_name(name))
        return sp_err_set(err, SP_ENOTFOUND, "template not found");
    const char *p[] = {name, a->team_id};
    /* SQL with SP_TMPL__TS between its strings: clang-format would break it apart */
    /* clang-format off */
    return sp_store_submit(
        t->store,
        "SELECT json_build_object('name', m.name,"
        " 'tags', coalesce((SELECT json_agg(json_build_object('tag', g.tag, 'version', g.hash,"
        "  'build_id', v.build_id, 'created_at', " SP_TMPL__TS("g.created_at") ")"
        "  ORDER BY g.tag)"
        "  FROM template_tags g JOIN template_versions v ON v.template = g.template"
        "  AND v.hash = g.hash WHERE g.template = m.name), '[]'::json),"
        " 'versions', coalesce((SELECT json_agg(json_build_object('version', v.hash,"
        "  'build_id', v.build_id, 'created_at', " SP_TMPL__TS("v.created_at") ","
        "  'cpu_count', v.cpu_count, 'memory_mb', v.memory_mb, 'disk_mb', v.disk_mb,"
        "  'size_bytes', v.size_bytes,"
        "  'tags', coalesce((SELECT json_agg(g.tag ORDER BY g.tag) FROM template_tags g"
        "   WHERE g.template = v.template AND g.hash = v.hash), '[]'::json),"
        "  'sandboxes', (SELECT count(*) FROM sandboxes s WHERE s.template = v.template"
        "   AND s.template_version = v.hash AND s.observed_state <> 'deleted'))"
        "  ORDER BY v.created_at DESC) FROM template_versions v WHERE v.template = m.name),"
        "  '[]'::json),"
        " 'builds', coalesce((SELECT json_agg(json_build_object('id', b.id, 'status', b.status,"
        "  'version', b.hash, 'tags', b.request->'tags',"
        "  'created_at', " SP_TMPL__TS("b.created_at") ","
        "  'error', b.error) ORDER BY b.created_at DESC) FROM (SELECT * FROM template_builds b"
        "  WHERE b.template = m.name AND b.team_id = $2 ORDER BY b.created_at DESC LIMIT 20) b),"
        "  '[]'::json))::text"
        " FROM templates m WHERE m.name = $1 AND m.team_id = $2 AND m.deleted_at IS NULL",
        2, p, on_versions, t, (void *)cb, arg, 0, err);
    /* clang-format on */
}
