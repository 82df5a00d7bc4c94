/* kvbank — CUDA block movers. One kernel for the three forms: a chunk's source and destination come
 * either from an address array or from a packed base. Each CUDA block moves one piece of up to
 * PIECE bytes of one chunk, so a few large blocks and many small ones both fill the GPU. */
#include "kernels/cuda/blocks.h"
#include "kernels/cuda/common.cuh"

namespace {

constexpr int THREADS = 256;
constexpr size_t PIECE = (size_t)THREADS * 16 * 8; /* 32 KiB: 8 vectors per thread */

__global__ void move_kernel(const void *const *__restrict__ src, const char *src_base, void *const *__restrict__ dst,
                            char *dst_base, size_t bytes, int pieces) {
    int chunk = blockIdx.x / pieces, piece = blockIdx.x % pieces;
    const char *s = src ? (const char *)src[chunk] : src_base + (size_t)chunk * bytes;
    char *d = dst ? (char *)dst[chunk] : dst_base + (size_t)chunk * bytes;
    size_t lo = (size_t)piece * PIECE, hi = lo + PIECE < bytes ? lo + PIECE : bytes;
    if (bytes % 16 == 0 && kvb::aligned16(s) && kvb::aligned16(d)) {
        const uint4 *s4 = reinterpret_cast<const uint4 *>(s);
        uint4 *d4 = reinterpret_cast<uint4 *>(d);
        size_t i = lo / 16 + threadIdx.x, end = hi / 16;
        /* several independent loads in flight before the stores */
        for (; i + 3 * THREADS < end; i += 4 * THREADS) {
            uint4 a = s4[i], b = s4[i + THREADS], c = s4[i + 2 * THREADS], e = s4[i + 3 * THREADS];
            d4[i] = a;
            d4[i + THREADS] = b;
            d4[i + 2 * THREADS] = c;
            d4[i + 3 * THREADS] = e;
        }
        for (; i < end; i += THREADS) d4[i] = s4[i];
    } else {
        for (size_t i = lo + threadIdx.x; i < hi; i += THREADS) d[i] = s[i];
    }
}

int launch(const void *const *src, const void *src_base, void *const *dst, void *dst_base, int n, size_t bytes,
           cudaStream_t s) {
    KVB_CUDA_REQUIRE_STREAM(s);
    if (n <= 0 || bytes == 0) return (int)cudaSuccess;
    size_t pieces = (bytes + PIECE - 1) / PIECE;
    if (pieces * (size_t)n > 0x7fffffffu) return (int)cudaErrorInvalidValue;
    move_kernel<<<(unsigned)(pieces * (size_t)n), THREADS, 0, s>>>(src, (const char *)src_base, dst, (char *)dst_base,
                                                                   bytes, (int)pieces);
    return (int)cudaGetLastError();
}

} // namespace

extern "C" int kvb_cuda_blocks_copy(const void *const *src, void *const *dst, int n, size_t bytes, kvb_cuda_stream_t s) {
    if (!src || !dst) return (int)cudaErrorInvalidValue;
    return launch(src, NULL, dst, NULL, n, bytes, s);
}

extern "C" int kvb_cuda_blocks_gather(const void *const *src, void *dst_base, int n, size_t bytes,
                                      kvb_cuda_stream_t s) {
    if (!src || !dst_base) return (int)cudaErrorInvalidValue;
    return launch(src, NULL, NULL, dst_base, n, bytes, s);
}

extern "C" int kvb_cuda_blocks_scatter(const void *src_base, void *const *dst, int n, size_t bytes,
                                       kvb_cuda_stream_t s) {
    if (!src_base || !dst) return (int)cudaErrorInvalidValue;
    return launch(NULL, src_base, dst, NULL, n, bytes, s);
}
