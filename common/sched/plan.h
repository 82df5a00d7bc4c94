/* kvbank — the planner seam: what a planner sees (the view), what it decides (the plan), and the
 * interface it implements (kvb_planner_i).
 *
 *     planner.plan_step(view) ──> plan ──> executor (validate, apply) ──> stager (copies) + forward pass
 *                                   ^                                                  │
 *     planner.observe(report) <─────┴──────────── step / layer times, link bandwidths ─┘
 *
 * Policies only plan (ARCHITECTURE.md "the one abstraction"); one executor carries plans out. A plan
 * is plain data: request-level decisions (admit, run, preempt, swap, pause, resume, each with its
 * query length), residency given as exceptions to the default, and copy orders between tiers. A
 * planner never touches a block pointer: blocks are named by id.
 *
 * The view is rebuilt before every step and is valid only during the call that receives it (a solver
 * running on its own thread copies what it needs). The plan is owned by the engine; a planner fills it
 * through kvb_plan_* below and may keep its own plans (kvb_plan_copy) to hand over its latest one.
 *
 * Validation: the executor checks a whole plan before it changes anything. A plan naming an unknown
 * request, an operation the request's state does not allow, more blocks than the pool can give, a
 * query length over the budget, residency of a block nobody in the step reads, or a copy from a tier
 * the block is not in is refused with KVB_ERR_INVALID and a sentence (kvb_engine_last_error); the
 * step then changes nothing and the requests stay as they were. */
#ifndef KVB_SCHED_PLAN_H
#define KVB_SCHED_PLAN_H

#include <stddef.h>
#include <stdint.h>

#include "common/util/util.h"
#include "common/model/config.h"
#include "kernels/backend.h"

/* ------------------------------------------------------------------------------------------ view */

typedef enum kvb_req_state {
    KVB_REQ_WAITING = 0, /* queued; holds no KV (a preempted request is back here with n_computed 0) */
    KVB_REQ_RUNNING = 1, /* admitted; its KV is in its blocks */
    KVB_REQ_PAUSED = 2,  /* admitted, not scheduled, keeps its KV (OrbitFlow §3.4 Pause-Resume) */
    KVB_REQ_SWAPPED = 3, /* its KV is in the host tier, it holds no pool block (vLLM swap) */
} kvb_req_state;

const char *kvb_req_state_str(kvb_req_state s);

/* One live request as a planner sees it. */
typedef struct kvb_req_view {
    uint64_t id;
    uint64_t arrival;      /* admission order, smaller is older (a preempted request keeps its own) */
    uint64_t t_arrival_ns; /* wall-clock time kvb_engine_add accepted it */
    kvb_req_state state;
    int n_prompt;          /* prompt tokens as submitted */
    int n_tokens;          /* prompt + generated so far */
    int n_generated;
    int max_tokens;        /* most tokens it may generate in all */
    uint64_t tbt_slo_ns;   /* its time-between-tokens SLO as submitted (kvb_request.tbt_slo_ms); 0: none given */
    int n_computed;        /* tokens whose KV is in its blocks (0 while waiting) */
    int n_blocks;          /* blocks in its table (pool ids; SWAPPED: host-tier ids) */
    int n_exclusive;       /* of those, referenced by this request alone (preempting it frees them) */
    const int32_t *blocks; /* [n_blocks] its block ids in token order (borrowed, valid during the call);
                            * blocks[0] holds tokens from n_dropped * block_size on */
    int n_dropped;         /* leading blocks it has released (KVB_OP_DROP): their tokens' KV is absent and
                            * every RUN recomputes them (n_absent >= n_dropped * block_size) */
    int host_layers;       /* its released blocks have host-tier copies of layers [n_layers - host_layers,
                            * n_layers) (KVB_OP_DROP n_host; 0: none) */
    int n_overtaken;       /* WAITING: later requests admitted past it while it could not fit the pool as
                            * it is now (bounded by kvb_view.stall_overtake) */
    int hidden_layers;     /* HCache: leading layers whose input hidden states of all its computed tokens
                            * are saved in host memory (RUNNING: what a SWAP_OUT may leave as hidden
                            * states; SWAPPED: the layers it left so) */
    const int32_t *tokens; /* [n_tokens] its prompt and generated tokens (borrowed, valid during the call) */
    int n_cached;          /* RUNNING, PAUSED: its first full blocks offered to the prefix cache */
    uint64_t cache_hash;   /* the prefix cache's chained hash after those blocks */
} kvb_req_view;

