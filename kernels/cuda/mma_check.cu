/* kvbank — kernels that exercise mma.cuh for tests/test_tensor_core (mma_check.h). */
#include "kernels/cuda/common.cuh"
#include "kernels/cuda/mma.cuh"
#include "kernels/cuda/mma_check.h"

namespace {

/* The two 16-bit elements p[0], p[1] as one register (p[0] in the low half). */
__device__ __forceinline__ uint32_t pair(const uint16_t *p) { return (uint32_t)p[0] | ((uint32_t)p[1] << 16); }

template <typename T>
__global__ void fragments_kernel(const uint16_t *a, const uint16_t *b, const float *c, float *d) {
    const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    uint32_t af[4], bf[2];
    af[0] = pair(a + g * 16 + 2 * t);
    af[1] = pair(a + (g + 8) * 16 + 2 * t);
    af[2] = pair(a + g * 16 + 2 * t + 8);
    af[3] = pair(a + (g + 8) * 16 + 2 * t + 8);
    /* b is [k][n]: b[0] holds B[2t][g] and B[2t+1][g] */
    uint16_t b0[2] = {b[(2 * t) * 8 + g], b[(2 * t + 1) * 8 + g]}, b1[2] = {b[(2 * t + 8) * 8 + g], b[(2 * t + 9) * 8 + g]};
    bf[0] = pair(b0);
    bf[1] = pair(b1);
    float cf[4] = {c[g * 8 + 2 * t], c[g * 8 + 2 * t + 1], c[(g + 8) * 8 + 2 * t], c[(g + 8) * 8 + 2 * t + 1]}, df[4];
    kvb::mma_16816<T>(df, af, bf, cf);
    d[g * 8 + 2 * t] = df[0];
    d[g * 8 + 2 * t + 1] = df[1];
    d[(g + 8) * 8 + 2 * t] = df[2];
    d[(g + 8) * 8 + 2 * t + 1] = df[3];
}

__global__ void ldmatrix_kernel(const uint16_t *m, uint32_t *out) {
    __shared__ __align__(16) uint16_t sm[32][8];
    const int lane = threadIdx.x & 31;
    for (int j = 0; j < 8; j++) sm[lane][j] = m[lane * 8 + j];
    __syncwarp();
    uint32_t r1[1], r2[2], r4[4];
    uint32_t *o = out + lane * 4;
    kvb::ldmatrix<1, false>(r1, &sm[lane][0]);
    o[0] = r1[0], o[1] = o[2] = o[3] = 0;
    o += 32 * 4;
    kvb::ldmatrix<2, false>(r2, &sm[lane][0]);
    o[0] = r2[0], o[1] = r2[1], o[2] = o[3] = 0;
    o += 32 * 4;
    kvb::ldmatrix<4, false>(r4, &sm[lane][0]);
    o[0] = r4[0], o[1] = r4[1], o[2] = r4[2], o[3] = r4[3];
    o += 32 * 4;
    kvb::ldmatrix<1, true>(r1, &sm[lane][0]);
    o[0] = r1[0], o[1] = o[2] = o[3] = 0;
    o += 32 * 4;
    kvb::ldmatrix<2, true>(r2, &sm[lane][0]);
    o[0] = r2[0], o[1] = r2[1], o[2] = o[3] = 0;
    o += 32 * 4;
    kvb::ldmatrix<4, true>(r4, &sm[lane][0]);
    o[0] = r4[0], o[1] = r4[1], o[2] = r4[2], o[3] = r4[3];
}

constexpr int TM = 64, TN = 64, TK = 32, PAD = 8;

/* c tile [64][64] of a . b^T; warp w owns rows 16w..16w+15 and all 64 columns (8 n-tiles of 8). */
template <typename T, bool B_KN>
__global__ void __launch_bounds__(128) gemm_kernel(const T *a, const T *b, float *c, int n, int k, int skip_wait) {
    __shared__ __align__(16) T As[2][TM][TK + PAD];
    __shared__ __align__(16) T Bs[2][B_KN ? TK : TN][B_KN ? TN + PAD : TK + PAD];
    const int tid = threadIdx.x, lane = tid & 31, w = tid >> 5, g = lane >> 2, t = lane & 3;
    const int tiles_n = n / TN, m0 = (blockIdx.x / tiles_n) * TM, n0 = (blockIdx.x % tiles_n) * TN;
    auto load = [&](int kt, int buf) {
        for (int ch = tid; ch < TM * TK / 8; ch += 128) {
            int r = ch / (TK / 8), c8 = ch % (TK / 8);
            kvb::cp_async16(&As[buf][r][c8 * 8], a + (size_t)(m0 + r) * k + kt * TK + c8 * 8);
        }
        for (int ch = tid; ch < TN * TK / 8; ch += 128) {
            if (B_KN) {
                int r = ch / (TN / 8), c8 = ch % (TN / 8);
                kvb::cp_async16(&Bs[buf][r][c8 * 8], b + (size_t)(kt * TK + r) * n + n0 + c8 * 8);
            } else {
                int r = ch / (TK / 8), c8 = ch % (TK / 8);
                kvb::cp_async16(&Bs[buf][r][c8 * 8], b + (size_t)(n0 + r) * k + kt * TK + c8 * 8);
            }
        }
        kvb::cp_async_commit();
    };
    float acc[TN / 8][4];
#pragma unroll
    for (int j = 0; j < TN / 8; j++) acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = 0.0f;
    const int nk = k / TK;
    load(0, 0);
    for (int kt = 0; kt < nk; kt++) {
        const int buf = kt & 1;
        if (kt + 1 < nk) {
            load(kt + 1, buf ^ 1);
            if (!skip_wait) kvb::cp_async_wait<1>();
        } else if (!skip_wait) {
            kvb::cp_async_wait<0>();
        }
        __syncthreads();
#pragma unroll
        for (int kk = 0; kk < TK; kk += 16) {
            uint32_t af[4];
            kvb::ldmatrix<4, false>(af, &As[buf][16 * w + (lane & 15)][kk + 8 * (lane >> 4)]);
#pragma unroll
            for (int j = 0; j < TN / 8; j++) {
                uint32_t bf[2];
                if (B_KN) kvb::ldmatrix<2, true>(bf, &Bs[buf][kk + (lane & 7) + 8 * ((lane >> 3) & 1)][8 * j]);
                else kvb::ldmatrix<2, false>(bf, &Bs[buf][8 * j + (lane & 7)][kk + 8 * ((lane >> 3) & 1)]);
                kvb::mma_16816<T>(acc[j], af, bf, acc[j]);
            }
        }
        __syncthreads();
    }
    if (skip_wait) kvb::cp_async_wait<0>();
#pragma unroll
    for (int j = 0; j < TN / 8; j++) {
        float *row0 = c + (size_t)(m0 + 16 * w + g) * n + n0 + 8 * j + 2 * t, *row1 = row0 + (size_t)8 * n;
        row0[0] = acc[j][0];
        row0[1] = acc[j][1];
        row1[0] = acc[j][2];
        row1[1] = acc[j][3];
    }
}

template <typename T>
int launch_gemm(const void *a, const void *b, float *c, int m, int n, int k, int b_kn, int skip_wait, cudaStream_t s) {
    int blocks = (m / TM) * (n / TN);
    if (b_kn) gemm_kernel<T, true><<<blocks, 128, 0, s>>>((const T *)a, (const T *)b, c, n, k, skip_wait);
    else gemm_kernel<T, false><<<blocks, 128, 0, s>>>((const T *)a, (const T *)b, c, n, k, skip_wait);
    return (int)cudaGetLastError();
}

} // namespace

