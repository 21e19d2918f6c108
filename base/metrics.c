/*
 * metrics.c - the registry behind metrics.h: a list of families, each a list of series, under
 * one mutex; the text exposition; the process_* figures read from /proc at render time.
 */
#include "base/metrics.h"

#include <dirent.h>
#include <math.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <unistd.h>

const double sp_metrics_buckets_http[13] = {0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5,
                                            1,     2.5,  5,     10,   30,  60};
const double sp_metrics_buckets_ops[12] = {0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300};
const double sp_metrics_buckets_wait[10] = {0.0005, 0.001, 0.0025, 0.005, 0.01,
                                            0.05,   0.1,   0.5,    1,     5};

struct sp_metric_series {
    char *vals[SP_METRICS_MAX_LABELS];
    double v;          /* counter, gauge; a histogram's sum */
    uint64_t count;    /* histogram */
    uint64_t *buckets; /* histogram: nbounds, not cumulative */
    struct sp_metric_series *next;
};

struct collector {
    sp_metrics_collect_fn fn;
    void *arg;
    struct collector *next;
};

static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
static sp_metric_t *families, *families_tail; /* in registration order */
static struct collector *collectors;

/* Under mu. */
static void reg(sp_metric_t *m)
{
    if (m->reg_)
        return;
    int n = 0;
    if (m->labels != NULL && m->labels[0] != '\0') {
        n = 1;
        for (const char *p = m->labels; *p; p++)
            n += *p == ',';
    }
    /* The definitions are ours, in this tree: no input can make more labels. */
    if (n > SP_METRICS_MAX_LABELS)
        n = SP_METRICS_MAX_LABELS;
    m->nlabels_ = n;
    m->reg_ = true;
    m->next_ = NULL;
    if (families_tail != NULL)
        families_tail->next_ = m;
    else
        families = m;
    families_tail = m;
}

/* Under mu: the series for the label values in ap, made when absent; NULL when out of memory. */
static struct sp_metric_series *series(sp_metric_t *m, va_list ap)
{
    reg(m);
    const char *vals[SP_METRICS_MAX_LABELS];
    for (int i = 0; i < m->nlabels_; i++) {
        vals[i] = va_arg(ap, const char *);
        if (vals[i] == NULL)
            vals[i] = "";
    }
    struct sp_metric_series **pp = &m->series_;
    for (; *pp != NULL; pp = &(*pp)->next) {
        int i = 0;
        while (i < m->nlabels_ && strcmp((*pp)->vals[i], vals[i]) == 0)
            i++;
        if (i == m->nlabels_)
            return *pp;
    }
    struct sp_metric_series *s = calloc(1, sizeof(*s));
    if (s == NULL)
        return NULL;
    if (m->type == SP_METRIC_T_HISTOGRAM && m->nbounds > 0 &&
        (s->buckets = calloc(m->nbounds, sizeof(uint64_t))) == NULL) {
        free(s);
        return NULL;
    }
    for (int i = 0; i < m->nlabels_; i++) {
        if ((s->vals[i] = strdup(vals[i])) == NULL) {
            for (int j = 0; j < i; j++)
                free(s->vals[j]);
            free(s->buckets);
            free(s);
            return NULL;
        }
    }
    *pp = s; /* appended: series render in the order they first appeared */
    return s;
}

enum update { UPDATE_ADD, UPDATE_SET, UPDATE_OBSERVE };

/* Updates the series for the label values in ap (taking mu): a series that cannot be made
 * (out of memory) goes uncounted. */
static void update(sp_metric_t *m, enum update how, double v, va_list ap)
{
    pthread_mutex_lock(&mu);
    struct sp_metric_series *s = series(m, ap);
    if (s != NULL) {
        switch (how) {
        case UPDATE_ADD:
            s->v += v;
            break;
        case UPDATE_SET:
            s->v = v;
            break;
        case UPDATE_OBSERVE: {
            if (s->buckets == NULL)
                break;
            size_t i = 0;
            while (i < m->nbounds && v > m->bounds[i])
                i++;
            if (i < m->nbounds)
                s->buckets[i]++;
            s->count++;
            s->v += v;
            break;
        }
        }
    }
    pthread_mutex_unlock(&mu);
}

void sp_metrics_add(sp_metric_t *m, double v, ...)
{
    va_list ap;
    va_start(ap, v);
    update(m, UPDATE_ADD, v, ap);
    va_end(ap);
}

void sp_metrics_set(sp_metric_t *m, double v, ...)
{
    va_list ap;
    va_start(ap, v);
    update(m, UPDATE_SET, v, ap);
    va_end(ap);
}

void sp_metrics_observe(sp_metric_t *m, double v, ...)
{
    va_list ap;
    va_start(ap, v);
    update(m, UPDATE_OBSERVE, v, ap);
    va_end(ap);
}

