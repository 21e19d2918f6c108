/*
 * agentproto.h - the wire protocol between the host and space-agent in the guest.
 *
 * Pure codec shared by both ends: frame header, a streaming frame reader over
 * a caller-owned buffer, a TLV field writer/reader, and typed helpers for the
 * common messages. No I/O, no allocation: every buffer is the caller's, and
 * decoded strings/bytes borrow from the payload they came from.
 *
 * ---- Frames ----
 * A frame is a 12-byte little-endian header followed by `len` payload bytes:
 *
 *     u32 len      payload bytes, at most SP_AP_MAX_PAYLOAD
 *     u32 stream   stream id (see below)
 *     u16 type     SP_AP_T_*
 *     u16 flags    SP_AP_F_*; bits outside SP_AP_F_KNOWN must be zero
 *
 * ---- Streams ----
 * Stream 0 is the control stream: only HELLO, PING, PONG and ERROR travel on
 * it. Every request opens a new stream: the host picks an unused id in
 * [1, SP_AP_STREAM_AGENT_BASE) and sends the opening frame (PROC_START,
 * FS_READ, ...). Ids with the top bit set are reserved for streams the agent
 * opens (egress, later). The agent ends a stream by sending a frame with
 * SP_AP_F_END set (OK, ERROR or PROC_EXIT); after it the host may reuse the
 * id. The host abandons a stream with RESET (no reply): a process stream is
 * detached (the process keeps running), a watch stops, a TCP stream closes.
 * Frames for unknown streams are dropped by both sides, since they may be
 * in flight across a RESET.
 *
 * A session starts when the host sends HELLO; the agent answers with its own
 * HELLO (versions, capabilities) and forgets all streams of any previous
 * session. Processes outlive sessions: the host lists them (PROC_LIST) and
 * re-attaches (PROC_ATTACH) after reconnecting.
 *
 * The host's HELLO carries a random SESSION, which the agent's answer echoes.
 * A host can go away (killed, or reconnecting) after its HELLO reached the
 * guest but before the agent read it: the agent was busy, or the VM stopped
 * first. The agent then answers that HELLO on the next connection, ahead of
 * the answer to the next host's own. So a host ignores a HELLO with another
 * SESSION and, as always, every other frame before its own answer. An answer
 * without SESSION (an older agent) is taken as the answer to this host.
 * For the same reason an agent that sees the host leave keeps the whole
 * frames it has queued: the guest may report the hangup only after it handed
 * over the next host's HELLO, and the answer to it is then in that queue.
 *
 * ---- Errors ----
 * A payload that does not parse, a missing field, a bad type for the stream
 * or a window violation ends that stream with ERROR (code, errno, message);
 * the agent carries on. A header whose length exceeds SP_AP_MAX_PAYLOAD is
 * answered with ERROR on that stream and the declared bytes are skipped, so a
 * correctly framed but oversized frame keeps the channel in sync. Random
 * garbage cannot be resynchronised; the host reconnects (which the guest sees
 * as read() == 0) and sends HELLO again.
 *
 * ---- Payloads ----
 * Most payloads are a sequence of TLV fields: u16 tag, u32 len, len bytes.
 * Integers are fixed-width little-endian (u32: 4 bytes, u64/i64: 8 bytes),
 * strings are raw bytes without NUL (a NUL inside is rejected), repeated tags
 * form lists (ARGV, ENV). Unknown tags are ignored, so fields can be added.
 * Byte-flow frames (DATA, PROC_STDOUT, PROC_STDERR, PING, PONG) carry raw bytes.
 *
 * ---- Flow control ----
 * Each stream has one window per direction, SP_AP_INITIAL_WINDOW bytes when
 * the stream opens. Only the payload bytes of DATA, PROC_STDOUT and
 * PROC_STDERR count. The receiver adds credit with WINDOW {WINDOW: u32
 * increment} as it consumes. A sender never exceeds its credit; the agent
 * ends a host stream that does with ERROR(SP_AP_E_PROTO). The agent keeps at
 * most SP_AP_PROC_RING bytes of each process's stdout and of its stderr; when
 * an attached stream is out of credit and the ring is full the agent stops
 * reading the child's pipe (the child blocks), so host memory per stream is
 * bounded by the window it granted. A process with no attached stream keeps
 * running and its oldest output is overwritten.
 *
 * ---- Messages (direction, stream, payload) ----
 *  HELLO        h->a, a->h, 0   VERSION u32, CLIENT str (h) | VERSION, AGENT_VERSION str,
 *                               CAPS u32 (SP_AP_CAP_*), BOOT_NS u64 (agent start, CLOCK_BOOTTIME);
 *                               both: SESSION u64 (the host's, echoed)
 *  PING/PONG    h->a / a->h, 0  raw bytes (<= 64), echoed
 *  OK           a->h, END       request done; may carry fields (FS entry, PID...)
 *  ERROR        a->h, END       CODE u32 (SP_AP_E_*), ERRNO u32 (guest errno or 0), MSG str
 *  WINDOW       both            WINDOW u32 increment
 *  RESET        h->a            none
 *  DATA         both            raw bytes: stdin (h->a on proc streams), file bytes, TCP bytes
 *  EOF          both            none: sender sends no more DATA (stdin close, write done,
 *                               TCP half-close)
 *  IDENTITY     h->a, opens     HOSTNAME str, SANDBOX_ID str, ENV str "K=V" (repeated,
 *                               default env for later PROC_START), SEED bytes (mixed into the
 *                               kernel RNG), TIME_NS u64 (CLOCK_REALTIME to set) -> OK
 *  PROC_START   h->a, opens     ARGV str (repeated) or CMD str (run by /bin/sh -c), ENV,
 *                               CWD str, USER str (default root), TAG str, PTY u32 (1 = PTY),
 *                               ROWS u32, COLS u32, STDIN u32 (0 = /dev/null, default 1 = pipe)
 *                               -> PROC_STARTED {PID}, then output, then PROC_EXIT (END)
 *  PROC_STARTED a->h            PID u32
 *  PROC_STDOUT  a->h            raw bytes (PTY output too)
 *  PROC_STDERR  a->h            raw bytes
 *  PROC_EXIT    a->h, END       EXIT_CODE i32 (if exited) or SIGNAL u32 (if killed)
 *  PROC_SIGNAL  h->a            SIGNAL u32, GROUP u32 (1 = whole process group)
 *  PROC_RESIZE  h->a            ROWS u32, COLS u32 (PTY only)
 *  PROC_ATTACH  h->a, opens     PID u32, REPLAY u32 (1 = send the buffered output first)
 *                               -> PROC_STARTED {PID}, output..., PROC_EXIT (END); stdin,
 *                               signals and resize work as on the starting stream
 *  PROC_LIST    h->a, opens     none -> PROC_INFO* then OK (END)
 *  PROC_INFO    a->h            PID, TAG, ARGV (one string: argv joined by spaces, cut at
 *                               4 KiB), CWD, USER, PTY, RUNNING u32, EXIT_CODE,
 *                               SIGNAL, STARTED_NS u64 (CLOCK_REALTIME)
 *  FS_STAT      h->a, opens     PATH, USER -> OK {entry fields}
 *  FS_READ      h->a, opens     PATH, USER, OFFSET u64, LENGTH u64 (0 = to EOF)
 *                               -> DATA* then OK {SIZE: bytes sent} (END)
 *  FS_WRITE     h->a, opens     PATH, USER, MODE u32 (default: the replaced file's mode,
 *                               else 0644), MKDIRS u32 (1 = create
 *                               parents); then host DATA* and EOF; the agent writes a
 *                               temporary file beside PATH, fsyncs and renames it over PATH
 *                               -> OK {entry}
 *  FS_LIST      h->a, opens     PATH, USER, DEPTH u32 (default 1) -> FS_ENTRY* then OK
 *                               {TRUNCATED u32 if SP_AP_LIST_MAX was hit}
 *  FS_MKDIR     h->a, opens     PATH, USER, MODE (default 0755); creates parents -> OK {entry}
 *  FS_MOVE      h->a, opens     PATH, DEST, USER -> OK {entry of DEST}
 *  FS_REMOVE    h->a, opens     PATH, USER, RECURSIVE u32 -> OK
 *  FS_CHMOD     h->a, opens     PATH, USER, MODE -> OK {entry}
 *  FS_CHOWN     h->a, opens     PATH, USER, OWNER str and/or GROUP_NAME str -> OK {entry}
 *  FS_ENTRY     a->h            entry fields: PATH, NAME, FTYPE u32 (SP_AP_FT_*), SIZE u64,
 *                               MODE u32 (permission bits), UID, GID, OWNER, GROUP_NAME,
 *                               MTIME_NS u64, LINK str (symlink target); symlinks also
 *                               TARGET str (the fully resolved target, absent when it does
 *                               not resolve), TARGET_FTYPE u32 and TARGET_MODE u32 (the
 *                               target's type and permission bits); FTYPE OTHER also
 *                               SPECIAL u32 (SP_AP_SPECIAL_*)
 *  WATCH_START  h->a, opens     PATH, USER, RECURSIVE u32 -> WATCH_STARTED, WATCH_EVENT*
 *                               until RESET (or ERROR if the directory goes away)
 *  WATCH_EVENT  a->h            PATH (full), NAME, EVENT u32 (SP_AP_EV_* bits), FTYPE
 *  TCP_CONNECT  h->a, opens     PORT u32, ADDR u32 (IPv4, host byte order, default
 *                               127.0.0.1) -> TCP_CONNECTED, then DATA/EOF both ways,
 *                               OK (END) once both directions are closed
 *
 * ---- Egress (the guest has no network device; its only way out is through here) ----
 * Streams the agent opens carry ids with SP_AP_STREAM_AGENT_BASE set, allocated by the
 * agent; on them the roles are mirrored: the host ends the stream with a frame flagged
 * SP_AP_F_END (OK, ERROR, DNS_ANSWER), the agent abandons it with RESET. Windows and
 * DATA/EOF work as on host streams.
 *  EGRESS_CONFIG h->a, opens    PROXY_PORT u32 (listen on 127.0.0.1:<port> in the guest for
 *                               proxy clients; 0 = stop listening), DNS u32 (1 = answer DNS
 *                               queries on 127.0.0.1:53, UDP and TCP), ENV str "K=V"
 *                               (repeated: added to the default env of later PROC_START,
 *                               e.g. HTTP_PROXY), WINDOW u32 (the send credit of EGRESS_OPEN
 *                               streams opened after this config: a host that grants the
 *                               rest as its memory allows; absent or 0: SP_AP_INITIAL_WINDOW;
 *                               agents with SP_AP_CAP_EGRESS_WINDOW) -> OK. Sent again after
 *                               every HELLO; the latest one wins. Without it the agent opens
 *                               nothing.
 *  EGRESS_OPEN  a->h, opens     KIND u32 (SP_AP_EGRESS_PROXY: a guest program connected to
 *                               the proxy port), PEER_PORT u32; then the connection's bytes as
 *                               DATA/EOF both ways (the host parses the proxy request);
 *                               the host ends it with OK or ERROR once done
 *  DNS_QUERY    a->h, opens     QUERY bytes (one DNS message as the guest sent it)
 *                               -> DNS_ANSWER (END) QUERY bytes (the reply message), or ERROR
 *
 * All paths may be relative; they resolve against the user's home directory.
 * File operations run with the user's uid, gid and groups as the filesystem
 * credentials, so `user` cannot touch root's files.
 */
