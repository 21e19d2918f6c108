/*
 * egress_policy.c - parsing and matching of outbound rules (core/egress/egress_policy.h).
 *
 * Pure functions: the only allocations are a parsed policy's rule arrays.
 * Every string that reaches here came from a client or a guest, so each
 * parser bounds its input before looking at it.
 */
#include "core/egress/egress_policy.h"

#include <arpa/inet.h>
#include <ctype.h>
#include <ifaddrs.h>
#include <netinet/in.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ---- addresses ---- */

static bool prefix_match(const uint8_t *a, const uint8_t *net, unsigned prefix)
{
    unsigned full = prefix / 8, rest = prefix % 8;
    if (memcmp(a, net, full) != 0)
        return false;
    if (rest == 0)
        return true;
    uint8_t mask = (uint8_t)(0xffu << (8 - rest));
    return (a[full] & mask) == (net[full] & mask);
}

static const uint8_t v4mapped_prefix[12] = {0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff};

/* IPv4-mapped IPv6 is the IPv4 address it carries. */
static void addr_normalize(sp_egp_addr_t *a)
{
    if (a->family == 6 && memcmp(a->b, v4mapped_prefix, 12) == 0) {
        uint8_t v4[4];
        memcpy(v4, a->b + 12, 4);
        memset(a->b, 0, sizeof(a->b));
        memcpy(a->b, v4, 4);
        a->family = 4;
    }
}

int sp_egp_addr_from_sockaddr(const struct sockaddr *sa, sp_egp_addr_t *out)
{
    memset(out, 0, sizeof(*out));
    if (sa->sa_family == AF_INET) {
        out->family = 4;
        memcpy(out->b, &((const struct sockaddr_in *)(const void *)sa)->sin_addr, 4);
        return 0;
    }
    if (sa->sa_family == AF_INET6) {
        out->family = 6;
        memcpy(out->b, &((const struct sockaddr_in6 *)(const void *)sa)->sin6_addr, 16);
        addr_normalize(out);
        return 0;
    }
    return -1;
}

void sp_egp_addr_format(const sp_egp_addr_t *a, char *out, size_t cap)
{
    char buf[INET6_ADDRSTRLEN];
    if (inet_ntop(a->family == 4 ? AF_INET : AF_INET6, a->b, buf, sizeof(buf)) == NULL)
        snprintf(buf, sizeof(buf), "?");
    snprintf(out, cap, "%s", buf);
}

/* ---- always-denied ranges ---- */

struct range {
    uint8_t family, prefix;
    uint8_t b[16];
    const char *label;
};

static const struct range ranges[] = {
    {4, 32, {169, 254, 169, 254}, "metadata address"},
    {4, 32, {168, 63, 129, 16}, "metadata address"}, /* Azure's wire server */
    {4, 8, {0}, "unspecified address"},
    {4, 8, {10}, "private address"},
    {4, 10, {100, 64}, "shared (CGNAT) address"},
    {4, 8, {127}, "loopback address"},
    {4, 16, {169, 254}, "link-local address"},
    {4, 12, {172, 16}, "private address"},
    {4, 24, {192, 0, 0}, "reserved address"},
    {4, 16, {192, 168}, "private address"},
    {4, 15, {198, 18}, "reserved address"},
    {4, 4, {224}, "multicast address"},
    {4, 4, {240}, "reserved address"},
    {6,
     128,
     {0xfd, 0x00, 0x0e, 0xc2, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0x02, 0x54},
     "metadata address"},
    {6, 128, {0}, "unspecified address"},
    {6, 128, {0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1}, "loopback address"},
    {6, 96, {0}, "reserved address"}, /* IPv4-compatible */
    {6, 7, {0xfc}, "private address"},
    {6, 10, {0xfe, 0x80}, "link-local address"},
    {6, 10, {0xfe, 0xc0}, "reserved address"}, /* site-local */
    {6, 8, {0xff}, "multicast address"},
    {6, 64, {0x01, 0x00}, "reserved address"},                         /* discard */
    {6, 32, {0x20, 0x01, 0x00, 0x00}, "reserved address"},             /* Teredo */
    {6, 48, {0x00, 0x64, 0xff, 0x9b, 0x00, 0x01}, "reserved address"}, /* local NAT64 */
};

