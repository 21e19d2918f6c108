/*
 * fswatch.c - cooked directory events and polling watchers (core/channel/fswatch.h).
 *
 * Owns the watcher table (a list: at most SP_FSWATCH_MAX, scanned linearly), each watcher's
 * agent watch (an sp_exec_t) and its ring of buffered events with their names. A sweep timer
 * (once a minute while the table is not empty) removes watchers nobody polls. Knows no HTTP.
 */
#include "core/channel/fswatch.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "base/ids.h"
#include "base/log.h"

#define SWEEP_MS 60000

/* ---- cooking ---- */

static int ev_bits(uint32_t bits, uint32_t out[5])
{
    static const uint32_t order[5] = {SP_AP_EV_CREATE, SP_AP_EV_WRITE, SP_AP_EV_REMOVE,
                                      SP_AP_EV_RENAME, SP_AP_EV_CHMOD};
    int n = 0;
    for (int i = 0; i < 5; i++)
        if (bits & order[i])
            out[n++] = order[i];
    return n;
}

/* The event's name relative to the watched directory. */
static const char *rel_name(const char *root, const char *path, const char *name)
{
    size_t rl = strlen(root);
    while (rl > 1 && root[rl - 1] == '/')
        rl--;
    if (strncmp(path, root, rl) == 0 && path[rl] == '/' && path[rl + 1] != '\0')
        return path + rl + 1;
    return name;
}

/* Whether rel names an agent's temporary file (".<name>.sp-<pid>-<n>"); orig gets the name
 * it stands for (relative, with its directory). */
static bool tmp_of(const char *rel, char *orig, size_t cap)
{
    const char *base = strrchr(rel, '/');
    size_t dl = base ? (size_t)(base - rel) + 1 : 0;
    base = base ? base + 1 : rel;
    if (base[0] != '.')
        return false;
    const char *sp = strstr(base, ".sp-");
    if (sp == NULL || sp == base + 1)
        return false;
    const char *p = sp + 4, *dash = NULL;
    for (; *p; p++) {
        if (*p == '-' && dash == NULL)
            dash = p;
        else if (*p < '0' || *p > '9')
            return false;
    }
    if (dash == NULL || dash == sp + 4 || dash[1] == '\0')
        return false;
    size_t bl = (size_t)(sp - base - 1);
    if (dl + bl + 1 > cap)
        return false;
    memcpy(orig, rel, dl);
    memcpy(orig + dl, base + 1, bl);
    orig[dl + bl] = '\0';
    return true;
}

int sp_fswatch_cook(sp_fswatch_cook_t *ck, const char *root, const char *path, const char *name,
                    uint32_t bits, const char **rel, uint32_t out[5])
{
    *rel = rel_name(root, path, name);
    char orig[SP_EXEC_PATH_MAX + 1];
    if (tmp_of(*rel, orig, sizeof(orig))) {
        if (bits & SP_AP_EV_RENAME)
            snprintf(ck->pending, sizeof(ck->pending), "%s", orig);
        return 0;
    }
    if ((bits & SP_AP_EV_RENAME) && ck->pending[0] != '\0' && strcmp(ck->pending, *rel) == 0) {
        ck->pending[0] = '\0';
        out[0] = SP_AP_EV_CREATE;
        out[1] = SP_AP_EV_WRITE;
        return 2;
    }
    return ev_bits(bits, out);
}

/* ---- polling watchers ---- */

typedef struct {
    char *name;
    uint32_t ev;
} wev_t;

typedef struct watcher watcher_t;

struct watcher {
    watcher_t *next;
    sp_fswatch_tab_t *tab;
    sp_fswatch_created_cb created; /* until the watch started; then NULL */
    void *arg;
    char id[SP_FSWATCH_ID_MAX];
    char sandbox_id[65];
    sp_exec_t *op; /* NULL once the watch ended */
    char *root;
    wev_t *events; /* ring of SP_FSWATCH_EVENTS_MAX */
    size_t head, count;
    size_t bytes;     /* of the buffered names (listcap.h) */
    uint64_t dropped; /* events dropped at a cap since the last poll */
    uint64_t polled_ms;
    bool failed;
    char why[160];
    sp_fswatch_cook_t cook;
};

struct sp_fswatch_tab {
    sp_loop_t *loop;
    watcher_t *head;
    size_t n;
    size_t bytes; /* buffered names of all watchers */
    uint64_t seq; /* makes ids unique within the table */
    sp_timer_t sweep;
};

