/* kvbank — SwiftCache sizing and scaling (swiftcache.txt §3.2 Eq. 1-5, §3.4 Eq. 6-9, §3.5 Alg. 1). */
#include "common/policy/swiftcache.h"

#include "common/kv/block_pool.h"

static uint64_t gcd_u64(uint64_t a, uint64_t b) {
    while (b) {
        uint64_t t = a % b;
        a = b;
        b = t;
    }
    return a;
}

kvb_status kvb_swift_meu(const kvb_kv_geom *master, const kvb_kv_geom *worker, uint64_t max_bytes, kvb_meu *out) {
    if (kvb_kv_geom_check(master) != KVB_OK || kvb_kv_geom_check(worker) != KVB_OK) return KVB_ERR_INVALID;
    uint64_t bm = kvb_kv_block_bytes(master), bw = kvb_kv_block_bytes(worker); /* 2 * BE * elem_size */
    uint64_t g = gcd_u64(bm, bw);
    uint64_t k = bw / g;
    if (k > UINT64_MAX / bm) return KVB_ERR_UNSUPPORTED;
    uint64_t lcm = bm * k; /* Eq. 8 */
    if (max_bytes && lcm > max_bytes) {
        KVB_LOG_W("minimum elastic unit of %llu bytes exceeds %llu bytes (block sizes %llu and %llu)",
                  (unsigned long long)lcm, (unsigned long long)max_bytes, (unsigned long long)bm,
                  (unsigned long long)bw);
        return KVB_ERR_UNSUPPORTED;
    }
    if (lcm / bm > UINT32_MAX || lcm / bw > UINT32_MAX) return KVB_ERR_UNSUPPORTED;
    out->lcm_bytes = lcm;
    out->meu_master = (uint32_t)(lcm / bm); /* Eq. 9 */
    out->meu_worker = (uint32_t)(lcm / bw);
    return KVB_OK;
}

void kvb_swift_scale_up(int64_t n_i, int b_i, uint32_t meu_i, uint32_t meu_m, int64_t request_len, int64_t *d_worker,
                        int64_t *d_master) {
    int64_t need = KVB_DIV_CEIL(request_len, b_i); /* line 11 */
    *d_worker = *d_master = 0;
    if (need <= n_i) return; /* lines 12-13 */
    int64_t diff = need - n_i;
    int64_t k = KVB_DIV_CEIL(diff, (int64_t)meu_i); /* line 16 */
    *d_worker = k * meu_i;
    *d_master = k * meu_m;
}

void kvb_swift_scale_down(int64_t n_i, int b_i, uint32_t meu_i, uint32_t meu_m, int64_t max_len, int64_t *d_worker,
                          int64_t *d_master) {
    int64_t max_need = KVB_DIV_CEIL(max_len, b_i); /* line 23 */
    *d_worker = *d_master = 0;
    if (max_need >= n_i) return; /* lines 24-25 */
    int64_t k = (n_i - max_need) / (int64_t)meu_i; /* lines 27-28 */
    *d_worker = k * meu_i;
    *d_master = k * meu_m;
}

kvb_status kvb_swift_window_init(kvb_swift_window *w, double window_s, int cap) {
    *w = (kvb_swift_window){.window_s = window_s, .cap = cap};
    KVB_TRY(kvb_calloc((size_t)cap, sizeof *w->t, (void **)&w->t));
    kvb_status st = kvb_calloc((size_t)cap, sizeof *w->len, (void **)&w->len);
    if (st != KVB_OK) free(w->t);
    return st;
}

void kvb_swift_window_free(kvb_swift_window *w) {
    free(w->t);
    free(w->len);
    w->t = NULL;
    w->len = NULL;
}

static void window_expire(kvb_swift_window *w, double now) {
    while (w->n && w->t[w->head] <= now - w->window_s) {
        w->head = (w->head + 1) % w->cap;
        w->n--;
    }
}

void kvb_swift_window_add(kvb_swift_window *w, double now, int64_t len) {
    window_expire(w, now);
    /* drop older samples that are not longer than this one: they can never be the maximum again */
    while (w->n && w->len[(w->head + w->n - 1) % w->cap] <= len) w->n--;
    if (w->n == w->cap) { /* full of strictly decreasing lengths: grow (the oldest is the maximum) */
        int cap = w->cap * 2;
        double *t = NULL;
        int64_t *len = NULL;
        if (kvb_malloc((size_t)cap * sizeof *t, (void **)&t) != KVB_OK ||
            kvb_malloc((size_t)cap * sizeof *len, (void **)&len) != KVB_OK) {
            free(t); /* out of memory: forget the newest-but-one sample, never the maximum */
            w->n--;
        } else {
            for (int i = 0; i < w->n; i++) {
                t[i] = w->t[(w->head + i) % w->cap];
                len[i] = w->len[(w->head + i) % w->cap];
            }
            free(w->t);
            free(w->len);
            w->t = t;
            w->len = len;
            w->head = 0;
            w->cap = cap;
        }
    }
    int i = (w->head + w->n) % w->cap;
    w->t[i] = now;
    w->len[i] = len;
    w->n++;
}

int64_t kvb_swift_window_max(kvb_swift_window *w, double now) {
    window_expire(w, now);
    return w->n ? w->len[w->head] : 0;
}

kvb_status kvb_swift_plan_lsc(const kvb_kv_geom *m, uint64_t c_master, const uint64_t *c_workers, int n,
                              kvb_swift_plan *out) {
    KVB_TRY(kvb_kv_geom_check(m));
    uint64_t m_block = kvb_kv_layer_bytes(m); /* Eq. 1: 2 * B * H_kv * D_kv * dtype */
    int64_t L = m->n_layers, k = 0;
    for (int i = 0; i < n; i++) k += (int64_t)(c_workers[i] / (m_block * (uint64_t)L)); /* Eq. 2 */
    int64_t k_master = (int64_t)(c_master / m_block);                                  /* Eq. 3 */
    out->m_block = m_block;
    out->k_workers = k;
    out->k_master = k_master;
    out->n_lsc = KVB_MIN(k, k_master);                     /* Eq. 4 */
    out->n_rc = k < k_master ? (k_master - k) / L : 0;     /* Eq. 5 */
    out->max_ctx_tokens = (out->n_lsc + out->n_rc) * m->block_size;
    out->no_lending_tokens = k_master / L * m->block_size;
    out->inplace_tokens = (k_master / L + k) * m->block_size;
    /* a streamed block costs 2/L of an own full-layer block and adds one: a gain only when L > 2 (with
     * L <= 2 the LSC would take as much as it streams, or more: nothing is streamed) */
    out->n_stream = L > 2 ? KVB_MAX(0, KVB_MIN(k, (k_master - L) / 2)) : 0;
    out->lsc_own_blocks = KVB_DIV_CEIL(2 * out->n_stream, L);
    out->n_rc_stream = k_master / L - out->lsc_own_blocks;
    out->stream_tokens = (out->n_stream + out->n_rc_stream) * m->block_size;
    return KVB_OK;
}
