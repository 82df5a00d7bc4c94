/* kvbank — the engine's public API: create and destroy, requests, the step, statistics. The work is in the
 * files state.h lists. */
#include "common/sched/engine.h"
#include "common/sched/link_calib.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/sched/state.h"

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
    o->stall_wait_s = 60;
    o->stall_overtake = 64;
}

/* The planner's resources (plan_pool SETUP), asked before the pool exists (a planner may bring the KV
 * memory): host tier, stage buffers, forward rows, its own pool memory. */
static kvb_status setup_pool_plan(kvb_engine *e, kvb_pool_plan *pp) {
    *pp = (kvb_pool_plan){0};
    if (!e->planner.iface || !e->planner.iface->plan_pool) return KVB_OK;
    kvb_pool_event ev = {.kind = KVB_POOL_SETUP, .now_s = kvb_now_s(), .model = e->m};
    kvb_view v = {.geom = &e->geom, .max_batch_tokens = e->o.max_batch_tokens, .max_rows = e->o.max_batch_tokens,
                  .max_seqs = e->o.max_seqs, .max_model_len = e->o.max_model_len,
                  .prefix_cache = e->o.enable_prefix_cache, .now_ns = kvb_wall_ns(),
                  .pool = {.capacity = e->o.n_blocks, .n_own = e->o.n_blocks, .n_blocks = e->o.n_blocks,
                           .n_free = e->o.n_blocks},
                  .links = &e->o.links};
    kvb_status st = e->planner.iface->plan_pool(e->planner.ctx, &ev, &v, pp);
    if (st != KVB_OK) {
        KVB_LOG_E("engine: planner %s cannot set up: %s", e->planner.iface->name, kvb_status_str(st));
        return st;
    }
    if (pp->host_tier_blocks < 0 || pp->extra_rows < 0 || pp->stage_slots < 0 || pp->sliced_ids < 0 ||
        pp->lsc_own_blocks < 0 || pp->max_borrowed < 0 ||
        (pp->lsc_own_blocks > 0 && (pp->lsc_own_blocks >= e->o.n_blocks || pp->kv_mem)) ||
        pp->sliced_min_layers < 0 || pp->max_model_len < 0 || pp->max_batch_tokens < 0 ||
        (pp->kv_mem && (pp->kv_blocks < 1 || pp->kv_mem_bytes / kvb_kv_block_bytes(&e->geom) < (size_t)pp->kv_blocks))) {
        KVB_LOG_E("engine: planner %s asks for negative resources or KV memory smaller than its blocks",
                  e->planner.iface->name);
        return KVB_ERR_INVALID;
    }
    if ((pp->host_prefix && pp->host_tier_blocks == 0) ||
        (pp->host_prefix && !e->o.enable_prefix_cache)) {
        KVB_LOG_E("engine: planner %s asks for a host-tier prefix cache %s", e->planner.iface->name,
                  e->o.enable_prefix_cache ? "without host-tier blocks" : "with the prefix cache off");
        return KVB_ERR_INVALID;
    }
    return KVB_OK;
}

/* Replaces the fresh block-major pool with a sliced one over the same memory (the planner asked for
 * request-level placements) and starts the layer-sliced KV manager. */
static kvb_status make_sliced(kvb_engine *e, const kvb_pool_plan *pp) {
    if (pp->stage_slots > 0 || pp->host_tier_blocks > 0) {
        KVB_LOG_E("engine: planner %s needs a sliced pool, which does not combine with stage buffers or the host tier",
                  e->planner.iface->name);
        return KVB_ERR_UNSUPPORTED;
    }
    size_t bytes = e->o.kv_mem ? e->o.kv_mem_bytes : kvb_kv_block_bytes(&e->geom) * (size_t)e->o.n_blocks;
    kvb_prefix_cache_destroy(e->pc);
    e->pc = NULL;
    kvb_block_pool_destroy(e->pool);
    e->pool = NULL;
    KVB_TRY(kvb_block_pool_create_sliced(&e->geom, e->kv_mem, bytes, e->o.n_blocks, pp->sliced_ids, &e->pool));
    KVB_TRY(kvb_prefix_cache_create(e->pool, &e->pc));
    return kvb__slices_init(e, pp->sliced_ids, pp->sliced_min_layers);
}

