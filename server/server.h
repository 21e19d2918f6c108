/*
 * server.h - the `spaced` program: command line, start-up, the serve loop.
 *
 * Folder: server/ is only the program: it wires the folders below it together. (ARCHITECTURE.md:
 * the layers.)
 *
 * The shipped binary calls sp_server_main with no extra driver. Test
 * binaries under tests/ may pass one (a test-only runtime), which the
 * shipped binary can never select.
 */
#ifndef SP_SERVER_H
#define SP_SERVER_H

#include "core/runtime/driver.h"

typedef sp_driver_t *(*sp_server_driver_factory)(sp_loop_t *loop, const char *data_dir);

int sp_server_main(int argc, char **argv, sp_server_driver_factory test_driver);

#endif
