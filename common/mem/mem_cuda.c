/* kvbank — the CUDA memory backend (mem.h) over the primitives of region_cuda.h: cudaMalloc for plain
 * memory, cudaHostAlloc for pinned memory, cudaMalloc + cudaIpcMemHandle_t for exportable regions, and
 * the driver's virtual memory: one cuMemCreate per physical chunk, cuMemAddressReserve for
 * reservations, cuMemMap + cuMemSetAccess to map a chunk and per-chunk cuMemUnmap (the range stays
 * reserved). Every call first makes the backend's device current on the calling thread, so a kvb_mem
 * may be used from any thread. Only built with CUDA; this file needs no CUDA header. */
#include <stdio.h>
#include <string.h>

#include "common/mem/mem_impl.h"
#include "common/mem/region_cuda.h"

typedef struct cuda_mem {
    int device;
    kvb_cuda_stream_t stream; /* non-blocking: kvb_mem_copy */
    size_t gran;              /* minimum VMM granularity, 0 until asked */
} cuda_mem;

typedef struct cuda_chunks {
    uint64_t *h;        /* [n] physical allocations (cuMemCreate) */
    int n;
} cuda_chunks;

#define ON_DEVICE(c) KVB_TRY(kvb_cuda_set_device(((cuda_mem *)(c))->device))

static kvb_status cu_alloc(void *ctx, size_t bytes, void **out) {
    ON_DEVICE(ctx);
    return kvb_cuda_malloc(bytes, out);
}

static void cu_free(void *ctx, void *p) {
    if (kvb_cuda_set_device(((cuda_mem *)ctx)->device) == KVB_OK) kvb_cuda_free(p);
}

static kvb_status cu_pinned_alloc(void *ctx, size_t bytes, void **out) {
    ON_DEVICE(ctx);
    return kvb_cuda_host_alloc(bytes, out);
}

static void cu_pinned_free(void *ctx, void *p) { kvb_cuda_host_free(p); }

static kvb_status cu_copy(void *ctx, void *dst, const void *src, size_t bytes) {
    cuda_mem *c = ctx;
    ON_DEVICE(c);
    KVB_TRY(kvb_cuda_copy_async(dst, src, bytes, c->stream));
    return kvb_cuda_stream_sync(c->stream);
}

/* ---------------------------------------------------------------------------------------- regions */

static kvb_status cu_region_create(void *ctx, const char *tag, size_t bytes, void **impl, void **base, char *handle) {
    ON_DEVICE(ctx);
    kvb_cuda_region *r = NULL;
    KVB_TRY(kvb_cuda_region_create(bytes, &r));
    *impl = r;
    *base = kvb_cuda_region_base(r);
    snprintf(handle, KVB_MEM_HANDLE_MAX, "%s", kvb_cuda_region_handle(r));
    return KVB_OK;
}

static kvb_status cu_region_import(void *ctx, const char *handle, size_t bytes, void **impl, void **base) {
    ON_DEVICE(ctx);
    kvb_cuda_region *r = NULL;
    KVB_TRY(kvb_cuda_region_import(handle, bytes, &r));
    *impl = r;
    *base = kvb_cuda_region_base(r);
    return KVB_OK;
}

static void cu_region_destroy(void *ctx, void *impl) {
    if (kvb_cuda_set_device(((cuda_mem *)ctx)->device) == KVB_OK) kvb_cuda_region_destroy(impl);
}

/* --------------------------------------------------------------------------------- virtual memory */

static kvb_status cu_granularity(void *ctx, size_t *out) {
    cuda_mem *c = ctx;
    if (!c->gran) {
        ON_DEVICE(c);
        KVB_TRY(kvb_cuda_vm_granularity(&c->gran));
    }
    *out = c->gran;
    return KVB_OK;
}

static void chunks_free(cuda_chunks *cc) {
    for (int i = 0; i < cc->n; i++) kvb_cuda_phys_release(cc->h[i]);
    free(cc->h);
    free(cc);
}

