/*
 * server.c - `spaced serve | keys | teams | admin-key | template | version`.
 *
 * serve: data directory, database (embedded cluster or --database-url),
 * migrations, first-start keys, then one h2o event loop running the HTTP
 * surfaces, the store and the controller until SIGINT/SIGTERM. The management
 * commands (keys, teams, admin-key) work beside a running serve: they use its
 * embedded cluster through its socket rather than starting one.
 * Options come from the config file (server/config.h) and then the command line.
 */
#include "server/server.h"

#include <errno.h>
#include <fcntl.h>
#include <getopt.h>
#include <h2o.h>
#include <netinet/in.h>
#include <pwd.h>
#include <signal.h>
#include <sodium.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/signalfd.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>
#include <arpa/inet.h>

#include "core/egress/egress.h"
#include "base/ids.h"
#include "core/control/admin.h"
#include "core/control/fleet.h"
#include "core/control/keys.h"
#include "base/log.h"
#include "core/store/migrate.h"
#include "core/egress/mitm.h"
#include "core/store/pgcluster.h"
#include "core/runtime/qemu.h"
#include "core/control/recon.h"
#include "core/control/sizes.h"
#include "core/egress/secrets.h"
#include "core/store/store.h"
#include "core/control/svc.h"
#include "core/control/snap.h"
#include "core/control/tmpl.h"
#include "core/control/tmplfiles.h"
#include "core/control/tokens.h"
#include "guest/tmplbuild.h"
#include "e2b-gateway/gw.h"
#include "native-api/napi.h"
#include "http/bodygate.h"
#include "http/http.h"
#include "http/sniff.h"
#include "http/tls.h"
#include "http/proxy.h"
#include "http/reqmetrics.h"
#include "server/opsrv.h"
#include "server/route.h"
#include "server/config.h"

#define SPACE_VERSION "0.1.0"

struct opts {
    const char *listen;
    const char *domain;   /* serve: sandbox host suffix (default space.localhost:<port>) */
    const char *tls_cert; /* serve: operator's certificate chain (PEM), with tls_key */
    const char *tls_key;
    const char *data_dir;
    const char *database_url;
    const char *runtime;
    const char *team;     /* keys create */
    const char *key_name; /* keys create */
    const char *agent;    /* template build: the guest agent binary */
    const char *master_key_file; /* serve: secrets' master key (else SPACE_MASTER_KEY, else
                                  * <data-dir>/master.key with the embedded database) */
    const char *cluster_key_file; /* serve: the nodes' shared secret (http/proxy.h) */
    bool force;           /* template build: ignore the cache */
    bool no_snapshot;     /* template build: do not build the template snapshot */
    const char *templates_dir; /* template build: specs from here, not the built-in ones */
    bool log_level_set;   /* --log-level was given */
    unsigned idle_timeout_s; /* serve: how long an idle client connection is kept open */
    const char *metrics_listen; /* serve: the operator listener for /metrics (server/opsrv.h) */
    const char *jail_uid_range;   /* the uids jailed QEMUs run as (core/runtime/jail.h) */
    const char *snapshot_dir;     /* storage all workers share: suspended sandboxes, template
                                   * images (core/runtime/qemu.h); NULL: none, one node */
    int template_max_layers;      /* serve: template images a disk chain stacks (0: default) */
    bool no_jail;                 /* --no-jail: QEMU unjailed (insecure, for comparisons) */
    bool insecure_no_seccomp;     /* start VMs without QEMU's seccomp sandbox */
    bool insecure_no_cgroups;     /* start VMs without their cgroup */
    const char *registry_mirror;   /* serve: where Docker Hub image references are pulled from */
    const char *insecure_registry; /* serve: registries reached over plain http (comma list) */
    unsigned long image_max_mb;    /* serve: cap on a container image (0: the default) */
    int build_cache_s;             /* serve: how long unused images and files stay (-1: default) */
    sp_quota_t quota;              /* serve: teams' default quotas (core/control/svc.h) */
    const char *quota_set[4];      /* teams set-quota: sandboxes, vcpus, memory-mb, snapshot-mb
                                    * (NULL: keep) */
    /* serve: this node's part in a fleet (core/control/fleet.h) */
    sp_role_t role;
    const char *advertise;    /* HOST:PORT other nodes reach this one at (default: --listen) */
    int worker_vcpus;         /* offered; 0: the role's default */
    int worker_memory_mb;
    const char *worker_labels; /* k=v,k=v */
    int heartbeat_timeout_s;
    int lost_grace_s;
    unsigned long max_body_kb;     /* serve: request bodies but uploads (KiB) */
    unsigned long max_upload_mb;   /* serve: file and template uploads (MiB; h2o's limit) */
    unsigned long max_large_bodies; /* serve: uploads over max_body_kb being received at once */
    /* serve: the spare pool (core/runtime/qemu.h): spares per template size at most (-1: none;
     * 0: $SPACE_POOL_SIZE, else its default) and their memory (0: $SPACE_POOL_MEMORY_MB, else
     * a quarter of the host's RAM) */
    int pool_size;
    int pool_memory_mb;
    int pool_reserve_mb; /* serve: host memory spares leave alone (-1: none; 0: the driver's
                          * $SPACE_POOL_RESERVE_MB, else a sixteenth of the host's RAM) */
    int prebuild_sizes;    /* serve: sizes per template whose snapshot is made ahead (sizes.h);
                            * 0: none */
    long egress_memory_mb; /* serve: all sandboxes' egress memory (core/egress/egmem.h); 0: a
                            * sixteenth of the host's RAM, at least 256 MiB */
};

/* Bodies: JSON and RPC bodies are small (the APIs' own caps are 1 MiB); uploads of files and
 * template files may be large (8 GiB was h2o's limit for everything before); a few at once. */
#define SP_SERVER_MAX_BODY_KB      1024
#define SP_SERVER_MAX_UPLOAD_MB    8192
#define SP_SERVER_MAX_LARGE_BODIES 16

/* E2B's Python SDKs pool their connections for 300 s and E2B's own edge keeps idle ones about
 * ten minutes; h2o's defaults (10 s) closed them under a pooled HTTP/2 connection, which the
 * SDK then reported as an error on the next call. */
#define SP_SERVER_IDLE_TIMEOUT_S 610

static void usage(FILE *f)
{
    fprintf(f,
            "usage: spaced serve [--listen ADDR:PORT] [--data-dir DIR] [--database-url URL]\n"
            "                    [--runtime qemu|none] [--log-level debug|info|warn|error]\n"
            "                    [--domain HOST[:PORT]] [--tls-cert FILE --tls-key FILE]\n"
            "                    [--master-key-file FILE] [--idle-timeout SECONDS]\n"
            "                    [--metrics-listen ADDR:PORT] [--log-format text|json]\n"
            "                    [--jail-uid-range START:COUNT] [--no-jail]\n"
            "                    [--snapshot-dir DIR] [--template-max-layers N]\n"
            "                    [--insecure-no-seccomp] [--insecure-no-cgroups]\n"
            "                    [--registry-mirror HOST[:PORT]] [--insecure-registry HOST:PORT,...]\n"
            "                    [--image-max-mb MIB] [--build-cache-s SECONDS] [--agent PATH]\n"
            "                    [--team-max-sandboxes N] [--team-max-vcpus N]\n"
            "                    [--team-max-memory-mb MIB] [--team-max-snapshot-mb MIB]\n"
            "                    [--role all|api|worker] [--advertise HOST:PORT]\n"
            "                    [--worker-vcpus N] [--worker-memory-mb MIB]\n"
            "                    [--worker-labels k=v,k=v] [--heartbeat-timeout-s N]\n"
            "                    [--lost-grace-s N]\n"
            "                    [--max-body-kb KIB] [--max-upload-mb MIB] [--max-large-bodies N]\n"
            "                    [--cluster-key-file FILE]\n"
            "                    [--pool-size N] [--pool-memory-mb MIB] [--prebuild-sizes N]\n"
            "                    [--pool-reserve-mb MIB] [--egress-memory-mb MIB]\n"
            "       spaced keys create [--team NAME] [--name NAME]\n"
            "       spaced keys list [--team NAME]\n"
            "       spaced keys revoke <key-id-or-prefix>\n"
            "       spaced teams list\n"
            "       spaced teams create <name>\n"
            "       spaced teams set-quota <team> [--sandboxes N|default] [--vcpus N|default]\n"
            "                                     [--memory-mb MIB|default]\n"
            "                                     [--snapshot-mb MIB|default]\n"
            "       spaced admin-key rotate\n"
            "       spaced template build <name> [--force] [--agent PATH] [--no-snapshot]\n"
            "                                    [--templates-dir DIR]\n"
            "       spaced template list\n"
            "       spaced version\n"
            "Common: --data-dir DIR (default $SPACE_DATA_DIR, else /var/lib/space as root,\n"
            "        else ~/.local/share/space), --database-url URL (default: the embedded\n"
            "        cluster in the data directory), --config FILE (default $SPACE_CONFIG,\n"
            "        else " SP_CONFIG_DEFAULT_PATH " if it exists: `name = value` lines for\n"
            "        any long option; the command line wins).\n");
}

