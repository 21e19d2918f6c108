/*
 * ndjson.c - streamed NDJSON answers: starting one, and a process's events as lines, for a
 * streamed command (route_commands.c) and a session attached over plain HTTP
 * (route_sessions.c), which answer the same lines.
 *
 * Each line is written with the number of agent bytes it stands for, and http/stream.h
 * hands that credit back only once the client took the line: the flow control is the
 * stream's, this file only builds lines. Output is UTF-8 text: bytes that are not become
 * U+FFFD, and a character split across two chunks is carried over whole to the next line.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "native-api/napi_int.h"

sp_stream_t *sp_napi__ndjson_begin(napi_ctx_t *c, const sp_err_t *err, const sp_stream_cbs_t *cbs,
                                   void *arg)
{
    if (err != NULL) {
        sp_napi__fail(c, err);
        return NULL;
    }
    h2o_req_t *req = sp_napi__take(c);
    if (req == NULL)
        return NULL; /* the client left before the start */
    sp_stream_t *st = sp_stream_start(req, 200, "application/x-ndjson", -1, cbs, arg);
    if (st == NULL)
        sp_http_error_code(req, SP_EINTERNAL, "out of memory");
    return st;
}

int sp_napi__ndjson_line(sp_stream_t *st, json_t *o, size_t raw)
{
    char *s = o != NULL ? json_dumps(o, JSON_COMPACT) : NULL;
    json_decref(o);
    if (s == NULL)
        return -1;
    size_t n = strlen(s);
    s[n] = '\n'; /* over the NUL: the string is not used as one again */
    int rc = sp_stream_write(st, s, n + 1, raw);
    free(s);
    return rc;
}

/* One chunk of fd's output (with the carry) as a line; final: the carry is flushed too. */
static int output(napi_ndjson_t *nd, int fd, const uint8_t *p, size_t n, bool final)
{
    size_t total = nd->ncarry[fd] + n;
    /* The scratch holds the output area, [0, 3 * total] (U+FFFD is 3 bytes for 1), then the
     * input staged after it. */
    sp_buf_reset(&nd->line);
    char *line = sp_buf_reserve(&nd->line, total * 4 + 1);
    if (line == NULL)
        return -1;
    uint8_t *in = (uint8_t *)line + total * 3 + 1;
    memcpy(in, nd->carry[fd], nd->ncarry[fd]);
    if (n > 0)
        memcpy(in + nd->ncarry[fd], p, n);
    size_t used = 0;
    size_t len = sp_exec_utf8_clean(in, total, line, final, &used);
    nd->ncarry[fd] = total - used; /* at most 3: an incomplete sequence */
    memcpy(nd->carry[fd], in + used, nd->ncarry[fd]);
    if (len == 0)
        return sp_stream_write(nd->st, "", 0, n); /* nothing to show yet: credit back */
    json_t *o = json_object();
    json_object_set_new(o, "type", json_string(fd == 0 ? "stdout" : "stderr"));
    json_object_set_new(o, "data", json_stringn_nocheck(line, len));
    return sp_napi__ndjson_line(nd->st, o, n);
}

int sp_napi__nd_event(napi_ndjson_t *nd, const sp_exec_ev_t *ev)
{
    switch (ev->type) {
    case SP_EXEC_EV_START:
        return 0;
    case SP_EXEC_EV_STDOUT:
    case SP_EXEC_EV_STDERR:
        if (output(nd, ev->type == SP_EXEC_EV_STDOUT ? 0 : 1, ev->data, ev->len, false) < 0) {
            sp_stream_end(nd->st, NULL, 0, false); /* the client sees a broken body */
            return -1;
        }
        return 0;
    case SP_EXEC_EV_EXIT:
        for (int fd = 0; fd < 2; fd++)
            if (nd->ncarry[fd] > 0)
                output(nd, fd, NULL, 0, true);
        sp_napi__ndjson_line(nd->st, sp_napi__exit_event(ev), 0);
        break;
    case SP_EXEC_EV_ERROR:
        sp_napi__ndjson_line(nd->st, sp_napi__error_event(ev->err), 0);
        break;
    }
    sp_stream_end(nd->st, NULL, 0, true);
    return 1;
}

void sp_napi__nd_clear(napi_ndjson_t *nd)
{
    sp_buf_free(&nd->line);
}

json_t *sp_napi__exit_json(bool exited, int code, int sig, bool timed_out)
{
    json_t *o = json_object();
    json_object_set_new(o, "exit_code", exited ? json_integer(code) : json_null());
    json_object_set_new(o, "signal", sig ? json_integer(sig) : json_null());
    json_object_set_new(o, "timed_out", json_boolean(timed_out));
    return o;
}

json_t *sp_napi__exit_event(const sp_exec_ev_t *ev)
{
    json_t *o = sp_napi__exit_json(ev->exited, ev->exit_code, ev->signal, ev->timed_out);
    json_object_set_new(o, "type", json_string("exit"));
    return o;
}

json_t *sp_napi__error_event(const sp_err_t *err)
{
    return json_pack("{s:s,s:{s:s,s:s}}", "type", "error", "error", "code", sp_err_name(err->code),
                     "message", err->msg);
}

json_t *sp_napi__start_event(uint32_t pid, const char *session)
{
    char id[16];
    snprintf(id, sizeof(id), "%u", pid);
    json_t *o = json_pack("{s:s,s:s,s:i}", "type", "start", "id", id, "pid", (int)pid);
    if (o != NULL && session != NULL)
        json_object_set_new(o, "session", json_string(session));
    return o;
}