static const struct range nat64 = {6, 96, {0x00, 0x64, 0xff, 0x9b}, NULL};
static const struct range sixto4 = {6, 16, {0x20, 0x02}, NULL};

/* The host's own interface addresses: a guest must not reach the host's services by the host's
 * public address either. Refreshed from the loop (sp_egp_host_addrs_refresh), read by checks;
 * the lock makes a refresh and a check on another thread safe. */
static pthread_mutex_t host_mu = PTHREAD_MUTEX_INITIALIZER;
static sp_egp_addr_t host_addrs[SP_EGP_HOST_ADDRS_MAX];
static size_t nhost_addrs;

int sp_egp_host_addrs_refresh(void)
{
    struct ifaddrs *ifs;
    if (getifaddrs(&ifs) < 0)
        return -1;
    sp_egp_addr_t got[SP_EGP_HOST_ADDRS_MAX];
    size_t n = 0;
    for (struct ifaddrs *i = ifs; i != NULL && n < SP_EGP_HOST_ADDRS_MAX; i = i->ifa_next) {
        if (i->ifa_addr == NULL)
            continue;
        sp_egp_addr_t a = {0};
        if (i->ifa_addr->sa_family == AF_INET) {
            a.family = 4;
            memcpy(a.b, &((struct sockaddr_in *)(void *)i->ifa_addr)->sin_addr, 4);
        } else if (i->ifa_addr->sa_family == AF_INET6) {
            a.family = 6;
            memcpy(a.b, &((struct sockaddr_in6 *)(void *)i->ifa_addr)->sin6_addr, 16);
        } else {
            continue;
        }
        addr_normalize(&a);
        got[n++] = a;
    }
    freeifaddrs(ifs);
    pthread_mutex_lock(&host_mu);
    memcpy(host_addrs, got, n * sizeof(got[0]));
    nhost_addrs = n;
    pthread_mutex_unlock(&host_mu);
    return (int)n;
}

static bool is_host_addr(const sp_egp_addr_t *a)
{
    bool hit = false;
    pthread_mutex_lock(&host_mu);
    for (size_t i = 0; i < nhost_addrs && !hit; i++)
        hit = host_addrs[i].family == a->family &&
              memcmp(host_addrs[i].b, a->b, a->family == 4 ? 4 : 16) == 0;
    pthread_mutex_unlock(&host_mu);
    return hit;
}

static bool is_loopback(const sp_egp_addr_t *a)
{
    static const uint8_t v6lo[16] = {0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1};
    return (a->family == 4 && a->b[0] == 127) || (a->family == 6 && memcmp(a->b, v6lo, 16) == 0);
}

/* The most specific always-denied range holding a (a normalized), or false. For NAT64 and
 * 6to4 addresses whose embedded IPv4 address is denied, the range is the translation prefix
 * itself (a rule must lie inside it to open the address) with the IPv4 label. */
static bool find_range(const sp_egp_addr_t *a, struct range *hit)
{
    const struct range *best = NULL;
    for (size_t i = 0; i < sizeof(ranges) / sizeof(ranges[0]); i++) {
        const struct range *r = &ranges[i];
        if (r->family == a->family && prefix_match(a->b, r->b, r->prefix) &&
            (best == NULL || r->prefix > best->prefix))
            best = r;
    }
    /* A host address is a range of one address even inside a wider range (a private one):
     * a rule opening 10.0.0.0/8 opens that network, not the host's own 10.x address. Loopback
     * keeps its range and label: a rule for 127.0.0.0/8 opens the host's 127.0.0.1 as before. */
    unsigned one = a->family == 4 ? 32 : 128;
    if ((best == NULL || (best->prefix < one && !is_loopback(a))) && is_host_addr(a)) {
        hit->family = a->family;
        hit->prefix = (uint8_t)one;
        memcpy(hit->b, a->b, sizeof(hit->b));
        hit->label = "host address";
        return true;
    }
    if (best != NULL) {
        *hit = *best;
        return true;
    }
    const struct range *tr = NULL;
    sp_egp_addr_t inner = {.family = 4};
    if (a->family == 6 && prefix_match(a->b, nat64.b, nat64.prefix)) {
        tr = &nat64;
        memcpy(inner.b, a->b + 12, 4);
    } else if (a->family == 6 && prefix_match(a->b, sixto4.b, sixto4.prefix)) {
        tr = &sixto4;
        memcpy(inner.b, a->b + 2, 4);
    }
    struct range in;
    if (tr != NULL && find_range(&inner, &in)) {
        *hit = *tr;
        hit->label = in.label;
        return true;
    }
    return false;
}

