/*
 * test_multipart.c - multipart/form-data parsing: normal and several parts, quoted and
 * escaped filenames, binary content, truncation, missing final boundary, huge headers.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "e2b-gateway/multipart.h"
#include "tests/check.h"

static const char *CT = "multipart/form-data; boundary=b0und";

static int parse_all(const char *ct, const void *body, size_t n, sp_multipart_part_t *parts,
                     char names[][256], int max)
{
    /* Part names live in the parser: it is kept until the next call. */
    static sp_multipart_t *m;
    free(m);
    m = malloc(sizeof(*m));
    sp_err_t err;
    if (sp_multipart_init(m, ct, body, n, &err) < 0)
        return -1;
    int k = 0, rc;
    while ((rc = sp_multipart_next(m, &parts[k], &err)) == 1) {
        snprintf(names[k], 256, "%s", parts[k].filename ? parts[k].filename : "(none)");
        if (++k == max)
            break;
    }
    return rc < 0 ? -1 : k;
}

static void test_multipart_one_part(void)
{
    const char *b = "--b0und\r\nContent-Disposition: form-data; name=\"file\"; "
                    "filename=\"/home/user/a.txt\"\r\nContent-Type: text/plain\r\n\r\nx\r\n"
                    "--b0und--\r\n";
    sp_multipart_part_t p[4];
    char n[4][256];
    CHECK(parse_all(CT, b, strlen(b), p, n, 4) == 1);
    CHECK(strcmp(p[0].name, "file") == 0 && strcmp(n[0], "/home/user/a.txt") == 0);
    CHECK(p[0].len == 1 && p[0].data[0] == 'x');
}

static void test_multipart_several_parts_and_preamble(void)
{
    const char *b = "preamble\r\n--b0und\r\nContent-Disposition: form-data; name=file; "
                    "filename=a\r\n\r\nAAA\r\n--b0und  \r\ncontent-disposition: form-data; "
                    "name=\"other\"\r\n\r\nzzz\r\n--b0und\r\nContent-Disposition: form-data; "
                    "name=\"file\"; filename=\"b\"\r\n\r\n\r\n--b0und--";
    sp_multipart_part_t p[8];
    char n[8][256];
    CHECK(parse_all(CT, b, strlen(b), p, n, 8) == 3);
    CHECK(strcmp(n[0], "a") == 0 && p[0].len == 3 && memcmp(p[0].data, "AAA", 3) == 0);
    CHECK(p[1].filename == NULL && strcmp(n[1], "(none)") == 0);
    CHECK(strcmp(n[2], "b") == 0 && p[2].len == 0);
}

static void test_multipart_quoted_filenames(void)
{
    const char *b = "--b0und\r\nContent-Disposition: form-data; name=\"file\"; "
                    "filename=\"we\\\"ird;name=x %22.txt\"\r\n\r\nq\r\n--b0und--\r\n";
    sp_multipart_part_t p[2];
    char n[2][256];
    CHECK(parse_all(CT, b, strlen(b), p, n, 2) == 1);
    CHECK(strcmp(n[0], "we\"ird;name=x %22.txt") == 0);
    CHECK(strcmp(p[0].name, "file") == 0);
    const char *ct2 = "Multipart/Form-Data; charset=x; boundary=\"b0und\"";
    CHECK(parse_all(ct2, b, strlen(b), p, n, 2) == 1);
}

static void test_multipart_binary_content(void)
{
    /* Content holding CRLF--, CRLF--b0un and NULs: only the whole delimiter ends it. */
    static const char content[] = "a\r\n--\r\n--b0un\r\n--b0unx\0\0\xff";
    size_t cl = sizeof(content) - 1;
    const char *h =
        "--b0und\r\nContent-Disposition: form-data; name=\"file\"; filename=\"f\"\r\n\r\n";
    const char *t = "\r\n--b0und--\r\n";
    size_t n = strlen(h) + cl + strlen(t);
    char *b = malloc(n);
    memcpy(b, h, strlen(h));
    memcpy(b + strlen(h), content, cl);
    memcpy(b + strlen(h) + cl, t, strlen(t));
    sp_multipart_part_t p[2];
    char nm[2][256];
    CHECK(parse_all(CT, b, n, p, nm, 2) == 1);
    CHECK(p[0].len == cl && memcmp(p[0].data, content, cl) == 0);
    free(b);
}

static void test_multipart_truncated_and_hostile(void)
{
    sp_multipart_part_t p[4];
    char n[4][256];
    const char *full = "--b0und\r\nContent-Disposition: form-data; name=\"file\"; filename=\"f\""
                       "\r\n\r\nhello\r\n--b0und--\r\n";
    /* Every strict prefix that cuts before the closing "--" fails. */
    size_t fl = strlen(full);
    for (size_t cut = 0; cut < fl - 4; cut++)
        CHECK(parse_all(CT, full, cut, p, n, 4) < 0);
    /* Missing final boundary. */
    const char *nofinal = "--b0und\r\nContent-Disposition: form-data; name=\"file\"\r\n\r\nabc";
    CHECK(parse_all(CT, nofinal, strlen(nofinal), p, n, 4) < 0);
    /* No boundary at all, bad content types. */
    CHECK(parse_all(CT, "garbage", 7, p, n, 4) < 0);
    CHECK(parse_all("multipart/form-data", full, fl, p, n, 4) < 0);
    CHECK(parse_all("multipart/form-data; boundary=", full, fl, p, n, 4) < 0);
    CHECK(parse_all("text/plain; boundary=b0und", full, fl, p, n, 4) < 0);
    CHECK(parse_all(NULL, full, fl, p, n, 4) < 0);
    /* Unterminated quote in the disposition. */
    const char *q = "--b0und\r\nContent-Disposition: form-data; name=\"file\"; filename=\"f"
                    "\r\n\r\nx\r\n--b0und--";
    CHECK(parse_all(CT, q, strlen(q), p, n, 4) < 0);
    /* Huge headers: over the bound, rejected without scanning the whole body. */
    size_t big = 64 * 1024;
    char *hb = malloc(big + 200);
    size_t k = (size_t)sprintf(hb, "--b0und\r\nX-Pad: ");
    memset(hb + k, 'a', big);
    k += big;
    k += (size_t)sprintf(hb + k, "\r\n\r\nx\r\n--b0und--");
    CHECK(parse_all(CT, hb, k, p, n, 4) < 0);
    free(hb);
    /* A filename longer than the bound. */
    size_t ln = 10000;
    char *lf = malloc(ln + 200);
    k = (size_t)sprintf(lf, "--b0und\r\nContent-Disposition: form-data; name=file; filename=\"");
    memset(lf + k, 'n', ln);
    k += ln;
    k += (size_t)sprintf(lf + k, "\"\r\n\r\nx\r\n--b0und--");
    CHECK(parse_all(CT, lf, k, p, n, 4) < 0);
    free(lf);
    /* A part with no headers is allowed (name ""). */
    const char *nh = "--b0und\r\n\r\nraw\r\n--b0und--";
    CHECK(parse_all(CT, nh, strlen(nh), p, n, 4) == 1 && p[0].name[0] == '\0');
    /* Empty body after a valid close. */
    CHECK(parse_all(CT, "--b0und--", 9, p, n, 4) == 0);
    parse_all(NULL, NULL, 0, p, n, 4); /* frees the kept parser */
}

int main(void)
{
    test_multipart_one_part();
    test_multipart_several_parts_and_preamble();
    test_multipart_quoted_filenames();
    test_multipart_binary_content();
    test_multipart_truncated_and_hostile();
    return check_report("multipart");
}
