/* kvbank — eLLM elastic memory for one model: requests' KV placement, Alg. 1 planning, memory applied
 * per iteration, Alg. 2 buffer scaling, speculative pre-mapping (ellm-elastic-memory.txt §4-5). */
#include "common/policy/ellm_elastic_core.h"

#include <stdlib.h>
#include <string.h>

enum { R_WAITING = 0, R_RESIDENT = 1, R_OFFLOADED = 2 };

typedef struct ee_req {
    uint64_t id;
    int used;            /* hash entry in use */
    int state;
    int slot;            /* RESIDENT: its KV slot */
    int buf;             /* OFFLOADED: chunks it holds in the CPU buffer (counted in buf_used) */
    int32_t *host;       /* [n_host] CPU-buffer chunks holding its KV (offloaded, or fetched this step) */
    int n_host;
    int kv;              /* tokens whose KV exists (slot or buffer) */
    int n_tokens;
    int n_gen;
    uint64_t arrival;    /* order of first sight */
    uint64_t t_arrival_ns;
    uint64_t t_first_ns; /* first token, 0 before */
    uint32_t mark;
} ee_req;

struct kvb_ee_core {
    kvb_ee_config c;
    kvb_epool *ep;
    kvb_slot_pool *sp;
    kvb_act_pool *ap;
    /* requests: open addressing on id */
    ee_req *tab;
    size_t cap;          /* power of two */
    size_t n_live;
    uint64_t next_arrival;
    uint32_t mark;
    /* this iteration's queues (entries of tab), by arrival */
    ee_req **run;        /* resident and offloaded */
    ee_req **wait;
    int n_run, n_wait, cap_q;
    kvb_ee_cand *cand;   /* [cap_q] */
    uint8_t *off;        /* [cap_q] */
    /* CPU buffer and Alg. 2 */
    int32_t *host_free;  /* [buf_max] stack of free CPU-buffer chunks */
    int n_host_free;
    int64_t b_logic;
    int64_t buf_used;
    kvb_ee_window win;
    kvb_ee_stats st;
};

int kvb_ee_core_kv_chunks(const kvb_ee_core *core, int64_t tokens) {
    return (int)KVB_DIV_CEIL(tokens, core->c.chunk_tokens);
}

/* ---------------------------------------------------------------- request table */

static size_t hash_id(uint64_t id) {
    id ^= id >> 33;
    id *= 0xff51afd7ed558ccdULL;
    id ^= id >> 33;
    return (size_t)id;
}

static ee_req *req_find(const kvb_ee_core *core, uint64_t id) {
    if (!core->cap) return NULL;
    for (size_t i = hash_id(id) & (core->cap - 1);; i = (i + 1) & (core->cap - 1)) {
        ee_req *r = &core->tab[i];
        if (!r->used) return NULL;
        if (r->id == id) return r;
    }
}

static kvb_status tab_grow(kvb_ee_core *core, size_t want) {
    size_t cap = core->cap ? core->cap : 64;
    while (cap < 2 * want) cap *= 2;
    if (cap == core->cap) return KVB_OK;
    ee_req *t = NULL;
    KVB_TRY(kvb_calloc(cap, sizeof *t, (void **)&t));
    for (size_t i = 0; i < core->cap; i++) {
        if (!core->tab[i].used) continue;
        size_t j = hash_id(core->tab[i].id) & (cap - 1);
        while (t[j].used) j = (j + 1) & (cap - 1);
        t[j] = core->tab[i];
    }
    free(core->tab);
    core->tab = t;
    core->cap = cap;
    return KVB_OK;
}

/* Removes entry r (backward-shift deletion keeps probe chains intact). */
static void req_remove(kvb_ee_core *core, ee_req *r) {
    size_t mask = core->cap - 1, i = (size_t)(r - core->tab), j = i;
    core->tab[i].used = 0;
    for (;;) {
        j = (j + 1) & mask;
        if (!core->tab[j].used) break;
        size_t h = hash_id(core->tab[j].id) & mask;
        /* can entry j move to the hole at i? only if its home is not in (i, j] cyclically */
        if ((j > i && (h <= i || h > j)) || (j < i && (h <= i && h > j))) {
            core->tab[i] = core->tab[j];
            core->tab[j].used = 0;
            i = j;
        }
    }
    core->n_live--;
}

/* ---------------------------------------------------------------- create / destroy */

