/*
 * table.h - spacectl's human output: aligned columns under a header, and "name: value" lists.
 *
 * Cells are copied. Widths count characters (UTF-8 sequences as one), not bytes; control
 * characters in a cell are shown as '?' so nothing a sandbox's metadata holds can move a
 * terminal's cursor; an empty or NULL cell shows as "-". The last column is not padded.
 * Scripts use --json instead: these layouts may change.
 */
#ifndef SPC_TABLE_H
#define SPC_TABLE_H

#include <stddef.h>
#include <stdio.h>

typedef struct spc_table spc_table_t;

/* A table with ncols columns named by headers (copied). NULL when out of memory. */
spc_table_t *spc_table_new(size_t ncols, const char *const *headers);
/* Adds a row of ncols cells (copied). -1 when out of memory. */
int spc_table_add(spc_table_t *t, const char *const *cells);
/* Header and rows, columns three spaces apart. */
void spc_table_print(const spc_table_t *t, FILE *f);
void spc_table_free(spc_table_t *t);

/* n pairs (names[i], values[i]) as "name:  value" lines, the values aligned. */
void spc_kv_print(FILE *f, size_t n, const char *const *names, const char *const *values);

/* s as a cell shows it (control characters as '?', "-" for nothing), malloc'd; NULL when out
 * of memory. */
char *spc_table_cell(const char *s);

/* The width of s as spc_table_print counts it. */
size_t spc_table_width(const char *s);

#endif
