/*
 * exec.h - commands and files in a sandbox, over its agent channel (core/channel/agentconn.h).
 *
 * Each call opens one agent stream and returns an operation handle (sp_exec_t) that lives
 * until its terminal callback returns or the caller cancels it. Knows no HTTP: the API layers
 * turn events into responses.
 *
 * Flow control, end to end: output (process stdout/stderr, file bytes) is handed to the
 * caller as it arrives, and the agent gets credit back only when the caller says the bytes
 * were passed on (sp_exec_ack). The agent never sends more than the credit we granted, so
 * what a stream can make us hold is one window (SP_AP_INITIAL_WINDOW) of raw bytes, however
 * large the file or however much the process writes. Uploads go the other way: the caller
 * offers bytes (sp_exec_write_data) and is told how many the agent's credit took; on_writable
 * says when to offer more.
 *
 * Contract for every call: returns the handle, or NULL with err filled and no callback ever;
 * with a handle, exactly one terminal callback follows (never inside the call), unless the
 * caller cancels first. sp_exec_cancel may be called from inside any of the operation's
 * callbacks; the handle is invalid once the terminal callback returned or cancel was called.
 * Cancelling a process stream detaches it: the process keeps running in the guest.
 *
 * Strings from the guest (paths, names, command lines) reach callers as valid UTF-8 JSON
 * strings: invalid bytes become U+FFFD.
 */
#ifndef SP_EXEC_H
#define SP_EXEC_H

#include <jansson.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "core/channel/agentconn.h"
#include "core/channel/listcap.h"
#include "base/err.h"
#include "loop/loop.h"

typedef struct sp_exec sp_exec_t;

#define SP_EXEC_PATH_MAX      4096u               /* bytes in a path */
#define SP_EXEC_COLLECT_MAX   (16u * 1024 * 1024) /* default cap per fd for sp_exec_run */
#define SP_EXEC_LIST_MAX      SP_LIST_ENTRIES_MAX /* entries kept by a listing (listcap.h) */
#define SP_EXEC_REPLY_MS      30000u              /* deadline for request/answer operations */
#define SP_EXEC_IDLE_MS       60000u              /* uploads/stdin with no progress fail after */
#define SP_EXEC_KILL_GRACE_MS 5000u               /* after a timeout's SIGKILL, wait this long */

/* ---- processes ---- */

typedef struct {
    const char *cmd;          /* a shell line run by /bin/sh -c, or NULL and argv */
    const char *const *argv;  /* argc >= 1 when cmd is NULL */
    size_t argc;
    const char *const *env;   /* "K=V" strings */
    size_t envc;
    const char *cwd;          /* NULL: the user's home */
    const char *user;         /* NULL: root */
    const char *tag;          /* NULL or a label shown by sp_exec_list */
    bool pty;
    uint32_t rows, cols;      /* PTY size; 0: 24x80 */
    bool stdin_pipe;          /* false: stdin is /dev/null */
    const void *stdin_data;   /* with stdin_pipe: written, then stdin is closed (copied) */
    size_t stdin_len;
    bool stdin_eof;           /* close stdin after stdin_data (foreground commands) */
    uint32_t timeout_ms;      /* 0: none; else SIGKILL to the process group when it passes */
} sp_exec_cmd_t;

typedef enum {
    SP_EXEC_EV_START = 0, /* pid */
    SP_EXEC_EV_STDOUT,    /* data, len: borrowed for the call; sp_exec_ack when passed on */
    SP_EXEC_EV_STDERR,
    SP_EXEC_EV_EXIT,      /* terminal: exited/exit_code, signal, timed_out */
    SP_EXEC_EV_ERROR,     /* terminal: err */
} sp_exec_evtype_t;

typedef struct {
    sp_exec_evtype_t type;
    uint32_t pid;
    const uint8_t *data;
    size_t len;
    bool exited;     /* EXIT: exit_code is valid */
    int exit_code;
    int signal;      /* EXIT: the signal that killed it, 0 if none */
    bool timed_out;  /* EXIT: timeout_ms passed and the process group was killed; when the
                      * process did not end within SP_EXEC_KILL_GRACE_MS either, exited is
                      * false and signal 0 */
    const sp_err_t *err;
} sp_exec_ev_t;

typedef void (*sp_exec_event_cb)(void *arg, const sp_exec_ev_t *ev);

/* Starts cmd and streams its events: START, then output, then EXIT (or ERROR at any point;
 * an ERROR before START means it did not start). */
sp_exec_t *sp_exec_stream(sp_loop_t *loop, sp_agentconn_t *c, const sp_exec_cmd_t *cmd,
                          sp_exec_event_cb cb, void *arg, sp_err_t *err);

/* Re-attaches to process pid: START, the output the agent still holds (replay), new output,
 * EXIT. ERROR with SP_ENOTFOUND when the agent knows no such process. */
