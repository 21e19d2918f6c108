/*
 * tmplrun.c - a template build's course (tmpl_int.h: struct build): the queue, the builder VM
 * (boot, from the step cache or not; the steps, copy steps among them; the env file; pause,
 * the disk's export and the seed its template snapshot is made from), the pull of an image
 * parent on a worker thread, the step cache hook (tmplcache.h), committing the new version's
 * files, its template snapshot, the build's log and the record of how it ended.
 *
 * Not here: validating requests and reading records (tmpl.c), versions, tags and their
 * collection (tmplver.c).
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
#include "base/log.h"
#include "core/channel/exec.h"
#include "core/control/ociimg.h"
#include "core/control/tmpl_int.h"
#include "core/control/tmplcache.h"
#include "core/control/tmplfiles.h"
#include "core/egress/egress.h"
#include "core/egress/secrets.h"
#include "core/runtime/qemu.h"
#include "guest/tmplbuild.h"

#define LINE_MAX_B 8192 /* a longer output line is split */
#define ENV_FILE "/etc/space/template.env"
/* Steps that ran longer than a step cache snapshot takes (tmplcache.h; as the last one took, at
 * least STEP_CACHE_MS, at most STEP_CACHE_MAX_MS) since the builder came up or its last one
 * get one: quicker ones cost every build more than running them again costs a rebuild. A
 * snapshot stops the builder for it: a few hundred ms under KVM, 1-2 s under TCG. */
#define STEP_CACHE_MS     1000u
#define STEP_CACHE_MAX_MS 2500u

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
        o = json_pack("{s:s,s:s,s:i,s:s,s:s}", "ts", when, "level", level, "step", step, "stream",
                      stream, "line", clean);
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
    if (n >= SP_TMPL__TAIL_MAX) {
        p += n - (SP_TMPL__TAIL_MAX - 1);
        n = SP_TMPL__TAIL_MAX - 1;
    }
    if (b->tail_len + n >= SP_TMPL__TAIL_MAX) {
        size_t drop = b->tail_len + n - (SP_TMPL__TAIL_MAX - 1);
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
    int step = b->growing ? 0 : (int)b->step + 1; /* the disk's grow is before step 1 */
    if (n > 0)
        tail_add(b, p, n);
    for (size_t i = 0; i < n; i++) {
        if (p[i] == '\n' || lb->len >= LINE_MAX_B) {
            log_raw(b, "info", step, names[fd], (const char *)lb->p, lb->len);
            sp_buf_reset(lb);
            if (p[i] == '\n')
                continue;
        }
        sp_buf_add(lb, p + i, 1);
    }
    if (final && lb->len > 0) {
        log_raw(b, "info", step, names[fd], (const char *)lb->p, lb->len);
        sp_buf_reset(lb);
    }
}

/* ---- the build's course ---- */

static void advance(struct build *b);
static bool has_default(const struct build *b);

/* What the step cache keys a build's builder on besides its steps: the snapshot it starts
 * from, else its parent's version. */
static const char *cache_parent(const struct build *b)
{
    return b->snapshot[0] != '\0' ? b->snapshot : b->pp.hash;
}

/* The new version's disk: as asked, else its parent's. */
static int disk_mb_of(const struct build *b)
{
    return b->disk_mb > 0 ? b->disk_mb : b->pp.disk_mb;
}

static void wipe_free(char *s)
{
    if (s != NULL) {
        sodium_memzero(s, strlen(s));
        free(s);
    }
}

void sp_tmpl__build_free(struct build *b)
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
    free(b->reg_secret);
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

void sp_tmpl__on_deadline(sp_timer_t *tm, void *arg)
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
    sp_tmpl__copy(name, sizeof name, b->name);
    b->waiters = NULL;
    sp_tmpl__build_free(b);
    if (moved)
        sp_tmpl__collect(t, name);
    while (ws != NULL) {
        struct waiter *n = ws->next;
        ws->b = NULL;
        sp_tmpl__waiter_answer(ws);
        ws = n;
    }
    sp_tmpl__start_queued(t);
}