kvb_status kvb_engine_create(kvb_model *m, const kvb_engine_opts *opts, const kvb_planner *planner,
                             const kvb_engine_events *ev, kvb_engine **out) {
    kvb_planner pl = planner && planner->iface ? *planner : (kvb_planner){0};
    if (!pl.iface || !pl.iface->plan_step) {
        KVB_LOG_E("engine: %s", pl.iface ? "the planner has no plan_step"
                                         : "no planner (kvb_policy_recompute schedules as vLLM does)");
        kvb_planner_destroy(&pl);
        return KVB_ERR_INVALID;
    }
    const kvb_model_config *c = kvb_model_cfg(m);
    kvb_engine_opts o = *opts;
    if (o.max_model_len <= 0 || o.max_model_len > c->max_pos) o.max_model_len = c->max_pos;
    if (o.block_size < 1 || o.n_blocks < 1 || o.max_batch_tokens < 1 || o.max_seqs < 1) {
        KVB_LOG_E("engine: block_size, n_blocks, max_batch_tokens and max_seqs must be positive");
        kvb_planner_destroy(&pl);
        return KVB_ERR_INVALID;
    }
    kvb_engine *e = NULL;
    kvb_status st = kvb_calloc(1, sizeof *e, (void **)&e);
    if (st != KVB_OK) {
        kvb_planner_destroy(&pl);
        return st;
    }
    pthread_mutex_init(&e->memo_mu, NULL);
    e->m = m;
    e->o = o;
    e->planner = pl; /* from here on kvb_engine_destroy destroys it */
    if (ev) e->ev = *ev;
    if (o.links.calibrate) { /* a scaled link preset no caller calibrated: at the default point */
        KVB_TRY_GOTO(kvb_link_calibrate(m, NULL, &o.links), fail);
        e->o.links = o.links;
    }
    e->geom = kvb_model_kv_geom(m, o.block_size);
    kvb_backend *be = kvb_model_backend(m);
    e->model_info = (kvb_model_info){.cfg = c, .weight_bytes = kvb_model_weight_bytes_per_token(m),
                                     .act_elem = (int)kvb_dtype_size(be->iface->act_dtype),
                                     .flops = o.links.measured_flops};
    KVB_TRY_GOTO(kvb_kv_geom_check(&e->geom), fail);
    KVB_TRY_GOTO(kvb__hcache_init(e), fail); /* the mechanisms that check plans on every engine */
    KVB_TRY_GOTO(kvb__prefix_init(e), fail);
    KVB_TRY_GOTO(kvb__offload_init(e), fail);
    kvb_pool_plan pp;
    KVB_TRY_GOTO(setup_pool_plan(e, &pp), fail);
    if (pp.kv_mem) { /* the planner's memory replaces the options' */
        e->planner_kv = 1;
        o.kv_mem = e->o.kv_mem = pp.kv_mem;
        o.kv_mem_bytes = e->o.kv_mem_bytes = pp.kv_mem_bytes;
        o.n_blocks = e->o.n_blocks = pp.kv_blocks;
    }
    if (pp.max_model_len > 0 && pp.max_model_len < e->o.max_model_len) e->o.max_model_len = pp.max_model_len;
    if (pp.no_prefix_cache) o.enable_prefix_cache = e->o.enable_prefix_cache = 0;
    if (pp.max_batch_tokens > 0) o.max_batch_tokens = e->o.max_batch_tokens = pp.max_batch_tokens;
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
        KVB_TRY_GOTO(kvb_mem_alloc(be->mem, bytes, &e->kv_mem), fail);
        e->kv_mem_owned = 1;
        o.kv_mem_bytes = bytes;
    }
    size_t pool_bytes = o.kv_mem ? o.kv_mem_bytes : bytes, lsc_bytes = 0;
    if (pp.lsc_own_blocks > 0) { /* the LSC takes the top of the KV memory; the pool keeps the rest (Eq. 5) */
        lsc_bytes = (size_t)pp.lsc_own_blocks * kvb_kv_block_bytes(&e->geom);
        pool_bytes -= lsc_bytes;
        o.n_blocks = e->o.n_blocks = (int)KVB_MIN((size_t)o.n_blocks, pool_bytes / kvb_kv_block_bytes(&e->geom));
    }
    KVB_TRY_GOTO(kvb_block_pool_create(&e->geom, e->kv_mem, pool_bytes, o.n_blocks, &e->pool), fail);
    KVB_TRY_GOTO(kvb_prefix_cache_create(e->pool, &e->pc), fail);
    KVB_TRY_GOTO(kvb_stager_create(be, &o.links, &e->stager), fail);
    if (lsc_bytes) KVB_TRY_GOTO(kvb_stager_use_memory(e->stager, (char *)e->kv_mem + pool_bytes, lsc_bytes), fail);
    if (pp.measure_flops && !(e->model_info.flops > 0)) KVB_TRY_GOTO(kvb_link_measure_flops(be, &e->model_info.flops), fail);
    if (pp.sliced_ids > 0) KVB_TRY_GOTO(make_sliced(e, &pp), fail);
    e->max_rows = o.max_batch_tokens + pp.extra_rows;
    if (pp.act_alloc.iface) e->act_alloc = pp.act_alloc;
    KVB_TRY_GOTO(kvb_forward_create_with(m, e->max_rows, e->act_alloc.iface ? &e->act_alloc : o.act_alloc, &e->fw),
                 fail);
    KVB_TRY_GOTO(kvb__step_init(e), fail);
    KVB_TRY_GOTO(kvb__residency_init(e), fail);
    if (pp.stage_slots > 0) KVB_TRY_GOTO(kvb__stage_reserve(e, pp.stage_slots), fail);
    e->max_borrowed = pp.limit_borrowed ? pp.max_borrowed : -1;
    if (pp.host_tier_blocks > 0)
        KVB_TRY_GOTO(kvb__host_tier_init(e, pp.host_tier_blocks, pp.host_prefix, pp.host_layered,
                                         pp.host_async_writeback), fail);
    *out = e;
    return KVB_OK;
