/* kvbank — the stager: the copy thread that moves layer slices between tiers while the forward pass
 * computes. Today it runs the layer stream cache (SwiftCache §3.2-3.3): double-buffered single-layer
 * slots for borrowed blocks, loads posted before a layer and stores of the rows a step wrote after it,
 * in FIFO order, each post returning a ticket to wait on before the layer that needs it. */
#include <assert.h>

#include "common/sched/state.h"

unsigned char *kvb__lsc_buf(const lsc *c, int k, int parity) {
    return (unsigned char *)c->mem + ((size_t)k * 2 + (size_t)parity) * c->layer_bytes;
}

/* Runs one task on the copy thread (outside the mutex). */
static kvb_status lsc_run(lsc *c, int kind, int layer) {
    const kvb_backend_i *bi = c->be->iface;
    size_t off = (size_t)layer * c->layer_bytes;
    for (int k = 0; k < c->n_used; k++) {
        unsigned char *buf = kvb__lsc_buf(c, k, layer & 1);
        if (kind == LSC_LOAD) {
            KVB_TRY(bi->copy(c->be->ctx, buf, c->src[k] + off, c->layer_bytes));
        } else if (c->dirty_lo[k] < c->dirty_hi[k]) {
            /* only the rows this step wrote: K rows, then the same V rows */
            size_t r0 = (size_t)c->dirty_lo[k] * c->row_bytes, nb = (size_t)(c->dirty_hi[k] - c->dirty_lo[k]) * c->row_bytes;
            KVB_TRY(bi->copy(c->be->ctx, c->src[k] + off + r0, buf + r0, nb));
            KVB_TRY(bi->copy(c->be->ctx, c->src[k] + off + c->half_bytes + r0, buf + c->half_bytes + r0, nb));
        }
    }
    return KVB_OK;
}

static void *lsc_thread(void *arg) {
    lsc *c = arg;
    pthread_mutex_lock(&c->mu);
    for (;;) {
        while (!c->quit && c->done == c->posted) pthread_cond_wait(&c->cv, &c->mu);
        if (c->done == c->posted) break; /* quit with nothing left */
        size_t slot = (size_t)(c->done % LSC_QUEUE);
        int kind = c->q_kind[slot], layer = c->q_layer[slot];
        pthread_mutex_unlock(&c->mu);
        kvb_status st = lsc_run(c, kind, layer);
        pthread_mutex_lock(&c->mu);
        if (st != KVB_OK && c->err == KVB_OK) c->err = st;
        c->done++;
        pthread_cond_broadcast(&c->cv);
    }
    pthread_mutex_unlock(&c->mu);
    return NULL;
}

/* Starts a step: clears the copy error (the thread is idle between steps). */
void kvb__lsc_begin(lsc *c) {
    pthread_mutex_lock(&c->mu);
    assert(c->done == c->posted);
    c->err = KVB_OK;
    pthread_mutex_unlock(&c->mu);
}

/* Queues a task; returns its ticket (wait for it with lsc_wait). */
uint64_t kvb__lsc_post(lsc *c, int kind, int layer) {
    pthread_mutex_lock(&c->mu);
    assert(c->posted - c->done < LSC_QUEUE);
    size_t slot = (size_t)(c->posted % LSC_QUEUE);
    c->q_kind[slot] = kind;
    c->q_layer[slot] = layer;
    uint64_t t = ++c->posted;
    pthread_cond_broadcast(&c->cv);
    pthread_mutex_unlock(&c->mu);
    return t;
}

/* Waits until task `ticket` and every task before it finished; returns the step's first copy error. */
kvb_status kvb__lsc_wait(lsc *c, uint64_t ticket) {
    pthread_mutex_lock(&c->mu);
    while (c->done < ticket) pthread_cond_wait(&c->cv, &c->mu);
    kvb_status st = c->err;
    pthread_mutex_unlock(&c->mu);
    return st;
}

