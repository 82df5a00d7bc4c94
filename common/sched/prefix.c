/* kvbank — host copies of released prefix blocks (eLLM token-wise with swapped prefix layers, §4.3) as an
 * executor mechanism. A DROP with n_host stores the upper layers [L - layers, L) of the blocks it releases
 * to new host-tier blocks before they go (once: a request keeps one layer count for all its copies); a
 * RUN with n_host then reads those layers from the copies instead of recomputing them: they are loaded
 * into the step's scratch slices (two parities, layer l+1's loads landing while layer l reads the other)
 * two layers ahead of the compute, and the recomputed rows leave the forward pass below them.
 *
 * Per request (kvb__seq.mx[KVB__MECH_PREFIX], made on its first stored copy): the copies' table
 * (bt.ids[j] is block j's copy: bt.n == the request's n_dropped while it has copies), their layer count,
 * and during a step the layers read from them. */
#include <assert.h>

#include "common/sched/state.h"

typedef struct pf_seq {
    kvb_block_table bt; /* host-tier copies of its released blocks */
    int layers;         /* layers [L - layers, L) of each; 0: no copies */
    int kept;           /* during a step: layers [L - kept, L) of its released blocks are read from them */
} pf_seq;

typedef struct prefix {
    uint64_t *t;        /* [n_layers] ticket of the loads due before each layer (0: none) */
    int serial;         /* this step's loads start when their layer is due (KVB_PLAN_SERIAL_LOADS) */
    kvb__xlist xl;
} prefix;

static pf_seq *of(const kvb__seq *s) { return s->mx[KVB__MECH_PREFIX]; }

static size_t layer_bytes(const kvb_engine *e) { return kvb_kv_layer_bytes(&e->geom); }

int kvb__prefix_kept_layers(const kvb_engine *e, const kvb__seq *s) {
    (void)e;
    return of(s) ? of(s)->kept : 0;
}

/* DROP n_host: before blocks [cur, to) of `s` are released, their layers [L - layers, L) go to new
 * host-tier blocks (counted by the plan's check) over the host link, once (eLLM §4.3: swapped prefix
 * KV is written before its device blocks are freed). A request keeps one layer count for all its
 * copies: its first DROP sets it (n_host), later DROPs store the same layers whatever their n_host, so
 * that every released block has a copy or none has. */
static kvb_status store_copies(kvb_engine *e, kvb__seq *s, int to, int n_host) {
    pf_seq *q = of(s);
    int cur = s->n_dropped, L = e->geom.n_layers;
    if ((!q || q->layers == 0) && (cur > 0 || n_host <= 0)) return KVB_OK;
    if (!q) {
        KVB_TRY(kvb_calloc(1, sizeof *q, (void **)&q));
        s->mx[KVB__MECH_PREFIX] = q;
    }
    assert(q->bt.n == cur);
    int layers = cur == 0 ? n_host : q->layers;
    KVB_TRY(kvb__host_blocks_push(e, &q->bt, to - cur));
    q->layers = layers;
    KVB_TRY(kvb__host_move(e, KVB_XFER_D2H, s->bt.ids, q->bt.ids + cur, to - cur, L - layers));
    e->stats.prefix_host_stores += (uint64_t)(to - cur);
    return KVB_OK;
}

static kvb_status pf_check_op(void *ctx, const kvb_engine *e, kvb_acct *a, const kvb_plan_op *op, int k, char *err,
                              size_t len) {
    (void)ctx;
    int L = e->geom.n_layers;
    if (op->kind != KVB_OP_RUN && op->kind != KVB_OP_DROP) return KVB_OK;
    if (op->n_host < 0 || op->n_host > L)
        return kvb_plan_refuse_op(err, len, k, op, "n_host %d is outside [0, %d layers]", op->n_host, L);
    if (op->kind == KVB_OP_RUN) return KVB_OK;
    const kvb_req_view *r = &a->v->reqs[kvb_view_find(a->v, op->id)];
    int cur = r->n_dropped, to = op->n_dropped;
    if (to > cur && ((cur == 0 && op->n_host > 0) || r->host_layers > 0)) { /* copies of the released blocks */
        if (!e->ht_pool)
            return kvb_plan_refuse_op(err, len, k, op, "n_host %d, but the engine has no host tier (plan_pool sets "
                                                       "host_tier_blocks)", KVB_MAX(op->n_host, r->host_layers));
        if (to - cur > a->host_left)
            return kvb_plan_refuse_op(err, len, k, op, "its released blocks need %d host-tier block(s), the host tier "
                                                       "can give %d at this point of the plan", to - cur, a->host_left);
        a->host_left -= to - cur;
    }
    return KVB_OK;
}

static kvb_status pf_apply_op(void *ctx, kvb_engine *e, kvb__seq *s, const kvb_plan_op *op) {
    (void)ctx;
    pf_seq *q = of(s);
    switch (op->kind) {
    case KVB_OP_RUN:
        /* released blocks' upper layers from their copies: at most the layers they hold, none in a step
         * that restores blocks (those are filled at every layer by the recompute) */
        if (q) q->kept = s->n_dropped > 0 && s->restore_hi <= s->n_dropped ? KVB_MIN(op->n_host, q->layers) : 0;
        return KVB_OK;
    case KVB_OP_ADMIT:
        if (q) q->kept = 0;
        return KVB_OK;
    case KVB_OP_DROP:
        if (op->n_dropped > s->n_dropped) return store_copies(e, s, op->n_dropped, op->n_host);
        if (q && q->layers > 0 && op->n_dropped < s->n_dropped) {
            /* the restored blocks' copies go: the table keeps blocks [0, to) */
            for (int j = op->n_dropped; j < q->bt.n; j++) kvb_block_pool_unref(e->ht_pool, q->bt.ids[j]);
            q->bt.n = op->n_dropped;
            if (op->n_dropped == 0) q->layers = 0;
        }
        return KVB_OK;
    default: return KVB_OK;
    }
}

