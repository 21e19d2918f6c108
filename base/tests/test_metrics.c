/* test_metrics.c - base/metrics.h: series by label values, histogram buckets, collectors and
 * the text exposition. */
#include <stdio.h>
#include <string.h>

#include "base/metrics.h"
#include "tests/check.h"

static sp_metric_t m_req =
    SP_METRIC_COUNTER("space_test_requests_total", "Requests.", "surface,code");
static sp_metric_t m_up = SP_METRIC_GAUGE("space_test_up", "Up.", "");
static const double bounds[] = {0.1, 1};
static sp_metric_t m_lat =
    SP_METRIC_HISTOGRAM("space_test_latency_seconds", "Latency.", "op", bounds);
static sp_metric_t m_quiet = SP_METRIC_COUNTER("space_test_quiet_total", "Never moves.", "");

static int collected;
static void collect(void *arg)
{
    collected++;
    sp_metrics_set(&m_up, *(double *)arg);
}

int main(void)
{
    sp_metrics_add(&m_req, 1, "native", "200");
    sp_metrics_add(&m_req, 2, "native", "200");
    sp_metrics_add(&m_req, 1, "e2b", "4\"04\\\n");
    CHECK(sp_metrics_value(&m_req, "native", "200") == 3);
    CHECK(sp_metrics_value(&m_req, "other", "500") == 0);
    sp_metrics_observe(&m_lat, 0.05, "create");
    sp_metrics_observe(&m_lat, 0.5, "create");
    sp_metrics_observe(&m_lat, 5, "create");
    CHECK(sp_metrics_value(&m_lat, "create") == 3);
    sp_metrics_declare(&m_quiet);
    double up = 7;
    CHECK(sp_metrics_collector_add(collect, &up) == 0);

    sp_buf_t b = SP_BUF_INIT;
    CHECK(sp_metrics_render(&b) == 0);
    const char *t = sp_buf_cstr(&b);
    CHECK(collected == 1);
    CHECK(strstr(t,
                 "# HELP space_test_requests_total Requests.\n"
                 "# TYPE space_test_requests_total counter\n"
                 "space_test_requests_total{surface=\"native\",code=\"200\"} 3\n"
                 "space_test_requests_total{surface=\"e2b\",code=\"4\\\"04\\\\\\n\"} 1\n") != NULL);
    CHECK(strstr(t, "# TYPE space_test_up gauge\nspace_test_up 7\n") != NULL);
    CHECK(strstr(t, "space_test_latency_seconds_bucket{op=\"create\",le=\"0.1\"} 1\n"
                    "space_test_latency_seconds_bucket{op=\"create\",le=\"1\"} 2\n"
                    "space_test_latency_seconds_bucket{op=\"create\",le=\"+Inf\"} 3\n"
                    "space_test_latency_seconds_sum{op=\"create\"} 5.55\n"
                    "space_test_latency_seconds_count{op=\"create\"} 3\n") != NULL);
    CHECK(strstr(t, "# TYPE space_test_quiet_total counter\n") != NULL);
    CHECK(strstr(t, "\nprocess_resident_memory_bytes ") != NULL);
    CHECK(strstr(t, "\nprocess_open_fds ") != NULL);
    CHECK(strstr(t, "\nprocess_cpu_seconds_total ") != NULL);
    CHECK(strstr(t, "\nprocess_start_time_seconds 1") != NULL);

    /* Gauges zeroed by a collector before it sets what exists now. */
    sp_metrics_zero(&m_up);
    CHECK(sp_metrics_value(&m_up) == 0);
    sp_metrics_collector_remove(collect, &up);
    sp_buf_reset(&b);
    CHECK(sp_metrics_render(&b) == 0);
    CHECK(collected == 1);
    CHECK(strstr(sp_buf_cstr(&b), "space_test_up 0\n") != NULL);
    sp_buf_free(&b);
    return check_report("base.metrics");
}