#ifndef SP_AGENTPROTO_H
#define SP_AGENTPROTO_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "base/err.h"

/* Protocol version carried in HELLO. Bump on incompatible change. */
#define SP_AP_VERSION 1

#define SP_AP_HDR_SIZE          12u
#define SP_AP_MAX_PAYLOAD       (1u << 20)              /* bytes */
#define SP_AP_MAX_FRAME         (SP_AP_HDR_SIZE + SP_AP_MAX_PAYLOAD)
#define SP_AP_MAX_DATA          (64u * 1024u)           /* data bytes per frame a sender should use */
#define SP_AP_INITIAL_WINDOW    (256u * 1024u)          /* bytes, each direction of each stream */
#define SP_AP_PROC_RING         (1u << 20)              /* bytes kept per process per fd */
#define SP_AP_LIST_MAX          100000u                 /* entries per FS_LIST */
#define SP_AP_PING_MAX          64u                     /* bytes */
#define SP_AP_STREAM_AGENT_BASE 0x80000000u             /* agent-opened ids have this bit */
/* In the guest, IDENTITY's env is also written here (NUL-separated K=V, root only) for
 * programs that started before it, such as the code daemon; E2B's /envs reads it. */
#define SP_AP_ENV_FILE          "/run/space/env"

/* Frame flags. */
enum {
    SP_AP_F_END = 1u << 0, /* last frame of the stream from the agent */
};
#define SP_AP_F_KNOWN 0x0001u