static const char *default_data_dir(void)
{
    const char *env = getenv("SPACE_DATA_DIR");
    if (env != NULL && env[0] != '\0')
        return env;
    if (geteuid() == 0)
        return "/var/lib/space";
    static char buf[4096];
    const char *home = getenv("HOME");
    snprintf(buf, sizeof(buf), "%s/.local/share/space", home ? home : ".");
    return buf;
}

static int mkdir_p(const char *path, mode_t mode)
{
    char buf[4096];
    snprintf(buf, sizeof(buf), "%s", path);
    for (char *p = buf + 1; *p; p++) {
        if (*p == '/') {
            *p = '\0';
            if (mkdir(buf, 0755) < 0 && errno != EEXIST)
                return -1;
            *p = '/';
        }
    }
    if (mkdir(buf, mode) < 0 && errno != EEXIST)
        return -1;
    return 0;
}

/* ---- database setup (blocking, start-up only) ---- */

struct db {
    sp_pgcluster_t *cluster;
    char conninfo[1024];
};

/* serve starts (and locks) the embedded cluster. A management command (!serve) uses the
 * cluster a running serve manages, through its socket, and starts it itself only when none
 * does (then stops it when done, as before). */
static int db_open(const struct opts *o, struct db *db, bool serve)
{
    memset(db, 0, sizeof(*db));
    if (o->database_url != NULL) {
        snprintf(db->conninfo, sizeof(db->conninfo), "%s", o->database_url);
        return 0;
    }
    sp_err_t e;
    for (int attempt = 0; !serve && attempt < 2; attempt++) {
        int shared = sp_pgcluster_attach(o->data_dir, db->conninfo, sizeof(db->conninfo), &e);
        if (shared < 0) {
            fprintf(stderr, "spaced: %s\n", e.msg);
            return -1;
        }
        if (shared == 1)
            return 0;
        db->cluster = sp_pgcluster_start(o->data_dir, &e);
        if (db->cluster != NULL || e.code != SP_ECONFLICT)
            break;
        /* A serve took the lock between our look and our start: use its cluster. */
    }
    if (serve)
        db->cluster = sp_pgcluster_start(o->data_dir, &e);
    if (db->cluster == NULL) {
        fprintf(stderr, "spaced: cannot start the embedded PostgreSQL: %s\n", e.msg);
        return -1;
    }
    snprintf(db->conninfo, sizeof(db->conninfo), "%s", sp_pgcluster_conninfo(db->cluster));
    return 0;
}

/* As the store's connections (core/store/store.c): a server that takes writes, unless
 * conninfo says otherwise (its own target_session_attrs comes later, so it wins). */
static PGconn *db_connect(const char *conninfo)
{
    const char *const keys[] = {"target_session_attrs", "dbname", NULL};
    const char *const vals[] = {"read-write", conninfo, NULL};
    PGconn *c = PQconnectdbParams(keys, vals, 1);
    if (PQstatus(c) != CONNECTION_OK) {
        fprintf(stderr, "spaced: cannot connect to the database: %s", PQerrorMessage(c));
        PQfinish(c);
        return NULL;
    }
    PQclear(PQexec(c, "SET client_min_messages = warning"));
    return c;
}

/* Registers every template this build knows, with its build status in the data directory. */
static int sync_templates(PGconn *c, const char *data_dir)
{
    for (const char *const *n = sp_tmplbuild_builtin_names(); *n != NULL; n++) {
        sp_err_t e;
        size_t len = 0;
        char *json = sp_tmplbuild_spec_load(NULL, *n, &len, &e);
        sp_tmplbuild_spec_t *spec = NULL;
        if (json == NULL || sp_tmplbuild_spec_parse(json, len, &spec, &e) < 0) {
            fprintf(stderr, "spaced: template %s: %s\n", *n, e.msg);
            free(json);
            return -1;
        }
        free(json);
        sp_tmplbuild_paths_t p;
        bool built = sp_tmplbuild_current(data_dir, *n, &p, &e) == 0;
        char cpus[16], mem[16];
        snprintf(cpus, sizeof(cpus), "%d", spec->cpu_count > 0 ? spec->cpu_count : 1);
        snprintf(mem, sizeof(mem), "%d", spec->memory_mb > 0 ? spec->memory_mb : 256);
        const char *params[] = {spec->name, spec->description ? spec->description : "", cpus, mem,
                                built ? "ready" : "unbuilt", built ? p.hash : NULL};
        PGresult *r = PQexecParams(
            c,
            "INSERT INTO templates (name, description, cpu_count, memory_mb, status, build_id)"
            " VALUES ($1, $2, $3::int, $4::int, $5, $6)"
            " ON CONFLICT (name) DO UPDATE SET description = excluded.description,"
            "  cpu_count = excluded.cpu_count, memory_mb = excluded.memory_mb,"
            "  status = excluded.status, build_id = excluded.build_id, updated_at = now()"
            " WHERE templates.status IS DISTINCT FROM excluded.status"
            "  OR templates.build_id IS DISTINCT FROM excluded.build_id"
            "  OR templates.description IS DISTINCT FROM excluded.description",
            6, NULL, params, NULL, NULL, 0);
        int ok = PQresultStatus(r) == PGRES_COMMAND_OK;
        if (!ok)
            fprintf(stderr, "spaced: registering template %s: %s", *n, PQerrorMessage(c));
        PQclear(r);
        sp_tmplbuild_spec_free(spec);
        if (!ok)
            return -1;
    }
    return 0;
}

static int db_prepare(PGconn *c, const char *data_dir)
{
    sp_err_t e;
    int applied;
    if (sp_migrate_apply(c, &applied, &e) < 0) {
        fprintf(stderr, "spaced: %s\n", e.msg);
        return -1;
    }
    return sync_templates(c, data_dir);
}

/* The guest agent to put in template images: --agent, $SPACE_AGENT_BIN, or the one the
 * build tree (or an install) keeps beside spaced. */
static const char *find_agent(const char *given)
{
    if (given != NULL)
        return given;
    const char *env = getenv("SPACE_AGENT_BIN");
    if (env != NULL && env[0] != '\0')
        return env;
    static char path[4096];
    char exe[4096];
    ssize_t n = readlink("/proc/self/exe", exe, sizeof(exe) - 1);
    if (n <= 0)
        return NULL;
    exe[n] = '\0';
    char *slash = strrchr(exe, '/');
    if (slash == NULL)
        return NULL;
    *slash = '\0';
    static const char *const rel[] = {"/space-agent", "/../agent/space-agent",
                                      "/../lib/space/space-agent"};
    for (size_t i = 0; i < sizeof(rel) / sizeof(rel[0]); i++) {
        snprintf(path, sizeof(path), "%s%s", exe, rel[i]);
        if (access(path, X_OK) == 0)
            return path;
    }
#ifdef SP_INSTALL_AGENT
    /* Where `cmake --install` put it, for a spaced that was copied or linked elsewhere. */
    if (access(SP_INSTALL_AGENT, X_OK) == 0)
        return SP_INSTALL_AGENT;
#endif
    return NULL;
}

struct tsnap_wait {
    int done;
    sp_err_t err;
    bool failed;
};

static void on_tsnap(void *arg, const sp_err_t *err)
{
    struct tsnap_wait *w = arg;
    w->done = 1;
    w->failed = err != NULL;
    if (err != NULL)
        w->err = *err;
}

/* The template snapshot the first create would otherwise build (core/runtime/qemu.h: boot a builder
 * VM, run the template's warmup, snapshot it), built now so that first create is fast: a loop
 * and a qemu driver of our own that adopts nothing (a serving spaced may share the data dir).
 * For the template's default size; other sizes are still built on their first create. */
static int template_snapshot(const struct opts *o, const char *name)
{
    const char *cold = getenv("SPACE_COLD_BOOT");
    if (cold != NULL && strcmp(cold, "1") == 0) {
        fprintf(stderr, "template %s: snapshot skipped (SPACE_COLD_BOOT=1)\n", name);
        return 0;
    }
    sp_log_level_t saved = sp_log_min_level;
    if (!o->log_level_set && sp_log_min_level < SP_LOG_WARN)
        sp_log_min_level = SP_LOG_WARN; /* the progress lines say it; --log-level shows more */
    int rc = 1;
    sp_loop_t *loop = sp_loop_create();
    sp_qemu_opts_t qo = {.data_dir = o->data_dir,
                         .accel = getenv("SPACE_ACCEL"),
                         .qemu = getenv("SPACE_QEMU"),
                         .no_adopt = 1,
                         .jail_uid_range = o->jail_uid_range,
                         .snapshot_dir = o->snapshot_dir,
                         .no_jail = o->no_jail,
                         .insecure_no_seccomp = o->insecure_no_seccomp,
                         .insecure_no_cgroups = o->insecure_no_cgroups};
    sp_err_t e;
    sp_driver_t *d = loop != NULL ? sp_qemu_create(loop, &qo, &e) : NULL;
    if (loop == NULL)
        sp_err_set(&e, SP_EINTERNAL, "out of memory");
    bool tty = isatty(2);
    struct timespec t0, t1;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    struct tsnap_wait w = {0};
    sp_qemu_tsnap_info_t info;
    if (d != NULL && sp_qemu_template_snapshot(d, name, 0, 0, &info, on_tsnap, &w, &e) == 0) {
        fprintf(stderr, "template %s: snapshot (boot, warmup, freeze) ...%s", name,
                tty ? "" : "\n");
        while (!w.done) {
            sp_loop_run_once(loop, 200);
            clock_gettime(CLOCK_MONOTONIC, &t1);
            if (tty)
                fprintf(stderr, "\r\033[Ktemplate %s: snapshot (boot, warmup, freeze) ... %.1fs",
                        name, (double)(t1.tv_sec - t0.tv_sec) +
                                  (double)(t1.tv_nsec - t0.tv_nsec) / 1e9);
        }
        clock_gettime(CLOCK_MONOTONIC, &t1);
        double secs =
            (double)(t1.tv_sec - t0.tv_sec) + (double)(t1.tv_nsec - t0.tv_nsec) / 1e9;
        if (tty)
            fprintf(stderr, "\r\033[K");
        if (w.failed) {
            e = w.err;
        } else {
            fprintf(stderr, "template %s: snapshot %s in %.1fs (%s)\n", name,
                    info.built ? "built" : "up to date", secs, info.dir);
            rc = 0;
        }
    }
    if (rc != 0)
        fprintf(stderr,
                "spaced: template %s: the image is built, but its snapshot is not: %s (creates "
                "will try again; --no-snapshot skips this step)\n",
                name, e.msg);
    sp_driver_destroy(d);
    sp_loop_destroy(loop);
    sp_log_min_level = saved;
    return rc;
}

