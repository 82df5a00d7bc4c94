/* kvbank — CPU kernels (f32 activations). Internal to kernels/cpu; everything else goes through the
 * backend vtable in kernels/backend.h. Each function is the CPU twin of a CUDA kernel. */
#ifndef KVB_KERNELS_CPU_OPS_H
#define KVB_KERNELS_CPU_OPS_H

#include <stddef.h>
#include <stdint.h>

#include "kernels/backend.h"

/* Per-backend scratch for attention: one slab per thread, grown on demand from the calling thread. */
typedef struct kvb_cpu_ctx {
    int n_threads;
    float *scratch;       /* [n_threads][scratch_floats] */
    size_t scratch_floats;
    float *rope_cs;       /* [n][head_dim] cos (first half) and sin (second half) per token */
    size_t rope_cs_floats;
    void *items;          /* [items_cap] attention work items */
    size_t items_cap;
    float *part;          /* [part_floats] decode attention's per-chunk partials */
    size_t part_floats;
    float *gath;          /* [gath_floats] prefill attention's keys and values, per KV head */
    size_t gath_floats;
} kvb_cpu_ctx;

/* Query heads the CPU attention takes (its per-row softmax state lives on the stack). */
#define KVB_CPU_ATTN_MAX_HEADS 256

/* Threads of the backend's OpenMP team. Process-wide, like OpenBLAS's own setting: every parallel
 * region names it explicitly, so the team size does not depend on which thread calls a kernel. */
extern int kvb__cpu_threads;
/* 1 when this processor has AVX2 and FMA (checked once at backend creation): the kernels with a
 * hand-vectorized variant take it. */
extern int kvb__cpu_avx2;
/* 1 when it also has AVX-512F (and kvb__cpu_avx2 is 1): the decode products take their 16-lane kernel,
 * the decode attention its group-wise walk. */
extern int kvb__cpu_avx512;

/* Makes sure every thread has `floats` floats of scratch. */
kvb_status kvb__cpu_scratch_reserve(kvb_cpu_ctx *c, size_t floats);
/* Makes the aligned buffer *buf hold at least `floats` floats (contents not kept). */
kvb_status kvb__cpu_floats_reserve(float **buf, size_t *cap, size_t floats);

void kvb__cpu_embed(const float *table, int64_t dim, const int32_t *ids, int n, float *out);
void kvb__cpu_matmul(const float *x, int n, const float *w, int64_t rows, int64_t cols, float beta, float *y);
/* y[i] = x . w[i]^T for i < nw (w[i] is [rows[i]][cols]) in one parallel region. */
void kvb__cpu_matmul_n(const float *x, int n, const float *const *w, const int64_t *rows, int nw, int64_t cols,
                       float *const *y);
void kvb__cpu_rmsnorm(const float *x, int rows, int dim, const float *w, float eps, float *y);
kvb_status kvb__cpu_rope(kvb_cpu_ctx *c, float *q, int n_heads, float *k, int n_kv_heads, int n, const int32_t *pos,
                         const kvb_rope *rope);
/* y[i][:] += b[:] for i < n (y is [n][dim]). */
void kvb__cpu_bias_add(float *y, int n, int dim, const float *b);
void kvb__cpu_silu_mul(const float *gate, const float *up, size_t n, float *out);
void kvb__cpu_kv_write(const kvb_attn_batch *b, const float *k, const float *v);
kvb_status kvb__cpu_attention(kvb_cpu_ctx *c, const kvb_attn_batch *b, const float *q, float *out);

#endif
