/* kvbank — eLLM adaptive KV caching, the pure core (../shared/papers/ellm-adaptive-kv-caching.txt
 * §3-4): the corrected cost model (§4.2.1 Eq. 2-4), the request-level optimizer (§4.1-4.2, Eq. 1 and
 * 5) and the layer-level optimizer (§4.3, Eq. 6-9). Names carry `etw` (eLLM token-wise). No engine
 * state: the planner (ellm_tw.c) feeds these functions the batch it sees and applies what they return.
 *
 * Where kvbank departs from the paper (each also in docs/papers/ellm-adaptive-kv-caching.md):
 *  - FLOPs and KV bytes come from the model's config: Q/O projections 2·h·q_dim each, K/V projections
 *    2·h·kv_dim each (GQA), SwiGLU 3·2·h·I, KV bytes 2·kv_dim·elem per token and layer. The paper's
 *    24h² and 4h assume MHA, a 4h two-matrix MLP and fp16.
 *  - Logits cost 2·h·V per request per step; recomputed tokens need none (the paper charges 2hV·s_i
 *    per decode and 2hV·s_i·r per recompute, ~200x too much at long contexts).
 *  - Recompute attention is causal: 2·q_dim·u(u+1) FLOPs per layer for u tokens, not 4hu².
 *  - A step costs a b-independent t_fixed + bytes/bandwidth (weights, and the KV every decode reads)
 *    on top of FLOPs/FLOPS (without it Eq. 5 is minimised at b = 1, r = 0). The four coefficients are
 *    calibrated per backend and re-fitted online from measured steps (kvb_etw_fit_*).
 *  - Memory counts whole blocks (resident tokens of each request, the new token included), the scratch
 *    units of the recompute/load pipeline (units of F layers, ellm_tw_map.h) and, where they come out
 *    of the same budget, the activations of the recomputed rows; M_o uses Σu_i (the tokens actually
 *    absent) instead of b·max(s_i)·r.
 *  - Swapped prefix layers sit above the highest recomputed one (a swapped layer below it would still
 *    need the prefix's hidden state to pass through it, saving only its K/V projections): (l1, l2)
 *    gives the share of swapped layers l1/(l1+l2) and the pipeline depths, not an interleaving. */
#ifndef KVB_POLICY_ELLM_TW_H
#define KVB_POLICY_ELLM_TW_H

#include <stdint.h>

#include "common/model/config.h"
#include "common/util/util.h"

/* ---------------------------------------------------------------- the model, as the cost model sees it */
typedef struct kvb_etw_dims {
    int n_layers;        /* L */
    int hidden;          /* h */
    int q_dim;           /* n_heads * head_dim: attention FLOPs and the Q/O projections scale with it */
    int kv_dim;          /* n_kv_heads * head_dim: K/V projections and KV bytes (GQA) */
    int intermediate;    /* SwiGLU width I */
    int vocab;           /* V */
    int kv_elem;         /* bytes per K/V element in the cache */
    int act_elem;        /* bytes per activation element */
    double weight_bytes; /* weight bytes read per step (kvb_model_weight_bytes_per_token) */
} kvb_etw_dims;

void kvb_etw_dims_from_config(const kvb_model_config *c, int kv_elem, int act_elem, double weight_bytes,
                              kvb_etw_dims *out);
/* Dense FLOPs of one token through one layer: 2·(2·h·q_dim + 2·h·kv_dim + 3·h·I). */
double kvb_etw_layer_flops(const kvb_etw_dims *d);
/* KV bytes of one token in one layer (K and V): 2·kv_dim·kv_elem. */
double kvb_etw_kv_bytes(const kvb_etw_dims *d);
/* Activation bytes of one row of a step in kvbank's forward pass (x, h, q, att, k, v, gate, up). */
double kvb_etw_act_row_bytes(const kvb_etw_dims *d);

