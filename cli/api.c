/*
 * api.c - JSON calls to the native API, its errors, and operations (api.h).
 */
#include "cli/api.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define MAX_JSON        (64 * 1024 * 1024) /* a page of 1000 sandboxes is far below */
#define CALL_TIMEOUT_MS 60000
#define WAIT_S          300 /* the API's longest ?wait= */

int spc_api_init_url(spc_api_t *a, const char *url, sp_err_t *err)
{
    memset(a, 0, sizeof(*a));
    return spc_url_parse(url, &a->url, err);
}

int spc_api_init(spc_api_t *a, const spc_config_t *c, sp_err_t *err)
{
    if (spc_api_init_url(a, c->url, err) < 0)
        return -1;
    snprintf(a->key, sizeof(a->key), "%s", c->key);
    snprintf(a->key_from, sizeof(a->key_from), "%s", c->key_from);
    return 0;
}

int spc_api_error(spc_api_t *a, spc_resp_t *r, sp_err_t *err)
{
    sp_buf_t b = SP_BUF_INIT;
    sp_err_t e2;
    int st = spc_resp_status(r);
    json_t *j = NULL;
    if (spc_resp_read_all(r, &b, 1024 * 1024, &e2) == 0 && b.len > 0)
        j = json_loadb((const char *)b.p, b.len, 0, NULL);
    sp_buf_free(&b);
    const char *msg = json_string_value(json_object_get(json_object_get(j, "error"), "message"));
    sp_code_t code = st == 400 ? SP_EINVAL
                     : st == 401 ? SP_EAUTH
                     : st == 403 ? SP_EFORBIDDEN
                     : st == 404 ? SP_ENOTFOUND
                     : st == 409 ? SP_ECONFLICT
                     : st == 413 ? SP_ETOOBIG
                     : st >= 500 ? SP_EUNAVAIL
                                 : SP_EINVAL;
    if (msg == NULL)
        sp_err_set(err, code, "the server at %.100s answered %d", a->url.text, st);
    else if (st == 401)
        sp_err_set(err, code, "%s (the key from %.100s)", msg, a->key_from);
    else
        sp_err_set(err, code, "%s", msg);
    json_decref(j);
    return -1;
}

int spc_api_call(spc_api_t *a, const char *method, const char *path, json_t *body, json_t **out,
                 int *status, sp_err_t *err)
{
    if (out != NULL)
        *out = NULL;
    if (status != NULL)
        *status = 0;
    char *text = body != NULL ? json_dumps(body, JSON_COMPACT) : NULL;
    if (body != NULL && text == NULL)
        return sp_err_set(err, SP_EINTERNAL, "out of memory");
    /* A call that waits on the server (?wait=) may take that long to answer. */
    bool waits = strstr(path, "wait=") != NULL;
    spc_req_t rq = {.method = method, .path = path, .bearer = a->key[0] ? a->key : NULL,
                    .content_type = text ? "application/json" : NULL, .body = text,
                    .body_len = text ? strlen(text) : 0,
                    .timeout_ms = waits ? (WAIT_S + 30) * 1000 : CALL_TIMEOUT_MS};
    spc_resp_t *r = spc_http_send(&a->url, &rq, err);
    free(text);
    if (r == NULL)
        return -1;
    int st = spc_resp_status(r);
    if (status != NULL)
        *status = st;
    if (st < 200 || st > 299) {
        spc_api_error(a, r, err);
        spc_resp_free(r);
        return -1;
    }
    sp_buf_t b = SP_BUF_INIT;
    int rc = spc_resp_read_all(r, &b, MAX_JSON, err);
    spc_resp_free(r);
    if (rc == 0 && b.len > 0 && out != NULL) {
        json_error_t je;
        *out = json_loadb((const char *)b.p, b.len, 0, &je);
        if (*out == NULL)
            rc = sp_err_set(err, SP_EUNAVAIL, "the server's answer is not JSON: %.80s", je.text);
    }
    sp_buf_free(&b);
    return rc;
}

static bool finished(json_t *op)
{
    const char *s = json_string_value(json_object_get(op, "status"));
    return s != NULL && (strcmp(s, "succeeded") == 0 || strcmp(s, "failed") == 0);
}

json_t *spc_api_wait(spc_api_t *a, json_t *first, sp_err_t *err)
{
    json_t *op = json_incref(json_object_get(first, "operation"));
    const char *id = json_string_value(json_object_get(op, "id"));
    if (id == NULL) {
        json_decref(op);
        sp_err_set(err, SP_EUNAVAIL, "the server's answer names no operation");
        return NULL;
    }
    char path[256];
    while (!finished(op)) {
        snprintf(path, sizeof(path), "/v1/operations/%s?wait=%d",
                 json_string_value(json_object_get(op, "id")), WAIT_S);
        json_t *next;
        if (spc_api_call(a, "GET", path, NULL, &next, NULL, err) < 0) {
            json_decref(op);
            return NULL;
        }
        json_decref(op);
        op = next;
    }
    /* The sandbox as it is now; gone after a finished delete (null, as the API says it). */
    const char *sid = json_string_value(json_object_get(op, "sandbox_id"));
    json_t *sb = NULL;
    int st = 0;
    sp_err_t e2;
    if (sid != NULL) {
        snprintf(path, sizeof(path), "/v1/sandboxes/%s", sid);
        if (spc_api_call(a, "GET", path, NULL, &sb, &st, &e2) < 0 && st != 404) {
            json_decref(op);
            *err = e2;
            return NULL;
        }
    }
    return json_pack("{s:o,s:o}", "sandbox", sb ? sb : json_null(), "operation", op);
}
