/* kvbank — causal paged attention (GQA) on the CPU, reading K/V through per-layer block pointers.
 *
 * The work is split into items run by one OpenMP team:
 *  - decode-like sequences (few query rows per KV head): one item per (sequence, KV head) walks the
 *    blocks in place: dot products, softmax, weighted sum of V rows;
 *  - prefill-like sequences: one item per (sequence, KV head, tile of query rows) gathers the keys and
 *    values visible to the tile into contiguous scratch and runs Q.K^T and P.V as two sgemm calls
 *    with the causal mask applied between them.
 * Both compute exact softmax attention in f32 (max subtracted before exp). With a sliding window
 * (kvb_attn_batch.window) a row sees only its last `window` keys; keys before every row's window are
 * neither read nor gathered. */
#include <cblas.h>
#include <math.h>
#include <omp.h>
#include <string.h>

#include "kernels/cpu/ops.h"

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define KVB_ATTN_AVX2 1
#else
#define KVB_ATTN_AVX2 0
#endif

/* A sequence takes the sgemm path when it has at least this many query rows per KV head. */
#define GEMM_MIN_ROWS 32
/* Query rows (tokens x heads of a group) per sgemm tile. */
#define TILE_ROWS 128

typedef struct attn_item {
    int seq;
    int g;      /* KV head */
    int t0, t1; /* query rows [t0, t1) of the sequence; walk items cover all of them */
    int gemm;
} attn_item;

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

/* e^x for the softmax's arguments (x <= 0 once the maximum is subtracted), in a form the compiler
 * vectorizes (glibc's vector expf is only declared under -ffast-math): x = k ln2 + r with |r| <= ln2/2
 * (k rounded to nearest by the 1.5 * 2^23 trick, ln2 split in two for an exact product), e^r by the
 * classic degree-6 minimax polynomial of single-precision exp (relative error about 1e-7, at most a
 * couple of ulps), 2^k built in the exponent bits. Arguments below -87 are clamped: e^-87 is 1.6e-38, so
 * a weight that small cannot change a sum that includes e^0 = 1. */
static inline float exp_softmax(float x) {
    x = x < -87.0f ? -87.0f : x;
    float k = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;
    float r = x - k * 0.693359375f + k * 2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    float e = p * r * r + r + 1.0f;
    int32_t bits = ((int32_t)k + 127) << 23;
    float scale;
    memcpy(&scale, &bits, sizeof scale);
    return e * scale;
}

/* Softmax of s[0..n) in place. Eight partial maxima and sums keep the loops vectorizable. */
static void softmax(float *s, int n) {
    float m8[8], a8[8] = {0};
    for (int j = 0; j < 8; j++) m8[j] = s[0];
    int i = 0;
    for (; i + 8 <= n; i += 8)
        for (int j = 0; j < 8; j++) m8[j] = s[i + j] > m8[j] ? s[i + j] : m8[j];
    float mx = m8[0];
    for (int j = 1; j < 8; j++) mx = m8[j] > mx ? m8[j] : mx;
    for (; i < n; i++) mx = s[i] > mx ? s[i] : mx;
    for (i = 0; i < n; i++) s[i] = exp_softmax(s[i] - mx);
    for (i = 0; i + 8 <= n; i += 8)
        for (int j = 0; j < 8; j++) a8[j] += s[i + j];
    float sum = ((a8[0] + a8[4]) + (a8[1] + a8[5])) + ((a8[2] + a8[6]) + (a8[3] + a8[7]));
    for (; i < n; i++) sum += s[i];
    float inv = 1.0f / sum;
    for (i = 0; i < n; i++) s[i] *= inv;
}

/* The group's query heads against one key row: s[h * stride] = scale * <q[h], k> for h < gq. */
static inline void dots_group(const float *q, int gq, const float *k, int hd, float scale, float *s, size_t stride) {
    for (int h = 0; h < gq; h++) s[(size_t)h * stride] = dot(q + (size_t)h * hd, k, hd) * scale;
}

/* The group's outputs plus one value row: o[h] += p[h * stride] * v for h < gq. */
static inline void axpy_group(const float *p, size_t stride, int gq, const float *v, float *o, int hd) {
    for (int h = 0; h < gq; h++) axpy(p[(size_t)h * stride], v, o + (size_t)h * hd, hd);
}

#if KVB_ATTN_AVX2
/* The same two loops with AVX2 + FMA for the head dimensions models use (multiples of 8): each key
 * and value row is loaded once for all heads of the group. Chosen at run time (kvb__cpu_avx2). */
