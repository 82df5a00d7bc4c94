/* Unit tests of eLLM token-wise's pure core (common/policy/ellm_tw*.h): the corrected cost model and
 * its online fit, the request-level optimizer against a dense grid, the layer-level optimizer, and the
 * map table's invariants under random workloads on a real block pool. */
#include <math.h>
#include <string.h>

#include "common/kv/block_pool.h"
#include "common/policy/ellm_tw.h"
#include "common/policy/ellm_tw_map.h"
#include "tests/harness.h"

/* xorshift64*: deterministic randomness per test */
static uint64_t rng_next(uint64_t *s) {
    *s ^= *s >> 12;
    *s ^= *s << 25;
    *s ^= *s >> 27;
    return *s * 0x2545F4914F6CDD1Dull;
}
static double rng_unif(uint64_t *s) { return (double)(rng_next(s) >> 11) / 9007199254740992.0; }
static int rng_int(uint64_t *s, int lo, int hi) { return lo + (int)(rng_next(s) % (uint64_t)(hi - lo + 1)); }

static kvb_model_config cfg_of(int L, int h, int heads, int kv_heads, int inter, int vocab) {
    kvb_model_config c = {.n_layers = L, .hidden = h, .n_heads = heads, .n_kv_heads = kv_heads,
                          .head_dim = h / heads, .intermediate = inter, .vocab = vocab, .max_pos = 1 << 20};
    return c;
}

/* ---------------------------------------------------------------- cost model */
KVB_TEST(cost_model_counts) {
    /* MHA with I = 8h/3 (SwiGLU's three matrices then cost the paper's 16h²) and fp16: the per-layer
     * dense FLOPs are the paper's 24h² and the KV bytes its 4h */
    kvb_model_config c = cfg_of(40, 96, 8, 8, 256, 1000);
    kvb_etw_dims d;
    kvb_etw_dims_from_config(&c, 2, 2, 1e6, &d);
    double h = 96;
    ck_assert_double_eq_tol(kvb_etw_layer_flops(&d), 24 * h * h, 1e-9);
    ck_assert_double_eq_tol(kvb_etw_kv_bytes(&d), 4 * h, 1e-9);
    /* GQA (2 of 8 heads for K/V): K/V projections and bytes shrink by 4, Q/O and attention do not */
    kvb_model_config g = cfg_of(40, 96, 8, 2, 256, 1000);
    kvb_etw_dims dg;
    kvb_etw_dims_from_config(&g, 2, 2, 1e6, &dg);
    ck_assert_double_eq_tol(kvb_etw_layer_flops(&dg), 24 * h * h - 2 * 2 * h * (h - h / 4), 1e-9);
    ck_assert_double_eq_tol(kvb_etw_kv_bytes(&dg), h, 1e-9);
    /* decode: logits once (2hV), attention over s + 1 keys; recompute: no logits, causal attention */
    kvb_etw_work w = kvb_etw_work_decode(&d, 1000);
    ck_assert_double_eq_tol(w.flops, 40 * 24 * h * h + 2 * h * 1000, 1e-6);
    ck_assert_double_eq_tol(w.attn, 40 * 4 * h * 1001, 1e-6);
    kvb_etw_work r = kvb_etw_work_recompute(&d, 10, 40);
    ck_assert_double_eq_tol(r.flops, 40 * 24 * h * h * 10, 1e-6);
    double causal = 0;
    for (int p = 1; p <= 10; p++) causal += 4 * h * p;
    ck_assert_double_eq_tol(r.attn, 40 * causal, 1e-6);
    /* the recompute of u tokens through all layers is the prefill of u tokens minus one logits row */
    kvb_etw_work pf = kvb_etw_work_prefill(&d, 0, 10);
    ck_assert_double_eq_tol(pf.flops - r.flops, 2 * h * 1000, 1e-6);
    ck_assert_double_eq_tol(pf.attn, r.attn, 1e-6);
    /* the paper's Eq. 2 charges 2hV·s·r for the recompute's logits: for s·r = 2000 tokens at V = 32000
     * that is more than all the layers' dense work of a 4096-wide 32-layer model at these sizes */
    kvb_model_config big = cfg_of(32, 4096, 32, 8, 14336, 128256);
    kvb_etw_dims db;
    kvb_etw_dims_from_config(&big, 2, 2, 16e9, &db);
    kvb_etw_work dec = kvb_etw_work_decode(&db, 8000);
    double paper_logits = 2.0 * 4096 * 128256 * 8000; /* Eq. 3's 2hV·s_i */
    ck_assert(paper_logits / (2.0 * 4096 * 128256) == 8000);
    ck_assert(dec.flops < paper_logits); /* ours: all layers + one logits row */
    /* step time: rates times work plus the fixed term */
    kvb_etw_rates k = {.t_fixed = 1e-3, .s_flop = 1e-12, .s_attn = 2e-12, .s_byte = 1e-10};
    kvb_etw_work sw = kvb_etw_work_step(&db);
    ck_assert_double_eq_tol(kvb_etw_step_time(&k, sw), 1e-3 + 16e9 * 1e-10, 1e-12);
}
KVB_TEST_END

