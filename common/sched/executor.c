/* kvbank — the executor: asks the planner for a plan and checks it, applies its request-level operations
 * (admit, run, preempt, pause, resume, drop, swap), lays the step out (layout.c), runs the forward pass
 * layer by layer with the mechanisms' hooks around each layer (mech.h), samples, publishes full blocks
 * to the prefix cache and tells the planner what the step measured. */
#include <stdio.h>
#include <string.h>

#include "common/sched/state.h"

/* ---------------------------------------------------------------- applying a plan */

/* Gives `s` blocks for its first `upto` tokens: from the free list, or with `op` placed, the blocks
 * op->block0 + j (checked free by the plan's check). Released leading blocks (DROP) are not given back.
 * KVB_ERR_EXHAUSTED if the pool cannot. */
static kvb_status grow_blocks(kvb_engine *e, kvb__seq *s, int upto, const kvb_plan_op *op) {
    int need = KVB_DIV_CEIL(upto, e->o.block_size) - s->n_dropped;
    while (s->bt.n < need) {
        int32_t id = op && op->placed ? op->block0 + s->bt.n : -1;
        if (id >= 0) KVB_TRY(kvb_block_pool_take(e->pool, id));
        else if (kvb__sliced(e)) KVB_TRY(kvb__slices_new_block(e, &id)); /* its layers get slices at the install */
        else KVB_TRY(kvb_prefix_cache_alloc(e->pc, &id));
        kvb_status st = kvb_block_table_push(&s->bt, id);
        if (st != KVB_OK) {
            kvb_block_pool_unref(e->pool, id);
            return st;
        }
    }
    return KVB_OK;
}

/* Takes the prefix-cache hits of a waiting request: full cached blocks, leaving at least one token to
 * compute for the logits. Sets n_published and last_hash (n_computed follows at admission) and
 * s->hits_taken: 1, or 2 when the match was used whole (the host tier may continue it). */
