/* kvbank — eLLM elastic memory (ellm-elastic-memory.txt §4-6) and its baselines as planners: the
 * engine's view goes into the core (ellm_elastic_core.c), the iteration's memory is applied there, and
 * the batch comes back as plan operations placed in each request's KV slot. */
#include "common/policy/ellm_elastic.h"

#include <math.h>
#include <string.h>

#include "common/kv/block_pool.h"
#include "common/mem/elastic_vm.h"
#include "common/model/model.h"

typedef struct ee {
    kvb_ee_mode mode;
    const char *name;
    /* parameters */
    double budget_mb, buffer_mb, slo_ttft_ms, slo_tpot_ms;
    int64_t chunk_tokens, slots, theta, intra, inter, alpha, window, misses, premap, premap_max, mapper, prefill_chunk;
    int chunk_given; /* chunk_tokens came from the parameters: kept as it is, or refused */
    /* set up at SETUP */
    kvb_model_config mc;
    kvb_kv_geom geom;
    size_t act_es;        /* bytes per activation element */
    int blocks_per_slot;
    int act_start;
    int max_model_len;
    kvb_mem *mem;         /* borrowed: the model backend's */
    kvb_elastic_vm *vm;
    kvb_ee_core *core;
    size_t chunk_bytes;
    kvb_mem_fence fence;
    /* per step */
    kvb_ee_step step;
    int step_open;        /* planned, its completion not yet recorded */
    uint64_t issued;      /* steps planned */
    uint64_t completed;   /* steps completed (the fence) */
    kvb_ee_req *reqs;     /* [cap_reqs] */
    int cap_reqs;
} ee;

/* ---------------------------------------------------------------- the activation model */

/* The forward pass's buffers for a step of n rows and `logits` logit rows (common/model/forward.c):
 * x, h [n][hidden]; q, att [n][n_heads * head_dim]; k, v [n][n_kv_heads * head_dim]; gate, up
 * [n][intermediate]; rows [logits][hidden]; logits [logits][vocab]; each rounded to 256 bytes (mem.h). */
static int act_sizes(const ee *p, int64_t n, int logits, size_t sizes[10]) {
    const kvb_model_config *c = &p->mc;
    size_t es = p->act_es, q = (size_t)c->n_heads * c->head_dim, kv = (size_t)c->n_kv_heads * c->head_dim;
    size_t nn = (size_t)n;
    size_t all[10] = {nn * c->hidden, nn * c->hidden, nn * q, nn * kv, nn * kv, nn * q, nn * c->intermediate,
                      nn * c->intermediate, (size_t)logits * c->hidden, (size_t)logits * c->vocab};
    for (int i = 0; i < 10; i++) sizes[i] = all[i] * es;
    return logits > 0 ? 10 : 8;
}


/* Chunks of chunk_bytes the forward pass's buffers of a step take, with stage_bytes of offload staging. */
static int64_t act_chunks_of(ee *p, size_t chunk_bytes, int64_t n_tokens, int n_seqs, int64_t stage_bytes) {
    if (n_tokens <= 0) return 0;
    size_t sizes[11];
    int n = act_sizes(p, n_tokens, n_seqs, sizes);
    if (stage_bytes > 0) sizes[n++] = (size_t)stage_bytes;
    return kvb_act_span_chunks(sizes, n, 256, chunk_bytes);
}

/* Whether a request of `len` tokens can ever be served by `n_chunks` chunks: its KV and θ beside the
 * activations of its own prefill (ellm-elastic) or beside the static reserve (the baselines). The same
 * rule as the core's configuration check. */
static int len_fits(ee *p, size_t chunk, int64_t n_chunks, int theta, int len, int max_seqs) {
    int64_t kv = KVB_DIV_CEIL(len, p->chunk_tokens); /* a slot is whole chunks */
    /* a prefill is at most `len` tokens, however many a slot's chunks hold (a chunk can hold more tokens
     * than the model's length) */
    if (p->mode == KVB_EE_MODE_ELASTIC && p->intra)
        return kv + act_chunks_of(p, chunk, len, 1, 0) + theta <= n_chunks;
    int64_t step = p->mode == KVB_EE_MODE_CHUNKED ? p->prefill_chunk : len;
    return kv + theta + act_chunks_of(p, chunk, step, (int)KVB_MIN(max_seqs, step), 0) <= n_chunks;
}

