/*
 * fuzz_egress_policy.c - libFuzzer target over egress policies (core/egress/egress_policy.h):
 * the JSON a client sends, each rule's text, and the two decision stages.
 *
 * The input is a policy as JSON, then a NUL, then a host (name or address) to decide on.
 * Checked: a policy that parses renders to JSON that parses to the same rendering (what the
 * API stores and shows back is stable); every rule renders within its buffer; deciding never
 * crashes, and a denial always says why.
 */
#include <jansson.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "core/egress/egress_policy.h"
#include "tests/fuzz.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    const uint8_t *z = memchr(data, '\0', size);
    size_t jn = z ? (size_t)(z - data) : size;
    const char *host = z ? (const char *)z + 1 : "";
    size_t hn = z ? size - jn - 1 : 0;
    json_t *j = json_loadb((const char *)data, jn, JSON_DECODE_ANY, NULL);
    if (j == NULL)
        return 0;
    sp_err_t e;
    sp_egp_t *p = sp_egp_from_json(j, "egress", &e);
    json_decref(j);
    if (p == NULL)
        return 0;
    json_t *out = sp_egp_to_json(p);
    ASSERT(out != NULL);
    sp_egp_t *p2 = sp_egp_from_json(out, "egress", &e);
    ASSERT(p2 != NULL);
    json_t *out2 = sp_egp_to_json(p2);
    ASSERT(out2 != NULL && json_equal(out, out2));
    json_decref(out);
    json_decref(out2);
    sp_egp_free(p2);
    for (size_t i = 0; i < p->nallow; i++) {
        char t[SP_EGP_MAX_RULE_LEN + 16];
        sp_egp_rule_format(&p->allow[i], t, sizeof(t));
        ASSERT(memchr(t, '\0', sizeof(t)) != NULL);
    }
    char name[SP_EGP_NAME_MAX + 1], why[160];
    sp_egp_addr_t a;
    bool by_name = false;
    uint16_t port = hn > 0 ? (uint16_t)(host[0] * 257) : 443;
    switch (sp_egp_host_parse(host, strnlen(host, hn), name, &a)) {
    case SP_EGP_HOST_NAME:
        why[0] = '\0';
        if (!sp_egp_check_name(p, name, port, &by_name, why, sizeof(why)))
            ASSERT(why[0] != '\0');
        break;
    case SP_EGP_HOST_ADDR:
        why[0] = '\0';
        if (!sp_egp_check_addr(p, &a, port, false, why, sizeof(why)))
            ASSERT(why[0] != '\0');
        break;
    default:
        break;
    }
    sp_egp_free(p);
    return 0;
}