void sp_metrics_zero(sp_metric_t *m)
{
    pthread_mutex_lock(&mu);
    reg(m);
    for (struct sp_metric_series *s = m->series_; s != NULL; s = s->next)
        s->v = 0;
    pthread_mutex_unlock(&mu);
}

void sp_metrics_declare(sp_metric_t *m)
{
    pthread_mutex_lock(&mu);
    reg(m);
    pthread_mutex_unlock(&mu);
}

double sp_metrics_value(sp_metric_t *m, ...)
{
    va_list ap;
    va_start(ap, m);
    pthread_mutex_lock(&mu);
    struct sp_metric_series *s = series(m, ap);
    double v = s == NULL ? 0 : m->type == SP_METRIC_T_HISTOGRAM ? (double)s->count : s->v;
    pthread_mutex_unlock(&mu);
    va_end(ap);
    return v;
}

int sp_metrics_collector_add(sp_metrics_collect_fn fn, void *arg)
{
    struct collector *c = malloc(sizeof(*c));
    if (c == NULL)
        return -1;
    c->fn = fn;
    c->arg = arg;
    pthread_mutex_lock(&mu);
    c->next = collectors;
    collectors = c;
    pthread_mutex_unlock(&mu);
    return 0;
}

void sp_metrics_collector_remove(sp_metrics_collect_fn fn, void *arg)
{
    pthread_mutex_lock(&mu);
    for (struct collector **pp = &collectors; *pp != NULL; pp = &(*pp)->next) {
        if ((*pp)->fn == fn && (*pp)->arg == arg) {
            struct collector *c = *pp;
            *pp = c->next;
            free(c);
            break;
        }
    }
    pthread_mutex_unlock(&mu);
}

/* ---- exposition ---- */

static void put_num(sp_buf_t *b, double v)
{
    if (isnan(v))
        sp_buf_str(b, "NaN");
    else if (isinf(v))
        sp_buf_str(b, v > 0 ? "+Inf" : "-Inf");
    else if (v == floor(v) && fabs(v) < 9007199254740992.0)
        sp_buf_printf(b, "%.0f", v);
    else
        sp_buf_printf(b, "%.15g", v);
}

/* A label value: backslash, double quote and newline escaped, as the format wants. */
static void put_label_value(sp_buf_t *b, const char *v)
{
    for (; *v; v++) {
        if (*v == '\\')
            sp_buf_str(b, "\\\\");
        else if (*v == '"')
            sp_buf_str(b, "\\\"");
        else if (*v == '\n')
            sp_buf_str(b, "\\n");
        else
            sp_buf_add(b, v, 1);
    }
}

/* {a="x",b="y"[,le="..."]} or nothing. */
static void put_labels(sp_buf_t *b, const sp_metric_t *m, const struct sp_metric_series *s,
                       const char *le)
{
    if (m->nlabels_ == 0 && le == NULL)
        return;
    sp_buf_str(b, "{");
    const char *name = m->labels;
    for (int i = 0; i < m->nlabels_; i++) {
        size_t n = strcspn(name, ",");
        if (i > 0)
            sp_buf_str(b, ",");
        sp_buf_add(b, name, n);
        sp_buf_str(b, "=\"");
        put_label_value(b, s->vals[i]);
        sp_buf_str(b, "\"");
        name += n + (name[n] == ',');
    }
    if (le != NULL)
        sp_buf_printf(b, "%sle=\"%s\"", m->nlabels_ > 0 ? "," : "", le);
    sp_buf_str(b, "}");
}

static void put_family(sp_buf_t *b, const sp_metric_t *m)
{
    static const char *const types[] = {"counter", "gauge", "histogram"};
    sp_buf_printf(b, "# HELP %s %s\n# TYPE %s %s\n", m->name, m->help, m->name, types[m->type]);
    for (const struct sp_metric_series *s = m->series_; s != NULL; s = s->next) {
        if (m->type != SP_METRIC_T_HISTOGRAM) {
            sp_buf_str(b, m->name);
            put_labels(b, m, s, NULL);
            sp_buf_str(b, " ");
            put_num(b, s->v);
            sp_buf_str(b, "\n");
            continue;
        }
        uint64_t cum = 0;
        for (size_t i = 0; i < m->nbounds; i++) {
            char le[32];
            snprintf(le, sizeof(le), "%g", m->bounds[i]);
            cum += s->buckets[i];
            sp_buf_printf(b, "%s_bucket", m->name);
            put_labels(b, m, s, le);
            sp_buf_printf(b, " %llu\n", (unsigned long long)cum);
        }
        sp_buf_printf(b, "%s_bucket", m->name);
        put_labels(b, m, s, "+Inf");
        sp_buf_printf(b, " %llu\n%s_sum", (unsigned long long)s->count, m->name);
        put_labels(b, m, s, NULL);
        sp_buf_str(b, " ");
        put_num(b, s->v);
        sp_buf_printf(b, "\n%s_count", m->name);
        put_labels(b, m, s, NULL);
        sp_buf_printf(b, " %llu\n", (unsigned long long)s->count);
    }
}

