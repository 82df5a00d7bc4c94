/* kvbank — CUDA block movers: whole KV blocks (or one layer's slices of them) between the pool, a
 * lender's imported region, the layer stream cache and prefetch buffers. */
#ifndef KVB_KERNELS_CUDA_BLOCKS_H
#define KVB_KERNELS_CUDA_BLOCKS_H

#include "kernels/cuda/launch.h"

KVB_CUDA_EXTERN_C_BEGIN

/* Each call moves n chunks of `bytes` bytes. Device arrays of addresses name scattered chunks (blocks
 * of a pool, of an imported region, slots of an LSC); a base address names n chunks packed back to
 * back (chunk i at base + i * bytes). Chunks must not overlap between source and destination. Chunks
 * whose addresses are 16-byte aligned and whose size is a multiple of 16 move as 16-byte vectors.
 * CPU twin: memcpy per chunk.
 *
 * copy:    dst[i] <- src[i]      (src, dst: [n] device arrays of addresses)
 * gather:  dst_base + i*bytes <- src[i]
 * scatter: dst[i] <- src_base + i*bytes */
int kvb_cuda_blocks_copy(const void *const *src, void *const *dst, int n, size_t bytes, kvb_cuda_stream_t s);
int kvb_cuda_blocks_gather(const void *const *src, void *dst_base, int n, size_t bytes, kvb_cuda_stream_t s);
int kvb_cuda_blocks_scatter(const void *src_base, void *const *dst, int n, size_t bytes, kvb_cuda_stream_t s);

KVB_CUDA_EXTERN_C_END

#endif
