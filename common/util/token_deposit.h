/* kvbank — Token-Deposit (OrbitFlow §3.2): when the tokens of a request reach its user.
 *
 * "Upon generation, the token is simply appended to Token-Deposit. While the deposit is non-empty,
 * the Executor delivers exactly one token per SLO interval. [...] the next token is delivered as soon
 * as it is generated. [...] Once a request finishes, [...] any remaining tokens are delivered in a
 * single burst." With g_i the generation time of token i and d_i its delivery time:
 *
 *     d_0 = g_0                          (the first token is never held: TTFT is not paced)
 *     d_i = max(g_i, d_{i-1} + slo)      (one token per SLO interval while the deposit holds any)
 *     on finish at time f: every token still held is delivered at f.
 *
 * The deposit level at time t is the number of tokens generated but not yet delivered:
 * #{ i : g_i <= t < d_i }. The HTTP gateway paces its streams with these functions and OrbitFlow's
 * planner (common/policy) computes deposit levels with the same ones, so both agree on what a user
 * sees. Pure functions of their arguments; times are in any one unit (the callers use ns). */
#ifndef KVB_UTIL_TOKEN_DEPOSIT_H
#define KVB_UTIL_TOKEN_DEPOSIT_H

#include <stdint.h>

/* Delivery time of a token generated at `gen` whose predecessor was delivered at `prev_delivery`
 * (`first`: there is no predecessor; `prev_delivery` is then ignored). slo 0 disables pacing. */
static inline uint64_t kvb_deposit_next(int first, uint64_t prev_delivery, uint64_t gen, uint64_t slo) {
    if (first) return gen;
    uint64_t paced = prev_delivery + slo;
    return paced > gen ? paced : gen;
}

/* Fills deliv[0..n) from gen[0..n) (non-decreasing) with kvb_deposit_next; when `finish` is nonzero
 * the request finished at time `finish` (>= gen[n-1]) and every token due later is delivered then.
 * Returns the deposit level just before the finish burst (tokens due after `finish`; 0 if finish is 0). */
static inline int kvb_deposit_schedule(const uint64_t *gen, int n, uint64_t slo, uint64_t finish, uint64_t *deliv) {
    int held = 0;
    for (int i = 0; i < n; i++) {
        deliv[i] = kvb_deposit_next(i == 0, i ? deliv[i - 1] : 0, gen[i], slo);
        if (finish && deliv[i] > finish) {
            deliv[i] = finish;
            held++;
        }
    }
    return held;
}

/* Deposit level at time t: tokens generated at or before t whose delivery is later than t. */
static inline int kvb_deposit_level(const uint64_t *gen, const uint64_t *deliv, int n, uint64_t t) {
    int level = 0;
    for (int i = 0; i < n; i++)
        if (gen[i] <= t && deliv[i] > t) level++;
    return level;
}

#endif
