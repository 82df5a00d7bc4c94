/* kvbank — the plan's residency exceptions and copy orders (kvb_plan_res, kvb_plan_copy) as an executor
 * mechanism.
 *
 * Host copies: a pool block may have a copy in the host tier (made by its first STORE copy order, dropped
 * with the block's last reference), valid per layer (a layer written in the pool other than through the
 * copy makes it stale). Copy orders move layer ranges between a block and its copy over the host link
 * while the step computes: LOADs are posted at the step's start and waited for before the layer they
 * precede, STOREs after their layer (or at once).
 *
 * Staging units: a block that some layer reads STREAM (borrowed memory over the peer link, SwiftCache's
 * layer stream cache, §3.2-3.3) or HOST (its host copy over the host link, OrbitFlow's offload) gets a
 * unit of two single-layer stage buffers (double buffering: layer l+1 loads while layer l computes);
 * the rows the step writes are stored back after each layer (and, for a host copy, into the pool block
 * too, which stays valid: block-major memory is not freed per layer). */
#include <string.h>

#include "common/sched/state.h"

/* A block whose layer slices pass through stage buffers in this step. */
typedef struct unit {
    int32_t block;          /* pool id */
    kvb_residency kind;     /* KVB_RES_STREAM or KVB_RES_HOST */
    int buf;                /* its stage buffers: 2 * buf + (layer & 1) */
    unsigned char *src;     /* where its slices live (all layers): borrowed block or host-tier block */
    int dirty_lo, dirty_hi; /* rows [lo, hi) of the block this step writes; lo >= hi: none */
} unit;

typedef struct residency {
    /* host copies of pool blocks */
    int32_t *copy;         /* [copy_cap] per block id: its host-tier copy, -1 */
    uint8_t *copy_ok;      /* [copy_cap][n_layers] 1 where the copy holds the layer */
    int copy_cap;
    /* the plan's exceptions by block id (during a step) */
    int32_t *first;        /* [first_cap] per block id: its first exception, -1 */
    int32_t *next;         /* [next_cap] the next exception of the same block, -1 */
    int first_cap, next_cap;
    int indexed;           /* exceptions of e->plan are linked */
    /* the step's staging units */
    unit *units;           /* [units_cap] */
    int n_units, units_cap;
    int32_t *unit_of;      /* [2][unit_of_cap] per block id: its STREAM / HOST unit in this step, -1 */
    int unit_of_cap;
    uint64_t load_t[2][KVB_LINK_COUNT]; /* per parity and link: the loads of the layer using it */
    uint64_t *copy_t;      /* [n_layers] ticket of the last LOAD copy order due before each layer */
    kvb__xlist xl;
} residency;

static residency *get(const kvb_engine *e) { return e->mech[KVB__MECH_RESIDENCY].ctx; }

static size_t layer_bytes(const kvb_engine *e) { return kvb_kv_layer_bytes(&e->geom); }

kvb_status kvb__stage_reserve(kvb_engine *e, int slots) {
    return kvb_stager_reserve(e->stager, 2 * slots, layer_bytes(e));
}

/* ---------------------------------------------------------------- host copies */

/* Makes the per-block copy tables cover every block id. */
static kvb_status copy_reserve(residency *r, const kvb_engine *e) {
    int ids = kvb_block_pool_id_limit(e->pool), L = e->geom.n_layers;
    if (ids <= r->copy_cap) return KVB_OK;
    KVB_TRY(kvb_realloc_array((void **)&r->copy, (size_t)ids, sizeof *r->copy));
    KVB_TRY(kvb_realloc_array((void **)&r->copy_ok, (size_t)ids * (size_t)L, 1));
    for (int i = r->copy_cap; i < ids; i++) r->copy[i] = -1;
    memset(r->copy_ok + (size_t)r->copy_cap * L, 0, (size_t)(ids - r->copy_cap) * L);
    r->copy_cap = ids;
    return KVB_OK;
}

