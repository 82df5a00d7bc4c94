/* kvbank — CUDA paged attention: decode splits with their merge, and the CUDA-core prefill (see
 * attention.h; the tensor-core prefill is attention_tc.cu).
 *
 * Keys and values are read through the block-address array: key `k` of a sequence lives in entry
 * blk_first + k / block_size, row k % block_size; its K row for KV head g starts at
 * row * (n_kv_heads * head_dim) + g * head_dim of the slice and its V row block_size rows further.
 * Scores are prescaled by scale * log2(e) so that every exponential is an exp2f.
 *
 * Templates: T the storage type, HDP the head dimension rounded up to 32/64/128/256 (shared-memory
 * rows are HDP wide, zero-padded), VP whether rows move as 16-byte vectors (head_dim * sizeof(T) a
 * multiple of 16; block addresses 16-byte aligned by contract) or element by element. */
#include <math.h>

#include "kernels/cuda/attention_impl.cuh"
#include "kernels/cuda/mma.cuh" /* cp.async */

namespace {

using kvb::attn::DR;
using kvb::attn::key_row;
using kvb::attn::LOG2E;
constexpr int TK = KVB_CUDA_ATTN_KEY_TILE;
constexpr int DEC_THREADS = 128;
constexpr int DEC_WARPS = DEC_THREADS / 32;
constexpr int PM = KVB_CUDA_ATTN_PREFILL_ROWS;
constexpr int PBK = 32; /* keys per prefill tile */
constexpr int PRE_THREADS = 256;
constexpr int U = 4; /* loads in flight per thread before their first use (tiled decode kernel) */
/* the fast decode kernel's ring: keys per lane group and stage, and stages (all but one in flight) */
constexpr int DEC_UF = 2;
constexpr int DEC_STAGES = 4;

static_assert(PM == 64 && PRE_THREADS == 256, "the prefill thread layout assumes 64 rows x 32 keys on 256 threads");

/* One slot of a row: W = VEC<T> elements (VP) or one element. */
template <typename T, bool VP> __device__ __forceinline__ void load_slot(const T *p, float *f) {
    if constexpr (VP) kvb::load_vec(p, f);
    else f[0] = kvb::to_f(*p);
}

/* ---------------------------------------------------------------- decode */

template <typename T, int HDP, bool VP>
__global__ void __launch_bounds__(DEC_THREADS, KVB_CUDA_ATTN_DECODE_RESIDENT)
    decode_kernel(const kvb_cuda_attn_args a, const kvb_cuda_attn_decode_item *__restrict__ items) {
    constexpr int W = VP ? kvb::VEC<T> : 1;            /* elements per slot */
    constexpr int SL1 = (HDP / W + 31) / 32;            /* slots per lane in the score phase */
    constexpr int SPT = (HDP / W + DEC_THREADS - 1) / DEC_THREADS; /* slots per thread in the P.V phase */
    __shared__ __align__(16) float Qs[DR][HDP];         /* query rows, prescaled, zero-padded */
    __shared__ float S[DR][TK];                         /* scores, then probabilities, of one key tile */
    __shared__ float Ored[DR][HDP];                     /* output rows after the cross-group reduction */
    __shared__ float m_s[DR], l_s[DR], alpha_s[DR];     /* running max, running sum, last rescale factor */
    __shared__ int nvis_s[DR];                          /* keys visible to each row (0: row unused) */
    __shared__ int lo_s[DR];                            /* first key of each row's sliding window (0: none) */

    const kvb_cuda_attn_decode_item it = items[blockIdx.x];
    const kvb_attn_seq sq = a.seqs[it.seq];
    const int hd = a.head_dim, gq = a.n_heads / a.n_kv_heads;
    const int rows = sq.q_len * gq; /* <= DR: the host sends larger groups to the prefill kernel */
    const int past = sq.ctx_len - sq.q_len;
    const size_t row_elems = (size_t)a.n_kv_heads * hd, v_off = (size_t)a.block_size * row_elems;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const float qscale = a.scale * LOG2E;

    const T *q = (const T *)a.q;
    for (int i = tid; i < DR * HDP; i += DEC_THREADS) {
        int r = i / HDP, d = i % HDP;
        float v = 0.0f;
        if (r < rows && d < hd) {
            int t = r / gq, h = it.kvh * gq + r % gq;
            v = kvb::to_f(q[((size_t)(sq.q_start + t) * a.n_heads + h) * hd + d]) * qscale;
        }
        Qs[r][d] = v;
    }
    if (tid < DR) {
        m_s[tid] = -INFINITY;
        l_s[tid] = 0.0f;
        alpha_s[tid] = 1.0f;
        nvis_s[tid] = tid < rows ? past + tid / gq + 1 : 0;
        lo_s[tid] = a.window > 0 && nvis_s[tid] > a.window ? nvis_s[tid] - a.window : 0;
    }
    __syncthreads();

    const int NS = (hd + W - 1) / W; /* slots per row */
    /* score phase: G lanes (a power of two) share one key, KPW keys per warp and step */
    int G = 1;
    while (G < NS && G < 32) G <<= 1;
    const int KPW = 32 / G, sub = lane / G, gl = lane % G;
    /* P.V phase: NSL threads cover a row's slots, KG groups of them take keys round-robin */
    const int NSL = NS < DEC_THREADS ? NS : DEC_THREADS;
    const int KG = DEC_THREADS / NSL, kg = tid / NSL, sl = tid % NSL;

    float o[DR][SPT][W];
#pragma unroll
    for (int r = 0; r < DR; r++)
#pragma unroll
        for (int sp = 0; sp < SPT; sp++)
#pragma unroll
            for (int j = 0; j < W; j++) o[r][sp][j] = 0.0f;

    for (int tile = it.k_begin; tile < it.k_end; tile += TK) {
        const int tlen = min(TK, it.k_end - tile);

        /* scores: warp w takes keys w*KPW + sub, then every DEC_WARPS*KPW; U keys per step */
        for (int kb = warp * KPW; kb < TK; kb += U * DEC_WARPS * KPW) {
            float kf[U][SL1][W];
#pragma unroll
            for (int u = 0; u < U; u++) {
                int kk = kb + u * DEC_WARPS * KPW + sub;
#pragma unroll
                for (int s1 = 0; s1 < SL1; s1++) {
                    int s = gl + s1 * G;
                    if (kk < tlen && s < NS && (s1 == 0 || G == 32)) {
                        const T *kr = key_row<T>(a, sq.blk_first, tile + kk, it.kvh, row_elems);
                        load_slot<T, VP>(kr + (size_t)s * W, kf[u][s1]);
                    } else {
#pragma unroll
                        for (int j = 0; j < W; j++) kf[u][s1][j] = 0.0f;
                    }
                }
            }
#pragma unroll
            for (int u = 0; u < U; u++) {
                int kk = kb + u * DEC_WARPS * KPW + sub;
                float acc[DR];
#pragma unroll
                for (int r = 0; r < DR; r++) {
                    acc[r] = 0.0f;
                    if (r < rows) {
#pragma unroll
                        for (int s1 = 0; s1 < SL1; s1++) {
                            int s = gl + s1 * G;
                            if (s < NS && (s1 == 0 || G == 32)) {
#pragma unroll
                                for (int j = 0; j < W; j++) acc[r] += Qs[r][s * W + j] * kf[u][s1][j];
                            }
                        }
                    }
                }
#pragma unroll
                for (int r = 0; r < DR; r++) {
                    if (r < rows) { /* uniform: every lane of the warp agrees */
                        for (int off = G / 2; off > 0; off >>= 1) acc[r] += __shfl_xor_sync(0xffffffffu, acc[r], off);
                    }
                }
                if (gl == 0 && kk < tlen) {
                    int key = tile + kk;
#pragma unroll
                    for (int r = 0; r < DR; r++) S[r][kk] = key < nvis_s[r] && key >= lo_s[r] ? acc[r] : -INFINITY;
                }
            }
        }
        __syncthreads();

        /* online softmax over the tile, one warp per row */
        for (int r = warp; r < rows; r += DEC_WARPS) {
            float m_old = m_s[r], l_old = l_s[r];
            float mx = -INFINITY;
            for (int kk = lane; kk < tlen; kk += 32) mx = fmaxf(mx, S[r][kk]);
            mx = kvb::warp_max(mx);
            float m_new = fmaxf(m_old, mx), alpha = 1.0f, sum = 0.0f;
            if (m_new == -INFINITY) {
                for (int kk = lane; kk < tlen; kk += 32) S[r][kk] = 0.0f;
            } else {
                alpha = exp2f(m_old - m_new);
                for (int kk = lane; kk < tlen; kk += 32) {
                    float p = exp2f(S[r][kk] - m_new);
                    S[r][kk] = p;
                    sum += p;
                }
            }
            sum = kvb::warp_sum(sum);
            __syncwarp(); /* every lane has read m_s[r] / l_s[r] before lane 0 overwrites them (racecheck) */
            if (lane == 0) {
                m_s[r] = m_new;
                l_s[r] = l_old * alpha + sum;
                alpha_s[r] = alpha;
            }
        }
        __syncthreads();

        /* o = o * alpha + P . V */
        if (kg < KG) {
#pragma unroll
            for (int r = 0; r < DR; r++) {
                float al = alpha_s[r];
#pragma unroll
                for (int sp = 0; sp < SPT; sp++)
#pragma unroll
                    for (int j = 0; j < W; j++) o[r][sp][j] *= al;
            }
            for (int kb = kg; kb < tlen; kb += U * KG) {
                float vf[U][SPT][W];
#pragma unroll
                for (int u = 0; u < U; u++) {
                    int kk = kb + u * KG;
#pragma unroll
                    for (int sp = 0; sp < SPT; sp++) {
                        int s = sl + sp * NSL;
                        if (kk < tlen && s < NS) {
                            const T *vr = key_row<T>(a, sq.blk_first, tile + kk, it.kvh, row_elems) + v_off;
                            load_slot<T, VP>(vr + (size_t)s * W, vf[u][sp]);
                        } else {
#pragma unroll
                            for (int j = 0; j < W; j++) vf[u][sp][j] = 0.0f;
                        }
                    }
                }
#pragma unroll
                for (int u = 0; u < U; u++) {
                    int kk = kb + u * KG;
                    if (kk >= tlen) break;
#pragma unroll
                    for (int r = 0; r < DR; r++) {
                        if (r < rows) {
                            float p = S[r][kk];
#pragma unroll
                            for (int sp = 0; sp < SPT; sp++)
#pragma unroll
                                for (int j = 0; j < W; j++) o[r][sp][j] += p * vf[u][sp][j];
                        }
                    }
                }
            }
        }
        __syncthreads();
    }

    /* deterministic reduction over the key groups, in group order */
    for (int g2 = 0; g2 < KG; g2++) {
        if (kg == g2) {
#pragma unroll
            for (int r = 0; r < DR; r++)
#pragma unroll
                for (int sp = 0; sp < SPT; sp++) {
                    int s = sl + sp * NSL;
                    if (s < NS)
#pragma unroll
                        for (int j = 0; j < W; j++) {
                            int d = s * W + j;
                            if (d < HDP) Ored[r][d] = (g2 == 0 ? 0.0f : Ored[r][d]) + o[r][sp][j];
                        }
                }
        }
        __syncthreads();
    }

    const size_t prow = it.part < 0 ? 0 : (size_t)a.groups[it.group].prow + (size_t)it.part * DR;
    for (int i = tid; i < rows * hd; i += DEC_THREADS) {
        int r = i / hd, d = i % hd;
        float l = l_s[r], v = l > 0.0f ? Ored[r][d] / l : 0.0f;
        if (it.part < 0) {
            int t = r / gq, h = it.kvh * gq + r % gq;
            ((T *)a.out)[((size_t)(sq.q_start + t) * a.n_heads + h) * hd + d] = kvb::from_f<T>(v);
        } else {
            a.part_o[(prow + r) * hd + d] = v;
        }
    }
    if (it.part >= 0) {
        if (tid < rows) a.part_lse[prow + tid] = l_s[tid] > 0.0f ? m_s[tid] + log2f(l_s[tid]) : -INFINITY;
        if (kvb::attn::split_done(a, it.group)) kvb::attn::merge_split<T>(a, sq, it.kvh, 0, 0, gq, rows, it.group, DR);
    }
}

/* The decode kernel for the shapes real models have: head_dim HD exactly 32, 64, 128 or 256 with rows
 * moved as 16-byte vectors and at most 32 lanes per row. LPK = HD / VEC<T> lanes hold one key's K and V
 * rows (a 16-byte slot each), so a warp takes KPW = 32 / LPK keys at a time and the block NG = 4 * KPW
 * lane groups. Group g = warp * KPW + lane / LPK keeps its own online softmax over its keys, with no
 * barrier inside the key loop: the scores of a key are reduced over its LPK lanes by shuffles. The
 * groups merge in shared memory at the end, in group order (deterministic). R is the register tile of
 * query rows (>= the launch's rows).
 *
 * K/V stream through a ring of DEC_STAGES stages per warp in shared memory, filled by cp.async: stage
 * st holds keys k_begin + st * BKS + warp * KPS + u * KPW + lane / LPK (u < DEC_UF) and is issued
 * DEC_STAGES - 1 stages before it is read, so each warp keeps (DEC_STAGES - 1) * KPS K and V rows in
 * flight while it computes (6 KiB a warp, 24 KiB a block; at 4 blocks a multiprocessor about three
 * times what Little's law asks of HBM3 at ~1 us). A lane reads back only the slots it copied itself,
 * so its own wait_group orders them: no barrier in the loop. */
template <typename T, int HD, int R>
__global__ void __launch_bounds__(DEC_THREADS, R <= 4 ? KVB_CUDA_ATTN_DECODE_RESIDENT : KVB_CUDA_ATTN_DECODE_RESIDENT / 2)
    decode_fast_kernel(const kvb_cuda_attn_args a, const kvb_cuda_attn_decode_item *__restrict__ items) {
    constexpr int W = kvb::VEC<T>;
    constexpr int LPK = HD / W;
    static_assert(LPK >= 1 && LPK <= 32 && 32 % LPK == 0, "a key's row must fit in one warp");
    constexpr int KPW = 32 / LPK, NG = DEC_WARPS * KPW, UF = DEC_UF, S = DEC_STAGES;
    constexpr int KPS = KPW * UF, BKS = DEC_WARPS * KPS; /* keys of a warp's stage, of the block's */
    constexpr size_t RING = sizeof(uint4) * DEC_WARPS * S * UF * 2 * 32, OSB = sizeof(float) * NG * R * HD;
    /* the ring, then (after the key loop) the groups' output rows */
    __shared__ __align__(16) unsigned char sbuf[RING > OSB ? RING : OSB];
    __shared__ float Ms[NG][R], Ls[NG][R];
    uint4(*ring)[S][UF][2][32] = reinterpret_cast<uint4(*)[S][UF][2][32]>(sbuf);
    float(*Os)[R][HD] = reinterpret_cast<float(*)[R][HD]>(sbuf);

    const kvb_cuda_attn_decode_item it = items[blockIdx.x];
    const kvb_attn_seq sq = a.seqs[it.seq];
    const int gq = a.n_heads / a.n_kv_heads, rows = sq.q_len * gq, past = sq.ctx_len - sq.q_len;
    const size_t row_elems = (size_t)a.n_kv_heads * HD, v_off = (size_t)a.block_size * row_elems;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int gl = lane % LPK, sub = lane / LPK, grp = warp * KPW + sub;
    const float qscale = a.scale * LOG2E;
    const int n_st = (it.k_end - it.k_begin + BKS - 1) / BKS; /* the same for every warp: the shuffles */
    /* the source of a copy past k_end (src-size 0 reads nothing, but the address must be valid) */
    const T *const kfirst = key_row<T>(a, sq.blk_first, it.k_begin, it.kvh, row_elems) + gl * W;

    auto issue = [&](int st) {
        if (st < n_st) {
            const int k0 = it.k_begin + st * BKS + warp * KPS + sub;
#pragma unroll
            for (int u = 0; u < UF; u++) {
                const int key = k0 + u * KPW;
                const bool ok = key < it.k_end;
                const T *kr = ok ? key_row<T>(a, sq.blk_first, key, it.kvh, row_elems) + gl * W : kfirst;
                kvb::cp_async16(&ring[warp][st % S][u][0][lane], kr, ok ? 16 : 0);
                kvb::cp_async16(&ring[warp][st % S][u][1][lane], ok ? kr + v_off : kfirst, ok ? 16 : 0);
            }
        }
        kvb::cp_async_commit(); /* an empty group past the end keeps the wait count uniform */
    };
#pragma unroll
    for (int st = 0; st < S - 1; st++) issue(st); /* in flight while q loads */

    float qf[R][W], o[R][W], m[R], l[R];
    int nvis[R], lo[R];
#pragma unroll
    for (int r = 0; r < R; r++) {
        m[r] = -INFINITY;
        l[r] = 0.0f;
        nvis[r] = r < rows ? past + r / gq + 1 : 0;
        lo[r] = a.window > 0 && nvis[r] > a.window ? nvis[r] - a.window : 0;
#pragma unroll
        for (int j = 0; j < W; j++) o[r][j] = qf[r][j] = 0.0f;
        if (r < rows) {
            int t = r / gq, h = it.kvh * gq + r % gq;
            kvb::load_vec((const T *)a.q + ((size_t)(sq.q_start + t) * a.n_heads + h) * HD + gl * W, qf[r]);
#pragma unroll
            for (int j = 0; j < W; j++) qf[r][j] *= qscale;
        }
    }

    for (int st = 0; st < n_st; st++) {
        issue(st + S - 1);
        kvb::cp_async_wait<S - 1>(); /* stage st has landed */
        const int k0 = it.k_begin + st * BKS + warp * KPS + sub;
        float sc[UF][R];
#pragma unroll
        for (int u = 0; u < UF; u++) {
            float kf[W];
            kvb::unpack_vec<T>(ring[warp][st % S][u][0][lane], kf);
            const int key = k0 + u * KPW;
#pragma unroll
            for (int r = 0; r < R; r++) {
                float acc = 0.0f;
#pragma unroll
                for (int j = 0; j < W; j++) acc += qf[r][j] * kf[j];
#pragma unroll
                for (int off = LPK / 2; off > 0; off >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, off);
                sc[u][r] = key < it.k_end && key < nvis[r] && key >= lo[r] ? acc : -INFINITY;
            }
        }
        float vf[UF][W];
#pragma unroll
        for (int u = 0; u < UF; u++) kvb::unpack_vec<T>(ring[warp][st % S][u][1][lane], vf[u]);
#pragma unroll
        for (int r = 0; r < R; r++) {
            float mx = sc[0][r];
#pragma unroll
            for (int u = 1; u < UF; u++) mx = fmaxf(mx, sc[u][r]);
            float m_new = fmaxf(m[r], mx);
            if (m_new == -INFINITY) continue; /* nothing visible yet: p = 0 for every key */
            float corr = exp2f(m[r] - m_new), p[UF], ps = 0.0f;
#pragma unroll
            for (int u = 0; u < UF; u++) {
                p[u] = exp2f(sc[u][r] - m_new);
                ps += p[u];
            }
            m[r] = m_new;
            l[r] = l[r] * corr + ps;
#pragma unroll
            for (int j = 0; j < W; j++) {
                float acc = o[r][j] * corr;
#pragma unroll
                for (int u = 0; u < UF; u++) acc += p[u] * vf[u][j];
                o[r][j] = acc;
            }
        }
    }
    kvb::cp_async_wait<0>(); /* only empty groups remain; the ring becomes Os below */
    __syncthreads();         /* every warp has read its ring */

    /* merge the groups */
#pragma unroll
    for (int r = 0; r < R; r++) {
#pragma unroll
        for (int j = 0; j < W; j++) Os[grp][r][gl * W + j] = o[r][j];
        if (gl == 0) {
            Ms[grp][r] = m[r];
            Ls[grp][r] = l[r];
        }
    }
    __syncthreads();
    for (int i = tid; i < rows * HD; i += DEC_THREADS) {
        int r = i / HD, d = i % HD;
        float M = -INFINITY;
#pragma unroll
        for (int g = 0; g < NG; g++) M = fmaxf(M, Ms[g][r]);
        float L = 0.0f, O = 0.0f;
        if (M != -INFINITY) {
#pragma unroll
            for (int g = 0; g < NG; g++) {
                float w = Ms[g][r] == -INFINITY ? 0.0f : exp2f(Ms[g][r] - M);
                L += w * Ls[g][r];
                O += w * Os[g][r][d];
            }
        }
        float v = L > 0.0f ? O / L : 0.0f;
        if (it.part < 0) {
            int t = r / gq, h = it.kvh * gq + r % gq;
            ((T *)a.out)[((size_t)(sq.q_start + t) * a.n_heads + h) * HD + d] = kvb::from_f<T>(v);
        } else {
            size_t prow = (size_t)a.groups[it.group].prow + (size_t)it.part * DR;
            a.part_o[(prow + r) * HD + d] = v;
            if (d == 0) a.part_lse[prow + r] = L > 0.0f ? M + log2f(L) : -INFINITY;
        }
    }
    if (it.part >= 0 && kvb::attn::split_done(a, it.group))
        kvb::attn::merge_split<T>(a, sq, it.kvh, 0, 0, gq, rows, it.group, DR);
}

/* ---------------------------------------------------------------- prefill */

template <int HDP> constexpr size_t prefill_smem_bytes() {
    return sizeof(float) * ((size_t)PM * (HDP + 4) + (size_t)PBK * (HDP + 4) + (size_t)PBK * HDP + (size_t)PM * (PBK + 1));
}

/* Thread (ty, tx) = (tid / 8, tid % 8) owns query rows ty and ty + 32 of the tile, score columns
 * tx + 8j (j < 4) of each key tile, and output columns 4 (tx + 8c) .. +3 (c < HDP/32). */
template <typename T, int HDP, bool VP>
__global__ void __launch_bounds__(PRE_THREADS)
    prefill_kernel(const kvb_cuda_attn_args a, const kvb_cuda_attn_prefill_item *__restrict__ items) {
    constexpr int W = VP ? kvb::VEC<T> : 1;
    constexpr int QLD = HDP + 4; /* padded row stride of Qs and Ks: conflict-free float4 reads */
    constexpr int NC = HDP / 32;
    constexpr int PLD = PBK + 1;
    extern __shared__ float4 smem4[];
    float *Qs = reinterpret_cast<float *>(smem4); /* [PM][QLD] prescaled queries */
    float *Ks = Qs + PM * QLD;                    /* [PBK][QLD] keys of the tile */
    float *Vs = Ks + PBK * QLD;                   /* [PBK][HDP] values of the tile */
    float *Ps = Vs + PBK * HDP;                   /* [PM][PLD] probabilities of the tile */

    const kvb_cuda_attn_prefill_item it = items[blockIdx.x];
    const kvb_attn_seq sq = a.seqs[it.seq];
    const int hd = a.head_dim, gq = a.n_heads / a.n_kv_heads;
    const int nh = min(gq, PM), TT = PM / nh;
    const int past = sq.ctx_len - sq.q_len;
    const size_t row_elems = (size_t)a.n_kv_heads * hd, v_off = (size_t)a.block_size * row_elems;
    const int tid = threadIdx.x, ty = tid >> 3, tx = tid & 7;
    const float qscale = a.scale * LOG2E;

    const T *q = (const T *)a.q;
    for (int i = tid; i < PM * QLD; i += PRE_THREADS) {
        int r = i / QLD, d = i % QLD, t = it.t0 + r / nh, hh = it.h0 + r % nh;
        float v = 0.0f;
        if (d < hd && r < TT * nh && t < sq.q_len && hh < gq)
            v = kvb::to_f(q[((size_t)(sq.q_start + t) * a.n_heads + (size_t)it.kvh * gq + hh) * hd + d]) * qscale;
        Qs[i] = v;
    }
    for (int i = tid; i < PBK * QLD; i += PRE_THREADS) Ks[i] = 0.0f; /* the padding stays zero */
    for (int i = tid; i < PBK * HDP; i += PRE_THREADS) Vs[i] = 0.0f;

    int nvis[2], lo[2]; /* each row sees keys [lo, nvis) */
#pragma unroll
    for (int i = 0; i < 2; i++) {
        int r = ty + 32 * i, t = it.t0 + r / nh, hh = it.h0 + r % nh;
        nvis[i] = (r < TT * nh && t < sq.q_len && hh < gq) ? past + t + 1 : 0;
        lo[i] = a.window > 0 && nvis[i] > a.window ? nvis[i] - a.window : 0;
    }
    const int kmax = past + min(it.t0 + TT, sq.q_len); /* keys the tile's last row sees */
    /* the first key the tile's first row sees (every other row's window starts later) */
    const int kmin = a.window > 0 && past + it.t0 + 1 > a.window ? past + it.t0 + 1 - a.window : 0;
    const int dlim = (hd + 3) & ~3;
    const int NS = (hd + W - 1) / W;

    float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.0f, 0.0f};
    float4 o[2][NC];
#pragma unroll
    for (int i = 0; i < 2; i++)
#pragma unroll
        for (int c = 0; c < NC; c++) o[i][c] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    __syncthreads();

