/* kvbank — causal paged attention (GQA) on the CPU, reading K/V through per-layer block pointers.
 *
 * The work is split into items run by one OpenMP team:
 *  - decode-like sequences (few query rows per KV head): one item per (sequence, chunk of WALK_KEYS
 *    keys at fixed positions) walks the blocks in place for every head at once, so each key and value
 *    row is read whole (all KV heads, contiguous): dot products, the chunk's softmax, weighted sum of V
 *    rows; a sequence of several chunks merges them by their maxima and sums, in chunk order. (An item
 *    per KV head read a quarter of every row of a 4-head model and ran at a third of the bandwidth.)
 *    Chunk bounds depend on key positions only, so a sequence's result does not depend on its batch;
 *  - prefill-like sequences: their visible keys and values are gathered once per call (K transposed),
 *    then one item per (sequence, KV head, tile of query rows) runs Q.K^T and P.V a block of keys at a
 *    time (AVX2 register tiles; sgemm without AVX2) with the causal mask and an online softmax between.
 * Both compute exact softmax attention in f32 (max subtracted before exp); a bf16 cache ("cpu:bf16") is
 * widened to f32 as it is read (walk: in registers by the AVX-512 kernels, else a block at a time into
 * L1; gemm: as gathered), the products unchanged, except where the walk takes the processor's bf16 dot
 * products (AVX512_BF16, head sizes a multiple of 64): there q and the softmax weights are rounded to
 * bf16 for the products too (dots_bf512, axpy_pairs_bf512). With a sliding window
 * (kvb_attn_batch.window) a row sees only its last `window` keys; keys before every row's window are
 * neither read nor gathered. */
#include <cblas.h>
#include <math.h>
#include <omp.h>
#include <string.h>

#include "kernels/cpu/ops.h"
#include "kernels/cpu/vexp.h"

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define KVB_ATTN_AVX2 1
#else
#define KVB_ATTN_AVX2 0
#endif

/* A sequence takes the gemm path (gathered K/V, tiled products) when it has at least this many query
 * rows per KV head. */
#define GEMM_MIN_ROWS 32
/* Query rows (tokens x heads of a group) per gemm tile, at most. A tile's tokens divide
 * KVB_CHUNK_ALIGN_ROWS and tiles start at step rows (kvb_attn_batch.row0 + q row) that are multiples
 * of it, so a sequence whose rows come in pieces (kernels/backend.h) has the tiles, and so the results,
 * it has in one piece. */
#define TILE_ROWS 128

/* Keys per decode walk item. */
#define WALK_KEYS 512

