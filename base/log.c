/*
 * log.c - the line writer behind sp_log(): text, or one JSON object per line.
 */
#include "base/log.h"

#include <stdarg.h>
#include <stdbool.h>
#include <stdio.h>
#include <string.h>
#include <time.h>

sp_log_level_t sp_log_min_level = SP_LOG_INFO;
sp_log_format_t sp_log_format = SP_LOG_TEXT;

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

int sp_log_parse_format(const char *s, sp_log_format_t *out)
{
    if (strcmp(s, "text") == 0)
        *out = SP_LOG_TEXT;
    else if (strcmp(s, "json") == 0)
        *out = SP_LOG_JSON;
    else
        return -1;
    return 0;
}

/* ---- JSON lines ---- */

struct line {
    char *p;
    size_t n, cap; /* cap keeps room for the closing "}\n" */
};

static void put(struct line *l, const char *s, size_t n)
{
    if (n > l->cap - l->n)
        n = l->cap - l->n;
    memcpy(l->p + l->n, s, n);
    l->n += n;
}

/* Length of the valid UTF-8 sequence at s (at most n bytes), 0 when it is not one. */
static size_t utf8_len(const unsigned char *s, size_t n)
{
    size_t len = s[0] >= 0xf0 && s[0] <= 0xf4 ? 4 : s[0] >= 0xe0 ? 3 : s[0] >= 0xc2 ? 2 : 0;
    if (s[0] >= 0xf8 || len == 0 || len > n)
        return 0;
    for (size_t i = 1; i < len; i++)
        if ((s[i] & 0xc0) != 0x80)
            return 0;
    return len;
}

/* s[0..n) as a JSON string: quotes, backslashes and control bytes escaped, bytes that are not
 * UTF-8 (a guest's output may hold any) as U+FFFD. Never cut inside an escape. */
static void put_str(struct line *l, const char *s, size_t n)
{
    put(l, "\"", 1);
    const unsigned char *u = (const unsigned char *)s;
    for (size_t i = 0; i < n && l->n + 8 < l->cap;) {
        unsigned char c = u[i];
        char esc[8];
        if (c == '"' || c == '\\') {
            esc[0] = '\\';
            esc[1] = (char)c;
            put(l, esc, 2);
            i++;
        } else if (c < 0x20 || c == 0x7f) {
            snprintf(esc, sizeof(esc), "\\u%04x", c);
            put(l, esc, 6);
            i++;
        } else if (c < 0x80) {
            put(l, (const char *)&u[i], 1);
            i++;
        } else {
            size_t k = utf8_len(u + i, n - i);
            if (k == 0) {
                put(l, "\\ufffd", 6);
                i++;
            } else {
                put(l, (const char *)&u[i], k);
                i += k;
            }
        }
    }
    if (l->n < l->cap)
        put(l, "\"", 1);
}

static bool is_key_char(char c, bool first)
{
    return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || c == '_' ||
           (!first && ((c >= '0' && c <= '9') || c == '.' || c == '-'));
}

/* The message's key=value fields, each once, after the four fixed keys. */
static void put_fields(struct line *l, const char *msg)
{
    static const char *const reserved[] = {"ts", "level", "component", "msg"};
    const char *seen[32];
    size_t seen_n[32];
    int nseen = 0;
    const char *p = msg;
    while (*p) {
        /* A field starts a word: at the beginning or after a space. */
        if (p != msg && p[-1] != ' ') {
            p++;
            continue;
        }
        const char *k = p;
        while (is_key_char(*p, p == k))
            p++;
        size_t kn = (size_t)(p - k);
        if (kn == 0 || *p != '=') {
            if (*p)
                p++;
            continue;
        }
        p++;
        const char *v = p;
        size_t vn;
        if (*p == '"') {
            v = ++p;
            while (*p && *p != '"')
                p++;
            vn = (size_t)(p - v);
            if (*p)
                p++;
        } else {
            while (*p && *p != ' ')
                p++;
            vn = (size_t)(p - v);
        }
        bool skip = false;
        for (size_t i = 0; i < sizeof(reserved) / sizeof(reserved[0]); i++)
            skip |= strlen(reserved[i]) == kn && memcmp(reserved[i], k, kn) == 0;
        for (int i = 0; i < nseen; i++)
            skip |= seen_n[i] == kn && memcmp(seen[i], k, kn) == 0;
        if (skip || nseen == 32)
            continue;
        seen[nseen] = k;
        seen_n[nseen++] = kn;
        put(l, ",", 1);
        put_str(l, k, kn);
        put(l, ":", 1);
        put_str(l, v, vn);
    }
}

static size_t json_line(char *out, size_t cap, const char *ts, sp_log_level_t level,
                        const char *module, const char *msg)
{
    struct line l = {out, 0, cap - 2};
    put(&l, "{\"ts\":", 6);
    put_str(&l, ts, strlen(ts));
    put(&l, ",\"level\":", 9);
    put_str(&l, level_names[level & 3], strlen(level_names[level & 3]));
    put(&l, ",\"component\":", 13);
    put_str(&l, module, strlen(module));
    put(&l, ",\"msg\":", 7);
    put_str(&l, msg, strlen(msg));
    put_fields(&l, msg);
    /* cap - 2 kept room for these even if the line were cut (sp_log_write sizes it so that
     * it is not). */
    out[l.n++] = '}';
    out[l.n++] = '\n';
    return l.n;
}

void sp_log_write(sp_log_level_t level, const char *module, const char *fmt, ...)
{
    char line[2048];
    struct timespec ts;
    struct tm tm;
    clock_gettime(CLOCK_REALTIME, &ts);
    gmtime_r(&ts.tv_sec, &tm);
    char when[64];
    snprintf(when, sizeof(when), "%04d-%02d-%02dT%02d:%02d:%02d.%03ldZ", tm.tm_year + 1900,
             tm.tm_mon + 1, tm.tm_mday, tm.tm_hour, tm.tm_min, tm.tm_sec, ts.tv_nsec / 1000000);
    va_list ap;
    va_start(ap, fmt);
    if (sp_log_format == SP_LOG_JSON) {
        /* Escaped (at most 6 bytes a byte) and with its fields repeated, a message this long
         * still fits the line: the object is never cut. */
        char msg[1024];
        vsnprintf(msg, sizeof(msg), fmt, ap);
        va_end(ap);
        char out[14336];
        size_t n = json_line(out, sizeof(out), when, level, module, msg);
        fwrite(out, 1, n, stderr);
        fflush(stderr);
        return;
    }
    int n = snprintf(line, sizeof(line), "%s %-5s %s ", when, level_names[level & 3], module);
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