KVB_TEST(cost_fit_recovers_rates) {
    kvb_model_config c = cfg_of(8, 256, 8, 2, 688, 4096);
    kvb_etw_dims d;
    kvb_etw_dims_from_config(&c, 4, 4, 8e6, &d);
    kvb_etw_rates truth = {.t_fixed = 4e-4, .s_flop = 1.0 / 60e9, .s_attn = 1.0 / 15e9, .s_byte = 1.0 / 9e9};
    kvb_etw_rates prior = {.t_fixed = 1e-3, .s_flop = 1.0 / 150e9, .s_attn = 1.0 / 150e9, .s_byte = 1.0 / 30e9};
    kvb_etw_fit f;
    kvb_etw_fit_init(&f, &prior, 0.01, 1.0);
    uint64_t rs = 7;
    for (int n = 0; n < 400; n++) {
        /* a step: some decodes of varied contexts, sometimes a recompute or a prefill chunk */
        kvb_etw_work w = kvb_etw_work_step(&d);
        int b = rng_int(&rs, 1, 48);
        for (int i = 0; i < b; i++) kvb_etw_work_add(&w, kvb_etw_work_decode(&d, rng_int(&rs, 10, 4000)));
        if (rng_unif(&rs) < 0.5) kvb_etw_work_add(&w, kvb_etw_work_recompute(&d, rng_int(&rs, 1, 600), 8));
        if (rng_unif(&rs) < 0.3) kvb_etw_work_add(&w, kvb_etw_work_prefill(&d, rng_int(&rs, 0, 2000), rng_int(&rs, 1, 256)));
        double t = kvb_etw_step_time(&truth, w) * (1 + 0.01 * (rng_unif(&rs) - 0.5));
        kvb_etw_fit_add(&f, w, t);
    }
    kvb_etw_rates got;
    kvb_etw_fit_rates(&f, &got);
    ck_assert_double_le(fabs(got.s_flop / truth.s_flop - 1), 0.05);
    ck_assert_double_le(fabs(got.s_attn / truth.s_attn - 1), 0.10);
    ck_assert_double_le(fabs(got.s_byte / truth.s_byte - 1), 0.10);
    ck_assert_double_le(fabs(got.t_fixed / truth.t_fixed - 1), 0.15);
    /* without samples the fit is the prior; a non-positive time is ignored */
    kvb_etw_fit_init(&f, &prior, 1, 0.99);
    kvb_etw_fit_add(&f, kvb_etw_work_step(&d), -1);
    kvb_etw_fit_add(&f, kvb_etw_work_step(&d), NAN);
    kvb_etw_fit_rates(&f, &got);
    ck_assert_double_eq_tol(got.s_flop, prior.s_flop, prior.s_flop * 1e-12);
    ck_assert_double_eq_tol(got.t_fixed, prior.t_fixed, prior.t_fixed * 1e-12);
}
KVB_TEST_END

/* ---------------------------------------------------------------- request level */
typedef struct rand_problem {
    kvb_etw_dims d;
    int s[256];
    kvb_etw_problem p;
} rand_problem;

static void make_problem(rand_problem *rp, uint64_t *rs, int n_max) {
    int gqa = rng_unif(rs) < 0.5;
    int L = rng_int(rs, 4, 32);
    /* half the problems in the regime where recomputing pays: compute far faster than the weights can be
     * read (a GPU's), large weights, tight memory */
    int friendly = rng_unif(rs) < 0.5;
    kvb_model_config c = cfg_of(L, 256, 8, gqa ? 2 : 8, 688, 4096);
    kvb_etw_dims_from_config(&c, 4, 4, 1e6 * L * pow(10, friendly ? 1.5 : 1.5 * rng_unif(rs)), &rp->d);
    int n = rng_int(rs, 1, n_max);
    int smax = rng_int(rs, 16, 3000);
    for (int i = 0; i < n; i++) rp->s[i] = rng_int(rs, 1, smax);
    kvb_etw_link link = {.bytes_per_s = rng_unif(rs) < 0.5 ? 0 : 2e9, .latency_s = 1e-5};
    /* from a CPU's balance of compute and bandwidth to a GPU's (compute up to 300x faster per byte) */
    double speed = pow(10, friendly ? 2.5 + rng_unif(rs) : 2.5 * rng_unif(rs));
    kvb_etw_rates k = {.t_fixed = 5e-4, .s_flop = 1.0 / (60e9 * speed), .s_attn = 1.0 / (15e9 * speed),
                       .s_byte = 1.0 / 9e9};
    kvb_etw_layer_plan lp = kvb_etw_layer_initial(&rp->d, &link);
    int bs = rng_int(rs, 0, 2) == 0 ? 1 : 16;
    /* memory: a fraction of what the whole set would need fully cached */
    int64_t full = 0;
    for (int i = 0; i < n; i++) full += KVB_DIV_CEIL(rp->s[i] + 1, bs);
    double frac = friendly ? 0.1 + 0.4 * rng_unif(rs) : 0.05 + 0.9 * rng_unif(rs);
    /* SLO: a multiple of one request's unloaded step */
    double t1 = kvb_etw_step_time(&k, kvb_etw_work_step(&rp->d)) +
                kvb_etw_time(&k, kvb_etw_work_decode(&rp->d, smax));
    rp->p = (kvb_etw_problem){
        .d = &rp->d,
        .rates = k,
        .layer = lp,
        .s = rp->s,
        .n = n,
        .b_bound = 512,
        .r_max = rng_unif(rs) < 0.2 ? 1.0 : 0.9,
        .slo_s = t1 * (1.2 + 6 * rng_unif(rs)),
        .wt_max_s = rng_unif(rs) < 0.5 ? 0 : 0.2 * t1,
        .block_size = bs,
        .unit_layers = (int[]){1, 2, 4, 8}[rng_int(rs, 0, 3)],
        .mem_blocks = (int64_t)(full * frac) + rng_int(rs, 0, 4),
        .host_blocks = lp.n_swap > 0 ? (int64_t)(full * 2) : 0,
        .max_rows = rng_unif(rs) < 0.3 ? 256 + rng_int(rs, 0, 2000) : 1 << 30,
        .act_row_bytes = rng_unif(rs) < 0.5 ? kvb_etw_act_row_bytes(&rp->d) : 0,
    };
}

