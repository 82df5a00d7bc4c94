/* kvbank — the plan check: the accounting every plan is checked with before a step, as routines planners
 * call to check or extend their own plans (common/policy/fcfs.h builds vLLM's scheduler on them).
 *
 * The accounting replays a plan's operations in order over the view: the state each request is left in,
 * the blocks allocation can still give (free + evictable, counting the references the plan adds and
 * drops), the step's tokens, rows and requests, the host-tier blocks left. The generic rules (states,
 * query lengths, blocks, budget) live here; each of the engine's mechanisms checks the operation fields
 * and plan parts it owns through the view's functions (kvb_view_ops). Nothing here writes what the view
 * shows: an accounting owns its memory, so a planner's thread may check plans while the engine waits in
 * plan_step. */
#ifndef KVB_SCHED_CHECK_H
#define KVB_SCHED_CHECK_H

#include "common/sched/plan.h"

/* What a request has in the plan so far (kvb_acct.sched, flags). */
enum {
    KVB_ACCT_RUN = 1 << 0,        /* a RUN */
    KVB_ACCT_ADMIT = 1 << 1,      /* an ADMIT */
    KVB_ACCT_SWAPPED_IN = 1 << 2, /* a SWAP_IN: the view lists its host blocks, it is not released again */
    KVB_ACCT_DROPPED = 1 << 3,    /* a DROP */
    KVB_ACCT_SCHEDULED = KVB_ACCT_RUN | KVB_ACCT_ADMIT,
};

/* The state of a plan being checked or built: what its operations so far leave of the pool, the budget
 * and the requests. */
typedef struct kvb_acct {
    const kvb_view *v;
    int64_t avail;          /* blocks allocation can give (free + evictable) */
    int tokens;             /* sum of q_len (ADMIT: after its prefix hits) */
    int rows;               /* tokens + sum of n_absent */
    int n_sched;            /* RUN + ADMIT entries */
    int n_running;          /* RUNNING + PAUSED requests */
    int64_t touched;        /* blocks the scheduled requests hold (an upper bound of the staged ones) */
    int host_left;          /* host-tier blocks allocation can give */
    int budget;             /* tokens the plan may compute */
    int batch_limit;        /* RUN + ADMIT entries the plan may have */
    kvb_req_state *state;   /* [n_reqs] each request's state after the operations so far */
    uint8_t *sched;         /* [n_reqs] KVB_ACCT_* */
    int32_t *dropped;       /* [n_reqs] its released leading blocks after the DROPs so far */
    int64_t *n_new;         /* [n_reqs] new blocks its RUN or ADMIT takes */
    /* private: reference changes of the blocks the plan touches, open addressing by id */
    struct kvb__adj { int32_t id, d; } *adj;
    int adj_cap, adj_n;
} kvb_acct;

/* Starts an accounting of an empty plan over the view (the plan's budget: v->max_batch_tokens, batch
 * limit v->max_seqs). KVB_ERR_NOMEM; KVB_ERR_STATE for a view without the engine's side (SETUP). */
kvb_status kvb_acct_begin(const kvb_view *v, kvb_acct *a);
/* Replays p's operations into a fresh accounting under a budget of at most `budget` tokens and `batch_limit`
 * RUN + ADMIT entries (0: the view's, and p's batch_limit). KVB_ERR_INVALID when p does not fit so far
 * (the sentence is logged). */
kvb_status kvb_acct_replay(const kvb_view *v, const kvb_plan *p, int budget, int batch_limit, kvb_acct *a);
/* Accounts operation k (its index in the plan, for messages), checking it. */
kvb_status kvb_acct_op(kvb_acct *a, const kvb_plan_op *op, int k, char *err, size_t len);
/* Frees the accounting's memory. NULL-safe. */
void kvb_acct_end(kvb_acct *a);

/* References to pool block `id` once the operations so far are applied. */
int kvb_acct_ref(const kvb_acct *a, int32_t id);
/* Adds d to the references the plan makes to pool block `id`. KVB_ERR_NOMEM. */
kvb_status kvb_acct_adj(kvb_acct *a, int32_t id, int d);
/* New blocks a RUN of q tokens of request i needs (a DROP's releases and restores keep the logical
 * count: the released leading blocks count as present, since a RUN never writes them). */
int64_t kvb_acct_run_need(const kvb_acct *a, int i, int q);
/* What admitting request i with at most q tokens costs: the tokens it computes (*q_eff) and the blocks
 * it takes (*blocks: idle prefix hits it references, host hits loaded into new blocks, blocks for the
 * new tokens, of which *n_new (may be NULL) new ones). With `take`, the hits count as referenced from now
 * on. */
kvb_status kvb_acct_admit_cost(kvb_acct *a, int i, int q, int take, int *q_eff, int64_t *blocks, int64_t *n_new);
/* 1 in *out when the next block waiting request i would compute (its first unmatched full prompt block)
 * is being computed now by a running request at the same place of the same chain, or by one the plan
 * admits before it: admitting i now would compute the same KV a second time. */
kvb_status kvb_acct_in_flight(kvb_acct *a, int i, int *out);
/* The prefix hits of waiting request i (kvb_view_ops.probe). */
kvb_status kvb_acct_hits(const kvb_acct *a, int i, kvb_view_hits *out);

/* Writes a plan's refusal (printf format) to err[len] (may be NULL) and returns KVB_ERR_INVALID. */
__attribute__((format(printf, 3, 4))) kvb_status kvb_plan_refuse(char *err, size_t len, const char *fmt, ...);
/* The same for operation k of a plan: "plan op K (KIND request ID): " and the sentence. */
__attribute__((format(printf, 5, 6))) kvb_status kvb_plan_refuse_op(char *err, size_t len, int k, const kvb_plan_op *op,
                                                                    const char *fmt, ...);

/* What admitting request v->reqs[req] now would reuse. */
typedef struct kvb_prefix_probe {
    int n_hit;            /* full prompt blocks found in the pool's prefix cache */
    int n_hit_idle;       /* of those, referenced by nobody after the plan's operations so far (admitting
                           * takes them out of what allocation can give) */
    int n_host_hit;       /* further blocks found in the host tier (each is loaded into a new pool block) */
    int deferred;         /* its next prompt block is being computed by a running request, or by one the
                           * plan admits before it: wait a step and reuse it */
} kvb_prefix_probe;

/* KVB_ERR_INVALID if req is not a waiting request of the view after p's operations. */
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

#endif
