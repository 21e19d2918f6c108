/*
 * spaced_test.c - `spaced` plus the test-only driver, selected with --runtime test, and the
 * egress proxy's test hooks (core/egress/egress.h), read from the environment:
 *
 *   SPACE_TEST_EGRESS_HOSTS    a hosts-style file ("ADDRESS NAME..." lines, '#' comments)
 *                              the egress resolver consults before DNS, re-read on each
 *                              lookup: how tests make a name resolve to 127.0.0.1
 *   SPACE_TEST_EGRESS_PORT     the proxy port the guest agent listens on (fake agents run on
 *                              the host and must not share 3128)
 *   SPACE_TEST_EGRESS_NO_DNS=1 do not ask the agent to answer DNS (fake agents cannot bind 53)
 *
 * The shipped spaced has none of this.
 */
#include <arpa/inet.h>
#include <netinet/in.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

#include "core/egress/egress.h"
#include "server/server.h"
#include "server/tests/fakedriver.h"

/* Runs on the egress lookups' worker threads (SP_WORK_SHORT): no shared state, the file is read each time. */
static int hosts_resolve(const char *name, struct sockaddr_storage *out, int max)
{
    const char *path = getenv("SPACE_TEST_EGRESS_HOSTS");
    if (path == NULL || path[0] == '\0')
        return 0;
    FILE *f = fopen(path, "r");
    if (f == NULL)
        return 0;
    char line[512];
    int n = 0;
    while (n < max && fgets(line, sizeof(line), f) != NULL) {
        char *hash = strchr(line, '#');
        if (hash != NULL)
            *hash = '\0';
        char *save = NULL;
        char *addr = strtok_r(line, " \t\r\n", &save);
        if (addr == NULL)
            continue;
        for (char *h = strtok_r(NULL, " \t\r\n", &save); h != NULL;
             h = strtok_r(NULL, " \t\r\n", &save)) {
            if (strcasecmp(h, name) != 0)
                continue;
            struct sockaddr_storage ss;
            memset(&ss, 0, sizeof(ss));
            struct sockaddr_in *s4 = (struct sockaddr_in *)&ss;
            struct sockaddr_in6 *s6 = (struct sockaddr_in6 *)&ss;
            if (inet_pton(AF_INET, addr, &s4->sin_addr) == 1)
                s4->sin_family = AF_INET;
            else if (inet_pton(AF_INET6, addr, &s6->sin6_addr) == 1)
                s6->sin6_family = AF_INET6;
            else
                break;
            out[n++] = ss;
            break;
        }
    }
    fclose(f);
    return n;
}

int main(int argc, char **argv)
{
    sp_egress_test_hooks_t h = {.resolve = hosts_resolve};
    const char *port = getenv("SPACE_TEST_EGRESS_PORT");
    if (port != NULL && atoi(port) > 0 && atoi(port) < 65536)
        h.guest_port = (uint16_t)atoi(port);
    const char *nodns = getenv("SPACE_TEST_EGRESS_NO_DNS");
    h.no_dns = nodns != NULL && strcmp(nodns, "1") == 0;
    sp_egress_set_test_hooks(&h);
    return sp_server_main(argc, argv, sp_test_fakedriver_create);
}