static int64_t act_chunks(void *ud, int64_t n_tokens, int n_seqs, int64_t stage_bytes) {
    ee *p = ud;
    return act_chunks_of(p, p->chunk_bytes, n_tokens, n_seqs, stage_bytes);
}

/* ---------------------------------------------------------------- the forward pass's allocator */

/* Each step's activation buffers come from the activation pool (common/mem/act_pool.h): a block
 * freed at the step's end stays mapped (idle) until GC gives its chunks to the KV side, which happens
 * only in a later plan, after the step's fence. */
static kvb_status act_alloc(void *ctx, size_t bytes, void **out) {
    ee *p = ctx;
    uintptr_t a;
    KVB_TRY(kvb_ee_core_act_alloc(p->core, bytes, &a));
    *out = (void *)a;
    return KVB_OK;
}

static void act_free(void *ctx, void *ptr) {
    if (ptr) kvb_ee_core_act_free(((ee *)ctx)->core, (uintptr_t)ptr);
}

static const kvb_mem_allocator_i act_iface = {.alloc = act_alloc, .free = act_free};

/* ---------------------------------------------------------------- the fence */

static int fence_passed(void *ud, uint64_t ticket) { return ticket <= ((ee *)ud)->completed; }

/* ---------------------------------------------------------------- setup */

static int64_t gcd64(int64_t a, int64_t b) {
    while (b) {
        int64_t t = a % b;
        a = b;
        b = t;
    }
    return a;
}