static kvb_status cu_chunks_create(void *ctx, size_t chunk_bytes, int n, void **impl) {
    ON_DEVICE(ctx);
    cuda_chunks *cc = NULL;
    KVB_TRY(kvb_calloc(1, sizeof *cc, (void **)&cc));
    kvb_status st = kvb_calloc((size_t)n, sizeof *cc->h, (void **)&cc->h);
    for (int i = 0; st == KVB_OK && i < n; i++) {
        st = kvb_cuda_phys_create(chunk_bytes, &cc->h[i]);
        if (st == KVB_OK) cc->n = i + 1;
    }
    if (st != KVB_OK) {
        KVB_LOG_E("mem cuda: creating %d chunks of %zu bytes stopped after %d", n, chunk_bytes, cc->n);
        chunks_free(cc);
        return st;
    }
    *impl = cc;
    return KVB_OK;
}

static void cu_chunks_destroy(void *ctx, void *impl) {
    if (kvb_cuda_set_device(((cuda_mem *)ctx)->device) == KVB_OK) chunks_free(impl);
}

static kvb_status cu_reserve(void *ctx, size_t bytes, void **base) {
    size_t g = 0;
    KVB_TRY(cu_granularity(ctx, &g));
    return kvb_cuda_va_reserve(bytes, g, base);
}

static void cu_release(void *ctx, void *base, size_t bytes) {
    if (kvb_cuda_set_device(((cuda_mem *)ctx)->device) == KVB_OK) kvb_cuda_va_free(base, bytes);
}

static kvb_status cu_map(void *ctx, void *at, size_t chunk_bytes, void *chunks, int i) {
    ON_DEVICE(ctx);
    return kvb_cuda_va_map(at, chunk_bytes, ((cuda_chunks *)chunks)->h[i]);
}

static kvb_status cu_unmap(void *ctx, void *at, size_t bytes) {
    ON_DEVICE(ctx);
    return kvb_cuda_va_unmap(at, bytes);
}

static void cu_destroy(void *ctx) {
    cuda_mem *c = ctx;
    if (!c) return;
    if (c->stream && kvb_cuda_set_device(c->device) == KVB_OK) kvb_cuda_stream_destroy(c->stream);
    free(c);
}

static const kvb_mem_i cuda_iface = {
    .kind = "cuda",
    .device_memory = 1,
    .alloc = cu_alloc,
    .free = cu_free,
    .pinned_alloc = cu_pinned_alloc,
    .pinned_free = cu_pinned_free,
    .copy = cu_copy,
    .region_create = cu_region_create,
    .region_import = cu_region_import,
    .region_destroy = cu_region_destroy,
    .granularity = cu_granularity,
    .chunks_create = cu_chunks_create,
    .chunks_destroy = cu_chunks_destroy,
    .reserve = cu_reserve,
    .release = cu_release,
    .map = cu_map,
    .unmap = cu_unmap,
    .destroy = cu_destroy,
};

int kvb__mem_cuda_probe(int device, char *why, size_t why_len) {
    int n = 0;
    char reason[200] = "";
    kvb_cuda_device_count(&n, reason, sizeof reason);
    if (n == 0) {
        if (why && why_len) snprintf(why, why_len, "no CUDA device: %s", reason[0] ? reason : "none found");
        return 0;
    }
    if (device >= n) {
        if (why && why_len) snprintf(why, why_len, "no CUDA device %d (this process sees %d)", device, n);
        return 0;
    }
    return 1;
}

kvb_status kvb__mem_cuda_create(int *device_io, const kvb_mem_i **iface, void **ctx) {
    int device = *device_io;
    char why[256];
    if (!kvb__mem_cuda_probe(device < 0 ? 0 : device, why, sizeof why)) {
        KVB_LOG_E("%s", why);
        return KVB_ERR_UNSUPPORTED;
    }
    cuda_mem *c = NULL;
    KVB_TRY(kvb_calloc(1, sizeof *c, (void **)&c));
    kvb_status st;
    if (device < 0) KVB_TRY_GOTO(kvb_cuda_get_device(&c->device), fail);
    else c->device = device;
    KVB_TRY_GOTO(kvb_cuda_set_device(c->device), fail);
    KVB_TRY_GOTO(kvb_cuda_stream_create(&c->stream), fail);
    *iface = &cuda_iface;
    *ctx = c;
    *device_io = c->device;
    return KVB_OK;
fail:
    cu_destroy(c);
    return st;
}
