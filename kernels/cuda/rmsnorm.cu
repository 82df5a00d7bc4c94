/* kvbank — CUDA RMSNorm. Short rows (dim < 1024, e.g. per-head norms) take one warp each, four rows per
 * block; long rows (hidden sizes) one block of 256 threads each. Both read x twice (the second time
 * from cache) and write y; a thread rewrites only the elements it read, so x and y may alias. */
#include "kernels/cuda/common.cuh"
#include "kernels/cuda/rmsnorm.h"

namespace {

constexpr int WARP_ROWS = 4;   /* rows per block of the warp kernel */
constexpr int LONG_THREADS = 256;
constexpr int LONG_DIM = 1024; /* from here on a row gets a whole block */

/* The sum of squares of row `xr` over the elements [first, dim) taken `step` at a time. */
template <typename T, bool V>
__device__ __forceinline__ float row_ss(const T *xr, int dim, int first, int step) {
    float ss = 0.0f;
    if (V) {
        constexpr int N = kvb::VEC<T>;
        for (int i = first * N; i < dim; i += step * N) {
            float f[N];
            kvb::load_vec(xr + i, f);
#pragma unroll
            for (int j = 0; j < N; j++) ss += f[j] * f[j];
        }
    } else {
        for (int i = first; i < dim; i += step) {
            float f = kvb::to_f(xr[i]);
            ss += f * f;
        }
    }
    return ss;
}

template <typename T, bool V>
__device__ __forceinline__ void row_scale(const T *xr, T *yr, const float *__restrict__ w, int dim, int first, int step,
                                          float inv) {
    if (V) {
        constexpr int N = kvb::VEC<T>;
        for (int i = first * N; i < dim; i += step * N) {
            float f[N];
            kvb::load_vec(xr + i, f);
#pragma unroll
            for (int j = 0; j < N; j++) f[j] = f[j] * inv * w[i + j];
            kvb::store_vec(yr + i, f);
        }
    } else {
        for (int i = first; i < dim; i += step) yr[i] = kvb::from_f<T>(kvb::to_f(xr[i]) * inv * w[i]);
    }
}

template <typename T, bool V>
__global__ void rmsnorm_warp(const T *x, T *y, int rows, int dim, const float *__restrict__ w, float eps) {
    int r = blockIdx.x * WARP_ROWS + (threadIdx.x >> 5), lane = threadIdx.x & 31;
    if (r >= rows) return;
    const T *xr = x + (size_t)r * dim;
    T *yr = y + (size_t)r * dim;
    float ss = kvb::warp_sum(row_ss<T, V>(xr, dim, lane, 32));
    float inv = rsqrtf(ss / (float)dim + eps);
    row_scale<T, V>(xr, yr, w, dim, lane, 32, inv);
}

template <typename T, bool V>
__global__ void rmsnorm_block(const T *x, T *y, int dim, const float *__restrict__ w, float eps) {
    __shared__ float red[32];
    const T *xr = x + (size_t)blockIdx.x * dim;
    T *yr = y + (size_t)blockIdx.x * dim;
    float ss = kvb::block_sum(row_ss<T, V>(xr, dim, threadIdx.x, blockDim.x), red);
    float inv = rsqrtf(ss / (float)dim + eps);
    row_scale<T, V>(xr, yr, w, dim, threadIdx.x, blockDim.x, inv);
}

template <typename T>
void launch(const T *x, T *y, int rows, int dim, const float *w, float eps, cudaStream_t s) {
    bool v = dim % kvb::VEC<T> == 0 && (((uintptr_t)x | (uintptr_t)y) & 15) == 0;
    if (dim < LONG_DIM) {
        int grid = (rows + WARP_ROWS - 1) / WARP_ROWS;
        if (v) rmsnorm_warp<T, true><<<grid, 32 * WARP_ROWS, 0, s>>>(x, y, rows, dim, w, eps);
        else rmsnorm_warp<T, false><<<grid, 32 * WARP_ROWS, 0, s>>>(x, y, rows, dim, w, eps);
    } else {
        if (v) rmsnorm_block<T, true><<<rows, LONG_THREADS, 0, s>>>(x, y, dim, w, eps);
        else rmsnorm_block<T, false><<<rows, LONG_THREADS, 0, s>>>(x, y, dim, w, eps);
    }
}

} // namespace

extern "C" int kvb_cuda_rmsnorm(const void *x, void *y, kvb_dtype dt, int rows, int dim, const float *w, float eps,
                                kvb_cuda_stream_t s) {
    KVB_CUDA_REQUIRE_STREAM(s);
    if (rows <= 0 || dim <= 0) return (int)cudaSuccess;
    KVB_CUDA_DISPATCH(dt, T, launch<T>((const T *)x, (T *)y, rows, dim, w, eps, s));
    return (int)cudaGetLastError();
}
