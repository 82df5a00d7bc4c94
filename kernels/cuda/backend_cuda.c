/* kvbank — the CUDA backend: kvb_backend_i over cudaMalloc'd memory, one non-blocking stream, cuBLAS
 * for the matrix products and the launchers of kernels/cuda for everything else (backend_cuda.h).
 *
 * Operators are asynchronous: each enqueues its work on the backend's stream and returns. The host
 * arrays an operator receives (token ids, positions, the batch's sequences, block addresses) are
 * packed into a pinned staging slot, copied to a device metadata buffer on the same stream and read
 * from there by the kernels. Stream order makes one device metadata buffer enough: the copy for an
 * operator runs after the kernels of the previous one. Staging slots rotate through a ring; a slot is
 * refilled only after the event recorded behind its last copy has completed, so the host runs up to
 * STAGE_SLOTS operators ahead of the device without waiting. */
#include "kernels/cuda/backend_cuda.h"

#include <cublas_v2.h>
#include <cuda_runtime_api.h>
#include <dlfcn.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#ifdef KVB_HAVE_NCCL
#include <nccl.h>
#endif

#include "kernels/copy_plan.h"
#include "kernels/cuda/attention.h"
#include "kernels/cuda/convert.h"
#include "kernels/cuda/elementwise.h"
#include "kernels/cuda/embed.h"
#include "kernels/cuda/fp8.h"
#include "kernels/cuda/gemv.h"
#include "kernels/cuda/kv_write.h"
#include "kernels/cuda/qkv.h"
#include "kernels/cuda/rmsnorm.h"
#include "kernels/cuda/rope.h"
#include "kernels/cuda/sampling.h"

#define STAGE_SLOTS 8
/* events of copy_async's tickets in flight: ticket t uses event t % TICKET_RING (a ticket that old has
 * landed long ago: reusing its event waits for it first) */
#define TICKET_RING 1024
/* cuBLAS workspace owned by the backend (NVIDIA recommends 32 MiB on Hopper). */
#define BLAS_WORKSPACE_BYTES ((size_t)32 << 20)
/* Elements converted per step when a weight's dtype changes on upload. */
#define UPLOAD_CHUNK_ELEMS ((size_t)16 << 20)
/* Tensor-core prefill tiles (at head size 128: 87 KB of shared memory for 64 rows, 105 KB for 128) run
 * about 2 per multiprocessor; when a batch has fewer tiles, their keys are split, never below this many
 * keys a split (a multiple of the kernel's 64-key tile) */
#define PREFILL_BLOCKS_PER_SM 2
#define PREFILL_MIN_SPLIT 512

/* ---------------------------------------------------------------- cuBLAS, loaded on first use */

/* cuBLAS is opened when the first CUDA backend is created, never linked: linked, libcublasLt alone put
 * about 150 MB into every process of a CUDA build (84 MB of zero pages from its .bss, 62 MB of file
 * pages), CPU backend included, before any model loaded (issue 14's memory target). The handful of
 * entry points the backend calls go through this table. A build against the host emulation
 * (kernels/cuda/emu) links its replacements instead (KVB_CUBLAS_LINKED). */
typedef struct blas_api {
    cublasStatus_t (*create)(cublasHandle_t *);
    cublasStatus_t (*destroy)(cublasHandle_t);
    cublasStatus_t (*set_stream)(cublasHandle_t, cudaStream_t);
    cublasStatus_t (*set_workspace)(cublasHandle_t, void *, size_t);
    cublasStatus_t (*set_pointer_mode)(cublasHandle_t, cublasPointerMode_t);
    cublasStatus_t (*gemm_ex)(cublasHandle_t, cublasOperation_t, cublasOperation_t, int, int, int, const void *,
                              const void *, cudaDataType, int, const void *, cudaDataType, int, const void *, void *,
                              cudaDataType, int, cublasComputeType_t, cublasGemmAlgo_t);
    const char *(*status_string)(cublasStatus_t);
    const char *(*status_name)(cublasStatus_t);
} blas_api;

static blas_api blas_fn;
static kvb_status blas_loaded = KVB_ERR_BACKEND;
static pthread_once_t blas_once = PTHREAD_ONCE_INIT;

#define KVB_STR_(x) #x
#define KVB_STR(x) KVB_STR_(x)
#define CUBLAS_SONAME "libcublas.so." KVB_STR(CUBLAS_VER_MAJOR)

static void blas_load(void) {
#ifdef KVB_CUBLAS_LINKED
    blas_fn = (blas_api){cublasCreate_v2,        cublasDestroy_v2, cublasSetStream_v2,    cublasSetWorkspace_v2,
                      cublasSetPointerMode_v2, cublasGemmEx,     cublasGetStatusString, cublasGetStatusName};
    blas_loaded = KVB_OK;
#else
    /* the toolkit's copy first (the one the build was checked against), then the loader's search path */
    void *h = NULL;
#ifdef KVB_CUDA_LIBDIR
    h = dlopen(KVB_CUDA_LIBDIR "/" CUBLAS_SONAME, RTLD_NOW | RTLD_LOCAL);
#endif
    if (!h) h = dlopen(CUBLAS_SONAME, RTLD_NOW | RTLD_LOCAL);
    if (!h) {
        KVB_LOG_E("cuda backend: cannot load cuBLAS (%s): %s", CUBLAS_SONAME, dlerror());
        return;
    }
    static const char *const names[] = {"cublasCreate_v2",         "cublasDestroy_v2", "cublasSetStream_v2",
                                        "cublasSetWorkspace_v2",   "cublasSetPointerMode_v2",
                                        "cublasGemmEx",            "cublasGetStatusString",
                                        "cublasGetStatusName"};
    void *fn[KVB_ARRAY_LEN(names)];
    for (size_t i = 0; i < KVB_ARRAY_LEN(names); i++) {
        if (!(fn[i] = dlsym(h, names[i]))) {
            KVB_LOG_E("cuda backend: %s has no %s", CUBLAS_SONAME, names[i]);
            dlclose(h);
            return;
        }
    }
    _Static_assert(sizeof blas_fn == sizeof fn, "one entry point per member of blas_api");
    memcpy(&blas_fn, fn, sizeof blas_fn); /* same order, all function pointers */
    blas_loaded = KVB_OK;
#endif
}

/* ---------------------------------------------------------------- errors */

kvb_status kvb__cublas_status(int st, const char *expr, const char *file, int line) {
    if (st == (int)CUBLAS_STATUS_SUCCESS) return KVB_OK;
    cublasStatus_t s = (cublasStatus_t)st;
    KVB_LOG_E("cublas: %s: %s (%s) at %s:%d", expr, blas_fn.status_string ? blas_fn.status_string(s) : "?",
              blas_fn.status_name ? blas_fn.status_name(s) : "?", file, line);
    switch (s) {
    case CUBLAS_STATUS_ALLOC_FAILED: return KVB_ERR_NOMEM;
    case CUBLAS_STATUS_NOT_SUPPORTED:
    case CUBLAS_STATUS_ARCH_MISMATCH: return KVB_ERR_UNSUPPORTED;
    case CUBLAS_STATUS_INVALID_VALUE: return KVB_ERR_INVALID;
    default: return KVB_ERR_BACKEND;
    }
}

#ifdef KVB_HAVE_NCCL
kvb_status kvb__nccl_status(int res, const char *expr, const char *file, int line) {
    if (res == (int)ncclSuccess) return KVB_OK;
    ncclResult_t r = (ncclResult_t)res;
    const char *last = ncclGetLastError(NULL);
    KVB_LOG_E("nccl: %s: %s%s%s at %s:%d", expr, ncclGetErrorString(r), last && *last ? ": " : "", last ? last : "",
              file, line);
    switch (r) {
    case ncclInvalidArgument:
    case ncclInvalidUsage: return KVB_ERR_INVALID;
    case ncclRemoteError:
    case ncclSystemError: return KVB_ERR_IO;
    default: return KVB_ERR_BACKEND;
    }
}
#endif

/* ---------------------------------------------------------------- context */

typedef struct stage_slot {
    void *host;        /* [cap] bytes of pinned memory */
    size_t cap;
    cudaEvent_t done;  /* recorded after the copy out of `host` */
    int pending;       /* 1 while that copy may still read `host` */
} stage_slot;

