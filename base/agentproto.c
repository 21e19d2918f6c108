/*
 * agentproto.c - frame and field codec for the host <-> space-agent protocol.
 *
 * Pure functions over caller buffers: no I/O, no allocation, no globals.
 * Everything that comes from the wire is bounds-checked here before a
 * caller sees it; the layout is documented in agentproto.h.
 */
#include "base/agentproto.h"

#include <string.h>

static void put_le16(uint8_t *p, uint16_t v)
{
    p[0] = (uint8_t)v;
    p[1] = (uint8_t)(v >> 8);
}

static void put_le32(uint8_t *p, uint32_t v)
{
    for (int i = 0; i < 4; i++)
        p[i] = (uint8_t)(v >> (8 * i));
}

static void put_le64(uint8_t *p, uint64_t v)
{
    for (int i = 0; i < 8; i++)
        p[i] = (uint8_t)(v >> (8 * i));
}

static uint16_t get_le16(const uint8_t *p)
{
    return (uint16_t)(p[0] | (p[1] << 8));
}

static uint32_t get_le32(const uint8_t *p)
{
    return (uint32_t)p[0] | ((uint32_t)p[1] << 8) | ((uint32_t)p[2] << 16) |
           ((uint32_t)p[3] << 24);
}

static uint64_t get_le64(const uint8_t *p)
{
    return (uint64_t)get_le32(p) | ((uint64_t)get_le32(p + 4) << 32);
}

/* ---- header ---- */

void sp_ap_hdr_encode(uint8_t out[SP_AP_HDR_SIZE], const sp_ap_hdr_t *h)
{
    put_le32(out, h->len);
    put_le32(out + 4, h->stream);
    put_le16(out + 8, h->type);
    put_le16(out + 10, h->flags);
}

void sp_ap_hdr_decode(const uint8_t in[SP_AP_HDR_SIZE], sp_ap_hdr_t *h)
{
    h->len = get_le32(in);
    h->stream = get_le32(in + 4);
    h->type = get_le16(in + 8);
    h->flags = get_le16(in + 10);
}

int sp_ap_hdr_check(const sp_ap_hdr_t *h, sp_err_t *err)
{
    if (h->len > SP_AP_MAX_PAYLOAD)
        return sp_err_set(err, SP_ETOOBIG, "frame payload %u exceeds %u", h->len,
                          SP_AP_MAX_PAYLOAD);
    if (h->flags & ~SP_AP_F_KNOWN)
        return sp_err_set(err, SP_EINVAL, "reserved frame flags 0x%x", h->flags);
    return 0;
}

