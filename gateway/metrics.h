/* kvbank-gateway — Prometheus text exposition (format 0.0.4): histograms and helpers.
 *
 * Names follow Prometheus conventions: a `kvbank_` prefix, base units in the name (`_seconds`),
 * counters end in `_total`. Each family is written once with its HELP and TYPE lines, its samples
 * labelled by model. vLLM's names (`vllm:...`, labelled `model_name`) are exported beside them for the
 * dashboards and routers written for vLLM (docs/gateway.md, "Metrics"). */
#ifndef KVB_GATEWAY_METRICS_H
#define KVB_GATEWAY_METRICS_H

#include <stddef.h>
#include <stdint.h>

#include "common/util/util.h"

#define GW_HIST_MAX_BUCKETS 24

/* Bucket upper bounds (seconds) of one kind of histogram. */
typedef struct gw_hist_spec {
    const double *le;  /* [n] increasing */
    int n;
} gw_hist_spec;

extern const gw_hist_spec GW_HIST_TTFT;    /* time to first token */
extern const gw_hist_spec GW_HIST_TOKEN;   /* time per output token, inter-token latency */
extern const gw_hist_spec GW_HIST_REQUEST; /* end-to-end request latency */
extern const gw_hist_spec GW_HIST_COUNT;   /* token counts per request: 1, 2, 5, 10, ... 10^6 (vLLM's 1-2-5) */

typedef struct gw_hist {
    const gw_hist_spec *spec;
    uint64_t count[GW_HIST_MAX_BUCKETS + 1]; /* per bucket (not cumulative); the last is +Inf */
    uint64_t n;
    double sum;
} gw_hist;

void gw_hist_init(gw_hist *h, const gw_hist_spec *spec);
void gw_hist_observe(gw_hist *h, double x);

/* A text buffer the exposition is written into (grows; `failed` once an allocation failed). */
typedef struct gw_text {
    char *s;
    size_t len, cap;
    int failed;
} gw_text;

void gw_text_printf(gw_text *t, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
/* "# HELP name help\n# TYPE name type\n" */
void gw_metric_head(gw_text *t, const char *name, const char *type, const char *help);
/* One sample: name{labels} value. `labels` is "" or `key="value",...` (already escaped). */
void gw_metric_sample(gw_text *t, const char *name, const char *labels, double value);
/* The _bucket / _sum / _count samples of `h` under `name`. */
void gw_metric_hist(gw_text *t, const char *name, const char *labels, const gw_hist *h);
/* Escapes a label value (\\, \", \n) into out[out_len]. */
void gw_label_escape(const char *v, char *out, size_t out_len);

#endif
