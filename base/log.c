/*
 * log.c - the line writer behind sp_log().
 */
#include "base/log.h"

#include <stdarg.h>
#include <stdio.h>
#include <string.h>
#include <time.h>

sp_log_level_t sp_log_min_level = SP_LOG_INFO;

static const char *level_names[] = {"debug", "info", "warn", "error"};

int sp_log_parse_level(const char *s, sp_log_level_t *out)
{
    for (int i = 0; i < 4; i++) {
        if (strcmp(s, level_names[i]) == 0) {
            *out = (sp_log_level_t)i;
            return 0;
        }
    }
    return -1;
}

void sp_log_write(sp_log_level_t level, const char *module, const char *fmt, ...)
{
    char line[2048];
    struct timespec ts;
    struct tm tm;
    clock_gettime(CLOCK_REALTIME, &ts);
    gmtime_r(&ts.tv_sec, &tm);
    int n = snprintf(line, sizeof(line), "%04d-%02d-%02dT%02d:%02d:%02d.%03ldZ %-5s %s ",
                     tm.tm_year + 1900, tm.tm_mon + 1, tm.tm_mday, tm.tm_hour, tm.tm_min,
                     tm.tm_sec, ts.tv_nsec / 1000000, level_names[level & 3], module);
    va_list ap;
    va_start(ap, fmt);
    if (n > 0 && (size_t)n < sizeof(line))
        n += vsnprintf(line + n, sizeof(line) - (size_t)n, fmt, ap);
    va_end(ap);
    if (n < 0)
        return;
    if ((size_t)n >= sizeof(line) - 1)
        n = (int)sizeof(line) - 2;
    line[n++] = '\n';
    /* One write per line so concurrent writers do not interleave. */
    fwrite(line, 1, (size_t)n, stderr);
    fflush(stderr);
}
