/* kvbank — kernels that exercise kernels/cuda/mma.cuh for tests/test_tensor_core: on a GPU they pin the
 * fragment layouts mma.cuh's comment states (a wrong layout gives wrong numbers, not a crash); in the
 * host emulation they check the emulation against the same statements. Not used by the backend. */
#ifndef KVB_KERNELS_CUDA_MMA_CHECK_H
#define KVB_KERNELS_CUDA_MMA_CHECK_H

#include "kernels/cuda/launch.h"

KVB_CUDA_EXTERN_C_BEGIN

/* One warp, one mma.m16n8k16: each lane loads its A, B and C fragments from global memory with the
 * layouts of mma.cuh's comment, and stores its D fragment the same way. a [16][16] and b [16][8]
 * (row-major, k by n) of dt (f16 or bf16), c and d [16][8] f32. */
int kvb_cuda_mma_check_fragments(kvb_dtype dt, const void *a, const void *b, const float *c, float *d,
                                 kvb_cuda_stream_t s);

/* One warp: m [32][8] 16-bit elements (four 8x8 matrices, matrix i = rows 8i..8i+7) are copied to
 * shared memory, then lane l points at row l of it and runs ldmatrix x1, x2, x4, x1.trans, x2.trans,
 * x4.trans. out [6][32][4] uint32: variant v, lane l, register r (registers a variant does not fill
 * are written as 0). */
int kvb_cuda_mma_check_ldmatrix(const uint16_t *m, uint32_t *out, kvb_cuda_stream_t s);

/* c [m][n] = a [m][k] . b [n][k]^T (f32 out) with K-tiles of 32 double-buffered in shared memory by
 * cp.async, A fragments by ldmatrix.x4, B by ldmatrix.x2 (b_kn = 0) or, with b_kn = 1, b given as
 * [k][n] and its fragments by ldmatrix.x2.trans. m, n multiples of 64, k of 32; 128 threads a 64x64
 * tile. skip_wait = 1 leaves out the cp.async wait (the emulation must then give NaN). */
int kvb_cuda_mma_check_gemm(kvb_dtype dt, const void *a, const void *b, float *c, int m, int n, int k, int b_kn,
                            int skip_wait, kvb_cuda_stream_t s);

KVB_CUDA_EXTERN_C_END

#endif