/* Message types. Ranges: 0x00xx control/generic, 0x01xx processes, 0x02xx files and
 * watches, 0x03xx TCP to guest ports, 0x04xx code-interpreter contexts (reserved),
 * 0x05xx egress streams opened by the agent (reserved). */
typedef enum {
    SP_AP_T_HELLO = 0x0001,
    SP_AP_T_PING = 0x0002,
    SP_AP_T_PONG = 0x0003,
    SP_AP_T_OK = 0x0004,
    SP_AP_T_ERROR = 0x0005,
    SP_AP_T_WINDOW = 0x0006,
    SP_AP_T_RESET = 0x0007,
    SP_AP_T_DATA = 0x0008,
    SP_AP_T_EOF = 0x0009,
    SP_AP_T_IDENTITY = 0x000A,

    SP_AP_T_PROC_START = 0x0101,
    SP_AP_T_PROC_STARTED = 0x0102,
    SP_AP_T_PROC_STDOUT = 0x0103,
    SP_AP_T_PROC_STDERR = 0x0104,
    SP_AP_T_PROC_EXIT = 0x0105,
    SP_AP_T_PROC_SIGNAL = 0x0106,
    SP_AP_T_PROC_RESIZE = 0x0107,
    SP_AP_T_PROC_ATTACH = 0x0108,
    SP_AP_T_PROC_LIST = 0x0109,
    SP_AP_T_PROC_INFO = 0x010A,

    SP_AP_T_FS_STAT = 0x0201,
    SP_AP_T_FS_READ = 0x0202,
    SP_AP_T_FS_WRITE = 0x0203,
    SP_AP_T_FS_LIST = 0x0204,
    SP_AP_T_FS_MKDIR = 0x0205,
    SP_AP_T_FS_MOVE = 0x0206,
    SP_AP_T_FS_REMOVE = 0x0207,
    SP_AP_T_FS_CHMOD = 0x0208,
    SP_AP_T_FS_CHOWN = 0x0209,
    SP_AP_T_FS_ENTRY = 0x020A,
    SP_AP_T_WATCH_START = 0x0210,
    SP_AP_T_WATCH_STARTED = 0x0211,
    SP_AP_T_WATCH_EVENT = 0x0212,

    SP_AP_T_TCP_CONNECT = 0x0301,
    SP_AP_T_TCP_CONNECTED = 0x0302,

    /* 0x0401..0x04ff: reserved (code contexts are served by the guest's code daemon over
     * TCP_CONNECT, core/channel/code.h). */

    /* Egress: see "Egress" above. */
    SP_AP_T_EGRESS_CONFIG = 0x0501,
    SP_AP_T_EGRESS_OPEN = 0x0502,
    SP_AP_T_DNS_QUERY = 0x0503,
    SP_AP_T_DNS_ANSWER = 0x0504,
} sp_ap_type_t;

