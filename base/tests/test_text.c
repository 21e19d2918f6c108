/*
 * test_text.c - base/text.h: hex digits, bytes as hex, trimming.
 */
#include <string.h>

#include "base/text.h"
#include "tests/check.h"

static void test_text_hexval(void)
{
    {
        const unsigned char b[] = {0x00, 0x9f, 0xa0, 0xff};
        char out[9];
        sp_text_hex(b, sizeof b, out);
        CHECK(strcmp(out, "009fa0ff") == 0);
        sp_text_hex(b, 0, out);
        CHECK(out[0] == '\0');
    }
    CHECK(sp_text_hexval('0') == 0 && sp_text_hexval('9') == 9);
    CHECK(sp_text_hexval('a') == 10 && sp_text_hexval('f') == 15);
    CHECK(sp_text_hexval('A') == 10 && sp_text_hexval('F') == 15);
    CHECK(sp_text_hexval('g') == -1 && sp_text_hexval('G') == -1 && sp_text_hexval(' ') == -1);
    CHECK(sp_text_hexval('/') == -1 && sp_text_hexval(':') == -1 && sp_text_hexval('@') == -1);
    CHECK(sp_text_hexval((char)0xc3) == -1 && sp_text_hexval(0xc3) == -1);
}

static void test_text_trim(void)
{
    char a[] = " \t key = v \t\r\n";
    CHECK(strcmp(sp_text_trim(a), "key = v") == 0);
    char b[] = "plain";
    CHECK(sp_text_trim(b) == b && strcmp(b, "plain") == 0);
    char c[] = " \t\r\n";
    CHECK(strcmp(sp_text_trim(c), "") == 0);
    char d[] = "";
    CHECK(strcmp(sp_text_trim(d), "") == 0);
    char e[] = "\nx"; /* a line end is cut only at the end */
    CHECK(strcmp(sp_text_trim(e), "\nx") == 0);
}

int main(void)
{
    test_text_hexval();
    test_text_trim();
    return check_report("base.text");
}
