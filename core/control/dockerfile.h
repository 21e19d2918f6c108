/*
 * dockerfile.h - the common subset of a Dockerfile, read into a template build's parent, steps
 * and start command (core/control/tmpl.h).
 *
 * Folder: core/control/ is sandboxes' lifecycle: these operations, states, the controller that
 * reconciles them, API keys. (ARCHITECTURE.md: the layers.)
 *
 * Taken: one FROM (a template's name, or a container image's reference: one with a '/', ':'
 * or '@', as "ubuntu:22.04" or "registry:5000/app"; `AS name` allowed), RUN (shell and exec form), ENV (both
 * forms), ARG (its default, as env), WORKDIR, USER (`user[:group]`, the group ignored),
 * COPY and ADD of local files (`--chown=`, `--chmod=`; several sources; from the build
 * context: uploaded files whose key the caller gives), CMD and ENTRYPOINT (the start command,
 * as Docker combines them), comments, parser directives, line continuations. Refused with the
 * line number and why, never skipped: a second FROM (multi-stage), FROM scratch,
 * `--mount` and other RUN flags, COPY --from, ADD of a URL, COPY without a context, and every
 * other instruction (HEALTHCHECK, ONBUILD, EXPOSE, LABEL, VOLUME, SHELL, STOPSIGNAL...).
 * Pure: no I/O.
 */
#ifndef SP_DOCKERFILE_H
#define SP_DOCKERFILE_H

#include <jansson.h>

#include "base/err.h"

#define SP_DOCKERFILE_MAX (1u << 20) /* bytes of a Dockerfile */

typedef struct {
    char parent[65];  /* FROM a template, or "" */
    char image[512];  /* FROM an image, or "" */
    json_t *steps;    /* tmpl steps (array, owned) */
    char *start_cmd;  /* from CMD/ENTRYPOINT, or NULL (owned) */
} sp_dockerfile_t;

/* Reads text (len bytes). context: the key of the uploaded build context, or NULL (then COPY
 * and ADD are refused). SP_EINVAL with "line N: ..." on anything it does not take. */
int sp_dockerfile_parse(const char *text, size_t len, const char *context, sp_dockerfile_t *out,
                        sp_err_t *err);
void sp_dockerfile_free(sp_dockerfile_t *d);

#endif
