/* kvbank — OrbitFlow's pure core (../shared/papers/orbitflow.txt §2.3, §3.2-3.4, §5.1): candidate
 * placements, the batch latency model, memory accounting per (block, layer) slice, the exact solver
 * over the pruned space, the adaptive controller's triggers, Pause-Resume's victim, Token-Deposit slack,
 * and the placement rules of the five baselines. Plain functions over plain data: no threads, no clock,
 * no engine. The planner (orbitflow_planner.c) runs them on its solver thread.
 *
 * Units. Time in seconds (double). Memory and transfers in (block, layer) slices: one layer's KV of one
 * block of block_size tokens (the allocation unit of §4's flattened layout and the "block" of Fig. 3).
 * Bandwidth in slices per second. Layers are 0-based here (the paper counts from 1).
 *
 * kvbank's readings where the paper is silent or contradicts itself (docs/papers/orbitflow.md):
 * - Latency model: the text of §3.3.1 (greedy launch, equal bandwidth share among active transfers,
 *   progress kept across layers), not the printed Alg. 1 (which restarts its clock at each boundary and
 *   gives Fig. 3's placement B 3 layer-times of stall at step 1 where the text says 0). A request holds
 *   `n_slots` prefetch slots (1 for OrbitFlow's candidates, 2 for DeepSpeed's double buffer); a slot is
 *   taken when its transfer launches and freed when the layer that reads it has computed; a request
 *   launches its next offloaded layer as soon as a slot is free. A transfer launched at t moves data from
 *   t + lat on.
 * - Prefetch buffer: sized as the sum over requests with an offloaded layer of n_slots x the largest
 *   slice set one of its layers fetches, because the greedy rule puts every such request's next layer
 *   in flight at once (Fig. 3, placement C at step 16: 10 slices in flight against Eq. 1's 6). Eq. 1's
 *   own value is kvb_of_eq1_buffer (reported, not used for the budget).
 * - SLO: a request fails at a step when its token would reach the user late under Token-Deposit
 *   (slack = scheduled delivery - generation time of its newest token); without Token-Deposit the slack
 *   is 0 and this is the plain TBT check. The windowed bound (1/Δ) Σ_s Σ_r fail ≤ α holds for the
 *   chosen Δ and the device budget holds at every step of the window.
 * - Objective and ties: the latency of the targeted step, then the larger Δ, then fewer slices fetched,
 *   then the lexicographically smaller candidate vector (request order as given). Times are compared
 *   in whole nanoseconds. */
#ifndef KVB_POLICY_ORBITFLOW_H
#define KVB_POLICY_ORBITFLOW_H

#include <stdint.h>

#include "common/util/util.h"

#define KVB_OF_MAX_LAYERS 256
#define KVB_OF_MAX_REQS 64   /* requests in one solve (a shared segment's owners are a 64-bit mask) */
#define KVB_OF_MAX_CANDS 64  /* placements per request: D(L) <= 2 sqrt(L) - 1 plus all-resident */
#define KVB_OF_MAX_WINDOW 256

/* A set of layers, bit l = layer l. */
typedef struct kvb_of_layerset {
    uint64_t w[KVB_OF_MAX_LAYERS / 64];
} kvb_of_layerset;

static inline int kvb_of_layer_in(const kvb_of_layerset *s, int l) { return (int)((s->w[l >> 6] >> (l & 63)) & 1u); }
static inline void kvb_of_layer_add(kvb_of_layerset *s, int l) { s->w[l >> 6] |= (uint64_t)1 << (l & 63); }

/* One placement of one request's layers. */
typedef struct kvb_of_cand {
    kvb_of_layerset off; /* layers whose KV lives in the host tier and is prefetched each step */
    int n_off;           /* |off| */
    int distance;        /* k of the distance-driven rule (offload layers k, 2k, ... counted from 1); 0 for
                          * all-resident, -1 for a placement given by its set */
    int n_slots;         /* prefetch slots of the request when n_off > 0: 1 (§3.3.1), 2 (DeepSpeed) */
} kvb_of_cand;

/* ---------------------------------------------------------------- candidates (§3.3.2) */

/* D(L) = |{ floor(L/k) : k = 2..L }|: the distinct counts of offloaded layers. 9 at L = 32. */
int kvb_of_dl(int n_layers);
/* The distance-driven placement with c offloaded layers: offload layers j*k (1-based), j = 1..c,
 * k = floor(L/c); c = 0 gives all-resident. One slot. */
void kvb_of_cand_distance(int n_layers, int c, kvb_of_cand *out);
/* DeepSpeed-Inference (§5.1): every layer offloaded, the next prefetched while one computes (2 slots). */
void kvb_of_cand_all_offloaded(int n_layers, kvb_of_cand *out);
/* OrbitFlow's candidates: all-resident first (Fig. 3's placement B), then the D(L) placements with
 * increasing c. Writes at most `max` and returns how many there are (1 + D(L)). */
