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
 * which block merges. A warp a row: its lanes compute the weights 2^(lse - M) of 32 splits at a time,
 * each once, and pass them round while every lane sums its dimensions (a weight per output element
 * recomputed them head_dim times: 64 splits at batch 1 x 8K keys, head 128). Uses the whole block. */
template <typename T>
__device__ void merge_split(const kvb_cuda_attn_args &a, const kvb_attn_seq &sq, int kvh, int t0, int h0, int nh,
                            int rows, int group, int stride) {
    constexpr int SLOTS = KVB_CUDA_ATTN_MAX_HEAD_DIM / 32; /* a lane's dimensions: lane, lane + 32, ... */
    const kvb_cuda_attn_group g = a.groups[group];
    const int hd = a.head_dim, gq = a.n_heads / a.n_kv_heads;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, n_warps = blockDim.x >> 5;
    const float *lse = a.part_lse + g.prow;
    for (int r = warp; r < rows; r += n_warps) {
        int t = t0 + r / nh, hh = h0 + r % nh;
        if (t >= sq.q_len || hh >= gq) continue;
        float M = -INFINITY, den = 0.0f;
        for (int p = lane; p < g.n_parts; p += 32) M = fmaxf(M, __ldcg(lse + (size_t)p * stride + r));
        M = warp_max(M);
        if (M != -INFINITY)
            for (int p = lane; p < g.n_parts; p += 32) {
                float x = __ldcg(lse + (size_t)p * stride + r);
                if (x != -INFINITY) den += exp2f(x - M);
            }
        den = warp_sum(den);
        float num[SLOTS];
#pragma unroll
        for (int j = 0; j < SLOTS; j++) num[j] = 0.0f;
        if (M != -INFINITY)
            for (int p0 = 0; p0 < g.n_parts; p0 += 32) {
                float x = p0 + lane < g.n_parts ? __ldcg(lse + (size_t)(p0 + lane) * stride + r) : -INFINITY;
                float w = x != -INFINITY ? exp2f(x - M) : 0.0f;
                int n = min(32, g.n_parts - p0);
                for (int q = 0; q < n; q++) {
                    float xq = __shfl_sync(0xffffffffu, x, q), wq = __shfl_sync(0xffffffffu, w, q);
                    if (xq == -INFINITY) continue;
                    const float *o = a.part_o + ((size_t)g.prow + (size_t)(p0 + q) * stride + r) * hd;
#pragma unroll
                    for (int j = 0; j < SLOTS; j++)
                        if (lane + 32 * j < hd) num[j] += wq * __ldcg(o + lane + 32 * j);
                }
            }
        T *out = (T *)a.out + ((size_t)(sq.q_start + t) * a.n_heads + (size_t)kvh * gq + hh) * hd;
#pragma unroll
        for (int j = 0; j < SLOTS; j++)
            if (lane + 32 * j < hd) out[lane + 32 * j] = from_f<T>(den > 0.0f ? num[j] / den : 0.0f);
    }
}

/* The tensor-core prefill (attention_tc.cu): runs the items when the batch's dtype and head size
 * have it (kvb_cuda_attention_prefill_tc), else returns -1 and launches nothing. */
int prefill_tc(const kvb_cuda_attn_args &a, const kvb_cuda_attn_prefill_item *items, int n_items, cudaStream_t s);

} // namespace attn
} // namespace kvb

#endif