extern "C" int kvb_cuda_mma_check_fragments(kvb_dtype dt, const void *a, const void *b, const float *c, float *d,
                                            kvb_cuda_stream_t s) {
    KVB_CUDA_REQUIRE_STREAM(s);
    if (dt == KVB_DTYPE_BF16)
        fragments_kernel<__nv_bfloat16><<<1, 32, 0, s>>>((const uint16_t *)a, (const uint16_t *)b, c, d);
    else if (dt == KVB_DTYPE_F16)
        fragments_kernel<__half><<<1, 32, 0, s>>>((const uint16_t *)a, (const uint16_t *)b, c, d);
    else return (int)cudaErrorInvalidValue;
    return (int)cudaGetLastError();
}

extern "C" int kvb_cuda_mma_check_ldmatrix(const uint16_t *m, uint32_t *out, kvb_cuda_stream_t s) {
    KVB_CUDA_REQUIRE_STREAM(s);
    ldmatrix_kernel<<<1, 32, 0, s>>>(m, out);
    return (int)cudaGetLastError();
}

extern "C" int kvb_cuda_mma_check_gemm(kvb_dtype dt, const void *a, const void *b, float *c, int m, int n, int k,
                                       int b_kn, int skip_wait, kvb_cuda_stream_t s) {
    KVB_CUDA_REQUIRE_STREAM(s);
    if (m <= 0 || n <= 0 || k <= 0 || m % TM || n % TN || k % TK) return (int)cudaErrorInvalidValue;
    if (dt == KVB_DTYPE_BF16) return launch_gemm<__nv_bfloat16>(a, b, c, m, n, k, b_kn, skip_wait, s);
    if (dt == KVB_DTYPE_F16) return launch_gemm<__half>(a, b, c, m, n, k, b_kn, skip_wait, s);
    return (int)cudaErrorInvalidValue;
}