typedef struct attn_item {
    int seq;
    int g;      /* KV head (gemm items) */
    int t0, t1; /* query rows [t0, t1) of the sequence (gemm items); walk items cover all of them */
    int k0, k1; /* keys [k0, k1) (walk and gather items) */
    int part;   /* walk: the chunk's partial slot, or -1 when the sequence has one chunk */
    int gemm;   /* 1: a gemm item, 2: a gather item */
    int kbase;  /* gemm and gather: the first key of the sequence's gathered K/V */
    size_t gat; /* gemm and gather: where the sequence's gathered K/V start in kvb_cpu_ctx.gath */
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

/* s[i] = e^(s[i] - mx) for i < n: 8 lanes at a time where AVX2 is there (the same polynomial; FMA may
 * contract it, so a machine gives the same result on every path, not the same bits as another one). */
#if KVB_ATTN_AVX2
__attribute__((target("avx2,fma"))) static void exp_sub_avx2(float *s, int n, float mx) {
    const __m256 vmx = _mm256_set1_ps(mx);
    int i = 0;
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(s + i, kvb__expf8(_mm256_sub_ps(_mm256_loadu_ps(s + i), vmx)));
    for (; i < n; i++) s[i] = kvb__expf(s[i] - mx);
}
#endif

static void exp_sub(float *s, int n, float mx) {
#if KVB_ATTN_AVX2
    if (kvb__cpu_avx2) {
        exp_sub_avx2(s, n, mx);
        return;
    }
#endif
    for (int i = 0; i < n; i++) s[i] = kvb__expf(s[i] - mx);
}

/* The maximum of s[0..n), n > 0 (8 lanes, then across). */
static float row_max(const float *s, int n) {
    float m8[8];
    for (int j = 0; j < 8; j++) m8[j] = s[0];
    int i = 0;
    for (; i + 8 <= n; i += 8)
        for (int j = 0; j < 8; j++) m8[j] = s[i + j] > m8[j] ? s[i + j] : m8[j];
    float mx = m8[0];
    for (int j = 1; j < 8; j++) mx = m8[j] > mx ? m8[j] : mx;
    for (; i < n; i++) mx = s[i] > mx ? s[i] : mx;
    return mx;
}

/* The sum of s[0..n) (8 lanes, then pairwise). */
static float row_sum(const float *s, int n) {
    float a8[8] = {0};
    int i = 0;
    for (; i + 8 <= n; i += 8)
        for (int j = 0; j < 8; j++) a8[j] += s[i + j];
    float acc = ((a8[0] + a8[4]) + (a8[1] + a8[5])) + ((a8[2] + a8[6]) + (a8[3] + a8[7]));
    for (; i < n; i++) acc += s[i];
    return acc;
}

/* e^(s[i] - max) in place for s[0..n), n > 0; returns the max, *sum the sum (not normalised). */
static float exp_part(float *s, int n, float *sum) {
    float mx = row_max(s, n);
    exp_sub(s, n, mx);
    *sum = row_sum(s, n);
    return mx;
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

/* Every head of a token against one whole key row (all KV heads): s[h * stride] for h < n_heads. */
__attribute__((target("avx2,fma"))) static void dots_row_avx2(const float *q, int n_kv, int gq, const float *k,
                                                               int hd, float scale, float *s, size_t stride) {
    for (int g = 0; g < n_kv; g++)
        dots_group_avx2(q + (size_t)g * gq * hd, gq, k + (size_t)g * hd, hd, scale, s + (size_t)g * gq * stride, stride);
}

/* Every head's output plus its share of one whole value row. */
__attribute__((target("avx2,fma"))) static void axpy_row_avx2(const float *p, size_t stride, int n_kv, int gq,
                                                               const float *v, float *o, int hd) {
    for (int g = 0; g < n_kv; g++)
        axpy_group_avx2(p + (size_t)g * gq * stride, stride, gq, v + (size_t)g * hd, o + (size_t)g * gq * hd, hd);
}

/* The same for 4 consecutive value rows (v, v + row, ...; their weights p[h * stride + j], j < 4): each
 * output vector is loaded and stored once for the 4 rows instead of once per row. Its 4 FMAs run in row
 * order, so the sums are the same bits as 4 calls of axpy_row_avx2. */
__attribute__((target("avx2,fma"))) static void axpy_rows4_avx2(const float *p, size_t stride, int n_kv, int gq,
                                                                 const float *v, size_t row, float *o, int hd) {
    for (int g = 0; g < n_kv; g++) {
        const float *vg = v + (size_t)g * hd;
        for (int h = g * gq; h < (g + 1) * gq; h++) {
            const float *ph = p + (size_t)h * stride;
            __m256 p0 = _mm256_set1_ps(ph[0]), p1 = _mm256_set1_ps(ph[1]), p2 = _mm256_set1_ps(ph[2]),
                   p3 = _mm256_set1_ps(ph[3]);
            float *oh = o + (size_t)h * hd;
            for (int i = 0; i < hd; i += 8) {
                __m256 acc = _mm256_loadu_ps(oh + i);
                acc = _mm256_fmadd_ps(p0, _mm256_loadu_ps(vg + i), acc);
                acc = _mm256_fmadd_ps(p1, _mm256_loadu_ps(vg + row + i), acc);
                acc = _mm256_fmadd_ps(p2, _mm256_loadu_ps(vg + 2 * row + i), acc);
                acc = _mm256_fmadd_ps(p3, _mm256_loadu_ps(vg + 3 * row + i), acc);
                _mm256_storeu_ps(oh + i, acc);
            }
        }
    }
}

/* Share `part` of `parts` of the prefetch of [pf, pf + bytes): a block's kernels spread the next block's
 * prefetch over their loops, so that it goes on while they compute. Into L2 (locality 2), as the products'
 * streaming kernel does (kernels/cpu/ops.c): a block's lines prefetched into L1 evicted the lines still in
 * use, and their requests queued behind each other. Always inlined: a copy out of line counts as free of
 * side effects to GCC, which then drops the calls (it did in the large dots_bf512). */
__attribute__((always_inline)) static inline void prefetch_share(const char *pf, size_t bytes, int part, int parts) {
    size_t lines = KVB_DIV_CEIL(bytes, 64), l1 = lines * (size_t)(part + 1) / (size_t)parts;
    for (size_t l = lines * (size_t)part / (size_t)parts; l < l1; l++) __builtin_prefetch(pf + l * 64, 0, 2);
}

/* s[j] = scale * (the sum of a[j]'s lanes) for j < 4, the lanes summed as hsum8 sums them (l + l+4, then
 * the pairs, then the two halves), the four sums together by a transpose in registers. */
__attribute__((target("avx2,fma"), always_inline)) static inline void hsum4_scaled(const __m256 a[4], __m256 scale,
                                                                                   float *s) {
    /* lanes l + l+4 of rows 0, 1 (then 2, 3) side by side: row 0 in the low half, row 1 in the high */
    __m256 s01 = _mm256_add_ps(_mm256_permute2f128_ps(a[0], a[1], 0x20), _mm256_permute2f128_ps(a[0], a[1], 0x31));
    __m256 s23 = _mm256_add_ps(_mm256_permute2f128_ps(a[2], a[3], 0x20), _mm256_permute2f128_ps(a[2], a[3], 0x31));
    /* + the pair two lanes on: low half [r0 e, r0 o, r2 e, r2 o], high half the same for rows 1, 3 */
    __m256 u = _mm256_add_ps(_mm256_shuffle_ps(s01, s23, _MM_SHUFFLE(1, 0, 1, 0)),
                             _mm256_shuffle_ps(s01, s23, _MM_SHUFFLE(3, 2, 3, 2)));
    /* even + odd: [r0, r2, r0, r2 | r1, r3, r1, r3] */
    __m256 w = _mm256_add_ps(_mm256_shuffle_ps(u, u, _MM_SHUFFLE(2, 0, 2, 0)), _mm256_shuffle_ps(u, u, _MM_SHUFFLE(3, 1, 3, 1)));
    __m128 r = _mm_unpacklo_ps(_mm256_castps256_ps128(w), _mm256_extractf128_ps(w, 1));
    _mm_storeu_ps(s, _mm_mul_ps(r, _mm256_castps256_ps128(scale)));
}

/* Scores of 4 consecutive key rows (k, k + row, ...) for one head, s[j] = scale * <q, k_j> for j < 4,
 * each product summed as dots_group_avx2 sums it (two accumulators over alternate 8-lane groups, then
 * lanes l and l + 4, then the pairs, then the two halves), so the same bits; the 4 horizontal sums are
 * done together by a transpose in registers, a quarter of their instructions. With hd a constant (the
 * callers below) q stays in registers for the 4 rows. */
__attribute__((target("avx2,fma"), always_inline)) static inline void dots4_head(const float *q, const float *k,
                                                                                 size_t row, int hd, __m256 scale,
                                                                                 float *s) {
    __m256 a[4];
    _Pragma("GCC unroll 4") for (int j = 0; j < 4; j++) {
        const float *kj = k + (size_t)j * row;
        __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
        int i = 0;
        _Pragma("GCC unroll 8") for (; i + 16 <= hd; i += 16) {
            a0 = _mm256_fmadd_ps(_mm256_loadu_ps(q + i), _mm256_loadu_ps(kj + i), a0);
            a1 = _mm256_fmadd_ps(_mm256_loadu_ps(q + i + 8), _mm256_loadu_ps(kj + i + 8), a1);
        }
        for (; i < hd; i += 8) a0 = _mm256_fmadd_ps(_mm256_loadu_ps(q + i), _mm256_loadu_ps(kj + i), a0);
        a[j] = _mm256_add_ps(a0, a1);
    }
    hsum4_scaled(a, scale, s);
}

/* Every head's scores for rows [0, n) of a block's keys, n a multiple of 4 (k: the first row; s: head
 * 0's score of that row, head h's h * stride on). Head by head, so that q stays in registers. */
__attribute__((target("avx2,fma"), always_inline)) static inline void dots_quads_body(const float *q, int nh, int gq,
                                                                                      const float *k, size_t row, int n,
                                                                                      int hd, float scale, float *s,
                                                                                      size_t stride, const char *pf,
                                                                                      size_t pf_bytes) {
    __m256 sc = _mm256_set1_ps(scale);
    for (int h = 0; h < nh; h++) {
        prefetch_share(pf, pf_bytes, h, nh);
        const float *qh = q + (size_t)h * hd, *kg = k + (size_t)(h / gq) * hd;
        float *sh = s + (size_t)h * stride;
        for (int r = 0; r + 4 <= n; r += 4) dots4_head(qh, kg + (size_t)r * row, row, hd, sc, sh + r);
    }
}
__attribute__((target("avx2,fma"))) static void dots_quads_64(const float *q, int nh, int gq, const float *k,
                                                              size_t row, int n, float scale, float *s, size_t stride,
                                                              const char *pf, size_t pf_bytes) {
    dots_quads_body(q, nh, gq, k, row, n, 64, scale, s, stride, pf, pf_bytes);
}
__attribute__((target("avx2,fma"))) static void dots_quads(const float *q, int nh, int gq, const float *k, size_t row,
                                                           int n, int hd, float scale, float *s, size_t stride,
                                                           const char *pf, size_t pf_bytes) {
    if (hd == 64) dots_quads_64(q, nh, gq, k, row, n, scale, s, stride, pf, pf_bytes);
    else dots_quads_body(q, nh, gq, k, row, n, hd, scale, s, stride, pf, pf_bytes);
}

/* o[h] += sum over rows r < n of p[h * stride + r] * v_r[h's KV head] for every head, v_r = v + r * row,
 * hd a multiple of 64: 64 columns of a head's output stay in registers while the rows pass, each
 * element's FMAs in row order as in axpy_rows4_avx2, so the same bits. */
__attribute__((target("avx2,fma"))) static void axpy_block_avx2(const float *p, size_t stride, int nh, int gq,
                                                                const float *v, size_t row, int n, float *o, int hd,
                                                                const char *pf, size_t pf_bytes) {
    for (int h = 0; h < nh; h++) {
        prefetch_share(pf, pf_bytes, h, nh);
        const float *ph = p + (size_t)h * stride, *vg = v + (size_t)(h / gq) * hd;
        for (int d = 0; d < hd; d += 64) {
            float *oh = o + (size_t)h * hd + d;
            __m256 acc[8];
            _Pragma("GCC unroll 8") for (int j = 0; j < 8; j++) acc[j] = _mm256_loadu_ps(oh + 8 * j);
            for (int r = 0; r < n; r++) {
                __m256 pr = _mm256_broadcast_ss(ph + r);
                const float *vr = vg + (size_t)r * row + d;
                _Pragma("GCC unroll 8") for (int j = 0; j < 8; j++)
                    acc[j] = _mm256_fmadd_ps(pr, _mm256_loadu_ps(vr + 8 * j), acc[j]);
            }
            _Pragma("GCC unroll 8") for (int j = 0; j < 8; j++) _mm256_storeu_ps(oh + 8 * j, acc[j]);
        }
    }
}

/* With AVX-512F, head sizes a multiple of 16 and up to GROUP512_MAX query heads per KV head, the walk
 * takes a KV group's heads together, so that every key and value row is loaded once for all of them (the
 * kernels above load it once per head: three times for the bench model's groups of 3), and spreads the
 * next block's prefetch over every 4 key rows (every value row) instead of over the heads: bursts of a
 * quarter of a block's lines had their requests wait behind each other. The decode walk alone, 12 layers
 * of the bench model on 2 Zen 4 cores: 1 x 8,192 keys 11.0-11.5 -> 7.7-7.9 ms (18 -> 26 GB/s), 32 x 128
 * 5.0 -> 4.0-4.3 ms. The same bits as the kernels above: a 16-lane accumulator over dimensions
 * [16i, 16i + 16) holds in its low lanes dots4_head's a0 and in its high lanes its a1, each lane's FMAs in
 * the same order, and its halves are added as a0 + a1; the values' FMAs run in row order for every output
 * element, from the output's value, as in axpy_block_avx2 (test_kernels: attention_decode_widths). */
#define GROUP512_MAX 6

#define V512_HALVES(x) _mm256_add_ps(_mm512_castps512_ps256(x), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(x), 1)))

/* 16 elements of a cache row at p + i as f32: loaded as they are (BF 0, an f32 cache), or 16 bf16 widened
 * in registers (BF 1: zero-extended, shifted into the high half; exact), the same values either way. */
__attribute__((target("avx512f"), always_inline)) static inline __m512 load16(const void *p, size_t i, const int BF) {
    if (!BF) return _mm512_loadu_ps((const float *)p + i);
    __m512i w = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)((const uint16_t *)p + i)));
    return _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
}

/* Scores of rows [0, n) of a block's keys, n a multiple of 4, for the GQ heads of one KV group (q: the
 * group's first head; k: its slice of the first key row; s: the first head's score of that row). */