/* The host copy of block `id`, made (empty) if it has none. */
static kvb_status copy_get(residency *r, kvb_engine *e, int32_t id, int32_t *out) {
    KVB_TRY(copy_reserve(r, e));
    if (r->copy[id] < 0) KVB_TRY(kvb__host_alloc(e, &r->copy[id]));
    *out = r->copy[id];
    return KVB_OK;
}

static int host_copy_exists(const kvb_engine *e, int32_t id) {
    const residency *r = get(e);
    return r && id >= 0 && id < r->copy_cap && r->copy[id] >= 0;
}

static int host_copy_has(const kvb_engine *e, int32_t id, int l) {
    return host_copy_exists(e, id) && get(e)->copy_ok[(size_t)id * e->geom.n_layers + l];
}

static void rs_block_free(void *ctx, kvb_engine *e, int32_t id) {
    residency *r = ctx;
    if (id < 0 || id >= r->copy_cap || r->copy[id] < 0) return;
    kvb_block_pool_unref(e->ht_pool, r->copy[id]);
    r->copy[id] = -1;
    memset(r->copy_ok + (size_t)id * e->geom.n_layers, 0, (size_t)e->geom.n_layers);
}

/* ---------------------------------------------------------------- the step's residency */

/* Where block `id` is read at `layer` in this step. */
static kvb_residency where(const residency *r, const kvb_engine *e, int32_t id, int layer) {
    if (id < r->first_cap)
        for (int k = r->first[id]; k >= 0; k = r->next[k]) {
            const kvb_plan_res *x = &e->plan.res[k];
            if (layer >= x->layer0 && layer < x->layer1) return x->where;
        }
    return kvb_block_pool_is_attached(e->pool, id) ? e->plan.lent_default : KVB_RES_LOCAL;
}

static int staged(kvb_residency w) { return w == KVB_RES_STREAM || w == KVB_RES_HOST; }

/* Links the plan's residency exceptions by block id. */
static kvb_status index_exceptions(residency *r, const kvb_engine *e) {
    const kvb_plan *p = &e->plan;
    int ids = kvb_block_pool_id_limit(e->pool);
    if (ids > r->first_cap) {
        KVB_TRY(kvb_realloc_array((void **)&r->first, (size_t)ids, sizeof *r->first));
        for (int i = r->first_cap; i < ids; i++) r->first[i] = -1;
        r->first_cap = ids;
    }
    if (p->n_res > r->next_cap) {
        KVB_TRY(kvb_realloc_array((void **)&r->next, (size_t)p->n_res, sizeof *r->next));
        r->next_cap = p->n_res;
    }
    for (int k = p->n_res - 1; k >= 0; k--) {
        r->next[k] = r->first[p->res[k].block];
        r->first[p->res[k].block] = k;
    }
    r->indexed = 1;
    return KVB_OK;
}

/* Gives every block of the step that some layer reads through stage buffers a unit per kind (a block
 * shared by several requests gets one), and records which rows the step writes into it. */
