/* kvbank-bench engine — the engine against this machine's ceilings, measured in the same run.
 *
 *   copy bandwidth  B  = 2 * bytes / time of a large memcpy (bytes read + bytes written), best of 3
 *   sgemm rate      F  = 2*n^3 / time of an n x n x n cblas_sgemm, best of 2
 * This machine shares memory bandwidth with its neighbours, so the ceilings are sampled again before
 * every measurement and each ratio uses the median of all samples of the run (printed with their
 * range); each measurement itself is the median of several repetitions.
 *   decode ratio       = (weight bytes + KV bytes read per step) / step time / B
 *   prefill ratio      = model FLOPs of the prefill / time / F
 * with model FLOPs = 2 * tokens * (layer weights) + 2 * (LM head, one row) + causal attention
 * (2 products x 2 FLOPs x heads x head_dim x tokens*(tokens+1)/2 per layer). */
#include <cblas.h>
#include <getopt.h>
#include <omp.h>
#include <stdio.h>
#include <string.h>

#include "bench/bench.h"
#include "common/kv/block_pool.h"
#include "common/model/model.h"
#include "common/policy/policy.h"
#include "common/sched/engine.h"

void openblas_set_num_threads(int n);

static double measure_copy_bw(size_t bytes, int threads) {
    char *a = NULL, *b = NULL;
    if (kvb_aligned_alloc(bytes, (void **)&a) != KVB_OK || kvb_aligned_alloc(bytes, (void **)&b) != KVB_OK) {
        free(a);
        return 0;
    }
    memset(a, 1, bytes);
    memset(b, 2, bytes);
    double best = 1e30;
    for (int rep = 0; rep < 3; rep++) {
        double t0 = kvb_now_s();
#pragma omp parallel for num_threads(threads) schedule(static)
        for (int i = 0; i < threads; i++) {
            size_t chunk = bytes / (size_t)threads, off = chunk * (size_t)i;
            memcpy(b + off, a + off, i == threads - 1 ? bytes - off : chunk);
        }
        double t = kvb_now_s() - t0;
        best = t < best ? t : best;
    }
    free(a);
    free(b);
    return 2.0 * (double)bytes / best;
}

static double measure_sgemm(int n) {
    float *a = NULL, *b = NULL, *c = NULL;
    size_t sz = (size_t)n * n * sizeof(float);
    if (kvb_aligned_alloc(sz, (void **)&a) || kvb_aligned_alloc(sz, (void **)&b) || kvb_aligned_alloc(sz, (void **)&c)) {
        free(a);
        free(b);
        return 0;
    }
    for (size_t i = 0; i < (size_t)n * n; i++) {
        a[i] = (float)(i % 7) * 0.1f;
        b[i] = (float)(i % 5) * 0.1f;
    }
    double best = 1e30;
    for (int rep = 0; rep < 2; rep++) {
        double t0 = kvb_now_s();
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, n, n, n, 1.0f, a, n, b, n, 0.0f, c, n);
        double t = kvb_now_s() - t0;
        best = t < best ? t : best;
    }
    free(a);
    free(b);
    free(c);
    return 2.0 * n * (double)n * n / best;
}

#define BENCH_MAX_BATCH 1024

