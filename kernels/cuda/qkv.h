/* kvbank — CUDA: what follows the stacked q/k/v product of a layer, in one kernel: the projections'
 * biases, Qwen3's per-head RMSNorm of q and k, RoPE of q and k, and the KV write. The separate
 * kernels (bias_add, rmsnorm, rope, kv_write) each read and write every head once more and cost a
 * launch each. CPU twin: kvb__cpu bias add, rmsnorm per head, rope and kv_write in that order. */
#ifndef KVB_KERNELS_CUDA_QKV_H
#define KVB_KERNELS_CUDA_QKV_H

#include "kernels/cuda/launch.h"

KVB_CUDA_EXTERN_C_BEGIN

/* For token t < n, from its row of qkv [n][(n_heads + 2 n_kv_heads) head_dim] (q heads, then k heads,
 * then v heads, as the stacked projection writes them):
 *   every head: += bias (f32 [(n_heads + 2 n_kv_heads) head_dim]; NULL: none);
 *   q heads: RMSNorm with q_norm (f32 [head_dim]; NULL: none), RoPE at pos[t] -> q_out [n][n_heads][head_dim];
 *   k heads: RMSNorm with k_norm, RoPE at pos[t] -> K row of slot slots[t];
 *   v heads: -> V row of slot slots[t];
 * where slot = j * block_size + row puts the row in blocks[j] ([2][block_size][n_kv_heads][head_dim]),
 * as kvb_cuda_kv_write; slots[t] < 0 writes no K/V row. RoPE is the rotate_half form with inv_freq
 * [head_dim / 2], cos/sin in double as kvb_cuda_rope. head_dim even, at most 256; dt any storage type. */
int kvb_cuda_qkv_rope_write(kvb_dtype dt, const void *qkv, int n, int n_heads, int n_kv_heads, int head_dim,
                            const float *bias, const float *q_norm, const float *k_norm, float eps, const int32_t *pos,
                            const float *inv_freq, void *q_out, void *const *blocks, const int64_t *slots,
                            int block_size, kvb_cuda_stream_t s);

KVB_CUDA_EXTERN_C_END

#endif
