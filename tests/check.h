/* Assertions for the C test programs, each one file that includes this once.
 *
 * CHECK counts a failure and goes on, so one run reports every broken expectation; main
 * ends with `return check_report("name")`. REQUIRE ends the program at once, for a step the
 * rest of the test cannot do without (a VM that did not start, a socket that did not open). */
#ifndef SP_TESTS_CHECK_H
#define SP_TESTS_CHECK_H

#include <stdio.h>
#include <stdlib.h>

static int failures __attribute__((unused)); /* CHECKs failed so far */

#define CHECK(c)                                                                                   \
    do {                                                                                           \
        if (!(c)) {                                                                                \
            fprintf(stderr, "%s:%d: CHECK failed: %s\n", __FILE__, __LINE__, #c);                  \
            failures++;                                                                            \
        }                                                                                          \
    } while (0)

#define REQUIRE(c)                                                                                 \
    do {                                                                                           \
        if (!(c)) {                                                                                \
            fprintf(stderr, "%s:%d: REQUIRE failed: %s\n", __FILE__, __LINE__, #c);                \
            exit(1);                                                                               \
        }                                                                                          \
    } while (0)

/* The end of main: how many CHECKs failed (stderr, exit status 1), or that name passed. */
static inline int check_report(const char *name)
{
    if (failures) {
        fprintf(stderr, "%s: %d check(s) failed\n", name, failures);
        return 1;
    }
    printf("%s: ok\n", name);
    return 0;
}

#endif
