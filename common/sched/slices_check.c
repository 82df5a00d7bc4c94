/* kvbank — the sliced pool's side of the plan check: the plan's placements (kvb_plan_place) and the
 * device slices the plan needs (the layers its running requests keep, and their prefetch slots). */
#include <string.h>

#include "common/sched/sliced.h"

/* ---------------------------------------------------------------- placements of the plan */

static kvb_status vreserve(kvb__slices *sl, int n) {
    if (n <= sl->vcap) return KVB_OK;
    int cap = KVB_MAX(n, 2 * sl->vcap);
    KVB_TRY(kvb_realloc_array((void **)&sl->vmask, (size_t)cap, sizeof *sl->vmask));
    KVB_TRY(kvb_realloc_array((void **)&sl->vdepth, (size_t)cap, sizeof *sl->vdepth));
    sl->vcap = cap;
    return KVB_OK;
}

/* Reads p->places into vmask / vdepth by view index, checking them. */
kvb_status kvb__slices_read_places(kvb__slices *sl, const kvb_view *v, const kvb_plan *p, char *err, size_t len) {
    KVB_TRY(vreserve(sl, v->n_reqs));
    memset(sl->vmask, 0, (size_t)v->n_reqs * sizeof *sl->vmask);
    for (int i = 0; i < v->n_reqs; i++) sl->vdepth[i] = 0;
    for (int k = 0; k < p->n_places; k++) {
        const kvb_plan_place *pl = &p->places[k];
        unsigned long long id = (unsigned long long)pl->id;
        int i = kvb_view_find(v, pl->id);
        if (i < 0) return kvb_plan_refuse(err, len, "placement %d: no live request has id %llu", k, id);
        if (pl->where != KVB_RES_HOST)
            return kvb_plan_refuse(err, len, "placement %d (request %llu): %s, only HOST is a request-level placement",
                                             k, id,
                          kvb_residency_str(pl->where));
        if (pl->layer0 < 0 || pl->layer1 > sl->L || pl->layer0 >= pl->layer1)
            return kvb_plan_refuse(err, len, "placement %d (request %llu): layers [%d, %d) outside [0, %d)",
                                             k, id, pl->layer0,
                          pl->layer1, sl->L);
        if (pl->depth < 1 || pl->depth > 2 || (sl->vdepth[i] && sl->vdepth[i] != pl->depth))
            return kvb_plan_refuse(err, len, "placement %d (request %llu): depth %d (1 or 2, the same in all its "
                                             "entries)", k, id,
                          pl->depth);
        sl->vdepth[i] = pl->depth;
        for (int l = pl->layer0; l < pl->layer1; l++) {
            if (mask_has(&sl->vmask[i], l))
                return kvb_plan_refuse(err, len, "placement %d (request %llu): layer %d is placed twice", k, id, l);
            sl->vmask[i].w[l >> 6] |= (uint64_t)1 << (l & 63);
        }
    }
    return KVB_OK;
}

/* ---------------------------------------------------------------- want */

static void touch(kvb__slices *sl, int32_t id) {
    if (sl->touched[id]) return;
    sl->touched[id] = 1;
    sl->tlist[sl->n_touched++] = id;
}

void kvb__slices_want_clear(kvb__slices *sl) {
    for (int t = 0; t < sl->n_touched; t++) {
        int32_t id = sl->tlist[t];
        sl->touched[id] = 0;
        memset(sl->want + (size_t)id * sl->L, 0, (size_t)sl->L);
    }
    sl->n_touched = 0;
}

/* Marks the layers a holder of ids[0..n) with host layers `m` keeps. */
void kvb__slices_want_mark(kvb__slices *sl, const int32_t *ids, int n, const sl_mask *m) {
    for (int j = 0; j < n; j++) {
        touch(sl, ids[j]);
        uint8_t *w = sl->want + (size_t)ids[j] * sl->L;
        for (int l = 0; l < sl->L; l++)
            if (!mask_has(m, l)) w[l] = 1;
    }
}

static int popcount_not(const sl_mask *m, int L) {
    int n = 0;
    for (int l = 0; l < L; l++) n += !mask_has(m, l);
    return n;
}