static int cmp_double(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

/* Median of v[0..n) (sorts v). */
static double median(double *v, int n) {
    qsort(v, (size_t)n, sizeof *v, cmp_double);
    return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

/* Ceiling samples of one run. */
typedef struct ceilings {
    double bw[16], fl[16];
    int n;
    int threads;
} ceilings;

static void sample_ceilings(ceilings *c) {
    if (c->n == 16) return;
    openblas_set_num_threads(c->threads); /* the library's own threads for the reference sgemm */
    c->bw[c->n] = measure_copy_bw((size_t)512 << 20, c->threads);
    c->fl[c->n] = measure_sgemm(2048);
    c->n++;
    openblas_set_num_threads(1); /* back to the backend's setting: one pool, OpenMP */
}

typedef struct bench_counter {
    int64_t tokens;
    int n_started;                    /* requests that produced their first token */
    int per_req[BENCH_MAX_BATCH];     /* tokens per request */
} bench_counter;

static void count_token(void *ud, uint64_t id, int index, int32_t tok, uint64_t t_ns) {
    bench_counter *c = ud;
    c->tokens++;
    if (id < BENCH_MAX_BATCH && c->per_req[id]++ == 0) c->n_started++;
}

static void usage(FILE *f) {
    fprintf(f, "usage: kvbank-bench engine --model DIR [--threads N] [--prefill-tokens N] [--context N]\n"
               "                           [--decode-steps N] [--batches 1,8,32] [--block-size N]\n"
               "\n"
               "  --threads N          CPU threads for the engine and the ceilings (default 2)\n"
               "  --prefill-tokens N   prompt length of the prefill measurement (default 512)\n"
               "  --context N          prompt length before the timed decode steps (default 128)\n"
               "  --decode-steps N     timed decode steps per batch size (default 16)\n"
               "  --batches LIST       decode batch sizes (default 1,8,32)\n");
}

/* Runs `batch` requests with prompts of `ctx` tokens until all are decoding, then times `steps` decode
 * steps. Returns seconds per step, or < 0 on error. */
static double time_decode(kvb_model *m, int batch, int ctx, int steps, int block_size) {
    const kvb_model_config *c = kvb_model_cfg(m);
    kvb_engine_opts o;
    kvb_engine_opts_default(&o);
    o.block_size = block_size;
    o.max_seqs = batch;
    o.max_batch_tokens = KVB_MAX(512, batch);
    /* prompts are prefilled over several steps, so the first requests start decoding earlier: give
     * every request enough tokens to still be decoding at the end of the timed window */
    int max_tokens = 3 * steps + KVB_DIV_CEIL(batch * ctx, o.max_batch_tokens) + 2;
    o.n_blocks = batch * KVB_DIV_CEIL(ctx + max_tokens, block_size);
    o.enable_prefix_cache = 0;
    bench_counter cnt = {0};
    kvb_engine_events ev = {.ud = &cnt, .on_token = count_token};
    kvb_planner pl = kvb_policy_recompute();
    kvb_engine *e = NULL;
    if (kvb_engine_create(m, &o, &pl, &ev, &e) != KVB_OK) return -1;
    int32_t *prompt = NULL;
    if (kvb_malloc((size_t)ctx * sizeof(int32_t), (void **)&prompt) != KVB_OK) {
        kvb_engine_destroy(e);
        return -1;
    }
    for (int r = 0; r < batch; r++) {
        for (int i = 0; i < ctx; i++) prompt[i] = (int32_t)((i * 31 + r * 17 + 1) % c->vocab);
        kvb_request req = {.id = (uint64_t)r, .prompt = prompt, .n_prompt = ctx, .max_tokens = max_tokens};
        if (kvb_engine_add(e, &req) != KVB_OK) {
            free(prompt);
            kvb_engine_destroy(e);
            return -1;
        }
    }
    free(prompt);
    while (cnt.n_started < batch) /* prefill everyone: each emits its first token */
        if (kvb_engine_step(e) != KVB_OK) break;
    /* every step from here decodes one token of each request */
    int64_t before = cnt.tokens;
    double win[3];
    for (int w = 0; w < 3; w++) {
        double t0 = kvb_now_s();
        for (int s = 0; s < steps; s++) kvb_engine_step(e);
        win[w] = (kvb_now_s() - t0) / steps;
    }
    double dt = median(win, 3);
    int ok = cnt.tokens - before == (int64_t)batch * steps * 3;
    kvb_engine_destroy(e);
    return ok ? dt : -1;
}

static double time_prefill(kvb_model *m, int tokens, int block_size) {
    const kvb_model_config *c = kvb_model_cfg(m);
    kvb_engine_opts o;
    kvb_engine_opts_default(&o);
    o.block_size = block_size;
    o.max_batch_tokens = tokens;
    o.n_blocks = KVB_DIV_CEIL(tokens + 1, block_size);
    o.enable_prefix_cache = 0;
    bench_counter cnt = {0};
    kvb_engine_events ev = {.ud = &cnt, .on_token = count_token};
    kvb_engine *e = NULL;
    if (kvb_engine_create(m, &o, NULL, &ev, &e) != KVB_OK) return -1;
    int32_t *prompt = NULL;
    if (kvb_malloc((size_t)tokens * sizeof(int32_t), (void **)&prompt) != KVB_OK) {
        kvb_engine_destroy(e);
        return -1;
    }
    double times[5];
    int n_t = 0;
    for (int rep = 0; rep < 5; rep++) {
        for (int i = 0; i < tokens; i++) prompt[i] = (int32_t)((i * 7 + rep * 13 + 3) % c->vocab);
        kvb_request req = {.id = (uint64_t)rep, .prompt = prompt, .n_prompt = tokens, .max_tokens = 1};
        if (kvb_engine_add(e, &req) != KVB_OK) break;
        double t0 = kvb_now_s();
        kvb_status st = kvb_engine_step(e);
        double t = kvb_now_s() - t0;
        if (st != KVB_OK || cnt.tokens != rep + 1) break;
        times[n_t++] = t;
    }
    free(prompt);
    kvb_engine_destroy(e);
    return n_t == 5 ? median(times, n_t) : -1;
}

int kvb_bench_engine(int argc, char **argv) {
    const char *model_dir = NULL;
    int threads = 2, prefill_tokens = 512, ctx = 128, steps = 16, block_size = 16;
    int32_t *batches = NULL;
    int n_batches = 0;
    static const struct option opts[] = {{"model", 1, 0, 'm'},        {"threads", 1, 0, 't'},
                                         {"prefill-tokens", 1, 0, 'p'}, {"context", 1, 0, 'c'},
                                         {"decode-steps", 1, 0, 's'}, {"batches", 1, 0, 'b'},
                                         {"block-size", 1, 0, 'k'},   {"help", 0, 0, 'h'},
                                         {0, 0, 0, 0}};
    int ch;
    int64_t v;
    while ((ch = getopt_long(argc, argv, "h", opts, NULL)) != -1) {
        int *dst = ch == 't' ? &threads : ch == 'p' ? &prefill_tokens : ch == 'c' ? &ctx : ch == 's' ? &steps
                 : ch == 'k' ? &block_size : NULL;
        if (dst) {
            if (kvb_parse_i64(optarg, 1, 1 << 20, &v) != KVB_OK) {
                fprintf(stderr, "kvbank-bench engine: bad number '%s'\n", optarg);
                return 2;
            }
            *dst = (int)v;
        } else if (ch == 'm') {
            model_dir = optarg;
        } else if (ch == 'b') {
            free(batches);
            if (kvb_parse_id_list(optarg, &batches, &n_batches) != KVB_OK) {
                fprintf(stderr, "kvbank-bench engine: --batches needs a list like 1,8,32\n");
                return 2;
            }
        } else {
            usage(ch == 'h' ? stdout : stderr);
            return ch == 'h' ? 0 : 2;
        }
    }
    if (!model_dir) {
        usage(stderr);
        return 2;
    }
    if (!batches) {
        static const int32_t def[] = {1, 8, 32};
        if (kvb_malloc(sizeof def, (void **)&batches) != KVB_OK) return 1;
        memcpy(batches, def, sizeof def);
        n_batches = 3;
    }
    kvb_backend *be = NULL;
    kvb_model *m = NULL;
    int rc = 1;
    ceilings ce = {.threads = threads};
    sample_ceilings(&ce);
    if (kvb_backend_create("cpu", threads, &be) != KVB_OK) goto out;
    if (kvb_model_load(model_dir, be, &m) != KVB_OK) goto out;
    const kvb_model_config *c = kvb_model_cfg(m);
    printf("kvbank-bench engine: %s, %d layers, hidden %d, %d heads / %d KV heads, vocab %d, %.1fM params, "
           "%d threads\n\n",
           model_dir, c->n_layers, c->hidden, c->n_heads, c->n_kv_heads, c->vocab, kvb_model_n_params(m) / 1e6,
           threads);

    /* prefill */
    int64_t w_bytes = kvb_model_weight_bytes_per_token(m);
    int64_t lm_params = (int64_t)c->vocab * c->hidden;
    int64_t layer_params = w_bytes / 4 - lm_params - c->hidden; /* f32 weights on the CPU backend */
    sample_ceilings(&ce);
    double t_pre = time_prefill(m, prefill_tokens, block_size);
    double T = prefill_tokens;
    double attn_flops = 4.0 * c->n_layers * c->n_heads * (double)c->head_dim * T * (T + 1) / 2;
    double model_flops = 2.0 * T * (double)layer_params + 2.0 * (double)lm_params + attn_flops;

    /* decode */
    kvb_kv_geom g = kvb_model_kv_geom(m, block_size);
    double kv_per_tok = 2.0 * g.n_layers * g.n_kv_heads * g.head_dim * g.elem_size;
    double dts[64], bytes[64];
    for (int i = 0; i < n_batches && i < 64; i++) {
        sample_ceilings(&ce);
        int b = batches[i];
        dts[i] = b < 1 || b > BENCH_MAX_BATCH ? -1 : time_decode(m, b, ctx, steps, block_size);
        bytes[i] = (double)w_bytes + b * kv_per_tok * (ctx + 1.5 * steps);
    }
    sample_ceilings(&ce);

    double bw_s[16], fl_s[16];
    memcpy(bw_s, ce.bw, sizeof bw_s);
    memcpy(fl_s, ce.fl, sizeof fl_s);
    double bw = median(bw_s, ce.n), flops_peak = median(fl_s, ce.n);
    printf("ceilings (median of %d samples in this run): copy bandwidth %.2f GB/s (read + write; range %.1f-%.1f), "
           "sgemm %.1f GFLOP/s (range %.1f-%.1f)\n\n",
           ce.n, bw / 1e9, bw_s[0] / 1e9, bw_s[ce.n - 1] / 1e9, flops_peak / 1e9, fl_s[0] / 1e9, fl_s[ce.n - 1] / 1e9);
    printf("%-28s %12s %14s %10s\n", "measurement", "time", "rate", "ratio");
    if (t_pre > 0)
        printf("%-28s %10.2fms %9.1f GF/s %9.2f   (of sgemm)\n", "prefill", t_pre * 1e3, model_flops / t_pre / 1e9,
               model_flops / t_pre / flops_peak);
    else
        printf("%-28s failed\n", "prefill");
    for (int i = 0; i < n_batches && i < 64; i++) {
        char label[64];
        snprintf(label, sizeof label, "decode batch %d ctx %d", batches[i], ctx);
        if (dts[i] <= 0) {
            printf("%-28s failed\n", label);
            continue;
        }
        printf("%-28s %10.2fms %9.1f tok/s %8.2f   (of copy bandwidth; %.2f GB/s)\n", label, dts[i] * 1e3,
               batches[i] / dts[i], bytes[i] / dts[i] / bw, bytes[i] / dts[i] / 1e9);
    }
    rc = 0;
out:
    kvb_model_destroy(m);
    kvb_backend_destroy(be);
    free(batches);
    return rc;
}