/* What a planner may know about the model and the machine (cost models). */
typedef struct kvb_model_info {
    const kvb_model_config *cfg; /* the model's config.json */
    int64_t weight_bytes;        /* weight bytes a step reads (kvb_model_weight_bytes_per_token) */
    int act_elem;                /* bytes per activation element on the backend */
    double flops;                /* this machine's measured matmul rate (kvb_link_measure_flops), FLOP/s;
                                  * 0 when not measured */
} kvb_model_info;

/* Block counts of the KV pool and of the host tier. */
typedef struct kvb_pool_view {
    int capacity;      /* own blocks the process's KV memory holds (ids [0, capacity)) */
    int n_own;         /* own blocks in the pool now (a worker lends the rest) */
    int n_borrowed;    /* attached (borrowed) blocks, ids >= capacity */
    int n_blocks;      /* n_own + n_borrowed */
    int n_free;        /* blocks on the free list (sliced pool: blocks allocatable with every layer) */
    int n_slices;      /* sliced pool: (block, layer) slices of device memory; else 0 */
    int n_free_slices; /* sliced pool: of those, free */
    int n_free_ids;    /* sliced pool: block ids allocation can give (their slices come at the install) */
    int n_evictable;   /* cached prefix blocks nobody references (allocation evicts them, LRU first) */
    int stage_slots;   /* blocks a step may read through stage buffers (STREAM / HOST), two
                        * single-layer buffers each (double buffering: layer l+1 loads while l runs) */
    int host_capacity; /* host-tier blocks (0: no host tier) */
    int host_free;
    int host_evictable;
} kvb_pool_view;

struct kvb_acct;
struct kvb_plan;
struct kvb_plan_op;

/* What admitting a request would reuse (kvb_view_ops.probe). */
typedef struct kvb_view_hits {
    int n_hit;             /* full prompt blocks in the pool's prefix cache (at least one token left to compute) */
    const int32_t *ids;    /* [n_hit] their block ids (valid while the view is) */
    int n_host_hit;        /* further blocks in the host tier's prefix cache */
    uint64_t last_hash;    /* the chained hash after all of them */
} kvb_view_hits;

/* The engine's side of a view: queries over the state the view shows and the checks of the engine's
 * mechanisms, valid while the view is. They change nothing the view shows (the probe keeps what it
 * found), so the scheduler's routines (common/sched/check.h) may run on any thread while the engine
 * waits in plan_step. */
typedef struct kvb_view_ops {
    /* References to pool block `id` now (0: free, or cached and idle). */
    int (*block_ref)(void *ctx, int32_t id);
    /* 1 if pool block `id` is on the free list now. */
    int (*block_free)(void *ctx, int32_t id);
    /* What admitting waiting request `req` would reuse; computed on first use. KVB_ERR_NOMEM. */
    kvb_status (*probe)(void *ctx, int req, kvb_view_hits *out);
    /* The mechanisms' checks of the fields of operation k they own, after its generic checks, against the
     * accounting so far (which they may charge); of the plan's other parts once every operation is
     * accounted. KVB_ERR_INVALID with a sentence in err[len]. */
    kvb_status (*check_op)(void *ctx, struct kvb_acct *a, const struct kvb_plan_op *op, int k, char *err, size_t len);
    kvb_status (*check_plan)(void *ctx, struct kvb_acct *a, const struct kvb_plan *p, char *err, size_t len);
} kvb_view_ops;

