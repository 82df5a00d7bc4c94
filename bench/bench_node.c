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
#include <fcntl.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include "bench/bench.h"
#include "bench/trace.h"
#include "common/ipc/client.h"
#include "common/model/config.h"
#include "common/util/node_config.h"
#include "common/util/progress.h"
#include "bench/plot.h"

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

/* --plot of replay: every model's blocks over time, from `kvbankctl status --json` twice a second. */
#define BL_MODELS 16
#define BL_SAMPLES 8192
typedef struct blocks_log {
    char ctl[4200];                 /* kvbankctl next to this program */
    int n_models, n;
    char names[BL_MODELS][65];
    int master[BL_MODELS];          /* role master: borrowed is drawn, else lent */
    double t[BL_SAMPLES];           /* s since the replay began */
    double own[BL_MODELS][BL_SAMPLES], lent[BL_MODELS][BL_SAMPLES], borrowed[BL_MODELS][BL_SAMPLES];
} blocks_log;

typedef struct replay {
    target tg[MAX_TARGETS];
    int n_targets;
    job *jobs;
    int n_jobs;
    atomic_int next;
    atomic_int done;   /* requests finished (or failed): the progress line */
    uint64_t start_ns; /* wall clock of t = 0 */
    int timeout_ms;
    blocks_log *bl;    /* --plot: sampled while the trace plays (NULL: not asked) */
} replay;

/* `kvbankctl --config CFG status --json` (the program at `ctl`): the reply (caller decrefs) and its
 * "models" array in *models, or NULL when the coordinator does not answer. */
static json_t *ctl_status(const char *ctl, const char *cfg, json_t **models) {
    char cmd[8600];
    snprintf(cmd, sizeof cmd, "'%s' --config '%s' --timeout-ms 1000 status --json 2>/dev/null", ctl, cfg);
    *models = NULL;
    FILE *f = popen(cmd, "r");
    if (!f) return NULL;
    json_error_t err;
    json_t *j = json_loadf(f, 0, &err);
    pclose(f);
    *models = j ? json_object_get(j, "models") : NULL;
    if (!json_is_array(*models)) *models = NULL;
    return j;
}

/* Adds one sample of every model's own / lent / borrowed blocks at time t (s). */
static void blocks_sample(blocks_log *bl, const char *cfg_path, double t) {
    if (bl->n >= BL_SAMPLES) return;
    json_t *models = NULL, *j = ctl_status(bl->ctl, cfg_path, &models);
    if (!models) {
        json_decref(j);
        return;
    }
    int k = bl->n++;
    bl->t[k] = t;
    for (int m = 0; m < BL_MODELS; m++) bl->own[m][k] = bl->lent[m][k] = bl->borrowed[m][k] = NAN;
    size_t i;
    json_t *o;
    json_array_foreach(models, i, o) {
        const char *name = json_string_value(json_object_get(o, "name"));
        if (!name || !json_is_true(json_object_get(o, "alive"))) continue;
        int m = 0;
        while (m < bl->n_models && strcmp(bl->names[m], name)) m++;
        if (m == bl->n_models) {
            if (m == BL_MODELS) continue;
            snprintf(bl->names[m], sizeof bl->names[m], "%s", name);
            const char *role = json_string_value(json_object_get(o, "role"));
            bl->master[m] = role && !strcmp(role, "master");
            for (int q = 0; q < k; q++) bl->own[m][q] = bl->lent[m][q] = bl->borrowed[m][q] = NAN;
            bl->n_models++;
        }
        bl->own[m][k] = (double)json_integer_value(json_object_get(o, "n_own"));
        bl->lent[m][k] = (double)json_integer_value(json_object_get(o, "n_lent"));
        bl->borrowed[m][k] = (double)json_integer_value(json_object_get(o, "n_borrowed"));
    }
    json_decref(j);
}

/* The replay's --plot: each model's own blocks, and a worker's lent or the master's borrowed ones. */
static int blocks_plot(const blocks_log *bl, const char *path) {
    kvb_plot_series ser[2 * BL_MODELS];
    char names[2 * BL_MODELS][96];
    int n = 0;
    for (int m = 0; m < bl->n_models; m++) {
        snprintf(names[n], sizeof names[n], "%s own", bl->names[m]);
        ser[n] = (kvb_plot_series){.name = names[n], .x = bl->t, .y = bl->own[m], .n = (size_t)bl->n, .steps = 1};
        n++;
        snprintf(names[n], sizeof names[n], "%s %s", bl->names[m], bl->master[m] ? "borrowed (master blocks)" : "lent");
        ser[n] = (kvb_plot_series){.name = names[n], .x = bl->t, .y = bl->master[m] ? bl->borrowed[m] : bl->lent[m],
                                   .n = (size_t)bl->n, .steps = 1};
        n++;
    }
    const kvb_plot pl = {.title = "KV blocks of every model during the replay (own, lent, borrowed)",
                         .xlabel = "time since the replay began (s)", .ylabel = "blocks", .series = ser, .n_series = n};
    return kvb_plot_svg(path, &pl);
}

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
            atomic_fetch_add(&rp->done, 1);
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
            atomic_fetch_add(&rp->done, 1);
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
        atomic_fetch_add(&rp->done, 1);
    }
    for (int i = 0; i < MAX_TARGETS; i++) kvb_client_destroy(cl[i]);
    return NULL;
}