static kvb_status make_units(residency *r, kvb_engine *e) {
    const kvb__step *st = &e->step;
    int ids = kvb_block_pool_id_limit(e->pool), bs = e->o.block_size, L = e->geom.n_layers, n = 0;
    if (ids > r->unit_of_cap) {
        KVB_TRY(kvb_realloc_array((void **)&r->unit_of, 2 * (size_t)ids, sizeof *r->unit_of));
        for (int i = 0; i < 2 * ids; i++) r->unit_of[i] = -1;
        r->unit_of_cap = ids;
    }
    if (st->n_ent > r->units_cap) {
        KVB_TRY(kvb_realloc_array((void **)&r->units, (size_t)st->n_ent, sizeof *r->units));
        r->units_cap = st->n_ent;
    }
    int stream_default = e->plan.lent_default == KVB_RES_STREAM;
    for (int j = 0; j < st->n_ent && (stream_default || e->plan.n_res > 0); j++) {
        if (st->ent[j].kind != KVB__ENT_BLOCK) continue;
        int32_t id = st->ent[j].block;
        /* a block without exceptions reads the same way at every layer */
        int layers = r->first[id] >= 0 ? L : 1;
        for (int l = 0; l < layers; l++) {
            kvb_residency w = where(r, e, id, l);
            if (!staged(w)) continue;
            int32_t *u = &r->unit_of[(w == KVB_RES_HOST) * r->unit_of_cap + id];
            if (*u >= 0) continue;
            unsigned char *src = w == KVB_RES_HOST ? kvb_block_pool_block(e->ht_pool, r->copy[id])
                                                   : kvb_block_pool_block(e->pool, id);
            *u = n;
            r->units[n] = (unit){.block = id, .kind = w, .buf = n, .src = src, .dirty_lo = bs, .dirty_hi = 0};
            n++;
        }
    }
    for (int i = 0; i < st->n_attn && n > 0; i++) {
        const kvb_attn_seq *as = &st->seqs[i];
        int p0 = as->ctx_len - as->q_len, p1 = as->ctx_len; /* positions written this step */
        for (int bj = p0 / bs; bj <= (p1 - 1) / bs; bj++) {
            const kvb__entry *x = &st->ent[as->blk_first + bj];
            if (x->kind != KVB__ENT_BLOCK) continue;
            for (int k = 0; k < 2; k++) {
                int u = r->unit_of[k * r->unit_of_cap + x->block];
                if (u < 0) continue;
                r->units[u].dirty_lo = KVB_MIN(r->units[u].dirty_lo, KVB_MAX(p0 - bj * bs, 0));
                r->units[u].dirty_hi = KVB_MAX(r->units[u].dirty_hi, KVB_MIN(p1 - bj * bs, bs));
            }
        }
    }
    r->n_units = n;
    return KVB_OK;
}

static kvb_link_kind unit_link(const unit *u) { return u->kind == KVB_RES_HOST ? KVB_LINK_HOST : KVB_LINK_PEER; }

static void *stage_buf(const kvb_engine *e, const unit *u, int layer) {
    return kvb_stager_buffer(e->stager, 2 * u->buf + (layer & 1));
}

/* Posts layer `l`'s loads into the stage buffers, one transfer per link; tickets in t[link]. */
static kvb_status post_unit_loads(residency *r, kvb_engine *e, int l, uint64_t t[KVB_LINK_COUNT]) {
    size_t lb = layer_bytes(e);
    for (int k = KVB_LINK_HOST; k <= KVB_LINK_PEER; k++) {
        kvb_xfer *first = r->xl.x + r->xl.n;
        int n = 0;
        for (int u = 0; u < r->n_units; u++) {
            const unit *su = &r->units[u];
            if (unit_link(su) != (kvb_link_kind)k || where(r, e, su->block, l) != su->kind) continue;
            *kvb__xlist_add(&r->xl) = (kvb_xfer){stage_buf(e, su, l), su->src + (size_t)l * lb, lb};
            n++;
        }
        KVB_TRY(kvb_stager_post(e->stager, (kvb_link_kind)k, k == KVB_LINK_HOST ? KVB_XFER_H2D : KVB_XFER_D2D, first,
                                n, &t[k]));
        e->stats.lsc_loads += (uint64_t)n;
    }
    return KVB_OK;
}

/* Posts the stores of the rows layer `l` wrote into stage buffers back to where the blocks live (and,
 * for host copies, into the pool block too, which stays valid). The pool's rows are in place for every
 * operator and copy issued after this returns: they go over the local link, which nothing else orders
 * against the host link's next loads into the same buffers or a STORE copy order reading the pool block,
 * so the compute waits for them (on the device where it can), and every later copy_async comes after
 * the compute issued before it. */
