/*
 * opsrv.h - the operator listener (`spaced serve --metrics-listen ADDR:PORT`): plain HTTP on
 * its own address, apart from the public one, answering GET /metrics with the Prometheus
 * text of base/metrics.h and 404 to anything else. No authentication: bind it where only
 * the operator's scraper reaches (loopback, a management network).
 *
 * Not here: what is counted (each module, base/metrics.h), request counting on the public
 * listener (http/reqmetrics.h; this listener's own requests are not counted).
 */
#ifndef SP_OPSRV_H
#define SP_OPSRV_H

#include "base/err.h"
#include "loop/loop.h"

typedef struct sp_opsrv sp_opsrv_t;

/* Listens on addr ("A.B.C.D:PORT" or "[IPv6]:PORT") on the loop; NULL and err when it cannot. */
sp_opsrv_t *sp_opsrv_create(sp_loop_t *loop, const char *addr, sp_err_t *err);
/* Stops listening and frees. NULL does nothing. */
void sp_opsrv_destroy(sp_opsrv_t *o);

#endif
