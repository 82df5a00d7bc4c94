/* kvbank — the engine's state, shared by the files of common/sched (not a public interface):
 *   engine.c     the public API: create, destroy, requests, step, statistics
 *   scheduler.c  the queue (requests and their lists), the planner's view, plan accounting, FCFS
 *   executor.c   plan validation and application, per-layer block pointers, the forward pass, results
 *   stager.c     the copy thread (layer stream cache) between tiers
 *   host_tier.c  the host tier behind the prefix cache
 *   lending.c    shrink / grow (worker), attach / detach (master) */
#ifndef KVB_SCHED_STATE_H
#define KVB_SCHED_STATE_H

#include <pthread.h>

#include "common/kv/block_pool.h"
#include "common/kv/block_table.h"
#include "common/kv/prefix_cache.h"
#include "common/sched/engine.h"
#include "common/sched/mech.h"
#include "common/sched/scheduler.h"
#include "common/sched/stager.h"

#define KVB_MAX_LAYERS 256 /* layers a sliced pool's placements can name */

typedef struct kvb_slices kvb_slices; /* slices.c */

typedef struct kvb__seq {
    uint64_t id;
    uint64_t arrival;  /* admission order */
    uint64_t t_add_ns; /* wall clock at kvb_engine_add */
    int32_t *tokens;   /* [cap] prompt followed by generated tokens */
    int n_tokens;
    int cap;
    int n_prompt;
    int max_tokens;
    uint64_t slo_ns;   /* time-between-tokens SLO, 0: the planner's default */
    int n_generated;
    int32_t *stop;     /* [n_stop] */
    int n_stop;
    kvb_sampling samp;
    kvb_rng rng;
    kvb_block_table bt;
    int n_computed;    /* tokens whose KV is in the sequence's blocks */
    int n_published;   /* full blocks offered to the prefix cache */
    uint64_t last_hash;/* chained hash of block n_published-1 */
    int q_len;         /* tokens scheduled in the current step */
    int paused;        /* running but not scheduled (KVB_OP_PAUSE) */
    int hits_taken;    /* during a step: its admission took its prefix hits (2: all that matched) */
    int n_absent;      /* tokens recomputed in the current step (KVB_OP_RUN.n_absent) */
    int n_dropped;     /* leading blocks released (KVB_OP_DROP): bt.ids[j] is block n_dropped + j */
    int restore_hi;    /* during a step: blocks [n_dropped, restore_hi) came back by a DROP and are
                        * filled by this step's recompute (restore_hi <= n_dropped: none) */
    kvb_block_table pfx_bt; /* host-tier copies of its released blocks, pfx_bt.ids[j] of block j (KVB_OP_DROP
                        * n_host): layers [L - pfx_layers, L) of each; pfx_bt.n == n_dropped when it has them */
    int pfx_layers;    /* 0: no copies */
    int n_swapl;       /* during a step: layers [L - n_swapl, L) of its released blocks are read from pfx_bt and
                        * its recomputed rows leave the forward pass above layer L - n_swapl - 1 */
    int row0;          /* during a step: the batch row of its first new token */
    int scr0;          /* during a step: its first scratch slice (recomputed whole blocks) */
    int offload;       /* during a step: an ADMIT offload (its KV goes to host_bt through the staging area) */
    kvb_block_table host_bt; /* SWAPPED: its blocks in the host tier, in token order */
    int vidx;          /* index in the current view, -1 when not in it */
    uint64_t t_stall_ns; /* WAITING: wall clock since which it no longer fits the pool (0: it fits) */
    int n_overtaken;   /* WAITING: later requests admitted past it while it stalled */
    void *mx[KVB__MECH_COUNT]; /* each mechanism's state for this request (NULL: none; mech.h) */
    struct kvb__seq *prev, *next;
} kvb__seq;

typedef struct kvb__seq_list {
    kvb__seq *head, *tail;
    int n;
} kvb__seq_list;

/* One attached loan: a segment of the pool. */
typedef struct kvb__loan {
    uint64_t tag;      /* the caller's loan id */
    int32_t first;     /* first block id of the segment */
    int n;             /* blocks */
} kvb__loan;

