/* kvbank — leveled, structured logging to stderr.
 * Lines look like `2026-11-21T02:14:02.123Z warn  [server] message`. The level comes from
 * KVB_LOG_LEVEL (error|warn|info|debug) or kvb_log_set_level(); the default is info. */
#ifndef KVB_UTIL_LOG_H
#define KVB_UTIL_LOG_H

#include <stddef.h>

#include "common/util/status.h"

typedef enum kvb_log_level {
    KVB_LOG_ERROR = 0,
    KVB_LOG_WARN = 1,
    KVB_LOG_INFO = 2,
    KVB_LOG_DEBUG = 3,
} kvb_log_level;

void kvb_log_set_level(kvb_log_level level);
kvb_log_level kvb_log_get_level(void);
/* Sets the tag printed in every line of this process (a model name, "coordinator"). Copied. */
void kvb_log_set_tag(const char *tag);
/* Takes the level from KVB_LOG_LEVEL now; KVB_ERR_INVALID with a message in `why` naming the levels
 * when it is set to something else (kvb_prog_init makes that a usage error). */
kvb_status kvb_log_level_from_env(char *why, size_t len);

/* Repeated lines: each call site (format string) prints at most `burst` lines per `window_ms`; the
 * rest are counted and reported in one line when the site's next window starts (default 20 per 10 s;
 * burst 0: no limit). */
void kvb_log_set_rate(unsigned burst, unsigned window_ms);

void kvb_log(kvb_log_level level, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

#define KVB_LOG_E(...) kvb_log(KVB_LOG_ERROR, __VA_ARGS__)
#define KVB_LOG_W(...) kvb_log(KVB_LOG_WARN, __VA_ARGS__)
#define KVB_LOG_I(...) kvb_log(KVB_LOG_INFO, __VA_ARGS__)
#define KVB_LOG_D(...)                                                                                 \
    do {                                                                                               \
        if (kvb_log_get_level() >= KVB_LOG_DEBUG) kvb_log(KVB_LOG_DEBUG, __VA_ARGS__);                 \
    } while (0)

#endif
