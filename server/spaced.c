/*
 * spaced.c - the shipped server binary.
 */
#include "server/server.h"

int main(int argc, char **argv)
{
    return sp_server_main(argc, argv, NULL);
}