__attribute__((target("avx512f,avx2,fma"), always_inline)) static inline void dots_quads_group512(
    const float *q, const int GQ, const void *k, const int BF, size_t row, int n, int hd, __m256 sc, float *s,
    size_t stride, const char *pf, size_t pf_bytes, int part0, int parts) {
    for (int r = 0; r + 4 <= n; r += 4) {
        prefetch_share(pf, pf_bytes, part0 + r / 4, parts);
        size_t kr = (size_t)r * row;
        __m512 acc[GROUP512_MAX][4];
        _Pragma("GCC unroll 6") for (int h = 0; h < GQ; h++) _Pragma("GCC unroll 4") for (int j = 0; j < 4; j++)
            acc[h][j] = _mm512_setzero_ps();
        for (int i = 0; i < hd; i += 16) {
            __m512 kv[4];
            _Pragma("GCC unroll 4") for (int j = 0; j < 4; j++) kv[j] = load16(k, kr + (size_t)j * row + i, BF);
            _Pragma("GCC unroll 6") for (int h = 0; h < GQ; h++) {
                __m512 qv = _mm512_loadu_ps(q + (size_t)h * hd + i);
                _Pragma("GCC unroll 4") for (int j = 0; j < 4; j++) acc[h][j] = _mm512_fmadd_ps(qv, kv[j], acc[h][j]);
            }
        }
        _Pragma("GCC unroll 6") for (int h = 0; h < GQ; h++) {
            __m256 a[4];
            _Pragma("GCC unroll 4") for (int j = 0; j < 4; j++) a[j] = V512_HALVES(acc[h][j]);
            hsum4_scaled(a, sc, s + (size_t)h * stride + r);
        }
    }
}

/* o[h] += sum over rows r < n of p[h * stride + r] * v_r for the GQ heads of one KV group (v: the group's
 * slice of the first value row; o: its first head's output), hd a multiple of 64. */
__attribute__((target("avx512f,avx2,fma"), always_inline)) static inline void axpy_group512(
    const float *p, size_t stride, const int GQ, const void *v, const int BF, size_t row, int n, float *o, int hd,
    const char *pf, size_t pf_bytes, int part0, int parts) {
    for (int d = 0; d < hd; d += 64) {
        __m512 acc[GROUP512_MAX][4];
        _Pragma("GCC unroll 6") for (int h = 0; h < GQ; h++) _Pragma("GCC unroll 4") for (int c = 0; c < 4; c++)
            acc[h][c] = _mm512_loadu_ps(o + (size_t)h * hd + d + 16 * c);
        for (int r = 0; r < n; r++) {
            if (d == 0) prefetch_share(pf, pf_bytes, part0 + r, parts);
            size_t vr = (size_t)r * row + d;
            __m512 vv[4];
            _Pragma("GCC unroll 4") for (int c = 0; c < 4; c++) vv[c] = load16(v, vr + 16 * c, BF);
            _Pragma("GCC unroll 6") for (int h = 0; h < GQ; h++) {
                __m512 pr = _mm512_set1_ps(p[(size_t)h * stride + r]);
                _Pragma("GCC unroll 4") for (int c = 0; c < 4; c++) acc[h][c] = _mm512_fmadd_ps(pr, vv[c], acc[h][c]);
            }
        }
        _Pragma("GCC unroll 6") for (int h = 0; h < GQ; h++) _Pragma("GCC unroll 4") for (int c = 0; c < 4; c++)
            _mm512_storeu_ps(o + (size_t)h * hd + d + 16 * c, acc[h][c]);
    }
}

/* Calls BODY(GQ, BF) with GQ a constant from 1 to GROUP512_MAX and BF one of 0, 1 (the accumulators then
 * live in registers, and the loads are one instruction or three). */
#define GROUP512_SWITCH_BF(gq, BF, BODY)                                                                           \
    switch (gq) {                                                                                                 \
    case 1: BODY(1, BF); break;                                                                                   \
    case 2: BODY(2, BF); break;                                                                                   \
    case 3: BODY(3, BF); break;                                                                                   \
    case 4: BODY(4, BF); break;                                                                                   \
    case 5: BODY(5, BF); break;                                                                                   \
    default: BODY(6, BF); break;                                                                                  \
    }
#define GROUP512_SWITCH(gq, bf, BODY)                                                                              \
    do {                                                                                                          \
        if (bf) GROUP512_SWITCH_BF(gq, 1, BODY) else GROUP512_SWITCH_BF(gq, 0, BODY)                              \
    } while (0)

/* dots_quads for every KV group (gq <= GROUP512_MAX), the next block's prefetch spread over every 4 key rows
 * of every group. */
__attribute__((target("avx512f,avx2,fma"))) static void dots_quads512(const float *q, int nkv, int gq, const void *k,
                                                                      int bf16, size_t row, int n, int hd, float scale,
                                                                      float *s, size_t stride, const char *pf,
                                                                      size_t pf_bytes) {
    __m256 sc = _mm256_set1_ps(scale);
    for (int g = 0; g < nkv; g++) {
        const float *qg = q + (size_t)g * gq * hd;
        const void *kg = (const char *)k + (size_t)g * hd * (bf16 ? 2 : sizeof(float));
        float *sg = s + (size_t)g * gq * stride;
#define DOTS(GQ, BF)                                                                                               \
    dots_quads_group512(qg, GQ, kg, BF, row, n, hd, sc, sg, stride, pf, pf_bytes, g * (n / 4), nkv * (n / 4))
        GROUP512_SWITCH(gq, bf16, DOTS);
#undef DOTS
    }
}

/* axpy_block_avx2 for every KV group (gq <= GROUP512_MAX, hd a multiple of 64), the next block's prefetch
 * spread over every value row of every group. */
__attribute__((target("avx512f,avx2,fma"))) static void axpy_block512(const float *p, size_t stride, int nkv, int gq,
                                                                      const void *v, int bf16, size_t row, int n,
                                                                      float *o, int hd, const char *pf,
                                                                      size_t pf_bytes) {
    for (int g = 0; g < nkv; g++) {
        const float *pg = p + (size_t)g * gq * stride;
        const void *vg = (const char *)v + (size_t)g * hd * (bf16 ? 2 : sizeof(float));
        float *og = o + (size_t)g * gq * hd;
#define AXPY(GQ, BF) axpy_group512(pg, stride, GQ, vg, BF, row, n, og, hd, pf, pf_bytes, g * n, nkv * n)
        GROUP512_SWITCH(gq, bf16, AXPY);
#undef AXPY
    }
}

/* With AVX512_BF16 (kvb__cpu_avx512bf16) the walk of a bf16 cache multiplies in bf16: vdpbf16ps takes 32
 * bf16 pairs of products per instruction where the widening kernels above take 16 f32 FMAs, and reads the
 * rows as they are (no widening). Its operands are bf16: q is rounded to bf16 for the scores (as llama.cpp
 * rounds q to its KV cache's type) and the softmax weights p for the values (as kvbank's own tensor-core
 * prefill rounds P to bf16 for its P.V MMA, kernels/cuda/attention_tc.cu), both to nearest even; each pair
 * of products is exact in f32 and summed into f32 accumulators, the softmax (max, exp, the sum l of the
 * unrounded p) stays f32. Head sizes a multiple of 64 and up to GROUP512_MAX heads per KV group; elsewhere
 * the widening kernels run. Per key and head at head size 64, the scores take 2 vdpbf16ps and the values 2
 * (against 4 + 4 FMAs), plus per key, shared by the group's heads, 2 loads and 2 unpacks for the values. */
#define BF16DOT_TARGET "avx512f,avx512bw,avx512vl,avx512bf16,avx2,fma"

/* n f32 at src rounded to bf16 into dst (the instruction's rounding: to nearest even, denormals to zero). */
__attribute__((target(BF16DOT_TARGET))) static void round_bf16(const float *src, uint16_t *dst, int n) {
    int i = 0;
    for (; i + 16 <= n; i += 16)
        _mm256_storeu_si256((__m256i *)(dst + i), (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(src + i)));
    if (i < n) {
        __mmask16 m = (__mmask16)((1u << (n - i)) - 1);
        _mm256_mask_storeu_epi16(dst + i, m, (__m256i)_mm512_cvtneps_pbh(_mm512_maskz_loadu_ps(m, src + i)));
    }
}

/* Scores of 4 key rows (k, k + row, ...; the first nr of them read, the others zero) for the GQ heads of
 * one KV group from its bf16 q (qb), 32 dimensions a vdpbf16ps into a 16-lane accumulator per key and
 * head, summed as dots_quads_group512 sums its accumulators (halves, then hsum4_scaled): a key's sum does
 * not depend on its place among the 4, so a score is the same bits whatever the block size. */
