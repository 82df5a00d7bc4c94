/* kvbank — causal paged attention (GQA) on the CPU, reading K/V through per-layer block pointers.
 *
 * Two paths with the same arithmetic contract (f32, exact softmax with max subtraction):
 *  - decode-like sequences (few query rows) walk their blocks in place: one pass of dot products,
 *    softmax, and a weighted sum of V rows; (sequence, KV head) pairs run in parallel on OpenMP;
 *  - prefill-like sequences gather one KV head's keys and values into contiguous scratch, then run
 *    query tiles through two multi-threaded sgemm calls (Q.K^T and P.V) with a causal mask between. */
#include <cblas.h>
#include <math.h>
#include <omp.h>
#include <string.h>

#include "kernels/cpu/ops.h"

/* A sequence takes the sgemm path when it has at least this many query rows per KV head. */
#define GEMM_MIN_ROWS 32
/* Query rows (tokens x heads of a group) per sgemm tile. */
#define TILE_ROWS 256

static inline float dot(const float *a, const float *b, int n) {
    float acc[8] = {0};
    int i = 0;
    for (; i + 8 <= n; i += 8)
        for (int j = 0; j < 8; j++) acc[j] += a[i + j] * b[i + j];
    float s = ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]));
    for (; i < n; i++) s += a[i] * b[i];
    return s;
}

static inline void axpy(float a, const float *x, float *y, int n) {
    for (int i = 0; i < n; i++) y[i] += a * x[i];
}

/* Softmax of s[0..n) in place; returns nothing, s sums to 1. */
static void softmax(float *s, int n) {
    float mx = s[0];
    for (int i = 1; i < n; i++) mx = s[i] > mx ? s[i] : mx;
    float sum = 0;
    for (int i = 0; i < n; i++) {
        s[i] = expf(s[i] - mx);
        sum += s[i];
    }
    float inv = 1.0f / sum;
    for (int i = 0; i < n; i++) s[i] *= inv;
}

/* One (sequence, KV head): every query row of the sequence, every query head of the group. */
static void attn_walk(const kvb_attn_batch *b, const kvb_attn_seq *sq, int g, const float *q, float *out,
                      float *scores) {
    const kvb_kv_geom *geo = b->geom;
    int hd = geo->head_dim, bs = geo->block_size, gq = b->n_heads / geo->n_kv_heads;
    size_t row = (size_t)geo->n_kv_heads * hd, half = (size_t)bs * row;
    for (int t = 0; t < sq->q_len; t++) {
        int n_vis = sq->ctx_len - sq->q_len + t + 1;
        for (int hi = 0; hi < gq; hi++) {
            int h = g * gq + hi;
            const float *qh = q + ((size_t)(sq->q_start + t) * b->n_heads + h) * hd;
            float *oh = out + ((size_t)(sq->q_start + t) * b->n_heads + h) * hd;
            for (int k0 = 0, j = 0; k0 < n_vis; k0 += bs, j++) {
                const float *kb = (const float *)b->layer_blocks[sq->blk_first + j] + (size_t)g * hd;
                int n_in = KVB_MIN(bs, n_vis - k0);
                for (int r = 0; r < n_in; r++) scores[k0 + r] = dot(qh, kb + r * row, hd) * b->scale;
            }
            softmax(scores, n_vis);
            memset(oh, 0, (size_t)hd * sizeof(float));
            for (int k0 = 0, j = 0; k0 < n_vis; k0 += bs, j++) {
                const float *vb = (const float *)b->layer_blocks[sq->blk_first + j] + half + (size_t)g * hd;
                int n_in = KVB_MIN(bs, n_vis - k0);
                for (int r = 0; r < n_in; r++) axpy(scores[k0 + r], vb + r * row, oh, hd);
            }
        }
    }
}

