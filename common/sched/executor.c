/* kvbank — the executor: asks the planner for a plan, checks it, applies its request-level decisions
 * (admit, run, preempt, swap, pause), turns the step into per-layer block pointers for the forward pass
 * (in place, through stage buffers loaded by the stager, or scratch slices for recomputed tokens),
 * carries out the plan's copy orders, runs the forward pass layer by layer, samples, publishes full
 * blocks to the prefix cache and tells the planner what the step measured. */
#include <assert.h>
#include <stdio.h>
#include <string.h>

#include "common/sched/state.h"

/* ---------------------------------------------------------------- host copies of pool blocks */

static size_t layer_bytes(const kvb_engine *e) { return kvb_kv_layer_bytes(&e->geom); }

/* Makes the per-block host-copy tables cover every block id. */
static kvb_status shadow_reserve(kvb_engine *e) {
    int ids = kvb_block_pool_id_limit(e->pool), L = e->geom.n_layers;
    if (ids <= e->shadow_cap) return KVB_OK;
    KVB_TRY(kvb_realloc_array((void **)&e->shadow, (size_t)ids, sizeof *e->shadow));
    KVB_TRY(kvb_realloc_array((void **)&e->shadow_ok, (size_t)ids * (size_t)L, 1));
    for (int i = e->shadow_cap; i < ids; i++) e->shadow[i] = -1;
    memset(e->shadow_ok + (size_t)e->shadow_cap * L, 0, (size_t)(ids - e->shadow_cap) * L);
    e->shadow_cap = ids;
    return KVB_OK;
}

void kvb__shadow_drop(kvb_engine *e, int32_t id) {
    if (id < 0 || id >= e->shadow_cap || e->shadow[id] < 0) return;
    kvb_block_pool_unref(e->ht_pool, e->shadow[id]);
    e->shadow[id] = -1;
    memset(e->shadow_ok + (size_t)id * e->geom.n_layers, 0, (size_t)e->geom.n_layers);
}

/* The host copy of block `id`, made (empty) if it has none. */
static kvb_status shadow_get(kvb_engine *e, int32_t id, int32_t *out) {
    KVB_TRY(shadow_reserve(e));
    if (e->shadow[id] < 0) KVB_TRY(kvb__host_alloc(e, &e->shadow[id]));
    *out = e->shadow[id];
    return KVB_OK;
}

/* ---------------------------------------------------------------- applying a plan */

/* Gives `s` blocks for its first `upto` tokens: from the free list, or with `op` placed, the blocks
 * op->block0 + j (checked free by the plan's check). Released leading blocks (DROP) are not given back.
 * KVB_ERR_EXHAUSTED if the pool cannot. */
static kvb_status grow_blocks(kvb_engine *e, kvb__seq *s, int upto, const kvb_plan_op *op) {
    int need = KVB_DIV_CEIL(upto, e->o.block_size) - s->n_dropped;
    while (s->bt.n < need) {
        int32_t id = op && op->placed ? op->block0 + s->bt.n : -1;
        if (id >= 0) KVB_TRY(kvb_block_pool_take(e->pool, id));
        else if (e->sl) KVB_TRY(kvb__slices_new_block(e, &id)); /* its layers get slices at the install */
        else KVB_TRY(kvb_prefix_cache_alloc(e->pc, &id));
        kvb_status st = kvb_block_table_push(&s->bt, id);
        if (st != KVB_OK) {
            kvb_block_pool_unref(e->pool, id);
            return st;
        }
    }
    return KVB_OK;
}

/* Takes the prefix-cache hits of a waiting sequence: full cached blocks, leaving at least one token to
 * compute for the logits. Sets n_published and last_hash (n_computed follows at admission) and
 * s->hits_taken: 1, or 2 when the match was used whole (the host tier may continue it). */
static void take_hits(kvb_engine *e, kvb__seq *s) {
    if (s->hits_taken) return;
    s->hits_taken = 1;
    if (!e->o.enable_prefix_cache || s->n_computed != 0) return;
    int max_blocks = (s->n_tokens - 1) / e->o.block_size;
    int32_t *ids = NULL;
    if (max_blocks <= 0 || kvb_malloc((size_t)max_blocks * sizeof *ids, (void **)&ids) != KVB_OK) return;
    int got = kvb_prefix_cache_match(e->pc, s->tokens, s->n_tokens, max_blocks, ids, &s->last_hash);
    int pushed = 0;
    while (pushed < got && kvb_block_table_push(&s->bt, ids[pushed]) == KVB_OK) pushed++;
    for (int i = pushed; i < got; i++) kvb_block_pool_unref(e->pool, ids[i]);
    if (pushed < got) { /* out of memory for the table: use what fits, recompute the rest */
        kvb__seq_drop_kv(e, s);
        pushed = 0;
    }
    free(ids);
    s->n_published = pushed;
    s->hits_taken = pushed == got ? 2 : 1;
}

/* Copies whole blocks between the pool and the host tier (pool[i] <-> host[i]) over the host link. */
/* Only layers [layer0, L) of each block: block-major blocks hold them contiguously at the end. */
static kvb_status move_blocks(kvb_engine *e, kvb_xfer_dir dir, const int32_t *pool, const int32_t *host, int n,
                              int layer0) {
    kvb_xfer *x = NULL;
    if (n == 0 || layer0 >= e->geom.n_layers) return KVB_OK;
    KVB_TRY(kvb__host_flush(e)); /* demotions first: they may read the blocks written here */
    KVB_TRY(kvb__host_tier_finish_loads(e)); /* and the layered loads of hits (host_layered) */
    KVB_TRY(kvb_malloc((size_t)n * sizeof *x, (void **)&x));
    size_t off = (size_t)layer0 * layer_bytes(e), bb = kvb_kv_block_bytes(&e->geom) - off;
    for (int i = 0; i < n; i++) {
        char *p = (char *)kvb_block_pool_block(e->pool, pool[i]) + off;
        char *h = (char *)kvb_block_pool_block(e->ht_pool, host[i]) + off;
        x[i] = dir == KVB_XFER_D2H ? (kvb_xfer){h, p, bb} : (kvb_xfer){p, h, bb};
    }
    uint64_t t;
    kvb_status st = kvb_stager_post(e->stager, KVB_LINK_HOST, dir, x, n, &t);
    if (st == KVB_OK) st = kvb_stager_wait(e->stager, t);
    free(x);
    return st;
}

/* Appends n new host-tier blocks (counted by the plan's check) to table t. */
static kvb_status host_blocks_push(kvb_engine *e, kvb_block_table *t, int n) {
    for (int j = 0; j < n; j++) {
        int32_t h;
        KVB_TRY(kvb__host_alloc(e, &h));
        kvb_status st = kvb_block_table_push(t, h);
        if (st != KVB_OK) {
            kvb_block_pool_unref(e->ht_pool, h);
            return st;
        }
    }
    return KVB_OK;
}

/* Backend memory of at least `bytes` at *mem (of *have bytes), kept across steps: grown, never shrunk. */
static kvb_status backend_reserve(kvb_engine *e, size_t bytes, void **mem, size_t *have) {
    if (bytes <= *have) return KVB_OK;
    kvb_backend *be = kvb_model_backend(e->m);
    void *m = NULL;
    KVB_TRY(kvb_mem_alloc(be->mem, bytes, &m));
    kvb_mem_free(be->mem, *mem);
    *mem = m;
    *have = bytes;
    return KVB_OK;
}

/* KVB_OP_SWAP_OUT: the sequence's KV goes to new host-tier blocks and its pool blocks are released;
 * layers [0, n_hidden) stay behind as its saved hidden states (HCache). */
