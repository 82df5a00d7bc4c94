/* kvbank — the link model's arithmetic: target machines (a GPU, its links and the model it serves), the
 * roofline of that model's step, and the time scale that makes a CPU run show the target's transfer /
 * compute regime. Pure functions of their arguments (no clock, no backend); the stager (stager.h)
 * charges the delays, link_calib.c measures the bench model's step.
 *
 * A transfer (one post: any number of pieces) on link k takes at least
 *     latency_s[k] + bytes / bytes_per_s[k].
 * A preset names a target: GPU, links and model shape (e.g. an H100 over PCIe 5 serving Llama-3-8B in
 * bf16); "NAME" charges the target's own figures, "NAME-scaled" rescales them for this machine at an
 * operating point P (a step of `batch` requests, each computing `q` new tokens over `ctx` cached ones):
 *     scale    = (this model's measured step at P / its layers) / (the target model's roofline step at
 *                P / its layers)                                   time here per unit of target time
 *     kv_ratio = one layer's KV of P's batch here / the target's    (bytes here per target byte)
 *     latency here   = latency x scale
 *     bandwidth here = bandwidth x kv_ratio / scale
 * so that at P one layer's transfer / one layer's compute (the *regime*) is the target's. Scaling by
 * the machines' FLOP rates alone ignores that the models differ in size: a transfer would cost several
 * whole steps. */
#ifndef KVB_SCHED_LINK_MODEL_H
#define KVB_SCHED_LINK_MODEL_H

#include <stdio.h>

#include "common/sched/plan.h"

typedef struct kvb_link {
    double bytes_per_s; /* 0: unlimited */
    double latency_s;   /* per transfer (post) */
} kvb_link;

/* A target model's shape: what its roofline needs. */
typedef struct kvb_target_model {
    const char *name;       /* "Llama-3-8B bf16" */
    int n_layers, hidden, n_heads, n_kv_heads, head_dim, intermediate, vocab;
    int elem_bytes;         /* of weights and KV */
} kvb_target_model;

/* A target GPU: the two ceilings of its roofline. */
typedef struct kvb_target_gpu {
    const char *name;
    double peak_flops;      /* dense bf16 tensor rate, FLOP/s */
    double mem_bytes_per_s; /* HBM (GDDR) bandwidth */
} kvb_target_gpu;

/* The operating point of a time scale: one step of `batch` requests, each computing `q` new tokens
 * over `ctx` tokens already in its KV (q = 1: a decode step). */
typedef struct kvb_link_point {
    int batch;
    int q;
    double ctx;             /* cached tokens per request, on this machine */
    double target_ctx;      /* the same requests on the target (ctx / the bench's length scale); 0: ctx */
    double target_q;        /* new tokens per request on the target; 0: q */
} kvb_link_point;

typedef struct kvb_link_model {
    char name[48];                 /* the preset's name ("off" when zeroed) */
    char target[160];              /* the machine it models, in words */
    kvb_link links[KVB_LINK_COUNT];
    double target_flops;           /* the target's compute rate (FLOP/s), 0 for "off" */
    double measured_flops;         /* this machine's matmul rate when measured (planners' cost models), else 0 */
    double scale;                  /* time here per unit of target time: 1 unscaled, else as above */
    int share;                     /* 0: a link's transfers run one after the other in post order; 1: the
                                    * transfers in flight on a link share its bandwidth equally, each
                                    * direction apart (to and from the device: full duplex), a transfer
                                    * moving data from post + latency on (processor sharing: OrbitFlow
                                    * §3.3.1's rule, and how DMA engines share a PCIe link) */
    /* the target and, for a scaled preset, its calibration */
    int calibrate;                 /* 1: a scaled preset whose time scale is still to be measured
                                    * (kvb_link_calibrate; kvb_engine_create does it when a caller did not) */
    char model[48];                /* the target model */
    kvb_target_model tm;           /* its shape (tm.name points into a static table) */
    kvb_target_gpu gpu;
    kvb_link target_links[KVB_LINK_COUNT]; /* the target's own figures */
    kvb_link_point point;          /* where the scale was measured */
    double target_step_s;          /* the target model's roofline step at the point */
    double measured_step_s;        /* this model's measured step there */
    int target_layers, bench_layers;
    double target_layer_bytes;     /* one layer's KV of the point's batch on the target */
    double bench_layer_bytes;      /* and here */
    double kv_ratio;               /* bench_layer_bytes / target_layer_bytes */
} kvb_link_model;

/* The preset `name` (kvb_link_preset_list prints them): "off", or a target as given, or "NAME-scaled"
 * (calibrate = 1, the target's figures until kvb_link_scale). KVB_ERR_NOT_FOUND (logged with the names)
 * for an unknown name. */
kvb_status kvb_link_preset_find(const char *name, kvb_link_model *out);
void kvb_link_preset_list(FILE *f);

/* Bytes of KV per token and layer of a target model, its weights a step reads, and the FLOPs and bytes
 * of a step at `p` (on the target's side of the point). */
double kvb_target_kv_bytes(const kvb_target_model *m);
double kvb_target_weight_bytes(const kvb_target_model *m);
double kvb_target_step_flops(const kvb_target_model *m, int batch, double q, double ctx);
double kvb_target_step_bytes(const kvb_target_model *m, int batch, double q, double ctx);
/* The roofline: max(FLOPs / peak, bytes / memory bandwidth), seconds. */
double kvb_target_step_s(const kvb_target_gpu *g, const kvb_target_model *m, int batch, double q, double ctx);

/* Applies the time scale to `m` (a preset from kvb_link_preset_find): this model has `bench_layers`
 * layers and `bench_kv_bytes` of KV per token and layer, and its step at `p` measured `measured_step_s`.
 * Clears calibrate. KVB_ERR_INVALID for a point or measurement that is not positive, or an "off" model. */
kvb_status kvb_link_scale(kvb_link_model *m, const kvb_link_point *p, double measured_step_s, int bench_layers,
                          double bench_kv_bytes);

/* The regime at the calibration point on `link`: one layer's KV of the point's batch over the link
 * (latency included) / one layer's compute. `here`: with this machine's links and measured step (after
 * kvb_link_scale); else the target's figures and roofline. 0 when the model is off or not calibrated. */
double kvb_link_regime(const kvb_link_model *m, kvb_link_kind link, int here);
/* 1 when `ratio` is more than 2x away from `paper` (either side); 0 when within or paper <= 0. */
int kvb_link_regime_far(double ratio, double paper);
/* "regime (one layer's KV over the host link / one layer's compute, batch B x q over C tokens): X here,
 * Y on the target[; the paper: Z (WHAT)][ -- more than 2x away]" on one line (nothing when off). */
void kvb_link_regime_print(FILE *f, const kvb_link_model *m, kvb_link_kind link, double paper, const char *paper_what);

/* The line every benchmark prints: "link preset: NAME (target ...; host X GB/s + Y us, ...)". */
void kvb_link_model_print(FILE *f, const kvb_link_model *m);
/* Seconds the model charges for one transfer of `bytes` on `link` (0 when off): what planners that
 * predict stalls (OrbitFlow's latency model, eLLM's swap cost) should use. */
double kvb_link_seconds(const kvb_link_model *m, kvb_link_kind link, size_t bytes);

#endif