/* One (sequence, KV head) through sgemm. `scratch` holds 2*ctx*hd + TILE_ROWS*(ctx + 2*hd) floats. */
static void attn_gemm(const kvb_attn_batch *b, const kvb_attn_seq *sq, int g, const float *q, float *out,
                      float *scratch) {
    const kvb_kv_geom *geo = b->geom;
    int hd = geo->head_dim, bs = geo->block_size, gq = b->n_heads / geo->n_kv_heads;
    size_t row = (size_t)geo->n_kv_heads * hd, half = (size_t)bs * row;
    int ctx = sq->ctx_len, past = ctx - sq->q_len;
    float *kc = scratch, *vc = kc + (size_t)ctx * hd, *s = vc + (size_t)ctx * hd;
    float *qt = s + (size_t)TILE_ROWS * ctx, *ot = qt + (size_t)TILE_ROWS * hd;

    for (int k0 = 0, j = 0; k0 < ctx; k0 += bs, j++) {
        const float *blk = b->layer_blocks[sq->blk_first + j];
        int n_in = KVB_MIN(bs, ctx - k0);
        for (int r = 0; r < n_in; r++) {
            memcpy(kc + (size_t)(k0 + r) * hd, blk + r * row + (size_t)g * hd, (size_t)hd * sizeof(float));
            memcpy(vc + (size_t)(k0 + r) * hd, blk + half + r * row + (size_t)g * hd, (size_t)hd * sizeof(float));
        }
    }
    int tile_t = KVB_MAX(1, TILE_ROWS / gq);
    for (int t0 = 0; t0 < sq->q_len; t0 += tile_t) {
        int t1 = KVB_MIN(sq->q_len, t0 + tile_t);
        int m = (t1 - t0) * gq, nk = past + t1; /* keys visible to the tile's last row */
        for (int t = t0; t < t1; t++)
            memcpy(qt + (size_t)(t - t0) * gq * hd, q + ((size_t)(sq->q_start + t) * b->n_heads + (size_t)g * gq) * hd,
                   (size_t)gq * hd * sizeof(float));
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, m, nk, hd, b->scale, qt, hd, kc, hd, 0.0f, s, nk);
#pragma omp parallel for schedule(static) if (m * nk >= 65536)
        for (int r = 0; r < m; r++) {
            int n_vis = past + t0 + r / gq + 1;
            float *sr = s + (size_t)r * nk;
            softmax(sr, n_vis);
            for (int c = n_vis; c < nk; c++) sr[c] = 0.0f;
        }
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, m, hd, nk, 1.0f, s, nk, vc, hd, 0.0f, ot, hd);
        for (int t = t0; t < t1; t++)
            memcpy(out + ((size_t)(sq->q_start + t) * b->n_heads + (size_t)g * gq) * hd, ot + (size_t)(t - t0) * gq * hd,
                   (size_t)gq * hd * sizeof(float));
    }
}

kvb_status kvb__cpu_attention(kvb_cpu_ctx *c, const kvb_attn_batch *b, const float *q, float *out) {
    const kvb_kv_geom *geo = b->geom;
    int nkv = geo->n_kv_heads, hd = geo->head_dim, gq = b->n_heads / nkv;
    size_t need = 0;
    int n_walk = 0;
    for (int s = 0; s < b->n_seqs; s++) {
        const kvb_attn_seq *sq = &b->seqs[s];
        size_t ctx = (size_t)sq->ctx_len;
        if (sq->q_len * gq >= GEMM_MIN_ROWS)
            need = KVB_MAX(need, 2 * ctx * hd + (size_t)TILE_ROWS * (ctx + 2 * (size_t)hd));
        else {
            need = KVB_MAX(need, ctx);
            n_walk++;
        }
    }
    KVB_TRY(kvb__cpu_scratch_reserve(c, need));

    /* Prefill-like sequences first, from this thread: sgemm parallelises inside. */
    for (int s = 0; s < b->n_seqs; s++) {
        if (b->seqs[s].q_len * gq < GEMM_MIN_ROWS) continue;
        for (int g = 0; g < nkv; g++) attn_gemm(b, &b->seqs[s], g, q, out, c->scratch);
    }
    if (!n_walk) return KVB_OK;
    /* Decode-like sequences: one work item per (sequence, KV head). */
    int n_items = b->n_seqs * nkv;
#pragma omp parallel for schedule(dynamic, 1) if (n_items > 1)
    for (int it = 0; it < n_items; it++) {
        const kvb_attn_seq *sq = &b->seqs[it / nkv];
        if (sq->q_len * gq >= GEMM_MIN_ROWS) continue;
        float *scores = c->scratch + (size_t)omp_get_thread_num() * c->scratch_floats;
        attn_walk(b, sq, it % nkv, q, out, scores);
    }
    return KVB_OK;
}
