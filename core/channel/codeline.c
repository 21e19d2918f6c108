/*
 * codeline.c - the code daemon's answer read on the host (core/channel/codeline.h).
 *
 * The daemon runs in the guest and is not trusted: a line that is too long, not JSON, too
 * complex for its size, or has a field of the wrong type is malformed, and the request ends
 * with an error (code.c). Owns nothing beyond what the caller frees.
 */
#include "core/channel/codeline.h"

#include <ctype.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "core/channel/exec.h"

#define JSON_TOKENS_MAX 262144u   /* structural tokens per line: bounds jansson's memory */
#define LINE_KEEP (1024u * 1024u) /* a line buffer larger than this is freed after use */

const char *sp_code_language(const char *name)
{
    if (name == NULL)
        return NULL;
    while (isspace((unsigned char)*name))
        name++;
    size_t n = strlen(name);
    while (n > 0 && isspace((unsigned char)name[n - 1]))
        n--;
    char low[16];
    if (n == 0 || n >= sizeof(low))
        return NULL;
    for (size_t i = 0; i < n; i++)
        low[i] = (char)tolower((unsigned char)name[i]);
    low[n] = '\0';
    if (strcmp(low, "python") == 0 || strcmp(low, "python3") == 0 || strcmp(low, "py") == 0)
        return "python";
    if (strcmp(low, "bash") == 0 || strcmp(low, "sh") == 0)
        return "bash";
    return NULL;
}

sp_codeline_cut_t sp_codeline_cut(sp_buf_t *buf, const uint8_t *p, size_t n, const char **line,
                                  size_t *len, size_t *used)
{
    const uint8_t *nl = memchr(p, '\n', n);
    size_t seg = nl != NULL ? (size_t)(nl - p) : n;
    if (buf->len + seg > SP_CODE_LINE_MAX)
        return SP_CODELINE_TOOLONG;
    if (nl == NULL || buf->len > 0) {
        sp_buf_add(buf, p, seg);
        if (buf->oom)
            return SP_CODELINE_NOMEM;
    }
    if (nl == NULL) {
        *used = n;
        return SP_CODELINE_HELD;
    }
    *line = buf->len > 0 ? (const char *)buf->p : (const char *)p;
    *len = buf->len > 0 ? buf->len : seg;
    *used = seg + 1;
    sp_buf_reset(buf); /* the bytes stay intact until the next append */
    return SP_CODELINE_LINE;
}

void sp_codeline_trim(sp_buf_t *buf)
{
    if (buf->cap > LINE_KEEP)
        sp_buf_free(buf);
}

void sp_codeline_clean(const char *s, size_t n, char *out, size_t cap)
{
    size_t k = 0;
    for (size_t i = 0; s != NULL && i < n && k + 1 < cap; i++) {
        unsigned char ch = (unsigned char)s[i];
        out[k++] = (ch >= 0x20 && ch < 0x7f) ? (char)ch : '?';
    }
    if (cap > 0)
        out[k] = '\0';
}

static void iso_now(char out[40])
{
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    struct tm tm;
    gmtime_r(&ts.tv_sec, &tm);
    char base[32];
    strftime(base, sizeof(base), "%Y-%m-%dT%H:%M:%S", &tm);
    snprintf(out, 40, "%.24s.%06uZ", base, (unsigned)(ts.tv_nsec / 1000) % 1000000u);
}

/* Commas, colons and opening brackets outside strings: a cheap bound on the number of values
 * jansson would allocate for the line. */
static bool too_complex(const char *p, size_t n)
{
    size_t tokens = 0;
    bool in_str = false;
    for (size_t i = 0; i < n; i++) {
        char c = p[i];
        if (in_str) {
            if (c == '\\')
                i++;
            else if (c == '"')
                in_str = false;
        } else if (c == '"') {
            in_str = true;
        } else if (c == ',' || c == ':' || c == '[' || c == '{') {
            if (++tokens > JSON_TOKENS_MAX)
                return true;
        }
    }
    return false;
}

int sp_codeline_json(const char *line, size_t len, json_t **out, const char **why)
{
    *out = NULL;
    size_t i = 0;
    while (i < len && (line[i] == ' ' || line[i] == '\t' || line[i] == '\r'))
        i++;
    if (i == len) /* blank */
        return 0;
    if (too_complex(line, len)) {
        *why = "line too complex";
        return -1;
    }
    json_error_t je;
    json_t *j = json_loadb(line, len, 0, &je);
    if (!json_is_object(j)) {
        json_decref(j);
        *why = j == NULL ? "not JSON" : "not an object";
        return -1;
    }
    *out = j;
    return 0;
}

int sp_codeline_ctx(json_t *o, sp_code_ctx_t *out)
{
    if (!json_is_object(o))
        return -1;
    json_t *id = json_object_get(o, "id"), *lang = json_object_get(o, "language"),
           *cwd = json_object_get(o, "cwd"), *def = json_object_get(o, "default");
    if (!json_is_string(id) || json_string_length(id) == 0 ||
        json_string_length(id) > SP_CODE_ID_MAX || !json_is_string(lang) ||
        json_string_length(lang) == 0 || json_string_length(lang) > 64 || !json_is_string(cwd) ||
        json_string_length(cwd) > SP_EXEC_PATH_MAX || (def != NULL && !json_is_boolean(def)))
        return -1;
    out->id = json_string_value(id);
    out->language = json_string_value(lang);
    out->cwd = json_string_value(cwd);
    out->is_default = json_is_true(def);
    return 0;
}

