#include "common/util/log.h"

#include <pthread.h>
#include <stdarg.h>
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

void kvb_log(kvb_log_level level, const char *fmt, ...) {
    static const char *names[] = {"error", "warn ", "info ", "debug"};
    if (level > kvb_log_get_level()) return;
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    struct tm tm;
    gmtime_r(&ts.tv_sec, &tm);
    char msg[1024];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    pthread_mutex_lock(&g_lock);
    fprintf(stderr, "%04d-%02d-%02dT%02d:%02d:%02d.%03ldZ %s [%s] %s\n", tm.tm_year + 1900, tm.tm_mon + 1,
            tm.tm_mday, tm.tm_hour, tm.tm_min, tm.tm_sec, ts.tv_nsec / 1000000, names[level], g_tag, msg);
    pthread_mutex_unlock(&g_lock);
}
