/*
 * fuzz_sni.c - libFuzzer target over the ClientHello server-name reader (core/egress/sni.h).
 *
 * Checked: the verdict is one of SP_SNI_*; a found name is NUL-terminated inside its buffer
 * and holds no NUL of its own; and a prefix of the input says "need more" or the same as the
 * whole (the proxy calls it again as bytes arrive, so the two must never disagree).
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "core/egress/sni.h"
#include "tests/fuzz.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    char name[256], part[256];
    int rc = sp_sni_peek(data, size, name, sizeof(name));
    ASSERT(rc >= SP_SNI_NEED && rc <= SP_SNI_BAD);
    if (rc == SP_SNI_FOUND)
        ASSERT(memchr(name, '\0', sizeof(name)) != NULL && name[0] != '\0');
    for (size_t cut = 0; cut < size; cut += 1 + size / 16) {
        int r2 = sp_sni_peek(data, cut, part, sizeof(part));
        ASSERT(r2 == SP_SNI_NEED || r2 == rc);
        if (r2 == SP_SNI_FOUND)
            ASSERT(strcmp(part, name) == 0);
    }
    return 0;
}