KVB_TEST(optimizer_matches_grid) {
    uint64_t rs = 12345;
    int n_feasible = 0, n_with_r = 0;
    double worst = 0;
    for (int t = 0; t < 300; t++) {
        rand_problem rp;
        make_problem(&rp, &rs, 40);
        kvb_etw_solution opt, grid;
        ck_assert_int_eq(kvb_etw_solve(&rp.p, &opt), KVB_OK);
        kvb_etw_solve_grid(&rp.p, 1000, &grid);
        ck_assert_int_eq(opt.feasible, grid.feasible);
        if (!grid.feasible) continue;
        n_feasible++;
        if (opt.r > 0) n_with_r++;
        /* never a point that breaks a constraint */
        ck_assert_msg(kvb_etw_feasible(&rp.p, opt.b, opt.r), "problem %d: (b %d, r %g) infeasible", t, opt.b, opt.r);
        ck_assert_int_le(opt.mem_blocks, rp.p.mem_blocks);
        /* r is near the exact smallest ratio at that b (the solver's local search may stop one step of
         * the stepped memory function above it) */
        double rmin = kvb_etw_min_ratio(&rp.p, opt.b);
        ck_assert_double_ge(opt.r, rmin - 1e-12);
        ck_assert_double_le(opt.r, rmin + 0.02 * rp.p.r_max);
        /* within 1% of the dense grid (the optimizer's r is continuous, so it may also beat it) */
        double rel = opt.objective / grid.objective - 1;
        if (rel > worst) worst = rel;
        ck_assert_msg(rel <= 0.01, "problem %d: optimizer %.6g (b %d r %.4f) vs grid %.6g (b %d r %.4f)", t,
                      opt.objective, opt.b, opt.r, grid.objective, grid.b, grid.r);
    }
    printf("optimizer vs grid: %d feasible problems (%d with r > 0), worst excess %.4f%%\n", n_feasible,
           n_with_r, 100 * worst);
    ck_assert_int_ge(n_feasible, 100);
    ck_assert_int_ge(n_with_r, 30);
}
KVB_TEST_END

KVB_TEST(optimizer_never_breaks_memory) {
    /* larger candidate sets (up to the 512 bound and beyond): the answer always fits exactly */
    uint64_t rs = 999;
    for (int t = 0; t < 60; t++) {
        rand_problem rp;
        make_problem(&rp, &rs, 256);
        rp.p.b_bound = rng_int(&rs, 1, 300);
        kvb_etw_solution opt;
        ck_assert_int_eq(kvb_etw_solve(&rp.p, &opt), KVB_OK);
        if (!opt.feasible) continue;
        ck_assert_int_le(opt.b, rp.p.b_bound);
        ck_assert(kvb_etw_feasible(&rp.p, opt.b, opt.r));
        int64_t dev, host;
        kvb_etw_exact_blocks(&rp.p, opt.b, opt.r, &dev, &host);
        ck_assert_int_le(dev, rp.p.mem_blocks);
        ck_assert_int_le(host, rp.p.host_blocks);
        ck_assert_double_le(opt.t_step + rp.p.wt_max_s, rp.p.slo_s);
    }
}
KVB_TEST_END

