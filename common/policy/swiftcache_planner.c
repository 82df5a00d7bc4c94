/* kvbank — `swiftcache`: SwiftCache's decisions as a planner (../shared/papers/swiftcache.txt).
 *
 * Master side (§3.2-3.3): borrowed blocks are read in place by default (lent memory addressable, as on
 * one GPU or the host backend: docs/papers/swiftcache.md); with lsc=stream they go through the layer stream cache
 * instead: every borrowed block of a step is read through stage buffers, its layer slice loaded before
 * the layer and the rows the step wrote stored back after it (residency STREAM). The LSC holds two
 * single-layer buffers per streamed block. With lenders_bytes (the KV bytes the node's workers can
 * lend) the LSC comes out of the master's own KV budget, sized by Eq. 1-5 with kvbank's two buffers per
 * block (kvb_swift_plan_lsc: n_stream blocks, the pool the rest), and an attach beyond n_stream is
 * refused (the engine says so: kvb_engine_max_borrowed; the node master registers it with the
 * coordinator, which caps the workers' offers); without it the LSC holds two buffers per attached block
 * beside the budget (in-process use only: the node master passes lenders_bytes, docs/lending.md). Scheduling is vLLM's (kvb_fcfs).
 *
 * Worker side (§3.5 Alg. 1, plan_pool): the window of the last window_s seconds' request lengths
 * (line 22); on a request SCALEUP asks back what the longest request needs (line 6-12); every tick
 * SCALEDOWN lends what the longest request of the window does not need (lines 14-21), capped by the free
 * tail and rounded down to the MEU; a starved worker asks back what its longest live request needs, at
 * least one MEU; blocks returned unasked count as demand for one window. The worker (worker/worker.c)
 * runs the protocol and carries out the amounts. */
#include <inttypes.h>
#include <stdio.h>
#include <string.h>

#include "common/kv/block_pool.h"
#include "common/policy/policy.h"
#include "common/policy/swiftcache.h"
#include "common/policy/fcfs.h"

#define WINDOW_CAP0 64 /* initial samples of Alg. 1's window */

typedef struct swift {
    int stream;           /* lsc=stream */
    int64_t lenders_bytes; /* stream: KV bytes the node's workers can lend (Eq. 2's C_i summed); > 0: the
                           * LSC comes out of the master's budget */
    int lsc_slots;        /* stream, within budget: lent blocks streamed at once (set at SETUP) */
    kvb_swift_window win; /* Alg. 1 line 22: prompt + max_tokens of each request, by arrival time */
} swift;

static kvb_status swift_plan_step(void *ctx, const kvb_view *v, kvb_plan *out) {
    const swift *s = ctx;
    if (s->stream && v->pool.n_borrowed > 0) out->lent_default = KVB_RES_STREAM;
    return kvb_fcfs(v, NULL, out);
}

/* Alg. 1 SCALEUP for `tokens`, at least one MEU when `starved`. */
static void scale_up(const kvb_pool_event *ev, int bs, int64_t tokens, int starved, kvb_pool_plan *out) {
    uint32_t mw = ev->meu_worker ? ev->meu_worker : 1, mm = ev->meu_master ? ev->meu_master : 1;
    int64_t d_w = 0, d_m = 0;
    kvb_swift_scale_up(ev->own_soon, bs, mw, mm, tokens, &d_w, &d_m);
    if (d_w == 0 && starved) d_w = mw;
    out->reclaim = d_w;
    if (d_w > 0)
        snprintf(out->why, sizeof out->why, "Alg. 1 SCALEUP: a request of %" PRId64 " tokens%s", tokens,
                 starved ? ", requests waiting" : "");
}

