/*
 * fakedriver.c - a test-only runtime driver: no VMs, just state files.
 *
 * Lives under tests/ and is linked only into spaced-test, so the shipped
 * binary can never select it. Each sandbox's "VM" is a file
 * <data-dir>/fake/<id> holding running|paused|suspended, so probe() sees
 * the same truth after a restart that a real driver would see from its
 * QMP sockets and snapshot manifests. Actions take SPACE_FAKE_DELAY_MS
 * (default 50) and fail when the sandbox env has SPACE_FAKE_FAIL naming
 * the action (boot, pause, resume, snapshot, restore, destroy).
 *
 * With SPACE_FAKE_AGENT set to a space-agent-host binary, each "VM" also gets a real agent:
 * boot starts `space-agent-host --listen-unix <data-dir>/fake/<id>.sock` (pid in <id>.pid,
 * log in <id>.agent.log) and answers once the agent said HELLO; agent() returns the channel.
 * pause/resume stop and continue the agent process, snapshot stops it and drops the channel,
 * restore continues it; destroy kills it. The agent outlives spaced like a VM would: probe()
 * after a restart re-adopts it from the pid file (or starts a new one if it died). The agent
 * runs on this host as this user: tests must keep their commands and files to scratch space.
 *
 * Snapshots ("forks", checkpoint): a file <data-dir>/fake/<snapshot id>.ckpt holding the
 * source's id, written after the delay for a running or paused source (and failing like any
 * action when its env's SPACE_FAKE_FAIL names "checkpoint"); checkpoint_delete removes it. A
 * boot with spec->snapshot_id fails unless that file exists, and records the snapshot it
 * started from in <id>.from, so tests can see what the controller asked for; checkpoint_list
 * lists the .ckpt files. Each worker has its own: a snapshot is its worker's, unless it is
 * taken with SP_CKPT_SHARED and SPACE_FAKE_SHARED_DIR is set: then <shared>/<snapshot id>.ckpt
 * is written too (checkpoint_shared says so), and a boot from it on a worker without the file
 * copies it in first (as the QEMU driver copies such a snapshot in); checkpoint_delete removes
 * the shared file too, and checkpoint_list lists the shared ones as well.
 *
 * Many workers (core/control/fleet.h): with SPACE_FAKE_SHARED_DIR set (one directory for every
 * worker, like --snapshot-dir), a suspend also writes <shared>/<id> and a restore on a worker
 * that has no suspended state of its own for the sandbox starts from that file (and removes it
 * once running), so a sandbox suspended on one worker wakes on another.
 *
 * Snapshot sizes (the snapshot-disk quota): with SPACE_FAKE_SNAPSHOT_BYTES=N, a suspend writes
 * <id>.snap and a checkpoint its .ckpt file at N bytes (sparse: ftruncate); stats() of a
 * suspended sandbox and checkpoint_bytes() measure those files (their size), as the QEMU
 * driver measures its own. A restore or destroy removes <id>.snap.
 *
 * Template snapshots: the first boot of a template at a size that succeeds makes one (in
 * memory, as the QEMU driver's records are until used after a restart); templates() lists
 * them, with no spares.
 */
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <jansson.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "core/channel/agentconn.h"

#include "core/runtime/driver.h"
#include "base/ids.h"
#include "server/tests/fakedriver.h"

struct vm {
    char id[65];
    sp_agentconn_t *conn;
    struct vm *next;
};

/* A "template snapshot": a template at a size some boot made (templates()). */
struct tmpl {
    char name[160];
    int cpu_count, memory_mb;
    struct tmpl *next;
};

typedef struct {
    sp_driver_t base;
    char dir[4096];
    char shared[4096]; /* SPACE_FAKE_SHARED_DIR, or "" */
    unsigned delay_ms;
    const char *agent_bin; /* NULL: no agents */
    long long snap_bytes;  /* SPACE_FAKE_SNAPSHOT_BYTES: a snapshot's files' size */
    struct vm *vms;
    struct tmpl *tmpls;
} fake_t;

struct job {
    fake_t *f;
    sp_timer_t timer;
    char id[65];
    char action[16];
    char to[16];    /* state file content after success; "" = remove */
    char ckpt[72];  /* checkpoint: the snapshot to write on success */
    bool share;     /* checkpoint: SP_CKPT_SHARED with a shared dir: written there too */
    char tmpl[160]; /* boot from a template: its name ("" otherwise) */
    int cpu_count, memory_mb;
    bool fail;
    sp_driver_cb cb;
    void *arg;
};