KVB_TEST(optimizer_edges) {
    kvb_model_config c = cfg_of(8, 256, 8, 8, 688, 4096);
    kvb_etw_dims d;
    kvb_etw_dims_from_config(&c, 4, 4, 8e6, &d);
    int s[4] = {200, 200, 200, 200};
    kvb_etw_rates k = {.t_fixed = 5e-4, .s_flop = 1.0 / 60e9, .s_attn = 1.0 / 15e9, .s_byte = 1.0 / 9e9};
    kvb_etw_problem p = {.d = &d, .rates = k, .layer = kvb_etw_layer_initial(&d, NULL), .s = s, .n = 4,
                         .b_bound = 512, .r_max = 0.9, .slo_s = 1, .block_size = 16, .unit_layers = 4,
                         .mem_blocks = 1000, .max_rows = 1 << 20, .act_row_bytes = kvb_etw_act_row_bytes(&d)};
    kvb_etw_solution o;
    /* everything fits: all four, nothing recomputed */
    ck_assert_int_eq(kvb_etw_solve(&p, &o), KVB_OK);
    ck_assert_int_eq(o.feasible, 1);
    ck_assert_int_eq(o.b, 4);
    ck_assert_double_eq(o.r, 0);
    /* memory for less than four fully cached (13 blocks each): all four only with recompute */
    p.mem_blocks = 50;
    ck_assert_int_eq(kvb_etw_solve(&p, &o), KVB_OK);
    ck_assert_int_eq(o.feasible, 1);
    ck_assert(kvb_etw_feasible(&p, o.b, o.r));
    ck_assert_int_le(o.mem_blocks, 50);
    /* r_max = 0 (the baselines): b limited by memory alone: three fit (13 blocks each, 39 of 50) */
    p.r_max = 0;
    ck_assert_int_eq(kvb_etw_solve(&p, &o), KVB_OK);
    ck_assert_int_eq(o.b, 3);
    ck_assert_double_eq(o.r, 0);
    /* not even one fits: infeasible, one request at r_max returned */
    p.r_max = 0.9;
    p.mem_blocks = 1;
    ck_assert_int_eq(kvb_etw_solve(&p, &o), KVB_OK);
    ck_assert_int_eq(o.feasible, 0);
    ck_assert_int_eq(o.b, 1);
    /* an SLO no step can meet */
    p.mem_blocks = 1000;
    p.slo_s = 1e-6;
    ck_assert_int_eq(kvb_etw_solve(&p, &o), KVB_OK);
    ck_assert_int_eq(o.feasible, 0);
    /* WT_max eats the SLO */
    p.slo_s = 1;
    p.wt_max_s = 1;
    ck_assert_int_eq(kvb_etw_solve(&p, &o), KVB_OK);
    ck_assert_int_eq(o.feasible, 0);
    /* no candidates */
    p.wt_max_s = 0;
    p.n = 0;
    ck_assert_int_eq(kvb_etw_solve(&p, &o), KVB_OK);
    ck_assert_int_eq(o.b, 0);
    /* malformed */
    p.n = 4;
    p.r_max = 1.5;
    ck_assert_int_eq(kvb_etw_solve(&p, &o), KVB_ERR_INVALID);
    p.r_max = 0.9;
    s[2] = -1;
    ck_assert_int_eq(kvb_etw_solve(&p, &o), KVB_ERR_INVALID);
}
KVB_TEST_END

static int fits_at(const kvb_etw_problem *p, int b, double r) {
    int64_t dev, host, rows = b;
    kvb_etw_exact_blocks(p, b, r, &dev, &host);
    for (int i = 0; i < b; i++) rows += kvb_etw_absent(r, p->s[i]);
    return dev <= p->mem_blocks && host <= p->host_blocks && rows <= p->max_rows;
}

/* The exact smallest ratio against a dense check of the ratios k/s_i below it: every one of them for
 * every eighth problem, those within 0.02 below it for the others (a dense check of all 400 problems
 * costs ~2·10^9 evaluations: 30 s of CPU under ASan, minutes on a loaded machine). */
KVB_TEST(min_ratio_is_smallest) {
    uint64_t rs = 31;
    int n_pos = 0, n_none = 0;
    int64_t n_checked = 0;
    for (int t = 0; t < 400; t++) {
        rand_problem rp;
        make_problem(&rp, &rs, 30);
        int b = rng_unif(&rs) < 0.5 ? rp.p.n : rng_int(&rs, 1, rp.p.n);
        double r = kvb_etw_min_ratio(&rp.p, b);
        double top = r < 0 ? rp.p.r_max : r;
        if (r < 0) n_none++;
        else ck_assert(fits_at(&rp.p, b, r));
        if (r > 0) n_pos++;
        /* memory is constant between breakpoints: checking each k/s_i below `top` checks every r */
        double from = t % 8 == 0 ? 0 : fmax(0, top - 0.02);
        for (int i = 0; i < b; i++)
            for (int64_t k = (int64_t)floor(from * rp.s[i]); (double)k / rp.s[i] < top - 1e-12 && k <= rp.s[i]; k++) {
                ck_assert_msg(!fits_at(&rp.p, b, (double)k / rp.s[i]), "problem %d: %g fits, below the minimum %g",
                              t, (double)k / rp.s[i], r);
                n_checked++;
            }
    }
    printf("min ratio: %d problems with r > 0, %d with none, %lld smaller ratios checked\n", n_pos, n_none,
           (long long)n_checked);
    ck_assert_int_ge(n_pos, 20);
    ck_assert_int_ge(n_none, 5);
}
KVB_TEST_END

