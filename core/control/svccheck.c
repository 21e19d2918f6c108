/*
 * svccheck.c - svc.h's checks of a request's values that need no state (a string map's
 * shape and size), apart from svc.c so the request-body parsers of both APIs (and their fuzz
 * target) use them without the database.
 */
#include <string.h>

#include "core/control/svc.h"

int sp_svc_check_string_map(const json_t *obj, const char *what, sp_err_t *err)
{
    if (obj == NULL || json_is_null(obj))
        return 0;
    if (!json_is_object(obj))
        return sp_err_set(err, SP_EINVAL, "%s must be an object of strings", what);
    if (json_object_size(obj) > 256)
        return sp_err_set(err, SP_EINVAL, "%s has more than 256 entries", what);
    const char *k;
    const json_t *v;
    size_t total = 0;
    json_object_foreach((json_t *)obj, k, v)
    {
        size_t kl = strlen(k);
        if (kl == 0 || kl > 256)
            return sp_err_set(err, SP_EINVAL, "%s keys must be 1 to 256 characters", what);
        if (!json_is_string(v))
            return sp_err_set(err, SP_EINVAL, "%s value for '%.64s' must be a string", what, k);
        if (memchr(k, '\0', kl) != NULL || strlen(json_string_value(v)) != json_string_length(v))
            return sp_err_set(err, SP_EINVAL, "%s may not contain NUL characters", what);
        total += kl + json_string_length(v);
    }
    if (total > 64 * 1024)
        return sp_err_set(err, SP_EINVAL, "%s is larger than 64 KiB", what);
    return 0;
}
