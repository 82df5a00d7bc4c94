/* kvbank — the host tier: a second block pool in host memory, sized by the planner (plan_pool SETUP),
 * holding swapped-out requests, host copies of pool blocks (STORE copy orders, HOST residency) and,
 * when the planner asks (host_prefix: the baseline SwiftCache compares against), a prefix cache keyed
 * like the pool's: a cached block the pool evicts is kept here (written back ahead of the eviction
 * asynchronously, or copied out by the prefix cache's evict hook, the last moment its KV can be read),
 * and a prefix match that ends in the pool continues here, each hit copied back into a new pool block.
 * Every copy goes over the stager's host link. */
#include <string.h>

#include "common/sched/state.h"

kvb_status kvb__host_alloc(kvb_engine *e, int32_t *out) { return kvb_prefix_cache_alloc(e->ht_pc, out); }

kvb_status kvb__host_copy(kvb_engine *e, kvb_xfer_dir dir, void *dst, const void *src, size_t bytes) {
    KVB_TRY(kvb__host_tier_finish_loads(e)); /* a copy never overtakes the step's layered loads */
    kvb_xfer x = {dst, src, bytes};
    uint64_t t;
    KVB_TRY(kvb_stager_post(e->stager, KVB_LINK_HOST, dir, &x, 1, &t));
    return kvb_stager_wait(e->stager, t);
}

kvb_status kvb__host_flush(kvb_engine *e) {
    if (e->n_ht_pend == 0) return KVB_OK;
    uint64_t t;
    /* the host tier's copies out share the link's from-device queue with its write-backs ahead */
    kvb_status st = kvb_stager_post_out(e->stager, KVB_LINK_HOST, e->ht_pend, e->n_ht_pend, &t);
    e->n_ht_pend = 0;
    return st == KVB_OK ? kvb_stager_wait(e->stager, t) : st;
}

kvb_status kvb__host_move(kvb_engine *e, kvb_xfer_dir dir, const int32_t *pool, const int32_t *host, int n, int layer0) {
    kvb_xfer *x = NULL;
    if (n == 0 || layer0 >= e->geom.n_layers) return KVB_OK;
    KVB_TRY(kvb__host_flush(e)); /* demotions first: they may read the blocks written here */
    KVB_TRY(kvb__host_tier_finish_loads(e)); /* and the layered loads of hits (host_layered) */
    KVB_TRY(kvb_malloc((size_t)n * sizeof *x, (void **)&x));
    size_t off = (size_t)layer0 * kvb_kv_layer_bytes(&e->geom), bb = kvb_kv_block_bytes(&e->geom) - off;
    for (int i = 0; i < n; i++) {
        char *p = (char *)kvb_block_pool_block(e->pool, pool[i]) + off;
        char *h = (char *)kvb_block_pool_block(e->ht_pool, host[i]) + off;
        x[i] = dir == KVB_XFER_D2H ? (kvb_xfer){h, p, bb} : (kvb_xfer){p, h, bb};
    }
    uint64_t t;
    kvb_status st = kvb_stager_post(e->stager, KVB_LINK_HOST, dir, x, n, &t);
    if (st == KVB_OK) st = kvb_stager_wait(e->stager, t);
    free(x);
    return st;
}

kvb_status kvb__host_blocks_push(kvb_engine *e, kvb_block_table *t, int n) {
    for (int j = 0; j < n; j++) {
        int32_t h;
        KVB_TRY(kvb__host_alloc(e, &h));
        kvb_status st = kvb_block_table_push(t, h);
        if (st != KVB_OK) {
            kvb_block_pool_unref(e->ht_pool, h);
            return st;
        }
    }
    return KVB_OK;
}

