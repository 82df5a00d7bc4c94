/* kvbank — what the attention kernels of attention.cu (decode, the f32 prefill) and attention_tc.cu
 * (the tensor-core prefill) share: block addressing, the split merge, and the tensor-core launcher
 * (C++ only, see attention.h). */
#ifndef KVB_KERNELS_CUDA_ATTENTION_IMPL_CUH
#define KVB_KERNELS_CUDA_ATTENTION_IMPL_CUH

#include <math.h>

#include "kernels/cuda/attention.h"
#include "kernels/cuda/common.cuh"

namespace kvb {
namespace attn {

constexpr float LOG2E = 1.4426950408889634f;
constexpr int DR = KVB_CUDA_ATTN_DECODE_ROWS;

/* The K row of key `key` of a sequence for KV head `kvh` (its V row is block_size rows further). */
template <typename T>
__device__ __forceinline__ const T *key_row(const kvb_cuda_attn_args &a, int blk_first, int key, int kvh,
                                            size_t row_elems) {
    const T *blk = (const T *)a.blocks[blk_first + key / a.block_size];
    return blk + (size_t)(key % a.block_size) * row_elems + (size_t)kvh * a.head_dim;
}

/* Called by every thread of a block that has written its split's partial rows (part_o, part_lse):
 * true in the block that finished its group last, which then merges (merge_split). */
__device__ __forceinline__ bool split_done(const kvb_cuda_attn_args &a, int group) {
    return last_of_group(&a.counters[group], a.groups[group].n_parts);
}

/* Merges the splits of `group` (partial rows of `stride`, `rows` of them used) into `out`: row r is
 * token t0 + r / nh, head h0 + r % nh of KV group kvh (rows past the sequence or the group's heads are
 * skipped). Every weight and sum runs over the splits in their order, so the bits do not depend on
 * which block merges. Uses the whole block. */
template <typename T>
__device__ void merge_split(const kvb_cuda_attn_args &a, const kvb_attn_seq &sq, int kvh, int t0, int h0, int nh,
                            int rows, int group, int stride) {
    __shared__ float M_s[KVB_CUDA_ATTN_PREFILL_ROWS_MAX], den_s[KVB_CUDA_ATTN_PREFILL_ROWS_MAX];
    const kvb_cuda_attn_group g = a.groups[group];
    const int hd = a.head_dim, gq = a.n_heads / a.n_kv_heads;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, n_warps = blockDim.x >> 5;
    const float *lse = a.part_lse + g.prow;
    for (int r = warp; r < rows; r += n_warps) {
        float M = -INFINITY, den = 0.0f;
        for (int p = lane; p < g.n_parts; p += 32) M = fmaxf(M, __ldcg(lse + (size_t)p * stride + r));
        M = warp_max(M);
        if (M != -INFINITY)
            for (int p = lane; p < g.n_parts; p += 32) {
                float x = __ldcg(lse + (size_t)p * stride + r);
                if (x != -INFINITY) den += exp2f(x - M);
            }
        den = warp_sum(den);
        if (lane == 0) {
            M_s[r] = M;
            den_s[r] = den;
        }
    }
    __syncthreads();
    for (int i = threadIdx.x; i < rows * hd; i += blockDim.x) {
        int r = i / hd, d = i % hd, t = t0 + r / nh, hh = h0 + r % nh;
        if (t >= sq.q_len || hh >= gq) continue;
        float M = M_s[r], den = den_s[r], num = 0.0f;
        if (M != -INFINITY) {
#pragma unroll 4
            for (int p = 0; p < g.n_parts; p++) {
                float x = __ldcg(lse + (size_t)p * stride + r);
                if (x != -INFINITY) num += exp2f(x - M) * __ldcg(a.part_o + ((size_t)g.prow + (size_t)p * stride + r) * hd + d);
            }
        }
        ((T *)a.out)[((size_t)(sq.q_start + t) * a.n_heads + (size_t)kvh * gq + hh) * hd + d] =
            from_f<T>(den > 0.0f ? num / den : 0.0f);
    }
}

/* The tensor-core prefill (attention_tc.cu): runs the items when the batch's dtype and head size
 * have it (kvb_cuda_attention_prefill_tc), else returns -1 and launches nothing. */
int prefill_tc(const kvb_cuda_attn_args &a, const kvb_cuda_attn_prefill_item *items, int n_items, cudaStream_t s);

} // namespace attn
} // namespace kvb

#endif
