/*
 * dockerfile.c - the Dockerfile subset (dockerfile.h), read line by line.
 */
#include "core/control/dockerfile.h"

#include <ctype.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

#include "base/buf.h"
#include "guest/tmplbuild.h"

struct parse {
    sp_dockerfile_t *out;
    const char *context;
    int line;       /* where the instruction being read starts */
    bool from_seen;
    char workdir[4096];
    json_t *entrypoint, *cmd; /* array (exec form) or string (shell form) */
    sp_err_t *err;
};

static int bad(struct parse *p, const char *fmt, const char *a)
{
    char msg[300];
    snprintf(msg, sizeof msg, fmt, a);
    return sp_err_set(p->err, SP_EINVAL, "Dockerfile line %d: %s", p->line, msg);
}

static json_t *exec_form(const char *s);

/* Splits s into words: whitespace separates, "..." and '...' quote, backslash escapes (outside
 * single quotes). A JSON array of strings when exec is set and s is one. */
static json_t *words(const char *s, bool exec)
{
    json_t *a = exec ? exec_form(s) : NULL;
    if (a != NULL)
        return a; /* else not JSON: Docker reads it as the shell form */
    json_t *out = json_array();
    sp_buf_t w = SP_BUF_INIT;
    bool in_word = false;
    char q = 0;
    for (; *s; s++) {
        char c = *s;
        if (q == '\'') {
            if (c == '\'')
                q = 0;
            else
                sp_buf_add(&w, &c, 1);
        } else if (q == '"') {
            if (c == '"')
                q = 0;
            else if (c == '\\' && (s[1] == '"' || s[1] == '\\') && (s++, true))
                sp_buf_add(&w, s, 1);
            else
                sp_buf_add(&w, &c, 1);
        } else if (isspace((unsigned char)c)) {
            if (in_word)
                json_array_append_new(out, json_string(sp_buf_cstr(&w)));
            sp_buf_reset(&w);
            in_word = false;
        } else {
            in_word = true;
            if (c == '"' || c == '\'')
                q = c;
            else if (c == '\\' && s[1] != '\0' && (s++, true))
                sp_buf_add(&w, s, 1);
            else
                sp_buf_add(&w, &c, 1);
        }
    }
    if (in_word)
        json_array_append_new(out, json_string(sp_buf_cstr(&w)));
    sp_buf_free(&w);
    return out;
}

/* The exec form's array of strings, or NULL for the shell form. */
static json_t *exec_form(const char *s)
{
    while (isspace((unsigned char)*s))
        s++;
    if (*s != '[')
        return NULL;
    json_t *a = json_loads(s, JSON_DECODE_ANY, NULL);
    bool ok = json_is_array(a) && json_array_size(a) > 0;
    for (size_t i = 0; ok && i < json_array_size(a); i++)
        ok = json_is_string(json_array_get(a, i));
    if (!ok) {
        json_decref(a);
        return NULL;
    }
    return a;
}

static int env_step(struct parse *p, const char *rest, bool arg)
{
    json_t *ws = words(rest, false);
    json_t *env = json_object();
    size_t n = json_array_size(ws);
    int rc = 0;
    if (n == 0) {
        rc = bad(p, "%s needs a name", arg ? "ARG" : "ENV");
    } else if (!arg && strchr(json_string_value(json_array_get(ws, 0)), '=') == NULL) {
        /* ENV key value with spaces */
        const char *k = json_string_value(json_array_get(ws, 0));
        const char *v = rest;
        while (isspace((unsigned char)*v))
            v++;
        v += strlen(k);
        while (isspace((unsigned char)*v))
            v++;
        json_object_set_new(env, k, json_string(v));
    } else {
        for (size_t i = 0; i < n && rc == 0; i++) {
            const char *kv = json_string_value(json_array_get(ws, i));
            const char *eq = strchr(kv, '=');
            if (eq == NULL && arg)
                continue; /* ARG without a default: nothing to set */
            if (eq == NULL || eq == kv) {
                rc = bad(p, "'%.100s' is not NAME=VALUE", kv);
                break;
            }
            char k[257];
            snprintf(k, sizeof k, "%.*s", (int)(eq - kv > 256 ? 256 : eq - kv), kv);
            json_object_set_new(env, k, json_string(eq + 1));
        }
    }
    if (rc == 0 && json_object_size(env) > 0)
        json_array_append_new(p->out->steps, json_pack("{s:O}", "env", env));
    json_decref(env);
    json_decref(ws);
    return rc;
}

