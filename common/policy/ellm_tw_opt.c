/* kvbank — eLLM token-wise: the request-level optimizer (§4.1-4.2: Eq. 5 under Eq. 1), solved with
 * NLopt's LD_SLSQP on a relaxation, then made integral and exact; and a dense grid search. */
#include "common/policy/ellm_tw.h"

#include <math.h>
#include <nlopt.h>
#include <string.h>

#include "common/policy/ellm_tw_map.h"

/* ---------------------------------------------------------------- exact evaluation */
static int b_limit(const kvb_etw_problem *p) {
    int bmax = p->n < p->b_bound ? p->n : p->b_bound;
    return bmax;
}

static int64_t block_bytes_of(const kvb_etw_problem *p) {
    return (int64_t)p->d->n_layers * (int64_t)kvb_etw_kv_bytes(p->d) * p->block_size;
}

int64_t kvb_etw_absent(double r, int64_t s) {
    int64_t u = (int64_t)floor(r * (double)s + 1e-9);
    return u < 0 ? 0 : u > s ? s : u;
}

/* Running totals over a batch from which its exact blocks follow. */
typedef struct totals {
    int64_t resident, token_blocks, absent;
} totals;

static void totals_of(const kvb_etw_problem *p, int b, double r, totals *t) {
    const int bs = p->block_size;
    *t = (totals){0};
    for (int i = 0; i < b; i++) {
        int64_t s = p->s[i], u = kvb_etw_absent(r, s);
        t->resident += KVB_DIV_CEIL(s + 1, bs) - u / bs;
        t->token_blocks += KVB_DIV_CEIL(u, bs);
        t->absent += u;
    }
}

static void blocks_of(const kvb_etw_problem *p, const totals *t, int64_t *dev, int64_t *host) {
    const int L = p->d->n_layers;
    int64_t scratch = kvb_etw_map_carriers(L, p->unit_layers, p->layer.depth, t->token_blocks);
    int64_t bb = block_bytes_of(p);
    int64_t act = (int64_t)ceil((double)t->absent * p->act_row_bytes / (double)bb);
    *dev = t->resident + scratch + act;
    *host = p->layer.n_swap > 0 ? kvb_etw_map_host_carriers(L, p->unit_layers, p->layer.n_rec, t->token_blocks) : 0;
}

static int totals_fit(const kvb_etw_problem *p, int b, const totals *t) {
    int64_t dev, host;
    blocks_of(p, t, &dev, &host);
    return dev <= p->mem_blocks && host <= p->host_blocks && b + t->absent <= p->max_rows;
}

void kvb_etw_exact_blocks(const kvb_etw_problem *p, int b, double r, int64_t *dev, int64_t *host) {
    totals t;
    totals_of(p, b, r, &t);
    blocks_of(p, &t, dev, host);
}

static int memory_ok(const kvb_etw_problem *p, int b, double r) {
    totals t;
    totals_of(p, b, r, &t);
    return totals_fit(p, b, &t);
}

double kvb_etw_exact_time(const kvb_etw_problem *p, int b, double r) {
    kvb_etw_work dec = kvb_etw_work_step(p->d), rec = {0};
    for (int i = 0; i < b; i++) {
        double s = p->s[i], u = (double)kvb_etw_absent(r, p->s[i]);
        kvb_etw_work_add(&dec, kvb_etw_work_decode(p->d, s));
        if (u > 0) kvb_etw_work_add(&rec, kvb_etw_work_recompute(p->d, u, p->layer.n_rec));
    }
    return kvb_etw_step_time(&p->rates, dec) + kvb_etw_time(&p->rates, rec);
}

int kvb_etw_feasible(const kvb_etw_problem *p, int b, double r) {
    if (b < 1 || b > b_limit(p) || r < 0 || r > p->r_max) return 0;
    if (!memory_ok(p, b, r)) return 0;
    return kvb_etw_exact_time(p, b, r) + p->wt_max_s <= p->slo_s;
}

