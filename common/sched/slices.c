/* kvbank — the layer-sliced KV manager: request-level placements (kvb_plan_place) carried out on a
 * sliced pool (common/kv/block_pool.h). OrbitFlow's "KV manager" (../shared/papers/orbitflow.txt §3.2,
 * §4) as a mechanism any planner can use.
 *
 * Every block id has a home in the host tier: host[id] holds its layers ([n_layers][layer_bytes], the
 * block-major layout). Per block the manager knows `fill` (rows holding KV) and per (block, layer)
 * `host_rows` (rows of the host copy that are valid: a prefix, since rows are only appended). A layer
 * on the device has a slice of the pool with rows [0, fill); a layer not on the device has
 * host_rows == fill.
 *
 * Before the forward pass (its step_begin, mech.h):
 *  1. want: (block, layer) stays or comes on the device iff a running, not paused request holding the
 *     block keeps the layer (shared prefix blocks: any owner; counted once);
 *  2. every slice that is not wanted any more is stored (rows [host_rows, fill) only) and freed, before
 *  3. every wanted layer that is not on the device gets a slice and is loaded (rows [0, fill));
 *  4. each scheduled request with host layers gets depth x (its largest host layer's non-resident
 *     blocks) prefetch slices.
 * When a slice is needed and none is free, room is made lazily: cached prefix blocks nobody references
 * are dropped (LRU), then the layers of paused requests leave, one layer of one request at a time,
 * deepest first, stored before their slice is reused (Pause-Resume, §3.4: never dropped).
 * During the step (its layer_in / layer_out) a host layer's blocks are read from the request's
 * prefetch slot and the rows the step wrote there are stored to the host tier after the layer.
 *
 * All copies go through the backend (to_device / to_host). */
#include <assert.h>
#include <stdio.h>
#include <string.h>

#include "common/sched/sliced.h"

/* ---------------------------------------------------------------- setup */

static const kvb__mech_i slices_iface;

kvb_status kvb__slices_init(kvb_engine *e, int n_ids, int min_layers) {
    kvb__slices *sl = NULL;
    KVB_TRY(kvb_calloc(1, sizeof *sl, (void **)&sl));
    pthread_mutex_init(&sl->mu, NULL);
    e->mech[KVB__MECH_SLICES] = (kvb__mech){.iface = &slices_iface, .ctx = sl};
    sl->L = e->geom.n_layers;
    sl->bs = e->geom.block_size;
    sl->n_ids = n_ids;
    sl->min_layers = min_layers > 0 ? KVB_MIN(min_layers, sl->L + 2) : sl->L;
    sl->layer_bytes = kvb_kv_layer_bytes(&e->geom);
    sl->block_bytes = kvb_kv_block_bytes(&e->geom);
    sl->row_bytes = (size_t)e->geom.n_kv_heads * (size_t)e->geom.head_dim * (size_t)e->geom.elem_size;
    sl->half_bytes = (size_t)sl->bs * sl->row_bytes;
    if (sl->L > KVB_MAX_LAYERS) {
        KVB_LOG_E("engine: a sliced pool supports at most %d layers (the model has %d)", KVB_MAX_LAYERS, sl->L);
        return KVB_ERR_UNSUPPORTED;
    }
    size_t host_bytes;
    if (__builtin_mul_overflow(sl->block_bytes, (size_t)n_ids, &host_bytes)) return KVB_ERR_INVALID;
    /* the host tier: pinned host memory of the backend's kvb_mem (asynchronous copies on a device) */
    KVB_TRY(kvb_mem_pinned_alloc(kvb_model_backend(e->m)->mem, host_bytes, (void **)&sl->host));
    size_t cells = (size_t)n_ids * (size_t)sl->L;
    KVB_TRY(kvb_calloc((size_t)n_ids, sizeof *sl->fill, (void **)&sl->fill));
    KVB_TRY(kvb_calloc(cells, sizeof *sl->host_rows, (void **)&sl->host_rows));
    KVB_TRY(kvb_calloc(cells, sizeof *sl->want, (void **)&sl->want));
    KVB_TRY(kvb_calloc((size_t)n_ids, sizeof *sl->touched, (void **)&sl->touched));
    KVB_TRY(kvb_calloc((size_t)n_ids, sizeof *sl->tlist, (void **)&sl->tlist));
    KVB_TRY(kvb_calloc((size_t)e->o.max_seqs, sizeof *sl->s_first, (void **)&sl->s_first));
    KVB_TRY(kvb_calloc((size_t)e->o.max_seqs, sizeof *sl->s_per, (void **)&sl->s_per));
    KVB_TRY(kvb_calloc((size_t)e->o.max_seqs * (size_t)sl->L, sizeof *sl->s_ticket, (void **)&sl->s_ticket));
    KVB_TRY(kvb_calloc((size_t)sl->L, sizeof *sl->onload_t, (void **)&sl->onload_t));
    return KVB_OK;
}

