/* kvbank — eLLM token-wise: the corrected cost model (§4.2.1 Eq. 2-4), its online fit, and the
 * layer-level optimizer (§4.3 Eq. 6-9). See ellm_tw.h for what departs from the paper and why. */
#include "common/policy/ellm_tw.h"

#include <math.h>
#include <string.h>

void kvb_etw_dims_from_config(const kvb_model_config *c, int kv_elem, int act_elem, double weight_bytes,
                              kvb_etw_dims *out) {
    *out = (kvb_etw_dims){
        .n_layers = c->n_layers,
        .hidden = c->hidden,
        .q_dim = c->n_heads * c->head_dim,
        .kv_dim = c->n_kv_heads * c->head_dim,
        .intermediate = c->intermediate,
        .vocab = c->vocab,
        .kv_elem = kv_elem,
        .act_elem = act_elem,
        .weight_bytes = weight_bytes,
    };
}

double kvb_etw_layer_flops(const kvb_etw_dims *d) {
    double h = d->hidden;
    /* q and o: 2·h·q_dim each; k and v: 2·h·kv_dim each; gate, up, down: 2·h·I each */
    return 2.0 * (2.0 * h * d->q_dim + 2.0 * h * d->kv_dim + 3.0 * h * d->intermediate);
}

double kvb_etw_kv_bytes(const kvb_etw_dims *d) { return 2.0 * d->kv_dim * d->kv_elem; }

double kvb_etw_act_row_bytes(const kvb_etw_dims *d) {
    /* common/model/forward.c: x and h [hidden], q and att [q_dim], k and v [kv_dim], gate and up [I] */
    return (2.0 * d->hidden + 2.0 * d->q_dim + 2.0 * d->kv_dim + 2.0 * d->intermediate) * d->act_elem;
}

kvb_etw_work kvb_etw_work_decode(const kvb_etw_dims *d, double s) {
    double L = d->n_layers;
    return (kvb_etw_work){
        .flops = L * kvb_etw_layer_flops(d) + 2.0 * d->hidden * (double)d->vocab, /* Eq. 3 + one logits row */
        .attn = L * 4.0 * d->q_dim * (s + 1.0),
        .bytes = L * kvb_etw_kv_bytes(d) * (s + 1.0),
    };
}

kvb_etw_work kvb_etw_work_recompute(const kvb_etw_dims *d, double u, int n_layers) {
    double n = n_layers;
    return (kvb_etw_work){
        .flops = n * kvb_etw_layer_flops(d) * u,                /* Eq. 2 without logits */
        .attn = n * 2.0 * d->q_dim * u * (u + 1.0),             /* causal: Σ_{p=1..u} 4·q_dim·p */
        .bytes = n * kvb_etw_kv_bytes(d) * u,                   /* the KV it writes */
    };
}

kvb_etw_work kvb_etw_work_prefill(const kvb_etw_dims *d, double p, double c) {
    double L = d->n_layers;
    return (kvb_etw_work){
        .flops = L * kvb_etw_layer_flops(d) * c + 2.0 * d->hidden * (double)d->vocab,
        .attn = L * 4.0 * d->q_dim * (c * p + c * (c + 1.0) / 2.0),
        .bytes = L * kvb_etw_kv_bytes(d) * (p + c),
    };
}

kvb_etw_work kvb_etw_work_step(const kvb_etw_dims *d) { return (kvb_etw_work){.bytes = d->weight_bytes}; }

void kvb_etw_work_add(kvb_etw_work *acc, kvb_etw_work w) {
    acc->flops += w.flops;
    acc->attn += w.attn;
    acc->bytes += w.bytes;
}

double kvb_etw_time(const kvb_etw_rates *k, kvb_etw_work w) {
    return w.flops * k->s_flop + w.attn * k->s_attn + w.bytes * k->s_byte;
}

double kvb_etw_step_time(const kvb_etw_rates *k, kvb_etw_work w) { return k->t_fixed + kvb_etw_time(k, w); }

/* ---------------------------------------------------------------- online fit */
void kvb_etw_fit_init(kvb_etw_fit *f, const kvb_etw_rates *prior, double prior_weight, double forget) {
    memset(f, 0, sizeof *f);
    f->prior = *prior;
    f->prior_weight = prior_weight;
    f->forget = forget > 0 && forget <= 1 ? forget : 1;
}

/* z_k: each feature times its prior coefficient (the prior's seconds for that term). */
static void fit_features(const kvb_etw_rates *p, kvb_etw_work w, double z[4]) {
    z[0] = p->t_fixed;
    z[1] = w.flops * p->s_flop;
    z[2] = w.attn * p->s_attn;
    z[3] = w.bytes * p->s_byte;
}

