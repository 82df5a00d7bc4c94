/* kvbank — OrbitFlow's adaptive controller (§3.4), Token-Deposit slack (§3.2) and the placement rules of
 * the five baselines (§5.1) of ../shared/papers/orbitflow.txt. */
#include <math.h>
#include <string.h>

#include "common/policy/orbitflow.h"
#include "common/policy/orbitflow_impl.h"

/* ---------------------------------------------------------------- Token-Deposit */

double kvb_of_slack(uint64_t newest_gen_ns, uint64_t newest_deliv_ns) {
    return newest_deliv_ns > newest_gen_ns ? (double)(newest_deliv_ns - newest_gen_ns) * 1e-9 : 0.0;
}

/* ---------------------------------------------------------------- adaptive controller */

void kvb_of_ctl_init(kvb_of_ctl *c, int delta_min, double threshold) {
    memset(c, 0, sizeof *c);
    c->delta_min = delta_min < 1 ? 1 : delta_min;
    c->threshold = threshold;
    c->plan_step = -1;
    c->last_mismatch = INT64_MIN / 2;
}

void kvb_of_ctl_install(kvb_of_ctl *c, int64_t step, const kvb_of_solution *sol) {
    c->plan_step = step;
    c->delta = sol->delta;
    int n = KVB_MIN(sol->delta, KVB_OF_MAX_WINDOW);
    memcpy(c->pred, sol->pred, (size_t)n * sizeof c->pred[0]);
}

unsigned kvb_of_ctl_check(kvb_of_ctl *c, int64_t step, int batch_changed, int mem_short, int had_prefill,
                          double observed) {
    unsigned t = KVB_OF_TRIG_NONE;
    if (batch_changed) {
        t |= KVB_OF_TRIG_BATCH;
        c->n_batch++;
    }
    if (mem_short) {
        t |= KVB_OF_TRIG_MEMORY;
        c->n_memory++;
    }
    if (c->plan_step < 0) return t | KVB_OF_TRIG_WINDOW; /* no plan yet */
    int64_t s = step - c->plan_step;                      /* window step `step` ran as */
    if (s + 1 >= c->delta) {
        t |= KVB_OF_TRIG_WINDOW;
        c->n_window++;
    }
    if (!had_prefill && s >= 0 && s < c->delta && s < KVB_OF_MAX_WINDOW && c->pred[s] > 0 &&
        fabs(observed - c->pred[s]) > c->threshold * c->pred[s] && step - c->last_mismatch >= c->delta_min) {
        t |= KVB_OF_TRIG_MISMATCH;
        c->last_mismatch = step;
        c->n_mismatch++;
    }
    return t;
}

/* ---------------------------------------------------------------- baselines */

/* The uniform candidate with the lowest latency at step 0 whose memory fits (ties: fewer slices
 * fetched, then the lower index); -1 if none fits. */
static int uniform_fastest(const kvb_of_problem *p) {
    int cand[KVB_OF_MAX_REQS], best = -1;
    int64_t best_t = 0, best_f = 0;
    for (int c = 0; c < p->n_cands; c++) {
        for (int r = 0; r < p->n_reqs; r++) cand[r] = c;
        if (kvb_of_memory(p, cand, 0, NULL) > p->budget) continue;
        kvb_of_sim_out so;
        int64_t t = kvb__of_ns(kvb_of_step_latency(p, cand, 0, &so));
        int64_t f = (int64_t)so.fetched;
        if (best < 0 || t < best_t || (t == best_t && f < best_f)) {
            best = c;
            best_t = t;
            best_f = f;
        }
    }
    return best;
}

static int most_offloaded(const kvb_of_problem *p) {
    int best = 0;
    for (int c = 1; c < p->n_cands; c++)
        if (p->cands[c].n_off > p->cands[best].n_off) best = c;
    return best;
}

int kvb_of_flexgen_static(const kvb_of_problem *p, int n_seqs, int64_t worst_len) {
    if (n_seqs < 1 || n_seqs > KVB_OF_MAX_REQS || kvb__of_check(p) != KVB_OK) return -1;
    kvb_of_req reqs[KVB_OF_MAX_REQS];
    for (int r = 0; r < n_seqs; r++) reqs[r] = (kvb_of_req){.len = worst_len};
    kvb_of_problem q = *p;
    q.reqs = reqs;
    q.n_reqs = n_seqs;
    q.excluded = NULL;
    q.segs = NULL;
    q.n_segs = 0;
    q.ahead = 0;
    int c = uniform_fastest(&q);
    return c >= 0 ? c : most_offloaded(p);
}