static kvb_status swap_out(kvb_engine *e, kvb__seq *s, int n_hidden) {
    int n = s->bt.n;
    KVB_TRY(host_blocks_push(e, &s->host_bt, n));
    KVB_TRY(move_blocks(e, KVB_XFER_D2H, s->bt.ids, s->host_bt.ids, n, kvb__hcache_swap_out(e, s, n_hidden)));
    for (int j = 0; j < n; j++)
        if (kvb_block_pool_refcount(e->pool, s->bt.ids[j]) == 1) kvb__shadow_drop(e, s->bt.ids[j]);
    kvb_block_table_release(&s->bt, e->pool);
    kvb__list_remove(&e->running, s);
    s->paused = 0;
    kvb__list_insert_ordered(&e->swapped, s);
    e->stats.swap_outs++;
    return KVB_OK;
}

/* KVB_OP_SWAP_IN: new pool blocks (placed: op->block0 + j) receive the sequence's KV from the host tier. */
static kvb_status swap_in(kvb_engine *e, kvb__seq *s, const kvb_plan_op *op) {
    int n = s->host_bt.n;
    for (int j = 0; j < n; j++) {
        int32_t id = op->placed ? op->block0 + j : -1;
        if (id >= 0) KVB_TRY(kvb_block_pool_take(e->pool, id)); /* checked free by the plan's check */
        else KVB_TRY(kvb_prefix_cache_alloc(e->pc, &id)); /* counted by the plan's check */
        kvb_status st = kvb_block_table_push(&s->bt, id);
        if (st != KVB_OK) {
            kvb_block_pool_unref(e->pool, id);
            return st;
        }
    }
    KVB_TRY(move_blocks(e, KVB_XFER_H2D, s->bt.ids, s->host_bt.ids, n, kvb__hcache_swapped_layers(s)));
    KVB_TRY(kvb__hcache_restore(e, s));
    kvb_block_table_release(&s->host_bt, e->ht_pool);
    kvb__list_remove(&e->swapped, s);
    kvb__list_insert_ordered(&e->running, s);
    e->stats.swap_ins++;
    return KVB_OK;
}

/* ADMIT offload (ellm-elastic-memory.txt §4.3.2): the sequence computes its whole prompt this step with
 * its KV going to new host-tier blocks (counted by the plan's check) through the step's staging area;
 * it runs in this step and is SWAPPED after it (offload_end). */
static kvb_status offload_begin(kvb_engine *e, kvb__seq *s) {
    int nb = KVB_DIV_CEIL(s->n_tokens, e->o.block_size);
    KVB_TRY(host_blocks_push(e, &s->host_bt, nb));
    s->hits_taken = 0;
    s->n_computed = 0;
    kvb__list_remove(&e->waiting, s);
    kvb__list_insert_ordered(&e->running, s);
    s->q_len = s->n_tokens;
    s->n_absent = 0;
    s->n_swapl = 0;
    s->offload = 1;
    e->stats.offload_prefills++;
    return KVB_OK;
}

/* After the step: offloaded sequences leave the running list for the swapped one. */
static void offload_end(kvb_engine *e, int n_sched) {
    for (int i = 0; i < n_sched; i++) {
        kvb__seq *s = e->sched[i];
        if (!s->offload) continue;
        s->offload = 0;
        kvb__list_remove(&e->running, s);
        kvb__list_insert_ordered(&e->swapped, s);
    }
}

/* DROP n_host: before blocks [cur, to) of `s` are released, their layers [L - layers, L) go to new
 * host-tier blocks (counted by the plan's check) over the host link, once (eLLM §4.3: swapped prefix
 * KV is written before its device blocks are freed). A request keeps one layer count for all its
 * copies: its first DROP sets it (n_host), later DROPs store the same layers whatever their n_host, so
 * that every released block has a copy or none has. */
static kvb_status store_prefix_copies(kvb_engine *e, kvb__seq *s, int to, int n_host) {
    int cur = s->n_dropped, L = e->geom.n_layers;
    if (s->pfx_layers == 0 && (cur > 0 || n_host <= 0)) return KVB_OK;
    assert(s->pfx_bt.n == cur);
    int layers = cur == 0 ? n_host : s->pfx_layers;
    KVB_TRY(host_blocks_push(e, &s->pfx_bt, to - cur));
    s->pfx_layers = layers;
    KVB_TRY(move_blocks(e, KVB_XFER_D2H, s->bt.ids, s->pfx_bt.ids + cur, to - cur, L - layers));
    e->stats.prefix_host_stores += (uint64_t)(to - cur);
    return KVB_OK;
}

/* KVB_OP_DROP: the sequence keeps device KV from block `to` on. Releasing moves the table's first
 * entries out (a block shared through the prefix cache stays cached for others), after storing their
 * upper layers to the host tier when the plan asks (n_host); restoring puts new blocks in front, which
 * this step's recompute fills (restore_hi), and the restored blocks' host copies go. */
static kvb_status drop_blocks(kvb_engine *e, kvb__seq *s, int to, int n_host) {
    int cur = s->n_dropped;
    kvb_block_table *t = &s->bt;
    if (to > cur) {
        int k = to - cur;
        KVB_TRY(store_prefix_copies(e, s, to, n_host));
        for (int j = 0; j < k; j++) {
            if (kvb_block_pool_refcount(e->pool, t->ids[j]) == 1) kvb__shadow_drop(e, t->ids[j]);
            kvb_block_pool_unref(e->pool, t->ids[j]);
        }
        memmove(t->ids, t->ids + k, (size_t)(t->n - k) * sizeof *t->ids);
        t->n -= k;
        e->stats.dropped_blocks += (uint64_t)k;
    } else if (to < cur) {
        int k = cur - to;
        for (int j = 0; j < k; j++) { /* grow the table by k (ids moved below) */
            int32_t id;
            KVB_TRY(kvb_prefix_cache_alloc(e->pc, &id)); /* counted by the plan's check */
            kvb_status st = kvb_block_table_push(t, id);
            if (st != KVB_OK) {
                kvb_block_pool_unref(e->pool, id);
                return st;
            }
        }
        /* the k new ids sit at the end: rotate them to the front */
        int32_t tmp[64];
        for (int done = 0; done < k;) {
            int c = KVB_MIN(k - done, 64);
            memcpy(tmp, t->ids + t->n - c, (size_t)c * sizeof *tmp);
            memmove(t->ids + c, t->ids, (size_t)(t->n - c) * sizeof *t->ids);
            memcpy(t->ids, tmp, (size_t)c * sizeof *tmp);
            done += c;
        }
        s->restore_hi = cur;
        e->stats.restored_blocks += (uint64_t)k;
        if (s->pfx_layers > 0) { /* the restored blocks' copies go: the table keeps blocks [0, to) */
            for (int j = to; j < s->pfx_bt.n; j++) kvb_block_pool_unref(e->ht_pool, s->pfx_bt.ids[j]);
            s->pfx_bt.n = to;
            if (to == 0) s->pfx_layers = 0;
        }
    }
    s->n_dropped = to;
    return KVB_OK;
}

/* The mechanisms' part of operation `op` on request s. */
static kvb_status mechs_apply(kvb_engine *e, kvb__seq *s, const kvb_plan_op *op) {
    for (int k = 0; k < KVB__MECH_COUNT; k++) {
        const kvb__mech *m = &e->mech[k];
        if (m->iface && m->iface->apply_op) KVB_TRY(m->iface->apply_op(m->ctx, e, s, op));
    }
    return KVB_OK;
}

/* Applies the checked plan in order and fills e->sched / e->n_sched with the requests that compute. A
 * failure (a copy of a swap, memory for saved hidden states) leaves the plan half applied: the step fails. */
