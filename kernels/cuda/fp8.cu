/* kvbank — FP8 weights on the CUDA backend (fp8.h): per-token quantization of activations, products that
 * widen E4M3 in registers (decode GEMV, tiled GEMM), and the W8A8 tensor-core product through cuBLASLt. */
#include <cfloat>
#include <cstdio>
#include <cstring>
#include <dlfcn.h>
#include <pthread.h>

#include "config.h" /* KVB_CUDA_LIBDIR */
#include "kernels/cuda/common.cuh"
#include "kernels/cuda/fp8.h"
#include "kernels/cuda/gemv.h"

#ifndef KVB_CUBLAS_LINKED
#include <cublasLt.h>
#endif

namespace {

/* ---------------------------------------------------------------- E4M3 on the device */

__device__ __forceinline__ float bits_f(uint32_t b) {
    float f;
    memcpy(&f, &b, 4);
    return f;
}

__device__ __forceinline__ uint32_t f_bits(float f) {
    uint32_t b;
    memcpy(&b, &f, 4);
    return b;
}

/* exact: a normal value's exponent moved by integer arithmetic, a subnormal's m * 2^-9 (no f32 subnormal
 * is formed, so a flush-to-zero build changes nothing); NaN bytes are refused at load */
__device__ __forceinline__ float e4m3_f(uint32_t b) {
    uint32_t mag = b & 0x7f;
    float f = mag < 8 ? (float)mag * 0x1p-9f : bits_f((mag << 20) + (120u << 23));
    return b & 0x80 ? -f : f;
}

/* IEEE single additions, never contracted or reassociated */
__device__ __forceinline__ float add_rn(float a, float b) {
#ifdef __CUDA_ARCH__
    return __fadd_rn(a, b);
#else
    return a + b;
#endif
}

__device__ __forceinline__ float div_rn(float a, float b) {
#ifdef __CUDA_ARCH__
    return __fdiv_rn(a, b);
#else
    return a / b;
#endif
}

/* v in [-448, 448] to its nearest E4M3 byte, ties to even: kvb_e4m3_round's sum with the binade's 2^23
 * quantum, then the bits */
__device__ __forceinline__ uint8_t e4m3_byte(float v) {
    float a = fabsf(v);
    int e = (int)(f_bits(a) >> 23) - 3;
    if (e < 127 - 9) e = 127 - 9;
    float m = bits_f((uint32_t)(e + 23) << 23);
    float r = add_rn(add_rn(a, m), -m);
    uint32_t rb = f_bits(r);
    uint32_t q = r >= 0x1p-6f ? ((((rb >> 23) - 120u) << 3) | ((rb >> 20) & 7u)) : (uint32_t)(r * 512.0f);
    return (uint8_t)(q | (f_bits(v) >> 31 << 7));
}

/* ---------------------------------------------------------------- per-token quantization */

constexpr int QUANT_THREADS = 256;

/* One block per token: the row's max |x|, then every element. */
template <typename T>
__global__ void __launch_bounds__(QUANT_THREADS)
    quant_kernel(const T *__restrict__ x, int cols, uint8_t *__restrict__ q, float *__restrict__ qs) {
    __shared__ float red[32];
    const T *xr = x + (size_t)blockIdx.x * cols;
    float m = 0.0f;
    for (int c = threadIdx.x; c < cols; c += blockDim.x) m = fmaxf(m, fabsf(kvb::to_f(xr[c])));
    m = kvb::warp_max(m);
    __syncthreads();
    if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = m;
    __syncthreads();
    m = (int)(threadIdx.x & 31) < (int)(blockDim.x >> 5) ? red[threadIdx.x & 31] : 0.0f;
    m = kvb::warp_max(m);
    float s = div_rn(m, 448.0f);
    if (s == 0.0f) s = FLT_EPSILON;
    uint8_t *qr = q + (size_t)blockIdx.x * cols;
    for (int c = threadIdx.x; c < cols; c += blockDim.x)
        qr[c] = e4m3_byte(fminf(fmaxf(div_rn(kvb::to_f(xr[c]), s), -448.0f), 448.0f));
    if (threadIdx.x == 0) qs[blockIdx.x] = s;
}

/* ---------------------------------------------------------------- products that widen in registers */

/* 16 elements of row x at column c as floats: activations of T, or E4M3 bytes */
template <typename T> __device__ __forceinline__ void load16(const T *x, float *f) {
#pragma unroll
    for (int i = 0; i < 16; i += kvb::VEC<T>) kvb::load_vec(x + i, f + i);
}
template <> __device__ __forceinline__ void load16<uint8_t>(const uint8_t *x, float *f) {
    uint4 u = *reinterpret_cast<const uint4 *>(x);
    const uint8_t *b = reinterpret_cast<const uint8_t *>(&u);
#pragma unroll
    for (int i = 0; i < 16; i++) f[i] = e4m3_f(b[i]);
}

/* y's element: the sum times the weight row's and the x row's scales, plus beta y */
template <typename Y>
__device__ __forceinline__ void put(Y *y, float v, float ws, const float *xs, int t, float beta) {
    v *= ws;
    if (xs) v *= xs[t];
    *y = kvb::from_f<Y>(beta != 0.0f ? v + beta * kvb::to_f(*y) : v);
}

constexpr int GEMV_THREADS = 256;
constexpr int GEMV_WARPS = GEMV_THREADS / 32;

/* Decode (N <= KVB_CUDA_GEMV_MAX_ROWS rows of x): one warp per weight row, 16 E4M3 bytes a lane at a
 * time (one 16-byte load), each widened and multiplied into the N rows' accumulators (gemv.cu's shape). */
template <typename X, typename Y, int N>
__global__ void __launch_bounds__(GEMV_THREADS)
    gemv_kernel(const uint8_t *__restrict__ w, const float *__restrict__ wscale, int scale_step, const X *__restrict__ x,
                const float *__restrict__ xs, Y *__restrict__ y, int rows, int cols, float beta) {
    const int lane = threadIdx.x & 31;
    const int r = blockIdx.x * GEMV_WARPS + (threadIdx.x >> 5);
    if (r >= rows) return; /* warp-uniform */
    const uint4 *wr = reinterpret_cast<const uint4 *>(w + (size_t)r * cols);
    float acc[N];
#pragma unroll
    for (int t = 0; t < N; t++) acc[t] = 0.0f;
    for (int s = lane; s < cols / 16; s += 32) {
        float wf[16], xf[16];
        load16<uint8_t>(reinterpret_cast<const uint8_t *>(wr + s), wf);
#pragma unroll
        for (int t = 0; t < N; t++) {
            load16<X>(x + (size_t)t * cols + (size_t)s * 16, xf);
#pragma unroll
            for (int j = 0; j < 16; j++) acc[t] += wf[j] * xf[j];
        }
    }
#pragma unroll
    for (int t = 0; t < N; t++) acc[t] = kvb::warp_sum(acc[t]);
    if (lane < N) {
        float v = acc[0];
#pragma unroll
        for (int t = 1; t < N; t++)
            if (lane == t) v = acc[t];
        put(y + (size_t)lane * rows + r, v, wscale[(size_t)r * scale_step], xs, lane, beta);
    }
}

/* Above: 64 weight rows x 64 rows of x per block, 16 columns at a time through shared memory (both
 * widened to f32 as they are staged), 4 x 4 outputs a thread. */
constexpr int TM = 64, TN = 64, TK = 16, GEMM_THREADS = 256;

template <typename X, typename Y>
__global__ void __launch_bounds__(GEMM_THREADS)
    gemm_kernel(const uint8_t *__restrict__ w, const float *__restrict__ wscale, int scale_step, const X *__restrict__ x,
                const float *__restrict__ xs, Y *__restrict__ y, int rows, int cols, int n, float beta) {
    __shared__ float ws_[TK][TM + 1], xs_[TK][TN + 1];
    const int row_blocks = (rows + TM - 1) / TM; /* a 1-D grid: row blocks vary fastest */
    const int r0 = (int)(blockIdx.x % row_blocks) * TM, t0 = (int)(blockIdx.x / row_blocks) * TN;
    const int tr = (threadIdx.x % 16) * 4, tt = (threadIdx.x / 16) * 4;
    float acc[4][4] = {};
    for (int k0 = 0; k0 < cols; k0 += TK) {
        /* 64 x 16 of each operand: 4 elements a thread */
        for (int i = threadIdx.x; i < TM * TK; i += GEMM_THREADS) {
            int rr = i / TK, kk = i % TK, r = r0 + rr, t = t0 + rr, k = k0 + kk;
            ws_[kk][rr] = r < rows && k < cols ? e4m3_f(w[(size_t)r * cols + k]) : 0.0f;
            float xv = 0.0f;
            if (t < n && k < cols) {
                if constexpr (sizeof(X) == 1) xv = e4m3_f(((const uint8_t *)x)[(size_t)t * cols + k]);
                else xv = kvb::to_f(x[(size_t)t * cols + k]);
            }
            xs_[kk][rr] = xv;
        }
        __syncthreads();
#pragma unroll
        for (int kk = 0; kk < TK; kk++) {
            float a[4], b[4];
#pragma unroll
            for (int i = 0; i < 4; i++) a[i] = ws_[kk][tr + i], b[i] = xs_[kk][tt + i];
#pragma unroll
            for (int i = 0; i < 4; i++)
#pragma unroll
                for (int j = 0; j < 4; j++) acc[i][j] += a[i] * b[j];
        }
        __syncthreads();
    }
#pragma unroll
    for (int i = 0; i < 4; i++)
#pragma unroll
        for (int j = 0; j < 4; j++) {
            int r = r0 + tr + i, t = t0 + tt + j;
            if (r < rows && t < n) put(y + (size_t)t * rows + r, acc[i][j], wscale[(size_t)r * scale_step], xs, t, beta);
        }
}

/* y = acc * ws[r] * xs[t] + beta y over the f32 products cuBLASLt made without scales. */
template <typename Y>
__global__ void scale_kernel(const float *__restrict__ acc, const float *__restrict__ wscale, int scale_step,
                             const float *__restrict__ xs, Y *__restrict__ y, int rows, int n, float beta) {
    size_t total = (size_t)rows * n;
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < total; i += (size_t)gridDim.x * blockDim.x) {
        int t = (int)(i / rows), r = (int)(i % rows);
        put(y + i, acc[i], wscale[(size_t)r * scale_step], xs, t, beta);
    }
}

