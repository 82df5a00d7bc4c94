/* kvbank — CUDA row gather: embedding lookup and the selection of rows that want logits. */
#ifndef KVB_KERNELS_CUDA_EMBED_H
#define KVB_KERNELS_CUDA_EMBED_H

#include "kernels/cuda/launch.h"

KVB_CUDA_EXTERN_C_BEGIN

/* dst[i][:] = src[ids[i]][:] for i < n, converting `sdt` to `ddt`.
 *   src: [src_rows][dim] of sdt (an embedding table or an activation buffer)
 *   ids: [n] int32 device array; every id in [0, src_rows) (the caller validated them)
 *   dst: [n][dim] of ddt; must not overlap src */
int kvb_cuda_gather_rows(const void *src, kvb_dtype sdt, const int32_t *ids, int n, int dim, void *dst,
                         kvb_dtype ddt, kvb_cuda_stream_t s);

KVB_CUDA_EXTERN_C_END

#endif