/* ---------------------------------------------------------------- the host tier's mechanism (mech.h)
 * Layered loads (host_layered): the step's host-tier hits load layer by layer behind the compute (the
 * paper's baseline): one transfer per layer for all of them, posted before the forward pass, each layer
 * waiting for its own; the pool and host blocks stay referenced until every layer is in.
 *
 * Write-back ahead of eviction (host_async_writeback), as HiCache's write-through and LMCache's store
 * run on a copy stream of their own: at each step's start the idle cached blocks the next step may evict
 * (the LRU tail: a step's budget in blocks plus the most recent steps evicted, less the free blocks) are
 * copied to new host-tier blocks in one transfer on the host link's from-device queue (full duplex, as
 * a GPU's D2H copy engine runs beside its H2D one: no later step's loads queue behind it), waited for by
 * nobody. Tickets order the rest: a host copy is published (readable) only once its transfer has
 * landed, and a pool block whose write-back is in flight is handed out again only after it landed (the
 * evict hook waits for it). A block the pool evicts before it was written back is copied as before:
 * batched on the same queue (behind the write-backs in flight), waited for before the step's forward
 * pass. Cached blocks are immutable, so a block read by a
 * write-back while a step runs is never written by it. */

typedef struct wb_batch {
    uint64_t ticket;
    int n;
    kvb_xfer *x;          /* [n] its pieces (the stager borrows them until the ticket is done) */
    int32_t *pool;        /* [n] pool block read */
    int32_t *host;        /* [n] host block written, held by the batch until it lands */
    uint64_t *parent;     /* [n] each block's parent hash ... */
    int32_t *tokens;      /* [n][block_size] ... and tokens: the key its host copy is published under */
} wb_batch;

typedef struct host_mech {
    /* layered loads */
    int layered;
    int32_t *hd;          /* [2 n]: host block, pool block of each pending hit */
    int n, cap;
    kvb_xfer *x;          /* [n_layers * cap] the posted pieces (kept until the transfers are done) */
    uint64_t *t;          /* [n_layers] tickets, 0: not posted */
    int posted;
    /* write-back ahead of eviction */
    int async_wb;
    wb_batch *wb;         /* [n_wb] in flight, in post order (one link: they land in that order) */
    int n_wb, cap_wb;
    int32_t *lru;         /* [cap_lru] the LRU tail being written back */
    int cap_lru;
    int evicted;          /* blocks the pool evicted since the last step began */
    int peak;             /* the most a recent step evicted (decays by 1/8 a step) */
} host_mech;

static host_mech *mech_of(const kvb_engine *e) { return e->mech[KVB__MECH_HOST_TIER].ctx; }

/* The batch whose write-back reads pool block `id`, or -1. */
static int wb_find(const host_mech *h, int32_t id) {
    for (int b = 0; b < h->n_wb; b++)
        for (int i = 0; i < h->wb[b].n; i++)
            if (h->wb[b].pool[i] == id) return b;
    return -1;
}

/* Batches [0, upto] have landed (or failed: st): their host copies are published, the host blocks
 * released (a failed copy's go back unpublished), the batches freed. */
static void wb_retire(kvb_engine *e, host_mech *h, int upto, kvb_status st) {
    int bs = e->o.block_size;
    for (int b = 0; b <= upto; b++) {
        wb_batch *w = &h->wb[b];
        for (int i = 0; i < w->n; i++) {
            if (st == KVB_OK)
                (void)kvb_prefix_cache_publish(e->ht_pc, w->parent[i], w->tokens + (size_t)i * bs, w->host[i], NULL);
            kvb_block_pool_unref(e->ht_pool, w->host[i]); /* published: idle in the host tier's LRU */
        }
        free(w->x); /* one allocation holds the batch's arrays */
    }
    memmove(h->wb, h->wb + upto + 1, (size_t)(h->n_wb - upto - 1) * sizeof *h->wb);
    h->n_wb -= upto + 1;
}

/* Waits until batch `upto` (and every earlier one) has landed, then retires them. */
static kvb_status wb_land(kvb_engine *e, host_mech *h, int upto) {
    kvb_status st = kvb_stager_wait(e->stager, h->wb[upto].ticket);
    if (st != KVB_OK) KVB_LOG_W("engine: a host-tier write-back failed (%s); its blocks are not kept there", kvb_status_str(st));
    wb_retire(e, h, upto, st);
    return st;
}

/* Retires the batches that have landed, without waiting. */
static void wb_collect(kvb_engine *e, host_mech *h) {
    int b = 0;
    while (b < h->n_wb && kvb_stager_done(e->stager, h->wb[b].ticket)) b++;
    if (b > 0) (void)wb_land(e, h, b - 1); /* landed: the wait only collects the link's error */
}

