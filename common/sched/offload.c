/* kvbank — offloaded admissions (eLLM's CPU buffer, ../shared/papers/ellm-elastic-memory.txt §4.3.2) as an
 * executor mechanism: an ADMIT with `offload` computes the request's whole prompt in this step while its
 * KV goes to new host-tier blocks and never takes a pool block. Each layer writes the K/V of its blocks
 * into a staging area of two single-layer slices per block (double-buffered: layer l+1 computes while
 * layer l's rows go out), which is stored over the host link after the layer; after the step the
 * request is SWAPPED (a SWAP_IN brings it back).
 *
 * The staging comes from the planner's activation allocator when it has one (the staging joins the
 * step's activations, which its Alg. 1 counted), else from backend memory kept across steps. A request
 * offloaded in this step has s->mx[KVB__MECH_OFFLOAD] set (to the mechanism) until the step ends. */
#include "common/sched/state.h"

typedef struct offload {
    void *stage;            /* [2 parities][n][layer slice] */
    size_t stage_bytes;     /* kept backend memory's size (0 when the activation allocator lends it) */
    int n;                  /* staging blocks of this step: its OFFLOAD entries' slices */
    uint64_t t[2];          /* per parity: the last stores out of the staging blocks */
    kvb__xlist xl;
} offload;

static offload *get(const kvb_engine *e) { return e->mech[KVB__MECH_OFFLOAD].ctx; }

static size_t layer_bytes(const kvb_engine *e) { return kvb_kv_layer_bytes(&e->geom); }

/* Layer l's slice of staging block k. */
static void *stage_slice(const kvb_engine *e, const offload *o, int k, int l) {
    return (char *)o->stage + ((size_t)(l & 1) * (size_t)o->n + (size_t)k) * layer_bytes(e);
}

static kvb_status off_check_op(void *ctx, const kvb_engine *e, kvb_acct *a, const kvb_plan_op *op, int k, char *err,
                               size_t len) {
    (void)ctx;
    if (op->kind != KVB_OP_ADMIT || !op->offload) return KVB_OK;
    const kvb_view *v = a->v;
    const kvb_req_view *r = &v->reqs[kvb_view_find(v, op->id)];
    if (!e->ht_pool || v->prefix_cache || op->placed || kvb__sliced(e))
        return kvb_plan_refuse_op(err, len, k, op, "an offloaded admission needs a host tier, the prefix cache off, "
                                                   "no placed blocks and a block-major pool");
    if (op->q_len < r->n_tokens)
        return kvb_plan_refuse_op(err, len, k, op, "an offloaded admission computes all %d tokens, q_len is %d",
                                                   r->n_tokens, op->q_len);
    int hb = KVB_DIV_CEIL(r->n_tokens, v->geom->block_size);
    if (hb > a->host_left)
        return kvb_plan_refuse_op(err, len, k, op, "offloading needs %d host-tier block(s), the host tier can give %d "
                                                   "at this point of the plan", hb, a->host_left);
    a->host_left -= hb;
    return KVB_OK;
}

kvb_status kvb__offload_admit(kvb_engine *e, kvb__seq *s) {
    int nb = KVB_DIV_CEIL(s->n_tokens, e->o.block_size);
    KVB_TRY(kvb__host_blocks_push(e, &s->host_bt, nb)); /* counted by the plan's check */
    s->hits_taken = 0;
    s->n_computed = 0;
    kvb__list_remove(&e->waiting, s);
    kvb__list_insert_ordered(&e->running, s);
    s->q_len = s->n_tokens;
    s->n_absent = 0;
    s->mx[KVB__MECH_OFFLOAD] = get(e);
    e->stats.offload_prefills++;
    return KVB_OK;
}

int kvb__offload_entry(kvb_engine *e, const kvb__seq *s, int j, kvb__entry *x) {
    offload *o = get(e);
    if (!s->mx[KVB__MECH_OFFLOAD]) return 0;
    /* its staging block, and the host-tier block its layers go to */
    *x = (kvb__entry){.kind = KVB__ENT_OFFLOAD, .block = -1, .slice = o->n++,
                      .base = kvb_block_pool_block(e->ht_pool, s->host_bt.ids[j])};
    return 1;
}