int launch_scale(const float *acc, const kvb_tensor *w, const float *qs, void *y, kvb_dtype dt, int rows, int n,
                 float beta, cudaStream_t s) {
    int grid = kvb_cuda_grid((size_t)rows * n, 256), step = w->n_scale == 1 ? 0 : 1;
    KVB_CUDA_DISPATCH(dt, T, {
        scale_kernel<T><<<grid, 256, 0, s>>>(acc, w->scale, step, qs, (T *)y, rows, n, beta);
        return (int)cudaGetLastError();
    });
    return (int)cudaErrorInvalidValue;
}

template <typename X, typename Y, int N>
int launch_gemv(const uint8_t *w, const float *wscale, int step, const void *x, const float *xs, void *y, int rows,
                int cols, float beta, cudaStream_t s) {
    gemv_kernel<X, Y, N><<<(rows + GEMV_WARPS - 1) / GEMV_WARPS, GEMV_THREADS, 0, s>>>(
        w, wscale, step, (const X *)x, xs, (Y *)y, rows, cols, beta);
    return (int)cudaGetLastError();
}

template <typename X, typename Y>
int launch_products(const uint8_t *w, const float *wscale, int step, const void *x, const float *xs, void *y, int rows,
                    int cols, int n, float beta, cudaStream_t s) {
    switch (n <= KVB_CUDA_GEMV_MAX_ROWS ? n : 0) {
    case 1: return launch_gemv<X, Y, 1>(w, wscale, step, x, xs, y, rows, cols, beta, s);
    case 2: return launch_gemv<X, Y, 2>(w, wscale, step, x, xs, y, rows, cols, beta, s);
    case 3: return launch_gemv<X, Y, 3>(w, wscale, step, x, xs, y, rows, cols, beta, s);
    case 4: return launch_gemv<X, Y, 4>(w, wscale, step, x, xs, y, rows, cols, beta, s);
    case 5: return launch_gemv<X, Y, 5>(w, wscale, step, x, xs, y, rows, cols, beta, s);
    case 6: return launch_gemv<X, Y, 6>(w, wscale, step, x, xs, y, rows, cols, beta, s);
    case 7: return launch_gemv<X, Y, 7>(w, wscale, step, x, xs, y, rows, cols, beta, s);
    case 8: return launch_gemv<X, Y, 8>(w, wscale, step, x, xs, y, rows, cols, beta, s);
    default: break;
    }
    unsigned grid = (unsigned)((rows + TM - 1) / TM) * (unsigned)((n + TN - 1) / TN);
    gemm_kernel<X, Y><<<grid, GEMM_THREADS, 0, s>>>(w, wscale, step, (const X *)x, xs, (Y *)y, rows, cols, n, beta);
    return (int)cudaGetLastError();
}