static int cmd_template(struct opts *o, int argc, char **argv)
{
    if (argc >= 1 && strcmp(argv[0], "list") == 0) {
        for (const char *const *n = sp_tmplbuild_builtin_names(); *n != NULL; n++) {
            sp_tmplbuild_paths_t p;
            sp_err_t e;
            if (sp_tmplbuild_current(o->data_dir, *n, &p, &e) == 0)
                printf("%-24s ready    %.12s  %s\n", *n, p.hash, p.rootfs);
            else
                printf("%-24s unbuilt\n", *n);
        }
        return 0;
    }
    if (argc < 2 || strcmp(argv[0], "build") != 0) {
        usage(stderr);
        return 2;
    }
    const char *agent = find_agent(o->agent);
    if (agent == NULL) {
        fprintf(stderr, "spaced: cannot find the guest agent binary; pass --agent PATH\n");
        return 1;
    }
    sp_tmplbuild_opts_t bo = {.name = argv[1],
                              .data_dir = o->data_dir,
                              .templates_dir = o->templates_dir,
                              .agent_path = agent,
                              .force = o->force,
                              .progress = 1};
    sp_tmplbuild_paths_t p;
    sp_err_t e;
    if (sp_tmplbuild_run(&bo, &p, &e) < 0) {
        fprintf(stderr, "spaced: template %s: %s\n", argv[1], e.msg);
        return 1;
    }
    if (!o->no_snapshot && template_snapshot(o, argv[1]) != 0)
        return 1;
    printf("template %s ready: %s\n", argv[1], p.rootfs);
    return 0;
}

/* ---- keys ---- */

/* <data_dir>/<name> (api-key, admin-key): the secret, 0600, replaced atomically. */
static int write_key_file(const char *data_dir, const char *name, const char *key)
{
    char path[4096], tmp[4200];
    snprintf(path, sizeof(path), "%s/%s", data_dir, name);
    snprintf(tmp, sizeof(tmp), "%s.tmp", path);
    unlink(tmp); /* a leftover could have other modes: O_CREAT keeps an existing file's */
    int fd = open(tmp, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC | O_EXCL, 0600);
    if (fd < 0)
        return -1;
    size_t n = strlen(key);
    bool ok = write(fd, key, n) == (ssize_t)n && write(fd, "\n", 1) == 1 && fsync(fd) == 0;
    close(fd);
    if (!ok || rename(tmp, path) < 0) {
        unlink(tmp);
        return -1;
    }
    return 0;
}

static int read_key_file(const char *data_dir, char *out, size_t cap)
{
    char path[4096];
    snprintf(path, sizeof(path), "%s/api-key", data_dir);
    FILE *f = fopen(path, "r");
    if (f == NULL)
        return -1;
    bool ok = fgets(out, (int)cap, f) != NULL;
    fclose(f);
    if (!ok)
        return -1;
    out[strcspn(out, "\r\n")] = '\0';
    return 0;
}

/* A management command's work on a connection to the migrated database: its exit status. */
typedef int (*db_cmd_fn)(PGconn *c, const struct opts *o, int argc, char **argv);

/* Opens the database as a management command does (db_open), connects, migrates, runs fn, and
 * closes it all again: fn's exit status, 1 when the database could not be made ready. */
static int with_db(struct opts *o, db_cmd_fn fn, int argc, char **argv)
{
    struct db db;
    if (db_open(o, &db, false) < 0)
        return 1;
    int rc = 1;
    PGconn *c = db_connect(db.conninfo);
    if (c != NULL && db_prepare(c, o->data_dir) == 0)
        rc = fn(c, o, argc, argv);
    PQfinish(c);
    if (db.cluster != NULL)
        sp_pgcluster_stop(db.cluster, NULL);
    return rc;
}

static int keys_run(PGconn *c, const struct opts *o, int argc, char **argv)
{
    const char *team = o->team, *name = o->key_name;
    sp_err_t e;
    if (strcmp(argv[0], "create") == 0) {
        char key[SP_KEY_LEN + 1], kid[SP_ID_LEN + 1];
        if (sp_keys_create(c, team, name, key, kid, &e) < 0) {
            fprintf(stderr, "spaced: %s\n", e.msg);
            return 1;
        }
        printf("%s\n", key);
        fprintf(stderr, "created key %s for team %s (shown once; store it now)\n", kid,
                team ? team : "default");
        return 0;
    }
    if (strcmp(argv[0], "list") == 0)
        return sp_keys_list(c, team, stdout, &e) < 0 ? 1 : 0;
    if (strcmp(argv[0], "revoke") == 0 && argc >= 2) {
        if (sp_keys_revoke(c, argv[1], &e) < 0) {
            fprintf(stderr, "spaced: %s\n", e.msg);
            return 1;
        }
        return 0;
    }
    usage(stderr);
    return 2;
}

static int cmd_keys(struct opts *o, int argc, char **argv)
{
    if (argc < 1) {
        usage(stderr);
        return 2;
    }
    return with_db(o, keys_run, argc, argv);
}

static int teams_run(PGconn *c, const struct opts *o, int argc, char **argv)
{
    sp_err_t e;
    if (argc == 1)
        return sp_keys_team_list(c, stdout, &e) < 0 ? 1 : 0;
    if (strcmp(argv[0], "set-quota") == 0) {
        if (sp_keys_team_set_quota(c, argv[1], o->quota_set, &e) < 0) {
            fprintf(stderr, "spaced: %s\n", e.msg);
            return e.code == SP_EINVAL ? 2 : 1;
        }
        return 0;
    }
    char id[SP_ID_LEN + 1];
    if (sp_keys_team_create(c, argv[1], id, &e) < 0) {
        fprintf(stderr, "spaced: %s\n", e.msg);
        return 1;
    }
    printf("%s\n", id);
    fprintf(stderr, "created team %s (keys: spaced keys create --team %s)\n", argv[1], argv[1]);
    return 0;
}

/* `teams list | create <name> | set-quota <team> ...`. Teams are also made by `keys create
 * --team`. */
static int cmd_teams(struct opts *o, int argc, char **argv)
{
    bool list = argc == 1 && strcmp(argv[0], "list") == 0;
    bool create = argc == 2 && strcmp(argv[0], "create") == 0;
    bool quota = argc == 2 && strcmp(argv[0], "set-quota") == 0 &&
                 (o->quota_set[0] || o->quota_set[1] || o->quota_set[2] || o->quota_set[3]);
    if (!list && !create && !quota) {
        usage(stderr);
        return 2;
    }
    sp_err_t e;
    if (create && sp_keys_check_team_name(argv[1], &e) < 0) {
        fprintf(stderr, "spaced: %s\n", e.msg);
        return 2;
    }
    return with_db(o, teams_run, argc, argv);
}

static int admin_key_run(PGconn *c, const struct opts *o, int argc, char **argv)
{
    sp_err_t e;
    char key[SP_KEY_LEN + 1];
    if (sp_keys_admin_create(c, true, key, &e) < 0) {
        fprintf(stderr, "spaced: %s\n", e.msg);
        return 1;
    }
    if (write_key_file(o->data_dir, "admin-key", key) < 0)
        fprintf(stderr, "spaced: cannot write %s/admin-key: %s\n", o->data_dir, strerror(errno));
    printf("%s\n", key);
    fprintf(stderr, "new admin key (the old one no longer works); also in %s/admin-key\n",
            o->data_dir);
    sodium_memzero(key, sizeof(key));
    return 0;
}

/* `admin-key rotate`: a new admin key (the old one stops working), written to
 * <data-dir>/admin-key and printed. */
static int cmd_admin_key(struct opts *o, int argc, char **argv)
{
    if (argc != 1 || strcmp(argv[0], "rotate") != 0) {
        usage(stderr);
        return 2;
    }
    return with_db(o, admin_key_run, argc, argv);
}

/* ---- serving ---- */