/* ---------------------------------------------------------------- cost model (Eq. 2-4, corrected) */
/* The work of (part of) a step, in the units the coefficients below convert to seconds. */
typedef struct kvb_etw_work {
    double flops; /* dense FLOPs: projections, MLP, LM head */
    double attn;  /* attention FLOPs (QK^T and AV) */
    double bytes; /* bytes read: weights once per step, the KV each decode attends to */
} kvb_etw_work;

/* Seconds per unit of work. T = t_fixed + flops·s_flop + attn·s_attn + bytes·s_byte. */
typedef struct kvb_etw_rates {
    double t_fixed; /* s per step: launches, synchronisation, sampling */
    double s_flop;  /* s per dense FLOP (1 / FLOPS) */
    double s_attn;  /* s per attention FLOP */
    double s_byte;  /* s per byte read (1 / bandwidth) */
} kvb_etw_rates;

/* Decode of one request whose KV covers `s` tokens: its new token through all L layers, attending to
 * s + 1 keys (the s before it and itself), plus its logits. */
kvb_etw_work kvb_etw_work_decode(const kvb_etw_dims *d, double s);
/* Recompute of a request's oldest `u` tokens through `n_layers` layers (a causal prefill from their
 * ids; no logits). */
kvb_etw_work kvb_etw_work_recompute(const kvb_etw_dims *d, double u, int n_layers);
/* A prefill chunk of `c` tokens that starts at position `p` (its logits row included). */
kvb_etw_work kvb_etw_work_prefill(const kvb_etw_dims *d, double p, double c);
/* The per-step constant: the weights, read once. */
kvb_etw_work kvb_etw_work_step(const kvb_etw_dims *d);
void kvb_etw_work_add(kvb_etw_work *acc, kvb_etw_work w);
double kvb_etw_time(const kvb_etw_rates *k, kvb_etw_work w);            /* without t_fixed */
double kvb_etw_step_time(const kvb_etw_rates *k, kvb_etw_work w);       /* with t_fixed */

/* Online fit of the rates (calibration at start and re-fit from `observe`). Ridge regression of the
 * measured step time on the four work features, each coefficient a multiplier of the prior's, pulled
 * toward 1 with weight `prior_weight` and forgotten exponentially (factor `forget` per sample). */
typedef struct kvb_etw_fit {
    kvb_etw_rates prior;
    double prior_weight; /* in units of one sample of squared relative error */
    double forget;       /* per sample, in (0, 1] */
    double xtx[4][4];    /* Σ z z^T, z = features scaled by the prior (seconds) */
    double xty[4];       /* Σ z t */
    double n;            /* effective number of samples */
} kvb_etw_fit;

void kvb_etw_fit_init(kvb_etw_fit *f, const kvb_etw_rates *prior, double prior_weight, double forget);
/* Adds one measured step: its work (without the per-step constant: that is added here) and seconds. */
void kvb_etw_fit_add(kvb_etw_fit *f, kvb_etw_work w_with_step, double seconds);
/* The current estimate (multipliers clamped to [1/50, 50] of the prior, never negative). */
void kvb_etw_fit_rates(const kvb_etw_fit *f, kvb_etw_rates *out);

/* ---------------------------------------------------------------- layer level (§4.3) */
/* The host link of the swapped layers (from the stager's link model): a transfer of n bytes takes
 * latency_s + n / bytes_per_s. Eq. 6's α (per token, all layers) is L·kv_bytes / bytes_per_s and β
 * is L·latency_s. */
typedef struct kvb_etw_link {
    double bytes_per_s; /* 0: no host tier (nothing is swapped) */
    double latency_s;
} kvb_etw_link;