/* ---------------------------------------------------------------- layer level */
KVB_TEST(layer_level_choice) {
    kvb_model_config c = cfg_of(24, 512, 8, 8, 1376, 4096);
    kvb_etw_dims d;
    kvb_etw_dims_from_config(&c, 2, 2, 3e7, &d);
    kvb_etw_rates k = {.t_fixed = 2e-4, .s_flop = 1.0 / 100e9, .s_attn = 1.0 / 50e9, .s_byte = 1.0 / 20e9};
    int s[8], u[8];
    for (int i = 0; i < 8; i++) {
        s[i] = 500 + 100 * i;
        u[i] = s[i] / 3;
    }
    kvb_etw_batch bt = {.b = 8, .s = s, .u = u};
    uint64_t rs = 5;
    for (int t = 0; t < 200; t++) {
        kvb_etw_link link = {.bytes_per_s = exp(log(1e7) + (log(1e11) - log(1e7)) * rng_unif(&rs)),
                             .latency_s = 1e-5};
        kvb_etw_layer_plan lp;
        kvb_etw_layer_optimize(&d, &k, &link, &bt, 16, KVB_ETW_DEVICE_CPU, &lp);
        ck_assert_int_eq(lp.n_rec + lp.n_swap, 24);
        ck_assert_int_ge(lp.n_rec, 1);
        if (lp.n_swap == 0) {
            ck_assert_int_eq(lp.l1, 0);
            ck_assert_int_eq(lp.depth, 1 + lp.l2);
        } else {
            /* brute force over the six: the chosen one has the smallest |T_swap − T_rec| */
            for (int l2 = 1; l2 <= 2; l2++)
                for (int l1 = 1; l1 <= 3; l1++) {
                    double ts = lp.t_swap / lp.l1 * l1, tr = lp.t_rec / lp.l2 * l2;
                    ck_assert_double_le(fabs(lp.t_swap - lp.t_rec), fabs(ts - tr) * (1 + 1e-9) + 1e-15);
                }
            ck_assert_int_eq(lp.n_swap, (int)lround(24.0 * lp.l1 / (lp.l1 + lp.l2)));
            ck_assert_int_eq(lp.depth, 1 + lp.l1 + lp.l2);
            /* the guard: swapping only when it shortens the step */
            kvb_etw_layer_plan none = {.l1 = 0, .l2 = 1, .n_rec = 24, .n_swap = 0, .depth = 2};
            ck_assert_double_lt(kvb_etw_step_estimate(&d, &k, &link, &bt, &lp),
                                kvb_etw_step_estimate(&d, &k, &link, &bt, &none));
        }
        ck_assert_int_ge(lp.delta, 1);
        ck_assert_int_le(lp.delta, 15);
        /* GPU: a warp multiple in [32, 992] */
        kvb_etw_layer_optimize(&d, &k, &link, &bt, 0, KVB_ETW_DEVICE_GPU, &lp);
        ck_assert_int_eq(lp.threads, 1024);
        ck_assert_int_eq(lp.delta % 32, 0);
        ck_assert_int_ge(lp.delta, 32);
        ck_assert_int_le(lp.delta, 992);
    }
    /* a fast link swaps, a crawling one does not */
    kvb_etw_layer_plan lp;
    kvb_etw_link fast = {.bytes_per_s = 1e12, .latency_s = 0}, slow = {.bytes_per_s = 1e5, .latency_s = 1e-3};
    kvb_etw_layer_optimize(&d, &k, &fast, &bt, 4, KVB_ETW_DEVICE_CPU, &lp);
    ck_assert_int_gt(lp.n_swap, 0);
    kvb_etw_layer_optimize(&d, &k, &slow, &bt, 4, KVB_ETW_DEVICE_CPU, &lp);
    ck_assert_int_eq(lp.n_swap, 0);
    /* no link: never swaps; nothing absent: no split */
    kvb_etw_layer_optimize(&d, &k, NULL, &bt, 4, KVB_ETW_DEVICE_CPU, &lp);
    ck_assert_int_eq(lp.n_swap, 0);
    for (int i = 0; i < 8; i++) u[i] = 0;
    kvb_etw_layer_optimize(&d, &k, &fast, &bt, 4, KVB_ETW_DEVICE_CPU, &lp);
    ck_assert_int_eq(lp.n_swap, 0);
    ck_assert_int_eq(lp.delta, 0);
    /* the paper's initial point: three swapped and two recomputed layers */
    lp = kvb_etw_layer_initial(&d, &fast);
    ck_assert_int_eq(lp.l1, 3);
    ck_assert_int_eq(lp.l2, 2);
    ck_assert_int_eq(lp.n_swap, (int)lround(24 * 0.6));
}
KVB_TEST_END

