/* Unit tests of OrbitFlow's pure core (../shared/papers/orbitflow.txt): the golden Fig. 3 example
 * (§2.3), D(L) (§3.3.2), the latency model's rule (§3.3.1), memory with the prefetch buffer, the solver
 * against brute force, Pause-Resume, Token-Deposit slack over a window, the controller (§3.4) and the
 * baselines' rules (§5.1). */
#include <math.h>

#include "common/policy/orbitflow.h"
#include "common/util/token_deposit.h"
#include "tests/harness.h"

/* Fig. 3: 9 layers, 16-token blocks, 70 slices of device memory, 3 slices cross the link in one layer's
 * compute. Time unit: one block-time (a slice at full bandwidth), so a layer computes in 3. */
enum { FIG3_L = 9 };

typedef struct fig3 {
    kvb_of_profile prof;
    kvb_of_cand c[8];
    int n;
    kvb_of_req reqs[2];
    kvb_of_problem p;
} fig3;

static void fig3_init(fig3 *f) {
    kvb_of_profile_uniform(&f->prof, FIG3_L, 3.0, 0.0, 1.0, 0.0);
    f->n = kvb_of_candidates(FIG3_L, f->c, 8);
    /* step 1: request 1 holds 3 blocks (40 tokens), request 2 holds 6 (81); 15 steps later 4 (55) and 6 (96) */
    f->reqs[0] = (kvb_of_req){.len = 40};
    f->reqs[1] = (kvb_of_req){.len = 81};
    f->p = (kvb_of_problem){.prof = &f->prof, .block_size = 16, .budget = 70, .reqs = f->reqs, .n_reqs = 2,
                            .cands = f->c, .n_cands = f->n, .ahead = 0, .delta_min = 1, .delta_max = 1,
                            .alpha = 1, .enforce_slo = 0, .mode = KVB_OF_REQUEST_WISE};
}

/* index of the candidate with c offloaded layers */
static int cand_with(const kvb_of_cand *cands, int n, int c) {
    for (int i = 0; i < n; i++)
        if (cands[i].n_off == c) return i;
    ck_abort_msg("no candidate with %d offloaded layers", c);
    return -1;
}

KVB_TEST(dl_candidates) {
    ck_assert_int_eq(kvb_of_dl(32), 9);
    kvb_of_cand c[KVB_OF_MAX_CANDS];
    ck_assert_int_eq(kvb_of_candidates(32, c, KVB_OF_MAX_CANDS), 10);
    int want[10] = {0, 1, 2, 3, 4, 5, 6, 8, 10, 16}; /* all-resident, then floor(32/k) increasing */
    for (int i = 0; i < 10; i++) ck_assert_int_eq(c[i].n_off, want[i]);
    /* c = 10: k = 3, layers 3, 6, ..., 30 (1-based) */
    for (int l = 0; l < 32; l++) ck_assert_int_eq(kvb_of_layer_in(&c[8].off, l), (l + 1) % 3 == 0 && l + 1 <= 30);
    ck_assert_int_eq(c[8].distance, 3);
    /* Fig. 3: D(9) = {1, 2, 3, 4}; three offloaded layers are L3, L6, L9 */
    ck_assert_int_eq(kvb_of_dl(9), 4);
    ck_assert_int_eq(kvb_of_candidates(9, c, KVB_OF_MAX_CANDS), 5);
    int i3 = cand_with(c, 5, 3);
    for (int l = 0; l < 9; l++) ck_assert_int_eq(kvb_of_layer_in(&c[i3].off, l), l == 2 || l == 5 || l == 8);
    /* every L: the bound of §3.3.2, and each count is reproduced by its own distance */
    for (int L = 1; L <= KVB_OF_MAX_LAYERS; L++) {
        int d = kvb_of_dl(L);
        ck_assert_int_le(d, L == 1 ? 0 : 2 * (int)floor(sqrt((double)L)) - 1);
        int n = kvb_of_candidates(L, c, KVB_OF_MAX_CANDS);
        ck_assert_int_eq(n, d + 1);
        ck_assert_int_le(n, KVB_OF_MAX_CANDS);
        for (int i = 0; i < n; i++) {
            int cnt = 0, top = -1;
            for (int l = 0; l < L; l++)
                if (kvb_of_layer_in(&c[i].off, l)) cnt++, top = l;
            ck_assert_int_eq(cnt, c[i].n_off);
            ck_assert_int_lt(top, L);
            if (i) ck_assert_int_gt(c[i].n_off, c[i - 1].n_off);
            ck_assert(!kvb_of_layer_in(&c[i].off, 0) || L == 1); /* layer 1 is never offloaded (k >= 2) */
        }
    }
    kvb_of_cand ds;
    kvb_of_cand_all_offloaded(32, &ds);
    ck_assert_int_eq(ds.n_off, 32);
    ck_assert_int_eq(ds.n_slots, 2);
}
KVB_TEST_END

