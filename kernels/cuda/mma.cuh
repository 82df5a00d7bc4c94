/* kvbank — warp-level tensor-core primitives for the kernels of kernels/cuda (C++ only): the sm_80+
 * `mma.sync.aligned.m16n8k16` with bf16 or f16 inputs and f32 accumulators, `ldmatrix` (x1/x2/x4,
 * optionally .trans) and `cp.async` with commit/wait groups. Inline PTX on the device; in the host
 * emulation (kernels/cuda/emu, KVB_CUDA_EMU) each is computed from the PTX ISA's definition, so that
 * a kernel's fragment bookkeeping is checked without a GPU:
 *  - mma is a warp collective: every lane deposits its A and B fragments, and each computes its own
 *    D fragment from the whole warp's (products in double, rounded once to f32: the tensor core's own
 *    accumulation order is not IEEE round-per-add, so results compare with tolerances);
 *  - ldmatrix gathers the row addresses of the lanes that supply them and reads each lane's elements;
 *    a row address that is not 16-byte aligned aborts;
 *  - cp.async poisons its destination (0xFF: NaN) at the issue and copies at the wait_group that
 *    completes its group, so a read before the wait (or by another thread before the wait and a
 *    barrier) sees NaN, and a thread that exits with copies not waited for aborts.
 *
 * Fragment layouts (PTX ISA, "Matrix Fragments for mma.m16n8k16 with floating point type"), with
 * g = lane / 4 and t = lane % 4; a 32-bit register holds two 16-bit elements, the lower-indexed one in
 * its low half:
 *   A (16 x 16, row-major)  a[0] = A[g][2t..2t+1]    a[1] = A[g+8][2t..2t+1]
 *                           a[2] = A[g][2t+8..+9]    a[3] = A[g+8][2t+8..+9]
 *   B (16 x 8, "col")       b[0] = B[2t..2t+1][g]    b[1] = B[2t+8..+9][g]
 *   C, D (16 x 8, f32)      c[0..1] = C[g][2t..2t+1] c[2..3] = C[g+8][2t..2t+1]
 * ldmatrix (PTX ISA, "ldmatrix"): lanes 8i..8i+7 give the addresses of rows 0..7 of matrix i (16 bytes
 * each); register i of lane l receives matrix i's row l/4, elements 2(l%4) and 2(l%4)+1 (with .trans:
 * column l/4, rows 2(l%4) and 2(l%4)+1). x1 reads lanes 0-7's addresses, x2 lanes 0-15's. So an x4
 * over a 16x16 row-major tile whose lane l points at row l%16, column 8(l/16) gives A's a[0..3], and
 * an x2.trans over a 16x8 row-major [k][n] tile gives B's b[0..1]. */
#ifndef KVB_KERNELS_CUDA_MMA_CUH
#define KVB_KERNELS_CUDA_MMA_CUH

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdint.h>

