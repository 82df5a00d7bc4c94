/* kvbank — one model's engine: requests, continuous batching, sampling, and the step executor.
 *
 * Every step the planner (common/sched/plan.h; the policies live in common/policy) plans from a view
 * of the engine: which requests run with how many tokens, which are admitted, preempted, paused or
 * swapped, where each block's KV is read from. The executor checks the plan, carries it out and runs
 * the layer-stepped forward pass; one token is sampled for each sequence whose prompt is done. The
 * `recompute` planner (kvb_policy_recompute) schedules as vLLM does (common/policy/fcfs.h): FCFS,
 * chunked prefill, prefix caching, preemption of the newest request by recompute (its blocks are freed
 * and it re-enters the queue with its prompt plus the tokens it already generated).
 *
 * Lossless: greedy sampling gives the same tokens whatever the batch composition, block size,
 * preemption or prefix-cache hits (KV is exact, and recompute reproduces it). */
#ifndef KVB_SCHED_ENGINE_H
#define KVB_SCHED_ENGINE_H

#include <stdint.h>

#include "common/model/model.h"
#include "common/sched/plan.h"
#include "common/text/grammar.h"
#include "common/sched/sampling.h"
#include "common/sched/stager.h"

typedef struct kvb_engine kvb_engine;

typedef enum kvb_finish {
    KVB_FINISH_NONE = 0,      /* still running */
    KVB_FINISH_LENGTH = 1,    /* max_tokens generated */
    KVB_FINISH_STOP = 2,      /* a stop token was generated (it is emitted) */
    KVB_FINISH_CANCELLED = 3, /* kvb_engine_cancel */
    KVB_FINISH_ERROR = 4,     /* could not be served (see the status) */
} kvb_finish;

const char *kvb_finish_str(kvb_finish f);

typedef struct kvb_engine_opts {
    int block_size;          /* tokens per KV block (default 16) */
    int n_blocks;            /* KV blocks in the pool */
    int max_batch_tokens;    /* token budget of one step (default 512) */
    int max_seqs;            /* most running sequences (default 64) */
    int max_model_len;       /* longest sequence (default: the model's max_pos) */
    int enable_prefix_cache; /* reuse full blocks across requests */
    void *kv_mem;            /* memory of the backend's kvb_mem for the pool (e.g. an exportable region's
                              * base); NULL: the engine allocates it (kvb_mem_alloc) */
    size_t kv_mem_bytes;     /* its size; kv_mem_bytes / block bytes is the capacity (>= n_blocks) */
    kvb_link_model links;    /* the stager's link model (common/sched/stager.h); all zero: off, copies at
                              * memory speed. What the planner asks for through plan_pool (host tier,
                              * stage buffers, forward rows) is not an option: planners own it. */
    const kvb_mem_allocator *act_alloc; /* where the forward pass takes each step's buffers, sized by
                              * that step's tokens (borrowed for the engine's lifetime); NULL: a step
                              * arena of the backend's memory (kvb_mem_arena) */
    int borrows;             /* 1: a master: loans come and go (a restart, a drain, a reclaim), so a request
                              * that its own memory plus the loans attached now cannot hold waits for more
                              * (stalled, below); only max_model_len and the planner's cap on borrowing
                              * (kvb_engine_max_borrowed) refuse it. 0 (default): capacity plus what is
                              * attached now is all the memory it will have. */
    /* A waiting request that does not fit the pool as it is now (it was admitted on borrowed blocks that
     * went back, own blocks a worker lent, or a master has not borrowed yet) is *stalled* (issue 10): */
    double stall_wait_s;     /* it fails with KVB_ERR_BUSY (FINISH_ERROR) after stalling this long
                              * (default 60; <= 0: it waits for blocks forever) */
    int stall_overtake;      /* later requests the FCFS scheduler admits past it while it stalls (bounded
                              * overtaking; default 64; <= 0: none, strict FCFS) */
} kvb_engine_opts;

void kvb_engine_opts_default(kvb_engine_opts *o);