/* The loads of layer l: every scheduled request reading layer l of its released blocks from their copies
 * gets them into its scratch slices of the layer's parity, one transfer over the host link. */
static kvb_status post_loads(prefix *p, kvb_engine *e, int l) {
    size_t lb = layer_bytes(e);
    int L = e->geom.n_layers, n = 0;
    kvb_xfer *first = p->xl.x + p->xl.n;
    p->t[l] = 0;
    for (int i = 0; i < e->step.n_sched; i++) {
        const kvb__seq *s = e->step.sched[i];
        const pf_seq *q = of(s);
        if (!q || l < L - q->kept) continue;
        for (int j = 0; j < s->n_dropped; j++) {
            const char *src = (const char *)kvb_block_pool_block(e->ht_pool, q->bt.ids[j]) + (size_t)l * lb;
            *kvb__xlist_add(&p->xl) = (kvb_xfer){kvb__scratch_slice(e, s->scr0 + j, l), src, lb};
            n++;
        }
    }
    if (n == 0) return KVB_OK;
    e->stats.prefix_host_loads += (uint64_t)n;
    return kvb_stager_post(e->stager, KVB_LINK_HOST, KVB_XFER_H2D, first, n, &p->t[l]);
}

static kvb_status pf_step_begin(void *ctx, kvb_engine *e, unsigned *flags) {
    prefix *p = ctx;
    int pieces = 0, L = e->geom.n_layers;
    *flags = 0;
    for (int i = 0; i < e->step.n_sched; i++)
        if (of(e->step.sched[i])) pieces += e->step.sched[i]->n_dropped * of(e->step.sched[i])->kept;
    if (pieces == 0) return KVB_OK;
    KVB_TRY(kvb__xlist_reserve(&p->xl, pieces));
    p->serial = (e->plan.prefix_serial & KVB_PLAN_SERIAL_LOADS) != 0;
    for (int l = 0; l < L; l++) p->t[l] = 0;
    for (int l = 0; !p->serial && l < KVB_MIN(2, L); l++) KVB_TRY(post_loads(p, e, l));
    *flags = KVB__STEP_ACTIVE | KVB__STEP_SYNC | KVB__STEP_DRAIN;
    return KVB_OK;
}

static kvb_status pf_layer_in(void *ctx, kvb_engine *e, int l) {
    prefix *p = ctx;
    if (p->serial) KVB_TRY(post_loads(p, e, l)); /* "without overlap" (§6.3) */
    if (p->t[l]) KVB_TRY(kvb_stager_wait_device(e->stager, p->t[l])); /* the layer's kernels after its loads */
    return KVB_OK;
}

/* After layer l (the backend idle): the loads two layers ahead, into the parity layer l has used. */
static kvb_status pf_layer_out(void *ctx, kvb_engine *e, int l) {
    prefix *p = ctx;
    if (!p->serial && l + 2 < e->geom.n_layers) KVB_TRY(post_loads(p, e, l + 2));
    return KVB_OK;
}

static void pf_step_end(void *ctx, kvb_engine *e, int ok) {
    (void)ctx;
    (void)ok;
    for (int i = 0; i < e->step.n_sched; i++)
        if (of(e->step.sched[i])) of(e->step.sched[i])->kept = 0;
}

static void pf_view_req(void *ctx, const kvb_engine *e, const kvb__seq *s, kvb_req_view *r) {
    (void)ctx;
    (void)e;
    if (of(s)) r->host_layers = of(s)->layers;
}

static void pf_seq_release(void *ctx, kvb_engine *e, kvb__seq *s, kvb__release why) {
    (void)ctx;
    pf_seq *q = of(s);
    if (!q) return;
    kvb_block_table_release(&q->bt, e->ht_pool);
    q->layers = 0;
    if (why == KVB__RELEASE_KV) return;
    kvb_block_table_free(&q->bt);
    free(q);
    s->mx[KVB__MECH_PREFIX] = NULL;
}

static void pf_destroy(void *ctx, kvb_engine *e) {
    (void)e;
    prefix *p = ctx;
    free(p->t);
    free(p->xl.x);
    free(p);
}

static const kvb__mech_i prefix_iface = {
    .name = "prefix copies",
    .check_op = pf_check_op,
    .apply_op = pf_apply_op,
    .step_begin = pf_step_begin,
    .layer_in = pf_layer_in,
    .layer_out = pf_layer_out,
    .step_end = pf_step_end,
    .view_req = pf_view_req,
    .seq_release = pf_seq_release,
    .destroy = pf_destroy,
};

kvb_status kvb__prefix_init(kvb_engine *e) {
    prefix *p = NULL;
    KVB_TRY(kvb_calloc(1, sizeof *p, (void **)&p));
    e->mech[KVB__MECH_PREFIX] = (kvb__mech){.iface = &prefix_iface, .ctx = p};
    return kvb_calloc((size_t)e->geom.n_layers, sizeof *p->t, (void **)&p->t);
}
