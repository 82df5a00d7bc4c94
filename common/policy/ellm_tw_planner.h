/* kvbank — the eLLM token-wise planner and its baselines (ellm_tw_planner.c): what they measured, for
 * kvbank-bench ellm-tw and the tests. */
#ifndef KVB_POLICY_ELLM_TW_PLANNER_H
#define KVB_POLICY_ELLM_TW_PLANNER_H

#include "common/policy/ellm_tw.h"
#include "common/sched/plan.h"

typedef struct kvb_etw_planner_stats {
    uint64_t steps;        /* plan_step calls */
    uint64_t observed;     /* steps whose time fed the cost model */
    uint64_t solves;       /* request-level solves (with the layer level before each) */
    double solve_mean_s;   /* seconds per solve */
    double solve_max_s;
    double b_sum;          /* Σ b used per step (mean: / steps) */
    double r_sum;          /* Σ r used per step */
    uint64_t trims;        /* running requests preempted because b fell below their count */
    double cost_mape;      /* mean |predicted − measured| / measured step time (§6.6) */
    double cached_ratio;   /* mean over steps of 1 − Σu_i / Σs_i of the decoding requests (paper: 0.64) */
    double work_flops;     /* FLOPs (dense + attention) of the observed steps, by the cost model's count */
    double work_seconds;   /* their measured seconds: work_flops / work_seconds is the achieved rate */
    double peak_flops;     /* this machine's matmul rate (0 if unknown): utilisation = achieved / peak */
    int n_hidden;          /* hcache: layers restored from hidden states (its state partition) */
    kvb_etw_rates rates;   /* the cost model now */
    kvb_etw_layer_plan layer;
} kvb_etw_planner_stats;

/* The statistics of a planner made by kvb_policy_create("ellm-tokenwise" | "vllm-recompute" |
 * "vllm-swap" | "hcache"); KVB_ERR_INVALID for any other planner. `pl` is borrowed (the engine may own
 * it: valid while the engine lives). */
kvb_status kvb_etw_planner_get_stats(const kvb_planner *pl, kvb_etw_planner_stats *out);

#endif
