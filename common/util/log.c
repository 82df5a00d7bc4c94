#include "common/util/log.h"

#include <pthread.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <time.h>

static kvb_log_level g_level = KVB_LOG_INFO;
static int g_level_from_env = 0;
static char g_tag[64] = "kvbank";
static pthread_mutex_t g_lock = PTHREAD_MUTEX_INITIALIZER;

static const char *const g_level_names[] = {"error", "warn", "info", "debug"};

/* Repeated lines: each call site (its format string) may print g_burst lines per g_window_ns; what it
 * prints beyond is counted and summed up in one line when its next window starts. A client that
 * repeats one thing a million times (resets, bad messages) then costs the log a few lines a second. */
#define LOG_SITES 256
typedef struct log_site {
    const char *fmt;           /* the call site; NULL: free */
    uint64_t window_ns;        /* start of its current window (CLOCK_MONOTONIC) */
    uint32_t n;                /* lines in the window */
    uint64_t suppressed;       /* lines not printed in the window */
} log_site;
static log_site g_sites[LOG_SITES];
static uint32_t g_burst = 20;
static uint64_t g_window_ns = 10000000000ull;

/* KVB_LOG_LEVEL's level; -1 when unset, -2 when it names no level. */
static int env_level(void) {
    const char *s = getenv("KVB_LOG_LEVEL");
    if (!s) return -1;
    for (int l = 0; l < 4; l++)
        if (!strcasecmp(s, g_level_names[l])) return l;
    return -2;
}

static void level_from_env(void) {
    if (g_level_from_env) return;
    g_level_from_env = 1;
    int l = env_level();
    if (l >= 0) g_level = (kvb_log_level)l; /* an invalid value is the program's to refuse (kvb_log_level_from_env) */
}

kvb_status kvb_log_level_from_env(char *why, size_t len) {
    int l = env_level();
    if (l == -2) {
        snprintf(why, len, "KVB_LOG_LEVEL=\"%s\" is not a log level (error, warn, info, debug)", getenv("KVB_LOG_LEVEL"));
        return KVB_ERR_INVALID;
    }
    level_from_env();
    return KVB_OK;
}

void kvb_log_set_level(kvb_log_level level) {
    g_level_from_env = 1;
    g_level = level;
}

kvb_log_level kvb_log_get_level(void) {
    level_from_env();
    return g_level;
}

void kvb_log_set_tag(const char *tag) {
    pthread_mutex_lock(&g_lock);
    snprintf(g_tag, sizeof g_tag, "%s", tag ? tag : "kvbank");
    pthread_mutex_unlock(&g_lock);
}

void kvb_log_set_rate(unsigned burst, unsigned window_ms) {
    pthread_mutex_lock(&g_lock);
    g_burst = burst;
    g_window_ns = (uint64_t)window_ms * 1000000u;
    memset(g_sites, 0, sizeof g_sites);
    pthread_mutex_unlock(&g_lock);
}

/* The site of `fmt` (made when new; NULL when the table is full: such a site is not limited). Under
 * g_lock. */
static log_site *site_of(const char *fmt) {
    size_t h = ((uintptr_t)fmt >> 3) * 0x9e3779b97f4a7c15ull >> 56; /* 8 bits: LOG_SITES */
    for (size_t k = 0; k < LOG_SITES; k++) {
        log_site *s = &g_sites[(h + k) % LOG_SITES];
        if (s->fmt == fmt) return s;
        if (!s->fmt) {
            s->fmt = fmt;
            return s;
        }
    }
    return NULL;
}

static void emit(kvb_log_level level, const struct timespec *ts, const char *msg) {
    static const char *names[] = {"error", "warn ", "info ", "debug"};
    struct tm tm;
    gmtime_r(&ts->tv_sec, &tm);
    fprintf(stderr, "%04d-%02d-%02dT%02d:%02d:%02d.%03ldZ %s [%s] %s\n", tm.tm_year + 1900, tm.tm_mon + 1,
            tm.tm_mday, tm.tm_hour, tm.tm_min, tm.tm_sec, ts->tv_nsec / 1000000, names[level], g_tag, msg);
}

void kvb_log(kvb_log_level level, const char *fmt, ...) {
    if (level > kvb_log_get_level()) return;
    struct timespec ts, mono;
    clock_gettime(CLOCK_REALTIME, &ts);
    clock_gettime(CLOCK_MONOTONIC, &mono);
    uint64_t now = (uint64_t)mono.tv_sec * 1000000000u + (uint64_t)mono.tv_nsec;
    char msg[1024];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    pthread_mutex_lock(&g_lock);
    log_site *s = g_burst ? site_of(fmt) : NULL;
    if (s && (s->n == 0 || now - s->window_ns >= g_window_ns)) {
        if (s->suppressed) {
            char sum[1200];
            snprintf(sum, sizeof sum, "(%llu more lines like \"%.900s\" were not logged in %.1f s)",
                     (unsigned long long)s->suppressed, fmt, (double)(now - s->window_ns) / 1e9);
            emit(level, &ts, sum);
        }
        s->window_ns = now;
        s->n = 0;
        s->suppressed = 0;
    }
    if (s && s->n >= g_burst) {
        s->suppressed++;
    } else {
        if (s) s->n++;
        emit(level, &ts, msg);
    }
    pthread_mutex_unlock(&g_lock);
}
