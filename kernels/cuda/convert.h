/* kvbank — CUDA element conversion and device-side random fill (see launch.h for the conventions). */
#ifndef KVB_KERNELS_CUDA_CONVERT_H
#define KVB_KERNELS_CUDA_CONVERT_H

#include "kernels/cuda/launch.h"

KVB_CUDA_EXTERN_C_BEGIN

/* dst[i] = src[i] for i < n, converted from `sdt` to `ddt` (round to nearest even). src and dst may be
 * the same array only when the dtypes have the same size. */
int kvb_cuda_convert(const void *src, kvb_dtype sdt, void *dst, kvb_dtype ddt, size_t n, kvb_cuda_stream_t s);

/* dst[i] = lo + (hi - lo) * U_i for i < n, with U_i uniform in [0, 1) from a counter-based hash of
 * (seed, i): the same seed gives the same array on any device and launch shape. lo == hi fills a
 * constant. Used to build benchmark weights on the device without files. */
int kvb_cuda_fill_uniform(void *dst, kvb_dtype dt, size_t n, uint64_t seed, float lo, float hi, kvb_cuda_stream_t s);

KVB_CUDA_EXTERN_C_END

#endif