static int by_job_time(const void *a, const void *b) {
    double x = ((const job *)a)->t_s, y = ((const job *)b)->t_s;
    return (x > y) - (x < y);
}

/* Everything one replay needs besides the node config and the targets. */
typedef struct replay_params {
    kvb_trace_opts to;
    int concurrency;
    int max_len;      /* 0: the model's max_position_embeddings */
    int timeout_ms;
    double slo_ttft, slo_tpot;
    const char *link; /* interference: every model's "link_preset" (NULL: the default below) */
    double warmup_s;  /* requests arriving before are replayed but not counted (< 0: the default) */
    int reps;         /* interference: repetitions (0: the default) */
    const char *traces_dir; /* interference without --target: where every model's own trace is */
    int rate_given;   /* --rate was given */
} replay_params;

/* One target's results. */
typedef struct replay_stats {
    int n, fails, sessions;
    double ttft[3], tpot[3], tbt[3]; /* p50, p95, p99 in ms */
    double tok_s, slo, reuse;
} replay_stats;

static void replay_free(replay *rp) {
    for (int i = 0; i < rp->n_targets; i++) {
        target *tg = &rp->tg[i];
        if (tg->gaps_ms && tg->trace)
            for (int k = 0; k < tg->trace->n; k++) free(tg->gaps_ms[k]);
        kvb_trace_free(tg->trace);
        free(tg->ttft_ms);
        free(tg->tpot_ms);
        free(tg->n_tokens);
        free(tg->failed);
        free(tg->gaps_ms);
        tg->trace = NULL;
        tg->ttft_ms = tg->tpot_ms = NULL;
        tg->n_tokens = tg->failed = NULL;
        tg->gaps_ms = NULL;
    }
    free(rp->jobs);
    rp->jobs = NULL;
}

/* Replays rp's targets (model + trace set by the caller) against the node of `cfg_path`; fills
 * out[i] per target. Returns 0 on success. */