typedef struct cuda_ctx {
    kvb_dtype dt;             /* activations, KV cache, weight matrices */
    int device;
    int n_sm;
    int prefill_tile;         /* rows of a tensor-core prefill item, 64 or 128 (KVB_CUDA_PREFILL_TILE) */
    uint64_t n_prefill_items[2]; /* prefill items launched with 64 and with 128 rows */
    cudaStream_t stream;      /* non-blocking; every operator runs here */
    cudaStream_t copy_stream; /* non-blocking; `copy` (any host thread, ordered after nothing) and
                               * copy_async's KVB_ENGINE_PEER */
    cudaStream_t h2d, d2h;    /* non-blocking; copy_async's host -> device and device -> host copies */
    pthread_mutex_t tk_mu;    /* copy_async's tickets (the stager's threads post at once) */
    cudaEvent_t fence;        /* recorded on `stream` by copy_async: its copy waits for the operators */
    cudaEvent_t ring[TICKET_RING]; /* the event of ticket t is ring[t % TICKET_RING] ... */
    uint64_t ring_t[TICKET_RING];  /* ... while ring_t[t % TICKET_RING] == t */
    uint64_t last_ticket;
    int tk_mu_init;
    /* copy_async's issue (tk_mu): its pieces coalesced, then one cudaMemcpyBatchAsync or a call each */
    int batch_on;                          /* kvb_cuda_backend_set_copy_batch: 1 (default) where the runtime has it */
    int batch_failed[KVB_ENGINE_COUNT];    /* the batch API failed on this engine where the loop did not */
    kvb_copy_piece *cp;                    /* [cp_cap] the call's pieces, coalesced */
    kvb_copy_span *spans;                  /* [3 cp_cap] kvb_copy_independent's scratch */
    void **b_dst;                          /* [cp_cap] cudaMemcpyBatchAsync's arrays */
    const void **b_src;
    size_t *b_size;
    size_t cp_cap;
    uint64_t n_batched, n_single;          /* pieces issued in batches, and one call each */
    cublasHandle_t blas;      /* bound to `stream` and `blas_ws` */
    cublasComputeType_t compute;
    void *blas_ws;            /* [BLAS_WORKSPACE_BYTES] */
    stage_slot stage[STAGE_SLOTS];
    int next_stage;
    void *meta;               /* [meta_cap] bytes: the current operator's host arrays */
    size_t meta_cap;
    float *part;              /* [part_cap] bytes: split partials of attention (outputs, then lse) and products */
    size_t part_cap;
    int32_t *counters;        /* [counters_cap / 4] split groups' counters (attention, products), zero between launches */
    size_t counters_cap;
    int32_t *tok;             /* [tok_cap / 4] the sampled tokens */
    size_t tok_cap;
    float *f32buf;            /* [f32_cap] floats: to_host_f32 conversion */
    size_t f32_cap;
    void *wtmp;               /* [wtmp_cap] bytes: weight upload before conversion */
    size_t wtmp_cap;
    void *scratch;            /* [scratch_cap] bytes: activations of matmul_norm / matmul_swiglu's fallbacks */
    size_t scratch_cap;
    /* host scratch for operator plans, grown on demand */
    int64_t *slots;           /* [slots_cap] kv_write slot per batch row */
    size_t slots_cap;
    const void **blk;         /* [blk_cap] compact block addresses for kv_write */
    size_t blk_cap;
    kvb_cuda_attn_prefill_item *pitems;
    size_t pitems_cap;
    kvb_cuda_attn_decode_item *ditems;
    size_t ditems_cap;
    kvb_cuda_attn_group *groups;
    size_t groups_cap;
    kvb_cuda_fp8 *fp8;        /* FP8 weights' products (fp8.h), made at the first FP8 weight */
    kvb_cuda_gemv_ctx gemv;   /* the decode products' kernel choice, split workspace (part, counters), counts */
    uint64_t n_cublas;        /* products cuBLAS ran */
} cuda_ctx;

/* Makes *arr hold at least n elements of `size` bytes (contents kept). */
static kvb_status host_reserve(void **arr, size_t *cap, size_t n, size_t size) {
    if (n <= *cap) return KVB_OK;
    size_t want = n + n / 2 + 16;
    KVB_TRY(kvb_realloc_array(arr, want, size));
    *cap = want;
    return KVB_OK;
}

/* Makes the device buffer *p hold at least `bytes`; waits for the stream before freeing the old one
 * (a kernel may still read it). Contents are not kept. */
static kvb_status dev_reserve(cuda_ctx *c, void **p, size_t *cap, size_t bytes) {
    if (bytes <= *cap) return KVB_OK;
    size_t want = bytes + bytes / 2;
    if (*p) {
        KVB_TRY(KVB_CUDA_CHECK(cudaStreamSynchronize(c->stream)));
        KVB_TRY(KVB_CUDA_CHECK(cudaFree(*p)));
        *p = NULL;
        *cap = 0;
    }
    KVB_TRY(KVB_CUDA_CHECK(cudaMalloc(p, want)));
    *cap = want;
    return KVB_OK;
}

/* Makes the split counters hold at least n groups, every one zero (new memory is cleared on the stream;
 * counters in use are zero between launches, the merging block resets its group's). */
static kvb_status counters_reserve(cuda_ctx *c, size_t n) {
    size_t bytes = n * sizeof(int32_t);
    if (bytes <= c->counters_cap) return KVB_OK;
    KVB_TRY(dev_reserve(c, (void **)&c->counters, &c->counters_cap, bytes));
    return KVB_CUDA_CHECK(cudaMemsetAsync(c->counters, 0, c->counters_cap, c->stream));
}

/* The split partials and counters of a decode product (attention's: the stream orders their uses, and
 * every launch leaves the counters zero). */
static kvb_status gemv_workspace(cuda_ctx *c, int rows, int cols, int n) {
    size_t n_counters = 0, floats = kvb_cuda_gemv_workspace(&c->gemv, c->dt, rows, cols, n, &n_counters);
    if (floats) {
        KVB_TRY(dev_reserve(c, (void **)&c->part, &c->part_cap, floats * sizeof(float)));
        KVB_TRY(counters_reserve(c, n_counters));
    }
    c->gemv.part = c->part;
    c->gemv.counters = c->counters;
    return KVB_OK;
}

/* One host array an operator sends to the device; `dev` receives its device address. */
typedef struct meta_part {
    const void *src;
    size_t bytes;
    const void **dev;
} meta_part;

#define ALIGN16(x) (((x) + 15) & ~(size_t)15)

/* The kernels read K/V with 16-byte loads: every block address must be 16-byte aligned. One OR over
 * the addresses checks them all; a misaligned one is a caller's bug (a pool or a lent region at an odd
 * offset), refused before any kernel could fault on it. */
static kvb_status check_blocks_aligned(const void *const *blocks, size_t n, const char *op) {
    uintptr_t bits = 0;
    for (size_t i = 0; i < n; i++) bits |= (uintptr_t)blocks[i];
    if (bits & 15u) {
        KVB_LOG_E("cuda %s: a KV block address is not 16-byte aligned", op);
        return KVB_ERR_INVALID;
    }
    return KVB_OK;
}

/* Copies the parts to the device metadata buffer on the stream (see the top of this file). */
static kvb_status upload(cuda_ctx *c, meta_part *parts, int n) {
    size_t total = 0;
    for (int i = 0; i < n; i++) total += ALIGN16(parts[i].bytes);
    if (total == 0) return KVB_OK;
    stage_slot *s = &c->stage[c->next_stage];
    c->next_stage = (c->next_stage + 1) % STAGE_SLOTS;
    if (s->pending) {
        KVB_TRY(KVB_CUDA_CHECK(cudaEventSynchronize(s->done)));
        s->pending = 0;
    }
    if (s->cap < total) {
        if (s->host) KVB_TRY(KVB_CUDA_CHECK(cudaFreeHost(s->host)));
        s->host = NULL;
        s->cap = 0;
        size_t want = KVB_MAX(total + total / 2, (size_t)64 << 10);
        KVB_TRY(KVB_CUDA_CHECK(cudaHostAlloc(&s->host, want, cudaHostAllocDefault)));
        s->cap = want;
    }
    KVB_TRY(dev_reserve(c, &c->meta, &c->meta_cap, total));
    size_t off = 0;
    for (int i = 0; i < n; i++) {
        if (parts[i].bytes) memcpy((char *)s->host + off, parts[i].src, parts[i].bytes);
        *parts[i].dev = (char *)c->meta + off;
        off += ALIGN16(parts[i].bytes);
    }
    KVB_TRY(KVB_CUDA_CHECK(cudaMemcpyAsync(c->meta, s->host, total, cudaMemcpyHostToDevice, c->stream)));
    KVB_TRY(KVB_CUDA_CHECK(cudaEventRecord(s->done, c->stream)));
    s->pending = 1;
    return KVB_OK;
}

static cudaDataType_t cuda_type(kvb_dtype dt) {
    switch (dt) {
    case KVB_DTYPE_F16: return CUDA_R_16F;
    case KVB_DTYPE_BF16: return CUDA_R_16BF;
    default: return CUDA_R_32F;
    }
}

/* ---------------------------------------------------------------- memory */

/* Frees a weight's device memory (buffers, pools and regions come from the memory interface). */
static void dev_free(void *ctx, void *p) {
    if (!p) return;
    cuda_ctx *c = ctx;
    /* the memory may be in use by work still queued */
    (void)KVB_CUDA_CHECK(cudaStreamSynchronize(c->stream));
    (void)KVB_CUDA_CHECK(cudaFree(p));
}

static kvb_status cu_to_device(void *ctx, void *dst, const void *src, size_t bytes) {
    cuda_ctx *c = ctx;
    if (bytes == 0) return KVB_OK;
    /* the calling thread may be another than the one that made the backend (a stager's copy thread) */
    KVB_TRY(KVB_CUDA_CHECK(cudaSetDevice(c->device)));
    KVB_TRY(KVB_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyHostToDevice, c->stream)));
    /* the caller may reuse `src` as soon as we return */
    return KVB_CUDA_CHECK(cudaStreamSynchronize(c->stream));
}

static kvb_status cu_to_host(void *ctx, void *dst, const void *src, size_t bytes) {
    cuda_ctx *c = ctx;
    if (bytes == 0) return KVB_OK;
    KVB_TRY(KVB_CUDA_CHECK(cudaSetDevice(c->device)));
    KVB_TRY(KVB_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToHost, c->stream)));
    return KVB_CUDA_CHECK(cudaStreamSynchronize(c->stream));
}