/* ---------------------------------------------------------------- cuBLASLt, loaded on first use */

#ifndef KVB_CUBLAS_LINKED
typedef struct lt_api {
    cublasStatus_t (*create)(cublasLtHandle_t *);
    cublasStatus_t (*destroy)(cublasLtHandle_t);
    cublasStatus_t (*desc_create)(cublasLtMatmulDesc_t *, cublasComputeType_t, cudaDataType_t);
    cublasStatus_t (*desc_destroy)(cublasLtMatmulDesc_t);
    cublasStatus_t (*desc_set)(cublasLtMatmulDesc_t, cublasLtMatmulDescAttributes_t, const void *, size_t);
    cublasStatus_t (*layout_create)(cublasLtMatrixLayout_t *, cudaDataType, uint64_t, uint64_t, int64_t);
    cublasStatus_t (*layout_destroy)(cublasLtMatrixLayout_t);
    cublasStatus_t (*pref_create)(cublasLtMatmulPreference_t *);
    cublasStatus_t (*pref_destroy)(cublasLtMatmulPreference_t);
    cublasStatus_t (*pref_set)(cublasLtMatmulPreference_t, cublasLtMatmulPreferenceAttributes_t, const void *, size_t);
    cublasStatus_t (*heuristic)(cublasLtHandle_t, cublasLtMatmulDesc_t, cublasLtMatrixLayout_t, cublasLtMatrixLayout_t,
                                cublasLtMatrixLayout_t, cublasLtMatrixLayout_t, cublasLtMatmulPreference_t, int,
                                cublasLtMatmulHeuristicResult_t *, int *);
    cublasStatus_t (*matmul)(cublasLtHandle_t, cublasLtMatmulDesc_t, const void *, const void *, cublasLtMatrixLayout_t,
                             const void *, cublasLtMatrixLayout_t, const void *, const void *, cublasLtMatrixLayout_t,
                             void *, cublasLtMatrixLayout_t, const cublasLtMatmulAlgo_t *, void *, size_t, cudaStream_t);
    const char *(*status_string)(cublasStatus_t);
} lt_api;