static kvb_status post_unit_stores(residency *r, kvb_engine *e, int l) {
    size_t lb = layer_bytes(e), row = lb / 2 / (size_t)e->o.block_size, half = lb / 2;
    uint64_t t;
    for (int k = KVB_LINK_HOST; k <= KVB_LINK_LOCAL; k++) {
        kvb_xfer *first = r->xl.x + r->xl.n;
        int n = 0;
        for (int u = 0; u < r->n_units; u++) {
            const unit *su = &r->units[u];
            if (su->dirty_lo >= su->dirty_hi || where(r, e, su->block, l) != su->kind) continue;
            if (k == KVB_LINK_LOCAL && su->kind != KVB_RES_HOST) continue;
            if (k != KVB_LINK_LOCAL && unit_link(su) != (kvb_link_kind)k) continue;
            unsigned char *buf = stage_buf(e, su, l);
            unsigned char *dst = k == KVB_LINK_LOCAL ? kvb_block_pool_block(e->pool, su->block) : su->src;
            dst += (size_t)l * lb;
            size_t r0 = (size_t)su->dirty_lo * row, nb = (size_t)(su->dirty_hi - su->dirty_lo) * row;
            *kvb__xlist_add(&r->xl) = (kvb_xfer){dst + r0, buf + r0, nb};               /* K rows */
            *kvb__xlist_add(&r->xl) = (kvb_xfer){dst + half + r0, buf + half + r0, nb}; /* V rows */
            n += 2;
            if (k != KVB_LINK_LOCAL) e->stats.lsc_stores++;
        }
        KVB_TRY(kvb_stager_post(e->stager, (kvb_link_kind)k, k == KVB_LINK_HOST ? KVB_XFER_D2H : KVB_XFER_D2D, first,
                                n, &t));
        if (k == KVB_LINK_LOCAL && n > 0) KVB_TRY(kvb_stager_wait_device(e->stager, t));
    }
    return KVB_OK;
}

/* When the plan's copy orders go: LOADs at the step's start, STOREs at once or after a layer. */
enum { COPY_AT_START = -2, COPY_AT_ONCE = -1 };

/* Posts the copy orders that go at `when` (COPY_AT_START: the LOADs; else the STOREs after layer `when`,
 * COPY_AT_ONCE: before layer 0); LOAD tickets go to copy_t[layer they must precede]. */
static kvb_status post_copies(residency *r, kvb_engine *e, int when) {
    const kvb_plan *p = &e->plan;
    size_t lb = layer_bytes(e);
    for (int c = 0; c < p->n_copies; c++) {
        const kvb_plan_copy *cp = &p->copies[c];
        int load = cp->dir == KVB_COPY_LOAD;
        if ((load && when != COPY_AT_START) || (!load && cp->layer != when)) continue;
        int32_t h;
        KVB_TRY(copy_get(r, e, cp->block, &h));
        unsigned char *pool = (unsigned char *)kvb_block_pool_block(e->pool, cp->block) + (size_t)cp->layer0 * lb;
        unsigned char *host = (unsigned char *)kvb_block_pool_block(e->ht_pool, h) + (size_t)cp->layer0 * lb;
        size_t nb = (size_t)(cp->layer1 - cp->layer0) * lb;
        kvb_xfer *x = kvb__xlist_add(&r->xl);
        *x = load ? (kvb_xfer){pool, host, nb} : (kvb_xfer){host, pool, nb};
        uint64_t t;
        KVB_TRY(kvb_stager_post(e->stager, KVB_LINK_HOST, load ? KVB_XFER_H2D : KVB_XFER_D2H, x, 1, &t));
        if (load) r->copy_t[cp->layer] = t; /* the host link runs in order: the last ticket covers the rest */
        e->stats.copy_orders++;
    }
    return KVB_OK;
}

