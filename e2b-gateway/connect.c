/*
 * connect.c - the Connect protocol's bytes (connect.h): message tables, the JSON codec
 * (jansson) and a small protobuf wire codec driven by the same tables, envelopes, error codes
 * and request headers' values.
 *
 * Owns nothing beyond a call except arenas the caller frees. Hostile input: every length is
 * checked against the bytes present, nesting is bounded (SP_CONNECT_MAX_DEPTH), repeated
 * fields and strings live in an arena bounded by SP_CONNECT_ARENA_MAX, and nothing aborts.
 */
#include "e2b-gateway/connect.h"

#include <errno.h>
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <time.h>

#include "http/json.h"

/* ---- arenas ---- */

struct sp_carena_chunk {
    sp_carena_chunk_t *next;
    size_t used, cap;
    max_align_t data[];
};

void *sp_carena_alloc(sp_carena_t *a, size_t n)
{
    n = (n + 15) & ~(size_t)15;
    if (n == 0)
        n = 16;
    if (n > SP_CONNECT_ARENA_MAX || a->used + n > SP_CONNECT_ARENA_MAX)
        return NULL;
    sp_carena_chunk_t *c = a->head;
    if (c == NULL || c->cap - c->used < n) {
        size_t cap = n > 8192 ? n : 8192;
        c = malloc(sizeof(*c) + cap);
        if (c == NULL)
            return NULL;
        c->cap = cap;
        c->used = 0;
        c->next = a->head;
        a->head = c;
    }
    void *p = (char *)c->data + c->used;
    c->used += n;
    a->used += n;
    memset(p, 0, n);
    return p;
}

void sp_carena_free(sp_carena_t *a)
{
    while (a->head != NULL) {
        sp_carena_chunk_t *c = a->head;
        a->head = c->next;
        free(c);
    }
    a->used = 0;
}

/* ---- tables ---- */

#define FLD(T, n, j, pn, k, m, h, s, e)                                                            \
    {                                                                                              \
        .num = n, .json = j, .pname = pn, .kind = k, .repeated = false, .off = offsetof(T, m),     \
        .cnt_off = 0, .has_off = h, .sub = s, .en = e                                              \
    }
#define REP(T, n, j, pn, k, m, c, s)                                                               \
    {                                                                                              \
        .num = n, .json = j, .pname = pn, .kind = k, .repeated = true, .off = offsetof(T, m),      \
        .cnt_off = offsetof(T, c), .has_off = SP_CNO_HAS, .sub = s, .en = NULL                     \
    }
#define HAS(T, m) offsetof(T, m)
#define NOH       SP_CNO_HAS
#define DESC(var, nm, T, tbl)                                                                      \
    const sp_cdesc_t var = {nm, sizeof(T), tbl, sizeof(tbl) / sizeof(tbl[0])}

static const sp_cenum_val_t signal_vals[] = {
    {"SIGNAL_UNSPECIFIED", 0}, {"SIGNAL_SIGTERM", 15}, {"SIGNAL_SIGKILL", 9}};
static const sp_cenum_t signal_enum = {signal_vals, 3};
static const sp_cenum_val_t ftype_vals[] = {
    {"FILE_TYPE_UNSPECIFIED", 0}, {"FILE_TYPE_FILE", 1}, {"FILE_TYPE_DIRECTORY", 2}};
static const sp_cenum_t ftype_enum = {ftype_vals, 3};
static const sp_cenum_val_t evtype_vals[] = {
    {"EVENT_TYPE_UNSPECIFIED", 0}, {"EVENT_TYPE_CREATE", 1}, {"EVENT_TYPE_WRITE", 2},
    {"EVENT_TYPE_REMOVE", 3},      {"EVENT_TYPE_RENAME", 4}, {"EVENT_TYPE_CHMOD", 5}};
static const sp_cenum_t evtype_enum = {evtype_vals, 6};

static const sp_cfield_t empty_f[1] = {{0}};
const sp_cdesc_t sp_cd_empty = {"Empty", sizeof(sp_cempty_t), empty_f, 0};

static const sp_cfield_t config_f[] = {
    FLD(sp_cp_config_t, 1, "cmd", "cmd", SP_CK_STRING, cmd, NOH, NULL, NULL),
    REP(sp_cp_config_t, 2, "args", "args", SP_CK_STRING, args, n_args, NULL),
    REP(sp_cp_config_t, 3, "envs", "envs", SP_CK_MAPSS, envs, n_envs, NULL),
    FLD(sp_cp_config_t, 4, "cwd", "cwd", SP_CK_STRING, cwd, HAS(sp_cp_config_t, has_cwd), NULL,
        NULL),
};
static DESC(cd_config, "ProcessConfig", sp_cp_config_t, config_f);

static const sp_cfield_t size_f[] = {
    FLD(sp_cp_size_t, 1, "cols", "cols", SP_CK_UINT32, cols, NOH, NULL, NULL),
    FLD(sp_cp_size_t, 2, "rows", "rows", SP_CK_UINT32, rows, NOH, NULL, NULL),
};
static DESC(cd_size, "PTY.Size", sp_cp_size_t, size_f);

static const sp_cfield_t pty_f[] = {
    FLD(sp_cp_pty_t, 1, "size", "size", SP_CK_MSG, size, HAS(sp_cp_pty_t, has_size), &cd_size,
        NULL),
};
static DESC(cd_pty, "PTY", sp_cp_pty_t, pty_f);

static const sp_cfield_t selector_f[] = {
    FLD(sp_cp_selector_t, 1, "pid", "pid", SP_CK_UINT32, pid, HAS(sp_cp_selector_t, has_pid), NULL,
        NULL),
    FLD(sp_cp_selector_t, 2, "tag", "tag", SP_CK_STRING, tag, HAS(sp_cp_selector_t, has_tag), NULL,
        NULL),
};
static DESC(cd_selector, "ProcessSelector", sp_cp_selector_t, selector_f);

static const sp_cfield_t input_f[] = {
    FLD(sp_cp_input_t, 1, "stdin", "stdin", SP_CK_BYTES, stdin_data, HAS(sp_cp_input_t, has_stdin),
        NULL, NULL),
    FLD(sp_cp_input_t, 2, "pty", "pty", SP_CK_BYTES, pty, HAS(sp_cp_input_t, has_pty), NULL, NULL),
};
static DESC(cd_input, "ProcessInput", sp_cp_input_t, input_f);

static const sp_cfield_t info_f[] = {
    FLD(sp_cp_info_t, 1, "config", "config", SP_CK_MSG, config, HAS(sp_cp_info_t, has_config),
        &cd_config, NULL),
    FLD(sp_cp_info_t, 2, "pid", "pid", SP_CK_UINT32, pid, NOH, NULL, NULL),
    FLD(sp_cp_info_t, 3, "tag", "tag", SP_CK_STRING, tag, HAS(sp_cp_info_t, has_tag), NULL, NULL),
};
DESC(sp_cd_info, "ProcessInfo", sp_cp_info_t, info_f);

static const sp_cfield_t start_ev_f[] = {
    FLD(sp_cp_start_ev_t, 1, "pid", "pid", SP_CK_UINT32, pid, NOH, NULL, NULL),
};
static DESC(cd_start_ev, "StartEvent", sp_cp_start_ev_t, start_ev_f);