static int replay_run(const char *cfg_path, replay *rp, const replay_params *p, replay_stats *out) {
    int rc = 1;
    kvb_node_config *cfg = NULL;
    rp->timeout_ms = p->timeout_ms;
    rp->n_jobs = 0;
    atomic_store(&rp->next, 0);
    atomic_store(&rp->done, 0);
    if (kvb_node_config_load(cfg_path, &cfg) != KVB_OK) return 1;
    for (int i = 0; i < rp->n_targets; i++) {
        target *tg = &rp->tg[i];
        const kvb_node_model *nm = kvb_node_config_model(cfg, tg->model);
        if (!nm) {
            fprintf(stderr, "kvbank-bench: no model '%s' in %s\n", tg->model, cfg_path);
            goto out;
        }
        kvb_model_config mc;
        if (kvb_model_config_load(nm->model_dir, &mc) != KVB_OK) goto out;
        tg->endpoint = nm->endpoint;
        kvb_trace_opts o = p->to;
        o.vocab = mc.vocab;
        o.max_len = p->max_len ? p->max_len : mc.max_pos;
        if (kvb_trace_load(tg->trace_path, &o, &tg->trace) != KVB_OK) goto out;
        int n = tg->trace->n;
        if (kvb_calloc((size_t)n, sizeof(double), (void **)&tg->ttft_ms) ||
            kvb_calloc((size_t)n, sizeof(double), (void **)&tg->tpot_ms) ||
            kvb_calloc((size_t)n, sizeof(int), (void **)&tg->n_tokens) ||
            kvb_calloc((size_t)n, sizeof(int), (void **)&tg->failed) ||
            kvb_calloc((size_t)n, sizeof(double *), (void **)&tg->gaps_ms))
            goto out;
        for (int k = 0; k < n; k++) tg->tpot_ms[k] = NAN;
        rp->n_jobs += n;
    }
    if (kvb_calloc((size_t)rp->n_jobs, sizeof *rp->jobs, (void **)&rp->jobs) != KVB_OK) goto out;
    int nj = 0;
    for (int i = 0; i < rp->n_targets; i++)
        for (int k = 0; k < rp->tg[i].trace->n; k++)
            rp->jobs[nj++] = (job){.target = i, .req = k, .t_s = rp->tg[i].trace->reqs[k].t_s};
    qsort(rp->jobs, (size_t)rp->n_jobs, sizeof *rp->jobs, by_job_time);
    printf("replay: %d requests over %.1f s to %d model(s), %d client threads\n", rp->n_jobs,
           rp->jobs[rp->n_jobs - 1].t_s, rp->n_targets, p->concurrency);
    fflush(stdout);

    pthread_t *th = NULL;
    if (kvb_calloc((size_t)p->concurrency, sizeof *th, (void **)&th) != KVB_OK) goto out;
    rp->start_ns = kvb_wall_ns() + 200000000ull; /* 200 ms to start the threads */
    int started = 0;
    for (int i = 0; i < p->concurrency; i++)
        if (pthread_create(&th[i], NULL, client_thread, rp) == 0) started++;
    /* a progress line on a terminal while the trace plays (common/util/progress.h) */
    kvb_progress pg;
    char what[160];
    snprintf(what, sizeof what, "replaying %d requests", rp->n_jobs);
    kvb_progress_begin(&pg, what, (uint64_t)rp->n_jobs, KVB_PROGRESS_COUNT);
    double next_sample = 0;
    while (started && atomic_load(&rp->done) < rp->n_jobs) {
        kvb_progress_update(&pg, (uint64_t)atomic_load(&rp->done));
        double t = ((double)kvb_wall_ns() - (double)rp->start_ns) / 1e9;
        if (rp->bl && t >= next_sample) {
            blocks_sample(rp->bl, cfg_path, t);
            next_sample = t + 0.5;
        }
        struct timespec ts = {.tv_sec = 0, .tv_nsec = 100000000};
        nanosleep(&ts, NULL);
    }
    kvb_progress_end(&pg);
    for (int i = 0; i < started; i++) pthread_join(th[i], NULL);
    free(th);
    double makespan = (double)(kvb_wall_ns() - rp->start_ns) / 1e9;

    for (int i = 0; i < rp->n_targets; i++) {
        target *tg = &rp->tg[i];
        replay_stats *st = &out[i];
        int n = tg->trace->n, ok = 0, n_tpot = 0, n_gap = 0, slo_ok = 0;
        int64_t toks = 0, reused = 0, prompt = 0;
        memset(st, 0, sizeof *st);
        const double warm = KVB_MAX(0, p->warmup_s);
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
        int n_meas = 0;
        for (int k = 0; k < n; k++) {
            if (tg->trace->reqs[k].t_s < warm) continue; /* the warm-up: not counted */
            n_meas++;
            prompt += tg->trace->reqs[k].n_prompt;
            reused += tg->trace->reqs[k].reused_tokens;
            if (tg->failed[k]) {
                st->fails++;
                continue;
            }
            a[ok++] = tg->ttft_ms[k];
            toks += tg->n_tokens[k];
            int meets = tg->ttft_ms[k] <= p->slo_ttft;
            if (!isnan(tg->tpot_ms[k])) {
                b[n_tpot++] = tg->tpot_ms[k];
                meets = meets && tg->tpot_ms[k] <= p->slo_tpot;
            }
            slo_ok += meets;
            for (int x = 0; x + 1 < tg->n_tokens[k]; x++) g[n_gap++] = tg->gaps_ms[k][x];
        }
        const double ps[3] = {50, 95, 99};
        for (int q = 0; q < 3; q++) {
            st->ttft[q] = kvb_bench_pct(a, ok, ps[q]);
            st->tpot[q] = kvb_bench_pct(b, n_tpot, ps[q]);
            st->tbt[q] = kvb_bench_pct(g, n_gap, ps[q]);
        }
        st->n = n_meas;
        st->sessions = tg->trace->n_sessions;
        st->tok_s = (double)toks / makespan;
        st->slo = n_meas ? (double)slo_ok / n_meas : 0;
        st->reuse = prompt ? (double)reused / prompt : 0;
        free(a);
        free(b);
        free(g);
    }
    rc = 0;
out:
    kvb_node_config_free(cfg);
    return rc;
}

static void print_header(void) {
    printf("\n%-10s %6s %5s | %8s %8s %8s | %7s %7s %7s | %7s %7s | %8s %6s\n", "model", "reqs", "fail", "TTFTp50",
           "TTFTp95", "TTFTp99", "TPOTp50", "TPOTp95", "TPOTp99", "TBTp95", "TBTp99", "tok/s", "SLO");
}

static void print_stats(const char *label, const replay_stats *s) {
    printf("%-10s %6d %5d | %8.1f %8.1f %8.1f | %7.1f %7.1f %7.1f | %7.1f %7.1f | %8.1f %5.1f%%\n", label, s->n,
           s->fails, s->ttft[0], s->ttft[1], s->ttft[2], s->tpot[0], s->tpot[1], s->tpot[2], s->tbt[1], s->tbt[2],
           s->tok_s, 100 * s->slo);
}