KVB_TEST(fig3_memory) {
    static fig3 F;
    fig3_init(&F);
    kvb_of_cand *c = F.c;
    int n = F.n;
    kvb_of_req *reqs = F.reqs;
    kvb_of_problem p = F.p;
    int A[2] = {cand_with(c, n, 3), cand_with(c, n, 3)};
    int B[2] = {0, cand_with(c, n, 3)};
    int C[2] = {cand_with(c, n, 2), cand_with(c, n, 3)};
    int64_t buf;
    /* step 1 (s = 0) and step 16 (s = 15 of the same window): 63 / 70 / 78 / 70 with Eq. 1's buffer */
    ck_assert_int_eq(kvb_of_memory(&p, A, 0, &buf), 63);
    ck_assert_int_eq(buf, 9);
    ck_assert_int_eq(kvb_of_eq1_buffer(&p, A, 0), 9);
    ck_assert_int_eq(kvb_of_memory(&p, A, 15, &buf), 70);
    ck_assert_int_eq(kvb_of_eq1_buffer(&p, A, 15), 10);
    ck_assert_int_eq(kvb_of_memory(&p, B, 15, &buf), 78);
    ck_assert_int_eq(kvb_of_eq1_buffer(&p, B, 15), 6);
    int64_t c16 = kvb_of_memory(&p, C, 15, &buf);
    ck_assert_int_eq(c16 - buf + kvb_of_eq1_buffer(&p, C, 15), 70); /* the paper's total */
    /* kvbank's buffer holds every request's in-flight layer: 4 + 6 against Eq. 1's 6 */
    ck_assert_int_eq(buf, 10);
    ck_assert_int_eq(c16, 74);
    /* the same totals from the lengths at step 16 directly */
    reqs[0].len = 55;
    reqs[1].len = 96;
    ck_assert_int_eq(kvb_of_memory(&p, A, 0, NULL), 70);
    ck_assert_int_eq(kvb_of_memory(&p, B, 0, NULL), 78);
}
KVB_TEST_END

static double fig3_stall(const kvb_of_cand *c, int ca, int cb, double ba, double bb, double *peak) {
    double comp[FIG3_L];
    for (int l = 0; l < FIG3_L; l++) comp[l] = 3;
    kvb_of_sim_req r[2] = {{.cand = &c[ca], .slices = ba}, {.cand = &c[cb], .slices = bb}};
    kvb_of_sim_out o;
    double t = kvb_of_sim(comp, FIG3_L, 1.0, 0.0, r, 2, &o, NULL);
    ck_assert_double_eq_tol(t, 27 + o.stall, 1e-9);
    if (peak) *peak = o.peak_inflight;
    return o.stall;
}

KVB_TEST(fig3_stalls) {
    kvb_of_cand c[8];
    int n = kvb_of_candidates(FIG3_L, c, 8);
    int c2 = cand_with(c, n, 2), c3 = cand_with(c, n, 3);
    double peak;
    /* placement A: 9 slices per offloaded layer against 6 of compute, three times */
    ck_assert_double_eq_tol(fig3_stall(c, c3, c3, 3, 6, &peak), 9, 1e-9);
    ck_assert_double_eq_tol(peak, 9, 1e-9);
    ck_assert_double_eq_tol(fig3_stall(c, c3, c3, 4, 6, NULL), 12, 1e-9); /* step 16 */
    /* placement B: request 2 alone on the link, 6 slices in 6 block-times: no stall (the text; the
     * printed Alg. 1 gives 3) */
    ck_assert_double_eq_tol(fig3_stall(c, 0, c3, 3, 6, NULL), 0, 1e-9);
    ck_assert_double_eq_tol(fig3_stall(c, 0, c3, 4, 6, NULL), 0, 1e-9);
    /* placement C under the stated rule (equal shares from t = 0): request 2's L3 shares the link with
     * request 1's L4 and lands at 9 (stall 3), and L6 shares it with L8 (stall 3 more): 6 at step 1,
     * where the figure draws 0 (and 2 at step 16) because it serves the nearest layer first. 10 slices
     * are in flight at once at step 16 against Eq. 1's 6. */
    ck_assert_double_eq_tol(fig3_stall(c, c2, c3, 3, 6, NULL), 6, 1e-9);
    double s16 = fig3_stall(c, c2, c3, 4, 6, &peak);
    ck_assert_double_eq_tol(peak, 10, 1e-9);
    ck_assert_double_gt(s16, 2);
}
KVB_TEST_END

