/* kvbank — OrbitFlow's placement solver (../shared/papers/orbitflow.txt §3.3): an exact branch and bound
 * over the pruned space (one candidate per request), brute force for tests, and the Pause-Resume loop
 * around them (§3.4).
 *
 * The paper hands an ILP to Gurobi; the latency model (§3.3.1, a simulation with bandwidth sharing) is
 * not linear, so kvbank searches the candidate vectors directly. Requests are assigned in the given
 * order, candidates in index order, so the search visits full assignments in lexicographic order and a
 * later assignment that ties an earlier one on every key loses (the last tie-break). A subtree is cut
 * when a valid bound shows no assignment in it can beat the best one found:
 *  - latency: every step takes at least the sum of its compute; the slices layers <= l need must cross
 *    the link (at most bw slices/s, from lat on) before layer l starts, and the layers from l on still
 *    compute (LB3); a request's own transfers are no faster than when it is alone on the link (LB2, the
 *    model run with that request only, valid for one-slot candidates: its launches and landings can only
 *    be later in company). Both grow with the window step (more tokens, more blocks).
 *  - memory: assigned requests exactly (without shared-block extras in their buffers), unassigned ones at
 *    their smallest candidate; shared blocks at least what the assigned owners keep.
 *  - SLO: failures are monotone in the step latencies, so the latency bound bounds them from below; with
 *    the memory bound this bounds the largest feasible window from above.
 *  - fetched slices: at least those of the assigned requests' own blocks. */
#include <string.h>

#include "common/policy/orbitflow.h"
#include "common/policy/orbitflow_impl.h"

int kvb_of_better(const kvb_of_solution *a, const kvb_of_solution *b) {
    if (a->feasible != b->feasible) return a->feasible;
    if (!a->feasible) return 0;
    int64_t ta = kvb__of_ns(a->t_batch), tb = kvb__of_ns(b->t_batch);
    if (ta != tb) return ta < tb;
    if (a->delta != b->delta) return a->delta > b->delta;
    if (a->fetched != b->fetched) return a->fetched < b->fetched;
    for (int r = 0; r < KVB_OF_MAX_REQS; r++)
        if (a->cand[r] != b->cand[r]) return a->cand[r] < b->cand[r];
    return 0;
}

typedef struct bb {
    const kvb_of_problem *p;
    int L, n_act, act[KVB_OF_MAX_REQS];
    double comp0[KVB_OF_MAX_LAYERS], suffix0[KVB_OF_MAX_LAYERS + 1];
    double sumcomp[KVB_OF_MAX_WINDOW]; /* sum of comp at window step s */
    int64_t shared[KVB_OF_MAX_REQS];
    int64_t own[KVB_OF_MAX_REQS][KVB_OF_MAX_WINDOW]; /* own blocks of request r at window step s */
    double lb2[KVB_OF_MAX_REQS][KVB_OF_MAX_CANDS];
    int cnt[KVB_OF_MAX_CANDS][KVB_OF_MAX_LAYERS]; /* offloaded layers <= l */
    int64_t memf[KVB_OF_MAX_CANDS];               /* slices per own block: resident layers + slots */
    int64_t memf_min;
    int max_noff;
    int cur[KVB_OF_MAX_REQS];
    double vol[KVB_OF_MAX_LAYERS]; /* own slices the assigned requests fetch for layers <= l, step 0 */
    kvb_of_solution best, scratch;
    int have_best;
    int64_t nodes, evals;
    int aborted;
} bb;

static int64_t own(const bb *B, int r, int s) { return B->own[r][s]; }

