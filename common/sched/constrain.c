/* kvbank — structured output in the engine: a request's grammar matcher (common/text/grammar.h) masks
 * its logits before any other sampling stage and follows every token sampled. The matcher lives in
 * the sequence, so preemption (recompute or swap) keeps it where the output is: recomputing the KV
 * of tokens already generated samples nothing. A resumed request's matcher is replayed over its
 * delivered tokens by the model server before it reaches the engine. */
#include "common/sched/state.h"

kvb_status kvb__constrain_logits(kvb_engine *e, kvb__seq *s, float *logits, int n_logits) {
    kvb__step *st = &e->step;
    const kvb_grammar_vocab *v = kvb_grammar_matcher_vocab(s->matcher);
    size_t words = kvb_grammar_mask_words(v);
    if (words > st->gmask_words) {
        KVB_TRY(kvb_realloc_array((void **)&st->gmask, words, sizeof *st->gmask));
        st->gmask_words = words;
    }
    KVB_TRY(kvb_grammar_matcher_fill_mask(s->matcher, st->gmask));
    /* some allowed token must lie within the logits, or sampling would pick a forbidden one */
    int n = KVB_MIN(n_logits, kvb_grammar_vocab_size(v)), any = 0;
    for (int w = 0; w < n / 32 && !any; w++) any = st->gmask[w] != 0;
    for (int i = n / 32 * 32; i < n && !any; i++) any = (st->gmask[i >> 5] >> (i & 31)) & 1;
    if (!any) {
        KVB_LOG_W("request %llu: its grammar allows no token among the model's %d logits",
                  (unsigned long long)s->id, n_logits);
        return KVB_ERR_INVALID;
    }
    kvb_grammar_mask_apply(v, st->gmask, logits, n_logits);
    return KVB_OK;
}

kvb_status kvb__constrain_accept(kvb__seq *s, int32_t tok, int *done) {
    KVB_TRY(kvb_grammar_matcher_accept_token(s->matcher, tok));
    *done = kvb_grammar_matcher_done(s->matcher);
    return KVB_OK;
}
