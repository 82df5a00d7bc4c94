/* kvbank — CPU elementwise kernels (the matrix products are matmul.c). */
#include "kernels/cpu/ops.h"
#include "kernels/cpu/vexp.h"

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
int kvb__cpu_avx512bf16 = 0;

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

void kvb__cpu_embed(const kvb_tensor *table, const int32_t *ids, int n, float *out) {
    int64_t dim = table->ne[1];
    for (int i = 0; i < n; i++) {
        float *o = out + (size_t)i * dim;
        const char *row = (const char *)table->data + (size_t)ids[i] * dim * kvb_dtype_size(table->dtype);
        if (table->dtype == KVB_DTYPE_F32) memcpy(o, row, (size_t)dim * sizeof(float));
        else kvb__cpu_widen(row, table->dtype, dim, o);
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

/* One K or V row into the cache: as it is (f32), or rounded to the nearest bf16 (a "cpu:bf16" cache). */
static void kv_row(void *dst, const float *src, size_t n, int elem_size) {
    if (elem_size != 2) {
        memcpy(dst, src, n * sizeof(float));
        return;
    }
    uint16_t *d = dst;
    for (size_t i = 0; i < n; i++) d[i] = kvb_f32_to_bf16(src[i]);
}

void kvb__cpu_kv_write(const kvb_attn_batch *b, const float *k, const float *v) {
    const kvb_kv_geom *g = b->geom;
    size_t row = (size_t)g->n_kv_heads * g->head_dim; /* elements per token per K or V */
    size_t half = (size_t)g->block_size * row;        /* elements of K (or V) in a layer slice */
    size_t es = g->elem_size == 2 ? 2 : sizeof(float);
    for (int s = 0; s < b->n_seqs; s++) {
        const kvb_attn_seq *sq = &b->seqs[s];
        for (int t = 0; t < sq->q_len; t++) {
            int p = sq->ctx_len - sq->q_len + t;
            char *blk = b->layer_blocks[sq->blk_first + p / g->block_size];
            size_t off = (size_t)(p % g->block_size) * row;
            kv_row(blk + off * es, k + (size_t)(sq->q_start + t) * row, row, g->elem_size);
            kv_row(blk + (half + off) * es, v + (size_t)(sq->q_start + t) * row, row, g->elem_size);
        }
    }
}
