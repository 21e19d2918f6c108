/*
 * test_egress_policy.c - rule parsing and the two decision stages of core/egress/egress_policy.h.
 */
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "core/egress/egress_policy.h"
#include "tests/check.h"

static sp_egp_t *policy(const char *json)
{
    json_error_t je;
    json_t *o = json_loads(json, 0, &je);
    sp_err_t e = {0};
    sp_egp_t *p = sp_egp_from_json(o, "egress", &e);
    if (p == NULL)
        fprintf(stderr, "policy %s: %s\n", json, e.msg);
    json_decref(o);
    return p;
}

static sp_egp_addr_t addr(const char *s)
{
    sp_egp_addr_t a;
    char name[SP_EGP_NAME_MAX + 1];
    memset(&a, 0, sizeof(a));
    if (s == NULL) /* check() passes NULL for names its cases expect refused before this */
        return a;
    if (sp_egp_host_parse(s, strlen(s), name, &a) != SP_EGP_HOST_ADDR)
        fprintf(stderr, "not an address: %s\n", s);
    return a;
}

/* Name stage then (for allowed names) address stage, as the proxy does. */
static bool allowed(const sp_egp_t *p, const char *host, const char *resolved, uint16_t port,
                    char *reason)
{
    char name[SP_EGP_NAME_MAX + 1];
    sp_egp_addr_t a;
    bool by_name = false;
    sp_egp_host_kind_t k = sp_egp_host_parse(host, strlen(host), name, &a);
    if (k == SP_EGP_HOST_BAD) {
        snprintf(reason, 128, "bad host");
        return false;
    }
    if (k == SP_EGP_HOST_NAME) {
        if (!sp_egp_check_name(p, name, port, &by_name, reason, 128))
            return false;
        a = addr(resolved);
    }
    return sp_egp_check_addr(p, &a, port, by_name, reason, 128);
}

static void test_egress_policy_rule_forms(void)
{
    static const struct {
        const char *in;
        const char *norm; /* NULL: must be rejected */
    } cases[] = {
        {"example.com", "example.com"},
        {"Example.COM.", "example.com"},
        {"*.example.com", "*.example.com"},
        {"example.com:443", "example.com:443"},
        {"*.example.com:8080", "*.example.com:8080"},
        {"*", "*"},
        {"*:25", "*:25"},
        {"localhost", "localhost"},
        {"under_score.example", "under_score.example"},
        {"203.0.113.7", "203.0.113.7"},
        {"203.0.113.0/24", "203.0.113.0/24"},
        {"203.0.113.0/24:5432", "203.0.113.0/24:5432"},
        {"0.0.0.0/0", "0.0.0.0/0"},
        {"2001:db8::1", "2001:db8::1"},
        {"2001:DB8::/32", "2001:db8::/32"},
        {"[2001:db8::/32]:443", "[2001:db8::/32]:443"},
        {"[::1]:22", "[::1]:22"},
        {"::ffff:10.1.2.3", "10.1.2.3"},
        {"::ffff:10.0.0.0/104", "10.0.0.0/8"},
        {"::/0", "::/0"},
        {"", NULL},
        {"10.0.0.1/8", NULL}, /* host bits */
        {"10.0.0.0/33", NULL},
        {"10.0.0.0/", NULL},
        {"10.0.0.0/x", NULL},
        {"2001:db8::/129", NULL},
        {"example.com:0", NULL},
        {"example.com:65536", NULL},
        {"example.com:http", NULL},
        {"example..com", NULL},
        {"-", NULL},
        {"exa mple.com", NULL},
        {"ex*ample.com", NULL},
        {"*example.com", NULL},
        {"a.*.example.com", NULL},
        {"*.", NULL},
        {"1.2.3.400", NULL},
        {"127.1", NULL}, /* inet_aton would read it as 127.0.0.1 */
        {"0x7f.0.0.1", NULL},
        {"0.0.0.0xa.:443", NULL}, /* its normal form, without the dot, is refused too */
        {"2130706433", NULL},
        {"[example.com]:80", NULL},
        {"[::1", NULL},
        {"[::1]x", NULL},
        {"münchen.de", NULL},
        {"a.b.c:1:2", NULL},
        {"-a.com", NULL},
        {"a-.com", NULL},
        {"fd00::/8:443", NULL},
    };
    for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
        sp_egp_rule_t r;
        sp_err_t e = {0};
        int rc = sp_egp_rule_parse(cases[i].in, &r, &e);
        if (cases[i].norm == NULL) {
            if (rc != -1 || e.code != SP_EINVAL)
                fprintf(stderr, "accepted bad rule '%s'\n", cases[i].in);
            CHECK(rc == -1 && e.code == SP_EINVAL && e.msg[0] != '\0');
            continue;
        }
        if (rc != 0)
            fprintf(stderr, "rejected rule '%s': %s\n", cases[i].in, e.msg);
        CHECK(rc == 0);
        char out[400];
        sp_egp_rule_format(&r, out, sizeof(out));
        if (rc == 0 && strcmp(out, cases[i].norm) != 0)
            fprintf(stderr, "rule '%s' formats as '%s', want '%s'\n", cases[i].in, out,
                    cases[i].norm);
        CHECK(rc == 0 && strcmp(out, cases[i].norm) == 0);
    }
    char longname[400];
    memset(longname, 'a', sizeof(longname) - 1);
    longname[sizeof(longname) - 1] = '\0';
    sp_egp_rule_t r;
    CHECK(sp_egp_rule_parse(longname, &r, NULL) == -1);
    memset(longname, 'a', 64); /* a 64-character label */
    strcpy(longname + 64, ".com");
    CHECK(sp_egp_rule_parse(longname, &r, NULL) == -1);
}