static json_t *stats_json(const char *model, const char *trace, const replay_stats *s, const replay_params *p) {
    return json_pack("{s:s, s:s, s:i, s:i, s:i, s:f, s:{s:f,s:f,s:f}, s:{s:f,s:f,s:f}, s:{s:f,s:f,s:f}, s:f, s:f, "
                     "s:f, s:f}",
                     "model", model, "trace", trace, "requests", s->n, "failed", s->fails, "sessions", s->sessions,
                     "prefix_reuse", s->reuse, "ttft_ms", "p50", s->ttft[0], "p95", s->ttft[1], "p99", s->ttft[2],
                     "tpot_ms", "p50", s->tpot[0], "p95", s->tpot[1], "p99", s->tpot[2], "tbt_ms", "p50", s->tbt[0],
                     "p95", s->tbt[1], "p99", s->tbt[2], "tokens_per_s", s->tok_s, "slo_attainment", s->slo,
                     "slo_ttft_ms", p->slo_ttft, "slo_tpot_ms", p->slo_tpot);
}

static const char *const REPLAY_OPTIONS =
    "  --target MODEL=TRACE  replay TRACE (a Mooncake .jsonl: multi-turn sessions rebuilt from hash_ids, or an\n"
    "                    Azure .csv) to MODEL; repeat for several models, all replayed at once\n"
    "  --rate X          arrival rate multiplier (default 1)\n"
    "  --len-scale S     prompt tokens per trace token, to fit small models (default 1/64)\n"
    "  --out-scale S     output tokens per trace token (default 1)\n"
    "  --max-len N       cap on prompt + output tokens (default: the model's max_position_embeddings)\n"
    "  --max-output N    cap on output tokens (default 64)\n"
    "  --duration S      replay only requests arriving in the first S seconds (after --rate)\n"
    "  --max-requests N  at most N requests per target\n"
    "  --concurrency N   client threads (default 64)\n"
    "  --timeout-ms N    give up on a silent request (default 60000)\n"
    "  --slo-ttft-ms N   TTFT SLO (default 2000);  --slo-tpot-ms N  TPOT SLO (default 200)\n"
    "  --warmup S        requests arriving in the first S s are replayed but not counted (replay: default 0;\n"
    "                    interference: 10)\n"
    "  --link PRESET     interference: every model's stager link model (default h20-nvlink-scaled, SwiftCache's\n"
    "                    testbed, each model's time scale measured by its engine)\n"
    "  --traces DIR      interference without --target: every model replays its own trace from DIR (default\n"
    "                    ../shared/traces): the master the Mooncake multi-turn trace, the workers Azure 2023 conv\n"
    "                    and code in turn, at --rate 4 for 110 s (the first 10 s the warm-up): each worker's\n"
    "                    P99 over about 1,000 requests or more\n"
    "  --reps N          interference: repetitions, each starting the node with lending off and on (default 3)\n"
    "  --json FILE       also write the results as JSON\n"
    "  --plot FILE.svg   draw a figure with gnuplot: replay, every model's blocks own / lent / borrowed\n"
    "                    over time; interference, each model's TTFT CDF with lending on against off\n";

/* Parses the options shared by replay and interference. Returns -1 to go on, else an exit status. */
static int parse_replay_args(int argc, char **argv, const char *prog, const char *usage, int need_targets,
                             const char **cfg_path, const char **json_path, const char **plot_path, replay *rp,
                             replay_params *p) {
    *p = (replay_params){.to = {.rate_scale = 1, .len_scale = 1.0 / 64, .min_output = 1, .max_output = 64},
                         .concurrency = 64, .timeout_ms = 60000, .slo_ttft = 2000, .slo_tpot = 200,
                         .warmup_s = -1};
    static const struct option opts[] = {
        {"config", 1, 0, 'c'},       {"target", 1, 0, 't'},      {"rate", 1, 0, 'r'},
        {"len-scale", 1, 0, 's'},    {"max-len", 1, 0, 'L'},     {"max-output", 1, 0, 'O'},
        {"duration", 1, 0, 'd'},     {"max-requests", 1, 0, 'n'}, {"concurrency", 1, 0, 'C'},
        {"timeout-ms", 1, 0, 'T'},   {"slo-ttft-ms", 1, 0, 'f'}, {"slo-tpot-ms", 1, 0, 'p'},
        {"json", 1, 0, 'j'},         {"out-scale", 1, 0, 'o'},   {"help", 0, 0, 'h'},
        {"plot", 1, 0, 'P'},         {"link", 1, 0, 'k'},        {"warmup", 1, 0, 'w'},
        {"reps", 1, 0, 'R'},         {"traces", 1, 0, 'D'},
        {0, 0, 0, 0}};
    int ch;
    int64_t v;
    while ((ch = getopt_long(argc, argv, "h", opts, NULL)) != -1) {
        kvb_status st = KVB_OK;
        switch (ch) {
        case 'o': st = kvb_parse_f64(optarg, &p->to.out_scale); break;
        case 'k': p->link = optarg; break;
        case 'w': st = kvb_parse_f64(optarg, &p->warmup_s); if (p->warmup_s < 0) st = KVB_ERR_INVALID; break;
        case 'R': st = kvb_parse_i64(optarg, 1, 64, &v); p->reps = (int)v; break;
        case 'D': p->traces_dir = optarg; break;
        case 'c': *cfg_path = optarg; break;
        case 'j': *json_path = optarg; break;
        case 'P': *plot_path = optarg; break;
        case 't': {
            char *eq = strchr(optarg, '=');
            if (!eq || eq == optarg || !eq[1] || rp->n_targets == MAX_TARGETS) {
                fprintf(stderr, "%s: --target needs MODEL=TRACE (at most %d)\n", prog, MAX_TARGETS);
                return 2;
            }
            *eq = 0;
            rp->tg[rp->n_targets].model = optarg;
            rp->tg[rp->n_targets++].trace_path = eq + 1;
            break;
        }
        case 'r': st = kvb_parse_f64(optarg, &p->to.rate_scale); p->rate_given = 1; break;
        case 's': st = kvb_parse_f64(optarg, &p->to.len_scale); break;
        case 'd': st = kvb_parse_f64(optarg, &p->to.max_time_s); break;
        case 'f': st = kvb_parse_f64(optarg, &p->slo_ttft); break;
        case 'p': st = kvb_parse_f64(optarg, &p->slo_tpot); break;
        case 'L': st = kvb_parse_i64(optarg, 2, 1 << 24, &v); p->max_len = (int)v; break;
        case 'O': st = kvb_parse_i64(optarg, 1, 1 << 24, &v); p->to.max_output = (int)v; break;
        case 'n': st = kvb_parse_i64(optarg, 1, 1 << 30, &v); p->to.max_requests = (int)v; break;
        case 'C': st = kvb_parse_i64(optarg, 1, 4096, &v); p->concurrency = (int)v; break;
        case 'T': st = kvb_parse_i64(optarg, 1, 1 << 30, &v); p->timeout_ms = (int)v; break;
        case 'h': printf("%s%s", usage, REPLAY_OPTIONS); return 0;
        default: fprintf(stderr, "%s%s", usage, REPLAY_OPTIONS); return 2;
        }
        if (st != KVB_OK || p->to.rate_scale <= 0 || p->to.len_scale <= 0) {
            fprintf(stderr, "%s: bad value '%s'\n", prog, optarg);
            return 2;
        }
    }
    if (!*cfg_path || (need_targets && rp->n_targets == 0)) {
        fprintf(stderr, "%s%s", usage, REPLAY_OPTIONS);
        return 2;
    }
    return -1;
}

