/*
 * route_metrics.c - the E2B control plane's read-only figures: a sandbox's metrics (its series
 * of samples, taken by core every few seconds: core/control/sampler.h), several sandboxes'
 * latest figures at once (sampled now), and a sandbox's logs (our lifecycle events for it, in
 * E2B's shapes).
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "base/log.h"
#include "e2b-gateway/route_int.h"

#define LOGS_DEFAULT_LIMIT 1000
#define LOGS_MAX_LIMIT     10000
#define METRICS_MAX_IDS    100

/* Optional non-negative integer query parameter; -1 and an answered 400 when malformed. */
static int query_ll(ctl_t *c, h2o_req_t *req, const char *name, long long *out)
{
    const char *v = sp_http_query(req, name);
    if (v == NULL)
        return 0;
    char *end;
    long long x = strtoll(v, &end, 10);
    if (*v == '\0' || *end != '\0' || x < 0) {
        char msg[96];
        snprintf(msg, sizeof(msg), "%s must be a non-negative integer", name);
        sp_e2b__ctl_fail(c, 400, msg);
        return -1;
    }
    *out = x;
    return 0;
}

/* One SandboxMetric. */
static json_t *metric_json(time_t at, int cpu_count, double cpu_used_pct, uint64_t mem_used,
                           uint64_t mem_total, uint64_t disk_used, uint64_t disk_total)
{
    struct tm tm;
    char ts[32];
    gmtime_r(&at, &tm);
    strftime(ts, sizeof(ts), "%Y-%m-%dT%H:%M:%SZ", &tm);
    json_t *o = json_object();
    json_object_set_new(o, "timestamp", json_string(ts));
    json_object_set_new(o, "timestampUnix", json_integer((json_int_t)at));
    json_object_set_new(o, "cpuCount", json_integer(cpu_count));
    json_object_set_new(o, "cpuUsedPct", json_real(cpu_used_pct));
    json_object_set_new(o, "memUsed", json_integer((json_int_t)mem_used));
    json_object_set_new(o, "memTotal", json_integer((json_int_t)mem_total));
    json_object_set_new(o, "diskUsed", json_integer((json_int_t)disk_used));
    json_object_set_new(o, "diskTotal", json_integer((json_int_t)disk_total));
    return o;
}

/* One SandboxMetric sampled now, or NULL when the sandbox has no VM to ask. */
static json_t *metric_now(ctl_t *c, const char *id)
{
    sp_vm_stats_t st;
    sp_err_t e;
    if (sp_svc_vm_stats(c->gw->svc, id, &st, &e) < 0)
        return NULL;
    return metric_json(time(NULL), st.cpu_count, st.cpu_used_pct, st.mem_used_bytes,
                       st.mem_total_bytes, st.disk_used_bytes, st.disk_total_bytes);
}

/* ---- GET /sandboxes/{id}/metrics ---- */

static void metrics_got(ctl_t *c, const sp_sandbox_rec_t *sb)
{
    const char *state = sp_e2b__state(sb);
    if (state == NULL) {
        sp_e2b__ctl_fail(c, 404, "sandbox not found");
        return;
    }
    json_t *arr = json_array();
    /* The series core keeps while the sandbox runs. A paused sandbox answers an empty series,
     * as E2B's does (core keeps its samples for when it runs again). */
    bool running = strcmp(state, "running") == 0;
    sp_sample_t *v = running ? malloc(SP_SAMPLER_RING * sizeof(*v)) : NULL;
    size_t n = v != NULL ? sp_svc_vm_samples(c->gw->svc, sb->id, c->start_s, c->end_s, v,
                                             SP_SAMPLER_RING)
                         : 0;
    for (size_t i = 0; i < n; i++)
        json_array_append_new(arr, metric_json((time_t)(v[i].at_ms / 1000), v[i].cpu_count,
                                               v[i].cpu_used_pct, v[i].mem_used_bytes,
                                               v[i].mem_total_bytes, v[i].disk_used_bytes,
                                               v[i].disk_total_bytes));
    free(v);
    sp_e2b__ctl_reply(c, 200, arr);
}

/* ---- GET /sandboxes/metrics?sandbox_ids=a,b ---- */

static bool wanted(ctl_t *c, const char *id)
{
    if (c->ids == NULL)
        return true;
    size_t i;
    json_t *v;
    json_array_foreach(c->ids, i, v)
    {
        if (strcmp(json_string_value(v), id) == 0)
            return true;
    }
    return false;
}