int kvb_of_candidates(int n_layers, kvb_of_cand *out, int max);

/* ---------------------------------------------------------------- the compute profile and the link */

/* comp_l = scale_l * (a_l + c_l * tokens): per-layer decode compute time in seconds for a batch
 * attending to `tokens` context tokens in all (§3.3.1 "profiled per-layer compute times"), profiled at
 * start (kvb_of_profile_fit) and corrected by an EWMA of measured/predicted (kvb_of_profile_observe). */
typedef struct kvb_of_profile {
    int n_layers;
    double a[KVB_OF_MAX_LAYERS];     /* s */
    double c[KVB_OF_MAX_LAYERS];     /* s per context token */
    double scale[KVB_OF_MAX_LAYERS]; /* EWMA correction, 1 at start */
    double bw;                       /* host -> device, slices per second (EWMA-corrected) */
    double lat;                      /* per transfer, s */
} kvb_of_profile;

/* Uniform profile: every layer a + c * tokens. */
void kvb_of_profile_uniform(kvb_of_profile *p, int n_layers, double a, double c, double bw, double lat);
/* Least-squares fit of a_l, c_l from n >= 2 samples: tokens[i] and times[i * n_layers + l] (s).
 * KVB_ERR_INVALID when the token counts do not span two values. Negative fits clamp at 0. */
kvb_status kvb_of_profile_fit(kvb_of_profile *p, int n_layers, const double *tokens, const double *times, int n);
/* comp[l] for `tokens` context tokens. */
void kvb_of_profile_comp(const kvb_of_profile *p, double tokens, double *comp);
/* EWMA (weight w) of a measured decode step: per-layer compute times `layer_s` [n_layers] at `tokens`
 * (NULL: none), and a measured bandwidth `bw` (<= 0: none). */
void kvb_of_profile_observe(kvb_of_profile *p, double tokens, const double *layer_s, double bw, double w);

/* ---------------------------------------------------------------- latency model (§3.3.1) */

typedef struct kvb_of_sim_req {
    const kvb_of_cand *cand;
    double slices;      /* fetched per offloaded layer when `size` is NULL */
    const double *size; /* [n_layers] slices fetched for each offloaded layer, or NULL */
} kvb_of_sim_req;

typedef struct kvb_of_sim_out {
    double t_batch;       /* s: end of the last layer's compute */
    double stall;         /* s: t_batch - sum of comp */
    double peak_inflight; /* most slices held in prefetch slots at once (launched, not yet consumed) */
    double fetched;       /* slices fetched in the step */
} kvb_of_sim_out;

/* Simulates one decode step: layer l starts when layer l-1 has computed and every transfer for l has
 * landed. `comp` [n_layers]; `layer_start` [n_layers] may be NULL. Returns t_batch. n <= KVB_OF_MAX_REQS. */
double kvb_of_sim(const double *comp, int n_layers, double bw, double lat, const kvb_of_sim_req *reqs, int n,
                  kvb_of_sim_out *out, double *layer_start);

/* ---------------------------------------------------------------- the placement problem (§3.3) */

/* Full blocks shared by several requests (prefix cache): resident at a layer if any owner keeps that
 * layer, and then counted once; otherwise every owner that offloads the layer fetches them. */
typedef struct kvb_of_segment {
    int64_t n_blocks;
    uint64_t owners; /* bit r: request r holds these blocks (the first blocks of its table) */
} kvb_of_segment;

typedef struct kvb_of_req {
    int64_t len;     /* tokens whose KV exists (context) */
    double slack;    /* s >= 0: Token-Deposit slack (kvb_of_slack); 0 without Token-Deposit */
    double slo;      /* s: TBT SLO; <= 0 means none */
    int64_t deposit; /* tokens held in the deposit now (the pause score) */
} kvb_of_req;

typedef enum kvb_of_mode {
    KVB_OF_REQUEST_WISE = 0, /* every request picks its own candidate (OrbitFlow) */
    KVB_OF_UNIFORM = 1,      /* one candidate for the whole batch (Fig. 14a "Batch-Uniform") */
} kvb_of_mode;

