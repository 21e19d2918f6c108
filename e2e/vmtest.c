/*
 * vmtest.c - the C end-to-end tests' shared helpers (vmtest.h).
 */
#include "e2e/vmtest.h"

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "base/agentproto.h"
#include "core/channel/agentconn.h"
#include "core/runtime/qemu.h"
#include "guest/tmplbuild.h"
#include "tests/check.h"

sp_loop_t *vt_loop;
const char *vt_data_dir;
double vt_mult = 1.0;
sp_tmplbuild_paths_t vt_base;

void vt_init(void)
{
    vt_data_dir = getenv("SP_TEST_DATA_DIR");
    const char *m = getenv("SP_TEST_TIMEOUT_MULT");
    if (m != NULL && atof(m) > 0)
        vt_mult = atof(m);
    if (system("command -v qemu-system-x86_64 >/dev/null && command -v qemu-img >/dev/null") != 0) {
        printf("skip: qemu-system-x86_64 or qemu-img not installed\n");
        exit(77);
    }
    if (vt_data_dir == NULL) {
        printf("skip: SP_TEST_DATA_DIR (a data dir with a built base template) is not set\n");
        exit(77);
    }
    sp_err_t e;
    if (sp_tmplbuild_current(vt_data_dir, "base", &vt_base, &e) < 0) {
        printf("skip: template base is not built in SP_TEST_DATA_DIR: %s\n", e.msg);
        exit(77);
    }
    vt_loop = sp_loop_create();
    REQUIRE(vt_loop != NULL);
}

void vt_on_res(void *arg, const sp_err_t *err)
{
    vt_res_t *r = arg;
    if (r == NULL)
        return;
    r->done++;
    r->ok = err == NULL;
    if (err != NULL)
        r->err = *err;
}

sp_driver_t *vt_driver(int cold, int pool)
{
    return vt_driver_at(vt_data_dir, NULL, cold, pool);
}

sp_driver_t *vt_driver_at(const char *data_dir, const char *snapshot_dir, int cold, int pool)
{
    const char *accel = getenv("SP_TEST_ACCEL");
    sp_qemu_opts_t o = {.data_dir = data_dir,
                        .accel = accel ? accel : "auto",
                        .cold_boot = cold,
                        .pool_size = pool,
                        .snapshot_dir = snapshot_dir};
    sp_err_t e;
    sp_driver_t *d = sp_qemu_create(vt_loop, &o, &e);
    if (d == NULL)
        fprintf(stderr, "sp_qemu_create: %s\n", e.msg);
    REQUIRE(d != NULL);
    return d;
}

double vt_now_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec * 1000.0 + (double)ts.tv_nsec / 1e6;
}

int vt_wait_for(int *flag, double timeout_ms)
{
    double end = vt_now_ms() + timeout_ms * vt_mult;
    while (!*flag && vt_now_ms() < end)
        sp_loop_run_once(vt_loop, 20);
    return *flag ? 0 : -1;
}

void vt_run_for(double ms)
{
    double end = vt_now_ms() + ms;
    while (vt_now_ms() < end)
        sp_loop_run_once(vt_loop, 10);
}

void vt_wait_ok(vt_res_t *r, const char *what, const char *id, double timeout_ms)
{
    REQUIRE(vt_wait_for(&r->done, timeout_ms) == 0);
    if (!r->ok)
        fprintf(stderr, "%s %s failed: %s\n", what, id, r->err.msg);
    REQUIRE(r->ok);
}

void vt_op(sp_driver_t *d, int (*op)(sp_driver_t *, const char *, sp_driver_cb, void *, sp_err_t *),
           const char *id, double timeout_ms)
{
    vt_res_t r = {0};
    sp_err_t e;
    if (op(d, id, vt_on_res, &r, &e) < 0) {
        fprintf(stderr, "op %s: %s\n", id, e.msg);
        exit(1);
    }
    vt_wait_ok(&r, "op", id, timeout_ms);
}