static kvb_status cu_to_host_f32(void *ctx, float *dst, const void *src, size_t n) {
    cuda_ctx *c = ctx;
    if (n == 0) return KVB_OK;
    KVB_TRY(KVB_CUDA_CHECK(cudaSetDevice(c->device)));
    const void *from = src;
    if (c->dt != KVB_DTYPE_F32) {
        KVB_TRY(dev_reserve(c, (void **)&c->f32buf, &c->f32_cap, n * sizeof(float)));
        KVB_TRY(KVB_CUDA_CHECK(kvb_cuda_convert(src, c->dt, c->f32buf, KVB_DTYPE_F32, n, c->stream)));
        from = c->f32buf;
    }
    KVB_TRY(KVB_CUDA_CHECK(cudaMemcpyAsync(dst, from, n * sizeof(float), cudaMemcpyDeviceToHost, c->stream)));
    return KVB_CUDA_CHECK(cudaStreamSynchronize(c->stream));
}

/* Device -> device bytes (local, or in a region imported from another process) on the copy stream,
 * which does not wait for the operators: the caller guarantees they do not touch these ranges. The
 * runtime is thread-safe, so the LSC copy thread calls this while the engine's thread runs operators. */
static kvb_status cu_copy(void *ctx, void *dst, const void *src, size_t bytes) {
    cuda_ctx *c = ctx;
    if (bytes == 0) return KVB_OK;
    /* the calling thread (the stager's copy thread) has its own current device, 0 by default */
    KVB_TRY(KVB_CUDA_CHECK(cudaSetDevice(c->device)));
    KVB_TRY(KVB_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, c->copy_stream)));
    return KVB_CUDA_CHECK(cudaStreamSynchronize(c->copy_stream));
}

static kvb_status cu_sync(void *ctx) {
    cuda_ctx *c = ctx;
    KVB_TRY(KVB_CUDA_CHECK(cudaSetDevice(c->device)));
    return KVB_CUDA_CHECK(cudaStreamSynchronize(c->stream));
}

/* The engine's batch sampled on the device (sampling.cu): only the token ids come back. */
static kvb_status cu_sample(void *ctx, const void *logits, int rows, int vocab, const kvb_sample_row *p, int32_t *out) {
    cuda_ctx *c = ctx;
    if (rows <= 0) return KVB_OK;
    KVB_TRY(dev_reserve(c, (void **)&c->tok, &c->tok_cap, (size_t)rows * sizeof(int32_t)));
    int greedy = 1;
    for (int r = 0; r < rows && greedy; r++) greedy = p[r].temperature <= 0;
    if (greedy) {
        KVB_TRY(KVB_CUDA_CHECK(kvb_cuda_argmax(logits, c->dt, rows, vocab, c->tok, c->stream)));
    } else {
        _Static_assert(sizeof(kvb_sample_row) == sizeof(kvb_cuda_sample_params), "one layout");
        const void *d_p = NULL;
        meta_part parts[] = {{p, (size_t)rows * sizeof *p, &d_p}};
        KVB_TRY(upload(c, parts, 1));
        KVB_TRY(KVB_CUDA_CHECK(kvb_cuda_sample(logits, c->dt, rows, vocab, d_p, c->tok, c->stream)));
    }
    KVB_TRY(KVB_CUDA_CHECK(cudaMemcpyAsync(out, c->tok, (size_t)rows * sizeof(int32_t), cudaMemcpyDeviceToHost, c->stream)));
    return KVB_CUDA_CHECK(cudaStreamSynchronize(c->stream));
}

/* ---------------------------------------------------------------- copies with tickets (backend.h) */

static cudaStream_t dir_stream(const cuda_ctx *c, kvb_copy_engine d) {
    return d == KVB_ENGINE_H2D ? c->h2d : d == KVB_ENGINE_D2H ? c->d2h : c->copy_stream;
}

/* Makes copy_async's piece arrays hold n pieces (with tk_mu held). */
static kvb_status pieces_reserve(cuda_ctx *c, size_t n) {
    if (n <= c->cp_cap) return KVB_OK;
    size_t want = n + n / 2 + 16;
    KVB_TRY(kvb_realloc_array((void **)&c->cp, want, sizeof *c->cp));
    KVB_TRY(kvb_realloc_array((void **)&c->spans, 3 * want, sizeof *c->spans));
    KVB_TRY(kvb_realloc_array((void **)&c->b_dst, want, sizeof *c->b_dst));
    KVB_TRY(kvb_realloc_array((void **)&c->b_src, want, sizeof *c->b_src));
    KVB_TRY(kvb_realloc_array((void **)&c->b_size, want, sizeof *c->b_size));
    c->cp_cap = want;
    return KVB_OK;
}

/* The batch API: CUDA 12.8 added it, 13.0 dropped its failIdx argument. */
#if defined(CUDART_VERSION) && CUDART_VERSION >= 12080
#define HAVE_MEMCPY_BATCH 1
/* c->cp[0..m) as one cudaMemcpyBatchAsync on s (with tk_mu held): one call into the runtime instead of m,
 * whose per-call cost (about 3.7 us on an H200 against 1.2 us to move 64 KiB) otherwise sets the rate
 * of small pieces and keeps the issuing thread from the next layer's kernels. */
static cudaError_t issue_batch(cuda_ctx *c, kvb_copy_engine dir, int m, cudaStream_t s) {
    for (int i = 0; i < m; i++) {
        c->b_dst[i] = c->cp[i].dst;
        c->b_src[i] = c->cp[i].src;
        c->b_size[i] = c->cp[i].bytes;
    }
    struct cudaMemcpyAttributes a;
    memset(&a, 0, sizeof a);
    /* the source is read in stream order: after the fence, so a store reads what the layers wrote */
    a.srcAccessOrder = cudaMemcpySrcAccessOrderStream;
    /* hints: the runtime uses them only for managed or system-allocated memory, ignores them otherwise */
    struct cudaMemLocation host = {.type = cudaMemLocationTypeHost, .id = 0};
    struct cudaMemLocation dev = {.type = cudaMemLocationTypeDevice, .id = c->device};
    a.srcLocHint = dir == KVB_ENGINE_H2D ? host : dev;
    a.dstLocHint = dir == KVB_ENGINE_D2H ? host : dev;
    /* the copies are there to run under the layers' kernels */
    a.flags = cudaMemcpyFlagPreferOverlapWithCompute;
    size_t first = 0;
#if CUDART_VERSION >= 13000
    return cudaMemcpyBatchAsync((void *const *)c->b_dst, (const void *const *)c->b_src, c->b_size, (size_t)m, &a,
                                &first, 1, s);
#else
    size_t fail_idx = 0;
    return cudaMemcpyBatchAsync(c->b_dst, (void **)c->b_src, c->b_size, (size_t)m, &a, &first, 1, &fail_idx, s);
#endif
}
#else
#define HAVE_MEMCPY_BATCH 0
#endif

/* c->cp[0..m) one cudaMemcpyAsync each, in order (with tk_mu held). */
static kvb_status issue_each(cuda_ctx *c, enum cudaMemcpyKind kind, int m, cudaStream_t s) {
    for (int i = 0; i < m; i++)
        KVB_TRY(KVB_CUDA_CHECK(cudaMemcpyAsync(c->cp[i].dst, c->cp[i].src, c->cp[i].bytes, kind, s)));
    c->n_single += (uint64_t)m;
    return KVB_OK;
}

/* Issues x[0..n) on s (with tk_mu held): coalesced, then as one batch when the pieces are independent
 * (a batch's copies run in no particular order) and the runtime has the batch API, else one call each. */
static kvb_status issue_pieces(cuda_ctx *c, kvb_copy_engine dir, enum cudaMemcpyKind kind, const kvb_copy_piece *x,
                               int n, cudaStream_t s) {
    KVB_TRY(pieces_reserve(c, (size_t)n));
    int m = kvb_copy_coalesce(x, n, c->cp);
#if HAVE_MEMCPY_BATCH
    if (m > 1 && c->batch_on && !c->batch_failed[dir] && kvb_copy_independent(c->cp, m, c->spans)) {
        cudaError_t e = issue_batch(c, dir, m, s);
        if (e == cudaSuccess) {
            c->n_batched += (uint64_t)m;
            return KVB_OK;
        }
        /* the error is also the thread's last error: clear it, or the next launch check reports it */
        (void)cudaGetLastError();
        /* issued again one by one: pieces a failed batch may have copied are copied again from unchanged
         * sources (they are independent); if that works, the batch API is what failed, here for good */
        kvb_status st = issue_each(c, kind, m, s);
        if (st == KVB_OK) {
            static const char *const engine[KVB_ENGINE_COUNT] = {"host -> device", "device -> host", "peer"};
            c->batch_failed[dir] = 1;
            KVB_LOG_W("cuda backend: cudaMemcpyBatchAsync failed on the %s copy engine (%s: %s); its copies go "
                      "one call each from now on",
                      engine[dir], cudaGetErrorName(e), cudaGetErrorString(e));
        }
        return st;
    }
#else
    (void)dir;
#endif
    return issue_each(c, kind, m, s);
}