/* A block whose layer slices pass through stage buffers in this step (STREAM: from its borrowed
 * memory over the peer link; HOST: from its host copy over the host link). */
typedef struct kvb__stage_unit {
    int32_t block;          /* pool id */
    kvb_residency kind;     /* KVB_RES_STREAM or KVB_RES_HOST */
    int buf;                /* its stage buffers: 2 * buf + (layer & 1) */
    unsigned char *src;     /* where its slices live (all layers): borrowed block or host-tier block */
    int dirty_lo, dirty_hi; /* rows [lo, hi) of the block this step writes; lo >= hi: none */
} kvb__stage_unit;

/* Per-step transfer lists of the stager, one run per (layer, load/store, link). */
typedef struct xfer_list {
    kvb_xfer *x;  /* [cap] */
    int n, cap;
} xfer_list;

/* What the scheduler's probe found for one request of the view (valid while the view is). */
typedef struct kvb__memo {
    int done;            /* probed in this view */
    int n_hit;           /* pool blocks */
    int hit_off;         /* their ids: e->memo_ids[hit_off .. hit_off + n_hit) */
    int n_host_hit;      /* host-tier blocks after them */
    uint64_t last_hash;  /* chained hash after all the hits (pool and host) */
} kvb__memo;

struct kvb_engine {
    kvb_model *m;
    kvb_engine_opts o;
    kvb_planner planner;
    kvb_engine_events ev;
    kvb_kv_geom geom;
    void *kv_mem;            /* pool memory */
    int kv_mem_owned;        /* allocated by the engine from the backend's kvb_mem */
    kvb_block_pool *pool;
    kvb_prefix_cache *pc;
    kvb_forward *fw;
    kvb_mem_allocator act_alloc; /* the planner's activation allocator (SETUP), iface NULL if none */
    int planner_kv;          /* the planner brought the KV memory (SETUP) */
    int max_borrowed;        /* >= 0: the planner attaches at most this many blocks (SETUP); -1: no limit */
    int max_rows;            /* rows the forward pass holds: max_batch_tokens + extra rows */
    kvb__seq_list waiting;        /* by arrival; preempted sequences go back in arrival order */
    kvb__seq_list running;        /* by arrival (paused ones included) */
    uint64_t next_arrival;
    kvb_engine_stats stats;
    kvb__mech mech[KVB__MECH_COUNT]; /* the executor's mechanisms (mech.h), iface NULL where not set up */
    /* per-step scratch */
    kvb__seq **sched;             /* [max_seqs] sequences of this step */
    int n_sched;
    int32_t *b_tokens;       /* [max_rows] */
    int32_t *b_pos;          /* [max_rows] */
    kvb_attn_seq *b_seqs;    /* [max_seqs] */
    int32_t *b_logit_rows;   /* [max_seqs] */
    void **blk_base;         /* [blk_cap] block base addresses of the step (all layers) */
    void **blk_layer;        /* [blk_cap] the same blocks' slices for the current layer */
    int blk_cap;
    int32_t *blk_id;         /* [blk_cap] the same blocks' ids */
    int32_t *blk_real;       /* [blk_cap] a scratch entry of a new-token sequence standing for one of its own
                              * (not released) blocks: that block's id, read in place from layer blk_rec on;
                              * else -1 */
    int16_t *blk_rec;        /* [blk_cap] */
    kvb__seq **pfx_ord;           /* [max_seqs] the step's recomputed prefixes in layout order */
    int *l_rows, *l_seqs;    /* [n_layers] rows and attention sequences computing each layer */
    int main_rows;           /* rows of the step's new tokens (the recomputed prefixes' come after) */
    int scr_par;             /* scratch slices per parity when the step reads prefix layers from the host tier
                              * (layer l uses parity l & 1), else 0 */
    uint64_t *t_pfx;         /* [n_layers] ticket of the prefix loads due before each layer (0: none) */
    float *logits;           /* [max_seqs][vocab] */
    float *sample_scratch;   /* [2*vocab] */
    char last_error[256];    /* why the last kvb_engine_add failed, or the last plan was refused */
    /* the planner's view and plan (scheduler.c, executor.c) */
    kvb_view view;
    kvb_req_view *vreqs;     /* [vcap] */
    kvb__seq **vseq;              /* [vcap] the sequence behind each view entry */
    int vcap;
    int32_t *vhash;          /* [vhash_cap] open-addressing map id -> view index, -1 empty */
    int vhash_cap;           /* power of two >= 2 * n_reqs */
    kvb__memo *memo;        /* [vcap] */
    int32_t *memo_ids;       /* hit ids of all probes of this view */
    int memo_n, memo_cap;
    int32_t *adj;            /* [adj_cap] per block id: refcount change the plan makes (accounting) */
    int adj_cap;
    int32_t *adj_touched;    /* ids with adj != 0, to reset */
    int adj_n, adj_touched_cap;
    kvb_req_state *astate;   /* [vcap] state of each request after the plan's operations so far */
    uint8_t *asched;         /* [vcap] 1 once the request has a RUN or ADMIT in the plan */
    int32_t *adrop;          /* [vcap] its released leading blocks after the plan's DROPs so far */
    kvb_plan plan;
    kvb_model_info model_info; /* what the view tells planners about the model (view.model) */
    uint64_t *t_layer;       /* [n_layers] this step's layer times */
    uint64_t *t_wait;        /* [n_layers] */
    uint64_t *t_copy;        /* [n_layers] ticket of the last LOAD copy order due before each layer */
    /* lending */
    kvb__loan *loans;             /* [n_loans] attached segments, in attach order */
    int n_loans;
    int loans_cap;
    int n_borrowed;          /* blocks of all loans */
    int starved;             /* the last schedule left the queue's head waiting for blocks */
    /* the stager and the step's residency (executor.c) */
    kvb_stager *stager;
    kvb__stage_unit *units;       /* [units_cap] this step's staged blocks */
    int n_units, units_cap;
    int32_t *unit_of;        /* [2][unit_of_cap] per block id: its STREAM / HOST unit in this step, -1 */
    int unit_of_cap;
    int32_t *res_first;      /* [res_first_cap] per block id: its first residency exception, -1 */
    int32_t *res_next;       /* [plan.n_res] the next exception of the same block, -1 */
    int res_first_cap, res_next_cap;
    xfer_list xl;            /* every transfer of the step (the stager borrows them until the drain) */
    void *scratch;           /* single-layer slices for recomputed (absent) tokens: [n_scratch][layer] */
    int n_scratch;
    /* ADMIT offload (eLLM's CPU buffer): this step's staging area, [2 parities][n_off][layer slice] from the
     * activation allocator (else backend memory kept across steps), and per step entry its staging
     * block (-1: none) */
    void *off_stage;
    size_t off_stage_bytes;  /* kept backend memory's size (0 when the activation allocator lends it) */
    int n_off;               /* staging blocks of this step */
    int32_t *blk_off;        /* [blk_cap] */
    int32_t *shadow;         /* [shadow_cap] per block id: its host-tier copy, -1 */
    uint8_t *shadow_ok;      /* [shadow_cap][n_layers] 1 where the host copy holds the layer */
    int shadow_cap;
    kvb__seq_list swapped;        /* by arrival: KV in the host tier (seq.host_bt) */
    void *ht_mem;            /* host tier: [host_tier_blocks][block_bytes] host memory, or NULL */
    kvb_block_pool *ht_pool; /* its blocks */
    kvb_slices *sl;          /* the layer-sliced KV manager when the pool is sliced, else NULL */
    int64_t *anew;           /* [vcap] per request: new blocks the plan being checked gives it */
    kvb_prefix_cache *ht_pc; /* its prefix cache: blocks keyed like the pool's */
    int host_prefix;         /* evicted cached blocks are demoted to the host tier, matches continue there */
    /* demotions while a plan is applied are batched: one transfer for all of them, posted (and waited
     * for) before the next host-link transfer and before the step's forward (kvb__host_flush) */
    int ht_batch;            /* 1 while apply_plan runs */
    kvb_xfer *ht_pend;       /* [n_ht_pend] pool block -> host block copies not posted yet */
    int n_ht_pend, cap_ht_pend;
    /* host_layered (issue 10; the paper's baseline): the step's host-tier hits load layer by layer behind
     * the compute: one transfer per layer for all of them, posted before the forward pass, each layer
     * waiting for its own (kvb__host_tier_post_loads); the pool and host blocks stay referenced until
     * every layer is in (kvb__host_tier_finish_loads). 0: each admission's hits in one transfer first. */
    int host_layered;
    int32_t *htl;            /* [2 n_htl]: host block, pool block of each pending hit */
    int n_htl, cap_htl;
    kvb_xfer *htl_x;         /* [n_layers * n_htl] the posted pieces (kept until the transfers are done) */
    uint64_t *t_htl;         /* [n_layers] tickets, 0: not posted */
    int htl_posted;
};