const char *sp_egp_special_range(const sp_egp_addr_t *a)
{
    sp_egp_addr_t n = *a;
    addr_normalize(&n);
    struct range hit;
    return find_range(&n, &hit) ? hit.label : NULL;
}

/* ---- names ---- */

/* Copies a host name in normal form (lowercase, no trailing dot) after checking its syntax:
 * labels of 1..63 letters, digits, '-' or '_', 253 characters at most. */
static bool name_normalize(const char *s, size_t len, char *out)
{
    if (len > 0 && s[len - 1] == '.')
        len--;
    if (len == 0 || len > SP_EGP_NAME_MAX)
        return false;
    size_t label = 0;
    for (size_t i = 0; i < len; i++) {
        unsigned char c = (unsigned char)s[i];
        if (c == '.') {
            if (label == 0 || s[i - 1] == '-')
                return false;
            label = 0;
        } else if (c == '-' && label == 0) {
            return false; /* a label neither starts nor ends with '-' */
        } else if (isalnum(c) || c == '-' || c == '_') {
            if (++label > 63)
                return false;
        } else {
            return false;
        }
        out[i] = (char)tolower(c);
    }
    if (label == 0 || s[len - 1] == '-')
        return false;
    out[len] = '\0';
    return true;
}

/* A name whose last label is all digits is no DNS name: it is a malformed address. */
static bool last_label_numeric(const char *name)
{
    const char *dot = strrchr(name, '.');
    const char *l = dot ? dot + 1 : name;
    for (; *l; l++)
        if (!isdigit((unsigned char)*l))
            return false;
    return true;
}

/* True when inet_aton (and so getaddrinfo) would read s as an IPv4 address. */
static bool loose_ipv4(const char *s)
{
    struct in_addr ia;
    return inet_aton(s, &ia) != 0;
}

sp_egp_host_kind_t sp_egp_host_parse(const char *host, size_t len, char *name, sp_egp_addr_t *addr)
{
    char buf[SP_EGP_NAME_MAX + 8];
    if (host == NULL || len == 0 || len >= sizeof(buf) || memchr(host, '\0', len) != NULL)
        return SP_EGP_HOST_BAD;
    memcpy(buf, host, len);
    buf[len] = '\0';
    memset(addr, 0, sizeof(*addr));
    if (buf[0] == '[') {
        if (buf[len - 1] != ']')
            return SP_EGP_HOST_BAD;
        buf[len - 1] = '\0';
        if (inet_pton(AF_INET6, buf + 1, addr->b) != 1)
            return SP_EGP_HOST_BAD;
        addr->family = 6;
        addr_normalize(addr);
        return SP_EGP_HOST_ADDR;
    }
    if (inet_pton(AF_INET, buf, addr->b) == 1) {
        addr->family = 4;
        return SP_EGP_HOST_ADDR;
    }
    if (inet_pton(AF_INET6, buf, addr->b) == 1) {
        addr->family = 6;
        addr_normalize(addr);
        return SP_EGP_HOST_ADDR;
    }
    if (loose_ipv4(buf))
        return SP_EGP_HOST_BAD;
    if (!name_normalize(buf, len, name) || last_label_numeric(name))
        return SP_EGP_HOST_BAD;
    return SP_EGP_HOST_NAME;
}

/* ---- rules ---- */

