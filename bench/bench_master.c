/* kvbank-bench maxctx / multiturn — the master's side of SwiftCache, in one process, with the node
 * config's memory budgets and real shared-memory regions for the lenders.
 *
 * maxctx: the longest context the master serves with its own KV memory only, and with every worker's
 *   memory lent to it (idle lenders: each lends all its blocks, rounded down to the pair's MEU); both
 *   measured by running a request of that length to completion and checking one block more is refused.
 *   Beside them, SwiftCache's own figures from Eq. 1-5 (LSC + RC) for the same budgets.
 * multiturn: open-loop replay of Mooncake multi-turn sessions on the master, twice with the same memory:
 *   (a) lending: the workers' memory attached and attended to in place; (b) the baseline: the same
 *   bytes as a host tier behind the prefix cache, reached by copies. Prints TTFT percentiles and the
 *   P99 ratio. */
#include <getopt.h>
#include <math.h>
#include <stdio.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "bench/bench.h"
#include "bench/plot.h"
#include "bench/trace.h"
#include "common/util/progress.h"
#include "common/kv/block_pool.h"
#include "common/mem/mem.h"
#include "common/model/model.h"
#include "common/policy/policy.h"
#include "common/policy/swiftcache.h"
#include "common/sched/engine.h"
#include "common/util/node_config.h"

typedef struct lender {
    kvb_mem_region *region; /* the lender's KV region, in the master backend's memory */
    int n_master_blocks; /* lent, in master blocks */
    uint64_t bytes;
} lender;

typedef struct master_setup {
    kvb_node_config *cfg;
    const kvb_node_model *nm;
    kvb_backend *be;
    kvb_model *m;
    kvb_kv_geom geom;
    lender lenders[16];
    int n_lenders;
} master_setup;

static void setup_free(master_setup *s) {
    for (int i = 0; i < s->n_lenders; i++) kvb_mem_region_destroy(s->lenders[i].region);
    kvb_model_destroy(s->m);
    kvb_backend_destroy(s->be);
    kvb_node_config_free(s->cfg);
}

/* Generates every model of the config that is missing and has "mkmodel" arguments, with the
 * kvbank-mkmodel next to this program (as kvbankd does). */
static kvb_status ensure_models(const kvb_node_config *c) {
    char self[4096];
    ssize_t n = readlink("/proc/self/exe", self, sizeof self - 1);
    if (n <= 0) return KVB_ERR_IO;
    self[n] = 0;
    char *slash = strrchr(self, '/');
    if (slash) *slash = 0;
    for (int i = 0; i < c->n_models; i++) {
        const kvb_node_model *nm = &c->models[i];
        char probe[4200];
        snprintf(probe, sizeof probe, "%s/config.json", nm->model_dir);
        if (access(probe, R_OK) == 0 || !nm->mkmodel) continue;
        char cmd[8400];
        snprintf(cmd, sizeof cmd, "mkdir -p \"$(dirname '%s')\" && '%s/kvbank-mkmodel' %s '%s' >/dev/null",
                 nm->model_dir, self, nm->mkmodel, nm->model_dir);
        printf("  generating %s: kvbank-mkmodel %s\n", nm->name, nm->mkmodel);
        if (system(cmd) != 0) {
            KVB_LOG_E("kvbank-mkmodel failed for %s", nm->name);
            return KVB_ERR_IO;
        }
    }
    return KVB_OK;
}

/* Loads the master model and makes one shm region per worker, sized like the worker's budget, of
 * which the whole MEU-aligned part is lent (an idle worker's Alg. 1 SCALEDOWN lends everything). */
