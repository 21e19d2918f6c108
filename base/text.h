/*
 * text.h - small pure helpers on C text that parsers in several folders need: a hex digit's
 * value, bytes as lowercase hex, a line's field without its surrounding blanks.
 *
 * No allocation, no locale: bytes are compared as ASCII. Anything larger (URLs, HTTP
 * heads, JSON) belongs to its own module.
 */
#ifndef SP_BASE_TEXT_H
#define SP_BASE_TEXT_H

#include <stddef.h>

/* The value of the hex digit c (0-9, a-f, A-F), or -1 for any other byte (a negative char
 * included). */
int sp_text_hexval(int c);

/* The n bytes at p as 2n lowercase hex digits and a NUL in out (2n+1 bytes). */
void sp_text_hex(const unsigned char *p, size_t n, char *out);

/* s without its leading spaces and tabs, its trailing spaces, tabs, CRs and LFs cut off in
 * place (s is written). */
char *sp_text_trim(char *s);

#endif