static kvb_status apply_plan(kvb_engine *e, kvb_step_report *rep) {
    const kvb_plan *p = &e->plan;
    int admits_stopped = 0;
    e->n_sched = 0;
    /* 1. the prefix hits of every admission are referenced first, so that no allocation of this step
     *    evicts a block a later admission of the same plan was planned to reuse */
    for (int k = 0; k < p->n_ops; k++) {
        const kvb_plan_op *op = &p->ops[k];
        if (op->kind != KVB_OP_ADMIT) continue;
        int i = kvb_view_find(&e->view, op->id);
        if (e->view.reqs[i].state == KVB_REQ_WAITING) take_hits(e, e->vseq[i]);
    }
    /* 2. the operations in order */
    for (int k = 0; k < p->n_ops; k++) {
        const kvb_plan_op *op = &p->ops[k];
        kvb__seq *s = e->vseq[kvb_view_find(&e->view, op->id)];
        switch (op->kind) {
        case KVB_OP_RUN:
            if (grow_blocks(e, s, s->n_computed + op->q_len, op) != KVB_OK) {
                /* the accounting allowed it: only a failed allocation of the table itself gets here */
                KVB_LOG_W("engine: no memory to extend request %llu's block table; preempting it",
                          (unsigned long long)s->id);
                kvb__preempt_seq(e, s);
                break;
            }
            s->q_len = op->q_len;
            s->n_absent = op->n_absent;
            /* released blocks' upper layers from their host copies: at most the layers they hold, none in
             * a step that restores blocks (those are filled at every layer by the recompute) */
            s->n_swapl = s->n_dropped > 0 && s->restore_hi <= s->n_dropped ? KVB_MIN(op->n_host, s->pfx_layers) : 0;
            KVB_TRY(mechs_apply(e, s, op));
            e->sched[e->n_sched++] = s;
            break;
        case KVB_OP_ADMIT: {
            if (admits_stopped) {
                kvb__seq_drop_kv(e, s);
                rep->admits_dropped++;
                break;
            }
            if (op->offload) {
                /* eLLM's CPU buffer: host-tier blocks for the whole prompt, no pool block */
                KVB_TRY(offload_begin(e, s));
                KVB_TRY(mechs_apply(e, s, op));
                e->sched[e->n_sched++] = s;
                break;
            }
            take_hits(e, s); /* a request the plan preempted before admitting it again */
            int max_blocks = (s->n_tokens - 1) / e->o.block_size;
            if (e->ht_pc && e->host_prefix && s->hits_taken == 2) kvb__host_tier_load(e, s, max_blocks);
            s->hits_taken = 0;
            int hit = s->n_published * e->o.block_size;
            s->n_computed = hit;
            int q = KVB_MIN(op->q_len, s->n_tokens - s->n_computed);
            if (grow_blocks(e, s, s->n_computed + q, op) != KVB_OK) {
                /* a host-tier hit was evicted since planning, or no memory for the table: it waits */
                kvb__seq_drop_kv(e, s);
                rep->admits_dropped++;
                admits_stopped = 1;
                break;
            }
            e->stats.prefix_hit_tokens += (uint64_t)hit;
            kvb__list_remove(&e->waiting, s);
            kvb__list_insert_ordered(&e->running, s);
            for (kvb__seq *w = e->waiting.head; w && w->arrival < s->arrival; w = w->next)
                if (w->t_stall_ns) w->n_overtaken++; /* admitted past a stalled request (bounded) */
            s->q_len = q;
            s->n_absent = 0;
            s->n_swapl = 0;
            KVB_TRY(mechs_apply(e, s, op));
            e->sched[e->n_sched++] = s;
            break;
        }
        case KVB_OP_PREEMPT: kvb__preempt_seq(e, s); break;
        case KVB_OP_PAUSE:
            s->paused = 1;
            e->stats.pauses++;
            break;
        case KVB_OP_RESUME: s->paused = 0; break;
        case KVB_OP_DROP: KVB_TRY(drop_blocks(e, s, op->n_dropped, op->n_host)); break;
        case KVB_OP_SWAP_OUT: KVB_TRY(swap_out(e, s, op->n_hidden)); break;
        case KVB_OP_SWAP_IN: KVB_TRY(swap_in(e, s, op)); break;
        }
    }
    e->starved = p->starved || admits_stopped;
    e->stats.deferred += (uint64_t)p->n_deferred;
    return KVB_OK;
}

/* ---------------------------------------------------------------- the step's block pointers */

static kvb_status ensure_blk_cap(kvb_engine *e, int n) {
    if (n <= e->blk_cap) return KVB_OK;
    int cap = KVB_MAX(n, e->blk_cap * 2);
    KVB_TRY(kvb_realloc_array((void **)&e->blk_base, (size_t)cap, sizeof(void *)));
    KVB_TRY(kvb_realloc_array((void **)&e->blk_layer, (size_t)cap, sizeof(void *)));
    KVB_TRY(kvb_realloc_array((void **)&e->blk_id, (size_t)cap, sizeof *e->blk_id));
    KVB_TRY(kvb_realloc_array((void **)&e->blk_off, (size_t)cap, sizeof *e->blk_off));
    KVB_TRY(kvb_realloc_array((void **)&e->blk_real, (size_t)cap, sizeof *e->blk_real));
    KVB_TRY(kvb_realloc_array((void **)&e->blk_rec, (size_t)cap, sizeof *e->blk_rec));
    e->blk_cap = cap;
    return KVB_OK;
}

/* Scratch slices for `n` fully recomputed blocks (one layer each: every layer recomputes them). */
static kvb_status scratch_reserve(kvb_engine *e, int n) {
    if (n <= e->n_scratch) return KVB_OK;
    kvb_backend *be = kvb_model_backend(e->m);
    void *mem = NULL;
    KVB_TRY(kvb_mem_alloc(be->mem, (size_t)n * layer_bytes(e), &mem));
    kvb_mem_free(be->mem, e->scratch);
    e->scratch = mem;
    e->n_scratch = n;
    return KVB_OK;
}

kvb_status kvb__stage_reserve(kvb_engine *e, int slots) {
    return kvb_stager_reserve(e->stager, 2 * slots, layer_bytes(e));
}

/* Offers every newly completed full block of `s` to the prefix cache. */
static void publish_full_blocks(kvb_engine *e, kvb__seq *s) {
    int bs = e->o.block_size;
    while ((s->n_published + 1) * bs <= s->n_computed) {
        int b = s->n_published;
        if (b < s->n_dropped) break; /* a released block can no longer be published (nor its successors) */
        if (kvb_prefix_cache_publish(e->pc, s->last_hash, s->tokens + (size_t)b * bs, s->bt.ids[b - s->n_dropped],
                                     &s->last_hash) !=
            KVB_OK)
            break;
        s->n_published++;
    }
}

static int is_stop(const kvb__seq *s, int32_t tok) {
    for (int i = 0; i < s->n_stop; i++)
        if (s->stop[i] == tok) return 1;
    return 0;
}

/* Entry ids of the step: pool block ids, or SCRATCH_ID(k) for scratch slice k. */
#define SCRATCH_ID(k) (-2 - (k))
/* The entry id of an offloaded admission's block: its blk_base is its host-tier block, blk_off its staging
 * block. */
#define OFFLOAD_ID (-1)

/* Entry n_blk of the step: block j of `s` (its first `full` blocks are recomputed whole). A released
 * block (DROP) and a fully recomputed block that is not being restored read scratch slice scr0 + j;
 * a restored block receives the recomputed KV in place; the rest are the sequence's blocks. `own`: the
 * entry belongs to the sequence's new tokens, whose scratch entries for blocks it still holds read
 * those blocks in place above its recomputed layers. */
static void layout_entry(kvb_engine *e, kvb__seq *s, int j, int full, int n_blk, int own) {
    int restored = j >= s->n_dropped && j < s->restore_hi;
    e->blk_off[n_blk] = -1;
    e->blk_real[n_blk] = -1;
    e->blk_rec[n_blk] = (int16_t)e->geom.n_layers;
    if (s->offload) { /* its staging block (per layer: forward) */
        e->blk_id[n_blk] = OFFLOAD_ID;
        e->blk_base[n_blk] = kvb_block_pool_block(e->ht_pool, s->host_bt.ids[j]); /* where its layers go */
        e->blk_off[n_blk] = e->n_off++;
    } else if (j < s->n_dropped || (j < full && !restored)) {
        e->blk_id[n_blk] = SCRATCH_ID(s->scr0 + j);
        e->blk_base[n_blk] = (char *)e->scratch + (size_t)(s->scr0 + j) * layer_bytes(e);
        if (own && j >= s->n_dropped && s->n_swapl > 0) {
            e->blk_real[n_blk] = s->bt.ids[j - s->n_dropped];
            e->blk_rec[n_blk] = (int16_t)(e->geom.n_layers - s->n_swapl);
        }
    } else {
        int32_t id = s->bt.ids[j - s->n_dropped];
        e->blk_id[n_blk] = id;
        e->blk_base[n_blk] = e->sl ? NULL /* per layer: kvb__slices_layer */ : kvb_block_pool_block(e->pool, id);
    }
}

