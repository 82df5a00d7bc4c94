/* kvbank — HCache (Gao et al., EuroSys '25) as an executor mechanism: a RUN or ADMIT with n_hidden saves
 * the hidden states entering layers [0, n_hidden) of its new tokens to host memory; a SWAP_OUT with
 * n_hidden leaves those layers behind as hidden states instead of KV, and its SWAP_IN rebuilds their K
 * and V from them (the layer's norm, K/V projections and RoPE) instead of copying them back.
 *
 * Per request (kvb__seq.mx[KVB__MECH_HCACHE], made on its first save): the saved states of tokens
 * [0, tokens) for layers [0, layers), host memory [cap_layers][cap_tokens][hidden] of the backend's
 * activation type, sized once for every token the request may ever hold. */
#include <string.h>

#include "common/sched/state.h"

typedef struct hc_seq {
    unsigned char *hid;        /* [cap_layers][cap_tokens][row_bytes] */
    int cap_layers, cap_tokens;
    int layers, tokens;        /* what is saved: layers [0, layers) of tokens [0, tokens) */
    int save;                  /* during a step: layers whose inputs this step saves (op n_hidden) */
    int swapped;               /* SWAPPED: layers left as hidden states (their KV is rebuilt at SWAP_IN) */
} hc_seq;

typedef struct hcache {
    size_t row_bytes;          /* one token's hidden state */
    void *stage;               /* backend memory staging restored states, [stage_bytes] */
    size_t stage_bytes;
} hcache;

static hc_seq *of(const kvb__seq *s) { return s->mx[KVB__MECH_HCACHE]; }

static hcache *get(const kvb_engine *e) { return e->mech[KVB__MECH_HCACHE].ctx; }

static unsigned char *hid_at(const hcache *h, const hc_seq *q, int layer, int token) {
    return q->hid + ((size_t)layer * q->cap_tokens + (size_t)token) * h->row_bytes;
}

/* A RUN or ADMIT saves the inputs of layers [0, n_hidden) of its new tokens: host memory for every layer
 * and token it may ever save (prompt + max_tokens). Saving must continue where it stopped, else what
 * is saved can no longer rebuild the KV of every token and is forgotten. */
static kvb_status hidden_begin(hcache *h, kvb__seq *s, int n_hidden) {
    hc_seq *q = of(s);
    if (q) q->save = 0;
    if (n_hidden <= 0) return KVB_OK;
    if (!q) {
        KVB_TRY(kvb_calloc(1, sizeof *q, (void **)&q));
        s->mx[KVB__MECH_HCACHE] = q;
    }
    int cap_tok = s->n_prompt + s->max_tokens;
    if (!q->hid || q->cap_layers < n_hidden || q->cap_tokens < cap_tok) {
        unsigned char *p = NULL;
        KVB_TRY(kvb_aligned_alloc((size_t)n_hidden * (size_t)cap_tok * h->row_bytes, (void **)&p));
        free(q->hid);
        q->hid = p;
        q->cap_layers = n_hidden;
        q->cap_tokens = cap_tok;
        q->layers = q->tokens = 0;
    }
    if (q->tokens != s->n_computed) q->layers = q->tokens = 0;
    if (s->n_computed > 0 && q->layers == 0) return KVB_OK; /* a gap: nothing to continue */
    q->save = n_hidden;
    return KVB_OK;
}

static kvb_status hc_apply_op(void *ctx, kvb_engine *e, kvb__seq *s, const kvb_plan_op *op) {
    (void)e;
    if (op->kind != KVB_OP_RUN && op->kind != KVB_OP_ADMIT) return KVB_OK;
    /* an offloaded admission's KV leaves the device as it is computed: nothing to rebuild it into */
    return hidden_begin(ctx, s, op->offload ? 0 : op->n_hidden);
}

