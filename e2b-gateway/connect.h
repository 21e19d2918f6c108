/*
 * connect.h - the Connect protocol as envd speaks it (spec 3.1), the part that is bytes in and
 * bytes out: request classification, envelopes, error codes, and both codecs (JSON and binary
 * protobuf) for exactly the process.Process and filesystem.Filesystem messages (spec 3.3,
 * 3.4). connectrpc.h puts it on h2o (reading requests, replies, streams).
 *
 * A message is one C struct shared by both codecs, described by a table (sp_cdesc_t) that
 * both codecs walk: the handlers never see which codec arrived. Decoded strings, bytes and
 * repeated fields live in an arena the caller frees in one go. Strings are NUL-terminated
 * (a string carrying a NUL is rejected as invalid_argument).
 *
 * Presence: every field with a `has_` flag is emitted when the flag is set (oneof members,
 * proto3 `optional`, sub-messages), others when they differ from their default.
 *
 * No I/O and no h2o, so the codecs can be tested and fuzzed alone.
 */
#ifndef SP_CONNECT_H
#define SP_CONNECT_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "base/buf.h"
#include "base/err.h"

/* ---- buffers and arenas ---- */

/* Encoded messages and envelopes are built in base/buf.h's sp_buf_t. sp_cbuf_t is its old
 * name here, kept (with the two calls) for the envd handlers that still use it. */
typedef sp_buf_t sp_cbuf_t;

static inline void sp_cbuf_add(sp_cbuf_t *b, const void *p, size_t n)
{
    sp_buf_add(b, p, n);
}

static inline void sp_cbuf_free(sp_cbuf_t *b)
{
    sp_buf_free(b);
}

typedef struct sp_carena_chunk sp_carena_chunk_t;
typedef struct {
    sp_carena_chunk_t *head;
    size_t used; /* bytes handed out, bounded by SP_CONNECT_ARENA_MAX */
} sp_carena_t;

#define SP_CONNECT_ARENA_MAX (64u * 1024 * 1024)

/* Zeroed memory that lives until sp_carena_free; NULL when out of memory or over the bound. */
void *sp_carena_alloc(sp_carena_t *a, size_t n);
void sp_carena_free(sp_carena_t *a);

/* ---- messages ---- */

typedef struct {
    const uint8_t *p;
    size_t n;
} sp_cbytes_t;

typedef struct {
    const char *key;
    const char *value;
} sp_ckv_t;

typedef struct {
    int64_t seconds;
    int32_t nanos;
} sp_ctime_t;

/* t from RFC 3339 text with Z or an offset and up to 9 fractional digits (the JSON codec's
 * Timestamp, and the agent's file times). -1 for anything else. */
int sp_connect_parse_time(const char *s, sp_ctime_t *t);

typedef struct {
    char unused_;
} sp_cempty_t;

/* process.Process */
typedef struct {
    const char *cmd;
    const char **args;
    size_t n_args;
    sp_ckv_t *envs;
    size_t n_envs;
    const char *cwd;
    bool has_cwd;
} sp_cp_config_t;

typedef struct {
    uint32_t cols, rows;
} sp_cp_size_t;

typedef struct {
    sp_cp_size_t size;
    bool has_size;
} sp_cp_pty_t;

typedef struct {
    uint32_t pid;
    bool has_pid;
    const char *tag;
    bool has_tag;
} sp_cp_selector_t;

typedef struct {
    sp_cbytes_t stdin_data;
    bool has_stdin;
    sp_cbytes_t pty;
    bool has_pty;
} sp_cp_input_t;

typedef struct {
    sp_cp_config_t config;
    bool has_config;
    uint32_t pid;
    const char *tag;
    bool has_tag;
} sp_cp_info_t;

typedef struct {
    uint32_t pid;
} sp_cp_start_ev_t;

typedef struct {
    sp_cbytes_t out, err, pty;
    bool has_out, has_err, has_pty;
} sp_cp_data_ev_t;

typedef struct {
    int32_t exit_code;
    bool exited;
    const char *status;
    const char *error;
    bool has_error;
} sp_cp_end_ev_t;

typedef struct {
    sp_cp_start_ev_t start;
    bool has_start;
    sp_cp_data_ev_t data;
    bool has_data;
    sp_cp_end_ev_t end;
    bool has_end;
    sp_cempty_t keepalive;
    bool has_keepalive;
} sp_cp_event_t;

/* StartResponse and ConnectResponse. */
typedef struct {
    sp_cp_event_t event;
    bool has_event;
} sp_cp_event_resp_t;

typedef struct {
    sp_cp_info_t *processes;
    size_t n_processes;
} sp_cp_list_resp_t;

typedef struct {
    sp_cp_config_t process;
    bool has_process;
    sp_cp_pty_t pty;
    bool has_pty;
    const char *tag;
    bool has_tag;
    bool stdin_open;
    bool has_stdin;
} sp_cp_start_req_t;

/* ConnectRequest and CloseStdinRequest. */
typedef struct {
    sp_cp_selector_t process;
    bool has_process;
} sp_cp_select_req_t;