    for (int k0 = kmin; k0 < kmax; k0 += PBK) {
        /* K and V of keys [k0, k0 + PBK) into shared memory as f32 */
        for (int i = tid; i < PBK * NS; i += PRE_THREADS) {
            int kk = i / NS, s = i % NS, key = k0 + kk;
            float kf[W], vf[W];
            if (key < kmax) {
                const T *kr = key_row<T>(a, sq.blk_first, key, it.kvh, row_elems) + (size_t)s * W;
                load_slot<T, VP>(kr, kf);
                load_slot<T, VP>(kr + v_off, vf);
            } else {
#pragma unroll
                for (int j = 0; j < W; j++) kf[j] = vf[j] = 0.0f;
            }
#pragma unroll
            for (int j = 0; j < W; j++) {
                Ks[kk * QLD + s * W + j] = kf[j];
                Vs[kk * HDP + s * W + j] = vf[j];
            }
        }
        __syncthreads();

        float sc[2][4] = {{0.0f, 0.0f, 0.0f, 0.0f}, {0.0f, 0.0f, 0.0f, 0.0f}};
#pragma unroll 4
        for (int d = 0; d < dlim; d += 4) {
            float4 q0 = *reinterpret_cast<const float4 *>(&Qs[ty * QLD + d]);
            float4 q1 = *reinterpret_cast<const float4 *>(&Qs[(ty + 32) * QLD + d]);
#pragma unroll
            for (int j = 0; j < 4; j++) {
                float4 kv = *reinterpret_cast<const float4 *>(&Ks[(tx + 8 * j) * QLD + d]);
                sc[0][j] += q0.x * kv.x + q0.y * kv.y + q0.z * kv.z + q0.w * kv.w;
                sc[1][j] += q1.x * kv.x + q1.y * kv.y + q1.z * kv.z + q1.w * kv.w;
            }
        }

#pragma unroll
        for (int i = 0; i < 2; i++) {
            float mx = -INFINITY;
#pragma unroll
            for (int j = 0; j < 4; j++) {
                int key = k0 + tx + 8 * j;
                if (key >= nvis[i] || key < lo[i]) sc[i][j] = -INFINITY;
                mx = fmaxf(mx, sc[i][j]);
            }
            mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
            mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
            mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 4));
            float mn = fmaxf(m[i], mx), alpha = 1.0f, rs = 0.0f, p[4];
            if (mn == -INFINITY) {
#pragma unroll
                for (int j = 0; j < 4; j++) p[j] = 0.0f;
            } else {
                alpha = exp2f(m[i] - mn);
#pragma unroll
                for (int j = 0; j < 4; j++) {
                    p[j] = exp2f(sc[i][j] - mn);
                    rs += p[j];
                }
            }
            rs += __shfl_xor_sync(0xffffffffu, rs, 1);
            rs += __shfl_xor_sync(0xffffffffu, rs, 2);
            rs += __shfl_xor_sync(0xffffffffu, rs, 4);
            l[i] = l[i] * alpha + rs;
            m[i] = mn;
#pragma unroll
            for (int c = 0; c < NC; c++) {
                o[i][c].x *= alpha;
                o[i][c].y *= alpha;
                o[i][c].z *= alpha;
                o[i][c].w *= alpha;
            }
#pragma unroll
            for (int j = 0; j < 4; j++) Ps[(ty + 32 * i) * PLD + tx + 8 * j] = p[j];
        }
        __syncthreads();

