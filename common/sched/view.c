/* kvbank — the planner's view (plan.h): plain data rebuilt from the engine before every plan_step and
 * every plan_pool, and the view's functions (kvb_view_ops): block references, the prefix probe, and the
 * mechanisms' checks, which the plan check (check.c) calls. */
#include <string.h>

#include "common/sched/state.h"

/* What a prefix probe found for one request of the view (valid while the view is). */
typedef struct kvb__memo {
    int done;            /* probed in this view */
    int n_hit;           /* pool blocks */
    int hit_off;         /* their ids: e->memo_ids[hit_off .. hit_off + n_hit), room for every full block */
    int n_host_hit;      /* host-tier blocks after them */
    uint64_t last_hash;  /* chained hash after all the hits (pool and host) */
} kvb__memo;


static kvb_status view_reserve(kvb_engine *e, int n) {
    if (n > e->vcap) {
        int cap = KVB_MAX(n, 2 * e->vcap);
        KVB_TRY(kvb_realloc_array((void **)&e->vreqs, (size_t)cap, sizeof *e->vreqs));
        KVB_TRY(kvb_realloc_array((void **)&e->vseq, (size_t)cap, sizeof *e->vseq));
        KVB_TRY(kvb_realloc_array((void **)&e->memo, (size_t)cap, sizeof *e->memo));
        e->vcap = cap;
    }
    int hc = 16;
    while (hc < 2 * n) hc *= 2;
    if (hc > e->vhash_cap) {
        KVB_TRY(kvb_realloc_array((void **)&e->vhash, (size_t)hc, sizeof *e->vhash));
        e->vhash_cap = hc;
    }
    return KVB_OK;
}

static void view_add(kvb_engine *e, kvb__seq *s, kvb_req_state state) {
    int i = e->view.n_reqs++;
    int exclusive = 0, swapped = state == KVB_REQ_SWAPPED;
    if (state == KVB_REQ_RUNNING || state == KVB_REQ_PAUSED)
        for (int j = 0; j < s->bt.n; j++) exclusive += kvb_block_pool_refcount(e->pool, s->bt.ids[j]) == 1;
    e->vreqs[i] = (kvb_req_view){.id = s->id, .arrival = s->arrival, .t_arrival_ns = s->t_add_ns, .state = state,
                                 .n_prompt = s->n_prompt, .n_tokens = s->n_tokens, .n_generated = s->n_generated,
                                 .max_tokens = s->max_tokens, .tbt_slo_ns = s->slo_ns, .n_computed = s->n_computed,
                                 .n_blocks = swapped ? s->host_bt.n : s->bt.n, .n_exclusive = exclusive,
                                 .blocks = swapped ? s->host_bt.ids : s->bt.ids, .n_dropped = s->n_dropped,
                                 .n_overtaken = s->n_overtaken, .tokens = s->tokens, .n_cached = s->n_published,
                                 .cache_hash = s->last_hash};
    for (int k = 0; k < KVB__MECH_COUNT; k++) {
        const kvb__mech *m = &e->mech[k];
        if (m->iface && m->iface->view_req) m->iface->view_req(m->ctx, e, s, &e->vreqs[i]);
    }
    e->vseq[i] = s;
    /* a probe finds at most the request's full blocks, leaving a token to compute for the logits (any
     * request may be probed: one the plan preempts may be admitted again) */
    e->memo[i] = (kvb__memo){.hit_off = e->memo_n};
    if (e->o.enable_prefix_cache) e->memo_n += KVB_MAX((s->n_tokens - 1) / e->o.block_size, 0);
    s->vidx = i;
    uint32_t mask = (uint32_t)e->vhash_cap - 1;
    uint32_t h = kvb_view_hash(s->id) & mask;
    while (e->vhash[h] >= 0) h = (h + 1) & mask;
    e->vhash[h] = i;
}

/* ---------------------------------------------------------------- the view's functions */

static int view_block_ref(void *ctx, int32_t id) {
    const kvb_engine *e = ctx;
    return kvb_block_pool_refcount(e->pool, id);
}

static int view_block_free(void *ctx, int32_t id) {
    const kvb_engine *e = ctx;
    return kvb_block_pool_is_free(e->pool, id);
}

/* Probes request req's prefix once per view, under the lock: a planner's thread may probe too. */
static kvb_status view_probe(void *ctx, int req, kvb_view_hits *out) {
    kvb_engine *e = ctx;
    kvb_status st = KVB_OK;
    pthread_mutex_lock(&e->memo_mu);
    kvb__memo *m = &e->memo[req];
    if (!m->done) {
        const kvb__seq *s = e->vseq[req];
        int bs = e->o.block_size;
        /* the view's whole memo at the first probe, so that the ids handed out never move */
        if (e->memo_n > e->memo_cap) {
            st = kvb_realloc_array((void **)&e->memo_ids, (size_t)e->memo_n, sizeof *e->memo_ids);
            if (st == KVB_OK) e->memo_cap = e->memo_n;
        }
        /* a request owing prompt logprobs computes its whole prompt (vLLM skips the prefix cache for
         * them too): the logits of cached positions were never computed */
        int max_blocks = s->plp_next > 0 ? 0 : (s->n_tokens - 1) / bs;
        if (st == KVB_OK) {
            *m = (kvb__memo){.done = 1, .last_hash = KVB_PREFIX_ROOT, .hit_off = m->hit_off};
            if (e->o.enable_prefix_cache && max_blocks > 0) {
                m->n_hit = kvb_prefix_cache_peek_from(e->pc, KVB_PREFIX_ROOT, s->tokens, s->n_tokens, max_blocks,
                                                      e->memo_ids + m->hit_off, &m->last_hash);
                if (e->ht_pc && e->host_prefix && m->n_hit < max_blocks)
                    m->n_host_hit = kvb__host_tier_peek(e, m->last_hash, s->tokens + (size_t)m->n_hit * bs,
                                                        max_blocks - m->n_hit, &m->last_hash);
            }
        }
    }
    if (st == KVB_OK)
        *out = (kvb_view_hits){.n_hit = m->n_hit, .ids = e->memo_ids + m->hit_off, .n_host_hit = m->n_host_hit,
                               .last_hash = m->last_hash};
    pthread_mutex_unlock(&e->memo_mu);
    return st;
}

