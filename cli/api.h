/*
 * api.h - the native API as spacectl calls it: which server with which key (cli/config.h),
 * JSON requests and answers over cli/http.h, the server's errors in its own words, and
 * waiting for lifecycle operations.
 *
 * Paths are the API's ("/v1/sandboxes/..."); callers percent-encode what they put in them.
 */
#ifndef SPC_API_H
#define SPC_API_H

#include <jansson.h>

#include "base/err.h"
#include "cli/config.h"
#include "cli/http.h"

typedef struct {
    spc_url_t url;
    char key[512];
    char key_from[1100]; /* where the key came from, for a 401's message */
} spc_api_t;

/* The server and key of settings c (cli/config.h; the key may be ""). -1 with err for a bad
 * URL. */
int spc_api_init(spc_api_t *a, const spc_config_t *c, sp_err_t *err);
/* For login: the URL alone (no key needed yet). */
int spc_api_init_url(spc_api_t *a, const char *url, sp_err_t *err);

/*
 * method path with an optional JSON body (borrowed). A 2xx answer's JSON goes to *out (the
 * caller's; NULL for an empty body) and its status to *status (either may be NULL). Any other
 * answer is -1 with the server's error.message in err (and *status set); no answer at all is
 * -1 with SP_EUNAVAIL naming the URL.
 */
int spc_api_call(spc_api_t *a, const char *method, const char *path, json_t *body, json_t **out,
                 int *status, sp_err_t *err);

/* err from a response that is not 2xx: its error.message, or the status line when it has none.
 * Reads (and leaves) the body. Always -1. */
int spc_api_error(spc_api_t *a, spc_resp_t *r, sp_err_t *err);

/* Waits until operation op_id has finished (asking with ?wait= in turns of up to 300 s) and
 * returns the last answer of the call that finished it: { "sandbox", "operation" } for
 * lifecycle paths. first is the accepted answer (borrowed); its operation is followed. */
json_t *spc_api_wait(spc_api_t *a, json_t *first, sp_err_t *err);

#endif