/* Recomputed prefixes in the order they are laid out: most recomputed layers first (so the rows that
 * leave the forward pass at a layer are the last ones). */
static int by_swapped_layers(const void *a, const void *b) {
    const kvb__seq *x = *(kvb__seq *const *)a, *y = *(kvb__seq *const *)b;
    if (x->n_swapl != y->n_swapl) return x->n_swapl < y->n_swapl ? -1 : 1;
    return x->row0 < y->row0 ? -1 : x->row0 > y->row0;
}

/* Lays out the batch: each scheduled sequence's new tokens over its blocks (the fully recomputed ones
 * replaced by scratch slices), in the order of e->sched (b_seqs[i] is sched[i]'s), then each recomputed
 * prefix as a sequence of its own at positions 0..n_absent-1 over the same scratch slices (and its
 * real boundary block), those with the most recomputed layers first. Fills e->b_seqs, tokens,
 * positions, logit rows, e->blk_id / blk_base / blk_real / blk_rec, and per layer the rows and
 * sequences that compute it (e->l_rows / l_seqs: the recomputed prefixes leave above their layers). */
static kvb_status layout(kvb_engine *e, int n_sched, kvb_batch *b, int *n_blk_out, int *n_attn_out) {
    int bs = e->o.block_size, L = e->geom.n_layers, n_tok = 0, n_blk = 0, n_attn = 0, n_logits = 0, n_scr = 0;
    int total = 0, n_pfx = 0, swapl = 0;
    for (int i = 0; i < n_sched; i++) {
        kvb__seq *s = e->sched[i];
        total += KVB_DIV_CEIL(s->n_computed + s->q_len, bs) + KVB_DIV_CEIL(s->n_absent, bs);
        s->scr0 = n_scr;
        n_scr += s->n_absent / bs;
        swapl |= s->n_swapl > 0;
        if (s->n_absent > 0) e->pfx_ord[n_pfx++] = s;
    }
    KVB_TRY(ensure_blk_cap(e, total));
    KVB_TRY(scratch_reserve(e, swapl ? 2 * n_scr : n_scr));
    e->scr_par = swapl ? n_scr : 0; /* layer l+1's loads land while layer l reads the other parity */
    e->n_off = 0;
    for (int i = 0; i < n_sched; i++) {
        kvb__seq *s = e->sched[i];
        int full = s->n_absent / bs;
        kvb_attn_seq *as = &e->b_seqs[n_attn++];
        s->row0 = n_tok;
        *as = (kvb_attn_seq){.q_start = n_tok, .q_len = s->q_len, .ctx_len = s->n_computed + s->q_len,
                             .blk_first = n_blk};
        as->n_blocks = KVB_DIV_CEIL(as->ctx_len, bs);
        for (int j = 0; j < as->n_blocks; j++, n_blk++) layout_entry(e, s, j, full, n_blk, 1);
        for (int t = 0; t < s->q_len; t++, n_tok++) {
            e->b_tokens[n_tok] = s->tokens[s->n_computed + t];
            e->b_pos[n_tok] = s->n_computed + t;
        }
        if (as->ctx_len == s->n_tokens) e->b_logit_rows[n_logits++] = n_tok - 1;
    }
    e->main_rows = n_tok;
    qsort(e->pfx_ord, (size_t)n_pfx, sizeof *e->pfx_ord, by_swapped_layers);
    for (int l = 0; l < L; l++) {
        e->l_rows[l] = n_tok;
        e->l_seqs[l] = n_attn;
    }
    for (int k = 0; k < n_pfx; k++) {
        kvb__seq *s = e->pfx_ord[k];
        int a = s->n_absent, full = a / bs;
        kvb_attn_seq *as = &e->b_seqs[n_attn++];
        *as = (kvb_attn_seq){.q_start = n_tok, .q_len = a, .ctx_len = a, .n_blocks = KVB_DIV_CEIL(a, bs),
                             .blk_first = n_blk};
        for (int j = 0; j < as->n_blocks; j++, n_blk++) layout_entry(e, s, j, full, n_blk, 0);
        for (int t = 0; t < a; t++, n_tok++) {
            e->b_tokens[n_tok] = s->tokens[t];
            e->b_pos[n_tok] = t;
        }
        for (int l = 0; l < L - s->n_swapl; l++) { /* its rows compute layers [0, L - n_swapl) */
            e->l_rows[l] = n_tok;
            e->l_seqs[l] = n_attn;
        }
        e->stats.recomputed_tokens += (uint64_t)a;
    }
    *b = (kvb_batch){.n_tokens = n_tok, .tokens = e->b_tokens, .pos = e->b_pos,
                     .attn = {.geom = &e->geom, .n_seqs = n_attn, .seqs = e->b_seqs, .layer_blocks = e->blk_layer},
                     .n_logits = n_logits, .logit_rows = e->b_logit_rows};
    *n_blk_out = n_blk;
    *n_attn_out = n_attn;
    return KVB_OK;
}

/* Where block `id` is read at `layer` in this step. */
static kvb_residency where(const kvb_engine *e, int32_t id, int layer) {
    if (id < 0) return KVB_RES_LOCAL; /* scratch */
    if (id < e->res_first_cap)
        for (int r = e->res_first[id]; r >= 0; r = e->res_next[r]) {
            const kvb_plan_res *x = &e->plan.res[r];
            if (layer >= x->layer0 && layer < x->layer1) return x->where;
        }
    return kvb_block_pool_is_attached(e->pool, id) ? e->plan.lent_default : KVB_RES_LOCAL;
}

static int staged(kvb_residency r) { return r == KVB_RES_STREAM || r == KVB_RES_HOST; }

/* Links the plan's residency exceptions by block id. */
static kvb_status index_residency(kvb_engine *e) {
    const kvb_plan *p = &e->plan;
    int ids = kvb_block_pool_id_limit(e->pool);
    if (ids > e->res_first_cap) {
        KVB_TRY(kvb_realloc_array((void **)&e->res_first, (size_t)ids, sizeof *e->res_first));
        for (int i = e->res_first_cap; i < ids; i++) e->res_first[i] = -1;
        e->res_first_cap = ids;
    }
    if (p->n_res > e->res_next_cap) {
        KVB_TRY(kvb_realloc_array((void **)&e->res_next, (size_t)p->n_res, sizeof *e->res_next));
        e->res_next_cap = p->n_res;
    }
    for (int r = p->n_res - 1; r >= 0; r--) {
        e->res_next[r] = e->res_first[p->res[r].block];
        e->res_first[p->res[r].block] = r;
    }
    return KVB_OK;
}

static void unindex_residency(kvb_engine *e) {
    for (int r = 0; r < e->plan.n_res; r++) e->res_first[e->plan.res[r].block] = -1;
}

/* Gives every block of the step that some layer reads through stage buffers a unit per kind (a block
 * shared by several sequences gets one), and records which rows the step writes into it. Returns the
 * number of units. */