static kvb_status config_check(const kvb_ee_config *c) {
    if (c->chunk_bytes == 0 || c->chunk_tokens < 1 || c->n_chunks < 1 || c->n_slots < 1 || c->slot_chunks < 1 ||
        c->act_chunks_start < 0 || c->act_chunks_start > c->n_chunks || c->act_seg_chunks < 1 || !c->act ||
        c->max_tokens < 1 || c->max_seqs < 1 || c->theta < 0 || c->alpha < 2 || c->buf_max < 0 || c->buf_start < 1 ||
        c->premap_max < 0 || c->slo_ttft_s < 0 || c->slo_tpot_s < 0 || c->stage_bytes_per_token < 0 ||
        c->stage_round_tokens < 0) {
        KVB_LOG_E("ellm-elastic: invalid configuration (chunks, slots, activation model, budget, θ >= 0, α >= 2, "
                  "buffer sizes)");
        return KVB_ERR_INVALID;
    }
    int64_t len = (int64_t)c->slot_chunks * c->chunk_tokens;
    int64_t kv = c->slot_chunks;
    int64_t act_prefill = c->act(c->act_ud, KVB_MIN(len, c->max_tokens), 1, 0);
    int64_t act_step = c->act(c->act_ud, c->max_tokens, KVB_MIN(c->max_seqs, c->max_tokens), 0);
    if (c->intra && c->mode == KVB_EE_MODE_ELASTIC) {
        if (kv + act_prefill + c->theta > c->n_chunks) {
            KVB_LOG_E("ellm-elastic: %d chunks cannot hold a request of the full length %lld: %lld KV chunks + %lld "
                      "activation chunks of its prefill + θ %d",
                      c->n_chunks, (long long)len, (long long)kv, (long long)act_prefill, c->theta);
            return KVB_ERR_INVALID;
        }
    } else {
        if (act_step > c->act_chunks_start || kv + c->theta > c->n_chunks - c->act_chunks_start) {
            KVB_LOG_E("ellm-elastic: the static split of %d chunks (%d activations) cannot serve: a full step's "
                      "activations take %lld chunks, a full-length request %lld KV chunks + θ %d",
                      c->n_chunks, c->act_chunks_start, (long long)act_step, (long long)kv, c->theta);
            return KVB_ERR_INVALID;
        }
    }
    if (c->mode == KVB_EE_MODE_CHUNKED && c->inter) {
        KVB_LOG_E("ellm-elastic: the chunked-prefill baseline has no CPU buffer");
        return KVB_ERR_INVALID;
    }
    return KVB_OK;
}

kvb_status kvb_ee_core_create(const kvb_ee_config *c, const kvb_vm_ops *ops, kvb_ee_core **out) {
    KVB_TRY(config_check(c));
    kvb_ee_core *core = NULL;
    KVB_TRY(kvb_calloc(1, sizeof *core, (void **)&core));
    core->c = *c;
    kvb_status st;
    KVB_TRY_GOTO(kvb_ee_window_init(&core->win, c->win_iters, c->win_misses), fail);
    KVB_TRY_GOTO(kvb_epool_create(c->n_chunks, c->chunk_bytes, c->act_chunks_start, ops, &core->ep), fail);
    KVB_TRY_GOTO(kvb_slot_pool_create(core->ep, c->n_slots, c->slot_chunks, &core->sp), fail);
    KVB_TRY_GOTO(kvb_act_pool_create(core->ep, c->act_seg_chunks, c->act_align, &core->ap), fail);
    KVB_TRY_GOTO(tab_grow(core, 64), fail);
    if (c->inter && c->buf_max > 0) {
        if (c->buf_max > INT32_MAX) {
            st = KVB_ERR_INVALID;
            goto fail;
        }
        KVB_TRY_GOTO(kvb_malloc((size_t)c->buf_max * sizeof *core->host_free, (void **)&core->host_free), fail);
        for (int64_t i = c->buf_max - 1; i >= 0; i--) core->host_free[core->n_host_free++] = (int32_t)i;
    }
    core->b_logic = (c->slo_ttft_s > 0 || c->slo_tpot_s > 0) ? KVB_MIN(c->buf_start, KVB_MAX(c->buf_max, 1)) : c->buf_max;
    *out = core;
    return KVB_OK;
fail:
    kvb_ee_core_destroy(core);
    return st;
}

void kvb_ee_core_destroy(kvb_ee_core *core) {
    if (!core) return;
    kvb_act_pool_destroy(core->ap);
    kvb_slot_pool_destroy(core->sp);
    kvb_epool_destroy(core->ep);
    for (size_t i = 0; i < core->cap; i++)
        if (core->tab[i].used) free(core->tab[i].host);
    free(core->tab);
    free(core->host_free);
    free(core->run);
    free(core->wait);
    free(core->cand);
    free(core->off);
    free(core);
}

const kvb_ee_config *kvb_ee_core_config(const kvb_ee_core *core) { return &core->c; }
kvb_epool *kvb_ee_core_epool(kvb_ee_core *core) { return core->ep; }
kvb_slot_pool *kvb_ee_core_slots(kvb_ee_core *core) { return core->sp; }
kvb_act_pool *kvb_ee_core_act_pool(kvb_ee_core *core) { return core->ap; }

