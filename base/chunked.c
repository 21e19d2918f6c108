/*
 * chunked.c - the chunked transfer coding, decoded incrementally (chunked.h).
 */
#include "base/chunked.h"

#include "base/text.h"

enum {
    CK_SIZE = 0, /* hex digits of a chunk size */
    CK_EXT,      /* a chunk extension, up to the line's end */
    CK_SIZE_LF,  /* after the size line's CR */
    CK_DATA,     /* left bytes of data */
    CK_DATA_CR,  /* the CRLF after the data */
    CK_DATA_LF,
    CK_TRAILER,      /* at the start of a trailer line (or of the final empty line) */
    CK_TRAILER_LINE, /* inside a trailer line */
    CK_END_LF,       /* after the final empty line's CR */
    CK_DONE,
};

int sp_chunked_step(sp_chunked_t *d, const uint8_t *in, size_t n, size_t max, size_t *used,
                    const uint8_t **data, size_t *dlen)
{
    size_t i = 0;
    *data = NULL;
    *dlen = 0;
    while (i < n && d->state != CK_DONE) {
        uint8_t c = in[i];
        switch (d->state) {
        case CK_SIZE: {
            int v = sp_text_hexval(c);
            if (v >= 0) {
                if (d->digits == 15) /* 2^60 bytes and more: not a size we can mean */
                    return -1;
                d->left = d->left * 16 + (uint64_t)v;
                d->digits++;
                i++;
                break;
            }
            if (d->digits == 0)
                return -1;
            if (c == ';' || c == ' ' || c == '\t')
                d->state = CK_EXT;
            else if (c == '\r')
                d->state = CK_SIZE_LF;
            else if (c == '\n')
                d->state = d->left ? CK_DATA : CK_TRAILER;
            else
                return -1;
            i++;
            break;
        }
        case CK_EXT:
            if (c == '\r')
                d->state = CK_SIZE_LF;
            else if (c == '\n')
                d->state = d->left ? CK_DATA : CK_TRAILER;
            i++;
            break;
        case CK_SIZE_LF:
            if (c != '\n')
                return -1;
            d->state = d->left ? CK_DATA : CK_TRAILER;
            i++;
            break;
        case CK_DATA: {
            size_t take = n - i;
            if (take > d->left)
                take = (size_t)d->left;
            if (take > max)
                take = max;
            if (take == 0)
                goto out; /* no room given */
            *data = in + i;
            *dlen = take;
            d->left -= take;
            i += take;
            if (d->left == 0) {
                d->state = CK_DATA_CR;
                d->digits = 0;
            }
            goto out;
        }
        case CK_DATA_CR:
            if (c == '\r')
                d->state = CK_DATA_LF;
            else if (c == '\n')
                d->state = CK_SIZE;
            else
                return -1;
            i++;
            break;
        case CK_DATA_LF:
            if (c != '\n')
                return -1;
            d->state = CK_SIZE;
            i++;
            break;
        case CK_TRAILER:
            d->state = c == '\r' ? CK_END_LF : c == '\n' ? CK_DONE : CK_TRAILER_LINE;
            i++;
            break;
        case CK_TRAILER_LINE:
            if (c == '\n')
                d->state = CK_TRAILER;
            i++;
            break;
        case CK_END_LF:
            if (c != '\n')
                return -1;
            d->state = CK_DONE;
            i++;
            break;
        }
    }
out:
    *used = i;
    return d->state == CK_DONE ? 1 : 0;
}
