/* kvbank — the queue and the scheduler: requests and their lists, the view a planner plans from, the
 * accounting every plan is checked with, and vLLM's FCFS scheduling as a routine planners call
 * (common/sched/scheduler.h). */
#include <assert.h>
#include <limits.h>
#include <stdarg.h>
#include <stdio.h>
#include <string.h>

#include "common/sched/state.h"

/* ---------------------------------------------------------------- lists and sequences */

void kvb__list_remove(kvb__seq_list *l, kvb__seq *s) {
    if (s->prev) s->prev->next = s->next;
    else l->head = s->next;
    if (s->next) s->next->prev = s->prev;
    else l->tail = s->prev;
    s->prev = s->next = NULL;
    l->n--;
}

/* Inserts keeping the list ordered by arrival (new arrivals go to the tail in O(1)). */
void kvb__list_insert_ordered(kvb__seq_list *l, kvb__seq *s) {
    kvb__seq *after = l->tail;
    while (after && after->arrival > s->arrival) after = after->prev;
    s->prev = after;
    s->next = after ? after->next : l->head;
    if (after) after->next = s;
    else l->head = s;
    if (s->next) s->next->prev = s;
    else l->tail = s;
    l->n++;
}

kvb__seq *kvb__find_seq(const kvb__seq_list *l, uint64_t id) {
    for (kvb__seq *s = l->head; s; s = s->next)
        if (s->id == id) return s;
    return NULL;
}

void kvb__block_forget(kvb_engine *e, int32_t id) {
    for (int k = 0; k < KVB__MECH_COUNT; k++) {
        const kvb__mech *m = &e->mech[k];
        if (m->iface && m->iface->block_free) m->iface->block_free(m->ctx, e, id);
    }
}

void kvb__block_unref(kvb_engine *e, int32_t id) {
    if (kvb_block_pool_refcount(e->pool, id) == 1) kvb__block_forget(e, id);
    kvb_block_pool_unref(e->pool, id);
}

void kvb__seq_release_blocks(kvb_engine *e, kvb__seq *s) {
    for (int j = 0; j < s->bt.n; j++)
        if (kvb_block_pool_refcount(e->pool, s->bt.ids[j]) == 1) kvb__block_forget(e, s->bt.ids[j]);
    kvb_block_table_release(&s->bt, e->pool); /* newest first, for the prefix cache's LRU */
}

void kvb__seq_free(kvb_engine *e, kvb__seq *s) {
    kvb__seq_release_blocks(e, s);
    kvb__mechs_seq_release(e, s, KVB__RELEASE_SEQ);
    kvb_block_table_free(&s->bt);
    if (e->ht_pool) kvb_block_table_release(&s->host_bt, e->ht_pool);
    kvb_block_table_free(&s->host_bt);
    free(s->tokens);
    free(s->stop);
    free(s);
}

void kvb__seq_drop_kv(kvb_engine *e, kvb__seq *s) {
    kvb__seq_release_blocks(e, s);
    s->n_dropped = 0;
    s->restore_hi = 0;
    kvb__mechs_seq_release(e, s, KVB__RELEASE_KV);
    s->n_computed = 0;
    s->n_published = 0;
    s->last_hash = KVB_PREFIX_ROOT;
    s->hits_taken = 0;
}

void kvb__finish(kvb_engine *e, kvb__seq_list *l, kvb__seq *s, kvb_finish why, kvb_status err) {
    kvb__list_remove(l, s);
    uint64_t id = s->id;
    kvb__seq_free(e, s);
    if (e->ev.on_finish) e->ev.on_finish(e->ev.ud, id, why, err);
}

void kvb__preempt_seq(kvb_engine *e, kvb__seq *victim) {
    KVB_LOG_D("preempting request %llu (%d tokens, %d blocks) by recompute", (unsigned long long)victim->id,
              victim->n_tokens, victim->bt.n);
    kvb__list_remove(&e->running, victim);
    kvb__seq_drop_kv(e, victim);
    victim->paused = 0;
    kvb__list_insert_ordered(&e->waiting, victim);
    e->stats.preemptions++;
}

int64_t kvb__seq_need_blocks(const kvb_engine *e, const kvb__seq *s) {
    return KVB_DIV_CEIL((int64_t)s->cap, e->o.block_size);
}

/* ---------------------------------------------------------------- requests */

/* Records and logs why a request is rejected; returns KVB_ERR_INVALID. */
__attribute__((format(printf, 3, 4))) static kvb_status reject(kvb_engine *e, uint64_t id, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(e->last_error, sizeof e->last_error, fmt, ap);
    va_end(ap);
    KVB_LOG_W("request %llu rejected: %s", (unsigned long long)id, e->last_error);
    return KVB_ERR_INVALID;
}

kvb_status kvb__sched_add(kvb_engine *e, const kvb_request *r) {
    const kvb_model_config *c = kvb_model_cfg(e->m);
    if (!r->prompt || r->n_prompt < 1) return reject(e, r->id, "empty prompt");
    if (r->max_tokens < 1) return reject(e, r->id, "max_tokens must be at least 1");
    if (r->resume_index < 0 || r->resume_index >= r->n_prompt)
        return reject(e, r->id, "resume_index %d must be in [0, %d) (the prompt length)", r->resume_index, r->n_prompt);
    for (int i = 0; i < r->n_prompt; i++) {
        if (r->prompt[i] < 0 || r->prompt[i] >= c->vocab)
            return reject(e, r->id, "prompt token %d = %d is outside the vocabulary [0, %d)", i, r->prompt[i], c->vocab);
    }
    if (!(r->tbt_slo_ms >= 0 && r->tbt_slo_ms <= 3.6e6))
        return reject(e, r->id, "tbt_slo_ms %g must be in [0, 3600000] (0: the model's default)", r->tbt_slo_ms);
    if (kvb_sampling_check(&r->sampling) != KVB_OK)
        return reject(e, r->id, "invalid sampling parameters (temperature >= 0, top_k >= 0, top_p in [0, 1])");
    int64_t total = (int64_t)r->n_prompt + r->max_tokens;
    if (total > e->o.max_model_len)
        return reject(e, r->id, "prompt (%d) + max_tokens (%d) exceeds the model length %d", r->n_prompt, r->max_tokens,
                      e->o.max_model_len);
    /* never fit: more than the own memory (lent-out part included) plus what is borrowed now */
    int64_t most = (int64_t)kvb_block_pool_capacity(e->pool) + e->n_borrowed;
    int64_t blocks = KVB_DIV_CEIL(total, e->o.block_size);
    if (kvb__sliced(e)) { /* sliced: the ids (host homes), and the device slices the planner needs at least */
        int64_t slices = (int64_t)kvb_block_pool_capacity(e->pool) * c->n_layers;
        if (blocks > kvb_block_pool_id_limit(e->pool) || blocks * kvb__slices_min_layers(e) > slices)
            return reject(e, r->id, "%lld tokens can never fit: %lld blocks of %d, %d block ids, %lld device slices "
                          "of which the planner needs %d per block", (long long)total, (long long)blocks,
                          e->o.block_size, kvb_block_pool_id_limit(e->pool), (long long)slices,
                          kvb__slices_min_layers(e));
    } else if (blocks > most) {
        return reject(e, r->id, "%lld tokens can never fit in %lld KV blocks of %d", (long long)total, (long long)most,
                      e->o.block_size);
    }
    if (kvb__find_seq(&e->waiting, r->id) || kvb__find_seq(&e->running, r->id) || kvb__find_seq(&e->swapped, r->id))
        return reject(e, r->id, "duplicate id");
    kvb__seq *s = NULL;
    KVB_TRY(kvb_calloc(1, sizeof *s, (void **)&s));
    s->cap = (int)total;
    kvb_status st;
    KVB_TRY_GOTO(kvb_malloc((size_t)s->cap * sizeof(int32_t), (void **)&s->tokens), fail);
    if (r->n_stop > 0) {
        KVB_TRY_GOTO(kvb_malloc((size_t)r->n_stop * sizeof(int32_t), (void **)&s->stop), fail);
        memcpy(s->stop, r->stop_ids, (size_t)r->n_stop * sizeof(int32_t));
        s->n_stop = r->n_stop;
    }
    memcpy(s->tokens, r->prompt, (size_t)r->n_prompt * sizeof(int32_t));
    s->id = r->id;
    s->arrival = e->next_arrival++;
    s->t_add_ns = kvb_wall_ns();
    s->n_tokens = s->n_prompt = r->n_prompt;
    s->max_tokens = r->max_tokens;
    s->slo_ns = (uint64_t)(r->tbt_slo_ms * 1e6 + 0.5);
    s->samp = r->sampling;
    kvb_rng_seed(&s->rng, r->sampling.seed);
    /* A resumed request's earlier tokens each took one draw (kvb_sample draws once per token when it
     * samples at all): continue the same random stream after them. */
    for (int k = 0; r->sampling.temperature > 0 && k < r->resume_index; k++) kvb_rng_uniform(&s->rng);
    s->last_hash = KVB_PREFIX_ROOT;
    s->vidx = -1;
    kvb__list_insert_ordered(&e->waiting, s);
    return KVB_OK;
fail:
    free(s->tokens);
    free(s);
    return st;
}