static void take_hits(kvb_engine *e, kvb__seq *s) {
    if (s->hits_taken) return;
    s->hits_taken = 1;
    if (!e->o.enable_prefix_cache || s->n_computed != 0 || s->plp_next > 0) return; /* view.c's probe */
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

/* KVB_OP_DROP: the request keeps device KV from block `to` on. Releasing moves the table's first entries
 * out (a block shared through the prefix cache stays cached for others); restoring puts new blocks in
 * front, which this step's recompute fills (restore_hi). The mechanisms (host copies of the released
 * blocks) had their part before. */
static kvb_status drop_blocks(kvb_engine *e, kvb__seq *s, int to) {
    int cur = s->n_dropped;
    kvb_block_table *t = &s->bt;
    if (to > cur) {
        int k = to - cur;
        for (int j = 0; j < k; j++) kvb__block_unref(e, t->ids[j]);
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

/* s computes in this step. */
static kvb_status schedule(kvb_engine *e, kvb__seq *s, const kvb_plan_op *op) {
    KVB_TRY(mechs_apply(e, s, op));
    e->step.sched[e->step.n_sched++] = s;
    return KVB_OK;
}

/* ADMIT: the request takes its prefix hits (continued in the host tier), then blocks for its first q_len
 * tokens. *stopped: it no longer fits (a probed hit was evicted since planning), and no admission after
 * it is applied. */
static kvb_status admit(kvb_engine *e, kvb__seq *s, const kvb_plan_op *op, kvb_step_report *rep, int *stopped) {
    if (*stopped) {
        kvb__seq_drop_kv(e, s);
        rep->admits_dropped++;
        return KVB_OK;
    }
    if (op->offload) { /* eLLM's CPU buffer: host-tier blocks for the whole prompt, no pool block */
        KVB_TRY(kvb__offload_admit(e, s));
        return schedule(e, s, op);
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
        *stopped = 1;
        return KVB_OK;
    }
    e->stats.prefix_hit_tokens += (uint64_t)hit;
    kvb__list_remove(&e->waiting, s);
    kvb__list_insert_ordered(&e->running, s);
    for (kvb__seq *w = e->waiting.head; w && w->arrival < s->arrival; w = w->next)
        if (w->t_stall_ns) w->n_overtaken++; /* admitted past a stalled request (bounded) */
    s->q_len = q;
    s->n_absent = 0;
    return schedule(e, s, op);
}

/* Applies the checked plan in order and fills e->step.sched with the requests that compute. A failure (a
 * copy of a swap, memory for saved hidden states) leaves the plan half applied: the step fails. */
static kvb_status apply_plan(kvb_engine *e, kvb_step_report *rep) {
    const kvb_plan *p = &e->plan;
    int stopped = 0;
    e->step.n_sched = 0;
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
            KVB_TRY(schedule(e, s, op));
            break;
        case KVB_OP_ADMIT: KVB_TRY(admit(e, s, op, rep, &stopped)); break;
        case KVB_OP_PREEMPT: kvb__preempt_seq(e, s); break;
        case KVB_OP_PAUSE:
            s->paused = 1;
            e->stats.pauses++;
            break;
        case KVB_OP_RESUME: s->paused = 0; break;
        case KVB_OP_DROP: /* the mechanisms first: they may read the blocks it releases */
            KVB_TRY(mechs_apply(e, s, op));
            KVB_TRY(drop_blocks(e, s, op->n_dropped));
            break;
        case KVB_OP_SWAP_OUT: KVB_TRY(kvb__swap_out(e, s, op->n_hidden)); break;
        case KVB_OP_SWAP_IN: KVB_TRY(kvb__swap_in(e, s, op)); break;
        }
    }
    e->starved = p->starved || stopped;
    e->stats.deferred += (uint64_t)p->n_deferred;
    return KVB_OK;
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

/* ---------------------------------------------------------------- the step */

const char *kvb__planner_name(const kvb_engine *e) {
    return e->planner.iface && e->planner.iface->name ? e->planner.iface->name : "?";
}

/* Asks the planner for the plan and checks it. Nothing changes on failure. */
static kvb_status make_plan(kvb_engine *e) {
    KVB_TRY(kvb__view_build(e));
    kvb_plan_reset(&e->plan);
    kvb_status st = e->planner.iface->plan_step(e->planner.ctx, &e->view, &e->plan);
    if (st != KVB_OK) {
        snprintf(e->last_error, sizeof e->last_error, "planner %s failed: %s", kvb__planner_name(e), kvb_status_str(st));
        KVB_LOG_E("engine: %s", e->last_error);
        return st;
    }
    st = kvb__plan_check(e, NULL);
    if (st == KVB_ERR_INVALID) KVB_LOG_E("engine: plan of %s refused: %s", kvb__planner_name(e), e->last_error);
    return st;
}

/* Runs the forward pass of the laid-out batch layer by layer, the mechanisms' hooks around each layer.
 * Every transfer a mechanism asks to be drained has landed when it returns, also on failure. */
static kvb_status forward(kvb_engine *e, const kvb_batch *b) {
    kvb__step *st = &e->step;
    kvb_backend *be = kvb_model_backend(e->m);
    int L = e->geom.n_layers;
    unsigned flags;
    kvb_status r = mechs_step_begin(e, &flags);
    if (r == KVB_OK) r = kvb_forward_begin(e->fw, b);
    /* "without fusion" (eLLM §6.3): the recomputed rows' GEMMs apart from the new tokens' */
    if (r == KVB_OK && (e->plan.prefix_serial & KVB_PLAN_SERIAL_GEMMS) && st->main_rows < b->n_tokens)
        r = kvb_forward_split(e->fw, st->main_rows);
    int rows = b->n_tokens, seqs = b->attn.n_seqs; /* what the forward pass computes now */
    for (int l = 0; l < L && r == KVB_OK; l++) {
        uint64_t tl = kvb_now_ns();
        if (st->l_rows[l] != rows || st->l_seqs[l] != seqs) { /* prefixes above their recomputed layers leave */
            rows = st->l_rows[l];
            seqs = st->l_seqs[l];
            if ((r = kvb_forward_rows(e->fw, rows, seqs)) != KVB_OK) break;
        }
        e->stats.recomputed_row_layers += (uint64_t)(rows - st->main_rows);
        if (!(flags & KVB__STEP_LAYOUT)) kvb__layout_layer(e, l);
        uint64_t h0, d0, h1, d1;
        kvb_stager_wait_counts(e->stager, &h0, &d0);
        if ((r = mechs_layer(e, l, 0)) != KVB_OK) break;
        kvb_stager_wait_counts(e->stager, &h1, &d1);
        e->stats.layer_in_host_waits += h1 - h0;
        e->stats.layer_in_device_waits += d1 - d0;
        st->t_wait[l] = kvb_now_ns() - tl;
        if ((r = kvb_forward_layer(e->fw, l)) != KVB_OK) break;
        /* the layer's kernels are done with the buffers the mechanisms reuse once the backend is idle; a
         * backend with tickets orders each copy after the operators issued before it (copy_async) */
        if ((flags & KVB__STEP_SYNC) && !be->iface->copy_async && (r = be->iface->sync(be->ctx)) != KVB_OK) break;
        if ((r = mechs_layer(e, l, 1)) != KVB_OK) break;
        st->t_layer[l] = kvb_now_ns() - tl;
    }
    /* the loads the layers waited for on the device have landed: one that failed fails the step */
    if (flags & KVB__STEP_ACTIVE) {
        kvb_status d = kvb_stager_settle(e->stager);
        if (r == KVB_OK) r = d;
    }
    /* every copy is back before the step ends (no copy may run on after a failed one) */
    if (flags & KVB__STEP_DRAIN || r != KVB_OK) {
        kvb_status d = kvb_stager_drain(e->stager);
        if (r == KVB_OK) r = d;
    }
    return r;
}

/* Issue 10: a waiting request that does not fit the pool as it is now (loans went back, own blocks
 * lent, a master not borrowing yet) stalls; after stall_wait_s without blocks coming it ends with
 * KVB_ERR_BUSY (capacity, not the request, is at fault: the gateway says 503 with Retry-After)
 * instead of holding the queue for good (the FCFS scheduler serves up to stall_overtake later requests
 * past it meanwhile). One that fits again starts over. */
static void fail_stalled(kvb_engine *e) {
    if (kvb__sliced(e)) return; /* a sliced pool lends nothing */
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
            KVB_LOG_W("engine: request %llu needs %lld KV blocks, the pool holds %d (blocks lent, reclaimed or not "
                      "borrowed yet), and none came within %.1f s: it fails", (unsigned long long)s->id,
                      (long long)need, n_blocks, e->o.stall_wait_s);
            e->stats.stalled_failed++;
            kvb__finish(e, &e->waiting, s, KVB_FINISH_ERROR, KVB_ERR_BUSY);
        }
        s = next;
    }
}

