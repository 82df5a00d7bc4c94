/* kvbank — the prefill attention on tensor cores, FlashAttention-2 style (Dao, "FlashAttention-2",
 * 2023, §3.1 algorithm 1 and §3.3 work partitioning: a block owns a tile of query rows, its warps split
 * the rows, not the keys, so no warp waits for another's partial softmax).
 *
 * A CUDA block of 4 warps takes one prefill item (attention.h): 64 query rows (tokens x heads of one KV
 * group, so a K/V tile serves every head of the group), 16 per warp, over the keys [k_begin, k_end).
 *  - The Q tile is copied to shared memory by cp.async and held in registers as mma A fragments for
 *    the whole key walk (head sizes up to 128; at 256 it is re-read from shared memory per tile).
 *  - K/V tiles of BC keys (64; 32 at head size 256) are double-buffered in shared memory: tile i + 1 is
 *    in flight (cp.async, one commit group per tile) while tile i is computed. Each key's row comes
 *    through the block-address array, so a tile may span blocks that live anywhere (local pool, a
 *    lender's region, stage buffers); keys past the range and dims past head_dim are zero-filled by
 *    cp.async's src-size, never read.
 *  - S = Q K^T: mma.m16n8k16 per (16-dim step, 8-key tile), K fragments by ldmatrix.x4 (two key tiles
 *    each); the scores are scaled by scale * log2(e) in f32, masked (causal to the end of the
 *    sequence, the sliding window, the range's end) only on tiles that cross a boundary.
 *  - Online softmax in f32 on the accumulator fragments: the row max over the 4 lanes of a quad by
 *    shuffles, exp2 of the shifted scores, the running row sum kept per lane and reduced at the end.
 *  - O += P V: the probabilities go from the S accumulators to A fragments in registers (bf16/f16),
 *    V fragments by ldmatrix.x4.trans; O stays in f32 registers (16 rows x head size per warp).
 * Rows of shared memory are padded by 16 bytes so that the 8 rows an ldmatrix reads fall in distinct
 * banks. An item with part >= 0 is one split of a tile's keys: it writes its normalised rows and their
 * log-sum-exp, and the group's last split merges them (attention_impl.cuh). */
#include "kernels/cuda/attention_impl.cuh"
#include "kernels/cuda/mma.cuh"