static kvb_status hc_check_op(void *ctx, const kvb_engine *e, kvb_acct *a, const kvb_plan_op *op, int k, char *err,
                              size_t len) {
    (void)ctx;
    int L = e->geom.n_layers;
    if ((op->kind == KVB_OP_RUN || op->kind == KVB_OP_ADMIT) && (op->n_hidden < 0 || op->n_hidden > L))
        return kvb_plan_refuse_op(err, len, k, op, "n_hidden %d is outside [0, %d layers]", op->n_hidden, L);
    if (op->kind == KVB_OP_SWAP_OUT) {
        const kvb_req_view *r = &a->v->reqs[kvb_view_find(a->v, op->id)];
        if (op->n_hidden < 0 || op->n_hidden > r->hidden_layers)
            return kvb_plan_refuse_op(err, len, k, op, "n_hidden %d, but hidden states are saved for %d layer(s)",
                                                       op->n_hidden, r->hidden_layers);
    }
    return KVB_OK;
}

static kvb_status hc_step_begin(void *ctx, kvb_engine *e, unsigned *flags) {
    (void)ctx;
    for (int i = 0; i < e->step.n_sched; i++)
        if (of(e->step.sched[i]) && of(e->step.sched[i])->save > 0) {
            *flags = KVB__STEP_ACTIVE;
            return KVB_OK;
        }
    *flags = 0;
    return KVB_OK;
}

/* Before layer l: the scheduled requests that save layer l's inputs copy their rows of the residual
 * stream to host memory. Written with the backend's to_host, not through the stager's link model:
 * HCache streams these saves out behind the compute, and a per-step transfer under a scaled link
 * preset would pay the preset's per-transfer latency (10 us scaled by the compute ratio: 100 ms and
 * more for a tiny model), an artifact of the scaling that would only handicap this baseline. The
 * restoration (SWAP_IN) does go over the host link. */
static kvb_status hc_layer_in(void *ctx, kvb_engine *e, int l) {
    hcache *h = ctx;
    kvb_backend *be = kvb_model_backend(e->m);
    const unsigned char *x = kvb_forward_hidden(e->fw);
    for (int i = 0; i < e->step.n_sched; i++) {
        kvb__seq *s = e->step.sched[i];
        hc_seq *q = of(s);
        if (!q || q->save <= l) continue;
        KVB_TRY(be->iface->to_host(be->ctx, hid_at(h, q, l, s->n_computed), x + (size_t)s->row0 * h->row_bytes,
                                   (size_t)s->q_len * h->row_bytes));
        e->stats.hidden_saved_bytes += (uint64_t)s->q_len * h->row_bytes;
    }
    return KVB_OK;
}

/* After the step: what the saves of this step cover. */
static void hc_step_done(void *ctx, kvb_engine *e) {
    (void)ctx;
    for (int i = 0; i < e->step.n_sched; i++) {
        kvb__seq *s = e->step.sched[i];
        hc_seq *q = of(s);
        if (!q || q->save <= 0) continue;
        q->layers = q->tokens == 0 ? q->save : KVB_MIN(q->layers, q->save);
        q->tokens = s->n_computed + s->q_len;
        q->save = 0;
    }
}

static void hc_view_req(void *ctx, const kvb_engine *e, const kvb__seq *s, kvb_req_view *r) {
    (void)ctx;
    (void)e;
    const hc_seq *q = of(s);
    if (!q) return;
    r->hidden_layers = r->state == KVB_REQ_SWAPPED ? q->swapped : q->tokens >= s->n_computed ? q->layers : 0;
}

static void hc_seq_release(void *ctx, kvb_engine *e, kvb__seq *s, kvb__release why) {
    (void)ctx;
    (void)e;
    hc_seq *q = of(s);
    if (!q) return;
    if (why == KVB__RELEASE_KV) { /* recomputed from its tokens: saved hidden states are moot */
        q->layers = q->tokens = 0;
        return;
    }
    free(q->hid);
    free(q);
    s->mx[KVB__MECH_HCACHE] = NULL;
}

static void hc_destroy(void *ctx, kvb_engine *e) {
    hcache *h = ctx;
    if (h->stage) kvb_mem_free(kvb_model_backend(e->m)->mem, h->stage);
    free(h);
}