/* Callbacks for what a step produced. Called from kvb_engine_step, in order of generation. */
typedef struct kvb_engine_events {
    void *ud;
    /* Token `index` (0-based) of request `id`, sampled at wall-clock time t_ns. */
    void (*on_token)(void *ud, uint64_t id, int index, int32_t token, uint64_t t_ns);
    /* The request ended; no further events for `id`. err is KVB_OK unless reason is ERROR. */
    void (*on_finish)(void *ud, uint64_t id, kvb_finish reason, kvb_status err);
    /* Optional: the logits [vocab] from which token `index` was sampled, before any processor changed
     * them (valid during the call). */
    void (*on_logits)(void *ud, uint64_t id, int index, const float *logits, int vocab);
    /* Optional, for requests with sampling.logprobs: token `index`'s logprob and the top_n most likely
     * tokens with theirs (top_ids / top_lp [top_n], most likely first), just before its on_token. */
    void (*on_logprobs)(void *ud, uint64_t id, int index, float lp, const int32_t *top_ids, const float *top_lp,
                        int top_n);
    /* Optional, for requests with sampling.prompt_logprobs: prompt positions pos0 .. pos0 + n - 1 (pos0 >= 1,
     * in order, each once): lp [n], top_ids / top_lp [n][top_n]; all of them come before the first
     * token. */
    void (*on_prompt_logprobs)(void *ud, uint64_t id, int pos0, int n, const float *lp, const int32_t *top_ids,
                               const float *top_lp, int top_n);
} kvb_engine_events;

typedef struct kvb_request {
    uint64_t id;            /* unique among the engine's live requests */
    const int32_t *prompt;  /* [n_prompt], copied */
    int n_prompt;
    int max_tokens;         /* >= 1 */
    const int32_t *stop_ids;/* [n_stop], copied */
    int n_stop;
    kvb_sampling sampling;
    int resume_index;       /* >= 0: the request continues one that already produced this many tokens
                             * (the last resume_index prompt ids are those tokens, e.g. after its
                             * server died): seeded sampling starts after their draws */
    double tbt_slo_ms;      /* >= 0: its time-between-tokens SLO (OrbitFlow's planner and Token-Deposit);
                             * 0: the planner's default for the model */
    /* Structured output (docs/grammar.md). What a client sends (kvb_client_*): the grammar's parts
     * (borrowed during the call) and KVB_GRAMMAR_REQ_* flags, which the model server compiles into a
     * matcher. The engine reads only `matcher`. */
    const kvb_grammar_part *grammar; /* [n_grammar] */
    int n_grammar;
    unsigned grammar_flags;
    /* Every step masks the request's logits to the tokens the matcher allows (before any other
     * sampling stage), advances it by the sampled token and finishes the request with STOP once it is
     * done. kvb_engine_add takes it on success (destroyed with the request); on failure the caller
     * keeps it. NULL: unconstrained. */
    kvb_grammar_matcher *matcher;
} kvb_request;

/* kvb_request.grammar_flags */
#define KVB_GRAMMAR_REQ_LAX 1u     /* schema objects without additionalProperties allow other keys (strict 0) */
#define KVB_GRAMMAR_REQ_COMPACT 2u /* no whitespace between JSON tokens (ws_indent -1) */

/* Creates an engine over `m` (borrowed) that `planner` plans (required: KVB_ERR_INVALID without one).
 * The engine takes the planner in every case: on success destroying the engine destroys it, on
 * failure it is destroyed before kvb_engine_create returns. The caller never destroys it after the
 * call. */
kvb_status kvb_engine_create(kvb_model *m, const kvb_engine_opts *opts, const kvb_planner *planner,
                             const kvb_engine_events *ev, kvb_engine **out);
/* Destroys the engine; live requests are dropped without events. NULL-safe. */
void kvb_engine_destroy(kvb_engine *e);

/* Queues a request. KVB_ERR_INVALID (logged, nothing queued) for an empty prompt, a token id out of
 * range, a duplicate id, max_tokens < 1, or a sequence that could never fit (max_model_len, or memory
 * the engine can never have: opts.borrows); kvb_engine_last_error then says which. One that fits but
 * not the pool as it is now is queued and stalls (opts.stall_wait_s). */
kvb_status kvb_engine_add(kvb_engine *e, const kvb_request *r);
/* Why the last kvb_engine_add failed (a sentence naming the field), or why the last plan was refused;
 * owned by the engine. */
const char *kvb_engine_last_error(const kvb_engine *e);
/* The name of the engine's planner ("fcfs" without one). */
const char *kvb_engine_planner_name(const kvb_engine *e);
/* The model the engine serves (borrowed). */
kvb_model *kvb_engine_model(const kvb_engine *e);
/* The link model its stager charges (a scaled preset calibrated; borrowed). */
const kvb_link_model *kvb_engine_links(const kvb_engine *e);
/* Cancels a queued or running request: on_finish(CANCELLED) is called at once. KVB_ERR_NOT_FOUND if
 * the id is unknown. Not to be called from inside an event callback (the engine is mid-step there):
 * defer it until kvb_engine_step returns. */