/* What one buffered event counts against the byte caps. */
static size_t ev_bytes(const char *name)
{
    return strlen(name) + 1 + sizeof(wev_t);
}

/* Drops the oldest buffered event. */
static void drop_oldest(watcher_t *w)
{
    char *nm = w->events[w->head].name;
    size_t b = ev_bytes(nm);
    w->bytes -= b;
    w->tab->bytes -= b;
    free(nm);
    w->head = (w->head + 1) % SP_FSWATCH_EVENTS_MAX;
    w->count--;
}

static void watcher_clear(watcher_t *w)
{
    while (w->count > 0)
        drop_oldest(w);
    w->head = 0;
}

static void watcher_free(watcher_t *w)
{
    sp_fswatch_tab_t *t = w->tab;
    for (watcher_t **pp = &t->head; *pp != NULL; pp = &(*pp)->next)
        if (*pp == w) {
            *pp = w->next;
            t->n--;
            break;
        }
    sp_exec_cancel(w->op);
    if (w->events != NULL)
        watcher_clear(w);
    free(w->events);
    free(w->root);
    free(w);
}

static void on_sweep(sp_timer_t *tm, void *arg)
{
    sp_fswatch_tab_t *t = arg;
    uint64_t now = sp_loop_now_ms(t->loop);
    for (watcher_t *w = t->head, *next; w != NULL; w = next) {
        next = w->next;
        if (w->created == NULL && now - w->polled_ms > SP_FSWATCH_IDLE_MS) {
            sp_log(SP_LOG_INFO, "fswatch", "watcher expired unpolled id=%s sandbox=%s", w->id,
                   w->sandbox_id);
            watcher_free(w);
        }
    }
    if (t->head != NULL)
        sp_timer_start(&t->sweep, SWEEP_MS);
}

sp_fswatch_tab_t *sp_fswatch_tab_create(sp_loop_t *loop)
{
    sp_fswatch_tab_t *t = calloc(1, sizeof(*t));
    if (t == NULL)
        return NULL;
    t->loop = loop;
    sp_timer_init(&t->sweep, loop, on_sweep, t);
    return t;
}

void sp_fswatch_tab_destroy(sp_fswatch_tab_t *t)
{
    if (t == NULL)
        return;
    sp_timer_stop(&t->sweep);
    while (t->head != NULL) {
        watcher_t *w = t->head;
        sp_fswatch_created_cb cb = w->created;
        void *arg = w->arg;
        watcher_free(w);
        if (cb != NULL) {
            sp_err_t e;
            sp_err_set(&e, SP_EUNAVAIL, "the server is shutting down");
            cb(arg, NULL, &e);
        }
    }
    free(t);
}

static void on_started(void *arg)
{
    watcher_t *w = arg;
    sp_fswatch_created_cb cb = w->created;
    w->created = NULL;
    w->polled_ms = sp_loop_now_ms(w->tab->loop);
    cb(w->arg, w->id, NULL);
}

static void on_event(void *arg, const char *path, const char *name, uint32_t bits, uint32_t ftype)
{
    watcher_t *w = arg;
    const char *rel;
    uint32_t evs[5];
    int n = sp_fswatch_cook(&w->cook, w->root, path, name, bits, &rel, evs);
    if (n <= 0)
        return;
    size_t b = ev_bytes(rel);
    for (int i = 0; i < n; i++) {
        /* Full (events or bytes): the oldest go; the table's cap reached: this one goes. */
        while (w->count > 0 &&
               (w->count == SP_FSWATCH_EVENTS_MAX || w->bytes + b > SP_WATCH_BYTES_MAX)) {
            drop_oldest(w);
            w->dropped++;
        }
        if (w->tab->bytes + b > SP_WATCH_ALL_BYTES_MAX || b > SP_WATCH_BYTES_MAX) {
            if (w->dropped++ == 0)
                sp_log(SP_LOG_WARN, "fswatch", "watchers' buffers full: events dropped id=%s",
                       w->id);
            continue;
        }
        char *nm = strdup(rel);
        if (nm == NULL)
            return;
        wev_t *e = &w->events[(w->head + w->count) % SP_FSWATCH_EVENTS_MAX];
        e->name = nm;
        e->ev = evs[i];
        w->count++;
        w->bytes += b;
        w->tab->bytes += b;
    }
}

