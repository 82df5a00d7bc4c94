/* kvbank — CUDA: bias, q/k norm, RoPE and the KV write after the stacked q/k/v product (qkv.h).
 *
 * A block per (token, group of HEADS heads): the token's cos/sin table goes to shared memory
 * (kvb::rope_table, as rope.cu), then each warp takes a head: its row
 * (plus bias) into shared memory as f32, the warp's sum of squares for the norm, and each lane writes
 * rotated pairs (i, i + half) to the head's destination. Nothing is rounded to the storage type between
 * the steps: the unfused kernels round after each. */
#include "kernels/cuda/common.cuh"
#include "kernels/cuda/qkv.h"

namespace {

constexpr int WARPS = 4, THREADS = 32 * WARPS, HEADS = 8;
constexpr int MAX_HD = 256;

template <typename T>
__global__ void __launch_bounds__(THREADS)
    qkv_kernel(const T *__restrict__ qkv, int n_heads, int n_kv_heads, int hd, int groups, const float *__restrict__ bias,
               const float *__restrict__ q_norm, const float *__restrict__ k_norm, float eps,
               const int32_t *__restrict__ pos, const float *__restrict__ inv_freq, T *__restrict__ q_out,
               void *const *__restrict__ blocks, const int64_t *__restrict__ slots, int block_size) {
    __shared__ float cs[MAX_HD];             /* [half] cos, then [half] sin */
    __shared__ float row[WARPS][MAX_HD];     /* each warp's head, f32 */
    const int t = blockIdx.x / groups, group = blockIdx.x % groups, half = hd / 2;
    const int lane = threadIdx.x & 31, w = threadIdx.x >> 5;
    const int heads = n_heads + 2 * n_kv_heads;
    kvb::rope_table(pos[t], inv_freq, half, cs);
    __syncthreads();
    const int64_t slot = slots[t];
    const size_t kv_row = (size_t)n_kv_heads * hd;
    for (int h = group * HEADS + w; h < min(heads, (group + 1) * HEADS); h += WARPS) {
        const T *src = qkv + ((size_t)t * heads + h) * hd;
        float ss = 0.0f;
        for (int d = lane; d < hd; d += 32) {
            float v = kvb::to_f(src[d]);
            if (bias) v += bias[(size_t)h * hd + d];
            row[w][d] = v;
            ss += v * v;
        }
        const bool is_q = h < n_heads, is_v = h >= n_heads + n_kv_heads;
        const float *nw = is_q ? q_norm : is_v ? NULL : k_norm;
        float scale = 1.0f;
        if (nw) scale = rsqrtf(kvb::warp_sum(ss) / (float)hd + eps);
        __syncwarp();
        T *dst;
        if (is_q) {
            dst = q_out + ((size_t)t * n_heads + h) * hd;
        } else {
            if (slot < 0) {
                __syncwarp(); /* the row is rewritten by the next head */
                continue;
            }
            char *blk = (char *)blocks[slot / block_size];
            int kvh = h - n_heads - (is_v ? n_kv_heads : 0);
            dst = (T *)blk + (size_t)(is_v ? block_size : 0) * kv_row + (size_t)(slot % block_size) * kv_row +
                  (size_t)kvh * hd;
        }
        if (is_v) {
            for (int d = lane; d < hd; d += 32) dst[d] = kvb::from_f<T>(row[w][d]);
        } else {
            for (int i = lane; i < half; i += 32) {
                float a = row[w][i], b = row[w][i + half];
                if (nw) {
                    a *= scale * nw[i];
                    b *= scale * nw[i + half];
                }
                float c = cs[i], sn = cs[half + i];
                dst[i] = kvb::from_f<T>(a * c - b * sn);
                dst[i + half] = kvb::from_f<T>(b * c + a * sn);
            }
        }
        __syncwarp(); /* every lane has read the row before the next head overwrites it */
    }
}

} // namespace

extern "C" int kvb_cuda_qkv_rope_write(kvb_dtype dt, const void *qkv, int n, int n_heads, int n_kv_heads, int head_dim,
                                       const float *bias, const float *q_norm, const float *k_norm, float eps,
                                       const int32_t *pos, const float *inv_freq, void *q_out, void *const *blocks,
                                       const int64_t *slots, int block_size, kvb_cuda_stream_t s) {
    KVB_CUDA_REQUIRE_STREAM(s);
    if (n <= 0) return (int)cudaSuccess;
    if (head_dim <= 0 || head_dim % 2 || head_dim > MAX_HD || n_heads <= 0 || n_kv_heads <= 0 || block_size <= 0)
        return (int)cudaErrorInvalidValue;
    int groups = (n_heads + 2 * n_kv_heads + HEADS - 1) / HEADS;
    KVB_CUDA_DISPATCH(dt, T,
                      qkv_kernel<T><<<n * groups, THREADS, 0, s>>>((const T *)qkv, n_heads, n_kv_heads, head_dim, groups,
                                                                   bias, q_norm, k_norm, eps, pos, inv_freq, (T *)q_out,
                                                                   blocks, slots, block_size));
    return (int)cudaGetLastError();
}