/* ---------------------------------------------------------------- results */

/* Offers every newly completed full block of `s` to the prefix cache. */
static void publish_full_blocks(kvb_engine *e, kvb__seq *s) {
    int bs = e->o.block_size;
    while ((s->n_published + 1) * bs <= s->n_computed) {
        int b = s->n_published;
        if (b < s->n_dropped) break; /* a released block can no longer be published (nor its successors) */
        if (kvb_prefix_cache_publish(e->pc, s->last_hash, s->tokens + (size_t)b * bs, s->bt.ids[b - s->n_dropped],
                                     &s->last_hash) != KVB_OK)
            break;
        s->n_published++;
    }
}

static int is_stop(const kvb__seq *s, int32_t tok) {
    for (int i = 0; i < s->n_stop; i++)
        if (s->stop[i] == tok) return 1;
    return 0;
}

/* Between the last layer and kvb_forward_end: the prompt logprobs of the step's rows that owe them
 * (layout.c's prompt_lp_rows), a batch's worth of logit rows at a time, reported as they come. */
static kvb_status prompt_logprobs(kvb_engine *e, int cap) {
    kvb__step *st = &e->step;
    int vocab = kvb_model_cfg(e->m)->vocab;
    for (int i = 0; i < st->n_sched; i++) {
        kvb__seq *s = st->sched[i];
        int top = s->samp.top_logprobs;
        for (int k = 0; k < s->plp_n; k += cap) {
            int n = KVB_MIN(cap, s->plp_n - k);
            int32_t *rows = st->plp_rows;
            for (int j = 0; j < n; j++) rows[j] = s->plp_row0 + k + j;
            KVB_TRY(kvb_forward_logits(e->fw, rows, n, st->logits));
            for (int j = 0; j < n; j++)
                kvb_logprobs(st->logits + (size_t)j * vocab, vocab, s->tokens[s->plp_next + k + j], top, &st->lp[j],
                             st->top_ids + (size_t)j * top, st->top_lp + (size_t)j * top);
            if (e->ev.on_prompt_logprobs)
                e->ev.on_prompt_logprobs(e->ev.ud, s->id, s->plp_next + k, n, st->lp, st->top_ids, st->top_lp, top);
        }
        if (s->plp_n) {
            s->plp_next += s->plp_n;
            if (s->plp_next >= s->out_start) s->plp_next = 0;
            s->plp_n = 0;
        }
    }
    return KVB_OK;
}

