/* kvbank — OrbitFlow: candidates, profile, the latency model and the evaluation of one placement
 * (../shared/papers/orbitflow.txt §3.3.1-3.3.2). Readings of the paper: see orbitflow.h. */
#include "common/policy/orbitflow.h"

#include <math.h>
#include <string.h>

#include "common/policy/orbitflow_impl.h"
#include "common/util/token_deposit.h"

/* ---------------------------------------------------------------- candidates */

int kvb_of_dl(int n_layers) {
    /* floor(L/k) takes each of its values on a contiguous run of k; count the runs for k = 2..L */
    int n = 0, prev = -1;
    for (int k = 2; k <= n_layers; k++) {
        int v = n_layers / k;
        if (v != prev) n++;
        prev = v;
    }
    return n;
}

void kvb_of_cand_distance(int n_layers, int c, kvb_of_cand *out) {
    memset(out, 0, sizeof *out);
    out->n_slots = 1;
    if (c <= 0) return;
    int k = n_layers / c;
    out->distance = k;
    for (int j = 1; j <= c; j++) kvb_of_layer_add(&out->off, j * k - 1);
    out->n_off = c;
}

void kvb_of_cand_all_offloaded(int n_layers, kvb_of_cand *out) {
    memset(out, 0, sizeof *out);
    for (int l = 0; l < n_layers; l++) kvb_of_layer_add(&out->off, l);
    out->n_off = n_layers;
    out->distance = 1;
    out->n_slots = 2;
}

int kvb_of_candidates(int n_layers, kvb_of_cand *out, int max) {
    int n = 0;
    if (n < max) kvb_of_cand_distance(n_layers, 0, &out[n]);
    n++;
    /* the distinct values of floor(L/k), k = L down to 2, are the counts c in increasing order */
    int prev = 0;
    for (int k = n_layers; k >= 2; k--) {
        int c = n_layers / k;
        if (c == prev) continue;
        prev = c;
        if (n < max) kvb_of_cand_distance(n_layers, c, &out[n]);
        n++;
    }
    return n;
}

/* ---------------------------------------------------------------- profile */

void kvb_of_profile_uniform(kvb_of_profile *p, int n_layers, double a, double c, double bw, double lat) {
    memset(p, 0, sizeof *p);
    p->n_layers = n_layers;
    for (int l = 0; l < n_layers; l++) {
        p->a[l] = a;
        p->c[l] = c;
        p->scale[l] = 1.0;
    }
    p->bw = bw;
    p->lat = lat;
}

kvb_status kvb_of_profile_fit(kvb_of_profile *p, int n_layers, const double *tokens, const double *times, int n) {
    if (n_layers < 1 || n_layers > KVB_OF_MAX_LAYERS || n < 2) return KVB_ERR_INVALID;
    double mx = 0;
    for (int i = 0; i < n; i++) mx += tokens[i];
    mx /= n;
    double sxx = 0;
    for (int i = 0; i < n; i++) sxx += (tokens[i] - mx) * (tokens[i] - mx);
    if (!(sxx > 0)) return KVB_ERR_INVALID;
    p->n_layers = n_layers;
    for (int l = 0; l < n_layers; l++) {
        double my = 0, sxy = 0;
        for (int i = 0; i < n; i++) my += times[i * n_layers + l];
        my /= n;
        for (int i = 0; i < n; i++) sxy += (tokens[i] - mx) * (times[i * n_layers + l] - my);
        double c = sxy / sxx, a = my - c * mx;
        if (c < 0) { /* noise: a flat layer */
            c = 0;
            a = my;
        }
        if (a < 0) { /* through the origin */
            double sx2 = 0, sxy0 = 0;
            for (int i = 0; i < n; i++) {
                sx2 += tokens[i] * tokens[i];
                sxy0 += tokens[i] * times[i * n_layers + l];
            }
            a = 0;
            c = sx2 > 0 ? sxy0 / sx2 : 0;
        }
        p->a[l] = a;
        p->c[l] = c;
        p->scale[l] = 1.0;
    }
    return KVB_OK;
}

