/*
 * input.c - what the native API reads from a request: the JSON body, its fields, and the
 * query parameters that more than one route takes.
 *
 * Every route reads its input with these, so a value of the wrong type gets the same answer
 * everywhere (400, naming the field or parameter). Optional fields: absent and JSON null are the same
 * thing and leave the output as it was (strings: NULL). Strings are borrowed from the body.
 * Knows no route: which keys a body may have, and what they mean, is the route's.
 */
#include <stdlib.h>
#include <string.h>

#include "native-api/napi_int.h"

int sp_napi__parse_body(h2o_req_t *req, bool quiet, json_t **out, sp_err_t *err)
{
    *out = NULL;
    if (req->entity.len > NAPI_MAX_BODY)
        return sp_err_set(err, SP_ETOOBIG, "request body is larger than 1 MiB");
    if (req->entity.base == NULL || req->entity.len == 0)
        return 0;
    json_error_t je;
    *out = json_loadb(req->entity.base, req->entity.len, JSON_REJECT_DUPLICATES, &je);
    if (*out != NULL)
        return 0;
    /* The parser's text quotes the body near the error: never for bodies with secrets. */
    if (quiet)
        return sp_err_set(err, SP_EINVAL, "malformed JSON (line %d, column %d)", je.line,
                          je.column);
    return sp_err_set(err, SP_EINVAL, "malformed JSON: %.100s", je.text);
}

int sp_napi__body_keys(const json_t *b, const char *const *allowed, bool required, sp_err_t *err)
{
    if (b == NULL)
        return required ? sp_err_set(err, SP_EINVAL, "request body must be a JSON object") : 0;
    const char *k;
    const json_t *v;
    json_object_foreach((json_t *)b, k, v)
    {
        bool ok = false;
        for (int i = 0; allowed[i] != NULL && !ok; i++)
            ok = strcmp(k, allowed[i]) == 0;
        if (!ok)
            return sp_err_set(err, SP_EINVAL, "unknown field '%.64s'", k);
    }
    return 0;
}

json_t *sp_napi__field(const json_t *b, const char *key)
{
    json_t *v = json_object_get(b, key); /* NULL for a NULL or non-object b */
    return v == NULL || json_is_null(v) ? NULL : v;
}

int sp_napi__opt_str(const json_t *b, const char *key, size_t maxlen, const char **out,
                     sp_err_t *err)
{
    json_t *v = sp_napi__field(b, key);
    *out = NULL;
    if (v == NULL)
        return 0;
    if (!json_is_string(v))
        return sp_err_set(err, SP_EINVAL, "%s must be a string", key);
    if (strlen(json_string_value(v)) != json_string_length(v))
        return sp_err_set(err, SP_EINVAL, "%s may not contain NUL characters", key);
    if (json_string_length(v) > maxlen)
        return sp_err_set(err, SP_EINVAL, "%s is longer than %zu bytes", key, maxlen);
    *out = json_string_value(v);
    return 0;
}

json_t *sp_napi__req_string(const json_t *b, const char *key, sp_err_t *err)
{
    json_t *v = json_object_get(b, key);
    if (v == NULL || !json_is_string(v)) {
        sp_err_set(err, SP_EINVAL, "%s is required and must be a string", key);
        return NULL;
    }
    return v;
}

int sp_napi__opt_bool(const json_t *b, const char *key, bool *out, sp_err_t *err)
{
    json_t *v = sp_napi__field(b, key);
    if (v == NULL)
        return 0;
    if (!json_is_boolean(v))
        return sp_err_set(err, SP_EINVAL, "%s must be true or false", key);
    *out = json_is_true(v);
    return 0;
}

int sp_napi__opt_int(const json_t *b, const char *key, int lo, int hi, int *out, sp_err_t *err)
{
    json_t *v = sp_napi__field(b, key);
    if (v == NULL)
        return 0;
    if (!json_is_integer(v) || json_integer_value(v) < lo || json_integer_value(v) > hi)
        return sp_err_set(err, SP_EINVAL, "%s must be an integer from %d to %d", key, lo, hi);
    *out = (int)json_integer_value(v);
    return 0;
}

int sp_napi__signal(const json_t *v)
{
    if (json_is_integer(v))
        return json_integer_value(v) >= 1 && json_integer_value(v) <= 64
                   ? (int)json_integer_value(v)
                   : -1;
    return json_is_string(v) ? sp_exec_signal_number(json_string_value(v)) : -1;
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