/* ---------------------------------------------------------------- the view */

static uint32_t id_hash(uint64_t id) { return (uint32_t)((id * 0x9E3779B97F4A7C15ull) >> 32); }

static kvb_status view_reserve(kvb_engine *e, int n) {
    if (n > e->vcap) {
        int cap = KVB_MAX(n, 2 * e->vcap);
        KVB_TRY(kvb_realloc_array((void **)&e->vreqs, (size_t)cap, sizeof *e->vreqs));
        KVB_TRY(kvb_realloc_array((void **)&e->vseq, (size_t)cap, sizeof *e->vseq));
        KVB_TRY(kvb_realloc_array((void **)&e->memo, (size_t)cap, sizeof *e->memo));
        KVB_TRY(kvb_realloc_array((void **)&e->astate, (size_t)cap, sizeof *e->astate));
        KVB_TRY(kvb_realloc_array((void **)&e->asched, (size_t)cap, sizeof *e->asched));
        KVB_TRY(kvb_realloc_array((void **)&e->adrop, (size_t)cap, sizeof *e->adrop));
        KVB_TRY(kvb_realloc_array((void **)&e->anew, (size_t)cap, sizeof *e->anew));
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
                                 .n_overtaken = s->n_overtaken};
    kvb__mechs_view_req(e, s, &e->vreqs[i]);
    e->vseq[i] = s;
    e->memo[i].done = 0;
    s->vidx = i;
    uint32_t mask = (uint32_t)e->vhash_cap - 1;
    uint32_t h = id_hash(s->id) & mask;
    while (e->vhash[h] >= 0) h = (h + 1) & mask;
    e->vhash[h] = i;
}

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
    if (e->ht_pool) {
        int hf = kvb_block_pool_n_free(e->ht_pool);
        v->pool.host_capacity = kvb_block_pool_n_blocks(e->ht_pool);
        v->pool.host_free = hf;
        v->pool.host_evictable = kvb_prefix_cache_n_available(e->ht_pc) - hf;
    }
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
    v->engine = e;
    e->memo_n = 0;
    return KVB_OK;
}

int kvb_view_find(const kvb_view *v, uint64_t id) {
    const kvb_engine *e = v->engine;
    if (!e || v != &e->view) return -1;
    uint32_t mask = (uint32_t)e->vhash_cap - 1;
    for (uint32_t h = id_hash(id) & mask;; h = (h + 1) & mask) {
        int i = e->vhash[h];
        if (i < 0) return -1;
        if (e->vreqs[i].id == id) return i;
    }
}

/* The engine behind a view, for the scheduler's own bookkeeping (scratch, memo): the routines are
 * the engine's code running on its thread during plan_step. */
static kvb_engine *view_engine(const kvb_view *v) { return (kvb_engine *)v->engine; }

/* ---------------------------------------------------------------- prefix probes */

static kvb_status memo_reserve(kvb_engine *e, int more) {
    if (e->memo_n + more <= e->memo_cap) return KVB_OK;
    int cap = KVB_MAX(e->memo_n + more, 2 * e->memo_cap);
    KVB_TRY(kvb_realloc_array((void **)&e->memo_ids, (size_t)cap, sizeof *e->memo_ids));
    e->memo_cap = cap;
    return KVB_OK;
}

kvb_status kvb__probe_memo(kvb_engine *e, int vidx, const kvb__memo **out) {
    kvb__memo *m = &e->memo[vidx];
    if (!m->done) {
        const kvb__seq *s = e->vseq[vidx];
        int bs = e->o.block_size;
        *m = (kvb__memo){.done = 1, .last_hash = KVB_PREFIX_ROOT, .hit_off = e->memo_n};
        if (e->o.enable_prefix_cache) {
            /* full blocks, leaving at least one token to compute for the logits */
            int max_blocks = (s->n_tokens - 1) / bs;
            if (max_blocks > 0) {
                KVB_TRY(memo_reserve(e, max_blocks));
                m->n_hit = kvb_prefix_cache_peek_from(e->pc, KVB_PREFIX_ROOT, s->tokens, s->n_tokens, max_blocks,
                                                      e->memo_ids + e->memo_n, &m->last_hash);
                e->memo_n += m->n_hit;
                if (e->ht_pc && e->host_prefix && m->n_hit < max_blocks)
                    m->n_host_hit = kvb__host_tier_peek(e, m->last_hash, s->tokens + (size_t)m->n_hit * bs,
                                                        max_blocks - m->n_hit, &m->last_hash);
            }
        }
    }
    *out = m;
    return KVB_OK;
}

/* ---------------------------------------------------------------- accounting */

/* The state of a plan being checked or built: what the operations so far leave of the pool, the
 * budget and the requests. One lives at a time per engine (its scratch is the engine's). */
typedef struct acct {
    kvb_engine *e;
    const kvb_view *v;
    int64_t avail;     /* blocks allocation can give (free + evictable) */
    int tokens, rows, n_sched, n_running;
    int64_t touched;   /* blocks the scheduled requests hold after the plan (an upper bound of staged ones) */
    int host_left;
    int budget, batch_limit;
} acct;

static kvb_status acct_begin(kvb_engine *e, const kvb_view *v, acct *a) {
    int ids = kvb_block_pool_id_limit(e->pool);
    if (ids > e->adj_cap) {
        KVB_TRY(kvb_realloc_array((void **)&e->adj, (size_t)ids, sizeof *e->adj));
        memset(e->adj + e->adj_cap, 0, (size_t)(ids - e->adj_cap) * sizeof *e->adj);
        e->adj_cap = ids;
    }
    e->adj_n = 0;
    for (int i = 0; i < v->n_reqs; i++) {
        e->astate[i] = v->reqs[i].state;
        e->asched[i] = 0;
        e->adrop[i] = v->reqs[i].n_dropped;
        e->anew[i] = 0;
    }
    /* a sliced pool counts ids here (its slices are checked apart, kvb__slices_check) */
    int64_t free_blocks = kvb__sliced(e) ? kvb_block_pool_n_free_ids(e->pool) : v->pool.n_free;
    *a = (acct){.e = e, .v = v, .avail = free_blocks + v->pool.n_evictable, .n_running = v->n_running,
                .host_left = v->pool.host_free + v->pool.host_evictable, .budget = v->max_batch_tokens,
                .batch_limit = v->max_seqs};
    return KVB_OK;
}

