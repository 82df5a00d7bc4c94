/* kvbank-bench replay — drive a running node with real traces (open loop) and report latency.
 *
 * Each --target MODEL=TRACE replays TRACE to MODEL's endpoint (from the node config): Mooncake
 * multi-turn sessions for the master, Azure arrivals for the workers, all targets at once. Requests are
 * sent at their (scaled) arrival times by a pool of client threads; TTFT counts from the scheduled
 * arrival, so queueing in the client pool or the server is included.
 *   TTFT  first token - arrival        TPOT  (last - first) / (tokens - 1)        TBT  every token gap */
#include <getopt.h>
#include <jansson.h>
#include <math.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <string.h>
#include <time.h>

#include "bench/bench.h"
#include "bench/trace.h"
#include "common/ipc/client.h"
#include "common/model/config.h"
#include "common/util/node_config.h"

#define MAX_TARGETS 8

typedef struct target {
    const char *model;
    const char *trace_path;
    const char *endpoint;
    kvb_trace *trace;
    /* results per request */
    double *ttft_ms, *tpot_ms; /* NAN when not applicable */
    int *n_tokens;
    int *failed;
    double **gaps_ms;          /* per request, [n_tokens - 1] */
} target;

typedef struct job {
    int target;
    int req;
    double t_s;
} job;

typedef struct replay {
    target tg[MAX_TARGETS];
    int n_targets;
    job *jobs;
    int n_jobs;
    atomic_int next;
    uint64_t start_ns; /* wall clock of t = 0 */
    int timeout_ms;
} replay;

typedef struct req_rec {
    uint64_t arrival_ns;
    uint64_t prev_ns;
    int n;
    double *gaps;
    double first_ms;
} req_rec;

static int on_tok(void *ud, int index, int32_t token, uint64_t t_ns) {
    req_rec *r = ud;
    if (r->n == 0) r->first_ms = (double)(int64_t)(t_ns - r->arrival_ns) / 1e6;
    else if (r->gaps) r->gaps[r->n - 1] = (double)(int64_t)(t_ns - r->prev_ns) / 1e6;
    r->prev_ns = t_ns;
    r->n++;
    return 0;
}

static void sleep_until(uint64_t wall_ns) {
    uint64_t now = kvb_wall_ns();
    if (wall_ns <= now) return;
    uint64_t d = wall_ns - now;
    struct timespec ts = {.tv_sec = (time_t)(d / 1000000000ull), .tv_nsec = (long)(d % 1000000000ull)};
    nanosleep(&ts, NULL);
}

static void *client_thread(void *arg) {
    replay *rp = arg;
    kvb_client *cl[MAX_TARGETS] = {0};
    for (;;) {
        int j = atomic_fetch_add(&rp->next, 1);
        if (j >= rp->n_jobs) break;
        const job *jb = &rp->jobs[j];
        target *tg = &rp->tg[jb->target];
        const kvb_trace_req *q = &tg->trace->reqs[jb->req];
        if (!cl[jb->target] && kvb_client_connect(tg->endpoint, &cl[jb->target]) != KVB_OK) {
            tg->failed[jb->req] = 1;
            continue;
        }
        uint64_t arrival = rp->start_ns + (uint64_t)(jb->t_s * 1e9);
        sleep_until(arrival);
        req_rec rec = {.arrival_ns = arrival};
        if (q->max_tokens > 1) kvb_malloc((size_t)(q->max_tokens - 1) * sizeof(double), (void **)&rec.gaps);
        kvb_request r = {.prompt = q->prompt, .n_prompt = q->n_prompt, .max_tokens = q->max_tokens};
        kvb_finish fin = KVB_FINISH_NONE;
        char err[200] = "";
        kvb_status st = kvb_client_generate(cl[jb->target], &r, on_tok, &rec, rp->timeout_ms, &fin, err, sizeof err);
        if (st != KVB_OK || fin == KVB_FINISH_ERROR || rec.n == 0) {
            tg->failed[jb->req] = 1;
            KVB_LOG_D("%s request %d failed: %s %s", tg->model, jb->req, kvb_status_str(st), err);
            free(rec.gaps);
            if (st == KVB_ERR_TIMEOUT) { /* the socket may hold a late reply: start a fresh one */
                kvb_client_destroy(cl[jb->target]);
                cl[jb->target] = NULL;
            }
            continue;
        }
        tg->ttft_ms[jb->req] = rec.first_ms;
        tg->n_tokens[jb->req] = rec.n;
        tg->gaps_ms[jb->req] = rec.gaps;
        if (rec.n > 1) {
            double sum = 0;
            for (int i = 0; i < rec.n - 1; i++) sum += rec.gaps[i];
            tg->tpot_ms[jb->req] = sum / (rec.n - 1);
        }
    }
    for (int i = 0; i < MAX_TARGETS; i++) kvb_client_destroy(cl[i]);
    return NULL;
}

