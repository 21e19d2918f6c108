/*
 * err.c - filling sp_err_t and naming codes.
 */
#include "base/err.h"

#include <stdarg.h>
#include <stdio.h>

int sp_err_set(sp_err_t *err, sp_code_t code, const char *fmt, ...)
{
    if (err == NULL)
        return -1;
    err->code = code;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(err->msg, sizeof(err->msg), fmt, ap);
    va_end(ap);
    return -1;
}

const char *sp_err_name(sp_code_t code)
{
    switch (code) {
    case SP_OK:
        return "ok";
    case SP_EINVAL:
        return "invalid_argument";
    case SP_EAUTH:
        return "unauthenticated";
    case SP_ENOTFOUND:
        return "not_found";
    case SP_ECONFLICT:
        return "conflict";
    case SP_ETOOBIG:
        return "payload_too_large";
    case SP_EUNAVAIL:
        return "unavailable";
    case SP_ERUNTIME:
        return "runtime_unavailable";
    case SP_EFORBIDDEN:
        return "permission_denied";
    case SP_ENOTSUP:
        return "not_supported";
    case SP_EQUOTA:
        return "quota_exceeded";
    case SP_ECAPACITY:
        return "capacity";
    case SP_EINTERNAL:
        break;
    }
    return "internal";
}

int sp_err_http_status(sp_code_t code)
{
    switch (code) {
    case SP_OK:
        return 200;
    case SP_EINVAL:
        return 400;
    case SP_EAUTH:
        return 401;
    case SP_ENOTFOUND:
        return 404;
    case SP_ECONFLICT:
        return 409;
    case SP_ETOOBIG:
        return 413;
    case SP_EUNAVAIL:
    case SP_ERUNTIME:
    case SP_ECAPACITY:
        return 503;
    case SP_EFORBIDDEN:
        return 403;
    case SP_ENOTSUP:
        return 501;
    case SP_EQUOTA:
        return 429;
    case SP_EINTERNAL:
        break;
    }
    return 500;
}