void kvb_ee_core_get_stats(const kvb_ee_core *core, kvb_ee_stats *out) {
    *out = core->st;
    out->b_logic = core->b_logic;
    out->buf_used = core->buf_used;
}

int kvb_ee_core_slot_of(const kvb_ee_core *core, uint64_t id) {
    const ee_req *r = req_find(core, id);
    return r ? (r->state == R_RESIDENT ? r->slot : -1) : -1;
}

int kvb_ee_core_buffer_chunks(const kvb_ee_core *core, uint64_t id) {
    const ee_req *r = req_find(core, id);
    return r ? (r->state == R_OFFLOADED ? r->buf : 0) : -1;
}

int kvb_ee_core_host_chunks(const kvb_ee_core *core, uint64_t id, const int32_t **ids) {
    const ee_req *r = req_find(core, id);
    *ids = r ? r->host : NULL;
    return r ? r->n_host : 0;
}

/* Gives a request's CPU-buffer chunks back. */
static void host_release(kvb_ee_core *core, ee_req *r) {
    for (int j = 0; j < r->n_host; j++) core->host_free[core->n_host_free++] = r->host[j];
    free(r->host);
    r->host = NULL;
    r->n_host = 0;
}

/* Takes `n` CPU-buffer chunks for a request (P_B <= B_logic <= B_max guarantees them). */
static kvb_status host_take(kvb_ee_core *core, ee_req *r, int n) {
    if (n > core->n_host_free || r->n_host) return KVB_ERR_STATE;
    KVB_TRY(kvb_malloc((size_t)KVB_MAX(n, 1) * sizeof *r->host, (void **)&r->host));
    for (int j = 0; j < n; j++) r->host[j] = core->host_free[--core->n_host_free];
    r->n_host = n;
    return KVB_OK;
}

/* ---------------------------------------------------------------- requests' KV */

/* The request's KV is gone (finished, preempted): slot cached, buffer chunks freed. */
static void drop_kv(kvb_ee_core *core, ee_req *r) {
    if (r->state == R_RESIDENT) kvb_slot_pool_release(core->sp, r->slot);
    if (r->state == R_OFFLOADED) core->buf_used -= r->buf;
    host_release(core, r);
    r->state = R_WAITING;
    r->slot = -1;
    r->buf = 0;
    r->kv = 0;
}

static kvb_status ensure_queues(kvb_ee_core *core, int n) {
    if (n <= core->cap_q) return KVB_OK;
    int cap = KVB_MAX(n, 2 * core->cap_q);
    KVB_TRY(kvb_realloc_array((void **)&core->run, (size_t)cap, sizeof *core->run));
    KVB_TRY(kvb_realloc_array((void **)&core->wait, (size_t)cap, sizeof *core->wait));
    KVB_TRY(kvb_realloc_array((void **)&core->cand, (size_t)cap, sizeof *core->cand));
    KVB_TRY(kvb_realloc_array((void **)&core->off, (size_t)cap, sizeof *core->off));
    core->cap_q = cap;
    return KVB_OK;
}

static int by_arrival(const void *a, const void *b) {
    const ee_req *x = *(ee_req *const *)a, *y = *(ee_req *const *)b;
    return x->arrival < y->arrival ? -1 : x->arrival > y->arrival;
}

