/*
 * table.c - aligned columns and name/value lists (table.h).
 */
#include "cli/table.h"

#include <stdbool.h>
#include <stdlib.h>
#include <string.h>

struct spc_table {
    size_t ncols, nrows, cap;
    char **cells; /* (nrows + 1) * ncols: the header row first */
};

char *spc_table_cell(const char *s)
{
    if (s == NULL || s[0] == '\0')
        s = "-";
    char *d = strdup(s);
    if (d == NULL)
        return NULL;
    for (unsigned char *p = (unsigned char *)d; *p; p++)
        if (*p < 0x20 || *p == 0x7f)
            *p = '?';
    return d;
}

size_t spc_table_width(const char *s)
{
    size_t w = 0;
    for (const unsigned char *p = (const unsigned char *)s; *p; p++)
        if ((*p & 0xC0) != 0x80) /* not a continuation byte */
            w++;
    return w;
}

static int add_row(spc_table_t *t, const char *const *cells)
{
    if (t->nrows == t->cap) {
        size_t cap = t->cap ? t->cap * 2 : 8;
        char **nc = realloc(t->cells, sizeof(char *) * cap * t->ncols);
        if (nc == NULL)
            return -1;
        t->cells = nc;
        t->cap = cap;
    }
    char **row = t->cells + t->nrows * t->ncols;
    for (size_t i = 0; i < t->ncols; i++) {
        row[i] = spc_table_cell(cells[i]);
        if (row[i] == NULL) {
            while (i-- > 0)
                free(row[i]);
            return -1;
        }
    }
    t->nrows++;
    return 0;
}

spc_table_t *spc_table_new(size_t ncols, const char *const *headers)
{
    spc_table_t *t = calloc(1, sizeof(*t));
    if (t == NULL)
        return NULL;
    t->ncols = ncols;
    if (add_row(t, headers) < 0) {
        spc_table_free(t);
        return NULL;
    }
    return t;
}

int spc_table_add(spc_table_t *t, const char *const *cells)
{
    return add_row(t, cells);
}

void spc_table_free(spc_table_t *t)
{
    if (t == NULL)
        return;
    for (size_t i = 0; i < t->nrows * t->ncols; i++)
        free(t->cells[i]);
    free(t->cells);
    free(t);
}

void spc_table_print(const spc_table_t *t, FILE *f)
{
    size_t *w = calloc(t->ncols, sizeof(size_t));
    if (w == NULL)
        return;
    for (size_t r = 0; r < t->nrows; r++)
        for (size_t c = 0; c < t->ncols; c++) {
            size_t n = spc_table_width(t->cells[r * t->ncols + c]);
            if (n > w[c])
                w[c] = n;
        }
    for (size_t r = 0; r < t->nrows; r++) {
        for (size_t c = 0; c < t->ncols; c++) {
            const char *s = t->cells[r * t->ncols + c];
            fputs(s, f);
            if (c + 1 < t->ncols)
                fprintf(f, "%*s", (int)(w[c] - spc_table_width(s) + 3), "");
        }
        fputc('\n', f);
    }
    free(w);
}

void spc_kv_print(FILE *f, size_t n, const char *const *names, const char *const *values)
{
    size_t w = 0;
    for (size_t i = 0; i < n; i++)
        if (spc_table_width(names[i]) > w)
            w = spc_table_width(names[i]);
    for (size_t i = 0; i < n; i++) {
        char *v = spc_table_cell(values[i]);
        fprintf(f, "%s:%*s%s\n", names[i], (int)(w - spc_table_width(names[i]) + 2), "",
                v ? v : "-");
        free(v);
    }
}