struct srv {
    sp_loop_t *loop;
    h2o_globalconf_t config;
    h2o_context_t ctx;
    h2o_accept_ctx_t accept_ctx;
    h2o_accept_ctx_t tls_accept_ctx; /* accept_ctx plus ssl_ctx: same hosts, same handlers */
    SSL_CTX *ssl_ctx;
    int listen_fd;
    sp_sniff_t *sniff; /* one port: TLS and plain HTTP told apart by the first byte */
    sp_sniff_t *sniff6; /* the same port on ::1, when listening on 127.0.0.1 */
    sp_route_t route;  /* the surfaces and where requests go (server/route.h); its wid is
                        * this node's worker id (<data-dir>/worker-id) */
    int sfd;
    bool stop;
};

struct handler {
    h2o_handler_t super;
    sp_route_t *route;
};

static int on_req(h2o_handler_t *self, h2o_req_t *req)
{
    return sp_route_request(((struct handler *)self)->route, req);
}

static int listen_on(struct srv *s, const char *addr)
{
    char host[256];
    const char *colon = strrchr(addr, ':');
    if (colon == NULL || (size_t)(colon - addr) >= sizeof(host)) {
        fprintf(stderr, "spaced: --listen wants ADDR:PORT\n");
        return -1;
    }
    memcpy(host, addr, (size_t)(colon - addr));
    host[colon - addr] = '\0';
    int port = atoi(colon + 1);
    struct sockaddr_in sa = {.sin_family = AF_INET, .sin_port = htons((uint16_t)port)};
    if (port <= 0 || port > 65535 || inet_pton(AF_INET, host, &sa.sin_addr) != 1) {
        fprintf(stderr, "spaced: bad listen address %s\n", addr);
        return -1;
    }
    int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    int one = 1;
    setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
    if (bind(fd, (struct sockaddr *)&sa, sizeof(sa)) < 0 || listen(fd, SOMAXCONN) < 0) {
        fprintf(stderr, "spaced: cannot listen on %s: %s\n", addr, strerror(errno));
        close(fd);
        return -1;
    }
    s->listen_fd = fd;
    return 0;
}

/*
 * Names under localhost (the default domain) resolve to ::1 as well as 127.0.0.1, and many
 * clients try ::1 first: a 127.0.0.1 listener gets a ::1 twin on the same port when it can
 * (best effort: -1 when not). */
static int listen_loopback6(const char *addr)
{
    if (strncmp(addr, "127.0.0.1:", 10) != 0)
        return -1;
    int port = atoi(addr + 10);
    int fd = socket(AF_INET6, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0)
        return -1;
    int one = 1;
    setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
    setsockopt(fd, IPPROTO_IPV6, IPV6_V6ONLY, &one, sizeof(one));
    struct sockaddr_in6 sa = {.sin6_family = AF_INET6, .sin6_port = htons((uint16_t)port),
                              .sin6_addr = IN6ADDR_LOOPBACK_INIT};
    if (bind(fd, (struct sockaddr *)&sa, sizeof(sa)) < 0 || listen(fd, SOMAXCONN) < 0) {
        sp_log(SP_LOG_INFO, "server", "no ::1 listener port=%d err=%s", port, strerror(errno));
        close(fd);
        return -1;
    }
    return fd;
}

/*
 * The sandbox domain (E2B `domain`): --domain, else $SPACE_E2B_DOMAIN, else
 * space.localhost:<listen port>. Names under localhost resolve to loopback through
 * nss-myhostname (scripts/lib.sh makes sure it is in nsswitch.conf), so the default needs
 * no DNS set-up on the server's own machine.
 */
static void serve_domain(const struct opts *o, char *out, size_t cap)
{
    const char *d = o->domain ? o->domain : getenv("SPACE_E2B_DOMAIN");
    if (d != NULL && d[0] != '\0') {
        snprintf(out, cap, "%s", d);
        return;
    }
    const char *colon = strrchr(o->listen, ':');
    snprintf(out, cap, "space.localhost:%s", colon ? colon + 1 : "3000");
}

/* TLS for the shared port: the operator's certificate, or the local CA's wildcard one. */
static bool http1_only(void *arg, const char *server_name)
{
    struct srv *s = arg;
    return s->route.e2b != NULL && sp_e2b_http1_only(s->route.e2b, server_name);
}

static int setup_tls(struct srv *s, const struct opts *o, const char *domain,
                     sp_tls_files_t *files)
{
    char host[256];
    snprintf(host, sizeof(host), "%s", domain);
    char *colon = strrchr(host, ':');
    if (colon != NULL && strchr(host, ']') == NULL && strchr(colon + 1, '.') == NULL)
        *colon = '\0'; /* "space.localhost:3000" -> "space.localhost" */
    sp_err_t e;
    const char *cert = o->tls_cert, *key = o->tls_key;
    memset(files, 0, sizeof(*files));
    if (cert == NULL) {
        if (sp_tls_ensure(o->data_dir, host, files, &e) < 0) {
            fprintf(stderr, "spaced: TLS set-up failed: %s\n", e.msg);
            return -1;
        }
        cert = files->cert;
        key = files->key;
    }
    s->ssl_ctx = sp_tls_server_ctx(cert, key, &e);
    if (s->ssl_ctx == NULL) {
        fprintf(stderr, "spaced: TLS set-up failed: %s\n", e.msg);
        return -1;
    }
    sp_tls_set_http1_only(s->ssl_ctx, http1_only, s);
    s->tls_accept_ctx = s->accept_ctx;
    s->tls_accept_ctx.ssl_ctx = s->ssl_ctx;
    return 0;
}

static void on_signal(sp_watch_t *w, int events, void *arg)
{
    struct srv *s = arg;
    struct signalfd_siginfo si;
    while (read(s->sfd, &si, sizeof(si)) == (ssize_t)sizeof(si))
        sp_log(SP_LOG_INFO, "server", "signal=%u", si.ssi_signo);
    s->stop = true;
}

static void worker_id(const char *data_dir, char out[SP_ID_LEN + 1])
{
    char path[4096];
    snprintf(path, sizeof(path), "%s/worker-id", data_dir);
    FILE *f = fopen(path, "r");
    if (f != NULL) {
        bool ok = fgets(out, SP_ID_LEN + 1, f) != NULL && sp_ids_valid(out);
        fclose(f);
        if (ok)
            return;
    }
    sp_ids_sandbox(out);
    f = fopen(path, "w");
    if (f != NULL) {
        fputs(out, f);
        fclose(f);
    }
}

/*
 * Secrets and credential injection. The master key comes from SPACE_MASTER_KEY, from
 * --master-key-file, or (the embedded default only) from <data-dir>/master.key, created on
 * first start; never from the database. Without one, both stay off and the secrets API says
 * how to configure a key. The test binary may trust an extra CA for upstream destinations
 * (SPACE_TEST_UPSTREAM_CA), for loopback test servers; the shipped binary never does.
 */
static int load_master_key(const struct opts *o, unsigned char key[SP_SECRETS_KEY_LEN],
                           sp_secrets_key_source_t *src)
{
    sp_err_t e;
    int rc = sp_secrets_load_key(o->master_key_file,
                                 o->database_url == NULL ? o->data_dir : NULL, key, src, &e);
    /* Read (or refused): it leaves the environment before any child starts (PostgreSQL,
     * QEMU, qemu-img), and its bytes are wiped where they were, so /proc/<spaced>/environ
     * (the block the process started with) no longer shows it either. */
    char *v = getenv("SPACE_MASTER_KEY");
    char *kv = v != NULL ? v - strlen("SPACE_MASTER_KEY=") : NULL;
    size_t kn = kv != NULL ? strlen(kv) : 0;
    unsetenv("SPACE_MASTER_KEY");
    if (kv != NULL)
        sodium_memzero(kv, kn);
    if (rc < 0)
        fprintf(stderr, "spaced: master key: %s\n", e.msg);
    return rc;
}

/* key: from load_master_key, at the start of serve; wiped by the caller. */
static int setup_secrets(unsigned char key[SP_SECRETS_KEY_LEN], sp_secrets_key_source_t src,
                         sp_loop_t *loop, sp_store_t *store, sp_svc_t *svc, bool test_binary,
                         sp_secrets_t **sec_out, sp_mitm_t **mitm_out)
{
    sp_err_t e;
    sp_secrets_t *sec =
        sp_secrets_create(loop, store, src != SP_SECRETS_KEY_NONE ? key : NULL, &e);
    sodium_memzero(key, SP_SECRETS_KEY_LEN);
    if (sec == NULL) {
        fprintf(stderr, "spaced: secrets: %s\n", e.msg);
        return -1;
    }
    *sec_out = sec;
    sp_svc_set_secrets(svc, sec);
    static const char *const from[] = {"none", "environment", "file", "created"};
    sp_log(src == SP_SECRETS_KEY_NONE ? SP_LOG_WARN : SP_LOG_INFO, "server",
           "secrets master_key=%s%s", from[src],
           src == SP_SECRETS_KEY_NONE ? " (secrets and credential injection are off: set "
                                        "SPACE_MASTER_KEY or --master-key-file)"
                                      : "");
    if (src == SP_SECRETS_KEY_NONE)
        return 0;
    const char *ca = test_binary ? getenv("SPACE_TEST_UPSTREAM_CA") : NULL;
    sp_mitm_opts_t mo = {.test_upstream_ca_file = ca != NULL && ca[0] != '\0' ? ca : NULL};
    *mitm_out = sp_mitm_create(loop, store, sec, &mo, &e);
    if (*mitm_out == NULL) {
        fprintf(stderr, "spaced: credential injection: %s\n", e.msg);
        return -1;
    }
    return 0;
}