static void sl_destroy(void *ctx, kvb_engine *e) {
    kvb__slices *sl = ctx;
    kvb_mem_pinned_free(kvb_model_backend(e->m)->mem, sl->host);
    free(sl->fill);
    free(sl->host_rows);
    free(sl->want);
    free(sl->touched);
    free(sl->tlist);
    free(sl->vmask);
    free(sl->vdepth);
    free(sl->scratch);
    free(sl->s_first);
    free(sl->s_per);
    free(sl->entry_scratch);
    free(sl->s_ticket);
    free(sl->onload_t);
    free(sl->ev.x);
    free(sl->on.x);
    free(sl->step.x);
    free(sl->mv_id);
    free(sl->mv_layer);
    pthread_mutex_destroy(&sl->mu);
    free(sl);
}

int kvb__slices_min_layers(const kvb_engine *e) {
    return kvb__sliced(e) ? kvb__sliced(e)->min_layers : e->geom.n_layers;
}

void kvb_engine_slices_stats(const kvb_engine *e, kvb_slices_stats *out) {
    if (kvb__sliced(e)) *out = kvb__sliced(e)->st;
    else memset(out, 0, sizeof *out);
}

/* ---------------------------------------------------------------- moving layers */

static kvb_status ids_reserve(kvb__slices *sl, int n) {
    if (n <= sl->mv_cap) return KVB_OK;
    int cap = KVB_MAX(n, 2 * sl->mv_cap);
    KVB_TRY(kvb_realloc_array((void **)&sl->mv_id, (size_t)cap, sizeof *sl->mv_id));
    KVB_TRY(kvb_realloc_array((void **)&sl->mv_layer, (size_t)cap, sizeof *sl->mv_layer));
    sl->mv_cap = cap;
    return KVB_OK;
}

/* Lists of transfer pieces. The stager borrows a list's pieces until their transfer has been waited
 * for, so a list is sized before anything is posted from it and only reset after the waits. */
static kvb_status px_reserve(px_list *l, int n) {
    if (l->n + n <= l->cap) return KVB_OK;
    assert(l->n == 0 || l->posted == 0); /* never moved while the stager holds pieces of it */
    int cap = KVB_MAX(l->n + n, 2 * l->cap);
    KVB_TRY(kvb_realloc_array((void **)&l->x, (size_t)cap, sizeof *l->x));
    l->cap = cap;
    return KVB_OK;
}

/* Appends the pieces that copy rows [r0, r1) of K and of V between a slice and the host home of (id, l). */
static void add_rows(kvb__slices *sl, px_list *pl, int to_host, void *slice, int32_t id, int l, int r0, int r1) {
    if (r1 <= r0) return;
    unsigned char *h = sl->host + (size_t)id * sl->block_bytes + (size_t)l * sl->layer_bytes;
    unsigned char *d = slice;
    size_t off = (size_t)r0 * sl->row_bytes, nb = (size_t)(r1 - r0) * sl->row_bytes;
    for (int half = 0; half < 2; half++) {
        size_t o = off + (half ? sl->half_bytes : 0);
        assert(pl->n < pl->cap);
        pl->x[pl->n++] = to_host ? (kvb_xfer){h + o, d + o, nb} : (kvb_xfer){d + o, h + o, nb};
    }
    if (to_host) sl->st.bytes_stored += 2 * (uint64_t)nb;
    else sl->st.bytes_loaded += 2 * (uint64_t)nb;
}