static kvb_status cu_copy_async(void *ctx, kvb_copy_engine dir, const kvb_copy_piece *x, int n, uint64_t *ticket) {
    cuda_ctx *c = ctx;
    static const enum cudaMemcpyKind kind[KVB_ENGINE_COUNT] = {cudaMemcpyHostToDevice, cudaMemcpyDeviceToHost,
                                                             cudaMemcpyDefault};
    if ((unsigned)dir >= KVB_ENGINE_COUNT || n < 0 || (n > 0 && !x) || !ticket) return KVB_ERR_INVALID;
    KVB_TRY(KVB_CUDA_CHECK(cudaSetDevice(c->device)));
    cudaStream_t s = dir_stream(c, dir);
    pthread_mutex_lock(&c->tk_mu);
    /* after the operators issued so far: a store reads what they wrote, a load may overwrite what they read */
    kvb_status st = KVB_CUDA_CHECK(cudaEventRecord(c->fence, c->stream));
    if (st == KVB_OK) st = KVB_CUDA_CHECK(cudaStreamWaitEvent(s, c->fence, 0));
    if (st == KVB_OK && n > 0) st = issue_pieces(c, dir, kind[dir], x, n, s);
    if (st == KVB_OK) {
        uint64_t t = c->last_ticket + 1;
        size_t slot = t % TICKET_RING;
        if (c->ring_t[slot]) st = KVB_CUDA_CHECK(cudaEventSynchronize(c->ring[slot]));
        if (st == KVB_OK) st = KVB_CUDA_CHECK(cudaEventRecord(c->ring[slot], s));
        if (st == KVB_OK) {
            c->ring_t[slot] = t;
            c->last_ticket = t;
            *ticket = t;
        }
    }
    pthread_mutex_unlock(&c->tk_mu);
    return st;
}

/* The event of ticket t (with tk_mu held): NULL when t has landed for sure (its event serves a later
 * ticket, which waited for it); KVB_ERR_INVALID for a ticket never handed out. */
static kvb_status ticket_event(const cuda_ctx *c, uint64_t t, cudaEvent_t *e) {
    if (t == 0 || t > c->last_ticket) return KVB_ERR_INVALID;
    size_t slot = t % TICKET_RING;
    *e = c->ring_t[slot] == t ? c->ring[slot] : NULL;
    return KVB_OK;
}

static kvb_status cu_wait_ticket(void *ctx, uint64_t t) {
    cuda_ctx *c = ctx;
    cudaEvent_t e = NULL;
    KVB_TRY(KVB_CUDA_CHECK(cudaSetDevice(c->device)));
    pthread_mutex_lock(&c->tk_mu);
    kvb_status st = ticket_event(c, t, &e);
    if (st == KVB_OK && e) st = KVB_CUDA_CHECK(cudaStreamWaitEvent(c->stream, e, 0));
    pthread_mutex_unlock(&c->tk_mu);
    return st;
}

static int cu_ticket_done(void *ctx, uint64_t t) {
    cuda_ctx *c = ctx;
    cudaEvent_t e = NULL;
    if (cudaSetDevice(c->device) != cudaSuccess) return 0;
    pthread_mutex_lock(&c->tk_mu);
    /* an error is not "not yet": ticket_wait reports it */
    int done = ticket_event(c, t, &e) != KVB_OK || !e || cudaEventQuery(e) != cudaErrorNotReady;
    pthread_mutex_unlock(&c->tk_mu);
    return done;
}

static kvb_status cu_ticket_wait(void *ctx, uint64_t t) {
    cuda_ctx *c = ctx;
    cudaEvent_t e = NULL;
    KVB_TRY(KVB_CUDA_CHECK(cudaSetDevice(c->device)));
    pthread_mutex_lock(&c->tk_mu);
    kvb_status st = ticket_event(c, t, &e);
    pthread_mutex_unlock(&c->tk_mu);
    /* outside the lock: the event may be recorded again for a later ticket meanwhile, and waiting for
     * that one waits longer, never too little */
    if (st == KVB_OK && e) st = KVB_CUDA_CHECK(cudaEventSynchronize(e));
    return st;
}

/* ---------------------------------------------------------------- weights */

/* Copies n host elements of src_dtype to device memory w as dd elements (converted on the device), on
 * the stream; the caller synchronises before `src` may go. */
static kvb_status upload_elems(cuda_ctx *c, void *w, kvb_dtype dd, const void *src, kvb_dtype src_dtype, size_t n) {
    size_t ss = kvb_dtype_size(src_dtype), ds = kvb_dtype_size(dd);
    if (src_dtype == dd) return KVB_CUDA_CHECK(cudaMemcpyAsync(w, src, n * ds, cudaMemcpyHostToDevice, c->stream));
    size_t chunk = KVB_MIN(n, UPLOAD_CHUNK_ELEMS);
    KVB_TRY(dev_reserve(c, &c->wtmp, &c->wtmp_cap, chunk * ss));
    for (size_t off = 0; off < n; off += chunk) {
        size_t len = KVB_MIN(chunk, n - off);
        /* stream order: this copy into wtmp runs after the previous chunk's conversion */
        KVB_TRY(KVB_CUDA_CHECK(
            cudaMemcpyAsync(c->wtmp, (const char *)src + off * ss, len * ss, cudaMemcpyHostToDevice, c->stream)));
        KVB_TRY(KVB_CUDA_CHECK(kvb_cuda_convert(c->wtmp, src_dtype, (char *)w + off * ds, dd, len, c->stream)));
    }
    return KVB_OK;
}

static kvb_status cu_weight_load_stacked(void *ctx, const void *const *src, const kvb_dtype *src_dtype,
                                         const int64_t *rows, int n, int64_t cols, kvb_tensor *dst) {
    cuda_ctx *c = ctx;
    if (n <= 0 || cols <= 0) return KVB_ERR_INVALID;
    int64_t total = 0;
    for (int i = 0; i < n; i++) {
        if (rows[i] <= 0 || kvb_dtype_size(src_dtype[i]) == 0) return KVB_ERR_INVALID;
        total += rows[i];
    }
    kvb_dtype dd = cols == 1 ? KVB_DTYPE_F32 : c->dt; /* vectors stay f32 */
    size_t ds = kvb_dtype_size(dd);
    void *w = NULL;
    KVB_TRY(KVB_CUDA_CHECK(cudaMalloc(&w, (size_t)total * (size_t)cols * ds)));
    kvb_status st;
    size_t off = 0;
    for (int i = 0; i < n; i++) {
        size_t elems = (size_t)rows[i] * (size_t)cols;
        KVB_TRY_GOTO(upload_elems(c, (char *)w + off * ds, dd, src[i], src_dtype[i], elems), fail);
        off += elems;
    }
    /* the caller unmaps `src` after we return */
    KVB_TRY_GOTO(KVB_CUDA_CHECK(cudaStreamSynchronize(c->stream)), fail);
    *dst = (kvb_tensor){.data = w, .dtype = dd, .ne = {total, cols}}; /* no view, no FP8 scale */
    return KVB_OK;
fail:
    cudaStreamSynchronize(c->stream);
    cudaFree(w);
    return st;
}

static kvb_status cu_weight_load(void *ctx, const void *src, kvb_dtype src_dtype, int64_t rows, int64_t cols,
                                 kvb_tensor *dst) {
    return cu_weight_load_stacked(ctx, &src, &src_dtype, &rows, 1, cols, dst);
}

/* FP8 weights: fp8.h. */
static kvb_status cu_weight_fp8(void *ctx, const kvb_fp8_weight *src, kvb_tensor *dst) {
    cuda_ctx *c = ctx;
    if (!c->fp8) KVB_TRY(kvb_cuda_fp8_create(&c->fp8));
    return kvb_cuda_fp8_upload(src, c->stream, dst);
}

static void cu_weight_free(void *ctx, kvb_tensor *t) {
    if (!t) return;
    dev_free(ctx, t->data);
    dev_free(ctx, t->scale);
    t->data = NULL;
    t->scale = NULL;
}

/* ---------------------------------------------------------------- operators */

static kvb_status cu_embed(void *ctx, const kvb_tensor *table, const int32_t *ids, int n, void *out) {
    cuda_ctx *c = ctx;
    if (n <= 0) return KVB_OK;
    const void *d_ids = NULL;
    meta_part parts[] = {{ids, (size_t)n * sizeof(int32_t), &d_ids}};
    KVB_TRY(upload(c, parts, 1));
    return KVB_CUDA_CHECK(
        kvb_cuda_gather_rows(table->data, table->dtype, d_ids, n, (int)table->ne[1], out, c->dt, c->stream));
}

static kvb_status cu_gather_rows(void *ctx, const void *x, const int32_t *rows, int n, int dim, void *out) {
    cuda_ctx *c = ctx;
    if (n <= 0) return KVB_OK;
    const void *d_rows = NULL;
    meta_part parts[] = {{rows, (size_t)n * sizeof(int32_t), &d_rows}};
    KVB_TRY(upload(c, parts, 1));
    return KVB_CUDA_CHECK(kvb_cuda_gather_rows(x, c->dt, d_rows, n, dim, out, c->dt, c->stream));
}