static int cmp_d(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

/* p-th percentile (nearest rank) of v[0..n) (sorted in place); NAN when n == 0. */
static double pct(double *v, int n, double p) {
    if (n == 0) return NAN;
    qsort(v, (size_t)n, sizeof *v, cmp_d);
    int k = (int)ceil(p / 100.0 * n) - 1;
    return v[KVB_MAX(0, KVB_MIN(n - 1, k))];
}

static int by_job_time(const void *a, const void *b) {
    double x = ((const job *)a)->t_s, y = ((const job *)b)->t_s;
    return (x > y) - (x < y);
}

static void usage(FILE *f) {
    fprintf(f,
            "usage: kvbank-bench replay --config NODE.json --target MODEL=TRACE [--target ...] [options]\n"
            "\n"
            "Replays real traces against a running node (start it with kvbankd first) and reports TTFT, TPOT\n"
            "and TBT percentiles, throughput and SLO attainment per model, as a table and optionally as JSON.\n"
            "TRACE is a Mooncake .jsonl (multi-turn sessions rebuilt from hash_ids) or an Azure .csv.\n"
            "\n"
            "  --rate X          arrival rate multiplier (default 1)\n"
            "  --len-scale S     tokens per trace token, to fit small models (default 1/64)\n"
            "  --max-len N       cap on prompt + output tokens (default: the model's max_position_embeddings)\n"
            "  --max-output N    cap on output tokens (default 64)\n"
            "  --duration S      replay only requests arriving in the first S seconds (after --rate)\n"
            "  --max-requests N  at most N requests per target\n"
            "  --concurrency N   client threads (default 64)\n"
            "  --timeout-ms N    give up on a silent request (default 60000)\n"
            "  --slo-ttft-ms N   TTFT SLO (default 2000);  --slo-tpot-ms N  TPOT SLO (default 200)\n"
            "  --json FILE       also write the results as JSON\n");
}

int kvb_bench_replay(int argc, char **argv) {
    const char *cfg_path = NULL, *json_path = NULL;
    replay rp = {.timeout_ms = 60000};
    kvb_trace_opts to = {.rate_scale = 1, .len_scale = 1.0 / 64, .min_output = 1, .max_output = 64};
    int concurrency = 64, max_len = 0;
    double slo_ttft = 2000, slo_tpot = 200;
    static const struct option opts[] = {
        {"config", 1, 0, 'c'},       {"target", 1, 0, 't'},      {"rate", 1, 0, 'r'},
        {"len-scale", 1, 0, 's'},    {"max-len", 1, 0, 'L'},     {"max-output", 1, 0, 'O'},
        {"duration", 1, 0, 'd'},     {"max-requests", 1, 0, 'n'}, {"concurrency", 1, 0, 'C'},
        {"timeout-ms", 1, 0, 'T'},   {"slo-ttft-ms", 1, 0, 'f'}, {"slo-tpot-ms", 1, 0, 'p'},
        {"json", 1, 0, 'j'},         {"help", 0, 0, 'h'},        {0, 0, 0, 0}};
    int ch;
    double d;
    int64_t v;
    while ((ch = getopt_long(argc, argv, "h", opts, NULL)) != -1) {
        kvb_status st = KVB_OK;
        switch (ch) {
        case 'c': cfg_path = optarg; break;
        case 'j': json_path = optarg; break;
        case 't': {
            char *eq = strchr(optarg, '=');
            if (!eq || eq == optarg || !eq[1] || rp.n_targets == MAX_TARGETS) {
                fprintf(stderr, "kvbank-bench replay: --target needs MODEL=TRACE (at most %d)\n", MAX_TARGETS);
                return 2;
            }
            *eq = 0;
            rp.tg[rp.n_targets].model = optarg;
            rp.tg[rp.n_targets++].trace_path = eq + 1;
            break;
        }
        case 'r': st = kvb_parse_f64(optarg, &to.rate_scale); break;
        case 's': st = kvb_parse_f64(optarg, &to.len_scale); break;
        case 'd': st = kvb_parse_f64(optarg, &to.max_time_s); break;
        case 'f': st = kvb_parse_f64(optarg, &slo_ttft); break;
        case 'p': st = kvb_parse_f64(optarg, &slo_tpot); break;
        case 'L': st = kvb_parse_i64(optarg, 2, 1 << 24, &v); max_len = (int)v; break;
        case 'O': st = kvb_parse_i64(optarg, 1, 1 << 24, &v); to.max_output = (int)v; break;
        case 'n': st = kvb_parse_i64(optarg, 1, 1 << 30, &v); to.max_requests = (int)v; break;
        case 'C': st = kvb_parse_i64(optarg, 1, 4096, &v); concurrency = (int)v; break;
        case 'T': st = kvb_parse_i64(optarg, 1, 1 << 30, &v); rp.timeout_ms = (int)v; break;
        case 'h': usage(stdout); return 0;
        default: usage(stderr); return 2;
        }
        if (st != KVB_OK || (ch == 'r' && to.rate_scale <= 0) || (ch == 's' && to.len_scale <= 0)) {
            fprintf(stderr, "kvbank-bench replay: bad value '%s'\n", optarg);
            return 2;
        }
        (void)d;
    }
    if (!cfg_path || rp.n_targets == 0) {
        usage(stderr);
        return 2;
    }
    int rc = 1;
    kvb_node_config *cfg = NULL;
    if (kvb_node_config_load(cfg_path, &cfg) != KVB_OK) return 1;
    for (int i = 0; i < rp.n_targets; i++) {
        target *tg = &rp.tg[i];
        const kvb_node_model *nm = kvb_node_config_model(cfg, tg->model);
        if (!nm) {
            fprintf(stderr, "kvbank-bench replay: no model '%s' in %s\n", tg->model, cfg_path);
            goto out;
        }
        kvb_model_config mc;
        if (kvb_model_config_load(nm->model_dir, &mc) != KVB_OK) goto out;
        tg->endpoint = nm->endpoint;
        kvb_trace_opts o = to;
        o.vocab = mc.vocab;
        o.max_len = max_len ? max_len : mc.max_pos;
        if (kvb_trace_load(tg->trace_path, &o, &tg->trace) != KVB_OK) goto out;
        int n = tg->trace->n;
        if (kvb_calloc((size_t)n, sizeof(double), (void **)&tg->ttft_ms) || kvb_calloc((size_t)n, sizeof(double), (void **)&tg->tpot_ms) ||
            kvb_calloc((size_t)n, sizeof(int), (void **)&tg->n_tokens) || kvb_calloc((size_t)n, sizeof(int), (void **)&tg->failed) ||
            kvb_calloc((size_t)n, sizeof(double *), (void **)&tg->gaps_ms))
            goto out;
        for (int k = 0; k < n; k++) tg->tpot_ms[k] = NAN;
        rp.n_jobs += n;
    }
    if (kvb_calloc((size_t)rp.n_jobs, sizeof *rp.jobs, (void **)&rp.jobs) != KVB_OK) goto out;
    int nj = 0;
    for (int i = 0; i < rp.n_targets; i++)
        for (int k = 0; k < rp.tg[i].trace->n; k++) rp.jobs[nj++] = (job){.target = i, .req = k, .t_s = rp.tg[i].trace->reqs[k].t_s};
    qsort(rp.jobs, (size_t)rp.n_jobs, sizeof *rp.jobs, by_job_time);
    double span = rp.jobs[rp.n_jobs - 1].t_s;
    printf("kvbank-bench replay: %d requests over %.1f s to %d model(s), %d client threads\n", rp.n_jobs, span,
           rp.n_targets, concurrency);
    fflush(stdout);

    pthread_t *th = NULL;
    if (kvb_calloc((size_t)concurrency, sizeof *th, (void **)&th) != KVB_OK) goto out;
    rp.start_ns = kvb_wall_ns() + 200000000ull; /* 200 ms to start the threads */
    int started = 0;
    for (int i = 0; i < concurrency; i++)
        if (pthread_create(&th[i], NULL, client_thread, &rp) == 0) started++;
    for (int i = 0; i < started; i++) pthread_join(th[i], NULL);
    free(th);
    double makespan = (double)(kvb_wall_ns() - rp.start_ns) / 1e9;

    json_t *jroot = json_object(), *jt = json_array();
    printf("\n%-10s %6s %5s | %8s %8s %8s | %7s %7s %7s | %7s %7s | %8s %6s\n", "model", "reqs", "fail", "TTFTp50",
           "TTFTp95", "TTFTp99", "TPOTp50", "TPOTp95", "TPOTp99", "TBTp95", "TBTp99", "tok/s", "SLO");
    for (int i = 0; i < rp.n_targets; i++) {
        target *tg = &rp.tg[i];
        int n = tg->trace->n, ok = 0, fails = 0, n_tpot = 0, n_gap = 0, slo_ok = 0;
        int64_t toks = 0, reused = 0, prompt = 0;
        for (int k = 0; k < n; k++) n_gap += tg->n_tokens[k] > 1 ? tg->n_tokens[k] - 1 : 0;
        double *a = malloc(sizeof(double) * (size_t)(n + 1)), *b = malloc(sizeof(double) * (size_t)(n + 1));
        double *g = malloc(sizeof(double) * (size_t)(n_gap + 1));
        if (!a || !b || !g) {
            free(a);
            free(b);
            free(g);
            goto out;
        }
        n_gap = 0;
        for (int k = 0; k < n; k++) {
            prompt += tg->trace->reqs[k].n_prompt;
            reused += tg->trace->reqs[k].reused_tokens;
            if (tg->failed[k]) {
                fails++;
                continue;
            }
            a[ok++] = tg->ttft_ms[k];
            toks += tg->n_tokens[k];
            int meets = tg->ttft_ms[k] <= slo_ttft;
            if (!isnan(tg->tpot_ms[k])) {
                b[n_tpot++] = tg->tpot_ms[k];
                meets = meets && tg->tpot_ms[k] <= slo_tpot;
            }
            slo_ok += meets;
            for (int x = 0; x + 1 < tg->n_tokens[k]; x++) g[n_gap++] = tg->gaps_ms[k][x];
        }
        double r[11] = {pct(a, ok, 50), pct(a, ok, 95), pct(a, ok, 99), pct(b, n_tpot, 50), pct(b, n_tpot, 95),
                        pct(b, n_tpot, 99), pct(g, n_gap, 50), pct(g, n_gap, 95), pct(g, n_gap, 99),
                        (double)toks / makespan, n ? (double)slo_ok / n : 0};
        printf("%-10s %6d %5d | %8.1f %8.1f %8.1f | %7.1f %7.1f %7.1f | %7.1f %7.1f | %8.1f %5.1f%%\n", tg->model, n,
               fails, r[0], r[1], r[2], r[3], r[4], r[5], r[7], r[8], r[9], 100 * r[10]);
        json_t *o = json_pack("{s:s, s:s, s:i, s:i, s:i, s:f, s:{s:f,s:f,s:f}, s:{s:f,s:f,s:f}, s:{s:f,s:f,s:f}, s:f, "
                              "s:f, s:f, s:f}",
                              "model", tg->model, "trace", tg->trace_path, "requests", n, "failed", fails, "sessions",
                              tg->trace->n_sessions, "prefix_reuse", prompt ? (double)reused / prompt : 0.0, "ttft_ms",
                              "p50", r[0], "p95", r[1], "p99", r[2], "tpot_ms", "p50", r[3], "p95", r[4], "p99", r[5],
                              "tbt_ms", "p50", r[6], "p95", r[7], "p99", r[8], "tokens_per_s", r[9], "slo_attainment",
                              r[10], "slo_ttft_ms", slo_ttft, "slo_tpot_ms", slo_tpot);
        if (o) json_array_append_new(jt, o);
        free(a);
        free(b);
        free(g);
    }
    json_object_set_new(jroot, "targets", jt);
    json_object_set_new(jroot, "makespan_s", json_real(makespan));
    json_object_set_new(jroot, "rate_scale", json_real(to.rate_scale));
    json_object_set_new(jroot, "len_scale", json_real(to.len_scale));
    if (json_path && json_dump_file(jroot, json_path, JSON_INDENT(2)) != 0)
        fprintf(stderr, "kvbank-bench replay: cannot write %s\n", json_path);
    json_decref(jroot);
    rc = 0;
out:
    for (int i = 0; i < rp.n_targets; i++) {
        target *tg = &rp.tg[i];
        if (tg->gaps_ms && tg->trace)
            for (int k = 0; k < tg->trace->n; k++) free(tg->gaps_ms[k]);
        kvb_trace_free(tg->trace);
        free(tg->ttft_ms);
        free(tg->tpot_ms);
        free(tg->n_tokens);
        free(tg->failed);
        free(tg->gaps_ms);
    }
    free(rp.jobs);
    kvb_node_config_free(cfg);
    return rc;
}