static kvb_status rs_step_begin(void *ctx, kvb_engine *e, unsigned *flags) {
    residency *r = ctx;
    const kvb_plan *p = &e->plan;
    int L = e->geom.n_layers;
    *flags = 0;
    /* host copies for the plan's STOREs exist before the units point at them */
    for (int c = 0; c < p->n_copies; c++) {
        int32_t h;
        if (p->copies[c].dir == KVB_COPY_STORE) KVB_TRY(copy_get(r, e, p->copies[c].block, &h));
    }
    KVB_TRY(index_exceptions(r, e));
    KVB_TRY(make_units(r, e));
    if (r->n_units == 0 && p->n_copies == 0) return KVB_OK;
    KVB_TRY(kvb__xlist_reserve(&r->xl, (r->n_units * 5 + 2) * L + p->n_copies));
    memset(r->load_t, 0, sizeof r->load_t);
    for (int l = 0; l < L; l++) r->copy_t[l] = 0;
    if (p->n_copies) {
        KVB_TRY(post_copies(r, e, COPY_AT_START));
        KVB_TRY(post_copies(r, e, COPY_AT_ONCE));
    }
    for (int l = 0; r->n_units && l < KVB_MIN(2, L); l++) KVB_TRY(post_unit_loads(r, e, l, r->load_t[l & 1]));
    *flags = KVB__STEP_ACTIVE | KVB__STEP_SYNC | KVB__STEP_DRAIN;
    return KVB_OK;
}

/* Before layer l: its kernels come after its LOAD copy orders and its stage buffers' loads (on the
 * device where the backend can), and the staged blocks read their stage buffers. */
static kvb_status rs_layer_in(void *ctx, kvb_engine *e, int l) {
    residency *r = ctx;
    kvb__step *st = &e->step;
    if (r->copy_t[l]) KVB_TRY(kvb_stager_wait_device(e->stager, r->copy_t[l]));
    if (!r->n_units) return KVB_OK;
    for (int k = 0; k < KVB_LINK_COUNT; k++)
        if (r->load_t[l & 1][k]) KVB_TRY(kvb_stager_wait_device(e->stager, r->load_t[l & 1][k]));
    for (int j = 0; j < st->n_ent; j++) {
        if (st->ent[j].kind != KVB__ENT_BLOCK) continue;
        int32_t id = st->ent[j].block;
        kvb_residency w = where(r, e, id, l);
        if (staged(w)) st->layer[j] = stage_buf(e, &r->units[r->unit_of[(w == KVB_RES_HOST) * r->unit_of_cap + id]], l);
    }
    return KVB_OK;
}

/* After layer l (the backend idle): its rows back from the stage buffers, the STOREs due after it, and
 * layer l+2's loads into the buffers it used. */
static kvb_status rs_layer_out(void *ctx, kvb_engine *e, int l) {
    residency *r = ctx;
    if (r->n_units) KVB_TRY(post_unit_stores(r, e, l));
    if (e->plan.n_copies) KVB_TRY(post_copies(r, e, l));
    if (r->n_units && l + 2 < e->geom.n_layers) KVB_TRY(post_unit_loads(r, e, l + 2, r->load_t[l & 1]));
    return KVB_OK;
}

/* After the step's copies were drained. A host copy is stale where the step wrote its pool block other
 * than through it; stored layers are current. */
static void rs_step_end(void *ctx, kvb_engine *e, int ok) {
    residency *r = ctx;
    const kvb__step *st = &e->step;
    int bs = e->o.block_size, L = e->geom.n_layers;
    for (int i = 0; ok && r->copy_cap && i < st->n_attn; i++) {
        const kvb_attn_seq *as = &st->seqs[i];
        int p0 = as->ctx_len - as->q_len, p1 = as->ctx_len;
        for (int bj = p0 / bs; bj <= (p1 - 1) / bs; bj++) {
            const kvb__entry *x = &st->ent[as->blk_first + bj];
            if (x->kind != KVB__ENT_BLOCK || !host_copy_exists(e, x->block)) continue;
            for (int l = 0; l < L; l++)
                if (where(r, e, x->block, l) != KVB_RES_HOST) r->copy_ok[(size_t)x->block * L + l] = 0;
        }
    }
    for (int c = 0; ok && r->copy_cap && c < e->plan.n_copies; c++) {
        const kvb_plan_copy *cp = &e->plan.copies[c];
        if (cp->dir == KVB_COPY_STORE) memset(r->copy_ok + (size_t)cp->block * L + cp->layer0, 1, cp->layer1 - cp->layer0);
    }
    for (int u = 0; u < r->n_units; u++)
        r->unit_of[(r->units[u].kind == KVB_RES_HOST) * r->unit_of_cap + r->units[u].block] = -1;
    r->n_units = 0;
    if (r->indexed)
        for (int k = 0; k < e->plan.n_res; k++) r->first[e->plan.res[k].block] = -1;
    r->indexed = 0;
}