static void test_egress_policy_bad_json_names_the_rule(void)
{
    static const struct {
        const char *json;
        const char *want; /* substring of the message */
    } cases[] = {
        {"{\"allow\": [\"ok.com\", \"bad..com\"]}", "egress.allow[1] 'bad..com'"},
        {"{\"deny\": [\"10.0.0.1/8\"]}", "egress.deny[0] '10.0.0.1/8': host bits"},
        {"{\"deny\": [7]}", "egress.deny[0] must be a string"},
        {"{\"allow\": \"x.com\"}", "egress.allow must be an array"},
        {"{\"internet\": \"yes\"}", "egress.internet must be true or false"},
        {"{\"internet\": true, \"extra\": 1}", "unknown field 'extra'"},
        {"[]", "egress must be an object"},
    };
    for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
        json_t *o = json_loads(cases[i].json, JSON_DECODE_ANY, NULL);
        sp_err_t e = {0};
        sp_egp_t *p = sp_egp_from_json(o, "egress", &e);
        CHECK(p == NULL && e.code == SP_EINVAL);
        if (strstr(e.msg, cases[i].want) == NULL)
            fprintf(stderr, "message for %s: '%s' lacks '%s'\n", cases[i].json, e.msg,
                    cases[i].want);
        CHECK(strstr(e.msg, cases[i].want) != NULL);
        sp_egp_free(p);
        json_decref(o);
    }
    /* Too many rules. */
    json_t *arr = json_array();
    for (int i = 0; i < SP_EGP_MAX_RULES + 1; i++)
        json_array_append_new(arr, json_string("a.com"));
    json_t *o = json_pack("{s:o}", "allow", arr);
    sp_err_t e = {0};
    CHECK(sp_egp_from_json(o, "egress", &e) == NULL && strstr(e.msg, "more than") != NULL);
    json_decref(o);
    /* Null and absent mean the default; round trip in normal form. */
    sp_egp_t *d = sp_egp_from_json(NULL, "egress", &e);
    CHECK(d != NULL && d->internet && d->nallow == 0 && d->ndeny == 0);
    sp_egp_free(d);
    sp_egp_t *p = policy("{\"internet\": false, \"allow\": [\"A.com\", \"10.0.0.0/8:22\"],"
                         " \"deny\": [\"*:25\"]}");
    CHECK(p != NULL);
    if (p != NULL) {
        json_t *j = sp_egp_to_json(p);
        char *s = json_dumps(j, JSON_COMPACT | JSON_SORT_KEYS);
        CHECK(strcmp(s, "{\"allow\":[\"a.com\",\"10.0.0.0/8:22\"],\"deny\":[\"*:25\"],"
                        "\"internet\":false}") == 0);
        free(s);
        json_decref(j);
    }
    sp_egp_free(p);
}

