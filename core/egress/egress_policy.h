/*
 * egress_policy.h - a sandbox's outbound rules and the pure decisions over them.
 *
 * No I/O, no loop, no allocation beyond the parsed policy itself: the proxy
 * (core/egress/proxy.c, dns.c) asks two questions, first about the name a guest asked for
 * (before resolving it), then about every address the name resolved to (or
 * the literal address it gave). Only an address that passed is ever
 * connected to, which is what stops DNS rebinding: a name allowed by a
 * domain rule that resolves to a private address is still denied.
 *
 * ---- The policy (JSON: {"internet": bool, "allow": [str], "deny": [str]}) ----
 *  internet  true (default): any public destination not denied is allowed.
 *            false: only destinations named in `allow` (a host name must match
 *            a domain rule, an address literal must match an IP/CIDR rule).
 *  allow     rules that open destinations (up to 256).
 *  deny      rules that close destinations (up to 256). Deny always wins.
 *
 * A rule is one of, each optionally followed by ":<port>" (1-65535; without
 * it the rule covers every port; IPv6 takes brackets then: "[2001:db8::/32]:443"):
 *   example.com          exactly that name (case-insensitive, trailing dot ignored)
 *   *.example.com        every name below example.com, NOT example.com itself
 *   203.0.113.7          one IPv4 address (a /32)
 *   203.0.113.0/24       an IPv4 CIDR (host bits must be zero)
 *   2001:db8::1, 2001:db8::/32, [2001:db8::/32]:443   IPv6 alike
 *   *                    every destination (names and addresses)
 * Names are ASCII (punycode for IDNs): labels of letters, digits, '-' and '_'.
 *
 * ---- Always-denied address ranges ----
 * Unless an allow rule that is an IP/CIDR lying wholly inside the range
 * matches, these are denied whatever the other rules say:
 *   0.0.0.0/8 unspecified, 10/8 172.16/12 192.168/16 private, 100.64/10 CGNAT,
 *   127/8 loopback, 169.254/16 link-local, 169.254.169.254 metadata (only a
 *   rule for exactly that address opens it), 192.0.0/24 198.18/15 240/4
 *   reserved, 224/4 multicast; ::, ::1, ::/96 (IPv4-compatible), fc00::/7
 *   private, fd00:ec2::254 metadata, fe80::/10 link-local, fec0::/10,
 *   ff00::/8 multicast, 100::/64, 2001::/32 (Teredo).
 * So "127.0.0.1" or "127.0.0.0/8" in allow opens loopback; "0.0.0.0/0" or a
 * domain rule never does. IPv4-mapped IPv6 (::ffff:a.b.c.d) is judged as the
 * IPv4 address it carries; NAT64 (64:ff9b::/96) and 6to4 (2002::/16)
 * addresses are denied when the IPv4 address they embed would be.
 * The host's own interface addresses (sp_egp_host_addrs_refresh) are ranges of
 * one address each ("host address"), inside the wider ranges too, loopback
 * excepted: "10.0.0.0/8" in allow opens that network, not the host's own
 * 10.x address; only a rule for exactly that address does.
 *
 * ---- Ports ----
 * Every port is allowed unless a rule says otherwise: "*:25" in deny closes
 * port 25 everywhere; "example.com:443" in allow opens only that port.
 * Port 0 in a question means "any port" (DNS answers): a deny rule with a
 * port does not hide a name or address, an allow rule with a port counts.
 */
#ifndef SP_EGRESS_POLICY_H
#define SP_EGRESS_POLICY_H

#include <jansson.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <sys/socket.h>

#include "base/err.h"

#define SP_EGP_MAX_RULES    256 /* per list */
#define SP_EGP_MAX_RULE_LEN 300 /* characters of one rule as written */
#define SP_EGP_NAME_MAX     253 /* characters of a host name, without the trailing dot */

typedef enum {
    SP_EGP_R_ANY = 0, /* "*" */
    SP_EGP_R_DOMAIN,  /* exact name */
    SP_EGP_R_SUFFIX,  /* "*.name": subdomains only */
    SP_EGP_R_CIDR,    /* address or network */
} sp_egp_rule_kind_t;

/* An address: family 4 (b[0..3]) or 6 (b[0..15]), network byte order. */
typedef struct {
    uint8_t family;
    uint8_t b[16];
} sp_egp_addr_t;