__attribute__((target(BF16DOT_TARGET), always_inline)) static inline void dots4_group_bf(const uint16_t *qb,
                                                                                        const int GQ,
                                                                                        const uint16_t *k, size_t row,
                                                                                        const int nr, int hd, __m256 sc,
                                                                                        float *s, size_t stride) {
    __m512 acc[GROUP512_MAX][4];
    _Pragma("GCC unroll 6") for (int h = 0; h < GQ; h++) _Pragma("GCC unroll 4") for (int j = 0; j < 4; j++)
        acc[h][j] = _mm512_setzero_ps();
    for (int i = 0; i < hd; i += 32) {
        __m512bh kv[4];
        _Pragma("GCC unroll 4") for (int j = 0; j < 4; j++) kv[j] =
            (__m512bh)(j < nr ? _mm512_loadu_si512(k + (size_t)j * row + i) : _mm512_setzero_si512());
        _Pragma("GCC unroll 6") for (int h = 0; h < GQ; h++) {
            __m512bh qv = (__m512bh)_mm512_loadu_si512(qb + (size_t)h * hd + i);
            _Pragma("GCC unroll 4") for (int j = 0; j < 4; j++) acc[h][j] = _mm512_dpbf16_ps(acc[h][j], qv, kv[j]);
        }
    }
    _Pragma("GCC unroll 6") for (int h = 0; h < GQ; h++) {
        __m256 a[4];
        _Pragma("GCC unroll 4") for (int j = 0; j < 4; j++) a[j] = V512_HALVES(acc[h][j]);
        float t[4];
        hsum4_scaled(a, sc, nr == 4 ? s + (size_t)h * stride : t);
        if (nr < 4) memcpy(s + (size_t)h * stride, t, (size_t)nr * sizeof(float));
    }
}

/* Every KV group's scores for rows [0, n) of a block's bf16 keys (any n: the last 1-3 rows by
 * dots4_group_bf with zero rows), the next block's prefetch spread over every 4 key rows of every group. */
__attribute__((target(BF16DOT_TARGET))) static void dots_bf512(const uint16_t *qb, int nkv, int gq, const uint16_t *k,
                                                               size_t row, int n, int hd, float scale, float *s,
                                                               size_t stride, const char *pf, size_t pf_bytes) {
    __m256 sc = _mm256_set1_ps(scale);
    int quads = KVB_DIV_CEIL(n, 4);
    for (int g = 0; g < nkv; g++) {
        const uint16_t *qg = qb + (size_t)g * gq * hd, *kg = k + (size_t)g * hd;
        float *sg = s + (size_t)g * gq * stride;
        for (int r = 0; r < n; r += 4) {
            prefetch_share(pf, pf_bytes, g * quads + r / 4, nkv * quads);
            const uint16_t *kr = kg + (size_t)r * row;
#define DOTS(GQ, BF_)                                                                                              \
    do {                                                                                                          \
        if (r + 4 <= n) dots4_group_bf(qg, GQ, kr, row, 4, hd, sc, sg + r, stride);                               \
        else dots4_group_bf(qg, GQ, kr, row, n - r, hd, sc, sg + r, stride);                                      \
    } while (0)
            GROUP512_SWITCH_BF(gq, 1, DOTS);
#undef DOTS
        }
    }
}

/* o[h] += p_a v_a + p_b v_b for npairs pairs of value rows (a_i = va + i * step, b_i = vb + i * step; the
 * group's slices) and the GQ heads of one KV group, their weights the bf16 pairs (pb[h * pstride + 2i],
 * pb[h * pstride + 2i + 1]), hd a multiple of 64. The two rows' bf16 are interleaved (unpacklo/hi of
 * 16-bit words) so that a vdpbf16ps against the broadcast pair of weights adds both rows' products to
 * each output element: o is kept in that interleaved order (bf_unpermute puts it back): in each 32
 * dimensions, the first 16 floats hold dimensions 0-3, 8-11, 16-19, 24-27, the next 16 the others. Each
 * output element sums its pairs in key order, whichever call they come in, so the same bits for any
 * block size. */
__attribute__((target(BF16DOT_TARGET), always_inline)) static inline void axpy_pairs_group_bf(
    const uint16_t *pb, size_t pstride, const int GQ, const uint16_t *va, const uint16_t *vb, size_t step, int npairs,
    float *o, int hd, const char *pf, size_t pf_bytes, int part0, int parts) {
    for (int d = 0; d < hd; d += 64) {
        __m512 acc[GROUP512_MAX][4];
        _Pragma("GCC unroll 6") for (int h = 0; h < GQ; h++) _Pragma("GCC unroll 4") for (int c = 0; c < 4; c++)
            acc[h][c] = _mm512_loadu_ps(o + (size_t)h * hd + d + 16 * c);
        for (int i = 0; i < npairs; i++) {
            if (d == 0) prefetch_share(pf, pf_bytes, part0 + i, parts);
            const uint16_t *ra = va + (size_t)i * step + d, *rb = vb + (size_t)i * step + d;
            __m512i a0 = _mm512_loadu_si512(ra), a1 = _mm512_loadu_si512(ra + 32);
            __m512i b0 = _mm512_loadu_si512(rb), b1 = _mm512_loadu_si512(rb + 32);
            __m512bh x[4] = {(__m512bh)_mm512_unpacklo_epi16(a0, b0), (__m512bh)_mm512_unpackhi_epi16(a0, b0),
                             (__m512bh)_mm512_unpacklo_epi16(a1, b1), (__m512bh)_mm512_unpackhi_epi16(a1, b1)};
            _Pragma("GCC unroll 6") for (int h = 0; h < GQ; h++) {
                int32_t w;
                memcpy(&w, pb + (size_t)h * pstride + 2 * (size_t)i, sizeof w);
                __m512bh pw = (__m512bh)_mm512_set1_epi32(w);
                _Pragma("GCC unroll 4") for (int c = 0; c < 4; c++) acc[h][c] = _mm512_dpbf16_ps(acc[h][c], x[c], pw);
            }
        }
        _Pragma("GCC unroll 6") for (int h = 0; h < GQ; h++) _Pragma("GCC unroll 4") for (int c = 0; c < 4; c++)
            _mm512_storeu_ps(o + (size_t)h * hd + d + 16 * c, acc[h][c]);
    }
}

/* axpy_pairs_group_bf for every KV group (va, vb: whole rows; pb: head 0's first weight), the next
 * block's prefetch spread over every pair of every group (all of it at once when there is no pair). */
__attribute__((target(BF16DOT_TARGET))) static void axpy_pairs_bf512(const uint16_t *pb, size_t pstride, int nkv, int gq,
                                                                     const uint16_t *va, const uint16_t *vb, size_t step,
                                                                     int npairs, float *o, int hd, const char *pf,
                                                                     size_t pf_bytes) {
    if (!npairs) {
        prefetch_share(pf, pf_bytes, 0, 1);
        return;
    }
    for (int g = 0; g < nkv; g++) {
        const uint16_t *pg = pb + (size_t)g * gq * pstride, *vag = va + (size_t)g * hd, *vbg = vb + (size_t)g * hd;
        float *og = o + (size_t)g * gq * hd;
#define AXPY(GQ, BF_)                                                                                              \
    axpy_pairs_group_bf(pg, pstride, GQ, vag, vbg, step, npairs, og, hd, pf, pf_bytes, g * npairs, nkv * npairs)
        GROUP512_SWITCH_BF(gq, 1, AXPY);
#undef AXPY
    }
}

/* n floats of outputs (a multiple of 32) from axpy_pairs_group_bf's interleaved order back to dimension
 * order, in place. */
__attribute__((target(BF16DOT_TARGET))) static void bf_unpermute(float *o, size_t n) {
    const __m512i lo = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
    const __m512i hi = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
    for (size_t i = 0; i < n; i += 32) {
        __m512 a = _mm512_loadu_ps(o + i), b = _mm512_loadu_ps(o + i + 16);
        _mm512_storeu_ps(o + i, _mm512_permutex2var_ps(a, lo, b));
        _mm512_storeu_ps(o + i + 16, _mm512_permutex2var_ps(a, hi, b));
    }
}
#endif

/* Asks for the `bytes` at p (one key or value row) to be brought into the cache. A walk reads a block's
 * rows in order, which the hardware prefetcher follows, but the next block is anywhere in the pool: while
 * it reads row r of one block it prefetches row r of the next. */
static inline void prefetch_row(const char *p, size_t bytes) {
    for (size_t o = 0; o < bytes; o += 64) __builtin_prefetch(p + o, 0, 2);
}

#if KVB_ATTN_AVX2
/* 32 bf16 to f32: each 16-bit pattern zero-extended and shifted into the high half. */
__attribute__((target("avx512f"))) static inline void widen32_512(const uint16_t *s, float *d) {
    __m512i a = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)s));
    __m512i b = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(s + 16)));
    _mm512_storeu_ps(d, _mm512_castsi512_ps(_mm512_slli_epi32(a, 16)));
    _mm512_storeu_ps(d + 16, _mm512_castsi512_ps(_mm512_slli_epi32(b, 16)));
}

__attribute__((target("avx2"))) static inline void widen32_avx2(const uint16_t *s, float *d) {
    for (int j = 0; j < 32; j += 8) {
        __m256i a = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(s + j)));
        _mm256_storeu_ps(d + j, _mm256_castsi256_ps(_mm256_slli_epi32(a, 16)));
    }
}
#endif

