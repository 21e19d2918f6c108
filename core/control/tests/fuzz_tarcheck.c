/*
 * fuzz_tarcheck.c - libFuzzer target for the template-file tar checker (scripts/fuzz run
 * tarcheck): any bytes, plain or gzip, fed whole and in two parts, must end in a verdict
 * without a crash, a leak or reading past what was given; both ways agree.
 */
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>

#include "core/control/tarcheck.h"
#include "tests/fuzz.h"

static int verdict(const uint8_t *p, size_t n, size_t split)
{
    char why[256];
    uint64_t entries;
    sp_tarcheck_t *t = sp_tarcheck_new(64u << 20);
    if (t == NULL)
        return -2;
    int rc = sp_tarcheck_feed(t, p, split, why, sizeof why);
    if (rc == 0)
        rc = sp_tarcheck_feed(t, p + split, n - split, why, sizeof why);
    if (rc == 0)
        rc = sp_tarcheck_end(t, &entries, why, sizeof why);
    sp_tarcheck_free(t);
    return rc;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    int a = verdict(data, size, size);
    int b = verdict(data, size, size / 3);
    ASSERT(a == b);
    return 0;
}