static void acct_end(acct *a) {
    kvb_engine *e = a->e;
    for (int i = 0; i < e->adj_n; i++) e->adj[e->adj_touched[i]] = 0;
    e->adj_n = 0;
}

/* Refcount of block `id` once the plan's operations so far are applied. */
static int eff_ref(const acct *a, int32_t id) { return kvb_block_pool_refcount(a->e->pool, id) + a->e->adj[id]; }

static kvb_status adj_add(acct *a, int32_t id, int d) {
    kvb_engine *e = a->e;
    if (e->adj[id] == 0) {
        if (e->adj_n == e->adj_touched_cap) {
            int cap = e->adj_touched_cap ? 2 * e->adj_touched_cap : 64;
            KVB_TRY(kvb_realloc_array((void **)&e->adj_touched, (size_t)cap, sizeof *e->adj_touched));
            e->adj_touched_cap = cap;
        }
        e->adj_touched[e->adj_n++] = id;
    }
    e->adj[id] += d;
    return KVB_OK;
}

/* Blocks releasing request i (preempt, swap out) gives back, and the release itself. */
static kvb_status acct_release(acct *a, int i, int *freed) {
    const kvb_req_view *r = &a->v->reqs[i];
    *freed = 0;
    for (int j = 0; j < r->n_blocks; j++) {
        *freed += eff_ref(a, r->blocks[j]) == 1;
        KVB_TRY(adj_add(a, r->blocks[j], -1));
    }
    return KVB_OK;
}

/* New blocks a RUN of q tokens needs (a DROP's releases and restores keep the logical count: the
 * released leading blocks count as present, since a RUN never writes them). */
static int64_t run_need(const acct *a, int i, int q) {
    const kvb_req_view *r = &a->v->reqs[i];
    int64_t need = KVB_DIV_CEIL((int64_t)r->n_computed + q, a->v->geom->block_size) - r->n_blocks - r->n_dropped;
    return need > 0 ? need : 0;
}

/* What admitting request i with at most q tokens costs: the tokens it computes and the blocks it takes
 * (idle prefix hits it references, host hits loaded into new blocks, blocks for the new tokens).
 * With `take`, the hits are counted as referenced from now on. */
static kvb_status admit_cost(acct *a, int i, int q, int take, int *q_eff, int64_t *blocks, int64_t *n_new) {
    const kvb__memo *m;
    KVB_TRY(kvb__probe_memo(a->e, i, &m));
    const kvb_req_view *r = &a->v->reqs[i];
    int bs = a->v->geom->block_size;
    int64_t cost = m->n_host_hit;
    for (int j = 0; j < m->n_hit; j++) {
        int32_t id = a->e->memo_ids[m->hit_off + j];
        if (eff_ref(a, id) == 0) cost++;
        if (take) KVB_TRY(adj_add(a, id, 1));
    }
    int have = m->n_hit + m->n_host_hit, computed = have * bs;
    *q_eff = KVB_MIN(q, r->n_tokens - computed);
    int64_t need = KVB_DIV_CEIL((int64_t)computed + *q_eff, bs) - have;
    if (need < 0) need = 0;
    *blocks = cost + need;
    if (n_new) *n_new = need;
    return KVB_OK;
}

/* Idle hits of request i that admitting it would take out of the available count (no change). */
static kvb_status idle_hits(acct *a, int i, int *out) {
    const kvb__memo *m;
    KVB_TRY(kvb__probe_memo(a->e, i, &m));
    *out = 0;
    for (int j = 0; j < m->n_hit; j++) *out += eff_ref(a, a->e->memo_ids[m->hit_off + j]) == 0;
    return KVB_OK;
}

kvb_status kvb__refuse(char *err, size_t len, const char *fmt, ...) {
    if (err && len) {
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(err, len, fmt, ap);
        va_end(ap);
    }
    return KVB_ERR_INVALID;
}

/* A placed RUN or ADMIT (op->placed): the request's blocks are block0 + j. Its existing blocks must be
 * laid out so, and the `more` blocks after them must be free now and not taken by an earlier operation
 * of the plan (they are counted as taken from here on). */
static kvb_status acct_place(acct *a, int i, const kvb_plan_op *op, int64_t more, int k, char *err, size_t len) {
    const kvb_req_view *r = &a->v->reqs[i];
    unsigned long long id = (unsigned long long)op->id;
    const char *kind = kvb_op_kind_str(op->kind);
    kvb_block_pool *pool = a->e->pool;
    if (a->v->prefix_cache)
        return kvb__refuse(err, len, "plan op %d (%s request %llu): placed blocks need the prefix cache off", k, kind, id);
    int have = op->kind == KVB_OP_RUN ? r->n_blocks : 0;
    if (op->block0 < 0 || (int64_t)op->block0 + have + more > kvb_block_pool_n_own(pool))
        return kvb__refuse(err, len, "plan op %d (%s request %llu): blocks from %d on are outside the own pool of %d", k, kind,
                      id, (int)op->block0, kvb_block_pool_n_own(pool));
    for (int j = 0; j < have; j++) {
        /* swapped in earlier in this plan: its view lists host blocks, its pool blocks are the ones taken */
        int ok = a->e->asched[i] & 4 ? eff_ref(a, op->block0 + j) == 1 : r->blocks[j] == op->block0 + j;
        if (!ok)
            return kvb__refuse(err, len, "plan op %d (%s request %llu): its block %d is not block %d", k, kind, id, j,
                          (int)(op->block0 + j));
    }
    for (int64_t j = have; j < have + more; j++) {
        int32_t b = (int32_t)(op->block0 + j);
        /* free now, or released by an earlier operation of this plan (a PREEMPT before a fetch into its slot) */
        if (eff_ref(a, b) != 0 || (a->e->adj[b] == 0 && !kvb_block_pool_is_free(pool, b)))
            return kvb__refuse(err, len, "plan op %d (%s request %llu): block %d is not free", k, kind, id, (int)b);
        KVB_TRY(adj_add(a, b, 1));
    }
    return KVB_OK;
}