static void test_egress_policy_wildcards(void)
{
    char why[128];
    sp_egp_t *p = policy("{\"internet\": false, \"allow\": [\"*.example.com\", \"exact.org\"]}");
    CHECK(allowed(p, "api.example.com", "93.184.216.34", 443, why));
    CHECK(allowed(p, "a.b.example.com", "93.184.216.34", 443, why));
    CHECK(allowed(p, "API.Example.Com.", "93.184.216.34", 443, why));
    CHECK(!allowed(p, "example.com", "93.184.216.34", 443, why)); /* apex not included */
    CHECK(!allowed(p, "badexample.com", "93.184.216.34", 443, why));
    CHECK(!allowed(p, "example.com.evil.net", "93.184.216.34", 443, why));
    CHECK(strstr(why, "internet access is off") != NULL);
    CHECK(allowed(p, "exact.org", "198.51.100.1", 80, why));
    CHECK(!allowed(p, "www.exact.org", "198.51.100.1", 80, why));
    CHECK(!allowed(p, "198.51.100.1", NULL, 80, why)); /* internet off: a literal needs a rule */
    sp_egp_free(p);

    p = policy("{\"deny\": [\"*.evil.com\"]}");
    CHECK(!allowed(p, "x.evil.com", "198.51.100.1", 80, why));
    CHECK(strcmp(why, "denied by rule '*.evil.com'") == 0);
    CHECK(allowed(p, "evil.com", "198.51.100.1", 80, why));
    CHECK(allowed(p, "good.com", "198.51.100.1", 80, why));
    sp_egp_free(p);
}

static void test_egress_policy_cidr_v4_v6(void)
{
    char why[128];
    sp_egp_t *p = policy("{\"internet\": false, \"allow\": [\"198.51.100.0/24\","
                         " \"2001:db8:1::/48\", \"203.0.113.9:443\"]}");
    CHECK(allowed(p, "198.51.100.200", NULL, 80, why));
    CHECK(!allowed(p, "198.51.101.1", NULL, 80, why));
    CHECK(allowed(p, "2001:db8:1:ffff::1", NULL, 80, why));
    CHECK(allowed(p, "[2001:db8:1::5]", NULL, 80, why));
    CHECK(!allowed(p, "2001:db8:2::1", NULL, 80, why));
    CHECK(allowed(p, "203.0.113.9", NULL, 443, why));
    CHECK(!allowed(p, "203.0.113.9", NULL, 80, why));
    /* IPv4-mapped IPv6 is the IPv4 address. */
    CHECK(allowed(p, "::ffff:198.51.100.7", NULL, 80, why));
    CHECK(!allowed(p, "::ffff:198.51.101.7", NULL, 80, why));
    sp_egp_free(p);

    p = policy("{\"deny\": [\"198.51.100.0/24\", \"2001:db8::/32\"]}");
    CHECK(!allowed(p, "198.51.100.1", NULL, 80, why));
    CHECK(!allowed(p, "::ffff:198.51.100.1", NULL, 80, why)); /* mapped form is no way around */
    CHECK(!allowed(p, "[::ffff:c633:6401]", NULL, 80, why));
    CHECK(!allowed(p, "64:ff9b::198.51.100.1", NULL, 80, why)); /* nor NAT64 */
    CHECK(!allowed(p, "2002:c633:6401::1", NULL, 80, why));     /* nor 6to4 */
    CHECK(!allowed(p, "2001:db8:ffff::1", NULL, 80, why));
    CHECK(allowed(p, "198.51.99.1", NULL, 80, why));
    /* A name that resolves into a denied CIDR is denied. */
    CHECK(!allowed(p, "example.com", "198.51.100.7", 80, why));
    sp_egp_free(p);
}

static void test_egress_policy_deny_wins(void)
{
    char why[128];
    sp_egp_t *p = policy("{\"internet\": false, \"allow\": [\"*.example.com\", \"127.0.0.1\","
                         " \"198.51.100.0/24\"], \"deny\": [\"bad.example.com\", \"127.0.0.1\","
                         " \"198.51.100.128/25\"]}");
    CHECK(allowed(p, "good.example.com", "93.184.216.34", 443, why));
    CHECK(!allowed(p, "bad.example.com", "93.184.216.34", 443, why));
    CHECK(!allowed(p, "127.0.0.1", NULL, 80, why));
    CHECK(strstr(why, "denied by rule") != NULL);
    CHECK(allowed(p, "198.51.100.1", NULL, 80, why));
    CHECK(!allowed(p, "198.51.100.129", NULL, 80, why));
    sp_egp_free(p);

    /* "*" in deny closes everything, explicit allows included. */
    p = policy("{\"allow\": [\"127.0.0.1\", \"a.com\"], \"deny\": [\"*\"]}");
    CHECK(!allowed(p, "127.0.0.1", NULL, 80, why));
    CHECK(!allowed(p, "a.com", "93.184.216.34", 80, why));
    sp_egp_free(p);
}