namespace {

using kvb::attn::key_row;
using kvb::attn::LOG2E;
using kvb::attn::PM;

constexpr int WARPS = 4, THREADS = 32 * WARPS;
static_assert(PM == 16 * WARPS, "a warp takes 16 rows of the tile");

template <int HD> struct tc_cfg {
    static constexpr int BC = HD <= 128 ? 64 : 32; /* keys per tile */
    static constexpr bool QREG = HD <= 128;        /* Q fragments in registers for the whole walk */
    static constexpr int LD = HD + 8;              /* shared-memory row stride, elements */
    static constexpr size_t SMEM = 2 * ((size_t)PM * LD + 4 * (size_t)BC * LD); /* Q, K[2], V[2] (16-bit) */
};

/* 2^x; -inf gives 0. */
__device__ __forceinline__ float ex2(float x) {
#ifdef KVB_CUDA_EMU
    return exp2f(x);
#else
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
#endif
}

template <typename T, int HD>
__global__ void __launch_bounds__(THREADS)
    prefill_tc_kernel(const kvb_cuda_attn_args a, const kvb_cuda_attn_prefill_item *__restrict__ items) {
    using C = tc_cfg<HD>;
    constexpr int BC = C::BC, LD = C::LD;
    constexpr int KS = HD / 16;  /* 16-dim steps of QK^T */
    constexpr int NT = BC / 8;   /* 8-key tiles of S */
    constexpr int ND = HD / 8;   /* 8-dim tiles of O */
    constexpr int KV = BC / 16;  /* 16-key steps of PV */
    constexpr int CH = HD / 8;   /* 16-byte chunks per row */
    static_assert(NT % 2 == 0 && ND % 2 == 0, "ldmatrix.x4 loads two 8-wide tiles");
    extern __shared__ float4 smem4[];
    T *Qs = reinterpret_cast<T *>(smem4); /* [PM][LD] */
    T *Ks = Qs + PM * LD;                 /* [2][BC][LD] */
    T *Vs = Ks + 2 * BC * LD;             /* [2][BC][LD] */

    const kvb_cuda_attn_prefill_item it = items[blockIdx.x];
    const kvb_attn_seq sq = a.seqs[it.seq];
    const int hd = a.head_dim, gq = a.n_heads / a.n_kv_heads;
    const int nh = min(gq, PM), TT = PM / nh, past = sq.ctx_len - sq.q_len;
    const size_t row_elems = (size_t)a.n_kv_heads * hd, v_off = (size_t)a.block_size * row_elems;
    const int tid = threadIdx.x, lane = tid & 31, w = tid >> 5, g = lane >> 2, t = lane & 3;
    const float qscale = a.scale * LOG2E;

    /* the keys the tile sees: up to its last token, from its first token's window */
    const int t_last = min(it.t0 + TT, sq.q_len) - 1;
    const int kmax = past + t_last + 1;
    const int kmin = a.window > 0 && past + it.t0 + 1 > a.window ? past + it.t0 + 1 - a.window : 0;
    const int k_begin = it.k_end > 0 ? it.k_begin : kmin, k_end = it.k_end > 0 ? it.k_end : kmax;
    /* keys every valid row sees (no mask needed below it) and the last row's window start */
    const int min_nvis = past + it.t0 + 1;
    const int max_lo = a.window > 0 && kmax > a.window ? kmax - a.window : 0;

    /* this lane's two rows (g and g + 8 of the warp's 16): keys [lo, nvis) visible, nvis 0: no row */
    int nvis[2], lo[2];
#pragma unroll
    for (int i = 0; i < 2; i++) {
        int r = 16 * w + g + 8 * i, tt = it.t0 + r / nh, hh = it.h0 + r % nh;
        nvis[i] = (r < TT * nh && tt < sq.q_len && hh < gq) ? past + tt + 1 : 0;
        lo[i] = a.window > 0 && nvis[i] > a.window ? nvis[i] - a.window : 0;
    }

    const T *q = (const T *)a.q;
    for (int c = tid; c < PM * CH; c += THREADS) {
        int r = c / CH, ch = c % CH, tt = it.t0 + r / nh, hh = it.h0 + r % nh;
        bool ok = r < TT * nh && tt < sq.q_len && hh < gq && ch * 8 < hd;
        const T *src = ok ? q + ((size_t)(sq.q_start + tt) * a.n_heads + (size_t)it.kvh * gq + hh) * hd + ch * 8 : q;
        kvb::cp_async16(&Qs[r * LD + ch * 8], src, ok ? 16 : 0);
    }
    kvb::cp_async_commit();
    const T *blk0 = (const T *)a.blocks[sq.blk_first]; /* a valid address for the zero-filled slots */
    auto load_kv = [&](int k0, int buf) {
        for (int c = tid; c < BC * CH; c += THREADS) {
            int kk = c / CH, ch = c % CH, key = k0 + kk;
            bool ok = key < k_end && ch * 8 < hd;
            const T *kr = ok ? key_row<T>(a, sq.blk_first, key, it.kvh, row_elems) + ch * 8 : blk0;
            kvb::cp_async16(&Ks[(buf * BC + kk) * LD + ch * 8], kr, ok ? 16 : 0);
            kvb::cp_async16(&Vs[(buf * BC + kk) * LD + ch * 8], ok ? kr + v_off : blk0, ok ? 16 : 0);
        }
        kvb::cp_async_commit();
    };

    float o[ND][4];
#pragma unroll
    for (int d = 0; d < ND; d++) o[d][0] = o[d][1] = o[d][2] = o[d][3] = 0.0f;
    float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.0f, 0.0f};
    uint32_t qf[C::QREG ? KS : 1][4];

