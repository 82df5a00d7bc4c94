/* kvbank — CUDA rotary position embedding (rotate-half / NeoX form of Llama and Qwen3). */
#ifndef KVB_KERNELS_CUDA_ROPE_H
#define KVB_KERNELS_CUDA_ROPE_H

#include "kernels/cuda/launch.h"

KVB_CUDA_EXTERN_C_BEGIN

/* Rotates, in place, every head of q [n][n_heads][head_dim] and k [n][n_kv_heads][head_dim] (k may be
 * NULL with n_kv_heads 0) of token t by the angles pos[t] * inv_freq[i], i < head_dim/2:
 *   v[i] = a cos - b sin, v[i + half] = b cos + a sin   with a = v[i], b = v[i + half].
 *   pos:      [n] int32 device array (positions in the sequence)
 *   inv_freq: [head_dim/2] f32 device array (the model's table, scaling already applied)
 * Angles, cos and sin are computed in double, as the CPU twin kvb__cpu_rope does. head_dim is even. */
int kvb_cuda_rope(void *q, int n_heads, void *k, int n_kv_heads, kvb_dtype dt, int n, int head_dim,
                  const int32_t *pos, const float *inv_freq, kvb_cuda_stream_t s);

KVB_CUDA_EXTERN_C_END

#endif