/* Field tags. One namespace for all messages. */
typedef enum {
    SP_AP_K_VERSION = 1,       /* u32 */
    SP_AP_K_AGENT_VERSION = 2, /* str */
    SP_AP_K_CAPS = 3,          /* u32 SP_AP_CAP_* */
    SP_AP_K_CLIENT = 4,        /* str */
    SP_AP_K_BOOT_NS = 5,       /* u64 */
    SP_AP_K_SESSION = 6,       /* u64, nonzero */

    SP_AP_K_CODE = 10,   /* u32 SP_AP_E_* */
    SP_AP_K_ERRNO = 11,  /* u32 */
    SP_AP_K_MSG = 12,    /* str */
    SP_AP_K_WINDOW = 13, /* u32 bytes */

    SP_AP_K_ARGV = 20,       /* str, repeated */
    SP_AP_K_CMD = 21,        /* str */
    SP_AP_K_ENV = 22,        /* str "K=V", repeated */
    SP_AP_K_CWD = 23,        /* str */
    SP_AP_K_USER = 24,       /* str user name */
    SP_AP_K_PTY = 25,        /* u32 bool */
    SP_AP_K_ROWS = 26,       /* u32 */
    SP_AP_K_COLS = 27,       /* u32 */
    SP_AP_K_TAG = 28,        /* str */
    SP_AP_K_PID = 29,        /* u32 */
    SP_AP_K_SIGNAL = 30,     /* u32 */
    SP_AP_K_EXIT_CODE = 31,  /* i32 (4 bytes) */
    SP_AP_K_STDIN = 32,      /* u32 bool */
    SP_AP_K_REPLAY = 33,     /* u32 bool */
    SP_AP_K_RUNNING = 34,    /* u32 bool */
    SP_AP_K_STARTED_NS = 35, /* u64 */
    SP_AP_K_GROUP = 36,      /* u32 bool */

    SP_AP_K_PATH = 40,       /* str */
    SP_AP_K_DEST = 41,       /* str */
    SP_AP_K_MODE = 42,       /* u32 */
    SP_AP_K_DEPTH = 43,      /* u32 */
    SP_AP_K_RECURSIVE = 44,  /* u32 bool */
    SP_AP_K_OFFSET = 45,     /* u64 */
    SP_AP_K_LENGTH = 46,     /* u64 */
    SP_AP_K_MKDIRS = 47,     /* u32 bool */
    SP_AP_K_OWNER = 48,      /* str user name */
    SP_AP_K_GROUP_NAME = 49, /* str */
    SP_AP_K_FTYPE = 50,      /* u32 SP_AP_FT_* */
    SP_AP_K_SIZE = 51,       /* u64 */
    SP_AP_K_UID = 52,        /* u32 */
    SP_AP_K_GID = 53,        /* u32 */
    SP_AP_K_MTIME_NS = 54,   /* u64 */
    SP_AP_K_NAME = 55,       /* str */
    SP_AP_K_LINK = 56,       /* str */
    SP_AP_K_EVENT = 57,      /* u32 SP_AP_EV_* */
    SP_AP_K_TRUNCATED = 58,  /* u32 bool */
    SP_AP_K_TARGET = 59,       /* str */
    SP_AP_K_TARGET_FTYPE = 60, /* u32 SP_AP_FT_* */
    SP_AP_K_TARGET_MODE = 61,  /* u32 */
    SP_AP_K_SPECIAL = 62,      /* u32 SP_AP_SPECIAL_* */

    SP_AP_K_HOSTNAME = 70,   /* str */
    SP_AP_K_SANDBOX_ID = 71, /* str */
    SP_AP_K_SEED = 72,       /* bytes */
    SP_AP_K_TIME_NS = 73,    /* u64 ns since the epoch */

    SP_AP_K_PORT = 80, /* u32 */
    SP_AP_K_ADDR = 81, /* u32 IPv4, host byte order */

    SP_AP_K_PROXY_PORT = 90, /* u32 guest TCP port of the egress proxy, 0 = off */
    SP_AP_K_DNS = 91,        /* u32 bool: answer DNS on 127.0.0.1:53 */
    SP_AP_K_KIND = 92,       /* u32 SP_AP_EGRESS_* */
    SP_AP_K_PEER_PORT = 93,  /* u32 guest source port */
    SP_AP_K_QUERY = 94,      /* bytes: one DNS message */
} sp_ap_tag_t;