/* A bf16 cache's rows widened to f32: n elements at src into dst (exact: a bf16 is the high half of an
 * f32), with the next block's bf16 rows [pf, pf + pf_bytes) prefetched a line per line widened. Where the
 * AVX-512 kernels do not run (AVX2, head sizes not a multiple of 16, a block's rows after its fours) the
 * walk runs its f32 kernels on dst, which stays in L1: the same products as an f32 cache holding the
 * rounded values, so on these paths "cpu:bf16" differs from "cpu" by the rounding of K and V alone (on the
 * bf16 dot products, by that of K, V, and q and p for the products). The AVX-512 kernels
 * widen in registers instead (load16): the same values, without the store and the load back, which took a
 * third of the walk's time (12 layers of the bench model at 2,048 keys, 2 Zen 4 cores, the cache in L3:
 * 0.72 -> 0.49-0.52 ms; one core 1.39 -> 0.95-0.97 ms). Its own loop, not
 * kvb__cpu_widen: one prefetch per 64 bytes widened kept the decode step at 8.9 ms on a 2K context
 * where widening 1 KB chunks through kvb__cpu_widen, each after its share of the prefetch, took 10.1 ms
 * (one thread, the bench model). */
static void widen_rows(const uint16_t *src, size_t n, float *dst, const char *pf, size_t pf_bytes) {
    size_t i = 0, line = 0;
#if KVB_ATTN_AVX2
    if (kvb__cpu_avx512) {
        for (; i + 32 <= n; i += 32, line += 64) {
            if (pf && line < pf_bytes) __builtin_prefetch(pf + line, 0, 2);
            widen32_512(src + i, dst + i);
        }
    } else if (kvb__cpu_avx2) {
        for (; i + 32 <= n; i += 32, line += 64) {
            if (pf && line < pf_bytes) __builtin_prefetch(pf + line, 0, 2);
            widen32_avx2(src + i, dst + i);
        }
    }
#endif
    for (; i < n; i++) {
        uint32_t x = (uint32_t)src[i] << 16;
        memcpy(dst + i, &x, sizeof x);
    }
    for (; pf && line < pf_bytes; line += 64) __builtin_prefetch(pf + line, 0, 2);
}

/* First key a query row with `n_vis` causally visible keys may see: 0, or with a sliding window the
 * start of the window (the row's own key is the last of `window` keys). */
static inline int first_key(const kvb_attn_batch *b, int n_vis) {
    return b->window > 0 && n_vis > b->window ? n_vis - b->window : 0;
}

/* Keys [k0, k1) of a decode-like sequence for every query row and head. Row t sees keys [lo_t, n_vis_t);
 * scores[(t * n_heads + h) * n + k - k0], n = k1 - k0. Each row and head gets the chunk's maximum m, sum
 * l and unnormalised output o = sum e^(s - m) v: normalised into `out` when the sequence has this one
 * chunk (part == NULL), else kept in the chunk's partial slot: o [q_len][n_heads][hd], then m and l,
 * [q_len][n_heads] each. */
static void attn_walk(const kvb_attn_batch *b, const kvb_attn_seq *sq, int k0, int k1, const float *q, float *out,
                      float *part, float *scores) {
    const kvb_kv_geom *geo = b->geom;
    int hd = geo->head_dim, bs = geo->block_size, nkv = geo->n_kv_heads, nh = b->n_heads, gq = nh / nkv;
    size_t row = (size_t)nkv * hd, half = (size_t)bs * row, stride = (size_t)(k1 - k0);
    /* a bf16 cache: the AVX-512 kernels read its rows where they are; the others, each block's rows widened
     * into `wide_rows` (after the scores: see `need` in kvb__cpu_attention) */
    int bf16 = geo->elem_size == 2;
    size_t es = bf16 ? 2 : sizeof(float);
    float *wide_rows = scores + (size_t)sq->q_len * nh * WALK_KEYS;
#if KVB_ATTN_AVX2
    int simd = kvb__cpu_avx2 && hd % 8 == 0;
    int wide = simd && kvb__cpu_avx512 && hd % 16 == 0 && gq <= GROUP512_MAX; /* the same bits, fewer loads */
    /* the bf16 dot products: q (qb) and each row's weights (pb, pstride a head, zero outside the row's keys)
     * rounded to bf16, and a zero row to pair a key without a partner with (after wide_rows) */
    int bfdot = wide && bf16 && kvb__cpu_avx512bf16 && hd % 64 == 0;
    size_t pstride = (size_t)((k1 - k0 + 2) & ~1);
    uint16_t *qb = (uint16_t *)(wide_rows + (size_t)bs * row), *pb = qb + (size_t)nh * hd, *zrow = pb + (size_t)nh * pstride;
    if (bfdot) memset(zrow, 0, row * sizeof(uint16_t));
#endif
    for (int t = 0; t < sq->q_len; t++) {
        int n_vis = sq->ctx_len - sq->q_len + t + 1;
        int a = KVB_MAX(k0, first_key(b, n_vis)), e = KVB_MIN(k1, n_vis);
        const float *qt = q + (size_t)(sq->q_start + t) * nh * hd;
        float *st = scores + (size_t)t * nh * stride;
        float *ot = part ? part + (size_t)t * nh * hd : out + (size_t)(sq->q_start + t) * nh * hd;
        float m[KVB_CPU_ATTN_MAX_HEADS], l[KVB_CPU_ATTN_MAX_HEADS];
        for (int h = 0; h < nh; h++) {
            m[h] = -INFINITY;
            l[h] = 0.0f;
        }
        memset(ot, 0, (size_t)nh * hd * sizeof(float));
        if (a < e) {
#if KVB_ATTN_AVX2
            if (bfdot) round_bf16(qt, qb, nh * hd);
#endif
            /* scores, key rows in block order */
            for (int k = a; k < e;) {
                int j = k / bs, r0 = k % bs, n_in = KVB_MIN(bs - r0, e - k);
                const char *blk = b->layer_blocks[sq->blk_first + j];
                int na = KVB_MIN(bs, e - k - n_in); /* rows read of the next block, which is prefetched */
                const char *kn = na > 0 ? (const char *)b->layer_blocks[sq->blk_first + j + 1] : NULL;
                const float *kb = (const float *)(blk + (size_t)r0 * row * es);
                int r = 0;
#if KVB_ATTN_AVX2
                if (bfdot) { /* every row of the block where it is, the next block's rows prefetched meanwhile */
                    dots_bf512(qb, nkv, gq, (const uint16_t *)kb, row, n_in, hd, b->scale, st + (k - k0), stride, kn,
                               kn ? (size_t)na * row * es : 0);
                    k += n_in;
                    continue;
                }
                if (wide && (n_in & ~3)) { /* rows by fours, read where they are (a bf16 cache widened in registers);
                                            * the next block's rows (as many as are read) prefetched meanwhile */
                    size_t pf = kn ? (size_t)na * row * es : 0;
                    r = n_in & ~3;
                    dots_quads512(qt, nkv, gq, kb, bf16, row, r, hd, b->scale, st + (k - k0), stride, kn, pf);
                    kn = NULL;
                }
#endif
                if (bf16 && r < n_in) {
                    widen_rows((const uint16_t *)kb + (size_t)r * row, (size_t)(n_in - r) * row, wide_rows + (size_t)r * row,
                               kn, kn ? (size_t)na * row * es : 0);
                    kb = wide_rows;
                    kn = NULL;
                }
#if KVB_ATTN_AVX2
                if (simd && !wide) { /* rows by fours, the next block's rows (as many as are read) prefetched meanwhile */
                    size_t pf = kn ? (size_t)na * row * sizeof(float) : 0;
                    r = n_in & ~3;
                    dots_quads(qt, nh, gq, kb, row, r, hd, b->scale, st + (k - k0), stride, kn, pf);
                    kn = NULL;
                }
#endif
                for (; r < n_in; r++) {
                    if (kn) prefetch_row(kn + (size_t)r * row * sizeof(float), row * sizeof(float));
                    float *s = st + (k + r - k0);
#if KVB_ATTN_AVX2
                    if (simd) {
                        dots_row_avx2(qt, nkv, gq, kb + r * row, hd, b->scale, s, stride);
                        continue;
                    }
#endif
                    for (int g = 0; g < nkv; g++)
                        dots_group(qt + (size_t)g * gq * hd, gq, kb + r * row + (size_t)g * hd, hd, b->scale,
                                   s + (size_t)g * gq * stride, stride);
                }
                k += n_in;
            }
            for (int h = 0; h < nh; h++) m[h] = exp_part(st + (size_t)h * stride + (a - k0), e - a, &l[h]);
#if KVB_ATTN_AVX2
            if (bfdot)
                for (int h = 0; h < nh; h++) {
                    uint16_t *ph = pb + (size_t)h * pstride;
                    memset(ph, 0, (size_t)(a - k0) * sizeof(uint16_t));
                    round_bf16(st + (size_t)h * stride + (a - k0), ph + (a - k0), e - a);
                    memset(ph + (e - k0), 0, (pstride - (size_t)(e - k0)) * sizeof(uint16_t));
                }
            /* bfdot: keys pair as (even, odd) positions; an even key whose partner is in the next block waits
             * here, a key without one (before a, at e) pairs with the zero row and weight */
            const uint16_t *pending = NULL;
#endif
            /* o += p v, value rows in block order */
            for (int k = a; k < e;) {
                int j = k / bs, r0 = k % bs, n_in = KVB_MIN(bs - r0, e - k);
                const char *blk = (const char *)b->layer_blocks[sq->blk_first + j] + half * es;
                int na = KVB_MIN(bs, e - k - n_in);
                const char *vn = na > 0 ? (const char *)b->layer_blocks[sq->blk_first + j + 1] + half * es : NULL;
                const float *vb = (const float *)(blk + (size_t)r0 * row * es);
#if KVB_ATTN_AVX2
                if (bfdot) {
                    const uint16_t *vr = (const uint16_t *)vb;
                    int r = 0;
                    if (k & 1) { /* the pair of k - 1 (the previous block's last row, or none) and k */
                        axpy_pairs_bf512(pb + (k - 1 - k0), pstride, nkv, gq, pending ? pending : zrow, vr, 0, 1, ot,
                                         hd, NULL, 0);
                        pending = NULL;
                        r = 1;
                    }
                    int np = (n_in - r) / 2;
                    axpy_pairs_bf512(pb + (k + r - k0), pstride, nkv, gq, vr + (size_t)r * row, vr + (size_t)(r + 1) * row,
                                     2 * row, np, ot, hd, vn, vn ? (size_t)na * row * es : 0);
                    r += 2 * np;
                    if (r < n_in) { /* an even key, the block's last */
                        if (k + r + 1 < e) pending = vr + (size_t)r * row;
                        else
                            axpy_pairs_bf512(pb + (k + r - k0), pstride, nkv, gq, vr + (size_t)r * row, zrow, 0, 1, ot,
                                             hd, NULL, 0);
                    }
                    k += n_in;
                    continue;
                }
                if (wide && hd % 64 == 0) { /* the block's rows at once where they are, the next block's prefetched */
                    size_t pf = vn ? (size_t)na * row * es : 0;
                    axpy_block512(st + (k - k0), stride, nkv, gq, vb, bf16, row, n_in, ot, hd, vn, pf);
                    k += n_in;
                    continue;
                }
#endif
                if (bf16) {
                    widen_rows((const uint16_t *)vb, (size_t)n_in * row, wide_rows, vn,
                               vn ? (size_t)na * row * es : 0);
                    vb = wide_rows;
                    vn = NULL;
                }
#if KVB_ATTN_AVX2
                if (simd && hd % 64 == 0) { /* the block's rows at once, the next block's prefetched meanwhile */
                    size_t pf = vn ? (size_t)na * row * sizeof(float) : 0;
                    axpy_block_avx2(st + (k - k0), stride, nh, gq, vb, row, n_in, ot, hd, vn, pf);
                    k += n_in;
                    continue;
                }
#endif
                for (int r = 0; r < n_in; r++) {
                    if (vn) prefetch_row(vn + (size_t)r * row * sizeof(float), row * sizeof(float));
                    const float *p = st + (k + r - k0);
#if KVB_ATTN_AVX2
                    if (simd && r + 4 <= n_in) {
                        for (int j = 1; j < 4 && vn; j++)
                            prefetch_row(vn + (size_t)(r + j) * row * sizeof(float), row * sizeof(float));
                        axpy_rows4_avx2(p, stride, nkv, gq, vb + r * row, row, ot, hd);
                        r += 3;
                        continue;
                    }
                    if (simd) {
                        axpy_row_avx2(p, stride, nkv, gq, vb + r * row, ot, hd);
                        continue;
                    }
#endif
                    for (int g = 0; g < nkv; g++)
                        axpy_group(p + (size_t)g * gq * stride, stride, gq, vb + r * row + (size_t)g * hd,
                                   ot + (size_t)g * gq * hd, hd);
                }
                k += n_in;
            }
#if KVB_ATTN_AVX2
            if (bfdot) bf_unpermute(ot, (size_t)nh * hd);
#endif
        }
        if (part) {
            float *mp = part + (size_t)sq->q_len * nh * hd + (size_t)t * nh, *lp = mp + (size_t)sq->q_len * nh;
            memcpy(mp, m, (size_t)nh * sizeof(float));
            memcpy(lp, l, (size_t)nh * sizeof(float));
            continue;
        }
        for (int h = 0; h < nh; h++) {
            float *oh = ot + (size_t)h * hd, inv = l[h] > 0.0f ? 1.0f / l[h] : 0.0f;
            for (int d = 0; d < hd; d++) oh[d] *= inv;
        }
    }
}

