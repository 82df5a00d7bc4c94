/* kvbank — the CUDA backend (kernels/cuda/backend_cuda.c): device memory, one non-blocking stream, a
 * cuBLAS handle with its workspace, and the launchers of kernels/cuda behind kvb_backend_i.
 *
 * Variants (the name given to kvb_backend_create):
 *   "cuda" or "cuda:bf16"  bf16 activations, KV cache and weight matrices (serving)
 *   "cuda:f16"             the same in f16
 *   "cuda:f32"             f32 everywhere, cuBLAS in pedantic f32 (checks against the CPU backend)
 * Norm weights (tensors with one column) stay f32 in every variant. Arithmetic is f32 throughout.
 *
 * Only registry.c, tests and benchmarks include this header; it needs no CUDA header. */
#ifndef KVB_KERNELS_CUDA_BACKEND_CUDA_H
#define KVB_KERNELS_CUDA_BACKEND_CUDA_H

#include "config.h"
#include "common/mem/region_cuda.h"
#include "kernels/backend.h"

/* Creates a CUDA backend on the current device. `variant`: NULL, "bf16", "f16" or "f32".
 * KVB_ERR_UNSUPPORTED with the log line "no CUDA device: <reason>" when the process sees no GPU;
 * KVB_ERR_INVALID for an unknown variant. n_threads is ignored (the host side is single-threaded). */
kvb_status kvb__backend_cuda_create(const char *variant, int n_threads, kvb_backend *out);

/* 1 if `be` is a CUDA backend. */
int kvb_cuda_backend_is(const kvb_backend *be);
/* The stream every operator of `be` runs on (NULL if `be` is not a CUDA backend). Tests and benchmarks
 * enqueue extra launchers on it to keep them ordered with the backend's operators. Owned by `be`. */
kvb_cuda_stream_t kvb_cuda_backend_stream(const kvb_backend *be);

/* What benchmarks print about the device of a CUDA backend. */
typedef struct kvb_cuda_device_info {
    char name[256];
    int ordinal;
    int cc_major, cc_minor;
    int n_sm;
    size_t l2_bytes;
    size_t mem_total, mem_free; /* bytes, at the time of the call */
} kvb_cuda_device_info;

kvb_status kvb_cuda_backend_info(const kvb_backend *be, kvb_cuda_device_info *out);

/* How copy_async issues a call's pieces, once those that continue each other are merged: 1 (the default
 * where the CUDA runtime has cudaMemcpyBatchAsync, 12.8 and later) as one batch when no piece writes
 * what another reads or writes, else one cudaMemcpyAsync each (0). Returns the setting before the call;
 * asking for 1 without the batch API leaves 0. kvbank-bench cuda times both. */
int kvb_cuda_backend_set_copy_batch(kvb_backend *be, int on);
/* Pieces copy_async has issued since `be` was created. */
typedef struct kvb_cuda_copy_counts {
    uint64_t batched;  /* in cudaMemcpyBatchAsync calls */
    uint64_t single;   /* one cudaMemcpyAsync each */
    int batch_failed;  /* copy engines on which the batch API failed (their copies go one call each since) */
} kvb_cuda_copy_counts;
void kvb_cuda_backend_copy_counts(const kvb_backend *be, kvb_cuda_copy_counts *out);

/* The kernel of the 9..64-row products (kernels/cuda/gemv.h, KVB_CUDA_SKINNY_V2 = 0 or _V1 = 1): the
 * environment's KVB_CUDA_SKINNY ("v2", the default, or "v1", the kernel before; read when the backend
 * is created, anything else fails the creation). Returns the setting before the call (-1 and nothing
 * changed for an unknown kernel); kvbank-bench cuda times both. */
int kvb_cuda_backend_set_skinny(kvb_backend *be, int skinny);
/* Products (matmul, matmul_norm, matmul_swiglu) `be` has launched since it was created, by kernel. */
typedef struct kvb_cuda_product_counts {
    uint64_t gemv;      /* 1-8 rows, CUDA cores */
    uint64_t skinny_v1; /* 9-64 rows, tensor cores */
    uint64_t skinny_v2;
    uint64_t cublas;    /* the rest */
} kvb_cuda_product_counts;
void kvb_cuda_backend_product_counts(const kvb_backend *be, kvb_cuda_product_counts *out);
/* Rows of a tensor-core prefill item (kernels/cuda/attention_tc.cu): 128 (the default) or 64, the tile
 * before it; KVB_CUDA_PREFILL_TILE=64 in the environment when the backend is created picks 64 (128 or
 * unset: 128; anything else fails the creation).
 * Returns the setting before the call, 0 (and changes nothing) for another value or backend.
 * kvbank-bench cuda times both. */
int kvb_cuda_backend_set_prefill_tile(kvb_backend *be, int rows);
/* Prefill items `be` has launched since it was created: out[0] with 64 rows (the CUDA-core kernel's
 * included), out[1] with 128. */
void kvb_cuda_backend_prefill_items(const kvb_backend *be, uint64_t out[2]);

/* ---------------------------------------------------------------- cuBLAS and NCCL errors */

/* cublasStatus_t (as int) -> kvb_status, logging cuBLAS's name and message for the expression. */
kvb_status kvb__cublas_status(int st, const char *expr, const char *file, int line);
#define KVB_CUBLAS_CHECK(call) kvb__cublas_status((int)(call), #call, __FILE__, __LINE__)

#ifdef KVB_HAVE_NCCL
/* ncclResult_t (as int) -> kvb_status, logging ncclGetErrorString and ncclGetLastError. Defined only
 * when configure found nccl.h (multi-GPU streaming into the LSC, a later issue). */
kvb_status kvb__nccl_status(int res, const char *expr, const char *file, int line);
#define KVB_NCCL_CHECK(call) kvb__nccl_status((int)(call), #call, __FILE__, __LINE__)
#endif

#endif