/* Error codes in ERROR.CODE. */
typedef enum {
    SP_AP_E_PROTO = 1,   /* malformed frame or payload, window violation */
    SP_AP_E_TYPE = 2,    /* unknown or unexpected message type */
    SP_AP_E_INVAL = 3,   /* bad or missing argument */
    SP_AP_E_NOTFOUND = 4,
    SP_AP_E_PERM = 5,
    SP_AP_E_EXISTS = 6,
    SP_AP_E_NOTDIR = 7,
    SP_AP_E_ISDIR = 8,
    SP_AP_E_IO = 9,
    SP_AP_E_TOOBIG = 10,
    SP_AP_E_BUSY = 11,   /* stream id in use, limits reached */
    SP_AP_E_UNAVAIL = 12,
    SP_AP_E_INTERNAL = 13,
} sp_ap_errcode_t;

/* File types in FTYPE. */
enum { SP_AP_FT_OTHER = 0, SP_AP_FT_FILE = 1, SP_AP_FT_DIR = 2, SP_AP_FT_SYMLINK = 3 };
/* What an OTHER entry is, in SPECIAL (0: unknown). */
enum {
    SP_AP_SPECIAL_FIFO = 1,
    SP_AP_SPECIAL_SOCKET = 2,
    SP_AP_SPECIAL_CHAR = 3,
    SP_AP_SPECIAL_BLOCK = 4,
};