/* ---------------------------------------------------------------- map table */
typedef struct pool_prov {
    kvb_block_pool *pool;
    int allocs, frees;
} pool_prov;

static kvb_status prov_alloc(void *ud, int32_t *b) {
    pool_prov *pp = ud;
    kvb_status st = kvb_block_pool_alloc(pp->pool, b);
    if (st == KVB_OK) pp->allocs++;
    return st;
}
static void prov_free(void *ud, int32_t b) {
    pool_prov *pp = ud;
    pp->frees++;
    kvb_block_pool_unref(pp->pool, b);
}

KVB_TEST(map_geometry) {
    /* units per window: brute force over window starts */
    for (int L = 1; L <= 20; L++)
        for (int F = 1; F <= 9; F++)
            for (int depth = 1; depth <= L; depth++) {
                int worst = 0;
                for (int a = 0; a + depth <= L; a++) {
                    int u = kvb_etw_map_units_span(L, F, a, a + depth);
                    if (u > worst) worst = u;
                }
                ck_assert_int_eq(kvb_etw_map_units_window(L, F, depth), worst);
            }
    ck_assert_int_eq(kvb_etw_map_slots(8, 4), 2);
    ck_assert_int_eq(kvb_etw_map_slots(10, 4), 2);
    ck_assert_int_eq(kvb_etw_map_groups(10, 4), 3);
    ck_assert_int_eq(kvb_etw_map_slots(4, 8), 1);
    ck_assert_int_eq(kvb_etw_map_units_span(40, 4, 17, 40), 6); /* groups 4..9 */
    ck_assert_int_eq(kvb_etw_map_units_span(40, 4, 40, 40), 0);
}
KVB_TEST_END

/* The carrier bound the optimizer uses holds for the real allocator: a window of `depth` layers for
 * N token blocks, mapped group by group as the pipeline moves up, never holds more carriers. */
KVB_TEST(map_window_within_bound) {
    int L = 10, bs = 4;
    kvb_kv_geom g = {.n_layers = L, .n_kv_heads = 1, .head_dim = 2, .block_size = bs, .elem_size = 4};
    size_t bb = kvb_kv_block_bytes(&g);
    void *mem = malloc(bb * 400);
    kvb_block_pool *pool;
    ck_assert_int_eq(kvb_block_pool_create(&g, mem, bb * 400, 400, &pool), KVB_OK);
    pool_prov pp = {.pool = pool};
    kvb_etw_map_blocks prov = {.ud = &pp, .alloc = prov_alloc, .free = prov_free};
    for (int F = 1; F <= 5; F++)
        for (int depth = 1; depth <= 4; depth++) {
            kvb_etw_map *m;
            ck_assert_int_eq(kvb_etw_map_create(L, F, bs, &prov, &m), KVB_OK);
            int groups = kvb_etw_map_groups_of(m), f = kvb_etw_map_unit_layers(L, F), N = 23;
            int64_t bound = kvb_etw_map_carriers(L, F, depth, N), peak = 0;
            /* decode at layer l needs layers [l, l + depth): map the groups covering them, drop the rest */
            for (int l = 0; l < L; l++) {
                int g_lo = l / f, g_hi = (KVB_MIN(L, l + depth) - 1) / f;
                for (int gg = 0; gg < groups; gg++)
                    for (int tb = 0; tb < N; tb++) {
                        kvb_etw_map_entry e;
                        int want = gg >= g_lo && gg <= g_hi, have = kvb_etw_map_entry_of(m, 1 + tb % 3, tb, gg, &e) == KVB_OK;
                        if (want && !have) ck_assert_int_eq(kvb_etw_map_add(m, 1 + tb % 3, tb, gg, bs), KVB_OK);
                        if (!want && have) ck_assert_int_eq(kvb_etw_map_remove(m, 1 + tb % 3, tb, gg), KVB_OK);
                    }
                kvb_etw_map_stats st;
                kvb_etw_map_get_stats(m, &st);
                if (st.carriers > peak) peak = st.carriers;
                ck_assert_int_eq(kvb_etw_map_check(m), KVB_OK);
            }
            ck_assert_msg(peak <= bound, "F %d depth %d: %lld carriers, bound %lld", F, depth, (long long)peak,
                          (long long)bound);
            kvb_etw_map_destroy(m);
            ck_assert_int_eq(kvb_block_pool_n_free(pool), 400);
        }
    kvb_block_pool_destroy(pool);
    free(mem);
}
KVB_TEST_END

