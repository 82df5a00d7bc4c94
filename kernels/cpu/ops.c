/* kvbank — CPU elementwise kernels and matrix products (OpenBLAS). */
#include "kernels/cpu/ops.h"
#include "kernels/cpu/vexp.h"

#include <cblas.h>
#include <math.h>
#include <omp.h>
#include <string.h>

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define KVB_OPS_AVX2 1
#else
#define KVB_OPS_AVX2 0
#endif

/* Below this many elements an elementwise kernel runs on the calling thread: waking the team would
 * cost more than the work. */
#define PAR_MIN_ELEMS 65536

int kvb__cpu_threads = 1;
int kvb__cpu_avx2 = 0;
int kvb__cpu_avx512 = 0;

kvb_status kvb__cpu_floats_reserve(float **buf, size_t *cap, size_t floats) {
    if (floats <= *cap) return KVB_OK;
    float *p = NULL;
    KVB_TRY(kvb_aligned_alloc(floats * sizeof(float), (void **)&p));
    free(*buf);
    *buf = p;
    *cap = floats;
    return KVB_OK;
}

kvb_status kvb__cpu_scratch_reserve(kvb_cpu_ctx *c, size_t floats) {
    if (floats <= c->scratch_floats) return KVB_OK;
    floats += floats / 2; /* room to grow before the next reallocation */
    size_t all = 0;       /* every thread's slab: always reallocated */
    KVB_TRY(kvb__cpu_floats_reserve(&c->scratch, &all, floats * (size_t)c->n_threads));
    c->scratch_floats = floats;
    return KVB_OK;
}

void kvb__cpu_embed(const float *table, int64_t dim, const int32_t *ids, int n, float *out) {
    for (int i = 0; i < n; i++) memcpy(out + (size_t)i * dim, table + (size_t)ids[i] * dim, (size_t)dim * sizeof(float));
}

/* Decode batches (at most this many rows of x) take the streaming kernel below instead of sgemm. */
#define SMALL_N_MAX 32

#if KVB_OPS_AVX2
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

/* The streaming kernel's two vector widths: V8 (AVX2, 16 registers) and V16 (AVX-512, 32 registers). */
#define V8_T __m256
#define V8_LANES 8
#define V8_TARGET "avx2,fma"
#define V8_ZERO _mm256_setzero_ps
#define V8_LOAD _mm256_loadu_ps
#define V8_FMA _mm256_fmadd_ps
#define V8_HSUM hsum8
#define V16_T __m512
#define V16_LANES 16
#define V16_TARGET "avx512f,avx2,fma"
#define V16_ZERO _mm512_setzero_ps
#define V16_LOAD _mm512_loadu_ps
#define V16_FMA _mm512_fmadd_ps
#define V16_HSUM hsum16

/* y[i][r] = <x[i], w[r]> (+ beta y[i][r]) for R rows of w and N rows of x, cols a multiple of the lanes
 * L: R x N accumulators of L lanes, each w vector loaded once for the N rows of x. Every output is summed
 * in the same order (lane c % L over c, then the lanes pairwise) whatever R, N and the batch size are, so
 * a sequence's logits do not depend on what it is batched with. Along the way it prefetches pf_n bytes
 * from pf, pf_k cache lines every L columns (the next block of w: see small_n_rows). */