static void path_of(fake_t *f, const char *id, char *out, size_t cap)
{
    snprintf(out, cap, "%s/%s", f->dir, id);
}

static const char *read_state(fake_t *f, const char *id, char *buf, size_t cap)
{
    char p[4200];
    path_of(f, id, p, sizeof(p));
    FILE *fp = fopen(p, "r");
    if (fp == NULL)
        return NULL;
    bool ok = fgets(buf, (int)cap, fp) != NULL;
    fclose(fp);
    if (!ok)
        return NULL;
    buf[strcspn(buf, "\n")] = '\0';
    return buf;
}

/* Writes path at the configured snapshot size (sparse), or removes it. */
static void size_file(fake_t *f, const char *path, bool remove)
{
    if (remove) {
        unlink(path);
        return;
    }
    int fd = open(path, O_WRONLY | O_CREAT | O_CLOEXEC, 0600);
    if (fd < 0)
        return;
    if (ftruncate(fd, (off_t)f->snap_bytes) < 0)
        fprintf(stderr, "fakedriver: cannot size %s\n", path);
    close(fd);
}

/* The size of a file, 0 when it is missing. */
static uint64_t file_size(const char *path)
{
    struct stat st;
    return stat(path, &st) == 0 ? (uint64_t)st.st_size : 0;
}

static void write_state(fake_t *f, const char *id, const char *st)
{
    char p[4200], tmp[4300];
    path_of(f, id, p, sizeof(p));
    if (st[0] == '\0') {
        unlink(p);
        return;
    }
    snprintf(tmp, sizeof(tmp), "%s.tmp", p);
    FILE *fp = fopen(tmp, "w");
    if (fp == NULL)
        return;
    fprintf(fp, "%s\n", st);
    fclose(fp);
    rename(tmp, p);
}

/* The shared copy of a suspended sandbox (SPACE_FAKE_SHARED_DIR): written by a suspend,
 * removed by the restore or destroy that used it. */
static void shared_note(fake_t *f, const char *id, const char *action)
{
    if (f->shared[0] == '\0')
        return;
    char p[4200];
    snprintf(p, sizeof(p), "%s/%s", f->shared, id);
    if (strcmp(action, "snapshot") == 0) {
        FILE *fp = fopen(p, "w");
        if (fp != NULL) {
            fputs("suspended\n", fp);
            fclose(fp);
        }
    } else if (strcmp(action, "restore") == 0 || strcmp(action, "destroy") == 0) {
        unlink(p);
    }
}

static bool shared_suspended(fake_t *f, const char *id)
{
    char p[4200];
    snprintf(p, sizeof(p), "%s/%s", f->shared, id);
    return f->shared[0] != '\0' && access(p, F_OK) == 0;
}

/* ---- agents ---- */

static struct vm *vm_find(fake_t *f, const char *id, bool create)
{
    for (struct vm *v = f->vms; v != NULL; v = v->next)
        if (strcmp(v->id, id) == 0)
            return v;
    if (!create)
        return NULL;
    struct vm *v = calloc(1, sizeof(*v));
    if (v == NULL)
        return NULL;
    snprintf(v->id, sizeof(v->id), "%s", id);
    v->next = f->vms;
    f->vms = v;
    return v;
}

static void vm_drop_conn(fake_t *f, const char *id)
{
    struct vm *v = vm_find(f, id, false);
    if (v != NULL) {
        sp_agentconn_destroy(v->conn);
        v->conn = NULL;
    }
}

static pid_t agent_pid(fake_t *f, const char *id)
{
    char p[4200];
    snprintf(p, sizeof(p), "%s/%s.pid", f->dir, id);
    FILE *fp = fopen(p, "r");
    if (fp == NULL)
        return 0;
    long pid = 0;
    if (fscanf(fp, "%ld", &pid) != 1)
        pid = 0;
    fclose(fp);
    return pid > 1 && kill((pid_t)pid, 0) == 0 ? (pid_t)pid : 0;
}

static void on_agent_state(void *arg, bool up)
{
}