/* Posts the write-back of the idle cached blocks the next step may evict that the host tier lacks. */
static kvb_status wb_post(kvb_engine *e, host_mech *h) {
    wb_collect(e, h);
    int bs = e->o.block_size;
    int want = KVB_DIV_CEIL(e->o.max_batch_tokens, bs) + h->peak - kvb_block_pool_n_free(e->pool);
    if (want <= 0 || kvb_prefix_cache_n_idle(e->pc) == 0) return KVB_OK;
    if (want > h->cap_lru) {
        KVB_TRY(kvb_realloc_array((void **)&h->lru, (size_t)want, sizeof *h->lru));
        h->cap_lru = want;
    }
    int n = kvb_prefix_cache_idle_lru(e->pc, h->lru, want);
    if (h->n_wb == h->cap_wb) {
        int cap = h->cap_wb ? 2 * h->cap_wb : 8;
        KVB_TRY(kvb_realloc_array((void **)&h->wb, (size_t)cap, sizeof *h->wb));
        h->cap_wb = cap;
    }
    wb_batch w = {0};
    size_t each = sizeof *w.x + 2 * sizeof *w.pool + sizeof *w.parent + (size_t)bs * sizeof *w.tokens;
    KVB_TRY(kvb_malloc((size_t)n * each, (void **)&w.x));
    w.parent = (uint64_t *)(w.x + n);
    w.pool = (int32_t *)(w.parent + n);
    w.host = w.pool + n;
    w.tokens = w.host + n;
    for (int i = 0; i < n; i++) {
        int32_t id = h->lru[i], hb;
        uint64_t parent, last;
        const int32_t *tk;
        if (wb_find(h, id) >= 0 || !kvb_prefix_cache_key(e->pc, id, &parent, &tk)) continue;
        if (kvb_prefix_cache_peek_from(e->ht_pc, parent, tk, bs, 1, NULL, &last) == 1) continue; /* there already */
        if (kvb__host_alloc(e, &hb) != KVB_OK) break; /* every host block is held */
        w.pool[w.n] = id;
        w.host[w.n] = hb;
        w.parent[w.n] = parent;
        memcpy(w.tokens + (size_t)w.n * bs, tk, (size_t)bs * sizeof *tk);
        w.x[w.n] = (kvb_xfer){kvb_block_pool_block(e->ht_pool, hb), kvb_block_pool_block(e->pool, id),
                              kvb_kv_block_bytes(&e->geom)};
        w.n++;
    }
    kvb_status st = w.n ? kvb_stager_post_out(e->stager, KVB_LINK_HOST, w.x, w.n, &w.ticket) : KVB_OK;
    if (st != KVB_OK || w.n == 0) {
        for (int i = 0; i < w.n; i++) kvb_block_pool_unref(e->ht_pool, w.host[i]);
        free(w.x);
        return st;
    }
    h->wb[h->n_wb++] = w;
    e->stats.host_tier_stores += (uint64_t)w.n;
    e->stats.host_tier_stores_ahead += (uint64_t)w.n;
    return KVB_OK;
}

kvb_status kvb__host_tier_quiesce(kvb_engine *e) {
    host_mech *h = mech_of(e);
    return h && h->n_wb ? wb_land(e, h, h->n_wb - 1) : KVB_OK;
}

int kvb__host_tier_in_flight(const kvb_engine *e) {
    const host_mech *h = mech_of(e);
    int n = 0;
    for (int b = 0; h && b < h->n_wb; b++) n += h->wb[b].n;
    return n;
}