static const sp_cfield_t data_ev_f[] = {
    FLD(sp_cp_data_ev_t, 1, "stdout", "stdout", SP_CK_BYTES, out, HAS(sp_cp_data_ev_t, has_out),
        NULL, NULL),
    FLD(sp_cp_data_ev_t, 2, "stderr", "stderr", SP_CK_BYTES, err, HAS(sp_cp_data_ev_t, has_err),
        NULL, NULL),
    FLD(sp_cp_data_ev_t, 3, "pty", "pty", SP_CK_BYTES, pty, HAS(sp_cp_data_ev_t, has_pty), NULL,
        NULL),
};
static DESC(cd_data_ev, "DataEvent", sp_cp_data_ev_t, data_ev_f);

static const sp_cfield_t end_ev_f[] = {
    FLD(sp_cp_end_ev_t, 1, "exitCode", "exit_code", SP_CK_SINT32, exit_code, NOH, NULL, NULL),
    FLD(sp_cp_end_ev_t, 2, "exited", "exited", SP_CK_BOOL, exited, NOH, NULL, NULL),
    FLD(sp_cp_end_ev_t, 3, "status", "status", SP_CK_STRING, status, NOH, NULL, NULL),
    FLD(sp_cp_end_ev_t, 4, "error", "error", SP_CK_STRING, error, HAS(sp_cp_end_ev_t, has_error),
        NULL, NULL),
};
static DESC(cd_end_ev, "EndEvent", sp_cp_end_ev_t, end_ev_f);

static const sp_cfield_t event_f[] = {
    FLD(sp_cp_event_t, 1, "start", "start", SP_CK_MSG, start, HAS(sp_cp_event_t, has_start),
        &cd_start_ev, NULL),
    FLD(sp_cp_event_t, 2, "data", "data", SP_CK_MSG, data, HAS(sp_cp_event_t, has_data),
        &cd_data_ev, NULL),
    FLD(sp_cp_event_t, 3, "end", "end", SP_CK_MSG, end, HAS(sp_cp_event_t, has_end), &cd_end_ev,
        NULL),
    FLD(sp_cp_event_t, 4, "keepalive", "keepalive", SP_CK_MSG, keepalive,
        HAS(sp_cp_event_t, has_keepalive), &sp_cd_empty, NULL),
};
static DESC(cd_event, "ProcessEvent", sp_cp_event_t, event_f);

static const sp_cfield_t event_resp_f[] = {
    FLD(sp_cp_event_resp_t, 1, "event", "event", SP_CK_MSG, event,
        HAS(sp_cp_event_resp_t, has_event), &cd_event, NULL),
};
DESC(sp_cd_event_resp, "StartResponse", sp_cp_event_resp_t, event_resp_f);

static const sp_cfield_t list_resp_f[] = {
    REP(sp_cp_list_resp_t, 1, "processes", "processes", SP_CK_MSG, processes, n_processes,
        &sp_cd_info),
};
DESC(sp_cd_list_resp, "ListResponse", sp_cp_list_resp_t, list_resp_f);

static const sp_cfield_t start_req_f[] = {
    FLD(sp_cp_start_req_t, 1, "process", "process", SP_CK_MSG, process,
        HAS(sp_cp_start_req_t, has_process), &cd_config, NULL),
    FLD(sp_cp_start_req_t, 2, "pty", "pty", SP_CK_MSG, pty, HAS(sp_cp_start_req_t, has_pty),
        &cd_pty, NULL),
    FLD(sp_cp_start_req_t, 3, "tag", "tag", SP_CK_STRING, tag, HAS(sp_cp_start_req_t, has_tag),
        NULL, NULL),
    FLD(sp_cp_start_req_t, 4, "stdin", "stdin", SP_CK_BOOL, stdin_open,
        HAS(sp_cp_start_req_t, has_stdin), NULL, NULL),
};
DESC(sp_cd_start_req, "StartRequest", sp_cp_start_req_t, start_req_f);

static const sp_cfield_t select_req_f[] = {
    FLD(sp_cp_select_req_t, 1, "process", "process", SP_CK_MSG, process,
        HAS(sp_cp_select_req_t, has_process), &cd_selector, NULL),
};
DESC(sp_cd_select_req, "ConnectRequest", sp_cp_select_req_t, select_req_f);

static const sp_cfield_t update_req_f[] = {
    FLD(sp_cp_update_req_t, 1, "process", "process", SP_CK_MSG, process,
        HAS(sp_cp_update_req_t, has_process), &cd_selector, NULL),
    FLD(sp_cp_update_req_t, 2, "pty", "pty", SP_CK_MSG, pty, HAS(sp_cp_update_req_t, has_pty),
        &cd_pty, NULL),
};
DESC(sp_cd_update_req, "UpdateRequest", sp_cp_update_req_t, update_req_f);

static const sp_cfield_t send_input_f[] = {
    FLD(sp_cp_send_input_req_t, 1, "process", "process", SP_CK_MSG, process,
        HAS(sp_cp_send_input_req_t, has_process), &cd_selector, NULL),
    FLD(sp_cp_send_input_req_t, 2, "input", "input", SP_CK_MSG, input,
        HAS(sp_cp_send_input_req_t, has_input), &cd_input, NULL),
};
DESC(sp_cd_send_input_req, "SendInputRequest", sp_cp_send_input_req_t, send_input_f);

static const sp_cfield_t send_signal_f[] = {
    FLD(sp_cp_send_signal_req_t, 1, "process", "process", SP_CK_MSG, process,
        HAS(sp_cp_send_signal_req_t, has_process), &cd_selector, NULL),
    FLD(sp_cp_send_signal_req_t, 2, "signal", "signal", SP_CK_ENUM, signal, NOH, NULL,
        &signal_enum),
};
DESC(sp_cd_send_signal_req, "SendSignalRequest", sp_cp_send_signal_req_t, send_signal_f);

typedef struct {
    sp_cp_input_t input;
    bool has_input;
} si_data_t;
static const sp_cfield_t si_data_f[] = {
    FLD(si_data_t, 2, "input", "input", SP_CK_MSG, input, HAS(si_data_t, has_input), &cd_input,
        NULL),
};
static DESC(cd_si_data, "StreamInputRequest.DataEvent", si_data_t, si_data_f);

static const sp_cfield_t stream_input_f[] = {
    FLD(sp_cp_stream_input_req_t, 1, "start", "start", SP_CK_MSG, start,
        HAS(sp_cp_stream_input_req_t, has_start), &sp_cd_select_req, NULL),
    FLD(sp_cp_stream_input_req_t, 2, "data", "data", SP_CK_MSG, data,
        HAS(sp_cp_stream_input_req_t, has_data), &cd_si_data, NULL),
    FLD(sp_cp_stream_input_req_t, 3, "keepalive", "keepalive", SP_CK_MSG, keepalive,
        HAS(sp_cp_stream_input_req_t, has_keepalive), &sp_cd_empty, NULL),
};
DESC(sp_cd_stream_input_req, "StreamInputRequest", sp_cp_stream_input_req_t, stream_input_f);

