/* kvbank — CUDA matrix-vector products for decode (gemv.h).
 *
 * One warp per weight row: its lanes walk the row in 16-byte slots (VEC<T> elements), U slots in
 * flight per lane, each slot multiplied into the N activation rows' accumulators; a warp reduction
 * finishes the row. N is a template parameter (the accumulators live in registers). */
#include "kernels/cuda/common.cuh"
#include "kernels/cuda/gemv.h"

namespace {

constexpr int THREADS = 256;
constexpr int WARPS = THREADS / 32;
constexpr int U = 4;

template <typename T, int N>
__global__ void __launch_bounds__(THREADS)
    gemv_kernel(const T *__restrict__ w, const T *__restrict__ x, T *__restrict__ y, int rows, int cols, float beta) {
    constexpr int V = kvb::VEC<T>;
    const int lane = threadIdx.x & 31;
    const int r = blockIdx.x * WARPS + (threadIdx.x >> 5);
    if (r >= rows) return; /* warp-uniform */
    const int slots = cols / V;
    const uint4 *wr = reinterpret_cast<const uint4 *>(w + (size_t)r * cols);
    float acc[N];
#pragma unroll
    for (int t = 0; t < N; t++) acc[t] = 0.0f;
    for (int s0 = lane; s0 < slots; s0 += 32 * U) {
        uint4 wv[U];
#pragma unroll
        for (int u = 0; u < U; u++) {
            int s = s0 + u * 32;
            wv[u] = s < slots ? __ldcs(wr + s) : make_uint4(0, 0, 0, 0); /* streamed once: evict first */
        }
#pragma unroll
        for (int u = 0; u < U; u++) {
            int s = s0 + u * 32;
            if (s >= slots) break;
            float wf[V];
            kvb::unpack_vec<T>(wv[u], wf);
#pragma unroll
            for (int t = 0; t < N; t++) {
                float xf[V];
                kvb::load_vec(x + (size_t)t * cols + (size_t)s * V, xf);
#pragma unroll
                for (int j = 0; j < V; j++) acc[t] += wf[j] * xf[j];
            }
        }
    }
#pragma unroll
    for (int t = 0; t < N; t++) acc[t] = kvb::warp_sum(acc[t]);
    if (lane < N) {
        float v = acc[0];
#pragma unroll
        for (int t = 1; t < N; t++)
            if (lane == t) v = acc[t];
        T *yp = y + (size_t)lane * rows + r;
        *yp = kvb::from_f<T>(beta != 0.0f ? v + beta * kvb::to_f(*yp) : v);
    }
}

template <typename T, int N>
int launch(const void *w, const void *x, void *y, int rows, int cols, float beta, cudaStream_t s) {
    gemv_kernel<T, N><<<(rows + WARPS - 1) / WARPS, THREADS, 0, s>>>((const T *)w, (const T *)x, (T *)y, rows, cols,
                                                                     beta);
    return (int)cudaGetLastError();
}

} // namespace

extern "C" int kvb_cuda_gemv_fits(kvb_dtype dt, const void *w, const void *x, int cols, int n) {
    size_t es = kvb_dtype_size(dt);
    return es && n >= 1 && n <= KVB_CUDA_GEMV_MAX_ROWS && cols > 0 && ((size_t)cols * es) % 16 == 0 &&
           ((uintptr_t)w & 15) == 0 && ((uintptr_t)x & 15) == 0;
}

extern "C" int kvb_cuda_gemv(const void *w, const void *x, void *y, kvb_dtype dt, int rows, int cols, int n, float beta,
                             kvb_cuda_stream_t s) {
    KVB_CUDA_REQUIRE_STREAM(s);
    if (!kvb_cuda_gemv_fits(dt, w, x, cols, n) || rows <= 0) return (int)cudaErrorInvalidValue;
    KVB_CUDA_DISPATCH(dt, T, {
        switch (n) {
        case 1: return launch<T, 1>(w, x, y, rows, cols, beta, s);
        case 2: return launch<T, 2>(w, x, y, rows, cols, beta, s);
        case 3: return launch<T, 3>(w, x, y, rows, cols, beta, s);
        case 4: return launch<T, 4>(w, x, y, rows, cols, beta, s);
        case 5: return launch<T, 5>(w, x, y, rows, cols, beta, s);
        case 6: return launch<T, 6>(w, x, y, rows, cols, beta, s);
        case 7: return launch<T, 7>(w, x, y, rows, cols, beta, s);
        default: return launch<T, 8>(w, x, y, rows, cols, beta, s);
        }
    });
    return (int)cudaErrorInvalidValue;
}
