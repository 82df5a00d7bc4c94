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
static kvb_status setup(const char *cfg_path, int threads, const char *link, master_setup *s) {
    memset(s, 0, sizeof *s);
    KVB_TRY(kvb_node_config_load(cfg_path, &s->cfg));
    KVB_TRY(ensure_models(s->cfg));
    s->nm = kvb_node_config_master(s->cfg);
    if (!s->nm) return KVB_ERR_INVALID;
    KVB_TRY(kvb_backend_create(s->nm->backend, threads, &s->be));
    KVB_TRY(kvb_model_load(s->nm->model_dir, s->be, &s->m));
    s->geom = kvb_model_kv_geom(s->m, s->nm->block_size);
    KVB_TRY(kvb_link_preset(link, s->be, &s->links));
    printf("  ");
    kvb_link_model_print(stdout, &s->links);
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
    char kv[2][64] = {"", ""};
    const char *policy = NULL;
    if (host_tier_blocks > 0) { /* the baseline: the host-tier planner with a host tier of the lent blocks' bytes */
        policy = "host-tier";
        snprintf(kv[0], sizeof kv[0], "blocks=%d", host_tier_blocks);
        snprintf(kv[1], sizeof kv[1], "layered=%d", !s->host_whole);
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
        for (int k = 0; k < 2 && st == KVB_OK; k++)
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
               "  --link PRESET     the stager's link model (default h100-pcie5-scaled; 'list' names them)\n"
               "  --plot FILE.svg   draw a bar chart with gnuplot: the longest context of every configuration\n"
               "  the master's and workers' models and KV budgets come from the node config; give the master\n"
               "  model a max_position_embeddings above what its memory holds (kvbank-mkmodel --max-pos)\n");
}