/*
 * Many hosts: each sandbox's figures are in the memory of the worker that runs it. What runs
 * here is sampled here; for the rest, one statement says where each runs, and each of those
 * workers gets one GET /sandboxes/metrics?sandbox_ids=<its own> (the client's key, the cluster
 * header: http/proxy.h), all at once, each bounded by SP_E2B_PEER_MS. A worker that does not
 * answer in time, or answers badly, leaves its sandboxes out, as E2B leaves out a sandbox it
 * has no figures for. A request a node sent is answered from this node only.
 */
static void many_reply(ctl_t *c)
{
    json_t *map = c->acc;
    c->acc = NULL;
    sp_e2b__ctl_reply(c, 200, json_pack("{s:o}", "sandboxes", map));
}

static void on_peer_metrics(void *arg, int status, const char *body, size_t len, const char *why)
{
    ctl_t *c = arg;
    json_t *o = status == 200 ? json_loadb(body, len, 0, NULL) : NULL;
    json_t *got = json_object_get(o, "sandboxes");
    const char *id;
    json_t *m;
    json_object_foreach(got, id, m)
    {
        /* Only what was asked for, and never over a figure taken here. */
        if (json_is_object(m) && wanted(c, id) && json_object_get(c->acc, id) == NULL)
            json_object_set(c->acc, id, m);
    }
    if (status != 200 && status != 0)
        sp_log(SP_LOG_INFO, "e2b", "metrics from a worker: status %d", status);
    json_decref(o);
    if (--c->pending == 0)
        many_reply(c);
}

static void on_remote_where(void *arg, const sp_where_t *w, size_t n, const sp_err_t *err)
{
    ctl_t *c = arg;
    if (err != NULL) {
        /* Where they run is unknown: the answer has what runs here. */
        sp_log(SP_LOG_WARN, "e2b", "metrics: workers of sandboxes not found err=%s", err->msg);
        many_reply(c);
        return;
    }
    h2o_req_t *req = sp_http_hold_req(c->hold);
    bool *done = n > 0 ? calloc(n, sizeof(*done)) : NULL;
    c->pending = 1; /* this loop's own: no answer completes the reply before it ends */
    for (size_t i = 0; req != NULL && done != NULL && i < n; i++) {
        if (done[i] || w[i].worker_id[0] == '\0' || w[i].address[0] == '\0' ||
            strcmp(w[i].worker_id, c->gw->self) == 0 || strcmp(w[i].worker_state, "lost") == 0)
            continue;
        /* Every sandbox of this worker in one request. */
        sp_buf_t path = SP_BUF_INIT;
        sp_buf_str(&path, "/sandboxes/metrics?sandbox_ids=");
        for (size_t k = i; k < n; k++) {
            if (done[k] || strcmp(w[k].worker_id, w[i].worker_id) != 0)
                continue;
            done[k] = true;
            if (k != i)
                sp_buf_str(&path, ",");
            sp_buf_str(&path, w[k].sandbox_id);
        }
        sp_buf_add(&path, "", 1);
        sp_err_t e;
        if (!path.oom && sp_proxy_get(c->gw->proxy, req, w[i].address, (const char *)path.p,
                                      SP_E2B_PEER_MS, on_peer_metrics, c, &e) != NULL)
            c->pending++;
        else if (!path.oom)
            sp_log(SP_LOG_INFO, "e2b", "metrics: worker %s not asked: %s", w[i].worker_id, e.msg);
        sp_buf_free(&path);
    }
    free(done);
    if (--c->pending == 0)
        many_reply(c);
}

static void on_running_list(void *arg, const sp_sandbox_rec_t *recs, size_t n, const char *next,
                            const sp_err_t *err)
{
    ctl_t *c = arg;
    if (err != NULL) {
        sp_e2b__ctl_fail_err(c, err);
        return;
    }
    c->acc = json_object();
    bool ask = !c->forwarded && sp_proxy_has_key(c->gw->proxy);
    const char **remote = ask && n > 0 ? calloc(n, sizeof(*remote)) : NULL;
    size_t nr = 0;
    for (size_t i = 0; i < n; i++) {
        const char *state = sp_e2b__state(&recs[i]);
        if (state == NULL || strcmp(state, "running") != 0 || !wanted(c, recs[i].id))
            continue;
        if (sp_svc_sandbox_here(c->gw->svc, recs[i].id) || remote == NULL) {
            json_t *m = metric_now(c, recs[i].id);
            if (m != NULL)
                json_object_set_new(c->acc, recs[i].id, m);
        } else {
            remote[nr++] = recs[i].id;
        }
    }
    sp_err_t e;
    if (nr == 0 || sp_svc_sandboxes_where(c->gw->svc, remote, nr, on_remote_where, c, &e) < 0) {
        if (nr > 0)
            sp_log(SP_LOG_WARN, "e2b", "metrics: workers of sandboxes not asked err=%s", e.msg);
        many_reply(c);
    }
    free(remote);
}

