/* kvbank — token sampling (the pipeline is described in sampling.h). */
#include "common/sched/sampling.h"

#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

void kvb_rng_seed(kvb_rng *r, uint64_t seed) { r->s = seed ^ 0x9e3779b97f4a7c15ull; }

static uint64_t splitmix64(kvb_rng *r) {
    uint64_t z = (r->s += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

double kvb_rng_uniform(kvb_rng *r) { return (double)(splitmix64(r) >> 11) * 0x1.0p-53; }

static kvb_status bad(char *why, size_t len, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
static kvb_status bad(char *why, size_t len, const char *fmt, ...) {
    if (why && len) {
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(why, len, fmt, ap);
        va_end(ap);
    }
    return KVB_ERR_INVALID;
}

static int in_range(float x, float lo, float hi) { return isfinite(x) && x >= lo && x <= hi; }

kvb_status kvb_sampling_check(const kvb_sampling *s, int vocab, char *why, size_t len) {
    if (why && len) why[0] = '\0';
    if (!isfinite(s->temperature) || s->temperature < 0)
        return bad(why, len, "temperature %g must be finite and >= 0", (double)s->temperature);
    if (s->top_k < 0) return bad(why, len, "top_k %d must be >= 0", s->top_k);
    if (!in_range(s->top_p, 0, 1)) return bad(why, len, "top_p %g must be in [0, 1]", (double)s->top_p);
    if (!in_range(s->min_p, 0, 1)) return bad(why, len, "min_p %g must be in [0, 1]", (double)s->min_p);
    if (!in_range(s->presence_penalty, -2, 2))
        return bad(why, len, "presence_penalty %g must be in [-2, 2]", (double)s->presence_penalty);
    if (!in_range(s->frequency_penalty, -2, 2))
        return bad(why, len, "frequency_penalty %g must be in [-2, 2]", (double)s->frequency_penalty);
    if (!isfinite(s->repetition_penalty) || s->repetition_penalty < 0)
        return bad(why, len, "repetition_penalty %g must be > 0 (0: off)", (double)s->repetition_penalty);
    if (s->min_tokens < 0) return bad(why, len, "min_tokens %d must be >= 0", s->min_tokens);
    if (s->top_logprobs < 0 || s->top_logprobs > KVB_MAX_TOP_LOGPROBS)
        return bad(why, len, "top_logprobs %d must be in [0, %d]", s->top_logprobs, KVB_MAX_TOP_LOGPROBS);
    if ((unsigned)s->logprobs > 1 || (unsigned)s->prompt_logprobs > 1)
        return bad(why, len, "logprobs and prompt_logprobs are 0 or 1");
    if (s->n_logit_bias < 0 || s->n_logit_bias > KVB_MAX_LOGIT_BIAS || (s->n_logit_bias && !s->logit_bias))
        return bad(why, len, "logit_bias has %d entries, at most %d", s->n_logit_bias, KVB_MAX_LOGIT_BIAS);
    for (int i = 0; i < s->n_logit_bias; i++) {
        const kvb_logit_bias *b = &s->logit_bias[i];
        if (b->id < 0 || (vocab > 0 && b->id >= vocab))
            return bad(why, len, "logit_bias token %d is outside the vocabulary [0, %d)", (int)b->id, vocab);
        if (!isfinite(b->bias)) return bad(why, len, "logit_bias of token %d is not finite", (int)b->id);
    }
    return KVB_OK;
}

static int repetition_on(const kvb_sampling *s) { return s->repetition_penalty > 0 && s->repetition_penalty != 1; }

int kvb_sampling_processes(const kvb_sampling *s) {
    return s->min_tokens > 0 || s->n_logit_bias > 0 || repetition_on(s) || s->presence_penalty != 0 ||
           s->frequency_penalty != 0;
}

/* ------------------------------------------------------------------------------ stage 3: processors */

#define IN_PROMPT 0x80000000u /* counts[t]: t occurs in the prompt; the low bits count it in the output */

void kvb_logits_process(const kvb_sampling *s, const kvb_sample_seq *q, float *x, int vocab, uint32_t *counts) {
    if (!kvb_sampling_processes(s)) return;
    /* min_tokens: no stop (EOS included) before the output has min_tokens tokens (vLLM's MinTokens) */
    if (q->n_tokens - q->out_start < s->min_tokens)
        for (int k = 0; k < q->n_stop; k++)
            if (q->stop_ids[k] >= 0 && q->stop_ids[k] < vocab) x[q->stop_ids[k]] = -INFINITY;
    for (int k = 0; k < s->n_logit_bias; k++) {
        int32_t id = s->logit_bias[k].id;
        if (id >= 0 && id < vocab) x[id] += s->logit_bias[k].bias;
    }
    int rep = repetition_on(s);
    if (!rep && s->presence_penalty == 0 && s->frequency_penalty == 0) return;
    /* vLLM's apply_penalties: repetition over prompt and output tokens, then the OpenAI penalties over
     * the output (frequency by count, presence once); each token once, whatever its occurrences */
    int first = rep ? 0 : q->out_start;
    for (int i = first; i < q->out_start; i++) counts[q->tokens[i]] |= IN_PROMPT;
    for (int i = q->out_start; i < q->n_tokens; i++) counts[q->tokens[i]]++;
    float r = s->repetition_penalty, fp = s->frequency_penalty, pp = s->presence_penalty;
    for (int i = first; i < q->n_tokens; i++) {
        int32_t t = q->tokens[i];
        uint32_t c = counts[t];
        if (!c) continue; /* done already */
        counts[t] = 0;
        float v = x[t];
        if (rep) v = v > 0 ? v / r : v * r;
        uint32_t n = c & ~IN_PROMPT;
        if (n) {
            v -= fp * (float)n;
            v -= pp;
        }
        x[t] = v;
    }
}

/* ------------------------------------------------------------------------------ selection helpers */

/* The first index of the largest logit (NaNs never win; 0 when x[0] is NaN and nothing beats it). Two
 * passes, the maximum in 8 independent lanes and then its first position, which GCC vectorizes: the one-
 * pass form carries a load of x[best] from one element to the next and took 6 ms for a batch of 32 rows
 * of a 32,000-word vocabulary here (0.9 ms now), 5% of a decode step. */
static int32_t argmax(const float *x, int n) {
    float m8[8];
    for (int j = 0; j < 8; j++) m8[j] = x[0];
    int i = 0;
    for (; i + 8 <= n; i += 8)
        for (int j = 0; j < 8; j++) m8[j] = x[i + j] > m8[j] ? x[i + j] : m8[j];
    float mx = m8[0];
    for (int j = 1; j < 8; j++) mx = m8[j] > mx ? m8[j] : mx;
    for (; i < n; i++) mx = x[i] > mx ? x[i] : mx;
    for (i = 0; i < n; i++)
        if (x[i] == mx) return i;
    return 0;
}

/* a ranks below b: a smaller value (NaN lowest), ties broken by the higher id */
static int worse(const float *v, int32_t a, int32_t b) {
    float x = v[a], y = v[b];
    if (x != y) return isnan(x) || x < y;
    return a > b;
}

static void sift_down(const float *v, int32_t *h, int n, int i) {
    for (;;) {
        int l = 2 * i + 1, r = l + 1, m = i;
        if (l < n && worse(v, h[l], h[m])) m = l;
        if (r < n && worse(v, h[r], h[m])) m = r;
        if (m == i) return;
        int32_t t = h[i];
        h[i] = h[m];
        h[m] = t;
        i = m;
    }
}

static int by_value_desc(const void *a, const void *b, void *ctx) {
    int32_t i = *(const int32_t *)a, j = *(const int32_t *)b;
    return worse(ctx, i, j) ? 1 : worse(ctx, j, i) ? -1 : 0;
}

/* The k largest of v[n] (ties: lower id first) into out[k], largest first: a heap of k whose root is
 * the worst kept, so that most elements cost one comparison. */
static void top_k_select(const float *v, int n, int k, int32_t *out) {
    for (int i = 0; i < k; i++) out[i] = i;
    for (int i = k / 2 - 1; i >= 0; i--) sift_down(v, out, k, i);
    for (int i = k; i < n; i++) {
        if (!worse(v, out[0], i)) continue;
        out[0] = i;
        sift_down(v, out, k, 0);
    }
    qsort_r(out, (size_t)k, sizeof *out, by_value_desc, (void *)v);
}

/* ---------------------------------------------------------------------------------- stage 2: logprobs */

void kvb_logprobs(const float *x, int vocab, int32_t tok, int top_n, float *lp, int32_t *top_ids, float *top_lp) {
    float mx = x[argmax(x, vocab)];
    double lse = INFINITY; /* every logit -inf or NaN: every logprob is -inf */
    if (mx > -INFINITY) {
        double sum = 0;
        for (int i = 0; i < vocab; i++) {
            float d = x[i] - mx;
            if (d >= -104.0f) sum += expf(d); /* below, expf is 0 (and NaN never passes) */
        }
        lse = (double)mx + log(sum);
    }
    *lp = tok >= 0 && tok < vocab && !isnan(x[tok]) ? (float)((double)x[tok] - lse) : -INFINITY;
    if (top_n <= 0) return;
    if (top_n > vocab) top_n = vocab;
    top_k_select(x, vocab, top_n, top_ids);
    for (int j = 0; j < top_n; j++) {
        float v = x[top_ids[j]];
        top_lp[j] = isnan(v) ? -INFINITY : (float)((double)v - lse);
    }
}

/* -------------------------------------------------------------------------------- stages 4 and 5 */

int32_t kvb_sample_u(const kvb_sampling *s, double u, const float *logits, int vocab, float *scratch) {
    float *p = scratch;                          /* [vocab] probabilities, relative to the largest */
    int32_t *idx = (int32_t *)(scratch + vocab); /* [vocab] candidate ids */
    int32_t am = argmax(logits, vocab);
    float mx = logits[am];
    if (!(mx > -INFINITY)) return am; /* nothing has any mass */
    float min_p = s->min_p; /* vLLM's MinP after temperature: p < min_p x max p, and max p is 1 here */
    double sum = 0;
    for (int i = 0; i < vocab; i++) {
        float v = expf((logits[i] - mx) / s->temperature);
        if (!(v >= min_p)) v = 0; /* NaN too */
        p[i] = v;
        sum += v;
        idx[i] = i;
    }
    int n = vocab;
    int use_k = s->top_k > 0 && s->top_k < vocab;
    int use_p = s->top_p > 0 && s->top_p < 1;
    if (use_k || use_p) {
        if (use_k) {
            n = s->top_k;
            top_k_select(p, vocab, n, idx);
        } else {
            qsort_r(idx, (size_t)vocab, sizeof *idx, by_value_desc, p);
        }
        if (use_p) {
            double total = 0, acc = 0;
            for (int i = 0; i < n; i++) total += p[idx[i]];
            int keep = 0;
            while (keep < n) {
                acc += p[idx[keep++]];
                if (acc >= s->top_p * total) break;
            }
            n = keep;
        }
        sum = 0;
        for (int i = 0; i < n; i++) sum += p[idx[i]];
    }
    double t = u * sum, acc = 0;
    for (int i = 0; i < n; i++) {
        acc += p[idx[i]];
        if (t < acc) return idx[i];
    }
    return idx[n - 1];
}

int32_t kvb_sample(const kvb_sampling *s, kvb_rng *rng, const float *logits, int vocab, float *scratch) {
    if (s->temperature <= 0) return argmax(logits, vocab);
    return kvb_sample_u(s, kvb_rng_uniform(rng), logits, vocab, scratch);
}
