/*
 * fuzz_multipart.c - libFuzzer target over the multipart/form-data parser
 * (e2b-gateway/multipart.h), which reads upload bodies from clients.
 *
 * The input is a Content-Type line, a newline, then the body. Checked: every part's data lies
 * inside the body and parts do not overlap or go backwards; names stay within their bounds;
 * once the parser has failed or finished it says so again on every later call.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "e2b-gateway/multipart.h"
#include "tests/fuzz.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    const uint8_t *nl = memchr(data, '\n', size < 512 ? size : 512);
    if (nl == NULL)
        return 0;
    char ct[512];
    size_t cl = (size_t)(nl - data);
    memcpy(ct, data, cl);
    ct[cl] = '\0';
    const uint8_t *body = nl + 1;
    size_t n = size - cl - 1;
    sp_multipart_t m;
    sp_err_t e;
    if (sp_multipart_init(&m, ct, body, n, &e) < 0)
        return 0;
    const uint8_t *last_end = body;
    int rc;
    for (int i = 0; i < 10000; i++) {
        sp_multipart_part_t part;
        rc = sp_multipart_next(&m, &part, &e);
        if (rc != 1)
            break;
        ASSERT(part.data >= last_end && part.data + part.len <= body + n);
        ASSERT(strlen(part.name) <= SP_MULTIPART_NAME_MAX);
        ASSERT(part.filename == NULL || strlen(part.filename) <= SP_MULTIPART_NAME_MAX);
        last_end = part.data + part.len;
    }
    sp_multipart_part_t again;
    if (rc <= 0)
        ASSERT(sp_multipart_next(&m, &again, &e) == rc);
    return 0;
}