#pragma unroll 4
        for (int kk = 0; kk < PBK; kk++) {
            float p0 = Ps[ty * PLD + kk], p1 = Ps[(ty + 32) * PLD + kk];
#pragma unroll
            for (int c = 0; c < NC; c++) {
                float4 v = *reinterpret_cast<const float4 *>(&Vs[kk * HDP + 4 * (tx + 8 * c)]);
                o[0][c].x += p0 * v.x;
                o[0][c].y += p0 * v.y;
                o[0][c].z += p0 * v.z;
                o[0][c].w += p0 * v.w;
                o[1][c].x += p1 * v.x;
                o[1][c].y += p1 * v.y;
                o[1][c].z += p1 * v.z;
                o[1][c].w += p1 * v.w;
            }
        }
        __syncthreads();
    }

    T *out = (T *)a.out;
#pragma unroll
    for (int i = 0; i < 2; i++) {
        if (nvis[i] == 0) continue;
        int r = ty + 32 * i, t = it.t0 + r / nh, hh = it.h0 + r % nh;
        float inv = l[i] > 0.0f ? 1.0f / l[i] : 0.0f;
        T *orow = out + ((size_t)(sq.q_start + t) * a.n_heads + (size_t)it.kvh * gq + hh) * hd;
#pragma unroll
        for (int c = 0; c < NC; c++) {
            int d = 4 * (tx + 8 * c);
            float v[4] = {o[i][c].x * inv, o[i][c].y * inv, o[i][c].z * inv, o[i][c].w * inv};
#pragma unroll
            for (int e = 0; e < 4; e++)
                if (d + e < hd) orow[d + e] = kvb::from_f<T>(v[e]);
        }
    }
}