    const int n_tiles = k_end > k_begin ? (k_end - k_begin + BC - 1) / BC : 0;
    if (n_tiles > 0) load_kv(k_begin, 0);
    for (int i = 0; i < n_tiles; i++) {
        const int buf = i & 1, k0 = k_begin + i * BC;
        if (i + 1 < n_tiles) {
            load_kv(k0 + BC, buf ^ 1);
            kvb::cp_async_wait<1>();
        } else {
            kvb::cp_async_wait<0>();
        }
        __syncthreads();
        if (C::QREG && i == 0) {
#pragma unroll
            for (int ks = 0; ks < KS; ks++)
                kvb::ldmatrix<4, false>(qf[C::QREG ? ks : 0], &Qs[(16 * w + (lane & 15)) * LD + ks * 16 + 8 * (lane >> 4)]);
        }
        const T *Kb = Ks + buf * BC * LD, *Vb = Vs + buf * BC * LD;

        /* S = Q K^T over the tile's BC keys */
        float s[NT][4];
#pragma unroll
        for (int j = 0; j < NT; j++) s[j][0] = s[j][1] = s[j][2] = s[j][3] = 0.0f;
#pragma unroll
        for (int ks = 0; ks < KS; ks++) {
            uint32_t qa[4];
            if (C::QREG) {
#pragma unroll
                for (int e = 0; e < 4; e++) qa[e] = qf[C::QREG ? ks : 0][e];
            } else {
                kvb::ldmatrix<4, false>(qa, &Qs[(16 * w + (lane & 15)) * LD + ks * 16 + 8 * (lane >> 4)]);
            }
#pragma unroll
            for (int j = 0; j < NT; j += 2) {
                uint32_t kb[4];
                kvb::ldmatrix<4, false>(kb, &Kb[(8 * j + (lane & 7) + 8 * (lane >> 4)) * LD + ks * 16 + 8 * ((lane >> 3) & 1)]);
                const uint32_t b0[2] = {kb[0], kb[1]}, b1[2] = {kb[2], kb[3]};
                kvb::mma_16816<T>(s[j], qa, b0, s[j]);
                kvb::mma_16816<T>(s[j + 1], qa, b1, s[j + 1]);
            }
        }

        /* scale, mask where the tile crosses a row's first or last visible key or the range's end */
        const bool full = k0 + BC <= min(min_nvis, k_end) && k0 >= max_lo;
#pragma unroll
        for (int j = 0; j < NT; j++)
#pragma unroll
            for (int e = 0; e < 4; e++) {
                float v = s[j][e] * qscale;
                if (!full) {
                    int key = k0 + 8 * j + 2 * t + (e & 1), ri = e >> 1;
                    if (key >= nvis[ri] || key < lo[ri] || key >= k_end) v = -INFINITY;
                }
                s[j][e] = v;
            }

        /* online softmax: row ri's elements are s[j][2 ri], s[j][2 ri + 1] of the 4 lanes of the quad */
#pragma unroll
        for (int ri = 0; ri < 2; ri++) {
            float mx = -INFINITY;
#pragma unroll
            for (int j = 0; j < NT; j++) mx = fmaxf(mx, fmaxf(s[j][2 * ri], s[j][2 * ri + 1]));
            mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
            mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
            const float m_new = fmaxf(m[ri], mx), base = m_new == -INFINITY ? 0.0f : m_new;
            const float alpha = ex2(m[ri] - base);
            m[ri] = m_new;
            float rs = 0.0f;
#pragma unroll
            for (int j = 0; j < NT; j++) {
                s[j][2 * ri] = ex2(s[j][2 * ri] - base);
                s[j][2 * ri + 1] = ex2(s[j][2 * ri + 1] - base);
                rs += s[j][2 * ri] + s[j][2 * ri + 1];
            }
            l[ri] = l[ri] * alpha + rs;
#pragma unroll
            for (int d = 0; d < ND; d++) {
                o[d][2 * ri] *= alpha;
                o[d][2 * ri + 1] *= alpha;
            }
        }

        /* O += P V: the S accumulators of key tiles 2kk, 2kk+1 are P's A fragment for keys 16kk.. */
#pragma unroll
        for (int kk = 0; kk < KV; kk++) {
            const uint32_t pa[4] = {kvb::pack2<T>(s[2 * kk][0], s[2 * kk][1]), kvb::pack2<T>(s[2 * kk][2], s[2 * kk][3]),
                                    kvb::pack2<T>(s[2 * kk + 1][0], s[2 * kk + 1][1]),
                                    kvb::pack2<T>(s[2 * kk + 1][2], s[2 * kk + 1][3])};
#pragma unroll
            for (int d = 0; d < ND; d += 2) {
                uint32_t vb[4];
                kvb::ldmatrix<4, true>(vb, &Vb[(16 * kk + (lane & 7) + 8 * ((lane >> 3) & 1)) * LD + 8 * d + 8 * (lane >> 4)]);
                const uint32_t b0[2] = {vb[0], vb[1]}, b1[2] = {vb[2], vb[3]};
                kvb::mma_16816<T>(o[d], pa, b0, o[d]);
                kvb::mma_16816<T>(o[d + 1], pa, b1, o[d + 1]);
            }
        }
        __syncthreads(); /* the buffer is refilled by the next tile's loads */
    }
    if (n_tiles == 0) kvb::cp_async_wait<0>(); /* the Q copy */

#pragma unroll
    for (int ri = 0; ri < 2; ri++) {
        l[ri] += __shfl_xor_sync(0xffffffffu, l[ri], 1);
        l[ri] += __shfl_xor_sync(0xffffffffu, l[ri], 2);
    }
    if (it.part < 0) {
        T *out = (T *)a.out;
#pragma unroll
        for (int ri = 0; ri < 2; ri++) {
            if (nvis[ri] == 0) continue;
            int r = 16 * w + g + 8 * ri, tt = it.t0 + r / nh, hh = it.h0 + r % nh;
            float inv = l[ri] > 0.0f ? 1.0f / l[ri] : 0.0f;
            T *orow = out + ((size_t)(sq.q_start + tt) * a.n_heads + (size_t)it.kvh * gq + hh) * hd;
#pragma unroll
            for (int d = 0; d < ND; d++) {
                int col = 8 * d + 2 * t;
                if (col < hd) /* hd is a multiple of 8: both columns or none */
                    *reinterpret_cast<uint32_t *>(orow + col) = kvb::pack2<T>(o[d][2 * ri] * inv, o[d][2 * ri + 1] * inv);
            }
        }
        return;
    }
    const size_t prow = (size_t)a.groups[it.group].prow + (size_t)it.part * PM;
#pragma unroll
    for (int ri = 0; ri < 2; ri++) {
        int r = 16 * w + g + 8 * ri;
        float inv = l[ri] > 0.0f ? 1.0f / l[ri] : 0.0f;
        float *prow_o = a.part_o + (prow + r) * hd;
#pragma unroll
        for (int d = 0; d < ND; d++) {
            int col = 8 * d + 2 * t;
            if (col < hd) {
                prow_o[col] = o[d][2 * ri] * inv;
                prow_o[col + 1] = o[d][2 * ri + 1] * inv;
            }
        }
        if (t == 0) a.part_lse[prow + r] = l[ri] > 0.0f ? m[ri] + log2f(l[ri]) : -INFINITY;
    }
    if (kvb::attn::split_done(a, it.group))
        kvb::attn::merge_split<T>(a, sq, it.kvh, it.t0, it.h0, nh, TT * nh, it.group, PM);
}