typedef struct kvb_view {
    const kvb_kv_geom *geom;  /* block geometry */
    int max_batch_tokens;     /* the step budget: sum of q_len over the plan */
    int max_rows;             /* rows the forward pass can hold: sum of q_len + n_absent */
    int max_seqs;             /* most requests RUNNING or PAUSED at once */
    int max_model_len;
    int prefix_cache;         /* 1 if full blocks are shared through the prefix cache */
    int stall_overtake;       /* most later requests admitted past one that cannot fit the pool now (0: none) */
    uint64_t step;            /* steps run so far */
    uint64_t now_ns;          /* wall clock at the view's making */
    kvb_pool_view pool;
    /* Live requests: RUNNING and PAUSED ones in arrival order, then SWAPPED ones in arrival order, then
     * WAITING ones in arrival order (the queue): n_running + n_swapped + n_waiting = n_reqs. */
    int n_reqs;
    const kvb_req_view *reqs; /* [n_reqs] */
    int n_running;
    int n_swapped;
    int n_waiting;
    /* The model, for planners with a cost model (eLLM's, OrbitFlow's). */
    const kvb_model_info *model;
    /* The stager's link model (common/sched/stager.h; "off" when copies run at memory speed), for
     * planners that predict transfer times. */
    const struct kvb_link_model *links;
    /* kvb_view_find's index: an open-addressing table of request indices (-1: empty) by id. */
    const int32_t *index;
    uint32_t index_mask;      /* its size - 1 (a power of two) */
    /* The engine's side (NULL at SETUP, when no request exists). */
    const kvb_view_ops *ops;
    void *ops_ctx;
} kvb_view;

/* Index of request `id` in v->reqs, or -1. O(1). */
int kvb_view_find(const kvb_view *v, uint64_t id);
/* The slot where kvb_view_find starts looking for `id` (before masking). */
uint32_t kvb_view_hash(uint64_t id);

/* ------------------------------------------------------------------------------------------ plan */

typedef enum kvb_op_kind {
    KVB_OP_RUN = 1,      /* RUNNING: compute the next q_len tokens (decode token or prefill chunk) */
    KVB_OP_ADMIT = 2,    /* WAITING -> RUNNING: take its prefix-cache hits, then compute q_len tokens */
    KVB_OP_PREEMPT = 3,  /* RUNNING/PAUSED -> WAITING: drop its KV (published blocks stay cached), keep its
                          * tokens; it is prefilled again when admitted (vLLM recompute) */
    KVB_OP_SWAP_OUT = 4, /* RUNNING/PAUSED -> SWAPPED: its KV is copied to the host tier, its pool blocks
                          * are released (needs a host tier) */
    KVB_OP_SWAP_IN = 5,  /* SWAPPED -> RUNNING: its KV is copied back into pool blocks before layer 0;
                          * a RUN later in the plan may schedule it in the same step */
    KVB_OP_PAUSE = 6,    /* RUNNING -> PAUSED: not scheduled, keeps its KV */
    KVB_OP_RESUME = 7,   /* PAUSED -> RUNNING; a RUN later in the plan may schedule it */
    KVB_OP_DROP = 8,     /* RUNNING/PAUSED, before its RUN: the request keeps device KV from block n_dropped
                          * on (eLLM token-wise). More than now: blocks [now, n_dropped) are released
                          * (shared prefix blocks stay cached for others), and every later RUN must
                          * recompute them (n_absent >= n_dropped * block_size). Fewer than now: blocks
                          * [n_dropped, now) come back as new blocks, which this step's RUN of the request
                          * must fill (its n_absent >= now * block_size). Only full blocks:
                          * n_dropped * block_size <= n_computed */
} kvb_op_kind;

const char *kvb_op_kind_str(kvb_op_kind k);

/* One request-level decision. The executor applies them in plan order, so a PREEMPT placed before a
 * RUN frees blocks that RUN can use. RUN and ADMIT entries make the step's batch, in that order. */