/* ---------------------------------------------------------------- dispatch */

template <typename T, int HDP, bool VP>
int launch_prefill(const kvb_cuda_attn_args &a, const kvb_cuda_attn_prefill_item *items, int n, cudaStream_t s) {
    constexpr size_t smem = prefill_smem_bytes<HDP>();
    if (smem > 48 * 1024) {
        /* above 48 KiB a kernel must opt in; cheap, and idempotent across threads */
        cudaError_t e = cudaFuncSetAttribute(prefill_kernel<T, HDP, VP>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                             (int)smem);
        if (e != cudaSuccess) return (int)e;
    }
    prefill_kernel<T, HDP, VP><<<n, PRE_THREADS, smem, s>>>(a, items);
    return (int)cudaGetLastError();
}

template <typename T, int HDP, bool VP>
int launch_decode(const kvb_cuda_attn_args &a, const kvb_cuda_attn_decode_item *items, int n, cudaStream_t s) {
    /* the fast kernel where the head fills its padded size and a row fits one warp in 16-byte slots */
    if constexpr (VP && HDP / kvb::VEC<T> <= 32) {
        if (a.head_dim == HDP) {
            if (a.decode_rows <= 4) decode_fast_kernel<T, HDP, 4><<<n, DEC_THREADS, 0, s>>>(a, items);
            else decode_fast_kernel<T, HDP, DR><<<n, DEC_THREADS, 0, s>>>(a, items);
            return (int)cudaGetLastError();
        }
    }
    decode_kernel<T, HDP, VP><<<n, DEC_THREADS, 0, s>>>(a, items);
    return (int)cudaGetLastError();
}