static void test_egress_policy_ports(void)
{
    char why[128];
    sp_egp_t *p = policy("{\"allow\": [\"127.0.0.1\"], \"deny\": [\"*:25\", \"127.0.0.1:6000\","
                         " \"a.com:8080\"]}");
    CHECK(!allowed(p, "93.184.216.34", NULL, 25, why));
    CHECK(!allowed(p, "mail.com", "93.184.216.34", 25, why));
    CHECK(allowed(p, "93.184.216.34", NULL, 26, why));
    CHECK(!allowed(p, "127.0.0.1", NULL, 6000, why));
    CHECK(allowed(p, "127.0.0.1", NULL, 6001, why));
    CHECK(!allowed(p, "a.com", "93.184.216.34", 8080, why));
    CHECK(allowed(p, "a.com", "93.184.216.34", 443, why));
    /* Port 0 (DNS: any port): a deny rule with a port does not hide the name or address. */
    bool by_name;
    CHECK(sp_egp_check_name(p, "a.com", 0, &by_name, why, sizeof why));
    sp_egp_addr_t lo = addr("127.0.0.1");
    CHECK(sp_egp_check_addr(p, &lo, 0, false, why, sizeof why));
    sp_egp_free(p);

    p = policy("{\"internet\": false, \"allow\": [\"a.com:443\"]}");
    CHECK(allowed(p, "a.com", "93.184.216.34", 443, why));
    CHECK(!allowed(p, "a.com", "93.184.216.34", 80, why));
    CHECK(sp_egp_check_name(p, "a.com", 0, &by_name, why, sizeof why) && by_name);
    sp_egp_free(p);
}

static void test_egress_policy_default_denied_ranges(void)
{
    static const char *const denied[] = {
        "0.0.0.0",
        "0.1.2.3",
        "10.1.2.3",
        "100.64.0.1",
        "100.127.255.254",
        "127.0.0.1",
        "127.255.0.1",
        "169.254.1.1",
        "169.254.169.254",
        "172.16.0.1",
        "172.31.255.255",
        "192.168.1.1",
        "224.0.0.1",
        "239.255.255.250",
        "255.255.255.255",
        "240.0.0.1",
        "192.0.0.8",
        "198.18.0.1",
        "::",
        "::1",
        "fc00::1",
        "fd12:3456::1",
        "fd00:ec2::254",
        "fe80::1",
        "ff02::1",
        "::ffff:127.0.0.1",
        "::ffff:10.0.0.1",
        "::127.0.0.1",
        "64:ff9b::127.0.0.1",
        "64:ff9b::a9fe:a9fe",
        "2002:7f00:1::1",
        "2002:a9fe:a9fe::",
        "fec0::1",
        "2001::1",
    };
    static const char *const open[] = {"93.184.216.34",      "100.63.255.255", "100.128.0.1",
                                       "172.32.0.1",         "11.0.0.1",       "2606:4700::1111",
                                       "64:ff9b::5db8:d822", "1.1.1.1"};
    char why[128];
    sp_egp_t *p = policy("{}");
    for (size_t i = 0; i < sizeof(denied) / sizeof(denied[0]); i++) {
        bool ok = allowed(p, denied[i], NULL, 80, why);
        if (ok)
            fprintf(stderr, "default policy allowed %s\n", denied[i]);
        CHECK(!ok);
        /* A domain rule never opens them: the DNS-rebinding case. */
        sp_egp_t *q = policy("{\"allow\": [\"rebind.test\", \"*.rebind.test\", \"*\"]}");
        CHECK(!allowed(q, "rebind.test", denied[i], 80, why));
        CHECK(!allowed(q, "x.rebind.test", denied[i], 80, why));
        sp_egp_free(q);
    }
    for (size_t i = 0; i < sizeof(open) / sizeof(open[0]); i++) {
        bool ok = allowed(p, open[i], NULL, 80, why);
        if (!ok)
            fprintf(stderr, "default policy denied %s: %s\n", open[i], why);
        CHECK(ok);
    }
    CHECK(!allowed(p, "127.0.0.1", NULL, 80, why) && strcmp(why, "loopback address") == 0);
    CHECK(!allowed(p, "169.254.169.254", NULL, 80, why) && strcmp(why, "metadata address") == 0);
    CHECK(!allowed(p, "localhost", "127.0.0.1", 80, why) && strcmp(why, "loopback address") == 0);
    sp_egp_free(p);

    /* Explicit IP/CIDR rules inside a range open it; wider ones and domains do not. */
    p = policy("{\"allow\": [\"127.0.0.1/32\", \"10.0.0.0/8\", \"169.254.0.0/16\", \"0.0.0.0/0\","
               " \"::1\", \"[fd00::/8]:443\"]}");
    CHECK(allowed(p, "127.0.0.1", NULL, 80, why));
    CHECK(!allowed(p, "127.0.0.2", NULL, 80, why));
    CHECK(allowed(p, "10.9.9.9", NULL, 80, why));
    CHECK(allowed(p, "169.254.1.1", NULL, 80, why));
    CHECK(!allowed(p, "169.254.169.254", NULL, 80, why)); /* metadata needs its own rule */
    CHECK(!allowed(p, "192.168.0.1", NULL, 80, why));     /* 0.0.0.0/0 is not inside it */
    CHECK(allowed(p, "::1", NULL, 80, why));
    CHECK(allowed(p, "::ffff:127.0.0.1", NULL, 80, why));
    CHECK(allowed(p, "fd00::5", NULL, 443, why));
    CHECK(!allowed(p, "fd00::5", NULL, 80, why));
    CHECK(!allowed(p, "fd00:ec2::254", NULL, 443, why));
    sp_egp_free(p);
    p = policy("{\"allow\": [\"169.254.169.254\"]}");
    CHECK(allowed(p, "169.254.169.254", NULL, 80, why));
    CHECK(!allowed(p, "169.254.1.1", NULL, 80, why));
    sp_egp_free(p);
    sp_egp_addr_t a = addr("10.0.0.1");
    CHECK(sp_egp_special_range(&a) != NULL);
    a = addr("8.8.8.8");
    CHECK(sp_egp_special_range(&a) == NULL);
}