typedef struct kvb_plan_op {
    kvb_op_kind kind;
    uint64_t id;   /* the request */
    int q_len;     /* RUN, ADMIT: new tokens computed this step (>= 1). ADMIT: at most this many after
                    * the prefix-cache hits (fewer if the prompt ends first) */
    int n_absent;  /* RUN: the KV of the request's oldest n_absent tokens is absent and recomputed in
                    * this step (eLLM token-wise): they are added as extra rows at positions
                    * 0..n_absent-1 whose KV goes to scratch blocks of the step, so every layer's
                    * attention sees them; they produce no logits. 0 <= n_absent <= n_computed */
    int n_dropped; /* DROP: the request's new count of released leading blocks */
    int n_host;    /* eLLM token-wise with swapped prefix layers (§4.3; needs a host tier). DROP: the blocks it
                    * releases keep host-tier copies of layers [L - n_host, L), stored over the host link
                    * before they are freed: when n_host > 0 and the request has no released block yet, and
                    * whatever n_host when its released blocks have copies (then of the layers those hold,
                    * kvb_req_view.host_layers): every released block has a copy or none has (a request
                    * whose first DROP had n_host 0 has none until all its blocks come back).
                    * RUN: layers [L - n_host, L) of the released blocks' tokens are read from those copies
                    * (loaded into scratch before their layer, two layers ahead) instead of recomputed, and
                    * the recomputed rows leave the forward pass after layer L - n_host - 1, so nothing of
                    * the upper layers is computed for them (rows n_absent covers beyond the released
                    * blocks read their own blocks there). At most the layers the copies hold are read
                    * (a larger n_host recomputes the rest); a step that restores blocks of the request
                    * recomputes every layer. 0 <= n_host <= n_layers */
    int n_hidden;  /* HCache (Gao et al., EuroSys '25). RUN, ADMIT: save the hidden states entering layers
                    * [0, n_hidden) of this step's new tokens to the request's host memory (over the host
                    * link). SWAP_OUT: layers [0, n_hidden) leave as those hidden states instead of KV
                    * (n_hidden <= the view's hidden_layers); SWAP_IN rebuilds their KV from them (the
                    * layer's norm, K/V projections and RoPE) and copies the other layers back */
    int placed;    /* RUN, ADMIT: 0 (default): new blocks come from the pool's free list; 1: the
                    * request's j-th block is block0 + j (its existing blocks must be laid out so, its
                    * new ones must be free): a planner that keeps each request's KV contiguous in an
                    * address range of its own (eLLM's KV slots). Needs the prefix cache off.
                    * SWAP_IN: the request's KV comes back into blocks block0 + j (free) */
    int32_t block0;
    int offload;   /* ADMIT: 1: the request's KV goes to the host tier as it is computed and never takes a
                    * pool block (eLLM's CPU buffer, ellm-elastic-memory.txt §4.3.2): each layer's K/V of
                    * its new tokens is written into a staging area of two single-layer slices per block
                    * (double-buffered, taken from the activation allocator) and stored over the host
                    * link to new host-tier blocks after the layer; after the step the request is
                    * SWAPPED (a SWAP_IN brings it back). Needs a host tier, the prefix cache off, not
                    * placed, and q_len covering the whole prompt */
} kvb_plan_op;

/* Where one block's KV is for a range of layers and how it reaches attention. The default needs no
 * entry: own blocks are LOCAL, attached (borrowed) blocks are plan.lent_default (LENT unless the
 * planner says STREAM). */
typedef enum kvb_residency {
    KVB_RES_LOCAL = 0,  /* read in place from the process's own pool */
    KVB_RES_LENT = 1,   /* borrowed block read in place through the imported region (zero copy) */
    KVB_RES_STREAM = 2, /* borrowed block read through a stage buffer: its layer slice is loaded before
                         * the layer and the rows the step wrote are stored back after it (SwiftCache
                         * §3.2-3.3 layer stream cache) */
    KVB_RES_HOST = 3,   /* read from the block's host copy (made by a STORE copy order): loaded into a
                         * stage buffer before the layer over the host link, rows the step writes
                         * stored back to it after the layer (OrbitFlow offload). The pool block keeps
                         * a valid copy too (block-major memory is not freed per layer) */
    KVB_RES_ABSENT = 4, /* not read at all: every scheduled request using the block recomputes its
                         * tokens (n_absent covers the block) */
} kvb_residency;

const char *kvb_residency_str(kvb_residency r);

/* An exception to the default residency: a physical block (a shared prefix block is one entry) over
 * layers [layer0, layer1). */
typedef struct kvb_plan_res {
    int32_t block;      /* pool block id */
    int layer0, layer1; /* 0 <= layer0 < layer1 <= n_layers */
    kvb_residency where;
} kvb_plan_res;

typedef enum kvb_copy_dir {
    KVB_COPY_LOAD = 1,  /* the block's host copy -> the pool block */
    KVB_COPY_STORE = 2, /* the pool block -> its host copy (made on the first STORE; dropped with the
                         * block's last reference) */
} kvb_copy_dir;

/* A copy of layers [layer0, layer1) of one pool block to or from its host copy in the host tier, run
 * by the stager over the host link while the step computes. A LOAD must be complete before layer
 * `layer` runs (0: before the step's first layer); a STORE may start once layer `layer` has run (-1:
 * at once, before layer 0); every copy is complete when the step ends. A LOAD needs a host copy that
 * holds those layers (stored, and not written in the pool since). */
