/*
 * input.c - what the native API reads from a request itself: its body's bytes (read as JSON
 * by body.c, which also has the body's field helpers) and the query parameters that more
 * than one route takes.
 *
 * Every route reads its input with these, so a value of the wrong type gets the same answer
 * everywhere (400, naming the parameter). Knows no route.
 */
#include <stdlib.h>
#include <string.h>

#include "native-api/napi_int.h"

int sp_napi__parse_body(h2o_req_t *req, bool quiet, json_t **out, sp_err_t *err)
{
    return sp_napi__json_body(req->entity.base, req->entity.len, quiet, out, err);
}

int sp_napi__query_int(h2o_req_t *req, const char *name, int lo, int hi, int *out, sp_err_t *err)
{
    const char *v = sp_http_query(req, name);
    if (v == NULL)
        return 0;
    char *end;
    long l = strtol(v, &end, 10);
    if (*v == '\0' || *end != '\0' || l < lo || l > hi)
        return sp_err_set(err, SP_EINVAL, "%s must be %d to %d", name, lo, hi);
    *out = (int)l;
    return 0;
}

int sp_napi__query_bool(h2o_req_t *req, const char *name, bool *out, sp_err_t *err)
{
    const char *v = sp_http_query(req, name);
    if (v == NULL)
        return 0;
    if (strcmp(v, "true") == 0 || strcmp(v, "1") == 0)
        *out = true;
    else if (strcmp(v, "false") == 0 || strcmp(v, "0") == 0)
        *out = false;
    else
        return sp_err_set(err, SP_EINVAL, "%s must be true or false", name);
    return 0;
}
