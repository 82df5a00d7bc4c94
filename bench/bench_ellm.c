/* kvbank-bench ellm-el — eLLM elastic memory (ellm-elastic-memory.txt §6) against its baselines, side by
 * side in one run: the static split (vLLM) and the static split with chunked prefill (vLLM-CP), same
 * model, same budget of KV + activation memory, same requests.
 *
 * Scaling (stated in the output): every length is the paper's times k = the model's max context /
 * 262,144 (Llama3-8B-262K): 2k-2k, 32k-2k and ShareGPT lengths (../shared/traces), outputs forced to
 * their length. The budget makes the static split's activation reserve (a model-length step) a given
 * share of the memory (paper Fig. 1/3: 30-40%). SLO = 25x the uncontended TTFT and TPOT (one request
 * at a time). Arrivals are Poisson at rates relative to the static split's saturation rate (its
 * offline throughput); goodput = the highest rate with >= 90% of requests within both SLOs, found by
 * bisection. Every number is the mean over --runs runs with its spread (min..max).
 *
 * Time is the engine's: a virtual clock advances by each step's wall time less what the engine's thread
 * waited for a CPU (Linux schedstat) and jumps over idle gaps, as ellm-tw's does, so that neighbours on a
 * shared machine do not stretch a run; token times are the clock at the end of their step.
 *
 * Tables: the setup; online curves per workload (TTFT, TPOT, output throughput, SLO attainment);
 * goodput and its ratios; offline throughput, decode throughput and the largest batch; the ablations
 * (intra-GPU only, GPU-CPU only); the time breakdown (planning, VM calls, sync/async maps). */
#include <getopt.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "bench/bench.h"
#include "bench/bench_link.h"
#include "common/model/model.h"
#include "common/policy/ellm_elastic.h"
#include "common/policy/policy.h"
#include "common/sched/engine.h"
#include "common/util/progress.h"

#define PAPER_CTX 262144.0

typedef struct wl {
    const char *name;
    int n;
    int *in, *out; /* [n] prompt and output lengths */
} wl;

typedef struct req_rec {
    double t_arr;      /* scheduled arrival, s from the run's start */
    double t_first;    /* first token, s (NAN before) */
    double t_last;
    int n_tok;
    int done;
    int stamp;         /* tokens since the last step's end: their time is that step's end */
} req_rec;

typedef struct run_res {
    double ttft_mean, ttft_p50, ttft_p99, tpot_mean, tpot_p99, attain, out_tps, span_s;
    double exec_s, decode_s, plan_s, vm_s, vm_sync_s;
    uint64_t out_tokens, prompt_tokens, decode_tokens;
    uint64_t host_bytes, host_busy_ns; /* the host link (the CPU buffer's offloads and fetches) */
    int max_batch, failed;
    kvb_ee_report rep;
} run_res;

typedef struct bench {
    kvb_backend *be;
    kvb_model *m;
    int vocab, max_len, threads, max_seqs, block_size;
    double budget_mb;
    kvb_link_model links; /* the stager's link model for this run */
    double k;          /* length scale */
    double slo_ttft, slo_tpot; /* seconds, per workload (set before its runs) */
    req_rec *recs;
    double vt;         /* engine time now, s from the run's start */
    int quiet;
    kvb_bench_dev dev;
} bench;

/* ---------------------------------------------------------------- small helpers */

