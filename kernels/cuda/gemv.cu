/* kvbank — CUDA products of a weight matrix and a few activation rows for decode (gemv.h).
 *
 * 1 to 8 rows (gemv_kernel), R weight rows a warp because with one every 16-byte weight slot re-read
 * its input slot (and the norm weight, or gate/up and an expf), so L1, not DRAM, bounded the product.
 * A warp owns R rows (1, 2 or 4; pick_r); its lanes walk them in 16-byte slots (VEC<T> elements), U
 * slots of each row in flight per lane; each input slot is loaded (and normalised, or SiLU-multiplied)
 * once and multiplied into the N x R accumulators, and a warp reduction finishes each row. N and R are
 * template parameters (the accumulators live in registers). A row's sum runs in the same order for
 * every R (lane l takes slots l, l + 32, ...): R changes which warp computes a row, never its bits.
 *
 * 9 to 64 rows (bf16/f16) on tensor cores, with the weights as the MMA's A operand. Both variants use
 * one fragment trick: lane (g, t) = (lane / 4, lane % 4) holds 16 bytes of weight rows g and g + 8 at
 * columns 8t.. of a 32-column chunk, and the B fragment it needs is 16 bytes of activation row g at the
 * same columns: the k order inside a chunk is permuted (logical column 2t + j of a 16-wide MMA step is
 * physical column 8t + 4s + j, 8t + 4s + 2 + j for the upper half), which the sum does not see, so
 * weights go from global memory straight into fragment layout with one 16-byte load each.
 *  - v2 (skinny2_kernel, the default): a block of 4 warps owns 128 weight rows (64 above 24 input
 *    rows), each warp 32 (16) of them across the block's whole column range; the block transforms the
 *    input once per tile of columns (norm or SwiGLU applied here, in f32) into shared memory as B
 *    fragments, [chunk][input row][16-byte quarter], so a lane's fragment for 8 input rows is one
 *    conflict-free 16-byte load, and every warp of the block reuses it. Tiles are double-buffered (the
 *    next one is transformed before the current one's weights stream), one barrier a tile; 4 chunks
 *    of each weight row in flight per lane, 4 blocks a multiprocessor. When the weight rows leave the device's
 *    resident blocks idle the columns are split over blocks (kvb_cuda_gemv_plan_of): each writes f32
 *    partials (and its columns' sums of squares), and the block that finishes its rows' group last
 *    adds them in split order (last_of_group), so the bits do not depend on which block merged.
 *  - v1 (skinny_kernel, KVB_CUDA_SKINNY=v1): a block of 4 warps owns 16 weight rows, its warps take
 *    the 32-column chunks in turn (split-K in the block) and sum in shared memory in warp order; every
 *    warp loads its activation fragments from global memory and transforms them on each load, so the
 *    input is re-read (and SwiGLU's expf recomputed) for every 16 weight rows.
 *
 * The input of either kernel is one of (gemv_in):
 *  - plain: x [n][cols];
 *  - norm: RMSNorm(x) with weight g folded in: the product runs on x * g in f32 and each row's sum of
 *    squares is gathered from the same loads, so y = (W . (x * g)) / rms(x) needs no normalised copy
 *    of x and no launch of its own;
 *  - swiglu: silu(gate) * up computed on the load from gu [n][2 cols] (the stacked gate/up product). */
#include "kernels/cuda/common.cuh"
#include "kernels/cuda/gemv.h"
#include "kernels/cuda/mma.cuh"

#include <string.h>