static const sp_cfield_t entry_f[] = {
    FLD(sp_cf_entry_t, 1, "name", "name", SP_CK_STRING, name, NOH, NULL, NULL),
    FLD(sp_cf_entry_t, 2, "type", "type", SP_CK_ENUM, type, NOH, NULL, &ftype_enum),
    FLD(sp_cf_entry_t, 3, "path", "path", SP_CK_STRING, path, NOH, NULL, NULL),
    FLD(sp_cf_entry_t, 4, "size", "size", SP_CK_INT64, size, NOH, NULL, NULL),
    FLD(sp_cf_entry_t, 5, "mode", "mode", SP_CK_UINT32, mode, NOH, NULL, NULL),
    FLD(sp_cf_entry_t, 6, "permissions", "permissions", SP_CK_STRING, permissions, NOH, NULL, NULL),
    FLD(sp_cf_entry_t, 7, "owner", "owner", SP_CK_STRING, owner, NOH, NULL, NULL),
    FLD(sp_cf_entry_t, 8, "group", "group", SP_CK_STRING, group, NOH, NULL, NULL),
    FLD(sp_cf_entry_t, 9, "modifiedTime", "modified_time", SP_CK_TIME, modified_time,
        HAS(sp_cf_entry_t, has_modified_time), NULL, NULL),
    FLD(sp_cf_entry_t, 10, "symlinkTarget", "symlink_target", SP_CK_STRING, symlink_target,
        HAS(sp_cf_entry_t, has_symlink_target), NULL, NULL),
};
DESC(sp_cd_entry, "EntryInfo", sp_cf_entry_t, entry_f);

static const sp_cfield_t fsevent_f[] = {
    FLD(sp_cf_event_t, 1, "name", "name", SP_CK_STRING, name, NOH, NULL, NULL),
    FLD(sp_cf_event_t, 2, "type", "type", SP_CK_ENUM, type, NOH, NULL, &evtype_enum),
};
static DESC(cd_fsevent, "FilesystemEvent", sp_cf_event_t, fsevent_f);

static const sp_cfield_t path_req_f[] = {
    FLD(sp_cf_path_req_t, 1, "path", "path", SP_CK_STRING, path, NOH, NULL, NULL),
};
DESC(sp_cd_path_req, "StatRequest", sp_cf_path_req_t, path_req_f);

static const sp_cfield_t move_req_f[] = {
    FLD(sp_cf_move_req_t, 1, "source", "source", SP_CK_STRING, source, NOH, NULL, NULL),
    FLD(sp_cf_move_req_t, 2, "destination", "destination", SP_CK_STRING, destination, NOH, NULL,
        NULL),
};
DESC(sp_cd_move_req, "MoveRequest", sp_cf_move_req_t, move_req_f);

static const sp_cfield_t listdir_req_f[] = {
    FLD(sp_cf_listdir_req_t, 1, "path", "path", SP_CK_STRING, path, NOH, NULL, NULL),
    FLD(sp_cf_listdir_req_t, 2, "depth", "depth", SP_CK_UINT32, depth, NOH, NULL, NULL),
};
DESC(sp_cd_listdir_req, "ListDirRequest", sp_cf_listdir_req_t, listdir_req_f);

static const sp_cfield_t watch_req_f[] = {
    FLD(sp_cf_watch_req_t, 1, "path", "path", SP_CK_STRING, path, NOH, NULL, NULL),
    FLD(sp_cf_watch_req_t, 2, "recursive", "recursive", SP_CK_BOOL, recursive, NOH, NULL, NULL),
};
DESC(sp_cd_watch_req, "WatchDirRequest", sp_cf_watch_req_t, watch_req_f);

static const sp_cfield_t watcher_f[] = {
    FLD(sp_cf_watcher_t, 1, "watcherId", "watcher_id", SP_CK_STRING, watcher_id, NOH, NULL, NULL),
};
DESC(sp_cd_watcher, "WatcherId", sp_cf_watcher_t, watcher_f);

static const sp_cfield_t entry_resp_f[] = {
    FLD(sp_cf_entry_resp_t, 1, "entry", "entry", SP_CK_MSG, entry,
        HAS(sp_cf_entry_resp_t, has_entry), &sp_cd_entry, NULL),
};
DESC(sp_cd_entry_resp, "StatResponse", sp_cf_entry_resp_t, entry_resp_f);

static const sp_cfield_t listdir_resp_f[] = {
    REP(sp_cf_listdir_resp_t, 1, "entries", "entries", SP_CK_MSG, entries, n_entries, &sp_cd_entry),
};
DESC(sp_cd_listdir_resp, "ListDirResponse", sp_cf_listdir_resp_t, listdir_resp_f);

static const sp_cfield_t events_resp_f[] = {
    REP(sp_cf_events_resp_t, 1, "events", "events", SP_CK_MSG, events, n_events, &cd_fsevent),
};
DESC(sp_cd_events_resp, "GetWatcherEventsResponse", sp_cf_events_resp_t, events_resp_f);

static const sp_cfield_t watch_resp_f[] = {
    FLD(sp_cf_watch_resp_t, 1, "start", "start", SP_CK_MSG, start,
        HAS(sp_cf_watch_resp_t, has_start), &sp_cd_empty, NULL),
    FLD(sp_cf_watch_resp_t, 2, "filesystem", "filesystem", SP_CK_MSG, filesystem,
        HAS(sp_cf_watch_resp_t, has_filesystem), &cd_fsevent, NULL),
    FLD(sp_cf_watch_resp_t, 3, "keepalive", "keepalive", SP_CK_MSG, keepalive,
        HAS(sp_cf_watch_resp_t, has_keepalive), &sp_cd_empty, NULL),
};
DESC(sp_cd_watch_resp, "WatchDirResponse", sp_cf_watch_resp_t, watch_resp_f);

/* ---- base64 ---- */

static const char b64c[] = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";

size_t sp_connect_b64_encode(const uint8_t *in, size_t n, char *out)
{
    size_t o = 0, i = 0;
    for (; i + 3 <= n; i += 3) {
        uint32_t v = (uint32_t)in[i] << 16 | (uint32_t)in[i + 1] << 8 | in[i + 2];
        out[o++] = b64c[v >> 18];
        out[o++] = b64c[(v >> 12) & 63];
        out[o++] = b64c[(v >> 6) & 63];
        out[o++] = b64c[v & 63];
    }
    if (n - i == 1) {
        uint32_t v = (uint32_t)in[i] << 16;
        out[o++] = b64c[v >> 18];
        out[o++] = b64c[(v >> 12) & 63];
        out[o++] = '=';
        out[o++] = '=';
    } else if (n - i == 2) {
        uint32_t v = (uint32_t)in[i] << 16 | (uint32_t)in[i + 1] << 8;
        out[o++] = b64c[v >> 18];
        out[o++] = b64c[(v >> 12) & 63];
        out[o++] = b64c[(v >> 6) & 63];
        out[o++] = '=';
    }
    out[o] = '\0';
    return o;
}

static int b64v(char c)
{
    if (c >= 'A' && c <= 'Z')
        return c - 'A';
    if (c >= 'a' && c <= 'z')
        return c - 'a' + 26;
    if (c >= '0' && c <= '9')
        return c - '0' + 52;
    if (c == '+' || c == '-')
        return 62;
    if (c == '/' || c == '_')
        return 63;
    return -1;
}

long sp_connect_b64_decode(const char *in, size_t n, uint8_t *out)
{
    while (n > 0 && in[n - 1] == '=')
        n--;
    if (n % 4 == 1)
        return -1;
    size_t o = 0;
    uint32_t acc = 0;
    int bits = 0;
    for (size_t i = 0; i < n; i++) {
        int v = b64v(in[i]);
        if (v < 0)
            return -1;
        acc = (acc << 6) | (uint32_t)v;
        bits += 6;
        if (bits >= 8) {
            bits -= 8;
            out[o++] = (uint8_t)(acc >> bits);
        }
    }
    return (long)o;
}

/* ---- helpers ---- */

#define AT(msg, off, T)  ((T *)((char *)(msg) + (off)))
#define CAT(msg, off, T) ((const T *)((const char *)(msg) + (off)))