static void test_egress_policy_internet_off(void)
{
    char why[128];
    sp_egp_t *p = policy("{\"internet\": false}");
    CHECK(!allowed(p, "example.com", "93.184.216.34", 443, why));
    CHECK(!allowed(p, "93.184.216.34", NULL, 443, why));
    CHECK(strstr(why, "internet access is off") != NULL);
    sp_egp_free(p);
    /* An allow rule still opens its destination; private ranges still need an IP rule. */
    p = policy("{\"internet\": false, \"allow\": [\"api.example.com\", \"127.0.0.1\"]}");
    CHECK(allowed(p, "api.example.com", "93.184.216.34", 443, why));
    CHECK(!allowed(p, "api.example.com", "10.0.0.1", 443, why));
    CHECK(allowed(p, "127.0.0.1", NULL, 8080, why));
    CHECK(!allowed(p, "localhost", "127.0.0.1", 8080, why)); /* a name needs a domain rule */
    sp_egp_free(p);
}

static void test_egress_policy_hosts(void)
{
    char name[SP_EGP_NAME_MAX + 1];
    sp_egp_addr_t a;
    CHECK(sp_egp_host_parse("Example.COM.", 12, name, &a) == SP_EGP_HOST_NAME &&
          strcmp(name, "example.com") == 0);
    CHECK(sp_egp_host_parse("[::1]", 5, name, &a) == SP_EGP_HOST_ADDR && a.family == 6);
    CHECK(sp_egp_host_parse("::ffff:1.2.3.4", 14, name, &a) == SP_EGP_HOST_ADDR && a.family == 4 &&
          a.b[0] == 1 && a.b[3] == 4);
    CHECK(sp_egp_host_parse("127.1", 5, name, &a) == SP_EGP_HOST_BAD);
    CHECK(sp_egp_host_parse("0x7f000001", 10, name, &a) == SP_EGP_HOST_BAD);
    CHECK(sp_egp_host_parse("2130706433", 10, name, &a) == SP_EGP_HOST_BAD);
    CHECK(sp_egp_host_parse("a b", 3, name, &a) == SP_EGP_HOST_BAD);
    CHECK(sp_egp_host_parse("a\0b", 3, name, &a) == SP_EGP_HOST_BAD);
    CHECK(sp_egp_host_parse("[fe80::1%eth0]", 14, name, &a) == SP_EGP_HOST_BAD);
    CHECK(sp_egp_host_parse("", 0, name, &a) == SP_EGP_HOST_BAD);
    char big[300];
    memset(big, 'a', sizeof(big));
    CHECK(sp_egp_host_parse(big, sizeof(big), name, &a) == SP_EGP_HOST_BAD);
    char fmt[64];
    a = addr("2001:db8::1");
    sp_egp_addr_format(&a, fmt, sizeof fmt);
    CHECK(strcmp(fmt, "2001:db8::1") == 0);
}