namespace {

constexpr int THREADS = 256;
constexpr int WARPS = THREADS / 32;

enum { IN_PLAIN = 0, IN_NORM = 1, IN_SWIGLU = 2 };

struct gemv_in {
    const void *x;  /* [n][x_stride] */
    size_t x_stride;
    const float *g; /* IN_NORM: [cols] norm weight */
    float eps;      /* IN_NORM */
};

__device__ __forceinline__ float silu(float g) { return g / (1.0f + expf(-g)); }

/* IN_NORM: slot s of the norm weight g, shared by the N input rows. */
template <typename T, int MODE>
__device__ __forceinline__ void load_g(const gemv_in &in, int s, float *gf) {
    if constexpr (MODE == IN_NORM) {
        constexpr int V = kvb::VEC<T>;
        const float4 *gv = reinterpret_cast<const float4 *>(in.g + (size_t)s * V);
#pragma unroll
        for (int j = 0; j < V; j += 4) {
            float4 w = gv[j / 4];
            gf[j] = w.x;
            gf[j + 1] = w.y;
            gf[j + 2] = w.z;
            gf[j + 3] = w.w;
        }
    }
}

/* Slot s (VEC<T> columns) of input row t as floats, gf from load_g; IN_NORM adds the raw values'
 * squares to ss. */
template <typename T, int MODE>
__device__ __forceinline__ void load_in(const gemv_in &in, int t, int s, int cols, const float *gf, float *f, float &ss) {
    constexpr int V = kvb::VEC<T>;
    const T *row = (const T *)in.x + (size_t)t * in.x_stride + (size_t)s * V;
    kvb::load_vec(row, f);
    if constexpr (MODE == IN_NORM) {
#pragma unroll
        for (int j = 0; j < V; j += 4) {
            ss += f[j] * f[j] + f[j + 1] * f[j + 1] + f[j + 2] * f[j + 2] + f[j + 3] * f[j + 3];
            f[j] *= gf[j];
            f[j + 1] *= gf[j + 1];
            f[j + 2] *= gf[j + 2];
            f[j + 3] *= gf[j + 3];
        }
    } else if constexpr (MODE == IN_SWIGLU) {
        float up[V];
        kvb::load_vec(row + cols, up);
#pragma unroll
        for (int j = 0; j < V; j++) f[j] = silu(f[j]) * up[j];
    }
}

/* Slots of each row in flight per lane: 8 in all once a warp has 2 rows or more. */
template <int R> constexpr int U_OF = R >= 2 ? 8 / R : 4;

template <typename T, int N, int R, int MODE>
__global__ void __launch_bounds__(THREADS)
    gemv_kernel(const T *__restrict__ w, const gemv_in in, T *__restrict__ y, int rows, int cols, float beta) {
    constexpr int V = kvb::VEC<T>, U = U_OF<R>;
    const int lane = threadIdx.x & 31;
    const int r0 = (blockIdx.x * WARPS + (threadIdx.x >> 5)) * R;
    if (r0 >= rows) return; /* warp-uniform */
    const int slots = cols / V;
    const uint4 *wr[R];
    bool live[R]; /* warp-uniform: rows past `rows` load nothing and store nothing */
#pragma unroll
    for (int i = 0; i < R; i++) {
        live[i] = r0 + i < rows;
        wr[i] = reinterpret_cast<const uint4 *>(w + (size_t)(live[i] ? r0 + i : r0) * cols);
    }
    float acc[N][R], ss[N];
#pragma unroll
    for (int t = 0; t < N; t++) {
        ss[t] = 0.0f;
#pragma unroll
        for (int i = 0; i < R; i++) acc[t][i] = 0.0f;
    }
    for (int s0 = lane; s0 < slots; s0 += 32 * U) {
        uint4 wv[U][R];
#pragma unroll
        for (int u = 0; u < U; u++) {
            int s = s0 + u * 32;
#pragma unroll
            for (int i = 0; i < R; i++) /* streamed once: evict first */
                wv[u][i] = s < slots && live[i] ? __ldcs(wr[i] + s) : make_uint4(0, 0, 0, 0);
        }
#pragma unroll
        for (int u = 0; u < U; u++) {
            int s = s0 + u * 32;
            if (s >= slots) break;
            float wf[R][V], gf[V];
#pragma unroll
            for (int i = 0; i < R; i++) kvb::unpack_vec<T>(wv[u][i], wf[i]);
            load_g<T, MODE>(in, s, gf);
#pragma unroll
            for (int t = 0; t < N; t++) {
                float xf[V];
                load_in<T, MODE>(in, t, s, cols, gf, xf, ss[t]);
#pragma unroll
                for (int i = 0; i < R; i++)
#pragma unroll
                    for (int j = 0; j < V; j++) acc[t][i] += wf[i][j] * xf[j];
            }
        }
    }
#pragma unroll
    for (int t = 0; t < N; t++) {
        float scale = MODE == IN_NORM ? rsqrtf(kvb::warp_sum(ss[t]) / (float)cols + in.eps) : 1.0f;
#pragma unroll
        for (int i = 0; i < R; i++) {
            acc[t][i] = kvb::warp_sum(acc[t][i]);
            if (MODE == IN_NORM) acc[t][i] *= scale;
        }
    }
    /* lane t * R + i writes row r0 + i of output row t */
    if (lane < N * R && live[lane % R]) {
        float v = acc[0][0];
#pragma unroll
        for (int t = 0; t < N; t++)
#pragma unroll
            for (int i = 0; i < R; i++)
                if (lane == t * R + i) v = acc[t][i];
        T *yp = y + (size_t)(lane / R) * rows + r0 + lane % R;
        *yp = kvb::from_f<T>(beta != 0.0f ? v + beta * kvb::to_f(*yp) : v);
    }
}

/* ---------------------------------------------------------------- 9 to 64 rows on tensor cores */

constexpr int SK_WARPS = 4, SK_THREADS = 32 * SK_WARPS, SK_U = 4;

/* Activation row `tok`'s 8 columns [c, c + 8) as the MMA's B words (two k steps), 0 past the rows. */
template <typename T, int MODE>
__device__ __forceinline__ uint4 load_b(const gemv_in &in, int tok, int n, int c, int cols, float &ss) {
    if (tok >= n) return make_uint4(0, 0, 0, 0);
    if constexpr (MODE == IN_PLAIN) {
        return *reinterpret_cast<const uint4 *>((const T *)in.x + (size_t)tok * in.x_stride + c);
    } else {
        float f[8], gf[8];
        load_g<T, MODE>(in, c / 8, gf);
        load_in<T, MODE>(in, tok, c / 8, cols, gf, f, ss);
        uint4 u;
        u.x = kvb::pack2<T>(f[0], f[1]);
        u.y = kvb::pack2<T>(f[2], f[3]);
        u.z = kvb::pack2<T>(f[4], f[5]);
        u.w = kvb::pack2<T>(f[6], f[7]);
        return u;
    }
}

/* y[tok][r] from its sum v (and the input row's sum of squares ss for IN_NORM). */
template <typename T, int MODE>
__device__ __forceinline__ void store_y(const gemv_in &in, T *y, int rows, int cols, float beta, int tok, int r, float v,
                                        float ss) {
    if (MODE == IN_NORM) v *= rsqrtf(ss / (float)cols + in.eps);
    T *yp = y + (size_t)tok * rows + r;
    *yp = kvb::from_f<T>(beta != 0.0f ? v + beta * kvb::to_f(*yp) : v);
}

/* v1 */
template <typename T, int NT, int MODE>
__global__ void __launch_bounds__(SK_THREADS)
    skinny_kernel(const T *__restrict__ w, const gemv_in in, T *__restrict__ y, int rows, int cols, int n, float beta) {
    __shared__ float red[SK_WARPS][16][NT * 8 + 1]; /* each warp's partial tile, [weight row][token] */
    __shared__ float ssred[SK_WARPS][NT * 8];
    const int lane = threadIdx.x & 31, wp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
    const int r0 = blockIdx.x * 16, chunks = cols / 32;
    const bool ok0 = r0 + g < rows, ok1 = r0 + g + 8 < rows;
    const uint4 *w0 = reinterpret_cast<const uint4 *>(w + (size_t)(ok0 ? r0 + g : 0) * cols) + t;
    const uint4 *w1 = reinterpret_cast<const uint4 *>(w + (size_t)(ok1 ? r0 + g + 8 : 0) * cols) + t;
    float acc[NT][4], ss[NT];
#pragma unroll
    for (int j = 0; j < NT; j++) acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = ss[j] = 0.0f;
    for (int c0 = wp; c0 < chunks; c0 += SK_WARPS * SK_U) {
        uint4 wa[SK_U], wb[SK_U];
#pragma unroll
        for (int u = 0; u < SK_U; u++) {
            int c = c0 + u * SK_WARPS;
            bool in_range = c < chunks;
            wa[u] = in_range && ok0 ? __ldcs(w0 + (size_t)c * 4) : make_uint4(0, 0, 0, 0);
            wb[u] = in_range && ok1 ? __ldcs(w1 + (size_t)c * 4) : make_uint4(0, 0, 0, 0);
        }
#pragma unroll
        for (int u = 0; u < SK_U; u++) {
            int c = c0 + u * SK_WARPS;
            if (c >= chunks) break; /* warp-uniform */
            const uint32_t *a0 = reinterpret_cast<const uint32_t *>(&wa[u]), *a1 = reinterpret_cast<const uint32_t *>(&wb[u]);
#pragma unroll
            for (int j = 0; j < NT; j++) {
                uint4 xb = load_b<T, MODE>(in, j * 8 + g, n, c * 32 + 8 * t, cols, ss[j]);
                const uint32_t *bw = reinterpret_cast<const uint32_t *>(&xb);
#pragma unroll
                for (int s = 0; s < 2; s++) {
                    const uint32_t af[4] = {a0[2 * s], a1[2 * s], a0[2 * s + 1], a1[2 * s + 1]};
                    const uint32_t bf[2] = {bw[2 * s], bw[2 * s + 1]};
                    kvb::mma_16816<T>(acc[j], af, bf, acc[j]);
                }
            }
        }
    }
#pragma unroll
    for (int j = 0; j < NT; j++) {
        red[wp][g][j * 8 + 2 * t] = acc[j][0];
        red[wp][g][j * 8 + 2 * t + 1] = acc[j][1];
        red[wp][g + 8][j * 8 + 2 * t] = acc[j][2];
        red[wp][g + 8][j * 8 + 2 * t + 1] = acc[j][3];
        if (MODE == IN_NORM) {
            float v = ss[j];
            v += __shfl_xor_sync(0xffffffffu, v, 1);
            v += __shfl_xor_sync(0xffffffffu, v, 2);
            if (t == 0) ssred[wp][j * 8 + g] = v;
        }
    }
    __syncthreads();
    for (int i = threadIdx.x; i < 16 * n; i += SK_THREADS) {
        int tok = i / 16, rr = i % 16, r = r0 + rr;
        if (r >= rows) continue;
        float v = 0.0f, s2 = 0.0f;
#pragma unroll
        for (int k = 0; k < SK_WARPS; k++) {
            v += red[k][rr][tok];
            if (MODE == IN_NORM) s2 += ssred[k][tok];
        }
        store_y<T, MODE>(in, y, rows, cols, beta, tok, r, v, s2);
    }
}

/* v2: 4 warps a block, each 16 * MT weight rows; the activation tiles hold SK2_TILE elements each
 * (16 KB), KT columns of NT * 8 input rows. The launch bounds hold 4 blocks a multiprocessor (128
 * registers a thread, 2 x 16 KB of tiles a block). */
constexpr int SK2_WARPS = 4, SK2_THREADS = 32 * SK2_WARPS, SK2_BLOCKS_PER_SM = 4, SK2_U = 4, SK2_TILE = 8192;
/* A split's columns: at least this many chunks; its fixed cost (the pipeline's ramp), in chunks. */
constexpr int SK2_MIN_SPLIT = 4;

/* 16-row MMA tiles a warp: 2 up to 24 input rows; above, the accumulators and the weights in flight
 * would not fit 128 registers (ptxas spills at 32 input rows). */
constexpr int sk2_mt(int nt) { return nt <= 3 ? 2 : 1; }

template <int NT> struct sk2 {
    static constexpr int NPAD = NT * 8;             /* input rows, padded to whole MMA n tiles */
    static constexpr int KC = SK2_TILE / NPAD / 32; /* 32-column chunks a tile */
    static constexpr int MT = sk2_mt(NT);
    static constexpr int BM = SK2_WARPS * MT * 16;  /* weight rows a block */
};

static int sk2_block_rows(int n) { return SK2_WARPS * sk2_mt((n + 7) / 8) * 16; }
static int sk2_tile_chunks(int n) { return SK2_TILE / (((n + 7) / 8) * 8) / 32; }

/* Transforms columns [32 c0, 32 (c0 + nc)) of the input into the tile xs as B fragments: group q (8
 * columns) of input row r at xs[((q / 4) * NPAD + r) * 4 + q % 4]; zeros past n rows and past cols.
 * Warp w takes input rows w, w + 4, ..., its lane l groups l, l + 32, ...; IN_NORM adds the raw
 * values' squares to ssl[r][l], a slot only that lane writes, in column order. */
template <typename T, int NT, int MODE>
__device__ __forceinline__ void sk2_fill(uint4 *xs, const gemv_in &in, int n, int cols, int c0, int nc, float (*ssl)[32]) {
    constexpr int NPAD = sk2<NT>::NPAD;
    const int lane = threadIdx.x & 31, wp = threadIdx.x >> 5;
    for (int r = wp; r < NPAD; r += SK2_WARPS) {
        float ss = 0.0f;
        for (int q = lane; q < nc * 4; q += 32) {
            int c = c0 * 32 + q * 8;
            xs[((q >> 2) * NPAD + r) * 4 + (q & 3)] = c < cols ? load_b<T, MODE>(in, r, n, c, cols, ss) : make_uint4(0, 0, 0, 0);
        }
        if constexpr (MODE == IN_NORM) ssl[r][lane] += ss;
    }
}

template <typename T, int NT, int MODE>
__global__ void __launch_bounds__(SK2_THREADS, SK2_BLOCKS_PER_SM)
    skinny2_kernel(const T *__restrict__ w, const gemv_in in, T *__restrict__ y, int rows, int cols, int n, float beta,
                   int splits, float *__restrict__ part, int32_t *__restrict__ counters) {
    constexpr int NPAD = sk2<NT>::NPAD, KC = sk2<NT>::KC, MT = sk2<NT>::MT, BM = sk2<NT>::BM, U = SK2_U;
    __shared__ uint4 xs[2][KC * NPAD * 4];
    __shared__ float ssl[MODE == IN_NORM ? NPAD : 1][32], sst[NPAD];
    const int lane = threadIdx.x & 31, wp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
    const int rb = blockIdx.x / splits, sp = blockIdx.x % splits, chunks = (cols + 31) / 32;
    const int kc0 = (int)((int64_t)chunks * sp / splits), kc1 = (int)((int64_t)chunks * (sp + 1) / splits);
    const int rw = rb * BM + wp * MT * 16; /* the warp's first row */
    const uint4 *wr[MT][2];
    bool ok[MT][2];
#pragma unroll
    for (int m = 0; m < MT; m++)
#pragma unroll
        for (int h = 0; h < 2; h++) {
            int r = rw + m * 16 + h * 8 + g;
            ok[m][h] = r < rows;
            wr[m][h] = reinterpret_cast<const uint4 *>(w + (size_t)(ok[m][h] ? r : 0) * cols) + t;
        }
    float acc[MT][NT][4];
#pragma unroll
    for (int m = 0; m < MT; m++)
#pragma unroll
        for (int j = 0; j < NT; j++) acc[m][j][0] = acc[m][j][1] = acc[m][j][2] = acc[m][j][3] = 0.0f;
    if constexpr (MODE == IN_NORM)
        for (int r = wp; r < NPAD; r += SK2_WARPS) ssl[r][lane] = 0.0f; /* the slots sk2_fill's lane owns */

    const int n_tiles = (kc1 - kc0 + KC - 1) / KC;
    sk2_fill<T, NT, MODE>(xs[0], in, n, cols, kc0, KVB_MIN(KC, kc1 - kc0), ssl);
    __syncthreads();
    for (int ti = 0; ti < n_tiles; ti++) {
        const int tc0 = kc0 + ti * KC, tn = KVB_MIN(KC, kc1 - tc0);
        const uint4 *xb = xs[ti & 1];
        /* the next tile, into the other buffer (last read before the previous barrier) */
        if (ti + 1 < n_tiles)
            sk2_fill<T, NT, MODE>(xs[(ti + 1) & 1], in, n, cols, tc0 + KC, KVB_MIN(KC, kc1 - tc0 - KC), ssl);
        for (int c = 0; c < tn; c += U) {
            uint4 wv[U][MT][2];
#pragma unroll
            for (int u = 0; u < U; u++) {
                int kc = tc0 + c + u;
                bool live = c + u < tn && kc * 32 + t * 8 < cols;
#pragma unroll
                for (int m = 0; m < MT; m++)
#pragma unroll
                    for (int h = 0; h < 2; h++) /* streamed once: evict first */
                        wv[u][m][h] = live && ok[m][h] ? __ldcs(wr[m][h] + (size_t)kc * 4) : make_uint4(0, 0, 0, 0);
            }
#pragma unroll
            for (int u = 0; u < U; u++) {
                if (c + u >= tn) break; /* warp-uniform */
#pragma unroll
                for (int j = 0; j < NT; j++) {
                    uint4 xv = xb[((c + u) * NPAD + j * 8 + g) * 4 + t];
                    const uint32_t *bw = reinterpret_cast<const uint32_t *>(&xv);
#pragma unroll
                    for (int m = 0; m < MT; m++) {
                        const uint32_t *a0 = reinterpret_cast<const uint32_t *>(&wv[u][m][0]);
                        const uint32_t *a1 = reinterpret_cast<const uint32_t *>(&wv[u][m][1]);
#pragma unroll
                        for (int s = 0; s < 2; s++) {
                            const uint32_t af[4] = {a0[2 * s], a1[2 * s], a0[2 * s + 1], a1[2 * s + 1]};
                            const uint32_t bf[2] = {bw[2 * s], bw[2 * s + 1]};
                            kvb::mma_16816<T>(acc[m][j], af, bf, acc[m][j]);
                        }
                    }
                }
            }
        }
        __syncthreads();
    }
    if constexpr (MODE == IN_NORM) { /* this split's sum of squares of each input row, lanes in order */
        for (int r = threadIdx.x; r < NPAD; r += SK2_THREADS) {
            float v = 0.0f;
            for (int l = 0; l < 32; l++) v += ssl[r][l];
            sst[r] = v;
        }
        __syncthreads();
    }
    /* acc[m][j][e] is weight row rw + 16 m + g (+ 8 for e >= 2), input row 8 j + 2 t + (e & 1); split,
     * the partials go to [split][input row][weight row], the sums of squares to [row block][split][input row] */
    float *ssp = part + (size_t)splits * n * rows;
#pragma unroll
    for (int m = 0; m < MT; m++)
#pragma unroll
        for (int j = 0; j < NT; j++)
#pragma unroll
            for (int e = 0; e < 4; e++) {
                int r = rw + m * 16 + g + (e >> 1) * 8, tok = j * 8 + 2 * t + (e & 1);
                if (r >= rows || tok >= n) continue;
                if (splits == 1) store_y<T, MODE>(in, y, rows, cols, beta, tok, r, acc[m][j][e], sst[tok]);
                else part[((size_t)sp * n + tok) * rows + r] = acc[m][j][e];
            }
    if (splits == 1) return;
    if (MODE == IN_NORM)
        for (int tok = threadIdx.x; tok < n; tok += SK2_THREADS) ssp[((size_t)rb * splits + sp) * n + tok] = sst[tok];
    if (!kvb::last_of_group(&counters[rb], splits)) return;
    for (int i = threadIdx.x; i < n * BM; i += SK2_THREADS) {
        int tok = i / BM, r = rb * BM + i % BM;
        if (r >= rows) continue;
        float v = 0.0f, s2 = 0.0f;
        for (int k = 0; k < splits; k++) {
            v += __ldcg(part + ((size_t)k * n + tok) * rows + r);
            if (MODE == IN_NORM) s2 += __ldcg(ssp + ((size_t)rb * splits + k) * n + tok);
        }
        store_y<T, MODE>(in, y, rows, cols, beta, tok, r, v, s2);
    }
}

/* Rows per warp: as many as keep the grid at MIN_WARPS warps or more (256 blocks: about two per SM of
 * a 132-SM H100/H200, so the input loads shared by R rows do not cost idle SMs), and at most 2 above 4
 * input rows, where acc[N][R] and the R * U weight slots in flight would crowd the registers. */
constexpr int MIN_WARPS = 2048;

static int pick_r(int rows, int n) {
    int r = n <= 4 ? 4 : 2;
    while (r > 1 && rows / r < MIN_WARPS) r /= 2;
    return r;
}

template <typename T, int N, int MODE>
int launch(const void *w, const gemv_in &in, void *y, int rows, int cols, float beta, cudaStream_t s) {
    int r = pick_r(rows, N), warps = (rows + r - 1) / r, blocks = (warps + WARPS - 1) / WARPS;
    if (r == 4) {
        if constexpr (N <= 4) gemv_kernel<T, N, 4, MODE><<<blocks, THREADS, 0, s>>>((const T *)w, in, (T *)y, rows, cols, beta);
    } else if (r == 2) {
        gemv_kernel<T, N, 2, MODE><<<blocks, THREADS, 0, s>>>((const T *)w, in, (T *)y, rows, cols, beta);
    } else {
        gemv_kernel<T, N, 1, MODE><<<blocks, THREADS, 0, s>>>((const T *)w, in, (T *)y, rows, cols, beta);
    }
    return (int)cudaGetLastError();
}

template <typename T, int MODE>
int launch_n(const void *w, const gemv_in &in, void *y, int rows, int cols, int n, float beta, cudaStream_t s) {
    switch (n) {
    case 1: return launch<T, 1, MODE>(w, in, y, rows, cols, beta, s);
    case 2: return launch<T, 2, MODE>(w, in, y, rows, cols, beta, s);
    case 3: return launch<T, 3, MODE>(w, in, y, rows, cols, beta, s);
    case 4: return launch<T, 4, MODE>(w, in, y, rows, cols, beta, s);
    case 5: return launch<T, 5, MODE>(w, in, y, rows, cols, beta, s);
    case 6: return launch<T, 6, MODE>(w, in, y, rows, cols, beta, s);
    case 7: return launch<T, 7, MODE>(w, in, y, rows, cols, beta, s);
    default: return launch<T, 8, MODE>(w, in, y, rows, cols, beta, s);
    }
}

template <typename T, int NT, int MODE>
int launch_skinny(const void *w, const gemv_in &in, void *y, int rows, int cols, int n, float beta, cudaStream_t s) {
    skinny_kernel<T, NT, MODE><<<(rows + 15) / 16, SK_THREADS, 0, s>>>((const T *)w, in, (T *)y, rows, cols, n, beta);
    return (int)cudaGetLastError();
}

template <typename T, int NT, int MODE>
int launch_skinny2(const kvb_cuda_gemv_ctx *g, const void *w, const gemv_in &in, void *y, int rows, int cols, int n,
                   float beta, cudaStream_t s) {
    kvb_cuda_gemv_plan p;
    kvb_cuda_gemv_plan_of(g, rows, cols, n, &p);
    if (p.splits > 1 && (!g->part || !g->counters)) return (int)cudaErrorInvalidValue;
    skinny2_kernel<T, NT, MODE><<<p.blocks, SK2_THREADS, 0, s>>>((const T *)w, in, (T *)y, rows, cols, n, beta, p.splits,
                                                                 g->part, g->counters);
    return (int)cudaGetLastError();
}

template <typename T, int MODE>
int launch_skinny_n(kvb_cuda_gemv_ctx *g, const void *w, const gemv_in &in, void *y, int rows, int cols, int n,
                    float beta, cudaStream_t s) {
#define KVB_SKINNY_CASE(NT)                                                                                     \
    case NT:                                                                                                    \
        return g->skinny == KVB_CUDA_SKINNY_V1 ? launch_skinny<T, NT, MODE>(w, in, y, rows, cols, n, beta, s)    \
                                               : launch_skinny2<T, NT, MODE>(g, w, in, y, rows, cols, n, beta, s);
    g->launched[g->skinny == KVB_CUDA_SKINNY_V1 ? KVB_CUDA_GEMV_K_SKINNY_V1 : KVB_CUDA_GEMV_K_SKINNY_V2]++;
    switch ((n + 7) / 8) {
        KVB_SKINNY_CASE(2)
        KVB_SKINNY_CASE(3)
        KVB_SKINNY_CASE(4)
        KVB_SKINNY_CASE(5)
        KVB_SKINNY_CASE(6)
        KVB_SKINNY_CASE(7)
    default:
        KVB_SKINNY_CASE(8)
    }
#undef KVB_SKINNY_CASE
}

template <int MODE>
int dispatch(kvb_cuda_gemv_ctx *g, kvb_dtype dt, const void *w, const gemv_in &in, void *y, int rows, int cols, int n,
             float beta, cudaStream_t s) {
    if (n <= KVB_CUDA_GEMV_MAX_ROWS) {
        g->launched[KVB_CUDA_GEMV_K_GEMV]++;
        if (MODE == IN_PLAIN && dt == KVB_DTYPE_F32) return launch_n<float, IN_PLAIN>(w, in, y, rows, cols, n, beta, s);
        if (dt == KVB_DTYPE_BF16) return launch_n<__nv_bfloat16, MODE>(w, in, y, rows, cols, n, beta, s);
        if (dt == KVB_DTYPE_F16) return launch_n<__half, MODE>(w, in, y, rows, cols, n, beta, s);
    } else if (dt == KVB_DTYPE_BF16) {
        return launch_skinny_n<__nv_bfloat16, MODE>(g, w, in, y, rows, cols, n, beta, s);
    } else if (dt == KVB_DTYPE_F16) {
        return launch_skinny_n<__half, MODE>(g, w, in, y, rows, cols, n, beta, s);
    }
    return (int)cudaErrorInvalidValue;
}

} // namespace