void kvb_etw_fit_add(kvb_etw_fit *f, kvb_etw_work w, double seconds) {
    if (!(seconds > 0) || !isfinite(seconds)) return;
    double z[4];
    fit_features(&f->prior, w, z);
    /* relative residuals: divide the sample by its own time */
    for (int i = 0; i < 4; i++) z[i] /= seconds;
    for (int i = 0; i < 4; i++) {
        for (int j = 0; j < 4; j++) f->xtx[i][j] = f->forget * f->xtx[i][j] + z[i] * z[j];
        f->xty[i] = f->forget * f->xty[i] + z[i];
    }
    f->n = f->forget * f->n + 1;
}

/* Solves a 4x4 system by Gaussian elimination with partial pivoting; 0 if singular. */
static int solve4(double a[4][4], double b[4], double x[4]) {
    for (int c = 0; c < 4; c++) {
        int piv = c;
        for (int r = c + 1; r < 4; r++)
            if (fabs(a[r][c]) > fabs(a[piv][c])) piv = r;
        if (fabs(a[piv][c]) < 1e-300) return 0;
        if (piv != c) {
            for (int k = 0; k < 4; k++) {
                double t = a[c][k];
                a[c][k] = a[piv][k];
                a[piv][k] = t;
            }
            double t = b[c];
            b[c] = b[piv];
            b[piv] = t;
        }
        for (int r = c + 1; r < 4; r++) {
            double m = a[r][c] / a[c][c];
            for (int k = c; k < 4; k++) a[r][k] -= m * a[c][k];
            b[r] -= m * b[c];
        }
    }
    for (int r = 3; r >= 0; r--) {
        double s = b[r];
        for (int k = r + 1; k < 4; k++) s -= a[r][k] * x[k];
        x[r] = s / a[r][r];
    }
    return 1;
}

void kvb_etw_fit_rates(const kvb_etw_fit *f, kvb_etw_rates *out) {
    double a[4][4], b[4], m[4] = {1, 1, 1, 1};
    for (int i = 0; i < 4; i++) {
        for (int j = 0; j < 4; j++) a[i][j] = f->xtx[i][j];
        a[i][i] += f->prior_weight;
        b[i] = f->xty[i] + f->prior_weight; /* pulls each multiplier toward 1 */
    }
    if (!solve4(a, b, m)) m[0] = m[1] = m[2] = m[3] = 1;
    for (int i = 0; i < 4; i++) {
        if (!isfinite(m[i])) m[i] = 1;
        m[i] = fmin(50.0, fmax(1.0 / 50.0, m[i]));
    }
    out->t_fixed = f->prior.t_fixed * m[0];
    out->s_flop = f->prior.s_flop * m[1];
    out->s_attn = f->prior.s_attn * m[2];
    out->s_byte = f->prior.s_byte * m[3];
}

/* ---------------------------------------------------------------- layer level */
static int scratch_depth(int l1, int l2, int n_swap) { return 1 + l2 + (n_swap > 0 ? l1 : 0); }

kvb_etw_layer_plan kvb_etw_layer_initial(const kvb_etw_dims *d, const kvb_etw_link *link) {
    kvb_etw_layer_plan lp = {.l1 = 0, .l2 = 2, .n_rec = d->n_layers, .n_swap = 0, .threads = 1};
    if (link && link->bytes_per_s > 0 && d->n_layers > 1) {
        lp.l1 = 3; /* M_o = 40hbsr in the paper: three swapped and two recomputed layers */
        lp.n_swap = (int)lround(d->n_layers * 3.0 / 5.0);
        if (lp.n_swap >= d->n_layers) lp.n_swap = d->n_layers - 1;
        lp.n_rec = d->n_layers - lp.n_swap;
    }
    lp.depth = scratch_depth(lp.l1, lp.l2, lp.n_swap);
    return lp;
}

/* Seconds to load one layer of the prefix KV of U tokens over the link (Eq. 6 for l1 = 1). */
static double load_layer_time(const kvb_etw_dims *d, const kvb_etw_link *link, double U) {
    return link->latency_s + U * kvb_etw_kv_bytes(d) / link->bytes_per_s;
}