/* Posts pieces [from, pl->n) of `pl` as one transfer on the host link (0: nothing to post). */
static kvb_status post(kvb_engine *e, px_list *pl, int from, int to_host, uint64_t *ticket) {
    *ticket = 0;
    if (pl->n == from) return KVB_OK;
    pl->posted = 1;
    return kvb_stager_post(e->stager, KVB_LINK_HOST, to_host ? KVB_XFER_D2H : KVB_XFER_H2D, pl->x + from,
                           pl->n - from, ticket);
}

/* Moves layers off the device: stores what each host copy lacks (one transfer), waits for it, then
 * frees the slices. ids[k], layers[k] for k < n. */
static kvb_status evict_layers(kvb_engine *e, const int32_t *ids, const int *layers, int n) {
    kvb__slices *sl = kvb__sliced(e);
    px_list *pl = &sl->ev;
    pl->n = pl->posted = 0;
    KVB_TRY(px_reserve(pl, 2 * n));
    for (int k = 0; k < n; k++) {
        uint16_t *hr = &sl->host_rows[(size_t)ids[k] * sl->L + layers[k]];
        add_rows(sl, pl, 1, kvb_block_pool_block_layer(e->pool, ids[k], layers[k]), ids[k], layers[k], *hr,
                 sl->fill[ids[k]]);
    }
    uint64_t t;
    KVB_TRY(post(e, pl, 0, 1, &t));
    if (t) KVB_TRY(kvb_stager_wait(e->stager, t)); /* the slices are read before anyone reuses them */
    pl->n = pl->posted = 0;
    for (int k = 0; k < n; k++) {
        sl->host_rows[(size_t)ids[k] * sl->L + layers[k]] = sl->fill[ids[k]];
        kvb_block_pool_slice_free(e->pool, ids[k], layers[k]);
    }
    sl->st.slices_offloaded += (uint64_t)n;
    return KVB_OK;
}

/* Frees lazily held slices: an unreferenced cached block is dropped, else a layer of a paused request
 * leaves (deepest layer first, all its blocks there at once). KVB_ERR_EXHAUSTED if nothing is left. */
static kvb_status make_room_once(kvb_engine *e) {
    kvb__slices *sl = kvb__sliced(e);
    int before = kvb_block_pool_n_free_slices(e->pool);
    while (kvb_prefix_cache_evict(e->pc) == KVB_OK) {
        sl->st.cached_dropped++;
        if (kvb_block_pool_n_free_slices(e->pool) > before) return KVB_OK;
    }
    for (kvb__seq *s = e->running.head; s; s = s->next) {
        if (!s->paused) continue;
        for (int l = sl->L - 1; l >= 0; l--) {
            int n = 0;
            for (int j = 0; j < s->bt.n; j++) {
                int32_t id = s->bt.ids[j];
                if (!kvb_block_pool_slice_resident(e->pool, id, l) || sl->want[(size_t)id * sl->L + l]) continue;
                KVB_TRY(ids_reserve(sl, n + 1));
                sl->mv_id[n] = id;
                sl->mv_layer[n++] = l;
            }
            if (n) {
                KVB_TRY(evict_layers(e, sl->mv_id, sl->mv_layer, n));
                sl->st.paused_layers_moved++;
                return KVB_OK;
            }
        }
    }
    return KVB_ERR_EXHAUSTED;
}

