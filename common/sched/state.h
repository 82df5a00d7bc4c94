/* kvbank — the engine's state, shared by the files of common/sched (not a public interface). By job:
 *   engine.c     the public API: create, destroy, requests, step, statistics
 *   lending.c    shrink / grow (worker), attach / detach (master)
 *   executor.c   plan making, the generic apply of a plan, the layer loop over the mechanisms, sampling
 *   layout.c     the step's batch: attention entries, recomputed prefixes over scratch slices
 *   step.c       the step's memory
 *   view.c       the planner's view and its functions (probe, the mechanisms' checks)
 *   check.c      the plan check's generic accounting (check.h, also for planners)
 *   queue.c      requests and their lists, release, preemption, end
 *   constrain.c  structured output: the grammar mask on a request's logits, the matcher's advance
 *   host_tier.c  the host tier behind the pool (and its layered loads), swap.c the swaps over it
 *   mechanisms (mech.h): slices.c, prefix.c, offload.c, residency.c, hcache.c
 *   stager.c     the copy threads between tiers and the link model
 * Calls go down that list (engine.c and lending.c call the rest; the mechanisms call queue.c, layout.c,
 * host_tier.c); what calls up goes through kvb__mech_i or kvb_view_ops. */
#ifndef KVB_SCHED_STATE_H
#define KVB_SCHED_STATE_H

#include <pthread.h>

#include "common/kv/block_pool.h"
#include "common/kv/block_table.h"
#include "common/kv/prefix_cache.h"
#include "common/sched/engine.h"
#include "common/sched/mech.h"
#include "common/sched/check.h"
#include "common/sched/stager.h"

#define KVB_MAX_LAYERS 256 /* layers a sliced pool's placements can name */

typedef struct kvb__slices kvb__slices; /* slices.c */

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
    kvb_sampling samp; /* samp.logit_bias points to `bias` */
    kvb_logit_bias *bias; /* [samp.n_logit_bias] owned */
    kvb_rng rng;
    kvb_grammar_matcher *matcher; /* structured output (constrain.c), NULL: unconstrained; owned */
    int out_start;     /* tokens[out_start..) are its output (resumed ones included: n_prompt - resume_index) */
    int plp_next;      /* prompt logprobs: the next prompt position owed (up to out_start; 0 when none are) */
    int plp_row0, plp_n; /* during a step: batch rows [plp_row0, plp_row0 + plp_n) give positions plp_next.. */
    kvb_block_table bt;
    int n_computed;    /* tokens whose KV is in the request's blocks */
    int n_published;   /* full blocks offered to the prefix cache */
    uint64_t last_hash;/* chained hash of block n_published-1 */
    int q_len;         /* tokens scheduled in the current step */
    int paused;        /* running but not scheduled (KVB_OP_PAUSE) */
    int hits_taken;    /* during a step: its admission took its prefix hits (2: all that matched) */
    int n_absent;      /* tokens recomputed in the current step (KVB_OP_RUN.n_absent) */
    int n_dropped;     /* leading blocks released (KVB_OP_DROP): bt.ids[j] is block n_dropped + j */
    int restore_hi;    /* during a step: blocks [n_dropped, restore_hi) came back by a DROP and are
                        * filled by this step's recompute (restore_hi <= n_dropped: none) */
    int row0;          /* during a step: the batch row of its first new token */
    int scr0;          /* during a step: its first scratch slice (recomputed whole blocks) */
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

/* What one entry of the step's attention blocks (kvb_attn_seq.blk_first + j) reads. */
typedef enum kvb__ent_kind {
    KVB__ENT_BLOCK = 0,   /* a pool block (`block`), in place unless a mechanism points it elsewhere */
    KVB__ENT_SCRATCH = 1, /* scratch slice `slice` (recomputed tokens), or from layer `rec` on the
                           * request's own block `block` in place (when block >= 0) */
    KVB__ENT_OFFLOAD = 2, /* an offloaded admission's block: staging slice `slice` of the offload
                           * mechanism, stored to the host-tier block at `base` */
} kvb__ent_kind;

typedef struct kvb__entry {
    kvb__ent_kind kind;
    int32_t block;     /* a pool block id, or -1 */
    int32_t slice;     /* SCRATCH, OFFLOAD: its slice */
    int rec;           /* SCRATCH with a block: the first layer read from the block */
    void *base;        /* BLOCK: the block (all layers; NULL in a sliced pool); OFFLOAD: its host-tier block */
} kvb__entry;

/* A recomputed prefix of the step, in layout order. */
typedef struct kvb__pfx {
    struct kvb__seq *s;
    int kept;          /* layers [L - kept, L) read from host copies (prefix.c), not recomputed */
} kvb__pfx;