static kvb_status ee_setup(ee *p, const kvb_pool_event *ev, const kvb_view *v, kvb_pool_plan *out) {
    if (!ev->model) return KVB_ERR_INVALID;
    p->mc = *kvb_model_cfg(ev->model);
    p->geom = *v->geom;
    kvb_backend *be = kvb_model_backend(ev->model);
    p->act_es = kvb_dtype_size(be->iface->act_dtype);
    int bs = p->geom.block_size;
    size_t block_bytes = kvb_kv_block_bytes(&p->geom), tok_bytes = block_bytes / (size_t)bs;
    p->mem = be->mem; /* the device's memory: chunks and reservations come from it */
    size_t gran;
    KVB_TRY(kvb_mem_granularity(p->mem, &gran));
    /* A chunk is whole blocks and whole mapping granules (§4.1: tensor slots align with the physical
     * chunks): the smallest such chunk is k tokens. */
    int64_t need = (int64_t)(gran / (size_t)gcd64((int64_t)gran, (int64_t)tok_bytes));
    int64_t k = need / gcd64(need, bs) * bs;
    if (!p->chunk_given) {
        /* the default: 16 tokens rounded up to k (one 2 MiB granule at Llama-3-8B's bf16 shape, where 16
         * tokens are exactly one; a small model's chunk is then many tokens) */
        p->chunk_tokens = KVB_DIV_CEIL(p->chunk_tokens, k) * k;
        if (p->chunk_tokens > (1 << 20)) {
            KVB_LOG_E("%s: the smallest chunk of whole blocks and %zu-byte granules is %lld tokens", p->name, gran,
                      (long long)p->chunk_tokens);
            return KVB_ERR_INVALID;
        }
    }
    if (p->chunk_tokens % bs) {
        KVB_LOG_E("%s: chunk_tokens %lld must be a multiple of the block size %d", p->name, (long long)p->chunk_tokens, bs);
        return KVB_ERR_INVALID;
    }
    size_t chunk = (size_t)p->chunk_tokens * tok_bytes;
    if (chunk % gran) {
        KVB_LOG_E("%s: a chunk of %lld tokens is %zu bytes, not a multiple of the %zu-byte mapping granularity of %s "
                  "memory; chunk_tokens must be a multiple of %lld (or left out: the default is derived)",
                  p->name, (long long)p->chunk_tokens, chunk, gran, kvb_mem_kind(p->mem), (long long)k);
        return KVB_ERR_INVALID;
    }
    /* The budget and the longest request it can serve. Default budget: the engine's KV blocks plus the
     * static split's activation reserve for a step of the longest request those blocks hold. */
    int max_seqs = v->max_seqs, ct = (int)p->chunk_tokens;
    int64_t kv_chunks = KVB_DIV_CEIL((int64_t)v->pool.n_blocks * (int64_t)block_bytes, (int64_t)chunk);
    int64_t n_chunks;
    if (p->budget_mb > 0) {
        n_chunks = (int64_t)(p->budget_mb * 1048576.0 / (double)chunk);
    } else {
        /* the KV blocks hold requests of up to len tokens; θ (1%) comes on top */
        int64_t len = KVB_MIN((int64_t)v->max_model_len, kv_chunks * ct);
        int64_t step = p->mode == KVB_EE_MODE_CHUNKED ? p->prefill_chunk : len;
        n_chunks = kv_chunks + act_chunks_of(p, chunk, step, (int)KVB_MIN(max_seqs, step), 0);
        n_chunks += (int64_t)ceil(0.01 * (double)n_chunks) + 1;
    }
    if (n_chunks < 1 || n_chunks > INT32_MAX / 2) {
        KVB_LOG_E("%s: a budget of %.3f MiB makes %lld chunks of %zu bytes", p->name,
                  (double)n_chunks * (double)chunk / 1048576.0, (long long)n_chunks, chunk);
        return KVB_ERR_INVALID;
    }
    int theta = p->theta >= 0 ? (int)p->theta : (int)ceil(0.01 * (double)n_chunks);
    /* the longest request (prompt + output) the budget serves, up to the model's length */
    int lo = 0, hi = v->max_model_len;
    while (lo < hi) {
        int len = lo + (hi - lo + 1) / 2;
        if (len_fits(p, chunk, n_chunks, theta, len, max_seqs)) lo = len;
        else hi = len - 1;
    }
    int max_len = lo;
    if (max_len < 1) {
        KVB_LOG_E("%s: %lld chunks of %zu bytes cannot serve a request of even one token (θ %d)", p->name,
                  (long long)n_chunks, chunk, theta);
        return KVB_ERR_INVALID;
    }
    int slot_chunks = (int)KVB_DIV_CEIL(max_len, p->chunk_tokens);
    int n_slots = p->slots > 0 ? (int)p->slots : v->max_seqs;
    int max_tokens = p->mode == KVB_EE_MODE_CHUNKED ? (int)p->prefill_chunk : max_len;
    int64_t reserve = act_chunks_of(p, chunk, max_tokens, KVB_MIN(max_seqs, max_tokens), 0);
    /* the most staging a step's offloaded prefills take (two single-layer slices per block, §4.3.2) */
    int64_t stage_max = p->mode == KVB_EE_MODE_ELASTIC && p->inter
                            ? 2 * (int64_t)kvb_kv_layer_bytes(&p->geom) * (KVB_DIV_CEIL(max_tokens, bs) + max_seqs)
                            : 0;
    double budget = (double)n_chunks * (double)chunk;
    int elastic = p->mode == KVB_EE_MODE_ELASTIC;
    p->chunk_bytes = chunk;
    kvb_ee_config c = {
        .mode = p->mode,
        .chunk_bytes = chunk,
        .chunk_tokens = (int)p->chunk_tokens,
        .n_chunks = (int)n_chunks,
        .n_slots = n_slots,
        .slot_chunks = slot_chunks,
        .act_chunks_start = (int)KVB_MIN(reserve, n_chunks),
        .act_seg_chunks = (int)KVB_MAX(act_chunks_of(p, chunk, KVB_MAX(max_tokens, max_seqs), max_seqs, stage_max), 1),
        .act_align = 256,
        .act = act_chunks,
        .act_ud = p,
        .stage_bytes_per_token = (int64_t)(2 * kvb_kv_layer_bytes(&p->geom) / (size_t)bs),
        .stage_round_tokens = bs,
        .max_tokens = max_tokens,
        .max_seqs = max_seqs,
        .theta = theta,
        .intra = elastic && p->intra,
        .inter = elastic && p->inter,
        .buf_max = (int64_t)((p->buffer_mb > 0 ? p->buffer_mb * 1048576.0 : budget) / (double)chunk),
        .buf_start = 1,
        .alpha = (int)p->alpha,
        .win_iters = (int)p->window,
        .win_misses = (int)p->misses,
        .slo_ttft_s = p->slo_ttft_ms / 1e3,
        .slo_tpot_s = p->slo_tpot_ms / 1e3,
        .premap = (int)p->premap,
        .premap_max = p->premap_max > 0 ? (int)p->premap_max : n_slots,
    };
    if (!c.inter) c.buf_max = 0;
    if (c.buf_max * (int64_t)(p->chunk_tokens / bs) > INT32_MAX / 2) {
        KVB_LOG_E("%s: a CPU buffer of %lld chunks is too large", p->name, (long long)c.buf_max);
        return KVB_ERR_INVALID;
    }
    p->act_start = c.act_chunks_start;
    p->max_model_len = max_len;
    p->blocks_per_slot = slot_chunks * (int)(p->chunk_tokens / bs);
    KVB_TRY(kvb_elastic_vm_create(p->mem, chunk, c.n_chunks, (int)p->mapper, &p->vm));
    p->fence = (kvb_mem_fence){.ud = p, .passed = fence_passed};
    kvb_elastic_vm_set_fence(p->vm, &p->fence);
    kvb_vm_ops ops = kvb_elastic_vm_ops(p->vm);
    KVB_TRY(kvb_ee_core_create(&c, &ops, &p->core));
    kvb_slot_pool *sp = kvb_ee_core_slots(p->core);
    out->kv_mem = (void *)kvb_slot_pool_base(sp, 0);
    out->kv_mem_bytes = (size_t)n_slots * (size_t)slot_chunks * chunk;
    out->kv_blocks = n_slots * p->blocks_per_slot;
    out->max_model_len = max_len;
    out->max_batch_tokens = max_tokens;
    out->no_prefix_cache = 1;
    /* the CPU buffer: B_max chunks of host-tier blocks (the core's chunk ids are its own books; the engine's
     * host tier holds the bytes) */
    out->host_tier_blocks = (int)(c.buf_max * (p->chunk_tokens / bs));
    out->act_alloc = (kvb_mem_allocator){.iface = &act_iface, .ctx = p};
    KVB_LOG_I("%s: %d chunks of %zu bytes (%lld tokens) = %.1f MiB for KV and activations, activations start with "
              "%d (a %d-token step), %d slots of %d chunks, θ %d%s%s",
              p->name, c.n_chunks, chunk, (long long)p->chunk_tokens, (double)c.n_chunks * (double)chunk / 1048576.0,
              c.act_chunks_start, max_tokens, n_slots, slot_chunks, c.theta, c.intra ? ", intra" : "",
              c.inter ? ", inter" : "");
    return KVB_OK;
}