/* Random adds, removes, refills and whole-sequence drops on a real pool. After every operation the
 * invariants hold; every mapped (seq, token block, layer) resolves to its own (block, layer) slice,
 * which keeps the signature written into it when it was mapped (no two units share memory, nothing
 * moved); the pool holds exactly the carriers; at the end every block is back. */
KVB_TEST(map_random_workload) {
    const int L = 12, bs = 8, NB = 12;
    kvb_kv_geom g = {.n_layers = L, .n_kv_heads = 1, .head_dim = 2, .block_size = bs, .elem_size = 4};
    size_t bb = kvb_kv_block_bytes(&g);
    float *mem = malloc(bb * NB);
    kvb_block_pool *pool;
    ck_assert_int_eq(kvb_block_pool_create(&g, mem, bb * NB, NB, &pool), KVB_OK);
    pool_prov pp = {.pool = pool};
    kvb_etw_map_blocks prov = {.ud = &pp, .alloc = prov_alloc, .free = prov_free};
    uint64_t rs = 4242;
    enum { NSEQ = 6, NTB = 12 };
    for (int F = 1; F <= 8; F *= 2) {
        kvb_etw_map *m;
        ck_assert_int_eq(kvb_etw_map_create(L, F, bs, &prov, &m), KVB_OK);
        int groups = kvb_etw_map_groups_of(m), f = kvb_etw_map_unit_layers(L, F);
        static int8_t mapped[NSEQ][NTB][12];
        memset(mapped, 0, sizeof mapped);
        int n_mapped = 0, exhausted = 0;
        for (int op = 0; op < 4000; op++) {
            int sq = rng_int(&rs, 0, NSEQ - 1), tb = rng_int(&rs, 0, NTB - 1), gg = rng_int(&rs, 0, groups - 1);
            double x = rng_unif(&rs);
            if (x < 0.55) {
                kvb_etw_map_stats before;
                kvb_etw_map_get_stats(m, &before);
                kvb_status st = kvb_etw_map_add(m, sq, tb, gg, rng_int(&rs, 1, bs));
                if (mapped[sq][tb][gg]) {
                    ck_assert_int_eq(st, KVB_ERR_STATE);
                } else if (st == KVB_ERR_EXHAUSTED) {
                    exhausted++;
                    kvb_etw_map_stats after;
                    kvb_etw_map_get_stats(m, &after);
                    ck_assert_int_eq(after.units, before.units);
                    ck_assert_int_eq(after.carriers, before.carriers);
                } else {
                    ck_assert_int_eq(st, KVB_OK);
                    mapped[sq][tb][gg] = 1;
                    n_mapped++;
                    /* sign every layer of the new unit */
                    for (int l = gg * f; l < KVB_MIN(L, gg * f + f); l++) {
                        kvb_etw_map_loc loc;
                        ck_assert_int_eq(kvb_etw_map_lookup(m, sq, tb, l, &loc), KVB_OK);
                        float *p = kvb_block_pool_block_layer(pool, loc.block, loc.layer);
                        p[0] = (float)(sq * 100000 + tb * 100 + l);
                    }
                }
            } else if (x < 0.9) {
                kvb_status st = kvb_etw_map_remove(m, sq, tb, gg);
                ck_assert_int_eq(st, mapped[sq][tb][gg] ? KVB_OK : KVB_ERR_NOT_FOUND);
                if (mapped[sq][tb][gg]) n_mapped--;
                mapped[sq][tb][gg] = 0;
            } else if (x < 0.995) {
                kvb_status st = kvb_etw_map_set_filled(m, sq, tb, gg, rng_int(&rs, 0, bs));
                ck_assert_int_eq(st, mapped[sq][tb][gg] ? KVB_OK : KVB_ERR_NOT_FOUND);
            } else {
                int want = 0;
                for (int a = 0; a < NTB; a++)
                    for (int b = 0; b < groups; b++) want += mapped[sq][a][b];
                ck_assert_int_eq(kvb_etw_map_remove_seq(m, sq), want);
                memset(mapped[sq], 0, sizeof mapped[sq]);
                n_mapped -= want;
            }
            ck_assert_int_eq(kvb_etw_map_check(m), KVB_OK);
            kvb_etw_map_stats st;
            kvb_etw_map_get_stats(m, &st);
            ck_assert_int_eq(st.units, n_mapped);
            ck_assert_int_eq(NB - kvb_block_pool_n_free(pool), st.carriers); /* nothing lost */
            ck_assert_int_eq(pp.allocs - pp.frees, st.carriers);
            ck_assert_double_le(st.used_bytes, st.held_bytes);
            if (op % 50 == 0) {
                /* every mapped layer: its own slice, still signed */
                static int8_t seen[64][12];
                memset(seen, 0, sizeof seen);
                for (int a = 0; a < NSEQ; a++)
                    for (int t2 = 0; t2 < NTB; t2++)
                        for (int l = 0; l < L; l++) {
                            kvb_etw_map_loc loc;
                            kvb_status ls = kvb_etw_map_lookup(m, a, t2, l, &loc);
                            ck_assert_int_eq(ls, mapped[a][t2][l / f] ? KVB_OK : KVB_ERR_NOT_FOUND);
                            if (ls != KVB_OK) continue;
                            ck_assert_int_eq(seen[loc.block][loc.layer], 0); /* never double-mapped */
                            seen[loc.block][loc.layer] = 1;
                            ck_assert_int_gt(kvb_block_pool_refcount(pool, loc.block), 0);
                            float *p = kvb_block_pool_block_layer(pool, loc.block, loc.layer);
                            ck_assert_float_eq(p[0], (float)(a * 100000 + t2 * 100 + l));
                        }
            }
        }
        ck_assert_int_gt(exhausted, 0); /* the workload did run the pool dry at times */
        kvb_etw_map_entry e;
        for (int a = 0; a < NSEQ; a++)
            for (int t2 = 0; t2 < NTB; t2++)
                for (int b = 0; b < groups; b++)
                    if (mapped[a][t2][b]) {
                        ck_assert_int_eq(kvb_etw_map_entry_of(m, a, t2, b, &e), KVB_OK);
                        ck_assert_int_eq(e.token_id, t2 * bs);
                        ck_assert_int_eq(e.layer_id, b * f);
                        ck_assert_int_eq(e.logical_block_id, t2 * groups + b);
                        ck_assert_int_le(e.filled, bs);
                    }
        kvb_etw_map_destroy(m);
        ck_assert_int_eq(kvb_block_pool_n_free(pool), NB);
        ck_assert_int_eq(pp.allocs, pp.frees);
    }
    kvb_block_pool_destroy(pool);
    free(mem);
}
KVB_TEST_END