/* Watch event bits in EVENT. */
enum {
    SP_AP_EV_CREATE = 1u << 0,
    SP_AP_EV_WRITE = 1u << 1,
    SP_AP_EV_REMOVE = 1u << 2,
    SP_AP_EV_RENAME = 1u << 3,
    SP_AP_EV_CHMOD = 1u << 4,
};

/* Capabilities in HELLO.CAPS. */
enum {
    SP_AP_CAP_PTY = 1u << 0,
    SP_AP_CAP_WATCH = 1u << 1,
    SP_AP_CAP_TCP = 1u << 2,
    SP_AP_CAP_IDENTITY = 1u << 3,
    SP_AP_CAP_EGRESS = 1u << 4,
    SP_AP_CAP_EGRESS_WINDOW = 1u << 5, /* EGRESS_OPEN streams start with EGRESS_CONFIG.WINDOW */
};

/* EGRESS_OPEN.KIND */
enum { SP_AP_EGRESS_PROXY = 1 };

/* ---- Header ---- */

typedef struct {
    uint32_t len; /* payload bytes */
    uint32_t stream;
    uint16_t type;
    uint16_t flags;
} sp_ap_hdr_t;

/* Writes the 12-byte header. */
void sp_ap_hdr_encode(uint8_t out[SP_AP_HDR_SIZE], const sp_ap_hdr_t *h);
/* Reads a header from 12 bytes. Does not validate. */
void sp_ap_hdr_decode(const uint8_t in[SP_AP_HDR_SIZE], sp_ap_hdr_t *h);

/* Checks a decoded header: length bound, reserved flags. 0 or -1 with err. */
int sp_ap_hdr_check(const sp_ap_hdr_t *h, sp_err_t *err);

/* Known message type? */
bool sp_ap_type_known(uint16_t type);
/* Stable lowercase name of a type ("proc_start"), "unknown" otherwise. */
const char *sp_ap_type_name(uint16_t type);
/* May the host send `type` on `stream`? Checks stream-0 rules and direction; on
 * agent-opened ids (SP_AP_STREAM_AGENT_BASE) OK, ERROR and DNS_ANSWER are the host's.
 * Returns 0, or -1 with *code set to SP_AP_E_TYPE or SP_AP_E_PROTO. */
int sp_ap_check_from_host(uint16_t type, uint32_t stream, uint32_t *code);
/* Does `type` open a new stream (PROC_START, FS_*, ...)? */
bool sp_ap_type_opens(uint16_t type);

/* ---- Streaming frame reader ----
 * Owns nothing: `buf` is the caller's, at least SP_AP_MAX_FRAME bytes so any
 * valid frame fits. Feed it with space()/commit(), pop frames with next(). */

typedef struct {
    uint8_t *buf;
    size_t cap;
    size_t len;      /* bytes held */
    size_t off;      /* start of unconsumed bytes */
    uint64_t skip;   /* bytes of an oversized frame still to discard */
} sp_ap_reader_t;

typedef enum {
    SP_AP_RD_NEED = 0,      /* no complete frame yet */
    SP_AP_RD_FRAME = 1,     /* *h and *payload filled; payload valid until the next call */
    SP_AP_RD_OVERSIZE = 2,  /* *h filled (len too big); the payload is being skipped */
    SP_AP_RD_BADHDR = 3,    /* *h filled; reserved flags set; payload skipped */
} sp_ap_rd_result_t;

void sp_ap_reader_init(sp_ap_reader_t *r, uint8_t *buf, size_t cap);
/* Forgets buffered bytes and skip state (new connection). */
void sp_ap_reader_reset(sp_ap_reader_t *r);
/* Where to read into, and how many bytes fit (> 0 unless cap is too small). */
uint8_t *sp_ap_reader_space(sp_ap_reader_t *r, size_t *avail);
/* n bytes were written at space(). */
void sp_ap_reader_commit(sp_ap_reader_t *r, size_t n);
/* Pops the next frame. */
sp_ap_rd_result_t sp_ap_reader_next(sp_ap_reader_t *r, sp_ap_hdr_t *h, const uint8_t **payload);