static const struct {
    uint16_t type;
    const char *name;
    uint8_t from_host; /* 1: the host may send it */
    uint8_t opens;     /* 1: opens a stream */
} types[] = {
    {SP_AP_T_HELLO, "hello", 1, 0},
    {SP_AP_T_PING, "ping", 1, 0},
    {SP_AP_T_PONG, "pong", 0, 0},
    {SP_AP_T_OK, "ok", 0, 0},
    {SP_AP_T_ERROR, "error", 0, 0},
    {SP_AP_T_WINDOW, "window", 1, 0},
    {SP_AP_T_RESET, "reset", 1, 0},
    {SP_AP_T_DATA, "data", 1, 0},
    {SP_AP_T_EOF, "eof", 1, 0},
    {SP_AP_T_IDENTITY, "identity", 1, 1},
    {SP_AP_T_PROC_START, "proc_start", 1, 1},
    {SP_AP_T_PROC_STARTED, "proc_started", 0, 0},
    {SP_AP_T_PROC_STDOUT, "proc_stdout", 0, 0},
    {SP_AP_T_PROC_STDERR, "proc_stderr", 0, 0},
    {SP_AP_T_PROC_EXIT, "proc_exit", 0, 0},
    {SP_AP_T_PROC_SIGNAL, "proc_signal", 1, 0},
    {SP_AP_T_PROC_RESIZE, "proc_resize", 1, 0},
    {SP_AP_T_PROC_ATTACH, "proc_attach", 1, 1},
    {SP_AP_T_PROC_LIST, "proc_list", 1, 1},
    {SP_AP_T_PROC_INFO, "proc_info", 0, 0},
    {SP_AP_T_FS_STAT, "fs_stat", 1, 1},
    {SP_AP_T_FS_READ, "fs_read", 1, 1},
    {SP_AP_T_FS_WRITE, "fs_write", 1, 1},
    {SP_AP_T_FS_LIST, "fs_list", 1, 1},
    {SP_AP_T_FS_MKDIR, "fs_mkdir", 1, 1},
    {SP_AP_T_FS_MOVE, "fs_move", 1, 1},
    {SP_AP_T_FS_REMOVE, "fs_remove", 1, 1},
    {SP_AP_T_FS_CHMOD, "fs_chmod", 1, 1},
    {SP_AP_T_FS_CHOWN, "fs_chown", 1, 1},
    {SP_AP_T_FS_ENTRY, "fs_entry", 0, 0},
    {SP_AP_T_WATCH_START, "watch_start", 1, 1},
    {SP_AP_T_WATCH_STARTED, "watch_started", 0, 0},
    {SP_AP_T_WATCH_EVENT, "watch_event", 0, 0},
    {SP_AP_T_TCP_CONNECT, "tcp_connect", 1, 1},
    {SP_AP_T_TCP_CONNECTED, "tcp_connected", 0, 0},
    {SP_AP_T_EGRESS_CONFIG, "egress_config", 1, 1},
    {SP_AP_T_EGRESS_OPEN, "egress_open", 0, 1},
    {SP_AP_T_DNS_QUERY, "dns_query", 0, 1},
    {SP_AP_T_DNS_ANSWER, "dns_answer", 0, 0},
};

static int type_index(uint16_t type)
{
    for (size_t i = 0; i < sizeof(types) / sizeof(types[0]); i++)
        if (types[i].type == type)
            return (int)i;
    return -1;
}

bool sp_ap_type_known(uint16_t type)
{
    return type_index(type) >= 0;
}

const char *sp_ap_type_name(uint16_t type)
{
    int i = type_index(type);
    return i < 0 ? "unknown" : types[i].name;
}

bool sp_ap_type_opens(uint16_t type)
{
    int i = type_index(type);
    return i >= 0 && types[i].opens;
}

static bool control_type(uint16_t type)
{
    return type == SP_AP_T_HELLO || type == SP_AP_T_PING || type == SP_AP_T_PONG ||
           type == SP_AP_T_ERROR;
}

/* Frames that end a stream; on streams the agent opened, the host sends them. */
static bool ends_agent_stream(uint16_t type)
{
    return type == SP_AP_T_OK || type == SP_AP_T_ERROR || type == SP_AP_T_DNS_ANSWER;
}

int sp_ap_check_from_host(uint16_t type, uint32_t stream, uint32_t *code)
{
    int i = type_index(type);
    if (stream >= SP_AP_STREAM_AGENT_BASE && ends_agent_stream(type))
        return 0; /* roles are mirrored on agent-opened streams */
    if (i < 0 || !types[i].from_host) {
        *code = SP_AP_E_TYPE;
        return -1;
    }
    /* Stream 0 carries only control; control never opens or rides a request stream. */
    if ((stream == 0) != control_type(type)) {
        *code = SP_AP_E_PROTO;
        return -1;
    }
    if (stream >= SP_AP_STREAM_AGENT_BASE && types[i].opens) {
        *code = SP_AP_E_PROTO; /* that id space is the agent's */
        return -1;
    }
    return 0;
}

/* ---- reader ---- */

void sp_ap_reader_init(sp_ap_reader_t *r, uint8_t *buf, size_t cap)
{
    r->buf = buf;
    r->cap = cap;
    sp_ap_reader_reset(r);
}

void sp_ap_reader_reset(sp_ap_reader_t *r)
{
    r->len = 0;
    r->off = 0;
    r->skip = 0;
}

