/* kvbank — the engine: FCFS continuous batching with chunked prefill, prefix caching, preemption by
 * recompute, and the step executor that feeds the layer-stepped forward pass. */
#include "common/sched/engine.h"

#include <assert.h>
#include <limits.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <string.h>

#include "common/kv/block_pool.h"
#include "common/kv/block_table.h"
#include "common/kv/prefix_cache.h"

typedef struct seq {
    uint64_t id;
    uint64_t arrival;  /* admission order */
    int32_t *tokens;   /* [cap] prompt followed by generated tokens */
    int n_tokens;
    int cap;
    int n_prompt;
    int max_tokens;
    int n_generated;
    int32_t *stop;     /* [n_stop] */
    int n_stop;
    kvb_sampling samp;
    kvb_rng rng;
    kvb_block_table bt;
    int n_computed;    /* tokens whose KV is in the sequence's blocks */
    int n_published;   /* full blocks offered to the prefix cache */
    uint64_t last_hash;/* chained hash of block n_published-1 */
    int q_len;         /* tokens scheduled in the current step */
    struct seq *prev, *next;
} seq;

typedef struct seq_list {
    seq *head, *tail;
    int n;
} seq_list;

/* One attached loan: a segment of the pool. */
typedef struct loan {
    uint64_t tag;      /* the caller's loan id */
    int32_t first;     /* first block id of the segment */
    int n;             /* blocks */
} loan;

/* Copy-thread tasks of the layer stream cache. */
enum { LSC_LOAD = 1, LSC_STORE = 2 };
#define LSC_QUEUE 8 /* at most 3 tasks are ever outstanding: load l+1, store l, load l+2 */

/* The layer stream cache (SwiftCache §3.2-3.3). Each borrowed block used by a step gets a slot k of
 * two single-layer buffers (parity 0 and 1: layer l uses parity l & 1). A copy thread loads layer
 * l's slice of every slot's block into parity l & 1 before layer l runs and stores the rows the step
 * wrote back after it; tasks run in the order they are posted (FIFO), which gives §3.3's ordering:
 * load(l+2) reuses the buffer of layer l and is posted after store(l). */
typedef struct lsc {
    void *mem;              /* backend memory [n_slots][2][layer_bytes] */
    int n_slots;            /* borrowed blocks the LSC can hold (= attached blocks) */
    int32_t *slot_of;       /* [slot_of_n] slot of attached id capacity+j in this step, -1 if none */
    int slot_of_n;
    int32_t *entry_slot;    /* [blk_cap] slot of each layer_blocks entry of the step, -1 for local */
    /* per step; the copy thread reads them (written before the first post, under the mutex) */
    unsigned char **src;    /* [n_slots] borrowed block base (all layers) of slot k */
    int *dirty_lo;          /* [n_slots] rows [lo, hi) of the block written by this step; lo >= hi: none */
    int *dirty_hi;
    int n_used;             /* slots used by this step */
    size_t layer_bytes;     /* one layer slice of a block: [2][block_size][n_kv_heads][head_dim] */
    size_t row_bytes;       /* one token row of K (or V): [n_kv_heads][head_dim] */
    size_t half_bytes;      /* offset of V in a slice: block_size * row_bytes */
    uint64_t *ticket;       /* [n_layers] ticket of each layer's load in this step */
    /* copy thread */
    kvb_backend *be;
    pthread_t thread;
    int started;
    pthread_mutex_t mu;
    pthread_cond_t cv;
    int q_kind[LSC_QUEUE];
    int q_layer[LSC_QUEUE];
    uint64_t posted;        /* tasks posted; task t (1-based) sits at q[(t - 1) % LSC_QUEUE] */
    uint64_t done;          /* tasks finished */
    kvb_status err;         /* first copy error of the step */
    int quit;
} lsc;

struct kvb_engine {
    kvb_model *m;
    kvb_engine_opts o;
    kvb_planner planner;
    kvb_engine_events ev;
    kvb_kv_geom geom;
    void *kv_mem;            /* pool memory */
    int kv_mem_owned;        /* allocated by the engine through the backend */
    kvb_block_pool *pool;
    kvb_prefix_cache *pc;
    kvb_forward *fw;
    seq_list waiting;        /* by arrival; preempted sequences go back in arrival order */
    seq_list running;        /* by arrival */
    uint64_t next_arrival;
    kvb_engine_stats stats;
    /* per-step scratch */
    seq **sched;             /* [max_seqs] sequences of this step */
    int32_t *b_tokens;       /* [max_batch_tokens] */
    int32_t *b_pos;          /* [max_batch_tokens] */
    kvb_attn_seq *b_seqs;    /* [max_seqs] */
    int32_t *b_logit_rows;   /* [max_seqs] */
    void **blk_base;         /* [blk_cap] block base addresses of the step (all layers) */
    void **blk_layer;        /* [blk_cap] the same blocks' slices for the current layer */
    int blk_cap;
    int32_t *blk_id;         /* [blk_cap] the same blocks' ids */
    kvb_seq_info *infos;     /* [max_seqs] */
    float *logits;           /* [max_seqs][vocab] */
    float *sample_scratch;   /* [2*vocab] */
    char last_error[256];    /* why the last kvb_engine_add failed */
    /* lending */
    loan *loans;             /* [n_loans] attached segments, in attach order */
    int n_loans;
    int loans_cap;
    int n_borrowed;          /* blocks of all loans */
    int starved;             /* the last schedule left the queue's head waiting for blocks */
    lsc lsc;                 /* used with o.lsc_stream */
    void *ht_mem;            /* host tier: [host_tier_blocks][block_bytes] host memory, or NULL */
    kvb_block_pool *ht_pool; /* its blocks */
    kvb_prefix_cache *ht_pc; /* its prefix cache: blocks keyed like the pool's */
};

const char *kvb_finish_str(kvb_finish f) {
    switch (f) {
    case KVB_FINISH_NONE: return "none";
    case KVB_FINISH_LENGTH: return "length";
    case KVB_FINISH_STOP: return "stop";
    case KVB_FINISH_CANCELLED: return "cancelled";
    case KVB_FINISH_ERROR: return "error";
    }
    return "?";
}

void kvb_engine_opts_default(kvb_engine_opts *o) {
    memset(o, 0, sizeof *o);
    o->block_size = 16;
    o->n_blocks = 256;
    o->max_batch_tokens = 512;
    o->max_seqs = 64;
    o->enable_prefix_cache = 1;
}

/* ---------------------------------------------------------------- lists */

static void list_remove(seq_list *l, seq *s) {
    if (s->prev) s->prev->next = s->next;
    else l->head = s->next;
    if (s->next) s->next->prev = s->prev;
    else l->tail = s->prev;
    s->prev = s->next = NULL;
    l->n--;
}