__attribute__((target("avx2,fma"))) static void dots_group_avx2(const float *q, int gq, const float *k, int hd,
                                                                 float scale, float *s, size_t stride) {
    for (int h = 0; h < gq; h++) {
        const float *qh = q + (size_t)h * hd;
        __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
        int i = 0;
        for (; i + 16 <= hd; i += 16) {
            a0 = _mm256_fmadd_ps(_mm256_loadu_ps(qh + i), _mm256_loadu_ps(k + i), a0);
            a1 = _mm256_fmadd_ps(_mm256_loadu_ps(qh + i + 8), _mm256_loadu_ps(k + i + 8), a1);
        }
        for (; i < hd; i += 8) a0 = _mm256_fmadd_ps(_mm256_loadu_ps(qh + i), _mm256_loadu_ps(k + i), a0);
        __m256 a = _mm256_add_ps(a0, a1);
        __m128 r = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
        r = _mm_add_ps(r, _mm_movehl_ps(r, r));
        r = _mm_add_ss(r, _mm_movehdup_ps(r));
        s[(size_t)h * stride] = _mm_cvtss_f32(r) * scale;
    }
}

__attribute__((target("avx2,fma"))) static void axpy_group_avx2(const float *p, size_t stride, int gq, const float *v,
                                                                 float *o, int hd) {
    for (int i = 0; i < hd; i += 8) {
        __m256 x = _mm256_loadu_ps(v + i);
        for (int h = 0; h < gq; h++) {
            float *oh = o + (size_t)h * hd + i;
            _mm256_storeu_ps(oh, _mm256_fmadd_ps(_mm256_set1_ps(p[(size_t)h * stride]), x, _mm256_loadu_ps(oh)));
        }
    }
}
#endif

/* First key a query row with `n_vis` causally visible keys may see: 0, or with a sliding window the
 * start of the window (the row's own key is the last of `window` keys). */
static inline int first_key(const kvb_attn_batch *b, int n_vis) {
    return b->window > 0 && n_vis > b->window ? n_vis - b->window : 0;
}

/* Every query row of the sequence for all query heads of KV group g, which sit next to each other
 * in a token's q row: one pass over the visible keys (each key row read once for the whole group),
 * the softmax of each head, one pass over the values. scores: gq * ctx_len floats, head h's score
 * for key k at scores[h * ctx_len + k]. */
static void attn_walk(const kvb_attn_batch *b, const kvb_attn_seq *sq, int g, const float *q, float *out,
                      float *scores) {
    const kvb_kv_geom *geo = b->geom;
    int hd = geo->head_dim, bs = geo->block_size, gq = b->n_heads / geo->n_kv_heads;
    size_t row = (size_t)geo->n_kv_heads * hd, half = (size_t)bs * row, stride = (size_t)sq->ctx_len;
#if KVB_ATTN_AVX2
    int simd = kvb__cpu_avx2 && hd % 8 == 0;
#endif
    for (int t = 0; t < sq->q_len; t++) {
        int n_vis = sq->ctx_len - sq->q_len + t + 1, lo = first_key(b, n_vis);
        const float *qg = q + ((size_t)(sq->q_start + t) * b->n_heads + (size_t)g * gq) * hd;
        float *og = out + ((size_t)(sq->q_start + t) * b->n_heads + (size_t)g * gq) * hd;
        /* keys [lo, n_vis), block by block */
        for (int k0 = lo; k0 < n_vis;) {
            int j = k0 / bs, r0 = k0 % bs, n_in = KVB_MIN(bs - r0, n_vis - k0);
            const float *kb = (const float *)b->layer_blocks[sq->blk_first + j] + (size_t)g * hd + r0 * row;
#if KVB_ATTN_AVX2
            if (simd) {
                for (int r = 0; r < n_in; r++) dots_group_avx2(qg, gq, kb + r * row, hd, b->scale, scores + k0 + r, stride);
                k0 += n_in;
                continue;
            }
#endif
            for (int r = 0; r < n_in; r++) dots_group(qg, gq, kb + r * row, hd, b->scale, scores + k0 + r, stride);
            k0 += n_in;
        }
        for (int h = 0; h < gq; h++) softmax(scores + (size_t)h * stride + lo, n_vis - lo);
        memset(og, 0, (size_t)gq * hd * sizeof(float));
        for (int k0 = lo; k0 < n_vis;) {
            int j = k0 / bs, r0 = k0 % bs, n_in = KVB_MIN(bs - r0, n_vis - k0);
            const float *vb = (const float *)b->layer_blocks[sq->blk_first + j] + half + (size_t)g * hd + r0 * row;
#if KVB_ATTN_AVX2
            if (simd) {
                for (int r = 0; r < n_in; r++) axpy_group_avx2(scores + k0 + r, stride, gq, vb + r * row, og, hd);
                k0 += n_in;
                continue;
            }
#endif
            for (int r = 0; r < n_in; r++) axpy_group(scores + k0 + r, stride, gq, vb + r * row, og, hd);
            k0 += n_in;
        }
    }
}

static size_t gemm_scratch_floats(int nk, int m, int hd) { return 2 * (size_t)nk * hd + (size_t)m * (nk + 2 * (size_t)hd); }

/* Query rows [t0, t1) of the sequence for KV group g through sgemm (single-threaded inside the team).
 * The tile gathers the keys [k_lo, nk) some row of it sees; row r's own keys are [lo_r, nvis_r). */