namespace kvb {

/* Two floats as one register of two 16-bit elements (lo in the low half), round to nearest. */
template <typename T> __device__ __forceinline__ uint32_t pack2(float lo, float hi);
template <> __device__ __forceinline__ uint32_t pack2<__nv_bfloat16>(float lo, float hi) {
    __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<uint32_t *>(&v);
}
template <> __device__ __forceinline__ uint32_t pack2<__half>(float lo, float hi) {
    __half2 v = __floats2half2_rn(lo, hi);
    return *reinterpret_cast<uint32_t *>(&v);
}

#ifdef KVB_CUDA_EMU
} // namespace kvb
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <type_traits>
namespace kvb {

/* d = A B + c over one warp (layouts above). T: __nv_bfloat16 or __half. */
template <typename T>
inline void mma_16816(float (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2], const float (&c)[4]) {
    float cc[4] = {c[0], c[1], c[2], c[3]}; /* d may alias c */
    emu_mma_16816(std::is_same<T, __nv_bfloat16>::value, d, a, b, cc);
}

/* ldmatrix .x N (N = 1, 2, 4), .trans when TRANS; `row` is this lane's row address (shared memory). */
template <int N, bool TRANS> inline void ldmatrix(uint32_t (&r)[N], const void *row) {
    const void *all[32];
    emu_warp_gather(&row, sizeof row, all);
    const int lane = emu_lane();
    for (int i = 0; i < 8 * N; i++)
        if ((uintptr_t)all[i] & 15) {
            std::fprintf(stderr, "emu: ldmatrix row address of lane %d is not 16-byte aligned\n", i);
            std::abort();
        }
    for (int i = 0; i < N; i++) {
        uint16_t lo, hi;
        if (!TRANS) {
            const uint16_t *p = (const uint16_t *)all[8 * i + lane / 4] + 2 * (lane % 4);
            lo = p[0];
            hi = p[1];
        } else {
            lo = ((const uint16_t *)all[8 * i + 2 * (lane % 4)])[lane / 4];
            hi = ((const uint16_t *)all[8 * i + 2 * (lane % 4) + 1])[lane / 4];
        }
        r[i] = (uint32_t)lo | ((uint32_t)hi << 16);
    }
}

/* 16 bytes global -> shared; only the first src_bytes (0 or 16) are read, the rest are zeros. */
inline void cp_async16(void *smem, const void *gmem, int src_bytes = 16) {
    emu_cp_async(smem, gmem, 16, (size_t)src_bytes);
}
inline void cp_async_commit() { emu_cp_async_commit(); }
template <int N> inline void cp_async_wait() { emu_cp_async_wait(N); }

#else /* the device */

template <typename T>
__device__ __forceinline__ void mma_16816(float (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2],
                                          const float (&c)[4]);
template <>
__device__ __forceinline__ void mma_16816<__nv_bfloat16>(float (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2],
                                                         const float (&c)[4]) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
                 "{%10,%11,%12,%13};\n"
                 : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]), "f"(c[0]), "f"(c[1]), "f"(c[2]),
                   "f"(c[3]));
}
template <>
__device__ __forceinline__ void mma_16816<__half>(float (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2],
                                                  const float (&c)[4]) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
                 "{%10,%11,%12,%13};\n"
                 : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]), "f"(c[0]), "f"(c[1]), "f"(c[2]),
                   "f"(c[3]));
}

__device__ __forceinline__ unsigned smem_addr(const void *p) { return (unsigned)__cvta_generic_to_shared(p); }

template <int N, bool TRANS> __device__ __forceinline__ void ldmatrix(uint32_t (&r)[N], const void *row);
template <> __device__ __forceinline__ void ldmatrix<1, false>(uint32_t (&r)[1], const void *row) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x1.shared.b16 {%0}, [%1];\n" : "=r"(r[0]) : "r"(smem_addr(row)));
}
template <> __device__ __forceinline__ void ldmatrix<2, false>(uint32_t (&r)[2], const void *row) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x2.shared.b16 {%0,%1}, [%2];\n"
                 : "=r"(r[0]), "=r"(r[1])
                 : "r"(smem_addr(row)));
}
template <> __device__ __forceinline__ void ldmatrix<4, false>(uint32_t (&r)[4], const void *row) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(smem_addr(row)));
}
template <> __device__ __forceinline__ void ldmatrix<1, true>(uint32_t (&r)[1], const void *row) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x1.trans.shared.b16 {%0}, [%1];\n" : "=r"(r[0]) : "r"(smem_addr(row)));
}
template <> __device__ __forceinline__ void ldmatrix<2, true>(uint32_t (&r)[2], const void *row) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x2.trans.shared.b16 {%0,%1}, [%2];\n"
                 : "=r"(r[0]), "=r"(r[1])
                 : "r"(smem_addr(row)));
}
template <> __device__ __forceinline__ void ldmatrix<4, true>(uint32_t (&r)[4], const void *row) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(smem_addr(row)));
}

/* 16 bytes global -> shared, bypassing L1 (.cg); only the first src_bytes (0 or 16) are read, the rest
 * are zeros (the src-size operand), so a tile's rows past the end are filled without a branch. */
__device__ __forceinline__ void cp_async16(void *smem, const void *gmem, int src_bytes = 16) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_addr(smem)), "l"(gmem), "r"(src_bytes));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
/* Waits until at most N of this thread's committed groups are in flight. */
template <int N> __device__ __forceinline__ void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

#endif

} // namespace kvb

#endif