static int agent_spawn(fake_t *f, const char *id)
{
    char sock[4200], log[4200], pidf[4200];
    snprintf(sock, sizeof(sock), "%s/%s.sock", f->dir, id);
    snprintf(log, sizeof(log), "%s/%s.agent.log", f->dir, id);
    snprintf(pidf, sizeof(pidf), "%s/%s.pid", f->dir, id);
    unlink(sock);
    pid_t pid = fork();
    if (pid < 0)
        return -1;
    if (pid == 0) {
        setsid(); /* like a VM: not in spaced's process group */
        sigset_t none;
        sigemptyset(&none);
        sigprocmask(SIG_SETMASK, &none, NULL);
        int fd = open(log, O_WRONLY | O_CREAT | O_APPEND, 0600);
        int nul = open("/dev/null", O_RDONLY);
        if (fd >= 0) {
            dup2(fd, 1);
            dup2(fd, 2);
        }
        if (nul >= 0)
            dup2(nul, 0);
        execl(f->agent_bin, f->agent_bin, "--listen-unix", sock, (char *)NULL);
        _exit(127);
    }
    FILE *fp = fopen(pidf, "w");
    if (fp != NULL) {
        fprintf(fp, "%ld\n", (long)pid);
        fclose(fp);
    }
    return 0;
}

/* Makes sure the sandbox has a live agent process and a channel to it. */
static sp_agentconn_t *agent_ensure(fake_t *f, const char *id)
{
    if (f->agent_bin == NULL)
        return NULL;
    struct vm *v = vm_find(f, id, true);
    if (v == NULL)
        return NULL;
    if (agent_pid(f, id) == 0) {
        sp_agentconn_destroy(v->conn);
        v->conn = NULL;
        if (agent_spawn(f, id) < 0)
            return NULL;
    }
    if (v->conn == NULL) {
        char sock[4200];
        snprintf(sock, sizeof(sock), "%s/%s.sock", f->dir, id);
        v->conn = sp_agentconn_create(f->base.loop, sock, on_agent_state, f);
        sp_agentconn_set_sandbox(v->conn, id); /* the egress proxy attaches here */
    }
    return v->conn;
}

static void agent_signal(fake_t *f, const char *id, int sig)
{
    pid_t pid = agent_pid(f, id);
    if (pid > 0)
        kill(pid, sig);
}

static void agent_kill(fake_t *f, const char *id)
{
    vm_drop_conn(f, id);
    pid_t pid = agent_pid(f, id);
    if (pid > 0) {
        kill(pid, SIGKILL);
        waitpid(pid, NULL, 0); /* ours unless spaced restarted: then ECHILD at once */
    }
    char p[4200];
    snprintf(p, sizeof(p), "%s/%s.pid", f->dir, id);
    unlink(p);
    snprintf(p, sizeof(p), "%s/%s.sock", f->dir, id);
    unlink(p);
}

/* A boot from a template succeeded: the template at that size has a snapshot from now on. */
static void tmpl_note(const struct job *j)
{
    if (j->tmpl[0] == '\0')
        return;
    for (const struct tmpl *t = j->f->tmpls; t != NULL; t = t->next)
        if (strcmp(t->name, j->tmpl) == 0 && t->cpu_count == j->cpu_count &&
            t->memory_mb == j->memory_mb)
            return;
    struct tmpl *t = calloc(1, sizeof(*t));
    if (t == NULL)
        return;
    snprintf(t->name, sizeof(t->name), "%s", j->tmpl);
    t->cpu_count = j->cpu_count;
    t->memory_mb = j->memory_mb;
    t->next = j->f->tmpls;
    j->f->tmpls = t;
}

static void job_finish(struct job *j, const sp_err_t *err)
{
    if (err != NULL) {
        j->cb(j->arg, err);
    } else {
        write_state(j->f, j->id, j->to);
        char sp[4200];
        snprintf(sp, sizeof(sp), "%s/%s.snap", j->f->dir, j->id);
        if (strcmp(j->action, "snapshot") == 0)
            size_file(j->f, sp, false);
        else if (strcmp(j->action, "restore") == 0 || strcmp(j->action, "destroy") == 0)
            size_file(j->f, sp, true);
        shared_note(j->f, j->id, j->action);
        tmpl_note(j);
        j->cb(j->arg, NULL);
    }
    free(j);
}

static void on_agent_up(void *arg, const sp_err_t *err)
{
    struct job *j = arg;
    if (err != NULL) {
        sp_err_t e;
        sp_err_set(&e, SP_EUNAVAIL, "agent did not come up");
        job_finish(j, &e);
        return;
    }
    job_finish(j, NULL);
}