KVB_TEST(sim_rule) {
    /* one request, one offloaded layer (index 3 of 6), layer compute 2, 10 slices at 4/s, latency 0.5:
     * launched at 0, moving from 0.5, lands at 3.0; layer 3 could start at 6: no stall */
    kvb_of_cand cd;
    memset(&cd, 0, sizeof cd);
    kvb_of_layer_add(&cd.off, 3);
    cd.n_off = 1;
    cd.n_slots = 1;
    double comp[6] = {2, 2, 2, 2, 2, 2}, start[6];
    kvb_of_sim_req r = {.cand = &cd, .slices = 10};
    kvb_of_sim_out o;
    ck_assert_double_eq_tol(kvb_of_sim(comp, 6, 4.0, 0.5, &r, 1, &o, start), 12, 1e-12);
    /* 40 slices: lands at 10.5, layer 3 starts there (stall 4.5) */
    r.slices = 40;
    ck_assert_double_eq_tol(kvb_of_sim(comp, 6, 4.0, 0.5, &r, 1, &o, start), 16.5, 1e-12);
    ck_assert_double_eq_tol(start[3], 10.5, 1e-12);
    ck_assert_double_eq_tol(o.stall, 4.5, 1e-12);
    ck_assert_double_eq_tol(o.fetched, 40, 1e-12);
    /* a layer right after an offloaded one reuses the single slot: layers 3 and 4 offloaded, 8 slices
     * each at 4/s: L3 lands at 2 (no stall at 6); L4 launches when L3 has computed (8) and lands at 10 */
    kvb_of_layer_add(&cd.off, 4);
    cd.n_off = 2;
    r.slices = 8;
    ck_assert_double_eq_tol(kvb_of_sim(comp, 6, 4.0, 0.0, &r, 1, &o, start), 14, 1e-12);
    ck_assert_double_eq_tol(start[4], 10, 1e-12);
    /* two slots (DeepSpeed): both launch at 0 sharing the link, L3 and L4 land at 4; no stall */
    cd.n_slots = 2;
    ck_assert_double_eq_tol(kvb_of_sim(comp, 6, 4.0, 0.0, &r, 1, &o, start), 12, 1e-12);
    ck_assert_double_eq_tol(o.peak_inflight, 16, 1e-12);
    /* progress is kept across layers and shares are redistributed: request a fetches 6 for layer 2,
     * request b 2 for layer 1, at 1/s, compute 1 per layer: both move at 1/2 until b lands at 4 (layer 1
     * starts at 4 after layer 0 ended at 1), then a alone: 4 left... a had 2 moved, lands at 8 */
    kvb_of_cand ca, cb;
    memset(&ca, 0, sizeof ca);
    memset(&cb, 0, sizeof cb);
    kvb_of_layer_add(&ca.off, 2);
    ca.n_off = ca.n_slots = 1;
    kvb_of_layer_add(&cb.off, 1);
    cb.n_off = cb.n_slots = 1;
    double comp1[3] = {1, 1, 1};
    kvb_of_sim_req two[2] = {{.cand = &ca, .slices = 6}, {.cand = &cb, .slices = 2}};
    ck_assert_double_eq_tol(kvb_of_sim(comp1, 3, 1.0, 0.0, two, 2, &o, start), 9, 1e-12);
    ck_assert_double_eq_tol(start[1], 4, 1e-12);
    ck_assert_double_eq_tol(start[2], 8, 1e-12);
}
KVB_TEST_END

/* ---------------------------------------------------------------- random instances */

static uint64_t rng_state;
static uint64_t rnd(void) {
    rng_state ^= rng_state << 13;
    rng_state ^= rng_state >> 7;
    rng_state ^= rng_state << 17;
    return rng_state;
}
static int rnd_int(int lo, int hi) { return lo + (int)(rnd() % (uint64_t)(hi - lo + 1)); }
static double rnd_unit(void) { return (double)(rnd() >> 11) / 9007199254740992.0; }

typedef struct inst {
    kvb_of_profile prof;
    kvb_of_cand cands[KVB_OF_MAX_CANDS];
    kvb_of_req reqs[KVB_OF_MAX_REQS];
    kvb_of_segment segs[4];
    uint8_t excl[KVB_OF_MAX_REQS];
    kvb_of_problem p;
} inst;

/* A small random problem: a few requests, a few layers, D(L) or arbitrary candidates, shared prefixes,
 * Token-Deposit slack, a budget between the least and the most any placement needs. */
