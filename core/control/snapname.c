/*
 * snapname.c - snap.h's snapshot ids and names (their shape, a name's normal form), apart from
 * snap.c so the request-body parsers of both APIs (and their fuzz target) use them without the
 * database.
 */
#include <stdbool.h>
#include <string.h>

#include "core/control/snap.h"

static bool in_set(char ch, const char *extra)
{
    return (ch >= 'a' && ch <= 'z') || (ch >= '0' && ch <= '9') || strchr(extra, ch) != NULL;
}

bool sp_snap_valid_id(const char *id)
{
    if (id == NULL || strlen(id) != SP_SNAP_ID_LEN || strncmp(id, "snap-", 5) != 0)
        return false;
    for (const char *p = id + 5; *p; p++)
        if (!in_set(*p, ""))
            return false;
    return true;
}

int sp_snap_norm_name(const char *name, char *out, size_t cap, sp_err_t *err)
{
    size_t n = name ? strlen(name) : 0;
    if (n == 0 || n > SP_SNAP_NAME_MAX || cap < n + 1)
        return sp_err_set(err, SP_EINVAL, "name must be 1 to %d characters", SP_SNAP_NAME_MAX);
    for (size_t i = 0; i <= n; i++)
        out[i] = (char)(name[i] >= 'A' && name[i] <= 'Z' ? name[i] + 32 : name[i]);
    char *colon = strchr(out, ':');
    size_t alen = colon ? (size_t)(colon - out) : n;
    bool ok = alen > 0 && (colon == NULL || colon[1] != '\0');
    for (size_t i = 0; ok && i < alen; i++)
        ok = in_set(out[i], "-_");
    for (const char *p = colon ? colon + 1 : ""; ok && *p; p++)
        ok = in_set(*p, "-_.");
    if (!ok)
        return sp_err_set(err, SP_EINVAL,
                          "name must be alias[:tag]: alias of a-z, 0-9, '-' and '_', tag of "
                          "those and '.'");
    if (colon != NULL && strcmp(colon + 1, "default") == 0)
        *colon = '\0';
    return 0;
}