/* Calls F<T, HDP, VP>::run(args...) for the batch's dtype and head size. */
#define KVB_ATTN_DISPATCH(a, LAUNCH, ...)                                                              \
    KVB_CUDA_DISPATCH((a).dtype, T, {                                                                  \
        bool vp = ((size_t)(a).head_dim * sizeof(T)) % 16 == 0;                                        \
        int hd = (a).head_dim;                                                                         \
        if (hd <= 32) return vp ? LAUNCH<T, 32, true>(__VA_ARGS__) : LAUNCH<T, 32, false>(__VA_ARGS__); \
        if (hd <= 64) return vp ? LAUNCH<T, 64, true>(__VA_ARGS__) : LAUNCH<T, 64, false>(__VA_ARGS__); \
        if (hd <= 128)                                                                                 \
            return vp ? LAUNCH<T, 128, true>(__VA_ARGS__) : LAUNCH<T, 128, false>(__VA_ARGS__);        \
        return vp ? LAUNCH<T, 256, true>(__VA_ARGS__) : LAUNCH<T, 256, false>(__VA_ARGS__);            \
    })

int check_args(const kvb_cuda_attn_args *a, cudaStream_t s) {
    if (!s || !a) return (int)cudaErrorInvalidValue;
    if (a->head_dim <= 0 || a->head_dim > KVB_CUDA_ATTN_MAX_HEAD_DIM || a->n_kv_heads <= 0 ||
        a->n_heads % a->n_kv_heads || a->block_size <= 0)
        return (int)cudaErrorInvalidValue;
    return (int)cudaSuccess;
}

} // namespace