lt_api lt;
kvb_status lt_loaded = KVB_ERR_UNSUPPORTED;
pthread_once_t lt_once = PTHREAD_ONCE_INIT;

#define KVB_STR_(x) #x
#define KVB_STR(x) KVB_STR_(x)
#define CUBLASLT_SONAME "libcublasLt.so." KVB_STR(CUBLAS_VER_MAJOR)

void lt_load() {
    void *h = NULL;
#ifdef KVB_CUDA_LIBDIR
    h = dlopen(KVB_CUDA_LIBDIR "/" CUBLASLT_SONAME, RTLD_NOW | RTLD_LOCAL);
#endif
    if (!h) h = dlopen(CUBLASLT_SONAME, RTLD_NOW | RTLD_LOCAL);
    if (!h) {
        KVB_LOG_W("cuda fp8: cannot load cuBLASLt (%s): %s; W8A8 products run on the widening kernels",
                  CUBLASLT_SONAME, dlerror());
        return;
    }
    static const char *const names[] = {
        "cublasLtCreate", "cublasLtDestroy", "cublasLtMatmulDescCreate", "cublasLtMatmulDescDestroy",
        "cublasLtMatmulDescSetAttribute", "cublasLtMatrixLayoutCreate", "cublasLtMatrixLayoutDestroy",
        "cublasLtMatmulPreferenceCreate", "cublasLtMatmulPreferenceDestroy", "cublasLtMatmulPreferenceSetAttribute",
        "cublasLtMatmulAlgoGetHeuristic", "cublasLtMatmul", "cublasLtGetStatusString"};
    void *fn[sizeof names / sizeof names[0]];
    for (size_t i = 0; i < sizeof names / sizeof names[0]; i++) {
        if (!(fn[i] = dlsym(h, names[i]))) {
            KVB_LOG_W("cuda fp8: %s has no %s; W8A8 products run on the widening kernels", CUBLASLT_SONAME, names[i]);
            dlclose(h);
            return;
        }
    }
    static_assert(sizeof lt == sizeof fn, "one entry point per member of lt_api");
    memcpy(&lt, fn, sizeof lt);
    lt_loaded = KVB_OK;
}