static void on_done(void *arg, const sp_err_t *err)
{
    watcher_t *w = arg;
    w->op = NULL;
    if (w->created != NULL) { /* did not start */
        sp_fswatch_created_cb cb = w->created;
        void *cb_arg = w->arg;
        watcher_free(w);
        cb(cb_arg, NULL, err);
        return;
    }
    w->failed = true;
    snprintf(w->why, sizeof(w->why), "%s", err->msg);
}

static const sp_exec_watch_cbs_t watch_cbs = {on_started, on_event, on_done};

int sp_fswatch_create(sp_fswatch_tab_t *t, sp_agentconn_t *c, const char *sandbox_id,
                      const char *root, const char *user, bool recursive, sp_fswatch_created_cb cb,
                      void *arg, sp_err_t *err)
{
    if (t->n >= SP_FSWATCH_MAX)
        return sp_err_set(err, SP_ETOOBIG, "too many watchers");
    watcher_t *w = calloc(1, sizeof(*w));
    if (w == NULL || (w->root = strdup(root)) == NULL ||
        (w->events = calloc(SP_FSWATCH_EVENTS_MAX, sizeof(*w->events))) == NULL) {
        if (w != NULL)
            free(w->root);
        free(w);
        return sp_err_set(err, SP_EINTERNAL, "out of memory");
    }
    w->tab = t;
    w->created = cb;
    w->arg = arg;
    char rnd[SP_ID_LEN + 1];
    sp_ids_random(rnd, SP_ID_LEN);
    rnd[SP_ID_LEN] = '\0';
    snprintf(w->id, sizeof(w->id), "w%s%llu", rnd, (unsigned long long)++t->seq);
    snprintf(w->sandbox_id, sizeof(w->sandbox_id), "%s", sandbox_id);
    w->next = t->head;
    t->head = w;
    t->n++;
    if (!sp_timer_armed(&t->sweep))
        sp_timer_start(&t->sweep, SWEEP_MS);
    w->op = sp_exec_watch(t->loop, c, root, user, recursive, &watch_cbs, w, err);
    if (w->op == NULL) {
        watcher_free(w);
        return -1;
    }
    return 0;
}

/* A started watcher of sandbox_id (one still starting is not there yet for clients). */
static watcher_t *find(sp_fswatch_tab_t *t, const char *sandbox_id, const char *id, sp_err_t *err)
{
    for (watcher_t *w = t->head; id != NULL && w != NULL; w = w->next)
        if (w->created == NULL && strcmp(w->id, id) == 0 && strcmp(w->sandbox_id, sandbox_id) == 0)
            return w;
    sp_err_set(err, SP_ENOTFOUND, "watcher not found");
    return NULL;
}

int sp_fswatch_poll(sp_fswatch_tab_t *t, const char *sandbox_id, const char *id,
                    int (*cb)(void *arg, const sp_fswatch_ev_t *evs, size_t n), void *arg,
                    sp_err_t *err)
{
    watcher_t *w = find(t, sandbox_id, id, err);
    if (w == NULL)
        return -1;
    w->polled_ms = sp_loop_now_ms(t->loop);
    if (w->count == 0 && w->failed)
        return sp_err_set(err, SP_EUNAVAIL, "%s", w->why);
    sp_fswatch_ev_t *evs = malloc((w->count + 1) * sizeof(*evs));
    if (evs == NULL)
        return sp_err_set(err, SP_EINTERNAL, "out of memory");
    for (size_t i = 0; i < w->count; i++) {
        const wev_t *e = &w->events[(w->head + i) % SP_FSWATCH_EVENTS_MAX];
        evs[i] = (sp_fswatch_ev_t){e->name, e->ev};
    }
    int rc = cb(arg, evs, w->count);
    free(evs);
    if (rc < 0)
        return sp_err_set(err, SP_EINTERNAL, "out of memory");
    if (w->dropped > 0)
        sp_log(SP_LOG_INFO, "fswatch", "watcher dropped %llu events at its caps id=%s",
               (unsigned long long)w->dropped, w->id);
    w->dropped = 0;
    watcher_clear(w);
    return 0;
}

int sp_fswatch_remove(sp_fswatch_tab_t *t, const char *sandbox_id, const char *id, sp_err_t *err)
{
    watcher_t *w = find(t, sandbox_id, id, err);
    if (w == NULL)
        return -1;
    watcher_free(w);
    return 0;
}