/* The directory of this executable, where kvbankctl and kvbankd are. */
static int self_dir(char *buf, size_t len) {
    ssize_t n = readlink("/proc/self/exe", buf, len - 1);
    if (n <= 0) return -1;
    buf[n] = 0;
    char *slash = strrchr(buf, '/');
    if (!slash) return -1;
    *slash = 0;
    return 0;
}

int kvb_bench_replay(int argc, char **argv) {
    const char *cfg_path = NULL, *json_path = NULL, *plot_path = NULL;
    replay rp = {0};
    replay_params p;
    int r = parse_replay_args(argc, argv, "kvbank-bench replay",
                              "usage: kvbank-bench replay --config NODE.json --target MODEL=TRACE [--target ...] "
                              "[options]\n\n"
                              "Replays real traces against a running node (start it with kvbankd first) and reports\n"
                              "TTFT, TPOT and TBT percentiles, throughput and SLO attainment per model.\n\n",
                              1, &cfg_path, &json_path, &plot_path, &rp, &p);
    if (r >= 0) return r;
    replay_stats st[MAX_TARGETS];
    if (plot_path) {
        char dir[4096];
        if (self_dir(dir, sizeof dir) != 0 || kvb_calloc(1, sizeof *rp.bl, (void **)&rp.bl) != KVB_OK) return 1;
        snprintf(rp.bl->ctl, sizeof rp.bl->ctl, "%s/kvbankctl", dir);
    }
    int rc = replay_run(cfg_path, &rp, &p, st);
    if (rc == 0 && rp.bl && blocks_plot(rp.bl, plot_path) != 0) rc = 1;
    free(rp.bl);
    rp.bl = NULL;
    if (rc == 0) {
        json_t *jroot = json_object(), *jt = json_array();
        print_header();
        for (int i = 0; i < rp.n_targets; i++) {
            print_stats(rp.tg[i].model, &st[i]);
            json_array_append_new(jt, stats_json(rp.tg[i].model, rp.tg[i].trace_path, &st[i], &p));
        }
        json_object_set_new(jroot, "targets", jt);
        if (json_path && json_dump_file(jroot, json_path, JSON_INDENT(2)) != 0)
            fprintf(stderr, "kvbank-bench replay: cannot write %s\n", json_path);
        json_decref(jroot);
    }
    replay_free(&rp);
    return rc;
}

/* ---------------------------------------------------------------- interference */

/* Writes a copy of the node config at `src` to `dst` with its run_dir moved to `run_dir`, model and
 * binary paths made absolute, every worker's "lend" set to `lend` and every model's "link_preset" to
 * `link`. */
