/* kvbank — the prefill attention on tensor cores, FlashAttention-2 style (Dao, "FlashAttention-2",
 * 2023, §3.1 algorithm 1 and §3.3 work partitioning: a block owns a tile of query rows, its warps split
 * the rows, not the keys, so no warp waits for another's partial softmax).
 *
 * A CUDA block of WARPS warps takes one prefill item (attention.h): a tile of ROWS = 16 MT WARPS query
 * rows (tokens x heads of one KV group, so a K/V tile serves every head of the group), 16 MT per warp,
 * over the keys [k_begin, k_end). Two tiles (kvb_cuda_attn_prefill_rows): 64 rows (4 warps x 16) and
 * 128 rows (4 warps x 32 up to head size 128, 8 warps x 16 at 256), the default: each K/V tile copied
 * to shared memory serves twice the rows, and at 32 rows a warp each K/V fragment an ldmatrix reads
 * feeds two mma (FlashAttention-2's 128 x 64 tile for head size 128 on sm80+).
 *  - The Q tile is copied to shared memory by cp.async and held in registers as mma A fragments for
 *    the whole key walk where they fit in 32 registers, else re-read from shared memory per key tile.
 *  - K/V tiles of BC keys (64; 32 at head size 256) are double-buffered in shared memory: tile i + 1 is
 *    in flight (cp.async, one commit group per tile) while tile i is computed. Each key's row comes
 *    through the block-address array, so a tile may span blocks that live anywhere (local pool, a
 *    lender's region, stage buffers); keys past the range and dims past head_dim are zero-filled by
 *    cp.async's src-size, never read. The row addresses of tile i + 2 are loaded from the block array
 *    while tile i is computed and kept in shared memory, so no copy waits on a pointer load.
 *  - S = Q K^T: mma.m16n8k16 per (16-dim step, 8-key tile), K fragments by ldmatrix.x4 (two key tiles
 *    each); masked (causal to the end of the sequence, the sliding window, the range's end) only on
 *    tiles that cross a boundary of one of the warp's rows; a warp skips a key tile none of its rows
 *    sees (the causal diagonal of an MHA tile).
 *  - Online softmax in f32 on the accumulator fragments: the row max over the 4 lanes of a quad by
 *    shuffles, exp2(s * scale log2 e - max * scale log2 e) as one fma and ex2, the running row sum kept
 *    per lane and reduced at the end.
 *  - O += P V: the probabilities go from the S accumulators to A fragments in registers (bf16/f16),
 *    V fragments by ldmatrix.x4.trans; O stays in f32 registers (16 MT rows x head size per warp).
 * Rows of shared memory are padded by 16 bytes so that the 8 rows an ldmatrix reads fall in distinct
 * banks. An item with part >= 0 is one split of a tile's keys: it writes its normalised rows and their
 * log-sum-exp, and the group's last split merges them (attention_impl.cuh). */
#include <limits.h>

#include "kernels/cuda/attention_impl.cuh"
#include "kernels/cuda/mma.cuh"

