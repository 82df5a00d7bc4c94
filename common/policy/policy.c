/* kvbank — the baseline planner: preemption by recompute (vLLM). */
#include "common/policy/policy.h"

#include <string.h>

static int recompute_pick_victim(void *ctx, const kvb_seq_info *running, int n) {
    int v = 0;
    for (int i = 1; i < n; i++)
        if (running[i].arrival > running[v].arrival) v = i;
    return v;
}

static const kvb_planner_i recompute_iface = {
    .name = "recompute",
    .pick_victim = recompute_pick_victim,
    .destroy = NULL,
};

kvb_planner kvb_policy_recompute(void) { return (kvb_planner){.iface = &recompute_iface, .ctx = NULL}; }

kvb_status kvb_policy_by_name(const char *name, kvb_planner *out) {
    if (name && !strcmp(name, "recompute")) {
        *out = kvb_policy_recompute();
        return KVB_OK;
    }
    KVB_LOG_E("unknown policy \"%s\" (available: recompute)", name ? name : "");
    return KVB_ERR_NOT_FOUND;
}