uint8_t *sp_ap_reader_space(sp_ap_reader_t *r, size_t *avail)
{
    /* Compact so a whole frame always fits once the consumed prefix is gone. */
    if (r->off > 0) {
        memmove(r->buf, r->buf + r->off, r->len - r->off);
        r->len -= r->off;
        r->off = 0;
    }
    *avail = r->cap - r->len;
    return r->buf + r->len;
}

void sp_ap_reader_commit(sp_ap_reader_t *r, size_t n)
{
    if (n > r->cap - r->len) /* caller bug; clamp rather than overrun */
        n = r->cap - r->len;
    r->len += n;
}

/* Discards buffered bytes owed to an oversized frame. */
static void reader_skip(sp_ap_reader_t *r)
{
    size_t have = r->len - r->off;
    size_t n = r->skip < have ? (size_t)r->skip : have;
    r->off += n;
    r->skip -= n;
}

sp_ap_rd_result_t sp_ap_reader_next(sp_ap_reader_t *r, sp_ap_hdr_t *h, const uint8_t **payload)
{
    reader_skip(r);
    if (r->skip > 0 || r->len - r->off < SP_AP_HDR_SIZE)
        return SP_AP_RD_NEED;
    sp_ap_hdr_decode(r->buf + r->off, h);
    size_t frame_max = r->cap < SP_AP_MAX_FRAME ? r->cap : SP_AP_MAX_FRAME;
    bool oversize = (uint64_t)h->len + SP_AP_HDR_SIZE > frame_max;
    bool badflags = (h->flags & ~SP_AP_F_KNOWN) != 0;
    if (oversize || badflags) {
        /* Skip the declared payload: a well-framed bad frame leaves the channel in sync. */
        r->off += SP_AP_HDR_SIZE;
        r->skip = h->len;
        reader_skip(r);
        return oversize ? SP_AP_RD_OVERSIZE : SP_AP_RD_BADHDR;
    }
    if (r->len - r->off < SP_AP_HDR_SIZE + (size_t)h->len)
        return SP_AP_RD_NEED;
    *payload = r->buf + r->off + SP_AP_HDR_SIZE;
    r->off += SP_AP_HDR_SIZE + (size_t)h->len;
    return SP_AP_RD_FRAME;
}

/* ---- writer ---- */

void sp_ap_writer_init(sp_ap_writer_t *w, uint8_t *buf, size_t cap)
{
    w->buf = buf;
    w->cap = cap;
    w->len = 0;
    w->start = 0;
    w->overflow = false;
}

void sp_ap_frame_begin(sp_ap_writer_t *w, uint32_t stream, uint16_t type, uint16_t flags)
{
    w->start = w->len;
    w->overflow = false;
    if (w->cap - w->len < SP_AP_HDR_SIZE) {
        w->overflow = true;
        return;
    }
    sp_ap_hdr_t h = {.len = 0, .stream = stream, .type = type, .flags = flags};
    sp_ap_hdr_encode(w->buf + w->len, &h);
    w->len += SP_AP_HDR_SIZE;
}

long sp_ap_frame_end(sp_ap_writer_t *w)
{
    size_t plen = w->len - w->start - (w->overflow ? 0 : SP_AP_HDR_SIZE);
    if (w->overflow || plen > SP_AP_MAX_PAYLOAD) {
        w->len = w->start;
        return -1;
    }
    put_le32(w->buf + w->start, (uint32_t)plen);
    return (long)(w->len - w->start);
}

static uint8_t *reserve(sp_ap_writer_t *w, size_t n)
{
    if (w->overflow || w->cap - w->len < n) {
        w->overflow = true;
        return NULL;
    }
    uint8_t *p = w->buf + w->len;
    w->len += n;
    return p;
}

void sp_ap_put_raw(sp_ap_writer_t *w, const void *p, size_t n)
{
    uint8_t *d = reserve(w, n);
    if (d != NULL && n > 0)
        memcpy(d, p, n);
}

void sp_ap_put_bytes(sp_ap_writer_t *w, uint16_t tag, const void *p, size_t n)
{
    if (n > SP_AP_MAX_PAYLOAD) {
        w->overflow = true;
        return;
    }
    uint8_t *d = reserve(w, 6 + n);
    if (d == NULL)
        return;
    put_le16(d, tag);
    put_le32(d + 2, (uint32_t)n);
    if (n > 0)
        memcpy(d + 6, p, n);
}