#define LT_WORKSPACE_BYTES ((size_t)32 << 20)

kvb_status lt_status(cublasStatus_t st, const char *what) {
    if (st == CUBLAS_STATUS_SUCCESS) return KVB_OK;
    KVB_LOG_E("cuda fp8: %s: %s", what, lt.status_string ? lt.status_string(st) : "?");
    return st == CUBLAS_STATUS_NOT_SUPPORTED ? KVB_ERR_UNSUPPORTED : KVB_ERR_BACKEND;
}
#define LT_TRY(call)                                                                                   \
    do {                                                                                               \
        kvb_status st_ = lt_status((call), #call);                                                     \
        if (st_ != KVB_OK) {                                                                           \
            st = st_;                                                                                  \
            goto out;                                                                                  \
        }                                                                                              \
    } while (0)
#endif

cudaDataType_t cuda_type(kvb_dtype dt) {
    return dt == KVB_DTYPE_BF16 ? CUDA_R_16BF : dt == KVB_DTYPE_F16 ? CUDA_R_16F : CUDA_R_32F;
}

} // namespace

struct kvb_cuda_fp8 {
    uint8_t *q;     /* [q_cap] bytes: the quantized activations of the current product */
    size_t q_cap;
    float *qs;      /* [qs_cap] their rows' scales */
    size_t qs_cap;
    float *acc;     /* [acc_cap] f32 products of the unscaled cuBLASLt fallback */
    size_t acc_cap;
    void *lt_ws;    /* [LT_WORKSPACE_BYTES] cuBLASLt's workspace; NULL until the first W8A8 product */
    void *lt;       /* cublasLtHandle_t, or NULL */
    int lt_failed;  /* cuBLASLt is not usable here: W8A8 goes to the widening kernels */
    int outer_vec_failed; /* the outer-vector scale modes had no algorithm: scales in the epilogue */
};

/* Makes the device buffer *p hold at least `bytes`, waiting for the stream before it frees the old one. */
static kvb_status reserve(void **p, size_t *cap, size_t bytes, cudaStream_t s) {
    if (bytes <= *cap) return KVB_OK;
    if (*p) {
        KVB_TRY(KVB_CUDA_CHECK(cudaStreamSynchronize(s)));
        KVB_TRY(KVB_CUDA_CHECK(cudaFree(*p)));
        *p = NULL;
        *cap = 0;
    }
    size_t want = bytes + bytes / 2;
    KVB_TRY(KVB_CUDA_CHECK(cudaMalloc(p, want)));
    *cap = want;
    return KVB_OK;
}

extern "C" kvb_status kvb_cuda_fp8_create(kvb_cuda_fp8 **out) {
    return kvb_calloc(1, sizeof(kvb_cuda_fp8), (void **)out);
}

extern "C" void kvb_cuda_fp8_destroy(kvb_cuda_fp8 *f) {
    if (!f) return;
#ifndef KVB_CUBLAS_LINKED
    if (f->lt) (void)lt.destroy((cublasLtHandle_t)f->lt);
#endif
    void *dev[] = {f->q, f->qs, f->acc, f->lt_ws};
    for (size_t i = 0; i < sizeof dev / sizeof dev[0]; i++)
        if (dev[i]) cudaFree(dev[i]);
    free(f);
}