static int write_variant(const char *src, const char *dst, const char *run_dir, int lend, const char *link) {
    kvb_node_config *c = NULL;
    if (kvb_node_config_load(src, &c) != KVB_OK) return -1;
    json_error_t err;
    json_t *j = json_load_file(src, 0, &err);
    json_t *models = j ? json_object_get(j, "models") : NULL;
    if (!json_is_array(models)) {
        json_decref(j);
        kvb_node_config_free(c);
        return -1;
    }
    json_object_set_new(j, "run_dir", json_string(run_dir));
    json_t *co = json_object_get(j, "coordinator");
    if (json_is_object(co)) json_object_del(co, "endpoint");
    size_t i;
    json_t *m;
    json_array_foreach(models, i, m) {
        const char *name = json_string_value(json_object_get(m, "name"));
        const kvb_node_model *nm = name ? kvb_node_config_model(c, name) : NULL;
        if (nm) json_object_set_new(m, "model_dir", json_string(nm->model_dir));
        json_object_del(m, "endpoint");
        json_object_set_new(m, "link_preset", json_string(link));
        if (nm && nm->role == KVB_ROLE_WORKER) json_object_set_new(m, "lend", json_boolean(lend));
    }
    int rc = json_dump_file(j, dst, JSON_INDENT(2));
    json_decref(j);
    kvb_node_config_free(c);
    return rc;
}

/* Runs `kvbankctl --config CFG status --json` and returns the sum of the workers' lent blocks and how
 * many models are alive (both -1 when the coordinator does not answer); `reclaims` (NULL: not asked):
 * the workers' reclaims since the node started. */
static void node_status(const char *bin_dir, const char *cfg, int *lent, int *alive, int *reclaims) {
    char ctl[4200];
    snprintf(ctl, sizeof ctl, "%s/kvbankctl", bin_dir);
    *lent = *alive = -1;
    if (reclaims) *reclaims = 0;
    json_t *models = NULL, *j = ctl_status(ctl, cfg, &models);
    if (models) {
        *lent = *alive = 0;
        size_t i;
        json_t *m;
        json_array_foreach(models, i, m) {
            *lent += (int)json_integer_value(json_object_get(m, "n_lent"));
            if (reclaims) *reclaims += (int)json_integer_value(json_object_get(m, "reclaims"));
            *alive += json_is_true(json_object_get(m, "alive"));
        }
    }
    json_decref(j);
}

/* interference --plot: per target the CDF of TTFT with lending off and on (the arrays are sorted). */
static int ttft_plot(const replay *rp, double *ttft[2][MAX_TARGETS], int n_ttft[2][MAX_TARGETS], const char *path) {
    kvb_plot_series ser[2 * MAX_TARGETS];
    char names[2 * MAX_TARGETS][96];
    double *xy[2 * MAX_TARGETS][2] = {{0}};
    int n = 0, rc = -1;
    for (int i = 0; i < rp->n_targets; i++)
        for (int lend = 0; lend < 2; lend++) {
            int k = n_ttft[lend][i];
            if (!k) continue;
            if (kvb_calloc((size_t)k, sizeof(double), (void **)&xy[n][0]) != KVB_OK ||
                kvb_calloc((size_t)k, sizeof(double), (void **)&xy[n][1]) != KVB_OK)
                goto out;
            kvb_plot_cdf(ttft[lend][i], (size_t)k, xy[n][0], xy[n][1]);
            snprintf(names[n], sizeof names[n], "%s, lending %s", rp->tg[i].model, lend ? "on" : "off");
            ser[n] = (kvb_plot_series){.name = names[n], .x = xy[n][0], .y = xy[n][1], .n = (size_t)k, .steps = 1};
            n++;
        }
    const kvb_plot pl = {.title = "TTFT of every model with lending on and off (same traces)", .xlabel = "TTFT (ms)",
                         .ylabel = "fraction of requests", .logx = 1, .series = ser, .n_series = n};
    rc = kvb_plot_svg(path, &pl);
out:
    for (int k = 0; k < 2 * MAX_TARGETS; k++) free(xy[k][0]), free(xy[k][1]);
    return rc;
}

/* interference without --target: every model replays a trace of its own (SwiftCache §5.2 loads the
 * workers with their own requests while the master serves its long multi-turn ones). */
static int default_targets(const char *cfg_path, replay *rp, replay_params *p) {
    static char names[MAX_TARGETS][64], paths[MAX_TARGETS][4200];
    static const char *const worker_traces[2] = {"AzureLLMInferenceTrace_conv.csv", "AzureLLMInferenceTrace_code.csv"};
    const char *dir = p->traces_dir ? p->traces_dir : "../shared/traces";
    kvb_node_config *c = NULL;
    if (kvb_node_config_load(cfg_path, &c) != KVB_OK) return -1;
    int w = 0;
    for (int i = 0; i < c->n_models && rp->n_targets < MAX_TARGETS; i++) {
        const kvb_node_model *m = &c->models[i];
        int k = rp->n_targets++;
        snprintf(names[k], sizeof names[k], "%s", m->name);
        snprintf(paths[k], sizeof paths[k], "%s/%s", dir,
                 m->role == KVB_ROLE_MASTER ? "synthetic_trace.jsonl" : worker_traces[w++ % 2]);
        rp->tg[k].model = names[k];
        rp->tg[k].trace_path = paths[k];
    }
    kvb_node_config_free(c);
    if (!p->rate_given) p->to.rate_scale = 4;
    if (!(p->to.max_time_s > 0)) p->to.max_time_s = 110;
    printf("every model replays its own trace (rate x%g, the first %.0f s):", p->to.rate_scale, p->to.max_time_s);
    for (int i = 0; i < rp->n_targets; i++) printf(" %s=%s", rp->tg[i].model, rp->tg[i].trace_path);
    printf("\n");
    return 0;
}

