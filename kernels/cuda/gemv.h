/* kvbank — CUDA products of a weight matrix and a few activation rows: decode steps and small batches.
 *
 * cuBLAS serves every product, but for one to KVB_CUDA_GEMV_MAX_ROWS activation rows it picks split-K
 * GEMM kernels plus a reduce launch that stream the weights at about 2.1 TB/s on an H100 (ncu,
 * 4096 x 4096 bf16), where a decode step is bound by exactly that stream; the CUDA-core kernel here
 * reads each weight row once with 16-byte loads and every activation row from L1/L2. From
 * KVB_CUDA_GEMV_MAX_ROWS + 1 to KVB_CUDA_SKINNY_MAX_ROWS rows (bf16/f16) a tensor-core kernel streams
 * the weights the same way (gemv.cu says how; KVB_CUDA_SKINNY picks its variant); larger batches go
 * to cuBLAS. The norm and swiglu forms
 * fold the layer's RMSNorm, or the MLP's SiLU-mul, into the product's input. CPU twin: kvb__cpu_matmul
 * (after kvb__cpu_rmsnorm / the SiLU-mul for the folded forms). */
#ifndef KVB_KERNELS_CUDA_GEMV_H
#define KVB_KERNELS_CUDA_GEMV_H

#include "kernels/cuda/launch.h"

KVB_CUDA_EXTERN_C_BEGIN

#define KVB_CUDA_GEMV_MAX_ROWS 8
#define KVB_CUDA_SKINNY_MAX_ROWS 64

/* The kernel that takes 9..64 activation rows (gemv.cu says how each works). */
enum {
    KVB_CUDA_SKINNY_V2 = 0, /* the default: 64-128 weight rows a block, the input transformed once a block */
    KVB_CUDA_SKINNY_V1 = 1, /* 16 weight rows a block, every warp loading its own input (A/B on a GPU) */
};
/* The kernels a launcher counts (kvb_cuda_gemv_ctx.launched). */
enum { KVB_CUDA_GEMV_K_GEMV = 0, KVB_CUDA_GEMV_K_SKINNY_V1 = 1, KVB_CUDA_GEMV_K_SKINNY_V2 = 2, KVB_CUDA_GEMV_K_COUNT };

/* What the products need besides their operands; one per stream (the backend's). */
typedef struct kvb_cuda_gemv_ctx {
    int skinny;        /* KVB_CUDA_SKINNY_V2 or _V1 */
    int n_sm;          /* the device's multiprocessors: v2's split plan */
    float *part;       /* v2's split partials, kvb_cuda_gemv_workspace's floats (NULL while none is needed) */
    int32_t *counters; /* [its n_counters] v2's split counters: zero before the first launch, and so left */
    uint64_t launched[KVB_CUDA_GEMV_K_COUNT]; /* launches of each kernel (host counts) */
} kvb_cuda_gemv_ctx;

/* "v1" / "v2" (NULL or "": v2) as KVB_CUDA_SKINNY_*, -1 for anything else; and the variant's name. */
int kvb_cuda_skinny_parse(const char *s);
const char *kvb_cuda_skinny_name(int skinny);

/* v2's plan for a product (host code; the same in the emulation): split-K when the weight rows alone
 * would leave the device's resident blocks idle. */
typedef struct kvb_cuda_gemv_plan {
    int block_rows; /* weight rows a block */
    int splits;     /* blocks over each block's rows, each a range of 32-column chunks */
    int blocks;     /* the grid */
    int tiles;      /* activation tiles the widest split walks */
} kvb_cuda_gemv_plan;
void kvb_cuda_gemv_plan_of(const kvb_cuda_gemv_ctx *g, int rows, int cols, int n, kvb_cuda_gemv_plan *out);

/* The floats of `part` and the counters a product needs (0 for kernels other than v2 and unsplit
 * products). */
size_t kvb_cuda_gemv_workspace(const kvb_cuda_gemv_ctx *g, kvb_dtype dt, int rows, int cols, int n, size_t *n_counters);

/* y[t][r] = sum_c w[r][c] * x[t][c] + beta * y[t][r] for t < n, r < rows: w [rows][cols], x [n][cols],
 * y [n][rows], all of `dt`, accumulated in f32. Needs w, x 16-byte aligned, cols * the element size a
 * multiple of 16 and either 1 <= n <= KVB_CUDA_GEMV_MAX_ROWS, or n <= KVB_CUDA_SKINNY_MAX_ROWS with dt
 * bf16 or f16 (and cols a multiple of 32 for v1); returns cudaErrorInvalidValue otherwise
 * (kvb_cuda_gemv_fits says beforehand), or when the workspace is missing. */
int kvb_cuda_gemv(kvb_cuda_gemv_ctx *g, const void *w, const void *x, void *y, kvb_dtype dt, int rows, int cols, int n,
                  float beta, kvb_cuda_stream_t s);
int kvb_cuda_gemv_fits(const kvb_cuda_gemv_ctx *g, kvb_dtype dt, const void *w, const void *x, int cols, int n);

/* bf16 and f16 only (the f32 backend keeps the CPU backend's order of operations), with the same
 * conditions on n and cols as kvb_cuda_gemv: */
/* The product of RMSNorm(x) with weight g (f32 [cols], 16-byte aligned): x_norm[t][c] = x[t][c] * g[c] /
 * sqrt(mean_c x[t][c]^2 + eps). x is not changed. */
int kvb_cuda_gemv_norm(kvb_cuda_gemv_ctx *g, const void *w, const void *x, const float *gn, float eps, void *y,
                       kvb_dtype dt, int rows, int cols, int n, float beta, kvb_cuda_stream_t s);

/* The product of silu(gu[t][c]) * gu[t][cols + c]: gu [n][2 cols] is the stacked gate/up product. */
int kvb_cuda_gemv_swiglu(kvb_cuda_gemv_ctx *g, const void *w, const void *gu, void *y, kvb_dtype dt, int rows, int cols,
                         int n, float beta, kvb_cuda_stream_t s);

KVB_CUDA_EXTERN_C_END

#endif
