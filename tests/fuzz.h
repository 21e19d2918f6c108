/* What the libFuzzer targets (the fuzz_*.c files of the tests folders, built and run by
 * scripts/fuzz) share: the entry point's declaration and ASSERT, which aborts on a broken
 * expectation (libFuzzer then keeps the input as a crash). */
#ifndef SP_TESTS_FUZZ_H
#define SP_TESTS_FUZZ_H

#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

#define ASSERT(c)                                                                                  \
    do {                                                                                           \
        if (!(c))                                                                                  \
            abort();                                                                               \
    } while (0)

#endif
