/* kvbank — CUDA products of a weight matrix and a few activation rows: decode steps and small batches.
 *
 * cuBLAS serves every product, but for one to KVB_CUDA_GEMV_MAX_ROWS activation rows it picks split-K
 * GEMM kernels plus a reduce launch that stream the weights at about 2.1 TB/s on an H100 (ncu,
 * 4096 x 4096 bf16), where a decode step is bound by exactly that stream; the CUDA-core kernel here
 * reads each weight row once with 16-byte loads and every activation row from L1/L2. From
 * KVB_CUDA_GEMV_MAX_ROWS + 1 to KVB_CUDA_SKINNY_MAX_ROWS rows (bf16/f16) a tensor-core kernel streams
 * the weights the same way (gemv.cu says how); larger batches go to cuBLAS. The norm and swiglu forms
 * fold the layer's RMSNorm, or the MLP's SiLU-mul, into the product's input. CPU twin: kvb__cpu_matmul
 * (after kvb__cpu_rmsnorm / the SiLU-mul for the folded forms). */
#ifndef KVB_KERNELS_CUDA_GEMV_H
#define KVB_KERNELS_CUDA_GEMV_H

#include "kernels/cuda/launch.h"

KVB_CUDA_EXTERN_C_BEGIN

#define KVB_CUDA_GEMV_MAX_ROWS 8
#define KVB_CUDA_SKINNY_MAX_ROWS 64

/* y[t][r] = sum_c w[r][c] * x[t][c] + beta * y[t][r] for t < n, r < rows: w [rows][cols], x [n][cols],
 * y [n][rows], all of `dt`, accumulated in f32. Needs w, x 16-byte aligned and either 1 <= n <=
 * KVB_CUDA_GEMV_MAX_ROWS with cols * the element size a multiple of 16, or n <= KVB_CUDA_SKINNY_MAX_ROWS,
 * dt bf16 or f16 and cols a multiple of 32; returns cudaErrorInvalidValue otherwise (kvb_cuda_gemv_fits
 * says beforehand). */
int kvb_cuda_gemv(const void *w, const void *x, void *y, kvb_dtype dt, int rows, int cols, int n, float beta,
                  kvb_cuda_stream_t s);
int kvb_cuda_gemv_fits(kvb_dtype dt, const void *w, const void *x, int cols, int n);

/* bf16 and f16 only (the f32 backend keeps the CPU backend's order of operations), with the same
 * conditions on n and cols as kvb_cuda_gemv: */
/* The product of RMSNorm(x) with weight g (f32 [cols], 16-byte aligned; cols a multiple of 8):
 * x_norm[t][c] = x[t][c] * g[c] / sqrt(mean_c x[t][c]^2 + eps). x is not changed. */
int kvb_cuda_gemv_norm(const void *w, const void *x, const float *g, float eps, void *y, kvb_dtype dt, int rows,
                       int cols, int n, float beta, kvb_cuda_stream_t s);

/* The product of silu(gu[t][c]) * gu[t][cols + c]: gu [n][2 cols] is the stacked gate/up product
 * (cols * the element size a multiple of 16). */
int kvb_cuda_gemv_swiglu(const void *w, const void *gu, void *y, kvb_dtype dt, int rows, int cols, int n, float beta,
                         kvb_cuda_stream_t s);

KVB_CUDA_EXTERN_C_END

#endif