static void on_job(sp_timer_t *t, void *arg)
{
    struct job *j = arg;
    fake_t *f = j->f;
    if (!j->fail && f->agent_bin != NULL) {
        /* The agent side of the action, then (for boot/restore) wait for its HELLO. */
        if (strcmp(j->action, "pause") == 0) {
            agent_signal(f, j->id, SIGSTOP);
        } else if (strcmp(j->action, "resume") == 0) {
            agent_signal(f, j->id, SIGCONT);
        } else if (strcmp(j->action, "snapshot") == 0) {
            vm_drop_conn(f, j->id);
            agent_signal(f, j->id, SIGSTOP);
        } else if (strcmp(j->action, "destroy") == 0) {
            agent_kill(f, j->id);
        } else if (strcmp(j->action, "boot") == 0 || strcmp(j->action, "restore") == 0) {
            agent_signal(f, j->id, SIGCONT);
            sp_agentconn_t *c = agent_ensure(f, j->id);
            if (c != NULL && sp_agentconn_when_up(c, 15000, on_agent_up, j) == 0)
                return;
            sp_err_t e;
            sp_err_set(&e, SP_EUNAVAIL, "cannot start the fake agent");
            job_finish(j, &e);
            return;
        }
    }
    if (!j->fail && j->ckpt[0] != '\0') { /* the source's state file stays as it is */
        char p[4200];
        snprintf(p, sizeof(p), "%s/%s.ckpt", f->dir, j->ckpt);
        FILE *fp = fopen(p, "w");
        if (fp != NULL) {
            fprintf(fp, "%s\n", j->id);
            fclose(fp);
            if (f->snap_bytes > 0)
                size_file(f, p, false);
        }
        snprintf(p, sizeof(p), "%s/%s.ckpt", f->shared, j->ckpt);
        if (j->share && (fp = fopen(p, "w")) != NULL) {
            fprintf(fp, "%s\n", j->id);
            fclose(fp);
        }
        j->cb(j->arg, NULL);
        free(j);
        return;
    }
    if (j->fail) {
        sp_err_t e;
        sp_err_set(&e, SP_EINTERNAL, "injected %s failure", j->action);
        j->cb(j->arg, &e);
    } else {
        write_state(j->f, j->id, j->to);
        char sp[4200];
        snprintf(sp, sizeof(sp), "%s/%s.snap", f->dir, j->id);
        if (strcmp(j->action, "snapshot") == 0)
            size_file(f, sp, false);
        else if (strcmp(j->action, "restore") == 0 || strcmp(j->action, "destroy") == 0)
            size_file(f, sp, true);
        shared_note(j->f, j->id, j->action);
        tmpl_note(j);
        j->cb(j->arg, NULL);
    }
    free(j);
}

static int start_ckpt(fake_t *f, const char *id, const char *action, const char *to, bool fail,
                      const char *ckpt, unsigned flags, const sp_vm_spec_t *tmpl, sp_driver_cb cb,
                      void *arg, sp_err_t *err)
{
    if (!sp_ids_valid(id))
        return sp_err_set(err, SP_EINVAL, "bad id");
    struct job *j = calloc(1, sizeof(*j));
    if (j == NULL)
        return sp_err_set(err, SP_EINTERNAL, "out of memory");
    j->f = f;
    snprintf(j->id, sizeof(j->id), "%s", id);
    snprintf(j->action, sizeof(j->action), "%s", action);
    snprintf(j->to, sizeof(j->to), "%s", to);
    j->fail = fail;
    snprintf(j->ckpt, sizeof(j->ckpt), "%s", ckpt ? ckpt : "");
    j->share = ckpt != NULL && (flags & SP_CKPT_SHARED) != 0 && f->shared[0] != '\0';
    if (tmpl != NULL && tmpl->template_name != NULL) {
        snprintf(j->tmpl, sizeof(j->tmpl), "%s", tmpl->template_name);
        j->cpu_count = tmpl->cpu_count;
        j->memory_mb = tmpl->memory_mb;
    }
    j->cb = cb;
    j->arg = arg;
    sp_timer_init(&j->timer, f->base.loop, on_job, j);
    sp_timer_start(&j->timer, f->delay_ms);
    return 0;
}

static int start(fake_t *f, const char *id, const char *action, const char *to, bool fail,
                 sp_driver_cb cb, void *arg, sp_err_t *err)
{
    return start_ckpt(f, id, action, to, fail, NULL, 0, NULL, cb, arg, err);
}