sp_exec_t *sp_exec_attach(sp_loop_t *loop, sp_agentconn_t *c, uint32_t pid, bool replay,
                          sp_exec_event_cb cb, void *arg, sp_err_t *err);

/* The caller passed n bytes of STDOUT/STDERR (or file data) on: the agent may send n more. */
void sp_exec_ack(sp_exec_t *op, size_t n);

typedef struct {
    uint32_t pid;
    bool exited;
    int exit_code;
    int signal;
    bool timed_out;
    const uint8_t *out, *err; /* collected output, borrowed for the callback */
    size_t out_len, err_len;
    bool out_truncated, err_truncated; /* more than the cap was written; the rest is dropped */
} sp_exec_result_t;

typedef void (*sp_exec_result_cb)(void *arg, const sp_exec_result_t *res, const sp_err_t *err);

/* Runs cmd to its end and collects at most cap bytes of stdout and of stderr each (0: the
 * default SP_EXEC_COLLECT_MAX); beyond that output is read and dropped so the process is
 * never blocked by us. Memory: at most 2 * cap. */
sp_exec_t *sp_exec_run(sp_loop_t *loop, sp_agentconn_t *c, const sp_exec_cmd_t *cmd, size_t cap,
                       sp_exec_result_cb cb, void *arg, sp_err_t *err);

/* Starts cmd in the background: cb with its pid once started, then the stream is detached
 * (the process keeps running; its latest output stays in the agent for sp_exec_attach). */
sp_exec_t *sp_exec_spawn(sp_loop_t *loop, sp_agentconn_t *c, const sp_exec_cmd_t *cmd,
                         void (*cb)(void *arg, uint32_t pid, const sp_err_t *err), void *arg,
                         sp_err_t *err);

/* The agent's processes, as a JSON array (borrowed for the callback) of objects:
 * {id, pid, tag, cmd, cwd, user, pty, running, exit_code, signal, started_at}. Capped as
 * listcap.h says: past SP_LIST_ENTRIES_MAX entries or SP_LIST_BYTES_MAX of the agent's bytes
 * the listing stops there (the stream is reset) and truncated is true; a string past
 * SP_LIST_STR_MAX bytes is cut there, also truncated. A truncated list may leave out
 * processes that run. */
typedef void (*sp_exec_list_cb)(void *arg, json_t *procs, bool truncated, const sp_err_t *err);
sp_exec_t *sp_exec_list(sp_loop_t *loop, sp_agentconn_t *c, sp_exec_list_cb cb, void *arg,
                        sp_err_t *err);

typedef void (*sp_exec_done_cb)(void *arg, const sp_err_t *err);

/* Writes data (copied) to a running process's stdin, then closes it if eof. SP_ENOTFOUND
 * for an unknown pid, SP_ECONFLICT when it has exited; SP_EUNAVAIL when it takes no bytes
 * for SP_EXEC_IDLE_MS. Done means handed to the agent, not read by the process. */
sp_exec_t *sp_exec_stdin(sp_loop_t *loop, sp_agentconn_t *c, uint32_t pid, const void *data,
                         size_t len, bool eof, sp_exec_done_cb cb, void *arg, sp_err_t *err);

/* Sends signal sig (1..64) to pid, or to its process group. Errors as sp_exec_stdin. */
sp_exec_t *sp_exec_signal(sp_loop_t *loop, sp_agentconn_t *c, uint32_t pid, int sig, bool group,
                          sp_exec_done_cb cb, void *arg, sp_err_t *err);

/* Resizes pid's PTY to rows x cols (1..1000 each). Errors as sp_exec_stdin. */
sp_exec_t *sp_exec_resize(sp_loop_t *loop, sp_agentconn_t *c, uint32_t pid, uint32_t rows,
                          uint32_t cols, sp_exec_done_cb cb, void *arg, sp_err_t *err);

/* ---- files ----
 * Paths: 1..SP_EXEC_PATH_MAX bytes, no NUL (SP_EINVAL otherwise); relative ones resolve
 * against the user's home. Operations run with the user's credentials (NULL: root).
 * Entries are JSON objects: {path, name, type (file|dir|symlink|other), size, mode, uid, gid,
 * owner, group, mtime, link (symlinks only: the raw link), target, target_type, target_mode
 * (symlinks that resolve: the final target, its type and permission bits), special (type
 * other: fifo|socket|char|block)}. */

typedef enum {
    SP_EXEC_FS_STAT = 0, /* -> entry */
    SP_EXEC_FS_LIST,     /* -> {"entries": [entry...], "truncated": bool}; capped as
                          * sp_exec_list (an entry with a string past SP_LIST_STR_MAX is
                          * left out, truncated) */
    SP_EXEC_FS_MKDIR,    /* -> entry; creates parents */
    SP_EXEC_FS_MOVE,     /* -> entry of dest */
    SP_EXEC_FS_REMOVE,   /* -> NULL */
} sp_exec_fsop_t;