extern "C" int kvb_cuda_skinny_parse(const char *s) {
    if (!s || !*s || !strcmp(s, "v2")) return KVB_CUDA_SKINNY_V2;
    if (!strcmp(s, "v1")) return KVB_CUDA_SKINNY_V1;
    return -1;
}

extern "C" const char *kvb_cuda_skinny_name(int skinny) { return skinny == KVB_CUDA_SKINNY_V1 ? "v1" : "v2"; }

/* Splits: the count whose whole waves of resident blocks times a block's chunks (plus its fixed cost:
 * the ramp, and a split's partials, n / 16 chunks of weight bytes as they go through L2) is least,
 * the fewer on a tie; each split at least SK2_MIN_SPLIT chunks. A block of a wave that is not full
 * does not run faster: the device's bandwidth, not the block, bounds it. */
extern "C" void kvb_cuda_gemv_plan_of(const kvb_cuda_gemv_ctx *g, int rows, int cols, int n, kvb_cuda_gemv_plan *out) {
    int bm = sk2_block_rows(n), rb = (rows + bm - 1) / bm, chunks = (cols + 31) / 32, kc = sk2_tile_chunks(n);
    int64_t slots = (int64_t)KVB_MAX(g->n_sm, 1) * SK2_BLOCKS_PER_SM;
    int best = 1, max_s = KVB_MAX(1, KVB_MIN(chunks / SK2_MIN_SPLIT, 256));
    double best_cost = 0.0;
    for (int sp = 1; sp <= max_s; sp++) {
        int64_t blocks = (int64_t)rb * sp;
        if (blocks > INT32_MAX) break;
        double waves = (double)((blocks + slots - 1) / slots);
        double cost = waves * ((chunks + sp - 1) / sp + 1.0 + (sp > 1 ? n / 16.0 : 0.0));
        if (sp == 1 || cost < best_cost) {
            best = sp;
            best_cost = cost;
        }
    }
    int widest = (chunks + best - 1) / best;
    kvb_cuda_gemv_plan p = {bm, best, rb * best, (widest + kc - 1) / kc};
    *out = p;
}