static void random_instance(inst *I, int max_reqs, int max_layers) {
    memset(I, 0, sizeof *I);
    int L = rnd_int(2, max_layers), R = rnd_int(1, max_reqs), bs = rnd_int(1, 3) * 4;
    kvb_of_profile_uniform(&I->prof, L, 0, 0, 0.5 + 4 * rnd_unit(), rnd() % 3 ? 0 : 0.3 * rnd_unit());
    for (int l = 0; l < L; l++) {
        I->prof.a[l] = 0.2 + rnd_unit();
        I->prof.c[l] = 0.002 * rnd_unit();
    }
    int n;
    if (rnd() % 2) {
        n = kvb_of_candidates(L, I->cands, KVB_OF_MAX_CANDS);
    } else {
        n = rnd_int(1, 5);
        for (int i = 0; i < n; i++) {
            kvb_of_cand *c = &I->cands[i];
            c->distance = -1;
            c->n_slots = rnd() % 4 ? 1 : 2;
            for (int l = 0; l < L; l++)
                if (i && rnd() % 3 == 0) kvb_of_layer_add(&c->off, l), c->n_off++;
        }
    }
    for (int r = 0; r < R; r++) {
        I->reqs[r].len = rnd_int(1, 60);
        I->reqs[r].slo = rnd() % 4 ? (0.5 + rnd_unit()) * L * 0.8 : 0;
        I->reqs[r].slack = rnd() % 2 ? rnd_unit() * L : 0;
        I->reqs[r].deposit = rnd_int(0, 5);
        I->excl[r] = R > 1 && rnd() % 6 == 0;
    }
    int ns = 0;
    if (R > 1 && rnd() % 2) { /* a shared prefix of the first two (full blocks of both) */
        int64_t full = KVB_MIN(I->reqs[0].len, I->reqs[1].len) / bs;
        if (full > 0) I->segs[ns++] = (kvb_of_segment){.n_blocks = rnd_int(1, (int)full), .owners = 3};
    }
    I->p = (kvb_of_problem){.prof = &I->prof, .block_size = bs, .reqs = I->reqs, .n_reqs = R,
                            .excluded = rnd() % 2 ? I->excl : NULL, .segs = I->segs, .n_segs = ns,
                            .cands = I->cands, .n_cands = n, .ahead = rnd_int(0, 1),
                            .delta_min = rnd_int(1, 3), .alpha = rnd() % 3 ? 1 : 0,
                            .enforce_slo = rnd() % 4 != 0, .mode = rnd() % 5 ? KVB_OF_REQUEST_WISE : KVB_OF_UNIFORM};
    I->p.delta_max = I->p.delta_min + rnd_int(0, 12);
    /* budget between the smallest and the largest placement at step 0 */
    int lo[KVB_OF_MAX_REQS], hi[KVB_OF_MAX_REQS];
    for (int r = 0; r < R; r++) {
        lo[r] = 0, hi[r] = 0;
        for (int c = 1; c < n; c++) {
            if (I->cands[c].n_off > I->cands[lo[r]].n_off) lo[r] = c;
            if (I->cands[c].n_off < I->cands[hi[r]].n_off) hi[r] = c;
        }
    }
    int64_t mlo = kvb_of_memory(&I->p, lo, 0, NULL), mhi = kvb_of_memory(&I->p, hi, 0, NULL);
    if (mlo > mhi) {
        int64_t t = mlo;
        mlo = mhi;
        mhi = t;
    }
    I->p.budget = mlo + (int64_t)((double)(mhi - mlo + 8) * rnd_unit());
}

static void assert_same(const kvb_of_problem *p, const kvb_of_solution *a, const kvb_of_solution *b, int it) {
    ck_assert_msg(a->feasible == b->feasible, "instance %d: feasible %d vs brute %d", it, a->feasible, b->feasible);
    if (!a->feasible) return;
    for (int r = 0; r < p->n_reqs; r++)
        ck_assert_msg(a->cand[r] == b->cand[r], "instance %d: request %d candidate %d vs brute %d", it, r,
                      a->cand[r], b->cand[r]);
    ck_assert_int_eq(a->delta, b->delta);
    ck_assert_double_eq(a->t_batch, b->t_batch);
    ck_assert_int_eq(a->fetched, b->fetched);
    ck_assert_int_eq(a->mem, b->mem);
    ck_assert_int_le(a->mem, p->budget);
    ck_assert(a->exact);
}

KVB_TEST(solver_equals_brute_force) {
    rng_state = 0x2545f4914f6cdd1dull;
    int feasible = 0, infeasible = 0;
    int64_t nodes = 0, brute_nodes = 0;
    static inst I;
    for (int it = 0; it < 1500; it++) {
        random_instance(&I, 4, 10);
        kvb_of_solution s, b;
        ck_assert_int_eq(kvb_of_solve(&I.p, &s), KVB_OK);
        ck_assert_int_eq(kvb_of_solve_brute(&I.p, &b), KVB_OK);
        assert_same(&I.p, &s, &b, it);
        feasible += s.feasible;
        infeasible += !s.feasible;
        nodes += s.evals;
        brute_nodes += b.evals;
        if (s.feasible) { /* the window really holds: the budget at every step, the SLO on average */
            for (int st = 0; st < s.delta; st++) ck_assert_int_le(kvb_of_memory(&I.p, s.cand, st, NULL), I.p.budget);
            if (I.p.enforce_slo) ck_assert(s.fails <= I.p.alpha * s.delta);
        }
    }
    /* both outcomes occur, and the bounds cut most of the evaluations */
    ck_assert_int_gt(feasible, 300);
    ck_assert_int_gt(infeasible, 50);
    ck_assert_int_lt(nodes * 2, brute_nodes);
}
KVB_TEST_END