void sp_ap_put_str(sp_ap_writer_t *w, uint16_t tag, const char *s)
{
    if (s != NULL)
        sp_ap_put_bytes(w, tag, s, strlen(s));
}

void sp_ap_put_u32(sp_ap_writer_t *w, uint16_t tag, uint32_t v)
{
    uint8_t b[4];
    put_le32(b, v);
    sp_ap_put_bytes(w, tag, b, 4);
}

void sp_ap_put_i32(sp_ap_writer_t *w, uint16_t tag, int32_t v)
{
    sp_ap_put_u32(w, tag, (uint32_t)v);
}

void sp_ap_put_u64(sp_ap_writer_t *w, uint16_t tag, uint64_t v)
{
    uint8_t b[8];
    put_le64(b, v);
    sp_ap_put_bytes(w, tag, b, 8);
}

static void put_sv(sp_ap_writer_t *w, uint16_t tag, sp_ap_str_t s)
{
    if (s.p != NULL)
        sp_ap_put_bytes(w, tag, s.p, s.n);
}

/* ---- fields ---- */

void sp_ap_fields_init(sp_ap_fields_t *f, const uint8_t *payload, size_t n)
{
    f->p = payload;
    f->n = n;
    f->off = 0;
}

int sp_ap_fields_next(sp_ap_fields_t *f, sp_ap_field_t *out)
{
    if (f->off == f->n)
        return 0;
    if (f->n - f->off < 6)
        return -1;
    uint16_t tag = get_le16(f->p + f->off);
    uint32_t len = get_le32(f->p + f->off + 2);
    if (len > f->n - f->off - 6)
        return -1;
    out->tag = tag;
    out->len = len;
    out->val = f->p + f->off + 6;
    f->off += 6 + (size_t)len;
    return 1;
}

int sp_ap_fields_check(const uint8_t *payload, size_t n)
{
    sp_ap_fields_t f;
    sp_ap_field_t x;
    int rc;
    sp_ap_fields_init(&f, payload, n);
    while ((rc = sp_ap_fields_next(&f, &x)) == 1)
        ;
    return rc;
}

int sp_ap_field_u32(const sp_ap_field_t *f, uint32_t *v)
{
    if (f->len != 4)
        return -1;
    *v = get_le32(f->val);
    return 0;
}

int sp_ap_field_i32(const sp_ap_field_t *f, int32_t *v)
{
    uint32_t u;
    if (sp_ap_field_u32(f, &u) < 0)
        return -1;
    *v = (int32_t)u;
    return 0;
}

int sp_ap_field_u64(const sp_ap_field_t *f, uint64_t *v)
{
    if (f->len != 8)
        return -1;
    *v = get_le64(f->val);
    return 0;
}

int sp_ap_field_str(const sp_ap_field_t *f, char *out, size_t cap)
{
    if (cap == 0 || f->len >= cap || memchr(f->val, 0, f->len) != NULL)
        return -1;
    memcpy(out, f->val, f->len);
    out[f->len] = 0;
    return 0;
}

static int field_sv(const sp_ap_field_t *f, sp_ap_str_t *s)
{
    if (memchr(f->val, 0, f->len) != NULL)
        return -1;
    s->p = (const char *)f->val;
    s->n = f->len;
    return 0;
}

int sp_ap_find(const uint8_t *p, size_t n, uint16_t tag, sp_ap_field_t *out)
{
    sp_ap_fields_t f;
    sp_ap_field_t x;
    int rc;
    int found = 0;
    sp_ap_fields_init(&f, p, n);
    /* Walk to the end even after a hit so a truncated tail is still reported. */
    while ((rc = sp_ap_fields_next(&f, &x)) == 1) {
        if (x.tag == tag && !found) {
            *out = x;
            found = 1;
        }
    }
    return rc < 0 ? -1 : found;
}