/* {"code": str, "message": str} -> our error; -1 when it is not that shape. */
static int daemon_error(json_t *eo, sp_err_t *out)
{
    json_t *c = json_object_get(eo, "code"), *m = json_object_get(eo, "message");
    if (!json_is_object(eo) || !json_is_string(c) || (m != NULL && !json_is_string(m)))
        return -1;
    const char *code = json_string_value(c);
    char msg[112];
    sp_codeline_clean(m ? json_string_value(m) : NULL, m ? json_string_length(m) : 0, msg,
                      sizeof(msg));
    if (strcmp(code, "invalid") == 0)
        sp_err_set(out, SP_EINVAL, "%s", msg[0] ? msg : "invalid request");
    else if (strcmp(code, "not_found") == 0)
        sp_err_set(out, SP_ENOTFOUND, "%s", msg[0] ? msg : "no such context");
    else if (strcmp(code, "unsupported_language") == 0 && strstr(msg, SP_CODE_LANGUAGES))
        sp_err_set(out, SP_EINVAL, "%s", msg);
    else if (strcmp(code, "unsupported_language") == 0)
        sp_err_set(out, SP_EINVAL, "%s (supported: %s)", msg[0] ? msg : "unsupported language",
                   SP_CODE_LANGUAGES);
    else if (strcmp(code, "unavailable") == 0)
        sp_err_set(out, SP_EUNAVAIL, "%s", msg[0] ? msg : "the code interpreter is unavailable");
    else
        sp_err_set(out, SP_EINTERNAL, "the code interpreter failed%s%s", msg[0] ? ": " : "", msg);
    return 0;
}

int sp_codeline_status(json_t *j, sp_err_t *err, const char **why)
{
    json_t *ok = json_object_get(j, "ok");
    if (!json_is_boolean(ok)) {
        *why = "status without ok";
        return -1;
    }
    if (json_is_true(ok))
        return 1;
    if (daemon_error(json_object_get(j, "error"), err) < 0) {
        *why = "bad error object";
        return -1;
    }
    return 0;
}

int sp_codeline_ctx_list(json_t *j, sp_code_ctx_t **out, size_t *n, const char **why)
{
    json_t *arr = json_object_get(j, "contexts");
    *out = NULL;
    *n = 0;
    if (!json_is_array(arr)) {
        *why = "contexts is not an array";
        return -1;
    }
    size_t k = json_array_size(arr);
    sp_code_ctx_t *v = calloc(k ? k : 1, sizeof(*v));
    if (v == NULL)
        return -2;
    for (size_t i = 0; i < k; i++) {
        if (sp_codeline_ctx(json_array_get(arr, i), &v[i]) < 0) {
            free(v);
            *why = "bad context in list";
            return -1;
        }
    }
    *out = v;
    *n = k;
    return 0;
}

static const char *const end_statuses[] = {"ok",          "error",   "timeout",
                                           "interrupted", "crashed", NULL};

int sp_codeline_event(json_t *j, sp_code_ev_t *ev, char now[40], const char **why)
{
    const char *type = json_string_value(json_object_get(j, "type"));
    *ev = (sp_code_ev_t){.execution_count = -1};
    if (type == NULL) {
        *why = "event without type";
        return -1;
    }
    if (strcmp(type, "stdout") == 0 || strcmp(type, "stderr") == 0) {
        json_t *t = json_object_get(j, "text"), *ts = json_object_get(j, "timestamp");
        if (!json_is_string(t) ||
            (ts != NULL && (!json_is_string(ts) || json_string_length(ts) > 64))) {
            *why = "bad output event";
            return -1;
        }
        ev->type = type[3] == 'o' ? SP_CODE_EV_STDOUT : SP_CODE_EV_STDERR;
        ev->text = json_string_value(t);
        ev->len = json_string_length(t);
        if (ts == NULL) {
            iso_now(now);
            ev->timestamp = now;
        } else {
            ev->timestamp = json_string_value(ts);
        }
        return 0;
    }
    if (strcmp(type, "result") == 0) {
        json_t *m = json_object_get(j, "is_main_result"), *d = json_object_get(j, "data");
        if ((m != NULL && !json_is_boolean(m)) || !json_is_object(d)) {
            *why = "bad result event";
            return -1;
        }
        ev->type = SP_CODE_EV_RESULT;
        ev->is_main_result = json_is_true(m);
        ev->data = d;
        return 0;
    }
    if (strcmp(type, "error") == 0) {
        json_t *n = json_object_get(j, "name"), *v = json_object_get(j, "value"),
               *tb = json_object_get(j, "traceback");
        bool good = json_is_string(n) && json_is_string(v) && json_is_array(tb);
        for (size_t i = 0; good && i < json_array_size(tb); i++)
            good = json_is_string(json_array_get(tb, i));
        if (!good) {
            *why = "bad error event";
            return -1;
        }
        ev->type = SP_CODE_EV_ERROR;
        ev->name = json_string_value(n);
        ev->value = json_string_value(v);
        ev->traceback = tb;
        return 0;
    }
    if (strcmp(type, "end") == 0) {
        json_t *st = json_object_get(j, "status"), *ec = json_object_get(j, "execution_count");
        const char *status = json_string_value(st);
        bool good = false;
        for (int i = 0; status != NULL && end_statuses[i] != NULL && !good; i++)
            good = strcmp(status, end_statuses[i]) == 0;
        if (!good || (ec != NULL && !json_is_null(ec) &&
                      (!json_is_integer(ec) || json_integer_value(ec) < 0 ||
                       json_integer_value(ec) > 0x7fffffff))) {
            *why = "bad end event";
            return -1;
        }
        ev->type = SP_CODE_EV_END;
        ev->status = status;
        ev->execution_count = json_is_integer(ec) ? (int)json_integer_value(ec) : -1;
        return 0;
    }
    return 1; /* a newer daemon's event */
}