kvb_status kvb_ee_core_sync(kvb_ee_core *core, const kvb_ee_req *reqs, int n, uint64_t now_ns) {
    uint64_t t0 = kvb_now_ns();
    KVB_TRY(ensure_queues(core, n));
    KVB_TRY(tab_grow(core, core->n_live + (size_t)n));
    uint32_t mark = ++core->mark;
    int ttft_miss = 0, tpot_miss = 0;
    for (int i = 0; i < n; i++) {
        const kvb_ee_req *q = &reqs[i];
        ee_req *r = req_find(core, q->id);
        if (!r) {
            size_t j = hash_id(q->id) & (core->cap - 1);
            while (core->tab[j].used) j = (j + 1) & (core->cap - 1);
            r = &core->tab[j];
            *r = (ee_req){.id = q->id, .used = 1, .slot = -1, .arrival = core->next_arrival++,
                          .t_arrival_ns = q->t_arrival_ns};
            core->n_live++;
        } else if (r->mark == mark) {
            KVB_LOG_E("ellm-elastic: request %llu listed twice", (unsigned long long)q->id);
            return KVB_ERR_INVALID;
        }
        r->mark = mark;
        if (q->waiting && r->state != R_WAITING) drop_kv(core, r); /* the engine preempted it */
        if (!q->waiting && r->state == R_WAITING) {
            KVB_LOG_E("ellm-elastic: request %llu runs in the engine but not in the plan", (unsigned long long)q->id);
            return KVB_ERR_STATE;
        }
        if (!q->waiting && q->n_computed != r->kv) {
            KVB_LOG_E("ellm-elastic: request %llu has %d tokens of KV in the engine, %d in the plan",
                      (unsigned long long)q->id, q->n_computed, r->kv);
            return KVB_ERR_STATE;
        }
        /* tokens produced since the last iteration: Alg. 2's measurements */
        if (q->n_generated > r->n_gen) {
            if (r->n_gen == 0) {
                r->t_first_ns = now_ns;
                if (core->c.slo_ttft_s > 0 && (double)(now_ns - r->t_arrival_ns) * 1e-9 > core->c.slo_ttft_s) ttft_miss++;
            } else if (core->c.slo_tpot_s > 0 && q->n_generated > 1 &&
                       (double)(now_ns - r->t_first_ns) * 1e-9 / (q->n_generated - 1) > core->c.slo_tpot_s) {
                tpot_miss++;
            }
        }
        r->n_gen = q->n_generated;
        r->n_tokens = q->n_tokens;
    }
    /* the ones not listed have finished */
    for (size_t i = 0; i < core->cap;) {
        ee_req *r = &core->tab[i];
        if (r->used && r->mark != mark) {
            drop_kv(core, r);
            req_remove(core, r); /* may shift a later entry into i: look at i again */
            continue;
        }
        i++;
    }
    /* this iteration's queues, by arrival (pointers into the table, stable until the next sync). The
     * engine lists its queues in arrival order, so they come sorted; running and swapped requests are two
     * sorted runs, merged by the sort only when both exist. */
    core->n_run = core->n_wait = 0;
    int run_sorted = 1, wait_sorted = 1;
    for (int i = 0; i < n; i++) {
        ee_req *r = req_find(core, reqs[i].id);
        if (r->state == R_WAITING) {
            wait_sorted &= core->n_wait == 0 || core->wait[core->n_wait - 1]->arrival < r->arrival;
            core->wait[core->n_wait++] = r;
        } else {
            run_sorted &= core->n_run == 0 || core->run[core->n_run - 1]->arrival < r->arrival;
            core->run[core->n_run++] = r;
        }
    }
    if (!run_sorted) qsort(core->run, (size_t)core->n_run, sizeof *core->run, by_arrival);
    if (!wait_sorted) qsort(core->wait, (size_t)core->n_wait, sizeof *core->wait, by_arrival);
    /* Alg. 2, once per iteration */
    core->st.ttft_misses += (uint64_t)ttft_miss;
    core->st.tpot_misses += (uint64_t)tpot_miss;
    if (core->c.inter && (core->c.slo_ttft_s > 0 || core->c.slo_tpot_s > 0)) {
        int et, ep;
        kvb_ee_window_push(&core->win, ttft_miss, tpot_miss, &et, &ep);
        core->st.events_ttft += (uint64_t)(et && !ep);
        core->st.events_tpot += (uint64_t)ep;
        core->b_logic = kvb_ee_buffer_scale(core->b_logic, et, ep, core->c.buf_max, core->c.alpha);
    }
    core->st.plan_ns += kvb_now_ns() - t0;
    return KVB_OK;
}

/* ---------------------------------------------------------------- planning */

static kvb_status push_item(kvb_ee_step *st, kvb_ee_item it) {
    if (st->n_items == st->cap_items) {
        int cap = st->cap_items ? 2 * st->cap_items : 16;
        KVB_TRY(kvb_realloc_array((void **)&st->items, (size_t)cap, sizeof *st->items));
        st->cap_items = cap;
    }
    st->items[st->n_items++] = it;
    return KVB_OK;
}

void kvb_ee_step_free(kvb_ee_step *st) {
    if (!st) return;
    free(st->items);
    memset(st, 0, sizeof *st);
}

static int kv_holding(const kvb_ee_core *core) { return kvb_slot_pool_n_needed(core->sp); }

static int p_kv_now(const kvb_ee_core *core) { return kvb_epool_n_owned(core->ep, KVB_EPOOL_KV) - kv_holding(core); }

static int p_act_now(const kvb_ee_core *core) {
    return kvb_epool_n_owned(core->ep, KVB_EPOOL_ACT) - kvb_act_pool_n_live(core->ap);
}

static kvb_ee_alg1_in alg_in(const kvb_ee_core *core, kvb_ee_phase phase) {
    const kvb_ee_config *c = &core->c;
    return (kvb_ee_alg1_in){
        .phase = phase,
        .p_kv = p_kv_now(core),
        .p_act = p_act_now(core),
        .theta = phase == KVB_EE_PREFILL ? c->theta : 0,
        .buf_avail = c->inter ? (int)KVB_MIN(kvb_ee_buffer_avail(core->b_logic, core->buf_used), INT32_MAX) : 0,
        .free_slots = kvb_slot_pool_n_free_slots(core->sp),
        .max_tokens = c->max_tokens,
        .max_seqs = c->max_seqs,
        .intra = c->intra,
        .act = c->act,
        .act_ud = c->act_ud,
    };
}