KVB_TEST(map_bad_input) {
    kvb_etw_map_blocks none = {0};
    kvb_etw_map *m;
    ck_assert_int_eq(kvb_etw_map_create(8, 4, 16, &none, &m), KVB_ERR_INVALID);
    kvb_kv_geom g = {.n_layers = 8, .n_kv_heads = 1, .head_dim = 2, .block_size = 4, .elem_size = 4};
    size_t bb = kvb_kv_block_bytes(&g);
    void *mem = malloc(bb);
    kvb_block_pool *pool;
    ck_assert_int_eq(kvb_block_pool_create(&g, mem, bb, 1, &pool), KVB_OK);
    pool_prov pp = {.pool = pool};
    kvb_etw_map_blocks prov = {.ud = &pp, .alloc = prov_alloc, .free = prov_free};
    ck_assert_int_eq(kvb_etw_map_create(0, 4, 4, &prov, &m), KVB_ERR_INVALID);
    ck_assert_int_eq(kvb_etw_map_create(8, 4, 4, &prov, &m), KVB_OK);
    ck_assert_int_eq(kvb_etw_map_add(m, 1, 0, 2, 4), KVB_ERR_INVALID); /* group 2 of 2 */
    ck_assert_int_eq(kvb_etw_map_add(m, 1, 0, 0, 5), KVB_ERR_INVALID); /* filled > bs */
    ck_assert_int_eq(kvb_etw_map_add(m, 1, 0, 0, 4), KVB_OK);
    ck_assert_int_eq(kvb_etw_map_add(m, 1, 0, 1, 4), KVB_OK); /* the second slot of the same block */
    ck_assert_int_eq(kvb_etw_map_add(m, 2, 0, 0, 4), KVB_ERR_EXHAUSTED);
    ck_assert_int_eq(kvb_etw_map_check(m), KVB_OK);
    kvb_etw_map_loc loc;
    ck_assert_int_eq(kvb_etw_map_lookup(m, 1, 0, 8, &loc), KVB_ERR_INVALID);
    ck_assert_int_eq(kvb_etw_map_lookup(m, 2, 0, 0, &loc), KVB_ERR_NOT_FOUND);
    ck_assert_int_eq(kvb_etw_map_remove(m, 2, 0, 0), KVB_ERR_NOT_FOUND);
    ck_assert_int_eq(kvb_etw_map_remove_seq(m, 1), 2);
    ck_assert_int_eq(kvb_block_pool_n_free(pool), 1);
    kvb_etw_map_destroy(m);
    kvb_etw_map_destroy(NULL);
    kvb_block_pool_destroy(pool);
    free(mem);
}
KVB_TEST_END

KVB_TEST_MAIN("ellm_tw", KVB_T(cost_model_counts, 10), KVB_T(cost_fit_recovers_rates, 10),
              KVB_T(optimizer_matches_grid, 300), KVB_T(optimizer_never_breaks_memory, 120),
              KVB_T(optimizer_edges, 10), KVB_T(min_ratio_is_smallest, 300), KVB_T(layer_level_choice, 10),
              KVB_T(map_geometry, 10), KVB_T(map_window_within_bound, 60), KVB_T(map_random_workload, 300),
              KVB_T(map_bad_input, 10))