int kvb_bench_interference(int argc, char **argv) {
    const char *cfg_path = NULL, *json_path = NULL, *plot_path = NULL;
    replay rp = {0};
    replay_params p;
    int r = parse_replay_args(argc, argv, "kvbank-bench interference",
                              "usage: kvbank-bench interference --config NODE.json [--target MODEL=TRACE ...] "
                              "[options]\n\n"
                              "Starts the node of NODE.json with kvbankd (the programs next to this one) twice per\n"
                              "repetition: with lending off (\"lend\": false on every worker) and on, every model under\n"
                              "the same stager link preset; replays the same traces each time (the warm-up not counted)\n"
                              "and prints every model's TTFT and TPOT with lending on against off, median and min-max\n"
                              "over the repetitions (SwiftCache's targets: within 5% at p50, 10% at p99).\n\n",
                              0, &cfg_path, &json_path, &plot_path, &rp, &p);
    if (r >= 0) return r;
    if (rp.n_targets == 0 && default_targets(cfg_path, &rp, &p) != 0) return 2;
    if (!p.link) p.link = "h20-nvlink-scaled";
    if (p.warmup_s < 0) p.warmup_s = 10;
    if (p.reps == 0) p.reps = 3;
    char bin_dir[4096];
    ssize_t n = readlink("/proc/self/exe", bin_dir, sizeof bin_dir - 1);
    if (n <= 0) return 1;
    bin_dir[n] = 0;
    *strrchr(bin_dir, '/') = 0;
    char tmpl[] = "/tmp/kvb-interference-XXXXXX";
    if (!mkdtemp(tmpl)) return 1;
    replay_stats (*st)[2][MAX_TARGETS] = NULL; /* [rep][off/on][target] */
    int reclaims[64] = {0};                     /* per repetition, lending on: the workers' reclaims */
    double *ttft[2][MAX_TARGETS] = {{0}}; /* --plot: [off/on][target] the last repetition's TTFTs, ms */
    int n_ttft[2][MAX_TARGETS] = {{0}};
    int rc = 1;
    if (kvb_calloc((size_t)p.reps, sizeof *st, (void **)&st) != KVB_OK) return 1;
    printf("kvbank-bench interference: %s, %d repetitions, warm-up %.0f s not counted; every model's link_preset %s\n",
           cfg_path, p.reps, p.warmup_s, p.link);
    for (int rep = 0; rep < p.reps; rep++)
        for (int lend = 0; lend < 2; lend++) {
            char cfg[4200], run[4200], log[4200];
            snprintf(cfg, sizeof cfg, "%s/node-%s.json", tmpl, lend ? "lend" : "nolend");
            snprintf(run, sizeof run, "%s/run-%s", tmpl, lend ? "lend" : "nolend");
            snprintf(log, sizeof log, "%s/kvbankd-%s-%d.log", tmpl, lend ? "lend" : "nolend", rep + 1);
            if (write_variant(cfg_path, cfg, run, lend, p.link) != 0) {
                fprintf(stderr, "kvbank-bench interference: cannot write %s\n", cfg);
                goto out;
            }
            printf("\n== repetition %d, lending %s: kvbankd --config %s (log %s)\n", rep + 1, lend ? "on" : "off", cfg,
                   log);
            fflush(stdout);
            pid_t pid = fork();
            if (pid == 0) {
                int fd = open(log, O_WRONLY | O_CREAT | O_TRUNC, 0600);
                if (fd >= 0) {
                    dup2(fd, 1);
                    dup2(fd, 2);
                }
                char exe[4200];
                snprintf(exe, sizeof exe, "%s/kvbankd", bin_dir);
                execl(exe, "kvbankd", "--config", cfg, "--foreground", (char *)NULL);
                _exit(127);
            }
            if (pid < 0) goto out;
            int lent = -1, alive = -1, want = 0;
            kvb_node_config *c = NULL;
            if (kvb_node_config_load(cfg, &c) == KVB_OK) want = c->n_models;
            kvb_node_config_free(c);
            for (int k = 0; k < 600; k++) { /* up to 60 s: models generated, loaded, registered (and lending) */
                node_status(bin_dir, cfg, &lent, &alive, NULL);
                if (alive == want && (!lend || lent > 0)) break;
                struct timespec ts = {0, 100000000};
                nanosleep(&ts, NULL);
            }
            printf("   %d models alive, %d worker blocks lent\n", alive, lent);
            int ok = alive == want && (!lend || lent > 0);
            if (ok) ok = replay_run(cfg, &rp, &p, st[rep][lend]) == 0;
            if (ok && lend) node_status(bin_dir, cfg, &lent, &alive, &reclaims[rep]);
            for (int i = 0; ok && plot_path && i < rp.n_targets; i++) { /* --plot: the TTFTs of the served requests */
                const target *tg = &rp.tg[i];
                free(ttft[lend][i]);
                n_ttft[lend][i] = 0;
                if (kvb_calloc((size_t)tg->trace->n, sizeof(double), (void **)&ttft[lend][i]) != KVB_OK) break;
                for (int k = 0; k < tg->trace->n; k++)
                    if (!tg->failed[k] && tg->trace->reqs[k].t_s >= p.warmup_s)
                        ttft[lend][i][n_ttft[lend][i]++] = tg->ttft_ms[k];
            }
            replay_free(&rp);
            kill(pid, SIGTERM);
            int status;
            waitpid(pid, &status, 0);
            if (!ok) {
                fprintf(stderr, "kvbank-bench interference: the node did not come up or the replay failed (see %s)\n",
                        log);
                goto out;
            }
            print_header();
            for (int i = 0; i < rp.n_targets; i++) print_stats(rp.tg[i].model, &st[rep][lend][i]);
            if (lend) printf("(the workers reclaimed %d times during this run)\n", reclaims[rep]);
        }
    /* the ratios on / off per repetition, then their median and min-max */
    printf("\nlending on / off, median [min-max] over %d repetitions (wall-clock latencies on a loaded shared CPU; "
           "link preset %s)\n",
           p.reps, p.link);
    printf("%-8s %6s %7s %22s %22s %22s %22s\n", "model", "n", "reuse", "TTFT p50 on/off", "TTFT p99 on/off",
           "TPOT p50 on/off", "TPOT p99 on/off");
    json_t *jroot = json_object(), *jt = json_array();
    for (int i = 0; i < rp.n_targets; i++) {
        double v[4][64];
        char t[4][48];
        const int q[4] = {0, 2, 0, 2};
        for (int rr = 0; rr < p.reps; rr++)
            for (int k = 0; k < 4; k++) {
                const replay_stats *a = &st[rr][0][i], *b = &st[rr][1][i];
                v[k][rr] = k < 2 ? b->ttft[q[k]] / a->ttft[q[k]] : b->tpot[q[k]] / a->tpot[q[k]];
            }
        printf("%-8s %6d %6.1f%% %22s %22s %22s %22s\n", rp.tg[i].model, st[0][1][i].n, 100 * st[0][1][i].reuse,
               kvb_bench_spread_str(v[0], p.reps, 3, t[0], sizeof t[0]), kvb_bench_spread_str(v[1], p.reps, 3, t[1], sizeof t[1]),
               kvb_bench_spread_str(v[2], p.reps, 3, t[2], sizeof t[2]), kvb_bench_spread_str(v[3], p.reps, 3, t[3], sizeof t[3]));
        if (st[0][1][i].n < 1000) printf("         (%d requests behind each P99: fewer than 1,000)\n", st[0][1][i].n);
        for (int rr = 0; rr < p.reps; rr++) {
            json_t *o = json_object();
            json_object_set_new(o, "repetition", json_integer(rr + 1));
            json_object_set_new(o, "off", stats_json(rp.tg[i].model, rp.tg[i].trace_path, &st[rr][0][i], &p));
            json_object_set_new(o, "on", stats_json(rp.tg[i].model, rp.tg[i].trace_path, &st[rr][1][i], &p));
            json_object_set_new(o, "worker_reclaims", json_integer(reclaims[rr]));
            json_array_append_new(jt, o);
        }
    }
    {
        double v[64];
        char t[48];
        for (int rr = 0; rr < p.reps; rr++) v[rr] = reclaims[rr];
        printf("(n: requests behind each percentile after the warm-up; reuse: the trace's reusable share of their prompt\n"
               " tokens; the workers reclaimed %s times per run with lending on)\n",
               kvb_bench_spread_str(v, p.reps, 0, t, sizeof t));
    }
    json_object_set_new(jroot, "link_preset", json_string(p.link));
    json_object_set_new(jroot, "targets", jt);
    if (json_path && json_dump_file(jroot, json_path, JSON_INDENT(2)) != 0)
        fprintf(stderr, "kvbank-bench interference: cannot write %s\n", json_path);
    json_decref(jroot);
    rc = 0;
    if (plot_path && ttft_plot(&rp, ttft, n_ttft, plot_path) != 0) rc = 1;
out:
    for (int l = 0; l < 2; l++)
        for (int i = 0; i < MAX_TARGETS; i++) free(ttft[l][i]);
    replay_free(&rp);
    free(st);
    return rc;
}