/* ---------------------------------------------------------------- scheduler.c */
void kvb__list_remove(kvb__seq_list *l, kvb__seq *s);
void kvb__list_insert_ordered(kvb__seq_list *l, kvb__seq *s);
kvb__seq *kvb__find_seq(const kvb__seq_list *l, uint64_t id);
void kvb__seq_free(kvb_engine *e, kvb__seq *s);
void kvb__seq_drop_kv(kvb_engine *e, kvb__seq *s);
/* Releases the host-tier copies of a sequence's released blocks (KVB_OP_DROP n_host). */
void kvb__prefix_copies_release(kvb_engine *e, kvb__seq *s);
/* Removes `s` from `l`, frees it and reports on_finish. */
void kvb__finish(kvb_engine *e, kvb__seq_list *l, kvb__seq *s, kvb_finish why, kvb_status err);
/* Preemption by recompute: releases the running sequence's blocks (published ones stay cached) and
 * puts it back in the queue in arrival order with its prompt plus the tokens it generated. */
void kvb__preempt_seq(kvb_engine *e, kvb__seq *victim);
/* Blocks `s` needs at most over its life (prompt + max_tokens). */
int64_t kvb__seq_need_blocks(const kvb_engine *e, const kvb__seq *s);
/* The body of kvb_engine_add. */
kvb_status kvb__sched_add(kvb_engine *e, const kvb_request *r);
/* Rebuilds e->view from the engine's state. KVB_ERR_NOMEM. */
kvb_status kvb__view_build(kvb_engine *e);
/* Checks e->plan against e->view; the sentence goes to e->last_error. */
kvb_status kvb__plan_check(kvb_engine *e, kvb_plan_cost *cost);
/* Calls the planner's plan_pool (if any) with a fresh view; `out` holds the current values. */
kvb_status kvb__plan_pool(kvb_engine *e, const kvb_pool_event *ev, kvb_pool_plan *out);
/* The probe results of request vidx (computed on first use). */
kvb_status kvb__probe_memo(kvb_engine *e, int vidx, const kvb__memo **out);
void kvb__sched_free(kvb_engine *e);