static size_t kind_size(const sp_cfield_t *f)
{
    switch (f->kind) {
    case SP_CK_STRING:
        return sizeof(char *);
    case SP_CK_BYTES:
        return sizeof(sp_cbytes_t);
    case SP_CK_MSG:
        return f->sub->size;
    case SP_CK_MAPSS:
        return sizeof(sp_ckv_t);
    case SP_CK_TIME:
        return sizeof(sp_ctime_t);
    default:
        return 8;
    }
}

static void set_has(const sp_cfield_t *f, void *msg)
{
    if (f->has_off != SP_CNO_HAS)
        *AT(msg, f->has_off, bool) = true;
}

/* Appends one zeroed element to a repeated field; NULL on memory exhaustion. */
static void *rep_push(const sp_cfield_t *f, void *msg, sp_carena_t *a)
{
    void **arr = AT(msg, f->off, void *);
    size_t *cnt = AT(msg, f->cnt_off, size_t);
    size_t es = kind_size(f);
    size_t n = *cnt;
    if ((n & (n - 1)) == 0) { /* 0, 1, 2, 4...: grow to the next power of two */
        size_t cap = n ? n * 2 : 1;
        void *nb = sp_carena_alloc(a, cap * es);
        if (nb == NULL)
            return NULL;
        if (n > 0)
            memcpy(nb, *arr, n * es);
        *arr = nb;
    }
    *cnt = n + 1;
    char *e = (char *)*arr + n * es;
    memset(e, 0, es);
    return e;
}

static char *arena_str(sp_carena_t *a, const char *p, size_t n, sp_err_t *err)
{
    if (memchr(p, '\0', n) != NULL) {
        sp_err_set(err, SP_EINVAL, "strings may not contain NUL characters");
        return NULL;
    }
    if (!sp_json_utf8_valid(p, n)) { /* JSON strings are; protobuf ones must be too (proto3) */
        sp_err_set(err, SP_EINVAL, "strings must be UTF-8");
        return NULL;
    }
    char *s = sp_carena_alloc(a, n + 1);
    if (s == NULL) {
        sp_err_set(err, SP_ETOOBIG, "message too large");
        return NULL;
    }
    memcpy(s, p, n);
    s[n] = '\0';
    return s;
}

static const char *enum_name(const sp_cenum_t *en, int32_t v)
{
    for (size_t i = 0; i < en->n; i++)
        if (en->vals[i].value == v)
            return en->vals[i].name;
    return NULL;
}

int sp_connect_parse_time(const char *s, sp_ctime_t *t)
{
    /* The exact shape first: sscanf alone would take signs and spaces ("+224-..."), which
     * fmt_time could not give back. */
    static const char shape[] = "dddd-dd-ddTdd:dd:dd";
    for (int i = 0; i < 19; i++)
        if (shape[i] == 'd' ? s[i] < '0' || s[i] > '9' : s[i] != shape[i])
            return -1;
    int Y, M, D, h, m, sec, n = 0;
    if (sscanf(s, "%4d-%2d-%2dT%2d:%2d:%2d%n", &Y, &M, &D, &h, &m, &sec, &n) != 6 || n != 19)
        return -1;
    if (M < 1 || M > 12 || D < 1 || D > 31 || h > 23 || m > 59 || sec > 60 || Y < 1)
        return -1;
    const char *p = s + 19;
    int32_t nanos = 0;
    if (*p == '.') {
        p++;
        int digits = 0;
        while (*p >= '0' && *p <= '9') {
            if (digits < 9) {
                nanos = nanos * 10 + (*p - '0');
                digits++;
            } else {
                return -1;
            }
            p++;
        }
        if (digits == 0)
            return -1;
        while (digits++ < 9)
            nanos *= 10;
    }
    long off = 0;
    if (*p == 'Z' || *p == 'z') {
        p++;
    } else if (*p == '+' || *p == '-') {
        int oh, om, k = 0;
        bool hhmm = p[1] >= '0' && p[1] <= '9' && p[2] >= '0' && p[2] <= '9' && p[3] == ':' &&
                    p[4] >= '0' && p[4] <= '9' && p[5] >= '0' && p[5] <= '9';
        if (!hhmm || sscanf(p + 1, "%2d:%2d%n", &oh, &om, &k) != 2 || k != 5 || oh > 23 || om > 59)
            return -1;
        off = (oh * 3600L + om * 60L) * (*p == '-' ? -1 : 1);
        p += 6;
    } else {
        return -1;
    }
    if (*p != '\0')
        return -1;
    struct tm tm = {.tm_year = Y - 1900,
                    .tm_mon = M - 1,
                    .tm_mday = D,
                    .tm_hour = h,
                    .tm_min = m,
                    .tm_sec = sec};
    t->seconds = (int64_t)timegm(&tm) - off;
    t->nanos = nanos;
    return 0;
}

/* Timestamp's range as protobuf defines it: 0001-01-01T00:00:00Z to 9999-12-31T23:59:59Z. */
#define TIME_MIN (-62135596800LL)
#define TIME_MAX 253402300799LL

/* RFC 3339 text that sp_connect_parse_time reads back: a time outside Timestamp's range is
 * written as the bound it passed, and the year always has four digits. */
static void fmt_time(const sp_ctime_t *t, char out[48])
{
    int64_t s = t->seconds < TIME_MIN ? TIME_MIN : t->seconds > TIME_MAX ? TIME_MAX : t->seconds;
    time_t secs = (time_t)s;
    struct tm tm;
    if (gmtime_r(&secs, &tm) == NULL)
        memset(&tm, 0, sizeof(tm));
    unsigned ns = t->nanos < 0 || t->nanos > 999999999 ? 0 : (unsigned)t->nanos;
    char frac[16] = "";
    if (ns != 0 && ns % 1000000 == 0)
        snprintf(frac, sizeof(frac), ".%03u", ns / 1000000 % 1000u);
    else if (ns != 0 && ns % 1000 == 0)
        snprintf(frac, sizeof(frac), ".%06u", ns / 1000 % 1000000u);
    else if (ns != 0)
        snprintf(frac, sizeof(frac), ".%09u", ns % 1000000000u);
    /* The modulos change nothing (the time is within Timestamp's range): they tell the
     * compiler how wide each field is. */
    snprintf(out, 48, "%04u-%02u-%02uT%02u:%02u:%02u%sZ", (unsigned)(tm.tm_year + 1900) % 10000u,
             (unsigned)(tm.tm_mon + 1) % 100u, (unsigned)tm.tm_mday % 100u,
             (unsigned)tm.tm_hour % 100u, (unsigned)tm.tm_min % 100u, (unsigned)tm.tm_sec % 100u,
             frac);
}

/* ---- JSON decode ---- */

static int jdec_msg(const sp_cdesc_t *d, json_t *o, void *msg, sp_carena_t *a, int depth,
                    sp_err_t *err);

static int jbad(sp_err_t *err, const sp_cdesc_t *d, const sp_cfield_t *f, const char *what)
{
    return sp_err_set(err, SP_EINVAL, "%s.%s: %s", d->name, f->json, what);
}

static int jdec_int(json_t *v, long long lo, long long hi, long long *out)
{
    if (json_is_integer(v)) {
        *out = json_integer_value(v);
    } else if (json_is_string(v)) {
        const char *s = json_string_value(v);
        char *end;
        if (s[0] == '\0')
            return -1;
        errno = 0;
        *out = strtoll(s, &end, 10);
        if (*end != '\0' || errno == ERANGE)
            return -1;
    } else if (json_is_real(v)) {
        /* In range before the cast (a double past long long's range, or NaN, is undefined
         * behaviour to convert): -2^63 <= x < 2^63. */
        double x = json_real_value(v);
        if (!(x >= -9223372036854775808.0 && x < 9223372036854775808.0) ||
            x != (double)(long long)x)
            return -1;
        *out = (long long)x;
    } else {
        return -1;
    }
    return *out < lo || *out > hi ? -1 : 0;
}

