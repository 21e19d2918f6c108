/*
 * reqmetrics.c - an h2o logger (called once per request, when h2o disposes of it) that
 * updates the request metrics.
 */
#include "http/reqmetrics.h"

#include <stdio.h>
#include <sys/time.h>

#include "base/metrics.h"

static sp_metric_t m_requests = SP_METRIC_COUNTER(
    "space_http_requests_total", "HTTP requests answered, by surface, route class and status code.",
    "surface,route,code");
static sp_metric_t m_duration = SP_METRIC_HISTOGRAM(
    "space_http_request_duration_seconds",
    "Time from a request's first byte to its response's last, by surface and route class.",
    "surface,route", sp_metrics_buckets_http);

struct logger {
    h2o_logger_t super;
    sp_reqmetrics_classify_fn fn;
    void *arg;
};

static void on_done(h2o_logger_t *self, h2o_req_t *req)
{
    struct logger *l = (struct logger *)self;
    const char *surface = "other", *route = "other";
    l->fn(l->arg, req, &surface, &route);
    char code[8];
    int st = req->res.status;
    snprintf(code, sizeof(code), "%d", st >= 100 && st <= 599 ? st : 0);
    sp_metrics_add(&m_requests, 1, surface, route, code);
    struct timeval end = req->timestamps.response_end_at;
    if (h2o_timeval_is_null(&end))
        gettimeofday(&end, NULL);
    struct timeval *b = &req->timestamps.request_begin_at;
    if (!h2o_timeval_is_null(b)) {
        double s = (double)(end.tv_sec - b->tv_sec) + (double)(end.tv_usec - b->tv_usec) / 1e6;
        sp_metrics_observe(&m_duration, s < 0 ? 0 : s, surface, route);
    }
}

int sp_reqmetrics_attach(h2o_pathconf_t *pc, sp_reqmetrics_classify_fn fn, void *arg)
{
    sp_metrics_declare(&m_requests);
    sp_metrics_declare(&m_duration);
    struct logger *l = (struct logger *)h2o_create_logger(pc, sizeof(*l));
    if (l == NULL)
        return -1;
    l->super.log_access = on_done;
    l->fn = fn;
    l->arg = arg;
    return 0;
}
