/* kvbank — CUDA elementwise ops: grid-stride loops over 16-byte vectors when every array is aligned
 * and n is a multiple of the vector, element by element otherwise. expf (not __expf) keeps the f32
 * results within rounding of the CPU twin. */
#include "kernels/cuda/common.cuh"
#include "kernels/cuda/elementwise.h"

namespace {

struct silu_mul_op {
    __device__ __forceinline__ float operator()(float g, float u) const { return g / (1.0f + expf(-g)) * u; }
};
struct add_op {
    __device__ __forceinline__ float operator()(float a, float b) const { return a + b; }
};

template <typename T, typename Op>
__global__ void binary_vec(const T *a, const T *b, T *out, size_t n_vec, Op op) {
    constexpr int V = kvb::VEC<T>;
    size_t stride = (size_t)gridDim.x * blockDim.x;
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n_vec; i += stride) {
        float x[V], y[V];
        kvb::load_vec(a + i * V, x);
        kvb::load_vec(b + i * V, y);
#pragma unroll
        for (int j = 0; j < V; j++) x[j] = op(x[j], y[j]);
        kvb::store_vec(out + i * V, x);
    }
}

template <typename T, typename Op> __global__ void binary_scalar(const T *a, const T *b, T *out, size_t n, Op op) {
    size_t stride = (size_t)gridDim.x * blockDim.x;
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride)
        out[i] = kvb::from_f<T>(op(kvb::to_f(a[i]), kvb::to_f(b[i])));
}

template <typename Op>
int launch_binary(const void *a, const void *b, void *out, kvb_dtype dt, size_t n, kvb_cuda_stream_t s, Op op) {
    KVB_CUDA_REQUIRE_STREAM(s);
    if (n == 0) return (int)cudaSuccess;
    const int threads = 256;
    int aligned = (((uintptr_t)a | (uintptr_t)b | (uintptr_t)out) & 15) == 0;
    KVB_CUDA_DISPATCH(dt, T, {
        size_t v = (size_t)kvb::VEC<T>;
        if (aligned && n % v == 0)
            binary_vec<T, Op><<<kvb_cuda_grid(n / v, threads), threads, 0, s>>>((const T *)a, (const T *)b, (T *)out,
                                                                               n / v, op);
        else
            binary_scalar<T, Op><<<kvb_cuda_grid(n, threads), threads, 0, s>>>((const T *)a, (const T *)b, (T *)out, n,
                                                                              op);
    });
    return (int)cudaGetLastError();
}

template <typename T> __global__ void bias_add_kernel(T *y, size_t n, int dim, const float *bias) {
    size_t stride = (size_t)gridDim.x * blockDim.x;
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride)
        y[i] = kvb::from_f<T>(kvb::to_f(y[i]) + bias[i % (size_t)dim]);
}

template <typename T> __global__ void swiglu_kernel(const T *gu, T *out, size_t n, int cols) {
    size_t stride = (size_t)gridDim.x * blockDim.x;
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
        size_t t = i / (size_t)cols, c = i % (size_t)cols;
        const T *row = gu + t * 2 * (size_t)cols;
        out[i] = kvb::from_f<T>(silu_mul_op()(kvb::to_f(row[c]), kvb::to_f(row[cols + c])));
    }
}

} // namespace

extern "C" int kvb_cuda_swiglu(const void *gu, void *out, kvb_dtype dt, int rows, int cols, kvb_cuda_stream_t s) {
    KVB_CUDA_REQUIRE_STREAM(s);
    if (rows <= 0 || cols <= 0) return (int)cudaSuccess;
    const int threads = 256;
    size_t n = (size_t)rows * (size_t)cols;
    KVB_CUDA_DISPATCH(dt, T, swiglu_kernel<T><<<kvb_cuda_grid(n, threads), threads, 0, s>>>((const T *)gu, (T *)out, n, cols));
    return (int)cudaGetLastError();
}

extern "C" int kvb_cuda_silu_mul(const void *gate, const void *up, void *out, kvb_dtype dt, size_t n,
                                 kvb_cuda_stream_t s) {
    return launch_binary(gate, up, out, dt, n, s, silu_mul_op());
}

extern "C" int kvb_cuda_add(const void *a, const void *b, void *out, kvb_dtype dt, size_t n, kvb_cuda_stream_t s) {
    return launch_binary(a, b, out, dt, n, s, add_op());
}

extern "C" int kvb_cuda_bias_add(void *y, kvb_dtype dt, int rows, int dim, const float *bias, kvb_cuda_stream_t s) {
    KVB_CUDA_REQUIRE_STREAM(s);
    if (rows <= 0 || dim <= 0) return (int)cudaSuccess;
    const int threads = 256;
    size_t n = (size_t)rows * (size_t)dim;
    KVB_CUDA_DISPATCH(dt, T, bias_add_kernel<T><<<kvb_cuda_grid(n, threads), threads, 0, s>>>((T *)y, n, dim, bias));
    return (int)cudaGetLastError();
}