extern "C" size_t kvb_cuda_gemv_workspace(const kvb_cuda_gemv_ctx *g, kvb_dtype dt, int rows, int cols, int n,
                                          size_t *n_counters) {
    *n_counters = 0;
    if (n <= KVB_CUDA_GEMV_MAX_ROWS || g->skinny == KVB_CUDA_SKINNY_V1 || dt == KVB_DTYPE_F32) return 0;
    kvb_cuda_gemv_plan p;
    kvb_cuda_gemv_plan_of(g, rows, cols, n, &p);
    if (p.splits == 1) return 0;
    *n_counters = (size_t)(p.blocks / p.splits);
    /* the partials, then the sums of squares of each row block's splits */
    return (size_t)p.splits * (size_t)n * (size_t)rows + (size_t)p.blocks * (size_t)n;
}

extern "C" int kvb_cuda_gemv_fits(const kvb_cuda_gemv_ctx *g, kvb_dtype dt, const void *w, const void *x, int cols, int n) {
    size_t es = kvb_dtype_size(dt);
    if (!es || n < 1 || cols <= 0 || ((uintptr_t)w & 15) || ((uintptr_t)x & 15) || ((size_t)cols * es) % 16) return 0;
    if (n <= KVB_CUDA_GEMV_MAX_ROWS) return 1;
    /* the tensor-core kernels: 16-bit types; v1 takes whole 32-column chunks */
    return n <= KVB_CUDA_SKINNY_MAX_ROWS && (dt == KVB_DTYPE_BF16 || dt == KVB_DTYPE_F16) &&
           (g->skinny != KVB_CUDA_SKINNY_V1 || cols % 32 == 0);
}