static kvb_status cu_matmul(void *ctx, const void *x, int n, const kvb_tensor *w, float beta, void *y) {
    cuda_ctx *c = ctx;
    if (n <= 0) return KVB_OK;
    if (w->dtype == KVB_DTYPE_F8_E4M3) return kvb_cuda_fp8_matmul(c->fp8, c->stream, c->dt, x, n, w, beta, y);
    if (w->dtype != c->dt || w->ne[0] > INT32_MAX || w->ne[1] > INT32_MAX) {
        KVB_LOG_E("cuda matmul: weight of dtype %s [%lld][%lld] on a %s backend", kvb_dtype_name(w->dtype),
                  (long long)w->ne[0], (long long)w->ne[1], kvb_dtype_name(c->dt));
        return KVB_ERR_INVALID;
    }
    int rows = (int)w->ne[0], cols = (int)w->ne[1];
    if (kvb_cuda_gemv_fits(&c->gemv, c->dt, w->data, x, cols, n)) { /* decode: gemv.h says why */
        KVB_TRY(gemv_workspace(c, rows, cols, n));
        return KVB_CUDA_CHECK(kvb_cuda_gemv(&c->gemv, w->data, x, y, c->dt, rows, cols, n, beta, c->stream));
    }
    c->n_cublas++;
    float alpha = 1.0f;
    cudaDataType_t t = cuda_type(c->dt);
    /* column-major view: Y^T[rows][n] = W[rows][cols] (stored as cols x rows, so op T) . X^T[cols][n] */
    return KVB_CUBLAS_CHECK(blas_fn.gemm_ex(c->blas, CUBLAS_OP_T, CUBLAS_OP_N, rows, n, cols, &alpha, w->data, t, cols, x, t,
                                         cols, &beta, y, t, rows, c->compute, CUBLAS_GEMM_DEFAULT));
}

/* A scratch activation buffer of at least `bytes` (the unfused fallbacks of matmul_norm / _swiglu). */
static kvb_status scratch(cuda_ctx *c, size_t bytes, void **out) {
    KVB_TRY(dev_reserve(c, &c->scratch, &c->scratch_cap, bytes));
    *out = c->scratch;
    return KVB_OK;
}

static kvb_status check_weight(const cuda_ctx *c, const kvb_tensor *w, const char *op) {
    if (w->dtype == c->dt && w->ne[0] <= INT32_MAX && w->ne[1] <= INT32_MAX) return KVB_OK;
    KVB_LOG_E("cuda %s: weight of dtype %s [%lld][%lld] on a %s backend", op, kvb_dtype_name(w->dtype),
              (long long)w->ne[0], (long long)w->ne[1], kvb_dtype_name(c->dt));
    return KVB_ERR_INVALID;
}

static kvb_status cu_matmul_norm(void *ctx, const void *x, int n, const kvb_tensor *norm, float eps,
                                 const kvb_tensor *w, void *y) {
    cuda_ctx *c = ctx;
    if (n <= 0) return KVB_OK;
    KVB_TRY(check_weight(c, w, "matmul_norm"));
    int rows = (int)w->ne[0], cols = (int)w->ne[1];
    if (norm->dtype != KVB_DTYPE_F32 || norm->ne[0] * norm->ne[1] != cols) {
        KVB_LOG_E("cuda matmul_norm: the norm weight must be %d f32 values", cols);
        return KVB_ERR_INVALID;
    }
    if (kvb_cuda_gemv_fits(&c->gemv, c->dt, w->data, x, cols, n)) { /* 16-bit rows of 16-byte slots: cols % 8 == 0 */
        KVB_TRY(gemv_workspace(c, rows, cols, n));
        return KVB_CUDA_CHECK(
            kvb_cuda_gemv_norm(&c->gemv, w->data, x, norm->data, eps, y, c->dt, rows, cols, n, 0.0f, c->stream));
    }
    void *h = NULL;
    KVB_TRY(scratch(c, (size_t)n * cols * kvb_dtype_size(c->dt), &h));
    KVB_TRY(KVB_CUDA_CHECK(kvb_cuda_rmsnorm(x, h, c->dt, n, cols, norm->data, eps, c->stream)));
    return cu_matmul(ctx, h, n, w, 0.0f, y);
}

static kvb_status cu_matmul_swiglu(void *ctx, const void *gu, int n, const kvb_tensor *w, float beta, void *y) {
    cuda_ctx *c = ctx;
    if (n <= 0) return KVB_OK;
    KVB_TRY(check_weight(c, w, "matmul_swiglu"));
    int rows = (int)w->ne[0], cols = (int)w->ne[1];
    if (kvb_cuda_gemv_fits(&c->gemv, c->dt, w->data, gu, cols, n)) {
        KVB_TRY(gemv_workspace(c, rows, cols, n));
        return KVB_CUDA_CHECK(kvb_cuda_gemv_swiglu(&c->gemv, w->data, gu, y, c->dt, rows, cols, n, beta, c->stream));
    }
    void *act = NULL;
    KVB_TRY(scratch(c, (size_t)n * cols * kvb_dtype_size(c->dt), &act));
    KVB_TRY(KVB_CUDA_CHECK(kvb_cuda_swiglu(gu, act, c->dt, n, cols, c->stream)));
    return cu_matmul(ctx, act, n, w, beta, y);
}

static kvb_status cu_rmsnorm(void *ctx, const void *x, int rows, int dim, const kvb_tensor *w, float eps, void *y) {
    cuda_ctx *c = ctx;
    if (w->dtype != KVB_DTYPE_F32 || w->ne[0] * w->ne[1] != dim) {
        KVB_LOG_E("cuda rmsnorm: weight must be %d f32 values", dim);
        return KVB_ERR_INVALID;
    }
    return KVB_CUDA_CHECK(kvb_cuda_rmsnorm(x, y, c->dt, rows, dim, w->data, eps, c->stream));
}

static kvb_status cu_rope(void *ctx, void *q, int n_heads, void *k, int n_kv_heads, int n, const int32_t *pos,
                          const kvb_rope *rope) {
    cuda_ctx *c = ctx;
    if (n <= 0) return KVB_OK;
    const void *d_pos = NULL, *d_freq = NULL;
    meta_part parts[] = {{pos, (size_t)n * sizeof(int32_t), &d_pos},
                         {rope->inv_freq, (size_t)(rope->head_dim / 2) * sizeof(float), &d_freq}};
    KVB_TRY(upload(c, parts, 2));
    return KVB_CUDA_CHECK(
        kvb_cuda_rope(q, n_heads, k, n_kv_heads, c->dt, n, rope->head_dim, d_pos, d_freq, c->stream));
}

static kvb_status cu_bias_add(void *ctx, void *y, int n, const kvb_tensor *b) {
    cuda_ctx *c = ctx;
    if (b->dtype != KVB_DTYPE_F32 || b->ne[1] != 1 || b->ne[0] > INT32_MAX) {
        KVB_LOG_E("cuda bias_add: the bias must be an f32 vector");
        return KVB_ERR_INVALID;
    }
    return KVB_CUDA_CHECK(kvb_cuda_bias_add(y, c->dt, n, (int)b->ne[0], b->data, c->stream));
}

static kvb_status cu_silu_mul(void *ctx, const void *gate, const void *up, size_t n, void *out) {
    cuda_ctx *c = ctx;
    return KVB_CUDA_CHECK(kvb_cuda_silu_mul(gate, up, out, c->dt, n, c->stream));
}

static kvb_status check_batch(cuda_ctx *c, const kvb_attn_batch *b) {
    const kvb_kv_geom *g = b->geom;
    if (b->window < 0) return KVB_ERR_INVALID;
    if (g->elem_size != (int)kvb_dtype_size(c->dt)) {
        KVB_LOG_E("cuda attention: KV elements of %d bytes on a %s backend", g->elem_size, kvb_dtype_name(c->dt));
        return KVB_ERR_INVALID;
    }
    if (g->n_kv_heads <= 0 || b->n_heads % g->n_kv_heads || g->block_size <= 0) return KVB_ERR_INVALID;
    if (g->head_dim > KVB_CUDA_ATTN_MAX_HEAD_DIM || g->head_dim <= 0) {
        KVB_LOG_E("cuda attention: head_dim %d is above the supported %d", g->head_dim, KVB_CUDA_ATTN_MAX_HEAD_DIM);
        return KVB_ERR_UNSUPPORTED;
    }
    return KVB_OK;
}

/* The KV write's plan for batch b: c->slots[t] (compact slot of row t, -1: none) and c->blk[0..*nb)
 * the addresses of the blocks that receive rows (per sequence a contiguous run of its entries: only
 * they travel), checked for alignment. */
static kvb_status kv_plan(cuda_ctx *c, const kvb_attn_batch *b, size_t *nb_out) {
    int bs = b->geom->block_size;
    size_t n_blk = 0;
    for (int s = 0; s < b->n_seqs; s++) {
        const kvb_attn_seq *sq = &b->seqs[s];
        if (sq->q_len > 0) n_blk += (size_t)((sq->ctx_len - 1) / bs - (sq->ctx_len - sq->q_len) / bs + 1);
    }
    KVB_TRY(host_reserve((void **)&c->slots, &c->slots_cap, (size_t)b->n_tokens, sizeof *c->slots));
    KVB_TRY(host_reserve((void **)&c->blk, &c->blk_cap, KVB_MAX(n_blk, 1), sizeof *c->blk));
    for (int t = 0; t < b->n_tokens; t++) c->slots[t] = -1;
    size_t nb = 0;
    for (int s = 0; s < b->n_seqs; s++) {
        const kvb_attn_seq *sq = &b->seqs[s];
        if (sq->q_len <= 0) continue;
        int p0 = sq->ctx_len - sq->q_len, j0 = p0 / bs, j1 = (sq->ctx_len - 1) / bs;
        for (int j = j0; j <= j1; j++) c->blk[nb + (size_t)(j - j0)] = b->layer_blocks[sq->blk_first + j];
        for (int t = 0; t < sq->q_len; t++) {
            int p = p0 + t;
            c->slots[sq->q_start + t] = (int64_t)(nb + (size_t)(p / bs - j0)) * bs + p % bs;
        }
        nb += (size_t)(j1 - j0 + 1);
    }
    *nb_out = nb;
    return check_blocks_aligned(c->blk, nb, "kv_write");
}

