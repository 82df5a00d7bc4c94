/* kvbank-bench ellm-tw — eLLM adaptive KV caching (`ellm-tokenwise`) against its three baselines of
 * ../shared/papers/ellm-adaptive-kv-caching.txt §6.1 (vllm-recompute, vllm-swap, hcache), as §6 measures
 * them, scaled to a CPU and tiny models:
 *
 *  - models: an MHA and a GQA tiny Llama (kvbank-mkmodel), the same KV budget for every policy (a
 *    fraction of what the offered load would hold), the same forward-pass rows for every policy
 *    (recomputed rows share the step's rows with prefill chunks), prefix caching off;
 *  - workloads: lengths from ShareGPT-8k, the Mooncake synthetic trace (long context, the L-Eval
 *    stand-in) and Azure 2023 conv, arrivals from the first Azure conv inter-arrival times (halved for
 *    ShareGPT, doubled for the long-context one, as §6.1 does), each as stored and with outputs resampled
 *    to the paper's in/out ratio; lengths scaled to the model;
 *  - load: 1.0x is half of what vllm-recompute serves closed-loop under the budget (so that the
 *    baselines' knee falls near 2x, where the paper's does), swept 0.5x..3x;
 *  - time: open loop in engine time: a virtual clock advances by each step's measured duration less the
 *    time the engine's thread waited for a CPU (Linux schedstat), and jumps over idle gaps, so a run
 *    never sleeps and the neighbours on this shared machine do not stretch it; one compute thread
 *    (--threads) so that the correction is exact;
 *  - TPOT SLO: a multiple of the TPOT one request alone sees (measured first);
 *  - links: the stager's link model under a named preset (default a100-pcie4-scaled: eLLM's A100 over
 *    PCIe 4.0 serving Llama-2-13B, its time scale measured on each model at the paper's ShareGPT context),
 *    printed in the output with the regime it gives; off on a GPU (--backend), whose copies are real.
 * Every run is repeated (--trials) and each figure is printed as the median and the spread (min..max)
 * over the repetitions; ratios between policies are ratios of medians. */
#include <getopt.h>
#include <math.h>
#include <stdio.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>

#include "bench/bench.h"
#include "bench/bench_link.h"
#include "common/model/model.h"
#include "common/policy/ellm_tw.h"
#include "common/policy/ellm_tw_map.h"
#include "common/policy/ellm_tw_planner.h"
#include "common/policy/policy.h"
#include "common/sched/engine.h"
#include "common/util/progress.h"

/* ---------------------------------------------------------------- traces */

typedef struct lens {
    int *in, *out; /* [n] */
    double *t;     /* [n] arrival seconds (Azure only) */
    int n;
} lens;

static void lens_free(lens *l) {
    free(l->in);
    free(l->out);
    free(l->t);
    memset(l, 0, sizeof *l);
}

static kvb_status lens_push(lens *l, int *cap, int in, int out, double t) {
    if (l->n == *cap) {
        int c = *cap ? 2 * *cap : 1024;
        KVB_TRY(kvb_realloc_array((void **)&l->in, (size_t)c, sizeof *l->in));
        KVB_TRY(kvb_realloc_array((void **)&l->out, (size_t)c, sizeof *l->out));
        KVB_TRY(kvb_realloc_array((void **)&l->t, (size_t)c, sizeof *l->t));
        *cap = c;
    }
    l->in[l->n] = in;
    l->out[l->n] = out;
    l->t[l->n++] = t;
    return KVB_OK;
}

/* ShareGPT-8k: num_prefill_tokens,num_decode_tokens,...; Mooncake: {"timestamp", "input_length",
 * "output_length", ...} per line; Azure: TIMESTAMP,ContextTokens,GeneratedTokens. */
static kvb_status load_lens(const char *path, lens *l) {
    FILE *f = fopen(path, "r");
    if (!f) {
        KVB_LOG_E("bench ellm-tw: cannot open %s", path);
        return KVB_ERR_IO;
    }
    char line[1 << 16];
    int cap = 0, lineno = 0, kind = strstr(path, ".jsonl") ? 1 : strstr(path, "Azure") ? 2 : 0;
    kvb_status st = KVB_OK;
    while (st == KVB_OK && fgets(line, sizeof line, f)) {
        lineno++;
        int in = -1, out = -1;
        double t = 0;
        if (kind == 1) {
            const char *a = strstr(line, "\"input_length\":"), *b = strstr(line, "\"output_length\":");
            if (a && b) {
                in = atoi(a + 15);
                out = atoi(b + 16);
            }
        } else if (kind == 2) {
            if (lineno == 1) continue;
            struct tm tm = {0};
            char *rest = strptime(line, "%Y-%m-%d %H:%M:%S", &tm);
            if (rest) {
                double frac = 0;
                if (*rest == '.') frac = strtod(rest, &rest);
                t = (double)timegm(&tm) + frac;
                if (*rest == ',' && sscanf(rest + 1, "%d,%d", &in, &out) != 2) in = -1;
            }
        } else {
            if (lineno == 1) continue;
            if (sscanf(line, "%d,%d", &in, &out) != 2) in = -1;
        }
        if (in < 1 || out < 1) {
            KVB_LOG_E("bench ellm-tw: %s line %d is not a request", path, lineno);
            st = KVB_ERR_FORMAT;
            break;
        }
        st = lens_push(l, &cap, in, out, t);
    }
    fclose(f);
    if (st == KVB_OK && l->n == 0) st = KVB_ERR_FORMAT;
    return st;
}

/* ---------------------------------------------------------------- workloads */

typedef enum wl_kind { WL_SHAREGPT, WL_SHAREGPT_PAPER, WL_LONG, WL_LONG_PAPER, WL_AZURE, WL_COUNT } wl_kind;
static const char *const wl_names[] = {"sharegpt", "sharegpt-paper", "mooncake", "mooncake-paper", "azure"};
/* the paper's in / out means (§6.1): ShareGPT 222 / 1,346; L-Eval 35,956 / 5,189 */
static const double paper_out_per_in[] = {0, 1346.0 / 222.0, 0, 5189.0 / 35956.0, 0};

typedef struct workload {
    int n;
    double *t; /* [n] arrival, seconds at 1.0x load */
    int *in, *out;
    double mean_in, mean_out;
} workload;

static void wl_free(workload *w) {
    free(w->t);
    free(w->in);
    free(w->out);
    memset(w, 0, sizeof *w);
}