static int parse_port(const char *s, uint16_t *out)
{
    if (*s == '\0' || strlen(s) > 5)
        return -1;
    unsigned long v = 0;
    for (const char *p = s; *p; p++) {
        if (!isdigit((unsigned char)*p))
            return -1;
        v = v * 10 + (unsigned long)(*p - '0');
    }
    if (v < 1 || v > 65535)
        return -1;
    *out = (uint16_t)v;
    return 0;
}

static int parse_cidr(char *host, sp_egp_rule_t *r, sp_err_t *err)
{
    char *slash = strchr(host, '/');
    int plen = -1;
    if (slash != NULL) {
        *slash = '\0';
        const char *ps = slash + 1;
        if (*ps == '\0' || strlen(ps) > 3)
            return sp_err_set(err, SP_EINVAL, "bad prefix length");
        plen = 0;
        for (; *ps; ps++) {
            if (!isdigit((unsigned char)*ps))
                return sp_err_set(err, SP_EINVAL, "bad prefix length");
            plen = plen * 10 + (*ps - '0');
        }
    }
    sp_egp_addr_t a = {0};
    if (inet_pton(AF_INET, host, a.b) == 1) {
        a.family = 4;
    } else if (inet_pton(AF_INET6, host, a.b) == 1) {
        a.family = 6;
    } else {
        return sp_err_set(err, SP_EINVAL, "not an IP address");
    }
    int max = a.family == 4 ? 32 : 128;
    if (plen < 0)
        plen = max;
    if (plen > max)
        return sp_err_set(err, SP_EINVAL, "prefix length over %d", max);
    if (a.family == 6 && memcmp(a.b, v4mapped_prefix, 12) == 0) {
        if (plen < 96)
            return sp_err_set(err, SP_EINVAL, "IPv4-mapped network shorter than /96");
        addr_normalize(&a);
        plen -= 96;
        max = 32;
    }
    /* Host bits must be zero: "10.0.0.1/8" is probably a typo, and says so. */
    sp_egp_addr_t net = a;
    unsigned bytes = a.family == 4 ? 4 : 16;
    for (unsigned i = 0; i < bytes; i++) {
        int keep = plen - (int)i * 8;
        uint8_t mask = keep >= 8 ? 0xff : keep <= 0 ? 0 : (uint8_t)(0xffu << (8 - keep));
        net.b[i] = a.b[i] & mask;
    }
    if (memcmp(net.b, a.b, bytes) != 0) {
        char t[INET6_ADDRSTRLEN];
        sp_egp_addr_format(&net, t, sizeof(t));
        return sp_err_set(err, SP_EINVAL, "host bits are set (the network is %s/%d)", t, plen);
    }
    r->kind = SP_EGP_R_CIDR;
    r->net = net;
    r->prefix = (uint8_t)plen;
    return 0;
}

