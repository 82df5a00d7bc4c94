/* kvbank — a host emulation of the CUDA execution model, for checking the LOGIC of kernels/cuda on a
 * machine without a GPU. A development tool (kernels/cuda/emu/build.sh), never part of a product
 * build and never a substitute for running on a GPU: it says nothing about speed, the memory model, or
 * races the real hardware would expose (beyond the one below); it only runs each kernel
 * the way the programming model defines it, so that wrong indexing, wrong reductions, wrong masks and
 * wrong synchronisation structure show up as wrong numbers or as a reported deadlock.
 *
 * Every CUDA thread of a block is a fiber (its own stack, cooperative switching); blocks run one after
 * another. __syncthreads waits for every live thread of the block, warp operations (__shfl_*_sync,
 * __ballot_sync) for every live lane of the warp, so a barrier reached by only part of a block or warp
 * is detected as a deadlock. __shared__ variables are static storage shared by the fibers of the
 * running block; dynamic shared memory is a per-launch buffer. Launches run synchronously, after the
 * launch's stream's pending copies. Asynchronous copies are deferred until work is ordered after them
 * (emu.cc, "Streams"): a kernel, or the host, that reads a copy's destination without waiting for the
 * copy's stream or event reads NaN.
 *
 * The .cu files are compiled by g++ with this header forced in first (-include) after build.sh has
 * rewritten each `kernel<<<grid, block, smem, stream>>>(args)` into an emu_launch call and each
 * `extern __shared__ T name[];` into a pointer to the dynamic buffer. */
#ifndef KVB_KERNELS_CUDA_EMU_H
#define KVB_KERNELS_CUDA_EMU_H

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>

/* the host compiler's view of CUDA's qualifiers: plain C++ */
#undef __global__
#undef __device__
#undef __host__
#undef __shared__
#undef __launch_bounds__
#undef __forceinline__
#define __global__
#define __device__
#define __host__
#define __shared__ static
#define __launch_bounds__(...)
#define __forceinline__ inline

struct emu_dim {
    unsigned x, y, z;
};
extern emu_dim emu_threadIdx, emu_blockIdx, emu_blockDim, emu_gridDim;
#define threadIdx emu_threadIdx
#define blockIdx emu_blockIdx
#define blockDim emu_blockDim
#define gridDim emu_gridDim

/* synchronisation */
void emu_syncthreads();
/* every live lane of the calling thread's warp deposits `v` and gets lane `src`'s value */
uint64_t emu_warp_exchange(uint64_t v, int src_lane);
int emu_lane();
void *emu_dyn_smem();
void emu_launch(unsigned grid, unsigned block, size_t smem, cudaStream_t stream, const std::function<void()> &body);
cudaError_t emu_last_error();

#define __syncthreads() emu_syncthreads()
#define __syncwarp(...) emu_syncthreads_warp()
inline void emu_syncthreads_warp() { (void)emu_warp_exchange(0, emu_lane()); }

template <typename T> inline uint64_t emu_bits(T v) {
    uint64_t b = 0;
    std::memcpy(&b, &v, sizeof(T));
    return b;
}
template <typename T> inline T emu_unbits(uint64_t b) {
    T v;
    std::memcpy(&v, &b, sizeof(T));
    return v;
}
template <typename T> inline T __shfl_xor_sync(unsigned, T v, int mask) {
    return emu_unbits<T>(emu_warp_exchange(emu_bits(v), emu_lane() ^ mask));
}
template <typename T> inline T __shfl_up_sync(unsigned, T v, unsigned delta) {
    int src = emu_lane() - (int)delta;
    T got = emu_unbits<T>(emu_warp_exchange(emu_bits(v), src < 0 ? emu_lane() : src));
    return src < 0 ? v : got;
}
template <typename T> inline T __shfl_sync(unsigned, T v, int src) {
    return emu_unbits<T>(emu_warp_exchange(emu_bits(v), src & 31));
}
unsigned emu_ballot(int pred);
#define __ballot_sync(mask, pred) emu_ballot((pred) ? 1 : 0)

/* fibers never interleave inside a call: plain read-modify-write is atomic here */
template <typename T> inline T atomicAdd(T *p, T v) {
    T old = *p;
    *p = old + v;
    return old;
}

/* cache-hinted loads are plain loads */
template <typename T> inline T __ldcs(const T *p) { return *p; }
template <typename T> inline T __ldcg(const T *p) { return *p; }
/* blocks run one after another: every write of an earlier block is visible */
inline void __threadfence() {}

/* ---------------------------------------------------------------- tensor-core instructions
 * What kernels/cuda/mma.cuh needs in the emulation (see there): a warp collective that hands every
 * lane the deposits of all 32 lanes (MMA fragments, ldmatrix row addresses), and cp.async as a copy
 * deferred to the cp.async.wait_group that completes its group, its destination poisoned (0xFF bytes:
 * NaN in f32, f16 and bf16) from the issue until then. */
#define KVB_CUDA_EMU 1
constexpr size_t EMU_GATHER_MAX = 32; /* bytes a lane deposits at most */
/* Every live lane of the warp deposits `bytes` from `mine`; once the whole warp has arrived each gets
 * all 32 deposits in `all` ([32][bytes]; lanes that are not running deposit zeros). */
void emu_warp_gather(const void *mine, size_t bytes, void *all);
/* mma.m16n8k16 (bf16: 1, f16: 0) of the calling lane's warp, fragments as in kernels/cuda/mma.cuh: the
 * first lane to run after the warp arrived computes the whole A B (products summed in double), and
 * each lane returns its D = A B + C, rounded once to f32. */
void emu_mma_16816(int bf16, float *d, const uint32_t *a, const uint32_t *b, const float *c);
/* cp.async of `bytes` from global `src` into shared `dst`, of which the first `src_bytes` are read
 * and the rest zero-filled (cp.async's src-size operand). */
void emu_cp_async(void *dst, const void *src, size_t bytes, size_t src_bytes);
void emu_cp_async_commit();
/* Completes the calling thread's committed groups but the newest `n`. */
void emu_cp_async_wait(int n);

inline int __ffs(unsigned x) { return x ? __builtin_ctz(x) + 1 : 0; }
inline unsigned __float_as_uint(float f) { return emu_unbits<unsigned>(emu_bits(f)); }
inline float rsqrtf(float x) { return 1.0f / std::sqrt(x); }
using std::max;
using std::min;

/* the runtime calls that launchers make around their launches */
#define cudaGetLastError() emu_last_error()
#define cudaFuncSetAttribute(...) cudaSuccess

#endif