extern "C" kvb_status kvb_cuda_fp8_upload(const kvb_fp8_weight *src, kvb_cuda_stream_t s, kvb_tensor *dst) {
    if (!s || src->rows <= 0 || src->cols <= 0 || src->rows > INT32_MAX || src->cols > INT32_MAX ||
        (src->n_scale != 1 && src->n_scale != src->rows))
        return KVB_ERR_INVALID;
    if (src->cols % 16) {
        KVB_LOG_E("cuda fp8: a weight of %lld columns (the products take multiples of 16)", (long long)src->cols);
        return KVB_ERR_UNSUPPORTED;
    }
    const uint8_t *b = (const uint8_t *)src->data;
    size_t n = (size_t)src->rows * (size_t)src->cols;
    for (size_t i = 0; i < n; i++)
        if ((b[i] & 0x7f) == 0x7f) {
            KVB_LOG_E("cuda fp8: FP8 weight [%lld][%lld] holds a NaN (byte 0x%02x at element %zu)",
                      (long long)src->rows, (long long)src->cols, b[i], i);
            return KVB_ERR_INVALID;
        }
    void *w = NULL, *sc = NULL;
    kvb_status st = KVB_CUDA_CHECK(cudaMalloc(&w, n));
    if (st == KVB_OK) st = KVB_CUDA_CHECK(cudaMalloc(&sc, (size_t)src->n_scale * sizeof(float)));
    if (st == KVB_OK) st = KVB_CUDA_CHECK(cudaMemcpyAsync(w, src->data, n, cudaMemcpyHostToDevice, s));
    if (st == KVB_OK)
        st = KVB_CUDA_CHECK(cudaMemcpyAsync(sc, src->scale, (size_t)src->n_scale * sizeof(float), cudaMemcpyHostToDevice, s));
    /* the caller unmaps the source after we return */
    if (st == KVB_OK) st = KVB_CUDA_CHECK(cudaStreamSynchronize(s));
    if (st != KVB_OK) {
        cudaStreamSynchronize(s);
        cudaFree(w);
        cudaFree(sc);
        return st;
    }
    *dst = kvb_tensor{};
    dst->data = w;
    dst->dtype = KVB_DTYPE_F8_E4M3;
    dst->ne[0] = src->rows;
    dst->ne[1] = src->cols;
    dst->scale = (float *)sc;
    dst->n_scale = src->n_scale;
    dst->act = src->act;
    return KVB_OK;
}

extern "C" int kvb_cuda_fp8_quant_tokens(const void *x, kvb_dtype dt, int n, int cols, uint8_t *q, float *qs,
                                         kvb_cuda_stream_t s) {
    KVB_CUDA_REQUIRE_STREAM(s);
    if (n <= 0 || cols <= 0) return (int)cudaErrorInvalidValue;
    KVB_CUDA_DISPATCH(dt, T, {
        quant_kernel<T><<<n, QUANT_THREADS, 0, s>>>((const T *)x, cols, q, qs);
        return (int)cudaGetLastError();
    });
    return (int)cudaErrorInvalidValue;
}

extern "C" int kvb_cuda_fp8_gemm(const uint8_t *w, const float *wscale, int scale_step, const void *x, const uint8_t *xq,
                                 const float *xscale, void *y, kvb_dtype dt, int rows, int cols, int n, float beta,
                                 kvb_cuda_stream_t s) {
    KVB_CUDA_REQUIRE_STREAM(s);
    if (rows <= 0 || cols <= 0 || cols % 16 || n <= 0 || ((uintptr_t)w & 15) || (xq && ((uintptr_t)xq & 15)) ||
        (!xq && ((uintptr_t)x & 15)))
        return (int)cudaErrorInvalidValue;
    KVB_CUDA_DISPATCH(dt, T, {
        if (xq) return launch_products<uint8_t, T>(w, wscale, scale_step, xq, xscale, y, rows, cols, n, beta, s);
        return launch_products<T, T>(w, wscale, scale_step, x, NULL, y, rows, cols, n, beta, s);
    });
    return (int)cudaErrorInvalidValue;
}