static kvb_status ee_plan_pool(void *ctx, const kvb_pool_event *ev, const kvb_view *v, kvb_pool_plan *out) {
    ee *p = ctx;
    if (ev->kind == KVB_POOL_SETUP) {
        if (p->core) return KVB_ERR_STATE;
        return ee_setup(p, ev, v, out);
    }
    if (ev->kind == KVB_POOL_ATTACH) {
        KVB_LOG_E("%s: an ellm-elastic model neither lends nor borrows", p->name);
        return KVB_ERR_UNSUPPORTED;
    }
    return KVB_OK;
}

/* ---------------------------------------------------------------- steps */

/* The step planned last has run (or, without a batch, only its preemptions were applied). */
static kvb_status close_step(ee *p) {
    if (!p->step_open) return KVB_OK;
    p->step_open = 0;
    p->completed = p->issued;
    return kvb_ee_core_done(p->core, &p->step);
}

static kvb_status ee_plan_step(void *ctx, const kvb_view *v, kvb_plan *out) {
    ee *p = ctx;
    if (!p->core) {
        KVB_LOG_E("%s: no SETUP event reached the planner", p->name);
        return KVB_ERR_STATE;
    }
    KVB_TRY(close_step(p));
    KVB_TRY(kvb_elastic_vm_drain(p->vm)); /* last step's pre-maps and unmaps are done */
    if (v->n_reqs > p->cap_reqs) {
        int cap = KVB_MAX(v->n_reqs, 2 * p->cap_reqs);
        KVB_TRY(kvb_realloc_array((void **)&p->reqs, (size_t)cap, sizeof *p->reqs));
        p->cap_reqs = cap;
    }
    for (int i = 0; i < v->n_reqs; i++) {
        const kvb_req_view *r = &v->reqs[i];
        p->reqs[i] = (kvb_ee_req){.id = r->id, .t_arrival_ns = r->t_arrival_ns, .n_tokens = r->n_tokens,
                                  .n_computed = r->n_computed, .n_generated = r->n_generated,
                                  .waiting = r->state == KVB_REQ_WAITING};
    }
    kvb_elastic_vm_set_ticket(p->vm, p->issued); /* what is unmapped now, no step after it reads */
    KVB_TRY(kvb_ee_core_sync(p->core, p->reqs, v->n_reqs, v->now_ns));
    KVB_TRY(kvb_ee_core_plan(p->core, &p->step));
    KVB_TRY(kvb_ee_core_apply(p->core, &p->step));
    /* the next decode's chunks are mapped on the mapper thread while this step computes */
    kvb_elastic_vm_async(p->vm, 1);
    kvb_ee_core_premap(p->core, &p->step);
    kvb_elastic_vm_async(p->vm, 0);
    for (int i = 0; i < p->step.n_items; i++) {
        const kvb_ee_item *it = &p->step.items[i];
        kvb_plan_op op = {.id = it->id, .q_len = it->q_len};
        switch (it->action) {
        case KVB_EE_DO_PREEMPT: op.kind = KVB_OP_PREEMPT; break;
        case KVB_EE_DO_PREFILL: op.kind = it->kv_before == 0 ? KVB_OP_ADMIT : KVB_OP_RUN; break;
        case KVB_EE_DO_DECODE: op.kind = KVB_OP_RUN; break;
        case KVB_EE_DO_OFFLOAD: /* §4.3.2: computed with its KV streamed to the CPU buffer layer by layer */
            op.kind = KVB_OP_ADMIT;
            op.offload = 1;
            break;
        case KVB_EE_DO_FETCH: { /* its KV back into its slot over the host link, then its decode */
            kvb_plan_op in = {.kind = KVB_OP_SWAP_IN, .id = it->id, .placed = 1, .block0 = it->slot * p->blocks_per_slot};
            KVB_TRY(kvb_plan_push_op(out, in));
            op.kind = KVB_OP_RUN;
            break;
        }
        }
        if (it->action != KVB_EE_DO_PREEMPT && it->action != KVB_EE_DO_OFFLOAD) {
            op.placed = 1;
            op.block0 = it->slot * p->blocks_per_slot;
        }
        KVB_TRY(kvb_plan_push_op(out, op));
    }
    p->step_open = 1;
    p->issued++;
    return KVB_OK;
}