kvb_status kvb_engine_cancel(kvb_engine *e, uint64_t id);
/* Runs one iteration. KVB_ERR_INVALID when the planner's plan was refused (kvb_engine_last_error says
 * why; nothing changed, the requests stay live), the planner's own error when plan_step failed (nothing
 * changed), KVB_ERR_NOMEM for the view (nothing changed); any other error is a backend failure, after
 * which every live request is finished with ERROR. A step with nothing to do returns KVB_OK at once. */
kvb_status kvb_engine_step(kvb_engine *e);
/* Requests queued or running. */
int kvb_engine_n_live(const kvb_engine *e);

typedef struct kvb_engine_stats {
    uint64_t steps;
    uint64_t prompt_tokens;     /* tokens prefilled (recomputed ones included) */
    uint64_t generated_tokens;
    uint64_t preemptions;
    uint64_t pauses;            /* PAUSE operations carried out (OrbitFlow's Pause-Resume) */
    uint64_t prefix_hit_tokens; /* prompt tokens served from the prefix cache (host tier included) */
    uint64_t host_tier_stores;  /* blocks copied pool -> host tier (prefix demotion) */
    uint64_t host_tier_stores_ahead; /* of which written back asynchronously before the pool evicted them */
    uint64_t host_tier_wb_waits;/* evictions that waited for their block's write-back to land */
    int host_tier_wb_in_flight; /* blocks whose write-back is in flight now */
    uint64_t host_tier_loads;   /* blocks copied host tier -> pool on a prefix hit */
    uint64_t swap_outs;         /* requests swapped out to the host tier (KVB_OP_SWAP_OUT) */
    uint64_t swap_ins;
    uint64_t offload_prefills;  /* requests prefilled with their KV streamed to the host tier (ADMIT offload) */
    uint64_t recomputed_tokens; /* absent tokens recomputed (sum of n_absent) */
    uint64_t dropped_blocks;    /* leading blocks requests released (KVB_OP_DROP) */
    uint64_t restored_blocks;   /* released blocks given back and refilled by recompute (KVB_OP_DROP) */
    uint64_t prefix_host_stores;/* released blocks whose upper layers were stored to the host tier (DROP n_host) */
    uint64_t prefix_host_loads; /* (released block, layer) slices loaded from the host tier instead of recomputed */
    uint64_t recomputed_row_layers; /* recomputed rows the forward pass computed, summed over layers (below
                                 * recomputed_tokens x n_layers when prefix layers come from the host tier) */
    uint64_t hidden_restores;   /* swap-ins whose first layers were rebuilt from saved hidden states (HCache) */
    uint64_t hidden_saved_bytes;/* hidden states saved to host memory (HCache) */
    uint64_t copy_orders;       /* plan copy orders carried out */
    uint64_t deferred;          /* admissions put off because a running sequence was computing the
                                 * same prefix block (it is reused a step later instead) */
    int blocks_total;
    int blocks_free;            /* free + evictable cached */
    int n_running;
    int n_waiting;
    int n_stalled;              /* of which need more blocks than the pool holds now (they wait for
                                 * blocks, not for a turn: the model server does not count them as queued) */
    int blocks_own;             /* own blocks in the pool (n_own) */
    int blocks_borrowed;        /* attached blocks (all tags) */
    uint64_t lsc_loads;         /* staged reads: block-layer slices loaded into stage buffers (STREAM, HOST) */
    uint64_t lsc_stores;        /* staged writes: block-layer slices whose new rows were stored back */
    uint64_t layer_in_host_waits;   /* transfers the mechanisms' layer_in waited for on the host */
    uint64_t layer_in_device_waits; /* transfers layer_in ordered the layer's kernels after on the device
                                 * (kvb_stager_wait_device; the host waited only until they were issued) */
    int n_swapped;
    kvb_link_report links[KVB_LINK_COUNT]; /* what the stager's links carried since creation */
    int prefix_cache;           /* 1 if the prefix cache is on (a planner may turn it off at setup) */
    int max_running;            /* most requests running (or paused) at once after a step */
    uint64_t stalled_failed;    /* waiting requests failed after stall_wait_s without fitting the pool */
    int stage_slots;            /* blocks a step may stream now (two single-layer stage buffers each) */
} kvb_engine_stats;
void kvb_engine_get_stats(const kvb_engine *e, kvb_engine_stats *out);
/* The statistics as one line of `key=value` words, starting with `policy=NAME` (kvbank-generate --stats,
 * and what kvbank-serve and the node's model processes log when they stop); truncated to `len`. */