/* Applies one operation to the accounting, checking it. `k` is its index in the plan (for messages). */
static kvb_status acct_op(acct *a, const kvb_plan_op *op, int k, char *err, size_t len) {
    const kvb_view *v = a->v;
    const char *kind = kvb_op_kind_str(op->kind);
    unsigned long long id = (unsigned long long)op->id;
    int i = kvb_view_find(v, op->id);
    if (i < 0) return kvb__refuse(err, len, "plan op %d (%s): no live request has id %llu", k, kind, id);
    const kvb_req_view *r = &v->reqs[i];
    kvb_req_state st = a->e->astate[i];
    switch (op->kind) {
    case KVB_OP_RUN: {
        if (st != KVB_REQ_RUNNING)
            return kvb__refuse(err, len, "plan op %d (RUN request %llu): the request is %s, not running", k, id,
                          kvb_req_state_str(st));
        if (a->e->asched[i] & 3)
            return kvb__refuse(err, len, "plan op %d (RUN request %llu): the request is already scheduled in this step", k, id);
        int left = r->n_tokens - r->n_computed;
        if (op->q_len < 1 || op->q_len > left)
            return kvb__refuse(err, len, "plan op %d (RUN request %llu): q_len %d, it has %d token(s) left to compute", k, id,
                          op->q_len, left);
        if (op->n_absent < 0 || op->n_absent > r->n_computed)
            return kvb__refuse(err, len, "plan op %d (RUN request %llu): n_absent %d, it has %d computed token(s)", k, id,
                          op->n_absent, r->n_computed);
        if (op->n_hidden < 0 || op->n_hidden > v->geom->n_layers)
            return kvb__refuse(err, len, "plan op %d (RUN request %llu): n_hidden %d is outside [0, %d layers]", k, id,
                          op->n_hidden, v->geom->n_layers);
        if (op->n_host < 0 || op->n_host > v->geom->n_layers)
            return kvb__refuse(err, len, "plan op %d (RUN request %llu): n_host %d is outside [0, %d layers]", k, id,
                          op->n_host, v->geom->n_layers);
        int absent_min = KVB_MAX(r->n_dropped, a->e->adrop[i]) * v->geom->block_size;
        if (op->n_absent < absent_min)
            return kvb__refuse(err, len, "plan op %d (RUN request %llu): n_absent %d, but its first %d token(s) have no KV "
                          "(dropped or restored in this step)", k, id, op->n_absent, absent_min);
        if (op->n_absent > 0 && kvb__sliced(a->e))
            return kvb__refuse(err, len, "plan op %d (RUN request %llu): n_absent needs a block-major pool, not a sliced "
                               "one", k, id);
        int64_t need = run_need(a, i, op->q_len);
        if (need > a->avail)
            return kvb__refuse(err, len,
                          "plan op %d (RUN request %llu): needs %lld new block(s), the pool can give %lld at this point "
                          "of the plan", k, id, (long long)need, (long long)a->avail);
        if (op->placed) KVB_TRY(acct_place(a, i, op, need, k, err, len));
        a->avail -= need;
        a->e->anew[i] = need;
        a->touched += r->n_blocks + need;
        a->tokens += op->q_len;
        a->rows += op->q_len + op->n_absent;
        a->n_sched++;
        a->e->asched[i] |= 1;
        break;
    }
    case KVB_OP_ADMIT: {
        if (st != KVB_REQ_WAITING)
            return kvb__refuse(err, len, "plan op %d (ADMIT request %llu): the request is %s, not waiting", k, id,
                          kvb_req_state_str(st));
        if (op->q_len < 1 || op->n_absent != 0)
            return kvb__refuse(err, len, "plan op %d (ADMIT request %llu): q_len %d must be >= 1 and n_absent %d 0", k, id,
                          op->q_len, op->n_absent);
        if (op->n_hidden < 0 || op->n_hidden > v->geom->n_layers)
            return kvb__refuse(err, len, "plan op %d (ADMIT request %llu): n_hidden %d is outside [0, %d layers]", k, id,
                          op->n_hidden, v->geom->n_layers);
        if (op->offload) {
            /* eLLM's CPU buffer: the whole prompt computed, its KV straight to new host-tier blocks */
            if (!a->e->ht_pool || v->prefix_cache || op->placed || kvb__sliced(a->e))
                return kvb__refuse(err, len, "plan op %d (ADMIT request %llu): an offloaded admission needs a host tier, "
                              "the prefix cache off, no placed blocks and a block-major pool", k, id);
            if (op->q_len < r->n_tokens)
                return kvb__refuse(err, len, "plan op %d (ADMIT request %llu): an offloaded admission computes all %d "
                              "tokens, q_len is %d", k, id, r->n_tokens, op->q_len);
            int hb = KVB_DIV_CEIL(r->n_tokens, v->geom->block_size);
            if (hb > a->host_left)
                return kvb__refuse(err, len, "plan op %d (ADMIT request %llu): offloading needs %d host-tier block(s), the "
                              "host tier can give %d at this point of the plan", k, id, hb, a->host_left);
            a->host_left -= hb;
            a->e->anew[i] = 0;
            a->tokens += r->n_tokens;
            a->rows += r->n_tokens;
            a->n_sched++;
            a->e->astate[i] = KVB_REQ_SWAPPED;
            a->e->asched[i] = 2;
            break;
        }
        int q;
        int64_t blocks;
        KVB_TRY(admit_cost(a, i, op->q_len, 1, &q, &blocks, &a->e->anew[i]));
        if (blocks > a->avail)
            return kvb__refuse(err, len,
                          "plan op %d (ADMIT request %llu): needs %lld block(s), the pool can give %lld at this point "
                          "of the plan", k, id, (long long)blocks, (long long)a->avail);
        if (op->placed) KVB_TRY(acct_place(a, i, op, blocks, k, err, len));
        a->avail -= blocks;
        a->touched += KVB_DIV_CEIL(r->n_tokens, v->geom->block_size);
        a->tokens += q;
        a->rows += q;
        a->n_sched++;
        a->n_running++;
        a->e->astate[i] = KVB_REQ_RUNNING;
        a->e->asched[i] = 2;
        break;
    }
    case KVB_OP_PREEMPT:
    case KVB_OP_PAUSE: {
        int pause = op->kind == KVB_OP_PAUSE;
        if (st != KVB_REQ_RUNNING && (pause || st != KVB_REQ_PAUSED))
            return kvb__refuse(err, len, "plan op %d (%s request %llu): the request is %s", k, kind, id, kvb_req_state_str(st));
        if (a->e->asched[i])
            return kvb__refuse(err, len, "plan op %d (%s request %llu): the request is scheduled or swapped in earlier in "
                          "this step", k, kind, id);
        if (pause) {
            a->e->astate[i] = KVB_REQ_PAUSED;
        } else {
            int freed;
            KVB_TRY(acct_release(a, i, &freed));
            a->avail += freed;
            a->n_running--;
            a->e->astate[i] = KVB_REQ_WAITING;
        }
        break;
    }
    case KVB_OP_RESUME:
        if (st != KVB_REQ_PAUSED)
            return kvb__refuse(err, len, "plan op %d (RESUME request %llu): the request is %s, not paused", k, id,
                          kvb_req_state_str(st));
        a->e->astate[i] = KVB_REQ_RUNNING;
        break;
    case KVB_OP_SWAP_OUT: {
        if (!a->e->ht_pool)
            return kvb__refuse(err, len, "plan op %d (SWAP_OUT request %llu): the engine has no host tier (plan_pool sets "
                          "host_tier_blocks)", k, id);
        if (st != KVB_REQ_RUNNING && st != KVB_REQ_PAUSED)
            return kvb__refuse(err, len, "plan op %d (SWAP_OUT request %llu): the request is %s", k, id, kvb_req_state_str(st));
        if (a->e->asched[i])
            return kvb__refuse(err, len, "plan op %d (SWAP_OUT request %llu): the request is scheduled or swapped in earlier "
                          "in this step", k, id);
        if (r->n_blocks > a->host_left)
            return kvb__refuse(err, len, "plan op %d (SWAP_OUT request %llu): needs %d host-tier block(s), the host tier can "
                          "give %d at this point of the plan", k, id, r->n_blocks, a->host_left);
        if (op->n_hidden < 0 || op->n_hidden > r->hidden_layers)
            return kvb__refuse(err, len, "plan op %d (SWAP_OUT request %llu): n_hidden %d, but hidden states are saved for %d "
                          "layer(s)", k, id, op->n_hidden, r->hidden_layers);
        int freed;
        KVB_TRY(acct_release(a, i, &freed));
        a->avail += freed;
        a->host_left -= r->n_blocks;
        a->n_running--;
        a->e->astate[i] = KVB_REQ_SWAPPED;
        break;
    }
    case KVB_OP_SWAP_IN:
        if (st != KVB_REQ_SWAPPED)
            return kvb__refuse(err, len, "plan op %d (SWAP_IN request %llu): the request is %s, not swapped", k, id,
                          kvb_req_state_str(st));
        if (r->n_blocks > a->avail)
            return kvb__refuse(err, len, "plan op %d (SWAP_IN request %llu): needs %d block(s), the pool can give %lld at this "
                          "point of the plan", k, id, r->n_blocks, (long long)a->avail);
        if (a->e->asched[i])
            return kvb__refuse(err, len, "plan op %d (SWAP_IN request %llu): the request is scheduled earlier in this step",
                          k, id);
        if (op->placed) KVB_TRY(acct_place(a, i, op, r->n_blocks, k, err, len));
        a->avail -= r->n_blocks;
        a->host_left += r->n_blocks;
        a->n_running++;
        a->e->astate[i] = KVB_REQ_RUNNING;
        a->e->asched[i] |= 4; /* its view lists host blocks: it is not released again in this plan */
        break;
    case KVB_OP_DROP: {
        if (st != KVB_REQ_RUNNING && st != KVB_REQ_PAUSED)
            return kvb__refuse(err, len, "plan op %d (DROP request %llu): the request is %s", k, id, kvb_req_state_str(st));
        if (a->e->asched[i])
            return kvb__refuse(err, len, "plan op %d (DROP request %llu): the request is scheduled, swapped in or dropped "
                          "earlier in this step", k, id);
        int bs = v->geom->block_size, cur = r->n_dropped, to = op->n_dropped;
        if (to < 0 || (int64_t)to * bs > r->n_computed)
            return kvb__refuse(err, len, "plan op %d (DROP request %llu): n_dropped %d, it has %d full block(s)", k, id, to,
                          r->n_computed / bs);
        if (op->n_host < 0 || op->n_host > v->geom->n_layers)
            return kvb__refuse(err, len, "plan op %d (DROP request %llu): n_host %d is outside [0, %d layers]", k, id,
                          op->n_host, v->geom->n_layers);
        if (to > cur && ((cur == 0 && op->n_host > 0) || r->host_layers > 0)) {
            /* the released blocks' host copies (executor.c, drop_blocks) */
            if (!a->e->ht_pool)
                return kvb__refuse(err, len, "plan op %d (DROP request %llu): n_host %d, but the engine has no host tier "
                              "(plan_pool sets host_tier_blocks)", k, id, KVB_MAX(op->n_host, r->host_layers));
            if (to - cur > a->host_left)
                return kvb__refuse(err, len, "plan op %d (DROP request %llu): its released blocks need %d host-tier "
                              "block(s), the host tier can give %d at this point of the plan", k, id, to - cur,
                              a->host_left);
            a->host_left -= to - cur;
        }
        if (to > cur) {
            /* the released blocks are the first (to - cur) of its table */
            for (int j = 0; j < to - cur; j++) {
                a->avail += eff_ref(a, r->blocks[j]) == 1;
                KVB_TRY(adj_add(a, r->blocks[j], -1));
            }
        } else if (to < cur) {
            if (cur - to > a->avail)
                return kvb__refuse(err, len, "plan op %d (DROP request %llu): restoring %d block(s), the pool can give %lld "
                              "at this point of the plan", k, id, cur - to, (long long)a->avail);
            a->avail -= cur - to;
        }
        a->e->adrop[i] = to;
        a->e->asched[i] |= 8;
        break;
    }
    default:
        return kvb__refuse(err, len, "plan op %d: unknown operation %d", k, (int)op->kind);
    }
    if (a->tokens > a->budget)
        return kvb__refuse(err, len, "plan op %d (%s request %llu): the plan computes %d tokens, the step budget is %d", k,
                      kind, id, a->tokens, a->budget);
    if (a->rows > v->max_rows)
        return kvb__refuse(err, len, "plan op %d (%s request %llu): the plan needs %d forward rows, the step holds %d", k,
                      kind, id, a->rows, v->max_rows);
    if (a->n_sched > a->batch_limit)
        return kvb__refuse(err, len, "plan op %d (%s request %llu): more than %d requests scheduled", k, kind, id,
                      a->batch_limit);
    return KVB_OK;
}

