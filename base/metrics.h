/*
 * metrics.h - the process's metrics registry: counters, gauges and histograms with fixed
 * label names, and their Prometheus text exposition (with the process_* figures).
 *
 * A family is a static sp_metric_t defined where its events happen and registered on first
 * use; its series (one per combination of label values) are made on first use too. Label
 * values must come from small fixed sets (route classes, states, outcomes), never from ids
 * or paths: every series lives until the process ends. Updates take one mutex, so any
 * thread may make them. Collectors are for figures read at scrape time (a pool's size, a
 * module's own counters); they run inside sp_metrics_render, on the thread that renders (the
 * server's loop), so they may read loop-owned state.
 *
 * Not here: serving the text (server/opsrv.h), naming HTTP routes (http/reqmetrics.h).
 */
#ifndef SP_METRICS_H
#define SP_METRICS_H

#include <stdbool.h>
#include <stddef.h>

#include "base/buf.h"

typedef enum {
    SP_METRIC_T_COUNTER = 0,
    SP_METRIC_T_GAUGE,
    SP_METRIC_T_HISTOGRAM,
} sp_metric_type_t;

struct sp_metric_series;

/* Define with the macros below; the fields after bounds belong to metrics.c. */
typedef struct sp_metric {
    const char *name;   /* space_..., with _total / _seconds / _bytes as Prometheus wants */
    const char *help;
    const char *labels; /* comma-separated label names, "" for none (at most 4) */
    sp_metric_type_t type;
    const double *bounds; /* histograms: upper bounds, ascending, without +Inf */
    size_t nbounds;
    bool reg_;
    int nlabels_;
    struct sp_metric *next_;
    struct sp_metric_series *series_;
} sp_metric_t;

#define SP_METRICS_MAX_LABELS 4

#define SP_METRIC_COUNTER(name, help, labels)                                                      \
    {(name), (help), (labels), SP_METRIC_T_COUNTER, NULL, 0, false, 0, NULL, NULL}
#define SP_METRIC_GAUGE(name, help, labels)                                                        \
    {(name), (help), (labels), SP_METRIC_T_GAUGE, NULL, 0, false, 0, NULL, NULL}
#define SP_METRIC_HISTOGRAM(name, help, labels, bounds)                                            \
    {(name),  (help), (labels), SP_METRIC_T_HISTOGRAM, (bounds), sizeof(bounds) / sizeof(double),  \
     false,   0,      NULL,     NULL}

/* Bucket sets for durations in seconds: HTTP requests, lifecycle operations, short waits. */
extern const double sp_metrics_buckets_http[13];
extern const double sp_metrics_buckets_ops[12];
extern const double sp_metrics_buckets_wait[10];

/*
 * The update calls take the family's label values after v, as many as it has label names,
 * each a NUL-terminated string (NULL is rendered as ""). add: counters and gauges (v >= 0
 * for counters); set: gauges, and counters a collector mirrors from a module's own running
 * total; observe: histograms.
 */
void sp_metrics_add(sp_metric_t *m, double v, ...);
void sp_metrics_set(sp_metric_t *m, double v, ...);
void sp_metrics_observe(sp_metric_t *m, double v, ...);
/* Every series of the family to 0 (a collector's gauge, before it sets what exists now). */
void sp_metrics_zero(sp_metric_t *m);
/* Registers m without a series, so its HELP and TYPE show before its first event. */
void sp_metrics_declare(sp_metric_t *m);

typedef void (*sp_metrics_collect_fn)(void *arg);
/* fn(arg) runs at the start of every render. -1 when out of memory. */
int sp_metrics_collector_add(sp_metrics_collect_fn fn, void *arg);
/* Removes the pair (fn, arg) added before; nothing when absent. */
void sp_metrics_collector_remove(sp_metrics_collect_fn fn, void *arg);

/* Runs the collectors, then appends every family and the process_* figures to out in the
 * Prometheus text format (version 0.0.4). -1 when out of memory (out holds a part). */
int sp_metrics_render(sp_buf_t *out);

/* Value of one series (for tests): the counter or gauge, a histogram's count; 0 when absent. */
double sp_metrics_value(sp_metric_t *m, ...);

#endif