/* Queues the copy of pool block `idx` into host block `h` (ht_batch), else copies it now. */
static kvb_status store_block(kvb_engine *e, int32_t h, int32_t idx) {
    kvb_xfer x = {kvb_block_pool_block(e->ht_pool, h), kvb_block_pool_block(e->pool, idx), kvb_kv_block_bytes(&e->geom)};
    if (!e->ht_batch) return kvb__host_copy(e, KVB_XFER_D2H, x.dst, x.src, x.bytes);
    if (e->n_ht_pend == e->cap_ht_pend) {
        int cap = e->cap_ht_pend ? 2 * e->cap_ht_pend : 64;
        kvb_xfer *p = realloc(e->ht_pend, (size_t)cap * sizeof *p);
        if (!p) return kvb__host_copy(e, KVB_XFER_D2H, x.dst, x.src, x.bytes);
        e->ht_pend = p;
        e->cap_ht_pend = cap;
    }
    e->ht_pend[e->n_ht_pend++] = x;
    return KVB_OK;
}

/* Evict hook of the pool's prefix cache: the block is about to be handed out again, the last moment its
 * KV can be read. A write-back in flight lands first; a block the host tier lacks is copied out (while
 * a plan is applied the copy is batched with the step's other demotions: kvb__host_flush runs before
 * the block can be written). */
static void host_tier_store(void *ud, uint64_t parent, const int32_t *tokens, int32_t idx) {
    kvb_engine *e = ud;
    host_mech *hm = mech_of(e);
    int32_t h;
    uint64_t last;
    if (hm) {
        hm->evicted++;
        int b = wb_find(hm, idx);
        if (b >= 0) { /* reused only once its write-back has landed */
            e->stats.host_tier_wb_waits++;
            (void)wb_land(e, hm, b); /* a failed one is not published: copied again below */
        }
    }
    if (kvb_prefix_cache_match_from(e->ht_pc, parent, tokens, e->o.block_size, 1, &h, &last) == 1) {
        kvb_block_pool_unref(e->ht_pool, h); /* already there */
        return;
    }
    if (kvb__host_alloc(e, &h) != KVB_OK) return; /* every host block in use: drop it */
    if (store_block(e, h, idx) == KVB_OK && kvb_prefix_cache_publish(e->ht_pc, parent, tokens, h, NULL) == KVB_OK)
        e->stats.host_tier_stores++;
    kvb_block_pool_unref(e->ht_pool, h);
}

/* Hit (host block h -> pool block d) joins the step's layered loads; both stay referenced until they
 * are in. */
static kvb_status loads_add(kvb_engine *e, host_mech *hl, int32_t h, int32_t d) {
    if (hl->n == hl->cap) {
        int cap = hl->cap ? 2 * hl->cap : 64;
        KVB_TRY(kvb_realloc_array((void **)&hl->hd, (size_t)cap * 2, sizeof *hl->hd));
        KVB_TRY(kvb_realloc_array((void **)&hl->x, (size_t)cap * (size_t)e->geom.n_layers, sizeof *hl->x));
        hl->cap = cap;
    }
    kvb_block_pool_ref(e->ht_pool, h);
    kvb_block_pool_ref(e->pool, d);
    hl->hd[2 * hl->n] = h;
    hl->hd[2 * hl->n + 1] = d;
    hl->n++;
    return KVB_OK;
}

/* Posts the pending hits' loads, one transfer per layer (after the pending demotions). */
static kvb_status loads_post(kvb_engine *e, host_mech *hl) {
    if (hl->n == 0 || hl->posted) return KVB_OK;
    KVB_TRY(kvb__host_flush(e)); /* demotions first: they may read the blocks written here */
    int L = e->geom.n_layers, n = hl->n;
    size_t lb = kvb_kv_layer_bytes(&e->geom);
    hl->posted = 1;
    for (int l = 0; l < L; l++) { /* block-major: layer l of a block at l * lb */
        kvb_xfer *x = hl->x + (size_t)l * (size_t)n;
        for (int i = 0; i < n; i++)
            x[i] = (kvb_xfer){(char *)kvb_block_pool_block(e->pool, hl->hd[2 * i + 1]) + (size_t)l * lb,
                              (const char *)kvb_block_pool_block(e->ht_pool, hl->hd[2 * i]) + (size_t)l * lb, lb};
        KVB_TRY(kvb_stager_post(e->stager, KVB_LINK_HOST, KVB_XFER_H2D, x, n, &hl->t[l]));
    }
    return KVB_OK;
}