/* What the plan's scheduled requests do with a block this step (step_marks). */
enum { MARK_READ = 1, MARK_WRITE = 2 };

/* Marks of the blocks the plan's scheduled requests read and write this step. */
static kvb_status step_marks(const kvb_engine *e, kvb_acct *a, const kvb_plan *p, uint8_t **out) {
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
                if (jl < a->dropped[i]) continue; /* released by a DROP of this plan */
                int w = (jl + 1) * bs > r->n_computed || (op->n_absent % bs && jl == op->n_absent / bs);
                m[r->blocks[j]] |= (uint8_t)(MARK_READ | (w ? MARK_WRITE : 0));
            }
        } else if (op->kind == KVB_OP_ADMIT) {
            kvb_view_hits pm;
            kvb_status st = kvb_acct_hits(a, i, &pm);
            if (st != KVB_OK) {
                free(m);
                return st;
            }
            for (int j = 0; j < pm.n_hit; j++) m[pm.ids[j]] |= MARK_READ;
        }
    }
    *out = m;
    return KVB_OK;
}

/* Whether the block's host copy holds layer l now, or a STORE of this plan at once (-1) makes it. */
static int copy_has_layer(const kvb_engine *e, const kvb_plan *p, int32_t id, int l) {
    if (host_copy_has(e, id, l)) return 1;
    for (int c = 0; c < p->n_copies; c++) {
        const kvb_plan_copy *cp = &p->copies[c];
        if (cp->dir == KVB_COPY_STORE && cp->block == id && cp->layer == -1 && l >= cp->layer0 && l < cp->layer1) return 1;
    }
    return 0;
}

/* An ABSENT block must not be read this step: every RUN request holding it recomputes it (n_absent
 * covers it) and no admission reuses it. */
static kvb_status absent_readers(kvb_acct *a, const kvb_plan *p, int32_t id, int r, char *err, size_t len) {
    const kvb_view *v = a->v;
    int bs = v->geom->block_size;
    for (int k = 0; k < p->n_ops; k++) {
        const kvb_plan_op *op = &p->ops[k];
        int i = kvb_view_find(v, op->id);
        const kvb_req_view *q = &v->reqs[i];
        if (op->kind == KVB_OP_RUN && q->state != KVB_REQ_SWAPPED) {
            for (int j = 0; j < q->n_blocks; j++)
                if (q->blocks[j] == id && (j + 1) * bs > op->n_absent)
                    return kvb_plan_refuse(err, len, "residency %d: block %d is ABSENT but request %llu reads it (n_absent %d)", r,
                                  (int)id, (unsigned long long)op->id, op->n_absent);
        } else if (op->kind == KVB_OP_ADMIT) {
            kvb_view_hits pm;
            KVB_TRY(kvb_acct_hits(a, i, &pm));
            for (int j = 0; j < pm.n_hit; j++)
                if (pm.ids[j] == id)
                    return kvb_plan_refuse(err, len, "residency %d: block %d is ABSENT but request %llu reuses it", r, (int)id,
                                  (unsigned long long)op->id);
        }
    }
    return KVB_OK;
}