static int jdec_value(const sp_cdesc_t *d, const sp_cfield_t *f, json_t *v, void *dst,
                      sp_carena_t *a, int depth, sp_err_t *err)
{
    long long x;
    switch (f->kind) {
    case SP_CK_STRING:
        if (!json_is_string(v))
            return jbad(err, d, f, "must be a string");
        *(const char **)dst = arena_str(a, json_string_value(v), json_string_length(v), err);
        return *(const char **)dst ? 0 : -1;
    case SP_CK_BYTES: {
        if (!json_is_string(v))
            return jbad(err, d, f, "must be a base64 string");
        size_t n = json_string_length(v);
        uint8_t *b = sp_carena_alloc(a, 3 * (n / 4 + 1));
        if (b == NULL)
            return sp_err_set(err, SP_ETOOBIG, "message too large");
        long k = sp_connect_b64_decode(json_string_value(v), n, b);
        if (k < 0)
            return jbad(err, d, f, "is not valid base64");
        *(sp_cbytes_t *)dst = (sp_cbytes_t){b, (size_t)k};
        return 0;
    }
    case SP_CK_BOOL:
        if (!json_is_boolean(v))
            return jbad(err, d, f, "must be true or false");
        *(bool *)dst = json_is_true(v);
        return 0;
    case SP_CK_UINT32:
        if (jdec_int(v, 0, 0xffffffffLL, &x) < 0)
            return jbad(err, d, f, "must be an unsigned 32-bit integer");
        *(uint32_t *)dst = (uint32_t)x;
        return 0;
    case SP_CK_SINT32:
        if (jdec_int(v, -0x80000000LL, 0x7fffffffLL, &x) < 0)
            return jbad(err, d, f, "must be a 32-bit integer");
        *(int32_t *)dst = (int32_t)x;
        return 0;
    case SP_CK_INT64:
        if (jdec_int(v, INT64_MIN, INT64_MAX, &x) < 0)
            return jbad(err, d, f, "must be a 64-bit integer");
        *(int64_t *)dst = x;
        return 0;
    case SP_CK_ENUM:
        if (json_is_string(v)) {
            for (size_t i = 0; i < f->en->n; i++)
                if (strcmp(f->en->vals[i].name, json_string_value(v)) == 0) {
                    *(int32_t *)dst = f->en->vals[i].value;
                    return 0;
                }
            return jbad(err, d, f, "unknown enum value");
        }
        if (jdec_int(v, -0x80000000LL, 0x7fffffffLL, &x) < 0)
            return jbad(err, d, f, "must be an enum name or number");
        *(int32_t *)dst = (int32_t)x;
        return 0;
    case SP_CK_MSG:
        if (!json_is_object(v))
            return jbad(err, d, f, "must be an object");
        return jdec_msg(f->sub, v, dst, a, depth + 1, err);
    case SP_CK_TIME:
        if (!json_is_string(v) || sp_connect_parse_time(json_string_value(v), dst) < 0)
            return jbad(err, d, f, "must be an RFC 3339 timestamp");
        return 0;
    case SP_CK_MAPSS:
        return jbad(err, d, f, "internal: map value");
    }
    return jbad(err, d, f, "unknown kind");
}

static int jdec_msg(const sp_cdesc_t *d, json_t *o, void *msg, sp_carena_t *a, int depth,
                    sp_err_t *err)
{
    if (depth > SP_CONNECT_MAX_DEPTH)
        return sp_err_set(err, SP_EINVAL, "message nested too deeply");
    for (size_t i = 0; i < d->nfields; i++) {
        const sp_cfield_t *f = &d->fields[i];
        json_t *v = json_object_get(o, f->json);
        if (v == NULL)
            v = json_object_get(o, f->pname);
        if (v == NULL || json_is_null(v))
            continue;
        if (f->kind == SP_CK_MAPSS) {
            if (!json_is_object(v))
                return jbad(err, d, f, "must be an object of strings");
            const char *k;
            json_t *val;
            json_object_foreach(v, k, val)
            {
                if (!json_is_string(val))
                    return jbad(err, d, f, "values must be strings");
                sp_ckv_t *kv = rep_push(f, msg, a);
                if (kv == NULL)
                    return sp_err_set(err, SP_ETOOBIG, "message too large");
                if ((kv->key = arena_str(a, k, strlen(k), err)) == NULL ||
                    (kv->value = arena_str(a, json_string_value(val), json_string_length(val),
                                           err)) == NULL)
                    return -1;
            }
            continue;
        }
        if (f->repeated) {
            if (!json_is_array(v))
                return jbad(err, d, f, "must be an array");
            for (size_t k = 0; k < json_array_size(v); k++) {
                void *e = rep_push(f, msg, a);
                if (e == NULL)
                    return sp_err_set(err, SP_ETOOBIG, "message too large");
                if (jdec_value(d, f, json_array_get(v, k), e, a, depth, err) < 0)
                    return -1;
            }
            continue;
        }
        if (jdec_value(d, f, v, AT(msg, f->off, void), a, depth, err) < 0)
            return -1;
        set_has(f, msg);
    }
    return 0;
}

/* ---- JSON encode ---- */

static json_t *jenc_msg(const sp_cdesc_t *d, const void *msg);

static json_t *jenc_value(const sp_cfield_t *f, const void *src)
{
    switch (f->kind) {
    case SP_CK_STRING: {
        const char *s = *(const char *const *)src;
        return json_string(s ? s : "");
    }
    case SP_CK_BYTES: {
        const sp_cbytes_t *b = src;
        char *tmp = malloc(4 * (b->n / 3 + 1) + 1);
        if (tmp == NULL)
            return NULL;
        size_t n = sp_connect_b64_encode(b->p, b->n, tmp);
        json_t *s = json_stringn(tmp, n);
        free(tmp);
        return s;
    }
    case SP_CK_BOOL:
        return json_boolean(*(const bool *)src);
    case SP_CK_UINT32:
        return json_integer(*(const uint32_t *)src);
    case SP_CK_SINT32:
        return json_integer(*(const int32_t *)src);
    case SP_CK_INT64: {
        char b[24];
        snprintf(b, sizeof(b), "%lld", (long long)*(const int64_t *)src);
        return json_string(b);
    }
    case SP_CK_ENUM: {
        const char *n = enum_name(f->en, *(const int32_t *)src);
        return n ? json_string(n) : json_integer(*(const int32_t *)src);
    }
    case SP_CK_MSG:
        return jenc_msg(f->sub, src);
    case SP_CK_TIME: {
        char b[48];
        fmt_time(src, b);
        return json_string(b);
    }
    case SP_CK_MAPSS:
        return NULL;
    }
    return NULL;
}

static bool is_default(const sp_cfield_t *f, const void *src)
{
    switch (f->kind) {
    case SP_CK_STRING: {
        const char *s = *(const char *const *)src;
        return s == NULL || s[0] == '\0';
    }
    case SP_CK_BYTES:
        return ((const sp_cbytes_t *)src)->n == 0;
    case SP_CK_BOOL:
        return !*(const bool *)src;
    case SP_CK_UINT32:
        return *(const uint32_t *)src == 0;
    case SP_CK_SINT32:
    case SP_CK_ENUM:
        return *(const int32_t *)src == 0;
    case SP_CK_INT64:
        return *(const int64_t *)src == 0;
    case SP_CK_TIME:
        return ((const sp_ctime_t *)src)->seconds == 0 && ((const sp_ctime_t *)src)->nanos == 0;
    case SP_CK_MSG:
    case SP_CK_MAPSS:
        return true; /* sub-messages need a presence flag */
    }
    return true;
}