#define SMALL_TILE(V, R, N)                                                                                       \
    __attribute__((target(V##_TARGET))) static void small_tile_##V##_##R##x##N(                                    \
        const float *w, const float *x, int64_t cols, float beta, float *y, int64_t ldy, const char *pf,          \
        int64_t pf_n, int pf_k) {                                                                                 \
        V##_T acc[R][N];                                                                                          \
        _Pragma("GCC unroll 8") for (int r = 0; r < R; r++) _Pragma("GCC unroll 4") for (int i = 0; i < N; i++)     \
            acc[r][i] = V##_ZERO();                                                                               \
        int64_t pf_at = 0;                                                                                        \
        for (int64_t c = 0; c < cols; c += V##_LANES) {                                                           \
            for (int k = 0; k < pf_k && pf_at < pf_n; k++, pf_at += 64) _mm_prefetch(pf + pf_at, _MM_HINT_T1);     \
            V##_T wv[R];                                                                                          \
            _Pragma("GCC unroll 8") for (int r = 0; r < R; r++) wv[r] = V##_LOAD(w + r * cols + c);               \
            _Pragma("GCC unroll 4") for (int i = 0; i < N; i++) {                                                 \
                V##_T xv = V##_LOAD(x + i * cols + c);                                                            \
                _Pragma("GCC unroll 8") for (int r = 0; r < R; r++) acc[r][i] = V##_FMA(wv[r], xv, acc[r][i]);    \
            }                                                                                                     \
        }                                                                                                         \
        _Pragma("GCC unroll 4") for (int i = 0; i < N; i++) _Pragma("GCC unroll 8") for (int r = 0; r < R; r++) {   \
            float s = V##_HSUM(acc[r][i]), *o = y + i * ldy + r;                                                  \
            *o = beta != 0.0f ? s + beta * *o : s;                                                                \
        }                                                                                                         \
    }
SMALL_TILE(V8, 3, 4)
SMALL_TILE(V8, 3, 1)
SMALL_TILE(V8, 1, 4)
SMALL_TILE(V8, 1, 1)
SMALL_TILE(V16, 6, 4)
SMALL_TILE(V16, 6, 1)
SMALL_TILE(V16, 1, 4)
SMALL_TILE(V16, 1, 1)

typedef void (*small_tile_fn)(const float *w, const float *x, int64_t cols, float beta, float *y, int64_t ldy,
                              const char *pf, int64_t pf_n, int pf_k);

/* One width of the streaming kernel: blocks of `rows` rows of w against groups of 4 rows of x. */
typedef struct small_kernel {
    int rows, lanes;
    small_tile_fn block_4, block_1, row_4, row_1; /* rows x 4, rows x 1, 1 x 4, 1 x 1 */
} small_kernel;

/* AVX2: 12 accumulators, 3 of w and one of x in the 16 registers. */
static const small_kernel small_v8 = {3, 8, small_tile_V8_3x4, small_tile_V8_3x1, small_tile_V8_1x4,
                                      small_tile_V8_1x1};
/* AVX-512: 24 accumulators of 16 lanes, 6 of w and one of x in the 32 registers: twice the work per loaded
 * vector of x. The 3 x 4 tile at 16 lanes was no faster than AVX2's (the loop's loads and prefetches per
 * FMA were the limit, not its width); 6 x 4 ran the products of a batch-32 decode step of the bench model
 * 1.13-1.25x faster than it on 2 Zen 4 cores (150-158 -> 178-188 GFLOP/s, weights in DRAM), 1.11x at batch 8. */
static const small_kernel small_v16 = {6, 16, small_tile_V16_6x4, small_tile_V16_6x1, small_tile_V16_1x4,
                                       small_tile_V16_1x1};

/* Rows [r0, r1) of y = x . w^T (+ beta y) for n <= SMALL_N_MAX: w is read from memory once — a block of
 * k->rows rows stays in L1 while every group of 4 rows of x (in L2) passes over it — where sgemm would
 * first copy (pack) all of it, which costs more than the products at these batch sizes. While a block is
 * in use, its passes prefetch the next block, a share each: the hardware's stream prefetcher restarts at
 * every block's new rows, and waiting for them cost 15-25% of the kernel's rate with the weights in DRAM
 * (a decode step's case: they are 400 MB), measured with 2 threads at batch 8 and 32. The prefetches go to
 * L2, not L1: on Zen 4 (2 cores, the products of the bench model's decode step, 302 MB of weights) those
 * into L1 held the streaming to 15-25 GB/s against 32 GB/s for a plain read of the same weights, and
 * into L2 it ran at 27-31 GB/s — batch 1 11.8 -> 7.5-9.8 ms, batch 8 16.4 -> 9.6-11.2 ms, batch 32 level
 * (25.6-26.4 ms), the next block's lines in L1 evicting the current block's while the batch's groups of x
 * still passed over it. */
static void small_n_rows(const small_kernel *k, const float *x, int n, const float *w, int64_t r0, int64_t r1,
                         int64_t cols, float beta, float *y, int64_t ldy) {
    int R = k->rows;
    int calls = n / 4 + n % 4; /* tile calls per block of R rows */
    int64_t block = R * cols * (int64_t)sizeof(float);
    int64_t share = KVB_DIV_CEIL(KVB_DIV_CEIL(block, calls), 64) * 64; /* bytes each call prefetches */
    int pf_k = (int)KVB_DIV_CEIL(share / 64, cols / k->lanes);           /* lines per vector of columns */
    int64_t r = r0;
    for (; r + R <= r1; r += R) {
        int64_t next = KVB_MIN(r1 - (r + R), R) * cols * (int64_t)sizeof(float); /* bytes of the next block */
        const char *pf = (const char *)(w + (r + R) * cols);
        int i = 0;
        int64_t at = 0; /* where this call's share of the next block starts */
        for (; i + 4 <= n; i += 4, at += share)
            k->block_4(w + r * cols, x + i * cols, cols, beta, y + i * ldy + r, ldy, pf + KVB_MIN(at, next),
                       KVB_MIN(share, next - at), pf_k);
        for (; i < n; i++, at += share)
            k->block_1(w + r * cols, x + i * cols, cols, beta, y + i * ldy + r, ldy, pf + KVB_MIN(at, next),
                       KVB_MIN(share, next - at), pf_k);
    }
    for (; r < r1; r++) {
        int i = 0;
        for (; i + 4 <= n; i += 4) k->row_4(w + r * cols, x + i * cols, cols, beta, y + i * ldy + r, ldy, NULL, 0, 0);
        for (; i < n; i++) k->row_1(w + r * cols, x + i * cols, cols, beta, y + i * ldy + r, ldy, NULL, 0, 0);
    }
}
#endif

/* Rows [r0, r1) of y = x . w^T + beta y (w is [rows][cols], y is [n][rows]) on the calling thread. */
static void matmul_rows(const float *x, int n, const float *w, int64_t rows, int64_t cols, int64_t r0, int64_t r1,
                        float beta, float *y) {
#if KVB_OPS_AVX2
    /* the width depends only on the processor and cols, never on n: a weight's products at every
     * decode batch size sum in the same order */
    if (kvb__cpu_avx512 && n <= SMALL_N_MAX && cols % 16 == 0) {
        small_n_rows(&small_v16, x, n, w, r0, r1, cols, beta, y, rows);
        return;
    }
    if (kvb__cpu_avx2 && n <= SMALL_N_MAX && cols % 8 == 0) {
        small_n_rows(&small_v8, x, n, w, r0, r1, cols, beta, y, rows);
        return;
    }
#endif
    const float *ws = w + r0 * cols;
    if (n == 1)
        cblas_sgemv(CblasRowMajor, CblasNoTrans, (blasint)(r1 - r0), (blasint)cols, 1.0f, ws, (blasint)cols, x, 1, beta,
                    y + r0, 1);
    else
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, n, (blasint)(r1 - r0), (blasint)cols, 1.0f, x,
                    (blasint)cols, ws, (blasint)cols, beta, y + r0, (blasint)rows);
}

/* Thread t's share [*r0, *r1) of `total` rows among nt: contiguous, cut at multiples of 16 rows
 * (64-byte aligned slices of y). */
static void row_share(int64_t total, int t, int nt, int64_t *r0, int64_t *r1) {
    *r0 = (total * t / nt) & ~(int64_t)15;
    *r1 = t + 1 < nt ? (total * (t + 1) / nt) & ~(int64_t)15 : total;
}

void kvb__cpu_matmul(const float *x, int n, const float *w, int64_t rows, int64_t cols, float beta, float *y) {
    /* w is [rows][cols] (HF Linear layout), so y = x . w^T. OpenBLAS runs single-threaded inside one
     * OpenMP team (one thread pool for the whole backend); each thread takes a slice of w's rows, so
     * w is streamed once in total. Decode batches (n <= SMALL_N_MAX) take the streaming kernel when the
     * processor has AVX2; otherwise a single row is a matrix-vector product, which OpenBLAS 0.3.21 does
     * not pick by itself for M = 1. */
    int par = (double)rows * cols * n >= 1 << 18 && rows >= 64;
#pragma omp parallel if (par) num_threads(kvb__cpu_threads)
    {
        int64_t r0, r1;
        row_share(rows, omp_get_thread_num(), omp_get_num_threads(), &r0, &r1);
        if (r1 > r0) matmul_rows(x, n, w, rows, cols, r0, r1, beta, y);
    }
}

void kvb__cpu_matmul_n(const float *x, int n, const float *const *w, const int64_t *rows, int nw, int64_t cols,
                       float *const *y) {
    /* the weights' rows one after the other, split among the team as one matrix */
    int64_t total = 0;
    for (int i = 0; i < nw; i++) total += rows[i];
    int par = (double)total * cols * n >= 1 << 18 && total >= 64;
#pragma omp parallel if (par) num_threads(kvb__cpu_threads)
    {
        int64_t r0, r1, base = 0;
        row_share(total, omp_get_thread_num(), omp_get_num_threads(), &r0, &r1);
        for (int i = 0; i < nw; base += rows[i++]) {
            int64_t a = KVB_MAX(r0, base) - base, b = KVB_MIN(r1, base + rows[i]) - base;
            if (b > a) matmul_rows(x, n, w[i], rows[i], cols, a, b, 0.0f, y[i]);
        }
    }
}

/* Rows of RMS_GROUP take their sums of squares together. */
#define RMS_GROUP 8

/* y = x / rms(x) * w for the rows [r0, r1), r1 - r0 <= RMS_GROUP. Each row's sum of squares runs in
 * double, element after element (a chain of dependent adds); a full group interleaves its rows' chains,
 * which the processor then overlaps (a 32 x 768 call: 51 us as one row after the other, 28 us so) —
 * each row's sum is the same sequence whether it is in a group or alone, so the same bits. y may be x. */
static void rmsnorm_rows(const float *x, int r0, int r1, int dim, const float *w, float eps, float *y) {
    double ss[RMS_GROUP] = {0};
    if (r1 - r0 == RMS_GROUP) {
        for (int i = 0; i < dim; i++)
            for (int j = 0; j < RMS_GROUP; j++) {
                double v = x[(size_t)(r0 + j) * dim + i];
                ss[j] += v * v;
            }
    } else {
        for (int r = r0; r < r1; r++)
            for (int i = 0; i < dim; i++) {
                double v = x[(size_t)r * dim + i];
                ss[r - r0] += v * v;
            }
    }
    for (int r = r0; r < r1; r++) {
        const float *xr = x + (size_t)r * dim;
        float *yr = y + (size_t)r * dim;
        float inv = (float)(1.0 / sqrt(ss[r - r0] / dim + (double)eps));
        for (int i = 0; i < dim; i++) yr[i] = xr[i] * inv * w[i];
    }
}

void kvb__cpu_rmsnorm(const float *x, int rows, int dim, const float *w, float eps, float *y) {
    int groups = KVB_DIV_CEIL(rows, RMS_GROUP);
#pragma omp parallel for schedule(static) if ((size_t)rows * dim >= PAR_MIN_ELEMS) num_threads(kvb__cpu_threads)
    for (int g = 0; g < groups; g++)
        rmsnorm_rows(x, g * RMS_GROUP, KVB_MIN(rows, (g + 1) * RMS_GROUP), dim, w, eps, y);
}

static void rope_rows(float *x, int n_heads, int n, const float *cs, int hd) {
    int half = hd / 2;
#pragma omp parallel for schedule(static) if ((size_t)n * n_heads * hd >= PAR_MIN_ELEMS) num_threads(kvb__cpu_threads)
    for (int t = 0; t < n; t++) {
        const float *cos_t = cs + (size_t)t * hd, *sin_t = cos_t + half;
        for (int h = 0; h < n_heads; h++) {
            float *v = x + ((size_t)t * n_heads + h) * hd;
            for (int i = 0; i < half; i++) {
                float a = v[i], b = v[i + half];
                v[i] = a * cos_t[i] - b * sin_t[i];
                v[i + half] = b * cos_t[i] + a * sin_t[i];
            }
        }
    }
}

kvb_status kvb__cpu_rope(kvb_cpu_ctx *c, float *q, int n_heads, float *k, int n_kv_heads, int n, const int32_t *pos,
                         const kvb_rope *rope) {
    int hd = rope->head_dim, half = hd / 2;
    KVB_TRY(kvb__cpu_floats_reserve(&c->rope_cs, &c->rope_cs_floats, (size_t)n * hd));
    /* One cos/sin table per token, shared by all heads; angles in double so that long positions keep
     * f32 accuracy (transformers computes them in f32; the f64 reference is the stricter target). */
    for (int t = 0; t < n; t++) {
        float *cs = c->rope_cs + (size_t)t * hd;
        for (int i = 0; i < half; i++) {
            double a = (double)pos[t] * (double)rope->inv_freq[i];
            cs[i] = (float)cos(a);
            cs[half + i] = (float)sin(a);
        }
    }
    rope_rows(q, n_heads, n, c->rope_cs, hd);
    rope_rows(k, n_kv_heads, n, c->rope_cs, hd);
    return KVB_OK;
}

#if KVB_OPS_AVX2
__attribute__((target("avx2,fma"))) static inline __m256 silu_mul8(__m256 g, __m256 u) {
    __m256 e = kvb__expf8(_mm256_sub_ps(_mm256_setzero_ps(), g));
    return _mm256_mul_ps(_mm256_div_ps(g, _mm256_add_ps(_mm256_set1_ps(1.0f), e)), u);
}

/* out[i] = g / (1 + e^-g) * up[i] for i in [i0, i1), 8 lanes at a time; the last partial group through
 * masked loads and stores (slow on AMD, so only there), so every element takes the same instructions
 * wherever the team's split falls. */
__attribute__((target("avx2,fma"))) static void silu_mul_avx2(const float *gate, const float *up, size_t i0,
                                                              size_t i1, float *out) {
    size_t i = i0;
    for (; i + 8 <= i1; i += 8) _mm256_storeu_ps(out + i, silu_mul8(_mm256_loadu_ps(gate + i), _mm256_loadu_ps(up + i)));
    if (i < i1) {
        __m256i m = _mm256_cmpgt_epi32(_mm256_set1_epi32((int)(i1 - i)), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
        _mm256_maskstore_ps(out + i, m, silu_mul8(_mm256_maskload_ps(gate + i, m), _mm256_maskload_ps(up + i, m)));
    }
}
#endif

void kvb__cpu_silu_mul(const float *gate, const float *up, size_t n, float *out) {
    /* the team splits n at multiples of 64 elements */
    size_t n64 = KVB_DIV_CEIL(n, 64);
#pragma omp parallel for schedule(static) if (n >= PAR_MIN_ELEMS) num_threads(kvb__cpu_threads)
    for (size_t c = 0; c < n64; c++) {
        size_t i0 = c * 64, i1 = KVB_MIN(n, i0 + 64);
#if KVB_OPS_AVX2
        if (kvb__cpu_avx2) {
            silu_mul_avx2(gate, up, i0, i1, out);
            continue;
        }
#endif
        for (size_t i = i0; i < i1; i++) out[i] = gate[i] / (1.0f + kvb__expf(-gate[i])) * up[i];
    }
}

void kvb__cpu_bias_add(float *y, int n, int dim, const float *b) {
#pragma omp parallel for schedule(static) if ((size_t)n * dim >= PAR_MIN_ELEMS) num_threads(kvb__cpu_threads)
    for (int i = 0; i < n; i++) {
        float *yr = y + (size_t)i * dim;
        for (int c = 0; c < dim; c++) yr[c] += b[c];
    }
}

void kvb__cpu_kv_write(const kvb_attn_batch *b, const float *k, const float *v) {
    const kvb_kv_geom *g = b->geom;
    size_t row = (size_t)g->n_kv_heads * g->head_dim; /* floats per token per K or V */
    size_t half = (size_t)g->block_size * row;        /* floats of K (or V) in a layer slice */
    for (int s = 0; s < b->n_seqs; s++) {
        const kvb_attn_seq *sq = &b->seqs[s];
        for (int t = 0; t < sq->q_len; t++) {
            int p = sq->ctx_len - sq->q_len + t;
            float *blk = b->layer_blocks[sq->blk_first + p / g->block_size];
            size_t off = (size_t)(p % g->block_size) * row;
            memcpy(blk + off, k + (size_t)(sq->q_start + t) * row, row * sizeof(float));
            memcpy(blk + half + off, v + (size_t)(sq->q_start + t) * row, row * sizeof(float));
        }
    }
}