int sp_ap_get_u32(const uint8_t *p, size_t n, uint16_t tag, uint32_t *v)
{
    sp_ap_field_t f = {0};
    int rc = sp_ap_find(p, n, tag, &f);
    if (rc <= 0)
        return rc;
    return sp_ap_field_u32(&f, v);
}

int sp_ap_get_u64(const uint8_t *p, size_t n, uint16_t tag, uint64_t *v)
{
    sp_ap_field_t f = {0};
    int rc = sp_ap_find(p, n, tag, &f);
    if (rc <= 0)
        return rc;
    return sp_ap_field_u64(&f, v);
}

int sp_ap_get_i32(const uint8_t *p, size_t n, uint16_t tag, int32_t *v)
{
    sp_ap_field_t f = {0};
    int rc = sp_ap_find(p, n, tag, &f);
    if (rc <= 0)
        return rc;
    return sp_ap_field_i32(&f, v);
}

int sp_ap_get_str(const uint8_t *p, size_t n, uint16_t tag, sp_ap_str_t *s)
{
    sp_ap_field_t f = {0};
    s->p = NULL;
    s->n = 0;
    int rc = sp_ap_find(p, n, tag, &f);
    if (rc <= 0)
        return rc;
    return field_sv(&f, s);
}

/* ---- typed messages ---- */

long sp_ap_enc_proc_start(sp_ap_writer_t *w, uint32_t stream, const sp_ap_proc_start_t *m)
{
    sp_ap_frame_begin(w, stream, SP_AP_T_PROC_START, 0);
    for (uint32_t i = 0; i < m->argc && i < SP_AP_MAX_ARGV; i++)
        put_sv(w, SP_AP_K_ARGV, m->argv[i]);
    put_sv(w, SP_AP_K_CMD, m->cmd);
    for (uint32_t i = 0; i < m->envc && i < SP_AP_MAX_ENV; i++)
        put_sv(w, SP_AP_K_ENV, m->env[i]);
    put_sv(w, SP_AP_K_CWD, m->cwd);
    put_sv(w, SP_AP_K_USER, m->user);
    put_sv(w, SP_AP_K_TAG, m->tag);
    if (m->pty) {
        sp_ap_put_u32(w, SP_AP_K_PTY, 1);
        sp_ap_put_u32(w, SP_AP_K_ROWS, m->rows);
        sp_ap_put_u32(w, SP_AP_K_COLS, m->cols);
    }
    sp_ap_put_u32(w, SP_AP_K_STDIN, m->stdin_pipe ? 1 : 0);
    return sp_ap_frame_end(w);
}

/* Appends a repeated string field to a bounded list. */
static int add_sv(sp_ap_str_t *list, uint32_t *count, uint32_t max, const sp_ap_field_t *f)
{
    if (*count >= max)
        return -1;
    if (field_sv(f, &list[*count]) < 0)
        return -1;
    (*count)++;
    return 0;
}

static int field_bool(const sp_ap_field_t *f, bool *b)
{
    uint32_t v;
    if (sp_ap_field_u32(f, &v) < 0)
        return -1;
    *b = v != 0;
    return 0;
}

static int proc_start_field(sp_ap_proc_start_t *m, const sp_ap_field_t *x)
{
    switch (x->tag) {
    case SP_AP_K_ARGV:
        return add_sv(m->argv, &m->argc, SP_AP_MAX_ARGV, x);
    case SP_AP_K_ENV:
        return add_sv(m->env, &m->envc, SP_AP_MAX_ENV, x);
    case SP_AP_K_CMD:
        return field_sv(x, &m->cmd);
    case SP_AP_K_CWD:
        return field_sv(x, &m->cwd);
    case SP_AP_K_USER:
        return field_sv(x, &m->user);
    case SP_AP_K_TAG:
        return field_sv(x, &m->tag);
    case SP_AP_K_PTY:
        return field_bool(x, &m->pty);
    case SP_AP_K_STDIN:
        return field_bool(x, &m->stdin_pipe);
    case SP_AP_K_ROWS:
        return sp_ap_field_u32(x, &m->rows);
    case SP_AP_K_COLS:
        return sp_ap_field_u32(x, &m->cols);
    default:
        return 0; /* unknown tags are for newer peers */
    }
}

