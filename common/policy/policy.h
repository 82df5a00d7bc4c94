/* kvbank — planners: the policies that decide what the engine does when memory is short.
 * Each is a kvb_planner (common/sched/engine.h). This one policy is the first baseline. */
#ifndef KVB_POLICY_POLICY_H
#define KVB_POLICY_POLICY_H

#include "common/sched/engine.h"

/* vLLM's default: when blocks run out, preempt the most recently admitted running sequence and
 * recompute it later (its KV is dropped, its tokens are kept). */
kvb_planner kvb_policy_recompute(void);

/* The planner called `name` ("recompute"); KVB_ERR_NOT_FOUND for an unknown name. */
kvb_status kvb_policy_by_name(const char *name, kvb_planner *out);

#endif
