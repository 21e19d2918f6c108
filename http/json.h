/*
 * json.h - JSON text for responses, written straight into an sp_buf_t.
 *
 * The same bytes as jansson's json_dumps(v, JSON_COMPACT) (a test compares them), without
 * its per-container loop check (a formatted pointer and a hash insert for every object and
 * array) and its reallocating string buffer: rendering a list of sandboxes was most of the
 * time spaced spent answering it. Reals, rare in responses, are still formatted by jansson.
 */
#ifndef SP_HTTP_JSON_H
#define SP_HTTP_JSON_H

#include <jansson.h>
#include <stdbool.h>

#include "base/buf.h"

/* Appends v's compact text. -1 when jansson would refuse too (a string that is not UTF-8, a
 * nesting deeper than SP_JSON_MAX_DEPTH); what was appended then is garbage: discard it. */
#define SP_JSON_MAX_DEPTH 2048
int sp_json_write(sp_buf_t *b, const json_t *v);

/* Appends s as a JSON string (quoted, escaped), the bytes sp_json_write gives json_string(s).
 * -1 when s is not UTF-8 (what was appended is then garbage). For renderers that write a
 * record's fields straight, without building jansson values first. */
int sp_json_write_str(sp_buf_t *b, const char *s);

/* Appends s[0..n) escaped as between a JSON string's quotes (NUL bytes too), without the
 * quotes: a string's text written in pieces, each ending on a character's end. -1 when s is not
 * UTF-8 (what was appended is then garbage). */
int sp_json_write_str_part(sp_buf_t *b, const char *s, size_t n);

/* Whether s[0..n) is UTF-8 as jansson takes it (no overlongs, no surrogates, nothing past
 * U+10FFFF): what a string from elsewhere (a protobuf message) must be to become JSON. */
bool sp_json_utf8_valid(const void *s, size_t n);

/* Pieces of an object written field by field, in the order its jansson twin sets them (a test
 * per renderer compares the bytes). prefix is the literal text before the value, e.g.
 * "{\"id\":" or ",\"state\":", written as is. */
/* prefix, then v as a JSON string, or null for "" when or_null. -1 when v is not UTF-8. */
int sp_json_put_str(sp_buf_t *b, const char *prefix, const char *v, bool or_null);
/* prefix, then v in decimal (what json_integer(v) is written as). */
void sp_json_put_int(sp_buf_t *b, const char *prefix, long long v);
/* prefix, then true, false, or null for a negative v. */
void sp_json_put_bool(sp_buf_t *b, const char *prefix, int v);

#endif
