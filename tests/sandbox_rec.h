/*
 * sandbox_rec.h - a plain running sandbox record (core/control/svc.h) for the tests that render
 * one: each test then sets what its surface shows on top (times, limits, escapes).
 */
#ifndef SP_TESTS_SANDBOX_REC_H
#define SP_TESTS_SANDBOX_REC_H

#include <jansson.h>
#include <stdio.h>
#include <string.h>

#include "core/control/svc.h"

/* s zeroed, then: an id, template base, running, created at a fixed time, deadline action
 * delete, token "tok", 1 vCPU, 256 MiB, no disk size recorded, empty metadata (the caller
 * frees it). */
static inline void test_sandbox_rec(sp_sandbox_rec_t *s)
{
    memset(s, 0, sizeof(*s));
    snprintf(s->id, sizeof(s->id), "abcdefghij0123456789");
    snprintf(s->template_name, sizeof(s->template_name), "base");
    snprintf(s->observed, sizeof(s->observed), "running");
    snprintf(s->desired, sizeof(s->desired), "running");
    snprintf(s->created_at, sizeof(s->created_at), "2026-12-02T00:25:19.123Z");
    snprintf(s->deadline_action, sizeof(s->deadline_action), "delete");
    snprintf(s->access_token, sizeof(s->access_token), "tok");
    s->cpu_count = 1;
    s->memory_mb = 256;
    s->disk_mb = -1;
    s->metadata = json_object();
}

#endif
