/*
 * spacectl.c - the command-line client of space's native API: the program around
 * spc_main (cli/dispatch.c).
 *
 * spacectl talks HTTP to a spaced, local or remote, like any other API client: it links only
 * base/ and its own modules (cli/http.h, cli/ws.h, cli/api.h), never core/.
 */
#include <signal.h>

#include "cli/cmd.h"

int main(int argc, char **argv)
{
    /* A server or a reader that goes away is an error to report, not a signal to die of. */
    signal(SIGPIPE, SIG_IGN);
    return spc_main(argc, argv);
}