/* Marks of the blocks the plan's scheduled requests read (1) and write (2) this step. */
static kvb_status step_marks(acct *a, const kvb_plan *p, uint8_t **out) {
    kvb_engine *e = a->e;
    const kvb_view *v = a->v;
    int bs = v->geom->block_size;
    uint8_t *m = NULL;
    KVB_TRY(kvb_calloc((size_t)kvb_block_pool_id_limit(e->pool), 1, (void **)&m));
    for (int k = 0; k < p->n_ops; k++) {
        const kvb_plan_op *op = &p->ops[k];
        int i = kvb_view_find(v, op->id);
        const kvb_req_view *r = &v->reqs[i];
        if (op->kind == KVB_OP_RUN && r->state != KVB_REQ_SWAPPED) {
            for (int j = 0; j < r->n_blocks; j++) {
                int jl = r->n_dropped + j; /* its block index in the request */
                if (jl < e->adrop[i]) continue; /* released by a DROP of this plan */
                int w = (jl + 1) * bs > r->n_computed || (op->n_absent % bs && jl == op->n_absent / bs);
                m[r->blocks[j]] |= (uint8_t)(1 | (w ? 2 : 0));
            }
        } else if (op->kind == KVB_OP_ADMIT) {
            const kvb__memo *pm;
            kvb_status st = kvb__probe_memo(e, i, &pm);
            if (st != KVB_OK) {
                free(m);
                return st;
            }
            for (int j = 0; j < pm->n_hit; j++) m[e->memo_ids[pm->hit_off + j]] |= 1;
        }
    }
    *out = m;
    return KVB_OK;
}

/* Whether the block's host copy holds layer l now, or a STORE of this plan at once (-1) makes it. */
static int host_copy_has(const kvb_engine *e, const kvb_plan *p, int32_t id, int l) {
    if (kvb__host_copy_has(e, id, l)) return 1;
    for (int c = 0; c < p->n_copies; c++) {
        const kvb_plan_copy *cp = &p->copies[c];
        if (cp->dir == KVB_COPY_STORE && cp->block == id && cp->layer == -1 && l >= cp->layer0 && l < cp->layer1) return 1;
    }
    return 0;
}

/* An ABSENT block must not be read this step: every RUN request holding it recomputes it (n_absent
 * covers it) and no admission reuses it. */
static kvb_status absent_readers(acct *a, const kvb_plan *p, int32_t id, int r, char *err, size_t len) {
    const kvb_view *v = a->v;
    int bs = v->geom->block_size;
    for (int k = 0; k < p->n_ops; k++) {
        const kvb_plan_op *op = &p->ops[k];
        int i = kvb_view_find(v, op->id);
        const kvb_req_view *q = &v->reqs[i];
        if (op->kind == KVB_OP_RUN && q->state != KVB_REQ_SWAPPED) {
            for (int j = 0; j < q->n_blocks; j++)
                if (q->blocks[j] == id && (j + 1) * bs > op->n_absent)
                    return kvb__refuse(err, len, "residency %d: block %d is ABSENT but request %llu reads it (n_absent %d)", r,
                                  (int)id, (unsigned long long)op->id, op->n_absent);
        } else if (op->kind == KVB_OP_ADMIT) {
            const kvb__memo *pm;
            KVB_TRY(kvb__probe_memo(a->e, i, &pm));
            for (int j = 0; j < pm->n_hit; j++)
                if (a->e->memo_ids[pm->hit_off + j] == id)
                    return kvb__refuse(err, len, "residency %d: block %d is ABSENT but request %llu reuses it", r, (int)id,
                                  (unsigned long long)op->id);
        }
    }
    return KVB_OK;
}

