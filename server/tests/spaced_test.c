/*
 * spaced_test.c - `spaced` plus the test-only driver, selected with --runtime test.
 */
#include "server/server.h"
#include "server/tests/fakedriver.h"

int main(int argc, char **argv)
{
    return sp_server_main(argc, argv, sp_test_fakedriver_create);
}