static kvb_status cu_kv_write(void *ctx, const kvb_attn_batch *b, const void *k, const void *v) {
    cuda_ctx *c = ctx;
    KVB_TRY(check_batch(c, b));
    const kvb_kv_geom *g = b->geom;
    if (b->n_tokens <= 0) return KVB_OK;
    size_t nb = 0;
    KVB_TRY(kv_plan(c, b, &nb));
    const void *d_slots = NULL, *d_blk = NULL;
    meta_part parts[] = {{c->slots, (size_t)b->n_tokens * sizeof(int64_t), &d_slots},
                         {c->blk, nb * sizeof(void *), &d_blk}};
    KVB_TRY(upload(c, parts, 2));
    return KVB_CUDA_CHECK(kvb_cuda_kv_write(c->dt, (void *const *)d_blk, d_slots, b->n_tokens, g->block_size,
                                            g->n_kv_heads * g->head_dim, k, v, c->stream));
}

static kvb_status cu_qkv_finish(void *ctx, const kvb_attn_batch *b, const void *qkv, const kvb_tensor *bias,
                                const kvb_tensor *q_norm, const kvb_tensor *k_norm, float eps, const int32_t *pos,
                                const kvb_rope *rope, void *q_out) {
    cuda_ctx *c = ctx;
    KVB_TRY(check_batch(c, b));
    const kvb_kv_geom *g = b->geom;
    int hd = g->head_dim, nkv = g->n_kv_heads;
    if (b->n_tokens <= 0) return KVB_OK;
    if (rope->head_dim != hd) return KVB_ERR_INVALID;
    const kvb_tensor *vecs[] = {bias, q_norm, k_norm};
    int64_t want[] = {(int64_t)(b->n_heads + 2 * nkv) * hd, hd, hd};
    for (int i = 0; i < 3; i++)
        if (vecs[i] && (vecs[i]->dtype != KVB_DTYPE_F32 || vecs[i]->ne[0] * vecs[i]->ne[1] != want[i])) {
            KVB_LOG_E("cuda qkv_finish: vector %d must be %lld f32 values", i, (long long)want[i]);
            return KVB_ERR_INVALID;
        }
    size_t nb = 0;
    KVB_TRY(kv_plan(c, b, &nb));
    const void *d_slots = NULL, *d_blk = NULL, *d_pos = NULL, *d_freq = NULL;
    meta_part parts[] = {{c->slots, (size_t)b->n_tokens * sizeof(int64_t), &d_slots},
                         {c->blk, nb * sizeof(void *), &d_blk},
                         {pos, (size_t)b->n_tokens * sizeof(int32_t), &d_pos},
                         {rope->inv_freq, (size_t)(hd / 2) * sizeof(float), &d_freq}};
    KVB_TRY(upload(c, parts, 4));
    return KVB_CUDA_CHECK(kvb_cuda_qkv_rope_write(
        c->dt, qkv, b->n_tokens, b->n_heads, nkv, hd, bias ? bias->data : NULL, q_norm ? q_norm->data : NULL,
        k_norm ? k_norm->data : NULL, eps, d_pos, d_freq, q_out, (void *const *)d_blk, d_slots, g->block_size, c->stream));
}

/* The first key any query row of a decode-like sequence sees: 0, or with a sliding window the start of
 * its first row's window (later rows' windows start later; the kernel masks per row). */
static int decode_first_key(const kvb_attn_batch *b, const kvb_attn_seq *sq) {
    int first_vis = sq->ctx_len - sq->q_len + 1;
    return b->window > 0 && first_vis > b->window ? first_vis - b->window : 0;
}

/* The keys [*k0, *k1) a prefill tile of sequence sq whose first token is t0 sees (as the kernel does). */
static void prefill_tile_keys(const kvb_attn_batch *b, const kvb_attn_seq *sq, int t0, int tt, int *k0, int *k1) {
    int past = sq->ctx_len - sq->q_len;
    *k1 = past + KVB_MIN(t0 + tt, sq->q_len);
    *k0 = b->window > 0 && past + t0 + 1 > b->window ? past + t0 + 1 - b->window : 0;
}

static kvb_status cu_attention(void *ctx, const kvb_attn_batch *b, const void *q, void *out) {
    cuda_ctx *c = ctx;
    KVB_TRY(check_batch(c, b));
    const kvb_kv_geom *g = b->geom;
    int nkv = g->n_kv_heads, gq = b->n_heads / nkv, hd = g->head_dim;
    int pm = kvb_cuda_attn_prefill_rows(c->dt, hd, c->prefill_tile); /* rows of a prefill item */
    int nh = KVB_MIN(gq, pm), tt = pm / nh;
    int pre_tc = kvb_cuda_attention_prefill_tc(c->dt, hd);

    /* count the work: prefill tiles, and decode (sequence, KV head) pairs */
    size_t n_tiles = 0, n_dec_pairs = 0, n_blocks = 0;
    int dec_keys = 0, dec_rows = 1;
    for (int s = 0; s < b->n_seqs; s++) {
        const kvb_attn_seq *sq = &b->seqs[s];
        n_blocks = KVB_MAX(n_blocks, (size_t)sq->blk_first + (size_t)sq->n_blocks);
        if (sq->q_len <= 0) continue;
        if (sq->q_len * gq <= KVB_CUDA_ATTN_DECODE_ROWS) {
            n_dec_pairs += (size_t)nkv;
            dec_keys = KVB_MAX(dec_keys, sq->ctx_len - decode_first_key(b, sq));
            dec_rows = KVB_MAX(dec_rows, sq->q_len * gq);
        } else {
            n_tiles += (size_t)nkv * (size_t)KVB_DIV_CEIL(gq, nh) * (size_t)KVB_DIV_CEIL(sq->q_len, tt);
        }
    }
    /* split decode contexts into whole waves of resident blocks (attention.h), and (tensor cores)
     * prefill tiles' keys until about PREFILL_BLOCKS_PER_SM blocks a multiprocessor run */
    int splits_wanted = kvb_cuda_attn_decode_splits(c->dt, hd, dec_rows, c->n_sm, n_dec_pairs, dec_keys);
    size_t want_tiles = (size_t)PREFILL_BLOCKS_PER_SM * (size_t)c->n_sm;
    int pre_splits = pre_tc && n_tiles && n_tiles < want_tiles ? (int)KVB_DIV_CEIL(want_tiles, n_tiles) : 1;
    size_t n_pre = 0, n_dec = 0, n_groups = 0, part_rows = 0;
    for (int s = 0; s < b->n_seqs; s++) {
        const kvb_attn_seq *sq = &b->seqs[s];
        if (sq->q_len <= 0) continue;
        if (sq->q_len * gq > KVB_CUDA_ATTN_DECODE_ROWS) {
            size_t per_t = (size_t)nkv * (size_t)KVB_DIV_CEIL(gq, nh);
            for (int t0 = 0; t0 < sq->q_len; t0 += tt) {
                int k0, k1, ns = 1;
                prefill_tile_keys(b, sq, t0, tt, &k0, &k1);
                if (pre_splits > 1) {
                    int len = KVB_MAX(PREFILL_MIN_SPLIT, KVB_DIV_CEIL(k1 - k0, pre_splits));
                    ns = KVB_DIV_CEIL(k1 - k0, KVB_DIV_CEIL(len, 64) * 64);
                }
                n_pre += per_t * (size_t)ns;
                if (ns > 1) {
                    n_groups += per_t;
                    part_rows += per_t * (size_t)ns * (size_t)pm;
                }
            }
            continue;
        }
        int k0 = decode_first_key(b, sq), len = kvb_cuda_attn_decode_split_len(sq->ctx_len - k0, splits_wanted);
        int ns = KVB_DIV_CEIL(sq->ctx_len - k0, len);
        n_dec += (size_t)nkv * (size_t)ns;
        if (ns > 1) {
            n_groups += (size_t)nkv;
            part_rows += (size_t)nkv * (size_t)ns * KVB_CUDA_ATTN_DECODE_ROWS;
        }
    }
    KVB_TRY(host_reserve((void **)&c->pitems, &c->pitems_cap, KVB_MAX(n_pre, 1), sizeof *c->pitems));
    KVB_TRY(host_reserve((void **)&c->ditems, &c->ditems_cap, KVB_MAX(n_dec, 1), sizeof *c->ditems));
    KVB_TRY(host_reserve((void **)&c->groups, &c->groups_cap, KVB_MAX(n_groups, 1), sizeof *c->groups));
    size_t ip = 0, id = 0, ig = 0;
    int32_t prow = 0;
    for (int s = 0; s < b->n_seqs; s++) {
        const kvb_attn_seq *sq = &b->seqs[s];
        if (sq->q_len <= 0) continue;
        if (sq->q_len * gq > KVB_CUDA_ATTN_DECODE_ROWS) {
            /* longest tiles (latest tokens, most keys) first: they finish last otherwise */
            int n_t = KVB_DIV_CEIL(sq->q_len, tt);
            for (int ti = n_t - 1; ti >= 0; ti--) {
                int k0, k1, len = 0, ns = 1;
                prefill_tile_keys(b, sq, ti * tt, tt, &k0, &k1);
                if (pre_splits > 1) {
                    len = KVB_DIV_CEIL(KVB_MAX(PREFILL_MIN_SPLIT, KVB_DIV_CEIL(k1 - k0, pre_splits)), 64) * 64;
                    ns = KVB_DIV_CEIL(k1 - k0, len);
                }
                for (int kvh = 0; kvh < nkv; kvh++)
                    for (int h0 = 0; h0 < gq; h0 += nh) {
                        kvb_cuda_attn_prefill_item it = {.seq = s, .kvh = kvh, .t0 = ti * tt, .h0 = h0, .part = -1};
                        if (ns == 1) {
                            c->pitems[ip++] = it;
                            continue;
                        }
                        c->groups[ig] = (kvb_cuda_attn_group){.prow = prow, .n_parts = ns};
                        for (int p = 0; p < ns; p++) {
                            it.k_begin = k0 + p * len;
                            it.k_end = KVB_MIN(k1, k0 + (p + 1) * len);
                            it.part = p;
                            it.group = (int32_t)ig;
                            c->pitems[ip++] = it;
                        }
                        ig++;
                        prow += ns * pm;
                    }
            }
            continue;
        }
        int k0 = decode_first_key(b, sq), len = kvb_cuda_attn_decode_split_len(sq->ctx_len - k0, splits_wanted);
        int ns = KVB_DIV_CEIL(sq->ctx_len - k0, len);
        for (int kvh = 0; kvh < nkv; kvh++) {
            if (ns == 1) {
                c->ditems[id++] = (kvb_cuda_attn_decode_item){s, kvh, k0, sq->ctx_len, -1, 0};
                continue;
            }
            c->groups[ig] = (kvb_cuda_attn_group){.prow = prow, .n_parts = ns};
            for (int i = 0; i < ns; i++)
                c->ditems[id++] = (kvb_cuda_attn_decode_item){s, kvh, k0 + i * len, KVB_MIN(sq->ctx_len, k0 + (i + 1) * len),
                                                              i, (int32_t)ig};
            ig++;
            prow += ns * KVB_CUDA_ATTN_DECODE_ROWS;
        }
    }

    kvb_cuda_attn_args a = {
        .dtype = c->dt,
        .n_heads = b->n_heads,
        .n_kv_heads = nkv,
        .head_dim = hd,
        .block_size = g->block_size,
        .scale = b->scale,
        .window = b->window,
        .prefill_rows = pm,
        .decode_rows = dec_rows,
        .q = q,
        .out = out,
    };
    if (part_rows) {
        KVB_TRY(dev_reserve(c, (void **)&c->part, &c->part_cap, part_rows * ((size_t)hd + 1) * sizeof(float)));
        KVB_TRY(counters_reserve(c, n_groups));
        a.part_o = c->part;
        a.part_lse = c->part + part_rows * (size_t)hd;
        a.counters = c->counters;
    }
    KVB_TRY(check_blocks_aligned((const void *const *)b->layer_blocks, n_blocks, "attention"));
    const void *d_seqs = NULL, *d_blocks = NULL, *d_pre = NULL, *d_dec = NULL, *d_grp = NULL;
    meta_part parts[] = {{b->seqs, (size_t)b->n_seqs * sizeof(kvb_attn_seq), &d_seqs},
                         {b->layer_blocks, n_blocks * sizeof(void *), &d_blocks},
                         {c->pitems, ip * sizeof *c->pitems, &d_pre},
                         {c->ditems, id * sizeof *c->ditems, &d_dec},
                         {c->groups, ig * sizeof *c->groups, &d_grp}};
    KVB_TRY(upload(c, parts, (int)KVB_ARRAY_LEN(parts)));
    a.seqs = d_seqs;
    a.blocks = d_blocks;
    a.groups = d_grp;
    if (ip) {
        KVB_TRY(KVB_CUDA_CHECK(kvb_cuda_attention_prefill(&a, d_pre, (int)ip, c->stream)));
        c->n_prefill_items[pm == KVB_CUDA_ATTN_PREFILL_ROWS ? 0 : 1] += ip;
    }
    if (id) KVB_TRY(KVB_CUDA_CHECK(kvb_cuda_attention_decode(&a, d_dec, (int)id, c->stream)));
    return KVB_OK;
}

