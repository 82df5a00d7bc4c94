/* kvbank — `host-tier`: the baseline SwiftCache is compared against (§4, "host-memory prefix cache"): a
 * host tier of blocks=N blocks behind the prefix cache. A cached block the pool evicts is copied to the
 * host tier, and a prefix match that ends in the pool continues there, each hit copied back into a new
 * pool block (over the stager's host link, so the link model applies): with layered=1 (the default,
 * issue 10) layer by layer behind the compute, one transfer per layer for the step's hits, each layer
 * waiting only for its own, as the paper's baseline loads; layered=0 copies each admission's hits whole
 * before the step (the earlier behaviour, kept to measure the difference). With writeback=async (the
 * default) the blocks the next step may evict are written back ahead, asynchronously, as HiCache's
 * write-through and LMCache's store run on a copy stream of their own (host_tier.c); writeback=sync
 * copies each block when the pool evicts it, before the step's forward pass. Scheduling is vLLM's
 * (kvb_fcfs). */
#include "common/policy/policy.h"
#include "common/policy/fcfs.h"

typedef struct host_tier {
    int64_t blocks;  /* 0: as many as the pool's own memory holds */
    int64_t layered; /* hits load layer by layer behind the compute (1) or whole before the step (0) */
    int async_wb;    /* evictions written back ahead, asynchronously (1), or when evicted (0) */
} host_tier;

static kvb_status ht_plan_step(void *ctx, const kvb_view *v, kvb_plan *out) {
    (void)ctx;
    return kvb_fcfs(v, NULL, out);
}

static kvb_status ht_plan_pool(void *ctx, const kvb_pool_event *ev, const kvb_view *v, kvb_pool_plan *out) {
    const host_tier *h = ctx;
    if (ev->kind != KVB_POOL_SETUP) return KVB_OK;
    if (!v->prefix_cache) {
        KVB_LOG_E("policy host-tier: the host tier sits behind the prefix cache, which is off");
        return KVB_ERR_INVALID;
    }
    out->host_tier_blocks = (int)(h->blocks > 0 ? h->blocks : v->pool.capacity);
    out->host_prefix = 1;
    out->host_layered = h->layered != 0;
    out->host_async_writeback = h->async_wb;
    return KVB_OK;
}

static void ht_destroy(void *ctx) { free(ctx); }

static const kvb_planner_i ht_iface = {
    .name = "host-tier",
    .plan_step = ht_plan_step,
    .plan_pool = ht_plan_pool,
    .destroy = ht_destroy,
};

kvb_status kvb_policy_host_tier_create(const kvb_policy_params *params, kvb_planner *out) {
    static const char *const known[] = {"blocks", "layered", "writeback", NULL};
    static const char *const writeback[] = {"sync", "async", NULL};
    KVB_TRY(kvb_policy_params_check(params, "host-tier", known));
    host_tier *h = NULL;
    KVB_TRY(kvb_calloc(1, sizeof *h, (void **)&h));
    h->layered = 1;
    h->async_wb = 1;
    kvb_status st = kvb_policy_param_i64(params, "host-tier", "blocks", 1, 1 << 30, &h->blocks);
    if (st == KVB_OK) st = kvb_policy_param_i64(params, "host-tier", "layered", 0, 1, &h->layered);
    if (st == KVB_OK) st = kvb_policy_param_choice(params, "host-tier", "writeback", writeback, &h->async_wb);
    if (st != KVB_OK) {
        free(h);
        return st;
    }
    *out = (kvb_planner){.iface = &ht_iface, .ctx = h};
    return KVB_OK;
}