/* Memory changes only where some floor(r·s_i) steps, at r = k/s_i: walk those breakpoints in order
 * (a binary heap of each request's next one), keeping the totals, and stop at the first that fits.
 * The walk starts at a lower bound of the answer: with u_i in (r·s_i − 1, r·s_i], resident blocks
 * are at least Σceil((s_i+1)/bs) − r·P1/bs and scratch plus activations at least c'·(r·P1 − b), c' the
 * blocks per absent token, so no r below (Σceil − c'·b − mem) / (P1·(1/bs − c')) can fit. From there
 * the walk crosses O(b·bs) breakpoints. Rows and host blocks only grow with r: once they fail,
 * nothing above fits. */
typedef struct brk {
    double r;
    int i;
    int64_t k; /* the u_i this breakpoint moves request i to */
} brk;

static void heap_down(brk *h, int n, int i) {
    for (;;) {
        int l = 2 * i + 1, m = i;
        if (l < n && h[l].r < h[m].r) m = l;
        if (l + 1 < n && h[l + 1].r < h[m].r) m = l + 1;
        if (m == i) return;
        brk t = h[i];
        h[i] = h[m];
        h[m] = t;
        i = m;
    }
}

/* c': device blocks each absent token costs at least (scratch units and activation rows). */
static double absent_cost(const kvb_etw_problem *p) {
    int L = p->d->n_layers;
    double uw = (double)kvb_etw_map_units_window(L, p->unit_layers, p->layer.depth) / kvb_etw_map_slots(L, p->unit_layers);
    return uw / p->block_size + p->act_row_bytes / (double)block_bytes_of(p);
}

/* Smallest r that can fit, from exact device blocks `dev` at r_c: from r_c to r, resident blocks
 * fall by at most (r − r_c)·P1/bs + b and scratch plus activations grow by at least
 * c'·(r − r_c)·P1 − 2c'·b − 2 (the roundings at both ends). */
static double next_possible(const kvb_etw_problem *p, int b, double P1, double c, double r_c, int64_t dev) {
    double bs = p->block_size;
    double excess = (double)(dev - p->mem_blocks) - b * (1 + 2 * c) - 2;
    if (excess <= 0) return r_c;
    if (c >= 1.0 / bs) return INFINITY;
    return r_c + excess / (P1 * (1.0 / bs - c));
}

/* Bisection between an infeasible lo and r_max on the exact memory (treated as monotone there):
 * a feasible ratio, maybe not the smallest, or -1. */
static double bisect_fit(const kvb_etw_problem *p, int b, double lo) {
    if (!memory_ok(p, b, p->r_max)) return -1;
    double hi = p->r_max;
    for (int it = 0; it < 50 && hi - lo > 1e-9; it++) {
        double mid = 0.5 * (lo + hi);
        if (memory_ok(p, b, mid)) hi = mid;
        else lo = mid;
    }
    return hi;
}

/* Jumps from r = 0 over ratios that provably cannot fit, recomputing the exact totals at each
 * landing. Returns the landing ratio and its totals; *done = 1 with the answer in the return value
 * (the landing fits: that ratio; -1: nothing can) or 0 when the breakpoint walk must go on. */
static double jump_ratio(const kvb_etw_problem *p, int b, double P1, double c, totals *t, int *done) {
    int64_t dev, host;
    double r = 0;
    *done = 1;
    for (;;) {
        totals_of(p, b, r, t);
        blocks_of(p, t, &dev, &host);
        if (host > p->host_blocks || b + t->absent > p->max_rows) return -1;
        if (dev <= p->mem_blocks) return r;
        double next = next_possible(p, b, P1, c, r, dev);
        if (!(next <= p->r_max)) return -1;
        if (next <= r * (1 + 1e-9) + 1e-12) break;
        r = next * (1 - 1e-12);
    }
    *done = 0;
    return r;
}

static double sum_s(const kvb_etw_problem *p, int b) {
    double P1 = 0;
    for (int i = 0; i < b; i++) P1 += p->s[i];
    return P1;
}

/* The next u after `u` at which a request's blocks change: tokens blocks of its absent prefix grow at
 * u = k·bs + 1, its resident blocks shrink at u = k·bs (both at every u when bs = 1). */
static int64_t next_block_event(int64_t u, int bs) {
    if (bs == 1 || u % bs == 0) return u + 1;
    return (u / bs + 1) * bs;
}