extern "C" int kvb_cuda_gemv(kvb_cuda_gemv_ctx *g, const void *w, const void *x, void *y, kvb_dtype dt, int rows, int cols,
                             int n, float beta, kvb_cuda_stream_t s) {
    KVB_CUDA_REQUIRE_STREAM(s);
    if (!kvb_cuda_gemv_fits(g, dt, w, x, cols, n) || rows <= 0) return (int)cudaErrorInvalidValue;
    gemv_in in = {x, (size_t)cols, NULL, 0.0f};
    return dispatch<IN_PLAIN>(g, dt, w, in, y, rows, cols, n, beta, s);
}

extern "C" int kvb_cuda_gemv_norm(kvb_cuda_gemv_ctx *g, const void *w, const void *x, const float *gn, float eps, void *y,
                                  kvb_dtype dt, int rows, int cols, int n, float beta, kvb_cuda_stream_t s) {
    KVB_CUDA_REQUIRE_STREAM(s);
    if (!kvb_cuda_gemv_fits(g, dt, w, x, cols, n) || rows <= 0 || ((uintptr_t)gn & 15) || cols % 8)
        return (int)cudaErrorInvalidValue;
    gemv_in in = {x, (size_t)cols, gn, eps};
    return dispatch<IN_NORM>(g, dt, w, in, y, rows, cols, n, beta, s);
}

extern "C" int kvb_cuda_gemv_swiglu(kvb_cuda_gemv_ctx *g, const void *w, const void *gu, void *y, kvb_dtype dt, int rows,
                                    int cols, int n, float beta, kvb_cuda_stream_t s) {
    KVB_CUDA_REQUIRE_STREAM(s);
    /* the up half starts cols elements into each row: 16-byte aligned by kvb_cuda_gemv_fits' condition */
    if (!kvb_cuda_gemv_fits(g, dt, w, gu, cols, n) || rows <= 0) return (int)cudaErrorInvalidValue;
    gemv_in in = {gu, 2 * (size_t)cols, NULL, 0.0f};
    return dispatch<IN_SWIGLU>(g, dt, w, in, y, rows, cols, n, beta, s);
}