void kvb_engine_stats_format(const kvb_engine *e, char *buf, size_t len);

/* The layer-sliced KV manager (request-level placements on a sliced pool, plan.h kvb_plan_place). */
typedef struct kvb_slices_stats {
    uint64_t slices_offloaded;    /* (block, layer) slices moved device -> host tier when a placement changed */
    uint64_t slices_onloaded;     /* moved host tier -> device when a placement changed */
    uint64_t slices_prefetched;   /* loaded into prefetch slots for a step */
    uint64_t bytes_loaded;        /* host tier -> device, all of the above */
    uint64_t bytes_stored;        /* device -> host tier (moves and the rows steps wrote into host layers) */
    uint64_t paused_layers_moved; /* layers of paused requests moved to make room (each: all its blocks) */
    uint64_t cached_dropped;      /* unreferenced cached prefix blocks dropped to make room */
    int peak_used;                /* most slices in use right after an install (kept + prefetch slots) */
    uint64_t install_ns;          /* time installing placements (moves, prefetch slots) */
    uint64_t layer_ns;            /* time preparing layers (prefetch copies and waits, host-layer stores) */
} kvb_slices_stats;
/* Zero unless the pool is sliced. */
void kvb_engine_slices_stats(const kvb_engine *e, kvb_slices_stats *out);

/* Runs plan_pool of `pl` (NULL: the engine's own planner) for `ev` with a fresh view of the engine;
 * `out` comes filled with the current stage slots (zeros otherwise). KVB_ERR_UNSUPPORTED when that planner
 * has no plan_pool. Between steps only. A worker's lending runs through here (SwiftCache Alg. 1). */
kvb_status kvb_engine_plan_pool(kvb_engine *e, const kvb_planner *pl, const kvb_pool_event *ev, kvb_pool_plan *out);

/* The engine's block pool (for lending and for tests). */
struct kvb_block_pool *kvb_engine_pool(kvb_engine *e);

/* ---------------------------------------------------------------- lending (SwiftCache §3.4-3.5)
 * The engine's own blocks are ids [0, n_own) of its KV memory (capacity blocks in all). A worker
 * lends the tail of that range: it shrinks n_own and the blocks [n_own, old n_own) become a loan; a
 * master attaches borrowed memory as extra blocks that it allocates from like its own (lowest id
 * first, so its own blocks fill first) and attends to in place (or, as its planner says, through
 * stage buffers: residency STREAM). Attached blocks have ids >= capacity (common/kv/block_pool.h, id layout), so a
 * process may both lend its tail and attach loans. Every call is O(blocks touched) and never copies
 * a block except where the comment says so. None of these may be called from inside an event
 * callback or while a step runs (they are the fence: no step is in flight between steps).
 *
 * Admission: kvb_engine_add rejects a request only when it could never fit: capacity + borrowed
 * blocks, or for an engine that borrows (opts.borrows) capacity + the planner's cap on borrowing (no
 * bound without one). A waiting request that needs more blocks than the pool holds now (n_own +
 * borrowed, e.g. after lending, a detach, or before a restarted master borrows again) stays queued
 * at the head (FCFS) and kvb_engine_starved reports it; it is admitted once grow/attach gives the
 * blocks, or fails with KVB_ERR_BUSY after opts.stall_wait_s. */

/* 1 when the planner brought the KV memory itself (plan_pool SETUP: eLLM's slots): the engine's blocks are
 * not in the memory the caller gave (opts.kv_mem, e.g. an exportable region), so the model neither
 * lends nor borrows. */
int kvb_engine_planner_owns_kv(const kvb_engine *e);

/* Worker: blocks currently owned, and the most the memory holds. */
int kvb_engine_n_own(const kvb_engine *e);
int kvb_engine_capacity(const kvb_engine *e);
/* Worker: how many blocks at the top of [0, n_own) could be given away now (free, or cached and
 * unreferenced). */
