/* kvbank — the engine's public API: create and destroy, requests, the step, statistics. The work is in
 * scheduler.c (queue, view, FCFS), executor.c (plans, the forward pass), stager.c (copies),
 * host_tier.c and lending.c (see state.h). */
#include "common/sched/engine.h"
#include "common/sched/link_calib.h"

#include <stdio.h>
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
                  .engine = e, .links = &e->o.links};
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
    if (pl.iface && !pl.iface->plan_step) {
        KVB_LOG_E("engine: planner %s has no plan_step", pl.iface->name ? pl.iface->name : "?");
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
    KVB_TRY_GOTO(kvb_calloc((size_t)o.max_seqs, sizeof *e->sched, (void **)&e->sched), fail);
    KVB_TRY_GOTO(kvb_calloc((size_t)e->max_rows, sizeof *e->b_tokens, (void **)&e->b_tokens), fail);
    KVB_TRY_GOTO(kvb_calloc((size_t)e->max_rows, sizeof *e->b_pos, (void **)&e->b_pos), fail);
    /* two attention sequences per request: its recomputed prefix (n_absent) and its new tokens */
    KVB_TRY_GOTO(kvb_calloc(2 * (size_t)o.max_seqs, sizeof *e->b_seqs, (void **)&e->b_seqs), fail);
    KVB_TRY_GOTO(kvb_calloc((size_t)o.max_seqs, sizeof *e->b_logit_rows, (void **)&e->b_logit_rows), fail);
    KVB_TRY_GOTO(kvb_calloc((size_t)o.max_seqs * c->vocab, sizeof(float), (void **)&e->logits), fail);
    KVB_TRY_GOTO(kvb_calloc(2 * (size_t)c->vocab, sizeof(float), (void **)&e->sample_scratch), fail);
    KVB_TRY_GOTO(kvb_calloc((size_t)c->n_layers, sizeof *e->t_layer, (void **)&e->t_layer), fail);
    KVB_TRY_GOTO(kvb_calloc((size_t)c->n_layers, sizeof *e->t_wait, (void **)&e->t_wait), fail);
    KVB_TRY_GOTO(kvb_calloc((size_t)c->n_layers, sizeof *e->t_copy, (void **)&e->t_copy), fail);
    KVB_TRY_GOTO(kvb_calloc((size_t)c->n_layers, sizeof *e->t_pfx, (void **)&e->t_pfx), fail);
    KVB_TRY_GOTO(kvb_calloc((size_t)c->n_layers, sizeof *e->l_rows, (void **)&e->l_rows), fail);
    KVB_TRY_GOTO(kvb_calloc((size_t)c->n_layers, sizeof *e->l_seqs, (void **)&e->l_seqs), fail);
    KVB_TRY_GOTO(kvb_calloc((size_t)e->o.max_seqs, sizeof *e->pfx_ord, (void **)&e->pfx_ord), fail);
    if (pp.stage_slots > 0) KVB_TRY_GOTO(kvb__stage_reserve(e, pp.stage_slots), fail);
    e->max_borrowed = pp.limit_borrowed ? pp.max_borrowed : -1;
    if (pp.host_tier_blocks > 0) KVB_TRY_GOTO(kvb__host_tier_init(e, pp.host_tier_blocks, pp.host_prefix,
                                                                        pp.host_layered), fail);
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
    seq_list *lists[] = {&e->waiting, &e->running, &e->swapped};
    for (int i = 0; i < 3; i++) {
        while (lists[i]->head) {
            seq *s = lists[i]->head;
            kvb__list_remove(lists[i], s);
            if (e->pool) kvb__seq_free(e, s);
        }
    }
    kvb_forward_destroy(e->fw);
    kvb__exec_free(e);
    kvb_prefix_cache_destroy(e->pc);
    kvb_block_pool_destroy(e->pool);
    if (e->kv_mem_owned) {
        kvb_mem_free(kvb_model_backend(e->m)->mem, e->kv_mem);
    }
    kvb_planner_destroy(&e->planner);
    kvb__sched_free(e);
    free(e->loans);
    kvb__host_tier_free(e);
    kvb__slices_free(e);
    free(e);
}

kvb_status kvb_engine_add(kvb_engine *e, const kvb_request *r) { return kvb__sched_add(e, r); }

const char *kvb_engine_last_error(const kvb_engine *e) { return e->last_error; }

kvb_model *kvb_engine_model(const kvb_engine *e) { return e->m; }

const kvb_link_model *kvb_engine_links(const kvb_engine *e) { return kvb_stager_links(e->stager); }

kvb_status kvb_engine_cancel(kvb_engine *e, uint64_t id) {
    seq_list *lists[] = {&e->waiting, &e->running, &e->swapped}, *l = NULL;
    seq *s = NULL;
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

const char *kvb_engine_planner_name(const kvb_engine *e) {
    return e->planner.iface && e->planner.iface->name ? e->planner.iface->name : "fcfs";
}

void kvb_engine_get_stats(const kvb_engine *e, kvb_engine_stats *out) {
    *out = e->stats;
    out->blocks_total = kvb_block_pool_n_blocks(e->pool);
    out->blocks_free = kvb_prefix_cache_n_available(e->pc);
    if (e->sl) /* sliced: whole blocks' worth of slices not held by live requests (free or cached) */
        out->blocks_free = (int)((kvb_block_pool_n_slices(e->pool) - kvb_block_pool_referenced_slices(e->pool)) /
                                 e->geom.n_layers);
    out->stage_slots = kvb_stager_n_buffers(e->stager) / 2;
    out->n_running = e->running.n;
    out->n_waiting = e->waiting.n;
    out->blocks_own = kvb_block_pool_n_own(e->pool);
    out->blocks_borrowed = e->n_borrowed;
    out->n_swapped = e->swapped.n;
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
             "peer_link_bytes=%llu",
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
             (unsigned long long)s.links[KVB_LINK_PEER].bytes);
}