KVB_TEST(lower_bounds_hold) {
    /* the solver's bounds: T >= sum of comp, T >= each one-slot request alone on the link */
    rng_state = 0x9e3779b97f4a7c15ull;
    static inst I;
    for (int it = 0; it < 2000; it++) {
        random_instance(&I, 5, 16);
        int cand[KVB_OF_MAX_REQS];
        for (int r = 0; r < I.p.n_reqs; r++) cand[r] = rnd_int(0, I.p.n_cands - 1);
        int s = rnd_int(0, 5);
        kvb_of_sim_out o;
        double t = kvb_of_step_latency(&I.p, cand, s, &o);
        ck_assert(o.stall >= -1e-9);
        int64_t buf;
        kvb_of_memory(&I.p, cand, s, &buf);
        ck_assert_msg(o.peak_inflight <= (double)buf + 1e-9, "in flight %g > buffer %lld", o.peak_inflight,
                      (long long)buf);
        double comp[KVB_OF_MAX_LAYERS];
        double tok = 0;
        for (int r = 0; r < I.p.n_reqs; r++)
            if (!I.p.excluded || !I.p.excluded[r]) tok += (double)(I.reqs[r].len + I.p.ahead + s);
        kvb_of_profile_comp(&I.prof, tok, comp);
        for (int r = 0; r < I.p.n_reqs; r++) {
            if ((I.p.excluded && I.p.excluded[r]) || I.cands[cand[r]].n_slots != 1) continue;
            kvb_of_sim_req one = {.cand = &I.cands[cand[r]],
                                  .slices = (double)kvb_of_blocks(I.reqs[r].len, I.p.ahead, s, I.p.block_size) -
                                            (I.p.n_segs && (I.segs[0].owners >> r & 1) ? I.segs[0].n_blocks : 0)};
            double alone = kvb_of_sim(comp, I.prof.n_layers, I.prof.bw, I.prof.lat, &one, 1, NULL, NULL);
            ck_assert_msg(alone <= t * (1 + 1e-12), "instance %d: alone %.9g > batch %.9g", it, alone, t);
        }
    }
}
KVB_TEST_END

KVB_TEST(solver_fig3) {
    /* step 1 of Fig. 3 with the budget of 70: B is the optimum (no stall, fewest slices fetched among
     * placements without stall); the solver agrees with brute force at every step up to 16 */
    static fig3 F;
    fig3_init(&F);
    kvb_of_cand *c = F.c;
    int n = F.n;
    kvb_of_req *reqs = F.reqs;
    kvb_of_problem p = F.p;
    kvb_of_solution s, b;
    ck_assert_int_eq(kvb_of_solve(&p, &s), KVB_OK);
    ck_assert(s.feasible);
    ck_assert_int_eq(s.cand[0], 0);
    ck_assert_int_eq(s.cand[1], cand_with(c, n, 3));
    ck_assert_double_eq_tol(s.t_batch, 27, 1e-9);
    ck_assert_int_eq(s.mem, 69);
    for (int step = 0; step < 16; step++) {
        reqs[0].len = 40 + step;
        reqs[1].len = 81 + step;
        ck_assert_int_eq(kvb_of_solve(&p, &s), KVB_OK);
        ck_assert_int_eq(kvb_of_solve_brute(&p, &b), KVB_OK);
        assert_same(&p, &s, &b, step);
    }
    /* Batch-Uniform at step 16 is placement A (the only uniform one that fits), stall 12 */
    p.mode = KVB_OF_UNIFORM;
    ck_assert_int_eq(kvb_of_solve(&p, &s), KVB_OK);
    ck_assert_int_eq(s.cand[0], cand_with(c, n, 3));
    ck_assert_double_eq_tol(s.t_batch, 39, 1e-9);
}
KVB_TEST_END

KVB_TEST(window_and_ties) {
    /* one request growing across a block boundary, 4 layers of 1 s, 4-token blocks, budget 16 slices */
    kvb_of_profile prof;
    kvb_of_profile_uniform(&prof, 4, 1.0, 0.0, 2.0, 0.0);
    kvb_of_cand c[4];
    int n = kvb_of_candidates(4, c, 4); /* 0: all-resident, 1: L4, 2: L2 and L4 */
    ck_assert_int_eq(n, 3);
    kvb_of_req r = {.len = 13};
    kvb_of_problem p = {.prof = &prof, .block_size = 4, .budget = 16, .reqs = &r, .n_reqs = 1, .cands = c,
                        .n_cands = n, .ahead = 0, .delta_min = 1, .delta_max = 8, .alpha = 1};
    /* slow link (4 slices take 2 s): all-resident and L4 take 4 s, L2+L4 stalls. All-resident holds
     * 4 blocks x 4 layers = 16 for lengths 13..16 (steps 0-3) and 20 at 17: a window of 4. L4 lasts as
     * long (12 + 4, then 15 + 5) and fetches more: all-resident wins. */
    kvb_of_solution s;
    ck_assert_int_eq(kvb_of_solve(&p, &s), KVB_OK);
    ck_assert_int_eq(s.cand[0], 0);
    ck_assert_int_eq(s.delta, 4);
    ck_assert_double_eq_tol(s.t_batch, 4, 1e-12);
    /* a minimum window longer than 4 leaves only L2+L4 (8 + 4 up to length 16, 10 + 5 up to 20) */
    p.delta_min = 5;
    ck_assert_int_eq(kvb_of_solve(&p, &s), KVB_OK);
    ck_assert_int_eq(s.cand[0], 2);
    ck_assert_int_eq(s.delta, 8);
    ck_assert_double_gt(s.t_batch, 4);
    /* a fast link: all three take 4 s; the tie goes to the longest window, L2+L4 */
    prof.bw = 100;
    p.delta_min = 1;
    ck_assert_int_eq(kvb_of_solve(&p, &s), KVB_OK);
    ck_assert_int_eq(s.cand[0], 2);
    ck_assert_int_eq(s.delta, 8);
    for (int ci = 0; ci < n; ci++) {
        kvb_of_solution e;
        kvb_of_evaluate(&p, &ci, &e);
        ck_assert(e.feasible);
        ck_assert_double_eq_tol(e.t_batch, 4, 1e-12);
        if (ci != 2) ck_assert(kvb_of_better(&s, &e));
    }
    /* infeasible: the budget cannot hold even the most offloaded placement */
    p.budget = 5;
    ck_assert_int_eq(kvb_of_solve(&p, &s), KVB_OK);
    ck_assert(!s.feasible);
}
KVB_TEST_END

