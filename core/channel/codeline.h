/*
 * codeline.h - the host's reading of the code daemon's answer (code.h's protocol, which the
 * guest writes and so is hostile): lines cut from the stream's bytes, each line's JSON, and
 * what a status line or an event line says.
 *
 * Pure: no loop, no agent stream, no credit (code.c keeps those and calls these); the
 * libFuzzer target core/channel/tests/fuzz_codeline.c drives them as code.c does.
 */
#ifndef SP_CODELINE_H
#define SP_CODELINE_H

#include <jansson.h>
#include <stddef.h>
#include <stdint.h>

#include "base/buf.h"
#include "base/err.h"
#include "core/channel/code.h"

typedef enum {
    SP_CODELINE_HELD = 0, /* all n bytes kept in the buffer: the line has no newline yet */
    SP_CODELINE_LINE,     /* a complete line */
    SP_CODELINE_TOOLONG,  /* the line would pass SP_CODE_LINE_MAX */
    SP_CODELINE_NOMEM,
} sp_codeline_cut_t;

/* Cuts the next line from p[0..n) (n > 0), after what buf holds of it already. LINE: *line and
 * *len are the complete line without its newline (in p or in buf, valid until buf's next
 * append), *used the bytes of p it took (its newline included), and buf is empty again. HELD:
 * *used is n. */
sp_codeline_cut_t sp_codeline_cut(sp_buf_t *buf, const uint8_t *p, size_t n, const char **line,
                                  size_t *len, size_t *used);
/* Frees buf's memory once a line is handled when it grew past what is worth keeping. */
void sp_codeline_trim(sp_buf_t *buf);

/* A line's JSON. 0 with *out NULL: a blank line (spaces, tabs, CRs). 0 with *out an object
 * (the caller json_decrefs it). -1 with *why (static text) when it is too complex for its
 * size, not JSON, or not an object. */
int sp_codeline_json(const char *line, size_t len, json_t **out, const char **why);

/* The status line j: 1 ok (the op's fields are in j), 0 the daemon refused (*err: its code and
 * message, cleaned to printable ASCII), -1 malformed (*why). */
int sp_codeline_status(json_t *j, sp_err_t *err, const char **why);
/* A CTX object; strings borrowed from o. -1 when it is not one. */
int sp_codeline_ctx(json_t *o, sp_code_ctx_t *out);
/* An ok status's "contexts": *out a malloc'd array of *n (strings borrowed from j; free it).
 * -1 malformed (*why), -2 out of memory. */
int sp_codeline_ctx_list(json_t *j, sp_code_ctx_t **out, size_t *n, const char **why);

/* An event line j (after execute's ok status): 0 with *ev filled (borrowed from j; an output
 * event without its timestamp gets now's, written into now), 1 when its type is not one this
 * host knows (a newer daemon's: skipped), -1 malformed (*why). END is the last event. */
int sp_codeline_event(json_t *j, sp_code_ev_t *ev, char now[40], const char **why);

/* A printable ASCII copy of the guest's s[0..n) (others become '?'), cut to fit out. */
void sp_codeline_clean(const char *s, size_t n, char *out, size_t cap);

#endif