static kvb_status make_units(kvb_engine *e, int n_attn, int n_blk, int *n_units) {
    int ids = kvb_block_pool_id_limit(e->pool), bs = e->o.block_size, L = e->geom.n_layers, n = 0;
    if (ids > e->unit_of_cap) {
        KVB_TRY(kvb_realloc_array((void **)&e->unit_of, 2 * (size_t)ids, sizeof *e->unit_of));
        for (int i = 0; i < 2 * ids; i++) e->unit_of[i] = -1;
        e->unit_of_cap = ids;
    }
    if (n_blk > e->units_cap) {
        KVB_TRY(kvb_realloc_array((void **)&e->units, (size_t)n_blk, sizeof *e->units));
        e->units_cap = n_blk;
    }
    int stream_default = e->plan.lent_default == KVB_RES_STREAM;
    for (int j = 0; j < n_blk && (stream_default || e->plan.n_res > 0); j++) {
        int32_t id = e->blk_id[j];
        if (id < 0) continue;
        /* a block without exceptions reads the same way at every layer */
        int layers = e->res_first[id] >= 0 ? L : 1;
        for (int l = 0; l < layers; l++) {
            kvb_residency w = where(e, id, l);
            if (!staged(w)) continue;
            int32_t *u = &e->unit_of[(w == KVB_RES_HOST) * e->unit_of_cap + id];
            if (*u >= 0) continue;
            unsigned char *src = w == KVB_RES_HOST ? kvb_block_pool_block(e->ht_pool, e->shadow[id])
                                                   : kvb_block_pool_block(e->pool, id);
            *u = n;
            e->units[n] = (kvb__stage_unit){.block = id, .kind = w, .buf = n, .src = src, .dirty_lo = bs, .dirty_hi = 0};
            n++;
        }
    }
    for (int i = 0; i < n_attn && n > 0; i++) {
        const kvb_attn_seq *as = &e->b_seqs[i];
        int p0 = as->ctx_len - as->q_len, p1 = as->ctx_len; /* positions written this step */
        for (int bj = p0 / bs; bj <= (p1 - 1) / bs; bj++) {
            int32_t id = e->blk_id[as->blk_first + bj];
            if (id < 0) continue;
            for (int k = 0; k < 2; k++) {
                int u = e->unit_of[k * e->unit_of_cap + id];
                if (u < 0) continue;
                e->units[u].dirty_lo = KVB_MIN(e->units[u].dirty_lo, KVB_MAX(p0 - bj * bs, 0));
                e->units[u].dirty_hi = KVB_MAX(e->units[u].dirty_hi, KVB_MIN(p1 - bj * bs, bs));
            }
        }
    }
    *n_units = e->n_units = n;
    return KVB_OK;
}

static void forget_units(kvb_engine *e) {
    for (int u = 0; u < e->n_units; u++)
        e->unit_of[(e->units[u].kind == KVB_RES_HOST) * e->unit_of_cap + e->units[u].block] = -1;
    e->n_units = 0;
}

/* ---------------------------------------------------------------- the step's transfers */

static kvb_xfer *xl_add(kvb_engine *e) { return &e->xl.x[e->xl.n++]; }

/* Reserves room for every transfer piece of the step (the stager borrows them until the drain). */
static kvb_status xl_reserve(kvb_engine *e, int n) {
    e->xl.n = 0;
    if (n <= e->xl.cap) return KVB_OK;
    KVB_TRY(kvb_realloc_array((void **)&e->xl.x, (size_t)n, sizeof *e->xl.x));
    e->xl.cap = n;
    return KVB_OK;
}

static kvb_link_kind unit_link(const kvb__stage_unit *u) { return u->kind == KVB_RES_HOST ? KVB_LINK_HOST : KVB_LINK_PEER; }

static void *stage_buf(const kvb_engine *e, const kvb__stage_unit *u, int layer) {
    return kvb_stager_buffer(e->stager, 2 * u->buf + (layer & 1));
}

/* Posts layer `l`'s loads into the stage buffers, one transfer per link; tickets in t[link]. */
static kvb_status post_loads(kvb_engine *e, int l, uint64_t t[KVB_LINK_COUNT]) {
    size_t lb = layer_bytes(e);
    for (int k = KVB_LINK_HOST; k <= KVB_LINK_PEER; k++) {
        kvb_xfer *first = e->xl.x + e->xl.n;
        int n = 0;
        for (int u = 0; u < e->n_units; u++) {
            const kvb__stage_unit *su = &e->units[u];
            if (unit_link(su) != (kvb_link_kind)k || where(e, su->block, l) != su->kind) continue;
            *xl_add(e) = (kvb_xfer){stage_buf(e, su, l), su->src + (size_t)l * lb, lb};
            n++;
        }
        KVB_TRY(kvb_stager_post(e->stager, (kvb_link_kind)k, k == KVB_LINK_HOST ? KVB_XFER_H2D : KVB_XFER_D2D, first,
                                n, &t[k]));
        e->stats.lsc_loads += (uint64_t)n;
    }
    return KVB_OK;
}

/* Posts the stores of the rows layer `l` wrote into stage buffers back to where the blocks live (and,
 * for host copies, into the pool block too, which stays valid). The pool's rows are in place when this
 * returns: they go over the local link, which nothing orders against the host link's next loads into
 * the same buffers or a STORE copy order reading the pool block. */
static kvb_status post_stores(kvb_engine *e, int l) {
    size_t lb = layer_bytes(e), row = lb / 2 / (size_t)e->o.block_size, half = lb / 2;
    uint64_t t;
    for (int k = KVB_LINK_HOST; k <= KVB_LINK_LOCAL; k++) {
        kvb_xfer *first = e->xl.x + e->xl.n;
        int n = 0;
        for (int u = 0; u < e->n_units; u++) {
            const kvb__stage_unit *su = &e->units[u];
            if (su->dirty_lo >= su->dirty_hi || where(e, su->block, l) != su->kind) continue;
            if (k == KVB_LINK_LOCAL && su->kind != KVB_RES_HOST) continue;
            if (k != KVB_LINK_LOCAL && unit_link(su) != (kvb_link_kind)k) continue;
            unsigned char *buf = stage_buf(e, su, l);
            unsigned char *dst = k == KVB_LINK_LOCAL ? kvb_block_pool_block(e->pool, su->block) : su->src;
            dst += (size_t)l * lb;
            size_t r0 = (size_t)su->dirty_lo * row, nb = (size_t)(su->dirty_hi - su->dirty_lo) * row;
            *xl_add(e) = (kvb_xfer){dst + r0, buf + r0, nb};               /* K rows */
            *xl_add(e) = (kvb_xfer){dst + half + r0, buf + half + r0, nb}; /* V rows */
            n += 2;
            if (k != KVB_LINK_LOCAL) e->stats.lsc_stores++;
        }
        KVB_TRY(kvb_stager_post(e->stager, (kvb_link_kind)k, k == KVB_LINK_HOST ? KVB_XFER_D2H : KVB_XFER_D2D, first,
                                n, &t));
        if (k == KVB_LINK_LOCAL && n > 0) KVB_TRY(kvb_stager_wait(e->stager, t));
    }
    return KVB_OK;
}

/* Posts the plan's copy orders that go at `when` (LOADs: -2, at the start; STOREs: after layer `when`,
 * -1 at once); LOAD tickets go to load_t[layer they must precede]. */
static kvb_status post_copies(kvb_engine *e, int when, uint64_t *load_t) {
    const kvb_plan *p = &e->plan;
    size_t lb = layer_bytes(e);
    for (int c = 0; c < p->n_copies; c++) {
        const kvb_plan_copy *cp = &p->copies[c];
        int load = cp->dir == KVB_COPY_LOAD;
        if ((load && when != -2) || (!load && cp->layer != when)) continue;
        int32_t h;
        KVB_TRY(shadow_get(e, cp->block, &h));
        unsigned char *pool = (unsigned char *)kvb_block_pool_block(e->pool, cp->block) + (size_t)cp->layer0 * lb;
        unsigned char *host = (unsigned char *)kvb_block_pool_block(e->ht_pool, h) + (size_t)cp->layer0 * lb;
        size_t nb = (size_t)(cp->layer1 - cp->layer0) * lb;
        kvb_xfer *x = xl_add(e);
        *x = load ? (kvb_xfer){pool, host, nb} : (kvb_xfer){host, pool, nb};
        uint64_t t;
        KVB_TRY(kvb_stager_post(e->stager, KVB_LINK_HOST, load ? KVB_XFER_H2D : KVB_XFER_D2H, x, 1, &t));
        if (load) load_t[cp->layer] = t; /* the host link runs in order: the last ticket covers the rest */
        e->stats.copy_orders++;
    }
    return KVB_OK;
}

