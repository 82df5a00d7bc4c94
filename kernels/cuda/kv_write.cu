/* kvbank — CUDA KV write. One block per token copies its K row and its V row (byte copies: the cache
 * and the activations share a dtype), as 16-byte vectors when the row size and addresses allow. */
#include "kernels/cuda/common.cuh"
#include "kernels/cuda/kv_write.h"

namespace {

__device__ __forceinline__ void copy_row(char *__restrict__ d, const char *__restrict__ s, size_t bytes, bool vec) {
    if (vec) {
        for (size_t i = threadIdx.x; i < bytes / 16; i += blockDim.x)
            reinterpret_cast<uint4 *>(d)[i] = reinterpret_cast<const uint4 *>(s)[i];
    } else {
        for (size_t i = threadIdx.x; i < bytes; i += blockDim.x) d[i] = s[i];
    }
}

__global__ void kv_write_kernel(void *const *__restrict__ blocks, const int64_t *__restrict__ slots, int block_size,
                                size_t row_bytes, const char *__restrict__ k, const char *__restrict__ v) {
    int t = blockIdx.x;
    int64_t slot = slots[t];
    if (slot < 0) return; /* a row the batch does not write */
    char *blk = (char *)blocks[slot / block_size];
    size_t off = (size_t)(slot % block_size) * row_bytes;
    char *dk = blk + off, *dv = blk + (size_t)block_size * row_bytes + off;
    const char *sk = k + (size_t)t * row_bytes, *sv = v + (size_t)t * row_bytes;
    bool vec = row_bytes % 16 == 0 && kvb::aligned16(blk) && kvb::aligned16(k) && kvb::aligned16(v);
    copy_row(dk, sk, row_bytes, vec);
    copy_row(dv, sv, row_bytes, vec);
}

} // namespace

extern "C" int kvb_cuda_kv_write(kvb_dtype dt, void *const *blocks, const int64_t *slots, int n_tokens, int block_size,
                                 int row_elems, const void *k, const void *v, kvb_cuda_stream_t s) {
    KVB_CUDA_REQUIRE_STREAM(s);
    if (n_tokens <= 0) return (int)cudaSuccess;
    if (block_size <= 0 || row_elems <= 0 || kvb_dtype_size(dt) == 0) return (int)cudaErrorInvalidValue;
    size_t row_bytes = (size_t)row_elems * kvb_dtype_size(dt);
    int threads = row_bytes / 16 >= 256 ? 256 : 128;
    kv_write_kernel<<<n_tokens, threads, 0, s>>>(blocks, slots, block_size, row_bytes, (const char *)k,
                                                 (const char *)v);
    return (int)cudaGetLastError();
}