double kvb_etw_min_ratio(const kvb_etw_problem *p, int b) {
    totals t;
    int64_t dev, host;
    const double c = absent_cost(p), P1 = sum_s(p, b);
    int done;
    double r = jump_ratio(p, b, P1, c, &t, &done);
    if (done) return r;
    brk *h;
    if (kvb_malloc((size_t)(b > 0 ? b : 1) * sizeof *h, (void **)&h) != KVB_OK) return -1;
    const int bs = p->block_size;
    int n = 0;
    for (int i = 0; i < b; i++) {
        int64_t s = p->s[i], v = next_block_event(kvb_etw_absent(r, s), bs);
        if (v <= s) h[n++] = (brk){.r = (double)v / (double)s, .i = i, .k = v};
    }
    for (int i = n / 2 - 1; i >= 0; i--) heap_down(h, n, i);
    double found = -1;
    /* Only block events are walked: resident and token-block totals stay exact; the absent count U
     * (activations, rows) is bounded by r·P1 − b < U <= r·P1 and computed exactly only when the bounds
     * do not decide. The walk is short unless an absent token frees barely more than it costs: past
     * the cap, bisect. */
    int64_t budget = 4 * (int64_t)b + 4096;
    int exact_checks = 16;
    const double act = p->act_row_bytes / (double)block_bytes_of(p);
    while (n > 0 && h[0].r <= p->r_max) {
        double rb = h[0].r;
        if (budget-- <= 0) {
            found = bisect_fit(p, b, rb);
            break;
        }
        int64_t resident_before = t.resident;
        while (n > 0 && h[0].r == rb) {
            int64_t s = p->s[h[0].i], v = h[0].k;
            if (v % bs == 0) t.resident--;
            if (bs == 1 || v % bs == 1) t.token_blocks++;
            int64_t w = next_block_event(v, bs);
            if (w <= s) {
                h[0].k = w;
                h[0].r = (double)w / (double)s;
            } else {
                h[0] = h[--n];
            }
            heap_down(h, n, 0);
        }
        double u_lo = rb * P1 - b, u_hi = floor(rb * P1 + 1e-9 * b);
        if (b + u_lo > (double)p->max_rows) break;
        if (t.resident == resident_before) continue; /* only a resident block leaving can make it fit */
        t.absent = (int64_t)u_hi;
        blocks_of(p, &t, &dev, &host);
        if (host > p->host_blocks) break;
        int fits = dev <= p->mem_blocks && b + u_hi <= (double)p->max_rows;
        if (!fits) {
            /* undecided only if the lower bound of U would fit; then U is counted (O(b)), at most
             * `exact_checks` times: past that the upper bound decides (the answer stays feasible and
             * is at most the ratio of act·b blocks above the smallest) */
            double dev_lo = (double)dev - ceil(u_hi * act) + ceil(fmax(0, u_lo) * act);
            if (dev_lo > (double)p->mem_blocks || exact_checks-- <= 0) continue;
            totals ex;
            totals_of(p, b, rb, &ex);
            fits = totals_fit(p, b, &ex);
        }
        if (fits) {
            found = rb;
            break;
        }
    }
    free(h);
    return found;
}

/* ---------------------------------------------------------------- the relaxation */
typedef struct relax {
    const kvb_etw_problem *p;
    int bmax;
    double *p1; /* [bmax + 1] prefix sums of s_i */
    double *p2; /* [bmax + 1] prefix sums of s_i² */
    double *pblk; /* [bmax + 1] prefix sums of ceil((s_i + 1) / bs): exact blocks at r = 0 */
    double *rmin; /* [bmax + 1] kvb_etw_min_ratio(b), NAN until computed (starts land on the same b) */
    int exact_calls;
    double f0;  /* objective scale: T(1, 0) */
    double bb;  /* block bytes */
    double uw;  /* scratch units per token block, over slots per carrier */
    double hw;  /* host units per token block, over slots per carrier */
    int evals;
} relax;

/* Linear interpolation of a prefix sum at real b, and its slope there. */
static double interp(const relax *R, const double *ps, double b, double *slope) {
    if (!(b > 0)) { /* also NaN: SLSQP may probe one after a failed line search */
        *slope = ps[1] - ps[0];
        return 0;
    }
    int k = (int)floor(b);
    if (k >= R->bmax) {
        *slope = ps[R->bmax] - ps[R->bmax - 1];
        return ps[R->bmax] + (b - R->bmax) * *slope;
    }
    *slope = ps[k + 1] - ps[k];
    return ps[k] + (b - k) * *slope;
}