/* Prefetch slices request `m`, `depth` needs for blocks ids[0..n) (already marked) plus n_new new blocks
 * (exclusive: not kept at its host layers). `resident(l, id)` is whether the block is on the device at
 * the layer when the step runs. */
int64_t kvb__slices_scratch_need(const kvb__slices *sl, const kvb_block_pool *pool, const int32_t *ids, int n,
                                 int64_t n_new,
                            const sl_mask *m, int depth, int installed) {
    if (!mask_any(m)) return 0;
    int64_t per = 0;
    for (int l = 0; l < sl->L; l++) {
        if (!mask_has(m, l)) continue;
        int64_t c = n_new;
        for (int j = 0; j < n; j++) {
            int on = installed ? kvb_block_pool_slice_resident(pool, ids[j], l) : sl->want[(size_t)ids[j] * sl->L + l];
            c += !on;
        }
        if (c > per) per = c;
    }
    return per * depth;
}

kvb_status kvb__slices_check_op(void *ctx, const kvb_engine *e, kvb_acct *a, const kvb_plan_op *op, int k, char *err,
                              size_t len) {
    (void)ctx;
    (void)e;
    (void)a;
    if (op->kind == KVB_OP_RUN && op->n_absent > 0)
        return kvb_plan_refuse_op(err, len, k, op, "n_absent needs a block-major pool, not a sliced one");
    return KVB_OK;
}

/* Reads the plan's placements (refusing bad ones) and checks the device slices the plan needs, after the
 * accounting of its operations (a: each request's state, whether it is scheduled, its new blocks). The
 * check's scratch (placements, wanted layers) is the manager's: one check at a time. */
static kvb_status check_slices(kvb__slices *sl, const kvb_engine *e, kvb_acct *a, const kvb_plan *p, char *err,
                               size_t len) {
    const kvb_view *v = a->v;
    const kvb_req_state *astate = a->state;
    const uint8_t *asched = a->sched;
    const int64_t *anew = a->n_new;
    KVB_TRY(kvb__slices_read_places(sl, v, p, err, len));
    /* the blocks each running request holds after the plan: its own now, an admission's prefix hits */
    int64_t need = 0;
    kvb__slices_want_clear(sl);
    for (int pass = 0; pass < 2; pass++) {
        for (int i = 0; i < v->n_reqs; i++) {
            if (astate[i] != KVB_REQ_RUNNING) continue;
            const int32_t *ids = v->reqs[i].blocks;
            int n = v->reqs[i].n_blocks;
            if (v->reqs[i].state == KVB_REQ_WAITING) { /* admitted by this plan: its hits */
                kvb_view_hits mm;
                KVB_TRY(kvb_acct_hits(a, i, &mm));
                ids = mm.ids;
                n = mm.n_hit;
            }
            if (pass == 0) {
                kvb__slices_want_mark(sl, ids, n, &sl->vmask[i]);
                need += anew[i] * popcount_not(&sl->vmask[i], sl->L);
            } else if (asched[i]) {
                need += kvb__slices_scratch_need(sl, e->pool, ids, n, anew[i], &sl->vmask[i], sl->vdepth[i], 0);
            }
        }
    }
    for (int t = 0; t < sl->n_touched; t++) {
        const uint8_t *w = sl->want + (size_t)sl->tlist[t] * sl->L;
        for (int l = 0; l < sl->L; l++) need += w[l];
    }
    kvb__slices_want_clear(sl);
    int have = kvb_block_pool_n_slices(e->pool);
    if (need > have)
        return kvb_plan_refuse(err, len,
                      "the plan needs %lld (block, layer) slices on the device (kept layers and prefetch slots), the "
                      "pool has %d", (long long)need, have);
    return KVB_OK;
}

kvb_status kvb__slices_check_plan(void *ctx, const kvb_engine *e, kvb_acct *a, const kvb_plan *p, char *err,
                                  size_t len) {
    kvb__slices *sl = ctx;
    pthread_mutex_lock(&sl->mu);
    kvb_status st = check_slices(sl, e, a, p, err, len);
    pthread_mutex_unlock(&sl->mu);
    return st;
}
