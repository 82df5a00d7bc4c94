/* kvbank — CUDA element conversion and random fill. Memory-bound grid-stride loops. */
#include "kernels/cuda/common.cuh"
#include "kernels/cuda/convert.h"

namespace {

template <typename S, typename D> __global__ void convert_kernel(const S *__restrict__ src, D *__restrict__ dst, size_t n) {
    size_t stride = (size_t)gridDim.x * blockDim.x;
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride)
        dst[i] = kvb::from_f<D>(kvb::to_f(src[i]));
}

__device__ __forceinline__ uint64_t mix64(uint64_t z) {
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

template <typename T> __global__ void fill_kernel(T *__restrict__ dst, size_t n, uint64_t seed, float lo, float span) {
    size_t stride = (size_t)gridDim.x * blockDim.x;
    uint64_t key = mix64(seed + 0x9e3779b97f4a7c15ull);
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
        float u = (float)(mix64(key ^ (i * 0x9e3779b97f4a7c15ull + 1)) >> 40) * (1.0f / 16777216.0f);
        dst[i] = kvb::from_f<T>(lo + span * u);
    }
}

} // namespace

extern "C" int kvb_cuda_convert(const void *src, kvb_dtype sdt, void *dst, kvb_dtype ddt, size_t n,
                                kvb_cuda_stream_t s) {
    KVB_CUDA_REQUIRE_STREAM(s);
    if (n == 0) return (int)cudaSuccess;
    const int threads = 256;
    int grid = kvb_cuda_grid(n, threads);
    KVB_CUDA_DISPATCH(sdt, S, KVB_CUDA_DISPATCH(ddt, D, convert_kernel<S, D><<<grid, threads, 0, s>>>(
                                                             (const S *)src, (D *)dst, n)));
    return (int)cudaGetLastError();
}

extern "C" int kvb_cuda_fill_uniform(void *dst, kvb_dtype dt, size_t n, uint64_t seed, float lo, float hi,
                                     kvb_cuda_stream_t s) {
    KVB_CUDA_REQUIRE_STREAM(s);
    if (n == 0) return (int)cudaSuccess;
    const int threads = 256;
    int grid = kvb_cuda_grid(n, threads);
    KVB_CUDA_DISPATCH(dt, T, fill_kernel<T><<<grid, threads, 0, s>>>((T *)dst, n, seed, lo, hi - lo));
    return (int)cudaGetLastError();
}
