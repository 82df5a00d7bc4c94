/* kvbank — the step's batch as the forward pass reads it (e->step): each scheduled request's new tokens
 * over its blocks, then each recomputed prefix (RUN n_absent) as an attention sequence of its own over
 * scratch slices, and per layer the slice every entry reads from the pool or the scratch. Mechanisms
 * point entries elsewhere in their layer_in (mech.h). */
#include <string.h>

#include "common/sched/state.h"

static size_t layer_bytes(const kvb_engine *e) { return kvb_kv_layer_bytes(&e->geom); }

static kvb_status ent_reserve(kvb__step *st, int n) {
    if (n <= st->cap) return KVB_OK;
    int cap = KVB_MAX(n, st->cap * 2);
    KVB_TRY(kvb_realloc_array((void **)&st->ent, (size_t)cap, sizeof *st->ent));
    KVB_TRY(kvb_realloc_array((void **)&st->layer, (size_t)cap, sizeof *st->layer));
    st->cap = cap;
    return KVB_OK;
}

/* Scratch slices for `n` fully recomputed blocks (one layer each: every layer recomputes them). */
static kvb_status scratch_reserve(kvb_engine *e, int n) {
    size_t have = (size_t)e->step.n_scratch * layer_bytes(e);
    KVB_TRY(kvb__backend_reserve(e, (size_t)n * layer_bytes(e), &e->step.scratch, &have));
    e->step.n_scratch = KVB_MAX(e->step.n_scratch, n);
    return KVB_OK;
}

/* Entry `ent`: block j of `s` (its first `full` blocks are recomputed whole). A released block (DROP) and
 * a fully recomputed block that is not being restored read scratch slice scr0 + j; a restored block
 * receives the recomputed KV in place; the rest are the request's blocks. `own`: the entry belongs to
 * the request's new tokens, whose scratch entries for blocks it still holds read those blocks in place
 * above its recomputed layers. */
static void layout_entry(kvb_engine *e, kvb__seq *s, int j, int full, int ent, int own) {
    kvb__entry *x = &e->step.ent[ent];
    int restored = j >= s->n_dropped && j < s->restore_hi, kept = kvb__prefix_kept_layers(e, s);
    *x = (kvb__entry){.kind = KVB__ENT_BLOCK, .block = -1, .rec = e->geom.n_layers};
    if (kvb__offload_entry(e, s, j, x)) return;
    if (j < s->n_dropped || (j < full && !restored)) {
        x->kind = KVB__ENT_SCRATCH;
        x->slice = s->scr0 + j;
        if (own && j >= s->n_dropped && kept > 0) {
            x->block = s->bt.ids[j - s->n_dropped];
            x->rec = e->geom.n_layers - kept;
        }
    } else {
        x->block = s->bt.ids[j - s->n_dropped];
        x->base = kvb__sliced(e) ? NULL /* per layer: the sliced pool's layer_in */ : kvb_block_pool_block(e->pool, x->block);
    }
}

/* Recomputed prefixes in the order they are laid out: most recomputed layers first (so the rows that
 * leave the forward pass at a layer are the last ones). */
static int by_kept_layers(const void *a, const void *b) {
    const kvb__pfx *x = a, *y = b;
    if (x->kept != y->kept) return x->kept < y->kept ? -1 : 1;
    return x->s->row0 < y->s->row0 ? -1 : x->s->row0 > y->s->row0;
}

/* The rows of s's new tokens (s->row0 set) whose logits give prompt logprobs it owes: row p predicts
 * prompt position p + 1. Sets plp_row0 / plp_n; returns plp_n. */
static int prompt_lp_rows(kvb__seq *s) {
    s->plp_n = 0;
    if (s->plp_next <= 0) return 0;
    int lo = s->n_computed, hi = KVB_MIN(s->n_computed + s->q_len, s->out_start - 1);
    if (s->plp_next - 1 < lo) { /* positions computed without their logits: cannot happen (no prefix hits) */
        KVB_LOG_W("engine: request %llu: prompt logprobs of positions %d..%d are lost", (unsigned long long)s->id,
                  s->plp_next, lo);
        s->plp_next = lo + 1 < s->out_start ? lo + 1 : 0;
        if (!s->plp_next) return 0;
    }
    if (s->plp_next - 1 >= hi) return 0; /* a recompute of rows already reported */
    s->plp_row0 = s->row0 + (s->plp_next - 1 - lo);
    s->plp_n = hi - (s->plp_next - 1);
    return s->plp_n;
}

