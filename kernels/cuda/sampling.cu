/* kvbank — CUDA sampling (see sampling.h). One block of THREADS threads per row.
 *
 * Filters never sort the vocabulary. The candidate order (descending p, ascending id) is a total
 * order, so every candidate set is a prefix of it, named by its last element: (key, id), where key is
 * the bit pattern of p (p >= 0, so unsigned order is float order). "The first element at which the
 * running weight reaches a target" — the k-th element for top-k (weight 1), the end of the top-p
 * prefix and the sampled token (weight = fixed-point mass) — is found by a radix descent over the key,
 * 8 bits per pass from the top (a 256-bucket weight histogram per pass), then a block-wide scan in id
 * order among the elements that share the final key. */
#include <math.h>

#include "kernels/cuda/common.cuh"
#include "kernels/cuda/sampling.h"

namespace {

constexpr int THREADS = 512;
constexpr int NW = THREADS / 32;
constexpr double FIX_ONE = 17592186044416.0; /* 2^44: fixed-point unit of mass */

typedef unsigned long long u64;

struct row_ctx {
    const void *logits; /* this row */
    kvb_dtype dt;
    int vocab;
    float mx;  /* max logit */
    float T;   /* temperature */
};

__device__ __forceinline__ float logit(const row_ctx &c, int i) {
    switch (c.dt) {
    case KVB_DTYPE_F16: return __half2float(((const __half *)c.logits)[i]);
    case KVB_DTYPE_BF16: return __bfloat162float(((const __nv_bfloat16 *)c.logits)[i]);
    default: return ((const float *)c.logits)[i];
    }
}

/* p_i exactly as the CPU computes it: expf((l - max) / T) in f32. */
__device__ __forceinline__ float prob(const row_ctx &c, int i) { return expf((logit(c, i) - c.mx) / c.T); }
__device__ __forceinline__ u64 fix(float p) { return (u64)((double)p * FIX_ONE); }

/* A prefix of the candidate order: every i with key > v, or key == v and i <= cut; `full`: everything. */
struct prefix {
    int full;
    unsigned v;
    int cut;
};
__device__ __forceinline__ bool in_prefix(const prefix &P, unsigned key, int i) {
    return P.full || key > P.v || (key == P.v && i <= P.cut);
}

/* ---------------------------------------------------------------- block primitives */

struct smem_t {
    u64 hist[256];
    u64 wtot[NW];
    float fv[NW];
    int fi[NW];
    unsigned sel_bucket;
    int sel_found;
    u64 sel_above;
    int answer;
};

__device__ __forceinline__ u64 block_sum64(u64 v, smem_t &sm) {
    int lane = threadIdx.x & 31, w = threadIdx.x >> 5;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    __syncthreads();
    if (lane == 0) sm.wtot[w] = v;
    __syncthreads();
    u64 t = 0;
    for (int k = 0; k < NW; k++) t += sm.wtot[k];
    return t;
}

/* Exclusive prefix sum over threads in thread order; *total gets the sum of all. */
__device__ __forceinline__ u64 block_excl_scan64(u64 v, smem_t &sm, u64 *total) {
    int lane = threadIdx.x & 31, w = threadIdx.x >> 5;
    u64 x = v;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
        u64 y = __shfl_up_sync(0xffffffffu, x, o);
        if (lane >= o) x += y;
    }
    __syncthreads();
    if (lane == 31) sm.wtot[w] = x;
    __syncthreads();
    u64 base = 0, t = 0;
    for (int k = 0; k < NW; k++) {
        if (k < w) base += sm.wtot[k];
        t += sm.wtot[k];
    }
    *total = t;
    return base + x - v;
}

/* (value, id) of the largest logit, lowest id on ties; NaN counts as -inf. */
__device__ void block_argmax(const row_ctx &c, smem_t &sm, float *best_v, int *best_i) {
    float bv = -INFINITY;
    int bi = 0x7fffffff;
    for (int i = threadIdx.x; i < c.vocab; i += THREADS) {
        float v = logit(c, i);
        if (isnan(v)) v = -INFINITY;
        if (v > bv || (v == bv && i < bi)) bv = v, bi = i;
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        float ov = __shfl_xor_sync(0xffffffffu, bv, o);
        int oi = __shfl_xor_sync(0xffffffffu, bi, o);
        if (ov > bv || (ov == bv && oi < bi)) bv = ov, bi = oi;
    }
    int lane = threadIdx.x & 31, w = threadIdx.x >> 5;
    __syncthreads();
    if (lane == 0) sm.fv[w] = bv, sm.fi[w] = bi;
    __syncthreads();
    bv = sm.fv[0];
    bi = sm.fi[0];
    for (int k = 1; k < NW; k++)
        if (sm.fv[k] > bv || (sm.fv[k] == bv && sm.fi[k] < bi)) bv = sm.fv[k], bi = sm.fi[k];
    if (bi == 0x7fffffff) bi = 0; /* all NaN: the CPU keeps id 0 */
    *best_v = bv;
    *best_i = bi;
}