template <typename T, int HD>
int launch(const kvb_cuda_attn_args &a, const kvb_cuda_attn_prefill_item *items, int n, cudaStream_t s) {
    constexpr size_t smem = tc_cfg<HD>::SMEM;
    if (smem > 48 * 1024) {
        /* above 48 KiB a kernel must opt in; cheap, and idempotent across threads */
        cudaError_t e = cudaFuncSetAttribute(prefill_tc_kernel<T, HD>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                             (int)smem);
        if (e != cudaSuccess) return (int)e;
    }
    prefill_tc_kernel<T, HD><<<n, THREADS, smem, s>>>(a, items);
    return (int)cudaGetLastError();
}

template <typename T>
int launch_hd(const kvb_cuda_attn_args &a, const kvb_cuda_attn_prefill_item *items, int n, cudaStream_t s) {
    if (a.head_dim <= 32) return launch<T, 32>(a, items, n, s);
    if (a.head_dim <= 64) return launch<T, 64>(a, items, n, s);
    if (a.head_dim <= 128) return launch<T, 128>(a, items, n, s);
    return launch<T, 256>(a, items, n, s);
}

} // namespace

extern "C" int kvb_cuda_attention_prefill_tc(kvb_dtype dt, int head_dim) {
    return (dt == KVB_DTYPE_BF16 || dt == KVB_DTYPE_F16) && head_dim > 0 && head_dim <= KVB_CUDA_ATTN_MAX_HEAD_DIM &&
           head_dim % 8 == 0;
}

int kvb::attn::prefill_tc(const kvb_cuda_attn_args &a, const kvb_cuda_attn_prefill_item *items, int n_items,
                          cudaStream_t s) {
    if (!kvb_cuda_attention_prefill_tc(a.dtype, a.head_dim)) return -1;
    if (a.dtype == KVB_DTYPE_BF16) return launch_hd<__nv_bfloat16>(a, items, n_items, s);
    return launch_hd<__half>(a, items, n_items, s);
}