static void ee_observe(void *ctx, const kvb_step_report *r) {
    (void)r;
    ee *p = ctx;
    kvb_status st = close_step(p);
    if (st != KVB_OK) KVB_LOG_E("%s: the step's bookkeeping failed: %s", p->name, kvb_status_str(st));
}

static void ee_destroy(void *ctx) {
    ee *p = ctx;
    if (!p) return;
    if (p->vm) (void)kvb_elastic_vm_drain(p->vm);
    kvb_ee_step_free(&p->step);
    kvb_ee_core_destroy(p->core);
    kvb_elastic_vm_destroy(p->vm);
    free(p->reqs);
    free(p);
}

static const kvb_planner_i ee_iface = {
    .name = "ellm-elastic",
    .plan_step = ee_plan_step,
    .plan_pool = ee_plan_pool,
    .observe = ee_observe,
    .destroy = ee_destroy,
};
static const kvb_planner_i static_iface = {
    .name = "static-split",
    .plan_step = ee_plan_step,
    .plan_pool = ee_plan_pool,
    .observe = ee_observe,
    .destroy = ee_destroy,
};
static const kvb_planner_i chunked_iface = {
    .name = "static-split-chunked",
    .plan_step = ee_plan_step,
    .plan_pool = ee_plan_pool,
    .observe = ee_observe,
    .destroy = ee_destroy,
};

int kvb_ee_planner_report(const kvb_planner *pl, kvb_ee_report *out) {
    memset(out, 0, sizeof *out);
    if (!pl || (pl->iface != &ee_iface && pl->iface != &static_iface && pl->iface != &chunked_iface)) return 0;
    const ee *p = pl->ctx;
    if (!p->core) return 0;
    kvb_ee_core_get_stats(p->core, &out->core);
    kvb_elastic_vm_stats vs;
    kvb_elastic_vm_get_stats(p->vm, &vs);
    out->sync_maps = vs.sync_maps;
    out->async_maps = vs.async_maps;
    out->async_unmaps = vs.async_unmaps;
    out->drain_waits = vs.drain_waits;
    out->fence_waits = vs.fence_waits;
    out->vm_sync_ns = vs.sync_ns + vs.drain_wait_ns;
    kvb_mem_vm_stats ms;
    kvb_mem_vm_stats_get(p->mem, &ms);
    out->vm_ns = ms.ns[KVB_MEM_OP_MAP] + ms.ns[KVB_MEM_OP_UNMAP];
    kvb_epool *ep = kvb_ee_core_epool(p->core);
    out->n_chunks = kvb_epool_n_chunks(ep);
    out->chunk_bytes = kvb_epool_chunk_bytes(ep);
    out->act_owned = kvb_epool_n_owned(ep, KVB_EPOOL_ACT);
    out->kv_owned = kvb_epool_n_owned(ep, KVB_EPOOL_KV);
    out->act_start = p->act_start;
    out->max_model_len = p->max_model_len;
    return 1;
}

