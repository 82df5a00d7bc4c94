/* kvbank — the scheduler's routines that planners call to fill their plans (common/sched/plan.h).
 *
 * kvb_sched_fcfs is vLLM's scheduler as one reusable routine: iteration-level batching (Orca), FCFS,
 * chunked prefill, automatic prefix caching, preemption when the pool runs out. Each step:
 *   1. running requests, oldest first, get their decode token or the next chunk of their prompt
 *      within the token budget; when one cannot get the blocks it needs, a victim among it and the
 *      running requests after it is preempted (opts.pick_victim, default the newest) and the block
 *      count is tried again (if the victim is the request itself, it is not scheduled);
 *   2. waiting requests are admitted in arrival order while the budget, the batch limit and the pool
 *      allow, each taking its prefix-cache hits first (full blocks, leaving at least one token to
 *      compute for the logits; continued in the host tier if there is one); the queue stops at the
 *      first request that does not fit (FCFS: nobody is preempted for a waiting request), and a
 *      request whose next prompt block a running (or just admitted) request is computing right now is
 *      passed over for a step (plan.n_deferred) and reuses that block from the cache instead.
 * A planner may put its own operations in the plan first (pauses, swaps, its own RUN entries) and call
 * kvb_sched_fcfs_admit for the admission part only: the routines account for what the plan already
 * holds.
 *
 * All of them run on the engine's thread during plan_step (they read the prefix cache through the
 * view) and change nothing but the plan. */
#ifndef KVB_SCHED_SCHEDULER_H
#define KVB_SCHED_SCHEDULER_H

#include "common/sched/plan.h"

typedef struct kvb_fcfs_opts {
    /* The victim when running request v->reqs[cand[0]] cannot get the blocks it needs: returns an
     * index into cand[0..n) (running requests not scheduled yet in this step, in arrival order,
     * cand[0] the one that needs blocks). NULL: the newest (vLLM). */
    int (*pick_victim)(void *ud, const kvb_view *v, const int *cand, int n);
    void *ud;
    kvb_op_kind preempt_op; /* KVB_OP_PREEMPT (0 means this: recompute) or KVB_OP_SWAP_OUT */
    int budget;             /* tokens for the whole plan (0: v->max_batch_tokens) */
    int batch_limit;        /* most RUN + ADMIT entries (0: v->max_seqs) */
} kvb_fcfs_opts;

/* Both phases, appended to `out`. KVB_ERR_NOMEM; KVB_ERR_INVALID if `out` already violates the pool
 * (the sentence is logged). */
kvb_status kvb_sched_fcfs(const kvb_view *v, const kvb_fcfs_opts *o, kvb_plan *out);
/* Phase 1 only (running requests). */
kvb_status kvb_sched_fcfs_running(const kvb_view *v, const kvb_fcfs_opts *o, kvb_plan *out);
/* Phase 2 only (admission), after whatever `out` already holds. */
kvb_status kvb_sched_fcfs_admit(const kvb_view *v, const kvb_fcfs_opts *o, kvb_plan *out);

/* What admitting request v->reqs[req] now would reuse. */
typedef struct kvb_prefix_probe {
    int n_hit;            /* full prompt blocks found in the pool's prefix cache */
    int n_hit_idle;       /* of those, referenced by nobody after the plan's operations so far (admitting
                           * takes them out of what allocation can give) */
    int n_host_hit;       /* further blocks found in the host tier (each is loaded into a new pool block) */
    int deferred;         /* its next prompt block is being computed by a running request, or by one the
                           * plan admits before it: wait a step and reuse it */
} kvb_prefix_probe;

/* KVB_ERR_INVALID if req is not a waiting request of the view. */
kvb_status kvb_sched_probe(const kvb_view *v, int req, const kvb_plan *p, kvb_prefix_probe *out);

/* What a plan asks of the pool and the step, as the executor will count it. */
typedef struct kvb_plan_cost {
    int64_t blocks_left;  /* blocks allocation could still give after the plan (free + evictable) */
    int tokens;           /* sum of q_len (ADMIT: after its prefix hits) */
    int rows;             /* tokens + sum of n_absent */
    int n_sched;          /* RUN + ADMIT entries */
    int n_running;        /* RUNNING + PAUSED requests after the plan */
    int host_left;        /* host-tier blocks still available after the plan's swaps and stores */
} kvb_plan_cost;

/* Checks `p` against the view exactly as the executor does before a step: KVB_OK with the cost, or
 * KVB_ERR_INVALID with a sentence in err (which may be NULL). KVB_ERR_NOMEM. */
kvb_status kvb_sched_cost(const kvb_view *v, const kvb_plan *p, kvb_plan_cost *out, char *err, size_t err_len);

/* Index of request `id` in v->reqs, or -1. O(1). */
int kvb_view_find(const kvb_view *v, uint64_t id);

#endif