static kvb_status setup(const char *cfg_path, int threads, master_setup *s) {
    memset(s, 0, sizeof *s);
    KVB_TRY(kvb_node_config_load(cfg_path, &s->cfg));
    KVB_TRY(ensure_models(s->cfg));
    s->nm = kvb_node_config_master(s->cfg);
    if (!s->nm) return KVB_ERR_INVALID;
    KVB_TRY(kvb_backend_create(s->nm->backend, threads, &s->be));
    KVB_TRY(kvb_model_load(s->nm->model_dir, s->be, &s->m));
    s->geom = kvb_model_kv_geom(s->m, s->nm->block_size);
    for (int i = 0; i < s->cfg->n_models && s->n_lenders < 16; i++) {
        const kvb_node_model *w = &s->cfg->models[i];
        if (w->role != KVB_ROLE_WORKER) continue;
        kvb_model_config wc;
        KVB_TRY(kvb_model_config_load(w->model_dir, &wc));
        kvb_kv_geom wg = {.n_layers = wc.n_layers, .n_kv_heads = wc.n_kv_heads, .head_dim = wc.head_dim,
                          .block_size = w->block_size, .elem_size = s->geom.elem_size};
        kvb_meu u;
        KVB_TRY(kvb_swift_meu(&s->geom, &wg, (uint64_t)w->kv_bytes, &u));
        int64_t w_blocks = w->kv_bytes / (int64_t)kvb_kv_block_bytes(&wg);
        int64_t units = w_blocks / u.meu_worker;
        lender *l = &s->lenders[s->n_lenders++];
        l->n_master_blocks = (int)(units * u.meu_master);
        l->bytes = (uint64_t)units * u.lcm_bytes;
        KVB_TRY(kvb_mem_region_create(s->be->mem, "bench-lender", (size_t)w->kv_bytes, &l->region));
        printf("  lender %-8s %lld blocks of %zu bytes, MEU %u worker / %u master blocks: lends %lld units = %d "
               "master blocks\n",
               w->name, (long long)w_blocks, kvb_kv_block_bytes(&wg), u.meu_worker, u.meu_master, (long long)units,
               l->n_master_blocks);
    }
    return KVB_OK;
}

static kvb_status make_engine(master_setup *s, int lend, int host_tier_blocks, const kvb_engine_events *ev,
                              kvb_engine **out) {
    kvb_engine_opts o;
    kvb_engine_opts_default(&o);
    o.block_size = s->nm->block_size;
    o.n_blocks = (int)(s->nm->kv_bytes / (int64_t)kvb_kv_block_bytes(&s->geom));
    o.max_batch_tokens = s->nm->max_batch_tokens;
    o.max_seqs = s->nm->max_seqs;
    /* the baseline: the host-tier planner with a host tier of the lent blocks' bytes */
    kvb_planner pl = {0};
    if (host_tier_blocks > 0) {
        char kv[32];
        snprintf(kv, sizeof kv, "blocks=%d", host_tier_blocks);
        kvb_policy_params pp = {0};
        kvb_status st = kvb_policy_params_add(&pp, kv);
        if (st == KVB_OK) st = kvb_policy_create("host-tier", &pp, &pl);
        kvb_policy_params_free(&pp);
        KVB_TRY(st);
    }
    KVB_TRY(kvb_engine_create(s->m, &o, host_tier_blocks > 0 ? &pl : NULL, ev, out));
    for (int i = 0; lend && i < s->n_lenders; i++)
        KVB_TRY(kvb_engine_attach(*out, (uint64_t)i + 1, kvb_mem_region_base(s->lenders[i].region), s->lenders[i].bytes,
                                  s->lenders[i].n_master_blocks));
    return KVB_OK;
}

typedef struct counter {
    int tokens;
    int finished;
    kvb_finish why;
} counter;

static void cnt_token(void *ud, uint64_t id, int index, int32_t tok, uint64_t t_ns) { ((counter *)ud)->tokens++; }
static void cnt_finish(void *ud, uint64_t id, kvb_finish why, kvb_status err) {
    ((counter *)ud)->finished++;
    ((counter *)ud)->why = why;
}

/* Tokens the engine can hold for one sequence: every block it has, bounded by the model length. */
static int64_t max_context(kvb_engine *e, const kvb_model *m, int bs) {
    int64_t blocks = kvb_block_pool_n_blocks(kvb_engine_pool(e));
    return KVB_MIN(blocks * bs, (int64_t)kvb_model_cfg(m)->max_pos);
}

/* Runs a request of `len` tokens (prompt len-1, one generated); 1 if it completed. `pg` (NULL: none) is
 * a progress line over the prompt's tokens. */
