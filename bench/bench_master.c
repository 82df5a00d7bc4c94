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
#include "bench/bench_link.h"
#include "bench/plot.h"
#include "bench/trace.h"
#include "common/util/progress.h"
#include "common/kv/block_pool.h"
#include "common/mem/mem.h"
#include "common/model/model.h"
#include "common/policy/policy.h"
#include "common/policy/swiftcache.h"
#include "common/sched/engine.h"
#include "common/sched/stager.h"
#include "common/util/node_config.h"

typedef struct lender {
    kvb_mem_region *region; /* the lender's KV region, in the master backend's memory */
    int n_master_blocks; /* lent, in master blocks */
    int meu_master;      /* master blocks of one MEU of this pair */
    uint64_t bytes;
} lender;

typedef struct master_setup {
    kvb_node_config *cfg;
    const kvb_node_model *nm;
    kvb_backend *be;
    kvb_model *m;
    kvb_kv_geom geom;
    kvb_link_model links; /* the stager's link model of every engine made here (--link) */
    lender lenders[16];
    int n_lenders;
    int host_whole;       /* the host-tier baseline loads hits whole before the step (--host-load whole) */
    int host_sync_wb;     /* ... and copies each block out when the pool evicts it (--host-writeback sync) */
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

/* Loads the master model (on `dev`'s backend when one was named, else the config's) with the run's link
 * model (`link`, calibrated at `pt`), and makes one region per worker, sized like the worker's budget, of
 * which the whole MEU-aligned part is lent (an idle worker's Alg. 1 SCALEDOWN lends everything). */
static kvb_status setup(const char *cfg_path, const kvb_bench_dev *dev, const char *link, const char *cpu_link,
                        const kvb_link_point *pt, master_setup *s) {
    memset(s, 0, sizeof *s);
    KVB_TRY(kvb_node_config_load(cfg_path, &s->cfg));
    KVB_TRY(ensure_models(s->cfg));
    s->nm = kvb_node_config_master(s->cfg);
    if (!s->nm) return KVB_ERR_INVALID;
    kvb_bench_dev d = *dev;
    if (!d.backend) d.backend = s->nm->backend;
    KVB_TRY(kvb_bench_backend(&d, &s->be));
    KVB_TRY(kvb_model_load(s->nm->model_dir, s->be, &s->m));
    s->geom = kvb_model_kv_geom(s->m, s->nm->block_size);
    KVB_TRY(kvb_bench_links(s->m, &d, link, cpu_link, pt, &s->links));
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
        l->meu_master = (int)u.meu_master;
        l->bytes = (uint64_t)units * u.lcm_bytes;
        KVB_TRY(kvb_mem_region_create(s->be->mem, "bench-lender", (size_t)w->kv_bytes, &l->region));
        printf("  lender %-8s %lld blocks of %zu bytes, MEU %u worker / %u master blocks: lends %lld units = %d "
               "master blocks\n",
               w->name, (long long)w_blocks, kvb_kv_block_bytes(&wg), u.meu_worker, u.meu_master, (long long)units,
               l->n_master_blocks);
    }
    return KVB_OK;
}

/* An engine of the master's budget: lend (0: own memory only), a host-tier baseline of
 * host_tier_blocks (> 0), or with `stream` SwiftCache's layer stream cache inside the budget
 * (swiftcache lsc=stream, lenders_bytes = what the lenders give: Eq. 1-5 size the LSC, the pool keeps
 * the rest) with as many lent blocks attached as the LSC streams. */
static kvb_status make_engine(master_setup *s, int lend, int host_tier_blocks, int stream, const kvb_engine_events *ev,
                              kvb_engine **out) {
    kvb_engine_opts o;
    kvb_engine_opts_default(&o);
    o.block_size = s->nm->block_size;
    o.n_blocks = (int)(s->nm->kv_bytes / (int64_t)kvb_kv_block_bytes(&s->geom));
    o.max_batch_tokens = s->nm->max_batch_tokens;
    o.max_seqs = s->nm->max_seqs;
    o.links = s->links;
    kvb_planner pl = {0};
    char kv[3][64] = {"", "", ""};
    const char *policy = NULL;
    if (host_tier_blocks > 0) { /* the baseline: the host-tier planner with a host tier of the lent blocks' bytes */
        policy = "host-tier";
        snprintf(kv[0], sizeof kv[0], "blocks=%d", host_tier_blocks);
        snprintf(kv[1], sizeof kv[1], "layered=%d", !s->host_whole);
        snprintf(kv[2], sizeof kv[2], "writeback=%s", s->host_sync_wb ? "sync" : "async");
    } else if (stream) {
        uint64_t lent = 0;
        for (int i = 0; i < s->n_lenders; i++) lent += s->lenders[i].bytes;
        policy = "swiftcache";
        snprintf(kv[0], sizeof kv[0], "lsc=stream");
        snprintf(kv[1], sizeof kv[1], "lenders_bytes=%llu", (unsigned long long)lent);
    }
    if (policy) {
        kvb_policy_params pp = {0};
        kvb_status st = KVB_OK;
        for (int k = 0; k < 3 && st == KVB_OK; k++)
            if (kv[k][0]) st = kvb_policy_params_add(&pp, kv[k]);
        if (st == KVB_OK) st = kvb_policy_create(policy, &pp, &pl);
        kvb_policy_params_free(&pp);
        KVB_TRY(st);
    }
    if (!policy) pl = kvb_policy_recompute();
    KVB_TRY(kvb_engine_create(s->m, &o, &pl, ev, out));
    kvb_engine_stats es;
    kvb_engine_get_stats(*out, &es);
    int room = stream ? es.stage_slots : INT32_MAX; /* stream: lent blocks the LSC streams */
    for (int i = 0; lend && i < s->n_lenders && room > 0; i++) {
        int nb = KVB_MIN(room, s->lenders[i].n_master_blocks);
        KVB_TRY(kvb_engine_attach(*out, (uint64_t)i + 1, kvb_mem_region_base(s->lenders[i].region),
                                  (size_t)nb * kvb_kv_block_bytes(&s->geom), nb));
        room -= nb;
    }
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
    fprintf(f, "usage: kvbank-bench maxctx --config NODE.json [--link PRESET] [--threads N] [--plot FILE.svg]\n"
               "  the longest context of the master alone, with every lent block in place, and with SwiftCache's\n"
               "  LSC + RC inside its budget (stream mode), each measured by running it; beside them Eq. 1-5\n"
               "  --link PRESET     the stager's link model (default h20-nvlink-scaled on the CPU, off on a GPU;\n"
               "                    'list' names them)\n"
               KVB_BENCH_DEV_USAGE
               "                    (default: the master's backend in the node config)\n"
               "  --plot FILE.svg   draw a bar chart with gnuplot: the longest context of every configuration\n"
               "  the master's and workers' models and KV budgets come from the node config; give the master\n"
               "  model a max_position_embeddings above what its memory holds (kvbank-mkmodel --max-pos)\n");
}

