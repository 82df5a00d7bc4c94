/* kvbank — the queues: requests and the lists they wait, run or sit swapped in (by arrival), their
 * release, preemption and end. */
#include <stdarg.h>
#include <stdio.h>
#include <string.h>

#include "common/sched/state.h"

/* Each mechanism's seq_release for s. */
static void mechs_seq_release(kvb_engine *e, kvb__seq *s, kvb__release why) {
    for (int k = 0; k < KVB__MECH_COUNT; k++) {
        const kvb__mech *m = &e->mech[k];
        if (m->iface && m->iface->seq_release) m->iface->seq_release(m->ctx, e, s, why);
    }
}

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
    mechs_seq_release(e, s, KVB__RELEASE_SEQ);
    kvb_block_table_free(&s->bt);
    if (e->ht_pool) kvb_block_table_release(&s->host_bt, e->ht_pool);
    kvb_block_table_free(&s->host_bt);
    kvb_grammar_matcher_destroy(s->matcher);
    free(s->tokens);
    free(s->stop);
    free(s->bias);
    free(s);
}

void kvb__seq_drop_kv(kvb_engine *e, kvb__seq *s) {
    kvb__seq_release_blocks(e, s);
    s->n_dropped = 0;
    s->restore_hi = 0;
    mechs_seq_release(e, s, KVB__RELEASE_KV);
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
    char why[160];
    if (kvb_sampling_check(&r->sampling, c->vocab, why, sizeof why) != KVB_OK)
        return reject(e, r->id, "invalid sampling parameters: %s", why);
    int64_t total = (int64_t)r->n_prompt + r->max_tokens;
    if (total > e->o.max_model_len)
        return reject(e, r->id, "prompt (%d) + max_tokens (%d) exceeds the model length %d", r->n_prompt, r->max_tokens,
                      e->o.max_model_len);
    /* never fit: more than the own memory (lent-out part included) plus what is borrowed now, or for a
     * master plus what its planner lets it borrow at most: loans that are not there yet (a restart, a
     * drain) are waited for, not refused */
    int64_t most = (int64_t)kvb_block_pool_capacity(e->pool) + e->n_borrowed;
    if (e->o.borrows) most = e->max_borrowed >= 0 ? KVB_MAX(most, (int64_t)kvb_block_pool_capacity(e->pool) + e->max_borrowed)
                                                   : INT64_MAX;
    int64_t blocks = KVB_DIV_CEIL(total, e->o.block_size);
    if (kvb__sliced(e)) { /* sliced: the ids (host homes), and the device slices the planner needs at least */
        int64_t slices = (int64_t)kvb_block_pool_capacity(e->pool) * c->n_layers;
        if (blocks > kvb_block_pool_id_limit(e->pool) || blocks * kvb__slices_min_layers(e) > slices)
            return reject(e, r->id, "%lld tokens can never fit: %lld blocks of %d, %d block ids, %lld device slices "
                          "of which the planner needs %d per block", (long long)total, (long long)blocks,
                          e->o.block_size, kvb_block_pool_id_limit(e->pool), (long long)slices,
                          kvb__slices_min_layers(e));
    } else if (blocks > most) {
        return reject(e, r->id, "%lld tokens can never fit in %lld KV blocks of %d%s", (long long)total, (long long)most,
                      e->o.block_size, e->o.borrows ? " (its own and the most its planner borrows)" : "");
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
    if (r->sampling.n_logit_bias > 0) {
        size_t nb = (size_t)r->sampling.n_logit_bias * sizeof *s->bias;
        KVB_TRY_GOTO(kvb_malloc(nb, (void **)&s->bias), fail);
        memcpy(s->bias, r->sampling.logit_bias, nb);
    }
    memcpy(s->tokens, r->prompt, (size_t)r->n_prompt * sizeof(int32_t));
    s->id = r->id;
    s->arrival = e->next_arrival++;
    s->t_add_ns = kvb_wall_ns();
    s->n_tokens = s->n_prompt = r->n_prompt;
    s->max_tokens = r->max_tokens;
    s->slo_ns = (uint64_t)(r->tbt_slo_ms * 1e6 + 0.5);
    s->samp = r->sampling;
    s->samp.logit_bias = s->bias;
    s->out_start = r->n_prompt - r->resume_index;
    s->plp_next = r->sampling.prompt_logprobs && s->out_start > 1 ? 1 : 0;
    kvb_rng_seed(&s->rng, r->sampling.seed);
    /* A resumed request's earlier tokens each took one draw (kvb_sample draws once per token when it
     * samples at all): continue the same random stream after them. */
    for (int k = 0; r->sampling.temperature > 0 && k < r->resume_index; k++) kvb_rng_uniform(&s->rng);
    s->last_hash = KVB_PREFIX_ROOT;
    s->vidx = -1;
    s->matcher = r->matcher; /* taken: nothing fails after this */
    kvb__list_insert_ordered(&e->waiting, s);
    return KVB_OK;
fail:
    free(s->tokens);
    free(s->stop);
    free(s->bias);
    free(s);
    return st;
}