/* ---- Frame writer ----
 * Builds one frame in a caller buffer. Any put that does not fit sets
 * `overflow`; end() then fails, so callers check once. */

typedef struct {
    uint8_t *buf;
    size_t cap;
    size_t len;
    size_t start; /* offset of the current frame's header */
    bool overflow;
} sp_ap_writer_t;

void sp_ap_writer_init(sp_ap_writer_t *w, uint8_t *buf, size_t cap);
/* Starts a frame at w->len (several frames can be built back to back). */
void sp_ap_frame_begin(sp_ap_writer_t *w, uint32_t stream, uint16_t type, uint16_t flags);
/* Finishes the frame: fills its length. Returns the frame size, or -1 on
 * overflow or payload > SP_AP_MAX_PAYLOAD (the frame is then discarded). */
long sp_ap_frame_end(sp_ap_writer_t *w);

void sp_ap_put_raw(sp_ap_writer_t *w, const void *p, size_t n);
void sp_ap_put_bytes(sp_ap_writer_t *w, uint16_t tag, const void *p, size_t n);
void sp_ap_put_str(sp_ap_writer_t *w, uint16_t tag, const char *s); /* NULL: nothing */
void sp_ap_put_u32(sp_ap_writer_t *w, uint16_t tag, uint32_t v);
void sp_ap_put_i32(sp_ap_writer_t *w, uint16_t tag, int32_t v);
void sp_ap_put_u64(sp_ap_writer_t *w, uint16_t tag, uint64_t v);

/* ---- Field reader ---- */

typedef struct {
    const uint8_t *p;
    size_t n;
    size_t off;
} sp_ap_fields_t;

typedef struct {
    uint16_t tag;
    uint32_t len;
    const uint8_t *val; /* borrowed from the payload */
} sp_ap_field_t;

void sp_ap_fields_init(sp_ap_fields_t *f, const uint8_t *payload, size_t n);
/* 1: *out filled; 0: end; -1: truncated field (the payload is malformed). */
int sp_ap_fields_next(sp_ap_fields_t *f, sp_ap_field_t *out);
/* Scans the whole payload once: 0 if every field is well formed, else -1. */
int sp_ap_fields_check(const uint8_t *payload, size_t n);

/* Typed views of a field: -1 when the length is wrong. */
int sp_ap_field_u32(const sp_ap_field_t *f, uint32_t *v);
int sp_ap_field_i32(const sp_ap_field_t *f, int32_t *v);
int sp_ap_field_u64(const sp_ap_field_t *f, uint64_t *v);
/* Copies a string field with a NUL into out[cap]; -1 if it holds a NUL or does not fit. */
int sp_ap_field_str(const sp_ap_field_t *f, char *out, size_t cap);

/* ---- Typed messages ----
 * Decoders borrow: sp_ap_str_t points into the payload, is not NUL-terminated,
 * and lives as long as the payload. They return 0, or -1 with err (code
 * SP_EINVAL) on a malformed payload, a missing required field, a string with
 * a NUL, or too many repeated fields. */

typedef struct {
    const char *p; /* NULL when absent */
    uint32_t n;
} sp_ap_str_t;

#define SP_AP_MAX_ARGV 256
#define SP_AP_MAX_ENV  256

typedef struct {
    sp_ap_str_t argv[SP_AP_MAX_ARGV];
    uint32_t argc;
    sp_ap_str_t cmd;
    sp_ap_str_t env[SP_AP_MAX_ENV];
    uint32_t envc;
    sp_ap_str_t cwd;
    sp_ap_str_t user;
    sp_ap_str_t tag;
    bool pty;
    bool stdin_pipe; /* default true */
    uint32_t rows, cols;
} sp_ap_proc_start_t;

/* Encodes PROC_START as one frame; -1 on overflow. */
long sp_ap_enc_proc_start(sp_ap_writer_t *w, uint32_t stream, const sp_ap_proc_start_t *m);
/* Needs exactly one of ARGV (>= 1) and CMD. */
int sp_ap_dec_proc_start(const uint8_t *p, size_t n, sp_ap_proc_start_t *m, sp_err_t *err);