/* The seed goes once the template snapshot is made or the build ended without it. */
static void drop_seed(struct build *b)
{
    sp_err_t e;
    if (b->seed[0] != '\0' && b->t->driver->ops->checkpoint_delete(b->t->driver, b->seed, &e) < 0)
        sp_log(SP_LOG_WARN, "tmpl", "cannot delete the template snapshot seed %s: %s", b->seed,
               e.msg);
    b->seed[0] = '\0';
}

static void record_end(struct build *b)
{
    drop_seed(b);
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
            "  WHERE id = $1 RETURNING pg_notify('" SP_TMPL_NOTIFY "', id))"
            " UPDATE templates SET status = 'failed', updated_at = now()"
            " WHERE name = $4 AND status = 'building' AND (SELECT count(*) FROM b) >= 0",
            4, p, sizeof(struct build *), on_recorded, &e);
    } else {
        const json_t *desc = json_object_get(b->req, "description");
        char cpus[16], mem[16], disk[16], size[24];
        snprintf(cpus, sizeof cpus, "%d", b->cpu_count);
        snprintf(mem, sizeof mem, "%d", b->memory_mb);
        snprintf(disk, sizeof disk, "%d", disk_mb_of(b));
        snprintf(size, sizeof size, "%lld", b->size_bytes);
        env = json_dumps(b->env, JSON_COMPACT);
        char *tags = json_dumps(json_object_get(b->req, "tags"), JSON_COMPACT);
        const char *p[] = {b->id,
                           b->hash,
                           b->cached ? "true" : "false",
                           b->name,
                           desc != NULL ? json_string_value(desc) : NULL,
                           cpus,
                           mem,
                           env,
                           b->parent,
                           tags ? tags : "[\"default\"]",
                           has_default(b) ? "true" : "false",
                           disk_mb_of(b) > 0 ? disk : NULL,
                           b->size_bytes >= 0 ? size : NULL};
        /* the version (its first build's id kept), its tags moved to it; the templates row
         * describes the default tag's version */
        rec = sp_store_call(
            b->t->store,
            "WITH b AS (UPDATE template_builds SET status = 'succeeded', hash = $2,"
            "  cached = $3::bool, finished_at = now(), started_at = coalesce(started_at, now())"
            "  WHERE id = $1 RETURNING pg_notify('" SP_TMPL_NOTIFY "', id)),"
            " v AS (INSERT INTO template_versions (template, hash, build_id, cpu_count, memory_mb,"
            "  env, disk_mb, size_bytes)"
            "  VALUES ($4, $2, $1, $6::int, $7::int, $8::jsonb, $12::int, $13::bigint)"
            "  ON CONFLICT (template, hash) DO UPDATE SET"
            "  disk_mb = coalesce(template_versions.disk_mb, EXCLUDED.disk_mb),"
            "  size_bytes = coalesce(template_versions.size_bytes, EXCLUDED.size_bytes)"
            "  RETURNING 1),"
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
            13, p, sizeof(struct build *), on_recorded, &e);
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

static void work_dir(const struct build *b, char *out, size_t n)
{
    if (sp_tmpl__pathf(out, n, "%s/templates/%s/.build-%s", b->t->data_dir, b->name, b->id) < 0)
        out[0] = '\0';
}

/* The warmup the template snapshot builder runs (as root): the template's env, then as the
 * template's user in its workdir start_cmd in the background and ready_cmd until it passes.
 * One shell as the user does both (its log opened by root on fd 3): a runuser per poll costs
 * as much CPU as the poll, and the guest's one vCPU is starting the server meanwhile. */
static json_t *warmup_argv(const struct build *b)
{
    const char *start = json_string_value(json_object_get(b->req, "start_cmd"));
    const char *ready = json_string_value(json_object_get(b->req, "ready_cmd"));
    if (start == NULL && ready == NULL)
        return json_null();
    static const char script[] =
        "set -a; [ -r " ENV_FILE " ] && . " ENV_FILE "; set +a\n"
        "user=$1 dir=$2 start=$3 ready=$4 limit=$5\n"
        "run='if [ -n \"$1\" ]; then ( /bin/sh -c \"$1\" ) </dev/null >&3 2>&3 & fi\n"
        "exec 3>&-\n"
        "[ -n \"$2\" ] || exit 0\n"
        "end=$(( $(date +%s) + $3 ))\n"
        "until /bin/sh -c \"$2\" </dev/null >/dev/null 2>&1; do\n"
        "  if [ \"$(date +%s)\" -ge \"$end\" ]; then\n"
        "    echo \"ready_cmd did not pass within $3 s; start_cmd'\\''s output:\"\n"
        "    tail -c 2000 /var/log/space-start.log; exit 1\n"
        "  fi\n"
        "  sleep 0.2\n"
        "done'\n"
        "if [ -n \"$dir\" ]; then cd \"$dir\" || exit 1; fi\n"
        "mkdir -p /var/log; exec 3>/var/log/space-start.log\n" /* images without one */
        "if [ \"$user\" = root ]; then exec /bin/sh -c \"$run\" space-start \"$start\" \"$ready\" "
        "\"$limit\"\n"
        "elif command -v runuser >/dev/null 2>&1; then\n"
        "  exec runuser -u \"$user\" -- /bin/sh -c \"$run\" space-start \"$start\" \"$ready\" "
        "\"$limit\"\n"
        /* images without util-linux (busybox ones) */
        "else exec su -s /bin/sh \"$user\" -c \"$run\" space-start \"$start\" \"$ready\" "
        "\"$limit\"\n"
        "fi\n";
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
    if (sp_tmpl__pathf(rootfs, sizeof rootfs, "templates/%s/%s/rootfs.qcow2", b->name, b->hash) <
        0) {
        json_decref(m);
        return -1;
    }
    struct stat st;
    char img[PATH_MAX], path[PATH_MAX], tmp[PATH_MAX];
    if (sp_tmpl__pathf(img, sizeof img, "%s/rootfs.qcow2", wdir) < 0 || stat(img, &st) < 0 ||
        sp_tmpl__pathf(path, sizeof path, "%s/manifest.json", wdir) < 0 ||
        sp_tmpl__pathf(tmp, sizeof tmp, "%s/manifest.json.tmp", wdir) < 0) {
        json_decref(m);
        return -1;
    }
    json_t *spec = json_deep_copy(b->req);
    json_object_set_new(spec, "parent_hash", json_string(b->pp.hash));
    b->size_bytes = (long long)st.st_blocks * 512;
    int rc = json_object_set_new(m, "name", json_string(b->name)) |
             json_object_set_new(m, "hash", json_string(b->hash)) |
             json_object_set_new(m, "rootfs", json_string(rootfs)) |
             json_object_set_new(m, "parent", json_string(b->parent)) |
             json_object_set_new(m, "cpu_count", json_integer(b->cpu_count)) |
             json_object_set_new(m, "memory_mb", json_integer(b->memory_mb)) |
             json_object_set_new(m, "disk_mb", json_integer(disk_mb_of(b))) |
             json_object_set_new(m, "warmup", warmup_argv(b)) |
             json_object_set_new(m, "env", json_deep_copy(b->env)) |
             json_object_set_new(m, "rootfs_bytes", json_integer((json_int_t)b->size_bytes)) |
             json_object_set_new(m, "built_at", json_integer((json_int_t)time(NULL))) |
             json_object_set_new(m, "build_seconds",
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
    json_array_foreach(json_object_get(b->req, "tags"), i, v)
    {
        if (strcmp(json_string_value(v), "default") == 0)
            return true;
    }
    return false;
}

/* The exported image is in the work dir: commit the version and point current at it when it
 * gets the default tag. */
static void install(struct build *b)
{
    char wdir[PATH_MAX], final[PATH_MAX], cur[PATH_MAX], target[128];
    work_dir(b, wdir, sizeof wdir);
    if (sp_tmpl__pathf(final, sizeof final, "%s/templates/%s/%s", b->t->data_dir, b->name,
                       b->hash) < 0 ||
        write_manifest(b, wdir) < 0 || rename(wdir, final) < 0) {
        fail(b, "cannot commit the template's files: %s", strerror(errno));
        return;
    }
    if (!has_default(b)) {
        logf_(b, "info", "version %.12s committed", b->hash);
        return;
    }
    if (sp_tmpl__pathf(cur, sizeof cur, "%s/templates/%s/current", b->t->data_dir, b->name) == 0) {
        ssize_t n = readlink(cur, target, sizeof target - 1);
        sp_tmpl__copy(b->prev_current, sizeof b->prev_current,
                      n > 0 ? (target[n] = '\0', target) : "");
    }
    if (sp_tmpl__set_current(b->t, b->name, b->hash) < 0) {
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
        logf_(b, "info", "template snapshot ready (%s)",
              !b->tsnap.built   ? "found"
              : b->tsnap.seeded ? "made from the builder's snapshot, no boot"
                                : "built from a cold boot");
    if (b->failed && b->swapped) { /* the previous version stays in service */
        if (sp_tmpl__set_current(b->t, b->name, b->prev_current) < 0)
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
    if (sp_qemu_template_snapshot_from(b->t->driver, ver, b->cpu_count, b->memory_mb,
                                       b->seed[0] != '\0' ? b->seed : NULL, &b->tsnap, on_tsnap, b,
                                       &e) < 0) {
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
    sp_tmpl__discard(b->t, wdir);
    record_end(b);
}

static void destroy_vm(struct build *b)
{
    sp_err_t e;
    b->ph = P_DESTROY;
    sp_egress_preset_clear(b->t->egress, b->vm_id); /* from now on it reaches nothing */
    if (!b->vm_up || b->t->driver->ops->destroy(b->t->driver, b->vm_id, on_destroyed, b, &e) < 0)
        on_destroyed(b, b->vm_up ? &e : NULL);
}

static void on_seeded(void *arg, const sp_err_t *err)
{
    struct build *b = arg;
    if (err != NULL) {
        logf_(b, "warn", "the template snapshot will boot the template cold (%s)", err->msg);
        b->seed[0] = '\0';
    }
    destroy_vm(b);
}

/* The builder, still paused with the disk as exported, snapshotted for its template snapshot
 * (qemu.h: sp_qemu_template_seed): that snapshot then needs no boot, nor the page cache the
 * steps filled read again. */
static void seed_snapshot(struct build *b)
{
    sp_err_t e;
    if (b->failed || strcmp(b->t->driver->ops->name, "qemu") != 0) {
        destroy_vm(b);
        return;
    }
    b->ph = P_SEED;
    snprintf(b->seed, sizeof b->seed, "%s%d-%s", SP_TMPL_SEED_PREFIX, (int)getpid(), b->vm_id);
    if (sp_qemu_template_seed(b->t->driver, b->vm_id, b->seed, on_seeded, b, &e) < 0)
        on_seeded(b, &e);
}

static void on_exported(void *arg, const sp_err_t *err)
{
    struct build *b = arg;
    if (err != NULL)
        fail(b, "cannot freeze the builder's disk: %s", err->msg);
    else
        logf_(b, "info", "disk frozen");
    seed_snapshot(b);
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
    if (sp_tmpl__pathf(dest, sizeof dest, "%s/rootfs.qcow2", wdir) < 0 ||
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
static const char **env_strings(const json_t *env, const json_t *extra, sp_buf_t *store, size_t *n)
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
    if (err == NULL)
        b->t->ckpt_cost_ms = b->ckpt_ms - b->ckpt_start_ms;
    if (err != NULL)
        logf_(b, "warn", "steps 1-%zu: not cached (%s)", b->step, err->msg);
    else
        logf_(b, "info", "steps 1-%zu: cached for later builds", b->step);
    sp_tmplcache_trim(b->t->driver, SP_TMPLCACHE_KEEP);
    advance(b);
}

/* A step succeeded: the builder as it is now becomes a step cache entry when the steps since
 * the last one took long enough, then the next step. */
static void step_done(struct build *b)
{
    sp_driver_t *d = b->t->driver;
    uint64_t now = sp_loop_now_ms(b->t->loop);
    uint64_t worth = b->t->ckpt_cost_ms < STEP_CACHE_MS       ? STEP_CACHE_MS
                     : b->t->ckpt_cost_ms > STEP_CACHE_MAX_MS ? STEP_CACHE_MAX_MS
                                                              : b->t->ckpt_cost_ms;
    if (b->failed || d == NULL || d->ops->checkpoint == NULL || now - b->ckpt_ms < worth) {
        advance(b);
        return;
    }
    char id[SP_TMPLCACHE_ID_LEN + 1];
    sp_tmplcache_key(b->team, cache_parent(b), b->cpu_count, b->memory_mb, b->disk_mb,
                     json_object_get(b->req, "steps"), b->step, id);
    sp_err_t e;
    b->ph = P_CKPT;
    b->ckpt_start_ms = now;
    if (d->ops->checkpoint_exists(d, id) == 1) {
        b->ckpt_ms = now;
        advance(b);
    } else if (d->ops->checkpoint(d, b->vm_id, id, 0, on_cached, b, &e) < 0) {
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
    if (b->growing) {
        b->growing = false;
        if (ev->type == SP_EXEC_EV_ERROR || !ev->exited || ev->exit_code != 0)
            fail(b, "growing the builder's filesystem to %d MiB failed: %s", b->disk_mb,
                 ev->type == SP_EXEC_EV_ERROR ? ev->err->msg : b->tail);
    } else if (b->finishing) {
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
                    const char *cwd, uint32_t timeout_ms, const void *stdin_data, size_t stdin_len)
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
        b->failed_step = b->finishing || b->growing ? 0 : (int)b->step + 1;
        b->growing = false;
        fail(b, "step %zu could not start: %s", b->step + 1,
             conn == NULL ? "the builder VM has no agent channel"
                          : (env == NULL ? "out of memory" : e.msg));
        advance(b);
    }
}

/* ---- copy steps: the files into the builder, then unpacked there ---- */

#define COPY_CHUNK (256u * 1024u)
#define COPY_DIR "/tmp/.space-copy"

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
        long took = sp_exec_write_data(b->op, b->copy_buf + b->copy_off, b->copy_len - b->copy_off);
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
/* The builder's disk grown to the disk_mb asked for, before the first step: by the runtime,
 * then its filesystem by the agent, as root (agent/growfs.h), which is any image's. */
static void on_disk_grown(void *arg, const sp_err_t *err)
{
    struct build *b = arg;
    if (err != NULL)
        fail(b, "cannot grow the builder's disk to %d MiB: %s", b->disk_mb, err->msg);
    if (b->failed) {
        advance(b);
        return;
    }
    b->growing = true;
    json_t *cmd = json_pack("[s,s]", "/usr/local/bin/space-agent", "--grow-root");
    run_cmd(b, cmd, NULL, "root", "/", 300000, NULL, 0);
    json_decref(cmd);
}

static void grow_disk(struct build *b)
{
    sp_driver_t *d = b->t->driver;
    sp_err_t e;
    logf_(b, "info", "growing the builder's disk from %d to %d MiB", b->pp.disk_mb, b->disk_mb);
    if (d->ops->grow_disk == NULL)
        on_disk_grown(b, (sp_err_set(&e, SP_EUNAVAIL, "the runtime cannot grow disks"), &e));
    else if (d->ops->grow_disk(d, b->vm_id, (uint64_t)b->disk_mb << 20, on_disk_grown, b, &e) < 0)
        on_disk_grown(b, &e);
}

static void advance(struct build *b)
{
    if (b->failed) {
        destroy_vm(b);
        return;
    }
    b->ph = P_EXEC;
    if (b->disk_mb > 0 && !b->grown) {
        b->grown = true;
        grow_disk(b);
        return;
    }
    json_t *steps = json_object_get(b->req, "steps");
    while (b->step < json_array_size(steps)) {
        json_t *s = json_array_get(steps, b->step);
        const char *kind = step_kind(s);
        logf_(b, "info", "step %zu/%zu: %s", b->step + 1, json_array_size(steps), kind);
        if (strcmp(kind, "env") == 0) {
            json_object_update(b->env, json_object_get(s, "env"));
        } else if (strcmp(kind, "user") == 0) {
            sp_tmpl__copy(b->user, sizeof b->user, json_string_value(json_object_get(s, "user")));
        } else if (strcmp(kind, "workdir") == 0) {
            sp_tmpl__copy(b->workdir, sizeof b->workdir,
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
            run_cmd(b, json_object_get(s, "run"), json_object_get(s, "env"), u ? u : b->user,
                    w ? w : (b->workdir[0] ? b->workdir : NULL), to > 0 ? (uint32_t)to * 1000u : 0,
                    NULL, 0);
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
        sp_tmpl__pathf(man, sizeof man, "%s/templates/%s/%s/manifest.json", b->t->data_dir, b->name,
                       b->hash) < 0 ||
        access(man, R_OK) < 0)
        return false;
    b->cached = true;
    logf_(b, "info", "version %.12s was built before with the same inputs: using it", b->hash);
    if (!has_default(b))
        return true;
    char cur[PATH_MAX], target[128];
    if (sp_tmpl__pathf(cur, sizeof cur, "%s/templates/%s/current", b->t->data_dir, b->name) == 0) {
        ssize_t n = readlink(cur, target, sizeof target - 1);
        sp_tmpl__copy(b->prev_current, sizeof b->prev_current,
                      n > 0 ? (target[n] = '\0', target) : "");
    }
    if (sp_tmpl__set_current(b->t, b->name, b->hash) < 0)
        fail(b, "cannot make the version current: %s", strerror(errno));
    else
        b->swapped = true;
    return true;
}

static void start_vm(struct build *b);

/* ---- a parent from a container image (ociimg.h), pulled on a worker thread ---- */

static void import_run(sp_work_t *w, void *arg)
{
    struct impjob *j = arg;
    j->rc = sp_ociimg_import(&j->opts, j->data_dir, j->ref, j->user, j->pass, w, &j->res, &j->err);
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
    if (user != NULL && sp_tmpl__valid_user(user))
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
    } else if (b->disk_mb > 0 && b->disk_mb < b->pp.disk_mb) {
        fail(b,
             "disk_mb %d is below the disk image %s was made into (%d MiB, from what its "
             "files take): a template's disk can grow, not shrink",
             b->disk_mb, b->image, b->pp.disk_mb);
    } else {
        if (b->disk_mb == b->pp.disk_mb)
            b->disk_mb = 0; /* as it is */
        sp_tmpl__copy(b->parent, sizeof b->parent, j->res.tmpl);
        sp_tmpl__copy(b->parent_ref, sizeof b->parent_ref, j->res.tmpl);
        logf_(b, "info", "image %s %s in %.1f s (template %s)", j->res.ref,
              j->res.cached ? "found in the digest cache" : "imported", j->res.seconds,
              j->res.tmpl);
        image_steps(b, j->res.config);
        json_t *f = json_object_get(b->req, "from");
        if (json_is_object(f))
            json_object_set_new(f, "digest", json_string(j->res.digest));
        sp_tmpl__input_hash(b);
    }
    impjob_free(j);
    if (b->failed) {
        record_end(b);
        return;
    }
    logf_(b, "info", "building %s from %s (version %.12s)", b->name, b->parent, b->pp.hash);
    start_vm(b);
}

static void start_import(struct build *b);

/* The registry password, opened from the team's secret: the pull goes on with it. */
static void on_reg_secret(void *arg, const char *value, size_t len, const sp_err_t *err)
{
    struct build *b = arg;
    (void)len;
    free(b->reg_secret);
    b->reg_secret = NULL;
    if (err == NULL && (b->reg_pass = strdup(value)) == NULL)
        fail(b, "cannot read the registry credentials: out of memory");
    else if (err != NULL)
        fail(b, "cannot read the registry credentials: %s", err->msg);
    if (b->failed) {
        record_end(b);
        return;
    }
    start_import(b);
}

static void start_import(struct build *b)
{
    sp_tmpl_t *t = b->t;
    b->ph = P_IMPORT;
    if (b->reg_secret != NULL) { /* the password is in a team secret: opened first */
        sp_err_t e;
        logf_(b, "info", "registry credentials: user %s, password from secret %s", b->reg_user,
              b->reg_secret);
        if (t->secrets == NULL ||
            sp_secrets_reveal(t->secrets, b->team, b->reg_secret, on_reg_secret, b, &e) < 0) {
            if (t->secrets == NULL)
                sp_err_set(&e, SP_EUNAVAIL, "secrets are not available on this server");
            on_reg_secret(b, NULL, 0, &e);
        }
        return;
    }
    struct impjob *j = calloc(1, sizeof(*j));
    if (j != NULL) {
        j->b = b;
        j->opts = (sp_ociimg_opts_t){.agent_path = t->agent,
                                     .mirror = t->mirror,
                                     .insecure = t->insecure,
                                     .max_bytes = t->image_max};
        sp_tmpl__copy(j->data_dir, sizeof j->data_dir, t->data_dir);
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
    sp_tmpl__discard(t, wdir);
    if (wdir[0] == '\0' || mkdir(wdir, 0755) < 0) {
        fail(b, "cannot make the build's work dir: %s", strerror(errno));
        record_end(b);
        return;
    }
    sp_vm_spec_t spec = {.sandbox_id = b->vm_id,
                         .template_name = b->parent_ref,
                         .cpu_count = b->cpu_count,
                         .memory_mb = b->memory_mb,
                         .hostname = "build",
                         .env_json = NULL};
    /* the step cache: the builder of an earlier build with the same first steps, as it was
     * after them; only the rest run */
    char cid[SP_TMPLCACHE_ID_LEN + 1];
    json_t *steps = json_object_get(b->req, "steps");
    size_t n =
        b->force ? 0
                 : sp_tmplcache_find(t->driver, b->team, cache_parent(b), b->cpu_count,
                                     b->memory_mb, b->disk_mb, steps, json_array_size(steps), cid);
    if (n == 0 && b->snapshot[0] != '\0') { /* the snapshot: its disk, memory and processes */
        spec.snapshot_id = b->snapshot;
        logf_(b, "info", "the builder starts from snapshot %s", b->snapshot);
    }
    if (n > 0) {
        spec.snapshot_id = cid;
        b->grown = true; /* its disk was grown before the steps it was taken after */
        for (size_t i = 0; i < n; i++) { /* what the skipped steps set, without running them */
            json_t *st = json_array_get(steps, i);
            const char *kind = step_kind(st);
            if (strcmp(kind, "env") == 0)
                json_object_update(b->env, json_object_get(st, "env"));
            else if (strcmp(kind, "user") == 0)
                sp_tmpl__copy(b->user, sizeof b->user,
                              json_string_value(json_object_get(st, "user")));
            else if (strcmp(kind, "workdir") == 0)
                sp_tmpl__copy(b->workdir, sizeof b->workdir,
                              json_string_value(json_object_get(st, "workdir")));
            logf_(b, "info", "step %zu/%zu: %s: cached", i + 1, json_array_size(steps), kind);
        }
        b->step = n;
        logf_(b, "info",
              "steps 1-%zu: cached: the builder starts as an earlier build left it "
              "after them",
              n);
    }
    /* its build's egress policy, given to the proxy before the builder can reach it */
    if (sp_egress_preset(t->egress, b->vm_id, b->team, json_object_get(b->req, "egress"), &e) < 0) {
        fail(b, "cannot set the builder's egress policy: %s", e.msg);
        record_end(b);
        return;
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

void sp_tmpl__start_queued(sp_tmpl_t *t)
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