/* The step as the executor laid it out (layout.c); mechanisms read it and point entries. */
typedef struct kvb__step {
    kvb__seq **sched;        /* [max_seqs] the requests that compute, in plan order */
    int n_sched;
    int32_t *tokens, *pos;   /* [max_rows] */
    kvb_attn_seq *seqs;      /* [2 max_seqs] seqs[i] is sched[i]'s new tokens, the recomputed prefixes after */
    int n_attn;
    int32_t *logit_rows;     /* [max_seqs] */
    int32_t *plp_rows;       /* [max_seqs] rows whose logits give prompt logprobs (a piece of them) */
    kvb__entry *ent;         /* [cap] what each attention block entry reads */
    void **layer;            /* [cap] each entry's slice of the current layer (the attention's layer_blocks) */
    int n_ent, cap;
    kvb__pfx *pfx;           /* [max_seqs] recomputed prefixes in layout order */
    int *l_rows, *l_seqs;    /* [n_layers] rows and attention sequences computing each layer */
    int main_rows;           /* rows of the new tokens (the recomputed prefixes' come after) */
    void *scratch;           /* single-layer slices for recomputed tokens: [n_scratch][layer] */
    int n_scratch;
    int scr_par;             /* slices per parity when the step loads prefix layers (layer l uses parity l & 1),
                              * else 0 */
    float *logits;           /* [max_seqs][vocab] */
    int n_sample;            /* logits rows that sample a token (the first ones; the rest compute prompt logprobs) */
    float *sample_scratch;   /* [2*vocab] */
    uint32_t *gmask;         /* [gmask_words] the grammar mask of one request (constrain.c), grown on use */
    size_t gmask_words;
    float *row_copy;         /* [vocab] a row's raw logits while the processors change it (logprobs) */
    uint32_t *counts;        /* [vocab] zeros between uses: the penalties' token counts */
    float *lp;               /* [max_seqs] logprobs of a step's rows */
    int32_t *top_ids;        /* [max_seqs][KVB_MAX_TOP_LOGPROBS] */
    float *top_lp;           /* [max_seqs][KVB_MAX_TOP_LOGPROBS] */
    kvb_sample_row *sample_rows; /* [max_seqs] how each logit row is sampled, when the backend samples */
    int32_t *sampled;        /* [max_seqs] the tokens it sampled */
    int device_sampled;      /* this step's tokens are in `sampled` (no logits came to the host) */
    uint64_t *t_layer;       /* [n_layers] this step's layer times */
    uint64_t *t_wait;        /* [n_layers] of which before the layer's kernels */
} kvb__step;

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
    /* the queues (queue.c) */
    kvb__seq_list waiting;   /* by arrival; preempted requests go back in arrival order */
    kvb__seq_list running;   /* by arrival (paused ones included) */
    kvb__seq_list swapped;   /* by arrival: KV in the host tier (seq.host_bt) */
    uint64_t next_arrival;
    kvb_engine_stats stats;
    char last_error[256];    /* why the last kvb_engine_add failed, or the last plan was refused */
    /* the planner's view (view.c) and plan (executor.c) */
    kvb_view view;
    kvb_req_view *vreqs;     /* [vcap] */
    kvb__seq **vseq;         /* [vcap] the request behind each view entry */
    int vcap;
    int32_t *vhash;          /* [vhash_cap] open-addressing map id -> view index, -1 empty */
    int vhash_cap;           /* power of two >= 2 * n_reqs */
    struct kvb__memo *memo;  /* [vcap] what each request's prefix probe found (view.c) */
    int32_t *memo_ids;       /* [memo_cap] the probes' hit ids, memo_n of them reserved for this view */
    int memo_n, memo_cap;
    pthread_mutex_t memo_mu; /* probes may run on a planner's thread */
    kvb_plan plan;
    kvb_model_info model_info; /* what the view tells planners about the model (view.model) */
    /* the step (executor.c, layout.c) and the mechanisms that carry it out (mech.h) */
    kvb__step step;
    kvb__mech mech[KVB__MECH_COUNT]; /* iface NULL where not set up */
    kvb_stager *stager;
    /* lending */
    kvb__loan *loans;        /* [n_loans] attached segments, in attach order */
    int n_loans;
    int loans_cap;
    int n_borrowed;          /* blocks of all loans */
    int starved;             /* the last schedule left the queue's head waiting for blocks */
    /* the host tier (host_tier.c) */
    void *ht_mem;            /* [host_tier_blocks][block_bytes] host memory, or NULL */
    kvb_block_pool *ht_pool; /* its blocks */
    kvb_prefix_cache *ht_pc; /* its prefix cache: blocks keyed like the pool's */
    int host_prefix;         /* evicted cached blocks are demoted to the host tier, matches continue there */
    /* demotions while a plan is applied are batched: one transfer for all of them, posted (and waited
     * for) before the next host-link transfer and before the step's forward (kvb__host_flush) */
    int ht_batch;            /* 1 while apply_plan runs */
    kvb_xfer *ht_pend;       /* [n_ht_pend] pool block -> host block copies not posted yet */
    int n_ht_pend, cap_ht_pend;
};