/* Preempts the newest device-resident request (recompute): its slot is cached, it waits again.
 * Returns 0 if there is none. */
static int preempt_newest(kvb_ee_core *core, kvb_ee_step *st) {
    for (int i = core->n_run - 1; i >= 0; i--) {
        ee_req *r = core->run[i];
        if (r->state != R_RESIDENT) continue;
        if (push_item(st, (kvb_ee_item){.id = r->id, .action = KVB_EE_DO_PREEMPT, .slot = -1}) != KVB_OK) return 0;
        drop_kv(core, r);
        memmove(&core->run[i], &core->run[i + 1], (size_t)(core->n_run - i - 1) * sizeof *core->run);
        core->n_run--;
        /* back to the queue in arrival order */
        int j = core->n_wait;
        while (j > 0 && core->wait[j - 1]->arrival > r->arrival) {
            core->wait[j] = core->wait[j - 1];
            j--;
        }
        core->wait[j] = r;
        core->n_wait++;
        core->st.preemptions++;
        return 1;
    }
    return 0;
}

static void record_batch(kvb_ee_step *st, const kvb_ee_alg1_in *in, const kvb_ee_alg1_out *o) {
    st->alg = *o;
    st->p_kv = in->p_kv;
    st->p_act = in->p_act;
}

/* Bytes of the staging area an offloaded prefill of n tokens streams its KV through. */
static int64_t stage_bytes(const kvb_ee_config *c, int64_t n) {
    if (c->stage_round_tokens > 0) n = KVB_DIV_CEIL(n, c->stage_round_tokens) * c->stage_round_tokens;
    return n * c->stage_bytes_per_token;
}

/* Alg. 1's prefill branch over the queue. Returns the batch size. */
static kvb_status plan_prefill(kvb_ee_core *core, kvb_ee_step *st, int *n_batch) {
    *n_batch = 0;
    if (core->n_wait == 0) return KVB_OK;
    for (int i = 0; i < core->n_wait; i++) {
        const ee_req *r = core->wait[i];
        core->cand[i] = (kvb_ee_cand){.kv_chunks = kvb_ee_core_kv_chunks(core, r->n_tokens),
                                      .q_len = r->n_tokens,
                                      .stage_bytes = stage_bytes(&core->c, r->n_tokens),
                                      .needs_slot = 1};
    }
    kvb_ee_alg1_in in = alg_in(core, KVB_EE_PREFILL);
    kvb_ee_alg1_out o;
    KVB_TRY(kvb_ee_alg1(&in, core->cand, core->n_wait, core->off, &o));
    if (o.n_batch == 0) return KVB_OK;
    st->phase = KVB_EE_PREFILL;
    record_batch(st, &in, &o);
    for (int i = 0; i < o.n_batch; i++) {
        const ee_req *r = core->wait[i];
        KVB_TRY(push_item(st, (kvb_ee_item){.id = r->id,
                                            .action = core->off[i] ? KVB_EE_DO_OFFLOAD : KVB_EE_DO_PREFILL,
                                            .q_len = r->n_tokens,
                                            .kv_before = 0,
                                            .slot = -1}));
        st->n_tokens += r->n_tokens;
    }
    *n_batch = o.n_batch;
    return KVB_OK;
}

/* Alg. 1's decode branch over the running requests. */
static kvb_status plan_decode(kvb_ee_core *core, kvb_ee_step *st, int *n_batch) {
    *n_batch = 0;
    for (int i = 0; i < core->n_run; i++) {
        const ee_req *r = core->run[i];
        int q = r->n_tokens - r->kv;
        int res = r->state == R_RESIDENT;
        core->cand[i] = (kvb_ee_cand){
            .kv_chunks = kvb_ee_core_kv_chunks(core, r->kv + q) - (res ? kvb_ee_core_kv_chunks(core, r->kv) : 0),
            .q_len = q,
            .needs_slot = !res};
    }
    kvb_ee_alg1_in in = alg_in(core, KVB_EE_DECODE);
    kvb_ee_alg1_out o;
    KVB_TRY(kvb_ee_alg1(&in, core->cand, core->n_run, core->off, &o));
    if (o.n_batch == 0) return KVB_OK;
    st->phase = KVB_EE_DECODE;
    record_batch(st, &in, &o);
    for (int i = 0; i < o.n_batch; i++) {
        const ee_req *r = core->run[i];
        int q = r->n_tokens - r->kv;
        KVB_TRY(push_item(st, (kvb_ee_item){.id = r->id,
                                            .action = r->state == R_RESIDENT ? KVB_EE_DO_DECODE : KVB_EE_DO_FETCH,
                                            .q_len = q,
                                            .kv_before = r->kv,
                                            .slot = r->state == R_RESIDENT ? r->slot : -1}));
        st->n_tokens += q;
    }
    *n_batch = o.n_batch;
    return KVB_OK;
}