/* ---------------------------------------------------------------- creation */

static kvb_status ee_create(kvb_ee_mode mode, const kvb_planner_i *iface, int intra, int inter,
                            const kvb_policy_params *params, kvb_planner *out) {
    static const char *const known[] = {"budget_mb", "chunk_tokens", "slots", "theta", "intra", "inter",
                                        "buffer_mb", "slo_ttft_ms", "slo_tpot_ms", "alpha", "window", "misses",
                                        "premap", "premap_max", "mapper", "prefill_chunk", NULL};
    const char *name = iface->name;
    KVB_TRY(kvb_policy_params_check(params, name, known));
    ee *p = NULL;
    KVB_TRY(kvb_calloc(1, sizeof *p, (void **)&p));
    *p = (ee){.mode = mode, .name = name, .chunk_tokens = 16, .slots = 0, .theta = -1, .intra = intra, .inter = inter,
              .alpha = 2, .window = 5, .misses = 3, .premap = 1, .premap_max = 0, .mapper = 1, .prefill_chunk = 512};
    kvb_status st = KVB_OK;
    struct {
        const char *key;
        int64_t *v, min, max;
    } ints[] = {{"chunk_tokens", &p->chunk_tokens, 1, 1 << 20}, {"slots", &p->slots, 1, 1 << 20},
                {"theta", &p->theta, -1, INT32_MAX},            {"intra", &p->intra, 0, 1},
                {"inter", &p->inter, 0, 1},                     {"alpha", &p->alpha, 2, 64},
                {"window", &p->window, 1, KVB_EE_WINDOW_MAX},   {"misses", &p->misses, 1, 1 << 20},
                {"premap", &p->premap, 0, 1},                   {"premap_max", &p->premap_max, 1, INT32_MAX},
                {"mapper", &p->mapper, 0, 1},                   {"prefill_chunk", &p->prefill_chunk, 1, 1 << 24}};
    for (size_t i = 0; i < KVB_ARRAY_LEN(ints) && st == KVB_OK; i++)
        st = kvb_policy_param_i64(params, name, ints[i].key, ints[i].min, ints[i].max, ints[i].v);
    struct {
        const char *key;
        double *v;
    } dbl[] = {{"budget_mb", &p->budget_mb}, {"buffer_mb", &p->buffer_mb}, {"slo_ttft_ms", &p->slo_ttft_ms},
               {"slo_tpot_ms", &p->slo_tpot_ms}};
    for (size_t i = 0; i < KVB_ARRAY_LEN(dbl) && st == KVB_OK; i++)
        st = kvb_policy_param_f64(params, name, dbl[i].key, 0, 1e12, dbl[i].v);
    p->chunk_given = kvb_policy_params_get(params, "chunk_tokens") != NULL;
    if (st == KVB_OK && mode != KVB_EE_MODE_ELASTIC && (kvb_policy_params_get(params, "intra") ||
                                                        kvb_policy_params_get(params, "inter"))) {
        KVB_LOG_E("%s: intra and inter are ellm-elastic's switches", name);
        st = KVB_ERR_INVALID;
    }
    if (st != KVB_OK) {
        free(p);
        return st;
    }
    *out = (kvb_planner){.iface = iface, .ctx = p};
    return KVB_OK;
}

kvb_status kvb_policy_ellm_elastic_create(const kvb_policy_params *params, kvb_planner *out) {
    return ee_create(KVB_EE_MODE_ELASTIC, &ee_iface, 1, 1, params, out);
}

kvb_status kvb_policy_static_split_create(const kvb_policy_params *params, kvb_planner *out) {
    return ee_create(KVB_EE_MODE_ELASTIC, &static_iface, 0, 0, params, out);
}

kvb_status kvb_policy_static_split_chunked_create(const kvb_policy_params *params, kvb_planner *out) {
    return ee_create(KVB_EE_MODE_CHUNKED, &chunked_iface, 0, 0, params, out);
}
