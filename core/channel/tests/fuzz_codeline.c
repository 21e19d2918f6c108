/*
 * fuzz_codeline.c - libFuzzer target over the host's reading of the code daemon's answer
 * (core/channel/codeline.h), driven as code.c drives it: the guest's bytes arrive in chunks
 * and are cut into lines; the first line is the status of a request (create, list, delete,
 * restart, interrupt or execute), an execute's later lines are events until END.
 *
 * Input: byte 0 picks the request (low 3 bits) and the chunk size (the rest, 1..32 bytes);
 * the rest are the daemon's bytes.
 *
 * Checked: a cut line never holds its newline and never passes SP_CODE_LINE_MAX; every chunk's
 * bytes are used exactly once; a refusal is one of the codes the protocol maps to, with a
 * printable message; a context's strings are within their bounds; an event's strings are
 * NUL-terminated as long as their length says and END's count is -1 or non-negative.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "core/channel/codeline.h"
#include "core/channel/exec.h"
#include "tests/fuzz.h"

enum { K_CREATE = 0, K_LIST, K_DELETE, K_RESTART, K_INTERRUPT, K_EXEC, K_NKINDS };

static void check_ctx(const sp_code_ctx_t *c)
{
    ASSERT(c->id != NULL && c->language != NULL && c->cwd != NULL);
    ASSERT(strlen(c->id) >= 1);
    ASSERT(strlen(c->language) >= 1 && strlen(c->language) <= 64);
}

static void check_err(const sp_err_t *e)
{
    ASSERT(e->code == SP_EINVAL || e->code == SP_ENOTFOUND || e->code == SP_EUNAVAIL ||
           e->code == SP_EINTERNAL);
    for (const char *p = e->msg; *p; p++)
        ASSERT((unsigned char)*p >= 0x20 && (unsigned char)*p < 0x7f);
}

/* 1 while more lines are wanted. */
static int on_line(int kind, int *phase, const char *line, size_t len)
{
    json_t *j;
    const char *why = NULL;
    ASSERT(memchr(line, '\n', len) == NULL && len <= SP_CODE_LINE_MAX);
    if (sp_codeline_json(line, len, &j, &why) < 0) {
        ASSERT(why != NULL);
        return 0;
    }
    if (j == NULL)
        return 1; /* blank */
    ASSERT(json_is_object(j));
    int more = 0;
    if (*phase == 0) {
        sp_err_t e;
        int st = sp_codeline_status(j, &e, &why);
        if (st < 0) {
            ASSERT(why != NULL);
        } else if (st == 0) {
            check_err(&e);
        } else if (kind == K_LIST) {
            sp_code_ctx_t *v;
            size_t n;
            if (sp_codeline_ctx_list(j, &v, &n, &why) == 0) {
                for (size_t i = 0; i < n; i++)
                    check_ctx(&v[i]);
                free(v);
            }
        } else if (kind == K_CREATE || kind == K_RESTART || kind == K_EXEC) {
            sp_code_ctx_t c;
            if (sp_codeline_ctx(json_object_get(j, "context"), &c) == 0) {
                check_ctx(&c);
                if (kind == K_EXEC) {
                    *phase = 1;
                    more = 1;
                }
            }
        }
    } else {
        sp_code_ev_t ev;
        char now[40];
        int rc = sp_codeline_event(j, &ev, now, &why);
        if (rc < 0) {
            ASSERT(why != NULL);
        } else if (rc > 0) {
            more = 1;
        } else {
            more = ev.type != SP_CODE_EV_END;
            switch (ev.type) {
            case SP_CODE_EV_STDOUT:
            case SP_CODE_EV_STDERR:
                ASSERT(ev.text != NULL && ev.timestamp != NULL);
                ASSERT(strlen(ev.timestamp) <= 64);
                ASSERT(ev.text[ev.len] == '\0');
                break;
            case SP_CODE_EV_RESULT:
                ASSERT(json_is_object(ev.data));
                break;
            case SP_CODE_EV_ERROR:
                ASSERT(ev.name != NULL && ev.value != NULL && json_is_array(ev.traceback));
                for (size_t i = 0; i < json_array_size(ev.traceback); i++)
                    ASSERT(json_is_string(json_array_get(ev.traceback, i)));
                break;
            case SP_CODE_EV_END:
                ASSERT(ev.status != NULL && ev.execution_count >= -1);
                break;
            default:
                ASSERT(0);
            }
        }
    }
    json_decref(j);
    return more;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    if (size < 1)
        return 0;
    int kind = (data[0] & 7) % K_NKINDS;
    size_t chunk = (size_t)(data[0] >> 3) + 1;
    data++;
    size--;
    sp_buf_t buf = SP_BUF_INIT;
    int phase = 0, more = 1;
    for (size_t off = 0; off < size && more;) {
        size_t n = size - off < chunk ? size - off : chunk, at = 0;
        while (at < n && more) {
            const char *line = NULL;
            size_t len = 0, used = 0;
            sp_codeline_cut_t r =
                sp_codeline_cut(&buf, data + off + at, n - at, &line, &len, &used);
            ASSERT(r == SP_CODELINE_HELD || r == SP_CODELINE_LINE);
            ASSERT(used >= 1 && used <= n - at);
            if (r == SP_CODELINE_HELD) {
                ASSERT(used == n - at);
                at = n;
                break;
            }
            ASSERT(data[off + at + used - 1] == '\n' && buf.len == 0);
            at += used;
            more = on_line(kind, &phase, line, len);
            sp_codeline_trim(&buf);
        }
        off += n;
    }
    sp_buf_free(&buf);
    return 0;
}