void vt_boot_start(sp_driver_t *d, const sp_vm_spec_t *spec, vt_res_t *r)
{
    sp_err_t e;
    if (d->ops->boot(d, spec, vt_on_res, r, &e) < 0) {
        fprintf(stderr, "boot %s: %s\n", spec->sandbox_id, e.msg);
        exit(1);
    }
}

double vt_boot(sp_driver_t *d, const sp_vm_spec_t *spec, double timeout_ms)
{
    vt_res_t r = {0};
    double t0 = vt_now_ms();
    vt_boot_start(d, spec, &r);
    vt_wait_ok(&r, "boot", spec->sandbox_id, timeout_ms);
    return vt_now_ms() - t0;
}

struct proc {
    char out[512];
    size_t n;
    int exited;
    int failed;
};

static void p_frame(sp_agentstream_t *s, uint16_t type, uint16_t flags, const uint8_t *p,
                    size_t len, void *arg)
{
    struct proc *pr = arg;
    if (type == SP_AP_T_PROC_STDOUT) {
        size_t k = len < sizeof pr->out - 1 - pr->n ? len : sizeof pr->out - 1 - pr->n;
        memcpy(pr->out + pr->n, p, k);
        pr->n += k;
        pr->out[pr->n] = '\0';
        sp_agentstream_grant(s, (uint32_t)len);
    }
    if (flags & SP_AP_F_END) {
        if (type != SP_AP_T_PROC_EXIT)
            pr->failed = 1;
        pr->exited = 1;
    }
}

static void p_error(sp_agentstream_t *s, const sp_err_t *err, void *arg)
{
    struct proc *pr = arg;
    pr->failed = 1;
    pr->exited = 1;
}

void vt_run_cmd(sp_driver_t *d, const char *id, const char *cmd, char *out, size_t n,
                double timeout_ms)
{
    sp_agentconn_t *c = d->ops->agent(d, id);
    REQUIRE(c != NULL);
    vt_res_t up = {0};
    REQUIRE(sp_agentconn_when_up(c, (uint32_t)(20000 * vt_mult), vt_on_res, &up) == 0);
    REQUIRE(vt_wait_for(&up.done, 25000) == 0 && up.ok);
    uint8_t buf[512];
    sp_ap_writer_t w;
    sp_ap_writer_init(&w, buf, sizeof buf);
    sp_ap_put_str(&w, SP_AP_K_CMD, cmd);
    sp_ap_put_u32(&w, SP_AP_K_STDIN, 0);
    REQUIRE(!w.overflow);
    static const sp_agentstream_cbs_t cbs = {p_frame, p_error, NULL};
    struct proc pr = {0};
    sp_err_t e;
    sp_agentstream_t *s = sp_agentconn_open(c, SP_AP_T_PROC_START, buf, w.len, &cbs, &pr, &e);
    REQUIRE(s != NULL);
    REQUIRE(vt_wait_for(&pr.exited, timeout_ms) == 0);
    REQUIRE(!pr.failed);
    while (pr.n > 0 && pr.out[pr.n - 1] == '\n')
        pr.out[--pr.n] = '\0';
    snprintf(out, n, "%s", pr.out);
}

void vt_read_file(const char *path, char *out, size_t n)
{
    out[0] = '\0';
    FILE *f = fopen(path, "r");
    if (f == NULL)
        return;
    size_t k = fread(out, 1, n - 1, f);
    out[k] = '\0';
    fclose(f);
}

pid_t vt_vm_pid(const char *id)
{
    char p[4096], b[32];
    snprintf(p, sizeof p, "%s/vms/%s/qemu.pid", vt_data_dir, id);
    FILE *f = fopen(p, "r");
    if (f == NULL)
        return 0;
    pid_t pid = 0;
    if (fgets(b, sizeof b, f) != NULL)
        pid = (pid_t)atoi(b);
    fclose(f);
    return pid;
}