/* vLLM with chunked prefill: running requests first (a decode token or their next prompt chunk), then
 * the queue, within the token budget; FCFS stops at the first that does not fit. Static split. */
static kvb_status plan_chunked(kvb_ee_core *core, kvb_ee_step *st, int *n_batch) {
    *n_batch = 0;
    int budget = core->c.max_tokens, seqs = 0, slots = kvb_slot_pool_n_free_slots(core->sp);
    int p_kv = p_kv_now(core), p_act = p_act_now(core), m_kv = 0;
    int64_t tokens = 0;
    int first_items = st->n_items;
    for (int i = 0; i < core->n_run + core->n_wait && budget > 0 && seqs < core->c.max_seqs; i++) {
        int waiting = i >= core->n_run;
        const ee_req *r = waiting ? core->wait[i - core->n_run] : core->run[i];
        int q = KVB_MIN(r->n_tokens - r->kv, budget);
        int kv_r = kvb_ee_core_kv_chunks(core, r->kv + q) - kvb_ee_core_kv_chunks(core, r->kv);
        int64_t act = core->c.act(core->c.act_ud, tokens + q, seqs + 1, 0);
        int theta = waiting ? core->c.theta : 0;
        if (p_kv - (m_kv + kv_r) < theta || act > p_act || (waiting && slots == 0)) break;
        m_kv += kv_r;
        slots -= waiting;
        KVB_TRY(push_item(st, (kvb_ee_item){.id = r->id,
                                            .action = waiting ? KVB_EE_DO_PREFILL : KVB_EE_DO_DECODE,
                                            .q_len = q,
                                            .kv_before = r->kv,
                                            .slot = waiting ? -1 : r->slot}));
        tokens += q;
        budget -= q;
        seqs++;
        st->alg.m_act = (int)act;
    }
    st->phase = KVB_EE_DECODE;
    st->alg.m_kv = m_kv;
    st->alg.n_batch = st->n_items - first_items;
    st->p_kv = p_kv;
    st->p_act = p_act;
    st->n_tokens = (int)tokens;
    *n_batch = st->alg.n_batch;
    return KVB_OK;
}

kvb_status kvb_ee_core_plan(kvb_ee_core *core, kvb_ee_step *st) {
    uint64_t t0 = kvb_now_ns();
    st->n_items = st->n_batch = st->n_tokens = 0;
    memset(&st->alg, 0, sizeof st->alg);
    st->phase = KVB_EE_DECODE;
    int n = 0, preempted = 0;
    kvb_status s = KVB_OK;
    for (;;) {
        if (core->c.mode == KVB_EE_MODE_CHUNKED) {
            s = plan_chunked(core, st, &n);
        } else {
            /* prefill first (vLLM v0.5's default order, which eLLM builds on); not again in an
             * iteration that preempted, or the victim would be admitted straight back */
            if (!preempted) s = plan_prefill(core, st, &n);
            if (s == KVB_OK && n == 0) s = plan_decode(core, st, &n);
        }
        if (s != KVB_OK || n > 0) break;
        if (core->n_run == 0 || !preempt_newest(core, st)) break; /* idle, or nothing left to preempt */
        preempted = 1;
    }
    st->n_batch = n;
    core->st.plan_ns += kvb_now_ns() - t0;
    return s;
}

/* ---------------------------------------------------------------- applying */

/* Moves `n` chunks of ownership from one side to the other, taking free ones first and making more
 * free (activation GC, or KV reclaim of cached slots and excess) when needed. */
static kvb_status balloon(kvb_ee_core *core, kvb_epool_owner from, kvb_epool_owner to, int n) {
    int t = KVB_MIN(n, kvb_epool_n_free(core->ep, from));
    KVB_TRY(kvb_epool_transfer(core->ep, from, to, t));
    int rest = n - t;
    if (rest > 0) {
        int got = from == KVB_EPOOL_ACT ? kvb_act_pool_gc(core->ap, rest) : kvb_slot_pool_reclaim(core->sp, rest);
        KVB_TRY(kvb_epool_transfer(core->ep, from, to, got));
        if (got < rest) {
            KVB_LOG_E("ellm-elastic: %s has only %d of the %d chunks to give", from == KVB_EPOOL_ACT ? "activations" : "KV",
                      t + got, n);
            return KVB_ERR_EXHAUSTED;
        }
    }
    if (to == KVB_EPOOL_KV) core->st.inflated += (uint64_t)n;
    else core->st.deflated += (uint64_t)n;
    return KVB_OK;
}