/* After the step: a host copy is stale where the step wrote its pool block other than through it;
 * stored layers are current. */
static void update_shadows(kvb_engine *e, int n_attn) {
    if (!e->shadow_cap) return;
    int bs = e->o.block_size, L = e->geom.n_layers;
    for (int i = 0; i < n_attn; i++) {
        const kvb_attn_seq *as = &e->b_seqs[i];
        int p0 = as->ctx_len - as->q_len, p1 = as->ctx_len;
        for (int bj = p0 / bs; bj <= (p1 - 1) / bs; bj++) {
            int32_t id = e->blk_id[as->blk_first + bj];
            if (id < 0 || id >= e->shadow_cap || e->shadow[id] < 0) continue;
            for (int l = 0; l < L; l++)
                if (where(e, id, l) != KVB_RES_HOST) e->shadow_ok[(size_t)id * L + l] = 0;
        }
    }
    for (int c = 0; c < e->plan.n_copies; c++) {
        const kvb_plan_copy *cp = &e->plan.copies[c];
        if (cp->dir == KVB_COPY_STORE) memset(e->shadow_ok + (size_t)cp->block * L + cp->layer0, 1, cp->layer1 - cp->layer0);
    }
}

/* Host copies for the plan's STOREs exist before the step's units point at them. */
static kvb_status prepare_shadows(kvb_engine *e) {
    for (int c = 0; c < e->plan.n_copies; c++) {
        int32_t h;
        if (e->plan.copies[c].dir == KVB_COPY_STORE) KVB_TRY(shadow_get(e, e->plan.copies[c].block, &h));
    }
    return KVB_OK;
}

/* ---------------------------------------------------------------- offloaded admissions' staging */

/* Layer l's slice of staging block k (two parities: layer l+1 is computed while layer l's rows go out). */
static void *off_slice(const kvb_engine *e, int k, int l) {
    return (char *)e->off_stage + ((size_t)(l & 1) * (size_t)e->n_off + (size_t)k) * layer_bytes(e);
}

/* The staging area of the step's offloaded admissions: from the planner's activation allocator (the
 * staging joins the step's activations, which Alg. 1 counted), else backend memory kept for later steps. */
static kvb_status off_stage_begin(kvb_engine *e) {
    if (e->n_off == 0) return KVB_OK;
    size_t bytes = 2 * (size_t)e->n_off * layer_bytes(e);
    if (e->act_alloc.iface) return e->act_alloc.iface->alloc(e->act_alloc.ctx, bytes, &e->off_stage);
    return backend_reserve(e, bytes, &e->off_stage, &e->off_stage_bytes);
}

/* After the step's copies are drained. */
static void off_stage_end(kvb_engine *e) {
    if (e->off_stage && e->act_alloc.iface) {
        e->act_alloc.iface->free(e->act_alloc.ctx, e->off_stage);
        e->off_stage = NULL;
    }
    e->n_off = 0;
}

/* After layer l: the rows it wrote into the staging blocks go to their host-tier blocks over the host link,
 * one transfer for the layer (the ticket in *t: the same parity is reused two layers later). */
static kvb_status post_offload_stores(kvb_engine *e, int n_blk, int l, uint64_t *t) {
    size_t lb = layer_bytes(e);
    kvb_xfer *first = e->xl.x + e->xl.n;
    int n = 0;
    for (int j = 0; j < n_blk; j++) {
        if (e->blk_off[j] < 0) continue;
        *xl_add(e) = (kvb_xfer){(char *)e->blk_base[j] + (size_t)l * lb, off_slice(e, e->blk_off[j], l), lb};
        n++;
    }
    return kvb_stager_post(e->stager, KVB_LINK_HOST, KVB_XFER_D2H, first, n, t);
}

/* ---------------------------------------------------------------- the step */

/* Asks the planner (or the built-in FCFS) for the plan and checks it. Nothing changes on failure. */
static kvb_status make_plan(kvb_engine *e) {
    KVB_TRY(kvb__view_build(e));
    kvb_plan_reset(&e->plan);
    const char *name = kvb_engine_planner_name(e);
    kvb_status st = e->planner.iface ? e->planner.iface->plan_step(e->planner.ctx, &e->view, &e->plan)
                                     : kvb_sched_fcfs(&e->view, NULL, &e->plan);
    if (st != KVB_OK) {
        snprintf(e->last_error, sizeof e->last_error, "planner %s failed: %s", name, kvb_status_str(st));
        KVB_LOG_E("engine: %s", e->last_error);
        return st;
    }
    st = kvb__plan_check(e, NULL);
    if (st == KVB_ERR_INVALID) KVB_LOG_E("engine: plan of %s refused: %s", name, e->last_error);
    return st;
}

/* The prefix loads of layer l (eLLM §4.3, swapped layers): every scheduled sequence reading layer l of its
 * released blocks from their host copies gets them into its scratch slices of the layer's parity, one
 * transfer over the host link; the ticket in e->t_pfx[l] (0: nothing to load). */
static kvb_status post_prefix_loads(kvb_engine *e, int n_sched, int l) {
    size_t lb = layer_bytes(e);
    int L = e->geom.n_layers, n = 0;
    kvb_xfer *first = e->xl.x + e->xl.n;
    e->t_pfx[l] = 0;
    for (int i = 0; i < n_sched; i++) {
        const kvb__seq *s = e->sched[i];
        if (l < L - s->n_swapl) continue;
        for (int j = 0; j < s->n_dropped; j++) {
            char *dst = (char *)e->scratch + ((size_t)(l & 1) * (size_t)e->scr_par + (size_t)(s->scr0 + j)) * lb;
            const char *src = (const char *)kvb_block_pool_block(e->ht_pool, s->pfx_bt.ids[j]) + (size_t)l * lb;
            *xl_add(e) = (kvb_xfer){dst, src, lb};
            n++;
        }
    }
    if (n == 0) return KVB_OK;
    e->stats.prefix_host_loads += (uint64_t)n;
    return kvb_stager_post(e->stager, KVB_LINK_HOST, KVB_XFER_H2D, first, n, &e->t_pfx[l]);
}

/* Layer l's slice of step entry j outside a sliced pool: a pool block's layer, a scratch slice (of the
 * layer's parity when the step loads prefix layers), or, above its sequence's recomputed layers, the
 * block a scratch entry stands for. */
static void *entry_layer(const kvb_engine *e, int j, int l) {
    int32_t id = e->blk_id[j];
    size_t lb = layer_bytes(e);
    if (id >= 0) return (char *)e->blk_base[j] + (size_t)l * lb;
    if (id == OFFLOAD_ID) return e->blk_base[j];
    if (e->blk_real[j] >= 0 && l >= e->blk_rec[j]) return (char *)kvb_block_pool_block(e->pool, e->blk_real[j]) + (size_t)l * lb;
    return (char *)e->scratch + ((size_t)(l & 1) * (size_t)e->scr_par + (size_t)(SCRATCH_ID(0) - id)) * lb;
}

/* ---------------------------------------------------------------- the mechanisms' hooks */

/* Every mechanism's step_begin; the union of their flags in *any. */
static kvb_status mechs_step_begin(kvb_engine *e, unsigned *any) {
    *any = 0;
    for (int k = 0; k < KVB__MECH_COUNT; k++) {
        kvb__mech *m = &e->mech[k];
        m->step = 0;
        if (!m->iface || !m->iface->step_begin) continue;
        KVB_TRY(m->iface->step_begin(m->ctx, e, &m->step));
        *any |= m->step;
    }
    return KVB_OK;
}