typedef struct kvb_plan_copy {
    kvb_copy_dir dir;
    int32_t block;      /* pool block id */
    int layer0, layer1;
    int layer;
} kvb_plan_copy;

/* A request-level placement (OrbitFlow's x_{r,l}): layers [layer0, layer1) of every block request `id`
 * holds, those it gains in this step included, live in the host tier (KVB_RES_HOST) and are read
 * through prefetch slots. Needs a sliced pool (kvb_pool_plan.sliced_ids at SETUP). A RUNNING request
 * without entries keeps every layer on the device; the entries of one request must not overlap. A
 * block is kept on the device at a layer if any running (not paused) request holding it keeps that
 * layer, and is then counted once. Between steps the executor installs the difference to the state it
 * has: a layer leaving the device is stored to the host tier (only rows not there yet) and its slices
 * freed before any layer arriving is given slices and loaded; blocks of paused requests and cached
 * prefix blocks leave lazily, layer by layer, when their slices are needed (never dropped while
 * referenced). Each step a request with host layers gets `depth` prefetch slots of the slices its
 * largest host layer needs; it loads its next host layer as soon as a slot is free (at the start of the
 * step, then when the layer that used a slot has computed) and writes the new rows of a host layer back
 * to the host tier after that layer. */
typedef struct kvb_plan_place {
    uint64_t id;
    int layer0, layer1; /* 0 <= layer0 < layer1 <= n_layers */
    kvb_residency where;/* KVB_RES_HOST */
    int depth;          /* prefetch slots of the request, 1 or 2 (the same in all its entries) */
} kvb_plan_place;

typedef struct kvb_plan {
    kvb_plan_op *ops;        /* [n_ops] in the order the executor applies them */
    int n_ops, cap_ops;
    kvb_plan_place *places;  /* [n_places] request-level placements */
    int n_places, cap_places;
    kvb_plan_res *res;       /* [n_res] residency exceptions */
    int n_res, cap_res;
    kvb_plan_copy *copies;   /* [n_copies] copy orders */
    int n_copies, cap_copies;
    int batch_limit;            /* most RUN + ADMIT entries this step (0: max_seqs) */
    kvb_residency lent_default; /* LENT (0 means LENT) or STREAM: borrowed blocks without an exception */
    int prefix_serial;          /* ablations of eLLM §6.3 for RUNs with n_host, KVB_PLAN_SERIAL_* flags */
    /* Outcome the planner reports along with the plan (statistics and the worker's Alg. 1 signal). */
    int starved;                /* the queue's head waits for blocks the pool does not have now */
    int n_deferred;             /* admissions put off to reuse a prefix a running request computes */
} kvb_plan;

/* kvb_plan.prefix_serial: the ablations of eLLM §6.3. */
enum {
    KVB_PLAN_SERIAL_LOADS = 1 << 0, /* "without overlap": a layer's prefix loads start when the layer is due and
                                     * are waited for at once, instead of two layers ahead behind the compute */
    KVB_PLAN_SERIAL_GEMMS = 1 << 1, /* "without fusion": the recomputed rows' projections and MLP run as GEMMs
                                     * of their own after the new tokens', instead of in the same GEMMs */
};

/* Empties the plan for a new step (keeps its arrays; lent_default back to LENT). */
void kvb_plan_reset(kvb_plan *p);
/* Appends an entry, growing the array. KVB_ERR_NOMEM. */
kvb_status kvb_plan_push_op(kvb_plan *p, kvb_plan_op op);
kvb_status kvb_plan_push_res(kvb_plan *p, kvb_plan_res r);
kvb_status kvb_plan_push_copy(kvb_plan *p, kvb_plan_copy c);
kvb_status kvb_plan_push_place(kvb_plan *p, kvb_plan_place pl);
/* dst becomes a copy of src (dst's arrays grow as needed). KVB_ERR_NOMEM leaves dst reset. */
kvb_status kvb_plan_copy_from(kvb_plan *dst, const kvb_plan *src);
/* Frees the arrays (the struct itself is the caller's). NULL-safe. */
void kvb_plan_free(kvb_plan *p);

/* --------------------------------------------------------------------------------- pool planning */