static kvb_status make_room(kvb_engine *e, int n) {
    while (kvb_block_pool_n_free_slices(e->pool) < n) {
        kvb_status st = make_room_once(e);
        if (st != KVB_OK) {
            KVB_LOG_E("engine: no (block, layer) slice left for the plan (%d free, %d needed)",
                      kvb_block_pool_n_free_slices(e->pool), n);
            return st;
        }
    }
    return KVB_OK;
}

kvb_status kvb__slices_new_block(kvb_engine *e, int32_t *out) {
    kvb__slices *sl = kvb__sliced(e);
    kvb_status st = kvb_block_pool_alloc_bare(e->pool, out);
    while (st == KVB_ERR_EXHAUSTED && kvb_prefix_cache_evict(e->pc) == KVB_OK) {
        sl->st.cached_dropped++;
        st = kvb_block_pool_alloc_bare(e->pool, out);
    }
    if (st != KVB_OK) return st;
    sl->fill[*out] = 0;
    memset(sl->host_rows + (size_t)*out * sl->L, 0, (size_t)sl->L * sizeof *sl->host_rows);
    return KVB_OK;
}

static kvb_status entries_reserve(kvb__slices *sl, int n) {
    if (n <= sl->entry_cap) return KVB_OK;
    KVB_TRY(kvb_realloc_array((void **)&sl->entry_scratch, (size_t)n, sizeof *sl->entry_scratch));
    sl->entry_cap = n;
    return KVB_OK;
}

/* Blocks sequence sched[i] reads in this step. */
static int step_blocks(const kvb__slices *sl, const kvb__seq *s) { return KVB_DIV_CEIL(s->n_computed + s->q_len, sl->bs); }

static int depth_of(const kvb__slices *sl, const kvb__seq *s) { return sl->vdepth[s->vidx] ? sl->vdepth[s->vidx] : 1; }

static kvb_status install(kvb__slices *sl, kvb_engine *e) {
    char err[256];
    int n_sched = e->step.n_sched;
    KVB_TRY(kvb__slices_read_places(sl, &e->view, &e->plan, err, sizeof err)); /* the plan was checked: this reads them */
    kvb__slices_want_clear(sl);
    for (kvb__seq *s = e->running.head; s; s = s->next)
        if (!s->paused) kvb__slices_want_mark(sl, s->bt.ids, s->bt.n, &sl->vmask[s->vidx]);
    /* layers leaving first, all in one transfer (their slices become free once it has landed) */
    int n = 0, n_on = 0;
    for (int t = 0; t < sl->n_touched; t++) {
        int32_t id = sl->tlist[t];
        for (int l = 0; l < sl->L; l++) {
            int want = sl->want[(size_t)id * sl->L + l], res = kvb_block_pool_slice_resident(e->pool, id, l);
            if (!want && res) {
                KVB_TRY(ids_reserve(sl, n + 1));
                sl->mv_id[n] = id;
                sl->mv_layer[n++] = l;
            }
            n_on += want && !res;
        }
    }
    if (n) KVB_TRY(evict_layers(e, sl->mv_id, sl->mv_layer, n));
    /* the step's prefetch slots: depth x the largest host layer's non-resident blocks, per sequence
     * (counted as the install leaves residency) */
    int n_scratch = 0;
    for (int i = 0; i < n_sched; i++) {
        kvb__seq *s = e->step.sched[i];
        int64_t need = kvb__slices_scratch_need(sl, e->pool, s->bt.ids, step_blocks(sl, s), 0, &sl->vmask[s->vidx], depth_of(sl, s),
                                    0 /* as wanted */);
        sl->s_first[i] = n_scratch;
        sl->s_per[i] = (int)(need / depth_of(sl, s));
        n_scratch += (int)need;
    }
    /* room for the arriving layers and the slots, then the arriving layers, one transfer per layer;
     * a layer counts as on the device once its transfer has landed (layer_in waits) */
    KVB_TRY(make_room(e, n_on + n_scratch));
    px_list *pl = &sl->on;
    pl->n = pl->posted = 0;
    KVB_TRY(px_reserve(pl, 2 * n_on));
    for (int l = 0; l < sl->L; l++) {
        int from = pl->n;
        for (int t = 0; t < sl->n_touched; t++) {
            int32_t id = sl->tlist[t];
            if (!sl->want[(size_t)id * sl->L + l] || kvb_block_pool_slice_resident(e->pool, id, l)) continue;
            KVB_TRY(kvb_block_pool_slice_alloc(e->pool, id, l)); /* make_room left enough */
            add_rows(sl, pl, 0, kvb_block_pool_block_layer(e->pool, id, l), id, l, 0, sl->fill[id]);
            sl->st.slices_onloaded++;
        }
        KVB_TRY(post(e, pl, from, 0, &sl->onload_t[l]));
    }
    sl->n_scratch = 0;
    if (n_scratch > sl->cap_scratch) {
        KVB_TRY(kvb_realloc_array((void **)&sl->scratch, (size_t)n_scratch, sizeof *sl->scratch));
        sl->cap_scratch = n_scratch;
    }
    for (int k = 0; k < n_scratch; k++) {
        kvb_status st = kvb_block_pool_scratch_alloc(e->pool, &sl->scratch[sl->n_scratch]);
        assert(st == KVB_OK);
        (void)st;
        sl->n_scratch++;
    }
    int used = kvb_block_pool_n_slices(e->pool) - kvb_block_pool_n_free_slices(e->pool);
    if (used > sl->st.peak_used) sl->st.peak_used = used;
    return KVB_OK;
}

