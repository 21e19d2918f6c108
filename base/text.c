/*
 * text.c - hex digits, bytes as hex, and trimming (text.h).
 */
#include "base/text.h"

#include <string.h>

int sp_text_hexval(int c)
{
    if (c >= '0' && c <= '9')
        return c - '0';
    if (c >= 'a' && c <= 'f')
        return c - 'a' + 10;
    if (c >= 'A' && c <= 'F')
        return c - 'A' + 10;
    return -1;
}

static int trailing_blank(char c)
{
    return c == ' ' || c == '\t' || c == '\r' || c == '\n';
}

char *sp_text_trim(char *s)
{
    while (*s == ' ' || *s == '\t')
        s++;
    size_t n = strlen(s);
    while (n > 0 && trailing_blank(s[n - 1]))
        s[--n] = '\0';
    return s;
}

void sp_text_hex(const unsigned char *p, size_t n, char *out)
{
    static const char digits[] = "0123456789abcdef";
    for (size_t i = 0; i < n; i++) {
        out[2 * i] = digits[p[i] >> 4];
        out[2 * i + 1] = digits[p[i] & 15];
    }
    out[2 * n] = '\0';
}
