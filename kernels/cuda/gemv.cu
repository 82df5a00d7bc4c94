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
 * 9 to 64 rows (skinny_kernel, bf16/f16): tensor cores, with the weights as the MMA's A operand: a
 * block of 4 warps owns 16 weight rows, its warps take the 32-column chunks of the rows in turn
 * (split-K) and sum in shared memory in warp order at the end. Lane (g, t) = (lane / 4, lane % 4) loads
 * 16 bytes of weight rows g and g + 8 at columns 8t.. of a chunk, and 16 bytes of activation row g of
 * each 8-row tile at the same columns: the k order inside a chunk is permuted (logical column 2t + j of
 * a 16-wide MMA step is physical column 8t + 4s + j, 8t + 4s + 2 + j for the upper half), which the
 * sum does not see, so both operands come straight from global memory in mma.m16n8k16's fragment
 * layout (mma.cuh) with no shared-memory staging and no ldmatrix; 4 chunks are in flight per lane.
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
        if (MODE == IN_NORM) v *= rsqrtf(s2 / (float)cols + in.eps);
        T *yp = y + (size_t)tok * rows + r;
        *yp = kvb::from_f<T>(beta != 0.0f ? v + beta * kvb::to_f(*yp) : v);
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

template <typename T, int MODE>
int launch_skinny_n(const void *w, const gemv_in &in, void *y, int rows, int cols, int n, float beta, cudaStream_t s) {
    switch ((n + 7) / 8) {
    case 2: return launch_skinny<T, 2, MODE>(w, in, y, rows, cols, n, beta, s);
    case 3: return launch_skinny<T, 3, MODE>(w, in, y, rows, cols, n, beta, s);
    case 4: return launch_skinny<T, 4, MODE>(w, in, y, rows, cols, n, beta, s);
    case 5: return launch_skinny<T, 5, MODE>(w, in, y, rows, cols, n, beta, s);
    case 6: return launch_skinny<T, 6, MODE>(w, in, y, rows, cols, n, beta, s);
    case 7: return launch_skinny<T, 7, MODE>(w, in, y, rows, cols, n, beta, s);
    default: return launch_skinny<T, 8, MODE>(w, in, y, rows, cols, n, beta, s);
    }
}

template <int MODE>
int dispatch(kvb_dtype dt, const void *w, const gemv_in &in, void *y, int rows, int cols, int n, float beta,
             cudaStream_t s) {
    if (n <= KVB_CUDA_GEMV_MAX_ROWS) {
        if (MODE == IN_PLAIN && dt == KVB_DTYPE_F32) return launch_n<float, IN_PLAIN>(w, in, y, rows, cols, n, beta, s);
        if (dt == KVB_DTYPE_BF16) return launch_n<__nv_bfloat16, MODE>(w, in, y, rows, cols, n, beta, s);
        if (dt == KVB_DTYPE_F16) return launch_n<__half, MODE>(w, in, y, rows, cols, n, beta, s);
    } else if (dt == KVB_DTYPE_BF16) {
        return launch_skinny_n<__nv_bfloat16, MODE>(w, in, y, rows, cols, n, beta, s);
    } else if (dt == KVB_DTYPE_F16) {
        return launch_skinny_n<__half, MODE>(w, in, y, rows, cols, n, beta, s);
    }
    return (int)cudaErrorInvalidValue;
}

} // namespace

extern "C" int kvb_cuda_gemv_fits(kvb_dtype dt, const void *w, const void *x, int cols, int n) {
    size_t es = kvb_dtype_size(dt);
    if (!es || n < 1 || cols <= 0 || ((uintptr_t)w & 15) || ((uintptr_t)x & 15)) return 0;
    if (n <= KVB_CUDA_GEMV_MAX_ROWS) return ((size_t)cols * es) % 16 == 0;
    /* the tensor-core kernel: 16-bit types, whole 32-column chunks */
    return n <= KVB_CUDA_SKINNY_MAX_ROWS && (dt == KVB_DTYPE_BF16 || dt == KVB_DTYPE_F16) && cols % 32 == 0;
}

extern "C" int kvb_cuda_gemv(const void *w, const void *x, void *y, kvb_dtype dt, int rows, int cols, int n, float beta,
                             kvb_cuda_stream_t s) {
    KVB_CUDA_REQUIRE_STREAM(s);
    if (!kvb_cuda_gemv_fits(dt, w, x, cols, n) || rows <= 0) return (int)cudaErrorInvalidValue;
    gemv_in in = {x, (size_t)cols, NULL, 0.0f};
    return dispatch<IN_PLAIN>(dt, w, in, y, rows, cols, n, beta, s);
}

extern "C" int kvb_cuda_gemv_norm(const void *w, const void *x, const float *g, float eps, void *y, kvb_dtype dt,
                                  int rows, int cols, int n, float beta, kvb_cuda_stream_t s) {
    KVB_CUDA_REQUIRE_STREAM(s);
    if (!kvb_cuda_gemv_fits(dt, w, x, cols, n) || rows <= 0 || ((uintptr_t)g & 15) || cols % 8)
        return (int)cudaErrorInvalidValue;
    gemv_in in = {x, (size_t)cols, g, eps};
    return dispatch<IN_NORM>(dt, w, in, y, rows, cols, n, beta, s);
}

extern "C" int kvb_cuda_gemv_swiglu(const void *w, const void *gu, void *y, kvb_dtype dt, int rows, int cols, int n,
                                    float beta, kvb_cuda_stream_t s) {
    KVB_CUDA_REQUIRE_STREAM(s);
    size_t es = kvb_dtype_size(dt);
    /* the up half starts cols elements into each row: it must stay 16-byte aligned */
    if (!kvb_cuda_gemv_fits(dt, w, gu, cols, n) || rows <= 0 || ((size_t)cols * es) % 16) return (int)cudaErrorInvalidValue;
    gemv_in in = {gu, 2 * (size_t)cols, NULL, 0.0f};
    return dispatch<IN_SWIGLU>(dt, w, in, y, rows, cols, n, beta, s);
}