void kvb_of_profile_comp(const kvb_of_profile *p, double tokens, double *comp) {
    for (int l = 0; l < p->n_layers; l++) comp[l] = p->scale[l] * (p->a[l] + p->c[l] * tokens);
}

void kvb_of_profile_observe(kvb_of_profile *p, double tokens, const double *layer_s, double bw, double w) {
    if (layer_s)
        for (int l = 0; l < p->n_layers; l++) {
            double base = p->a[l] + p->c[l] * tokens;
            if (!(base > 0) || !(layer_s[l] >= 0)) continue;
            p->scale[l] = (1 - w) * p->scale[l] + w * (layer_s[l] / base);
        }
    if (bw > 0) p->bw = (1 - w) * p->bw + w * bw;
}

/* ---------------------------------------------------------------- latency model */

/* A transfer: one request's slices for one layer, from launch until that layer has computed. */
typedef struct xfer {
    int req, layer;
    double size, rem; /* slices */
    double act;       /* time it starts moving data (launch + lat) */
    int done;         /* landed */
    int live;         /* holds a slot (launched, not yet consumed) */
} xfer;

typedef struct sim {
    xfer x[2 * KVB_OF_MAX_REQS];
    int nx;
    double t, bw, occupancy, peak;
} sim;

/* Advances the shared link to the next event (a transfer lands or starts moving data) or to `target`,
 * whichever is first. Active transfers share the bandwidth equally (§3.3.1); progress is kept. */
static void ps_step(sim *S, double target) {
    int n_act = 0;
    double min_rem = INFINITY, next_act = INFINITY;
    for (int i = 0; i < S->nx; i++) {
        xfer *x = &S->x[i];
        if (!x->live || x->done) continue;
        if (x->act <= S->t) {
            if (x->rem <= 0) { /* nothing to move: lands as it starts */
                x->done = 1;
                continue;
            }
            n_act++;
            if (x->rem < min_rem) min_rem = x->rem;
        } else if (x->act < next_act) {
            next_act = x->act;
        }
    }
    double t_fin = n_act ? S->t + min_rem * n_act / S->bw : INFINITY;
    double tn = KVB_MIN(KVB_MIN(t_fin, next_act), target);
    if (tn == INFINITY) return; /* nothing can happen (the caller never waits on nothing) */
    if (n_act) {
        double moved = (tn - S->t) * S->bw / n_act;
        for (int i = 0; i < S->nx; i++) {
            xfer *x = &S->x[i];
            if (!x->live || x->done || x->act > S->t) continue;
            if (tn == t_fin && x->rem <= min_rem * (1 + 1e-12)) {
                x->rem = 0;
                x->done = 1;
            } else {
                x->rem -= moved;
            }
        }
    }
    S->t = tn;
}

static void ps_advance(sim *S, double target) {
    while (S->t < target) ps_step(S, target);
}

static int layer_pending(const sim *S, int layer) {
    for (int i = 0; i < S->nx; i++)
        if (S->x[i].live && S->x[i].layer == layer && !S->x[i].done) return 1;
    return 0;
}

static double req_size(const kvb_of_sim_req *r, int l) { return r->size ? r->size[l] : r->slices; }

/* Launches request r's next offloaded layers while it has a free slot. */
static void launch(sim *S, const kvb_of_sim_req *r, int ri, int n_layers, int *next, int *free_slots, double lat) {
    while (free_slots[ri] > 0) {
        int l = next[ri];
        while (l < n_layers && !kvb_of_layer_in(&r->cand->off, l)) l++;
        if (l >= n_layers) {
            next[ri] = n_layers;
            return;
        }
        next[ri] = l + 1;
        free_slots[ri]--;
        xfer *x = NULL;
        for (int i = 0; i < S->nx; i++)
            if (!S->x[i].live) {
                x = &S->x[i];
                break;
            }
        if (!x) x = &S->x[S->nx++];
        double sz = req_size(r, l);
        *x = (xfer){.req = ri, .layer = l, .size = sz, .rem = sz, .act = S->t + lat, .done = 0, .live = 1};
        S->occupancy += sz;
        if (S->occupancy > S->peak) S->peak = S->occupancy;
    }
}

