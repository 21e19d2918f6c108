/*
 * json.c - compact JSON text of a jansson value into an sp_buf_t (json.h).
 */
#include "http/json.h"

#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* Length of the valid UTF-8 sequence at s (n bytes left), or 0 when it is not one: the rules
 * jansson checks (no overlongs, no surrogates, nothing past U+10FFFF). */
static size_t utf8_len(const unsigned char *s, size_t n)
{
    unsigned c = s[0];
    size_t len;
    uint32_t cp;
    if (c < 0x80)
        return 1;
    if (c >= 0xC2 && c <= 0xDF) {
        len = 2;
        cp = c & 0x1F;
    } else if (c >= 0xE0 && c <= 0xEF) {
        len = 3;
        cp = c & 0x0F;
    } else if (c >= 0xF0 && c <= 0xF4) {
        len = 4;
        cp = c & 0x07;
    } else {
        return 0;
    }
    if (n < len)
        return 0;
    for (size_t i = 1; i < len; i++) {
        if ((s[i] & 0xC0) != 0x80)
            return 0;
        cp = (cp << 6) | (s[i] & 0x3F);
    }
    if ((len == 3 && cp < 0x800) || (len == 4 && cp < 0x10000) || cp > 0x10FFFF ||
        (cp >= 0xD800 && cp <= 0xDFFF))
        return 0;
    return len;
}

bool sp_json_utf8_valid(const void *s, size_t n)
{
    const unsigned char *p = s;
    for (size_t i = 0, k; i < n; i += k)
        if ((k = utf8_len(p + i, n - i)) == 0)
            return false;
    return true;
}

/* Escapes s[0..n) into o (room for 6 bytes per input byte); the bytes written, or -1 when s is
 * not UTF-8. A sequence may run up to 3 bytes past n (the caller's block): *used says where the
 * input ended. */
static long escape(const unsigned char *s, size_t n, size_t avail, char *o, size_t *used)
{
    static const char hex[] = "0123456789ABCDEF";
    char *start = o;
    size_t i = 0;
    while (i < n) {
        unsigned char c = s[i];
        if (c >= 0x80) {
            size_t k = utf8_len(s + i, avail - i);
            if (k == 0)
                return -1;
            memcpy(o, s + i, k);
            o += k;
            i += k;
            continue;
        }
        i++;
        if (c >= 0x20 && c != '"' && c != '\\') {
            *o++ = (char)c;
            continue;
        }
        *o++ = '\\';
        switch (c) {
        case '"':
        case '\\':
            *o++ = (char)c;
            break;
        case '\b':
            *o++ = 'b';
            break;
        case '\f':
            *o++ = 'f';
            break;
        case '\n':
            *o++ = 'n';
            break;
        case '\r':
            *o++ = 'r';
            break;
        case '\t':
            *o++ = 't';
            break;
        default:
            memcpy(o, "u00", 3);
            o[3] = hex[c >> 4];
            o[4] = hex[c & 15];
            o += 5;
            break;
        }
    }
    *used = i;
    return (long)(o - start);
}

/* In blocks, so a large string never needs six times its size at once. */
#define BLOCK 4096

int sp_json_write_str_part(sp_buf_t *b, const char *str, size_t n)
{
    const unsigned char *s = (const unsigned char *)str;
    for (size_t i = 0; i < n;) {
        size_t chunk = n - i < BLOCK ? n - i : BLOCK, used;
        char *o = sp_buf_reserve(b, (chunk + 3) * 6);
        if (o == NULL)
            return -1;
        long w = escape(s + i, chunk, n - i, o, &used);
        if (w < 0)
            return -1;
        sp_buf_commit(b, (size_t)w);
        i += used;
    }
    return 0;
}

static int write_string(sp_buf_t *b, const char *str, size_t n)
{
    sp_buf_add(b, "\"", 1);
    if (sp_json_write_str_part(b, str, n) < 0)
        return -1;
    sp_buf_add(b, "\"", 1);
    return 0;
}

static int write_value(sp_buf_t *b, const json_t *v, int depth)
{
    if (depth > SP_JSON_MAX_DEPTH)
        return -1;
    switch (json_typeof(v)) {
    case JSON_OBJECT: {
        sp_buf_add(b, "{", 1);
        bool first = true;
        for (void *it = json_object_iter((json_t *)v); it != NULL;
             it = json_object_iter_next((json_t *)v, it)) {
            if (!first)
                sp_buf_add(b, ",", 1);
            first = false;
            const char *k = json_object_iter_key(it);
            if (write_string(b, k, strlen(k)) < 0)
                return -1;
            sp_buf_add(b, ":", 1);
            if (write_value(b, json_object_iter_value(it), depth + 1) < 0)
                return -1;
        }
        sp_buf_add(b, "}", 1);
        return 0;
    }
    case JSON_ARRAY: {
        sp_buf_add(b, "[", 1);
        for (size_t i = 0, n = json_array_size(v); i < n; i++) {
            if (i > 0)
                sp_buf_add(b, ",", 1);
            if (write_value(b, json_array_get(v, i), depth + 1) < 0)
                return -1;
        }
        sp_buf_add(b, "]", 1);
        return 0;
    }
    case JSON_STRING:
        return write_string(b, json_string_value(v), json_string_length(v));
    case JSON_INTEGER:
        sp_json_put_int(b, "", json_integer_value(v));
        return 0;
    case JSON_REAL: {
        char *s = json_dumps(v, JSON_ENCODE_ANY | JSON_COMPACT);
        if (s == NULL)
            return -1;
        sp_buf_str(b, s);
        free(s);
        return 0;
    }
    case JSON_TRUE:
        sp_buf_add(b, "true", 4);
        return 0;
    case JSON_FALSE:
        sp_buf_add(b, "false", 5);
        return 0;
    case JSON_NULL:
        sp_buf_add(b, "null", 4);
        return 0;
    }
    return -1;
}

int sp_json_write_str(sp_buf_t *b, const char *s)
{
    return write_string(b, s, strlen(s)) < 0 || b->oom ? -1 : 0;
}

int sp_json_write(sp_buf_t *b, const json_t *v)
{
    if (v == NULL)
        return -1;
    return write_value(b, v, 0) < 0 || b->oom ? -1 : 0;
}

int sp_json_put_str(sp_buf_t *b, const char *prefix, const char *v, bool or_null)
{
    sp_buf_str(b, prefix);
    if (or_null && v[0] == '\0') {
        sp_buf_add(b, "null", 4);
        return 0;
    }
    return write_string(b, v, strlen(v));
}

void sp_json_put_int(sp_buf_t *b, const char *prefix, long long v)
{
    sp_buf_str(b, prefix);
    /* Digits backwards into a small array: snprintf's format parsing cost more than the rest
     * of a field. The magnitude as unsigned, so LLONG_MIN works. */
    char d[24];
    size_t n = 0;
    unsigned long long u = v < 0 ? 0ull - (unsigned long long)v : (unsigned long long)v;
    do {
        d[sizeof(d) - 1 - n++] = (char)('0' + u % 10);
        u /= 10;
    } while (u != 0);
    if (v < 0)
        d[sizeof(d) - 1 - n++] = '-';
    sp_buf_add(b, d + sizeof(d) - n, n);
}

void sp_json_put_bool(sp_buf_t *b, const char *prefix, int v)
{
    sp_buf_str(b, prefix);
    if (v < 0)
        sp_buf_add(b, "null", 4);
    else if (v)
        sp_buf_add(b, "true", 4);
    else
        sp_buf_add(b, "false", 5);
}