/* Samples s's next token from its row of logits (sampling.h's pipeline: raw logprobs, processors,
 * greedy or the draw) and reports its logprobs when asked. */
static int32_t sample_one(kvb_engine *e, kvb__seq *s, float *lg, int index) {
    kvb__step *st = &e->step;
    int vocab = kvb_model_cfg(e->m)->vocab;
    const float *raw = lg;
    if (kvb_sampling_processes(&s->samp)) {
        if (s->samp.logprobs) { /* logprobs are of the raw row: keep it */
            memcpy(st->row_copy, lg, (size_t)vocab * sizeof *lg);
            raw = st->row_copy;
        }
        kvb_sample_seq q = {.tokens = s->tokens, .n_tokens = s->n_tokens, .out_start = s->out_start,
                            .stop_ids = s->stop, .n_stop = s->n_stop};
        kvb_logits_process(&s->samp, &q, lg, vocab, st->counts);
    }
    int32_t tok = kvb_sample(&s->samp, &s->rng, lg, vocab, st->sample_scratch);
    if (s->samp.logprobs) {
        int top = s->samp.top_logprobs;
        kvb_logprobs(raw, vocab, tok, top, &st->lp[0], st->top_ids, st->top_lp);
        if (e->ev.on_logprobs) e->ev.on_logprobs(e->ev.ud, s->id, index, st->lp[0], st->top_ids, st->top_lp, top);
    }
    return tok;
}

/* After the step: each request advances by its new tokens; those whose prompt is done get a token. */
static void advance(kvb_engine *e) {
    const kvb_model_config *c = kvb_model_cfg(e->m);
    kvb__step *st = &e->step;
    uint64_t now = kvb_wall_ns();
    int li = 0;
    for (int i = 0; i < st->n_sched; i++) {
        kvb__seq *s = st->sched[i];
        int decode = s->q_len == 1 && s->n_generated > 0 && s->n_computed == s->n_tokens - 1;
        if (!decode) e->stats.prompt_tokens += (uint64_t)s->q_len;
        s->n_computed += s->q_len;
        s->n_absent = 0;
        s->restore_hi = 0;
        if (e->o.enable_prefix_cache) publish_full_blocks(e, s);
        if (s->n_computed != s->n_tokens) continue; /* prefill chunk: no token yet */
        kvb__seq_list *in = s->host_bt.n > 0 && s->bt.n == 0 ? &e->swapped : &e->running; /* offloaded: swapped */
        int index = s->n_generated, done = 0;
        int32_t tok;
        kvb_status cst;
        if (st->device_sampled) {
            tok = st->sampled[li++]; /* plain sampling (forward_end): no mask, processors or logprobs */
        } else {
            float *lg = st->logits + (size_t)li++ * c->vocab;
            cst = s->matcher ? kvb__constrain_logits(e, s, lg, c->vocab) : KVB_OK; /* the first stage */
            if (cst != KVB_OK) {
                kvb__finish(e, in, s, KVB_FINISH_ERROR, cst);
                continue;
            }
            if (e->ev.on_logits) e->ev.on_logits(e->ev.ud, s->id, index, lg, c->vocab);
            tok = sample_one(e, s, lg, index);
        }
        if (s->matcher && (cst = kvb__constrain_accept(s, tok, &done)) != KVB_OK) { /* the mask allowed it: never */
            kvb__finish(e, in, s, KVB_FINISH_ERROR, cst);
            continue;
        }
        s->tokens[s->n_tokens++] = tok;
        s->n_generated++;
        e->stats.generated_tokens++;
        if (e->ev.on_token) e->ev.on_token(e->ev.ud, s->id, index, tok, now);
        if (is_stop(s, tok) || done) kvb__finish(e, in, s, KVB_FINISH_STOP, KVB_OK);
        else if (s->n_generated >= s->max_tokens) kvb__finish(e, in, s, KVB_FINISH_LENGTH, KVB_OK);
    }
}