static void egress_policy_changed(void *arg, const char *sandbox_id, const json_t *policy)
{
    sp_egress_policy_set(arg, sandbox_id, policy);
}

/* The fleet options that need no database: -1 (said on stderr) when the role cannot start. */
static int check_role(struct opts *o, json_t **labels)
{
    if (o->role != SP_ROLE_ALL && o->database_url == NULL) {
        fprintf(stderr, "spaced: --role %s needs --database-url (the PostgreSQL every node of "
                        "the fleet shares); only --role all runs the embedded one\n",
                sp_fleet_role_name(o->role));
        return -1;
    }
    if (o->advertise == NULL) {
        const char *colon = strrchr(o->listen, ':');
        size_t hl = colon ? (size_t)(colon - o->listen) : 0;
        bool any = (hl == 7 && strncmp(o->listen, "0.0.0.0", 7) == 0) ||
                   (hl == 2 && strncmp(o->listen, "::", 2) == 0) ||
                   (hl == 4 && strncmp(o->listen, "[::]", 4) == 0) || hl == 0;
        if (any && o->role != SP_ROLE_ALL) {
            fprintf(stderr, "spaced: listening on %s, other nodes cannot reach this one there: "
                            "give --advertise HOST:PORT\n", o->listen);
            return -1;
        }
        o->advertise = o->listen;
    }
    sp_err_t e;
    *labels = sp_fleet_parse_labels(o->worker_labels, &e);
    if (*labels == NULL) {
        fprintf(stderr, "spaced: --worker-labels: %s\n", e.msg);
        return -1;
    }
    if (o->role == SP_ROLE_WORKER) { /* a worker offers what the host has, unless told */
        long cpus = sysconf(_SC_NPROCESSORS_ONLN), pages = sysconf(_SC_PHYS_PAGES),
             page = sysconf(_SC_PAGESIZE);
        if (o->worker_vcpus == 0)
            o->worker_vcpus = 4 * (int)(cpus > 0 ? cpus : 1);
        if (o->worker_memory_mb == 0 && pages > 0 && page > 0)
            o->worker_memory_mb = (int)((long long)pages * page >> 20);
    }
    return 0;
}