static void cu_set_threads(void *ctx, int n_threads) { /* the host side of this backend is one thread */ }

static void cu_destroy(void *ctx) {
    cuda_ctx *c = ctx;
    if (!c) return;
    if (c->stream) (void)KVB_CUDA_CHECK(cudaStreamSynchronize(c->stream));
    if (c->copy_stream) (void)KVB_CUDA_CHECK(cudaStreamSynchronize(c->copy_stream));
    if (c->h2d) (void)KVB_CUDA_CHECK(cudaStreamSynchronize(c->h2d));
    if (c->d2h) (void)KVB_CUDA_CHECK(cudaStreamSynchronize(c->d2h));
    for (int i = 0; i < TICKET_RING; i++)
        if (c->ring[i]) cudaEventDestroy(c->ring[i]);
    if (c->fence) cudaEventDestroy(c->fence);
    if (c->tk_mu_init) pthread_mutex_destroy(&c->tk_mu);
    if (c->blas) (void)KVB_CUBLAS_CHECK(blas_fn.destroy(c->blas));
    kvb_cuda_fp8_destroy(c->fp8);
    for (int i = 0; i < STAGE_SLOTS; i++) {
        if (c->stage[i].host) cudaFreeHost(c->stage[i].host);
        if (c->stage[i].done) cudaEventDestroy(c->stage[i].done);
    }
    void *dev[] = {c->blas_ws, c->meta, c->part, c->counters, c->f32buf, c->wtmp, c->scratch, c->tok};
    for (size_t i = 0; i < KVB_ARRAY_LEN(dev); i++)
        if (dev[i]) cudaFree(dev[i]);
    if (c->stream) cudaStreamDestroy(c->stream);
    if (c->copy_stream) cudaStreamDestroy(c->copy_stream);
    if (c->h2d) cudaStreamDestroy(c->h2d);
    if (c->d2h) cudaStreamDestroy(c->d2h);
    free(c->slots);
    free(c->blk);
    free(c->pitems);
    free(c->ditems);
    free(c->groups);
    free(c->cp);
    free(c->spans);
    free(c->b_dst);
    free(c->b_src);
    free(c->b_size);
    free(c);
}

/* A layer's rows per chunk in the forward pass: on an H200 the 8K prefill step took 102.9 ms in 512-row
 * chunks and 76.6 in 2048-row ones (0.41 -> 0.55 of the GEMM rate; docs/cuda.md, the second GPU run).
 * A chunk's buffers (q, the stacked q/k/v, the attention output, the stacked gate/up: 43,008 values a row
 * at Llama-3-8B's shape) are 176 MB in bf16, taken only by steps of more rows than 512. */
#define CUDA_CHUNK_ROWS 2048
#define CUDA_OPS                                                                                       \
    .to_device = cu_to_device, .to_host = cu_to_host, .to_host_f32 = cu_to_host_f32, .copy = cu_copy,          \
    .sync = cu_sync, .copy_async = cu_copy_async, .wait_ticket = cu_wait_ticket, .ticket_done = cu_ticket_done, \
    .ticket_wait = cu_ticket_wait, .weight_load = cu_weight_load, .weight_fp8 = cu_weight_fp8, .weight_free = cu_weight_free, .embed = cu_embed,          \
    .matmul = cu_matmul, .rmsnorm = cu_rmsnorm, .rope = cu_rope, .bias_add = cu_bias_add,                      \
    .silu_mul = cu_silu_mul, .kv_write = cu_kv_write, .attention = cu_attention, .gather_rows = cu_gather_rows, \
    .sample = cu_sample, .set_threads = cu_set_threads, .destroy = cu_destroy, .chunk_rows = CUDA_CHUNK_ROWS
/* bf16 and f16 run the fused layer (stacked q/k/v and gate/up, folded norm and SiLU-mul); f32, the
 * variant that must give the CPU backend's tokens, keeps its order of operations */
#define CUDA_FUSED                                                                                     \
    .weight_load_stacked = cu_weight_load_stacked, .matmul_norm = cu_matmul_norm,                      \
    .matmul_swiglu = cu_matmul_swiglu, .qkv_finish = cu_qkv_finish

static const kvb_backend_i cuda_bf16_iface = {.name = "cuda", .act_dtype = KVB_DTYPE_BF16, CUDA_OPS, CUDA_FUSED};
static const kvb_backend_i cuda_f16_iface = {.name = "cuda:f16", .act_dtype = KVB_DTYPE_F16, CUDA_OPS, CUDA_FUSED};
static const kvb_backend_i cuda_f32_iface = {.name = "cuda:f32", .act_dtype = KVB_DTYPE_F32, CUDA_OPS};

int kvb_cuda_backend_is(const kvb_backend *be) {
    return be && (be->iface == &cuda_bf16_iface || be->iface == &cuda_f16_iface || be->iface == &cuda_f32_iface);
}

kvb_cuda_stream_t kvb_cuda_backend_stream(const kvb_backend *be) {
    return kvb_cuda_backend_is(be) ? ((cuda_ctx *)be->ctx)->stream : NULL;
}