typedef struct kvb_of_problem {
    const kvb_of_profile *prof;
    int block_size;            /* tokens per block */
    int64_t budget;            /* slices the device holds for KV, prefetch buffer included */
    const kvb_of_req *reqs;
    int n_reqs;                /* <= KVB_OF_MAX_REQS */
    const uint8_t *excluded;   /* [n_reqs] or NULL: 1 = not in the batch (paused) */
    const kvb_of_segment *segs;
    int n_segs;
    const kvb_of_cand *cands;  /* every request chooses among these */
    int n_cands;               /* <= KVB_OF_MAX_CANDS */
    int ahead;                 /* tokens added per request for the targeted step (1: the solver runs one
                                * step ahead, §3.3.2); block counts are ceil((len + ahead + s) / bs) */
    int delta_min, delta_max;  /* decode window bounds, 1 <= min <= max <= KVB_OF_MAX_WINDOW */
    double alpha;              /* SLO violations allowed per step, averaged over the window (1) */
    int enforce_slo;           /* 0: the budget alone (baselines, a lone request) */
    kvb_of_mode mode;
    int64_t max_nodes;         /* search nodes before giving up optimality (0: no limit) */
} kvb_of_problem;

typedef struct kvb_of_solution {
    int feasible;                   /* a placement meets the budget (and the SLO cap when enforced) */
    int cand[KVB_OF_MAX_REQS];      /* candidate index per request (-1 for excluded ones) */
    int delta;                      /* the window: the plan holds for steps [0, delta) */
    double t_batch;                 /* s: predicted latency of the targeted step */
    double pred[KVB_OF_MAX_WINDOW]; /* s: predicted latency of window step s (s < delta) */
    int64_t mem;                    /* slices at the targeted step, buffer included */
    int64_t buffer;                 /* of which prefetch slots */
    int64_t fetched;                /* slices fetched per step at the targeted step */
    int fails;                      /* predicted SLO failures over the window */
    int exact;                      /* 1: the search completed (the optimum is proven) */
    int64_t nodes;                  /* search nodes visited */
    int64_t evals;                  /* full placements evaluated */
} kvb_of_solution;

/* Blocks request r holds at window step s. */
static inline int64_t kvb_of_blocks(int64_t len, int ahead, int s, int block_size) {
    return KVB_DIV_CEIL(len + ahead + s, (int64_t)block_size);
}

/* Device slices of a full assignment `cand` [n_reqs] at window step s: resident slices + prefetch slots
 * (*buffer). Excluded requests count nothing. */
int64_t kvb_of_memory(const kvb_of_problem *p, const int *cand, int s, int64_t *buffer);
/* Eq. 1's prefetch buffer for the same assignment: max over layers of the slices offloaded there. */
int64_t kvb_of_eq1_buffer(const kvb_of_problem *p, const int *cand, int s);
/* Predicted latency of window step s for a full assignment (fetched slices in *fetched, may be NULL). */
double kvb_of_step_latency(const kvb_of_problem *p, const int *cand, int s, kvb_of_sim_out *out);
/* Evaluates a full assignment: feasibility, the largest feasible Δ and its predictions (sol->cand is
 * copied from `cand`). */
void kvb_of_evaluate(const kvb_of_problem *p, const int *cand, kvb_of_solution *sol);

/* The exact solver: branch and bound over the pruned space. KVB_ERR_INVALID for a malformed problem.
 * sol->feasible = 0 reports infeasible (no placement meets the budget and the SLO cap). */
kvb_status kvb_of_solve(const kvb_of_problem *p, kvb_of_solution *sol);
/* The same optimum by enumerating every assignment (tests and the pruning benchmark). */
kvb_status kvb_of_solve_brute(const kvb_of_problem *p, kvb_of_solution *sol);
/* 1 if a is better than b under the objective and its ties (see the top of this file). */
int kvb_of_better(const kvb_of_solution *a, const kvb_of_solution *b);

/* ---------------------------------------------------------------- Pause-Resume (§3.4) */

typedef enum kvb_of_victim {
    KVB_OF_VICTIM_SCORE = 0,    /* largest KV + deposited tokens, in tokens (OrbitFlow) */
    KVB_OF_VICTIM_LONGEST = 1,  /* largest KV (Fig. 14c "longest") */
    KVB_OF_VICTIM_SHORTEST = 2, /* smallest KV (Fig. 14c "shortest") */
    KVB_OF_VICTIM_RANDOM = 3,   /* uniform among the batch (Fig. 14c "random"), from *rng */
} kvb_of_victim;

/* The request to pause among those not excluded; -1 when fewer than two remain (a lone request is
 * never paused). Ties go to the later index. `rng` (xorshift state) is used by RANDOM only. */
int kvb_of_pick_victim(const kvb_of_req *reqs, int n, const uint8_t *excluded, kvb_of_victim rule, uint64_t *rng);

typedef struct kvb_of_plan_out {
    kvb_of_solution sol;
    uint8_t paused[KVB_OF_MAX_REQS]; /* 1: paused by this plan (added to p->excluded) */
    int n_paused;
    int best_effort;                 /* 1: even a lone request misses the SLO; planned for the budget alone */
} kvb_of_plan_out;

/* Solve; while infeasible and more than one request remains, pause the victim and solve again (§3.4);
 * a lone request that still misses the SLO gets the fastest placement within the budget (best_effort).
 * sol.feasible = 0 at the end means the budget cannot hold even that. */