namespace {

using kvb::attn::key_row;
using kvb::attn::LOG2E;

/* A tile of ROWS = 16 MT WARPS query rows: WARPS warps of 16 MT rows each. */
template <int HD, int WARPS, int MT> struct tc_cfg {
    static constexpr int ROWS = 16 * MT * WARPS, THREADS = 32 * WARPS;
    /* keys per tile: 64, but 32 where S's and O's accumulators of 32 rows would not fit the registers
     * beside each other (head size 128 at 32 rows a warp spills 164 bytes with 64; ptxas, sm_90) */
    static constexpr int BC = MT * HD <= 128 ? 64 : 32;
    static constexpr bool QREG = MT * (HD / 16) * 4 <= 32;  /* Q fragments in registers for the whole walk */
    static constexpr int LD = HD + 8;                       /* shared-memory row stride, elements */
    /* skip O's rescale when no lane's max moved; not at head size 128 with 32 rows a warp, where the
     * vote's registers spill 12 bytes (ptxas, sm_90) */
    static constexpr bool VOTE = !(MT > 1 && HD >= 128);
    static constexpr size_t SMEM = 2 * ((size_t)ROWS * LD + 4 * (size_t)BC * LD); /* Q, K[2], V[2] (16-bit) */
    static_assert(ROWS <= KVB_CUDA_ATTN_PREFILL_ROWS_MAX && THREADS >= BC, "a tile's rows and key addresses");
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

template <typename Op> __device__ __forceinline__ int warp_reduce_int(int v, Op op) {
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) v = op(v, __shfl_xor_sync(0xffffffffu, v, off));
    return v;
}

template <typename T, int HD, int WARPS, int MT>
__global__ void __launch_bounds__(32 * WARPS)
    prefill_tc_kernel(const kvb_cuda_attn_args a, const kvb_cuda_attn_prefill_item *__restrict__ items) {
    using C = tc_cfg<HD, WARPS, MT>;
    constexpr int ROWS = C::ROWS, THREADS = C::THREADS, BC = C::BC, LD = C::LD;
    constexpr int KS = HD / 16;  /* 16-dim steps of QK^T */
    constexpr int NT = BC / 8;   /* 8-key tiles of S */
    constexpr int ND = HD / 8;   /* 8-dim tiles of O */
    constexpr int KV = BC / 16;  /* 16-key steps of PV */
    constexpr int CH = HD / 8;   /* 16-byte chunks per row */
    static_assert(NT % 2 == 0 && ND % 2 == 0, "ldmatrix.x4 loads two 8-wide tiles");
    extern __shared__ float4 smem4[];
    __shared__ const T *kaddr[2][BC]; /* K row address of each key of a tile (null: past the range) */
    T *Qs = reinterpret_cast<T *>(smem4); /* [ROWS][LD] */
    T *Ks = Qs + ROWS * LD;               /* [2][BC][LD] */
    T *Vs = Ks + 2 * BC * LD;             /* [2][BC][LD] */

    const kvb_cuda_attn_prefill_item it = items[blockIdx.x];
    const kvb_attn_seq sq = a.seqs[it.seq];
    const int hd = a.head_dim, gq = a.n_heads / a.n_kv_heads;
    const int nh = min(gq, ROWS), TT = ROWS / nh, past = sq.ctx_len - sq.q_len;
    const size_t row_elems = (size_t)a.n_kv_heads * hd, v_off = (size_t)a.block_size * row_elems;
    const int tid = threadIdx.x, lane = tid & 31, w = tid >> 5, g = lane >> 2, t = lane & 3;
    const int wrow = 16 * MT * w; /* the warp's first row */
    const float qscale = a.scale * LOG2E;

    /* the keys the tile sees: up to its last token, from its first token's window */
    const int t_last = min(it.t0 + TT, sq.q_len) - 1;
    const int kmax = past + t_last + 1;
    const int kmin = a.window > 0 && past + it.t0 + 1 > a.window ? past + it.t0 + 1 - a.window : 0;
    const int k_begin = it.k_end > 0 ? it.k_begin : kmin, k_end = it.k_end > 0 ? it.k_end : kmax;

    /* this lane's rows (g and g + 8 of each of the warp's 16-row tiles): keys [lo, nvis) visible, where
     * lo = nvis - window with a window; nvis 0: no row. Over the warp's rows: the most and fewest keys
     * seen, the earliest and latest window start (a key tile outside every row's keys is skipped, one
     * inside all of them needs no mask). */
    int nvis[MT][2];
    int w_hi = 0, w_lo = INT_MAX, lo_min = INT_MAX, lo_max = 0;
#pragma unroll
    for (int mt = 0; mt < MT; mt++)
#pragma unroll
        for (int i = 0; i < 2; i++) {
            int r = wrow + 16 * mt + g + 8 * i, tt = it.t0 + r / nh, hh = it.h0 + r % nh;
            int nv = (r < TT * nh && tt < sq.q_len && hh < gq) ? past + tt + 1 : 0;
            nvis[mt][i] = nv;
            if (nv > 0) {
                int lo = a.window > 0 && nv > a.window ? nv - a.window : 0;
                w_hi = max(w_hi, nv);
                w_lo = min(w_lo, nv);
                lo_min = min(lo_min, lo);
                lo_max = max(lo_max, lo);
            }
        }
    w_hi = warp_reduce_int(w_hi, [](int x, int y) { return max(x, y); });
    w_lo = warp_reduce_int(w_lo, [](int x, int y) { return min(x, y); });
    lo_min = warp_reduce_int(lo_min, [](int x, int y) { return min(x, y); });
    lo_max = warp_reduce_int(lo_max, [](int x, int y) { return max(x, y); });

    const T *q = (const T *)a.q;
    for (int c = tid; c < ROWS * CH; c += THREADS) {
        int r = c / CH, ch = c % CH, tt = it.t0 + r / nh, hh = it.h0 + r % nh;
        bool ok = r < TT * nh && tt < sq.q_len && hh < gq && ch * 8 < hd;
        const T *src = ok ? q + ((size_t)(sq.q_start + tt) * a.n_heads + (size_t)it.kvh * gq + hh) * hd + ch * 8 : q;
        kvb::cp_async16(&Qs[r * LD + ch * 8], src, ok ? 16 : 0);
    }
    kvb::cp_async_commit();

    const int n_tiles = k_end > k_begin ? (k_end - k_begin + BC - 1) / BC : 0;
    /* key tid's K row address in tile `tile` (threads below BC) */
    auto key_addr = [&](int tile) -> const T * {
        const int key = k_begin + tile * BC + tid;
        return tid < BC && tile < n_tiles && key < k_end ? key_row<T>(a, sq.blk_first, key, it.kvh, row_elems)
                                                         : nullptr;
    };
    auto load_kv = [&](int buf) {
        for (int c = tid; c < BC * CH; c += THREADS) {
            int kk = c / CH, ch = c % CH;
            const T *kr = kaddr[buf][kk];
            bool ok = kr != nullptr && ch * 8 < hd;
            kvb::cp_async16(&Ks[(buf * BC + kk) * LD + ch * 8], ok ? kr + ch * 8 : q, ok ? 16 : 0);
            kvb::cp_async16(&Vs[(buf * BC + kk) * LD + ch * 8], ok ? kr + v_off + ch * 8 : q, ok ? 16 : 0);
        }
        kvb::cp_async_commit();
    };
    const T *kaddr_next = nullptr; /* tile i + 2's, loaded during tile i */
    if (tid < BC) {
        kaddr[0][tid] = key_addr(0);
        kaddr[1][tid] = key_addr(1);
        kaddr_next = key_addr(2);
    }
    __syncthreads();

    float o[MT][ND][4];
#pragma unroll
    for (int mt = 0; mt < MT; mt++)
#pragma unroll
        for (int d = 0; d < ND; d++) o[mt][d][0] = o[mt][d][1] = o[mt][d][2] = o[mt][d][3] = 0.0f;
    /* running max (of raw scores) and sum of each of the lane's rows */
    float m[MT][2], l[MT][2];
#pragma unroll
    for (int mt = 0; mt < MT; mt++) m[mt][0] = m[mt][1] = -INFINITY, l[mt][0] = l[mt][1] = 0.0f;
    uint32_t qf[C::QREG ? MT * KS : 1][4];

    if (n_tiles > 0) load_kv(0);
    for (int i = 0; i < n_tiles; i++) {
        const int buf = i & 1, k0 = k_begin + i * BC;
        if (i + 1 < n_tiles) {
            load_kv(buf ^ 1);
            kvb::cp_async_wait<1>();
        } else {
            kvb::cp_async_wait<0>();
        }
        __syncthreads();
        if (C::QREG && i == 0) {
#pragma unroll
            for (int mt = 0; mt < MT; mt++)
#pragma unroll
                for (int ks = 0; ks < KS; ks++)
                    kvb::ldmatrix<4, false>(qf[C::QREG ? mt * KS + ks : 0],
                                            &Qs[(wrow + 16 * mt + (lane & 15)) * LD + ks * 16 + 8 * (lane >> 4)]);
        }
        const T *Kb = Ks + buf * BC * LD, *Vb = Vs + buf * BC * LD;

        if (k0 < w_hi && k0 + BC > lo_min) { /* else no row of the warp sees a key of the tile */
            /* S = Q K^T over the tile's BC keys */
            float s[MT][NT][4];
#pragma unroll
            for (int mt = 0; mt < MT; mt++)
#pragma unroll
                for (int j = 0; j < NT; j++) s[mt][j][0] = s[mt][j][1] = s[mt][j][2] = s[mt][j][3] = 0.0f;
#pragma unroll
            for (int ks = 0; ks < KS; ks++) {
                uint32_t qa[MT][4];
#pragma unroll
                for (int mt = 0; mt < MT; mt++) {
                    if (C::QREG) {
#pragma unroll
                        for (int e = 0; e < 4; e++) qa[mt][e] = qf[C::QREG ? mt * KS + ks : 0][e];
                    } else {
                        kvb::ldmatrix<4, false>(qa[mt], &Qs[(wrow + 16 * mt + (lane & 15)) * LD + ks * 16 + 8 * (lane >> 4)]);
                    }
                }
#pragma unroll
                for (int j = 0; j < NT; j += 2) {
                    uint32_t kb[4];
                    kvb::ldmatrix<4, false>(kb, &Kb[(8 * j + (lane & 7) + 8 * (lane >> 4)) * LD + ks * 16 + 8 * ((lane >> 3) & 1)]);
                    const uint32_t b0[2] = {kb[0], kb[1]}, b1[2] = {kb[2], kb[3]};
#pragma unroll
                    for (int mt = 0; mt < MT; mt++) {
                        kvb::mma_16816<T>(s[mt][j], qa[mt], b0, s[mt][j]);
                        kvb::mma_16816<T>(s[mt][j + 1], qa[mt], b1, s[mt][j + 1]);
                    }
                }
            }

            /* mask where the tile crosses one of the warp's rows' first or last visible key or the
             * range's end (raw scores: the scale goes into the exponent below) */
            if (!(k0 + BC <= min(w_lo, k_end) && k0 >= lo_max)) {
#pragma unroll
                for (int mt = 0; mt < MT; mt++)
#pragma unroll
                    for (int j = 0; j < NT; j++)
#pragma unroll
                        for (int e = 0; e < 4; e++) {
                            const int key = k0 + 8 * j + 2 * t + (e & 1), nv = nvis[mt][e >> 1];
                            const int lo = a.window > 0 && nv > a.window ? nv - a.window : 0;
                            if (key >= nv || key < lo || key >= k_end) s[mt][j][e] = -INFINITY;
                        }
            }

            /* online softmax: row ri of tile mt is s[mt][j][2 ri], s[mt][j][2 ri + 1] of the quad's 4 lanes;
             * the probabilities go to P (bf16/f16 pairs: half the registers of S) as they are made */
            uint32_t p[MT][NT][2];
#pragma unroll
            for (int mt = 0; mt < MT; mt++)
#pragma unroll
                for (int ri = 0; ri < 2; ri++) {
                    float mx = -INFINITY;
#pragma unroll
                    for (int j = 0; j < NT; j++) mx = fmaxf(mx, fmaxf(s[mt][j][2 * ri], s[mt][j][2 * ri + 1]));
                    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
                    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
                    const float m_new = fmaxf(m[mt][ri], mx);
                    /* exp2((s - m) * qscale); nothing visible yet: every p is 0 */
                    const float base = m_new == -INFINITY ? 0.0f : m_new * qscale;
                    const float alpha = m_new == -INFINITY ? 1.0f : ex2((m[mt][ri] - m_new) * qscale);
                    m[mt][ri] = m_new;
                    float rs = 0.0f;
#pragma unroll
                    for (int j = 0; j < NT; j++) {
                        const float p0 = ex2(fmaf(s[mt][j][2 * ri], qscale, -base));
                        const float p1 = ex2(fmaf(s[mt][j][2 * ri + 1], qscale, -base));
                        p[mt][j][ri] = kvb::pack2<T>(p0, p1);
                        rs += p0 + p1;
                    }
                    l[mt][ri] = l[mt][ri] * alpha + rs;
                    /* O's rescale (HD / 2 multiplies a lane) only where a row's max moved: once a causal
                     * row's max settles, most key tiles leave alpha at 1 in every lane (C::VOTE) */
                    if (!C::VOTE || __ballot_sync(0xffffffffu, alpha != 1.0f)) {
#pragma unroll
                        for (int d = 0; d < ND; d++) {
                            o[mt][d][2 * ri] *= alpha;
                            o[mt][d][2 * ri + 1] *= alpha;
                        }
                    }
                }

            /* O += P V: P of key tiles 2kk, 2kk+1 (the S accumulators' layout) is the A fragment for keys
             * 16kk.. */
#pragma unroll
            for (int kk = 0; kk < KV; kk++) {
                uint32_t pa[MT][4];
#pragma unroll
                for (int mt = 0; mt < MT; mt++) {
                    pa[mt][0] = p[mt][2 * kk][0];
                    pa[mt][1] = p[mt][2 * kk][1];
                    pa[mt][2] = p[mt][2 * kk + 1][0];
                    pa[mt][3] = p[mt][2 * kk + 1][1];
                }
#pragma unroll
                for (int d = 0; d < ND; d += 2) {
                    uint32_t vb[4];
                    kvb::ldmatrix<4, true>(vb, &Vb[(16 * kk + (lane & 7) + 8 * ((lane >> 3) & 1)) * LD + 8 * d + 8 * (lane >> 4)]);
                    const uint32_t b0[2] = {vb[0], vb[1]}, b1[2] = {vb[2], vb[3]};
#pragma unroll
                    for (int mt = 0; mt < MT; mt++) {
                        kvb::mma_16816<T>(o[mt][d], pa[mt], b0, o[mt][d]);
                        kvb::mma_16816<T>(o[mt][d + 1], pa[mt], b1, o[mt][d + 1]);
                    }
                }
            }
        }
        if (tid < BC) { /* tile i + 2's addresses, in the slot tile i's loads have read; then tile i + 3's */
            kaddr[buf][tid] = kaddr_next;
            kaddr_next = key_addr(i + 3);
        }
        __syncthreads(); /* the buffers are refilled by the next tiles' loads */
    }
    if (n_tiles == 0) kvb::cp_async_wait<0>(); /* the Q copy */

#pragma unroll
    for (int mt = 0; mt < MT; mt++)
#pragma unroll
        for (int ri = 0; ri < 2; ri++) {
            l[mt][ri] += __shfl_xor_sync(0xffffffffu, l[mt][ri], 1);
            l[mt][ri] += __shfl_xor_sync(0xffffffffu, l[mt][ri], 2);
        }
    if (it.part < 0) {
        T *out = (T *)a.out;
#pragma unroll
        for (int mt = 0; mt < MT; mt++)
#pragma unroll
            for (int ri = 0; ri < 2; ri++) {
                if (nvis[mt][ri] == 0) continue;
                int r = wrow + 16 * mt + g + 8 * ri, tt = it.t0 + r / nh, hh = it.h0 + r % nh;
                float inv = l[mt][ri] > 0.0f ? 1.0f / l[mt][ri] : 0.0f;
                T *orow = out + ((size_t)(sq.q_start + tt) * a.n_heads + (size_t)it.kvh * gq + hh) * hd;
#pragma unroll
                for (int d = 0; d < ND; d++) {
                    int col = 8 * d + 2 * t;
                    if (col < hd) /* hd is a multiple of 8: both columns or none */
                        *reinterpret_cast<uint32_t *>(orow + col) =
                            kvb::pack2<T>(o[mt][d][2 * ri] * inv, o[mt][d][2 * ri + 1] * inv);
                }
            }
        return;
    }
    const size_t prow = (size_t)a.groups[it.group].prow + (size_t)it.part * ROWS;
#pragma unroll
    for (int mt = 0; mt < MT; mt++)
#pragma unroll
        for (int ri = 0; ri < 2; ri++) {
            int r = wrow + 16 * mt + g + 8 * ri;
            float inv = l[mt][ri] > 0.0f ? 1.0f / l[mt][ri] : 0.0f;
            float *prow_o = a.part_o + (prow + r) * hd;
#pragma unroll
            for (int d = 0; d < ND; d++) {
                int col = 8 * d + 2 * t;
                if (col < hd) {
                    prow_o[col] = o[mt][d][2 * ri] * inv;
                    prow_o[col + 1] = o[mt][d][2 * ri + 1] * inv;
                }
            }
            if (t == 0) a.part_lse[prow + r] = l[mt][ri] > 0.0f ? m[mt][ri] * qscale + log2f(l[mt][ri]) : -INFINITY;
        }
    if (kvb::attn::split_done(a, it.group))
        kvb::attn::merge_split<T>(a, sq, it.kvh, it.t0, it.h0, nh, TT * nh, it.group, ROWS);
}

template <typename T, int HD, int WARPS, int MT>
int launch(const kvb_cuda_attn_args &a, const kvb_cuda_attn_prefill_item *items, int n, cudaStream_t s) {
    constexpr size_t smem = tc_cfg<HD, WARPS, MT>::SMEM;
    if (smem > 48 * 1024) {
        /* above 48 KiB a kernel must opt in; cheap, and idempotent across threads */
        cudaError_t e = cudaFuncSetAttribute(prefill_tc_kernel<T, HD, WARPS, MT>,
                                             cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem);
        if (e != cudaSuccess) return (int)e;
    }
    prefill_tc_kernel<T, HD, WARPS, MT><<<n, 32 * WARPS, smem, s>>>(a, items);
    return (int)cudaGetLastError();
}

/* The 128-row tile: 4 warps x 32 rows where O (32 rows x head size in f32) fits the registers beside
 * S, 8 warps x 16 at head size 256. */
template <typename T, int HD>
int launch_rows(const kvb_cuda_attn_args &a, const kvb_cuda_attn_prefill_item *items, int n, cudaStream_t s) {
    if (a.prefill_rows == 64) return launch<T, HD, 4, 1>(a, items, n, s);
    if (a.prefill_rows != 128) return (int)cudaErrorInvalidValue;
    if constexpr (HD <= 128) return launch<T, HD, 4, 2>(a, items, n, s);
    else return launch<T, HD, 8, 1>(a, items, n, s);
}

template <typename T>
int launch_hd(const kvb_cuda_attn_args &a, const kvb_cuda_attn_prefill_item *items, int n, cudaStream_t s) {
    if (a.head_dim <= 32) return launch_rows<T, 32>(a, items, n, s);
    if (a.head_dim <= 64) return launch_rows<T, 64>(a, items, n, s);
    if (a.head_dim <= 128) return launch_rows<T, 128>(a, items, n, s);
    return launch_rows<T, 256>(a, items, n, s);
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