fail:
    kvb_engine_destroy(e);
    return st;
}

void kvb_engine_destroy(kvb_engine *e) {
    if (!e) return;
    kvb_stager_destroy(e->stager); /* no copy runs on */
    e->stager = NULL;
    kvb__seq_list *lists[] = {&e->waiting, &e->running, &e->swapped};
    for (int i = 0; i < 3; i++) {
        while (lists[i]->head) {
            kvb__seq *s = lists[i]->head;
            kvb__list_remove(lists[i], s);
            if (e->pool) kvb__seq_free(e, s);
        }
    }
    for (int k = 0; k < KVB__MECH_COUNT; k++)
        if (e->mech[k].iface && e->mech[k].iface->destroy) e->mech[k].iface->destroy(e->mech[k].ctx, e);
    kvb_forward_destroy(e->fw);
    kvb__exec_free(e);
    kvb_prefix_cache_destroy(e->pc);
    kvb_block_pool_destroy(e->pool);
    if (e->kv_mem_owned) {
        kvb_mem_free(kvb_model_backend(e->m)->mem, e->kv_mem);
    }
    kvb_planner_destroy(&e->planner);
    kvb__view_free(e);
    free(e->loans);
    kvb__host_tier_free(e);
    free(e);
}

kvb_status kvb_engine_add(kvb_engine *e, const kvb_request *r) { return kvb__sched_add(e, r); }

const char *kvb_engine_last_error(const kvb_engine *e) { return e->last_error; }

kvb_model *kvb_engine_model(const kvb_engine *e) { return e->m; }

const kvb_link_model *kvb_engine_links(const kvb_engine *e) { return kvb_stager_links(e->stager); }

kvb_status kvb_engine_cancel(kvb_engine *e, uint64_t id) {
    kvb__seq_list *lists[] = {&e->waiting, &e->running, &e->swapped}, *l = NULL;
    kvb__seq *s = NULL;
    for (int i = 0; i < 3 && !s; i++) s = kvb__find_seq(l = lists[i], id);
    if (!s) return KVB_ERR_NOT_FOUND;
    kvb__finish(e, l, s, KVB_FINISH_CANCELLED, KVB_OK);
    return KVB_OK;
}