typedef struct {
    sp_ap_str_t hostname;
    sp_ap_str_t sandbox_id;
    sp_ap_str_t env[SP_AP_MAX_ENV];
    uint32_t envc;
    sp_ap_str_t seed; /* bytes */
    uint64_t time_ns; /* 0: leave the clock alone */
} sp_ap_identity_t;

long sp_ap_enc_identity(sp_ap_writer_t *w, uint32_t stream, const sp_ap_identity_t *m);
int sp_ap_dec_identity(const uint8_t *p, size_t n, sp_ap_identity_t *m, sp_err_t *err);

typedef struct {
    uint32_t proxy_port; /* 0: no proxy listener */
    bool dns;
    sp_ap_str_t env[SP_AP_MAX_ENV]; /* "K=V" */
    uint32_t envc;
    uint32_t window; /* EGRESS_OPEN streams' initial send credit; 0: SP_AP_INITIAL_WINDOW */
} sp_ap_egress_config_t;

long sp_ap_enc_egress_config(sp_ap_writer_t *w, uint32_t stream, const sp_ap_egress_config_t *m);
/* Also rejects PROXY_PORT > 65535, DNS other than 0/1, an ENV without "K=" (empty K) and a
 * WINDOW over SP_AP_INITIAL_WINDOW. */
int sp_ap_dec_egress_config(const uint8_t *p, size_t n, sp_ap_egress_config_t *m, sp_err_t *err);

typedef struct {
    uint32_t code; /* SP_AP_E_* */
    uint32_t sys_errno;
    sp_ap_str_t msg;
} sp_ap_error_t;

long sp_ap_enc_error(sp_ap_writer_t *w, uint32_t stream, uint32_t code, uint32_t sys_errno,
                     const char *msg);
int sp_ap_dec_error(const uint8_t *p, size_t n, sp_ap_error_t *m, sp_err_t *err);

typedef struct {
    uint32_t version;
    sp_ap_str_t agent_version; /* from the agent */
    sp_ap_str_t client;        /* from the host */
    uint32_t caps;
    uint64_t boot_ns;
    uint64_t session; /* the host's, echoed by the agent; 0: absent */
} sp_ap_hello_t;

long sp_ap_enc_hello(sp_ap_writer_t *w, const sp_ap_hello_t *m);
int sp_ap_dec_hello(const uint8_t *p, size_t n, sp_ap_hello_t *m, sp_err_t *err);

/* File entry (FS_ENTRY, and OK of stat-like requests). */
typedef struct {
    sp_ap_str_t path;
    sp_ap_str_t name;
    uint32_t ftype;
    uint64_t size;
    uint32_t mode;
    uint32_t uid, gid;
    sp_ap_str_t owner;
    sp_ap_str_t group;
    uint64_t mtime_ns;
    sp_ap_str_t link;
    sp_ap_str_t target;    /* symlinks: resolved target (absent: none or dangling) */
    uint32_t target_ftype; /* with target */
    uint32_t target_mode;  /* with target */
    uint32_t special;      /* FTYPE OTHER: SP_AP_SPECIAL_*, 0 unknown */
} sp_ap_entry_t;

/* Appends entry fields to the current frame. */
void sp_ap_put_entry(sp_ap_writer_t *w, const sp_ap_entry_t *e);
int sp_ap_dec_entry(const uint8_t *p, size_t n, sp_ap_entry_t *e, sp_err_t *err);

/* Finds the first field with `tag`: 1 found, 0 absent, -1 malformed payload. */
int sp_ap_find(const uint8_t *p, size_t n, uint16_t tag, sp_ap_field_t *out);
/* Convenience for optional integer fields: *v keeps its value when absent.
 * -1 on a malformed payload or a wrong-size field. */
int sp_ap_get_u32(const uint8_t *p, size_t n, uint16_t tag, uint32_t *v);
int sp_ap_get_u64(const uint8_t *p, size_t n, uint16_t tag, uint64_t *v);
int sp_ap_get_i32(const uint8_t *p, size_t n, uint16_t tag, int32_t *v);
/* Borrowed string view (absent: s->p == NULL); -1 if malformed or holds a NUL. */
int sp_ap_get_str(const uint8_t *p, size_t n, uint16_t tag, sp_ap_str_t *s);

#endif