double kvb_of_sim(const double *comp, int n_layers, double bw, double lat, const kvb_of_sim_req *reqs, int n,
                  kvb_of_sim_out *out, double *layer_start) {
    sim S;
    S.nx = 0;
    S.t = 0;
    S.bw = bw;
    S.occupancy = S.peak = 0;
    int next[KVB_OF_MAX_REQS], free_slots[KVB_OF_MAX_REQS];
    double fetched = 0, sum_comp = 0;
    for (int r = 0; r < n; r++) {
        next[r] = 0;
        free_slots[r] = reqs[r].cand->n_off > 0 ? reqs[r].cand->n_slots : 0;
        for (int l = 0; l < n_layers; l++)
            if (kvb_of_layer_in(&reqs[r].cand->off, l)) fetched += req_size(&reqs[r], l);
        launch(&S, &reqs[r], r, n_layers, next, free_slots, lat);
    }
    double e = 0; /* end of the previous layer's compute */
    for (int l = 0; l < n_layers; l++) {
        ps_advance(&S, e);
        if (l > 0) /* layer l-1 has computed: its slots are free */
            for (int i = 0; i < S.nx; i++) {
                xfer *x = &S.x[i];
                if (x->live && x->layer == l - 1) {
                    x->live = 0;
                    S.occupancy -= x->size;
                    free_slots[x->req]++;
                }
            }
        for (int r = 0; r < n; r++) launch(&S, &reqs[r], r, n_layers, next, free_slots, lat);
        while (layer_pending(&S, l)) ps_step(&S, INFINITY);
        double s = S.t; /* >= e: the stall is s - e */
        if (layer_start) layer_start[l] = s;
        e = s + comp[l];
        sum_comp += comp[l];
    }
    if (out) {
        out->t_batch = e;
        out->stall = e - sum_comp;
        out->peak_inflight = S.peak;
        out->fetched = fetched;
    }
    return e;
}

/* ---------------------------------------------------------------- one placement of the batch */

kvb_status kvb__of_check(const kvb_of_problem *p) {
    if (!p || !p->prof || p->prof->n_layers < 1 || p->prof->n_layers > KVB_OF_MAX_LAYERS) return KVB_ERR_INVALID;
    if (p->block_size < 1 || p->n_reqs < 0 || p->n_reqs > KVB_OF_MAX_REQS || p->n_cands < 1 ||
        p->n_cands > KVB_OF_MAX_CANDS || p->n_segs < 0 || (p->n_segs && !p->segs) || (p->n_reqs && !p->reqs))
        return KVB_ERR_INVALID;
    if (p->delta_min < 1 || p->delta_max < p->delta_min || p->delta_max > KVB_OF_MAX_WINDOW || p->ahead < 0)
        return KVB_ERR_INVALID;
    if (!(p->prof->bw > 0) || p->prof->lat < 0 || p->alpha < 0) return KVB_ERR_INVALID;
    for (int c = 0; c < p->n_cands; c++)
        if (p->cands[c].n_off > 0 && (p->cands[c].n_slots < 1 || p->cands[c].n_slots > 2)) return KVB_ERR_INVALID;
    for (int r = 0; r < p->n_reqs; r++) {
        if (p->reqs[r].len < 0) return KVB_ERR_INVALID;
        int64_t shared = 0;
        for (int g = 0; g < p->n_segs; g++)
            if (p->segs[g].owners >> r & 1) shared += p->segs[g].n_blocks;
        if (shared > p->reqs[r].len / p->block_size) return KVB_ERR_INVALID; /* only full blocks are shared */
    }
    for (int g = 0; g < p->n_segs; g++)
        if (p->segs[g].n_blocks < 0 || (p->n_reqs < 64 && p->segs[g].owners >> p->n_reqs)) return KVB_ERR_INVALID;
    return KVB_OK;
}

int kvb__of_active(const kvb_of_problem *p, int r) { return !p->excluded || !p->excluded[r]; }

int64_t kvb__of_shared(const kvb_of_problem *p, int r) {
    int64_t shared = 0;
    for (int g = 0; g < p->n_segs; g++)
        if (p->segs[g].owners >> r & 1) shared += p->segs[g].n_blocks;
    return shared;
}