KVB_TEST(token_deposit_window) {
    /* fake clock: steps of 15 ms, SLO 10 ms, the newest token due 25 ms after it was generated. Tokens
     * are generated at 15, 30, 45, 60, 75, 90 and due at 35, 45, 55, 65, 75, 90: the sixth is the first
     * delivered late (the deposit ran dry), so a window of 5 steps has no failure and 6 has one. */
    kvb_of_profile prof;
    kvb_of_profile_uniform(&prof, 1, 0.015, 0.0, 1.0, 0.0);
    kvb_of_cand c;
    kvb_of_cand_distance(1, 0, &c);
    kvb_of_req r = {.len = 1, .slo = 0.010, .slack = kvb_of_slack(1000000000ull, 1025000000ull)};
    ck_assert_double_eq_tol(r.slack, 0.025, 1e-12);
    kvb_of_problem p = {.prof = &prof, .block_size = 16, .budget = 100, .reqs = &r, .n_reqs = 1, .cands = &c,
                        .n_cands = 1, .delta_min = 1, .delta_max = 6, .alpha = 0, .enforce_slo = 1};
    int cand = 0;
    kvb_of_solution s;
    kvb_of_evaluate(&p, &cand, &s);
    ck_assert_int_eq(s.delta, 5);
    ck_assert_int_eq(s.fails, 0);
    /* the same deliveries from the shared function */
    uint64_t gen[7] = {0, 15, 30, 45, 60, 75, 90}, deliv[7];
    uint64_t prev = 25;
    for (int i = 1; i < 7; i++) {
        deliv[i] = kvb_deposit_next(0, prev, gen[i], 10);
        prev = deliv[i];
    }
    ck_assert_uint_eq(deliv[5], 75);
    ck_assert_uint_eq(deliv[6], 90);
    /* alpha = 1 tolerates one failure per step on average: the whole window */
    p.alpha = 1;
    kvb_of_evaluate(&p, &cand, &s);
    ck_assert_int_eq(s.delta, 6);
    ck_assert_int_eq(s.fails, 1);
    /* without Token-Deposit every step fails (15 > 10) */
    r.slack = 0;
    p.alpha = 0;
    kvb_of_evaluate(&p, &cand, &s);
    ck_assert(!s.feasible);
    ck_assert_double_eq(kvb_of_slack(10, 5), 0);
}
KVB_TEST_END

KVB_TEST(pause_resume) {
    kvb_of_req reqs[3] = {{.len = 100, .deposit = 0}, {.len = 80, .deposit = 30}, {.len = 20, .deposit = 0}};
    /* score in tokens: KV + deposited: 100, 110, 20 */
    ck_assert_int_eq(kvb_of_pick_victim(reqs, 3, NULL, KVB_OF_VICTIM_SCORE, NULL), 1);
    ck_assert_int_eq(kvb_of_pick_victim(reqs, 3, NULL, KVB_OF_VICTIM_LONGEST, NULL), 0);
    ck_assert_int_eq(kvb_of_pick_victim(reqs, 3, NULL, KVB_OF_VICTIM_SHORTEST, NULL), 2);
    uint8_t ex[3] = {0, 1, 1};
    ck_assert_int_eq(kvb_of_pick_victim(reqs, 3, ex, KVB_OF_VICTIM_SCORE, NULL), -1); /* a lone request */
    uint64_t rng = 7;
    int seen[3] = {0};
    for (int i = 0; i < 300; i++) seen[kvb_of_pick_victim(reqs, 3, NULL, KVB_OF_VICTIM_RANDOM, &rng)]++;
    for (int i = 0; i < 3; i++) ck_assert_int_gt(seen[i], 50);

    /* two requests that cannot both meet a tight SLO: the larger score is paused and the other runs;
     * alone, the paused one would run best-effort */
    kvb_of_profile prof;
    kvb_of_profile_uniform(&prof, 8, 0.001, 1e-6, 50.0, 0.0);
    kvb_of_cand c[8];
    int n = kvb_of_candidates(8, c, 8);
    reqs[0] = (kvb_of_req){.len = 200, .slo = 0.012};
    reqs[1] = (kvb_of_req){.len = 600, .slo = 0.012, .deposit = 5};
    kvb_of_problem p = {.prof = &prof, .block_size = 16, .budget = 400, .reqs = reqs, .n_reqs = 2, .cands = c,
                        .n_cands = n, .ahead = 1, .delta_min = 2, .delta_max = 16, .alpha = 0, .enforce_slo = 1};
    kvb_of_plan_out po;
    ck_assert_int_eq(kvb_of_plan(&p, KVB_OF_VICTIM_SCORE, NULL, &po), KVB_OK);
    ck_assert_int_eq(po.n_paused, 1);
    ck_assert_int_eq(po.paused[1], 1);
    ck_assert(po.sol.feasible);
    ck_assert_int_eq(po.sol.cand[1], -1);
    ck_assert_int_ge(po.sol.cand[0], 0);
    ck_assert(!po.best_effort);
    /* the paused one alone misses the SLO: it is not paused again, it runs best-effort */
    uint8_t only1[2] = {1, 0};
    p.excluded = only1;
    ck_assert_int_eq(kvb_of_plan(&p, KVB_OF_VICTIM_SCORE, NULL, &po), KVB_OK);
    ck_assert_int_eq(po.n_paused, 0);
    ck_assert(po.sol.feasible);
    ck_assert(po.best_effort);
    /* a budget nothing fits: infeasible even best-effort */
    p.budget = 10;
    ck_assert_int_eq(kvb_of_plan(&p, KVB_OF_VICTIM_SCORE, NULL, &po), KVB_OK);
    ck_assert(!po.sol.feasible);
}
KVB_TEST_END

