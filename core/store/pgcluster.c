/*
 * pgcluster.c - create, run and stop the embedded PostgreSQL cluster.
 *
 * Owns <data-dir>/pg: its directories, the config files spaced writes into
 * PGDATA (spaced.conf, pg_hba.conf, pg_ident.conf), the manager lock and the
 * child processes (initdb, pg_ctl). Does not own the postmaster's lifetime
 * beyond start/stop: pg_ctl detaches it (setsid), so a spaced killed with
 * SIGKILL leaves it running and the next start reuses it.
 *
 * Children are run with fork/execve, never a shell built here, with a fixed
 * environment, all fds above 2 closed, and, as root, the postgres user's
 * credentials. Anything that touches the postgres-owned tree (mkdir, config
 * writes, rename) is also done in such a child, so root never follows a path
 * the postgres user could have replaced with a symlink. Their output is
 * captured and logged; clients only see a short sp_err_t.
 *
 * Auth: `local all all peer map=spaced`, pg_ident mapping root / postgres /
 * the current user to the DB superuser `postgres`. No secret to generate,
 * store or leak in backups; the kernel vouches for the peer uid, and the
 * socket dir (0700, cluster user) plus unix_socket_permissions=0700 keep
 * everyone else away from the socket in the first place. `trust` would rely
 * on that one permission bit alone.
 *
 * pg_ctl itself runs `exec postgres -D "<pgdata>" ... >> "<log>"` through
 * /bin/sh, so paths are limited to a safe character set (see path_ok).
 */
#include "core/store/pgcluster.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <grp.h>
#include <libpq-fe.h>
#include <limits.h>
#include <pwd.h>
#include <signal.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "base/log.h"

#define PG_PORT       5432       /* no TCP: only names the socket, no host conflict */
#define PG_USER       "postgres" /* system user when root, and DB superuser */
#define PG_DB         "space"
#define PG_START_WAIT "300" /* s; covers WAL replay after a crash */
#define PG_STOP_WAIT  "120" /* s */
#define OUT_KEEP      8192  /* bytes of child output kept for the log */
#define SOCK_NAME_LEN 14    /* strlen("/.s.PGSQL.5432") */

struct sp_pgcluster {
    char *root;     /* <data-dir>/pg */
    char *pgdata;   /* <root>/data */
    char *sockdir;  /* <root>/run */
    char *logfile;  /* <root>/log/postgres.log */
    char *bindir;   /* holds initdb, pg_ctl, postgres */
    char *conninfo; /* dbname=space */
    int lock_fd;
    bool drop; /* root: children switch to uid/gid/groups */
    uid_t uid;
    gid_t gid;
    gid_t *groups;
    int ngroups;
    char *osuser; /* OS name peer auth will see for us */
    char *env[5]; /* child environment, NULL-terminated */
};

/* ---------------------------------------------------------------- paths */

/* pg_ctl pastes paths into a /bin/sh command line inside double quotes,
 * and unix_socket_directories is a comma list: allow only what needs no
 * quoting anywhere. */
static bool path_ok(const char *p)
{
    if (p[0] != '/')
        return false;
    for (const char *s = p; *s; s++) {
        char ch = *s;
        if (!((ch >= 'a' && ch <= 'z') || (ch >= 'A' && ch <= 'Z') || (ch >= '0' && ch <= '9') ||
              strchr("/._-+@:~=%", ch) != NULL))
            return false;
    }
    return true;
}

