/*
 * err.h - the error value every layer returns to its caller.
 *
 * Folder: base/ holds what every layer and the agent share: errors, logging, ids, the agent
 * protocol, a growable buffer, small text helpers, the chunked decoder. It uses nothing of the
 * project's.
 * (ARCHITECTURE.md: the layers.)
 *
 * A function that can fail returns 0 or a pointer on success and -1 or NULL
 * on failure, filling the caller's sp_err_t. The message is client-safe: no
 * SQL, host paths, keys or tokens. Internal detail is logged where it happens.
 */
#ifndef SP_ERR_H
#define SP_ERR_H

typedef enum {
    SP_OK = 0,
    SP_EINVAL,    /* bad client input        -> 400 */
    SP_EAUTH,     /* missing or bad key      -> 401 */
    SP_ENOTFOUND, /* unknown or not yours    -> 404 */
    SP_ECONFLICT, /* not allowed in state    -> 409 */
    SP_ETOOBIG,   /* body or field too large -> 413 */
    SP_EUNAVAIL,  /* dependency down         -> 503 */
    SP_ERUNTIME,  /* no microVM runtime      -> 503 */
    SP_EFORBIDDEN, /* guest refused (EACCES) -> 403 */
    SP_EINTERNAL, /* our bug                 -> 500 */
    SP_ENOTSUP,   /* the runtime cannot do it -> 501 */
    SP_EQUOTA,    /* over a team's quota     -> 429 */
    SP_ECAPACITY, /* no worker has room      -> 503 */
} sp_code_t;

typedef struct {
    sp_code_t code;
    char msg[160];
} sp_err_t;

/* Fills *err if err != NULL. Always returns -1. */
int sp_err_set(sp_err_t *err, sp_code_t code, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

/* Stable lowercase name of a code ("not_found"), for JSON error bodies. */
const char *sp_err_name(sp_code_t code);

/* The HTTP status that goes with a code. */
int sp_err_http_status(sp_code_t code);

#endif