int kvb_bench_maxctx(int argc, char **argv) {
    const char *cfg = NULL, *plot_path = NULL, *link = "h100-pcie5-scaled";
    int threads = 2;
    static const struct option opts[] = {{"config", 1, 0, 'c'}, {"threads", 1, 0, 't'}, {"plot", 1, 0, 'P'},
                                         {"link", 1, 0, 'l'},   {"help", 0, 0, 'h'},    {0, 0, 0, 0}};
    int ch;
    int64_t v;
    while ((ch = getopt_long(argc, argv, "h", opts, NULL)) != -1) {
        if (ch == 'c') cfg = optarg;
        else if (ch == 'P') plot_path = optarg;
        else if (ch == 'l') link = optarg;
        else if (ch == 't' && kvb_parse_i64(optarg, 1, 256, &v) == KVB_OK) threads = (int)v;
        else {
            usage_maxctx(ch == 'h' ? stdout : stderr);
            return ch == 'h' ? 0 : 2;
        }
    }
    if (!strcmp(link, "list")) {
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
    if (setup(cfg, threads, link, &s) != KVB_OK) goto out;
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

typedef struct mt_opts {
    kvb_trace_opts to;
    double skip_s;        /* requests arriving before are not replayed (the trace's reuse still counts them) */
    double warmup_s;      /* requests arriving before are replayed but not counted */
    double reclaim_every; /* lending: a lender reclaims (or lends back) every this many wall seconds; 0: never */
    double reclaim_frac;  /* of the lender's loan, rounded to whole MEUs (at least one) */
    int reps;
} mt_opts;

/* One replay's figures (over the requests arriving after the warm-up). */
typedef struct mt_result {
    int n, served, rejected;
    double ttft[3];      /* p50, p95, p99 in ms */
    uint64_t prefilled, hit, host_loads, preempted, stalled; /* hit: prompt tokens from the prefix caches */
    int reclaims, relends;
    int64_t reclaimed, lost, kept, demoted, moved; /* blocks; lost = cached blocks dropped by reclaims */
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

/* Replays `tr` once on a fresh engine: lending (mode 0: the workers' memory attached, in place, with
 * churn) or the host-tier baseline of `lent_blocks` (mode 1). The measured requests' TTFTs (ms) go to
 * ttft_ms[0..out->served), sorted. */
static kvb_status mt_run(master_setup *s, const kvb_trace *tr, const mt_opts *mo, int mode, int lent_blocks,
                         double *ttft_ms, mt_result *out) {
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
    KVB_TRY_GOTO(make_engine(s, mode == 0, mode == 1 ? lent_blocks : 0, 0, &ev, &e), out);
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
    churn_on = churn_on && mode == 0 && mo->reclaim_every > 0;
    int next = 0, rejected_warm = 0;
    while (next < n && tr->reqs[next].t_s < mo->skip_s) next++;
    rejected_warm = next; /* skipped: never replayed */
    kvb_progress pg; /* a progress line on a terminal (common/util/progress.h) */
    char what[96];
    snprintf(what, sizeof what, "multiturn, %s", mode ? "host tier" : "lending");
    kvb_progress_begin(&pg, what, (uint64_t)n, KVB_PROGRESS_COUNT);
    /* the warm-up: the requests arriving before warmup_s, queued at once in arrival order (FCFS serves
     * them in that order) and run to the end: it fills the caches as the trace's earlier part would */
    const double t_meas = mo->skip_s + mo->warmup_s; /* trace time the measured window starts */
    for (; next < n && tr->reqs[next].t_s < t_meas; next++) {
        const kvb_trace_req *q = &tr->reqs[next];
        kvb_request r = {.id = (uint64_t)next, .prompt = q->prompt, .n_prompt = q->n_prompt, .max_tokens = q->max_tokens};
        if (kvb_engine_add(e, &r) != KVB_OK) rejected_warm++;
    }
    while (kvb_engine_n_live(e) > 0) {
        kvb_progress_update(&pg, (uint64_t)(ms.done + rejected_warm));
        KVB_TRY_GOTO(kvb_engine_step(e), out_pg);
    }
    kvb_engine_get_stats(e, &s0);
    /* the measured window, open loop on the wall clock: trace time t_meas is now */
    double t0 = kvb_now_s() - t_meas, next_churn = t_meas + mo->reclaim_every;
    while (ms.done + out->rejected + rejected_warm < n) {
        kvb_progress_update(&pg, (uint64_t)(ms.done + out->rejected + rejected_warm));
        double now = kvb_now_s() - t0;
        while (next < n && tr->reqs[next].t_s <= now) {
            const kvb_trace_req *q = &tr->reqs[next];
            ms.arrival[next] = t0 + q->t_s;
            kvb_request r = {.id = (uint64_t)next, .prompt = q->prompt, .n_prompt = q->n_prompt,
                             .max_tokens = q->max_tokens};
            if (kvb_engine_add(e, &r) != KVB_OK) out->rejected++;
            next++;
        }
        if (churn_on && now >= next_churn && next < n) { /* lenders reclaim while requests still arrive */
            while (ch[who].front <= 0) who = (who + 1) % s->n_lenders;
            KVB_TRY_GOTO(churn_event(s, e, &ch[who], who, &next_tag, out), out_pg);
            who = (who + 1) % s->n_lenders;
            next_churn += mo->reclaim_every;
        }
        if (kvb_engine_n_live(e) > 0) {
            KVB_TRY_GOTO(kvb_engine_step(e), out_pg);
        } else if (next < n) {
            double wait = KVB_MIN(tr->reqs[next].t_s, churn_on ? next_churn : 1e300) - (kvb_now_s() - t0);
            if (wait > 0) {
                struct timespec ts = {.tv_sec = (time_t)wait, .tv_nsec = (long)((wait - (time_t)wait) * 1e9)};
                nanosleep(&ts, NULL);
            }
        }
    }
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
        for (int i = 0; i < n; i++) {
            if (tr->reqs[i].t_s < t_meas) continue;
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

static void mt_print_run(const char *name, int rep, const mt_result *r) {
    printf("%-20s %3d %6d %6d %9.1f %9.1f %9.1f %10llu %9llu %8llu %8llu", name, rep + 1, r->n, r->served, r->ttft[0],
           r->ttft[1], r->ttft[2], (unsigned long long)r->prefilled, (unsigned long long)r->hit,
           (unsigned long long)r->host_loads, (unsigned long long)r->preempted);
    if (r->reclaims)
        printf("  %d reclaims (%lld blocks): %lld cached lost, %lld kept, %lld moved live", r->reclaims,
               (long long)r->reclaimed, (long long)r->lost, (long long)r->kept, (long long)r->moved);
    if (r->rejected || r->stalled) printf("  (%d rejected, %llu stalled)", r->rejected, (unsigned long long)r->stalled);
    printf("\n");
}

static void usage_multiturn(FILE *f) {
    fprintf(f,
            "usage: kvbank-bench multiturn --config NODE.json --trace MOONCAKE.jsonl [options]\n"
            "  open-loop replay of the trace's multi-turn sessions on the master: lending (the workers' memory\n"
            "  attached, read in place, lenders reclaiming and lending back during the run) against a host-tier\n"
            "  prefix cache of the same bytes (copies over the host link), side by side in every repetition\n"
            "  --link PRESET       the stager's link model (default h100-pcie5-scaled; 'list' names them)\n"
            "  --rate X            arrival rate multiplier (default 5)\n"
            "  --len-scale S       prompt tokens per trace token (default 1/128)\n"
            "  --skip S            the requests of the first S s (after --rate) are not replayed; the reusable share\n"
            "                      still counts what they had (default 30: the window sits where the trace reuses most)\n"
            "  --warmup S          the next S s of requests run first, queued at once in arrival order, not counted:\n"
            "                      they fill the caches (default 5)\n"
            "  --duration S        the measured window after the warm-up, s (default 60)\n"
            "  --max-output N      cap on output tokens (default 32)\n"
            "  --reclaim-every S   a lender reclaims or lends back every S s, round robin (default 2; 0: never)\n"
            "  --reclaim-frac F    share of a lender's loan each reclaim takes, whole MEUs (default 0.5)\n"
            "  --reps N            repetitions, medians and min-max printed (default 3)\n"
            "  --host-load MODE    how the host-tier baseline loads its hits: layered (default: layer by layer\n"
            "                      behind the compute, as the paper's baseline) or whole (all of them before the step)\n"
            "  --threads N  --plot FILE.svg (the TTFT CDFs of the last repetition, gnuplot)\n");
}

int kvb_bench_multiturn(int argc, char **argv) {
    const char *cfg = NULL, *trace = NULL, *plot_path = NULL, *link = "h100-pcie5-scaled", *host_load = "layered";
    int threads = 2;
    double duration = 60;
    mt_opts mo = {.to = {.rate_scale = 5, .len_scale = 1.0 / 128, .min_output = 1, .max_output = 32},
                  .skip_s = 30, .warmup_s = 5, .reclaim_every = 2, .reclaim_frac = 0.5, .reps = 3};
    static const struct option opts[] = {{"config", 1, 0, 'c'},   {"trace", 1, 0, 'T'},     {"threads", 1, 0, 't'},
                                         {"rate", 1, 0, 'r'},     {"len-scale", 1, 0, 's'}, {"duration", 1, 0, 'd'},
                                         {"max-output", 1, 0, 'o'}, {"help", 0, 0, 'h'},    {"plot", 1, 0, 'P'},
                                         {"link", 1, 0, 'l'},     {"warmup", 1, 0, 'w'},    {"reclaim-every", 1, 0, 'e'},
                                         {"reclaim-frac", 1, 0, 'f'}, {"reps", 1, 0, 'R'}, {"skip", 1, 0, 'S'},
                                         {"host-load", 1, 0, 'H'}, {0, 0, 0, 0}};
    int ch;
    int64_t v;
    while ((ch = getopt_long(argc, argv, "h", opts, NULL)) != -1) {
        kvb_status st = KVB_OK;
        if (ch == 'c') cfg = optarg;
        else if (ch == 'T') trace = optarg;
        else if (ch == 'P') plot_path = optarg;
        else if (ch == 'l') link = optarg;
        else if (ch == 'H') { host_load = optarg; st = strcmp(optarg, "layered") && strcmp(optarg, "whole") ? KVB_ERR_INVALID : KVB_OK; }
        else if (ch == 't') { st = kvb_parse_i64(optarg, 1, 256, &v); threads = (int)v; }
        else if (ch == 'r') st = kvb_parse_f64(optarg, &mo.to.rate_scale);
        else if (ch == 's') st = kvb_parse_f64(optarg, &mo.to.len_scale);
        else if (ch == 'd') st = kvb_parse_f64(optarg, &duration);
        else if (ch == 'w') st = kvb_parse_f64(optarg, &mo.warmup_s);
        else if (ch == 'S') st = kvb_parse_f64(optarg, &mo.skip_s);
        else if (ch == 'e') st = kvb_parse_f64(optarg, &mo.reclaim_every);
        else if (ch == 'f') st = kvb_parse_f64(optarg, &mo.reclaim_frac);
        else if (ch == 'o') { st = kvb_parse_i64(optarg, 1, 1 << 20, &v); mo.to.max_output = (int)v; }
        else if (ch == 'R') { st = kvb_parse_i64(optarg, 1, 64, &v); mo.reps = (int)v; }
        else {
            usage_multiturn(ch == 'h' ? stdout : stderr);
            return ch == 'h' ? 0 : 2;
        }
        if (st != KVB_OK || mo.to.rate_scale <= 0 || mo.to.len_scale <= 0 || duration <= 0 || mo.warmup_s < 0 || mo.skip_s < 0 ||
            mo.reclaim_every < 0 || mo.reclaim_frac <= 0 || mo.reclaim_frac >= 1) {
            fprintf(stderr, "kvbank-bench multiturn: bad value '%s'\n", optarg);
            return 2;
        }
    }
    if (!strcmp(link, "list")) {
        kvb_link_preset_list(stdout);
        return 0;
    }
    if (!cfg || !trace) {
        fprintf(stderr, "kvbank-bench multiturn: --config and --trace are required\n");
        return 2;
    }
    master_setup s;
    kvb_trace *tr = NULL;
    int rc = 1;
    double *keep[2] = {0}; /* the served TTFTs of each arm's latest replay, ms */
    mt_result res[64][2];
    printf("kvbank-bench multiturn: %s on the master of %s\n", trace, cfg);
    if (setup(cfg, threads, link, &s) != KVB_OK) goto out;
    s.host_whole = !strcmp(host_load, "whole");
    mo.to.vocab = kvb_model_cfg(s.m)->vocab;
    mo.to.max_time_s = mo.skip_s + mo.warmup_s + duration;
    int lent_blocks = 0;
    for (int i = 0; i < s.n_lenders; i++) lent_blocks += s.lenders[i].n_master_blocks;
    int own_blocks = (int)(s.nm->kv_bytes / (int64_t)kvb_kv_block_bytes(&s.geom));
    mo.to.max_len = (int)KVB_MIN((int64_t)kvb_model_cfg(s.m)->max_pos, (int64_t)own_blocks * s.nm->block_size);
    if (kvb_trace_load(trace, &mo.to, &tr) != KVB_OK) goto out;
    int n = tr->n;
    if (kvb_calloc((size_t)n, sizeof(double), (void **)&keep[0]) ||
        kvb_calloc((size_t)n, sizeof(double), (void **)&keep[1]))
        goto out;
    /* the measured window: its reusable share (prompt tokens an earlier request of the trace had) and its
     * working set (prompt blocks no earlier request had), against the master's own memory */
    int64_t prompt = 0, reused = 0, n_meas = 0;
    for (int i = 0; i < n; i++) {
        if (tr->reqs[i].t_s < mo.skip_s + mo.warmup_s) continue;
        n_meas++;
        prompt += tr->reqs[i].n_prompt;
        reused += tr->reqs[i].reused_tokens;
    }
    printf("  %d requests in %d sessions over %.1f s (rate x%g, len-scale %g): the first %.0f s skipped, %.0f s of warm-up, "
           "then %lld requests in %.0f s measured\n",
           n, tr->n_sessions, tr->reqs[n - 1].t_s, mo.to.rate_scale, mo.to.len_scale, mo.skip_s, mo.warmup_s,
           (long long)n_meas, duration);
    printf("  reusable share of the measured prompt tokens (their blocks were in an earlier request of the trace): %.1f%% "
           "(%lld of %lld); new prompt tokens %lld = %lld blocks against the master's own %d blocks\n",
           prompt ? 100.0 * (double)reused / (double)prompt : 0, (long long)reused, (long long)prompt,
           (long long)(prompt - reused), (long long)((prompt - reused) / s.nm->block_size), own_blocks);
    printf("  lenders give %d master blocks (host-tier baseline: the same bytes, its hits loaded %s); ", lent_blocks,
           s.host_whole ? "whole before the step" : "layer by layer behind the compute");
    if (mo.reclaim_every > 0)
        printf("each %.1f s a lender (round robin) reclaims %.0f%% of its loan or lends it back\n", mo.reclaim_every,
               mo.reclaim_frac * 100);
    else
        printf("lenders never reclaim\n");
    if (n_meas < 1000)
        printf("  NOTE: %lld requests behind each P99, fewer than 1,000 (a reduced run)\n", (long long)n_meas);
    printf("\n%-20s %3s %6s %6s %9s %9s %9s %10s %9s %8s %8s\n", "TTFT (ms)", "rep", "n", "served", "p50", "p95", "p99",
           "prefilled", "hit tok", "h-loads", "preempt");
    fflush(stdout);
    static const char *const names[2] = {"lending (in place)", "host-tier (copies)"};
    for (int rep = 0; rep < mo.reps; rep++)
        for (int mode = 0; mode < 2; mode++) {
            if (mt_run(&s, tr, &mo, mode, lent_blocks, keep[mode], &res[rep][mode]) != KVB_OK) {
                fprintf(stderr, "kvbank-bench multiturn: the %s replay failed\n", names[mode]);
                goto out;
            }
            mt_print_run(names[mode], rep, &res[rep][mode]);
            fflush(stdout);
        }
    /* the summary: medians and min-max over the repetitions */
    double a[64], b[64];
    char t1[64], t2[64], t3[64];
    printf("\nover %d repetitions (median [min-max]); wall-clock figures on a loaded shared CPU under the link model\n",
           mo.reps);
    printf("(n: requests behind each percentile; prefilled: prompt tokens computed in the window, recomputation included;\n"
           " hit tok: prompt tokens served from the prefix caches, host tier included; h-loads: host-tier blocks loaded)\n");
    printf("%-20s %24s %24s %24s\n", "", "TTFT p50 (ms)", "TTFT p99 (ms)", "prefilled tokens");
    for (int mode = 0; mode < 2; mode++) {
        for (int r = 0; r < mo.reps; r++) a[r] = res[r][mode].ttft[0], b[r] = res[r][mode].ttft[2];
        double c[64];
        for (int r = 0; r < mo.reps; r++) c[r] = (double)res[r][mode].prefilled;
        printf("%-20s %24s %24s %24s\n", names[mode], kvb_bench_spread_str(a, mo.reps, 1, t1, sizeof t1),
               kvb_bench_spread_str(b, mo.reps, 1, t2, sizeof t2), kvb_bench_spread_str(c, mo.reps, 0, t3, sizeof t3));
    }
    for (int r = 0; r < mo.reps; r++) a[r] = res[r][1].ttft[2] / res[r][0].ttft[2];
    for (int r = 0; r < mo.reps; r++) b[r] = 100.0 * (1 - res[r][0].ttft[2] / res[r][1].ttft[2]);
    printf("P99 TTFT host tier / lending: %s (lending's P99 %s%% lower; the paper's target: >= 54%%)\n",
           kvb_bench_spread_str(a, mo.reps, 2, t1, sizeof t1), kvb_bench_spread_str(b, mo.reps, 1, t2, sizeof t2));
    /* the reuse the arms achieved, against what the trace offers (issue 10: SwiftCache's regime is high reuse) */
    for (int r = 0; r < mo.reps; r++) {
        a[r] = prompt ? 100.0 * (double)res[r][0].hit / (double)prompt : 0;
        b[r] = prompt ? 100.0 * (double)res[r][1].hit / (double)prompt : 0;
    }
    printf("achieved reuse (hit tokens / measured prompt tokens): lending %s%%, host tier %s%% (the trace offers %.1f%%)\n",
           kvb_bench_spread_str(a, mo.reps, 1, t1, sizeof t1), kvb_bench_spread_str(b, mo.reps, 1, t2, sizeof t2),
           prompt ? 100.0 * (double)reused / (double)prompt : 0);
    if (mo.reclaim_every > 0) {
        int64_t rb = 0, lost = 0;
        for (int r = 0; r < mo.reps; r++) {
            a[r] = res[r][0].reclaimed ? (double)res[r][0].lost / (double)res[r][0].reclaimed : 0;
            rb += res[r][0].reclaimed;
            lost += res[r][0].lost;
        }
        printf("cached blocks lost per reclaimed block (lending): %s (%lld lost of %lld reclaimed in all)\n",
               kvb_bench_spread_str(a, mo.reps, 3, t1, sizeof t1), (long long)lost, (long long)rb);
    }
    rc = 0;
    if (plot_path) { /* the TTFT CDFs of the last repetition (keep[] holds them, sorted) */
        const int m0 = res[mo.reps - 1][0].served, m1 = res[mo.reps - 1][1].served;
        double *xy = NULL;
        if (kvb_calloc((size_t)(2 * (m0 + m1)) + 1, sizeof(double), (void **)&xy) == KVB_OK) {
            double *ax = xy, *ay = xy + m0, *bx = xy + 2 * m0, *by = xy + 2 * m0 + m1;
            kvb_plot_cdf(keep[0], (size_t)m0, ax, ay);
            kvb_plot_cdf(keep[1], (size_t)m1, bx, by);
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
out:
    free(keep[0]);
    free(keep[1]);
    kvb_trace_free(tr);
    setup_free(&s);
    return rc;
}