KVB_TEST(controller) {
    kvb_of_ctl c;
    kvb_of_ctl_init(&c, 2, 0.2);
    ck_assert_uint_eq(kvb_of_ctl_check(&c, 0, 0, 0, 0, 1.0), KVB_OF_TRIG_WINDOW); /* no plan yet */
    kvb_of_solution s;
    memset(&s, 0, sizeof s);
    s.delta = 4;
    for (int i = 0; i < 4; i++) s.pred[i] = 0.010;
    kvb_of_ctl_install(&c, 10, &s);
    ck_assert_uint_eq(kvb_of_ctl_check(&c, 10, 0, 0, 0, 0.0105), 0);
    ck_assert_uint_eq(kvb_of_ctl_check(&c, 11, 0, 0, 0, 0.0110), 0); /* 10% off: within 20% */
    /* 50% off: mismatch; again at the next step: suppressed (Δmin = 2); a prefill step is not compared */
    ck_assert_uint_eq(kvb_of_ctl_check(&c, 12, 0, 0, 1, 0.1), 0);
    ck_assert_uint_eq(kvb_of_ctl_check(&c, 12, 0, 0, 0, 0.015), KVB_OF_TRIG_MISMATCH);
    ck_assert_uint_eq(kvb_of_ctl_check(&c, 13, 0, 0, 0, 0.015), KVB_OF_TRIG_WINDOW); /* last step of Δ = 4 */
    kvb_of_ctl_install(&c, 14, &s);
    ck_assert_uint_eq(kvb_of_ctl_check(&c, 14, 0, 0, 0, 0.015), KVB_OF_TRIG_MISMATCH);
    /* batch change and budget fire at once */
    ck_assert_uint_eq(kvb_of_ctl_check(&c, 15, 1, 1, 0, 0.010), KVB_OF_TRIG_BATCH | KVB_OF_TRIG_MEMORY);
    ck_assert_int_eq(c.n_mismatch, 2);
    ck_assert_int_eq(c.n_batch, 1);
}
KVB_TEST_END

KVB_TEST(profile) {
    /* two layers: 1 ms + 2 us/token, 3 ms flat; measured at 100, 200, 400 tokens */
    double tok[3] = {100, 200, 400}, times[6];
    for (int i = 0; i < 3; i++) {
        times[i * 2 + 0] = 0.001 + 2e-6 * tok[i];
        times[i * 2 + 1] = 0.003;
    }
    kvb_of_profile p;
    kvb_of_profile_uniform(&p, 2, 0, 0, 10, 0);
    ck_assert_int_eq(kvb_of_profile_fit(&p, 2, tok, times, 3), KVB_OK);
    ck_assert_double_eq_tol(p.a[0], 0.001, 1e-12);
    ck_assert_double_eq_tol(p.c[0], 2e-6, 1e-15);
    ck_assert_double_eq_tol(p.a[1], 0.003, 1e-12);
    ck_assert_double_eq_tol(p.c[1], 0, 1e-15);
    double comp[2];
    kvb_of_profile_comp(&p, 300, comp);
    ck_assert_double_eq_tol(comp[0], 0.0016, 1e-12);
    /* layer 0 runs twice as slow: the EWMA moves a quarter of the way each time */
    double obs[2] = {0.0032, 0.003};
    kvb_of_profile_observe(&p, 300, obs, 20, 0.25);
    ck_assert_double_eq_tol(p.scale[0], 1.25, 1e-9);
    ck_assert_double_eq_tol(p.scale[1], 1.0, 1e-9);
    ck_assert_double_eq_tol(p.bw, 12.5, 1e-9);
    double same[3] = {100, 100, 100};
    ck_assert_int_eq(kvb_of_profile_fit(&p, 2, same, times, 3), KVB_ERR_INVALID);
}
KVB_TEST_END

