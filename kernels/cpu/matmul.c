/* kvbank — the CPU backend's matrix products y = x . w^T (+ beta y): x is f32 activations, w a weight in
 * the dtype the checkpoint stores it (f32, bf16 and f16 used where they lie in the safetensors mapping;
 * FP8 E4M3 with per-row scales, docs/weights.md).
 *
 * With AVX2 (or AVX-512F) every product, decode and prefill, runs kvbank's streaming kernel: tiles of R
 * weight rows x 4 rows of x, each output summed in one order — lane c % L over the columns c, then the
 * lanes pairwise — whatever the tile, the batch, the thread split and the weight's dtype. A bf16, f16 or
 * E4M3 element widened to f32 is exact, so a weight stored in any of them gives the same bits as its
 * widened f32 copy, and a token's products are the same bits in a prefill and in a decode step. Decode
 * batches widen the weights in registers as they stream them; longer x converts each block of weight
 * rows once into an f32 buffer (L1) that all its rows of x then pass over. Without AVX2 (or a column count
 * that is not a multiple of 8) OpenBLAS runs the products, half and FP8 weights converted a panel at a time. */
#include "kernels/cpu/ops.h"

#include <cblas.h>
#include <float.h>
#include <math.h>
#include <omp.h>
#include <string.h>

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define MM_SIMD 1
#else
#define MM_SIMD 0
#endif

/* Rows of x above which a block of weight rows is converted to f32 once (a prefill) rather than widened
 * in registers for every group of 4 rows that passes (a decode batch). */
#define WIDEN_N_MAX 32
/* The same for E4M3, whose widening costs a multiply on the FMA ports: one Zen 4 core, 2048 x 768, thread
 * CPU time: at 8 rows in registers 176 GFLOP/s against 160 converted once, at 32 rows 178 against 202. */
#define WIDEN_N_MAX_E4M3 16
/* Rows of x the streaming kernel takes at once: they stay in L2 while every block of the thread's weight
 * rows passes over them. At 512 rows, one Zen 4 core: 64 ran 2048 x 768 at 1.7x OpenBLAS's sgemm rate,
 * 768 x 2048 at 1.2x (32 and 128 within a few percent of 64). */
#define X_ROWS 64
/* Weight rows converted at a time on the OpenBLAS path. */
#define PANEL_ROWS 64
/* Most rows in a tile of the streaming kernel. */
#define TILE_ROWS_MAX 6


/* Where a tile's outputs go: y[i * ldy + r] = dot(x row i, w row r) * ws[r] * xs[i] + beta * y[...]. */
typedef struct tile_out {
    float *y;
    int64_t ldy;
    float beta;
    const float *ws; /* [tile rows] the weight rows' scales, or NULL (1) */
    const float *xs; /* [tile x rows] the x rows' scales, or NULL (1) */
} tile_out;

#if MM_SIMD
__attribute__((target("avx2,fma"))) static inline float hsum8(__m256 a) {
    __m128 r = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    r = _mm_add_ps(r, _mm_movehl_ps(r, r));
    r = _mm_add_ss(r, _mm_movehdup_ps(r));
    return _mm_cvtss_f32(r);
}

/* lane j + lane j + 8, then as hsum8 */
__attribute__((target("avx512f,avx2,fma"))) static inline float hsum16(__m512 a) {
    __m256 hi = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a), 1));
    return hsum8(_mm256_add_ps(_mm512_castps512_ps256(a), hi));
}

/* E4M3 widened: the byte sign-extended and shifted so that its sign is the float's and its 7 exponent and
 * mantissa bits sit at the low end of the float's exponent, times 2^(127 - 7): exact, subnormals included
 * (kvb_e4m3_to_f32; NaN bytes are refused at load). */
__attribute__((target("avx2,fma"))) static inline __m256 e4m3x8(const uint8_t *p) {
    __m256i v = _mm256_slli_epi32(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)), 20);
    __m256 f = _mm256_castsi256_ps(_mm256_and_si256(v, _mm256_set1_epi32((int)0x87f00000u)));
    return _mm256_mul_ps(f, _mm256_set1_ps(0x1p120f));
}

__attribute__((target("avx512f,avx2,fma"))) static inline __m512 e4m3x16(const uint8_t *p) {
    __m512i v = _mm512_slli_epi32(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)), 20);
    __m512 f = _mm512_castsi512_ps(_mm512_and_si512(v, _mm512_set1_epi32((int)0x87f00000u)));
    return _mm512_mul_ps(f, _mm512_set1_ps(0x1p120f));
}