kvb_status kvb_engine_step(kvb_engine *e) { return kvb__exec_step(e); }

kvb_status kvb_engine_plan_pool(kvb_engine *e, const kvb_planner *pl, const kvb_pool_event *ev, kvb_pool_plan *out) {
    const kvb_planner *use = pl ? pl : &e->planner;
    if (!use->iface || !use->iface->plan_pool) return KVB_ERR_UNSUPPORTED;
    *out = (kvb_pool_plan){.stage_slots = kvb_stager_n_buffers(e->stager) / 2};
    KVB_TRY(kvb__view_build(e));
    return use->iface->plan_pool(use->ctx, ev, &e->view, out);
}

int kvb_engine_n_live(const kvb_engine *e) { return e->waiting.n + e->running.n + e->swapped.n; }

int kvb_engine_planner_owns_kv(const kvb_engine *e) { return e->planner_kv; }
int kvb_engine_max_borrowed(const kvb_engine *e) { return e ? e->max_borrowed : -1; }

struct kvb_block_pool *kvb_engine_pool(kvb_engine *e) { return e->pool; }

const char *kvb_engine_planner_name(const kvb_engine *e) { return kvb__planner_name(e); }

void kvb_engine_get_stats(const kvb_engine *e, kvb_engine_stats *out) {
    *out = e->stats;
    out->blocks_total = kvb_block_pool_n_blocks(e->pool);
    out->blocks_free = kvb_prefix_cache_n_available(e->pc);
    if (kvb__sliced(e)) /* sliced: whole blocks' worth of slices not held by live requests (free or cached) */
        out->blocks_free = (int)((kvb_block_pool_n_slices(e->pool) - kvb_block_pool_referenced_slices(e->pool)) /
                                 e->geom.n_layers);
    out->stage_slots = kvb_stager_n_buffers(e->stager) / 2;
    out->n_running = e->running.n;
    out->n_waiting = e->waiting.n;
    out->n_stalled = 0;
    if (!kvb__sliced(e))
        for (const kvb__seq *s = e->waiting.head; s; s = s->next)
            out->n_stalled += kvb__seq_need_blocks(e, s) > out->blocks_total;
    out->blocks_own = kvb_block_pool_n_own(e->pool);
    out->blocks_borrowed = e->n_borrowed;
    out->n_swapped = e->swapped.n;
    out->host_tier_wb_in_flight = kvb__host_tier_in_flight(e);
    kvb_stager_totals(e->stager, out->links);
    out->prefix_cache = e->o.enable_prefix_cache;
}

void kvb_engine_stats_format(const kvb_engine *e, char *buf, size_t len) {
    kvb_engine_stats s;
    kvb_engine_get_stats(e, &s);
    kvb_slices_stats ss;
    kvb_engine_slices_stats(e, &ss);
    snprintf(buf, len,
             "policy=%s steps=%llu prompt_tokens=%llu generated_tokens=%llu preemptions=%llu prefix_hit_tokens=%llu "
             "blocks_total=%d pauses=%llu slices_prefetched=%llu slices_offloaded=%llu prefix_cache=%d "
             "max_running=%d swap_outs=%llu swap_ins=%llu offload_prefills=%llu recomputed_tokens=%llu dropped_blocks=%llu "
             "restored_blocks=%llu prefix_host_stores=%llu prefix_host_loads=%llu recomputed_row_layers=%llu hidden_restores=%llu hidden_saved_bytes=%llu host_link_bytes=%llu "
             "peer_link_bytes=%llu layer_in_host_waits=%llu layer_in_device_waits=%llu",
             kvb_engine_planner_name(e), (unsigned long long)s.steps, (unsigned long long)s.prompt_tokens,
             (unsigned long long)s.generated_tokens, (unsigned long long)s.preemptions,
             (unsigned long long)s.prefix_hit_tokens, s.blocks_total, (unsigned long long)s.pauses,
             (unsigned long long)ss.slices_prefetched, (unsigned long long)ss.slices_offloaded, s.prefix_cache,
             s.max_running, (unsigned long long)s.swap_outs, (unsigned long long)s.swap_ins,
             (unsigned long long)s.offload_prefills, (unsigned long long)s.recomputed_tokens, (unsigned long long)s.dropped_blocks,
             (unsigned long long)s.restored_blocks, (unsigned long long)s.prefix_host_stores,
             (unsigned long long)s.prefix_host_loads, (unsigned long long)s.recomputed_row_layers,
             (unsigned long long)s.hidden_restores,
             (unsigned long long)s.hidden_saved_bytes, (unsigned long long)s.links[KVB_LINK_HOST].bytes,
             (unsigned long long)s.links[KVB_LINK_PEER].bytes, (unsigned long long)s.layer_in_host_waits,
             (unsigned long long)s.layer_in_device_waits);
}

