/* kvbank — OrbitFlow and its five baselines as planners (common/policy/orbitflow_planner.c): the
 * registry names `orbitflow`, `deepspeed`, `flexgen`, `flexgen-plus`, `slo-aware-offload` and
 * `dynamic-heuristic` (policies.def). Parameters (all optional; kvbank's defaults, the paper gives none):
 *   slo_ms=50          per-model default time-between-tokens SLO (a request's tbt_slo_ms wins)
 *   delta_min=2 delta_max=64 ewma=0.25 threshold=0.2 alpha=1   the solver and the controller (§3.3-3.4)
 *   deposit=on|off     the planner counts Token-Deposit slack (orbitflow on; baselines off, Fig. 14b)
 *   pause=on|off       Pause-Resume (orbitflow on; baselines have none)
 *   mode=request-wise|uniform   one candidate per request, or one for the batch (Fig. 14a)
 *   victim=score|longest|shortest|random   Pause-Resume's victim (Fig. 14c)
 *   host_blocks=N      block ids of the sliced pool = host-tier homes (0: from the pool and max_model_len)
 *   batch=N            most running requests (0: the engine's max_seqs); batch_tokens=N: the per-batch
 *                      token limit FlexGen and SLO-aware offloading size for (0: batch x max_model_len)
 *   solver=thread|inline   the solver on its own thread one step ahead (default) or in plan_step
 *   solver_lag=N       inline solver only: its decision is installed N steps after the snapshot it
 *                      was made on (0), a solver thread N steps behind the engine, made deterministic
 *   max_nodes=N        search nodes before the solver stops with its best (0: no limit)
 *   link_gbps=G link_us=U   the host link for the latency model (0: measured by the stager) */
#ifndef KVB_POLICY_ORBITFLOW_PLANNER_H
#define KVB_POLICY_ORBITFLOW_PLANNER_H

#include "common/policy/orbitflow.h"
#include "common/policy/policy.h"

typedef enum kvb_of_kind {
    KVB_OF_KIND_ORBITFLOW = 0,
    KVB_OF_KIND_DEEPSPEED = 1,
    KVB_OF_KIND_FLEXGEN = 2,
    KVB_OF_KIND_FLEXGEN_PLUS = 3,
    KVB_OF_KIND_SLO_AWARE = 4,
    KVB_OF_KIND_DYNAMIC = 5,
    KVB_OF_KIND_COUNT = 6,
} kvb_of_kind;

typedef struct kvb_of_params {
    int delta_min, delta_max;
    double ewma, threshold, alpha;
    double slo_ms;
    int deposit, pause;
    kvb_of_mode mode;
    kvb_of_victim victim;
    int host_blocks;
    int batch;
    int64_t batch_tokens;
    int threaded;
    int solver_lag;            /* inline solver: steps between a snapshot and its decision's install */
    int64_t max_nodes;
    double link_gbps, link_us;
} kvb_of_params;

void kvb_of_params_default(kvb_of_params *p);
/* Parses `pp` over *p (unknown keys and bad values: KVB_ERR_INVALID, logged with `name`). */
kvb_status kvb_of_params_parse(const kvb_policy_params *pp, const char *name, kvb_of_params *p);

typedef struct kvb_of_planner kvb_of_planner;

/* What a planner did (for benchmarks and logs). */
typedef struct kvb_of_planner_stats {
    uint64_t solver_calls;      /* snapshots handed to the solver */
    uint64_t decisions;         /* decisions installed */
    uint64_t solver_late;       /* steps a trigger waited because the solver was still busy */
    double solve_us_total, solve_us_max, last_solve_us;
    uint64_t nodes;             /* search nodes over all solves */
    uint64_t infeasible;        /* decisions with no feasible plan at all (budget) */
    uint64_t best_effort;       /* decisions where a lone request misses the SLO */
    int last_window;
    uint64_t trig_batch, trig_window, trig_memory, trig_mismatch;
    uint64_t pauses, resumes, emergency_pauses, preemptions, trimmed;
    uint64_t resumes_deferred;  /* a decision's resumes dropped from a step's plan: no room beside what runs */
    uint64_t profile_fits;
    double plan_s;              /* time in plan_step (the solver thread's time is solve_us_total) */
    int link_measured;
    double last_observed;       /* s: the last step's layers, waits included */
    uint64_t pred_steps;        /* decode steps with a prediction */
    double pred_err_sum, pred_err_max; /* |observed - predicted| / predicted */
    uint64_t pred_within[3];    /* of those, steps with that error within 10 %, 25 %, 50 % */
    /* feasible decisions: sums of their device slices (buffer included), their prefetch buffer (the sum over
     * requests kvbank reserves), Eq. 1's buffer for the same placement (the max over layers) and the budget */
    uint64_t feasible_decisions;
    double mem_slices_sum, buffer_slices_sum, eq1_buffer_slices_sum, budget_slices_sum;
} kvb_of_planner_stats;

kvb_status kvb_of_planner_create(kvb_of_kind kind, const kvb_of_params *p, kvb_planner *out);
/* 1 (and *out, may be NULL) if `pl` is one of these planners. */
int kvb_of_planner_of(const kvb_planner *pl, kvb_of_planner **out);
void kvb_of_planner_get_stats(const kvb_of_planner *P, kvb_of_planner_stats *out);

#endif
