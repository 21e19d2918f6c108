/*
 * fuzz_connect.c - libFuzzer target over the Connect bytes envd requests arrive in
 * (e2b-gateway/connect.h): envelopes and both codecs, driven the way sp_connect_read_msg
 * reads a request body.
 *
 * The first byte picks the codec (bit 0: proto), unary or streaming (bit 1) and the message
 * (the rest, modulo the tables below, requests first); the remaining bytes are the body.
 * Checked: envelopes walked over the body stay inside it, move forward, and written again are
 * the bytes they were read from; a message that decodes encodes again (in both codecs), and
 * what it encodes to decodes and encodes to the same bytes; the arena is freed in one go
 * (ASan's leak check sees the rest). Header values (content type, timeout, keepalive) and
 * base64 are fed the body as text.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "e2b-gateway/connect.h"
#include "tests/fuzz.h"

static const sp_cdesc_t *const descs[] = {
    &sp_cd_start_req,       &sp_cd_select_req,       &sp_cd_update_req, &sp_cd_send_input_req,
    &sp_cd_send_signal_req, &sp_cd_stream_input_req, &sp_cd_path_req,   &sp_cd_move_req,
    &sp_cd_listdir_req,     &sp_cd_watch_req,        &sp_cd_watcher,    &sp_cd_empty,
    &sp_cd_event_resp,      &sp_cd_list_resp,        &sp_cd_info,       &sp_cd_entry_resp,
    &sp_cd_listdir_resp,    &sp_cd_events_resp,      &sp_cd_watch_resp, &sp_cd_entry,
};
#define NDESCS (sizeof(descs) / sizeof(descs[0]))

static void envelopes(const uint8_t *p, size_t n)
{
    size_t off = 0;
    sp_buf_t again = {0};
    for (;;) {
        size_t before = off, len = 0;
        uint8_t flags = 0;
        const uint8_t *pl = NULL;
        sp_err_t err;
        int rc = sp_connect_envelope_next(p, n, &off, &flags, &pl, &len, &err);
        ASSERT(rc >= -1 && rc <= 1);
        if (rc <= 0) {
            ASSERT(off == before);
            ASSERT(rc == 0 ? off >= n : err.code == SP_EINVAL);
            break;
        }
        ASSERT(off == before + SP_CONNECT_ENV_HDR + len && off <= n);
        ASSERT(pl == p + before + SP_CONNECT_ENV_HDR);
        ASSERT(!(flags & SP_CONNECT_FLAG_COMPRESSED));
        sp_connect_envelope_add(&again, flags, pl, len);
        ASSERT(!again.oom && again.len == off && memcmp(again.p, p, off) == 0);
    }
    sp_buf_free(&again);
}

/* encode(m) in codec k, decoded and encoded again, gives the same bytes. */
static void stable(sp_connect_codec_t k, const sp_cdesc_t *d, const void *m)
{
    sp_buf_t a = {0}, b = {0};
    if (sp_connect_encode(k, d, m, &a) == 0) {
        void *back = calloc(1, d->size);
        ASSERT(back != NULL);
        sp_carena_t ar = {0};
        sp_err_t err;
        ASSERT(sp_connect_decode(k, d, a.p, a.len, back, &ar, &err) == 0);
        ASSERT(sp_connect_encode(k, d, back, &b) == 0);
        ASSERT(a.len == b.len && (a.len == 0 || memcmp(a.p, b.p, a.len) == 0));
        sp_carena_free(&ar);
        free(back);
    }
    sp_buf_free(&a);
    sp_buf_free(&b);
}

static void text(const uint8_t *p, size_t n)
{
    char *s = malloc(n + 1);
    ASSERT(s != NULL);
    memcpy(s, p, n);
    s[n] = '\0';
    sp_connect_req_t cr;
    uint32_t v = 7;
    if (sp_connect_content_type(s, &cr) == 0)
        ASSERT(cr.codec == SP_CONNECT_JSON || cr.codec == SP_CONNECT_PROTO);
    if (sp_connect_parse_timeout(s, &v) == 0)
        ASSERT(v >= 1);
    if (sp_connect_parse_keepalive(s, &v) == 0)
        ASSERT(v >= 1);
    sp_ctime_t t;
    (void)sp_connect_parse_time(s, &t);
    uint8_t *bin = malloc(3 * (n / 4 + 1));
    ASSERT(bin != NULL);
    long bl = sp_connect_b64_decode(s, n, bin);
    if (bl >= 0) {
        ASSERT((size_t)bl <= 3 * (n / 4 + 1));
        char *enc = malloc(4 * ((size_t)bl / 3 + 1) + 1);
        ASSERT(enc != NULL);
        size_t el = sp_connect_b64_encode(bin, (size_t)bl, enc);
        uint8_t *bin2 = malloc(3 * (el / 4 + 1));
        ASSERT(bin2 != NULL);
        ASSERT(sp_connect_b64_decode(enc, el, bin2) == bl && memcmp(bin, bin2, (size_t)bl) == 0);
        free(bin2);
        free(enc);
    }
    free(bin);
    free(s);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    if (size < 1)
        return 0;
    sp_connect_req_t cr = {0};
    cr.codec = data[0] & 1 ? SP_CONNECT_PROTO : SP_CONNECT_JSON;
    cr.streaming = (data[0] & 2) != 0;
    const sp_cdesc_t *d = descs[(data[0] >> 2) % NDESCS];
    const uint8_t *body = size > 1 ? data + 1 : NULL;
    size_t n = size - 1;

    envelopes(body, n);
    text(data + 1, n);

    void *msg = malloc(d->size);
    ASSERT(msg != NULL);
    memset(msg, 0xa5, d->size); /* decode zeroes it first */
    sp_carena_t ar = {0};
    sp_err_t err;
    if (sp_connect_decode_body(&cr, d, body, n, msg, &ar, &err) == 0) {
        stable(SP_CONNECT_JSON, d, msg);
        stable(SP_CONNECT_PROTO, d, msg);
    } else {
        ASSERT(err.code == SP_EINVAL && memchr(err.msg, '\0', sizeof(err.msg)) != NULL);
    }
    sp_carena_free(&ar);
    free(msg);
    return 0;
}
