/* kvbank-gateway — Prometheus text exposition helpers (see metrics.h). */
#include "gateway/metrics.h"

#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* vLLM's buckets, with finer ones below 10 ms (a CPU node's small models are fast per token). */
static const double LE_TTFT[] = {0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5,
                                 0.75,  1.0,   2.5,  5.0,  7.5,  10.0, 20.0, 40.0, 80.0};
static const double LE_TOKEN[] = {0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15,
                                  0.2,   0.3,    0.4,   0.5,  0.75,  1.0,  2.5,   5.0, 10.0};
static const double LE_REQUEST[] = {0.01, 0.05, 0.1, 0.3, 0.5, 1.0, 2.5, 5.0, 10.0, 15.0, 20.0,
                                    30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0};
/* vLLM's build_1_2_5_buckets, to a million tokens (its bound is the model's context) */
static const double LE_COUNT[] = {1,    2,    5,     10,    20,    50,     100,    200,    500,    1000,
                                  2000, 5000, 10000, 20000, 50000, 100000, 200000, 500000, 1000000};
const gw_hist_spec GW_HIST_COUNT = {LE_COUNT, (int)KVB_ARRAY_LEN(LE_COUNT)};
const gw_hist_spec GW_HIST_TTFT = {LE_TTFT, (int)KVB_ARRAY_LEN(LE_TTFT)};
const gw_hist_spec GW_HIST_TOKEN = {LE_TOKEN, (int)KVB_ARRAY_LEN(LE_TOKEN)};
const gw_hist_spec GW_HIST_REQUEST = {LE_REQUEST, (int)KVB_ARRAY_LEN(LE_REQUEST)};

void gw_hist_init(gw_hist *h, const gw_hist_spec *spec) {
    memset(h, 0, sizeof *h);
    h->spec = spec;
}

void gw_hist_observe(gw_hist *h, double x) {
    if (!isfinite(x)) return;
    if (x < 0) x = 0;
    int i = 0;
    while (i < h->spec->n && x > h->spec->le[i]) i++;
    h->count[i]++;
    h->n++;
    h->sum += x;
}

void gw_text_printf(gw_text *t, const char *fmt, ...) {
    if (t->failed) return;
    for (;;) {
        va_list ap;
        va_start(ap, fmt);
        size_t room = t->cap - t->len;
        int n = vsnprintf(t->s ? t->s + t->len : NULL, t->s ? room : 0, fmt, ap);
        va_end(ap);
        if (n < 0) {
            t->failed = 1;
            return;
        }
        if (t->s && (size_t)n < room) {
            t->len += (size_t)n;
            return;
        }
        size_t c = t->cap ? t->cap : 4096;
        while (c < t->len + (size_t)n + 1) c *= 2;
        char *s = realloc(t->s, c);
        if (!s) {
            t->failed = 1;
            return;
        }
        t->s = s;
        t->cap = c;
    }
}

void gw_metric_head(gw_text *t, const char *name, const char *type, const char *help) {
    gw_text_printf(t, "# HELP %s %s\n# TYPE %s %s\n", name, help, name, type);
}

/* Prometheus' float syntax: integers as such, +Inf / NaN spelled out. */
static void fmt_value(double v, char *buf, size_t n) {
    if (isnan(v)) snprintf(buf, n, "NaN");
    else if (isinf(v)) snprintf(buf, n, v > 0 ? "+Inf" : "-Inf");
    else if (v == floor(v) && fabs(v) < 1e15) snprintf(buf, n, "%.0f", v);
    else snprintf(buf, n, "%.9g", v);
}

void gw_metric_sample(gw_text *t, const char *name, const char *labels, double value) {
    char v[64];
    fmt_value(value, v, sizeof v);
    if (labels && *labels) gw_text_printf(t, "%s{%s} %s\n", name, labels, v);
    else gw_text_printf(t, "%s %s\n", name, v);
}

void gw_metric_hist(gw_text *t, const char *name, const char *labels, const gw_hist *h) {
    const char *sep = labels && *labels ? "," : "";
    uint64_t cum = 0;
    char le[64];
    for (int i = 0; i <= h->spec->n; i++) {
        cum += h->count[i];
        if (i < h->spec->n) fmt_value(h->spec->le[i], le, sizeof le);
        else snprintf(le, sizeof le, "+Inf");
        gw_text_printf(t, "%s_bucket{%s%sle=\"%s\"} %llu\n", name, labels ? labels : "", sep, le, (unsigned long long)cum);
    }
    char base[200];
    snprintf(base, sizeof base, "%s_sum", name);
    gw_metric_sample(t, base, labels, h->sum);
    snprintf(base, sizeof base, "%s_count", name);
    gw_metric_sample(t, base, labels, (double)h->n);
}

void gw_label_escape(const char *v, char *out, size_t out_len) {
    size_t k = 0;
    for (; *v && k + 3 < out_len; v++) {
        if (*v == '\\' || *v == '"') {
            out[k++] = '\\';
            out[k++] = *v;
        } else if (*v == '\n') {
            out[k++] = '\\';
            out[k++] = 'n';
        } else {
            out[k++] = *v;
        }
    }
    out[k] = '\0';
}