/* Merges the n_chunks partials of a sequence (walk items, in chunk order) into `out`. */
static void attn_merge(const kvb_attn_batch *b, const kvb_attn_seq *sq, const float *part, int n_chunks, float *out) {
    int hd = b->geom->head_dim, nh = b->n_heads;
    size_t rows = (size_t)sq->q_len * nh, slot = rows * (hd + 2); /* one chunk's partials */
    for (int t = 0; t < sq->q_len; t++)
        for (int h = 0; h < nh; h++) {
            size_t r = (size_t)t * nh + h;
            float M = -INFINITY;
            for (int c = 0; c < n_chunks; c++) {
                const float *mc = part + c * slot + rows * hd + r, *lc = mc + rows;
                if (*lc > 0.0f && *mc > M) M = *mc;
            }
            float *o = out + ((size_t)(sq->q_start + t) * nh + h) * hd, L = 0.0f;
            memset(o, 0, (size_t)hd * sizeof(float));
            if (M == -INFINITY) continue;
            for (int c = 0; c < n_chunks; c++) {
                const float *oc = part + c * slot + r * hd, *mc = part + c * slot + rows * hd + r, *lc = mc + rows;
                if (!(*lc > 0.0f)) continue;
                float w = kvb__expf(*mc - M);
                L += w * *lc;
                for (int d = 0; d < hd; d++) o[d] += w * oc[d];
            }
            float inv = 1.0f / L;
            for (int d = 0; d < hd; d++) o[d] *= inv;
        }
}

/* Keys per block of a gemm item (at key positions that are multiples of it): the block's scores, tile
 * rows x KEY_BLOCK, stay in L2 through the softmax and P.V. */
#define KEY_BLOCK 256

static size_t gemm_scratch_floats(int m, int hd) { return (size_t)m * (KEY_BLOCK + 2 * (size_t)hd + 2); }

/* Keys per gather item. */
#define GATHER_KEYS 512

/* The first key some query row of a gemm sequence sees: its gathered K/V start there. */
static int gather_base(const kvb_attn_batch *b, const kvb_attn_seq *sq) {
    return first_key(b, sq->ctx_len - sq->q_len + 1);
}

/* Columns of a sequence's gathered K^T: its keys rounded up to 16, plus 16 (the score kernel reads 16
 * columns from any key's column, the last ones unused). */
static size_t gather_ldk(const kvb_attn_batch *b, const kvb_attn_seq *sq) {
    return (size_t)KVB_DIV_CEIL(sq->ctx_len - gather_base(b, sq), 16) * 16 + 16;
}

/* Floats of a sequence's gathered K^T and V. */
static size_t gather_floats(const kvb_attn_batch *b, const kvb_attn_seq *sq) {
    size_t nks = (size_t)(sq->ctx_len - gather_base(b, sq));
    return (size_t)b->geom->n_kv_heads * (size_t)b->geom->head_dim * (gather_ldk(b, sq) + nks);
}

/* Keys [it->k0, it->k1) of a gemm sequence into its gathered K/V at gath + it->gat: K transposed, as
 * [KV head][dim][key - kbase] (row stride gather_ldk), then V as [KV head][key - kbase][dim] (whole
 * K/V rows read once, each head's slice written to its own run). */
