/* kvbank — the executor: asks the planner for a plan, checks it, applies its request-level decisions,
 * turns the step's block tables into per-layer block pointers for the forward pass (streaming borrowed
 * blocks through the layer stream cache when asked), runs the forward pass layer by layer, samples,
 * publishes full blocks to the prefix cache and tells the planner what the step measured. */
#include <assert.h>
#include <stdio.h>
#include <string.h>

#include "common/sched/state.h"

/* ---------------------------------------------------------------- applying a plan */

/* Gives `s` blocks for its first `upto` tokens: from the free list, or with `op` placed, the blocks
 * op->block0 + j (checked free by the plan's check). KVB_ERR_EXHAUSTED if the pool cannot. */
static kvb_status grow_blocks(kvb_engine *e, seq *s, int upto, const kvb_plan_op *op) {
    int need = KVB_DIV_CEIL(upto, e->o.block_size);
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
static void take_hits(kvb_engine *e, seq *s) {
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

/* Applies the checked plan in order; fills e->sched and returns how many sequences compute. */
static int apply_plan(kvb_engine *e, kvb_step_report *rep) {
    const kvb_plan *p = &e->plan;
    int n = 0, admits_stopped = 0;
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
        seq *s = e->vseq[kvb_view_find(&e->view, op->id)];
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
            e->sched[n++] = s;
            break;
        case KVB_OP_ADMIT: {
            if (admits_stopped) {
                kvb__seq_drop_kv(e, s);
                rep->admits_dropped++;
                break;
            }
            take_hits(e, s); /* a request the plan preempted before admitting it again */
            int max_blocks = (s->n_tokens - 1) / e->o.block_size;
            if (e->ht_pc && s->hits_taken == 2) kvb__host_tier_load(e, s, max_blocks);
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
            s->q_len = q;
            e->sched[n++] = s;
            break;
        }
        case KVB_OP_PREEMPT: kvb__preempt_seq(e, s); break;
        case KVB_OP_PAUSE:
            s->paused = 1;
            e->stats.pauses++;
            break;
        case KVB_OP_RESUME: s->paused = 0; break;
        default: assert(!"refused by the check"); break;
        }
    }
    e->starved = p->starved || admits_stopped;
    e->stats.deferred += (uint64_t)p->n_deferred;
    return n;
}

/* ---------------------------------------------------------------- the step's block pointers */

static kvb_status ensure_blk_cap(kvb_engine *e, int n) {
    if (n <= e->blk_cap) return KVB_OK;
    int cap = KVB_MAX(n, e->blk_cap * 2);
    KVB_TRY(kvb_realloc_array((void **)&e->blk_base, (size_t)cap, sizeof(void *)));
    KVB_TRY(kvb_realloc_array((void **)&e->blk_layer, (size_t)cap, sizeof(void *)));
    KVB_TRY(kvb_realloc_array((void **)&e->blk_id, (size_t)cap, sizeof *e->blk_id));
    if (e->o.lsc_stream) KVB_TRY(kvb_realloc_array((void **)&e->lsc.entry_slot, (size_t)cap, sizeof(int32_t)));
    e->blk_cap = cap;
    return KVB_OK;
}

/* Offers every newly completed full block of `s` to the prefix cache. */
static void publish_full_blocks(kvb_engine *e, seq *s) {
    int bs = e->o.block_size;
    while ((s->n_published + 1) * bs <= s->n_computed) {
        int b = s->n_published;
        if (kvb_prefix_cache_publish(e->pc, s->last_hash, s->tokens + (size_t)b * bs, s->bt.ids[b], &s->last_hash) !=
            KVB_OK)
            break;
        s->n_published++;
    }
}

static int is_stop(const seq *s, int32_t tok) {
    for (int i = 0; i < s->n_stop; i++)
        if (s->stop[i] == tok) return 1;
    return 0;
}

/* LSC streaming: gives every borrowed block of the step a slot (a block shared by several sequences
 * gets one), records where its layer slices live and which rows the step writes into it. Returns
 * the number of slots used (0: nothing to stream). */