/* Relaxed step time and its partial derivatives. */
static double relax_time(const relax *R, double b, double r, double *dt_db, double *dt_dr) {
    const kvb_etw_problem *p = R->p;
    const kvb_etw_dims *d = p->d;
    const kvb_etw_rates *k = &p->rates;
    double g1, g2;
    double P1 = interp(R, R->p1, b, &g1), P2 = interp(R, R->p2, b, &g2);
    double L = d->n_layers, nr = p->layer.n_rec, lf = kvb_etw_layer_flops(d), kv = kvb_etw_kv_bytes(d);
    double logit = 2.0 * d->hidden * (double)d->vocab;
    /* decode: b·(L·lf + logits) dense, L·4q·(P1 + b) attention, L·kv·(P1 + b) bytes, + weights */
    double dec = b * (L * lf + logit) * k->s_flop + L * 4.0 * d->q_dim * (P1 + b) * k->s_attn +
                 (d->weight_bytes + L * kv * (P1 + b)) * k->s_byte;
    double ddec_db = (L * lf + logit) * k->s_flop + L * 4.0 * d->q_dim * (g1 + 1) * k->s_attn +
                     L * kv * (g1 + 1) * k->s_byte;
    /* recompute of n_rec layers: lf·r·P1, 2q·(r²P2 + r·P1), kv·r·P1 */
    double a_flop = nr * lf * k->s_flop + nr * kv * k->s_byte, a_attn = nr * 2.0 * d->q_dim * k->s_attn;
    double rec = a_flop * r * P1 + a_attn * (r * r * P2 + r * P1);
    double drec_db = a_flop * r * g1 + a_attn * (r * r * g2 + r * g1);
    double drec_dr = a_flop * P1 + a_attn * (2 * r * P2 + P1);
    *dt_db = ddec_db + drec_db;
    *dt_dr = drec_dr;
    return k->t_fixed + dec + rec;
}

static double obj_fn(unsigned n, const double *x, double *grad, void *data) {
    relax *R = data;
    R->evals++;
    double b = x[0], r = x[1], tb, tr;
    double t = relax_time(R, b, r, &tb, &tr);
    if (grad) {
        grad[0] = (tb * b - t) / (b * b) / R->f0;
        grad[1] = tr / b / R->f0;
    }
    return t / b / R->f0;
}

/* SLO: (T + WT_max) / SLO − 1 <= 0 */
static double slo_fn(unsigned n, const double *x, double *grad, void *data) {
    relax *R = data;
    double tb, tr, t = relax_time(R, x[0], x[1], &tb, &tr);
    if (grad) {
        grad[0] = tb / R->p->slo_s;
        grad[1] = tr / R->p->slo_s;
    }
    return (t + R->p->wt_max_s) / R->p->slo_s - 1;
}

/* Device memory in blocks: resident (P1(1 − r) + b)/bs + b·(bs − 1)/bs (the two roundings, ceil and
 * floor, about (bs − 1)/(2 bs) each on average), scratch r·P1/bs·uw, activations r·P1·act/bb. */
static double mem_fn(unsigned n, const double *x, double *grad, void *data) {
    relax *R = data;
    const kvb_etw_problem *p = R->p;
    double b = x[0], r = x[1], g1;
    double P1 = interp(R, R->p1, b, &g1), bs = p->block_size;
    double act = p->act_row_bytes / R->bb;
    double per_absent = -1.0 / bs + R->uw / bs + act; /* blocks per absent token */
    double round = (bs - 1) / bs;
    double m = (P1 + b) / bs + b * round + r * P1 * per_absent;
    double M = (double)(p->mem_blocks > 0 ? p->mem_blocks : 1);
    if (grad) {
        grad[0] = ((g1 + 1) / bs + round + r * g1 * per_absent) / M;
        grad[1] = P1 * per_absent / M;
    }
    return (m - (double)p->mem_blocks) / M;
}

/* Rows of the step: b + r·P1 <= max_rows. */
static double rows_fn(unsigned n, const double *x, double *grad, void *data) {
    relax *R = data;
    double g1, P1 = interp(R, R->p1, x[0], &g1), M = (double)R->p->max_rows;
    if (grad) {
        grad[0] = (1 + x[1] * g1) / M;
        grad[1] = P1 / M;
    }
    return (x[0] + x[1] * P1) / M - 1;
}