KVB_TEST(baselines) {
    static fig3 F;
    fig3_init(&F);
    kvb_of_cand *c = F.c;
    int n = F.n;
    kvb_of_req *reqs = F.reqs;
    kvb_of_problem p = F.p;
    /* FlexGen from the worst case. 2 requests of 96 tokens (6 blocks each): all-resident needs 108,
     * c = 1..4 need 108, 96, 84, 72: nothing fits the 70, so the most offloaded. 2 requests of 64 (4 blocks):
     * c = 2, 3, 4 fit (64, 56, 48); c = 2 hides its 8 slices per offloaded layer under 3 layers of compute,
     * c = 3 cannot (8 against 6): c = 2. */
    ck_assert_int_eq(kvb_of_flexgen_static(&p, 2, 96), n - 1);
    ck_assert_int_eq(kvb_of_flexgen_static(&p, 2, 64), cand_with(c, n, 2));
    /* FlexGen+ at final lengths 55 and 96 (step 16): A is the only uniform fit */
    int64_t fin[2] = {55, 96};
    ck_assert_int_eq(kvb_of_flexgen_batch(&p, fin), cand_with(c, n, 3));
    /* dynamic heuristic at step 16: offloads the larger request first until the budget holds */
    reqs[0].len = 55;
    reqs[1].len = 96;
    int dh[2];
    ck_assert_int_eq(kvb_of_dynamic_heuristic(&p, dh), 1);
    ck_assert_int_le(kvb_of_memory(&p, dh, 0, NULL), 70);
    int prev[2] = {dh[0], dh[1]};
    if (prev[1] > 0) prev[1]--; else prev[0]--;
    ck_assert_int_gt(kvb_of_memory(&p, prev, 0, NULL), 70); /* one step less does not fit */
    /* SLO-aware table: a loose SLO takes the most offloaded candidate that fits; a tight one the fastest */
    kvb_of_slo_table t;
    ck_assert_int_eq(kvb_of_slo_table_build(&p, 1000, 2, 192, 32, &t), KVB_OK);
    ck_assert_int_eq(kvb_of_slo_table_lookup(&t, 1, 1), n - 1);
    kvb_of_slo_table_free(&t);
    ck_assert_int_eq(kvb_of_slo_table_build(&p, 27.5, 2, 192, 32, &t), KVB_OK);
    /* one request of 32 tokens (2 blocks): 2 blocks per offloaded layer, all hidden under 6 of compute
     * for c <= 3; c = 4 (every other layer, 2 per 3 of compute) too: the most offloaded meeting 27.5 */
    int e = kvb_of_slo_table_lookup(&t, 1, 32);
    ck_assert_int_ge(e, 0);
    int ce[1] = {e};
    kvb_of_req one = {.len = 32};
    kvb_of_problem q = p;
    q.reqs = &one;
    q.n_reqs = 1;
    ck_assert(kvb_of_step_latency(&q, ce, 0, NULL) <= 27.5);
    for (int ci = 0; ci < n; ci++) {
        int cc[1] = {ci};
        if (c[ci].n_off > c[e].n_off) ck_assert(kvb_of_step_latency(&q, cc, 0, NULL) > 27.5);
    }
    ck_assert_int_eq(kvb_of_slo_table_lookup(&t, 5, 100000), t.entry[1 * t.n_cols + t.n_cols - 1]);
    kvb_of_slo_table_free(&t);
    kvb_of_slo_table_free(NULL);
}
KVB_TEST_END

KVB_TEST(bad_problems) {
    static fig3 F;
    fig3_init(&F);
    kvb_of_problem p = F.p;
    kvb_of_solution s;
    kvb_of_problem q = p;
    q.delta_min = 0;
    ck_assert_int_eq(kvb_of_solve(&q, &s), KVB_ERR_INVALID);
    q = p;
    q.delta_max = KVB_OF_MAX_WINDOW + 1;
    ck_assert_int_eq(kvb_of_solve(&q, &s), KVB_ERR_INVALID);
    kvb_of_profile slow = F.prof;
    slow.bw = 0;
    q = p;
    q.prof = &slow;
    ck_assert_int_eq(kvb_of_solve(&q, &s), KVB_ERR_INVALID);
    kvb_of_segment seg = {.n_blocks = 4, .owners = 3}; /* request 1 has only 2 full blocks */
    q = p;
    q.segs = &seg;
    q.n_segs = 1;
    ck_assert_int_eq(kvb_of_solve(&q, &s), KVB_ERR_INVALID);
    seg = (kvb_of_segment){.n_blocks = 1, .owners = 4}; /* no request 2 */
    ck_assert_int_eq(kvb_of_solve(&q, &s), KVB_ERR_INVALID);
    ck_assert_int_eq(kvb_of_solve_brute(&q, &s), KVB_ERR_INVALID);
}
KVB_TEST_END

KVB_TEST_MAIN("orbitflow", KVB_T(dl_candidates, 10), KVB_T(fig3_memory, 10), KVB_T(fig3_stalls, 10),
              KVB_T(sim_rule, 10), KVB_T(solver_equals_brute_force, 120), KVB_T(lower_bounds_hold, 60),
              KVB_T(solver_fig3, 10), KVB_T(window_and_ties, 10), KVB_T(token_deposit_window, 10),
              KVB_T(pause_resume, 10), KVB_T(controller, 10), KVB_T(profile, 10), KVB_T(baselines, 10),
              KVB_T(bad_problems, 10))
