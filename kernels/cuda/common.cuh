/* kvbank — device-side helpers shared by the .cu files of kernels/cuda (C++ only, never included by C).
 * Storage types are float, __half and __nv_bfloat16; arithmetic is always f32. A "vector" is 16 bytes:
 * VEC<T> elements, loaded and stored as one uint4 when the address is 16-byte aligned. */
#ifndef KVB_KERNELS_CUDA_COMMON_CUH
#define KVB_KERNELS_CUDA_COMMON_CUH

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <stdint.h>

#include "kernels/cuda/launch.h"

namespace kvb {

template <typename T> struct vec_of {
    static constexpr int n = 16 / (int)sizeof(T);
};
template <typename T> constexpr int VEC = vec_of<T>::n;

__device__ __forceinline__ float to_f(float x) { return x; }
__device__ __forceinline__ float to_f(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_f(__nv_bfloat16 x) { return __bfloat162float(x); }

template <typename T> __device__ __forceinline__ T from_f(float x);
template <> __device__ __forceinline__ float from_f<float>(float x) { return x; }
template <> __device__ __forceinline__ __half from_f<__half>(float x) { return __float2half_rn(x); }
template <> __device__ __forceinline__ __nv_bfloat16 from_f<__nv_bfloat16>(float x) { return __float2bfloat16_rn(x); }

/* 16 loaded bytes as VEC<T> floats. */
template <typename T> __device__ __forceinline__ void unpack_vec(const uint4 &u, float *f) {
    const T *e = reinterpret_cast<const T *>(&u);
#pragma unroll
    for (int i = 0; i < VEC<T>; i++) f[i] = to_f(e[i]);
}

/* 16 bytes at p (16-byte aligned) as VEC<T> floats. */
template <typename T> __device__ __forceinline__ void load_vec(const T *p, float *f) {
    unpack_vec<T>(*reinterpret_cast<const uint4 *>(p), f);
}

template <typename T> __device__ __forceinline__ void store_vec(T *p, const float *f) {
    uint4 u;
    T *e = reinterpret_cast<T *>(&u);
#pragma unroll
    for (int i = 0; i < VEC<T>; i++) e[i] = from_f<T>(f[i]);
    *reinterpret_cast<uint4 *>(p) = u;
}

__device__ __forceinline__ bool aligned16(const void *p) { return ((uintptr_t)p & 15) == 0; }

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

/* Sum over the block (blockDim.x a multiple of 32, at most 1024); every thread gets the result.
 * `red` is 32 floats of shared memory; the call contains two __syncthreads. */
__device__ __forceinline__ float block_sum(float v, float *red) {
    int lane = threadIdx.x & 31, w = threadIdx.x >> 5, nw = blockDim.x >> 5;
    v = warp_sum(v);
    __syncthreads(); /* red may still be read by a previous call */
    if (lane == 0) red[w] = v;
    __syncthreads();
    v = lane < nw ? red[lane] : 0.0f;
    return warp_sum(v);
}

/* Called by every thread of a block that has written its part of a group of n_parts blocks (split
 * partials): true in the block that finished the group last, which then merges the parts and, having
 * reset *counter, leaves the group ready for the next launch. The fence orders this block's parts
 * before its count, so the last block sees every part (read them through L2: __ldcg). */
__device__ __forceinline__ bool last_of_group(int32_t *counter, int n_parts) {
    __shared__ int last;
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) {
        int prev = atomicAdd(counter, 1);
        last = prev == n_parts - 1;
        if (last) *counter = 0;
    }
    __syncthreads();
    if (last) __threadfence(); /* acquire: the other parts */
    return last;
}

/* The rotation table of RoPE at position pos: cs[i] = cos, cs[half + i] = sin of pos * inv_freq[i] for
 * i < half, the block's threads taking every blockDim.x-th i. In double, with the angle reduced to
 * [-pi, pi] first: sincos of a large double argument takes the slow reduction path (13 us for one
 * token on an H100); 2 pi in two parts keeps the reduced angle exact to ~1e-15. */
__device__ __forceinline__ void rope_table(int32_t pos, const float *inv_freq, int half, float *cs) {
    double p = (double)pos;
    for (int i = threadIdx.x; i < half; i += blockDim.x) {
        double x = p * (double)inv_freq[i], n = rint(x * 0.15915494309189535);
        x = fma(-n, 6.283185307179586, x);
        x = fma(-n, 2.4492935982947064e-16, x);
        double sn, c;
        sincos(x, &sn, &c);
        cs[i] = (float)c;
        cs[half + i] = (float)sn;
    }
}

} // namespace kvb

/* Runs the statement with T bound to the storage type of `dt`; an unknown dtype returns
 * cudaErrorInvalidValue from the enclosing launcher. */
#define KVB_CUDA_DISPATCH(dt, T, ...)                                                                  \
    switch (dt) {                                                                                      \
    case KVB_DTYPE_F32: {                                                                              \
        typedef float T;                                                                               \
        __VA_ARGS__;                                                                                   \
    } break;                                                                                           \
    case KVB_DTYPE_F16: {                                                                              \
        typedef __half T;                                                                              \
        __VA_ARGS__;                                                                                   \
    } break;                                                                                           \
    case KVB_DTYPE_BF16: {                                                                             \
        typedef __nv_bfloat16 T;                                                                       \
        __VA_ARGS__;                                                                                   \
    } break;                                                                                           \
    default: return (int)cudaErrorInvalidValue;                                                        \
    }

/* Launchers refuse the legacy default stream. */
#define KVB_CUDA_REQUIRE_STREAM(s)                                                                     \
    do {                                                                                               \
        if (!(s)) return (int)cudaErrorInvalidValue;                                                   \
    } while (0)

/* Grid size for a grid-stride loop over `n` items with `threads` per block (at most 8 blocks/SM worth
 * is plenty; capped so that the count fits in an int). */
static inline int kvb_cuda_grid(size_t n, int threads) {
    size_t b = (n + (size_t)threads - 1) / (size_t)threads;
    if (b < 1) b = 1;
    if (b > 65536) b = 65536;
    return (int)b;
}

#endif