static uint64_t mix64(uint64_t z) {
    z += 0x9E3779B97F4A7C15ull;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

typedef struct traces {
    lens sharegpt, mooncake, azure;
} traces;

/* n requests of workload k (trial `seed` draws other lengths): lengths times in_scale / out_scale,
 * capped at max_len tokens in all; arrivals from the Azure gaps (x0.5 ShareGPT, x2 long context), at
 * 1.0x load when multiplied by time_scale later. */
static kvb_status wl_make(const traces *tr, wl_kind k, int n, uint64_t seed, double in_scale, double out_scale,
                          int max_len, workload *w) {
    memset(w, 0, sizeof *w);
    KVB_TRY(kvb_calloc((size_t)n, sizeof *w->t, (void **)&w->t));
    KVB_TRY(kvb_calloc((size_t)n, sizeof *w->in, (void **)&w->in));
    KVB_TRY(kvb_calloc((size_t)n, sizeof *w->out, (void **)&w->out));
    w->n = n;
    const lens *src = k == WL_SHAREGPT || k == WL_SHAREGPT_PAPER ? &tr->sharegpt
                      : k == WL_LONG || k == WL_LONG_PAPER       ? &tr->mooncake
                                                                 : &tr->azure;
    double gap_scale = k == WL_SHAREGPT || k == WL_SHAREGPT_PAPER ? 0.5 : k == WL_AZURE ? 1.0 : 2.0;
    /* the paper's ratio: outputs rescaled so that mean(out) / mean(in) is the paper's over the source */
    double resample = 1;
    if (paper_out_per_in[k] > 0) {
        double si = 0, so = 0;
        for (int i = 0; i < src->n; i++) {
            si += src->in[i];
            so += src->out[i];
        }
        resample = paper_out_per_in[k] * si / so;
    }
    double t = 0;
    for (int i = 0; i < n; i++) {
        /* Azure keeps its own rows in order (lengths with their arrivals); the others sample rows */
        int row = k == WL_AZURE ? (int)((seed * 7919 + (uint64_t)i) % (uint64_t)src->n)
                                : (int)(mix64(seed * 1000003 + (uint64_t)i) % (uint64_t)src->n);
        int in = (int)lround(src->in[row] * in_scale), out = (int)lround(src->out[row] * resample * out_scale);
        in = KVB_MAX(1, in);
        out = KVB_MAX(2, out);
        if (in + out > max_len) {
            in = KVB_MIN(in, max_len / 2);
            out = KVB_MAX(2, KVB_MIN(out, max_len - in));
        }
        w->in[i] = in;
        w->out[i] = out;
        w->mean_in += in;
        w->mean_out += out;
        w->t[i] = t;
        const lens *az = &tr->azure;
        int g = i % (KVB_MIN(az->n, 3000) - 1);
        t += (az->t[g + 1] - az->t[g]) * gap_scale;
    }
    w->mean_in /= n;
    w->mean_out /= n;
    return KVB_OK;
}

/* ---------------------------------------------------------------- one run */

typedef struct run_opts {
    const char *policy;
    const char *params[8]; /* KEY=VALUE, NULL-terminated */
    int n_blocks, block_size, max_batch_tokens, max_seqs;
    double time_scale;     /* arrival times are multiplied by this / load */
    double load;           /* 0: everything arrives at once (closed loop) */
    double slo_s;          /* TPOT SLO */
    int warmup;            /* the first requests not measured */
    kvb_link_model links;
} run_opts;

typedef struct run_res {
    double wall_s;         /* engine time from the first arrival to the last token */
    double tok_s;          /* output tokens / s over the measured requests' span */
    double slo_tok_s;      /* output tokens / s of the measured requests that met the SLO */
    double ttft_mean, ttft_p99, tpot_mean;
    double attain;         /* measured requests with TPOT <= SLO */
    double run_mean, run_max;
    double cached, util, mape;
    double solve_mean_ms, solve_max_ms;
    uint64_t preempt, swaps, dropped, recomputed;
    double host_loads;     /* (released block, layer) slices read from the host tier (swap=1) */
    double r_used, b_used; /* ellm planners: mean r and b the steps used */
    double t_base, t_tok;  /* the fitted cost model at the end: a step's fixed cost + weight read, and one
                            * token recomputed through every layer (seconds) */
    int ok;
} run_res;

typedef struct run_state {
    const workload *w;
    double vt;        /* engine time now */
    double *arr, *first, *last;
    int *ntok;
    int done;
} run_state;

static void rs_token(void *ud, uint64_t id, int index, int32_t tok, uint64_t t_ns) {
    run_state *s = ud;
    /* stamped with the engine time at the end of the step (set before the step, corrected after) */
    if (index == 0) s->first[id] = -1;
    s->last[id] = -1;
    s->ntok[id]++;
}
static void rs_finish(void *ud, uint64_t id, kvb_finish why, kvb_status err) { ((run_state *)ud)->done++; }

static int cmp_d(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

static double pctl(double *v, int n, double p) {
    if (n <= 0) return NAN;
    qsort(v, (size_t)n, sizeof *v, cmp_d);
    int k = (int)ceil(p / 100 * n) - 1;
    return v[KVB_MAX(0, KVB_MIN(n - 1, k))];
}

static kvb_status run_once(kvb_model *m, const workload *w, const run_opts *o, run_res *res) {
    memset(res, 0, sizeof *res);
    kvb_policy_params pp = {0};
    kvb_status st = KVB_OK;
    for (int i = 0; o->params[i] && st == KVB_OK; i++) st = kvb_policy_params_add(&pp, o->params[i]);
    kvb_planner pl = {0};
    if (st == KVB_OK) st = kvb_policy_create(o->policy, &pp, &pl);
    kvb_policy_params_free(&pp);
    KVB_TRY(st);
    kvb_planner keep = pl; /* the engine owns it; its stats stay readable while the engine lives */
    kvb_engine_opts eo;
    kvb_engine_opts_default(&eo);
    eo.block_size = o->block_size;
    eo.n_blocks = o->n_blocks;
    eo.max_batch_tokens = o->max_batch_tokens;
    eo.max_seqs = o->max_seqs;
    eo.enable_prefix_cache = 0;
    eo.links = o->links;
    int n = w->n;
    run_state s = {.w = w};
    kvb_progress pg = {0}; /* a progress line per replay on a terminal (common/util/progress.h) */
    double *tmp = NULL;
    int32_t *prompt = NULL;
    kvb_engine *e = NULL;
    if (kvb_calloc((size_t)n, sizeof(double), (void **)&s.arr) || kvb_calloc((size_t)n, sizeof(double), (void **)&s.first) ||
        kvb_calloc((size_t)n, sizeof(double), (void **)&s.last) || kvb_calloc((size_t)n, sizeof(int), (void **)&s.ntok) ||
        kvb_calloc((size_t)n, sizeof(double), (void **)&tmp) || kvb_calloc(8192, sizeof(int32_t), (void **)&prompt)) {
        kvb_planner_destroy(&pl);
        st = KVB_ERR_NOMEM;
        goto out;
    }
    kvb_engine_events ev = {.ud = &s, .on_token = rs_token, .on_finish = rs_finish};
    st = kvb_engine_create(m, &eo, &pl, &ev, &e);
    if (st != KVB_OK) goto out;
    int vocab = kvb_model_cfg(m)->vocab, next = 0, rejected = 0;
    double run_sum = 0, steps = 0;
    char what[160];
    snprintf(what, sizeof what, "replaying %d requests under %s", n, o->policy);
    kvb_progress_begin(&pg, what, (uint64_t)n, KVB_PROGRESS_COUNT);
    for (int i = 0; i < n; i++) s.arr[i] = o->load > 0 ? w->t[i] * o->time_scale / o->load : 0;
    while (s.done + rejected < n) {
        while (next < n && s.arr[next] <= s.vt) {
            int len = KVB_MIN(w->in[next], 8192);
            for (int t = 0; t < len; t++) prompt[t] = 3 + (int32_t)(mix64((uint64_t)next * 65599 + (uint64_t)t) % (uint64_t)(vocab - 3));
            kvb_request r = {.id = (uint64_t)next, .prompt = prompt, .n_prompt = len, .max_tokens = w->out[next]};
            if (kvb_engine_add(e, &r) != KVB_OK) rejected++;
            next++;
        }
        if (kvb_engine_n_live(e) == 0) {
            if (next < n) s.vt = s.arr[next];
            continue;
        }
        /* engine time: the step's wall time less what this thread waited for a CPU (the machine is
         * shared: neighbours must not stretch the clock) */
        uint64_t t0 = kvb_now_ns(), q0 = kvb_thread_runq_ns();
        st = kvb_engine_step(e);
        if (st != KVB_OK) goto out;
        uint64_t dt = kvb_now_ns() - t0, dq = kvb_thread_runq_ns() - q0;
        s.vt += (double)(dq < dt ? dt - dq : dt) * 1e-9;
        for (int i = 0; i < next; i++) {
            if (s.first[i] < 0) s.first[i] = s.vt;
            if (s.last[i] < 0) s.last[i] = s.vt;
        }
        kvb_engine_stats es;
        kvb_engine_get_stats(e, &es);
        run_sum += es.n_running;
        steps++;
        if (es.n_running > res->run_max) res->run_max = es.n_running;
        kvb_progress_update(&pg, (uint64_t)(s.done + rejected));
    }
    kvb_progress_end(&pg);
    res->run_mean = steps > 0 ? run_sum / steps : 0;
    /* metrics over the measured requests (after the warm-up) */
    double t_lo = INFINITY, t_hi = 0, toks = 0, slo_toks = 0, tpot_sum = 0, ttft_sum = 0;
    int meas = 0, met = 0, n_tpot = 0;
    for (int i = o->warmup; i < n; i++) {
        if (s.ntok[i] == 0) continue;
        meas++;
        double ttft = s.first[i] - s.arr[i];
        tmp[meas - 1] = ttft;
        ttft_sum += ttft;
        t_lo = fmin(t_lo, s.arr[i]);
        t_hi = fmax(t_hi, s.last[i]);
        toks += s.ntok[i];
        double tpot = s.ntok[i] > 1 ? (s.last[i] - s.first[i]) / (s.ntok[i] - 1) : 0;
        if (s.ntok[i] > 1) {
            tpot_sum += tpot;
            n_tpot++;
        }
        if (tpot <= o->slo_s) {
            met++;
            slo_toks += s.ntok[i];
        }
    }
    res->wall_s = s.vt;
    if (meas > 0 && t_hi > t_lo) {
        res->tok_s = toks / (t_hi - t_lo);
        res->slo_tok_s = slo_toks / (t_hi - t_lo);
        res->ttft_mean = ttft_sum / meas;
        res->ttft_p99 = pctl(tmp, meas, 99);
        res->tpot_mean = n_tpot ? tpot_sum / n_tpot : 0;
        res->attain = (double)met / meas;
        res->ok = 1;
    }
    kvb_engine_stats es;
    kvb_engine_get_stats(e, &es);
    res->preempt = es.preemptions;
    res->swaps = es.swap_outs;
    res->dropped = es.dropped_blocks;
    res->recomputed = es.recomputed_tokens;
    kvb_etw_planner_stats ps;
    if (kvb_etw_planner_get_stats(&keep, &ps) == KVB_OK) {
        res->cached = ps.cached_ratio;
        res->mape = ps.cost_mape;
        res->util = ps.peak_flops > 0 && ps.work_seconds > 0 ? ps.work_flops / ps.work_seconds / ps.peak_flops : 0;
        res->solve_mean_ms = ps.solve_mean_s * 1e3;
        res->solve_max_ms = ps.solve_max_s * 1e3;
        res->r_used = ps.steps ? ps.r_sum / (double)ps.steps : 0;
        res->b_used = ps.steps ? ps.b_sum / (double)ps.steps : 0;
        /* why r stays 0 (or not): what one step's base cost buys in recomputed tokens */
        const kvb_model_config *mc = kvb_model_cfg(m);
        int act = (int)kvb_dtype_size(kvb_model_backend(m)->iface->act_dtype);
        kvb_etw_dims d;
        kvb_etw_dims_from_config(mc, act, act, (double)kvb_model_weight_bytes_per_token(m), &d);
        res->t_base = kvb_etw_step_time(&ps.rates, kvb_etw_work_step(&d));
        res->t_tok = kvb_etw_time(&ps.rates, kvb_etw_work_recompute(&d, 1, mc->n_layers));
    }
    res->host_loads = (double)es.prefix_host_loads;
    if (rejected) printf("    (%s: %d requests rejected)\n", o->policy, rejected);
out:
    kvb_progress_cancel(&pg); /* after kvb_progress_end: nothing */
    kvb_engine_destroy(e);
    free(s.arr);
    free(s.first);
    free(s.last);
    free(s.ntok);
    free(tmp);
    free(prompt);
    return st;
}

/* ---------------------------------------------------------------- statistics over trials */

#define AGG_MAX 100 /* --trials is at most 100 */

typedef struct agg {
    double v[AGG_MAX]; /* the repetitions' values */
    double min, max;
    int n;
} agg;

static void agg_add(agg *a, double x) {
    if (isnan(x) || a->n >= AGG_MAX) return;
    if (!a->n || x < a->min) a->min = x;
    if (!a->n || x > a->max) a->max = x;
    a->v[a->n++] = x;
}

static int cmp_d(const void *a, const void *b);

/* The median of the repetitions (the mean of the middle two for an even count). */
static double agg_med(const agg *a) {
    if (!a->n) return NAN;
    double s[AGG_MAX];
    memcpy(s, a->v, (size_t)a->n * sizeof *s);
    qsort(s, (size_t)a->n, sizeof *s, cmp_d);
    return a->n % 2 ? s[a->n / 2] : 0.5 * (s[a->n / 2 - 1] + s[a->n / 2]);
}

/* "median (min..max)" into buf */
static const char *fmt_agg(char *buf, size_t len, const agg *a, double scale, int prec) {
    if (!a->n) snprintf(buf, len, "-");
    else if (a->n == 1 || a->max - a->min < 1e-12 * fabs(a->max))
        snprintf(buf, len, "%.*f", prec, agg_med(a) * scale);
    else snprintf(buf, len, "%.*f (%.*f..%.*f)", prec, agg_med(a) * scale, prec, a->min * scale, prec, a->max * scale);
    return buf;
}


/* ---------------------------------------------------------------- optimizer and map table costs */

/* CPU seconds of this thread: the solver and the map table are pure computation on one thread, so
 * their cost on a shared machine is the CPU time they take (wall time less run-queue waits is not
 * monotone enough at sub-millisecond scale: schedstat's counter moves in jumps). */
static double thread_cpu_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

/* §6.7: request-level solve time as the batch bound grows (512 -> 1,024), on candidate sets drawn from
 * a workload's lengths under memory pressure, on the MHA model's dimensions at Llama-2-13B's shape
 * (the solver's cost does not depend on the model's size); SLSQP alone against kvbank's answer; the
 * layer level (δ) per call; map-table operations per unit. */
static void bench_solver(const traces *tr, int trials) {
    kvb_model_config cfg = {.n_layers = 40, .hidden = 5120, .n_heads = 40, .n_kv_heads = 40, .head_dim = 128,
                            .intermediate = 13824, .vocab = 32000, .max_pos = 4096};
    kvb_etw_dims d;
    kvb_etw_dims_from_config(&cfg, 2, 2, 26e9, &d);
    /* an A100-like balance: 312 TFLOP/s, 2 TB/s, 1 ms per step */
    kvb_etw_rates k = {.t_fixed = 1e-3, .s_flop = 1 / 312e12, .s_attn = 1 / 156e12, .s_byte = 1 / 2e12};
    printf("== optimizer cost (§6.7): Llama-2-13B shape, A100-like rates, ShareGPT lengths, KV for 40%% of the "
           "candidates, SLO 3x one request's step\n");
    printf("  %-10s %-12s %-12s %-12s %-22s %-18s %-16s\n", "bound B", "mean ms CPU", "p90 ms", "max ms",
           "SLSQP alone worse by", "exact walks/solve", "answers with r>0");
    const int bounds[] = {128, 256, 512, 1024};
    int *s = NULL;
    double *times = NULL;
    int n_prob = 20 * trials;
    if (kvb_calloc(1024, sizeof *s, (void **)&s) || kvb_calloc((size_t)n_prob, sizeof *times, (void **)&times)) goto out;
    for (size_t bi = 0; bi < KVB_ARRAY_LEN(bounds); bi++) {
        int B = bounds[bi], worse = 0, with_r = 0;
        double worst = 0, walks = 0;
        for (int t = 0; t < n_prob; t++) {
            int64_t full = 0;
            for (int i = 0; i < B; i++) {
                int row = (int)(mix64((uint64_t)t * 7777 + (uint64_t)i) % (uint64_t)tr->sharegpt.n);
                s[i] = tr->sharegpt.in[row] + (int)(mix64((uint64_t)i * 31 + (uint64_t)t) % (uint64_t)(tr->sharegpt.out[row] + 1));
                full += KVB_DIV_CEIL(s[i] + 1, 16);
            }
            kvb_etw_problem p = {.d = &d, .rates = k, .layer = kvb_etw_layer_initial(&d, NULL), .s = s, .n = B,
                                 .b_bound = B, .r_max = 0.9, .block_size = 16, .unit_layers = 4,
                                 .mem_blocks = (int64_t)(0.4 * (double)full), .max_rows = 1 << 20,
                                 .act_row_bytes = kvb_etw_act_row_bytes(&d)};
            p.slo_s = 3 * (kvb_etw_step_time(&k, kvb_etw_work_step(&d)) + kvb_etw_time(&k, kvb_etw_work_decode(&d, 2000)));
            kvb_etw_solution sol;
            double t0 = thread_cpu_s();
            if (kvb_etw_solve(&p, &sol) != KVB_OK) goto out;
            times[t] = (thread_cpu_s() - t0) * 1e3;
            walks += sol.exact_evals;
            with_r += sol.r > 0;
            if (sol.b_slsqp < 1 || sol.obj_slsqp > sol.objective * (1 + 1e-9)) {
                worse++;
                if (sol.b_slsqp >= 1) worst = fmax(worst, sol.obj_slsqp / sol.objective - 1);
            }
        }
        double mean = 0, mx = 0;
        for (int t = 0; t < n_prob; t++) {
            mean += times[t] / n_prob;
            mx = fmax(mx, times[t]);
        }
        char wb[64];
        snprintf(wb, sizeof wb, "%d/%d (max %.1f%%)", worse, n_prob, worst * 100);
        printf("  %-10d %-12.3f %-12.3f %-12.3f %-22s %-18.1f %d/%d\n", B, mean, pctl(times, n_prob, 90), mx, wb,
               walks / n_prob, with_r, n_prob);
    }
    /* Where r > 0 pays: Eq. 5 with the corrected cost model on the same shape and rates, B = 256, as the
     * KV memory tightens and the contexts shorten (ShareGPT lengths scaled), r_max 0.9; the median r
     * chosen over the problems of a cell and how many chose r > 0 */
    {
        const double fracs[] = {0.005, 0.02, 0.1, 0.4}, scales[] = {1.0 / 64, 1.0 / 16, 0.25, 1};
        int n_cell = 5 * trials;
        double rs[500];
        printf("  where r > 0 pays (B = 256, SLO 3x one request's step): median r chosen (problems with r > 0 of %d) "
               "by KV memory (fraction of what the candidates' full KV needs) and context (ShareGPT lengths x scale)\n",
               n_cell);
        printf("  %-16s", "KV fraction");
        for (size_t si = 0; si < KVB_ARRAY_LEN(scales); si++) printf(" ctx x%-15g", scales[si]);
        printf("\n");
        for (size_t fi = 0; fi < KVB_ARRAY_LEN(fracs); fi++) {
            printf("  %-16.3f", fracs[fi]);
            for (size_t si = 0; si < KVB_ARRAY_LEN(scales); si++) {
                int with_r = 0, B = 256;
                for (int t = 0; t < n_cell && t < 500; t++) {
                    int64_t full = 0;
                    for (int i = 0; i < B; i++) {
                        int row = (int)(mix64((uint64_t)t * 7919 + (uint64_t)i) % (uint64_t)tr->sharegpt.n);
                        int len = tr->sharegpt.in[row] + (int)(mix64((uint64_t)i * 37 + (uint64_t)t) % (uint64_t)(tr->sharegpt.out[row] + 1));
                        s[i] = KVB_MAX(1, (int)(len * scales[si]));
                        full += KVB_DIV_CEIL(s[i] + 1, 16);
                    }
                    kvb_etw_problem p = {.d = &d, .rates = k, .layer = kvb_etw_layer_initial(&d, NULL), .s = s, .n = B,
                                         .b_bound = B, .r_max = 0.9, .block_size = 16, .unit_layers = 1,
                                         .mem_blocks = (int64_t)(fracs[fi] * (double)full), .max_rows = 1 << 20,
                                         .act_row_bytes = kvb_etw_act_row_bytes(&d)};
                    p.layer.depth = 1;
                    p.slo_s = 3 * (kvb_etw_step_time(&k, kvb_etw_work_step(&d)) + kvb_etw_time(&k, kvb_etw_work_decode(&d, 2000)));
                    kvb_etw_solution sol;
                    if (kvb_etw_solve(&p, &sol) != KVB_OK) goto out;
                    rs[t] = sol.r;
                    with_r += sol.r > 0;
                }
                char cellb[32];
                snprintf(cellb, sizeof cellb, "%.3f (%d)", pctl(rs, KVB_MIN(n_cell, 500), 50), with_r);
                printf(" %-20s", cellb);
            }
            printf("\n");
        }
        /* the closed form behind the table: memory-bound, b = b0 / (1 - r), so a request's share of a step
         * is base·(1 - r)/b0 + its decode + r·s·t_tok, linear in r: r > 0 lowers Eq. 5 only where
         * s·t_tok < base / b0 (recompute attention, superlinear in u, only adds to the right side) */
        double base = kvb_etw_step_time(&k, kvb_etw_work_step(&d)), ttok = kvb_etw_time(&k, kvb_etw_work_recompute(&d, 1, d.n_layers));
        printf("  (memory-bound, Eq. 5 per request is base·(1-r)/b0 + decode + r·s·t_tok: linear in r, so r > 0 pays only "
               "where a request's context s < base / (b0·t_tok); here base (fixed + weight read) %.2f ms, t_tok (one "
               "token through all layers) %.4f ms: s < %.0f / b0 tokens, or where r = 0 fits not even the queue's head "
               "(b0 < 1: the top row); the paper's model charges every decode 2hV·s of logits, which makes r = 0 look "
               "far costlier)\n", base * 1e3, ttok * 1e3, base / ttok);
    }
    /* layer level: (l1, l2) and δ per call, on a running set of 256 */
    {
        int ss[256], uu[256];
        for (int i = 0; i < 256; i++) {
            ss[i] = 200 + (int)(mix64((uint64_t)i) % 1800);
            uu[i] = ss[i] / 3;
        }
        kvb_etw_batch bt = {.b = 256, .s = ss, .u = uu};
        kvb_etw_link link = {.bytes_per_s = 25e9, .latency_s = 10e-6};
        kvb_etw_layer_plan lp;
        int reps = 2000;
        double t0 = thread_cpu_s();
        for (int r = 0; r < reps; r++) kvb_etw_layer_optimize(&d, &k, &link, &bt, 1024, KVB_ETW_DEVICE_GPU, &lp);
        double per = (thread_cpu_s() - t0) / reps;
        printf("  layer level (six (l1, l2), δ) on 256 running requests: %.1f us per call (the paper: ~0.03 ms); "
               "chose l1 %d, l2 %d, %d swapped layers, δ %d of 1024\n", per * 1e6, lp.l1, lp.l2, lp.n_swap, lp.delta);
    }
out:
    free(s);
    free(times);
}

typedef struct fake_pool {
    int next, live;
    int32_t *free_ids;
    int n_free, cap;
} fake_pool;
static kvb_status fp_alloc(void *ud, int32_t *b) {
    fake_pool *f = ud;
    *b = f->n_free ? f->free_ids[--f->n_free] : f->next++;
    f->live++;
    return KVB_OK;
}
static void fp_free(void *ud, int32_t b) {
    fake_pool *f = ud;
    f->live--;
    if (f->n_free == f->cap) {
        int c = f->cap ? 2 * f->cap : 256;
        if (kvb_realloc_array((void **)&f->free_ids, (size_t)c, sizeof *f->free_ids) != KVB_OK) return;
        f->cap = c;
    }
    f->free_ids[f->n_free++] = b;
}

/* §6.5 (Table 2) as the paper's map table would do it for kvbank's pipeline: every absent token block of
 * a running set gets its window of units as the step moves up the layers (window of `depth` layers), with
 * a lookup per layer; fragmentation = unused token-layers of the held carriers, map cost per step. */
static void bench_map(void) {
    printf("\n== map table (§3.2, §6.5): 40 layers, block 16, 256 requests with 40..800 absent tokens, a window of "
           "2 layers (the decode's and the recompute's next) moving up one step\n");
    printf("  %-4s %-16s %-18s %-22s %-18s\n", "F", "fragmentation %", "peak carriers", "map ops per step (us)",
           "per lookup (ns)");
    const int L = 40, bs = 16, R = 256, depth = 2;
    int u[256];
    int64_t tb = 0;
    for (int i = 0; i < R; i++) {
        u[i] = 40 + (int)(mix64((uint64_t)i * 3) % 761);
        tb += KVB_DIV_CEIL(u[i], bs);
    }
    const int Fs[] = {1, 2, 4, 8};
    for (size_t fi = 0; fi < KVB_ARRAY_LEN(Fs); fi++) {
        int F = Fs[fi];
        fake_pool fp = {0};
        kvb_etw_map_blocks prov = {.ud = &fp, .alloc = fp_alloc, .free = fp_free};
        kvb_etw_map *m = NULL;
        if (kvb_etw_map_create(L, F, bs, &prov, &m) != KVB_OK) return;
        int f = kvb_etw_map_unit_layers(L, F), groups = kvb_etw_map_groups_of(m);
        double frag_sum = 0;
        int frag_n = 0;
        int64_t peak = 0, lookups = 0;
        double t0 = thread_cpu_s();
        for (int l = 0; l < L; l++) {
            int g_lo = l / f, g_hi = (KVB_MIN(L, l + depth) - 1) / f;
            for (int i = 0; i < R; i++)
                for (int j = 0; j < KVB_DIV_CEIL(u[i], bs); j++) {
                    int filled = KVB_MIN(bs, u[i] - j * bs);
                    for (int g = g_lo; g <= g_hi; g++) {
                        kvb_etw_map_entry e;
                        if (kvb_etw_map_entry_of(m, (uint64_t)i, j, g, &e) != KVB_OK)
                            (void)kvb_etw_map_add(m, (uint64_t)i, j, g, filled);
                    }
                    if (g_lo > 0) (void)kvb_etw_map_remove(m, (uint64_t)i, j, g_lo - 1);
                    kvb_etw_map_loc loc;
                    (void)kvb_etw_map_lookup(m, (uint64_t)i, j, l, &loc);
                    lookups++;
                }
            kvb_etw_map_stats st;
            kvb_etw_map_get_stats(m, &st);
            peak = KVB_MAX(peak, st.carriers);
            /* the window uses `depth` layers of each unit's F (or fewer at the top) */
            double used = 0;
            for (int i = 0; i < R; i++) used += (double)u[i] * (double)KVB_MIN(depth, L - l);
            if (st.held_bytes > 0) {
                frag_sum += 1 - used / st.held_bytes;
                frag_n++;
            }
        }
        double dt = thread_cpu_s() - t0;
        (void)groups;
        printf("  %-4d %-16.1f %-18lld %-22.1f %-18.1f\n", F, 100 * frag_sum / KVB_MAX(1, frag_n), (long long)peak,
               dt * 1e6, dt * 1e9 / (double)lookups);
        kvb_etw_map_destroy(m);
        free(fp.free_ids);
    }
    printf("  (%lld absent token blocks; kvbank's fused CPU step keeps one single-layer scratch slice per absent "
           "block, indexed directly: F = 1 without a table)\n", (long long)tb);
}

/* ---------------------------------------------------------------- the benchmark */

#define N_POL 4
static const char *const pol_names[N_POL] = {"ellm-tokenwise", "vllm-recompute", "vllm-swap", "hcache"};

typedef struct cell {
    agg tok, slo_tok, ttft, p99, tpot, attain, run_mean, run_max, cached, util, mape, solve, solve_max;
    agg host_loads, r_used, b_used, t_base, t_tok;
} cell;

static void cell_add(cell *c, const run_res *r) {
    if (!r->ok) return;
    agg_add(&c->tok, r->tok_s);
    agg_add(&c->slo_tok, r->slo_tok_s);
    agg_add(&c->ttft, r->ttft_mean);
    agg_add(&c->p99, r->ttft_p99);
    agg_add(&c->tpot, r->tpot_mean);
    agg_add(&c->attain, r->attain);
    agg_add(&c->run_mean, r->run_mean);
    agg_add(&c->run_max, r->run_max);
    agg_add(&c->cached, r->cached);
    agg_add(&c->util, r->util);
    agg_add(&c->mape, r->mape);
    agg_add(&c->solve, r->solve_mean_ms);
    agg_add(&c->solve_max, r->solve_max_ms);
    agg_add(&c->host_loads, r->host_loads);
    agg_add(&c->r_used, r->r_used);
    agg_add(&c->b_used, r->b_used);
    agg_add(&c->t_base, r->t_base);
    agg_add(&c->t_tok, r->t_tok);
}

typedef struct bench_cfg {
    const char *traces_dir, *model_dir, *link_preset, *parts;
    kvb_bench_dev dev;
    int n_req, trials, block_size, max_batch_tokens, max_seqs;
    double budget_frac, slo_x, loads[16];
    int n_loads;
    int workloads[WL_COUNT];
    int n_wl;
    double in_scale[WL_COUNT], out_scale[WL_COUNT];
    int max_len;
} bench_cfg;

static int has_part(const bench_cfg *c, const char *p) {
    return !strcmp(c->parts, "all") || strstr(c->parts, p) != NULL;
}

/* Makes the two models (once; kept in model_dir between runs). */
static kvb_status ensure_model(const char *dir, int kv_heads) {
    char cfg[800];
    snprintf(cfg, sizeof cfg, "%s/config.json", dir);
    struct stat sb;
    if (stat(cfg, &sb) == 0) return KVB_OK;
    char cmd[1200];
    const char *bin = getenv("KVB_BUILDDIR");
    snprintf(cmd, sizeof cmd,
             "%s%skvbank-mkmodel --arch llama --layers 8 --hidden 384 --heads 6 --kv-heads %d --intermediate 1024 "
             "--vocab 2048 --max-pos 4096 --seed 12 %s >/dev/null",
             bin ? bin : "", bin ? "/" : "", kv_heads, dir);
    if (system(cmd) != 0) {
        KVB_LOG_E("bench ellm-tw: '%s' failed (set KVB_BUILDDIR to the build directory)", cmd);
        return KVB_ERR_IO;
    }
    return KVB_OK;
}

typedef struct model_ctx {
    const char *label;
    kvb_backend *be;
    kvb_model *m;
    kvb_link_model links; /* calibrated on this model */
} model_ctx;

static void fill_params(run_opts *o, const char *pol, double slo_s, char storage[4][64]) {
    o->policy = pol;
    snprintf(storage[0], 64, "slo_ms=%.3f", slo_s * 1e3);
    int k = 0;
    o->params[k++] = storage[0];
    if (!strcmp(pol, "ellm-tokenwise")) o->params[k++] = "rows=0";
    o->params[k] = NULL;
}

static void print_cell_row(const char *label, const cell *c) {
    char a[64], b[64], d[64], f[64], g[64], h[64], i[64], i2[64], j[64], k[64];
    printf("  %-20s %-20s %-20s %-20s %-20s %-18s %-16s %-14s %-14s %-12s %-12s\n", label,
           fmt_agg(a, sizeof a, &c->tok, 1, 1), fmt_agg(b, sizeof b, &c->slo_tok, 1, 1),
           fmt_agg(d, sizeof d, &c->ttft, 1e3, 1), fmt_agg(f, sizeof f, &c->p99, 1e3, 1),
           fmt_agg(g, sizeof g, &c->tpot, 1e3, 2), fmt_agg(h, sizeof h, &c->attain, 100, 1),
           fmt_agg(i, sizeof i, &c->run_mean, 1, 1), fmt_agg(i2, sizeof i2, &c->run_max, 1, 0),
           fmt_agg(j, sizeof j, &c->cached, 1, 2), fmt_agg(k, sizeof k, &c->util, 100, 1));
}

static void print_header(void) {
    printf("  %-20s %-20s %-20s %-20s %-20s %-18s %-16s %-14s %-14s %-12s %-12s\n", "policy", "out tok/s",
           "tok/s in SLO", "TTFT mean ms", "TTFT P99 ms", "TPOT ms", "SLO attain %", "running avg", "running max",
           "cached", "util %");
}

/* A workload's run setup: KV budget, SLO, the 1.0x arrival scale. */
typedef struct prep {
    run_opts o;
    double slo, tpot0, cap_rate;
    double ctx; /* the workload's mean context while decoding: mean in + mean out / 2 */
} prep;

static kvb_status prepare(const bench_cfg *c, const traces *tr, const model_ctx *mc, wl_kind k, prep *pr) {
    const kvb_link_model *links = &mc->links;
    workload w0;
    KVB_TRY(wl_make(tr, k, c->n_req, 1, c->in_scale[k], c->out_scale[k], c->max_len, &w0));
    /* the budget: a fraction of the blocks all requests of the run would hold together, at least what
     * the longest one needs */
    int need = 0, longest = 0;
    for (int i = 0; i < w0.n; i++) {
        int b = (int)ceil((double)(w0.in[i] + w0.out[i]) / c->block_size);
        need += b;
        longest = KVB_MAX(longest, b);
    }
    memset(pr, 0, sizeof *pr);
    run_opts *o = &pr->o;
    *o = (run_opts){.block_size = c->block_size, .max_batch_tokens = c->max_batch_tokens, .max_seqs = c->max_seqs,
                    .links = *links};
    o->n_blocks = KVB_MAX((int)(need * c->budget_frac), longest + 2);
    /* unloaded TPOT: one request of the workload's mean lengths alone */
    workload one = {.n = 1};
    double t1 = 0;
    int ii = (int)w0.mean_in, oo = (int)KVB_MAX(8, w0.mean_out);
    one.t = &t1;
    one.in = &ii;
    one.out = &oo;
    run_res r;
    o->policy = "recompute";
    o->params[0] = NULL;
    o->load = 0;
    o->slo_s = 1e9;
    kvb_status st = run_once(mc->m, &one, o, &r);
    if (st != KVB_OK) goto out;
    pr->tpot0 = r.tpot_mean;
    pr->slo = c->slo_x * pr->tpot0;
    o->slo_s = pr->slo;
    /* 1.0x: half of what vllm-recompute serves closed-loop */
    char store[4][64];
    fill_params(o, "vllm-recompute", pr->slo, store);
    o->load = 0;
    st = run_once(mc->m, &w0, o, &r);
    if (st != KVB_OK) goto out;
    pr->cap_rate = w0.n / r.wall_s;
    double span = w0.t[w0.n - 1] > 0 ? w0.t[w0.n - 1] : 1;
    o->time_scale = span / (w0.n / (0.5 * pr->cap_rate));
    o->warmup = c->n_req / 10;
    pr->ctx = w0.mean_in + w0.mean_out / 2;
    printf("== %s model, workload %s: %d requests, mean in %.0f / out %.0f tokens; KV budget %d blocks of %d (%.2f "
           "of the run's %d); unloaded TPOT %.2f ms, SLO %.2f ms (%.1fx); 1.0x = %.2f req/s (half of vllm-recompute's "
           "closed-loop %.2f)\n",
           mc->label, wl_names[k], w0.n, w0.mean_in, w0.mean_out, o->n_blocks, c->block_size,
           (double)o->n_blocks / need, need, pr->tpot0 * 1e3, pr->slo * 1e3, c->slo_x, 0.5 * pr->cap_rate, pr->cap_rate);
out:
    wl_free(&w0);
    return st;
}

typedef struct variant {
    const char *label, *policy;
    const char *params[6];
} variant;

/* Runs every variant at every load, trials interleaved (each trial runs all variants on the same
 * requests), and prints a table per load; with `ratios`, eLLM against each other row, and goodput. */
static kvb_status run_variants(const bench_cfg *c, const traces *tr, const model_ctx *mc, wl_kind k, prep *pr,
                               const variant *vs, int nv, const double *loads, int n_loads, int ratios) {
    static cell cells[16][16];
    memset(cells, 0, sizeof cells);
    run_opts o = pr->o;
    char slo[64];
    snprintf(slo, sizeof slo, "slo_ms=%.3f", pr->slo * 1e3);
    for (int li = 0; li < n_loads; li++) {
        o.load = loads[li];
        for (int t = 0; t < c->trials; t++) {
            workload w;
            KVB_TRY(wl_make(tr, k, c->n_req, 1 + (uint64_t)t, c->in_scale[k], c->out_scale[k], c->max_len, &w));
            for (int v = 0; v < nv && v < 16; v++) {
                o.policy = vs[v].policy;
                int n = 0;
                o.params[n++] = slo;
                if (!strcmp(vs[v].policy, "ellm-tokenwise")) o.params[n++] = "rows=0";
                for (int j = 0; vs[v].params[j] && n < 7; j++) o.params[n++] = vs[v].params[j];
                o.params[n] = NULL;
                run_res r;
                if (run_once(mc->m, &w, &o, &r) != KVB_OK) {
                    printf("    %s failed at load %.1fx\n", vs[v].label, o.load);
                    continue;
                }
                cell_add(&cells[li][v], &r);
            }
            wl_free(&w);
        }
        printf(" load %.1fx (%.2f req/s)\n", o.load, o.load * 0.5 * pr->cap_rate);
        print_header();
        for (int v = 0; v < nv; v++)
            if (cells[li][v].tok.n) print_cell_row(vs[v].label, &cells[li][v]);
        if (ratios)
            for (int v = 1; v < nv; v++)
                if (cells[li][v].tok.n && cells[li][0].tok.n)
                    printf("  %s / %-14s throughput %.2fx, in-SLO throughput %.2fx, mean TTFT %.2fx lower\n",
                           vs[0].label, vs[v].label, agg_med(&cells[li][0].tok) / agg_med(&cells[li][v].tok),
                           agg_med(&cells[li][0].slo_tok) / fmax(1e-9, agg_med(&cells[li][v].slo_tok)),
                           agg_med(&cells[li][v].ttft) / agg_med(&cells[li][0].ttft));
        for (int v = 0; v < nv; v++)
            if (cells[li][v].mape.n && !strcmp(vs[v].policy, "ellm-tokenwise")) {
                char a[64], b2[64], d[64];
                printf("  %s: cost model MAPE %s %%, solver %s ms per solve (max %s ms)\n", vs[v].label,
                       fmt_agg(a, sizeof a, &cells[li][v].mape, 100, 1), fmt_agg(b2, sizeof b2, &cells[li][v].solve, 1, 3),
                       fmt_agg(d, sizeof d, &cells[li][v].solve_max, 1, 3));
                break;
            }
        for (int v = 0; v < nv; v++) {
            const cell *cv = &cells[li][v];
            if (!cv->r_used.n || strcmp(vs[v].policy, "ellm-tokenwise")) continue;
            /* the optimizer's r: recomputing pays only while the running set's recomputed tokens cost
             * less than the step's base (fixed cost + weight read) they help share among more requests */
            char a[64], b2[64], d[64], f[64], g[64];
            double hide = agg_med(&cv->t_base) / fmax(1e-12, agg_med(&cv->t_tok));
            printf("  %s: r used %s, b %s; fitted model: step base (fixed + weight read) %s ms, one token recomputed "
                   "through all layers %s ms: r > 0 pays only for contexts under base / (b·t_tok) = %.1f tokens "
                   "(the workload's mean context while decoding: %.0f)",
                   vs[v].label, fmt_agg(a, sizeof a, &cv->r_used, 1, 3), fmt_agg(b2, sizeof b2, &cv->b_used, 1, 2),
                   fmt_agg(d, sizeof d, &cv->t_base, 1e3, 2), fmt_agg(f, sizeof f, &cv->t_tok, 1e3, 3),
                   hide / fmax(1.0, agg_med(&cv->b_used)), pr->ctx);
            if (cv->host_loads.n && cv->host_loads.max > 0)
                printf("; (block, layer) slices from the host tier per run %s", fmt_agg(g, sizeof g, &cv->host_loads, 1, 0));
            printf("\n");
        }
    }
    if (ratios && n_loads > 1) {
        printf(" goodput (the highest load with SLO attainment >= 90%%):");
        for (int v = 0; v < nv; v++) {
            double best = 0;
            for (int li = 0; li < n_loads; li++)
                if (cells[li][v].attain.n && agg_med(&cells[li][v].attain) >= 0.9) best = fmax(best, loads[li]);
            printf("  %s %.1fx (%.2f req/s)", vs[v].label, best, best * 0.5 * pr->cap_rate);
        }
        printf("\n");
    }
    printf("\n");
    return KVB_OK;
}

/* A part of variants on the first workload at 2x, per model, under `title`. */
static kvb_status run_part(const bench_cfg *c, const traces *tr, const model_ctx *mods, const char *title,
                           const variant *vs, int nv) {
    wl_kind k = c->n_wl ? (wl_kind)c->workloads[0] : WL_SHAREGPT;
    for (int mi = 0; mi < 2; mi++) {
        prep pr;
        KVB_TRY(prepare(c, tr, &mods[mi], k, &pr));
        double l2[1] = {2.0};
        printf("%s\n", title);
        KVB_TRY(run_variants(c, tr, &mods[mi], k, &pr, vs, nv, l2, 1, 0));
    }
    return KVB_OK;
}

int kvb_bench_ellm_tw(int argc, char **argv) {
    setvbuf(stdout, NULL, _IOLBF, 0); /* long runs: show each table as it is done */
    bench_cfg c = {.traces_dir = "../shared/traces", .model_dir = "/tmp/kvb-bench-ellm-tw", .link_preset = NULL,
                   .parts = "main,sweep,ablate,layers,solver", .dev = {.backend = "cpu", .device = -1, .threads = 1}, .n_req = 60,
                   .trials = 3, .block_size = 16, .max_batch_tokens = 512, .max_seqs = 64, .budget_frac = 0.1,
                   .slo_x = 4, .max_len = 1024};
    double def_loads[] = {0.5, 1, 2, 3};
    memcpy(c.loads, def_loads, sizeof def_loads);
    c.n_loads = 4;
    for (int k = 0; k < WL_COUNT; k++) c.workloads[c.n_wl++] = k;
    /* lengths scaled to a tiny model on two shared cores */
    c.in_scale[WL_SHAREGPT] = c.in_scale[WL_SHAREGPT_PAPER] = 1.0 / 32;
    c.out_scale[WL_SHAREGPT] = 1.0 / 16;
    c.out_scale[WL_SHAREGPT_PAPER] = 1.0 / 32;
    c.in_scale[WL_LONG] = c.in_scale[WL_LONG_PAPER] = 1.0 / 64;
    c.out_scale[WL_LONG] = 1.0 / 4;
    c.out_scale[WL_LONG_PAPER] = 1.0 / 64;
    c.in_scale[WL_AZURE] = 1.0 / 16;
    c.out_scale[WL_AZURE] = 1.0 / 8;
    static const struct option opts[] = {
        {"traces", 1, 0, 'T'},  {"models", 1, 0, 'M'},   {"links", 1, 0, 'L'},  {"parts", 1, 0, 'P'},
        {"threads", 1, 0, 't'}, {"requests", 1, 0, 'n'}, {"trials", 1, 0, 'r'}, {"budget", 1, 0, 'b'},
        {"slo-x", 1, 0, 's'},   {"loads", 1, 0, 'l'},    {"workloads", 1, 0, 'w'}, {"help", 0, 0, 'h'},
        {"backend", 1, 0, 'B'}, {"device", 1, 0, 'D'},  {0, 0, 0, 0}};
    int ch;
    int64_t v;
    while ((ch = getopt_long(argc, argv, "h", opts, NULL)) != -1) {
        kvb_status st = KVB_OK;
        int d = kvb_bench_dev_opt(&c.dev, ch, optarg, "kvbank-bench ellm-tw");
        if (d == 2) return 2;
        if (d) continue;
        switch (ch) {
        case 'T': c.traces_dir = optarg; break;
        case 'M': c.model_dir = optarg; break;
        case 'L': c.link_preset = optarg; break;
        case 'P': c.parts = optarg; break;
        case 't': st = kvb_parse_i64(optarg, 1, 64, &v); c.dev.threads = (int)v; break;
        case 'n': st = kvb_parse_i64(optarg, 4, 100000, &v); c.n_req = (int)v; break;
        case 'r': st = kvb_parse_i64(optarg, 1, 100, &v); c.trials = (int)v; break;
        case 'b': st = kvb_parse_f64(optarg, &c.budget_frac); break;
        case 's': st = kvb_parse_f64(optarg, &c.slo_x); break;
        case 'l': {
            c.n_loads = 0;
            char buf[256];
            snprintf(buf, sizeof buf, "%s", optarg);
            for (char *tok = strtok(buf, ","); tok && c.n_loads < 16; tok = strtok(NULL, ","))
                if (kvb_parse_f64(tok, &c.loads[c.n_loads++]) != KVB_OK || c.loads[c.n_loads - 1] <= 0) st = KVB_ERR_INVALID;
            break;
        }
        case 'w': {
            c.n_wl = 0;
            char buf[256];
            snprintf(buf, sizeof buf, "%s", optarg);
            for (char *tok = strtok(buf, ","); tok; tok = strtok(NULL, ",")) {
                int k = 0;
                while (k < WL_COUNT && strcmp(tok, wl_names[k])) k++;
                if (k == WL_COUNT) st = KVB_ERR_INVALID;
                else c.workloads[c.n_wl++] = k;
            }
            break;
        }
        default:
            fprintf(ch == 'h' ? stdout : stderr,
                    "usage: kvbank-bench ellm-tw [--parts main,sweep,ablate,layers,solver|all] [--workloads W,..] [--loads X,..]\n"
                    "                            [--trials N] [--requests N] [--budget FRAC] [--slo-x X] [--links PRESET]\n"
                    "                            [--traces DIR] [--models DIR] [--threads N] [--backend NAME] [--device N]\n"
                    "  eLLM token-wise against vllm-recompute, vllm-swap and hcache (paper §6) on an MHA and a GQA\n"
                    "  tiny model. Workloads: sharegpt, sharegpt-paper, mooncake, mooncake-paper, azure (the -paper\n"
                    "  ones resample outputs to the paper's in/out ratio). Defaults: all parts, all workloads, loads\n"
                    "  0.5,1,2,3, 3 trials of 60 requests, a KV budget of 0.1 of the run's total KV, SLO = 4x the\n"
                    "  unloaded TPOT, links a100-pcie4-scaled on the CPU (off on a GPU), traces ../shared/traces.\n"
                    KVB_BENCH_DEV_USAGE);
            return ch == 'h' ? 0 : 2;
        }
        if (st != KVB_OK || c.budget_frac <= 0 || c.slo_x <= 0) {
            fprintf(stderr, "kvbank-bench ellm-tw: bad value '%s'\n", optarg);
            return 2;
        }
    }
    int rc = 1;
    traces tr = {0};
    model_ctx mods[2] = {{.label = "MHA"}, {.label = "GQA"}};
    char path[600];
    snprintf(path, sizeof path, "%s/sharegpt_8k_filtered_stats_llama2_tokenizer.csv", c.traces_dir);
    if (load_lens(path, &tr.sharegpt) != KVB_OK) goto out;
    snprintf(path, sizeof path, "%s/synthetic_trace.jsonl", c.traces_dir);
    if (load_lens(path, &tr.mooncake) != KVB_OK) goto out;
    snprintf(path, sizeof path, "%s/AzureLLMInferenceTrace_conv.csv", c.traces_dir);
    if (load_lens(path, &tr.azure) != KVB_OK) goto out;
    mkdir(c.model_dir, 0700);
    for (int k = 0; k < 2; k++) {
        char dir[700];
        snprintf(dir, sizeof dir, "%s/%s", c.model_dir, k ? "gqa" : "mha");
        if (ensure_model(dir, k ? 2 : 6) != KVB_OK) goto out;
        if (kvb_bench_backend(&c.dev, &mods[k].be) != KVB_OK || kvb_model_load(dir, mods[k].be, &mods[k].m) != KVB_OK)
            goto out;
    }
    printf("kvbank-bench ellm-tw: eLLM token-wise against its baselines (paper §6), %s backend, %d threads\n",
           mods[0].be->iface->name, c.dev.threads);
    /* each model's time scale at the paper's ShareGPT operating point: 16 requests decoding over 900 tokens
     * (222 in + half of 1,346 out), the lengths scaled as the ShareGPT workload's prompts */
    kvb_link_point pt = {.batch = 16, .q = 1, .ctx = 900 * c.in_scale[WL_SHAREGPT], .target_ctx = 900};
    for (int k = 0; k < 2; k++) {
        printf("%s model:\n", mods[k].label);
        if (kvb_bench_links(mods[k].m, &c.dev, c.link_preset, "a100-pcie4-scaled", &pt, &mods[k].links) != KVB_OK)
            goto out;
        printf("  ");
        kvb_link_regime_print(stdout, &mods[k].links, KVB_LINK_HOST, 0, NULL);
    }
    printf("(the paper gives no transfer / compute figure: its testbed is an A100 over PCIe 4.0 x16 without NVLink, §6.1)\n");
    printf("models: small Llama, 8 layers, hidden 384, 6 heads of 64, SwiGLU 1024, vocab 2048, f32 (57 MB of weights: "
           "more than the last-level cache, so that a decode step reads its weights from memory and batching pays, "
           "as on a GPU): MHA (6 KV heads) and GQA (2 KV heads); block size %d, %d forward rows per step for every "
           "policy, prefix cache off\n",
           c.block_size, c.max_batch_tokens);
    printf("scaled: %d requests per run (the paper: 3,000 inter-arrival times), %d trials (the paper: 5), the first 10%% "
           "of requests are the warm-up (the paper: 2 minutes)\n\n", c.n_req, c.trials);

    /* ---- main and sweep: per model and workload, the four policies */
    if (has_part(&c, "main") || has_part(&c, "sweep")) {
        for (int mi = 0; mi < 2; mi++)
            for (int wi = 0; wi < c.n_wl; wi++) {
                prep pr;
                wl_kind k = (wl_kind)c.workloads[wi];
                if (prepare(&c, &tr, &mods[mi], k, &pr) != KVB_OK) goto out;
                variant vs[N_POL];
                int nv = 0;
                for (int p = 0; p < N_POL; p++)
                    if (kvb_policy_find(pol_names[p])) vs[nv++] = (variant){pol_names[p], pol_names[p], {NULL}};
                int sweep = has_part(&c, "sweep");
                double loads_main[1] = {2.0};
                if (run_variants(&c, &tr, &mods[mi], k, &pr, vs, nv, sweep ? c.loads : loads_main,
                                 sweep ? c.n_loads : 1, 1) != KVB_OK)
                    goto out;
            }
    }
    /* ---- ablations (§6.3, §6.6) on one workload at 2x: the optimizer's inputs off by ±20%, the paper's
     * operating points as fixed ratios */
    if (has_part(&c, "ablate")) {
        static const variant vs[] = {
            {"ellm-tokenwise", "ellm-tokenwise", {NULL}},
            {"FLOPS +20%", "ellm-tokenwise", {"perturb_flops=1.2", NULL}},
            {"FLOPS -20%", "ellm-tokenwise", {"perturb_flops=0.8", NULL}},
            {"bandwidth +20%", "ellm-tokenwise", {"perturb_bw=1.2", NULL}},
            {"bandwidth -20%", "ellm-tokenwise", {"perturb_bw=0.8", NULL}},
            {"fixed r = 0.1", "ellm-tokenwise", {"r=0.1", NULL}},
            {"fixed r = 0.36", "ellm-tokenwise", {"r=0.36", NULL}},
            {"vllm-recompute", "vllm-recompute", {NULL}},
        };
        if (run_part(&c, &tr, mods, "-- ablations (the optimizer's FLOPS / bandwidth off by 20% as §6.6; r fixed at "
                     "0.1 and at the paper's average uncached ratio 0.36 on ShareGPT)", vs, (int)KVB_ARRAY_LEN(vs)) != KVB_OK)
            goto out;
    }
    /* ---- layers (§4.3, §6.3) on one workload at 2x, r fixed at the paper's 0.36 so that there is a
     * prefix to recompute or load: all layers recomputed, "without fusion", the top half of the layers
     * from the host tier with and without overlap, and swapping as the layer level chooses */
    if (has_part(&c, "layers")) {
        static const variant vs[] = {
            {"r=.36 recompute", "ellm-tokenwise", {"r=0.36", NULL}},
            {"r=.36 w/o fusion", "ellm-tokenwise", {"r=0.36", "fuse=0", NULL}},
            {"r=.36 swap 4 of 8", "ellm-tokenwise", {"r=0.36", "swap=1", "n_swap=4", NULL}},
            {"r=.36 swap w/o overlap", "ellm-tokenwise", {"r=0.36", "swap=1", "n_swap=4", "overlap=0", NULL}},
            {"swap, layer level", "ellm-tokenwise", {"swap=1", NULL}},
            {"vllm-recompute", "vllm-recompute", {NULL}},
        };
        if (run_part(&c, &tr, mods, "-- prefix layers (§4.3, §6.3) at r = 0.36: every layer recomputed (fused into "
                     "the decode's GEMMs), \"without fusion\" (the recomputed rows' GEMMs apart), the top 4 of 8 layers of "
                     "the released blocks loaded from the host tier two layers ahead, \"without overlap\" (each layer's "
                     "loads when it is due), and swapping with the optimizers' own choices, under the link preset above",
                     vs, (int)KVB_ARRAY_LEN(vs)) != KVB_OK)
            goto out;
    }
    if (has_part(&c, "solver")) {
        bench_solver(&tr, c.trials);
        bench_map();
    }
    rc = 0;
out:
    for (int k = 0; k < 2; k++) {
        kvb_model_destroy(mods[k].m);
        kvb_backend_destroy(mods[k].be);
    }
    lens_free(&tr.sharegpt);
    lens_free(&tr.mooncake);
    lens_free(&tr.azure);
    return rc;
}
