/* kvbank — CUDA elementwise ops of the MLP and the residual stream. */
#ifndef KVB_KERNELS_CUDA_ELEMENTWISE_H
#define KVB_KERNELS_CUDA_ELEMENTWISE_H

#include "kernels/cuda/launch.h"

KVB_CUDA_EXTERN_C_BEGIN

/* out[i] = silu(gate[i]) * up[i] = gate[i] / (1 + exp(-gate[i])) * up[i] for i < n, all of `dt`.
 * out may alias gate or up. CPU twin: kvb__cpu_silu_mul. */
int kvb_cuda_silu_mul(const void *gate, const void *up, void *out, kvb_dtype dt, size_t n, kvb_cuda_stream_t s);

/* out[t][c] = silu(gu[t][c]) * gu[t][cols + c] for t < rows, c < cols: gu [rows][2 cols] is the stacked
 * gate/up product, out [rows][cols] (must not overlap gu). CPU twin: kvb__cpu_silu_mul on the halves. */
int kvb_cuda_swiglu(const void *gu, void *out, kvb_dtype dt, int rows, int cols, kvb_cuda_stream_t s);

/* out[i] = a[i] + b[i] for i < n, all of `dt` (the residual add, when it is not fused into a GEMM's
 * beta). out may alias a or b. */
int kvb_cuda_add(const void *a, const void *b, void *out, kvb_dtype dt, size_t n, kvb_cuda_stream_t s);

/* y[i][c] += bias[c] for i < rows, c < dim: y of `dt`, bias f32 (a linear layer's bias, kept f32 like
 * every vector weight). CPU twin: kvb__cpu_bias_add. */
int kvb_cuda_bias_add(void *y, kvb_dtype dt, int rows, int dim, const float *bias, kvb_cuda_stream_t s);

KVB_CUDA_EXTERN_C_END

#endif