static const kvb__mech_i hcache_iface = {
    .name = "hcache",
    .check_op = hc_check_op,
    .apply_op = hc_apply_op,
    .step_begin = hc_step_begin,
    .layer_in = hc_layer_in,
    .step_done = hc_step_done,
    .view_req = hc_view_req,
    .seq_release = hc_seq_release,
    .destroy = hc_destroy,
};

kvb_status kvb__hcache_init(kvb_engine *e) {
    hcache *h = NULL;
    KVB_TRY(kvb_calloc(1, sizeof *h, (void **)&h));
    h->row_bytes = (size_t)kvb_model_cfg(e->m)->hidden * kvb_dtype_size(kvb_model_backend(e->m)->iface->act_dtype);
    e->mech[KVB__MECH_HCACHE] = (kvb__mech){.iface = &hcache_iface, .ctx = h};
    return KVB_OK;
}

int kvb__hcache_swap_out(kvb_engine *e, kvb__seq *s, int n_hidden) {
    (void)e;
    hc_seq *q = of(s);
    if (q) q->swapped = n_hidden;
    return q ? n_hidden : 0;
}

int kvb__hcache_swapped_layers(const kvb__seq *s) { return of(s) ? of(s)->swapped : 0; }

/* SWAP_IN of a request that left layers [0, swapped) as hidden states: each layer's states go back over
 * the host link (in chunks of the forward's rows) and its K and V are rebuilt into the new blocks. */
kvb_status kvb__hcache_restore(kvb_engine *e, kvb__seq *s) {
    hcache *h = get(e);
    hc_seq *q = of(s);
    int nh = q ? q->swapped : 0, total = s->n_computed, bs = e->o.block_size;
    if (q) q->swapped = 0;
    if (nh <= 0 || total <= 0) return KVB_OK;
    size_t rb = h->row_bytes;
    int chunk = KVB_MIN(total, e->max_rows);
    if ((size_t)chunk * rb > h->stage_bytes) {
        kvb_backend *be = kvb_model_backend(e->m);
        void *m = NULL;
        KVB_TRY(kvb_mem_alloc(be->mem, (size_t)chunk * rb, &m));
        kvb_mem_free(be->mem, h->stage);
        h->stage = m;
        h->stage_bytes = (size_t)chunk * rb;
    }
    int32_t *pos = NULL;
    void **blocks = NULL;
    kvb_status st = kvb_malloc((size_t)chunk * sizeof *pos, (void **)&pos);
    if (st == KVB_OK) st = kvb_malloc((size_t)s->bt.n * sizeof *blocks, (void **)&blocks);
    for (int l = 0; l < nh && st == KVB_OK; l++) {
        for (int a0 = 0; a0 < total && st == KVB_OK; a0 += chunk) {
            int c = KVB_MIN(chunk, total - a0);
            kvb_xfer xf = {h->stage, hid_at(h, q, l, a0), (size_t)c * rb};
            uint64_t t;
            st = kvb__host_tier_finish_loads(e); /* the recompute below may read loaded blocks */
            if (st == KVB_OK) st = kvb_stager_post(e->stager, KVB_LINK_HOST, KVB_XFER_H2D, &xf, 1, &t);
            if (st == KVB_OK) st = kvb_stager_wait(e->stager, t);
            if (st != KVB_OK) break;
            for (int i = 0; i < c; i++) pos[i] = a0 + i;
            kvb_attn_seq as = {.q_start = 0, .q_len = c, .ctx_len = a0 + c, .n_blocks = KVB_DIV_CEIL(a0 + c, bs)};
            for (int j = 0; j < as.n_blocks; j++) blocks[j] = kvb_block_pool_block_layer(e->pool, s->bt.ids[j], l);
            kvb_attn_batch ab = {.geom = &e->geom, .n_heads = kvb_model_cfg(e->m)->n_heads, .n_tokens = c,
                                 .n_seqs = 1, .seqs = &as, .layer_blocks = blocks};
            st = kvb_forward_kv_from_hidden(e->fw, l, h->stage, pos, &ab);
        }
    }
    e->stats.hidden_restores += (uint64_t)(st == KVB_OK);
    free(pos);
    free(blocks);
    return st;
}
