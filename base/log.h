/*
 * log.h - one line per event on stderr: time, level, module, key=value fields; as text
 * (the default) or as one JSON object per line (sp_log_format = SP_LOG_JSON) with the keys
 * ts (RFC 3339, UTC, milliseconds), level, component, msg (the whole message) and then each
 * key=value field of the message under its key (value "quoted" or up to the next space; a
 * field named like one of the four keys, or seen twice, is left in msg only).
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

typedef enum {
    SP_LOG_TEXT = 0,
    SP_LOG_JSON,
} sp_log_format_t;

extern sp_log_format_t sp_log_format;

/* Parses "text|json"; returns -1 on anything else. */
int sp_log_parse_format(const char *s, sp_log_format_t *out);

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