static kvb_status swift_plan_pool(void *ctx, const kvb_pool_event *ev, const kvb_view *v, kvb_pool_plan *out) {
    swift *s = ctx;
    int bs = v->geom->block_size;
    switch (ev->kind) {
    case KVB_POOL_SETUP:
        if (s->stream && s->lenders_bytes > 0) { /* Eq. 1-5 within the master's budget */
            kvb_swift_plan p;
            uint64_t lend = (uint64_t)s->lenders_bytes;
            KVB_TRY(kvb_swift_plan_lsc(v->geom, (uint64_t)v->pool.capacity * kvb_kv_block_bytes(v->geom), &lend, 1, &p));
            s->lsc_slots = (int)p.n_stream;
            out->lsc_own_blocks = (int)p.lsc_own_blocks;
            out->stage_slots = s->lsc_slots;
            out->limit_borrowed = 1; /* an attach beyond lsc_slots is refused below */
            out->max_borrowed = s->lsc_slots;
            break;
        }
        /* fall through */
    case KVB_POOL_ATTACH:
    case KVB_POOL_DETACH:
        if (!s->stream) out->stage_slots = 0;
        else if (!s->lenders_bytes) out->stage_slots = v->pool.n_borrowed; /* beside the budget (in-process use) */
        else if (v->pool.n_borrowed <= s->lsc_slots) out->stage_slots = s->lsc_slots;
        else { /* refused: the LSC cannot stream that many */
            KVB_LOG_W("swiftcache: %d borrowed blocks, the layer stream cache streams at most %d (Eq. 4 within "
                      "the master's budget)", v->pool.n_borrowed, s->lsc_slots);
            out->stage_slots = -1;
        }
        break;
    case KVB_POOL_REQUEST:
        kvb_swift_window_add(&s->win, ev->now_s, ev->tokens);
        scale_up(ev, bs, ev->tokens, 0, out); /* Alg. 1 SCALEUP is triggered by the incoming request */
        break;
    case KVB_POOL_RETURNED: /* someone wants this worker to hold its blocks: demand for one window */
        kvb_swift_window_add(&s->win, ev->now_s, (int64_t)ev->n_blocks * bs);
        break;
    case KVB_POOL_TICK: {
        if (ev->starved) {
            scale_up(ev, bs, ev->live_max_tokens, 1, out);
            break;
        }
        if (!ev->meu_worker || !ev->meu_master) break; /* lend nothing before the MEU is known */
        int64_t max_len = kvb_swift_window_max(&s->win, ev->now_s);
        if (ev->live_max_tokens > max_len) max_len = ev->live_max_tokens; /* older requests still run */
        int64_t d_w = 0, d_m = 0;
        kvb_swift_scale_down(v->pool.n_own, bs, ev->meu_worker, ev->meu_master, max_len, &d_w, &d_m);
        int64_t tail = ev->free_tail - ev->free_tail % ev->meu_worker;
        out->lend = d_w > tail ? tail : d_w;
        if (out->lend > 0)
            snprintf(out->why, sizeof out->why, "Alg. 1 SCALEDOWN: longest request %" PRId64 " tokens in the window",
                     max_len);
        break;
    }
    }
    out->demand_tokens = kvb_swift_window_max(&s->win, ev->now_s);
    return KVB_OK;
}

static void swift_destroy(void *ctx) {
    swift *s = ctx;
    kvb_swift_window_free(&s->win);
    free(s);
}

static const kvb_planner_i swift_iface = {
    .name = "swiftcache",
    .plan_step = swift_plan_step,
    .plan_pool = swift_plan_pool,
    .destroy = swift_destroy,
};

kvb_status kvb_policy_swiftcache_create(const kvb_policy_params *params, kvb_planner *out) {
    static const char *const known[] = {"lsc", "window_s", "lenders_bytes", NULL};
    static const char *const lsc[] = {"inplace", "stream", NULL};
    KVB_TRY(kvb_policy_params_check(params, "swiftcache", known));
    int mode = 0;
    double window_s = 60.0;
    KVB_TRY(kvb_policy_param_choice(params, "swiftcache", "lsc", lsc, &mode));
    KVB_TRY(kvb_policy_param_f64(params, "swiftcache", "window_s", 0.001, 7 * 86400.0, &window_s));
    int64_t lenders_bytes = 0;
    KVB_TRY(kvb_policy_param_i64(params, "swiftcache", "lenders_bytes", 0, INT64_MAX / 2, &lenders_bytes));
    swift *s = NULL;
    KVB_TRY(kvb_calloc(1, sizeof *s, (void **)&s));
    s->stream = mode == 1;
    s->lenders_bytes = lenders_bytes;
    kvb_status st = kvb_swift_window_init(&s->win, window_s, WINDOW_CAP0);
    if (st != KVB_OK) {
        free(s);
        return st;
    }
    *out = (kvb_planner){.iface = &swift_iface, .ctx = s};
    return KVB_OK;
}