kvb_status kvb_of_plan(const kvb_of_problem *p, kvb_of_victim rule, uint64_t *rng, kvb_of_plan_out *out);

/* ---------------------------------------------------------------- Token-Deposit (§3.2) */

/* kvbank's reading of the planner's deposit level: slack = scheduled delivery of the newest token -
 * its generation time (>= 0), both from kvb_deposit_next (common/util/token_deposit.h). */
double kvb_of_slack(uint64_t newest_gen_ns, uint64_t newest_deliv_ns);

/* ---------------------------------------------------------------- adaptive controller (§3.4) */

typedef enum kvb_of_trigger {
    KVB_OF_TRIG_NONE = 0,
    KVB_OF_TRIG_BATCH = 1,    /* a request joined, left, paused or resumed */
    KVB_OF_TRIG_WINDOW = 2,   /* the plan's window Δ expired */
    KVB_OF_TRIG_MEMORY = 4,   /* growing KV would pass the budget at the next step */
    KVB_OF_TRIG_MISMATCH = 8, /* observed step latency departed from the prediction by > threshold */
} kvb_of_trigger;

typedef struct kvb_of_ctl {
    int delta_min;            /* the mismatch trigger fires at most once per delta_min steps */
    double threshold;         /* relative |observed - predicted| / predicted */
    int64_t plan_step;        /* step index at which the installed plan took effect */
    int delta;                /* its window */
    double pred[KVB_OF_MAX_WINDOW];
    int64_t last_mismatch;    /* step of the last mismatch trigger (INT64_MIN / 2 when none) */
    int64_t n_mismatch, n_window, n_batch, n_memory;
} kvb_of_ctl;

void kvb_of_ctl_init(kvb_of_ctl *c, int delta_min, double threshold);
/* A new plan took effect at `step` with solution `sol`'s window and predictions. */
void kvb_of_ctl_install(kvb_of_ctl *c, int64_t step, const kvb_of_solution *sol);
/* After decode step `step` (which took `observed` s; `had_prefill`: it carried prefill tokens and is
 * not compared): the triggers that ask for a new plan for the next step (a kvb_of_trigger mask).
 * `batch_changed`, `mem_short` come from the scheduler. Batch and memory fire at once (§3.4 "immediately
 * re-runs"); the window at its end; the mismatch no more often than every delta_min steps (§3.3.1). */
unsigned kvb_of_ctl_check(kvb_of_ctl *c, int64_t step, int batch_changed, int mem_short, int had_prefill,
                          double observed);

/* ---------------------------------------------------------------- baselines (§5.1) */

/* FlexGen: the uniform candidate with the lowest predicted latency whose memory fits at the worst case
 * (n_seqs requests of worst_len tokens each); static for the run. Returns the candidate index into
 * p->cands, -1 if none fits (then the most offloaded one). p's requests are ignored. */
int kvb_of_flexgen_static(const kvb_of_problem *p, int n_seqs, int64_t worst_len);
/* FlexGen+: the same rule for the batch as it is, each request at its final length (len + remaining
 * tokens, `final_len` [n_reqs]); re-run on batch change. */
int kvb_of_flexgen_batch(const kvb_of_problem *p, const int64_t *final_len);

/* SLO-aware offloading (ref. [35]): an offline table over batch size x total tokens; each entry holds
 * the uniform candidate with the most offloaded layers whose predicted latency meets the SLO and whose
 * memory fits, or the fastest that fits when none meets it. */
typedef struct kvb_of_slo_table {
    int max_seqs;
    int64_t max_tokens;  /* per batch */
    int64_t bucket;      /* tokens per column */
    int n_cols;
    int16_t *entry;      /* [max_seqs][n_cols] candidate index, -1: nothing fits */
} kvb_of_slo_table;

kvb_status kvb_of_slo_table_build(const kvb_of_problem *p, double slo, int max_seqs, int64_t max_tokens,
                                  int64_t bucket, kvb_of_slo_table *t);
void kvb_of_slo_table_free(kvb_of_slo_table *t);
/* The entry for n_seqs requests holding `tokens` in all (rounded up to the next column). */
int kvb_of_slo_table_lookup(const kvb_of_slo_table *t, int n_seqs, int64_t tokens);

/* Dynamic heuristic: starting from all-resident, move the request with the most blocks to its next more
 * offloaded candidate until the batch fits the budget at the targeted step (fewest offloaded layers,
 * no SLO, no Pause-Resume). Fills cand [n_reqs] (-1 for excluded); 0 if even the most offloaded
 * placement does not fit (cand then holds it). Candidates must be ordered by increasing n_off. */
int kvb_of_dynamic_heuristic(const kvb_of_problem *p, int *cand);

#endif
