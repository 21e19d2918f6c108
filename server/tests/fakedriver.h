/*
 * fakedriver.h - test-only runtime driver (state files, no VMs).
 */
#ifndef SP_TEST_FAKEDRIVER_H
#define SP_TEST_FAKEDRIVER_H

#include "core/runtime/driver.h"

sp_driver_t *sp_test_fakedriver_create(sp_loop_t *loop, const char *data_dir);

#endif