/* Writes a plan's refusal (printf format) to err[len] (may be NULL) and returns KVB_ERR_INVALID. */
__attribute__((format(printf, 3, 4))) kvb_status kvb__refuse(char *err, size_t len, const char *fmt, ...);

/* ---------------------------------------------------------------- executor.c */
kvb_status kvb__exec_step(kvb_engine *e);
void kvb__exec_free(kvb_engine *e);
/* Stage buffers for `slots` staged blocks (2 single-layer buffers each). */
kvb_status kvb__stage_reserve(kvb_engine *e, int slots);
/* Drops the host copy of block `id` if it has one (its last reference is going). */
void kvb__shadow_drop(kvb_engine *e, int32_t id);

/* ---------------------------------------------------------------- hcache.c */
kvb_status kvb__hcache_init(kvb_engine *e);
/* SWAP_OUT: layers [0, n_hidden) of s leave as its saved hidden states; returns how many do. */
int kvb__hcache_swap_out(kvb_engine *e, kvb__seq *s, int n_hidden);
/* SWAPPED: the layers s left as hidden states. */
int kvb__hcache_swapped_layers(const kvb__seq *s);
/* SWAP_IN: rebuilds the K and V of the layers s left as hidden states into its (new) blocks. */
kvb_status kvb__hcache_restore(kvb_engine *e, kvb__seq *s);