kvb_status kvb_ee_core_apply(kvb_ee_core *core, kvb_ee_step *st) {
    uint64_t t0 = kvb_now_ns();
    kvb_status s = KVB_OK;
    /* 1. ballooning (Alg. 1 lines 24-27): only the shortfall moves */
    int inflate = st->alg.inflate;
    if (inflate > 0) s = balloon(core, KVB_EPOOL_ACT, KVB_EPOOL_KV, inflate);
    else if (inflate < 0) s = balloon(core, KVB_EPOOL_KV, KVB_EPOOL_ACT, -inflate);
    /* 2. slots and needs for everything the step writes on the device, before any mapping, so that a
     *    reclaim never takes a chunk this step needs */
    for (int i = 0; i < st->n_items && s == KVB_OK; i++) {
        kvb_ee_item *it = &st->items[i];
        ee_req *r = req_find(core, it->id);
        if (!r) return KVB_ERR_STATE;
        int need = kvb_ee_core_kv_chunks(core, it->kv_before + it->q_len);
        switch (it->action) {
        case KVB_EE_DO_PREFILL:
        case KVB_EE_DO_FETCH:
            s = kvb_slot_pool_acquire(core->sp, need, &it->slot);
            if (s == KVB_OK) {
                if (it->action == KVB_EE_DO_FETCH) {
                    core->buf_used -= r->buf;
                    core->st.fetches++;
                    core->st.fetch_chunks += (uint64_t)r->buf;
                    r->buf = 0;
                }
                r->state = R_RESIDENT;
                r->slot = it->slot;
            }
            break;
        case KVB_EE_DO_DECODE:
            it->slot = r->slot;
            kvb_slot_pool_set_need(core->sp, r->slot, need);
            break;
        case KVB_EE_DO_OFFLOAD: {
            int chunks = kvb_ee_core_kv_chunks(core, it->q_len);
            s = host_take(core, r, chunks);
            if (s != KVB_OK) break;
            r->state = R_OFFLOADED;
            r->buf = chunks;
            core->buf_used += chunks;
            core->st.offloads++;
            core->st.offload_chunks += (uint64_t)chunks;
            break;
        }
        case KVB_EE_DO_PREEMPT:
            break;
        }
    }
    /* 3. map what the step writes (cached slots and pre-mapped chunks need no call) */
    for (int i = 0; i < st->n_items && s == KVB_OK; i++) {
        const kvb_ee_item *it = &st->items[i];
        if (it->slot < 0) continue;
        int need = kvb_slot_pool_need(core->sp, it->slot);
        int mapped = kvb_slot_pool_n_mapped(core->sp, it->slot);
        if (it->action == KVB_EE_DO_DECODE && it->q_len == 1 && need > mapped) core->st.decode_maps += (uint64_t)(need - mapped);
        s = kvb_slot_pool_map(core->sp, it->slot, need, KVB_SLOT_RECLAIM_ALL);
    }
    core->st.iterations++;
    if (st->n_batch > 0) {
        if (st->phase == KVB_EE_PREFILL) core->st.prefill_iters++;
        else core->st.decode_iters++;
        if (st->phase == KVB_EE_DECODE) core->st.max_batch = KVB_MAX(core->st.max_batch, st->n_batch);
    }
    core->st.plan_ns += kvb_now_ns() - t0;
    if (s != KVB_OK) KVB_LOG_E("ellm-elastic: the iteration's memory could not be allocated: %s", kvb_status_str(s));
    return s;
}

kvb_status kvb_ee_core_done(kvb_ee_core *core, const kvb_ee_step *st) {
    uint64_t t0 = kvb_now_ns();
    for (int i = 0; i < st->n_items; i++) {
        const kvb_ee_item *it = &st->items[i];
        if (it->action == KVB_EE_DO_PREEMPT) continue;
        ee_req *r = req_find(core, it->id);
        if (!r) return KVB_ERR_STATE;
        r->kv = it->kv_before + it->q_len;
        if (r->state == R_RESIDENT) kvb_slot_pool_set_need(core->sp, r->slot, kvb_ee_core_kv_chunks(core, r->kv));
        if (it->action == KVB_EE_DO_FETCH) host_release(core, r); /* the copy back is done */
    }
    core->st.plan_ns += kvb_now_ns() - t0;
    return KVB_OK;
}