extern "C" int kvb_cuda_attention_prefill(const kvb_cuda_attn_args *a, const kvb_cuda_attn_prefill_item *items,
                                          int n_items, kvb_cuda_stream_t s) {
    int e = check_args(a, s);
    if (e || n_items <= 0) return e;
    if (a->prefill_rows != kvb_cuda_attn_prefill_rows(a->dtype, a->head_dim, a->prefill_rows))
        return (int)cudaErrorInvalidValue;
    if (kvb_cuda_attention_prefill_tc(a->dtype, a->head_dim)) return kvb::attn::prefill_tc(*a, items, n_items, s);
    KVB_ATTN_DISPATCH(*a, launch_prefill, *a, items, n_items, s);
    return (int)cudaErrorInvalidValue;
}

extern "C" int kvb_cuda_attention_decode(const kvb_cuda_attn_args *a, const kvb_cuda_attn_decode_item *items,
                                         int n_items, kvb_cuda_stream_t s) {
    int e = check_args(a, s);
    if (e || n_items <= 0) return e;
    KVB_ATTN_DISPATCH(*a, launch_decode, *a, items, n_items, s);
    return (int)cudaErrorInvalidValue;
}

extern "C" int kvb_cuda_attn_prefill_rows(kvb_dtype dt, int head_dim, int tile) {
    if (tile != PM && tile != KVB_CUDA_ATTN_PREFILL_ROWS_MAX) return 0;
    return kvb_cuda_attention_prefill_tc(dt, head_dim) ? tile : PM;
}

