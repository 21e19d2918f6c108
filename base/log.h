/*
 * log.h - one line per event on stderr: time, level, module, key=value fields.
 *
 * The macro tests the level before evaluating its arguments. Never log keys,
 * tokens or sandbox env values.
 */
#ifndef SP_LOG_H
#define SP_LOG_H

typedef enum {
    SP_LOG_DEBUG = 0,
    SP_LOG_INFO,
    SP_LOG_WARN,
    SP_LOG_ERROR,
} sp_log_level_t;

extern sp_log_level_t sp_log_min_level;

/* Parses "debug|info|warn|error"; returns -1 on anything else. */
int sp_log_parse_level(const char *s, sp_log_level_t *out);

void sp_log_write(sp_log_level_t level, const char *module, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

#define sp_log(level, module, ...)                                                                 \
    do {                                                                                           \
        if ((level) >= sp_log_min_level)                                                           \
            sp_log_write((level), (module), __VA_ARGS__);                                          \
    } while (0)

#endif