/* Inserts keeping the list ordered by arrival (new arrivals go to the tail in O(1)). */
static void list_insert_ordered(seq_list *l, seq *s) {
    seq *after = l->tail;
    while (after && after->arrival > s->arrival) after = after->prev;
    s->prev = after;
    s->next = after ? after->next : l->head;
    if (after) after->next = s;
    else l->head = s;
    if (s->next) s->next->prev = s;
    else l->tail = s;
    l->n++;
}

static seq *find_seq(const seq_list *l, uint64_t id) {
    for (seq *s = l->head; s; s = s->next)
        if (s->id == id) return s;
    return NULL;
}

static void seq_free(kvb_engine *e, seq *s) {
    kvb_block_table_release(&s->bt, e->pool);
    kvb_block_table_free(&s->bt);
    free(s->tokens);
    free(s->stop);
    free(s);
}

/* Drops a sequence's KV (its blocks go back to the pool or stay cached) and resets its progress. */
static void seq_drop_kv(kvb_engine *e, seq *s) {
    kvb_block_table_release(&s->bt, e->pool);
    s->n_computed = 0;
    s->n_published = 0;
    s->last_hash = KVB_PREFIX_ROOT;
}

static void finish(kvb_engine *e, seq_list *l, seq *s, kvb_finish why, kvb_status err) {
    list_remove(l, s);
    uint64_t id = s->id;
    seq_free(e, s);
    if (e->ev.on_finish) e->ev.on_finish(e->ev.ud, id, why, err);
}

/* ---------------------------------------------------------------- layer stream cache */

static unsigned char *lsc_buf(const lsc *c, int k, int parity) {
    return (unsigned char *)c->mem + ((size_t)k * 2 + (size_t)parity) * c->layer_bytes;
}