#ifndef KVB_CUBLAS_LINKED
/* y = (q . w^T) * scale * qs + beta y on the tensor cores: column-major, D[rows][n] = A^T B with A the
 * weight (cols x rows, E4M3) and B the quantized tokens (cols x n, E4M3); the scales as outer-vector modes
 * (one per row of A, one per column of B; the weight's a scalar mode when it has one), or, where that
 * finds no algorithm, scales 1 into f32 and scale_kernel after. KVB_ERR_UNSUPPORTED when cuBLASLt has no
 * FP8 algorithm for the shape at all. */
static kvb_status lt_product(kvb_cuda_fp8 *f, cudaStream_t s, kvb_dtype dt, int n, const kvb_tensor *w, float beta,
                             void *y) {
    int rows = (int)w->ne[0], cols = (int)w->ne[1];
    int outer = !f->outer_vec_failed;
    kvb_status st = KVB_OK;
    cublasLtMatmulDesc_t desc = NULL;
    cublasLtMatrixLayout_t la = NULL, lb = NULL, lc = NULL, ld = NULL;
    cublasLtMatmulPreference_t pref = NULL;
    cublasLtMatmulHeuristicResult_t heur;
    int found = 0;
    cublasOperation_t ta = CUBLAS_OP_T, tb = CUBLAS_OP_N;
    float alpha = 1.0f, b = outer ? beta : 0.0f;
    cudaDataType_t out_t = outer ? cuda_type(dt) : CUDA_R_32F;
    void *out_p = outer ? y : f->acc;
    size_t ws_bytes = LT_WORKSPACE_BYTES;
    if (!outer) KVB_TRY(reserve((void **)&f->acc, &f->acc_cap, (size_t)rows * n * sizeof(float), s));
    LT_TRY(lt.desc_create(&desc, CUBLAS_COMPUTE_32F, CUDA_R_32F));
    LT_TRY(lt.desc_set(desc, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof ta));
    LT_TRY(lt.desc_set(desc, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof tb));
    if (outer) {
        cublasLtMatmulMatrixScale_t am = w->n_scale == 1 ? CUBLASLT_MATMUL_MATRIX_SCALE_SCALAR_32F
                                                         : CUBLASLT_MATMUL_MATRIX_SCALE_OUTER_VEC_32F;
        cublasLtMatmulMatrixScale_t bm = CUBLASLT_MATMUL_MATRIX_SCALE_OUTER_VEC_32F;
        const void *ap = w->scale, *bp = f->qs;
        LT_TRY(lt.desc_set(desc, CUBLASLT_MATMUL_DESC_A_SCALE_MODE, &am, sizeof am));
        LT_TRY(lt.desc_set(desc, CUBLASLT_MATMUL_DESC_B_SCALE_MODE, &bm, sizeof bm));
        LT_TRY(lt.desc_set(desc, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, &ap, sizeof ap));
        LT_TRY(lt.desc_set(desc, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, &bp, sizeof bp));
    }
    LT_TRY(lt.layout_create(&la, CUDA_R_8F_E4M3, (uint64_t)cols, (uint64_t)rows, cols));
    LT_TRY(lt.layout_create(&lb, CUDA_R_8F_E4M3, (uint64_t)cols, (uint64_t)n, cols));
    LT_TRY(lt.layout_create(&lc, out_t, (uint64_t)rows, (uint64_t)n, rows));
    LT_TRY(lt.layout_create(&ld, out_t, (uint64_t)rows, (uint64_t)n, rows));
    LT_TRY(lt.pref_create(&pref));
    LT_TRY(lt.pref_set(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws_bytes, sizeof ws_bytes));
    LT_TRY(lt.heuristic((cublasLtHandle_t)f->lt, desc, la, lb, lc, ld, pref, 1, &heur, &found));
    if (found < 1) {
        st = KVB_ERR_UNSUPPORTED;
        goto out;
    }
    LT_TRY(lt.matmul((cublasLtHandle_t)f->lt, desc, &alpha, w->data, la, f->q, lb, &b, out_p, lc, out_p, ld,
                     &heur.algo, f->lt_ws, ws_bytes, s));
    if (!outer) st = KVB_CUDA_CHECK(launch_scale(f->acc, w, f->qs, y, dt, rows, n, beta, s));
out:
    if (pref) lt.pref_destroy(pref);
    cublasLtMatrixLayout_t lays[] = {la, lb, lc, ld};
    for (size_t i = 0; i < 4; i++)
        if (lays[i]) lt.layout_destroy(lays[i]);
    if (desc) lt.desc_destroy(desc);
    return st;
}