/* Host blocks of the swapped layers: r·P1/bs·hw <= host_blocks. */
static double host_fn(unsigned n, const double *x, double *grad, void *data) {
    relax *R = data;
    double g1, P1 = interp(R, R->p1, x[0], &g1), bs = R->p->block_size;
    double M = (double)(R->p->host_blocks > 0 ? R->p->host_blocks : 1);
    if (grad) {
        grad[0] = x[1] * g1 / bs * R->hw / M;
        grad[1] = P1 / bs * R->hw / M;
    }
    return x[1] * P1 / bs * R->hw / M - (R->p->host_blocks > 0 ? 1 : 0);
}

/* ---------------------------------------------------------------- integral and exact */
typedef struct best_pt {
    int b;
    double r, obj;
} best_pt;

/* The relaxation's smallest ratio for integer b (memory is linear in r there); > r_max if none. */
static double relax_min_ratio(const relax *R, int b) {
    const kvb_etw_problem *p = R->p;
    double bs = p->block_size, P1 = R->p1[b];
    double per_absent = -1.0 / bs + R->uw / bs + p->act_row_bytes / R->bb;
    double m0 = R->pblk[b]; /* exact at r = 0; the floors of r > 0 lose half a block each on average */
    if (m0 <= (double)p->mem_blocks) return 0;
    if (per_absent >= 0 || P1 <= 0) return INFINITY;
    return (m0 + b * (bs - 1) / (2 * bs) - (double)p->mem_blocks) / (-P1 * per_absent);
}

/* Evaluates integer b at its smallest exactly feasible r; updates *best if feasible and better. */
static void try_b(relax *R, int b, best_pt *best) {
    const kvb_etw_problem *p = R->p;
    if (b < 1 || b > R->bmax) return;
    if (isnan(R->rmin[b])) {
        /* a lower bound first: no ratio below the jump's landing fits and the time only grows with r,
         * so a b whose time there is already worse (or past the SLO) needs no exact walk */
        totals t;
        int done;
        double r_lo = jump_ratio(p, b, R->p1[b], absent_cost(p), &t, &done);
        if (done) {
            R->rmin[b] = r_lo;
        } else {
            double t_lo = kvb_etw_exact_time(p, b, r_lo);
            if (t_lo + p->wt_max_s > p->slo_s || t_lo / b >= best->obj) return;
        }
    }
    if (isnan(R->rmin[b])) {
        R->rmin[b] = kvb_etw_min_ratio(p, b);
        R->exact_calls++;
    }
    double r = R->rmin[b];
    if (r < 0) return;
    double t = kvb_etw_exact_time(p, b, r);
    if (t + p->wt_max_s > p->slo_s) return;
    double obj = t / b;
    if (obj < best->obj) *best = (best_pt){.b = b, .r = r, .obj = obj};
}

/* From a relaxed optimum b*: floor it and try it and the next integer at their smallest exact
 * ratios, then walk up and down while the exact objective improves (the relaxation's roundings put b*
 * near, not at, the integer optimum); if neither is feasible, lower b until something is. */
static void integral(relax *R, double bstar, best_pt *best) {
    int b0 = (int)floor(bstar + 1e-9);
    if (b0 < 1) b0 = 1;
    if (b0 > R->bmax) b0 = R->bmax;
    best_pt local = {.obj = INFINITY};
    try_b(R, b0, &local);
    try_b(R, b0 + 1, &local);
    if (local.obj == INFINITY) {
        for (int b = b0 - 1; b >= 1 && local.obj == INFINITY; b--) try_b(R, b, &local);
        if (local.obj == INFINITY) return;
    }
    for (int dir = -1; dir <= 1; dir += 2)
        for (int b = local.b + dir; b >= 1 && b <= R->bmax; b += dir) {
            best_pt t = local;
            try_b(R, b, &t);
            if (t.b != b) break; /* infeasible or no better: stop walking this way */
            local = t;
        }
    if (local.obj < best->obj) *best = local;
}