/* layer_in (out = 0) or layer_out (out = 1) of layer l, of the mechanisms active in this step. */
static kvb_status mechs_layer(kvb_engine *e, int l, int out) {
    for (int k = 0; k < KVB__MECH_COUNT; k++) {
        const kvb__mech *m = &e->mech[k];
        if (!(m->step & KVB__STEP_ACTIVE)) continue;
        kvb_status (*hook)(void *, kvb_engine *, int) = out ? m->iface->layer_out : m->iface->layer_in;
        if (hook) KVB_TRY(hook(m->ctx, e, l));
    }
    return KVB_OK;
}

static void mechs_step_end(kvb_engine *e, int ok) {
    for (int k = 0; k < KVB__MECH_COUNT; k++) {
        kvb__mech *m = &e->mech[k];
        if (m->iface && m->iface->step_end) m->iface->step_end(m->ctx, e, ok);
        m->step = 0;
    }
}

static void mechs_step_done(kvb_engine *e) {
    for (int k = 0; k < KVB__MECH_COUNT; k++) {
        const kvb__mech *m = &e->mech[k];
        if (m->iface && m->iface->step_done) m->iface->step_done(m->ctx, e);
    }
}

/* Runs the forward pass of the laid-out batch, layer by layer, with the stager's loads and stores. */
static kvb_status forward(kvb_engine *e, const kvb_batch *b, int n_sched, int n_blk, int n_units) {
    const kvb_model_config *c = kvb_model_cfg(e->m);
    kvb_backend *be = kvb_model_backend(e->m);
    int L = c->n_layers;
    uint64_t load_t[2][KVB_LINK_COUNT] = {{0}}; /* per parity */
    uint64_t *copy_t = e->t_copy;               /* the LOAD copy orders each layer waits for */
    int copies = e->plan.n_copies > 0, stores = 0, offs = e->n_off > 0;
    uint64_t off_t[2] = {0, 0}; /* per parity: the last stores out of the staging blocks */
    int pfx_xfers = 0, serial = e->plan.prefix_serial;
    for (int i = 0; i < n_sched; i++) pfx_xfers += e->sched[i]->n_dropped * e->sched[i]->n_swapl;
    int pfx = pfx_xfers > 0;
    for (int l = 0; l < L; l++) copy_t[l] = 0;
    int htl = e->n_htl > 0; /* host-tier hits loading layer by layer (host_layered) */
    if (htl) KVB_TRY(kvb__host_tier_post_loads(e));
    KVB_TRY(xl_reserve(e, (n_units * 5 + 2 + e->n_off) * L + e->plan.n_copies + pfx_xfers));
    if (copies) {
        KVB_TRY(post_copies(e, -2, copy_t));
        KVB_TRY(post_copies(e, -1, NULL));
    }
    for (int l = 0; n_units && l < KVB_MIN(2, L); l++) KVB_TRY(post_loads(e, l, load_t[l & 1]));
    for (int l = 0; pfx && !(serial & 1) && l < KVB_MIN(2, L); l++) KVB_TRY(post_prefix_loads(e, n_sched, l));
    KVB_TRY(off_stage_begin(e));
    unsigned flags;
    KVB_TRY(mechs_step_begin(e, &flags));
    KVB_TRY(kvb_forward_begin(e->fw, b));
    /* "without fusion" (§6.3): the recomputed rows' GEMMs apart from the new tokens' */
    if ((serial & 2) && e->main_rows < b->n_tokens) KVB_TRY(kvb_forward_split(e->fw, e->main_rows));
    int rows = b->n_tokens, seqs = b->attn.n_seqs; /* what the forward pass computes now */
    for (int l = 0; l < L; l++) {
        uint64_t tl = kvb_now_ns();
        if (copy_t[l]) KVB_TRY(kvb_stager_wait(e->stager, copy_t[l]));
        if (htl && e->t_htl[l]) KVB_TRY(kvb_stager_wait(e->stager, e->t_htl[l]));
        if (pfx && (serial & 1)) KVB_TRY(post_prefix_loads(e, n_sched, l)); /* "without overlap" (§6.3) */
        if (pfx && e->t_pfx[l]) KVB_TRY(kvb_stager_wait(e->stager, e->t_pfx[l]));
        if (e->l_rows[l] != rows || e->l_seqs[l] != seqs) { /* prefixes above their recomputed layers leave */
            rows = e->l_rows[l];
            seqs = e->l_seqs[l];
            KVB_TRY(kvb_forward_rows(e->fw, rows, seqs));
        }
        e->stats.recomputed_row_layers += (uint64_t)(rows - e->main_rows);
        if (e->sl) { /* a sliced pool: its manager places the slices (one attention sequence per request) */
            KVB_TRY(kvb__slices_layer(e, n_sched, l));
        } else {
            for (int j = 0; j < n_blk; j++) e->blk_layer[j] = entry_layer(e, j, l);
        }
        if (offs) { /* layer l writes into the staging parity whose rows of layer l-2 are out */
            if (off_t[l & 1]) KVB_TRY(kvb_stager_wait(e->stager, off_t[l & 1]));
            for (int j = 0; j < n_blk; j++)
                if (e->blk_off[j] >= 0) e->blk_layer[j] = off_slice(e, e->blk_off[j], l);
        }
        if (n_units) {
            for (int k = 0; k < KVB_LINK_COUNT; k++)
                if (load_t[l & 1][k]) KVB_TRY(kvb_stager_wait(e->stager, load_t[l & 1][k]));
            for (int j = 0; j < n_blk; j++) {
                int32_t id = e->blk_id[j];
                if (id < 0) continue;
                kvb_residency w = where(e, id, l);
                if (staged(w)) e->blk_layer[j] = stage_buf(e, &e->units[e->unit_of[(w == KVB_RES_HOST) * e->unit_of_cap + id]], l);
            }
        }
        KVB_TRY(mechs_layer(e, l, 0));
        e->t_wait[l] = kvb_now_ns() - tl;
        KVB_TRY(kvb_forward_layer(e->fw, l));
        if (e->sl) {
            /* the layer's kernels are done with its prefetch slots once the backend is idle */
            KVB_TRY(be->iface->sync(be->ctx));
            KVB_TRY(kvb__slices_layer_done(e, n_sched, l));
        }
        if (n_units || copies || offs || pfx) {
            /* the layer's kernels are done with its buffers once the backend is idle */
            KVB_TRY(be->iface->sync(be->ctx));
            if (pfx && !(serial & 1) && l + 2 < L) KVB_TRY(post_prefix_loads(e, n_sched, l + 2));
            if (offs) KVB_TRY(post_offload_stores(e, n_blk, l, &off_t[l & 1]));
            if (n_units) KVB_TRY(post_stores(e, l));
            if (copies) KVB_TRY(post_copies(e, l, NULL));
            if (n_units && l + 2 < L) KVB_TRY(post_loads(e, l + 2, load_t[l & 1]));
            stores = 1;
        }
        if (flags & KVB__STEP_SYNC) KVB_TRY(be->iface->sync(be->ctx));
        KVB_TRY(mechs_layer(e, l, 1));
        e->t_layer[l] = kvb_now_ns() - tl;
    }
    /* every copy is back before the step ends */
    if (stores || copies || pfx || (flags & KVB__STEP_DRAIN)) KVB_TRY(kvb_stager_drain(e->stager));
    if (htl) KVB_TRY(kvb__host_tier_finish_loads(e));
    return KVB_OK;
}

/* Issue 10: a waiting request that no longer fits the pool as it is now (loans went back, own blocks
 * lent) stalls; after stall_wait_s without blocks coming back it ends with an explicit error instead of
 * holding the queue for good (the FCFS scheduler serves up to stall_overtake later requests past it
 * meanwhile). One that fits again starts over. */
