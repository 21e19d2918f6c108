/*
 * tmplname.c - template and package names checked (tmplbuild.h), apart from the builds in
 * tmplbuild.c: pure, so the body fuzzer (tests/fuzz_bodies.c) links it alone.
 */
#include "guest/tmplbuild.h"

#include <ctype.h>
#include <string.h>

/* min to max bytes of [a-z0-9] and the characters in more, the first of [a-z0-9]. */
bool sp_tmplbuild__valid_word(const char *s, size_t min, size_t max, const char *more)
{
    size_t n = strlen(s);
    if (n < min || n > max || !(islower((unsigned char)s[0]) || isdigit((unsigned char)s[0])))
        return false;
    for (size_t i = 0; i < n; i++) {
        unsigned char c = (unsigned char)s[i];
        if (!(islower(c) || isdigit(c) || strchr(more, c) != NULL))
            return false;
    }
    return true;
}

bool sp_tmplbuild_valid_name(const char *s)
{
    return sp_tmplbuild__valid_word(s, 1, 63, "._-");
}
