/*
 * embedded.h - the builder scripts and template specs compiled into the
 * binary (generated from guest/scripts/ and templates/ by embed.cmake).
 *
 * Names are relative: "scripts/kernel.sh", "templates/base/template.json".
 * Data is NUL-terminated one byte past size.
 */
#ifndef SP_GUEST_EMBEDDED_H
#define SP_GUEST_EMBEDDED_H

typedef struct {
    const char *name;
    const unsigned char *data;
    unsigned long size;
    unsigned mode;
} sp_guest_file_t;

extern const sp_guest_file_t sp_guest_files[];
extern const unsigned sp_guest_nfiles;

#endif