kvb_status kvb__layout(kvb_engine *e, kvb_batch *b) {
    kvb__step *st = &e->step;
    int bs = e->o.block_size, L = e->geom.n_layers, n_tok = 0, n_ent = 0, n_attn = 0, n_logits = 0, n_scr = 0;
    int n_plp = 0;
    int total = 0, n_pfx = 0, kept = 0;
    for (int i = 0; i < st->n_sched; i++) {
        kvb__seq *s = st->sched[i];
        total += KVB_DIV_CEIL(s->n_computed + s->q_len, bs) + KVB_DIV_CEIL(s->n_absent, bs);
        s->scr0 = n_scr;
        n_scr += s->n_absent / bs;
        kept |= kvb__prefix_kept_layers(e, s) > 0;
        if (s->n_absent > 0) st->pfx[n_pfx++] = (kvb__pfx){.s = s, .kept = kvb__prefix_kept_layers(e, s)};
    }
    KVB_TRY(ent_reserve(st, total));
    KVB_TRY(scratch_reserve(e, kept ? 2 * n_scr : n_scr));
    st->scr_par = kept ? n_scr : 0; /* layer l+1's loads land while layer l reads the other parity */
    for (int i = 0; i < st->n_sched; i++) {
        kvb__seq *s = st->sched[i];
        int full = s->n_absent / bs;
        kvb_attn_seq *as = &st->seqs[n_attn++];
        s->row0 = n_tok;
        *as = (kvb_attn_seq){.q_start = n_tok, .q_len = s->q_len, .ctx_len = s->n_computed + s->q_len,
                             .blk_first = n_ent};
        as->n_blocks = KVB_DIV_CEIL(as->ctx_len, bs);
        for (int j = 0; j < as->n_blocks; j++, n_ent++) layout_entry(e, s, j, full, n_ent, 1);
        for (int t = 0; t < s->q_len; t++, n_tok++) {
            st->tokens[n_tok] = s->tokens[s->n_computed + t];
            st->pos[n_tok] = s->n_computed + t;
        }
        if (as->ctx_len == s->n_tokens) st->logit_rows[n_logits++] = n_tok - 1;
        n_plp += prompt_lp_rows(s);
    }
    st->main_rows = n_tok;
    st->n_sample = n_logits;
    if (n_plp > 0) { /* logit buffers for kvb_forward_logits: within what planners budget (a row per sequence) */
        int cap = e->act_alloc.iface || e->o.act_alloc ? KVB_MAX(n_logits, 1)
                                                        : KVB_MIN(e->o.max_seqs, n_logits + n_plp);
        for (int i = 0; i < st->n_sched && n_logits < cap; i++)
            for (int k = 0; k < st->sched[i]->plp_n && n_logits < cap; k++)
                st->logit_rows[n_logits++] = st->sched[i]->plp_row0 + k;
    }
    qsort(st->pfx, (size_t)n_pfx, sizeof *st->pfx, by_kept_layers);
    for (int l = 0; l < L; l++) {
        st->l_rows[l] = n_tok;
        st->l_seqs[l] = n_attn;
    }
    for (int k = 0; k < n_pfx; k++) {
        kvb__seq *s = st->pfx[k].s;
        int a = s->n_absent, full = a / bs;
        kvb_attn_seq *as = &st->seqs[n_attn++];
        *as = (kvb_attn_seq){.q_start = n_tok, .q_len = a, .ctx_len = a, .n_blocks = KVB_DIV_CEIL(a, bs),
                             .blk_first = n_ent};
        for (int j = 0; j < as->n_blocks; j++, n_ent++) layout_entry(e, s, j, full, n_ent, 0);
        for (int t = 0; t < a; t++, n_tok++) {
            st->tokens[n_tok] = s->tokens[t];
            st->pos[n_tok] = t;
        }
        for (int l = 0; l < L - st->pfx[k].kept; l++) { /* its rows compute the layers below those */
            st->l_rows[l] = n_tok;
            st->l_seqs[l] = n_attn;
        }
        e->stats.recomputed_tokens += (uint64_t)a;
    }
    st->n_ent = n_ent;
    st->n_attn = n_attn;
    *b = (kvb_batch){.n_tokens = n_tok, .tokens = st->tokens, .pos = st->pos,
                     .attn = {.geom = &e->geom, .n_seqs = n_attn, .seqs = st->seqs, .layer_blocks = st->layer},
                     .n_logits = n_logits, .logit_rows = st->logit_rows};
    return KVB_OK;
}

void kvb__layout_layer(kvb_engine *e, int l) {
    kvb__step *st = &e->step;
    size_t lb = layer_bytes(e);
    for (int j = 0; j < st->n_ent; j++) {
        const kvb__entry *x = &st->ent[j];
        switch (x->kind) {
        case KVB__ENT_BLOCK: st->layer[j] = (char *)x->base + (size_t)l * lb; break;
        case KVB__ENT_SCRATCH:
            st->layer[j] = x->block >= 0 && l >= x->rec
                               ? (char *)kvb_block_pool_block(e->pool, x->block) + (size_t)l * lb
                               : kvb__scratch_slice(e, x->slice, l);
            break;
        case KVB__ENT_OFFLOAD: st->layer[j] = NULL; break; /* the offload mechanism's layer_in */
        }
    }
}
