/* test_log.c - the two line formats of base/log.h: text as before, JSON one object a line with
 * the stable keys and the message's key=value fields. */
#include <jansson.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>

#include "base/log.h"
#include "tests/check.h"

/* Runs one sp_log call with stderr sent to a file; returns what it wrote. */
static char out[32768];

static const char *capture_begin(FILE **f, int *saved)
{
    fflush(stderr);
    *f = tmpfile();
    REQUIRE(*f != NULL);
    *saved = dup(2);
    REQUIRE(dup2(fileno(*f), 2) == 2);
    return NULL;
}

static const char *capture_end(FILE *f, int saved)
{
    fflush(stderr);
    dup2(saved, 2);
    close(saved);
    rewind(f);
    size_t n = fread(out, 1, sizeof(out) - 1, f);
    out[n] = '\0';
    fclose(f);
    return out;
}

#define CAPTURE(stmt)                                                                              \
    do {                                                                                           \
        FILE *f_;                                                                                  \
        int s_;                                                                                    \
        capture_begin(&f_, &s_);                                                                   \
        stmt;                                                                                      \
        capture_end(f_, s_);                                                                       \
    } while (0)

int main(void)
{
    sp_log_format_t fm;
    CHECK(sp_log_parse_format("json", &fm) == 0 && fm == SP_LOG_JSON);
    CHECK(sp_log_parse_format("text", &fm) == 0 && fm == SP_LOG_TEXT);
    CHECK(sp_log_parse_format("xml", &fm) < 0);

    /* Text: time, level, module, message, one line. */
    CAPTURE(sp_log(SP_LOG_WARN, "recon", "sandbox=%s action=%s", "sb1", "boot"));
    CHECK(strlen(out) > 24 && out[4] == '-' && out[10] == 'T' && out[23] == 'Z');
    CHECK(strstr(out, " warn  recon sandbox=sb1 action=boot\n") != NULL);

    sp_log_format = SP_LOG_JSON;
    CAPTURE(sp_log(SP_LOG_INFO, "egress", "denied sandbox=%s dest=%s reason=\"%s\" ts=x n=1 n=2",
                   "abc", "example.com:443", "policy \"deny\" \\ all"));
    CHECK(strchr(out, '\n') == out + strlen(out) - 1); /* one line */
    json_error_t je;
    json_t *o = json_loads(out, 0, &je);
    REQUIRE(o != NULL);
    const char *ts = json_string_value(json_object_get(o, "ts"));
    /* 2026-12-01T17:07:08.123Z */
    CHECK(ts != NULL && strlen(ts) == 24 && ts[10] == 'T' && ts[19] == '.' && ts[23] == 'Z');
    CHECK(strcmp(json_string_value(json_object_get(o, "level")), "info") == 0);
    CHECK(strcmp(json_string_value(json_object_get(o, "component")), "egress") == 0);
    const char *msg = json_string_value(json_object_get(o, "msg"));
    CHECK(msg != NULL && strncmp(msg, "denied sandbox=abc dest=example.com:443", 39) == 0);
    CHECK(strcmp(json_string_value(json_object_get(o, "sandbox")), "abc") == 0);
    CHECK(strcmp(json_string_value(json_object_get(o, "dest")), "example.com:443") == 0);
    /* A quoted value runs to the next quote; a reserved or repeated key is not a field. */
    CHECK(strcmp(json_string_value(json_object_get(o, "reason")), "policy ") == 0);
    CHECK(strcmp(json_string_value(json_object_get(o, "n")), "1") == 0);
    CHECK(json_object_get(o, "ts") != NULL && strcmp(ts, "x") != 0);
    json_decref(o);

    /* Control bytes, quotes and bytes that are not UTF-8 stay one valid object. */
    CAPTURE(sp_log(SP_LOG_ERROR, "qemu", "out=%s", "a\"b\n\x01\xff\xc3\xa9"));
    o = json_loads(out, 0, &je);
    REQUIRE(o != NULL);
    CHECK(strcmp(json_string_value(json_object_get(o, "level")), "error") == 0);
    CHECK(strcmp(json_string_value(json_object_get(o, "msg")),
                 "out=a\"b\n\x01\xef\xbf\xbd\xc3\xa9") == 0);
    json_decref(o);

    /* A long message is cut, never the object. */
    static char big[5000];
    memset(big, '\x02', sizeof(big) - 1);
    CAPTURE(sp_log(SP_LOG_INFO, "x", "k=%s", big));
    o = json_loads(out, 0, &je);
    CHECK(o != NULL);
    json_decref(o);

    /* Below the level: nothing. */
    CAPTURE(sp_log(SP_LOG_DEBUG, "x", "hidden"));
    CHECK(out[0] == '\0');
    return check_report("base.log");
}
