/* kvbank — the engine: FCFS continuous batching with chunked prefill, prefix caching, preemption by
 * recompute, and the step executor that feeds the layer-stepped forward pass. */
#include "common/sched/engine.h"

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
    kvb_seq_info *infos;     /* [max_seqs] */
    float *logits;           /* [max_seqs][vocab] */
    float *sample_scratch;   /* [2*vocab] */
    char last_error[256];    /* why the last kvb_engine_add failed */
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

/* ---------------------------------------------------------------- create / destroy */

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
    if (KVB_DIV_CEIL(total, e->o.block_size) > kvb_block_pool_n_blocks(e->pool))
        return reject(e, r->id, "%lld tokens can never fit in %d KV blocks of %d", (long long)total,
                      kvb_block_pool_n_blocks(e->pool), e->o.block_size);
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
    KVB_LOG_D("preempting request %llu (%d tokens, %d blocks) by recompute", (unsigned long long)victim->id,
              victim->n_tokens, victim->bt.n);
    list_remove(&e->running, victim);
    seq_drop_kv(e, victim);
    list_insert_ordered(&e->waiting, victim);
    e->stats.preemptions++;
    return victim;
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
     *    first that does not fit, preempting nobody for it) */
    while (e->waiting.head && budget > 0 && e->running.n < e->o.max_seqs) {
        s = e->waiting.head;
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
                s->n_computed = hit = pushed * e->o.block_size;
            }
        }
        int q = KVB_MIN(s->n_tokens - s->n_computed, budget);
        if (grow_blocks(e, s, s->n_computed + q) != KVB_OK) {
            seq_drop_kv(e, s);
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

kvb_status kvb_engine_step(kvb_engine *e) {
    int n_sched = schedule(e);
    if (n_sched == 0) return KVB_OK;
    const kvb_model_config *c = kvb_model_cfg(e->m);
    int n_tok = 0, n_blk = 0, n_logits = 0;
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
        for (int j = 0; j < as->n_blocks; j++) e->blk_base[n_blk++] = kvb_block_pool_block(e->pool, s->bt.ids[j]);
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
    /* Residency: every block is local this issue; the layer's slice is block base + layer offset. */
    size_t layer_bytes = kvb_kv_layer_bytes(&e->geom);
    KVB_TRY_GOTO(kvb_forward_begin(e->fw, &b), fail);
    for (int l = 0; l < c->n_layers; l++) {
        for (int j = 0; j < n_blk; j++) e->blk_layer[j] = (char *)e->blk_base[j] + (size_t)l * layer_bytes;
        KVB_TRY_GOTO(kvb_forward_layer(e->fw, l), fail);
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
fail:
    KVB_LOG_E("engine step failed: %s; failing %d live requests", kvb_status_str(st), kvb_engine_n_live(e));
    while (e->running.head) finish(e, &e->running, e->running.head, KVB_FINISH_ERROR, st);
    while (e->waiting.head) finish(e, &e->waiting, e->waiting.head, KVB_FINISH_ERROR, st);
    return st;
}
