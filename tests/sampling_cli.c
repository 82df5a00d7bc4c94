/* kvbank — the sampler's stages on one row of logits, for tests/sampling_ref.py (its NumPy reference).
 *
 *   sampling_cli DIR
 * reads DIR/case.json {"vocab", "params": {temperature, top_k, top_p, min_p, presence_penalty,
 * frequency_penalty, repetition_penalty, min_tokens, logit_bias: [[id, bias], ...]}, "tokens": [...],
 * "out_start", "stop_ids": [...], "top_n", "u": [...], "reps"} and DIR/logits.f32 ([vocab] float32), and
 * writes DIR/processed.f32 (the row after kvb_logits_process) and DIR/out.json {"lp", "top_ids",
 * "top_lp" (kvb_logprobs of the raw row, for the greedy token of the processed row), "greedy",
 * "samples" (kvb_sample_u of the processed row for each u), "ns_logprobs", "ns_process", "ns_sample"
 * (the median time of one call over `reps` calls)}. Not a test itself. */
#include <jansson.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/sched/sampling.h"

static void die(const char *what) {
    fprintf(stderr, "sampling_cli: %s\n", what);
    exit(2);
}

static double num(json_t *o, const char *k) { return json_number_value(json_object_get(o, k)); }

static int cmp_u64(const void *a, const void *b) {
    uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
    return (x > y) - (x < y);
}

static double median_ns(uint64_t *t, int n) {
    qsort(t, (size_t)n, sizeof *t, cmp_u64);
    return (double)t[n / 2];
}

