/*
 * secretcheck.c - secrets.h's checks of what a request gives: a secret's name and value, and
 * credential rules (checked and normalised), apart from secrets.c (the sealing, the store) so
 * the request-body parsers (and their fuzz target) use them without libsodium or the database.
 */
#include <ctype.h>
#include <stdbool.h>
#include <stdio.h>
#include <string.h>
#include <strings.h>

#include "core/egress/secrets.h"

int sp_secrets_check_name(const char *name, sp_err_t *err)
{
    size_t n = name ? strlen(name) : 0;
    bool ok = n >= 1 && n <= SP_SECRETS_NAME_MAX &&
              ((name[0] >= 'A' && name[0] <= 'Z') || (name[0] >= 'a' && name[0] <= 'z') ||
               name[0] == '_');
    for (size_t i = 1; ok && i < n; i++) {
        char c = name[i];
        ok = (c >= 'A' && c <= 'Z') || (c >= 'a' && c <= 'z') || (c >= '0' && c <= '9') ||
             c == '_' || c == '.' || c == '-';
    }
    if (!ok)
        return sp_err_set(err, SP_EINVAL,
                          "secret name must be 1 to %d characters of letters, digits, '_', '.' "
                          "and '-', starting with a letter or '_'",
                          SP_SECRETS_NAME_MAX);
    return 0;
}

int sp_secrets_check_value(const char *value, size_t len, sp_err_t *err)
{
    if (value == NULL || len == 0)
        return sp_err_set(err, SP_EINVAL, "secret value must not be empty");
    if (len > SP_SECRETS_VALUE_MAX)
        return sp_err_set(err, SP_EINVAL, "secret value is longer than %d bytes",
                          SP_SECRETS_VALUE_MAX);
    for (size_t i = 0; i < len; i++) {
        unsigned char c = (unsigned char)value[i];
        if (c < 0x20 || c == 0x7f)
            return sp_err_set(err, SP_EINVAL,
                              "secret value must not contain control characters (it is sent "
                              "in an HTTP header)");
    }
    return 0;
}

static bool is_tchar(char c)
{
    return (c >= 'A' && c <= 'Z') || (c >= 'a' && c <= 'z') || (c >= '0' && c <= '9') ||
           (c != '\0' && strchr("!#$%&'*+-.^_`|~", c) != NULL);
}

static int check_header_name(const char *h, sp_err_t *err)
{
    size_t n = strlen(h);
    if (n == 0 || n > 64)
        return sp_err_set(err, SP_EINVAL, "credential header must be 1 to 64 characters");
    for (size_t i = 0; i < n; i++)
        if (!is_tchar(h[i]))
            return sp_err_set(err, SP_EINVAL, "credential header '%.64s' is not a valid name", h);
    static const char *const framing[] = {
        "host", "content-length", "transfer-encoding", "connection", "upgrade",
        "te",   "trailer",        "keep-alive",        "expect",     NULL};
    for (int i = 0; framing[i] != NULL; i++)
        if (strcasecmp(h, framing[i]) == 0)
            return sp_err_set(err, SP_EINVAL,
                              "credential header may not be %.64s (it frames the request)", h);
    if (strncasecmp(h, "proxy-", 6) == 0)
        return sp_err_set(err, SP_EINVAL, "credential header may not be a Proxy- header");
    return 0;
}

/* Lowercases host into out; "*.suffix" is kept as a wildcard. */
static int check_host(const char *h, char *out, size_t cap, sp_err_t *err)
{
    size_t n = strlen(h);
    if (n == 0 || n > 253 || n >= cap)
        return sp_err_set(err, SP_EINVAL, "credential host must be 1 to 253 characters");
    const char *p = h;
    if (strncmp(h, "*.", 2) == 0)
        p += 2;
    if (*p == '\0' || *p == '.' || h[n - 1] == '.')
        return sp_err_set(err, SP_EINVAL, "credential host '%.64s' is not a host name", h);
    for (const char *q = p; *q; q++) {
        char c = *q;
        bool ok = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') ||
                  c == '-' || c == '.' || c == '_' || c == ':';
        if (!ok || (c == '.' && q[1] == '.'))
            return sp_err_set(err, SP_EINVAL,
                              "credential host '%.64s' is not a host name (no scheme, port or "
                              "path)",
                              h);
    }
    if (strchr(p, ':') != NULL && strchr(p, '.') != NULL && strncmp(h, "*.", 2) != 0) {
        /* Either an IPv6 literal (colons, hex) or host:port; only the former is a host. */
        for (const char *q = p; *q; q++)
            if (*q == '.')
                return sp_err_set(err, SP_EINVAL, "credential host '%.64s' must not include a port",
                                  h);
    }
    for (size_t i = 0; i <= n; i++)
        out[i] = (h[i] >= 'A' && h[i] <= 'Z') ? (char)(h[i] - 'A' + 'a') : h[i];
    return 0;
}

static int check_format(const char *f, sp_err_t *err)
{
    size_t n = strlen(f);
    if (n > SP_SECRETS_FORMAT_MAX)
        return sp_err_set(err, SP_EINVAL, "credential format is longer than %d characters",
                          SP_SECRETS_FORMAT_MAX);
    const char *at = strstr(f, "{secret}");
    if (at == NULL || strstr(at + 1, "{secret}") != NULL)
        return sp_err_set(err, SP_EINVAL, "credential format must contain {secret} exactly once");
    for (size_t i = 0; i < n; i++)
        if ((unsigned char)f[i] < 0x20 || f[i] == 0x7f)
            return sp_err_set(err, SP_EINVAL,
                              "credential format must not contain control characters");
    return 0;
}