/* Checks the plan's residency exceptions and copy orders (after its operations were accounted). */
static kvb_status check_residency(acct *a, const kvb_plan *p, char *err, size_t len) {
    kvb_engine *e = a->e;
    const kvb_view *v = a->v;
    int L = v->geom->n_layers;
    if (p->lent_default != KVB_RES_LENT && p->lent_default != KVB_RES_STREAM)
        return kvb__refuse(err, len, "lent_default %s: borrowed blocks are read LENT (in place) or STREAM",
                      kvb_residency_str(p->lent_default));
    if (p->n_res == 0 && p->n_copies == 0 && p->lent_default == KVB_RES_LENT) return KVB_OK;
    if (kvb__sliced(e))
        return kvb__refuse(err, len, "a sliced pool takes request-level placements (kvb_plan_place), not residency "
                           "exceptions, copy orders or streamed borrowed blocks");
    uint8_t *mark = NULL;
    int32_t *first = NULL, *next = NULL;
    kvb_status st = KVB_OK;
    int ids = kvb_block_pool_id_limit(e->pool), staged = 0, new_copies = 0;
    KVB_TRY_GOTO(step_marks(a, p, &mark), out);
    KVB_TRY_GOTO(kvb_malloc((size_t)ids * sizeof *first, (void **)&first), out);
    KVB_TRY_GOTO(kvb_malloc((size_t)(p->n_res + 1) * sizeof *next, (void **)&next), out);
    for (int i = 0; i < ids; i++) first[i] = -1;
    for (int r = 0; r < p->n_res && st == KVB_OK; r++) {
        const kvb_plan_res *x = &p->res[r];
        int32_t id = x->block;
        if (!kvb_block_pool_has(e->pool, id)) {
            st = kvb__refuse(err, len, "residency %d: block %d is not a block of the pool", r, (int)id);
            break;
        }
        if (x->layer0 < 0 || x->layer0 >= x->layer1 || x->layer1 > L) {
            st = kvb__refuse(err, len, "residency %d (block %d): layers [%d, %d) are not a range of the model's %d", r, (int)id,
                        x->layer0, x->layer1, L);
            break;
        }
        int lent = kvb_block_pool_is_attached(e->pool, id);
        switch (x->where) {
        case KVB_RES_LOCAL:
            if (lent) st = kvb__refuse(err, len, "residency %d: block %d is borrowed; LOCAL is for the process's own blocks", r,
                                  (int)id);
            break;
        case KVB_RES_LENT:
        case KVB_RES_STREAM:
            if (!lent) st = kvb__refuse(err, len, "residency %d: block %d is not borrowed; %s is for borrowed blocks", r,
                                   (int)id, kvb_residency_str(x->where));
            break;
        case KVB_RES_HOST:
            for (int l = x->layer0; l < x->layer1 && st == KVB_OK; l++)
                if (!host_copy_has(e, p, id, l))
                    st = kvb__refuse(err, len, "residency %d: block %d has no host copy of layer %d (STORE it first)", r,
                                (int)id, l);
            break;
        case KVB_RES_ABSENT:
            if (mark[id]) st = absent_readers(a, p, id, r, err, len);
            break;
        default: st = kvb__refuse(err, len, "residency %d (block %d): unknown residency %d", r, (int)id, (int)x->where);
        }
        if (st != KVB_OK) break;
        for (int o = first[id]; o >= 0; o = next[o])
            if (p->res[o].layer0 < x->layer1 && x->layer0 < p->res[o].layer1) {
                st = kvb__refuse(err, len, "residency %d and %d both give block %d's layers %d..", o, r, (int)id,
                            KVB_MAX(x->layer0, p->res[o].layer0));
                break;
            }
        if (first[id] < 0 && (x->where == KVB_RES_STREAM || x->where == KVB_RES_HOST)) staged++;
        next[r] = first[id];
        first[id] = r;
    }
    for (int c = 0; c < p->n_copies && st == KVB_OK; c++) {
        const kvb_plan_copy *cp = &p->copies[c];
        int32_t id = cp->block;
        int load = cp->dir == KVB_COPY_LOAD;
        if (cp->dir != KVB_COPY_LOAD && cp->dir != KVB_COPY_STORE) {
            st = kvb__refuse(err, len, "copy %d: unknown direction %d", c, (int)cp->dir);
        } else if (!e->ht_pool) {
            st = kvb__refuse(err, len, "copy %d: the engine has no host tier (plan_pool sets host_tier_blocks)", c);
        } else if (!kvb_block_pool_has(e->pool, id)) {
            st = kvb__refuse(err, len, "copy %d: block %d is not a block of the pool", c, (int)id);
        } else if (cp->layer0 < 0 || cp->layer0 >= cp->layer1 || cp->layer1 > L) {
            st = kvb__refuse(err, len, "copy %d (block %d): layers [%d, %d) are not a range of the model's %d", c, (int)id,
                        cp->layer0, cp->layer1, L);
        } else if (load ? (cp->layer < 0 || cp->layer >= L) : (cp->layer < -1 || cp->layer >= L)) {
            st = kvb__refuse(err, len, "copy %d (block %d): a %s at layer %d", c, (int)id, load ? "LOAD due before" :
                        "STORE after", cp->layer);
        } else if (load) {
            for (int l = cp->layer0; l < cp->layer1 && st == KVB_OK; l++)
                if (!kvb__host_copy_has(e, id, l))
                    st = kvb__refuse(err, len, "copy %d: LOAD of block %d layer %d from the host tier, which does not hold it",
                                c, (int)id, l);
            if (st == KVB_OK && mark[id] && cp->layer > cp->layer0)
                st = kvb__refuse(err, len, "copy %d: LOAD of block %d layers [%d, %d) is due before layer %d, but the step "
                            "reads it at layer %d", c, (int)id, cp->layer0, cp->layer1, cp->layer, cp->layer0);
        } else {
            if ((mark[id] & 2) && cp->layer < cp->layer1 - 1)
                st = kvb__refuse(err, len, "copy %d: STORE of block %d layers [%d, %d) after layer %d, but the step writes the "
                            "block until layer %d", c, (int)id, cp->layer0, cp->layer1, cp->layer, cp->layer1 - 1);
            int fresh = !kvb__host_copy_exists(e, id);
            for (int o = 0; o < c && fresh; o++) fresh = !(p->copies[o].dir == KVB_COPY_STORE && p->copies[o].block == id);
            new_copies += fresh;
        }
    }
    if (st != KVB_OK) goto out;
    if (new_copies > a->host_left) {
        st = kvb__refuse(err, len, "the plan's STOREs need %d new host copies, the host tier can give %d", new_copies,
                    a->host_left);
        goto out;
    }
    a->host_left -= new_copies;
    int64_t bound = staged + (p->lent_default == KVB_RES_STREAM ? KVB_MIN((int64_t)v->pool.n_borrowed, a->touched) : 0);
    if (bound > v->pool.stage_slots)
        st = kvb__refuse(err, len, "the plan may read %lld blocks through stage buffers, there are slots for %d (plan_pool's "
                    "stage_slots)", (long long)bound, v->pool.stage_slots);
out:
    free(mark);
    free(first);
    free(next);
    return st;
}