typedef struct {
    sp_exec_fsop_t op;
    const char *path;
    const char *dest;    /* MOVE */
    const char *user;
    uint32_t depth;      /* LIST: 1..; 0 = 1 */
    bool recursive;      /* REMOVE */
    uint32_t mode;       /* MKDIR: 0 = 0755 */
} sp_exec_fs_req_t;

/* Checks a path as the API takes it. */
int sp_exec_check_path(const char *path, sp_err_t *err);

/* Maps an agent ERROR payload (base/agentproto.h) to a client-safe error: our code for the
 * agent's, and the guest's message made printable. For every module that reads agent streams. */
void sp_exec_agent_error(const uint8_t *p, size_t n, sp_err_t *out);

/* Decodes a PROC_EXIT payload into ev: type EXIT, exited, exit_code (0 unless exited) and
 * signal; the rest zero. -1 when it is malformed. For every module that reads process
 * streams. */
int sp_exec_proc_exit(const uint8_t *p, size_t n, sp_exec_ev_t *ev);

/* result is borrowed for the callback (NULL for REMOVE and on error). */
sp_exec_t *sp_exec_fs(sp_loop_t *loop, sp_agentconn_t *c, const sp_exec_fs_req_t *req,
                      void (*cb)(void *arg, json_t *result, const sp_err_t *err), void *arg,
                      sp_err_t *err);

typedef struct {
    /* File bytes, borrowed for the call; sp_exec_ack(op, len) once passed on. */
    void (*on_data)(void *arg, const uint8_t *p, size_t len);
    /* Terminal: every byte was delivered (err NULL; total = bytes), or the read failed. */
    void (*on_done)(void *arg, uint64_t total, const sp_err_t *err);
} sp_exec_read_cbs_t;

/* Streams length bytes (0: to the end) of path from offset. */
sp_exec_t *sp_exec_read(sp_loop_t *loop, sp_agentconn_t *c, const char *path, const char *user,
                        uint64_t offset, uint64_t length, const sp_exec_read_cbs_t *cbs,
                        void *arg, sp_err_t *err);

typedef struct {
    /* The agent takes more bytes now (after sp_exec_write_data took fewer than offered). */
    void (*on_writable)(void *arg);
    /* Terminal: the file was written and renamed into place (entry borrowed), or failed. */
    void (*on_done)(void *arg, json_t *entry, const sp_err_t *err);
} sp_exec_write_cbs_t;

/* Opens path for writing (the agent writes a temporary file and renames it over path when
 * sp_exec_write_end is called). mode 0: keep the replaced file's mode, else 0644. */
sp_exec_t *sp_exec_write(sp_loop_t *loop, sp_agentconn_t *c, const char *path, const char *user,
                         uint32_t mode, bool mkdirs, const sp_exec_write_cbs_t *cbs, void *arg,
                         sp_err_t *err);
/* Offers n bytes: returns how many the agent's credit took now (0..n; the caller keeps the
 * rest and waits for on_writable), or -1 when the operation already failed (on_done follows
 * or came). Never calls back. */
long sp_exec_write_data(sp_exec_t *op, const void *p, size_t n);
/* No more bytes: the agent commits the file; on_done follows. */
void sp_exec_write_end(sp_exec_t *op);

typedef struct {
    /* The watch is in place (once, before any event). */
    void (*on_started)(void *arg);
    /* A change: path (full) and name (last component) are NUL-terminated, borrowed for the
     * call; events are SP_AP_EV_* bits, ftype SP_AP_FT_*. */
    void (*on_event)(void *arg, const char *path, const char *name, uint32_t events,
                     uint32_t ftype);
    /* Terminal: the watch could not start or ended (directory gone, channel lost). */
    void (*on_done)(void *arg, const sp_err_t *err);
} sp_exec_watch_cbs_t;

/* Watches directory path (and, if recursive, its subdirectories) until cancelled. */
sp_exec_t *sp_exec_watch(sp_loop_t *loop, sp_agentconn_t *c, const char *path, const char *user,
                         bool recursive, const sp_exec_watch_cbs_t *cbs, void *arg,
                         sp_err_t *err);

/* Stops the operation: no more callbacks; a process stream is detached, a write is abandoned
 * (the agent drops its temporary file). NULL does nothing. */
void sp_exec_cancel(sp_exec_t *op);

/* ---- helpers ---- */

/*
 * Converts in[0..n) to valid UTF-8 in out (capacity >= 3 * n), each invalid byte becoming
 * U+FFFD. Unless final, an incomplete sequence at the end is left unconverted: *consumed
 * says how many input bytes were used. Returns the output length.
 */
size_t sp_exec_utf8_clean(const uint8_t *in, size_t n, char *out, bool final, size_t *consumed);

/* json_t string of arbitrary bytes (via sp_exec_utf8_clean); NULL on allocation failure. */
json_t *sp_exec_json_bytes(const void *p, size_t n);

/* Signal number from "SIGTERM", "TERM" or "15"; -1 when unknown. */
int sp_exec_signal_number(const char *name);

#endif