/* Mass (fixed point) of the elements of P. */
__device__ u64 prefix_mass(const row_ctx &c, const prefix &P, smem_t &sm) {
    u64 m = 0;
    for (int i = threadIdx.x; i < c.vocab; i += THREADS) {
        float p = prob(c, i);
        if (in_prefix(P, __float_as_uint(p), i)) m += fix(p);
    }
    return block_sum64(m, sm);
}

/* The first element of R, in candidate order, at which the running weight (1 per element when
 * by_count, else its fixed-point mass) reaches `target`. Returns 0 if R's total weight stays below. */
__device__ int select_first(const row_ctx &c, const prefix &R, int by_count, u64 target, smem_t &sm, prefix *out) {
    unsigned pre = 0, pmask = 0;
    u64 above = 0; /* weight of the elements of R whose key is above every key still possible */
    for (int sh = 24; sh >= 0; sh -= 8) {
        for (int b = threadIdx.x; b < 256; b += THREADS) sm.hist[b] = 0;
        __syncthreads();
        for (int i = threadIdx.x; i < c.vocab; i += THREADS) {
            float p = prob(c, i);
            unsigned key = __float_as_uint(p);
            if ((key & pmask) != pre || !in_prefix(R, key, i)) continue;
            u64 wgt = by_count ? 1ull : fix(p);
            if (wgt) atomicAdd(&sm.hist[(key >> sh) & 255u], wgt);
        }
        __syncthreads();
        /* warp 0 scans the buckets from the top: lane l holds buckets 255-8l .. 248-8l */
        if (threadIdx.x < 32) {
            int lane = threadIdx.x;
            u64 h[8], sum = 0;
#pragma unroll
            for (int j = 0; j < 8; j++) {
                h[j] = sm.hist[255 - 8 * lane - j];
                sum += h[j];
            }
            u64 incl = sum;
#pragma unroll
            for (int o = 1; o < 32; o <<= 1) {
                u64 y = __shfl_up_sync(0xffffffffu, incl, o);
                if (lane >= o) incl += y;
            }
            u64 cum = above + incl - sum;
            int found = -1;
            u64 found_above = 0;
#pragma unroll
            for (int j = 0; j < 8; j++) {
                if (found < 0 && cum + h[j] >= target) {
                    found = 255 - 8 * lane - j;
                    found_above = cum;
                }
                cum += h[j];
            }
            unsigned ballot = __ballot_sync(0xffffffffu, found >= 0);
            if (ballot == 0) {
                if (lane == 0) sm.sel_found = 0;
            } else if (lane == __ffs(ballot) - 1) {
                sm.sel_found = 1;
                sm.sel_bucket = (unsigned)found;
                sm.sel_above = found_above;
            }
        }
        __syncthreads();
        if (!sm.sel_found) return 0;
        pre |= sm.sel_bucket << sh;
        pmask |= 255u << sh;
        above = sm.sel_above;
        __syncthreads();
    }
    /* the elements of R with key == pre, in id order: contiguous chunks per thread */
    int chunk = (c.vocab + THREADS - 1) / THREADS;
    int c0 = min(c.vocab, (int)threadIdx.x * chunk), c1 = min(c.vocab, c0 + chunk);
    u64 mine = 0;
    for (int i = c0; i < c1; i++) {
        float p = prob(c, i);
        unsigned key = __float_as_uint(p);
        if (key == pre && in_prefix(R, key, i)) mine += by_count ? 1ull : fix(p);
    }
    u64 total;
    u64 ex = block_excl_scan64(mine, sm, &total);
    if (threadIdx.x == 0) sm.answer = -1;
    __syncthreads();
    u64 run = above + ex;
    if (run < target && run + mine >= target) {
        for (int i = c0; i < c1; i++) {
            float p = prob(c, i);
            unsigned key = __float_as_uint(p);
            if (key != pre || !in_prefix(R, key, i)) continue;
            run += by_count ? 1ull : fix(p);
            if (run >= target) {
                sm.answer = i;
                break;
            }
        }
    }
    __syncthreads();
    int ans = sm.answer;
    __syncthreads();
    if (ans < 0) return 0;
    out->full = 0;
    out->v = pre;
    out->cut = ans;
    return 1;
}