kvb_status kvb_sched_cost(const kvb_view *v, const kvb_plan *p, kvb_plan_cost *out, char *err, size_t err_len) {
    kvb_engine *e = view_engine(v);
    if (err && err_len) err[0] = 0;
    acct a;
    KVB_TRY(acct_begin(e, v, &a));
    kvb_status st = KVB_OK;
    if (p->batch_limit < 0 || p->batch_limit > v->max_seqs) {
        st = kvb__refuse(err, err_len, "plan batch_limit %d is outside [0, max_seqs %d]", p->batch_limit, v->max_seqs);
        goto out;
    }
    if (p->batch_limit > 0) a.batch_limit = p->batch_limit;
    for (int k = 0; k < p->n_ops && st == KVB_OK; k++) st = acct_op(&a, &p->ops[k], k, err, err_len);
    if (st != KVB_OK) goto out;
    if (a.n_running > v->max_seqs) {
        st = kvb__refuse(err, err_len, "the plan leaves %d requests running or paused, max_seqs is %d", a.n_running,
                    v->max_seqs);
        goto out;
    }
    for (int i = 0; i < v->n_reqs; i++)
        if (e->adrop[i] < v->reqs[i].n_dropped && !(e->asched[i] & 1)) {
            st = kvb__refuse(err, err_len, "request %llu: a DROP restores its blocks %d..%d but no RUN of this plan fills them",
                        (unsigned long long)v->reqs[i].id, e->adrop[i], v->reqs[i].n_dropped - 1);
            goto out;
        }
    KVB_TRY_GOTO(check_residency(&a, p, err, err_len), out);
    KVB_TRY_GOTO(kvb__slices_check(e, v, p, e->astate, e->asched, e->anew, err, err_len), out);
    if (out)
        *out = (kvb_plan_cost){.blocks_left = a.avail, .tokens = a.tokens, .rows = a.rows, .n_sched = a.n_sched,
                               .n_running = a.n_running, .host_left = a.host_left};
out:
    acct_end(&a);
    return st;
}

kvb_status kvb__plan_check(kvb_engine *e, kvb_plan_cost *cost) {
    return kvb_sched_cost(&e->view, &e->plan, cost, e->last_error, sizeof e->last_error);
}

/* Replays the plan's operations into a fresh accounting (the routines below extend a plan). */
static kvb_status acct_replay(kvb_engine *e, const kvb_view *v, const kvb_fcfs_opts *o, const kvb_plan *p, acct *a) {
    KVB_TRY(acct_begin(e, v, a));
    if (o && o->budget > 0) a->budget = KVB_MIN(o->budget, v->max_batch_tokens);
    int limit = p->batch_limit > 0 ? p->batch_limit : v->max_seqs;
    if (o && o->batch_limit > 0) limit = KVB_MIN(limit, o->batch_limit);
    a->batch_limit = limit;
    char err[256];
    for (int k = 0; k < p->n_ops; k++) {
        kvb_status st = acct_op(a, &p->ops[k], k, err, sizeof err);
        if (st != KVB_OK) {
            if (st == KVB_ERR_INVALID) KVB_LOG_E("scheduler: the plan so far is invalid: %s", err);
            acct_end(a);
            return st;
        }
    }
    return KVB_OK;
}

/* ---------------------------------------------------------------- FCFS (vLLM) */

static kvb_status push(acct *a, kvb_plan *p, kvb_plan_op op) {
    char err[256];
    kvb_status st = acct_op(a, &op, p->n_ops, err, sizeof err);
    if (st == KVB_ERR_INVALID) {
        KVB_LOG_E("scheduler: internal accounting error: %s", err);
        return st;
    }
    KVB_TRY(st);
    return kvb_plan_push_op(p, op);
}

static kvb_status fcfs_running(acct *a, const kvb_fcfs_opts *o, kvb_plan *p) {
    const kvb_view *v = a->v;
    kvb_engine *e = a->e;
    int *cand = NULL;
    kvb_status st = KVB_OK;
    if (v->n_running > 0) KVB_TRY(kvb_malloc((size_t)v->n_running * sizeof *cand, (void **)&cand));
    for (int i = 0; i < v->n_running && a->budget - a->tokens > 0 && a->n_sched < a->batch_limit; i++) {
        if (e->astate[i] != KVB_REQ_RUNNING || (e->asched[i] & 3)) continue;
        const kvb_req_view *r = &v->reqs[i];
        int q = KVB_MIN(r->n_tokens - r->n_computed, a->budget - a->tokens);
        for (;;) {
            if (run_need(a, i, q) <= a->avail) {
                int absent = e->adrop[i] * v->geom->block_size; /* dropped blocks are recomputed */
                st = push(a, p, (kvb_plan_op){.kind = KVB_OP_RUN, .id = r->id, .q_len = q, .n_absent = absent});
                break;
            }
            /* candidates: this request and the running ones after it that are not scheduled */
            int n = 0;
            for (int j = i; j < v->n_running; j++)
                if ((e->astate[j] == KVB_REQ_RUNNING || e->astate[j] == KVB_REQ_PAUSED) && !e->asched[j]) cand[n++] = j;
            int vi = n - 1;
            if (o && o->pick_victim) {
                vi = o->pick_victim(o->ud, v, cand, n);
                if (vi < 0 || vi >= n) vi = n - 1;
            }
            int victim = cand[vi];
            kvb_op_kind kind = KVB_OP_PREEMPT;
            if (o && o->preempt_op == KVB_OP_SWAP_OUT && a->host_left >= v->reqs[victim].n_blocks) kind = KVB_OP_SWAP_OUT;
            st = push(a, p, (kvb_plan_op){.kind = kind, .id = v->reqs[victim].id});
            if (st != KVB_OK || victim == i) break;
        }
        if (st != KVB_OK) break;
    }
    free(cand);
    return st;
}

/* Whether `s`'s next prompt block (after `hits` full blocks, chained hash `last`) is being computed
 * now by request r (fields as they will be when this step starts). */
static int computes_block(const kvb__seq *r, int r_published, uint64_t r_last, int r_computed, const kvb__seq *s, int hits,
                          uint64_t last, int bs) {
    if (r_published != hits || r_last != last) return 0;
    if (r->n_tokens < (hits + 1) * bs || r_computed >= (hits + 1) * bs) return 0;
    return !memcmp(r->tokens + (size_t)hits * bs, s->tokens + (size_t)hits * bs, (size_t)bs * sizeof(int32_t));
}

/* The next block request i would compute (its first unmatched full prompt block) is being computed
 * now by a running request at the same place of the same chain, or by one the plan admits before it:
 * admitting i now would compute the same KV a second time. */
static kvb_status in_flight(acct *a, int i, int *out) {
    kvb_engine *e = a->e;
    const kvb__memo *m;
    KVB_TRY(kvb__probe_memo(e, i, &m));
    const kvb__seq *s = e->vseq[i];
    int bs = e->o.block_size, b = m->n_hit + m->n_host_hit;
    *out = 0;
    if ((int64_t)(b + 1) * bs > s->n_tokens - 1) return KVB_OK; /* no full block left to match */
    for (int j = 0; j < a->v->n_reqs; j++) {
        if (j == i || e->astate[j] != KVB_REQ_RUNNING) continue;
        const kvb__seq *r = e->vseq[j];
        if ((e->asched[j] & 3) == 2) { /* admitted by this plan: as it will be after its hits */
            const kvb__memo *mr;
            KVB_TRY(kvb__probe_memo(e, j, &mr));
            int h = mr->n_hit + mr->n_host_hit;
            if (computes_block(r, h, mr->last_hash, h * bs, s, b, m->last_hash, bs)) *out = 1;
        } else if (a->v->reqs[j].state == KVB_REQ_RUNNING || a->v->reqs[j].state == KVB_REQ_PAUSED) {
            if (computes_block(r, r->n_published, r->last_hash, r->n_computed, s, b, m->last_hash, bs)) *out = 1;
        }
        if (*out) break;
    }
    return KVB_OK;
}

