/* kvbank — token sampling: greedy, or temperature with top-k and top-p, reproducible from a seed. */
#ifndef KVB_SCHED_SAMPLING_H
#define KVB_SCHED_SAMPLING_H

#include <stdint.h>

#include "common/util/util.h"

typedef struct kvb_sampling {
    float temperature; /* <= 0: greedy (argmax, lowest id on ties) */
    int top_k;         /* 0: off */
    float top_p;       /* >= 1 or <= 0: off */
    uint64_t seed;
} kvb_sampling;

/* Per-request random state (splitmix64 seeded with the request's seed). */
typedef struct kvb_rng {
    uint64_t s;
} kvb_rng;

void kvb_rng_seed(kvb_rng *r, uint64_t seed);
/* Uniform in [0, 1). */
double kvb_rng_uniform(kvb_rng *r);

/* Validates a sampling configuration (finite temperature, top_k >= 0, top_p in [0, 1]). */
kvb_status kvb_sampling_check(const kvb_sampling *s);

/* Chooses a token from logits[vocab]. `scratch` must hold 2*vocab floats (indices and probabilities
 * for the sorted candidates). Greedy ignores rng and scratch. */
int32_t kvb_sample(const kvb_sampling *s, kvb_rng *rng, const float *logits, int vocab, float *scratch);

#endif
