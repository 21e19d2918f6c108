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

#include "base/buf.h"

/* Appends v's compact text. -1 when jansson would refuse too (a string that is not UTF-8, a
 * nesting deeper than SP_JSON_MAX_DEPTH); what was appended then is garbage: discard it. */
#define SP_JSON_MAX_DEPTH 2048
int sp_json_write(sp_buf_t *b, const json_t *v);

/* Appends s as a JSON string (quoted, escaped), the bytes sp_json_write gives json_string(s).
 * -1 when s is not UTF-8 (what was appended is then garbage). For renderers that write a
 * record's fields straight, without building jansson values first. */
int sp_json_write_str(sp_buf_t *b, const char *s);

#endif
