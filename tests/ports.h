/* A loopback port for a C test to hand to a server it starts, each one file that includes
 * this once.
 *
 * The port comes from below the kernel's ephemeral range and is free for TCP and for UDP when
 * chosen. A port the kernel hands out (bind to port 0) and the test closes again can go to an
 * outgoing connection of a suite running beside this one before the server binds it; the
 * agent's DNS listener takes both protocols on one port. */
#ifndef SP_TESTS_PORTS_H
#define SP_TESTS_PORTS_H

#include <arpa/inet.h>
#include <netinet/in.h>
#include <stdbool.h>
#include <stdio.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

static bool test_port_free(int port, int type)
{
    int s = socket(AF_INET, type | SOCK_CLOEXEC, 0);
    if (s < 0)
        return false;
    struct sockaddr_in sa = {.sin_family = AF_INET, .sin_port = htons((uint16_t)port)};
    sa.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    bool ok = bind(s, (struct sockaddr *)&sa, sizeof(sa)) == 0;
    close(s);
    return ok;
}

/* A port nothing held when asked, or -1. Each call starts its search elsewhere, so two calls
 * in a row do not return the same port. */
static int test_free_port(void)
{
    int lo = 32768;
    FILE *f = fopen("/proc/sys/net/ipv4/ip_local_port_range", "r");
    if (f) {
        if (fscanf(f, "%d", &lo) != 1)
            lo = 32768;
        fclose(f);
    }
    int base = lo > 11024 ? 10000 : 1024, span = lo > base + 1 ? lo - base : 1;
    static unsigned calls; /* later calls start 1,009 ports further on */
    unsigned r = ((unsigned)getpid() ^ (unsigned)time(NULL)) * 2654435761u + 1009u * ++calls;
    for (int i = 0; i < 1000; i++) {
        int port = base + (int)((r + (unsigned)i * 7919u) % (unsigned)span);
        if (test_port_free(port, SOCK_STREAM) && test_port_free(port, SOCK_DGRAM))
            return port;
    }
    return -1;
}

#endif
