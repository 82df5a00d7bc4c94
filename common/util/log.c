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

static void level_from_env(void) {
    if (g_level_from_env) return;
    g_level_from_env = 1;
    const char *s = getenv("KVB_LOG_LEVEL");
    if (!s) return;
    if (!strcasecmp(s, "error")) g_level = KVB_LOG_ERROR;
    else if (!strcasecmp(s, "warn")) g_level = KVB_LOG_WARN;
    else if (!strcasecmp(s, "info")) g_level = KVB_LOG_INFO;
    else if (!strcasecmp(s, "debug")) g_level = KVB_LOG_DEBUG;
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
