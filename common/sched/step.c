/* kvbank — the step's memory (e->step): the arrays the executor lays a batch out into, the scratch slices
 * of recomputed tokens, and backend memory kept across steps for the mechanisms' buffers. */
#include <string.h>

#include "common/sched/state.h"

static size_t layer_bytes(const kvb_engine *e) { return kvb_kv_layer_bytes(&e->geom); }

kvb_status kvb__backend_reserve(kvb_engine *e, size_t bytes, void **mem, size_t *have) {
    if (bytes <= *have) return KVB_OK;
    kvb_backend *be = kvb_model_backend(e->m);
    void *m = NULL;
    KVB_TRY(kvb_mem_alloc(be->mem, bytes, &m));
    kvb_mem_free(be->mem, *mem);
    *mem = m;
    *have = bytes;
    return KVB_OK;
}

void *kvb__scratch_slice(const kvb_engine *e, int k, int l) {
    const kvb__step *st = &e->step;
    return (char *)st->scratch + ((size_t)(l & 1) * (size_t)st->scr_par + (size_t)k) * layer_bytes(e);
}

kvb_status kvb__step_init(kvb_engine *e) {
    kvb__step *st = &e->step;
    int ms = e->o.max_seqs, L = e->geom.n_layers, vocab = kvb_model_cfg(e->m)->vocab;
    KVB_TRY(kvb_calloc((size_t)ms, sizeof *st->sched, (void **)&st->sched));
    KVB_TRY(kvb_calloc((size_t)e->max_rows, sizeof *st->tokens, (void **)&st->tokens));
    KVB_TRY(kvb_calloc((size_t)e->max_rows, sizeof *st->pos, (void **)&st->pos));
    /* two attention sequences per request: its recomputed prefix (n_absent) and its new tokens */
    KVB_TRY(kvb_calloc(2 * (size_t)ms, sizeof *st->seqs, (void **)&st->seqs));
    KVB_TRY(kvb_calloc((size_t)ms, sizeof *st->logit_rows, (void **)&st->logit_rows));
    KVB_TRY(kvb_calloc((size_t)ms, sizeof *st->plp_rows, (void **)&st->plp_rows));
    KVB_TRY(kvb_calloc((size_t)ms * (size_t)vocab, sizeof(float), (void **)&st->logits));
    KVB_TRY(kvb_calloc(2 * (size_t)vocab, sizeof(float), (void **)&st->sample_scratch));
    KVB_TRY(kvb_calloc((size_t)vocab, sizeof *st->row_copy, (void **)&st->row_copy));
    KVB_TRY(kvb_calloc((size_t)vocab, sizeof *st->counts, (void **)&st->counts));
    KVB_TRY(kvb_calloc((size_t)ms, sizeof *st->lp, (void **)&st->lp));
    KVB_TRY(kvb_calloc((size_t)ms * KVB_MAX_TOP_LOGPROBS, sizeof *st->top_ids, (void **)&st->top_ids));
    KVB_TRY(kvb_calloc((size_t)ms * KVB_MAX_TOP_LOGPROBS, sizeof *st->top_lp, (void **)&st->top_lp));
    KVB_TRY(kvb_calloc((size_t)ms, sizeof *st->sample_rows, (void **)&st->sample_rows));
    KVB_TRY(kvb_calloc((size_t)ms, sizeof *st->sampled, (void **)&st->sampled));
    KVB_TRY(kvb_calloc((size_t)L, sizeof *st->t_layer, (void **)&st->t_layer));
    KVB_TRY(kvb_calloc((size_t)L, sizeof *st->t_wait, (void **)&st->t_wait));
    KVB_TRY(kvb_calloc((size_t)L, sizeof *st->l_rows, (void **)&st->l_rows));
    KVB_TRY(kvb_calloc((size_t)L, sizeof *st->l_seqs, (void **)&st->l_seqs));
    KVB_TRY(kvb_calloc((size_t)ms, sizeof *st->pfx, (void **)&st->pfx));
    return KVB_OK;
}

void kvb__step_free(kvb_engine *e) {
    kvb__step *st = &e->step;
    free(st->sched);
    free(st->tokens);
    free(st->pos);
    free(st->seqs);
    free(st->logit_rows);
    free(st->plp_rows);
    free(st->ent);
    free(st->layer);
    free(st->pfx);
    free(st->l_rows);
    free(st->l_seqs);
    free(st->logits);
    free(st->sample_scratch);
    free(st->gmask);
    free(st->row_copy);
    free(st->counts);
    free(st->lp);
    free(st->top_ids);
    free(st->top_lp);
    free(st->sample_rows);
    free(st->sampled);
    free(st->t_layer);
    free(st->t_wait);
    if (st->scratch) kvb_mem_free(kvb_model_backend(e->m)->mem, st->scratch);
    memset(st, 0, sizeof *st);
}