typedef struct kvb_etw_layer_plan {
    int l1;          /* swapped layers per window: also how many loads run ahead (0: no swapping) */
    int l2;          /* recomputed layers per window: how many layers the recompute runs ahead */
    int n_rec;       /* prefix layers recomputed each step: [0, n_rec) */
    int n_swap;      /* prefix layers reloaded from the host tier each step: [n_rec, L) */
    int depth;       /* prefix layers held in scratch at once: 1 + l2 (+ l1 when swapping) */
    double t_swap;   /* Eq. 6 for one window (l1 layers), seconds */
    double t_rec;    /* Eq. 7 corrected for one window (l2 layers), seconds */
    /* The fused step's thread split (Eq. 8-9): delta of `threads` for the recompute (K1), the rest
     * for the decode (K2). GPU: threads = 1024 and delta a multiple of 32 in [32, 992]; CPU: the
     * worker threads, delta in [1, threads - 1] (0 when there is nothing to recompute). */
    int threads;
    int delta;
} kvb_etw_layer_plan;

/* What the layer level needs about the batch. */
typedef struct kvb_etw_batch {
    int b;              /* requests */
    const int *s;       /* [b] tokens whose KV each request has (resident or absent) */
    const int *u;       /* [b] absent (recomputed) tokens of each, u[i] <= s[i] */
} kvb_etw_batch;

/* What the δ split divides (Eq. 8-9): a GPU's thread block (1024 threads, warp-aligned) or the CPU
 * backend's worker threads. */
typedef enum kvb_etw_device {
    KVB_ETW_DEVICE_CPU = 0, /* delta in [1, threads - 1] of the worker threads */
    KVB_ETW_DEVICE_GPU = 1  /* delta a multiple of 32 in [32, 992] of 1024 threads */
} kvb_etw_device;

/* The paper's starting point before the layer level answers: l1 = 3, l2 = 2 (M_o = 40hbsr). */
kvb_etw_layer_plan kvb_etw_layer_initial(const kvb_etw_dims *d, const kvb_etw_link *link);
/* §4.3.1: picks (l1, l2) in {1,2,3} x {1,2} with the smallest |T_swap − T_rec| (ties: the smaller
 * depth) when the link exists and swapping does not make the estimated step longer than recomputing
 * every layer (kvbank's guard); otherwise l1 = 0, l2 = 1, n_rec = L. Then the δ split of `threads`
 * (`device_kind` GPU: warp-aligned, ≤ 1024) from the estimated times of K1 (recompute of l2 layers) and K2
 * (decode of l1 + l2 layers), Eq. 8-9 in seconds instead of FLOPs. */
void kvb_etw_layer_optimize(const kvb_etw_dims *d, const kvb_etw_rates *k, const kvb_etw_link *link,
                            const kvb_etw_batch *bt, int threads, kvb_etw_device device_kind,
                            kvb_etw_layer_plan *out);
/* Estimated seconds of one step of `bt` under `lp` (decode + recompute of n_rec layers, the loads of
 * n_swap layers overlapped with them and exposed only where they run past the compute). */
double kvb_etw_step_estimate(const kvb_etw_dims *d, const kvb_etw_rates *k, const kvb_etw_link *link,
                             const kvb_etw_batch *bt, const kvb_etw_layer_plan *lp);

/* ---------------------------------------------------------------- request level (§4.1-4.2) */
typedef struct kvb_etw_problem {
    const kvb_etw_dims *d;
    kvb_etw_rates rates;
    kvb_etw_layer_plan layer; /* current layer-level answer: n_rec and the scratch depth (M_o) */
    const int *s;      /* [n] tokens of each candidate request, FCFS order (running, then waiting) */
    int n;
    int b_bound;       /* the batch bound (512 by default); b <= min(n, b_bound) */
    double r_max;      /* largest uncached ratio, <= 1 */
    double slo_s;      /* TPOT SLO */
    double wt_max_s;   /* WT_max: the longest a decode waits per step for prefill work in the same
                        * step (the planner's definition: its prefill chunk budget, costed by the model) */
    int block_size;    /* tokens per block */
    int unit_layers;   /* F: layers per map-table unit */
    int64_t mem_blocks;  /* device blocks for resident KV, scratch units and recompute activations */
    int64_t host_blocks; /* host-tier blocks for swapped prefix layers (0: none) */
    int64_t max_rows;    /* most rows one step's forward pass may hold (decodes + recomputed tokens) */
    double act_row_bytes;/* device bytes each recomputed row's activations take from mem_blocks (0 when
                          * the forward pass's rows are allocated once, outside the pool) */
} kvb_etw_problem;

