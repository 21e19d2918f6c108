/*
 * reqmetrics.h - counts every HTTP request a path configuration answers, once it is done:
 * space_http_requests_total and space_http_request_duration_seconds by surface, route class
 * and status code (base/metrics.h).
 *
 * The owner names the surface and the route class of each request (a classify callback
 * returning static strings from small fixed sets: never a path or an id). The duration runs
 * from the request's first byte to its response's last (or to now, for a client that left
 * first: code "0" when no response was started).
 */
#ifndef SP_REQMETRICS_H
#define SP_REQMETRICS_H

#include <h2o.h>

/* Fills *surface and *route with static strings; runs as the request is disposed. */
typedef void (*sp_reqmetrics_classify_fn)(void *arg, h2o_req_t *req, const char **surface,
                                          const char **route);

/* Adds the counting logger to pc (h2o owns it from there). -1 when out of memory. */
int sp_reqmetrics_attach(h2o_pathconf_t *pc, sp_reqmetrics_classify_fn fn, void *arg);

#endif