/* A POSIX variable name the guest does not already depend on. */
static int check_env(const char *v, sp_err_t *err)
{
    size_t n = strlen(v);
    if (n == 0 || n > SP_SECRETS_ENV_MAX)
        return sp_err_set(err, SP_EINVAL, "credential env must be 1 to %d characters",
                          SP_SECRETS_ENV_MAX);
    for (size_t i = 0; i < n; i++) {
        char c = v[i];
        bool ok = (c >= 'A' && c <= 'Z') || (c >= 'a' && c <= 'z') || c == '_' ||
                  (i > 0 && c >= '0' && c <= '9');
        if (!ok)
            return sp_err_set(err, SP_EINVAL,
                              "credential env '%.64s' is not a variable name "
                              "([A-Za-z_][A-Za-z0-9_]*)",
                              v);
    }
    /* Set by the guest's login or by the egress proxy (core/egress/proxy.c, core/egress/mitm.c). */
    static const char *const taken[] = {"PATH",
                                        "HOME",
                                        "USER",
                                        "LOGNAME",
                                        "SHELL",
                                        "TERM",
                                        "HTTP_PROXY",
                                        "HTTPS_PROXY",
                                        "http_proxy",
                                        "https_proxy",
                                        "NO_PROXY",
                                        "no_proxy",
                                        "ALL_PROXY",
                                        "all_proxy",
                                        "SSL_CERT_FILE",
                                        "CURL_CA_BUNDLE",
                                        "REQUESTS_CA_BUNDLE",
                                        "NODE_EXTRA_CA_CERTS",
                                        NULL};
    for (int i = 0; taken[i] != NULL; i++)
        if (strcmp(v, taken[i]) == 0)
            return sp_err_set(err, SP_EINVAL,
                              "credential env may not be %s (the sandbox sets it itself)", v);
    return 0;
}

json_t *sp_secrets_rules_normalize(const json_t *rules, sp_err_t *err)
{
    if (rules == NULL || json_is_null(rules))
        return json_array();
    if (!json_is_array(rules)) {
        sp_err_set(err, SP_EINVAL, "credentials must be an array of rules");
        return NULL;
    }
    if (json_array_size(rules) > SP_SECRETS_RULES_MAX) {
        sp_err_set(err, SP_EINVAL, "credentials may hold at most %d rules", SP_SECRETS_RULES_MAX);
        return NULL;
    }
    json_t *out = json_array();
    size_t i;
    const json_t *r;
    json_array_foreach(rules, i, r)
    {
        if (!json_is_object(r)) {
            sp_err_set(err, SP_EINVAL, "credentials[%zu] must be an object", i);
            goto fail;
        }
        const char *k;
        const json_t *v;
        json_object_foreach((json_t *)r, k, v)
        {
            if (strcmp(k, "host") != 0 && strcmp(k, "header") != 0 && strcmp(k, "secret") != 0 &&
                strcmp(k, "format") != 0 && strcmp(k, "env") != 0) {
                sp_err_set(err, SP_EINVAL, "credentials[%zu] has unknown field '%.64s'", i, k);
                goto fail;
            }
            if (!json_is_string(v) || strlen(json_string_value(v)) != json_string_length(v)) {
                sp_err_set(err, SP_EINVAL, "credentials[%zu].%s must be a string without NUL", i,
                           k);
                goto fail;
            }
        }
        const char *host = json_string_value(json_object_get(r, "host"));
        const char *header = json_string_value(json_object_get(r, "header"));
        const char *secret = json_string_value(json_object_get(r, "secret"));
        const char *format = json_string_value(json_object_get(r, "format"));
        const char *env = json_string_value(json_object_get(r, "env"));
        if (host == NULL || header == NULL || secret == NULL) {
            sp_err_set(err, SP_EINVAL, "credentials[%zu] needs host, header and secret", i);
            goto fail;
        }
        char lhost[256];
        if (format == NULL)
            format = "{secret}";
        if (check_host(host, lhost, sizeof(lhost), err) < 0 || check_header_name(header, err) < 0 ||
            sp_secrets_check_name(secret, err) < 0 || check_format(format, err) < 0 ||
            (env != NULL && check_env(env, err) < 0))
            goto fail;
        /* One value per header and host: a second rule would be ambiguous. */
        size_t j;
        const json_t *prev;
        json_array_foreach(out, j, prev)
        {
            if (strcmp(json_string_value(json_object_get(prev, "host")), lhost) == 0 &&
                strcasecmp(json_string_value(json_object_get(prev, "header")), header) == 0) {
                sp_err_set(err, SP_EINVAL,
                           "credentials[%zu] sets header %.64s for host %.64s a second time", i,
                           header, lhost);
                goto fail;
            }
            /* One placeholder per variable: the guest sees one value. */
            const char *penv = json_string_value(json_object_get(prev, "env"));
            if (env != NULL && penv != NULL && strcmp(env, penv) == 0 &&
                strcmp(json_string_value(json_object_get(prev, "secret")), secret) != 0) {
                sp_err_set(err, SP_EINVAL,
                           "credentials[%zu] sets env %.64s to secret %.64s; another rule sets "
                           "it to secret %.64s",
                           i, env, secret, json_string_value(json_object_get(prev, "secret")));
                goto fail;
            }
        }
        json_t *o = json_pack("{s:s,s:s,s:s,s:s}", "host", lhost, "header", header, "secret",
                              secret, "format", format);
        if (o == NULL || (env != NULL && json_object_set_new(o, "env", json_string(env)) < 0)) {
            json_decref(o);
            sp_err_set(err, SP_EINTERNAL, "out of memory");
            goto fail;
        }
        json_array_append_new(out, o);
    }
    return out;
fail:
    json_decref(out);
    return NULL;
}