/* Unfiltered sampling: the first id whose running mass, in id order, exceeds u * total. */
__device__ int sample_id_order(const row_ctx &c, double u, smem_t &sm) {
    int chunk = (c.vocab + THREADS - 1) / THREADS;
    int c0 = min(c.vocab, (int)threadIdx.x * chunk), c1 = min(c.vocab, c0 + chunk);
    u64 mine = 0;
    for (int i = c0; i < c1; i++) mine += fix(prob(c, i));
    u64 total;
    u64 ex = block_excl_scan64(mine, sm, &total);
    u64 target = (u64)(u * (double)total) + 1; /* acc > u*S  <=>  acc >= floor(u*S) + 1 */
    if (threadIdx.x == 0) sm.answer = c.vocab - 1;      /* rounding past the end: the CPU's last id */
    __syncthreads();
    u64 run = ex;
    if (run < target && run + mine >= target) {
        for (int i = c0; i < c1; i++) {
            run += fix(prob(c, i));
            if (run >= target) {
                sm.answer = i;
                break;
            }
        }
    }
    __syncthreads();
    return sm.answer;
}

__global__ void __launch_bounds__(THREADS) argmax_kernel(const void *logits, kvb_dtype dt, int vocab, int32_t *out) {
    __shared__ smem_t sm;
    size_t es = dt == KVB_DTYPE_F32 ? 4 : 2;
    row_ctx c = {(const char *)logits + (size_t)blockIdx.x * vocab * es, dt, vocab, 0.0f, 1.0f};
    float bv;
    int bi;
    block_argmax(c, sm, &bv, &bi);
    if (threadIdx.x == 0) out[blockIdx.x] = bi;
}

__global__ void __launch_bounds__(THREADS)
    sample_kernel(const void *logits, kvb_dtype dt, int vocab, const kvb_cuda_sample_params *__restrict__ params,
                  int32_t *out) {
    __shared__ smem_t sm;
    size_t es = dt == KVB_DTYPE_F32 ? 4 : 2;
    const kvb_cuda_sample_params P = params[blockIdx.x];
    row_ctx c = {(const char *)logits + (size_t)blockIdx.x * vocab * es, dt, vocab, 0.0f, P.temperature};
    float bv;
    int bi;
    block_argmax(c, sm, &bv, &bi);
    if (!(P.temperature > 0.0f)) {
        if (threadIdx.x == 0) out[blockIdx.x] = bi;
        return;
    }
    c.mx = bv;
    bool use_k = P.top_k > 0 && P.top_k < vocab, use_p = P.top_p > 0.0f && P.top_p < 1.0f;
    int tok;
    if (!use_k && !use_p) {
        tok = sample_id_order(c, P.u, sm);
    } else {
        prefix all = {1, 0u, 0}, kept = all;
        if (use_k && !select_first(c, all, 1, (u64)P.top_k, sm, &kept)) kept = all; /* cannot happen: k < vocab */
        if (use_p) {
            u64 total = prefix_mass(c, kept, sm);
            u64 target = (u64)ceil((double)P.top_p * (double)total);
            prefix pp;
            if (select_first(c, kept, 0, target, sm, &pp)) kept = pp;
        }
        u64 S = prefix_mass(c, kept, sm);
        u64 target = (u64)(P.u * (double)S) + 1;
        prefix hit;
        if (select_first(c, kept, 0, target, sm, &hit)) tok = hit.cut;
        else if (!kept.full) tok = kept.cut; /* rounding past the end: the last kept candidate */
        else tok = vocab - 1;
    }
    if (threadIdx.x == 0) out[blockIdx.x] = tok;
}

} // namespace

extern "C" int kvb_cuda_argmax(const void *logits, kvb_dtype dt, int rows, int vocab, int32_t *out,
                               kvb_cuda_stream_t s) {
    KVB_CUDA_REQUIRE_STREAM(s);
    if (rows <= 0) return (int)cudaSuccess;
    if (vocab <= 0 || kvb_dtype_size(dt) == 0) return (int)cudaErrorInvalidValue;
    argmax_kernel<<<rows, THREADS, 0, s>>>(logits, dt, vocab, out);
    return (int)cudaGetLastError();
}

extern "C" int kvb_cuda_sample(const void *logits, kvb_dtype dt, int rows, int vocab,
                               const kvb_cuda_sample_params *params, int32_t *out, kvb_cuda_stream_t s) {
    KVB_CUDA_REQUIRE_STREAM(s);
    if (rows <= 0) return (int)cudaSuccess;
    if (vocab <= 0 || kvb_dtype_size(dt) == 0) return (int)cudaErrorInvalidValue;
    sample_kernel<<<rows, THREADS, 0, s>>>(logits, dt, vocab, params, out);
    return (int)cudaGetLastError();
}
