/* kvbank — CUDA matrix-vector products for decode: a weight matrix times a few activation rows.
 *
 * cuBLAS serves every product, but for one to KVB_CUDA_GEMV_MAX_ROWS activation rows it picks split-K
 * GEMM kernels plus a reduce launch that stream the weights at about 2.1 TB/s on an H100 (ncu,
 * 4096 x 4096 bf16), where a decode step is bound by exactly that stream. This kernel reads each weight
 * row once with 16-byte loads and every activation row from L1/L2. CPU twin: kvb__cpu_matmul. */
#ifndef KVB_KERNELS_CUDA_GEMV_H
#define KVB_KERNELS_CUDA_GEMV_H

#include "kernels/cuda/launch.h"

KVB_CUDA_EXTERN_C_BEGIN

#define KVB_CUDA_GEMV_MAX_ROWS 8

/* y[t][r] = sum_c w[r][c] * x[t][c] + beta * y[t][r] for t < n, r < rows: w [rows][cols], x [n][cols],
 * y [n][rows], all of `dt`, accumulated in f32. Needs 1 <= n <= KVB_CUDA_GEMV_MAX_ROWS, cols * the
 * element size a multiple of 16 and w, x 16-byte aligned; returns cudaErrorInvalidValue otherwise
 * (kvb_cuda_gemv_fits says beforehand). */
int kvb_cuda_gemv(const void *w, const void *x, void *y, kvb_dtype dt, int rows, int cols, int n, float beta,
                  kvb_cuda_stream_t s);
int kvb_cuda_gemv_fits(kvb_dtype dt, const void *w, const void *x, int cols, int n);

KVB_CUDA_EXTERN_C_END

#endif