/* Ends the forward pass: on a backend that samples (kvb_backend_i.sample), with no one asking for the
 * logits and every row plain (no grammar, logits processor or logprobs; no prompt-logprob rows), the
 * logit rows are sampled on the device and only the tokens come back; the rows are in the order
 * advance() takes them, each drawing its uniform number as kvb_sample does (one per sampled token). */
static kvb_status forward_end(kvb_engine *e, int n_logits) {
    kvb__step *st = &e->step;
    st->device_sampled = 0;
    int device = kvb_model_backend(e->m)->iface->sample && !e->ev.on_logits && n_logits == st->n_sample;
    for (int i = 0; device && i < st->n_sched; i++) {
        const kvb__seq *s = st->sched[i];
        if (s->n_computed + s->q_len == s->n_tokens &&
            (s->matcher || s->samp.logprobs || kvb_sampling_processes(&s->samp)))
            device = 0;
    }
    if (!device) return kvb_forward_end(e->fw, st->logits);
    int n = 0;
    for (int i = 0; i < st->n_sched; i++) {
        kvb__seq *s = st->sched[i];
        if (s->n_computed + s->q_len != s->n_tokens) continue; /* a prefill chunk: no token yet */
        int hot = s->samp.temperature > 0;
        st->sample_rows[n++] = (kvb_sample_row){.temperature = s->samp.temperature, .top_k = s->samp.top_k,
                                                .top_p = s->samp.top_p, .u = hot ? kvb_rng_uniform(&s->rng) : 0};
    }
    KVB_TRY(kvb_forward_end_sample(e->fw, st->sample_rows, st->sampled));
    st->device_sampled = n > 0;
    return KVB_OK;
}

kvb_status kvb__exec_step(kvb_engine *e) {
    uint64_t t0 = kvb_now_ns();
    fail_stalled(e);
    KVB_TRY(make_plan(e));
    kvb__step *stp = &e->step;
    kvb_step_report rep = {.step = e->stats.steps, .t_plan_ns = kvb_now_ns() - t0, .n_layers = e->geom.n_layers,
                           .t_layer_ns = stp->t_layer, .t_wait_ns = stp->t_wait};
    e->ht_batch = e->host_prefix; /* demotions go out in one transfer, before anything writes the pool */
    kvb_status st = apply_plan(e, &rep), fst;
    e->ht_batch = 0;
    fst = kvb__host_flush(e);
    if (st == KVB_OK) st = fst;
    if (st != KVB_OK || stp->n_sched == 0) { /* no forward pass: layered loads of admissions the plan dropped land now */
        fst = kvb__host_tier_finish_loads(e);
        if (st == KVB_OK) st = fst;
    }
    if (st != KVB_OK) goto fail;
    if (stp->n_sched == 0) return KVB_OK;
    kvb_batch b;
    KVB_TRY_GOTO(kvb__layout(e, &b), fail);
    for (int i = 0; i < stp->n_sched; i++) {
        rep.n_tokens += stp->sched[i]->q_len;
        rep.n_absent_rows += stp->sched[i]->n_absent;
        rep.n_prefill_seqs += stp->sched[i]->q_len > 1;
    }
    rep.n_seqs = stp->n_sched;
    KVB_TRY_GOTO(forward(e, &b), fail);
    mechs_step_end(e, 1);
    if (b.n_logits > stp->n_sample && (st = prompt_logprobs(e, b.n_logits)) != KVB_OK) goto fail_ended;
    st = forward_end(e, b.n_logits);
    if (st != KVB_OK) goto fail_ended; /* the failed step's rows are not counted */
    mechs_step_done(e);
    e->stats.steps++;
    e->stats.max_running = KVB_MAX(e->stats.max_running, e->running.n);
    advance(e);
    rep.t_step_ns = kvb_now_ns() - t0;
    kvb_stager_take_report(e->stager, rep.links);
    if (e->planner.iface && e->planner.iface->observe) e->planner.iface->observe(e->planner.ctx, &rep);
    return KVB_OK;
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
    kvb__step_free(e);
    kvb_plan_free(&e->plan);
}