typedef struct {
    sp_cp_selector_t process;
    bool has_process;
    sp_cp_pty_t pty;
    bool has_pty;
} sp_cp_update_req_t;

typedef struct {
    sp_cp_selector_t process;
    bool has_process;
    sp_cp_input_t input;
    bool has_input;
} sp_cp_send_input_req_t;

enum { SP_CP_SIGNAL_UNSPECIFIED = 0, SP_CP_SIGNAL_SIGKILL = 9, SP_CP_SIGNAL_SIGTERM = 15 };

typedef struct {
    sp_cp_selector_t process;
    bool has_process;
    int32_t signal;
} sp_cp_send_signal_req_t;

typedef struct {
    sp_cp_select_req_t start;
    bool has_start;
    struct {
        sp_cp_input_t input;
        bool has_input;
    } data;
    bool has_data;
    sp_cempty_t keepalive;
    bool has_keepalive;
} sp_cp_stream_input_req_t;

/* filesystem.Filesystem */
enum { SP_CF_TYPE_UNSPECIFIED = 0, SP_CF_TYPE_FILE = 1, SP_CF_TYPE_DIRECTORY = 2 };
enum {
    SP_CF_EV_UNSPECIFIED = 0,
    SP_CF_EV_CREATE = 1,
    SP_CF_EV_WRITE = 2,
    SP_CF_EV_REMOVE = 3,
    SP_CF_EV_RENAME = 4,
    SP_CF_EV_CHMOD = 5,
};

typedef struct {
    const char *name;
    int32_t type;
    const char *path;
    int64_t size;
    uint32_t mode;
    const char *permissions;
    const char *owner;
    const char *group;
    sp_ctime_t modified_time;
    bool has_modified_time;
    const char *symlink_target;
    bool has_symlink_target;
} sp_cf_entry_t;

typedef struct {
    const char *name;
    int32_t type;
} sp_cf_event_t;

/* Stat, MakeDir, Remove requests. */
typedef struct {
    const char *path;
} sp_cf_path_req_t;

typedef struct {
    const char *source;
    const char *destination;
} sp_cf_move_req_t;

typedef struct {
    const char *path;
    uint32_t depth;
} sp_cf_listdir_req_t;

/* WatchDir and CreateWatcher requests. */
typedef struct {
    const char *path;
    bool recursive;
} sp_cf_watch_req_t;

/* CreateWatcher response, GetWatcherEvents and RemoveWatcher requests. */
typedef struct {
    const char *watcher_id;
} sp_cf_watcher_t;

/* Stat, MakeDir and Move responses. */
typedef struct {
    sp_cf_entry_t entry;
    bool has_entry;
} sp_cf_entry_resp_t;

typedef struct {
    sp_cf_entry_t *entries;
    size_t n_entries;
} sp_cf_listdir_resp_t;

typedef struct {
    sp_cf_event_t *events;
    size_t n_events;
} sp_cf_events_resp_t;

typedef struct {
    sp_cempty_t start;
    bool has_start;
    sp_cf_event_t filesystem;
    bool has_filesystem;
    sp_cempty_t keepalive;
    bool has_keepalive;
} sp_cf_watch_resp_t;

/* ---- message descriptors ---- */

typedef enum {
    SP_CK_STRING = 0,
    SP_CK_BYTES,
    SP_CK_BOOL,
    SP_CK_UINT32,
    SP_CK_SINT32,
    SP_CK_INT64,
    SP_CK_ENUM,
    SP_CK_MSG,
    SP_CK_TIME,  /* google.protobuf.Timestamp as sp_ctime_t */
    SP_CK_MAPSS, /* map<string,string> as sp_ckv_t[] (always repeated) */
} sp_ckind_t;

typedef struct {
    const char *name;
    int32_t value;
} sp_cenum_val_t;

typedef struct {
    const sp_cenum_val_t *vals;
    size_t n;
} sp_cenum_t;

typedef struct sp_cdesc sp_cdesc_t;

#define SP_CNO_HAS ((size_t)-1)

typedef struct {
    uint32_t num;
    const char *json;  /* lowerCamelCase */
    const char *pname; /* proto field name, also accepted on input */
    sp_ckind_t kind;
    bool repeated; /* value at off is a pointer to elements, count (size_t) at cnt_off */
    size_t off;
    size_t cnt_off;
    size_t has_off; /* bool presence flag, or SP_CNO_HAS */
    const sp_cdesc_t *sub;
    const sp_cenum_t *en;
} sp_cfield_t;

struct sp_cdesc {
    const char *name;
    size_t size;
    const sp_cfield_t *fields;
    size_t nfields;
};

extern const sp_cdesc_t sp_cd_empty;
extern const sp_cdesc_t sp_cd_start_req, sp_cd_select_req, sp_cd_update_req, sp_cd_send_input_req,
    sp_cd_send_signal_req, sp_cd_stream_input_req, sp_cd_event_resp, sp_cd_list_resp, sp_cd_info;