/* ---------------------------------------------------------------- the step */

/* Loads sched[i]'s host layer l into its slot (slot = rank of l among its host layers, modulo depth):
 * one transfer of every block of the sequence that is not on the device at l. */
static kvb_status launch(kvb_engine *e, int i, int l) {
    kvb__slices *sl = kvb__sliced(e);
    kvb__seq *s = e->step.sched[i];
    const sl_mask *m = &sl->vmask[s->vidx];
    int rank = 0;
    for (int k = 0; k < l; k++) rank += mask_has(m, k);
    int pos = sl->s_first[i] + (rank % depth_of(sl, s)) * sl->s_per[i];
    int from = sl->step.n, nb = step_blocks(sl, s);
    for (int j = 0; j < nb; j++) {
        int32_t id = s->bt.ids[j];
        if (kvb_block_pool_slice_resident(e->pool, id, l)) continue;
        add_rows(sl, &sl->step, 0, kvb_block_pool_slice_addr(e->pool, sl->scratch[pos++]), id, l, 0, sl->fill[id]);
        sl->st.slices_prefetched++;
    }
    uint64_t t;
    KVB_TRY(post(e, &sl->step, from, 0, &t));
    /* nothing to load (only fresh blocks): the layer still waits for the stores that read the slot
     * before (an empty post's ticket is done once everything posted before it is) */
    if (!t) KVB_TRY(kvb_stager_post(e->stager, KVB_LINK_HOST, KVB_XFER_H2D, NULL, 0, &t));
    sl->s_ticket[(size_t)i * sl->L + l] = LAUNCHED | t;
    return KVB_OK;
}

/* The next host layer of sched[i] from layer `l0` on that is not launched yet (-1 if none). */
static int next_host(const kvb__slices *sl, int i, const kvb__seq *s, int l0) {
    const sl_mask *m = &sl->vmask[s->vidx];
    for (int l = l0; l < sl->L; l++)
        if (mask_has(m, l) && !sl->s_ticket[(size_t)i * sl->L + l]) return l;
    return -1;
}

/* Before the forward pass: the transfer pieces of the step (prefetches and the stores of the rows the
 * step writes into host layers), then each sequence loads its first `depth` host layers at once (the
 * greedy rule of §3.3.1 that the latency model simulates). */
