/*
 * vmtest.h - what the C end-to-end tests (test_qemu_driver.c, test_clones.c, test_forks.c)
 * share: the start-up checks, the QEMU driver on the test data dir, a loop pumped until a flag
 * is set, results of driver calls, boots, commands run in a guest over the agent channel, and
 * files of the data dir read.
 */
#ifndef SP_E2E_VMTEST_H
#define SP_E2E_VMTEST_H

#include <stddef.h>
#include <sys/types.h>

#include "base/err.h"
#include "core/runtime/driver.h"
#include "guest/tmplbuild.h"
#include "loop/loop.h"

extern sp_loop_t *vt_loop;
extern const char *vt_data_dir;      /* SP_TEST_DATA_DIR: a data dir with a built base template */
extern double vt_mult;               /* SP_TEST_TIMEOUT_MULT */
extern sp_tmplbuild_paths_t vt_base; /* the base template's files */

/* Reads the environment, makes the loop; exits 77 (skip, saying why) without QEMU or a
 * built base template. */
void vt_init(void);

/* One driver call's outcome: vt_on_res counts calls in done. */
typedef struct {
    int done;
    int ok;
    sp_err_t err;
} vt_res_t;
void vt_on_res(void *arg, const sp_err_t *err);

/* A QEMU driver on vt_data_dir (accel from SP_TEST_ACCEL, else auto). cold: cold_boot (never
 * from a template snapshot); pool: pool_size (-1 no spare clones, 0 the driver's default).
 * Stops the test if it cannot be made. */
sp_driver_t *vt_driver(int cold, int pool);
/* The same on another data dir, with a shared snapshot dir (NULL: none). */
sp_driver_t *vt_driver_at(const char *data_dir, const char *snapshot_dir, int cold, int pool);

double vt_now_ms(void);
/* Runs the loop until *flag is non-zero or timeout_ms (times vt_mult) passed: 0 or -1. */
int vt_wait_for(int *flag, double timeout_ms);
/* Runs the loop for ms. */
void vt_run_for(double ms);

/* op(d, id, ...) and waits (timeout_ms) for it to succeed; stops the test otherwise. */
void vt_op(sp_driver_t *d, int (*op)(sp_driver_t *, const char *, sp_driver_cb, void *, sp_err_t *),
           const char *id, double timeout_ms);
/* Waits (timeout_ms) for the driver call r was given to to succeed; stops the test
 * otherwise, saying which (what, id) and why. */
void vt_wait_ok(vt_res_t *r, const char *what, const char *id, double timeout_ms);

/* Starts booting spec (its outcome into r by vt_on_res); stops the test if the driver
 * refuses it at once. */
void vt_boot_start(sp_driver_t *d, const sp_vm_spec_t *spec, vt_res_t *r);
/* Boots spec and waits (timeout_ms) for it to succeed: ms from the call to agent ready. */
double vt_boot(sp_driver_t *d, const sp_vm_spec_t *spec, double timeout_ms);

/* Runs `sh -c cmd` in the guest (waiting for its agent); its stdout without trailing
 * newlines into out (cut to n). Stops the test if it cannot run or its stream fails. */
void vt_run_cmd(sp_driver_t *d, const char *id, const char *cmd, char *out, size_t n,
                double timeout_ms);

/* A small file's contents into out (cut to n), "" when it cannot be read. */
void vt_read_file(const char *path, char *out, size_t n);

/* The pid of the VM's QEMU from its pid file, 0 when there is none. */
pid_t vt_vm_pid(const char *id);

#endif
