/*
 * sni.c - the server name in a TLS ClientHello (sni.h).
 *
 * Reassembles the handshake message from its records into a stack buffer and
 * walks it with bounds checks at every step; owns nothing.
 */
#include "core/egress/sni.h"

#include <string.h>

int sp_sni_peek(const uint8_t *p, size_t n, char *name, size_t cap)
{
    uint8_t hs[SP_SNI_MAX_HELLO + 8];
    size_t hl = 0, off = 0;
    while (off + 5 <= n) {
        if (p[off] != 0x16)
            return SP_SNI_BAD;
        size_t rl = (size_t)p[off + 3] << 8 | p[off + 4];
        if (rl == 0 || rl > 16384 + 256)
            return SP_SNI_BAD;
        if (off + 5 + rl > n)
            break;
        size_t k = rl;
        if (hl + k > sizeof(hs))
            return SP_SNI_BAD; /* a ClientHello larger than we look at */
        memcpy(hs + hl, p + off + 5, k);
        hl += k;
        off += 5 + rl;
        if (hl >= 4) {
            if (hs[0] != 1)
                return SP_SNI_BAD;
            size_t ml = (size_t)hs[1] << 16 | (size_t)hs[2] << 8 | hs[3];
            if (ml > sizeof(hs) - 4)
                return SP_SNI_BAD;
            if (hl >= 4 + ml) {
                const uint8_t *b = hs + 4, *e = hs + 4 + ml;
                if (e - b < 34)
                    return SP_SNI_BAD;
                b += 34; /* version, random */
                if (b + 1 > e || b + 1 + b[0] > e)
                    return SP_SNI_BAD;
                b += 1 + b[0]; /* session id */
                if (b + 2 > e)
                    return SP_SNI_BAD;
                size_t cl = (size_t)b[0] << 8 | b[1];
                if (b + 2 + cl > e)
                    return SP_SNI_BAD;
                b += 2 + cl; /* cipher suites */
                if (b + 1 > e || b + 1 + b[0] > e)
                    return SP_SNI_BAD;
                b += 1 + b[0]; /* compression */
                if (b == e)
                    return SP_SNI_NONE;
                if (b + 2 > e)
                    return SP_SNI_BAD;
                size_t el = (size_t)b[0] << 8 | b[1];
                b += 2;
                if (b + el > e)
                    return SP_SNI_BAD;
                const uint8_t *xe = b + el;
                while (b + 4 <= xe) {
                    unsigned type = (unsigned)b[0] << 8 | b[1];
                    size_t xl = (size_t)b[2] << 8 | b[3];
                    b += 4;
                    if (b + xl > xe)
                        return SP_SNI_BAD;
                    if (type == 0) {
                        const uint8_t *s = b, *se = b + xl;
                        if (s + 2 > se)
                            return SP_SNI_BAD;
                        s += 2;
                        while (s + 3 <= se) {
                            unsigned nt = s[0];
                            size_t nl = (size_t)s[1] << 8 | s[2];
                            s += 3;
                            if (s + nl > se)
                                return SP_SNI_BAD;
                            if (nt == 0) {
                                if (nl == 0 || nl >= cap)
                                    return SP_SNI_BAD;
                                memcpy(name, s, nl);
                                name[nl] = '\0';
                                return memchr(name, '\0', nl) ? SP_SNI_BAD : SP_SNI_FOUND;
                            }
                            s += nl;
                        }
                        return SP_SNI_NONE;
                    }
                    b += xl;
                }
                return SP_SNI_NONE;
            }
        }
    }
    return SP_SNI_NEED;
}