static bool present(const sp_cfield_t *f, const void *msg)
{
    if (f->has_off != SP_CNO_HAS)
        return *CAT(msg, f->has_off, bool);
    return !is_default(f, CAT(msg, f->off, void));
}

static json_t *jenc_msg(const sp_cdesc_t *d, const void *msg)
{
    json_t *o = json_object();
    if (o == NULL)
        return NULL;
    for (size_t i = 0; i < d->nfields; i++) {
        const sp_cfield_t *f = &d->fields[i];
        json_t *v = NULL;
        if (f->repeated) {
            size_t n = *CAT(msg, f->cnt_off, size_t);
            const char *arr = *CAT(msg, f->off, char *);
            if (n == 0)
                continue;
            if (f->kind == SP_CK_MAPSS) {
                v = json_object();
                for (size_t k = 0; v && k < n; k++) {
                    const sp_ckv_t *kv = (const sp_ckv_t *)arr + k;
                    if (kv->key != NULL)
                        json_object_set_new(v, kv->key, json_string(kv->value ? kv->value : ""));
                }
            } else {
                v = json_array();
                size_t es = kind_size(f);
                for (size_t k = 0; v && k < n; k++)
                    json_array_append_new(v, jenc_value(f, arr + k * es));
            }
        } else {
            if (!present(f, msg))
                continue;
            v = jenc_value(f, CAT(msg, f->off, void));
        }
        if (v == NULL) {
            json_decref(o);
            return NULL;
        }
        json_object_set_new(o, f->json, v);
    }
    return o;
}

/* ---- protobuf wire ---- */

enum { WT_VARINT = 0, WT_I64 = 1, WT_LEN = 2, WT_I32 = 5 };

static void pb_varint(sp_buf_t *b, uint64_t v)
{
    uint8_t t[10];
    size_t n = 0;
    do {
        t[n] = (uint8_t)(v & 0x7f);
        v >>= 7;
        if (v)
            t[n] |= 0x80;
        n++;
    } while (v);
    sp_buf_add(b, t, n);
}

static void pb_tag(sp_buf_t *b, uint32_t num, int wt)
{
    pb_varint(b, ((uint64_t)num << 3) | (uint64_t)wt);
}

static void pb_len(sp_buf_t *b, uint32_t num, const void *p, size_t n)
{
    pb_tag(b, num, WT_LEN);
    pb_varint(b, n);
    sp_buf_add(b, p, n);
}

static void penc_msg(const sp_cdesc_t *d, const void *msg, sp_buf_t *b);

static void penc_value(const sp_cfield_t *f, const void *src, sp_buf_t *b)
{
    switch (f->kind) {
    case SP_CK_STRING: {
        const char *s = *(const char *const *)src;
        pb_len(b, f->num, s ? s : "", s ? strlen(s) : 0);
        return;
    }
    case SP_CK_BYTES:
        pb_len(b, f->num, ((const sp_cbytes_t *)src)->p, ((const sp_cbytes_t *)src)->n);
        return;
    case SP_CK_BOOL:
        pb_tag(b, f->num, WT_VARINT);
        pb_varint(b, *(const bool *)src ? 1 : 0);
        return;
    case SP_CK_UINT32:
        pb_tag(b, f->num, WT_VARINT);
        pb_varint(b, *(const uint32_t *)src);
        return;
    case SP_CK_SINT32: {
        int32_t v = *(const int32_t *)src;
        pb_tag(b, f->num, WT_VARINT);
        pb_varint(b, (uint32_t)(((uint32_t)v << 1) ^ (uint32_t)(v >> 31)));
        return;
    }
    case SP_CK_ENUM: /* int32 semantics: negative values sign-extend to ten bytes */
        pb_tag(b, f->num, WT_VARINT);
        pb_varint(b, (uint64_t)(int64_t) * (const int32_t *)src);
        return;
    case SP_CK_INT64:
        pb_tag(b, f->num, WT_VARINT);
        pb_varint(b, (uint64_t) * (const int64_t *)src);
        return;
    case SP_CK_TIME: {
        const sp_ctime_t *t = src;
        sp_buf_t sub = {0};
        if (t->seconds != 0) {
            pb_tag(&sub, 1, WT_VARINT);
            pb_varint(&sub, (uint64_t)t->seconds);
        }
        if (t->nanos != 0) {
            pb_tag(&sub, 2, WT_VARINT);
            pb_varint(&sub, (uint64_t)(int64_t)t->nanos);
        }
        if (sub.oom)
            b->oom = true;
        pb_len(b, f->num, sub.p, sub.len);
        sp_buf_free(&sub);
        return;
    }
    case SP_CK_MSG: {
        sp_buf_t sub = {0};
        penc_msg(f->sub, src, &sub);
        if (sub.oom)
            b->oom = true;
        pb_len(b, f->num, sub.p, sub.len);
        sp_buf_free(&sub);
        return;
    }
    case SP_CK_MAPSS: {
        const sp_ckv_t *kv = src;
        sp_buf_t sub = {0};
        const char *k = kv->key ? kv->key : "", *v = kv->value ? kv->value : "";
        pb_len(&sub, 1, k, strlen(k));
        pb_len(&sub, 2, v, strlen(v));
        if (sub.oom)
            b->oom = true;
        pb_len(b, f->num, sub.p, sub.len);
        sp_buf_free(&sub);
        return;
    }
    }
}

static void penc_msg(const sp_cdesc_t *d, const void *msg, sp_buf_t *b)
{
    for (size_t i = 0; i < d->nfields; i++) {
        const sp_cfield_t *f = &d->fields[i];
        if (f->repeated) {
            size_t n = *CAT(msg, f->cnt_off, size_t);
            const char *arr = *CAT(msg, f->off, char *);
            size_t es = kind_size(f);
            for (size_t k = 0; k < n; k++)
                penc_value(f, arr + k * es, b);
        } else if (present(f, msg)) {
            penc_value(f, CAT(msg, f->off, void), b);
        }
    }
}

typedef struct {
    const uint8_t *p;
    size_t n, off;
} pbr_t;

static int pb_get_varint(pbr_t *r, uint64_t *v)
{
    uint64_t x = 0;
    for (int shift = 0; shift < 70; shift += 7) {
        if (r->off >= r->n)
            return -1;
        uint8_t c = r->p[r->off++];
        if (shift == 63 && (c & 0x7e))
            return -1; /* more than 64 bits */
        x |= (uint64_t)(c & 0x7f) << shift;
        if (!(c & 0x80)) {
            *v = x;
            return 0;
        }
    }
    return -1;
}

/* Skips one value of wire type wt; -1 when malformed (groups are refused). */
static int pb_skip(pbr_t *r, int wt)
{
    uint64_t v;
    switch (wt) {
    case WT_VARINT:
        return pb_get_varint(r, &v);
    case WT_I64:
        if (r->n - r->off < 8)
            return -1;
        r->off += 8;
        return 0;
    case WT_I32:
        if (r->n - r->off < 4)
            return -1;
        r->off += 4;
        return 0;
    case WT_LEN:
        if (pb_get_varint(r, &v) < 0 || v > r->n - r->off)
            return -1;
        r->off += (size_t)v;
        return 0;
    default:
        return -1;
    }
}