static kvb_status prefetch_begin(kvb__slices *sl, kvb_engine *e) {
    KVB_TRY(entries_reserve(sl, e->step.n_ent));
    int n_sched = e->step.n_sched, pieces = 0;
    for (int i = 0; i < n_sched; i++) {
        kvb__seq *s = e->step.sched[i];
        const sl_mask *m = &sl->vmask[s->vidx];
        int host = 0, nb = step_blocks(sl, s);
        for (int l = 0; l < sl->L; l++) host += mask_has(m, l);
        int written = KVB_DIV_CEIL(s->q_len, sl->bs) + 1;
        pieces += 2 * host * (nb + KVB_MIN(written, nb));
        memset(sl->s_ticket + (size_t)i * sl->L, 0, (size_t)sl->L * sizeof *sl->s_ticket);
    }
    sl->step.n = sl->step.posted = 0;
    KVB_TRY(px_reserve(&sl->step, pieces));
    for (int i = 0; i < n_sched; i++) {
        kvb__seq *s = e->step.sched[i];
        for (int k = 0; k < depth_of(sl, s); k++) {
            int l = next_host(sl, i, s, 0);
            if (l >= 0) KVB_TRY(launch(e, i, l));
        }
    }
    return KVB_OK;
}

/* After the plan's operations: installs the placements and the step's prefetch slots, and launches the
 * first prefetches. */
static kvb_status sl_step_begin(void *ctx, kvb_engine *e, unsigned *flags) {
    kvb__slices *sl = ctx;
    uint64_t t0 = kvb_now_ns();
    pthread_mutex_lock(&sl->mu);
    kvb_status st = install(sl, e);
    pthread_mutex_unlock(&sl->mu);
    sl->st.install_ns += kvb_now_ns() - t0;
    KVB_TRY(st);
    KVB_TRY(prefetch_begin(sl, e));
    *flags = KVB__STEP_ACTIVE | KVB__STEP_SYNC | KVB__STEP_LAYOUT;
    return KVB_OK;
}

/* Layer l's pointers for the scheduled sequences: resident slices in place, the others from the
 * sequence's prefetch slot once its transfer (and any install load of the layer) has landed. */
static kvb_status sl_layer_in(void *ctx, kvb_engine *e, int l) {
    kvb__slices *sl = ctx;
    int n_sched = e->step.n_sched;
    uint64_t t0 = kvb_now_ns();
    /* the layer's kernels wait for its loads (on the device where the backend can; step_end drains) */
    if (sl->onload_t[l]) KVB_TRY(kvb_stager_wait_device(e->stager, sl->onload_t[l]));
    for (int i = 0; i < n_sched; i++) {
        kvb__seq *s = e->step.sched[i];
        const kvb_attn_seq *as = &e->step.seqs[i];
        const sl_mask *m = &sl->vmask[s->vidx];
        int in_host = mask_has(m, l), rank = 0;
        if (in_host) {
            uint64_t *t = &sl->s_ticket[(size_t)i * sl->L + l];
            assert(*t & LAUNCHED); /* launched when its slot was freed by the layer before that used it */
            if (*t & ~LAUNCHED) KVB_TRY(kvb_stager_wait_device(e->stager, *t & ~LAUNCHED));
            for (int k = 0; k < l; k++) rank += mask_has(m, k);
        }
        int pos = sl->s_first[i] + (rank % depth_of(sl, s)) * sl->s_per[i];
        for (int j = 0; j < as->n_blocks; j++) {
            int ent = as->blk_first + j;
            int32_t id = s->bt.ids[j];
            sl->entry_scratch[ent] = -1;
            if (kvb_block_pool_slice_resident(e->pool, id, l)) {
                e->step.layer[ent] = kvb_block_pool_block_layer(e->pool, id, l);
                continue;
            }
            assert(in_host); /* the install gave every other layer a slice */
            int32_t k = sl->scratch[pos++];
            sl->entry_scratch[ent] = k;
            e->step.layer[ent] = kvb_block_pool_slice_addr(e->pool, k);
        }
    }
    sl->st.layer_ns += kvb_now_ns() - t0;
    return KVB_OK;
}