static void fail_stalled(kvb_engine *e) {
    if (e->sl) return; /* a sliced pool lends nothing */
    int n_blocks = kvb_block_pool_n_blocks(e->pool);
    uint64_t now = kvb_now_ns(), wait = e->o.stall_wait_s > 0 ? (uint64_t)(e->o.stall_wait_s * 1e9) : 0;
    for (kvb__seq *s = e->waiting.head; s;) {
        kvb__seq *next = s->next;
        int64_t need = kvb__seq_need_blocks(e, s);
        if (need <= n_blocks) {
            s->t_stall_ns = 0;
            s->n_overtaken = 0;
        } else if (!s->t_stall_ns) {
            s->t_stall_ns = now;
        } else if (wait && now - s->t_stall_ns >= wait) {
            KVB_LOG_W("engine: request %llu needs %lld KV blocks, the pool holds %d since its blocks were lent or "
                      "reclaimed, and none came back within %.1f s: it fails", (unsigned long long)s->id,
                      (long long)need, n_blocks, e->o.stall_wait_s);
            e->stats.stalled_failed++;
            kvb__finish(e, &e->waiting, s, KVB_FINISH_ERROR, KVB_ERR_EXHAUSTED);
        }
        s = next;
    }
}

kvb_status kvb__exec_step(kvb_engine *e) {
    uint64_t t0 = kvb_now_ns();
    fail_stalled(e);
    KVB_TRY(make_plan(e));
    const kvb_model_config *c = kvb_model_cfg(e->m);
    kvb_step_report rep = {.step = e->stats.steps, .t_plan_ns = kvb_now_ns() - t0, .n_layers = c->n_layers,
                           .t_layer_ns = e->t_layer, .t_wait_ns = e->t_wait};
    e->ht_batch = e->host_prefix; /* demotions go out in one transfer, before anything writes the pool */
    kvb_status st = apply_plan(e, &rep), fst;
    int n_sched = e->n_sched, n_blk = 0, n_attn = 0, n_units = 0;
    e->ht_batch = 0;
    fst = kvb__host_flush(e);
    if (st == KVB_OK) st = fst;
    if (st != KVB_OK || n_sched == 0) { /* no forward pass: layered loads of admissions the plan dropped land now */
        fst = kvb__host_tier_finish_loads(e);
        if (st == KVB_OK) st = fst;
    }
    if (st != KVB_OK) goto fail;
    if (n_sched == 0) return KVB_OK;
    kvb_batch b;
    KVB_TRY_GOTO(prepare_shadows(e), fail);
    KVB_TRY_GOTO(layout(e, n_sched, &b, &n_blk, &n_attn), fail);
    KVB_TRY_GOTO(index_residency(e), fail);
    KVB_TRY_GOTO(make_units(e, n_attn, n_blk, &n_units), fail_res);
    for (int i = 0; i < n_sched; i++) {
        rep.n_tokens += e->sched[i]->q_len;
        rep.n_absent_rows += e->sched[i]->n_absent;
        rep.n_prefill_seqs += e->sched[i]->q_len > 1;
    }
    rep.n_seqs = n_sched;
    if (e->sl) { /* request-level placements: install them, prefetch slots for the host layers */
        KVB_TRY_GOTO(kvb__slices_install(e, n_sched), fail_sl);
        KVB_TRY_GOTO(kvb__slices_step_begin(e, n_blk), fail_sl);
    }
    st = forward(e, &b, n_sched, n_blk, n_units);
    if (st != KVB_OK) {
        (void)kvb_stager_drain(e->stager); /* no copy may run on after the step */
        off_stage_end(e);
        goto fail_sl;
    }
    off_stage_end(e);
    update_shadows(e, n_attn);
    forget_units(e);
    unindex_residency(e);
    mechs_step_end(e, 1);
    st = kvb_forward_end(e->fw, e->logits);
    if (st != KVB_OK) {
        kvb__slices_step_end(e, 0); /* prefetch slots back; the failed step's rows are not counted */
        goto fail_ended;
    }
    kvb__slices_step_end(e, n_sched);
    offload_end(e, n_sched);
    mechs_step_done(e);
    e->stats.steps++;
    e->stats.max_running = KVB_MAX(e->stats.max_running, e->running.n);

    uint64_t now = kvb_wall_ns();
    int li = 0;
    for (int i = 0; i < n_sched; i++) {
        kvb__seq *s = e->sched[i];
        int decode = s->q_len == 1 && s->n_generated > 0 && s->n_computed == s->n_tokens - 1;
        if (!decode) e->stats.prompt_tokens += (uint64_t)s->q_len;
        s->n_computed += s->q_len;
        s->n_absent = 0;
        s->n_swapl = 0;
        s->restore_hi = 0;
        if (e->o.enable_prefix_cache) publish_full_blocks(e, s);
        if (s->n_computed != s->n_tokens) continue; /* prefill chunk: no token yet */
        const float *lg = e->logits + (size_t)li++ * c->vocab;
        int32_t tok = kvb_sample(&s->samp, &s->rng, lg, c->vocab, e->sample_scratch);
        int index = s->n_generated;
        if (e->ev.on_logits) e->ev.on_logits(e->ev.ud, s->id, index, lg, c->vocab);
        s->tokens[s->n_tokens++] = tok;
        s->n_generated++;
        e->stats.generated_tokens++;
        if (e->ev.on_token) e->ev.on_token(e->ev.ud, s->id, index, tok, now);
        kvb__seq_list *in = s->host_bt.n > 0 && s->bt.n == 0 ? &e->swapped : &e->running; /* offloaded: swapped */
        if (is_stop(s, tok)) kvb__finish(e, in, s, KVB_FINISH_STOP, KVB_OK);
        else if (s->n_generated >= s->max_tokens) kvb__finish(e, in, s, KVB_FINISH_LENGTH, KVB_OK);
    }
    rep.t_step_ns = kvb_now_ns() - t0;
    kvb_stager_take_report(e->stager, rep.links);
    if (e->planner.iface && e->planner.iface->observe) e->planner.iface->observe(e->planner.ctx, &rep);
    return KVB_OK;
fail_sl:
    kvb__slices_step_end(e, 0); /* prefetch slots back; the failed step's rows are not counted */
    forget_units(e);
fail_res:
    unindex_residency(e);
fail:
    mechs_step_end(e, 0);
fail_ended:
    (void)kvb__host_tier_finish_loads(e); /* a step that stopped before its forward pass */
    KVB_LOG_E("engine step failed: %s; failing %d live requests", kvb_status_str(st),
              e->waiting.n + e->running.n + e->swapped.n);
    kvb__seq_list *lists[] = {&e->running, &e->swapped, &e->waiting};
    for (int k = 0; k < 3; k++)
        while (lists[k]->head) kvb__finish(e, lists[k], lists[k]->head, KVB_FINISH_ERROR, st);
    return st;
}

void kvb__exec_free(kvb_engine *e) {
    free(e->sched);
    free(e->b_tokens);
    free(e->b_pos);
    free(e->b_seqs);
    free(e->b_logit_rows);
    free(e->blk_base);
    free(e->blk_layer);
    free(e->blk_id);
    free(e->blk_off);
    free(e->blk_real);
    free(e->blk_rec);
    free(e->pfx_ord);
    free(e->l_rows);
    free(e->l_seqs);
    free(e->t_pfx);
    free(e->logits);
    free(e->sample_scratch);
    free(e->t_layer);
    free(e->t_wait);
    free(e->t_copy);
    free(e->units);
    free(e->unit_of);
    free(e->res_first);
    free(e->res_next);
    free(e->xl.x);
    if (e->scratch || e->off_stage_bytes) {
        kvb_backend *be = kvb_model_backend(e->m);
        kvb_mem_free(be->mem, e->scratch);
        if (e->off_stage_bytes) kvb_mem_free(be->mem, e->off_stage);
    }
    free(e->shadow);
    free(e->shadow_ok);
    kvb_plan_free(&e->plan);
}