kvb_status kvb_sched_probe(const kvb_view *v, int req, const kvb_plan *p, kvb_prefix_probe *out) {
    kvb_engine *e = view_engine(v);
    if (req < 0 || req >= v->n_reqs) return KVB_ERR_INVALID;
    acct a;
    KVB_TRY(acct_replay(e, v, NULL, p, &a));
    kvb_status st = KVB_OK;
    if (e->astate[req] != KVB_REQ_WAITING) {
        st = KVB_ERR_INVALID;
        goto out;
    }
    const kvb__memo *m;
    KVB_TRY_GOTO(kvb__probe_memo(e, req, &m), out);
    *out = (kvb_prefix_probe){.n_hit = m->n_hit, .n_host_hit = m->n_host_hit};
    KVB_TRY_GOTO(idle_hits(&a, req, &out->n_hit_idle), out);
    KVB_TRY_GOTO(in_flight(&a, req, &out->deferred), out);
out:
    acct_end(&a);
    return st;
}

/* First index in [k, end) whose request is waiting after the plan's operations so far, or end. */
static int next_waiting(const acct *a, int k, int end) {
    while (k < end && a->e->astate[k] != KVB_REQ_WAITING) k++;
    return k;
}

/* Waiting requests (after the plan's operations so far) in arrival order: the requests the plan
 * preempted (among the view's running ones) merged with the view's queue; both runs are sorted. */
static kvb_status waiting_order(acct *a, int **out, int *n_out) {
    const kvb_view *v = a->v;
    int *w = NULL, n = 0;
    *out = NULL;
    *n_out = 0;
    if (v->n_reqs == 0) return KVB_OK;
    KVB_TRY(kvb_malloc((size_t)v->n_reqs * sizeof *w, (void **)&w));
    int i = next_waiting(a, 0, v->n_running), j = next_waiting(a, v->n_running, v->n_reqs);
    while (i < v->n_running || j < v->n_reqs) {
        if (j >= v->n_reqs || (i < v->n_running && v->reqs[i].arrival < v->reqs[j].arrival)) {
            w[n++] = i;
            i = next_waiting(a, i + 1, v->n_running);
        } else {
            w[n++] = j;
            j = next_waiting(a, j + 1, v->n_reqs);
        }
    }
    *out = w;
    *n_out = n;
    return KVB_OK;
}

/* Swapped requests come back first, oldest first, each with its next tokens (vLLM: no new request is
 * admitted while one waits swapped out). Returns 1 in *blocked when one could not come back. */
static kvb_status fcfs_swap_in(acct *a, kvb_plan *p, int *blocked) {
    const kvb_view *v = a->v;
    *blocked = 0;
    for (int i = v->n_running; i < v->n_running + v->n_swapped; i++) {
        if (a->e->astate[i] != KVB_REQ_SWAPPED) continue;
        const kvb_req_view *r = &v->reqs[i];
        int q = KVB_MIN(r->n_tokens - r->n_computed, a->budget - a->tokens);
        if (q < 1 || a->n_running >= v->max_seqs || a->n_sched >= a->batch_limit ||
            r->n_blocks + run_need(a, i, q) > a->avail) {
            *blocked = 1;
            return KVB_OK;
        }
        KVB_TRY(push(a, p, (kvb_plan_op){.kind = KVB_OP_SWAP_IN, .id = r->id}));
        KVB_TRY(push(a, p, (kvb_plan_op){.kind = KVB_OP_RUN, .id = r->id, .q_len = q}));
    }
    return KVB_OK;
}

static kvb_status fcfs_admit(acct *a, const kvb_fcfs_opts *o, kvb_plan *p) {
    const kvb_view *v = a->v;
    int blocked;
    p->starved = 0;
    KVB_TRY(fcfs_swap_in(a, p, &blocked));
    if (blocked) {
        p->starved = 1;
        return KVB_OK;
    }
    int *w, n;
    KVB_TRY(waiting_order(a, &w, &n));
    kvb_status st = KVB_OK;
    int may_pass = INT_MAX; /* admissions still allowed past the stalled requests skipped so far */
    for (int k = 0; k < n && a->budget - a->tokens > 0 && a->n_running < v->max_seqs && a->n_sched < a->batch_limit;
         k++) {
        int i = w[k];
        const kvb_req_view *r = &v->reqs[i];
        /* one that needs more blocks than the pool holds now (lent out or detached) waits until grow /
         * attach: admitted, it could only preempt itself over and over. Requests behind it that fit are
         * served meanwhile, up to v->stall_overtake of them (bounded overtaking, issue 10); the engine
         * fails it after its stall wait. */
        if (!v->pool.n_slices &&
            KVB_DIV_CEIL((int64_t)r->n_prompt + r->max_tokens, v->geom->block_size) > v->pool.n_blocks) {
            p->starved = 1;
            may_pass = KVB_MIN(may_pass, v->stall_overtake - r->n_overtaken);
            if (may_pass > 0) continue;
            break;
        }
        if (may_pass <= 0) break;
        if (v->prefix_cache) {
            int defer;
            KVB_TRY_GOTO(in_flight(a, i, &defer), out);
            if (defer) { /* wait a step or two and hit the cache instead */
                p->n_deferred++;
                continue;
            }
        }
        int q;
        int64_t blocks;
        KVB_TRY_GOTO(admit_cost(a, i, a->budget - a->tokens, 0, &q, &blocks, NULL), out);
        if (blocks > a->avail) {
            p->starved = 1;
            break;
        }
        KVB_TRY_GOTO(push(a, p, (kvb_plan_op){.kind = KVB_OP_ADMIT, .id = r->id, .q_len = q}), out);
        if (may_pass != INT_MAX) may_pass--; /* it passed a stalled request */
    }
out:
    free(w);
    return st;
}

/* Runs the chosen phases after what `out` already holds. */
static kvb_status fcfs_phases(const kvb_view *v, const kvb_fcfs_opts *o, kvb_plan *out, int running, int admit) {
    acct a;
    KVB_TRY(acct_replay(view_engine(v), v, o, out, &a));
    kvb_status st = running ? fcfs_running(&a, o, out) : KVB_OK;
    if (st == KVB_OK && admit) st = fcfs_admit(&a, o, out);
    acct_end(&a);
    return st;
}

kvb_status kvb_sched_fcfs_running(const kvb_view *v, const kvb_fcfs_opts *o, kvb_plan *out) {
    return fcfs_phases(v, o, out, 1, 0);
}

kvb_status kvb_sched_fcfs_admit(const kvb_view *v, const kvb_fcfs_opts *o, kvb_plan *out) {
    return fcfs_phases(v, o, out, 0, 1);
}

kvb_status kvb_sched_fcfs(const kvb_view *v, const kvb_fcfs_opts *o, kvb_plan *out) {
    return fcfs_phases(v, o, out, 1, 1);
}

kvb_status kvb__plan_pool(kvb_engine *e, const kvb_pool_event *ev, kvb_pool_plan *out) {
    if (!e->planner.iface || !e->planner.iface->plan_pool) return KVB_OK;
    KVB_TRY(kvb__view_build(e));
    kvb_status st = e->planner.iface->plan_pool(e->planner.ctx, ev, &e->view, out);
    if (st != KVB_OK) KVB_LOG_E("engine: plan_pool of %s failed: %s", e->planner.iface->name, kvb_status_str(st));
    return st;
}

void kvb__sched_free(kvb_engine *e) {
    free(e->vreqs);
    free(e->vseq);
    free(e->vhash);
    free(e->memo);
    free(e->memo_ids);
    free(e->adj);
    free(e->adj_touched);
    free(e->astate);
    free(e->asched);
    free(e->adrop);
    free(e->anew);
}