/* After layer l (the backend is idle): the rows the step wrote into prefetch slots go to their host
 * homes (in one transfer, waited for at the end of the step), and every sequence whose slot layer l
 * used launches its next host layer into it. */
static kvb_status sl_layer_out(void *ctx, kvb_engine *e, int l) {
    kvb__slices *sl = ctx;
    int n_sched = e->step.n_sched;
    uint64_t t0 = kvb_now_ns();
    int from = sl->step.n;
    for (int i = 0; i < n_sched; i++) {
        kvb__seq *s = e->step.sched[i];
        const kvb_attn_seq *as = &e->step.seqs[i];
        int p0 = as->ctx_len - as->q_len, p1 = as->ctx_len;
        for (int j = p0 / sl->bs; j <= (p1 - 1) / sl->bs; j++) {
            int32_t k = sl->entry_scratch[as->blk_first + j];
            if (k < 0) continue;
            int32_t id = s->bt.ids[j];
            int r0 = KVB_MAX(p0 - j * sl->bs, 0), r1 = KVB_MIN(p1 - j * sl->bs, sl->bs);
            uint16_t *hr = &sl->host_rows[(size_t)id * sl->L + l];
            assert(*hr == sl->fill[id] && r0 == *hr); /* appending right after the stored rows */
            add_rows(sl, &sl->step, 1, kvb_block_pool_slice_addr(e->pool, k), id, l, r0, r1);
            *hr = (uint16_t)r1; /* landed by the end of the step (step_end drains) */
        }
    }
    uint64_t t;
    KVB_TRY(post(e, &sl->step, from, 1, &t));
    for (int i = 0; i < n_sched; i++) {
        kvb__seq *s = e->step.sched[i];
        if (!mask_has(&sl->vmask[s->vidx], l)) continue;
        int nl = next_host(sl, i, s, l + 1);
        if (nl >= 0) KVB_TRY(launch(e, i, nl));
    }
    sl->st.layer_ns += kvb_now_ns() - t0;
    return KVB_OK;
}

/* After the step, ok or not: every transfer has landed, prefetch slots go back. */
static void sl_step_end(void *ctx, kvb_engine *e, int ok) {
    kvb__slices *sl = ctx;
    (void)ok;
    if (sl->step.posted || sl->on.posted) (void)kvb_stager_drain(e->stager);
    sl->step.n = sl->step.posted = 0;
    sl->on.n = sl->on.posted = 0;
    for (int l = 0; l < sl->L; l++) sl->onload_t[l] = 0;
    for (int k = 0; k < sl->n_scratch; k++) kvb_block_pool_scratch_free(e->pool, sl->scratch[k]);
    sl->n_scratch = 0;
}

/* The step succeeded: the blocks' fill grows by the rows written. */
static void sl_step_done(void *ctx, kvb_engine *e) {
    kvb__slices *sl = ctx;
    for (int i = 0; i < e->step.n_sched; i++) {
        kvb__seq *s = e->step.sched[i];
        const kvb_attn_seq *as = &e->step.seqs[i];
        int p0 = as->ctx_len - as->q_len;
        for (int j = p0 / sl->bs; j < as->n_blocks; j++) {
            int rows = KVB_MIN(as->ctx_len - j * sl->bs, sl->bs);
            if (rows > sl->fill[s->bt.ids[j]]) sl->fill[s->bt.ids[j]] = (uint16_t)rows;
        }
    }
}

static const kvb__mech_i slices_iface = {
    .name = "sliced pool",
    .check_op = kvb__slices_check_op,
    .check_plan = kvb__slices_check_plan,
    .step_begin = sl_step_begin,
    .layer_in = sl_layer_in,
    .layer_out = sl_layer_out,
    .step_end = sl_step_end,
    .step_done = sl_step_done,
    .destroy = sl_destroy,
};