static void bb_init(bb *B, const kvb_of_problem *p) {
    B->p = p;
    B->L = p->prof->n_layers;
    B->n_act = 0;
    for (int r = 0; r < p->n_reqs; r++) {
        B->cur[r] = -1;
        B->shared[r] = kvb__of_shared(p, r);
        if (!kvb__of_active(p, r)) continue;
        B->act[B->n_act++] = r;
        for (int s = 0; s < p->delta_max; s++)
            B->own[r][s] = kvb_of_blocks(p->reqs[r].len, p->ahead, s, p->block_size) - B->shared[r];
    }
    int L = B->L;
    kvb_of_profile_comp(p->prof, kvb__of_tokens(p, 0), B->comp0);
    B->suffix0[L] = 0;
    for (int l = L - 1; l >= 0; l--) B->suffix0[l] = B->suffix0[l + 1] + B->comp0[l];
    for (int s = 0; s < p->delta_max; s++) {
        double comp[KVB_OF_MAX_LAYERS], sum = 0;
        kvb_of_profile_comp(p->prof, kvb__of_tokens(p, s), comp);
        for (int l = 0; l < L; l++) sum += comp[l];
        B->sumcomp[s] = sum;
    }
    B->memf_min = INT64_MAX;
    B->max_noff = 0;
    for (int c = 0; c < p->n_cands; c++) {
        const kvb_of_cand *cd = &p->cands[c];
        int n = 0;
        for (int l = 0; l < L; l++) {
            n += kvb_of_layer_in(&cd->off, l);
            B->cnt[c][l] = n;
        }
        B->memf[c] = (L - cd->n_off) + (cd->n_off > 0 ? cd->n_slots : 0);
        if (B->memf[c] < B->memf_min) B->memf_min = B->memf[c];
        if (cd->n_off > B->max_noff) B->max_noff = cd->n_off;
    }
    for (int i = 0; i < B->n_act; i++) {
        int r = B->act[i];
        for (int c = 0; c < p->n_cands; c++) {
            const kvb_of_cand *cd = &p->cands[c];
            if (cd->n_off == 0 || cd->n_slots != 1) {
                B->lb2[r][c] = 0;
                continue;
            }
            kvb_of_sim_req sr = {.cand = cd, .slices = (double)own(B, r, 0), .size = NULL};
            B->lb2[r][c] = kvb_of_sim(B->comp0, L, p->prof->bw, p->prof->lat, &sr, 1, NULL, NULL);
        }
    }
    for (int l = 0; l < L; l++) B->vol[l] = 0;
    B->have_best = 0;
    B->nodes = B->evals = 0;
    B->aborted = 0;
}

/* Shared blocks' slices at least: the layers the assigned owners keep, or (with an unassigned owner)
 * the fewest a single owner can keep. */
static int64_t seg_lb(const bb *B, int depth) {
    const kvb_of_problem *p = B->p;
    int64_t sum = 0;
    for (int g = 0; g < p->n_segs; g++) {
        kvb_of_layerset kept;
        memset(&kept, 0, sizeof kept);
        int assigned = 0, open = 0;
        for (int i = 0; i < B->n_act; i++) {
            int r = B->act[i];
            if (!(p->segs[g].owners >> r & 1)) continue;
            if (i < depth) {
                assigned = 1;
                const kvb_of_cand *c = &p->cands[B->cur[r]];
                for (int w = 0; w < KVB_OF_MAX_LAYERS / 64; w++) kept.w[w] |= ~c->off.w[w];
            } else {
                open = 1;
            }
        }
        int n = 0;
        if (assigned)
            for (int l = 0; l < B->L; l++) n += kvb_of_layer_in(&kept, l);
        if (open && B->L - B->max_noff > n) n = B->L - B->max_noff;
        sum += (int64_t)n * p->segs[g].n_blocks;
    }
    return sum;
}