static int pdec_msg(const sp_cdesc_t *d, const uint8_t *p, size_t n, void *msg, sp_carena_t *a,
                    int depth, sp_err_t *err);

static int pbad(sp_err_t *err, const sp_cdesc_t *d, const sp_cfield_t *f, const char *what)
{
    return sp_err_set(err, SP_EINVAL, "%s.%s: %s", d->name, f->pname, what);
}

static int pdec_time(const uint8_t *p, size_t n, sp_ctime_t *t)
{
    pbr_t r = {p, n, 0};
    while (r.off < r.n) {
        uint64_t key, v;
        if (pb_get_varint(&r, &key) < 0)
            return -1;
        int wt = (int)(key & 7);
        if ((key >> 3) == 1 && wt == WT_VARINT) {
            if (pb_get_varint(&r, &v) < 0)
                return -1;
            t->seconds = (int64_t)v;
        } else if ((key >> 3) == 2 && wt == WT_VARINT) {
            if (pb_get_varint(&r, &v) < 0)
                return -1;
            t->nanos = (int32_t)v;
        } else if (pb_skip(&r, wt) < 0) {
            return -1;
        }
    }
    return 0;
}

static int pdec_kv(const uint8_t *p, size_t n, sp_ckv_t *kv, sp_carena_t *a, sp_err_t *err)
{
    pbr_t r = {p, n, 0};
    kv->key = kv->value = "";
    while (r.off < r.n) {
        uint64_t key, len;
        if (pb_get_varint(&r, &key) < 0)
            return -1;
        int wt = (int)(key & 7);
        uint64_t num = key >> 3;
        if ((num == 1 || num == 2) && wt == WT_LEN) {
            if (pb_get_varint(&r, &len) < 0 || len > r.n - r.off)
                return -1;
            char *s = arena_str(a, (const char *)r.p + r.off, (size_t)len, err);
            if (s == NULL)
                return -2;
            if (num == 1)
                kv->key = s;
            else
                kv->value = s;
            r.off += (size_t)len;
        } else if (pb_skip(&r, wt) < 0) {
            return -1;
        }
    }
    return 0;
}

static int pdec_field(const sp_cdesc_t *d, const sp_cfield_t *f, pbr_t *r, int wt, void *dst,
                      sp_carena_t *a, int depth, sp_err_t *err)
{
    uint64_t v;
    bool want_len = f->kind == SP_CK_STRING || f->kind == SP_CK_BYTES || f->kind == SP_CK_MSG ||
                    f->kind == SP_CK_TIME || f->kind == SP_CK_MAPSS;
    if (want_len ? wt != WT_LEN : wt != WT_VARINT)
        return pbad(err, d, f, "wrong wire type");
    if (pb_get_varint(r, &v) < 0)
        return pbad(err, d, f, "truncated");
    if (want_len && v > r->n - r->off)
        return pbad(err, d, f, "length past the end of the message");
    const uint8_t *p = r->p + r->off;
    size_t n = want_len ? (size_t)v : 0;
    if (want_len)
        r->off += n;
    switch (f->kind) {
    case SP_CK_STRING:
        *(const char **)dst = arena_str(a, (const char *)p, n, err);
        return *(const char **)dst ? 0 : -1;
    case SP_CK_BYTES: {
        uint8_t *b = sp_carena_alloc(a, n);
        if (b == NULL)
            return sp_err_set(err, SP_ETOOBIG, "message too large");
        memcpy(b, p, n);
        *(sp_cbytes_t *)dst = (sp_cbytes_t){b, n};
        return 0;
    }
    case SP_CK_BOOL:
        *(bool *)dst = v != 0;
        return 0;
    case SP_CK_UINT32:
        *(uint32_t *)dst = (uint32_t)v;
        return 0;
    case SP_CK_SINT32:
        *(int32_t *)dst = (int32_t)((uint32_t)(v >> 1) ^ (uint32_t) - (int32_t)(v & 1));
        return 0;
    case SP_CK_ENUM:
        *(int32_t *)dst = (int32_t)v;
        return 0;
    case SP_CK_INT64:
        *(int64_t *)dst = (int64_t)v;
        return 0;
    case SP_CK_TIME:
        return pdec_time(p, n, dst) < 0 ? pbad(err, d, f, "malformed timestamp") : 0;
    case SP_CK_MSG:
        return pdec_msg(f->sub, p, n, dst, a, depth + 1, err);
    case SP_CK_MAPSS: {
        int rc = pdec_kv(p, n, dst, a, err);
        return rc == -1 ? pbad(err, d, f, "malformed map entry") : rc < 0 ? -1 : 0;
    }
    }
    return pbad(err, d, f, "unknown kind");
}

static int pdec_msg(const sp_cdesc_t *d, const uint8_t *p, size_t n, void *msg, sp_carena_t *a,
                    int depth, sp_err_t *err)
{
    if (depth > SP_CONNECT_MAX_DEPTH)
        return sp_err_set(err, SP_EINVAL, "message nested too deeply");
    pbr_t r = {p, n, 0};
    while (r.off < r.n) {
        uint64_t key;
        if (pb_get_varint(&r, &key) < 0)
            return sp_err_set(err, SP_EINVAL, "%s: truncated field key", d->name);
        uint64_t num = key >> 3;
        int wt = (int)(key & 7);
        if (num == 0 || num > 0x1fffffff)
            return sp_err_set(err, SP_EINVAL, "%s: bad field number", d->name);
        const sp_cfield_t *f = NULL;
        for (size_t i = 0; i < d->nfields; i++)
            if (d->fields[i].num == num)
                f = &d->fields[i];
        if (f == NULL) {
            if (pb_skip(&r, wt) < 0)
                return sp_err_set(err, SP_EINVAL, "%s: malformed unknown field", d->name);
            continue;
        }
        void *dst;
        if (f->repeated || f->kind == SP_CK_MAPSS) {
            dst = rep_push(f, msg, a);
            if (dst == NULL)
                return sp_err_set(err, SP_ETOOBIG, "message too large");
        } else {
            dst = AT(msg, f->off, void);
            /* A repeated occurrence of a singular message merges in proto; we keep the last
             * whole value, which is what the clients we serve never rely on. */
            if (f->kind == SP_CK_MSG)
                memset(dst, 0, f->sub->size);
        }
        if (pdec_field(d, f, &r, wt, dst, a, depth, err) < 0)
            return -1;
        if (!f->repeated)
            set_has(f, msg);
    }
    return 0;
}

/* ---- codec entry points ---- */

int sp_connect_decode(sp_connect_codec_t codec, const sp_cdesc_t *d, const uint8_t *p, size_t n,
                      void *msg, sp_carena_t *a, sp_err_t *err)
{
    memset(msg, 0, d->size);
    if (codec == SP_CONNECT_PROTO)
        return pdec_msg(d, p, n, msg, a, 0, err);
    if (n == 0)
        return 0;
    json_error_t je;
    json_t *o = json_loadb((const char *)p, n, JSON_REJECT_DUPLICATES, &je);
    if (o == NULL)
        return sp_err_set(err, SP_EINVAL, "request is not valid JSON");
    int rc = 0;
    if (!json_is_object(o))
        rc = sp_err_set(err, SP_EINVAL, "request must be a JSON object");
    else
        rc = jdec_msg(d, o, msg, a, 0, err);
    json_decref(o);
    return rc;
}