double kvb_etw_step_estimate(const kvb_etw_dims *d, const kvb_etw_rates *k, const kvb_etw_link *link,
                             const kvb_etw_batch *bt, const kvb_etw_layer_plan *lp) {
    kvb_etw_work dec = kvb_etw_work_step(d), rec = {0};
    double U = 0;
    for (int i = 0; i < bt->b; i++) {
        kvb_etw_work_add(&dec, kvb_etw_work_decode(d, bt->s[i]));
        if (bt->u[i] > 0) kvb_etw_work_add(&rec, kvb_etw_work_recompute(d, bt->u[i], lp->n_rec));
        U += bt->u[i];
    }
    double t_comp = kvb_etw_time(k, dec) + kvb_etw_time(k, rec);
    double exposed = 0;
    if (lp->n_swap > 0 && U > 0 && link && link->bytes_per_s > 0)
        exposed = fmax(0.0, lp->n_swap * load_layer_time(d, link, U) - t_comp);
    return k->t_fixed + t_comp + exposed;
}

void kvb_etw_layer_optimize(const kvb_etw_dims *d, const kvb_etw_rates *k, const kvb_etw_link *link,
                            const kvb_etw_batch *bt, int threads, kvb_etw_device device_kind,
                            kvb_etw_layer_plan *out) {
    const int L = d->n_layers;
    double U = 0;
    kvb_etw_work rec1 = {0}, dec1 = {0}; /* one layer of recompute / of decode for the whole batch */
    for (int i = 0; i < bt->b; i++) {
        U += bt->u[i];
        if (bt->u[i] > 0) kvb_etw_work_add(&rec1, kvb_etw_work_recompute(d, bt->u[i], 1));
        kvb_etw_work w = kvb_etw_work_decode(d, bt->s[i]);
        w.flops -= 2.0 * d->hidden * (double)d->vocab; /* per layer: no logits */
        w.flops /= L;
        w.attn /= L;
        w.bytes /= L;
        kvb_etw_work_add(&dec1, w);
    }
    double t_rl = kvb_etw_time(k, rec1), t_dl = kvb_etw_time(k, dec1);

    kvb_etw_layer_plan best = {.l1 = 0, .l2 = 1, .n_rec = L, .n_swap = 0};
    if (U > 0 && link && link->bytes_per_s > 0 && L > 1) {
        double t_ll = load_layer_time(d, link, U);
        double best_gap = INFINITY;
        kvb_etw_layer_plan cand_best = best;
        for (int l2 = 1; l2 <= 2; l2++)
            for (int l1 = 1; l1 <= 3; l1++) {
                double ts = l1 * t_ll, tr = l2 * t_rl, gap = fabs(ts - tr);
                int n_swap = (int)lround((double)L * l1 / (l1 + l2));
                if (n_swap >= L) n_swap = L - 1;
                kvb_etw_layer_plan c = {.l1 = l1, .l2 = l2, .n_rec = L - n_swap, .n_swap = n_swap,
                                        .t_swap = ts, .t_rec = tr};
                c.depth = scratch_depth(l1, l2, n_swap);
                if (gap < best_gap * (1 - 1e-12) ||
                    (fabs(gap - best_gap) <= 1e-12 * fmax(gap, 1e-30) && c.depth < cand_best.depth)) {
                    best_gap = gap;
                    cand_best = c;
                }
            }
        /* kvbank's guard: swap only when it shortens the estimated step */
        kvb_etw_layer_plan none = {.l1 = 0, .l2 = 1, .n_rec = L, .n_swap = 0};
        if (kvb_etw_step_estimate(d, k, link, bt, &cand_best) < kvb_etw_step_estimate(d, k, link, bt, &none))
            best = cand_best;
    }
    if (best.n_swap == 0) {
        best.t_rec = best.l2 * t_rl;
        best.t_swap = 0;
    }
    best.depth = scratch_depth(best.l1, best.l2, best.n_swap);

    /* Eq. 8-9: K1 recomputes l2 layers, K2 decodes l1 + l2 layers; split by their estimated times */
    double v1 = best.l2 * t_rl, v2 = (best.l1 + best.l2) * t_dl;
    if (device_kind == KVB_ETW_DEVICE_GPU) {
        best.threads = 1024;
        if (U <= 0 || v1 <= 0) {
            best.delta = 0;
        } else {
            int dl = (int)lround(1024.0 * v1 / (v1 + v2) / 32.0) * 32;
            best.delta = dl < 32 ? 32 : dl > 992 ? 992 : dl;
        }
    } else {
        best.threads = threads > 0 ? threads : 1;
        if (U <= 0 || v1 <= 0 || best.threads < 2) {
            best.delta = 0;
        } else {
            int dl = (int)lround(best.threads * v1 / (v1 + v2));
            best.delta = dl < 1 ? 1 : dl > best.threads - 1 ? best.threads - 1 : dl;
        }
    }
    *out = best;
}