/* 1 if no completion of the first `depth` assignments can beat the best found so far. */
static int bb_prune(bb *B, int depth) {
    const kvb_of_problem *p = B->p;
    double lb0 = B->suffix0[0];
    for (int i = 0; i < depth; i++) {
        int r = B->act[i];
        if (B->lb2[r][B->cur[r]] > lb0) lb0 = B->lb2[r][B->cur[r]];
    }
    for (int l = 0; l < B->L; l++) {
        if (!(B->vol[l] > 0)) continue;
        double t = p->prof->lat + B->vol[l] / p->prof->bw + B->suffix0[l];
        if (t > lb0) lb0 = t;
    }
    int64_t lbq = kvb__of_ns(lb0);
    if (B->have_best && lbq > kvb__of_ns(B->best.t_batch)) return 1;

    int64_t segs = seg_lb(B, depth);
    uint64_t due[KVB_OF_MAX_REQS], slo_ns[KVB_OF_MAX_REQS], g = 0;
    kvb__of_due_init(p, due, slo_ns);
    int cum = 0, delta_ub = 0;
    for (int s = 0; s < p->delta_max; s++) {
        int64_t mem = segs;
        for (int i = 0; i < B->n_act; i++) {
            int r = B->act[i];
            mem += (i < depth ? B->memf[B->cur[r]] : B->memf_min) * own(B, r, s);
        }
        if (mem > p->budget) break;
        if (p->enforce_slo) {
            double t = s == 0 ? lb0 : KVB_MAX(B->sumcomp[s], lb0);
            g += (uint64_t)kvb__of_ns(t);
            cum += kvb__of_fails(p->n_reqs, slo_ns, g, due);
        }
        if (s + 1 >= p->delta_min && (!p->enforce_slo || cum <= p->alpha * (s + 1))) delta_ub = s + 1;
    }
    if (!delta_ub) return 1;
    if (!B->have_best || lbq < kvb__of_ns(B->best.t_batch)) return 0;
    /* the latency bound ties the best: the window and the fetched slices decide */
    if (delta_ub != B->best.delta) return delta_ub < B->best.delta;
    int64_t fetched = 0;
    for (int i = 0; i < depth; i++) {
        int r = B->act[i];
        fetched += (int64_t)p->cands[B->cur[r]].n_off * own(B, r, 0);
    }
    return fetched >= B->best.fetched; /* an equal one comes later in lexicographic order and loses */
}

static void bb_leaf(bb *B) {
    const kvb_of_problem *p = B->p;
    if (kvb_of_memory(p, B->cur, 0, NULL) > p->budget) return;
    if (B->have_best) {
        double t0 = kvb_of_step_latency(p, B->cur, 0, NULL);
        if (kvb__of_ns(t0) > kvb__of_ns(B->best.t_batch)) return;
    }
    B->evals++;
    kvb_of_evaluate(p, B->cur, &B->scratch);
    if (B->scratch.feasible && (!B->have_best || kvb_of_better(&B->scratch, &B->best))) {
        B->best = B->scratch;
        B->have_best = 1;
    }
}

static void bb_dfs(bb *B, int depth) {
    const kvb_of_problem *p = B->p;
    if (B->aborted) return;
    if (p->max_nodes && B->nodes >= p->max_nodes) {
        B->aborted = 1;
        return;
    }
    B->nodes++;
    if (depth == B->n_act) {
        bb_leaf(B);
        return;
    }
    int r = B->act[depth];
    int64_t o = own(B, r, 0);
    for (int c = 0; c < p->n_cands && !B->aborted; c++) {
        B->cur[r] = c;
        for (int l = 0; l < B->L; l++) B->vol[l] += (double)(o * B->cnt[c][l]);
        if (!bb_prune(B, depth + 1)) bb_dfs(B, depth + 1);
        for (int l = 0; l < B->L; l++) B->vol[l] -= (double)(o * B->cnt[c][l]);
    }
    B->cur[r] = -1;
}

static void finish(bb *B, kvb_of_solution *sol) {
    if (B->have_best) {
        *sol = B->best;
    } else {
        memset(sol, 0, sizeof *sol);
        for (int r = 0; r < KVB_OF_MAX_REQS; r++) sol->cand[r] = -1;
    }
    sol->exact = !B->aborted;
    sol->nodes = B->nodes;
    sol->evals = B->evals;
}

/* Batch-Uniform (Fig. 14a): one candidate for every request, tried in index order. */
static void solve_uniform(bb *B) {
    const kvb_of_problem *p = B->p;
    for (int c = 0; c < p->n_cands; c++) {
        B->nodes++;
        for (int i = 0; i < B->n_act; i++) B->cur[B->act[i]] = c;
        bb_leaf(B);
    }
}