/* ---------------------------------------------------------------- the link model's time scale (link_calib.h)
 * Measured by running the model on an engine of its own; here, in the engine's own file, because an
 * engine made with a scaled preset no caller calibrated calibrates it first (kvb_engine_create). */

enum { CAL_BS = 16 };

static int cmp_d(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

/* Token `i` of request `r`'s prompt: the first ctx are its history, the rest differ per repetition. */
static int32_t tok_of(int r, int rep, int i, int ctx, int vocab) {
    uint64_t z = (uint64_t)r * 1000003u + (uint64_t)i * 7919u + (i >= ctx ? (uint64_t)(rep + 1) * 104729u : 0);
    z ^= z >> 17;
    z *= 0xed5ad4bbu;
    z ^= z >> 11;
    return (int32_t)(3 + z % (uint64_t)(vocab - 3));
}

/* The measurement's own plan (the engine needs a planner, and the policies that hold vLLM's sit above
 * this layer): running requests compute what is left of their prompt, then waiting ones are admitted in
 * arrival order, each taking its prefix hits, as far as the step's budget and max_seqs go. */
static kvb_status cal_plan(void *ctx, const kvb_view *v, kvb_plan *out) {
    (void)ctx;
    int left = v->max_batch_tokens, n = 0, bs = v->geom->block_size;
    for (int i = 0; i < v->n_reqs && left > 0 && n < v->max_seqs; i++) {
        const kvb_req_view *r = &v->reqs[i];
        kvb_plan_op op = {.id = r->id};
        if (r->state == KVB_REQ_RUNNING) {
            op.kind = KVB_OP_RUN;
            op.q_len = KVB_MIN(r->n_tokens - r->n_computed, left);
        } else if (r->state == KVB_REQ_WAITING) {
            kvb_prefix_probe pr;
            KVB_TRY(kvb_sched_probe(v, i, out, &pr));
            op.kind = KVB_OP_ADMIT;
            op.q_len = KVB_MIN(r->n_tokens - (pr.n_hit + pr.n_host_hit) * bs, left);
        } else {
            continue;
        }
        KVB_TRY(kvb_plan_push_op(out, op));
        left -= op.q_len;
        n++;
    }
    return KVB_OK;
}

static const kvb_planner_i cal_planner = {.name = "link-calibration", .plan_step = cal_plan};

/* Runs the engine until it has no live request; the steps' time less run-queue waits, seconds. */
static kvb_status run_out(kvb_engine *e, double *t_s) {
    double t = 0;
    while (kvb_engine_n_live(e) > 0) {
        uint64_t t0 = kvb_now_ns(), q0 = kvb_thread_runq_ns();
        KVB_TRY(kvb_engine_step(e));
        uint64_t dt = kvb_now_ns() - t0, dq = kvb_thread_runq_ns() - q0;
        t += (double)(dq < dt ? dt - dq : dt) * 1e-9;
    }
    if (t_s) *t_s = t;
    return KVB_OK;
}

kvb_status kvb_link_measure_step(kvb_model *m, const kvb_link_point *p, int reps, double *step_s) {
    const kvb_model_config *c = kvb_model_cfg(m);
    int ctx = KVB_MAX(CAL_BS, (int)lround(p->ctx / CAL_BS) * CAL_BS);
    if (p->batch < 1 || p->q < 1 || reps < 1 || ctx + p->q + 1 > c->max_pos || c->vocab < 4) {
        KVB_LOG_E("link calibration: a step of %d x %d tokens over %d does not fit the model (context %d)", p->batch,
                  p->q, ctx, c->max_pos);
        return KVB_ERR_INVALID;
    }
    int len = ctx + p->q, per_req = (len + CAL_BS - 1) / CAL_BS + 1;
    kvb_engine_opts o;
    kvb_engine_opts_default(&o);
    o.block_size = CAL_BS;
    o.n_blocks = 2 * p->batch * per_req + 4; /* the histories stay cached while a repetition runs */
    o.max_seqs = p->batch;
    o.max_batch_tokens = KVB_MAX(p->batch * p->q, 256);
    o.enable_prefix_cache = 1;
    kvb_engine *e = NULL;
    int32_t *prompt = NULL;
    double *t = NULL;
    kvb_status st;
    KVB_TRY_GOTO(kvb_malloc((size_t)len * sizeof *prompt, (void **)&prompt), out);
    KVB_TRY_GOTO(kvb_calloc((size_t)reps + 1, sizeof *t, (void **)&t), out);
    KVB_TRY_GOTO(kvb_engine_create(m, &o, &(kvb_planner){.iface = &cal_planner}, NULL, &e), out);
    uint64_t id = 1;
    /* the histories, prefilled once and left in the prefix cache */
    for (int r = 0; r < p->batch; r++) {
        for (int i = 0; i < ctx; i++) prompt[i] = tok_of(r, 0, i, ctx, c->vocab);
        kvb_request rq = {.id = id++, .prompt = prompt, .n_prompt = ctx, .max_tokens = 1};
        KVB_TRY_GOTO(kvb_engine_add(e, &rq), out);
    }
    KVB_TRY_GOTO(run_out(e, NULL), out);
    /* each repetition: every request's q new tokens over its cached history, in one step (the budget
     * holds them all), and its first token sampled there */
    for (int rep = 0; rep <= reps; rep++) {
        for (int r = 0; r < p->batch; r++) {
            for (int i = 0; i < len; i++) prompt[i] = tok_of(r, rep, i, ctx, c->vocab);
            kvb_request rq = {.id = id++, .prompt = prompt, .n_prompt = len, .max_tokens = 1};
            KVB_TRY_GOTO(kvb_engine_add(e, &rq), out);
        }
        KVB_TRY_GOTO(run_out(e, &t[rep]), out);
    }
    qsort(t + 1, (size_t)reps, sizeof *t, cmp_d); /* the first repetition warms the caches */
    *step_s = reps % 2 ? t[1 + reps / 2] : 0.5 * (t[reps / 2] + t[1 + reps / 2]);
    st = KVB_OK;
out:
    kvb_engine_destroy(e);
    free(prompt);
    free(t);
    return st;
}

kvb_status kvb_link_calibrate(kvb_model *m, const kvb_link_point *p, kvb_link_model *lm) {
    if (!lm->calibrate) return KVB_OK;
    const kvb_model_config *c = kvb_model_cfg(m);
    kvb_link_point def = {.batch = 4, .q = 1, .ctx = KVB_MIN(512, (c->max_pos - 2) / CAL_BS * CAL_BS)};
    if (!p) p = &def;
    kvb_link_point pt = *p;
    pt.ctx = KVB_MAX(CAL_BS, (int)lround(pt.ctx / CAL_BS) * CAL_BS); /* what kvb_link_measure_step runs */
    double step;
    KVB_TRY(kvb_link_measure_step(m, &pt, 7, &step));
    kvb_kv_geom g = kvb_model_kv_geom(m, 1);
    double kv_bytes = (double)kvb_kv_layer_bytes(&g); /* one token, one layer: K and V */
    if (p->target_ctx > 0 && p->ctx > 0) pt.target_ctx = p->target_ctx * pt.ctx / p->ctx; /* the rounding, on both sides */
    return kvb_link_scale(lm, &pt, step, c->n_layers, kv_bytes);
}
