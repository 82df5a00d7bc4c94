/* kvbank — OrbitFlow core: helpers shared by the files of common/policy/orbitflow*.c (not public). */
#ifndef KVB_POLICY_ORBITFLOW_IMPL_H
#define KVB_POLICY_ORBITFLOW_IMPL_H

#include "common/policy/orbitflow.h"

/* KVB_ERR_INVALID for a malformed problem (sizes, bounds, shared blocks beyond a request's full ones). */
kvb_status kvb__of_check(const kvb_of_problem *p);
/* 1 if request r is in the batch (not excluded). */
int kvb__of_active(const kvb_of_problem *p, int r);
/* Blocks of request r in shared segments, and its own (unshared) blocks at window step s. */
int64_t kvb__of_shared(const kvb_of_problem *p, int r);
int64_t kvb__of_own(const kvb_of_problem *p, int r, int s);
/* Context tokens of the batch at window step s (what comp_l scales with). */
double kvb__of_tokens(const kvb_of_problem *p, int s);
/* Seconds to whole nanoseconds (how times are compared and fed to Token-Deposit). */
int64_t kvb__of_ns(double s);
/* Token-Deposit over a window: due[r] starts at the slack and slo_ns[r] is the SLO (0: none or not in
 * the batch), both ns; kvb__of_fails takes the generation time g_ns of one step's tokens, returns the
 * requests that step fails and advances due[]. */
void kvb__of_due_init(const kvb_of_problem *p, uint64_t *due, uint64_t *slo_ns);
int kvb__of_fails(int n, const uint64_t *slo_ns, uint64_t g_ns, uint64_t *due);

#endif