kvb_status kvb__host_tier_finish_loads(kvb_engine *e) {
    host_mech *hl = mech_of(e);
    if (!hl || hl->n == 0) return KVB_OK;
    kvb_status st = loads_post(e, hl);
    for (int l = 0; l < e->geom.n_layers; l++) {
        if (st == KVB_OK && hl->t[l]) st = kvb_stager_wait(e->stager, hl->t[l]);
        hl->t[l] = 0;
    }
    if (st != KVB_OK) (void)kvb_stager_drain(e->stager); /* nothing may land after the blocks go back */
    for (int i = 0; i < hl->n; i++) {
        kvb_block_pool_unref(e->ht_pool, hl->hd[2 * i]);
        kvb_block_pool_unref(e->pool, hl->hd[2 * i + 1]);
    }
    hl->n = 0;
    hl->posted = 0;
    return st;
}

static kvb_status hm_step_begin(void *ctx, kvb_engine *e, unsigned *flags) {
    host_mech *h = ctx;
    *flags = 0;
    h->peak = KVB_MAX(h->evicted, h->peak - h->peak / 8); /* this step's evictions were made applying its plan */
    h->evicted = 0;
    if (h->n > 0) {
        KVB_TRY(loads_post(e, h));
        *flags = KVB__STEP_ACTIVE;
    }
    /* on the link's from-device queue: it never delays a step's loads; no DRAIN: nothing waits for it but
     * a reuse of its blocks */
    return h->async_wb ? wb_post(e, h) : KVB_OK;
}

/* Layer l's kernels come after its loads (on the device where the backend can); step_end waits for
 * them on the host before the blocks go back. */
static kvb_status hm_layer_in(void *ctx, kvb_engine *e, int l) {
    host_mech *h = ctx;
    return h->t[l] ? kvb_stager_wait_device(e->stager, h->t[l]) : KVB_OK;
}

/* Every layer is in (or the step failed): no load runs on after the step. Write-backs that landed
 * meanwhile become readable. */
static void hm_step_end(void *ctx, kvb_engine *e, int ok) {
    (void)ok;
    (void)kvb__host_tier_finish_loads(e);
    wb_collect(e, ctx);
}

static void hm_destroy(void *ctx, kvb_engine *e) {
    host_mech *h = ctx; /* no load is pending: each step finishes its own; the stager is gone */
    for (int b = 0; b < h->n_wb; b++) {
        for (int i = 0; i < h->wb[b].n; i++) kvb_block_pool_unref(e->ht_pool, h->wb[b].host[i]);
        free(h->wb[b].x);
    }
    free(h->wb);
    free(h->lru);
    free(h->hd);
    free(h->x);
    free(h->t);
    free(h);
}

static const kvb__mech_i host_mech_iface = {
    .name = "host tier",
    .step_begin = hm_step_begin,
    .layer_in = hm_layer_in,
    .step_end = hm_step_end,
    .destroy = hm_destroy,
};

kvb_status kvb__host_tier_init(kvb_engine *e, int blocks, int prefix, int layered, int async_wb) {
    size_t bytes = kvb_kv_block_bytes(&e->geom) * (size_t)blocks;
    /* pinned host memory: on a device, copies between the pool and the tier run asynchronously */
    KVB_TRY(kvb_mem_pinned_alloc(kvb_model_backend(e->m)->mem, bytes, &e->ht_mem));
    KVB_TRY(kvb_block_pool_create(&e->geom, e->ht_mem, bytes, blocks, &e->ht_pool));
    KVB_TRY(kvb_prefix_cache_create(e->ht_pool, &e->ht_pc));
    e->host_prefix = prefix;
    if (prefix) kvb_prefix_cache_set_evict_hook(e->pc, host_tier_store, e);
    if (!prefix || !(layered || async_wb)) return KVB_OK;
    host_mech *h = NULL;
    KVB_TRY(kvb_calloc(1, sizeof *h, (void **)&h));
    h->layered = layered;
    h->async_wb = async_wb;
    e->mech[KVB__MECH_HOST_TIER] = (kvb__mech){.iface = &host_mech_iface, .ctx = h};
    return kvb_calloc((size_t)e->geom.n_layers, sizeof *h->t, (void **)&h->t);
}