static void metrics_many(ctl_t *c, h2o_req_t *req)
{
    const char *ids = sp_http_query(req, "sandbox_ids");
    if (ids != NULL) {
        c->ids = json_array();
        size_t len = strlen(ids);
        char *buf = h2o_mem_alloc_pool(&req->pool, len + 1);
        memcpy(buf, ids, len + 1);
        char *save = NULL;
        for (char *s = strtok_r(buf, ",", &save); s; s = strtok_r(NULL, ",", &save)) {
            if (!sp_ids_valid(s))
                continue; /* no such sandbox: simply absent from the answer */
            if (json_array_size(c->ids) == METRICS_MAX_IDS) {
                sp_e2b__ctl_fail(c, 400, "at most 100 sandbox_ids");
                return;
            }
            json_array_append_new(c->ids, json_string(s));
        }
    }
    /* Only running sandboxes have figures; one core page covers what a team runs here. */
    sp_list_req_t r = {.states = (1u << SP_OBS_RUNNING), .limit = 1000};
    sp_err_t e;
    if (sp_svc_list_sandboxes(c->gw->svc, &c->auth, &r, on_running_list, c, &e) < 0)
        sp_e2b__ctl_fail_err(c, &e);
}

void sp_e2b__route_metrics(ctl_t *c, h2o_req_t *req)
{
    if (c->route == R_METRICS_MANY) {
        metrics_many(c, req);
        return;
    }
    long long start = 0, end = 0;
    if (query_ll(c, req, "start", &start) < 0 || query_ll(c, req, "end", &end) < 0)
        return;
    c->start_s = start;
    c->end_s = end;
    sp_e2b__ctl_fetch(c, metrics_got);
}

/* ---- GET /sandboxes/{id}/logs, /v2/sandboxes/{id}/logs ---- */

static json_t *log_entry(const sp_event_rec_t *ev, const char *id)
{
    bool bad = strstr(ev->kind, "failed") != NULL;
    json_t *fields = json_pack("{s:s,s:s}", "event", ev->kind, "sandboxID", id);
    if (ev->detail[0])
        json_object_set_new(fields, "detail", json_string(ev->detail));
    char msg[320];
    snprintf(msg, sizeof(msg), "%s%s%s", ev->kind, ev->detail[0] ? ": " : "", ev->detail);
    return json_pack("{s:s,s:s,s:s,s:o}", "timestamp", ev->at, "message", msg, "level",
                     bad ? "error" : "info", "fields", fields);
}

static void on_events(void *arg, const sp_event_rec_t *recs, size_t n, const sp_err_t *err)
{
    ctl_t *c = arg;
    if (err != NULL) {
        sp_e2b__ctl_fail_err(c, err);
        return;
    }
    json_t *entries = json_array();
    json_t *lines = json_array();
    for (size_t i = 0; i < n; i++) {
        json_t *e = log_entry(&recs[i], c->id);
        json_array_append_new(lines, json_pack("{s:s,s:O}", "timestamp", recs[i].at, "line",
                                               json_object_get(e, "message")));
        json_array_append_new(entries, e);
    }
    if (c->route == R_LOGS_V2) {
        json_decref(lines);
        sp_e2b__ctl_reply(c, 200, json_pack("{s:o}", "logs", entries));
        return;
    }
    sp_e2b__ctl_reply(c, 200, json_pack("{s:o,s:o}", "logs", lines, "logEntries", entries));
}

void sp_e2b__route_logs(ctl_t *c, h2o_req_t *req)
{
    long long start = 0, limit = LOGS_DEFAULT_LIMIT;
    /* v1: start (epoch ms); v2: cursor (epoch ms), forward only. */
    if (query_ll(c, req, c->route == R_LOGS_V2 ? "cursor" : "start", &start) < 0 ||
        query_ll(c, req, "limit", &limit) < 0)
        return;
    if (limit < 1 || limit > LOGS_MAX_LIMIT) {
        sp_e2b__ctl_fail(c, 400, "limit must be 1 to 10000");
        return;
    }
    sp_err_t e;
    if (sp_svc_sandbox_events(c->gw->svc, &c->auth, c->id, start, (int)limit, on_events, c, &e) < 0)
        sp_e2b__ctl_fail_err(c, &e);
}