/* Checks the plan's residency exceptions and copy orders (after its operations were accounted). */
static kvb_status rs_check_plan(void *ctx, const kvb_engine *e, kvb_acct *a, const kvb_plan *p, char *err, size_t len) {
    (void)ctx;
    const kvb_view *v = a->v;
    int L = v->geom->n_layers;
    if (p->lent_default != KVB_RES_LENT && p->lent_default != KVB_RES_STREAM)
        return kvb_plan_refuse(err, len, "lent_default %s: borrowed blocks are read LENT (in place) or STREAM",
                      kvb_residency_str(p->lent_default));
    if (p->n_res == 0 && p->n_copies == 0 && p->lent_default == KVB_RES_LENT) return KVB_OK;
    if (kvb__sliced(e))
        return kvb_plan_refuse(err, len, "a sliced pool takes request-level placements (kvb_plan_place), not residency "
                           "exceptions, copy orders or streamed borrowed blocks");
    uint8_t *mark = NULL;
    int32_t *first = NULL, *next = NULL;
    kvb_status st = KVB_OK;
    int ids = kvb_block_pool_id_limit(e->pool), staged = 0, new_copies = 0;
    KVB_TRY_GOTO(step_marks(e, a, p, &mark), out);
    KVB_TRY_GOTO(kvb_malloc((size_t)ids * sizeof *first, (void **)&first), out);
    KVB_TRY_GOTO(kvb_malloc((size_t)(p->n_res + 1) * sizeof *next, (void **)&next), out);
    for (int i = 0; i < ids; i++) first[i] = -1;
    for (int r = 0; r < p->n_res && st == KVB_OK; r++) {
        const kvb_plan_res *x = &p->res[r];
        int32_t id = x->block;
        if (!kvb_block_pool_has(e->pool, id)) {
            st = kvb_plan_refuse(err, len, "residency %d: block %d is not a block of the pool", r, (int)id);
            break;
        }
        if (x->layer0 < 0 || x->layer0 >= x->layer1 || x->layer1 > L) {
            st = kvb_plan_refuse(err, len, "residency %d (block %d): layers [%d, %d) are not a range of the model's %d", r, (int)id,
                        x->layer0, x->layer1, L);
            break;
        }
        int lent = kvb_block_pool_is_attached(e->pool, id);
        switch (x->where) {
        case KVB_RES_LOCAL:
            if (lent) st = kvb_plan_refuse(err, len, "residency %d: block %d is borrowed; LOCAL is for the process's own blocks", r,
                                  (int)id);
            break;
        case KVB_RES_LENT:
        case KVB_RES_STREAM:
            if (!lent) st = kvb_plan_refuse(err, len, "residency %d: block %d is not borrowed; %s is for borrowed blocks", r,
                                   (int)id, kvb_residency_str(x->where));
            break;
        case KVB_RES_HOST:
            for (int l = x->layer0; l < x->layer1 && st == KVB_OK; l++)
                if (!copy_has_layer(e, p, id, l))
                    st = kvb_plan_refuse(err, len, "residency %d: block %d has no host copy of layer %d (STORE it first)", r,
                                (int)id, l);
            break;
        case KVB_RES_ABSENT:
            if (mark[id]) st = absent_readers(a, p, id, r, err, len);
            break;
        default: st = kvb_plan_refuse(err, len, "residency %d (block %d): unknown residency %d", r, (int)id, (int)x->where);
        }
        if (st != KVB_OK) break;
        for (int o = first[id]; o >= 0; o = next[o])
            if (p->res[o].layer0 < x->layer1 && x->layer0 < p->res[o].layer1) {
                st = kvb_plan_refuse(err, len, "residency %d and %d both give block %d's layers %d..", o, r, (int)id,
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
            st = kvb_plan_refuse(err, len, "copy %d: unknown direction %d", c, (int)cp->dir);
        } else if (!e->ht_pool) {
            st = kvb_plan_refuse(err, len, "copy %d: the engine has no host tier (plan_pool sets host_tier_blocks)", c);
        } else if (!kvb_block_pool_has(e->pool, id)) {
            st = kvb_plan_refuse(err, len, "copy %d: block %d is not a block of the pool", c, (int)id);
        } else if (cp->layer0 < 0 || cp->layer0 >= cp->layer1 || cp->layer1 > L) {
            st = kvb_plan_refuse(err, len, "copy %d (block %d): layers [%d, %d) are not a range of the model's %d", c, (int)id,
                        cp->layer0, cp->layer1, L);
        } else if (load ? (cp->layer < 0 || cp->layer >= L) : (cp->layer < -1 || cp->layer >= L)) {
            st = kvb_plan_refuse(err, len, "copy %d (block %d): a %s at layer %d", c, (int)id, load ? "LOAD due before" :
                        "STORE after", cp->layer);
        } else if (load) {
            for (int l = cp->layer0; l < cp->layer1 && st == KVB_OK; l++)
                if (!host_copy_has(e, id, l))
                    st = kvb_plan_refuse(err, len, "copy %d: LOAD of block %d layer %d from the host tier, which does not hold it",
                                c, (int)id, l);
            if (st == KVB_OK && mark[id] && cp->layer > cp->layer0)
                st = kvb_plan_refuse(err, len, "copy %d: LOAD of block %d layers [%d, %d) is due before layer %d, but the step "
                            "reads it at layer %d", c, (int)id, cp->layer0, cp->layer1, cp->layer, cp->layer0);
        } else {
            if ((mark[id] & MARK_WRITE) && cp->layer < cp->layer1 - 1)
                st = kvb_plan_refuse(err, len, "copy %d: STORE of block %d layers [%d, %d) after layer %d, but the step writes the "
                            "block until layer %d", c, (int)id, cp->layer0, cp->layer1, cp->layer, cp->layer1 - 1);
            int fresh = !host_copy_exists(e, id);
            for (int o = 0; o < c && fresh; o++) fresh = !(p->copies[o].dir == KVB_COPY_STORE && p->copies[o].block == id);
            new_copies += fresh;
        }
    }
    if (st != KVB_OK) goto out;
    if (new_copies > a->host_left) {
        st = kvb_plan_refuse(err, len, "the plan's STOREs need %d new host copies, the host tier can give %d", new_copies,
                    a->host_left);
        goto out;
    }
    a->host_left -= new_copies;
    int64_t bound = staged + (p->lent_default == KVB_RES_STREAM ? KVB_MIN((int64_t)v->pool.n_borrowed, a->touched) : 0);
    if (bound > v->pool.stage_slots)
        st = kvb_plan_refuse(err, len, "the plan may read %lld blocks through stage buffers, there are slots for %d (plan_pool's "
                    "stage_slots)", (long long)bound, v->pool.stage_slots);
out:
    free(mark);
    free(first);
    free(next);
    return st;
}


static void rs_destroy(void *ctx, kvb_engine *e) {
    (void)e;
    residency *r = ctx;
    free(r->copy);
    free(r->copy_ok);
    free(r->first);
    free(r->next);
    free(r->units);
    free(r->unit_of);
    free(r->copy_t);
    free(r->xl.x);
    free(r);
}

static const kvb__mech_i residency_iface = {
    .name = "residency",
    .check_plan = rs_check_plan,
    .step_begin = rs_step_begin,
    .layer_in = rs_layer_in,
    .layer_out = rs_layer_out,
    .step_end = rs_step_end,
    .block_free = rs_block_free,
    .destroy = rs_destroy,
};

kvb_status kvb__residency_init(kvb_engine *e) {
    residency *r = NULL;
    KVB_TRY(kvb_calloc(1, sizeof *r, (void **)&r));
    e->mech[KVB__MECH_RESIDENCY] = (kvb__mech){.iface = &residency_iface, .ctx = r};
    return kvb_calloc((size_t)e->geom.n_layers, sizeof *r->copy_t, (void **)&r->copy_t);
}
