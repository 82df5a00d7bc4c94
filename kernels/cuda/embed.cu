/* kvbank — CUDA row gather. One block per output row; rows of the same dtype move as 16-byte vectors. */
#include "kernels/cuda/common.cuh"
#include "kernels/cuda/embed.h"

namespace {

/* Same dtype: a row is a byte copy. `vec` = 1 when every row starts 16-byte aligned and row_bytes % 16 == 0. */
__global__ void gather_bytes(const char *__restrict__ src, const int32_t *__restrict__ ids, size_t row_bytes,
                             char *__restrict__ dst, int vec) {
    const char *s = src + (size_t)ids[blockIdx.x] * row_bytes;
    char *d = dst + (size_t)blockIdx.x * row_bytes;
    if (vec) {
        const uint4 *s4 = reinterpret_cast<const uint4 *>(s);
        uint4 *d4 = reinterpret_cast<uint4 *>(d);
        for (size_t i = threadIdx.x; i < row_bytes / 16; i += blockDim.x) d4[i] = s4[i];
    } else {
        for (size_t i = threadIdx.x; i < row_bytes; i += blockDim.x) d[i] = s[i];
    }
}

template <typename S, typename D>
__global__ void gather_convert(const S *__restrict__ src, const int32_t *__restrict__ ids, int dim, D *__restrict__ dst) {
    const S *s = src + (size_t)ids[blockIdx.x] * dim;
    D *d = dst + (size_t)blockIdx.x * dim;
    for (int i = threadIdx.x; i < dim; i += blockDim.x) d[i] = kvb::from_f<D>(kvb::to_f(s[i]));
}

} // namespace

extern "C" int kvb_cuda_gather_rows(const void *src, kvb_dtype sdt, const int32_t *ids, int n, int dim, void *dst,
                                    kvb_dtype ddt, kvb_cuda_stream_t s) {
    KVB_CUDA_REQUIRE_STREAM(s);
    if (n <= 0 || dim <= 0) return (int)cudaSuccess;
    if (n > 0x7fffffff) return (int)cudaErrorInvalidValue;
    const int threads = 256;
    if (sdt == ddt) {
        size_t row_bytes = (size_t)dim * kvb_dtype_size(sdt);
        int vec = row_bytes % 16 == 0 && ((uintptr_t)src & 15) == 0 && ((uintptr_t)dst & 15) == 0;
        gather_bytes<<<n, threads, 0, s>>>((const char *)src, ids, row_bytes, (char *)dst, vec);
        return (int)cudaGetLastError();
    }
    KVB_CUDA_DISPATCH(sdt, S, KVB_CUDA_DISPATCH(ddt, D, gather_convert<S, D><<<n, threads, 0, s>>>(
                                                             (const S *)src, ids, dim, (D *)dst)));
    return (int)cudaGetLastError();
}