/* The streaming kernel's two vector widths: V8 (AVX2, 16 registers) and V16 (AVX-512, 32 registers),
 * and for each the loads that widen L weight elements of each dtype to f32 (bf16: the bits shifted into a
 * float's high half; f16: the F16C conversion). */
#define V8_T __m256
#define V8_LANES 8
#define V8_TARGET "avx2,fma,f16c"
#define V8_ZERO _mm256_setzero_ps
#define V8_LOAD _mm256_loadu_ps
#define V8_STORE _mm256_storeu_ps
#define V8_FMA _mm256_fmadd_ps
#define V8_HSUM hsum8
#define V8_F32(p) _mm256_loadu_ps(p)
#define V8_BF16(p) \
    _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(p))), 16))
#define V8_F16(p) _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p)))
#define V8_E4M3(p) e4m3x8(p)
#define V16_T __m512
#define V16_LANES 16
#define V16_TARGET "avx512f,avx2,fma,f16c"
#define V16_ZERO _mm512_setzero_ps
#define V16_LOAD _mm512_loadu_ps
#define V16_STORE _mm512_storeu_ps
#define V16_FMA _mm512_fmadd_ps
#define V16_HSUM hsum16
#define V16_F32(p) _mm512_loadu_ps(p)
#define V16_BF16(p) \
    _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(p))), 16))
#define V16_F16(p) _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(p)))
#define V16_E4M3(p) e4m3x16(p)
#define F32_T float
#define BF16_T uint16_t
#define F16_T uint16_t
#define E4M3_T uint8_t

/* y[i][r] = <x[i], w[r]> (scaled, + beta y[i][r]) for R rows of w and N rows of x, cols a multiple of the
 * lanes L: R x N accumulators of L lanes, each w vector loaded (and widened) once for the N rows of x.
 * Every output is summed in the same order (lane c % L over c, then the lanes pairwise) whatever R, N,
 * the batch size and the dtype of w, so a sequence's logits do not depend on what it is batched with or
 * on how the weights are stored. Along the way it prefetches pf_n bytes from pf, pf_k cache lines every L
 * columns (the next block of w: see small_n_rows). */