/* Continues a prefix match of `s` in the host tier: the hits are copied into new pool blocks in one
 * transfer (after the pending demotions, which may read those blocks), then published and appended to
 * the sequence; with host_layered they join the step's layer-by-layer loads instead (the blocks are
 * published now: whatever reads them in this step waits for each layer in the forward pass). Returns
 * the blocks loaded. */
int kvb__host_tier_load(kvb_engine *e, kvb__seq *s, int max_blocks) {
    int bs = e->o.block_size, n = 0, loaded = 0, cap = max_blocks - s->n_published;
    if (cap <= 0) return 0;
    int32_t *hd = NULL;   /* [2 cap]: host block, pool block */
    uint64_t *par = NULL; /* [cap + 1]: the chained hash before each hit, then after the last */
    kvb_xfer *x = NULL;
    if (kvb_malloc((size_t)cap * 2 * sizeof *hd, (void **)&hd) || kvb_malloc((size_t)(cap + 1) * sizeof *par, (void **)&par) ||
        kvb_malloc((size_t)cap * sizeof *x, (void **)&x))
        goto out;
    par[0] = s->last_hash;
    while (n < cap) {
        const int32_t *tk = s->tokens + (size_t)(s->n_published + n) * bs;
        int32_t h, d;
        if (kvb_prefix_cache_match_from(e->ht_pc, par[n], tk, bs, 1, &h, &par[n + 1]) != 1) break;
        if (kvb_prefix_cache_alloc(e->pc, &d) != KVB_OK) { /* the host block stays referenced until copied */
            kvb_block_pool_unref(e->ht_pool, h);
            break;
        }
        hd[2 * n] = h;
        hd[2 * n + 1] = d;
        x[n] = (kvb_xfer){kvb_block_pool_block(e->pool, d), kvb_block_pool_block(e->ht_pool, h), kvb_kv_block_bytes(&e->geom)};
        n++;
    }
    uint64_t t;
    kvb_status st = KVB_OK;
    host_mech *hl = mech_of(e);
    if (hl && hl->layered) {
        for (int i = 0; i < n && st == KVB_OK; i++) st = loads_add(e, hl, hd[2 * i], hd[2 * i + 1]);
    } else {
        st = n ? kvb__host_flush(e) : KVB_OK;
        if (st == KVB_OK && n) st = kvb_stager_post(e->stager, KVB_LINK_HOST, KVB_XFER_H2D, x, n, &t);
        if (st == KVB_OK && n) st = kvb_stager_wait(e->stager, t);
    }
    for (int i = 0; i < n; i++) {
        int32_t d = hd[2 * i + 1];
        const int32_t *tk = s->tokens + (size_t)s->n_published * bs;
        if (st == KVB_OK) st = kvb_prefix_cache_publish(e->pc, par[i], tk, d, NULL);
        if (st == KVB_OK) st = kvb_block_table_push(&s->bt, d);
        if (st != KVB_OK) kvb_block_pool_unref(e->pool, d);
        kvb_block_pool_unref(e->ht_pool, hd[2 * i]);
        if (st != KVB_OK) continue;
        s->last_hash = par[i + 1];
        s->n_published++;
        loaded++;
        e->stats.host_tier_loads++;
    }
out:
    free(hd);
    free(par);
    free(x);
    return loaded;
}


int kvb__host_tier_peek(const kvb_engine *e, uint64_t parent, const int32_t *tokens, int max_blocks,
                        uint64_t *last_hash) {
    return kvb_prefix_cache_peek_from(e->ht_pc, parent, tokens, max_blocks * e->o.block_size, max_blocks, NULL,
                                      last_hash);
}

void kvb__host_tier_free(kvb_engine *e) {
    free(e->ht_pend);
    e->ht_pend = NULL;
    e->n_ht_pend = e->cap_ht_pend = 0;
    kvb_prefix_cache_destroy(e->ht_pc);
    kvb_block_pool_destroy(e->ht_pool);
    kvb_mem_pinned_free(kvb_model_backend(e->m)->mem, e->ht_mem);
    e->ht_pc = NULL;
    e->ht_pool = NULL;
    e->ht_mem = NULL;
}
