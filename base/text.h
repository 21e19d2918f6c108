/*
 * text.h - small pure helpers on ASCII text that several parsers share: hexadecimal digits
 * (percent-encoding, HTTP chunk sizes), trimming a line read from a config file.
 *
 * No allocation, no state, no locale: only ASCII characters count.
 */
#ifndef SP_BASE_TEXT_H
#define SP_BASE_TEXT_H

/* The value (0 to 15) of the hex digit c, either case; -1 for any other character. */
int sp_text_hex_value(unsigned char c);

/* s without its leading spaces and tabs (a pointer into s) and its trailing spaces, tabs, CRs
 * and LFs (cut in place). */
char *sp_text_trim(char *s);

#endif