/* ---------------------------------------------------------------- mechanisms, for the files that own requests */
/* Each mechanism's seq_release for s. */
static inline void kvb__mechs_seq_release(kvb_engine *e, kvb__seq *s, kvb__release why) {
    for (int k = 0; k < KVB__MECH_COUNT; k++) {
        const kvb__mech *m = &e->mech[k];
        if (m->iface && m->iface->seq_release) m->iface->seq_release(m->ctx, e, s, why);
    }
}

/* Each mechanism's view_req for s. */
static inline void kvb__mechs_view_req(const kvb_engine *e, const kvb__seq *s, kvb_req_view *r) {
    for (int k = 0; k < KVB__MECH_COUNT; k++) {
        const kvb__mech *m = &e->mech[k];
        if (m->iface && m->iface->view_req) m->iface->view_req(m->ctx, e, s, r);
    }
}

/* ---------------------------------------------------------------- slices.c (sliced pools) */
/* Sets up the manager for a sliced pool of n_ids ids (host homes included); min_layers: see
 * kvb_pool_plan.sliced_min_layers. */
kvb_status kvb__slices_init(kvb_engine *e, int n_ids, int min_layers);
void kvb__slices_free(kvb_engine *e);
int kvb__slices_min_layers(const kvb_engine *e);
/* Reads the plan's placements (refusing bad ones; any placement without a sliced pool) and, for a
 * sliced pool, checks the device slices the plan needs: astate / asched / anew per view index are the
 * accounting's state after the operations (anew: new blocks each request gets). */
kvb_status kvb__slices_check(kvb_engine *e, const kvb_view *v, const kvb_plan *p, const kvb_req_state *astate,
                             const uint8_t *asched, const int64_t *anew, char *err, size_t len);
/* A new block id for a sequence (no slice yet; its layers get slices at the install). */
kvb_status kvb__slices_new_block(kvb_engine *e, int32_t *out);
/* After the plan's operations: installs the placements and the step's prefetch slots. */
kvb_status kvb__slices_install(kvb_engine *e, int n_sched);
kvb_status kvb__slices_step_begin(kvb_engine *e, int n_blk);
/* Fills e->blk_layer for layer l (prefetching host layers) / stores the rows written into host layers. */
kvb_status kvb__slices_layer(kvb_engine *e, int n_sched, int l);
kvb_status kvb__slices_layer_done(kvb_engine *e, int n_sched, int l);
void kvb__slices_step_end(kvb_engine *e, int n_sched);

/* ---------------------------------------------------------------- host_tier.c */
/* Creates the host tier of `blocks` blocks; `prefix`: demote evicted cached blocks into it. */
kvb_status kvb__host_tier_init(kvb_engine *e, int blocks, int prefix, int layered);
/* host_layered: posts the pending hits' loads, one transfer per layer (after the pending demotions) */
kvb_status kvb__host_tier_post_loads(kvb_engine *e);
/* Posts what is not posted yet, waits for every layer, releases the blocks: no load runs on after it. */
kvb_status kvb__host_tier_finish_loads(kvb_engine *e);
void kvb__host_tier_free(kvb_engine *e);
/* Continues the prefix match of `s` in the host tier, loading each hit into a new pool block. Returns
 * the blocks loaded. */
int kvb__host_tier_load(kvb_engine *e, kvb__seq *s, int max_blocks);
/* A host-tier block for writing (free, or the least recently used cached one). KVB_ERR_EXHAUSTED. */
kvb_status kvb__host_alloc(kvb_engine *e, int32_t *out);
/* Posts the batched demotions (one transfer) and waits for them; a no-op when none are pending. Called
 * before anything else goes over the host link and before the pool's blocks are written. */
kvb_status kvb__host_flush(kvb_engine *e);
/* Copies `bytes` between the pool and the host tier over the host link and waits (dir D2H or H2D). */
kvb_status kvb__host_copy(kvb_engine *e, kvb_xfer_dir dir, void *dst, const void *src, size_t bytes);
/* How many blocks after `parent` the host tier holds for tokens[0..max_blocks*bs), without loading. */
int kvb__host_tier_peek(const kvb_engine *e, uint64_t parent, const int32_t *tokens, int max_blocks,
                        uint64_t *last_hash);

#endif