static void gather_kv(const kvb_attn_batch *b, const attn_item *it, float *gath) {
    const kvb_kv_geom *geo = b->geom;
    const kvb_attn_seq *sq = &b->seqs[it->seq];
    int hd = geo->head_dim, bs = geo->block_size, nkv = geo->n_kv_heads;
    size_t row = (size_t)nkv * hd, half = (size_t)bs * row, nks = (size_t)(sq->ctx_len - it->kbase);
    size_t ldk = gather_ldk(b, sq);
    int bf16 = geo->elem_size == 2; /* a bf16 cache: widened as gathered */
    size_t es = bf16 ? 2 : sizeof(float);
    float *kg = gath + it->gat, *vg = kg + (size_t)nkv * hd * ldk;
    for (int k0 = it->k0; k0 < it->k1;) {
        int j = k0 / bs, r0 = k0 % bs, n_in = KVB_MIN(bs - r0, it->k1 - k0);
        const char *blk = b->layer_blocks[sq->blk_first + j];
        for (int r = 0; r < n_in; r++) {
            size_t key = (size_t)(k0 + r - it->kbase), src = (size_t)(r0 + r) * row;
            for (int g = 0; g < nkv; g++) {
                const char *kr = blk + (src + (size_t)g * hd) * es;
                float *kt = kg + (size_t)g * hd * ldk + key;
                for (int d = 0; d < hd; d++)
                    kt[(size_t)d * ldk] = bf16 ? kvb_bf16_to_f32(((const uint16_t *)kr)[d]) : ((const float *)kr)[d];
                kvb__cpu_widen(blk + (half + src + (size_t)g * hd) * es, bf16 ? KVB_DTYPE_BF16 : KVB_DTYPE_F32, hd,
                               vg + ((size_t)g * nks + key) * hd);
            }
        }
        k0 += n_in;
    }
}

#if KVB_ATTN_AVX2
/* The prefill tile's two products without sgemm's packing of operands it reads once per key block
 * (measured: the tile's attention ran at about two thirds of the matrix products' rate through sgemm).
 * Register tiles of R rows x 16 columns, R <= 6: 12 accumulators, two 8-lane loads of the shared operand
 * and one broadcast per row for each step of the inner dimension. Each entry is an FMA chain in
 * inner-dimension order, so a row's results do not depend on how rows were tiled (chunked forward
 * passes give the same bits). */

/* acc[r][0..1] += sum_i A[r * lda + i] * B[i * ldb + 0..16) for r < R, i < n: one 16-column panel of B
 * per step, shared by the R rows, and one broadcast of A per row (both products' inner loop). */
#define TILE_FMA(R, A, lda, B, ldb, n, acc)                                                                         \
    for (int i_ = 0; i_ < (n); i_++) {                                                                              \
        __m256 b0 = _mm256_loadu_ps((B) + (size_t)i_ * (ldb)), b1 = _mm256_loadu_ps((B) + (size_t)i_ * (ldb) + 8);  \
        _Pragma("GCC unroll 6") for (int r = 0; r < R; r++) {                                                       \
            __m256 av = _mm256_broadcast_ss((A) + (size_t)r * (lda) + i_);                                          \
            acc[r][0] = _mm256_fmadd_ps(av, b0, acc[r][0]);                                                         \
            acc[r][1] = _mm256_fmadd_ps(av, b1, acc[r][1]);                                                         \
        }                                                                                                           \
    }

/* S[r][j] = scale * sum_d Q[r][d] KT[d][j], r < R, j < nj <= 16 (KT has 16 readable columns). */
#define QK_TILE(R)                                                                                                  \
    __attribute__((target("avx2,fma"))) static void qk_tile_##R(const float *Q, int hd, const float *KT, size_t ldk, \
                                                                float scale, int nj, float *S, size_t lds) {        \
        __m256 a[R][2];                                                                                             \
        _Pragma("GCC unroll 6") for (int r = 0; r < R; r++) a[r][0] = a[r][1] = _mm256_setzero_ps();                \
        TILE_FMA(R, Q, hd, KT, ldk, hd, a);                                                                         \
        const __m256 vs = _mm256_set1_ps(scale);                                                                    \
        _Pragma("GCC unroll 6") for (int r = 0; r < R; r++) {                                                       \
            float t[16];                                                                                            \
            float *o = nj == 16 ? S + (size_t)r * lds : t;                                                          \
            _mm256_storeu_ps(o, _mm256_mul_ps(a[r][0], vs));                                                        \
            _mm256_storeu_ps(o + 8, _mm256_mul_ps(a[r][1], vs));                                                    \
            if (nj < 16) memcpy(S + (size_t)r * lds, t, (size_t)nj * sizeof(float));                                \
        }                                                                                                           \
    }

/* O[r][0..16) += sum_k P[r][k] V[k][0..16), r < R, k < nk (V rows hd apart). */
#define PV_TILE(R)                                                                                                  \
    __attribute__((target("avx2,fma"))) static void pv_tile_##R(const float *P, size_t ldp, const float *V, int hd,  \
                                                                int nk, float *O) {                                 \
        __m256 a[R][2];                                                                                             \
        _Pragma("GCC unroll 6") for (int r = 0; r < R; r++) {                                                       \
            a[r][0] = _mm256_loadu_ps(O + (size_t)r * hd);                                                          \
            a[r][1] = _mm256_loadu_ps(O + (size_t)r * hd + 8);                                                      \
        }                                                                                                           \
        TILE_FMA(R, P, ldp, V, hd, nk, a);                                                                          \
        _Pragma("GCC unroll 6") for (int r = 0; r < R; r++) {                                                       \
            _mm256_storeu_ps(O + (size_t)r * hd, a[r][0]);                                                          \
            _mm256_storeu_ps(O + (size_t)r * hd + 8, a[r][1]);                                                      \
        }                                                                                                           \
    }
QK_TILE(1)
QK_TILE(2)
QK_TILE(3)
QK_TILE(4)
QK_TILE(5)
QK_TILE(6)
PV_TILE(1)
PV_TILE(2)
PV_TILE(3)
PV_TILE(4)
PV_TILE(5)
PV_TILE(6)
typedef void (*qk_tile_fn)(const float *, int, const float *, size_t, float, int, float *, size_t);
typedef void (*pv_tile_fn)(const float *, size_t, const float *, int, int, float *);
static const qk_tile_fn qk_tiles[7] = {NULL, qk_tile_1, qk_tile_2, qk_tile_3, qk_tile_4, qk_tile_5, qk_tile_6};
static const pv_tile_fn pv_tiles[7] = {NULL, pv_tile_1, pv_tile_2, pv_tile_3, pv_tile_4, pv_tile_5, pv_tile_6};
#endif

/* s [m][nk] = scale * q [m][hd] . kt [hd][nk] (kt's rows ldk apart, readable to a multiple of 16). */
static void scores_block(const float *q, int m, int hd, const float *kt, size_t ldk, int nk, float scale, float *s) {
#if KVB_ATTN_AVX2
    if (kvb__cpu_avx2) {
        for (int i = 0; i < m; i += 6)
            for (int j = 0; j < nk; j += 16)
                qk_tiles[KVB_MIN(6, m - i)](q + (size_t)i * hd, hd, kt + j, ldk, scale, KVB_MIN(16, nk - j),
                                            s + (size_t)i * nk + j, (size_t)nk);
        return;
    }
#endif
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, m, nk, hd, scale, q, hd, kt, (blasint)ldk, 0.0f, s, nk);
}

/* o [m][hd] += p [m][nk] . v [nk][hd]. */
static void values_block(const float *p, int m, int nk, const float *v, int hd, float *o) {
#if KVB_ATTN_AVX2
    if (kvb__cpu_avx2 && hd % 16 == 0) {
        for (int i = 0; i < m; i += 6)
            for (int d = 0; d < hd; d += 16)
                pv_tiles[KVB_MIN(6, m - i)](p + (size_t)i * nk, (size_t)nk, v + d, hd, nk, o + (size_t)i * hd + d);
        return;
    }
#endif
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, m, hd, nk, 1.0f, p, nk, v, hd, 1.0f, o, hd);
}

/* The query rows [t0, t1) of the sequence for KV group g of gemm item `it` (single-threaded inside
 * the team), a block of keys at a time with the online softmax: row r keeps its running maximum mx[r],
 * sum l[r] and unnormalised output; a block that raises the maximum scales the sum and output by
 * e^(old - new) first. The tile sees keys [k_lo, nk); row r its own [lo_r, nvis_r). */
