/* kvbank-bench — what every paper bench shares: the backend it runs on (--backend, --device) and the
 * run's link model (--link), calibrated once per run on the bench's model (common/sched/link_calib.h)
 * so that every arm of the run is charged the same links. */
#ifndef KVB_BENCH_LINK_H
#define KVB_BENCH_LINK_H

#include "common/model/model.h"
#include "common/sched/link_model.h"

typedef struct kvb_bench_dev {
    const char *backend; /* "cpu", "cuda", "cuda:f32", ... (kvb_backend_create_on) */
    int device;          /* GPU index; -1: the current one */
    int threads;         /* CPU threads */
} kvb_bench_dev;

#define KVB_BENCH_DEV_DEFAULT ((kvb_bench_dev){.backend = "cpu", .device = -1, .threads = 2})
#define KVB_BENCH_DEV_USAGE                                                                                      \
    "  --backend NAME      cpu (default), cuda, cuda:f32 (f32 activations and KV: tokens as the CPU's)\n"        \
    "  --device N          the GPU of a device backend (default: the current one)\n"

/* Handles --backend (`opt` 'B') and --device ('D'); 1 when `opt` was one of them (bad values: 2 and a
 * message naming `prog`), 0 otherwise. */
int kvb_bench_dev_opt(kvb_bench_dev *d, int opt, const char *arg, const char *prog);
/* 1 for a device backend (its copies are real: the link model defaults to off). */
int kvb_bench_dev_is_gpu(const kvb_bench_dev *d);
kvb_status kvb_bench_backend(const kvb_bench_dev *d, kvb_backend **out);

/* The run's link model: `preset` (NULL: `cpu_default` on the CPU, "off" on a device backend), a scaled
 * one calibrated on `m` at `pt`; prints "  link preset: ..." (the line kvb_link_model_print writes). */
kvb_status kvb_bench_links(kvb_model *m, const kvb_bench_dev *d, const char *preset, const char *cpu_default,
                           const kvb_link_point *pt, kvb_link_model *out);

#endif