static int run_len(kvb_engine *e, counter *c, int64_t len, int vocab, uint64_t id, kvb_progress *pg) {
    int32_t *p = NULL;
    if (kvb_malloc((size_t)len * sizeof *p, (void **)&p) != KVB_OK) return 0;
    for (int64_t i = 0; i < len - 1; i++) p[i] = (int32_t)(3 + (i * 7919 + 13) % (vocab - 3));
    kvb_request r = {.id = id, .prompt = p, .n_prompt = (int)(len - 1), .max_tokens = 1};
    *c = (counter){0};
    kvb_status st = kvb_engine_add(e, &r);
    free(p);
    if (st != KVB_OK) return 0;
    kvb_engine_stats s0, s1;
    kvb_engine_get_stats(e, &s0);
    while (kvb_engine_n_live(e) > 0) {
        if (kvb_engine_step(e) != KVB_OK) return 0;
        kvb_engine_get_stats(e, &s1);
        kvb_progress_update(pg, s1.prompt_tokens - s0.prompt_tokens);
    }
    return c->finished == 1 && c->why == KVB_FINISH_LENGTH && c->tokens == 1;
}

static void usage_maxctx(FILE *f) {
    fprintf(f, "usage: kvbank-bench maxctx --config NODE.json [--threads N] [--plot FILE.svg]\n"
               "  --plot FILE.svg   draw a bar chart with gnuplot: the longest context of every configuration\n"
               "  the master's and workers' models and KV budgets come from the node config; give the master\n"
               "  model a max_position_embeddings above what its memory holds (kvbank-mkmodel --max-pos)\n");
}

int kvb_bench_maxctx(int argc, char **argv) {
    const char *cfg = NULL, *plot_path = NULL;
    int threads = 2;
    static const struct option opts[] = {{"config", 1, 0, 'c'}, {"threads", 1, 0, 't'}, {"plot", 1, 0, 'P'},
                                         {"help", 0, 0, 'h'}, {0, 0, 0, 0}};
    int ch;
    int64_t v;
    while ((ch = getopt_long(argc, argv, "h", opts, NULL)) != -1) {
        if (ch == 'c') cfg = optarg;
        else if (ch == 'P') plot_path = optarg;
        else if (ch == 't' && kvb_parse_i64(optarg, 1, 256, &v) == KVB_OK) threads = (int)v;
        else {
            usage_maxctx(ch == 'h' ? stdout : stderr);
            return ch == 'h' ? 0 : 2;
        }
    }
    if (!cfg) {
        usage_maxctx(stderr);
        return 2;
    }
    master_setup s;
    int rc = 1;
    printf("kvbank-bench maxctx: %s\n", cfg);
    if (setup(cfg, threads, &s) != KVB_OK) goto out;
    int bs = s.nm->block_size, vocab = kvb_model_cfg(s.m)->vocab;
    int64_t got[2] = {0, 0};
    for (int lend = 0; lend < 2; lend++) {
        counter c;
        kvb_engine_events ev = {.ud = &c, .on_token = cnt_token, .on_finish = cnt_finish};
        kvb_engine *e = NULL;
        if (make_engine(&s, lend, 0, &ev, &e) != KVB_OK) goto out;
        int64_t mx = max_context(e, s.m, bs);
        /* a progress line per configuration on a terminal (common/util/progress.h) */
        kvb_progress pg;
        char what[96];
        snprintf(what, sizeof what, "%s: prefilling %lld tokens", lend ? "with lending" : "own memory only", (long long)mx - 1);
        kvb_progress_begin(&pg, what, (uint64_t)mx - 1, KVB_PROGRESS_COUNT);
        double t0 = kvb_now_s();
        int ok = run_len(e, &c, mx, vocab, 1, &pg);
        double dt = kvb_now_s() - t0;
        if (ok) kvb_progress_end(&pg);
        else kvb_progress_cancel(&pg);
        int refused = !run_len(e, &c, mx + bs, vocab, 2, NULL);
        printf("  %-16s max context %7lld tokens: %s in %.1f s; %lld tokens %s\n", lend ? "with lending" : "own memory only",
               (long long)mx, ok ? "completed" : "FAILED", dt, (long long)(mx + bs), refused ? "refused" : "NOT refused");
        got[lend] = ok && refused ? mx : 0;
        kvb_engine_destroy(e);
    }
    uint64_t cw[16];
    for (int i = 0; i < s.n_lenders; i++) cw[i] = s.lenders[i].bytes;
    kvb_swift_plan p;
    if (kvb_swift_plan_lsc(&s.geom, (uint64_t)s.nm->kv_bytes, cw, s.n_lenders, &p) != KVB_OK) goto out;
    printf("\n%-44s %10s %8s\n", "", "tokens", "ratio");
    printf("%-44s %10lld %8.2f\n", "master alone (measured)", (long long)got[0], 1.0);
    printf("%-44s %10lld %8.2f\n", "master + lenders, in place (measured)", (long long)got[1],
           got[0] ? (double)got[1] / got[0] : 0);
    printf("%-44s %10lld %8.2f\n", "SwiftCache Eq. 1-5: (N_LSC + N_RC) * B", (long long)p.max_ctx_tokens,
           p.no_lending_tokens ? (double)p.max_ctx_tokens / p.no_lending_tokens : 0);
    printf("%-44s %10lld %8.2f\n", "Eq. 1-5 without lending: K_master / L * B", (long long)p.no_lending_tokens, 1.0);
    printf("(N_LSC %lld, N_RC %lld, K_master %lld single-layer blocks, lenders hold %lld full blocks)\n",
           (long long)p.n_lsc, (long long)p.n_rc, (long long)p.k_master, (long long)p.k_workers);
    rc = got[0] && got[1] ? 0 : 1;
    if (plot_path) {
        /* the four rows of the table as bars (a failed measurement is a bar of 0) */
        static const char *const labels[4] = {"master alone", "master + lenders", "Eq. 1-5 with lending",
                                              "Eq. 1-5 without lending"};
        const double x[4] = {0, 1, 2, 3};
        const double y[4] = {(double)got[0], (double)got[1], (double)p.max_ctx_tokens, (double)p.no_lending_tokens};
        const kvb_plot_series ser[2] = {{.name = "measured", .x = x, .y = y, .n = 2, .bars = 1},
                                        {.name = "SwiftCache Eq. 1-5", .x = x + 2, .y = y + 2, .n = 2, .bars = 1}};
        const kvb_plot pl = {.title = "the master's longest context per configuration", .xlabel = "configuration",
                             .ylabel = "longest context (tokens)", .series = ser, .n_series = 2, .xtics = labels,
                             .n_xtics = 4};
        if (kvb_plot_svg(plot_path, &pl) != 0) rc = 1;
    }
out:
    setup_free(&s);
    return rc;
}

