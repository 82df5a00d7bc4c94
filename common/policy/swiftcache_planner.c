/* kvbank — `swiftcache`: SwiftCache's decisions as a planner (../shared/papers/swiftcache.txt).
 *
 * Master side (§3.2-3.3): borrowed blocks are read in place by default (lent memory addressable, as on
 * one GPU or the host backend: docs/design.md); with lsc=stream they go through the layer stream cache
 * instead: every borrowed block of a step is read through stage buffers, its layer slice loaded before
 * the layer and the rows the step wrote stored back after it (residency STREAM). The LSC holds two
 * single-layer buffers per attached block (plan_pool ATTACH / DETACH), so a step never needs more than
 * exist: Eq. 4's N_LSC when the caller attaches at most K_master blocks. Scheduling is vLLM's
 * (kvb_sched_fcfs). */
#include <string.h>

#include "common/policy/policy.h"
#include "common/sched/scheduler.h"

typedef struct swift {
    int stream; /* lsc=stream */
} swift;

static kvb_status swift_plan_step(void *ctx, const kvb_view *v, kvb_plan *out) {
    const swift *s = ctx;
    if (s->stream && v->pool.n_borrowed > 0) out->lent_default = KVB_RES_STREAM;
    return kvb_sched_fcfs(v, NULL, out);
}

static kvb_status swift_plan_pool(void *ctx, const kvb_pool_event *ev, const kvb_view *v, kvb_pool_plan *out) {
    const swift *s = ctx;
    if (ev->kind == KVB_POOL_SETUP || ev->kind == KVB_POOL_ATTACH || ev->kind == KVB_POOL_DETACH)
        out->stage_slots = s->stream ? v->pool.n_borrowed : 0;
    return KVB_OK;
}

static void swift_destroy(void *ctx) { free(ctx); }

static const kvb_planner_i swift_iface = {
    .name = "swiftcache",
    .plan_step = swift_plan_step,
    .plan_pool = swift_plan_pool,
    .destroy = swift_destroy,
};

kvb_status kvb_policy_swiftcache_create(const kvb_policy_params *params, kvb_planner *out) {
    static const char *const known[] = {"lsc", NULL};
    static const char *const lsc[] = {"inplace", "stream", NULL};
    KVB_TRY(kvb_policy_params_check(params, "swiftcache", known));
    int mode = 0;
    KVB_TRY(kvb_policy_param_choice(params, "swiftcache", "lsc", lsc, &mode));
    swift *s = NULL;
    KVB_TRY(kvb_calloc(1, sizeof *s, (void **)&s));
    s->stream = mode == 1;
    *out = (kvb_planner){.iface = &swift_iface, .ctx = s};
    return KVB_OK;
}