/* The host's own addresses are denied like the fixed ranges (label "host address"), and only an
 * explicit rule for the address opens one. In a network namespace of our own (root needed) lo
 * gets a public-looking address, so the host's real ones (whatever they are) do not matter. */
static void test_egress_policy_host_addresses(void)
{
    char why[128];
    sp_egp_t *p = policy("{}");
    CHECK(!allowed(p, "168.63.129.16", NULL, 80, why) && strcmp(why, "metadata address") == 0);
    sp_egp_free(p);
    CHECK(sp_egp_host_addrs_refresh() >= 1); /* lo at least */
    pid_t pid = fork();
    if (pid == 0) {
        if (unshare(CLONE_NEWNET) < 0)
            _exit(77);
        if (system("ip link set lo up && ip addr add 198.51.100.7/32 dev lo && "
                   "ip addr add 2001:db8:5::7/128 dev lo && ip addr add 10.9.8.7/32 dev lo && "
                   "ip addr add fd12::7/128 dev lo") != 0)
            _exit(2);
        int bad = 0;
        sp_egp_t *q = policy("{}");
        bad += !allowed(q, "198.51.100.7", NULL, 80, why); /* not read yet */
        bad += sp_egp_host_addrs_refresh() < 3;
        bad += allowed(q, "198.51.100.7", NULL, 80, why) || strcmp(why, "host address") != 0;
        bad += allowed(q, "2001:db8:5::7", NULL, 443, why) || strcmp(why, "host address") != 0;
        bad += !allowed(q, "198.51.100.8", NULL, 80, why);
        sp_egp_free(q);
        q = policy("{\"allow\": [\"198.51.100.0/24\"]}"); /* wider: does not open it */
        bad += allowed(q, "198.51.100.7", NULL, 80, why);
        sp_egp_free(q);
        q = policy("{\"allow\": [\"198.51.100.7\"]}");
        bad += !allowed(q, "198.51.100.7", NULL, 80, why);
        sp_egp_free(q);
        /* A host address inside a private range: opening the network does not open it. */
        q = policy("{}");
        bad += allowed(q, "10.9.8.7", NULL, 80, why) || strcmp(why, "host address") != 0;
        sp_egp_free(q);
        q = policy("{\"allow\": [\"10.0.0.0/8\", \"fd00::/8\", \"127.0.0.0/8\"]}");
        bad += allowed(q, "10.9.8.7", NULL, 80, why) || strcmp(why, "host address") != 0;
        bad += allowed(q, "::ffff:10.9.8.7", NULL, 80, why) || strcmp(why, "host address") != 0;
        bad += allowed(q, "fd12::7", NULL, 80, why) || strcmp(why, "host address") != 0;
        bad += !allowed(q, "10.9.8.6", NULL, 80, why); /* the rest of the network */
        bad += !allowed(q, "fd12::6", NULL, 80, why);
        bad += !allowed(q, "127.0.0.1", NULL, 80, why); /* loopback keeps its range */
        sp_egp_free(q);
        q = policy("{\"allow\": [\"10.9.8.7\"]}");
        bad += !allowed(q, "10.9.8.7", NULL, 80, why);
        sp_egp_free(q);
        q = policy("{}");
        bad += allowed(q, "127.0.0.1", NULL, 80, why) || strcmp(why, "loopback address") != 0;
        sp_egp_free(q);
        if (bad != 0)
            fprintf(stderr, "host addresses: %d checks failed (last reason: %s)\n", bad, why);
        _exit(bad == 0 ? 0 : 1);
    }
    int st = 0;
    CHECK(pid > 0 && waitpid(pid, &st, 0) == pid && WIFEXITED(st));
    if (WEXITSTATUS(st) == 77)
        printf("host addresses in a namespace: skipped (no CAP_SYS_ADMIN)\n");
    else
        CHECK(WEXITSTATUS(st) == 0);
}

int main(void)
{
    test_egress_policy_rule_forms();
    test_egress_policy_bad_json_names_the_rule();
    test_egress_policy_wildcards();
    test_egress_policy_cidr_v4_v6();
    test_egress_policy_deny_wins();
    test_egress_policy_ports();
    test_egress_policy_default_denied_ranges();
    test_egress_policy_internet_off();
    test_egress_policy_hosts();
    test_egress_policy_host_addresses();
    return check_report("egress_policy");
}