static int lsc_prepare(kvb_engine *e, int n_sched, int n_blk) {
    lsc *c = &e->lsc;
    int cap = kvb_block_pool_capacity(e->pool), bs = e->o.block_size, n = 0;
    for (int j = 0; j < n_blk; j++) {
        int32_t id = e->blk_id[j];
        c->entry_slot[j] = -1;
        if (!kvb_block_pool_is_attached(e->pool, id)) continue;
        int32_t *k = &c->slot_of[id - cap];
        if (*k < 0) {
            /* every slot is a distinct attached block and the LSC has one per attached block */
            assert(n < c->n_slots);
            *k = n++;
            c->src[*k] = e->blk_base[j];
            c->dirty_lo[*k] = bs;
            c->dirty_hi[*k] = 0;
        }
        c->entry_slot[j] = *k;
    }
    for (int i = 0; i < n_sched && n > 0; i++) {
        const kvb_attn_seq *as = &e->b_seqs[i];
        int p0 = as->ctx_len - as->q_len, p1 = as->ctx_len; /* positions written this step */
        for (int bj = p0 / bs; bj <= (p1 - 1) / bs; bj++) {
            int k = c->entry_slot[as->blk_first + bj];
            if (k < 0) continue;
            c->dirty_lo[k] = KVB_MIN(c->dirty_lo[k], KVB_MAX(p0 - bj * bs, 0));
            c->dirty_hi[k] = KVB_MAX(c->dirty_hi[k], KVB_MIN(p1 - bj * bs, bs));
        }
    }
    c->n_used = n;
    return n;
}

/* Forgets the step's slot assignment (the slot map is reused by the next step). */
static void lsc_finish(kvb_engine *e, int n_blk) {
    int cap = kvb_block_pool_capacity(e->pool);
    for (int j = 0; j < n_blk; j++)
        if (e->lsc.entry_slot[j] >= 0) e->lsc.slot_of[e->blk_id[j] - cap] = -1;
    e->lsc.n_used = 0;
}

/* ---------------------------------------------------------------- the step */