int kvb_cuda_backend_set_copy_batch(kvb_backend *be, int on) {
    if (!kvb_cuda_backend_is(be)) return 0;
    cuda_ctx *c = be->ctx;
    pthread_mutex_lock(&c->tk_mu);
    int was = c->batch_on;
    c->batch_on = on && HAVE_MEMCPY_BATCH;
    pthread_mutex_unlock(&c->tk_mu);
    return was;
}

int kvb_cuda_backend_set_prefill_tile(kvb_backend *be, int rows) {
    if (!kvb_cuda_backend_is(be) || (rows != KVB_CUDA_ATTN_PREFILL_ROWS && rows != KVB_CUDA_ATTN_PREFILL_ROWS_MAX))
        return 0;
    cuda_ctx *c = be->ctx;
    int was = c->prefill_tile;
    c->prefill_tile = rows;
    return was;
}

void kvb_cuda_backend_prefill_items(const kvb_backend *be, uint64_t out[2]) {
    out[0] = out[1] = 0;
    if (!kvb_cuda_backend_is(be)) return;
    const cuda_ctx *c = be->ctx;
    out[0] = c->n_prefill_items[0];
    out[1] = c->n_prefill_items[1];
}

void kvb_cuda_backend_copy_counts(const kvb_backend *be, kvb_cuda_copy_counts *out) {
    memset(out, 0, sizeof *out);
    if (!kvb_cuda_backend_is(be)) return;
    cuda_ctx *c = be->ctx;
    pthread_mutex_lock(&c->tk_mu);
    out->batched = c->n_batched;
    out->single = c->n_single;
    for (int e = 0; e < KVB_ENGINE_COUNT; e++) out->batch_failed += c->batch_failed[e];
    pthread_mutex_unlock(&c->tk_mu);
}

int kvb_cuda_backend_set_skinny(kvb_backend *be, int skinny) {
    if (!kvb_cuda_backend_is(be) || (skinny != KVB_CUDA_SKINNY_V1 && skinny != KVB_CUDA_SKINNY_V2)) return -1;
    cuda_ctx *c = be->ctx;
    int was = c->gemv.skinny;
    c->gemv.skinny = skinny;
    return was;
}

void kvb_cuda_backend_product_counts(const kvb_backend *be, kvb_cuda_product_counts *out) {
    memset(out, 0, sizeof *out);
    if (!kvb_cuda_backend_is(be)) return;
    const cuda_ctx *c = be->ctx;
    out->gemv = c->gemv.launched[KVB_CUDA_GEMV_K_GEMV];
    out->skinny_v1 = c->gemv.launched[KVB_CUDA_GEMV_K_SKINNY_V1];
    out->skinny_v2 = c->gemv.launched[KVB_CUDA_GEMV_K_SKINNY_V2];
    out->cublas = c->n_cublas;
}

kvb_status kvb_cuda_backend_info(const kvb_backend *be, kvb_cuda_device_info *out) {
    if (!kvb_cuda_backend_is(be)) return KVB_ERR_INVALID;
    const cuda_ctx *c = be->ctx;
    struct cudaDeviceProp p;
    KVB_TRY(KVB_CUDA_CHECK(cudaGetDeviceProperties(&p, c->device)));
    memset(out, 0, sizeof *out);
    snprintf(out->name, sizeof out->name, "%s", p.name);
    out->ordinal = c->device;
    out->cc_major = p.major;
    out->cc_minor = p.minor;
    out->n_sm = p.multiProcessorCount;
    out->l2_bytes = (size_t)p.l2CacheSize;
    KVB_TRY(KVB_CUDA_CHECK(cudaMemGetInfo(&out->mem_free, &out->mem_total)));
    return KVB_OK;
}

/* KVB_CUDA_PREFILL_TILE: the tensor-core prefill's rows a tile, 128 (unset: the default) or 64 (the A/B
 * of kvbank-bench cuda's attention rows); 0 for anything else. */
static int prefill_tile_env(const char *e) {
    if (!e || !*e || !strcmp(e, "128")) return KVB_CUDA_ATTN_PREFILL_ROWS_MAX;
    return strcmp(e, "64") ? 0 : KVB_CUDA_ATTN_PREFILL_ROWS;
}

kvb_status kvb__backend_cuda_create(const char *variant, int n_threads, kvb_backend *out) {
    const kvb_backend_i *iface;
    if (!variant || !*variant || !strcmp(variant, "bf16")) iface = &cuda_bf16_iface;
    else if (!strcmp(variant, "f16")) iface = &cuda_f16_iface;
    else if (!strcmp(variant, "f32")) iface = &cuda_f32_iface;
    else {
        KVB_LOG_E("backend cuda: unknown variant \"%.32s\" (cuda, cuda:bf16, cuda:f16, cuda:f32)", variant);
        return KVB_ERR_INVALID;
    }
    int n_dev = 0;
    char why[200];
    KVB_TRY(kvb_cuda_device_count(&n_dev, why, sizeof why));
    if (n_dev == 0) {
        KVB_LOG_E("no CUDA device: %s", why);
        return KVB_ERR_UNSUPPORTED;
    }
    cuda_ctx *c = NULL;
    KVB_TRY(kvb_calloc(1, sizeof *c, (void **)&c));
    kvb_status st;
    c->dt = iface->act_dtype;
    c->compute = c->dt == KVB_DTYPE_F32 ? CUBLAS_COMPUTE_32F_PEDANTIC : CUBLAS_COMPUTE_32F;
    KVB_TRY_GOTO(KVB_CUDA_CHECK(cudaGetDevice(&c->device)), fail);
    KVB_TRY_GOTO(KVB_CUDA_CHECK(cudaFree(NULL)), fail); /* creates the device's primary context now */
    KVB_TRY_GOTO(KVB_CUDA_CHECK(cudaDeviceGetAttribute(&c->n_sm, cudaDevAttrMultiProcessorCount, c->device)), fail);
    const char *sk = getenv("KVB_CUDA_SKINNY");
    c->gemv.skinny = kvb_cuda_skinny_parse(sk);
    c->gemv.n_sm = c->n_sm;
    if (c->gemv.skinny < 0) {
        KVB_LOG_E("KVB_CUDA_SKINNY=\"%.32s\": the 9-64-row product kernel is v2 (the default) or v1", sk);
        st = KVB_ERR_INVALID;
        goto fail;
    }
    const char *pt = getenv("KVB_CUDA_PREFILL_TILE");
    c->prefill_tile = prefill_tile_env(pt);
    if (!c->prefill_tile) {
        KVB_LOG_E("KVB_CUDA_PREFILL_TILE=\"%.32s\": the prefill's tensor-core tile is 128 rows (the default) or 64", pt);
        st = KVB_ERR_INVALID;
        goto fail;
    }
    KVB_TRY_GOTO(KVB_CUDA_CHECK(cudaStreamCreateWithFlags(&c->stream, cudaStreamNonBlocking)), fail);
    KVB_TRY_GOTO(KVB_CUDA_CHECK(cudaStreamCreateWithFlags(&c->copy_stream, cudaStreamNonBlocking)), fail);
    KVB_TRY_GOTO(KVB_CUDA_CHECK(cudaStreamCreateWithFlags(&c->h2d, cudaStreamNonBlocking)), fail);
    KVB_TRY_GOTO(KVB_CUDA_CHECK(cudaStreamCreateWithFlags(&c->d2h, cudaStreamNonBlocking)), fail);
    KVB_TRY_GOTO(KVB_CUDA_CHECK(cudaEventCreateWithFlags(&c->fence, cudaEventDisableTiming)), fail);
    for (int i = 0; i < TICKET_RING; i++)
        KVB_TRY_GOTO(KVB_CUDA_CHECK(cudaEventCreateWithFlags(&c->ring[i], cudaEventDisableTiming)), fail);
    if (pthread_mutex_init(&c->tk_mu, NULL)) {
        st = KVB_ERR_NOMEM;
        goto fail;
    }
    c->tk_mu_init = 1;
    c->batch_on = HAVE_MEMCPY_BATCH;
    for (int i = 0; i < STAGE_SLOTS; i++)
        KVB_TRY_GOTO(KVB_CUDA_CHECK(cudaEventCreateWithFlags(&c->stage[i].done, cudaEventDisableTiming)), fail);
    pthread_once(&blas_once, blas_load);
    KVB_TRY_GOTO(blas_loaded, fail);
    KVB_TRY_GOTO(KVB_CUBLAS_CHECK(blas_fn.create(&c->blas)), fail);
    KVB_TRY_GOTO(KVB_CUBLAS_CHECK(blas_fn.set_stream(c->blas, c->stream)), fail);
    KVB_TRY_GOTO(KVB_CUDA_CHECK(cudaMalloc(&c->blas_ws, BLAS_WORKSPACE_BYTES)), fail);
    KVB_TRY_GOTO(KVB_CUBLAS_CHECK(blas_fn.set_workspace(c->blas, c->blas_ws, BLAS_WORKSPACE_BYTES)), fail);
    KVB_TRY_GOTO(KVB_CUBLAS_CHECK(blas_fn.set_pointer_mode(c->blas, CUBLAS_POINTER_MODE_HOST)), fail);
    out->iface = iface;
    out->ctx = c;
    struct cudaDeviceProp p;
    if (cudaGetDeviceProperties(&p, c->device) == cudaSuccess)
        KVB_LOG_I("backend %s on device %d: %s (sm_%d%d, %d SMs)", iface->name, c->device, p.name, p.major, p.minor,
                  p.multiProcessorCount);
    return KVB_OK;
fail:
    cu_destroy(c);
    return st;
}