int kvb_engine_free_tail(const kvb_engine *e);
/* Worker: gives up own blocks [n_own_new, n_own): drops cached entries there and shrinks the pool.
 * KVB_ERR_STATE (nothing changed) if one of them is referenced. */
kvb_status kvb_engine_shrink(kvb_engine *e, int n_own_new);
/* Worker: takes blocks back up to n_own_new (n_own <= n_own_new <= capacity, else KVB_ERR_INVALID);
 * they start free. */
kvb_status kvb_engine_grow(kvb_engine *e, int n_own_new);
/* Worker: tokens the live requests need at most (prompt + max_tokens of the longest one, waiting or
 * running): the request_len of Alg. 1 SCALEUP. */
int64_t kvb_engine_max_request_tokens(const kvb_engine *e);
/* Requests wait because the pool is short (a worker should reclaim): the head of the queue needs
 * more blocks than the pool holds now, or the last step could not give it blocks. Cleared by grow and
 * attach (the next step decides again). */
int kvb_engine_starved(const kvb_engine *e);

/* Master: adds `n_blocks` blocks at `mem` (memory of `bytes` >= n_blocks * block_bytes, borrowed:
 * the caller keeps it mapped until the detach returns) under the caller's `tag` (a loan id).
 * KVB_ERR_INVALID for a bad argument or a tag already attached; KVB_ERR_NOMEM (nothing attached) if
 * the stage buffers the planner asks for on attach (plan_pool ATTACH) cannot be allocated. */
kvb_status kvb_engine_attach(kvb_engine *e, uint64_t tag, void *mem, size_t bytes, int n_blocks);

typedef struct kvb_detach_stats {
    int moved;     /* live blocks copied to other blocks (KV moved, sequences keep running) */
    int dropped;   /* unreferenced prefix-cache blocks dropped */
    int preempted; /* sequences preempted by recompute (no free block to move to, or lender_dead) */
    int kept;      /* unreferenced prefix-cache blocks copied into free blocks outside the range (issue 10) */
    int demoted;   /* unreferenced prefix-cache blocks stored into the host tier's prefix cache */
} kvb_detach_stats;

/* Master: stops using the blocks attached under `tag` and forgets them: live blocks are copied to
 * free blocks elsewhere (their sequences keep running), or their sequences are preempted by recompute
 * when no block is free; cached blocks there are dropped. `lender_dead`: the memory is gone, read
 * nothing from it (every sequence that used it is preempted). After this returns no step touches the
 * memory. KVB_ERR_NOT_FOUND for an unknown tag, KVB_ERR_NOMEM (nothing changed) for scratch memory.
 *
 * Details: a block shared by several sequences (prefix cache) is copied once (all layers, with the
 * backend's `copy`) and every block table that references it is updated; its prefix-cache entry moves
 * with it to the new id, so later turns still hit. Sequences are handled oldest first; when no block
 * outside the range is free or evictable, the newest sequence still on the range is preempted (its
 * own blocks free up room for the older ones). `out` may be NULL. */
kvb_status kvb_engine_detach(kvb_engine *e, uint64_t tag, int lender_dead, kvb_detach_stats *out);
/* Master, partial reclaim (issue 10): detaches only the first `n_blocks` (1..the loan's size) blocks of
 * the loan `tag` as above; the loan keeps the rest, same tag. Idle cached blocks of the range are kept
 * where room allows, most recently used first: copied into free blocks outside the range (as many as
 * stay free once the range's live blocks moved) or, with a host-tier prefix cache, demoted there; the
 * rest are dropped (the stats count each). Also done by kvb_engine_detach, unless lender_dead.
 * KVB_ERR_INVALID for a bad count (nothing changed). */
kvb_status kvb_engine_detach_front(kvb_engine *e, uint64_t tag, int n_blocks, int lender_dead, kvb_detach_stats *out);
/* Master: blocks attached now (all tags). */
int kvb_engine_n_borrowed(const kvb_engine *e);
/* Master: the most blocks the planner lets it attach (SwiftCache's LSC within the budget streams no
 * more, issue 10), or -1 when there is no limit. */
int kvb_engine_max_borrowed(const kvb_engine *e);
/* Master: the loans attached now: writes up to `max` tags and their block counts (either array may be
 * NULL) in attach order and returns how many loans there are. */
int kvb_engine_loans(const kvb_engine *e, uint64_t *tags, int *n_blocks, int max);

#endif
