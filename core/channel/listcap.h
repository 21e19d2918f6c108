/*
 * listcap.h - the caps on every list a guest answers, in one place: processes (sp_exec_list),
 * directory entries (sp_exec_fs LIST), polling watchers' buffered events (fswatch.h) and code
 * contexts (sp_code_list).
 *
 * The guest is hostile: it can answer a list with millions of entries, strings of a megabyte
 * each, or events that never stop. The host builds each answer in its memory before it sends
 * it (a JSON array, a Connect message), so each answer has caps on its entries, on each string
 * and on the guest bytes read for it. List frames are not under the agent's flow control
 * (only DATA and output count against a stream's window, base/agentproto.h), so the byte cap
 * is counted on the host in windows: an answer may take SP_LIST_WINDOWS windows of the guest's
 * bytes. Past a cap the host stops reading (the stream is reset, the agent stops) and answers
 * what it has with a truncation flag: "truncated": true on the native API, the header
 * SP_LIST_TRUNCATED_HEADER on E2B's (whose messages have no field for it). An entry whose
 * string passes SP_LIST_STR_MAX is cut (process fields, shown to people) or left out
 * (paths and names, which clients use: a cut one would name another file), both flagged.
 *
 * What one answer can cost: SP_LIST_BYTES_MAX of guest bytes, each made at most 6 bytes of
 * JSON (an escaped control byte), plus jansson's objects for SP_LIST_ENTRIES_MAX entries:
 * tens of MiB at the very worst, for the life of the request.
 */
#ifndef SP_LISTCAP_H
#define SP_LISTCAP_H

#include "base/agentproto.h"

#define SP_LIST_ENTRIES_MAX 10000u /* entries in one answer */
#define SP_LIST_STR_MAX 4096u      /* bytes of one string of an entry (a path: PATH_MAX) */
#define SP_LIST_WINDOWS 16u        /* guest bytes of one answer, in stream windows */
#define SP_LIST_BYTES_MAX (SP_LIST_WINDOWS * SP_AP_INITIAL_WINDOW) /* 4 MiB */

/* Polling watchers: events buffered until polled, per watcher and for all of a server's. */
#define SP_WATCH_EVENTS_MAX 10000u                     /* per watcher */
#define SP_WATCH_BYTES_MAX (4u * SP_AP_INITIAL_WINDOW) /* per watcher: 1 MiB */
#define SP_WATCH_ALL_BYTES_MAX (64u * 1024 * 1024)     /* all watchers of a table */

/* Code contexts in one list answer (a daemon answer past SP_LIST_BYTES_MAX is refused). */
#define SP_LIST_CONTEXTS_MAX 1000u

#define SP_LIST_TRUNCATED_HEADER "x-space-truncated"

#endif
