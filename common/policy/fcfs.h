/* kvbank — vLLM's scheduler as reusable routines that planners call to fill their plans (the `recompute`
 * planner is these routines alone).
 *
 * kvb_fcfs: iteration-level batching (Orca), FCFS, chunked prefill, automatic prefix caching, preemption
 * when the pool runs out. Each step:
 *   1. running requests, oldest first, get their decode token or the next chunk of their prompt
 *      within the token budget; when one cannot get the blocks it needs, a victim among it and the
 *      running requests after it is preempted (opts.pick_victim, default the newest) and the block
 *      count is tried again (if the victim is the request itself, it is not scheduled);
 *   2. swapped requests come back first (vLLM admits nothing new while one waits swapped out), then
 *      waiting requests are admitted in arrival order while the budget, the batch limit and the pool
 *      allow, each taking its prefix-cache hits first (full blocks, leaving at least one token to
 *      compute for the logits; continued in the host tier if there is one); the queue stops at the
 *      first request that does not fit (FCFS: nobody is preempted for a waiting request), and a
 *      request whose next prompt block a running (or just admitted) request is computing right now is
 *      passed over for a step (plan.n_deferred) and reuses that block from the cache instead.
 * A planner may put its own operations in the plan first (pauses, swaps, its own RUN entries) and call
 * kvb_fcfs_admit for the admission part only: the routines account for what the plan already holds
 * (common/sched/check.h). They change nothing but the plan. */
#ifndef KVB_POLICY_FCFS_H
#define KVB_POLICY_FCFS_H

#include "common/sched/check.h"

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
kvb_status kvb_fcfs(const kvb_view *v, const kvb_fcfs_opts *o, kvb_plan *out);
/* Phase 1 only (running requests). */
kvb_status kvb_fcfs_running(const kvb_view *v, const kvb_fcfs_opts *o, kvb_plan *out);
/* Phase 2 only (admission), after whatever `out` already holds. */
kvb_status kvb_fcfs_admit(const kvb_view *v, const kvb_fcfs_opts *o, kvb_plan *out);

#endif
