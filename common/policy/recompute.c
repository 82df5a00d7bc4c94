/* kvbank — `recompute`, the baseline planner: vLLM's scheduler (kvb_fcfs) with preemption of the
 * most recently admitted request by recompute (its KV is dropped, its tokens are kept). */
#include "common/policy/policy.h"
#include "common/policy/fcfs.h"

static kvb_status recompute_plan_step(void *ctx, const kvb_view *v, kvb_plan *out) {
    (void)ctx;
    return kvb_fcfs(v, NULL, out);
}

static const kvb_planner_i recompute_iface = {
    .name = "recompute",
    .plan_step = recompute_plan_step,
};

kvb_planner kvb_policy_recompute(void) { return (kvb_planner){.iface = &recompute_iface, .ctx = NULL}; }

kvb_status kvb_policy_recompute_create(const kvb_policy_params *params, kvb_planner *out) {
    static const char *const known[] = {NULL};
    KVB_TRY(kvb_policy_params_check(params, "recompute", known));
    *out = kvb_policy_recompute();
    return KVB_OK;
}