int kvb_ee_core_premap(kvb_ee_core *core, const kvb_ee_step *st) {
    if (!core->c.premap) return 0;
    uint64_t t0 = kvb_now_ns();
    int ahead = kvb_slot_pool_n_excess(core->sp), done = 0;
    for (int i = 0; i < st->n_items && ahead < core->c.premap_max; i++) {
        const kvb_ee_item *it = &st->items[i];
        if (it->slot < 0 || it->action == KVB_EE_DO_PREEMPT || it->action == KVB_EE_DO_OFFLOAD) continue;
        int next = kvb_ee_core_kv_chunks(core, it->kv_before + it->q_len + 1);
        if (next <= kvb_slot_pool_n_mapped(core->sp, it->slot) || next > core->c.slot_chunks) continue;
        if (kvb_epool_n_free(core->ep, KVB_EPOOL_KV) == 0 && core->c.intra &&
            kvb_epool_n_free(core->ep, KVB_EPOOL_ACT) > 0 &&
            kvb_epool_transfer(core->ep, KVB_EPOOL_ACT, KVB_EPOOL_KV, 1) == KVB_OK)
            core->st.inflated++;
        /* the slot's need stays at its KV: the pre-mapped chunk is reclaimable excess until used */
        if (kvb_slot_pool_map(core->sp, it->slot, next, KVB_SLOT_RECLAIM_CACHED) != KVB_OK) break;
        core->st.premapped++;
        ahead++;
        done++;
    }
    core->st.plan_ns += kvb_now_ns() - t0;
    return done;
}

/* ---------------------------------------------------------------- activations */

kvb_status kvb_ee_core_act_alloc(kvb_ee_core *core, size_t bytes, uintptr_t *addr) {
    for (;;) {
        kvb_status s = kvb_act_pool_alloc(core->ap, bytes, addr);
        if (s != KVB_ERR_EXHAUSTED) return s;
        /* the step needs more than Alg. 1 planned: take one chunk from the KV side if it has one */
        if (kvb_epool_n_free(core->ep, KVB_EPOOL_KV) == 0 && kvb_slot_pool_reclaim(core->sp, 1) == 0) return s;
        KVB_TRY(kvb_epool_transfer(core->ep, KVB_EPOOL_KV, KVB_EPOOL_ACT, 1));
        core->st.act_rescues++;
        core->st.deflated++;
    }
}

void kvb_ee_core_act_free(kvb_ee_core *core, uintptr_t addr) { (void)kvb_act_pool_free(core->ap, addr); }

/* ---------------------------------------------------------------- checks */

kvb_status kvb_ee_core_check(const kvb_ee_core *core) {
    KVB_TRY(kvb_epool_check(core->ep));
    KVB_TRY(kvb_slot_pool_check(core->sp));
    KVB_TRY(kvb_act_pool_check(core->ap));
    int n = kvb_slot_pool_n_slots(core->sp);
    uint8_t *owner = NULL;
    KVB_TRY(kvb_calloc((size_t)n, 1, (void **)&owner));
    int64_t buf = 0, held = 0;
    kvb_status s = KVB_OK;
    int live = 0;
    for (size_t i = 0; i < core->cap && s == KVB_OK; i++) {
        const ee_req *r = &core->tab[i];
        if (!r->used) continue;
        if (r->state == R_RESIDENT) {
            live++;
            if (r->slot < 0 || r->slot >= n || owner[r->slot] || !kvb_slot_pool_is_live(core->sp, r->slot) ||
                kvb_slot_pool_need(core->sp, r->slot) < kvb_ee_core_kv_chunks(core, r->kv)) {
                KVB_LOG_E("ellm-elastic: request %llu's slot %d is shared, not live, or short of its KV",
                          (unsigned long long)r->id, r->slot);
                s = KVB_ERR_STATE;
            } else {
                owner[r->slot] = 1;
            }
        } else if (r->state == R_OFFLOADED) {
            buf += r->buf;
            if (r->n_host != r->buf) {
                KVB_LOG_E("ellm-elastic: offloaded request %llu holds %d buffer chunks for %d", (unsigned long long)r->id,
                          r->n_host, r->buf);
                s = KVB_ERR_STATE;
            }
        }
        held += r->n_host;
    }
    free(owner);
    if (s == KVB_OK && core->c.inter && held + core->n_host_free != core->c.buf_max) {
        KVB_LOG_E("ellm-elastic: %lld buffer chunks held + %d free != B_max %lld", (long long)held, core->n_host_free,
                  (long long)core->c.buf_max);
        s = KVB_ERR_STATE;
    }
    if (s != KVB_OK) return s;
    if (live != n - kvb_slot_pool_n_free_slots(core->sp) || buf != core->buf_used || buf < 0) {
        KVB_LOG_E("ellm-elastic: %d resident requests for %d live slots; %lld buffer chunks held, %lld counted", live,
                  n - kvb_slot_pool_n_free_slots(core->sp), (long long)buf, (long long)core->buf_used);
        return KVB_ERR_STATE;
    }
    if (core->c.inter && core->buf_used > core->c.buf_max) {
        KVB_LOG_E("ellm-elastic: %lld chunks in a CPU buffer of %lld", (long long)core->buf_used,
                  (long long)core->c.buf_max);
        return KVB_ERR_STATE;
    }
    return KVB_OK;
}
