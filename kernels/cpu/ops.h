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
    float *mm_buf;        /* [n_threads][mm_buf_floats] the products' weight rows widened to f32 */
    size_t mm_buf_floats;
    float *xq;            /* [xq_floats] x quantized to E4M3 values for an FP8-activation product */
    size_t xq_floats;
    float *xs;            /* [xs_floats] the scales of xq's rows */
    size_t xs_floats;
    uint64_t tickets; /* copy_async's last ticket (atomic: the stager's threads copy too) */
} kvb_cpu_ctx;

/* Query heads the CPU attention takes (its per-row softmax state lives on the stack). */
#define KVB_CPU_ATTN_MAX_HEADS 256

/* Threads of the backend's OpenMP team. Process-wide, like OpenBLAS's own setting: every parallel
 * region names it explicitly, so the team size does not depend on which thread calls a kernel. */
extern int kvb__cpu_threads;
/* 1 when this processor has AVX2, FMA and F16C (checked once at backend creation): the kernels with a
 * hand-vectorized variant take it. */
extern int kvb__cpu_avx2;
/* 1 when it also has AVX-512F (and kvb__cpu_avx2 is 1): the products take their 16-lane kernel, the
 * decode attention its group-wise walk. */
extern int kvb__cpu_avx512;
/* 1 when it also has AVX512_BF16 (with AVX512BW and VL; kvb__cpu_avx512 is 1): the decode walk of a bf16
 * KV cache takes the bf16 dot products (q and the softmax weights rounded to bf16, attention.c). */
extern int kvb__cpu_avx512bf16;

/* Makes sure every thread has `floats` floats of scratch. */
kvb_status kvb__cpu_scratch_reserve(kvb_cpu_ctx *c, size_t floats);
/* Makes the aligned buffer *buf hold at least `floats` floats (contents not kept). */
kvb_status kvb__cpu_floats_reserve(float **buf, size_t *cap, size_t floats);

/* out[i][:] = table[ids[i]][:] widened to f32. */
void kvb__cpu_embed(const kvb_tensor *table, const int32_t *ids, int n, float *out);
/* n elements of dtype dt at src (any alignment) widened to f32, exactly. */
void kvb__cpu_widen(const void *src, kvb_dtype dt, int64_t n, float *dst);
/* y[n][rows] = x[n][cols] . w^T (+ beta y) for a weight of any dtype the backend keeps (matmul.c); an FP8
 * weight's scales and input quantization included. */
kvb_status kvb__cpu_matmul(kvb_cpu_ctx *c, const float *x, int n, const kvb_tensor *w, float beta, float *y);
/* y[i] = x . w[i]^T for i < nw (weights of the same cols) in one parallel region. */
kvb_status kvb__cpu_matmul_n(kvb_cpu_ctx *c, const float *x, int n, const kvb_tensor *const *w, int nw,
                             float *const *y);
/* Dynamic per-token FP8 quantization of n rows of cols (kvb_act_quant KVB_ACT_FP8_TOKEN): q[i] E4M3 values
 * (as f32) and s[i] the row's scale, x[i] ~ q[i] * s[i]. */
void kvb__cpu_quant_fp8_rows(const float *x, int n, int64_t cols, float *q, float *s);
void kvb__cpu_rmsnorm(const float *x, int rows, int dim, const float *w, float eps, float *y);
kvb_status kvb__cpu_rope(kvb_cpu_ctx *c, float *q, int n_heads, float *k, int n_kv_heads, int n, const int32_t *pos,
                         const kvb_rope *rope);
/* y[i][:] += b[:] for i < n (y is [n][dim]). */
void kvb__cpu_bias_add(float *y, int n, int dim, const float *b);
void kvb__cpu_silu_mul(const float *gate, const float *up, size_t n, float *out);
void kvb__cpu_kv_write(const kvb_attn_batch *b, const float *k, const float *v);
kvb_status kvb__cpu_attention(kvb_cpu_ctx *c, const kvb_attn_batch *b, const float *q, float *out);

#endif