/* The figures Prometheus' client libraries call the process collector, from /proc. */
static void put_process(sp_buf_t *b)
{
    long tck = sysconf(_SC_CLK_TCK), page = sysconf(_SC_PAGESIZE);
    double cpu = -1, start = -1, rss = -1, vsz = -1;
    char line[2048];
    FILE *f = fopen("/proc/self/stat", "r");
    if (f != NULL) {
        size_t n = fread(line, 1, sizeof(line) - 1, f);
        fclose(f);
        line[n] = '\0';
        /* Fields after the command name, which is in parentheses and may hold anything. */
        char *p = strrchr(line, ')');
        unsigned long long utime, stime, starttime, vsize;
        long long rsspages;
        if (p != NULL &&
            sscanf(p + 2,
                   "%*c %*d %*d %*d %*d %*d %*u %*u %*u %*u %*u %llu %llu %*d %*d %*d %*d %*d "
                   "%*d %llu %llu %lld",
                   &utime, &stime, &starttime, &vsize, &rsspages) == 5 &&
            tck > 0) {
            cpu = (double)(utime + stime) / (double)tck;
            vsz = (double)vsize;
            rss = (double)rsspages * (double)page;
            /* starttime is in ticks after boot; btime in /proc/stat is the boot's epoch time. */
            FILE *s = fopen("/proc/stat", "r");
            while (s != NULL && fgets(line, sizeof(line), s) != NULL) {
                unsigned long long btime;
                if (sscanf(line, "btime %llu", &btime) == 1) {
                    start = (double)btime + (double)starttime / (double)tck;
                    break;
                }
            }
            if (s != NULL)
                fclose(s);
        }
    }
    double fds = -1;
    DIR *d = opendir("/proc/self/fd");
    if (d != NULL) {
        fds = 0;
        for (struct dirent *e; (e = readdir(d)) != NULL;)
            fds += e->d_name[0] != '.';
        fds -= 1; /* the directory's own descriptor */
        closedir(d);
    }
    struct rlimit rl;
    double maxfds = getrlimit(RLIMIT_NOFILE, &rl) == 0 && rl.rlim_cur != RLIM_INFINITY
                        ? (double)rl.rlim_cur
                        : -1;
    static const struct {
        const char *name, *type, *help;
    } pm[] = {
        {"process_cpu_seconds_total", "counter", "User and system CPU time spent in seconds."},
        {"process_start_time_seconds", "gauge",
         "Start time of the process since unix epoch in seconds."},
        {"process_resident_memory_bytes", "gauge", "Resident memory size in bytes."},
        {"process_virtual_memory_bytes", "gauge", "Virtual memory size in bytes."},
        {"process_open_fds", "gauge", "Number of open file descriptors."},
        {"process_max_fds", "gauge", "Maximum number of open file descriptors."},
    };
    double vals[] = {cpu, start, rss, vsz, fds, maxfds};
    for (size_t i = 0; i < sizeof(pm) / sizeof(pm[0]); i++) {
        if (vals[i] < 0)
            continue;
        sp_buf_printf(b, "# HELP %s %s\n# TYPE %s %s\n%s ", pm[i].name, pm[i].help, pm[i].name,
                      pm[i].type, pm[i].name);
        put_num(b, vals[i]);
        sp_buf_str(b, "\n");
    }
}

int sp_metrics_render(sp_buf_t *out)
{
    /* Collectors call the update functions, which take mu: run them from a copy. */
    pthread_mutex_lock(&mu);
    size_t n = 0;
    for (struct collector *c = collectors; c != NULL; c = c->next)
        n++;
    struct collector *copy = n > 0 ? calloc(n, sizeof(*copy)) : NULL;
    size_t i = 0;
    for (struct collector *c = collectors; c != NULL && copy != NULL; c = c->next)
        copy[i++] = *c;
    pthread_mutex_unlock(&mu);
    if (n > 0 && copy == NULL)
        return -1;
    for (i = 0; i < n; i++)
        copy[i].fn(copy[i].arg);
    free(copy);

    pthread_mutex_lock(&mu);
    for (const sp_metric_t *m = families; m != NULL; m = m->next_)
        put_family(out, m);
    pthread_mutex_unlock(&mu);
    put_process(out);
    return out->oom ? -1 : 0;
}