/* The relaxation at every integer b, each at its smallest relaxed ratio (O(1) per b from the prefix
 * sums): the FCFS objective is bumpy in b (a long request raises the mean cost), so SLSQP from a few
 * starts can stop at a local optimum; the best few of this scan, and its largest feasible b, are made
 * exact like SLSQP's answers. */
enum { SCAN_KEEP = 4 };
static int relaxed_scan(const relax *R, int *cand) {
    const kvb_etw_problem *p = R->p;
    double best_obj[SCAN_KEEP];
    int n = 0, largest = 0;
    for (int b = 1; b <= R->bmax; b++) {
        double r = relax_min_ratio(R, b), P1 = R->p1[b];
        if (!(r <= p->r_max) || b + r * P1 > (double)p->max_rows) continue;
        if (p->layer.n_swap > 0 && r * P1 / p->block_size * R->hw > (double)p->host_blocks) continue;
        double d1, d2, t = relax_time(R, b, r, &d1, &d2);
        if (t + p->wt_max_s > p->slo_s) continue;
        largest = b;
        double obj = t / b;
        if (n == SCAN_KEEP && obj >= best_obj[SCAN_KEEP - 1]) continue;
        int k = n < SCAN_KEEP ? n++ : SCAN_KEEP - 1; /* the slot the new one enters, then sifted up */
        for (; k > 0 && best_obj[k - 1] > obj; k--) {
            best_obj[k] = best_obj[k - 1];
            cand[k] = cand[k - 1];
        }
        best_obj[k] = obj;
        cand[k] = b;
    }
    if (largest) cand[n++] = largest;
    return n;
}

static kvb_status check_problem(const kvb_etw_problem *p) {
    if (!p || !p->d || (!p->s && p->n > 0) || p->n < 0 || p->b_bound < 1 || !(p->r_max >= 0 && p->r_max <= 1) ||
        !(p->slo_s > 0) || p->wt_max_s < 0 || p->block_size < 1 || p->unit_layers < 1 || p->mem_blocks < 0 ||
        p->host_blocks < 0 || p->max_rows < 1 || p->layer.n_rec < 0 || p->layer.n_rec > p->d->n_layers ||
        p->layer.depth < 1 || p->d->n_layers < 1)
        return KVB_ERR_INVALID;
    for (int i = 0; i < p->n; i++)
        if (p->s[i] < 0) return KVB_ERR_INVALID;
    return KVB_OK;
}

static void finish(const kvb_etw_problem *p, best_pt bp, int feasible, int evals, kvb_etw_solution *out) {
    memset(out, 0, sizeof *out);
    out->b = bp.b;
    out->r = bp.r;
    out->feasible = feasible;
    out->evals = evals;
    if (bp.b >= 1) {
        out->t_step = kvb_etw_exact_time(p, bp.b, bp.r);
        out->objective = out->t_step / bp.b;
        kvb_etw_exact_blocks(p, bp.b, bp.r, &out->mem_blocks, &out->host_blocks);
    }
}

/* No feasible point: one request at its smallest ratio (r_max when even that does not fit). */
static void fallback(const kvb_etw_problem *p, int evals, kvb_etw_solution *out) {
    double r = p->n > 0 ? kvb_etw_min_ratio(p, 1) : 0;
    finish(p, (best_pt){.b = p->n > 0 ? 1 : 0, .r = r < 0 ? p->r_max : r}, 0, evals, out);
}