/* The sliced pool's manager, NULL when the pool is block-major. */
static inline kvb__slices *kvb__sliced(const kvb_engine *e) { return e->mech[KVB__MECH_SLICES].ctx; }

/* ---------------------------------------------------------------- queue.c */
void kvb__list_remove(kvb__seq_list *l, kvb__seq *s);
void kvb__list_insert_ordered(kvb__seq_list *l, kvb__seq *s);
kvb__seq *kvb__find_seq(const kvb__seq_list *l, uint64_t id);
void kvb__seq_free(kvb_engine *e, kvb__seq *s);
void kvb__seq_drop_kv(kvb_engine *e, kvb__seq *s);
/* Tells the mechanisms that pool block `id` loses its last reference or leaves (block_free). */
void kvb__block_forget(kvb_engine *e, int32_t id);
/* Drops one reference of pool block `id`; the mechanisms hear of its last (block_free). */
void kvb__block_unref(kvb_engine *e, int32_t id);
/* Releases the request's pool blocks (published ones stay cached); the mechanisms hear of each last
 * reference. */
void kvb__seq_release_blocks(kvb_engine *e, kvb__seq *s);
/* Removes `s` from `l`, frees it and reports on_finish. */
void kvb__finish(kvb_engine *e, kvb__seq_list *l, kvb__seq *s, kvb_finish why, kvb_status err);
/* Preemption by recompute: releases the running request's blocks (published ones stay cached) and
 * puts it back in the queue in arrival order with its prompt plus the tokens it generated. */
void kvb__preempt_seq(kvb_engine *e, kvb__seq *victim);
/* Blocks `s` needs at most over its life (prompt + max_tokens). */
int64_t kvb__seq_need_blocks(const kvb_engine *e, const kvb__seq *s);
/* The body of kvb_engine_add. */
kvb_status kvb__sched_add(kvb_engine *e, const kvb_request *r);

/* ---------------------------------------------------------------- view.c */
/* Rebuilds e->view from the engine's state. KVB_ERR_NOMEM. */
kvb_status kvb__view_build(kvb_engine *e);
/* Checks e->plan against e->view; the sentence goes to e->last_error. */
kvb_status kvb__plan_check(kvb_engine *e, kvb_plan_cost *cost);
/* Calls the planner's plan_pool (if any) with a fresh view; `out` holds the current values. */
kvb_status kvb__plan_pool(kvb_engine *e, const kvb_pool_event *ev, kvb_pool_plan *out);
void kvb__view_free(kvb_engine *e);

/* ---------------------------------------------------------------- executor.c */
kvb_status kvb__exec_step(kvb_engine *e);
void kvb__exec_free(kvb_engine *e);
const char *kvb__planner_name(const kvb_engine *e);

/* ---------------------------------------------------------------- constrain.c (structured output) */
/* Sets to -inf the logits[n_logits] of every token s's matcher does not allow now. KVB_ERR_INVALID
 * when it allows none of them (a grammar whose next tokens lie beyond the model's logits), KVB_ERR_NOMEM. */
kvb_status kvb__constrain_logits(kvb_engine *e, kvb__seq *s, float *logits, int n_logits);
/* Advances s's matcher by the sampled token; *done = 1 when the output is complete and must stop. */
kvb_status kvb__constrain_accept(kvb__seq *s, int32_t tok, int *done);

/* ---------------------------------------------------------------- step.c */
kvb_status kvb__step_init(kvb_engine *e);
void kvb__step_free(kvb_engine *e);
/* Scratch slice k of layer l (its parity when the step loads prefix layers). */
void *kvb__scratch_slice(const kvb_engine *e, int k, int l);
/* Backend memory of at least `bytes` at *mem (of *have bytes), kept across steps: grown, never shrunk. */
kvb_status kvb__backend_reserve(kvb_engine *e, size_t bytes, void **mem, size_t *have);

