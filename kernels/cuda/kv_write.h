/* kvbank — CUDA KV write: the step's new K and V rows into their paged blocks. */
#ifndef KVB_KERNELS_CUDA_KV_WRITE_H
#define KVB_KERNELS_CUDA_KV_WRITE_H

#include "kernels/cuda/launch.h"

KVB_CUDA_EXTERN_C_BEGIN

/* For every token t < n_tokens, copies k[t] and v[t] (row_elems = n_kv_heads * head_dim elements of
 * `dt` each) into its block slot:
 *   blocks: device array of block addresses for the current layer; entry j points at that block's
 *           layer slice [2 (K,V)][block_size][n_kv_heads][head_dim] (the kvb_attn_batch.layer_blocks
 *           contract), 16-byte aligned for the vector path
 *   slots:  [n_tokens] int64 device array; slot = j * block_size + row: token t goes to row `row` of
 *           block entry j (K at row, V at block_size + row of the slice); a negative slot skips
 *           the token
 *   k, v:   [n_tokens][row_elems] of `dt` (the KV cache has the activations' dtype)
 * CPU twin: kvb__cpu_kv_write (which derives the slots from the batch itself). */
int kvb_cuda_kv_write(kvb_dtype dt, void *const *blocks, const int64_t *slots, int n_tokens, int block_size,
                      int row_elems, const void *k, const void *v, kvb_cuda_stream_t s);

KVB_CUDA_EXTERN_C_END

#endif