static void attn_gemm(const kvb_attn_batch *b, const kvb_attn_seq *sq, const attn_item *it, const float *q,
                      float *out, const float *gath, float *scratch) {
    const kvb_kv_geom *geo = b->geom;
    int hd = geo->head_dim, gq = b->n_heads / geo->n_kv_heads, g = it->g, t0 = it->t0, t1 = it->t1;
    int past = sq->ctx_len - sq->q_len;
    int nk = past + t1, k_lo = first_key(b, past + t0 + 1); /* keys of the tile's last / first row */
    int m = (t1 - t0) * gq;
    size_t nks = (size_t)(sq->ctx_len - it->kbase), ldk = gather_ldk(b, sq);
    const float *kg = gath + it->gat + (size_t)g * hd * ldk;
    const float *vg = gath + it->gat + (size_t)geo->n_kv_heads * hd * ldk + (size_t)g * nks * hd;
    float *s = scratch, *qt = s + (size_t)m * KEY_BLOCK, *ot = qt + (size_t)m * hd, *mx = ot + (size_t)m * hd;
    float *l = mx + m;

    /* the group's gq heads are adjacent in a token's q row */
    for (int t = t0; t < t1; t++)
        memcpy(qt + (size_t)(t - t0) * gq * hd, q + ((size_t)(sq->q_start + t) * b->n_heads + (size_t)g * gq) * hd,
               (size_t)gq * hd * sizeof(float));
    memset(ot, 0, (size_t)m * hd * sizeof(float));
    for (int r = 0; r < m; r++) {
        mx[r] = -INFINITY;
        l[r] = 0.0f;
    }
    for (int kb = k_lo, ke; kb < nk; kb = ke) {
        ke = KVB_MIN(nk, (kb / KEY_BLOCK + 1) * KEY_BLOCK);
        int nkb = ke - kb;
        const float *kc = kg + (kb - it->kbase), *vc = vg + (size_t)(kb - it->kbase) * hd;
        scores_block(qt, m, hd, kc, ldk, nkb, b->scale, s);
        for (int r = 0; r < m; r++) {
            int n_vis = past + t0 + r / gq + 1;
            int lo = KVB_MAX(first_key(b, n_vis), kb) - kb, hi = KVB_MIN(n_vis, ke) - kb;
            float *sr = s + (size_t)r * nkb;
            if (lo >= hi) { /* none of the block's keys is the row's */
                memset(sr, 0, (size_t)nkb * sizeof(float));
                continue;
            }
            float M = KVB_MAX(mx[r], row_max(sr + lo, hi - lo));
            exp_sub(sr + lo, hi - lo, M);
            if (M > mx[r] && l[r] > 0.0f) {
                float c = kvb__expf(mx[r] - M), *o = ot + (size_t)r * hd;
                l[r] *= c;
                for (int d = 0; d < hd; d++) o[d] *= c;
            }
            mx[r] = M;
            l[r] += row_sum(sr + lo, hi - lo);
            memset(sr, 0, (size_t)lo * sizeof(float));
            memset(sr + hi, 0, (size_t)(nkb - hi) * sizeof(float));
        }
        values_block(s, m, nkb, vc, hd, ot);
    }
    for (int t = t0; t < t1; t++)
        for (int h = 0; h < gq; h++) {
            int r = (t - t0) * gq + h;
            const float *o = ot + (size_t)r * hd;
            float *dst = out + ((size_t)(sq->q_start + t) * b->n_heads + (size_t)g * gq + h) * hd;
            float inv = l[r] > 0.0f ? 1.0f / l[r] : 0.0f;
            for (int d = 0; d < hd; d++) dst[d] = o[d] * inv;
        }
}

/* Walk chunks of a decode-like sequence: chunks c0 .. c1 - 1 of WALK_KEYS keys cover the keys some row
 * sees, [first_key of its first row, ctx_len). */
static void walk_chunks(const kvb_attn_batch *b, const kvb_attn_seq *sq, int *c0, int *c1) {
    *c0 = first_key(b, sq->ctx_len - sq->q_len + 1) / WALK_KEYS;
    *c1 = KVB_DIV_CEIL(sq->ctx_len, WALK_KEYS);
}

kvb_status kvb__cpu_attention(kvb_cpu_ctx *c, const kvb_attn_batch *b, const float *q, float *out) {
    const kvb_kv_geom *geo = b->geom;
    int nkv = geo->n_kv_heads, hd = geo->head_dim, nh = b->n_heads, gq = nh / nkv;
    int tile_t = KVB_MAX(1, TILE_ROWS / gq);
    while (KVB_CHUNK_ALIGN_ROWS % tile_t) tile_t--;
    if (nh > KVB_CPU_ATTN_MAX_HEADS) {
        KVB_LOG_E("cpu attention: %d query heads, at most %d", nh, KVB_CPU_ATTN_MAX_HEADS);
        return KVB_ERR_UNSUPPORTED;
    }
    int n_items = 0, n_gather = 0;
    size_t part_floats = 0, gath_floats = 0;
    for (int s = 0; s < b->n_seqs; s++) {
        const kvb_attn_seq *sq = &b->seqs[s];
        if (sq->q_len <= 0) continue;
        if (sq->q_len * gq >= GEMM_MIN_ROWS) {
            int r0 = b->row0 + sq->q_start; /* the step's row of the first query row */
            n_items += nkv * ((r0 + sq->q_len - 1) / tile_t - r0 / tile_t + 1);
            int kbase = gather_base(b, sq);
            n_gather += KVB_DIV_CEIL(sq->ctx_len - kbase, GATHER_KEYS);
            gath_floats += gather_floats(b, sq);
            continue;
        }
        int c0, c1;
        walk_chunks(b, sq, &c0, &c1);
        n_items += c1 - c0;
        if (c1 - c0 > 1) part_floats += (size_t)(c1 - c0) * sq->q_len * nh * (hd + 2);
    }
    if ((size_t)(n_items + n_gather) > c->items_cap) {
        KVB_TRY(kvb_realloc_array(&c->items, (size_t)(n_items + n_gather), sizeof(attn_item)));
        c->items_cap = (size_t)(n_items + n_gather);
    }
    KVB_TRY(kvb__cpu_floats_reserve(&c->part, &c->part_floats, part_floats));
    KVB_TRY(kvb__cpu_floats_reserve(&c->gath, &c->gath_floats, gath_floats));
    attn_item *items = c->items, *gather = items + n_items;
    size_t need = 0, part_at = 0, gat_at = 0;
    int n = 0, ng = 0;
    for (int s = 0; s < b->n_seqs; s++) {
        const kvb_attn_seq *sq = &b->seqs[s];
        if (sq->q_len <= 0) continue;
        if (sq->q_len * gq >= GEMM_MIN_ROWS) {
            int r0 = b->row0 + sq->q_start, kbase = gather_base(b, sq);
            for (int k0 = kbase; k0 < sq->ctx_len; k0 += GATHER_KEYS)
                gather[ng++] = (attn_item){.seq = s, .k0 = k0, .k1 = KVB_MIN(sq->ctx_len, k0 + GATHER_KEYS), .gemm = 2,
                                           .kbase = kbase, .gat = gat_at};
            for (int g = 0; g < nkv; g++)
                for (int t0 = 0, t1; t0 < sq->q_len; t0 = t1) {
                    t1 = KVB_MIN(sq->q_len, ((r0 + t0) / tile_t + 1) * tile_t - r0);
                    items[n++] = (attn_item){.seq = s, .g = g, .t0 = t0, .t1 = t1, .gemm = 1, .kbase = kbase, .gat = gat_at};
                }
            gat_at += gather_floats(b, sq);
            need = KVB_MAX(need, gemm_scratch_floats(tile_t * gq, hd));
            continue;
        }
        int c0, c1;
        walk_chunks(b, sq, &c0, &c1);
        for (int ch = c0; ch < c1; ch++) {
            items[n++] = (attn_item){.seq = s,
                                     .k0 = ch * WALK_KEYS,
                                     .k1 = KVB_MIN(sq->ctx_len, (ch + 1) * WALK_KEYS),
                                     .part = c1 - c0 > 1 ? (int)part_at : -1};
            if (c1 - c0 > 1) part_at += (size_t)sq->q_len * nh * (hd + 2);
        }
        /* the scores, then for a bf16 cache its widened block, and the bf16 dot products' q, weights and zero
         * row (attn_walk; 16-bit each, counted as floats) */
        size_t bf_floats = (size_t)geo->block_size * nkv * hd + ((size_t)nh * hd + (size_t)nh * (WALK_KEYS + 2) + (size_t)nkv * hd) / 2 + 1;
        need = KVB_MAX(need, (size_t)sq->q_len * nh * WALK_KEYS + (geo->elem_size == 2 ? bf_floats : 0));
    }
    KVB_TRY(kvb__cpu_scratch_reserve(c, need));
    /* the gemm sequences' keys and values, per KV head, contiguous: read by all of its tiles */
#pragma omp parallel for schedule(dynamic, 1) if (ng > 1) num_threads(kvb__cpu_threads)
    for (int i = 0; i < ng; i++) gather_kv(b, &gather[i], c->gath);
#pragma omp parallel for schedule(dynamic, 1) if (n_items > 1) num_threads(kvb__cpu_threads)
    for (int i = 0; i < n_items; i++) {
        const attn_item *it = &items[i];
        float *scratch = c->scratch + (size_t)omp_get_thread_num() * c->scratch_floats;
        if (it->gemm) attn_gemm(b, &b->seqs[it->seq], it, q, out, c->gath, scratch);
        else attn_walk(b, &b->seqs[it->seq], it->k0, it->k1, q, out, it->part < 0 ? NULL : c->part + it->part, scratch);
    }
    /* sequences of several chunks: merge in chunk order (their items are adjacent, first at .part) */
    for (int i = 0; i < n;) {
        const attn_item *it = &items[i];
        int j = i + 1;
        if (it->gemm || it->part < 0) {
            i = j;
            continue;
        }
        while (j < n && !items[j].gemm && items[j].seq == it->seq) j++;
        attn_merge(b, &b->seqs[it->seq], c->part + it->part, j - i, out);
        i = j;
    }
    return KVB_OK;
}