typedef struct kvb_etw_solution {
    int b;             /* requests to run: the first b candidates */
    double r;          /* uncached ratio: request i recomputes floor(r * s_i) tokens */
    double t_step;     /* estimated step seconds at (b, r) */
    double objective;  /* t_step / b (Eq. 5) */
    int feasible;      /* 0: even b = 1 breaks a constraint (b = 1 at r_max is returned) */
    int64_t mem_blocks;  /* device blocks (b, r) needs, exact */
    int64_t host_blocks; /* host blocks it needs, exact */
    int evals;         /* objective evaluations (SLSQP) */
    int exact_evals;   /* batch sizes made exact (kvb_etw_min_ratio calls) */
    /* SLSQP's answer alone, made integral and exact (the paper's method; b = 0 if it found nothing
     * feasible): kvb_etw_solve's answer is never worse */
    int b_slsqp;
    double r_slsqp, obj_slsqp;
} kvb_etw_solution;

/* u_i = floor(r·s_i), in [0, s_i] (with 1e-9 of slack, so r = k/s_i gives k exactly). */
int64_t kvb_etw_absent(double r, int64_t s);
/* Exact device and host blocks of the first `b` candidates at ratio r (u_i = kvb_etw_absent(r, s_i)):
 * Σ (ceil((s_i + 1) / bs) − floor(u_i / bs)) resident blocks, the scratch carriers of the pipeline
 * window (ellm_tw_map.h's unit rule) and the recompute rows' activations in whole blocks. */
void kvb_etw_exact_blocks(const kvb_etw_problem *p, int b, double r, int64_t *dev, int64_t *host);
/* The exact Eq. 4 step time of the first b candidates at r (layer plan of the problem). */
double kvb_etw_exact_time(const kvb_etw_problem *p, int b, double r);
/* 1 if (b, r) meets every constraint of Eq. 1 exactly (memory in blocks, rows, SLO). */
int kvb_etw_feasible(const kvb_etw_problem *p, int b, double r);
/* The smallest r in [0, r_max] at which b requests fit in memory (and rows, host blocks), -1 if none.
 * Memory changes only at the ratios k/s_i; after jumping over ratios that provably cannot fit, the
 * requests' block boundaries are walked in order with exact resident and scratch counts. The absent
 * count (activations, rows) is bounded by r·Σs_i − b < U <= r·Σs_i and counted exactly only where the
 * bounds do not decide, at most 16 times: past that, or past 4·b + 4096 steps (an absent token that
 * frees barely more than it costs), the answer is still feasible but may lie above the smallest by
 * the ratio that holds the activations of b tokens. */
double kvb_etw_min_ratio(const kvb_etw_problem *p, int b);

/* Eq. 5 under Eq. 1 with NLopt's LD_SLSQP on b relaxed to a real (prefix sums of s_i and s_i²
 * interpolated linearly between integers, so the gradients exist), from a few starting points; b is
 * floored, r raised to the smallest exactly feasible ratio, and the constraints re-checked (b lowered
 * until they hold). kvbank adds candidates from an O(B) scan of the relaxation over every integer b
 * (the FCFS objective is bumpy in b and SLSQP is local) and keeps the best exact one.
 * KVB_ERR_INVALID for a malformed problem, KVB_ERR_NOMEM. */
kvb_status kvb_etw_solve(const kvb_etw_problem *p, kvb_etw_solution *out);
/* Dense search for tests and benchmarks: every integer b, r on a grid of `r_steps` + 1 points in
 * [0, r_max], exact constraints and objective. */
void kvb_etw_solve_grid(const kvb_etw_problem *p, int r_steps, kvb_etw_solution *out);

#endif