/* ---------------------------------------------------------------- layout.c */
/* Lays out e->step.sched's batch into e->step and *b. KVB_ERR_NOMEM. */
kvb_status kvb__layout(kvb_engine *e, kvb_batch *b);
/* Every entry's slice of layer l from the pool or the scratch (e->step.layer). */
void kvb__layout_layer(kvb_engine *e, int l);

/* ---------------------------------------------------------------- the mechanisms' own entry points */
/* offload.c: ADMIT offload of s (host-tier blocks for its whole prompt, no pool block). */
kvb_status kvb__offload_init(kvb_engine *e);
kvb_status kvb__offload_admit(kvb_engine *e, kvb__seq *s);
/* Fills *x when s's block j is an offloaded admission's (returns 1), else returns 0. */
int kvb__offload_entry(kvb_engine *e, const kvb__seq *s, int j, kvb__entry *x);
/* prefix.c */
kvb_status kvb__prefix_init(kvb_engine *e);
/* During a step: layers [L - n, L) of s's released blocks are read from their host copies. */
int kvb__prefix_kept_layers(const kvb_engine *e, const kvb__seq *s);
/* residency.c */
kvb_status kvb__residency_init(kvb_engine *e);
/* Stage buffers for `slots` staged blocks (2 single-layer buffers each). */
kvb_status kvb__stage_reserve(kvb_engine *e, int slots);
/* swap.c: KVB_OP_SWAP_OUT (n_hidden layers left as hidden states) and KVB_OP_SWAP_IN. */
kvb_status kvb__swap_out(kvb_engine *e, kvb__seq *s, int n_hidden);
kvb_status kvb__swap_in(kvb_engine *e, kvb__seq *s, const kvb_plan_op *op);

/* ---------------------------------------------------------------- hcache.c */
kvb_status kvb__hcache_init(kvb_engine *e);
/* SWAP_OUT: layers [0, n_hidden) of s leave as its saved hidden states; returns how many do. */
int kvb__hcache_swap_out(kvb_engine *e, kvb__seq *s, int n_hidden);
/* SWAPPED: the layers s left as hidden states. */
int kvb__hcache_swapped_layers(const kvb__seq *s);
/* SWAP_IN: rebuilds the K and V of the layers s left as hidden states into its (new) blocks. */
kvb_status kvb__hcache_restore(kvb_engine *e, kvb__seq *s);

/* ---------------------------------------------------------------- slices.c (sliced pools) */
/* Sets up the manager for a sliced pool of n_ids ids (host homes included); min_layers: see
 * kvb_pool_plan.sliced_min_layers. */
kvb_status kvb__slices_init(kvb_engine *e, int n_ids, int min_layers);
int kvb__slices_min_layers(const kvb_engine *e);
/* A new block id for a sequence (no slice yet; its layers get slices at the install). */
kvb_status kvb__slices_new_block(kvb_engine *e, int32_t *out);

/* ---------------------------------------------------------------- host_tier.c */
/* Creates the host tier of `blocks` blocks; `prefix`: demote evicted cached blocks into it (`async_wb`:
 * written back ahead of eviction, asynchronously); `layered`: its hits load layer by layer. */
kvb_status kvb__host_tier_init(kvb_engine *e, int blocks, int prefix, int layered, int async_wb);
/* Waits for every write-back in flight and makes its host copies readable: before a pool block may
 * leave by another way than eviction (a shrink, a detach). */
kvb_status kvb__host_tier_quiesce(kvb_engine *e);
/* Blocks whose write-back is in flight. */
int kvb__host_tier_in_flight(const kvb_engine *e);
/* host_layered: posts the step's layered loads not posted yet, waits for every layer, releases the blocks:
 * no load runs on after it. */
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
/* Copies layers [layer0, L) of blocks pool[i] <-> host[i] (i < n) over the host link and waits (dir D2H: to
 * the host tier). */
kvb_status kvb__host_move(kvb_engine *e, kvb_xfer_dir dir, const int32_t *pool, const int32_t *host, int n, int layer0);
/* Appends n new host-tier blocks (counted by the plan's check) to table t. */
kvb_status kvb__host_blocks_push(kvb_engine *e, kvb_block_table *t, int n);
/* Copies `bytes` between the pool and the host tier over the host link and waits (dir D2H or H2D). */
kvb_status kvb__host_copy(kvb_engine *e, kvb_xfer_dir dir, void *dst, const void *src, size_t bytes);
/* How many blocks after `parent` the host tier holds for tokens[0..max_blocks*bs), without loading. */
int kvb__host_tier_peek(const kvb_engine *e, uint64_t parent, const int32_t *tokens, int max_blocks,
                        uint64_t *last_hash);

#endif
