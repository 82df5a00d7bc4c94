/* kvbank — CUDA RoPE. A block per (token, group of HEADS_PER_BLOCK heads of q then k): the token's cos/sin
 * table (head_dim/2 pairs, computed in double precision) goes to shared memory, then the block rotates
 * its heads. One block per token left a decode step's single token to one multiprocessor, 13.8 us on
 * an H100 (ncu), a latency chain of 20 dependent load-rotate-store rounds per thread. */
#include "kernels/cuda/common.cuh"
#include "kernels/cuda/rope.h"

namespace {

constexpr int THREADS = 128;
constexpr int HEADS_PER_BLOCK = 4;

template <typename T>
__global__ void rope_kernel(T *q, int n_heads, T *k, int n_kv_heads, int hd, int groups, const int32_t *__restrict__ pos,
                            const float *__restrict__ inv_freq) {
    extern __shared__ float cs[]; /* [half] cos, then [half] sin */
    int t = blockIdx.x / groups, group = blockIdx.x % groups, half = hd / 2;
    kvb::rope_table(pos[t], inv_freq, half, cs);
    __syncthreads();
    int pairs_q = n_heads * half, pairs = (n_heads + n_kv_heads) * half;
    int j_end = min(pairs, (group + 1) * HEADS_PER_BLOCK * half);
    for (int j = group * HEADS_PER_BLOCK * half + threadIdx.x; j < j_end; j += blockDim.x) {
        T *v;
        int i;
        if (j < pairs_q) {
            v = q + ((size_t)t * n_heads + j / half) * hd;
            i = j % half;
        } else {
            int jk = j - pairs_q;
            v = k + ((size_t)t * n_kv_heads + jk / half) * hd;
            i = jk % half;
        }
        float a = kvb::to_f(v[i]), b = kvb::to_f(v[i + half]), c = cs[i], sn = cs[half + i];
        v[i] = kvb::from_f<T>(a * c - b * sn);
        v[i + half] = kvb::from_f<T>(b * c + a * sn);
    }
}

} // namespace

extern "C" int kvb_cuda_rope(void *q, int n_heads, void *k, int n_kv_heads, kvb_dtype dt, int n, int head_dim,
                             const int32_t *pos, const float *inv_freq, kvb_cuda_stream_t s) {
    KVB_CUDA_REQUIRE_STREAM(s);
    if (head_dim <= 0 || head_dim % 2) return (int)cudaErrorInvalidValue;
    if (!k) n_kv_heads = 0;
    if (n <= 0 || n_heads + n_kv_heads <= 0) return (int)cudaSuccess;
    size_t smem = (size_t)head_dim * sizeof(float);
    int groups = (n_heads + n_kv_heads + HEADS_PER_BLOCK - 1) / HEADS_PER_BLOCK;
    KVB_CUDA_DISPATCH(dt, T, rope_kernel<T><<<n * groups, THREADS, smem, s>>>((T *)q, n_heads, (T *)k, n_kv_heads,
                                                                            head_dim, groups, pos, inv_freq));
    return (int)cudaGetLastError();
}