static void attn_gemm(const kvb_attn_batch *b, const kvb_attn_seq *sq, int g, int t0, int t1, const float *q,
                      float *out, float *scratch) {
    const kvb_kv_geom *geo = b->geom;
    int hd = geo->head_dim, bs = geo->block_size, gq = b->n_heads / geo->n_kv_heads;
    size_t row = (size_t)geo->n_kv_heads * hd, half = (size_t)bs * row;
    int past = sq->ctx_len - sq->q_len;
    int nk = past + t1, k_lo = first_key(b, past + t0 + 1); /* keys of the tile's last / first row */
    int m = (t1 - t0) * gq, nkt = nk - k_lo;
    float *kc = scratch, *vc = kc + (size_t)nkt * hd, *s = vc + (size_t)nkt * hd;
    float *qt = s + (size_t)m * nkt, *ot = qt + (size_t)m * hd;

    for (int k0 = k_lo; k0 < nk;) {
        int j = k0 / bs, r0 = k0 % bs, n_in = KVB_MIN(bs - r0, nk - k0);
        const float *blk = b->layer_blocks[sq->blk_first + j];
        for (int r = 0; r < n_in; r++) {
            size_t at = (size_t)(k0 - k_lo + r) * hd, src = (size_t)(r0 + r) * row + (size_t)g * hd;
            memcpy(kc + at, blk + src, (size_t)hd * sizeof(float));
            memcpy(vc + at, blk + half + src, (size_t)hd * sizeof(float));
        }
        k0 += n_in;
    }
    /* the group's gq heads are adjacent in a token's q row */
    for (int t = t0; t < t1; t++)
        memcpy(qt + (size_t)(t - t0) * gq * hd, q + ((size_t)(sq->q_start + t) * b->n_heads + (size_t)g * gq) * hd,
               (size_t)gq * hd * sizeof(float));
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, m, nkt, hd, b->scale, qt, hd, kc, hd, 0.0f, s, nkt);
    for (int r = 0; r < m; r++) {
        int n_vis = past + t0 + r / gq + 1, lo = first_key(b, n_vis) - k_lo, hi = n_vis - k_lo;
        float *sr = s + (size_t)r * nkt;
        softmax(sr + lo, hi - lo);
        for (int c = 0; c < lo; c++) sr[c] = 0.0f;
        for (int c = hi; c < nkt; c++) sr[c] = 0.0f;
    }
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, m, hd, nkt, 1.0f, s, nkt, vc, hd, 0.0f, ot, hd);
    for (int t = t0; t < t1; t++)
        memcpy(out + ((size_t)(sq->q_start + t) * b->n_heads + (size_t)g * gq) * hd, ot + (size_t)(t - t0) * gq * hd,
               (size_t)gq * hd * sizeof(float));
}

kvb_status kvb__cpu_attention(kvb_cpu_ctx *c, const kvb_attn_batch *b, const float *q, float *out) {
    const kvb_kv_geom *geo = b->geom;
    int nkv = geo->n_kv_heads, hd = geo->head_dim, gq = b->n_heads / nkv;
    int tile_t = KVB_MAX(1, TILE_ROWS / gq);
    int n_items = 0;
    for (int s = 0; s < b->n_seqs; s++) {
        const kvb_attn_seq *sq = &b->seqs[s];
        n_items += nkv * (sq->q_len * gq >= GEMM_MIN_ROWS ? KVB_DIV_CEIL(sq->q_len, tile_t) : 1);
    }
    if ((size_t)n_items > c->items_cap) {
        KVB_TRY(kvb_realloc_array(&c->items, (size_t)n_items, sizeof(attn_item)));
        c->items_cap = (size_t)n_items;
    }
    attn_item *items = c->items;
    size_t need = 0;
    int n = 0;
    for (int s = 0; s < b->n_seqs; s++) {
        const kvb_attn_seq *sq = &b->seqs[s];
        int gemm = sq->q_len * gq >= GEMM_MIN_ROWS;
        for (int g = 0; g < nkv; g++) {
            if (!gemm) {
                items[n++] = (attn_item){.seq = s, .g = g, .t0 = 0, .t1 = sq->q_len, .gemm = 0};
                continue;
            }
            for (int t0 = 0; t0 < sq->q_len; t0 += tile_t)
                items[n++] = (attn_item){.seq = s, .g = g, .t0 = t0, .t1 = KVB_MIN(sq->q_len, t0 + tile_t), .gemm = 1};
        }
        size_t item_need = gemm ? gemm_scratch_floats(sq->ctx_len, tile_t * gq, hd) : (size_t)gq * sq->ctx_len;
        need = KVB_MAX(need, item_need);
    }
    KVB_TRY(kvb__cpu_scratch_reserve(c, need));
#pragma omp parallel for schedule(dynamic, 1) if (n_items > 1) num_threads(kvb__cpu_threads)
    for (int i = 0; i < n_items; i++) {
        const attn_item *it = &items[i];
        float *scratch = c->scratch + (size_t)omp_get_thread_num() * c->scratch_floats;
        if (it->gemm) attn_gemm(b, &b->seqs[it->seq], it->g, it->t0, it->t1, q, out, scratch);
        else attn_walk(b, &b->seqs[it->seq], it->g, q, out, scratch);
    }
    return KVB_OK;
}
