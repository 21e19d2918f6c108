/*
 * fuzz_agentproto.c - libFuzzer target over the frame reader and every
 * payload decoder. The input is fed to the reader in chunks whose sizes come
 * from the input itself, so split headers and skips are exercised too.
 */
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "base/agentproto.h"
#include "tests/fuzz.h"

static void decode_payload(const sp_ap_hdr_t *h, const uint8_t *p)
{
    static sp_ap_proc_start_t ps;
    static sp_ap_identity_t id;
    static sp_ap_egress_config_t eg;
    sp_ap_hello_t hello;
    sp_ap_error_t err;
    sp_ap_entry_t e;
    uint32_t code;
    char s[64];
    sp_ap_fields_t f;
    sp_ap_field_t x;
    (void)sp_ap_check_from_host(h->type, h->stream, &code);
    (void)sp_ap_dec_proc_start(p, h->len, &ps, NULL);
    (void)sp_ap_dec_identity(p, h->len, &id, NULL);
    (void)sp_ap_dec_egress_config(p, h->len, &eg, NULL);
    (void)sp_ap_dec_hello(p, h->len, &hello, NULL);
    (void)sp_ap_dec_error(p, h->len, &err, NULL);
    (void)sp_ap_dec_entry(p, h->len, &e, NULL);
    sp_ap_fields_init(&f, p, h->len);
    while (sp_ap_fields_next(&f, &x) == 1)
        (void)sp_ap_field_str(&x, s, sizeof(s));
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    /* Small buffer on purpose: the skip path for "too big for the buffer" runs often. */
    static uint8_t rbuf[4096];
    sp_ap_reader_t r;
    sp_ap_reader_init(&r, rbuf, sizeof(rbuf));
    size_t off = 0;
    while (off < size) {
        size_t chunk = 1 + data[off] % 97;
        size_t avail;
        uint8_t *dst = sp_ap_reader_space(&r, &avail);
        if (chunk > size - off)
            chunk = size - off;
        if (chunk > avail)
            chunk = avail;
        memcpy(dst, data + off, chunk);
        sp_ap_reader_commit(&r, chunk);
        off += chunk;
        sp_ap_hdr_t h;
        const uint8_t *p;
        sp_ap_rd_result_t rc;
        while ((rc = sp_ap_reader_next(&r, &h, &p)) != SP_AP_RD_NEED)
            if (rc == SP_AP_RD_FRAME)
                decode_payload(&h, p);
    }
    /* The whole input as one payload too. */
    sp_ap_hdr_t h = {.len = (uint32_t)(size > SP_AP_MAX_PAYLOAD ? SP_AP_MAX_PAYLOAD : size)};
    decode_payload(&h, data);
    return 0;
}