static char *xasprintf(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
static char *xasprintf(const char *fmt, ...)
{
    char *s = NULL;
    va_list ap;
    va_start(ap, fmt);
    int n = vasprintf(&s, fmt, ap);
    va_end(ap);
    return n < 0 ? NULL : s;
}

static bool has_bins(const char *dir)
{
    static const char *const need[] = {"initdb", "pg_ctl", "postgres"};
    char p[PATH_MAX];
    for (size_t i = 0; i < sizeof(need) / sizeof(need[0]); i++) {
        if (snprintf(p, sizeof(p), "%s/%s", dir, need[i]) >= (int)sizeof(p))
            return false;
        if (access(p, X_OK) != 0)
            return false;
    }
    return true;
}

/* Debian installs each major in /usr/lib/postgresql/<major>/bin and
 * pg_config --bindir is only in the -dev package. Prefer the major the
 * cluster was created with (want, may be NULL), then the highest installed,
 * then whatever initdb is on PATH (resolved, so pg_ctl finds postgres
 * beside it). Returns a malloc'd path or NULL. */
static char *find_bindir(const char *want)
{
    char p[PATH_MAX];
    if (want != NULL) {
        snprintf(p, sizeof(p), "/usr/lib/postgresql/%s/bin", want);
        if (has_bins(p))
            return strdup(p);
    }
    long best = -1;
    DIR *d = opendir("/usr/lib/postgresql");
    if (d != NULL) {
        struct dirent *e;
        while ((e = readdir(d)) != NULL) {
            char *end;
            errno = 0;
            long v = strtol(e->d_name, &end, 10);
            if (errno != 0 || end == e->d_name || *end != '\0' || v <= best)
                continue;
            snprintf(p, sizeof(p), "/usr/lib/postgresql/%ld/bin", v);
            if (has_bins(p))
                best = v;
        }
        closedir(d);
    }
    if (best >= 0) {
        snprintf(p, sizeof(p), "/usr/lib/postgresql/%ld/bin", best);
        return strdup(p);
    }
    const char *path = getenv("PATH");
    if (path == NULL)
        return NULL;
    char *copy = strdup(path);
    if (copy == NULL)
        return NULL;
    char *save = NULL, *res = NULL;
    for (char *dir = strtok_r(copy, ":", &save); dir != NULL; dir = strtok_r(NULL, ":", &save)) {
        char real[PATH_MAX];
        if (snprintf(p, sizeof(p), "%s/initdb", dir) >= (int)sizeof(p))
            continue;
        if (access(p, X_OK) != 0 || realpath(p, real) == NULL)
            continue;
        char *slash = strrchr(real, '/');
        *slash = '\0'; /* realpath is absolute: a '/' exists */
        if (has_bins(real)) {
            res = strdup(real);
            break;
        }
    }
    free(copy);
    return res;
}

/* PG_VERSION of an existing cluster ("15"), or "" if none. */
static void read_pg_version(const char *pgdata, char *out, size_t n)
{
    out[0] = '\0';
    char p[PATH_MAX];
    snprintf(p, sizeof(p), "%s/PG_VERSION", pgdata);
    FILE *f = fopen(p, "re");
    if (f == NULL)
        return;
    if (fgets(out, (int)n, f) == NULL)
        out[0] = '\0';
    fclose(f);
    out[strcspn(out, "\r\n")] = '\0';
    for (char *s = out; *s; s++)
        if (!((*s >= '0' && *s <= '9') || *s == '.'))
            out[0] = '\0';
}

/* Who children run as. Fills c->drop/uid/gid/groups/osuser. */
static int lookup_user(sp_pgcluster_t *c, sp_err_t *err)
{
    char buf[4096];
    struct passwd pw, *res = NULL;
    bool root = geteuid() == 0;
    int rc = root ? getpwnam_r(PG_USER, &pw, buf, sizeof(buf), &res)
                  : getpwuid_r(geteuid(), &pw, buf, sizeof(buf), &res);
    if (res == NULL) {
        sp_log(SP_LOG_ERROR, "pgcluster", "user lookup failed user=%s err=%s",
               root ? PG_USER : "(self)", rc ? strerror(rc) : "no such user");
        return sp_err_set(err, SP_EUNAVAIL,
                          root ? "PostgreSQL system user 'postgres' is missing"
                               : "current user has no passwd entry");
    }
    if (root && pw.pw_uid == 0)
        return sp_err_set(err, SP_EUNAVAIL, "PostgreSQL system user must not be root");
    c->drop = root;
    c->uid = pw.pw_uid;
    c->gid = pw.pw_gid;
    c->osuser = strdup(root ? "root" : pw.pw_name);
    c->env[0] = xasprintf("HOME=%s", pw.pw_dir);
    if (root) {
        int n = 16;
        for (;;) {
            gid_t *g = realloc(c->groups, (size_t)n * sizeof(gid_t));
            if (g == NULL)
                break;
            c->groups = g;
            int want = n;
            if (getgrouplist(pw.pw_name, pw.pw_gid, g, &want) >= 0) {
                c->ngroups = want;
                break;
            }
            if (want <= n || want > 65536)
                break;
            n = want;
        }
        if (c->ngroups == 0) {
            sp_log(SP_LOG_ERROR, "pgcluster", "getgrouplist failed user=%s", PG_USER);
            return sp_err_set(err, SP_EINTERNAL, "cannot resolve PostgreSQL user groups");
        }
    }
    if (c->osuser == NULL || c->env[0] == NULL)
        return sp_err_set(err, SP_EINTERNAL, "out of memory");
    return 0;
}

int sp_pgcluster_available(void)
{
    char *b = find_bindir(NULL);
    if (b == NULL)
        return 0;
    free(b);
    if (geteuid() != 0)
        return 1;
    char buf[4096];
    struct passwd pw, *res = NULL;
    getpwnam_r(PG_USER, &pw, buf, sizeof(buf), &res);
    return res != NULL && res->pw_uid != 0;
}

/* --------------------------------------------------------------- children */

/* Work a child does in place of exec, on the cluster user's credentials.
 * Runs between fork and _exit: async-signal-safe calls only. */
enum fs_op { FS_MKDIR = 0, FS_WRITE, FS_APPEND, FS_RENAME, FS_UNLINK, FS_PROBE };
struct fsop {
    enum fs_op op;
    const char *path;
    const char *path2; /* FS_WRITE: temp name; FS_RENAME: target */
    const char *data;
    size_t len;
};

static void child_say(const char *a, const char *b)
{
    /* write(2) only: the parent logs it */
    if (write(2, a, strlen(a)) < 0 || write(2, b, strlen(b)) < 0 || write(2, "\n", 1) < 0)
        return;
}

/* Writes the n bytes at p to fd, makes them durable and closes fd (in every case): 0, or -1. */
static int write_synced(int fd, const char *p, size_t n)
{
    int rc = 0;
    while (n > 0) {
        ssize_t w = write(fd, p, n);
        if (w < 0 && errno == EINTR)
            continue;
        if (w <= 0) {
            rc = -1;
            break;
        }
        p += w;
        n -= (size_t)w;
    }
    if (rc == 0 && fsync(fd) != 0)
        rc = -1;
    close(fd);
    return rc;
}

static int child_fsop(const struct fsop *o)
{
    struct stat st;
    int fd;
    switch (o->op) {
    case FS_MKDIR:
        if (mkdir(o->path, 0700) != 0 && errno != EEXIST)
            break;
        if (lstat(o->path, &st) != 0 || !S_ISDIR(st.st_mode) || chmod(o->path, 0700) != 0)
            break;
        return 0;
    case FS_WRITE:
        unlink(o->path2);
        fd = open(o->path2, O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0600);
        if (fd < 0 || write_synced(fd, o->data, o->len) != 0)
            break;
        if (rename(o->path2, o->path) != 0)
            break;
        return 0;
    case FS_APPEND:
        fd = open(o->path, O_WRONLY | O_APPEND | O_NOFOLLOW | O_CLOEXEC);
        if (fd < 0 || write_synced(fd, o->data, o->len) != 0)
            break;
        return 0;
    case FS_RENAME:
        if (rename(o->path, o->path2) != 0)
            break;
        return 0;
    case FS_UNLINK:
        if (unlink(o->path) != 0 && errno != ENOENT)
            break;
        return 0;
    case FS_PROBE:
        if (access(o->path, R_OK | W_OK | X_OK) != 0)
            break;
        return 0;
    }
    child_say("pgcluster file operation failed: ", o->path);
    return 1;
}

/* Runs argv (absolute argv[0]) or, if argv is NULL, op, in a child on the
 * cluster user's credentials with cwd = root. Returns the exit status (0-255;
 * 128+signal when killed) or -1 when it could not run (err set). Output is
 * logged at debug when the status is in ok_mask (bit per status), else at
 * warn. */
static int run(const sp_pgcluster_t *c, const char *what, char *const argv[], const struct fsop *op,
               unsigned ok_mask, sp_err_t *err)
{
    int pfd[2];
    if (pipe2(pfd, O_CLOEXEC) != 0) {
        sp_log(SP_LOG_ERROR, "pgcluster", "pipe failed what=%s err=%s", what, strerror(errno));
        return sp_err_set(err, SP_EINTERNAL, "cannot run PostgreSQL tools");
    }
    int nullfd = open("/dev/null", O_RDONLY | O_CLOEXEC);
    pid_t pid = fork();
    if (pid < 0) {
        sp_log(SP_LOG_ERROR, "pgcluster", "fork failed what=%s err=%s", what, strerror(errno));
        close(pfd[0]);
        close(pfd[1]);
        if (nullfd >= 0)
            close(nullfd);
        return sp_err_set(err, SP_EINTERNAL, "cannot run PostgreSQL tools");
    }
    if (pid == 0) {
        /* Child: async-signal-safe from here on. */
        if (nullfd < 0 || dup2(nullfd, 0) < 0 || dup2(pfd[1], 1) < 0 || dup2(pfd[1], 2) < 0)
            _exit(126);
        /* Nothing else leaks: not the manager lock (a postmaster holding it
         * would lock out the next spaced), not the caller's sockets. */
        if (close_range(3, ~0U, 0) != 0)
            for (int fd = 3; fd < 1024; fd++)
                close(fd);
        sigset_t none;
        sigemptyset(&none);
        sigprocmask(SIG_SETMASK, &none, NULL);
        struct sigaction dfl;
        memset(&dfl, 0, sizeof(dfl));
        dfl.sa_handler = SIG_DFL;
        for (int s = 1; s < NSIG; s++)
            sigaction(s, &dfl, NULL); /* SIG_IGN would survive exec */
        umask(077);
        if (c->drop) {
            if (setgroups((size_t)c->ngroups, c->groups) != 0 || setgid(c->gid) != 0 ||
                setuid(c->uid) != 0 || setuid(0) == 0) {
                child_say("pgcluster: cannot switch to user ", PG_USER);
                _exit(126);
            }
        }
        if (chdir(c->root) != 0) {
            child_say("pgcluster: cannot enter ", c->root);
            _exit(126);
        }
        if (argv == NULL)
            _exit(child_fsop(op));
        execve(argv[0], argv, c->env);
        child_say("pgcluster: cannot execute ", argv[0]);
        _exit(127);
    }
    close(pfd[1]);
    if (nullfd >= 0)
        close(nullfd);

    /* Keep the last OUT_KEEP bytes: failures print their reason last. */
    char out[OUT_KEEP + 1];
    size_t len = 0;
    bool cut = false;
    char chunk[2048];
    for (;;) {
        ssize_t r = read(pfd[0], chunk, sizeof(chunk));
        if (r < 0 && errno == EINTR)
            continue;
        if (r <= 0)
            break;
        size_t n = (size_t)r; /* <= sizeof(chunk) < OUT_KEEP */
        if (len + n > OUT_KEEP) {
            size_t drop = len + n - OUT_KEEP;
            memmove(out, out + drop, len - drop);
            len -= drop;
            cut = true;
        }
        memcpy(out + len, chunk, n);
        len += n;
    }
    close(pfd[0]);
    int st = 0;
    while (waitpid(pid, &st, 0) < 0) {
        if (errno != EINTR) {
            sp_log(SP_LOG_ERROR, "pgcluster", "waitpid failed what=%s err=%s", what,
                   strerror(errno));
            return sp_err_set(err, SP_EINTERNAL, "cannot run PostgreSQL tools");
        }
    }
    int code = WIFEXITED(st) ? WEXITSTATUS(st) : 128 + (WIFSIGNALED(st) ? WTERMSIG(st) : 0);
    sp_log_level_t lvl = (code < 32 && (ok_mask & (1u << code))) ? SP_LOG_DEBUG : SP_LOG_WARN;
    out[len] = '\0';
    if (cut)
        sp_log(lvl, "pgcluster", "output truncated what=%s", what);
    for (char *save = NULL, *line = strtok_r(out, "\n", &save); line != NULL;
         line = strtok_r(NULL, "\n", &save))
        sp_log(lvl, "pgcluster", "output what=%s line=\"%s\"", what, line);
    if (lvl != SP_LOG_DEBUG)
        sp_log(SP_LOG_WARN, "pgcluster", "child failed what=%s status=%d", what, code);
    return code;
}

static int fsop(const sp_pgcluster_t *c, enum fs_op op, const char *path, const char *path2,
                const char *data, sp_err_t *err)
{
    struct fsop o = {op, path, path2, data, data ? strlen(data) : 0};
    int rc = run(c, "fs", NULL, &o, 1u, err);
    if (rc < 0)
        return -1;
    if (rc != 0)
        return sp_err_set(err, SP_EUNAVAIL, "cannot prepare the PostgreSQL directory");
    return 0;
}

/* Atomic replace of <pgdata>/<name>, as the cluster user. */
static int write_conf(const sp_pgcluster_t *c, const char *dir, const char *name, const char *data,
                      sp_err_t *err)
{
    char *p = xasprintf("%s/%s", dir, name), *t = xasprintf("%s/.%s.tmp", dir, name);
    int rc = (p && t) ? fsop(c, FS_WRITE, p, t, data, err)
                      : sp_err_set(err, SP_EINTERNAL, "out of memory");
    free(p);
    free(t);
    return rc;
}

static int pg_ctl(const sp_pgcluster_t *c, const char *what, const char *const *args,
                  unsigned ok_mask, sp_err_t *err)
{
    char exe[PATH_MAX];
    snprintf(exe, sizeof(exe), "%s/pg_ctl", c->bindir);
    const char *argv[16] = {exe};
    int n = 1;
    for (; args[n - 1] != NULL && n < 15; n++)
        argv[n] = args[n - 1];
    argv[n] = NULL;
    return run(c, what, (char *const *)argv, NULL, ok_mask, err);
}

/* ----------------------------------------------------------------- steps */

/* The data dir itself is root's; the cluster user only needs to pass
 * through it to reach pg/. 0700 would stop it: add --x for others, keeping
 * it unlistable (0711-style). Other ancestors are the operator's choice;
 * the probe in prepare_root reports them. */
static int prepare_data_dir(const char *dir, bool drop, sp_err_t *err)
{
    if (mkdir(dir, drop ? 0711 : 0700) != 0 && errno != EEXIST) {
        sp_log(SP_LOG_ERROR, "pgcluster", "mkdir failed path=%s err=%s", dir, strerror(errno));
        return sp_err_set(err, SP_EINVAL, "cannot create the data directory");
    }
    struct stat st;
    if (stat(dir, &st) != 0 || !S_ISDIR(st.st_mode)) {
        sp_log(SP_LOG_ERROR, "pgcluster", "not a directory path=%s", dir);
        return sp_err_set(err, SP_EINVAL, "data directory is not a directory");
    }
    if (drop && (st.st_mode & 0011) != 0011) {
        if (chmod(dir, (st.st_mode & 07777) | 0011) != 0) {
            sp_log(SP_LOG_ERROR, "pgcluster", "chmod failed path=%s err=%s", dir, strerror(errno));
            return sp_err_set(err, SP_EINVAL, "cannot make the data directory traversable");
        }
        sp_log(SP_LOG_INFO, "pgcluster", "data dir made traversable path=%s mode=%o", dir,
               (unsigned)((st.st_mode & 07777) | 0011));
    }
    return 0;
}

/* <data-dir>/pg: created by us in root's directory, then handed over. */
static int prepare_root(sp_pgcluster_t *c, sp_err_t *err)
{
    if (mkdir(c->root, 0700) != 0 && errno != EEXIST) {
        sp_log(SP_LOG_ERROR, "pgcluster", "mkdir failed path=%s err=%s", c->root, strerror(errno));
        return sp_err_set(err, SP_EINVAL, "cannot create the PostgreSQL directory");
    }
    struct stat st;
    if (lstat(c->root, &st) != 0 || !S_ISDIR(st.st_mode)) {
        sp_log(SP_LOG_ERROR, "pgcluster", "not a directory path=%s", c->root);
        return sp_err_set(err, SP_EINVAL, "PostgreSQL directory is not a directory");
    }
    if (c->drop && (st.st_uid != c->uid || st.st_gid != c->gid) &&
        lchown(c->root, c->uid, c->gid) != 0) {
        sp_log(SP_LOG_ERROR, "pgcluster", "chown failed path=%s err=%s", c->root, strerror(errno));
        return sp_err_set(err, SP_EINTERNAL, "cannot hand the PostgreSQL directory over");
    }
    if ((st.st_mode & 07777) != 0700 && chmod(c->root, 0700) != 0) {
        sp_log(SP_LOG_ERROR, "pgcluster", "chmod failed path=%s err=%s", c->root, strerror(errno));
        return sp_err_set(err, SP_EINTERNAL, "cannot protect the PostgreSQL directory");
    }
    /* Can the cluster user reach it (every ancestor traversable)? */
    struct fsop o = {FS_PROBE, c->root, NULL, NULL, 0};
    int rc = run(c, "probe", NULL, &o, 1u, err);
    if (rc < 0)
        return -1;
    if (rc != 0) {
        sp_log(SP_LOG_ERROR, "pgcluster",
               "cluster user cannot reach its directory path=%s user=%s "
               "hint=\"make every "
               "parent directory traversable (o+x)\"",
               c->root, c->drop ? PG_USER : c->osuser);
        return sp_err_set(err, SP_EINVAL, "PostgreSQL user cannot reach the data directory");
    }
    return 0;
}

static int take_lock(sp_pgcluster_t *c, sp_err_t *err)
{
    char *p = xasprintf("%s/.spaced.lock", c->root);
    if (p == NULL)
        return sp_err_set(err, SP_EINTERNAL, "out of memory");
    /* O_CLOEXEC matters: see run(). O_NOFOLLOW: the directory is the
     * cluster user's. */
    c->lock_fd = open(p, O_RDWR | O_CREAT | O_CLOEXEC | O_NOFOLLOW, 0600);
    if (c->lock_fd < 0) {
        sp_log(SP_LOG_ERROR, "pgcluster", "lock open failed path=%s err=%s", p, strerror(errno));
        free(p);
        return sp_err_set(err, SP_EINTERNAL, "cannot open the PostgreSQL lock file");
    }
    if (flock(c->lock_fd, LOCK_EX | LOCK_NB) != 0) {
        int e = errno;
        char holder[32] = "";
        ssize_t n = pread(c->lock_fd, holder, sizeof(holder) - 1, 0);
        holder[n > 0 ? n : 0] = '\0';
        holder[strcspn(holder, "\n")] = '\0';
        sp_log(SP_LOG_ERROR, "pgcluster", "cluster locked path=%s holder_pid=%s err=%s", p,
               holder[0] ? holder : "?", strerror(e));
        free(p);
        close(c->lock_fd);
        c->lock_fd = -1;
        if (e == EWOULDBLOCK)
            return sp_err_set(err, SP_ECONFLICT,
                              "embedded PostgreSQL is managed by another spaced process");
        return sp_err_set(err, SP_EINTERNAL, "cannot lock the PostgreSQL directory");
    }
    free(p);
    char pid[32];
    int n = snprintf(pid, sizeof(pid), "%ld\n", (long)getpid());
    if (ftruncate(c->lock_fd, 0) != 0 || pwrite(c->lock_fd, pid, (size_t)n, 0) != n)
        sp_log(SP_LOG_WARN, "pgcluster", "lock pid write failed err=%s", strerror(errno));
    return 0;
}

static int do_initdb(sp_pgcluster_t *c, sp_err_t *err)
{
    char *tmp = xasprintf("%s/data.init", c->root);
    char *conf = xasprintf("%s/data.init/postgresql.conf", c->root);
    char exe[PATH_MAX];
    snprintf(exe, sizeof(exe), "%s/initdb", c->bindir);
    int rc = -1;
    if (tmp == NULL || conf == NULL) {
        sp_err_set(err, SP_EINTERNAL, "out of memory");
        goto out;
    }
    /* A half-made data.init from a crash mid-initdb: start over. */
    char *const rm[] = {"/bin/rm", "-rf", "--", tmp, NULL};
    int st = run(c, "rm", rm, NULL, 1u, err);
    if (st < 0)
        goto out;
    if (st != 0) {
        sp_err_set(err, SP_EUNAVAIL, "cannot clear a partial PostgreSQL initdb");
        goto out;
    }
    /* --locale=C: byte order collation, so a glibc upgrade can never
     * silently corrupt text indexes. Checksums: it holds platform state.
     * Peer only, no TCP, even before our pg_hba.conf is written. */
    char *const argv[] = {exe,
                          "-D",
                          tmp,
                          "-U",
                          PG_USER,
                          "-E",
                          "UTF8",
                          "--locale=C",
                          "--data-checksums",
                          "--auth-local=peer",
                          "--auth-host=reject",
                          NULL};
    struct timespec t0, t1;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    st = run(c, "initdb", argv, NULL, 1u, err);
    if (st < 0)
        goto out;
    if (st != 0) {
        sp_err_set(err, SP_EUNAVAIL, "PostgreSQL initdb failed");
        goto out;
    }
    clock_gettime(CLOCK_MONOTONIC, &t1);
    /* Strict include: a missing spaced.conf must fail the start rather
     * than run on defaults (which listen on TCP localhost). */
    if (fsop(c, FS_APPEND, conf, NULL,
             "\n# Added by spaced: its settings, rewritten on every start.\n"
             "include = 'spaced.conf'\n",
             err) != 0)
        goto out;
    if (fsop(c, FS_RENAME, tmp, c->pgdata, NULL, err) != 0)
        goto out;
    sp_log(SP_LOG_INFO, "pgcluster", "initdb done pgdata=%s ms=%ld", c->pgdata,
           (long)((t1.tv_sec - t0.tv_sec) * 1000 + (t1.tv_nsec - t0.tv_nsec) / 1000000));
    rc = 0;
out:
    free(tmp);
    free(conf);
    return rc;
}

static int write_configs(sp_pgcluster_t *c, sp_err_t *err)
{
    char logdir[PATH_MAX];
    snprintf(logdir, sizeof(logdir), "%s/log", c->root);
    /* Paths passed path_ok: no quote needs escaping. */
    char *conf = xasprintf("# Written by spaced on every start; edits here are lost.\n"
                           "listen_addresses = ''\n"
                           "port = %d\n"
                           "unix_socket_directories = '%s'\n"
                           "unix_socket_permissions = 0700\n"
                           "max_connections = 50\n"
                           "shared_buffers = 64MB\n"
                           "fsync = on\n"
                           "synchronous_commit = on\n"
                           "full_page_writes = on\n"
                           "logging_collector = on\n"
                           "log_directory = '%s'\n"
                           "log_filename = 'postgres-%%a.log'\n" /* a week of daily files, reused */
                           "log_truncate_on_rotation = on\n"
                           "log_rotation_age = 1d\n"
                           "log_rotation_size = 0\n",
                           PG_PORT, c->sockdir, logdir);
    char *hba = xasprintf("# Written by spaced on every start; edits here are lost.\n"
                          "# Unix socket only (no TCP); OS user checked by the kernel.\n"
                          "local all all peer map=spaced\n");
    char *ident = c->drop ? xasprintf("# Written by spaced on every start.\n"
                                      "spaced root %s\n"
                                      "spaced %s %s\n",
                                      PG_USER, PG_USER, PG_USER)
                          : xasprintf("# Written by spaced on every start.\n"
                                      "spaced %s %s\n",
                                      c->osuser, PG_USER);
    int rc = -1;
    if (conf == NULL || hba == NULL || ident == NULL)
        sp_err_set(err, SP_EINTERNAL, "out of memory");
    else if (write_conf(c, c->pgdata, "spaced.conf", conf, err) == 0 &&
             write_conf(c, c->pgdata, "pg_hba.conf", hba, err) == 0 &&
             write_conf(c, c->pgdata, "pg_ident.conf", ident, err) == 0)
        rc = 0;
    free(conf);
    free(hba);
    free(ident);
    return rc;
}

/* pg_ctl status trusts kill(pid, 0). After a reboot (or a container
 * restart) the pid in a stale postmaster.pid may belong to something else;
 * then reusing would fail and starting would refuse. When /proc shows the
 * pid is not a postgres, drop the stale file. */
static void drop_stale_pidfile(sp_pgcluster_t *c)
{
    char p[PATH_MAX], lnk[64], exe[PATH_MAX];
    snprintf(p, sizeof(p), "%s/postmaster.pid", c->pgdata);
    FILE *f = fopen(p, "re");
    if (f == NULL)
        return;
    long pid = 0;
    if (fscanf(f, "%ld", &pid) != 1)
        pid = 0;
    fclose(f);
    if (pid <= 0)
        return;
    snprintf(lnk, sizeof(lnk), "/proc/%ld/exe", pid);
    ssize_t n = readlink(lnk, exe, sizeof(exe) - 1);
    if (n < 0)
        return; /* gone (pg_ctl sees that) or not ours to look at */
    exe[n] = '\0';
    const char *base = strrchr(exe, '/');
    base = base ? base + 1 : exe;
    if (strncmp(base, "postgres", 8) == 0 || strncmp(base, "postmaster", 10) == 0)
        return;
    sp_log(SP_LOG_WARN, "pgcluster", "stale postmaster.pid pid=%ld exe=%s", pid, exe);
    fsop(c, FS_UNLINK, p, NULL, NULL, NULL);
}

static void log_server_tail(const sp_pgcluster_t *c)
{
    FILE *f = fopen(c->logfile, "re");
    if (f == NULL)
        return;
    char buf[2048];
    if (fseek(f, -(long)(sizeof(buf) - 1), SEEK_END) != 0)
        rewind(f);
    size_t n = fread(buf, 1, sizeof(buf) - 1, f);
    fclose(f);
    buf[n] = '\0';
    char *save = NULL, *line = strtok_r(buf, "\n", &save);
    if (n == sizeof(buf) - 1 && line != NULL)
        line = strtok_r(NULL, "\n", &save); /* first one is likely cut */
    for (; line != NULL; line = strtok_r(NULL, "\n", &save))
        sp_log(SP_LOG_WARN, "pgcluster", "server log line=\"%s\"", line);
}

/* 1 running, 0 not, -1 error. */
static int status(const sp_pgcluster_t *c, sp_err_t *err)
{
    const char *const args[] = {"status", "-D", c->pgdata, NULL};
    int st = pg_ctl(c, "pg_ctl status", args, (1u << 0) | (1u << 3), err);
    if (st < 0)
        return -1;
    if (st == 0)
        return 1;
    if (st == 3)
        return 0;
    return sp_err_set(err, SP_EUNAVAIL, "cannot query the PostgreSQL server state");
}

static int start_server(sp_pgcluster_t *c, sp_err_t *err)
{
    const char *const args[] = {"start", "-w",      "-s", "-t",       PG_START_WAIT,
                                "-D",    c->pgdata, "-l", c->logfile, NULL};
    struct timespec t0, t1;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    int st = pg_ctl(c, "pg_ctl start", args, 1u, err);
    if (st < 0)
        return -1;
    if (st != 0) {
        log_server_tail(c);
        return sp_err_set(err, SP_EUNAVAIL, "embedded PostgreSQL failed to start");
    }
    clock_gettime(CLOCK_MONOTONIC, &t1);
    sp_log(SP_LOG_INFO, "pgcluster", "server started pgdata=%s ms=%ld", c->pgdata,
           (long)((t1.tv_sec - t0.tv_sec) * 1000 + (t1.tv_nsec - t0.tv_nsec) / 1000000));
    return 0;
}

/* First line of a libpq message, for a one-line log field. */
static const char *line1(const char *msg, char *buf, size_t n)
{
    snprintf(buf, n, "%s", msg ? msg : "");
    buf[strcspn(buf, "\r\n")] = '\0';
    return buf;
}

/* Creates database `space` if missing; also proves the conninfo works. */
static int ensure_db(sp_pgcluster_t *c, sp_err_t *err)
{
    char *ci = xasprintf("host='%s' port=%d dbname=postgres user=%s connect_timeout=30", c->sockdir,
                         PG_PORT, PG_USER);
    if (ci == NULL)
        return sp_err_set(err, SP_EINTERNAL, "out of memory");
    PGconn *pg = PQconnectdb(ci);
    free(ci);
    char why[256];
    int rc = -1;
    if (PQstatus(pg) != CONNECTION_OK) {
        sp_log(SP_LOG_ERROR, "pgcluster", "connect failed err=\"%s\"",
               line1(PQerrorMessage(pg), why, sizeof(why)));
        sp_err_set(err, SP_EUNAVAIL, "cannot connect to the embedded PostgreSQL");
        goto out;
    }
    const char *const params[] = {PG_DB};
    PGresult *r = PQexecParams(pg, "SELECT 1 FROM pg_database WHERE datname = $1", 1, NULL, params,
                               NULL, NULL, 0);
    if (PQresultStatus(r) != PGRES_TUPLES_OK) {
        sp_log(SP_LOG_ERROR, "pgcluster", "database lookup failed err=\"%s\"",
               line1(PQresultErrorMessage(r), why, sizeof(why)));
        PQclear(r);
        sp_err_set(err, SP_EUNAVAIL, "embedded PostgreSQL query failed");
        goto out;
    }
    bool exists = PQntuples(r) > 0;
    PQclear(r);
    if (!exists) {
        /* Constant SQL: CREATE DATABASE takes no parameters. */
        r = PQexec(pg, "CREATE DATABASE " PG_DB);
        if (PQresultStatus(r) != PGRES_COMMAND_OK) {
            sp_log(SP_LOG_ERROR, "pgcluster", "create database failed err=\"%s\"",
                   line1(PQresultErrorMessage(r), why, sizeof(why)));
            PQclear(r);
            sp_err_set(err, SP_EUNAVAIL, "cannot create the database");
            goto out;
        }
        PQclear(r);
        sp_log(SP_LOG_INFO, "pgcluster", "database created name=%s", PG_DB);
    }
    rc = 0;
out:
    PQfinish(pg);
    return rc;
}

static void cluster_free(sp_pgcluster_t *c)
{
    if (c == NULL)
        return;
    if (c->lock_fd >= 0)
        close(c->lock_fd); /* releases the flock */
    free(c->root);
    free(c->pgdata);
    free(c->sockdir);
    free(c->logfile);
    free(c->bindir);
    free(c->conninfo);
    free(c->groups);
    free(c->osuser);
    for (size_t i = 0; i < sizeof(c->env) / sizeof(c->env[0]); i++)
        free(c->env[i]);
    free(c);
}

/* ------------------------------------------------------------------- API */

static int check_path(const char *p, sp_err_t *err)
{
    if (path_ok(p))
        return 0;
    sp_log(SP_LOG_ERROR, "pgcluster",
           "unsupported characters in path path=\"%s\" allowed=\"A-Z a-z 0-9 "
           "/._-+@:~=%%\"",
           p);
    return sp_err_set(err, SP_EINVAL, "data directory path has unsupported characters");
}

sp_pgcluster_t *sp_pgcluster_start(const char *data_dir, sp_err_t *err)
{
    if (data_dir == NULL || data_dir[0] == '\0') {
        sp_err_set(err, SP_EINVAL, "no data directory");
        return NULL;
    }
    sp_pgcluster_t *c = calloc(1, sizeof(*c));
    if (c == NULL) {
        sp_err_set(err, SP_EINTERNAL, "out of memory");
        return NULL;
    }
    c->lock_fd = -1;
    char real[PATH_MAX], ver[16];
    /* Checked before mkdir when possible, and again once resolved. */
    if (data_dir[0] == '/' && check_path(data_dir, err) != 0)
        goto fail;
    if (lookup_user(c, err) != 0 || prepare_data_dir(data_dir, c->drop, err) != 0)
        goto fail;
    if (realpath(data_dir, real) == NULL) {
        sp_log(SP_LOG_ERROR, "pgcluster", "realpath failed path=%s err=%s", data_dir,
               strerror(errno));
        sp_err_set(err, SP_EINVAL, "cannot resolve the data directory");
        goto fail;
    }
    if (check_path(real, err) != 0)
        goto fail;
    c->root = xasprintf("%s/pg", real);
    c->pgdata = xasprintf("%s/pg/data", real);
    c->sockdir = xasprintf("%s/pg/run", real);
    c->logfile = xasprintf("%s/pg/log/postgres.log", real);
    if (!c->root || !c->pgdata || !c->sockdir || !c->logfile) {
        sp_err_set(err, SP_EINTERNAL, "out of memory");
        goto fail;
    }
    if (strlen(c->sockdir) + SOCK_NAME_LEN >= sizeof(((struct sockaddr_un *)0)->sun_path)) {
        sp_log(SP_LOG_ERROR, "pgcluster", "socket path too long sockdir=%s max=%zu", c->sockdir,
               sizeof(((struct sockaddr_un *)0)->sun_path) - 1 - SOCK_NAME_LEN);
        sp_err_set(err, SP_EINVAL, "data directory path too long for a unix socket");
        goto fail;
    }
    read_pg_version(c->pgdata, ver, sizeof(ver));
    c->bindir = find_bindir(ver[0] ? ver : NULL);
    if (c->bindir == NULL) {
        sp_log(SP_LOG_ERROR, "pgcluster",
               "PostgreSQL binaries not found cluster_version=%s "
               "hint=\"apt-get install postgresql, or pass --database-url\"",
               ver[0] ? ver : "none");
        sp_err_set(err, SP_EUNAVAIL, "PostgreSQL server binaries not found");
        goto fail;
    }
    c->env[1] = xasprintf("PATH=%s:/usr/bin:/bin", c->bindir);
    c->env[2] = strdup("LC_ALL=C");
    const char *tz = getenv("TZ");
    if (tz != NULL)
        c->env[3] = xasprintf("TZ=%s", tz);
    c->conninfo =
        xasprintf("host='%s' port=%d dbname=%s user=%s", c->sockdir, PG_PORT, PG_DB, PG_USER);
    if (!c->env[1] || !c->env[2] || (tz && !c->env[3]) || !c->conninfo) {
        sp_err_set(err, SP_EINTERNAL, "out of memory");
        goto fail;
    }
    if (prepare_root(c, err) != 0 || take_lock(c, err) != 0)
        goto fail;
    /* Under the lock from here. */
    char logdir[PATH_MAX];
    snprintf(logdir, sizeof(logdir), "%s/log", c->root);
    if (fsop(c, FS_MKDIR, c->sockdir, NULL, NULL, err) != 0 ||
        fsop(c, FS_MKDIR, logdir, NULL, NULL, err) != 0)
        goto fail;
    if (ver[0] == '\0') {
        struct stat st;
        if (lstat(c->pgdata, &st) == 0) {
            /* We only ever create it by rename after a full initdb. */
            sp_log(SP_LOG_ERROR, "pgcluster", "PGDATA exists without PG_VERSION pgdata=%s",
                   c->pgdata);
            sp_err_set(err, SP_EUNAVAIL, "embedded PostgreSQL directory is damaged");
            goto fail;
        }
        if (do_initdb(c, err) != 0)
            goto fail;
    }
    if (write_configs(c, err) != 0)
        goto fail;
    drop_stale_pidfile(c);
    int up = status(c, err);
    if (up < 0)
        goto fail;
    if (up) {
        /* A previous spaced died without stopping it; new config applies at
         * the next restart. */
        sp_log(SP_LOG_INFO, "pgcluster", "reusing running server pgdata=%s", c->pgdata);
    } else if (start_server(c, err) != 0) {
        goto fail;
    }
    if (ensure_db(c, err) != 0)
        goto fail;
    sp_log(SP_LOG_INFO, "pgcluster", "ready sockdir=%s port=%d user=%s bindir=%s", c->sockdir,
           PG_PORT, c->drop ? PG_USER : c->osuser, c->bindir);
    return c;
fail:
    cluster_free(c);
    return NULL;
}

int sp_pgcluster_attach(const char *data_dir, char *out, size_t cap, sp_err_t *err)
{
    char real[PATH_MAX], lock[PATH_MAX + 32];
    if (data_dir == NULL || realpath(data_dir, real) == NULL)
        return 0; /* no data directory yet: no cluster either */
    if (check_path(real, err) != 0)
        return -1;
    snprintf(lock, sizeof(lock), "%s/pg/.spaced.lock", real);
    /* Read-only and shared: probing must never keep a serving spaced from taking it. */
    int fd = open(lock, O_RDONLY | O_CLOEXEC | O_NOFOLLOW);
    if (fd < 0) {
        int e = errno;
        if (e == ENOENT)
            return 0;
        sp_log(SP_LOG_ERROR, "pgcluster", "lock open failed path=%s err=%s", lock, strerror(e));
        return sp_err_set(err, e == EACCES ? SP_EFORBIDDEN : SP_EINTERNAL,
                          "cannot read the embedded PostgreSQL's lock (another user's data "
                          "directory?)");
    }
    int held = 0;
    if (flock(fd, LOCK_SH | LOCK_NB) == 0)
        flock(fd, LOCK_UN);
    else if (errno == EWOULDBLOCK)
        held = 1;
    close(fd);
    if (!held)
        return 0;
    int n = snprintf(out, cap, "host='%s/pg/run' port=%d dbname=%s user=%s", real, PG_PORT, PG_DB,
                     PG_USER);
    if (n < 0 || (size_t)n >= cap)
        return sp_err_set(err, SP_EINVAL, "data directory path too long");
    return 1;
}

const char *sp_pgcluster_conninfo(const sp_pgcluster_t *c)
{
    return c->conninfo;
}

int sp_pgcluster_running(const sp_pgcluster_t *c)
{
    return status(c, NULL) == 1;
}

int sp_pgcluster_ensure_running(sp_pgcluster_t *c, sp_err_t *err)
{
    int up = status(c, err);
    if (up < 0)
        return -1;
    if (up)
        return 0;
    sp_log(SP_LOG_WARN, "pgcluster", "server not running, restarting pgdata=%s", c->pgdata);
    drop_stale_pidfile(c);
    return start_server(c, err);
}

int sp_pgcluster_stop(sp_pgcluster_t *c, sp_err_t *err)
{
    if (c == NULL)
        return 0;
    const char *const args[] = {"stop", "-m",         "fast", "-w",      "-s",
                                "-t",   PG_STOP_WAIT, "-D",   c->pgdata, NULL};
    int rc = 0;
    /* Not running counts as stopped (exit 1 + "PID file does not exist"). */
    int st = pg_ctl(c, "pg_ctl stop", args, 1u, err);
    if (st < 0) {
        rc = -1;
    } else if (st != 0 && status(c, NULL) != 0) {
        log_server_tail(c);
        rc = sp_err_set(err, SP_EUNAVAIL, "embedded PostgreSQL did not stop");
    } else {
        sp_log(SP_LOG_INFO, "pgcluster", "server stopped pgdata=%s", c->pgdata);
    }
    cluster_free(c);
    return rc;
}