static kvb_status off_step_begin(void *ctx, kvb_engine *e, unsigned *flags) {
    offload *o = ctx;
    *flags = 0;
    if (o->n == 0) return KVB_OK;
    size_t bytes = 2 * (size_t)o->n * layer_bytes(e);
    if (e->act_alloc.iface) KVB_TRY(e->act_alloc.iface->alloc(e->act_alloc.ctx, bytes, &o->stage));
    else KVB_TRY(kvb__backend_reserve(e, bytes, &o->stage, &o->stage_bytes));
    o->t[0] = o->t[1] = 0;
    KVB_TRY(kvb__xlist_reserve(&o->xl, o->n * e->geom.n_layers));
    *flags = KVB__STEP_ACTIVE | KVB__STEP_SYNC | KVB__STEP_DRAIN;
    return KVB_OK;
}

/* Layer l writes into the staging parity whose rows of layer l-2 are out: its kernels come after that
 * store (on the device where the backend can). */
static kvb_status off_layer_in(void *ctx, kvb_engine *e, int l) {
    offload *o = ctx;
    if (o->t[l & 1]) KVB_TRY(kvb_stager_wait_device(e->stager, o->t[l & 1]));
    for (int j = 0; j < e->step.n_ent; j++)
        if (e->step.ent[j].kind == KVB__ENT_OFFLOAD) e->step.layer[j] = stage_slice(e, o, e->step.ent[j].slice, l);
    return KVB_OK;
}

/* After layer l: the rows it wrote into the staging blocks go to their host-tier blocks, one transfer. */
static kvb_status off_layer_out(void *ctx, kvb_engine *e, int l) {
    offload *o = ctx;
    size_t lb = layer_bytes(e);
    kvb_xfer *first = o->xl.x + o->xl.n;
    for (int j = 0; j < e->step.n_ent; j++) {
        const kvb__entry *x = &e->step.ent[j];
        if (x->kind == KVB__ENT_OFFLOAD)
            *kvb__xlist_add(&o->xl) = (kvb_xfer){(char *)x->base + (size_t)l * lb, stage_slice(e, o, x->slice, l), lb};
    }
    return kvb_stager_post(e->stager, KVB_LINK_HOST, KVB_XFER_D2H, first, o->n, &o->t[l & 1]);
}

/* After the step's copies were drained: the staging goes back to the activation allocator. */
static void off_step_end(void *ctx, kvb_engine *e, int ok) {
    offload *o = ctx;
    if (o->stage && e->act_alloc.iface) {
        e->act_alloc.iface->free(e->act_alloc.ctx, o->stage);
        o->stage = NULL;
    }
    o->n = 0;
    if (ok) return;
    for (int i = 0; i < e->step.n_sched; i++) e->step.sched[i]->mx[KVB__MECH_OFFLOAD] = NULL;
}

/* The offloaded requests leave the running list for the swapped one. */
static void off_step_done(void *ctx, kvb_engine *e) {
    (void)ctx;
    for (int i = 0; i < e->step.n_sched; i++) {
        kvb__seq *s = e->step.sched[i];
        if (!s->mx[KVB__MECH_OFFLOAD]) continue;
        s->mx[KVB__MECH_OFFLOAD] = NULL;
        kvb__list_remove(&e->running, s);
        kvb__list_insert_ordered(&e->swapped, s);
    }
}

static void off_destroy(void *ctx, kvb_engine *e) {
    offload *o = ctx;
    if (o->stage_bytes) kvb_mem_free(kvb_model_backend(e->m)->mem, o->stage);
    free(o->xl.x);
    free(o);
}

static const kvb__mech_i offload_iface = {
    .name = "offload",
    .check_op = off_check_op,
    .step_begin = off_step_begin,
    .layer_in = off_layer_in,
    .layer_out = off_layer_out,
    .step_end = off_step_end,
    .step_done = off_step_done,
    .destroy = off_destroy,
};

kvb_status kvb__offload_init(kvb_engine *e) {
    offload *o = NULL;
    KVB_TRY(kvb_calloc(1, sizeof *o, (void **)&o));
    e->mech[KVB__MECH_OFFLOAD] = (kvb__mech){.iface = &offload_iface, .ctx = o};
    return KVB_OK;
}
