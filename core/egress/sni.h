/*
 * sni.h - the server name (SNI) a TLS ClientHello asks for, read from the first
 * bytes a guest sends through a CONNECT tunnel, so the proxy can hold it to the
 * CONNECT host.
 *
 * Pure: no I/O, no allocation. Reads handshake records only; a ClientHello is
 * not checked beyond what reaching its extensions needs.
 */
#ifndef SP_EGRESS_SNI_H
#define SP_EGRESS_SNI_H

#include <stddef.h>
#include <stdint.h>

#define SP_SNI_MAX_HELLO 16384 /* bytes of a ClientHello message looked at; larger is BAD */

enum {
    SP_SNI_NEED = 0, /* not all of the ClientHello is there yet */
    SP_SNI_NONE,     /* a ClientHello without a host name */
    SP_SNI_FOUND,    /* name holds it (NUL-terminated, as sent) */
    SP_SNI_BAD,      /* not a ClientHello, malformed, too large, or a name that does
                        not fit */
};

/*
 * Looks at p[0..n), the first bytes of a TLS connection: SP_SNI_* above. name
 * gets the host name when FOUND (cap bytes with its NUL; a name with a NUL in
 * it is BAD).
 */
int sp_sni_peek(const uint8_t *p, size_t n, char *name, size_t cap);

#endif