extern "C" int kvb_cuda_attn_decode_split_len(int n_keys, int splits) {
    constexpr int M = KVB_CUDA_ATTN_DECODE_MIN_SPLIT;
    if (splits < 1) splits = 1;
    int len = (n_keys + splits - 1) / splits;
    return len < M ? M : (len + M - 1) / M * M;
}

/* Whether launch_decode takes the key-group kernel for this shape, and its lanes a key. */
static int decode_fast_lanes(kvb_dtype dt, int head_dim) {
    size_t es = kvb_dtype_size(dt);
    int pow2 = head_dim == 32 || head_dim == 64 || head_dim == 128 || head_dim == 256;
    if (!pow2 || !es || (head_dim * es) % 16) return 0;
    int lanes = (int)(head_dim * es / 16);
    return lanes <= 32 ? lanes : 0;
}

extern "C" int kvb_cuda_attn_decode_min_split(kvb_dtype dt, int head_dim) {
    int lanes = decode_fast_lanes(dt, head_dim);
    if (!lanes) return KVB_CUDA_ATTN_DECODE_MIN_SPLIT;
    /* a block's stage: DEC_UF keys for each lane group of each warp (8 KiB of K and V); two turns of the
     * ring, so that its DEC_STAGES - 1 stages in flight cover most of the block's keys */
    int stage_keys = DEC_WARPS * (32 / lanes) * DEC_UF;
    int len = 2 * DEC_STAGES * stage_keys;
    return len > KVB_CUDA_ATTN_DECODE_MIN_SPLIT ? len : KVB_CUDA_ATTN_DECODE_MIN_SPLIT;
}