int sp_egp_rule_parse(const char *text, sp_egp_rule_t *out, sp_err_t *err)
{
    memset(out, 0, sizeof(*out));
    size_t len = text ? strlen(text) : 0;
    if (len == 0)
        return sp_err_set(err, SP_EINVAL, "empty rule");
    if (len > SP_EGP_MAX_RULE_LEN)
        return sp_err_set(err, SP_EINVAL, "longer than %d characters", SP_EGP_MAX_RULE_LEN);
    char host[SP_EGP_MAX_RULE_LEN + 1];
    const char *port = NULL;
    bool bracketed = false;
    if (text[0] == '[') {
        const char *close = strchr(text, ']');
        if (close == NULL)
            return sp_err_set(err, SP_EINVAL, "'[' without ']'");
        if (close[1] != '\0' && close[1] != ':')
            return sp_err_set(err, SP_EINVAL, "unexpected text after ']'");
        if (close[1] == ':')
            port = close + 2;
        memcpy(host, text + 1, (size_t)(close - text - 1));
        host[close - text - 1] = '\0';
        bracketed = true;
    } else {
        const char *c1 = strchr(text, ':');
        if (c1 != NULL && strchr(c1 + 1, ':') == NULL) {
            port = c1 + 1;
            memcpy(host, text, (size_t)(c1 - text));
            host[c1 - text] = '\0';
        } else {
            memcpy(host, text, len + 1); /* no colon, or a bare IPv6 address */
        }
    }
    if (port != NULL && parse_port(port, &out->port) < 0)
        return sp_err_set(err, SP_EINVAL, "port must be 1 to 65535");
    if (host[0] == '\0')
        return sp_err_set(err, SP_EINVAL, "no host");
    if (bracketed) {
        if (strchr(host, ':') == NULL)
            return sp_err_set(err, SP_EINVAL, "brackets are for IPv6 addresses");
        return parse_cidr(host, out, err);
    }
    if (strcmp(host, "*") == 0) {
        out->kind = SP_EGP_R_ANY;
        return 0;
    }
    if (strchr(host, '/') != NULL || strchr(host, ':') != NULL)
        return parse_cidr(host, out, err);
    sp_egp_addr_t a;
    if (inet_pton(AF_INET, host, a.b) == 1)
        return parse_cidr(host, out, err);
    const char *name = host;
    out->kind = SP_EGP_R_DOMAIN;
    if (strncmp(host, "*.", 2) == 0) {
        name = host + 2;
        out->kind = SP_EGP_R_SUFFIX;
    }
    if (strchr(name, '*') != NULL)
        return sp_err_set(err, SP_EINVAL, "'*' is allowed only as \"*\" or a leading \"*.\"");
    if (!name_normalize(name, strlen(name), out->name))
        return sp_err_set(err, SP_EINVAL, "not a host name, IP address or CIDR");
    /* on the normal form: "0.0.0.0xa." is the name "0.0.0.0xa" as stored and shown back */
    if (loose_ipv4(out->name))
        return sp_err_set(err, SP_EINVAL, "ambiguous numeric address (write a dotted quad)");
    if (last_label_numeric(out->name))
        return sp_err_set(err, SP_EINVAL, "not a valid IP address");
    return 0;
}

void sp_egp_rule_format(const sp_egp_rule_t *r, char *out, size_t cap)
{
    char host[SP_EGP_NAME_MAX + 8];
    bool v6 = false;
    switch (r->kind) {
    case SP_EGP_R_ANY:
        snprintf(host, sizeof(host), "*");
        break;
    case SP_EGP_R_DOMAIN:
        snprintf(host, sizeof(host), "%s", r->name);
        break;
    case SP_EGP_R_SUFFIX:
        snprintf(host, sizeof(host), "*.%s", r->name);
        break;
    default: {
        char a[INET6_ADDRSTRLEN];
        sp_egp_addr_format(&r->net, a, sizeof(a));
        v6 = r->net.family == 6;
        if (r->prefix == (v6 ? 128 : 32))
            snprintf(host, sizeof(host), "%s", a);
        else
            snprintf(host, sizeof(host), "%s/%u", a, (unsigned)r->prefix);
        break;
    }
    }
    if (r->port == 0)
        snprintf(out, cap, "%s", host);
    else if (v6)
        snprintf(out, cap, "[%s]:%u", host, (unsigned)r->port);
    else
        snprintf(out, cap, "%s:%u", host, (unsigned)r->port);
}

/* ---- policies ---- */

sp_egp_t *sp_egp_default(void)
{
    sp_egp_t *p = calloc(1, sizeof(*p));
    if (p != NULL)
        p->internet = true;
    return p;
}

void sp_egp_free(sp_egp_t *p)
{
    if (p == NULL)
        return;
    free(p->allow);
    free(p->deny);
    free(p);
}