static int copy_step(struct parse *p, const char *rest, bool add)
{
    json_t *ws = words(rest, true);
    const char *user = "root", *mode = NULL; /* Docker's COPY makes root's files */
    char ubuf[64] = "";
    int rc = 0;
    size_t i = 0;
    for (; i < json_array_size(ws); i++) {
        const char *w = json_string_value(json_array_get(ws, i));
        if (strncmp(w, "--", 2) != 0)
            break;
        if (strncmp(w, "--chown=", 8) == 0) {
            snprintf(ubuf, sizeof ubuf, "%.*s", (int)strcspn(w + 8, ":"), w + 8);
            user = ubuf;
        } else if (strncmp(w, "--chmod=", 8) == 0) {
            mode = w + 8;
        } else if (strncmp(w, "--from=", 7) == 0) {
            rc = bad(p, "%s --from (multi-stage builds) is not supported", add ? "ADD" : "COPY");
        } else {
            rc = bad(p, "the option %.60s is not supported", w);
        }
        if (rc < 0)
            break;
    }
    size_t n = json_array_size(ws);
    if (rc == 0 && n - i < 2)
        rc = bad(p, "%s needs a source and a destination", add ? "ADD" : "COPY");
    if (rc == 0 && p->context == NULL)
        rc = bad(p, "%s needs the build context: upload it (PUT /v1/template-files/{sha256}) and "
                    "give its key as from.context",
                 add ? "ADD" : "COPY");
    const char *dest = rc == 0 ? json_string_value(json_array_get(ws, n - 1)) : NULL;
    if (rc == 0 && dest[0] == '\0')
        rc = bad(p, "%s needs a destination (it is empty)", add ? "ADD" : "COPY");
    if (rc == 0 && n - i > 2 && dest[strlen(dest) - 1] != '/')
        rc = bad(p, "with several sources the destination must end with '/' (%.100s)", dest);
    for (size_t k = i; rc == 0 && k + 1 < n; k++) {
        const char *src = json_string_value(json_array_get(ws, k));
        if (strstr(src, "://") != NULL || strncmp(src, "git@", 4) == 0) {
            rc = bad(p, "remote sources are not supported (%.100s)", src);
            break;
        }
        while (src[0] == '.' && src[1] == '/')
            src += 2;
        if (src[0] == '/' || strstr(src, "..") != NULL || src[0] == '\0') {
            rc = bad(p, "a source must be a path inside the context (%.100s)", src);
            break;
        }
        json_t *c = json_pack("{s:s,s:s,s:s,s:s}", "files", p->context, "src", src, "dest", dest,
                              "user", user);
        if (mode != NULL)
            json_object_set_new(c, "mode", json_string(mode));
        json_array_append_new(p->out->steps, json_pack("{s:o}", "copy", c));
    }
    json_decref(ws);
    return rc;
}

/* One word, shell-quoted. */
static void quote(sp_buf_t *b, const char *w)
{
    sp_buf_str(b, "'");
    for (; *w; w++) {
        if (*w == '\'')
            sp_buf_str(b, "'\\''");
        else
            sp_buf_add(b, w, 1);
    }
    sp_buf_str(b, "'");
}