int64_t kvb__of_own(const kvb_of_problem *p, int r, int s) {
    return kvb_of_blocks(p->reqs[r].len, p->ahead, s, p->block_size) - kvb__of_shared(p, r);
}

/* Per segment, the layers some active owner keeps resident. Returns 0 when the segment has no active
 * owner (it is then not part of the batch). */
static int seg_kept(const kvb_of_problem *p, const int *cand, int g, kvb_of_layerset *kept) {
    int L = p->prof->n_layers, any = 0;
    memset(kept, 0, sizeof *kept);
    for (int r = 0; r < p->n_reqs; r++) {
        if (!(p->segs[g].owners >> r & 1) || !kvb__of_active(p, r)) continue;
        any = 1;
        const kvb_of_cand *c = &p->cands[cand[r]];
        for (int w = 0; w < KVB_OF_MAX_LAYERS / 64; w++) kept->w[w] |= ~c->off.w[w];
    }
    for (int l = L; l < KVB_OF_MAX_LAYERS; l++) kept->w[l >> 6] &= ~((uint64_t)1 << (l & 63));
    return any;
}

/* size[r][l]: slices request r fetches for its offloaded layer l at step s. */
static void fetch_sizes(const kvb_of_problem *p, const int *cand, int s, double (*size)[KVB_OF_MAX_LAYERS]) {
    int L = p->prof->n_layers;
    for (int r = 0; r < p->n_reqs; r++) {
        if (!kvb__of_active(p, r)) continue;
        double own = (double)kvb__of_own(p, r, s);
        for (int l = 0; l < L; l++) size[r][l] = own;
    }
    for (int g = 0; g < p->n_segs; g++) {
        kvb_of_layerset kept;
        if (!seg_kept(p, cand, g, &kept)) continue;
        for (int r = 0; r < p->n_reqs; r++) {
            if (!(p->segs[g].owners >> r & 1) || !kvb__of_active(p, r)) continue;
            for (int l = 0; l < L; l++)
                if (!kvb_of_layer_in(&kept, l)) size[r][l] += (double)p->segs[g].n_blocks;
        }
    }
}

int64_t kvb_of_memory(const kvb_of_problem *p, const int *cand, int s, int64_t *buffer) {
    int L = p->prof->n_layers;
    static __thread double size[KVB_OF_MAX_REQS][KVB_OF_MAX_LAYERS];
    fetch_sizes(p, cand, s, size);
    int64_t res = 0, buf = 0;
    for (int r = 0; r < p->n_reqs; r++) {
        if (!kvb__of_active(p, r)) continue;
        const kvb_of_cand *c = &p->cands[cand[r]];
        res += (int64_t)(L - c->n_off) * kvb__of_own(p, r, s);
        if (c->n_off > 0) {
            double mx = 0;
            for (int l = 0; l < L; l++)
                if (kvb_of_layer_in(&c->off, l) && size[r][l] > mx) mx = size[r][l];
            buf += (int64_t)c->n_slots * (int64_t)mx;
        }
    }
    for (int g = 0; g < p->n_segs; g++) {
        kvb_of_layerset kept;
        if (!seg_kept(p, cand, g, &kept)) continue;
        int n = 0;
        for (int w = 0; w < KVB_OF_MAX_LAYERS / 64; w++) n += __builtin_popcountll(kept.w[w]);
        res += (int64_t)n * p->segs[g].n_blocks;
    }
    if (buffer) *buffer = buf;
    return res + buf;
}

int64_t kvb_of_eq1_buffer(const kvb_of_problem *p, const int *cand, int s) {
    int L = p->prof->n_layers;
    static __thread double size[KVB_OF_MAX_REQS][KVB_OF_MAX_LAYERS];
    fetch_sizes(p, cand, s, size);
    double mx = 0;
    for (int l = 0; l < L; l++) {
        double sum = 0;
        for (int r = 0; r < p->n_reqs; r++)
            if (kvb__of_active(p, r) && kvb_of_layer_in(&p->cands[cand[r]].off, l)) sum += size[r][l];
        if (sum > mx) mx = sum;
    }
    return (int64_t)mx;
}