static int parse_list(const json_t *arr, const char *what, const char *key, sp_egp_rule_t **out,
                      size_t *n, sp_err_t *err)
{
    *out = NULL;
    *n = 0;
    if (arr == NULL || json_is_null(arr))
        return 0;
    if (!json_is_array(arr))
        return sp_err_set(err, SP_EINVAL, "%s.%s must be an array of strings", what, key);
    size_t cnt = json_array_size(arr);
    if (cnt > SP_EGP_MAX_RULES)
        return sp_err_set(err, SP_EINVAL, "%s.%s has more than %d rules", what, key,
                          SP_EGP_MAX_RULES);
    if (cnt == 0)
        return 0;
    sp_egp_rule_t *rules = calloc(cnt, sizeof(*rules));
    if (rules == NULL)
        return sp_err_set(err, SP_EINTERNAL, "out of memory");
    for (size_t i = 0; i < cnt; i++) {
        const json_t *v = json_array_get(arr, i);
        if (!json_is_string(v)) {
            free(rules);
            return sp_err_set(err, SP_EINVAL, "%s.%s[%zu] must be a string", what, key, i);
        }
        const char *s = json_string_value(v);
        sp_err_t e;
        if (strlen(s) != json_string_length(v)) {
            free(rules);
            return sp_err_set(err, SP_EINVAL, "%s.%s[%zu] contains NUL", what, key, i);
        }
        if (sp_egp_rule_parse(s, &rules[i], &e) < 0) {
            free(rules);
            return sp_err_set(err, SP_EINVAL, "%s.%s[%zu] '%.60s': %s", what, key, i, s, e.msg);
        }
    }
    *out = rules;
    *n = cnt;
    return 0;
}

sp_egp_t *sp_egp_from_json(const json_t *obj, const char *what, sp_err_t *err)
{
    if (what == NULL)
        what = "egress";
    if (obj == NULL || json_is_null(obj)) {
        sp_egp_t *d = sp_egp_default();
        if (d == NULL)
            sp_err_set(err, SP_EINTERNAL, "out of memory");
        return d;
    }
    if (!json_is_object(obj)) {
        sp_err_set(err, SP_EINVAL, "%s must be an object", what);
        return NULL;
    }
    const char *k;
    const json_t *v;
    json_object_foreach((json_t *)obj, k, v)
    {
        if (strcmp(k, "internet") != 0 && strcmp(k, "allow") != 0 && strcmp(k, "deny") != 0) {
            sp_err_set(err, SP_EINVAL, "%s has an unknown field '%.64s'", what, k);
            return NULL;
        }
    }
    const json_t *inet = json_object_get(obj, "internet");
    if (inet != NULL && !json_is_null(inet) && !json_is_boolean(inet)) {
        sp_err_set(err, SP_EINVAL, "%s.internet must be true or false", what);
        return NULL;
    }
    sp_egp_t *p = sp_egp_default();
    if (p == NULL) {
        sp_err_set(err, SP_EINTERNAL, "out of memory");
        return NULL;
    }
    p->internet = inet == NULL || json_is_null(inet) || json_is_true(inet);
    if (parse_list(json_object_get(obj, "allow"), what, "allow", &p->allow, &p->nallow, err) < 0 ||
        parse_list(json_object_get(obj, "deny"), what, "deny", &p->deny, &p->ndeny, err) < 0) {
        sp_egp_free(p);
        return NULL;
    }
    return p;
}

json_t *sp_egp_to_json(const sp_egp_t *p)
{
    json_t *allow = json_array(), *deny = json_array();
    char buf[SP_EGP_MAX_RULE_LEN + 16];
    for (size_t i = 0; i < p->nallow; i++) {
        sp_egp_rule_format(&p->allow[i], buf, sizeof(buf));
        json_array_append_new(allow, json_string(buf));
    }
    for (size_t i = 0; i < p->ndeny; i++) {
        sp_egp_rule_format(&p->deny[i], buf, sizeof(buf));
        json_array_append_new(deny, json_string(buf));
    }
    return json_pack("{s:b,s:o,s:o}", "internet", p->internet, "allow", allow, "deny", deny);
}

/* ---- decisions ---- */

/* Does the rule's port cover the question's? Port 0 asks about any port: a deny rule limited
 * to one port cannot close it, an allow rule limited to one port opens it. */
static bool port_ok(const sp_egp_rule_t *r, uint16_t port, bool deny)
{
    if (r->port == 0)
        return true;
    if (port == 0)
        return !deny;
    return r->port == port;
}