extern const sp_cdesc_t sp_cd_path_req, sp_cd_move_req, sp_cd_listdir_req, sp_cd_watch_req,
    sp_cd_watcher, sp_cd_entry_resp, sp_cd_listdir_resp, sp_cd_events_resp, sp_cd_watch_resp,
    sp_cd_entry;

/* ---- codecs ---- */

typedef enum { SP_CONNECT_JSON = 0, SP_CONNECT_PROTO } sp_connect_codec_t;

#define SP_CONNECT_MAX_DEPTH 32 /* nested messages, both codecs */

/* Decodes p[0..n) into msg (d->size bytes, zeroed first); allocations in a. -1 with err
 * (SP_EINVAL) on malformed input. JSON: unknown keys ignored, camelCase or proto names,
 * int64 as string or number, enums as name or number, base64 standard or URL-safe. Proto:
 * unknown fields skipped. An empty body is the empty message in both codecs. */
int sp_connect_decode(sp_connect_codec_t codec, const sp_cdesc_t *d, const uint8_t *p, size_t n,
                      void *msg, sp_carena_t *a, sp_err_t *err);

/* Appends the encoding of msg to out. -1 when memory ran out. JSON: compact, camelCase,
 * bytes base64 with padding, enums by name, int64 as strings, timestamps RFC 3339. */
int sp_connect_encode(sp_connect_codec_t codec, const sp_cdesc_t *d, const void *msg,
                      sp_buf_t *out);

/* Base64 (standard alphabet, padded); decode also takes URL-safe and missing padding, and
 * skips nothing else. Decode returns the length or -1; out needs 3 * (n / 4 + 1) bytes. */
size_t sp_connect_b64_encode(const uint8_t *in, size_t n, char *out);
long sp_connect_b64_decode(const char *in, size_t n, uint8_t *out);

/* ---- envelopes ---- */

enum { SP_CONNECT_FLAG_COMPRESSED = 0x01, SP_CONNECT_FLAG_END = 0x02 };
#define SP_CONNECT_ENV_HDR 5

/* Next envelope of buf[*off..n): 1 with flags/payload, 0 at the end, -1 with err when
 * truncated, a length runs past the body, or the compressed flag is set. */
int sp_connect_envelope_next(const uint8_t *buf, size_t n, size_t *off, uint8_t *flags,
                             const uint8_t **payload, size_t *len, sp_err_t *err);
/* Appends one envelope. */
void sp_connect_envelope_add(sp_buf_t *out, uint8_t flags, const void *p, size_t n);

/* ---- error codes ---- */

typedef enum {
    SP_CC_OK = 0,
    SP_CC_CANCELED,
    SP_CC_UNKNOWN,
    SP_CC_INVALID_ARGUMENT,
    SP_CC_DEADLINE_EXCEEDED,
    SP_CC_NOT_FOUND,
    SP_CC_ALREADY_EXISTS,
    SP_CC_PERMISSION_DENIED,
    SP_CC_RESOURCE_EXHAUSTED,
    SP_CC_FAILED_PRECONDITION,
    SP_CC_ABORTED,
    SP_CC_OUT_OF_RANGE,
    SP_CC_UNIMPLEMENTED,
    SP_CC_INTERNAL,
    SP_CC_UNAVAILABLE,
    SP_CC_DATA_LOSS,
    SP_CC_UNAUTHENTICATED,
} sp_connect_code_t;

const char *sp_connect_code_name(sp_connect_code_t c);
/* HTTP status of a unary error with this code. */
int sp_connect_code_http(sp_connect_code_t c);
/* Our error codes as Connect codes (conflict -> already_exists). */
sp_connect_code_t sp_connect_code_from(sp_code_t c);

/* ---- requests ---- */

typedef struct {
    sp_connect_codec_t codec;
    bool streaming;       /* application/connect+json|proto */
    uint32_t timeout_ms;  /* connect-timeout-ms; 0: none */
    uint32_t keepalive_s; /* Keepalive-Ping-Interval; SP_CONNECT_KEEPALIVE_DEFAULT_S if absent */
} sp_connect_req_t;

#define SP_CONNECT_KEEPALIVE_DEFAULT_S 90

/* Content type -> codec and kind. -1 when it is none of the four Connect types. */
int sp_connect_content_type(const char *ct, sp_connect_req_t *out);
/* connect-timeout-ms: 1..10 ASCII digits (the protocol's bound); -1 otherwise. */
int sp_connect_parse_timeout(const char *v, uint32_t *ms);
/* Keepalive-Ping-Interval seconds: a positive integer; -1 otherwise. */
int sp_connect_parse_keepalive(const char *v, uint32_t *s);

/* The request message in body[0..n) (NULL when n is 0): for unary the whole body, for
 * streaming the single envelope it holds (what follows it is ignored). Decoded with cr's codec
 * into msg, as sp_connect_decode. */
int sp_connect_decode_body(const sp_connect_req_t *cr, const sp_cdesc_t *d, const uint8_t *body,
                           size_t n, void *msg, sp_carena_t *a, sp_err_t *err);

#endif