int sp_ap_dec_proc_start(const uint8_t *p, size_t n, sp_ap_proc_start_t *m, sp_err_t *err)
{
    sp_ap_fields_t f;
    sp_ap_field_t x;
    int rc;
    memset(m, 0, sizeof(*m));
    m->stdin_pipe = true;
    sp_ap_fields_init(&f, p, n);
    while ((rc = sp_ap_fields_next(&f, &x)) == 1) {
        if (proc_start_field(m, &x) < 0)
            return sp_err_set(err, SP_EINVAL, "bad proc_start field %u", x.tag);
    }
    if (rc < 0)
        return sp_err_set(err, SP_EINVAL, "truncated proc_start payload");
    if ((m->argc > 0) == (m->cmd.p != NULL))
        return sp_err_set(err, SP_EINVAL, "proc_start needs exactly one of argv and cmd");
    if (m->argc > 0 && m->argv[0].n == 0)
        return sp_err_set(err, SP_EINVAL, "empty argv[0]");
    if (m->pty && (m->rows > 0xffff || m->cols > 0xffff))
        return sp_err_set(err, SP_EINVAL, "pty size out of range");
    return 0;
}

long sp_ap_enc_identity(sp_ap_writer_t *w, uint32_t stream, const sp_ap_identity_t *m)
{
    sp_ap_frame_begin(w, stream, SP_AP_T_IDENTITY, 0);
    put_sv(w, SP_AP_K_HOSTNAME, m->hostname);
    put_sv(w, SP_AP_K_SANDBOX_ID, m->sandbox_id);
    for (uint32_t i = 0; i < m->envc && i < SP_AP_MAX_ENV; i++)
        put_sv(w, SP_AP_K_ENV, m->env[i]);
    if (m->seed.p != NULL)
        sp_ap_put_bytes(w, SP_AP_K_SEED, m->seed.p, m->seed.n);
    if (m->time_ns != 0)
        sp_ap_put_u64(w, SP_AP_K_TIME_NS, m->time_ns);
    return sp_ap_frame_end(w);
}

int sp_ap_dec_identity(const uint8_t *p, size_t n, sp_ap_identity_t *m, sp_err_t *err)
{
    sp_ap_fields_t f;
    sp_ap_field_t x;
    int rc;
    memset(m, 0, sizeof(*m));
    sp_ap_fields_init(&f, p, n);
    while ((rc = sp_ap_fields_next(&f, &x)) == 1) {
        int bad = 0;
        switch (x.tag) {
        case SP_AP_K_HOSTNAME:
            bad = field_sv(&x, &m->hostname);
            break;
        case SP_AP_K_SANDBOX_ID:
            bad = field_sv(&x, &m->sandbox_id);
            break;
        case SP_AP_K_ENV:
            bad = add_sv(m->env, &m->envc, SP_AP_MAX_ENV, &x);
            break;
        case SP_AP_K_SEED: /* bytes: NULs allowed */
            m->seed.p = (const char *)x.val;
            m->seed.n = x.len;
            break;
        case SP_AP_K_TIME_NS:
            bad = sp_ap_field_u64(&x, &m->time_ns);
            break;
        default:
            break;
        }
        if (bad)
            return sp_err_set(err, SP_EINVAL, "bad identity field %u", x.tag);
    }
    if (rc < 0)
        return sp_err_set(err, SP_EINVAL, "truncated identity payload");
    return 0;
}

long sp_ap_enc_egress_config(sp_ap_writer_t *w, uint32_t stream, const sp_ap_egress_config_t *m)
{
    sp_ap_frame_begin(w, stream, SP_AP_T_EGRESS_CONFIG, 0);
    sp_ap_put_u32(w, SP_AP_K_PROXY_PORT, m->proxy_port);
    sp_ap_put_u32(w, SP_AP_K_DNS, m->dns ? 1 : 0);
    for (uint32_t i = 0; i < m->envc && i < SP_AP_MAX_ENV; i++)
        put_sv(w, SP_AP_K_ENV, m->env[i]);
    if (m->window != 0)
        sp_ap_put_u32(w, SP_AP_K_WINDOW, m->window);
    return sp_ap_frame_end(w);
}