static kvb_status view_check_op(void *ctx, kvb_acct *a, const kvb_plan_op *op, int k, char *err, size_t len) {
    const kvb_engine *e = ctx;
    for (int i = 0; i < KVB__MECH_COUNT; i++) {
        const kvb__mech *m = &e->mech[i];
        if (m->iface && m->iface->check_op) KVB_TRY(m->iface->check_op(m->ctx, e, a, op, k, err, len));
    }
    return KVB_OK;
}

static kvb_status view_check_plan(void *ctx, kvb_acct *a, const kvb_plan *p, char *err, size_t len) {
    const kvb_engine *e = ctx;
    for (int i = 0; i < KVB__MECH_COUNT; i++) {
        const kvb__mech *m = &e->mech[i];
        if (m->iface && m->iface->check_plan) KVB_TRY(m->iface->check_plan(m->ctx, e, a, p, err, len));
    }
    return KVB_OK;
}

static const kvb_view_ops view_ops = {
    .block_ref = view_block_ref,
    .block_free = view_block_free,
    .probe = view_probe,
    .check_op = view_check_op,
    .check_plan = view_check_plan,
};

/* ---------------------------------------------------------------- building it */

kvb_status kvb__view_build(kvb_engine *e) {
    int n = e->running.n + e->swapped.n + e->waiting.n;
    KVB_TRY(view_reserve(e, n));
    for (int i = 0; i < e->vhash_cap; i++) e->vhash[i] = -1;
    kvb_view *v = &e->view;
    v->geom = &e->geom;
    v->max_batch_tokens = e->o.max_batch_tokens;
    v->max_rows = e->max_rows;
    v->max_seqs = e->o.max_seqs;
    v->max_model_len = e->o.max_model_len;
    v->prefix_cache = e->o.enable_prefix_cache;
    v->stall_overtake = KVB_MAX(e->o.stall_overtake, 0);
    v->step = e->stats.steps;
    v->now_ns = kvb_wall_ns();
    int n_free = kvb_block_pool_n_free(e->pool);
    v->pool = (kvb_pool_view){.capacity = kvb_block_pool_capacity(e->pool), .n_own = kvb_block_pool_n_own(e->pool),
                              .n_borrowed = e->n_borrowed, .n_blocks = kvb_block_pool_n_blocks(e->pool),
                              .n_free = n_free, .n_evictable = kvb_prefix_cache_n_available(e->pc) - n_free,
                              .stage_slots = kvb_stager_n_buffers(e->stager) / 2,
                              .n_slices = kvb_block_pool_n_slices(e->pool),
                              .n_free_slices = kvb_block_pool_n_free_slices(e->pool)};
    if (kvb__sliced(e)) v->pool.n_free_ids = kvb_block_pool_n_free_ids(e->pool);
    if (e->ht_pool) {
        int hf = kvb_block_pool_n_free(e->ht_pool);
        v->pool.host_capacity = kvb_block_pool_n_blocks(e->ht_pool);
        v->pool.host_free = hf;
        v->pool.host_evictable = kvb_prefix_cache_n_available(e->ht_pc) - hf;
    }
    e->memo_n = 0;
    v->n_reqs = 0;
    for (kvb__seq *s = e->running.head; s; s = s->next) view_add(e, s, s->paused ? KVB_REQ_PAUSED : KVB_REQ_RUNNING);
    v->n_running = v->n_reqs;
    for (kvb__seq *s = e->swapped.head; s; s = s->next) view_add(e, s, KVB_REQ_SWAPPED);
    v->n_swapped = v->n_reqs - v->n_running;
    for (kvb__seq *s = e->waiting.head; s; s = s->next) view_add(e, s, KVB_REQ_WAITING);
    v->n_waiting = v->n_reqs - v->n_running - v->n_swapped;
    v->reqs = e->vreqs;
    v->model = &e->model_info;
    v->links = &e->o.links; /* the stager's, which copied them (it may not exist yet at SETUP) */
    v->index = e->vhash;
    v->index_mask = (uint32_t)e->vhash_cap - 1;
    v->ops = &view_ops;
    v->ops_ctx = e;
    return KVB_OK;
}

kvb_status kvb__plan_check(kvb_engine *e, kvb_plan_cost *cost) {
    return kvb_sched_cost(&e->view, &e->plan, cost, e->last_error, sizeof e->last_error);
}

kvb_status kvb__plan_pool(kvb_engine *e, const kvb_pool_event *ev, kvb_pool_plan *out) {
    if (!e->planner.iface || !e->planner.iface->plan_pool) return KVB_OK;
    KVB_TRY(kvb__view_build(e));
    kvb_status st = e->planner.iface->plan_pool(e->planner.ctx, ev, &e->view, out);
    if (st != KVB_OK) KVB_LOG_E("engine: plan_pool of %s failed: %s", e->planner.iface->name, kvb_status_str(st));
    return st;
}

void kvb__view_free(kvb_engine *e) {
    free(e->vreqs);
    free(e->vseq);
    free(e->vhash);
    free(e->memo);
    free(e->memo_ids);
    pthread_mutex_destroy(&e->memo_mu);
}