/* Asks the planner (or the built-in FCFS) for the plan and checks it. Nothing changes on failure. */
static kvb_status make_plan(kvb_engine *e) {
    KVB_TRY(kvb__view_build(e));
    kvb_plan_reset(&e->plan);
    const char *name = e->planner.iface ? e->planner.iface->name : "fcfs";
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

kvb_status kvb__exec_step(kvb_engine *e) {
    uint64_t t0 = kvb_now_ns();
    KVB_TRY(make_plan(e));
    const kvb_model_config *c = kvb_model_cfg(e->m);
    kvb_step_report rep = {.step = e->stats.steps, .t_plan_ns = kvb_now_ns() - t0, .n_layers = c->n_layers,
                           .t_layer_ns = e->t_layer, .t_wait_ns = e->t_wait};
    int n_sched = apply_plan(e, &rep);
    if (n_sched == 0) return KVB_OK;
    int n_tok = 0, n_blk = 0, n_logits = 0, stream = 0;
    for (int i = 0; i < n_sched; i++) n_blk += e->sched[i]->bt.n;
    kvb_status st;
    KVB_TRY_GOTO(ensure_blk_cap(e, n_blk), fail);
    n_blk = 0;
    for (int i = 0; i < n_sched; i++) {
        seq *s = e->sched[i];
        kvb_attn_seq *as = &e->b_seqs[i];
        as->q_start = n_tok;
        as->q_len = s->q_len;
        as->ctx_len = s->n_computed + s->q_len;
        as->n_blocks = KVB_DIV_CEIL(as->ctx_len, e->o.block_size);
        as->blk_first = n_blk;
        for (int j = 0; j < as->n_blocks; j++) {
            e->blk_id[n_blk] = s->bt.ids[j];
            e->blk_base[n_blk++] = e->sl ? NULL : kvb_block_pool_block(e->pool, s->bt.ids[j]);
        }
        for (int t = 0; t < s->q_len; t++) {
            e->b_tokens[n_tok] = s->tokens[s->n_computed + t];
            e->b_pos[n_tok] = s->n_computed + t;
            n_tok++;
        }
        if (as->ctx_len == s->n_tokens) e->b_logit_rows[n_logits++] = n_tok - 1;
        rep.n_prefill_seqs += s->q_len > 1;
    }
    rep.n_seqs = n_sched;
    rep.n_tokens = n_tok;
    kvb_batch b = {
        .n_tokens = n_tok,
        .tokens = e->b_tokens,
        .pos = e->b_pos,
        .attn = {.geom = &e->geom, .n_seqs = n_sched, .seqs = e->b_seqs, .layer_blocks = e->blk_layer},
        .n_logits = n_logits,
        .logit_rows = e->b_logit_rows,
    };
    /* Residency: own and borrowed blocks are read in place (block base + layer offset), except that
     * with lsc_stream the borrowed ones are read from their LSC slot of the layer's parity. */
    size_t layer_bytes = kvb_kv_layer_bytes(&e->geom);
    lsc *ls = &e->lsc;
    if (e->sl) { /* request-level placements: install them, prefetch slots for the host layers */
        KVB_TRY_GOTO(kvb__slices_install(e, n_sched), fail_sl);
        KVB_TRY_GOTO(kvb__slices_step_begin(e, n_blk), fail_sl);
    }
    if (e->o.lsc_stream && e->n_borrowed > 0) stream = lsc_prepare(e, n_sched, n_blk) > 0;
    if (stream) {
        /* layers 0 and 1 load at once (different buffers), overlapping the embedding; the load of
         * layer l+2 is posted after the store of layer l, which used the same buffer */
        kvb__lsc_begin(ls);
        for (int l = 0; l < KVB_MIN(2, c->n_layers); l++) {
            ls->ticket[l] = kvb__lsc_post(ls, LSC_LOAD, l);
            e->stats.lsc_loads += (uint64_t)ls->n_used;
        }
    }
    KVB_TRY_GOTO(kvb_forward_begin(e->fw, &b), fail_lsc);
    for (int l = 0; l < c->n_layers; l++) {
        uint64_t tl = kvb_now_ns();
        if (e->sl) KVB_TRY_GOTO(kvb__slices_layer(e, n_sched, l), fail_sl);
        else
            for (int j = 0; j < n_blk; j++) e->blk_layer[j] = (char *)e->blk_base[j] + (size_t)l * layer_bytes;
        if (stream) {
            KVB_TRY_GOTO(kvb__lsc_wait(ls, ls->ticket[l]), fail_lsc);
            for (int j = 0; j < n_blk; j++)
                if (ls->entry_slot[j] >= 0) e->blk_layer[j] = kvb__lsc_buf(ls, ls->entry_slot[j], l & 1);
        }
        e->t_wait[l] = kvb_now_ns() - tl;
        KVB_TRY_GOTO(kvb_forward_layer(e->fw, l), fail_lsc);
        if (e->sl) {
            /* the layer's kernels are done with its prefetch slots once the backend is idle */
            KVB_TRY_GOTO(kvb_model_backend(e->m)->iface->sync(kvb_model_backend(e->m)->ctx), fail_sl);
            KVB_TRY_GOTO(kvb__slices_layer_done(e, n_sched, l), fail_sl);
        }
        if (stream) {
            /* the layer's kernels are done with its buffers once the backend is idle */
            KVB_TRY_GOTO(kvb_model_backend(e->m)->iface->sync(kvb_model_backend(e->m)->ctx), fail_lsc);
            kvb__lsc_post(ls, LSC_STORE, l);
            for (int k = 0; k < ls->n_used; k++) e->stats.lsc_stores += ls->dirty_lo[k] < ls->dirty_hi[k];
            if (l + 2 < c->n_layers) {
                ls->ticket[l + 2] = kvb__lsc_post(ls, LSC_LOAD, l + 2);
                e->stats.lsc_loads += (uint64_t)ls->n_used;
            }
        }
        e->t_layer[l] = kvb_now_ns() - tl;
    }
    if (stream) {
        KVB_TRY_GOTO(kvb__lsc_wait(ls, ls->posted), fail_lsc); /* every store is back before the step ends */
        lsc_finish(e, n_blk);
        stream = 0;
    }
    KVB_TRY_GOTO(kvb_forward_end(e->fw, e->logits), fail_sl);
    kvb__slices_step_end(e, n_sched);
    e->stats.steps++;
    e->stats.max_running = KVB_MAX(e->stats.max_running, e->running.n);

    uint64_t now = kvb_wall_ns();
    int li = 0;
    for (int i = 0; i < n_sched; i++) {
        seq *s = e->sched[i];
        int decode = s->q_len == 1 && s->n_generated > 0 && s->n_computed == s->n_tokens - 1;
        if (!decode) e->stats.prompt_tokens += (uint64_t)s->q_len;
        s->n_computed += s->q_len;
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
        if (is_stop(s, tok)) kvb__finish(e, &e->running, s, KVB_FINISH_STOP, KVB_OK);
        else if (s->n_generated >= s->max_tokens) kvb__finish(e, &e->running, s, KVB_FINISH_LENGTH, KVB_OK);
    }
    rep.t_step_ns = kvb_now_ns() - t0;
    if (e->planner.iface && e->planner.iface->observe) e->planner.iface->observe(e->planner.ctx, &rep);
    return KVB_OK;
fail_lsc:
    if (stream) {
        (void)kvb__lsc_wait(ls, ls->posted); /* no copy may run on after the step */
        lsc_finish(e, n_blk);
    }
fail_sl:
    kvb__slices_step_end(e, 0); /* prefetch slots back; the failed step's rows are not counted */
fail:
    KVB_LOG_E("engine step failed: %s; failing %d live requests", kvb_status_str(st), e->waiting.n + e->running.n);
    while (e->running.head) kvb__finish(e, &e->running, e->running.head, KVB_FINISH_ERROR, st);
    while (e->waiting.head) kvb__finish(e, &e->waiting, e->waiting.head, KVB_FINISH_ERROR, st);
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
    free(e->logits);
    free(e->sample_scratch);
    free(e->t_layer);
    free(e->t_wait);
    kvb_plan_free(&e->plan);
}