/* Whether the sandbox's env asks this action to fail; env is read from a side file
 * written at boot, so later actions see it too. */
static bool wants_fail(fake_t *f, const char *id, const char *action, const char *env_json)
{
    char p[4200], buf[256] = "";
    snprintf(p, sizeof(p), "%s/%s.fail", f->dir, id);
    if (env_json != NULL) {
        json_t *env = json_loads(env_json, 0, NULL);
        const char *v = json_string_value(json_object_get(env, "SPACE_FAKE_FAIL"));
        if (v != NULL) {
            FILE *fp = fopen(p, "w");
            if (fp) {
                fputs(v, fp);
                fclose(fp);
            }
        }
        json_decref(env);
    }
    FILE *fp = fopen(p, "r");
    if (fp == NULL)
        return false;
    bool got = fgets(buf, sizeof(buf), fp) != NULL;
    fclose(fp);
    return got && strstr(buf, action) != NULL;
}

static bool ckpt_exists(fake_t *f, const char *snap)
{
    char p[4200];
    snprintf(p, sizeof(p), "%s/%s.ckpt", f->dir, snap);
    return access(p, F_OK) == 0;
}

static bool ckpt_shared(fake_t *f, const char *snap)
{
    char p[4200];
    snprintf(p, sizeof(p), "%s/%s.ckpt", f->shared, snap);
    return f->shared[0] != '\0' && access(p, F_OK) == 0;
}

/* A shared snapshot copied in (a link): true when it is here now. */
static bool ckpt_fetch(fake_t *f, const char *snap)
{
    if (ckpt_exists(f, snap))
        return true;
    if (!ckpt_shared(f, snap))
        return false;
    char a[4200], b[4200];
    snprintf(a, sizeof(a), "%s/%s.ckpt", f->shared, snap);
    snprintf(b, sizeof(b), "%s/%s.ckpt", f->dir, snap);
    return link(a, b) == 0;
}

static int f_boot(sp_driver_t *d, const sp_vm_spec_t *s, sp_driver_cb cb, void *arg, sp_err_t *e)
{
    fake_t *f = (fake_t *)d;
    bool fail = wants_fail(f, s->sandbox_id, "boot", s->env_json);
    if (s->snapshot_id != NULL) {
        char p[4200];
        snprintf(p, sizeof(p), "%s/%s.from", f->dir, s->sandbox_id);
        FILE *fp = fopen(p, "w");
        if (fp != NULL) {
            fprintf(fp, "%s\n", s->snapshot_id);
            fclose(fp);
        }
        if (!ckpt_fetch(f, s->snapshot_id))
            fail = true;
    }
    return start_ckpt(f, s->sandbox_id, "boot", "running", fail, NULL, 0,
                      s->snapshot_id == NULL ? s : NULL, cb, arg, e);
}

static int f_checkpoint(sp_driver_t *d, const char *id, const char *snap, unsigned flags,
                        sp_driver_cb cb, void *arg, sp_err_t *e)
{
    fake_t *f = (fake_t *)d;
    char buf[32];
    const char *st = read_state(f, id, buf, sizeof(buf));
    if (st == NULL)
        return sp_err_set(e, SP_ENOTFOUND, "no VM");
    if (strcmp(st, "running") != 0 && strcmp(st, "paused") != 0)
        return sp_err_set(e, SP_ECONFLICT, "the VM is %s", st);
    if (ckpt_exists(f, snap) || ckpt_shared(f, snap))
        return sp_err_set(e, SP_ECONFLICT, "snapshot %s exists", snap);
    return start_ckpt(f, id, "checkpoint", st, wants_fail(f, id, "checkpoint", NULL), snap, flags,
                      NULL, cb, arg, e);
}

static int f_checkpoint_delete(sp_driver_t *d, const char *snap, sp_err_t *e)
{
    fake_t *f = (fake_t *)d;
    char p[4200];
    snprintf(p, sizeof(p), "%s/%s.ckpt", f->dir, snap);
    unlink(p);
    if (f->shared[0] != '\0') {
        snprintf(p, sizeof(p), "%s/%s.ckpt", f->shared, snap);
        unlink(p);
    }
    return 0;
}

static int f_checkpoint_exists(sp_driver_t *d, const char *snap)
{
    return ckpt_exists((fake_t *)d, snap) ? 1 : 0;
}