kvb_status kvb_of_solve(const kvb_of_problem *p, kvb_of_solution *sol) {
    KVB_TRY(kvb__of_check(p));
    bb *B;
    KVB_TRY(kvb_malloc(sizeof *B, (void **)&B));
    bb_init(B, p);
    if (p->mode == KVB_OF_UNIFORM)
        solve_uniform(B);
    else if (!bb_prune(B, 0))
        bb_dfs(B, 0);
    finish(B, sol);
    free(B);
    return KVB_OK;
}

kvb_status kvb_of_solve_brute(const kvb_of_problem *p, kvb_of_solution *sol) {
    KVB_TRY(kvb__of_check(p));
    bb *B;
    KVB_TRY(kvb_malloc(sizeof *B, (void **)&B));
    bb_init(B, p);
    if (p->mode == KVB_OF_UNIFORM) {
        solve_uniform(B);
    } else {
        int digit[KVB_OF_MAX_REQS] = {0};
        for (;;) {
            for (int i = 0; i < B->n_act; i++) B->cur[B->act[i]] = digit[i];
            B->nodes++;
            B->evals++;
            kvb_of_evaluate(p, B->cur, &B->scratch);
            if (B->scratch.feasible && (!B->have_best || kvb_of_better(&B->scratch, &B->best))) {
                B->best = B->scratch;
                B->have_best = 1;
            }
            int i = B->n_act - 1;
            while (i >= 0 && ++digit[i] == p->n_cands) digit[i--] = 0;
            if (i < 0) break;
        }
    }
    finish(B, sol);
    free(B);
    return KVB_OK;
}

/* ---------------------------------------------------------------- Pause-Resume (§3.4) */

int kvb_of_pick_victim(const kvb_of_req *reqs, int n, const uint8_t *excluded, kvb_of_victim rule, uint64_t *rng) {
    int idx[KVB_OF_MAX_REQS], m = 0;
    for (int r = 0; r < n && r < KVB_OF_MAX_REQS; r++)
        if (!excluded || !excluded[r]) idx[m++] = r;
    if (m < 2) return -1;
    if (rule == KVB_OF_VICTIM_RANDOM) {
        uint64_t x = rng && *rng ? *rng : 0x9e3779b97f4a7c15ull; /* xorshift64 */
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        if (rng) *rng = x;
        return idx[x % (uint64_t)m];
    }
    int v = idx[0];
    for (int i = 1; i < m; i++) {
        const kvb_of_req *a = &reqs[idx[i]], *b = &reqs[v];
        int64_t sa, sb;
        switch (rule) {
        case KVB_OF_VICTIM_LONGEST: sa = a->len, sb = b->len; break;
        case KVB_OF_VICTIM_SHORTEST: sa = -a->len, sb = -b->len; break;
        default: sa = a->len + a->deposit, sb = b->len + b->deposit; break; /* tokens: KV + deposited */
        }
        if (sa >= sb) v = idx[i];
    }
    return v;
}

kvb_status kvb_of_plan(const kvb_of_problem *p, kvb_of_victim rule, uint64_t *rng, kvb_of_plan_out *out) {
    KVB_TRY(kvb__of_check(p));
    memset(out, 0, sizeof *out);
    kvb_of_problem q = *p;
    uint8_t excl[KVB_OF_MAX_REQS];
    for (int r = 0; r < p->n_reqs; r++) excl[r] = p->excluded ? p->excluded[r] : 0;
    q.excluded = excl;
    for (;;) {
        KVB_TRY(kvb_of_solve(&q, &out->sol));
        if (out->sol.feasible) return KVB_OK;
        int v = kvb_of_pick_victim(q.reqs, q.n_reqs, excl, rule, rng);
        if (v < 0) break;
        excl[v] = 1;
        out->paused[v] = 1;
        out->n_paused++;
    }
    if (q.enforce_slo) { /* a lone request is never paused: the fastest plan the budget allows */
        q.enforce_slo = 0;
        KVB_TRY(kvb_of_solve(&q, &out->sol));
        out->best_effort = out->sol.feasible;
    }
    return KVB_OK;
}