int sp_connect_encode(sp_connect_codec_t codec, const sp_cdesc_t *d, const void *msg,
                      sp_buf_t *out)
{
    if (codec == SP_CONNECT_PROTO) {
        penc_msg(d, msg, out);
        return out->oom ? -1 : 0;
    }
    json_t *o = jenc_msg(d, msg);
    if (o == NULL)
        return -1;
    char *s = json_dumps(o, JSON_COMPACT);
    json_decref(o);
    if (s == NULL)
        return -1;
    sp_buf_add(out, s, strlen(s));
    free(s);
    return out->oom ? -1 : 0;
}

/* ---- envelopes ---- */

int sp_connect_envelope_next(const uint8_t *buf, size_t n, size_t *off, uint8_t *flags,
                             const uint8_t **payload, size_t *len, sp_err_t *err)
{
    if (*off >= n)
        return 0;
    if (n - *off < SP_CONNECT_ENV_HDR)
        return sp_err_set(err, SP_EINVAL, "truncated envelope header");
    const uint8_t *h = buf + *off;
    uint32_t l = (uint32_t)h[1] << 24 | (uint32_t)h[2] << 16 | (uint32_t)h[3] << 8 | h[4];
    if (h[0] & SP_CONNECT_FLAG_COMPRESSED)
        return sp_err_set(err, SP_EINVAL, "compressed envelopes are not supported");
    if (l > n - *off - SP_CONNECT_ENV_HDR)
        return sp_err_set(err, SP_EINVAL, "envelope length runs past the body");
    *flags = h[0];
    *payload = h + SP_CONNECT_ENV_HDR;
    *len = l;
    *off += SP_CONNECT_ENV_HDR + l;
    return 1;
}

void sp_connect_envelope_add(sp_buf_t *out, uint8_t flags, const void *p, size_t n)
{
    uint8_t h[SP_CONNECT_ENV_HDR] = {flags, (uint8_t)(n >> 24), (uint8_t)(n >> 16),
                                     (uint8_t)(n >> 8), (uint8_t)n};
    sp_buf_add(out, h, sizeof(h));
    sp_buf_add(out, p, n);
}

/* ---- error codes ---- */

static const struct {
    const char *name;
    int http;
} codes[] = {
    [SP_CC_OK] = {"ok", 200},
    [SP_CC_CANCELED] = {"canceled", 499},
    [SP_CC_UNKNOWN] = {"unknown", 500},
    [SP_CC_INVALID_ARGUMENT] = {"invalid_argument", 400},
    [SP_CC_DEADLINE_EXCEEDED] = {"deadline_exceeded", 504},
    [SP_CC_NOT_FOUND] = {"not_found", 404},
    [SP_CC_ALREADY_EXISTS] = {"already_exists", 409},
    [SP_CC_PERMISSION_DENIED] = {"permission_denied", 403},
    [SP_CC_RESOURCE_EXHAUSTED] = {"resource_exhausted", 429},
    [SP_CC_FAILED_PRECONDITION] = {"failed_precondition", 400},
    [SP_CC_ABORTED] = {"aborted", 409},
    [SP_CC_OUT_OF_RANGE] = {"out_of_range", 400},
    [SP_CC_UNIMPLEMENTED] = {"unimplemented", 501},
    [SP_CC_INTERNAL] = {"internal", 500},
    [SP_CC_UNAVAILABLE] = {"unavailable", 503},
    [SP_CC_DATA_LOSS] = {"data_loss", 500},
    [SP_CC_UNAUTHENTICATED] = {"unauthenticated", 401},
};

const char *sp_connect_code_name(sp_connect_code_t c)
{
    return (unsigned)c <= SP_CC_UNAUTHENTICATED ? codes[c].name : "unknown";
}

int sp_connect_code_http(sp_connect_code_t c)
{
    return (unsigned)c <= SP_CC_UNAUTHENTICATED ? codes[c].http : 500;
}

sp_connect_code_t sp_connect_code_from(sp_code_t c)
{
    switch (c) {
    case SP_OK:
        return SP_CC_OK;
    case SP_EINVAL:
        return SP_CC_INVALID_ARGUMENT;
    case SP_EAUTH:
        return SP_CC_UNAUTHENTICATED;
    case SP_ENOTFOUND:
        return SP_CC_NOT_FOUND;
    case SP_ECONFLICT:
        return SP_CC_ALREADY_EXISTS;
    case SP_ETOOBIG:
    case SP_EQUOTA:
        return SP_CC_RESOURCE_EXHAUSTED;
    case SP_EUNAVAIL:
    case SP_ERUNTIME:
    case SP_ECAPACITY:
        return SP_CC_UNAVAILABLE;
    case SP_EFORBIDDEN:
        return SP_CC_PERMISSION_DENIED;
    case SP_ENOTSUP:
        return SP_CC_UNIMPLEMENTED;
    case SP_EINTERNAL:
        return SP_CC_INTERNAL;
    }
    return SP_CC_UNKNOWN;
}

/* ---- requests ---- */

static bool ct_is(const char *ct, const char *want)
{
    size_t n = strlen(want);
    if (strncasecmp(ct, want, n) != 0)
        return false;
    return ct[n] == '\0' || ct[n] == ';' || ct[n] == ' ';
}

int sp_connect_content_type(const char *ct, sp_connect_req_t *out)
{
    if (ct == NULL)
        return -1;
    if (ct_is(ct, "application/json")) {
        out->codec = SP_CONNECT_JSON;
        out->streaming = false;
    } else if (ct_is(ct, "application/proto")) {
        out->codec = SP_CONNECT_PROTO;
        out->streaming = false;
    } else if (ct_is(ct, "application/connect+json")) {
        out->codec = SP_CONNECT_JSON;
        out->streaming = true;
    } else if (ct_is(ct, "application/connect+proto")) {
        out->codec = SP_CONNECT_PROTO;
        out->streaming = true;
    } else {
        return -1;
    }
    return 0;
}

static int parse_uint(const char *v, int maxdigits, uint64_t *out)
{
    if (v == NULL || v[0] == '\0' || (int)strlen(v) > maxdigits)
        return -1;
    uint64_t x = 0;
    for (const char *p = v; *p; p++) {
        if (*p < '0' || *p > '9')
            return -1;
        x = x * 10 + (uint64_t)(*p - '0');
    }
    *out = x;
    return 0;
}

int sp_connect_parse_timeout(const char *v, uint32_t *ms)
{
    uint64_t x;
    if (parse_uint(v, 10, &x) < 0)
        return -1;
    *ms = x > 0xffffffffu ? 0xffffffffu : (uint32_t)x;
    if (*ms == 0)
        *ms = 1; /* 0 means already expired, never "no limit" */
    return 0;
}

int sp_connect_parse_keepalive(const char *v, uint32_t *s)
{
    uint64_t x;
    if (parse_uint(v, 9, &x) < 0 || x == 0)
        return -1;
    *s = (uint32_t)x;
    return 0;
}

int sp_connect_decode_body(const sp_connect_req_t *cr, const sp_cdesc_t *d, const uint8_t *body,
                           size_t n, void *msg, sp_carena_t *a, sp_err_t *err)
{
    if (!cr->streaming)
        return sp_connect_decode(cr->codec, d, body, n, msg, a, err);
    size_t off = 0;
    uint8_t flags = 0;
    const uint8_t *p = NULL;
    size_t len = 0;
    int rc = sp_connect_envelope_next(body, n, &off, &flags, &p, &len, err);
    if (rc < 0)
        return -1;
    if (rc == 0 || (flags & SP_CONNECT_FLAG_END))
        return sp_err_set(err, SP_EINVAL, "the request stream holds no message");
    return sp_connect_decode(cr->codec, d, p, len, msg, a, err);
}