static int cmd_serve(struct opts *o, sp_server_driver_factory test_driver)
{
    json_t *labels = NULL;
    if (check_role(o, &labels) < 0)
        return 2;
    unsigned char mkey[SP_SECRETS_KEY_LEN];
    sp_secrets_key_source_t msrc;
    if (load_master_key(o, mkey, &msrc) < 0) {
        json_decref(labels);
        return 1;
    }
    struct db db;
    if (db_open(o, &db, true) < 0) {
        sodium_memzero(mkey, sizeof(mkey));
        json_decref(labels);
        return 1;
    }
    int rc = 1;
    PGconn *c = db_connect(db.conninfo);
    unsigned char hashkey[SP_HASHKEY_LEN];
    sp_err_t e;
    if (c == NULL || db_prepare(c, o->data_dir) < 0 || sp_keys_hash_key(c, hashkey, &e) < 0) {
        PQfinish(c);
        goto out_db;
    }
    /* The embedded default's first start: a team and a key, written 0600 to the data dir. */
    char key[256] = "";
    long teams = 0;
    if (o->database_url == NULL && sp_keys_team_count(c, &teams, &e) == 0 && teams == 0) {
        char kid[SP_ID_LEN + 1];
        if (sp_keys_create(c, "default", "first key", key, kid, &e) < 0 ||
            write_key_file(o->data_dir, "api-key", key) < 0) {
            fprintf(stderr, "spaced: cannot create the first API key\n");
            PQfinish(c);
            goto out_db;
        }
    } else if (o->database_url == NULL) {
        read_key_file(o->data_dir, key, sizeof(key));
    }
    /* The admin key (/v1/admin): made by whichever server starts first without one. */
    char admin_key[SP_KEY_LEN + 1];
    int made = sp_keys_admin_create(c, false, admin_key, &e);
    if (made < 0 || (made == 1 && write_key_file(o->data_dir, "admin-key", admin_key) < 0)) {
        fprintf(stderr, "spaced: cannot create the admin key\n");
        PQfinish(c);
        goto out_db;
    }
    sodium_memzero(admin_key, sizeof(admin_key));
    /* Sandboxes' envd tokens from before schema 12, kept in clear, are sealed now
     * (core/control/tokens.h): each keeps working and is given again by connect. */
    sp_tokens_t *tokens = sp_tokens_create(hashkey, msrc != SP_SECRETS_KEY_NONE ? mkey : NULL);
    int converted = 0;
    if (tokens == NULL || sp_tokens_convert(c, tokens, &converted, &e) < 0) {
        fprintf(stderr, "spaced: cannot convert sandbox tokens\n");
        sp_tokens_destroy(tokens);
        PQfinish(c);
        goto out_db;
    }
    sp_tokens_destroy(tokens);
    if (converted > 0)
        sp_log(SP_LOG_INFO, "server", "sandbox tokens converted=%d (no longer kept in clear)",
               converted);
    PQfinish(c);

    struct srv s = {.listen_fd = -1};
    sp_tls_files_t tls_files;
    sp_recon_t *recon = NULL;
    sp_sizes_t *sizes = NULL;
    sp_tmpl_t *tmpl = NULL;
    sp_snap_t *snap = NULL;
    sp_opsrv_t *opsrv = NULL;
    sp_fleet_t *fleet = NULL;
    sp_driver_t *nodriver = NULL; /* an API node's templates and snapshots: they run no VMs */
    bool api = o->role == SP_ROLE_API;
    s.loop = sp_loop_create();
    sp_store_t *store = sp_store_create(s.loop, db.conninfo, 4, &e);
    sp_svc_t *svc = store ? sp_svc_create(s.loop, store, hashkey, &e) : NULL;
    if (svc != NULL)
        sp_svc_set_quota_defaults(svc, &o->quota);
    sp_admin_t *admin = store ? sp_admin_create(store, hashkey) : NULL;
    sp_secrets_t *secrets = NULL;
    sp_mitm_t *mitm = NULL;
    sp_driver_t *driver = NULL;
    /* Outbound traffic: before the driver, which names the agent channels of the VMs it
     * re-adopts as it starts (the proxy attaches to each). */
    sp_egress_opts_t ego = {.memory_limit = (uint64_t)o->egress_memory_mb << 20};
    sp_egress_t *egress = svc && !api ? sp_egress_create(s.loop, store, &ego, &e) : NULL;
    if (svc != NULL && !api && egress == NULL) {
        fprintf(stderr, "spaced: egress proxy: %s\n", e.msg);
        goto out_srv;
    }
    /* With a master key, the database alone cannot make a sandbox's token (tokens.h). After
     * every pointer out_srv frees is set: a jump from before them read them uninitialized. */
    if (svc != NULL && msrc != SP_SECRETS_KEY_NONE && sp_svc_set_token_master(svc, mkey, &e) < 0)
        goto out_srv;
    if (svc != NULL && msrc == SP_SECRETS_KEY_NONE)
        sp_log(SP_LOG_WARN, "server", "sandbox tokens from the database's key: without a master "
                                      "key (SPACE_MASTER_KEY or --master-key-file) whoever reads "
                                      "the database can recompute them");
    if (egress != NULL)
        sp_svc_set_egress_hook(svc, egress_policy_changed, egress);
    const char *runtime = o->runtime ? o->runtime : "qemu";
    if (api) {
        nodriver = sp_driver_unavailable_create(s.loop, "this node runs no sandboxes (--role api)");
    } else if (test_driver != NULL && strcmp(runtime, "test") == 0) {
        driver = test_driver(s.loop, o->data_dir);
    } else if (strcmp(runtime, "qemu") == 0) {
        /* SPACE_ACCEL=auto|kvm|tcg (default auto: KVM only where a probe guest boots). */
        sp_qemu_opts_t qo = {.data_dir = o->data_dir,
                             .accel = getenv("SPACE_ACCEL"),
                             .qemu = getenv("SPACE_QEMU"),
                             .qemu_img = NULL,
                             .jail_uid_range = o->jail_uid_range,
                             .snapshot_dir = o->snapshot_dir,
                             .max_layers = o->template_max_layers,
                             .no_jail = o->no_jail,
                             .insecure_no_seccomp = o->insecure_no_seccomp,
                             .insecure_no_cgroups = o->insecure_no_cgroups,
                             .pool_size = o->pool_size,
                             .pool_memory_mb = o->pool_memory_mb,
                             .pool_reserve_mb = o->pool_reserve_mb};
        driver = sp_qemu_create(s.loop, &qo, &e);
        if (driver == NULL) {
            sp_log(SP_LOG_WARN, "server", "microVM runtime unavailable: %s", e.msg);
            driver = sp_driver_unavailable_create(s.loop, e.msg);
        }
    } else if (strcmp(runtime, "none") == 0) {
        driver = sp_driver_unavailable_create(s.loop, "the server runs without a microVM runtime");
    } else {
        fprintf(stderr, "spaced: unknown runtime %s (qemu or none)\n", runtime);
        goto out_srv;
    }
    if (svc != NULL &&
        setup_secrets(mkey, msrc, s.loop, store, svc, test_driver != NULL, &secrets, &mitm) < 0)
        goto out_srv;
    if (egress != NULL && mitm != NULL)
        sp_egress_set_mitm(egress, mitm); /* credentials for destinations with rules */
    if (svc != NULL && driver != NULL)
        sp_svc_set_driver(svc, driver); /* commands and files reach VMs through it */
    char wid[SP_ID_LEN + 1];
    unsigned char links_key[32];
    bool links_key_set = false;
    worker_id(o->data_dir, wid);
    snprintf(s.route.wid, sizeof(s.route.wid), "%s", wid);
    s.route.svc = svc;
    {
        unsigned char ck[SP_PROXY_KEY_MAX];
        size_t ck_len = 0;
        if (o->cluster_key_file != NULL &&
            sp_proxy_read_key(o->cluster_key_file, ck, &ck_len, &e) < 0) {
            fprintf(stderr, "spaced: %s\n", e.msg);
            goto out_srv;
        }
        /* E2B upload links made by one worker and used through another: the fleet's key */
        links_key_set = ck_len > 0;
        if (links_key_set)
            sp_tmplfiles_fleet_link_key(ck, ck_len, links_key);
        sp_proxy_opts_t po = {.key = ck_len > 0 ? ck : NULL,
                              .key_len = ck_len,
                              .idle_timeout_ms = o->idle_timeout_s * 1000u};
        s.route.proxy = sp_proxy_create(s.loop, &po, &e);
        sodium_memzero(ck, sizeof(ck));
        if (s.route.proxy == NULL) {
            fprintf(stderr, "spaced: %s\n", e.msg);
            goto out_srv;
        }
    }
    recon = svc && driver ? sp_recon_create(s.loop, store, driver, wid, &e) : NULL;
    if (recon != NULL) /* rows from before placement are a single node's */
        sp_recon_set_unplaced(recon, o->role == SP_ROLE_ALL);
    /* template snapshots for the sizes of the last day's creates, made while this worker idles */
    if (recon != NULL && o->prebuild_sizes > 0 && driver->ops->prepare != NULL) {
        sp_sizes_opts_t zo = {.per_template = o->prebuild_sizes};
        sizes = sp_sizes_create(s.loop, store, driver, &zo, &e);
        if (sizes == NULL) {
            fprintf(stderr, "spaced: %s\n", e.msg);
            goto out_srv;
        }
    }
    if (svc != NULL)
        sp_svc_set_placement(svc, api ? NULL : wid, o->heartbeat_timeout_s);
    char accel_file[4200];
    snprintf(accel_file, sizeof(accel_file), "%s/vms/accel", o->data_dir);
    sp_fleet_opts_t fo = {.role = o->role,
                          .worker_id = wid,
                          .address = o->advertise,
                          .vcpus = o->worker_vcpus,
                          .memory_mb = o->worker_memory_mb,
                          .labels = labels,
                          .accel_file = accel_file,
                          .version = SPACE_VERSION,
                          .heartbeat_timeout_s = o->heartbeat_timeout_s,
                          .lost_grace_s = o->lost_grace_s};
    fleet = store ? sp_fleet_create(s.loop, store, driver, &fo, &e) : NULL;
    if (store != NULL && fleet == NULL) {
        fprintf(stderr, "spaced: fleet: %s\n", e.msg);
        goto out_srv;
    }
    sp_driver_t *tdriver = driver ? driver : nodriver;
    tmpl = store && tdriver
               ? sp_tmpl_create(s.loop, store, tdriver, o->data_dir, api ? NULL : wid, &e)
               : NULL;
    snap = store && tdriver ? sp_snap_create(s.loop, store, tdriver, api ? NULL : wid, &e) : NULL;
    if (snap != NULL)
        sp_snap_set_quota_default(snap, o->quota.snapshot_mb);
    /* Builds from container images put the agent into them (none found: refused) */
    if (tmpl != NULL && sp_tmpl_set_images(tmpl, find_agent(o->agent), o->registry_mirror,
                                           o->insecure_registry,
                                           (uint64_t)o->image_max_mb << 20, &e) < 0)
        sp_log(SP_LOG_WARN, "server", "builds from images are off: %s", e.msg);
    if (tmpl != NULL && o->build_cache_s >= 0)
        sp_tmpl_set_build_cache(tmpl, (uint64_t)o->build_cache_s);
    if (tmpl != NULL)
        sp_tmpl_set_secrets(tmpl, secrets); /* registry passwords from team secrets */
    if (tmpl != NULL)
        sp_tmpl_set_egress(tmpl, egress); /* each builder's policy, while its build runs */
    if (tmpl != NULL && !api && o->snapshot_dir != NULL)
        sp_tmpl_set_shared_dir(tmpl, o->snapshot_dir); /* builds from versions built elsewhere */
    if (tmpl != NULL && links_key_set)
        sp_tmplfiles_set_link_key(sp_tmpl_files(tmpl), links_key);
    sodium_memzero(links_key, sizeof links_key);
    s.route.fleet = fleet;
    s.route.api = api;
    s.route.napi = svc ? sp_napi_create(svc) : NULL;
    if (s.route.napi != NULL) {
        sp_napi_set_driver(s.route.napi, driver); /* command sessions attach through it */
        sp_napi_set_admin(s.route.napi, admin);
        sp_napi_set_tmpl(s.route.napi, tmpl);
        sp_napi_set_snap(s.route.napi, snap);
        sp_napi_set_fleet(s.route.napi, fleet);
    }
    /* The E2B surface and the host suffix it returns as `domain`. */
    char domain[256];
    serve_domain(o, domain, sizeof(domain));
    sp_e2b_opts_t eo = {.domain = domain};
    s.route.e2b = svc ? sp_e2b_create(svc, &eo) : NULL;
    if (s.route.e2b != NULL) {
        sp_e2b_set_tmpl(s.route.e2b, tmpl);
        sp_e2b_set_snap(s.route.e2b, snap);
        /* figures from other workers */
        sp_e2b_set_peers(s.route.e2b, s.route.proxy, s.route.wid);
    }
    if ((recon == NULL && !api) || tmpl == NULL || snap == NULL || s.route.napi == NULL ||
        s.route.e2b == NULL || admin == NULL) {
        fprintf(stderr, "spaced: start-up failed\n");
        goto out_srv;
    }

    h2o_config_init(&s.config);
    /* h2o's one limit, for every route and protocol; the gate holds the rest (HTTP/1). */
    s.config.max_request_entity_size = (size_t)o->max_upload_mb << 20;
    s.route.max_body = (uint64_t)o->max_body_kb << 10;
    s.route.gate =
        sp_bodygate_create(s.loop, sp_route_body_policy, &s.route, (unsigned)o->max_large_bodies);
    if (s.route.gate == NULL)
        goto out_srv;
    /* One idle limit for both protocols: HTTP/1.1 keep-alive between requests (h2o's request
     * timeout) and an HTTP/2 connection without streams. */
    s.config.http1.req_timeout = (uint64_t)o->idle_timeout_s * 1000;
    s.config.http2.idle_timeout = (uint64_t)o->idle_timeout_s * 1000;
    h2o_hostconf_t *host =
        h2o_config_register_host(&s.config, h2o_iovec_init(H2O_STRLIT("default")), 65535);
    h2o_pathconf_t *path = h2o_config_register_path(host, "/", 0);
    struct handler *hd = (struct handler *)h2o_create_handler(path, sizeof(*hd));
    hd->super.on_req = on_req;
    hd->route = &s.route;
    if (sp_reqmetrics_attach(path, sp_route_classify, &s.route) < 0)
        goto out_srv;
    h2o_context_init(&s.ctx, sp_loop_native(s.loop), &s.config);
    s.accept_ctx.ctx = &s.ctx;
    s.accept_ctx.hosts = s.config.hosts;
    if (setup_tls(&s, o, domain, &tls_files) < 0 || listen_on(&s, o->listen) < 0)
        goto out_srv;
    s.sniff = sp_sniff_create(s.loop, s.listen_fd, &s.accept_ctx, &s.tls_accept_ctx);
    if (s.sniff == NULL) {
        close(s.listen_fd);
        goto out_srv;
    }
    sp_sniff_set_gate(s.sniff, s.route.gate);
    if (o->metrics_listen != NULL &&
        (opsrv = sp_opsrv_create(s.loop, o->metrics_listen, &e)) == NULL) {
        fprintf(stderr, "spaced: metrics listener: %s\n", e.msg);
        goto out_srv;
    }
    int fd6 = listen_loopback6(o->listen);
    if (fd6 >= 0 &&
        (s.sniff6 = sp_sniff_create(s.loop, fd6, &s.accept_ctx, &s.tls_accept_ctx)) == NULL)
        close(fd6);
    if (s.sniff6 != NULL)
        sp_sniff_set_gate(s.sniff6, s.route.gate);

    sigset_t set;
    sigemptyset(&set);
    sigaddset(&set, SIGINT);
    sigaddset(&set, SIGTERM);
    sigprocmask(SIG_BLOCK, &set, NULL);
    signal(SIGPIPE, SIG_IGN);
    int sfd = signalfd(-1, &set, SFD_NONBLOCK | SFD_CLOEXEC);
    s.sfd = sfd;
    sp_watch_t *sw = sp_watch_create(s.loop, sfd, on_signal, &s);
    sp_watch_set(sw, SP_IO_READ);

    printf("space %s listening on http://%s and https://%s\n", SPACE_VERSION, o->listen,
           o->listen);
    printf("sandbox domain: %s   (E2B: E2B_API_URL=http://%s, sandboxes at "
           "https://<port>-<id>.%s)\n",
           domain, o->listen, domain);
    if (o->tls_cert == NULL) {
        printf("trust the local CA%s:\n  export SSL_CERT_FILE=%s NODE_EXTRA_CA_CERTS=%s\n",
               tls_files.created_ca ? " (new)" : "",
               tls_files.bundle[0] ? tls_files.bundle : tls_files.ca_cert, tls_files.ca_cert);
    }
    if (key[0])
        printf("API key: %s   (also in %s/api-key)\n", key, o->data_dir);
    if (made == 1)
        printf("admin key (teams and keys, /v1/admin) in %s/admin-key\n", o->data_dir);
    printf("try: curl -H 'Authorization: Bearer <key>' http://%s/v1/templates\n", o->listen);
    if (opsrv != NULL)
        printf("metrics (operator only): http://%s/metrics\n", o->metrics_listen);
    fflush(stdout);
    sp_log(SP_LOG_INFO, "server", "serving listen=%s worker=%s runtime=%s role=%s advertise=%s",
           o->listen, wid, driver ? driver->ops->name : "none", sp_fleet_role_name(o->role),
           o->advertise);

    while (!s.stop)
        sp_loop_run_once(s.loop, 1000);
    sp_log(SP_LOG_INFO, "server", "shutting down");
    sp_watch_destroy(sw);
    close(sfd);
    rc = 0;
out_srv:
    sp_opsrv_destroy(opsrv);
    sp_sniff_destroy(s.sniff);
    sp_sniff_destroy(s.sniff6);
    sp_bodygate_destroy(s.route.gate);
    sp_sizes_destroy(sizes);
    sp_recon_destroy(recon);
    sp_fleet_destroy(fleet);
    if (tmpl != NULL)
        sp_tmpl_set_egress(tmpl, NULL); /* builds ending from here on have no proxy */
    sp_egress_destroy(egress); /* closes its mitm handles and proxied connections */
    sp_mitm_destroy(mitm);
    sp_store_destroy(store); /* pending statements answer first: builds may still need tmpl */
    sp_tmpl_destroy(tmpl);
    sp_snap_destroy(snap);
    sp_svc_destroy(svc);
    sp_secrets_destroy(secrets);
    sp_napi_destroy(s.route.napi);
    sp_admin_destroy(admin);
    sp_e2b_destroy(s.route.e2b);
    sp_proxy_destroy(s.route.proxy);
    sp_driver_destroy(driver);
    sp_driver_destroy(nodriver);
    if (s.ssl_ctx != NULL)
        SSL_CTX_free(s.ssl_ctx);
out_db:
    json_decref(labels);
    sodium_memzero(mkey, sizeof(mkey));
    if (db.cluster != NULL && sp_pgcluster_stop(db.cluster, &e) < 0)
        fprintf(stderr, "spaced: stopping the embedded PostgreSQL failed: %s\n", e.msg);
    return rc;
}