/* cuBLASLt and its workspace, on the first W8A8 product; 0 where it cannot be had. */
static int lt_ready(kvb_cuda_fp8 *f, cudaStream_t s) {
    if (f->lt) return 1;
    if (f->lt_failed) return 0;
    pthread_once(&lt_once, lt_load);
    cublasLtHandle_t h = NULL;
    if (lt_loaded != KVB_OK || lt_status(lt.create(&h), "cublasLtCreate") != KVB_OK ||
        KVB_CUDA_CHECK(cudaMalloc(&f->lt_ws, LT_WORKSPACE_BYTES)) != KVB_OK) {
        if (h) lt.destroy(h);
        f->lt_failed = 1;
        return 0;
    }
    f->lt = h;
    return 1;
}
#endif

extern "C" kvb_status kvb_cuda_fp8_matmul(kvb_cuda_fp8 *f, kvb_cuda_stream_t s, kvb_dtype dt, const void *x, int n,
                                          const kvb_tensor *w, float beta, void *y) {
    if (n <= 0) return KVB_OK;
    if (!f || w->dtype != KVB_DTYPE_F8_E4M3 || !w->scale || w->ne[0] > INT32_MAX || w->ne[1] > INT32_MAX) {
        KVB_LOG_E("cuda fp8 matmul: not an FP8 weight ([%lld][%lld] %s)", (long long)w->ne[0], (long long)w->ne[1],
                  kvb_dtype_name(w->dtype));
        return KVB_ERR_INVALID;
    }
    int rows = (int)w->ne[0], cols = (int)w->ne[1], step = w->n_scale == 1 ? 0 : 1;
    if (w->act == KVB_ACT_NONE)
        return KVB_CUDA_CHECK(kvb_cuda_fp8_gemm((const uint8_t *)w->data, w->scale, step, x, NULL, NULL, y, dt, rows,
                                                cols, n, beta, s));
    KVB_TRY(reserve((void **)&f->q, &f->q_cap, (size_t)n * cols, s));
    KVB_TRY(reserve((void **)&f->qs, &f->qs_cap, (size_t)n * sizeof(float), s));
    KVB_TRY(KVB_CUDA_CHECK(kvb_cuda_fp8_quant_tokens(x, dt, n, cols, f->q, f->qs, s)));
#ifndef KVB_CUBLAS_LINKED
    if (n > KVB_CUDA_GEMV_MAX_ROWS && lt_ready(f, s)) {
        kvb_status st = lt_product(f, s, dt, n, w, beta, y);
        if (st == KVB_ERR_UNSUPPORTED && !f->outer_vec_failed) {
            KVB_LOG_W("cuda fp8: cuBLASLt has no algorithm with outer-vector scales here; scaling after the product");
            f->outer_vec_failed = 1;
            st = lt_product(f, s, dt, n, w, beta, y);
        }
        if (st == KVB_OK) return st;
        if (st == KVB_ERR_UNSUPPORTED) {
            KVB_LOG_W("cuda fp8: cuBLASLt has no FP8 algorithm for [%d][%d] x %d rows; the widening kernels run it",
                      rows, cols, n);
        } else {
            /* refused (its reason logged above): the widening kernels give the same product, so this and every
             * later W8A8 product runs there rather than failing the step */
            KVB_LOG_W("cuda fp8: cuBLASLt failed a [%d][%d] x %d-row product (%s); W8A8 runs on the widening kernels "
                      "from now on", rows, cols, n, kvb_status_str(st));
            f->lt_failed = 1;
        }
    }
#endif
    return KVB_CUDA_CHECK(kvb_cuda_fp8_gemm((const uint8_t *)w->data, w->scale, step, NULL, f->q, f->qs, y, dt, rows,
                                            cols, n, beta, s));
}