static int cmp_d(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

static double pct(double *v, int n, double p) {
    if (n == 0) return NAN;
    qsort(v, (size_t)n, sizeof *v, cmp_d);
    int k = (int)ceil(p / 100.0 * n) - 1;
    return v[KVB_MAX(0, KVB_MIN(n - 1, k))];
}

static uint64_t rng_next(uint64_t *s) {
    *s ^= *s << 13;
    *s ^= *s >> 7;
    *s ^= *s << 17;
    return *s;
}

static double rng_unit(uint64_t *s) { return (double)(rng_next(s) >> 11) / 9007199254740992.0; }

/* mean and spread of v[0..n) */
typedef struct spread {
    double mean, lo, hi;
} spread;

static spread spread_of(const double *v, int n) {
    spread s = {0, INFINITY, -INFINITY};
    for (int i = 0; i < n; i++) {
        s.mean += v[i] / n;
        s.lo = fmin(s.lo, v[i]);
        s.hi = fmax(s.hi, v[i]);
    }
    return s;
}

static void print_spread(const char *fmt, spread s, int runs) {
    char a[32], b[32], c[32];
    snprintf(a, sizeof a, fmt, s.mean);
    if (runs > 1) {
        snprintf(b, sizeof b, fmt, s.lo);
        snprintf(c, sizeof c, fmt, s.hi);
        printf(" %s (%s..%s)", a, b, c);
    } else {
        printf(" %s", a);
    }
}

/* ---------------------------------------------------------------- workloads */

static void wl_free(wl *w) {
    free(w->in);
    free(w->out);
    memset(w, 0, sizeof *w);
}

static kvb_status wl_fixed(const char *name, int n, int in, int out, wl *w) {
    *w = (wl){.name = name, .n = n};
    KVB_TRY(kvb_malloc((size_t)n * sizeof(int), (void **)&w->in));
    KVB_TRY(kvb_malloc((size_t)n * sizeof(int), (void **)&w->out));
    for (int i = 0; i < n; i++) {
        w->in[i] = in;
        w->out[i] = out;
    }
    return KVB_OK;
}

/* ShareGPT lengths (num_prefill_tokens, num_decode_tokens), scaled by k, sampled with a seed. */
static kvb_status wl_sharegpt(const char *path, int n, double k, int max_len, uint64_t seed, wl *w) {
    FILE *f = fopen(path, "r");
    if (!f) {
        KVB_LOG_E("ellm-el: cannot open %s", path);
        return KVB_ERR_IO;
    }
    int cap = 0, cnt = 0, *pi = NULL, *po = NULL;
    char line[256];
    kvb_status st = KVB_OK;
    if (!fgets(line, sizeof line, f)) st = KVB_ERR_FORMAT;
    while (st == KVB_OK && fgets(line, sizeof line, f)) {
        int a, b;
        if (sscanf(line, "%d,%d", &a, &b) != 2) continue;
        if (cnt == cap) {
            cap = cap ? 2 * cap : 1024;
            if (kvb_realloc_array((void **)&pi, (size_t)cap, sizeof *pi) != KVB_OK ||
                kvb_realloc_array((void **)&po, (size_t)cap, sizeof *po) != KVB_OK) {
                st = KVB_ERR_NOMEM;
                break;
            }
        }
        pi[cnt] = a;
        po[cnt] = b;
        cnt++;
    }
    fclose(f);
    if (st == KVB_OK && cnt == 0) st = KVB_ERR_FORMAT;
    if (st == KVB_OK) st = wl_fixed("sharegpt", n, 1, 1, w);
    for (int i = 0; st == KVB_OK && i < n; i++) {
        int j = (int)(rng_next(&seed) % (uint64_t)cnt);
        int in = KVB_MAX(1, (int)lround(pi[j] * k)), out = KVB_MAX(1, (int)lround(po[j] * k));
        if (in + out > max_len) in = KVB_MAX(1, max_len - out);
        w->in[i] = in;
        w->out[i] = KVB_MIN(out, max_len - in);
    }
    free(pi);
    free(po);
    if (st != KVB_OK) KVB_LOG_E("ellm-el: %s: no lengths read", path);
    return st;
}

/* ---------------------------------------------------------------- one run */

static void on_token(void *ud, uint64_t id, int index, int32_t tok, uint64_t t_ns) {
    (void)tok, (void)index, (void)t_ns;
    bench *b = ud;
    req_rec *r = &b->recs[id];
    r->stamp = 1; /* stamped with the engine time at the end of the step (run_once) */
    r->n_tok++;
}

static void on_finish(void *ud, uint64_t id, kvb_finish why, kvb_status err) {
    (void)err;
    bench *b = ud;
    b->recs[id].done = why == KVB_FINISH_LENGTH ? 1 : -1;
}

/* Runs workload `w` under `policy` with `params` ("k=v,k=v"), arrivals at arr[i] seconds (all 0:
 * offline). */
static kvb_status run_once(bench *b, const char *policy, const char *params, const wl *w, const double *arr,
                           uint64_t seed, run_res *res) {
    memset(res, 0, sizeof *res);
    kvb_policy_params pp = {0};
    char buf[512];
    /* eLLM's Alg. 2 scales its CPU buffer against the workload's SLOs (B_logic from 1 chunk) */
    char slo[96] = "";
    if (!strcmp(policy, "ellm-elastic") && isfinite(b->slo_ttft) && isfinite(b->slo_tpot))
        snprintf(slo, sizeof slo, ",slo_ttft_ms=%.3f,slo_tpot_ms=%.4f", b->slo_ttft * 1e3, b->slo_tpot * 1e3);
    snprintf(buf, sizeof buf, "budget_mb=%.4f,slots=%d%s%s%s", b->budget_mb, b->max_seqs, slo,
             params && *params ? "," : "", params ? params : "");
    for (char *t = strtok(buf, ","); t; t = strtok(NULL, ",")) KVB_TRY(kvb_policy_params_add(&pp, t));
    kvb_planner pl;
    kvb_status st = kvb_policy_create(policy, &pp, &pl);
    kvb_policy_params_free(&pp);
    KVB_TRY(st);
    kvb_planner keep = pl;
    kvb_engine_opts o;
    kvb_engine_opts_default(&o);
    o.block_size = b->block_size;
    o.n_blocks = 1; /* the planner brings its KV memory */
    o.max_seqs = b->max_seqs;
    o.max_batch_tokens = b->max_len;
    o.enable_prefix_cache = 0;
    o.links = b->links;
    kvb_engine_events ev = {.ud = b, .on_token = on_token, .on_finish = on_finish};
    kvb_engine *e = NULL;
    KVB_TRY(kvb_engine_create(b->m, &o, &pl, &ev, &e));
    KVB_TRY(kvb_realloc_array((void **)&b->recs, (size_t)w->n, sizeof *b->recs));
    int32_t *prompt = NULL;
    int max_in = 0;
    for (int i = 0; i < w->n; i++) max_in = KVB_MAX(max_in, w->in[i]);
    st = kvb_malloc((size_t)max_in * sizeof *prompt, (void **)&prompt);
    for (int i = 0; i < w->n; i++) b->recs[i] = (req_rec){.t_arr = arr[i], .t_first = NAN};
    /* a progress line per replay on a terminal (common/util/progress.h) */
    kvb_progress pg;
    char what[160];
    snprintf(what, sizeof what, "replaying %d requests under %s", w->n, policy);
    kvb_progress_begin(&pg, what, (uint64_t)w->n, KVB_PROGRESS_COUNT);
    b->vt = 0;
    int next = 0, finished = 0;
    kvb_engine_stats s0, s1;
    while (st == KVB_OK && finished < w->n) {
        for (; next < w->n && arr[next] <= b->vt; next++) {
            for (int t = 0; t < w->in[next]; t++) prompt[t] = 3 + (int32_t)(rng_next(&seed) % (uint64_t)(b->vocab - 3));
            kvb_request q = {.id = (uint64_t)next, .prompt = prompt, .n_prompt = w->in[next], .max_tokens = w->out[next]};
            st = kvb_engine_add(e, &q);
            if (st != KVB_OK) {
                KVB_LOG_E("ellm-el: request %d (%d + %d tokens) refused: %s", next, w->in[next], w->out[next],
                          kvb_engine_last_error(e));
                break;
            }
        }
        if (st != KVB_OK) break;
        if (kvb_engine_n_live(e) == 0) {
            if (next < w->n) b->vt = fmax(b->vt, arr[next]); /* idle: the clock jumps to the next arrival */
        } else {
            kvb_engine_get_stats(e, &s0);
            /* the step's wall time less what this thread waited for a CPU */
            uint64_t t = kvb_now_ns(), q0 = kvb_thread_runq_ns();
            st = kvb_engine_step(e);
            uint64_t wall = kvb_now_ns() - t, rq = kvb_thread_runq_ns() - q0;
            double dt = (double)(rq < wall ? wall - rq : wall) * 1e-9;
            b->vt += dt;
            kvb_engine_get_stats(e, &s1);
            res->exec_s += dt;
            if (s1.prompt_tokens == s0.prompt_tokens && s1.generated_tokens > s0.generated_tokens) {
                res->decode_s += dt;
                res->decode_tokens += s1.generated_tokens - s0.generated_tokens;
            }
            for (int i = 0; i < next; i++) {
                req_rec *r = &b->recs[i];
                if (!r->stamp) continue;
                if (isnan(r->t_first)) r->t_first = b->vt;
                r->t_last = b->vt;
                r->stamp = 0;
            }
        }
        finished = 0;
        for (int i = 0; i < next; i++) finished += b->recs[i].done != 0;
        kvb_progress_update(&pg, (uint64_t)finished);
    }
    if (st == KVB_OK) kvb_progress_end(&pg);
    else kvb_progress_cancel(&pg);
    free(prompt);
    if (st == KVB_OK) {
        kvb_engine_get_stats(e, &s1);
        res->out_tokens = s1.generated_tokens;
        res->prompt_tokens = s1.prompt_tokens;
        res->host_bytes = s1.links[KVB_LINK_HOST].bytes;
        res->host_busy_ns = s1.links[KVB_LINK_HOST].busy_ns;
        kvb_ee_planner_report(&keep, &res->rep);
    }
    kvb_engine_destroy(e);
    KVB_TRY(st);
    /* per-request metrics */
    double *ttft = NULL, *tpot = NULL;
    KVB_TRY(kvb_malloc((size_t)w->n * 2 * sizeof(double), (void **)&ttft));
    tpot = ttft + w->n;
    int nt = 0, np = 0, ok = 0;
    double end = 0, start = INFINITY;
    for (int i = 0; i < w->n; i++) {
        const req_rec *r = &b->recs[i];
        if (r->done != 1) {
            res->failed++;
            continue;
        }
        double a = r->t_first - r->t_arr;
        double p = r->n_tok > 1 ? (r->t_last - r->t_first) / (r->n_tok - 1) : 0;
        ttft[nt++] = a;
        if (r->n_tok > 1) tpot[np++] = p;
        ok += a <= b->slo_ttft && p <= b->slo_tpot;
        end = fmax(end, r->t_last);
        start = fmin(start, r->t_arr);
    }
    double sum = 0;
    for (int i = 0; i < nt; i++) sum += ttft[i];
    res->ttft_mean = nt ? sum / nt : NAN;
    sum = 0;
    for (int i = 0; i < np; i++) sum += tpot[i];
    res->tpot_mean = np ? sum / np : NAN;
    res->ttft_p50 = pct(ttft, nt, 50);
    res->ttft_p99 = pct(ttft, nt, 99);
    res->tpot_p99 = pct(tpot, np, 99);
    res->attain = (double)ok / w->n;
    res->span_s = end - start;
    res->out_tps = res->span_s > 0 ? (double)res->out_tokens / res->span_s : 0;
    res->max_batch = res->rep.core.max_batch;
    res->plan_s = (double)res->rep.core.plan_ns * 1e-9;
    res->vm_s = (double)res->rep.vm_ns * 1e-9;
    res->vm_sync_s = (double)res->rep.vm_sync_ns * 1e-9;
    free(ttft);
    return KVB_OK;
}

static kvb_status poisson(double rate, int n, uint64_t seed, double **out) {
    KVB_TRY(kvb_realloc_array((void **)out, (size_t)n, sizeof **out));
    double t = 0;
    for (int i = 0; i < n; i++) {
        (*out)[i] = rate > 0 ? t : 0;
        if (rate > 0) t += -log(1.0 - rng_unit(&seed)) / rate;
    }
    return KVB_OK;
}

/* ---------------------------------------------------------------- the benchmark */

typedef struct pol {
    const char *label, *policy, *params;
} pol;

static void usage(FILE *f) {
    fprintf(f,
            "usage: kvbank-bench ellm-el --model DIR [options]\n"
            "\n"
            "eLLM elastic memory against the static split and the static split with chunked prefill, on one\n"
            "model and one budget of KV + activation memory (see bench/bench_ellm.c). A model of the paper's\n"
            "activation/KV regime, small enough for a CPU:\n"
            "  kvbank-mkmodel --arch llama --layers 8 --hidden 128 --heads 4 --kv-heads 4 --head-dim 32 \\\n"
            "      --intermediate 256 --vocab 256 --max-pos 8192 DIR\n"
            "\n"
            "  --model DIR          the model (its max_position_embeddings / 262144 is the length scale k)\n"
            "  --threads N          CPU threads (default 1: OpenMP barriers spin on a shared machine, and the\n"
            "                       run-queue correction of the engine's clock is exact for one thread)\n"
            KVB_BENCH_DEV_USAGE
            "  --act-share F        the static split's activation reserve as a share of the budget (0.35)\n"
            "  --slots N            concurrency slots = max_seqs (default 256)\n"
            "  --requests N         requests per online run (default 1000)\n"
            "  --offline-requests N requests of the offline runs (default 400; 32k-2k: a quarter)\n"
            "  --runs N             repetitions of every measurement (default 3)\n"
            "  --workloads LIST     of 2k2k,32k2k,sharegpt (default all)\n"
            "  --rates LIST         online rates as multiples of the static split's saturation (0.5,1,1.5,2)\n"
            "  --bisect N           bisection steps for goodput (default 4)\n"
            "  --sharegpt FILE      (default ../shared/traces/sharegpt_8k_filtered_stats_llama2_tokenizer.csv)\n"
            "  --link NAME          the stager's link preset for the CPU buffer (default a100-pcie4-8b-scaled on the\n"
            "                       CPU: the paper's A100, its host link as PCIe 4.0, Llama-3-8B's roofline; the\n"
            "                       time scale measured on this model at the 2k-2k point; off on a GPU)\n"
            "  --link2 NAME         a second preset for eLLM's online rows at 1x and 1.5x saturation\n"
            "                       (default h100-pcie5-scaled on the CPU; none: skip)\n"
            "  --quick              smaller everything (a smoke run)\n");
}

typedef struct opts {
    const char *model, *sharegpt, *workloads, *rates, *link, *link2;
    int threads, slots, requests, offline, runs, bisect, quick;
    double act_share;
} opts;

/* Mean over runs of one configuration; the per-run results go to out[0..runs). */
static kvb_status measure(bench *b, const pol *p, const wl *w, double rate, int runs, run_res *out) {
    double *arr = NULL;
    kvb_status st = KVB_OK;
    for (int r = 0; r < runs && st == KVB_OK; r++) {
        st = poisson(rate, w->n, 1000 + (uint64_t)r, &arr);
        if (st == KVB_OK) st = run_once(b, p->policy, p->params, w, arr, 77 + (uint64_t)r, &out[r]);
    }
    free(arr);
    return st;
}

#define GET(field) ({ double v_[16]; for (int r_ = 0; r_ < runs; r_++) v_[r_] = (double)res[r_].field; spread_of(v_, runs); })

static void print_row(const char *label, double rate, const run_res *res, int runs) {
    printf("  %-22s %6.2f |", label, rate);
    print_spread("%.3f", GET(ttft_mean), runs);
    print_spread("%.3f", GET(ttft_p99), runs);
    printf(" |");
    print_spread("%.4f", GET(tpot_mean), runs);
    print_spread("%.4f", GET(tpot_p99), runs);
    printf(" |");
    print_spread("%.0f", GET(out_tps), runs);
    printf(" |");
    print_spread("%.2f", GET(attain), runs);
    printf(" | %d | %llu/%llu\n", res[0].max_batch, (unsigned long long)res[0].rep.core.offloads,
           (unsigned long long)res[0].rep.core.fetches);
}

/* The highest rate with >= 90% attainment: the curve's points bracket it, bisection narrows it. */
static kvb_status goodput(bench *b, const pol *p, const wl *w, const double *rates, const double *att, int n_rates,
                          int steps, int runs, double *out) {
    double lo = 0, hi = -1;
    for (int i = 0; i < n_rates; i++) {
        if (att[i] >= 0.9) lo = fmax(lo, rates[i]);
        else if (hi < 0 || rates[i] < hi) hi = rates[i];
    }
    if (hi < 0) { /* never failed: the highest rate tried is a lower bound */
        *out = lo;
        return KVB_OK;
    }
    if (hi < lo) hi = lo; /* attainment not monotone over the points: trust the highest passing one */
    run_res *res = NULL;
    KVB_TRY(kvb_calloc((size_t)runs, sizeof *res, (void **)&res));
    kvb_status st = KVB_OK;
    for (int s = 0; s < steps && hi > lo && st == KVB_OK; s++) {
        double mid = 0.5 * (lo + hi);
        st = measure(b, p, w, mid, runs, res);
        double a = 0;
        for (int r = 0; r < runs; r++) a += res[r].attain / runs;
        if (a >= 0.9) lo = mid;
        else hi = mid;
    }
    free(res);
    *out = lo;
    return st;
}

int kvb_bench_ellm(int argc, char **argv) {
    opts o = {.sharegpt = "../shared/traces/sharegpt_8k_filtered_stats_llama2_tokenizer.csv",
              .workloads = "2k2k,32k2k,sharegpt", .rates = "0.5,1,1.5,2", .threads = 1, .slots = 256,
              .requests = 1000, .offline = 400, .runs = 3, .bisect = 4, .act_share = 0.35,
              .link = NULL, .link2 = NULL};
    static const struct option lo[] = {
        {"model", 1, 0, 'm'},    {"threads", 1, 0, 't'},          {"act-share", 1, 0, 'a'},
        {"slots", 1, 0, 's'},    {"requests", 1, 0, 'n'},         {"offline-requests", 1, 0, 'o'},
        {"runs", 1, 0, 'r'},     {"workloads", 1, 0, 'w'},        {"rates", 1, 0, 'R'},
        {"bisect", 1, 0, 'b'},   {"sharegpt", 1, 0, 'g'},         {"quick", 0, 0, 'q'},
        {"link", 1, 0, 'L'},     {"link2", 1, 0, 'M'},          {"backend", 1, 0, 'B'},
        {"device", 1, 0, 'D'},   {"help", 0, 0, 'h'},           {0, 0, 0, 0}};
    int ch;
    optind = 1;
    kvb_bench_dev dev = {.backend = "cpu", .device = -1, .threads = 1};
    while ((ch = getopt_long(argc, argv, "h", lo, NULL)) != -1) {
        int d = kvb_bench_dev_opt(&dev, ch, optarg, "kvbank-bench ellm-el");
        if (d == 2) return 2;
        if (d) continue;
        switch (ch) {
        case 'm': o.model = optarg; break;
        case 't': o.threads = atoi(optarg); break;
        case 'a': o.act_share = atof(optarg); break;
        case 's': o.slots = atoi(optarg); break;
        case 'n': o.requests = atoi(optarg); break;
        case 'o': o.offline = atoi(optarg); break;
        case 'r': o.runs = atoi(optarg); break;
        case 'w': o.workloads = optarg; break;
        case 'R': o.rates = optarg; break;
        case 'b': o.bisect = atoi(optarg); break;
        case 'g': o.sharegpt = optarg; break;
        case 'q': o.quick = 1; break;
        case 'L': o.link = optarg; break;
        case 'M': o.link2 = optarg; break;
        case 'h': usage(stdout); return 0;
        default: usage(stderr); return 2;
        }
    }
    if (!o.model || o.threads < 1 || o.slots < 1 || o.requests < 1 || o.offline < 1 || o.runs < 1 || o.runs > 16 ||
        o.bisect < 0 || !(o.act_share > 0 && o.act_share < 1)) {
        usage(stderr);
        return 2;
    }
    if (o.quick) {
        o.requests = KVB_MIN(o.requests, 60);
        o.offline = KVB_MIN(o.offline, 60);
        o.runs = 1;
        o.bisect = KVB_MIN(o.bisect, 1);
    }
    kvb_log_set_level(KVB_LOG_WARN);
    bench b = {.threads = o.threads, .max_seqs = o.slots, .block_size = 16};
    int rc = 1;
    run_res *res = NULL;
    dev.threads = o.threads;
    b.dev = dev;
    if (kvb_bench_backend(&dev, &b.be) != KVB_OK || kvb_model_load(o.model, b.be, &b.m) != KVB_OK) {
        fprintf(stderr, "ellm-el: cannot load %s\n", o.model);
        goto out;
    }
    printf("kvbank-bench ellm-el — eLLM elastic memory (ellm-elastic-memory.txt §6) on the %s backend\n", b.be->iface->name);
    kvb_link_model links2;
    memset(&links2, 0, sizeof links2);
    if (!o.link2) o.link2 = kvb_bench_dev_is_gpu(&dev) ? "none" : "h100-pcie5-scaled";
    int have2 = strcmp(o.link2, "none") != 0;
    {
        /* the time scale at the 2k-2k workload's middle: 8 requests decoding over 3K tokens (scaled by k) */
        const kvb_model_config *mc = kvb_model_cfg(b.m);
        double k = (double)mc->max_pos / PAPER_CTX;
        kvb_link_point pt = {.batch = 8, .q = 1, .ctx = 3072 * k, .target_ctx = 3072};
        printf("the CPU buffer (offload at prefill, fetch at decode) runs over the stager's host link:\n");
        if (kvb_bench_links(b.m, &dev, o.link, "a100-pcie4-8b-scaled", &pt, &b.links) != KVB_OK ||
            (have2 && kvb_bench_links(b.m, &dev, o.link2, o.link2, &pt, &links2) != KVB_OK)) {
            fprintf(stderr, "ellm-el: unknown link preset (see kvbank-bench --help)\n");
            goto out;
        }
        printf("  ");
        kvb_link_regime_print(stdout, &b.links, KVB_LINK_HOST, 0, NULL);
        printf("  (the paper gives no transfer / compute figure; its GPUs reach the host over NVLink-connected A100s'\n"
               "   PCIe 4.0 without contention, §5)\n");
    }
    const kvb_model_config *c = kvb_model_cfg(b.m);
    b.vocab = c->vocab;
    b.max_len = c->max_pos;
    b.k = (double)c->max_pos / PAPER_CTX;
    /* bytes per token: KV of every layer; the forward pass's activation buffers (x, h, q, k, v, att, gate,
     * up); the budget sized so that a model-length step's activations are act_share of it */
    kvb_kv_geom g = kvb_model_kv_geom(b.m, b.block_size);
    double kv_tok = 2.0 * g.n_layers * g.n_kv_heads * g.head_dim * g.elem_size;
    double act_tok = (double)g.elem_size * (2.0 * c->hidden + 2.0 * c->n_heads * c->head_dim +
                                            2.0 * c->n_kv_heads * c->head_dim + 2.0 * c->intermediate);
    double reserve = act_tok * b.max_len + (double)b.max_seqs * g.elem_size * (c->hidden + c->vocab);
    b.budget_mb = reserve / o.act_share / 1048576.0;
    printf("model %s: %d layers, hidden %d, %d/%d heads of %d, intermediate %d, vocab %d, max context %d\n", o.model,
           c->n_layers, c->hidden, c->n_heads, c->n_kv_heads, c->head_dim, c->intermediate, c->vocab, c->max_pos);
    printf("length scale k = %d / 262144 = 1/%.0f (the paper's Llama3-8B-262K); every length below is the paper's x k\n",
           c->max_pos, 1.0 / b.k);
    printf("bytes per token: KV %.0f, activations %.0f (ratio %.2f; paper Fig. 3: activation/KV space 0.52-1.08)\n",
           kv_tok, act_tok, act_tok / kv_tok);
    printf("budget %.1f MiB (KV + activations): the static split reserves %.1f MiB (%.0f%%) for a %d-token step, "
           "the rest is KV (%.0f tokens)\n",
           b.budget_mb, reserve / 1048576.0, 100 * o.act_share, b.max_len,
           (b.budget_mb * 1048576.0 - reserve) / kv_tok);
    printf("chunks of 16 tokens (%.0f KiB), %d slots; requests per online run %d, offline %d, runs %d\n",
           16 * kv_tok / 1024, b.max_seqs, o.requests, o.offline, o.runs);
    fflush(stdout);

    const pol pols[] = {{"ellm-elastic", "ellm-elastic", ""},
                        {"static-split (vLLM)", "static-split", ""},
                        {"static-split-chunked (CP)", "static-split-chunked", ""}};
    const pol ablations[] = {{"eLLM intra only", "ellm-elastic", "inter=0"}, {"eLLM inter only", "ellm-elastic", "intra=0"}};
    double rates_rel[16];
    int n_rates = 0;
    {
        char buf[256];
        snprintf(buf, sizeof buf, "%s", o.rates);
        for (char *t = strtok(buf, ","); t && n_rates < 16; t = strtok(NULL, ",")) rates_rel[n_rates++] = atof(t);
    }
    char wbuf[128];
    snprintf(wbuf, sizeof wbuf, "%s", o.workloads);
    res = calloc((size_t)o.runs, sizeof *res);
    double *arr = NULL;
    if (!res) goto out;
    char *wsave = NULL; /* strtok_r: run_once tokenizes its parameters with strtok inside this loop */
    for (char *wname = strtok_r(wbuf, ",", &wsave); wname; wname = strtok_r(NULL, ",", &wsave)) {
        wl w = {0}, woff = {0};
        int in = 0, out_len = 0;
        kvb_status st;
        if (!strcmp(wname, "2k2k") || !strcmp(wname, "32k2k")) {
            in = (int)lround((!strcmp(wname, "2k2k") ? 2048 : 32768) * b.k);
            out_len = (int)lround(2048 * b.k);
            st = wl_fixed(wname, o.requests, in, out_len, &w);
            if (st == KVB_OK)
                st = wl_fixed(wname, !strcmp(wname, "32k2k") ? KVB_MAX(o.offline / 4, 8) : o.offline, in, out_len, &woff);
        } else if (!strcmp(wname, "sharegpt")) {
            st = wl_sharegpt(o.sharegpt, o.requests, b.k, b.max_len, 5, &w);
            if (st == KVB_OK) st = wl_sharegpt(o.sharegpt, o.offline, b.k, b.max_len, 6, &woff);
        } else {
            fprintf(stderr, "ellm-el: unknown workload %s\n", wname);
            goto out;
        }
        if (st != KVB_OK) goto out;
        /* SLOs: 25x the uncontended TTFT and TPOT (one request at a time, the static split) */
        b.slo_ttft = b.slo_tpot = INFINITY;
        double ttft = 0, tpot = 0;
        int n_solo = KVB_MIN(8, w.n);
        for (int i = 0; i < n_solo; i++) {
            wl one = {.name = "one", .n = 1, .in = &w.in[i], .out = &w.out[i]};
            double a0 = 0;
            run_res r0;
            if (run_once(&b, "static-split", "", &one, &a0, 3 + (uint64_t)i, &r0) != KVB_OK) goto out;
            ttft += r0.ttft_mean / n_solo;
            tpot += (isnan(r0.tpot_mean) ? 0 : r0.tpot_mean) / n_solo;
        }
        b.slo_ttft = 25 * ttft;
        b.slo_tpot = 25 * fmax(tpot, 1e-6);
        int mean_in = 0, mean_out = 0;
        for (int i = 0; i < w.n; i++) {
            mean_in += w.in[i];
            mean_out += w.out[i];
        }
        printf("\n== workload %s: %s%d in / %d out tokens (mean; paper's x k); uncontended TTFT %.4f s, TPOT %.5f s; "
               "SLO TTFT %.3f s, TPOT %.4f s (25x)\n",
               wname, !strcmp(wname, "sharegpt") ? "ShareGPT lengths, " : "", mean_in / w.n, mean_out / w.n, ttft,
               tpot, b.slo_ttft, b.slo_tpot);
        /* offline (all at t = 0): the static split's throughput is the saturation rate */
        printf("-- offline: %d requests at t = 0 (total and decode throughput in tokens/s, largest decode batch)\n",
               woff.n);
        double sat = 0;
        spread off_tot[3], off_dec[3];
        int off_batch[3];
        for (int k = 0; k < 3; k++) {
            if (measure(&b, &pols[k], &woff, 0, o.runs, res) != KVB_OK) goto out;
            double tot[16], dec[16], rq[16];
            for (int r = 0; r < o.runs; r++) {
                tot[r] = (double)(res[r].out_tokens + res[r].prompt_tokens) / res[r].span_s;
                dec[r] = res[r].decode_s > 0 ? (double)res[r].decode_tokens / res[r].decode_s : 0;
                rq[r] = woff.n / res[r].span_s;
            }
            off_tot[k] = spread_of(tot, o.runs);
            off_dec[k] = spread_of(dec, o.runs);
            off_batch[k] = res[0].max_batch;
            if (k == 1) sat = spread_of(rq, o.runs).mean;
            printf("  %-26s total", pols[k].label);
            print_spread("%.0f", off_tot[k], o.runs);
            printf("  decode");
            print_spread("%.0f", off_dec[k], o.runs);
            printf("  largest batch %d", off_batch[k]);
            if (k == 0) /* the CPU buffer under a queue that only grows: TTFT misses without TPOT ones (Alg. 2) */
                printf("  CPU buffer: %llu offloaded at prefill, %llu fetched (first run)",
                       (unsigned long long)res[0].rep.core.offloads, (unsigned long long)res[0].rep.core.fetches);
            printf("\n");
            fflush(stdout);
        }
        printf("  ratios eLLM / static split: total %.2fx, decode %.2fx, largest batch %.2fx (paper, Jamba 128K: "
               "1.82x, 2.32x, 3x)\n",
               off_tot[0].mean / off_tot[1].mean, off_dec[0].mean / off_dec[1].mean,
               (double)off_batch[0] / KVB_MAX(off_batch[1], 1));
        printf("  saturation rate of the static split: %.2f requests/s\n", sat);
        {
            /* the CPU buffer's own effect (Fig. 8): an offline burst of 6x the requests the static split runs at
             * once, as a batch job without SLOs (Alg. 2 then leaves B_logic at B_max: with the workload's SLOs a
             * CPU's TPOT misses at batch 10 halve it back to one chunk before any request's KV fits), with the
             * buffer and without (inter=0) */
            const pol nobuf = {"eLLM without CPU buffer", "ellm-elastic", "inter=0"};
            spread ttft_on, ttft_off, tot_on, tot_off;
            double a[16], t[16];
            wl wb = {0};
            int n_burst = KVB_MAX(woff.n, 6 * KVB_MAX(off_batch[1], 1));
            kvb_status bst = !strcmp(wname, "sharegpt") ? wl_sharegpt(o.sharegpt, n_burst, b.k, b.max_len, 7, &wb)
                                                         : wl_fixed(wname, n_burst, woff.in[0], woff.out[0], &wb);
            if (bst != KVB_OK) goto out;
            printf("  the CPU buffer, an offline burst of %d requests without SLOs:", n_burst);
            double keep_ttft = b.slo_ttft, keep_tpot = b.slo_tpot;
            b.slo_ttft = b.slo_tpot = INFINITY;
            for (int k = 0; k < 2; k++) {
                if (measure(&b, k ? &nobuf : &pols[0], &wb, 0, o.runs, res) != KVB_OK) {
                    wl_free(&wb);
                    goto out;
                }
                for (int r = 0; r < o.runs; r++) {
                    a[r] = res[r].ttft_mean;
                    t[r] = (double)(res[r].out_tokens + res[r].prompt_tokens) / res[r].span_s;
                }
                *(k ? &ttft_off : &ttft_on) = spread_of(a, o.runs);
                *(k ? &tot_off : &tot_on) = spread_of(t, o.runs);
                if (!k)
                    printf(" %llu offloaded at prefill (%llu chunks), %llu fetched (first run); TTFT mean with / "
                           "without it:",
                           (unsigned long long)res[0].rep.core.offloads, (unsigned long long)res[0].rep.core.offload_chunks,
                           (unsigned long long)res[0].rep.core.fetches);
            }
            print_spread("%.3f", ttft_on, o.runs);
            printf(" /");
            print_spread("%.3f", ttft_off, o.runs);
            printf(" s, total tokens/s");
            print_spread("%.0f", tot_on, o.runs);
            printf(" /");
            print_spread("%.0f", tot_off, o.runs);
            printf("\n");
            wl_free(&wb);
            b.slo_ttft = keep_ttft;
            b.slo_tpot = keep_tpot;
        }
        /* online curves */
        printf("-- online, Poisson arrivals: rate (req/s) | TTFT mean, p99 (s) | TPOT mean, p99 (s) | output tokens/s "
               "| SLO attainment | largest batch | offloaded/fetched (first run)\n");
        double att[3][16], rates[16];
        for (int i = 0; i < n_rates; i++) rates[i] = rates_rel[i] * sat;
        for (int i = 0; i < n_rates; i++) {
            for (int k = 0; k < 3; k++) {
                if (measure(&b, &pols[k], &w, rates[i], o.runs, res) != KVB_OK) goto out;
                print_row(pols[k].label, rates[i], res, o.runs);
                att[k][i] = 0;
                for (int r = 0; r < o.runs; r++) att[k][i] += res[r].attain / o.runs;
                fflush(stdout);
            }
        }
        double gp[3];
        for (int k = 0; k < 3; k++)
            if (goodput(&b, &pols[k], &w, rates, att[k], n_rates, o.bisect, o.runs, &gp[k]) != KVB_OK) goto out;
        printf("-- goodput (highest rate with >= 90%% attainment, %d bisection steps): eLLM %.2f, static split %.2f, "
               "chunked %.2f req/s; eLLM / static split %.2fx, eLLM / chunked %.2fx (paper: 2.5x, 2.26x)\n",
               o.bisect, gp[0], gp[1], gp[2], gp[1] > 0 ? gp[0] / gp[1] : NAN, gp[2] > 0 ? gp[0] / gp[2] : NAN);
        /* ablations and the time breakdown at the static split's saturation rate */
        if (!strcmp(wname, "2k2k")) {
            printf("-- ablations at 1x saturation (%.2f req/s):\n", sat);
            for (int k = 0; k < 2; k++) {
                if (measure(&b, &ablations[k], &w, sat, o.runs, res) != KVB_OK) goto out;
                print_row(ablations[k].label, sat, res, o.runs);
            }
        }
        if (measure(&b, &pols[0], &w, sat, o.runs, res) != KVB_OK) goto out;
        printf("-- time breakdown of ellm-elastic at 1x saturation: of the execution time,");
        double planp[16], vmp[16], vmsp[16];
        for (int r = 0; r < o.runs; r++) {
            planp[r] = 100 * res[r].plan_s / res[r].exec_s;
            vmp[r] = 100 * res[r].vm_s / res[r].exec_s;
            vmsp[r] = 100 * res[r].vm_sync_s / res[r].exec_s;
        }
        printf(" planning %%");
        print_spread("%.2f", spread_of(planp, o.runs), o.runs);
        printf(", VM calls %%");
        print_spread("%.2f", spread_of(vmp, o.runs), o.runs);
        printf(" (on the planner's thread");
        print_spread("%.2f", spread_of(vmsp, o.runs), o.runs);
        printf("); paper: scheduling < 1%%, VM 1-5%%\n");
        const kvb_ee_report *rp = &res[0].rep;
        printf("   maps: %llu synchronous (%llu of them for a decode token), %llu asynchronous (pre-mapped); unmaps "
               "%llu (asynchronous); inflated %llu / deflated %llu chunks; %llu preempted\n",
               (unsigned long long)rp->sync_maps, (unsigned long long)rp->core.decode_maps,
               (unsigned long long)rp->async_maps, (unsigned long long)rp->async_unmaps,
               (unsigned long long)rp->core.inflated, (unsigned long long)rp->core.deflated,
               (unsigned long long)rp->core.preemptions);
        double hostp[16];
        for (int r = 0; r < o.runs; r++) hostp[r] = 100 * (double)res[r].host_busy_ns * 1e-9 / res[r].exec_s;
        printf("   CPU buffer: %llu requests offloaded at prefill (%llu chunks), %llu fetched (%llu chunks); host link "
               "%.1f MiB, busy %% of execution",
               (unsigned long long)rp->core.offloads, (unsigned long long)rp->core.offload_chunks,
               (unsigned long long)rp->core.fetches, (unsigned long long)rp->core.fetch_chunks,
               (double)res[0].host_bytes / 1048576.0);
        print_spread("%.2f", spread_of(hostp, o.runs), o.runs);
        printf(" (%s)\n", b.links.name);
        if (have2) {
            /* the CPU buffer under the second preset: only eLLM uses the host link */
            kvb_link_model keep_links = b.links;
            b.links = links2;
            printf("-- ellm-elastic with the CPU buffer over %s:\n", links2.name);
            for (int i = 0; i < n_rates; i++) {
                if (rates_rel[i] != 1.0 && rates_rel[i] != 1.5) continue;
                if (measure(&b, &pols[0], &w, rates[i], o.runs, res) != KVB_OK) goto out;
                print_row(pols[0].label, rates[i], res, o.runs);
            }
            b.links = keep_links;
        }
        fflush(stdout);
        wl_free(&w);
        wl_free(&woff);
    }
    rc = 0;
out:
    free(arr);
    free(res);
    free(b.recs);
    kvb_model_destroy(b.m);
    kvb_backend_destroy(b.be);
    return rc;
}