int kvb_bench_maxctx(int argc, char **argv) {
    const char *cfg = NULL, *plot_path = NULL, *link = NULL;
    kvb_bench_dev dev = KVB_BENCH_DEV_DEFAULT;
    dev.backend = NULL;
    static const struct option opts[] = {{"config", 1, 0, 'c'}, {"threads", 1, 0, 't'}, {"plot", 1, 0, 'P'},
                                         {"link", 1, 0, 'l'},   {"help", 0, 0, 'h'},    {"backend", 1, 0, 'B'},
                                         {"device", 1, 0, 'D'}, {0, 0, 0, 0}};
    int ch;
    int64_t v;
    while ((ch = getopt_long(argc, argv, "h", opts, NULL)) != -1) {
        int d = kvb_bench_dev_opt(&dev, ch, optarg, "kvbank-bench maxctx");
        if (d == 2) return 2;
        if (d) continue;
        if (ch == 'c') cfg = optarg;
        else if (ch == 'P') plot_path = optarg;
        else if (ch == 'l') link = optarg;
        else if (ch == 't' && kvb_parse_i64(optarg, 1, 256, &v) == KVB_OK) dev.threads = (int)v;
        else {
            usage_maxctx(ch == 'h' ? stdout : stderr);
            return ch == 'h' ? 0 : 2;
        }
    }
    if (link && !strcmp(link, "list")) {
        kvb_link_preset_list(stdout);
        return 0;
    }
    if (!cfg) {
        usage_maxctx(stderr);
        return 2;
    }
    master_setup s;
    int rc = 1;
    printf("kvbank-bench maxctx: %s\n", cfg);
    if (setup(cfg, &dev, link, "h20-nvlink-scaled", NULL, &s) != KVB_OK) goto out;
    int bs = s.nm->block_size, vocab = kvb_model_cfg(s.m)->vocab;
    /* three configurations of the same budget: own memory only, every lent block in place, and
     * SwiftCache's LSC + RC inside the budget (stream mode: Eq. 1-5 as kvbank streams) */
    static const char *const conf[3] = {"own memory only", "with lending", "stream mode"};
    int64_t got[3] = {0, 0, 0};
    for (int k = 0; k < 3; k++) {
        counter c;
        kvb_engine_events ev = {.ud = &c, .on_token = cnt_token, .on_finish = cnt_finish};
        kvb_engine *e = NULL;
        if (make_engine(&s, k > 0, 0, k == 2, &ev, &e) != KVB_OK) goto out;
        int64_t mx = max_context(e, s.m, bs);
        /* a progress line per configuration on a terminal (common/util/progress.h) */
        kvb_progress pg;
        char what[96];
        snprintf(what, sizeof what, "%s: prefilling %lld tokens", conf[k], (long long)mx - 1);
        kvb_progress_begin(&pg, what, (uint64_t)mx - 1, KVB_PROGRESS_COUNT);
        double t0 = kvb_now_s();
        int ok = run_len(e, &c, mx, vocab, 1, &pg);
        double dt = kvb_now_s() - t0;
        if (ok) kvb_progress_end(&pg);
        else kvb_progress_cancel(&pg);
        int refused = !run_len(e, &c, mx + bs, vocab, 2, NULL);
        kvb_engine_stats es;
        kvb_engine_get_stats(e, &es);
        printf("  %-16s max context %7lld tokens: %s in %.1f s; %lld tokens %s", conf[k], (long long)mx,
               ok ? "completed" : "FAILED", dt, (long long)(mx + bs), refused ? "refused" : "NOT refused");
        if (k == 2)
            printf(" (pool %d own + %d lent blocks, %d streamed at once)", es.blocks_own, es.blocks_borrowed, es.stage_slots);
        printf("\n");
        got[k] = ok && refused ? mx : 0;
        kvb_engine_destroy(e);
    }
    uint64_t cw[16];
    for (int i = 0; i < s.n_lenders; i++) cw[i] = s.lenders[i].bytes;
    kvb_swift_plan p;
    if (kvb_swift_plan_lsc(&s.geom, (uint64_t)s.nm->kv_bytes, cw, s.n_lenders, &p) != KVB_OK) goto out;
    printf("\n(prefill times: one run each on a loaded shared CPU under the link model; the token counts are exact\n"
           " capacities, the same on every run)\n");
    printf("\n%-52s %10s %8s\n", "", "tokens", "ratio");
    printf("%-52s %10lld %8.2f\n", "master alone (measured)", (long long)got[0], 1.0);
    printf("%-52s %10lld %8.2f\n", "master + lenders, in place (measured)", (long long)got[1],
           got[0] ? (double)got[1] / got[0] : 0);
    printf("%-52s %10lld %8.2f\n", "SwiftCache LSC + RC in the budget, stream (measured)", (long long)got[2],
           got[0] ? (double)got[2] / got[0] : 0);
    printf("%-52s %10lld %8.2f\n", "  its plan: (n_stream + N_RC') * B", (long long)p.stream_tokens,
           p.no_lending_tokens ? (double)p.stream_tokens / p.no_lending_tokens : 0);
    printf("%-52s %10lld %8.2f\n", "SwiftCache Eq. 1-5: (N_LSC + N_RC) * B", (long long)p.max_ctx_tokens,
           p.no_lending_tokens ? (double)p.max_ctx_tokens / p.no_lending_tokens : 0);
    printf("%-52s %10lld %8.2f\n", "Eq. 1-5 without lending: K_master / L * B", (long long)p.no_lending_tokens, 1.0);
    printf("(Eq. 1-5 use the master's geometry: %s, L = %d layers, H_kv = %d, D = %d, B = %d, %d-byte elements: one\n"
           " single-layer block %llu bytes; the lenders' bytes become master blocks by Eq. 2. N_LSC %lld, N_RC %lld,\n"
           " K_master %lld single-layer blocks, lenders hold %lld full blocks; kvbank streams %lld blocks through 2\n"
           " buffers each, taking %lld own blocks, N_RC' %lld)\n",
           s.nm->name, s.geom.n_layers, s.geom.n_kv_heads, s.geom.head_dim, s.geom.block_size, s.geom.elem_size,
           (unsigned long long)p.m_block, (long long)p.n_lsc, (long long)p.n_rc, (long long)p.k_master,
           (long long)p.k_workers, (long long)p.n_stream, (long long)p.lsc_own_blocks, (long long)p.n_rc_stream);
    /* the headline side by side: what the paper's stream layout gives here against what its equations say */
    printf("\nside by side (x the master alone): stream layout measured %.2fx, its plan %.2fx, Eq. 1-5 %.2fx; the paper's\n"
           " Fig. 9: 1.58-3.98x over vLLM with 8K chunked prefill. In-place lending (%.2fx) is the budgets' ratio (own +\n"
           " lent) / own, not a gain of the layer stream cache\n",
           got[0] ? (double)got[2] / got[0] : 0, p.no_lending_tokens ? (double)p.stream_tokens / p.no_lending_tokens : 0,
           p.no_lending_tokens ? (double)p.max_ctx_tokens / p.no_lending_tokens : 0, got[0] ? (double)got[1] / got[0] : 0);
    if (p.max_ctx_tokens > p.stream_tokens)
        printf("(the stream layout falls short of Eq. 1-5 because kvbank double-buffers each streamed block (2 single-\n"
               " layer buffers, so that layer l+1 loads while l computes) and the buffers come out of the master's own\n"
               " budget; Eq. 1-5 count one buffer per block, the paper's LSC)\n");
    if (s.geom.n_layers <= 2)
        printf("(with L = %d the layer stream cache gains nothing: N_LSC <= K_master, so Eq. 1-5 give at most L times\n"
               " the master alone, and a streamed block costs 2/L >= 1 own blocks; only in-place lending adds blocks)\n",
               s.geom.n_layers);
    rc = got[0] && got[1] && got[2] ? 0 : 1;
    if (plot_path) {
        /* the rows of the table as bars (a failed measurement is a bar of 0) */
        static const char *const labels[5] = {"master alone", "master + lenders", "stream (LSC+RC)",
                                              "Eq. 1-5 with lending", "Eq. 1-5 without lending"};
        const double x[5] = {0, 1, 2, 3, 4};
        const double y[5] = {(double)got[0], (double)got[1], (double)got[2], (double)p.max_ctx_tokens,
                             (double)p.no_lending_tokens};
        const kvb_plot_series ser[2] = {{.name = "measured", .x = x, .y = y, .n = 3, .bars = 1},
                                        {.name = "SwiftCache Eq. 1-5", .x = x + 3, .y = y + 3, .n = 2, .bars = 1}};
        const kvb_plot pl = {.title = "the master's longest context per configuration", .xlabel = "configuration",
                             .ylabel = "longest context (tokens)", .series = ser, .n_series = 2, .xtics = labels,
                             .n_xtics = 5};
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

/* The three arms, each on the same budget: the workers' memory attached and read in place (SwiftCache's
 * lending; same-GPU lending is the degenerate case of the paper's NVLink setup: no copy at all), the same
 * bytes as a host tier behind the prefix cache (HiCache / LMCache: copies over the host link), and the
 * master's own memory alone (no lending, no host tier). */
enum { ARM_LEND, ARM_HOST, ARM_ALONE, N_ARMS };
static const char *const arm_names[N_ARMS] = {"lending (in place)", "host tier (copies)", "master alone"};

typedef struct mt_opts {
    kvb_trace_opts to;
    int n_meas;           /* requests in the measured window */
    double start_s;       /* < 0: the window is the trace's last n_meas requests; else its first arrives at
                           * or after this trace time (after --rate) */
    double reclaim_every; /* lending: a lender reclaims (or lends back) every this many wall seconds; 0: never */
    double reclaim_frac;  /* of the lender's loan, rounded to whole MEUs (at least one) */
    int reps;
} mt_opts;

/* The measured window and its warm-up: the earlier turns of the sessions it measures. A measured request
 * that reuses a prefix continues the latest earlier request sharing the longest prefix with it (a
 * session's previous turn, or the request that brought the shared document); the warm-up replays those
 * that arrive before the window, so that the caches hold what the window's requests reuse as they
 * would in the trace's own run. */
typedef struct mt_window {
    int w0, w1;  /* measured: requests [w0, w1) */
    int *warm;   /* [n_warm] indices below w0, ascending */
    int n_warm;
} mt_window;

static int common_prefix(const kvb_trace_req *a, const kvb_trace_req *b) {
    int n = KVB_MIN(a->n_prompt, b->n_prompt), k = 0;
    while (k < n && a->prompt[k] == b->prompt[k]) k++;
    return k;
}

static kvb_status mt_window_make(const kvb_trace *tr, const mt_opts *mo, mt_window *w) {
    memset(w, 0, sizeof *w);
    int n = tr->n;
    if (mo->start_s < 0) {
        w->w1 = n;
        w->w0 = KVB_MAX(0, n - mo->n_meas);
    } else {
        while (w->w0 < n && tr->reqs[w->w0].t_s < mo->start_s) w->w0++;
        w->w1 = KVB_MIN(n, w->w0 + mo->n_meas);
    }
    if (w->w1 <= w->w0) {
        fprintf(stderr, "kvbank-bench multiturn: no request of the trace arrives after --start %g s\n", mo->start_s);
        return KVB_ERR_INVALID;
    }
    char *mark = NULL;
    KVB_TRY(kvb_calloc((size_t)n, 1, (void **)&mark));
    for (int i = w->w0; i < w->w1; i++) {
        const kvb_trace_req *q = &tr->reqs[i];
        if (q->reused_tokens <= 0) continue;
        int best = -1, len = 0;
        for (int j = i - 1; j >= 0 && len < q->reused_tokens; j--) {
            int c = common_prefix(q, &tr->reqs[j]);
            if (c > len) len = c, best = j;
        }
        if (best >= 0 && best < w->w0) mark[best] = 1;
    }
    for (int j = 0; j < w->w0; j++) w->n_warm += mark[j];
    kvb_status st = kvb_calloc((size_t)KVB_MAX(w->n_warm, 1), sizeof *w->warm, (void **)&w->warm);
    if (st == KVB_OK) {
        int k = 0;
        for (int j = 0; j < w->w0; j++)
            if (mark[j]) w->warm[k++] = j;
    }
    free(mark);
    return st;
}

/* One replay's figures (over the measured requests). */
typedef struct mt_result {
    int n, served, rejected;
    double ttft[3];      /* p50, p95, p99 in ms */
    uint64_t prefilled, hit, host_loads, preempted, stalled; /* hit: prompt tokens from the prefix caches */
    int reclaims, relends;
    int64_t reclaimed, lost, kept, demoted, moved; /* blocks; lost = cached blocks dropped by reclaims */
    uint64_t h_stores, h_ahead, h_waits; /* host-tier copies out, of which written back ahead, evictions waiting */
    kvb_link_report host;                /* what the host link carried (both directions) */
    uint64_t steps;                      /* engine steps in the window */
    int max_running;                     /* most requests running at once (warm-up included) */
    double wall_s;       /* the measured window's replay */
} mt_result;

/* The lenders' churn in the lending replay: lender i's loan starts whole (tag i+1); its first reclaim
 * takes the front `front` blocks back from that loan (a partial reclaim: the loan keeps its end), the
 * next event lends them back as a loan of their own, the one after reclaims that loan whole, and so on. */
typedef struct churn {
    int front;        /* master blocks the lender takes back each time (whole MEUs) */
    uint64_t front_tag; /* the front's own loan (0: not lent; the main loan still holds it while first_done is 0) */
    int first_done;
} churn;

static void add_detach(mt_result *r, const kvb_detach_stats *d, int blocks) {
    r->reclaims++;
    r->reclaimed += blocks;
    r->lost += d->dropped;
    r->kept += d->kept;
    r->demoted += d->demoted;
    r->moved += d->moved;
}

/* The next churn event, on lender `i` (between steps: the reclaim protocol's fence). */
static kvb_status churn_event(master_setup *s, kvb_engine *e, churn *c, int i, uint64_t *next_tag, mt_result *r) {
    lender *l = &s->lenders[i];
    kvb_detach_stats d = {0};
    if (!c->first_done) {
        KVB_TRY(kvb_engine_detach_front(e, (uint64_t)i + 1, c->front, 0, &d));
        c->first_done = 1;
        add_detach(r, &d, c->front);
    } else if (c->front_tag) {
        KVB_TRY(kvb_engine_detach(e, c->front_tag, 0, &d));
        c->front_tag = 0;
        add_detach(r, &d, c->front);
    } else {
        uint64_t tag = (*next_tag)++;
        KVB_TRY(kvb_engine_attach(e, tag, kvb_mem_region_base(l->region), (size_t)c->front * kvb_kv_block_bytes(&s->geom),
                                  c->front));
        c->front_tag = tag;
        r->relends++;
    }
    return KVB_OK;
}

static void mt_add(kvb_engine *e, const kvb_trace *tr, int i, int *rejected) {
    const kvb_trace_req *q = &tr->reqs[i];
    kvb_request r = {.id = (uint64_t)i, .prompt = q->prompt, .n_prompt = q->n_prompt, .max_tokens = q->max_tokens};
    if (kvb_engine_add(e, &r) != KVB_OK) (*rejected)++;
}

/* Replays the window of `tr` once on a fresh engine of `arm` (ARM_HOST: a host tier of `lent_blocks`):
 * the warm-up queued at once and run to the end, then the window open loop on the wall clock. The
 * measured requests' TTFTs (ms) go to ttft_ms[0..out->served), sorted. */
static kvb_status mt_run(master_setup *s, const kvb_trace *tr, const mt_opts *mo, const mt_window *w, int arm,
                         int lent_blocks, double *ttft_ms, mt_result *out) {
    int n = tr->n;
    mt_state ms = {0};
    kvb_engine_stats s0 = {0}; /* at the end of the warm-up */
    kvb_status st = KVB_ERR_NOMEM;
    kvb_engine *e = NULL;
    memset(out, 0, sizeof *out);
    if (kvb_calloc((size_t)n, sizeof(double), (void **)&ms.arrival) ||
        kvb_calloc((size_t)n, sizeof(double), (void **)&ms.ttft))
        goto out;
    for (int i = 0; i < n; i++) ms.ttft[i] = NAN;
    kvb_engine_events ev = {.ud = &ms, .on_token = mt_token, .on_finish = mt_finish};
    KVB_TRY_GOTO(make_engine(s, arm == ARM_LEND, arm == ARM_HOST ? lent_blocks : 0, 0, &ev, &e), out);
    churn ch[16] = {{0}};
    for (int i = 0; i < s->n_lenders; i++) {
        const lender *l = &s->lenders[i];
        int units = l->n_master_blocks / KVB_MAX(1, l->meu_master);
        ch[i].front = KVB_MAX(1, (int)(units * mo->reclaim_frac)) * l->meu_master;
        if (ch[i].front >= l->n_master_blocks) ch[i].front = l->n_master_blocks - l->meu_master; /* 0: one MEU */
    }
    uint64_t next_tag = (uint64_t)s->n_lenders + 1;
    int churn_on = 0, who = 0; /* churn only lenders whose loan has more than one MEU */
    for (int i = 0; i < s->n_lenders; i++) churn_on |= ch[i].front > 0;
    churn_on = churn_on && arm == ARM_LEND && mo->reclaim_every > 0;
    int n_meas = w->w1 - w->w0, rejected_warm = 0;
    kvb_progress pg; /* a progress line on a terminal (common/util/progress.h) */
    char what[96];
    snprintf(what, sizeof what, "multiturn, %s", arm_names[arm]);
    kvb_progress_begin(&pg, what, (uint64_t)(w->n_warm + n_meas), KVB_PROGRESS_COUNT);
    /* the warm-up: queued at once in arrival order (FCFS serves them in that order), run to the end */
    for (int k = 0; k < w->n_warm; k++) mt_add(e, tr, w->warm[k], &rejected_warm);
    while (kvb_engine_n_live(e) > 0) {
        kvb_progress_update(&pg, (uint64_t)(ms.done + rejected_warm));
        KVB_TRY_GOTO(kvb_engine_step(e), out_pg);
    }
    kvb_engine_get_stats(e, &s0);
    int done0 = ms.done + rejected_warm;
    /* the measured window, open loop on the wall clock: the first measured arrival is now */
    const double t_meas = tr->reqs[w->w0].t_s;
    double t0 = kvb_now_s() - t_meas, next_churn = t_meas + mo->reclaim_every;
    int next = w->w0;
    while (ms.done + rejected_warm - done0 + out->rejected < n_meas) {
        kvb_progress_update(&pg, (uint64_t)(ms.done + rejected_warm + out->rejected));
        double now = kvb_now_s() - t0;
        while (next < w->w1 && tr->reqs[next].t_s <= now) {
            ms.arrival[next] = t0 + tr->reqs[next].t_s;
            mt_add(e, tr, next, &out->rejected);
            next++;
        }
        if (churn_on && now >= next_churn && next < w->w1) { /* lenders reclaim while requests still arrive */
            while (ch[who].front <= 0) who = (who + 1) % s->n_lenders;
            KVB_TRY_GOTO(churn_event(s, e, &ch[who], who, &next_tag, out), out_pg);
            who = (who + 1) % s->n_lenders;
            next_churn += mo->reclaim_every;
        }
        if (kvb_engine_n_live(e) > 0) {
            KVB_TRY_GOTO(kvb_engine_step(e), out_pg);
        } else if (next < w->w1) {
            double wait = KVB_MIN(tr->reqs[next].t_s, churn_on ? next_churn : 1e300) - (kvb_now_s() - t0);
            if (wait > 0) {
                struct timespec ts = {.tv_sec = (time_t)wait, .tv_nsec = (long)((wait - (time_t)wait) * 1e9)};
                nanosleep(&ts, NULL);
            }
        }
    }
    out->wall_s = kvb_now_s() - t0 - t_meas;
    st = KVB_OK;
out_pg:
    if (st != KVB_OK) kvb_progress_cancel(&pg);
    else kvb_progress_end(&pg);
    if (st == KVB_OK) {
        kvb_engine_stats s1;
        kvb_engine_get_stats(e, &s1);
        out->prefilled = s1.prompt_tokens - s0.prompt_tokens;
        out->host_loads = s1.host_tier_loads - s0.host_tier_loads;
        out->hit = s1.prefix_hit_tokens - s0.prefix_hit_tokens;
        out->preempted = s1.preemptions - s0.preemptions;
        out->stalled = s1.stalled_failed - s0.stalled_failed;
        out->steps = s1.steps - s0.steps;
        out->max_running = s1.max_running;
        out->h_stores = s1.host_tier_stores - s0.host_tier_stores;
        out->h_ahead = s1.host_tier_stores_ahead - s0.host_tier_stores_ahead;
        out->h_waits = s1.host_tier_wb_waits - s0.host_tier_wb_waits;
        out->host.bytes = s1.links[KVB_LINK_HOST].bytes - s0.links[KVB_LINK_HOST].bytes;
        out->host.copies = s1.links[KVB_LINK_HOST].copies - s0.links[KVB_LINK_HOST].copies;
        out->host.busy_ns = s1.links[KVB_LINK_HOST].busy_ns - s0.links[KVB_LINK_HOST].busy_ns;
        for (int i = w->w0; i < w->w1; i++) {
            out->n++;
            if (!isnan(ms.ttft[i])) ttft_ms[out->served++] = ms.ttft[i] * 1e3;
        }
        const double ps[3] = {50, 95, 99};
        for (int q = 0; q < 3; q++) out->ttft[q] = kvb_bench_pct(ttft_ms, out->served, ps[q]);
    }
out:
    kvb_engine_destroy(e);
    free(ms.arrival);
    free(ms.ttft);
    return st;
}

static void mt_print_run(const char *name, int rep, const mt_result *r, int64_t prompt) {
    printf("%-20s %3d %6d %6d %9.1f %9.1f %9.1f %10llu %8.1f %8llu %8llu %7.1f", name, rep + 1, r->n, r->served,
           r->ttft[0], r->ttft[1], r->ttft[2], (unsigned long long)r->prefilled,
           prompt ? 100.0 * (double)r->hit / (double)prompt : 0, (unsigned long long)r->host_loads,
           (unsigned long long)r->preempted, r->wall_s);
    if (r->reclaims)
        printf("  %d reclaims (%lld blocks): %lld cached lost, %lld kept, %lld moved live", r->reclaims,
               (long long)r->reclaimed, (long long)r->lost, (long long)r->kept, (long long)r->moved);
    printf("  %llu steps (window / steps: %.2f ms), at most %d running", (unsigned long long)r->steps,
           r->steps ? r->wall_s * 1e3 / (double)r->steps : 0, r->max_running);
    if (r->h_stores || r->host.copies)
        printf("  host link: %.1f MB in %llu copies, busy %.2f s; %llu blocks copied out (%llu written back ahead, %llu "
               "evictions waited for one)", (double)r->host.bytes / 1e6, (unsigned long long)r->host.copies,
               (double)r->host.busy_ns / 1e9, (unsigned long long)r->h_stores, (unsigned long long)r->h_ahead,
               (unsigned long long)r->h_waits);
    if (r->rejected || r->stalled) printf("  (%d rejected, %llu stalled)", r->rejected, (unsigned long long)r->stalled);
    printf("\n");
}

static void usage_multiturn(FILE *f) {
    fprintf(f,
            "usage: kvbank-bench multiturn --config NODE.json --trace MOONCAKE.jsonl [options]\n"
            "  open-loop replay of the trace's multi-turn sessions on the master, three arms of the same budget side by\n"
            "  side in every repetition (in turn, the order rotating): lending (the workers' memory attached, read in\n"
            "  place, lenders reclaiming and lending back during the run), a host-tier prefix cache of the same bytes\n"
            "  (copies over the host link), and the master's own memory alone\n"
            "  --link PRESET       the stager's link model (default h20-nvlink-scaled, SwiftCache's testbed, on the CPU;\n"
            "                      off on a GPU; 'list' names them)\n"
            KVB_BENCH_DEV_USAGE
            "                      (default: the master's backend in the node config)\n"
            "  --requests N        measured requests, each P99 over them (default 1000)\n"
            "  --start S           the window starts at trace time S (after --rate); default: it ends with the trace,\n"
            "                      where the trace reuses most. The warm-up replays the earlier turns of the sessions\n"
            "                      measured (queued at once, not counted)\n"
            "  --rate X            arrival rate multiplier (default 5)\n"
            "  --len-scale S       prompt tokens per trace token (default 1/32: a 512-token hash block of the trace is\n"
            "                      one 16-token block)\n"
            "  --max-output N      cap on output tokens (default 32)\n"
            "  --reclaim-every S   a lender reclaims or lends back every S s, round robin (default 2; 0: never)\n"
            "  --reclaim-frac F    share of a lender's loan each reclaim takes, whole MEUs (default 0.5)\n"
            "  --reps N            repetitions, medians and min-max printed (default 3)\n"
            "  --host-load MODE    how the host-tier arm loads its hits: layered (default: layer by layer behind the\n"
            "                      compute, as HiCache and LMCache do) or whole (all of them before the step)\n"
            "  --host-writeback M  how it copies cached blocks out: async (default: written back ahead of eviction on\n"
            "                      the link's from-device queue, as HiCache and LMCache do) or sync (each block when\n"
            "                      evicted, before the step computes)\n"
            "  --threads N  --plot FILE.svg (the TTFT CDFs of the last repetition, gnuplot)\n");
}

int kvb_bench_multiturn(int argc, char **argv) {
    const char *cfg = NULL, *trace = NULL, *plot_path = NULL, *link = NULL, *host_load = "layered", *host_wb = "async";
    kvb_bench_dev dev = KVB_BENCH_DEV_DEFAULT;
    dev.backend = NULL;
    mt_opts mo = {.to = {.rate_scale = 5, .len_scale = 1.0 / 32, .min_output = 1, .max_output = 32},
                  .n_meas = 1000, .start_s = -1, .reclaim_every = 2, .reclaim_frac = 0.5, .reps = 3};
    static const struct option opts[] = {{"config", 1, 0, 'c'},   {"trace", 1, 0, 'T'},     {"threads", 1, 0, 't'},
                                         {"rate", 1, 0, 'r'},     {"len-scale", 1, 0, 's'}, {"requests", 1, 0, 'n'},
                                         {"max-output", 1, 0, 'o'}, {"help", 0, 0, 'h'},    {"plot", 1, 0, 'P'},
                                         {"link", 1, 0, 'l'},     {"start", 1, 0, 'S'},     {"reclaim-every", 1, 0, 'e'},
                                         {"reclaim-frac", 1, 0, 'f'}, {"reps", 1, 0, 'R'}, {"backend", 1, 0, 'B'},
                                         {"host-load", 1, 0, 'H'}, {"device", 1, 0, 'D'},  {"host-writeback", 1, 0, 'W'},
                                         {0, 0, 0, 0}};
    int ch;
    int64_t v;
    while ((ch = getopt_long(argc, argv, "h", opts, NULL)) != -1) {
        int d = kvb_bench_dev_opt(&dev, ch, optarg, "kvbank-bench multiturn");
        if (d == 2) return 2;
        if (d) continue;
        kvb_status st = KVB_OK;
        if (ch == 'c') cfg = optarg;
        else if (ch == 'T') trace = optarg;
        else if (ch == 'P') plot_path = optarg;
        else if (ch == 'l') link = optarg;
        else if (ch == 'H') { host_load = optarg; st = strcmp(optarg, "layered") && strcmp(optarg, "whole") ? KVB_ERR_INVALID : KVB_OK; }
        else if (ch == 'W') { host_wb = optarg; st = strcmp(optarg, "async") && strcmp(optarg, "sync") ? KVB_ERR_INVALID : KVB_OK; }
        else if (ch == 't') { st = kvb_parse_i64(optarg, 1, 256, &v); dev.threads = (int)v; }
        else if (ch == 'r') st = kvb_parse_f64(optarg, &mo.to.rate_scale);
        else if (ch == 's') st = kvb_parse_f64(optarg, &mo.to.len_scale);
        else if (ch == 'n') { st = kvb_parse_i64(optarg, 1, 1 << 24, &v); mo.n_meas = (int)v; }
        else if (ch == 'S') { st = kvb_parse_f64(optarg, &mo.start_s); if (mo.start_s < 0) st = KVB_ERR_INVALID; }
        else if (ch == 'e') st = kvb_parse_f64(optarg, &mo.reclaim_every);
        else if (ch == 'f') st = kvb_parse_f64(optarg, &mo.reclaim_frac);
        else if (ch == 'o') { st = kvb_parse_i64(optarg, 1, 1 << 20, &v); mo.to.max_output = (int)v; }
        else if (ch == 'R') { st = kvb_parse_i64(optarg, 1, 64, &v); mo.reps = (int)v; }
        else {
            usage_multiturn(ch == 'h' ? stdout : stderr);
            return ch == 'h' ? 0 : 2;
        }
        if (st != KVB_OK || mo.to.rate_scale <= 0 || mo.to.len_scale <= 0 || mo.reclaim_every < 0 ||
            mo.reclaim_frac <= 0 || mo.reclaim_frac >= 1) {
            fprintf(stderr, "kvbank-bench multiturn: bad value '%s'\n", optarg);
            return 2;
        }
    }
    if (link && !strcmp(link, "list")) {
        kvb_link_preset_list(stdout);
        return 0;
    }
    if (!cfg || !trace) {
        fprintf(stderr, "kvbank-bench multiturn: --config and --trace are required\n");
        return 2;
    }
    master_setup s;
    kvb_trace *tr = NULL;
    mt_window w = {0};
    int rc = 1;
    double *keep[N_ARMS] = {0}; /* the served TTFTs of each arm's latest replay, ms */
    static mt_result res[64][N_ARMS];
    double t_start = kvb_now_s();
    printf("kvbank-bench multiturn: %s on the master of %s\n", trace, cfg);
    /* the link model's point: SwiftCache's Fig. 1 (256 new tokens over 5K of history), scaled like the trace */
    const double paper_ctx = 5000, paper_q = 256;
    kvb_link_point pt = {.batch = 1, .q = (int)KVB_MAX(1, lround(paper_q * mo.to.len_scale)),
                         .ctx = paper_ctx * mo.to.len_scale, .target_ctx = paper_ctx, .target_q = paper_q};
    if (setup(cfg, &dev, link, "h20-nvlink-scaled", &pt, &s) != KVB_OK) goto out;
    /* Fig. 1: PCIe loading about 75 ms against 27 ms of compute at 5K history */
    const double paper_regime = 75.0 / 27.0;
    double regime = kvb_link_regime(&s.links, KVB_LINK_HOST, 1);
    int far = s.links.target_layers && kvb_link_regime_far(regime, paper_regime);
    printf("  ");
    kvb_link_regime_print(stdout, &s.links, KVB_LINK_HOST, paper_regime,
                          "Fig. 1: LWM-1M-Text on an H20, 256 new tokens over 5K, PCIe 4.0 75 ms / compute 27 ms");
    s.host_whole = !strcmp(host_load, "whole");
    s.host_sync_wb = !strcmp(host_wb, "sync");
    mo.to.vocab = kvb_model_cfg(s.m)->vocab;
    int lent_blocks = 0;
    for (int i = 0; i < s.n_lenders; i++) lent_blocks += s.lenders[i].n_master_blocks;
    int own_blocks = (int)(s.nm->kv_bytes / (int64_t)kvb_kv_block_bytes(&s.geom));
    mo.to.max_len = (int)KVB_MIN((int64_t)kvb_model_cfg(s.m)->max_pos, (int64_t)own_blocks * s.nm->block_size);
    if (kvb_trace_load(trace, &mo.to, &tr) != KVB_OK) goto out;
    if (mt_window_make(tr, &mo, &w) != KVB_OK) goto out;
    int n = tr->n, n_meas = w.w1 - w.w0;
    for (int k = 0; k < N_ARMS; k++)
        if (kvb_calloc((size_t)n, sizeof(double), (void **)&keep[k]) != KVB_OK) goto out;
    /* the window: its reusable share (prompt tokens an earlier request of the trace had: what a cache that
     * never forgets would hit) and its working set, against the master's own memory */
    int64_t prompt = 0, reused = 0, warm_prompt = 0;
    for (int i = w.w0; i < w.w1; i++) {
        prompt += tr->reqs[i].n_prompt;
        reused += tr->reqs[i].reused_tokens;
    }
    for (int k = 0; k < w.n_warm; k++) warm_prompt += tr->reqs[w.warm[k]].n_prompt;
    printf("  %d requests in %d sessions over %.1f s (rate x%g, len-scale %g); measured: requests %d..%d (%d, arriving "
           "over %.1f s from trace time %.1f s); warm-up: the %d earlier turns of their sessions (%lld prompt tokens)\n",
           n, tr->n_sessions, tr->reqs[n - 1].t_s, mo.to.rate_scale, mo.to.len_scale, w.w0, w.w1 - 1, n_meas,
           tr->reqs[w.w1 - 1].t_s - tr->reqs[w.w0].t_s, tr->reqs[w.w0].t_s, w.n_warm, (long long)warm_prompt);
    printf("  offered reuse (measured prompt tokens whose blocks an earlier request of the trace had): %.1f%% (%lld of "
           "%lld); new prompt tokens %lld = %lld blocks, against the master's own %d blocks and own + lent %d\n",
           prompt ? 100.0 * (double)reused / (double)prompt : 0, (long long)reused, (long long)prompt,
           (long long)(prompt - reused), (long long)((prompt - reused) / s.nm->block_size), own_blocks,
           own_blocks + lent_blocks);
    printf("  lenders give %d master blocks (the host-tier arm: the same bytes, its hits loaded %s, its blocks %s); ",
           lent_blocks, s.host_whole ? "whole before the step" : "layer by layer behind the compute",
           s.host_sync_wb ? "copied out when evicted" : "written back ahead of eviction, asynchronously");
    if (mo.reclaim_every > 0)
        printf("each %.1f s a lender (round robin) reclaims %.0f%% of its loan or lends it back\n", mo.reclaim_every,
               mo.reclaim_frac * 100);
    else
        printf("lenders never reclaim\n");
    if (n_meas < 1000) printf("  NOTE: %d requests behind each P99, fewer than 1,000 (a reduced run)\n", n_meas);
    printf("\nTTFT (ms) per replay%s\n", far ? " -- THE LINK MODEL'S REGIME IS MORE THAN 2x AWAY FROM THE PAPER'S" : "");
    printf("%-20s %3s %6s %6s %9s %9s %9s %10s %8s %8s %8s %7s\n", "arm", "rep", "n", "served", "p50", "p95", "p99",
           "prefilled", "reuse %", "h-loads", "preempt", "wall s");
    fflush(stdout);
    for (int rep = 0; rep < mo.reps; rep++)
        for (int k = 0; k < N_ARMS; k++) {
            int arm = (rep + k) % N_ARMS; /* the order rotates: no arm always runs first on a drifting machine */
            if (mt_run(&s, tr, &mo, &w, arm, lent_blocks, keep[arm], &res[rep][arm]) != KVB_OK) {
                fprintf(stderr, "kvbank-bench multiturn: the %s replay failed\n", arm_names[arm]);
                goto out;
            }
            mt_print_run(arm_names[arm], rep, &res[rep][arm], prompt);
            fflush(stdout);
        }
    /* the summary: medians and min-max over the repetitions */
    double a[64], b[64], c[64], d[64];
    char t1[64], t2[64], t3[64], t4[64];
    printf("\nover %d repetitions, median [min-max]; wall-clock on a loaded shared CPU under the link model%s\n", mo.reps,
           far ? " -- THE REGIME IS MORE THAN 2x AWAY FROM THE PAPER'S" : "");
    printf("(n: %d requests behind each percentile; prefilled: prompt tokens computed in the window, recomputation\n"
           " included; reuse: prompt tokens served from the prefix caches, host tier included / measured prompt tokens,\n"
           " the trace offering %.1f%%; h-loads: host-tier blocks loaded)\n",
           n_meas, prompt ? 100.0 * (double)reused / (double)prompt : 0);
    printf("%-20s %24s %24s %24s %24s\n", "", "TTFT p50 (ms)", "TTFT p99 (ms)", "prefilled tokens", "reuse %");
    for (int arm = 0; arm < N_ARMS; arm++) {
        for (int r = 0; r < mo.reps; r++) {
            a[r] = res[r][arm].ttft[0];
            b[r] = res[r][arm].ttft[2];
            c[r] = (double)res[r][arm].prefilled;
            d[r] = prompt ? 100.0 * (double)res[r][arm].hit / (double)prompt : 0;
        }
        printf("%-20s %24s %24s %24s %24s\n", arm_names[arm], kvb_bench_spread_str(a, mo.reps, 1, t1, sizeof t1),
               kvb_bench_spread_str(b, mo.reps, 1, t2, sizeof t2), kvb_bench_spread_str(c, mo.reps, 0, t3, sizeof t3),
               kvb_bench_spread_str(d, mo.reps, 1, t4, sizeof t4));
    }
    for (int other = ARM_HOST; other <= ARM_ALONE; other++) {
        for (int r = 0; r < mo.reps; r++) {
            a[r] = res[r][other].ttft[2] / res[r][ARM_LEND].ttft[2];
            b[r] = 100.0 * (1 - res[r][ARM_LEND].ttft[2] / res[r][other].ttft[2]);
        }
        printf("P99 TTFT %s / lending: %s (lending's P99 %s%% lower; the paper: %s)\n", arm_names[other],
               kvb_bench_spread_str(a, mo.reps, 2, t1, sizeof t1), kvb_bench_spread_str(b, mo.reps, 1, t2, sizeof t2),
               other == ARM_HOST ? "54-58% lower than vLLM + LMCache, 67-69% than SGLang + HiCache (Fig. 7)"
                                 : "not measured; its baselines all offload to host memory");
    }
    for (int r = 0; r < mo.reps; r++) a[r] = reused ? 100.0 * (double)res[r][ARM_LEND].hit / (double)reused : 0;
    printf("lending achieved %s%% of the reuse the trace offers (%.1f%% of the measured prompt tokens)\n",
           kvb_bench_spread_str(a, mo.reps, 1, t1, sizeof t1), prompt ? 100.0 * (double)reused / (double)prompt : 0);
    if (mo.reclaim_every > 0) {
        int64_t rb = 0, lost = 0;
        for (int r = 0; r < mo.reps; r++) {
            a[r] = res[r][ARM_LEND].reclaimed ? (double)res[r][ARM_LEND].lost / (double)res[r][ARM_LEND].reclaimed : 0;
            rb += res[r][ARM_LEND].reclaimed;
            lost += res[r][ARM_LEND].lost;
        }
        printf("cached blocks lost per reclaimed block (lending): %s (%lld lost of %lld reclaimed in all)\n",
               kvb_bench_spread_str(a, mo.reps, 3, t1, sizeof t1), (long long)lost, (long long)rb);
    }
    printf("run time: %.0f s\n", kvb_now_s() - t_start);
    rc = 0;
    if (plot_path) { /* the TTFT CDFs of the last repetition (keep[] holds them, sorted) */
        kvb_plot_series ser[N_ARMS];
        double *xy[N_ARMS] = {0};
        static const char *const labels[N_ARMS] = {"lending (workers' blocks in place)", "host-tier prefix cache (copies)",
                                                   "master alone (own memory)"};
        for (int arm = 0; arm < N_ARMS; arm++) {
            int m = res[mo.reps - 1][arm].served;
            if (kvb_calloc((size_t)(2 * m) + 1, sizeof(double), (void **)&xy[arm]) != KVB_OK) {
                rc = 1;
                break;
            }
            kvb_plot_cdf(keep[arm], (size_t)m, xy[arm], xy[arm] + m);
            ser[arm] = (kvb_plot_series){.name = labels[arm], .x = xy[arm], .y = xy[arm] + m, .n = (size_t)m, .steps = 1};
        }
        const kvb_plot pl = {.title = "multi-turn TTFT on the master: lending, a host tier of the same size, own memory",
                             .xlabel = "TTFT (ms)", .ylabel = "fraction of requests", .logx = 1, .series = ser,
                             .n_series = N_ARMS};
        if (rc == 0 && kvb_plot_svg(plot_path, &pl) != 0) rc = 1;
        for (int arm = 0; arm < N_ARMS; arm++) free(xy[arm]);
    }
out:
    for (int k = 0; k < N_ARMS; k++) free(keep[k]);
    free(w.warm);
    kvb_trace_free(tr);
    setup_free(&s);
    return rc;
}