/* ENTRYPOINT and CMD as Docker runs them, as one shell line. */
static char *start_line(const struct parse *p)
{
    sp_buf_t b = SP_BUF_INIT;
    if (json_is_string(p->entrypoint)) {
        sp_buf_str(&b, json_string_value(p->entrypoint)); /* shell form: CMD is not passed */
    } else {
        json_t *parts[2] = {p->entrypoint, p->cmd};
        for (int k = 0; k < 2; k++) {
            if (json_is_string(parts[k])) {
                if (b.len > 0)
                    sp_buf_str(&b, " ");
                sp_buf_str(&b, json_string_value(parts[k]));
                continue;
            }
            for (size_t i = 0; i < json_array_size(parts[k]); i++) {
                if (b.len > 0)
                    sp_buf_str(&b, " ");
                quote(&b, json_string_value(json_array_get(parts[k], i)));
            }
        }
    }
    char *s = b.len > 0 && !b.oom ? strdup(sp_buf_cstr(&b)) : NULL;
    sp_buf_free(&b);
    return s;
}

static int instruction(struct parse *p, const char *ins, const char *rest)
{
    if (!p->from_seen && strcasecmp(ins, "FROM") != 0 && strcasecmp(ins, "ARG") != 0)
        return bad(p, "%s comes before FROM", ins);
    if (strcasecmp(ins, "FROM") == 0) {
        if (p->from_seen)
            return bad(p, "%s", "a second FROM: multi-stage builds are not supported");
        p->from_seen = true;
        json_t *ws = words(rest, false);
        const char *ref = json_string_value(json_array_get(ws, 0));
        int rc = 0;
        if (ref == NULL)
            rc = bad(p, "%s", "FROM needs a template");
        else if (strncmp(ref, "--", 2) == 0)
            rc = bad(p, "FROM options (%.60s) are not supported", ref);
        else if (json_array_size(ws) != 1 && !(json_array_size(ws) == 3 &&
                                               strcasecmp(json_string_value(json_array_get(ws, 1)),
                                                          "AS") == 0))
            rc = bad(p, "%s", "FROM takes a template and an optional AS name");
        else if (strcmp(ref, "scratch") == 0)
            rc = bad(p, "%s", "FROM scratch is not supported: start from a template (base)");
        else if (sp_tmplbuild_valid_name(ref)) /* a template; an image has a '/', ':' or '@' */
            snprintf(p->out->parent, sizeof p->out->parent, "%s", ref);
        else if (strlen(ref) >= sizeof p->out->image || strpbrk(ref, "/:@") == NULL)
            rc = bad(p,
                     "FROM %.100s: neither a template name nor an image reference "
                     "(registry/repository:tag)",
                     ref);
        else
            snprintf(p->out->image, sizeof p->out->image, "%s", ref);
        json_decref(ws);
        return rc;
    }
    if (strcasecmp(ins, "RUN") == 0) {
        while (isspace((unsigned char)*rest))
            rest++;
        if (strncmp(rest, "--", 2) == 0)
            return bad(p, "RUN options (%.60s) are not supported", rest);
        if (*rest == '\0')
            return bad(p, "%s", "RUN needs a command");
        json_t *ws = exec_form(rest);
        if (ws != NULL)
            json_array_append_new(p->out->steps, json_pack("{s:o}", "run", ws));
        else
            json_array_append_new(p->out->steps, json_pack("{s:s}", "run", rest));
        return 0;
    }
    if (strcasecmp(ins, "ENV") == 0 || strcasecmp(ins, "ARG") == 0)
        return env_step(p, rest, strcasecmp(ins, "ARG") == 0);
    if (strcasecmp(ins, "WORKDIR") == 0) {
        json_t *ws = words(rest, false);
        const char *d = json_string_value(json_array_get(ws, 0));
        int rc = 0;
        if (d == NULL || json_array_size(ws) != 1) {
            rc = bad(p, "%s", "WORKDIR takes one path");
        } else {
            sp_buf_t next = SP_BUF_INIT;
            if (d[0] != '/') { /* relative to the WORKDIR before */
                sp_buf_str(&next, strcmp(p->workdir, "/") != 0 ? p->workdir : "");
                sp_buf_str(&next, "/");
            }
            sp_buf_str(&next, d);
            if (next.len >= sizeof p->workdir)
                rc = bad(p, "%s", "WORKDIR is longer than 4095 bytes");
            else
                memcpy(p->workdir, sp_buf_cstr(&next), next.len + 1);
            sp_buf_free(&next);
            if (rc == 0)
                json_array_append_new(p->out->steps, json_pack("{s:s}", "workdir", p->workdir));
        }
        json_decref(ws);
        return rc;
    }
    if (strcasecmp(ins, "USER") == 0) {
        json_t *ws = words(rest, false);
        const char *u = json_string_value(json_array_get(ws, 0));
        int rc = 0;
        if (u == NULL || json_array_size(ws) != 1) {
            rc = bad(p, "%s", "USER takes one name");
        } else {
            char name[64];
            snprintf(name, sizeof name, "%.*s", (int)strcspn(u, ":"), u);
            json_array_append_new(p->out->steps, json_pack("{s:s}", "user", name));
        }
        json_decref(ws);
        return rc;
    }
    if (strcasecmp(ins, "COPY") == 0 || strcasecmp(ins, "ADD") == 0)
        return copy_step(p, rest, strcasecmp(ins, "ADD") == 0);
    if (strcasecmp(ins, "CMD") == 0 || strcasecmp(ins, "ENTRYPOINT") == 0) {
        while (isspace((unsigned char)*rest))
            rest++;
        json_t *v = exec_form(rest);
        if (v == NULL)
            v = json_string(rest);
        json_t **slot = strcasecmp(ins, "CMD") == 0 ? &p->cmd : &p->entrypoint;
        json_decref(*slot);
        *slot = v;
        return 0;
    }
    return bad(p, "%s is not supported by this server", ins);
}