/*
 * The config file's settings (server/config.h) as options before the command line's, which
 * come after them and win: argv becomes [0] program, [1] command, the file's, the rest.
 * The new argv lives as long as the process (options point into it), like the original.
 */
static int with_config(int *argc, char ***argv, const struct option *lopts)
{
    static sp_config_args_t ca;
    static char **all;
    bool given;
    const char *path = sp_config_path(*argc, *argv, 2, &given);
    sp_err_t e;
    if (sp_config_load(path, given, lopts, &ca, &e) < 0) {
        fprintf(stderr, "spaced: config file %s: %s\n", path, e.msg);
        return -1;
    }
    if (ca.argc == 0)
        return 0;
    all = calloc((size_t)*argc + (size_t)ca.argc + 1, sizeof(*all));
    if (all == NULL) {
        fprintf(stderr, "spaced: out of memory\n");
        return -1;
    }
    all[0] = (*argv)[0];
    all[1] = (*argv)[1];
    for (int i = 0; i < ca.argc; i++)
        all[2 + i] = ca.argv[i];
    for (int i = 2; i < *argc; i++)
        all[ca.argc + i] = (*argv)[i];
    *argc += ca.argc;
    *argv = all;
    return 0;
}

int sp_server_main(int argc, char **argv, sp_server_driver_factory test_driver)
{
    if (sp_ids_init() < 0) {
        fprintf(stderr, "spaced: libsodium failed to initialise\n");
        return 1;
    }
    struct opts o = {.listen = "127.0.0.1:3000",
                     .idle_timeout_s = SP_SERVER_IDLE_TIMEOUT_S,
                     .max_body_kb = SP_SERVER_MAX_BODY_KB,
                     .max_upload_mb = SP_SERVER_MAX_UPLOAD_MB,
                     .max_large_bodies = SP_SERVER_MAX_LARGE_BODIES,
                     .quota = {SP_SVC_QUOTA_SANDBOXES, SP_SVC_QUOTA_VCPUS, SP_SVC_QUOTA_MEMORY_MB,
                               SP_SVC_QUOTA_SNAPSHOT_MB},
                     .heartbeat_timeout_s = 10,
                     .lost_grace_s = 60,
                     .build_cache_s = -1,
                     .prebuild_sizes = SP_SIZES_PER_TEMPLATE};
    static const struct option lopts[] = {
        {"listen", required_argument, NULL, 'l'},   {"data-dir", required_argument, NULL, 'd'},
        {"database-url", required_argument, NULL, 'u'}, {"runtime", required_argument, NULL, 'r'},
        {"log-level", required_argument, NULL, 'L'}, {"help", no_argument, NULL, 'h'},
        {"team", required_argument, NULL, 't'},      {"name", required_argument, NULL, 'n'},
        {"agent", required_argument, NULL, 'a'},     {"force", no_argument, NULL, 'f'},
        {"domain", required_argument, NULL, 'D'},    {"tls-cert", required_argument, NULL, 'C'},
        {"tls-key", required_argument, NULL, 'K'},
        {"no-snapshot", no_argument, NULL, 'S'},    {"templates-dir", required_argument, NULL, 'T'},
        {"master-key-file", required_argument, NULL, 'M'},
        {"idle-timeout", required_argument, NULL, 'I'},
        {"metrics-listen", required_argument, NULL, 1601},
        {"log-format", required_argument, NULL, 1602},
        {"config", required_argument, NULL, 'c'},
        {"jail-uid-range", required_argument, NULL, 0x100},
        {"no-jail", no_argument, NULL, 0x101},
        {"insecure-no-seccomp", no_argument, NULL, 0x102},
        {"insecure-no-cgroups", no_argument, NULL, 0x103},
        {"registry-mirror", required_argument, NULL, 0x104},
        {"insecure-registry", required_argument, NULL, 0x105},
        {"image-max-mb", required_argument, NULL, 0x106},
        {"build-cache-s", required_argument, NULL, 0x117},
        {"team-max-sandboxes", required_argument, NULL, 0x107},
        {"team-max-vcpus", required_argument, NULL, 0x108},
        {"team-max-memory-mb", required_argument, NULL, 0x109},
        {"sandboxes", required_argument, NULL, 0x10a},
        {"vcpus", required_argument, NULL, 0x10b},
        {"memory-mb", required_argument, NULL, 0x10c},
        {"team-max-snapshot-mb", required_argument, NULL, 0x150},
        {"snapshot-mb", required_argument, NULL, 0x151},
        {"role", required_argument, NULL, 0x110},
        {"advertise", required_argument, NULL, 0x111},
        {"worker-vcpus", required_argument, NULL, 0x112},
        {"worker-memory-mb", required_argument, NULL, 0x113},
        {"worker-labels", required_argument, NULL, 0x114},
        {"heartbeat-timeout-s", required_argument, NULL, 0x115},
        {"lost-grace-s", required_argument, NULL, 0x116},
        {"snapshot-dir", required_argument, NULL, 0x120},
        {"template-max-layers", required_argument, NULL, 0x121},
        {"max-body-kb", required_argument, NULL, 0x10d},
        {"max-upload-mb", required_argument, NULL, 0x10e},
        {"max-large-bodies", required_argument, NULL, 0x10f},
        {"cluster-key-file", required_argument, NULL, 0x130},
        {"pool-size", required_argument, NULL, 0x140},
        {"pool-memory-mb", required_argument, NULL, 0x141},
        {"prebuild-sizes", required_argument, NULL, 0x142},
        {"egress-memory-mb", required_argument, NULL, 0x143},
        {"pool-reserve-mb", required_argument, NULL, 0x144},
        {NULL, 0, NULL, 0}};
    if (argc < 2) {
        usage(stderr);
        return 2;
    }
    const char *cmd = argv[1];
    if (strcmp(cmd, "version") == 0) {
        printf("spaced %s\n", SPACE_VERSION);
        return 0;
    }
    if (strcmp(cmd, "help") == 0 || strcmp(cmd, "--help") == 0) {
        usage(stdout);
        return 0;
    }
    if (with_config(&argc, &argv, lopts) < 0)
        return 2;
    /* Options may come anywhere after the command (GNU getopt permutes positionals to the end). */
    optind = 2;
    int ch;
    while ((ch = getopt_long(argc, argv, "", lopts, NULL)) != -1) {
        switch (ch) {
        case 't':
            o.team = optarg;
            break;
        case 'a':
            o.agent = optarg;
            break;
        case 'f':
            o.force = true;
            break;
        case 'S':
            o.no_snapshot = true;
            break;
        case 'T':
            o.templates_dir = optarg;
            break;
        case 'n':
            o.key_name = optarg;
            break;
        case 'l':
            o.listen = optarg;
            break;
        case 'D':
            o.domain = optarg;
            break;
        case 'C':
            o.tls_cert = optarg;
            break;
        case 'K':
            o.tls_key = optarg;
            break;
        case 'M':
            o.master_key_file = optarg;
            break;
        case 0x130:
            o.cluster_key_file = optarg;
            break;
        case 'I': {
            char *end;
            unsigned long v = strtoul(optarg, &end, 10);
            if (*optarg == '\0' || *end != '\0' || v < 1 || v > 86400) {
                fprintf(stderr, "spaced: --idle-timeout wants seconds (1..86400)\n");
                return 2;
            }
            o.idle_timeout_s = (unsigned)v;
            break;
        }
        case 'd':
            o.data_dir = optarg;
            break;
        case 0x100:
            o.jail_uid_range = optarg;
            break;
        case 0x120:
            o.snapshot_dir = optarg;
            break;
        case 0x121: {
            char *end;
            long v = strtol(optarg, &end, 10);
            if (*optarg == '\0' || *end != '\0' || v < 1 || v > 16) {
                fprintf(stderr, "spaced: --template-max-layers wants 1..16\n");
                return 2;
            }
            o.template_max_layers = (int)v;
            break;
        }
        case 0x101:
            o.no_jail = true;
            break;
        case 0x102:
            o.insecure_no_seccomp = true;
            break;
        case 0x103:
            o.insecure_no_cgroups = true;
            break;
        case 0x104:
            o.registry_mirror = optarg;
            break;
        case 0x105:
            o.insecure_registry = optarg;
            break;
        case 0x106: {
            char *end;
            unsigned long v = strtoul(optarg, &end, 10);
            if (*optarg == '\0' || *end != '\0' || v < 1 || v > (1ul << 24)) {
                fprintf(stderr, "spaced: --image-max-mb wants MiB (1..16777216)\n");
                return 2;
            }
            o.image_max_mb = v;
            break;
        }
        case 0x107:
        case 0x108:
        case 0x109:
        case 0x150: {
            int k = ch == 0x150 ? 3 : ch - 0x107; /* sp_quota_t's order */
            char *end;
            unsigned long v = strtoul(optarg, &end, 10);
            if (*optarg == '\0' || *end != '\0' || v > 1000000000) {
                static const char *const names[] = {"sandboxes", "vcpus", "memory-mb",
                                                    "snapshot-mb"};
                fprintf(stderr, "spaced: --team-max-%s wants 0 (no limit) to 1000000000\n",
                        names[k]);
                return 2;
            }
            int *q[] = {&o.quota.sandboxes, &o.quota.vcpus, &o.quota.memory_mb,
                        &o.quota.snapshot_mb};
            *q[k] = (int)v;
            break;
        }
        case 0x10d:
        case 0x10e:
        case 0x10f: {
            static const char *const names[] = {"max-body-kb", "max-upload-mb",
                                                "max-large-bodies"};
            static const unsigned long maxes[] = {1ul << 24, 1ul << 24, 100000};
            char *end;
            unsigned long v = strtoul(optarg, &end, 10);
            if (*optarg == '\0' || *end != '\0' || v < 1 || v > maxes[ch - 0x10d]) {
                fprintf(stderr, "spaced: --%s wants 1..%lu\n", names[ch - 0x10d],
                        maxes[ch - 0x10d]);
                return 2;
            }
            unsigned long *f[] = {&o.max_body_kb, &o.max_upload_mb, &o.max_large_bodies};
            *f[ch - 0x10d] = v;
            break;
        }
        case 0x10a:
        case 0x10b:
        case 0x10c:
            o.quota_set[ch - 0x10a] = optarg; /* checked by sp_keys_team_set_quota */
            break;
        case 0x151:
            o.quota_set[3] = optarg;
            break;
        case 'u':
            o.database_url = optarg;
            break;
        case 0x110:
            if (sp_fleet_role_parse(optarg, &o.role) < 0) {
                fprintf(stderr, "spaced: --role wants all, api or worker\n");
                return 2;
            }
            break;
        case 0x111:
            o.advertise = optarg;
            break;
        case 0x114:
            o.worker_labels = optarg; /* checked by serve */
            break;
        case 0x112:
        case 0x113:
        case 0x115:
        case 0x116:
        case 0x117: {
            /* by code from 0x112; 0x114 (labels) is not a number */
            static const char *const names[] = {"worker-vcpus", "worker-memory-mb", "",
                                                "heartbeat-timeout-s", "lost-grace-s",
                                                "build-cache-s"};
            static const long lo[] = {1, 128, 0, 2, 0, 0};
            char *end;
            long v = strtol(optarg, &end, 10);
            if (*optarg == '\0' || *end != '\0' || v < lo[ch - 0x112] || v > 100000000) {
                fprintf(stderr, "spaced: --%s wants a number from %ld\n", names[ch - 0x112],
                        lo[ch - 0x112]);
                return 2;
            }
            int *dst[] = {&o.worker_vcpus, &o.worker_memory_mb, NULL, &o.heartbeat_timeout_s,
                          &o.lost_grace_s, &o.build_cache_s};
            *dst[ch - 0x112] = (int)v;
            break;
        }
        case 0x140:
        case 0x141:
        case 0x142:
        case 0x144: {
            /* 0x143 (egress-memory-mb) has its own rule below */
            static const char *const names[] = {"pool-size", "pool-memory-mb", "prebuild-sizes",
                                                NULL, "pool-reserve-mb"};
            static const long lo[] = {0, 1, 0, 0, 0}, hi[] = {256, 16777216, 64, 0, 16777216};
            char *end;
            long v = strtol(optarg, &end, 10);
            if (*optarg == '\0' || *end != '\0' || v < lo[ch - 0x140] || v > hi[ch - 0x140]) {
                fprintf(stderr, "spaced: --%s wants %ld..%ld\n", names[ch - 0x140], lo[ch - 0x140],
                        hi[ch - 0x140]);
                return 2;
            }
            if (ch == 0x140)
                o.pool_size = v == 0 ? -1 : (int)v; /* 0: no spares (the driver's -1) */
            else if (ch == 0x141)
                o.pool_memory_mb = (int)v;
            else if (ch == 0x144)
                o.pool_reserve_mb = v == 0 ? -1 : (int)v; /* 0: none (the driver's -1) */
            else
                o.prebuild_sizes = (int)v;
            break;
        }
        case 0x143: {
            /* At least one sandbox's worth (SP_EGRESS_MAX_BUFFERED). */
            char *end;
            long v = strtol(optarg, &end, 10);
            if (*optarg == '\0' || *end != '\0' || v < 64 || v > 16777216) {
                fprintf(stderr, "spaced: --egress-memory-mb wants 64..16777216\n");
                return 2;
            }
            o.egress_memory_mb = v;
            break;
        }
        case 'r':
            o.runtime = optarg;
            break;
        case 'L':
            if (sp_log_parse_level(optarg, &sp_log_min_level) < 0) {
                fprintf(stderr, "spaced: bad log level\n");
                return 2;
            }
            o.log_level_set = true;
            break;
        case 1601:
            o.metrics_listen = optarg;
            break;
        case 1602:
            if (sp_log_parse_format(optarg, &sp_log_format) < 0) {
                fprintf(stderr, "spaced: --log-format wants text or json\n");
                return 2;
            }
            break;
        case 'h':
            usage(stdout);
            return 0;
        case 'c':
            break; /* read before parsing (sp_config_path) */
        default:
            usage(stderr);
            return 2;
        }
    }
    if ((o.tls_cert == NULL) != (o.tls_key == NULL)) {
        fprintf(stderr, "spaced: --tls-cert and --tls-key go together\n");
        return 2;
    }
    if (o.data_dir == NULL)
        o.data_dir = default_data_dir();
    if (o.database_url == NULL)
        o.database_url = getenv("SPACE_DATABASE_URL");
    if (o.database_url != NULL && o.database_url[0] == '\0')
        o.database_url = NULL;
    /* 0711: the embedded cluster's user must traverse it; nobody else may list it. */
    if (mkdir_p(o.data_dir, 0711) < 0) {
        fprintf(stderr, "spaced: cannot create data directory %s: %s\n", o.data_dir,
                strerror(errno));
        return 1;
    }
    if (strcmp(cmd, "serve") == 0)
        return cmd_serve(&o, test_driver);
    if (strcmp(cmd, "keys") == 0)
        return cmd_keys(&o, argc - optind, argv + optind);
    if (strcmp(cmd, "teams") == 0)
        return cmd_teams(&o, argc - optind, argv + optind);
    if (strcmp(cmd, "admin-key") == 0)
        return cmd_admin_key(&o, argc - optind, argv + optind);
    if (strcmp(cmd, "template") == 0)
        return cmd_template(&o, argc - optind, argv + optind);
    usage(stderr);
    return 2;
}