typedef struct {
    uint8_t kind;   /* sp_egp_rule_kind_t */
    uint8_t prefix; /* CIDR: prefix length */
    uint16_t port;  /* 0 = every port */
    sp_egp_addr_t net;
    char name[SP_EGP_NAME_MAX + 1]; /* DOMAIN/SUFFIX: lowercase, SUFFIX without "*." */
} sp_egp_rule_t;

typedef struct {
    bool internet;
    size_t nallow, ndeny;
    sp_egp_rule_t *allow; /* owned */
    sp_egp_rule_t *deny;  /* owned */
} sp_egp_t;

/* The default policy (internet on, no rules). NULL when memory is short. */
sp_egp_t *sp_egp_default(void);
/* Parses a policy object strictly: only the keys internet, allow, deny; bad rules are
 * SP_EINVAL naming the rule ("egress.allow[2] 'a..b': ..."); `what` prefixes the message
 * ("egress"). NULL or JSON null gives the default policy. */
sp_egp_t *sp_egp_from_json(const json_t *obj, const char *what, sp_err_t *err);
/* The canonical JSON form (rules rewritten in normal form). New reference. */
json_t *sp_egp_to_json(const sp_egp_t *p);
void sp_egp_free(sp_egp_t *p);

/* Parses one rule. 0, or -1 with SP_EINVAL and a reason (without the rule text). */
int sp_egp_rule_parse(const char *text, sp_egp_rule_t *out, sp_err_t *err);
/* Writes the rule's normal form ("*.example.com:443", "10.0.0.0/8"). */
void sp_egp_rule_format(const sp_egp_rule_t *r, char *out, size_t cap);

/* ---- hosts ---- */

typedef enum {
    SP_EGP_HOST_BAD = 0,
    SP_EGP_HOST_NAME, /* *name filled: lowercase, no trailing dot */
    SP_EGP_HOST_ADDR, /* *addr filled (IPv4-mapped IPv6 becomes IPv4) */
} sp_egp_host_kind_t;

/*
 * Classifies a host as a client wrote it (CONNECT target, URI host, Host header, DNS name):
 * an IPv4 dotted quad, an IPv6 address with or without brackets, or a host name. Numeric
 * forms that only some parsers accept ("127.1", "0x7f.0.0.1", "2130706433") are BAD:
 * they would mean one thing to the policy and another to the resolver. name must have room
 * for SP_EGP_NAME_MAX + 1 bytes.
 */
sp_egp_host_kind_t sp_egp_host_parse(const char *host, size_t len, char *name, sp_egp_addr_t *addr);

/* From a socket address; IPv4-mapped IPv6 becomes IPv4. -1 for another family. */
int sp_egp_addr_from_sockaddr(const struct sockaddr *sa, sp_egp_addr_t *out);
/* Text form ("127.0.0.1", "2001:db8::1"). */
void sp_egp_addr_format(const sp_egp_addr_t *a, char *out, size_t cap);

/* ---- decisions ----
 * Each returns true for allowed; on a denial, reason (cap >= 1) gets a short client-safe
 * sentence such as "loopback address" or "denied by rule '*.example.com'". */

/*
 * The name stage, for a host name (not an address literal). *by_name is set when an allow
 * rule names the host: then its public addresses pass the address stage even with internet
 * off. port 0 = any.
 */
bool sp_egp_check_name(const sp_egp_t *p, const char *name, uint16_t port, bool *by_name,
                       char *reason, size_t cap);

/* The address stage: a literal the guest gave (by_name false) or one the allowed name
 * resolved to (by_name from the name stage). port 0 = any. */
bool sp_egp_check_addr(const sp_egp_t *p, const sp_egp_addr_t *a, uint16_t port, bool by_name,
                       char *reason, size_t cap);

/* The always-denied range holding a (with its label) or NULL: for tests and logs. */
const char *sp_egp_special_range(const sp_egp_addr_t *a);

/* The host's own interface addresses (all of them, up to SP_EGP_HOST_ADDRS_MAX) are denied as
 * "host address" like the ranges above: read now from getifaddrs. The egress service calls it
 * at start and every minute. The number of addresses, or -1 (the last list stays). */
#define SP_EGP_HOST_ADDRS_MAX 256
int sp_egp_host_addrs_refresh(void);

#endif