double kvb__of_tokens(const kvb_of_problem *p, int s) {
    double tok = 0;
    for (int r = 0; r < p->n_reqs; r++)
        if (kvb__of_active(p, r)) tok += (double)(p->reqs[r].len + p->ahead + s);
    return tok;
}

double kvb_of_step_latency(const kvb_of_problem *p, const int *cand, int s, kvb_of_sim_out *out) {
    int L = p->prof->n_layers;
    static __thread double size[KVB_OF_MAX_REQS][KVB_OF_MAX_LAYERS];
    double comp[KVB_OF_MAX_LAYERS];
    kvb_of_profile_comp(p->prof, kvb__of_tokens(p, s), comp);
    fetch_sizes(p, cand, s, size);
    kvb_of_sim_req sr[KVB_OF_MAX_REQS];
    int n = 0;
    for (int r = 0; r < p->n_reqs; r++) {
        if (!kvb__of_active(p, r)) continue;
        sr[n++] = (kvb_of_sim_req){.cand = &p->cands[cand[r]], .slices = 0, .size = size[r]};
    }
    return kvb_of_sim(comp, L, p->prof->bw, p->prof->lat, sr, n, out, NULL);
}

int64_t kvb__of_ns(double s) { return s >= 0 ? (int64_t)(s * 1e9 + 0.5) : -(int64_t)(-s * 1e9 + 0.5); }

/* Token-Deposit over the window (§3.2): request r's newest token was generated at 0 and is due at
 * slack; the token of step s is generated at g(s) = sum of the step latencies and fails when it would be
 * delivered later than one SLO after its predecessor. Returns the failures of step s and advances due[]. */
int kvb__of_fails(int n, const uint64_t *slo_ns, uint64_t g_ns, uint64_t *due) {
    int fails = 0;
    for (int r = 0; r < n; r++) {
        if (!slo_ns[r]) continue;
        uint64_t d = kvb_deposit_next(0, due[r], g_ns, slo_ns[r]);
        if (d > due[r] + slo_ns[r]) fails++; /* the deposit was empty: delivered late */
        due[r] = d;
    }
    return fails;
}

void kvb__of_due_init(const kvb_of_problem *p, uint64_t *due, uint64_t *slo_ns) {
    for (int r = 0; r < p->n_reqs; r++) {
        due[r] = p->reqs[r].slack > 0 ? (uint64_t)kvb__of_ns(p->reqs[r].slack) : 0;
        slo_ns[r] = kvb__of_active(p, r) && p->reqs[r].slo > 0 ? (uint64_t)kvb__of_ns(p->reqs[r].slo) : 0;
    }
}

void kvb_of_evaluate(const kvb_of_problem *p, const int *cand, kvb_of_solution *sol) {
    memset(sol, 0, sizeof *sol);
    for (int r = 0; r < p->n_reqs; r++) sol->cand[r] = kvb__of_active(p, r) ? cand[r] : -1;
    uint64_t due[KVB_OF_MAX_REQS], slo_ns[KVB_OF_MAX_REQS], g = 0;
    kvb__of_due_init(p, due, slo_ns);
    int cum = 0;
    for (int s = 0; s < p->delta_max; s++) {
        int64_t buf;
        int64_t mem = kvb_of_memory(p, cand, s, &buf);
        if (mem > p->budget) break;
        kvb_of_sim_out so;
        double t = kvb_of_step_latency(p, cand, s, &so);
        if (s == 0) {
            sol->t_batch = t;
            sol->mem = mem;
            sol->buffer = buf;
            sol->fetched = (int64_t)so.fetched;
        }
        sol->pred[s] = t;
        g += (uint64_t)kvb__of_ns(t);
        cum += kvb__of_fails(p->n_reqs, slo_ns, g, due);
        if (s + 1 >= p->delta_min && (!p->enforce_slo || cum <= p->alpha * (s + 1))) {
            sol->delta = s + 1;
            sol->fails = cum;
        }
    }
    sol->feasible = sol->delta > 0;
    sol->evals = 1;
}