#define SMALL_TILE(V, W, R, N)                                                                                    \
    __attribute__((target(V##_TARGET))) static void small_tile_##V##_##W##_##R##x##N(                              \
        const void *wp, const float *x, int64_t cols, const tile_out *o, const char *pf, int64_t pf_n, int pf_k) {  \
        const W##_T *w = wp;                                                                                      \
        V##_T acc[R][N];                                                                                          \
        _Pragma("GCC unroll 8") for (int r = 0; r < R; r++) _Pragma("GCC unroll 4") for (int i = 0; i < N; i++)     \
            acc[r][i] = V##_ZERO();                                                                               \
        int64_t pf_at = 0;                                                                                        \
        for (int64_t c = 0; c < cols; c += V##_LANES) {                                                           \
            for (int k = 0; k < pf_k && pf_at < pf_n; k++, pf_at += 64) _mm_prefetch(pf + pf_at, _MM_HINT_T1);     \
            V##_T wv[R];                                                                                          \
            _Pragma("GCC unroll 8") for (int r = 0; r < R; r++) wv[r] = V##_##W(w + r * cols + c);                \
            _Pragma("GCC unroll 4") for (int i = 0; i < N; i++) {                                                 \
                V##_T xv = V##_LOAD(x + i * cols + c);                                                            \
                _Pragma("GCC unroll 8") for (int r = 0; r < R; r++) acc[r][i] = V##_FMA(wv[r], xv, acc[r][i]);    \
            }                                                                                                     \
        }                                                                                                         \
        _Pragma("GCC unroll 4") for (int i = 0; i < N; i++) _Pragma("GCC unroll 8") for (int r = 0; r < R; r++) {   \
            float s = V##_HSUM(acc[r][i]), *y = o->y + i * o->ldy + r;                                            \
            if (o->ws) s *= o->ws[r];                                                                             \
            if (o->xs) s *= o->xs[i];                                                                             \
            *y = o->beta != 0.0f ? s + o->beta * *y : s;                                                          \
        }                                                                                                         \
    }

/* The four shapes of one width and dtype: R x 4, R x 1, 1 x 4, 1 x 1. */
#define SMALL_TILES(V, W, R) SMALL_TILE(V, W, R, 4) SMALL_TILE(V, W, R, 1) SMALL_TILE(V, W, 1, 4) SMALL_TILE(V, W, 1, 1)

/* n weight elements (a multiple of the lanes) widened into f32. */
#define WIDEN(V, W)                                                                                               \
    __attribute__((target(V##_TARGET))) static void widen_##V##_##W(const void *src, int64_t n, float *dst) {     \
        const W##_T *s = src;                                                                                     \
        for (int64_t c = 0; c < n; c += V##_LANES) V##_STORE(dst + c, V##_##W(s + c));                            \
    }

SMALL_TILES(V8, F32, 3)
SMALL_TILES(V8, BF16, 3)
SMALL_TILES(V8, F16, 3)
SMALL_TILES(V8, E4M3, 3)
SMALL_TILES(V16, F32, 6)
SMALL_TILES(V16, BF16, 6)
SMALL_TILES(V16, F16, 6)
SMALL_TILES(V16, E4M3, 6)
WIDEN(V8, BF16)
WIDEN(V8, F16)
WIDEN(V8, E4M3)
WIDEN(V16, BF16)
WIDEN(V16, F16)
WIDEN(V16, E4M3)

typedef void (*small_tile_fn)(const void *w, const float *x, int64_t cols, const tile_out *o, const char *pf,
                              int64_t pf_n, int pf_k);
typedef void (*widen_fn)(const void *src, int64_t n, float *dst);

/* One width of the streaming kernel for one weight dtype: blocks of `rows` rows of w against groups of 4
 * rows of x. */
typedef struct small_kernel {
    int rows, lanes;
    small_tile_fn block_4, block_1, row_4, row_1; /* rows x 4, rows x 1, 1 x 4, 1 x 1 */
    widen_fn widen;                               /* NULL for f32 */
} small_kernel;

#define KERNEL(V, W, R, widen)                                                                                    \
    {R, V##_LANES, small_tile_##V##_##W##_##R##x4, small_tile_##V##_##W##_##R##x1, small_tile_##V##_##W##_1x4,      \
     small_tile_##V##_##W##_1x1, widen}

/* AVX2: 12 accumulators, 3 of w and one of x in the 16 registers. Indexed by kvb_dtype. */
static const small_kernel small_v8[4] = {
    [KVB_DTYPE_F32] = KERNEL(V8, F32, 3, NULL),
    [KVB_DTYPE_F16] = KERNEL(V8, F16, 3, widen_V8_F16),
    [KVB_DTYPE_BF16] = KERNEL(V8, BF16, 3, widen_V8_BF16),
    [KVB_DTYPE_F8_E4M3] = KERNEL(V8, E4M3, 3, widen_V8_E4M3),
};
/* AVX-512: 24 accumulators of 16 lanes, 6 of w and one of x in the 32 registers: twice the work per loaded
 * vector of x. The 3 x 4 tile at 16 lanes was no faster than AVX2's (the loop's loads and prefetches per
 * FMA were the limit, not its width); 6 x 4 ran the products of a batch-32 decode step of the bench model
 * 1.13-1.25x faster than it on 2 Zen 4 cores (150-158 -> 178-188 GFLOP/s, weights in DRAM), 1.11x at batch 8. */
static const small_kernel small_v16[4] = {
    [KVB_DTYPE_F32] = KERNEL(V16, F32, 6, NULL),
    [KVB_DTYPE_F16] = KERNEL(V16, F16, 6, widen_V16_F16),
    [KVB_DTYPE_BF16] = KERNEL(V16, BF16, 6, widen_V16_BF16),
    [KVB_DTYPE_F8_E4M3] = KERNEL(V16, E4M3, 6, widen_V16_E4M3),
};
#endif

void kvb__cpu_widen(const void *src, kvb_dtype dt, int64_t n, float *dst) {
#if MM_SIMD
    /* bf16: the streaming kernels' widening for the whole vectors (a shift: the same exact values) */
    const small_kernel *ks = kvb__cpu_avx512 ? small_v16 : kvb__cpu_avx2 ? small_v8 : NULL;
    if (ks && dt == KVB_DTYPE_BF16) {
        int64_t v = n - n % ks[dt].lanes;
        ks[dt].widen(src, v, dst);
        src = (const char *)src + 2 * v, dst += v, n -= v;
    }
#endif
    switch (dt) {
    case KVB_DTYPE_F32: memcpy(dst, src, (size_t)n * sizeof(float)); return;
    case KVB_DTYPE_F16:
    case KVB_DTYPE_BF16:
        for (int64_t i = 0; i < n; i++) {
            uint16_t h;
            memcpy(&h, (const char *)src + 2 * i, 2);
            dst[i] = dt == KVB_DTYPE_BF16 ? kvb_bf16_to_f32(h) : kvb_f16_to_f32(h);
        }
        return;
    case KVB_DTYPE_F8_E4M3:
        for (int64_t i = 0; i < n; i++) dst[i] = kvb_e4m3_to_f32(((const uint8_t *)src)[i]);
        return;
    }
}

/* One product's operands, shared by the team. */
typedef struct mm_args {
    const float *x;      /* [n][cols] (for an FP8-activation weight: the quantized rows) */
    const float *xs;     /* [n] x rows' scales, or NULL */
    int n;
    const kvb_tensor *w; /* [rows][cols] */
    float beta;
    float *y;            /* [n][rows] */
} mm_args;

/* The streaming kernels (indexed by dtype) of the width this weight takes on this processor, or NULL
 * (OpenBLAS). The width depends only on
 * the processor and cols, never on n: a weight's products at every batch size sum in the same order. */
static const void *pick_kernel(const kvb_tensor *w) {
#if MM_SIMD
    if (kvb__cpu_avx512 && w->ne[1] % 16 == 0) return small_v16;
    if (kvb__cpu_avx2 && w->ne[1] % 8 == 0) return small_v8;
#endif
    (void)w;
    return NULL;
}

#if MM_SIMD
/* How many blocks ahead a block's passes prefetch: the block after next. One ahead left the weights' lines
 * arriving late at decode batch 1 (a block of 6 bf16 rows of 768 columns is 9 KB, read in about 0.3 us):
 * two ahead ran the bench model's decode step 1.04-1.13x faster on one Zen 4 core (7.55-8.00 -> 6.89-7.69
 * ms, 0.78-0.87 -> 0.83-0.95 of the read-bandwidth roofline) and 1.00-1.12x at 2 threads; three and
 * four ahead were between (kvbank-bench engine, cpu:bf16, context 100, rounds in turn). */
#define PF_AHEAD 2

/* Rows [r0, r1) of y = x . w^T (+ beta y) for n rows of x: w is read from memory once — a block of
 * k->rows rows stays in L1 while every group of 4 rows of x (in L2) passes over it — where sgemm would
 * first copy (pack) all of it, which costs more than the products at decode batch sizes. With more than
 * WIDEN_N_MAX rows of x a block of half or FP8 weights is widened once into `buf` ([k->rows][cols]
 * floats, the thread's) and the f32 tiles read it there; below, the tiles widen it in registers. While a
 * block is in use, its passes prefetch the next block, a share each: the hardware's stream prefetcher
 * restarts at every block's new rows, and waiting for them cost 15-25% of the kernel's rate with the
 * weights in DRAM (a decode step's case: they are 400 MB), measured with 2 threads at batch 8 and 32. The
 * prefetches go to L2, not L1: on Zen 4 (2 cores, the products of the bench model's decode step, 302 MB of
 * weights) those into L1 held the streaming to 15-25 GB/s against 32 GB/s for a plain read of the same
 * weights, and into L2 it ran at 27-31 GB/s — batch 1 11.8 -> 7.5-9.8 ms, batch 8 16.4 -> 9.6-11.2 ms,
 * batch 32 level (25.6-26.4 ms), the next block's lines in L1 evicting the current block's while the
 * batch's groups of x still passed over it. Which block they prefetch: PF_AHEAD. */
static void small_n_rows(const small_kernel *ks, const mm_args *a, const float *x, int n, const float *xs, float *y,
                         int64_t r0, int64_t r1, int64_t pf_end, float *buf) {
    const kvb_tensor *wt = a->w;
    const small_kernel *k = &ks[wt->dtype];
    int64_t cols = wt->ne[1], ldy = wt->ne[0];
    size_t es = kvb_dtype_size(wt->dtype);
    const char *w = wt->data;
    int widen = k->widen && n > (wt->dtype == KVB_DTYPE_F8_E4M3 ? WIDEN_N_MAX_E4M3 : WIDEN_N_MAX) && buf;
    const small_kernel *t = widen ? &ks[KVB_DTYPE_F32] : k; /* the tiles the blocks go through */
    int R = k->rows;
    int calls = n / 4 + n % 4; /* tile calls per block of R rows */
    int64_t block = R * cols * (int64_t)es;
    int64_t share = KVB_DIV_CEIL(KVB_DIV_CEIL(block, calls), 64) * 64; /* bytes each call prefetches */
    int pf_k = (int)KVB_DIV_CEIL(share / 64, cols / k->lanes);           /* lines per vector of columns */
    const float *ws = wt->scale;
    int64_t r = r0;
    for (; r + R <= r1; r += R) {
        /* the block PF_AHEAD blocks on: its bytes (0 past the end) and where it starts */
        int64_t next = KVB_MAX(0, KVB_MIN(pf_end - (r + PF_AHEAD * R), R)) * cols * (int64_t)es;
        const char *pf = w + (r + PF_AHEAD * R) * cols * (int64_t)es;
        const void *wb = w + r * cols * (int64_t)es;
        if (widen) {
            k->widen(wb, R * cols, buf);
            wb = buf;
        }
        int i = 0;
        int64_t at = 0; /* where this call's share of the next block starts */
        for (; i < n; at += share) {
            tile_out o = {y + i * ldy + r, ldy, a->beta, ws ? ws + r : NULL, xs ? xs + i : NULL};
            const char *p = pf + KVB_MIN(at, next);
            if (i + 4 <= n) {
                t->block_4(wb, x + i * cols, cols, &o, p, KVB_MIN(share, next - at), pf_k);
                i += 4;
            } else {
                t->block_1(wb, x + i * cols, cols, &o, p, KVB_MIN(share, next - at), pf_k);
                i++;
            }
        }
    }
    for (; r < r1; r++) {
        const void *wr = w + r * cols * (int64_t)es;
        for (int i = 0; i < n;) {
            tile_out o = {y + i * ldy + r, ldy, a->beta, ws ? ws + r : NULL, xs ? xs + i : NULL};
            if (i + 4 <= n) {
                k->row_4(wr, x + i * cols, cols, &o, NULL, 0, 0);
                i += 4;
            } else {
                k->row_1(wr, x + i * cols, cols, &o, NULL, 0, 0);
                i++;
            }
        }
    }
}
#endif

/* Rows [r0, r1) through OpenBLAS. f32 weights go in as they are (sgemv for one row: OpenBLAS 0.3.21 does
 * not pick it by itself for M = 1); others a panel of PANEL_ROWS rows at a time, widened into `buf`
 * ([PANEL_ROWS][cols] floats, then [n][PANEL_ROWS] for the unscaled products of scaled weights). */
static void blas_rows(const mm_args *a, int64_t r0, int64_t r1, float *buf) {
    const kvb_tensor *wt = a->w;
    int64_t rows = wt->ne[0], cols = wt->ne[1];
    int n = a->n;
    int scaled = wt->scale || a->xs;
    if (wt->dtype == KVB_DTYPE_F32 && !scaled) {
        const float *ws = (const float *)wt->data + r0 * cols;
        if (n == 1)
            cblas_sgemv(CblasRowMajor, CblasNoTrans, (blasint)(r1 - r0), (blasint)cols, 1.0f, ws, (blasint)cols, a->x, 1,
                        a->beta, a->y + r0, 1);
        else
            cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, n, (blasint)(r1 - r0), (blasint)cols, 1.0f, a->x,
                        (blasint)cols, ws, (blasint)cols, a->beta, a->y + r0, (blasint)rows);
        return;
    }
    size_t es = kvb_dtype_size(wt->dtype);
    float *panel = buf, *tmp = buf + PANEL_ROWS * cols;
    for (int64_t p = r0; p < r1; p += PANEL_ROWS) {
        int64_t m = KVB_MIN(PANEL_ROWS, r1 - p);
        kvb__cpu_widen((const char *)wt->data + p * cols * (int64_t)es, wt->dtype, m * cols, panel);
        /* scaled: the products first, then y = p * ws[r] * xs[i] + beta y, as the streaming kernel does */
        float *dst = scaled ? tmp : a->y + p;
        blasint ld = scaled ? (blasint)m : (blasint)rows;
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, n, (blasint)m, (blasint)cols, 1.0f, a->x, (blasint)cols,
                    panel, (blasint)cols, scaled ? 0.0f : a->beta, dst, ld);
        if (!scaled) continue;
        for (int i = 0; i < n; i++)
            for (int64_t r = 0; r < m; r++) {
                float s = tmp[(size_t)i * m + r], *y = a->y + (size_t)i * rows + p + r;
                if (wt->scale) s *= wt->scale[p + r];
                if (a->xs) s *= a->xs[i];
                *y = a->beta != 0.0f ? s + a->beta * *y : s;
            }
    }
}

/* Floats of the per-thread buffer a product of this weight needs for n rows of x. */
static size_t buf_floats(const kvb_tensor *w, int n) {
    int64_t cols = w->ne[1];
    if (pick_kernel(w)) return w->dtype == KVB_DTYPE_F32 ? 0 : (size_t)(TILE_ROWS_MAX * cols);
    if (w->dtype == KVB_DTYPE_F32 && !w->scale && w->act == KVB_ACT_NONE) return 0;
    return (size_t)(PANEL_ROWS * cols + (int64_t)n * PANEL_ROWS);
}

/* Rows [r0, r1) of the product on the calling thread, the streaming kernels prefetching on up to row
 * pf_end (the end of the rows this thread goes on with); `buf` is the thread's buffer (buf_floats). */
static void matmul_rows(const mm_args *a, int64_t r0, int64_t r1, int64_t pf_end, float *buf) {
#if MM_SIMD
    const small_kernel *k = pick_kernel(a->w);
    if (k) {
        int64_t cols = a->w->ne[1], rows = a->w->ne[0];
        for (int i0 = 0; i0 < a->n; i0 += X_ROWS)
            small_n_rows(k, a, a->x + (size_t)i0 * cols, KVB_MIN(X_ROWS, a->n - i0), a->xs ? a->xs + i0 : NULL,
                         a->y + (size_t)i0 * rows, r0, r1, pf_end, buf);
        return;
    }
#endif
    (void)pf_end;
    blas_rows(a, r0, r1, buf);
}

/* Thread t's share [*r0, *r1) of `total` rows among nt: contiguous, cut at multiples of 16 rows
 * (64-byte aligned slices of y). */
static void row_share(int64_t total, int t, int nt, int64_t *r0, int64_t *r1) {
    *r0 = (total * t / nt) & ~(int64_t)15;
    *r1 = t + 1 < nt ? (total * (t + 1) / nt) & ~(int64_t)15 : total;
}

/* x row i quantized as compressed-tensors' dynamic per-token FP8 does (quantization/lifecycle/forward.py,
 * utils/helpers.py): s = max|x| / 448 (the float32 epsilon when 0), q = x / s clamped to [-448, 448] and
 * rounded to E4M3, ties to even; the product is then q . w^T * s. */
static void quant_row(const float *x, int64_t cols, float *q, float *s) {
    float m = 0.0f;
    for (int64_t c = 0; c < cols; c++) m = fmaxf(m, fabsf(x[c]));
    float sc = m / 448.0f;
    if (sc == 0.0f) sc = FLT_EPSILON;
    for (int64_t c = 0; c < cols; c++) q[c] = kvb_e4m3_round(fminf(fmaxf(x[c] / sc, -448.0f), 448.0f));
    *s = sc;
}

#if MM_SIMD
/* quant_row 8 lanes at a time, the same bits: the maximum does not depend on the order, the division and
 * the rounding (kvb_e4m3_round's sum with the binade's 2^23 quantum) are the same IEEE operations. */
__attribute__((target("avx2,fma"))) static void quant_row_avx2(const float *x, int64_t cols, float *q, float *s) {
    __m256 absmask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    __m256 mv = _mm256_setzero_ps();
    for (int64_t c = 0; c < cols; c += 8) mv = _mm256_max_ps(mv, _mm256_and_ps(_mm256_loadu_ps(x + c), absmask));
    float m = 0.0f, lanes[8];
    _mm256_storeu_ps(lanes, mv);
    for (int j = 0; j < 8; j++) m = fmaxf(m, lanes[j]);
    float sc = m / 448.0f;
    if (sc == 0.0f) sc = FLT_EPSILON;
    __m256 scv = _mm256_set1_ps(sc), lo = _mm256_set1_ps(-448.0f), hi = _mm256_set1_ps(448.0f);
    __m256i floor_e = _mm256_set1_epi32(127 - 9), three = _mm256_set1_epi32(3), twenty3 = _mm256_set1_epi32(23);
    for (int64_t c = 0; c < cols; c += 8) {
        __m256 v = _mm256_min_ps(_mm256_max_ps(_mm256_div_ps(_mm256_loadu_ps(x + c), scv), lo), hi);
        __m256 a = _mm256_and_ps(v, absmask);
        __m256i e = _mm256_max_epi32(_mm256_sub_epi32(_mm256_srli_epi32(_mm256_castps_si256(a), 23), three), floor_e);
        __m256 mq = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(e, twenty3), 23));
        __m256 r = _mm256_sub_ps(_mm256_add_ps(a, mq), mq);
        _mm256_storeu_ps(q + c, _mm256_or_ps(r, _mm256_andnot_ps(absmask, v)));
    }
    *s = sc;
}
#endif

void kvb__cpu_quant_fp8_rows(const float *x, int n, int64_t cols, float *q, float *s) {
#pragma omp parallel for schedule(static) if ((size_t)n * cols >= 65536) num_threads(kvb__cpu_threads)
    for (int i = 0; i < n; i++) {
#if MM_SIMD
        if (kvb__cpu_avx2 && cols % 8 == 0) {
            quant_row_avx2(x + (size_t)i * cols, cols, q + (size_t)i * cols, s + i);
            continue;
        }
#endif
        quant_row(x + (size_t)i * cols, cols, q + (size_t)i * cols, s + i);
    }
}

/* The per-thread buffers for weights w[0..nw) and, when one of them quantizes its input, x quantized
 * (c->xq, c->xs). */
static kvb_status reserve(kvb_cpu_ctx *c, const float *x, int n, const kvb_tensor *const *w, int nw) {
    size_t need = 0;
    int quant = 0;
    for (int i = 0; i < nw; i++) {
        need = KVB_MAX(need, buf_floats(w[i], n));
        quant |= w[i]->act == KVB_ACT_FP8_TOKEN;
    }
    if (need > c->mm_buf_floats) {
        size_t all = 0; /* every thread's slab: always reallocated */
        KVB_TRY(kvb__cpu_floats_reserve(&c->mm_buf, &all, need * (size_t)c->n_threads));
        c->mm_buf_floats = need;
    }
    if (quant) {
        int64_t cols = w[0]->ne[1];
        KVB_TRY(kvb__cpu_floats_reserve(&c->xq, &c->xq_floats, (size_t)n * cols));
        KVB_TRY(kvb__cpu_floats_reserve(&c->xs, &c->xs_floats, (size_t)n));
        kvb__cpu_quant_fp8_rows(x, n, cols, c->xq, c->xs);
    }
    return KVB_OK;
}

/* The operands of weight w's product (x quantized by reserve when w asks for it). */
static mm_args args_for(const kvb_cpu_ctx *c, const float *x, int n, const kvb_tensor *w, float beta, float *y) {
    int q = w->act == KVB_ACT_FP8_TOKEN;
    return (mm_args){q ? c->xq : x, q ? c->xs : NULL, n, w, beta, y};
}

/* Thread t's slab of the products' buffer (NULL when no product has needed one). */
static float *thread_buf(const kvb_cpu_ctx *c, int t) {
    return c->mm_buf ? c->mm_buf + (size_t)t * c->mm_buf_floats : NULL;
}

/* How a product's rows are shared by the team. Each thread's contiguous share (row_share) is cut into
 * chunks of STEAL_ROWS rows, taken from its front by its owner and, once a thread has done its own share,
 * by the others: at decode the products are bound by each core's read rate, which varies from moment to
 * moment, and with fixed shares both threads spent about a tenth of a decode step waiting for each other
 * at the products' ends (perf of the bench model's step, cpu:bf16, 2 threads, 2K context: libgomp's spin
 * at 10% of each thread's samples). 48 rows: a multiple of the streaming kernels' 3 or 6 rows (whole blocks,
 * whose prefetch runs on across the owner's next chunk) and of 16 (64-byte slices of y, never shared by
 * two threads). OpenBLAS's panels (prefill) keep the fixed shares. A row's sum does not depend on who
 * computes it, so the results are the same bits either way. */
#define STEAL_ROWS 48

typedef struct {
    int64_t next, end; /* the first row not yet taken; the end of the share */
} __attribute__((aligned(64))) row_region;

/* A chunk [*r0, *r1) of g, or 0 when all of it is taken. */
static int take_rows(row_region *g, int64_t *r0, int64_t *r1) {
    if (__atomic_load_n(&g->next, __ATOMIC_RELAXED) >= g->end) return 0;
    int64_t r = __atomic_fetch_add(&g->next, STEAL_ROWS, __ATOMIC_RELAXED);
    if (r >= g->end) return 0;
    *r0 = r;
    *r1 = KVB_MIN(r + STEAL_ROWS, g->end);
    return 1;
}

typedef void rows_fn(const void *arg, int64_t r0, int64_t r1, int64_t pf_end, float *buf);

/* f over rows [0, total), by the team when par (each thread's calls with its own buffer), in chunks when
 * steal. */
static void team_rows(const kvb_cpu_ctx *c, int64_t total, int par, int steal, rows_fn *f, const void *arg) {
    int nt = par ? kvb__cpu_threads : 1;
    row_region reg[nt];
    for (int t = 0; t < nt; t++) row_share(total, t, nt, &reg[t].next, &reg[t].end);
#pragma omp parallel if (par) num_threads(nt)
    {
        int t = omp_get_thread_num(), team = omp_get_num_threads();
        float *buf = thread_buf(c, t);
        int64_t r0, r1;
        if (!steal) {
            /* a team smaller than asked for (nested in another's) takes the shares round-robin */
            for (int j = t; j < nt; j += team)
                if (reg[j].end > reg[j].next) f(arg, reg[j].next, reg[j].end, reg[j].end, buf);
        } else {
            for (int j = 0; j < nt; j++) {
                row_region *g = &reg[(t + j) % nt];
                while (take_rows(g, &r0, &r1)) f(arg, r0, r1, g->end, buf);
            }
        }
    }
}

static void one_rows(const void *arg, int64_t r0, int64_t r1, int64_t pf_end, float *buf) {
    matmul_rows(arg, r0, r1, pf_end, buf);
}

kvb_status kvb__cpu_matmul(kvb_cpu_ctx *c, const float *x, int n, const kvb_tensor *w, float beta, float *y) {
    /* w is [rows][cols] (HF Linear layout), so y = x . w^T. OpenBLAS runs single-threaded inside one
     * OpenMP team (one thread pool for the whole backend); each thread takes slices of w's rows, so
     * w is streamed once in total (once per X_ROWS rows of x on the streaming kernel). */
    KVB_TRY(reserve(c, x, n, &w, 1));
    mm_args a = args_for(c, x, n, w, beta, y);
    int64_t rows = w->ne[0], cols = w->ne[1];
    int par = (double)rows * cols * n >= 1 << 18 && rows >= 64;
    team_rows(c, rows, par, pick_kernel(w) != NULL, one_rows, &a);
    return KVB_OK;
}

/* Several weights' products of the same x, their rows one after the other as one matrix. */
typedef struct {
    const kvb_cpu_ctx *c;
    const float *x;
    int n, nw;
    const kvb_tensor *const *w;
    float *const *y;
} mm_n_args;

static void n_rows(const void *arg, int64_t r0, int64_t r1, int64_t pf_end, float *buf) {
    const mm_n_args *m = arg;
    int64_t base = 0;
    for (int i = 0; i < m->nw; base += m->w[i++]->ne[0]) {
        int64_t lo = KVB_MAX(r0, base) - base, hi = KVB_MIN(r1, base + m->w[i]->ne[0]) - base;
        if (hi <= lo) continue;
        mm_args a = args_for(m->c, m->x, m->n, m->w[i], 0.0f, m->y[i]);
        matmul_rows(&a, lo, hi, KVB_MIN(pf_end, base + m->w[i]->ne[0]) - base, buf);
    }
}

kvb_status kvb__cpu_matmul_n(kvb_cpu_ctx *c, const float *x, int n, const kvb_tensor *const *w, int nw,
                             float *const *y) {
    KVB_TRY(reserve(c, x, n, w, nw));
    int64_t total = 0, cols = w[0]->ne[1];
    int steal = 1;
    for (int i = 0; i < nw; i++) {
        total += w[i]->ne[0];
        steal &= pick_kernel(w[i]) != NULL;
    }
    int par = (double)total * cols * n >= 1 << 18 && total >= 64;
    mm_n_args m = {c, x, n, nw, w, y};
    team_rows(c, total, par, steal, n_rows, &m);
    return KVB_OK;
}