kvb_status kvb_etw_solve(const kvb_etw_problem *p, kvb_etw_solution *out) {
    KVB_TRY(check_problem(p));
    int bmax = b_limit(p);
    if (bmax < 1) {
        memset(out, 0, sizeof *out);
        return KVB_OK;
    }
    relax R = {.p = p, .bmax = bmax, .bb = (double)block_bytes_of(p)};
    kvb_status st = kvb_calloc((size_t)bmax + 1, sizeof *R.p1, (void **)&R.p1);
    if (st != KVB_OK) return st;
    KVB_TRY_GOTO(kvb_calloc((size_t)bmax + 1, sizeof *R.p2, (void **)&R.p2), out);
    KVB_TRY_GOTO(kvb_calloc((size_t)bmax + 1, sizeof *R.pblk, (void **)&R.pblk), out);
    KVB_TRY_GOTO(kvb_calloc((size_t)bmax + 1, sizeof *R.rmin, (void **)&R.rmin), out);
    for (int b = 0; b <= bmax; b++) R.rmin[b] = NAN;
    for (int i = 0; i < bmax; i++) {
        double s = p->s[i];
        R.p1[i + 1] = R.p1[i] + s;
        R.p2[i + 1] = R.p2[i] + s * s;
        R.pblk[i + 1] = R.pblk[i] + (double)KVB_DIV_CEIL((int64_t)p->s[i] + 1, (int64_t)p->block_size);
    }
    int L = p->d->n_layers;
    int slots = kvb_etw_map_slots(L, p->unit_layers);
    R.uw = (double)kvb_etw_map_units_window(L, p->unit_layers, p->layer.depth) / slots;
    R.hw = p->layer.n_swap > 0 ? (double)kvb_etw_map_units_span(L, p->unit_layers, p->layer.n_rec, L) / slots : 0;
    double dummy;
    R.f0 = relax_time(&R, 1, 0, &dummy, &dummy);
    if (!(R.f0 > 0)) R.f0 = 1;

    best_pt best = {.b = 0, .obj = INFINITY};
    nlopt_opt o = nlopt_create(NLOPT_LD_SLSQP, 2);
    if (!o) {
        st = KVB_ERR_NOMEM;
        goto out;
    }
    double lb[2] = {1, 0}, ub[2] = {bmax, p->r_max};
    nlopt_set_lower_bounds(o, lb);
    nlopt_set_upper_bounds(o, ub);
    nlopt_set_min_objective(o, obj_fn, &R);
    nlopt_add_inequality_constraint(o, slo_fn, &R, 1e-9);
    nlopt_add_inequality_constraint(o, mem_fn, &R, 1e-9);
    nlopt_add_inequality_constraint(o, rows_fn, &R, 1e-9);
    if (p->layer.n_swap > 0) nlopt_add_inequality_constraint(o, host_fn, &R, 1e-9);
    nlopt_set_xtol_rel(o, 1e-7);
    nlopt_set_ftol_rel(o, 1e-9);
    nlopt_set_maxeval(o, 200);
    /* SLSQP is local and the interpolated prefix sums are only piecewise smooth: a few starts */
    const double starts[][2] = {{bmax, 0.5 * p->r_max}, {0.5 * (1 + bmax), 0.1 * p->r_max}, {1, 0},
                                {bmax, p->r_max}};
    for (size_t k = 0; k < KVB_ARRAY_LEN(starts); k++) {
        double x[2] = {starts[k][0], starts[k][1]}, f;
        nlopt_optimize(o, x, &f); /* any result, also a failure, leaves a point to make exact */
        if (isfinite(x[0]) && isfinite(x[1])) integral(&R, x[0], &best);
    }
    nlopt_destroy(o);
    best_pt slsqp = best;
    int cand[SCAN_KEEP + 1];
    int nc = relaxed_scan(&R, cand);
    for (int k = 0; k < nc; k++) integral(&R, cand[k], &best);
    if (best.b >= 1) finish(p, best, 1, R.evals, out);
    else fallback(p, R.evals, out);
    out->exact_evals = R.exact_calls;
    out->b_slsqp = slsqp.b;
    out->r_slsqp = slsqp.r;
    out->obj_slsqp = slsqp.b >= 1 ? slsqp.obj : INFINITY;
out:
    free(R.p1);
    free(R.p2);
    free(R.pblk);
    free(R.rmin);
    return st;
}

void kvb_etw_solve_grid(const kvb_etw_problem *p, int r_steps, kvb_etw_solution *out) {
    best_pt best = {.b = 0, .obj = INFINITY};
    if (r_steps < 1) r_steps = 1;
    int bmax = check_problem(p) == KVB_OK ? b_limit(p) : 0;
    for (int b = 1; b <= bmax; b++)
        for (int k = 0; k <= r_steps; k++) {
            double r = p->r_max * k / r_steps;
            if (!kvb_etw_feasible(p, b, r)) continue;
            double obj = kvb_etw_exact_time(p, b, r) / b;
            if (obj < best.obj) best = (best_pt){.b = b, .r = r, .obj = obj};
        }
    if (best.b >= 1) finish(p, best, 1, 0, out);
    else if (bmax >= 1) fallback(p, 0, out);
    else memset(out, 0, sizeof *out);
}
