/* kvbank — token sampling: vLLM's logits processors, greedy or a seeded draw, and logprobs.
 *
 * A row of logits becomes a token through a pipeline of stages, in vLLM V1's order
 * (vllm/v1/sample/sampler.py, Sampler.forward):
 *   1. masks             a structured-output token mask (-inf outside it; vLLM applies its grammar
 *                        bitmask to the logits before the sampler sees them)
 *   2. raw logprobs      log-softmax of the logits as they are now (vLLM's default logprobs_mode,
 *                        "raw_logprobs"): what logprobs / top_logprobs report (kvb_logprobs)
 *   3. processors        min_tokens (stop ids -inf until min_tokens outputs), logit_bias (+= bias),
 *                        then the penalties: repetition (prompt and output: positive logits divided,
 *                        negative multiplied), frequency (-= f x count in the output), presence (-= p
 *                        for each token in the output): kvb_logits_process
 *   4. greedy            argmax (lowest id on ties), when temperature is 0
 *   5. the draw          temperature, min_p (tokens below min_p x the most likely probability drop),
 *                        top-k, top-p, then one uniform draw from the request's kvb_rng: kvb_sample
 * Each stage is a function over the row, so that another (a grammar's mask) is one more call before
 * stage 2. With every processor off the row is not touched: greedy output is the model's argmax. */
#ifndef KVB_SCHED_SAMPLING_H
#define KVB_SCHED_SAMPLING_H

#include <stdint.h>

#include "common/util/util.h"

#define KVB_MAX_TOP_LOGPROBS 20   /* vLLM's default max_logprobs */
#define KVB_MAX_LOGIT_BIAS 1024   /* logit_bias entries one request may carry */

/* One logit_bias entry (OpenAI: a token id and a bias in [-100, 100] added to its logit). */
typedef struct kvb_logit_bias {
    int32_t id;
    float bias;
} kvb_logit_bias;

typedef struct kvb_sampling {
    float temperature; /* <= 0: greedy (argmax, lowest id on ties) */
    int top_k;         /* 0: off */
    float top_p;       /* >= 1 or <= 0: off */
    uint64_t seed;
    /* vLLM's SamplingParams beyond those (all zero: off) */
    float min_p;              /* [0, 1] */
    float presence_penalty;   /* [-2, 2] (OpenAI's range) */
    float frequency_penalty;  /* [-2, 2] */
    float repetition_penalty; /* >= 0; 0 or 1: off */
    int min_tokens;           /* >= 0 */
    const kvb_logit_bias *logit_bias; /* [n_logit_bias] borrowed; ids distinct (the last one wins) */
    int n_logit_bias;         /* [0, KVB_MAX_LOGIT_BIAS] */
    /* what is reported with the tokens */
    int logprobs;             /* 1: each sampled token's logprob and top_logprobs alternatives */
    int top_logprobs;         /* [0, KVB_MAX_TOP_LOGPROBS] */
    int prompt_logprobs;      /* 1: the prompt tokens' logprobs too (all but the first) */
} kvb_sampling;

/* Per-request random state (splitmix64 seeded with the request's seed). */
typedef struct kvb_rng {
    uint64_t s;
} kvb_rng;

void kvb_rng_seed(kvb_rng *r, uint64_t seed);
/* Uniform in [0, 1). */
double kvb_rng_uniform(kvb_rng *r);

/* Validates a sampling configuration against a vocabulary of `vocab` tokens (0: ids only checked to be
 * >= 0): finite temperature >= 0, top_k >= 0, top_p and min_p in [0, 1], penalties in their ranges,
 * min_tokens >= 0, top_logprobs <= KVB_MAX_TOP_LOGPROBS, logit_bias ids in the vocabulary with finite
 * biases. KVB_ERR_INVALID with a sentence naming the field in why[len] (may be NULL). */
kvb_status kvb_sampling_check(const kvb_sampling *s, int vocab, char *why, size_t len);

/* 1 when a processor of stage 3 is on. */
int kvb_sampling_processes(const kvb_sampling *s);

/* What the processors read of a request besides its parameters. */
typedef struct kvb_sample_seq {
    const int32_t *tokens;   /* [n_tokens]: the prompt, then the output */
    int n_tokens;
    int out_start;           /* tokens[out_start, n_tokens) are the output so far */
    const int32_t *stop_ids; /* [n_stop] (EOS among them): masked while the output is below min_tokens */
    int n_stop;
} kvb_sample_seq;

/* Stage 3 over logits[vocab], in place: min_tokens, logit_bias, repetition, frequency and presence
 * penalties (vLLM's MinTokens and LogitBias processors, then apply_penalties). `counts` is [vocab]
 * zeros and is left zeros (the occurrences of each token, set and cleared over the request's tokens:
 * O(n_tokens), never O(vocab)). Nothing happens when kvb_sampling_processes is 0. */
void kvb_logits_process(const kvb_sampling *s, const kvb_sample_seq *q, float *logits, int vocab, uint32_t *counts);

/* Stage 2: the logprob of token `tok` under log_softmax(logits[vocab]) (f32 logits, the normaliser
 * summed in double), and the top_n most likely tokens (ties: lower id first) with theirs, most likely
 * first, into top_ids / top_lp [top_n] (may be NULL when top_n is 0). A partial selection: O(vocab)
 * passes, no sort of the vocabulary. A -inf logit has logprob -inf. */
void kvb_logprobs(const float *logits, int vocab, int32_t tok, int top_n, float *lp, int32_t *top_ids, float *top_lp);

/* Stages 4 and 5 from (processed) logits[vocab]. `scratch` must hold 2*vocab floats (probabilities and
 * candidate ids). Greedy ignores rng and scratch; otherwise exactly one uniform is drawn per token. */
int32_t kvb_sample(const kvb_sampling *s, kvb_rng *rng, const float *logits, int vocab, float *scratch);
/* Stage 5 with the uniform `u` in [0, 1) given: temperature, min_p, top-k, top-p; the candidates in
 * order of descending probability (ties: lower id first; in id order when neither top-k nor top-p is
 * on), the token is the first whose running mass exceeds u x the kept mass. */
int32_t kvb_sample_u(const kvb_sampling *s, double u, const float *logits, int vocab, float *scratch);

#endif