int sp_ap_dec_egress_config(const uint8_t *p, size_t n, sp_ap_egress_config_t *m, sp_err_t *err)
{
    sp_ap_fields_t f;
    sp_ap_field_t x;
    int rc;
    uint32_t dns = 0;
    memset(m, 0, sizeof(*m));
    sp_ap_fields_init(&f, p, n);
    while ((rc = sp_ap_fields_next(&f, &x)) == 1) {
        int bad = 0;
        if (x.tag == SP_AP_K_PROXY_PORT)
            bad = sp_ap_field_u32(&x, &m->proxy_port) < 0 || m->proxy_port > 65535;
        else if (x.tag == SP_AP_K_DNS)
            bad = sp_ap_field_u32(&x, &dns) < 0 || dns > 1;
        else if (x.tag == SP_AP_K_ENV)
            bad = add_sv(m->env, &m->envc, SP_AP_MAX_ENV, &x) < 0 ||
                  memchr(x.val, '=', x.len) == NULL || x.val[0] == '=';
        else if (x.tag == SP_AP_K_WINDOW)
            bad = sp_ap_field_u32(&x, &m->window) < 0 || m->window > SP_AP_INITIAL_WINDOW;
        if (bad)
            return sp_err_set(err, SP_EINVAL, "bad egress_config field %u", x.tag);
    }
    if (rc < 0)
        return sp_err_set(err, SP_EINVAL, "truncated egress_config payload");
    m->dns = dns == 1;
    return 0;
}

long sp_ap_enc_error(sp_ap_writer_t *w, uint32_t stream, uint32_t code, uint32_t sys_errno,
                     const char *msg)
{
    sp_ap_frame_begin(w, stream, SP_AP_T_ERROR, SP_AP_F_END);
    sp_ap_put_u32(w, SP_AP_K_CODE, code);
    sp_ap_put_u32(w, SP_AP_K_ERRNO, sys_errno);
    sp_ap_put_str(w, SP_AP_K_MSG, msg);
    return sp_ap_frame_end(w);
}

int sp_ap_dec_error(const uint8_t *p, size_t n, sp_ap_error_t *m, sp_err_t *err)
{
    memset(m, 0, sizeof(*m));
    if (sp_ap_get_u32(p, n, SP_AP_K_CODE, &m->code) < 0 ||
        sp_ap_get_u32(p, n, SP_AP_K_ERRNO, &m->sys_errno) < 0 ||
        sp_ap_get_str(p, n, SP_AP_K_MSG, &m->msg) < 0)
        return sp_err_set(err, SP_EINVAL, "malformed error payload");
    if (m->code == 0)
        return sp_err_set(err, SP_EINVAL, "error without code");
    return 0;
}

long sp_ap_enc_hello(sp_ap_writer_t *w, const sp_ap_hello_t *m)
{
    sp_ap_frame_begin(w, 0, SP_AP_T_HELLO, 0);
    sp_ap_put_u32(w, SP_AP_K_VERSION, m->version);
    put_sv(w, SP_AP_K_AGENT_VERSION, m->agent_version);
    put_sv(w, SP_AP_K_CLIENT, m->client);
    if (m->caps != 0)
        sp_ap_put_u32(w, SP_AP_K_CAPS, m->caps);
    if (m->boot_ns != 0)
        sp_ap_put_u64(w, SP_AP_K_BOOT_NS, m->boot_ns);
    if (m->session != 0)
        sp_ap_put_u64(w, SP_AP_K_SESSION, m->session);
    return sp_ap_frame_end(w);
}