int sp_dockerfile_parse(const char *text, size_t len, const char *context, sp_dockerfile_t *out,
                        sp_err_t *err)
{
    memset(out, 0, sizeof(*out));
    if (len > SP_DOCKERFILE_MAX || memchr(text, '\0', len) != NULL)
        return sp_err_set(err, SP_EINVAL, "the Dockerfile is over 1 MiB or has a NUL byte");
    struct parse p = {.out = out, .context = context, .err = err};
    snprintf(p.workdir, sizeof p.workdir, "/");
    out->steps = json_array();
    sp_buf_t ins = SP_BUF_INIT;
    int rc = 0, lineno = 0;
    bool cont = false;
    for (size_t i = 0; i < len && rc == 0;) {
        const char *l = text + i;
        const char *nl = memchr(l, '\n', len - i);
        size_t n = nl ? (size_t)(nl - l) : len - i;
        i += n + (nl ? 1 : 0);
        lineno++;
        while (n > 0 && isspace((unsigned char)l[n - 1]))
            n--;
        size_t lead = 0;
        while (lead < n && isspace((unsigned char)l[lead]))
            lead++;
        if (lead == n || l[lead] == '#')
            continue; /* blank lines and comments (parser directives too), even inside one */
        if (!cont)
            p.line = lineno;
        bool more = l[n - 1] == '\\';
        sp_buf_add(&ins, l + lead, n - lead - (more ? 1 : 0));
        if (more) {
            sp_buf_add(&ins, " ", 1);
            cont = true;
            continue;
        }
        cont = false;
        const char *s = sp_buf_cstr(&ins);
        size_t wl = strcspn(s, " \t");
        char word[32];
        snprintf(word, sizeof word, "%.*s", (int)(wl < 31 ? wl : 31), s);
        rc = instruction(&p, word, s + wl);
        sp_buf_reset(&ins);
    }
    if (rc == 0 && cont) {
        p.line = lineno;
        rc = bad(&p, "%s", "the file ends inside a continued line");
    }
    if (rc == 0 && !p.from_seen)
        rc = sp_err_set(err, SP_EINVAL, "the Dockerfile has no FROM");
    if (rc == 0 && (p.entrypoint != NULL || p.cmd != NULL))
        out->start_cmd = start_line(&p);
    json_decref(p.entrypoint);
    json_decref(p.cmd);
    sp_buf_free(&ins);
    if (rc < 0)
        sp_dockerfile_free(out);
    return rc;
}

void sp_dockerfile_free(sp_dockerfile_t *d)
{
    json_decref(d->steps);
    free(d->start_cmd);
    d->steps = NULL;
    d->start_cmd = NULL;
}
