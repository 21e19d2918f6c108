/*
 * cmd.c - the helpers every command uses (cmd.h).
 */
#include "cli/cmd.h"

#include <stdarg.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

int spc_fail(const sp_err_t *e)
{
    fprintf(stderr, "spacectl: %s\n", e->msg);
    return SPC_EXIT_FAIL;
}

int spc_failf(const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    fputs("spacectl: ", stderr);
    vfprintf(stderr, fmt, ap);
    fputc('\n', stderr);
    va_end(ap);
    return SPC_EXIT_FAIL;
}

static const char *real_getenv(const char *name)
{
    return getenv(name);
}

int spc_api(spc_api_t *a)
{
    sp_err_t e;
    spc_config_t c;
    if (spc_config_load(&c, real_getenv, geteuid(), &e) < 0 || spc_api_init(a, &c, &e) < 0) {
        spc_fail(&e);
        return -1;
    }
    if (c.key[0] == '\0') {
        spc_failf("no API key: %s (spacectl login saves one)", c.looked);
        return -1;
    }
    return 0;
}

int spc_print_json(const json_t *j)
{
    int rc = json_dumpf(j, stdout, JSON_INDENT(2) | JSON_PRESERVE_ORDER);
    fputc('\n', stdout);
    return rc == 0 && fflush(stdout) == 0 ? 0 : SPC_EXIT_FAIL;
}

int spc_show(const spc_args_t *a, const char *path, void (*print)(const json_t *ans))
{
    spc_api_t api;
    sp_err_t e;
    json_t *ans;
    if (spc_api(&api) < 0)
        return SPC_EXIT_FAIL;
    if (spc_api_call(&api, "GET", path, NULL, &ans, NULL, &e) < 0)
        return spc_fail(&e);
    int rc = 0;
    if (spc_args_count(a, "json"))
        rc = spc_print_json(ans);
    else
        print(ans);
    json_decref(ans);
    return rc;
}

int spc_delete(const char *path, const char *what, const char *name)
{
    spc_api_t api;
    sp_err_t e;
    if (spc_api(&api) < 0)
        return SPC_EXIT_FAIL;
    if (spc_api_call(&api, "DELETE", path, NULL, NULL, NULL, &e) < 0)
        return spc_fail(&e);
    printf("%s %s deleted\n", what, name);
    return 0;
}

int spc_kv_object(const char *const *items, size_t n, const char *what, json_t **out,
                  sp_err_t *err)
{
    json_t *o = json_object();
    for (size_t i = 0; i < n; i++) {
        const char *eq = strchr(items[i], '=');
        if (eq == NULL || eq == items[i]) {
            json_decref(o);
            return sp_err_set(err, SP_EINVAL, "%s wants NAME=VALUE, not '%.60s'", what,
                              items[i]);
        }
        char name[256];
        snprintf(name, sizeof(name), "%.*s", (int)(eq - items[i]), items[i]);
        json_object_set_new(o, name, json_string(eq + 1));
    }
    *out = o;
    return 0;
}

const char *spc_str(const json_t *o, const char *key)
{
    const char *s = json_string_value(json_object_get(o, key));
    return s ? s : "";
}

const char *spc_cell(const json_t *o, const char *key, char *buf, size_t cap)
{
    json_t *v = json_object_get(o, key);
    if (json_is_string(v))
        return json_string_value(v);
    if (json_is_integer(v))
        snprintf(buf, cap, "%lld", (long long)json_integer_value(v));
    else if (json_is_real(v))
        snprintf(buf, cap, "%g", json_real_value(v));
    else if (json_is_boolean(v))
        snprintf(buf, cap, "%s", json_is_true(v) ? "true" : "false");
    else
        buf[0] = '\0';
    return buf;
}

const char *spc_time(const char *iso, char *buf, size_t cap)
{
    /* The API's times are UTC, "YYYY-MM-DDTHH:MM:SS[.frac]Z": keep the date and seconds. */
    if (strlen(iso) >= 19 && iso[10] == 'T') {
        snprintf(buf, cap, "%.10s %.8s", iso, iso + 11);
        return buf;
    }
    return iso;
}

const char *spc_path(char *buf, size_t cap, const char *fmt, const char *id)
{
    sp_buf_t b = SP_BUF_INIT;
    spc_urlencode(&b, id);
    snprintf(buf, cap, fmt, sp_buf_cstr(&b));
    sp_buf_free(&b);
    return buf;
}