/* ---------------------------------------------------------------- multiturn */

typedef struct mt_state {
    double *arrival;  /* [n] wall seconds */
    double *ttft;     /* [n] seconds, NAN until the first token */
    int done;
} mt_state;

static void mt_token(void *ud, uint64_t id, int index, int32_t tok, uint64_t t_ns) {
    mt_state *m = ud;
    if (index == 0) m->ttft[id] = kvb_now_s() - m->arrival[id];
}
static void mt_finish(void *ud, uint64_t id, kvb_finish why, kvb_status err) { ((mt_state *)ud)->done++; }

static int cmp_d(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

static double pctl(const double *v, int n, double p, double *tmp) {
    memcpy(tmp, v, sizeof(double) * (size_t)n);
    qsort(tmp, (size_t)n, sizeof *tmp, cmp_d);
    int k = (int)ceil(p / 100 * n) - 1;
    return tmp[KVB_MAX(0, KVB_MIN(n - 1, k))];
}

int kvb_bench_multiturn(int argc, char **argv) {
    const char *cfg = NULL, *trace = NULL, *plot_path = NULL;
    int threads = 2;
    kvb_trace_opts to = {.rate_scale = 1, .len_scale = 1.0 / 32, .min_output = 1, .max_output = 32,
                         .max_time_s = 20};
    static const struct option opts[] = {{"config", 1, 0, 'c'}, {"trace", 1, 0, 'T'}, {"threads", 1, 0, 't'},
                                         {"rate", 1, 0, 'r'},   {"len-scale", 1, 0, 's'}, {"duration", 1, 0, 'd'},
                                         {"max-output", 1, 0, 'o'}, {"help", 0, 0, 'h'}, {"plot", 1, 0, 'P'},
                                         {0, 0, 0, 0}};
    int ch;
    int64_t v;
    while ((ch = getopt_long(argc, argv, "h", opts, NULL)) != -1) {
        kvb_status st = KVB_OK;
        if (ch == 'c') cfg = optarg;
        else if (ch == 'T') trace = optarg;
        else if (ch == 'P') plot_path = optarg;
        else if (ch == 't') { st = kvb_parse_i64(optarg, 1, 256, &v); threads = (int)v; }
        else if (ch == 'r') st = kvb_parse_f64(optarg, &to.rate_scale);
        else if (ch == 's') st = kvb_parse_f64(optarg, &to.len_scale);
        else if (ch == 'd') st = kvb_parse_f64(optarg, &to.max_time_s);
        else if (ch == 'o') { st = kvb_parse_i64(optarg, 1, 1 << 20, &v); to.max_output = (int)v; }
        else {
            fprintf(ch == 'h' ? stdout : stderr,
                    "usage: kvbank-bench multiturn --config NODE.json --trace MOONCAKE.jsonl [--rate X] [--len-scale S]\n"
                    "                              [--duration S] [--max-output N] [--threads N] [--plot FILE.svg]\n"
                    "  open-loop replay of the trace's multi-turn sessions on the master: lending (workers' memory\n"
                    "  attached, in place) against a host-tier prefix cache of the same bytes; defaults: rate 1,\n"
                    "  len-scale 1/32, the first 20 s, outputs capped at 32 tokens; --plot draws both TTFT CDFs\n"
                    "  (gnuplot)\n");
            return ch == 'h' ? 0 : 2;
        }
        if (st != KVB_OK || to.rate_scale <= 0 || to.len_scale <= 0) {
            fprintf(stderr, "kvbank-bench multiturn: bad value '%s'\n", optarg);
            return 2;
        }
    }
    if (!cfg || !trace) {
        fprintf(stderr, "kvbank-bench multiturn: --config and --trace are required\n");
        return 2;
    }
    master_setup s;
    kvb_trace *tr = NULL;
    int rc = 1;
    double *res[2] = {0}, *tmp = NULL;
    uint64_t computed[2] = {0}, loads[2] = {0}, preempted[2] = {0};
    printf("kvbank-bench multiturn: %s on the master of %s\n", trace, cfg);
    if (setup(cfg, threads, &s) != KVB_OK) goto out;
    to.vocab = kvb_model_cfg(s.m)->vocab;
    int lent_blocks = 0;
    for (int i = 0; i < s.n_lenders; i++) lent_blocks += s.lenders[i].n_master_blocks;
    to.max_len = (int)KVB_MIN((int64_t)kvb_model_cfg(s.m)->max_pos,
                              (s.nm->kv_bytes / (int64_t)kvb_kv_block_bytes(&s.geom)) * s.nm->block_size);
    if (kvb_trace_load(trace, &to, &tr) != KVB_OK) goto out;
    int n = tr->n;
    if (kvb_calloc((size_t)n, sizeof(double), (void **)&tmp)) goto out;
    printf("  %d requests in %d sessions over %.1f s; lenders give %d master blocks; host tier of the same size\n\n", n,
           tr->n_sessions, tr->reqs[n - 1].t_s, lent_blocks);
    for (int mode = 0; mode < 2; mode++) {
        mt_state ms = {0};
        if (kvb_calloc((size_t)n, sizeof(double), (void **)&ms.arrival) ||
            kvb_calloc((size_t)n, sizeof(double), (void **)&res[mode])) {
            free(ms.arrival);
            goto out;
        }
        ms.ttft = res[mode];
        for (int i = 0; i < n; i++) ms.ttft[i] = NAN;
        kvb_engine_events ev = {.ud = &ms, .on_token = mt_token, .on_finish = mt_finish};
        kvb_engine *e = NULL;
        if (make_engine(&s, mode == 0, mode == 1 ? lent_blocks : 0, &ev, &e) != KVB_OK) {
            free(ms.arrival);
            goto out;
        }
        double t0 = kvb_now_s();
        int next = 0, rejected = 0;
        kvb_progress pg; /* a progress line on a terminal (common/util/progress.h) */
        char what[96];
        snprintf(what, sizeof what, "multiturn, %s", mode ? "host tier" : "lending");
        kvb_progress_begin(&pg, what, (uint64_t)n, KVB_PROGRESS_COUNT);
        while (ms.done + rejected < n) {
            kvb_progress_update(&pg, (uint64_t)(ms.done + rejected));
            double now = kvb_now_s() - t0;
            while (next < n && tr->reqs[next].t_s <= now) {
                const kvb_trace_req *q = &tr->reqs[next];
                ms.arrival[next] = t0 + q->t_s;
                kvb_request r = {.id = (uint64_t)next, .prompt = q->prompt, .n_prompt = q->n_prompt,
                                 .max_tokens = q->max_tokens};
                if (kvb_engine_add(e, &r) != KVB_OK) rejected++;
                next++;
            }
            if (kvb_engine_n_live(e) > 0) {
                if (kvb_engine_step(e) != KVB_OK) break;
            } else if (next < n) {
                double wait = tr->reqs[next].t_s - (kvb_now_s() - t0);
                if (wait > 0) {
                    struct timespec ts = {.tv_sec = (time_t)wait, .tv_nsec = (long)((wait - (time_t)wait) * 1e9)};
                    nanosleep(&ts, NULL);
                }
            }
        }
        if (ms.done + rejected < n) kvb_progress_cancel(&pg);
        else kvb_progress_end(&pg);
        kvb_engine_stats st;
        kvb_engine_get_stats(e, &st);
        computed[mode] = st.prompt_tokens;
        loads[mode] = st.host_tier_loads;
        preempted[mode] = st.preemptions;
        kvb_engine_destroy(e);
        free(ms.arrival);
        if (rejected) printf("  (%s: %d requests rejected)\n", mode ? "host tier" : "lending", rejected);
    }
    {
        int m0 = 0, m1 = 0;
        double *a = NULL, *b = NULL;
        if (kvb_calloc((size_t)n, sizeof(double), (void **)&a) || kvb_calloc((size_t)n, sizeof(double), (void **)&b)) {
            free(a);
            goto out;
        }
        for (int i = 0; i < n; i++) {
            if (!isnan(res[0][i])) a[m0++] = res[0][i] * 1e3;
            if (!isnan(res[1][i])) b[m1++] = res[1][i] * 1e3;
        }
        printf("%-34s %9s %9s %9s %14s %10s %9s\n", "TTFT (ms)", "p50", "p95", "p99", "prefilled tok", "host loads",
               "preempts");
        printf("%-34s %9.1f %9.1f %9.1f %14llu %10llu %9llu\n", "lending (in place)", pctl(a, m0, 50, tmp),
               pctl(a, m0, 95, tmp), pctl(a, m0, 99, tmp), (unsigned long long)computed[0], (unsigned long long)loads[0],
               (unsigned long long)preempted[0]);
        printf("%-34s %9.1f %9.1f %9.1f %14llu %10llu %9llu\n", "host-tier prefix cache (copies)", pctl(b, m1, 50, tmp),
               pctl(b, m1, 95, tmp), pctl(b, m1, 99, tmp), (unsigned long long)computed[1], (unsigned long long)loads[1],
               (unsigned long long)preempted[1]);
        printf("(prefilled tok: prompt tokens computed, recomputation after preemption included; fewer means more "
               "reuse)\n");
        printf("\nP99 TTFT ratio host tier / lending: %.2f\n", pctl(b, m1, 99, tmp) / pctl(a, m0, 99, tmp));
        rc = 0;
        if (plot_path) { /* the two TTFT CDFs (a and b are sorted in place) */
            double *xy = NULL;
            if (kvb_calloc((size_t)(2 * (m0 + m1)) + 1, sizeof(double), (void **)&xy) == KVB_OK) {
                double *ax = xy, *ay = xy + m0, *bx = xy + 2 * m0, *by = xy + 2 * m0 + m1;
                kvb_plot_cdf(a, (size_t)m0, ax, ay);
                kvb_plot_cdf(b, (size_t)m1, bx, by);
                const kvb_plot_series ser[2] = {
                    {.name = "lending (workers' blocks in place)", .x = ax, .y = ay, .n = (size_t)m0, .steps = 1},
                    {.name = "host-tier prefix cache (copies)", .x = bx, .y = by, .n = (size_t)m1, .steps = 1},
                };
                const kvb_plot pl = {.title = "multi-turn TTFT on the master: lending against a host tier of the same size",
                                     .xlabel = "TTFT (ms)", .ylabel = "fraction of requests", .logx = 1, .series = ser,
                                     .n_series = 2};
                if (kvb_plot_svg(plot_path, &pl) != 0) rc = 1;
            } else {
                rc = 1;
            }
            free(xy);
        }
        free(a);
        free(b);
    }
out:
    free(res[0]);
    free(res[1]);
    free(tmp);
    kvb_trace_free(tr);
    setup_free(&s);
    return rc;
}