typedef enum kvb_pool_event_kind {
    KVB_POOL_SETUP = 0,   /* once, in kvb_engine_create: size the resources the planner needs */
    KVB_POOL_TICK = 1,    /* between steps, periodically (worker: Alg. 1 SCALEDOWN) */
    KVB_POOL_REQUEST = 2, /* a request arrived: `tokens` = prompt + max_tokens (worker: SCALEUP) */
    KVB_POOL_ATTACH = 3,  /* `n_blocks` borrowed blocks were attached (master: LSC sizing) */
    KVB_POOL_DETACH = 4,  /* `n_blocks` borrowed blocks were detached */
    KVB_POOL_RETURNED = 5,/* `n_blocks` lent blocks came back unasked (worker: keep them a window) */
} kvb_pool_event_kind;

struct kvb_model;

typedef struct kvb_pool_event {
    kvb_pool_event_kind kind;
    double now_s;          /* monotonic seconds */
    struct kvb_model *model; /* SETUP: the model (borrowed; its config and backend) */
    int64_t tokens;        /* REQUEST */
    int n_blocks;          /* ATTACH, DETACH, RETURNED */
    /* Lending context the role knows (worker; 0 when unknown): */
    uint32_t meu_worker;   /* worker blocks per minimum elastic unit (SwiftCache Eq. 9) */
    uint32_t meu_master;   /* master blocks per unit */
    int64_t own_soon;      /* own blocks once returned ranges are grown back */
    int64_t lent;          /* blocks lent now */
    int64_t free_tail;     /* blocks at the top of the own range that could be given away now */
    int64_t live_max_tokens;/* prompt + max_tokens of the longest live request */
    int starved;           /* kvb_engine_starved */
} kvb_pool_event;

/* What plan_pool decides. Fields a given event does not concern are left as the engine set them. */
typedef struct kvb_pool_plan {
    /* SETUP (read once): */
    int host_tier_blocks;  /* blocks of host memory behind the pool (0: none) */
    int extra_rows;        /* forward-pass rows beyond max_batch_tokens (recomputed tokens) */
    int measure_flops;     /* measure this machine's matmul rate for view.model->flops (a few ms, once per
                            * process and backend) */
    void *kv_mem;          /* the planner's own memory for the KV pool, borrowed until the engine is
                            * destroyed (eLLM: the KV slots, one reservation whose chunks the planner maps
                            * on demand); NULL: the engine's (the options' kv_mem, else allocated) */
    size_t kv_mem_bytes;   /* its size */
    int kv_blocks;         /* blocks of it in the pool (with kv_mem) */
    int max_model_len;     /* > 0: longest request the planner can serve (kvb_engine_add refuses longer) */
    int max_batch_tokens;  /* > 0: the step budget the planner works with (eLLM computes whole prompts in one
                            * step); the forward pass holds that many rows */
    int no_prefix_cache;   /* 1: the prefix cache is off (a planner that places KV itself) */
    kvb_mem_allocator act_alloc; /* iface set: where the forward pass takes each step's buffers (eLLM's
                            * activation pool), borrowed for the engine's lifetime; it replaces the
                            * options' act_alloc */
    int lsc_own_blocks;    /* > 0: the stage buffers live in this many blocks' worth of the engine's KV
                            * memory (its top), which the pool does not get: SwiftCache's LSC inside the
                            * master's budget (Eq. 4-5); stage_slots can then never ask for more */
    int limit_borrowed;    /* 1: the planner refuses to attach more than max_borrowed blocks (the LSC within
                            * the budget streams no more); the node master tells the coordinator (issue 10) */
    int max_borrowed;
    /* SETUP, ATTACH, DETACH: */
    int stage_slots;       /* blocks a step may read through stage buffers (STREAM / HOST) */
    /* SETUP (read once): */
    int host_layered;      /* with host_prefix: a step's hits load layer by layer behind the compute (one
                            * transfer per layer, each layer waiting for its own) instead of all of them
                            * before the step (issue 10: the paper's baseline loads per layer) */
    int host_prefix;       /* with a host tier: cached blocks the pool evicts are copied there and prefix
                            * matches continue there (the host-tier prefix cache baseline) */
    int host_async_writeback; /* with host_prefix: the idle cached blocks the next step may evict are written
                            * back ahead, asynchronously (HiCache's write-through, LMCache's store), instead
                            * of copied when evicted, before the step's forward pass */
    /* SETUP (read once): a sliced pool (common/kv/block_pool.h) for request-level placements. */
    int sliced_ids;        /* > 0: the pool's memory is counted in (block, layer) slices and it has this
                            * many virtual block ids, each with a home in a host tier of as many blocks */
    int sliced_min_layers; /* slices per block the planner needs at least for any request (its most
                            * offloaded placement, prefetch slots included); kvb_engine_add refuses a
                            * request whose blocks times this exceed the device's slices (0: n_layers) */
    /* TICK, REQUEST, RETURNED (worker; the role rounds and caps them and runs the protocol): */
    int64_t lend;          /* own blocks to offer to the master */
    int64_t reclaim;       /* lent blocks to ask back */
    int64_t demand_tokens; /* the longest request the planner keeps room for (Alg. 1's window maximum) */
    char why[96];          /* a reason for the log */
} kvb_pool_plan;