kvb_status kvb__lsc_init(kvb_engine *e) {
    lsc *c = &e->lsc;
    c->be = kvb_model_backend(e->m);
    if (!c->be->iface->copy) {
        KVB_LOG_E("engine: LSC streaming needs the %s backend's copy operation", c->be->iface->name);
        return KVB_ERR_UNSUPPORTED;
    }
    c->layer_bytes = kvb_kv_layer_bytes(&e->geom);
    c->row_bytes = (size_t)e->geom.n_kv_heads * (size_t)e->geom.head_dim * (size_t)e->geom.elem_size;
    c->half_bytes = (size_t)e->geom.block_size * c->row_bytes;
    KVB_TRY(kvb_calloc((size_t)e->geom.n_layers, sizeof *c->ticket, (void **)&c->ticket));
    if (pthread_mutex_init(&c->mu, NULL)) return KVB_ERR_NOMEM;
    if (pthread_cond_init(&c->cv, NULL)) {
        pthread_mutex_destroy(&c->mu);
        return KVB_ERR_NOMEM;
    }
    if (pthread_create(&c->thread, NULL, lsc_thread, c)) {
        KVB_LOG_E("engine: cannot start the LSC copy thread");
        pthread_cond_destroy(&c->cv);
        pthread_mutex_destroy(&c->mu);
        return KVB_ERR_NOMEM;
    }
    c->started = 1;
    return KVB_OK;
}

/* Stops the copy thread and frees the LSC. Safe on a partly initialised or unused LSC. */
void kvb__lsc_release(kvb_engine *e) {
    lsc *c = &e->lsc;
    if (c->started) {
        pthread_mutex_lock(&c->mu);
        c->quit = 1;
        pthread_cond_broadcast(&c->cv);
        pthread_mutex_unlock(&c->mu);
        pthread_join(c->thread, NULL);
        pthread_cond_destroy(&c->cv);
        pthread_mutex_destroy(&c->mu);
        c->started = 0;
    }
    if (c->mem) kvb_mem_free(c->be->mem, c->mem);
    c->mem = NULL;
    free(c->slot_of);
    free(c->entry_slot);
    free(c->src);
    free(c->dirty_lo);
    free(c->dirty_hi);
    free(c->ticket);
}

/* Sizes the LSC for `n_slots` borrowed blocks and the slot map for the pool's id space. Called
 * between steps only (no task in flight). On failure the LSC keeps its old size. */
kvb_status kvb__lsc_resize(kvb_engine *e, int n_slots) {
    lsc *c = &e->lsc;
    int ids = kvb_block_pool_id_limit(e->pool) - kvb_block_pool_capacity(e->pool);
    if (ids > c->slot_of_n) {
        KVB_TRY(kvb_realloc_array((void **)&c->slot_of, (size_t)ids, sizeof *c->slot_of));
        for (int j = c->slot_of_n; j < ids; j++) c->slot_of[j] = -1;
        c->slot_of_n = ids;
    }
    if (n_slots == c->n_slots) return KVB_OK;
    void *mem = NULL;
    if (n_slots > 0) {
        /* per-slot arrays first: on a later failure, arrays longer than n_slots are harmless */
        KVB_TRY(kvb_realloc_array((void **)&c->src, (size_t)n_slots, sizeof *c->src));
        KVB_TRY(kvb_realloc_array((void **)&c->dirty_lo, (size_t)n_slots, sizeof *c->dirty_lo));
        KVB_TRY(kvb_realloc_array((void **)&c->dirty_hi, (size_t)n_slots, sizeof *c->dirty_hi));
        KVB_TRY(kvb_mem_alloc(c->be->mem, (size_t)n_slots * 2 * c->layer_bytes, &mem));
    }
    if (c->mem) kvb_mem_free(c->be->mem, c->mem);
    c->mem = mem;
    c->n_slots = n_slots;
    return KVB_OK;
}

/* ---------------------------------------------------------------- create / destroy */

/* ---------------------------------------------------------------- host tier (baseline) */