/* Runs one task on the copy thread (outside the mutex). */
static kvb_status lsc_run(lsc *c, int kind, int layer) {
    const kvb_backend_i *bi = c->be->iface;
    size_t off = (size_t)layer * c->layer_bytes;
    for (int k = 0; k < c->n_used; k++) {
        unsigned char *buf = lsc_buf(c, k, layer & 1);
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
static void lsc_begin(lsc *c) {
    pthread_mutex_lock(&c->mu);
    assert(c->done == c->posted);
    c->err = KVB_OK;
    pthread_mutex_unlock(&c->mu);
}

/* Queues a task; returns its ticket (wait for it with lsc_wait). */
static uint64_t lsc_post(lsc *c, int kind, int layer) {
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
static kvb_status lsc_wait(lsc *c, uint64_t ticket) {
    pthread_mutex_lock(&c->mu);
    while (c->done < ticket) pthread_cond_wait(&c->cv, &c->mu);
    kvb_status st = c->err;
    pthread_mutex_unlock(&c->mu);
    return st;
}

static kvb_status lsc_init(kvb_engine *e) {
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
static void lsc_release(kvb_engine *e) {
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
    if (c->mem) c->be->iface->free(c->be->ctx, c->mem);
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
static kvb_status lsc_resize(kvb_engine *e, int n_slots) {
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
        KVB_TRY(c->be->iface->alloc(c->be->ctx, (size_t)n_slots * 2 * c->layer_bytes, &mem));
    }
    if (c->mem) c->be->iface->free(c->be->ctx, c->mem);
    c->mem = mem;
    c->n_slots = n_slots;
    return KVB_OK;
}

/* ---------------------------------------------------------------- create / destroy */

/* ---------------------------------------------------------------- host tier (baseline) */

/* Evict hook of the pool's prefix cache: copy the block out before it is reused. */
static void host_tier_store(void *ud, uint64_t parent, const int32_t *tokens, int32_t idx) {
    kvb_engine *e = ud;
    int32_t h;
    uint64_t last;
    if (kvb_prefix_cache_match_from(e->ht_pc, parent, tokens, e->o.block_size, 1, &h, &last) == 1) {
        kvb_block_pool_unref(e->ht_pool, h); /* already there */
        return;
    }
    if (kvb_prefix_cache_alloc(e->ht_pc, &h) != KVB_OK) return; /* every host block in use: drop it */
    kvb_backend *be = kvb_model_backend(e->m);
    if (be->iface->to_host(be->ctx, kvb_block_pool_block(e->ht_pool, h), kvb_block_pool_block(e->pool, idx),
                           kvb_kv_block_bytes(&e->geom)) == KVB_OK &&
        kvb_prefix_cache_publish(e->ht_pc, parent, tokens, h, NULL) == KVB_OK)
        e->stats.host_tier_stores++;
    kvb_block_pool_unref(e->ht_pool, h);
}

static kvb_status host_tier_init(kvb_engine *e) {
    size_t bytes = kvb_kv_block_bytes(&e->geom) * (size_t)e->o.host_tier_blocks;
    KVB_TRY(kvb_aligned_alloc(bytes, &e->ht_mem));
    KVB_TRY(kvb_block_pool_create(&e->geom, e->ht_mem, bytes, e->o.host_tier_blocks, &e->ht_pool));
    KVB_TRY(kvb_prefix_cache_create(e->ht_pool, &e->ht_pc));
    kvb_prefix_cache_set_evict_hook(e->pc, host_tier_store, e);
    return KVB_OK;
}

/* Continues a prefix match of `s` in the host tier: each hit is copied into a new pool block, which is
 * published and appended to the sequence. Returns the blocks loaded. */
static int host_tier_load(kvb_engine *e, seq *s, int max_blocks) {
    int bs = e->o.block_size, loaded = 0;
    kvb_backend *be = kvb_model_backend(e->m);
    while (s->n_published < max_blocks) {
        const int32_t *tk = s->tokens + (size_t)s->n_published * bs;
        int32_t h, d;
        uint64_t next;
        if (kvb_prefix_cache_match_from(e->ht_pc, s->last_hash, tk, bs, 1, &h, &next) != 1) break;
        kvb_status st = kvb_prefix_cache_alloc(e->pc, &d);
        if (st == KVB_OK) {
            st = be->iface->to_device(be->ctx, kvb_block_pool_block(e->pool, d), kvb_block_pool_block(e->ht_pool, h),
                                      kvb_kv_block_bytes(&e->geom));
            if (st == KVB_OK) st = kvb_prefix_cache_publish(e->pc, s->last_hash, tk, d, NULL);
            if (st == KVB_OK) st = kvb_block_table_push(&s->bt, d);
            if (st != KVB_OK) kvb_block_pool_unref(e->pool, d);
        }
        kvb_block_pool_unref(e->ht_pool, h);
        if (st != KVB_OK) break;
        s->last_hash = next;
        s->n_published++;
        loaded++;
        e->stats.host_tier_loads++;
    }
    return loaded;
}

kvb_status kvb_engine_create(kvb_model *m, const kvb_engine_opts *opts, const kvb_planner *planner,
                             const kvb_engine_events *ev, kvb_engine **out) {
    const kvb_model_config *c = kvb_model_cfg(m);
    kvb_engine_opts o = *opts;
    if (o.max_model_len <= 0 || o.max_model_len > c->max_pos) o.max_model_len = c->max_pos;
    if (o.block_size < 1 || o.n_blocks < 1 || o.max_batch_tokens < 1 || o.max_seqs < 1) {
        KVB_LOG_E("engine: block_size, n_blocks, max_batch_tokens and max_seqs must be positive");
        return KVB_ERR_INVALID;
    }
    kvb_engine *e = NULL;
    KVB_TRY(kvb_calloc(1, sizeof *e, (void **)&e));
    e->m = m;
    e->o = o;
    if (planner && planner->iface) e->planner = *planner;
    if (ev) e->ev = *ev;
    e->geom = kvb_model_kv_geom(m, o.block_size);
    kvb_backend *be = kvb_model_backend(m);
    kvb_status st;
    KVB_TRY_GOTO(kvb_kv_geom_check(&e->geom), fail);
    size_t bytes = kvb_kv_block_bytes(&e->geom) * (size_t)o.n_blocks;
    if (o.kv_mem) {
        if (o.kv_mem_bytes < bytes) {
            KVB_LOG_E("engine: KV memory of %zu bytes is smaller than %d blocks (%zu bytes)", o.kv_mem_bytes,
                      o.n_blocks, bytes);
            st = KVB_ERR_INVALID;
            goto fail;
        }
        e->kv_mem = o.kv_mem;
    } else {
        KVB_TRY_GOTO(be->iface->alloc(be->ctx, bytes, &e->kv_mem), fail);
        e->kv_mem_owned = 1;
        o.kv_mem_bytes = bytes;
    }
    KVB_TRY_GOTO(kvb_block_pool_create(&e->geom, e->kv_mem, o.kv_mem ? o.kv_mem_bytes : bytes, o.n_blocks, &e->pool),
                 fail);
    KVB_TRY_GOTO(kvb_prefix_cache_create(e->pool, &e->pc), fail);
    KVB_TRY_GOTO(kvb_forward_create(m, o.max_batch_tokens, &e->fw), fail);
    KVB_TRY_GOTO(kvb_calloc((size_t)o.max_seqs, sizeof *e->sched, (void **)&e->sched), fail);
    KVB_TRY_GOTO(kvb_calloc((size_t)o.max_batch_tokens, sizeof *e->b_tokens, (void **)&e->b_tokens), fail);
    KVB_TRY_GOTO(kvb_calloc((size_t)o.max_batch_tokens, sizeof *e->b_pos, (void **)&e->b_pos), fail);
    KVB_TRY_GOTO(kvb_calloc((size_t)o.max_seqs, sizeof *e->b_seqs, (void **)&e->b_seqs), fail);
    KVB_TRY_GOTO(kvb_calloc((size_t)o.max_seqs, sizeof *e->b_logit_rows, (void **)&e->b_logit_rows), fail);
    KVB_TRY_GOTO(kvb_calloc((size_t)o.max_seqs, sizeof *e->infos, (void **)&e->infos), fail);
    KVB_TRY_GOTO(kvb_calloc((size_t)o.max_seqs * c->vocab, sizeof(float), (void **)&e->logits), fail);
    KVB_TRY_GOTO(kvb_calloc(2 * (size_t)c->vocab, sizeof(float), (void **)&e->sample_scratch), fail);
    if (o.lsc_stream) KVB_TRY_GOTO(lsc_init(e), fail);
    if (o.host_tier_blocks > 0 && o.enable_prefix_cache) KVB_TRY_GOTO(host_tier_init(e), fail);
    *out = e;
    return KVB_OK;
fail:
    e->planner = (kvb_planner){0}; /* the caller keeps the planner when creation fails */
    kvb_engine_destroy(e);
    return st;
}

void kvb_engine_destroy(kvb_engine *e) {
    if (!e) return;
    seq_list *lists[] = {&e->waiting, &e->running};
    for (int i = 0; i < 2; i++) {
        while (lists[i]->head) {
            seq *s = lists[i]->head;
            list_remove(lists[i], s);
            if (e->pool) seq_free(e, s);
        }
    }
    kvb_forward_destroy(e->fw);
    kvb_prefix_cache_destroy(e->pc);
    kvb_block_pool_destroy(e->pool);
    if (e->kv_mem_owned) {
        kvb_backend *be = kvb_model_backend(e->m);
        be->iface->free(be->ctx, e->kv_mem);
    }
    if (e->planner.iface && e->planner.iface->destroy) e->planner.iface->destroy(e->planner.ctx);
    free(e->sched);
    free(e->b_tokens);
    free(e->b_pos);
    free(e->b_seqs);
    free(e->b_logit_rows);
    free(e->blk_base);
    free(e->blk_layer);
    free(e->blk_id);
    free(e->loans);
    lsc_release(e);
    kvb_prefix_cache_destroy(e->ht_pc);
    kvb_block_pool_destroy(e->ht_pool);
    free(e->ht_mem);
    free(e->infos);
    free(e->logits);
    free(e->sample_scratch);
    free(e);
}

/* ---------------------------------------------------------------- requests */

/* Records and logs why a request is rejected; returns KVB_ERR_INVALID. */
__attribute__((format(printf, 3, 4))) static kvb_status reject(kvb_engine *e, uint64_t id, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(e->last_error, sizeof e->last_error, fmt, ap);
    va_end(ap);
    KVB_LOG_W("request %llu rejected: %s", (unsigned long long)id, e->last_error);
    return KVB_ERR_INVALID;
}

const char *kvb_engine_last_error(const kvb_engine *e) { return e->last_error; }

kvb_model *kvb_engine_model(const kvb_engine *e) { return e->m; }

kvb_status kvb_engine_add(kvb_engine *e, const kvb_request *r) {
    const kvb_model_config *c = kvb_model_cfg(e->m);
    if (!r->prompt || r->n_prompt < 1) return reject(e, r->id, "empty prompt");
    if (r->max_tokens < 1) return reject(e, r->id, "max_tokens must be at least 1");
    if (r->resume_index < 0 || r->resume_index >= r->n_prompt)
        return reject(e, r->id, "resume_index %d must be in [0, %d) (the prompt length)", r->resume_index, r->n_prompt);
    for (int i = 0; i < r->n_prompt; i++) {
        if (r->prompt[i] < 0 || r->prompt[i] >= c->vocab)
            return reject(e, r->id, "prompt token %d = %d is outside the vocabulary [0, %d)", i, r->prompt[i], c->vocab);
    }
    if (kvb_sampling_check(&r->sampling) != KVB_OK)
        return reject(e, r->id, "invalid sampling parameters (temperature >= 0, top_k >= 0, top_p in [0, 1])");
    int64_t total = (int64_t)r->n_prompt + r->max_tokens;
    if (total > e->o.max_model_len)
        return reject(e, r->id, "prompt (%d) + max_tokens (%d) exceeds the model length %d", r->n_prompt, r->max_tokens,
                      e->o.max_model_len);
    /* never fit: more than the own memory (lent-out part included) plus what is borrowed now */
    int64_t most = (int64_t)kvb_block_pool_capacity(e->pool) + e->n_borrowed;
    if (KVB_DIV_CEIL(total, e->o.block_size) > most)
        return reject(e, r->id, "%lld tokens can never fit in %lld KV blocks of %d", (long long)total, (long long)most,
                      e->o.block_size);
    if (find_seq(&e->waiting, r->id) || find_seq(&e->running, r->id)) return reject(e, r->id, "duplicate id");
    seq *s = NULL;
    KVB_TRY(kvb_calloc(1, sizeof *s, (void **)&s));
    s->cap = (int)total;
    kvb_status st;
    KVB_TRY_GOTO(kvb_malloc((size_t)s->cap * sizeof(int32_t), (void **)&s->tokens), fail);
    if (r->n_stop > 0) {
        KVB_TRY_GOTO(kvb_malloc((size_t)r->n_stop * sizeof(int32_t), (void **)&s->stop), fail);
        memcpy(s->stop, r->stop_ids, (size_t)r->n_stop * sizeof(int32_t));
        s->n_stop = r->n_stop;
    }
    memcpy(s->tokens, r->prompt, (size_t)r->n_prompt * sizeof(int32_t));
    s->id = r->id;
    s->arrival = e->next_arrival++;
    s->n_tokens = s->n_prompt = r->n_prompt;
    s->max_tokens = r->max_tokens;
    s->samp = r->sampling;
    kvb_rng_seed(&s->rng, r->sampling.seed);
    /* A resumed request's earlier tokens each took one draw (kvb_sample draws once per token when it
     * samples at all): continue the same random stream after them. */
    for (int k = 0; r->sampling.temperature > 0 && k < r->resume_index; k++) kvb_rng_uniform(&s->rng);
    s->last_hash = KVB_PREFIX_ROOT;
    list_insert_ordered(&e->waiting, s);
    return KVB_OK;
fail:
    free(s->tokens);
    free(s);
    return st;
}

kvb_status kvb_engine_cancel(kvb_engine *e, uint64_t id) {
    seq *s = find_seq(&e->waiting, id);
    seq_list *l = &e->waiting;
    if (!s) {
        s = find_seq(&e->running, id);
        l = &e->running;
    }
    if (!s) return KVB_ERR_NOT_FOUND;
    finish(e, l, s, KVB_FINISH_CANCELLED, KVB_OK);
    return KVB_OK;
}

int kvb_engine_n_live(const kvb_engine *e) { return e->waiting.n + e->running.n; }

struct kvb_block_pool *kvb_engine_pool(kvb_engine *e) { return e->pool; }

void kvb_engine_get_stats(const kvb_engine *e, kvb_engine_stats *out) {
    *out = e->stats;
    out->blocks_total = kvb_block_pool_n_blocks(e->pool);
    out->blocks_free = kvb_prefix_cache_n_available(e->pc);
    out->n_running = e->running.n;
    out->n_waiting = e->waiting.n;
    out->blocks_own = kvb_block_pool_n_own(e->pool);
    out->blocks_borrowed = e->n_borrowed;
}

/* ---------------------------------------------------------------- scheduling */

/* Gives `s` blocks for its first `upto` tokens. KVB_ERR_EXHAUSTED if the pool cannot. */
static kvb_status grow_blocks(kvb_engine *e, seq *s, int upto) {
    int need = KVB_DIV_CEIL(upto, e->o.block_size);
    while (s->bt.n < need) {
        int32_t id;
        KVB_TRY(kvb_prefix_cache_alloc(e->pc, &id));
        kvb_status st = kvb_block_table_push(&s->bt, id);
        if (st != KVB_OK) {
            kvb_block_pool_unref(e->pool, id);
            return st;
        }
    }
    return KVB_OK;
}

/* Blocks `s` needs at most over its life (prompt + max_tokens). */
static int64_t seq_need_blocks(const kvb_engine *e, const seq *s) { return KVB_DIV_CEIL((int64_t)s->cap, e->o.block_size); }

/* Preemption by recompute: releases the running sequence's blocks (published ones stay cached) and
 * puts it back in the queue in arrival order with its prompt plus the tokens it generated. */
static void preempt_seq(kvb_engine *e, seq *victim) {
    KVB_LOG_D("preempting request %llu (%d tokens, %d blocks) by recompute", (unsigned long long)victim->id,
              victim->n_tokens, victim->bt.n);
    list_remove(&e->running, victim);
    seq_drop_kv(e, victim);
    list_insert_ordered(&e->waiting, victim);
    e->stats.preemptions++;
}

/* Preempts a running sequence that is not scheduled yet this step, chosen by the planner among
 * `s` and the sequences after it. Returns the victim. */
static seq *preempt_one(kvb_engine *e, seq *s) {
    int n = 0;
    seq *cand[1024];
    for (seq *t = s; t && n < (int)KVB_ARRAY_LEN(cand) && n < e->o.max_seqs; t = t->next) {
        cand[n] = t;
        e->infos[n] = (kvb_seq_info){.id = t->id, .arrival = t->arrival, .n_tokens = t->n_tokens, .n_blocks = t->bt.n};
        n++;
    }
    int v = n - 1; /* no planner: the newest */
    if (e->planner.iface && e->planner.iface->pick_victim) {
        v = e->planner.iface->pick_victim(e->planner.ctx, e->infos, n);
        if (v < 0 || v >= n) v = n - 1;
    }
    seq *victim = cand[v];
    preempt_seq(e, victim);
    return victim;
}

/* The next block `s` would compute (its first unmatched full prompt block) is being computed now by a
 * running sequence at the same place of the same chain: same parent hash, same tokens, not yet
 * published, and that sequence holds all of the block's tokens, so it is in its prefill and publishes
 * the block within a step or two. Admitting `s` now would compute the same KV a second time. */
static int prefix_in_flight(const kvb_engine *e, const seq *s) {
    int bs = e->o.block_size, b = s->n_published;
    if ((int64_t)(b + 1) * bs > s->n_tokens - 1) return 0; /* no full block left to match */
    const int32_t *tk = s->tokens + (size_t)b * bs;
    for (const seq *r = e->running.head; r; r = r->next) {
        if (r->n_published != b || r->last_hash != s->last_hash) continue;
        if (r->n_tokens < (b + 1) * bs || r->n_computed >= (b + 1) * bs) continue;
        if (!memcmp(r->tokens + (size_t)b * bs, tk, (size_t)bs * sizeof *tk)) return 1;
    }
    return 0;
}

/* Picks this step's sequences and their token counts; returns how many. */
static int schedule(kvb_engine *e) {
    int budget = e->o.max_batch_tokens, n = 0;
    /* 1. running sequences, oldest first: decode tokens and the rest of chunked prefills */
    seq *s = e->running.head;
    while (s && budget > 0) {
        seq *next = s->next;
        int q = KVB_MIN(s->n_tokens - s->n_computed, budget);
        int got = 0;
        while (!got) {
            if (grow_blocks(e, s, s->n_computed + q) == KVB_OK) {
                got = 1;
            } else {
                seq *victim = preempt_one(e, s);
                if (victim == s) break;
                next = s->next; /* the victim may have been s's successor */
            }
        }
        if (got) {
            s->q_len = q;
            e->sched[n++] = s;
            budget -= q;
        }
        s = next;
    }
    /* 2. waiting sequences in arrival order while the budget and the pool allow (FCFS: stop at the
     *    first that does not fit, preempting nobody for it). One that needs more blocks than the pool
     *    holds now (lent out or detached) waits until grow/attach: admitted, it could only preempt
     *    itself over and over. */
    e->starved = 0;
    seq *next_waiting;
    for (s = e->waiting.head; s && budget > 0 && e->running.n < e->o.max_seqs; s = next_waiting) {
        next_waiting = s->next;
        if (seq_need_blocks(e, s) > kvb_block_pool_n_blocks(e->pool)) {
            e->starved = 1;
            break;
        }
        int hit = 0;
        if (e->o.enable_prefix_cache && s->n_computed == 0) {
            /* reuse full cached blocks, leaving at least one token to compute for the logits */
            int max_blocks = (s->n_tokens - 1) / e->o.block_size;
            int32_t *ids = NULL;
            if (max_blocks > 0 && kvb_malloc((size_t)max_blocks * sizeof *ids, (void **)&ids) == KVB_OK) {
                int got = kvb_prefix_cache_match(e->pc, s->tokens, s->n_tokens, max_blocks, ids, &s->last_hash);
                int pushed = 0;
                while (pushed < got && kvb_block_table_push(&s->bt, ids[pushed]) == KVB_OK) pushed++;
                for (int i = pushed; i < got; i++) kvb_block_pool_unref(e->pool, ids[i]);
                if (pushed < got) { /* out of memory for the table: use what fits, recompute the rest */
                    seq_drop_kv(e, s);
                    pushed = 0;
                }
                free(ids);
                s->n_published = pushed;
                if (e->ht_pc && pushed == got) host_tier_load(e, s, max_blocks);
                s->n_computed = hit = s->n_published * e->o.block_size;
            }
            if (prefix_in_flight(e, s)) { /* wait a step or two and hit the cache instead */
                seq_drop_kv(e, s);
                e->stats.deferred++;
                continue;
            }
        }
        int q = KVB_MIN(s->n_tokens - s->n_computed, budget);
        if (grow_blocks(e, s, s->n_computed + q) != KVB_OK) {
            seq_drop_kv(e, s);
            e->starved = 1;
            break;
        }
        e->stats.prefix_hit_tokens += (uint64_t)hit;
        list_remove(&e->waiting, s);
        list_insert_ordered(&e->running, s);
        s->q_len = q;
        e->sched[n++] = s;
        budget -= q;
    }
    return n;
}

/* ---------------------------------------------------------------- execution */

static kvb_status ensure_blk_cap(kvb_engine *e, int n) {
    if (n <= e->blk_cap) return KVB_OK;
    int cap = KVB_MAX(n, e->blk_cap * 2);
    KVB_TRY(kvb_realloc_array((void **)&e->blk_base, (size_t)cap, sizeof(void *)));
    KVB_TRY(kvb_realloc_array((void **)&e->blk_layer, (size_t)cap, sizeof(void *)));
    KVB_TRY(kvb_realloc_array((void **)&e->blk_id, (size_t)cap, sizeof *e->blk_id));
    if (e->o.lsc_stream) KVB_TRY(kvb_realloc_array((void **)&e->lsc.entry_slot, (size_t)cap, sizeof(int32_t)));
    e->blk_cap = cap;
    return KVB_OK;
}

/* Offers every newly completed full block of `s` to the prefix cache. */
static void publish_full_blocks(kvb_engine *e, seq *s) {
    int bs = e->o.block_size;
    while ((s->n_published + 1) * bs <= s->n_computed) {
        int b = s->n_published;
        if (kvb_prefix_cache_publish(e->pc, s->last_hash, s->tokens + (size_t)b * bs, s->bt.ids[b], &s->last_hash) !=
            KVB_OK)
            break;
        s->n_published++;
    }
}

static int is_stop(const seq *s, int32_t tok) {
    for (int i = 0; i < s->n_stop; i++)
        if (s->stop[i] == tok) return 1;
    return 0;
}

/* LSC streaming: gives every borrowed block of the step a slot (a block shared by several sequences
 * gets one), records where its layer slices live and which rows the step writes into it. Returns
 * the number of slots used (0: nothing to stream). */
static int lsc_prepare(kvb_engine *e, int n_sched, int n_blk) {
    lsc *c = &e->lsc;
    int cap = kvb_block_pool_capacity(e->pool), bs = e->o.block_size, n = 0;
    for (int j = 0; j < n_blk; j++) {
        int32_t id = e->blk_id[j];
        c->entry_slot[j] = -1;
        if (!kvb_block_pool_is_attached(e->pool, id)) continue;
        int32_t *k = &c->slot_of[id - cap];
        if (*k < 0) {
            /* every slot is a distinct attached block and the LSC has one per attached block */
            assert(n < c->n_slots);
            *k = n++;
            c->src[*k] = e->blk_base[j];
            c->dirty_lo[*k] = bs;
            c->dirty_hi[*k] = 0;
        }
        c->entry_slot[j] = *k;
    }
    for (int i = 0; i < n_sched && n > 0; i++) {
        const kvb_attn_seq *as = &e->b_seqs[i];
        int p0 = as->ctx_len - as->q_len, p1 = as->ctx_len; /* positions written this step */
        for (int bj = p0 / bs; bj <= (p1 - 1) / bs; bj++) {
            int k = c->entry_slot[as->blk_first + bj];
            if (k < 0) continue;
            c->dirty_lo[k] = KVB_MIN(c->dirty_lo[k], KVB_MAX(p0 - bj * bs, 0));
            c->dirty_hi[k] = KVB_MAX(c->dirty_hi[k], KVB_MIN(p1 - bj * bs, bs));
        }
    }
    c->n_used = n;
    return n;
}

/* Forgets the step's slot assignment (the slot map is reused by the next step). */
static void lsc_finish(kvb_engine *e, int n_blk) {
    int cap = kvb_block_pool_capacity(e->pool);
    for (int j = 0; j < n_blk; j++)
        if (e->lsc.entry_slot[j] >= 0) e->lsc.slot_of[e->blk_id[j] - cap] = -1;
    e->lsc.n_used = 0;
}

kvb_status kvb_engine_step(kvb_engine *e) {
    int n_sched = schedule(e);
    if (n_sched == 0) return KVB_OK;
    const kvb_model_config *c = kvb_model_cfg(e->m);
    int n_tok = 0, n_blk = 0, n_logits = 0, stream = 0;
    for (int i = 0; i < n_sched; i++) n_blk += e->sched[i]->bt.n;
    kvb_status st;
    KVB_TRY_GOTO(ensure_blk_cap(e, n_blk), fail);
    n_blk = 0;
    for (int i = 0; i < n_sched; i++) {
        seq *s = e->sched[i];
        kvb_attn_seq *as = &e->b_seqs[i];
        as->q_start = n_tok;
        as->q_len = s->q_len;
        as->ctx_len = s->n_computed + s->q_len;
        as->n_blocks = KVB_DIV_CEIL(as->ctx_len, e->o.block_size);
        as->blk_first = n_blk;
        for (int j = 0; j < as->n_blocks; j++) {
            e->blk_id[n_blk] = s->bt.ids[j];
            e->blk_base[n_blk++] = kvb_block_pool_block(e->pool, s->bt.ids[j]);
        }
        for (int t = 0; t < s->q_len; t++) {
            e->b_tokens[n_tok] = s->tokens[s->n_computed + t];
            e->b_pos[n_tok] = s->n_computed + t;
            n_tok++;
        }
        if (as->ctx_len == s->n_tokens) e->b_logit_rows[n_logits++] = n_tok - 1;
    }
    kvb_batch b = {
        .n_tokens = n_tok,
        .tokens = e->b_tokens,
        .pos = e->b_pos,
        .attn = {.geom = &e->geom, .n_seqs = n_sched, .seqs = e->b_seqs, .layer_blocks = e->blk_layer},
        .n_logits = n_logits,
        .logit_rows = e->b_logit_rows,
    };
    /* Residency: own and borrowed blocks are read in place (block base + layer offset), except that
     * with lsc_stream the borrowed ones are read from their LSC slot of the layer's parity. */
    size_t layer_bytes = kvb_kv_layer_bytes(&e->geom);
    lsc *ls = &e->lsc;
    if (e->o.lsc_stream && e->n_borrowed > 0) stream = lsc_prepare(e, n_sched, n_blk) > 0;
    if (stream) {
        /* layers 0 and 1 load at once (different buffers), overlapping the embedding; the load of
         * layer l+2 is posted after the store of layer l, which used the same buffer */
        lsc_begin(ls);
        for (int l = 0; l < KVB_MIN(2, c->n_layers); l++) {
            ls->ticket[l] = lsc_post(ls, LSC_LOAD, l);
            e->stats.lsc_loads += (uint64_t)ls->n_used;
        }
    }
    KVB_TRY_GOTO(kvb_forward_begin(e->fw, &b), fail_lsc);
    for (int l = 0; l < c->n_layers; l++) {
        for (int j = 0; j < n_blk; j++) e->blk_layer[j] = (char *)e->blk_base[j] + (size_t)l * layer_bytes;
        if (stream) {
            KVB_TRY_GOTO(lsc_wait(ls, ls->ticket[l]), fail_lsc);
            for (int j = 0; j < n_blk; j++)
                if (ls->entry_slot[j] >= 0) e->blk_layer[j] = lsc_buf(ls, ls->entry_slot[j], l & 1);
        }
        KVB_TRY_GOTO(kvb_forward_layer(e->fw, l), fail_lsc);
        if (stream) {
            /* the layer's kernels are done with its buffers once the backend is idle */
            KVB_TRY_GOTO(kvb_model_backend(e->m)->iface->sync(kvb_model_backend(e->m)->ctx), fail_lsc);
            lsc_post(ls, LSC_STORE, l);
            for (int k = 0; k < ls->n_used; k++) e->stats.lsc_stores += ls->dirty_lo[k] < ls->dirty_hi[k];
            if (l + 2 < c->n_layers) {
                ls->ticket[l + 2] = lsc_post(ls, LSC_LOAD, l + 2);
                e->stats.lsc_loads += (uint64_t)ls->n_used;
            }
        }
    }
    if (stream) {
        KVB_TRY_GOTO(lsc_wait(ls, ls->posted), fail_lsc); /* every store is back before the step ends */
        lsc_finish(e, n_blk);
        stream = 0;
    }
    KVB_TRY_GOTO(kvb_forward_end(e->fw, e->logits), fail);
    e->stats.steps++;

    uint64_t now = kvb_wall_ns();
    int li = 0;
    for (int i = 0; i < n_sched; i++) {
        seq *s = e->sched[i];
        int decode = s->q_len == 1 && s->n_generated > 0 && s->n_computed == s->n_tokens - 1;
        if (!decode) e->stats.prompt_tokens += (uint64_t)s->q_len;
        s->n_computed += s->q_len;
        if (e->o.enable_prefix_cache) publish_full_blocks(e, s);
        if (s->n_computed != s->n_tokens) continue; /* prefill chunk: no token yet */
        const float *lg = e->logits + (size_t)li++ * c->vocab;
        int32_t tok = kvb_sample(&s->samp, &s->rng, lg, c->vocab, e->sample_scratch);
        int index = s->n_generated;
        if (e->ev.on_logits) e->ev.on_logits(e->ev.ud, s->id, index, lg, c->vocab);
        s->tokens[s->n_tokens++] = tok;
        s->n_generated++;
        e->stats.generated_tokens++;
        if (e->ev.on_token) e->ev.on_token(e->ev.ud, s->id, index, tok, now);
        if (is_stop(s, tok)) finish(e, &e->running, s, KVB_FINISH_STOP, KVB_OK);
        else if (s->n_generated >= s->max_tokens) finish(e, &e->running, s, KVB_FINISH_LENGTH, KVB_OK);
    }
    return KVB_OK;
fail_lsc:
    if (stream) {
        (void)lsc_wait(ls, ls->posted); /* no copy may run on after the step */
        lsc_finish(e, n_blk);
    }
fail:
    KVB_LOG_E("engine step failed: %s; failing %d live requests", kvb_status_str(st), kvb_engine_n_live(e));
    while (e->running.head) finish(e, &e->running, e->running.head, KVB_FINISH_ERROR, st);
    while (e->waiting.head) finish(e, &e->waiting, e->waiting.head, KVB_FINISH_ERROR, st);
    return st;
}

/* ---------------------------------------------------------------- lending */

int kvb_engine_n_own(const kvb_engine *e) { return kvb_block_pool_n_own(e->pool); }
int kvb_engine_capacity(const kvb_engine *e) { return kvb_block_pool_capacity(e->pool); }

int kvb_engine_free_tail(const kvb_engine *e) {
    int n = 0;
    /* refcount 0 is free or an unreferenced prefix-cache entry (the only holder of such blocks) */
    for (int32_t i = kvb_block_pool_n_own(e->pool) - 1; i >= 0 && kvb_block_pool_refcount(e->pool, i) == 0; i--) n++;
    return n;
}

kvb_status kvb_engine_shrink(kvb_engine *e, int n_own_new) {
    int n_own = kvb_block_pool_n_own(e->pool);
    if (n_own_new < 0 || n_own_new > n_own) {
        KVB_LOG_E("engine: shrink to %d own blocks, %d owned now", n_own_new, n_own);
        return KVB_ERR_INVALID;
    }
    for (int32_t i = n_own_new; i < n_own; i++) {
        if (kvb_block_pool_refcount(e->pool, i) > 0) {
            KVB_LOG_D("engine: cannot shrink to %d own blocks: block %d is in use", n_own_new, (int)i);
            return KVB_ERR_STATE;
        }
    }
    kvb_prefix_cache_drop_tail(e->pc, n_own_new);
    kvb_status st = kvb_block_pool_resize(e->pool, n_own_new);
    assert(st == KVB_OK); /* every block of the tail is free now */
    return st;
}

kvb_status kvb_engine_grow(kvb_engine *e, int n_own_new) {
    int n_own = kvb_block_pool_n_own(e->pool), cap = kvb_block_pool_capacity(e->pool);
    if (n_own_new < n_own || n_own_new > cap) {
        KVB_LOG_E("engine: grow to %d own blocks, %d owned now, capacity %d", n_own_new, n_own, cap);
        return KVB_ERR_INVALID;
    }
    KVB_TRY(kvb_block_pool_resize(e->pool, n_own_new));
    e->starved = 0;
    return KVB_OK;
}

int64_t kvb_engine_max_request_tokens(const kvb_engine *e) {
    int64_t most = 0;
    const seq_list *lists[] = {&e->waiting, &e->running};
    for (int i = 0; i < 2; i++)
        for (const seq *s = lists[i]->head; s; s = s->next) most = KVB_MAX(most, (int64_t)s->cap);
    return most;
}

int kvb_engine_starved(const kvb_engine *e) {
    if (e->starved) return 1;
    return e->waiting.head && seq_need_blocks(e, e->waiting.head) > kvb_block_pool_n_blocks(e->pool);
}

static int find_loan(const kvb_engine *e, uint64_t tag) {
    for (int i = 0; i < e->n_loans; i++)
        if (e->loans[i].tag == tag) return i;
    return -1;
}

kvb_status kvb_engine_attach(kvb_engine *e, uint64_t tag, void *mem, size_t bytes, int n_blocks) {
    size_t bb = kvb_kv_block_bytes(&e->geom);
    if (!mem || n_blocks < 1 || bytes / bb < (size_t)n_blocks) {
        KVB_LOG_E("engine: attach of loan %llu: %d blocks of %zu bytes need memory of at least that size (%zu)",
                  (unsigned long long)tag, n_blocks, bb, bytes);
        return KVB_ERR_INVALID;
    }
    if (find_loan(e, tag) >= 0) {
        KVB_LOG_E("engine: loan %llu is already attached", (unsigned long long)tag);
        return KVB_ERR_INVALID;
    }
    if (n_blocks > INT_MAX - e->n_borrowed) return KVB_ERR_INVALID;
    if (e->n_loans == e->loans_cap) {
        int cap = e->loans_cap ? 2 * e->loans_cap : 4;
        KVB_TRY(kvb_realloc_array((void **)&e->loans, (size_t)cap, sizeof *e->loans));
        e->loans_cap = cap;
    }
    int32_t first;
    KVB_TRY(kvb_block_pool_attach(e->pool, mem, n_blocks, &first));
    if (e->o.lsc_stream) {
        kvb_status st = lsc_resize(e, e->n_borrowed + n_blocks);
        if (st != KVB_OK) {
            KVB_LOG_E("engine: no memory for the LSC of %d borrowed blocks", e->n_borrowed + n_blocks);
            kvb_status st2 = kvb_block_pool_detach(e->pool, first, n_blocks);
            assert(st2 == KVB_OK); /* its blocks are all free: nothing ran on them */
            (void)st2;
            return st;
        }
    }
    e->loans[e->n_loans++] = (loan){.tag = tag, .first = first, .n = n_blocks};
    e->n_borrowed += n_blocks;
    e->starved = 0;
    KVB_LOG_D("engine: loan %llu attached as blocks [%d, %d)", (unsigned long long)tag, (int)first,
              (int)first + n_blocks);
    return KVB_OK;
}

int kvb_engine_n_borrowed(const kvb_engine *e) { return e->n_borrowed; }

int kvb_engine_loans(const kvb_engine *e, uint64_t *tags, int *n_blocks, int max) {
    for (int i = 0; i < e->n_loans && i < max; i++) {
        if (tags) tags[i] = e->loans[i].tag;
        if (n_blocks) n_blocks[i] = e->loans[i].n;
    }
    return e->n_loans;
}

/* State of one detach: the range [first, first + n) leaving the pool. */
typedef struct detach_ctx {
    int32_t first;
    int n;
    uint8_t *taken;      /* [n] 1 once the detach holds the block (its only reference) */
    int32_t *moved_to;   /* [n] new id of a moved block (the detach holds one reference), -1 */
    int32_t *scratch;    /* [n] range ids of a sequence being preempted */
    kvb_detach_stats st;
} detach_ctx;

static int in_range(const detach_ctx *d, int32_t id) { return id >= d->first && id - d->first < d->n; }

/* Takes block `id` of the range out of circulation once nothing references it: a prefix-cache
 * entry there is dropped, then the detach holds the block so that no allocation can hand it out. */
static void fence_block(kvb_engine *e, detach_ctx *d, int32_t id) {
    int off = id - d->first;
    if (d->taken[off] || kvb_block_pool_refcount(e->pool, id) > 0) return;
    if (!kvb_block_pool_is_free(e->pool, id)) d->st.dropped += kvb_prefix_cache_drop_range(e->pc, id, 1);
    kvb_status st = kvb_block_pool_take(e->pool, id);
    assert(st == KVB_OK); /* refcount 0 and no cache entry: on the free list */
    (void)st;
    d->taken[off] = 1;
}

static int seq_uses_range(const seq *s, const detach_ctx *d) {
    for (int j = 0; j < s->bt.n; j++)
        if (in_range(d, s->bt.ids[j])) return 1;
    return 0;
}

/* Preempts `s` by recompute and fences the range blocks it released. */
static void preempt_in_range(kvb_engine *e, detach_ctx *d, seq *s) {
    int m = 0;
    for (int j = 0; j < s->bt.n; j++)
        if (in_range(d, s->bt.ids[j])) d->scratch[m++] = s->bt.ids[j]; /* a table holds a block once */
    preempt_seq(e, s);
    for (int i = 0; i < m; i++) fence_block(e, d, d->scratch[i]);
    d->st.preempted++;
}

/* The newest running sequence that still references the range (NULL if none). */
static seq *newest_on_range(kvb_engine *e, const detach_ctx *d) {
    for (seq *s = e->running.tail; s; s = s->prev)
        if (seq_uses_range(s, d)) return s;
    return NULL;
}

/* Moves every range block of `s` to a block outside the range (or preempts `s`, or newer sequences
 * to make room). Returns the running sequence to visit next. */
static seq *move_seq(kvb_engine *e, detach_ctx *d, seq *s) {
    kvb_backend *be = kvb_model_backend(e->m);
    size_t bb = kvb_kv_block_bytes(&e->geom);
    for (int j = 0; j < s->bt.n; j++) {
        int32_t id = s->bt.ids[j];
        if (!in_range(d, id)) continue;
        int off = id - d->first;
        if (d->moved_to[off] < 0) {
            int32_t nid;
            /* the range's idle blocks are fenced, so whatever comes back lies outside it */
            while (kvb_prefix_cache_alloc(e->pc, &nid) != KVB_OK) {
                seq *victim = newest_on_range(e, d);
                assert(victim); /* s itself is still on the range */
                if (victim == s) {
                    seq *next = s->next;
                    preempt_in_range(e, d, s);
                    return next;
                }
                preempt_in_range(e, d, victim);
            }
            assert(!in_range(d, nid));
            kvb_status st = be->iface->copy(be->ctx, kvb_block_pool_block(e->pool, nid),
                                            kvb_block_pool_block(e->pool, id), bb);
            if (st != KVB_OK) {
                KVB_LOG_W("engine: copying block %d failed (%s); preempting request %llu instead", (int)id,
                          kvb_status_str(st), (unsigned long long)s->id);
                kvb_block_pool_unref(e->pool, nid);
                seq *next = s->next;
                preempt_in_range(e, d, s);
                return next;
            }
            /* keep the prefix-cache entry on the copy; if that fails (no memory for the cache's slot
             * table) the entry stays on the old block and is dropped with it */
            if (kvb_prefix_cache_is_cached(e->pc, id)) (void)kvb_prefix_cache_move(e->pc, id, nid);
            d->moved_to[off] = nid; /* the allocation's reference is the detach's until the end */
            d->st.moved++;
        }
        kvb_block_pool_ref(e->pool, d->moved_to[off]);
        s->bt.ids[j] = d->moved_to[off];
        kvb_block_pool_unref(e->pool, id);
        fence_block(e, d, id);
    }
    return s->next;
}

kvb_status kvb_engine_detach(kvb_engine *e, uint64_t tag, int lender_dead, kvb_detach_stats *out) {
    if (out) *out = (kvb_detach_stats){0};
    int li = find_loan(e, tag);
    if (li < 0) return KVB_ERR_NOT_FOUND;
    detach_ctx d = {.first = e->loans[li].first, .n = e->loans[li].n};
    kvb_status st;
    KVB_TRY_GOTO(kvb_calloc((size_t)d.n, sizeof *d.taken, (void **)&d.taken), fail_scratch);
    KVB_TRY_GOTO(kvb_malloc((size_t)d.n * sizeof *d.moved_to, (void **)&d.moved_to), fail_scratch);
    KVB_TRY_GOTO(kvb_malloc((size_t)d.n * sizeof *d.scratch, (void **)&d.scratch), fail_scratch);
    for (int i = 0; i < d.n; i++) d.moved_to[i] = -1;
    int can_move = !lender_dead && kvb_model_backend(e->m)->iface->copy;

    /* 1. idle blocks (free, or cached and unreferenced) leave circulation */
    for (int i = 0; i < d.n; i++) fence_block(e, &d, d.first + i);
    /* 2. live blocks: only running sequences hold blocks (a waiting one holds none) */
    for (seq *s = e->running.head; s;) {
        if (!seq_uses_range(s, &d)) {
            s = s->next;
        } else if (!can_move) {
            seq *next = s->next;
            preempt_in_range(e, &d, s); /* nothing is read from the range */
            s = next;
        } else {
            s = move_seq(e, &d, s);
        }
    }
    /* 3. the copies keep only their sequences' references; the range is held by the detach alone */
    for (int i = 0; i < d.n; i++)
        if (d.moved_to[i] >= 0) kvb_block_pool_unref(e->pool, d.moved_to[i]);
    for (int i = 0; i < d.n; i++) {
        fence_block(e, &d, d.first + i);
        assert(d.taken[i] && kvb_block_pool_refcount(e->pool, d.first + i) == 1);
        kvb_block_pool_unref(e->pool, d.first + i); /* no cache entry: back to the free list */
    }
    st = kvb_block_pool_detach(e->pool, d.first, d.n);
    assert(st == KVB_OK);
    memmove(&e->loans[li], &e->loans[li + 1], (size_t)(e->n_loans - li - 1) * sizeof *e->loans);
    e->n_loans--;
    e->n_borrowed -= d.n;
    if (e->o.lsc_stream && lsc_resize(e, e->n_borrowed) != KVB_OK)
        KVB_LOG_W("engine: could not shrink the LSC; it keeps %d slots", e->lsc.n_slots);
    KVB_LOG_D("engine: loan %llu detached%s: %d blocks moved, %d cached dropped, %d requests preempted",
              (unsigned long long)tag, lender_dead ? " (lender dead)" : "", d.st.moved, d.st.dropped,
              d.st.preempted);
    if (out) *out = d.st;
fail_scratch:
    free(d.taken);
    free(d.moved_to);
    free(d.scratch);
    return st;
}