extern "C" int kvb_cuda_attn_decode_splits(kvb_dtype dt, int head_dim, int decode_rows, int n_sm, size_t n_pairs,
                                           int n_keys) {
    int min_len = kvb_cuda_attn_decode_min_split(dt, head_dim);
    if (n_pairs == 0 || n_keys < 2 * min_len || n_sm <= 0) return 1;
    /* the fast kernel (launch_decode) at 8 rows has half the tiled kernel's residency */
    int fast = decode_fast_lanes(dt, head_dim) > 0;
    int resident = KVB_CUDA_ATTN_DECODE_RESIDENT / (fast && decode_rows > 4 ? 2 : 1);
    size_t slots = (size_t)n_sm * (size_t)resident;
    int most = n_keys / min_len; /* every split at least min_len keys */
    size_t lo = (slots + n_pairs - 1) / n_pairs;
    int first = lo < (size_t)most ? (int)lo : most, best = first;
    /* where the split length caps the count, a little over a wave may do worse than fewer splits in one */
    int from = first == most ? (first + 1) / 2 : first;
    unsigned long long best_cost = 0;
    for (int ns = from; ns <= most && ns <= 4 * first; ns++) {
        int len = kvb_cuda_attn_decode_split_len(n_keys, ns), parts = (n_keys + len - 1) / len;
        unsigned long long waves = (n_pairs * (size_t)parts + slots - 1) / slots, cost = waves * (unsigned long long)len;
        if (ns == from || cost < best_cost) {
            best = ns;
            best_cost = cost;
        }
    }
    return best;
}