int main(int argc, char **argv) {
    if (argc != 2) die("usage: sampling_cli DIR");
    char path[4096];
    snprintf(path, sizeof path, "%s/case.json", argv[1]);
    json_error_t je;
    json_t *c = json_load_file(path, 0, &je);
    if (!c) die(je.text);
    int vocab = (int)json_integer_value(json_object_get(c, "vocab"));
    json_t *p = json_object_get(c, "params");
    json_t *jb = json_object_get(p, "logit_bias");
    int n_bias = (int)json_array_size(jb);
    kvb_logit_bias *bias = calloc((size_t)n_bias + 1, sizeof *bias);
    for (int i = 0; i < n_bias; i++) {
        bias[i].id = (int32_t)json_integer_value(json_array_get(json_array_get(jb, (size_t)i), 0));
        bias[i].bias = (float)json_number_value(json_array_get(json_array_get(jb, (size_t)i), 1));
    }
    kvb_sampling s = {.temperature = (float)num(p, "temperature"), .top_k = (int)num(p, "top_k"),
                      .top_p = (float)num(p, "top_p"), .min_p = (float)num(p, "min_p"),
                      .presence_penalty = (float)num(p, "presence_penalty"),
                      .frequency_penalty = (float)num(p, "frequency_penalty"),
                      .repetition_penalty = (float)num(p, "repetition_penalty"),
                      .min_tokens = (int)num(p, "min_tokens"), .logit_bias = bias, .n_logit_bias = n_bias};
    char why[160];
    if (kvb_sampling_check(&s, vocab, why, sizeof why) != KVB_OK) die(why);
    json_t *jt = json_object_get(c, "tokens"), *js = json_object_get(c, "stop_ids"), *ju = json_object_get(c, "u");
    int n_tok = (int)json_array_size(jt), n_stop = (int)json_array_size(js), n_u = (int)json_array_size(ju);
    int32_t *tokens = calloc((size_t)n_tok + 1, sizeof *tokens), *stop = calloc((size_t)n_stop + 1, sizeof *stop);
    for (int i = 0; i < n_tok; i++) tokens[i] = (int32_t)json_integer_value(json_array_get(jt, (size_t)i));
    for (int i = 0; i < n_stop; i++) stop[i] = (int32_t)json_integer_value(json_array_get(js, (size_t)i));
    kvb_sample_seq q = {.tokens = tokens, .n_tokens = n_tok, .out_start = (int)num(c, "out_start"),
                        .stop_ids = stop, .n_stop = n_stop};
    int top_n = (int)num(c, "top_n"), reps = (int)num(c, "reps");
    if (reps < 1) reps = 1;

    float *raw = malloc((size_t)vocab * sizeof *raw), *x = malloc((size_t)vocab * sizeof *x);
    float *scratch = malloc(2 * (size_t)vocab * sizeof *scratch);
    uint32_t *counts = calloc((size_t)vocab, sizeof *counts);
    uint64_t *t = calloc((size_t)reps, sizeof *t);
    snprintf(path, sizeof path, "%s/logits.f32", argv[1]);
    FILE *f = fopen(path, "rb");
    if (!f || fread(raw, sizeof *raw, (size_t)vocab, f) != (size_t)vocab) die("cannot read logits.f32");
    fclose(f);

    for (int r = 0; r < reps; r++) {
        memcpy(x, raw, (size_t)vocab * sizeof *x);
        uint64_t t0 = kvb_now_ns();
        kvb_logits_process(&s, &q, x, vocab, counts);
        t[r] = kvb_now_ns() - t0;
    }
    double ns_process = median_ns(t, reps);
    for (int i = 0; i < vocab; i++)
        if (counts[i]) die("counts not left zero");
    kvb_sampling greedy = s;
    greedy.temperature = 0;
    int32_t g = kvb_sample(&greedy, NULL, x, vocab, NULL);
    float lp = 0;
    int32_t *top_ids = calloc((size_t)top_n + 1, sizeof *top_ids);
    float *top_lp = calloc((size_t)top_n + 1, sizeof *top_lp);
    for (int r = 0; r < reps; r++) {
        uint64_t t0 = kvb_now_ns();
        kvb_logprobs(raw, vocab, g, top_n, &lp, top_ids, top_lp);
        t[r] = kvb_now_ns() - t0;
    }
    double ns_logprobs = median_ns(t, reps);
    json_t *samples = json_array();
    double ns_sample = 0;
    for (int i = 0; i < n_u; i++) {
        double u = json_number_value(json_array_get(ju, (size_t)i));
        int32_t tok = 0;
        for (int r = 0; r < (i ? 1 : reps); r++) {
            uint64_t t0 = kvb_now_ns();
            tok = s.temperature > 0 ? kvb_sample_u(&s, u, x, vocab, scratch) : g;
            t[r] = kvb_now_ns() - t0;
        }
        if (!i) ns_sample = median_ns(t, reps);
        json_array_append_new(samples, json_integer(tok));
    }

    snprintf(path, sizeof path, "%s/processed.f32", argv[1]);
    f = fopen(path, "wb");
    if (!f || fwrite(x, sizeof *x, (size_t)vocab, f) != (size_t)vocab || fclose(f)) die("cannot write processed.f32");
    json_t *ids = json_array(), *lps = json_array();
    for (int i = 0; i < top_n && i < vocab; i++) {
        json_array_append_new(ids, json_integer(top_ids[i]));
        json_array_append_new(lps, isinf(top_lp[i]) ? json_string("-inf") : json_real(top_lp[i]));
    }
    json_t *out = json_pack("{s:o, s:o, s:o, s:i, s:o, s:f, s:f, s:f}", "lp", isinf(lp) ? json_string("-inf") : json_real(lp),
                            "top_ids", ids, "top_lp", lps, "greedy", g, "samples", samples, "ns_logprobs", ns_logprobs,
                            "ns_process", ns_process, "ns_sample", ns_sample);
    snprintf(path, sizeof path, "%s/out.json", argv[1]);
    if (json_dump_file(out, path, JSON_COMPACT)) die("cannot write out.json");
    json_decref(out);
    json_decref(c);
    free(bias);
    free(tokens);
    free(stop);
    free(raw);
    free(x);
    free(scratch);
    free(counts);
    free(t);
    free(top_ids);
    free(top_lp);
    return 0;
}