int sp_ap_dec_hello(const uint8_t *p, size_t n, sp_ap_hello_t *m, sp_err_t *err)
{
    memset(m, 0, sizeof(*m));
    sp_ap_field_t f = {0};
    int rc = sp_ap_find(p, n, SP_AP_K_VERSION, &f);
    if (rc <= 0 || sp_ap_field_u32(&f, &m->version) < 0 || m->version == 0)
        return sp_err_set(err, SP_EINVAL, "hello without a valid version");
    if (sp_ap_get_str(p, n, SP_AP_K_AGENT_VERSION, &m->agent_version) < 0 ||
        sp_ap_get_str(p, n, SP_AP_K_CLIENT, &m->client) < 0 ||
        sp_ap_get_u32(p, n, SP_AP_K_CAPS, &m->caps) < 0 ||
        sp_ap_get_u64(p, n, SP_AP_K_BOOT_NS, &m->boot_ns) < 0 ||
        sp_ap_get_u64(p, n, SP_AP_K_SESSION, &m->session) < 0)
        return sp_err_set(err, SP_EINVAL, "malformed hello payload");
    return 0;
}

void sp_ap_put_entry(sp_ap_writer_t *w, const sp_ap_entry_t *e)
{
    put_sv(w, SP_AP_K_PATH, e->path);
    put_sv(w, SP_AP_K_NAME, e->name);
    sp_ap_put_u32(w, SP_AP_K_FTYPE, e->ftype);
    sp_ap_put_u64(w, SP_AP_K_SIZE, e->size);
    sp_ap_put_u32(w, SP_AP_K_MODE, e->mode);
    sp_ap_put_u32(w, SP_AP_K_UID, e->uid);
    sp_ap_put_u32(w, SP_AP_K_GID, e->gid);
    put_sv(w, SP_AP_K_OWNER, e->owner);
    put_sv(w, SP_AP_K_GROUP_NAME, e->group);
    sp_ap_put_u64(w, SP_AP_K_MTIME_NS, e->mtime_ns);
    put_sv(w, SP_AP_K_LINK, e->link);
    if (e->target.p != NULL) {
        put_sv(w, SP_AP_K_TARGET, e->target);
        sp_ap_put_u32(w, SP_AP_K_TARGET_FTYPE, e->target_ftype);
        sp_ap_put_u32(w, SP_AP_K_TARGET_MODE, e->target_mode);
    }
    if (e->special != 0)
        sp_ap_put_u32(w, SP_AP_K_SPECIAL, e->special);
}

int sp_ap_dec_entry(const uint8_t *p, size_t n, sp_ap_entry_t *e, sp_err_t *err)
{
    memset(e, 0, sizeof(*e));
    if (sp_ap_get_str(p, n, SP_AP_K_PATH, &e->path) < 0 ||
        sp_ap_get_str(p, n, SP_AP_K_NAME, &e->name) < 0 ||
        sp_ap_get_u32(p, n, SP_AP_K_FTYPE, &e->ftype) < 0 ||
        sp_ap_get_u64(p, n, SP_AP_K_SIZE, &e->size) < 0 ||
        sp_ap_get_u32(p, n, SP_AP_K_MODE, &e->mode) < 0 ||
        sp_ap_get_u32(p, n, SP_AP_K_UID, &e->uid) < 0 ||
        sp_ap_get_u32(p, n, SP_AP_K_GID, &e->gid) < 0 ||
        sp_ap_get_str(p, n, SP_AP_K_OWNER, &e->owner) < 0 ||
        sp_ap_get_str(p, n, SP_AP_K_GROUP_NAME, &e->group) < 0 ||
        sp_ap_get_u64(p, n, SP_AP_K_MTIME_NS, &e->mtime_ns) < 0 ||
        sp_ap_get_str(p, n, SP_AP_K_LINK, &e->link) < 0 ||
        sp_ap_get_str(p, n, SP_AP_K_TARGET, &e->target) < 0 ||
        sp_ap_get_u32(p, n, SP_AP_K_TARGET_FTYPE, &e->target_ftype) < 0 ||
        sp_ap_get_u32(p, n, SP_AP_K_TARGET_MODE, &e->target_mode) < 0 ||
        sp_ap_get_u32(p, n, SP_AP_K_SPECIAL, &e->special) < 0)
        return sp_err_set(err, SP_EINVAL, "malformed entry payload");
    if (e->path.p == NULL)
        return sp_err_set(err, SP_EINVAL, "entry without path");
    return 0;
}
