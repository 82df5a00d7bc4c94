/* kvbank — what every CUDA launcher header in kernels/cuda shares.
 *
 * Each op is an `op.cu` + `op.h` pair; the header declares only extern "C" launchers, callable from C
 * (backend_cuda.c, tests, benchmarks) without any CUDA header. A launcher:
 *  - takes device pointers, plain sizes and a stream (never the legacy default stream: NULL is
 *    rejected with cudaErrorInvalidValue), and only enqueues work; nothing waits for the device;
 *  - returns the launch's cudaError_t as an int (0 = cudaSuccess), to be wrapped in KVB_CUDA_CHECK;
 *  - computes in f32 whatever the storage type (kvb_dtype: f32, f16 or bf16) of its arrays.
 * Shapes are row-major like the rest of kvbank; every array is described where it is declared. */
#ifndef KVB_KERNELS_CUDA_LAUNCH_H
#define KVB_KERNELS_CUDA_LAUNCH_H

#include <stddef.h>
#include <stdint.h>
#include <stdlib.h> /* before the extern "C" block: C++'s <stdlib.h> must keep C++ linkage */

#ifdef __cplusplus
extern "C" {
#endif
#include "common/mem/region_cuda.h" /* kvb_cuda_stream_t, KVB_CUDA_CHECK */
#include "common/util/util.h"       /* kvb_dtype */
#ifdef __cplusplus
}
#endif

#ifdef __cplusplus
#define KVB_CUDA_EXTERN_C_BEGIN extern "C" {
#define KVB_CUDA_EXTERN_C_END }
#else
#define KVB_CUDA_EXTERN_C_BEGIN
#define KVB_CUDA_EXTERN_C_END
#endif

#endif