static bool name_match(const sp_egp_rule_t *r, const char *name)
{
    switch (r->kind) {
    case SP_EGP_R_ANY:
        return true;
    case SP_EGP_R_DOMAIN:
        return strcmp(r->name, name) == 0;
    case SP_EGP_R_SUFFIX: {
        size_t nl = strlen(name), sl = strlen(r->name);
        return nl > sl + 1 && name[nl - sl - 1] == '.' && strcmp(name + nl - sl, r->name) == 0;
    }
    default:
        return false;
    }
}

static bool addr_match(const sp_egp_rule_t *r, const sp_egp_addr_t *a)
{
    if (r->kind == SP_EGP_R_ANY)
        return true;
    return r->kind == SP_EGP_R_CIDR && r->net.family == a->family &&
           prefix_match(a->b, r->net.b, r->prefix);
}

static void deny_reason(const sp_egp_rule_t *r, char *reason, size_t cap)
{
    char t[SP_EGP_MAX_RULE_LEN + 16];
    sp_egp_rule_format(r, t, sizeof(t));
    snprintf(reason, cap, "denied by rule '%.80s'", t);
}

bool sp_egp_check_name(const sp_egp_t *p, const char *name, uint16_t port, bool *by_name,
                       char *reason, size_t cap)
{
    *by_name = false;
    for (size_t i = 0; i < p->ndeny; i++) {
        const sp_egp_rule_t *r = &p->deny[i];
        if (name_match(r, name) && port_ok(r, port, true)) {
            deny_reason(r, reason, cap);
            return false;
        }
    }
    for (size_t i = 0; i < p->nallow && !*by_name; i++) {
        const sp_egp_rule_t *r = &p->allow[i];
        *by_name = name_match(r, name) && port_ok(r, port, false);
    }
    if (!*by_name && !p->internet) {
        snprintf(reason, cap, "internet access is off and the name is not in the allow list");
        return false;
    }
    return true;
}

bool sp_egp_check_addr(const sp_egp_t *p, const sp_egp_addr_t *addr, uint16_t port, bool by_name,
                       char *reason, size_t cap)
{
    sp_egp_addr_t a = *addr;
    addr_normalize(&a);
    /* Deny rules see through NAT64 and 6to4 too: closing 203.0.113.0/24 closes its
     * translations. */
    sp_egp_addr_t inner = {.family = 0};
    if (a.family == 6 && prefix_match(a.b, nat64.b, nat64.prefix)) {
        inner.family = 4;
        memcpy(inner.b, a.b + 12, 4);
    } else if (a.family == 6 && prefix_match(a.b, sixto4.b, sixto4.prefix)) {
        inner.family = 4;
        memcpy(inner.b, a.b + 2, 4);
    }
    for (size_t i = 0; i < p->ndeny; i++) {
        const sp_egp_rule_t *r = &p->deny[i];
        if (port_ok(r, port, true) &&
            (addr_match(r, &a) || (inner.family == 4 && addr_match(r, &inner)))) {
            deny_reason(r, reason, cap);
            return false;
        }
    }
    struct range hit;
    if (find_range(&a, &hit)) {
        /* Only an allow rule that names an address or network inside the range opens it. */
        for (size_t i = 0; i < p->nallow; i++) {
            const sp_egp_rule_t *r = &p->allow[i];
            if (r->kind == SP_EGP_R_CIDR && r->net.family == hit.family &&
                r->prefix >= hit.prefix && prefix_match(r->net.b, hit.b, hit.prefix) &&
                addr_match(r, &a) && port_ok(r, port, false))
                return true;
        }
        snprintf(reason, cap, "%s", hit.label);
        return false;
    }
    if (by_name)
        return true;
    for (size_t i = 0; i < p->nallow; i++) {
        const sp_egp_rule_t *r = &p->allow[i];
        if (addr_match(r, &a) && port_ok(r, port, false))
            return true;
    }
    if (!p->internet) {
        snprintf(reason, cap, "internet access is off and the address is not in the allow list");
        return false;
    }
    return true;
}