static int f_checkpoint_shared(sp_driver_t *d, const char *snap)
{
    return ckpt_shared((fake_t *)d, snap) ? 1 : 0;
}

static void list_ckpts(const char *dirpath, const char *prefix,
                       void (*fn)(const char *snapshot_id, long long committed_s, void *arg),
                       void *arg)
{
    DIR *dir = opendir(dirpath);
    if (dir == NULL)
        return;
    size_t pl = strlen(prefix);
    struct dirent *de;
    while ((de = readdir(dir)) != NULL) {
        size_t n = strlen(de->d_name);
        char id[128];
        if (strncmp(de->d_name, prefix, pl) != 0 || n < 6 || n - 5 >= sizeof(id) ||
            strcmp(de->d_name + n - 5, ".ckpt") != 0)
            continue;
        memcpy(id, de->d_name, n - 5);
        id[n - 5] = '\0';
        fn(id, 0, arg);
    }
    closedir(dir);
}

static int f_checkpoint_list(sp_driver_t *d, const char *prefix,
                             void (*fn)(const char *snapshot_id, long long committed_s, void *arg),
                             void *arg, sp_err_t *e)
{
    fake_t *f = (fake_t *)d;
    if (access(f->dir, F_OK) < 0 && errno != ENOENT)
        return sp_err_set(e, SP_ERUNTIME, "cannot list %s", f->dir);
    list_ckpts(f->dir, prefix, fn, arg);
    if (f->shared[0] != '\0')
        list_ckpts(f->shared, prefix, fn, arg);
    return 0;
}

static uint64_t f_checkpoint_bytes(sp_driver_t *d, const char *snap)
{
    char p[4200];
    snprintf(p, sizeof(p), "%s/%s.ckpt", ((fake_t *)d)->dir, snap);
    return file_size(p);
}

static int simple(sp_driver_t *d, const char *id, const char *act, const char *need,
                  const char *to, sp_driver_cb cb, void *arg, sp_err_t *e)
{
    fake_t *f = (fake_t *)d;
    char buf[32];
    const char *st = read_state(f, id, buf, sizeof(buf));
    bool fail = wants_fail(f, id, act, NULL);
    if (need != NULL && (st == NULL || strstr(need, st) == NULL)) {
        fail = true;
    }
    return start(f, id, act, to, fail, cb, arg, e);
}

static int f_pause(sp_driver_t *d, const char *id, sp_driver_cb cb, void *arg, sp_err_t *e)
{
    return simple(d, id, "pause", "running", "paused", cb, arg, e);
}

static int f_resume(sp_driver_t *d, const char *id, sp_driver_cb cb, void *arg, sp_err_t *e)
{
    return simple(d, id, "resume", "paused", "running", cb, arg, e);
}

static int f_snapshot(sp_driver_t *d, const char *id, sp_driver_cb cb, void *arg, sp_err_t *e)
{
    return simple(d, id, "snapshot", "running,paused", "suspended", cb, arg, e);
}

static int f_restore(sp_driver_t *d, const sp_vm_spec_t *s, sp_driver_cb cb, void *arg,
                     sp_err_t *e)
{
    fake_t *f = (fake_t *)d;
    char buf[32];
    const char *st = read_state(f, s->sandbox_id, buf, sizeof(buf));
    if ((st == NULL || strcmp(st, "suspended") != 0) && shared_suspended(f, s->sandbox_id))
        return simple(d, s->sandbox_id, "restore", NULL, "running", cb, arg, e);
    return simple(d, s->sandbox_id, "restore", "suspended", "running", cb, arg, e);
}

static int f_destroy(sp_driver_t *d, const char *id, sp_driver_cb cb, void *arg, sp_err_t *e)
{
    fake_t *f = (fake_t *)d;
    char p[4200];
    snprintf(p, sizeof(p), "%s/%s.fail", f->dir, id);
    bool fail = wants_fail(f, id, "destroy", NULL);
    if (!fail)
        unlink(p);
    return start(f, id, "destroy", "", fail, cb, arg, e);
}

static sp_vm_state_t f_probe(sp_driver_t *d, const char *id)
{
    fake_t *f = (fake_t *)d;
    char buf[32];
    const char *st = read_state(f, id, buf, sizeof(buf));
    if (st == NULL)
        return SP_VM_ABSENT;
    bool running = strcmp(st, "running") == 0, paused = strcmp(st, "paused") == 0;
    /* Re-adopt (or restart) the agent of a live "VM" we have no channel to, e.g. after
     * spaced restarted. */
    if ((running || paused) && f->agent_bin != NULL) {
        struct vm *v = vm_find(f, id, false);
        if (v == NULL || v->conn == NULL || agent_pid(f, id) == 0)
            agent_ensure(f, id);
    }
    if (running)
        return SP_VM_RUNNING;
    if (paused)
        return SP_VM_PAUSED;
    return SP_VM_SUSPENDED;
}