int kvb_of_flexgen_batch(const kvb_of_problem *p, const int64_t *final_len) {
    if (kvb__of_check(p) != KVB_OK) return -1;
    kvb_of_req reqs[KVB_OF_MAX_REQS];
    uint8_t excl[KVB_OF_MAX_REQS];
    for (int r = 0; r < p->n_reqs; r++) {
        reqs[r] = p->reqs[r];
        reqs[r].len = final_len[r];
        excl[r] = p->excluded ? p->excluded[r] : 0;
    }
    kvb_of_problem q = *p;
    q.reqs = reqs;
    q.excluded = excl;
    q.segs = NULL; /* final lengths: shared prefixes are not modelled (counted per owner: conservative) */
    q.n_segs = 0;
    q.ahead = 0;
    int c = uniform_fastest(&q);
    return c >= 0 ? c : most_offloaded(p);
}

kvb_status kvb_of_slo_table_build(const kvb_of_problem *p, double slo, int max_seqs, int64_t max_tokens,
                                  int64_t bucket, kvb_of_slo_table *t) {
    memset(t, 0, sizeof *t);
    KVB_TRY(kvb__of_check(p));
    if (max_seqs < 1 || max_seqs > KVB_OF_MAX_REQS || bucket < 1 || max_tokens < bucket) return KVB_ERR_INVALID;
    t->max_seqs = max_seqs;
    t->max_tokens = max_tokens;
    t->bucket = bucket;
    t->n_cols = (int)KVB_DIV_CEIL(max_tokens, bucket);
    KVB_TRY(kvb_calloc((size_t)max_seqs * (size_t)t->n_cols, sizeof *t->entry, (void **)&t->entry));
    kvb_of_req reqs[KVB_OF_MAX_REQS];
    int cand[KVB_OF_MAX_REQS];
    kvb_of_problem q = *p;
    q.reqs = reqs;
    q.excluded = NULL;
    q.segs = NULL;
    q.n_segs = 0;
    q.ahead = 0;
    for (int n = 1; n <= max_seqs; n++) {
        q.n_reqs = n;
        for (int j = 0; j < t->n_cols; j++) {
            int64_t tokens = KVB_MIN((int64_t)(j + 1) * bucket, max_tokens);
            for (int r = 0; r < n; r++) reqs[r] = (kvb_of_req){.len = KVB_DIV_CEIL(tokens, (int64_t)n)};
            int meets = -1, fastest = -1;
            int64_t fastest_t = 0;
            for (int c = 0; c < p->n_cands; c++) {
                for (int r = 0; r < n; r++) cand[r] = c;
                if (kvb_of_memory(&q, cand, 0, NULL) > q.budget) continue;
                double lat = kvb_of_step_latency(&q, cand, 0, NULL);
                if (lat <= slo && (meets < 0 || p->cands[c].n_off > p->cands[meets].n_off)) meets = c;
                if (fastest < 0 || kvb__of_ns(lat) < fastest_t) {
                    fastest = c;
                    fastest_t = kvb__of_ns(lat);
                }
            }
            t->entry[(n - 1) * t->n_cols + j] = (int16_t)(meets >= 0 ? meets : fastest);
        }
    }
    return KVB_OK;
}

void kvb_of_slo_table_free(kvb_of_slo_table *t) {
    if (!t) return;
    free(t->entry);
    memset(t, 0, sizeof *t);
}

int kvb_of_slo_table_lookup(const kvb_of_slo_table *t, int n_seqs, int64_t tokens) {
    if (!t->entry || n_seqs < 1) return -1;
    int n = KVB_MIN(n_seqs, t->max_seqs);
    int64_t j = tokens <= 0 ? 0 : KVB_DIV_CEIL(tokens, t->bucket) - 1;
    if (j >= t->n_cols) j = t->n_cols - 1;
    return t->entry[(n - 1) * t->n_cols + j];
}

int kvb_of_dynamic_heuristic(const kvb_of_problem *p, int *cand) {
    for (int r = 0; r < p->n_reqs; r++) cand[r] = kvb__of_active(p, r) ? 0 : -1;
    int fixed_cand[KVB_OF_MAX_REQS];
    for (;;) {
        for (int r = 0; r < p->n_reqs; r++) fixed_cand[r] = cand[r] < 0 ? 0 : cand[r];
        if (kvb_of_memory(p, fixed_cand, 0, NULL) <= p->budget) return 1;
        int v = -1;
        int64_t vb = -1;
        for (int r = 0; r < p->n_reqs; r++) {
            if (cand[r] < 0 || cand[r] + 1 >= p->n_cands) continue;
            int64_t b = kvb_of_blocks(p->reqs[r].len, p->ahead, 0, p->block_size);
            if (b > vb) {
                vb = b;
                v = r;
            }
        }
        if (v < 0) return 0;
        cand[v]++;
    }
}
