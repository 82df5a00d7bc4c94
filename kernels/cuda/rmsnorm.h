/* kvbank — CUDA RMSNorm: layer norms, the final norm, and Qwen3's per-head q/k norm. */
#ifndef KVB_KERNELS_CUDA_RMSNORM_H
#define KVB_KERNELS_CUDA_RMSNORM_H

#include "kernels/cuda/launch.h"

KVB_CUDA_EXTERN_C_BEGIN

/* y[r][i] = x[r][i] / sqrt(mean_i(x[r][i]^2) + eps) * w[i] for r < rows, i < dim.
 *   x, y: [rows][dim] of `dt`; may alias (in place)
 *   w:    [dim] f32 (the backend keeps norm weights in f32)
 * For the per-head q/k norm, rows = tokens * heads and dim = head_dim. CPU twin: kvb__cpu_rmsnorm. */
int kvb_cuda_rmsnorm(const void *x, void *y, kvb_dtype dt, int rows, int dim, const float *w, float eps,
                     kvb_cuda_stream_t s);

KVB_CUDA_EXTERN_C_END

#endif