static int f_stats(sp_driver_t *d, const char *id, sp_vm_stats_t *out, sp_err_t *err)
{
    if (f_probe(d, id) == SP_VM_ABSENT)
        return sp_err_set(err, SP_ENOTFOUND, "no VM");
    memset(out, 0, sizeof(*out));
    out->cpu_count = 1;
    out->mem_total_bytes = 256u << 20;
    if (f_probe(d, id) == SP_VM_SUSPENDED) {
        char p[4200];
        snprintf(p, sizeof(p), "%s/%s.snap", ((fake_t *)d)->dir, id);
        out->snapshot_bytes = file_size(p);
    }
    return 0;
}

static uint64_t f_disk_bytes(sp_driver_t *d, const char *id)
{
    (void)d;
    (void)id;
    return 0; /* as f_stats */
}

static struct sp_agentconn *f_agent(sp_driver_t *d, const char *id)
{
    fake_t *f = (fake_t *)d;
    if (f->agent_bin == NULL || f_probe(d, id) != SP_VM_RUNNING)
        return NULL; /* without SPACE_FAKE_AGENT there is no guest */
    struct vm *v = vm_find(f, id, false);
    return v ? v->conn : NULL;
}

static void f_templates(sp_driver_t *d,
                        void (*fn)(const char *template_name, int cpu_count, int memory_mb,
                                   int spares, void *arg),
                        void *arg)
{
    for (const struct tmpl *t = ((fake_t *)d)->tmpls; t != NULL; t = t->next)
        fn(t->name, t->cpu_count, t->memory_mb, 0, arg);
}

static void f_free(sp_driver_t *d)
{
    fake_t *f = (fake_t *)d;
    while (f->tmpls != NULL) {
        struct tmpl *t = f->tmpls;
        f->tmpls = t->next;
        free(t);
    }
    while (f->vms != NULL) { /* the agents keep running, like VMs across a restart */
        struct vm *v = f->vms;
        f->vms = v->next;
        sp_agentconn_destroy(v->conn);
        free(v);
    }
    free(d);
}

static const sp_driver_ops_t fake_ops = {
    .name = "test",
    .boot = f_boot,
    .pause = f_pause,
    .resume = f_resume,
    .snapshot = f_snapshot,
    .restore = f_restore,
    .destroy = f_destroy,
    .probe = f_probe,
    .agent = f_agent,
    .stats = f_stats,
    .disk_bytes = f_disk_bytes,
    .free = f_free,
    .checkpoint = f_checkpoint,
    .checkpoint_shared = f_checkpoint_shared,
    .checkpoint_delete = f_checkpoint_delete,
    .checkpoint_list = f_checkpoint_list,
    .checkpoint_exists = f_checkpoint_exists,
    .checkpoint_bytes = f_checkpoint_bytes,
    .templates = f_templates,
};

sp_driver_t *sp_test_fakedriver_create(sp_loop_t *loop, const char *data_dir)
{
    fake_t *f = calloc(1, sizeof(*f));
    if (f == NULL)
        return NULL;
    f->base.ops = &fake_ops;
    f->base.loop = loop;
    snprintf(f->dir, sizeof(f->dir), "%s/fake", data_dir);
    if (mkdir(f->dir, 0700) < 0 && errno != EEXIST) {
        free(f);
        return NULL;
    }
    const char *d = getenv("SPACE_FAKE_DELAY_MS");
    f->delay_ms = d ? (unsigned)atoi(d) : 50;
    const char *sh = getenv("SPACE_FAKE_SHARED_DIR");
    snprintf(f->shared, sizeof(f->shared), "%s", sh != NULL ? sh : "");
    const char *a = getenv("SPACE_FAKE_AGENT");
    f->agent_bin = a != NULL && a[0] != '\0' ? a : NULL;
    const char *sb = getenv("SPACE_FAKE_SNAPSHOT_BYTES");
    f->snap_bytes = sb != NULL ? atoll(sb) : 0;
    return &f->base;
}