/* ------------------------------------------------------------------------------------- observing */

typedef enum kvb_link_kind {
    KVB_LINK_HOST = 0,  /* device <-> host tier (PCIe) */
    KVB_LINK_PEER = 1,  /* device <-> another device's memory (NVLink / PCIe peer) */
    KVB_LINK_LOCAL = 2, /* device <-> device memory (same GPU: moves, stage buffers of lent-in-place) */
    KVB_LINK_COUNT = 3,
} kvb_link_kind;

const char *kvb_link_kind_str(kvb_link_kind k);

/* What one link carried during a step. */
typedef struct kvb_link_report {
    uint64_t bytes;
    uint64_t copies;
    uint64_t busy_ns;  /* time the link's copy thread spent copying (link model delays included; under
                        * device waits, kvb_stager_device_waits, the time issuing) */
    double gbps;       /* achieved: bytes / busy_ns (0 when idle) */
} kvb_link_report;

/* One step as measured, for planners that calibrate (OrbitFlow's EWMA, eLLM's cost model). */
typedef struct kvb_step_report {
    uint64_t step;
    uint64_t t_step_ns;        /* plan + execution + sampling */
    uint64_t t_plan_ns;        /* in plan_step */
    int n_layers;
    const uint64_t *t_layer_ns;/* [n_layers] wall time of each layer, waits for its loads included */
    const uint64_t *t_wait_ns; /* [n_layers] of which before the layer's kernels (the mechanisms' layer_in: waits for
                                * loads, saved inputs) */
    int n_seqs;                /* RUN + ADMIT entries */
    int n_tokens;              /* sum of q_len */
    int n_absent_rows;         /* sum of n_absent */
    int n_prefill_seqs;        /* scheduled requests that computed more than one token */
    int admits_dropped;        /* ADMITs that no longer fit when applied (a probed prefix hit was evicted
                                * by this step's earlier allocations); they stay waiting */
    kvb_link_report links[KVB_LINK_COUNT];
} kvb_step_report;

/* ---------------------------------------------------------------------------------- the planner */

/* A policy (common/policy). Every member but plan_step may be NULL. */
typedef struct kvb_planner_i {
    const char *name;
    /* Required. Fills `out` (already reset) for the next step from the view. Never blocks: a planner
     * with a solver runs it on its own thread and hands over its latest plan. An error fails the step
     * (nothing changes; kvb_engine_step returns it). */
    kvb_status (*plan_step)(void *ctx, const kvb_view *v, kvb_plan *out);
    /* Optional. Pool decisions for `ev` (see kvb_pool_event_kind); `out` comes filled with the current
     * values. Runs between steps on the engine's thread. */
    kvb_status (*plan_pool)(void *ctx, const kvb_pool_event *ev, const kvb_view *v, kvb_pool_plan *out);
    /* Optional. What the last step measured (valid during the call). */
    void (*observe)(void *ctx, const kvb_step_report *r);
    /* Optional. Frees ctx. */
    void (*destroy)(void *ctx);
} kvb_planner_i;

typedef struct kvb_planner {
    const kvb_planner_i *iface;
    void *ctx;
} kvb_planner;

/* Destroys a planner the caller still owns (NULL-safe; iface->destroy may be NULL). */
void kvb_planner_destroy(kvb_planner *p);

#endif
